"""The ``scan_loop`` pass: unrolled Python time loops -> ssm.selective_scan.

Each positive form is written after real code (HF transformers' ``mamba_selective_scan`` loop
branch, mamba-minimal, mamba_ssm's ``selective_scan_ref``); each negative form is a near miss
that computes something else and must be left alone with a reason.
"""
import operator

import pytest
import torch
from expecttest import assert_expected_inline
from torch._dynamo.utils import counters
from utils import PassCapture, TOL, compile_with_passes, rel_err

from ssm_compile.passes import scan_loop
from ssm_compile.passes.discretize import match_discretization
from ssm_compile.passes.fx_utils import normalized_graph_str

BATCH, DIM, N, L = 2, 6, 4, 9


@pytest.fixture(scope="module", autouse=True)
def registered():
    # The rewritten graphs call torch.ops.ssm.*; the op must exist before they are traced.
    from ssm_compile.kernels.selective_scan import op

    op.register()


PASSES = (scan_loop,)


def compile_and_run(fn, *args):
    return compile_with_passes(fn, *args, passes=PASSES)


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def make_inputs(dtype=torch.float32, layout="bdl", length=L, dim=DIM, state=N):
    """u, delta, A, B, C in the op's layout ("bdl": (b, d, L), B/C (b, N, L)) or mamba-minimal's."""
    g = torch.Generator().manual_seed(0)
    u = torch.randn(BATCH, dim, length, generator=g)
    delta = torch.rand(BATCH, dim, length, generator=g) * 0.5 + 0.05
    A = -torch.rand(dim, state, generator=g) - 0.5
    B = torch.randn(BATCH, state, length, generator=g)
    C = torch.randn(BATCH, state, length, generator=g)
    if layout == "bld":
        u, delta, B, C = (t.transpose(1, 2).contiguous() for t in (u, delta, B, C))
    return tuple(t.to(dtype) for t in (u, delta)) + (A,) + tuple(t.to(dtype) for t in (B, C))


def assert_rewritten(cap, loops=1):
    assert counters["ssm"]["scan_loop"] == loops, cap.ctx.misses
    assert counters["ssm"]["discretization"] == loops
    assert counters["ssm"]["readout"] == loops
    assert cap.ctx.misses == []
    targets = [n.target for n in cap.gm.graph.nodes]
    assert targets.count(torch.ops.ssm.selective_scan.default) == loops


def assert_close(out, ref, tol):
    for o, r in zip(as_tuple(out), as_tuple(ref)):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert rel_err(o, r) <= tol


# --- positive forms -------------------------------------------------------------------------

def hf_loop(u, dt, A, B, C):
    """transformers 5.17/5.24 ``mamba_selective_scan``, loop branch (B, C arrive as (b, N, L))."""
    input_dtype = u.dtype
    B = B.transpose(1, 2)
    C = C.transpose(1, 2)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    discrete_B = dt[:, :, :, None] * B[:, None, :, :].float()
    deltaB_u = discrete_B * u[:, :, :, None].float()
    ssm_state = torch.zeros(u.shape[0], u.shape[1], A.shape[-1], dtype=input_dtype, device=u.device)
    scan_outputs = []
    for index in range(u.shape[2]):
        ssm_state = discrete_A[:, :, index] * ssm_state + deltaB_u[:, :, index]
        scan_output = torch.matmul(ssm_state.to(input_dtype), C[:, index, :].unsqueeze(-1))
        scan_outputs.append(scan_output[:, :, 0])
    return torch.stack(scan_outputs, dim=-1), ssm_state


def mamba_minimal(u, delta, A, B, C):
    """mamba-minimal ``selective_scan``: (b, L, d) layout, einsum discretisation and readout."""
    b, l, d_in = u.shape
    n = A.shape[1]
    deltaA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
    deltaB_u = torch.einsum("bld,bln,bld->bldn", delta, B, u)
    x = torch.zeros((b, d_in, n), device=deltaA.device)
    ys = []
    for i in range(l):
        x = deltaA[:, i] * x + deltaB_u[:, i]
        y = torch.einsum("bdn,bn->bd", x, C[:, i, :])
        ys.append(y)
    return torch.stack(ys, dim=1)


def scan_ref(u, delta, A, B, C):
    """mamba_ssm ``selective_scan_ref`` (no D/z/bias), returning the last state."""
    batch, dim, dstate = u.shape[0], A.shape[0], A.shape[1]
    x = A.new_zeros((batch, dim, dstate))
    ys = []
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    last_state = None
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        y = torch.einsum("bdn,bn->bd", x, C[:, :, i])
        if i == u.shape[2] - 1:
            last_state = x
        ys.append(y)
    return torch.stack(ys, dim=2), last_state


def time_invariant_B(u, delta, A, B, C):
    """B (dim, N) shared by every step and batch; readout as a broadcast product + sum; cat."""
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,dn,bdl->bdln", delta, A.sin(), u)
    x = torch.zeros_like(deltaA[:, :, 0])
    ys = []
    for i in range(u.shape[2]):
        x = x * deltaA[:, :, i] + deltaB_u[:, :, i]
        ys.append((x * C[:, None, :, i]).sum(-1).unsqueeze(-1))
    return torch.cat(ys, dim=-1)


def with_initial_state(u, delta, A, B, C, h):
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    x = h
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=-1), x * 2


def ones_initial_state(u, delta, A, B, C):
    return with_initial_state(u, delta, A, B, C, torch.ones(u.shape[0], u.shape[1], A.shape[1]))


def broadcast_initial_state(u, delta, A, B, C):
    """h_{-1} of shape (batch, dim, 1) broadcast over the state axis: the op gets an expanded view."""
    return with_initial_state(u, delta, A, B, C, torch.ones(u.shape[0], u.shape[1], 1))[0]


def setitem_buffer(u, delta, A, B, C):
    """Outputs written into a preallocated buffer with ``out[:, :, i] = y``."""
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    out = torch.empty_like(u)
    x = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        out[:, :, i] = torch.einsum("bdn,bn->bd", x, C[:, :, i])
    return out + 1


def copy_buffer(u, delta, A, B, C):
    """Outputs copied into a (b, L, d) buffer with ``out[:, i].copy_(y)``."""
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    out = u.new_zeros(u.shape[0], u.shape[2], u.shape[1])
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        out[:, i].copy_(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return out


def grouped_ref(u, delta, A, Bg, Cg):
    """selective_scan_ref with grouped B, C (batch, G, N, L) broadcast to channels."""
    heads = u.shape[1] // Bg.shape[1]
    B = Bg.repeat_interleave(heads, dim=1)
    C = Cg.repeat_interleave(heads, dim=1)
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bdnl,bdl->bdln", delta, B, u)
    x = A.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bdn->bd", x, C[:, :, :, i]))
    return torch.stack(ys, dim=2)


def grouped_B_shared_C(u, delta, A, Bg, Cg):
    """Grouped B with one C for all channels: C goes to the op as a stride-0 grouped view."""
    B = Bg.repeat_interleave(u.shape[1] // Bg.shape[1], dim=1)
    C = Cg[:, 0]
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bdnl,bdl->bdln", delta, B, u)
    x = A.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


@pytest.mark.parametrize("fn", [grouped_ref, grouped_B_shared_C], ids=["grouped-B-C", "grouped-B-shared-C"])
def test_grouped(fn):
    u, delta, A, _, _ = make_inputs()
    g = torch.Generator().manual_seed(1)
    Bg, Cg = (torch.randn(BATCH, 3, N, L, generator=g) for _ in range(2))
    cap, out = compile_and_run(fn, u, delta, A, Bg, Cg)
    assert_rewritten(cap)
    assert_close(out, fn(u, delta, A, Bg, Cg), TOL[torch.float32])
    scan = next(n for n in cap.gm.graph.nodes if n.target == torch.ops.ssm.selective_scan.default)
    assert scan.args[3].name == "l_bg_"  # grouped B reaches the op as the user's (b, G, N, L) tensor


def per_step(u, delta, A, B, C):
    """Discretised inside the loop, one step at a time: no A_full/B_full tensor exists."""
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        dA = torch.exp(delta[:, :, t, None] * A)
        dB = delta[:, :, t, None] * B[:, None, :, t]
        h = dA * h + dB * u[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=-1), h


def per_step_bld(u, delta, A, B, C):
    """Per-step discretisation in the (b, L, d) layout, with unsqueeze instead of None-indexing."""
    h = torch.zeros(u.shape[0], u.shape[2], A.shape[1])
    ys = []
    for t in range(u.shape[1]):
        dA = torch.exp(delta[:, t].unsqueeze(-1) * A)
        h = dA * h + (delta[:, t] * u[:, t]).unsqueeze(-1) * B[:, t].unsqueeze(1)
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
    return torch.stack(ys, dim=1)


def inplace_state(u, delta, A, B, C):
    """The state updated in place, on a tensor the code allocated (passes/inplace.py)."""
    deltaA, deltaB_u = _disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h *= deltaA[:, :, i]
        h += deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]))
    return torch.stack(ys, dim=2)


def inplace_state_chained(u, delta, A, B, C):
    """``h.mul_(a).add_(b)`` on a clone of the previous state, as a statement."""
    deltaA, deltaB_u = _disc(u, delta, A, B)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = h.clone()
        h.mul_(deltaA[:, :, i]).add_(deltaB_u[:, :, i])
        ys.append((h * C[:, None, :, i]).sum(-1))
    return torch.stack(ys, dim=2)


def sliced_prefixes(u, delta, A, B, C):
    # A_full and B_full cut to the loop's steps after the fact (a narrow and a slice): step t
    # of either prefix is step t of the whole, so the loop is a scan over the first L - 3 steps.
    deltaA, deltaB_u = _disc(u, delta, A, B)
    steps = u.shape[2] - 3
    deltaA, deltaB_u = deltaA.narrow(2, 0, steps), deltaB_u[:, :, :steps]
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(steps):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


POSITIVE = [
    pytest.param(hf_loop, "bdl", id="hf-loop"),
    pytest.param(inplace_state, "bdl", id="inplace-state"),
    pytest.param(inplace_state_chained, "bdl", id="inplace-state-chained"),
    pytest.param(mamba_minimal, "bld", id="mamba-minimal"),
    pytest.param(scan_ref, "bdl", id="selective-scan-ref"),
    pytest.param(time_invariant_B, "bdl", id="time-invariant-B-cat"),
    pytest.param(ones_initial_state, "bdl", id="ones-initial-state"),
    pytest.param(broadcast_initial_state, "bdl", id="broadcast-initial-state"),
    pytest.param(setitem_buffer, "bdl", id="setitem-buffer"),
    pytest.param(copy_buffer, "bdl", id="copy-buffer"),
    pytest.param(per_step, "bdl", id="per-step"),
    pytest.param(per_step_bld, "bld", id="per-step-bld"),
    pytest.param(sliced_prefixes, "bdl", id="sliced-prefixes"),
]


@pytest.mark.parametrize("fn, layout", POSITIVE)
def test_rewrites_and_matches_eager(fn, layout):
    args = make_inputs(layout=layout)
    cap, out = compile_and_run(fn, *args)
    assert_rewritten(cap)
    assert_close(out, fn(*args), TOL[torch.float32])


def test_initial_state_argument():
    args = make_inputs()
    h = torch.randn(BATCH, DIM, N)
    cap, out = compile_and_run(with_initial_state, *args, h)
    assert_rewritten(cap)
    assert_close(out, with_initial_state(*args, h), TOL[torch.float32])
    decision = cap.ctx.rewrites[0].decision
    assert decision["initial_state"] and decision["return_last_state"]



def number_start(u, delta, A, B, C, h=0.0, update=lambda s: s):
    """``x = 0.0`` before the loop (a number, not a tensor): step 0 multiplies the decay by it."""
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    x = h
    ys = []
    for i in range(u.shape[2]):
        x = update(deltaA[:, :, i] * x + deltaB_u[:, :, i])
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=-1), x


def _numbers_multiplied(gm):
    return sorted(a for n in gm.graph.nodes if n.target in (operator.mul, torch.mul, "mul")
                  for a in n.args if isinstance(a, (int, float)))


@pytest.mark.parametrize("h", [0.0, 0, 1.0, -0.5, 0.1], ids=["0.0", "int0", "1.0", "-0.5", "0.1"])
def test_number_initial_state(h):
    # 0.1 is not a float32 number, but eager's float32 product rounds it to one, as the state does.
    args = make_inputs()
    cap, out = compile_and_run(lambda *a: number_start(*a, h=h), *args)
    assert_rewritten(cap)
    assert cap.ctx.rewrites[0].decision["initial_state"] is (h != 0)
    assert _numbers_multiplied(cap.gm) == []
    ref = number_start(*(a.double() for a in args), h=torch.tensor(h, dtype=torch.float32).double())
    assert all(rel_err(o, r) <= TOL[torch.float32] for o, r in zip(out, ref))


def test_number_initial_state_left_alone_as_written():
    # bf16 multiplies by 0.1 in float32, a bf16 state would hold its rounding; and a tanh between
    # steps is no scan: either way the user's own product by the number stays in the graph.
    args = tuple(a.to(torch.bfloat16) for a in make_inputs())
    cap, out = compile_and_run(lambda *a: number_start(*a, h=0.1), *args)
    assert counters["ssm"]["scan_loop"] == 0
    reasons = [m.reason for m in cap.ctx.misses if m.family == "scan_loop"]
    assert any("number 0.1 as its initial state, which torch.bfloat16 does not hold exactly" in r
               for r in reasons), reasons
    assert _numbers_multiplied(cap.gm) == [0.1]
    assert all(torch.equal(o, r) for o, r in zip(out, number_start(*args, h=0.1)))
    counters.clear()
    args = make_inputs()
    cap, out = compile_and_run(lambda *a: number_start(*a, h=0.0, update=torch.tanh), *args)
    assert counters["ssm"]["scan_loop"] == 0
    assert any("not linear in the previous state" in m.reason for m in cap.ctx.misses), cap.ctx.misses
    assert _numbers_multiplied(cap.gm) == [0.0]
    assert all(torch.equal(o, r) for o, r in zip(out, number_start(*args, h=0.0, update=torch.tanh)))

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hf_loop_low_precision(dtype):
    args = make_inputs(dtype=dtype)
    cap, out = compile_and_run(hf_loop, *args)
    assert_rewritten(cap)
    ref = hf_loop(*(a.double() for a in args))
    y, last = out
    assert y.dtype == dtype and last.dtype == torch.float32
    assert rel_err(y, ref[0]) <= TOL[dtype]
    assert rel_err(last, ref[1]) <= TOL[dtype]


@pytest.mark.parametrize("length", [2, 17], ids=["L2", "L17"])
def test_lengths(length):
    args = make_inputs(length=length)
    cap, out = compile_and_run(scan_ref, *args)
    assert_rewritten(cap)
    assert_close(out, scan_ref(*args), TOL[torch.float32])


@pytest.mark.parametrize("fn, layout", [pytest.param(scan_ref, "bdl", id="selective-scan-ref"),
                                        pytest.param(time_invariant_B, "bdl", id="time-invariant-B-cat")])
def test_dynamic_shapes(fn, layout):
    """With symbolic batch/dim/state sizes (the loop's length is specialised by unrolling)."""
    args = make_inputs(layout=layout)
    cap = PassCapture(*PASSES)
    out = torch.compile(fn, backend=cap, dynamic=True)(*args)
    assert_rewritten(cap)
    assert_close(out, fn(*args), TOL[torch.float32])


def test_two_loops_in_one_graph():
    def two(u, delta, A, B, C):
        y1, _ = scan_ref(u, delta, A, B, C)
        y2 = mamba_minimal(u.transpose(1, 2), delta.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2))
        return y1 + y2.transpose(1, 2)

    args = make_inputs()
    cap, out = compile_and_run(two, *args)
    assert_rewritten(cap, loops=2)
    assert_close(out, two(*args), TOL[torch.float32])


# --- snapshots ------------------------------------------------------------------------------

def test_snapshot_hf_loop():
    cap, _ = compile_and_run(hf_loop, *make_inputs())
    assert cap.ctx.rewrites[0].decision == {
        "L": L, "N": N, "layout": "bdln", "initial_state": False, "return_last_state": True,
        "collector": "stack",
    }
    assert_expected_inline(normalized_graph_str(cap.gm), """\
%L_A_ = placeholder
%L_B_ = placeholder
%L_C_ = placeholder
%L_dt_ = placeholder
%L_u_ = placeholder
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%L_u_, %L_dt_, %L_A_, %L_B_, %L_C_, None, None, None, False, None, True)
%getitem_1 = operator.getitem(%selective_scan_1, 0)
%getitem_2 = operator.getitem(%selective_scan_1, 1)
return (%getitem_1, %getitem_2)
""")


def test_snapshot_mamba_minimal():
    cap, _ = compile_and_run(mamba_minimal, *make_inputs(layout="bld"))
    assert_expected_inline(normalized_graph_str(cap.gm), """\
%L_A_ = placeholder
%L_B_ = placeholder
%L_C_ = placeholder
%L_delta_ = placeholder
%L_u_ = placeholder
%permute_1 = .permute(%L_u_, (0, 2, 1))
%permute_2 = .permute(%L_delta_, (0, 2, 1))
%permute_3 = .permute(%L_C_, (0, 2, 1))
%permute_4 = .permute(%L_B_, (0, 2, 1))
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%permute_1, %permute_2, %L_A_, %permute_4, %permute_3, None, None, None, False, None, False)
%getitem_1 = operator.getitem(%selective_scan_1, 0)
%permute_5 = .permute(%getitem_1, (0, 2, 1))
return (%permute_5,)
""")


def test_snapshot_time_invariant_B():
    cap, _ = compile_and_run(time_invariant_B, *make_inputs())
    assert_expected_inline(normalized_graph_str(cap.gm), """\
%L_A_ = placeholder
%L_C_ = placeholder
%L_delta_ = placeholder
%L_u_ = placeholder
%sin_1 = .sin(%L_A_)
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%L_u_, %L_delta_, %L_A_, %sin_1, %L_C_, None, None, None, False, None, False)
%getitem_1 = operator.getitem(%selective_scan_1, 0)
return (%getitem_1,)
""")


def test_snapshot_per_step_bld():
    cap, _ = compile_and_run(per_step_bld, *make_inputs(layout="bld"))
    assert_expected_inline(normalized_graph_str(cap.gm), """\
%L_A_ = placeholder
%L_B_ = placeholder
%L_C_ = placeholder
%L_delta_ = placeholder
%L_u_ = placeholder
%permute_1 = .permute(%L_u_, (0, 2, 1))
%permute_2 = .permute(%L_delta_, (0, 2, 1))
%permute_3 = .permute(%L_C_, (0, 2, 1))
%permute_4 = .permute(%L_B_, (0, 2, 1))
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%permute_1, %permute_2, %L_A_, %permute_4, %permute_3, None, None, None, False, None, False)
%getitem_1 = operator.getitem(%selective_scan_1, 0)
%permute_5 = .permute(%getitem_1, (0, 2, 1))
return (%permute_5,)
""")


def test_snapshot_setitem_buffer():
    cap, _ = compile_and_run(setitem_buffer, *make_inputs())
    assert_expected_inline(normalized_graph_str(cap.gm), """\
%L_A_ = placeholder
%L_B_ = placeholder
%L_C_ = placeholder
%L_delta_ = placeholder
%L_u_ = placeholder
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%L_u_, %L_delta_, %L_A_, %L_B_, %L_C_, None, None, None, False, None, False)
%getitem_1 = operator.getitem(%selective_scan_1, 0)
%add_1 = operator.add(%getitem_1, 1)
return (%add_1,)
""")


# --- near misses: each computes something else and must be left alone -----------------------

def _disc(u, delta, A, B):
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    return deltaA, deltaB_u


def previous_input(u, delta, A, B, C):
    deltaA, deltaB_u = _disc(u, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i - 1]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


def tanh_update(u, delta, A, B, C):
    deltaA, deltaB_u = _disc(u, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = torch.tanh(deltaA[:, :, i] * x + deltaB_u[:, :, i])
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


def quadratic_update(u, delta, A, B, C):
    deltaA, deltaB_u = _disc(u, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


def scaled_update(u, delta, A, B, C):
    deltaA, deltaB_u = _disc(u, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x * 0.5 + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


def reset_midway(u, delta, A, B, C):
    deltaA, deltaB_u = _disc(u, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaB_u[:, :, i] if i == 4 else deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


def zeroed_midway(u, delta, A, B, C):
    deltaA, deltaB_u = _disc(u, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        if i == 4:
            x = x * 0
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


def lagged_readout(u, delta, A, B, C):
    deltaA, deltaB_u = _disc(u, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
    return torch.stack(ys, dim=2)


def intermediate_used(u, delta, A, B, C):
    deltaA, deltaB_u = _disc(u, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        if i == 3:
            mid = x
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2), mid


def out_of_order(u, delta, A, B, C):
    deltaA, deltaB_u = _disc(u, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    order = list(range(u.shape[2]))
    order[2], order[3] = order[3], order[2]
    for i in order:
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


def skipped_step(u, delta, A, B, C):
    deltaA, deltaB_u = _disc(u, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in [t for t in range(u.shape[2]) if t != 5]:
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


def exp_plus_one(u, delta, A, B, C):
    deltaA, deltaB_u = _disc(u, delta, A, B)
    deltaA = deltaA + 1
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


def different_delta(u, delta, A, B, C):
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta * 1.5, B, u)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


def per_step_input_lagged(u, delta, A, B, C):
    """β_t built inside the loop from Δ_t, B_t and u_{t-1} (u[-1] at step 0): a precomputed A_full
    with a per-step input term is proved (the mixed form), but this one reads u a step late."""
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + delta[:, :, i, None] * B[:, None, :, i] * u[:, :, i - 1, None]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


def readout_not_contraction(u, delta, A, B, C):
    deltaA, deltaB_u = _disc(u, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.tanh(x).sum(-1))
    return torch.stack(ys, dim=2)


def stacked_twice(u, delta, A, B, C):
    deltaA, deltaB_u = _disc(u, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    ys[3] = ys[2]
    return torch.stack(ys, dim=2)


def mutated_source(u, delta, A, B, C):
    # Through a view: a write to a graph-local tensor nothing else shares is written out of place
    # first (passes/inplace.py; test_inplace_writes.py), and the loop would then match.
    u2 = u.clone()
    u2.view(-1).mul_(2)
    deltaA, deltaB_u = _disc(u2, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2) + u2


def per_step_previous_input(u, delta, A, B, C):
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = torch.exp(delta[:, :, t, None] * A) * h + delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t - 1, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=-1)


def per_step_other_delta(u, delta, A, B, C):
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = torch.exp(delta[:, :, t, None] * A) * h + u[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=-1)


def divides_by_the_decay(u, delta, A, B, C):
    # (a*h*a + b*a) / a is a*h + b in algebra, NaN in floats wherever a decay underflows to 0.
    deltaA, deltaB_u = _disc(u, delta, A, B)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        a = deltaA[:, :, i]
        x = (a * x * a + deltaB_u[:, :, i] * a) / a
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


def shifted_slice(u, delta, A, B, C):
    # B_full[:, :, 1:] is not a prefix: step i adds the input of step i + 1.
    deltaA, deltaB_u = _disc(u, delta, A, B)
    deltaB_u = deltaB_u[:, :, 1:]
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2] - 1):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


NEGATIVE = [
    pytest.param(divides_by_the_decay, "not a number", id="divides-by-the-decay"),
    pytest.param(previous_input, "adds B_full at time index 8, not 0", id="previous-input"),
    pytest.param(shifted_slice, "B_full is not a product", id="shifted-slice"),
    pytest.param(tanh_update, "not linear in the previous state", id="tanh-update"),
    pytest.param(quadratic_update, "not linear in the previous state", id="quadratic-update"),
    pytest.param(scaled_update, "computes with the number 0.5", id="scaled-update"),
    pytest.param(reset_midway, "step 4 does not repeat step 0", id="reset-midway"),
    pytest.param(zeroed_midway, "step 5 does not repeat step 0", id="zeroed-midway"),
    pytest.param(lagged_readout, "lagged readout", id="lagged-readout"),
    pytest.param(intermediate_used, "intermediate state h_3 is used outside", id="intermediate-used"),
    pytest.param(out_of_order, "step 2 does not repeat step 0", id="out-of-order"),
    pytest.param(skipped_step, "step 5 does not repeat step 0", id="skipped-step"),
    pytest.param(exp_plus_one, "discretization: A_full is not exp", id="exp-plus-one"),
    pytest.param(different_delta, "none of which is A_full's Δ", id="different-delta"),
    pytest.param(per_step_input_lagged, "addend reads time 8 where its multiplier reads time 0", id="per-step-input"),
    pytest.param(readout_not_contraction, "readout is not a contraction", id="readout-tanh"),
    pytest.param(mutated_source, "is mutated in place", id="mutated-source"),
    pytest.param(per_step_previous_input, "addend reads time 8 where its multiplier reads time 0",
                 id="per-step-previous-input"),
    pytest.param(per_step_other_delta, "does not use the same Δ", id="per-step-other-delta"),
]


def _detached_at(where):
    def fn(u, delta, A, B, C):
        deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
        deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
        deltaA = deltaA.detach() if where == "A_full" else deltaA
        x = torch.zeros_like(deltaA[:, :, 0])
        ys = []
        for i in range(u.shape[2]):
            a = deltaA[:, :, i].detach() if where == "step" else deltaA[:, :, i]
            x = a * x + deltaB_u[:, :, i]
            c = C[:, :, i].detach() if where == "C" else C[:, :, i]
            ys.append(torch.einsum("bdn,bn->bd", x.detach() if where == "h" else x, c))
        return torch.stack(ys, dim=-1)
    return fn


# A gradient cut inside the scan is named (probe BO: the reasons said only "not exp(Δ·A)").
NEGATIVE += [
    pytest.param(_detached_at("A_full"), "A_full is not exp(Δ·A) (it is deltaA.detach()", id="detached-A_full"),
    pytest.param(_detached_at("step"), "the state's multiplier is not exp(Δ·A) (it is getitem_1.detach(), a:",
                 id="detached-step-decay"),
    pytest.param(_detached_at("C"), ".detach(), c: the program cuts the gradient there", id="detached-C"),
    pytest.param(_detached_at("h"), "the readout is not a contraction of h_t with C_t (it is x_1.detach(), detach:",
                 id="detached-state-in-readout"),
]


def _loop_over(deltaA, deltaB_u, C):
    x = torch.zeros_like(deltaA[:, :, 0])
    ys = []
    for i in range(C.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=-1)


def checkpointed_loop_only(u, delta, A, B, C):
    """A checkpoint around the loop alone: exp(Δ·A) is the body's operand, computed by its caller."""
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    return torch.utils.checkpoint.checkpoint(_loop_over, deltaA, deltaB_u, C, use_reentrant=False)


# A decay the graph being proved receives is named as such (it said only "not exp(Δ·A)").
NEGATIVE += [
    pytest.param(checkpointed_loop_only, "A_full is not exp(Δ·A) (it is an input of the graph being proved, a "
                 "function argument or a checkpoint body's operand", id="checkpointed-loop-only"),
]


@pytest.mark.parametrize("fn, reason", NEGATIVE)
def test_near_miss_is_left_alone(fn, reason):
    args = make_inputs()
    cap, out = compile_and_run(fn, *args)
    assert counters["ssm"]["scan_loop"] == 0
    assert counters["ssm"]["discretization"] == 0
    assert torch.ops.ssm.selective_scan.default not in [n.target for n in cap.gm.graph.nodes]
    reasons = [m.reason for m in cap.ctx.misses if m.family == "scan_loop"]
    assert any(reason in r for r in reasons), reasons
    assert_close(out, fn(*args), TOL[torch.float32])


# --- match_discretization, the interface scan_assoc imports ---------------------------------

def _output_nodes(fn, *args):
    nodes = {}

    def backend(gm, example_inputs):
        nodes["out"] = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return nodes["out"]


def test_match_discretization_layouts():
    u, delta, A, B, _ = make_inputs()

    def hf(u, dt, A, B):
        Bt = B.transpose(1, 2)
        return torch.exp(A[None, :, None, :] * dt[:, :, :, None]), dt[..., None] * Bt[:, None].float() * u[..., None]

    a_full, b_full = _output_nodes(hf, u, delta, A, B)
    d = match_discretization(a_full, b_full, 2)
    assert not isinstance(d, str), d
    assert (d.u.node.name, d.delta.node.name, d.A.node.name, d.B.node.name) == ("l_u_", "l_dt_", "l_a_", "l_b_")
    assert d.a_roles == d.b_roles == ("b", "d", "t", "n")
    assert d.B.roles == ("b", "n", "t") and d.B.perm_to("bnt") == (0, 1, 2)

    def minimal(u, delta, A, B):
        return (torch.exp(torch.einsum("bld,dn->bldn", delta, A)),
                torch.einsum("bld,bln,bld->bldn", delta, B, u))

    ut, dt, Bt = (t.transpose(1, 2) for t in (u, delta, B))
    d = match_discretization(*_output_nodes(minimal, ut, dt, A, Bt), (1, 1))
    assert not isinstance(d, str), d
    assert d.a_roles == ("b", "t", "d", "n") and d.u.perm_to("bdt") == (0, 2, 1)


def test_match_discretization_refusals():
    u, delta, A, B, _ = make_inputs()

    def swapped(u, delta, A, B):
        # A_full and B_full with their roles exchanged: not a discretisation.
        return _disc(u, delta, A, B)[::-1]

    assert "A_full is not exp" in match_discretization(*_output_nodes(swapped, u, delta, A, B), 2)

    # A caller that names B_full's state axis as its time axis must be refused.
    msg = match_discretization(*_output_nodes(_disc, u, delta, A, B), (2, 3))
    assert isinstance(msg, str) and "time axis" in msg


# --- the real model -------------------------------------------------------------------------

def test_hf_mamba_model_loop_branch():
    """Every layer of a tiny MambaForCausalLM (loop branch) is rewritten; logits match eager."""
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, intermediate_size=32,
                      time_step_rank=4, use_associative_scan=False)
    torch.manual_seed(0)
    model = MambaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 10))
    cap = PassCapture(*PASSES)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        out = torch.compile(model, backend=cap)(ids, use_cache=False).logits
    assert_rewritten(cap, loops=2)
    assert rel_err(out, ref) <= TOL[torch.float32]


# --- fx_utils -------------------------------------------------------------------------------

def test_normalized_graph_str_renumbers_by_kind():
    def fn(x, y):
        a = torch.exp(x) * y
        return torch.exp(a)[:, 0] + a.sum(-1)

    cap = {}

    def backend(gm, example_inputs):
        cap["gm"] = gm
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(torch.randn(3, 4), torch.randn(3, 4))
    assert_expected_inline(normalized_graph_str(cap["gm"], with_meta=True), """\
%L_x_ = placeholder  # float32[3, 4]
%L_y_ = placeholder  # float32[3, 4]
%exp_1 = torch.exp(%L_x_)  # float32[3, 4]
%mul_1 = operator.mul(%exp_1, %L_y_)  # float32[3, 4]
%exp_2 = torch.exp(%mul_1)  # float32[3, 4]
%getitem_1 = operator.getitem(%exp_2, (:, 0))  # float32[3]
%sum_1 = .sum(%mul_1, -1)  # float32[3]
%add_1 = operator.add(%getitem_1, %sum_1)  # float32[3]
return (%add_1,)
""")
