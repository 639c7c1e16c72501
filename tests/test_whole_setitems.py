"""``t[:] = v`` and ``t[...] = v`` read as ``t.copy_(v)`` (run 65, probe CV), and two decode
reasons that named the wrong thing.

A decode step that shifts its conv window with ``conv_state[:] = torch.roll(conv_state, -1, -1)``
was left alone with no reason at all, where ``conv_state.copy_(torch.roll(...))`` is rewritten. A
whole-tensor setitem converts and broadcasts its value as ``copy_`` does (``Tensor.__setitem__``
makes that copy), so the pre-pass writes it as one; a partial index stays a setitem.
"""
import pytest
import torch
import torch.nn.functional as F

from ssm_compile.report import explain

BATCH, DIM, WIDTH = 2, 6, 4


def make_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, WIDTH, generator=g),
            torch.randn(DIM, WIDTH, generator=g), torch.randn(DIM, generator=g))


def run_step(step):
    """``step`` through explain and eagerly, each on its own copy of one conv state, without grad:
    (report, eager's output, the state explain's run left, the state eager's run left)."""
    x, state, w, b = make_inputs()
    mine, theirs = state.clone(), state.clone()
    with torch.no_grad():
        report = explain(step, x, mine, w, b)
        want = step(x, theirs, w, b)
    return report, want, mine, theirs


def step_with(shift_window):
    """mamba_simple's decode step of the conv, the window shifted by ``shift_window``."""
    def step(x, conv_state, w, b):
        shift_window(conv_state)
        conv_state[:, :, -1] = x
        return F.silu(torch.sum(conv_state * w, dim=-1) + b)
    return step


def _whole(conv_state):
    conv_state[:] = torch.roll(conv_state, shifts=-1, dims=-1)


def _ellipsis(conv_state):
    conv_state[...] = torch.roll(conv_state, shifts=-1, dims=-1)


def _colons(conv_state):
    conv_state[:, :, :] = torch.roll(conv_state, shifts=-1, dims=-1)


def _copy(conv_state):
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))


@pytest.mark.parametrize("shift_window", [_whole, _ellipsis, _colons, _copy], ids=["[:]", "[...]", "[:,:,:]", "copy_"])
def test_whole_setitem_window_shift_is_rewritten(shift_window):
    report, want, mine, theirs = run_step(step_with(shift_window))
    assert report.counts["conv_update"] == 1, report.format(graphs=False)
    assert torch.allclose(report.output, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(mine, theirs)


def test_partial_setitem_is_not_a_copy():
    """``t[1:] = v`` writes part of t: still a setitem, the step keeps its reason."""
    def step(x, conv_state, w, b):
        conv_state[1:] = torch.roll(conv_state[1:], shifts=-1, dims=-1)
        conv_state[:, :, -1] = x
        return F.silu(torch.sum(conv_state * w, dim=-1) + b)

    report, want, mine, theirs = run_step(step)
    assert report.counts["conv_update"] == 0, report.format(graphs=False)
    assert torch.equal(report.output, want) and torch.equal(mine, theirs)


def test_whole_setitem_broadcasts_and_converts_like_eager():
    """The value broadcast along an axis and rounded to the target's dtype, as setitem does."""
    def fn(t, v):
        t[:] = v
        return t * 2

    t = torch.randn(3, 4, dtype=torch.bfloat16)
    v = torch.randn(3, 1, dtype=torch.float64)
    mine, theirs = t.clone(), t.clone()
    report = explain(fn, mine, v)
    want = fn(theirs, v)
    assert torch.equal(report.output, want) and torch.equal(mine, theirs)


def test_symbolic_roll_shift_is_named_as_such():
    """A shift from a closure, a symbol under dynamic=True: the reason named the axis before."""
    shift = -1

    def step(x, conv_state, w, b):
        conv_state.copy_(torch.roll(conv_state, shifts=shift, dims=-1))
        conv_state[:, :, -1] = x
        return F.silu(torch.sum(conv_state * w, dim=-1) + b)

    from torch._dynamo.utils import counters
    from ssm_compile.compiler import SSMBackend
    from ssm_compile.config import SSMOptions
    from ssm_compile.report import Report

    records = []
    compiled = torch.compile(step, backend=SSMBackend(SSMOptions(inductor=False), on_graph=records.append),
                             dynamic=True)
    x, state, w, b = make_inputs()
    mine, theirs = state.clone(), state.clone()
    with torch.no_grad():
        got, want = compiled(x, mine, w, b), step(x, theirs, w, b)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6) and torch.equal(mine, theirs)
    report = Report(graphs=records, graph_breaks={})
    reasons = [m.reason for m in report.misses if m.family == "conv_update"]
    assert counters["ssm"]["conv_update"] == 0, dict(counters["ssm"])
    assert any("a value the graph does not fix" in r for r in reasons), report.format(graphs=False)
    assert not any("not along its last axis" in r for r in reasons), report.format(graphs=False)


def test_window_rolled_the_other_way_names_the_shift():
    """Newest input first: rolled by +1 and written at index 0 (the weights flipped)."""
    def step(x, conv_state, w, b):
        conv_state.copy_(torch.roll(conv_state, shifts=1, dims=-1))
        conv_state[:, :, 0] = x
        return F.silu(torch.sum(conv_state * w.flip(-1), dim=-1) + b)

    report, want, mine, theirs = run_step(step)
    assert report.counts["conv_update"] == 0, report.format(graphs=False)
    assert torch.equal(report.output, want) and torch.equal(mine, theirs)
    reasons = [m.reason for m in report.misses if m.family == "conv_update"]
    assert any("rolled with shifts=1, not -1" in r for r in reasons), report.format(graphs=False)
