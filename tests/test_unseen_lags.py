"""Probe BY (run 58): loops whose decay and input term read different steps, and other reasons.

Recorded behaviour before this round (every value was right; these are explain's words):
- A decay one step ahead of the input term (``dA[:, :, t + 1] * h + dBu[:, :, t]``, or
  ``exp(Δ[min(t + 1, L - 1)]·A)`` computed in the step) was called "a linear recurrence that starts
  at time index 1, not 0 (a state reset or a late start)": there is neither.
- An input term one step behind (``u[max(t - 1, 0)]``, ``dBu[max(t - 1, 0)]``) got "step 1 does
  not repeat step 0's state update (no copy of h_1)" and the same reset reason.
- ``h = dA[t] * (h + dBu[t])`` was named a lag only; a second-order ``hp, h = h, dA*hp + dBu`` a
  loop stepping by 2 only; a readout of the state before its update a lagged C only.
- A log-space scan masked with ``masked_fill(-inf)`` before its exp got no reason at all.
- A loop over the first L-1 steps had its scan rewritten, but the skip ``u[..., :L-1] * D``
  was refused ("the skip multiplies getitem_22", a node the user never wrote), and the gate
  after it too.
- A one-token prefill written as the whole-sequence in-place loop got the decode reason "made
  for a whole sequence".
"""
import pytest
import torch
import torch.nn.functional as F

from test_unseen_scan5 import B_, D_, L_, N_, assert_matches_eager, inputs
from test_unseen_scan6 import _disc

from ssm_compile.report import explain

LAG = "the input term and the decay read different steps (one lags the other)"


def _reasons(report, family="scan_loop"):
    return [m.reason for m in report.misses if m.family == family]


def _loop(update):
    def fn(u, delta, A, B, C):
        dA, dBu = _disc(u, delta, A, B)
        h = u.new_zeros(B_, D_, N_)
        ys = []
        for t in range(L_):
            h = update(t, dA, dBu, h, u, delta, A, B)
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
        return torch.stack(ys, -1)
    return fn


def _step_input(t, delta, u, B):
    return delta[:, :, t, None] * u[:, :, t, None] * B[:, None, :, t]


LAGS = [
    pytest.param(lambda t, dA, dBu, h, *_: dA[:, :, min(t + 1, L_ - 1)] * h + dBu[:, :, t],
                 "reads time index 0 in the step whose decay reads time index 1", id="decay-ahead"),
    pytest.param(lambda t, dA, dBu, h, u, delta, A, B:
                 torch.exp(delta[:, :, min(t + 1, L_ - 1), None] * A) * h + dBu[:, :, t],
                 "reads time index 0 in the step whose decay reads time index 1", id="decay-ahead-in-step"),
    pytest.param(lambda t, dA, dBu, h, *_: dA[:, :, t] * h + dBu[:, :, max(t - 1, 0)],
                 "reads time index 0 in the step whose decay reads time index 1", id="input-behind"),
    pytest.param(lambda t, dA, dBu, h, u, delta, A, B:
                 dA[:, :, t] * h + delta[:, :, t, None] * u[:, :, max(t - 1, 0), None] * B[:, None, :, t],
                 "reads time index 0 in the step whose decay reads time index 1", id="u-behind-in-step"),
]


@pytest.mark.parametrize("update, where", LAGS)
def test_a_lag_is_named_as_one_and_no_reset_is_claimed(update, where):
    fn = _loop(update)
    args = inputs()
    report = explain(fn, *args)
    reasons = _reasons(report)
    assert len(reasons) == 1, reasons
    assert LAG in reasons[0] and where in reasons[0], reasons
    assert report.counts["scan_loop"] == 0
    assert_matches_eager(report.output, fn, args)


def test_the_loop_over_steps_after_the_first_with_a_lead_is_a_lag():
    def fn(u, delta, A, B, C):
        dA, dBu = _disc(u, delta, A, B)
        h = u.new_zeros(B_, D_, N_)
        ys = []
        for t in range(L_ - 1):
            h = dA[:, :, t + 1] * h + dBu[:, :, t]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
        return torch.stack(ys, -1)

    reasons = _reasons(explain(fn, *inputs()))
    assert len(reasons) == 1 and LAG in reasons[0] and "state reset" not in reasons[0], reasons


@pytest.mark.parametrize("update, hint", [
    pytest.param(lambda t, dA, dBu, h, *_: dA[:, :, t] * (h + dBu[:, :, t]),
                 "h = A_full[t] * (h + B_full[t])", id="input-inside-decay"),
    pytest.param(lambda t, dA, dBu, h, u, delta, A, B: torch.exp(delta[:, :, t, None] * A) * (h + _step_input(t, delta, u, B)),
                 "h = exp(Δ[t]·A) * (h + Δ[t]·B[t]·u[t])", id="input-inside-decay-in-step"),
])
def test_an_input_added_inside_the_decay_is_named(update, hint):
    reasons = _reasons(explain(_loop(update), *inputs()))
    assert len(reasons) == 1 and hint in reasons[0], reasons


def test_a_second_order_recurrence_is_named():
    def fn(u, delta, A, B, C):
        dA, dBu = _disc(u, delta, A, B)
        h = hp = u.new_zeros(B_, D_, N_)
        ys = []
        for t in range(L_):
            hp, h = h, dA[:, :, t] * hp + dBu[:, :, t]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
        return torch.stack(ys, -1)

    reasons = _reasons(explain(fn, *inputs()))
    assert reasons and all("reads the state from 2 steps back" in r for r in reasons), reasons


def test_a_readout_before_the_update_is_named():
    def fn(u, delta, A, B, C):
        dA, dBu = _disc(u, delta, A, B)
        h = u.new_zeros(B_, D_, N_)
        ys = []
        for t in range(L_):
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
            h = dA[:, :, t] * h + dBu[:, :, t]
        return torch.stack(ys, -1), h

    args = inputs()
    reasons = _reasons(explain(fn, *args))
    assert any("a readout of the state before its update" in r for r in reasons), reasons
    assert not any("state reset" in r for r in reasons), reasons


def test_a_packed_sequences_c_index_names_the_slice_that_would_be_read():
    # vLLM's per-sequence fallback over a packed batch: B sliced per sequence, C read by the
    # packed index.
    starts = (0, 5, 8)

    def fn(u, delta, A, B, C):
        outs = []
        for s, e in zip(starts, starts[1:]):
            dA, dBu = _disc(u[:, :, s:e], delta[:, :, s:e], A, B[:, :, s:e])
            h = u.new_zeros(B_, D_, N_)
            ys = []
            for t in range(e - s):
                h = dA[:, :, t] * h + dBu[:, :, t]
                ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, s + t]))
            outs.append(torch.stack(ys, -1))
        return torch.cat(outs, -1)

    args = inputs()
    report = explain(fn, *args)
    reasons = _reasons(report)
    assert any("a packed sequence's C[..., start+t]" in r and "C[..., start:end]" in r for r in reasons), reasons
    assert_matches_eager(report.output, fn, args)


def test_a_masked_log_space_scan_is_named_as_a_closed_form():
    def fn(u, delta, A, B, C):
        logA = delta[..., None] * A[:, None, :]
        dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
        cs = torch.cumsum(logA, dim=2)
        diff = cs[:, :, :, None, :] - cs[:, :, None, :, :]
        mask = torch.tril(torch.ones(L_, L_, dtype=torch.bool))[:, :, None]
        w = torch.exp(diff.masked_fill(~mask, float("-inf")))
        hs = (w * dBu[:, :, None]).sum(3)
        return torch.einsum("bdln,bnl->bdl", hs, C)

    reasons = _reasons(explain(fn, *inputs()))
    assert any(r.startswith("a closed-form scan") for r in reasons), reasons


def _first_steps(u, delta, A, B, C):
    """y of the scan over the first L-1 steps."""
    dA, dBu = _disc(u, delta, A, B)
    h = u.new_zeros(B_, D_, N_)
    ys = []
    for t in range(L_ - 1):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, -1)


def test_a_loop_over_the_first_steps_folds_its_sliced_skip_and_gate():
    def fn(u, delta, A, B, C, D, z):
        y = _first_steps(u, delta, A, B, C) + u[..., :L_ - 1] * D[:, None]
        return y * F.silu(z[..., :L_ - 1])

    g = torch.Generator().manual_seed(3)
    args = [*inputs(), torch.randn(D_, generator=g, dtype=torch.float64).requires_grad_(),
            torch.randn(B_, D_, L_, generator=g, dtype=torch.float64).requires_grad_()]
    report = explain(fn, *args)
    assert {r.family for r in report.rewrites} >= {"scan_loop", "skip", "gate"}, str(report)
    assert not report.misses, [m.reason for m in report.misses]
    assert report.counts["skip"] == 1 and report.counts["gate"] == 1, dict(report.counts)
    assert_matches_eager(report.output, fn, args)


def test_a_skip_on_another_prefix_is_not_folded():
    # u[..., 1:L] is not the scan's u[..., :L-1]: the same shape, other values.
    def fn(u, delta, A, B, C, D):
        return _first_steps(u, delta, A, B, C) + u[..., 1:] * D[:, None]

    args = [*inputs(), torch.randn(D_, generator=torch.Generator().manual_seed(3), dtype=torch.float64).requires_grad_()]
    report = explain(fn, *args)
    assert "not the scan's u" in " ".join(_reasons(report, "skip"))
    assert report.counts["skip"] == 0
    assert_matches_eager(report.output, fn, args)


def test_a_one_token_prefill_loop_is_not_called_a_whole_sequence():
    def fn(u, delta, A, B, C, h):
        dA, dBu = _disc(u, delta, A, B)
        ys = []
        for t in range(u.shape[2]):
            h.mul_(dA[:, :, t]).add_(dBu[:, :, t])
            ys.append((h * C[:, None, :, t]).sum(-1))
        return torch.stack(ys, -1)

    g = torch.Generator().manual_seed(0)
    args = [x.detach()[..., :1] for x in inputs()]
    args[2] = inputs()[2].detach()
    h = torch.randn(B_, D_, N_, generator=g, dtype=torch.float64)
    reasons = _reasons(explain(fn, *args, h.clone()), "state_update")
    assert len(reasons) == 1 and "a sequence of one step computed whole and then sliced" in reasons[0], reasons
    assert "made for a whole sequence" not in reasons[0]
    want_h, got_h = h.clone(), h.clone()
    want = fn(*args, want_h)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ssm")(*args, got_h)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_h, want_h)


def test_a_nonstandard_update_names_the_users_values():
    # The proof's symbols were printed as they were ("h*(leaf0) + (-leaf1)").
    reasons = _reasons(explain(_loop(lambda t, dA, dBu, h, *_: dA[:, :, t] * h - dBu[:, :, t]), *inputs()))
    assert any("h*(dA[t=0]) + (-dBu[t=0])" in r for r in reasons), reasons


@pytest.mark.parametrize("form", ["loop", "assoc"])
def test_fp32_inputs_rounded_at_the_top_of_a_bf16_block_are_not_read_unrounded(form):
    # The op was handed the fp32 u, B and C the program rounds to bf16 first (Δ being bf16 made
    # the rounding look no finer than the inputs): 5e-2 off eager on outputs of ~12 (probe BY).
    def fn(u, delta, A, B, C):
        u, delta, B, C = (t.bfloat16() for t in (u, delta, B, C))
        dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A.to(delta.dtype)))
        dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
        if form == "assoc":
            from torch._higher_order_ops.associative_scan import associative_scan

            hs = associative_scan(lambda x, y: (x[0] * y[0], y[0] * x[1] + y[1]), (dA, dBu), dim=2,
                                  combine_mode="generic")[1]
            return torch.einsum("bdln,bnl->bdl", hs, C).float()
        h = torch.zeros(B_, D_, N_, dtype=u.dtype)
        ys = []
        for t in range(L_):
            h = dA[:, :, t] * h + dBu[:, :, t]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
        return torch.stack(ys, -1).float()

    args = [x.detach().float() for x in inputs()]
    report = explain(fn, *args)
    family = "scan_loop" if form == "loop" else "scan_assoc"
    assert family not in report.counts, str(report)
    assert any("which the program then computes with the rounded value" in r for r in _reasons(report, family)), \
        _reasons(report, family)
    # Nothing rewritten: the graph run eagerly is eager's to the bit (inductor's bf16 arithmetic
    # in fp32 registers would not be).
    assert torch.equal(report.output, fn(*args))
