"""Tests for ``ssm::causal_conv1d``: CPU op, Triton kernels (interpreted on CPU), registration."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from utils import TOL, TRITON_DEVICE, in_layout_of, rel_err, traced_without_interpreter

from ssm_compile.kernels.causal_conv1d import op, reference, triton_conv
from ssm_compile.kernels.causal_conv1d.op import causal_conv1d_fn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (bias, silu, initial_state, transposed x): "T" is x as a (batch, L, dim) tensor's transpose.
FLAGS = {
    "plain": (False, False, False, False),
    "bias-silu": (True, True, False, False),
    "init": (False, False, True, False),
    "bias-silu-init": (True, True, True, False),
    "T": (False, True, False, True),
    "bias-silu-init-T": (True, True, True, True),
}
HALF_FLAGS = ("bias-silu-init", "T")


@pytest.fixture(scope="module", autouse=True)
def _ops():
    op.register()


def make_inputs(batch, dim, seqlen, width, dtype, flags, seed=0, device="cpu"):
    """Random (never zero) inputs; weights and bias are fp32 like a model's conv params."""
    has_bias, silu, has_init, transposed = flags
    g = torch.Generator().manual_seed(seed)
    if transposed:
        x = torch.randn(batch, seqlen, dim, generator=g).to(dtype).transpose(1, 2)
    else:
        x = torch.randn(batch, dim, seqlen, generator=g).to(dtype)
    return dict(
        x=x.to(device),
        weight=(torch.randn(dim, width, generator=g) / width**0.5).to(device),
        bias=torch.randn(dim, generator=g).to(device) if has_bias else None,
        initial_state=torch.randn(batch, dim, width - 1, generator=g).to(dtype).to(device)
        if has_init
        else None,
        activation="silu" if silu else None,
    )


def tensors(inputs):
    return {k: v for k, v in inputs.items() if torch.is_tensor(v)}


def op_args(inputs):
    """The inputs in the op schema's order."""
    names = ("x", "weight", "bias", "activation", "initial_state")
    return tuple(inputs[k] for k in names)


def ref_forward_backward(inputs, dy):
    """fp64 reference output and gradients w.r.t. every tensor input that is present."""
    leaves = {k: v.detach().double().requires_grad_() for k, v in tensors(inputs).items()}
    y = reference.causal_conv1d_ref(
        leaves["x"], leaves["weight"], leaves.get("bias"), inputs["activation"],
        leaves.get("initial_state"),
    )
    grads = torch.autograd.grad(y, list(leaves.values()), dy.double())
    return y.detach(), dict(zip(leaves, grads))


def case_id(batch, dim, seqlen, width, dtype, flags):
    return f"B{batch}-D{dim}-L{seqlen}-W{width}-{dtype}-{flags}"


# Every flag combination in fp32; the half dtypes on the two combinations that use all inputs.
CPU_CASES = [
    (2, 6, seqlen, width, dtype, flags)
    for width in (2, 3, 4, 5, 8)
    for seqlen in (1, 7, 37, 130)
    for dtype, flag_set in [("fp32", FLAGS), ("bf16", HALF_FLAGS), ("fp16", HALF_FLAGS)]
    for flags in flag_set
]


@pytest.mark.parametrize("case", CPU_CASES, ids=[case_id(*c) for c in CPU_CASES])
def test_cpu_forward(case):
    batch, dim, seqlen, width, dtype, flags = case
    inputs = make_inputs(batch, dim, seqlen, width, DTYPES[dtype], FLAGS[flags])
    y = causal_conv1d_fn(**inputs)
    assert y.shape == (batch, dim, seqlen) and y.dtype == DTYPES[dtype] and in_layout_of(y, inputs["x"])
    ref = reference.causal_conv1d_ref(**inputs)
    assert rel_err(y, ref) < TOL[DTYPES[dtype]]
    if inputs["initial_state"] is None:
        # The formulation users write, which the conv1d pass rewrites into this op.
        x, w, b = inputs["x"].float(), inputs["weight"], inputs["bias"]
        eager = F.conv1d(x, w.unsqueeze(1), b, padding=width - 1, groups=dim)[..., :seqlen]
        if inputs["activation"] == "silu":
            eager = F.silu(eager)
        assert rel_err(y, eager) < TOL[DTYPES[dtype]]


BWD_CASES = [
    (2, 6, seqlen, width, dtype, flags)
    for width in (2, 4, 5, 8)
    for seqlen in (1, 7, 130)
    for dtype, flag_set in [("fp32", FLAGS), ("bf16", HALF_FLAGS)]
    for flags in flag_set
]


@pytest.mark.parametrize("case", BWD_CASES, ids=[case_id(*c) for c in BWD_CASES])
def test_cpu_backward(case):
    batch, dim, seqlen, width, dtype, flags = case
    inputs = make_inputs(batch, dim, seqlen, width, DTYPES[dtype], FLAGS[flags])
    leaves = {k: v.detach().requires_grad_() for k, v in tensors(inputs).items()}
    y = causal_conv1d_fn(**{**inputs, **leaves})
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
    got = dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), dy)))
    _, ref = ref_forward_backward(inputs, dy)
    for name, grad in got.items():
        assert grad.dtype == inputs[name].dtype and grad.shape == inputs[name].shape, name
        assert rel_err(grad, ref[name]) < TOL[DTYPES[dtype]], name


# Interpreter cases: small, but chosen to cross tile edges. In B2-D20-L130 each backward
# program loops over three 64-wide L-blocks; the transposed (batch, L, dim) view uses L tiles of
# 64 (forward) and 16 (backward), so the halo crosses tile boundaries in both kernels.
TRITON_CASES = [
    (2, 20, 37, 4, "fp32", "plain"),
    (2, 20, 37, 4, "fp32", "bias-silu"),
    (2, 20, 37, 4, "fp32", "init"),
    (2, 20, 37, 4, "fp32", "bias-silu-init"),
    (1, 8, 1, 4, "fp32", "bias-silu-init"),
    (1, 8, 19, 2, "fp32", "bias-silu-init"),
    (1, 8, 19, 3, "fp32", "bias-silu-init"),
    (1, 8, 19, 5, "fp32", "bias-silu-init"),
    (1, 8, 19, 8, "fp32", "bias-silu-init"),
    (2, 20, 130, 4, "fp32", "bias-silu-init"),
    (1, 24, 130, 3, "fp32", "bias-silu-init-T"),
    (2, 20, 37, 4, "bf16", "bias-silu-init"),
    (2, 20, 37, 4, "fp16", "bias-silu-init"),
]


def triton_args(inputs):
    return (
        inputs["x"], inputs["weight"], inputs["bias"], inputs["initial_state"],
        inputs["activation"] == "silu",
    )


@pytest.mark.parametrize("case", TRITON_CASES, ids=[case_id(*c) for c in TRITON_CASES])
def test_triton_forward_backward(case):
    batch, dim, seqlen, width, dtype, flags = case
    inputs = make_inputs(batch, dim, seqlen, width, DTYPES[dtype], FLAGS[flags], device=TRITON_DEVICE)
    y = triton_conv.causal_conv1d_fwd(*triton_args(inputs))
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device, y.dtype)
    ref_y, ref = ref_forward_backward(inputs, dy)
    assert y.dtype == DTYPES[dtype] and in_layout_of(y, inputs["x"])
    assert rel_err(y, ref_y) < TOL[DTYPES[dtype]]

    grads = triton_conv.causal_conv1d_bwd(dy, *triton_args(inputs))
    for name, grad in grads._asdict().items():
        key = name[1:]
        if inputs[key] is None:
            assert grad.shape == (0,), name
            continue
        assert grad.dtype == inputs[key].dtype and grad.shape == inputs[key].shape, name
        assert rel_err(grad, ref[key]) < TOL[DTYPES[dtype]], name


def test_triton_strided_weight_and_expanded_dy():
    # `y.sum().backward()` hands the backward a zero-stride dy; a (W, dim) parameter used
    # transposed gives a weight with a non-unit inner stride. Neither may be copied or misread.
    inputs = make_inputs(2, 20, 37, 4, torch.float32, FLAGS["bias-silu-init"], device=TRITON_DEVICE)
    inputs["weight"] = inputs["weight"].t().contiguous().t()
    dy = torch.randn(1, 1, 1, generator=torch.Generator().manual_seed(1)).to(TRITON_DEVICE).expand(2, 20, 37)
    assert inputs["weight"].stride() == (1, 20) and dy.stride() == (0, 0, 0)
    _, ref = ref_forward_backward(inputs, dy)
    grads = triton_conv.causal_conv1d_bwd(dy, *triton_args(inputs))
    for name in ("x", "weight", "bias", "initial_state"):
        assert rel_err(getattr(grads, "d" + name), ref[name]) < TOL[torch.float32], name


def test_triton_dweight_is_deterministic():
    # Transposed x: 16-wide backward L-blocks over two programs per row, so dweight is a sum of
    # four per-program partials.
    inputs = make_inputs(2, 24, 130, 3, torch.float32, FLAGS["bias-silu-init-T"], device=TRITON_DEVICE)
    dy = torch.randn(2, 24, 130, generator=torch.Generator().manual_seed(1)).to(TRITON_DEVICE)
    first = triton_conv.causal_conv1d_bwd(dy, *triton_args(inputs))
    second = triton_conv.causal_conv1d_bwd(dy, *triton_args(inputs))
    assert torch.equal(first.dweight, second.dweight)
    assert torch.equal(first.dbias, second.dbias)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (CPU counterpart: the interpreter tests)"
)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_op_matches_reference_and_is_deterministic(dtype):
    inputs = make_inputs(2, 256, 1000, 4, DTYPES[dtype], FLAGS["bias-silu-init"], device="cuda")
    leaves = {k: v.detach().requires_grad_() for k, v in tensors(inputs).items()}
    y = causal_conv1d_fn(**{**inputs, **leaves})
    dy = torch.randn_like(y)
    got = dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), dy)))
    on_cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in inputs.items()}
    ref_y, ref = ref_forward_backward(on_cpu, dy.cpu())
    assert rel_err(y.cpu(), ref_y) < TOL[DTYPES[dtype]]
    for name, grad in got.items():
        assert rel_err(grad.cpu(), ref[name]) < TOL[DTYPES[dtype]], name
    for _ in range(3):
        again = torch.ops.ssm.causal_conv1d_backward(dy, *op_args(inputs))
        assert torch.equal(again[1], got["weight"])


OPCHECK_FLAGS = ["plain", "bias-silu", "bias-silu-init-T"]


@pytest.mark.parametrize("flags", OPCHECK_FLAGS)
def test_opcheck_forward(flags):
    inputs = make_inputs(2, 6, 11, 4, torch.float32, FLAGS[flags])
    args = tuple(v.requires_grad_() if torch.is_tensor(v) else v for v in op_args(inputs))
    torch.library.opcheck(torch.ops.ssm.causal_conv1d.default, args)


@pytest.mark.parametrize("flags", OPCHECK_FLAGS)
def test_opcheck_backward(flags):
    inputs = make_inputs(2, 6, 11, 4, torch.float32, FLAGS[flags])
    dy = torch.randn(2, 6, 11)
    torch.library.opcheck(torch.ops.ssm.causal_conv1d_backward.default, (dy, *op_args(inputs)))


@pytest.mark.parametrize("flags", ["bias-silu", "bias-silu-init-T"])
def test_gradcheck_fp64(flags):
    inputs = make_inputs(2, 3, 9, 3, torch.float64, FLAGS[flags])
    names = list(tensors(inputs))
    # make_inputs gives fp32 weight and bias (as a model has); gradcheck needs every input fp64.
    leaves = [inputs[k].detach().double().requires_grad_() for k in names]

    def fn(*tensors):
        return causal_conv1d_fn(**{**inputs, **dict(zip(names, tensors))})

    assert torch.autograd.gradcheck(fn, leaves)


def test_swish_is_silu():
    inputs = make_inputs(2, 6, 11, 4, torch.float32, FLAGS["bias-silu-init"])
    swish = causal_conv1d_fn(**{**inputs, "activation": "swish"})
    assert torch.equal(causal_conv1d_fn(**inputs), swish)


@pytest.mark.parametrize("batch, dim, seqlen", [(0, 6, 11), (2, 0, 11), (2, 6, 0)], ids=["batch0", "dim0", "L0"])
def test_empty_input_gives_an_empty_output_and_zero_grads(batch, dim, seqlen):
    # As F.conv1d does: a batch 0 (a filtered-out micro-batch) must not fail a compiled graph.
    inputs = make_inputs(batch, dim, seqlen, 4, torch.float32, FLAGS["bias-silu-init"])
    leaves = {k: v.detach().requires_grad_() for k, v in tensors(inputs).items()}
    y = causal_conv1d_fn(**{**inputs, **leaves})
    assert y.shape == (batch, dim, seqlen)
    y.sum().backward()
    for name, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape and not leaf.grad.any(), name
    torch.library.opcheck(torch.ops.ssm.causal_conv1d.default, op_args(inputs))
    dy = torch.randn(batch, dim, seqlen)
    torch.library.opcheck(torch.ops.ssm.causal_conv1d_backward.default, (dy, *op_args(inputs)))


def _bad(**changes):
    inputs = make_inputs(2, 6, 11, 4, torch.float32, FLAGS["bias-silu-init"])
    return {**inputs, **changes}


BAD_INPUTS = {  # name: (inputs, error, message regex)
    "x-rank": (_bad(x=torch.randn(6, 11)), ValueError, r"^causal_conv1d: x: .*\(batch, dim, seqlen\)"),
    "x-int": (_bad(x=torch.ones(2, 6, 11, dtype=torch.int32)), TypeError, r"^causal_conv1d: x: expected dtype"),
    "weight-dim": (_bad(weight=torch.randn(5, 4)), ValueError, r"^causal_conv1d: weight: .*\(dim=6, W\)"),
    "weight-W1": (_bad(weight=torch.randn(6, 1)), ValueError, r"^causal_conv1d: weight: .*W in \[2, 8\]"),
    "weight-W9": (
        _bad(weight=torch.randn(6, 9), initial_state=None), ValueError, r"^causal_conv1d: weight: .*\[2, 8\]"
    ),
    "weight-3d": (_bad(weight=torch.randn(6, 1, 4)), ValueError, r"^causal_conv1d: weight: expected shape"),
    "weight-int": (
        _bad(weight=torch.ones(6, 4, dtype=torch.int64)), TypeError, r"^causal_conv1d: weight: expected dtype"
    ),
    "bias-shape": (_bad(bias=torch.randn(7)), ValueError, r"^causal_conv1d: bias: expected shape \(6,\)"),
    "activation": (_bad(activation="relu"), ValueError, r"^causal_conv1d: activation: .*'silu' or 'swish'"),
    "init-shape": (
        _bad(initial_state=torch.randn(2, 6, 4)), ValueError, r"^causal_conv1d: initial_state: .*\(2, 6, 3\)"
    ),
    "init-dtype": (
        _bad(initial_state=torch.ones(2, 6, 3, dtype=torch.int32)), TypeError,
        r"^causal_conv1d: initial_state: expected dtype",
    ),
    "bias-device": (_bad(bias=torch.randn(6, device="meta")), ValueError, r"^causal_conv1d: bias: .*device cpu"),
    "x-None": (_bad(x=None), TypeError, r"^causal_conv1d: x: expected a Tensor, got NoneType"),
    "weight-None": (_bad(weight=None), TypeError, r"^causal_conv1d: weight: expected a Tensor, got NoneType"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_inputs_name_the_argument(name):
    inputs, error, match = BAD_INPUTS[name]
    with pytest.raises(error, match=match):
        causal_conv1d_fn(**inputs)


def test_backward_rejects_bad_dy():
    with pytest.raises(ValueError, match=r"^causal_conv1d_backward: dy: expected shape \(2, 6, 11\)"):
        torch.ops.ssm.causal_conv1d_backward(torch.randn(2, 6, 10), *op_args(_bad()))


def test_torch_compile_fullgraph():
    inputs = make_inputs(2, 6, 11, 4, torch.float32, FLAGS["bias-silu-init"])
    leaves = {k: v.detach().requires_grad_() for k, v in tensors(inputs).items()}

    def block(x, weight, bias, initial_state):
        # The op sits between ordinary ops that inductor fuses around it.
        y = causal_conv1d_fn(x * 2.0, weight, bias, initial_state, activation="silu")
        return (y * x).sum()

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    loss = compiled(**leaves)
    got = torch.autograd.grad(loss, list(leaves.values()))
    eager_loss = block(**leaves)
    expected = torch.autograd.grad(eager_loss, list(leaves.values()))
    assert rel_err(loss, eager_loss) < TOL[torch.float32]
    for name, g, e in zip(leaves, got, expected):
        assert rel_err(g, e) < TOL[torch.float32], name


# The kernels shape their tiles by x's unit-stride axis, and Triton lays each load out along
# its tensor's: x as HF Mamba passes it (the x half of the (batch, L, 2*dim) in_proj output,
# transposed: unit stride along dim; the forward streams rows over time segments, which L130 and
# L70 split into 5 segments each, so the halo and initial_state cross segment starts, with
# W=8 at L70; the backward's segments are longer, test_triton_rows_backward_flags crosses them),
# dy with unit stride along dim, and L-contiguous x long enough for two 256-step tiles, split over two
# backward programs (D8) or looped over by one (D40: more channel blocks than the interpreter's
# one "SM" wants).
LAYOUT_CASES = [
    # (batch, dim, seqlen, width, dtype, x layout, dy layout)
    (2, 20, 37, 4, "fp32", "in_proj", "contig"),
    (2, 20, 130, 4, "bf16", "in_proj", "contig"),
    (1, 72, 70, 8, "fp32", "in_proj", "contig"),
    (1, 12, 45, 2, "fp16", "in_proj", "T"),
    (2, 12, 45, 3, "fp32", "contig", "T"),
    (1, 8, 300, 4, "bf16", "contig", "contig"),
    (1, 8, 300, 5, "fp32", "contig", "contig"),
    (1, 40, 300, 4, "bf16", "contig", "contig"),
]


def layout_id(batch, dim, seqlen, width, dtype, x_layout, dy_layout):
    return f"B{batch}-D{dim}-L{seqlen}-W{width}-{dtype}-x_{x_layout}-dy_{dy_layout}"


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=[layout_id(*c) for c in LAYOUT_CASES])
def test_triton_layouts(case):
    batch, dim, seqlen, width, dtype, x_layout, dy_layout = case
    inputs = make_inputs(
        batch, dim, seqlen, width, DTYPES[dtype], FLAGS["bias-silu-init"], device=TRITON_DEVICE
    )
    g = torch.Generator().manual_seed(2)
    if x_layout == "in_proj":
        xz = torch.randn(batch, seqlen, 2 * dim, generator=g).to(TRITON_DEVICE, DTYPES[dtype])
        inputs["x"] = xz.transpose(1, 2)[:, :dim]
        assert inputs["x"].stride() == (2 * dim * seqlen, 1, 2 * dim)
        if TRITON_DEVICE == "cpu" and seqlen > 64:
            # The time segments the comment above counts (one interpreter "SM").
            _, _, seg_len = triton_conv._fwd_rows_tile(inputs["x"], batch, dim, seqlen)
            assert -(-seqlen // seg_len) >= 2
    if dy_layout == "T":
        dy = torch.randn(batch, seqlen, dim, generator=g).transpose(1, 2)
    else:
        dy = torch.randn(batch, dim, seqlen, generator=g)
    dy = dy.to(TRITON_DEVICE, DTYPES[dtype])
    ref_y, ref = ref_forward_backward(inputs, dy)
    y = triton_conv.causal_conv1d_fwd(*triton_args(inputs))
    assert in_layout_of(y, inputs["x"]) and rel_err(y, ref_y) < TOL[DTYPES[dtype]]
    grads = triton_conv.causal_conv1d_bwd(dy, *triton_args(inputs))
    for name in ("x", "weight", "bias", "initial_state"):
        grad = getattr(grads, "d" + name)
        assert grad.shape == inputs[name].shape, name
        assert rel_err(grad, ref[name]) < TOL[DTYPES[dtype]], name


@pytest.mark.parametrize("width", [2, 7])
@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)),
                         ids=lambda f: "-".join(n for n, on in zip(("bias", "silu", "init"), f) if on) or "plain")
def test_triton_rows_backward_flags(flags, width, monkeypatch):
    """The row-streaming backward (x with unit stride along dim) for every flag combination, dy in
    HF's layout too: 16-channel rows (two blocks, one partial) and 32-step segments, so that a
    length that is not a multiple of 8 runs over three segments and the rows read past each one
    (W-1 <= 6 of them) reach into the next, and initial_state only into the first."""
    batch, dim, seqlen = 1, 24, 83
    monkeypatch.setattr(triton_conv, "_bwd_rows_tile", lambda *args: (16, 1, 32))
    inputs = make_inputs(batch, dim, seqlen, width, torch.float32, (*flags, False), device=TRITON_DEVICE)
    g = torch.Generator().manual_seed(4)
    xz = torch.randn(batch, seqlen, 2 * dim, generator=g).to(TRITON_DEVICE)
    inputs["x"] = xz.transpose(1, 2)[:, dim:]
    dy = torch.randn(batch, seqlen, dim, generator=g).transpose(1, 2).to(TRITON_DEVICE)
    _, ref = ref_forward_backward(inputs, dy)
    grads = triton_conv.causal_conv1d_bwd(dy, *triton_args(inputs))
    assert in_layout_of(grads.dx, inputs["x"])
    for name in ("x", "weight", "bias", "initial_state"):
        if inputs[name] is None:
            continue
        grad = getattr(grads, "d" + name)
        assert grad.shape == inputs[name].shape, name
        assert rel_err(grad, ref[name]) < TOL[torch.float32], name


def test_validation_cache_still_rejects_a_new_bad_signature():
    """A signature that passed once is cached; a different, bad one must still be rejected."""
    good = make_inputs(1, 8, 16, 4, torch.float32, (True, True, True, False))
    for _ in range(2):
        torch.ops.ssm.causal_conv1d(*op_args(good))
    bad = dict(good, initial_state=good["initial_state"][..., :2])
    for _ in range(2):  # a rejected signature is never cached
        with pytest.raises(ValueError, match="initial_state"):
            torch.ops.ssm.causal_conv1d(*op_args(bad))
    with pytest.raises(ValueError, match="activation"):
        torch.ops.ssm.causal_conv1d(*op_args(dict(good, activation="relu")))


def test_no_grad_and_inference_mode_match_the_autograd_path():
    inputs = make_inputs(1, 8, 16, 4, torch.float32, (True, True, True, False))
    leaves = {k: v.clone().requires_grad_() if torch.is_tensor(v) else v for k, v in inputs.items()}
    y_grad = torch.ops.ssm.causal_conv1d(*op_args(leaves))
    assert y_grad.grad_fn is not None
    with torch.no_grad():
        y_nograd = torch.ops.ssm.causal_conv1d(*op_args(leaves))
    assert y_nograd.grad_fn is None and not y_nograd.requires_grad
    with torch.inference_mode():
        y_inf = torch.ops.ssm.causal_conv1d(*op_args(inputs))
    assert torch.equal(y_nograd, y_grad.detach()) and torch.equal(y_inf, y_grad.detach())


def test_double_backward_is_refused_by_name():
    inputs = make_inputs(1, 8, 16, 4, torch.float64, (True, True, False, False))
    x = inputs["x"].requires_grad_()
    y = torch.ops.ssm.causal_conv1d(*op_args(inputs))
    (dx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dx.sum().backward()


# --- the forward's launches handed to inductor (kernels/inline.py) -------------------------------

def _conv_forward_inputs(device, channel_innermost):
    inputs = make_inputs(2, 64, 40, 4, torch.bfloat16, (True, True, False, channel_innermost), device=device)
    return inputs["x"], inputs["weight"], inputs["bias"]


def _traced_conv_forward(device, channel_innermost):
    """The forward as AOTAutograd traces it (``FunctionalTensorMode``), on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    def forward(x, weight, bias):
        return torch.ops.ssm.causal_conv1d(x, weight, bias, "silu")

    real = _conv_forward_inputs("cpu", channel_innermost)
    with FakeTensorMode():
        args = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) for t in real]
    gm = make_fx(dispatch_functionalize(forward), tracing_mode="fake")(*args)
    return sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})


_CONV_TRACE_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_causal_conv1d as t
# The row-streaming kernel's launcher reads the SM count, which a machine without a GPU lacks.
t.triton_conv.num_sms = lambda index: 132
t.op.register()
print(json.dumps({f"{d}/{layout}": t._traced_conv_forward(d, layout == "ci")
                  for d in ("cuda", "cpu") for layout in ("ci", "lmajor")}))
"""


def test_functionalization_inlines_the_forward_launches():
    """On CUDA the forward becomes its kernel's wrap_triton launch (the row-streaming kernel for
    HF's channel-innermost x, the chunk-tile kernel for L-major x); on CPU the op stays. Traced
    with fake CUDA tensors, so it runs without a GPU; in a subprocess without TRITON_INTERPRET,
    under which the rule keeps the op whole."""
    traced = traced_without_interpreter(_CONV_TRACE_SCRIPT)
    for layout in ("ci", "lmajor"):
        assert "triton_kernel_wrapper_functional" in traced[f"cuda/{layout}"], traced
        assert "ssm.causal_conv1d.default" not in traced[f"cuda/{layout}"], traced
        assert "ssm.causal_conv1d.default" in traced[f"cpu/{layout}"], traced
        assert "triton_kernel_wrapper_functional" not in traced[f"cpu/{layout}"], traced


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU counterpart: the tracing test above)")
@pytest.mark.parametrize("channel_innermost", [True, False], ids=["ci", "lmajor"])
def test_inductor_launches_the_forward_kernel_itself(channel_innermost):
    """A training step under inductor on CUDA: the forward kernel is launched from inductor's code,
    the backward is the op, and both match eager."""
    from torch._inductor.utils import run_and_get_code

    x, weight, bias = (t.requires_grad_() for t in _conv_forward_inputs("cuda", channel_innermost))

    def step(forward):
        y = forward(x, weight, bias, "silu")
        return y, torch.autograd.grad(y.float().square().sum(), (x, weight, bias))

    y_e, grads_e = step(torch.ops.ssm.causal_conv1d)
    # The backward is compiled when autograd first runs it: inside step, so its code is captured.
    (y_c, grads_c), codes = run_and_get_code(step, torch.compile(lambda *args: torch.ops.ssm.causal_conv1d(*args)))
    code = "\n".join(codes)
    kernel = "_causal_conv1d_fwd_rows_kernel" if channel_innermost else "_causal_conv1d_fwd_kernel"
    assert kernel in code and "torch.ops.ssm.causal_conv1d.default" not in code
    assert "causal_conv1d_backward" in code
    assert torch.equal(y_c, y_e) and y_c.stride() == y_e.stride()
    for got, want in zip(grads_c, grads_e):
        assert rel_err(got, want) < 1e-5
