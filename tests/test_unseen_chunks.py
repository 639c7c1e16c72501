"""Mamba-1 run in chunks, and flattened Mamba-2 (run 57, probes BT and BU).

Streaming and chunked prefill carry the conv's last W-1 inputs and the SSM state from one call
to the next. The conv over ``torch.cat([conv_state, x], -1)`` with no padding is the causal conv
of x started from that window: the conv pass now rewrites it into ``ssm.causal_conv1d`` with
``initial_state`` where the state is a value (a function argument, an attribute reassigned), and
the decode pass's conv update takes the unsliced output of a window of exactly W-1 states (a
buffer written back with ``copy_``). One-step windows stay the decode pass's.

A Mamba-2 block flattened to Mamba-1 (dim = heads * headdim, A repeated over headdim and the
state) is a Mamba-1 scan. Through ``associative_scan`` with a one-group B read as ``B[:, :, 0]``
it is now rewritten (the evaluator looked through the select, and the op reads the user's
view); a B indexed by a single ``B[:, None, :, 0]``, or by time and group at once in a loop's
``B[:, t, 0, None, :]``, is left alone with a reason that says so. (Until run 63 the loop's A,
broadcast over the state axis without a value that holds it, was the reason; such an A is now
read through a stride-0 expand, tests/test_broadcast_A.py.)
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._higher_order_ops.associative_scan import associative_scan

from ssm_compile.compiler import backend
from ssm_compile.report import explain

W, DIM, BATCH = 4, 6, 2
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


def conv_inputs(T, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, DIM, T, generator=g, dtype=dtype)
    cs = torch.randn(BATCH, DIM, W - 1, generator=g, dtype=dtype)
    w = torch.randn(DIM, 1, W, generator=g, dtype=dtype) * 0.5
    b = torch.randn(DIM, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (x, cs, w, b)]


def carried_conv(x, cs, w, b):
    """A chunk: the conv over the carried window and the chunk, and the next window returned."""
    win = torch.cat([cs, x], -1)
    return F.silu(F.conv1d(win, w, b, groups=DIM)), win[..., -(W - 1):]


def _compiled(fn, *args):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, backend=backend(inductor=False))(*args)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Triton conv with an initial state needs a CUDA device"))])
@pytest.mark.parametrize("T", [2, 7])
def test_conv_over_a_carried_window_is_the_causal_conv_from_that_state(T, device):
    args = [t.detach().to(device).requires_grad_() for t in conv_inputs(T)]
    want = carried_conv(*args)
    got = _compiled(carried_conv, *args)
    assert counters["ssm"]["conv1d"] == 1, dict(counters["ssm"])
    for o, r in zip(got, want):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
    weights = [torch.randn_like(r) for r in want]
    g_want = torch.autograd.grad(sum((r * v).sum() for r, v in zip(want, weights)), args)
    g_got = torch.autograd.grad(sum((o * v).sum() for o, v in zip(got, weights)), args)
    for o, r in zip(g_got, g_want):  # the state's gradient included
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    report = explain(carried_conv, *[t.detach().to(device) for t in conv_inputs(T)])
    assert [r.pattern for r in report.rewrites if r.family == "conv1d"] == ["cat(state(W-1), x)+conv1d+silu"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="inductor's inlined conv launch with an initial state needs CUDA"))])
def test_chunks_of_a_sequence_equal_the_whole_sequence(device):
    torch._dynamo.reset()
    x, cs, w, b = (t.detach().to(device) for t in conv_inputs(12))
    whole = F.silu(F.conv1d(F.pad(x, (W - 1, 0)), w, b, groups=DIM))
    state, outs = torch.zeros_like(cs), []
    step = torch.compile(carried_conv, backend="ssm")
    for piece in x.split([3, 7, 2], -1):
        y, state = step(piece, state, w, b)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs, -1), whole, rtol=1e-5, atol=1e-6)


def one_step_window(x, cs, w, b):
    return F.conv1d(torch.cat([cs, x], -1), w, b, groups=DIM)[..., -1]


def mixed_dtypes(x, cs, w, b):
    # cat promotes the bf16 state to x's dtype: the op would read the state unpromoted.
    return F.conv1d(torch.cat([cs.bfloat16(), x.float()], -1), w.float(), b.float(), groups=DIM)


def longer_window(x, cs, w, b):
    # W inputs carried, not W - 1: the output has T + 1 steps, not the causal conv of x.
    return F.conv1d(torch.cat([torch.cat([cs, cs[..., :1]], -1), x], -1), w, b, groups=DIM)


@pytest.mark.parametrize("fn, T", [(one_step_window, 1), (mixed_dtypes, 5), (longer_window, 5)],
                         ids=["one-step", "mixed-dtypes", "W-inputs-carried"])
def test_windows_that_are_not_a_chunk_are_left_to_others(fn, T):
    args = [t.detach() for t in conv_inputs(T)]
    want = fn(*args)
    got = _compiled(fn, *args)
    assert "conv1d" not in counters["ssm"], dict(counters["ssm"])
    assert torch.equal(got, want)


class BufferedChunk(torch.nn.Module):
    """A chunk whose states live in buffers written back in place (probe BU)."""

    def __init__(self, N=4):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.A_log = torch.nn.Parameter(torch.randn(DIM, N, generator=g) * 0.1)
        self.w = torch.nn.Parameter(torch.randn(DIM, 1, W, generator=g) * 0.3)
        self.register_buffer("h", torch.randn(BATCH, DIM, N, generator=g) * 0.3)
        self.register_buffer("cs", torch.randn(BATCH, DIM, W - 1, generator=g) * 0.3)

    def forward(self, x, delta, B, C):  # x, delta: (batch, T, dim); B, C: (batch, T, N)
        win = torch.cat([self.cs, x.transpose(1, 2)], -1)
        u = F.silu(F.conv1d(win, self.w, groups=DIM))  # exactly T outputs: no slice
        self.cs.copy_(win[:, :, -(W - 1):])
        u = u.transpose(1, 2)
        dA = torch.exp(delta.unsqueeze(-1) * -torch.exp(self.A_log))
        dBu = delta.unsqueeze(-1) * B.unsqueeze(2) * u.unsqueeze(-1)
        h, ys = self.h, []
        for t in range(x.shape[1]):
            h = dA[:, t] * h + dBu[:, t]
            ys.append((h * C[:, t].unsqueeze(1)).sum(-1))
        self.h.copy_(h)
        return torch.stack(ys, 1)


def test_buffered_chunk_is_rewritten_without_false_reasons():
    g = torch.Generator().manual_seed(4)
    T = 5
    args = (torch.randn(BATCH, T, DIM, generator=g), F.softplus(torch.randn(BATCH, T, DIM, generator=g)),
            torch.randn(BATCH, T, 4, generator=g), torch.randn(BATCH, T, 4, generator=g))
    eager, compiled = BufferedChunk(), BufferedChunk()
    with torch.no_grad():
        want = eager(*args)
        report = explain(compiled, *args)
    assert report.counts["conv_update"] == 1 and report.counts["scan_loop"] == 1, dict(report.counts)
    torch.testing.assert_close(report.output, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled.h, eager.h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled.cs, eager.cs, rtol=0, atol=0)
    # The state written back is the rewritten scan's last state: no decode step, no reason.
    assert not [m for m in report.misses if m.family in ("state_update", "conv_update")], report.format(graphs=False)


# --- flattened Mamba-2 --------------------------------------------------------------------------

HEADS, HEADDIM, NS, L = 2, 3, 4, 7


def m2_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, L, HEADS, HEADDIM, generator=g, dtype=torch.float64)
    dt = F.softplus(torch.randn(BATCH, L, HEADS, generator=g, dtype=torch.float64))
    A = -torch.rand(HEADS, generator=g, dtype=torch.float64) - 0.5
    B = torch.randn(BATCH, L, 1, NS, generator=g, dtype=torch.float64)
    C = torch.randn(BATCH, L, 1, NS, generator=g, dtype=torch.float64)
    D = torch.randn(HEADS, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D)]


def _combine(left, right):
    return left[0] * right[0], right[0] * left[1] + right[1]


def _flat(x, dt, A):
    d = HEADS * HEADDIM
    u = x.reshape(BATCH, L, d).transpose(1, 2)
    delta = dt.transpose(1, 2)[:, :, None, :].expand(BATCH, HEADS, HEADDIM, L).reshape(BATCH, d, L)
    return u, delta, A[:, None, None].expand(HEADS, HEADDIM, NS).reshape(d, NS)


def m2_assoc(x, dt, A, B, C, D):
    u, delta, Af = _flat(x, dt, A)
    dA = torch.exp(delta[..., None] * Af[:, None, :])
    dBu = delta[..., None] * u[..., None] * B[:, :, 0][:, None, :, :]
    hs = associative_scan(_combine, (dA, dBu), dim=2, combine_mode="generic")[1]
    return (hs * C[:, :, 0][:, None]).sum(-1) + D.repeat_interleave(HEADDIM)[:, None] * u


def m2_assoc_one_index(x, dt, A, B, C, D):
    u, delta, Af = _flat(x, dt, A)
    dA = torch.exp(delta[..., None] * Af[:, None, :])
    dBu = delta[..., None] * u[..., None] * B[:, None, :, 0, :]
    hs = associative_scan(_combine, (dA, dBu), dim=2, combine_mode="generic")[1]
    return (hs * C[:, :, 0][:, None]).sum(-1)


def m2_loop_A_broadcast(x, dt, A, B, C, D):
    u, delta, _ = _flat(x, dt, A)
    Af = A.repeat_interleave(HEADDIM)[:, None].expand(HEADS * HEADDIM, NS)
    h, ys = u.new_zeros(BATCH, HEADS * HEADDIM, NS), []
    for t in range(L):
        h = torch.exp(delta[:, :, t, None] * Af) * h + delta[:, :, t, None] * B[:, t, 0, None, :] * u[:, :, t, None]
        ys.append((h * C[:, t, 0, None, :]).sum(-1))
    return torch.stack(ys, -1)


def m2_loop_4d(x, dt, A, B, C, D):
    """Mamba-2's own loop: a (batch, heads, headdim, N) state, a scalar decay per head."""
    h, ys = x.new_zeros(BATCH, HEADS, HEADDIM, NS), []
    for t in range(L):
        dA = torch.exp(dt[:, t] * A)
        dBx = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        h = dA[..., None, None] * h + dBx
        ys.append((h * C[:, t, :, None, :]).sum(-1) + D[:, None] * x[:, t])
    return torch.stack(ys, 1)


def test_flattened_mamba2_through_associative_scan_is_rewritten():
    args = m2_inputs()
    want = m2_assoc(*args)
    got = _compiled(m2_assoc, *args)
    assert counters["ssm"]["scan_assoc"] == 1, dict(counters["ssm"])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    v = torch.randn_like(want)
    for o, r in zip(torch.autograd.grad((got * v).sum(), args), torch.autograd.grad((want * v).sum(), args)):
        torch.testing.assert_close(o, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("fn, family, reason", [
    (m2_assoc_one_index, "discretization", "its size-1 axis is one the product does not have"),
    (m2_loop_A_broadcast, "scan_loop", "the state's addend: a factor is neither a time slice nor"),
    (m2_loop_4d, "scan_loop", "the state update broadcasts"),
], ids=["B-one-index", "A-broadcast-over-state", "4-D-state"])
def test_flattened_mamba2_left_alone_says_why(fn, family, reason):
    args = [t.detach() for t in m2_inputs()]
    want = fn(*args)
    got = _compiled(fn, *args)
    assert not counters["ssm"], dict(counters["ssm"])
    assert torch.equal(got, want)
    misses = [m for m in explain(fn, *args).misses if m.family in ("scan_loop", "discretization")]
    assert any(m.family == family and reason in m.reason for m in misses), misses
    # The skip's D * x[t] next to the refused loop is no loop of its own (it said "no state chain").
    assert not any("no state chain" in m.reason for m in misses), misses


# --- serving: a cache pool's rows gathered by index (probe BW) ---------------------------------

SLOTS, NP = 7, 4


def pool_inputs(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=r(batch, DIM), z=r(batch, DIM), dtr=r(batch, DIM), cw=r(DIM, W) * 0.5, cb=r(DIM),
                A=-torch.rand(DIM, NP, generator=g) - 0.5, B=r(batch, NP), C=r(batch, NP), D=r(DIM), bias=r(DIM),
                conv_pool=r(SLOTS, DIM, W), ssm_pool=r(SLOTS, DIM, NP),
                idx=torch.randperm(SLOTS, generator=g)[:batch], active=torch.rand(batch, generator=g) > 0.3)


def pooled_step(x, z, dtr, cw, cb, A, B, C, D, bias, conv_pool, ssm_pool, idx, active, gather="index"):
    """One continuous-batching decode step: each request's rows gathered from the pools, the
    new rows written back for the active requests only."""
    cs_old = conv_pool[idx] if gather == "index" else conv_pool.index_select(0, idx)
    cs = torch.cat([cs_old[:, :, 1:], x[:, :, None]], -1)
    xc = F.silu((cs * cw).sum(-1) + cb)
    st_old = ssm_pool[idx] if gather == "index" else torch.index_select(ssm_pool, 0, idx)
    delta = F.softplus(dtr + bias)
    st = st_old * torch.exp(delta[:, :, None] * A) + delta[:, :, None] * B[:, None, :] * xc[:, :, None]
    y = ((st * C[:, None, :]).sum(-1) + xc * D) * F.silu(z)
    keep = active[:, None, None]
    conv_pool[idx] = torch.where(keep, cs, cs_old)
    ssm_pool.index_copy_(0, idx, torch.where(keep, st, st_old))
    return y


@pytest.mark.parametrize("gather", ["index", "index_select"])
def test_decode_on_rows_gathered_from_a_pool_is_rewritten(gather):
    torch._dynamo.reset()
    counters.clear()
    # The batch changes: dynamo recompiles with the batch dynamic (W and N stay static).
    step = torch.compile(pooled_step, backend=backend(inductor=False))
    for batch in (2, 3, 5):
        eager, comp = pool_inputs(batch, seed=batch), pool_inputs(batch, seed=batch)
        want = pooled_step(**eager, gather=gather)
        got = step(**comp, gather=gather)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for name in ("conv_pool", "ssm_pool"):
            torch.testing.assert_close(comp[name], eager[name], rtol=1e-5, atol=1e-6)
    assert counters["ssm"]["state_update"] >= 1 and counters["ssm"]["conv_update"] >= 1, dict(counters["ssm"])


def subtract_alias_step(state, x, dt, A, B, C):
    dA = torch.exp(dt[..., None] * A)
    state.copy_(torch.subtract(state * dA, dt[..., None] * B[:, None, :] * x[..., None], alpha=-1))
    return (state * C[:, None, :]).sum(-1)


def test_decode_update_through_torch_subtract_is_rewritten():
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(BATCH, DIM, NP, generator=g), torch.randn(BATCH, DIM, generator=g),
            torch.rand(BATCH, DIM, generator=g), -torch.rand(DIM, NP, generator=g), torch.randn(BATCH, NP, generator=g),
            torch.randn(BATCH, NP, generator=g)]
    eager, comp = [a.clone() for a in args], [a.clone() for a in args]
    want = subtract_alias_step(*eager)
    got = _compiled(subtract_alias_step, *comp)
    assert counters["ssm"]["state_update"] == 1, dict(counters["ssm"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comp[0], eager[0], rtol=1e-5, atol=1e-6)


def state_scaled_before_the_cat(x, cs, w, b):
    cs.mul_(0.5)
    return F.conv1d(torch.cat([cs, x], -1), w, b, groups=DIM)


def test_carried_state_written_in_place_says_so():
    args = [t.detach() for t in conv_inputs(5)]
    want = state_scaled_before_the_cat(*[a.clone() for a in args])
    got = _compiled(state_scaled_before_the_cat, *[a.clone() for a in args])
    assert "conv1d" not in counters["ssm"] and torch.equal(got, want)
    misses = [m.reason for m in explain(state_scaled_before_the_cat, *[a.clone() for a in args]).misses
              if m.family == "conv1d"]
    assert any("writes the carried state" in r for r in misses), misses


def m2_assoc_scaled_C(x, dt, A, B, C, D):
    """C scaled by a number after its group select: the product ``C[:, :, 0] * 2.0`` is no loop
    started from 2.0 (it said "no state chain" after a full rewrite, and turned on cpp.simdlen=1)."""
    u, delta, Af = _flat(x, dt, A)
    dA = torch.exp(delta[..., None] * Af[:, None, :])
    dBu = delta[..., None] * u[..., None] * B[:, :, 0][:, None, :, :]
    hs = associative_scan(_combine, (dA, dBu), dim=2, combine_mode="generic")[1]
    return (hs * (C[:, :, 0] * 2.0)[:, None]).sum(-1)


def test_a_number_times_a_slice_is_no_loop():
    args = [t.detach() for t in m2_inputs()]
    report = explain(m2_assoc_scaled_C, *args)
    assert {r.family for r in report.rewrites} >= {"scan_assoc", "readout"}, report.format(graphs=False)
    assert not [m for m in report.misses if m.family == "scan_loop"], report.format(graphs=False)
    torch.testing.assert_close(_compiled(m2_assoc_scaled_C, *args), m2_assoc_scaled_C(*args), rtol=1e-10, atol=1e-12)


def step_on_a_row_selected_by_a_0d_index(pool, i, x, dt, A, B, C):
    st = pool[i]  # a 0-d index selects like an int: a view of the pool, not a gathered copy
    new = st * torch.exp(dt[..., None] * A) + dt[..., None] * B[:, None] * x[..., None]
    pool.mul_(0.5)
    return (new * C[:, None]).sum(-1), new


def test_a_row_selected_by_a_0d_index_is_no_gathered_copy():
    g = torch.Generator().manual_seed(2)
    args = [torch.randn(4, BATCH, DIM, NP, generator=g), torch.tensor(1), torch.randn(BATCH, DIM, generator=g),
            torch.rand(BATCH, DIM, generator=g), -torch.rand(DIM, NP, generator=g), torch.randn(BATCH, NP, generator=g),
            torch.randn(BATCH, NP, generator=g)]
    eager, comp = [a.clone() for a in args], [a.clone() for a in args]
    want = step_on_a_row_selected_by_a_0d_index(*eager)
    got = _compiled(step_on_a_row_selected_by_a_0d_index, *comp)
    assert "state_update" not in counters["ssm"], dict(counters["ssm"])
    for o, r in zip(got, want):
        assert torch.equal(o, r)
    assert torch.equal(comp[0], eager[0])
