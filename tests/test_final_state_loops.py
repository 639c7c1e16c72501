"""Scan loops whose only result is the last state (run 65).

A prefill that fills a cache, or a chunk's state, runs ``h = exp(Δ_t·A)·h + Δ_t·B_t·u_t`` over
every step and reads no output at all; the state at the end is what the program uses. Such a loop
is the op's scan with its last state: the pass gives it a zero C (the op's y, which nobody reads,
is then cheap and finite) and hands the last state on. Before, the loop was left alone ("no
per-step readout"), unrolled into L steps. Values and gradients are checked against eager in
fp64; near-misses keep their reasons.
"""
import pytest
import torch
from torch._dynamo.utils import counters
from utils import TOL, check_explained_against_fp64, rel_err

from ssm_compile.report import explain

BATCH, DIM, N, L = 2, 5, 3, 7


def make_inputs(length=L, seed=0, dim=DIM):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(BATCH, dim, length, generator=g)
    delta = torch.rand(BATCH, dim, length, generator=g) + 0.1
    A = -torch.rand(dim, N, generator=g) - 0.2
    B = torch.randn(BATCH, N, length, generator=g)
    return [x.requires_grad_() for x in (u, delta, A, B)]


def step(h, u, delta, A, B, t):
    return torch.exp(delta[:, :, t, None] * A) * h + (delta[:, :, t, None] * B[:, None, :, t]) * u[:, :, t, None]


def last_state(u, delta, A, B):
    """The state after every step, from zeros, discretised inside the step."""
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    for t in range(u.shape[2]):
        h = step(h, u, delta, A, B, t)
    return h


def precomputed(u, delta, A, B):
    """exp(Δ·A) and Δ·B·u computed for all steps first (mamba-minimal's einsums), then the loop."""
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
    return h


def from_state(u, delta, A, B, h0):
    """A chunk carried on from a given state, the state used twice after the loop."""
    h = h0
    for t in range(u.shape[2]):
        h = step(h, u, delta, A, B, t)
    return h * 2, h.sum(-1)


def last_token_readout(u, delta, A, B, C):
    """Only the last token's output: C_{L-1}·h_{L-1}, read once after the loop."""
    h = last_state(u, delta, A, B)
    return torch.einsum("bdn,bn->bd", h, C[:, :, -1])


def grouped_B(u, delta, A, B):
    """B in two groups over the channels (Mamba-2-style prefill), no C in the program: the op's
    zero C takes B's groups (probe CW: a time-invariant zero C made the op refuse them)."""
    Bg = torch.stack([B, B * 0.5], 1).repeat_interleave(u.shape[1] // 2, 1)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    for t in range(u.shape[2]):
        h = torch.exp(delta[:, :, t, None] * A) * h + delta[:, :, t, None] * Bg[:, :, :, t] * u[:, :, t, None]
    return h


def _c():
    return torch.randn(BATCH, N, L, generator=torch.Generator().manual_seed(3)).requires_grad_()


def _h0():
    return torch.randn(BATCH, DIM, N, generator=torch.Generator().manual_seed(4)).requires_grad_()


CASES = [
    pytest.param(last_state, lambda: make_inputs(), id="in-step-discretisation"),
    pytest.param(precomputed, lambda: make_inputs(), id="precomputed-einsums"),
    pytest.param(from_state, lambda: make_inputs() + [_h0()], id="initial-state"),
    pytest.param(last_token_readout, lambda: make_inputs() + [_c()], id="last-token-readout"),
    pytest.param(grouped_B, lambda: make_inputs(dim=4), id="grouped-B"),
]


@pytest.mark.parametrize("fn, inputs", CASES)
def test_last_state_loop_is_rewritten(fn, inputs):
    args = inputs()
    report = explain(fn, *args)
    assert report.counts["scan_loop"] == 1 and report.counts["discretization"] == 1, report.format(graphs=False)
    # No readout of the op is used: none is recorded.
    assert report.counts["readout"] == 0, report.format(graphs=False)
    check_explained_against_fp64(report, fn, args)


def test_last_state_loop_without_grad_and_at_new_lengths():
    compiled = torch.compile(last_state, backend="ssm", dynamic=True)
    for length in (6, 11):
        args = [a.detach() for a in make_inputs(length, seed=length)]
        with torch.no_grad():
            got = compiled(*args)
        want = last_state(*[a.double() for a in args])
        assert rel_err(got, want) <= TOL[torch.float32]
    assert counters["ssm"]["scan_loop"] >= 1, dict(counters["ssm"])


def mid_state_used(u, delta, A, B):
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    total = 0
    for t in range(u.shape[2]):
        h = step(h, u, delta, A, B, t)
        total = total + h.sum()
    return h, total


def detached_each_step(u, delta, A, B):
    """Truncated backpropagation through one step: not the scan's gradient."""
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    for t in range(u.shape[2]):
        h = step(h.detach(), u, delta, A, B, t)
    return h


def clamped_midway(u, delta, A, B):
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    for t in range(u.shape[2]):
        h = step(h, u, delta, A, B, t)
        if t == 2:
            h = h.clamp(-0.1, 0.1)
    return h


def first_steps_of_longer_inputs(u, delta, A, B):
    """Stops two steps early but B is read as a whole afterwards: not a loop over a prefix."""
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    for t in range(u.shape[2] - 2):
        h = step(h, u, delta, A, B, t)
    return h, B.sum()


@pytest.mark.parametrize("fn, reason", [
    # Every state's sum, summed over time: a per-step output that is no readout Σ_n h_t·C_t (run 66:
    # the reason named that output; it was "intermediate state h_0 is used outside the recurrence").
    pytest.param(mid_state_used, "the readout is not a contraction of h_t with C_t", id="mid-state-used"),
    pytest.param(detached_each_step, "(detach)", id="detached-each-step"),
    pytest.param(clamped_midway, "step 3 does not repeat step 0's state update", id="clamped-at-t=2"),
    pytest.param(first_steps_of_longer_inputs, "l_b_ is read there or as a whole", id="prefix-B-read-later"),
])
def test_near_miss_is_left_alone(fn, reason):
    args = make_inputs()
    report = explain(fn, *args)
    assert report.counts["scan_loop"] == 0, report.format(graphs=False)
    assert any(reason in m.reason for m in report.misses if m.family == "scan_loop"), report.format(graphs=False)
    got, want = report.output, fn(*args)
    for o, r in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(o, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU counterpart: the rewrite tests above)")
def test_last_state_loop_on_cuda_matches_fp64():
    args = [a.detach().cuda().requires_grad_() for a in make_inputs(length=40)] + [_h0().detach().cuda().requires_grad_()]
    compiled = torch.compile(from_state, backend="ssm")
    outs = compiled(*args)
    wide = [a.detach().cpu().double().requires_grad_() for a in args]
    refs = from_state(*wide)
    grads = [torch.randn_like(o) for o in outs]
    for o, r in zip(outs, refs):
        assert rel_err(o, r) <= 2 * TOL[torch.float32]
    got = torch.autograd.grad(outs, args, grads)
    want = torch.autograd.grad(refs, wide, [g.cpu().double() for g in grads])
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 2 * TOL[torch.float32]
