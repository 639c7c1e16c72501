"""Fused selective-scan forward in Triton: one pass over the inputs, the state stays on chip.

Layers: ``_selective_scan_fwd_kernel`` (the jit kernel), ``scan_fwd_config`` (the tile
heuristic), ``selective_scan_fwd`` (the launcher; ``selective_scan_fwd_launch`` also takes
the dt projection, for ``ssm::fused_mamba_scan``'s dt level, and returns the compiled kernel).
The op layer (``op.py``) validates inputs and turns 3-D B/C into the grouped 4-D layout before
calling the launcher.

Work decomposition ("three levels of parallelism"):

1. Across programs: one program per (block of ``BLOCK_D`` channels, batch row, time segment).
2. Inside a program: the segment is walked in chunks of ``CHUNK_T`` timesteps; the state
   ``h`` (BLOCK_D x N, fp32) is the carry from one chunk to the next and never leaves
   registers. Each chunk is a register tile of steps (a, b) = (exp(delta*A), delta*B*u),
   prefix-combined along time with ``tl.associative_scan``. The tile's axes are ordered so
   that each thread owns a run of consecutive timesteps: Triton lowers that scan as a serial
   chain in registers, with no shuffles (see the kernel and ``scan_fwd_config``).
3. Across segments (only when batch * dim is too small to fill the GPU): a first launch of
   the same kernel reduces every segment but the last to its composite step (A_seg, B_seg);
   the second launch runs every segment and writes y, each program first walking the
   composites before its segment (at most ``MAX_SEGMENTS - 1`` steps per state element) to
   its carry. Two launches, not three: the serial carry walk is folded into the programs
   that need it (host launch cost dominates at short L, see benchmarks/NOTES_scan_fwd.md).

No (batch, dim, L, N) tensor is ever written: the only workspace is the segment composites,
2 * (segments - 1) * batch * dim * N fp32.
"""
import contextlib
import functools
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..layout import dim_innermost, empty_activation
from ..triton_common import (LOG2E, dt_dot_meta, finite_decay_rate, launcher, linear_combine, neg_zero, num_sms,
                             project_dt, silu, softplus)

# Registers per thread that let 3 programs of 4 warps share an SM's 64K registers (see
# scan_fwd_config): 65536 / (3 * 128) = 170.7, rounded down to ptxas's allocation granule of 8.
_OCCUPANCY_REGS_3X4 = 168

# Widest lane axis whose readout sum is done by halving (_sum_lanes); wider ones use tl.sum.
_HALVE_MAX_LANES = tl.constexpr(8)

# Upper bound on the time split: the carry pass is serial in the segment index, and every
# segment but the last costs its exps twice (once for its composite, once for y).
MAX_SEGMENTS = 8


class ScanFwdConfig(NamedTuple):
    """Tile choices of the forward kernel (see ``scan_fwd_config``)."""

    block_d: int  # channels per program
    chunk_t: int  # timesteps per inner-loop iteration, all held by one thread
    lanes_n: int  # lanes of a warp spread over the state dim; the rest of N is per thread
    num_warps: int
    n_segments: int  # time-parallel split of L across programs; 1 = no split
    # Per-thread register cap handed to ptxas (Triton's ``maxnreg``); None = ptxas's choice.
    max_registers: Optional[int] = None
    prefetch: int = 1  # chunks whose loads are in flight while one is computed (1 or 2)


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    # Not triton.cdiv: that one is a jit-callable and costs ~1 µs per host-side call.
    return -(-a // b)


@functools.lru_cache(maxsize=1024)  # a pure function of its arguments, called on every launch
def scan_fwd_config(
    batch: int, dim: int, L: int, N: int, dims_per_group: int, num_sms: int,
    channel_innermost: bool = False, half_precision: bool = False,
) -> ScanFwdConfig:
    """Choose tiles for ``(batch, dim, L, N)`` on a GPU with ``num_sms`` SMs.

    ``channel_innermost``: u, delta and z have unit stride along dim (nn.Linear-based Mamba
    code, e.g. HF's, holds them as (batch, L, dim) in memory); ``half_precision``: they are
    16-bit. The two only change ``prefetch``.

    The register tile of a chunk is [chunk_t, N / lanes_n, block_d, lanes_n]; a thread owns
    ``chunk_t`` consecutive timesteps of ``N / lanes_n`` states of one channel. Reasoning
    (numbers for an H200; see benchmarks/NOTES_scan_fwd.md):

    * Time entirely inside a thread makes the scan a serial chain of FMAs with no shuffles
      (with time across lanes Triton's scan costs ~5 shuffle levels per element).
    * The readout y = sum_n C*h reduces over N: in registers for the N / lanes_n part, and
      across the lanes_n lanes through one shared-memory round trip that also lays y out for
      its store (``_sum_lanes``; log2(lanes_n) shuffles per (t, d) from 16 lanes). lanes_n =
      N / 4 (at least 4 lanes when N >= 4) gives batch * dim * lanes_n threads of parallelism.
    * Registers: for N = 16 (Mamba's default; lanes_n = 4) chunk_t = 16, a 64-element tile
      per thread: 151-168 registers since run 18's readout (145-165 after run 17's joined
      layout conversions, ~170 before),
      no spills on sm_90 (checked with ptxas), 3 programs of 4 warps per SM. 16 timesteps
      make each channel row a 64 B (fp32) / 32 B (bf16) vector load, and one chunk in
      flight per program is ~6 KB, which occupancy multiplies towards the ~25 KB per SM that
      HBM latency needs. Other N get a 32-element tile (chunk_t <= 8):
      the 64-element tile reaches 210-250 registers there (larger B/C tiles for lanes_n >= 16,
      [chunk_t, block_d] tiles shared by fewer lanes for N <= 2).
    * block_d = (32 / lanes_n) * num_warps: one channel per lane group, no replication. It must
      not straddle a B/C group (one (N, chunk_t) tile of B and C serves the program).
    * n_segments: split time only when the programs cannot give every SM ~8 warps, and only
      while each segment keeps >= 16 chunks: the split costs one extra exp per element of
      every segment but the last.
    * A grid that still has fewer programs than SMs (short L, batch 1) gets narrower programs
      (fewer warps, smaller block_d), so the work spreads over more SMs.
    * max_registers: the 16-step, 4-warp tile (N <= 16) is capped at 168 registers, which is
      what 3 programs of 4 warps per SM allow (65536 / (3 * 128) rounded down to ptxas's
      granule of 8). Uncapped, ptxas lands anywhere in 164-182 depending on the flags (Triton
      3.6, sm_90: fp32 without last_state 180, fp32 time-split output pass 182, bf16 168),
      and above 168 only 2 programs fit per SM: the fp32 forward at batch 8 ran 1.5x slower
      (0.259 -> 0.389 ms) from nothing but that. At 168 the unsplit loop is unchanged (691
      instructions, no local memory); the fp32 split pass reloads 16 B per chunk from L1.
      The cap stays a ceiling now that ptxas needs less: 128 (4 programs per SM) fits
      without spills but ran slower at batch 8 (384 programs fill 3 per SM anyway). It also
      steers ptxas's schedule: uncapped, Triton 3.6 compiles the bf16 HF-layout tile to 133
      registers and it runs 7.8 % slower (0.2434 against 0.2258 ms), and the fp32 one to the
      same 163 registers, 1.6 % slower (run 26).
      Narrower programs (1-2 warps) are only chosen when programs < SMs, where occupancy
      does not matter and a cap would only add spills (1 warp: 236 regs uncapped).
    * prefetch: on (batch, dim, L) activations the capped 4-warp tile keeps two chunks of loads
      in flight (measured 6 % faster in fp32, 1.5 % in bf16, equal at batch 1; ~3 % more
      instructions, no extra registers). By Little's law one chunk should already cover HBM
      latency at 3 programs per SM, so the gain is latency hiding of the dependent chunk loop,
      not bandwidth. On channel-innermost activations the same second chunk costs time instead
      (H200, run 16, batch 8, L=2048: bf16 0.275 against 0.257 ms, fp32 0.281 against 0.269;
      batch 1 equal or 2 µs slower; not profiled: a chunk is then 16 rows of 32 channels
      instead of 32 rows of 16 steps). That is the layout of HF's model, so its end-to-end
      forward takes prefetch 1. Since run 17's joined layout conversions (fewer registers,
      fewer barriers) that holds for 16-bit activations only: fp32 ones run 0.248 ms with two
      chunks against 0.263 with one (bf16: 0.249 against 0.244). Other tiles keep 1.

    A register-budget / occupancy model can replace these constants: the kernel accepts any
    power-of-two block_d, chunk_t, lanes_n.
    """
    block_n = _next_pow2(N)
    lanes_n = min(block_n, max(4, min(32, block_n // 4)))
    per_thread_n = block_n // lanes_n
    chunk_t = 16 if lanes_n == 4 else min(8, 32 // per_thread_n)
    chunk_t = max(1, min(chunk_t, _next_pow2(L)))
    num_warps = 4
    block_d = (32 // lanes_n) * num_warps
    block_d = min(block_d, max(1, _next_pow2(dim)))
    if dims_per_group != dim:
        # Largest power of two that divides dims_per_group (x & -x isolates the lowest set bit).
        block_d = min(block_d, dims_per_group & -dims_per_group)
    num_warps = max(1, min(num_warps, block_d * lanes_n // 32))
    warps = batch * _cdiv(dim, block_d) * num_warps
    n_segments = 1
    n_chunks = _cdiv(L, chunk_t)
    while (
        n_segments < MAX_SEGMENTS
        and warps * n_segments < 8 * num_sms
        and n_chunks // (2 * n_segments) >= 16
    ):
        n_segments *= 2
    while num_warps > 1 and batch * _cdiv(dim, block_d) * n_segments < num_sms:
        num_warps //= 2
        block_d //= 2
    max_registers, prefetch = None, 1
    if lanes_n == 4 and chunk_t == 16 and num_warps == 4:
        # Measured on the H200 (bench_scan.py --sweep-named [--layout hf], RESULTS.md): on
        # (batch, dim, L) activations two chunks of loads in flight run 0.251 instead of 0.266 ms
        # (fp32) and 0.259 instead of 0.263 ms (bf16) at batch 8, L=2048; on channel-innermost
        # 16-bit ones one chunk is faster (see the docstring).
        prefetch = 1 if channel_innermost and half_precision else 2
        max_registers = _OCCUPANCY_REGS_3X4
    return ScanFwdConfig(block_d, chunk_t, lanes_n, num_warps, n_segments, max_registers, prefetch)


@triton.jit
def _last_step(x, CHUNK_T: tl.constexpr):
    """x[CHUNK_T - 1] of a chunk tile [CHUNK_T, ...4-D]: the state after the chunk.

    A masked sum, not a "keep the right operand" tl.reduce: Triton's cross-lane reductions
    combine butterfly partners in either order (they assume a commutative combine), and time
    does span lanes when a program is narrow (block_d * lanes_n < 32). -0.0 is the exact
    identity of +, so with time inside one thread this folds to a register read.
    """
    is_last = (tl.arange(0, CHUNK_T) == CHUNK_T - 1)[:, None, None, None]
    return tl.sum(tl.where(is_last, x, neg_zero()), axis=0)


@triton.jit
def _sum_lanes(part, LANES_N: tl.constexpr):
    """The readout's sum over the lane axis of [CHUNK_T, BLOCK_D, LANES_N] partial sums.

    Up to 8 lanes, by halving: ``tl.split`` needs its size-2 axis inside each thread, so Triton
    moves the partial sums through shared memory once, into a layout that holds a (t, d) pair's
    lanes in one thread and is also the y store's layout. The cross-lane sum becomes register
    adds and the y tile's own conversion for the store disappears (sm_90, bf16, HF's layout,
    N = 16: 710 -> 646 loop instructions, 32 -> 0 SHFL, the same 6 barriers, 145 -> 153
    registers). ``tl.sum`` shuffles log2(LANES_N) times per (t, d) and then converts y.
    Measured (H200, run 18, batch 8, L=2048, N = 16, median of 5 CUDA-graph timings): bf16 on
    HF's layout 0.2446 -> 0.2265 ms, fp32 0.2479 -> 0.2344, bf16 (batch, dim, L) 0.2590 ->
    0.2452, bf16 batch 1 0.0573 -> 0.0552. From 16 lanes (N >= 64) halving costs 30-35
    registers more (123 -> 156 at N = 64), a program fewer per SM, so those keep ``tl.sum``
    (not measured).
    """
    if LANES_N == 1 or LANES_N > _HALVE_MAX_LANES:
        y = tl.sum(part, axis=2)
    else:
        if LANES_N >= 8:
            part = _halve_lanes(part)
        if LANES_N >= 4:
            part = _halve_lanes(part)
        even, odd = tl.split(part)
        y = even + odd
    return y


@triton.jit
def _halve_lanes(part):
    """[T, D, K] -> [T, D, K / 2]: adds lane-axis neighbours (2j, 2j + 1)."""
    a, b = tl.split(tl.reshape(part, [part.shape[0], part.shape[1], part.shape[2] // 2, 2]))
    return a + b


@triton.jit
def _state_tile(pid_d, dim, N, dims_per_group, BLOCK_D: tl.constexpr, N_PER_THREAD: tl.constexpr,
                LANES_N: tl.constexpr):
    """Indices of program ``pid_d``'s [N_PER_THREAD, BLOCK_D, LANES_N] state tile (state
    n = i * LANES_N + j): channels and states with their masks, their 3-D broadcasts, and the
    B/C group of the channel block (the heuristics keep a block inside one group)."""
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_bn = tl.arange(0, N_PER_THREAD)[:, None] * LANES_N + tl.arange(0, LANES_N)[None, :]
    mask_d = offs_d < dim
    mask_bn = offs_bn < N
    offs_n3 = offs_bn[:, None, :]  # [N_PER_THREAD, 1, LANES_N]
    offs_d3 = offs_d[None, :, None]  # [1, BLOCK_D, 1]
    mask_dn = mask_bn[:, None, :] & mask_d[None, :, None]  # [N_PER_THREAD, BLOCK_D, LANES_N]
    return offs_d, offs_bn, mask_d, mask_bn, offs_n3, offs_d3, mask_dn, (pid_d * BLOCK_D) // dims_per_group


@triton.jit
def _load_chunk(
    u_ptr, delta_ptr, z_ptr, B_ptr, C_ptr,
    offs_d, offs_t, offs_bn, mask_d, mask_bn, t_end,
    stride_u_d, stride_u_l, stride_delta_d, stride_delta_l, stride_z_d, stride_z_l,
    stride_B_n, stride_B_l, stride_C_n, stride_C_l, dt_rank,
    NEED_Z: tl.constexpr, NEED_C: tl.constexpr, DT_RANK_PAD: tl.constexpr,
):
    """Raw (un-converted) tiles of one chunk: u, delta, z as [CHUNK_T, BLOCK_D]; B, C as
    [CHUNK_T, N_PER_THREAD, LANES_N]; with the dt projection fused (DT_RANK_PAD > 0) delta
    is the dt_low tile [CHUNK_T, DT_RANK_PAD] (its ``d`` stride walks the rank). Out-of-range
    elements load as 0; the caller turns those steps into the identity."""
    mask_t = offs_t < t_end
    mask_td = mask_t[:, None] & mask_d[None, :]
    mask_tn = mask_t[:, None, None] & mask_bn[None, :, :]
    u = tl.load(u_ptr + offs_t[:, None] * stride_u_l + offs_d[None, :] * stride_u_d,
                mask=mask_td, other=0.0)
    if DT_RANK_PAD > 0:
        offs_r = tl.arange(0, DT_RANK_PAD)
        delta = tl.load(delta_ptr + offs_t[:, None] * stride_delta_l + offs_r[None, :] * stride_delta_d,
                        mask=mask_t[:, None] & (offs_r < dt_rank)[None, :], other=0.0)
    else:
        delta = tl.load(delta_ptr + offs_t[:, None] * stride_delta_l + offs_d[None, :] * stride_delta_d,
                        mask=mask_td, other=0.0)
    Bt = tl.load(B_ptr + offs_t[:, None, None] * stride_B_l + offs_bn[None, :, :] * stride_B_n,
                 mask=mask_tn, other=0.0)
    if NEED_Z:
        z = tl.load(z_ptr + offs_t[:, None] * stride_z_l + offs_d[None, :] * stride_z_d,
                    mask=mask_td, other=0.0)
    else:
        z = u
    if NEED_C:
        Ct = tl.load(C_ptr + offs_t[:, None, None] * stride_C_l + offs_bn[None, :, :] * stride_C_n,
                     mask=mask_tn, other=0.0)
    else:
        Ct = Bt
    return u, delta, z, Bt, Ct


# The HAS_* flags are passed by the launcher rather than through @triton.heuristics: the
# heuristics wrapper rebuilds a dict of all ~60 arguments once per flag on every launch, which
# was a measurable part of the per-call host cost (benchmarks/host_overhead_scan.py).
@triton.jit
def _selective_scan_fwd_kernel(
    # pointers
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, delta_bias_ptr, h0_ptr,
    y_ptr, last_ptr, seg_a_ptr, seg_b_ptr, dt_w_ptr,
    # sizes
    batch, dim, L, N, dims_per_group, seg_len, dt_rank,
    # strides
    stride_u_b, stride_u_d, stride_u_l,
    stride_delta_b, stride_delta_d, stride_delta_l,
    stride_A_d, stride_A_n,
    stride_B_b, stride_B_g, stride_B_n, stride_B_l,
    stride_C_b, stride_C_g, stride_C_n, stride_C_l,
    stride_D, stride_delta_bias,
    stride_z_b, stride_z_d, stride_z_l,
    stride_h0_b, stride_h0_d, stride_h0_n,
    stride_y_b, stride_y_d, stride_y_l,
    stride_dtw_d, stride_dtw_r,
    # meta-parameters
    BLOCK_D: tl.constexpr, CHUNK_T: tl.constexpr,
    N_PER_THREAD: tl.constexpr, LANES_N: tl.constexpr,  # N_PER_THREAD * LANES_N = next_pow2(N)
    SEGMENT_TOTALS: tl.constexpr,  # True: first launch of a time split (composites only)
    DELTA_SOFTPLUS: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DELTA_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_LAST: tl.constexpr, TIME_SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,  # chunks loaded ahead of the one being computed: 1 or 2
    # > 0: the dt projection is fused. delta_ptr is dt_low (batch, R, L), dt_w_ptr W_dt (dim, R),
    # and each chunk's delta is a [CHUNK_T, R] x [R, BLOCK_D] tensor-core product, R padded to
    # this power of two; DOT_PRECISION is tl.dot's input_precision for it.
    DT_RANK_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    N_RAGGED: tl.constexpr = False,  # N < N_PER_THREAD * LANES_N: padded state lanes exist
):
    # Every per-element tile is 4-D [CHUNK_T, N_PER_THREAD, BLOCK_D, LANES_N]. Triton's default
    # layout hands the lanes to the fastest dims first (LANES_N, then BLOCK_D) and the warps to
    # BLOCK_D, so time and N_PER_THREAD stay inside each thread: the scan over axis 0 is serial
    # in registers and the readout over axis 1 is register adds. Do not reorder the axes.
    pid_d = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2)

    offs_d, offs_bn, mask_d, mask_bn, offs_n3, offs_d3, mask_dn, pid_g = _state_tile(
        pid_d, dim, N, dims_per_group, BLOCK_D, N_PER_THREAD, LANES_N)

    u_ptr += pid_b * stride_u_b
    delta_ptr += pid_b * stride_delta_b
    if HAS_Z:
        z_ptr += pid_b * stride_z_b
    y_ptr += pid_b * stride_y_b
    B_ptr += pid_b * stride_B_b + pid_g * stride_B_g
    C_ptr += pid_b * stride_C_b + pid_g * stride_C_g

    # exp(delta * A) == exp2(delta * (A * log2(e))): fold the constant once so the inner loop
    # issues a single MUFU ex2 per element. Padded n get A = 0 -> a = 1, and B = 0 -> b = 0.
    A = tl.load(A_ptr + offs_d3 * stride_A_d + offs_n3 * stride_A_n, mask=mask_dn,
                other=0.0).to(tl.float32) * LOG2E  # [N_PER_THREAD, BLOCK_D, LANES_N]
    A = finite_decay_rate(A)
    if HAS_DELTA_BIAS:
        delta_bias = tl.load(delta_bias_ptr + offs_d * stride_delta_bias, mask=mask_d,
                             other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d * stride_D, mask=mask_d, other=0.0).to(tl.float32)
    if DT_RANK_PAD > 0:
        # W_dt^T for the program's channels, [R, BLOCK_D], loaded once: a few registers per
        # thread (R = 48 -> 64 rows x 32 channels of 16-bit over 128 threads), in dt_low's dtype
        # as the split path's matmul casts it.
        offs_r = tl.arange(0, DT_RANK_PAD)
        w_dt = tl.load(dt_w_ptr + offs_r[:, None] * stride_dtw_r + offs_d[None, :] * stride_dtw_d,
                       mask=(offs_r < dt_rank)[:, None] & mask_d[None, :],
                       other=0.0).to(delta_ptr.dtype.element_ty)

    # States (segment composites, last_state) are contiguous [batch, dim, N] fp32 slabs.
    offs_state = (pid_b * dim + offs_d3) * N + offs_n3  # [N_PER_THREAD, BLOCK_D, LANES_N]
    seg_stride = batch * dim * N

    t_start = pid_s * seg_len
    t_end = tl.minimum(t_start + seg_len, L)

    if SEGMENT_TOTALS:
        # The composite of a segment is (A_seg, B_seg) = (prod_t exp(dt_t*A), the state reached
        # from h = 0). A is constant in time, so A_seg = exp(A * sum_t dt_t): a running sum of
        # dt per channel replaces a product chain per (d, n) element.
        h = tl.zeros((N_PER_THREAD, BLOCK_D, LANES_N), tl.float32)
        dt_sum = tl.zeros((BLOCK_D,), tl.float32)
    else:
        if HAS_INIT:
            h = tl.load(h0_ptr + pid_b * stride_h0_b + offs_d3 * stride_h0_d
                        + offs_n3 * stride_h0_n, mask=mask_dn, other=0.0).to(tl.float32)
        else:
            h = tl.zeros((N_PER_THREAD, BLOCK_D, LANES_N), tl.float32)
        if TIME_SPLIT:
            # Segment s starts from h_s = A_{s-1} * h_{s-1} + B_{s-1}, with h_0 the initial
            # state and (A_j, B_j) the composites of the first launch. Every program walks its
            # own prefix (at most MAX_SEGMENTS - 1 tile-sized steps) instead of a separate
            # carry launch: the walk is tiny next to the segment, a launch is not.
            for j in range(0, pid_s):
                seg_a = tl.load(seg_a_ptr + j * seg_stride + offs_state, mask=mask_dn, other=1.0)
                seg_b = tl.load(seg_b_ptr + j * seg_stride + offs_state, mask=mask_dn, other=0.0)
                h = seg_a * h + seg_b
        # Route the start state through a chunk-shaped tile so that it enters the loop in the
        # chunk tile's layout. A carry that starts as a plain load keeps the load's layout: a
        # shared-memory round trip of h every chunk and ~40 more registers (ptxas, sm_90).
        h = _last_step(tl.broadcast_to(h[None, :, :, :],
                                       (CHUNK_T, N_PER_THREAD, BLOCK_D, LANES_N)), CHUNK_T)

    # Software prefetch: the loads of the chunk PREFETCH chunks ahead are issued before this
    # chunk's arithmetic, so their latency hides behind the scan even at low occupancy
    # (batch 1). PREFETCH = 2 doubles the bytes in flight per program for one more set of
    # raw tiles in registers (for when HBM latency, not issue, bounds the loop).
    u, delta, z, Bt, Ct = _load_chunk(
        u_ptr, delta_ptr, z_ptr, B_ptr, C_ptr,
        offs_d, t_start + tl.arange(0, CHUNK_T), offs_bn, mask_d, mask_bn, t_end,
        stride_u_d, stride_u_l, stride_delta_d, stride_delta_l, stride_z_d, stride_z_l,
        stride_B_n, stride_B_l, stride_C_n, stride_C_l, dt_rank,
        # The first launch of a time split needs neither the gate (z) nor the readout (C).
        HAS_Z and not SEGMENT_TOTALS, not SEGMENT_TOTALS, DT_RANK_PAD)
    if PREFETCH == 2:
        u2, delta2, z2, Bt2, Ct2 = _load_chunk(
            u_ptr, delta_ptr, z_ptr, B_ptr, C_ptr,
            offs_d, t_start + CHUNK_T + tl.arange(0, CHUNK_T), offs_bn, mask_d, mask_bn, t_end,
            stride_u_d, stride_u_l, stride_delta_d, stride_delta_l, stride_z_d, stride_z_l,
            stride_B_n, stride_B_l, stride_C_n, stride_C_l, dt_rank,
            HAS_Z and not SEGMENT_TOTALS, not SEGMENT_TOTALS, DT_RANK_PAD)
    for t0 in range(t_start, t_end, CHUNK_T):
        offs_t = t0 + tl.arange(0, CHUNK_T)
        mask_t = offs_t < t_end
        nxt = _load_chunk(
            u_ptr, delta_ptr, z_ptr, B_ptr, C_ptr,
            offs_d, offs_t + PREFETCH * CHUNK_T, offs_bn, mask_d, mask_bn, t_end,
            stride_u_d, stride_u_l, stride_delta_d, stride_delta_l, stride_z_d, stride_z_l,
            stride_B_n, stride_B_l, stride_C_n, stride_C_l, dt_rank,
            HAS_Z and not SEGMENT_TOTALS, not SEGMENT_TOTALS, DT_RANK_PAD)

        uf = u.to(tl.float32)
        if DT_RANK_PAD > 0:
            dt = project_dt(delta, w_dt, DOT_PRECISION)
        else:
            dt = delta.to(tl.float32)  # [CHUNK_T, BLOCK_D]
        if HAS_DELTA_BIAS:
            dt += delta_bias[None, :]
        if DELTA_SOFTPLUS:
            dt = softplus(dt)
        # Padded timesteps (ragged tail) must be the identity step (1, 0): dt = 0 gives
        # a = exp2(0) = 1 and b = 0 whatever softplus(bias) would have been, so nothing leaks
        # into the carry or the last state. (B and C load as 0 there.)
        dt = tl.where(mask_t[:, None], dt, 0.0)
        dtu = dt * uf

        # The (t, d) values and the B/C tiles reach the chunk layout [CHUNK_T, N_PER_THREAD,
        # BLOCK_D, LANES_N] through shared memory. Joining the pairs that travel together makes
        # that two layout conversions instead of four, i.e. two round trips and barrier pairs
        # fewer per chunk (H200, run 17, batch 8, L=2048, HF's layout: bf16 0.2575 -> 0.2431
        # ms, fp32 0.2689 -> 0.2479 with scan_fwd_config's prefetch 2 for it). The join also
        # pins each conversion after the widening casts, where the earlier code needed
        # where()-guards to stop Triton from converting the 16-bit loads and then redoing the
        # (t, d) math and the widening on every lane.
        dt4, dtu4 = tl.split(tl.join(dt, dtu)[:, None, :, None, :])
        if SEGMENT_TOTALS:  # no readout, no C
            B4 = Bt.to(tl.float32)[:, :, None, :]
        else:
            B4, C4 = tl.split(tl.join(Bt.to(tl.float32), Ct.to(tl.float32))[:, :, None, :, :])
        a = tl.exp2(dt4 * A[None, :, :, :])
        b = dtu4 * B4

        # Put the carry into the first step (b_0 <- a_0 * h + b_0) instead of applying it to
        # every prefix afterwards: the scanned b is then the state itself, and only the b half
        # of the combine is live, so the a products fold away.
        is_first = (tl.arange(0, CHUNK_T) == 0)[:, None, None, None]
        b = tl.where(is_first, a * h[None, :, :, :] + b, b)
        _, hs = tl.associative_scan((a, b), 0, linear_combine)  # the states h_t
        h = _last_step(hs, CHUNK_T)
        if SEGMENT_TOTALS:
            dt_sum += tl.sum(dt, axis=0)
        else:
            # Sum the per-thread states first (register adds), then the lanes' partial sums.
            prod = hs * C4
            if N_RAGGED:
                # A padded lane's state is (+-inf) * 0 = NaN where dt * u is infinite; it must not
                # reach y (the lane's C is 0, but NaN * 0 is NaN).
                prod = tl.where(mask_bn[None, :, None, :], prod, 0.0)
            part = tl.sum(prod, axis=1)  # [CHUNK_T, BLOCK_D, LANES_N]
            y = _sum_lanes(part, LANES_N)
            if HAS_D:
                y += Dv[None, :] * uf
            if HAS_Z:
                y *= silu(z.to(tl.float32))
            tl.store(y_ptr + offs_t[:, None] * stride_y_l + offs_d[None, :] * stride_y_d,
                     y.to(y_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_d[None, :])
        if PREFETCH == 2:
            u, delta, z, Bt, Ct = u2, delta2, z2, Bt2, Ct2
            u2, delta2, z2, Bt2, Ct2 = nxt
        else:
            u, delta, z, Bt, Ct = nxt

    if SEGMENT_TOTALS:
        seg_a = tl.exp2(A * dt_sum[None, :, None])
        tl.store(seg_a_ptr + pid_s * seg_stride + offs_state, seg_a, mask=mask_dn)
        tl.store(seg_b_ptr + pid_s * seg_stride + offs_state, h, mask=mask_dn)
    elif STORE_LAST:
        # Only the program of the final segment owns the final state.
        if pid_s == tl.num_programs(2) - 1:
            tl.store(last_ptr + offs_state, h, mask=mask_dn)


class _LaunchPlan(NamedTuple):
    """Everything about a launch that depends only on the problem's sizes and the config."""

    grid_totals: Tuple[int, int, int]  # first launch of a time split (unused when unsplit)
    grid: Tuple[int, int, int]  # the output launch
    seg_len: int
    n_segments: int
    n_per_thread: int
    lanes_n: int


def check_block_in_group(config: ScanFwdConfig, G: int, dims_per_group: int) -> None:
    """A program's channel block reads one B/C group (``_state_tile``'s ``pid_g``): with G > 1
    its width must divide dim // G, or the block's later channels read the wrong group."""
    if G > 1 and dims_per_group % config.block_d:
        raise ValueError(
            f"config.block_d={config.block_d} must divide dim // G = {dims_per_group}: a channel "
            "block reads a single B/C group")


@functools.lru_cache(maxsize=1024)
def _launch_plan(batch: int, dim: int, L: int, N: int, config: ScanFwdConfig) -> _LaunchPlan:
    block_n = _next_pow2(N)
    n_segments = max(1, min(config.n_segments, _cdiv(L, config.chunk_t)))
    # Segments are whole chunks long, so only the last one has a ragged tail.
    seg_len = _cdiv(_cdiv(L, n_segments), config.chunk_t) * config.chunk_t
    n_segments = _cdiv(L, seg_len)
    n_blocks_d = _cdiv(dim, config.block_d)
    return _LaunchPlan(
        grid_totals=(n_blocks_d, batch, max(1, n_segments - 1)),
        grid=(n_blocks_d, batch, n_segments),
        seg_len=seg_len,
        n_segments=n_segments,
        n_per_thread=max(1, block_n // config.lanes_n),
        lanes_n=min(config.lanes_n, block_n),
    )


@functools.lru_cache(maxsize=4096)
def _row_span(shape: torch.Size, stride: Tuple[int, ...]) -> int:
    """Largest in-row element offset of a tensor (the kernel indexes one batch row in int32)."""
    return sum((n - 1) * st for n, st in zip(shape[1:], stride[1:]))


def selective_scan_fwd(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    delta_bias: Optional[torch.Tensor],
    delta_softplus: bool,
    initial_state: Optional[torch.Tensor],
    return_last_state: bool,
    *,
    config: Optional[ScanFwdConfig] = None,
    traced: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Selective scan forward with the Triton kernel (inputs already validated by the op).

    Args:
        u, delta: (batch, dim, L), any strides. z: (batch, dim, L) or None.
        A: (dim, N). B, C: (batch, G, N, L) grouped layout. D, delta_bias: (dim,) or None.
        initial_state: (batch, dim, N) fp32 or None.
        config: tile override (tests use it to force a time split); default
            ``scan_fwd_config``.
        traced: launch through ``wrap_triton``, for a graph that records it
            (``kernels/inline.py``), register cap included (``triton_common.launcher``).

    Returns:
        y (batch, dim, L) in u's dtype, and last_state (batch, dim, N) fp32 if
        ``return_last_state`` else None.
    """
    y, last_state, _ = selective_scan_fwd_launch(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, return_last_state,
        config=config, traced=traced)
    return y, last_state


def selective_scan_fwd_launch(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    delta_bias: Optional[torch.Tensor],
    delta_softplus: bool,
    initial_state: Optional[torch.Tensor],
    return_last_state: bool,
    *,
    dt_weight: Optional[torch.Tensor] = None,
    config: Optional[ScanFwdConfig] = None,
    traced: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], object]:
    """``selective_scan_fwd``, optionally with the dt projection fused, and the compiled kernel.

    With ``dt_weight`` (dim, R) given, ``delta`` is dt_low (batch, R, L), any strides (HF's
    x_proj output view works as it is), and each chunk's delta = W_dt @ dt_low is a tensor-core
    product inside the kernel (``ssm::fused_mamba_scan``'s "dt" level): delta never exists in
    HBM. Returns (y, last_state, compiled); ``compiled`` is the output launch's kernel (None
    under the interpreter), whose ``n_regs`` / ``n_spills`` the fusion heuristic reads.

    Host cost matters here (at batch 1 / short L the call is launch-bound): everything that
    depends only on sizes is cached (``scan_fwd_config``, ``_launch_plan``, ``_row_span``),
    and the unsplit case is a single launch with no workspace.
    """
    batch, dim, L = u.shape
    if L < 1:
        raise ValueError(f"u: expected at least one timestep, got shape {tuple(u.shape)}")
    G, N = B.shape[1], B.shape[2]
    dims_per_group = dim // G
    if config is None:
        n_sms = num_sms(u.device.index) if u.is_cuda else 132
        config = scan_fwd_config(batch, dim, L, N, dims_per_group, n_sms, dim_innermost(u),
                                 u.element_size() == 2)
    if config.prefetch not in (1, 2):
        raise ValueError(f"config.prefetch: expected 1 or 2 chunks ahead, got {config.prefetch}")
    check_block_in_group(config, G, dims_per_group)
    # The kernel adds the batch offset in int64 but indexes within one batch row in int32.
    for name, t in (("u", u), ("delta", delta), ("z", z), ("B", B), ("C", C)):
        if t is not None and _row_span(t.shape, t.stride()) >= 2**31:
            raise ValueError(
                f"{name}: one batch row spans more than 2**31 elements (shape {tuple(t.shape)}, "
                f"strides {t.stride()}); the Triton selective scan indexes rows in int32")
    plan = _launch_plan(batch, dim, L, N, config)
    dt_rank = dt_weight.shape[1] if dt_weight is not None else 0
    dt_rank_pad, dot_precision = dt_dot_meta(dt_rank, delta.dtype)
    if dt_weight is None:
        dt_rank_pad = 0  # the kernel's "no dt stage"
    dtw_strides = dt_weight.stride() if dt_weight is not None else (0, 0)

    y = empty_activation(u)
    last_state = (torch.empty((batch, dim, N), dtype=torch.float32, device=u.device)
                  if return_last_state else None)
    seg_a = seg_b = None
    if plan.n_segments > 1:
        seg_a = torch.empty((2, plan.n_segments - 1, batch, dim, N), dtype=torch.float32,
                            device=u.device)
        # unbind rather than indexing: a CPU-only torch refuses to index a fake CUDA tensor,
        # and the tracing tests record this launch on one.
        seg_a, seg_b = seg_a.unbind(0)

    z_strides = z.stride() if z is not None else (0, 0, 0)
    h0_strides = initial_state.stride() if initial_state is not None else (0, 0, 0)
    D_stride = D.stride(0) if D is not None else 0
    bias_stride = delta_bias.stride(0) if delta_bias is not None else 0

    kernel, options = launcher(_selective_scan_fwd_kernel, traced, config.max_registers)

    def launch(segment_totals: bool, grid: Tuple[int, int, int]):
        return kernel[grid](
            u, delta, A, B, C, D, z, delta_bias, initial_state,
            y, last_state, seg_a, seg_b, dt_weight,
            batch, dim, L, N, dims_per_group, plan.seg_len, dt_rank,
            *u.stride(), *delta.stride(), *A.stride(), *B.stride(), *C.stride(),
            D_stride, bias_stride, *z_strides, *h0_strides, *y.stride(), *dtw_strides,
            BLOCK_D=config.block_d, CHUNK_T=config.chunk_t,
            N_PER_THREAD=plan.n_per_thread, LANES_N=plan.lanes_n,
            SEGMENT_TOTALS=segment_totals, DELTA_SOFTPLUS=delta_softplus,
            HAS_D=D is not None, HAS_Z=z is not None, HAS_DELTA_BIAS=delta_bias is not None,
            HAS_INIT=initial_state is not None, STORE_LAST=last_state is not None,
            TIME_SPLIT=seg_a is not None, PREFETCH=config.prefetch,
            DT_RANK_PAD=dt_rank_pad, DOT_PRECISION=dot_precision,
            N_RAGGED=plan.n_per_thread * plan.lanes_n != N, num_warps=config.num_warps, **options,
        )

    # Triton launches on the current device; make that u's (e.g. u on cuda:1). The context
    # manager is skipped in the common case, where it would only add host time, and for a
    # recorded launch, whose device the generated code sets.
    switch = not traced and u.is_cuda and u.device.index != torch.cuda.current_device()
    with torch.cuda.device(u.device) if switch else contextlib.nullcontext():
        if seg_a is not None:
            launch(True, plan.grid_totals)
        compiled = launch(False, plan.grid)
    return y, last_state, compiled if u.is_cuda and not traced else None
