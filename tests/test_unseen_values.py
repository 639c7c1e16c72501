"""Probes CB and CC (run 59): a decay shared across channels (rewritten since run 60), and
explain's reason for an associative_scan the op refuses; x_dt_proj's reason for an x_proj it does not compute is in
test_x_dt_proj.py, the associative_scan's first state in test_pass_scan_assoc.py."""
import pytest
import torch
import torch.nn.functional as F
from torch._higher_order_ops.associative_scan import associative_scan

import ssm_compile


def _reasons(fn, *args):
    torch._dynamo.reset()
    report = ssm_compile.explain(fn, *args)
    return report, [f"[{m.family}] {m.reason}" for m in report.misses]


def _a_shared_by_channels(u, dt, A_log, B, C):
    A = -torch.exp(A_log)  # (N,): one decay per state, the same for every channel
    deltaA = torch.exp(torch.einsum("bdl,n->bdln", dt, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", dt, B, u)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[0])
    ys = []
    for i in range(u.shape[2]):
        h = deltaA[:, :, i] * h + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]))
    return torch.stack(ys, dim=2)


def _a_shared_step_form(u, dt, A_log, B, C):
    A = -torch.exp(A_log)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[0])
    ys = []
    for i in range(u.shape[2]):
        h = torch.exp(dt[:, :, i, None] * A) * h + (dt[:, :, i] * u[:, :, i])[..., None] * B[:, None, :, i]
        ys.append((h * C[:, None, :, i]).sum(-1))
    return torch.stack(ys, dim=-1)


def _a_and_B_shared(u, dt, A_log, B, C):
    """A (N,) and B (N,): nothing in the step tells Δ's batch axis from its channel axis."""
    A = -torch.exp(A_log)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[0])
    ys = []
    for i in range(u.shape[2]):
        h = torch.exp(dt[:, :, i, None] * A) * h + (dt[:, :, i] * u[:, :, i])[..., None] * B[0, :, 0]
        ys.append((h * C[:, None, :, i]).sum(-1))
    return torch.stack(ys, dim=-1)


def _shared_args(batch=2, dim=6):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, dim, 5, generator=g), F.softplus(torch.randn(batch, dim, 5, generator=g)),
            (torch.randn(4, generator=g) * 0.5).requires_grad_(), torch.randn(batch, 4, 5, generator=g),
            torch.randn(batch, 4, 5, generator=g))


@pytest.mark.parametrize("fn", [_a_shared_by_channels, _a_shared_step_form], ids=["precomputed", "per-step"])
@pytest.mark.parametrize("batch, dim", [(2, 6), (6, 6)], ids=["b2-d6", "b6-d6"])
def test_a_decay_per_state_shared_by_the_channels_is_rewritten(fn, batch, dim):
    # A (N,) broadcast over the channels (probe CB): Δ's batch and channel axes are told apart by
    # u and B, so the op gets A as a (dim, N) view; A's gradient is the sum over channels. With
    # batch == dim, shapes cannot tell the axes apart and the proof does not use them.
    args = _shared_args(batch, dim)
    report, _ = _reasons(fn, *args)
    assert [r.family for r in report.rewrites].count("scan_loop") == 1, str(report)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(*args)
    ref = fn(*args)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(out, args[2], grad)[0], torch.autograd.grad(ref, args[2], grad)[0])


def test_a_and_B_shared_by_the_channels_is_left_alone_with_the_reason():
    args = _shared_args()
    report, reasons = _reasons(_a_and_B_shared, *args)
    assert not report.rewrites
    text = "\n".join(reasons)
    assert "nothing in the step tells Δ's batch axis from its channel axis" in text, text
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(_a_and_B_shared, backend="ssm")(*args), _a_and_B_shared(*args))


def _combine(left, right):
    return left[0] * right[0], right[0] * left[1] + right[1]


def _assoc(u, dt, A, B, C):
    dA = torch.exp(dt[..., None] * A[:, None, :])
    dBu = (dt * u)[..., None] * B.transpose(1, 2)[:, None]
    states = associative_scan(_combine, (dA, dBu), dim=2, combine_mode="generic")[1]
    return (states * C.transpose(1, 2)[:, None]).sum(-1)


@pytest.mark.parametrize("n", [300])
def test_a_scan_the_op_refuses_gets_that_reason_alone(n):
    # N beyond the op's range: the scan is recognised and refused; explain also said "no scan over
    # it was recognised" of its exp(Δ·A) (probe CC).
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(1, 2, 4, generator=g), torch.rand(1, 2, 4, generator=g),
            -torch.rand(2, n, generator=g), torch.randn(1, n, 4, generator=g), torch.randn(1, n, 4, generator=g))
    report, reasons = _reasons(_assoc, *args)
    assert not report.rewrites
    assert len(reasons) == 1 and reasons[0].startswith("[scan_assoc] ssm.selective_scan refused the inputs") \
        and "256" in reasons[0], reasons
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(_assoc, backend="ssm")(*args), _assoc(*args))


def test_sign_of_reads_signs_from_the_ops_only():
    from ssm_compile.passes.fx_utils import sign_of

    def f(x, a):
        return (F.softplus(x) / 2, -torch.exp(a.float()) * 3, x / x.abs(), (x * x).clamp(min=0),
                torch.sqrt(x) - torch.exp(x), -(a ** 2), x, F.relu(x) / -0.0, F.softplus(x).transpose(0, 1)[:1])

    gm = torch.fx.symbolic_trace(f)
    (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    # A placeholder's sign is unknown (0), and so is a division by anything but a non-zero number.
    assert [sign_of(o) for o in outputs] == [1, -1, 0, 1, 0, -1, 0, 0, 1]


def _softplus_written_then_scaled(u, x, A_log, B, C):
    s = F.softplus(x)
    s[:, :, 0] = -1.0  # a negative Δ at t = 0, written into softplus's output
    delta = s * 2.0  # a fresh tensor made after the write: no reader of delta sees it
    A = -torch.exp(A_log)
    dA = torch.exp(delta[..., None] * A[:, None, :])
    dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
    states = associative_scan(_combine, (dA, dBu), dim=2, combine_mode="generic")[1]
    return (states * C.transpose(1, 2)[:, None]).sum(-1)


def test_a_sign_is_not_read_from_an_op_whose_output_is_written():
    # Review of run 59: sign_of read softplus's sign through the write, the op started from a zero
    # state, and exp(Δ·A) at t = 0 = exp(+2194) gave NaN over every channel where eager is finite.
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g), torch.full((3, 4), 7.0),
            torch.randn(2, 4, 5, generator=g), torch.randn(2, 4, 5, generator=g))
    with torch.no_grad():
        report, _ = _reasons(_softplus_written_then_scaled, *args)
        assert any("first_state" in r.decision for r in report.rewrites if r.family == "scan_assoc"), report
        torch._dynamo.reset()
        want = _softplus_written_then_scaled(*args)
        got = torch.compile(_softplus_written_then_scaled, backend="ssm")(*args)
    assert want.isfinite().all() and got.isfinite().all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- probe CE (run 60): signs the ops do not show, and a skip's u written between two reads -----

def _assoc_scan(delta, A, u, B, C):
    dA = torch.exp(delta[..., None] * A[:, None, :])
    dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
    states = associative_scan(_combine, (dA, dBu), dim=2, combine_mode="generic")[1]
    return (states * C.transpose(1, 2)[:, None]).sum(-1)


def _negative_beta(u, x, y, A_log, B, C):
    return _assoc_scan(F.softplus(x, beta=-1.0), -torch.exp(A_log), u, B, C)


def _negative_beta_module(u, x, y, A_log, B, C):
    return _assoc_scan(torch.nn.Softplus(beta=-2.0)(x), -torch.exp(A_log), u, B, C)


def _clamp_max_below_min(u, x, y, A_log, B, C):
    # clamp(x, 0, -1) is -1 everywhere: torch applies max after min.
    return _assoc_scan(torch.clamp(y, 0.0, -1.0) * F.softplus(-x), -torch.exp(A_log), u, B, C)


def _cast_to_bool(u, x, y, A_log, B, C):
    # -exp(A_log) cast to bool is True: A = +0.5.
    return _assoc_scan(F.softplus(-x), (-torch.exp(A_log)).to(torch.bool).float() * 0.5, u, B, C)


@pytest.mark.parametrize("fn", [_negative_beta, _negative_beta_module, _clamp_max_below_min, _cast_to_bool],
                         ids=["softplus-beta<0", "nn.Softplus-beta<0", "clamp-max<min", "cast-to-bool"])
def test_a_sign_the_ops_do_not_show_keeps_the_scans_first_state(fn):
    # Each Δ·A is >= 0 somewhere, and at t = 0 large enough that exp(Δ·A) is inf: started from a
    # zero state the op gave NaN over whole channels where eager is finite.
    g = torch.Generator().manual_seed(3)
    u, x, y = (torch.randn(2, 4, 8, generator=g) for _ in range(3))
    x[..., 0] = -100.0 if fn in (_negative_beta, _negative_beta_module) else -300.0
    args = (u, x, y, torch.randn(4, 4, generator=g) * 0.3, torch.randn(2, 4, 8, generator=g),
            torch.randn(2, 4, 8, generator=g))
    if fn is _cast_to_bool:
        args[1][..., 0] = -300.0  # Δ0 = softplus(300) = 300, exp(150) = inf
    report, _ = _reasons(fn, *args)
    assert any(r.family == "scan_assoc" for r in report.rewrites), str(report)
    ref = fn(*args)
    assert torch.isfinite(ref).all()
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(*args)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def _overflowed_A(u, x, y, A_log, B, C):
    return _assoc_scan(F.softplus(x), -torch.exp(A_log), u, B, C)


def test_an_infinite_A_meeting_a_zero_delta_at_the_first_step():
    # Probe CI (run 61): A = -exp(90) = -inf and Δ0 = softplus(-120) = 0 exactly. The signs are
    # shown (Δ >= 0, A <= 0), so the op starts from a zero state; eager's first state is
    # Δ0·B0·u0 = 0, and the op's CPU path formed exp(0·-inf) = NaN over the whole channel.
    g = torch.Generator().manual_seed(1)
    u, x, y = (torch.randn(2, 3, 6, generator=g) for _ in range(3))
    x[..., 0] = -120.0
    A_log = torch.randn(3, 4, generator=g)
    A_log[0, 0] = 90.0
    args = [u, x, y, A_log, torch.randn(2, 4, 6, generator=g), torch.randn(2, 4, 6, generator=g)]
    report, _ = _reasons(_overflowed_A, *args)
    assert any(r.family == "scan_assoc" for r in report.rewrites), str(report)
    leaves = [a.clone().requires_grad_(i in (0, 4, 5)) for i, a in enumerate(args)]
    ref = _overflowed_A(*leaves)
    assert torch.isfinite(ref).all()
    torch._dynamo.reset()
    out = torch.compile(_overflowed_A, backend="ssm")(*leaves)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grads = torch.randn_like(ref)
    wrt = [leaves[i] for i in (0, 4, 5)]
    for got, want in zip(torch.autograd.grad(out, wrt, grads), torch.autograd.grad(ref, wrt, grads), strict=True):
        assert torch.isfinite(want).all()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _loop(u, delta, A, B, C):
    dA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
    dBu = torch.einsum("bld,bln,bld->bldn", delta, B, u)
    h = torch.zeros(u.shape[0], u.shape[2], A.shape[1])
    ys = []
    for i in range(u.shape[1]):
        h = dA[:, i] * h + dBu[:, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, i]))
    return torch.stack(ys, dim=1)


def _skip_u_scaled_after_the_scan(u_in, x, A_log, B, C, D):
    u = u_in * 1.0
    y = _loop(u.float(), F.softplus(x), -torch.exp(A_log), B, C)
    u.mul_(2.0)
    return y + u.transpose(1, 2).transpose(1, 2) * D


def _skip_u_slice_zeroed_after_the_scan(u_in, x, A_log, B, C, D):
    u = u_in * 1.0
    y = _loop(u.float(), F.softplus(x), -torch.exp(A_log), B, C)
    u[:, -1] = 0.0
    return y + u.mT.mT * D


@pytest.mark.parametrize("fn", [_skip_u_scaled_after_the_scan, _skip_u_slice_zeroed_after_the_scan],
                         ids=["mul_", "setitem"])
def test_a_skip_whose_u_is_written_between_the_two_reads_is_not_folded(fn):
    # The op's u is a cast copy made before the write, the skip's a view made after it: each is
    # read after it is made, and still the two values differ (probe CE).
    g = torch.Generator().manual_seed(4)
    args = (torch.randn(2, 8, 4, generator=g).bfloat16(), torch.randn(2, 8, 4, generator=g),
            torch.randn(4, 4, generator=g) * 0.3, torch.randn(2, 8, 4, generator=g),
            torch.randn(2, 8, 4, generator=g), torch.randn(4, generator=g))
    report, reasons = _reasons(fn, *args)
    assert not any(r.family == "skip" for r in report.rewrites), str(report)
    assert any("writes D or u in place after the op or the user's D·u first reads it" in r for r in reasons), reasons
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend="ssm")(*args), fn(*args))


# --- probe CG (run 60): a readout collected with a size-1 axis, squeezed after the stack ---------

def _squeezed_after_stack(u, dt, A, B, C, D, z):
    dA = torch.exp(torch.einsum("bld,dn->bldn", dt, A))
    dBu = torch.einsum("bld,bln,bld->bldn", dt, B, u)
    h = torch.zeros(u.shape[0], u.shape[2], A.shape[1])
    ys = []
    for i in range(u.shape[1]):
        h = dA[:, i] * h + dBu[:, i]
        ys.append(h @ C[:, i, :, None])
    y = torch.stack(ys, 1).squeeze(-1)
    return (y + u * D) * F.silu(z)


def _time_major_block_args():
    """(u, Δ, A, B, C, D, z) of a (batch, L, dim) block, random."""
    g = torch.Generator().manual_seed(5)
    b, L, d, n = 2, 7, 6, 4
    return (torch.randn(b, L, d, generator=g), F.softplus(torch.randn(b, L, d, generator=g)),
            -torch.rand(d, n, generator=g) - 0.5, torch.randn(b, L, n, generator=g), torch.randn(b, L, n, generator=g),
            torch.randn(d, generator=g), torch.randn(b, L, d, generator=g))


def test_skip_and_gate_fold_after_a_squeezed_stack():
    # The op's y comes back as y[..., None] for the stack's size-1 axis; the user's squeeze(-1)
    # undoes it, and the skip and gate after it are the op's (they were left unfolded, silently).
    args = _time_major_block_args()
    report, _ = _reasons(_squeezed_after_stack, *args)
    assert {"scan_loop", "skip", "gate"} <= {r.family for r in report.rewrites}, str(report)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(_squeezed_after_stack, backend="ssm")(*args), _squeezed_after_stack(*args))


# --- probe CF (run 60): a Mamba-1 whose projections run inside the loop -------------------------

class _ProjectionsInTheLoop(torch.nn.Module):
    def __init__(self, d=8, n=4, r=2):
        super().__init__()
        self.n, self.r = n, r
        self.A_log = torch.nn.Parameter(torch.log(torch.rand(d, n) * 3 + 0.5))
        self.x_proj = torch.nn.Linear(d, r + 2 * n, bias=False)
        self.dt_proj = torch.nn.Linear(r, d)

    def forward(self, u):
        A = -torch.exp(self.A_log)
        h = u.new_zeros(u.shape[0], u.shape[2], self.n)
        ys = []
        for t in range(u.shape[1]):
            x_t = u[:, t]
            dt, B, C = torch.split(self.x_proj(x_t), [self.r, self.n, self.n], dim=-1)
            delta = F.softplus(self.dt_proj(dt))
            h = torch.exp(delta.unsqueeze(-1) * A) * h + (delta * x_t).unsqueeze(-1) * B.unsqueeze(1)
            ys.append((h @ C.unsqueeze(-1)).squeeze(-1))
        return torch.stack(ys, 1)


def test_projections_inside_the_loop_get_a_reason():
    # Each step's Δ comes from x_proj and dt_proj of x[:, t], deeper than the step keys look: the
    # loop was left alone with no reason in explain (probe CF).
    torch.manual_seed(0)
    model, u = _ProjectionsInTheLoop(), torch.randn(2, 6, 8)
    report, reasons = _reasons(model, u)
    assert not report.rewrites
    assert any("computes its decay from values the pass does not read as time slices" in r for r in reasons), reasons
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(model, backend="ssm")(u), model(u))


# --- run 60: loops over reversed(range(L)) ---------------------------------------------------------

class _Bidirectional(torch.nn.Module):
    """A bidirectional Mamba-1 mixer in (batch, L, dim): one scan forward, one written as a loop
    over reversed(range(L)) with its own dt/B/C projection (Vim-style, but with no flip of the
    input), the two outputs summed, skip and gate after."""

    def __init__(self, d=6, n=4, r=2):
        super().__init__()
        self.n, self.r = n, r
        self.x_proj = torch.nn.ModuleList([torch.nn.Linear(d, r + 2 * n, bias=False) for _ in range(2)])
        self.dt_proj = torch.nn.ModuleList([torch.nn.Linear(r, d) for _ in range(2)])
        self.A_log = torch.nn.Parameter(torch.log(torch.rand(2, d, n) + 0.5))
        self.D = torch.nn.Parameter(torch.randn(d))

    def direction(self, u, k, backwards):
        dt, B, C = self.x_proj[k](u).split([self.r, self.n, self.n], dim=-1)
        delta = F.softplus(self.dt_proj[k](dt))
        dA = torch.exp(torch.einsum("bld,dn->bldn", delta, -torch.exp(self.A_log[k])))
        dBu = torch.einsum("bld,bln,bld->bldn", delta, B, u)
        h = u.new_zeros(u.shape[0], u.shape[2], self.n)
        ys = []
        steps = reversed(range(u.shape[1])) if backwards else range(u.shape[1])
        for t in steps:
            h = dA[:, t] * h + dBu[:, t]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
        return torch.stack(ys[::-1] if backwards else ys, dim=1), h

    def forward(self, u, z):
        y_fwd, _ = self.direction(u, 0, False)
        y_bwd, h_first = self.direction(u, 1, True)
        return (y_fwd + y_bwd + u * self.D) * F.silu(z), h_first


def test_a_bidirectional_block_rewrites_both_directions():
    torch.manual_seed(0)
    model = _Bidirectional()
    u, z = torch.randn(2, 7, 6, requires_grad=True), torch.randn(2, 7, 6)
    report, _ = _reasons(model, u, z)
    assert [r.family for r in report.rewrites].count("scan_loop") == 2, str(report)
    torch._dynamo.reset()
    out = torch.compile(model, backend="ssm")(u, z)
    ref = model(u, z)
    for o, r in zip(out, ref, strict=True):
        torch.testing.assert_close(o, r)
    grads = [torch.randn_like(r) for r in ref]
    params = [u, *model.parameters()]
    got = torch.autograd.grad(out, params, grads)
    want = torch.autograd.grad(ref, params, grads)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def _disc_bdl(u, dt, A, B):
    return torch.exp(torch.einsum("bdl,dn->bdln", dt, A)), torch.einsum("bdl,bnl,bdl->bdln", dt, B, u)


def _reverse_loop_over_a_written_tensor(u, delta, A, B, C):
    dA, dBu = _disc_bdl(u, delta, A, B)
    dBu[:, :, 0] *= 2.0  # written in place: its flip would be a copy taken at one point
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in reversed(range(u.shape[2])):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1)


def _shared_forward_and_backward(u, delta, A, B, C):
    # One dA read forward by one loop and backward by the next: the backward loop's pass over it
    # is flipped on its own (run 63: before, the forward reads kept every slice unflipped and the
    # backward loop was left alone), and both loops are rewritten.
    dA, dBu = _disc_bdl(u, delta, A, B)
    outs = []
    for steps in (range(u.shape[2]), reversed(range(u.shape[2]))):
        h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
        ys = []
        for t in steps:
            h = dA[:, :, t] * h + dBu[:, :, t]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
        outs.append(torch.stack(ys, dim=-1))
    return outs[0], outs[1]


@pytest.mark.parametrize("fn, scans", [(_reverse_loop_over_a_written_tensor, 0), (_shared_forward_and_backward, 2)],
                         ids=["written-in-place", "one-dA-both-ways"])
def test_reverse_loops_over_written_or_shared_tensors(fn, scans):
    g = torch.Generator().manual_seed(6)
    args = (torch.randn(2, 4, 6, generator=g), F.softplus(torch.randn(2, 4, 6, generator=g)),
            -torch.rand(4, 3, generator=g) - 0.5, torch.randn(2, 3, 6, generator=g), torch.randn(2, 3, 6, generator=g))
    report, reasons = _reasons(fn, *args)
    assert [r.family for r in report.rewrites].count("scan_loop") == scans, str(report)
    assert any("walks time backwards" in r for r in reasons) == (scans < 2), reasons
    torch._dynamo.reset()
    out, ref = torch.compile(fn, backend="ssm")(*args), fn(*args)
    for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        torch.testing.assert_close(o, r)


def _forward_over_double_flips(u, dt, A, B, C):
    dA, dBu = _disc_bdl(u, dt, A, B)
    dA, dBu = dA.flip(2).flip(2), dBu.flip(2).flip(-2)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1), h


def _reversed_over_flipped(u, dt, A, B, C):
    dA, dBu = _disc_bdl(u, dt, A, B)
    dA, dBu, C = dA.flip(2), dBu.flip(2), C.flip(2)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in reversed(range(u.shape[2])):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=-1), h


def _assoc_over_double_flips(u, dt, A, B, C):
    dA, dBu = _disc_bdl(u, dt, A, B)
    hs = associative_scan(_combine, (dA.flip(2).flip(2), dBu.flip(2).flip(2)), dim=2, combine_mode="generic")[1]
    return torch.einsum("bdln,bnl->bdl", hs, C), hs[:, :, -1]


@pytest.mark.parametrize("fn", [_forward_over_double_flips, _reversed_over_flipped, _assoc_over_double_flips],
                         ids=["loop-flip-flip", "reversed-loop-over-flips", "assoc-flip-flip"])
def test_two_flips_along_time_are_none(fn):
    # flip(flip(dA)) was read as one flip: the op scanned u, Δ and B backwards, off by ~7 (probe CH).
    g = torch.Generator().manual_seed(6)
    args = (torch.randn(2, 4, 6, generator=g), F.softplus(torch.randn(2, 4, 6, generator=g)),
            -torch.rand(4, 3, generator=g) - 0.5, torch.randn(2, 3, 6, generator=g), torch.randn(2, 3, 6, generator=g))
    report, _ = _reasons(fn, *args)
    assert {"scan_loop", "scan_assoc"} & {r.family for r in report.rewrites}, str(report)
    torch._dynamo.reset()
    out, ref = torch.compile(fn, backend="ssm")(*args), fn(*[a.double() for a in args])
    for o, r in zip(out, ref, strict=True):
        torch.testing.assert_close(o, r.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gate, name", [(lambda z: 2 * F.silu(z), "operator.mul"),
                                        (lambda z: F.silu(z) + 1, "operator.add")], ids=["2*silu(z)", "silu(z)+1"])
def test_a_gate_computed_from_silu_gets_a_reason(gate, name):
    # The op gates by silu(z) itself; a function of it is left as written, and explain now says so
    # (probe CG: no reason was given).
    def gated(u, dt, A, B, C, D, z):
        return (_loop(u, dt, A, B, C) + u * D) * gate(z)

    args = _time_major_block_args()
    report, reasons = _reasons(gated, *args)
    assert "gate" not in {r.family for r in report.rewrites}, str(report)
    assert any(f"= {name} of silu(z) and another value" in r for r in reasons), reasons
    torch.testing.assert_close(report.output, gated(*args))


# --- probe CI (run 61): the skip and gate after a reverse loop's outputs ----------------------

def _reverse_block(collect, tail, time_major):
    """A reverse loop collected last step first (into a buffer, or by ``insert(0)``), then the D
    skip and/or the z gate on the outputs in the loop's time order."""
    def fn(u, dt, A, B, C, z, D):
        if time_major:
            u, dt, z = (x.transpose(1, 2) for x in (u, dt, z))
        dA, dBu = _disc_bdl(u, dt, A, B)
        h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
        if collect == "buffer":
            y = u.new_empty(u.shape)
            for t in range(u.shape[2] - 1, -1, -1):
                h = dA[:, :, t] * h + dBu[:, :, t]
                y[:, :, t] = torch.einsum("bdn,bn->bd", h, C[:, :, t])
        else:
            ys = []
            for t in reversed(range(u.shape[2])):
                h = dA[:, :, t] * h + dBu[:, :, t]
                ys.insert(0, torch.einsum("bdn,bn->bd", h, C[:, :, t]))
            y = torch.stack(ys, dim=-1)
        if "skip" in tail:
            y = y + u * D[:, None]
        if "gate" in tail:
            y = y * F.silu(z)
        return y.transpose(1, 2) if time_major else y
    return fn


def _reverse_block_args(seed, time_major=False):
    """(u, Δ, A, B, C, z, D) for ``_reverse_block``, random; u, Δ, z (batch, L, dim) if time_major."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, 6, 4) if time_major else (2, 4, 6)
    return [torch.randn(shape, generator=g), F.softplus(torch.randn(shape, generator=g)),
            -torch.rand(4, 3, generator=g) - 0.5, torch.randn(2, 3, 6, generator=g), torch.randn(2, 3, 6, generator=g),
            torch.randn(shape, generator=g), torch.randn(4, generator=g)]


@pytest.mark.parametrize("collect, tail, time_major", [
    ("buffer", ("gate",), False), ("buffer", ("skip", "gate"), True),
    ("insert0", ("skip",), False), ("insert0", ("skip", "gate"), False)],
    ids=["buffer-gate", "buffer-skip-gate-time-major", "insert0-skip", "insert0-skip-gate"])
def test_skip_and_gate_after_a_reverse_loop_fold(collect, tail, time_major):
    # The op runs over flipped time and its y is flipped back; a skip or gate after that flip folds
    # with z read flipped (u already is). Before, the gate's reason named the backend's own flip
    # ("multiplies flip_6 (.flip of y), not y") and neither was folded.
    fn = _reverse_block(collect, tail, time_major)
    args = _reverse_block_args(8, time_major)
    report, _ = _reasons(fn, *args)
    families = [r.family for r in report.rewrites]
    assert "scan_loop" in families and all(f in families for f in tail), str(report)
    assert not [m for m in report.misses if m.family in ("skip", "gate")], str(report)
    leaves = [a.clone().requires_grad_() for a in args]
    ref = fn(*leaves)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(*leaves)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    wrt = [x for x in leaves if "skip" in tail or x is not leaves[-1]]
    wrt = [x for x in wrt if "gate" in tail or x is not leaves[5]]
    grads = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, wrt, grads), torch.autograd.grad(ref, wrt, grads), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _per_channel_B_with_shared_A(u, dt, A, B, C):
    dA = torch.exp(dt[..., None] * A)
    dBu = (dt * u)[..., None] * B.transpose(1, 2)[None]  # B (batch == dim, N, L) read per channel
    h = torch.zeros(dA.shape[0], dA.shape[1], dA.shape[3])
    ys = []
    for t in range(dA.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, -1)


def test_a_shared_A_whose_B_reads_the_channels_says_B_or_C():
    # Probe CI (run 61): with batch == dim, B read along the channels proves the reading that swaps
    # Δ's axes, and the reason blamed C alone, which is indexed as Mamba's.
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(3, 3, 5, generator=g), F.softplus(torch.randn(3, 3, 5, generator=g)),
            -torch.rand(2, generator=g) - 0.3, torch.randn(3, 2, 5, generator=g), torch.randn(3, 2, 5, generator=g))
    report, _ = _reasons(_per_channel_B_with_shared_A, *args)
    assert not report.rewrites, str(report)
    reasons = [m.reason for m in report.misses if m.family == "scan_loop"]
    assert any("C_t must be indexed by (batch, state)" in r and "B or C is not indexed as (batch, state)" in r
               for r in reasons), reasons
    torch._dynamo.reset()
    out = torch.compile(_per_channel_B_with_shared_A, backend="ssm")(*args)
    torch.testing.assert_close(out, _per_channel_B_with_shared_A(*args))


# --- probe CL (run 61): infinite or NaN A against tiny and zero Δ ----------------------------

def _loop_bdl(u, delta, A, B, C):
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = torch.exp(delta[:, :, i, None] * A) * h + (delta[:, :, i] * u[:, :, i])[..., None] * B[:, None, :, i]
        ys.append((h * C[:, None, :, i]).sum(-1))
    return torch.stack(ys, -1)


def _assoc_given_A(u, delta, A, B, C):
    # Δ and A as arguments: nothing shows Δ·A <= 0, so the op starts from h_-1 = B_full[0] with Δ0 = 0.
    dA = torch.exp(delta[..., None] * A[:, None, :])
    dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
    return (associative_scan(_combine, (dA, dBu), dim=2, combine_mode="generic")[1] * C.transpose(1, 2)[:, None]).sum(-1)


@pytest.mark.parametrize("fn, a, d0, dmid", [
    (_loop_bdl, -float("inf"), None, 1e-39), (_assoc_given_A, -float("inf"), None, 1e-39),
    (_assoc_given_A, float("inf"), 0.0, None), (_assoc_given_A, float("nan"), 0.0, None),
    (_loop_bdl, -float("inf"), None, 0.0), (_assoc_given_A, -float("inf"), None, 0.0)],
    ids=["loop--inf-tiny-delta", "assoc--inf-tiny-delta", "assoc-+inf-zero-delta0", "assoc-nan-zero-delta0",
         "loop--inf-zero-delta-mid", "assoc--inf-zero-delta-mid"])
def test_an_infinite_or_nan_A_keeps_eagers_values(fn, a, d0, dmid):
    # A = -inf with a tiny Δ (1e-39: softplus(-89.8)) decays to exp(-inf) = 0 in eager; a finite
    # stand-in for -inf on the CPU path gave exp(-1e-39 * 3.4e38) = 0.71. An A = +inf or NaN with
    # Δ0 = 0 on the h_-1 path formed exp(0 * inf) = NaN at t = 0, where eager's first state is
    # finite. Where eager is not finite, neither may the compiled value be: Δ = 0 mid-sequence with
    # A = -inf is NaN in eager from there on, and was silently finite (probe CN, run 62).
    g = torch.Generator().manual_seed(11)
    u, delta = torch.randn(2, 4, 8, generator=g), F.softplus(torch.randn(2, 4, 8, generator=g))
    A = -torch.rand(4, 3, generator=g) - 0.2
    A[0, 0] = a
    if d0 is not None:
        delta[..., 0] = d0
    if dmid is not None:
        delta[:, :, 4] = dmid
    args = (u, delta, A, torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g))
    ref = fn(*args)
    torch._dynamo.reset()
    report, _ = _reasons(fn, *args)
    assert report.rewrites, str(report)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(*args)
    assert torch.equal(out.isfinite(), ref.isfinite()), (out, ref)
    assert ref.isfinite().any()
    torch.testing.assert_close(out[ref.isfinite()], ref[ref.isfinite()], rtol=1e-5, atol=1e-5)


def _values_and_grads_match(fn, args):
    """Compiled ``fn`` equals eager on ``args``, and so do the gradients of every argument."""
    leaves = [a.clone().requires_grad_() for a in args]
    ref = fn(*leaves)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(*leaves)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grads = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, leaves, grads), torch.autograd.grad(ref, leaves, grads), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _reverse_loop_kept_in_loop_order(u, dt, A, B, C, z, D):
    # The outputs in the loop's own (reversed) order: the skip reads u flipped to that order.
    dA, dBu = _disc_bdl(u, dt, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in reversed(range(u.shape[2])):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return (torch.stack(ys, dim=-1) + u.flip(-1) * D[:, None]) * F.silu(z)


def _reverse_loop_skip_on_a_double_flip(u, dt, A, B, C, z, D):
    y = _reverse_block("insert0", (), False)(u, dt, A, B, C, z, D)
    return (y + u.flip(-1).flip(-1) * D[:, None]) * F.silu(z)


@pytest.mark.parametrize("fn", [_reverse_loop_kept_in_loop_order, _reverse_loop_skip_on_a_double_flip],
                         ids=["loop-order-u-flipped", "u-flipped-twice"])
def test_a_skip_on_the_same_flip_of_u_folds(fn):
    # Probe CL (run 61): the op's u is unreverse_loops' flip of u; the user's own u.flip(-1) (or
    # u.flip(-1).flip(-1), which is u) is the same value, and was called "not the scan's u".
    args = _reverse_block_args(9)
    report, _ = _reasons(fn, *args)
    families = [r.family for r in report.rewrites]
    assert "skip" in families and "gate" in families, str(report)
    _values_and_grads_match(fn, args)


def test_a_reverse_loops_outputs_read_twice_name_no_internal_node():
    # Probe CL (run 61): "y (flip_6) has other users besides the skip" named the rewrite's own flip.
    def fn(u, dt, A, B, C, z, D):
        y = _reverse_block("insert0", (), False)(u, dt, A, B, C, z, D)
        return y + u * D[:, None], y.sum()

    args = _reverse_block_args(4)
    report, _ = _reasons(fn, *args)
    reasons = [m.reason for m in report.misses if m.family == "skip"]
    assert reasons == ["y (the loop's outputs) has other users besides the skip"], str(report)
    torch._dynamo.reset()
    for o, r in zip(torch.compile(fn, backend="ssm")(*args), fn(*args), strict=True):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("skip, reason", [
    (lambda y, u, D: y - u * D[:, None], "sub subtracts D·u from y: the op adds D·u to y"),
    (lambda y, u, D: torch.add(y, u * D[:, None], alpha=2.0), "(its alpha=2.0), not y + D·u: the op adds D·u to y")],
    ids=["subtracted", "alpha"])
def test_a_reverse_loops_skip_of_another_form_says_so(skip, reason):
    # Probe CN (run 62): after a reverse loop the reasons compared the skip's u with the op's own
    # flip of it, so y - u·D and add(y, u·D, alpha=2) got none (a forward loop's did).
    def fn(u, dt, A, B, C, z, D):
        return skip(_reverse_block("buffer", (), False)(u, dt, A, B, C, z, D), u, D)

    args = _reverse_block_args(5)
    report, _ = _reasons(fn, *args)
    assert "scan_loop" in [r.family for r in report.rewrites], str(report)
    reasons = [m.reason for m in report.misses if m.family == "skip"]
    assert len(reasons) == 1 and reason in reasons[0], str(report)
    torch.testing.assert_close(report.output, fn(*args), rtol=1e-5, atol=1e-5)


def _reverse_loop_softplus_delta(u, dt, A, B, C, bias, D):
    # Δ = softplus(dt + bias) computed in the graph, read by a reverse loop with the D skip.
    return _reverse_block("insert0", ("skip",), False)(u, F.softplus(dt + bias[:, None]), A, B, C, None, D)


def test_a_reverse_loops_softplus_delta_folds_flipped():
    # Probe CO (run 62): the op's Δ is the softplus flipped along time; the fold looks through the
    # flip and hands the op the pre-activation flipped (it went unfolded, with no reason).
    g = torch.Generator().manual_seed(3)
    args = _reverse_block_args(6)
    args[5] = torch.randn(4, generator=g)  # the bias, in z's place
    args[1] = torch.randn(2, 4, 6, generator=g)  # dt before the bias and softplus
    report, _ = _reasons(_reverse_loop_softplus_delta, *args)
    folds = [r for r in report.rewrites if r.family == "delta"]
    assert len(folds) == 1 and folds[0].decision.get("time_flipped") is True, str(report)
    assert not [m for m in report.misses if m.family == "delta"], str(report)
    _values_and_grads_match(_reverse_loop_softplus_delta, args)


def _assoc_over_a_flipped_softplus(u, dt, A_log, B, C, bias, D):
    # The user's own Δ flipped along time: softplus, then flip, then an associative_scan.
    delta = F.softplus(dt + bias[:, None]).flip(-1)
    dA = torch.exp(delta[..., None] * -torch.exp(A_log)[:, None, :])
    dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
    h = associative_scan(_combine, (dA, dBu), dim=2, combine_mode="generic")[1]
    return (h * C.transpose(1, 2)[:, None]).sum(-1) + u * D[:, None]


def _reverse_loop_over_a_flipped_softplus(u, dt, A, B, C, bias, D):
    # A reverse loop over the user's flip of Δ: the op's Δ is that flip flipped again.
    return _reverse_block("insert0", ("skip",), False)(u, F.softplus(dt + bias[:, None]).flip(-1), A, B, C, None, D)


@pytest.mark.parametrize("fn, flipped", [(_assoc_over_a_flipped_softplus, True),
                                         (_reverse_loop_over_a_flipped_softplus, False)],
                         ids=["assoc-flipped-softplus", "reverse-loop-twice-flipped"])
def test_a_delta_flipped_by_the_user_folds(fn, flipped):
    # Probe CQ (run 62): a flip kept softplus's sign from the first-state proof (the op took a
    # copy of Δ with Δ0 = 0, and no fold), and two flips along time stopped the fold.
    g = torch.Generator().manual_seed(4)
    args = _reverse_block_args(6)
    args[1] = torch.randn(2, 4, 6, generator=g)
    args[2] = torch.randn(4, 3, generator=g) * 0.3  # A_log for the scan, A for the loop (signs unused)
    args[5] = torch.randn(4, generator=g)
    report, _ = _reasons(fn, *args)
    folds = [r for r in report.rewrites if r.family == "delta"]
    assert len(folds) == 1 and bool(folds[0].decision.get("time_flipped")) is flipped, str(report)
    assert not any("first_state" in r.decision for r in report.rewrites), str(report)
    _values_and_grads_match(fn, args)
