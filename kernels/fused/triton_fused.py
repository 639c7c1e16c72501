"""Fused Mamba-block scan in Triton: causal conv1d (+ silu), and optionally the dt projection,
inside the selective-scan forward kernel (levels 1 and 2; the dt level alone is the level-0
kernel's, see below).

What each fusion level really saves (HBM traffic of one Mamba-1 mixer forward)
------------------------------------------------------------------------------
Let E = batch * dim * L elements and s the activation size (2 B bf16, 4 B fp32). At level 0
(split: ``ssm.causal_conv1d``, x_proj/dt_proj matmuls, ``ssm.selective_scan``) the tensors of
E elements move as follows:

* conv:    reads the pre-conv x (E), writes u = silu(conv(x)) (E);
* x_proj:  reads u (E), writes x_dbl = (dt_low, B, C), (batch, L, R + 2N): small (R = dim/16);
* dt_proj: reads dt_low (small), writes delta = W_dt @ dt_low (E);
* scan:    reads u, delta, z (3E), writes y (E).

That is 8E * s of elementwise traffic (plus the small x_dbl and the in/out projections).

**Level 1** (conv + silu + scan + D + z in one kernel, reading the pre-conv x with a halo of W-1
steps that is re-read from L1/L2 rather than carried): the scan reads x instead of u. But x_proj
is a matmul over u and produces B, C and dt, which the scan needs *before* it starts, so u must
still be materialised by a separate conv for x_proj. In a Mamba block level 1 therefore saves
**nothing** (the scan's read of u becomes a read of x: same bytes) and adds W multiply-adds
and the conv's registers to the scan. It only wins where the conv output has no other consumer
(a selective_scan_ref-style function that takes its u straight from the conv); the heuristic
(``ssm_compile/heuristic.py``) models exactly that and does not pick level 1 when the conv
output also feeds x_proj.

**Level 2** (level 1 + delta = W_dt @ dt_low + bias + softplus inside the kernel, reading
dt_low through a strided view of the x_proj output): delta never exists in HBM, which removes
its write and its read: 2E * s of the 8E * s, i.e. up to 25% of the block's elementwise traffic
(the scan alone goes from 4E to 3E). The cost is one [CHUNK_T, R] x [R, BLOCK_D] tensor-core
product per chunk (``triton_common.dot_f32``; R padded to a power of two >= 16, fp32 operands
as three tf32 products), W_dt^T held per program, and the product's layout conversion into
the scan's tile. (Until run 19 it was an R-long FMA loop per (t, d) on every state lane,
2-30x slower than split.)

**The dt level** (the dt projection alone, conv output read as u: the combination with the
traffic win and no conv overhead) is not this kernel: it is the level-0 kernel with its
``DT_RANK_PAD`` stage (``selective_scan_fwd_launch(..., dt_weight=...)``), so it keeps that
kernel's time split, prefetch, register cap and states. ``fused_scan_fwd`` routes it there.
Measured (H200, run 19, ``benchmarks/probe_dt_fusion.py``, batch 8, dim 1536, L 2048, N 16,
R 48, HF's layouts): dt_proj matmul + scan 0.247 ms bf16 / 0.319 fp32; the fused scan 0.324 /
0.365, with the same registers and no spills. The product costs ~28 of ~673 loop instructions
offline, yet ~0.1 ms on the GPU: it and its result's layout conversion (three more barriers)
sit on each chunk's critical path in a loop that is latency-bound at 12 warps per SM, as run
17's experiment with the same design found (benchmarks/NOTES_scan_fwd.md). So the numbers
decide and ``fuse="auto"`` keeps split.

Limits of this kernel, by design: no time split across programs (the level-0 kernel splits L
when batch * dim is too small to fill the GPU; this one does not, so the heuristic passes the
conv levels over for those shapes), no software prefetch of the next chunk (the level-0 kernel
has one; here it would hold the conv halo and dt_low tiles of two chunks at once), no
initial/last state (a prefill with a cache can only take the dt level), and forward only (see
``op.py``).

Layers: ``_fused_scan_kernel`` (jit), ``fused_scan_fwd`` (launcher). Tiles come from the
level-0 kernel's ``scan_fwd_config`` (same register tile, same layout reasoning).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..selective_scan.triton_fwd import (ScanFwdConfig, _last_step, _next_pow2, _state_tile, check_block_in_group,
                                         scan_fwd_config,
                                         selective_scan_fwd_launch)
from ..layout import empty_activation
from ..triton_common import (LAUNCH_OPTIONS, LOG2E, dt_dot_meta, finite_decay_rate, linear_combine, num_sms,
                             project_dt, silu, softplus)



class FusedLaunch(NamedTuple):
    """What a launch produced: y, the last state (None unless requested), and the compiled
    kernel (None under the interpreter), whose ``n_regs`` / ``n_spills`` the heuristic reads to
    correct its register estimate."""

    y: torch.Tensor
    last_state: Optional[torch.Tensor]
    compiled: object


@triton.heuristics(
    {
        "HAS_D": lambda args: args["D_ptr"] is not None,
        "HAS_Z": lambda args: args["z_ptr"] is not None,
        "HAS_DELTA_BIAS": lambda args: args["delta_bias_ptr"] is not None,
        "HAS_CONV_BIAS": lambda args: args["conv_b_ptr"] is not None,
        "FUSE_DT": lambda args: args["dt_w_ptr"] is not None,
    }
)
@triton.jit
def _fused_scan_kernel(
    # pointers
    x_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, delta_bias_ptr,
    conv_w_ptr, conv_b_ptr, dt_w_ptr, y_ptr,
    # sizes
    dim, L, N, R, dims_per_group,
    # strides
    stride_x_b, stride_x_d, stride_x_l,
    stride_delta_b, stride_delta_c, stride_delta_l,  # c: dim, or dt_rank when FUSE_DT
    stride_A_d, stride_A_n,
    stride_B_b, stride_B_g, stride_B_n, stride_B_l,
    stride_C_b, stride_C_g, stride_C_n, stride_C_l,
    stride_D, stride_delta_bias,
    stride_z_b, stride_z_d, stride_z_l,
    stride_cw_d, stride_cw_k, stride_cb,
    stride_dtw_d, stride_dtw_r,
    stride_y_b, stride_y_d, stride_y_l,
    # meta-parameters
    BLOCK_D: tl.constexpr, CHUNK_T: tl.constexpr,
    N_PER_THREAD: tl.constexpr, LANES_N: tl.constexpr,
    W: tl.constexpr, CONV_SILU: tl.constexpr,
    DELTA_SOFTPLUS: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DELTA_BIAS: tl.constexpr,
    HAS_CONV_BIAS: tl.constexpr, FUSE_DT: tl.constexpr,
    DT_RANK_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,  # as in the level-0 kernel
    N_RAGGED: tl.constexpr = False,  # as in the level-0 kernel
):
    # Same 4-D tile as the level-0 kernel: [CHUNK_T, N_PER_THREAD, BLOCK_D, LANES_N], time and
    # N_PER_THREAD inside a thread (serial scan, register readout). Do not reorder the axes.
    pid_d = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)

    offs_d, offs_bn, mask_d, mask_bn, offs_n3, offs_d3, mask_dn, pid_g = _state_tile(
        pid_d, dim, N, dims_per_group, BLOCK_D, N_PER_THREAD, LANES_N)

    x_ptr += pid_b * stride_x_b
    delta_ptr += pid_b * stride_delta_b
    if HAS_Z:
        z_ptr += pid_b * stride_z_b
    y_ptr += pid_b * stride_y_b
    B_ptr += pid_b * stride_B_b + pid_g * stride_B_g
    C_ptr += pid_b * stride_C_b + pid_g * stride_C_g

    A = finite_decay_rate(tl.load(A_ptr + offs_d3 * stride_A_d + offs_n3 * stride_A_n, mask=mask_dn,
                                  other=0.0).to(tl.float32) * LOG2E)  # [N_PER_THREAD, BLOCK_D, LANES_N]
    if HAS_DELTA_BIAS:
        delta_bias = tl.load(delta_bias_ptr + offs_d * stride_delta_bias, mask=mask_d,
                             other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d * stride_D, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_CONV_BIAS:
        conv_b = tl.load(conv_b_ptr + offs_d * stride_cb, mask=mask_d, other=0.0).to(tl.float32)
    if FUSE_DT:
        # W_dt^T [R, BLOCK_D] once per program, in dt_low's dtype (the split matmul's cast).
        offs_r = tl.arange(0, DT_RANK_PAD)
        w_dt = tl.load(dt_w_ptr + offs_r[:, None] * stride_dtw_r + offs_d[None, :] * stride_dtw_d,
                       mask=(offs_r < R)[:, None] & mask_d[None, :],
                       other=0.0).to(delta_ptr.dtype.element_ty)

    h = tl.zeros((N_PER_THREAD, BLOCK_D, LANES_N), tl.float32)
    # Give the carry the chunk tile's layout from the start (see triton_fwd.py: a carry born
    # as a plain tile costs a shared-memory round trip per chunk).
    h = _last_step(tl.broadcast_to(h[None, :, :, :], (CHUNK_T, N_PER_THREAD, BLOCK_D, LANES_N)),
                   CHUNK_T)

    for t0 in range(0, L, CHUNK_T):
        offs_t = t0 + tl.arange(0, CHUNK_T)
        mask_t = offs_t < L
        mask_td = mask_t[:, None] & mask_d[None, :]

        # u[t] = act(bias + sum_k w[k] * x[t - (W-1) + k]); the W-1 halo steps before the
        # chunk are re-read (they hit L1/L2) instead of shifted in registers, which Triton
        # cannot express. Times before 0 read as 0: no initial conv state at this level.
        acc = tl.zeros((CHUNK_T, BLOCK_D), tl.float32)
        for k in tl.static_range(W):
            pos = offs_t - (W - 1) + k
            xk = tl.load(x_ptr + pos[:, None] * stride_x_l + offs_d[None, :] * stride_x_d,
                         mask=((pos >= 0) & (pos < L))[:, None] & mask_d[None, :], other=0.0)
            wk = tl.load(conv_w_ptr + offs_d * stride_cw_d + k * stride_cw_k, mask=mask_d,
                         other=0.0)
            acc += wk.to(tl.float32)[None, :] * xk.to(tl.float32)
        if HAS_CONV_BIAS:
            acc += conv_b[None, :]
        if CONV_SILU:
            acc = silu(acc)
        # Round through x's dtype as the split path's conv output is rounded, so the fused
        # level's u carries the same rounding as the split level's.
        uf = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        # Padded timesteps must be the identity step: u = 0 there, which the conv bias and
        # the halo taps are not.
        uf = tl.where(mask_td, uf, 0.0)  # [CHUNK_T, BLOCK_D]

        if FUSE_DT:
            # delta = dt_low^T @ W_dt^T for the chunk, one tensor-core product
            # ([CHUNK_T, R] x [R, BLOCK_D]); dt_low is read through the x_proj output's strided
            # view (no copy). An R-long FMA loop per (t, d) on every state lane made this level
            # 2-30x slower than split (H200, run 10).
            dtl = tl.load(delta_ptr + offs_t[:, None] * stride_delta_l + offs_r[None, :] * stride_delta_c,
                          mask=mask_t[:, None] & (offs_r < R)[None, :], other=0.0)
            dt = project_dt(dtl, w_dt, DOT_PRECISION)
        else:
            dt = tl.load(delta_ptr + offs_t[:, None] * stride_delta_l + offs_d[None, :] * stride_delta_c,
                         mask=mask_td, other=0.0).to(tl.float32)
        if HAS_DELTA_BIAS:
            dt += delta_bias[None, :]
        if DELTA_SOFTPLUS:
            dt = softplus(dt)
        # dt = 0 on padded steps: a = exp2(0) = 1, b = 0, nothing leaks into the carry.
        dt = tl.where(mask_td, dt, 0.0)
        dtu = dt * uf

        mask_tn = mask_t[:, None, None] & mask_bn[None, :, :]
        Bf = tl.load(B_ptr + offs_t[:, None, None] * stride_B_l + offs_bn[None, :, :] * stride_B_n,
                     mask=mask_tn, other=0.0).to(tl.float32)  # [CHUNK_T, N_PER_THREAD, LANES_N]
        Cf = tl.load(C_ptr + offs_t[:, None, None] * stride_C_l + offs_bn[None, :, :] * stride_C_n,
                     mask=mask_tn, other=0.0).to(tl.float32)

        # [CHUNK_T, N_PER_THREAD, BLOCK_D, LANES_N]
        a = tl.exp2(dt[:, None, :, None] * A[None, :, :, :])
        b = dtu[:, None, :, None] * Bf[:, :, None, :]
        # Fold the carry into the first step so the scanned b is the state itself.
        is_first = (tl.arange(0, CHUNK_T) == 0)[:, None, None, None]
        b = tl.where(is_first, a * h[None, :, :, :] + b, b)
        _, hs = tl.associative_scan((a, b), 0, linear_combine)
        h = _last_step(hs, CHUNK_T)

        prod = hs * Cf[:, :, None, :]
        if N_RAGGED:  # a padded lane's NaN (from an infinite dt * u) must not reach y
            prod = tl.where(mask_bn[None, :, None, :], prod, 0.0)
        y = tl.sum(tl.sum(prod, axis=1), axis=2)  # [CHUNK_T, BLOCK_D]
        if HAS_D:
            y += Dv[None, :] * uf
        if HAS_Z:
            z = tl.load(z_ptr + offs_t[:, None] * stride_z_l + offs_d[None, :] * stride_z_d,
                        mask=mask_td, other=0.0)
            y *= silu(z.to(tl.float32))
        tl.store(y_ptr + offs_t[:, None] * stride_y_l + offs_d[None, :] * stride_y_d,
                 y.to(y_ptr.dtype.element_ty), mask=mask_td)


def fused_config(batch: int, dim: int, L: int, N: int, dims_per_group: int,
                 num_sms: int) -> ScanFwdConfig:
    """The level-0 tiles without the time split (the fused kernel walks all of L)."""
    return scan_fwd_config(batch, dim, L, N, dims_per_group, num_sms)._replace(n_segments=1)


def fused_scan_fwd(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    delta_bias: Optional[torch.Tensor],
    delta_softplus: bool,
    conv_weight: Optional[torch.Tensor],
    conv_bias: Optional[torch.Tensor],
    conv_silu: bool,
    dt_weight: Optional[torch.Tensor],
    *,
    initial_state: Optional[torch.Tensor] = None,
    return_last_state: bool = False,
    config: Optional[ScanFwdConfig] = None,
) -> FusedLaunch:
    """Launch the fused kernel (inputs already validated by the op layer).

    Args:
        x: (batch, dim, L): the pre-conv input when ``conv_weight`` is given, else u.
        delta: (batch, dim, L), or dt_low (batch, R, L) when ``dt_weight`` (dim, R) is given.
        A: (dim, N). B, C: (batch, G, N, L). D, delta_bias, conv_bias: (dim,) or None.
        z: (batch, dim, L) or None. conv_weight: (dim, W) or None.
        config: tile override; default ``fused_config``.

    Returns:
        ``FusedLaunch(y, last_state, compiled)``: y (batch, dim, L) in x's dtype.

    The dt projection alone (no conv) runs in the level-0 kernel (``selective_scan_fwd_launch``
    with ``dt_weight``): it keeps that kernel's time split, prefetch, register cap and states
    (``initial_state``, ``return_last_state``), so ``config`` is then a ``scan_fwd_config``.
    With the conv fused this kernel runs; it carries no state.
    """
    if conv_weight is None:
        if dt_weight is None:
            raise ValueError("fused_scan_fwd: nothing to fuse (neither conv_weight nor dt_weight)")
        y, last_state, compiled = selective_scan_fwd_launch(
            x, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, return_last_state,
            dt_weight=dt_weight, config=config)
        return FusedLaunch(y, last_state, compiled)
    if initial_state is not None or return_last_state:
        raise ValueError("fused_scan_fwd: initial_state/return_last_state need conv_weight=None")
    batch, dim, L = x.shape
    G, N = B.shape[1], B.shape[2]
    dims_per_group = dim // G
    block_n = _next_pow2(N)
    if config is None:
        n_sms = num_sms(x.device.index) if x.is_cuda else 132
        config = fused_config(batch, dim, L, N, dims_per_group, n_sms)
    check_block_in_group(config, G, dims_per_group)
    R = dt_weight.shape[1] if dt_weight is not None else 0
    # The batch offset is int64 in the kernel; offsets within one batch row are int32.
    for name, t in (("x", x), ("delta", delta), ("z", z), ("B", B), ("C", C)):
        if t is not None and sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:])) >= 2**31:
            raise ValueError(
                f"{name}: one batch row spans more than 2**31 elements (shape {tuple(t.shape)}, "
                f"strides {t.stride()}); the fused Triton scan indexes rows in int32")
    dt_rank_pad, dot_precision = dt_dot_meta(R, delta.dtype)
    y = empty_activation(x)

    def strides(t, n):
        return t.stride() if t is not None else (0,) * n

    n_per_thread, lanes_n = max(1, block_n // config.lanes_n), min(config.lanes_n, block_n)
    grid = (triton.cdiv(dim, config.block_d), batch)
    compiled = _fused_scan_kernel[grid](
        x, delta, A, B, C, D, z, delta_bias, conv_weight, conv_bias, dt_weight, y,
        dim, L, N, R, dims_per_group,
        *x.stride(), *delta.stride(), *A.stride(), *B.stride(), *C.stride(),
        *strides(D, 1), *strides(delta_bias, 1), *strides(z, 3),
        *strides(conv_weight, 2), *strides(conv_bias, 1), *strides(dt_weight, 2), *y.stride(),
        BLOCK_D=config.block_d, CHUNK_T=config.chunk_t,
        N_PER_THREAD=n_per_thread, LANES_N=lanes_n,
        W=conv_weight.shape[1], CONV_SILU=conv_silu,
        DELTA_SOFTPLUS=delta_softplus,
        DT_RANK_PAD=dt_rank_pad, DOT_PRECISION=dot_precision,
        N_RAGGED=n_per_thread * lanes_n != N,
        num_warps=config.num_warps,
        **LAUNCH_OPTIONS,
    )
    return FusedLaunch(y, None, compiled if x.is_cuda else None)
