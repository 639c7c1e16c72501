"""How many graphs ``dynamic=True`` compiles for one Mamba block over four (batch, L) shapes, per
backend: tells a torch version's own specialisation apart from one the ssm passes cause.

    python benchmarks/probe_dynamic_recompiles.py [--bisect]   # --bisect: also each pass alone
    TORCH_LOGS=dynamic python benchmarks/probe_dynamic_recompiles.py --only conv1d   # where guards come from

Why: ``tests/test_robustness.py::test_dynamic_shapes_compile_once`` compiled once on torch 2.13
and four times on the H200's torch 2.11 (run 35). The bisection put it in the layout pass's fake
re-run; run 36 found the cause (torch 2.11's C++ ``F.linear`` reading sizes as ints outside the
Python dispatcher) and fixed it (``passes/fx_utils.fake_dispatch``): 1 graph in every row on
torch 2.11 (CPU, run 36).
"""
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_robustness import SHAPES, MambaSsmStyleBlock, minimal_block  # noqa: E402

import ssm_compile  # noqa: E402


def graphs(backend, mark):
    torch._dynamo.reset()
    counters.clear()
    block = minimal_block(MambaSsmStyleBlock)
    fast = torch.compile(block, backend=backend, dynamic=None if mark else True)
    g = torch.Generator().manual_seed(2)
    for batch, length in SHAPES:
        x = torch.randn(batch, 6, length, generator=g)
        if mark:
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 2)
        with torch.no_grad():
            fast(x)
    return counters["stats"]["unique_graphs"]


def main():
    print(f"torch {torch.__version__}")
    rows = [("eager", "eager"), ("aot_eager", "aot_eager"),
            ("ssm inductor=False", ssm_compile.backend(inductor=False)),
            ("ssm, no passes", ssm_compile.backend(inductor=False, passes=()))]
    if "--only" in sys.argv:  # one pass, dynamic=True, one compile: for TORCH_LOGS=dynamic
        name = sys.argv[sys.argv.index("--only") + 1]
        print(f"| ssm, only {name} | dynamic=True | {graphs(ssm_compile.backend(inductor=False, passes=(name,)), False)} |")
        return
    if "--bisect" in sys.argv:
        rows += [(f"ssm, only {p}", ssm_compile.backend(inductor=False, passes=(p,))) for p in ssm_compile.PASS_NAMES]
    for name, be in rows:
        for mark in (False, True):
            try:
                n = graphs(be, mark)
            except Exception as e:  # a backend that cannot run this at all is a row too
                n = f"{type(e).__name__}: {str(e)[:80]}"
            print(f"| {name} | {'mark_dynamic' if mark else 'dynamic=True'} | {n} |")


if __name__ == "__main__":
    main()
