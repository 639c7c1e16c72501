"""Decode steps whose state is a view of a stacked cache (``cache[layer]`` of a (layers, batch,
dim, N) tensor), compiled with ``backend="ssm"`` as the batch size changes.

Inductor (torch 2.13) gets a mutating custom op's write wrong when the written tensor is a view
with a storage offset and the shapes are dynamic (and the write to a clone of such a view even
with static shapes): the op read and wrote ``cache[0]`` instead of ``cache[1]``. A hand-written
decode loop over a stacked cache hits that as soon as a second batch size makes dynamo mark the
batch dynamic. The passes therefore write a state in place only when it is a graph input itself;
a view gets the op's functional twin and a ``copy_`` into it. Every case is compared with eager,
outputs and caches, over three batch sizes (the second and third recompile with a dynamic batch).
"""
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import ssm_compile
from ssm_compile.kernels.decode import op as decode_op

LAYERS, DIM, N, W = 3, 6, 4, 4
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


@pytest.fixture(scope="module", autouse=True)
def registered():
    decode_op.register()


def _params():
    g = torch.Generator().manual_seed(0)
    return dict(A=-torch.rand(DIM, N, generator=g) - 0.1, D=torch.randn(DIM, generator=g),
                w=torch.randn(DIM, 1, W, generator=g), b=torch.randn(DIM, generator=g))


P = _params()


def ssm_step_in_place(cache, i: int, x, dt, B, C):
    h = cache[i]
    dt = F.softplus(dt)
    h.mul_(torch.exp(dt[..., None] * P["A"])).add_(dt[..., None] * x[..., None] * B[:, None, :])
    return (h * C[:, None, :]).sum(-1) + P["D"] * x


def ssm_step_copy(cache, i: int, x, dt, B, C):
    state = cache[i]
    dt = F.softplus(dt)
    h = state * torch.exp(dt[..., None] * P["A"]) + dt[..., None] * x[..., None] * B[:, None, :]
    state.copy_(h)
    return (h * C[:, None, :]).sum(-1) + P["D"] * x


def conv_step_roll(conv_cache, i: int, x):
    s = conv_cache[i]
    s.copy_(torch.roll(s, shifts=-1, dims=-1))
    s[:, :, -1] = x
    return F.silu((s * P["w"][:, 0]).sum(-1) + P["b"])


def _inputs(fn, batch, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if fn is conv_step_roll:
        args = [torch.randn(LAYERS, batch, DIM, W, generator=g), 1, torch.randn(batch, DIM, generator=g)]
    else:
        args = [torch.randn(LAYERS, batch, DIM, N, generator=g), 1,
                *(torch.randn(batch, DIM, generator=g) for _ in "xd"), *(torch.randn(batch, N, generator=g) for _ in "BC")]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


# On CUDA the mutating ops are launched from inductor's code (kernels/inline.py): that path gets
# the same views.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (CPU counterpart: the cpu case)"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn,family", [(ssm_step_in_place, "state_update"), (ssm_step_copy, "state_update"),
                                       (conv_step_roll, "conv_update")],
                         ids=["state-in-place", "state-copy_", "conv-roll"])
def test_step_on_a_stacked_cache_matches_eager_as_the_batch_changes(fn, family, device):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="ssm")
    params = {k: v.to(device) for k, v in P.items()}
    saved = dict(P)
    P.update(params)
    try:
        _run_batches(fn, compiled, device)
    finally:
        P.update(saved)
    # Both compilations (static, then dynamic batch) rewrote the step.
    assert counters["ssm"][family] == 2


def _run_batches(fn, compiled, device):
    for step, batch in enumerate((2, 3, 5)):
        args = _inputs(fn, batch, step, device)
        ref_args, got_args = _clone(args), _clone(args)
        ref = fn(*ref_args)
        got = compiled(*got_args)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        # The whole stacked cache: the written layer, and the others untouched.
        torch.testing.assert_close(got_args[0], ref_args[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got_args[0][0], args[0][0]) and torch.equal(got_args[0][2], args[0][2])


@pytest.mark.parametrize("fn", [ssm_step_in_place, conv_step_roll], ids=["state", "conv"])
def test_view_state_gets_the_functional_op_and_a_copy_back(fn):
    report = ssm_compile.explain(fn, *_inputs(fn, 2, 0))
    (rewrite,) = report.rewrites
    assert rewrite.decision["writes"] == "new state, copied"
    text = str(report)
    name = "selective_state_update" if fn is ssm_step_in_place else "causal_conv1d_update"
    assert f"ssm.{name}_functional" in text and "copy_" in text.split("-- graph after --")[1]


def test_graph_input_state_is_still_written_in_place():
    """A state that is a graph input itself (a cache with one tensor per layer, as HF's) keeps the
    mutating op: where it is inlined (CUDA, static sizes) its kernel writes the state, with no
    extra copy per step."""

    def step(state, x, dt, B, C):
        dt = F.softplus(dt)
        state.mul_(torch.exp(dt[..., None] * P["A"])).add_(dt[..., None] * x[..., None] * B[:, None, :])
        return (state * C[:, None, :]).sum(-1) + P["D"] * x

    args = _inputs(ssm_step_in_place, 2, 0)
    args = [args[0][1].clone(), *args[2:]]
    report = ssm_compile.explain(step, *args)
    (rewrite,) = report.rewrites
    assert rewrite.decision["writes"] == "state"
    assert "_functional" not in str(report)


def test_opcheck_functional_twins():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    for softplus, full in itertools.product((True, False), (True, False)):
        opt = (r(DIM), r(2, DIM), r(DIM)) if full else (None, None, None)
        args = (r(2, DIM, N), r(2, DIM), r(2, DIM), P["A"], r(2, N), r(2, N), *opt, softplus)
        torch.library.opcheck(torch.ops.ssm.selective_state_update_functional.default, args)
    for x_shape, act in (((2, DIM), "silu"), ((2, DIM, 3), None)):
        args = (r(*x_shape), r(2, DIM, W), r(DIM, W), r(DIM), act)
        torch.library.opcheck(torch.ops.ssm.causal_conv1d_update_functional.default, args)


def test_functional_twins_equal_the_in_place_ops_and_leave_their_state():
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    state = r(2, DIM, N)
    args = (r(2, DIM), r(2, DIM), P["A"], r(2, 2, N), r(2, 2, N), r(DIM), r(2, DIM), r(DIM), True)
    before = state.clone()
    y_f, new = torch.ops.ssm.selective_state_update_functional(state, *args)
    assert torch.equal(state, before)
    y = torch.ops.ssm.selective_state_update(state, *args)
    assert torch.equal(y_f, y) and torch.equal(new, state)
    conv_state, x = r(2, DIM, W), r(2, DIM)
    before = conv_state.clone()
    y_f, new = torch.ops.ssm.causal_conv1d_update_functional(x, conv_state, P["w"][:, 0], P["b"], "silu")
    assert torch.equal(conv_state, before)
    y = torch.ops.ssm.causal_conv1d_update(x, conv_state, P["w"][:, 0], P["b"], "silu")
    assert torch.equal(y_f, y) and torch.equal(new, conv_state)


def test_functional_twins_refuse_bad_input_by_name():
    with pytest.raises(ValueError, match="x must have shape"):
        torch.ops.ssm.selective_state_update_functional(torch.randn(2, DIM, N), torch.randn(3, DIM), torch.randn(2, DIM),
                                                        P["A"], torch.randn(2, N), torch.randn(2, N))
    with pytest.raises(ValueError, match="conv_state must"):
        torch.ops.ssm.causal_conv1d_update_functional(torch.randn(2, DIM), torch.randn(2, DIM), torch.randn(DIM, W))


def test_step_read_between_its_writes_on_a_layer_is_left_alone_with_a_reason():
    """state.mul_(dA); state.sum(-1); state.add_(dBx) on cache[1]: the middle read sees the decayed
    state only, which one op call cannot give; explain says so (it said nothing before)."""

    def step(cache, i: int, x, dt, B, C):
        h = cache[i]
        dt = F.softplus(dt)
        h.mul_(torch.exp(dt[..., None] * P["A"]))
        mid = h.sum(-1)
        h.add_(dt[..., None] * x[..., None] * B[:, None, :])
        return (h * C[:, None, :]).sum(-1) + P["D"] * x, mid

    args = _inputs(ssm_step_in_place, 2, 0)
    ref_args = _clone(args)
    ref = step(*ref_args)
    report = ssm_compile.explain(step, *_clone(args))
    assert not report.rewrites
    assert any("multiplied in place by a decay" in m.reason for m in report.misses), report.format(graphs=False)
    for got, want in zip(report.output, ref):
        assert torch.equal(got, want)


def test_layer_indexed_twice_is_left_alone_with_a_reason():
    """h = cache[i] * dA + dBx; cache[i].copy_(h): two getitem nodes for one layer. Not matched
    (the proof follows one state node), and explain says how to write it (it said nothing before)."""

    def step(cache, i: int, x, dt, B, C):
        dt = F.softplus(dt)
        h = cache[i] * torch.exp(dt[..., None] * P["A"]) + dt[..., None] * x[..., None] * B[:, None, :]
        cache[i].copy_(h)
        return (h * C[:, None, :]).sum(-1) + P["D"] * x

    args = _inputs(ssm_step_in_place, 2, 0)
    ref_args, got_args = _clone(args), _clone(args)
    ref = step(*ref_args)
    report = ssm_compile.explain(step, *got_args)
    assert not report.rewrites
    assert any("another view equal to it" in m.reason for m in report.misses), report.format(graphs=False)
    assert torch.equal(report.output, ref)


def ssm_step_returned(state, x, dt, B, C):
    dt = F.softplus(dt)
    new = state * torch.exp(dt[..., None] * P["A"]) + dt[..., None] * x[..., None] * B[:, None, :]
    return (new * C[:, None, :]).sum(-1) + P["D"] * x, new


def test_step_returning_its_state_of_a_layer_passed_in_matches_eager():
    """The caller passes cache[1] as the state and the step returns the new state. The op used to
    update a clone of it in place, and inductor misplaced that write for a view with an offset:
    4.0 off eager at the first call, with static shapes (run 42). It now gets the functional twin."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(ssm_step_returned, backend="ssm")
    for step, batch in enumerate((2, 3, 5)):
        cache, _, *rest = _inputs(ssm_step_in_place, batch, step)
        ref_cache, got_cache = cache.clone(), cache.clone()
        ref = ssm_step_returned(ref_cache[1], *rest)
        got = compiled(got_cache[1], *rest)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
        assert torch.equal(got_cache, cache) and torch.equal(ref_cache, cache)
    assert counters["ssm"]["state_update"] == 2


def _direct_state_update(layer):
    def step(cache, x, dt, B, C):
        return torch.ops.ssm.selective_state_update(layer(cache), x, dt, P["A"], B, C, P["D"], None, None, True)
    return step


def _direct_conv_update(layer):
    def step(cache, x):
        return torch.ops.ssm.causal_conv1d_update(x, layer(cache), P["w"][:, 0], P["b"], "silu")
    return step


LAYER_OF = {"cache[1]": lambda c: c[1], "cache[1].clone()": lambda c: c[1].clone(),
            "zeros_like(cache[1]) + cache[1]": lambda c: torch.zeros_like(c[1]) + c[1]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("layer", LAYER_OF.values(), ids=LAYER_OF.keys())
@pytest.mark.parametrize("make,conv", [(_direct_state_update, False), (_direct_conv_update, True)],
                         ids=["state_update", "conv_update"])
def test_mutating_op_called_on_a_cache_layer_under_inductor_matches_eager(make, conv, layer, dynamic, device):
    """The ops called by the user's own code, compiled by plain inductor (probe BG, run 53). Kept
    whole, a mutating op became ``auto_functionalized``, for which inductor (torch 2.13) read
    ``cache[0]`` where the code named ``cache[1]`` (symbolic sizes), or the clone of it (static
    too): y up to ~3 off eager, and the other layers written. The op is now traced as its
    functional twin and a copy back wherever it is not inlined. Inlined (CUDA, static sizes), its
    launch wrote the state in place, and inductor (torch 2.11) generated the clone that
    functionalization made of a state computed from the offset view as a copy from offset 0
    (run 54): the launch now writes a fresh buffer that becomes the state. Caches off: an
    artifact compiled before the fix would hide it."""
    fn = make(layer)
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(LAYERS, 2, DIM, W if conv else N, generator=g)
    rest = [torch.randn(2, DIM, generator=g)] if conv else [
        *(torch.randn(2, DIM, generator=g) for _ in "xd"), *(torch.randn(2, N, generator=g) for _ in "BC")]
    cache, rest = cache.to(device), [r.to(device) for r in rest]
    saved = dict(P)
    P.update({k: v.to(device) for k, v in P.items()})
    try:
        ref_cache, got_cache = cache.clone(), cache.clone()
        ref = fn(ref_cache, *rest)
        torch._dynamo.reset()
        with torch._inductor.config.patch(force_disable_caches=True):
            got = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=dynamic)(got_cache, *rest)
    finally:
        P.update(saved)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_cache, ref_cache)
