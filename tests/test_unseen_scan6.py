"""Round 6 of the adversarial review, scan and tail side (run 47): the spellings and near-misses
that run 46 left with an imprecise reason or none. Each case either rewrites and matches an fp64
eager run (outputs and gradients), or is left alone with a reason that names the cause and gives
eager's result.

Recorded behaviour before this round:
- ``zip(dA.unbind(2), dBu.unbind(2), C.unbind(1))`` with a C shorter than the others (zip stops at
  C): left alone with "step 6 does not repeat step 0 ... dA is read there or as a whole".
- An associative_scan or stacked-states readout that keeps the summed axis (``sum(-1,
  keepdim=True)`` or ``h @ C[..., None]`` with no squeeze): left alone with "neither a readout
  Σ_n h·C nor the last state".
- No reason at all for a gate ``z * sigmoid(z).detach()`` or ``z.detach() * sigmoid(z)``, a gate
  or a Δ softplus passed through a custom autograd.Function, and a gate of ``y - r`` or ``r - y``.
- "the readout's C_t is not a time slice of one tensor" for mamba_ssm's ``selective_scan_ref``
  with a time-invariant (dim, N) C (rewritten since run 48: ``test_time_invariant_BC.py``).
- (Probe AD) ``associative_scan`` over ``(dA[:, :, :k], dBu[:, :, :k])``: left alone with "A_full
  is not exp(Δ·A)". A state updated in place and then ``tanh_()``-ed, ``clamp_()``-ed or
  ``zero_()``-ed: explained as a Mamba-2 per-head decay. A ``range(1, L)`` loop after a first step
  written out: "decay a_t is not a time slice of exp(Δ·A)", or no reason with a tanh or clamp.
  A near-miss met at every step: one equal line per step.
"""
import pytest
import torch
import torch.nn.functional as F

from ssm_compile.compiler import backend
from ssm_compile.report import explain
from test_unseen_scan5 import (B_, D_, N_, _assoc_states, _check_rewritten_and_exact, _HalfGrad, assert_matches_eager,
                               inputs, loop,
                               mul_sum)


def _with_C_length(args, length):
    """``args`` with C cut to its first ``length`` steps (a new leaf)."""
    u, delta, A, B, C = args
    return [u, delta, A, B, C.detach()[..., :length].clone().requires_grad_()]


def zip_precomputed(u, delta, A, B, C):
    dA = torch.exp(delta[..., None] * A[:, None, :])
    dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
    h = u.new_zeros(B_, D_, N_)
    ys = []
    for a_t, bu_t, c_t in zip(dA.unbind(2), dBu.unbind(2), C.unbind(-1)):
        h = a_t * h + bu_t
        ys.append(mul_sum(h, c_t))
    return torch.stack(ys, -1)


def zip_per_step(u, delta, A, B, C):
    h = u.new_zeros(B_, D_, N_)
    ys = []
    for u_t, d_t, b_t, c_t in zip(u.unbind(-1), delta.unbind(-1), B.unbind(-1), C.unbind(-1)):
        h = torch.exp(d_t[..., None] * A) * h + (d_t * u_t)[..., None] * b_t[:, None]
        ys.append(mul_sum(h, c_t))
    return torch.stack(ys, -1)


@pytest.mark.parametrize("c_length", [6, 3])
@pytest.mark.parametrize("fn", [zip_precomputed, zip_per_step], ids=lambda f: f.__name__)
def test_zip_stops_at_a_shorter_C(fn, c_length):
    """The loop runs as many steps as C has: the op scans u, Δ and B's first ``c_length``."""
    args = _with_C_length(inputs(), c_length)
    _check_rewritten_and_exact(fn, args)
    assert fn(*args).shape[-1] == c_length


def test_unbind_item_read_after_the_loop_is_never_wrong():
    """Six steps over the unbound decay, and its item 7 read afterwards: not a prefix loop (a
    later step is read), so it is left alone and gives eager's result."""
    def fn(u, delta, A, B, C):
        dA = torch.exp(delta[..., None] * A[:, None, :])
        dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
        items = dA.unbind(2)
        h = u.new_zeros(B_, D_, N_)
        ys = []
        for t in range(6):
            h = items[t] * h + dBu[:, :, t]
            ys.append(mul_sum(h, C[:, :, t]))
        return torch.stack(ys, -1) + items[7].sum(-1, keepdim=True)

    report = _check_left_alone_and_exact(fn, inputs())
    assert report.counts.get("scan_loop") is None
    assert any("dA is read there or as a whole" in m.reason for m in report.misses), report.format(graphs=False)


def _check_left_alone_and_exact(fn, args):
    """``explain(fn, *args)``, whose output (the compiled one) is eager's, values and gradients."""
    report = explain(fn, *args)
    assert_matches_eager(report.output, fn, args, tol=(1e-12, 1e-12), grad_tol=(1e-12, 1e-12))
    return report


# --- readouts that keep a size-1 axis -----------------------------------------------------------

def _assoc_readout(expr):
    def fn(u, delta, A, B, C):
        return expr(_assoc_states(u, delta, A, B), C.transpose(1, 2))
    return fn


KEPT_AXIS_READOUTS = {
    "keepdim": lambda h, c: (h * c[:, None]).sum(-1, keepdim=True),
    "keepdim_then_transpose": lambda h, c: (h * c[:, None]).sum(-1, keepdim=True).transpose(1, 2),
    "matmul_column": lambda h, c: h[..., None, :] @ c[:, None, :, :, None],
    "leading_unit_axis": lambda h, c: (h[None] * c[None, :, None]).sum(-1),
    "middle_unit_axis": lambda h, c: (h[:, :, None] * c[:, None, None]).sum(-1, keepdim=True),
}


@pytest.mark.parametrize("name", list(KEPT_AXIS_READOUTS))
def test_associative_scan_readout_keeping_a_unit_axis_is_rewritten(name):
    fn = _assoc_readout(KEPT_AXIS_READOUTS[name])
    args = inputs()
    _check_rewritten_and_exact(fn, args, family="scan_assoc")
    assert 1 in fn(*args).shape


def test_stacked_states_read_by_a_matmul_column_are_rewritten():
    """mamba.py's ``hs @ C[..., None]`` with no squeeze: y keeps its trailing size-1 axis."""
    def fn(u, delta, A, B, C):
        h = u.new_zeros(B_, D_, N_)
        hs = []
        for t in range(u.shape[-1]):
            h = torch.exp(delta[:, :, t, None] * A) * h + (delta[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
            hs.append(h)
        return torch.stack(hs, 1) @ C.transpose(1, 2)[:, :, :, None]

    _check_rewritten_and_exact(fn, inputs())


def test_readout_broadcast_along_a_wider_axis_of_C_is_left_alone():
    """C broadcast along an axis of size 2 of its own is two readouts, not one with a kept axis."""
    def fn(u, delta, A, B, C):
        C2 = torch.stack([C, 2 * C], 1).permute(0, 3, 1, 2)  # (batch, L, 2, N)
        return (_assoc_states(u, delta, A, B)[:, :, :, None] * C2[:, None]).sum(-1)

    assert not _check_left_alone_and_exact(fn, inputs()).counts


# --- near-misses of the tail and Δ folds, with the reason ---------------------------------------

def _gated(gate):
    def fn(u, delta, A, B, C):
        y = loop(u, delta, A, B, C, mul_sum)
        return gate(y, u * 0.7 - 0.2, u)
    return fn


NEAR_MISS_GATES = {
    "sigmoid_detached": (lambda y, z, r: y * (z * torch.sigmoid(z).detach()), "with a detached factor"),
    "z_detached": (lambda y, z, r: y * (z.detach() * torch.sigmoid(z)), "with a detached factor"),
    "autograd_function": (lambda y, z, r: y * _HalfGrad.apply(F.silu(z)), "autograd_function_apply of silu(z)"),
    "y_minus_r": (lambda y, z, r: (y - r) * F.silu(z), "= y - "),
    "r_minus_y": (lambda y, z, r: (r - y) * F.silu(z), " - y, not y"),
}


@pytest.mark.parametrize("name", list(NEAR_MISS_GATES))
def test_gate_near_miss_is_left_alone_with_a_reason(name):
    gate, words = NEAR_MISS_GATES[name]
    report = _check_rewritten_and_exact(_gated(gate), inputs())
    assert report.counts.get("scan_loop") == 1 and report.counts.get("gate") is None
    reasons = [m.reason for m in report.misses if m.family == "gate"]
    assert len(reasons) == 1 and words in reasons[0], report.format(graphs=False)


def test_softplus_through_an_autograd_function_is_not_folded():
    """Δ = _HalfGrad(softplus(x)): the op's softplus would bring its own backward, without the
    halving; the scan is still rewritten, with the user's Δ, and the gradients keep the halving."""
    def fn(u, x, A, B, C):
        return loop(u, _HalfGrad.apply(F.softplus(x)), A, B, C, mul_sum)

    report = _check_rewritten_and_exact(fn, inputs())
    assert report.counts.get("delta") is None
    reasons = [m.reason for m in report.misses if m.family == "delta"]
    assert len(reasons) == 1 and "autograd_function_apply of the softplus" in reasons[0], report.format(graphs=False)


# --- run 47's probe AD: the five named near-misses crossed with the scan spellings -------------

def _disc(u, delta, A, B):
    """The precomputed (batch, dim, L, N) decay and input term."""
    return torch.exp(delta[..., None] * A[:, None, :]), (delta * u)[..., None] * B.transpose(1, 2)[:, None]


def _combine(x, y):
    return x[0] * y[0], y[0] * x[1] + y[1]


def _assoc_over(slicer):
    def fn(u, delta, A, B, C):
        from torch._higher_order_ops.associative_scan import associative_scan

        dA, dBu = _disc(u, delta, A, B)
        hs = associative_scan(_combine, (slicer(dA), slicer(dBu)), dim=2, combine_mode="generic")[1]
        return torch.einsum("bdln,bnl->bdl", hs, slicer(C))
    return fn


@pytest.mark.parametrize("slicer", [lambda x: x[:, :, :6], lambda x: x.narrow(2, 0, 5), lambda x: x[:, :, :4]],
                         ids=["getitem", "narrow", "half"])
def test_associative_scan_over_a_time_prefix_is_rewritten(slicer):
    """``associative_scan`` over ``(dA[:, :, :k], dBu[:, :, :k])``: the scan of u, Δ and B's first
    k steps. It was left alone with "A_full is not exp(Δ·A)"."""
    _check_rewritten_and_exact(_assoc_over(slicer), inputs(), family="scan_assoc")


def test_associative_scan_over_a_time_suffix_is_left_alone_with_a_reason():
    report = _check_left_alone_and_exact(_assoc_over(lambda x: x[:, :, 2:]), inputs())
    assert any("not a prefix of its time axis" in m.reason for m in report.misses), report.format(graphs=False)
    assert not report.counts


def _inplace_loop(after):
    """The loop updating a state the graph allocated in place, then ``after(h, t)`` on it."""
    def fn(u, delta, A, B, C):
        dA, dBu = _disc(u, delta, A, B)
        h = torch.zeros(B_, D_, N_, dtype=u.dtype)
        ys = []
        for t in range(u.shape[-1]):
            h.mul_(dA[:, :, t]).add_(dBu[:, :, t])
            after(h, t)
            ys.append((h * C[:, None, :, t]).sum(-1))
        return torch.stack(ys, -1)
    return fn


IN_PLACE_NEAR_MISSES = {
    "tanh_": (lambda h, t: h.tanh_(), "not linear in the previous state"),
    "clamp_": (lambda h, t: h.clamp_(-0.5, 0.5), "not an elementwise add/mul (clamp)"),
    "zero_at_4": (lambda h, t: h.zero_() if t == 4 else None, "state reset"),
    "fill_at_4": (lambda h, t: h.fill_(0.25) if t == 4 else None, "state reset"),
}


@pytest.mark.parametrize("name", list(IN_PLACE_NEAR_MISSES))
def test_in_place_nonlinear_update_or_reset_is_named(name):
    """Written in place, these were explained as a Mamba-2 per-head decay by the decode pass."""
    after, words = IN_PLACE_NEAR_MISSES[name]
    fn = _inplace_loop(after)
    args = [a.detach() for a in inputs()]
    report = explain(fn, *args)
    reasons = [m.reason for m in report.misses]
    assert not report.rewrites and any(words in r for r in reasons), report.format(graphs=False)
    assert not any("Mamba-2" in r for r in reasons), report.format(graphs=False)
    torch.testing.assert_close(report.output, fn(*args), rtol=0, atol=0)


def test_in_place_control_is_rewritten():
    fn = _inplace_loop(lambda h, t: None)
    args = [a.detach() for a in inputs()]
    report = explain(fn, *args)
    assert report.counts.get("scan_loop") == 1
    torch.testing.assert_close(report.output, fn(*args), rtol=1e-12, atol=1e-12)


def scan_on_callers_state(u, delta, A, B, C, h0):
    dA, dBu = _disc(u, delta, A, B)
    h = h0
    ys = []
    for t in range(u.shape[-1]):
        h.mul_(dA[:, :, t]).add_(dBu[:, :, t])
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, -1)


def test_loop_on_the_callers_state_in_place_gets_a_reason():
    """The caller's h0 updated in place at every step is left as written (the caller reads the
    final state from it); the only reasons were the decode pass's, which pointed at the scan
    passes, which said nothing (probe BF, run 53)."""
    args = [a.detach() for a in inputs()]
    h0 = torch.randn(B_, D_, N_, dtype=args[0].dtype)
    ref_h0, got_h0 = h0.clone(), h0.clone()
    ref = scan_on_callers_state(*args, ref_h0)
    report = explain(scan_on_callers_state, *args, got_h0)
    assert not report.counts["scan_loop"]
    reasons = [m.reason for m in report.misses if m.family == "scan_loop"]
    assert any("the state is the caller's tensor" in r and ".clone()" in r for r in reasons), report.format(graphs=False)
    torch.testing.assert_close(report.output, ref, rtol=0, atol=0)
    torch.testing.assert_close(got_h0, ref_h0, rtol=0, atol=0)


def test_transposed_state_is_named_as_written():
    """h = dA * h.mT + dBu (dim == N) is refused; the reason named FX's ``getattr``, not ``.mT``."""
    def fn(u, delta, A, B, C):
        h = u.new_zeros(B_, D_, D_)
        ys = []
        for t in range(u.shape[-1]):
            dt = delta[:, :, t, None]
            h = torch.exp(dt * A[:, :1]) * h.mT + dt * B[:, None, :1, t] * u[:, :, t, None]
            ys.append((h * C[:, None, :1, t]).sum(-1))
        return torch.stack(ys, -1)

    report = _check_left_alone_and_exact(fn, inputs())
    reasons = [m.reason for m in report.misses if m.family == "scan_loop"]
    assert any("not an elementwise add/mul (.mT)" in r for r in reasons), reasons
    assert not report.counts


def _late_start(update):
    """Step 0 written out before a ``range(1, L)`` loop that discretises in its step."""
    def fn(u, delta, A, B, C):
        h = delta[:, :, 0, None] * B[:, None, :, 0] * u[:, :, 0, None]
        ys = [torch.einsum("bdn,bn->bd", h, C[:, :, 0])]
        for t in range(1, u.shape[-1]):
            dt = delta[:, :, t, None]
            h = update(torch.exp(dt * A) * h + dt * B[:, None, :, t] * u[:, :, t, None])
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
        return torch.stack(ys, -1)
    return fn


@pytest.mark.parametrize("update, words", [
    (lambda h: h, "reads its inputs at time index 1, not 0 (a loop that starts late"),
    (torch.tanh, "not linear in the previous state"),
    (lambda h: h.clamp(-0.5, 0.5), "not an elementwise add/mul (clamp)"),
], ids=["linear", "tanh", "clamp"])
def test_loop_from_step_one_is_left_alone_with_a_reason(update, words):
    """The linear one was said to have a decay that "is not a time slice of exp(Δ·A)"; the
    nonlinear ones had no reason at all."""
    report = _check_left_alone_and_exact(_late_start(update), inputs())
    reasons = [m.reason for m in report.misses if m.family == "scan_loop"]
    assert len(reasons) == 1 and words in reasons[0], report.format(graphs=False)
    assert not report.counts


def _lagged_input(name):
    """The input term reads one operand a step late, clamped at 0 (``B[:, max(t - 1, 0)]``), while
    the decay reads step t: steps 1.. repeat each other, step 0 does not."""
    def fn(u, delta, A, B, C):
        h = u.new_zeros(B_, D_, N_)
        ys = []
        for t in range(u.shape[-1]):
            at = {k: (max(t - 1, 0) if k == name else t) for k in ("delta", "B", "u")}
            dBu = delta[:, :, at["delta"], None] * B[:, None, :, at["B"]] * u[:, :, at["u"], None]
            h = torch.exp(delta[:, :, t, None] * A) * h + dBu
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
        return torch.stack(ys, -1)
    return fn


@pytest.mark.parametrize("name", ["delta", "B", "u"])
def test_input_term_one_step_late_is_named_a_lag(name):
    """Was "a loop that starts late ..., or a state reset": nothing starts late (probe BF, run 53)."""
    report = _check_left_alone_and_exact(_lagged_input(name), inputs())
    reasons = [m.reason for m in report.misses if m.family == "scan_loop"]
    assert any("input term reads time index 0 in the step whose decay reads time index 1" in r
               and "one lags the other" in r for r in reasons), report.format(graphs=False)
    assert not any("starts late" in r for r in reasons), reasons
    assert not report.counts


def test_a_near_miss_met_at_every_step_is_reported_once():
    """A stale ``dA[:, :, 0]`` read by every step was reported once per step (8 equal lines)."""
    def fn(u, delta, A, B, C):
        dA, dBu = _disc(u, delta, A, B)
        h = u.new_zeros(B_, D_, N_)
        ys = []
        for t in range(u.shape[-1]):
            h = dA[:, :, 0] * h + dBu[:, :, t]
            ys.append(mul_sum(h, C[:, :, t]))
        return torch.stack(ys, -1)

    report = _check_left_alone_and_exact(fn, inputs())
    keys = [(m.family, m.reason) for m in report.misses]
    assert report.misses and len(keys) == len(set(keys)), keys
    assert not report.counts


def test_reasons_in_the_passes_vocabulary_come_with_its_legend():
    """Reasons name the step's terms A_full / B_full (the pass's words, not the user's): the
    report says once per graph what they are (probe AC, run 47)."""
    def fn(u, delta, A, B, C):
        dA, dBu = _disc(u, delta, A, B)
        h = u.new_zeros(B_, D_, N_)
        ys = []
        for t in range(u.shape[-1]):
            h = dA[:, :, 0] * h + dBu[:, :, t]
            ys.append(mul_sum(h, C[:, :, t]))
        return torch.stack(ys, -1)

    text = explain(fn, *inputs()).format(graphs=False)
    assert "A_full[t=1]" in text and text.count("A_full, B_full: the decay exp(Δ·A)") == 1, text
    assert "A_full, B_full:" not in explain(_inplace_loop(lambda h, t: None), *inputs()).format(graphs=False)


@pytest.mark.parametrize("start, rewritten", [(0, True), (1, False)], ids=["prefix", "shifted"])
def test_prefix_loop_with_u_read_after_it(start, rewritten):
    """A loop over the first k = L - 2 steps and a skip on ``u[:, :, :k]`` after it: the skip
    reads no step past k, so the loop is a scan over the first k (run 46 left it alone, naming u
    as read past the prefix). ``u[:, :, 1:k + 1]`` reads step k, and the loop stays."""
    def fn(u, delta, A, B, C):
        k = u.shape[-1] - 2
        return loop(u, delta, A, B, C, mul_sum, steps=k) + u[:, :, start:start + k] * 0.5

    if rewritten:
        _check_rewritten_and_exact(fn, inputs())
    else:
        assert not _check_left_alone_and_exact(fn, inputs()).counts


def test_every_closed_form_scan_of_a_graph_is_accounted_for():
    """Two layers' ``exp(cumsum(Δ·A))`` scans: explain named only the first (probe AB, on HF's
    Mamba-2 models, one per mixer)."""
    def layer(u, delta, A, B, C):
        dA = delta[..., None] * A[:, None, :]
        dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
        P = torch.exp(torch.cumsum(dA, 2))
        return ((P * torch.cumsum(dBu / P, 2)) * C.transpose(1, 2)[:, None]).sum(-1)

    def fn(u, delta, A, B, C):
        return layer(layer(u, delta, A, B, C), delta, A, B, C)

    report = _check_left_alone_and_exact(fn, inputs())
    misses = [m for m in report.misses if "closed-form scan" in m.reason]
    assert len(misses) == 1 and len(misses[0].nodes) == 2, misses
    assert not report.counts


@pytest.mark.parametrize("refill", [lambda h: h.zero_(), lambda h: h.fill_(1.5)], ids=["zero_", "fill_"])
def test_refilling_a_tensor_with_history_keeps_its_history(refill):
    """``h.zero_()`` on a tensor that requires grad keeps a (zero) gradient path, which
    ``zeros_like`` would drop: the first version of the out-of-place refill made the output
    stop requiring grad, and ``backward()`` raise (probe AE)."""
    def fn(x):
        h = x * 2
        refill(h)
        return h

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend(inductor=False))(x)
    assert out.requires_grad
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.zeros_like(x))
    torch.testing.assert_close(out.detach(), fn(x).detach())
