"""Memory the caller can write, and what the ops read from it.

* An op that records a backward keeps its inputs. Where the user's code handed it a copy
  (``.contiguous()``, ``.clone()``, a cast) of a graph input or of a returned tensor, a write the
  caller makes to that tensor before ``backward()`` must not reach what the op saved: eager's
  backward read the copy. So the rewrites keep such copies (``fx_utils.protects_saved_input``).
* A rounding cast of the dt bias or of D, written on its broadcast view, is part of the function:
  the op must not read the unrounded parameter.
* The decode ops update their state in place: an input that shares the state's memory is refused
  by name, never read half-updated; so is a leaf state that requires grad, as torch's in-place
  ops refuse one.
* Empty batches through the scan op and its Triton backward.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from utils import TRITON_DEVICE, rel_err

import ssm_compile
from ssm_compile.kernels.selective_scan import triton_bwd, triton_fwd

BATCH, DIM, L, N, R = 2, 6, 9, 4, 2


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        u=torch.randn(BATCH, DIM, L, generator=g),
        xin=torch.randn(BATCH, L, DIM, generator=g),
        W=torch.randn(R + 2 * N, DIM, generator=g),
        dt=torch.randn(BATCH, DIM, L, generator=g),
        A=-torch.rand(DIM, N, generator=g) - 0.5,
    )


def _op_block(copy):
    """x_proj, its split, and the scan op on B and C laid out as (batch, N, L) copies."""

    def f(u, x_dbl, dt, A):
        _, Bp, Cp = x_dbl.split([R, N, N], dim=-1)
        Bt, Ct = Bp.transpose(1, 2), Cp.transpose(1, 2)
        Bt, Ct = (Bt.contiguous(), Ct.contiguous()) if copy == "contiguous" else (Bt.clone(), Ct.clone())
        return ssm_compile.selective_scan_fn(u, F.softplus(dt), A, Bt, Ct)

    f.loop = False
    return f


def _loop_block(copy):
    """The same with the scan written as a Python loop (the discretisation matcher looks through
    the copy or the cast)."""

    def f(u, x_dbl, dt, A):
        _, Bp, Cp = x_dbl.split([R, N, N], dim=-1)
        Bp, Cp = {"contiguous": (Bp.contiguous(), Cp.contiguous()), "clone": (Bp.clone(), Cp.clone()),
                  "bf16": (Bp.float(), Cp.float())}[copy]
        delta = F.softplus(dt)
        dA = torch.exp(delta.unsqueeze(-1) * A.unsqueeze(1))
        dBu = delta.unsqueeze(-1) * Bp.unsqueeze(1) * u.unsqueeze(-1)
        h = torch.zeros(BATCH, DIM, N)
        ys = []
        for t in range(L):
            h = dA[:, :, t] * h + dBu[:, :, t]
            ys.append((h * Cp[:, t].unsqueeze(1)).sum(-1))
        return torch.stack(ys, -1)

    # "bf16": x_dbl comes in bf16 and its B and C are widened, a cast that copies.
    f.x_dbl_dtype = torch.bfloat16 if copy == "bf16" else torch.float32
    f.loop = True
    return f


def _grads_after_a_caller_write(block, fn, x_dbl_from):
    """Gradients of u and x_proj's weight when the caller scales x_proj's output in place between
    the forward and the backward: returned by the compiled function, or passed into it."""
    x = _inputs()
    u, W = x["u"].clone().requires_grad_(), x["W"].clone().requires_grad_()
    dtype = getattr(block, "x_dbl_dtype", torch.float32)
    if x_dbl_from == "output":
        def whole(u, xin, W, dt, A):
            x_dbl = F.linear(xin, W).to(dtype)
            return block(u, x_dbl, dt, A), x_dbl

        run = whole if fn is None else fn(whole)
        y, x_dbl = run(u, x["xin"], W, x["dt"], x["A"])
    else:
        run = block if fn is None else fn(block)
        x_dbl = F.linear(x["xin"], W).to(dtype)
        y = run(u, x_dbl, x["dt"], x["A"])
    with torch.no_grad():
        x_dbl.mul_(100.0)
    y.sum().backward()
    return u.grad, W.grad


BLOCKS = {"op-contiguous": _op_block("contiguous"), "op-clone": _op_block("clone"),
          "loop-contiguous": _loop_block("contiguous"), "loop-clone": _loop_block("clone"),
          "loop-bf16-cast": _loop_block("bf16")}


def _check_against_eager(block, x_dbl_from, inductor):
    ref = _grads_after_a_caller_write(block, None, x_dbl_from)
    torch._dynamo.reset()
    counters.clear()
    compiled = _grads_after_a_caller_write(
        block, lambda f: torch.compile(f, backend=ssm_compile.backend(inductor=inductor)), x_dbl_from)
    torch._dynamo.reset()
    # The loop became the op all the same, reading the copies; no copy went.
    assert counters["ssm"]["scan_loop"] == int(block.loop), dict(counters["ssm"])
    assert counters["ssm"]["x_proj_split"] == 0, dict(counters["ssm"])
    for c, e in zip(compiled, ref):
        assert rel_err(c, e) < 1e-5


@pytest.mark.parametrize("x_dbl_from", ["output", "input"])
@pytest.mark.parametrize("block", list(BLOCKS))
def test_copied_input_written_by_the_caller_before_backward(block, x_dbl_from):
    _check_against_eager(BLOCKS[block], x_dbl_from, inductor=False)


@pytest.mark.parametrize("block", ["op-contiguous", "loop-bf16-cast"])
def test_copied_input_written_by_the_caller_through_inductor(block):
    _check_against_eager(BLOCKS[block], "output", inductor=True)


def test_explain_says_why_the_copy_stays_and_drops_it_where_the_caller_cannot_write():
    x = _inputs()
    u, W = x["u"].clone().requires_grad_(), x["W"].clone().requires_grad_()

    def returns_x_dbl(u, xin, W, dt, A):
        x_dbl = F.linear(xin, W)
        return _op_block("contiguous")(u, x_dbl, dt, A), x_dbl

    def keeps_x_dbl(u, xin, W, dt, A):
        return _op_block("contiguous")(u, F.linear(xin, W), dt, A)

    report = ssm_compile.explain(returns_x_dbl, u, x["xin"], W, x["dt"], x["A"])
    assert report.counts["x_proj_split"] == 0, report.format(graphs=False)
    kept = [m for m in report.misses if m.family == "x_proj_split"]
    assert len(kept) == 2 and all("caller may write" in m.reason for m in kept), report.format(graphs=False)
    # x_dbl stays inside the graph: the copies go.
    report = ssm_compile.explain(keeps_x_dbl, u, x["xin"], W, x["dt"], x["A"])
    assert report.counts["x_proj_split"] == 2, report.format(graphs=False)
    # Without gradients nothing is saved, so the copies go even though x_dbl is returned.
    with torch.no_grad():
        report = ssm_compile.explain(returns_x_dbl, u, x["xin"], W, x["dt"], x["A"])
    assert report.counts["x_proj_split"] == 2, report.format(graphs=False)


def test_hf_training_graph_keeps_no_copy():
    transformers = pytest.importorskip("transformers", reason="the HF case needs transformers")
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2,
                                      expand=2, conv_kernel=4, use_cache=False)
    model = transformers.MambaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 12))
    report = ssm_compile.explain(model, ids, labels=ids)
    assert report.counts["conv1d"] == 2 and report.counts["x_dt_proj"] == 2, report.format(graphs=False)
    assert not [m for m in report.misses if "caller may write" in m.reason], report.format(graphs=False)


@pytest.mark.parametrize("where", ["delta_bias", "D"])
def test_rounding_cast_on_a_broadcast_parameter_is_kept(where):
    g = torch.Generator().manual_seed(1)
    u, dt = torch.randn(BATCH, DIM, L, generator=g), torch.randn(BATCH, DIM, L, generator=g)
    A = -torch.rand(DIM, N, generator=g) - 0.5
    B, C = torch.randn(BATCH, N, L, generator=g), torch.randn(BATCH, N, L, generator=g)
    p = torch.randn(DIM, generator=g) * 3
    scan = ssm_compile.selective_scan_fn
    if where == "delta_bias":
        def f(u, dt, A, B, C, p):
            return scan(u, F.softplus(dt + p[:, None].bfloat16()), A, B, C)
    else:
        def f(u, dt, A, B, C, p):
            return scan(u, dt, A, B, C) + u * p[:, None].bfloat16()
    ref = f(u, dt, A, B, C, p)
    unrounded = (scan(u, F.softplus(dt + p[:, None]), A, B, C) if where == "delta_bias"
                 else scan(u, dt, A, B, C) + u * p[:, None])
    assert rel_err(unrounded, ref) > 1e-6, "the rounding must matter for this test to mean anything"
    torch._dynamo.reset()
    out = torch.compile(f, backend=ssm_compile.backend(inductor=False))(u, dt, A, B, C, p)
    torch._dynamo.reset()
    assert rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("alias", ["x", "z", "B", "dt_bias"])
def test_state_update_refuses_inputs_sharing_the_state(alias):
    g = torch.Generator().manual_seed(2)
    buf = torch.randn(BATCH, DIM, N + 1, generator=g)
    state = buf[:, :, :N]
    args = dict(x=torch.randn(BATCH, DIM, generator=g), dt=torch.randn(BATCH, DIM, generator=g),
                A=-torch.rand(DIM, N, generator=g), B=torch.randn(BATCH, N, generator=g),
                C=torch.randn(BATCH, N, generator=g), D=torch.randn(DIM, generator=g),
                z=torch.randn(BATCH, DIM, generator=g), dt_bias=torch.randn(DIM, generator=g))
    args[alias] = {"x": state[:, :, 0], "z": state[:, :, 1], "B": state[:, 0, :], "dt_bias": state[0, :, 2]}[alias]
    before = state.clone()
    with pytest.raises(ValueError, match=f"^ssm::selective_state_update: {alias} shares memory with state"):
        ssm_compile.selective_state_update(state, **args)
    assert torch.equal(state, before), "the refused call must not have written the state"
    # A copy of the same values is fine, and the state's neighbour in the buffer is no alias.
    args[alias] = args[alias].clone()
    ssm_compile.selective_state_update(state, **{**args, "x": buf[:, :, N].clone()})


def test_conv_update_refuses_inputs_sharing_the_state():
    g = torch.Generator().manual_seed(3)
    conv_state = torch.randn(BATCH, DIM, 3, generator=g)
    weight = torch.randn(DIM, 4, generator=g)
    with pytest.raises(ValueError, match="^ssm::causal_conv1d_update: x shares memory with conv_state"):
        ssm_compile.causal_conv1d_update(conv_state[:, :, 2], conv_state, weight)
    y = ssm_compile.causal_conv1d_update(conv_state[:, :, 2].clone(), conv_state, weight)
    assert y.shape == (BATCH, DIM)


def test_decode_ops_refuse_a_leaf_state_that_requires_grad():
    # What torch's own in-place ops do: the write would not be seen by autograd.
    g = torch.Generator().manual_seed(6)
    state = torch.randn(BATCH, DIM, N, generator=g).requires_grad_()
    args = (torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g),
            -torch.rand(DIM, N, generator=g), torch.randn(BATCH, N, generator=g), torch.randn(BATCH, N, generator=g))
    with pytest.raises(RuntimeError, match=r"leaf Variable that requires grad \(state\)"):
        ssm_compile.selective_state_update(state, *args)
    conv_state = torch.randn(BATCH, DIM, 3, generator=g).requires_grad_()
    with pytest.raises(RuntimeError, match=r"leaf Variable that requires grad \(conv_state\)"):
        ssm_compile.causal_conv1d_update(torch.randn(BATCH, DIM, generator=g), conv_state, torch.randn(DIM, 4))
    # Under no_grad it is an ordinary state update, as for torch's in-place ops.
    with torch.no_grad():
        before = state.clone()
        ssm_compile.selective_state_update(state, *args)
    assert not torch.equal(state, before)


def test_conv_update_takes_swish_as_silu():
    g = torch.Generator().manual_seed(7)
    x, weight = torch.randn(BATCH, DIM, generator=g), torch.randn(DIM, 4, generator=g)
    conv_state = torch.randn(BATCH, DIM, 3, generator=g)
    silu_state, swish_state = conv_state.clone(), conv_state.clone()
    silu = ssm_compile.causal_conv1d_update(x, silu_state, weight, activation="silu")
    swish = ssm_compile.causal_conv1d_update(x, swish_state, weight, activation="swish")
    assert torch.equal(silu, swish) and torch.equal(silu_state, swish_state)
    assert not torch.equal(silu, ssm_compile.causal_conv1d_update(x, conv_state.clone(), weight))


def test_empty_batch_with_last_state():
    g = torch.Generator().manual_seed(4)
    u, delta = torch.randn(0, DIM, L, generator=g), torch.randn(0, DIM, L, generator=g)
    A = -torch.rand(DIM, N, generator=g)
    B, C = torch.randn(0, N, L, generator=g), torch.randn(0, N, L, generator=g)
    y, last = ssm_compile.selective_scan_fn(u, delta, A, B, C, return_last_state=True)
    assert y.shape == (0, DIM, L) and last.shape == (0, DIM, N)


def test_triton_backward_of_an_empty_batch():
    g = torch.Generator().manual_seed(5)
    dev = TRITON_DEVICE
    u, delta, dy = (torch.randn(0, DIM, L, generator=g).to(dev) for _ in range(3))
    A = (-torch.rand(DIM, N, generator=g)).to(dev)
    B, C = (torch.randn(0, 1, N, L, generator=g).to(dev) for _ in range(2))
    D, bias = torch.randn(DIM, generator=g).to(dev), torch.randn(DIM, generator=g).to(dev)
    y, last = triton_fwd.selective_scan_fwd(u, delta, A, B, C, D, None, bias, True, None, True)
    assert y.shape == (0, DIM, L) and last.shape == (0, DIM, N)
    grads = triton_bwd.selective_scan_bwd(dy, None, u, delta, A, B, C, D, None, bias, True, None)
    assert grads.du.shape == u.shape and grads.dB.shape == B.shape
    for name in ("dA", "dD", "ddelta_bias"):
        assert torch.count_nonzero(getattr(grads, name)) == 0, name
