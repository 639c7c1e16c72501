"""A regression check of end-to-end speed, cheap enough to run beside every whole-suite GPU call.

  python benchmarks/speed_check.py [--train] [--tolerance 1.10]

Times the 130m-shaped HF Mamba (24 layers, d_model 768, batch 8, bf16, random weights) under
backend="ssm": the forward at L=2048 from a CUDA graph, and with --train one AdamW step at
L=2048 (no CUDA graphs, as bench_e2e's training row). Each time is compared with the last figure
recorded in RESULTS.md for the same card; a time above ``tolerance`` x that figure fails the
step (exit status 1), naming what regressed.

Why it exists: the whole-suite GPU calls check values, not speed. Run 68 found the forward 17%
slower than run 50 (two copy kernels a layer from a pass change in run 63); nothing had timed
the model for five sessions. The reference figures below are from benchmark runs, with their
source; update them (and say so in RESULTS.md) when a change makes the model faster.
"""
from __future__ import annotations

import argparse
import sys

import torch

import ssm_compile

from bench_e2e import VOCAB, build, floor_ms, train_step_ms
from common import copy_bandwidth_gbs, event_median_ms, matmul_tflops, median_ms, write_out

# (card name fragment, part) -> (ms, where it was measured).
REFERENCE_MS = {
    ("H100", "forward"): (15.25, "run 68, call 3 (profiles/bench_e2e_forward_h100_run68_call3.md)"),
    ("H100", "train"): (87.27, "run 69, call 1 (profiles/speed_check_h100_run69.md)"),
    ("H200", "forward"): (14.47, "run 51 (profiles/bench_e2e_forward_h200_run51.md)"),
    ("H200", "train"): (77.94, "run 33, call 3 (profiles/probe_e2e_options_train_run33_call3.md)"),
}


def reference(part: str):
    name = torch.cuda.get_device_name()
    for (card, p), value in REFERENCE_MS.items():
        if p == part and card in name:
            return value
    return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--train", action="store_true", help="also time one training step")
    p.add_argument("--tolerance", type=float, default=1.10)
    args = p.parse_args()

    gbs, tflops = copy_bandwidth_gbs(), matmul_tflops()
    fl = floor_ms(args.batch, args.len, 2, tflops, gbs)
    ids = torch.randint(0, VOCAB, (args.batch, args.len), device="cuda")
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {gbs:.0f} GB/s, "
             f"bf16 matmul {tflops:.0f} TFLOP/s; batch {args.batch}, L {args.len}, bf16",
             "", "| part | ms | reference ms | ratio | floor/time | verdict |", "|---|---|---|---|---|---|"]
    failed = []

    def record(part: str, ms: float, floor: float | None):
        ref = reference(part)
        ratio = ms / ref[0] if ref else None
        verdict = "no reference for this card" if ref is None else (
            "REGRESSED" if ratio > args.tolerance else "ok")
        if verdict == "REGRESSED":
            failed.append(f"{part}: {ms:.2f} ms against {ref[0]:.2f} ms ({ref[1]})")
        lines.append(f"| {part} | {ms:.2f} | {ref[0] if ref else '-'} | {f'{ratio:.3f}' if ratio else '-'} | "
                     f"{f'{floor / ms:.3f}' if floor else '-'} | {verdict} |")
        print(lines[-1], flush=True)

    model = build(True, torch.bfloat16).eval()
    with torch.no_grad():
        fast = torch.compile(model, backend=ssm_compile.backend(mode="reduce-overhead"))

        def run():
            torch.compiler.cudagraph_mark_step_begin()
            return fast(ids)

        run(), run()
        record("forward", median_ms(run), fl)
    del fast, model
    torch._dynamo.reset()
    if args.train:
        net = build(True, torch.bfloat16).train()
        step = train_step_ms(net, torch.compile(net, backend="ssm"), ids)
        record("train", event_median_ms(step, warmup=3, iters=10), None)
    write_out("speed_check.md", "\n".join(lines) + "\n")
    for f in failed:
        print(f"speed regression: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
