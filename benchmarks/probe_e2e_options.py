"""The 130m-shaped HF Mamba forward under backend="ssm" with CUDA graphs, once per set of backend
options, to decide whether an option is worth making a default.

    python benchmarks/probe_e2e_options.py [--len 2048] [--batch 8] [--repeats 3] [--variants NAME ...] [--train] [--host]

Per variant: the forward's median time from CUDA-graph replay, the GPU kernels (and memsets) one
forward launches with their summed GPU time (a profile of the same options without CUDA graphs),
and the largest logit difference against the first variant (the default). That difference only
clears an option when it is 0: the random bf16 model amplifies any change of rounding (eager
bf16 against its own fp32 twin: relative error ~0.95, bench_e2e.py), so a large one is a reason
to look, not a verdict. Variants run interleaved, ``--repeats`` rounds, so that drift
of the machine does not favour one. ``--host`` times the forward launched from Python instead
of replayed from a CUDA graph (where the forward is host-bound, L=512, options that change the
launches' host cost show only there). Appends a table to $OUT/probe_e2e_options.md when OUT is set,
and writes each variant's kernels by name (count, GPU µs) to $OUT/probe_e2e_kernels_<variant>.md.
"""
import argparse
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import VOCAB, build, train_step_ms  # noqa: E402
from common import markdown_table, median_ms  # noqa: E402

import ssm_compile  # noqa: E402

# name -> backend options. combo_kernels: inductor launches independent small kernels (each
# layer's -exp(A_log.float()), D.float(), ...) as one kernel, fewer launches per forward.
VARIANTS = {
    "default": {},
    # The two thin products (x_proj, dt_proj) as cuBLAS calls, as before ssm.x_dt_proj.
    "no_x_dt_proj": {"disable": ("x_dt_proj",)},
    # The conv forward's (and decode ops') launches behind the ops, as before run 25.
    "ops_whole": {"inline_launches": False},
    "combo_kernels": {"inductor_config": {"combo_kernels": True}},
    # Inductor's C++ wrapper forced on (the launches go out from compiled code, not Python).
    "cpp_wrapper": {"cpp_wrapper": True},
    # The default picks the C++ wrapper on CUDA without CUDA graphs (run 27); this turns it off.
    "no_cpp_wrapper": {"cpp_wrapper": False},
    "combo_kernels, mixed sizes": {"inductor_config": {"combo_kernels": True, "combo_kernel_allow_mixed_sizes": 2}},
}
# name -> the scan backward's tiles (``triton_bwd.choose_tiles`` overrides) in place of the
# launcher's defaults, default backend options; --train only (a forward never runs the backward).
BWD_VARIANTS = {
    # The chunk kernel the launcher took at batch 8 before run 23 (on L-major copies).
    "bwd_nblock": {"variant": "nblock"},
    # "serial" reading HF's channel-innermost rows as they are, without the L-major copies.
    "bwd_serial_unstaged": {"variant": "serial", "stage": False},
    # Run 23 call 4's "serial": two warps, a block of 16 channels per program (dim 1536).
    "bwd_serial_2w_block": {"variant": "serial", "num_warps": 2, "num_splits": 96},
}


def with_bwd_tiles(step, tiles):
    """``step`` with the scan backward's default tiles replaced by ``tiles`` during each call."""
    import functools

    from ssm_compile.kernels.selective_scan import triton_bwd

    # Cached as the launcher's own choice is, so the variant pays no extra host time.
    forced = functools.lru_cache(maxsize=None)(lambda *shape: triton_bwd.choose_tiles(*shape, **tiles))

    def run():
        saved, triton_bwd._default_tiles = triton_bwd._default_tiles, forced
        try:
            return step()
        finally:
            triton_bwd._default_tiles = saved

    return run


class FallbackCount(logging.Handler):
    """Counts the ssm backend's warnings while active: a compile that fell back (the launches
    kept in the ops, or the rewrites dropped) must not pass for the option it was asked for."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        self.count += 1
        print(f"ssm warning: {record.getMessage()[:300]}", flush=True)

    def __enter__(self):
        logging.getLogger("ssm_compile").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("ssm_compile").removeHandler(self)


def kernels_per_forward(model, ids, options, fn=None, name=None) -> tuple[int, float]:
    """(GPU kernels + memsets, their summed GPU ms) of one forward, profiled without CUDA graphs
    (``fn``: the model already compiled that way). With ``name`` and $OUT set, the per-kernel
    table (count, summed and mean GPU µs per kernel name) goes to
    $OUT/probe_e2e_kernels_<name>.md."""
    from torch.profiler import ProfilerActivity, profile

    if fn is None:
        torch._dynamo.reset()
        # The Python wrapper: the same kernels as the C++ one (run 27), a minute less to compile.
        fn = torch.compile(model, backend=ssm_compile.backend(**{"cpp_wrapper": False, **options}))
    fn(ids)
    fn(ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(ids)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.device_time for e in events)
    if name and os.environ.get("OUT"):
        by_name = {}
        for e in events:
            count, total = by_name.get(e.name, (0, 0.0))
            by_name[e.name] = (count + 1, total + e.device_time)
        rows = [[k[:90], c, f"{t:.1f}", f"{t / c:.2f}"]
                for k, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])]
        path = os.path.join(os.environ["OUT"], f"probe_e2e_kernels_{name.replace(' ', '_').replace(',', '')}.md")
        with open(path, "w") as f:
            f.write(f"{name}: {len(events)} GPU kernels and memsets, {total_us:.1f} µs\n\n"
                    + markdown_table(["kernel", "count", "µs", "µs each"], rows) + "\n")
    return len(events), total_us / 1e3


def train_rounds(args, variants):
    """One AdamW step of the model in train mode per variant (no CUDA graphs, as bench_e2e's
    training row), interleaved ``--repeats`` rounds; each variant trains its own copy."""
    ids = torch.randint(0, VOCAB, (args.batch, args.len), device="cuda")
    steps, times, fallbacks, compile_s = {}, {name: [] for name in variants}, {}, {}
    for name in variants:
        torch._dynamo.reset()
        net = build(True, torch.bfloat16).train()
        step = train_step_ms(net, torch.compile(net, backend=ssm_compile.backend(**VARIANTS.get(name, {}))), ids)
        if name in BWD_VARIANTS:
            step = with_bwd_tiles(step, BWD_VARIANTS[name])
        with FallbackCount() as fallbacks[name]:
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            compile_s[name] = time.perf_counter() - t0
        steps[name] = step
        print(f"{name}: compiled in {compile_s[name]:.1f} s", flush=True)
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(median_ms(step))
    rows = [[name, f"{statistics.median(times[name]):.2f}", " ".join(f"{t:.2f}" for t in times[name]),
             f"{compile_s[name]:.1f}", fallbacks[name].count] for name in variants]
    table = markdown_table(["variant", "train step ms (median)", "rounds", "first step s", "ssm warnings"], rows)
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_e2e_options.md"), "a") as f:
            f.write(f"training step, batch {args.batch}, L {args.len}, bf16, 130m-shaped HF Mamba\n\n{table}\n")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train", action="store_true",
                   help="time a training step (forward, backward, AdamW) per variant instead")
    p.add_argument("--host", action="store_true",
                   help="time the forward launched from Python, without CUDA graphs")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS) + list(BWD_VARIANTS),
                   help="which variants to run (the first is the reference for the logit difference); "
                        f"{', '.join(BWD_VARIANTS)} with --train only")
    args = p.parse_args()
    if args.train:
        return train_rounds(args, args.variants)
    if set(args.variants) & set(BWD_VARIANTS):
        p.error(f"{', '.join(BWD_VARIANTS)} change the backward: pass --train")
    variants = {name: VARIANTS[name] for name in args.variants}
    model = build(True, torch.bfloat16).eval()
    ids = torch.randint(0, VOCAB, (args.batch, args.len), device="cuda")
    compiled, outputs, times, counts, fallbacks = {}, {}, {name: [] for name in variants}, {}, {}
    with torch.no_grad():
        for name, options in variants.items():
            if not args.host:
                counts[name] = kernels_per_forward(model, ids, options, name=name)
            torch._dynamo.reset()
            mode = None if args.host else "reduce-overhead"
            with FallbackCount() as fallbacks[name]:
                fn = torch.compile(model, backend=ssm_compile.backend(mode=mode, **options))

                def run(fn=fn):
                    if not args.host:
                        torch.compiler.cudagraph_mark_step_begin()
                    return fn(ids)

                run()
            if args.host:
                counts[name] = kernels_per_forward(model, ids, options, fn, name=name)
            outputs[name] = run().logits.float().clone()
            compiled[name] = run
            print(f"{name}: {counts[name][0]} GPU kernels and memsets, {counts[name][1]:.3f} ms summed",
                  flush=True)
        for _ in range(args.repeats):
            for name, run in compiled.items():
                times[name].append(median_ms(run))
    first = next(iter(variants))
    rows = [[name, f"{statistics.median(times[name]):.3f}", " ".join(f"{t:.3f}" for t in times[name]),
             counts[name][0], f"{counts[name][1]:.3f}",
             f"{(outputs[name] - outputs[first]).abs().max().item():.2e}", fallbacks[name].count]
            for name in variants]
    timing = "host-launched ms (median)" if args.host else "CUDA-graph ms (median)"
    table = markdown_table(["variant", timing, "rounds", "kernels + memsets",
                            "their GPU ms", f"max |logits - {first}|", "ssm warnings"], rows)
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_e2e_options.md"), "a") as f:
            f.write(f"batch {args.batch}, L {args.len}, bf16, 130m-shaped HF Mamba\n\n{table}\n")


if __name__ == "__main__":
    main()
