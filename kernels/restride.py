"""Copies of (batch, dim, L) activations between memory layouts, at copy bandwidth.

``torch.Tensor.copy_`` between an L-contiguous and a channel-innermost tensor is a strided
copy that coalesces on one side only: on the H200 the backward's seven such copies per scan
call (benchmarks/RESULTS.md, run 13, "staging copies") took ~1.1 ms at batch 8, L=2048,
bf16, about six times their bytes at copy bandwidth. Here a program moves a [64, 64] tile:
loaded along whichever axis is contiguous in the source, stored along whichever is contiguous
in the destination (Triton's layout conversion between the two goes through shared memory).
"""
import torch
import triton
import triton.language as tl

from .triton_common import LAUNCH_OPTIONS

_BLOCK = 64


@triton.jit
def _restride_kernel(
    src_ptr, dst_ptr, dim, L,
    stride_src_b, stride_src_d, stride_src_l,
    stride_dst_b, stride_dst_d, stride_dst_l,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid_b = tl.program_id(2).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[:, None]
    offs_l = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)[None, :]
    mask = (offs_d < dim) & (offs_l < L)
    x = tl.load(src_ptr + pid_b * stride_src_b + offs_d * stride_src_d + offs_l * stride_src_l, mask=mask)
    tl.store(dst_ptr + pid_b * stride_dst_b + offs_d * stride_dst_d + offs_l * stride_dst_l, x, mask=mask)


def restride_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for two (batch, dim, L) tensors of one shape, dtype and device.

    Example:
        >>> l_major = restride_into(torch.empty(x.shape, dtype=x.dtype, device=x.device), x)
    """
    if dst.shape != src.shape or dst.dim() != 3 or dst.dtype != src.dtype or dst.device != src.device:
        raise ValueError(
            f"restride_into: dst and src must be (batch, dim, L) tensors of one shape, dtype and device, got "
            f"dst {tuple(dst.shape)} {dst.dtype} {dst.device}, src {tuple(src.shape)} {src.dtype} {src.device}"
        )
    batch, dim, L = src.shape
    grid = (triton.cdiv(L, _BLOCK), triton.cdiv(dim, _BLOCK), batch)
    _restride_kernel[grid](src, dst, dim, L, *src.stride(), *dst.stride(), BLOCK_D=_BLOCK, BLOCK_L=_BLOCK,
                           num_warps=4, **LAUNCH_OPTIONS)
    return dst
