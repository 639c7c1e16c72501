"""Probe DC (run 69): Mamba-1 blocks with one change in a non-scan piece (the D·u skip, the
z·silu(z) gate, the causal conv1d, x_proj's split, dt_proj and its softplus). Every program gave
eager's values and gradients; what the probe found:

- A Δ that is a function of dt_proj other than its bias and softplus (``exp(dt_proj(dt))``,
  ``relu(...) + c``, ``softplus(...).clamp(min)``, ``2 * softplus(...)``), or a dt_proj that keeps
  its bias because a second one was added: ssm.x_dt_proj left x_proj and dt_proj apart with no
  reason. It now says that Δ is not dt_proj (``x_dt_proj._function_of_dt_proj``).
"""
import pytest
import torch
import torch.nn.functional as F

from ssm_compile.report import explain
from utils import check_explained_against_fp64

BATCH, L, DIM, N, R = 2, 5, 6, 3, 2


def block(x, W_x, W_dt, b_dt, A_log, D, kind):
    """x_proj, dt_proj and a Python-loop scan with the skip; ``kind`` changes Δ's function."""
    dt, B, C = F.linear(x, W_x).split([R, N, N], dim=-1)
    if kind == "exp":
        delta = torch.exp(F.linear(dt, W_dt, b_dt) * 0.3)
    else:  # the bias added twice: the delta pass folds the outer add, dt_proj keeps its bias
        delta = F.softplus(F.linear(dt, W_dt, b_dt) + b_dt)
    A = -torch.exp(A_log)
    dA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
    dBu = torch.einsum("bld,bln,bld->bldn", delta, B, x)
    h = x.new_zeros(BATCH, DIM, N)
    ys = []
    for t in range(L):
        h = dA[:, t] * h + dBu[:, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
    return torch.stack(ys, 1) + x * D


@pytest.mark.parametrize("kind, reason", [("exp", "Δ is delta = torch.exp of a value computed from dt_proj"),
                                          ("bias_twice", "keeps its bias (the delta pass did not move it")])
def test_delta_a_function_of_dt_proj_gets_a_reason(kind, reason):
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(BATCH, L, DIM, generator=g), torch.randn(R + 2 * N, DIM, generator=g) * 0.5,
            torch.randn(DIM, R, generator=g) * 0.5, torch.randn(DIM, generator=g) * 0.5,
            torch.rand(DIM, N, generator=g).log(), torch.randn(DIM, generator=g)]
    args = [a.requires_grad_() for a in args]
    fn = lambda *a: block(*a, kind)  # noqa: E731
    report = explain(fn, *args)
    assert report.counts["scan_loop"] == 1 and not report.counts.get("x_dt_proj"), report.format(graphs=False)
    assert any(m.family == "x_dt_proj" and reason in m.reason for m in report.misses), report.format(graphs=False)
    check_explained_against_fp64(report, fn, args)


def test_skip_spelled_as_an_einsum_gets_a_reason():
    """``y + einsum('bld,d->bld', x, D)`` is D·u, but the pass proves a skip only from a product
    (``tail._skip_by_einsum`` says why): it is left as written, and until probe DC had no reason."""
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(BATCH, L, DIM, generator=g), torch.randn(BATCH, L, DIM, generator=g).sigmoid(),
            torch.rand(DIM, N, generator=g).log(), torch.randn(BATCH, L, N, generator=g),
            torch.randn(BATCH, L, N, generator=g), torch.randn(DIM, generator=g)]
    args = [a.requires_grad_() for a in args]

    def fn(x, delta, A_log, B, C, D):
        dA = torch.exp(torch.einsum("bld,dn->bldn", delta, -torch.exp(A_log)))
        dBu = torch.einsum("bld,bln,bld->bldn", delta, B, x)
        h = x.new_zeros(BATCH, DIM, N)
        ys = []
        for t in range(L):
            h = dA[:, t] * h + dBu[:, t]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
        return torch.stack(ys, 1) + torch.einsum("bld,d->bld", x, D)

    report = explain(fn, *args)
    assert report.counts["scan_loop"] == 1 and not report.counts.get("skip"), report.format(graphs=False)
    assert any(m.family == "skip" and "torch.einsum('bld,d->bld'" in m.reason and "only as a product" in m.reason
               for m in report.misses), report.format(graphs=False)
    check_explained_against_fp64(report, fn, args)
