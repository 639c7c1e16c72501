"""Output layouts of the ssm ops, and the backend's layout check after its rewrites.

The ops return their activations in their main input's layout (``kernels/layout.py``), so a
channel-innermost activation (how nn.Linear-based Mamba code holds them) reaches the next
nn.Linear without a copy. That can differ from the layout the replaced user code had; the
layout check (``passes/layout.py``) mends the two places where user code sees strides, a
``.view`` and the graph's outputs, or compiles the graph without rewrites when it cannot.
"""
import functools
import logging
import operator

import pytest
import torch
from torch._dynamo.utils import counters
from utils import TOL, TRITON_DEVICE, in_layout_of, rel_err

import ssm_compile
from ssm_compile.kernels import register_ops
from ssm_compile.kernels.causal_conv1d import triton_conv
from ssm_compile.kernels.selective_scan import triton_fwd


@pytest.fixture(scope="module", autouse=True)
def _ops():
    register_ops()


def _channel_innermost(t):
    """The same values as ``t`` (batch, dim, L), stored as (batch, L, dim)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def scan_inputs(batch=2, dim=6, L=21, N=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(batch, dim, L, generator=g).to(dtype)
    delta = (torch.randn(batch, dim, L, generator=g) * 0.5 - 1).to(dtype)
    A = -(torch.rand(dim, N, generator=g) + 0.1)
    B = torch.randn(batch, N, L, generator=g).to(dtype)
    C = torch.randn(batch, N, L, generator=g).to(dtype)
    D = torch.randn(dim, generator=g)
    z = torch.randn(batch, dim, L, generator=g).to(dtype)
    bias = torch.randn(dim, generator=g) * 0.1
    return u, delta, A, B, C, D, z, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["cpu-op", "triton"])
def test_scan_output_follows_u(path, dtype):
    u, delta, A, B, C, D, z, bias = scan_inputs(dtype=dtype)
    if path == "triton":
        dev = [t.to(TRITON_DEVICE) for t in (u, delta, A, B, C, D, z, bias)]

        def run(u_):
            return triton_fwd.selective_scan_fwd(u_, dev[1], dev[2], dev[3].unsqueeze(1), dev[4].unsqueeze(1),
                                                 dev[5], dev[6], dev[7], True, None, False)[0]
        u = dev[0]
    else:
        def run(u_):
            return torch.ops.ssm.selective_scan(u_, delta, A, B, C, D, z, bias, True, None, False)[0]
    y_dense = run(u)
    y_ci = run(_channel_innermost(u))
    assert in_layout_of(y_dense, u) and y_dense.is_contiguous()
    assert in_layout_of(y_ci, _channel_innermost(u)) and not y_ci.is_contiguous()
    torch.testing.assert_close(y_ci, y_dense, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["cpu-op", "triton"])
def test_conv_output_and_dx_follow_x(path):
    g = torch.Generator().manual_seed(1)
    # An nn.Linear output split along channels, as HF Mamba's conv input: channel-innermost and
    # not dense (the other half of the channels sits between rows).
    xz = torch.randn(2, 13, 12, generator=g)
    x = xz.transpose(1, 2)[:, :6]
    w, b = torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    if path == "triton":
        x, w, b = x.to(TRITON_DEVICE), w.to(TRITON_DEVICE), b.to(TRITON_DEVICE)
        y = triton_conv.causal_conv1d_fwd(x, w, b, None, True)
        dx = triton_conv.causal_conv1d_bwd(torch.randn_like(y), x, w, b, None, True).dx
        y_dense = triton_conv.causal_conv1d_fwd(x.contiguous(), w, b, None, True)
    else:
        xr = x.clone().requires_grad_()
        xr_view = xr  # the op sees xr's strides
        y = torch.ops.ssm.causal_conv1d(xr_view, w, b, "silu")
        (dx,) = torch.autograd.grad(y, xr, torch.randn_like(y))
        y_dense = torch.ops.ssm.causal_conv1d(x.contiguous(), w, b, "silu")
    assert not x.is_contiguous() and x.stride(1) == 1
    assert y.transpose(1, 2).is_contiguous() and dx.transpose(1, 2).is_contiguous()
    assert rel_err(y, y_dense) < TOL[torch.float32]


def test_opcheck_channel_innermost():
    """Fake and real kernels agree on strides for channel-innermost inputs (forward and backward)."""
    u, delta, A, B, C, D, z, bias = scan_inputs(L=9)
    ci = [_channel_innermost(t) for t in (u, delta, z)]
    torch.library.opcheck(torch.ops.ssm.selective_scan.default,
                          (ci[0].requires_grad_(), ci[1], A, B, C, D, ci[2], bias, True, None, True))
    x = _channel_innermost(torch.randn(2, 6, 9)).requires_grad_()
    torch.library.opcheck(torch.ops.ssm.causal_conv1d.default, (x, torch.randn(6, 4), torch.randn(6), "silu"))


# -- the backend's layout check ------------------------------------------------------------

def loop_scan(u, delta, A, B, C, view_out=True, write=False, unrelated_write=False):
    """A selective scan in (batch, dim, L) that stacks its outputs along dim 1, so eager's y is
    (batch, L, dim)-contiguous while the op's is (batch, dim, L)-contiguous."""
    b, d, l = u.shape
    dA = torch.exp(torch.einsum("bdl,dn->bldn", delta, A))
    dBu = torch.einsum("bdl,bnl,bdl->bldn", delta, B, u)
    h = torch.zeros(b, d, A.shape[1])
    ys = []
    for i in range(l):
        h = dA[:, i] * h + dBu[:, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]))
    y = torch.stack(ys, dim=1)
    if write:
        # A write through the view: eager's y changes with it, a copy's would not.
        v = y.view(b * l, d)
        v.mul_(3.0)
        return v, y
    if unrelated_write:
        # A write to memory of its own: it cannot tell a copy from a view, so it changes nothing.
        scratch = torch.ones(2)
        scratch.mul_(3.0)
    out = y.view(b * l, d) * 2 if view_out else y * 2
    return out, y


def _loop_args():
    u, delta, A, B, C, *_ = scan_inputs(L=12)
    return u, delta.sigmoid(), A, B, C


@pytest.mark.parametrize("unrelated_write", [False, True], ids=["pure", "unrelated-write"])
@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_view_after_rewrite_is_mended(inductor, unrelated_write):
    args = _loop_args()
    ref = loop_scan(*args, unrelated_write=unrelated_write)
    torch._dynamo.reset()
    counters.clear()
    fn = functools.partial(loop_scan, unrelated_write=unrelated_write)
    out = torch.compile(fn, backend=ssm_compile.backend(inductor=inductor))(*args)
    assert counters["ssm"]["scan_loop"] == 1
    for o, r in zip(out, ref):
        assert rel_err(o, r.double()) < TOL[torch.float32]
        # The caller sees eager's strides on every output (y included).
        assert o.stride() == r.stride()


def test_returned_y_keeps_eager_strides():
    args = _loop_args()
    ref = loop_scan(*args, view_out=False)
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(lambda *a: loop_scan(*a, view_out=False), backend=ssm_compile.backend(inductor=False))(*args)
    assert counters["ssm"]["scan_loop"] == 1
    assert out[1].stride() == ref[1].stride() == (12 * 6, 6, 1)
    assert out[1].view(-1, 6).shape == (24, 6)  # what a caller relying on eager's layout does


def test_view_with_in_place_write_falls_back():
    args = _loop_args()
    ref = loop_scan(*[a.clone() for a in args], write=True)
    report = ssm_compile.explain(lambda *a: loop_scan(*a, write=True), *[a.clone() for a in args])
    assert report.rewrites == [] or all(r.family != "scan_loop" for r in report.rewrites)
    reasons = " ".join(m.reason for m in report.misses)
    assert ("writes in place" in reasons or "returned" in reasons) and "without ssm rewrites" in reasons
    torch._dynamo.reset()
    out = torch.compile(lambda *a: loop_scan(*a, write=True), backend="ssm")(*[a.clone() for a in args])
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)


# -- HF's Δ product and the casts around the op's output -----------------------------------

def op_block(u, ts, W, bias, A, B, C, D, z, write=False, return_down=False):
    """The scan op between HF Mamba's neighbours, in bf16: Δ = dt_proj.weight @ time_step.mT
    (+ bias, softplus), and an fp32 detour on y that the bf16 consumer undoes."""
    dt = torch.nn.functional.softplus(W @ ts.transpose(1, 2) + bias.to(ts.dtype)[..., None])
    y = torch.ops.ssm.selective_scan(u, dt, A, B, C, D, z, None, False, None, False)[0]
    up = y.float()
    if write:
        up.mul_(3.0)  # the down-cast reads the written value: folding would drop the write
    down = up.transpose(1, 2).to(u.dtype)
    return down if return_down else down * 2


def _block_args(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(3)
    b, d, l, n, r = 2, 8, 10, 4, 3
    return (torch.randn(b, d, l, generator=g).to(dtype), torch.randn(b, l, r, generator=g).to(dtype),
            (torch.randn(d, r, generator=g) * 0.5).to(dtype), torch.randn(d, generator=g).to(dtype),
            -(torch.rand(d, n, generator=g) + 0.1), torch.randn(b, n, l, generator=g).to(dtype),
            torch.randn(b, n, l, generator=g).to(dtype), torch.randn(d, generator=g),
            torch.randn(b, d, l, generator=g).to(dtype))


def _after(fn, args):
    report = ssm_compile.explain(fn, *args)
    return report, "\n".join(g.after for g in report.graphs)


def test_delta_product_becomes_a_linear():
    args = _block_args()
    report, after = _after(op_block, args)
    assert report.counts["delta"] == 1
    assert "linear" in after and "matmul" not in after
    eager = op_block(*args)
    torch._dynamo.reset()
    out = torch.compile(op_block, backend="ssm")(*args)
    assert out.dtype == torch.bfloat16 and rel_err(out, eager.double()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("variant", ["plain", "write", "returned"])
def test_round_trip_cast_is_folded_only_when_unobservable(variant):
    args = _block_args()
    fn = {"plain": op_block,
          "write": lambda *a: op_block(*a, write=True),
          "returned": lambda *a: op_block(*a, return_down=True)}[variant]
    report, after = _after(fn, args)
    assert report.counts["delta"] == 1
    # "plain": y reaches the transpose and the bf16 consumer without the fp32 trip. With an
    # in-place write in the graph, or the down-cast returned, the trip stays.
    assert (".float()" in after) == (variant != "plain"), after
    eager = fn(*args)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(*args)
    assert out.dtype == eager.dtype and rel_err(out, eager.double()) < TOL[torch.bfloat16]


def _cache_states(cache) -> list[torch.Tensor]:
    # transformers 5.2x: one layer object per block, states keyed by index; use whatever is there.
    out = []
    for layer in cache.layers:
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name)
            out += list(states.values()) if isinstance(states, dict) else [states]
    return out


def test_hf_bf16_prefill_keeps_cache_writes():
    """HF Mamba in bf16 with a cache: the cast fold runs in a graph that writes the conv and
    recurrent states in place (``conv_state.copy_(x[..., -W+1:])``), and the clean-up after it
    must keep those writes, whose results nothing in the graph reads."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    cfg = MambaConfig(vocab_size=100, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
    model = MambaForCausalLM(cfg).eval().to(torch.bfloat16)
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        eager = model(ids, use_cache=True)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="ssm")(ids, use_cache=True)
    assert counters["ssm"]["selective_scan"] + counters["ssm"]["scan_assoc"] + counters["ssm"]["scan_loop"] >= 2
    assert rel_err(compiled.logits, eager.logits.double()) < TOL[torch.bfloat16]
    want, got = _cache_states(eager.cache_params), _cache_states(compiled.cache_params)
    assert len(want) == len(got) == 4
    for w, g in zip(want, got):
        assert w.abs().sum() > 0 and rel_err(g, w.double()) < TOL[torch.bfloat16]


def test_view_inside_checkpointed_layer_is_mended():
    """The layout check runs in checkpointed subgraphs too, where a rewritten layer's ``.view``
    would otherwise fail AOTAutograd's trace."""
    args = [a.clone().requires_grad_(i < 2) for i, a in enumerate(_loop_args())]

    def layer(*a):
        return torch.utils.checkpoint.checkpoint(loop_scan, *a, use_reentrant=False)

    ref = layer(*args)
    ref_grads = torch.autograd.grad(ref[0].sum(), args[:2])
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(layer, backend="ssm")(*args)
    assert counters["ssm"]["scan_loop"] == 1
    grads = torch.autograd.grad(out[0].sum(), args[:2])
    for o, r in zip(list(out) + list(grads), list(ref) + list(ref_grads)):
        assert rel_err(o, r.double()) < TOL[torch.float32]


def test_compile_failure_of_rewritten_graph_falls_back(caplog, monkeypatch):
    """Whatever the layout check misses: if the rewritten graph fails to compile, the backend
    compiles dynamo's graph instead of failing a program that runs eagerly."""
    import torch._inductor.compile_fx as compile_fx_module

    real = compile_fx_module.compile_fx
    calls = []

    def fails_rewritten(gm, *a, **k):
        # Fail every compile of a graph holding an ssm op, as inductor might: the rewritten graph
        # (the scan's launches inlined, then, on the backend's retry, the op whole); dynamo's
        # own graph then compiles.
        calls.append(1)
        if any(str(n.target).startswith("ssm.") for n in gm.graph.nodes):
            raise RuntimeError("inductor failed on purpose")
        return real(gm, *a, **k)

    monkeypatch.setattr(compile_fx_module, "compile_fx", fails_rewritten)
    args = _loop_args()
    ref = loop_scan(*args)
    torch._dynamo.reset()
    counters.clear()
    with caplog.at_level(logging.WARNING, logger="ssm_compile"):
        out = torch.compile(loop_scan, backend="ssm")(*args)
    assert len(calls) >= 3 and "compiling the rewritten graph raised" in caplog.text
    assert "retrying with the ops whole" in caplog.text  # the scan's launches were inlined first
    assert counters["ssm"]["scan_loop"] == 0
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)


def test_rewritten_graph_that_does_not_run_falls_back(caplog):
    """A rewrite that leaves a graph that no longer runs on fake tensors: the layout check
    says so and the backend compiles dynamo's graph."""
    from ssm_compile.compiler import SSMBackend
    from ssm_compile.config import SSMOptions

    class Broken(SSMBackend):
        # A "rewrite" whose op call cannot trace (B has the wrong length): AOTAutograd raises.
        def pass_manager(self):
            pm = super().pass_manager()

            def bad(gm, ctx):
                node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.sin)
                x = node.args[0]
                with gm.graph.inserting_before(node):
                    call = gm.graph.call_function(torch.ops.ssm.selective_scan.default, (x, x, x, x, x))
                    first = gm.graph.call_function(operator.getitem, (call, 0))
                node.replace_all_uses_with(first)
                gm.graph.erase_node(node)
                gm.recompile()
                ctx.rewrite("scan_loop", "broken on purpose", [], "ssm.selective_scan", {})

            pm.add("broken", bad)
            return pm

    def fn(x):
        return torch.sin(x) * 2

    x = torch.randn(2, 3, 5)
    torch._dynamo.reset()
    counters.clear()
    with caplog.at_level(logging.WARNING, logger="ssm_compile"):
        out = torch.compile(fn, backend=Broken(SSMOptions()))(x)
    torch.testing.assert_close(out, fn(x))
    assert counters["ssm"]["scan_loop"] == 0
    assert "does not run on fake tensors" in caplog.text


# -- what the layout check must also get right (found in review) ---------------------------

@pytest.mark.parametrize("length", [12, 9])
def test_dynamic_shapes_keep_eager_output_layout(length):
    u, delta, A, B, C, *_ = scan_inputs(L=length)
    args = (u, delta.sigmoid(), A, B, C)

    def fn(*a):
        return loop_scan(*a, view_out=False)

    ref = fn(*args)
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend="ssm", dynamic=True)(*args)
    assert counters["ssm"]["scan_loop"] == 1
    assert out[1].stride() == ref[1].stride()
    assert out[1].view(-1, 6).shape == (2 * length, 6)
    assert rel_err(out[1], ref[1].double()) < TOL[torch.float32]


def test_autocast_region_survives_a_fallback():
    """A view that cannot be mended inside an autocast region: the graph falls back, and the
    fake run that found it must not leave autocast switched on for the compile after it."""
    def fn(u, delta, A, B, C):
        b, d, l = u.shape
        _, y = loop_scan(u, delta, A, B, C, view_out=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            v = y.view(b * l, d)
            v.mul_(3.0)
        return v, y

    args = _loop_args()
    ref = fn(*[a.clone() for a in args])
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend="ssm")(*[a.clone() for a in args])
    assert not torch.is_autocast_enabled("cpu")
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype == torch.float32 and rel_err(o, r.double()) < TOL[torch.float32]


def test_outputs_that_alias_keep_aliasing():
    """(y, y.mT) share memory in eager; restoring one output's layout by a copy would split
    them, so the graph falls back rather than return two unrelated tensors."""
    def fn(*a):
        _, y = loop_scan(*a, view_out=False)
        return y, y.transpose(1, 2)

    args = _loop_args()
    ref = fn(*args)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(*args)
    for o, r in zip(out, ref):
        assert o.stride() == r.stride() and rel_err(o, r.double()) < TOL[torch.float32]
    before = out[1].clone()
    out[0].mul_(2.0)
    assert torch.equal(out[1], before * 2.0)


def test_cast_fold_never_returns_an_alias_of_an_input():
    def fn(*a):
        c = a[0].float().to(torch.bfloat16)  # new memory in eager
        return op_block(*a), c.transpose(1, 2)

    args = _block_args()
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(*args)
    assert out[1].untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr()
    torch.testing.assert_close(out[1], args[0].transpose(1, 2))


def test_delta_product_with_another_user_stays_a_matmul():
    """The linear form only pays when the product feeds Δ alone; otherwise it would be a
    second GEMM next to the matmul the other user still needs."""
    def fn(u, ts, W, bias, A, B, C, D, z):
        pre = W @ ts.transpose(1, 2)
        dt = torch.nn.functional.softplus(pre + bias.to(ts.dtype)[..., None])
        y = torch.ops.ssm.selective_scan(u, dt, A, B, C, D, z, None, False, None, False)[0]
        return y, pre.sum()

    args = _block_args()
    report, after = _after(fn, args)
    assert report.counts["delta"] == 1
    assert "linear" not in after and after.count(" @ ") + after.count("matmul") == 1, after


# --- random draws over a rewritten value --------------------------------------------------------

def _conv_then(draw):
    """A conv block whose (transposed back) conv output feeds a random op: eager's conv output is
    (batch, L, dim)-contiguous after the transpose, the op's (batch, dim, L) one is not."""
    conv = torch.nn.Conv1d(8, 8, 4, groups=8, padding=3)

    def fn(x):
        xs = torch.nn.functional.silu(conv(x.transpose(1, 2))[..., :x.shape[1]]).transpose(1, 2)
        return draw(xs) * 2.0

    return fn


def _seeded_runs(fn, x):
    """(eager's output, the rewritten graph's output run eagerly), each after the same seed."""
    torch.manual_seed(7)
    expected = fn(x)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(7)
    return expected, torch.compile(fn, backend=ssm_compile.backend(inductor=False))(x)


DRAWS = {
    "dropout": lambda xs: torch.nn.functional.dropout(xs, 0.3, True),
    "rand_like": lambda xs: xs + torch.rand_like(xs),
    "bernoulli": lambda xs: xs * torch.bernoulli(torch.full_like(xs, 0.7)),
    "dropout-of-a-sum": lambda xs: torch.nn.functional.dropout(xs + 1.0, 0.3, True),
    # A strided slice is not dense: the mask is laid out densely in the order of its strides.
    "rand_like-of-a-slice": lambda xs: xs[:, ::2] + torch.rand_like(xs[:, ::2]),
}


@pytest.mark.parametrize("draw", DRAWS)
def test_random_draw_over_an_op_output_takes_eagers_numbers(draw):
    # The same seed must give the same draws: a mask filled in another memory order puts the
    # same numbers on other elements (0.27 off eager before the draw's input got eager's order).
    x = torch.randn(2, 10, 8, requires_grad=True)
    expected, out = _seeded_runs(_conv_then(DRAWS[draw]), x)
    (g_expected,) = torch.autograd.grad(expected.sum(), x)
    (g_out,) = torch.autograd.grad(out.sum(), x)
    assert counters["ssm"]["conv1d"] == 1
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_out, g_expected, rtol=1e-5, atol=1e-6)


def _uniform_in_place(xs):
    t = xs.detach() * 1.0
    t.uniform_()
    return t + xs


def _dropout_in_place_then_read(xs):
    t = xs * 1.0
    torch.nn.functional.dropout(t, 0.3, True, inplace=True)
    return t + xs


def _dropout_in_place_on_the_op_output(xs):
    torch.nn.functional.dropout(xs, 0.3, True, inplace=True)
    return xs * 2.0


def _draw_then_a_write_to_the_op_output(xs):
    # The restore's own copy is no view eager had: the write must not make the rewrite unsafe.
    y = torch.nn.functional.dropout(xs, 0.3, True)
    xs.detach().clamp_(max=0.5)
    return y + xs


IN_PLACE_DRAWS = {"uniform_": _uniform_in_place, "dropout-inplace": _dropout_in_place_then_read,
                  "dropout-inplace-on-the-op-output": _dropout_in_place_on_the_op_output,
                  "draw-then-a-write": _draw_then_a_write_to_the_op_output}


@pytest.mark.parametrize("draw", IN_PLACE_DRAWS)
def test_in_place_draw_over_an_op_output_still_writes_its_tensor(draw):
    # The draw fills a copy in eager's order, which is written back: the tensor the user's code
    # reads afterwards holds the drawn numbers (before, the copy took them and t kept its own).
    expected, out = _seeded_runs(_conv_then(IN_PLACE_DRAWS[draw]), torch.randn(2, 10, 8, requires_grad=True))
    assert counters["ssm"]["conv1d"] == 1
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("draw", ["dropout1d", "eval-dropout"])
def test_a_draw_that_ignores_its_inputs_layout_gets_no_copy(caplog, draw):
    # dropout1d draws one number per (batch, channel) into its own tensor, and a dropout in eval
    # mode draws nothing: nothing to restore, and an inference graph pays no copy.
    fn = _conv_then({
        "dropout1d": lambda xs: torch.nn.functional.dropout1d(xs.transpose(1, 2), 0.3, True).transpose(1, 2),
        "eval-dropout": lambda xs: torch.nn.functional.dropout(xs, 0.3, False),
    }[draw])
    with caplog.at_level(logging.INFO, logger="ssm_compile"):
        expected, out = _seeded_runs(fn, torch.randn(2, 10, 8))
    assert "draws random numbers over" not in caplog.text
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


class _TwoDrawBlock(torch.nn.Module):
    """A Mamba block in training, with dropout after the conv and after the gate: the first
    draw's copy changes the layout of everything the scan computes from it, the second's input
    included."""

    def __init__(self, dim=16, N=4, R=2):
        super().__init__()
        self.dim, self.N, self.R = dim, N, R
        self.in_proj = torch.nn.Linear(8, 2 * dim, bias=False)
        self.conv1d = torch.nn.Conv1d(dim, dim, 4, groups=dim, padding=3)
        self.x_proj = torch.nn.Linear(dim, R + 2 * N, bias=False)
        self.dt_proj = torch.nn.Linear(R, dim)
        self.A_log = torch.nn.Parameter(torch.randn(dim, N) * 0.3)
        self.D = torch.nn.Parameter(torch.randn(dim))
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        L = x.shape[1]
        xs, z = self.in_proj(x).split(self.dim, dim=-1)
        xs = self.drop(torch.nn.functional.silu(self.conv1d(xs.transpose(1, 2))[:, :, :L].transpose(1, 2)))
        dt, B, C = self.x_proj(xs).split([self.R, self.N, self.N], dim=-1)
        dt = torch.nn.functional.softplus(self.dt_proj(dt))
        dA = torch.exp(torch.einsum("bld,dn->bldn", dt, -torch.exp(self.A_log)))
        dBu = torch.einsum("bld,bln,bld->bldn", dt, B, xs)
        h = torch.zeros(x.shape[0], self.dim, self.N)
        ys = []
        for t in range(L):
            h = dA[:, t] * h + dBu[:, t]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
        y = torch.stack(ys, dim=1) + xs * self.D
        return self.drop(y * torch.nn.functional.silu(z))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_every_draw_of_a_block_takes_eagers_numbers(dynamic):
    # dynamic: the dropout's p is a graph input read by .item(), which the layout check now runs
    # through (it skipped the whole check before, and with it the draws' orders).
    torch.manual_seed(1)
    block = _TwoDrawBlock().train()
    x = torch.randn(2, 12, 8, requires_grad=True)
    torch.manual_seed(7)
    expected = block(x)
    grads_expected = torch.autograd.grad(expected.sum(), [x, *block.parameters()])
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend=ssm_compile.backend(inductor=False), dynamic=dynamic)
    torch.manual_seed(7)
    out = compiled(x)
    grads = torch.autograd.grad(out.sum(), [x, *block.parameters()])
    assert counters["ssm"]["conv1d"] == 1 and counters["ssm"]["scan_loop"] == 1
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, grads_expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
