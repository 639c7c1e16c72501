"""In-place writes to values a pass looks through or recomputes (run 49, probes AI, AK and AL).

A pass that makes an op compute a value itself (Δ from dt and the bias, a decode step's dA, dBx
and gate, the gate's sigmoid), or read an earlier value instead of a later one (x instead of
F.pad(x), a split piece instead of its copy), must see every in-place write to what it skips.

Recorded behaviour before this round, each a wrong result with no near-miss in explain:
- delta: ``s = dt + b; s[:, 0].mul_(2); softplus(s)`` and ``delta = softplus(..); delta[:, 0].zero_()``
  before a scan: the op recomputed Δ from dt and b (errors 7-10, gradients off by 20-180 %).
- decode (state_update): writes to the step's dt, dA, dBx, silu(z) or x·D were lost: the output
  and the cache state were wrong (errors 0.03-3.6).
- gate: ``s = sigmoid(z); s[:, 0] = 0; (y * z) * s``: the two-mul gate's write check looked at z,
  not at the sigmoid (error 1.5).
- xproj: a cast on the way to a ``.contiguous()`` copy (new memory) written through an alias
  after the copy: the copy was removed (error 7.7).
- conv1d (``test_pass_conv1d.py``): an initial window written into F.pad's zeros.
"""
import pytest
import torch
import torch.nn.functional as F

from ssm_compile.kernels import register_ops
from ssm_compile.report import explain

register_ops()


def _misses(report, family=None):
    return [m.reason for m in report.misses if family is None or m.family == family]


def _scan_loop(u, delta, A, B, C):
    """selective_scan_ref's loop (batch, dim, L) / (batch, N, L)."""
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, -1)


def _scan_inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    b, d, n, L = 2, 4, 3, 6
    u = torch.randn(b, d, L, generator=g, dtype=dtype)
    dt = torch.randn(b, d, L, generator=g, dtype=dtype)
    A = -torch.rand(d, n, generator=g, dtype=dtype) - 0.5
    B = torch.randn(b, n, L, generator=g, dtype=dtype)
    C = torch.randn(b, n, L, generator=g, dtype=dtype)
    bias = torch.randn(d, generator=g, dtype=dtype)
    z = torch.randn(b, d, L, generator=g, dtype=dtype)
    return u, dt, A, B, C, bias, z


def _compiled_equals_eager(fn, args, rtol=1e-12, atol=1e-12):
    """The compiled result (and every argument afterwards: some are written) is eager's."""
    want_args = [a.clone() for a in args]
    want = fn(*want_args)
    torch._dynamo.reset()
    got_args = [a.clone() for a in args]
    got = torch.compile(fn, backend="ssm")(*got_args)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    for g, w in zip(got_args, want_args):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
    torch._dynamo.reset()
    return explain(fn, *[a.clone() for a in args])


def sum_written(u, dt, A, B, C, bias, z):
    s = dt + bias[:, None]
    s[:, 0].mul_(2)
    return _scan_loop(u, F.softplus(s), A, B, C)


def delta_written_then_op(u, dt, A, B, C, bias, z):
    delta = F.softplus(dt + bias[:, None])
    delta[:, 0].zero_()
    return torch.ops.ssm.selective_scan(u, delta, A, B, C)[0]


def delta_detached_alias_written(u, dt, A, B, C, bias, z):
    delta = F.softplus(dt + bias[:, None])
    delta.detach().mul_(0.5)
    return _scan_loop(u, delta, A, B, C)


@pytest.mark.parametrize("fn, family, reason", [
    (sum_written, "delta", "writes in place to memory Δ or its inputs"),
    (delta_written_then_op, "delta", "writes in place to memory Δ or its inputs"),
    # The loop itself reads Δ after the write: the scan pass refuses first.
    (delta_detached_alias_written, "scan_loop", "delta is mutated in place"),
], ids=lambda x: getattr(x, "__name__", None))
def test_delta_fold_sees_writes_to_the_sum_and_to_delta(fn, family, reason):
    report = _compiled_equals_eager(fn, _scan_inputs())
    assert any(reason in r for r in _misses(report, family)), report.format(graphs=False)


def gate_sigmoid_written(u, dt, A, B, C, bias, z):
    y = _scan_loop(u, F.softplus(dt), A, B, C)
    s = torch.sigmoid(z)
    s[:, 0] = 0.0
    return (y * z) * s


def test_split_gate_sees_a_write_to_its_sigmoid():
    report = _compiled_equals_eager(gate_sigmoid_written, _scan_inputs())
    assert not report.counts.get("gate") and any("in the gate" in r for r in _misses(report, "gate")), \
        report.format(graphs=False)


def test_split_gate_without_the_write_is_still_folded():
    def fn(u, dt, A, B, C, bias, z):
        return (_scan_loop(u, F.softplus(dt), A, B, C) * z) * torch.sigmoid(z)
    report = _compiled_equals_eager(fn, _scan_inputs(), rtol=1e-10, atol=1e-10)
    (gate,) = [r for r in report.rewrites if r.family == "gate"]
    # The record names the sigmoid among what it replaced, not the graph input z.
    assert any("sigmoid" in name for name in gate.replaced) and not any(name.startswith("l_z") for name in
                                                                         gate.replaced), gate.replaced


# --- decode steps -----------------------------------------------------------------------------

def _disc(x, dt, A, B):
    return torch.exp(dt.unsqueeze(-1) * A), dt.unsqueeze(-1) * B.unsqueeze(1) * x.unsqueeze(-1)


def _step(write):
    """HF's decode-step fallback with ``write(name, value)`` applied to each intermediate."""
    def fn(state, x, dt, A, B, C, D, z, dt_bias):
        dt = F.softplus(dt + dt_bias)
        write("dt", dt)
        dA, dBx = _disc(x, dt, A, B)
        write("dA", dA)
        write("dBx", dBx)
        state.copy_(state * dA + dBx)
        y = torch.einsum("bdn,bn->bd", state, C)
        p = x * D
        write("skip", p)
        g = F.silu(z)
        write("gate", g)
        return (y + p) * g
    return fn


def _decode_inputs():
    g = torch.Generator().manual_seed(0)
    b, d, n = 2, 6, 4
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return [r(b, d, n), r(b, d), r(b, d), -torch.rand(d, n, generator=g) - 0.1, r(b, n), r(b, n), r(d), r(b, d), r(d)]


WRITES = {
    "dt[:, 0] = 0": ("dt", lambda v: v.__setitem__((slice(None), 0), 0.0)),
    "dt.mul_(0.5)": ("dt", lambda v: v.mul_(0.5)),
    "dA[:, 0].mul_(2)": ("dA", lambda v: v[:, 0].mul_(2)),
    "dBx[:, 0] = 0": ("dBx", lambda v: v.__setitem__((slice(None), 0), 0.0)),
    "(x*D)[:, 0] = 0": ("skip", lambda v: v.__setitem__((slice(None), 0), 0.0)),
    "silu(z).detach().zero_()": ("gate", lambda v: v.detach().zero_()),
}


@pytest.mark.parametrize("case", list(WRITES))
def test_decode_step_sees_writes_to_its_intermediates(case):
    where, how = WRITES[case]
    fn = _step(lambda name, v: how(v) if name == where else None)
    report = _compiled_equals_eager(fn, _decode_inputs(), rtol=1e-5, atol=1e-6)
    assert not report.counts.get("state_update"), report.format(graphs=False)
    assert any("writes in place to a value the step computes" in r for r in _misses(report, "state_update")), \
        report.format(graphs=False)


def test_decode_step_without_writes_is_still_rewritten():
    report = _compiled_equals_eager(_step(lambda name, v: None), _decode_inputs(), rtol=1e-5, atol=1e-6)
    assert report.counts.get("state_update") == 1, report.format(graphs=False)


def _step_after(prepare):
    """A decode step (in-place state update) whose inputs ``prepare`` rewrites first."""
    def fn(state, x, dt, A, B, C, D, z, dt_bias):
        x, B = prepare(x, B)
        dt = F.softplus(dt + dt_bias)
        dA, dBx = _disc(x, dt, A, B)
        state.mul_(dA).add_(dBx)
        y = (state @ C.unsqueeze(-1)).squeeze(-1)
        return (y + D * x) * F.silu(z)
    return fn


def _normalised_in_place(x, B):
    B = B * 1.0
    B.div_(B.norm(dim=-1, keepdim=True))
    return x, B


def _clone_written(x, B):
    x = x.clone()
    x.mul_(2)
    return x, B


def test_decode_step_reads_an_input_written_before_it():
    """An input written in place before the step (its own memory, read where the op runs) is no
    value the step computes: rewritten (probe AN: refused since the check above was added)."""
    report = _compiled_equals_eager(_step_after(_normalised_in_place), _decode_inputs(), rtol=1e-5, atol=1e-6)
    assert report.counts.get("state_update") == 1, report.format(graphs=False)


def test_decode_step_after_a_written_clone_is_left_alone():
    """``x = x.clone(); x.mul_(2)``: the match reads x through the clone, so the write to the clone
    is one the op would miss (a wrong result before run 49)."""
    report = _compiled_equals_eager(_step_after(_clone_written), _decode_inputs(), rtol=1e-5, atol=1e-6)
    assert not report.counts.get("state_update"), report.format(graphs=False)


# --- x_proj pieces ------------------------------------------------------------------------------

def test_copy_of_a_written_cast_is_kept():
    b, d, L, N, R = 2, 3, 5, 3, 2
    g = torch.Generator().manual_seed(0)
    u = torch.randn(b, d, L, generator=g, dtype=torch.float64)
    delta = F.softplus(torch.randn(b, d, L, generator=g, dtype=torch.float64))
    A = -torch.rand(d, N, generator=g, dtype=torch.float64) - 0.3
    xin, Wx = torch.randn(b * L, d, generator=g), torch.randn(R + 2 * N, d, generator=g)

    def fn(u, delta, A, xin, Wx):
        x_dbl = F.linear(xin, Wx)
        dt, B, C = torch.split(x_dbl, [R, N, N], dim=-1)
        Bd, Cd = B.to(torch.float64), C.to(torch.float64)
        alias = Bd.view(-1)
        B3 = Bd.view(b, L, N).permute(0, 2, 1).contiguous()
        C3 = Cd.view(b, L, N).permute(0, 2, 1).contiguous()
        alias.mul_(2)  # after the copy: the op must read the copy's values
        return torch.ops.ssm.selective_scan(u, delta, A, B3, C3)[0]

    report = _compiled_equals_eager(fn, [u, delta, A, xin, Wx])
    assert any("the copy protects the op's input" in r for r in _misses(report)), report.format(graphs=False)


# --- fused levels (probe AM) ------------------------------------------------------------------

def _fuse_inputs():
    g = torch.Generator().manual_seed(0)
    b, d, n, L, R, W = 2, 4, 3, 6, 2, 4
    return [torch.randn(b, d, L, generator=g), torch.randn(d, W, generator=g) * .5,
            torch.randn(d, generator=g) * .1, torch.randn(b, R, L, generator=g) * .5,
            torch.randn(d, R, generator=g) * .5, -torch.rand(d, n, generator=g) - .5,
            torch.randn(b, n, L, generator=g), torch.randn(b, n, L, generator=g), torch.randn(d, generator=g),
            torch.randn(b, d, L, generator=g), torch.randn(d, generator=g)]


def _conv_then_scan(write):
    """The conv op and the scan op on ``W_dt @ dt_low``, with ``write`` applied in between."""
    def fn(x, cw, cb, low, Wdt, A, B, C, D, z, bias):
        u = torch.ops.ssm.causal_conv1d(x, cw, cb, "silu")
        delta = Wdt @ low
        write(x=x, cw=cw, cb=cb, u=u, low=low, Wdt=Wdt, delta=delta)
        return torch.ops.ssm.selective_scan(u, delta, A, B, C, D, z, bias, True)[0]
    return fn


FUSE_WRITES = {
    "x.mul_(3) after the conv": (lambda x, **_: x.mul_(3), "level1"),
    "conv weight written": (lambda cw, **_: cw.mul_(2), "level2"),
    "conv output u[:, 0] = 0": (lambda u, **_: u.__setitem__((slice(None), 0), 0.0), "level1"),
    "dt_low written after the product": (lambda low, **_: low.mul_(2), "dt"),
    "W_dt written after the product": (lambda Wdt, **_: Wdt.mul_(2), "level2"),
    "delta.detach()[:, 0].zero_()": (lambda delta, **_: delta.detach()[:, 0].zero_(), "dt"),
}


@pytest.mark.parametrize("case", list(FUSE_WRITES))
def test_forced_fusion_level_sees_writes_to_what_it_recomputes(case):
    """A forced fused level recomputes the conv and Δ = W_dt @ dt_low at the scan (``fuse=...``;
    ``auto`` keeps split on the CPU): a write in between must keep the ops split."""
    write, level = FUSE_WRITES[case]
    got, want, record = _fused(_conv_then_scan(write), level)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert any("which a fused level recomputes at the scan" in m.reason for m in record.misses), record.misses


def test_forced_fusion_level_without_writes_still_fuses():
    got, want, record = _fused(_conv_then_scan(lambda **_: None), "level2")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert [r.family for r in record.rewrites] == ["fuse"], record.rewrites


def _fused(fn, level):
    """fn compiled with a forced fusion level (the rewritten graph run eagerly), eager's result,
    and what the passes did."""
    from ssm_compile.compiler import SSMBackend
    from ssm_compile.config import SSMOptions

    args = _fuse_inputs()
    records = []
    with torch.no_grad():
        want = fn(*[a.clone() for a in args])
        torch._dynamo.reset()
        configured = SSMBackend(SSMOptions(inductor=False, fuse=level), on_graph=records.append)
        got = torch.compile(fn, backend=configured)(*[a.clone() for a in args])
    torch._dynamo.reset()
    (record,) = records
    return got, want, record


# --- x_dt_proj through a copy of a weight (probe AM) -------------------------------------------

def _x_dt_block(x_proj, dt_proj):
    R, N = 2, 3

    def fn(x, Wx, Wdt, bias, A):
        from ssm_compile.kernels.selective_scan.op import selective_scan_fn

        x_dbl = x_proj(x, Wx)
        dt, B, C = x_dbl.split([R, N, N], dim=-1)
        delta = F.softplus(dt_proj(dt, Wdt) + bias)
        return selective_scan_fn(x.transpose(1, 2), delta.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2))
    return fn


def _x_dt_inputs():
    g = torch.Generator().manual_seed(0)
    b, L, d, R, N = 2, 5, 4, 2, 3
    return [torch.randn(b, L, d, generator=g), torch.randn(R + 2 * N, d, generator=g) * .5,
            torch.randn(d, R, generator=g) * .5, torch.randn(d, generator=g) * .1,
            -torch.rand(d, N, generator=g) - .5]


def _copied_then_written(x, W):
    Wt = W.t().contiguous()  # a copy of W^T: the product reads the copy, not W
    W.zero_()
    return x @ Wt


def _copy_written(x, W):
    Wt = W.t().contiguous()
    Wt[0] = 0.0  # the copy is written, W is not
    return x @ Wt


@pytest.mark.parametrize("x_proj, dt_proj", [
    (_copied_then_written, lambda dt, W: F.linear(dt, W)),
    (lambda x, W: F.linear(x, W), _copy_written),
], ids=["W_x written after its copy", "W_dt's copy written"])
def test_x_dt_proj_through_a_weight_copy_sees_the_writes(x_proj, dt_proj):
    fn = _x_dt_block(x_proj, dt_proj)
    report = _compiled_equals_eager(fn, _x_dt_inputs(), rtol=1e-5, atol=1e-6)
    assert not report.counts.get("x_dt_proj") and any(
        "a weight or a copy or view of them" in r for r in _misses(report, "x_dt_proj")), report.format(graphs=False)


def test_x_dt_proj_through_a_weight_transpose_is_rewritten():
    fn = _x_dt_block(lambda x, W: x @ W.t(), lambda dt, W: dt @ W.T)
    report = _compiled_equals_eager(fn, _x_dt_inputs(), rtol=1e-5, atol=1e-6)
    assert report.counts.get("x_dt_proj") == 1, report.format(graphs=False)
