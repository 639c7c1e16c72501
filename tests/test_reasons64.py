"""Run 64: four near-misses whose explain reason was missing or misleading (probe CS, run 63).

- Δ flipped inside the scan's step (``delta.flip(0)[:, :, t]``: every step flips Δ anew, or
  ``delta[:, :, t].flip(0)``): with an A (dim, 1) the loop got no reason at all (and so no
  ``cpp.simdlen=1`` guard), with an A (dim, N) a generic one; the reason now names the flip and
  the axis it reverses (batch, channels, time), read from A's axes.
- A per batch (``A[:, None, :]`` of an A (batch, 1) or (batch, N)) was refused as "B must be
  indexed by (batch, state, time), got ('d', 'n', 't')": the decay proof had taken A's axis for
  the channels. The reason now says that A varies along batch.
- dt_proj over ``dt.to(torch.bfloat16, copy=True)`` (a copy that changes the dtype, unlike the
  same-dtype copies x_dt_proj reads through) got no reason, or "to = .to of x_proj's first
  columns"; the reason now says the columns are copied or rounded to bf16.
- dt_proj over a piece of a cat that is not its leading columns (``torch.cat([B, dt], -1)[...,
  N:]``, ``cat(...)[..., R:2R]``) or along the batch or time axis got no reason; it now names the
  piece, the cat's axis and the operand it reads.

Each case's output (explain runs the rewritten graph) is checked against eager: bit for bit where
nothing is rewritten; where the Δ fold is (dt_proj's cases), against fp64 eager in values and
every input's gradient, or, over a bf16 copy whose rounding is the program's, against eager.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from utils import TOL, rel_err, scan_bdl

from ssm_compile.kernels.selective_scan.op import selective_scan_fn
from ssm_compile.report import explain

BATCH, DIM, L, N, R = 2, 5, 6, 4, 3
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


def _misses(report, family):
    return [m.reason for m in report.misses if m.family == family]


# --- Δ flipped in the step -----------------------------------------------------------------------

def _step_loop(decay_delta, input_delta, a_of=lambda A: A):
    """The discretisation in the step; ``decay_delta(delta, t)`` and ``input_delta(delta, t)`` are
    step t's Δ in exp(Δ·A) and in Δ·B·u, ``a_of(A)`` the A the decay reads."""
    def fn(u, dt, A_log, B, C):
        delta, A = F.softplus(dt), -torch.exp(A_log)
        h = u.new_zeros(u.shape[0], u.shape[1], B.shape[1])
        ys = []
        for t in range(u.shape[2]):
            h = (torch.exp(decay_delta(delta, t)[..., None] * a_of(A)) * h
                 + (input_delta(delta, t) * u[:, :, t])[..., None] * B[:, None, :, t])
            ys.append((h * C[:, None, :, t]).sum(-1))
        return torch.stack(ys, dim=-1)
    return fn


def _scan_args(a_shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, DIM, L, generator=g), torch.randn(BATCH, DIM, L, generator=g),
            torch.randn(*a_shape, generator=g), torch.randn(BATCH, N, L, generator=g),
            torch.randn(BATCH, N, L, generator=g))


def _plain(delta, t):
    return delta[:, :, t]


_ANEW = ("no state chain: step 1's exp(...) is not step 0's with every time index + 1: the step reads Δ as a time "
         "slice of Δ flipped along {}, a flip that no other step reads (each step flips Δ anew), and the scan pass "
         "compares the steps' slices only where they read one tensor, or one that every step recomputes by views, "
         "casts or elementwise ops, which a flip is not")
FLIPPED_IN_THE_STEP = {
    # case: (decay's Δ at t, input term's Δ at t, the reason)
    "batch_flip_in_the_decay": (lambda d, t: d.flip(0)[:, :, t], _plain, _ANEW.format("batch")),
    "batch_flip_in_both": (lambda d, t: d.flip(0)[:, :, t], lambda d, t: d.flip(0)[:, :, t],
                           _ANEW.format("batch")),
    "channel_flip": (lambda d, t: torch.flip(d, (1,))[:, :, t], _plain, _ANEW.format("channels")),
    "time_flip": (lambda d, t: d.flip(-1)[:, :, t], _plain, _ANEW.format("time")),
    # (The flip and the slice are Dynamo's nodes of step 0: flip and getitem on torch 2.13.)
    "batch_flip_of_the_slice": (lambda d, t: d[:, :, t].flip(0), _plain,
                                r"discretization: exactly one factor of exp\(Δ·A\) must be a time slice \(Δ\): Δ's "
                                r"step is \w+, the time slice \w+ flipped \(Δ flipped along batch\), and the pass "
                                "does not read a flipped time slice as a time slice"),
}


@pytest.mark.parametrize("a_shape", [(DIM, 1), (DIM, N)], ids=["A_dim_1", "A_dim_N"])
@pytest.mark.parametrize("case", list(FLIPPED_IN_THE_STEP))
def test_delta_flipped_in_the_step_names_the_flip(case, a_shape):
    decay_delta, input_delta, reason = FLIPPED_IN_THE_STEP[case]
    fn = _step_loop(decay_delta, input_delta)
    args = _scan_args(a_shape)
    report = explain(fn, *args)
    assert not report.rewrites, report.format(graphs=False)
    misses = _misses(report, "scan_loop")
    if case == "batch_flip_of_the_slice":
        assert len(misses) == 1 and re.fullmatch(reason, misses[0]), misses
    else:
        assert misses == [reason], misses
    # A recurrence left alone on the CPU: inductor would compile it with its vectorisation off.
    assert report.graphs[0].options["inductor_config"] == {"cpp.simdlen": 1}
    assert torch.equal(report.output, fn(*args))


# --- A per batch ---------------------------------------------------------------------------------

def _precomputed_loop(a_of):
    """exp(Δ·A) and Δ·B·u precomputed, (batch, dim, L, N), einsum readout; A read as ``a_of(A)``."""
    def fn(u, dt, A_log, B, C):
        delta, A = F.softplus(dt), -torch.exp(A_log)
        dA = torch.exp(delta[..., None] * a_of(A)[:, :, None, :])
        dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
        return scan_bdl(dA, dBu, u, B, C)
    return fn


_PER_BATCH = ("discretization: A varies along batch: the axis that A (shape {}) shares with Δ is B's batch axis (B "
              "read as the op's (batch, state, time) B), so each batch element has its own decay; "
              "ssm.selective_scan takes a (dim, N) A, one decay per channel and state, the same for every batch "
              "element (read as the channel axis instead, it would make B vary along the channels)")
PER_BATCH_A = {
    # case: (the loop, A's shape)
    "b1_in_the_step": (_step_loop(_plain, _plain, lambda A: A[:, None, :]), (BATCH, 1)),
    "bN_in_the_step": (_step_loop(_plain, _plain, lambda A: A.unsqueeze(1)), (BATCH, N)),
    "b_in_the_step": (_step_loop(_plain, _plain, lambda A: A[:, None, None]), (BATCH,)),
    "b1_precomputed": (_precomputed_loop(lambda A: A[:, None, :]), (BATCH, 1)),
    "bN_precomputed": (_precomputed_loop(lambda A: A[:, None, :]), (BATCH, N)),
}


@pytest.mark.parametrize("case", list(PER_BATCH_A))
def test_A_per_batch_says_A_varies_along_batch(case):
    fn, a_shape = PER_BATCH_A[case]
    args = _scan_args(a_shape)
    report = explain(fn, *args)
    assert "scan_loop" not in report.counts, report.format(graphs=False)
    assert _misses(report, "scan_loop") == [_PER_BATCH.format(a_shape)], report.format(graphs=False)
    assert torch.equal(report.output, fn(*args))


# --- dt_proj over a dtype-changing copy, or over a piece of a cat --------------------------------

def _dt_block(dt_of):
    """x_proj, split, ``dt_of(dt, B, W_dt, bias)`` (dt_proj's pre-activation), softplus, scan."""
    def fn(x, w_x, w_dt, bias, A):
        dt, B, C = F.linear(x, w_x).split([R, N, N], dim=-1)
        pre = dt_of(dt, B, w_dt, bias)
        return selective_scan_fn(x.transpose(1, 2), F.softplus(pre).transpose(1, 2), A, B.transpose(1, 2),
                                 C.transpose(1, 2))
    return fn


def _dt_args():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, L, DIM, generator=g), 0.3 * torch.randn(R + 2 * N, DIM, generator=g),
            torch.randn(DIM, R, generator=g), torch.randn(DIM, generator=g), -torch.rand(DIM, N, generator=g) - 0.5]


COPIES_TO_ANOTHER_DTYPE = {
    # case: (dt_proj's pre-activation, the reason's start)
    "bf16_copy_back_to_fp32": (lambda dt, w, b: F.linear(dt.to(torch.bfloat16, copy=True).float(), w, b),
                               "dt_proj reads x_proj's first columns rounded to torch.bfloat16 by to (a copy) and "
                               "cast to torch.float32, not the columns themselves: ssm.x_dt_proj computes the two "
                               "products back to back"),
    "bf16_copy_under_a_bf16_linear": (lambda dt, w, b: F.linear(dt.to(torch.bfloat16, copy=True), w.bfloat16(),
                                                                b.bfloat16()).float(),
                                      "dt_proj reads x_proj's first columns copied to torch.bfloat16, not the "
                                      "columns themselves"),
}


@pytest.mark.parametrize("case", list(COPIES_TO_ANOTHER_DTYPE))
def test_dt_proj_over_a_copy_to_another_dtype_says_so(case):
    dt_of, reason = COPIES_TO_ANOTHER_DTYPE[case]
    fn = _dt_block(lambda dt, B, w, b: dt_of(dt, w, b))
    args = _dt_args()
    report = explain(fn, *args)
    assert "x_dt_proj" not in report.counts
    misses = _misses(report, "x_dt_proj")
    assert len(misses) == 1 and misses[0].startswith(reason), misses
    # Against eager itself, which rounds dt to bf16 as the program does. Under a bf16 dt_proj the Δ
    # fold adds the bf16 bias inside the scan, which rounds otherwise (as test_x_dt_proj's "cast").
    tol = TOL[torch.bfloat16 if case == "bf16_copy_under_a_bf16_linear" else torch.float32]
    assert rel_err(report.output, fn(*args).double()) < tol


def _explain_against_eager(fn):
    """explain's report, its output and input gradients checked against fp64 eager."""
    leaves = [a.requires_grad_() for a in _dt_args()]
    report = explain(fn, *leaves)
    got = torch.autograd.grad(report.output.square().sum(), leaves)
    ref_leaves = [a.detach().double().requires_grad_() for a in leaves]
    want_out = fn(*ref_leaves)
    want = torch.autograd.grad(want_out.square().sum(), ref_leaves)
    assert rel_err(report.output, want_out) < TOL[torch.float32]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert rel_err(g, w) < TOL[torch.float32], i
    return report


def _cat_reason(where, part, how):
    return (f"dt_proj reads {where}, which are {part}: ssm.x_dt_proj computes dt from x_proj's first R columns, and "
            f"the pass reads them through a cat {how} (torch.cat([dt, B], -1)[..., :R]), so the two products stay "
            "as they are")


_LEADING = "only as its first R columns where its first operand is those R columns"
_COLUMNS_ONLY = "only along the last axis, as its first operand's columns"
CAT_PIECES = {
    # case: (dt_proj's input, the reason)
    "second_operand": (lambda dt, B: torch.cat([2.0 * dt, dt], -1)[..., R:2 * R],
                       _cat_reason("columns 3:6 of cat, a torch.cat along the last axis",
                                   "its operand 1 (dt = x_proj's first columns)", _LEADING)),
    "second_operand_scaled": (lambda dt, B: torch.cat([dt, dt * 2.0], -1)[..., R:2 * R],
                              _cat_reason("columns 3:6 of cat, a torch.cat along the last axis",
                                          "its operand 1 (mul = operator.mul of x_proj's first columns)", _LEADING)),
    "after_B_narrow": (lambda dt, B: torch.cat([B, dt], -1).narrow(-1, N, R),
                       _cat_reason("columns 4:7 of cat, a torch.cat along the last axis",
                                   "its operand 1 (dt = x_proj's first columns)", _LEADING)),
    "B_leading": (lambda dt, B: torch.cat([B, dt], -1)[..., :R],
                  _cat_reason("columns 0:3 of cat, a torch.cat along the last axis", "part of its operand 0 (B)",
                              _LEADING)),
    "along_batch": (lambda dt, B: torch.cat([dt, dt * 2.0], 0)[:BATCH],
                    _cat_reason("0:2 along the batch axis of cat, a torch.cat along the batch axis",
                                "its operand 0 (dt = x_proj's first columns)", _COLUMNS_ONLY)),
    "along_time_split": (lambda dt, B: torch.cat([dt * 2.0, dt], 1).split([L, L], 1)[1],
                         _cat_reason("6:12 along the time axis of cat, a torch.cat along the time axis",
                                     "its operand 1 (dt = x_proj's first columns)", _COLUMNS_ONLY)),
}


@pytest.mark.parametrize("case", list(CAT_PIECES))
def test_dt_proj_over_a_piece_of_a_cat_names_the_piece(case):
    dt_of, reason = CAT_PIECES[case]
    report = _explain_against_eager(_dt_block(lambda dt, B, w, b: F.linear(dt_of(dt, B), w, b)))
    assert "x_dt_proj" not in report.counts
    assert _misses(report, "x_dt_proj") == [reason]


def dt_columns_by_weight_size(x, wx, wdt, bdt, A):
    """mamba_inner_ref's functional style: the weights are arguments, dt's width is W_dt's."""
    rank, n = wdt.shape[1], A.shape[1]
    x_dbl = F.linear(x, wx)
    dt, B, C = x_dbl[..., :rank], x_dbl[..., rank:rank + n], x_dbl[..., rank + n:]
    return _scan_of(x, F.softplus(F.linear(dt, wdt) + bdt), A, B, C)


def dt_columns_of_the_input(x, wx, wdt, bdt, A):
    rank, n = wdt.shape[1], A.shape[1]
    x_dbl = F.linear(x, wx)
    B, C = x_dbl[..., rank:rank + n], x_dbl[..., rank + n:]
    return _scan_of(x, F.softplus(F.linear(x[..., :rank], wdt) + bdt), A, B, C)


def dt_columns_past_B_and_C(x, wx, wdt, bdt, A):
    rank, n = wdt.shape[1], A.shape[1]
    x_dbl = F.linear(x, wx)
    B, C, dt = x_dbl[..., :n], x_dbl[..., n:2 * n], x_dbl[..., 2 * n:]
    return _scan_of(x, F.softplus(F.linear(dt, wdt) + bdt), A, B, C)


def _scan_of(x, delta, A, B, C):
    return selective_scan_fn(x.transpose(1, 2), delta.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2))


SYMBOLIC = "up to a size known only when the graph runs"


@pytest.mark.parametrize("fn, says, not_says", [
    (dt_columns_by_weight_size, SYMBOLIC, None),
    # Probe CU: the symbolic-width reason was given for any piece with a symbolic bound.
    (dt_columns_of_the_input, "not a bias-free linear of x", SYMBOLIC),
    (dt_columns_past_B_and_C, None, SYMBOLIC),
], ids=["x_proj-columns", "input-columns", "columns-past-B-and-C"])
def test_dt_columns_of_symbolic_width_say_so(fn, says, not_says):
    # Under dynamic=True the plain-tensor weights' sizes are symbolic, so the columns dt_proj reads
    # end at a size known only at run time: the pass left x_proj and dt_proj alone with no reason
    # (probe CT, run 64).
    from ssm_compile.compiler import SSMBackend
    from ssm_compile.config import SSMOptions
    from ssm_compile.report import Report

    g = torch.Generator().manual_seed(5)
    dim, rank, n = 6, 2, 3
    args = (torch.randn(2, 9, dim, generator=g), torch.randn(rank + 2 * n, dim, generator=g) / dim ** 0.5,
            torch.randn(dim, rank, generator=g) / rank ** 0.5, torch.randn(dim, generator=g),
            -torch.rand(dim, n, generator=g) - 0.5)
    records = []
    compiled = torch.compile(fn, dynamic=True, backend=SSMBackend(SSMOptions(inductor=False), on_graph=records.append))
    torch.testing.assert_close(compiled(*args), fn(*args), rtol=1e-5, atol=1e-5)
    report = Report(graphs=records, graph_breaks={})
    text = report.format(graphs=False)
    assert not [r for r in report.rewrites if r.family == "x_dt_proj"], text
    reasons = [m.reason for m in report.misses if m.family == "x_dt_proj"]
    if says is not None:
        assert any(says in r for r in reasons), text
    if not_says is not None:
        assert not any(not_says in r for r in reasons), text
