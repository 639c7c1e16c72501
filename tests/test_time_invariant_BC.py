"""A time-invariant B or C, (dim, N) (mamba_ssm's ``is_variable_B`` / ``is_variable_C`` false):
the op takes it as it is, and its backward reduces dB/dC over time segments without a
(batch, dim, N, L) buffer (``kernels/selective_scan/invariant.py``); the scan passes hand it over
from loops, stacked states and associative_scan alike.

Before run 48 a (dim, N) B reached the op as a stride-0 (batch, dim, N, L) view, whose backward
returned dB, and dC of the C expanded to match, at that full size; a (dim, N) C was left alone.
"""
import pytest
import torch
from test_unseen_scan5 import assert_matches_eager, compare_with_eager
from utils import TOL, rel_err

from ssm_compile.kernels.selective_scan import invariant, op
from ssm_compile.kernels.selective_scan.reference import selective_scan_ref
from ssm_compile.report import explain


@pytest.fixture(scope="module", autouse=True)
def _register_ops():
    op.register()


# B/C kinds: "inv" (dim, N), "var" (batch, N, L), "g1" (batch, 1, N, L), "gd" (batch, dim, N, L).
PAIRS = [("inv", "inv"), ("inv", "var"), ("var", "inv"), ("inv", "g1"), ("gd", "inv"), ("inv", "gd")]


def make_inputs(kind_B, kind_C, batch=2, dim=6, L=23, N=3, dtype=torch.float64, seed=0, softplus=True):
    g = torch.Generator().manual_seed(seed)
    wdtype = torch.float64 if dtype == torch.float64 else torch.float32

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dt)

    shapes = {"inv": (dim, N), "var": (batch, N, L), "g1": (batch, 1, N, L), "gd": (batch, dim, N, L)}
    return dict(
        u=randn(batch, dim, L),
        delta=randn(batch, dim, L) * 0.5 - (1.0 if softplus else -1.5),
        A=-(torch.rand(dim, N, generator=g, dtype=torch.float64) + 0.1).to(wdtype),
        B=randn(*shapes[kind_B]),
        C=randn(*shapes[kind_C]),
        D=randn(dim, dt=wdtype),
        z=randn(batch, dim, L),
        delta_bias=randn(dim, dt=wdtype) * 0.1,
        initial_state=randn(batch, dim, N, dt=wdtype),
    )


def _grads(run, inputs, dy, dlast):
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    y, last = run(leaves)
    torch.autograd.backward([y, last], [dy.to(y.dtype), dlast.to(last.dtype)])
    return y, last, {k: v.grad for k, v in leaves.items()}


def _op(leaves):
    return torch.ops.ssm.selective_scan(**leaves, delta_softplus=True, return_last_state=True)


def _ref(leaves):
    return selective_scan_ref(**leaves, delta_softplus=True, return_last_state=True)


@pytest.mark.parametrize("min_segment", [64, 4, 1], ids=lambda s: f"minseg{s}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
def test_op_matches_reference(pair, dtype, min_segment, monkeypatch):
    """Forward, last state and every gradient, in one segment (L = 23 < 64) and in several (the
    forward's kept states and the carried d last_state are what a wrong segment boundary breaks)."""
    monkeypatch.setattr(invariant, "MIN_SEGMENT", min_segment)
    assert invariant.segment_length(23, 3) == (23 if min_segment == 64 else 8)
    inputs = make_inputs(*pair, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(inputs["u"].shape, generator=g, dtype=torch.float64)
    dlast = torch.randn(inputs["initial_state"].shape, generator=g, dtype=torch.float64)
    y, last, got = _grads(_op, inputs, dy, dlast)
    y_ref, last_ref, want = _grads(_ref, {k: v.double() for k, v in inputs.items()}, dy, dlast)
    tol = 1e-12 if dtype == torch.float64 else 2 * TOL[dtype]
    assert rel_err(y, y_ref) < tol and rel_err(last, last_ref) < tol
    for name, grad in got.items():
        assert grad.shape == inputs[name].shape and grad.dtype == inputs[name].dtype, name
        assert rel_err(grad, want[name]) < tol, (name, rel_err(grad, want[name]))


def test_segments_cover_the_sequence_and_bound_the_buffers():
    assert invariant.segment_length(23, 3, min_segment=1) == 8  # ceil(23 / 3): three segments
    assert invariant.segment_length(2048, 16) == 128  # batch*dim*N*128 = batch*dim*L values
    assert invariant.segment_length(2048, 256) == 64  # at least MIN_SEGMENT
    assert invariant.segment_length(40, 16) == 40  # one segment below MIN_SEGMENT


@pytest.mark.parametrize("pair", [("inv", "var"), ("var", "inv"), ("inv", "inv")], ids="-".join)
def test_gradcheck_fp64(pair, monkeypatch):
    monkeypatch.setattr(invariant, "MIN_SEGMENT", 2)
    inputs = make_inputs(*pair, batch=1, dim=2, L=7, N=2)
    assert invariant.segment_length(7, 2) == 4  # two segments
    names = list(inputs)

    def fn(*tensors):
        return torch.ops.ssm.selective_scan(**dict(zip(names, tensors)), delta_softplus=True,
                                            return_last_state=True)

    assert torch.autograd.gradcheck(fn, [t.requires_grad_() for t in inputs.values()])


@pytest.mark.parametrize("pair", [("inv", "var"), ("var", "inv")], ids="-".join)
def test_memory_stays_linear_in_L(pair):
    """The backward's largest allocation is far below a (batch, dim, L, N) tensor: before run 48
    dB (or dC) came back from the launcher at that size."""
    batch, dim, L, N = 1, 8, 1024, 16
    inputs = make_inputs(*pair, batch=batch, dim=dim, L=L, N=N, dtype=torch.float32)
    leaves = {k: v.requires_grad_() for k, v in inputs.items()}
    with torch.profiler.profile(profile_memory=True) as prof:
        y, last = _op(leaves)
        (y.sum() + last.sum()).backward()
    full_bytes = batch * dim * L * N * 4
    allocations = {e.name: e.cpu_memory_usage for e in prof.events() if e.name.startswith("aten::")}
    # What is left: the (batch, dim, L) activations and gradients, B/C's own (batch, N, L), the
    # chunk buffers and the segments' (batch, dim, N, 64) dB/dC.
    assert 0 < max(allocations.values()) <= full_bytes // 8, allocations


@pytest.mark.parametrize("pair", [("inv", "var"), ("inv", "inv")], ids="-".join)
@pytest.mark.parametrize("return_last_state", [False, True], ids=["y", "y+last_state"])
def test_opcheck(pair, return_last_state):
    inputs = {k: v.float() if v.dtype == torch.float64 else v
              for k, v in make_inputs(*pair, batch=2, dim=4, L=9, N=3).items()}
    for t in inputs.values():
        t.requires_grad_()
    torch.library.opcheck(
        torch.ops.ssm.selective_scan.default, (), dict(inputs, delta_softplus=True, return_last_state=return_last_state),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("pair", [("inv", "var"), ("gd", "inv")], ids="-".join)
def test_triton_backward_over_segments(pair):
    """The Triton launchers (TRITON_INTERPRET on a CPU-only machine) under the segmented backward,
    against the reference; L = 21 in segments of 7 crosses the launchers' chunks and the segments."""
    from ssm_compile.kernels.selective_scan import triton_bwd, triton_fwd

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = {k: v.to(device) for k, v in make_inputs(*pair, batch=2, dim=4, L=21, N=3, dtype=torch.float32).items()}
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(inputs["u"].shape, generator=g).to(device)
    dlast = torch.randn(inputs["initial_state"].shape, generator=g).to(device)
    got = invariant.backward(triton_fwd.selective_scan_fwd, triton_bwd.selective_scan_bwd, dy, dlast, *(inputs[k] for k in ("u", "delta", "A", "B", "C", "D", "z",
                                                                              "delta_bias")),
                             True, inputs["initial_state"], min_segment=7)
    _, _, want = _grads(_ref, {k: v.double() for k, v in inputs.items()}, dy.double(), dlast.double())
    names = {"u": "du", "delta": "ddelta", "A": "dA", "B": "dB", "C": "dC", "D": "dD", "z": "dz",
             "delta_bias": "ddelta_bias", "initial_state": "dinitial_state"}
    for name, field in names.items():
        grad = getattr(got, field)
        assert grad.shape == inputs[name].shape, name
        assert rel_err(grad, want[name]) < 2 * TOL[torch.float32], (name, rel_err(grad, want[name]))


# --- the passes ------------------------------------------------------------------------------

BATCH, DIM, STEPS, STATE = 2, 4, 7, 3


def _pass_inputs(B_shape, C_shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(BATCH, DIM, STEPS, generator=g, dtype=torch.float64)
    delta = torch.rand(BATCH, DIM, STEPS, generator=g, dtype=torch.float64) * 0.5 + 0.05
    A = -torch.rand(DIM, STATE, generator=g, dtype=torch.float64) - 0.2
    B = torch.randn(*B_shape, generator=g, dtype=torch.float64)
    C = torch.randn(*C_shape, generator=g, dtype=torch.float64)
    return [x.requires_grad_() for x in (u, delta, A, B, C)]


def _selective_scan_ref_loop(input_term: str):
    """mamba_ssm's selective_scan_ref with is_variable_C=False: a (dim, N) C; ``input_term`` is the
    einsum of Δ, B and u (a per-step B, or a (dim, N) one for is_variable_B=False too)."""
    def fn(u, delta, A, B, C):
        deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
        deltaB_u = torch.einsum(input_term, delta, B, u)
        x = A.new_zeros((u.shape[0], u.shape[1], A.shape[1]))
        ys = []
        for i in range(u.shape[2]):
            x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
            ys.append(torch.einsum("bdn,dn->bd", x, C))
        return torch.stack(ys, dim=2)
    return fn


ref_loop_invariant_C = _selective_scan_ref_loop("bdl,bnl,bdl->bdln")
ref_loop_invariant_C.__name__ = "ref_loop_invariant_C"
ref_loop_invariant_B_and_C = _selective_scan_ref_loop("bdl,dn,bdl->bdln")
ref_loop_invariant_B_and_C.__name__ = "ref_loop_invariant_B_and_C"


def _disc(u, delta, A, B):
    dA = torch.exp(delta.unsqueeze(-1) * A[:, None, :])
    dBu = delta.unsqueeze(-1) * B.transpose(1, 2).unsqueeze(1) * u.unsqueeze(-1)
    return dA, dBu


def loop_shared_C(u, delta, A, B, C):
    """One (N,) C for every channel and step, a broadcast product and sum."""
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(BATCH, DIM, STATE, dtype=u.dtype)
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append((h * C).sum(-1))
    return torch.stack(ys, 2)


def stacked_invariant_C(u, delta, A, B, C):
    dA, dBu = _disc(u, delta, A, B)
    h = torch.zeros(BATCH, DIM, STATE, dtype=u.dtype)
    hs = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        hs.append(h)
    return (torch.stack(hs, 2) * C[:, None, :]).sum(-1)


def assoc_invariant_C(u, delta, A, B, C):
    from torch._higher_order_ops.associative_scan import associative_scan

    dA, dBu = _disc(u, delta, A, B)
    _, hs = associative_scan(lambda x, y: (x[0] * y[0], y[0] * x[1] + y[1]), (dA, dBu), dim=2,
                             combine_mode="generic")
    return torch.einsum("bdln,dn->bdl", hs, C)


REWRITTEN = [
    (ref_loop_invariant_C, (BATCH, STATE, STEPS), (DIM, STATE), "scan_loop"),
    (ref_loop_invariant_B_and_C, (DIM, STATE), (DIM, STATE), "scan_loop"),
    (loop_shared_C, (BATCH, STATE, STEPS), (STATE,), "scan_loop"),
    (stacked_invariant_C, (BATCH, STATE, STEPS), (DIM, STATE), "scan_loop"),
    (assoc_invariant_C, (BATCH, STATE, STEPS), (DIM, STATE), "scan_assoc"),
]


@pytest.mark.parametrize("fn, B_shape, C_shape, family", REWRITTEN, ids=lambda x: getattr(x, "__name__", None))
def test_time_invariant_scan_is_rewritten_and_matches_eager(fn, B_shape, C_shape, family):
    args = _pass_inputs(B_shape, C_shape)
    report = explain(fn, *args)
    assert report.counts.get(family) == 1 and report.counts.get("readout") == 1, report.format(graphs=False)
    readout = next(r for r in report.rewrites if r.family == "readout")
    assert readout.decision["C"].startswith("time-invariant"), readout.decision
    assert_matches_eager(report.output, fn, args)


# --- a B or C without a time axis: (N,) for every channel, (batch, N) per batch element --------
# (run 52; before, such a B was a miss, "neither a time slice nor a time-invariant B (dim, state)",
# and a (batch, N) C was left alone: "ssm.selective_scan takes a time-invariant C only as (dim, N)")

def _shared_disc(u, delta, A, B):
    dA = torch.exp(delta.unsqueeze(-1) * A[:, None, :])
    Bx = {1: lambda: B, 2: lambda: B[:, None, None, :], 3: lambda: B.transpose(1, 2).unsqueeze(1)}[B.dim()]()
    return dA, delta.unsqueeze(-1) * Bx * u.unsqueeze(-1)


def _c_at(C, t):
    return C[:, None, :] if C.dim() == 2 else C[:, None, :, t]


def _c_of_states(C):
    return C[:, None, None, :] if C.dim() == 2 else C.transpose(1, 2)[:, None]


def shared_loop(u, delta, A, B, C):
    dA, dBu = _shared_disc(u, delta, A, B)
    h = u.new_zeros(BATCH, DIM, STATE)
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append((h * _c_at(C, t)).sum(-1))
    return torch.stack(ys, 2)


def shared_step_loop(u, delta, A, B, C):
    """The discretisation inside the loop, from the step's slices."""
    h = u.new_zeros(BATCH, DIM, STATE)
    ys = []
    for t in range(u.shape[2]):
        dt = delta[:, :, t, None]
        Bx = {1: lambda: B, 2: lambda: B[:, None, :], 3: lambda: B[:, None, :, t]}[B.dim()]()
        h = torch.exp(dt * A) * h + dt * Bx * u[:, :, t, None]
        ys.append((h * _c_at(C, t)).sum(-1))
    return torch.stack(ys, 2)


def shared_stacked(u, delta, A, B, C):
    dA, dBu = _shared_disc(u, delta, A, B)
    h = u.new_zeros(BATCH, DIM, STATE)
    hs = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        hs.append(h)
    return (torch.stack(hs, 2) * _c_of_states(C)).sum(-1)


def shared_assoc(u, delta, A, B, C):
    from torch._higher_order_ops.associative_scan import associative_scan

    dA, dBu = _shared_disc(u, delta, A, B)
    _, hs = associative_scan(lambda x, y: (x[0] * y[0], y[0] * x[1] + y[1]), (dA, dBu), dim=2,
                             combine_mode="generic")
    return (hs * _c_of_states(C)).sum(-1)


SHARED = [((STATE,), (BATCH, STATE, STEPS)), ((BATCH, STATE), (BATCH, STATE, STEPS)),
          ((BATCH, STATE, STEPS), (BATCH, STATE)), ((BATCH, STATE), (BATCH, STATE)), ((STATE,), (BATCH, STATE))]


@pytest.mark.parametrize("shapes", SHARED, ids=lambda s: f"B{len(s[0])}d-C{len(s[1])}d")
@pytest.mark.parametrize("fn, family", [(shared_loop, "scan_loop"), (shared_step_loop, "scan_loop"),
                                        (shared_stacked, "scan_loop"), (shared_assoc, "scan_assoc")],
                         ids=["loop", "step-loop", "stacked", "assoc"])
def test_a_B_or_C_without_a_time_axis_is_rewritten(fn, family, shapes):
    args = _pass_inputs(*shapes)
    report = explain(fn, *args)
    assert report.counts.get(family) == 1 and report.counts.get("readout") == 1, report.format(graphs=False)
    assert_matches_eager(report.output, fn, args)


def test_a_C_per_batch_and_channel_is_left_alone_with_a_reason():
    """The same C at every step but one per (batch, channel), (batch, dim, N): the op has no such input."""
    def fn(u, delta, A, B, C):
        dA, dBu = _disc(u, delta, A, B)
        h = torch.zeros(BATCH, DIM, STATE, dtype=u.dtype)
        ys = []
        for t in range(u.shape[2]):
            h = dA[:, :, t] * h + dBu[:, :, t]
            ys.append((h * C).sum(-1))
        return torch.stack(ys, 2)

    args = _pass_inputs((BATCH, STATE, STEPS), (BATCH, DIM, STATE))
    report = explain(fn, *args)
    assert report.counts.get("scan_loop") is None
    assert any("takes a C without a time axis only as (dim, state), (state) or (batch, state)" in m.reason
               for m in report.misses), report.format(graphs=False)
    assert_matches_eager(report.output, fn, args)


def test_triton_launchers_read_per_batch_views():
    """A (batch, N) B and C reach the launchers as stride-0 (batch, 1, N, L) views (the passes'
    expand): forward and backward against the reference (TRITON_INTERPRET on a CPU-only machine)."""
    from ssm_compile.kernels.selective_scan import triton_bwd, triton_fwd

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = make_inputs("var", "var", batch=2, dim=4, L=21, N=3, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    Bb, Cb = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    inputs["B"], inputs["C"] = Bb[:, :, None].expand(2, 3, 21), Cb[:, :, None].expand(2, 3, 21)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    dy = torch.randn(inputs["u"].shape, generator=g).to(device)
    dlast = torch.randn(inputs["initial_state"].shape, generator=g).to(device)
    args = [inputs[k] for k in ("u", "delta", "A")] + [inputs["B"][:, None], inputs["C"][:, None]] + [
        inputs[k] for k in ("D", "z", "delta_bias")]
    y, last = triton_fwd.selective_scan_fwd(*args, True, inputs["initial_state"], True)
    got = triton_bwd.selective_scan_bwd(dy, dlast, *args, True, inputs["initial_state"])
    want_y, want_last, want = _grads(_ref, {k: v.double() for k, v in inputs.items()}, dy.double(), dlast.double())
    assert rel_err(y, want_y) < TOL[torch.float32] and rel_err(last, want_last) < TOL[torch.float32]
    for name, grad in (("u", got.du), ("delta", got.ddelta), ("A", got.dA), ("B", got.dB[:, 0]), ("C", got.dC[:, 0]),
                       ("D", got.dD), ("z", got.dz), ("delta_bias", got.ddelta_bias),
                       ("initial_state", got.dinitial_state)):
        assert rel_err(grad, want[name]) < 2 * TOL[torch.float32], (name, rel_err(grad, want[name]))


@pytest.mark.parametrize("inplace", [False, True], ids=["rebound", "in-place"])
def test_a_C_that_changes_between_steps_is_left_alone(inplace):
    """``C = C * 0.9`` or ``C.mul_(0.9)`` after each readout: the steps read different values, so
    this is no time-invariant C (and no scan the op computes)."""
    def fn(u, delta, A, B, C):
        C = C.clone()
        dA, dBu = _disc(u, delta, A, B)
        h = torch.zeros(BATCH, DIM, STATE, dtype=u.dtype)
        ys = []
        for t in range(u.shape[2]):
            h = dA[:, :, t] * h + dBu[:, :, t]
            ys.append((h * C).sum(-1))
            if inplace:
                C.mul_(0.9)
            else:
                C = C * 0.9
        return torch.stack(ys, 2)

    args = _pass_inputs((BATCH, STATE, STEPS), (DIM, STATE))
    if inplace:
        # Eager's backward refuses a C modified after the readouts saved it: compare values only.
        args = [a.detach() for a in args]
    report = explain(fn, *args)
    assert report.counts.get("scan_loop") is None, report.format(graphs=False)
    assert report.misses, report.format(graphs=False)
    torch.testing.assert_close(report.output, fn(*args), rtol=1e-12, atol=1e-12)


def test_launchers_get_stride_0_views():
    """The launchers take (batch, G, N, L) only: a (dim, N) pair reaches them as G = dim views of
    the caller's own memory, never as copies."""
    B, C = torch.randn(4, 3), torch.randn(2, 3, 5)
    Bv, Cv = invariant.launcher_views(B, C, 2, 4, 5)
    assert Bv.shape == Cv.shape == (2, 4, 3, 5)
    assert Bv.data_ptr() == B.data_ptr() and Cv.data_ptr() == C.data_ptr()
    assert Bv.stride() == (0, 3, 1, 0) and Cv.stride() == (15, 0, 5, 1)
    assert torch.equal(Bv[1, 2, :, 4], B[2]) and torch.equal(Cv[1, 3], C[1])


# --- operands with no time axis that still vary per step (probe AG: wrong results before) -------

def _per_step_operand_loop(c_of=None, b_of=None, a_of=None, tail=False):
    """A textbook loop in which the readout's C, the input's B or the decay's A is recomputed at
    every step by ``*_of(x, u, h, t)``: none has a time axis, all differ from step to step."""
    def fn(u, delta, A, B, C):
        h = torch.zeros(u.shape[0], u.shape[1], A.shape[1], dtype=u.dtype)
        ys = []
        for t in range(u.shape[2]):
            dt = delta[:, :, t, None]
            A_t = A if a_of is None else a_of(A, u, h, t)
            B_t = B[:, None, :, t] if b_of is None else b_of(B, u, h, t)
            h = torch.exp(dt * A_t) * h + dt * B_t * u[:, :, t, None]
            C_t = C[:, None, :, t] if c_of is None else c_of(C, u, h, t)
            y = (h * C_t).sum(-1)
            ys.append(y + 0.5 * u[:, :, t] if tail else y)
        return torch.stack(ys, -1)
    return fn


PER_STEP = {
    "C-plus-a-time-slice": (_per_step_operand_loop(c_of=lambda C, u, h, t: C + u[:, :, t].mean(0)[:, None]),
                            "B", "C", "time slices"),
    "C-plus-a-time-slice-tail": (_per_step_operand_loop(c_of=lambda C, u, h, t: C + u[:, :, t].mean(0)[:, None],
                                                        tail=True), "B", "C", "time slices"),
    "C-from-the-state": (_per_step_operand_loop(c_of=lambda C, u, h, t: C + h.detach().mean(0)), "B", "C",
                         "the loop's own values"),
    "C-from-the-state-tail": (_per_step_operand_loop(c_of=lambda C, u, h, t: C + h.detach().mean(0), tail=True),
                              "B", "C", "the loop's own values"),
    "B-from-a-time-slice": (_per_step_operand_loop(b_of=lambda B, u, h, t: torch.sigmoid(B * u[:, :, t].mean(0)[:, None])),
                            "B-inv", "C", "time slices"),
    "A-from-a-time-slice": (_per_step_operand_loop(a_of=lambda A, u, h, t: A - torch.sigmoid(u[:, :, t].mean(0))[:, None]),
                            "B", "C", "time slices"),
}


@pytest.mark.parametrize("name", list(PER_STEP))
def test_an_operand_without_a_time_axis_that_varies_per_step_is_left_alone(name):
    """Each step's copy of such an operand reads its own step (or the state): the op, which reads a
    (dim, N) A, B or C once, would give every step step 0's value (errors of 0.1 to 3.5 before)."""
    fn, b_kind, c_kind, cause = PER_STEP[name]
    B_shape = (DIM, STATE) if b_kind == "B-inv" else (BATCH, STATE, STEPS)
    C_shape = (DIM, STATE) if name.startswith("C-") else (BATCH, STATE, STEPS)
    args = _pass_inputs(B_shape, C_shape)
    report = explain(fn, *args)
    assert report.counts.get("scan_loop") is None, report.format(graphs=False)
    assert any("has no time axis but is computed from " + cause in m.reason for m in report.misses), \
        report.format(graphs=False)
    assert_matches_eager(report.output, fn, args)


METADATA_ONLY = {
    "C.type_as(x_t)": _per_step_operand_loop(c_of=lambda C, u, h, t: C.type_as(u[:, :, t])),
    "C.to(x_t)": _per_step_operand_loop(c_of=lambda C, u, h, t: C.to(u[:, :, t])),
    "C.type_as(h)": _per_step_operand_loop(c_of=lambda C, u, h, t: C.type_as(h)),
    "C.view_as(h[0])": _per_step_operand_loop(c_of=lambda C, u, h, t: C.view_as(h[0])),
    "A.to(x_t)": _per_step_operand_loop(a_of=lambda A, u, h, t: A.to(u[:, :, t])),
}


@pytest.mark.parametrize("name", list(METADATA_ONLY))
def test_an_operand_that_takes_only_a_dtype_or_shape_from_a_step_is_rewritten(name):
    """Probe AH: the per-step check of ``ddb716d`` followed every input, so a C or A that reads only
    a step's dtype or shape was refused as varying per step."""
    C_shape = (DIM, STATE) if name.startswith("C") else (BATCH, STATE, STEPS)
    args = _pass_inputs((BATCH, STATE, STEPS), C_shape)
    assert compare_with_eager(METADATA_ONLY[name], args)["scan_loop"] == 1
