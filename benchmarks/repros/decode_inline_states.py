"""Which states of a directly called, in-place decode op does inductor get wrong on CUDA?

Run 54's first device call found ``torch.ops.ssm.selective_state_update(cache[1].clone(), ...)`` (and
``causal_conv1d_update``) compiled by plain inductor with static sizes up to ~2.7 off eager on
torch 2.11 (`tests/test_decode_views.py`), where the op is inlined as its Triton launch. This
tries one state producer per case, compares y and the cache with eager, and writes inductor's
code for each case under $OUT (``python benchmarks/repros/decode_inline_states.py``).
"""
import os
import pathlib

import torch

import ssm_compile  # noqa: F401  (registers the ops)
from ssm_compile.kernels.decode import op as decode_op

decode_op.register()
LAYERS, DIM, N, W = 3, 6, 4, 4
g = torch.Generator().manual_seed(0)
A = (-torch.rand(DIM, N, generator=g) - 0.1).cuda()
D = torch.randn(DIM, generator=g).cuda()
w = torch.randn(DIM, W, generator=g).cuda()
b = torch.randn(DIM, generator=g).cuda()

STATES = {
    "input": lambda c: c,  # the caller passes cache[1].clone(): the state is the graph input itself
    "cache[1]": lambda c: c[1],
    "cache[1].clone()": lambda c: c[1].clone(),
    "cache[0].clone()": lambda c: c[0].clone(),
    "cache[1] * 1": lambda c: c[1] * 1,
    "cache[1].contiguous()": lambda c: c[1].contiguous(),
    "cache.clone()[1]": lambda c: c.clone()[1],
    "cache[1].clone() twice": lambda c: c[1].clone().clone(),
    "zeros + cache[1]": lambda c: torch.zeros_like(c[1]) + c[1],
}


def state_step(layer, returned):
    def step(cache, x, dt, Bm, Cm):
        s = layer(cache)
        y = torch.ops.ssm.selective_state_update(s, x, dt, A, Bm, Cm, D, None, None, True)
        return (y, s) if returned else (y,)
    return step


def conv_step(layer, returned):
    def step(cache, x):
        s = layer(cache)
        y = torch.ops.ssm.causal_conv1d_update(x, s, w, b, "silu")
        return (y, s) if returned else (y,)
    return step


def main():
    out = pathlib.Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    from torch._inductor.utils import run_and_get_code

    for kind, make, returned, (name, layer) in [
            (k, m, r, item) for k, m in (("state", state_step), ("conv", conv_step)) for r in (False, True)
            for item in STATES.items()]:
        if True:
            gen = torch.Generator().manual_seed(3)
            cache = torch.randn(LAYERS, 2, DIM, W if kind == "conv" else N, generator=gen).cuda()
            if name == "input":
                cache = cache[1].clone()
            rest = ([torch.randn(2, DIM, generator=gen).cuda()] if kind == "conv" else
                    [torch.randn(2, DIM, generator=gen).cuda() for _ in "xd"]
                    + [torch.randn(2, N, generator=gen).cuda() for _ in "BC"])
            fn = make(layer, returned)
            ref_cache, got_cache = cache.clone(), cache.clone()
            ref = fn(ref_cache, *rest)
            torch._dynamo.reset()
            with torch._inductor.config.patch(force_disable_caches=True):
                got, codes = run_and_get_code(torch.compile(fn, backend="inductor", fullgraph=True), got_cache, *rest)
            errs = [(a - r).abs().max().item() for a, r in zip(got, ref)]
            err_c = (got_cache - ref_cache).abs().max().item()
            verdict = "ok" if max(*errs, err_c) < 1e-5 else "WRONG"
            launches = sum(code.count(".run(") for code in codes)
            print(f"{kind:5s} {name:24s} returned={returned!s:5s} y/state {errs} cache {err_c:.2e} {verdict}; "
                  f"{launches} kernel launches", flush=True)
            slug = f"{kind}_{int(returned)}_{name}".replace(" ", "_").replace("[", "").replace("]", "").replace("(", "").replace(
                ")", "").replace("*", "x").replace("+", "plus").replace(".", "_")
            (out / f"{slug}.py").write_text("\n\n# ----\n\n".join(codes))


if __name__ == "__main__":
    main()
