"""passes/inplace.py: in-place arithmetic on graph-allocated tensors, written out of place before
the matchers run; and the clones that only guarded against such writes.

Each case runs the rewritten graph against eager on random inputs. The refusals check that the
in-place node is still in the graph and that the values (and the caller's mutated tensors) are
eager's.
"""
import operator

import pytest
import torch
import torch.nn.functional as F
from utils import TOL, rel_err

from ssm_compile.compiler import backend
from ssm_compile.passes.inplace import rewrite_local_writes
from ssm_compile.report import explain


def capture(fn, *args):
    """Compile ``fn`` with a backend that applies the two rewrites; returns (changes, graph, out)."""
    seen = {}

    def backend(gm, example_inputs):
        seen["changes"] = rewrite_local_writes(gm)
        seen["gm"] = gm
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    return seen["changes"], seen["gm"], out


def inplace_nodes(gm):
    return [n for n in gm.graph.nodes
            if (n.op == "call_method" and n.target.endswith("_"))
            or (n.op == "call_function" and n.target in (operator.iadd, operator.isub, operator.imul,
                                                         operator.itruediv, operator.setitem))]


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# --- values: every reader sees the write before it ------------------------------------------

def readers_between_writes(x, y):
    a = x * 2.0
    before = a + 0.5          # reads a before any write
    a += y
    middle = a * 3.0          # after the first write
    a.mul_(y).sub_(1.0)
    a.addcmul_(x, y)
    a /= 2.0
    return before, middle, a, a.neg_()


def test_readers_see_the_value_at_their_place():
    x, y = rand(3, 4, seed=1), rand(3, 4, seed=2)
    changes, gm, out = capture(readers_between_writes, x, y)
    assert len(changes) == 1 and "6 in-place write(s)" in changes[0], changes
    assert inplace_nodes(gm) == []
    for o, r in zip(out, readers_between_writes(x, y)):
        torch.testing.assert_close(o, r, rtol=0, atol=0)


def state_from_zeros(dA, dBu, C):
    h = torch.zeros(dA.shape[0], dA.shape[1], dA.shape[3], dtype=dA.dtype)
    ys = []
    for t in range(dA.shape[2]):
        h *= dA[:, :, t]
        h += dBu[:, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, -1), h


def test_state_updated_in_place_keeps_values_and_grads():
    b, d, L, n = 2, 3, 5, 4
    args = [rand(b, d, L, n, seed=1).sigmoid(), rand(b, d, L, n, seed=2), rand(b, n, L, seed=3)]
    changes, gm, out = capture(state_from_zeros, *args)
    assert len(changes) == 1 and f"{2 * L} in-place write(s)" in changes[0], changes
    assert inplace_nodes(gm) == []
    for o, r in zip(out, state_from_zeros(*args)):
        torch.testing.assert_close(o, r, rtol=0, atol=0)


# --- refusals -----------------------------------------------------------------------------------

def writes_an_input(x, y):
    x.mul_(y)
    return x + 1.0


def writes_through_a_view(x, y):
    a = x * 2.0
    a.view(-1).add_(1.0)
    return a * y


def promotes(x, y):
    a = x * 2.0          # fp32
    a += y               # y is fp64: in place keeps fp32, out of place would give fp64
    return a


def across_no_grad(x, y):
    a = x * 2.0
    with torch.no_grad():
        a += y
    return a * y


def written_by_copy(x, y):
    a = x * 2.0
    a.copy_(y)
    return a + 1.0


def written_by_setitem(x, y):
    a = x * 2.0
    a[0] = 1.0
    return a + y


def exp_under_autocast(x, y):
    # In place, exp and pow keep a's dtype; out of place, CUDA's autocast would run them in fp32
    # (probe AF). CPU autocast leaves both alone, so only the graph can tell here.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = x * 2.0
        a.exp_()
        a.pow_(2)
        return a * y


@pytest.mark.parametrize("fn, dtypes", [
    (exp_under_autocast, (torch.float32, torch.float32)),
    (writes_an_input, (torch.float64, torch.float64)),
    (writes_through_a_view, (torch.float64, torch.float64)),
    (promotes, (torch.float32, torch.float64)),
    (across_no_grad, (torch.float64, torch.float64)),
    (written_by_copy, (torch.float64, torch.float64)),
    (written_by_setitem, (torch.float64, torch.float64)),
], ids=lambda p: getattr(p, "__name__", ""))
def test_writes_it_must_keep(fn, dtypes):
    def inputs():
        return rand(3, 4, seed=1, dtype=dtypes[0]), rand(3, 4, seed=2, dtype=dtypes[1])

    x, y = inputs()
    changes, gm, out = capture(fn, x, y)
    assert changes == [] and inplace_nodes(gm), changes
    x_ref, y_ref = inputs()
    ref = fn(x_ref, y_ref)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(x, x_ref, rtol=0, atol=0)  # the caller's tensor written as in eager


def test_arithmetic_under_autocast_is_written_out_of_place():
    """add/mul/tanh/clamp are on no autocast list: inside a region their out-of-place ops compute
    what the in-place ones did."""
    def fn(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = x * 2.0
            a.mul_(y).add_(1.0)
            a.tanh_()
            a.clamp_(-0.5, 0.5)
            return a * y

    x, y = rand(3, 4, seed=1, dtype=torch.float32), rand(3, 4, seed=2, dtype=torch.float32)
    changes, gm, out = capture(fn, x, y)
    assert len(changes) == 1 and "4 in-place write(s)" in changes[0] and not inplace_nodes(gm), changes
    torch.testing.assert_close(out, fn(x, y), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast runs exp/pow in fp32; needs a GPU")
def test_exp_under_cuda_autocast_keeps_eager_dtype():
    """Probe AF's repro: written out of place, ``h.exp()`` would return fp32 under CUDA autocast
    where eager's ``h.exp_()`` keeps fp16."""
    def fn(x, w):
        with torch.autocast("cuda", dtype=torch.float16):
            h = x @ w
            h.exp_()
            h.pow_(2)
            return h * 1.0

    x, w = torch.randn(4, 8, device="cuda") * 0.1, torch.randn(8, 8, device="cuda") * 0.1
    ref = fn(x, w)
    # The passes alone (the rewritten graph run eagerly): eager's values exactly.
    out = torch.compile(fn, backend=backend(inductor=False))(x, w)
    torch._dynamo.reset()
    assert out.dtype == ref.dtype == torch.float16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # With inductor, which keeps exp's result in fp32 for the pow (one rounding, not two): fp16's.
    out = torch.compile(fn, backend="ssm")(x, w)
    torch._dynamo.reset()
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, ref)


def test_no_grad_write_keeps_eager_autograd():
    """Under no_grad an in-place write changes a value autograd does not see; kept as written, the
    compiled function's gradient is eager's (out of place, the write would cut the graph)."""
    x = rand(3, 4, seed=1).requires_grad_()
    y = rand(3, 4, seed=2)
    out = torch.compile(across_no_grad, backend="ssm")(x, y)
    torch._dynamo.reset()
    (gx,) = torch.autograd.grad(out.sum(), x)
    x2 = x.detach().clone().requires_grad_()
    (gx_ref,) = torch.autograd.grad(across_no_grad(x2, y).sum(), x2)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=0)


# --- clones -------------------------------------------------------------------------------------

def clone_in_step(x, y):
    h = x * 1.5
    for _ in range(3):
        h = y * h.clone() + 1.0
    return h


def clone_then_source_written(x, y):
    a = x * 2.0
    c = a.clone()
    a.view(-1).add_(1.0)
    return c * y + a


def clone_returned(x, y):
    a = x * 2.0
    c = a.clone()
    return c, c * y, a


def clone_of_expanded(x, y):
    e = x[:, :1].expand(3, 4)
    c = e.clone()           # dense strides, e's are 0 along dim 1
    return (c * y).view(-1)


@pytest.mark.parametrize("fn, dropped", [(clone_in_step, 3), (clone_then_source_written, 0),
                                         (clone_returned, 0), (clone_of_expanded, 0)],
                         ids=lambda p: getattr(p, "__name__", str(p)))
def test_clones(fn, dropped):
    x, y = rand(3, 4, seed=1), rand(3, 4, seed=2)
    changes, gm, out = capture(fn, x, y)
    assert sum("a clone of" in c for c in changes) == dropped, changes
    clones = [n for n in gm.graph.nodes if n.target in ("clone", torch.clone)]
    assert (len(clones) == 0) == (dropped > 0)
    ref = fn(x, y)
    for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        torch.testing.assert_close(o, r, rtol=0, atol=0)


# --- through the backend: a hand-written Mamba core written in place ---------------------------

def discretize(u, delta, A, B):
    delta = F.softplus(delta)
    return torch.exp(torch.einsum("bdl,dn->bdln", delta, A)), torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)


def mamba_core_inplace(u, delta, A, B, C, D, z):
    """A selective scan whose state, skip and gate are all written in place."""
    dA, dBu = discretize(u, delta, A, B)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h *= dA[:, :, t]
        h += dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    y = torch.stack(ys, -1)
    y += u * D[:, None]
    y *= F.silu(z)
    return y


def mamba_core_reference(u, delta, A, B, C, D, z):
    """The same function out of place (eager cannot differentiate the in-place one: the readout
    saved h, which the next step overwrites)."""
    dA, dBu = discretize(u, delta, A, B)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return (torch.stack(ys, -1) + u * D[:, None]) * F.silu(z)


def core_inputs(dtype=torch.float64, requires_grad=True):
    b, d, L, n = 2, 6, 9, 4
    g = torch.Generator().manual_seed(3)
    f = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    args = [f(b, d, L), f(b, d, L), -torch.rand(d, n, generator=g, dtype=dtype) - 0.5, f(b, n, L), f(b, n, L),
            f(d), f(b, d, L)]
    return [a.requires_grad_(requires_grad) for a in args]


def test_inplace_mamba_core_is_rewritten_and_trains():
    report = explain(mamba_core_inplace, *[a.detach() for a in core_inputs()])
    assert {"scan_loop", "discretization", "readout", "delta", "skip", "gate"} <= set(report.counts), \
        report.format(graphs=False)
    args, ref_args = core_inputs(), core_inputs()
    out = torch.compile(mamba_core_inplace, backend="ssm")(*args)
    torch._dynamo.reset()
    with torch.no_grad():
        assert rel_err(out, mamba_core_inplace(*ref_args)) <= TOL[torch.float64]
    ref = mamba_core_reference(*ref_args)
    assert rel_err(out, ref) <= TOL[torch.float64]
    grad_out = rand(*ref.shape, seed=9)
    grads = torch.autograd.grad(out, args, grad_out)
    ref_grads = torch.autograd.grad(ref, ref_args, grad_out)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= TOL[torch.float64]


# --- writes to a scan input through an alias the op names do not list -------------------------

def _scan_after_write(write):
    def fn(u, delta, A, B, C, D, z):
        u = F.silu(u)
        write(u, delta, B)
        return mamba_core_reference(u, delta, A, B, C, D, z)
    return fn


ALIAS_WRITES = {
    "data": lambda u, delta, B: u.data.__setitem__((Ellipsis, slice(0, 1)), 0.5),
    "ravel": lambda u, delta, B: u.ravel()[:7].mul_(3),
    "moveaxis": lambda u, delta, B: u.moveaxis(1, 2)[:, 0].add_(1),
    "tensor_split": lambda u, delta, B: torch.tensor_split(u, 2, dim=2)[1].mul_(-1),
    "positive": lambda u, delta, B: B.positive().mul_(2),
    "ipow": lambda u, delta, B: operator.ipow(u.view(-1), 2),
}


@pytest.mark.parametrize("name", list(ALIAS_WRITES))
def test_a_write_through_any_alias_of_a_scan_input_keeps_the_loop(name):
    """The op would read u (or B) where the loop starts, after the write, if it saw the write:
    an alias the scan pass did not recognise (``.data``, ``ravel``, a split's piece, ``**=``)
    let it read the value before the write."""
    fn = _scan_after_write(ALIAS_WRITES[name])
    args = [a.detach() for a in core_inputs(torch.float32, requires_grad=False)]
    report = explain(fn, *[a.clone() for a in args])
    assert "scan_loop" not in report.counts, report.format(graphs=False)
    assert any("mutated in place" in m.reason for m in report.misses), report.format(graphs=False)
    assert rel_err(report.output, fn(*[a.double() for a in args])) <= TOL[torch.float32]
