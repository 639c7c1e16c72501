"""A loop that takes each step as a width-1 piece keeping the time axis (``passes/pieces.py``).

``x[:, :, t:t + 1]``, ``x.narrow(2, t, 1)``, ``zip(x.split(1, 2), ...)``, ``x.chunk(L, 2)`` and
``torch.tensor_split(x, L, 2)`` read the same values as ``x.select(2, t).unsqueeze(2)``. Before
run 52 the scan pass saw no time slice in such a loop: the scan was not rewritten and explain
said nothing about it. ``read_unit_pieces`` now writes the pieces as selects put back, where one
tensor is cut into two or more of them along one axis and nobody writes, returns or reads the
strides of a piece.

Values and gradients are compared with eager in fp64 on random inputs in every case, the
refusals included.
"""
import logging

import pytest
import torch
from test_pieces_and_staging import capture

from ssm_compile.compiler import backend
from ssm_compile.passes.fx_utils import unit_piece
from ssm_compile.passes.pieces import read_unit_pieces
from ssm_compile.report import explain

BATCH, DIM, L, N = 2, 4, 6, 3


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(BATCH, DIM, L, generator=g, dtype=torch.float64)
    delta = torch.rand(BATCH, DIM, L, generator=g, dtype=torch.float64) + 0.1
    A = -torch.rand(DIM, N, generator=g, dtype=torch.float64) - 0.2
    B = torch.randn(BATCH, N, L, generator=g, dtype=torch.float64)
    C = torch.randn(BATCH, N, L, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (u, delta, A, B, C)]


def _scan(steps, A):
    """The step body shared by every spelling: (Δ_t, u_t, B_t, C_t) each keep a size-1 time axis
    ((b, d, 1) and (b, N, 1))."""
    h = A.new_zeros(BATCH, DIM, N)
    ys = []
    for dt, ut, Bt, Ct in steps:
        h = torch.exp(dt * A) * h + (dt * ut) * Bt.transpose(1, 2)
        ys.append((h * Ct.transpose(1, 2)).sum(-1))
    return torch.stack(ys, -1)


def slices(u, delta, A, B, C):
    return _scan(((delta[:, :, t:t + 1], u[:, :, t:t + 1], B[:, :, t:t + 1], C[:, :, t:t + 1])
                  for t in range(L)), A)


def narrows(u, delta, A, B, C):
    return _scan(((delta.narrow(2, t, 1), u.narrow(2, t, 1), B.narrow(-1, t, 1), C.narrow(2, t, 1))
                  for t in range(L)), A)


def splits(u, delta, A, B, C):
    return _scan(zip(delta.split(1, 2), u.split(1, dim=2), B.split(1, -1), torch.split(C, 1, 2)), A)


def chunks(u, delta, A, B, C):
    return _scan(zip(delta.chunk(L, 2), torch.chunk(u, L, 2), B.chunk(L, dim=2), C.chunk(L, 2)), A)


def tensor_splits(u, delta, A, B, C):
    return _scan(zip(torch.tensor_split(delta, L, 2), u.tensor_split(L, 2), torch.tensor_split(B, L, dim=2),
                     C.tensor_split(L, 2)), A)


def selects_put_back(u, delta, A, B, C):
    return _scan(((delta.select(2, t).unsqueeze(2), u.select(2, t).unsqueeze(2), B.select(2, t).unsqueeze(2),
                   C.select(2, t).unsqueeze(2)) for t in range(L)), A)


def _scan_of_steps(steps, A):
    """``_scan`` for steps read without their time axis: (Δ_t, u_t) (b, d), (B_t, C_t) (b, N)."""
    h = A.new_zeros(BATCH, DIM, N)
    ys = []
    for dt, ut, Bt, Ct in steps:
        h = torch.exp(dt[..., None] * A) * h + (dt * ut)[..., None] * Bt[:, None]
        ys.append((h * Ct[:, None]).sum(-1))
    return torch.stack(ys, -1)


def slices_at_zero(u, delta, A, B, C):
    return _scan_of_steps(((delta[:, :, t:t + 1][:, :, 0], u[:, :, t:t + 1][..., 0], B[:, :, t:t + 1][:, :, -1],
                            C[:, :, t:t + 1].select(2, 0)) for t in range(L)), A)


def chunks_at_zero(u, delta, A, B, C):
    return _scan_of_steps(((dt[:, :, 0], ut[:, :, 0], Bt[:, :, 0], Ct[:, :, 0]) for dt, ut, Bt, Ct in
                           zip(delta.chunk(L, 2), u.chunk(L, 2), B.chunk(L, 2), C.chunk(L, 2))), A)


def compare(fn, args, *, rewrites):
    """``explain(fn, *args)``: ``rewrites`` scans rewritten, and the output (the compiled one) and
    its gradients eager's."""
    ref = fn(*args)
    ref_grads = torch.autograd.grad(ref.square().sum(), args)
    report = explain(fn, *args)
    grads = torch.autograd.grad(report.output.square().sum(), args)
    assert report.counts["scan_loop"] == rewrites
    torch.testing.assert_close(report.output, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    return report


@pytest.mark.parametrize("fn", [slices, narrows, splits, chunks, tensor_splits, selects_put_back],
                         ids=lambda f: f.__name__)
def test_a_loop_over_width_one_pieces_is_rewritten(fn):
    compare(fn, inputs(), rewrites=1)


@pytest.mark.parametrize("fn", [slices_at_zero, chunks_at_zero], ids=lambda f: f.__name__)
def test_pieces_read_at_index_zero_are_the_steps(fn):
    """Index 0 of a width-1 piece along its axis is the step's select (run 66). Before, each piece
    was read as a tensor one step long, and the loop was left alone as "a one-step loop" (probe
    CV): a false reason for an L-step scan."""
    assert not compare(fn, inputs(), rewrites=1).misses


def test_the_pieces_are_read_as_selects_put_back(caplog):
    with caplog.at_level(logging.INFO, logger="ssm_compile"):
        torch.compile(slices, backend=backend(inductor=False))(*inputs())
    torch._dynamo.reset()
    changes = caplog.text
    for name in ("l_delta_", "l_u_", "l_b_", "l_c_"):
        assert f"{L} width-1 pieces of {name} along axis 2 read as {name}.select(2, t).unsqueeze(2)" in changes


def written_piece(u, delta, A, B, C):
    # Each step's Δ piece is scaled in place: a write through the piece reaches delta itself, so
    # a later step reads what an earlier one wrote. Left as written.
    delta = delta.clone()
    steps = []
    for t in range(L):
        dt = delta[:, :, t:t + 1]
        dt.mul_(0.5)
        steps.append((dt, u[:, :, t:t + 1], B[:, :, t:t + 1], C[:, :, t:t + 1]))
    return _scan(steps, A)


def one_piece(u, delta, A, B, C):
    # One width-1 piece of each tensor: not a loop's steps, left as written.
    return (delta[:, :, 2:3] * u[:, :, 2:3]).sum(-1) + B[:, :, 0:1].sum() + C[:, :, -1:].sum()


def strided_reader(u, delta, A, B, C):
    # as_strided reads the piece's strides, which a select put back does not keep.
    pieces = [delta[:, :, t:t + 1] for t in range(L)]
    return sum(torch.as_strided(p, (BATCH, DIM), (p.stride(0), p.stride(1))) for p in pieces)


def returned(u, delta, A, B, C):
    # The caller gets the pieces themselves (their strides included).
    return tuple(u[:, :, t:t + 1] for t in range(L))


def two_axes(u, delta, A, B, C):
    # Width-1 pieces along two axes of one tensor: two groups, each a loop's steps.
    return sum(u[:, i:i + 1, t:t + 1] for i in range(DIM) for t in range(L))


def channels_last_conv(u, delta, A, B, C):
    # The width-1 pieces of a channels-last x have the stride of its channel axis on their
    # size-1 axis, a select put back has 1 there: conv2d picks its output's layout from it, and
    # as_strided reads that layout through the strides the code asked for (probe BB: 23.2 off).
    x = u.detach().reshape(BATCH, DIM, 2, L // 2).contiguous(memory_format=torch.channels_last)
    w = delta.detach()[0, :, :3].reshape(DIM, 1, 3, 1).expand(DIM, DIM, 3, 1).contiguous()
    outs = []
    for i in range(L // 2):
        y = torch.nn.functional.conv2d(x[:, :, :, i:i + 1], w, padding=(1, 0))
        s = y.stride()
        outs.append(torch.as_strided(y, (BATCH, 2, DIM), (s[0], s[2], s[1])))
    return torch.stack(outs, 1)


@pytest.mark.parametrize("fn, changed", [
    (channels_last_conv, []),
    (written_piece, ["b", "c", "u"]), (one_piece, []), (strided_reader, []), (returned, []),
], ids=["channels-last", "written", "one-piece", "as_strided", "returned"])
def test_pieces_left_as_written(fn, changed):
    args = [t.detach() for t in inputs()]
    changes, gm, out = capture(fn, *[a.clone() for a in args], rewrite=read_unit_pieces)
    assert sorted(c.split(" of l_")[1].split("_ ")[0] for c in changes) == changed
    ref = fn(*args)
    ref = ref if isinstance(ref, tuple) else (ref,)
    out = out if isinstance(out, tuple) else (out,)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=0, atol=0)
        assert o.stride() == r.stride()


def test_a_piece_narrowing_two_axes_is_not_a_unit_piece():
    args = [t.detach() for t in inputs()]
    changes, gm, out = capture(two_axes, *args, rewrite=read_unit_pieces)
    assert changes == []
    torch.testing.assert_close(out, two_axes(*args), rtol=0, atol=0)


@pytest.mark.parametrize("expr, expected", [
    (lambda x: x[:, :, 3:4], (2, 3)),
    (lambda x: x[:, :, -2:-1], (2, -2)),
    (lambda x: x[:, -1:0], None),            # empty: -1 .. 0
    (lambda x: x[:, :, -1:], (2, -1)),       # an open stop, width 1
    (lambda x: x[:, :, 5:], (2, 5)),
    (lambda x: x[:, :, 4:], None),           # an open stop, width 2
    (lambda x: x[:, None, 1:2], None),       # an inserted axis: not a plain piece
    (lambda x: x[:, 1:2, 1:2], None),        # narrows two axes
    (lambda x: x[:, :, 1:3], None),          # width 2
    (lambda x: x.narrow(1, 2, 1), (1, 2)),
    (lambda x: x.chunk(6, 2)[5], (2, 5)),
    (lambda x: x.chunk(3, 2)[1], None),      # width 2
    (lambda x: torch.tensor_split(x, 6, 2)[0], (2, 0)),
    (lambda x: torch.tensor_split(x, [1, 2], 2)[1], None),  # indices, not sections
    (lambda x: x.split(1, 2)[4], (2, 4)),
    (lambda x: x.split([1, 5], 2)[0], None),  # sizes, not one size
    (lambda x: x.select(2, 1).unsqueeze(2), (2, 1)),
    (lambda x: x.select(2, 1).unsqueeze(1), None),  # put back elsewhere
])
def test_unit_piece(expr, expected):
    x = torch.randn(BATCH, DIM, L)
    seen = {}

    def be(gm, example_inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        seen["node"] = out.args[0][0]
        return gm.forward

    torch.compile(lambda x: (expr(x),), backend=be, fullgraph=True)(x)
    torch._dynamo.reset()
    found = unit_piece(seen["node"])
    assert (None if found is None else found[1:]) == expected


def test_a_state_with_the_time_axis_kept_is_named_in_the_reason():
    def full_terms(u, delta, A, B, C):
        dA = torch.exp(delta.unsqueeze(-1) * A[:, None, :])  # (b, d, L, N)
        dBu = (delta * u).unsqueeze(-1) * B.transpose(1, 2).unsqueeze(1)
        h = u.new_zeros(BATCH, DIM, 1, N)
        ys = []
        for t in range(L):
            h = dA[:, :, t:t + 1] * h + dBu[:, :, t:t + 1]
            ys.append((h * C[:, None, :, t:t + 1].transpose(2, 3)).sum(-1))
        return torch.cat(ys, 2)

    report = str(compare(full_terms, inputs(), rewrites=0))
    assert "with its time axis 2 kept at size 1, as x[:, t:t + 1] reads it" in report, report
