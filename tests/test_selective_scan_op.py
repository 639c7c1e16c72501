"""ssm::selective_scan: the chunked PyTorch CPU path against the fp64 reference, the op's
validation, its torch.library registration (opcheck), autograd and torch.compile; at the end,
the same op through its CUDA (Triton) path when a GPU is present."""
import dataclasses
from typing import Optional

import pytest
import torch
from utils import TOL, in_layout_of, rel_err

from ssm_compile.kernels.selective_scan import cpu, op
from ssm_compile.kernels.selective_scan.reference import selective_scan_ref


@pytest.fixture(scope="module", autouse=True)
def _register_ops():
    op.register()


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 2
    dim: int = 4
    L: int = 37
    N: int = 8
    groups: Optional[int] = None  # None: 3-D B/C (batch, N, L); else (batch, G, N, L)
    dtype: torch.dtype = torch.float32
    D: bool = True
    z: bool = True
    delta_bias: bool = True
    softplus: bool = True
    initial_state: bool = True

    @property
    def id(self) -> str:
        name = f"B{self.batch}-D{self.dim}-L{self.L}-N{self.N}"
        if self.groups is not None:
            name += f"-G{self.groups}"
        for flag in ("D", "z", "delta_bias", "softplus", "initial_state"):
            if not getattr(self, flag):
                name += f"-no_{flag}"
        short = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
        return f"{name}-{short[self.dtype]}"


def make_inputs(case: Case, seed: int = 0) -> dict:
    """Random, never-zero inputs for ``case`` as the op's keyword arguments."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=case.dtype):
        return torch.randn(*shape, generator=gen).to(dtype)

    batch, dim, L, N = case.batch, case.dim, case.L, case.N
    bc_shape = (batch, N, L) if case.groups is None else (batch, case.groups, N, L)
    if case.softplus:
        delta = (randn(batch, dim, L, dtype=torch.float32) * 0.5 - 1.0).to(case.dtype)
    else:
        delta = (torch.rand(batch, dim, L, generator=gen) * 0.5 + 0.05).to(case.dtype)
    # A in [-1.1, -0.1): decays slow enough that long sequences keep a non-trivial state.
    A = -(torch.rand(dim, N, generator=gen) + 0.1)
    # The fp64 verification mode keeps everything in fp64; otherwise weights are fp32.
    wdtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    return dict(
        u=randn(batch, dim, L),
        delta=delta,
        A=A.to(wdtype),
        B=randn(*bc_shape),
        C=randn(*bc_shape),
        D=randn(dim, dtype=wdtype) if case.D else None,
        z=randn(batch, dim, L) if case.z else None,
        delta_bias=randn(dim, dtype=wdtype) * 0.1 if case.delta_bias else None,
        delta_softplus=case.softplus,
        initial_state=randn(batch, dim, N, dtype=wdtype) if case.initial_state else None,
    )


# The op's tensor and flag arguments in schema order (without return_last_state).
SCAN_ARGS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "initial_state")
# Its differentiable inputs; ScanGrads names each gradient "d" + the input's name.
GRAD_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


def positional(inputs: dict) -> list:
    return [inputs[k] for k in SCAN_ARGS]


def run_op(inputs: dict, return_last_state: bool = True):
    return torch.ops.ssm.selective_scan(**inputs, return_last_state=return_last_state)


def run_ref(inputs: dict):
    return selective_scan_ref(**inputs, return_last_state=True)


FWD_CASES = [
    Case(L=1),
    Case(L=37),
    Case(L=64),
    Case(L=100),  # two chunks, the second one partial
    Case(L=150, batch=1),  # three chunks
    Case(N=1),
    Case(N=4, groups=2),
    Case(N=16, groups=4),
    Case(N=64, batch=1, dim=2),
    Case(N=128, batch=1, dim=2, L=70),
    Case(N=256, batch=1, dim=2, L=70, groups=2),
    Case(D=False, z=False, delta_bias=False, softplus=False, initial_state=False),
    Case(z=False, softplus=False),
    Case(D=False, delta_bias=False, L=80),
    Case(initial_state=False, groups=1),
    Case(dtype=torch.bfloat16, L=100),
    Case(dtype=torch.float16, L=100),
    Case(dtype=torch.bfloat16, groups=2, initial_state=False),
    Case(dtype=torch.float16, N=16, z=False),
]


@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: c.id)
def test_forward_matches_reference(case):
    inputs = make_inputs(case)
    y, last_state = run_op(inputs)
    y_ref, last_ref = run_ref(inputs)
    assert y.dtype == case.dtype and y.shape == y_ref.shape and in_layout_of(y, inputs["u"])
    assert last_state.dtype == torch.float32 and last_state.shape == (case.batch, case.dim, case.N)
    assert rel_err(y, y_ref) < TOL[case.dtype]
    # The state is accumulated in fp32 from exactly the inputs the reference sees.
    assert rel_err(last_state, last_ref) < TOL[torch.float32]


@pytest.mark.parametrize("chunk_len", [1, 3, 8, 37, 64])
@pytest.mark.parametrize("grouped", [False, True], ids=["G1", "G2"])
def test_cpu_chunking_is_exact_in_fp64(chunk_len, grouped):
    """Every chunk length gives the reference's result to rounding, forward and backward."""
    case = Case(L=37, N=5, groups=2 if grouped else None, dtype=torch.float64)
    inputs = make_inputs(case)
    # The launcher interface takes B/C 4-D; a 3-D pair is G = 1.
    four_d = inputs if grouped else dict(inputs, B=inputs["B"].unsqueeze(1), C=inputs["C"].unsqueeze(1))
    args = positional(four_d)
    y, last_state = cpu.selective_scan_fwd(*args, True, chunk_len=chunk_len)

    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    y_ref, last_ref = selective_scan_ref(**dict(inputs, **leaves), return_last_state=True)
    assert rel_err(y, y_ref) < TOL[torch.float64]
    assert rel_err(last_state, last_ref) < TOL[torch.float64]

    gen = torch.Generator().manual_seed(1)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    dlast = torch.randn(last_state.shape, generator=gen, dtype=torch.float64)
    grads = cpu.selective_scan_bwd(dy, dlast, *args, chunk_len=chunk_len)
    ref = dict(zip(leaves, torch.autograd.grad([y_ref, last_ref], list(leaves.values()), [dy, dlast])))
    for name in GRAD_NAMES:
        grad = getattr(grads, "d" + name)
        expected = ref[name].view(four_d[name].shape)
        assert grad.shape == expected.shape, name
        assert rel_err(grad, expected) < TOL[torch.float64], name


def test_mixed_dtypes():
    """mamba_ssm lets B/C stay fp32 while u is bf16; D and delta_bias may be bf16 params."""
    inputs = make_inputs(Case(L=70, dtype=torch.bfloat16))
    inputs.update(B=inputs["B"].float(), C=inputs["C"].float(), D=inputs["D"].bfloat16(),
                  delta_bias=inputs["delta_bias"].bfloat16())
    names = [n for n in GRAD_NAMES if inputs[n] is not None]
    leaves = {n: inputs[n].clone().requires_grad_() for n in names}
    y, last_state = run_op(dict(inputs, **leaves))
    ref_leaves = {n: inputs[n].double().requires_grad_() for n in names}
    y_ref, last_ref = run_ref(dict(inputs, **ref_leaves))
    assert y.dtype == torch.bfloat16 and last_state.dtype == torch.float32
    assert rel_err(y, y_ref) < TOL[torch.bfloat16]
    assert rel_err(last_state, last_ref) < TOL[torch.float32]
    (y.float().sum() + last_state.sum()).backward()
    (y_ref.sum() + last_ref.sum()).backward()
    for n in names:
        assert leaves[n].grad.dtype == inputs[n].dtype, n
        assert rel_err(leaves[n].grad, ref_leaves[n].grad) < 2 * TOL[torch.bfloat16], n


def test_fp64_verification_mode_returns_fp64_state():
    inputs = make_inputs(Case(dtype=torch.float64))
    y, last_state = run_op(inputs)
    y_ref, last_ref = run_ref(inputs)
    assert y.dtype == last_state.dtype == torch.float64
    assert rel_err(y, y_ref) < TOL[torch.float64]
    assert rel_err(last_state, last_ref) < TOL[torch.float64]


def test_without_last_state_returns_empty_fp32():
    inputs = make_inputs(Case())
    y, last_state = run_op(inputs, return_last_state=False)
    assert last_state.shape == (0,) and last_state.dtype == torch.float32
    assert rel_err(y, run_ref(inputs)[0]) < TOL[torch.float32]


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """Same values, non-contiguous: stored with the last two dims swapped."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize(
    "case", [Case(L=70), Case(L=70, groups=2, dtype=torch.bfloat16)], ids=lambda c: c.id
)
def test_noncontiguous_inputs(case):
    inputs = make_inputs(case)
    strided = dict(inputs)
    for name in ("delta", "A", "B", "C", "z", "initial_state"):
        strided[name] = _transposed(inputs[name])
    # A slice of a wider buffer: non-unit stride along the time axis.
    strided["u"] = torch.stack([inputs["u"], inputs["u"]], dim=-1)[..., 0]
    assert not any(strided[k].is_contiguous() for k in ("u", "delta", "A", "B", "C", "z"))
    y, last_state = run_op(strided)
    y_ref, last_ref = run_op(inputs)
    assert in_layout_of(y, strided["u"]) and y.is_contiguous() and last_state.is_contiguous()
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(last_state, last_ref, rtol=0, atol=0)


def test_selective_scan_fn_calling_convention():
    inputs = make_inputs(Case())
    args = [inputs.pop(k) for k in ("u", "delta", "A", "B", "C")]
    y = op.selective_scan_fn(*args, **inputs)
    y2, last_state = op.selective_scan_fn(*args, **inputs, return_last_state=True)
    assert isinstance(y, torch.Tensor) and torch.equal(y, y2)
    assert last_state.shape == (2, 4, 8)


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize(
    "case",
    [
        Case(batch=1, dim=2, L=70, N=3, dtype=torch.float64),  # two chunks, every optional on
        Case(batch=2, dim=4, L=9, N=2, groups=2, dtype=torch.float64),
        Case(batch=1, dim=2, L=11, N=3, D=False, z=False, delta_bias=False, softplus=False,
             dtype=torch.float64),
    ],
    ids=lambda c: c.id,
)
def test_gradcheck_fp64(case):
    """gradcheck every differentiable input, including initial_state and a downstream use of
    last_state (the function returns it, so its gradient flows back through the op)."""
    inputs = make_inputs(case)
    names = [n for n in GRAD_NAMES if inputs[n] is not None]
    leaves = [inputs[n].clone().requires_grad_() for n in names]

    def fn(*tensors):
        y, last_state = run_op(dict(inputs, **dict(zip(names, tensors))))
        return y, last_state.sin()

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        Case(L=100, N=16),
        Case(L=45, N=8, groups=2, initial_state=False),
        Case(L=30, N=4, D=False, z=False),
        Case(L=80, N=8, dtype=torch.bfloat16),
        Case(L=80, N=8, dtype=torch.float16, groups=4),
    ],
    ids=lambda c: c.id,
)
@pytest.mark.parametrize("use_last_state", [False, True], ids=["y", "y+last_state"])
def test_gradients_match_reference(case, use_last_state):
    inputs = make_inputs(case)
    names = [n for n in GRAD_NAMES if inputs[n] is not None]
    gen = torch.Generator().manual_seed(2)
    dy = torch.randn(case.batch, case.dim, case.L, generator=gen)
    dlast = torch.randn(case.batch, case.dim, case.N, generator=gen)

    def grads_of(fn, cast):
        leaves = {n: cast(inputs[n]).requires_grad_() for n in names}
        y, last_state = fn(dict(inputs, **leaves))
        loss = (y * cast(dy)).sum()
        if use_last_state:
            loss = loss + (last_state * cast(dlast)).sum()
        loss.backward()
        return {n: leaf.grad for n, leaf in leaves.items()}

    got = grads_of(run_op, lambda t: t.detach().clone().to(t.dtype))
    ref = grads_of(run_ref, lambda t: t.detach().double())
    for n in names:
        assert got[n].dtype == inputs[n].dtype and got[n].shape == inputs[n].shape, n
        # dy is rounded to the input dtype before the op sees it, hence 2x the forward tolerance.
        assert rel_err(got[n], ref[n]) < 2 * TOL[case.dtype], n


def test_grad_only_through_last_state():
    inputs = make_inputs(Case(L=20))
    u = inputs["u"].clone().requires_grad_()
    _, last_state = run_op(dict(inputs, u=u))
    last_state.sum().backward()
    u_ref = inputs["u"].double().requires_grad_()
    run_ref(dict(inputs, u=u_ref))[1].sum().backward()
    assert rel_err(u.grad, u_ref.grad) < TOL[torch.float32]


def test_memory_stays_linear_in_L():
    """No single allocation, forward or backward, is anywhere near a (batch, dim, L, N) tensor."""
    case = Case(batch=1, dim=8, L=1024, N=16)
    inputs = make_inputs(case)
    u = inputs["u"].requires_grad_()
    with torch.profiler.profile(profile_memory=True) as prof:
        y, last_state = run_op(inputs)
        (y.sum() + last_state.sum()).backward()
    assert u.grad is not None
    full_bytes = case.batch * case.dim * case.L * case.N * 4
    allocations = {e.name: e.cpu_memory_usage for e in prof.events() if e.name.startswith("aten::")}
    # The largest legitimate ones are the outputs (dB, dC: batch * N * L) and chunk buffers.
    assert 0 < max(allocations.values()) <= full_bytes // 8, allocations


# ---------------------------------------------------------------- registration

OPCHECK_CASES = [
    Case(batch=2, dim=4, L=9, N=3),
    Case(batch=1, dim=4, L=5, N=2, groups=2, D=False, z=False, delta_bias=False, softplus=False,
         initial_state=False),
]


@pytest.mark.parametrize("return_last_state", [False, True], ids=["y", "y+last_state"])
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: c.id)
def test_opcheck_forward(case, return_last_state):
    inputs = make_inputs(case)
    for name in GRAD_NAMES:
        if inputs[name] is not None:
            inputs[name].requires_grad_()
    torch.library.opcheck(
        torch.ops.ssm.selective_scan.default, (), dict(inputs, return_last_state=return_last_state),
        test_utils=(
            "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic",
        ),
    )


@pytest.mark.parametrize("transposed", [False, True], ids=["dense", "transposed"])
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: c.id)
def test_opcheck_backward(case, transposed):
    """Includes the gradient layouts: opcheck compares the fake's strides with the real ones."""
    inputs = make_inputs(case)
    if transposed:
        # A and the initial state too: their gradients are dense whatever their inputs' strides.
        for name in ("u", "delta", "A", "B", "C", "z", "initial_state"):
            if inputs[name] is not None:
                inputs[name] = _transposed(inputs[name])
    gen = torch.Generator().manual_seed(3)
    dy = torch.randn(case.batch, case.dim, case.L, generator=gen)
    dlast = torch.randn(case.batch, case.dim, case.N, generator=gen) if case.initial_state else None
    torch.library.opcheck(torch.ops.ssm.selective_scan_backward.default, (dy, dlast, *positional(inputs)))


def test_register_is_idempotent():
    assert op.register() is op.register()


def test_meta_tensors_use_the_fake_impl():
    inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v
              for k, v in make_inputs(Case()).items()}
    y, last_state = run_op(inputs)
    assert y.device.type == "meta" and y.shape == (2, 4, 37) and last_state.shape == (2, 4, 8)


# ---------------------------------------------------------------- bad input
# Each case edits valid inputs (batch 2, dim 4, L 37, N 8, G 2) and names the error it expects.


def _shorter(name, dim=-1):
    return lambda i: {name: i[name].narrow(dim, 0, i[name].shape[dim] - 1)}


def _cast(name, dtype):
    return lambda i: {name: i[name].to(dtype)}


def _to_meta(name):
    return lambda i: {name: i[name].to("meta")}


def _no_time_steps(i):
    return {k: i[k][..., :0] for k in ("u", "delta", "z", "B", "C")}


def _n257(i):
    return {"A": -torch.rand(4, 257), "B": torch.randn(2, 2, 257, 37),
            "C": torch.randn(2, 2, 257, 37), "initial_state": None}


def _three_groups(i):
    return {"B": torch.randn(2, 3, 8, 37), "C": torch.randn(2, 3, 8, 37)}


def _bad_case(case_id, edit, error, message):
    return pytest.param(edit, error, message, id=case_id)


BAD_INPUTS = [
    _bad_case("u-2d", lambda i: {"u": i["u"][0]}, ValueError, r"\bu must be 3-D"),
    _bad_case("u-L0", _no_time_steps, ValueError, r"\bu must have L >= 1"),
    _bad_case("delta-L", _shorter("delta"), ValueError,
              r"delta must have shape \(batch, dim, L\) = \(2, 4, 37\), got \(2, 4, 36\)"),
    _bad_case("delta-batch", _shorter("delta", 0), ValueError, r"delta must have shape"),
    _bad_case("z-dim", _shorter("z", 1), ValueError, r"\bz must have shape"),
    _bad_case("A-dim", _shorter("A", 0), ValueError, r"\bA must have shape \(dim, N\) with dim = 4"),
    _bad_case("A-1d", lambda i: {"A": i["A"][0]}, ValueError, r"\bA must have shape"),
    _bad_case("N-257", _n257, ValueError, r"N = A.shape\[1\] must be in \[1, 256\], got 257"),
    _bad_case("B-N", _shorter("B", 2), ValueError,
              r"\bB must have shape \(batch, G, N, L\) = \(2, 2, 8, 37\)"),
    _bad_case("B-1d", lambda i: {"B": i["B"][0, 0, 0]}, ValueError,
              r"\bB must be \(batch, N, L\), grouped \(batch, G, N, L\) or time-invariant \(dim, N\)"),
    # A 2-D B is time-invariant, (dim, N): these (N, L) and (dim, N) ones are not, or not with a
    # C grouped in two.
    _bad_case("B-2d-shape", lambda i: {"B": i["B"][0, 0]}, ValueError,
              r"time-invariant B must have shape \(dim, N\) = \(4, 8\), got \(8, 37\)"),
    _bad_case("B-2d-C-G2", lambda i: {"B": i["A"].clone()}, ValueError,
              r"with a time-invariant B \(dim, N\), a grouped C must have G = 1 or G = dim"),
    _bad_case("C-2d-B-L", lambda i: {"C": i["A"].clone(), "B": i["B"][:, :1, :, :-1]}, ValueError,
              r"grouped B must have G = 1 or G = dim .* got \(2, 1, 8, 36\)"),
    _bad_case("B-3d-N", lambda i: {"B": i["B"][:, 0, :-1], "C": i["C"][:, 0, :-1]}, ValueError,
              r"\bB must have shape \(batch, N, L\)"),
    _bad_case("G3-dim4", _three_groups, ValueError, r"G = 3 must divide dim = 4"),
    _bad_case("C-3d-B-4d", lambda i: {"C": i["C"][:, 0]}, ValueError, r"\bC must have the same layout as B"),
    _bad_case("C-L", _shorter("C"), ValueError, r"\bC must have shape"),
    _bad_case("D-dim", _shorter("D", 0), ValueError, r"\bD must have shape \(dim,\)"),
    _bad_case("delta_bias-2d", lambda i: {"delta_bias": i["delta_bias"][None]}, ValueError,
              r"delta_bias must have shape"),
    _bad_case("initial_state-N", _shorter("initial_state"), ValueError,
              r"initial_state must have shape \(batch, dim, N\) = \(2, 4, 8\)"),
    _bad_case("initial_state-bf16", _cast("initial_state", torch.bfloat16), TypeError,
              r"initial_state must have a dtype"),
    _bad_case("u-int64", _cast("u", torch.int64), TypeError, r"\bu must have a dtype .* got torch.int64"),
    _bad_case("delta-int32", _cast("delta", torch.int32), TypeError, r"delta must have a dtype"),
    _bad_case("B-complex64", _cast("B", torch.complex64), TypeError, r"\bB must have a dtype"),
    _bad_case("z-bool", _cast("z", torch.bool), TypeError, r"\bz must have a dtype"),
    _bad_case("A-int32", _cast("A", torch.int32), TypeError, r"\bA must have a dtype"),
    _bad_case("A-bf16", _cast("A", torch.bfloat16), TypeError, r"\bA must have a dtype in \['torch.float32'"),
    _bad_case("delta-meta", _to_meta("delta"), RuntimeError, r"delta is on meta while u is on cpu"),
    _bad_case("C-meta", _to_meta("C"), RuntimeError, r"\bC is on meta while u is on cpu"),
    _bad_case("u-meta", _to_meta("u"), RuntimeError, r"delta is on cpu while u is on meta"),
    _bad_case("initial_state-meta", _to_meta("initial_state"), RuntimeError, r"initial_state is on meta"),
    # None for a required tensor reached our checks as an AttributeError naming no argument.
    _bad_case("u-None", lambda i: {"u": None}, TypeError, r"\bu must be a Tensor, got NoneType"),
    _bad_case("C-None", lambda i: {"C": None}, TypeError, r"\bC must be a Tensor, got NoneType"),
    # Caught by the dispatcher's schema check before any of our code runs.
    _bad_case("D-list", lambda i: {"D": [1.0] * 4}, RuntimeError, r"for argument 'D'"),
]


def _edited(edit) -> dict:
    inputs = make_inputs(Case(groups=2))
    return dict(inputs, **edit(inputs))


@pytest.mark.parametrize("edit, error, message", BAD_INPUTS)
def test_bad_input_is_rejected_by_name(edit, error, message):
    with pytest.raises(error, match=message):
        run_op(_edited(edit))


@pytest.mark.parametrize("edit, error, message", BAD_INPUTS[:4])
def test_bad_input_is_rejected_by_the_backward_op(edit, error, message):
    with pytest.raises(error, match=message):
        torch.ops.ssm.selective_scan_backward(torch.randn(2, 4, 37), None, *positional(_edited(edit)))


@pytest.mark.parametrize(
    "dy, dlast_state, message",
    [
        pytest.param(torch.randn(2, 4, 36), None, r"dy must have shape \(batch, dim, L\) = \(2, 4, 37\)",
                     id="dy-L"),
        pytest.param(torch.randn(2, 4, 37), torch.randn(2, 4, 7), r"dlast_state must have shape \(batch, dim, N\)",
                     id="dlast_state-N"),
        pytest.param(torch.randn(2, 4, 37).to("meta"), None, r"dy is on meta while u is on cpu", id="dy-meta"),
        pytest.param(torch.randn(2, 4, 37).long(), None, r"dy has unsupported dtype torch.int64", id="dy-int64"),
    ],
)
def test_bad_incoming_gradient_is_rejected_by_name(dy, dlast_state, message):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        torch.ops.ssm.selective_scan_backward(dy, dlast_state, *positional(make_inputs(Case())))


def test_unsupported_device_type_is_named():
    inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v
              for k, v in make_inputs(Case()).items()}
    # All-meta inputs dispatch to the fake impl; the real impl is what refuses the device.
    with pytest.raises(RuntimeError, match=r"device type 'meta' are not supported \(u is on meta\)"):
        op._selective_scan_impl(**inputs)


def test_bad_input_fails_at_compile_time():
    inputs = _edited(_shorter("delta"))

    @torch.compile(backend="eager", fullgraph=True)
    def fn(inputs):
        return run_op(inputs)

    torch._dynamo.reset()
    # Raised by the fake impl while dynamo traces, not later by the CPU kernel.
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match=r"delta must have shape"):
        fn(inputs)


# ---------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compile_fullgraph(backend):
    """The op and the public wrapper trace without graph breaks, forward and backward."""
    case = Case(L=70, groups=2)
    inputs = make_inputs(case)
    leaves = {n: inputs[n].clone().requires_grad_() for n in ("u", "delta", "B", "D")}

    def fn(u, delta, B, D):
        y, last_state = op.selective_scan_fn(
            u.sin(), delta, inputs["A"], B, inputs["C"], D, inputs["z"], inputs["delta_bias"],
            delta_softplus=True, return_last_state=True, initial_state=inputs["initial_state"],
        )
        return (y * 2).sum() + last_state.square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    loss = compiled(**leaves)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    loss_eager = fn(**leaves)
    grads_eager = torch.autograd.grad(loss_eager, list(leaves.values()))
    torch.testing.assert_close(loss, loss_eager, rtol=1e-5, atol=1e-5)
    for name, g, g_eager in zip(leaves, grads, grads_eager):
        assert rel_err(g, g_eager) < TOL[torch.float32], name


# ---------------------------------------------------------------- CUDA (Triton launchers)
# The same checks through the op's CUDA path; each has a CPU counterpart above.

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA_CASES = [
    Case(batch=2, dim=64, L=300, N=16),
    Case(batch=2, dim=64, L=300, N=16, groups=2, dtype=torch.bfloat16),
    Case(batch=1, dim=32, L=129, N=64, dtype=torch.float16, initial_state=False),
    Case(batch=2, dim=16, L=37, N=8, D=False, z=False, delta_bias=False, softplus=False),
]


def _to_cuda(inputs: dict, transposed: bool = False) -> dict:
    out = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            value = value.cuda()
            if transposed and name in ("u", "delta", "B", "C", "z"):
                value = _transposed(value)
        out[name] = value
    return out


@requires_cuda
@pytest.mark.parametrize("transposed", [False, True], ids=["dense", "transposed"])
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: c.id)
def test_cuda_matches_reference(case, transposed):
    inputs = make_inputs(case)
    names = [n for n in GRAD_NAMES if inputs[n] is not None]
    on_cuda = _to_cuda(inputs, transposed)
    leaves = {n: t.requires_grad_() for n, t in on_cuda.items() if n in names}
    y, last_state = run_op(dict(on_cuda, **leaves))
    ref_leaves = {n: inputs[n].detach().double().requires_grad_() for n in names}
    y_ref, last_ref = run_ref(dict(inputs, **ref_leaves))
    assert y.dtype == case.dtype and in_layout_of(y, on_cuda["u"]) and last_state.dtype == torch.float32
    assert rel_err(y.cpu(), y_ref) < TOL[case.dtype]
    assert rel_err(last_state.cpu(), last_ref) < TOL[torch.float32]

    gen = torch.Generator().manual_seed(4)
    dy = torch.randn(y.shape, generator=gen)
    dlast = torch.randn(last_state.shape, generator=gen)
    ((y * dy.cuda().to(y.dtype)).sum() + (last_state * dlast.cuda()).sum()).backward()
    ((y_ref * dy.to(case.dtype).double()).sum() + (last_ref * dlast.double()).sum()).backward()
    for n in names:
        got = leaves[n].grad
        assert got.dtype == leaves[n].dtype and got.shape == leaves[n].shape, n
        assert rel_err(got.cpu(), ref_leaves[n].grad) < 2 * TOL[case.dtype], n


@requires_cuda
@pytest.mark.parametrize("transposed", [False, True], ids=["dense", "transposed"])
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: c.id)
def test_cuda_opcheck(case, transposed):
    """opcheck on CUDA compares the Triton launchers' output strides with the fake impls'."""
    inputs = _to_cuda(make_inputs(case), transposed)
    for name in GRAD_NAMES:
        if inputs[name] is not None:
            inputs[name].requires_grad_()
    torch.library.opcheck(torch.ops.ssm.selective_scan.default, (), dict(inputs, return_last_state=True))
    detached = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    dy = torch.randn(case.batch, case.dim, case.L, device="cuda")
    dlast = torch.randn(case.batch, case.dim, case.N, device="cuda")
    torch.library.opcheck(torch.ops.ssm.selective_scan_backward.default, (dy, dlast, *positional(detached)))


@requires_cuda
def test_cuda_rejects_fp64():
    inputs = _to_cuda(make_inputs(Case(dtype=torch.float64)))
    with pytest.raises(TypeError, match=r"\bu must have a dtype .*fp64 is supported on CPU only"):
        run_op(inputs)


@requires_cuda
def test_cuda_compile_fullgraph_inductor():
    inputs = _to_cuda(make_inputs(Case(dim=64, L=200, N=16, groups=2)))
    u = inputs["u"].requires_grad_()

    def fn(u):
        y, last_state = op.selective_scan_fn(
            u.sin(), inputs["delta"], inputs["A"], inputs["B"], inputs["C"], inputs["D"], inputs["z"],
            inputs["delta_bias"], delta_softplus=True, return_last_state=True,
            initial_state=inputs["initial_state"],
        )
        return (y * 2).sum() + last_state.square().sum()

    torch._dynamo.reset()
    loss = torch.compile(fn, backend="inductor", fullgraph=True)(u)
    (grad,) = torch.autograd.grad(loss, [u])
    loss_eager = fn(u)
    (grad_eager,) = torch.autograd.grad(loss_eager, [u])
    torch.testing.assert_close(loss, loss_eager, rtol=1e-5, atol=1e-4)
    assert rel_err(grad, grad_eager) < TOL[torch.float32]


# ---------------------------------------------------------------------------------------------
# The Library-based registration (low host overhead): the validation cache, the no-grad
# redispatch, inference mode and double backward.


def test_validation_cache_still_rejects_a_new_bad_signature():
    """A signature that passed once is cached; a different, bad one must still be rejected."""
    good = make_inputs(Case())
    run_op(good)
    run_op(good)
    bad = dict(good, delta=good["delta"][..., :-1])
    for _ in range(2):  # a rejected signature is never cached
        with pytest.raises(ValueError, match="delta must have shape"):
            run_op(bad)


def test_no_grad_and_inference_mode_match_the_autograd_path():
    inputs = make_inputs(Case(batch=1, L=20))
    leaves = {k: v.clone().requires_grad_() if torch.is_tensor(v) else v for k, v in inputs.items()}
    y_grad, h_grad = run_op(leaves)
    assert y_grad.grad_fn is not None and y_grad.requires_grad
    with torch.no_grad():
        y_nograd, h_nograd = run_op(leaves)
    assert y_nograd.grad_fn is None and not y_nograd.requires_grad
    with torch.inference_mode():
        y_inf, h_inf = run_op(inputs)
    for out in (y_nograd, y_inf):
        assert torch.equal(out, y_grad.detach())
    for out in (h_nograd, h_inf):
        assert torch.equal(out, h_grad.detach())


def test_double_backward_is_refused_by_name():
    inputs = make_inputs(Case(batch=1, L=12, dtype=torch.float64))
    u = inputs["u"].requires_grad_()
    y, _ = run_op(inputs)
    (du,) = torch.autograd.grad(y.sum(), u, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        du.sum().backward()


def test_autograd_kernel_is_registered_at_the_autograd_key():
    for name in ("ssm::selective_scan", "ssm::selective_scan_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd"), name


def test_torch_func_grad_is_refused_by_name():
    """torch.func.grad needs a setup_context-style autograd.Function; the op's node is not one, so
    the op refuses by name (before: torch's generic autograd.Function message). vmap of the
    forward alone still works."""
    g = torch.Generator().manual_seed(0)
    u, dt = torch.randn(2, 4, 5, generator=g), torch.randn(2, 4, 5, generator=g)
    A, B, C = -torch.rand(4, 3, generator=g), torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)

    def f(x):
        return torch.ops.ssm.selective_scan(x, dt, A, B, C, None, None, None, True, None, False)[0]

    with pytest.raises(RuntimeError, match="ssm::selective_scan: torch.func transforms"):
        torch.func.grad(lambda x: f(x).sum())(u)
    batched = torch.func.vmap(f)(torch.stack([u, 2 * u]))
    torch.testing.assert_close(batched[1], f(2 * u))
