"""Where a training step's time goes: torch.profiler over 3 steps of the 130m-shaped HF Mamba
under backend="ssm" (after 3 warm-up steps), tables by self GPU time and by self and total host time.

    python benchmarks/profile_train.py [--len 128] [--batch 8]

Run 11 ran this at L=128, where the step is host-bound (benchmarks/profiles/profile_train_ssm_L128.txt).
"""
import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_e2e  # noqa: E402
from common import write_out  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    net = bench_e2e.build(True, torch.bfloat16).train()
    run = torch.compile(net, backend="ssm")
    ids = torch.randint(0, bench_e2e.VOCAB, (args.batch, args.len), device="cuda")
    step = bench_e2e.train_step_ms(net, run, ids)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    table = "\n\n".join(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
                        for key in ("self_cuda_time_total", "self_cpu_time_total", "cpu_time_total"))
    write_out(f"profile_train_ssm_L{args.len}.txt", table)


if __name__ == "__main__":
    main()
