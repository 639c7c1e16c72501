"""Scan loops whose per-step readouts are proved but not stored once each in one stack, cat or
buffer (run 65, probe CV).

``y_t = Σ_n h_t·C_t`` is the op's y at step t whatever the program then does with it: a cat grown
step by step, ``select_scatter``/``index_copy_`` into a tensor, a sum over time, a list with one
entry repeated or shifted, a cat of several loops' outputs, a buffer whose first slot the loop never
writes. Each y_t is replaced by the op's y at t, and the program's own code that collects them
stays. Before, such loops were left alone with reasons that were false for most of them ("not
collected exactly once, in time order", "intermediate state h_0 is used outside the recurrence").
Each case is checked against eager in fp64, values and gradients.
"""
import pytest
import torch
from test_pass_scan_loop import make_inputs as scan_loop_inputs, stacked_twice
from test_reasons_cs63 import outputs_into_buffer
from test_unseen import output_also_accumulated
from test_unseen_scan4 import chained_loops_apart, loop_with
from utils import check_compiled_against_fp64, check_explained_against_fp64

from ssm_compile.report import explain

def make_inputs(layout="bdl"):
    """u, Δ, A, B, C as test_pass_scan_loop makes them, each requiring grad."""
    return [x.requires_grad_() for x in scan_loop_inputs(layout=layout)]


def disc(u, delta, A, B):
    return torch.exp(torch.einsum("bdl,dn->bdln", delta, A)), torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)


def readouts(u, delta, A, B, C):
    """The states' readouts y_t, one (batch, dim) tensor per step, as a generator."""
    dA, dBu = disc(u, delta, A, B)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        yield torch.einsum("bdn,bn->bd", h, C[:, :, t])


def cat_grown_from_empty(u, delta, A, B, C):
    out = u.new_zeros(u.shape[0], u.shape[1], 0)
    for y in readouts(u, delta, A, B, C):
        out = torch.cat([out, y[..., None]], -1)
    return out


def cat_grown_from_none(u, delta, A, B, C):
    out = None
    for y in readouts(u, delta, A, B, C):
        out = y[..., None] if out is None else torch.cat([out, y[..., None]], -1)
    return out


def summed_over_time(u, delta, A, B, C):
    total = 0
    for y in readouts(u, delta, A, B, C):
        total = total + y
    return total


def select_scattered(u, delta, A, B, C):
    out = torch.zeros_like(u)
    for t, y in enumerate(readouts(u, delta, A, B, C)):
        out = out.select_scatter(y, 2, t)
    return out


def index_copied(u, delta, A, B, C):
    out = torch.zeros_like(u)
    for t, y in enumerate(readouts(u, delta, A, B, C)):
        out = out.index_copy(2, torch.tensor([t]), y[..., None])
    return out


def chunks_discretised_apart(u, delta, A, B, C, size=3):
    """Each chunk of time discretised on its own, the state carried across, the chunks' stacks
    joined by cat (a cat of several recurrences' outputs)."""
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    parts = []
    for c0 in range(0, u.shape[2], size):
        sl = slice(c0, c0 + size)
        dA, dBu = disc(u[:, :, sl], delta[:, :, sl], A, B[:, :, sl])
        Cc = C[:, :, sl]
        ys = []
        for t in range(dA.shape[2]):
            h = dA[:, :, t] * h + dBu[:, :, t]
            ys.append(torch.einsum("bdn,bn->bd", h, Cc[:, :, t]))
        parts.append(torch.stack(ys, -1))
    return torch.cat(parts, -1)


def time_last(view):
    """exp(Δ·A) and Δ·B·u moved to (batch, dim, N, L) by ``view``, stepped as ``x[..., t]``."""
    def fn(u, delta, A, B, C):
        dA, dBu = (view(x) for x in disc(u, delta, A, B))
        h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
        ys = []
        for t in range(u.shape[2]):
            h = dA[..., t] * h + dBu[..., t]
            ys.append(torch.einsum("bdn,bn->bd", h, C[..., t]))
        return torch.stack(ys, -1)
    return fn


CASES = [
    # Not a readout case: the other spellings of a permutation of Δ·B·u ("B_full is not a product
    # Δ·B·u (found 1 factors)" before; permute and transpose were seen through).
    pytest.param(time_last(lambda x: x.movedim(2, -1)), "bdl", 1, id="movedim(2,-1)"),
    pytest.param(time_last(lambda x: x.swapdims(2, 3)), "bdl", 1, id="swapdims(2,3)"),
    pytest.param(time_last(lambda x: x.mT), "bdl", 1, id="mT"),
    pytest.param(time_last(lambda x: x.movedim((2, 3), (3, 2))), "bdl", 1, id="movedim((2,3),(3,2))"),
    pytest.param(cat_grown_from_empty, "bdl", 1, id="cat-grown-from-empty"),
    pytest.param(cat_grown_from_none, "bdl", 1, id="cat-grown-from-None"),
    pytest.param(summed_over_time, "bdl", 1, id="summed-over-time"),
    pytest.param(select_scattered, "bdl", 1, id="select_scatter"),
    pytest.param(index_copied, "bdl", 1, id="index_copy"),
    pytest.param(chunks_discretised_apart, "bdl", 3, id="chunks-discretised-apart"),
    # Moved from the near-miss lists, where their reasons were false; each is the scan's y at
    # every step it keeps:
    pytest.param(stacked_twice, "bdl", 1, id="stacked-with-ys[3]=ys[2]"),
    pytest.param(output_also_accumulated, "bdl", 1, id="y-also-accumulated"),
    pytest.param(loop_with(readout="lagged"), "bld", 1, id="y-lagged-one-step"),
    pytest.param(chained_loops_apart, "bld", 1, id="chained-loops-returned-apart"),
]


@pytest.mark.parametrize("fn, layout, scans", CASES)
def test_rewritten_with_values_and_gradients(fn, layout, scans):
    args = make_inputs(layout)
    report = explain(fn, *args)
    assert report.counts["scan_loop"] == scans and report.counts["readout"] == scans, report.format(graphs=False)
    assert not [m for m in report.misses if m.family == "scan_loop"], report.format(graphs=False)
    check_explained_against_fp64(report, fn, args)


def test_buffer_slot_the_reverse_loop_never_writes_keeps_its_value():
    """``for t in range(L - 1, 0, -1): Y[:, :, t] = y_t``: slot 0 keeps the buffer's zeros; the
    other slots are the op's y (run 65: was left alone with the unwritten slot named)."""
    from test_reasons_cs63 import L as length, make_inputs as cs63_inputs

    u, delta, A, B, C, D = cs63_inputs()
    args = [x.requires_grad_() for x in (u, delta, A, B, C)]
    report = explain(outputs_into_buffer, *args, D)
    assert report.counts["scan_loop"] == 1, report.format(graphs=False)
    assert torch.equal(report.output[:, :, 0], torch.zeros_like(u[:, :, 0]))
    assert length == u.shape[2]
    check_compiled_against_fp64(lambda *a: outputs_into_buffer(*a, D), args)


def lagged_C_summed(u, delta, A, B, C):
    """y_t = h_t·C_{t+1}, summed over time: not the op's y at any step."""
    dA, dBu = disc(u, delta, A, B)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    total = 0
    for t in range(u.shape[2] - 1):
        h = dA[:, :, t] * h + dBu[:, :, t]
        total = total + torch.einsum("bdn,bn->bd", h, C[:, :, t + 1])
    return total


def test_lagged_readout_summed_is_left_alone_and_named():
    # (Probe CW: the reason was "intermediate state h_0 is used outside the recurrence".)
    args = make_inputs()
    report = explain(lagged_C_summed, *args)
    assert report.counts["scan_loop"] == 0, report.format(graphs=False)
    assert any("C at time t+1 (lagged readout)" in m.reason for m in report.misses if m.family == "scan_loop"), \
        report.format(graphs=False)
    assert torch.equal(report.output, lagged_C_summed(*args))
