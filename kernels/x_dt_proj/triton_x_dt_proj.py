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

from ..triton_common import dot_acc, dt_dot_meta, launcher

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


def choose_tiles(dtype: torch.dtype) -> Tiles:
    """The tiles of a call in ``dtype`` (R and 2N within ``MAX_RANK_PAD`` / ``MAX_BC_PAD``).

    From the H200 sweep (``benchmarks/bench_x_dt_proj.py --sweep``, run 22, batch 8, L 2048, dim
    1536, R 48, N 16): 64 x 64 tiles, 64 channels of dt per step, 4 warps, within 3 % of the
    fastest of 72 tile sets in bf16 (35.4 against 34.4 us), using ~80 KB of shared memory where
    the fastest needs ~224 KB, all an H200 has; fp32 takes 3 stages (~120 KB).
    """
    return Tiles(num_stages=3) if dtype == torch.float32 else Tiles()


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
def _x_dt_proj_kernel(
    x_ptr, wx_ptr, wdt_ptr, xdbl_ptr, dt_ptr,
    M, L, K, R, NBC, D,
    stride_xb, stride_xl, stride_xk,
    stride_wxe, stride_wxk,
    stride_wdd, stride_wdr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_BC: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    # x is (batch, L, K) with any strides: a row m is (m // L, m % L).
    b = rows // L
    x_rows = x_ptr + b.to(tl.int64) * stride_xb + (rows - b * L).to(tl.int64) * stride_xl
    ks = tl.arange(0, BLOCK_K)
    rs = tl.arange(0, BLOCK_R)
    cs = tl.arange(0, BLOCK_BC)
    r_ok = rs < R
    c_ok = cs < NBC
    # Two accumulators instead of one R + 2N wide: the dt columns are then a tensor of their
    # own, the operand of the second product (a register tile cannot be sliced).
    acc_dt = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc_bc = tl.zeros((BLOCK_M, BLOCK_BC), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        xt = tl.load(x_rows[:, None] + k[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_dt = tl.load(wx_ptr + rs[None, :] * stride_wxe + k[:, None] * stride_wxk,
                       mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        w_bc = tl.load(wx_ptr + (R + cs)[None, :] * stride_wxe + k[:, None] * stride_wxk,
                       mask=c_ok[None, :] & k_ok[:, None], other=0.0)
        acc_dt = dot_acc(xt, w_dt, acc_dt, PRECISION)
        acc_bc = dot_acc(xt, w_bc, acc_bc, PRECISION)
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


def x_dt_proj_fwd(x: torch.Tensor, x_weight: torch.Tensor, dt_weight: torch.Tensor,
                  tiles: Tiles | None = None, traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel; outputs are contiguous (..., R + 2N) and (..., dim) in x's dtype.

    ``traced``: launch through ``wrap_triton``, for a graph that records it (``kernels/inline.py``)."""
    x3 = _as_rows(x)
    batch, L, K = x3.shape
    E, R, D = x_weight.shape[0], dt_weight.shape[1], dt_weight.shape[0]
    tiles = tiles or choose_tiles(x.dtype)
    lead = tuple(x.shape[:-1])
    x_dbl = torch.empty(lead + (E,), device=x.device, dtype=x.dtype)
    dt = torch.empty(lead + (D,), device=x.device, dtype=x.dtype)
    M = batch * L
    grid = (triton.cdiv(M, tiles.block_m),)
    kernel, options = launcher(_x_dt_proj_kernel, traced)
    kernel[grid](
        x3, x_weight, dt_weight, x_dbl, dt,
        M, L, K, R, E - R, D,
        x3.stride(0), x3.stride(1), x3.stride(2),
        x_weight.stride(0), x_weight.stride(1),
        dt_weight.stride(0), dt_weight.stride(1),
        BLOCK_M=tiles.block_m, BLOCK_K=tiles.block_k, BLOCK_R=_pad(R), BLOCK_BC=_pad(E - R),
        BLOCK_D=tiles.block_d, PRECISION=dt_dot_meta(R, x.dtype)[1],
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **options,
    )
    return x_dbl, dt
