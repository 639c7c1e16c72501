"""A decay broadcast over one axis (run 63): A (dim, 1), one decay per channel shared by the N
states (S4D-real with a shared decay, Mamba with a scalar decay per channel); A (dim,) read as
``A[:, None]`` (a flattened Mamba-2's decay per head, repeated to its channels); A (1, N), one
decay per state kept 2-D.

The state's N axis is proved from B and the channel axis from Δ and u, as for a (dim, N) A; the
op reads the user's A through a stride-0 (dim, N) expand, whose backward sums dA over the
broadcast axis as the user's broadcast does. Each form is compared with eager in values and in
the gradients of every input (A_log, the Δ projection, u, B, C, D); the near misses keep eager's
values and say why.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._higher_order_ops.associative_scan import associative_scan
from utils import TOL, rel_err, scan_bdl

import ssm_compile

BATCH, DIM, N, L = 2, 6, 4, 7
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


def _rate(A_log):
    """The user's A, as the exponent broadcasts it: (dim, 1) and (1, N) as they are, (dim,) as A[:, None]."""
    A = -torch.exp(A_log)
    return A.unsqueeze(-1) if A.dim() == 1 else A


def loop_bdl(u, dt, A_log, B, C, D):
    """(batch, dim, L) activations, exp(Δ·A) and Δ·B·u precomputed, einsum readout."""
    delta = F.softplus(dt)
    dA = torch.exp(delta[..., None] * _rate(A_log)[:, None, :])
    dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
    return scan_bdl(dA, dBu, u, B, C) + u * D[:, None]


def loop_bld(u, dt, A_log, B, C, D):
    """mamba-minimal's layout: u, Δ (batch, L, dim), B, C (batch, L, N)."""
    delta = F.softplus(dt)
    dA = torch.exp(delta.unsqueeze(-1) * _rate(A_log))
    dBu = delta.unsqueeze(-1) * B.unsqueeze(2) * u.unsqueeze(-1)
    h = torch.zeros(u.shape[0], u.shape[2], B.shape[-1])
    ys = []
    for t in range(u.shape[1]):
        h = dA[:, t] * h + dBu[:, t]
        ys.append((h @ C[:, t, :, None]).squeeze(-1))
    return torch.stack(ys, dim=1) + u * D


def loop_step(u, dt, A_log, B, C, D):
    """The discretisation in the step, from time slices."""
    delta = F.softplus(dt)
    A = _rate(A_log)
    h = u.new_zeros(u.shape[0], u.shape[1], B.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = torch.exp(delta[:, :, i, None] * A) * h + (delta[:, :, i] * u[:, :, i])[..., None] * B[:, None, :, i]
        ys.append((h * C[:, None, :, i]).sum(-1))
    return torch.stack(ys, dim=-1) + u * D[:, None]


def loop_mixed(u, dt, A_log, B, C, D):
    """The decay computed in the step, the input term precomputed."""
    delta = F.softplus(dt)
    A = _rate(A_log)
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    h = u.new_zeros(u.shape[0], u.shape[1], B.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = torch.exp(delta[:, :, i, None] * A) * h + dBu[:, :, i]
        ys.append((h * C[:, None, :, i]).sum(-1))
    return torch.stack(ys, dim=-1) + u * D[:, None]


def loop_buffer(u, dt, A_log, B, C, D):
    """The states written into a preallocated buffer, ``H[:, :, t] = h``, read out after the loop."""
    delta = F.softplus(dt)
    dA = torch.exp(delta[..., None] * _rate(A_log)[:, None, :])
    dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
    h = u.new_zeros(u.shape[0], u.shape[1], B.shape[1])
    H = u.new_zeros(u.shape[0], u.shape[1], u.shape[2], B.shape[1])
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        H[:, :, t] = h
    return torch.einsum("bdln,bnl->bdl", H, C) + u * D[:, None]


def _combine(left, right):
    return left[0] * right[0], right[0] * left[1] + right[1]


def assoc(u, dt, A_log, B, C, D):
    """torch's associative_scan over (exp(Δ·A), Δ·B·u): the decay keeps its size-1 axis."""
    delta = F.softplus(dt)
    dA = torch.exp(delta[..., None] * _rate(A_log)[:, None, :])
    dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
    states = associative_scan(_combine, (dA, dBu), dim=2, combine_mode="generic")[1]
    return (states * C.transpose(1, 2)[:, None]).sum(-1) + u * D[:, None]


LAYOUT = {loop_bld: "bld"}
FAMILY = {assoc: "scan_assoc"}
A_SHAPES = {"dim-1": (DIM, 1), "dim-unsqueezed": (DIM,), "1-N": (1, N)}


def make_args(fn, a_shape, dtype=torch.float32, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(BATCH, DIM, L, generator=g)
    dt = torch.randn(BATCH, DIM, L, generator=g) - 1.0
    A_log = torch.randn(*a_shape, generator=g) * 0.5
    B = torch.randn(BATCH, n, L, generator=g)
    C = torch.randn(BATCH, n, L, generator=g)
    D = torch.randn(DIM, generator=g)
    if LAYOUT.get(fn) == "bld":
        u, dt, B, C = (x.transpose(1, 2).contiguous() for x in (u, dt, B, C))
    u, dt, B, C = (x.to(dtype) for x in (u, dt, B, C))
    return tuple(x.requires_grad_() for x in (u, dt, A_log, B, C, D))


def _report(fn, args):
    torch._dynamo.reset()
    return ssm_compile.explain(fn, *[a.detach() for a in args])


def _compiled(fn, args):
    torch._dynamo.reset()
    return torch.compile(fn, backend="ssm")(*args)


def _grads(out, args, v):
    return torch.autograd.grad(out, args, v)


def _misses(report):
    return [f"[{m.family}] {m.reason}" for m in report.misses]


def _check_rewritten(fn, args, family="scan_loop"):
    """One rewrite of ``family`` and no near-miss; values and the gradients of every input as eager's."""
    report = _report(fn, args)
    assert [r.family for r in report.rewrites].count(family) == 1, str(report)
    assert not _misses(report), _misses(report)
    ref = fn(*args)
    out = _compiled(fn, args)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    v = torch.randn_like(ref)
    for name, o, r in zip("u dt A_log B C D".split(), _grads(out, args, v), _grads(ref, args, v)):
        assert o.shape == r.shape, name
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("a_shape", list(A_SHAPES.values()), ids=list(A_SHAPES))
@pytest.mark.parametrize("fn", [loop_bdl, loop_bld, loop_step, loop_mixed, loop_buffer, assoc],
                         ids=lambda f: f.__name__)
def test_broadcast_decay_is_rewritten_with_eager_values_and_gradients(fn, a_shape):
    _check_rewritten(fn, make_args(fn, a_shape), FAMILY.get(fn, "scan_loop"))


@pytest.mark.parametrize("a_shape, stride", [((DIM, 1), (1, 0)), ((DIM,), (1, 0)), ((1, N), (0, 1))],
                         ids=list(A_SHAPES))
def test_the_kernels_read_the_users_A_through_the_stride_0_expand(a_shape, stride):
    # The op's A is a view of the user's (no copy, which would lose the gradient path or cost
    # memory); the CPU path and the Triton kernels (on CPU tensors in the interpreter here) read
    # it as they read the same A made dense, and dA comes back dense for the expand to sum.
    from utils import PassCapture

    from ssm_compile.kernels.selective_scan.triton_bwd import selective_scan_bwd
    from ssm_compile.kernels.selective_scan.triton_fwd import selective_scan_fwd
    from ssm_compile.passes import scan_loop
    from ssm_compile.passes.fx_utils import val

    args = make_args(loop_step, a_shape)
    cap = PassCapture(scan_loop)
    torch._dynamo.reset()
    torch.compile(loop_step, backend=cap, fullgraph=True)(*args)
    ops = [n for n in cap.gm.graph.nodes if n.target is torch.ops.ssm.selective_scan.default]
    assert len(ops) == 1, cap.ctx.misses
    assert tuple(val(ops[0].args[2]).shape) == (DIM, N) and val(ops[0].args[2]).stride() == stride

    g = torch.Generator().manual_seed(3)
    u, delta, dy = (torch.randn(BATCH, DIM, L, generator=g) for _ in range(3))
    B, C = (torch.randn(BATCH, N, L, generator=g) for _ in range(2))
    A = _rate(args[2].detach()).expand(DIM, N)
    assert A.stride() == stride
    dense = A.contiguous()
    y, last = torch.ops.ssm.selective_scan(u, delta, A, B, C, None, None, None, True, None, True)
    y_ref, last_ref = torch.ops.ssm.selective_scan(u, delta, dense, B, C, None, None, None, True, None, True)
    torch.testing.assert_close((y, last), (y_ref, last_ref), rtol=0, atol=0)

    # The Triton kernels on the GPU where there is one, else under the interpreter (conftest).
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    u, delta, dy, dense = (t.to(dev) for t in (u, delta, dy, dense))
    A = _rate(args[2].detach().to(dev)).expand(DIM, N)  # (a copy of a stride-0 view is dense)
    assert A.stride() == stride
    B, C = B[:, None].to(dev), C[:, None].to(dev)  # the kernels' grouped layout, one group
    y, last = selective_scan_fwd(u, delta, A, B, C, None, None, None, True, None, True)
    torch.testing.assert_close((y.cpu(), last.cpu()), (y_ref, last_ref), rtol=1e-5, atol=1e-5)
    grads = selective_scan_bwd(dy, None, u, delta, A, B, C, None, None, None, True, None)
    ref = selective_scan_bwd(dy, None, u, delta, dense, B, C, None, None, None, True, None)
    assert grads.dA.is_contiguous() and grads.dA.shape == (DIM, N)
    for name in ("du", "ddelta", "dA", "dB", "dC"):
        torch.testing.assert_close(getattr(grads, name), getattr(ref, name), rtol=0, atol=0, msg=name)


def step_exp_unsqueezed(u, dt, A_log, B, C, D):
    """A (dim,): the decay exp(Δ[t]·A) made per channel, then unsqueezed over the states."""
    delta = F.softplus(dt)
    A = -torch.exp(A_log)
    h = u.new_zeros(u.shape[0], u.shape[1], B.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = torch.exp(delta[:, :, i] * A).unsqueeze(-1) * h + (delta[:, :, i] * u[:, :, i]).unsqueeze(-1) * B[:, None, :, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]))
    return torch.stack(ys, dim=-1) + u * D[:, None]


def full_exp_unsqueezed(u, dt, A_log, B, C, D):
    """A (dim,): exp(Δ·A) precomputed as (batch, dim, L), then given a size-1 state axis."""
    delta = F.softplus(dt)
    dA = torch.exp(delta * -torch.exp(A_log)[:, None]).unsqueeze(-1)
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    return scan_bdl(dA, dBu, u, B, C) + u * D[:, None]


HEADS, HEADDIM = 2, 3


def flat_mamba2(x, dt, A_log, B, C, D):
    """A Mamba-2 block flattened to Mamba-1: x (batch, L, heads, headdim), one decay per head
    repeated to its channels and read as A[:, None], one group of B and C (batch, L, N)."""
    b, length = x.shape[:2]
    u = x.reshape(b, length, -1).transpose(1, 2)
    delta = F.softplus(dt).repeat_interleave(HEADDIM, dim=-1).transpose(1, 2)
    A = -torch.exp(A_log).repeat_interleave(HEADDIM)
    h = u.new_zeros(b, u.shape[1], B.shape[-1])
    ys = []
    for t in range(length):
        h = torch.exp(delta[:, :, t, None] * A[:, None]) * h + delta[:, :, t, None] * B[:, t, None, :] * u[:, :, t, None]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, -1) + D.repeat_interleave(HEADDIM)[:, None] * u


def _flat_mamba2_args():
    g = torch.Generator().manual_seed(1)
    return tuple(x.requires_grad_() for x in (
        torch.randn(BATCH, L, HEADS, HEADDIM, generator=g), torch.randn(BATCH, L, HEADS, generator=g) - 1.0,
        torch.randn(HEADS, generator=g) * 0.5, torch.randn(BATCH, L, N, generator=g),
        torch.randn(BATCH, L, N, generator=g), torch.randn(HEADS, generator=g)))


@pytest.mark.parametrize("fn", [step_exp_unsqueezed, full_exp_unsqueezed, flat_mamba2], ids=lambda f: f.__name__)
def test_a_decay_per_channel_unsqueezed_is_rewritten(fn):
    _check_rewritten(fn, _flat_mamba2_args() if fn is flat_mamba2 else make_args(fn, (DIM,)))


def test_bf16_activations_match_fp64():
    # bf16 u, Δ projection, B and C upcast in the program as selective_scan_ref does; A (dim, 1).
    def fn(u, dt, A_log, B, C, D):
        delta = F.softplus(dt.float())
        dA = torch.exp(delta.unsqueeze(-1) * -torch.exp(A_log))
        dBu = delta.unsqueeze(-1) * B.float().unsqueeze(2) * u.float().unsqueeze(-1)
        h = torch.zeros(u.shape[0], u.shape[2], B.shape[-1])
        ys = []
        for t in range(u.shape[1]):
            h = dA[:, t] * h + dBu[:, t]
            ys.append((h * C[:, t, None, :].float()).sum(-1))
        return (torch.stack(ys, dim=1) + u.float() * D).to(u.dtype)

    LAYOUT[fn] = "bld"
    try:
        args = make_args(fn, (DIM, 1), dtype=torch.bfloat16)
    finally:
        del LAYOUT[fn]
    report = _report(fn, args)
    assert [r.family for r in report.rewrites].count("scan_loop") == 1, str(report)
    wide = tuple(a.detach().double().requires_grad_() for a in args)
    ref = fn(*wide)
    out = _compiled(fn, args)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= TOL[torch.bfloat16]
    v = torch.randn(ref.shape, dtype=torch.float64)
    for name, o, r in zip("u dt A_log B C D".split(), _grads(out, args, v.to(out.dtype)), _grads(ref, wide, v)):
        assert rel_err(o, r) <= TOL[torch.bfloat16], name


def test_a_real_state_of_size_one_is_rewritten():
    # N = 1: a (dim, 1) A is a (dim, N) A as it is; no axis is broadcast.
    args = make_args(loop_step, (DIM, 1), n=1)
    report = _report(loop_step, args)
    assert [r.family for r in report.rewrites].count("scan_loop") == 1, str(report)
    ref = loop_step(*args)
    out = _compiled(loop_step, args)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    v = torch.randn_like(ref)
    for o, r in zip(_grads(out, args, v), _grads(ref, args, v)):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)


# --- near misses ------------------------------------------------------------------------------

def no_state_axis_from_B(u, dt, A_log, B, C, D):
    """A (dim, 1), and an input term with no state axis either (B summed to one value per step):
    the state's N axis comes from its zeros alone, not from B."""
    delta = F.softplus(dt)
    dA = torch.exp(delta[..., None] * -torch.exp(A_log)[:, None, :])
    dBu = (delta * u * B.sum(1)[:, None])[..., None]
    return scan_bdl(dA, dBu, u, B, C)


def shared_B_and_A(u, dt, A_log, B, C, D):
    """A (1, N) and a B (N,) for every batch element and step: nothing tells Δ's batch axis from
    its channel axis (A has no channel axis, B no batch axis)."""
    delta = F.softplus(dt)
    A = -torch.exp(A_log)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = torch.exp(delta[:, :, i, None] * A) * h + (delta[:, :, i] * u[:, :, i])[..., None] * B[0, :, 0]
        ys.append((h * C[:, None, :, i]).sum(-1))
    return torch.stack(ys, dim=-1)


def decay_shared_by_channels_and_states(u, dt, A_log, B, C, D):
    """Δ without a channel axis (one per batch element and step) and A (1, 1), through
    associative_scan: the decay is the same for every channel and state, which is no exp(Δ·A) of
    the op (its Δ is per channel). (A loop's update broadcasting it along two axes is refused
    before the proof.)"""
    delta = F.softplus(dt[:, 0])
    dA = torch.exp(delta[:, None, :, None] * -torch.exp(A_log))
    dBu = (delta[:, None] * u)[..., None] * B.transpose(1, 2)[:, None]
    states = associative_scan(_combine, (dA, dBu), dim=2, combine_mode="generic")[1]
    return (states * C.transpose(1, 2)[:, None]).sum(-1)


def delta_shared_by_the_batch(u, dt, A_log, B, C, D):
    """A (dim,) as A[:, None], and a Δ with no batch axis (one per channel and step, the same for
    every sequence), through associative_scan: the op's Δ is per batch element."""
    delta = F.softplus(dt[0])
    dA = torch.exp(delta[None, :, :, None] * (-torch.exp(A_log))[:, None, None])
    dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
    states = associative_scan(_combine, (dA, dBu), dim=2, combine_mode="generic")[1]
    return (states * C.transpose(1, 2)[:, None]).sum(-1)


@pytest.mark.parametrize("fn, a_shape, reason", [
    (no_state_axis_from_B, (DIM, 1), "the state update broadcasts: A_full[t], B_full[t] and h_t differ in shape"),
    (shared_B_and_A, (1, N), "nothing in the step tells Δ's batch axis from its channel axis"),
    (decay_shared_by_channels_and_states, (1, 1),
     "A_full: A must be indexed by (dim, state) and Δ by (batch, dim, time) (A has shape (1, 1): its size-1 axis "
     "0 indexes nothing, so it reads as a broadcast axis, and A's roles are proved only where Δ has a batch and a "
     "channel axis besides time"),
    (delta_shared_by_the_batch, (DIM,),
     "A_full: A must be indexed by (dim, state) and Δ by (batch, dim, time) (A is neg, of shape (6,), broadcast "
     "over the state axis: one decay per channel, as a flattened Mamba-2's scalar decay per head, which is proved "
     "only where Δ has a batch and a channel axis besides time"),
], ids=["no-N-from-B", "batch-or-channel", "no-channel-axis", "no-batch-axis"])
def test_near_misses_keep_eager_values_and_say_why(fn, a_shape, reason):
    args = make_args(fn, a_shape)
    report = _report(fn, args)
    assert not report.rewrites, str(report)
    text = "\n".join(_misses(report))
    assert reason in text, text
    with torch.no_grad():
        torch.testing.assert_close(_compiled(fn, args), fn(*args), rtol=1e-5, atol=1e-5)
