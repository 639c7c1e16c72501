"""The decode ops against the fp64 reference: CPU path, Triton kernels, in-place state, errors."""
import itertools
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from ssm_compile.kernels import inline
from ssm_compile.kernels.decode import op as decode_op
from ssm_compile.kernels.decode import triton_decode
from ssm_compile.kernels.decode.reference import causal_conv1d_update_ref, selective_state_update_ref
from utils import TOL, rel_err, traced_without_interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@pytest.fixture(scope="module", autouse=True)
def _ops():
    decode_op.register()


# The Triton launchers run on the GPU when there is one, else on CPU tensors under the
# interpreter (conftest sets TRITON_INTERPRET=1 before any kernel is imported).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _dev(t):
    return None if not isinstance(t, torch.Tensor) else t.to(TRITON_DEVICE)


def _op_state_update(state, *args):
    return torch.ops.ssm.selective_state_update(state, *args)


def _triton_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    # The launcher takes validated inputs with B/C already grouped, as the op layer hands them.
    B, C = (t.unsqueeze(1) if t.dim() == 2 else t for t in (B, C))
    st = state.to(TRITON_DEVICE)
    y = triton_decode.selective_state_update(st, *map(_dev, (x, dt, A, B, C, D, z, dt_bias)), dt_softplus)
    if st is not state:
        state.copy_(st)
    return y.to(state.device)


def _op_conv_update(x, conv_state, weight, bias, activation):
    return torch.ops.ssm.causal_conv1d_update(x, conv_state, weight, bias, activation)


def _triton_conv_update(x, conv_state, weight, bias, activation):
    x3 = x.unsqueeze(-1) if x.dim() == 2 else x
    st = conv_state.to(TRITON_DEVICE)
    y = triton_decode.causal_conv1d_update(_dev(x3), st, _dev(weight), _dev(bias), activation)
    if st is not conv_state:
        conv_state.copy_(st)
    y = y.to(x.device)
    return y.squeeze(-1) if x.dim() == 2 else y


def _fresh_out(st):
    """An output state for the launchers' out-of-place mode (the ops' inlined path), with a
    layout of its own (axes 1 and 2 swapped in memory), so the kernel must use its strides."""
    return torch.empty(st.shape[0], st.shape[2], st.shape[1], dtype=st.dtype, device=st.device).transpose(1, 2)


def _triton_state_update_out_of_place(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    # Inlined on CUDA, the op hands the launcher a fresh buffer for the new state: the old one
    # must be read and left as it was.
    B, C = (t.unsqueeze(1) if t.dim() == 2 else t for t in (B, C))
    st = state.to(TRITON_DEVICE)
    before, new = st.clone(), _fresh_out(st)
    y = triton_decode.selective_state_update(st, *map(_dev, (x, dt, A, B, C, D, z, dt_bias)), dt_softplus,
                                             new_state=new)
    assert torch.equal(st, before)
    state.copy_(new)
    return y.to(state.device)


def _triton_conv_update_out_of_place(x, conv_state, weight, bias, activation):
    x3 = x.unsqueeze(-1) if x.dim() == 2 else x
    st = conv_state.to(TRITON_DEVICE)
    before, new = st.clone(), _fresh_out(st)
    y = triton_decode.causal_conv1d_update(_dev(x3), st, _dev(weight), _dev(bias), activation, new_state=new)
    assert torch.equal(st, before)
    conv_state.copy_(new)
    y = y.to(x.device)
    return y.squeeze(-1) if x.dim() == 2 else y


STATE_IMPLS = {"cpu": _op_state_update, "triton": _triton_state_update,
               "triton_out_of_place": _triton_state_update_out_of_place}
CONV_IMPLS = {"cpu": _op_conv_update, "triton": _triton_conv_update,
              "triton_out_of_place": _triton_conv_update_out_of_place}


def make_state_update_inputs(batch, dim, N, G, dtype, full, seed=0):
    """Random inputs; G=0 means plain (batch, N) B/C. ``full`` turns on D, z, dt_bias, softplus."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    bc = (batch, N) if G == 0 else (batch, G, N)
    return dict(
        state=rnd(batch, dim, N, dt=torch.float32),
        x=rnd(batch, dim), dt=rnd(batch, dim, scale=0.5),
        A=-torch.rand(dim, N, generator=g) - 0.1,
        B=rnd(*bc), C=rnd(*bc),
        D=rnd(dim, dt=torch.float32) if full else None,
        z=rnd(batch, dim) if full else None,
        dt_bias=rnd(dim, dt=torch.float32, scale=0.5) if full else None,
        dt_softplus=full,
    )


def _args(inp):
    keys = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus")
    return [inp[k] for k in keys]


STATE_CASES = [
    # (batch, dim, N, G, full)
    (2, 24, 8, 0, True),
    (2, 24, 8, 3, True),
    (1, 40, 16, 1, False),
    (3, 20, 5, 2, True),  # N not a power of two; dim block straddles groups
]


@pytest.mark.parametrize("impl", list(STATE_IMPLS))
@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("batch,dim,N,G,full", STATE_CASES,
                         ids=[f"B{b}-D{d}-N{n}-G{g}-{'full' if f else 'bare'}" for b, d, n, g, f in STATE_CASES])
def test_selective_state_update_matches_reference(impl, dtype, batch, dim, N, G, full):
    inp = make_state_update_inputs(batch, dim, N, G, dtype, full)
    y_ref, h_ref = selective_state_update_ref(inp["state"], *_args(inp))
    state = inp["state"].clone()
    ptr = state.data_ptr()
    y = STATE_IMPLS[impl](state, *_args(inp))
    assert y.dtype == dtype and y.shape == (batch, dim)
    assert rel_err(y, y_ref) < TOL[dtype]
    # The state is fp32 and computed from the same (already rounded) inputs, so it is held to fp32.
    assert state.data_ptr() == ptr and rel_err(state, h_ref) < 10 * TOL[torch.float32]


@pytest.mark.parametrize("impl", list(STATE_IMPLS))
def test_selective_state_update_strided_inputs(impl):
    """Non-contiguous views (as HF slices them out of bigger tensors) give the same answer."""
    batch, dim, N = 2, 24, 8
    inp = make_state_update_inputs(batch, dim, N, 0, torch.float32, True)
    y_ref, h_ref = selective_state_update_ref(inp["state"], *_args(inp))
    # Built on the device that runs the kernel, so the views reach it with their strides.
    dev = TRITON_DEVICE if impl.startswith("triton") else "cpu"
    inp = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in inp.items()}
    xs = torch.stack([inp["x"], inp["dt"], inp["z"]], dim=-1)  # x, dt, z interleaved: stride 3
    BC = torch.stack([inp["B"], inp["C"]], dim=1).transpose(1, 2)  # (batch, N, 2)
    A_t = inp["A"].t().contiguous().t()
    state = inp["state"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not xs[..., 0].is_contiguous() and not state.is_contiguous() and not A_t.is_contiguous()
    # On a GPU the op itself dispatches to Triton; on CPU the launcher runs under the interpreter.
    impl_fn = _op_state_update if impl == "cpu" or dev == "cuda" else STATE_IMPLS[impl]
    y = impl_fn(state, xs[..., 0], xs[..., 1], A_t, BC[..., 0], BC[..., 1], inp["D"], xs[..., 2],
                inp["dt_bias"], True)
    assert rel_err(y.cpu(), y_ref) < TOL[torch.float32]
    assert rel_err(state.cpu(), h_ref) < 10 * TOL[torch.float32]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU counterpart: the interpreter runs above)")
def test_ops_dispatch_to_triton_on_cuda():
    """The ops on CUDA tensors go through the Triton kernels and match the reference."""
    inp = make_state_update_inputs(2, 40, 16, 4, torch.bfloat16, True)
    y_ref, h_ref = selective_state_update_ref(inp["state"], *_args(inp))
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inp.items()}
    y = decode_op.selective_state_update(cuda["state"], *_args(cuda))
    assert y.is_cuda and rel_err(y, y_ref) < TOL[torch.bfloat16]
    assert rel_err(cuda["state"], h_ref) < 10 * TOL[torch.float32]
    x, conv_state, w = torch.randn(2, 40, 3), torch.randn(2, 40, 4), torch.randn(40, 4)
    y_ref, s_ref = causal_conv1d_update_ref(x, conv_state, w, None, "silu")
    s = conv_state.cuda()
    y = decode_op.causal_conv1d_update(x.cuda(), s, w.cuda(), None, "silu")
    assert rel_err(y, y_ref) < TOL[torch.float32] and torch.equal(s.cpu(), s_ref.float())


def test_state_update_steps_equal_reference_scan():
    """L single steps equal one scan over L (fp64 scan reference), final state included."""
    from ssm_compile.kernels.selective_scan.reference import selective_scan_ref

    batch, dim, N, L = 2, 16, 4, 6
    g = torch.Generator().manual_seed(1)
    u, delta, z = (torch.randn(batch, dim, L, generator=g) for _ in range(3))
    B, C = (torch.randn(batch, N, L, generator=g) for _ in range(2))
    A = -torch.rand(dim, N, generator=g) - 0.1
    D, bias = torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    h0 = torch.randn(batch, dim, N, generator=g)
    y_ref, h_ref = selective_scan_ref(u, delta, A, B, C, D, z, bias, True, initial_state=h0, return_last_state=True)
    state = h0.clone()
    ys = [decode_op.selective_state_update(state, u[..., t], delta[..., t], A, B[..., t], C[..., t], D,
                                           z[..., t], bias, True) for t in range(L)]
    assert rel_err(torch.stack(ys, -1), y_ref) < TOL[torch.float32]
    assert rel_err(state, h_ref) < TOL[torch.float32]


def test_state_update_steps_equal_scan_op():
    """Against ``ssm::selective_scan`` itself (another module): prefill then decode must agree."""
    from ssm_compile.kernels.selective_scan import op as scan_op

    scan_op.register()
    batch, dim, N, L, G = 2, 16, 4, 5, 2
    g = torch.Generator().manual_seed(2)
    u, delta, z = (torch.randn(batch, dim, L, generator=g) for _ in range(3))
    B, C = (torch.randn(batch, G, N, L, generator=g) for _ in range(2))
    A = -torch.rand(dim, N, generator=g) - 0.1
    D, bias = torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    h0 = torch.randn(batch, dim, N, generator=g)
    y_scan, h_scan = torch.ops.ssm.selective_scan(u, delta, A, B, C, D, z, bias, True, h0, True)
    state = h0.clone()
    ys = [decode_op.selective_state_update(state, u[..., t], delta[..., t], A, B[..., t], C[..., t], D,
                                           z[..., t], bias, True) for t in range(L)]
    assert rel_err(torch.stack(ys, -1), y_scan) < TOL[torch.float32]
    assert rel_err(state, h_scan) < TOL[torch.float32]


CONV_CASES = [
    # (batch, dim, W, S, T); T=0 means a 2-D (batch, dim) input
    (2, 24, 4, 4, 0),  # HF's layout: S = W
    (2, 24, 4, 3, 1),  # S = W - 1, the minimum
    (1, 70, 2, 1, 0),  # more than one channel block
    (2, 8, 8, 10, 3),  # several new inputs, S > W
    (2, 8, 3, 2, 5),  # T > S: the whole state is replaced by inputs
]


@pytest.mark.parametrize("impl", list(CONV_IMPLS))
@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("bias_act", [(True, "silu"), (False, None)], ids=["bias-silu", "nobias-none"])
@pytest.mark.parametrize("batch,dim,W,S,T", CONV_CASES,
                         ids=[f"B{b}-D{d}-W{w}-S{s}-T{t}" for b, d, w, s, t in CONV_CASES])
def test_causal_conv1d_update_matches_reference(impl, dtype, bias_act, batch, dim, W, S, T):
    has_bias, activation = bias_act
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch, dim, *([T] if T else []), generator=g).to(dtype)
    conv_state = torch.randn(batch, dim, S, generator=g).to(dtype)
    weight = torch.randn(dim, W, generator=g).to(dtype)
    bias = torch.randn(dim, generator=g).to(dtype) if has_bias else None
    y_ref, state_ref = causal_conv1d_update_ref(x, conv_state, weight, bias, activation)
    state = conv_state.clone()
    y = CONV_IMPLS[impl](x, state, weight, bias, activation)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_err(y, y_ref) < TOL[dtype]
    # Rolling only moves values (no arithmetic), so the new state is exact.
    assert torch.equal(state, state_ref.to(dtype))


@pytest.mark.parametrize("impl", list(CONV_IMPLS))
def test_causal_conv1d_update_steps_equal_full_conv(impl):
    """Feeding a sequence one token at a time equals one causal conv over the whole sequence."""
    batch, dim, W, L = 2, 12, 4, 7
    g = torch.Generator().manual_seed(4)
    x = torch.randn(batch, dim, L, generator=g)
    weight, bias = torch.randn(dim, W, generator=g), torch.randn(dim, generator=g)
    y_full = F.silu(F.conv1d(x, weight.unsqueeze(1), bias, padding=W - 1, groups=dim)[..., :L])
    state = torch.zeros(batch, dim, W)
    ys = [CONV_IMPLS[impl](x[..., t], state, weight, bias, "silu") for t in range(L)]
    assert rel_err(torch.stack(ys, -1), y_full) < TOL[torch.float32]
    assert torch.equal(state, x[..., L - W:])


def test_causal_conv1d_update_bf16_state_fp32_input():
    """The state keeps its own dtype: new fp32 inputs are rounded into a bf16 cache."""
    x = torch.randn(2, 8)
    state = torch.randn(2, 8, 4).bfloat16()
    weight = torch.randn(8, 4)
    y_ref, state_ref = causal_conv1d_update_ref(x, state, weight)
    y = decode_op.causal_conv1d_update(x, state, weight)
    assert y.dtype == torch.float32 and rel_err(y, y_ref) < TOL[torch.float32]
    assert torch.equal(state, state_ref.bfloat16())


def _state_update_kwargs():
    inp = make_state_update_inputs(2, 8, 4, 0, torch.float32, True)
    return {k: inp[k] for k in ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus")}


STATE_ERRORS = [
    ("state-bf16", lambda kw: kw.update(state=kw["state"].bfloat16()), TypeError, "state must be fp32"),
    ("state-2d", lambda kw: kw.update(state=kw["state"][0]), ValueError, "state must be a"),
    ("N-too-big", lambda kw: kw.update(state=torch.zeros(2, 8, 300), A=torch.zeros(8, 300),
                                       B=torch.zeros(2, 300), C=torch.zeros(2, 300)), ValueError, "1 <= N <= 256"),
    # The scan refuses N = 0, so the decode step must too (it used to return D * x).
    ("N-zero", lambda kw: kw.update(state=torch.zeros(2, 8, 0), A=torch.zeros(8, 0),
                                    B=torch.zeros(2, 0), C=torch.zeros(2, 0)), ValueError, "1 <= N <= 256"),
    ("x-shape", lambda kw: kw.update(x=kw["x"][:, :4]), ValueError, "x must have shape"),
    ("dt-int", lambda kw: kw.update(dt=kw["dt"].long()), TypeError, "dt must have dtype"),
    ("A-shape", lambda kw: kw.update(A=kw["A"].t()), ValueError, "A must have shape"),
    ("B-groups", lambda kw: kw.update(B=torch.zeros(2, 3, 4), C=torch.zeros(2, 3, 4)), ValueError, "divide dim"),
    ("C-shape", lambda kw: kw.update(C=kw["C"][:, :2]), ValueError, "C must have shape"),
    ("D-shape", lambda kw: kw.update(D=torch.zeros(7)), ValueError, "D must have shape"),
    ("z-shape", lambda kw: kw.update(z=kw["z"][:1]), ValueError, "z must have shape"),
    ("dt_bias-device", lambda kw: kw.update(dt_bias=kw["dt_bias"].to("meta")), ValueError, "dt_bias must be on"),
]


@pytest.mark.parametrize("mutate,exc,match", [e[1:] for e in STATE_ERRORS], ids=[e[0] for e in STATE_ERRORS])
def test_selective_state_update_bad_input(mutate, exc, match):
    kw = _state_update_kwargs()
    mutate(kw)
    before = kw["state"].clone()
    with pytest.raises(exc, match=match):
        decode_op.selective_state_update(**kw)
    assert torch.equal(kw["state"], before), "a rejected call must leave the state untouched"


def _conv_kwargs():
    return dict(x=torch.randn(2, 8), conv_state=torch.randn(2, 8, 4), weight=torch.randn(8, 4),
                bias=torch.randn(8), activation="silu")


CONV_ERRORS = [
    ("W-too-wide", lambda kw: kw.update(weight=torch.randn(8, 9), conv_state=torch.randn(2, 8, 9)), ValueError,
     "W <= 8"),
    ("W-1", lambda kw: kw.update(weight=torch.randn(8, 1)), ValueError, "2 <= W"),
    ("state-too-short", lambda kw: kw.update(conv_state=torch.randn(2, 8, 2)), ValueError, "S >= 3"),
    ("state-dim", lambda kw: kw.update(conv_state=torch.randn(2, 6, 4)), ValueError, "conv_state must have shape"),
    ("x-4d", lambda kw: kw.update(x=torch.randn(2, 8, 1, 1)), ValueError, "x must be"),
    ("x-T0", lambda kw: kw.update(x=torch.randn(2, 8, 0)), ValueError, "at least one time step"),
    ("x-batch", lambda kw: kw.update(x=torch.randn(3, 8)), ValueError, "x has batch 3, conv_state batch 2"),
    ("bias-shape", lambda kw: kw.update(bias=torch.randn(4)), ValueError, "bias must have shape"),
    ("activation", lambda kw: kw.update(activation="relu"), ValueError, "activation must be one of"),
    ("weight-int", lambda kw: kw.update(weight=torch.ones(8, 4, dtype=torch.int32)), TypeError, "weight must have"),
]


@pytest.mark.parametrize("mutate,exc,match", [e[1:] for e in CONV_ERRORS], ids=[e[0] for e in CONV_ERRORS])
def test_causal_conv1d_update_bad_input(mutate, exc, match):
    kw = _conv_kwargs()
    mutate(kw)
    with pytest.raises(exc, match=match):
        decode_op.causal_conv1d_update(**kw)


def test_opcheck_selective_state_update():
    for G, full in itertools.product((0, 2), (True, False)):
        inp = make_state_update_inputs(2, 8, 4, G, torch.float32, full)
        torch.library.opcheck(torch.ops.ssm.selective_state_update.default, (inp["state"], *_args(inp)))


def test_opcheck_causal_conv1d_update():
    for x_shape, act in (((2, 8), "silu"), ((2, 8, 3), None)):
        args = (torch.randn(x_shape), torch.randn(2, 8, 4), torch.randn(8, 4), torch.randn(8), act)
        torch.library.opcheck(torch.ops.ssm.causal_conv1d_update.default, args)


@pytest.mark.parametrize("src,dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                       (torch.float64, torch.float32), (torch.float64, torch.bfloat16)])
def test_round_through_is_the_cast_round_trip(src, dtype):
    """ssm::round_through is x.to(dtype).to(x.dtype), bit for bit, and so is its gradient."""
    x = (torch.randn(3, 5, dtype=src) * 3).requires_grad_()
    g = torch.randn(3, 5, dtype=src)
    y = torch.ops.ssm.round_through(x, dtype)
    want = x.to(dtype).to(src)
    assert y.dtype == src and torch.equal(y, want) and not torch.equal(y, x)
    (gx,) = torch.autograd.grad(y, x, g)
    (want_gx,) = torch.autograd.grad(want, x, g)
    assert torch.equal(gx, want_gx)
    torch.library.opcheck(torch.ops.ssm.round_through.default, (x.detach(), dtype))
    torch.library.opcheck(torch.ops.ssm.round_through.default, (x, dtype))


@pytest.mark.parametrize("x,dtype,match", [
    (torch.randn(3), torch.float32, "dtype must be a floating-point dtype narrower than x's torch.float32"),
    (torch.randn(3), torch.int8, "dtype must be a floating-point dtype narrower"),
    (torch.randn(3, dtype=torch.float16), torch.bfloat16, "narrower than x's torch.float16"),
    (torch.arange(3), torch.float16, "x must be a floating-point Tensor, got torch.int64"),
])
def test_round_through_refuses_bad_input(x, dtype, match):
    with pytest.raises(TypeError, match=match):
        torch.ops.ssm.round_through(x, dtype)


def test_decode_ops_refuse_backward():
    """Inference-only: a backward through a decode op raises instead of giving wrong gradients."""
    inp = make_state_update_inputs(2, 8, 4, 0, torch.float32, True)
    x = inp["x"].requires_grad_()
    y = decode_op.selective_state_update(inp["state"], x, *_args(inp)[1:])
    with pytest.raises(RuntimeError, match="no autograd formula"):
        y.sum().backward()
    kw = _conv_kwargs()
    kw["weight"].requires_grad_()
    with pytest.raises(RuntimeError, match="no autograd formula"):
        decode_op.causal_conv1d_update(**kw).sum().backward()


def test_decode_ops_mutation_survives_compile():
    """The schema's (a!) makes functionalization write the state back inside a compiled graph."""
    inp = make_state_update_inputs(2, 8, 4, 0, torch.float32, True)
    kw = _conv_kwargs()

    def step(state, conv_state, x):
        xc = torch.ops.ssm.causal_conv1d_update(x, conv_state, kw["weight"], kw["bias"], "silu")
        return torch.ops.ssm.selective_state_update(state, xc, *_args(inp)[1:])

    state_e, conv_e = inp["state"].clone(), kw["conv_state"].clone()
    state_c, conv_c = inp["state"].clone(), kw["conv_state"].clone()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for _ in range(3):
        y_e = step(state_e, conv_e, kw["x"])
        y_c = compiled(state_c, conv_c, kw["x"])
        assert torch.equal(y_e, y_c)
    assert torch.equal(state_e, state_c) and torch.equal(conv_e, conv_c)


def test_mutation_bumps_the_version_counter():
    """The in-place write is visible to autograd's version counter, as the schema's (a!) says."""
    kw = _state_update_kwargs()
    before = kw["state"]._version
    decode_op.selective_state_update(**kw)
    assert kw["state"]._version > before
    ckw = _conv_kwargs()
    before = ckw["conv_state"]._version
    decode_op.causal_conv1d_update(**ckw)
    assert ckw["conv_state"]._version > before


def test_validation_cache_still_rejects_a_new_bad_signature():
    """A signature that passed once is cached; a different, bad one must still be rejected."""
    kw = _state_update_kwargs()
    for _ in range(2):
        decode_op.selective_state_update(**kw)
    kw["x"] = kw["x"][:, :4]
    for _ in range(2):  # a rejected signature is never cached
        with pytest.raises(ValueError, match="x must have shape"):
            decode_op.selective_state_update(**kw)
    ckw = _conv_kwargs()
    decode_op.causal_conv1d_update(**ckw)
    with pytest.raises(ValueError, match="activation must be one of"):
        decode_op.causal_conv1d_update(**dict(ckw, activation="relu"))


def test_inference_mode_and_no_grad_match_eager():
    kw = _state_update_kwargs()
    state0 = kw["state"].clone()
    y_eager = decode_op.selective_state_update(**kw)
    state_eager = kw["state"].clone()
    for ctx in (torch.no_grad, torch.inference_mode):
        kw["state"] = state0.clone()
        with ctx():
            y = decode_op.selective_state_update(**kw)
        assert torch.equal(y, y_eager) and torch.equal(kw["state"], state_eager)


def _decode_step(state, conv_state, x, dt, A, B, C, D, z, dt_bias, weight, conv_bias):
    xc = torch.ops.ssm.causal_conv1d_update(x, conv_state, weight, conv_bias, "silu")
    return torch.ops.ssm.selective_state_update(state, xc, dt, A, B, C, D, z, dt_bias, True)


def _decode_step_inputs(device, batch=2, dim=64, N=16, W=4):
    inp = make_state_update_inputs(batch, dim, N, 0, torch.bfloat16, True)
    kw = dict(x=torch.randn(batch, dim).bfloat16(), conv_state=torch.randn(batch, dim, W - 1).bfloat16(),
              weight=torch.randn(dim, W), conv_bias=torch.randn(dim))
    args = (inp["state"], kw["conv_state"], kw["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"],
            inp["dt_bias"], kw["weight"], kw["conv_bias"])
    return [a.to(device) for a in args]


def _traced_decode_step(device):
    """The decode step as AOTAutograd sees it: traced under ``FunctionalTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    # Fake tensors made on the device directly: a fake tensor's .to("cuda") needs a CUDA build.
    with FakeTensorMode():
        args = [torch.empty(a.shape, dtype=a.dtype, device=device) for a in _decode_step_inputs("cpu")]
    gm = make_fx(dispatch_functionalize(_decode_step), tracing_mode="fake")(*args)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    # A mutating op that stays is wrapped: auto_functionalized(op, ...).
    return {str(n.target) for n in calls} | {str(n.args[0]) for n in calls if "auto_functionalized" in str(n.target)}


_TRACE_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_decode_ops as t
t.decode_op.register()
print(json.dumps({d: sorted(t._traced_decode_step(d)) for d in ("cuda", "cpu")}))
"""


def test_functionalization_inlines_the_cuda_launches():
    """On CUDA each decode op becomes its kernel's wrap_triton launch, which inductor compiles
    and launches itself; on CPU and under the interpreter the op becomes its functional twin and
    a copy back (symbolic sizes: the CUDA test below; why: tests/test_decode_views.py). Traced
    with fake CUDA tensors, so it runs without a GPU; in a subprocess without TRITON_INTERPRET,
    which this process's kernels were imported under on CPU."""
    traced = traced_without_interpreter(_TRACE_SCRIPT)
    ops = {"ssm.causal_conv1d_update.default", "ssm.selective_state_update.default"}
    twins = {"ssm.causal_conv1d_update_functional.default", "ssm.selective_state_update_functional.default"}
    assert "triton_kernel_wrapper_functional" in traced["cuda"]
    assert not (ops | twins) & set(traced["cuda"]), traced["cuda"]
    assert twins <= set(traced["cpu"]) and not ops & set(traced["cpu"]), traced["cpu"]
    assert "triton_kernel_wrapper_functional" not in traced["cpu"]
    if inline._interpreted():
        # Nothing is inlined under the interpreter, CUDA tensors or not. (Not traced here: the
        # copy back into a fake CUDA tensor needs a CUDA build.)
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            args = [torch.empty(2, 3, device="cuda")]
        assert not inline.inlines([torch.Tensor], args, {})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU counterpart: the tracing test above)")
def test_inductor_launches_the_decode_kernels_itself():
    """Under inductor on CUDA the step's kernels are launched from inductor's code, not through
    the ops, and five steps give eager's outputs and states."""
    from torch._inductor.utils import run_and_get_code

    eager_args = _decode_step_inputs("cuda")
    compiled_args = [a.clone() for a in eager_args]
    compiled = torch.compile(_decode_step, fullgraph=True)
    for step in range(5):
        y_e = _decode_step(*eager_args)
        if step == 0:
            y_c, codes = run_and_get_code(compiled, *compiled_args)
            code = "\n".join(codes)
            assert "_selective_state_update_kernel" in code and "_causal_conv1d_update_kernel" in code
            assert "torch.ops.ssm." not in code
        else:
            y_c = compiled(*compiled_args)
        assert rel_err(y_c, y_e) < 1e-2  # bf16 outputs: one rounding apart at most
        assert rel_err(compiled_args[0], eager_args[0]) < 1e-5  # the fp32 state
        assert torch.equal(compiled_args[1], eager_args[1])  # the conv window is a copy of inputs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU counterpart: the tracing test above)")
def test_decode_ops_stay_whole_with_dynamic_sizes():
    """With symbolic sizes the launch sizes cannot be chosen at trace time: the ops stay, as their
    functional twins, and their results are eager's."""
    from torch._inductor.utils import run_and_get_code

    eager_args = _decode_step_inputs("cuda")
    compiled_args = [a.clone() for a in eager_args]
    y_e = _decode_step(*eager_args)
    y_c, codes = run_and_get_code(torch.compile(_decode_step, fullgraph=True, dynamic=True), *compiled_args)
    assert "torch.ops.ssm.selective_state_update_functional" in "\n".join(codes)
    assert torch.equal(y_c, y_e) and torch.equal(compiled_args[0], eager_args[0])


def test_decode_op_errors_name_the_op():
    """Errors from a direct torch.ops.ssm call say which op refused, as well as which argument."""
    kw = _conv_kwargs()
    kw["x"] = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"^ssm::causal_conv1d_update: x has batch 3"):
        decode_op.causal_conv1d_update(**kw)
    with pytest.raises(ValueError, match=r"^ssm::selective_state_update: state must be a \(batch, dim, N\)"):
        decode_op.selective_state_update(torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8), torch.randn(8, 4),
                                         torch.randn(2, 4), torch.randn(2, 4))



@pytest.mark.parametrize("wrapper", ["selective_state_update", "causal_conv1d_update", "selective_scan_fn",
                                     "causal_conv1d_fn"])
def test_public_wrapper_compiles_fullgraph_before_any_registration(wrapper):
    """A fresh process whose first use of a wrapper is under torch.compile(fullgraph=True): the
    decode wrappers traced into register() (dynamo's lru_cache warning, then the Library's
    constructor, which dynamo refuses: fullgraph failed)."""
    script = textwrap.dedent(f"""
        import warnings
        import torch
        import ssm_compile
        b, d, n, W, L = 2, 4, 3, 4, 5
        calls = {{
            "selective_state_update": lambda: (ssm_compile.selective_state_update, (
                torch.randn(b, d, n), torch.randn(b, d), torch.randn(b, d), -torch.rand(d, n), torch.randn(b, n),
                torch.randn(b, n))),
            "causal_conv1d_update": lambda: (ssm_compile.causal_conv1d_update, (
                torch.randn(b, d), torch.randn(b, d, W), torch.randn(d, W))),
            "selective_scan_fn": lambda: (ssm_compile.selective_scan_fn, (
                torch.randn(b, d, L), torch.rand(b, d, L), -torch.rand(d, n), torch.randn(b, n, L),
                torch.randn(b, n, L))),
            "causal_conv1d_fn": lambda: (ssm_compile.causal_conv1d_fn, (torch.randn(b, d, L), torch.randn(d, W))),
        }}
        fn, args = calls["{wrapper}"]()
        eager_args = [a.clone() for a in args]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = torch.compile(fn, backend="eager", fullgraph=True)(*args)
        assert not [w for w in seen if "lru_cache" in str(w.message)], [str(w.message) for w in seen]
        torch.testing.assert_close(out, fn(*eager_args), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(args, eager_args, rtol=1e-6, atol=1e-6)
        print("OK")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-4000:]
