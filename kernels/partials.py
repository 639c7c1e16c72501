"""Deterministic sums of per-program partials, several tensors in one launch.

The backward kernels write their reductions over time and channels (dA, dB, dC, dD,
ddelta_bias; the conv's dweight and dbias) as fp32 partials, one row per program, so that no
two programs add into the same memory and every run gives the same bits. Summing the rows
with one ``torch.sum`` per gradient (plus a cast to the parameter's dtype) costs a launch each:
on the H200 the five reductions of the scan backward took 35 µs of GPU time at batch 1,
L=2048 (benchmarks/RESULTS.md, run 14), for ~16 MB of reads. Here one launch sums up to
``MAX_SEGMENTS`` partial tensors and writes each total in its output's dtype.

The order of the additions is fixed by the launch shape (a strided serial sum per row block,
then ``tl.sum``'s tree over the block), so the result is the same bits on every run.

Each partial gets its own block shape (``_blocks``): up to 64 rows a step, so that a partial of
many rows is read in a few wide steps by many programs. With one shape for all (8 rows x 256
columns) the scan backward's dA partial at batch 8, L=2048 (256 rows of 24576 columns) went to
96 programs of 32 dependent load steps each, and dD's (256 x 1536) to 6 programs, which made
the launch 0.033 ms for ~60 MB of reads (~14 µs at copy bandwidth); with these blocks it
takes 0.022 ms (H200 run 32).
"""
from typing import List, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .triton_common import LAUNCH_OPTIONS

MAX_SEGMENTS = 5
# Elements of a program's [rows, columns] block: 32 fp32 accumulators a thread at 4 warps.
_BLOCK_ELEMS = 4096
_MAX_BLOCK_R = 64
_MAX_BLOCK_M = 256


def _blocks(rows: int, cols: int) -> Tuple[int, int]:
    """(rows, columns) of a program's block for a ``rows`` x ``cols`` partial."""
    block_r = min(triton.next_power_of_2(max(rows, 1)), _MAX_BLOCK_R)
    return block_r, min(_BLOCK_ELEMS // block_r, _MAX_BLOCK_M, triton.next_power_of_2(max(cols, 1)))


@triton.jit
def _sum_rows(src_ptr, dst_ptr, R, M, pid, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr):
    """dst[m] = sum over r of src[r, m] for the pid-th block of BLOCK_M columns."""
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    acc = tl.zeros([BLOCK_R, BLOCK_M], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        # R * M may pass 2**31 (the dB/dC partials at long L): row offsets in int64.
        ptrs = src_ptr + offs_r.to(tl.int64)[:, None] * M + offs_m[None, :]
        acc += tl.load(ptrs, mask=(offs_r[:, None] < R) & mask_m[None, :], other=0.0)
    tl.store(dst_ptr + offs_m, tl.sum(acc, axis=0).to(dst_ptr.dtype.element_ty), mask=mask_m)


@triton.jit
def _sum_partials_kernel(
    s0, d0, R0, M0, end0,
    s1, d1, R1, M1, end1,
    s2, d2, R2, M2, end2,
    s3, d3, R3, M3, end3,
    s4, d4, R4, M4, end4,
    BR0: tl.constexpr, BM0: tl.constexpr, BR1: tl.constexpr, BM1: tl.constexpr, BR2: tl.constexpr,
    BM2: tl.constexpr, BR3: tl.constexpr, BM3: tl.constexpr, BR4: tl.constexpr, BM4: tl.constexpr,
):
    # Segment k owns programs [end_{k-1}, end_k); an unused segment is empty (end_k = end_{k-1}).
    pid = tl.program_id(0)
    if pid < end0:
        _sum_rows(s0, d0, R0, M0, pid, BR0, BM0)
    elif pid < end1:
        _sum_rows(s1, d1, R1, M1, pid - end0, BR1, BM1)
    elif pid < end2:
        _sum_rows(s2, d2, R2, M2, pid - end1, BR2, BM2)
    elif pid < end3:
        _sum_rows(s3, d3, R3, M3, pid - end2, BR3, BM3)
    elif pid < end4:
        _sum_rows(s4, d4, R4, M4, pid - end3, BR4, BM4)


def sum_partials(jobs: Sequence[Tuple[torch.Tensor, int, torch.Size, torch.dtype]]) -> List[torch.Tensor]:
    """Sum the leading ``reduce_dims`` axes of each fp32 partial, in one launch.

    Args:
        jobs: up to ``MAX_SEGMENTS`` of ``(partial, reduce_dims, out_shape, out_dtype)``: a
            contiguous fp32 CUDA tensor whose first ``reduce_dims`` axes are summed away, the
            shape of what is left as the caller wants it (same number of elements), and the
            dtype of the result.

    Returns:
        The totals, one per job, contiguous, in ``out_dtype``.

    Example:
        >>> dA, dD = sum_partials([(dA_part, 2, A.shape, A.dtype), (dD_part, 2, D.shape, D.dtype)])
    """
    if not 1 <= len(jobs) <= MAX_SEGMENTS:
        raise ValueError(f"sum_partials: expected 1 to {MAX_SEGMENTS} partials, got {len(jobs)}")
    args, outs, end, blocks = [], [], 0, {}
    for partial, reduce_dims, out_shape, out_dtype in jobs:
        if partial.dtype != torch.float32 or not partial.is_contiguous():
            raise ValueError(f"sum_partials: partials must be contiguous fp32, got {partial.dtype} "
                             f"with strides {partial.stride()}")
        rows = partial.shape[:reduce_dims].numel()
        cols = partial.shape[reduce_dims:].numel()
        if cols != torch.Size(out_shape).numel() or cols >= 2**31:
            raise ValueError(f"sum_partials: a partial of shape {tuple(partial.shape)} reduced over "
                             f"{reduce_dims} axes cannot give shape {tuple(out_shape)}")
        out = torch.empty(out_shape, dtype=out_dtype, device=partial.device)
        k = len(outs)
        blocks[f"BR{k}"], blocks[f"BM{k}"] = _blocks(rows, cols)
        end += triton.cdiv(cols, blocks[f"BM{k}"])
        args += [partial, out, rows, cols, end]
        outs.append(out)
    for k in range(len(jobs), MAX_SEGMENTS):
        args += [args[0], args[1], 0, 0, end]  # empty segment: never reached
        blocks[f"BR{k}"], blocks[f"BM{k}"] = 1, 1
    if end:
        _sum_partials_kernel[(end,)](*args, **blocks, num_warps=4, **LAUNCH_OPTIONS)
    return outs
