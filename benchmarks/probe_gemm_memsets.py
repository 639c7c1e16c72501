"""The 130m forward's matmuls one by one: which cuBLAS kernel runs, whether a memset comes with it,
and how long both take, under each BLAS library torch can route ``mm`` to.

    python benchmarks/probe_gemm_memsets.py

Why: the end-to-end profile (RESULTS.md, runs 18-20) has 73 ``cudaMemsetAsync`` per forward, one
before each of cuBLAS's cooperative ("coop") GEMM kernels, ~0.9 us each plus a gap in the CUDA
graph. They are cuBLAS's own, issued inside ``aten::mm``; nothing the backend emits. This checks
whether another library choice (``torch.backends.cuda.preferred_blas_library``, a process-wide
user setting the backend must not change) runs the same shapes without them, and at what speed.
Appends a table to $OUT/probe_gemm_memsets.md when OUT is set.
"""
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, median_ms  # noqa: E402

TOKENS, D_MODEL, D_INNER, RANK, N, VOCAB = 8 * 2048, 768, 1536, 48, 16, 50280
# (name, M, K, N, output dtype): every matmul of one layer, and the LM head with its fp32 logits.
SHAPES = [("in_proj", TOKENS, D_MODEL, 2 * D_INNER, None), ("x_proj", TOKENS, D_INNER, RANK + 2 * N, None),
          ("dt_proj", TOKENS, RANK, D_INNER, None), ("out_proj", TOKENS, D_INNER, D_MODEL, None),
          ("lm_head", TOKENS, D_MODEL, VOCAB, torch.float32)]


def one_call(a, b, out_dtype):
    if out_dtype is None:
        return lambda: torch.mm(a, b)
    return lambda: torch.mm(a, b, out_dtype=out_dtype)


def kernels_of(fn) -> list[str]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main():
    rows = []
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, m, k, n, out_dtype in SHAPES:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # nn.Linear's weight.t()
            fn = one_call(a, b, out_dtype)
            names = kernels_of(fn)
            memsets = sum("memset" in x.lower() for x in names)
            gemms = [x for x in names if "memset" not in x.lower()]
            times = [median_ms(fn) for _ in range(3)]
            rows.append([lib, name, f"{m}x{k}x{n}", memsets, " ".join(g[:48] for g in gemms),
                         f"{statistics.median(times) * 1e3:.1f}"])
            print(rows[-1], flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    table = markdown_table(["library", "matmul", "M x K x N", "memsets", "kernels", "us"], rows)
    print(table)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "probe_gemm_memsets.md"), "a") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
