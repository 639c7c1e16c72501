"""Inductor's vectorised CPU code miscompiles an unrolled Mamba-1 loop (no ssm rewrite involved).

    python benchmarks/inductor_cpu_recurrence.py

For each state size N and length L it compiles the same loop with ``backend="inductor"`` (as
is, and with ``cpp.simdlen=1``) and with ``backend="ssm"`` on a lagged-readout variant the scan
pass leaves alone (the backend then compiles with ``cpp.simdlen=1`` itself), and prints each
one's max abs difference from eager. On torch 2.13 (CPU wheel, AVX-512 host) the vectorised
inductor columns are off by 1 to 80 from N = 8 on; the other columns are at rounding level.
"""
import argparse
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("ssm_compile.benchmarks")


def mamba_loop(u, delta, A, B, C):
    b, d, L = u.shape
    h = torch.zeros(b, d, A.shape[1])
    ys = []
    for t in range(L):
        dA = torch.exp(delta[:, :, t, None] * A)
        dBu = delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        h = dA * h + dBu
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=-1)


def lagged_readout_loop(u, delta, A, B, C):
    """The readout reads C one step late: not the op's scan, so the ssm passes leave it alone."""
    b, d, L = u.shape
    h = torch.zeros(b, d, A.shape[1])
    ys = []
    for t in range(L):
        h = torch.exp(delta[:, :, t, None] * A) * h + delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        ys.append((h * C[:, None, :, max(t - 1, 0)]).sum(-1))
    return torch.stack(ys, dim=-1)


def inputs(N: int, L: int, batch: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, dim, L, generator=g), F.softplus(torch.randn(batch, dim, L, generator=g)),
            -torch.rand(dim, N, generator=g) - 0.5, torch.randn(batch, N, L, generator=g),
            torch.randn(batch, N, L, generator=g))


def error(fn, backend, args, options=None) -> float:
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, options=options)
    return (compiled(*args) - fn(*args)).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--N", type=int, nargs="+", default=[4, 8, 17, 64])
    parser.add_argument("--L", type=int, nargs="+", default=[3, 12])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info("torch %s; max abs difference from eager", torch.__version__)
    log.info("%4s %4s %14s %22s %22s", "N", "L", "inductor", "inductor simdlen=1", "ssm (left alone)")
    for N in args.N:
        for L in args.L:
            a = inputs(N, L)
            log.info("%4d %4d %14.2e %22.2e %22.2e", N, L, error(mamba_loop, "inductor", a),
                     error(mamba_loop, "inductor", a, {"cpp.simdlen": 1}),
                     error(lagged_readout_loop, "ssm", a))


if __name__ == "__main__":
    main()
