"""Why the scan kernel is slower inside the model than alone: the SM clock and power under each.

    python benchmarks/probe_clocks.py [--len 2048] [--batch 8] [--seconds 4]

The forward scan measures ~0.226 ms alone (bf16, batch 8, L=2048, HF's layout, CUDA-graph
replay) and ~0.235-0.240 ms a layer in the profile of the 130m model's forward. The kernel is
bound by issue and MUFU rate, so it scales with the SM clock, and the model's matmuls draw more
power than the scan alone. Phases, each with ``nvidia-smi`` sampling the SM clock and the board
power every 50 ms:

1. the scan alone, replayed from a CUDA graph;
2. the compiled model's forward (backend ssm, CUDA graphs), back to back;
3. the scan alone again.

Then one profiled forward gives the scan kernel's mean time inside the model. Appends to
$OUT/probe_clocks.md.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import ssm_compile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import VOCAB, build  # noqa: E402
from bench_scan import hf_layout, make_inputs, ours  # noqa: E402
from common import markdown_table, write_out  # noqa: E402


def sampled(fn, seconds: float) -> tuple[float, float, float, int]:
    """Run ``fn`` (one batch of GPU work, synchronized inside) for ``seconds`` while nvidia-smi
    samples; (ms per call, median SM MHz, median W, samples)."""
    with tempfile.NamedTemporaryFile("r", suffix=".csv") as log:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "50", "-f", log.name])
        time.sleep(0.3)
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            calls += fn()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        smi.terminate()
        smi.wait()
        rows = [line.split(",") for line in log.read().splitlines() if line.strip()]
    mhz = [float(r[0]) for r in rows]
    watts = [float(r[1]) for r in rows]
    return elapsed * 1e3 / calls, statistics.median(mhz), statistics.median(watts), len(rows)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seconds", type=float, default=4.0)
    args = p.parse_args()

    torch.manual_seed(0)
    x = hf_layout(make_inputs(args.batch, args.len, torch.bfloat16))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            ours(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(50):
            ours(x)

    def scan_batch():
        graph.replay()
        torch.cuda.synchronize()
        return 50

    ids = torch.randint(0, VOCAB, (args.batch, args.len), device="cuda")
    model = build(True, torch.bfloat16).eval()
    fn = torch.compile(model, backend=ssm_compile.backend(mode="reduce-overhead"))
    with torch.no_grad():
        for _ in range(3):
            fn(ids)
        torch.cuda.synchronize()

        def model_batch():
            for _ in range(10):
                fn(ids)
            torch.cuda.synchronize()
            return 10

        rows = []
        for name, batch_fn in (("scan alone", scan_batch), ("model forward", model_batch),
                               ("scan alone, after", scan_batch)):
            ms, mhz, watts, n = sampled(batch_fn, args.seconds)
            rows.append([name, f"{ms:.4f}", f"{mhz:.0f}", f"{watts:.0f}", n])
            print(rows[-1], flush=True)

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn(ids)
            torch.cuda.synchronize()
    scan = [e for e in prof.key_averages() if e.key == "_selective_scan_fwd_kernel"]
    in_model = scan[0].device_time_total / scan[0].count / 1e3 if scan else float("nan")
    table = markdown_table(["phase", "ms per call", "SM MHz (median)", "board W (median)", "samples"], rows)
    text = (f"{torch.cuda.get_device_name()}, bf16, batch {args.batch}, L {args.len}, scan in HF's layout; "
            f"the model: 130m-shaped HF Mamba, backend ssm with CUDA graphs\n\n{table}\n\n"
            f"scan kernel inside the model's forward (profiler, 5 forwards): {in_model:.4f} ms a call\n")
    write_out("probe_clocks.md", text, append=True)


if __name__ == "__main__":
    main()
