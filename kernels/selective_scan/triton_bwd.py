"""Selective-scan backward: Triton kernels and their launcher.

The forward saves only its inputs, so the backward recomputes every state it needs. No
(batch, dim, L, N) tensor is ever written; the work is split into three kernels around two
transient chunk-boundary workspaces of shape (batch, L/T, dim, N) fp32, T the chunk length:

1. ``_chunk_state_kernel``, parallel over (channel block, batch, chunk): each chunk's own
   contribution, from zero, to the state at its end and to dL/dh just before it (the latter
   needs only the readout gradient C_t * g_t, g = dy * silu(z), which does not depend on h).
   It runs on the forward kernel's tiles, time inside each thread: one exp per element.
2. ``_state_pass_kernel``, serial over chunks but only (batch, dim, N)-wide: chains those
   contributions in place, forward into h entering each chunk (from initial_state) and
   backward into r = dL/dh at each chunk's end from later steps (from dlast_state); what is
   left after chunk 0 is dL/d initial_state.
3. ``_chunk_bwd_kernel``: with both boundaries known, every chunk is independent. One program
   per (chunk, batch, slice of a group's channels) recomputes the interior with two in-chunk
   scans (h forward, dh in reverse) and forms all gradients. Each thread owns 4 consecutive
   steps, so a scan is a serial chain in registers plus one cross-lane scan of the threads'
   composites (``_scan_fwd``, ``_scan_rev``). Because a program
   loops over many channels of ONE group, it sums their dB/dC into rows of a per-slice
   partial that it alone owns; dA, dD and ddelta_bias are written per (batch, chunk).
   The launcher reduces all partials in one fixed-order launch (``partials.sum_partials``):
   no atomics, the same bits on every run. ``_chunk_bwd_nblock_kernel``
   (``Tiles.variant = "nblock"``, the launcher's choice from 16 (chunk, batch, group) cells:
   2.65 / 2.39 ms against the column kernel's 3.44 / 3.25 ms at batch 8, L=2048 in fp32 / bf16,
   H200 run 10; 0.350 ms fp32 at batch 1, run 14) is the same step with the loops swapped,
   blocks of state columns outside the channel loop, so dB/dC are summed over channels in
   registers (benchmarks/NOTES_scan_bwd.md, "H17").
   ``_chunk_bwd_serial_kernel`` (``Tiles.variant = "serial"``, the launcher's choice below 16
   cells since run 13) uses the forward kernel's tiles instead: time inside each thread, so both
   scans are serial chains, a forward walk to the sub-chunk entry states and a backward walk
   (NOTES "Serial").

The chunk kernels work on [channels, chunk] tiles ([channels, chunk / 4, 4] in the second one)
and loop over the N state columns, so sums
over N are running sums in registers rather than cross-thread reductions, and a tile's size
does not depend on N (N <= 256 costs loop trips, not registers).

Precision of dA: the decay's input a_t * h_{t-1} is recovered as h_t - b_t (no shifted copy of
h), as mamba_ssm's CUDA backward does (``a = x_t - delta * u * B``). Where the decay is strong
(a_t near 0, |A * delta| >~ 10) that difference cancels: dA's columns of large |A| then carry
absolute errors of ~1e-7 of the other gradients' scale, which is up to ~2e-2 of their own small
values (normwise ~1e-6; the CPU path, which keeps h_{t-1}, stays near 4e-6 per element).
The other gradients do not use the difference.
"""
import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..layout import dim_innermost
from ..partials import sum_partials
from ..restride import restride_into
from ..triton_common import (LAUNCH_OPTIONS, LOG2E, finite_decay_rate, launcher, linear_combine, neg_zero, num_sms,
                             prefetch, sigmoid_approx, silu, softplus)
from .grads import ScanGrads
from .triton_fwd import _last_step, _load_chunk, _state_tile, _sum_lanes, scan_fwd_config


# Kernels work on [BLOCK_D, CHUNK] tiles, one state column at a time.
_CHUNK = 128
# Channels per loop step of the chunk kernel. One channel per step keeps its [1, 32, 4] tile
# (chunk 128) inside one warp: the sums over channels (dB, dC) vanish, no cross-warp reduction
# or barrier is left in the n-loop, and the kernel needs ~122 registers (sm_90, triton 3.6)
# instead of ~250 at [16, 64] with 4 warps, which doubles the warps an SM can hold.
_BLOCK_D = 1
# Consecutive time steps per thread in the chunk kernel's tiles: the serial part of its scans,
# and one 16 B vector of fp32 per load. Its scans are written out for exactly 4.
_STEPS = 4
# Warps per program of the state pass (each warp owns 4 * 32 (channel, state) pairs, see the
# kernel), and the chunks whose loads it issues at once. H200 run 32, batch 8, L=2048 (32
# chunks), inside the backward: 4 rows 0.024 ms, 8 rows 0.026, 16 rows 0.034; 2 warps 0.026.
_PASS_WARPS = 1
_PASS_ROWS = 4
# Resident warps per SM the chunk kernel's grid aims for: its n-loop is a chain of dependent
# cross-lane scan steps, so throughput scales with the warps a scheduler can switch between
# (at ~120 registers an SM holds 16 one-warp programs).
_WARPS_PER_SM = 16


@triton.jit
def _delta_tile(delta_ptrs, bias, mask, HAS_DELTA_BIAS: tl.constexpr, DELTA_SOFTPLUS: tl.constexpr):
    """Delta for a tile of (channel, time) pointers and its pre-activation; ``bias`` is already
    broadcast to the tile's rank.

    Delta is zero outside the sequence and the channel block, so padded steps decay by
    exp(0) = 1 and inject nothing; a softplus(bias) there would corrupt the chunk sums.
    """
    x = tl.load(delta_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA_BIAS:
        x += bias
    if DELTA_SOFTPLUS:
        dt = softplus(x, FAST_MATH=True)
    else:
        dt = x
    return tl.where(mask, dt, 0.0), x


@triton.jit
def _steps(x):
    """A [BLOCK_D, ROWS, 4] tile as its four step columns ([BLOCK_D, ROWS] each).

    The step axis lives inside one thread, so split/join are register renamings; Triton's own
    scan along it would not be (a reverse scan is lowered through lane permutations).
    """
    even, odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], 2, 2]))  # steps (0, 2), (1, 3)
    s0, s2 = tl.split(even)
    s1, s3 = tl.split(odd)
    return s0, s1, s2, s3


@triton.jit
def _unsteps(s0, s1, s2, s3):
    x = tl.join(tl.join(s0, s2), tl.join(s1, s3))
    return tl.reshape(x, [s0.shape[0], s0.shape[1], 4])


@triton.jit
def _scan_fwd(a, b, ROWS: tl.constexpr):
    """h_t = a_t * h_{t-1} + b_t from h = 0, over a [BLOCK_D, ROWS, 4] tile, t = row * 4 + step.

    Each thread owns a row's 4 consecutive steps: the chain along them is serial in registers;
    only the rows' composites (one per thread) are scanned across lanes, and the state entering
    each row is the previous row's result, fetched with a one-lane gather.
    """
    a0, a1, a2, a3 = _steps(a)
    b0, b1, b2, b3 = _steps(b)
    return _scan_fwd_steps(a0, a1, a2, a3, b0, b1, b2, b3, ROWS)


@triton.jit
def _scan_fwd_from(a, b, h_start, ROWS: tl.constexpr):
    """``_scan_fwd`` from h_{-1} = h_start ([BLOCK_D, 1]), folded into the first step's input:
    one FMA per row rather than a select over the whole tile."""
    a0, a1, a2, a3 = _steps(a)
    b0, b1, b2, b3 = _steps(b)
    rows = tl.arange(0, ROWS)[None, :]
    b0 = tl.where(rows == 0, b0 + a0 * h_start, b0)
    return _scan_fwd_steps(a0, a1, a2, a3, b0, b1, b2, b3, ROWS)


@triton.jit
def _scan_fwd_steps(a0, a1, a2, a3, b0, b1, b2, b3, ROWS: tl.constexpr):
    h1 = a1 * b0 + b1
    h2 = a2 * h1 + b2
    h3 = a3 * h2 + b3
    p1 = a0 * a1
    p2 = p1 * a2
    p3 = p2 * a3
    _, h_end = tl.associative_scan((p3, h3), axis=1, combine_fn=linear_combine)  # [BLOCK_D, ROWS]
    rows = tl.arange(0, ROWS)[None, :]
    prev = tl.broadcast_to(tl.maximum(rows - 1, 0), h_end.shape)
    h_in = tl.where(rows == 0, 0.0, tl.gather(h_end, prev, 1))
    return _unsteps(b0 + a0 * h_in, h1 + p1 * h_in, h2 + p2 * h_in, h3 + p3 * h_in)


@triton.jit
def _scan_rev(alpha, c, ROWS: tl.constexpr):
    """x_t = alpha_t * x_{t+1} + c_t from x = 0 past the tile; layout as in ``_scan_fwd``."""
    a0, a1, a2, a3 = _steps(alpha)
    c0, c1, c2, c3 = _steps(c)
    return _scan_rev_steps(a0, a1, a2, a3, c0, c1, c2, c3, ROWS)


@triton.jit
def _scan_rev_from(alpha, c, x_end, ROWS: tl.constexpr):
    """``_scan_rev`` from x = x_end past the tile ([BLOCK_D, 1]), folded into the last step's
    input."""
    a0, a1, a2, a3 = _steps(alpha)
    c0, c1, c2, c3 = _steps(c)
    rows = tl.arange(0, ROWS)[None, :]
    c3 = tl.where(rows == ROWS - 1, c3 + a3 * x_end, c3)
    return _scan_rev_steps(a0, a1, a2, a3, c0, c1, c2, c3, ROWS)


@triton.jit
def _scan_rev_steps(a0, a1, a2, a3, c0, c1, c2, c3, ROWS: tl.constexpr):
    x2 = a2 * c3 + c2
    x1 = a1 * x2 + c1
    x0 = a0 * x1 + c0
    p2 = a2 * a3
    p1 = a1 * p2
    p0 = a0 * p1
    _, x_start = tl.associative_scan((p0, x0), axis=1, combine_fn=linear_combine, reverse=True)
    rows = tl.arange(0, ROWS)[None, :]
    nxt = tl.broadcast_to(tl.minimum(rows + 1, ROWS - 1), x_start.shape)
    x_in = tl.where(rows == ROWS - 1, 0.0, tl.gather(x_start, nxt, 1))
    return _unsteps(x0 + p0 * x_in, x1 + p1 * x_in, x2 + p2 * x_in, c3 + a3 * x_in)


# The HAS_* flags are passed by the launcher rather than through @triton.heuristics, as in the
# forward kernel: the heuristics wrapper rebuilds a dict of every argument once per flag on each
# launch (benchmarks/host_overhead_scan.py measured it for the forward).
@triton.jit
def _chunk_state_kernel(
    # pointers
    u_ptr, delta_ptr, dy_ptr, z_ptr, A_ptr, B_ptr, C_ptr, delta_bias_ptr, hs_ptr, rs_ptr, total_ptr,
    # sizes
    dim, L, N, n_chunks, dims_per_group,
    # strides
    stride_u_b, stride_u_d, stride_u_l,
    stride_delta_b, stride_delta_d, stride_delta_l,
    stride_dy_b, stride_dy_d, stride_dy_l,
    stride_z_b, stride_z_d, stride_z_l,
    stride_A_d, stride_A_n,
    stride_B_b, stride_B_g, stride_B_n, stride_B_l,
    stride_C_b, stride_C_g, stride_C_n, stride_C_l,
    # meta-parameters
    DELTA_SOFTPLUS: tl.constexpr, HAS_Z: tl.constexpr, HAS_DELTA_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr, CHUNK_T: tl.constexpr, N_PER_THREAD: tl.constexpr, LANES_N: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Each chunk's own contribution to the state at its end and to dL/dh before it.

    Both start from zero, so every chunk is independent; ``_state_pass_kernel`` chains them.
    A program walks one chunk of CHUNK steps in tiles of CHUNK_T, each thread owning a run of
    consecutive steps of N_PER_THREAD states of one channel (the forward's 4-D tile, same
    loads). The scan of (a, b) = (exp(delta*A), delta*u*B) along time is serial in registers:
    its b half is the state from zero, and its a half, started from the decay of the tiles
    before it (``carry``), the decay since the chunk's start, which weighs each step's C*g:
        h_end   = h after the chunk, from h = 0
        dh_prev = sum_t exp(A * P_t) * C_t * g_t          (P_t = sum_{j<=t} delta_j)
    Until run 21 this kernel summed both in closed form over [channels, chunk] tiles, two exps
    per element (exp(A * partial sums of delta)) and cross-lane sums over time: 0.382 against
    0.266 ms now in bf16, 0.409 against 0.301 in fp32 at batch 8, L=2048 on L-major input, and
    1.24 against 0.33 ms on channel-innermost input (H200, benchmarks/bench_chunk_state.py).
    """
    pid_d = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    pid_c = tl.program_id(2)
    offs_d, offs_bn, mask_d, mask_bn, offs_n3, offs_d3, mask_dn, pid_g = _state_tile(
        pid_d, dim, N, dims_per_group, BLOCK_D, N_PER_THREAD, LANES_N)

    u_ptr += pid_b * stride_u_b
    delta_ptr += pid_b * stride_delta_b
    dy_ptr += pid_b * stride_dy_b
    if HAS_Z:
        z_ptr += pid_b * stride_z_b
    B_ptr += pid_b * stride_B_b + pid_g * stride_B_g
    C_ptr += pid_b * stride_C_b + pid_g * stride_C_g

    A = finite_decay_rate(tl.load(A_ptr + offs_d3 * stride_A_d + offs_n3 * stride_A_n, mask=mask_dn,
                                  other=0.0).to(tl.float32) * LOG2E)
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_DELTA_BIAS:
        bias = tl.load(delta_bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)

    t_start = pid_c * CHUNK
    t_end = tl.minimum(t_start + CHUNK, L)
    h = tl.zeros((N_PER_THREAD, BLOCK_D, LANES_N), tl.float32)
    acc = tl.zeros((N_PER_THREAD, BLOCK_D, LANES_N), tl.float32)
    carry = tl.full((N_PER_THREAD, BLOCK_D, LANES_N), 1.0, tl.float32)  # exp(A * P) before the tile
    dt_sum = tl.zeros((BLOCK_D,), tl.float32)
    is_first = (tl.arange(0, CHUNK_T) == 0)[:, None, None, None]
    # One tile of loads ahead, as the forward on channel-innermost activations.
    u, delta, z, Bt, Ct = _load_chunk(
        u_ptr, delta_ptr, z_ptr, B_ptr, C_ptr, offs_d, t_start + tl.arange(0, CHUNK_T), offs_bn,
        mask_d, mask_bn, t_end, stride_u_d, stride_u_l, stride_delta_d, stride_delta_l, stride_z_d,
        stride_z_l, stride_B_n, stride_B_l, stride_C_n, stride_C_l, 0, HAS_Z, True, 0)
    g = _load_rows(dy_ptr, t_start + tl.arange(0, CHUNK_T), offs_d, mask_d, t_end, stride_dy_d, stride_dy_l)
    for t0 in range(t_start, t_end, CHUNK_T):
        offs_t = t0 + tl.arange(0, CHUNK_T)
        mask_t = offs_t < t_end
        nxt = _load_chunk(
            u_ptr, delta_ptr, z_ptr, B_ptr, C_ptr, offs_d, offs_t + CHUNK_T, offs_bn,
            mask_d, mask_bn, t_end, stride_u_d, stride_u_l, stride_delta_d, stride_delta_l, stride_z_d,
            stride_z_l, stride_B_n, stride_B_l, stride_C_n, stride_C_l, 0, HAS_Z, True, 0)
        g_nxt = _load_rows(dy_ptr, offs_t + CHUNK_T, offs_d, mask_d, t_end, stride_dy_d, stride_dy_l)

        dt = delta.to(tl.float32) + bias[None, :]
        if DELTA_SOFTPLUS:
            dt = softplus(dt, FAST_MATH=True)
        # Steps past the chunk (or L) are the identity (1, 0) and weigh nothing: dt = 0, g = 0.
        dt = tl.where(mask_t[:, None], dt, 0.0)
        gf = g.to(tl.float32)
        if HAS_Z:
            gf *= silu(z.to(tl.float32), FAST_MATH=True)
        dt4, dtu4 = tl.split(tl.join(dt, dt * u.to(tl.float32))[:, None, :, None, :])
        g4 = gf[:, None, :, None]
        B4, C4 = tl.split(tl.join(Bt.to(tl.float32), Ct.to(tl.float32))[:, :, None, :, :])
        a = tl.exp2(dt4 * A[None, :, :, :])
        b = tl.where(is_first, a * h[None, :, :, :] + dtu4 * B4, dtu4 * B4)
        # The first step's decay also carries the tiles' before it: the scan's a half is then
        # exp(A * P_t) itself. No step's b reads the first a (b_t = a_t * b_{t-1} + b_t), so h
        # is unchanged by it. Until run 32 the carry was exp2(A * sum of delta so far), an exp
        # and a product per (d, n) and tile: 152 -> 126 registers (Triton 3.6), and on the H200
        # at batch 8, L=2048 0.289 -> 0.278 ms fp32, 0.281 -> 0.258 ms bf16.
        decay, hs = tl.associative_scan((tl.where(is_first, a * carry[None, :, :, :], a), b), 0,
                                        linear_combine)
        h = _last_step(hs, CHUNK_T)
        carry = _last_step(decay, CHUNK_T)
        acc += tl.sum(decay * (g4 * C4), axis=0)
        dt_sum += tl.sum(dt, axis=0)
        u, delta, z, Bt, Ct = nxt
        g = g_nxt

    ws = ((pid_b * n_chunks + pid_c) * dim + offs_d3) * N + offs_n3
    tl.store(hs_ptr + ws, h, mask=mask_dn)
    tl.store(rs_ptr + ws, acc, mask=mask_dn)
    tl.store(total_ptr + (pid_b * n_chunks + pid_c) * dim + offs_d, dt_sum, mask=mask_d)


@triton.jit
def _load_rows(ptr, offs_t, offs_d, mask_d, t_end, stride_d, stride_l):
    """A [CHUNK_T, BLOCK_D] tile (zeros past ``t_end``), loaded as ``_load_chunk`` loads u."""
    mask = (offs_t < t_end)[:, None] & mask_d[None, :]
    return tl.load(ptr + offs_t[:, None] * stride_l + offs_d[None, :] * stride_d, mask=mask, other=0.0)


@triton.jit
def _state_pass_kernel(
    # pointers
    A_ptr, total_ptr, init_ptr, dlast_ptr, hs_ptr, rs_ptr, dinit_ptr,
    # sizes
    dim, N, n_chunks,
    # strides
    stride_A_d, stride_A_n,
    stride_init_b, stride_init_d, stride_init_n,
    stride_dlast_b, stride_dlast_d, stride_dlast_n,
    # meta-parameters
    HAS_INIT: tl.constexpr, HAS_DLAST: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Chain the chunks, in place: hs[c] becomes h entering chunk c, rs[c] dL/dh at its end.

    Each program owns BLOCK_D channels (BLOCK_N >= N states each) of one batch row and walks
    the chunks forward (h) and backward (dL/dh) ROWS chunks at a time: the loads of a block of
    chunks are issued together, then the chain runs row by row. The launcher sizes the tile at
    4 elements a thread (BLOCK_D * BLOCK_N = 128 * num_warps), so the loads' layout (4
    consecutive elements a thread, lanes and warps along them) keeps an element's ROWS chunks
    inside its thread: the chain is one FMA per row in registers, and a thread rewrites only
    what it read (one barrier per block guards that, see below). Until run 32 the chain was
    ``tl.associative_scan`` along the rows, which Triton 3.6 lowered with the rows across lanes
    and warps (sm_90: 579 loop instructions per block of 8 chunks with 128 SHFL and 12 BAR;
    now 263 per block of 4, none of them SHFL, under 3.6 and 3.9). H200 (run 32, batch 8,
    L=2048, inside the backward): 0.053 -> 0.024 ms, ~4 TB/s on its 100 MB of workspace reads
    and writes.
    """
    pid_b = tl.program_id(0).to(tl.int64)
    # (d, n) flattened over BLOCK_D whole channels, padded to BLOCK_N states each: with
    # N = BLOCK_N the workspace rows are contiguous along it.
    i = tl.arange(0, BLOCK_D * BLOCK_N)
    offs_d = tl.program_id(1) * BLOCK_D + i // BLOCK_N
    offs_n = i % BLOCK_N
    mask = (offs_d < dim) & (offs_n < N)
    offs = offs_d * N + offs_n
    A2 = finite_decay_rate(tl.load(A_ptr + offs_d * stride_A_d + offs_n * stride_A_n, mask=mask,
                                   other=0.0).to(tl.float32) * LOG2E)
    if HAS_INIT:
        h = tl.load(init_ptr + pid_b * stride_init_b + offs_d * stride_init_d + offs_n * stride_init_n,
                    mask=mask, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BLOCK_D * BLOCK_N], dtype=tl.float32)
    if HAS_DLAST:
        r = tl.load(dlast_ptr + pid_b * stride_dlast_b + offs_d * stride_dlast_d + offs_n * stride_dlast_n,
                    mask=mask, other=0.0).to(tl.float32)
    else:
        r = tl.zeros([BLOCK_D * BLOCK_N], dtype=tl.float32)
    ws_ptrs = (pid_b * n_chunks * dim * N + offs)[None, :]
    chunk_stride = dim.to(tl.int64) * N  # a workspace may pass 2**31 elements past one batch row
    # The chunks' delta sums are per channel: loaded as [ROWS, BLOCK_D] (contiguous along the
    # channels) and widened over the states. A load of the full-width tile (not contiguous:
    # each sum repeats N times) made Triton 3.6 put the rows across lanes.
    offs_bd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    total_ptrs = total_ptr + pid_b * n_chunks * dim + offs_bd[None, :]
    rows = tl.arange(0, ROWS)[:, None]
    for c0 in range(0, n_chunks, ROWS):
        fwd = c0 + rows  # the h walk's chunks, in order
        rev = n_chunks - 1 - fwd  # the dL/dh walk's
        m = (fwd < n_chunks) & mask[None, :]
        m_bd = (fwd < n_chunks) & (offs_bd < dim)[None, :]
        # Past the last chunk the steps are the identity (1, 0): a = exp2(0), local = 0.
        h_local = tl.load(hs_ptr + ws_ptrs + fwd * chunk_stride, mask=m, other=0.0)
        r_local = tl.load(rs_ptr + ws_ptrs + rev * chunk_stride, mask=m, other=0.0)
        t_h = tl.load(total_ptrs + fwd * dim, mask=m_bd, other=0.0)
        t_r = tl.load(total_ptrs + rev * dim, mask=m_bd, other=0.0)
        t_h = tl.reshape(tl.broadcast_to(t_h[:, :, None], [ROWS, BLOCK_D, BLOCK_N]), [ROWS, BLOCK_D * BLOCK_N])
        t_r = tl.reshape(tl.broadcast_to(t_r[:, :, None], [ROWS, BLOCK_D, BLOCK_N]), [ROWS, BLOCK_D * BLOCK_N])
        a_h = tl.exp2(A2[None, :] * t_h)
        a_r = tl.exp2(A2[None, :] * t_r)
        h_in = h_local
        r_in = r_local
        for j in tl.static_range(ROWS):
            # Row j's slot takes the value entering its chunk (in the walk's direction).
            h_in = tl.where(rows == j, h[None, :], h_in)
            r_in = tl.where(rows == j, r[None, :], r_in)
            h = _row(a_h, j) * h + _row(h_local, j)
            r = _row(a_r, j) * r + _row(r_local, j)
        # The stores take the loads' layout (Triton 3.6 and 3.9, BLOCK_N = 8, 16, 256), so each
        # thread overwrites only what it read; the barrier keeps that true should a compiler
        # convert the stored tile: no thread's store may reach a row another has yet to load.
        tl.debug_barrier()
        tl.store(hs_ptr + ws_ptrs + fwd * chunk_stride, h_in, mask=m)
        tl.store(rs_ptr + ws_ptrs + rev * chunk_stride, r_in, mask=m)
    if HAS_INIT:
        # What is left after chunk 0 is dL/dh_{-1}, the initial state's gradient.
        tl.store(dinit_ptr + pid_b * dim * N + offs, r, mask=mask)


@triton.jit
def _chunk_bwd_kernel(
    # pointers
    dy_ptr, u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, delta_bias_ptr, hs_ptr, rs_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dA_part_ptr, dB_part_ptr, dC_part_ptr, dD_part_ptr, ddb_part_ptr,
    # sizes
    batch, dim, L, N, G, n_chunks, dim_per_group, dim_per_split, n_splits,
    # strides
    stride_dy_b, stride_dy_d, stride_dy_l,
    stride_u_b, stride_u_d, stride_u_l,
    stride_delta_b, stride_delta_d, stride_delta_l,
    stride_A_d, stride_A_n,
    stride_B_b, stride_B_g, stride_B_n, stride_B_l,
    stride_C_b, stride_C_g, stride_C_n, stride_C_l,
    stride_z_b, stride_z_d, stride_z_l,
    stride_du_b, stride_du_d, stride_du_l,
    stride_ddelta_b, stride_ddelta_d, stride_ddelta_l,
    stride_dz_b, stride_dz_d, stride_dz_l,
    # meta-parameters
    DELTA_SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_DELTA_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, STEPS: tl.constexpr,
):
    """Recompute a chunk's interior and form every gradient, one state column at a time.

    Tiles are [BLOCK_D, ROWS, STEPS] with time t = chunk start + row * STEPS + step: each
    thread owns a row's STEPS consecutive steps (one 16 B vector of fp32 when STEPS = 4), so
    both scans run serially in registers and only ROWS composites per channel cross lanes
    (see ``_scan_fwd``/``_scan_rev``).
    """
    tl.static_assert(STEPS == 4, "the in-thread scans are written out for 4 steps")
    ROWS: tl.constexpr = CHUNK // STEPS
    pid_c = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    pid_g = tl.program_id(2) // n_splits
    pid_s = tl.program_id(2) % n_splits
    offs_t = tl.arange(0, ROWS)[:, None] * STEPS + tl.arange(0, STEPS)[None, :]  # [ROWS, STEPS]
    t = pid_c * CHUNK + offs_t
    mask_t = t < L
    mask_next = t + 1 < L
    # The chunk's last real step, where the carry from later chunks enters dh.
    last = tl.minimum(L - pid_c * CHUNK, CHUNK) - 1
    is_first = (offs_t == 0)[None, :, :]
    is_last = (offs_t == last)[None, :, :]

    B_ptr += pid_b * stride_B_b + pid_g * stride_B_g
    C_ptr += pid_b * stride_C_b + pid_g * stride_C_g
    dy_ptr += pid_b * stride_dy_b
    u_ptr += pid_b * stride_u_b
    delta_ptr += pid_b * stride_delta_b
    du_ptr += pid_b * stride_du_b
    ddelta_ptr += pid_b * stride_ddelta_b
    if HAS_Z:
        z_ptr += pid_b * stride_z_b
        dz_ptr += pid_b * stride_dz_b
    # Workspaces and partials are contiguous, allocated by the launcher; this program owns its
    # (split, batch, group) rows of the dB/dC partials, laid out (n_splits, batch, G, N, L).
    ws_off = (pid_b * n_chunks + pid_c) * dim * N
    part_off = (pid_b * n_chunks + pid_c) * dim
    bc_part = ((pid_s * batch + pid_b) * G + pid_g) * N * L + t

    d_start = pid_s * dim_per_split
    d_stop = tl.minimum(d_start + dim_per_split, dim_per_group)
    for d0 in range(d_start, d_stop, BLOCK_D):
        offs_dl = d0 + tl.arange(0, BLOCK_D)
        offs_d = pid_g * dim_per_group + offs_dl
        mask_d = offs_dl < d_stop
        d3 = offs_d[:, None, None]
        t3 = t[None, :, :]
        mask_dt = mask_d[:, None, None] & mask_t[None, :, :]  # [BLOCK_D, ROWS, STEPS]

        bias = tl.zeros([BLOCK_D, 1, 1], dtype=tl.float32)
        if HAS_DELTA_BIAS:
            bias = tl.load(delta_bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[:, None, None]
        delta_ptrs = delta_ptr + d3 * stride_delta_d + t3 * stride_delta_l
        dt, x = _delta_tile(delta_ptrs, bias, mask_dt, HAS_DELTA_BIAS, DELTA_SOFTPLUS)
        # dh_t = a_{t+1} * dh_{t+1} + C_t * g_t needs the NEXT step's decay at position t; a
        # second (cached) load of delta shifted by one is cheaper than shifting a tile.
        dt_next, _ = _delta_tile(delta_ptrs + stride_delta_l, bias,
                                 mask_d[:, None, None] & mask_next[None, :, :], HAS_DELTA_BIAS, DELTA_SOFTPLUS)
        u = tl.load(u_ptr + d3 * stride_u_d + t3 * stride_u_l, mask=mask_dt, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + d3 * stride_dy_d + t3 * stride_dy_l, mask=mask_dt, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_ptr + d3 * stride_z_d + t3 * stride_z_l, mask=mask_dt, other=0.0).to(tl.float32)
            g = dy * silu(z, FAST_MATH=True)
        else:
            g = dy
        dtu = dt * u

        # One state column at a time; sums over n are running sums.
        y = tl.zeros([BLOCK_D, ROWS, STEPS], dtype=tl.float32)  # C . h, before skip and gate (for dz)
        q = tl.zeros([BLOCK_D, ROWS, STEPS], dtype=tl.float32)  # dh . B
        s = tl.zeros([BLOCK_D, ROWS, STEPS], dtype=tl.float32)  # (dh * a * h_prev) . A * log2(e)
        for n in range(N):
            A2 = finite_decay_rate(tl.load(A_ptr + offs_d * stride_A_d + n * stride_A_n, mask=mask_d,
                                           other=0.0).to(tl.float32) * LOG2E)
            A2 = A2[:, None, None]
            Bn = tl.load(B_ptr + n * stride_B_n + t * stride_B_l, mask=mask_t, other=0.0).to(tl.float32)[None, :, :]
            Cn = tl.load(C_ptr + n * stride_C_n + t * stride_C_l, mask=mask_t, other=0.0).to(tl.float32)[None, :, :]
            h0 = tl.load(hs_ptr + ws_off + offs_d * N + n, mask=mask_d, other=0.0)[:, None, None]
            r = tl.load(rs_ptr + ws_off + offs_d * N + n, mask=mask_d, other=0.0)[:, None, None]

            # Forward recompute; h entering the chunk is folded into the first step's input.
            a = tl.exp2(A2 * dt)
            b = dtu * Bn
            h = _scan_fwd(a, tl.where(is_first, b + a * h0, b), ROWS)
            if HAS_Z:
                y += h * Cn

            # Adjoint: a reverse scan of (a_{t+1}, C_t * g_t), the later chunks' carry entering
            # at the last real step. Steps past it hold c = 0 and contribute nothing.
            c = g * Cn
            dh = _scan_rev(tl.exp2(A2 * dt_next), tl.where(is_last, c + r, c), ROWS)

            # h_t - b_t = a_t * h_{t-1}: the decay's input, recovered without shifting h.
            e = dh * (h - b)
            q += dh * Bn
            s += e * A2
            dA_n = tl.sum(tl.sum(e * dt, axis=2), axis=1)
            tl.store(dA_part_ptr + ws_off + offs_d * N + n, dA_n, mask=mask_d)
            # dB/dC sum over this program's channels: read-modify-write of rows it alone owns.
            dB_ptrs = dB_part_ptr + bc_part + n * L
            dC_ptrs = dC_part_ptr + bc_part + n * L
            tl.store(dB_ptrs, tl.load(dB_ptrs, mask=mask_t) + tl.sum(dh * dtu, axis=0), mask=mask_t)
            tl.store(dC_ptrs, tl.load(dC_ptrs, mask=mask_t) + tl.sum(h * g, axis=0), mask=mask_t)

        if HAS_Z:
            if HAS_D:
                y += tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[:, None, None] * u
            sig_z = tl.sigmoid(z)
            dz = dy * y * sig_z * (1.0 + z * (1.0 - sig_z))
            tl.store(dz_ptr + d3 * stride_dz_d + t3 * stride_dz_l, dz.to(dz_ptr.dtype.element_ty), mask=mask_dt)
        du = q * dt
        if HAS_D:
            du += tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[:, None, None] * g
            tl.store(dD_part_ptr + part_off + offs_d, tl.sum(tl.sum(g * u, axis=2), axis=1), mask=mask_d)
        ddt = q * u + s * (1.0 / LOG2E)
        if DELTA_SOFTPLUS:
            # softplus'(x) = sigmoid(x); it rounds to 1 above torch's threshold of 20, matching
            # the identity branch there.
            ddt *= tl.sigmoid(x)
        ddt = tl.where(mask_dt, ddt, 0.0)
        if HAS_DELTA_BIAS:
            tl.store(ddb_part_ptr + part_off + offs_d, tl.sum(tl.sum(ddt, axis=2), axis=1), mask=mask_d)
        tl.store(du_ptr + d3 * stride_du_d + t3 * stride_du_l, du.to(du_ptr.dtype.element_ty), mask=mask_dt)
        tl.store(ddelta_ptr + d3 * stride_ddelta_d + t3 * stride_ddelta_l,
                 ddt.to(ddelta_ptr.dtype.element_ty), mask=mask_dt)
        # The next block reads the dB/dC rows that other threads of this program just wrote.
        tl.debug_barrier()


@triton.jit
def _next_step(x, ROWS: tl.constexpr):
    """x_{t+1} at position t over a [1, ROWS, 4] tile, 0 at the tile's last step: three in-thread
    renamings and a one-lane gather of the next row's first step, instead of a second load (and
    softplus) of delta.

    The 0 at the end makes the decay there exp(0) = 1, so the carry from later chunks (dL/dh at
    the chunk's end, their decays included) can enter the reverse scan as its state past the tile.
    """
    s0, s1, s2, s3 = _steps(x)
    rows = tl.arange(0, ROWS)[None, :]
    nxt = tl.broadcast_to(tl.minimum(rows + 1, ROWS - 1), s0.shape)
    return _unsteps(s1, s2, s3, tl.where(rows == ROWS - 1, 0.0, tl.gather(s0, nxt, 1)))


@triton.jit
def _chunk_bwd_nblock_kernel(
    # pointers
    dy_ptr, u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, delta_bias_ptr, hs_ptr, rs_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dA_part_ptr, dB_part_ptr, dC_part_ptr, dD_part_ptr, ddb_part_ptr,
    q_acc_ptr, s_acc_ptr, y_acc_ptr,
    # sizes
    batch, dim, L, N, G, n_chunks, dim_per_group, dim_per_split, n_splits, group_d,
    # strides
    stride_dy_b, stride_dy_d, stride_dy_l,
    stride_u_b, stride_u_d, stride_u_l,
    stride_delta_b, stride_delta_d, stride_delta_l,
    stride_A_d, stride_A_n,
    stride_B_b, stride_B_g, stride_B_n, stride_B_l,
    stride_C_b, stride_C_g, stride_C_n, stride_C_l,
    stride_z_b, stride_z_d, stride_z_l,
    stride_du_b, stride_du_d, stride_du_l,
    stride_ddelta_b, stride_ddelta_d, stride_ddelta_l,
    stride_dz_b, stride_dz_d, stride_dz_l,
    stride_qa_b, stride_qa_d, stride_qa_l,
    stride_sa_b, stride_sa_d, stride_sa_l,
    stride_ya_b, stride_ya_d, stride_ya_l,
    # meta-parameters
    DELTA_SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_DELTA_BIAS: tl.constexpr,
    NB: tl.constexpr, CHUNK: tl.constexpr, STEPS: tl.constexpr,
    PREFETCH: tl.constexpr,  # prefetch the next channel's rows: 0 no, 1 into L1, 2 into L2 (GPU only)
):
    """``_chunk_bwd_kernel`` with the loops swapped: dB/dC are summed over channels in registers.

    The program owns (chunk, batch, group, channel slice) as before, but walks the state columns
    in blocks of NB OUTSIDE its channel loop. Its tiles are [NB, ROWS, STEPS] (NB columns of one
    channel; the two scans run the NB columns side by side), the block's B/C rows stay in
    registers across the channels, and dB/dC for the block are accumulated over the channels in
    registers and written once per group of ``group_d`` channels: no read-modify-write per
    (channel, column), whose load, queued behind the previous store, stalled every column step of
    ``_chunk_bwd_kernel``.

    What sums over n per channel (q = dh . B, s = (dh * a * h_prev) . A * log2(e), and the
    pre-gate y = C . h for dz) is summed in registers within a block and carried across blocks
    as fp32 rows in q/s/y_acc (rows of (batch, dim, L)); the last block finishes du, ddelta, dz
    from them. Per (d, t) that costs 3 x 8 B per block boundary instead of 16 B per (d, t, n).
    See benchmarks/NOTES_scan_bwd.md, "H17".
    """
    tl.static_assert(STEPS == 4, "the in-thread scans are written out for 4 steps")
    ROWS: tl.constexpr = CHUNK // STEPS
    pid_c = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    pid_g = tl.program_id(2) // n_splits
    pid_s = tl.program_id(2) % n_splits
    offs_t = tl.arange(0, ROWS)[:, None] * STEPS + tl.arange(0, STEPS)[None, :]  # [ROWS, STEPS]
    t3 = (pid_c * CHUNK + offs_t)[None, :, :]  # [1, ROWS, STEPS]
    mask_t3 = t3 < L
    rows3 = tl.arange(0, ROWS)[None, :, None]
    # One step per thread and row for the prefetches (see the channel loop), clamped to L - 1 so
    # that a tail chunk's addresses stay valid.
    t_pf = tl.minimum(pid_c * CHUNK + tl.arange(0, ROWS) * STEPS, L - 1)[None, :, None]

    B_ptr += pid_b * stride_B_b + pid_g * stride_B_g
    C_ptr += pid_b * stride_C_b + pid_g * stride_C_g
    dy_ptr += pid_b * stride_dy_b
    u_ptr += pid_b * stride_u_b
    delta_ptr += pid_b * stride_delta_b
    du_ptr += pid_b * stride_du_b
    ddelta_ptr += pid_b * stride_ddelta_b
    q_acc_ptr += pid_b * stride_qa_b
    s_acc_ptr += pid_b * stride_sa_b
    if HAS_Z:
        z_ptr += pid_b * stride_z_b
        dz_ptr += pid_b * stride_dz_b
        y_acc_ptr += pid_b * stride_ya_b
    ws_off = (pid_b * n_chunks + pid_c) * dim * N
    part_off = (pid_b * n_chunks + pid_c) * dim
    # This program alone writes its (split, batch, group, ., chunk) rows of the dB/dC partials,
    # laid out (n_splits, batch, G, N, L), each element exactly once.
    bc_part = ((pid_s * batch + pid_b) * G + pid_g) * N * L + t3

    d_start = pid_g * dim_per_group + pid_s * dim_per_split
    d_stop = pid_g * dim_per_group + tl.minimum((pid_s + 1) * dim_per_split, dim_per_group)
    # Channels are taken in groups of group_d, each group walking all the column blocks: every
    # block re-reads the group's u, delta, dy, z rows and running sums, and a small group keeps
    # those in L2 (group_d x CHUNK x 28 B per resident program), at one dB/dC read-modify-write
    # per group instead of one per channel.
    for d0 in range(d_start, d_stop, group_d):
        d1 = tl.minimum(d0 + group_d, d_stop)
        for n0 in range(0, N, NB):
            offs_n = n0 + tl.arange(0, NB)
            mask_n = offs_n < N
            n3 = offs_n[:, None, None]
            mask_nt = mask_n[:, None, None] & mask_t3  # [NB, ROWS, STEPS]
            # The block's B/C rows serve every channel of the group: loaded once, kept in registers.
            Bt = tl.load(B_ptr + n3 * stride_B_n + t3 * stride_B_l, mask=mask_nt, other=0.0).to(tl.float32)
            Ct = tl.load(C_ptr + n3 * stride_C_n + t3 * stride_C_l, mask=mask_nt, other=0.0).to(tl.float32)
            dB_acc = tl.zeros([NB, ROWS, STEPS], dtype=tl.float32)
            dC_acc = tl.zeros([NB, ROWS, STEPS], dtype=tl.float32)
            for d in range(d0, d1):
                if PREFETCH > 0:
                    # The loads below are used at once, and with 2 warps per scheduler (254
                    # registers) nothing hides their latency: Nsight Compute put 23 % of this
                    # kernel's stall samples on the first uses of delta (+ bias) and z (run 15).
                    # Ask for the next channel's rows now, so that they are cache hits a whole
                    # channel's work later. After the group's last channel comes its first (next
                    # column block) or the next group's first.
                    dn = tl.where(d + 1 < d1, d + 1, tl.where(n0 + NB < N, d0, tl.minimum(d1, d_stop - 1)))
                    prefetch(delta_ptr + dn * stride_delta_d + t_pf * stride_delta_l, PREFETCH)
                    prefetch(u_ptr + dn * stride_u_d + t_pf * stride_u_l, PREFETCH)
                    prefetch(dy_ptr + dn * stride_dy_d + t_pf * stride_dy_l, PREFETCH)
                    if HAS_Z:
                        prefetch(z_ptr + dn * stride_z_d + t_pf * stride_z_l, PREFETCH)
                    if n0 > 0:
                        prefetch(q_acc_ptr + dn * stride_qa_d + t_pf * stride_qa_l, PREFETCH)
                        prefetch(s_acc_ptr + dn * stride_sa_d + t_pf * stride_sa_l, PREFETCH)
                        if HAS_Z:
                            prefetch(y_acc_ptr + dn * stride_ya_d + t_pf * stride_ya_l, PREFETCH)
                bias = 0.0
                if HAS_DELTA_BIAS:
                    bias = tl.load(delta_bias_ptr + d).to(tl.float32)
                delta_ptrs = delta_ptr + d * stride_delta_d + t3 * stride_delta_l
                dt, _ = _delta_tile(delta_ptrs, bias, mask_t3, HAS_DELTA_BIAS, DELTA_SOFTPLUS)  # [1, ROWS, STEPS]
                u_ptrs = u_ptr + d * stride_u_d + t3 * stride_u_l
                dy_ptrs = dy_ptr + d * stride_dy_d + t3 * stride_dy_l
                dtu = dt * tl.load(u_ptrs, mask=mask_t3, other=0.0).to(tl.float32)
                g = tl.load(dy_ptrs, mask=mask_t3, other=0.0).to(tl.float32)
                if HAS_Z:
                    z_ptrs = z_ptr + d * stride_z_d + t3 * stride_z_l
                    g *= silu(tl.load(z_ptrs, mask=mask_t3, other=0.0).to(tl.float32), FAST_MATH=True)
                A2 = finite_decay_rate(tl.load(A_ptr + d * stride_A_d + offs_n * stride_A_n, mask=mask_n,
                                               other=0.0).to(tl.float32) * LOG2E)[:, None, None]  # [NB, 1, 1]
                h0 = tl.load(hs_ptr + ws_off + d * N + offs_n, mask=mask_n, other=0.0)[:, None]  # [NB, 1]
                r = tl.load(rs_ptr + ws_off + d * N + offs_n, mask=mask_n, other=0.0)[:, None]
                # Earlier blocks' sums over their columns, loaded up here with the other loads: below
                # the dA store the compiler could not move them up, and their latency would stall.
                q_acc_ptrs = q_acc_ptr + d * stride_qa_d + t3 * stride_qa_l
                s_acc_ptrs = s_acc_ptr + d * stride_sa_d + t3 * stride_sa_l
                mask_acc = mask_t3 & (n0 > 0)
                q = tl.load(q_acc_ptrs, mask=mask_acc, other=0.0)  # [1, ROWS, STEPS]
                s = tl.load(s_acc_ptrs, mask=mask_acc, other=0.0)
                if HAS_Z:
                    y_acc_ptrs = y_acc_ptr + d * stride_ya_d + t3 * stride_ya_l
                    y = tl.load(y_acc_ptrs, mask=mask_acc, other=0.0)

                # Forward recompute and adjoint as in ``_chunk_bwd_kernel``, NB columns side by side;
                # h0 and r enter as the scans' carries. Steps past the sequence have delta = 0, so
                # decay 1 and no input: the carry r reaches the last real step unchanged.
                a = tl.exp2(A2 * dt)
                b = dtu * Bt
                h = _scan_fwd_from(a, b, h0, ROWS)
                dh = _scan_rev_from(tl.exp2(A2 * _next_step(dt, ROWS)), g * Ct, r, ROWS)
                # h_t - b_t = a_t * h_{t-1}: the decay's input, recovered without shifting h.
                e = dh * (h - b)
                # Stored from a [NB, ROWS, 1] tile (row 0 only) laid out like the scans' tiles: storing
                # the [NB] vector itself makes the compiler convert it through shared memory, with a
                # barrier, on every channel.
                dA = tl.sum(tl.sum(e * dt, axis=2, keep_dims=True), axis=1, keep_dims=True)  # [NB, 1, 1]
                tl.store(dA_part_ptr + ws_off + d * N + n3 + 0 * rows3, tl.broadcast_to(dA, [NB, ROWS, 1]),
                         mask=mask_n[:, None, None] & (rows3 == 0))
                dB_acc += dh * dtu
                dC_acc += h * g

                # Sums over this block's columns, added to the earlier blocks'.
                q += tl.sum(dh * Bt, axis=0, keep_dims=True)
                s += tl.sum(e * A2, axis=0, keep_dims=True)
                if HAS_Z:
                    y += tl.sum(h * Ct, axis=0, keep_dims=True)
                if n0 + NB < N:
                    tl.store(q_acc_ptrs, q, mask=mask_t3)
                    tl.store(s_acc_ptrs, s, mask=mask_t3)
                    if HAS_Z:
                        tl.store(y_acc_ptrs, y, mask=mask_t3)
                else:
                    # Last block: finish the per-channel gradients. u, dy, z and delta are reloaded
                    # (L1 hits from the top of this step) rather than kept live through the scans.
                    u = tl.load(u_ptrs, mask=mask_t3, other=0.0).to(tl.float32)
                    dy = tl.load(dy_ptrs, mask=mask_t3, other=0.0).to(tl.float32)
                    if HAS_Z:
                        z = tl.load(z_ptrs, mask=mask_t3, other=0.0).to(tl.float32)
                        if HAS_D:
                            y += tl.load(D_ptr + d).to(tl.float32) * u
                        sig_z = tl.sigmoid(z)
                        dz = dy * y * sig_z * (1.0 + z * (1.0 - sig_z))
                        tl.store(dz_ptr + d * stride_dz_d + t3 * stride_dz_l, dz.to(dz_ptr.dtype.element_ty),
                                 mask=mask_t3)
                    du = q * dt
                    if HAS_D:
                        du += tl.load(D_ptr + d).to(tl.float32) * g
                        tl.store(dD_part_ptr + part_off + d, tl.sum(g * u))
                    ddt = q * u + s * (1.0 / LOG2E)
                    if DELTA_SOFTPLUS:
                        # softplus'(x) = sigmoid(x), which rounds to 1 past torch's threshold of 20.
                        x = tl.load(delta_ptrs, mask=mask_t3, other=0.0).to(tl.float32) + bias
                        ddt *= tl.sigmoid(x)
                    ddt = tl.where(mask_t3, ddt, 0.0)
                    if HAS_DELTA_BIAS:
                        tl.store(ddb_part_ptr + part_off + d, tl.sum(ddt))
                    tl.store(du_ptr + d * stride_du_d + t3 * stride_du_l, du.to(du_ptr.dtype.element_ty), mask=mask_t3)
                    tl.store(ddelta_ptr + d * stride_ddelta_d + t3 * stride_ddelta_l,
                             ddt.to(ddelta_ptr.dtype.element_ty), mask=mask_t3)
            # The slice's first group writes its rows, later groups add to them.
            dB_ptrs = dB_part_ptr + bc_part + n3 * L
            dC_ptrs = dC_part_ptr + bc_part + n3 * L
            if d0 != d_start:
                dB_acc += tl.load(dB_ptrs, mask=mask_nt, other=0.0)
                dC_acc += tl.load(dC_ptrs, mask=mask_nt, other=0.0)
            tl.store(dB_ptrs, dB_acc, mask=mask_nt)
            tl.store(dC_ptrs, dC_acc, mask=mask_nt)
            # The running sums and dB/dC rows stored above are read at the next block or group,
            # possibly by another warp when tiles span several (a row reduced over columns is
            # replicated across warps, and only one of them stores it). One barrier per block.
            tl.debug_barrier()


@triton.jit
def _row(x, i):
    """x[i] of a 2-D or 4-D tile whose axis 0 lives inside each thread.

    A masked sum with -0.0 (the exact identity of +; ``neg_zero``): for a compile-time ``i`` it
    folds to a register read; a run-time ``i`` wants ``_pick_row``. The reverse does not hold:
    ``_pick_row`` with the adjoint's compile-time rows made Triton 3.6's backward walk 903 ->
    1014 instructions (fp32; 3.9 unchanged at 860).
    """
    sel = tl.arange(0, x.shape[0]) == i
    if len(x.shape) == 2:
        sel = sel[:, None]
    else:
        sel = sel[:, None, None, None]
    return tl.sum(tl.where(sel, x, neg_zero()), axis=0)


@triton.jit
def _pick_row(x, i):
    """x[i] of a [T, ...] 4-D tile whose axis 0 lives inside each thread, for a run-time ``i``.

    A binary tree of selects on the bits of ``i``, log2(T) levels: T - 1 selects per element of
    the row, against ``_row``'s T selects and T - 1 adds (sm_90, the serial kernel's backward
    walk: 989 -> 903 instructions per sub-chunk under Triton 3.6, 945 -> 860 under 3.9, fp32;
    H200 run 31, batch 8 L=2048: backward 1.447 -> 1.435 ms fp32, 1.449 -> 1.406 ms bf16).
    """
    for level in tl.static_range(10):
        if x.shape[0] > 1:
            pairs = tl.reshape(x, [x.shape[0] // 2, 2, x.shape[1], x.shape[2], x.shape[3]])
            even, odd = tl.split(tl.permute(pairs, (0, 2, 3, 4, 1)))
            x = tl.where(((i >> level) & 1) == 1, odd, even)
    return tl.reshape(x, [x.shape[1], x.shape[2], x.shape[3]])


@triton.jit
def _with_row(x, i, v, T: tl.constexpr):
    """x with row i replaced by v (a register move for a compile-time ``i``)."""
    sel = (tl.arange(0, T) == i)[:, None, None, None]
    return tl.where(sel, v[None, :, :, :], x)


# Triton 3.6-3.8 (not 3.9) place the layout conversion into ``_sum_channels``'s layout for dC
# (h * g) at the product's inputs, the per-(t, d) rows, B, A and the entry state, which are fewer
# elements than the product, and then run the decays' exp2 and the state scan a second time in
# that layout: the backward walk 1269 SASS instructions instead of 970 (sm_90, bf16, L-major,
# 8 steps, `benchmarks/sass_scan_bwd_serial.py`). Halving the product across lane pairs first
# makes it the smaller side, and those versions convert it instead: 3.6 1276 -> 1066 bf16,
# 1255 -> 1038 fp32 (3.7 1263 -> 1024, 3.8 1287 -> 1055); on 3.9 the shuffle would only add
# instructions (970 -> 1013).
_PAIR_DC = tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9)


@triton.jit
def _sum_channels(x, PAIRS: tl.constexpr):
    """Sum a [T, N_PER_THREAD, BLOCK_D, LANES_N] tile over its channel axis: [T, N_PER_THREAD, LANES_N].

    The channels span lanes and warps, where ``tl.sum`` shuffles log2(lanes) times per value
    and then reduces across warps through shared memory. Halving with ``tl.split`` (as the
    forward's ``_sum_lanes`` does along N) needs each size-2 axis inside a thread, so Triton
    moves the tile through shared memory once, into a layout where each thread holds all the
    channels of a few (t, n) pairs, and the sums become register adds in a fixed order. The
    serial kernel's dB/dC (sm_90, Triton 3.9, bf16, 8 steps, chunk 64, 32 channels, 4 warps):
    backward walk 1665 -> 1026 SASS instructions per 32 elements a thread, SHFL 372 -> 52,
    BAR 46 -> 14 (``benchmarks/sass_scan_bwd_serial.py``).

    PAIRS first adds channel pairs across lanes (one shuffle level), so that the tile moved
    through shared memory is half the size: see ``_PAIR_DC``.
    """
    tl.static_assert(x.shape[2] <= 1024, "at most 1024 channels per program (32 warps of 32 lanes)")
    if PAIRS and x.shape[2] > 1:
        x = tl.sum(tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2] // 2, 2, x.shape[3]]), axis=3)
    x = tl.permute(x, (0, 1, 3, 2))
    for _ in tl.static_range(10):
        if x.shape[3] > 1:
            a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2], x.shape[3] // 2, 2]))
            x = a + b
    return tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2]])


@triton.jit
def _add_block_sum(ptrs, v, mask, blk):
    """Store ``v``, a channel block's dB or dC sums, into the slice's partial; from the second
    block on, add it to what the blocks before stored there.

    The adds are relaxed atomics, not a load and a store: a load of the partial would need a
    barrier against a replicated tile's other stores (the threads that load an element need not
    be the one that stores it), and a barrier in every sub-chunk of the walk costs time (H200
    run 30, batch 8 L=2048, with dC's paired sum: chunk kernel 1.078 ms with atomics against
    1.162 with load, barrier, store, fp32; 1.094 against 1.142 bf16). No two programs share a
    partial row, the blocks run in a fixed order, and the barrier at the top of each block puts
    the blocks before's stores and adds ahead of this block's: every element is summed in the
    same order on every run, the same bits as the load-and-store form.
    """
    tl.store(ptrs, v, mask=mask & (blk == 0))
    tl.atomic_add(ptrs, v, mask=mask & (blk > 0), sem="relaxed")


@triton.jit
def _load_steps(ptr, offs_t, offs_d, mask_td, stride_d, stride_l):
    """A [T, BLOCK_D] tile of a (channel, time) activation, widened to fp32; 0 where masked."""
    return tl.load(ptr + offs_t[:, None] * stride_l + offs_d[None, :] * stride_d,
                   mask=mask_td, other=0.0).to(tl.float32)


@triton.jit
def _serial_steps(delta_ptr, u_ptr, B_ptr, bias, offs_t, offs_d, offs_bn, mask_t, mask_td, mask_tn,
                  stride_delta_d, stride_delta_l, stride_u_d, stride_u_l, stride_B_n, stride_B_l,
                  HAS_DELTA_BIAS: tl.constexpr, DELTA_SOFTPLUS: tl.constexpr):
    """delta (after bias and softplus), its pre-activation, u and B for T steps of a block:
    [T, BLOCK_D], [T, BLOCK_D], [T, BLOCK_D], [T, N_PER_THREAD, LANES_N]."""
    uf = _load_steps(u_ptr, offs_t, offs_d, mask_td, stride_u_d, stride_u_l)
    x = _load_steps(delta_ptr, offs_t, offs_d, mask_td, stride_delta_d, stride_delta_l)
    if HAS_DELTA_BIAS:
        x += bias[None, :]
    if DELTA_SOFTPLUS:
        dt = softplus(x, FAST_MATH=True)
    else:
        dt = x
    # Padded steps must be the identity (1, 0): dt = 0 there, read from u (exactly 0 where its
    # load was masked) rather than a constant, which keeps Triton <= 3.6 from hoisting dt's layout
    # conversion above the cast and redoing the (t, d) math on every lane (see the forward kernel).
    dt = tl.where(mask_t[:, None], dt, uf)
    Bf = tl.load(B_ptr + offs_t[:, None, None] * stride_B_l + offs_bn[None, :, :] * stride_B_n,
                 mask=mask_tn, other=0.0).to(tl.float32)
    return dt, x, uf, Bf


@triton.jit
def _chunk_bwd_serial_kernel(
    # pointers
    dy_ptr, u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, delta_bias_ptr, hs_ptr, rs_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dA_part_ptr, dB_part_ptr, dC_part_ptr, dD_part_ptr, ddb_part_ptr,
    # sizes
    batch, dim, L, N, G, n_chunks, dim_per_group, dim_per_split, n_splits,
    # strides
    stride_dy_b, stride_dy_d, stride_dy_l,
    stride_u_b, stride_u_d, stride_u_l,
    stride_delta_b, stride_delta_d, stride_delta_l,
    stride_A_d, stride_A_n,
    stride_B_b, stride_B_g, stride_B_n, stride_B_l,
    stride_C_b, stride_C_g, stride_C_n, stride_C_l,
    stride_z_b, stride_z_d, stride_z_l,
    stride_du_b, stride_du_d, stride_du_l,
    stride_ddelta_b, stride_ddelta_d, stride_ddelta_l,
    stride_dz_b, stride_dz_d, stride_dz_l,
    # meta-parameters
    DELTA_SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_DELTA_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr, T: tl.constexpr, N_PER_THREAD: tl.constexpr, LANES_N: tl.constexpr,
    CHUNK: tl.constexpr, PAIR_DC: tl.constexpr,
):
    """A chunk's gradients with time inside each thread: both scans are serial chains.

    Tiles are the forward kernel's [T, N_PER_THREAD, BLOCK_D, LANES_N]: a thread owns T
    consecutive steps of N_PER_THREAD states of one channel, so the forward recompute
    (``tl.associative_scan`` along axis 0) and the adjoint (written out step by step, each row a
    register) need no shuffles. The chunk (CHUNK = T * SUB sub-chunks) is walked
    twice: forward from hs to find the state entering each sub-chunk (kept as the rows of one
    more tile), then backward sub-chunk by sub-chunk from rs, recomputing the states and forming
    every gradient. Sums over N (dh . B, the ddelta term, the pre-gate y) are in-thread adds,
    then the forward's lane halving (``_sum_lanes``); dB/dC sum over a block's BLOCK_D
    channels (one group's) through one shared-memory round trip (``_sum_channels``). A program
    walks its slice of the group's channels one block after another, adding each block's dB/dC
    sums to its slice's row of a (n_splits, batch, G, N, L) partial (``_add_block_sum``): the
    launcher picks the slices to fill the GPU, not one per block, so the partials stay small.
    Both sums replaced cross-lane butterflies (offline, sm_90, Triton 3.9, 8 steps, chunk 64,
    32 channels, 4 warps: backward walk 52.0 -> 29.6 SASS instructions per element in bf16,
    51.5 -> 29.1 in fp32, 55.6 -> 32.3 on channel-innermost bf16 with its 72 B of spills down to
    8). H200 run 23 (Triton 3.6), batch 8 L=2048 L-major fp32 with one warp and 16 slices:
    1.365 ms for this kernel, against 1.827 for "nblock"'s chunk kernel; run 30, with dC's
    channel sum paired so that Triton 3.6 stops computing the states twice (``_PAIR_DC``):
    1.078 ms fp32, 1.094 ms bf16 (1.354 / 1.274 before); run 31, with no zeros added
    (``neg_zero``) and the entry state's row picked by a select tree (``_pick_row``): 1.060 /
    1.043 ms.
    """
    pid_c = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    pid_g = tl.program_id(2) // n_splits
    pid_s = tl.program_id(2) % n_splits
    # State n = i * LANES_N + j of the [N_PER_THREAD, LANES_N] sub-tile.
    offs_bn = tl.arange(0, N_PER_THREAD)[:, None] * LANES_N + tl.arange(0, LANES_N)[None, :]
    mask_bn = offs_bn < N
    offs_n3 = offs_bn[:, None, :]

    dy_ptr += pid_b * stride_dy_b
    u_ptr += pid_b * stride_u_b
    delta_ptr += pid_b * stride_delta_b
    du_ptr += pid_b * stride_du_b
    ddelta_ptr += pid_b * stride_ddelta_b
    if HAS_Z:
        z_ptr += pid_b * stride_z_b
        dz_ptr += pid_b * stride_dz_b
    B_ptr += pid_b * stride_B_b + pid_g * stride_B_g
    C_ptr += pid_b * stride_C_b + pid_g * stride_C_g
    bc_part = ((pid_s * batch + pid_b) * G + pid_g) * N * L

    SUB: tl.constexpr = CHUNK // T
    rows = tl.arange(0, T)[:, None, None, None]
    t_chunk = pid_c * CHUNK
    n_sub = tl.cdiv(tl.minimum(CHUNK, L - t_chunk), T)
    # The slice's channels, BLOCK_D at a time (the launcher sizes slices to whole blocks; only a
    # group's last slice may hold fewer). Each block adds its dB/dC sums to the slice's partial.
    d_start = pid_s * dim_per_split
    n_blocks = tl.cdiv(tl.minimum(dim_per_split, dim_per_group - d_start), BLOCK_D)
    for blk in range(0, n_blocks):
        # The previous blocks' stores and adds to the slice's dB/dC rows come before this
        # block's adds (``_add_block_sum``) whichever threads made them: a fixed order.
        tl.debug_barrier()
        offs_dl = d_start + blk * BLOCK_D + tl.arange(0, BLOCK_D)
        offs_d = pid_g * dim_per_group + offs_dl
        mask_d = offs_dl < dim_per_group
        offs_d3 = offs_d[None, :, None]
        mask_dn = mask_bn[:, None, :] & mask_d[None, :, None]  # [N_PER_THREAD, BLOCK_D, LANES_N]
        A2 = finite_decay_rate(tl.load(A_ptr + offs_d3 * stride_A_d + offs_n3 * stride_A_n, mask=mask_dn,
                                       other=0.0).to(tl.float32) * LOG2E)
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_DELTA_BIAS:
            bias = tl.load(delta_bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        Dv = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_D:
            Dv = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        # Workspaces and partials are contiguous, allocated by the launcher.
        ws = ((pid_b * n_chunks + pid_c) * dim + offs_d3) * N + offs_n3  # [N_PER_THREAD, BLOCK_D, LANES_N]
        part_off = (pid_b * n_chunks + pid_c) * dim + offs_d

        # Boundary states enter through a chunk-shaped tile so they take its layout (a plain
        # load's layout would cost a shared-memory round trip per use; see the forward kernel).
        h = tl.load(hs_ptr + ws, mask=mask_dn, other=0.0)
        h = _last_step(tl.broadcast_to(h[None, :, :, :], [T, N_PER_THREAD, BLOCK_D, LANES_N]), T)
        x = tl.load(rs_ptr + ws, mask=mask_dn, other=0.0)
        x = _last_step(tl.broadcast_to(x[None, :, :, :], [T, N_PER_THREAD, BLOCK_D, LANES_N]), T)

        # Forward walk: the state entering each sub-chunk, row k of h_in.
        h_in = tl.zeros([SUB, N_PER_THREAD, BLOCK_D, LANES_N], dtype=tl.float32)
        # (The last sub-chunk's exit state is not needed: the walk stops one short.)
        for k in range(0, n_sub - 1):
            h_in = _with_row(h_in, k, h, SUB)
            offs_t = t_chunk + k * T + tl.arange(0, T)
            mask_t = offs_t < L
            mask_td = mask_t[:, None] & mask_d[None, :]
            mask_tn = mask_t[:, None, None] & mask_bn[None, :, :]
            dt, _, uf, Bf = _serial_steps(delta_ptr, u_ptr, B_ptr, bias, offs_t, offs_d, offs_bn, mask_t, mask_td,
                                          mask_tn, stride_delta_d, stride_delta_l, stride_u_d, stride_u_l,
                                          stride_B_n, stride_B_l, HAS_DELTA_BIAS, DELTA_SOFTPLUS)
            a = tl.exp2(dt[:, None, :, None] * A2[None, :, :, :])
            b = (dt * uf)[:, None, :, None] * Bf[:, :, None, :]
            b = tl.where(rows == 0, a * h[None, :, :, :] + b, b)
            _, hk = tl.associative_scan((a, b), 0, linear_combine)
            h = _last_step(hk, T)
        h_in = _with_row(h_in, n_sub - 1, h, SUB)

        # Backward walk. x is the carry a_{t+1} * dL/dh_{t+1}: rs holds it for the chunk's last
        # step (dL/dh at the chunk's end from later chunks, their decay included). Padded steps
        # have delta = 0 and dy = 0: decay 1, no input, so x reaches the last real step unchanged.
        dA = tl.zeros([N_PER_THREAD, BLOCK_D, LANES_N], dtype=tl.float32)
        dD = tl.zeros([BLOCK_D], dtype=tl.float32)
        ddb = tl.zeros([BLOCK_D], dtype=tl.float32)
        for kk in range(0, n_sub):
            k = n_sub - 1 - kk
            offs_t = t_chunk + k * T + tl.arange(0, T)
            mask_t = offs_t < L
            mask_td = mask_t[:, None] & mask_d[None, :]
            mask_tn = mask_t[:, None, None] & mask_bn[None, :, :]
            dt, xpre, uf, Bf = _serial_steps(delta_ptr, u_ptr, B_ptr, bias, offs_t, offs_d, offs_bn, mask_t,
                                             mask_td, mask_tn, stride_delta_d, stride_delta_l, stride_u_d,
                                             stride_u_l, stride_B_n, stride_B_l, HAS_DELTA_BIAS, DELTA_SOFTPLUS)
            dy = _load_steps(dy_ptr, offs_t, offs_d, mask_td, stride_dy_d, stride_dy_l)
            if HAS_Z:
                z = _load_steps(z_ptr, offs_t, offs_d, mask_td, stride_z_d, stride_z_l)
                sig_z = sigmoid_approx(z)
                g = dy * z * sig_z
            else:
                g = dy
            Cf = tl.load(C_ptr + offs_t[:, None, None] * stride_C_l + offs_bn[None, :, :] * stride_C_n,
                         mask=mask_tn, other=0.0).to(tl.float32)
            # B and C are 0 wherever masked, so each stands in for the other's zeros: the same
            # guard against Triton <= 3.6 widening them on every lane as in the forward kernel.
            Bf, Cf = tl.where(mask_tn, Bf, Cf), tl.where(mask_tn, Cf, Bf)
            dtu = dt * uf
            B4 = Bf[:, :, None, :]
            dt4, dtu4, g4 = dt[:, None, :, None], dtu[:, None, :, None], g[:, None, :, None]
            a = tl.exp2(dt4 * A2[None, :, :, :])
            b = dtu4 * B4
            _, hk = tl.associative_scan((a, tl.where(rows == 0, a * _pick_row(h_in, k)[None, :, :, :] + b, b)),
                                       0, linear_combine)
            # Everything that needs h but not dh first, so that h, C and the gate die before the
            # adjoint (register pressure): h_t - b_t = a_t * h_{t-1} (the decay's input), the dC
            # contribution h * g, and the pre-gate y for dz.
            hp = hk - b
            bc_ptrs = bc_part + offs_bn[None, :, :] * L + offs_t[:, None, None]  # [T, N_PER_THREAD, LANES_N]
            _add_block_sum(dC_part_ptr + bc_ptrs, _sum_channels(hk * g4, PAIR_DC), mask_tn, blk)
            if HAS_Z:
                y = _sum_lanes(tl.sum(hk * Cf[:, :, None, :], axis=1), LANES_N) + Dv[None, :] * uf
                dz = dy * y * sig_z * (1.0 + z * (1.0 - sig_z))
                tl.store(dz_ptr + offs_t[:, None] * stride_dz_l + offs_d[None, :] * stride_dz_d,
                         dz.to(dz_ptr.dtype.element_ty), mask=mask_td)
            # The adjoint, last step first: dh_t = x + C_t g_t, then x = a_t dh_t for step t - 1.
            dh = g4 * Cf[:, :, None, :]
            for j in tl.static_range(T):
                i = T - 1 - j
                dh_i = x + _row(dh, i)
                dh = _with_row(dh, i, dh_i, T)
                x = _row(a, i) * dh_i
            e = dh * hp
            dA += tl.sum(e * dt4, axis=0)
            q = _sum_lanes(tl.sum(dh * B4, axis=1), LANES_N)  # [T, BLOCK_D]
            s = _sum_lanes(tl.sum(e * A2[None, :, :, :], axis=1), LANES_N)
            _add_block_sum(dB_part_ptr + bc_ptrs, _sum_channels(dh * dtu4, False), mask_tn, blk)

            du = q * dt
            if HAS_D:
                du += Dv[None, :] * g
                dD += tl.sum(g * uf, axis=0)
            ddt = q * uf + s * (1.0 / LOG2E)
            if DELTA_SOFTPLUS:
                # softplus'(x) = sigmoid(x); it rounds to 1 above torch's threshold of 20,
                # matching the identity branch there.
                ddt *= sigmoid_approx(xpre)
            ddt = tl.where(mask_td, ddt, 0.0)
            if HAS_DELTA_BIAS:
                ddb += tl.sum(ddt, axis=0)
            tl.store(du_ptr + offs_t[:, None] * stride_du_l + offs_d[None, :] * stride_du_d,
                     du.to(du_ptr.dtype.element_ty), mask=mask_td)
            tl.store(ddelta_ptr + offs_t[:, None] * stride_ddelta_l + offs_d[None, :] * stride_ddelta_d,
                     ddt.to(ddelta_ptr.dtype.element_ty), mask=mask_td)

        tl.store(dA_part_ptr + ws, dA, mask=mask_dn)
        if HAS_D:
            tl.store(dD_part_ptr + part_off, dD, mask=mask_d)
        if HAS_DELTA_BIAS:
            tl.store(ddb_part_ptr + part_off, ddb, mask=mask_d)


def _num_sms(device: torch.device) -> int:
    return num_sms(device.index) if device.type == "cuda" else 1


def _check_inputs(dy, dlast_state, u, B, C, initial_state) -> None:
    if u.dim() != 3 or u.shape[2] < 1:
        raise ValueError(f"selective_scan_bwd: u must be (batch, dim, L) with L >= 1, got {tuple(u.shape)}")
    if dy.shape != u.shape:
        raise ValueError(f"selective_scan_bwd: dy must have u's shape {tuple(u.shape)}, got {tuple(dy.shape)}")
    if B.dim() != 4 or C.dim() != 4:
        raise ValueError(
            f"selective_scan_bwd: B and C must be grouped (batch, G, N, L), got B {tuple(B.shape)}, "
            f"C {tuple(C.shape)}"
        )
    state_shape = (u.shape[0], u.shape[1], B.shape[2])
    for name, s in (("dlast_state", dlast_state), ("initial_state", initial_state)):
        if s is not None and tuple(s.shape) != state_shape:
            raise ValueError(f"selective_scan_bwd: {name} must be (batch, dim, N) = {state_shape}, got {tuple(s.shape)}")


class Tiles(NamedTuple):
    """Launch shape of the three kernels."""

    chunk: int  # time steps per chunk, a power of two; sets the workspaces' L/T
    block_d: int  # channels per loop step in the chunk kernel
    num_splits: int  # slices of each group's channels, one chunk-kernel program each
    num_warps: int
    # Chunk-kernel loop order; the launcher picks "serial" where N <= 16, else "nblock" for large
    # grids and "column" for small ones (choose_tiles).
    # "column": channels outer, one state column at a time inner, dB/dC summed over channels
    # by read-modify-write of partial rows (``_chunk_bwd_kernel``).
    # "nblock": blocks of ``nb`` columns outer, channels inner, dB/dC summed in registers
    # (``_chunk_bwd_nblock_kernel``; one channel per step, so ``block_d`` is 1).
    # "serial": the forward kernel's tiles, time inside each thread (``_chunk_bwd_serial_kernel``;
    # N <= 16, one program per ``block_d`` channels of a group, so ``num_splits`` follows).
    variant: str = "column"
    nb: int = 1  # state columns per block of the "nblock" variant
    group_d: int = 1  # "nblock": channels per pass over the column blocks
    steps: int = 4  # "serial": consecutive steps per thread (a chunk is at most steps sub-chunks)
    lanes_n: int = 1  # "serial": lanes spread over the state dim
    # "nblock": prefetch the next channel's rows, 0 no, 1 into L1, 2 into L2; None: 1 for fp32
    # activations, 0 otherwise (H200 run 15, batch 8 L=2048: fp32 2.605 -> 2.522 ms with it, bf16
    # 2.354 -> 2.383). A hint: off the GPU always 0, the interpreter has no inline assembly.
    prefetch: Optional[int] = None
    # "serial": run on L-major copies of channel-innermost activations (as the other variants
    # always do). None: from _STAGE_MIN_CELLS (chunk, batch, group) cells on (see choose_tiles).
    stage: Optional[bool] = None
    # "serial": the register cap handed to ptxas (Triton's ``maxnreg``); None = ptxas's choice.
    max_registers: Optional[int] = None


_VARIANTS = ("column", "nblock", "serial")
# "serial" holds a thread's N / lanes_n states of T steps in ~6 live tiles: T = 8 and 4 states
# keep it under the 255-register cap; N above 16 would need a loop over state blocks.
# H200, triton 3.6 (bench_scan_bwd.py --sweep, B8 L2048 fp32): steps 8 / chunk 64 2.90 ms, steps 4
# with 2 warps 3.09, steps 4 / chunk 64 3.71, / chunk 32 4.00, / chunk 16 4.77 (more chunks: a
# longer serial state pass, larger workspaces). Steps 8 was over the register cap there (136 B of
# spills); those times predate the channel and lane sums by halving (see the kernel's docstring).
# Triton 3.9 compiles the committed tile (8 channels, one warp) for sm_90 in 255 registers with
# 24 B of stack in bf16, 8 B in fp32 (benchmarks/sass_scan_bwd_serial.py).
_SERIAL_STEPS = 8
_SERIAL_CHUNK = 64
# One warp, 8 channels a block (N = 16): at ~252 registers 1, 2 and 4 warps all keep 8 warps an
# SM resident, and the smaller block's channel sums are shorter. H200 run 23, B8 L2048 L-major
# fp32 (call 2, a block per program): 1.722 ms with 1 warp, 1.901 with 2, 2.367 with 4, 5.886 with 8.
_SERIAL_WARPS = 1
# Resident "serial" warps per SM (~252 registers a thread: 8 warps), and the waves of programs
# its grid aims for. Run 23 call 6, B8 L2048 fp32, one warp: 8, 16 (this default), 32 and 64
# slices 1.763-1.770 ms, 192 (a block per program, 400 MB of dB/dC partials) 1.794.
_SERIAL_WARPS_PER_SM = 8
_SERIAL_WAVES = 4
# Sub-chunks per chunk at most: their entry states are the rows of one register tile.
_SERIAL_SUB = 16
_SERIAL_MAX_N = 16
# "nblock" tiles are [nb, chunk / 4, 4]; a warp per 16 elements per thread keeps them at the
# "column" kernel's ~4 elements per thread per [1, chunk] tile for nb = 4.
_NBLOCK_ELEMS_PER_THREAD = 16
# "nblock" channels per pass over the column blocks: 8 x 128 steps x 28 B (u, delta, dy, z and
# three fp32 running sums) per resident program, ~30 MB over the H200's 1056 one-warp programs,
# keeps the re-reads in its 50 MB L2.
_NBLOCK_GROUP_D = 8
# Resident one-warp "nblock" programs per SM at nb = 4 (~250 registers; sm_90, triton 3.6), and
# the waves of them its grid aims for.
_NBLOCK_WARPS_PER_SM = 8
_NBLOCK_WAVES = 4
# Fewest (chunk, batch, group) cells from which "serial" works on L-major copies of
# channel-innermost activations (see choose_tiles).
_STAGE_MIN_CELLS = 16


def choose_tiles(batch: int, dim: int, L: int, N: int, G: int, device: torch.device, **overrides) -> Tiles:
    """Tiles for a problem shape; any field of ``Tiles`` may be given to override the choice."""
    unknown = sorted(set(overrides) - set(Tiles._fields))
    if unknown:
        raise ValueError(f"selective_scan_bwd: unknown tiles {unknown}; the fields are {Tiles._fields}")
    dim_per_group = dim // G
    dpg = triton.next_power_of_2(dim_per_group)
    sms = _num_sms(device)
    chunk = overrides.get("chunk") or max(16, min(_CHUNK, triton.next_power_of_2(L)))
    if chunk < _STEPS or chunk & (chunk - 1):
        raise ValueError(f"selective_scan_bwd: tiles chunk must be a power of two >= {_STEPS}, got {chunk}")
    n_chunks = triton.cdiv(L, chunk)
    # H200 run 10 at dim 1536, N 16: "nblock" wins with 128 and 512 (chunk, batch, group)
    # cells (2.65 vs 3.44 ms at batch 8, L=2048 fp32), "column" with 16 (0.42 vs 0.56 ms at
    # batch 1): with few cells, "nblock"'s one-warp programs over 8-channel groups leave SMs idle.
    # Run 13 (bench_scan_bwd.py --layouts): below that, "serial" beats both wherever it applies
    # (batch 8 L=128: 0.32 vs 0.64 ms bf16; batch 1 L=512: 0.28 vs 0.63 ms fp32), and loses to
    # "nblock" above it (batch 8 L=2048: 2.94 vs 2.63 ms fp32).
    # Run 14, after the partial sums became one launch (partials.py), with CUDA-graph times:
    # at 16 cells (batch 1, L=2048) "nblock" beats "serial" in both layouts and dtypes, host-
    # launched too (fp32 L-major 0.357 vs 0.388 ms, bf16 0.324 vs 0.375; channel-innermost
    # 0.419 vs 0.499 and 0.482 vs 0.569). At 4 and 8 cells (batch 1 L=512, batch 8 L=128) the
    # two are within 5 % of GPU time on L-major input, and "serial", which needs no staging
    # copies, is 1.5-2x faster host-launched on channel-innermost input: the threshold is 16.
    # Run 23 (calls 2 and 6, Triton 3.6, CUDA-graph ms), after the serial kernel's sums became
    # halvings and its programs walk slices of channel blocks: one-warp "serial" beats "nblock" at
    # every measured shape. Batch 8 L=2048 L-major bf16 1.636 vs 1.949, fp32 1.761 vs 2.169;
    # channel-innermost (both staged) 1.819 vs 2.135 and 2.116 vs 2.528; batch 1 L=2048 bf16
    # 0.224 vs 0.272; batch 8 L=128 bf16 0.128 vs 0.169; batch 1 L=512 0.076 vs 0.091. Reading
    # channel-innermost [steps, channels] tiles as they are is slower than its L-major time plus
    # the staging copies at batch 8 L=2048 (2 warps: 2.465 vs 1.984 ms bf16), within 0.01 ms
    # below 16 cells, where the copies' host time counts: from 16 cells it stages.
    prefetch = overrides.get("prefetch")
    if prefetch not in (None, 0, 1, 2):
        raise ValueError(f"selective_scan_bwd: tiles prefetch must be 0, 1 (L1) or 2 (L2), got {prefetch!r}")
    variant = overrides.get("variant")
    if not variant:
        if N <= _SERIAL_MAX_N:
            variant = "serial"
        else:
            variant = "nblock" if n_chunks * batch * G >= _STAGE_MIN_CELLS else "column"
    if variant not in _VARIANTS:
        raise ValueError(f"selective_scan_bwd: tiles variant must be one of {_VARIANTS}, got {variant!r}")
    max_registers = overrides.get("max_registers")
    if max_registers is not None and not (isinstance(max_registers, int) and 32 <= max_registers <= 255):
        raise ValueError(f"selective_scan_bwd: tiles max_registers must be an int in [32, 255], got {max_registers!r}")
    if variant == "serial":
        return _serial_tiles(batch, dim_per_group, L, N, G, sms, overrides)
    if max_registers is not None:
        raise ValueError(f"selective_scan_bwd: tiles max_registers needs variant 'serial' (variant {variant!r})")
    if overrides.get("stage") is False:
        raise ValueError(f"selective_scan_bwd: tiles stage=False needs variant 'serial' (variant {variant!r} "
                         "reads L-major rows only)")
    if variant == "nblock":
        nb = overrides.get("nb") or min(4, triton.next_power_of_2(N))
        if nb & (nb - 1):
            raise ValueError(f"selective_scan_bwd: tiles nb must be a power of two, got {nb}")
        if overrides.get("block_d") not in (None, 1):
            raise ValueError("selective_scan_bwd: tiles block_d must be 1 for variant 'nblock' (one channel "
                             f"per step), got {overrides['block_d']}")
        block_d = 1
        num_warps = overrides.get("num_warps") or _warps_for(nb * chunk, _NBLOCK_ELEMS_PER_THREAD)
        group_d = overrides.get("group_d") or _NBLOCK_GROUP_D
    else:
        nb = group_d = 1
        block_d = overrides.get("block_d") or min(_BLOCK_D, dpg)
        num_warps = overrides.get("num_warps") or _warps_for(block_d * chunk, _STEPS)
    if variant == "nblock":
        # ~250 registers: 8 one-warp programs per SM.
        fill = _slices_for_waves(_NBLOCK_WAVES, _NBLOCK_WARPS_PER_SM * sms // num_warps, n_chunks * batch * G)
    else:
        fill = triton.cdiv(_WARPS_PER_SM * sms, num_warps * n_chunks * batch * G)
    splits = overrides.get("num_splits") or min(fill, triton.cdiv(dim_per_group, block_d), _max_splits(dim_per_group))
    # Each slice is a whole number of channel blocks, so only a group's last block is ragged.
    per_split = triton.cdiv(triton.cdiv(dim_per_group, splits), block_d) * block_d
    return Tiles(
        chunk=chunk,
        block_d=block_d,
        num_splits=triton.cdiv(dim_per_group, per_split),
        num_warps=num_warps,
        variant=variant,
        nb=nb,
        group_d=group_d,
        prefetch=prefetch,
        stage=True,
    )


class StateTiles(NamedTuple):
    """Launch shape of the chunk-state kernel (the forward's tile, ``scan_fwd_config``)."""

    block_d: int
    chunk_t: int
    n_per_thread: int
    lanes_n: int
    num_warps: int
    max_registers: Optional[int]


# Steps per thread in the chunk-state kernel at most. The forward's 16 (N <= 16) is 1.1-1.4x
# slower here (H200 run 21, bench_chunk_state.py, batch 8 / 1, L=2048, N 16: bf16 L-major
# 0.266 / 0.037 ms with 8 against 0.306 / 0.043 with 16; channel-innermost equal): the kernel
# also carries C*g and the decays' sum, more live tiles per step than the forward's readout.
_STATE_MAX_CHUNK_T = 8


@functools.lru_cache(maxsize=1024)
def _state_tiles(rows: int, dim: int, chunk: int, N: int, dim_per_group: int, sms: int) -> StateTiles:
    """The forward's tile for ``rows`` = batch * chunks sequences of one chunk each."""
    fc = scan_fwd_config(rows, dim, chunk, N, dim_per_group, sms)
    block_n = triton.next_power_of_2(N)
    lanes_n = min(fc.lanes_n, block_n)
    return StateTiles(fc.block_d, min(fc.chunk_t, _STATE_MAX_CHUNK_T), max(1, block_n // lanes_n), lanes_n,
                      fc.num_warps, fc.max_registers)


def _prefetch_level(prefetch: Optional[int], u: torch.Tensor) -> int:
    if not u.is_cuda:
        return 0
    return (1 if u.dtype == torch.float32 else 0) if prefetch is None else prefetch


# The launcher's default tiles depend only on sizes and the device: cached, because at batch 1 or
# short L the backward is host-bound and this choice costs ~15 µs of Python per call.
_default_tiles = functools.lru_cache(maxsize=1024)(choose_tiles)


def _serial_lanes_n(N: int) -> int:
    return min(triton.next_power_of_2(N), 4)


def _serial_block_d(dim_per_group: int, lanes_n: int, num_warps: int) -> int:
    # One channel per lane group; a group's last block may be ragged (masked), never crossing
    # into the next group (one B/C tile per program).
    return min((32 // lanes_n) * num_warps, triton.next_power_of_2(dim_per_group))


def _slices_for_waves(waves: int, resident: int, cells: int) -> int:
    """Channel slices per (chunk, batch, group) cell for ``waves`` whole waves of ``resident``
    programs: rounded down, so that no last wave of a few programs doubles the time; several
    waves even out the programs' ends."""
    return max(1, waves * resident // cells)


def _max_splits(dim_per_group: int) -> int:
    # dB/dC are reduced through one (batch, G, N, L) partial per channel slice. Capping the
    # slices at an eighth of the channels keeps those partials far below a (batch, dim, L, N)
    # tensor even for narrow layers, where filling the SMs alone would give every channel one.
    return max(1, dim_per_group // 8)


def _serial_tiles(batch: int, dim_per_group: int, L: int, N: int, G: int, sms: int, overrides: dict) -> Tiles:
    if N > _SERIAL_MAX_N:
        raise ValueError(f"selective_scan_bwd: tiles variant 'serial' supports N <= {_SERIAL_MAX_N}, got N={N}")
    steps = overrides.get("steps") or _SERIAL_STEPS
    if steps & (steps - 1):
        raise ValueError(f"selective_scan_bwd: tiles steps must be a power of two, got {steps}")
    chunk = overrides.get("chunk") or min(max(_SERIAL_CHUNK, steps), steps * _SERIAL_SUB,
                                          max(steps, triton.next_power_of_2(L)))
    if chunk & (chunk - 1) or not steps <= chunk <= steps * _SERIAL_SUB:
        raise ValueError(f"selective_scan_bwd: tiles chunk for variant 'serial' must be a power of two in "
                         f"[steps, steps * {_SERIAL_SUB}] = [{steps}, {steps * _SERIAL_SUB}], got {chunk}")
    lanes_n = _serial_lanes_n(N)
    num_warps = overrides.get("num_warps") or _SERIAL_WARPS
    block_d = overrides.get("block_d") or _serial_block_d(dim_per_group, lanes_n, num_warps)
    if block_d & (block_d - 1):
        raise ValueError(f"selective_scan_bwd: tiles block_d for variant 'serial' must be a power of two, "
                         f"got {block_d}")
    num_warps = max(1, min(num_warps, block_d * lanes_n // 32))
    blocks = triton.cdiv(dim_per_group, block_d)
    cells = triton.cdiv(L, chunk) * batch * G
    max_registers = overrides.get("max_registers")
    splits = overrides.get("num_splits")
    if splits is None:
        # Whole waves of resident programs (rounded down, as for "nblock"), no more slices than
        # that: each slice's dB/dC partial costs a write in the chunk kernel and a read in the
        # final sum, ~4 MB a slice at batch 8, L=2048, N=16.
        # A register cap lets more one-warp programs share an SM (64K registers, 32 a warp's row).
        resident = _SERIAL_WARPS_PER_SM if max_registers is None else 65536 // (32 * max_registers)
        splits = _slices_for_waves(_SERIAL_WAVES, resident * sms // num_warps, cells)
        splits = min(splits, blocks, _max_splits(dim_per_group))
    elif not 1 <= splits <= _max_splits(dim_per_group):
        raise ValueError(f"selective_scan_bwd: tiles num_splits={splits} for variant 'serial' must be in [1, "
                         f"{_max_splits(dim_per_group)}] for {dim_per_group} channels per group: each slice has "
                         f"a dB/dC partial, and they must stay far below a (batch, dim, L, N) tensor")
    # Each slice is a whole number of channel blocks, so only a group's last slice is short.
    per_split = triton.cdiv(blocks, splits) * block_d
    return Tiles(
        chunk=chunk,
        block_d=block_d,
        num_splits=triton.cdiv(dim_per_group, per_split),
        num_warps=num_warps,
        variant="serial",
        steps=steps,
        lanes_n=lanes_n,
        stage=cells >= _STAGE_MIN_CELLS if overrides.get("stage") is None else overrides["stage"],
        max_registers=max_registers,
    )


def _warps_for(tile: int, per_thread: int) -> int:
    # Fewer elements per thread leave the per-column overhead (loads, the scan's cross-lane
    # steps) unamortised; more cost registers (the chunk kernel keeps ~15 live tiles).
    return max(1, min(8, tile // (32 * per_thread)))


def _column_sum_rows(several_blocks: bool, du, ddelta, dz):
    """fp32 (batch, dim, L) rows that carry the "nblock" kernel's sums over state columns
    (q = dh . B into du's row, s into ddelta's, the pre-gate y into dz's) between column blocks.

    An fp32 output is its own row: the kernel reads its running sum back from it and overwrites
    it with the finished gradient at the last block. A half-precision output cannot hold the
    sum, so it gets an fp32 row of its own. With one block nothing is carried.
    """
    def row(out):
        if out is None or not several_blocks or out.dtype == torch.float32:
            return out
        return torch.empty(out.shape, device=out.device, dtype=torch.float32)

    return row(du), row(ddelta), row(dz)


def _l_major(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """An L-contiguous copy of a channel-innermost ``t``; any other ``t`` as it is (a stride-0
    broadcast dy, say, stays a broadcast).

    The backward kernels give each program a few channels (``group_d``, 8 by default) and walk
    them along L, so a channel-innermost tensor (the layout nn.Linear-based Mamba code hands the
    op, kernels/layout.py) would cost a 32-byte sector per time step for 16 useful bytes in
    bf16, on every load of u, delta, z and dy. One copy each (a read and a write of the tensor,
    through ``restride_into``: ``Tensor.contiguous`` was ~6x slower than its bytes) is cheaper
    than that and keeps the kernels' measured tiles valid.
    """
    if t is None or not dim_innermost(t):
        return t
    return restride_into(torch.empty(t.shape, dtype=t.dtype, device=t.device), t)


def _in_layout_of(like: Optional[torch.Tensor], grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``grad`` in ``torch.empty_like(like)``'s layout (a copy only when the kernel wrote an
    L-major stand-in for a channel-innermost input)."""
    if grad is None or grad.stride() == like.stride():
        return grad
    # empty_like's strides for ``like``, read without allocating (a non-dense ``like``, a chunk
    # of HF's in_proj output, gets contiguous ones, which may already be the kernel's).
    if torch.empty_like(like, device="meta").stride() == grad.stride():
        return grad
    return restride_into(torch.empty_like(like), grad)


def _strides(x: Optional[torch.Tensor], n: int):
    """x's strides, or n zeros for an absent optional tensor (its kernel flag keeps it unread)."""
    return x.stride() if x is not None else (0,) * n


def _state_pass(A, total, initial_state, dlast_state, hs, rs, dinit) -> None:
    """Chains the chunk-state kernel's per-chunk workspaces in place (``_state_pass_kernel``):
    hs (batch, chunks, dim, N) becomes h entering each chunk, rs dL/dh at each chunk's end, and
    dinit (when not None) receives dL/d initial_state."""
    batch, n_chunks, dim, N = hs.shape
    pass_n = triton.next_power_of_2(N)
    # 4 elements a thread (see the kernel): one warp covers 128 of a row; N > 128 takes more.
    pass_warps = max(_PASS_WARPS, pass_n // 128)
    pass_d = max(1, 128 * pass_warps // pass_n)

    _state_pass_kernel[(batch, triton.cdiv(dim, pass_d))](
        A, total, initial_state, dlast_state, hs, rs, dinit,
        dim, N, n_chunks,
        *A.stride(), *_strides(initial_state, 3), *_strides(dlast_state, 3),
        HAS_INIT=initial_state is not None, HAS_DLAST=dlast_state is not None,
        BLOCK_D=pass_d, BLOCK_N=pass_n, ROWS=_PASS_ROWS, num_warps=pass_warps,
        **LAUNCH_OPTIONS,
    )


def _empty_grads(u, delta, A, B, C, D, z, delta_bias, initial_state) -> ScanGrads:
    # No (batch, channel) pair: the per-element gradients are empty, and the sums over them
    # (dA, dD, ddelta_bias, and dB/dC, which sum over channels and stay non-empty when only
    # dim is 0) are zeros.
    def zeros(t):
        return None if t is None else torch.zeros_like(t)

    return ScanGrads(
        du=torch.empty_like(u), ddelta=torch.empty_like(delta), dA=zeros(A), dB=torch.zeros_like(B),
        dC=torch.zeros_like(C), dD=zeros(D), dz=None if z is None else torch.empty_like(z),
        ddelta_bias=zeros(delta_bias),
        dinitial_state=None if initial_state is None else torch.empty_like(initial_state, dtype=torch.float32),
    )


def selective_scan_bwd(
    dy: torch.Tensor,
    dlast_state: Optional[torch.Tensor],
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
    *,
    tiles: Optional[dict] = None,
) -> ScanGrads:
    """Gradients of ``selective_scan`` by recomputation; inputs already validated by the op.

    Args:
        dy: (batch, dim, L), the gradient of y. dlast_state: (batch, dim, N) or None, the
            gradient of the returned last state (seeds dh at the last step).
        u, delta, z: (batch, dim, L). A: (dim, N). B, C: (batch, G, N, L).
        D, delta_bias: (dim,) or None. initial_state: (batch, dim, N) or None.
        tiles: overrides of ``choose_tiles`` (fields of ``Tiles``), for tests and tuning.

    Returns:
        ``ScanGrads``; dB/dC in the (batch, G, N, L) layout, dinitial_state fp32.

    Example:
        >>> grads = selective_scan_bwd(dy, None, u, delta, A, B, C, D, z, bias, True, None)
    """
    _check_inputs(dy, dlast_state, u, B, C, initial_state)
    # The gradients keep the layouts the op promises (their inputs'); the kernels work on
    # L-major copies where an input is not L-major (see _l_major).
    promised = dict(du=u, ddelta=delta, dz=z)
    batch, dim, L = u.shape
    G, N = B.shape[1], B.shape[2]
    if batch == 0 or dim == 0:
        # Nothing to launch (and no grid to size): no (batch, channel) pair, no gradient.
        return _empty_grads(u, delta, A, B, C, D, z, delta_bias, initial_state)
    # The kernels read D and delta_bias at unit stride (they are (dim,) vectors, loaded once a
    # program); an expanded or sliced parameter is copied, which costs dim elements.
    D = None if D is None else D.contiguous()
    delta_bias = None if delta_bias is None else delta_bias.contiguous()
    dim_per_group = dim // G
    if tiles:
        cfg = choose_tiles(batch, dim, L, N, G, u.device, **tiles)
    else:
        cfg = _default_tiles(batch, dim, L, N, G, u.device)
    if cfg.stage:
        dy, u, delta, z = _l_major(dy), _l_major(u), _l_major(delta), _l_major(z)
    n_chunks = triton.cdiv(L, cfg.chunk)
    num_splits = cfg.num_splits
    dim_per_split = triton.cdiv(triton.cdiv(dim_per_group, num_splits), cfg.block_d) * cfg.block_d

    f32 = dict(device=u.device, dtype=torch.float32)
    hs = torch.empty(batch, n_chunks, dim, N, **f32)
    rs = torch.empty(batch, n_chunks, dim, N, **f32)
    total = torch.empty(batch, n_chunks, dim, **f32)
    dinit = torch.empty(batch, dim, N, **f32) if initial_state is not None else None
    du = torch.empty_like(u)
    ddelta = torch.empty_like(delta)
    dz = torch.empty_like(z) if z is not None else None
    dA_part = torch.empty(batch, n_chunks, dim, N, **f32)
    # "column" accumulates into them in place, so they start at zero; "nblock" writes each once.
    partial = torch.zeros if cfg.variant == "column" else torch.empty
    dB_part = partial(num_splits, batch, G, N, L, **f32)
    dC_part = partial(num_splits, batch, G, N, L, **f32)
    dD_part = torch.empty(batch, n_chunks, dim, **f32) if D is not None else None
    ddb_part = torch.empty(batch, n_chunks, dim, **f32) if delta_bias is not None else None

    st = _state_tiles(batch * n_chunks, dim, cfg.chunk, N, dim_per_group, _num_sms(u.device))
    _chunk_state_kernel[(triton.cdiv(dim, st.block_d), batch, n_chunks)](
        u, delta, dy, z, A, B, C, delta_bias, hs, rs, total,
        dim, L, N, n_chunks, dim_per_group,
        *u.stride(), *delta.stride(), *dy.stride(), *_strides(z, 3), *A.stride(), *B.stride(),
        *C.stride(),
        DELTA_SOFTPLUS=delta_softplus, HAS_Z=z is not None, HAS_DELTA_BIAS=delta_bias is not None,
        BLOCK_D=st.block_d, CHUNK_T=st.chunk_t, N_PER_THREAD=st.n_per_thread, LANES_N=st.lanes_n,
        CHUNK=cfg.chunk, num_warps=st.num_warps, maxnreg=st.max_registers,
        **LAUNCH_OPTIONS,
    )
    _state_pass(A, total, initial_state, dlast_state, hs, rs, dinit)
    if cfg.variant == "column":
        _chunk_bwd_kernel[(n_chunks, batch, G * num_splits)](
            dy, u, delta, A, B, C, D, z, delta_bias, hs, rs,
            du, ddelta, dz, dA_part, dB_part, dC_part, dD_part, ddb_part,
            batch, dim, L, N, G, n_chunks, dim_per_group, dim_per_split, num_splits,
            *dy.stride(), *u.stride(), *delta.stride(), *A.stride(), *B.stride(), *C.stride(),
            *_strides(z, 3), *du.stride(), *ddelta.stride(), *_strides(dz, 3),
            DELTA_SOFTPLUS=delta_softplus, HAS_D=D is not None, HAS_Z=z is not None,
            HAS_DELTA_BIAS=delta_bias is not None, BLOCK_D=cfg.block_d, CHUNK=cfg.chunk, STEPS=_STEPS,
            num_warps=cfg.num_warps,
            **LAUNCH_OPTIONS,
        )
    elif cfg.variant == "serial":
        kernel, options = launcher(_chunk_bwd_serial_kernel, False, cfg.max_registers)
        kernel[(n_chunks, batch, G * num_splits)](
            dy, u, delta, A, B, C, D, z, delta_bias, hs, rs,
            du, ddelta, dz, dA_part, dB_part, dC_part, dD_part, ddb_part,
            batch, dim, L, N, G, n_chunks, dim_per_group, dim_per_split, num_splits,
            *dy.stride(), *u.stride(), *delta.stride(), *A.stride(), *B.stride(), *C.stride(),
            *_strides(z, 3), *du.stride(), *ddelta.stride(), *_strides(dz, 3),
            DELTA_SOFTPLUS=delta_softplus, HAS_D=D is not None, HAS_Z=z is not None,
            HAS_DELTA_BIAS=delta_bias is not None, BLOCK_D=cfg.block_d, T=cfg.steps,
            N_PER_THREAD=triton.next_power_of_2(N) // cfg.lanes_n, LANES_N=cfg.lanes_n, CHUNK=cfg.chunk,
            PAIR_DC=_PAIR_DC, num_warps=cfg.num_warps,
            **options,
        )
    else:
        q_acc, s_acc, y_acc = _column_sum_rows(cfg.nb < N, du, ddelta, dz)
        _chunk_bwd_nblock_kernel[(n_chunks, batch, G * num_splits)](
            dy, u, delta, A, B, C, D, z, delta_bias, hs, rs,
            du, ddelta, dz, dA_part, dB_part, dC_part, dD_part, ddb_part, q_acc, s_acc, y_acc,
            batch, dim, L, N, G, n_chunks, dim_per_group, dim_per_split, num_splits, cfg.group_d,
            *dy.stride(), *u.stride(), *delta.stride(), *A.stride(), *B.stride(), *C.stride(),
            *_strides(z, 3), *du.stride(), *ddelta.stride(), *_strides(dz, 3),
            *q_acc.stride(), *s_acc.stride(), *_strides(y_acc, 3),
            DELTA_SOFTPLUS=delta_softplus, HAS_D=D is not None, HAS_Z=z is not None,
            HAS_DELTA_BIAS=delta_bias is not None, NB=cfg.nb, CHUNK=cfg.chunk, STEPS=_STEPS,
            PREFETCH=_prefetch_level(cfg.prefetch, u), num_warps=cfg.num_warps,
            **LAUNCH_OPTIONS,
        )
    du, ddelta, dz = (_in_layout_of(promised[name], g) for name, g in (("du", du), ("ddelta", ddelta), ("dz", dz)))
    jobs = [(dA_part, 2, A.shape, A.dtype), (dB_part, 1, dB_part.shape[1:], B.dtype),
            (dC_part, 1, dC_part.shape[1:], C.dtype)]
    if D is not None:
        jobs.append((dD_part, 2, D.shape, D.dtype))
    if delta_bias is not None:
        jobs.append((ddb_part, 2, delta_bias.shape, delta_bias.dtype))
    dA, dB, dC, *rest = sum_partials(jobs)
    return ScanGrads(
        du=du,
        ddelta=ddelta,
        dA=dA,
        dB=dB,
        dC=dC,
        dD=rest.pop(0) if D is not None else None,
        dz=dz,
        ddelta_bias=rest.pop(0) if delta_bias is not None else None,
        dinitial_state=dinit,
    )
