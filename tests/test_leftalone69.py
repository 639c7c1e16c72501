"""Items run 69 found left alone without a reason or with a needless copy.

- A bare ``squeeze()`` after the scan's readout that drops a size-1 axis of y other than its
  leading ones (one channel: dim = 1; zeta's ``(hs @ C.unsqueeze(-1)).squeeze()``): the skip and
  the gate after it were not looked at, and the skip's miss had no reason. Broadcasting puts
  size-1 axes back in front only, so no skip or gate after such a squeeze holds y's values in
  y's shape: each is left as written, with a reason that says what was squeezed. A squeeze of
  the leading axes alone (batch 1) still folds.
- mamba.py's ``step`` over several tokens in one graph (``test_decode68``): each step after the
  first handed its op a copy of the state and of the conv window the step before returned, a
  fresh buffer nothing else writes. That copy is gone; one is kept where the program writes the
  previous state.

Values and gradients are compared with eager in fp64 on random inputs.
"""
import operator

import pytest
import torch
import torch.nn.functional as F
from test_decode68 import D_MODEL, DIM, W, MambaPyBlock, generate_steps
from utils import TOL, check_explained_against_fp64, rel_err

from ssm_compile.kernels.decode import op as decode_op
from ssm_compile.passes.decode import _read_in_place_of_copy
from ssm_compile.report import explain

L, N = 5, 3


def seq_scan(x, delta, A, B, C, D=None, z=None, squeeze_terms=False):
    """zeta's ``selective_scan_seq`` (x (batch, L, dim)) with an optional skip and gate;
    ``squeeze_terms``: they read x and z squeezed as y is, so their result stays squeezed."""
    deltaA = torch.exp(delta.unsqueeze(-1) * A)
    BX = delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
    h = torch.zeros(x.size(0), x.size(2), A.shape[1])
    hs = []
    for t in range(x.shape[1]):
        h = deltaA[:, t] * h + BX[:, t]
        hs.append(h)
    y = (torch.stack(hs, dim=1) @ C.unsqueeze(-1)).squeeze()
    if D is not None:
        y = y + D * (x.squeeze() if squeeze_terms else x)
    return y if z is None else y * F.silu(z.squeeze() if squeeze_terms else z)


def _inputs(batch, dim, skip, gate):
    g = torch.Generator().manual_seed(7)
    args = [torch.randn(batch, L, dim, generator=g), F.softplus(torch.randn(batch, L, dim, generator=g)),
            -(torch.rand(dim, N, generator=g) + 0.3), torch.randn(batch, L, N, generator=g),
            torch.randn(batch, L, N, generator=g)]
    args.append(torch.randn(dim, generator=g) if skip else None)
    args.append(torch.randn(batch, L, dim, generator=g) if gate else None)
    return args


@pytest.mark.parametrize("batch, dim, skip, gate, folded, family, reason", [
    # Batch 1: the squeeze drops the leading axis, and the skip and the gate broadcast it back.
    (1, 6, True, True, {"skip": 1, "gate": 1}, None, None),
    # One channel: the squeeze drops the dim axis, in the middle of (batch, L, 1).
    (2, 1, True, False, {}, "skip", "a squeeze() that drops y's size-1 axes [2] of [2, 5, 1], not only leading "
                                    "ones: broadcasting puts size-1 axes back in front only, so the skip's result "
                                    "[2, 5] cannot hold y's values"),
    (2, 1, False, True, {}, "gate", "a squeeze() that drops y's size-1 axes [2] of [2, 5, 1], not only leading "
                                    "ones: broadcasting puts size-1 axes back in front only, so the gate's result "
                                    "[2, 5] cannot hold y's values"),
    # Batch 1 and one channel: leading and trailing axes dropped.
    (1, 1, True, False, {}, "skip", "drops y's size-1 axes [0, 2] of [1, 5, 1], not only leading ones"),
], ids=["B1-folds", "D1-skip-says-why", "D1-gate-says-why", "B1-D1-skip-says-why"])
def test_tail_after_a_squeeze_of_y(batch, dim, skip, gate, folded, family, reason):
    *tensors, D, z = _inputs(batch, dim, skip, gate)
    args = [a.requires_grad_() for a in [*tensors, *(t for t in (D, z) if t is not None)]]

    def fn(*a):
        # Indexed, not popped: torch 2.11's dynamo makes a starred target a tuple.
        x, delta, A, B, C = a[:5]
        return seq_scan(x, delta, A, B, C, a[5] if skip else None, a[5 + skip] if gate else None,
                        squeeze_terms=family is not None)

    report = explain(fn, *args)
    assert report.counts["scan_loop"] == 1, report.format(graphs=False)
    assert {k: report.counts[k] for k in ("skip", "gate") if report.counts[k]} == folded, report.format(graphs=False)
    if reason is not None:
        assert any(reason in m.reason for m in report.misses if m.family == family), report.format(graphs=False)
    else:
        assert not [m for m in report.misses if m.family in ("skip", "gate")], report.format(graphs=False)
    check_explained_against_fp64(report, fn, args)


# --- chained decode steps: no copy of the previous step's new state ----------------------------

def test_chained_steps_copy_no_fresh_state():
    decode_op.register()
    block = MambaPyBlock()
    g = torch.Generator().manual_seed(8)
    xs, inputs0 = torch.randn(2, 3, D_MODEL, generator=g), torch.randn(2, DIM, W - 1, generator=g)
    report = explain(generate_steps, block, xs, inputs0)
    assert report.counts["state_update"] == 3 and report.counts["conv_update"] == 3, report.format(graphs=False)
    for o, r in zip(report.output, generate_steps(block, xs, inputs0), strict=True):
        assert rel_err(o, r) <= TOL[torch.float32]
    # The first step's state (zeros) and window (an input) are copied; the later ones, each the
    # step before's op output, are not.
    assert report.graphs[0].after.count(".clone()") == 2, report.graphs[0].after


def test_written_fresh_state_is_still_copied():
    # The matchers refuse a step whose state the program writes (test_decode68); the copy's own
    # condition is checked here on a graph made by hand: the new state an op returned, then
    # written in place, is no longer one value wherever it is read.
    decode_op.register()
    graph = torch.fx.Graph()
    state = graph.placeholder("state")
    state.meta["val"] = torch.randn(2, DIM, N)
    op = graph.call_function(torch.ops.ssm.selective_state_update_functional.default, (state,))
    op.meta["val"] = (torch.randn(2, DIM), torch.randn(2, DIM, N))
    new = graph.call_function(operator.getitem, (op, 1))
    new.meta["val"] = op.meta["val"][1]
    heads = graph.call_method("unflatten", (new, 1, (2, DIM // 2)))
    heads.meta["val"] = new.meta["val"].unflatten(1, (2, DIM // 2))
    assert _read_in_place_of_copy(graph, new) and _read_in_place_of_copy(graph, heads)
    assert not _read_in_place_of_copy(graph, state)
    graph.call_method("mul_", (heads, 2.0))
    assert not _read_in_place_of_copy(graph, new) and not _read_in_place_of_copy(graph, heads)
