"""Reverse loops whose tensors are also read in another order, or only in part (run 63).

``unreverse_loops`` flips a tensor's time slices where a loop reads them last step first. It
used to flip a tensor only when every slice of it in the graph was read in that one order, and
from the last step down to step 0. So a bidirectional block whose two loops share C (or dA, or
Δ·B·u) kept its reverse loop unrolled, a reverse loop that stops before step 0
(``range(L - 1, k, -1)``) was left alone, and under ``dynamic=True`` a C that the loop only
indexes (its length a fresh symbol) kept every recompiled reverse loop unrolled (probe CR). Now
each pass over a tensor's steps, last to first, is flipped on its own.
"""
import pytest
import torch
import torch.nn.functional as F

import ssm_compile
from ssm_compile.compiler import SSMBackend
from ssm_compile.config import SSMOptions


def disc(u, delta, A, B):
    """(batch, dim, L) activations, B (batch, N, L): exp(Δ·A) and Δ·B·u as (batch, dim, L, N)."""
    return (torch.exp(torch.einsum("bdl,dn->bdln", delta, A)),
            torch.einsum("bdl,bnl,bdl->bdln", delta, B, u))


def run(dA, dBu, C, steps):
    h = dA.new_zeros(dA.shape[0], dA.shape[1], dA.shape[3])
    ys = {}
    for t in steps:
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys[t] = torch.einsum("bdn,bn->bd", h, C[:, :, t])
    return torch.stack([ys[t] for t in sorted(ys)], dim=-1)


def shared_both_ways(u, dt, bias, A_log, B, C, D):
    """One dA, Δ·B·u and C, scanned forward by one loop and backward by the next (a bidirectional
    mixer whose two directions share their parameters)."""
    delta = F.softplus(dt + bias[:, None])
    dA, dBu = disc(u, delta, -torch.exp(A_log), B)
    L = u.shape[-1]
    fwd = run(dA, dBu, C, range(L))
    bwd = run(dA, dBu, C, reversed(range(L)))
    return fwd + bwd + u * D[:, None]


def recomputed_both_ways(u, dt, bias, A_log, B, C, D):
    """Each direction discretises again; u, Δ, B and C are shared, and C read both ways."""
    delta = F.softplus(dt + bias[:, None])
    L = u.shape[-1]
    outs = []
    for steps in (range(L), range(L - 1, -1, -1)):
        dA, dBu = disc(u, delta, -torch.exp(A_log), B)
        outs.append(run(dA, dBu, C, steps) + u * D[:, None])
    return outs[0] + outs[1]


def backward_then_forward(u, dt, bias, A_log, B, C, D):
    """The reverse loop first: its last read of C (step 0) is followed by the forward loop's."""
    delta = F.softplus(dt + bias[:, None])
    dA, dBu = disc(u, delta, -torch.exp(A_log), B)
    L = u.shape[-1]
    return run(dA, dBu, C, reversed(range(L))) * 2 + run(dA, dBu, C, range(L))


def reverse_suffix(k):
    """A reverse loop over steps L-1 down to k + 1 (``range(L - 1, k, -1)``), from a zero state."""
    def fn(u, dt, bias, A_log, B, C, D):
        delta = F.softplus(dt + bias[:, None])
        dA, dBu = disc(u, delta, -torch.exp(A_log), B)
        return run(dA, dBu, C, range(u.shape[-1] - 1, k, -1))
    return fn


def inputs(b=2, d=5, L=8, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [t.requires_grad_() for t in (
        torch.randn(b, d, L, generator=g), torch.randn(b, d, L, generator=g), torch.randn(d, generator=g) * 0.5,
        torch.log(torch.rand(d, n, generator=g) + 0.5), torch.randn(b, n, L, generator=g),
        torch.randn(b, n, L, generator=g), torch.randn(d, generator=g))]


def values_and_grads_match(fn, args):
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(*args)
    ref = fn(*args)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(ref)
    used = [a for a in args if a.requires_grad]
    got = torch.autograd.grad(out, used, grad, allow_unused=True)
    want = torch.autograd.grad(ref, used, grad, allow_unused=True)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fn", [shared_both_ways, recomputed_both_ways, backward_then_forward],
                         ids=["shared-dA", "recomputed-dA", "backward-first"])
def test_both_directions_over_shared_tensors_are_rewritten(fn):
    args = inputs()
    report = ssm_compile.explain(fn, *args)
    counts = [r.family for r in report.rewrites]
    assert counts.count("scan_loop") == 2, report.format(graphs=False)
    assert not [m for m in report.misses if m.family == "scan_loop"], report.format(graphs=False)
    values_and_grads_match(fn, args)


@pytest.mark.parametrize("k", [0, 2, -1], ids=["to-step-1", "to-step-3", "whole"])
def test_a_reverse_loop_that_stops_before_step_0_is_rewritten(k):
    fn = reverse_suffix(k)
    args = inputs()
    report = ssm_compile.explain(fn, *args)
    assert [r.family for r in report.rewrites].count("scan_loop") == 1, report.format(graphs=False)
    values_and_grads_match(fn, args)


def test_a_reverse_loop_over_the_first_steps_keeps_its_reason():
    """``range(k, -1, -1)`` with k < L-1: the flip's late steps, which no rewrite covers."""
    def fn(u, dt, bias, A_log, B, C, D):
        dA, dBu = disc(u, F.softplus(dt + bias[:, None]), -torch.exp(A_log), B)
        return run(dA, dBu, C, range(u.shape[-1] - 3, -1, -1))
    args = inputs()
    report = ssm_compile.explain(fn, *args)
    assert not report.rewrites, report.format(graphs=False)
    assert any("walks time backwards" in m.reason for m in report.misses), report.format(graphs=False)
    torch.testing.assert_close(report.output, fn(*args))


def test_one_loop_walking_both_ways_keeps_its_slices():
    """One loop body steps a forward state at t and a backward one at L-1-t over the same dA: the
    reads of dA alternate in order, so nothing is flipped, and the forward state is rewritten."""
    def fn(u, dt, bias, A_log, B, C, D):
        dA, dBu = disc(u, F.softplus(dt + bias[:, None]), -torch.exp(A_log), B)
        L = u.shape[-1]
        h = g = dA.new_zeros(dA.shape[0], dA.shape[1], dA.shape[3])
        ys, zs = [], []
        for t in range(L):
            h = dA[:, :, t] * h + dBu[:, :, t]
            g = dA[:, :, L - 1 - t] * g + dBu[:, :, L - 1 - t]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
            zs.append(torch.einsum("bdn,bn->bd", g, C[:, :, L - 1 - t]))
        return torch.stack(ys, -1) + torch.stack(zs[::-1], -1)
    args = inputs()
    report = ssm_compile.explain(fn, *args)
    assert [r.family for r in report.rewrites].count("scan_loop") <= 1, report.format(graphs=False)
    torch.testing.assert_close(report.output, fn(*args))
    values_and_grads_match(fn, args)


def test_a_reverse_loop_under_dynamic_shapes_is_rewritten_at_every_length():
    """C only indexed keeps a symbolic length, known to be at least the loop's (probe CR)."""
    d, n = 5, 4

    def rev(u, dt, A, B, C, D, z):
        b, L = u.shape[0], u.shape[1]
        dA = torch.exp(torch.einsum("bld,dn->bldn", dt, A))
        dBu = torch.einsum("bld,bln,bld->bldn", dt, B, u)
        h = torch.zeros(b, d, n)
        ys = []
        for t in reversed(range(L)):
            h = dA[:, t] * h + dBu[:, t]
            ys.insert(0, torch.einsum("bdn,bn->bd", h, C[:, t]))
        return (torch.stack(ys, 1) + u * D) * F.silu(z)

    torch._dynamo.reset()
    records = []
    comp = torch.compile(rev, backend=SSMBackend(SSMOptions(inductor=False), on_graph=records.append), dynamic=True)
    for b, L in ((2, 7), (3, 9), (2, 5)):
        g = torch.Generator().manual_seed(L)
        args = [torch.randn(b, L, d, generator=g), F.softplus(torch.randn(b, L, d, generator=g)),
                -(torch.rand(d, n, generator=g) + 0.5), torch.randn(b, L, n, generator=g),
                torch.randn(b, L, n, generator=g), torch.randn(d, generator=g), torch.randn(b, L, d, generator=g)]
        seen = len(records)
        torch.testing.assert_close(comp(*args), rev(*args), rtol=1e-5, atol=1e-5)
        for record in records[seen:]:
            assert "scan_loop" in {r.family for r in record.rewrites}, [m.reason for m in record.misses]
    assert records
