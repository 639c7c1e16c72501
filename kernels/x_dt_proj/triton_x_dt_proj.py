"""Triton kernel of ``ssm::x_dt_proj``: ``x_dbl = x @ W_x^T`` and ``dt = x_dbl[:, :R] @ W_dt^T``.

Mamba's x_proj reads the conv output (M rows of `dim`) and writes M rows of R + 2N; dt_proj
then reads the first R columns back and writes M rows of `dim`. Both products are thin (R + 2N
and R are 48-80 at the usual shapes), so each is a pass over its large operand at memory
speed, and as two cuBLAS calls they cost two launches, a cuBLAS memset, and (under inductor) a
copy of the dt columns into a contiguous operand. Here one program takes BLOCK_M rows through
both products: it streams its rows of x once, keeps the R dt columns in registers (rounded to
the output dtype first, as eager's dt_proj reads them from x_dbl), and writes its rows of dt.

The weights (a few hundred KB) are re-read by every program from L2. fp32 operands run as
three tf32 products each (``tf32x3``, about fp32's accuracy; the scan's fused dt product makes
the same choice), not as one tf32 product, which would lose precision cuBLAS's fp32 default keeps.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..layout import empty_activation
from ..triton_common import LAUNCH_OPTIONS, dot_acc, dt_dot_meta, silu

# Where the kernel runs; everywhere else the op runs the two torch products. H200, run 22
# (benchmarks/bench_x_dt_proj.py, bf16, dim 1536, R 48, N 16): at 16384 rows 35.1 us against
# cuBLAS's 40.7; at 4096 rows (64 programs for 132 SMs) 18.8 against 12.2. With Mamba-2.8b's
# R = 160 (R_pad 256) the dt accumulator alone is 64 registers a thread at 32 rows, and the
# kernel took 1.27 ms against 0.136. So: R and 2N as Mamba-130m..1.4b have them (R <= 64, N
# <= 16), and at least the rows it was measured faster at.
MAX_RANK_PAD = 64
MAX_BC_PAD = 32
MIN_ROWS = 16384


class Tiles(NamedTuple):
    """Launch parameters of one call."""

    block_m: int = 64
    block_k: int = 64
    block_d: int = 64
    num_warps: int = 4
    num_stages: int = 4
    conv_k: int = 256
    conv_bk: int = 64


def choose_tiles(dtype: torch.dtype) -> Tiles:
    """The tiles of a call in ``dtype`` (R and 2N within ``MAX_RANK_PAD`` / ``MAX_BC_PAD``).

    From the H200 sweep (``benchmarks/bench_x_dt_proj.py --sweep``, run 22, batch 8, L 2048, dim
    1536, R 48, N 16): 64 x 64 tiles, 64 channels of dt per step, 4 warps, within 3 % of the
    fastest of 72 tile sets in bf16 (35.4 against 34.4 us), using ~80 KB of shared memory where
    the fastest needs ~224 KB, all an H200 has; fp32 takes 3 stages (~120 KB).
    """
    return Tiles(num_stages=3) if dtype == torch.float32 else Tiles()


def choose_conv_tiles(dtype: torch.dtype) -> Tiles:
    """The tiles of a call that also runs the conv (``conv_x_dt_proj_fwd``)."""
    # 8 warps: at 4 the conv's four tap tiles and the two accumulators need 255 registers and
    # spill (sm_90, offline); at 8, 215 and no spill.
    return Tiles(num_warps=8, num_stages=2)


def _pad(n: int) -> int:
    # tl.dot wants every dimension a power of two of at least 16.
    return max(16, triton.next_power_of_2(n))


@functools.cache
def _shared_memory(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def shared_bytes(tiles: Tiles, rank: int, bc: int, dtype: torch.dtype) -> int:
    """Shared memory the kernel asks for, with a margin: each pipeline stage holds a tile of x
    and the two weight tiles, and the second product stages dt_low and a W_dt tile."""
    size = dtype.itemsize
    stage = tiles.block_m * tiles.block_k + tiles.block_k * (_pad(rank) + _pad(bc))
    second = tiles.block_m * _pad(rank) + _pad(rank) * tiles.block_d
    return int(1.25 * size * (tiles.num_stages * stage + second))


def column_offsets_fit(x: torch.Tensor) -> bool:
    """The kernel forms k * stride_k in int32 (rows' offsets are int64): an L-major x whose
    columns lie 2^31 elements apart or more must go to the two products instead."""
    return (x.shape[-1] - 1) * abs(x.stride(-1)) < 2**31


def supported(x: torch.Tensor, x_weight: torch.Tensor, dt_weight: torch.Tensor) -> bool:
    """Whether the kernel takes this call on x's GPU (else the op runs the two torch products):
    enough rows to fill the GPU, R and 2N within the register tiles, and the tiles' shared
    memory within the device's (a launch that asks for more fails instead of running)."""
    rows = x.numel() // max(x.shape[-1], 1)
    rank, bc = dt_weight.shape[1], x_weight.shape[0] - dt_weight.shape[1]
    if x.device.type != "cuda" or rows < MIN_ROWS or _pad(rank) > MAX_RANK_PAD or _pad(bc) > MAX_BC_PAD:
        return False
    if not column_offsets_fit(x):
        return False
    tiles = choose_tiles(x.dtype)
    return shared_bytes(tiles, rank, bc, x.dtype) <= _shared_memory(x.device.index)


@triton.jit
def _conv_rows(x_rows, u_rows, t, row_ok, k, k_ok, cw_ptr, cb_ptr,
               stride_xl, stride_xk, stride_cwd, stride_cwk, stride_cb, stride_uk,
               CONV_W: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, SILU: tl.constexpr):
    # u on these rows and channels: bias + sum_j w[:, j] * x[t - (W-1) + j], zero inputs before
    # t = 0, then silu, in fp32 in the conv rows kernel's order (taps first, bias last), rounded
    # to u's dtype. Row t - j is re-read for each tap: the re-reads hit the cache lines the tap
    # before brought in.
    for j in tl.static_range(CONV_W):
        back = CONV_W - 1 - j
        xj = tl.load(x_rows[:, None] - back * stride_xl + k[None, :] * stride_xk,
                     mask=(row_ok & (t >= back))[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        wj = tl.load(cw_ptr + k * stride_cwd + j * stride_cwk, mask=k_ok, other=0.0).to(tl.float32)
        if j == 0:
            acc = wj[None, :] * xj
        else:
            acc += wj[None, :] * xj
    if HAS_CONV_BIAS:
        acc += tl.load(cb_ptr + k * stride_cb, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = silu(acc)
    tl.store(u_rows[:, None] + k[None, :] * stride_uk, acc.to(u_rows.dtype.element_ty),
             mask=row_ok[:, None] & k_ok[None, :])


@triton.jit
def _products(a_rows, stride_ak, row_ok, k_lo, k_hi, ks, wx_ptr, rs, r_ok, cs, c_ok, R,
              stride_wxe, stride_wxk, acc_dt, acc_bc, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # acc_dt += a[:, k] @ W_x[:R, k]^T and acc_bc += a[:, k] @ W_x[R:, k]^T over k in [k_lo, k_hi).
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + ks
        k_ok = k < k_hi
        at = tl.load(a_rows[:, None] + k[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_dt = tl.load(wx_ptr + rs[None, :] * stride_wxe + k[:, None] * stride_wxk,
                       mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        w_bc = tl.load(wx_ptr + (R + cs)[None, :] * stride_wxe + k[:, None] * stride_wxk,
                       mask=c_ok[None, :] & k_ok[:, None], other=0.0)
        acc_dt = dot_acc(at, w_dt, acc_dt, PRECISION)
        acc_bc = dot_acc(at, w_bc, acc_bc, PRECISION)
    return acc_dt, acc_bc


@triton.jit
def _x_dt_proj_kernel(
    x_ptr, wx_ptr, wdt_ptr, xdbl_ptr, dt_ptr, cw_ptr, cb_ptr, u_ptr,
    M, L, K, R, NBC, D,
    stride_xb, stride_xl, stride_xk,
    stride_wxe, stride_wxk,
    stride_wdd, stride_wdr,
    stride_cwd, stride_cwk, stride_cb,
    stride_ub, stride_ul, stride_uk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_BC: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    CONV_W: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, SILU: tl.constexpr, CONV_K: tl.constexpr,
    CONV_BK: tl.constexpr,
):
    # CONV_W = 0: the products read x. CONV_W >= 2: x is the causal conv's input, and the
    # products read its output u, which the program computes and writes (for the scan) CONV_K
    # channels at a time and reads back from L2 after a barrier. Feeding the products the conv's
    # registers directly made Triton compute the conv twice, once in the store's layout and once
    # in the tensor-core operand's, at 210-255 registers with spills (sm_90, offline).
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    # x (and u) are (batch, L, K) with any strides: a row m is (m // L, m % L).
    b = rows // L
    t = rows - b * L
    x_rows = x_ptr + b.to(tl.int64) * stride_xb + t.to(tl.int64) * stride_xl
    ks = tl.arange(0, BLOCK_K)
    rs = tl.arange(0, BLOCK_R)
    cs = tl.arange(0, BLOCK_BC)
    r_ok = rs < R
    c_ok = cs < NBC
    # Two accumulators instead of one R + 2N wide: the dt columns are then a tensor of their
    # own, the operand of the second product (a register tile cannot be sliced).
    acc_dt = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc_bc = tl.zeros((BLOCK_M, BLOCK_BC), dtype=tl.float32)
    if CONV_W > 0:
        u_rows = u_ptr + b.to(tl.int64) * stride_ub + t.to(tl.int64) * stride_ul
        for kc in range(0, K, CONV_K):
            kc_end = tl.minimum(kc + CONV_K, K)
            for k0 in range(kc, kc_end, CONV_BK):
                k = k0 + tl.arange(0, CONV_BK)
                _conv_rows(x_rows, u_rows, t, row_ok, k, k < kc_end, cw_ptr, cb_ptr, stride_xl, stride_xk,
                           stride_cwd, stride_cwk, stride_cb, stride_uk, CONV_W, HAS_CONV_BIAS, SILU)
            # Every thread's u stores are visible to the whole program after the barrier.
            tl.debug_barrier()
            acc_dt, acc_bc = _products(u_rows, stride_uk, row_ok, kc, kc_end, ks, wx_ptr, rs, r_ok, cs, c_ok, R,
                                       stride_wxe, stride_wxk, acc_dt, acc_bc, BLOCK_K, PRECISION)
    else:
        acc_dt, acc_bc = _products(x_rows, stride_xk, row_ok, 0, K, ks, wx_ptr, rs, r_ok, cs, c_ok, R,
                                   stride_wxe, stride_wxk, acc_dt, acc_bc, BLOCK_K, PRECISION)
    out_rows = rows.to(tl.int64) * (R + NBC)
    # Rounded to the output dtype before the second product: eager's dt_proj reads the rounded
    # x_dbl, so this keeps the same rounding points (only the summation order differs).
    low = acc_dt.to(xdbl_ptr.dtype.element_ty)
    tl.store(xdbl_ptr + out_rows[:, None] + rs[None, :], low, mask=row_ok[:, None] & r_ok[None, :])
    tl.store(xdbl_ptr + out_rows[:, None] + R + cs[None, :], acc_bc.to(xdbl_ptr.dtype.element_ty),
             mask=row_ok[:, None] & c_ok[None, :])
    ds = tl.arange(0, BLOCK_D)
    dt_rows = rows.to(tl.int64) * D
    for d0 in range(0, D, BLOCK_D):
        d = d0 + ds
        d_ok = d < D
        w = tl.load(wdt_ptr + d[None, :] * stride_wdd + rs[:, None] * stride_wdr,
                    mask=d_ok[None, :] & r_ok[:, None], other=0.0)
        out = dot_acc(low, w, tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32), PRECISION)
        tl.store(dt_ptr + dt_rows[:, None] + d[None, :], out.to(dt_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as (batch, L, K) without a copy where its strides allow one (any 2-D or 3-D x)."""
    if x.dim() == 2:
        return x.unsqueeze(0)
    if x.dim() == 3:
        return x
    # More leading dims: merge all but the last two; reshape copies only when they don't merge.
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _launch(x3: torch.Tensor, x_weight: torch.Tensor, dt_weight: torch.Tensor, lead: tuple,
            tiles: Tiles | None, conv: tuple = (None, None, False), u3: torch.Tensor | None = None):
    """x_dbl and dt of the rows of x3 (batch, L, K), or of the conv of x3's rows into u3 when
    ``conv`` = (weight, bias, silu) has a weight."""
    batch, L, K = x3.shape
    E, R, D = x_weight.shape[0], dt_weight.shape[1], dt_weight.shape[0]
    tiles = tiles or choose_tiles(x3.dtype)
    x_dbl = torch.empty(lead + (E,), device=x3.device, dtype=x3.dtype)
    dt = torch.empty(lead + (D,), device=x3.device, dtype=x3.dtype)
    conv_weight, conv_bias, silu_on = conv
    grid = (triton.cdiv(batch * L, tiles.block_m),)
    _x_dt_proj_kernel[grid](
        x3, x_weight, dt_weight, x_dbl, dt, conv_weight, conv_bias, u3,
        batch * L, L, K, R, E - R, D,
        x3.stride(0), x3.stride(1), x3.stride(2),
        x_weight.stride(0), x_weight.stride(1),
        dt_weight.stride(0), dt_weight.stride(1),
        *((0, 0) if conv_weight is None else conv_weight.stride()),
        0 if conv_bias is None else conv_bias.stride(0),
        *((0, 0, 0) if u3 is None else u3.stride()),
        BLOCK_M=tiles.block_m, BLOCK_K=tiles.block_k, BLOCK_R=_pad(R), BLOCK_BC=_pad(E - R),
        BLOCK_D=tiles.block_d, PRECISION=dt_dot_meta(R, x3.dtype)[1],
        CONV_W=0 if conv_weight is None else conv_weight.shape[1], HAS_CONV_BIAS=conv_bias is not None,
        SILU=silu_on, CONV_K=tiles.conv_k, CONV_BK=min(tiles.conv_bk, tiles.conv_k), num_warps=tiles.num_warps, num_stages=tiles.num_stages, **LAUNCH_OPTIONS,
    )
    return x_dbl, dt


def x_dt_proj_fwd(x: torch.Tensor, x_weight: torch.Tensor, dt_weight: torch.Tensor,
                  tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel; outputs are contiguous (..., R + 2N) and (..., dim) in x's dtype."""
    return _launch(_as_rows(x), x_weight, dt_weight, tuple(x.shape[:-1]), tiles)


def conv_x_dt_proj_fwd(x: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                       silu_on: bool, x_weight: torch.Tensor, dt_weight: torch.Tensor,
                       tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv of x (batch, dim, L) into u (x's layout, as ``ssm::causal_conv1d`` allocates
    it) and the two products of u's rows, in one launch: (u, x_dbl, dt)."""
    u = empty_activation(x)
    tiles = tiles or choose_conv_tiles(x.dtype)
    x_dbl, dt = _launch(x.transpose(1, 2), x_weight, dt_weight, (x.shape[0], x.shape[2]), tiles,
                        (conv_weight, conv_bias, silu_on), u.transpose(1, 2))
    return u, x_dbl, dt
