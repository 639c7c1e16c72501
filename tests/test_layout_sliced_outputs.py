"""Returned views of an ssm op's output keep eager's strides (``passes/layout.py``).

A scan loop written in (batch, dim, L) that stacks its per-step outputs along L is
(batch, dim, L)-contiguous in eager; fed channel-innermost activations (an nn.Linear output
transposed) the op returns its y (batch, L, dim)-contiguous. A returned slice of y is not dense,
so no copy of the slice has eager's strides: the layout check copies the op output itself into
eager's layout right after the op and points the slice at the copy. Where a write in place
could tell that copy from the op's memory, or a returned tensor sharing that memory would not
move onto it, the output keeps the op's strides (right values, as before).

Each case checks values against eager within ``TOL``, the outputs' strides against eager's,
and that the scan was rewritten (``counters["ssm"]["scan_loop"]``).
"""

import pytest
import torch
from torch._dynamo.utils import counters
from utils import SCAN_SHAPE, TOL, channel_innermost, rel_err, scan_inputs, scan_y

import ssm_compile
from ssm_compile.compiler import SSMBackend, SSMOptions
from ssm_compile.kernels import register_ops

BATCH, DIM, N, L = SCAN_SHAPE
pytestmark = [pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`"),
              pytest.mark.usefixtures("quiet_ssm_log")]


@pytest.fixture(scope="module", autouse=True)
def _ops():
    register_ops()


def clones(args):
    return [a.clone() for a in args]


def compiled(fn, args, inductor):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, backend=ssm_compile.backend(inductor=inductor))(*clones(args))


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def assert_values(out, ref, tol):
    for o, r in zip(as_tuple(out), as_tuple(ref), strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert rel_err(o, r.double()) < tol


def assert_like_eager(out, ref, tol=TOL[torch.float32]):
    assert_values(out, ref, tol)
    for o, r in zip(as_tuple(out), as_tuple(ref), strict=True):
        assert o.stride() == r.stride(), (o.stride(), r.stride())


# Non-dense views of y, each through a different chain of plain views.
SLICES = {
    "cols": lambda y: y[:, :3],
    "row": lambda y: y[:, 0],
    "steps": lambda y: y[..., 2:5],
    "narrow": lambda y: y.narrow(2, 1, 4),
    "transposed-slice": lambda y: y.transpose(1, 2)[:, 1:],
    "select-unsqueeze": lambda y: y.select(1, 2).unsqueeze(1),
    "strided": lambda y: y[:, ::2, 1:],
}


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
@pytest.mark.parametrize("view", list(SLICES))
def test_returned_view_of_scan_output_keeps_eager_strides(view, inductor):
    def fn(u, delta, A, B, C):
        return SLICES[view](scan_y(u, delta, A, B, C))

    args = scan_inputs()
    out = compiled(fn, args, inductor)
    assert counters["ssm"]["scan_loop"] == 1
    assert_like_eager(out, fn(*args))


@pytest.mark.parametrize("layout", ["ci", "dense"])
def test_two_scans_and_dense_input(layout):
    """Dense u: the op's layout is eager's already (nothing to copy); two scans: one copy each."""
    def fn(u, delta, A, B, C):
        return scan_y(u, delta, A, B, C)[:, 1:4] * 1.0, scan_y(u * 2, delta, A, B, C)[:, :2]

    args = scan_inputs(layout=layout)
    out = compiled(fn, args, inductor=False)
    assert counters["ssm"]["scan_loop"] == 2
    assert_like_eager(out, fn(*args))


def test_only_the_returned_views_move_onto_the_copy():
    """The op's other users keep its layout (the next nn.Linear reads it without a copy); the
    returned slice views a copy in eager's layout, made right after the op."""
    records = []

    def fn(u, delta, A, B, C):
        y = scan_y(u, delta, A, B, C)
        return y[:, :3], y.transpose(1, 2) @ torch.ones(DIM, 2)

    args = scan_inputs()
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend=SSMBackend(SSMOptions(inductor=False), on_graph=records.append))(*clones(args))
    assert counters["ssm"]["scan_loop"] == 1
    assert_like_eager(out, fn(*args))
    (record,) = records
    code = record.after
    assert code.count(".contiguous()") == 1, code
    copy_line = next(line for line in code.splitlines() if ".contiguous()" in line)
    scan_line = next(i for i, line in enumerate(code.splitlines()) if "selective_scan" in line)
    assert code.splitlines().index(copy_line) == scan_line + 3, code  # getitem, permute, contiguous


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_views_of_one_output_stay_aliased(inductor):
    """y and two views of it, returned: all move onto the one copy, so the caller's write through
    y shows in both views, as in eager."""
    def fn(u, delta, A, B, C):
        y = scan_y(u, delta, A, B, C)
        return y, y[:, 0], y[:, 2:]

    args = scan_inputs()
    ref = fn(*args)
    out = compiled(fn, args, inductor)
    assert counters["ssm"]["scan_loop"] == 1
    assert_like_eager(out, ref)
    seen = [o.clone() for o in out[1:]]
    out[0].add_(1.0)
    for o, s in zip(out[1:], seen):
        torch.testing.assert_close(o, s + 1.0)


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_view_with_other_users(inductor):
    def fn(u, delta, A, B, C):
        s = scan_y(u, delta, A, B, C)[:, 1:]
        return s, s.sum(-1), s.transpose(1, 2) * 2

    args = scan_inputs()
    out = compiled(fn, args, inductor)
    assert counters["ssm"]["scan_loop"] == 1
    assert_like_eager(out, fn(*args))


# --- where a copy could be told apart: left in the op's layout, values still right ----------

def write_after_the_slice(y):
    s = y[:, :3]
    y.mul_(2)
    return s


def write_through_the_slice(y):
    s = y[:, :3]
    s.add_(1)
    return s, y * 2


def write_before_the_slice(y):
    y[:, 0] = 0
    return y[:, :3]


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
@pytest.mark.parametrize("write", [write_after_the_slice, write_through_the_slice, write_before_the_slice],
                         ids=lambda f: f.__name__)
def test_write_in_place_keeps_the_op_layout(write, inductor):
    """A copy made before the write would miss it (or the slice would miss the write through y):
    the slice stays a view of the op's own output, channel-innermost, and sees every write."""
    def fn(u, delta, A, B, C):
        return write(scan_y(u, delta, A, B, C))

    args = scan_inputs()
    ref = fn(*clones(args))
    out = compiled(fn, args, inductor)
    assert counters["ssm"]["scan_loop"] == 1
    assert_values(out, ref, TOL[torch.float32])
    if not inductor:  # inductor functionalizes the write and picks the output's strides itself
        # Today's layout: the slice of a (batch, L, dim)-contiguous y.
        assert as_tuple(out)[0].stride() == channel_innermost(torch.empty(BATCH, DIM, L))[:, :3].stride()


def test_output_sharing_memory_outside_the_views_keeps_the_op_layout():
    """Two returned views of y, one through ``unflatten`` (not a view the check follows): moving
    only the other onto a copy would split memory the caller sees shared, so both stay on the
    op's output, aliased as in eager."""
    def fn(u, delta, A, B, C):
        y = scan_y(u, delta, A, B, C)
        return y[:, :3], y.unflatten(2, (2, L // 2))[:, :3]

    args = scan_inputs()
    ref = fn(*args)
    out = compiled(fn, args, inductor=False)
    assert counters["ssm"]["scan_loop"] == 1
    assert_values(out, ref, TOL[torch.float32])
    assert out[0].stride() == channel_innermost(torch.empty(BATCH, DIM, L))[:, :3].stride()
    seen = out[0].clone()
    out[1].add_(1.0)
    torch.testing.assert_close(out[0], seen + 1.0)


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_gradients_through_the_copy(inductor):
    def fn(u, delta, A, B, C):
        return scan_y(u, delta, A, B, C)[:, :3, 1:]

    args = scan_inputs()
    leaves = [a.clone().requires_grad_() for a in args]
    ref_leaves = [a.clone().double().requires_grad_() for a in args]
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend=ssm_compile.backend(inductor=inductor))(*leaves)
    ref = fn(*ref_leaves)
    assert counters["ssm"]["scan_loop"] == 1
    assert_like_eager(out, fn(*args))
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(dy.float())
    ref.backward(dy)
    for leaf, ref_leaf in zip(leaves, ref_leaves):
        assert rel_err(leaf.grad, ref_leaf.grad) < TOL[torch.float32]


def test_dynamic_shapes():
    """Eager's order, not its strides, is what the copy keeps: it holds for symbolic sizes too.
    fx only: inductor's own dynamic-shape code for this loop is wrong on torch 2.13 CPU even
    without the ssm backend (``backend="inductor"``), so it cannot be compared here."""
    def fn(u, delta, A, B, C):
        return scan_y(u, delta, A, B, C)[:, :3, 1:]

    torch._dynamo.reset()
    counters.clear()
    cf = torch.compile(fn, backend=ssm_compile.backend(inductor=False), dynamic=True)
    for seed in (0, 1):
        args = scan_inputs(seed=seed)
        assert_like_eager(cf(*clones(args)), fn(*args))
    assert counters["ssm"]["scan_loop"] == 1  # one graph, symbolic batch
