"""The conv decode step of transformers 4.39's ``MambaMixer.slow_forward`` (probe CR, run 63)::

    conv_state = torch.roll(cache, shifts=-1, dims=-1)      # a new tensor: the rolled window
    conv_state[:, :, -1] = hidden_states[:, :, 0]           # x into the rolled window's last slot
    cache.copy_(conv_state)                                  # the new window into the cache
    hidden_states = torch.sum(conv_state * w[:, 0, :], -1)  # the rolled window read out
    hidden_states += bias; hidden_states = act(hidden_states)

mamba_simple writes x into the cache after the copy; here it goes into the rolled copy before
it. Both leave the cache and the readout's window holding the last S inputs, x last, which is
``ssm.causal_conv1d_update``'s new state and the window its output is read from. The pass left
this order alone with "the rolled window is not followed by conv_state[..., -1] = x", which was
false. Orders that are not the op's (x written after the copy, the window read before x is in it,
x written in place before the op would read it) and an x broadcast over the batch are left alone
with their reasons.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from utils import TOL, PassCapture, rel_err

from ssm_compile.compiler import backend
from ssm_compile.kernels.decode import op as decode_op
from ssm_compile.passes import decode
from ssm_compile.passes.fx_utils import normalized_graph_str

BATCH, DIM, W = 2, 6, 4


@pytest.fixture(scope="module", autouse=True)
def registered():
    decode_op.register()


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(BATCH, DIM, 1, generator=g), conv_state=torch.randn(BATCH, DIM, W, generator=g),
                weight=torch.randn(DIM, 1, W, generator=g), bias=torch.randn(DIM, generator=g))


def hf439_step(bias: bool, act: bool):
    def step(x, conv_state, weight, b):
        rolled = torch.roll(conv_state, shifts=-1, dims=-1)
        rolled[:, :, -1] = x[:, :, 0]
        conv_state.copy_(rolled)
        y = torch.sum(rolled * weight[:, 0, :], dim=-1)
        if bias:
            y += b
        if act:
            y = F.silu(y)
        return y.unsqueeze(-1)
    return step


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("bias, act", [(True, True), (False, True), (True, False), (False, False)],
                         ids=["bias-silu", "silu", "bias", "plain"])
def test_rolled_copy_step_is_the_op_call_after_call(bias, act, grad_mode):
    """Four calls on one cache: each output and the cache after each call as eager's."""
    step = hf439_step(bias, act)
    inp = inputs()
    eager_state, comp_state = inp["conv_state"].clone(), inp["conv_state"].clone()
    cap = PassCapture(decode)
    compiled = torch.compile(step, backend=cap, fullgraph=True)
    for i in range(4):
        x = inputs(seed=i + 1)["x"]
        with grad_mode():
            y_e = step(x, eager_state, inp["weight"], inp["bias"])
            y_c = compiled(x, comp_state, inp["weight"], inp["bias"])
        assert y_c.shape == y_e.shape and rel_err(y_c, y_e) <= TOL[torch.float32]
        assert torch.equal(comp_state, eager_state), i
    assert dict(counters["ssm"]) == {"conv_update": 1}, cap.ctx.misses
    (record,) = cap.ctx.rewrites
    # Without the silu, ``y += b`` writes y, whose view the step returns: passes/inplace.py leaves
    # that write as written, and it adds the bias to the op's output.
    assert record.decision["form"] == "rolled copy" and record.decision["bias"] == (bias and act)
    assert record.decision["activation"] == ("silu" if act else None)
    graph = normalized_graph_str(cap.gm)
    assert "causal_conv1d_update" in graph and "roll" not in graph and "copy_" not in graph, graph


class HF439Mixer(nn.Module):
    """The conv half of transformers 4.39's slow decode step, its cache a registered buffer."""

    def __init__(self):
        super().__init__()
        self.conv1d = nn.Conv1d(DIM, DIM, W, groups=DIM, padding=W - 1)
        self.act = nn.SiLU()
        self.register_buffer("conv_states", torch.zeros(BATCH, DIM, W))

    def forward(self, hidden_states):  # (batch, dim, 1)
        dtype = hidden_states.dtype
        conv_state = torch.roll(self.conv_states, shifts=-1, dims=-1)
        conv_state[:, :, -1] = hidden_states[:, :, 0]
        self.conv_states.copy_(conv_state)
        hidden_states = torch.sum(conv_state * self.conv1d.weight[:, 0, :], dim=-1)
        hidden_states += self.conv1d.bias
        return self.act(hidden_states).to(dtype).unsqueeze(-1)


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_module_with_buffer_cache_through_the_backend(grad_mode):
    torch.manual_seed(0)
    eager = HF439Mixer()
    with torch.no_grad():
        eager.conv_states.copy_(torch.randn(BATCH, DIM, W))
    comp = HF439Mixer()
    comp.load_state_dict(eager.state_dict())
    compiled = torch.compile(comp, backend=backend(inductor=False))
    xs = [torch.randn(BATCH, DIM, 1) for _ in range(5)]
    with grad_mode():
        for x in xs:
            y_e, y_c = eager(x), compiled(x)
            assert rel_err(y_c, y_e) <= TOL[torch.float32]
            assert torch.equal(comp.conv_states, eager.conv_states)
    assert counters["ssm"]["conv_update"] == 1, dict(counters["ssm"])
    assert counters["stats"]["unique_graphs"] == 1


def two_steps(x1, x2, conv_state, weight, b):
    """Two tokens in one graph: the second step rolls the window the first one wrote."""
    ys = []
    for x in (x1, x2):
        rolled = torch.roll(conv_state, shifts=-1, dims=-1)
        rolled[:, :, -1] = x[:, :, 0]
        conv_state.copy_(rolled)
        ys.append(F.silu(torch.sum(rolled * weight[:, 0, :], dim=-1) + b))
    return torch.stack(ys, -1)


def test_two_steps_in_one_graph():
    inp = inputs()
    x2 = inputs(seed=1)["x"]
    eager_state, comp_state = inp["conv_state"].clone(), inp["conv_state"].clone()
    cap = PassCapture(decode)
    with torch.no_grad():
        y_e = two_steps(inp["x"], x2, eager_state, inp["weight"], inp["bias"])
        y_c = torch.compile(two_steps, backend=cap, fullgraph=True)(inp["x"], x2, comp_state, inp["weight"],
                                                                    inp["bias"])
    assert dict(counters["ssm"]) == {"conv_update": 2}, cap.ctx.misses
    assert rel_err(y_c, y_e) <= TOL[torch.float32] and torch.equal(comp_state, eager_state)


# --- orders that are not the op's -------------------------------------------------------------

def x_written_after_the_copy(x, conv_state, weight, b):
    """The cache gets the rolled window with the oldest input at the end; only the readout sees x."""
    rolled = torch.roll(conv_state, shifts=-1, dims=-1)
    conv_state.copy_(rolled)
    rolled[:, :, -1] = x[:, :, 0]
    return F.silu(torch.sum(rolled * weight[:, 0, :], dim=-1) + b)


def read_before_x(x, conv_state, weight, b):
    rolled = torch.roll(conv_state, shifts=-1, dims=-1)
    y = torch.sum(rolled * weight[:, 0, :], dim=-1) + b
    rolled[:, :, -1] = x[:, :, 0]
    conv_state.copy_(rolled)
    return y


def x_written_in_place_after_its_write(x, conv_state, weight, b):
    """The window holds x as it was; the op, which reads x where the readout ends, would see x * 2."""
    rolled = torch.roll(conv_state, shifts=-1, dims=-1)
    xs = x[:, :, 0]
    rolled[:, :, -1] = xs
    xs.mul_(2)
    conv_state.copy_(rolled)
    return torch.sum(rolled * weight[:, 0, :], dim=-1) + b


def window_also_returned(x, conv_state, weight, b):
    rolled = torch.roll(conv_state, shifts=-1, dims=-1)
    rolled[:, :, -1] = x[:, :, 0]
    conv_state.copy_(rolled)
    return torch.sum(rolled * weight[:, 0, :], dim=-1) + b, rolled


def x_broadcast_over_batch(x, conv_state, weight, b):
    rolled = torch.roll(conv_state, shifts=-1, dims=-1)
    rolled[:, :, -1] = x[:1, :, 0]
    conv_state.copy_(rolled)
    return torch.sum(rolled * weight[:, 0, :], dim=-1) + b


def mamba_simple_x_broadcast_over_batch(x, conv_state, weight, b):
    """mamba_simple's order with the same broadcast (the op refused x inside the pass before run 63,
    which failed the compile)."""
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x[:1, :, 0]
    return torch.sum(conv_state * weight[:, 0, :], dim=-1) + b


BROADCAST = "the window's last slot is written (1, 6), broadcast to its (batch, dim) = (2, 6)"
LOOK_ALIKES = [
    pytest.param(x_broadcast_over_batch, BROADCAST, id="x-broadcast"),
    pytest.param(mamba_simple_x_broadcast_over_batch, BROADCAST, id="mamba-simple-x-broadcast"),
    pytest.param(x_written_after_the_copy, "writes the rolled window after the copy_: the state keeps its oldest "
                 "input", id="x-after-copy"),
    pytest.param(read_before_x, "is used by ['mul'] before x is written into its last slot", id="read-before-x"),
    pytest.param(x_written_in_place_after_its_write, "writes x (", id="x-mul_-after-write"),
    pytest.param(window_also_returned, "the new window is used by", id="window-returned"),
]


@pytest.mark.parametrize("fn, reason", LOOK_ALIKES)
def test_other_orders_left_alone(fn, reason):
    inp = inputs()
    e_in = {k: v.clone() for k, v in inp.items()}
    c_in = {k: v.clone() for k, v in inp.items()}
    cap = PassCapture(decode)
    with torch.no_grad():
        y_e = fn(*e_in.values())
        y_c = torch.compile(fn, backend=cap, fullgraph=True)(*c_in.values())
    assert not counters["ssm"], cap.ctx.rewrites
    reasons = [m.reason for m in cap.ctx.misses if m.family == "conv_update"]
    assert any(reason in r for r in reasons), reasons
    for o, r in zip(y_c if isinstance(y_c, tuple) else (y_c,), y_e if isinstance(y_e, tuple) else (y_e,),
                    strict=True):
        assert torch.equal(o, r)
    assert torch.equal(c_in["conv_state"], e_in["conv_state"])


def test_rolled_copy_step_under_grad_keeps_eager_values_and_gradients():
    """Under grad the step records a backward the op has none of: left alone, values and
    gradients as eager's."""
    step = hf439_step(True, True)
    inp = inputs()
    e_in = {k: v.clone().requires_grad_(k != "conv_state") for k, v in inp.items()}
    c_in = {k: v.clone().requires_grad_(k != "conv_state") for k, v in inp.items()}
    cap = PassCapture(decode)
    y_e = step(*e_in.values())
    y_c = torch.compile(step, backend=cap, fullgraph=True)(*c_in.values())
    assert not counters["ssm"], cap.ctx.rewrites
    reasons = [m.reason for m in cap.ctx.misses if m.family == "conv_update"]
    assert any("requires grad: gradients flow through this step, and the decode ops are inference-only" in r
               for r in reasons), reasons
    g = torch.randn_like(y_e)
    y_e.backward(g)
    y_c.backward(g)
    assert torch.equal(y_c, y_e) and torch.equal(c_in["conv_state"], e_in["conv_state"])
    for k in ("x", "weight", "bias"):
        assert torch.equal(c_in[k].grad, e_in[k].grad), k
