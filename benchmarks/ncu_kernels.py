"""Launch one scan kernel a few times, for Nsight Compute to profile (issues 4, 5).

    ncu --clock-control none --set full -k regex:_selective_scan_fwd --launch-skip 3 \
        --launch-count 1 -o fwd python3 benchmarks/ncu_kernels.py --which fwd --dtype bf16

``--which fwd``: the forward kernel at the benchmark's headline shape (batch 8, dim 1536,
L 2048, N 16, z, D, delta_bias, softplus). ``--which bwd``: the backward launcher at the same
shape (every backward kernel runs; pick one with ncu's ``-k``). ``gpu_session.sh ncu`` runs
both and prints each kernel's stall breakdown and its SASS with per-instruction stall samples.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scan_bwd import bwd_call, make_inputs  # noqa: E402

from ssm_compile.kernels.selective_scan.triton_fwd import selective_scan_fwd  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--which", choices=("fwd", "bwd"), required=True)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--calls", type=int, default=5)
    args = p.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    x, dy = make_inputs(args.batch, args.len, dtype)
    if args.which == "fwd":
        B4, C4 = x["B"].unsqueeze(1), x["C"].unsqueeze(1)

        def call():
            selective_scan_fwd(x["u"], x["delta"], x["A"], B4, C4, x["D"], x["z"], x["delta_bias"],
                               True, None, False)
    else:
        call = bwd_call(x, dy)
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
