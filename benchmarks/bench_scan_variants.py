"""Time the forward scan's default tiles on the headline shapes, for A/B tests of kernel edits.

    python benchmarks/bench_scan_variants.py --label base [--repeats 5]

A kernel edit is compared by running this once per variant in the same device call (apply the
edit between runs; Triton recompiles on the changed source). Each case prints the median and
the spread of ``--repeats`` CUDA-graph timings (GPU time only), and the largest error against
the fp64 reference at a small shape, so a faster variant that is wrong shows up as such.
``--delta-ready`` also times each case with Δ handed over finished (softplus(dt + bias) computed
beforehand, the op's ``delta_bias=None, delta_softplus=False``): what the scan would gain if the
kernel before it wrote Δ instead of the pre-softplus dt.
Appends its rows to $OUT/bench_scan_variants.md when OUT is set.
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scan import DIM, N, graph_ms, hf_layout, make_inputs  # noqa: E402
from common import copy_bandwidth_gbs  # noqa: E402
from ssm_compile.kernels.selective_scan.reference import selective_scan_ref  # noqa: E402
from ssm_compile.heuristic import compiled_stats  # noqa: E402
from ssm_compile.kernels.selective_scan.triton_fwd import (scan_fwd_config, selective_scan_fwd,  # noqa: E402
                                                             selective_scan_fwd_launch)

CASES = [("bf16", 8, 2048, "hf"), ("fp32", 8, 2048, "hf"), ("bf16", 8, 2048, "dense"),
         ("bf16", 1, 2048, "hf")]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def delta_ready(x):
    """The same inputs with Δ finished: softplus(delta + bias) in delta's dtype and layout, no bias."""
    delta = torch.nn.functional.softplus(x["delta"].float() + x["delta_bias"][:, None])
    return dict(x, delta=torch.empty_like(x["delta"]).copy_(delta), delta_bias=None)


def run(x, config):
    softplus = x["delta_bias"] is not None
    return selective_scan_fwd(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                              x["delta_bias"], softplus, None, False, config=config)[0]


def registers(x, config):
    """(n_regs, n_spills) of the output launch's kernel as the call compiles it."""
    compiled = selective_scan_fwd_launch(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                                         x["delta_bias"], x["delta_bias"] is not None, None, False,
                                         config=config)[2]
    return compiled_stats(compiled)


def max_error(dtype, layout, config=None, ready=False):
    """Largest |ours - fp64 reference| / max |reference| at batch 2, L 200 (a ragged tail)."""
    torch.manual_seed(0)
    x = make_inputs(2, 200, dtype)
    if layout == "hf":
        x = hf_layout(x)
    if ready:
        x = delta_ready(x)
    y = run(x, config).double()
    ref = selective_scan_ref(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                             x["delta_bias"], x["delta_bias"] is not None)
    return ((y - ref).abs().max() / ref.abs().max()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--caps", default="",
                    help="also time the default tile under these register caps (0 = none), e.g. 128,0")
    ap.add_argument("--delta-ready", action="store_true",
                    help="also time every variant with delta finished beforehand (no bias, no softplus)")
    args = ap.parse_args()
    bw = copy_bandwidth_gbs()
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = []
    for dname, batch, L, layout in CASES:
        dtype = DTYPES[dname]
        torch.manual_seed(0)
        x = make_inputs(batch, L, dtype)
        if layout == "hf":
            x = hf_layout(x)
        default = scan_fwd_config(batch, DIM, L, N, DIM, n_sms, layout == "hf", dtype != torch.float32)
        variants = [(args.label, None)]
        for cap in (int(c) for c in args.caps.split(",") if c):
            if default.num_warps == 4 and (cap or None) != default.max_registers:
                variants.append((f"{args.label} cap {cap or '-'}", default._replace(max_registers=cap or None)))
        inputs = [(False, x)] + ([(True, delta_ready(x))] if args.delta_ready else [])
        for (ready, xi), (label, cfg) in ((i, v) for i in inputs for v in variants):
            label = f"{label} delta ready" if ready else label
            times = [graph_ms(lambda xi: run(xi, cfg), xi) for _ in range(args.repeats)]
            err = max_error(dtype, layout, cfg, ready)
            regs = registers(xi, cfg)
            line = (f"| {label} | {dname} | {batch} | {L} | {layout} | {statistics.median(times):.4f} "
                    f"| {min(times):.4f}-{max(times):.4f} | {err:.1e} | {regs} | {bw:.0f} |")
            print(line, flush=True)
            lines.append(line)
        del x, inputs, xi
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "bench_scan_variants.md")
        new = not os.path.exists(path)
        with open(path, "a") as f:
            if new:
                f.write("| variant | dtype | batch | L | layout | graph ms (median) | range | max rel err "
                        "| (regs, spills) | copy GB/s |\n|---|---|---|---|---|---|---|---|---|---|\n")
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
