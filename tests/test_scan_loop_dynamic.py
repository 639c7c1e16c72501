"""``scan_loop`` under dynamic shapes: an unrolled loop next to tensors whose length is a symbol.

When dynamo recompiles at a second length (``dynamic=True``), ``range(u.shape[2])`` specialises
the length of the tensor the loop ranges over, but a tensor the loop only indexes (C; u, Δ and B
in code that discretises inside the loop) keeps a fresh symbol, known only to be long enough for
the indices read. Dynamo then reuses the graph for any longer such tensor, of which the loop reads
the first L steps: the op must read the same steps (through a narrowed view), and near-misses must
still be refused with an accurate reason.
"""

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from utils import TOL, rel_err

import ssm_compile
from ssm_compile.compiler import SSMBackend
from ssm_compile.config import SSMOptions
from ssm_compile.passes.scan_loop import _too_short

BATCH, DIM, N, L = 2, 6, 4, 8
pytestmark = [pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`"),
              pytest.mark.usefixtures("quiet_ssm_log")]


@pytest.fixture(scope="module", autouse=True)
def _ops():
    from ssm_compile.kernels.selective_scan import op

    op.register()


def inputs(length=L, extra=(0, 0, 0, 0), seed=0):
    """u, Δ, A, B, C in (batch, dim, L) / (batch, N, L), random; ``extra`` is how many steps Δ, B,
    C and u (in that order) have beyond ``length``."""
    g = torch.Generator().manual_seed(seed)
    e_delta, e_B, e_C, e_u = extra
    u = torch.randn(BATCH, DIM, length + e_u, generator=g)
    delta = torch.rand(BATCH, DIM, length + e_delta, generator=g) * 0.5 + 0.05
    A = -torch.rand(DIM, N, generator=g) - 0.5
    B = torch.randn(BATCH, N, length + e_B, generator=g)
    C = torch.randn(BATCH, N, length + e_C, generator=g)
    return u, delta, A, B, C


# --- user code: the loop ranges over u's length, and only indexes the other tensors -----------

def scan_ref(u, delta, A, B, C):
    """mamba_ssm ``selective_scan_ref``: A_full/B_full precomputed; C only indexed in the loop."""
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    x = A.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2)


def per_step(u, delta, A, B, C):
    """Discretised inside the loop: Δ, B and C are only indexed, each keeps its own symbol."""
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        dA = torch.exp(delta[:, :, t, None] * A)
        h = dA * h + delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=-1), h


def over_C(u, delta, A, B, C):
    """The loop ranges over C's length: A_full, B_full (and u, Δ, B) keep a symbolic one, so the
    steps are counted, not read off A_full."""
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(C.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2), x


def per_step_short(u, delta, A, B, C):
    """The loop stops two steps before u's end: every source is longer than the loop."""
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2] - 2):
        dA = torch.exp(delta[:, :, t, None] * A)
        h = dA * h + delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=-1), h


def _scan_with_readout(u, delta, A, B, C, readout):
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, readout(C, i)))
    return torch.stack(ys, dim=2)


# The time offsets are literals: an int from a closure would be a symbol under dynamic=True.
def C_ahead(u, delta, A, B, C):
    """The readout reads C at time t + 1."""
    return _scan_with_readout(u, delta, A, B, C, lambda C, i: C[:, :, i + 1])


def C_behind(u, delta, A, B, C):
    """The readout reads C at time t - 1 (C[:, :, -1] at step 0)."""
    return _scan_with_readout(u, delta, A, B, C, lambda C, i: C[:, :, i - 1])


def fixed_C(u, delta, A, B, C):
    """Every step reads C at time 0."""
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, 0]))
    return torch.stack(ys, dim=2)


# --- helpers ----------------------------------------------------------------------------------

def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def assert_like_eager(out, ref):
    for o, r in zip(as_tuple(out), as_tuple(ref), strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert rel_err(o, r.double()) < TOL[torch.float32]


def compile_dynamic(fn):
    """``fn`` compiled with ``dynamic=True`` through the ssm backend (eager graphs), and the list
    its per-graph records are appended to."""
    torch._dynamo.reset()
    counters.clear()
    records = []
    return torch.compile(fn, backend=SSMBackend(SSMOptions(inductor=False), on_graph=records.append),
                         dynamic=True), records


def scan_loop_reasons(record):
    return [m.reason for m in record.misses if m.family == "scan_loop"]


# --- tests ------------------------------------------------------------------------------------

@pytest.mark.usefixtures("no_opt_einsum")
@pytest.mark.parametrize("fn, extra", [
    pytest.param(scan_ref, (0, 0, 5, 0), id="ref-longer-C"),
    pytest.param(per_step, (2, 4, 5, 0), id="per-step-longer-delta-B-C"),
    pytest.param(over_C, (4, 4, 0, 4), id="over-C-longer-u-delta-B"),
])
def test_second_length_is_rewritten(fn, extra):
    """Both lengths become the op; then the second graph, reused for tensors longer than the
    loop, still matches eager (values and gradients): the op reads only the loop's steps."""
    cf, records = compile_dynamic(fn)
    # Every call's inputs require grad: dynamo guards on it, and the last call must hit graph 2.
    for length in (L, L + 3):
        args = [t.requires_grad_() for t in inputs(length)]
        assert_like_eager(cf(*args), fn(*args))
    assert counters["ssm"]["scan_loop"] == 2
    assert len(records) == 2 and scan_loop_reasons(records[1]) == []
    assert ".narrow(" in records[1].after and "selective_scan" in records[1].after

    args = [t.requires_grad_() for t in inputs(L + 3, extra, seed=1)]
    out, ref = as_tuple(cf(*args)), as_tuple(fn(*args))
    assert len(records) == 2, "longer indexed tensors must reuse the second graph"
    assert_like_eager(out, ref)
    grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, (1.0, 0.5))), args)
    ref_grads = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, (1.0, 0.5))), args)
    for name, g, r in zip("u delta A B C".split(), grads, ref_grads):
        assert rel_err(g, r.double()) < TOL[torch.float32], name


def test_loop_shorter_than_every_source():
    """range(u.shape[2] - 2) under a symbolic Δ/B/C length: the steps are counted, and all five
    sources (u included) reach the op narrowed to them."""
    cf, records = compile_dynamic(per_step_short)
    for length in (L, L + 3):
        args = inputs(length)
        assert_like_eager(cf(*args), per_step_short(*args))
    assert len(records) == 2
    assert scan_loop_reasons(records[1]) == [] and "selective_scan" in records[1].after
    assert records[1].rewrites[0].decision["L"] == L + 1
    assert records[1].after.count(".narrow(") == 4  # u, Δ, B, C


@pytest.mark.parametrize("fn, reason", [
    pytest.param(C_ahead, "C at time t+1 (lagged readout)", id="C-at-t+1"),
    pytest.param(C_behind, "counts from the end of a time axis of symbolic length", id="C-at-t-1"),
    pytest.param(fixed_C, "step 1's readout does not repeat step 0's", id="C-at-0"),
])
def test_near_miss_stays_refused(fn, reason):
    """C read at the wrong time: refused at both lengths (the second with C's length a symbol),
    with the reason recorded, and the graph runs as written."""
    cf, records = compile_dynamic(fn)
    for length in (L, L + 3):
        args = inputs(length, extra=(0, 0, 1, 0))
        assert_like_eager(cf(*args), fn(*args))
    assert counters["ssm"]["scan_loop"] == 0
    assert len(records) == 2 and "selective_scan" not in records[1].after
    assert any(reason in r for r in scan_loop_reasons(records[1])), scan_loop_reasons(records[1])


def test_explain_with_a_symbolic_C_length():
    """explain on one call, C's time axis marked dynamic (the recompiled graph in one step)."""
    u, delta, A, B, C = inputs()
    torch._dynamo.mark_dynamic(C, 2)
    report = ssm_compile.explain(scan_ref, u, delta, A, B, C)
    assert report.counts["scan_loop"] == 1
    assert not [m for m in report.misses if m.family == "scan_loop"]
    assert "[scan_loop]" in str(report)
    assert_like_eager(report.output, scan_ref(u, delta, A, B, C))

    report = ssm_compile.explain(C_behind, u, delta, A, B, C)
    assert report.counts["scan_loop"] == 0
    assert "counts from the end of a time axis of symbolic length" in str(report)


def test_length_check_adds_no_guard():
    """The length check decides from what the shape env already knows: a symbol only hinted to
    be long enough is refused (no guard is added that could specialise it), a provable one passes."""
    env = ShapeEnv()
    source = torch._dynamo.source.ConstantSource("C_len")
    length = env.create_symintnode(env.create_symbol(11, source), hint=11, source=source)
    assert "not provably at least the loop's length 11" in _too_short("C_full", length, 11)
    assert _too_short("C_full", length, 2) is None  # sizes are at least 2 unless specialised
    assert not env.guards
    assert _too_short("C_full", 12, 11) is None
    assert "(10) is not provably" in _too_short("C_full", 10, 11)
