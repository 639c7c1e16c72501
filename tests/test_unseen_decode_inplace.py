"""Decode steps with in-place writes between where the user's code reads a value and where the
decode op would read it.

``passes/decode.py`` emits each op at the end of the pattern it replaces (the state op at the
step's output, the conv op at the conv1d or the readout's end), so the op reads x, dt, A, B, C,
D, z, dt_bias, the weight and the states there, not where the user's code read them. A write in
between (``dt.mul_(2)``, ``x.zero_()``, ``F.silu(z, True)``, a write through a view of an
input or through a second input that aliases the state) changes what the op sees; the pass must
then leave the step alone (a near-miss with a reason), and every case must give eager's outputs
and leave the inputs (the states above all) as eager does. Writes outside that span must not
stop the rewrite.

Each case runs eager, the decode passes alone (``PassCapture``, to read the counters and
reasons) and the whole pipeline without inductor; two cases also run ``backend="ssm"``.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from utils import TOL, PassCapture, rel_err

from ssm_compile.compiler import backend
from ssm_compile.kernels.decode import op as decode_op
from ssm_compile.passes import decode

BATCH, DIM, N, W = 2, 6, 4, 4
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


@pytest.fixture(scope="module", autouse=True)
def registered():
    decode_op.register()


def state_inputs():
    """Random non-zero step inputs, built afresh (same values) on each call."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return dict(state=r(BATCH, DIM, N), x=r(BATCH, DIM), dt=r(BATCH, DIM), A=-torch.rand(DIM, N, generator=g) - 0.1,
                B=r(BATCH, N), C=r(BATCH, N), D=r(DIM), z=r(BATCH, DIM), dt_bias=r(DIM))


def heads_inputs():
    """mamba_ssm's layout with a heads axis: state (batch, heads, headdim, N), B and C (batch, N)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return dict(state=r(BATCH, 2, 3, N), x=r(BATCH, 2, 3), dt=r(BATCH, 2, 3), A=-torch.rand(2, 3, N, generator=g) - 0.1,
                B=r(BATCH, N), C=r(BATCH, N))


def xdbl_inputs():
    """The x_proj output (batch, dt + 2N) that dt, B and C are views of, as in HF's decode step."""
    inp = state_inputs()
    inp["xdbl"] = torch.cat([inp.pop("dt"), inp.pop("B"), inp.pop("C")], -1)
    return inp


def aliased_state_inputs():
    """The state and a second input viewing its first sequence (a cache handed in twice)."""
    inp = state_inputs()
    inp["alias"] = inp["state"][0]
    return inp


def conv_inputs(S=W):
    g = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(BATCH, DIM, generator=g), conv_state=torch.randn(BATCH, DIM, S, generator=g),
                weight=torch.randn(DIM, W, generator=g), bias=torch.randn(DIM, generator=g))


def aliased_conv_inputs(S=W):
    inp = conv_inputs(S)
    inp["alias"] = inp["conv_state"][:, :, -1]
    return inp


def _disc(x, dt, A, B):
    return torch.exp(dt[..., None] * A), dt[..., None] * B[:, None, :] * x[..., None]


def _readout(h, C):
    return (h * C[:, None, :]).sum(-1)


# --- state_update: a write between the user's read and the op's -------------------------------

def dt_written_between_decay_and_input(state, x, dt, A, B, C, D, z, dt_bias):
    dA = torch.exp(dt[..., None] * A)
    dt.mul_(2)
    state.copy_(state * dA + dt[..., None] * B[:, None, :] * x[..., None])
    return _readout(state, C)


def dt_written_after_discretization(state, x, dt, A, B, C, D, z, dt_bias):
    dA, dBu = _disc(x, dt, A, B)
    dt.mul_(2)
    state.mul_(dA).add_(dBu)
    return _readout(state, C)


def raw_dt_written_after_softplus(state, x, dt, A, B, C, D, z, dt_bias):
    delta = F.softplus(dt + dt_bias)
    dt.mul_(2)
    dA, dBu = _disc(x, delta, A, B)
    state.copy_(state * dA + dBu)
    return _readout(state, C)


def dt_bias_zeroed_after_softplus(state, x, dt, A, B, C, D, z, dt_bias):
    delta = F.softplus(dt + dt_bias)
    dt_bias.zero_()
    dA, dBu = _disc(x, delta, A, B)
    state.copy_(state * dA + dBu)
    return _readout(state, C)


def A_written_after_decay(state, x, dt, A, B, C, D, z, dt_bias):
    dA, dBu = _disc(x, dt, A, B)
    A.mul_(2)
    state.copy_(state * dA + dBu)
    return _readout(state, C)


def x_zeroed_before_skip(state, x, dt, A, B, C, D, z, dt_bias):
    dA, dBu = _disc(x, dt, A, B)
    state.mul_(dA).add_(dBu)
    x.zero_()
    return _readout(state, C) + x * D


def x_written_through_view(state, x, dt, A, B, C, D, z, dt_bias):
    dA, dBu = _disc(x, dt, A, B)
    x.view(-1)[:3] = 5.0
    state.copy_(state * dA + dBu)
    return _readout(state, C) + x * D


def C_zeroed_after_readout(state, x, dt, A, B, C, D, z, dt_bias):
    dA, dBu = _disc(x, dt, A, B)
    state.copy_(state * dA + dBu)
    y = _readout(state, C)
    C.zero_()
    return y + x * D


def D_written_after_skip(state, x, dt, A, B, C, D, z, dt_bias):
    dA, dBu = _disc(x, dt, A, B)
    skip = x * D
    D.mul_(2)
    state.copy_(state * dA + dBu)
    return _readout(state, C) + skip


def z_silu_inplace_after_gate(state, x, dt, A, B, C, D, z, dt_bias):
    gate = F.silu(z)
    F.silu(z, True)
    dA, dBu = _disc(x, dt, A, B)
    state.copy_(state * dA + dBu)
    return _readout(state, C) * gate


def z_silu_inplace_kwarg_after_gate(state, x, dt, A, B, C, D, z, dt_bias):
    gate = F.silu(z)
    dA, dBu = _disc(x, dt, A, B)
    state.copy_(state * dA + dBu)
    y = _readout(state, C)
    F.silu(z, inplace=True)
    return y * gate


def x_written_by_out_kwarg(state, x, dt, A, B, C, D, z, dt_bias):
    """``out=`` writes like an in-place method does."""
    dA, dBu = _disc(x, dt, A, B)
    torch.mul(x, 3.0, out=x)
    state.copy_(state * dA + dBu)
    return _readout(state, C) + x * D


def x_addcmul_inplace(state, x, dt, A, B, C, D, z, dt_bias):
    dA, dBu = _disc(x, dt, A, B)
    x.addcmul_(x, x)
    state.mul_(dA).add_(dBu)
    return _readout(state, C) + x * D


def returned_state_written_before_output(state, x, dt, A, B, C, D, z, dt_bias):
    """The returned new state written between the readout and the step's output."""
    dA, dBu = _disc(x, dt, A, B)
    h = state * dA + dBu
    y = _readout(h, C)
    h.mul_(2)
    return y + x * D, h


def z_relu_inplace_before_gate(state, x, dt, A, B, C, D, z, dt_bias):
    """Written before every read: the gate and the op both see the relu'd z (the rewrite stays)."""
    F.relu(z, inplace=True)
    dA, dBu = _disc(x, dt, A, B)
    state.copy_(state * dA + dBu)
    return _readout(state, C) * F.silu(z)


def B_view_written_after_input_term(state, x, xdbl, A, D, z, dt_bias):
    """HF's split of the x_proj output: dt, B, C are views of one tensor that is written later."""
    dt, B, C = torch.split(xdbl, [DIM, N, N], dim=-1)
    dA, dBu = _disc(x, F.softplus(dt + dt_bias), A, B)
    xdbl.mul_(2)
    state.copy_(state * dA + dBu)
    return _readout(state, C)


def returned_state_x_written(state, x, dt, A, B, C, D, z, dt_bias):
    """A functional step (new state returned) whose x is written after the input term."""
    dA, dBu = _disc(x, dt, A, B)
    h = state * dA + dBu
    x.add_(1)
    return _readout(h, C) + x * D, h


def heads_x_written_after_input_term(state, x, dt, A, B, C):
    """mamba_ssm's reference step with a heads axis, x written between its read and the op's."""
    dA = torch.exp(dt[..., None] * A)
    dBx = dt[..., None] * B[:, None, None, :] * x[..., None]
    x.mul_(-2)
    state.copy_(state * dA + dBx)
    return torch.einsum("bhpn,bn->bhp", state, C) + x


def state_view_zeroed_between_update_and_readout(state, x, dt, A, B, C, D, z, dt_bias):
    dA, dBu = _disc(x, dt, A, B)
    state.mul_(dA).add_(dBu)
    state.view(-1)[:3] = 0
    return _readout(state, C)


def alias_zeroed_between_update_and_readout(state, alias, x, dt, A, B, C, D, z, dt_bias):
    dA, dBu = _disc(x, dt, A, B)
    state.copy_(state * dA + dBu)
    alias.zero_()
    return _readout(state, C)


def alias_read_between_update_and_readout(state, alias, x, dt, A, B, C, D, z, dt_bias):
    dA, dBu = _disc(x, dt, A, B)
    state.mul_(dA).add_(dBu)
    seen = alias.sum(-1)
    return _readout(state, C), seen


def alias_scaled_after_readout(state, alias, x, dt, A, B, C, D, z, dt_bias):
    dA, dBu = _disc(x, dt, A, B)
    state.copy_(state * dA + dBu)
    y = _readout(state, C)
    alias.mul_(0.5)
    return y + x * D


def readout_of_state_before_update_through_alias(state, alias, x, dt, A, B, C, D, z, dt_bias):
    """The near-miss: the old state read (through the alias) before the update."""
    old = alias * 1.0
    dA, dBu = _disc(x, dt, A, B)
    state.copy_(state * dA + dBu)
    return _readout(state, C), old


def x_written_after_step(state, x, dt, A, B, C, D, z, dt_bias):
    """Written after the step's output: nothing the op reads changes (the rewrite stays)."""
    dA, dBu = _disc(x, dt, A, B)
    state.copy_(state * dA + dBu)
    y = _readout(state, C) + x * D
    x.zero_()
    dt.mul_(2)
    return y


class BufferStep(torch.nn.Module):
    """HF-style cache held as module buffers; x is computed by the module and written in place."""

    def __init__(self):
        super().__init__()
        inp = state_inputs()
        self.register_buffer("state", inp["state"])
        self.A = torch.nn.Parameter(inp["A"], requires_grad=False)
        self.D = torch.nn.Parameter(inp["D"], requires_grad=False)

    def forward(self, x, dt, B, C):
        x = x * 1.5
        dA, dBu = _disc(x, dt, self.A, B)
        self.state.copy_(self.state * dA + dBu)
        x.mul_(-1)
        return _readout(self.state, C) + x * self.D


def decode_loop_x_written_each_step(state, x, dt, A, B, C, D, z, dt_bias):
    """Two steps on one state in one graph; each step's x is written after its input term."""
    ys = []
    for _ in range(2):
        xs = x * 1.0
        dA, dBu = _disc(xs, dt, A, B)
        xs.add_(1)
        state.mul_(dA).add_(dBu)
        ys.append(_readout(state, C) + xs * D)
    return torch.stack(ys)


def decode_loop_clean(state, x, dt, A, B, C, D, z, dt_bias):
    ys = []
    for _ in range(2):
        dA, dBu = _disc(x, dt, A, B)
        state.mul_(dA).add_(dBu)
        y = _readout(state, C) + x * D
        x = y * 0.5
        ys.append(y)
    return torch.stack(ys)


# (fn, inputs, True if the rewrite must stay, False if it must be refused)
STATE_CASES = [
    pytest.param(dt_written_between_decay_and_input, state_inputs, False, id="dt-mul_-between-dA-dBu"),
    pytest.param(dt_written_after_discretization, state_inputs, False, id="dt-mul_-after-disc"),
    pytest.param(raw_dt_written_after_softplus, state_inputs, False, id="raw-dt-mul_-after-softplus"),
    pytest.param(dt_bias_zeroed_after_softplus, state_inputs, False, id="dt_bias-zero_-after-softplus"),
    pytest.param(A_written_after_decay, state_inputs, False, id="A-mul_-after-dA"),
    pytest.param(x_zeroed_before_skip, state_inputs, False, id="x-zero_-before-skip"),
    pytest.param(x_written_through_view, state_inputs, False, id="x-view-setitem"),
    pytest.param(C_zeroed_after_readout, state_inputs, False, id="C-zero_-after-readout"),
    pytest.param(D_written_after_skip, state_inputs, False, id="D-mul_-after-skip"),
    pytest.param(z_silu_inplace_after_gate, state_inputs, False, id="z-silu-inplace-after-gate"),
    pytest.param(z_silu_inplace_kwarg_after_gate, state_inputs, False, id="z-silu-inplace=True-after-readout"),
    pytest.param(x_written_by_out_kwarg, state_inputs, False, id="x-out=-after-dBu"),
    pytest.param(x_addcmul_inplace, state_inputs, False, id="x-addcmul_-after-dBu"),
    pytest.param(returned_state_written_before_output, state_inputs, False, id="returned-h-mul_-before-output"),
    pytest.param(z_relu_inplace_before_gate, state_inputs, True, id="z-relu-inplace-before-reads"),
    pytest.param(B_view_written_after_input_term, xdbl_inputs, False, id="xdbl-mul_-after-dBu"),
    pytest.param(returned_state_x_written, state_inputs, False, id="returned-x-add_"),
    pytest.param(heads_x_written_after_input_term, heads_inputs, False, id="heads-x-mul_-after-dBx"),
    pytest.param(state_view_zeroed_between_update_and_readout, state_inputs, False, id="state-view-setitem"),
    pytest.param(alias_zeroed_between_update_and_readout, aliased_state_inputs, False, id="alias-zero_-before-readout"),
    pytest.param(alias_read_between_update_and_readout, aliased_state_inputs, False, id="alias-read-before-readout"),
    pytest.param(alias_scaled_after_readout, aliased_state_inputs, False, id="alias-mul_-after-readout"),
    pytest.param(readout_of_state_before_update_through_alias, aliased_state_inputs, True,
                 id="alias-read-before-update"),
    pytest.param(x_written_after_step, state_inputs, True, id="x-dt-written-after-step"),
    pytest.param(decode_loop_x_written_each_step, state_inputs, False, id="loop-x-add_-each-step"),
    pytest.param(decode_loop_clean, state_inputs, True, id="loop-clean"),
]


def _run(fn, make_inputs, compiler):
    inp = make_inputs()
    out = compiler(fn)(**inp)
    return (out if isinstance(out, tuple) else (out,)), inp


def _check_equal(fn, make_inputs, compiler):
    (out_e, in_e), (out_c, in_c) = _run(fn, make_inputs, lambda f: f), _run(fn, make_inputs, compiler)
    for o, r in zip(out_c, out_e, strict=True):
        assert o.shape == r.shape and rel_err(o, r) <= TOL[torch.float32], (rel_err(o, r))
    for name in in_e:  # every input after the call: the states, and the inputs the step wrote
        assert rel_err(in_c[name], in_e[name]) <= TOL[torch.float32], name


def _check(fn, make_inputs, rewritten, family):
    cap = PassCapture(decode)
    _check_equal(fn, make_inputs, lambda f: torch.compile(f, backend=cap, fullgraph=True))
    if rewritten:
        assert counters["ssm"][family] >= 1, cap.ctx.misses
    else:
        assert not counters["ssm"][family], cap.ctx.rewrites
        reasons = [m.reason for m in cap.ctx.misses if m.family == family]
        assert any(word in r for r in reasons for word in ("writes", "reads", "also used")), reasons
    counters.clear()
    torch._dynamo.reset()
    _check_equal(fn, make_inputs, lambda f: torch.compile(f, backend=backend(inductor=False), fullgraph=True))


@pytest.mark.parametrize("fn, make_inputs, rewritten", STATE_CASES)
def test_state_step_with_inplace_write(fn, make_inputs, rewritten):
    _check(fn, make_inputs, rewritten, "state_update")


def test_buffer_state_step_with_inplace_x():
    """Module buffers as the cache; the module's own x is written after its input term."""
    inputs = state_inputs()
    args = dict(x=inputs["x"], dt=inputs["dt"], B=inputs["B"], C=inputs["C"])
    eager, comp = BufferStep(), BufferStep()
    y_e = eager(**{k: v.clone() for k, v in args.items()})
    cap = PassCapture(decode)
    y_c = torch.compile(comp, backend=cap, fullgraph=True)(**{k: v.clone() for k, v in args.items()})
    assert not counters["ssm"]["state_update"], cap.ctx.rewrites
    assert rel_err(y_c, y_e) <= TOL[torch.float32]
    assert rel_err(comp.state, eager.state) <= TOL[torch.float32]


# --- conv_update ------------------------------------------------------------------------------

def cat_form_x_written_before_conv(x, conv_state, weight, bias):
    """HF's torch fallback with x (batch, dim, 1) written between the cat and the conv."""
    x3 = x.unsqueeze(-1)
    hs = torch.cat([conv_state, x3], dim=-1)
    conv_state.copy_(hs[:, :, -W:])
    x.mul_(2)
    y = torch.conv1d(hs, weight.unsqueeze(1), bias, padding=0, groups=DIM)[:, :, -1:]
    return F.silu(y)


def cat_form_weight_written_before_conv(x, conv_state, weight, bias):
    """Written before the conv, which reads it: the op reads it there too (the rewrite stays)."""
    hs = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)
    conv_state.copy_(hs[:, :, -W:])
    weight.mul_(2)
    return torch.conv1d(hs, weight.unsqueeze(1), bias, padding=0, groups=DIM)[:, :, -1:]


def cat_form_alias_read_before_conv(x, conv_state, alias, weight, bias):
    """The window read through an alias between the roll and the conv (the op rolls later)."""
    hs = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)
    conv_state.copy_(hs[:, :, -W:])
    seen = alias * 1.0
    return torch.conv1d(hs, weight.unsqueeze(1), bias, padding=0, groups=DIM)[:, :, -1:], seen


def roll_x_zeroed_before_readout(x, conv_state, weight, bias):
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    x.zero_()
    return F.silu((conv_state * weight).sum(-1) + bias) + x


def roll_x_written_by_out_kwarg(x, conv_state, weight, bias):
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    torch.add(x, 1.0, out=x)
    return (conv_state * weight).sum(-1) + bias + x


def roll_weight_written_after_readout(x, conv_state, weight, bias):
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    y = (conv_state * weight).sum(-1)
    weight.mul_(2)
    return F.silu(y + bias)


def roll_bias_zeroed_before_silu(x, conv_state, weight, bias):
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    y = (conv_state * weight).sum(-1) + bias
    bias.zero_()
    return F.silu(y)


def roll_alias_zeroed_before_readout(x, conv_state, alias, weight, bias):
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    alias.zero_()
    return (conv_state * weight).sum(-1)


def roll_state_view_read_after_roll(x, conv_state, weight, bias):
    """conv_state.copy_(roll) then the old window read back through a view taken before."""
    old = conv_state[:, :, :]
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    return (conv_state * weight).sum(-1), old.sum(-1)


def cat_slice_copy_x_written(x, conv_state, weight, bias):
    conv_state.copy_(torch.cat([conv_state[..., 1:], x[..., None]], -1))
    x.mul_(2)
    return F.silu((conv_state * weight).sum(-1) + bias)


def returned_window_x_written(x, conv_state, weight, bias):
    window = torch.cat([conv_state[..., 1:], x[..., None]], -1)
    x.zero_()
    return F.silu((window * weight).sum(-1) + bias), window


def returned_window_alias_written(x, conv_state, alias, weight, bias):
    """The input window written (through an alias) after the new window is built: the op's copy
    of the window is taken before, where the user's code read it (the rewrite stays)."""
    window = torch.cat([conv_state[..., 1:], x[..., None]], -1)
    alias.zero_()
    return (window * weight).sum(-1), window


def returned_window_alias_written_between_reads(x, conv_state, alias, weight, bias):
    """The input window used, written through an alias, then read for the new window: a copy
    taken at its first use would miss the write."""
    seen = conv_state.sum(-1)
    alias.zero_()
    window = torch.cat([conv_state[..., 1:], x[..., None]], -1)
    return (window * weight).sum(-1), window, seen


def mambapy_alias_written_between_conv_and_window(x, conv_state, alias, weight, bias):
    x_cache = x.unsqueeze(2)
    y = F.conv1d(torch.cat([conv_state, x_cache], dim=2), weight.unsqueeze(1), bias, padding=W - 1,
                 groups=DIM)[:, :, W - 1]
    alias.zero_()
    return F.silu(y), torch.cat([conv_state[:, :, 1:], x_cache], dim=2)


def mambapy_conv_weight_written(x, conv_state, weight, bias):
    x_cache = x.unsqueeze(2)
    y = F.conv1d(torch.cat([conv_state, x_cache], dim=2), weight.unsqueeze(1), bias, padding=W - 1,
                 groups=DIM)[:, :, W - 1]
    weight.zero_()
    return F.silu(y), torch.cat([conv_state[:, :, 1:], x_cache], dim=2)


CONV_CASES = [
    pytest.param(cat_form_x_written_before_conv, conv_inputs, False, id="cat-x-mul_-before-conv"),
    pytest.param(cat_form_weight_written_before_conv, conv_inputs, True, id="cat-weight-mul_-before-conv"),
    pytest.param(cat_form_alias_read_before_conv, aliased_conv_inputs, False, id="cat-alias-read-before-conv"),
    pytest.param(roll_x_zeroed_before_readout, conv_inputs, False, id="roll-x-zero_-before-readout"),
    pytest.param(roll_x_written_by_out_kwarg, conv_inputs, False, id="roll-x-out=-before-readout"),
    pytest.param(roll_weight_written_after_readout, conv_inputs, False, id="roll-weight-mul_-after-readout"),
    pytest.param(roll_bias_zeroed_before_silu, conv_inputs, False, id="roll-bias-zero_-before-silu"),
    pytest.param(roll_alias_zeroed_before_readout, aliased_conv_inputs, False, id="roll-alias-zero_-before-readout"),
    pytest.param(roll_state_view_read_after_roll, conv_inputs, False, id="roll-old-view-read-after"),
    pytest.param(cat_slice_copy_x_written, conv_inputs, False, id="cat-slice-copy_-x-mul_"),
    pytest.param(returned_window_x_written, conv_inputs, False, id="returned-window-x-zero_"),
    pytest.param(returned_window_alias_written, aliased_conv_inputs, True, id="returned-window-alias-zero_"),
    pytest.param(returned_window_alias_written_between_reads, aliased_conv_inputs, False,
                 id="returned-window-alias-zero_-between-reads"),
    pytest.param(mambapy_alias_written_between_conv_and_window, lambda: aliased_conv_inputs(S=W - 1), False,
                 id="mambapy-alias-zero_-between-conv-and-window"),
    pytest.param(mambapy_conv_weight_written, lambda: conv_inputs(S=W - 1), False, id="mambapy-weight-zero_"),
]


@pytest.mark.parametrize("fn, make_inputs, rewritten", CONV_CASES)
def test_conv_step_with_inplace_write(fn, make_inputs, rewritten):
    _check(fn, make_inputs, rewritten, "conv_update")


@pytest.mark.parametrize("fn, make_inputs", [
    pytest.param(x_zeroed_before_skip, state_inputs, id="state-x-zero_"),
    pytest.param(roll_weight_written_after_readout, conv_inputs, id="conv-weight-mul_"),
])
def test_through_inductor(fn, make_inputs):
    _check_equal(fn, make_inputs, lambda f: torch.compile(f, backend="ssm", fullgraph=True))
