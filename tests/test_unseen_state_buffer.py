"""States written into a preallocated buffer, then read out after the loop.

``H = torch.zeros(b, d, L, N); for t: h = dA[:, :, t] * h + dBu[:, :, t]; H[:, :, t] = h`` and
then ``einsum('bdln,bnl->bdl', H, C)``: the buffer form of stacking the states
(``torch.stack(hs, 2)``, which the passes already read). Every slot must be written once, at its
own step, with the state itself (no rounding into a narrower buffer), nothing may read the
buffer inside the loop, and after it only the readout (and the last state's slot) may use it.
Look-alikes of each condition are left alone with eager's bits.
"""
import pytest
import torch
from utils import TOL, rel_err

from ssm_compile.compiler import backend
from ssm_compile.report import explain

BATCH, DIM, N, L = 2, 6, 4, 9
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


def make_inputs():
    g = torch.Generator().manual_seed(5)
    u = torch.randn(BATCH, DIM, L, generator=g)
    delta = torch.nn.functional.softplus(torch.randn(BATCH, DIM, L, generator=g))
    A = -torch.rand(DIM, N, generator=g) - 0.5
    B = torch.randn(BATCH, N, L, generator=g)
    C = torch.randn(BATCH, N, L, generator=g)
    D = torch.randn(DIM, generator=g)
    return u, delta, A, B, C, D


def disc(u, delta, A, B):
    return (torch.exp(torch.einsum("bdl,dn->bdln", delta, A)), torch.einsum("bdl,bnl,bdl->bdln", delta, B, u))


def buffer_setitem(u, delta, A, B, C, D):
    H = fill(u.new_zeros(BATCH, DIM, L, N), u, delta, A, B)
    return torch.einsum("bdln,bnl->bdl", H, C) + u * D[:, None]


def buffer_time_major_matmul(u, delta, A, B, C, D):
    """(batch, L, dim, N) buffer, mamba.py's matmul readout, the last state returned too."""
    dA, dBu = (x.transpose(1, 2) for x in disc(u, delta, A, B))
    h = torch.zeros(BATCH, DIM, N, dtype=u.dtype)
    H = torch.empty(BATCH, L, DIM, N, dtype=u.dtype)
    for t in range(L):
        h = dA[:, t] * h + dBu[:, t]
        H[:, t] = h
    y = (H @ C.transpose(1, 2).unsqueeze(-1)).squeeze(-1)
    return y.transpose(1, 2) + u * D[:, None], H[:, -1]


def buffer_copy_(u, delta, A, B, C, D):
    dA, dBu = disc(u, delta, A, B)
    h = u.new_zeros(BATCH, DIM, N)
    H = torch.empty_like(dA)
    for t in range(L):
        h = dA[:, :, t] * h + dBu[:, :, t]
        H[:, :, t].copy_(h)
    return (H * C.transpose(1, 2)[:, None]).sum(-1)


REWRITTEN = [buffer_setitem, buffer_time_major_matmul, buffer_copy_]


@pytest.mark.parametrize("fn", REWRITTEN, ids=[f.__name__ for f in REWRITTEN])
def test_states_written_into_a_buffer_are_one_scan(fn):
    args = make_inputs()
    report = explain(fn, *args)
    assert report.counts.get("scan_loop") == 1 and report.counts.get("readout") == 1, report.format(graphs=False)
    assert report.misses == [], report.format(graphs=False)
    text = report.format()
    # The (batch, dim, L, N) buffer is gone with the loop.
    assert "new_zeros(2, 6, 9, 4)" not in text.split("-- graph after --")[1]
    ref = fn(*(x.double() for x in args))
    for got, want in zip(report.output if isinstance(report.output, tuple) else (report.output,),
                         ref if isinstance(ref, tuple) else (ref,)):
        assert rel_err(got, want) <= TOL[torch.float32]


def test_buffer_form_gradients_match_eager():
    args = [x.clone().requires_grad_() for x in make_inputs()]
    compiled = torch.compile(buffer_setitem, backend=backend(inductor=False))
    got = torch.autograd.grad(compiled(*args).square().sum(), args)
    ref = torch.autograd.grad(buffer_setitem(*args).square().sum(), args)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


# --- look-alikes ---------------------------------------------------------------------------------

def fill(H, u, delta, A, B, slot=lambda t: t, feedback=0.0):
    """The scan from h = 0 written into ``H``: state h_t stored at ``slot(t)``, plus
    ``feedback`` times the buffer's previous slot in the update (0: none)."""
    dA, dBu = disc(u, delta, A, B)
    h = u.new_zeros(BATCH, DIM, N)
    for t in range(L):
        h = dA[:, :, t] * h + dBu[:, :, t]
        if feedback:
            h = h + feedback * H[:, :, t - 1]
        H[:, :, slot(t)] = h
    return H


def wrong_slot(u, delta, A, B, C, D):
    H = fill(u.new_zeros(BATCH, DIM, L, N), u, delta, A, B, slot=lambda t: (t + 1) % L)
    return torch.einsum("bdln,bnl->bdl", H, C)


def narrower_buffer(u, delta, A, B, C, D):
    """A bf16 buffer: each write rounds the fp32 state."""
    H = fill(torch.zeros(BATCH, DIM, L, N, dtype=torch.bfloat16), u, delta, A, B)
    return torch.einsum("bdln,bnl->bdl", H.float(), C)


def longer_buffer(u, delta, A, B, C, D):
    """One slot more than steps: the readout also sums the never-written last slot (ones)."""
    H = fill(u.new_ones(BATCH, DIM, L + 1, N), u, delta, A, B)
    return torch.einsum("bdln,bnl->bdl", H[:, :, :L], C) + H[:, :, L].sum(-1, keepdim=True)


def read_inside_the_loop(u, delta, A, B, C, D):
    """The buffer's previous slot feeds the next step's update."""
    H = fill(u.new_zeros(BATCH, DIM, L, N), u, delta, A, B, feedback=0.1)
    return torch.einsum("bdln,bnl->bdl", H, C)


def written_after_the_loop(u, delta, A, B, C, D):
    H = fill(u.new_zeros(BATCH, DIM, L, N), u, delta, A, B)
    H[:, :, 0] = 0
    return torch.einsum("bdln,bnl->bdl", H, C)


def states_also_summed(u, delta, A, B, C, D):
    """The buffer is read out and also summed over time: the op never materialises it."""
    H = fill(u.new_zeros(BATCH, DIM, L, N), u, delta, A, B)
    return torch.einsum("bdln,bnl->bdl", H, C), H.sum(2)


def last_slot_doubled_before_the_readout(u, delta, A, B, C, D):
    """A write through the last-state view changes what the readout sums."""
    H = fill(u.new_zeros(BATCH, DIM, L, N), u, delta, A, B)
    last = H[:, :, -1]
    last.mul_(2)
    return torch.einsum("bdln,bnl->bdl", H, C), last


def last_slot_and_final_state_apart(u, delta, A, B, C, D):
    """The final state is scaled after the loop; the buffer's copy of it is not."""
    dA, dBu = disc(u, delta, A, B)
    h = u.new_zeros(BATCH, DIM, N)
    H = u.new_zeros(BATCH, DIM, L, N)
    for t in range(L):
        h = dA[:, :, t] * h + dBu[:, :, t]
        H[:, :, t] = h
    y = torch.einsum("bdln,bnl->bdl", H, C)
    h.mul_(3)
    return y, H[:, :, -1], h


def broadcast_write(u, delta, A, B, C, D):
    """Each batch-1 state is written into a batch-2 buffer: both rows get a copy."""
    dA, dBu = disc(u[:1], delta[:1], A, B[:1])
    h = u.new_zeros(1, DIM, N)
    H = u.new_zeros(BATCH, DIM, L, N)
    for t in range(L):
        h = dA[:, :, t] * h + dBu[:, :, t]
        H[:, :, t] = h
    return torch.einsum("bdln,bnl->bdl", H, C)


def extra_leading_axis(u, delta, A, B, C, D):
    dA, dBu = disc(u, delta, A, B)
    h = u.new_zeros(BATCH, DIM, N)
    H = u.new_zeros(2, BATCH, DIM, L, N)
    for t in range(L):
        h = dA[:, :, t] * h + dBu[:, :, t]
        H[:, :, :, t] = h
    return torch.einsum("kbdln,bnl->kbdl", H, C)


LOOK_ALIKES = [wrong_slot, narrower_buffer, longer_buffer, read_inside_the_loop, written_after_the_loop,
               states_also_summed, last_slot_doubled_before_the_readout, last_slot_and_final_state_apart,
               broadcast_write, extra_leading_axis]


@pytest.mark.parametrize("fn", LOOK_ALIKES, ids=[f.__name__ for f in LOOK_ALIKES])
def test_buffer_look_alikes_are_left_alone(fn):
    args = make_inputs()
    report = explain(fn, *args)
    assert not report.counts.get("scan_loop"), report.format(graphs=False)
    assert any(m.family == "scan_loop" for m in report.misses), report.format(graphs=False)
    eager = fn(*args)
    for got, want in zip(report.output if isinstance(report.output, tuple) else (report.output,),
                         eager if isinstance(eager, tuple) else (eager,)):
        assert torch.equal(got, want)


def stacked_last_state_doubled_before_the_readout(u, delta, A, B, C, D):
    """The same through torch.stack: writing the stacked states' last slot changes the readout
    (this one was rewritten, and wrong, before the state-buffer work added the check)."""
    dA, dBu = disc(u, delta, A, B)
    h = u.new_zeros(BATCH, DIM, N)
    hs = []
    for t in range(L):
        h = dA[:, :, t] * h + dBu[:, :, t]
        hs.append(h)
    H = torch.stack(hs, 2)
    last = H[:, :, -1]
    last.mul_(2)
    return torch.einsum("bdln,bnl->bdl", H, C), last


def test_stacked_states_written_after_the_loop_are_left_alone():
    args = make_inputs()
    report = explain(stacked_last_state_doubled_before_the_readout, *args)
    assert not report.counts.get("scan_loop"), report.format(graphs=False)
    assert any("written in place after the loop" in m.reason for m in report.misses), report.format(graphs=False)
    for got, want in zip(report.output, stacked_last_state_doubled_before_the_readout(*args)):
        assert torch.equal(got, want)
