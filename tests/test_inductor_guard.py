"""A CPU graph that keeps a recurrence the scan pass left alone is compiled unvectorised.

Inductor's vectorised C++ code miscompiles unrolled Mamba-1 loops with N >= 8 (torch 2.13,
AVX-512: 18.5 off eager for the loop below, ``benchmarks/inductor_cpu_recurrence.py``), with no
ssm rewrite involved; ``cpp.simdlen=1`` computes them right. Whether a host's vector ISA trips
the bug varies, so the tests check the decision as well as the numbers.
"""
import logging

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import ssm_compile
from ssm_compile.compiler import SSMBackend, _unvectorised_cpu_recurrence
from ssm_compile.config import SSMOptions

N, L = 17, 6


def lagged_readout_loop(u, delta, A, B, C):
    """C read one step late: a near-miss the scan pass leaves alone, so the loop stays unrolled."""
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = torch.exp(delta[:, :, t, None] * A) * h + delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        ys.append((h * C[:, None, :, max(t - 1, 0)]).sum(-1))
    return torch.stack(ys, dim=-1)


def mamba_loop(u, delta, A, B, C):
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = torch.exp(delta[:, :, t, None] * A) * h + delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=-1)


def inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 8, L, generator=g), F.softplus(torch.randn(2, 8, L, generator=g)),
            -torch.rand(8, N, generator=g) - 0.5, torch.randn(2, N, L, generator=g), torch.randn(2, N, L, generator=g))


def test_refused_recurrence_on_the_cpu_matches_eager_through_inductor(caplog):
    args = inputs()
    torch._dynamo.reset()
    counters.clear()
    with caplog.at_level(logging.WARNING, logger="ssm_compile"):
        out = torch.compile(lagged_readout_loop, backend="ssm")(*args)
    assert not counters["ssm"]
    assert "cpp.simdlen=1" in caplog.text
    torch.testing.assert_close(out, lagged_readout_loop(*args), rtol=1e-5, atol=1e-5)


def test_the_decision_is_recorded_and_only_where_a_recurrence_was_refused():
    records = []
    for fn in (lagged_readout_loop, mamba_loop):
        torch._dynamo.reset()
        torch.compile(fn, backend=SSMBackend(SSMOptions(inductor=False), on_graph=records.append))(*inputs())
    refused, rewritten = records
    assert refused.options["inductor_config"] == {"cpp.simdlen": 1}
    assert "inductor_config" not in rewritten.options and rewritten.rewrites
    assert "cpp.simdlen" in str(ssm_compile.explain(lagged_readout_loop, *inputs()))


def test_a_users_simdlen_and_non_cpu_graphs_are_left_as_they_are():
    class Ctx:
        misses = [type("Miss", (), {"family": "scan_loop"})()]

    user = SSMOptions(inductor_config={"cpp.simdlen": 8})
    assert _unvectorised_cpu_recurrence(user, Ctx, [torch.zeros(2)]) is user
    plain = SSMOptions()
    assert _unvectorised_cpu_recurrence(plain, Ctx, [torch.zeros(2, device="meta")]) is plain
    assert _unvectorised_cpu_recurrence(plain, Ctx, [torch.zeros(2)]).inductor_config == {"cpp.simdlen": 1}
