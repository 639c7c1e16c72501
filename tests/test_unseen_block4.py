"""Full Mamba-1 blocks written in styles this repo has not seen, one part varied at a time (round 4).

Every case is a whole block: in_proj -> causal conv1d + silu -> x_proj split -> dt_proj + softplus
-> selective-scan loop -> D skip -> z gate -> out_proj, in (batch, L, dim) like mamba-minimal and
mamba.py. One part is spelled differently per case (Δ, the x_proj split, the conv, the tail,
precision). For each, the ``ssm`` backend must either rewrite the part and match eager (and the
fp64 block), or leave it alone with a reason in ``explain``; it must never give another answer
than eager. Where the user's code over- or underflows (``log1p(exp(x))`` for large x), the
non-finite values must be eager's, position for position.

Found here and fixed:
- ``F.linear(x, weight=W, bias=b)`` / ``F.softplus(input=x)`` (keyword arguments) crashed the Δ
  pass, which threw away every rewrite of the graph (passes/delta.py reads arguments by name);
- under autocast a conv of an fp32 input returned fp32 where eager returns bf16 (passes/conv1d.py
  casts the op's output to the dtype eager's conv produced);
- in-place writes: a value the user read BEFORE an in-place write, which a fold makes the op read
  AFTER it (``s = x + b; x.mul_(2); softplus(s)``, ``xp = F.pad(x); relu_(x); conv1d(xp)``, a
  copy of an x_proj slice then ``xdbl[..., r:].mul_(2)`` through another view) gave wrong answers;
  the Δ, conv and xproj passes now refuse when anything writes to that memory
  (``fx_utils.written_in_place``, by fake-tensor storage);
- mamba-minimal's silu after the transpose back to (batch, L, dim) is folded into the conv op;
- the scan pass did not see ``F.relu(x, inplace=True)`` as a write, the skip / gate folds made the
  op read D / z after the user wrote them in place, and the clean-up after a rewrite dropped an
  in-place activation whose result nothing used (all fixed; tests below).
"""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from utils import TOL, rel_err

from ssm_compile.compiler import backend
from ssm_compile.report import explain

D_MODEL, D_STATE, RANK, L = 6, 4, 2, 6
ED = 2 * D_MODEL
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


# --- the block and its default parts ----------------------------------------------------------

def conv_padded_slice(self, x):
    """mamba-minimal: ``nn.Conv1d(padding=W-1)`` over (batch, dim, L), first L outputs, silu."""
    length = x.shape[1]
    return F.silu(self.conv1d(x.transpose(1, 2))[..., :length].transpose(1, 2))


def split_sizes(self, xdbl):
    return torch.split(xdbl, [RANK, D_STATE, D_STATE], dim=-1)


def delta_linear_softplus(self, dt):
    return F.softplus(self.dt_proj(dt))


def tail_skip_gate(self, y, u, z):
    return (y + u * self.D) * F.silu(z)


def scan_loop(u, delta, A, B, C):
    """mamba-minimal's ``selective_scan`` without D: precomputed Δ·A, Δ·B·u, einsum readout."""
    deltaA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
    deltaB_u = torch.einsum("bld,bln,bld->bldn", delta, B, u)
    h = torch.zeros(u.shape[0], u.shape[2], A.shape[1], device=u.device, dtype=deltaA.dtype)
    ys = []
    for i in range(u.shape[1]):
        h = deltaA[:, i] * h + deltaB_u[:, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, i]))
    return torch.stack(ys, dim=1)


class Block(nn.Module):
    """A Mamba-1 mixer in (batch, L, dim); ``conv``, ``split``, ``delta``, ``tail`` are the parts a
    case swaps (functions of ``self``); ``upcast`` runs the scan in fp32 (for bf16 weights). Every
    parameter is random, so a dropped term shows."""

    def __init__(self, conv=conv_padded_slice, split=split_sizes, delta=delta_linear_softplus, tail=tail_skip_gate,
                 width=4, conv_bias=True, dt_bias=True, conv_module=None, upcast=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv_fn, self.split_fn, self.delta_fn, self.tail_fn = conv, split, delta, tail
        self.width, self.upcast = width, upcast
        self.in_proj = nn.Linear(D_MODEL, 2 * ED)
        self.conv1d = conv_module or nn.Conv1d(ED, ED, width, groups=ED, padding=width - 1, bias=conv_bias)
        self.x_proj = nn.Linear(ED, RANK + 2 * D_STATE, bias=False)
        self.dt_proj = nn.Linear(RANK, ED, bias=dt_bias)
        self.A_log = nn.Parameter(torch.log(torch.rand(ED, D_STATE) + 0.5))
        self.D = nn.Parameter(torch.randn(ED))
        self.norm_weight = nn.Parameter(torch.rand(ED) + 0.5)
        self.out_proj = nn.Linear(ED, D_MODEL)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(torch.randn_like(p) * 0.1)

    def forward(self, x):
        xi, z = self.in_proj(x).chunk(2, dim=-1)
        u = self.conv_fn(self, xi)
        dt, B, C = self.split_fn(self, self.x_proj(u))
        delta = self.delta_fn(self, dt)
        A = -torch.exp(self.A_log.float())
        if self.upcast:
            # selective_scan_ref's way with bf16 weights: the scan in fp32, y back in u's dtype.
            y = scan_loop(u.float(), delta.float(), A, B.float(), C.float()).to(u.dtype)
        else:
            y = scan_loop(u, delta, A, B, C)
        return self.out_proj(self.tail_fn(self, y, u, z))


def block_input(seed=1, dtype=torch.float32):
    return torch.randn(2, L, D_MODEL, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- checks ------------------------------------------------------------------------------------

# fp32 blocks agree with eager to ~1e-7; 10x the table's fp32 entry leaves room for the cases
# where eager rounds Δ to bf16 and the folded op does not (~6e-6 from eager, closer to fp64).
BLOCK_TOL = TOL[torch.float32] * 10


def assert_eager_answer(out, ref, tol):
    """``out`` is eager's ``ref``: the same shape and dtype, non-finite values at the same places
    with the same values, finite values within ``tol`` (relative, over the finite part)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), finite), "non-finite values differ from eager's"
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), "NaNs differ from eager's"
    assert torch.equal(out[torch.isinf(ref)], ref[torch.isinf(ref)]), "infinities differ from eager's"
    if finite.any():
        assert rel_err(out[finite], ref[finite]) <= tol


def check_block(model, x, folded, reason=None, reason_family=None):
    """Explain ``model(x)``; the families in ``folded`` (and only those of FAMILIES) fired, ``reason``
    was recorded, and the output is eager's (and, for fp32, the fp64 block's)."""
    report = explain(model, x)
    counts = {f for f in report.counts if f in FAMILIES}
    assert counts == set(folded), report.format(graphs=False)
    if reason is not None:
        assert any(reason in m.reason for m in report.misses
                   if reason_family is None or m.family == reason_family), report.format(graphs=False)
    with torch.no_grad():
        ref = model(x)
    if not report.rewrites:
        assert torch.equal(report.output, ref)
    assert_eager_answer(report.output, ref, BLOCK_TOL)
    # Where fp32 eager overflows (log1p(exp(x))), fp64 need not: eager's answer is the one to keep.
    if torch.isfinite(ref).all():
        ref64 = copy.deepcopy(model).double()(x.double())
        assert rel_err(report.output, ref64) <= BLOCK_TOL
    check_fused_inference(model, x, ref)
    return report


def check_fused_inference(model, x, ref):
    """Inference (no grad) with every fusion forced: ``fuse`` may merge conv and dt_proj into the
    scan, so the pieces this file varies also reach ``ssm::fused_mamba_scan``; still eager's answer."""
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=backend(inductor=False, fuse="fused"))(x)
    torch._dynamo.reset()
    assert_eager_answer(out, ref, BLOCK_TOL)


FAMILIES = ("conv1d", "scan_loop", "delta", "skip", "gate")
ALL = set(FAMILIES)


# --- 1. Δ ---------------------------------------------------------------------------------------

def delta_log1p_exp(self, dt):
    return torch.log1p(torch.exp(self.dt_proj(dt)))


def delta_beta2(self, dt):
    return F.softplus(self.dt_proj(dt), beta=2)


def delta_threshold5(self, dt):
    return F.softplus(self.dt_proj(dt), threshold=5)


_SOFTPLUS = nn.Softplus()


def delta_softplus_module(self, dt):
    return _SOFTPLUS(self.dt_proj(dt))


def delta_bias_added_after(self, dt):
    """dt_proj's weight as a matmul, its bias a separate add (mamba.py's style)."""
    return F.softplus(dt @ self.dt_proj.weight.t() + self.dt_proj.bias)


def delta_bias_in_linear(self, dt):
    return F.softplus(F.linear(dt, self.dt_proj.weight, self.dt_proj.bias))


def delta_clamped(self, dt):
    """Mamba-2's dt_limit: softplus then clamp; Δ is the clamp's output."""
    return F.softplus(self.dt_proj(dt)).clamp(min=1e-4)


def delta_exp(self, dt):
    return torch.exp(self.dt_proj(dt) * 0.3)


def delta_softplus_bias_after(self, dt):
    return F.softplus(F.linear(dt, self.dt_proj.weight)) + self.dt_proj.bias.abs()


def delta_linear_keywords(self, dt):
    return F.softplus(input=F.linear(dt, weight=self.dt_proj.weight, bias=self.dt_proj.bias))


def delta_bias_twice(self, dt):
    """The bias inside the linear AND added again: both must reach the op."""
    return F.softplus(F.linear(dt, self.dt_proj.weight, self.dt_proj.bias) + self.dt_proj.bias)


def delta_einsum(self, dt):
    return F.softplus(torch.einsum("blr,dr->bld", dt, self.dt_proj.weight) + self.dt_proj.bias)


def delta_rounded_to_bf16(self, dt):
    """Δ's pre-activation rounded to bf16 in an fp32 block: the op would compute softplus(x + b)
    unrounded, so the rounding is the program's and the fold is refused (run 39's F3)."""
    return F.softplus(self.dt_proj(dt).to(torch.bfloat16)).float()


# The writes below go through a view: a write to a tensor the graph allocated and no view shares
# is written out of place before the matchers run (passes/inplace.py), and the rewrite is then
# legitimate (the ``local`` rows); through a view it stays, and the delta pass must refuse it.

def delta_pre_written_after_add(self, dt, local=False):
    """``x`` doubled in place after ``x + bias`` was taken: Δ uses the old x."""
    x = F.linear(dt, self.dt_proj.weight)
    pre = x + self.dt_proj.bias
    (x if local else x.view(-1)).mul_(2.0)
    return F.softplus(pre)


def delta_pre_written_after_cast(self, dt, local=False):
    x = dt @ self.dt_proj.weight.t()
    pre = x.to(torch.bfloat16)
    (x if local else x.view(-1)).mul_(2.0)
    return F.softplus(pre).float()


def delta_bias_written_after_add(self, dt, local=False):
    bias = self.dt_proj.bias * 1.0
    pre = F.linear(dt, self.dt_proj.weight) + bias
    (bias if local else bias.view(-1)).mul_(2.0)
    return F.softplus(pre)


def delta_linear_output_written(self, dt, local=False):
    """dt_proj's output shifted in place before the softplus: folding would recompute the linear
    without the shift (the local row: the shift becomes ``x + 0.3``, read by the softplus)."""
    x = self.dt_proj(dt)
    (x if local else x.view(-1)).add_(0.3)
    return F.softplus(x)


def delta_linear_output_setitem(self, dt):
    x = F.linear(dt, self.dt_proj.weight)
    x[..., 0] = 1.0
    return F.softplus(x + self.dt_proj.bias)


DELTAS = [
    # (delta part, dt_proj has a bias, families that must fire, a miss reason or None)
    pytest.param(delta_beta2, True, ALL - {"delta"}, "beta=2", id="softplus-beta=2"),
    pytest.param(delta_threshold5, True, ALL - {"delta"}, "threshold=5", id="softplus-threshold=5"),
    pytest.param(delta_softplus_module, True, ALL, None, id="nn.Softplus()"),
    pytest.param(delta_bias_added_after, True, ALL, None, id="matmul+bias-add"),
    pytest.param(delta_bias_in_linear, True, ALL, None, id="F.linear(bias)"),
    pytest.param(delta_linear_softplus, False, ALL, None, id="dt_proj-no-bias"),
    pytest.param(delta_clamped, True, ALL - {"delta"}, None, id="softplus.clamp(min=1e-4)"),
    pytest.param(delta_exp, True, ALL - {"delta"}, None, id="exp(dt)"),
    pytest.param(delta_log1p_exp, True, ALL - {"delta"}, None, id="log1p(exp(dt))"),
    pytest.param(delta_softplus_bias_after, True, ALL - {"delta"}, None, id="softplus+bias-after"),
    pytest.param(delta_linear_keywords, True, ALL, None, id="softplus(input=linear(weight=,bias=))"),
    pytest.param(delta_bias_twice, True, ALL, None, id="linear(bias)+bias"),
    pytest.param(delta_einsum, True, ALL, None, id="einsum+bias"),
    pytest.param(lambda self, dt: 0.5 * F.softplus(self.dt_proj(dt)), True, ALL - {"delta"}, None, id="0.5*softplus"),
    pytest.param(lambda self, dt: -F.softplus(-self.dt_proj(dt)), True, ALL - {"delta"}, None,
                 id="-softplus(-x)"),
    pytest.param(delta_rounded_to_bf16, True, ALL - {"delta"}, "rounds torch.float32 to torch.bfloat16",
                 id="softplus(x.bf16()).float()"),
    pytest.param(delta_pre_written_after_add, True, ALL - {"delta"}, "writes in place", id="x+b-then-x.mul_"),
    # The cast rounds an fp32 block's Δ: refused for that before the write is looked at.
    pytest.param(delta_pre_written_after_cast, True, ALL - {"delta"}, "rounds torch.float32",
                 id="x.bf16()-then-x.mul_"),
    pytest.param(delta_bias_written_after_add, True, ALL - {"delta"}, "writes in place", id="x+b-then-b.mul_"),
    pytest.param(delta_linear_output_written, True, ALL - {"delta"}, "writes in place", id="dt_proj(dt).add_(c)"),
    pytest.param(delta_linear_output_setitem, True, ALL - {"delta"}, "writes in place", id="x[...,0]=1-then-x+b"),
    pytest.param(functools.partial(delta_pre_written_after_add, local=True), True, ALL, None, id="local:x+b-then-x.mul_"),
    pytest.param(functools.partial(delta_pre_written_after_cast, local=True), True, ALL - {"delta"},
                 "rounds torch.float32", id="local:x.bf16()-then-x.mul_"),
    pytest.param(functools.partial(delta_bias_written_after_add, local=True), True, ALL, None, id="local:x+b-then-b.mul_"),
    pytest.param(functools.partial(delta_linear_output_written, local=True), True, ALL, None, id="local:dt_proj(dt).add_(c)"),
]


@pytest.mark.parametrize("delta, dt_bias, folded, reason", DELTAS)
def test_delta_spelling(delta, dt_bias, folded, reason):
    check_block(Block(delta=delta, dt_bias=dt_bias), block_input(), folded, reason)


# --- 2. x_proj split ----------------------------------------------------------------------------

SPLITS = [
    pytest.param(lambda self, xd: xd.split([RANK, D_STATE, D_STATE], dim=-1), id=".split([r,N,N])"),
    pytest.param(lambda self, xd: (xd[..., :RANK], *torch.chunk(xd[..., RANK:], 2, dim=-1)), id="slice+torch.chunk"),
    pytest.param(lambda self, xd: (xd[..., :RANK], xd[..., RANK:RANK + D_STATE], xd[..., RANK + D_STATE:]),
                 id="xdbl[...,:r]-slices"),
    pytest.param(lambda self, xd: (xd[:, :, :RANK], xd[:, :, RANK:RANK + D_STATE], xd[:, :, -D_STATE:]),
                 id="xdbl[:,:,r:r+N]-slices"),
    pytest.param(lambda self, xd: torch.tensor_split(xd, (RANK, RANK + D_STATE), dim=-1), id="tensor_split"),
    pytest.param(lambda self, xd: torch.split(xd, [RANK, D_STATE, D_STATE], dim=2), id="split-dim=2"),
    pytest.param(lambda self, xd: (lambda dt, C, B: (dt, B, C))(*torch.split(xd, [RANK, D_STATE, D_STATE], -1)),
                 id="dt,C,B-swapped"),
    pytest.param(lambda self, xd: (xd[..., :RANK], xd[..., RANK + 1:RANK + 1 + D_STATE], xd[..., -D_STATE:]),
                 id="overlapping-B-C"),
    pytest.param(lambda self, xd: (xd[..., :RANK], xd[..., RANK:RANK + D_STATE], xd[..., RANK:RANK + D_STATE]),
                 id="B-is-C"),
    pytest.param(lambda self, xd: (xd[..., :RANK], xd[..., RANK:RANK + D_STATE].contiguous(),
                                   xd[..., -D_STATE:].contiguous()), id="slices.contiguous()"),
]


@pytest.mark.parametrize("split", SPLITS)
def test_x_proj_split_spelling(split):
    check_block(Block(split=split), block_input(), ALL)


def test_log1p_exp_overflow_is_eagers_inf_and_nan():
    """log1p(exp(x)) is inf above ~88 in fp32 where softplus(x) = x: a channel with dt ~ 100 must
    come out non-finite exactly where eager's does, and a softplus block stays finite."""
    outs = {}
    for delta in (delta_log1p_exp, delta_linear_softplus):
        model = Block(delta=delta)
        model.out_proj = nn.Identity()
        with torch.no_grad():
            model.dt_proj.bias[3] = 100.0
            model.dt_proj.bias[5] = 60.0
        folded = ALL - {"delta"} if delta is delta_log1p_exp else ALL
        outs[delta] = check_block(model, block_input(), folded).output
    assert not torch.isfinite(outs[delta_log1p_exp][..., 3]).any()
    assert torch.isfinite(outs[delta_linear_softplus]).all()


# --- 3. the conv --------------------------------------------------------------------------------

def conv_silu_before_transpose(self, x):
    """mamba.py: silu on the sliced (batch, dim, L) output, then back to (batch, L, dim)."""
    return F.silu(self.conv1d(x.transpose(1, 2))[..., :x.shape[1]]).transpose(1, 2)


def conv_left_pad(self, x):
    """The hand-written causal conv: zeros on the left, an unpadded depthwise conv, no slice."""
    xt = F.pad(x.transpose(1, 2), (self.width - 1, 0))
    return F.silu(F.conv1d(xt, self.conv1d.weight, self.conv1d.bias, groups=ED)).transpose(1, 2)


def conv_sliced_negative(self, x):
    """``[..., :-(W-1)]``: drop the W-1 outputs that see the right-hand padding; still causal."""
    return F.silu(self.conv1d(x.transpose(1, 2))[..., :-(self.width - 1)]).transpose(1, 2)


def conv_x_sigmoid(self, x):
    y = self.conv1d(x.permute(0, 2, 1))[:, :, :x.shape[1]]
    return (y * torch.sigmoid(y)).permute(0, 2, 1)


def conv_x_sigmoid_after_permute(self, x):
    y = self.conv1d(x.permute(0, 2, 1))[:, :, :x.shape[1]].permute(0, 2, 1)
    return y * torch.sigmoid(y)


def conv_transposed_twice(self, x):
    """Two views between the slice and the silu: not folded (only one is looked through)."""
    y = self.conv1d(x.transpose(1, 2))[..., :x.shape[1]]
    return F.silu(y.transpose(1, 2).transpose(1, 2).transpose(1, 2))


def conv_with(activation):
    def conv(self, x):
        return activation(self.conv1d(x.transpose(1, 2))[..., :x.shape[1]]).transpose(1, 2)
    return conv


def conv_unsliced_same(self, x):
    """``padding='same'``: a centred, non-causal conv, no slice."""
    return F.silu(self.conv1d(x.transpose(1, 2))).transpose(1, 2)


def conv_keywords(self, x):
    xt = x.transpose(1, 2)
    y = F.conv1d(input=xt, weight=self.conv1d.weight, bias=self.conv1d.bias, padding=self.width - 1, groups=ED)
    return F.silu(input=y[..., :x.shape[1]]).transpose(1, 2)


def conv_positional(self, x):
    """Every conv argument positional; the taps reversed (a different conv, still causal)."""
    y = F.conv1d(x.transpose(1, 2), self.conv1d.weight.flip(-1), self.conv1d.bias, 1, self.width - 1, 1, ED)
    return F.silu(y[:, :, 0:x.shape[1]]).transpose(1, 2)


def conv_pad_keywords(self, x):
    xt = F.pad(input=x.transpose(1, 2), pad=[self.width - 1, 0], mode="constant", value=0.0)
    return F.silu(F.conv1d(xt, self.conv1d.weight, self.conv1d.bias, padding="valid", groups=ED)).transpose(1, 2)


def conv_pad_and_sliced(self, x):
    """Left-padded AND sliced to L (a no-op slice): rewritten, the silu then follows the slice."""
    xt = F.pad(x.transpose(1, 2), (self.width - 1, 0))
    return F.silu(F.conv1d(xt, self.conv1d.weight, self.conv1d.bias, groups=ED)[..., :x.shape[1]]).transpose(1, 2)


def conv_narrow(self, x):
    return F.silu(self.conv1d(x.transpose(1, 2)).narrow(-1, 0, x.shape[1])).transpose(1, 2)


def conv_silu_then_slice(self, x):
    return F.silu(self.conv1d(x.transpose(1, 2)))[..., :x.shape[1]].transpose(1, 2)


def conv_double_padded(self, x):
    """Padded twice (F.pad and the conv's own padding): output t sees x[t-2(W-1) .. t-(W-1)]."""
    xt = F.pad(x.transpose(1, 2), (self.width - 1, 0))
    return F.silu(self.conv1d(xt)[..., :x.shape[1]]).transpose(1, 2)


def conv_sigmoid_first(self, x):
    y = self.conv1d(x.transpose(1, 2))[..., :x.shape[1]]
    return (y.sigmoid() * y).transpose(1, 2)


def dw_conv(width, **kwargs):
    return nn.Conv1d(ED, ED, width, groups=ED, **kwargs)


CONVS = [
    # (conv part, conv module or None (the default causal one), W, families, miss reason, silu folded)
    pytest.param(conv_padded_slice, None, 4, ALL, None, True, id="silu-after-transpose"),
    pytest.param(conv_x_sigmoid_after_permute, None, 4, ALL, None, True, id="permute-then-y*sigmoid(y)"),
    pytest.param(conv_transposed_twice, None, 4, ALL, None, False, id="silu-after-two-transposes"),
    pytest.param(conv_silu_before_transpose, None, 4, ALL, None, True, id="silu-before-transpose"),
    pytest.param(conv_left_pad, None, 4, ALL, None, True, id="F.pad(W-1,0)+conv1d"),
    pytest.param(conv_sliced_negative, None, 4, ALL, None, True, id="[...,:-(W-1)]"),
    pytest.param(conv_silu_before_transpose, dw_conv(4, padding=3, bias=False), 4, ALL, None, True, id="no-bias"),
    pytest.param(conv_silu_before_transpose, None, 2, ALL, None, True, id="W=2"),
    pytest.param(conv_silu_before_transpose, None, 8, ALL, None, True, id="W=8"),
    pytest.param(conv_x_sigmoid, None, 4, ALL, None, True, id="y*sigmoid(y)-permute"),
    pytest.param(conv_with(nn.SiLU()), None, 4, ALL, None, True, id="nn.SiLU()"),
    pytest.param(conv_with(F.gelu), None, 4, ALL, None, False, id="gelu-not-silu"),
    pytest.param(conv_with(torch.relu), None, 4, ALL, None, False, id="relu-not-silu"),
    pytest.param(conv_silu_before_transpose, dw_conv(4, padding=6, dilation=2), 4, ALL - {"conv1d"}, "dilation",
                 None, id="dilation=2"),
    pytest.param(conv_unsliced_same, dw_conv(4, padding="same"), 4, ALL - {"conv1d"}, "padding 'same'", None,
                 id="padding=same"),
    pytest.param(conv_silu_before_transpose, dw_conv(4, padding=3, padding_mode="circular"), 4, ALL - {"conv1d"},
                 "not zeros (W-1, 0) on the left only", None, id="padding_mode=circular"),
    pytest.param(conv_silu_before_transpose, nn.Conv1d(ED, ED, 4, groups=ED // 2, padding=3), 4, ALL - {"conv1d"},
                 "not depthwise", None, id="groups=dim/2"),
    pytest.param(conv_keywords, None, 4, ALL, None, True, id="F.conv1d(input=,weight=,...)+silu(input=)"),
    pytest.param(conv_positional, None, 4, ALL, None, True, id="F.conv1d-positional-flipped-weight"),
    pytest.param(conv_pad_keywords, None, 4, ALL, None, True, id="F.pad(input=,pad=,value=0.)+padding=valid"),
    pytest.param(conv_pad_and_sliced, None, 4, ALL, None, False, id="F.pad+conv1d+no-op-slice"),
    pytest.param(conv_narrow, None, 4, ALL, None, True, id="narrow(-1,0,L)"),
    pytest.param(conv_silu_then_slice, None, 4, ALL, None, True, id="silu-before-slice"),
    pytest.param(conv_double_padded, None, 4, ALL - {"conv1d"}, "does not keep exactly the first L", None,
                 id="F.pad(W-1)+padding=W-1"),
    pytest.param(conv_sigmoid_first, None, 4, ALL, None, True, id="y.sigmoid()*y"),
]


@pytest.mark.parametrize("conv, module, width, folded, reason, silu_folded", CONVS)
def test_conv_spelling(conv, module, width, folded, reason, silu_folded):
    model = Block(conv=conv, conv_module=copy.deepcopy(module), width=width)
    report = check_block(model, block_input(), folded, reason, reason_family="conv1d")
    if silu_folded is not None:
        (rewrite,) = [r for r in report.rewrites if r.family == "conv1d"]
        assert rewrite.decision["W"] == width and rewrite.decision["activation"] == ("silu" if silu_folded else None)


# --- 4. the tail (D skip, z gate, a norm) -------------------------------------------------------

def bdl(fn):
    """A tail written in (batch, dim, L) like ``selective_scan_ref``, on a (batch, L, dim) block."""
    def tail(self, y, u, z):
        return fn(self, y.transpose(1, 2), u.transpose(1, 2), z.transpose(1, 2)).transpose(1, 2)
    return tail


def rms_norm(self, x):
    """Mamba-2's RMSNorm over the channels (no mean subtracted), with a weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.norm_weight


TAILS = [
    # (tail part, families that must fire, a miss reason or None)
    pytest.param(bdl(lambda s, y, u, z: (y + u * s.D[:, None]) * F.silu(z)), ALL, None, id="u*D[:,None]"),
    pytest.param(bdl(lambda s, y, u, z: (y + s.D.unsqueeze(-1) * u) * F.silu(z)), ALL, None, id="D.unsqueeze(-1)*u"),
    pytest.param(lambda s, y, u, z: torch.addcmul(y, u, s.D) * F.silu(z), ALL, None, id="addcmul(y,u,D)"),
    pytest.param(lambda s, y, u, z: y * F.silu(z), ALL - {"skip"}, None, id="gate-only"),
    pytest.param(lambda s, y, u, z: (y + u * s.D) * z * torch.sigmoid(z), ALL, None, id="y*z*sigmoid(z)"),
    pytest.param(lambda s, y, u, z: (y + u * s.D) * (z * torch.sigmoid(z)), ALL, None, id="y*(z*sigmoid(z))"),
    pytest.param(lambda s, y, u, z: (y + u * s.D) * F.gelu(z), ALL - {"gate"}, None, id="gelu(z)-gate"),
    pytest.param(lambda s, y, u, z: (y + u * s.D) * torch.sigmoid(z), ALL - {"gate"}, "sigmoid, not silu",
                 id="sigmoid(z)-gate"),
    pytest.param(lambda s, y, u, z: y + u * s.D, ALL - {"gate"}, None, id="no-gate"),
    pytest.param(lambda s, y, u, z: y, ALL - {"gate", "skip"}, None, id="no-D-no-gate"),
    # One number for every channel: the op's skip with D broadcast to (dim,) (run 60).
    pytest.param(lambda s, y, u, z: (y + u * 0.5) * F.silu(z), ALL, None, id="D-python-float"),
    pytest.param(lambda s, y, u, z: rms_norm(s, (y + u * s.D) * F.silu(z)), ALL, None, id="norm(y*silu(z))"),
    pytest.param(lambda s, y, u, z: rms_norm(s, y + u * s.D) * F.silu(z), ALL - {"gate"}, None,
                 id="norm(y)*silu(z)"),
    pytest.param(lambda s, y, u, z: rms_norm(s, y) * F.silu(z) + u * s.D, ALL - {"gate", "skip"}, None,
                 id="norm(y)*silu(z)+D*u"),
]


@pytest.mark.parametrize("tail, folded, reason", TAILS)
def test_tail_spelling(tail, folded, reason):
    check_block(Block(tail=tail), block_input(), folded, reason)


# --- 5. mixed precision -------------------------------------------------------------------------

def run_low_precision(model, x, autocast):
    """(compiled output, eager output, the fp64 block's output, the families that fired)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        report = explain(model, x)
        with torch.no_grad():
            ref = model(x)
    ref64 = copy.deepcopy(model).double()(x.double())
    return report.output, ref, ref64, {f for f in report.counts if f in FAMILIES}


PRECISIONS = [
    # (autocast, bf16 weights and input, the scan upcast to fp32, out_proj kept)
    pytest.param(True, False, False, True, id="autocast-bf16"),
    pytest.param(True, False, False, False, id="autocast-bf16-no-out_proj"),
    pytest.param(True, False, True, False, id="autocast-bf16-fp32-scan-no-out_proj"),
    pytest.param(False, True, True, True, id="bf16-weights-fp32-scan"),
    pytest.param(True, True, True, True, id="bf16-weights-under-autocast"),
]


@pytest.mark.parametrize("autocast, bf16, upcast, out_proj", PRECISIONS)
def test_mixed_precision_block(autocast, bf16, upcast, out_proj):
    """The whole block in bf16 (autocast or bf16 weights): rewritten, eager's dtype (under autocast
    the fp32 D promotes the tail to fp32), within bf16 tolerance of eager, and no more than 2x
    further from the fp64 block than eager is."""
    model = Block(conv=conv_silu_before_transpose, upcast=upcast)
    if not out_proj:
        model.out_proj = nn.Identity()
    x = block_input()
    if bf16:
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    out, ref, ref64, folded = run_low_precision(model, x, autocast)
    assert folded == ALL
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert rel_err(out, ref.float()) <= TOL[torch.bfloat16]
    assert rel_err(out, ref64) <= 2 * rel_err(ref, ref64)


def conv_of_fp32_input(x, weight, bias):
    """A conv applied to the fp32 input itself (a Vim-style stem), inside an autocast region."""
    return F.silu(F.conv1d(x, weight, bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[..., :x.shape[-1]])


def test_autocast_conv_of_fp32_input_keeps_eagers_dtype():
    """Autocast runs eager's conv in bf16 and returns bf16; the op returns its input's dtype (fp32),
    so the rewrite must hand the rest of the graph bf16, as eager did (it once returned fp32)."""
    g = torch.Generator().manual_seed(4)
    args = torch.randn(2, ED, L, generator=g), torch.randn(ED, 1, 4, generator=g) / 2, torch.randn(ED, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = explain(conv_of_fp32_input, *args)
        ref = conv_of_fp32_input(*args)
    assert report.counts["conv1d"] == 1
    assert report.output.dtype == ref.dtype == torch.bfloat16
    assert rel_err(report.output, ref) <= TOL[torch.bfloat16]


# --- 6. gradients -------------------------------------------------------------------------------

GRAD_TOL = 1e-4
GRADS = [
    pytest.param(dict(delta=delta_bias_added_after), id="matmul+bias-add-delta"),
    pytest.param(dict(split=SPLITS[6].values[0]), id="dt,C,B-swapped"),
    pytest.param(dict(conv=conv_left_pad, width=2), id="F.pad-conv-W=2"),
    pytest.param(dict(tail=TAILS[11].values[0], dt_bias=False), id="norm(y*silu(z))-no-dt-bias"),
    pytest.param(dict(tail=TAILS[5].values[0], conv=conv_x_sigmoid), id="z*sigmoid(z)-gate-y*sigmoid(y)-conv"),
]


@pytest.mark.parametrize("parts", GRADS)
def test_gradients_match_eager(parts):
    """d(random-weighted sum of outputs)/d(every parameter and the input) through the rewritten
    block (the ops' autograd) equals eager's."""
    eager = Block(**parts)
    compiled = copy.deepcopy(eager)
    x = block_input().requires_grad_()
    weights = torch.randn(2, L, D_MODEL, generator=torch.Generator().manual_seed(7))
    counters.clear()
    torch._dynamo.reset()
    out = torch.compile(compiled, backend=backend(inductor=False))(x)
    assert {f for f in counters["ssm"] if f in FAMILIES} == ALL, dict(counters["ssm"])
    grads = torch.autograd.grad((out * weights).sum(), [x, *compiled.parameters()], allow_unused=True)
    ref = torch.autograd.grad((eager(x) * weights).sum(), [x, *eager.parameters()], allow_unused=True)
    names = ["x", *(n for n, _ in eager.named_parameters())]
    for name, g, r in zip(names, grads, ref, strict=True):
        if r is None:  # the norm's weight, in a block without the norm
            assert g is None, name
            continue
        assert rel_err(g, r) <= GRAD_TOL, name
    torch._dynamo.reset()


# --- through inductor ---------------------------------------------------------------------------

def test_mamba_minimal_block_through_inductor():
    """``torch.compile(backend="ssm")`` with inductor on the mamba-minimal-style block, with the
    spellings this file found rewritable mixed in (Δ bias as a separate add, dt,C,B split order,
    silu after the transpose, gate as z*sigmoid(z))."""
    model = Block(delta=delta_bias_added_after, split=SPLITS[6].values[0], tail=TAILS[5].values[0])
    x = block_input()
    counters.clear()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="ssm")(x)
        ref = model(x)
    fired = dict(counters["ssm"])
    torch._dynamo.reset()
    assert {f for f in fired if f in FAMILIES} == ALL, fired
    assert_eager_answer(out, ref, BLOCK_TOL)


# --- copies of x_proj slices, then an in-place write to x_proj's output -------------------------

def split_copied_then_scaled_in_place(self, xd):
    """B and C copied out of x_proj's output, then the output scaled in place through a view:
    eager's B and C are the values from BEFORE the write."""
    dt, B, C = torch.split(xd, [RANK, D_STATE, D_STATE], dim=-1)
    B, C = B.contiguous(), C.contiguous()
    xd[..., RANK:].mul_(2.0)
    return dt, B, C


def split_cloned_then_flat_write(self, xd):
    dt, B, C = torch.split(xd, [RANK, D_STATE, D_STATE], dim=-1)
    B, C = B.contiguous(), C.clone()
    xd.view(-1)[:7].mul_(3.0)
    return dt, B, C


def split_cloned_then_relu_(self, xd):
    dt, B, C = torch.split(xd, [RANK, D_STATE, D_STATE], dim=-1)
    B, C = B.clone(), C.clone()
    F.relu(xd, inplace=True)
    return dt, B, C


@pytest.mark.parametrize("split", [split_copied_then_scaled_in_place, split_cloned_then_flat_write,
                                   split_cloned_then_relu_], ids=["xd[...,r:].mul_", "xd.view(-1)[:7].mul_",
                                                                  "relu_(xd)"])
def test_copy_before_in_place_write_is_kept(split):
    """Inference only (autograd refuses in-place writes to split views). Whatever the passes do
    with the copies, the scan must read B and C as they were when copied."""
    model, x = Block(split=split), block_input()
    with torch.no_grad():
        ref = model(x)
        report = explain(model, x)
    assert_eager_answer(report.output, ref, BLOCK_TOL)
    check_fused_inference(model, x, ref)


def copy_then_write(u, dt, A, xd):
    """Minimal repro: a scan over B, C copied from ``xd`` before ``xd`` is scaled in place; Δ reads
    ``xd`` after the write, so the op is emitted after it."""
    B, C = xd[..., :D_STATE].contiguous(), xd[..., D_STATE:].clone()
    xd.mul_(2.0)
    delta = F.softplus(dt * xd[..., :1])
    return scan_loop(u, delta, A, B, C)


def test_scan_reads_copies_made_before_an_in_place_write():
    g = torch.Generator().manual_seed(0)
    u, dt = torch.randn(2, 5, 3, generator=g), torch.rand(2, 5, 3, generator=g)
    A, xd = -torch.rand(3, D_STATE, generator=g), torch.randn(2, 5, 2 * D_STATE, generator=g)
    ref = copy_then_write(u, dt, A, xd.clone())
    report = explain(copy_then_write, u, dt, A, xd.clone())
    assert_eager_answer(report.output, ref, BLOCK_TOL)


def x_proj_view_written(u, delta, A, xd):
    """User code calling the op on copies of split outputs, then writing x_proj's output through
    another view: the xproj pass must keep the copies."""
    _, B, C = torch.split(xd, [RANK, D_STATE, D_STATE], dim=-1)
    B, C = B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous()
    xd[..., RANK:].mul_(2.0)
    return torch.ops.ssm.selective_scan(u, delta, A, B, C)[0]


def test_xproj_keeps_copies_when_another_view_is_written():
    from ssm_compile.kernels.selective_scan import op as scan_op
    scan_op.register()
    g = torch.Generator().manual_seed(0)
    u, delta = torch.randn(2, 3, 5, generator=g), torch.rand(2, 3, 5, generator=g)
    A = -torch.rand(3, D_STATE, generator=g)
    xd = torch.randn(2, 5, RANK + 2 * D_STATE, generator=g)
    with torch.no_grad():
        ref = x_proj_view_written(u, delta, A, xd.clone())
        report = explain(x_proj_view_written, u, delta, A, xd.clone())
    assert not report.counts["x_proj_split"], report.format(graphs=False)
    assert any("writes in place to memory the split's input (or a value on the way" in m.reason for m in report.misses)
    assert torch.equal(report.output, ref)


# --- tail operands written in place between the user's read and the scan ------------------------

def gate_of_z_before_write(u, dt, A, B, C, D, z):
    g = F.silu(z)  # the gate of the original z
    z.mul_(2.0)
    return (scan_loop(u, F.softplus(dt), A, B, C) + u * D) * g


def skip_of_D_before_write(u, dt, A, B, C, D, z):
    s = u * D  # the skip with the original D
    D.mul_(2.0)
    return scan_loop(u, F.softplus(dt), A, B, C) + s


def gate_of_z_before_out_write(u, dt, A, B, C, D, z):
    g = F.silu(z)
    torch.mul(z, 2.0, out=z)  # an out= write is a write too
    return (scan_loop(u, F.softplus(dt), A, B, C) + u * D) * g


def skip_of_D_before_out_write(u, dt, A, B, C, D, z):
    s = u * D
    torch.add(D, 1.0, out=D)
    return scan_loop(u, F.softplus(dt), A, B, C) + s


@pytest.mark.parametrize("fn", [gate_of_z_before_write, skip_of_D_before_write, gate_of_z_before_out_write,
                                skip_of_D_before_out_write],
                         ids=["silu(z)-then-z.mul_", "u*D-then-D.mul_", "silu(z)-then-mul(out=z)",
                              "u*D-then-add(out=D)"])
def test_tail_reads_values_from_before_an_in_place_write(fn):
    """Folding the skip or gate makes the op read D or z where the scan runs, after the write."""
    g = torch.Generator().manual_seed(0)
    u, dt, z = (torch.randn(2, 5, 3, generator=g) for _ in range(3))
    A, B, C = -torch.rand(3, D_STATE, generator=g), torch.randn(2, 5, D_STATE, generator=g), torch.randn(2, 5, D_STATE,
                                                                                                        generator=g)
    D = torch.randn(3, generator=g)
    ref = fn(u, dt, A, B, C, D.clone(), z.clone())
    report = explain(fn, u, dt, A, B, C, D.clone(), z.clone())
    assert_eager_answer(report.output, ref, BLOCK_TOL)


def pad_then_write(x, weight, bias):
    """x padded, then x written in place (through an in-place activation), then the conv of the
    padded copy: eager convolves the values from before the write."""
    xp = F.pad(x, (weight.shape[-1] - 1, 0))
    F.relu(x, inplace=True)
    return F.silu(F.conv1d(xp, weight, bias, groups=x.shape[1]))


def test_conv_of_padded_copy_written_after_the_pad_is_left_alone():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(2, ED, L, generator=g), torch.randn(ED, 1, 4, generator=g), torch.randn(ED, generator=g)
    ref = pad_then_write(x.clone(), w, b)
    report = explain(pad_then_write, x.clone(), w, b)
    assert not report.counts["conv1d"]
    assert any("writes in place to the padded input's memory" in m.reason for m in report.misses), report.format()
    assert torch.equal(report.output, ref)


# --- shapes that make axes ambiguous, and a dynamic batch ---------------------------------------

def delta_bias_per_time(self, dt):
    """``bias[:, None]`` on a (batch, L, dim) tensor with L == dim: a bias per TIME step."""
    return F.softplus(F.linear(dt, self.dt_proj.weight) + self.dt_proj.bias[:, None])


@pytest.mark.parametrize("parts, folded", [
    pytest.param({}, ALL, id="plain"),
    pytest.param(dict(delta=delta_bias_per_time), ALL, id="dt-bias-along-L"),
    pytest.param(dict(tail=lambda s, y, u, z: (y + u * s.D[:, None]) * F.silu(z)), ALL - {"skip", "gate"},
                 id="D-along-L"),
    pytest.param(dict(tail=TAILS[0].values[0], conv=conv_left_pad), ALL, id="bdl-tail-padded-conv"),
])
def test_length_equal_to_dim(parts, folded):
    """L == dim == 12: a broadcast along the wrong one of two equal axes must not pass for the op's."""
    x = torch.randn(2, ED, D_MODEL, generator=torch.Generator().manual_seed(3))
    check_block(Block(**parts), x, folded)


@pytest.mark.usefixtures("no_opt_einsum")
def test_dynamic_batch():
    model = Block(conv=conv_left_pad, delta=delta_bias_added_after)
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend(inductor=False), dynamic=True)
    for batch in (2, 3, 5):
        x = torch.randn(batch, L, D_MODEL, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            assert_eager_answer(compiled(x), model(x), BLOCK_TOL)
    fired = dict(counters["ssm"])
    assert {f for f in fired if f in FAMILIES} == ALL and fired["conv1d"] == 1, fired
    torch._dynamo.reset()


def conv_then_unused_in_place_relu(x, weight, bias, v):
    """A rewritten causal conv, and an in-place relu whose result nothing reads: only its write to
    ``v`` matters. The clean-up after a rewrite must not drop it as dead code (FX's own purity
    test does not know ``inplace=True``)."""
    L = x.shape[-1]
    y = F.silu(F.conv1d(x, weight, bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[..., :L])
    F.relu(v, inplace=True)
    F.silu(v, True)
    return y + v


def test_unused_in_place_activation_survives_the_rewrite_clean_up():
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(2, 6, 9, generator=g), torch.randn(2, 6, 9, generator=g)
    weight, bias = torch.randn(6, 1, 4, generator=g), torch.randn(6, generator=g)
    ref = conv_then_unused_in_place_relu(x, weight, bias, v.clone())
    counters.clear()
    torch._dynamo.reset()
    out = torch.compile(conv_then_unused_in_place_relu, backend=backend(inductor=False))(x, weight, bias, v.clone())
    torch._dynamo.reset()
    assert counters["ssm"]["conv1d"] == 1
    # Without the relu and silu writes the result differs by O(1) wherever v < 0.
    assert rel_err(out, ref) <= TOL[torch.float32]
