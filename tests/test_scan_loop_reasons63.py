"""Probe CR (run 63), scan_loop: three loops that explain gave false reasons for.

- A loop from t = 1 after ``h = dBu[:, 0]`` (step 0 written out before the loop) was left alone
  "where exp(Δ·A) at t = 0 is finite, which the graph does not show" even where Δ = softplus(...)
  and A = -exp(A_log) show it, as scan_assoc's first-state check reads them. It is now rewritten
  there (step 0 written into the graph as the loop's other steps, from a zero state), and where
  the signs are not shown the reason names the Δ and A it read.
- A reverse loop whose states are collected in time order (``hs.insert(0, h)``, or ``H[:, t] = h``)
  and read out after the loop was refused as "not every step's state, once, in time order" / "the
  wrong place of the states' buffer": the states of the flipped loop, flipped back. Now rewritten,
  C read flipped and y flipped back; the states' slot at time L-1 (the walk's first state, which
  the op does not return) keeps such a loop with a reason.
- A reverse loop that starts below the last time index (over the flipped tensors: a late start)
  was given the generic reverse-walk reason, or, where it also stops above index 0, no scan_loop
  reason at all; it now says where the walk starts and ends.

Each rewrite is checked against fp64 eager, values and gradients; each near-miss gives eager's
result bit for bit.
"""
import pytest
import torch
import torch.nn.functional as F
from utils import check_explained_against_fp64

from ssm_compile.report import explain

BATCH, L, DIM, N = 2, 7, 5, 4


def make_inputs(seed=0):
    """u, a raw dt (softplus(dt) is Δ), A_log, B, C in the (batch, L, ...) layout."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, L, DIM, generator=g), torch.randn(BATCH, L, DIM, generator=g),
            torch.randn(DIM, N, generator=g), torch.randn(BATCH, L, N, generator=g),
            torch.randn(BATCH, L, N, generator=g))


def _disc(dt, A, B, u):
    return torch.exp(torch.einsum("bld,dn->bldn", dt, A)), torch.einsum("bld,bln,bld->bldn", dt, B, u)


def _shown(u, dt_raw, A_log, B):
    """Δ = softplus(dt), A = -exp(A_log): the graph shows Δ·A <= 0."""
    return _disc(F.softplus(dt_raw), -torch.exp(A_log), B, u)


def _from_t1(dA, dBu, C):
    """Step 0's state written out as ``h = dBu[:, 0]`` before a loop from t = 1, einsum readouts
    stacked."""
    h = dBu[:, 0]
    ys = [torch.einsum("bdn,bn->bd", h, C[:, 0])]
    for t in range(1, L):
        h = dA[:, t] * h + dBu[:, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
    return torch.stack(ys, 1)


def peeled(u, dt_raw, A_log, B, C):
    dA, dBu = _shown(u, dt_raw, A_log, B)
    return _from_t1(dA, dBu, C)


def peeled_h_is_none(u, dt_raw, A_log, B, C):
    """The ``h is None`` idiom, the decay on the right, and the last state returned too."""
    dA, dBu = _shown(u, dt_raw, A_log, B)
    h, ys = None, []
    for t in range(L):
        h = dBu[:, t] if h is None else h * dA[:, t] + dBu[:, t]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1), h


def peeled_addcmul(u, dt_raw, A_log, B, C):
    dA, dBu = _shown(u, dt_raw, A_log, B)
    h = dBu[:, 0]
    out = u.new_empty(BATCH, L, DIM)
    out[:, 0] = torch.einsum("bdn,bn->bd", h, C[:, 0])
    for t in range(1, L):
        h = torch.addcmul(dBu[:, t], dA[:, t], h)
        out[:, t] = torch.einsum("bdn,bn->bd", h, C[:, t])
    return out


def _check_rewritten(fn, args, family="scan_loop"):
    args = [a.clone().requires_grad_() for a in args]
    report = explain(fn, *args)
    assert report.counts.get(family) == 1, report.format(graphs=False)
    check_explained_against_fp64(report, fn, args)
    return report


def _check_left_alone(fn, args, reason):
    report = explain(fn, *args)
    assert "scan_loop" not in report.counts, report.format(graphs=False)
    assert any(reason in m.reason for m in report.misses if m.family == "scan_loop"), report.format(graphs=False)
    out, ref = report.output, fn(*args)
    for o, r in zip(out if isinstance(out, tuple) else [out], ref if isinstance(ref, tuple) else [ref], strict=True):
        assert torch.equal(o, r)
    return report


@pytest.mark.parametrize("fn", [peeled, peeled_h_is_none, peeled_addcmul])
def test_loop_from_t1_after_first_state_is_rewritten_where_signs_show_a_finite_decay(fn):
    report = _check_rewritten(fn, make_inputs())
    (rewrite,) = [r for r in report.rewrites if r.family == "scan_loop"]
    assert "first_state" in rewrite.decision


def test_loop_from_t1_keeps_a_reason_naming_delta_and_A_where_signs_are_not_shown():
    """Δ and A passed in: the graph does not show Δ·A <= 0, and a Δ·A > 0 makes exp(Δ·A) at t = 0
    infinite, where a scan from a zero state is NaN and the user's loop is not."""
    def fn(u, delta, A, B, C):
        dA, dBu = _disc(delta, A, B, u)
        return _from_t1(dA, dBu, C)

    u, dt_raw, A_log, B, C = make_inputs()
    delta, A = F.softplus(dt_raw), -torch.exp(A_log)
    delta[:, 0] = -200.0  # Δ·A at t = 0 overflows exp: the op from h = 0 would give NaN
    report = _check_left_alone(fn, (u, delta, A, B, C), "first state is itself a time slice")
    (miss,) = [m for m in report.misses if m.family == "scan_loop"]
    assert "do not show" in miss.reason and "l_delta_" in miss.reason and "l_a_" in miss.reason, miss.reason
    assert torch.isfinite(report.output).all()


def test_loop_from_t1_with_delta_shown_but_A_not_keeps_the_reason():
    def fn(u, dt_raw, A, B, C):
        dA, dBu = _disc(F.softplus(dt_raw), A, B, u)
        return _from_t1(dA, dBu, C)

    u, dt_raw, A_log, B, C = make_inputs()
    _check_left_alone(fn, (u, dt_raw, -torch.exp(A_log), B, C),
                      "which the ops that make Δ (softplus) and A (l_a_) do not show")


def _rev(u, dt_raw, A_log, B):
    dA, dBu = _shown(u, dt_raw, A_log, B)
    return dA, dBu, u.new_zeros(BATCH, DIM, N)


def _states_inserted(u, dt_raw, A_log, B):
    """A reverse walk's states put in time order by ``hs.insert(0, h)``, stacked."""
    dA, dBu, h = _rev(u, dt_raw, A_log, B)
    hs = []
    for t in reversed(range(L)):
        h = dA[:, t] * h + dBu[:, t]
        hs.insert(0, h)
    return torch.stack(hs, 1)


def rev_states_inserted(u, dt_raw, A_log, B, C):
    return torch.einsum("bldn,bln->bld", _states_inserted(u, dt_raw, A_log, B), C)


def rev_states_buffer(u, dt_raw, A_log, B, C):
    dA, dBu, h = _rev(u, dt_raw, A_log, B)
    H = u.new_empty(BATCH, L, DIM, N)
    for t in range(L - 1, -1, -1):
        h = dA[:, t] * h + dBu[:, t]
        H[:, t] = h
    return torch.einsum("bldn,bln->bld", H, C)


def rev_states_matmul_last(u, dt_raw, A_log, B, C):
    """The states stacked last step first by ``ys[::-1]``, read out by a matmul, and the state
    at time 0 (the walk's last) returned."""
    dA, dBu, h = _rev(u, dt_raw, A_log, B)
    hs = []
    for t in reversed(range(L)):
        h = dA[:, t] * h + dBu[:, t]
        hs.append(h)
    states = torch.stack(hs[::-1], dim=1)
    return (states @ C.unsqueeze(-1)).squeeze(-1), h


@pytest.mark.parametrize("fn", [rev_states_inserted, rev_states_buffer, rev_states_matmul_last])
def test_reverse_loop_states_collected_in_time_order_are_rewritten(fn):
    _check_rewritten(fn, make_inputs(1))


def test_reverse_loop_states_slot_at_L_minus_1_is_left_alone():
    """``hs[:, -1]`` of states collected in time order is the state at time L-1: the reverse walk's
    first, which the op does not return."""
    def fn(u, dt_raw, A_log, B, C):
        states = _states_inserted(u, dt_raw, A_log, B)
        return torch.einsum("bldn,bln->bld", states, C), states[:, -1]

    _check_left_alone(fn, make_inputs(2), "the walk's first state")


def _reverse_range(start, stop, fixed_C=False):
    def fn(u, dt_raw, A_log, B, C):
        dA, dBu, h = _rev(u, dt_raw, A_log, B)
        ys = []
        for t in range(start, stop, -1):
            h = dA[:, t] * h + dBu[:, t]
            # C[:, 0] at every step: a slice read in no walk's order, among the loop's reads.
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, 0] if fixed_C else C[:, t]))
        return torch.stack(ys, 1)
    return fn


@pytest.mark.parametrize("start, stop, reason", [
    (L - 2, -1, f"walks time backwards from time index {L - 2}, not from the last one ({L - 1}), down to 0"),
    (L - 3, 1, f"walks time backwards from time index {L - 3}, not from the last one ({L - 1}), down to 2"),
    (3, 0, f"walks time backwards from time index 3, not from the last one ({L - 1}), down to 1"),
], ids=["from-L-2-to-0", "from-L-3-to-2", "from-3-to-1"])
def test_reverse_loop_that_starts_late_gets_its_reason(start, stop, reason):
    """A reverse walk from below the last index is, over the flipped tensors, a loop that starts
    late; one that also stops above 0 had no scan_loop reason at all."""
    _check_left_alone(_reverse_range(start, stop), make_inputs(3), reason)


def test_reverse_loop_over_the_last_steps_that_keeps_its_slices_gets_its_reason():
    """From L-1 down to 2, with a slice read in no walk's order among the loop's reads: its slices
    are not read flipped (``unreverse_loops``), and there is no step at t = 0 for an anchor."""
    _check_left_alone(_reverse_range(L - 1, 1, fixed_C=True), make_inputs(4),
                      "walks time backwards from the last time index down to 2")
