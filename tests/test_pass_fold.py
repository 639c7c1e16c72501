"""The ``delta`` and ``tail`` passes: Δ preprocessing and the D skip / z gate folded into the op.

The functions call ``torch.ops.ssm.selective_scan`` directly (as a user of
``ssm_compile.selective_scan_fn`` would, or as the scan passes leave the graph) and do the rest
in plain torch, in the forms real code writes.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch._dynamo.utils import counters
from utils import TOL, PassCapture, compile_with_passes, rel_err

from ssm_compile.passes import delta as delta_pass
from ssm_compile.passes import tail as tail_pass
from ssm_compile.passes.fx_utils import normalized_graph_str

BATCH, DIM, L, N, R = 2, 6, 7, 4, 3


@pytest.fixture(scope="module", autouse=True)
def registered():
    # The rewritten graphs call torch.ops.ssm.*; the op must exist before they are traced.
    from ssm_compile.kernels.selective_scan import op

    op.register()


PASSES = (delta_pass, tail_pass)


def compile_and_run(fn, *args):
    return compile_with_passes(fn, *args, passes=PASSES)


def scan(u, delta, A, B, C):
    return torch.ops.ssm.selective_scan(u, delta, A, B, C)[0]


def make_inputs(dtype=torch.float32, layout="bdl", length=L, dim=DIM):
    """Random (never zero) inputs; x is the pre-bias Δ, ts the dt_proj input (batch, L, R)."""
    g = torch.Generator().manual_seed(0)
    act = (BATCH, dim, length) if layout == "bdl" else (BATCH, length, dim)
    return dict(
        u=torch.randn(act, generator=g).to(dtype),
        x=(torch.randn(act, generator=g) * 0.5).to(dtype),
        A=-torch.rand(dim, N, generator=g) - 0.5,
        B=torch.randn(BATCH, N, length, generator=g).to(dtype),
        C=torch.randn(BATCH, N, length, generator=g).to(dtype),
        D=torch.randn(dim, generator=g),
        z=torch.randn(act, generator=g).to(dtype),
        bias=(torch.randn(dim, generator=g) * 0.5).to(dtype),
        W=(torch.randn(dim, R, generator=g) / R).to(dtype),
        ts=torch.randn(BATCH, length, R, generator=g).to(dtype),
    )


def check_close(out, ref, dtype=torch.float32):
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    for o, r in zip(outs, refs):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert rel_err(o, r) <= TOL[dtype]


def fired(cap):
    return {f: counters["ssm"][f] for f in ("delta", "skip", "gate")}


def misses(cap, family):
    return [m.reason for m in cap.ctx.misses if m.family == family]


# --- positive forms ---------------------------------------------------------------------------

def f_mamba_ssm_ref(u, x, A, B, C, D, z, bias, W, ts):
    """mamba_ssm selective_scan_ref's preprocessing and tail around the scan."""
    delta = F.softplus(x + bias[..., None].float())
    out = scan(u, delta, A, B, C)
    out = out + u * D.unsqueeze(-1)
    return out * F.silu(z)


def f_hf524(u, x, A, B, C, D, z, bias, W, ts):
    """HF 5.24 ``mamba_selective_scan``: W @ x, bias cast to dt's dtype, D.float()[None, :, None]."""
    dt = W @ ts.transpose(1, 2)
    dt = dt + bias.float().to(dt.dtype)[..., None]
    dt = F.softplus(dt)
    y = scan(u, dt, A, B, C)
    y = y + u * D.float()[None, :, None]
    return y * F.silu(z)


def f_bld_linear(u, x, A, B, C, D, z, bias, W, ts):
    """(batch, L, dim) code: softplus(linear(ts, W, b)), y transposed back, ``y + u * D``."""
    delta = F.softplus(F.linear(ts, W, bias))
    y = scan(u.transpose(1, 2), delta.transpose(1, 2), A, B, C).transpose(1, 2)
    y = y + D * u
    return y * (z * torch.sigmoid(z))


class HF517Mixer(nn.Module):
    """HF 5.17's slow path: softplus(self.dt_proj(ts).transpose(1, 2)), gate split over two muls."""

    def __init__(self, W, bias):
        super().__init__()
        self.dt_proj = nn.Linear(R, W.shape[0])
        self.dt_proj.to(W.dtype)
        with torch.no_grad():
            self.dt_proj.weight.copy_(W)
            self.dt_proj.bias.copy_(bias)

    def forward(self, u, x, A, B, C, D, z, bias, W, ts):
        delta = F.softplus(self.dt_proj(ts).transpose(1, 2))
        y = scan(u, delta, A, B, C)
        y = y + D[:, None] * u
        return (y * torch.sigmoid(z)) * z


def f_delta_has_other_user(u, x, A, B, C, D, z, bias, W, ts):
    """The softplus output is also returned: the fold stays sound, softplus is kept for it."""
    delta = F.softplus(x + bias[:, None])
    y = scan(u, delta, A, B, C)
    return y * F.silu(z), delta


def f_public_wrapper(u, x, A, B, C, D, z, bias, W, ts):
    """Through ``selective_scan_fn`` (mamba_ssm's calling convention, keyword arguments)."""
    from ssm_compile.kernels.selective_scan.op import selective_scan_fn

    y, last = selective_scan_fn(u, F.softplus(x + bias[:, None]), A, B, C, return_last_state=True)
    return (y + u * D[None, :, None]) * F.silu(z), last


def f_addcmul_skip(u, x, A, B, C, D, z, bias, W, ts):
    """The skip as one call, ``torch.addcmul(y, D[:, None], u)``, and the gate as z·sigmoid(z)."""
    y = scan(u, F.softplus(x + bias[:, None]), A, B, C)
    return torch.addcmul(y, D[:, None], u) * (z * torch.sigmoid(z))


def f_addcmul_skip_method(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, F.softplus(x + bias[:, None]), A, B, C)
    return y.addcmul(u, D[:, None]) * F.silu(z)


def f_skip_in_another_layout(u, x, A, B, C, D, z, bias, W, ts):
    """(batch, L, dim) code whose skip multiplies in (batch, dim, L) by a (dim, 1) D and turns
    the product back: the same values as y + u * D, permuted."""
    y = scan(u.transpose(1, 2), x.transpose(1, 2), A, B, C).transpose(1, 2)
    return (y + (u.transpose(1, 2) * D[:, None]).transpose(1, 2)) * F.silu(z)


def f_skip_permuted_twice(u, x, A, B, C, D, z, bias, W, ts):
    """The product permuted by two views that compose to the identity."""
    y = scan(u, x, A, B, C)
    return (y + (u.transpose(1, 2) * D).permute(0, 2, 1)) * F.silu(z)


def f_skip_explicit_broadcast(u, x, A, B, C, D, z, bias, W, ts):
    """D broadcast by hand (``expand``, as einops' ``repeat(D, "d -> b d l")`` does it), and the
    bias by ``expand_as``."""
    y = scan(u, F.softplus(x + bias[:, None].expand_as(x)), A, B, C)
    return (y + u * D[None, :, None].expand(*u.shape)) * F.silu(z)


def f_sums_spelled_with_alpha(u, x, A, B, C, D, z, bias, W, ts):
    """``torch.add(.., alpha=1)`` and ``torch.sub(.., alpha=-1)`` add exactly: the bias and the skip."""
    y = scan(u, F.softplus(torch.add(x, bias[:, None], alpha=1)), A, B, C)
    return torch.sub(y, u * D[:, None], alpha=-1) * F.silu(z)


def f_sums_spelled_with_alpha_methods(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, F.softplus(x.sub(bias[:, None], alpha=-1.0)), A, B, C)
    return (u * D[:, None]).add(y, alpha=1) * F.silu(z)


def f_gate_silu_inplace_false(u, x, A, B, C, D, z, bias, W, ts):
    """``F.silu(z, False)``, as ``nn.SiLU()`` and HF 4.x's ``ACT2FN["silu"]`` record it (probe BQ:
    the gate was left unfolded, with no reason)."""
    y = scan(u, F.softplus(x + bias[:, None]), A, B, C)
    return (y + u * D[:, None]) * F.silu(z, False)


def f_gate_silu_inplace_false_keyword(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, F.softplus(x + bias[:, None]), A, B, C)
    return F.silu(z, inplace=False) * (y + u * D[:, None])


class SiLUModuleGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.SiLU()

    def forward(self, u, x, A, B, C, D, z, bias, W, ts):
        y = scan(u, F.softplus(x + bias[:, None]), A, B, C)
        return (y + u * D[:, None]) * self.act(z)


def f_gate_aten_silu(u, x, A, B, C, D, z, bias, W, ts):
    # The overload packet has an out= overload; this call writes nothing (probe BR: "silu writes z
    # in place").
    y = scan(u, F.softplus(x + bias[:, None]), A, B, C)
    return (y + u * D[:, None]) * torch.ops.aten.silu(z)


POSITIVE = {
    "gate_aten_silu": (f_gate_aten_silu, "bdl", dict(delta=1, skip=1, gate=1)),
    "gate_silu_module": (SiLUModuleGate(), "bdl", dict(delta=1, skip=1, gate=1)),
    "gate_silu_inplace_false": (f_gate_silu_inplace_false, "bdl", dict(delta=1, skip=1, gate=1)),
    "gate_silu_inplace_false_keyword": (f_gate_silu_inplace_false_keyword, "bdl", dict(delta=1, skip=1, gate=1)),
    "sums_spelled_with_alpha": (f_sums_spelled_with_alpha, "bdl", dict(delta=1, skip=1, gate=1)),
    "sums_spelled_with_alpha_methods": (f_sums_spelled_with_alpha_methods, "bdl", dict(delta=1, skip=1, gate=1)),
    "skip_explicit_broadcast": (f_skip_explicit_broadcast, "bdl", dict(delta=1, skip=1, gate=1)),
    "skip_in_another_layout": (f_skip_in_another_layout, "bld", dict(delta=0, skip=1, gate=1)),
    "skip_permuted_twice": (f_skip_permuted_twice, "bdl", dict(delta=0, skip=1, gate=1)),
    "mamba_ssm_ref": (f_mamba_ssm_ref, "bdl", dict(delta=1, skip=1, gate=1)),
    "hf524": (f_hf524, "bdl", dict(delta=1, skip=1, gate=1)),
    "bld_linear": (f_bld_linear, "bld", dict(delta=1, skip=1, gate=1)),
    "hf517_module": (None, "bdl", dict(delta=1, skip=1, gate=1)),
    "delta_other_user": (f_delta_has_other_user, "bdl", dict(delta=1, skip=0, gate=1)),
    "public_wrapper": (f_public_wrapper, "bdl", dict(delta=1, skip=1, gate=1)),
    "addcmul_skip": (f_addcmul_skip, "bdl", dict(delta=1, skip=1, gate=1)),
    "addcmul_skip_method": (f_addcmul_skip_method, "bdl", dict(delta=1, skip=1, gate=1)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", list(POSITIVE))
def test_fold_forms(form, dtype):
    fn, layout, expected = POSITIVE[form]
    inputs = make_inputs(dtype, layout)
    if fn is None:
        fn = HF517Mixer(inputs["W"], inputs["bias"])
    ref = fn(**inputs)
    cap, out = compile_and_run(fn, *inputs.values())
    assert fired(cap) == expected, cap.ctx.misses
    check_close(out, ref, dtype)
    # A 16-bit z's silu: eager rounds it, the op does not, and the rewrite says so.
    (gate,) = [r for r in cap.ctx.rewrites if r.family == "gate"]
    assert ("silu" in gate.decision) == (dtype == torch.bfloat16), gate.decision
    # Every folded piece is gone from the graph; only the op computes them.
    text = normalized_graph_str(cap.gm)
    assert "silu" not in text and "sigmoid" not in text
    if form != "delta_other_user":
        assert "softplus" not in text


def test_fold_hf524_snapshot():
    cap, _ = compile_and_run(f_hf524, *make_inputs().values())
    assert_expected_inline(normalized_graph_str(cap.gm), """\
%L_A_ = placeholder
%L_B_ = placeholder
%L_C_ = placeholder
%L_D_ = placeholder
%L_W_ = placeholder
%L_bias_ = placeholder
%L_ts_ = placeholder
%L_u_ = placeholder
%L_z_ = placeholder
%transpose_1 = .transpose(%L_ts_, 1, 2)
%transpose_2 = .transpose(%transpose_1, -1, -2)
%linear_1 = torch._C._nn.linear(%transpose_2, %L_W_)
%transpose_3 = .transpose(%linear_1, -1, -2)
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%L_u_, %transpose_3, %L_A_, %L_B_, %L_C_, %L_D_, %L_z_, %L_bias_, True, None, False)
%getitem_1 = operator.getitem(%selective_scan_1, 0)
return (%getitem_1,)
""")


def test_fold_bld_linear_snapshot():
    cap, _ = compile_and_run(f_bld_linear, *make_inputs(layout="bld").values())
    assert_expected_inline(normalized_graph_str(cap.gm), """\
%L_A_ = placeholder
%L_B_ = placeholder
%L_C_ = placeholder
%L_D_ = placeholder
%L_W_ = placeholder
%L_bias_ = placeholder
%L_ts_ = placeholder
%L_u_ = placeholder
%L_z_ = placeholder
%transpose_1 = .transpose(%L_u_, 1, 2)
%linear_1 = torch._C._nn.linear(%L_ts_, %L_W_)
%permute_1 = .permute(%linear_1, (0, 2, 1))
%permute_2 = .permute(%L_z_, (0, 2, 1))
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%transpose_1, %permute_1, %L_A_, %L_B_, %L_C_, %L_D_, %permute_2, %L_bias_, True, None, False)
%getitem_1 = operator.getitem(%selective_scan_1, 0)
%transpose_2 = .transpose(%getitem_1, 1, 2)
return (%transpose_2,)
""")


# --- negative cases -----------------------------------------------------------------------------

def f_softplus_beta(u, x, A, B, C, D, z, bias, W, ts):
    return scan(u, F.softplus(x + bias[:, None], beta=2.0), A, B, C)


def f_softplus_log1p_exp(u, x, A, B, C, D, z, bias, W, ts):
    return scan(u, torch.log1p(torch.exp(x + bias[:, None])), A, B, C)


def f_softplus_log_one_plus_exp(u, x, A, B, C, D, z, bias, W, ts):
    return scan(u, ((x + bias[:, None]).exp() + 1.0).log(), A, B, C)


def f_softplus_threshold(u, x, A, B, C, D, z, bias, W, ts):
    return scan(u, F.softplus(x + bias[:, None], 1.0, 5.0), A, B, C)


def f_gate_before_skip(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, x, A, B, C)
    return y * F.silu(z) + u * D[:, None]


def f_y_also_returned(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, x, A, B, C)
    return y + u * D[:, None], y


def f_y_also_returned_gate(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, x, A, B, C)
    return y * F.silu(z), y.sum()


def f_D_on_time_axis(u, x, A, B, C, D, z, bias, W, ts):
    # A vector of L entries broadcasts along time: not the op's per-channel skip.
    return scan(u, x, A, B, C) + u * ts[0, :, 0]


def f_D_full_matrix(u, x, A, B, C, D, z, bias, W, ts):
    return scan(u, x, A, B, C) + u * (D[:, None] * torch.ones(L))


def f_skip_other_tensor(u, x, A, B, C, D, z, bias, W, ts):
    return scan(u, x, A, B, C) + x * D[:, None]


def f_skip_transposed_u(u, x, A, B, C, D, z, bias, W, ts):
    # Square (dim == L): u.mT has y's shape but pairs channel d with time step d.
    return scan(u, x, A, B, C) + u.mT * D[:, None]


def f_skip_rounded_u(u, x, A, B, C, D, z, bias, W, ts):
    return scan(u, x, A, B, C) + u.to(torch.bfloat16) * D[:, None]


def f_addcmul_skip_scaled(u, x, A, B, C, D, z, bias, W, ts):
    return torch.addcmul(scan(u, x, A, B, C), u, D[:, None], value=0.5)


def f_addcmul_skip_other_tensor(u, x, A, B, C, D, z, bias, W, ts):
    return torch.addcmul(scan(u, x, A, B, C), x, D[:, None])


def f_gate_sigmoid(u, x, A, B, C, D, z, bias, W, ts):
    return scan(u, x, A, B, C) * torch.sigmoid(z)


def f_gate_gelu(u, x, A, B, C, D, z, bias, W, ts):
    return scan(u, x, A, B, C) * F.gelu(z)


def f_gate_mismatched_sigmoid(u, x, A, B, C, D, z, bias, W, ts):
    return scan(u, x, A, B, C) * (z * torch.sigmoid(x))


def f_skip_product_not_turned_back(u, x, A, B, C, D, z, bias, W, ts):
    # Square (dim == L): the product computed on u.mT and permuted once more pairs channel d
    # with time step d, although it has y's shape.
    return scan(u, x, A, B, C) + (u.transpose(1, 2) * D).transpose(1, 2).transpose(1, 2)


def f_skip_written_through_its_transpose(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, x, A, B, C)
    skip = u.transpose(1, 2) * D
    skip.mul_(3)
    return (y + skip.transpose(1, 2)) * F.silu(z)


def f_skip_product_written_by_setitem(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, x, A, B, C)
    skip = u * D[:, None]
    skip[:, :, 0] = 0
    return (y + skip) * F.silu(z)


def f_skip_copy_written(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, x, A, B, C)
    skip = (u * D[:, None]).contiguous()
    skip.view(-1)[:5] = 0
    return (y + skip) * F.silu(z)


def f_gate_written_by_setitem(u, x, A, B, C, D, z, bias, W, ts):
    g = F.silu(z)
    g[:, :, 0] = 0
    return scan(u, x, A, B, C) * g


def f_gate_sigmoid_written(u, x, A, B, C, D, z, bias, W, ts):
    s = torch.sigmoid(z)
    s[:, 0] = 1
    return scan(u, x, A, B, C) * (z * s)


def f_skip_D_expanded_along_time(u, x, A, B, C, D, z, bias, W, ts):
    # Square (dim == L): D expanded along the time axis has y's shape but varies along time.
    return scan(u, x, A, B, C) + u * D[None, None, :].expand(*u.shape)


def f_skip_written_by_ipow(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, x, A, B, C)
    skip = u * D[:, None]
    flat = skip.view(-1)
    flat **= 2  # operator.ipow in dynamo's graph
    return (y + skip) * F.silu(z)


def f_gate_written_by_imod(u, x, A, B, C, D, z, bias, W, ts):
    g = F.silu(z)
    flat = g.view(-1)
    flat %= 0.3
    return scan(u, x, A, B, C) * g


def f_addcmul_factor_written(u, x, A, B, C, D, z, bias, W, ts):
    # The widened copy of a bf16 D, which the fold reads through to D itself, is written.
    wide = D.bfloat16()[:, None].float()
    wide[0] = 5.0
    return torch.addcmul(scan(u, x, A, B, C), u, wide) * F.silu(z)


def f_gate_after_two_skips(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, x, A, B, C)
    return (y + u * D[:, None] + u * D[:, None]) * F.silu(z)


def f_skip_scaled_by_alpha(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, x, A, B, C)
    return torch.add(y, u * D[:, None], alpha=2) * F.silu(z)


def f_skip_subtracted_with_alpha(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, x, A, B, C)
    return y.sub(u * D[:, None], alpha=0.5) * F.silu(z)


def f_gate_after_dropout(u, x, A, B, C, D, z, bias, W, ts):
    y = scan(u, x, A, B, C)
    return F.dropout(y, 0.0, training=False) * F.silu(z)


NEGATIVE = {
    # (probe BS: an nn.Dropout between the scan and the gate was left with no reason.)
    "gate_after_dropout": (f_gate_after_dropout, {}, dict(delta=0, skip=0, gate=0),
                           ("gate", "(torch.nn.functional.dropout of y), not y: the op gates y itself")),
    "skip_scaled_by_alpha": (f_skip_scaled_by_alpha, {}, dict(delta=0, skip=0, gate=0),
                             ("skip", "computes y + 2·mul (its alpha=2), not y + D·u")),
    "skip_subtracted_with_alpha": (f_skip_subtracted_with_alpha, {}, dict(delta=0, skip=0, gate=0),
                                   ("skip", "computes y - 0.5·mul (its alpha=0.5), not y + D·u")),
    "gate_after_a_scaled_skip": (f_skip_scaled_by_alpha, {}, dict(delta=0, skip=0, gate=0),
                                 ("gate", "= y + 2·mul, not y: the op gates y")),
    # name: (fn, layout/length, expected counters, (family, reason fragment) or None)
    "softplus_beta": (f_softplus_beta, {}, dict(delta=0, skip=0, gate=0), ("delta", "beta=2.0")),
    "softplus_log1p_exp": (f_softplus_log1p_exp, {}, dict(delta=0, skip=0, gate=0),
                           ("delta", "= log1p(exp(x)), softplus written out: it is inf wherever exp(x) overflows")),
    "softplus_log_one_plus_exp": (f_softplus_log_one_plus_exp, {}, dict(delta=0, skip=0, gate=0),
                                  ("delta", "= log(1 + exp(x)), softplus written out")),
    "softplus_threshold": (f_softplus_threshold, {}, dict(delta=0, skip=0, gate=0),
                           ("delta", "threshold=5.0")),
    "gate_before_skip": (f_gate_before_skip, {}, dict(delta=0, skip=0, gate=1),
                         ("skip", "after the z gate")),
    "y_also_returned": (f_y_also_returned, {}, dict(delta=0, skip=0, gate=0), ("skip", "other users")),
    "y_also_used_gate": (f_y_also_returned_gate, {}, dict(delta=0, skip=0, gate=0),
                         ("gate", "other users")),
    "D_on_time_axis": (f_D_on_time_axis, {}, dict(delta=0, skip=0, gate=0),
                       ("skip", "not a (dim,) vector")),
    "D_full_matrix": (f_D_full_matrix, {}, dict(delta=0, skip=0, gate=0), ("skip", "not a (dim,) vector")),
    "skip_other_tensor": (f_skip_other_tensor, {}, dict(delta=0, skip=0, gate=0),
                          ("skip", "not the scan's u")),
    "skip_transposed_u": (f_skip_transposed_u, {"length": DIM}, dict(delta=0, skip=0, gate=0),
                          ("skip", "another layout")),
    "skip_rounded_u": (f_skip_rounded_u, {}, dict(delta=0, skip=0, gate=0), ("skip", "rounding cast")),
    "addcmul_skip_scaled": (f_addcmul_skip_scaled, {}, dict(delta=0, skip=0, gate=0), ("skip", "{'value': 0.5}")),
    "addcmul_skip_other_tensor": (f_addcmul_skip_other_tensor, {}, dict(delta=0, skip=0, gate=0),
                                  ("skip", "not the scan's u")),
    "gate_sigmoid": (f_gate_sigmoid, {}, dict(delta=0, skip=0, gate=0), ("gate", "not silu")),
    "gate_gelu": (f_gate_gelu, {}, dict(delta=0, skip=0, gate=0), ("gate", "not silu")),
    "gate_mismatched_sigmoid": (f_gate_mismatched_sigmoid, {}, dict(delta=0, skip=0, gate=0), None),
    "skip_product_not_turned_back": (f_skip_product_not_turned_back, {"length": DIM}, dict(delta=0, skip=0, gate=0),
                                     ("skip", "not a (dim,) vector broadcast along the product's axis 1, which its "
                                              "permutation turns into y's dim axis 1")),
    "skip_written_through_its_transpose": (f_skip_written_through_its_transpose, {}, dict(delta=0, skip=0, gate=0),
                                           ("skip", "writes in place to the memory of a value in the D·u product")),
    "skip_product_written_by_setitem": (f_skip_product_written_by_setitem, {}, dict(delta=0, skip=0, gate=0),
                                        ("skip", "writes in place to the memory of a value in the D·u product")),
    "skip_copy_written": (f_skip_copy_written, {}, dict(delta=0, skip=0, gate=0),
                          ("skip", "writes in place to the memory of a value in the D·u product")),
    "gate_written_by_setitem": (f_gate_written_by_setitem, {}, dict(delta=0, skip=0, gate=0),
                                ("gate", "writes in place to the memory of a value in the gate")),
    "gate_sigmoid_written": (f_gate_sigmoid_written, {}, dict(delta=0, skip=0, gate=0),
                             ("gate", "writes in place to the memory of a value in the gate")),
    "skip_D_expanded_along_time": (f_skip_D_expanded_along_time, {"length": DIM}, dict(delta=0, skip=0, gate=0),
                                   ("skip", "not a (dim,) vector broadcast along the dim axis 1 of y")),
    "skip_written_by_ipow": (f_skip_written_by_ipow, {}, dict(delta=0, skip=0, gate=0),
                             ("skip", "writes in place to the memory of a value in the D·u product")),
    "gate_written_by_imod": (f_gate_written_by_imod, {}, dict(delta=0, skip=0, gate=0),
                             ("gate", "writes in place to the memory of a value in the gate")),
    "addcmul_factor_written": (f_addcmul_factor_written, {}, dict(delta=0, skip=0, gate=0),
                               ("skip", "writes in place to the memory of a value in the D·u product")),
    "gate_after_two_skips": (f_gate_after_two_skips, {}, dict(delta=0, skip=1, gate=0),
                             ("gate", "not y: the op gates y (with its own D·u) alone")),
}


@pytest.mark.parametrize("case", list(NEGATIVE))
def test_refused(case):
    fn, shape, expected, miss = NEGATIVE[case]
    inputs = make_inputs(**shape)
    ref = fn(**inputs)
    cap, out = compile_and_run(fn, *inputs.values())
    assert fired(cap) == expected
    if miss is not None:
        family, fragment = miss
        assert any(fragment in reason for reason in misses(cap, family)), cap.ctx.misses
    check_close(out, ref)


def f_tail_and_an_unrelated_write(u, x, A, B, C, D, z, bias, W, ts, state):
    y = scan(u, x, A, B, C)
    state.copy_(x[:, :, -1])
    return (y + u * D.view(u.shape[1], 1)) * F.silu(z)


def test_an_unrelated_write_under_dynamic_shapes_does_not_block_the_folds():
    """Under dynamic shapes the skip's term holds size nodes, which hold no memory; counted as
    unknown memory, any write in the graph (a cache's ``copy_``) refused the skip and the gate."""
    inputs = make_inputs()
    state = torch.zeros(BATCH, DIM)
    cap = PassCapture(*PASSES)
    out = torch.compile(f_tail_and_an_unrelated_write, backend=cap, dynamic=True)(*inputs.values(), state)
    assert fired(cap) == dict(delta=0, skip=1, gate=1), cap.ctx.misses
    expected_state = torch.zeros(BATCH, DIM)
    check_close(out, f_tail_and_an_unrelated_write(*inputs.values(), expected_state))
    assert torch.equal(state, expected_state)
