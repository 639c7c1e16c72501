"""An in-place parallel scan (mamba.py's PScan style) under each backend, at model shapes.

Run on a CUDA machine from the repo root:  python benchmarks/bench_inplace_scan.py [--lens 1024 2048]
Writes bench_inplace_scan.md to $OUT when it is set.

The block is ``tests/test_pass_scan_inplace.py``'s ``block`` (the code the pass is tested
against): exp(Δ·A) and Δ·B·u materialised as (batch, L, dim, N), a Brent-Kung scan by in-place
updates of strided views, the readout by matmul, the D skip. Forward only, under no_grad (an
in-place scan trains only inside an autograd.Function, which the pass leaves alone). Columns:
median ms (CUDA events after warm-up) of eager, ``backend="inductor"`` and ``backend="ssm"``;
compile s of the first call; peak MB allocated during one call; the relative error of each
against an fp64 sequential loop on the same inputs (at L <= 2048).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

from common import copy_bandwidth_gbs, event_median_ms, markdown_table, peak_mib, write_out  # noqa: E402
from test_pass_scan_inplace import block, reference  # noqa: E402


def inputs(batch, L, dim, n, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, L, dim, device="cuda", generator=g)
    delta = torch.rand(batch, L, dim, device="cuda", generator=g) * 0.1 + 0.001
    A = -torch.rand(dim, n, device="cuda", generator=g) - 0.5
    B = torch.randn(batch, L, n, device="cuda", generator=g)
    C = torch.randn(batch, L, n, device="cuda", generator=g)
    D = torch.randn(dim, device="cuda", generator=g)
    return tuple(t.to(dtype) for t in (x, delta, A, B, C, D))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dim", type=int, default=1536)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--lens", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--backends", nargs="+", default=["eager", "inductor", "ssm"])
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for L in args.lens:
        xs = inputs(args.batch, L, args.dim, args.n, torch.float32)
        ref = reference(*(t.cpu() for t in xs)) if L <= 2048 else None
        for name in args.backends:
            torch._dynamo.reset()
            fn = block if name == "eager" else torch.compile(block, backend=name)
            t0 = time.time()
            with torch.no_grad():
                out = fn(*xs)
            torch.cuda.synchronize()
            compile_s = time.time() - t0 if name != "eager" else 0.0
            err = ((out.double().cpu() - ref).norm() / ref.norm()).item() if ref is not None else float("nan")
            with torch.no_grad():
                ms = event_median_ms(lambda: fn(*xs), warmup=3, iters=15)
                mb = peak_mib(lambda: fn(*xs))
            rows.append([L, name, ms, compile_s, mb, f"{err:.2e}"])
            print(rows[-1], flush=True)
    gbs = copy_bandwidth_gbs()
    text = (f"batch {args.batch}, dim {args.dim}, N {args.n}, fp32, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}; copy bandwidth {gbs:.0f} GB/s\n\n"
            + markdown_table(["L", "backend", "ms", "compile s", "peak MiB", "rel err vs fp64 loop"], rows))
    write_out("bench_inplace_scan.md", text)


if __name__ == "__main__":
    main()
