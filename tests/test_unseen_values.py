"""Probes CB and CC (run 59): explain's reasons for a decay shared across channels and for an
associative_scan the op refuses; x_dt_proj's reason for an x_proj it does not compute is in
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


def test_a_decay_per_state_shared_by_the_channels_is_not_called_one_per_channel():
    # The note for a 1-D A said "one decay per channel" whichever axis A indexes (probe CB).
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 6, 5, generator=g), F.softplus(torch.randn(2, 6, 5, generator=g)),
            torch.randn(4, generator=g) * 0.5, torch.randn(2, 4, 5, generator=g), torch.randn(2, 4, 5, generator=g))
    report, reasons = _reasons(_a_shared_by_channels, *args)
    assert not report.rewrites
    text = "\n".join(reasons)
    assert "broadcast over the channels: one decay per state, shared by every channel" in text, text
    assert "one decay per channel" not in text, text
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(_a_shared_by_channels, backend="ssm")(*args),
                               _a_shared_by_channels(*args))


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
