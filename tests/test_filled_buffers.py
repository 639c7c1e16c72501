"""A scan input filled in place before it is made (VMamba's cross-scan as a plain function).

``xs = x.new_empty(...); xs[:, 0] = ...; xs[:, 1] = ...; u = xs.view(...)``: every write to u's
memory comes before u exists, so nothing can read u before them, and the op, which reads u
after u's node, reads what the loop read. Before run 52 any in-place write to a source's memory
refused the scan ("u is mutated in place"; probe AZ, EfficientVMamba's atrous split and
VMamba's CrossScan written without the autograd.Function). A write at or after the source's own
node still refuses it, up to the loop's last read: the op could read another value there than the
loop did. A write after the whole loop (``u.mul_(2)`` once the scan is done) changes nothing the
loop or the op read, so the scan is rewritten; a fold that would read the written value where the
user read it (the skip's D·u after the write) is not.

Values and gradients are compared with eager in fp64 on random inputs, the refusals included.
"""
import pytest
import torch
from torch._higher_order_ops.associative_scan import associative_scan
from test_unseen_scan5 import assert_matches_eager

from ssm_compile.report import explain

BATCH, CH, H, W, N = 2, 2, 2, 3, 3
L = H * W


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, CH, H, W, generator=g, dtype=torch.float64)
    delta = torch.rand(BATCH, 2 * CH, L, generator=g, dtype=torch.float64) * 0.5 + 0.1
    A = -torch.rand(2 * CH, N, generator=g, dtype=torch.float64) - 0.5
    B = torch.randn(BATCH, N, L, generator=g, dtype=torch.float64)
    C = torch.randn(BATCH, N, L, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (x, delta, A, B, C)]


def _cross(x):
    """Two scan orders of an image, row-major and column-major, in one (b, 2c, L) buffer filled
    in place."""
    b, c = x.shape[:2]
    xs = x.new_empty((b, 2, c, L))
    xs[:, 0] = x.flatten(2, 3)
    xs[:, 1] = x.transpose(2, 3).flatten(2, 3)
    return xs


def _loop(u, delta, A, B, C):
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    h = A.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]))
    return torch.stack(ys, dim=2)


def filled_then_viewed(x, delta, A, B, C):
    return _loop(_cross(x).view(BATCH, 2 * CH, L), delta, A, B, C)


def filled_then_assoc(x, delta, A, B, C):
    u = _cross(x).view(BATCH, 2 * CH, L)
    dA = torch.exp(delta.unsqueeze(-1) * A[:, None, :])
    dBu = (delta * u).unsqueeze(-1) * B.transpose(1, 2).unsqueeze(1)
    _, hs = associative_scan(lambda p, q: (p[0] * q[0], q[0] * p[1] + q[1]), (dA, dBu), dim=2,
                             combine_mode="generic")
    return torch.einsum("bdln,bnl->bdl", hs, C)


def filled_then_viewed_twice(x, delta, A, B, C):
    # u read through a view of its own (u.unsqueeze(-1)), made after the fills like u (probe BB).
    u = _cross(x).view(BATCH, 2 * CH, L)
    dA = torch.exp(delta.unsqueeze(-1) * A[:, None, :])
    dBu = delta.unsqueeze(-1) * u.unsqueeze(-1) * B.transpose(1, 2).unsqueeze(1)
    h = A.new_zeros(BATCH, 2 * CH, N)
    ys = []
    for i in range(L):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]))
    return torch.stack(ys, dim=2)


def viewed_then_filled(x, delta, A, B, C):
    # u's node comes before the writes: the op would be placed where u is not filled yet.
    b, c = x.shape[:2]
    xs = x.new_empty((b, 2, c, L))
    u = xs.view(b, 2 * c, L)
    xs[:, 0] = x.flatten(2, 3)
    xs[:, 1] = x.transpose(2, 3).flatten(2, 3)
    return _loop(u, delta, A, B, C)


def written_between(x, delta, A, B, C):
    # Half of u is rewritten after the loop's input term read it: the loop read both values.
    xs = _cross(x)
    u = xs.view(BATCH, 2 * CH, L)
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    xs[:, 1] = 0.5 * x.flatten(2, 3)
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    h = A.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(L):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]) + u[:, :, i])
    return torch.stack(ys, dim=2)


def compare(fn, args):
    """``explain(fn, *args)``, whose output (the compiled one) is eager's: values, and gradients
    where the inputs need them."""
    report = explain(fn, *args)
    if args[0].requires_grad:
        assert_matches_eager(report.output, fn, args)
    else:
        torch.testing.assert_close(report.output, fn(*args), rtol=1e-12, atol=1e-12)
    return report


@pytest.mark.parametrize("fn, family", [(filled_then_viewed, "scan_loop"), (filled_then_viewed_twice, "scan_loop"),
                                        (filled_then_assoc, "scan_assoc")], ids=["loop", "loop-view", "assoc"])
def test_a_source_filled_before_it_is_made_is_rewritten(fn, family):
    assert compare(fn, inputs()).counts[family] == 1


def filled_then_skip_and_gate(x, delta, A, B, C):
    # VMamba v2's selective_scan_torch after its cross-scan (probe CB, run 59): the skip reads u,
    # the gate a second buffer filled the same way; every write comes before u and z are made.
    z = _cross(x.cos()).view(BATCH, 2 * CH, L)
    u = _cross(x).view(BATCH, 2 * CH, L)
    y = _loop(u, delta, A, B, C) + u * A[:, :1]
    return y * torch.nn.functional.silu(z)


def test_a_skip_and_gate_read_from_filled_buffers_fold():
    # Any write to u's or z's memory used to refuse the folds, even one before u and z existed.
    report = compare(filled_then_skip_and_gate, inputs())
    assert report.counts["scan_loop"] == 1
    assert report.counts.get("skip") == 1 and report.counts.get("gate") == 1, report.format(graphs=False)


@pytest.mark.parametrize("fn, reason", [
    (viewed_then_filled, "u is mutated in place (it, or a view sharing its memory, is written by"),
    (written_between, "u is mutated in place (it, or a view sharing its memory, is written by"),
], ids=["viewed-first", "written-between"])
def test_a_source_written_after_it_is_made_is_left_alone(fn, reason):
    # Eager's own backward refuses the written-between program (its einsum saved u): values only.
    args = inputs() if fn is viewed_then_filled else [a.detach() for a in inputs()]
    report = compare(fn, args)
    assert report.counts["scan_loop"] == 0
    assert any(reason in m.reason for m in report.misses), report.format(graphs=False)


def written_after_the_loop(x, delta, A, B, C):
    # Half of u is rewritten once the loop is done; only what follows reads the new values.
    xs = _cross(x)
    u = xs.view(BATCH, 2 * CH, L)
    y = _loop(u, delta, A, B, C)
    xs[:, 1] = 0.5 * x.flatten(2, 3)
    return y + u


def skip_after_the_write(x, delta, A, B, C):
    # The skip reads u after the write: the scan is rewritten, the skip stays the user's.
    u = _cross(x).view(BATCH, 2 * CH, L)
    y = _loop(u, delta, A, B, C)
    u.mul_(2.0)
    return y + u * delta[0, :, :1]


def state_written_after_the_loop(x, delta, A, B, C):
    # An initial state the program clears once the loop has read it (a cache reset after use),
    # through the cache it is a view of.
    u = _cross(x).view(BATCH, 2 * CH, L)
    cache = x.new_ones(2, BATCH, 2 * CH, N) * x.mean()
    h = h0 = cache[1]
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    ys = []
    for i in range(L):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]))
    cache.zero_()
    return torch.stack(ys, dim=2), cache, h


@pytest.mark.parametrize("fn, skip", [(written_after_the_loop, None),
                                      (skip_after_the_write, "writes D or u in place"),
                                      (state_written_after_the_loop, None)],
                         ids=["u-after", "skip-after-the-write", "initial-state-after"])
def test_a_source_written_after_the_loop_is_rewritten(fn, skip):
    # Eager's own backward refuses these programs (the loop saved what is written): values only.
    args = [a.detach() for a in inputs()]
    report = compare(fn, args)
    assert report.counts["scan_loop"] == 1
    if skip is not None:
        assert any(skip in m.reason for m in report.misses if m.family == "skip"), report.format(graphs=False)


@pytest.mark.parametrize("fn", [written_after_the_loop, skip_after_the_write, state_written_after_the_loop],
                         ids=["u-after", "skip-after-the-write", "initial-state-after"])
def test_a_source_written_after_the_loop_is_left_alone_where_gradients_are_recorded(fn):
    # The op saves its inputs for its backward; a later write reaches them (a version-counter
    # error in the backward, or wrong gradients through .data; probe BR, 0.6 off in C's gradient).
    args = inputs()
    report = explain(fn, *args)
    assert not report.counts.get("scan_loop"), report.format(graphs=False)
    assert any("after the loop while gradients are recorded: the op saves its inputs" in m.reason
               for m in report.misses), report.format(graphs=False)
    torch.testing.assert_close(report.output, fn(*args), rtol=1e-12, atol=1e-12)
