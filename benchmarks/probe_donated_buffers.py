"""What giving up AOTAutograd's donated buffers costs the training step.

    python benchmarks/probe_donated_buffers.py [--len 2048] [--batch 8] [--repeats 3]

The backend compiles a rewritten graph's backward together with its forward (so that a failure
there falls back too), and a backward compiled ahead may not reuse its saved tensors' memory
("donated buffers") if a later ``backward(retain_graph=True)`` is to work: since run 38 the
backend donates none (``ssm_compile/compiler._backward_compiled_now``). This times the 130m-shaped
HF Mamba's AdamW step (bf16, train mode, no CUDA graphs, as bench_e2e's training row) with the
committed setting and with donation as before, interleaved ``--repeats`` rounds, and reports each
one's peak allocated memory above what stays resident (both models, grads, AdamW states). Inductor's FX graph and AOTAutograd caches are off: both variants
hash to the same cache key. Appends its table to $OUT/probe_donated_buffers.md when OUT is set.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch._functorch.config
import torch._inductor.config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import VOCAB, build, train_step_ms  # noqa: E402
from common import markdown_table, median_ms  # noqa: E402

import ssm_compile  # noqa: E402
import ssm_compile.compiler as compiler  # noqa: E402


def _donating():
    """The setting before run 38: the backward compiled ahead, with AOTAutograd's donation."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(force_non_lazy_backward_lowering=True)


VARIANTS = {"no donation (committed)": None, "donated (before)": _donating}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    committed = compiler._backward_compiled_now
    ids = torch.randint(0, VOCAB, (args.batch, args.len), device="cuda")
    steps, first_s, peak, times = {}, {}, {}, {name: [] for name in VARIANTS}
    for name, context in VARIANTS.items():
        torch._dynamo.reset()
        compiler._backward_compiled_now = context or committed
        net = build(True, torch.bfloat16).train()
        step = train_step_ms(net, torch.compile(net, backend=ssm_compile.backend()), ids)
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first_s[name] = time.perf_counter() - t0
        compiler._backward_compiled_now = committed
        steps[name], peak[name] = step, 0.0
        print(f"{name}: first step {first_s[name]:.1f} s", flush=True)
    for _ in range(args.repeats):
        for name, step in steps.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            resident = torch.cuda.memory_allocated()  # both models, their grads and AdamW states
            times[name].append(median_ms(step))
            peak[name] = max(peak[name], (torch.cuda.max_memory_allocated() - resident) / 2**30)
    rows = [[name, f"{statistics.median(times[name]):.2f}", " ".join(f"{t:.2f}" for t in times[name]),
             f"{peak[name]:.2f}", f"{first_s[name]:.1f}"] for name in VARIANTS]
    table = markdown_table(["variant", "train step ms (median)", "rounds", "step peak above resident GiB", "first step s"], rows)
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_donated_buffers.md"), "a") as f:
            f.write(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; training step, batch "
                    f"{args.batch}, L {args.len}, bf16, 130m-shaped HF Mamba\n\n{table}\n")


if __name__ == "__main__":
    main()
