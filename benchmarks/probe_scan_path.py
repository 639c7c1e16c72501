"""Which scan form does dynamo capture from the installed transformers on this device, and why?

  python benchmarks/probe_scan_path.py

HF's `mamba_selective_scan` takes `associative_scan` only when `use_associative_scan` is set,
`associative_scan` imports, and `is_torchdynamo_compiling() and not is_torchdynamo_exporting()`;
otherwise it runs the Python time loop, which dynamo unrolls (compile time grows with L). This
prints each of those predicates as dynamo sees them, the graph breaks of a one-layer model, and
which ssm passes fire, for use_cache off and on.
"""
from __future__ import annotations

import importlib.metadata as md
import logging

import torch


def predicates() -> dict:
    from transformers.utils import import_utils as iu

    def probe(x):
        return (x + 1 * int(iu.is_torchdynamo_compiling()) + 10 * int(iu.is_torchdynamo_exporting())
                + 100 * int(iu.is_torch_greater_or_equal("2.9.0")) + 1000 * int(iu.is_mambapy_available()))

    v = int(torch.compile(probe, backend="eager", fullgraph=True)(torch.zeros((), device="cuda")).item())
    return {"is_compiling": bool(v % 10), "is_exporting": bool(v // 10 % 10),
            "torch>=2.9": bool(v // 100 % 10), "mambapy": bool(v // 1000 % 10)}


def one_layer(use_cache: bool, L: int = 16):
    from torch._dynamo.utils import counters
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(vocab_size=64, hidden_size=64, state_size=16, num_hidden_layers=1, use_associative_scan=True)
    m = MambaForCausalLM(cfg).cuda().eval()
    ids = torch.randint(0, 64, (1, L), device="cuda")
    torch._dynamo.reset()
    with torch.no_grad():
        ex = torch._dynamo.explain(m)(ids, use_cache=use_cache)
    ops = {}
    for g in ex.graphs:
        for n in g.graph.nodes:
            if n.op == "call_function":
                name = getattr(n.target, "__name__", str(n.target))
                ops[name] = ops.get(name, 0) + 1
    print(f"use_cache={use_cache}: {ex.graph_count} graph(s), {ex.graph_break_count} break(s); "
          f"associative_scan nodes: {ops.get('associative_scan', 0)}, mul nodes: {ops.get('mul', 0)}", flush=True)
    for r in ex.break_reasons:
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(r.user_stack[-4:]))
        print(f"  break: {str(r.reason)[:400]!r} at {where}", flush=True)
    counters.clear()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(m, backend="ssm")(ids, use_cache=use_cache)
    print(f"  ssm rewrites: {dict(counters['ssm'])}", flush=True)


def direct_hop():
    """associative_scan(pointwise) called directly on CUDA: does dynamo keep the HOP, and does
    the scan_assoc pass take it?"""
    from torch._dynamo.utils import counters
    from torch._higher_order_ops.associative_scan import associative_scan

    def f(dA, dBu, C):
        def combine(l, r):
            return l[0] * r[0], r[0] * l[1] + r[1]
        _, h = associative_scan(combine, (dA, dBu), dim=2, combine_mode="pointwise")
        return (h * C[:, None]).sum(-1)

    b, d, L, n = 2, 8, 32, 4
    dt = torch.rand(b, d, L, device="cuda")
    A = -torch.rand(d, n, device="cuda")
    B, C = torch.randn(b, L, n, device="cuda"), torch.randn(b, L, n, device="cuda")
    u = torch.randn(b, d, L, device="cuda")
    dA = torch.exp(A[None, :, None] * dt[..., None])
    dBu = dt[..., None] * B[:, None] * u[..., None]
    counters.clear()
    torch._dynamo.reset()
    try:
        torch.compile(f, backend="ssm")(dA, dBu, C)
        print(f"direct pointwise HOP: ssm rewrites {dict(counters['ssm'])}", flush=True)
    except Exception as e:  # noqa: BLE001 - report and go on: this is a probe
        print(f"direct pointwise HOP failed: {type(e).__name__}: {str(e)[:400]}", flush=True)


def main():
    logging.basicConfig(level=logging.WARNING)
    for pkg in ("torch", "triton", "transformers", "kernels", "mambapy", "mamba_ssm", "huggingface_hub"):
        try:
            print(f"{pkg} {md.version(pkg)}", flush=True)
        except md.PackageNotFoundError:
            print(f"{pkg} not installed", flush=True)
    print("predicates under dynamo:", predicates(), flush=True)
    direct_hop()
    for use_cache in (False, True):
        one_layer(use_cache)


if __name__ == "__main__":
    main()
