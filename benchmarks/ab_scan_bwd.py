"""A/B of the scan backward's kernel code: time the backward under the code now checked out,
labelled, so that one device call can run it, swap a kernel file, and run it again.

    python benchmarks/ab_scan_bwd.py --label new --tiles '{}' '{"num_warps": 2}'
    git show REV:kernels/selective_scan/triton_bwd.py > /tmp/old.py
    cp kernels/selective_scan/triton_bwd.py /tmp/new.py && cp /tmp/old.py kernels/selective_scan/triton_bwd.py
    python benchmarks/ab_scan_bwd.py --label old; cp /tmp/new.py kernels/selective_scan/triton_bwd.py

For each tiles override (JSON; '{}' = the default tiles), batch 8 and 1 at L=2048, fp32 and
bf16, L-major activations: GPU ms of one backward from CUDA-graph replay, the ms of the chunk
kernel, the chunk-state kernel, the state pass and the partial sums from the profiler, the
largest relative difference from the default tiles' grads, and whether two calls give the same
bits. Rows are appended to $OUT/ab_scan_bwd.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scan_bwd import DTYPES, bwd_call, make_inputs, tiles_timing  # noqa: E402
from common import markdown_table  # noqa: E402

from ssm_compile.kernels.selective_scan import triton_bwd  # noqa: E402


def same_bits(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in a._fields if getattr(a, f) is not None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--tiles", nargs="+", default=["{}"])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 1])
    p.add_argument("--set", nargs="*", default=[], metavar="NAME=INT",
                   help="module constants of triton_bwd to override, e.g. _PASS_ROWS=16")
    args = p.parse_args()
    for item in args.set:
        name, value = item.split("=")
        if not hasattr(triton_bwd, name):
            raise SystemExit(f"--set: triton_bwd has no {name}")
        setattr(triton_bwd, name, int(value))
    if args.set:
        args.label += " " + " ".join(args.set)
    rows = []
    for batch in args.batches:
        for dname in ("fp32", "bf16"):
            x, dy = make_inputs(batch, 2048, DTYPES[dname])
            ref = bwd_call(x, dy)()
            for text in args.tiles:
                tiles = json.loads(text)
                ms, chunk_ms, diff, first, kernels = tiles_timing(x, dy, ref, **tiles)
                small = [sum(v for name, v in kernels.items() if key in name)
                         for key in ("_chunk_state_kernel", "_state_pass_kernel", "_sum_partials_kernel")]
                rows.append([args.label, text, f"B{batch} L2048", dname, f"{ms:.4f}", f"{chunk_ms:.4f}",
                             *(f"{v:.4f}" for v in small), f"{diff:.1e}",
                             same_bits(first, bwd_call(x, dy, **tiles)())])
                print(rows[-1], flush=True)
            del x, dy, ref
            torch.cuda.empty_cache()
    table = markdown_table(["code", "tiles", "shape", "dtype", "bwd graph ms", "chunk kernel ms",
                            "chunk-state ms", "state pass ms", "partial sums ms", "rel diff from default",
                            "same bits twice"], rows)
    out = os.path.join(os.environ.get("OUT", "."), "ab_scan_bwd.md")
    with open(out, "a") as f:
        f.write(f"## {args.label} ({torch.cuda.get_device_name()}, triton {__import__('triton').__version__})\n\n"
                f"{table}\n\n")
    print(table)


if __name__ == "__main__":
    main()
