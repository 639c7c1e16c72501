"""Shared measurement helpers for the GPU benchmarks: timing, copy bandwidth, matmul rate.

All timings are medians of CUDA-event measurements after warm-up (triton's do_bench).
"""
from __future__ import annotations

import os
import statistics

import torch
import triton


def median_ms(fn, warmup_ms: int = 50, rep_ms: int = 200) -> float:
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def event_median_ms(fn, warmup: int = 5, iters: int = 30) -> float:
    """Median of per-call CUDA-event times: for calls too slow (or too few) for do_bench's
    time-based repetition, e.g. baselines that take hundreds of ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (GB/s)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(n: int = 8192, dtype=torch.bfloat16) -> float:
    """Dense matmul rate on random data (TFLOP/s)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = median_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def sm_clock_ghz() -> float:
    """Max SM clock in GHz from the driver (nvidia-smi's clocks.max.sm), 1.98 if unavailable."""
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        return float(out) / 1000
    except Exception:  # noqa: BLE001 - a missing nvidia-smi only loses the exact clock
        return 1.98


def peak_mib(fn) -> float:
    """MiB allocated at the peak of one call of ``fn``, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def markdown_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_out(name: str, text: str, append: bool = False) -> None:
    """Print the table and, when the device tool's $OUT is set, keep a copy there (``append``:
    after what earlier runs of the same call left in it)."""
    print(text, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, name), "a" if append else "w") as f:
            f.write(text + "\n")


def dynamo_folds_is_exporting() -> bool:
    """Whether this torch's dynamo folds ``torch.compiler.is_exporting()`` to True under plain
    torch.compile (torch 2.11; fixed upstream by pytorch#176499). HF's Mamba then takes its
    unrolled loop under every backend but ours (``ssm_compile.dynamo_compat``)."""
    def probe(x):
        return x + (1 if torch.compiler.is_exporting() else 0)

    torch._dynamo.reset()
    folded = bool(torch.compile(probe, backend="eager")(torch.zeros(())).item())
    torch._dynamo.reset()
    return folded


def graph_ms(fn, calls: int = 10) -> float:
    """GPU time per call of fn(): ``calls`` calls captured in one CUDA graph and replayed, so
    the host's launch cost is not in the figure."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ms = median_ms(graph.replay) / calls
    del graph
    return ms

