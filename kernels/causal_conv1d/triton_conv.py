"""Triton kernels and launchers for ``ssm::causal_conv1d`` (forward and backward).

Layout: x, y, dy, dx are (batch, dim, L) with any strides; weight is (dim, W), 2 <= W <= 8, a
constexpr so the W taps unroll. y and dx are allocated contiguous (the fake implementation
promises that).

Time is cut into chunks of CHUNK = 8 steps, and a tile is held as 8 *planes*: plane i is the
[BLOCK_D, NC] tensor of the values at times t0 + 8c + i of the tile's NC chunks. A causal tap
that looks j steps back is then plane i-j of the same chunk, or plane 8+i-j of the previous
chunk, so every tap is an elementwise op between registers: no shifted (hence unaligned,
unvectorizable) re-load of x per tap, which is what made a first version LSU-bound. Since
W-1 <= 7 < CHUNK, one previous chunk always holds the whole halo.

Loads are [BLOCK_D, NC, 8] (two [.., 4] halves in fp32) and are laid out by Triton along the
tensor's unit-stride axis, with 16-byte vectors: along L for a plain (batch, dim, L) tensor,
where splitting into planes is register-only; along dim for HF Mamba's x (the x half of the
(batch, L, 2*dim) in_proj output, transposed), where the split transposes the tile once through
shared memory rather than reading HBM with uncoalesced accesses. The launcher only picks the
tile's shape from x's strides: long along the unit-stride axis. The forward on such dim-major
x has its own kernel (``_causal_conv1d_fwd_rows_kernel``): it streams rows of channels
through time, with the halo carried in registers, and reads each row once.

The backward kernel is not autotuned: its dweight/dbias partials are summed in a fixed order so
the result is bitwise reproducible, and the split of L over programs is part of that order.
"""
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ..layout import empty_activation
from ..partials import sum_partials
from ..triton_common import LAUNCH_OPTIONS, launcher, num_sms, sigmoid_approx, silu
from .cpu import ConvGrads

# Time steps per chunk: 8 bf16/fp16 values are one 16-byte load, and 8 > W-1 for every W.
CHUNK = 8


@triton.jit
def _split8(v, BLOCK_D: tl.constexpr, NC: tl.constexpr):
    # [BLOCK_D, NC, 8] -> 8 planes [BLOCK_D, NC]. Index i = 4a + 2b + c: split off c, then b,
    # then a. Register-only when the 8 elements are in one thread, as the load layout makes them.
    c0, c1 = tl.split(tl.reshape(v, [BLOCK_D, NC, 4, 2]))
    b00, b01 = tl.split(tl.reshape(c0, [BLOCK_D, NC, 2, 2]))
    b10, b11 = tl.split(tl.reshape(c1, [BLOCK_D, NC, 2, 2]))
    v0, v4 = tl.split(b00)
    v2, v6 = tl.split(b01)
    v1, v5 = tl.split(b10)
    v3, v7 = tl.split(b11)
    return (v0, v1, v2, v3, v4, v5, v6, v7)


@triton.jit
def _split4(v, BLOCK_D: tl.constexpr, NC: tl.constexpr):
    # [BLOCK_D, NC, 4] -> 4 planes [BLOCK_D, NC]; index i = 2a + b.
    b0, b1 = tl.split(tl.reshape(v, [BLOCK_D, NC, 2, 2]))
    v0, v2 = tl.split(b0)
    v1, v3 = tl.split(b1)
    return (v0, v1, v2, v3)


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_D: tl.constexpr, NC: tl.constexpr):
    # Inverse of _split8: 8 planes [BLOCK_D, NC] -> [BLOCK_D, NC, 8].
    c0 = tl.reshape(tl.join(tl.join(v0, v4), tl.join(v2, v6)), [BLOCK_D, NC, 4])
    c1 = tl.reshape(tl.join(tl.join(v1, v5), tl.join(v3, v7)), [BLOCK_D, NC, 4])
    return tl.reshape(tl.join(c0, c1), [BLOCK_D, NC, 8])


@triton.jit
def _load_padded(
    # pointers (already offset to this batch row)
    x_ptr, init_ptr,
    # sizes (broadcastable against each other: channel offsets, times)
    offs_d, mask_d, pos, seqlen,
    # strides
    stride_x_d, stride_x_l, stride_init_d, stride_init_k,
    # meta-parameters
    W: tl.constexpr, HAS_INIT: tl.constexpr,
):
    # The input at times `pos`, in fp32: x for 0 <= pos < L, initial_state for the W-1 times
    # before 0, zero elsewhere. Out-of-range lanes are masked, never read, so negative offsets
    # are harmless.
    in_x = (pos >= 0) & (pos < seqlen)
    v = tl.load(x_ptr + offs_d * stride_x_d + pos * stride_x_l, mask=mask_d & in_x, other=0.0)
    v = v.to(tl.float32)
    if HAS_INIT:
        in_init = (pos < 0) & (pos >= 1 - W)
        v += tl.load(
            init_ptr + offs_d * stride_init_d + (pos + (W - 1)) * stride_init_k,
            mask=mask_d & in_init, other=0.0,
        ).to(tl.float32)
    return v


@triton.jit
def _load_planes(
    # pointers
    x_ptr, init_ptr,
    # sizes
    offs_d, mask_d, t0, seqlen,
    # strides
    stride_x_d, stride_x_l, stride_init_d, stride_init_k,
    # meta-parameters
    W: tl.constexpr, HAS_INIT: tl.constexpr, BLOCK_D: tl.constexpr, NC: tl.constexpr,
):
    # The 8 planes of the chunks starting at times t0 ([NC], multiples of 8), fp32. The load
    # itself is laid out by Triton along whichever axis has unit stride (16-byte vectors either
    # way); when that is dim, splitting into planes transposes the tile once through shared
    # memory, which is cheaper than converting each plane separately.
    d = offs_d[:, None, None]
    m = mask_d[:, None, None]
    if x_ptr.dtype.element_ty.primitive_bitwidth == 32:
        # fp32: two loads of 4 steps. One [.., 8] load would be split over two threads (the
        # widest vector is 16 bytes), and splitting it into planes would go through shared
        # memory even for an L-contiguous tensor.
        lo = _load_padded(  # [BLOCK_D, NC, 4]
            x_ptr, init_ptr, d, m, t0[None, :, None] + tl.arange(0, 4)[None, None, :], seqlen,
            stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT,
        )
        hi = _load_padded(  # [BLOCK_D, NC, 4]
            x_ptr, init_ptr, d, m, t0[None, :, None] + tl.arange(4, 8)[None, None, :], seqlen,
            stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT,
        )
        a = _split4(lo, BLOCK_D, NC)
        b = _split4(hi, BLOCK_D, NC)
        planes = (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3])
    else:
        # bf16/fp16: 8 steps are one 16-byte load per thread and chunk.
        v = _load_padded(  # [BLOCK_D, NC, 8]
            x_ptr, init_ptr, d, m, t0[None, :, None] + tl.arange(0, 8)[None, None, :], seqlen,
            stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT,
        )
        planes = _split8(v, BLOCK_D, NC)
    return planes


@triton.jit
def _tap(j: tl.constexpr, prev, cur, nxt):
    # The plane at chunk-relative time j in [-8, 16): previous, current or next chunk.
    if j < 0:
        v = prev[j + 8]
    elif j < 8:
        v = cur[j]
    else:
        v = nxt[j - 8]
    return v


@triton.jit
def _load_weight(k: tl.constexpr, w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W: tl.constexpr):
    # Tap k as an fp32 [BLOCK_D, 1] column; zeros for k >= W (never used: every loop over taps
    # stops at W).
    if k < W:
        w = tl.load(w_ptr + offs_d * stride_w_d + k * stride_w_k, mask=mask_d, other=0.0)
    else:
        w = tl.zeros_like(offs_d)
    return w.to(tl.float32)[:, None]


@triton.jit
def _load_weights(w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W: tl.constexpr):
    return (
        _load_weight(0, w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W),
        _load_weight(1, w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W),
        _load_weight(2, w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W),
        _load_weight(3, w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W),
        _load_weight(4, w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W),
        _load_weight(5, w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W),
        _load_weight(6, w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W),
        _load_weight(7, w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W),
    )


@triton.jit
def _load_row_weights(w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W: tl.constexpr, BLOCK_D: tl.constexpr):
    # _load_weights as [BLOCK_D] rows, for the row-streaming kernels' [BLOCK_D] planes.
    w = _load_weights(w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W)
    return (tl.reshape(w[0], [BLOCK_D]), tl.reshape(w[1], [BLOCK_D]), tl.reshape(w[2], [BLOCK_D]),
            tl.reshape(w[3], [BLOCK_D]), tl.reshape(w[4], [BLOCK_D]), tl.reshape(w[5], [BLOCK_D]),
            tl.reshape(w[6], [BLOCK_D]), tl.reshape(w[7], [BLOCK_D]))


@triton.jit
def _preact(i: tl.constexpr, prev, cur, nxt, w, bias, W: tl.constexpr, HAS_BIAS: tl.constexpr):
    # p at chunk-relative time i = bias + sum_k w[k] * input[i - (W-1) + k], fp32 [BLOCK_D, NC].
    acc = w[0] * _tap(i - (W - 1), prev, cur, nxt)
    for k in tl.static_range(1, W):
        acc += w[k] * _tap(i - (W - 1) + k, prev, cur, nxt)
    if HAS_BIAS:
        acc += bias
    return acc


@triton.jit
def _fwd_out(i: tl.constexpr, prev, cur, w, bias, W: tl.constexpr, SILU: tl.constexpr,
             HAS_BIAS: tl.constexpr):
    acc = _preact(i, prev, cur, cur, w, bias, W, HAS_BIAS)
    if SILU:
        # The MUFU exp2 and reciprocal (1 ulp) instead of libdevice exp and IEEE division: the
        # row kernel runs at ~3/4 of copy bandwidth with spare bytes, and fewer instructions per
        # element moved it closer (H200, run 29, batch 8, L=2048, dim 1536, HF's layout:
        # bf16 32.2 -> 30.9 us, fp32 60.8 -> 58.6 us). The chunk-tile kernel (L-contiguous x)
        # shares this function; it was not timed.
        acc = silu(acc, FAST_MATH=True)
    return acc


@triton.jit
def _dpre(i: tl.constexpr, prev, cur, nxt, dy, w, bias, W: tl.constexpr, SILU: tl.constexpr,
          HAS_BIAS: tl.constexpr, N: tl.constexpr):
    # dL/dp at chunk-relative time i of the chunk `cur`, or zeros for i >= N (planes the caller
    # does not need); zero outside [0, L) because dy is, which is what makes the sums stop at
    # the sequence ends.
    if i < N:
        dp = dy[i]
        if SILU:
            # The pre-activation is recomputed from registers rather than saved by the forward:
            # saving it would cost an activation-sized write and read.
            p = _preact(i, prev, cur, nxt, w, bias, W, HAS_BIAS)
            # MUFU exp2 and reciprocal, as the forward's silu (_fwd_out): the rows backward ran
            # 69.7 -> 63.1 us in bf16, 84.0 -> 82.4 us in fp32 (H200, run 29, same shape).
            s = sigmoid_approx(p)
            dp = dp * s * (1.0 + p * (1.0 - s))
    else:
        dp = tl.zeros_like(dy[0])
    return dp


@triton.jit
def _dpre_planes(prev, cur, nxt, dy, w, bias, W: tl.constexpr, SILU: tl.constexpr,
                 HAS_BIAS: tl.constexpr, N: tl.constexpr):
    # dL/dp for the first N planes of `cur` (zeros after), as an 8-tuple.
    return (
        _dpre(0, prev, cur, nxt, dy, w, bias, W, SILU, HAS_BIAS, N),
        _dpre(1, prev, cur, nxt, dy, w, bias, W, SILU, HAS_BIAS, N),
        _dpre(2, prev, cur, nxt, dy, w, bias, W, SILU, HAS_BIAS, N),
        _dpre(3, prev, cur, nxt, dy, w, bias, W, SILU, HAS_BIAS, N),
        _dpre(4, prev, cur, nxt, dy, w, bias, W, SILU, HAS_BIAS, N),
        _dpre(5, prev, cur, nxt, dy, w, bias, W, SILU, HAS_BIAS, N),
        _dpre(6, prev, cur, nxt, dy, w, bias, W, SILU, HAS_BIAS, N),
        _dpre(7, prev, cur, nxt, dy, w, bias, W, SILU, HAS_BIAS, N),
    )


@triton.jit
def _dx_plane(i: tl.constexpr, dp, dp_next, w, W: tl.constexpr):
    # Input time s feeds outputs s .. s+W-1 through taps W-1 .. 0, so
    # d input[s] = sum_m w[W-1-m] * dp[s + m]: a correlation with the flipped kernel.
    acc = w[W - 1] * dp[i]
    for m in tl.static_range(1, W):
        acc += w[W - 1 - m] * _tap(i + m, dp, dp, dp_next)
    return acc


@triton.jit
def _dw_lane(k: tl.constexpr, dp, xprev, xcur, W: tl.constexpr):
    # This tile's part of dweight[k] = sum_t dp[t] * input[t - (W-1) + k], per chunk.
    acc = tl.zeros_like(dp[0])
    if k < W:
        for i in tl.static_range(8):
            acc += dp[i] * _tap(i - (W - 1) + k, xprev, xcur, xcur)
    return acc


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
    BLOCK_D: tl.constexpr, NC: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    pid_l = tl.program_id(2)
    # int64 offsets: batch * dim * L (or a transposed view's strides) can pass 2**31.
    offs_d = (pid_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    t0 = (pid_l * (NC * 8) + tl.arange(0, NC) * 8).to(tl.int64)  # chunk starts [NC]
    mask_d = offs_d < dim
    x_ptr += pid_b * stride_x_b
    y_ptr += pid_b * stride_y_b
    if HAS_INIT:
        init_ptr += pid_b * stride_init_b

    w = _load_weights(w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d * stride_bias, mask=mask_d, other=0.0)
        bias = bias.to(tl.float32)[:, None]
    # The previous chunk supplies the halo (its last W-1 planes; initial_state before time 0).
    prev = _load_planes(
        x_ptr, init_ptr, offs_d, mask_d, t0 - 8, seqlen,
        stride_x_d, stride_x_l, stride_init_d, stride_init_k,
        W, HAS_INIT, BLOCK_D, NC,
    )
    cur = _load_planes(
        x_ptr, init_ptr, offs_d, mask_d, t0, seqlen,
        stride_x_d, stride_x_l, stride_init_d, stride_init_k,
        W, False, BLOCK_D, NC,
    )
    y = _join8(  # [BLOCK_D, NC, 8]
        _fwd_out(0, prev, cur, w, bias, W, SILU, HAS_BIAS),
        _fwd_out(1, prev, cur, w, bias, W, SILU, HAS_BIAS),
        _fwd_out(2, prev, cur, w, bias, W, SILU, HAS_BIAS),
        _fwd_out(3, prev, cur, w, bias, W, SILU, HAS_BIAS),
        _fwd_out(4, prev, cur, w, bias, W, SILU, HAS_BIAS),
        _fwd_out(5, prev, cur, w, bias, W, SILU, HAS_BIAS),
        _fwd_out(6, prev, cur, w, bias, W, SILU, HAS_BIAS),
        _fwd_out(7, prev, cur, w, bias, W, SILU, HAS_BIAS),
        BLOCK_D, NC,
    )
    pos = t0[None, :, None] + tl.arange(0, 8)[None, None, :]
    tl.store(
        y_ptr + offs_d[:, None, None] * stride_y_d + pos * stride_y_l,
        y.to(y_ptr.dtype.element_ty),
        mask=mask_d[:, None, None] & (pos < seqlen),
    )


@triton.jit
def _load_row(x_ptr, init_ptr, offs_d, mask_d, pos, seqlen, t_end,
              stride_x_d, stride_x_l, stride_init_d, stride_init_k,
              W: tl.constexpr, HAS_INIT: tl.constexpr):
    # The input row at time pos ([BLOCK_D] fp32; initial_state before 0, zero past t_end).
    # pos is broadcast to the row first: Triton's interpreter rejects a mask made by and-ing a
    # scalar condition into a vector one (the compiled kernel folds the broadcast away).
    pos = pos + tl.zeros_like(offs_d)
    return _load_padded(x_ptr, init_ptr, offs_d, mask_d & (pos < t_end), pos, seqlen,
                        stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT)


@triton.jit
def _row_or_zero(i: tl.constexpr, FIRST: tl.constexpr, x_ptr, init_ptr, offs_d, mask_d, t, seqlen,
                 t_end, stride_x_d, stride_x_l, stride_init_d, stride_init_k,
                 W: tl.constexpr, HAS_INIT: tl.constexpr):
    if i < FIRST:
        v = tl.zeros_like(offs_d).to(tl.float32)
    else:
        v = _load_row(x_ptr, init_ptr, offs_d, mask_d, t + i, seqlen, t_end,
                      stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT)
    return v


@triton.jit
def _load_rows8(x_ptr, init_ptr, offs_d, mask_d, t, seqlen, t_end,
                stride_x_d, stride_x_l, stride_init_d, stride_init_k,
                W: tl.constexpr, HAS_INIT: tl.constexpr, FIRST: tl.constexpr):
    # Rows t .. t+7 as 8 planes; the first FIRST of them zero, not loaded.
    return (
        _row_or_zero(0, FIRST, x_ptr, init_ptr, offs_d, mask_d, t, seqlen, t_end,
                     stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT),
        _row_or_zero(1, FIRST, x_ptr, init_ptr, offs_d, mask_d, t, seqlen, t_end,
                     stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT),
        _row_or_zero(2, FIRST, x_ptr, init_ptr, offs_d, mask_d, t, seqlen, t_end,
                     stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT),
        _row_or_zero(3, FIRST, x_ptr, init_ptr, offs_d, mask_d, t, seqlen, t_end,
                     stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT),
        _row_or_zero(4, FIRST, x_ptr, init_ptr, offs_d, mask_d, t, seqlen, t_end,
                     stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT),
        _row_or_zero(5, FIRST, x_ptr, init_ptr, offs_d, mask_d, t, seqlen, t_end,
                     stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT),
        _row_or_zero(6, FIRST, x_ptr, init_ptr, offs_d, mask_d, t, seqlen, t_end,
                     stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT),
        _row_or_zero(7, FIRST, x_ptr, init_ptr, offs_d, mask_d, t, seqlen, t_end,
                     stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT),
    )


@triton.jit
def _causal_conv1d_fwd_rows_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, init_ptr, y_ptr,
    # sizes
    dim, seqlen, seg_len,
    # strides
    stride_x_b, stride_x_d, stride_x_l,
    stride_w_d, stride_w_k,
    stride_bias,
    stride_init_b, stride_init_d, stride_init_k,
    stride_y_b, stride_y_d, stride_y_l,
    # meta-parameters
    W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Forward for x with unit stride along dim (HF Mamba's in_proj view): each program walks a
    # segment of time over BLOCK_D channels, 8 rows per step, and carries the last 8 rows in
    # registers as the next step's halo. Every x row is then read once (the chunk-tile kernel
    # reads each chunk twice, once as a halo, and transposes tiles through shared memory), and
    # a row is BLOCK_D contiguous elements: coalesced, no transpose. The planes are the
    # chunk-tile kernel's with a [BLOCK_D] shape, so the tap arithmetic (_fwd_out) is shared.
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_d = (pid_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    mask_d = offs_d < dim
    x_ptr += pid_b * stride_x_b
    y_ptr += pid_b * stride_y_b
    if HAS_INIT:
        init_ptr += pid_b * stride_init_b
    w = _load_row_weights(w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W, BLOCK_D)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d * stride_bias, mask=mask_d, other=0.0).to(tl.float32)
    t_start = (pid_s * seg_len).to(tl.int64)
    t_end = tl.minimum(t_start + seg_len, seqlen)
    # The halo before the segment: only its last W-1 rows are ever tapped (j >= -(W-1) in
    # _tap), so the others stay zero and cost no load.
    p0, p1, p2, p3, p4, p5, p6, p7 = _load_rows8(
        x_ptr, init_ptr, offs_d, mask_d, t_start - 8, seqlen, t_end,
        stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT, 8 - (W - 1))
    for t0 in range(t_start, t_end, 8):
        # Rows t0 .. t0+7 (all at times >= 0: no initial_state).
        c0, c1, c2, c3, c4, c5, c6, c7 = _load_rows8(
            x_ptr, init_ptr, offs_d, mask_d, t0, seqlen, t_end,
            stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, False, 0)
        prev = (p0, p1, p2, p3, p4, p5, p6, p7)
        cur = (c0, c1, c2, c3, c4, c5, c6, c7)
        for i in tl.static_range(8):
            y = _fwd_out(i, prev, cur, w, bias, W, SILU, HAS_BIAS)
            pos = t0 + i + tl.zeros_like(offs_d)  # a vector, as in _load_row
            tl.store(y_ptr + offs_d * stride_y_d + pos * stride_y_l, y.to(y_ptr.dtype.element_ty),
                     mask=mask_d & (pos < t_end))
        p0, p1, p2, p3, p4, p5, p6, p7 = c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _causal_conv1d_bwd_rows_kernel(
    # pointers
    dy_ptr, x_ptr, w_ptr, bias_ptr, init_ptr,
    dx_ptr, dw_part_ptr, db_part_ptr, dinit_ptr,
    # sizes
    dim, seqlen, seg_len,
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
    W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Backward for x with unit stride along dim (HF Mamba's in_proj view), streaming rows like
    # the forward's _causal_conv1d_fwd_rows_kernel: a program walks a segment of time over
    # BLOCK_D channels, 8 rows per step, and carries the rows it still needs in registers. Each
    # step loads only the next 8 rows of x and dy; x's previous and current rows and dL/dp of
    # the current rows come from the step before. The chunk-tile kernel instead re-reads x over
    # three chunks and dy over two for every chunk and transposes each tile through shared
    # memory: 208 us a call in the 130m training step (run 20), ~6x its bytes.
    # dx at time s needs dL/dp up to s + W-1, so the last step also reads the first W-1 rows
    # after the segment (zero past the sequence, where dy is).
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_d = (pid_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    mask_d = offs_d < dim
    dy_ptr += pid_b * stride_dy_b
    x_ptr += pid_b * stride_x_b
    dx_ptr += pid_b * stride_dx_b
    if HAS_INIT:
        init_ptr += pid_b * stride_init_b
    w = _load_row_weights(w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W, BLOCK_D)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d * stride_bias, mask=mask_d, other=0.0).to(tl.float32)
    t_start = (pid_s * seg_len).to(tl.int64)
    t_end = tl.minimum(t_start + seg_len, seqlen)
    # Rows are read up to W-1 past the segment, and never past the sequence.
    t_read = tl.minimum(t_end + (W - 1), seqlen)
    # The rows before the segment: only the last W-1 are tapped (initial_state before time 0).
    p0, p1, p2, p3, p4, p5, p6, p7 = _load_rows8(
        x_ptr, init_ptr, offs_d, mask_d, t_start - 8, seqlen, t_read,
        stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, HAS_INIT, 8 - (W - 1))
    c0, c1, c2, c3, c4, c5, c6, c7 = _load_rows8(
        x_ptr, init_ptr, offs_d, mask_d, t_start, seqlen, t_read,
        stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, False, 0)
    dycur = _load_rows8(dy_ptr, dy_ptr, offs_d, mask_d, t_start, seqlen, t_read,
                        stride_dy_d, stride_dy_l, 0, 0, W, False, 0)
    g0, g1, g2, g3, g4, g5, g6, g7 = _dpre_planes(
        (p0, p1, p2, p3, p4, p5, p6, p7), (c0, c1, c2, c3, c4, c5, c6, c7),
        (c0, c1, c2, c3, c4, c5, c6, c7), dycur, w, bias, W, SILU, HAS_BIAS, 8)
    if HAS_INIT:
        if pid_s == 0:
            # initial_state holds input times -(W-1) .. -1, which feed outputs 0 .. W-2 only:
            # d input[j - (W-1)] = sum_{t <= j} w[j - t] * dp[t].
            dp = (g0, g1, g2, g3, g4, g5, g6, g7)
            for j in tl.static_range(W - 1):
                acc = w[j] * dp[0]
                for t in tl.static_range(1, j + 1):
                    acc += w[j - t] * dp[t]
                tl.store(dinit_ptr + pid_b * stride_dinit_b + offs_d * stride_dinit_d + j * stride_dinit_k,
                         acc.to(dinit_ptr.dtype.element_ty), mask=mask_d)
    zero = tl.zeros([BLOCK_D], dtype=tl.float32)
    w0, w1, w2, w3, w4, w5, w6, w7, db = zero, zero, zero, zero, zero, zero, zero, zero, zero
    for t0 in range(t_start, t_end, 8):
        n0, n1, n2, n3, n4, n5, n6, n7 = _load_rows8(
            x_ptr, init_ptr, offs_d, mask_d, t0 + 8, seqlen, t_read,
            stride_x_d, stride_x_l, stride_init_d, stride_init_k, W, False, 0)
        dynext = _load_rows8(dy_ptr, dy_ptr, offs_d, mask_d, t0 + 8, seqlen, t_read,
                             stride_dy_d, stride_dy_l, 0, 0, W, False, 0)
        xprev = (p0, p1, p2, p3, p4, p5, p6, p7)
        xcur = (c0, c1, c2, c3, c4, c5, c6, c7)
        xnext = (n0, n1, n2, n3, n4, n5, n6, n7)
        dp = (g0, g1, g2, g3, g4, g5, g6, g7)
        # dL/dp of the next 8 rows: the next step's dp, and the taps dx needs here.
        h0, h1, h2, h3, h4, h5, h6, h7 = _dpre_planes(xcur, xnext, xnext, dynext, w, bias, W, SILU,
                                                      HAS_BIAS, 8)
        dp_next = (h0, h1, h2, h3, h4, h5, h6, h7)
        for i in tl.static_range(8):
            dx = _dx_plane(i, dp, dp_next, w, W)
            pos = t0 + i + tl.zeros_like(offs_d)  # a vector, as in _load_row
            tl.store(dx_ptr + offs_d * stride_dx_d + pos * stride_dx_l, dx.to(dx_ptr.dtype.element_ty),
                     mask=mask_d & (pos < t_end))
        # Rows past the segment are the next program's; past the sequence dy (so dp) is zero.
        db += g0 + g1 + g2 + g3 + g4 + g5 + g6 + g7
        w0 += _dw_lane(0, dp, xprev, xcur, W)
        w1 += _dw_lane(1, dp, xprev, xcur, W)
        w2 += _dw_lane(2, dp, xprev, xcur, W)
        w3 += _dw_lane(3, dp, xprev, xcur, W)
        w4 += _dw_lane(4, dp, xprev, xcur, W)
        w5 += _dw_lane(5, dp, xprev, xcur, W)
        w6 += _dw_lane(6, dp, xprev, xcur, W)
        w7 += _dw_lane(7, dp, xprev, xcur, W)
        p0, p1, p2, p3, p4, p5, p6, p7 = c0, c1, c2, c3, c4, c5, c6, c7
        c0, c1, c2, c3, c4, c5, c6, c7 = n0, n1, n2, n3, n4, n5, n6, n7
        g0, g1, g2, g3, g4, g5, g6, g7 = h0, h1, h2, h3, h4, h5, h6, h7

    pid_p = pid_b * tl.num_programs(2) + pid_s
    dw_row = dw_part_ptr + pid_p * stride_dw_part_p + offs_d * stride_dw_part_d
    lanes = (w0, w1, w2, w3, w4, w5, w6, w7)
    for k in tl.static_range(W):
        tl.store(dw_row + k * stride_dw_part_k, lanes[k], mask=mask_d)
    if HAS_BIAS:
        tl.store(db_part_ptr + pid_p * stride_db_part_p + offs_d * stride_db_part_d, db, mask=mask_d)


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
    W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK_D: tl.constexpr, NC: tl.constexpr,
):
    # Program (b, d-block, s) owns L-blocks s*blocks_per_program ... (s+1)*blocks_per_program - 1
    # of batch row b; it writes dx for them and one partial of dweight/dbias, which the launcher
    # sums over programs in a fixed order (no atomics, so the result is reproducible).
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_d = (pid_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    offs_c = tl.arange(0, NC)
    offs_k = tl.arange(0, 8)
    mask_d = offs_d < dim
    dy_ptr += pid_b * stride_dy_b
    x_ptr += pid_b * stride_x_b
    dx_ptr += pid_b * stride_dx_b
    if HAS_INIT:
        init_ptr += pid_b * stride_init_b

    w = _load_weights(w_ptr, offs_d, mask_d, stride_w_d, stride_w_k, W)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d * stride_bias, mask=mask_d, other=0.0)
        bias = bias.to(tl.float32)[:, None]
    # Per-chunk partial sums, reduced over chunks once at the end: [BLOCK_D, NC, 8] holds
    # dweight[k] in lane k, [BLOCK_D, NC] holds dbias.
    dw_acc = tl.zeros([BLOCK_D, NC, 8], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_D, NC], dtype=tl.float32)
    for it in range(blocks_per_program):
        t0 = ((pid_s * blocks_per_program + it) * (NC * 8) + offs_c * 8).to(tl.int64)
        # x over three chunks: the previous one for the halo of p, the next one because dx
        # at time s needs dp (so p) up to s + W-1.
        xprev = _load_planes(
            x_ptr, init_ptr, offs_d, mask_d, t0 - 8, seqlen,
            stride_x_d, stride_x_l, stride_init_d, stride_init_k,
            W, HAS_INIT, BLOCK_D, NC,
        )
        xcur = _load_planes(
            x_ptr, init_ptr, offs_d, mask_d, t0, seqlen,
            stride_x_d, stride_x_l, stride_init_d, stride_init_k,
            W, False, BLOCK_D, NC,
        )
        xnext = _load_planes(
            x_ptr, init_ptr, offs_d, mask_d, t0 + 8, seqlen,
            stride_x_d, stride_x_l, stride_init_d, stride_init_k,
            W, False, BLOCK_D, NC,
        )
        dycur = _load_planes(
            dy_ptr, dy_ptr, offs_d, mask_d, t0, seqlen,
            stride_dy_d, stride_dy_l, 0, 0,
            W, False, BLOCK_D, NC,
        )
        dynext = _load_planes(
            dy_ptr, dy_ptr, offs_d, mask_d, t0 + 8, seqlen,
            stride_dy_d, stride_dy_l, 0, 0,
            W, False, BLOCK_D, NC,
        )
        dp = _dpre_planes(xprev, xcur, xnext, dycur, w, bias, W, SILU, HAS_BIAS, 8)
        dp_next = _dpre_planes(
            xcur, xnext, xnext, dynext, w, bias, W, SILU, HAS_BIAS, W - 1
        )
        dx = _join8(  # [BLOCK_D, NC, 8]
            _dx_plane(0, dp, dp_next, w, W), _dx_plane(1, dp, dp_next, w, W),
            _dx_plane(2, dp, dp_next, w, W), _dx_plane(3, dp, dp_next, w, W),
            _dx_plane(4, dp, dp_next, w, W), _dx_plane(5, dp, dp_next, w, W),
            _dx_plane(6, dp, dp_next, w, W), _dx_plane(7, dp, dp_next, w, W),
            BLOCK_D, NC,
        )
        pos = t0[None, :, None] + offs_k[None, None, :]
        tl.store(
            dx_ptr + offs_d[:, None, None] * stride_dx_d + pos * stride_dx_l,
            dx.to(dx_ptr.dtype.element_ty),
            mask=mask_d[:, None, None] & (pos < seqlen),
        )
        db_acc += dp[0] + dp[1] + dp[2] + dp[3] + dp[4] + dp[5] + dp[6] + dp[7]
        dw_acc += _join8(
            _dw_lane(0, dp, xprev, xcur, W), _dw_lane(1, dp, xprev, xcur, W),
            _dw_lane(2, dp, xprev, xcur, W), _dw_lane(3, dp, xprev, xcur, W),
            _dw_lane(4, dp, xprev, xcur, W), _dw_lane(5, dp, xprev, xcur, W),
            _dw_lane(6, dp, xprev, xcur, W), _dw_lane(7, dp, xprev, xcur, W),
            BLOCK_D, NC,
        )

    pid_p = pid_b * tl.num_programs(2) + pid_s
    tl.store(
        dw_part_ptr + pid_p * stride_dw_part_p
        + offs_d[:, None] * stride_dw_part_d + offs_k[None, :] * stride_dw_part_k,
        tl.sum(dw_acc, axis=1),
        mask=mask_d[:, None] & (offs_k < W)[None, :],
    )
    if HAS_BIAS:
        tl.store(
            db_part_ptr + pid_p * stride_db_part_p + offs_d * stride_db_part_d,
            tl.sum(db_acc, axis=1), mask=mask_d,
        )
    if HAS_INIT:
        if pid_s == 0:
            # initial_state holds input times -(W-1) .. -1, which feed outputs 0 .. W-2 only:
            # d input[j - (W-1)] = sum_{t <= j} w[j - t] * dp[t]. Recomputed for the first
            # chunk (column 0 of this program's first tile), once per row.
            t0 = (offs_c * 8).to(tl.int64)
            xcur = _load_planes(
                x_ptr, init_ptr, offs_d, mask_d, t0, seqlen,
                stride_x_d, stride_x_l, stride_init_d, stride_init_k,
                W, False, BLOCK_D, NC,
            )
            xprev = _load_planes(
                x_ptr, init_ptr, offs_d, mask_d, t0 - 8, seqlen,
                stride_x_d, stride_x_l, stride_init_d, stride_init_k,
                W, HAS_INIT, BLOCK_D, NC,
            )
            dycur = _load_planes(
                dy_ptr, dy_ptr, offs_d, mask_d, t0, seqlen,
                stride_dy_d, stride_dy_l, 0, 0,
                W, False, BLOCK_D, NC,
            )
            dp = _dpre_planes(
                xprev, xcur, xcur, dycur, w, bias, W, SILU, HAS_BIAS, W - 1
            )
            dinit_ptr += pid_b * stride_dinit_b
            for j in tl.static_range(W - 1):
                acc = w[j] * dp[0]
                for t in tl.static_range(1, j + 1):
                    acc += w[j - t] * dp[t]
                # Keep column 0 (the chunk at time 0); the sum just drops the other columns.
                dinit = tl.sum(tl.where((offs_c == 0)[None, :], acc, 0.0), axis=1)  # [BLOCK_D]
                tl.store(
                    dinit_ptr + offs_d * stride_dinit_d + j * stride_dinit_k,
                    dinit.to(dinit_ptr.dtype.element_ty), mask=mask_d,
                )


def _strides(t: Optional[torch.Tensor], ndim: int) -> tuple:
    return (0,) * ndim if t is None else t.stride()


def _l_contig(x: torch.Tensor) -> bool:
    # Whether x's unit-stride axis is L (a size-1 dim makes the question moot), which decides
    # the tile's shape: long along the axis that the loads coalesce on.
    return x.stride(2) == 1 or (x.stride(1) != 1 and x.shape[1] != 1)


def _fwd_tile(dim: int) -> tuple:
    """(BLOCK_D, NC, num_warps) of the chunk-tile forward (L-contiguous x; dim-major x takes the
    row-streaming kernel, see ``_rows_plan``); see benchmarks/NOTES_conv1d.md."""
    # 2048 elements over 4 warps (16 per thread: 2 chunks of x plus their halo in flight, 40
    # registers on sm_90): [8 channels, 32 chunks], 512 contiguous bytes of bf16 per channel.
    return min(8, triton.next_power_of_2(dim)), 32, 4


@functools.lru_cache(maxsize=256)
def _rows_plan(batch: int, dim: int, seqlen: int, sms: int, longest: int, min_per_sm: int) -> tuple:
    """(BLOCK_D, num_warps, seg_len) of a row-streaming kernel: rows of up to 256 channels over
    up to 4 warps, segments of ``longest`` steps halved while there are fewer than
    ``min_per_sm`` programs per SM (short L, batch 1)."""
    block_d = min(256, triton.next_power_of_2(dim))
    num_warps = max(1, min(4, block_d // 64))
    blocks = batch * triton.cdiv(dim, block_d)
    seg_len = longest
    while seg_len > CHUNK and blocks * triton.cdiv(seqlen, seg_len) < min_per_sm * sms:
        seg_len //= 2
    return block_d, num_warps, seg_len


def _fwd_rows_tile(x: torch.Tensor, batch: int, dim: int, seqlen: int) -> tuple:
    """(BLOCK_D, num_warps, seg_len) of the row-streaming forward (x with unit stride on dim)."""
    # Measured on the H200 (benchmarks/sweep_conv_rows.py, B8 L2048 dim 1536, RESULTS.md runs
    # 16 and 29): rows of 256 channels over 4 warps (2 bf16 per thread) and 32-64-step segments
    # ran 32.4-32.8 us in bf16 (73 % of copy bandwidth); 512-channel rows over 2 warps with 64
    # steps, 38.3 us; segments of 128 or more steps 38-150 us. Many short segments keep many
    # rows in flight. Run 29 (with the fast silu): 32 steps equal 64 in bf16 (30.8 / 30.9 us) and
    # beat them in fp32 (55.6 / 58.6 us, 85 / 81 %), though each segment re-reads W-1 halo
    # rows (~9 % of its bytes at 32 steps).
    sms = num_sms(x.device.index) if x.is_cuda else 1
    return _rows_plan(batch, dim, seqlen, sms, longest=32, min_per_sm=4)


def _bwd_tile(dim: int) -> tuple:
    """(BLOCK_D, NC, num_warps) of the chunk-tile backward (L-contiguous x; dim-major x takes the
    row-streaming kernel, ``_bwd_rows_tile``), per loop iteration."""
    # Each chunk costs ~60 fp32 registers (x over 3 chunks, dy over 2, dp, dx, the dweight
    # lanes), so one chunk per thread: 1024 elements, [4, 32] chunks.
    return min(4, triton.next_power_of_2(dim)), 32, 4


def _bwd_rows_tile(x: torch.Tensor, batch: int, dim: int, seqlen: int) -> tuple:
    """(BLOCK_D, num_warps, seg_len) of the row-streaming backward (x with unit stride on dim)."""
    # Measured on the H200 (benchmarks/sweep_conv_rows.py --bwd, B8 L2048 dim 1536, RESULTS.md
    # run 20): rows of 256 channels over 4 warps (124 registers in bf16) and 256-step segments
    # ran 70 us in bf16 and 84 us in fp32 (51 % / 85 % of copy bandwidth), 64-step segments 83 /
    # 101 us: unlike the forward, the backward gains from longer segments (each re-reads 2(W-1)
    # rows around it and writes a dweight partial). Segments shrink only below 2 programs per
    # SM; that threshold is the measured point's (384 programs), not a swept one.
    sms = num_sms(x.device.index) if x.is_cuda else 1
    return _rows_plan(batch, dim, seqlen, sms, longest=256, min_per_sm=2)


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
    silu_on: bool,
    traced: bool = False,
) -> torch.Tensor:
    """Forward; inputs already validated. Returns y (batch, dim, L) in x's layout and dtype.
    ``traced``: launch through ``wrap_triton``, for a graph that records it (``kernels/inline.py``)."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    y = empty_activation(x)
    if not _l_contig(x):
        block_d, num_warps, seg_len = _fwd_rows_tile(x, batch, dim, seqlen)
        grid = (batch, triton.cdiv(dim, block_d), triton.cdiv(seqlen, seg_len))
        kernel, options = launcher(_causal_conv1d_fwd_rows_kernel, traced)
        kernel[grid](
            x, weight, bias, initial_state, y,
            dim, seqlen, seg_len,
            *x.stride(), *weight.stride(), *_strides(bias, 1), *_strides(initial_state, 3), *y.stride(),
            HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
            W=width, SILU=silu_on, BLOCK_D=block_d, num_warps=num_warps,
            **options,
        )
        return y
    block_d, nc, num_warps = _fwd_tile(dim)
    # Short sequences: fewer, fully used chunks per tile.
    nc = max(1, min(nc, triton.next_power_of_2(triton.cdiv(seqlen, CHUNK))))
    grid = (batch, triton.cdiv(dim, block_d), triton.cdiv(seqlen, nc * CHUNK))
    kernel, options = launcher(_causal_conv1d_fwd_kernel, traced)
    kernel[grid](
        x, weight, bias, initial_state, y,
        dim, seqlen,
        *x.stride(), *weight.stride(), *_strides(bias, 1), *_strides(initial_state, 3), *y.stride(),
        # Flags as arguments, not @triton.heuristics (which rebuilds a dict of every argument per
        # flag on each launch; see triton_fwd.py).
        HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        W=width, SILU=silu_on, BLOCK_D=block_d, NC=nc, num_warps=num_warps,
        **options,
    )
    return y


def causal_conv1d_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
    silu_on: bool,
) -> ConvGrads:
    """Backward; inputs already validated. See ``ConvGrads`` for what is returned."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    if not _l_contig(x):
        return _causal_conv1d_bwd_rows(dy, x, weight, bias, initial_state, silu_on)
    block_d, nc, num_warps = _bwd_tile(dim)
    nc = max(1, min(nc, triton.next_power_of_2(triton.cdiv(seqlen, CHUNK))))
    n_dblocks, n_lblocks = triton.cdiv(dim, block_d), triton.cdiv(seqlen, nc * CHUNK)
    # Split L over enough programs for about one full wave (8 resident 4-warp programs per SM
    # at 64 registers per thread, the bf16 kernels' count on sm_90), but no finer: each split
    # adds a (dim, W) partial to write and sum, about 1% of the bytes at 8 splits. On CPU (the
    # interpreter, in tests) one "SM" keeps several L-blocks per program, so small test shapes
    # exercise the loop over L.
    sms = num_sms(x.device.index) if x.is_cuda else 1
    n_split = min(n_lblocks, max(1, triton.cdiv(8 * sms, batch * n_dblocks)))
    blocks_per_program = triton.cdiv(n_lblocks, n_split)
    n_split = triton.cdiv(n_lblocks, blocks_per_program)

    dx, dw_part, db_part, dinit = _grad_buffers(x, weight, bias, initial_state, batch * n_split)
    grid = (batch, n_dblocks, n_split)
    _causal_conv1d_bwd_kernel[grid](
        dy, x, weight, bias, initial_state,
        dx, dw_part, db_part, dinit,
        dim, seqlen, blocks_per_program,
        *dy.stride(), *x.stride(), *weight.stride(), *_strides(bias, 1),
        *_strides(initial_state, 3), *dx.stride(), *dw_part.stride(), *_strides(db_part, 2),
        *_strides(dinit if initial_state is not None else None, 3),
        HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        W=width, SILU=silu_on, BLOCK_D=block_d, NC=nc, num_warps=num_warps,
        **LAUNCH_OPTIONS,
    )
    return _summed(dx, dw_part, db_part, dinit, x, weight, bias)


def _grad_buffers(x, weight, bias, initial_state, n_parts) -> tuple:
    """dx, the (n_parts, dim, W) dweight and (n_parts, dim) dbias partials (None without a bias)
    and dinitial_state (empty without one) that a backward kernel writes."""
    batch, dim, _ = x.shape
    width = weight.shape[1]
    dw_part = torch.empty((n_parts, dim, width), dtype=torch.float32, device=x.device)
    db_part = None if bias is None else torch.empty((n_parts, dim), dtype=torch.float32, device=x.device)
    dinit = x.new_empty(0, dtype=torch.float32)
    if initial_state is not None:
        dinit = torch.empty((batch, dim, width - 1), dtype=initial_state.dtype, device=x.device)
    return empty_activation(x), dw_part, db_part, dinit


def _summed(dx, dw_part, db_part, dinit, x, weight, bias) -> ConvGrads:
    """The gradients, with the per-program dweight/dbias partials summed in a fixed order."""
    jobs = [(dw_part, 1, weight.shape, weight.dtype)]
    if db_part is not None:
        jobs.append((db_part, 1, bias.shape, bias.dtype))
    dweight, *rest = sum_partials(jobs)
    dbias = rest[0] if rest else x.new_empty(0, dtype=torch.float32)
    return ConvGrads(dx=dx, dweight=dweight, dbias=dbias, dinitial_state=dinit)


def _causal_conv1d_bwd_rows(dy, x, weight, bias, initial_state, silu_on) -> ConvGrads:
    """The backward for x with unit stride along dim, by the row-streaming kernel."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    block_d, num_warps, seg_len = _bwd_rows_tile(x, batch, dim, seqlen)
    n_seg = triton.cdiv(seqlen, seg_len)
    dx, dw_part, db_part, dinit = _grad_buffers(x, weight, bias, initial_state, batch * n_seg)
    grid = (batch, triton.cdiv(dim, block_d), n_seg)
    _causal_conv1d_bwd_rows_kernel[grid](
        dy, x, weight, bias, initial_state,
        dx, dw_part, db_part, dinit,
        dim, seqlen, seg_len,
        *dy.stride(), *x.stride(), *weight.stride(), *_strides(bias, 1),
        *_strides(initial_state, 3), *dx.stride(), *dw_part.stride(), *_strides(db_part, 2),
        *_strides(dinit if initial_state is not None else None, 3),
        HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        W=width, SILU=silu_on, BLOCK_D=block_d, num_warps=num_warps,
        **LAUNCH_OPTIONS,
    )
    return _summed(dx, dw_part, db_part, dinit, x, weight, bias)
