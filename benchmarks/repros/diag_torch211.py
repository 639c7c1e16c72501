# Diagnostics for the suite's failures on the H200 machine's torch 2.11 (run 40), which the same
# torch 2.11 on a CPU-only host passes:
#   --autocast  per-parameter gradient errors of test_robustness's autocast training step (the
#               ssm backend and eager, both against fp64)
#   --by-pass   the same for dt_proj / x_proj with each pass off in turn
#   --dynamic   the dynamic-batch case of test_unseen_layouts (run with TORCH_LOGS=recompiles,dynamic)
import copy
import sys

import torch

sys.path.insert(0, "tests")
from test_robustness import BF16, fp64_grads, minimal_block  # noqa: E402
from utils import rel_err  # noqa: E402

import ssm_compile  # noqa: E402
from ssm_compile.compiler import backend  # noqa: E402


def training_step(**options):
    torch._dynamo.reset()
    block = minimal_block()
    compiled_block = copy.deepcopy(block)
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(1))
    _, _, ref_grads = fp64_grads(block, x)
    fast = torch.compile(compiled_block, backend=backend(**options))
    with torch.autocast("cpu", dtype=BF16):
        eager = block(x.clone().requires_grad_())
        out = fast(x.clone().requires_grad_())
    (eager.float() ** 2).sum().backward()
    (out.float() ** 2).sum().backward()
    eager_grads = dict(block.named_parameters())
    return {n: (rel_err(p.grad, ref_grads[n]), rel_err(eager_grads[n].grad, ref_grads[n]))
            for n, p in compiled_block.named_parameters()}


print(torch.__version__)
if "--autocast" in sys.argv:
    for inductor in (False, True):
        print(f"inductor={inductor}")
        for name, (c, e) in training_step(inductor=inductor).items():
            print(f"  {name:24s} compiled {c:.2e} eager {e:.2e}")
if "--by-pass" in sys.argv:
    for off in ((), ("delta",), ("tail",), ("xproj",), ("x_dt_proj",), ("fuse",), ("scan_loop",)):
        errs = training_step(inductor=False, disable=off)
        print(f"off={off}: " + ", ".join(f"{n} {c:.2e}/{e:.2e}" for n, (c, e) in errs.items()
                                         if n.startswith(("dt_proj", "x_proj"))))
if "--dynamic" in sys.argv:
    from test_unseen_layouts import DIM, L, N, channel_innermost, scan_y

    torch._dynamo.reset()
    cf = torch.compile(lambda u, delta, A, B, C: scan_y(u, delta, A, B, C), backend=ssm_compile.backend(inductor=False))
    for batch in (2, 3, 4):
        g = torch.Generator().manual_seed(batch)
        u = channel_innermost(torch.randn(batch, DIM, L, generator=g))
        delta = channel_innermost(torch.rand(batch, DIM, L, generator=g) * 0.5 + 0.05)
        A = -torch.rand(DIM, N, generator=g) - 0.5
        cf(u, delta, A, torch.randn(batch, N, L, generator=g), torch.randn(batch, N, L, generator=g))
        print("batch", batch, "done")
