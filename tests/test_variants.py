"""Mamba-1 variants and look-alikes the passes were not written against.

The passes must match by what code computes, not by names: HF FalconMamba (RMS norms on B, C, Δ)
and Jamba (weighted RMS norms: B = w · rms(B_raw)), mamba.py's ``selective_scan_seq`` (the states
are stacked and read out after the loop), hand-written blocks in other spellings, and a
bidirectional (Vim-style) block. Look-alikes that compute something else (a tanh recurrence, a
state reset, a lagged readout or input, an EMA, a gated RNN) must be left alone, with a reason
in the report, and still give eager's result.

Most cases run the full pass pipeline without inductor (``backend(inductor=False)``): the
rewrite is what is under test, and inductor's CPU compile would dominate the run time; one Jamba
case goes through ``backend="ssm"`` end to end.
"""
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch._dynamo.utils import counters
from test_pass_scan_inplace import _down, _padded_copies, _up_pairs
from utils import (TOL, assert_one_graph, check_explained_against_fp64, compile_with_passes, perturbed, rel_err,
                   tiny_falcon_mamba, tiny_jamba)

from ssm_compile.compiler import backend
from ssm_compile.passes import scan_loop
from ssm_compile.passes.fx_utils import normalized_graph_str
from ssm_compile.report import explain

BATCH, DIM, N, L = 2, 6, 4, 9
MIXER = ("scan", "discretization", "readout", "delta", "skip", "gate")
# HF's mamba_selective_scan calls lru_cache'd feature probes; dynamo's warning about them is noise here.
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


def run(fn, *args, **kwargs):
    """Compile with every ssm pass and no inductor; return (out, eager out)."""
    with torch.no_grad():
        ref = fn(*args, **kwargs)
        out = torch.compile(fn, backend=backend(inductor=False), fullgraph=True)(*args, **kwargs)
    return out, ref


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def assert_close(out, ref):
    for o, r in zip(as_tuple(out), as_tuple(ref), strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert rel_err(o, r) <= TOL[torch.float32]


def expected(scan, n=1, families=MIXER, conv1d=0):
    counts = {(scan if f == "scan" else f): n for f in families}
    return counts | ({"conv1d": conv1d} if conv1d else {})


def make_inputs(layout="bdl"):
    g = torch.Generator().manual_seed(0)
    u = torch.randn(BATCH, DIM, L, generator=g)
    delta = torch.rand(BATCH, DIM, L, generator=g) * 0.5 + 0.05
    A = -torch.rand(DIM, N, generator=g) - 0.5
    B = torch.randn(BATCH, N, L, generator=g)
    C = torch.randn(BATCH, N, L, generator=g)
    if layout == "bld":
        u, delta, B, C = (t.transpose(1, 2).contiguous() for t in (u, delta, B, C))
    return u, delta, A, B, C


# --- HF FalconMamba and Jamba ---------------------------------------------------------------

VOCAB = 64


def hf():
    # Only the HF cases need transformers; the rest of this file runs without it.
    return pytest.importorskip("transformers", reason="the HF variant tests need transformers")


def falcon_mamba(assoc):
    hf()
    return tiny_falcon_mamba(VOCAB, use_associative_scan=assoc)


def jamba(assoc):
    hf()
    return tiny_jamba(VOCAB, use_associative_scan=assoc)


@pytest.mark.parametrize("make", [falcon_mamba, jamba], ids=["falcon-mamba", "jamba"])
@pytest.mark.parametrize("assoc", [False, True], ids=["loop", "assoc"])
def test_hf_variant_every_mixer_is_rewritten(make, assoc):
    model = make(assoc)
    ids = torch.randint(0, VOCAB, (2, L), generator=torch.Generator().manual_seed(1))
    out, ref = run(model, ids, use_cache=False)
    assert dict(counters["ssm"]) == expected("scan_assoc" if assoc else "scan_loop", 2, conv1d=2)
    assert counters["stats"]["unique_graphs"] == 1
    assert rel_err(out.logits, ref.logits) <= TOL[torch.float32]


def test_jamba_end_to_end_with_inductor():
    model = jamba(assoc=False)
    ids = torch.randint(0, VOCAB, (2, L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        out = torch.compile(model, backend="ssm")(ids, use_cache=False).logits
    assert dict(counters["ssm"]) == expected("scan_loop", 2, conv1d=2)
    assert rel_err(out, ref) <= TOL[torch.float32]


def test_jamba_generate_matches_eager_and_decode_is_rewritten():
    """Greedy generation of the hybrid model: the prefill scans and every decode step's
    state/conv updates of both mamba layers are rewritten; the tokens are eager's."""
    model = jamba(assoc=True)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    eager = model.generate(prompt, **kwargs)
    model.forward = torch.compile(model.forward, backend=backend(inductor=False))
    out = model.generate(prompt, **kwargs)
    assert torch.equal(out, eager)
    ssm = counters["ssm"]
    assert ssm["scan_assoc"] == 2 and ssm["conv1d"] == 2
    # Each decode graph (dynamo may compile one more as the attention cache grows) has both layers'.
    assert ssm["state_update"] >= 2 and ssm["state_update"] % 2 == 0 and ssm["conv_update"] == ssm["state_update"]


# --- HF Zamba: Mamba-1 split into independent heads ------------------------------------------

def tiny_zamba():
    """Six Zamba layers (a shared attention block at layers 2 and 5, as its weight tying expects),
    each with a Mamba mixer of two heads: per-head x_proj/dt_proj weights (batched matmuls, not
    nn.Linear) and one ``mamba_selective_scan`` call per head."""
    transformers = hf()
    if not hasattr(transformers, "ZambaConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Zamba")
    cfg = transformers.ZambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, attn_layer_period=3,
        attn_layer_offset=2, num_attention_heads=2, num_key_value_heads=2, attention_hidden_size=64,
        attention_head_dim=32, mamba_d_state=N, mamba_d_conv=4, mamba_expand=2, n_mamba_heads=2,
        mamba_dt_rank=4, use_mamba_kernels=False)
    torch.manual_seed(0)
    model = perturbed(transformers.ZambaForCausalLM(cfg))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def test_zamba_every_head_scan_is_rewritten():
    model = tiny_zamba()
    ids = torch.randint(0, VOCAB, (2, L), generator=torch.Generator().manual_seed(1))
    out, ref = run(model, ids, use_cache=False)
    fired = counters["ssm"]
    # 6 mixers x 2 heads; the heads share each mixer's conv.
    scans = fired["scan_assoc"] + fired["scan_loop"]
    assert scans == 12 and fired["conv1d"] == 6, dict(fired)
    assert all(fired[f] == 12 for f in ("discretization", "readout", "delta", "skip", "gate")), dict(fired)
    assert rel_err(out.logits, ref.logits) <= TOL[torch.float32]


def test_zamba_generate_matches_eager_and_decode_is_rewritten():
    model = tiny_zamba()
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    eager = model.generate(prompt, **kwargs)
    model.forward = torch.compile(model.forward, backend=backend(inductor=False))
    out = model.generate(prompt, **kwargs)
    assert torch.equal(out, eager)
    fired = counters["ssm"]
    # Every decode graph updates all 12 head states (two heads' rows of each mixer's cache
    # tensor) and the 6 mixers' conv states.
    assert fired["conv_update"] >= 6 and fired["conv_update"] % 6 == 0, dict(fired)
    assert fired["state_update"] == 2 * fired["conv_update"], dict(fired)


# --- mamba.py (alxndrTL) ---------------------------------------------------------------------

class RMSNorm(nn.Module):
    """mamba.py's RMSNorm: ``x * rsqrt(mean(x²) + eps) * weight`` (its ``inner_layernorms``)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


def selective_scan_seq(x, delta, A, B, C, D, last_state=False):
    """mamba.py's ``selective_scan_seq``: (B, L, ED) layout, states stacked, readout after the loop."""
    _, length, _ = x.shape
    deltaA = torch.exp(delta.unsqueeze(-1) * A)
    deltaB = delta.unsqueeze(-1) * B.unsqueeze(2)
    BX = deltaB * (x.unsqueeze(-1))
    h = torch.zeros(x.size(0), A.shape[0], A.shape[1], device=deltaA.device)
    hs = []
    for t in range(0, length):
        h = deltaA[:, t] * h + BX[:, t]
        hs.append(h)
    hs = torch.stack(hs, dim=1)
    y = (hs @ C.unsqueeze(-1)).squeeze(3)
    y = y + D * x
    return (y, hs[:, -1]) if last_state else y


def selective_scan_parallel(x, delta, A, B, C, D):
    """mamba.py's ``selective_scan`` with its default parallel scan: the states by in-place
    up/down sweeps over padded copies of exp(Δ·A) and Δ·B·u (test_pass_scan_inplace's sweeps)."""
    deltaA = torch.exp(delta.unsqueeze(-1) * A)
    BX = delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
    Ac, Xc, T = _padded_copies(deltaA, BX)
    _up_pairs(Ac, Xc, T)
    _down(Ac, Xc, T)
    hs = Xc.transpose(1, 2)[:, :x.shape[1]]
    return (hs @ C.unsqueeze(-1)).squeeze(3) + D * x


class MambaPyBlock(nn.Module):
    """mamba.py's ``MambaBlock`` (sequential path, or ``parallel`` for its in-place parallel scan);
    ``bidirectional`` adds its Vim-style backward branch: a second scan over ``xz.flip([1])``
    whose output is flipped back."""

    def __init__(self, d_model=8, d_state=4, dt_rank=2, inner_layernorms=False, bidirectional=False,
                 parallel=False):
        super().__init__()
        ed = 2 * d_model
        self.d_state, self.dt_rank, self.bidirectional = d_state, dt_rank, bidirectional
        self.scan = selective_scan_parallel if parallel else selective_scan_seq
        self.in_proj = nn.Linear(d_model, 2 * ed, bias=False)
        self.x_proj = nn.Linear(ed, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, ed, bias=True)
        self.out_proj = nn.Linear(ed, d_model, bias=False)
        self.norms = nn.ModuleList([RMSNorm(d) for d in (dt_rank, d_state, d_state)]) if inner_layernorms else None
        self.branches = nn.ModuleList([self._branch(ed, d_state) for _ in range(2 if bidirectional else 1)])

    @staticmethod
    def _branch(ed, d_state):
        branch = nn.Module()
        branch.conv1d = nn.Conv1d(ed, ed, kernel_size=4, bias=True, groups=ed, padding=3)
        branch.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32).repeat(ed, 1)))
        branch.D = nn.Parameter(torch.ones(ed))
        return branch

    def forward(self, x):
        length = x.shape[1]
        xz = self.in_proj(x)
        outs = []
        for branch, xz_dir in zip(self.branches, (xz, xz.flip([1]))):
            xi, z = xz_dir.chunk(2, dim=-1)
            xi = F.silu(branch.conv1d(xi.transpose(1, 2))[:, :, :length].transpose(1, 2))
            outs.append(self.ssm(xi, branch) * F.silu(z))
        y = outs[0] + outs[1].flip([1]) if self.bidirectional else outs[0]
        return self.out_proj(y)

    def ssm(self, x, branch):
        A = -torch.exp(branch.A_log.float())
        delta, B, C = torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.norms is not None:
            delta, B, C = (norm(v) for norm, v in zip(self.norms, (delta, B, C)))
        delta = (self.dt_proj.weight @ delta.transpose(1, 2)).transpose(1, 2)
        delta = F.softplus(delta + self.dt_proj.bias)
        return self.scan(x, delta, A, B, C, branch.D.float())


@pytest.mark.parametrize("parallel", [False, True], ids=["seq", "parallel"])
@pytest.mark.parametrize("norms, bidirectional", [(False, False), (True, False), (False, True)],
                         ids=["plain", "inner-layernorms", "bidirectional"])
def test_mambapy_block(norms, bidirectional, parallel):
    model = perturbed(MambaPyBlock(inner_layernorms=norms, bidirectional=bidirectional, parallel=parallel))
    x = torch.randn(2, L, 8, generator=torch.Generator().manual_seed(1))
    out, ref = run(model, x)
    branches = 2 if bidirectional else 1
    # mamba.py's dt_proj, (W @ dt.transpose(1, 2)).transpose(1, 2), is x_dt_proj's linear (run 64);
    # with the inner RMS norms dt_proj reads a norm of x_proj's columns, not the columns.
    x_dt = {} if norms else {"x_dt_proj": branches}
    assert dict(counters["ssm"]) == expected("scan_assoc" if parallel else "scan_loop", branches,
                                             conv1d=branches) | x_dt
    assert_close(out, ref)


def test_mambapy_stacked_states_last_state():
    u, delta, A, B, C = make_inputs("bld")
    D = torch.randn(DIM)
    def fn(x, delta, A, B, C, D):
        return selective_scan_seq(x, delta, A, B, C, D, last_state=True)

    cap, out = compile_with_passes(fn, u, delta, A, B, C, D, passes=(scan_loop,))
    assert dict(counters["ssm"]) == {"scan_loop": 1, "discretization": 1, "readout": 1}
    assert cap.ctx.rewrites[0].decision["collector"] == "states"
    assert cap.ctx.rewrites[0].decision["return_last_state"]
    assert_close(out, fn(u, delta, A, B, C, D))
    # The (batch, L, dim, N) stack of states is gone: the op returns y and the last state.
    assert_expected_inline(normalized_graph_str(cap.gm), """\
%L_A_ = placeholder
%L_B_ = placeholder
%L_C_ = placeholder
%L_D_ = placeholder
%L_delta_ = placeholder
%L_x_ = placeholder
%permute_1 = .permute(%L_x_, (0, 2, 1))
%permute_2 = .permute(%L_delta_, (0, 2, 1))
%permute_3 = .permute(%L_C_, (0, 2, 1))
%permute_4 = .permute(%L_B_, (0, 2, 1))
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%permute_1, %permute_2, %L_A_, %permute_4, %permute_3, None, None, None, False, None, True)
%getitem_1 = operator.getitem(%selective_scan_1, 0)
%permute_5 = .permute(%getitem_1, (0, 2, 1))
%getitem_2 = operator.getitem(%selective_scan_1, 1)
%mul_1 = operator.mul(%L_D_, %L_x_)
%add_1 = operator.add(%permute_5, %mul_1)
return (%add_1, %getitem_2)
""")


# --- hand-written blocks and spellings -------------------------------------------------------

class HandBlock(nn.Module):
    """A block written from the paper in (B, L, D): dt = softplus(dt_proj(x)) (Linear with bias),
    A a negative parameter (or -exp(A_log)), readout by einsum or matmul."""

    def __init__(self, d=12, n=4, r=3, a_direct=True, readout="einsum"):
        super().__init__()
        self.n, self.r, self.readout, self.a_direct = n, r, readout, a_direct
        self.in_proj = nn.Linear(d, 2 * d)
        self.x_proj = nn.Linear(d, r + 2 * n, bias=False)
        self.dt_proj = nn.Linear(r, d, bias=True)
        if a_direct:
            self.A = nn.Parameter(-torch.rand(d, n) - 0.5)
        else:
            self.A_log = nn.Parameter(torch.rand(d, n))
        self.D = nn.Parameter(torch.randn(d))
        self.out_proj = nn.Linear(d, d)

    def forward(self, x):
        xin, z = self.in_proj(x).chunk(2, dim=-1)
        xin = F.silu(xin)
        dt, B, C = self.x_proj(xin).split([self.r, self.n, self.n], dim=-1)
        dt = F.softplus(self.dt_proj(dt))
        A = self.A if self.a_direct else -torch.exp(self.A_log)
        dA = torch.exp(dt.unsqueeze(-1) * A)
        dBu = dt.unsqueeze(-1) * B.unsqueeze(2) * xin.unsqueeze(-1)
        h = torch.zeros(x.shape[0], x.shape[2], self.n)
        ys = []
        for t in range(x.shape[1]):
            h = dA[:, t] * h + dBu[:, t]
            if self.readout == "einsum":
                ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
            else:
                ys.append((h @ C[:, t].unsqueeze(-1)).squeeze(-1))
        y = torch.stack(ys, dim=1) + xin * self.D
        return self.out_proj(y * F.silu(z))


@pytest.mark.parametrize("a_direct, readout", [(True, "einsum"), (False, "matmul")],
                         ids=["A-param-einsum", "A_log-matmul"])
def test_hand_written_block(a_direct, readout):
    model = HandBlock(a_direct=a_direct, readout=readout)
    x = torch.randn(2, L, 12, generator=torch.Generator().manual_seed(1))
    out, ref = run(model, x)
    # x_proj -> split -> dt_proj (bias moved into the scan) is one ssm.x_dt_proj.
    assert dict(counters["ssm"]) == expected("scan_loop") | {"x_dt_proj": 1}
    assert_close(out, ref)


class ColumnParamBlock(nn.Module):
    """A (batch, dim, L) block whose D and dt bias are (dim, 1) parameters, broadcast along L as
    they are (no ``[:, None]``); ``d_shape`` (dim, L) makes D a time-varying skip instead."""

    def __init__(self, d=6, n=4, r=2, d_shape=None):
        super().__init__()
        self.n, self.r = n, r
        self.in_proj = nn.Linear(5, 2 * d)
        self.x_proj = nn.Linear(d, r + 2 * n, bias=False)
        self.dt_w = nn.Parameter(torch.randn(d, r) * 0.5)
        self.dt_b = nn.Parameter(torch.randn(d, 1) * 0.5)
        self.A_log = nn.Parameter(torch.log(torch.rand(d, n) + 0.5))
        self.D = nn.Parameter(torch.randn(*(d_shape or (d, 1))))
        self.out_proj = nn.Linear(d, 5)

    def forward(self, x):
        u, z = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)
        u = F.silu(u)
        dt, B, C = self.x_proj(u.transpose(1, 2)).split([self.r, self.n, self.n], dim=-1)
        dt = F.softplus(torch.einsum("dr,blr->bdl", self.dt_w, dt) + self.dt_b)
        A = -torch.exp(self.A_log)
        h = u.new_zeros(u.shape[0], u.shape[1], self.n)
        ys = []
        for t in range(u.shape[2]):
            h = torch.exp(dt[:, :, t, None] * A) * h + dt[:, :, t, None] * B[:, t, None, :] * u[:, :, t, None]
            ys.append((h * C[:, t, None, :]).sum(-1))
        y = torch.stack(ys, dim=-1) + u * self.D
        return self.out_proj((y * F.silu(z)).transpose(1, 2))


def test_column_shaped_D_and_dt_bias_fold_with_their_gradients():
    """(dim, 1) parameters hold the op's (dim,) vectors: the op gets their reshape (a view), so
    the forward and the gradients of the (dim, 1) parameters match eager."""
    torch.manual_seed(0)
    model = ColumnParamBlock()
    x = torch.randn(2, L, 5)
    report = explain(model, x)
    assert_one_graph(report)
    out = report.output
    assert dict(report.counts) == expected("scan_loop"), report.format(graphs=False)
    ref = model(x)
    assert rel_err(out, ref) <= TOL[torch.float32]
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, list(model.parameters()), grad)
    want = torch.autograd.grad(ref, list(model.parameters()), grad)
    for (name, p), g, w in zip(model.named_parameters(), got, want, strict=True):
        assert g.shape == p.shape, name
        assert rel_err(g, w) <= TOL[torch.float32], name
    assert "softplus(x + bias)" in str(report) and "y + u * D" in str(report)


@pytest.mark.parametrize("d_kind", ["0-dim", "(1,)", "(1, 1, 1)", "float", "int"])
def test_one_number_D_folds_with_its_gradient(d_kind):
    """A D that is one number for every channel (a 0-dim or one-element parameter, a Python
    number) is the op's skip broadcast to (dim,): skip and gate fold, and the parameter's gradient
    is eager's (the sum over channels, through the broadcast view)."""
    torch.manual_seed(0)
    model = HandBlock(a_direct=False, readout="matmul")
    del model.D
    if d_kind in ("float", "int"):
        model.D = 0.7 if d_kind == "float" else 2
    else:
        shape = {"0-dim": (), "(1,)": (1,), "(1, 1, 1)": (1, 1, 1)}[d_kind]
        model.D = nn.Parameter(torch.randn(shape))
    x = torch.randn(2, L, 12)
    compiled = torch.compile(model, backend=backend(inductor=False), fullgraph=True)
    out = compiled(x)
    assert dict(counters["ssm"]) == expected("scan_loop") | {"x_dt_proj": 1}
    ref = model(x)
    assert rel_err(out, ref) <= TOL[torch.float32]
    grad = torch.randn_like(ref)
    params = [p for _, p in model.named_parameters()]
    got = torch.autograd.grad(out, params, grad)
    want = torch.autograd.grad(ref, params, grad)
    for (name, p), g, w in zip(model.named_parameters(), got, want, strict=True):
        assert g.shape == p.shape, name
        assert rel_err(g, w) <= TOL[torch.float32], name


def test_time_varying_D_is_not_a_skip():
    """A (dim, L) D is a per-step weight, not the op's skip: left alone, with the reason."""
    torch.manual_seed(0)
    model = ColumnParamBlock(d_shape=(6, L))
    x = torch.randn(2, L, 5)
    out, ref = run(model, x)
    assert_close(out, ref)
    assert counters["ssm"]["skip"] == 0 and counters["ssm"]["gate"] == 0
    assert "not a (dim,) vector broadcast along the dim axis 1 of y" in str(explain(model, x))


def _disc(u, delta, A, B):
    return (torch.exp(torch.einsum("bdl,dn->bdln", delta, A)),
            torch.einsum("bdl,bnl,bdl->bdln", delta, B, u))


def swapped_operands(u, delta, A, B, C):
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = h * dA[:, :, t] + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def broadcast_sum_readout(u, delta, A, B, C):
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    y = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        y.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(y, dim=-1)


def addcmul_update(u, delta, A, B, C):
    """``h = addcmul(B_full[t], A_full[t], h)``: the update in one call, readout by torch.sum, cat."""
    dA, dBu = _disc(u, delta, A, B)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = torch.addcmul(dBu[:, :, t], dA[:, :, t], h)
        ys.append(torch.sum(h * C[:, :, t].unsqueeze(1), dim=-1).unsqueeze(-1))
    return torch.cat(ys, dim=-1)


def normed_B_C(u, delta, A, B, C, w):
    """selective_scan_ref on weighted-RMS-normed B and C (Jamba's inner norms, as a function)."""
    def rms(x):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    B = rms(B.transpose(1, 2)).transpose(1, 2)
    C = rms(C.transpose(1, 2)).transpose(1, 2)
    dA, dBu = _disc(u, delta, A, B)
    x = A.new_zeros((u.shape[0], u.shape[1], A.shape[1]))
    ys = []
    for i in range(u.shape[2]):
        x = dA[:, :, i] * x + dBu[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


H_GLOBAL = torch.randn(BATCH, DIM, N, generator=torch.Generator().manual_seed(7))


def global_initial_state(u, delta, A, B, C):
    """h_{-1} a module-level constant tensor (dynamo lifts it into the graph): its initial_state."""
    dA, dBu = _disc(u, delta, A, B)
    h = H_GLOBAL
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def constant_initial_state(u, delta, A, B, C):
    """A non-zero constant h_{-1} made inside the function: passed to the op as initial_state."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.full((u.shape[0], u.shape[1], A.shape[1]), 0.3)
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def ellipsis_einsum(u, delta, A, B, C):
    """einsum with ``...`` for the leading axes, in the discretisation and in the readout."""
    deltaA = torch.exp(torch.einsum("...dl,dn->...dln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = deltaA[..., t, :] * h + deltaB_u[..., t, :]
        ys.append(torch.einsum("...dn,...n->...d", h, C[..., t]))
    return torch.stack(ys, dim=-1)


def unbind_loop(u, delta, A, B, C):
    """``for dA_t, dBu_t, C_t in zip(dA.unbind(2), ...)``: time slices as unbind items."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for dA_t, dBu_t, C_t in zip(dA.unbind(2), dBu.unbind(dim=2), C.unbind(-1)):
        h = dA_t * h + dBu_t
        ys.append(torch.einsum("bdn,bn->bd", h, C_t))
    return torch.stack(ys, dim=-1)


def narrow_squeeze_loop(u, delta, A, B, C):
    """Time slices as width-1 pieces squeezed along time: ``narrow``, a ``t:t+1`` slice, select."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA.select(2, t) * h + dBu.narrow(2, t, 1).squeeze(2)
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t:t + 1].squeeze(-1)))
    return torch.stack(ys, dim=-1)


def split_loop(u, delta, A, B, C):
    """``zip(x.split(1, dim=2), ...)``: every item a width-1 piece, squeezed in the step."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for a_t, b_t, c_t in zip(dA.split(1, dim=2), torch.split(dBu, 1, 2), C.split(1, dim=-1)):
        h = a_t.squeeze(2) * h + b_t.squeeze(2)
        ys.append(torch.einsum("bdn,bn->bd", h, c_t.squeeze(-1)))
    return torch.stack(ys, dim=-1)


def readout_c_first(u, delta, A, B, C):
    """The readout as ``C_t @ h``, C on the left, its batch axes broadcast against h's."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append((C[:, None, None, :, t] @ h.unsqueeze(-1)).reshape(u.shape[0], u.shape[1]))
    return torch.stack(ys, dim=-1)


def prefix_loop(u, delta, A, B, C):
    """A loop over the first L - 3 steps only; the op reads its inputs' first L - 3 steps."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2] - 3):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def unbind_stacked_states(u, delta, A, B, C):
    """mamba.py's stacked-states loop over ``torch.unbind`` items, in its (B, L, ED) layout."""
    x, delta, B, C = (t.transpose(1, 2) for t in (u, delta, B, C))
    deltaA = torch.exp(delta.unsqueeze(-1) * A)
    BX = delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
    h = torch.zeros(x.size(0), A.shape[0], A.shape[1])
    hs = []
    for a, b in zip(torch.unbind(deltaA, 1), torch.unbind(BX, 1)):
        h = a * h + b
        hs.append(h)
    return (torch.stack(hs, dim=1) @ C.unsqueeze(-1)).squeeze(3)


def negated_exponent(u, delta, A, B, C):
    """``exp(-Δ·A_pos)`` with a positive A: the op gets -A_pos (negation is exact)."""
    A_pos = torch.exp(torch.log(-A))
    dA = torch.exp(-delta[..., None] * A_pos[None, :, None, :])
    dBu = delta[..., None] * B.transpose(1, 2)[:, None] * u[..., None]
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def negated_exponent_per_step(u, delta, A, B, C):
    A_pos = torch.exp(torch.log(-A))
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        dA = torch.exp(-(delta[:, :, t, None] * A_pos))
        h = dA * h + delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=-1)


@pytest.mark.parametrize("fn", [swapped_operands, broadcast_sum_readout, addcmul_update, constant_initial_state,
                                global_initial_state, ellipsis_einsum, unbind_loop, unbind_stacked_states,
                                negated_exponent, negated_exponent_per_step, narrow_squeeze_loop, split_loop,
                                readout_c_first, prefix_loop],
                         ids=["h*dA+dBu", "sum-readout", "addcmul-cat", "constant-initial-state",
                              "global-initial-state", "einsum-ellipsis", "unbind", "unbind-stacked-states",
                              "exp(-dt*A_pos)", "exp(-dt*A_pos)-per-step", "narrow-squeeze", "zip-split",
                              "C@h-readout", "prefix-loop"])
def test_spellings(fn):
    args = make_inputs()
    out, ref = run(fn, *args)
    assert dict(counters["ssm"]) == expected("scan_loop", families=("scan", "discretization", "readout"))
    assert_close(out, ref)


def test_prefix_loop_hands_its_last_state_and_gradients_on():
    # The state after the prefix is used after the loop: the op's last state, and gradients
    # flow to every input as in eager (the steps past the prefix get none).
    def fn(u, delta, A, B, C):
        dA, dBu = _disc(u, delta, A, B)
        h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
        ys = []
        for t in range(u.shape[2] - 2):
            h = dA[:, :, t] * h + dBu[:, :, t]
            ys.append((h * C[:, None, :, t]).sum(-1))
        return torch.stack(ys, dim=-1), torch.tanh(h)

    args = make_inputs()
    compiled = [a.clone().requires_grad_(True) for a in args]
    eager = [a.clone().requires_grad_(True) for a in args]
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(*compiled)
    ref = fn(*eager)
    assert counters["ssm"]["scan_loop"] == 1
    for o, r in zip(out, ref):
        assert_close(o, r)
    sum(o.sum() for o in out).backward()
    sum(r.sum() for r in ref).backward()
    for c, e in zip(compiled, eager):
        assert_close(c.grad, e.grad)


def test_normed_B_reaches_the_op_as_the_users_product():
    args = make_inputs() + (torch.randn(N),)
    cap, out = compile_with_passes(normed_B_C, *args, passes=(scan_loop,))
    assert dict(counters["ssm"]) == {"scan_loop": 1, "discretization": 1, "readout": 1}
    assert_close(out, normed_B_C(*args))
    # B and C reach the op as the user's own w · (x · rsqrt) values (as permuted views), not as
    # products the pass re-made.
    assert_expected_inline(normalized_graph_str(cap.gm), """\
%L_A_ = placeholder
%L_B_ = placeholder
%L_C_ = placeholder
%L_delta_ = placeholder
%L_u_ = placeholder
%L_w_ = placeholder
%transpose_1 = .transpose(%L_B_, 1, 2)
%pow_1 = .pow(%transpose_1, 2)
%mean_1 = .mean(%pow_1, -1, True)
%add_1 = operator.add(%mean_1, 1e-06)
%rsqrt_1 = torch.rsqrt(%add_1)
%mul_1 = operator.mul(%transpose_1, %rsqrt_1)
%mul_2 = operator.mul(%L_w_, %mul_1)
%transpose_2 = .transpose(%L_C_, 1, 2)
%pow_2 = .pow(%transpose_2, 2)
%mean_2 = .mean(%pow_2, -1, True)
%add_2 = operator.add(%mean_2, 1e-06)
%rsqrt_2 = torch.rsqrt(%add_2)
%mul_3 = operator.mul(%transpose_2, %rsqrt_2)
%mul_4 = operator.mul(%L_w_, %mul_3)
%transpose_3 = .transpose(%mul_4, 1, 2)
%permute_1 = .permute(%mul_2, (0, 2, 1))
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%L_u_, %L_delta_, %L_A_, %permute_1, %transpose_3, None, None, None, False, None, False)
%getitem_1 = operator.getitem(%selective_scan_1, 0)
return (%getitem_1,)
""")


def learned_initial_state(u, delta, A, B, C, h0):
    """h_{-1} a (dim, N) parameter shared by the batch: broadcast in the first update."""
    dA, dBu = _disc(u, delta, A, B)
    h = h0
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1), h


def test_broadcast_initial_state_forward_and_backward():
    u, delta, A, B, C = make_inputs()
    h0 = torch.randn(DIM, N, generator=torch.Generator().manual_seed(1), requires_grad=True)
    A.requires_grad_(True)
    ref = learned_initial_state(u, delta, A, B, C, h0)
    out = torch.compile(learned_initial_state, backend=backend(inductor=False), fullgraph=True)(u, delta, A, B, C, h0)
    assert dict(counters["ssm"]) == {"scan_loop": 1, "discretization": 1, "readout": 1}
    assert_close(out, ref)
    grads = torch.autograd.grad(sum(o.square().sum() for o in out), (h0, A))
    ref_grads = torch.autograd.grad(sum(r.square().sum() for r in ref), (h0, A))
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= TOL[torch.float32]


def test_negated_exponent_hands_the_op_minus_A():
    args = make_inputs()
    cap, out = compile_with_passes(negated_exponent, *args, passes=(scan_loop,))
    assert_close(out, negated_exponent(*args))
    scan = next(n for n in cap.gm.graph.nodes if n.target == torch.ops.ssm.selective_scan.default)
    A = scan.args[2]
    assert A.target is operator.neg and A.args[0].target is torch.exp  # -(A_pos), A_pos = exp(log(-A))


# --- look-alikes that must be left alone ----------------------------------------------------

def einsum_sums_over_dim(u, delta, A, B, C):
    """``'...l,dn->...ln'``: the ellipsis is (batch, dim) and A's d is summed, so the exponent is
    Δ[b, d, l] · Σ_d' A[d', n], not Δ·A."""
    deltaA = torch.exp(torch.einsum("...l,dn->...ln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = deltaA[:, :, t] * h + deltaB_u[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def tanh_recurrence(u, delta, A, B, C):
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = torch.tanh(dA[:, :, t] * h + dBu[:, :, t])
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def reset_midway(u, delta, A, B, C):
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        if t == u.shape[2] // 2:
            h = torch.zeros_like(h)
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def readout_before_update(u, delta, A, B, C):
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
        h = dA[:, :, t] * h + dBu[:, :, t]
    return torch.stack(ys, dim=-1)


def lagged_input(u, delta, A, B, C):
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        u_prev = u[:, :, t - 1] if t > 0 else torch.zeros_like(u[:, :, 0])
        h = dA[:, :, t] * h + delta[:, :, t, None] * B[:, None, :, t] * u_prev[..., None]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def lagged_narrow(u, delta, A, B, C):
    """``dBu.narrow(2, t - 1, 1)``: at t = 0 the piece wraps to the last step, later ones lag."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu.narrow(2, t - 1, 1).squeeze(2)
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def two_step_pieces(u, delta, A, B, C):
    """``x[:, :, t:t+2].sum(2)``: a width-2 piece reduced, not one time slice."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2] - 1):
        h = dA[:, :, t] * h + dBu[:, :, t:t + 2].sum(2)
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def lerp_update(u, delta, A, B, C):
    """``h = torch.lerp(dBu_t, h, dA_t)`` = dA_t*h + (1 - dA_t)*dBu_t: linear, but its input term
    is not Δ·B·u."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = torch.lerp(dBu[:, :, t], h, dA[:, :, t])
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def first_state_is_a_slice(u, delta, A, B, C):
    """``h = dBu[t]`` at t = 0 (the ``h is None`` idiom), then the update from t = 1."""
    dA, dBu = _disc(u, delta, A, B)
    h = None
    ys = []
    for t in range(u.shape[2]):
        h = dBu[:, :, t] if h is None else dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def lagged_c_first(u, delta, A, B, C):
    """``C[..., t - 1] @ h``: the C-first readout one step late."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append((C[:, None, None, :, t - 1] @ h.unsqueeze(-1)).reshape(u.shape[0], u.shape[1]))
    return torch.stack(ys, dim=-1)


def reversed_loop(u, delta, A, B, C):
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in reversed(range(u.shape[2])):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def reversed_per_step_loop(u, delta, A, B, C):
    """The same reverse walk with the decay computed in each step (run 41: was "no state chain")."""
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in reversed(range(u.shape[2])):
        h = torch.exp(delta[:, :, t, None] * A) * h + (delta[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def two_state_factors(u, delta, A, B, C):
    """B_full = Δ·B·C·u: two (batch, state, time) factors that no single value multiplies."""
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = delta[..., None] * B.transpose(1, 2)[:, None] * C.transpose(1, 2)[:, None] * u[..., None]
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def stacked_states_other_use(u, delta, A, B, C):
    x, delta, B, C = (t.transpose(1, 2) for t in (u, delta, B, C))
    deltaA, BX = torch.exp(delta.unsqueeze(-1) * A), delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
    h = torch.zeros(x.size(0), A.shape[0], A.shape[1])
    hs = []
    for t in range(x.shape[1]):
        h = deltaA[:, t] * h + BX[:, t]
        hs.append(h)
    hs = torch.stack(hs, dim=1)
    return (hs @ C.unsqueeze(-1)).squeeze(3) + hs[:, :-1].sum()


def negated_B_full(u, delta, A, B, C):
    """B_full = -(Δ·B·u): negations are only looked through in the exponent."""
    dA = torch.exp(delta[..., None] * A[None, :, None, :])
    dBu = -(delta[..., None] * B.transpose(1, 2)[:, None] * u[..., None])
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def float64_state(u, delta, A, B, C):
    """The state kept in float64 on purpose: the op would accumulate fp32 inputs in float32."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1], dtype=torch.float64)
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t].double()))
    return torch.stack(ys, dim=-1)


def ema(u, delta, A, B, C):
    """h = 0.9·h + 0.1·x_t is linear, but its decay is no exp(Δ·A): exp(log 0.9) is not 0.9."""
    h = torch.zeros_like(u[:, :, 0])
    ys = []
    for t in range(u.shape[2]):
        h = 0.9 * h + 0.1 * u[:, :, t]
        ys.append(h)
    return torch.stack(ys, dim=-1)


def gated_rnn(u, delta, A, B, C):
    """h = a_t·h + x_t with a (batch, dim, time) decay: no state axis, no exp(Δ·A)."""
    h = torch.zeros_like(u[:, :, 0])
    ys = []
    for t in range(u.shape[2]):
        h = delta[:, :, t] * h + u[:, :, t]
        ys.append(h)
    return torch.stack(ys, dim=-1)


def softplus_per_step(u, delta, A, B, C):
    """Δ_t = softplus(raw[t]) computed inside the loop: the same function as a softplus of the
    whole tensor, but Δ is no time slice, and the passes only prove slices (left alone, correct)."""
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        dt = F.softplus(delta[:, :, t])
        h = torch.exp(dt[..., None] * A) * h + (dt * u[:, :, t])[..., None] * B[:, None, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def outputs_in_reverse(u, delta, A, B, C):
    """The scan runs forwards but step t's output lands at position L-1-t."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = [None] * u.shape[2]
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys[u.shape[2] - 1 - t] = torch.einsum("bdn,bn->bd", h, C[:, :, t])
    return torch.stack(ys, dim=-1)


def one_step_skipped(u, delta, A, B, C):
    """Step 4 keeps the state (no update) and still reads it out."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        if t != 4:
            h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def lead_B(u, delta, A, B, C):
    """B one step ahead of Δ and u (B[t+1], wrapping at the end)."""
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        B_next = B[:, :, (t + 1) % u.shape[2]]
        h = torch.exp(delta[:, :, t, None] * A) * h + delta[:, :, t, None] * B_next[:, None, :] * u[:, :, t, None]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def per_batch_A(u, delta, A, B, C):
    """A that differs per batch row: exp(Δ·A_b) is no exp(Δ ⊗ A) over (dim, state)."""
    A_b = A * torch.arange(1.0, u.shape[0] + 1.0)[:, None, None]
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = torch.exp(delta[:, :, t, None] * A_b) * h + delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


NEAR_MISSES = [
    pytest.param(softplus_per_step, "must be a time slice (Δ)", id="softplus-per-step"),
    pytest.param(one_step_skipped, "does not repeat step 0's state update", id="one-step-skipped"),
    pytest.param(lead_B, "reads time 1 where its multiplier reads time 0", id="B[t+1]"),
    pytest.param(per_batch_A, "not exp of a product Δ·A", id="per-batch-A"),
    pytest.param(tanh_recurrence, "not linear in the previous state", id="tanh"),
    pytest.param(reset_midway, "starts at time index 4, not 0", id="reset-at-L/2"),
    pytest.param(readout_before_update, "lagged readout", id="readout-before-update"),
    pytest.param(lagged_input, "the state's addend: a factor is neither a time slice", id="u[t-1]"),
    pytest.param(lagged_narrow, "time index", id="narrow(t-1)"),
    pytest.param(two_step_pieces, "the state's addend is not a product", id="sum-of-two-steps"),
    pytest.param(lerp_update, "written with torch.lerp", id="lerp"),
    pytest.param(lagged_c_first, "lagged readout", id="C[t-1]@h"),
    pytest.param(first_state_is_a_slice, "first state is itself a time slice", id="h-is-None-start"),
    pytest.param(two_state_factors, "not two graph values u and B", id="B-times-C"),
    pytest.param(stacked_states_other_use, "neither a readout", id="stacked-states-other-use"),
    pytest.param(ema, "time-invariant decay c (an EMA)", id="ema"),
    pytest.param(gated_rnn, "time slice of a 3-D tensor", id="gated-rnn"),
    pytest.param(einsum_sums_over_dim, "summed axes", id="einsum-sums-over-dim"),
    pytest.param(negated_B_full, "B_full is not a product", id="negated-B_full"),
    pytest.param(float64_state, "accumulated in float64", id="float64-state"),
]


@pytest.mark.parametrize("fn", [reversed_loop, reversed_per_step_loop, outputs_in_reverse],
                         ids=["reversed-loop", "reversed-per-step-loop", "outputs-in-reverse"])
def test_reverse_walks_are_rewritten_over_flipped_inputs(fn):
    """A loop over reversed(range(L)) reads its time slices last step first: as slices of the
    flipped tensors it is a forward scan over them (run 60; it was left alone). A forward loop
    that stores its outputs last step first is the op's y flipped. Values and gradients against
    fp64 eager."""
    args = [a.requires_grad_() for a in make_inputs()]
    report = explain(fn, *args)
    assert [r.family for r in report.rewrites if r.family == "scan_loop"] == ["scan_loop"], report.format(graphs=False)
    check_explained_against_fp64(report, fn, args)


@pytest.mark.parametrize("fn, reason", NEAR_MISSES)
def test_look_alike_is_left_alone_with_a_reason(fn, reason):
    args = make_inputs()
    report = explain(fn, *args)
    assert not report.rewrites, report.format(graphs=False)
    assert any(reason in m.reason for m in report.misses if m.family == "scan_loop"), report.format(graphs=False)
    # The untouched graph runs eagerly: bit for bit eager's result.
    assert torch.equal(report.output, fn(*args))


SHAPE_READERS = {
    "expand_as": lambda y, x, D: y + x * D[:, None].expand_as(y),
    "size": lambda y, x, D: y + x * D.view(1, y.size(1), 1),
}


@pytest.mark.parametrize("reader", list(SHAPE_READERS))
def test_skip_whose_D_reads_y_shape_is_folded(reader):
    """``D[:, None].expand_as(y)``: the broadcast reads y's shape, not its values, so y has no
    other user that the fold could change (probe AQ, run 50: refused as "y has other users",
    and the gate after it too). Values and gradients as eager's, in fp64."""
    from utils import scan_inputs, scan_y

    def fn(u, delta, A, B, C, D, z):
        y = SHAPE_READERS[reader](scan_y(u, delta, A, B, C), u, D)
        return y * F.silu(z)

    g = torch.Generator().manual_seed(3)
    u, delta, A, B, C = (t.double() for t in scan_inputs())
    D, z = torch.randn(u.shape[1], generator=g, dtype=torch.float64), torch.randn(u.shape, generator=g, dtype=torch.float64)
    args = [u.requires_grad_(), delta, A, B, C, D.requires_grad_(), z]
    ref = fn(*args)
    want = torch.autograd.grad(ref.sum(), [u, D])
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend=backend(inductor=False))(*args)
    assert counters["ssm"]["skip"] == 1 and counters["ssm"]["gate"] == 1, dict(counters["ssm"])
    got = torch.autograd.grad(out.sum(), [u, D])
    assert rel_err(out, ref) <= 1e-12
    for g_, w in zip(got, want, strict=True):
        assert rel_err(g_, w) <= 1e-12
