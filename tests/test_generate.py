"""Decode passes and greedy generation: HF ``MambaForCausalLM.generate`` under ``backend="ssm"``.

Pass tests capture small functions (HF 5.x's own decode fallbacks, and near-misses of them) with
a local pass manager running only ``passes/decode.py``; the generation tests run the whole
backend on a tiny random model on CPU.
"""
import functools

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from transformers import MambaConfig, MambaForCausalLM
from transformers.models.mamba import modeling_mamba

from ssm_compile.kernels.decode import op as decode_op
from ssm_compile.kernels.decode.reference import selective_state_update_ref
from ssm_compile.passes import decode
from ssm_compile.passes.fx_utils import normalized_graph_str
from ssm_compile.passes.manager import PassManager
from utils import TOL, rel_err

# Dynamo traces into the hub-kernel wrappers' torch fallbacks, exactly as in generate().
hf_state_update = modeling_mamba.mamba_selective_state_update
hf_conv_update = modeling_mamba.causal_conv1d_update


@pytest.fixture(autouse=True)
def _fresh():
    decode_op.register()
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class Captured:
    """Compile ``fn`` with a backend that runs only the decode passes and keeps what they did."""

    def __init__(self, fn):
        self.ctx = None
        self.graph = ""
        self.fn = torch.compile(fn, backend=self._backend, fullgraph=True)

    def _backend(self, gm, example_inputs):
        pm = PassManager()
        decode.register(pm)
        self.ctx = pm(gm)
        self.graph = normalized_graph_str(gm)
        return gm.forward

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _state_inputs(batch=2, dim=8, N=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = functools.partial(torch.randn, generator=g)
    return dict(state=r(batch, dim, N), x=r(batch, dim).to(dtype), dt=r(batch, dim).to(dtype),
                A=-torch.rand(dim, N, generator=g) - 0.1, B=r(batch, N).to(dtype), C=r(batch, N).to(dtype),
                D=r(dim), z=r(batch, dim).to(dtype), dt_bias=r(dim))


def _conv_inputs(batch=2, dim=8, W=4, S=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(batch, dim, 1, generator=g).to(dtype),
                conv_state=torch.randn(batch, dim, S, generator=g).to(dtype),
                weight=torch.randn(dim, W, generator=g).to(dtype), bias=torch.randn(dim, generator=g).to(dtype))


def _run_both(fn, inputs, mutated):
    """Run eager and captured on separate copies; returns (eager out, compiled out, states, captured)."""
    eager_in = {k: v.clone() for k, v in inputs.items()}
    comp_in = {k: v.clone() for k, v in inputs.items()}
    cap = Captured(fn)
    y_e, y_c = fn(**eager_in), cap(**comp_in)
    return y_e, y_c, eager_in[mutated], comp_in[mutated], cap


class TestDecodePasses(expecttest.TestCase):
    def test_hf_state_update_rewritten(self):
        def step(state, x, dt, A, B, C, D, z, dt_bias):
            return hf_state_update(state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=True)

        for dtype in (torch.float32, torch.bfloat16):
            torch._dynamo.reset()
            counters.clear()
            y_e, y_c, s_e, s_c, cap = _run_both(step, _state_inputs(dtype=dtype), "state")
            assert counters["ssm"]["state_update"] == 1 and not cap.ctx.misses
            assert y_c.dtype == y_e.dtype == dtype
            # In bf16, HF rounds dt + dt_bias and the state (before the readout) to bf16; the op
            # keeps fp32, so it is held to the fp64 reference, and eager only to bf16 accuracy.
            inp = _state_inputs(dtype=dtype)
            y_ref, s_ref = selective_state_update_ref(inp.pop("state"), **inp, dt_softplus=True)
            assert rel_err(y_c, y_ref) < TOL[dtype] and rel_err(s_c, s_ref) < TOL[torch.float32]
            assert rel_err(y_c, y_e) < 2 * TOL[dtype] and rel_err(s_c, s_e) < TOL[dtype]
        self.assertExpectedInline(cap.graph, """\
%L_A_ = placeholder
%L_B_ = placeholder
%L_C_ = placeholder
%L_D_ = placeholder
%L_dt_ = placeholder
%L_dt_bias_ = placeholder
%L_state_ = placeholder
%L_x_ = placeholder
%L_z_ = placeholder
%selective_state_update_1 = torch.ops.ssm.selective_state_update.default(%L_state_, %L_x_, %L_dt_, %L_A_, %L_B_, %L_C_, %L_D_, %L_z_, %L_dt_bias_, True)
return (%selective_state_update_1,)
""")

    def test_hf_conv_update_rewritten(self):
        def step(x, conv_state, weight, bias):
            return hf_conv_update(x, conv_state, weight, bias, activation="silu")

        for dtype in (torch.float32, torch.bfloat16):
            torch._dynamo.reset()
            counters.clear()
            y_e, y_c, s_e, s_c, cap = _run_both(step, _conv_inputs(dtype=dtype), "conv_state")
            assert counters["ssm"]["conv_update"] == 1 and not cap.ctx.misses
            assert y_c.dtype == dtype and rel_err(y_c, y_e) < TOL[dtype]
            assert torch.equal(s_c, s_e)
        self.assertExpectedInline(cap.graph, """\
%L_bias_ = placeholder
%L_conv_state_ = placeholder
%L_weight_ = placeholder
%L_x_ = placeholder
%causal_conv1d_update_1 = torch.ops.ssm.causal_conv1d_update.default(%L_x_, %L_conv_state_, %L_weight_, %L_bias_, 'silu')
return (%causal_conv1d_update_1,)
""")

    def test_minimal_variants_rewritten(self):
        """No bias/softplus/D/z, the readout as (h * C).sum(-1), and a conv without activation."""

        def state_step(state, x, dt, A, B, C):
            dA = torch.exp(dt.unsqueeze(-1) * A)
            h = state * dA + dt[..., None] * x[..., None] * B[:, None, :]
            state.copy_(h)
            return (h * C[:, None, :]).sum(-1)

        inp = _state_inputs()
        inp = {k: inp[k] for k in ("state", "x", "dt", "A", "B", "C")}
        y_e, y_c, s_e, s_c, cap = _run_both(state_step, inp, "state")
        assert counters["ssm"]["state_update"] == 1
        assert rel_err(y_c, y_e) < TOL[torch.float32] and rel_err(s_c, s_e) < TOL[torch.float32]
        self.assertExpectedInline(cap.graph, """\
%L_A_ = placeholder
%L_B_ = placeholder
%L_C_ = placeholder
%L_dt_ = placeholder
%L_state_ = placeholder
%L_x_ = placeholder
%selective_state_update_1 = torch.ops.ssm.selective_state_update.default(%L_state_, %L_x_, %L_dt_, %L_A_, %L_B_, %L_C_, None, None, None, False)
return (%selective_state_update_1,)
""")

        def conv_step(x, conv_state, weight):
            return hf_conv_update(x, conv_state, weight, None, activation=None)

        inp = _conv_inputs(W=3, S=5)
        inp.pop("bias")
        y_e, y_c, s_e, s_c, cap = _run_both(conv_step, inp, "conv_state")
        assert counters["ssm"]["conv_update"] == 1
        assert rel_err(y_c, y_e) < TOL[torch.float32] and torch.equal(s_c, s_e)


def _state_near_misses():
    def other_dt(state, x, dt, A, B, C, D, z, dt_bias):
        # The input term uses a different dt than the decay: not a discretised SSM step.
        h = state * torch.exp(dt[..., None] * A) + (dt * 2)[..., None] * B[:, None, :] * x[..., None]
        state.copy_(h)
        return torch.matmul(h, C.unsqueeze(-1)).squeeze(-1)

    def softplus_beta(state, x, dt, A, B, C, D, z, dt_bias):
        dt = F.softplus(dt + dt_bias, beta=2.0)
        h = state * torch.exp(dt[..., None] * A) + dt[..., None] * B[:, None, :] * x[..., None]
        state.copy_(h)
        return torch.matmul(h, C.unsqueeze(-1)).squeeze(-1)

    def state_read_later(state, x, dt, A, B, C, D, z, dt_bias):
        y = hf_state_update(state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=True)
        return y + state.sum(-1)  # reads the state after the update

    def readout_over_dim(state, x, dt, A, B, C, D, z, dt_bias):
        h = state * torch.exp(dt[..., None] * A) + dt[..., None] * B[:, None, :] * x[..., None]
        state.copy_(h)
        return (h * C[:, None, :]).sum(1)  # sums over channels, not over N

    def not_exp(state, x, dt, A, B, C, D, z, dt_bias):
        h = state * torch.sigmoid(dt[..., None] * A) + dt[..., None] * B[:, None, :] * x[..., None]
        state.copy_(h)
        return torch.matmul(h, C.unsqueeze(-1)).squeeze(-1)

    def state_alias_used(state, x, dt, A, B, C, D, z, dt_bias):
        s = state.float()  # fp32 -> fp32 returns the state itself: an alias
        h = s * torch.exp(dt[..., None] * A) + dt[..., None] * B[:, None, :] * x[..., None]
        state.copy_(h)
        seen = s.sum(-1)  # after the copy_: sees the new state
        return torch.matmul(h, C.unsqueeze(-1)).squeeze(-1) + seen

    return [("other-dt", other_dt, "same dt"), ("state-alias-used", state_alias_used, "state is also used"),
            ("softplus-beta2", softplus_beta, "beta=2"),
            ("state-read-after", state_read_later, "state is also used"),
            ("readout-over-dim", readout_over_dim, "not (h * C[:, None, :]).sum(-1)"),
            ("decay-not-exp", not_exp, "not exp(dt * A)")]


@pytest.mark.parametrize("fn,reason", [c[1:] for c in _state_near_misses()], ids=[c[0] for c in _state_near_misses()])
def test_state_update_near_miss(fn, reason):
    y_e, y_c, s_e, s_c, cap = _run_both(fn, _state_inputs(), "state")
    assert counters["ssm"]["state_update"] == 0
    assert any(reason in m.reason for m in cap.ctx.misses if m.family == "state_update"), cap.ctx.misses
    assert "selective_state_update" not in cap.graph
    assert torch.equal(y_c, y_e) and torch.equal(s_c, s_e)


def _conv_near_misses():
    def wrong_roll(x, conv_state, weight, bias):
        hs = torch.cat([conv_state, x], dim=-1)
        conv_state.copy_(hs[:, :, -conv_state.shape[-1] - 1:-1])  # keeps the wrong window
        return F.silu(F.conv1d(hs, weight.unsqueeze(1), bias, groups=hs.shape[1])[:, :, -1:])

    def first_output(x, conv_state, weight, bias):
        hs = torch.cat([conv_state, x], dim=-1)
        conv_state.copy_(hs[:, :, -conv_state.shape[-1]:])
        return F.conv1d(hs, weight.unsqueeze(1), bias, groups=hs.shape[1])[:, :, :1]  # not the last step

    def padded(x, conv_state, weight, bias):
        hs = torch.cat([conv_state, x], dim=-1)
        conv_state.copy_(hs[:, :, -conv_state.shape[-1]:])
        return F.conv1d(hs, weight.unsqueeze(1), bias, padding=1, groups=hs.shape[1])[:, :, -1:]

    def window_reused(x, conv_state, weight, bias):
        hs = torch.cat([conv_state, x], dim=-1)
        conv_state.copy_(hs[:, :, -conv_state.shape[-1]:])
        y = F.conv1d(hs, weight.unsqueeze(1), bias, groups=hs.shape[1])[:, :, -1:]
        return y + hs.mean(-1, keepdim=True)

    return [("wrong-roll", wrong_roll, "not the last S=4"), ("first-output", first_output, "last T=1"),
            ("padding-1", padded, "padding=1"), ("window-reused", window_reused, "other than one roll")]


@pytest.mark.parametrize("fn,reason", [c[1:] for c in _conv_near_misses()], ids=[c[0] for c in _conv_near_misses()])
def test_conv_update_near_miss(fn, reason):
    y_e, y_c, s_e, s_c, cap = _run_both(fn, _conv_inputs(), "conv_state")
    assert counters["ssm"]["conv_update"] == 0
    assert any(reason in m.reason for m in cap.ctx.misses if m.family == "conv_update"), cap.ctx.misses
    assert "causal_conv1d_update" not in cap.graph
    assert torch.equal(y_c, y_e) and torch.equal(s_c, s_e)


def test_state_update_refuses_bf16_state():
    """A bf16 recurrent state would be rounded differently by the op (fp32 state): refused."""
    inp = _state_inputs()
    inp["state"] = inp["state"].bfloat16()

    def step(state, x, dt, A, B, C, D, z, dt_bias):
        return hf_state_update(state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=True)

    y_e, y_c, s_e, s_c, cap = _run_both(step, inp, "state")
    assert counters["ssm"]["state_update"] == 0
    assert any("fp32" in m.reason for m in cap.ctx.misses)
    assert torch.equal(y_c, y_e) and torch.equal(s_c, s_e)


# ---------------------------------------------------------------------------------------------
# generate() through the whole backend
# ---------------------------------------------------------------------------------------------

LAYERS = 2


def _tiny_model():
    torch.manual_seed(0)
    cfg = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=LAYERS, expand=2,
                      conv_kernel=4, time_step_rank=2)
    return MambaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def generated():
    """Eager and ``backend="ssm"`` greedy generations, and the dynamo/ssm counters after each."""
    torch._dynamo.reset()
    counters.clear()
    model = _tiny_model()
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    eager = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    model.forward = torch.compile(model.forward, backend="ssm")
    first = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    after_first = {k: dict(v) for k, v in counters.items()}
    longer = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
    after_second = {k: dict(v) for k, v in counters.items()}
    eager_longer = _tiny_model().generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                                          do_sample=False)
    torch._dynamo.reset()
    return dict(eager=eager, first=first, longer=longer, eager_longer=eager_longer,
                after_first=after_first, after_second=after_second)


def test_generate_tokens_equal_eager(generated):
    assert torch.equal(generated["first"], generated["eager"])
    assert torch.equal(generated["longer"], generated["eager_longer"])


def test_generate_does_not_recompile_per_token(generated):
    # One graph for the prefill, one for every decode step: a recompile per token would add a
    # frame (and a unique graph) for each new token, and a second generate() would add more.
    first, second = generated["after_first"], generated["after_second"]
    assert first["stats"]["unique_graphs"] == 2, first["stats"]
    assert first["frames"]["total"] == 2, first["frames"]
    assert second["stats"]["unique_graphs"] == 2 and second["frames"]["total"] == 2
    assert not second.get("recompiles")


def test_generate_decode_rewrites_fired(generated):
    ssm = generated["after_second"]["ssm"]
    assert ssm["state_update"] == LAYERS and ssm["conv_update"] == LAYERS, ssm


def test_generate_dynamic_rewrites_every_layers_decode_step():
    """Under ``dynamic=True`` the decode graph reads ``conv_states.size()`` for HF's ``[..., -W:]``
    bound; a read of the shape sees the same shape after the update (probe BS: layer 0's conv
    update was left alone, "also used by ['size_2']")."""
    from ssm_compile.compiler import SSMBackend
    from ssm_compile.config import SSMOptions

    torch._dynamo.reset()
    records = []
    model = _tiny_model()
    prompt = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False)
    eager = model.generate(prompt, **kw)
    model.forward = torch.compile(model.forward, backend=SSMBackend(SSMOptions(), on_graph=records.append),
                                  dynamic=True)
    try:
        assert torch.equal(model.generate(prompt, **kw), eager)
    finally:
        torch._dynamo.reset()
    decode_graphs = [g for g in records if any(r.family == "state_update" for r in g.rewrites)]
    assert decode_graphs, [sorted(r.family for r in g.rewrites) for g in records]
    for g in decode_graphs:
        families = [r.family for r in g.rewrites]
        assert families.count("conv_update") == LAYERS and families.count("state_update") == LAYERS, g.misses


def test_prefill_scan_returns_last_state_into_cache():
    """The prefill's scan (the scan passes' pattern) emits return_last_state=True, and that state
    is what the cache's copy_ stores; the decode graph writes its caches only through the ops."""
    import re

    from ssm_compile.compiler import SSMBackend
    from ssm_compile.config import SSMOptions

    records = []
    model = _tiny_model()
    model.forward = torch.compile(model.forward,
                                  backend=SSMBackend(SSMOptions(inductor=False), on_graph=records.append))
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    prefill, decode_step = (r.after for r in records)
    scans = re.findall(r"(\w+) = torch\.ops\.ssm\.selective_scan\.default\((.*)\);", prefill)
    assert len(scans) == LAYERS, prefill
    for name, args in scans:
        assert args.split(", ")[-1] == "True", f"return_last_state is not True: {args}"
        last_state = re.search(rf"(\w+) = {name}\[1\]", prefill).group(1)
        assert re.search(rf"\.copy_\({last_state}\)", prefill), f"{last_state} is not copied into the cache"
    assert "copy_" not in decode_step and "torch.cat" not in decode_step
    assert decode_step.count("ssm.selective_state_update.default(") == LAYERS
    assert decode_step.count("ssm.causal_conv1d_update.default(") == LAYERS
