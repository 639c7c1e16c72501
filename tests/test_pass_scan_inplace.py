"""Parallel scans written as in-place updates of views (mamba.py's PScan style), family scan_assoc.

The scans here are Brent-Kung up-sweep/down-sweep scans over clones (or zero-padded copies) of
``exp(Δ·A)`` and ``Δ·B·u``, written two ways: with strided slices of the time axis, and with the
time axis split into pairs by ``view`` (as mamba.py does). The pass must prove them by what they
compute, rewrite them into ``ssm.selective_scan``, and leave alone, with a reason, in-place code
that is not the inclusive scan: a suffix scan, a missing level, a reset, a wrong combine.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch._dynamo.utils import counters
from utils import TOL, compile_with_passes, rel_err

from ssm_compile.compiler import SSMBackend, SSMOptions
from ssm_compile.passes import scan_assoc, scan_loop
from ssm_compile.passes.fx_utils import normalized_graph_str

BATCH, DIM, N = 2, 3, 4


def _up(A, X, T):
    # After the level with stride s, position 2s-1 (mod 2s) holds its block of 2s steps.
    s = 1
    while s < T:
        right, left = slice(2 * s - 1, T, 2 * s), slice(s - 1, T, 2 * s)
        X[:, :, right].add_(A[:, :, right] * X[:, :, left])
        A[:, :, right].mul_(A[:, :, left])
        s *= 2


def _down(A, X, T, skip_last=False):
    # Each block's middle gets the prefix that ends just before it.
    s = T // 4
    while s >= (2 if skip_last else 1):
        dst, src = slice(3 * s - 1, T, 2 * s), slice(2 * s - 1, T - s, 2 * s)
        X[:, :, dst].add_(A[:, :, dst] * X[:, :, src])
        A[:, :, dst].mul_(A[:, :, src])
        s //= 2


def _up_setitem(A, X, T):
    # The same up-sweep with augmented assignment on indexed views (a setitem in the graph).
    s = 1
    while s < T:
        right, left = slice(2 * s - 1, T, 2 * s), slice(s - 1, T, 2 * s)
        X[:, :, right] += A[:, :, right] * X[:, :, left]
        A[:, :, right] *= A[:, :, left]
        s *= 2


def _down_copied(A, X, T):
    # The down-sweep computed out of place, each level copied back into the buffers.
    s = T // 4
    while s >= 1:
        dst, src = slice(3 * s - 1, T, 2 * s), slice(2 * s - 1, T - s, 2 * s)
        X[:, :, dst].copy_(X[:, :, dst] + A[:, :, dst] * X[:, :, src])
        A[:, :, dst] = A[:, :, dst] * A[:, :, src]
        s //= 2


def _up_pairs(A, X, T):
    # mamba.py's spelling of the up-sweep: split time into pairs, update the odd half, recurse on it.
    b, d, _, n = X.shape
    while T > 1:
        Ap, Xp = A.view(b, d, T // 2, 2, n), X.view(b, d, T // 2, 2, n)
        Xp[:, :, :, 1].add_(Ap[:, :, :, 1].mul(Xp[:, :, :, 0]))
        Ap[:, :, :, 1].mul_(Ap[:, :, :, 0])
        A, X, T = Ap[:, :, :, 1], Xp[:, :, :, 1], T // 2


def _padded_copies(dA, BX):
    """(B, L, D, N) inputs as (B, D, T, N) copies, T the next power of two (zeros appended)."""
    L = dA.shape[1]
    T = 1 << (L - 1).bit_length()
    if T == L:
        A, X = dA.clone(), BX.clone()
    else:
        A, X = F.pad(dA, (0, 0, 0, 0, 0, T - L)), F.pad(BX, (0, 0, 0, 0, 0, T - L))
    return A.transpose(1, 2), X.transpose(1, 2), T


def _copies(x, delta, A, B):
    return _padded_copies(torch.exp(delta.unsqueeze(-1) * A), delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1))


def _readout(Xc, x, C, D):
    return (Xc.transpose(1, 2)[:, :x.shape[1]] @ C.unsqueeze(-1)).squeeze(-1) + D * x


def block(x, delta, A, B, C, D, sweep="slices", tamper=None, readout="matmul", last_state=False):
    """A mamba.py-style selective scan in (batch, L, dim) with an in-place parallel scan; the
    readout by matmul or by product and sum, optionally with the last state returned too."""
    L = x.shape[1]
    Ac, Xc, T = _copies(x, delta, A, B)
    {"slices": _up, "pairs": _up_pairs, "setitem": _up_setitem, "copied": _up}[sweep](Ac, Xc, T)
    if tamper == "reset":
        Xc[:, :, 2].zero_()
    if tamper == "assigned-reset":
        Xc[:, :, 2] = 0.0
    if tamper == "shifted-copy":
        Xc[:, :, 1:3] = Xc[:, :, 0:2].clone()
    if sweep == "copied":
        _down_copied(Ac, Xc, T)
    else:
        _down(Ac, Xc, T, skip_last=tamper == "missing-level")
    hs = Xc.transpose(1, 2)[:, :L]
    if tamper == "lagged":
        hs = torch.cat([torch.zeros_like(hs[:, :1]), hs[:, :-1]], dim=1)
    if tamper == "write-after-read":
        # contiguous() of a contiguous tensor is the tensor itself: the update below reaches h.
        hs = hs.contiguous()
        Xc[:, :, 3].mul_(Ac[:, :, 3])
    if readout == "matmul":
        y = (hs @ C.unsqueeze(-1)).squeeze(-1)
    else:
        y = (hs * C.unsqueeze(2)).sum(-1)
    return (y + D * x, hs[:, -1]) if last_state else y + D * x


def unsliced_block(x, delta, A, B, C, D):
    """Sweeps along axis 1 of the (batch, L, dim, N) clones themselves (L a power of two), and
    the readout of the clone itself: the states' other users are the sweeps."""
    Ac = torch.exp(delta.unsqueeze(-1) * A).clone()
    Xc = (delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)).clone()
    _up(Ac.transpose(1, 2), Xc.transpose(1, 2), x.shape[1])
    _down(Ac.transpose(1, 2), Xc.transpose(1, 2), x.shape[1])
    return (Xc @ C.unsqueeze(-1)).squeeze(-1) + D * x


def wrong_combine(x, delta, A, B, C, D):
    # Each right child adds its left sibling scaled by the *left* decay: not the recurrence.
    Ac, Xc, T = _copies(x, delta, A, B)
    s = 1
    while s < T:
        right, left = slice(2 * s - 1, T, 2 * s), slice(s - 1, T, 2 * s)
        Xc[:, :, right].add_(Ac[:, :, left] * Xc[:, :, left])
        Ac[:, :, right].mul_(Ac[:, :, left])
        s *= 2
    _down(Ac, Xc, T)
    return _readout(Xc, x, C, D)


def suffix_scan(x, delta, A, B, C, D):
    # The mirror image (h_t from the steps after t, as a reverse scan's backward uses).
    Ac, Xc, T = _copies(x, delta, A, B)
    s = 1
    while s < T:
        lo, hi = slice(0, T, 2 * s), slice(s, T, 2 * s)
        Xc[:, :, lo].add_(Ac[:, :, lo] * Xc[:, :, hi])
        Ac[:, :, lo].mul_(Ac[:, :, hi])
        s *= 2
    return _readout(Xc, x, C, D)


def copy_indexed(x, delta, A, B, C, D):
    # The first level's update goes through list indexing, which copies: in eager it changes
    # nothing, so the states are not the scan, and a proof that took it for a view would be wrong.
    Ac, Xc, T = _copies(x, delta, A, B)
    odd, even = list(range(1, T, 2)), slice(0, T, 2)
    Xc[:, :, odd].add_(Ac[:, :, 1::2] * Xc[:, :, even])
    _up(Ac, Xc, T)
    _down(Ac, Xc, T)
    return _readout(Xc, x, C, D)


def overlapping_sweeps(x, delta, A, B, C, D):
    # Hillis-Steele with each level in place: ``A[s:].mul_(A[:-s])`` reads what it writes. Torch
    # does not refuse this overlap for these strides, and eager then reads updated values.
    Ac, Xc, T = _copies(x, delta, A, B)
    s = 1
    while s < T:
        Xc[:, :, s:].add_(Ac[:, :, s:] * Xc[:, :, :-s])
        Ac[:, :, s:].mul_(Ac[:, :, :-s])
        s *= 2
    return _readout(Xc, x, C, D)


def make_inputs(L, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, L, DIM, generator=g)
    delta = torch.rand(BATCH, L, DIM, generator=g) * 0.5 + 0.05
    A = -torch.rand(DIM, N, generator=g) - 0.5
    B = torch.randn(BATCH, L, N, generator=g)
    C = torch.randn(BATCH, L, N, generator=g)
    D = torch.randn(DIM, generator=g)
    return tuple(t.to(dtype) for t in (x, delta, A, B, C, D))


def reference(*args):
    """The inputs' scan as a sequential fp64 loop: h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t."""
    x, delta, A, B, C, D = (t.double() for t in args)
    h = torch.zeros(x.shape[0], x.shape[2], A.shape[1], dtype=torch.float64)
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(delta[:, t, :, None] * A) * h + delta[:, t, :, None] * B[:, t, None, :] * x[:, t, :, None]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, dim=1) + D * x


def compile_and_run(fn, *args, **kwargs):
    records = []
    compiled = torch.compile(lambda *a: fn(*a, **kwargs),
                             backend=SSMBackend(SSMOptions(inductor=False), on_graph=records.append))
    with torch.no_grad():
        out = compiled(*args)
    return out, records


@pytest.mark.parametrize("sweep", ["slices", "pairs", "setitem", "copied"])
@pytest.mark.parametrize("L", [2, 8, 13, 32])
def test_in_place_scan_is_rewritten(sweep, L):
    args = make_inputs(L)
    out, records = compile_and_run(block, *args, sweep=sweep)
    assert counters["ssm"]["scan_assoc"] == 1, [m.reason for r in records for m in r.misses]
    assert counters["ssm"]["discretization"] == 1 and counters["ssm"]["readout"] == 1
    (rewrite,) = [r for r in records[0].rewrites if r.family == "scan_assoc"]
    assert rewrite.pattern == "parallel scan (in place)" and rewrite.decision["L"] == L
    # The buffers, the sweeps and the (batch, L, dim, N) states are gone from the graph.
    assert "add_" not in records[0].after and "selective_scan" in records[0].after
    assert rel_err(out, reference(*args)) <= TOL[torch.float32]
    # No stale account of the in-place updates as a loop.
    assert not [m for m in records[0].misses if m.family == "scan_loop"]


def _mamba_py_pscan(A, X):
    """mamba.py's in-place Blelloch scan along axis 2 of (batch, dim, L, N), L a power of two
    (its pscan.py, `pscan` without the autograd wrapper)."""
    Bs, Dd, L, _ = A.size()
    steps = int(math.log2(L))
    Aa, Xa = A, X
    for _ in range(steps - 2):
        T = Xa.size(2)
        Aa, Xa = Aa.view(Bs, Dd, T // 2, 2, -1), Xa.view(Bs, Dd, T // 2, 2, -1)
        Xa[:, :, :, 1].add_(Aa[:, :, :, 1].mul(Xa[:, :, :, 0]))
        Aa[:, :, :, 1].mul_(Aa[:, :, :, 0])
        Aa, Xa = Aa[:, :, :, 1], Xa[:, :, :, 1]
    Xa[:, :, 1].add_(Aa[:, :, 1].mul(Xa[:, :, 0]))
    Aa[:, :, 1].mul_(Aa[:, :, 0])
    Xa[:, :, 3].add_(Aa[:, :, 3].mul(Xa[:, :, 2] + Aa[:, :, 2].mul(Xa[:, :, 1])))
    Aa, Xa = A[:, :, 2 ** (steps - 2) - 1:L:2 ** (steps - 2)], X[:, :, 2 ** (steps - 2) - 1:L:2 ** (steps - 2)]
    Xa[:, :, 2].add_(Aa[:, :, 2].mul(Xa[:, :, 1]))
    Aa[:, :, 2].mul_(Aa[:, :, 1])
    for k in range(steps - 3, -1, -1):
        Aa, Xa = A[:, :, 2 ** k - 1:L:2 ** k], X[:, :, 2 ** k - 1:L:2 ** k]
        T = Xa.size(2)
        Aa, Xa = Aa.view(Bs, Dd, T // 2, 2, -1), Xa.view(Bs, Dd, T // 2, 2, -1)
        Xa[:, :, 1:, 0].add_(Aa[:, :, 1:, 0].mul(Xa[:, :, :-1, 1]))
        Aa[:, :, 1:, 0].mul_(Aa[:, :, :-1, 1])


def two_pscans(x, delta, A, B, C, D):
    """Two mamba.py scans in one graph (L = 8; its PScan clones, then transposes), the second
    with B and C swapped."""
    def scan(B, C):
        Ap = torch.exp(delta.unsqueeze(-1) * A).clone().transpose(2, 1)
        Xp = (delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)).clone().transpose(2, 1)
        _mamba_py_pscan(Ap, Xp)
        return (Xp.transpose(2, 1) @ C.unsqueeze(-1)).squeeze(3) + D * x
    return scan(B, C) + scan(C, B)


def test_two_in_place_scans_leave_no_loop_account():
    """scan_loop reads both sweeps' updates as loops and meets the same reason in each: one miss
    at the nodes of both. The first rewrite left it standing for both, and explain (and the CPU
    graph's cpp.simdlen=1, which a scan_loop miss turns on) kept it (probe BE, run 53)."""
    args = make_inputs(8)
    out, records = compile_and_run(two_pscans, *args)
    assert counters["ssm"]["scan_assoc"] == 2, [m.reason for r in records for m in r.misses]
    assert not [m for m in records[0].misses if m.family == "scan_loop"], records[0].misses
    x, delta, A, B, C, D = args
    ref = reference(*args) + reference(x, delta, A, C, B, D)
    assert rel_err(out, ref) <= TOL[torch.float32]


def test_scan_of_the_clone_itself():
    args = make_inputs(16)
    out, records = compile_and_run(unsliced_block, *args)
    assert counters["ssm"]["scan_assoc"] == 1, [m.reason for r in records for m in r.misses]
    assert rel_err(out, reference(*args)) <= TOL[torch.float32]


@pytest.mark.parametrize("readout", ["matmul", "mulsum"])
def test_last_state_and_product_readout(readout):
    """mamba.py returning ``hs[:, -1]`` beside y, and the readout as ``(hs * C).sum(-1)``."""
    args = make_inputs(13)
    (y, last), records = compile_and_run(block, *args, readout=readout, last_state=True)
    assert counters["ssm"]["scan_assoc"] == 1, [m.reason for r in records for m in r.misses]
    (rewrite,) = [r for r in records[0].rewrites if r.family == "scan_assoc"]
    assert rewrite.decision["last_state"]
    with torch.no_grad():
        ref_y, ref_last = block(*(a.double() for a in args), readout=readout, last_state=True)
    assert rel_err(y, ref_y) <= TOL[torch.float32] and rel_err(last, ref_last) <= TOL[torch.float32]


def test_through_inductor():
    args = make_inputs(16)
    with torch.no_grad():
        out = torch.compile(block, backend="ssm", fullgraph=True)(*args)
    assert counters["ssm"]["scan_assoc"] == 1
    assert rel_err(out, reference(*args)) <= TOL[torch.float32]


NEAR_MISSES = [
    pytest.param(block, {"tamper": "missing-level"}, "is not the inclusive scan", id="missing-level"),
    pytest.param(block, {"tamper": "reset"}, "writes the scan's buffers with", id="mid-sequence-reset"),
    pytest.param(block, {"tamper": "assigned-reset"}, "writes something else than the scan's own values",
                 id="assigned-reset"),
    pytest.param(block, {"tamper": "shifted-copy"}, "writes something else than the scan's own values",
                 id="shifted-copy"),
    pytest.param(block, {"tamper": "lagged"}, "read outside it through 2 values", id="lagged-states"),
    pytest.param(wrong_combine, {}, "exactly one multiplier copy and one offset copy", id="wrong-combine"),
    pytest.param(suffix_scan, {}, "is not the inclusive scan", id="suffix-scan"),
    pytest.param(copy_indexed, {}, "which copies", id="list-indexed-copy"),
    pytest.param(block, {"tamper": "write-after-read"}, "after they are read outside it", id="write-after-read"),
    pytest.param(overlapping_sweeps, {}, "reads positions of the scan's buffer that it also writes",
                 id="overlapping-in-place"),
]


@pytest.mark.parametrize("fn, kwargs, reason", NEAR_MISSES)
def test_near_miss_is_left_alone(fn, kwargs, reason):
    args = make_inputs(16)
    out, records = compile_and_run(fn, *args, **kwargs)
    assert counters["ssm"]["scan_assoc"] == 0
    reasons = [m.reason for r in records for m in r.misses if m.family == "scan_assoc"]
    assert any(reason in r for r in reasons), reasons
    with torch.no_grad():
        assert rel_err(out, fn(*args, **kwargs)) <= 1e-6


def pow2_block(x, delta, A, B, C, D):
    """Powers of two only, no padding: the sweeps' sizes follow L when dynamo makes it symbolic."""
    Ac = torch.exp(delta.unsqueeze(-1) * A).clone().transpose(1, 2)
    Xc = (delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)).clone().transpose(1, 2)
    _up_pairs(Ac, Xc, x.shape[1])
    _down(Ac, Xc, x.shape[1])
    return (Xc.transpose(1, 2) @ C.unsqueeze(-1)).squeeze(-1) + D * x


def test_symbolic_length_is_proved_at_the_lengths_its_guards_admit():
    """At a second length dynamo recompiles with a symbolic L. The sweeps are proved at every
    length the graph's guards admit; most of those guards are on the other inputs' length
    symbols, which dynamo found equal to the scan's (``shape_env.replace``), and read so they
    pin L to 32 (the pair views' ``L // 2`` even, down to one pair). They were once left out:
    33..63 were admitted too, the pair views failed there, and the scan was left alone."""
    records = []
    compiled = torch.compile(pow2_block, backend=SSMBackend(SSMOptions(inductor=False), on_graph=records.append))
    for L in (16, 32, 64):
        args = make_inputs(L)
        with torch.no_grad():
            out = compiled(*args)
        assert rel_err(out, reference(*args)) <= TOL[torch.float32]
    assert [[r.decision.get("proved_lengths") for r in g.rewrites if r.family == "scan_assoc"] for g in records] == [
        [None], [[32]], [[64]]], [m.reason for g in records for m in g.misses]


class ScanFunction(torch.autograd.Function):
    """The in-place scan with a hand-written backward (as mamba.py's PScan has): (B, L, D, N) in
    and out, states H_t = A_t H_{t-1} + X_t."""

    @staticmethod
    def forward(ctx, dA, BX):
        Ac, Xc, T = _padded_copies(dA, BX)
        _up(Ac, Xc, T)
        _down(Ac, Xc, T)
        H = Xc.transpose(1, 2)[:, :dA.shape[1]]
        ctx.save_for_backward(dA, H)
        return H

    @staticmethod
    def backward(ctx, grad):
        dA, H = ctx.saved_tensors
        # dX_t = g_t + A_{t+1} dX_{t+1}, walked backwards; dA_t = dX_t H_{t-1}.
        dX = torch.empty_like(grad)
        carry = torch.zeros_like(grad[:, 0])
        for t in reversed(range(grad.shape[1])):
            nxt = dA[:, t + 1] if t + 1 < grad.shape[1] else torch.zeros_like(carry)
            carry = grad[:, t] + nxt * carry
            dX[:, t] = carry
        prev = torch.cat([torch.zeros_like(H[:, :1]), H[:, :-1]], dim=1)
        return dX * prev, dX


def function_block(x, delta, A, B, C, D):
    H = ScanFunction.apply(torch.exp(delta.unsqueeze(-1) * A), delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1))
    return (H @ C.unsqueeze(-1)).squeeze(-1) + D * x


def test_scan_inside_autograd_function_is_left_alone_with_a_reason():
    """Under grad the Function stays a HOP holding the user's backward: no rewrite, a reason, and
    eager's forward and gradients."""
    args = [t.requires_grad_() for t in make_inputs(13)]
    records = []
    compiled = torch.compile(function_block, backend=SSMBackend(SSMOptions(inductor=False), on_graph=records.append))
    out = compiled(*args)
    ref = function_block(*args)
    assert rel_err(ref.detach(), reference(*args)) <= TOL[torch.float32]   # the Function is right
    assert rel_err(out, ref) <= 1e-6
    grad = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, args, grad), torch.autograd.grad(ref, args, grad), strict=True):
        assert rel_err(got, want) <= 1e-6
    assert counters["ssm"]["scan_assoc"] == 0
    reasons = [m.reason for r in records for m in r.misses if m.family == "scan_assoc"]
    assert any("inside a custom autograd.Function" in r for r in reasons), reasons
    # Without grad dynamo inlines the forward, and the scan is the op.
    with torch.no_grad():
        counters.clear()
        torch._dynamo.reset()
        out = torch.compile(function_block, backend=SSMBackend(SSMOptions(inductor=False)))(*args)
    assert counters["ssm"]["scan_assoc"] == 1
    assert rel_err(out, reference(*args)) <= TOL[torch.float32]


def test_snapshot_in_place_scan():
    """scan_loop and scan_assoc alone: the copies, sweeps and states give way to one op reading
    the sources in (batch, dim, L) views; the D skip stays for the tail pass."""
    with torch.no_grad():
        cap, _ = compile_with_passes(block, *make_inputs(12), passes=(scan_loop, scan_assoc))
    assert [(r.family, r.pattern) for r in cap.ctx.rewrites][0] == ("scan_assoc", "parallel scan (in place)")
    assert_expected_inline(normalized_graph_str(cap.gm), """\
%L_A_ = placeholder
%L_B_ = placeholder
%L_C_ = placeholder
%L_D_ = placeholder
%L_delta_ = placeholder
%L_x_ = placeholder
%permute_1 = .permute(%L_x_, (0, 2, 1))
%permute_2 = .permute(%L_delta_, (0, 2, 1))
%permute_3 = .permute(%L_C_, (0, 2, 1))
%permute_4 = .permute(%L_B_, (0, 2, 1))
%getitem_1 = operator.getitem(%permute_1, (:, :, 0))
%getitem_2 = operator.getitem(%permute_2, (:, :, 0))
%getitem_3 = operator.getitem(%permute_4, (:, None, :, 0))
%mul_1 = operator.mul(%getitem_2, %getitem_1)
%getitem_4 = operator.getitem(%mul_1, (:, :, None))
%mul_2 = operator.mul(%getitem_4, %getitem_3)
%getitem_5 = operator.getitem(%permute_2, (..., :1))
%zeros_like_1 = torch.zeros_like(%getitem_5)
%getitem_6 = operator.getitem(%permute_2, (..., 1:))
%cat_1 = torch.cat([%zeros_like_1, %getitem_6], -1)
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%permute_1, %cat_1, %L_A_, %permute_4, %permute_3, None, None, None, False, %mul_2, False)
%getitem_7 = operator.getitem(%selective_scan_1, 0)
%permute_5 = .permute(%getitem_7, (0, 2, 1))
%mul_3 = operator.mul(%L_D_, %L_x_)
%add_1 = operator.add(%permute_5, %mul_3)
return (%add_1,)
""")
