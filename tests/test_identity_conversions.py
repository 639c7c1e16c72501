"""Conversions that return their own input (``h.float()`` on an fp32 h) are read through.

Before ``passes/casts.py``'s ``drop_identity_conversions``, a loop that converted its state at the
start of each step (``h = dA * h.double() + dBu`` in an fp64 program) was not rewritten: its state
update started at the conversion, and the last step, with no conversion after it, "did not repeat
step 0's state update". A conversion that changes the values (a rounding) or copies must stay,
and keep the loop's refusal.
"""
import pytest
import torch

from ssm_compile.compiler import backend
from ssm_compile.passes.casts import drop_identity_conversions
from ssm_compile.report import explain

BATCH, DIM, N, L = 2, 4, 3, 6


def inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(x.to(dtype) for x in (
        torch.randn(BATCH, DIM, L, generator=g, dtype=torch.float64),
        torch.rand(BATCH, DIM, L, generator=g, dtype=torch.float64) + 0.1,
        -torch.rand(DIM, N, generator=g, dtype=torch.float64) - 0.1,
        torch.randn(BATCH, N, L, generator=g, dtype=torch.float64),
        torch.randn(BATCH, N, L, generator=g, dtype=torch.float64)))


def loop(convert):
    def fn(u, delta, A, B, C):
        h = u.new_zeros(BATCH, DIM, N)
        ys = []
        for t in range(L):
            dA = torch.exp(delta[:, :, t, None] * A)
            dBu = delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
            h = dA * convert(h, u) + dBu
            ys.append((h * C[:, None, :, t]).sum(-1))
        return torch.stack(ys, -1)
    return fn


IDENTITIES = {
    "double": lambda h, u: h.double(),
    "to_dtype": lambda h, u: h.to(torch.float64),
    "to_dtype_of_input": lambda h, u: h.to(u.dtype),
    "type_as": lambda h, u: h.type_as(u),
    "contiguous": lambda h, u: h.contiguous(),
    "to_device": lambda h, u: h.to(u.device),
}


def compare(fn, args, rtol, atol):
    """Values and gradients under every pass (no inductor) against eager; the report of that compile."""
    eager_args = [a.clone().requires_grad_() for a in args]
    fast_args = [a.clone().requires_grad_() for a in args]
    ref = fn(*eager_args)
    report = explain(fn, *fast_args)
    out = report.output
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    weights = torch.randn_like(ref)
    (ref * weights).sum().backward()
    (out * weights).sum().backward()
    for name, e, f in zip("u delta A B C".split(), eager_args, fast_args):
        torch.testing.assert_close(f.grad, e.grad, rtol=rtol, atol=atol, msg=name)
    return report


@pytest.mark.parametrize("name", sorted(IDENTITIES))
def test_state_converted_to_its_own_dtype_each_step_is_rewritten(name):
    report = compare(loop(IDENTITIES[name]), inputs(torch.float64), rtol=1e-10, atol=1e-12)
    assert report.counts["scan_loop"] == 1 and report.counts["readout"] == 1, report.format(graphs=False)


@pytest.mark.parametrize("convert", [lambda h, u: h.bfloat16().float(), lambda h, u: h.half().to(torch.float32)],
                         ids=["bf16", "fp16"])
def test_state_rounded_each_step_stays_a_refusal(convert):
    # fp32 program: rounding the state to 16 bits every step is its function; the op's fp32
    # state would not round it. Without inductor the compiled graph runs the same kernels as eager.
    report = compare(loop(convert), inputs(torch.float32), rtol=0, atol=0)
    assert report.counts["scan_loop"] == 0, report.format(graphs=False)
    assert any(m.family == "scan_loop" and "the state is rounded at every step" in m.reason
               for m in report.misses), report.format(graphs=False)


def test_state_converted_to_a_narrower_input_dtype_stays_a_refusal():
    # An fp32 state converted to u's bf16 before each step is rounded, not converted to itself.
    def fn(u, delta, A, B, C):
        h = delta.new_zeros(BATCH, DIM, N)
        ys = []
        for t in range(L):
            dA = torch.exp(delta[:, :, t, None] * A)
            dBu = delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None].float()
            h = dA * h.to(u.dtype) + dBu
            ys.append((h * C[:, None, :, t]).sum(-1))
        return torch.stack(ys, -1)

    u, delta, A, B, C = inputs(torch.float32)
    report = compare(fn, (u.bfloat16(), delta, A, B, C), rtol=0, atol=0)
    assert report.counts["scan_loop"] == 0, report.format(graphs=False)


def _graph_of(fn, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=capture)(*args)
    return graphs[0]


def test_only_conversions_that_return_their_input_are_dropped():
    def fn(x, y):
        same = x.float() + x.to(torch.float32) + x.contiguous() + x.type_as(y)
        copies = x.to(torch.float32, copy=True) + x.t().contiguous().t() + x.double().float()
        return same, copies

    x, y = torch.randn(3, 3), torch.randn(3, 3)
    gm = _graph_of(fn, x, y)
    dropped = drop_identity_conversions(gm)
    gm.graph.lint()
    gm.recompile()
    kept = [n.target for n in gm.graph.nodes if n.op == "call_method"]
    assert len(dropped) == 4, dropped
    assert kept.count("contiguous") == 1 and kept.count("double") == 1, kept
    assert kept.count("to") == 1 and kept.count("float") == 1, kept  # copy=True, and the float of the double
    for r, o in zip(fn(x, y), gm(x, y)):
        torch.testing.assert_close(o, r, rtol=0, atol=0)


def test_conversions_of_memory_written_in_place_are_kept():
    # Dropping them would be exact too (the same tensor object), but the matchers' refusals of
    # in-place writes name the nodes the code wrote.
    def fn(x):
        a = x.float()
        a.mul_(2)
        return x.float() + 1

    gm = _graph_of(fn, torch.randn(3))
    assert drop_identity_conversions(gm) == []


def flat_state_loop(flatten, unflatten, return_state):
    def fn(u, delta, A, B, C):
        h = u.new_zeros(BATCH, DIM * N)
        ys = []
        for t in range(L):
            dA = torch.exp(delta[:, :, t, None] * A)
            dBu = delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
            hn = dA * unflatten(h) + dBu
            ys.append((hn * C[:, None, :, t]).sum(-1))
            h = flatten(hn)
        y = torch.stack(ys, -1)
        return (y, h) if return_state else y
    return fn


FLAT = {
    "view": (lambda h: h.view(BATCH, DIM * N), lambda h: h.view(BATCH, DIM, N)),
    "reshape": (lambda h: h.reshape(BATCH, -1), lambda h: h.reshape(BATCH, DIM, N)),
    "flatten_unflatten": (lambda h: h.flatten(1), lambda h: h.unflatten(1, (DIM, N))),
    "torch_functions": (lambda h: torch.flatten(h, 1), lambda h: torch.reshape(h, (BATCH, DIM, N))),
}


@pytest.mark.parametrize("return_state", [False, True], ids=["y", "y_and_state"])
@pytest.mark.parametrize("name", sorted(FLAT))
def test_state_kept_flat_between_steps_is_rewritten(name, return_state):
    fn = flat_state_loop(*FLAT[name], return_state)
    if return_state:
        def out(*args):
            y, h = fn(*args)
            return torch.cat([y.flatten(), h.flatten()])
    else:
        out = fn
    report = compare(out, inputs(torch.float64), rtol=1e-10, atol=1e-12)
    assert report.counts["scan_loop"] == 1, report.format(graphs=False)


def test_reshape_that_copies_is_not_read_through():
    # The state is kept (b, n, d) and flattened from a transposed view: the flat reshape copies,
    # and the round trip's result does not share x's memory. Values must still match.
    def fn(u, delta, A, B, C):
        h = u.new_zeros(BATCH, N * DIM)
        ys = []
        for t in range(L):
            dA = torch.exp(delta[:, :, t, None] * A)
            dBu = delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
            hn = dA * h.view(BATCH, N, DIM).transpose(1, 2) + dBu
            ys.append((hn * C[:, None, :, t]).sum(-1))
            h = hn.transpose(1, 2).reshape(BATCH, N * DIM)
        return torch.stack(ys, -1)

    compare(fn, inputs(torch.float64), rtol=1e-10, atol=1e-12)


def test_round_trip_is_an_exact_view_and_is_read_through_only_where_unobservable():
    from ssm_compile.passes.pieces import read_reshape_round_trips

    # The round trip shares x's memory element for element: a write through the flat view
    # changes both alike, so reading x gives the same values.
    def written(x):
        flat = x.view(-1)
        back = flat.view(x.shape)
        flat.mul_(2)
        return back + 1

    x = torch.randn(2, 3)
    gm = _graph_of(written, x.clone())
    assert len(read_reshape_round_trips(gm)) == 1
    gm.graph.lint()
    gm.recompile()
    torch.testing.assert_close(gm(x.clone())[0], written(x.clone()), rtol=0, atol=0)

    # Returned, the round trip would hand the caller x's tensor object itself.
    def returned(x):
        return x.reshape(-1).view(2, 3)

    assert read_reshape_round_trips(_graph_of(returned, x)) == []


PIECES = {
    "reshape round trip": lambda x: x.view(-1).view(3, 3),
    "whole split piece": lambda x: torch.split(x, [3])[0],
    "whole tensor_split piece": lambda x: torch.tensor_split(x, [3], 1)[0],
}


@pytest.mark.parametrize("name", sorted(PIECES))
def test_view_read_as_its_source_sees_a_transpose_through_an_alias(name):
    """x.add_(0) returns x itself as another node; a t_() through it transposes x and not the
    view taken before. The view was read as x, whose end-of-trace metadata (restored by a second
    t_()) matched: the product read a transposed x, up to 25 off eager (probe BM, run 54)."""
    piece = PIECES[name]
    m = torch.arange(9.0, dtype=torch.float64).view(3, 3)

    def fn(x):
        x = x * 1
        z = piece(x)
        xa = x.add_(0)
        xa.t_()
        r = z @ m
        xa.t_()
        return r

    x = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend(inductor=False))(x.clone())
    torch.testing.assert_close(out, fn(x.clone()), rtol=0, atol=0)
