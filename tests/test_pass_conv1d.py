"""The ``conv1d`` pass: causal depthwise convs in the forms real code writes -> ssm.causal_conv1d."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch._dynamo.utils import counters
from utils import PassCapture, TOL, compile_with_passes, rel_err

from ssm_compile.passes import conv1d as conv1d_pass
from ssm_compile.passes.fx_utils import normalized_graph_str

DIM, L, W = 6, 11, 4


@pytest.fixture(scope="module", autouse=True)
def registered():
    # The rewritten graphs call torch.ops.ssm.*; the op must exist before they are traced.
    from ssm_compile.kernels.causal_conv1d import op

    op.register()


PASSES = (conv1d_pass,)


def compile_and_run(fn, *args):
    return compile_with_passes(fn, *args, passes=PASSES)


def make_inputs(dtype=torch.float32, width=W, dim=DIM, length=L, layout="bdl"):
    g = torch.Generator().manual_seed(0)
    shape = (2, dim, length) if layout == "bdl" else (2, length, dim)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (torch.randn(dim, 1, width, generator=g) / width).to(dtype)
    b = torch.randn(dim, generator=g).to(dtype)
    return x, w, b


# --- positive forms -------------------------------------------------------------------------

def f_functional_silu(x, w, b):
    return F.silu(F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1])[..., :x.shape[-1]])


def f_positional_sigmoid_no_bias(x, w, b):
    y = torch.conv1d(x, w, None, 1, w.shape[-1] - 1, 1, x.shape[1])[:, :, :x.shape[-1]]
    return y * torch.sigmoid(y)


def f_no_activation(x, w, b):
    return F.conv1d(x, w, b, padding=(w.shape[-1] - 1,), groups=x.shape[1])[..., :-(w.shape[-1] - 1)]


def f_hf524_causal_conv1d_fn(x, w, b):
    from transformers.models.mamba.modeling_mamba import causal_conv1d_fn

    # HF 5.24 passes the squeezed (dim, W) weight and unsqueezes it again inside.
    return causal_conv1d_fn(x, w.squeeze(1), b, activation="silu")


class HF517Block(nn.Module):
    """HF 5.17's slow path, in the (batch, L, dim) layout: self.act(self.conv1d(h)[..., :L])."""

    def __init__(self, dim, width):
        super().__init__()
        from transformers.activations import ACT2FN

        self.conv1d = nn.Conv1d(dim, dim, width, groups=dim, padding=width - 1)
        self.act = ACT2FN["silu"]

    def forward(self, h):
        seq_len = h.shape[1]
        return self.act(self.conv1d(h.transpose(1, 2))[..., :seq_len]).transpose(1, 2)


def f_cat_zeros(x, w, b):
    # The causal pad written as a concatenation of W-1 zero steps in front of x.
    pad = torch.zeros(x.shape[0], x.shape[1], w.shape[-1] - 1, dtype=x.dtype)
    return F.silu(F.conv1d(torch.cat([pad, x], dim=-1), w, b, groups=x.shape[1]))


def f_narrow(x, w, b):
    return F.silu(F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1]).narrow(-1, 0, x.shape[-1]))


def f_full_batch_slice(x, w, b):
    # Slices that keep every batch row and channel are no slices of them.
    return F.silu(F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1])[0:x.shape[0], :, :x.shape[-1]])


def f_pad_all_axes(x, w, b):
    # F.pad's further (left, right) pairs pad the axes before time; all zero here.
    return F.silu(F.conv1d(F.pad(x, (w.shape[-1] - 1, 0, 0, 0, 0, 0)), w, b, groups=x.shape[1]))


def f_silu_then_slice(x, w, b):
    # silu on the padded output, then the slice: elementwise, so the silu of the causal conv.
    return F.silu(F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1]))[..., :x.shape[-1]]


def f_sigmoid_product_then_narrow(x, w, b):
    y = F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1])
    return (y * torch.sigmoid(y)).narrow(2, 0, x.shape[-1])


def f_gelu_then_slice(x, w, b):
    return F.gelu(F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1]), approximate="tanh")[..., :x.shape[-1]]


def f_tanh_method_then_narrow(x, w, b):
    return F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1]).tanh().narrow(-1, 0, x.shape[-1])


FORMS = {
    "gelu-then-slice": (f_gelu_then_slice, "conv1d+gelu[..., :L]", None),
    "tanh-then-narrow": (f_tanh_method_then_narrow, "conv1d+tanh[..., :L]", None),
    "silu-then-slice": (f_silu_then_slice, "conv1d+silu[..., :L]", "silu"),
    "x*sigmoid(x)-then-narrow": (f_sigmoid_product_then_narrow, "conv1d+x*sigmoid(x)[..., :L]", "silu"),
    "narrow": (f_narrow, "conv1d[..., :L]+silu", "silu"),
    "full-batch-slice": (f_full_batch_slice, "conv1d[..., :L]+silu", "silu"),
    "pad-with-zero-pairs-for-other-axes": (f_pad_all_axes, "pad(W-1, 0)+conv1d+silu", "silu"),
    "F.conv1d+F.silu": (f_functional_silu, "conv1d[..., :L]+silu", "silu"),
    "torch.conv1d-positional+x*sigmoid(x)": (f_positional_sigmoid_no_bias, "conv1d[..., :L]+x*sigmoid(x)", "silu"),
    "no-activation-slice-minus-W": (f_no_activation, "conv1d[..., :L]", None),
    "hf524-causal_conv1d_fn": (f_hf524_causal_conv1d_fn, "conv1d[..., :L]+silu", "silu"),
    "cat-zeros": (f_cat_zeros, "cat(zeros(W-1), x)+conv1d+silu", "silu"),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_functional_forms_rewrite(form):
    fn, pattern, activation = FORMS[form]
    x, w, b = make_inputs()
    cap, out = compile_and_run(fn, x, w, b)
    assert counters["ssm"]["conv1d"] == 1
    (rewrite,) = cap.ctx.rewrites
    assert (rewrite.pattern, rewrite.emitted, rewrite.decision["activation"]) == (pattern, "ssm.causal_conv1d", activation)
    targets = [n.target for n in cap.gm.graph.nodes]
    assert torch.ops.ssm.causal_conv1d.default in targets and torch.conv1d not in targets
    assert rel_err(out, fn(x, w, b)) <= TOL[torch.float32]


@pytest.mark.parametrize("width", [2, 3, 4, 8], ids=lambda w: f"W{w}")
def test_nn_conv1d_bld_layout_widths(width):
    block = HF517Block(DIM, width)
    h = make_inputs(width=width, layout="bld")[0]
    cap, out = compile_and_run(block, h)
    assert counters["ssm"]["conv1d"] == 1 and cap.ctx.rewrites[0].decision["W"] == width
    assert rel_err(out, block(h)) <= TOL[torch.float32]


def test_snapshot_functional_silu():
    cap, _ = compile_and_run(f_functional_silu, *make_inputs())
    assert_expected_inline(normalized_graph_str(cap.gm, with_meta=True), """\
%L_b_ = placeholder  # float32[6]
%L_w_ = placeholder  # float32[6, 1, 4]
%L_x_ = placeholder  # float32[2, 6, 11]
%squeeze_1 = .squeeze(%L_w_, 1)  # float32[6, 4]
%causal_conv1d_1 = torch.ops.ssm.causal_conv1d.default(%L_x_, %squeeze_1, %L_b_, 'silu')  # float32[2, 6, 11]
return (%causal_conv1d_1,)
""")


def test_snapshot_hf517_module_bld():
    cap, _ = compile_and_run(HF517Block(DIM, W), make_inputs(layout="bld")[0])
    assert_expected_inline(normalized_graph_str(cap.gm, with_meta=True), """\
%L_h_ = placeholder  # float32[2, 11, 6]
%L_self_modules_conv1d_parameters_bias_ = placeholder  # float32[6]
%L_self_modules_conv1d_parameters_weight_ = placeholder  # float32[6, 1, 4]
%transpose_1 = .transpose(%L_h_, 1, 2)  # float32[2, 6, 11]
%squeeze_1 = .squeeze(%L_self_modules_conv1d_parameters_weight_, 1)  # float32[6, 4]
%causal_conv1d_1 = torch.ops.ssm.causal_conv1d.default(%transpose_1, %squeeze_1, %L_self_modules_conv1d_parameters_bias_, 'silu')  # float32[2, 6, 11]
%transpose_2 = .transpose(%causal_conv1d_1, 1, 2)  # float32[2, 11, 6]
%permute_1 = .permute(%transpose_2, 0, 2, 1)  # float32[2, 6, 11]
%contiguous_1 = .contiguous(%permute_1)  # float32[2, 6, 11]
%permute_2 = .permute(%contiguous_1, 0, 2, 1)  # float32[2, 11, 6]
return (%permute_2,)
""")


def test_hf524_reuses_unsqueezed_weight_without_a_new_view():
    cap, _ = compile_and_run(f_hf524_causal_conv1d_fn, *make_inputs())
    assert not any(n.target == "unsqueeze" for n in cap.gm.graph.nodes)
    assert sum(n.target == "squeeze" for n in cap.gm.graph.nodes) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).removeprefix("torch."))
def test_half_precision_numerics(dtype):
    x, w, b = make_inputs(dtype)
    cap, out = compile_and_run(f_functional_silu, x, w, b)
    assert counters["ssm"]["conv1d"] == 1 and out.dtype == dtype
    ref = f_functional_silu(x.double(), w.double(), b.double())
    assert rel_err(out, ref) <= TOL[dtype]


def test_dynamic_shapes_prove_slice_length_symbolically():
    x, w, b = make_inputs()
    cap = PassCapture(*PASSES)
    torch._dynamo.mark_dynamic(x, 2)
    compiled = torch.compile(f_functional_silu, backend=cap)
    out = compiled(x, w, b)
    assert counters["ssm"]["conv1d"] == 1
    assert rel_err(out, f_functional_silu(x, w, b)) <= TOL[torch.float32]
    x2 = make_inputs(length=17)[0]
    assert counters["stats"]["unique_graphs"] == 1
    assert rel_err(compiled(x2, w, b), f_functional_silu(x2, w, b)) <= TOL[torch.float32]


# --- negative cases: each must be left alone, with the reason recorded ------------------------

def neg_not_depthwise(x, w, b):
    return F.conv1d(x, w, b, padding=3)[..., :x.shape[-1]]


def neg_padding_short(x, w, b):
    return F.conv1d(x, w, b, padding=2, groups=x.shape[1])[..., :x.shape[-1] - 1]


def neg_padding_same(x, w, b):
    return F.conv1d(x, w, b, padding="same", groups=x.shape[1])


def neg_slice_not_from_start(x, w, b):
    return F.conv1d(x, w, b, padding=3, groups=x.shape[1])[..., 3:]


def neg_slice_too_long(x, w, b):
    return F.conv1d(x, w, b, padding=3, groups=x.shape[1])[..., :x.shape[-1] + 1]


def neg_stride(x, w, b):
    return F.conv1d(x, w, b, stride=2, padding=3, groups=x.shape[1])[..., :4]


def neg_dilation(x, w, b):
    return F.conv1d(x, w, b, padding=3, dilation=2, groups=x.shape[1])[..., :x.shape[-1]]


def neg_other_user(x, w, b):
    full = F.conv1d(x, w, b, padding=3, groups=x.shape[1])
    return full[..., :x.shape[-1]], full.sum()


def neg_slice_channel_too(x, w, b):
    return F.conv1d(x, w, b, padding=3, groups=x.shape[1])[:, :3, :x.shape[-1]]


def neg_unsliced(x, w, b):
    return F.conv1d(x, w, b, padding=3, groups=x.shape[1])


def neg_cat_state(x, w, b):
    # A zeros block that a conv state is copied into: an initial window, not a zero pad.
    pad = torch.zeros(x.shape[0], x.shape[1], w.shape[-1] - 1)
    pad.copy_(x[:, :, :w.shape[-1] - 1] * 0.5)
    return F.conv1d(torch.cat([pad, x], dim=-1), w, b, groups=x.shape[1])


def neg_pad_state(x, w, b):
    # An initial window written into F.pad's zeros (probe AI, run 49: rewritten, the window lost).
    xp = F.pad(x, (w.shape[-1] - 1, 0))
    xp[..., :w.shape[-1] - 1] = x[:, :, -(w.shape[-1] - 1):] * 0.5
    return F.conv1d(xp, w, b, groups=x.shape[1])


def neg_cat_state_after(x, w, b):
    # The same written into the cat's output rather than into its zeros block.
    xp = torch.cat([torch.zeros(x.shape[0], x.shape[1], w.shape[-1] - 1), x], dim=-1)
    xp[..., :w.shape[-1] - 1] = x[:, :, -(w.shape[-1] - 1):] * 0.5
    return F.conv1d(xp, w, b, groups=x.shape[1])


def neg_cat_zeros_after(x, w, b):
    pad = torch.zeros(x.shape[0], x.shape[1], w.shape[-1] - 1)
    return F.conv1d(torch.cat([x, pad], dim=-1), w, b, groups=x.shape[1])


def neg_cat_zeros_short(x, w, b):
    pad = x.new_zeros(x.shape[0], x.shape[1], w.shape[-1] - 2)
    return F.conv1d(torch.cat([pad, x], dim=-1), w, b, groups=x.shape[1])


def neg_narrow_from_1(x, w, b):
    return F.conv1d(x, w, b, padding=3, groups=x.shape[1]).narrow(-1, 1, x.shape[-1])


def neg_slice_step_2(x, w, b):
    return F.conv1d(x, w, b, padding=3, groups=x.shape[1])[..., 0:2 * x.shape[-1]:2]


def neg_narrow_short(x, w, b):
    return F.conv1d(x, w, b, padding=3, groups=x.shape[1]).narrow(-1, 0, x.shape[-1] - 1)


def neg_padded_dilated(x, w, b):
    # A causal dilated conv: padded by dilation·(W-1) on the left (probe AI, run 49: blamed on the pad).
    return F.conv1d(F.pad(x, (2 * (w.shape[-1] - 1), 0)), w, b, dilation=2, groups=x.shape[1])


def neg_batch_row_slice(x, w, b):
    return F.conv1d(x, w, b, padding=3, groups=x.shape[1])[0:1, :, :x.shape[-1]]


def neg_pad_batch_too(x, w, b):
    return F.conv1d(F.pad(x, (3, 0, 0, 0, 1, 0)), w, b, groups=x.shape[1])


def neg_silu_then_slice_from_1(x, w, b):
    return F.silu(F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1]))[..., 1:x.shape[-1] + 1]


def neg_silu_then_two_slices(x, w, b):
    y = F.silu(F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1]))
    return y[..., :x.shape[-1]] + y[..., w.shape[-1] - 1:]


def neg_relu_in_place_then_slice(x, w, b):
    return F.relu(F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1]), inplace=True)[..., :x.shape[-1]]


def neg_relu_method_in_place_then_slice(x, w, b):
    return F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1]).relu_()[..., :x.shape[-1]]


def neg_tanh_in_place_then_slice(x, w, b):
    c = F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1])
    c.tanh_()
    return c[..., :x.shape[-1]]


def neg_written_by_setitem_before_the_slice_is_read(x, w, b):
    # (Probe CJ, run 61: the reason named the right-hand padding, not the write.)
    c = F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1])
    y = c[..., :x.shape[-1]]
    c[..., 1] = 5.0
    return F.silu(y)


def neg_written_through_a_view_before_the_slice_is_read(x, w, b):
    # (Probe CN, run 62: the right-hand padding was blamed again when the write went through a view.)
    c = F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1])
    y = c[..., :x.shape[-1]]
    c[:, :, :][..., 1] = 5.0
    return F.silu(y)


def neg_pad_both_sides_then_slice(x, w, b):
    # nn.Conv1d(padding=W-1)'s pad by hand: causal once sliced, but only (W-1, 0) is the form proved.
    return F.conv1d(F.pad(x, (w.shape[-1] - 1, w.shape[-1] - 1)), w, b, groups=x.shape[1])[..., :x.shape[-1]]


NEGATIVES = {
    "pad-both-sides-then-slice": (neg_pad_both_sides_then_slice, {},
                                  "zero-padded by (3, 3) on the time axis, W-1 on the left and more on the right: the first "
                                  "L outputs are a causal conv, but the pass rewrites only a pad of (W-1, 0)"),
    "silu-then-slice-from-1": (neg_silu_then_slice_from_1, {}, "the slice [..., 1:12] does not start at step 0"),
    "silu-then-two-slices": (neg_silu_then_two_slices, {},
                             "(torch.nn.functional.silu), whose result is read by getitem (operator.getitem), getitem_1"),
    "relu-in-place-then-slice": (neg_relu_in_place_then_slice, {},
                                 "(torch.nn.functional.relu, in place) writes it in place: the pass folds"),
    # (probe BP: "its last W - 1 steps see the right-hand padding, so it is not a causal conv".)
    "relu-method-in-place-then-slice": (neg_relu_method_in_place_then_slice, {},
                                        "relu_ (.relu_, in place) writes it in place: the pass folds"),
    "setitem-then-slice": (neg_written_by_setitem_before_the_slice_is_read, {},
                           "setitem (operator.setitem, in place) writes it in place"),
    "setitem-through-a-view-then-slice": (neg_written_through_a_view_before_the_slice_is_read, {},
                                          "setitem (operator.setitem, through a view) writes it in place"),
    "tanh-in-place-then-slice": (neg_tanh_in_place_then_slice, {},
                                 "getitem (operator.getitem), and tanh_ (.tanh_, in place) writes it in place"),
    "narrow-from-1": (neg_narrow_from_1, {}, "does not start at step 0"),
    "batch-row-slice": (neg_batch_row_slice, {}, "not a slice of the time axis alone"),
    "pad-batch-too": (neg_pad_batch_too, {}, "not zeros (W-1, 0) on the left only"),
    "groups-1": (neg_not_depthwise, {"w": (DIM, DIM, W)}, "not depthwise"),
    "padding-W-2": (neg_padding_short, {}, "padding 2 is not kernel_size - 1"),
    "padding-same": (neg_padding_same, {}, "padding 'same'"),
    "slice-from-3": (neg_slice_not_from_start, {}, "the slice [..., 3:] does not start at step 0"),
    # The step and the narrow's length are named (probe AI, run 49: "slice(0, 12, 2) does not
    # start at step 0", and a narrow printed as slice(0, None, None)).
    "slice-step-2": (neg_slice_step_2, {}, "the slice [..., 0:22:2] steps by 2, not 1"),
    "padded-dilated": (neg_padded_dilated, {}, "dilation 2 is not 1 (a dilated conv over a padded input)"),
    "narrow-L-1": (neg_narrow_short, {}, "the slice narrow(-1, 0, 10) does not keep exactly the first L=11"),
    "slice-L+1": (neg_slice_too_long, {}, "first L=11 steps"),
    "stride-2": (neg_stride, {}, "stride 2 is not 1"),
    "dilation-2": (neg_dilation, {}, "dilation 2 is not 1"),
    "other-user": (neg_other_user, {}, "is read by getitem (operator.getitem), sum_1 (.sum), not only"),
    "channel-slice": (neg_slice_channel_too, {}, "not a slice of the time axis alone"),
    # The slice may be in the next graph, after a graph break (probe BS).
    "unsliced": (neg_unsliced, {}, "is read by the graph's output, not only by one slice [..., :L] (directly, or "
                 "through out-of-place elementwise functions of it alone, each read once: activations, and "
                 "arithmetic with a Python number, not with a tensor, pow or floor division): its last W - 1 steps "
                 "see the right-hand padding, so it is not a causal conv in this graph (a slice after a graph "
                 "break, in the next graph, is not seen here)"),
    "W9": (f_functional_silu, {"width": 9}, "kernel width 9 unsupported"),
    "W1": (f_functional_silu, {"width": 1}, "kernel width 1 unsupported"),
    "fp64": (f_functional_silu, {"dtype": torch.float64}, "dtype torch.float64 is not supported"),
    "cat-state-copied-into-zeros": (neg_cat_state, {}, "concatenates zeros in front of x"),
    "cat-zeros-W-2": (neg_cat_zeros_short, {}, "concatenates zeros in front of x"),
    "pad-state-written-into-pad": (neg_pad_state, {}, "writes in place to the padded tensor"),
    "cat-state-written-into-cat": (neg_cat_state_after, {}, "writes in place to the padded tensor"),
}


def unpadded_window(x, w, b):
    # HF's decode step: the caller builds the window (state + new input) and convolves it unpadded.
    return F.conv1d(x, w, b, padding=0, groups=x.shape[1])


def unpadded_window_valid(x, w, b):
    return F.conv1d(x, w, b, padding="valid", groups=x.shape[1])


@pytest.mark.parametrize("fn", [unpadded_window, unpadded_window_valid, neg_cat_zeros_after],
                         ids=["padding-0", "padding-valid", "zeros-after-x"])
def test_unpadded_conv_is_no_candidate_and_records_no_miss(fn):
    x, w, b = make_inputs()
    cap, out = compile_and_run(fn, x, w, b)
    assert counters["ssm"]["conv1d"] == 0 and not cap.ctx.rewrites
    assert not [m for m in cap.ctx.misses if m.family == "conv1d"], cap.ctx.misses
    assert torch.conv1d in [n.target for n in cap.gm.graph.nodes]
    torch.testing.assert_close(out, fn(x, w, b), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("case", list(NEGATIVES))
def test_near_misses_are_refused(case):
    fn, overrides, reason = NEGATIVES[case]
    x, w, b = make_inputs(dtype=overrides.get("dtype", torch.float32), width=overrides.get("width", W))
    if "w" in overrides:
        w = torch.randn(overrides["w"])
    cap, out = compile_and_run(fn, x, w, b)
    assert counters["ssm"]["conv1d"] == 0 and not cap.ctx.rewrites
    assert any(m.family == "conv1d" and reason in m.reason for m in cap.ctx.misses), cap.ctx.misses
    assert torch.conv1d in [n.target for n in cap.gm.graph.nodes]
    torch.testing.assert_close(out, fn(x, w, b), rtol=0, atol=0)
