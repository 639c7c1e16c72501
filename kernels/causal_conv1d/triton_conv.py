"""Triton kernels and launchers for ``ssm::causal_conv1d`` (forward and backward).

Layout: x, y, dy, dx are (batch, dim, L) with any strides; weight is (dim, W), 2 <= W <= 8, a
constexpr so the W taps unroll. A program owns a [BLOCK_D, BLOCK_L] tile; the W-1 inputs before
the tile (the halo) are re-read from x, or from initial_state before time 0, rather than shifted
in registers, which Triton cannot express. The repeated loads hit L1/L2, so HBM sees each input
about once.

The backward kernel is not autotuned: its dweight/dbias partials are summed in a fixed order so
the result is bitwise reproducible, and the split of L over programs is part of that order.
"""
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ..triton_common import silu as silu_fn
from .cpu import ConvGrads


@triton.jit
def _load_padded(
    # pointers (already offset to this batch row)
    x_ptr, init_ptr,
    # sizes
    offs_d, mask_d, pos, seqlen,
    # strides
    stride_x_d, stride_x_l, stride_init_d, stride_init_k,
    # meta-parameters
    W: tl.constexpr, HAS_INIT: tl.constexpr,
):
    # The input at times `pos`, fp32 [BLOCK_D, len(pos)]: x for 0 <= pos < L, initial_state for
    # the W-1 times before 0, zero elsewhere. Out-of-range lanes are masked, never read, so
    # negative offsets are harmless.
    in_x = (pos >= 0) & (pos < seqlen)
    v = tl.load(
        x_ptr + offs_d[:, None] * stride_x_d + pos[None, :] * stride_x_l,
        mask=mask_d[:, None] & in_x[None, :], other=0.0,
    ).to(tl.float32)
    if HAS_INIT:
        in_init = (pos < 0) & (pos >= 1 - W)
        v += tl.load(
            init_ptr + offs_d[:, None] * stride_init_d + (pos + (W - 1))[None, :] * stride_init_k,
            mask=mask_d[:, None] & in_init[None, :], other=0.0,
        ).to(tl.float32)
    return v


@triton.jit
def _preactivation(
    # pointers
    x_ptr, init_ptr, w_ptr, bias_ptr,
    # sizes
    offs_d, mask_d, pos, seqlen,
    # strides
    stride_x_d, stride_x_l, stride_init_d, stride_init_k, stride_w_d, stride_w_k, stride_bias,
    # meta-parameters
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
):
    # p[t] = bias + sum_k w[k] * input[t - (W-1) + k], fp32 [BLOCK_D, len(pos)].
    w = tl.load(w_ptr + offs_d * stride_w_d, mask=mask_d, other=0.0).to(tl.float32)
    acc = w[:, None] * _load_padded(
        x_ptr, init_ptr, offs_d, mask_d, pos - (W - 1), seqlen,
        stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT,
    )
    for k in tl.static_range(1, W):
        w = tl.load(w_ptr + offs_d * stride_w_d + k * stride_w_k, mask=mask_d, other=0.0)
        acc += w.to(tl.float32)[:, None] * _load_padded(
            x_ptr, init_ptr, offs_d, mask_d, pos + (k - (W - 1)), seqlen,
            stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT,
        )
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d * stride_bias, mask=mask_d, other=0.0)
        acc += bias.to(tl.float32)[:, None]
    return acc


@triton.jit
def _grad_preactivation(
    # pointers
    dy_ptr, x_ptr, init_ptr, w_ptr, bias_ptr,
    # sizes
    offs_d, mask_d, pos, seqlen,
    # strides
    stride_dy_d, stride_dy_l,
    stride_x_d, stride_x_l, stride_init_d, stride_init_k, stride_w_d, stride_w_k, stride_bias,
    # meta-parameters
    W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
):
    # dL/dp at times `pos`, fp32 [BLOCK_D, len(pos)]; zero outside [0, L) because dy is, which is
    # what makes the sums below stop at the sequence ends.
    in_seq = (pos >= 0) & (pos < seqlen)
    dp = tl.load(
        dy_ptr + offs_d[:, None] * stride_dy_d + pos[None, :] * stride_dy_l,
        mask=mask_d[:, None] & in_seq[None, :], other=0.0,
    ).to(tl.float32)
    if SILU:
        # The pre-activation is recomputed (W loads that hit cache) rather than saved by the
        # forward: saving it would cost an activation-sized write and read.
        p = _preactivation(
            x_ptr, init_ptr, w_ptr, bias_ptr, offs_d, mask_d, pos, seqlen,
            stride_x_d, stride_x_l, stride_init_d, stride_init_k, stride_w_d, stride_w_k,
            stride_bias, W, HAS_BIAS, HAS_INIT,
        )
        s = tl.sigmoid(p)
        dp = dp * s * (1.0 + p * (1.0 - s))
    return dp


@triton.jit
def _grad_input(
    # pointers
    dy_ptr, x_ptr, init_ptr, w_ptr, bias_ptr,
    # sizes
    offs_d, mask_d, pos, seqlen,
    # strides
    stride_dy_d, stride_dy_l,
    stride_x_d, stride_x_l, stride_init_d, stride_init_k, stride_w_d, stride_w_k, stride_bias,
    # meta-parameters
    W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
):
    # Input time s feeds outputs s .. s+W-1 through taps W-1 .. 0, so
    # d input[s] = sum_m w[W-1-m] * dp[s + m]: a correlation with the flipped kernel.
    # Returns (d input, dp) at `pos`, both fp32 [BLOCK_D, len(pos)]: the caller reuses the
    # m = 0 term dp for dweight and dbias instead of recomputing it.
    dp = _grad_preactivation(
        dy_ptr, x_ptr, init_ptr, w_ptr, bias_ptr, offs_d, mask_d, pos, seqlen,
        stride_dy_d, stride_dy_l, stride_x_d, stride_x_l, stride_init_d, stride_init_k,
        stride_w_d, stride_w_k, stride_bias, W, SILU, HAS_BIAS, HAS_INIT,
    )
    w = tl.load(w_ptr + offs_d * stride_w_d + (W - 1) * stride_w_k, mask=mask_d, other=0.0)
    acc = w.to(tl.float32)[:, None] * dp
    for m in tl.static_range(1, W):
        w = tl.load(w_ptr + offs_d * stride_w_d + (W - 1 - m) * stride_w_k, mask=mask_d, other=0.0)
        acc += w.to(tl.float32)[:, None] * _grad_preactivation(
            dy_ptr, x_ptr, init_ptr, w_ptr, bias_ptr, offs_d, mask_d, pos + m, seqlen,
            stride_dy_d, stride_dy_l, stride_x_d, stride_x_l, stride_init_d, stride_init_k,
            stride_w_d, stride_w_k, stride_bias, W, SILU, HAS_BIAS, HAS_INIT,
        )
    return acc, dp


@triton.heuristics(
    {
        "HAS_BIAS": lambda args: args["bias_ptr"] is not None,
        "HAS_INIT": lambda args: args["init_ptr"] is not None,
    }
)
@triton.jit
def _causal_conv1d_fwd_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, init_ptr, y_ptr,
    # sizes
    dim, seqlen,
    # strides
    stride_x_b, stride_x_d, stride_x_l,
    stride_w_d, stride_w_k,
    stride_bias,
    stride_init_b, stride_init_d, stride_init_k,
    stride_y_b, stride_y_d, stride_y_l,
    # meta-parameters
    W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    pid_l = tl.program_id(2)
    # int64 offsets: batch * dim * L (or a transposed view's strides) can pass 2**31.
    offs_d = (pid_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    offs_l = (pid_l * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)
    mask_d = offs_d < dim
    x_ptr += pid_b * stride_x_b
    y_ptr += pid_b * stride_y_b
    if HAS_INIT:
        init_ptr += pid_b * stride_init_b

    acc = _preactivation(  # [BLOCK_D, BLOCK_L]
        x_ptr, init_ptr, w_ptr, bias_ptr, offs_d, mask_d, offs_l, seqlen,
        stride_x_d, stride_x_l, stride_init_d, stride_init_k, stride_w_d, stride_w_k,
        stride_bias, W, HAS_BIAS, HAS_INIT,
    )
    if SILU:
        acc = silu_fn(acc)
    tl.store(
        y_ptr + offs_d[:, None] * stride_y_d + offs_l[None, :] * stride_y_l,
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_d[:, None] & (offs_l < seqlen)[None, :],
    )


@triton.heuristics(
    {
        "HAS_BIAS": lambda args: args["bias_ptr"] is not None,
        "HAS_INIT": lambda args: args["init_ptr"] is not None,
    }
)
@triton.jit
def _causal_conv1d_bwd_kernel(
    # pointers
    dy_ptr, x_ptr, w_ptr, bias_ptr, init_ptr,
    dx_ptr, dw_part_ptr, db_part_ptr, dinit_ptr,
    # sizes
    dim, seqlen, blocks_per_program,
    # strides
    stride_dy_b, stride_dy_d, stride_dy_l,
    stride_x_b, stride_x_d, stride_x_l,
    stride_w_d, stride_w_k,
    stride_bias,
    stride_init_b, stride_init_d, stride_init_k,
    stride_dx_b, stride_dx_d, stride_dx_l,
    stride_dw_part_p, stride_dw_part_d, stride_dw_part_k,
    stride_db_part_p, stride_db_part_d,
    stride_dinit_b, stride_dinit_d, stride_dinit_k,
    # meta-parameters
    W: tl.constexpr, W_PAD: tl.constexpr, SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    # Program (b, d-block, s) owns L-blocks s*blocks_per_program ... (s+1)*blocks_per_program - 1
    # of batch row b; it writes dx for them and one partial of dweight/dbias, which the launcher
    # sums over programs in a fixed order (no atomics, so the result is reproducible).
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_d = (pid_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    offs_k = tl.arange(0, W_PAD)
    mask_d = offs_d < dim
    dy_ptr += pid_b * stride_dy_b
    x_ptr += pid_b * stride_x_b
    dx_ptr += pid_b * stride_dx_b
    if HAS_INIT:
        init_ptr += pid_b * stride_init_b

    dw_acc = tl.zeros([BLOCK_D, W_PAD], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(blocks_per_program):
        offs_l = ((pid_s * blocks_per_program + i) * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)
        dx, dp = _grad_input(  # [BLOCK_D, BLOCK_L] each
            dy_ptr, x_ptr, init_ptr, w_ptr, bias_ptr, offs_d, mask_d, offs_l, seqlen,
            stride_dy_d, stride_dy_l, stride_x_d, stride_x_l, stride_init_d, stride_init_k,
            stride_w_d, stride_w_k, stride_bias, W, SILU, HAS_BIAS, HAS_INIT,
        )
        tl.store(
            dx_ptr + offs_d[:, None] * stride_dx_d + offs_l[None, :] * stride_dx_l,
            dx.to(dx_ptr.dtype.element_ty),
            mask=mask_d[:, None] & (offs_l < seqlen)[None, :],
        )
        db_acc += tl.sum(dp, axis=1)
        for k in tl.static_range(W):
            x_k = _load_padded(
                x_ptr, init_ptr, offs_d, mask_d, offs_l + (k - (W - 1)), seqlen,
                stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT,
            )
            # Column k of the [BLOCK_D, W_PAD] accumulator: Triton has no per-column update.
            dw_acc += tl.where(offs_k[None, :] == k, tl.sum(dp * x_k, axis=1)[:, None], 0.0)

    pid_p = pid_b * tl.num_programs(2) + pid_s
    tl.store(
        dw_part_ptr + pid_p * stride_dw_part_p
        + offs_d[:, None] * stride_dw_part_d + offs_k[None, :] * stride_dw_part_k,
        dw_acc,
        mask=mask_d[:, None] & (offs_k < W)[None, :],
    )
    if HAS_BIAS:
        tl.store(
            db_part_ptr + pid_p * stride_db_part_p + offs_d * stride_db_part_d, db_acc, mask=mask_d
        )
    if HAS_INIT:
        if pid_s == 0:
            # initial_state holds input times -(W-1) .. -1, which feed outputs 0 .. W-2 only.
            pos = offs_k - (W - 1)
            dinit, _ = _grad_input(  # [BLOCK_D, W_PAD]
                dy_ptr, x_ptr, init_ptr, w_ptr, bias_ptr, offs_d, mask_d, pos, seqlen,
                stride_dy_d, stride_dy_l, stride_x_d, stride_x_l, stride_init_d, stride_init_k,
                stride_w_d, stride_w_k, stride_bias, W, SILU, HAS_BIAS, HAS_INIT,
            )
            dinit_ptr += pid_b * stride_dinit_b
            tl.store(
                dinit_ptr + offs_d[:, None] * stride_dinit_d + offs_k[None, :] * stride_dinit_k,
                dinit.to(dinit_ptr.dtype.element_ty),
                mask=mask_d[:, None] & (offs_k < W - 1)[None, :],
            )


def _strides(t: Optional[torch.Tensor], ndim: int) -> tuple:
    return (0,) * ndim if t is None else t.stride()


def _tile(x: torch.Tensor, elements: int) -> tuple:
    # A [BLOCK_D, BLOCK_L] tile of `elements`, long along x's unit-stride axis so that loads
    # coalesce for both the (batch, dim, L) layout and a transposed (batch, L, dim) view.
    _, dim, seqlen = x.shape
    channels_last = x.stride(1) == 1 and x.stride(2) != 1
    block_d = 64 if channels_last else 8
    block_d = min(block_d, triton.next_power_of_2(dim))
    return block_d, min(elements // block_d, triton.next_power_of_2(seqlen))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
    silu: bool,
) -> torch.Tensor:
    """Forward; inputs already validated. Returns y (batch, dim, L), contiguous, x's dtype."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    y = torch.empty((batch, dim, seqlen), dtype=x.dtype, device=x.device)
    # Sized from ptxas register counts on sm_90: each element costs W shifted, unaligned
    # loads, so about 8 elements per thread (4 for W > 4) keep the kernel free of spills.
    block_d, block_l = _tile(x, elements=2048 if width <= 4 else 1024)
    grid = (batch, triton.cdiv(dim, block_d), triton.cdiv(seqlen, block_l))
    _causal_conv1d_fwd_kernel[grid](
        x, weight, bias, initial_state, y,
        dim, seqlen,
        *x.stride(), *weight.stride(), *_strides(bias, 1), *_strides(initial_state, 3), *y.stride(),
        W=width, SILU=silu, BLOCK_D=block_d, BLOCK_L=block_l, num_warps=8,
    )
    return y


def causal_conv1d_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
    silu: bool,
) -> ConvGrads:
    """Backward; inputs already validated. See ``ConvGrads`` for what is returned."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    # Through silu each dx element recomputes W pre-activations of W loads each: about 4
    # elements per thread (2 for W > 4) keep it within registers (ptxas, sm_90).
    block_d, block_l = _tile(x, elements=512 if width <= 4 else 256)
    n_dblocks, n_lblocks = triton.cdiv(dim, block_d), triton.cdiv(seqlen, block_l)
    # Split L over enough programs to fill the GPU about 4 times over, but no finer: each split
    # adds a (dim, W) partial to write and sum. On CPU (the interpreter, in tests) one "SM"
    # keeps several L-blocks per program, so small test shapes exercise the loop over L.
    sms = _num_sms(x.device.index) if x.is_cuda else 1
    n_split = min(n_lblocks, max(1, triton.cdiv(4 * sms, batch * n_dblocks)))
    blocks_per_program = triton.cdiv(n_lblocks, n_split)
    n_split = triton.cdiv(n_lblocks, blocks_per_program)

    dx = torch.empty((batch, dim, seqlen), dtype=x.dtype, device=x.device)
    dw_part = torch.empty((batch * n_split, dim, width), dtype=torch.float32, device=x.device)
    db_part = None
    if bias is not None:
        db_part = torch.empty((batch * n_split, dim), dtype=torch.float32, device=x.device)
    dinit = x.new_empty(0, dtype=torch.float32)
    if initial_state is not None:
        dinit = torch.empty((batch, dim, width - 1), dtype=initial_state.dtype, device=x.device)
    grid = (batch, n_dblocks, n_split)
    _causal_conv1d_bwd_kernel[grid](
        dy, x, weight, bias, initial_state,
        dx, dw_part, db_part, dinit,
        dim, seqlen, blocks_per_program,
        *dy.stride(), *x.stride(), *weight.stride(), *_strides(bias, 1),
        *_strides(initial_state, 3), *dx.stride(), *dw_part.stride(), *_strides(db_part, 2),
        *_strides(dinit if initial_state is not None else None, 3),
        W=width, W_PAD=triton.next_power_of_2(width), SILU=silu,
        BLOCK_D=block_d, BLOCK_L=block_l, num_warps=4,
    )
    dbias = x.new_empty(0, dtype=torch.float32)
    if db_part is not None:
        dbias = db_part.sum(dim=0).to(bias.dtype)
    dweight = dw_part.sum(dim=0).to(weight.dtype)
    return ConvGrads(dx=dx, dweight=dweight, dbias=dbias, dinitial_state=dinit)
