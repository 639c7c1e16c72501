"""The 130m-shaped HF Mamba under backend="ssm" without CUDA graphs, with the ops' Triton
launches handed to inductor (``kernels/inline.py``, the default) and without (the ops called
whole, as before: the backend option ``inline_launches=False``).

    python benchmarks/probe_inline_launches.py [--lens [512 2048 ...]] [--batch 8] [--repeats 3] [--train-len 128]

Rows: the forward at each L (do_bench median, host-launched: where the host is the limit, this
is what the launches cost), and one AdamW training step at ``--train-len``. The variants run
interleaved, ``--repeats`` rounds. The logits of both are compared: the same kernels with the
same launch sizes, so they should agree exactly. Appends to $OUT/probe_inline_launches.md.
"""
import argparse
import os
import statistics
import sys

import torch
from torch._inductor.utils import run_and_get_code

import ssm_compile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import VOCAB, build, train_step_ms  # noqa: E402
from common import markdown_table, median_ms  # noqa: E402

VARIANTS = {"inlined (default)": True, "ops whole": False}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lens", type=int, nargs="*", default=[512, 2048], help="none: no forward rows")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train-len", type=int, default=128, help="0: no training step")
    args = p.parse_args()
    rows = []
    with torch.no_grad():
        for L in args.lens:
            ids = torch.randint(0, VOCAB, (args.batch, L), device="cuda")
            runs, logits, launched = {}, {}, {}
            for name, inline in VARIANTS.items():
                # A model per variant, so that each compiled graph stays in its own dynamo cache.
                fn = torch.compile(build(True, torch.bfloat16).eval(),
                                   backend=ssm_compile.backend(inline_launches=inline))
                out, codes = run_and_get_code(fn, ids)
                logits[name] = out.logits.float()
                runs[name] = (lambda fn=fn: fn(ids))
                # What the compiled forward launches: a compile that failed with the launches
                # inlined falls back (the ops whole, or no rewrites), and must not pass for inlining.
                code = "\n".join(codes)
                launched[name] = ", ".join(f"{what} {code.count(what)}" for what in (
                    "torch.ops.ssm.selective_scan.", "_selective_scan_fwd_kernel", "'maxnreg': 168",
                    "torch.ops.ssm.causal_conv1d.", "_causal_conv1d_fwd_rows_kernel",
                    "torch.ops.ssm.x_dt_proj.", "_x_dt_proj_kernel"))
            times = {name: [] for name in runs}
            for _ in range(args.repeats):
                for name, run in runs.items():
                    times[name].append(median_ms(run))
            diff = (logits["inlined (default)"] - logits["ops whole"]).abs().max().item()
            for name in runs:
                rows.append([f"forward L={L}", name, f"{statistics.median(times[name]):.3f}",
                             " ".join(f"{t:.3f}" for t in times[name]), f"{diff:.3g}", launched[name]])
            print(rows[-2], rows[-1], flush=True)
            del runs, logits
            torch.cuda.empty_cache()
    steps, times = {}, {}
    ids = torch.randint(0, VOCAB, (args.batch, max(args.train_len, 1)), device="cuda")
    for name, inline in VARIANTS.items() if args.train_len else ():
        net = build(True, torch.bfloat16).train()
        step = train_step_ms(net, torch.compile(net, backend=ssm_compile.backend(inline_launches=inline)), ids)
        step()
        steps[name], times[name] = step, []
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(median_ms(step))
    for name in steps:
        rows.append([f"train step L={args.train_len}", name, f"{statistics.median(times[name]):.3f}",
                     " ".join(f"{t:.3f}" for t in times[name]), "-", "-"])
    table = markdown_table(["what", "variant", "ms (median)", "rounds", "max |logit diff|",
                            "in the forward's code: ssm op calls, kernel launches"], rows)
    head = (f"130m-shaped HF Mamba, batch {args.batch}, bf16, backend ssm without CUDA graphs, "
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n")
    print(head + table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_inline_launches.md"), "a") as f:
            f.write(head + table + "\n")


if __name__ == "__main__":
    main()
