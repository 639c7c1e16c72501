"""A torch.cond after a rewritten conv (tests/test_unseen_bodies.py's "cond" case): what
ssm_compile.explain says on the installed torch.

    python benchmarks/repros/cond_body_write_torch211.py      (from outside the repository root)

torch 2.13: the conv is rewritten (1 rewrite). torch 2.11 (H100, run 51): the layout check's run
of the rewritten graph on fake tensors fails inside torch.cond ("AssertionError: Mixing fake
modes NYI"), so the graph compiles without rewrites, with that reason: correct, not rewritten.
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
from test_unseen_bodies import BODIES  # noqa: E402

import ssm_compile  # noqa: E402

g = torch.Generator().manual_seed(0)
x = torch.randn(2, 4, 6, generator=g, requires_grad=True)
w = torch.randn(4, 1, 4, generator=g, requires_grad=True)
b = torch.randn(4, generator=g, requires_grad=True)
print(torch.__version__)
print(ssm_compile.explain(BODIES["cond"], x, w, b).format(graphs=False))
