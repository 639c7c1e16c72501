"""Probe CS (run 63): reverse loops that stop before step 0 (``range(L-1, 0, -1)``).

- Storing each output at ``Y[:, :, t]`` (or each state at ``H[:, :, t]``) of a buffer as long as
  the input was left alone as "step 0's output is stored at the wrong place of the output buffer
  (index 7 of axis 2)": false, index L-1 is where the walk's first step belongs. The true reason
  is that slot 0 is never written by the loop (it keeps the buffer's zeros), which the op's output,
  one value per step walked, does not hold. (Run 65: the outputs' buffer is now rewritten, each
  stored y_t replaced by the op's y at t and slot 0 left as it was: test_step_readouts.py.)
- The skip after such a loop's stacked outputs, ``+ u[:, :, 1:] * D``, was refused as "the skip
  multiplies getitem_N, not the scan's u" although ``u[:, :, 1:]`` is the u that loop scans (the op
  reads ``u.narrow(2, -7, 7)`` flipped). It now folds into the op.
- Δ = softplus(...) rolled by whole turns (``roll(0, -1)``, ``roll(dim, -1)``) was said to be
  "rolled along channels ... delta_bias would have to move", and flipped twice along channels it
  got no delta reason at all: both move nothing, and the reason now says so (Δ is not folded).
- transformers 4.39's conv step whose rolled copy of one cache is copied into another got no
  conv_update near-miss at all; it now has one.

Each rewrite is checked against fp64 eager, values and gradients; each near-miss gives eager's
result bit for bit (the skip left alone beside a rewritten loop: eager's in fp64).
"""
import pytest
import torch
import torch.nn.functional as F
from utils import TOL, check_explained_against_fp64, rel_err

from ssm_compile.kernels.selective_scan.op import selective_scan_fn
from ssm_compile.report import explain

BATCH, DIM, L, N = 2, 5, 8, 4


def make_inputs(seed=0):
    """u, Δ, A, B, C, D in the (batch, dim, L) layout."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, DIM, L, generator=g), F.softplus(torch.randn(BATCH, DIM, L, generator=g)),
            -torch.rand(DIM, N, generator=g) - 0.5, torch.randn(BATCH, N, L, generator=g),
            torch.randn(BATCH, N, L, generator=g), torch.randn(DIM, generator=g))


def _disc(u, delta, A, B):
    return torch.exp(torch.einsum("bdl,dn->bdln", delta, A)), torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)


def outputs_into_buffer(u, delta, A, B, C, D):
    dA, dBu = _disc(u, delta, A, B)
    h = u.new_zeros(BATCH, DIM, N)
    Y = torch.zeros_like(u)
    for t in range(L - 1, 0, -1):
        h = dA[:, :, t] * h + dBu[:, :, t]
        Y[:, :, t] = torch.einsum("bdn,bn->bd", h, C[:, :, t])
    return Y


def states_into_buffer(u, delta, A, B, C, D):
    dA, dBu = _disc(u, delta, A, B)
    h = u.new_zeros(BATCH, DIM, N)
    H = u.new_zeros(BATCH, DIM, L, N)
    for t in range(L - 1, 0, -1):
        h = dA[:, :, t] * h + dBu[:, :, t]
        H[:, :, t] = h
    return torch.einsum("bdln,bnl->bdl", H, C)


@pytest.mark.parametrize("fn, reason", [
    (states_into_buffer,
     "the loop walks the states' buffer back from index 7 to index 1 of axis 2 (length 8): index 0 is never "
     "written by the loop and keeps what the buffer held before it; the op's output holds one value per step walked"),
])
def test_reverse_walk_stopping_before_step_0_into_a_buffer_names_the_unwritten_slot(fn, reason):
    args = make_inputs()
    report = explain(fn, *args)
    assert "scan_loop" not in report.counts, report.format(graphs=False)
    assert reason in [m.reason for m in report.misses if m.family == "scan_loop"], report.format(graphs=False)
    assert torch.equal(report.output, fn(*args))


def _reverse_suffix(u, delta, A, B, C):
    dA, dBu = _disc(u, delta, A, B)
    h = u.new_zeros(BATCH, DIM, N)
    ys = []
    for t in range(L - 1, 0, -1):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.insert(0, torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, -1)


def skip_sliced(u, delta, A, B, C, D):
    return _reverse_suffix(u, delta, A, B, C) + u[:, :, 1:] * D[:, None]


def skip_ellipsis(u, delta, A, B, C, D):
    return _reverse_suffix(u, delta, A, B, C) + D[:, None] * u[..., 1:]


def skip_narrowed(u, delta, A, B, C, D):
    return _reverse_suffix(u, delta, A, B, C) + u.narrow(-1, 1, L - 1) * D[:, None]


@pytest.mark.parametrize("fn", [skip_sliced, skip_ellipsis, skip_narrowed])
def test_skip_over_the_steps_a_reverse_suffix_loop_scans_folds(fn):
    args = [a.clone().requires_grad_() for a in make_inputs(1)]
    report = explain(fn, *args)
    assert report.counts.get("scan_loop") == 1 and report.counts.get("skip") == 1, report.format(graphs=False)
    assert not [m for m in report.misses if m.family == "skip"], report.format(graphs=False)
    check_explained_against_fp64(report, fn, args)


def test_skip_over_other_steps_than_the_loop_scans_is_not_folded():
    """``u[:, :, :-1]`` has the loop's length but holds steps 0..L-2, not the steps 1..L-1 it scans."""
    def fn(u, delta, A, B, C, D):
        return _reverse_suffix(u, delta, A, B, C) + u[:, :, :-1] * D[:, None]

    args = make_inputs(2)
    report = explain(fn, *args)
    assert report.counts.get("scan_loop") == 1 and "skip" not in report.counts, report.format(graphs=False)
    assert any("not the scan's u" in m.reason for m in report.misses if m.family == "skip"), report.format(graphs=False)
    assert rel_err(report.output, fn(*[a.double() for a in args])) <= TOL[torch.float32]


R, DT_IN = 3, 8


def _delta_program(reorder):
    """A block's x_proj / dt_proj / softplus, Δ reordered by ``reorder`` in the (batch, L, dim) layout."""
    def fn(x, w_x, w_dt, bias, A):
        dt, B, C = F.linear(x, w_x).split([R, N, N], dim=-1)
        delta = reorder(F.softplus(F.linear(dt, w_dt, bias))).transpose(1, 2)
        return selective_scan_fn(x.transpose(1, 2), delta, A, B.transpose(1, 2), C.transpose(1, 2))
    return fn


def _delta_inputs():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(BATCH, L, DT_IN, generator=g), 0.3 * torch.randn(R + 2 * N, DT_IN, generator=g),
            torch.randn(DT_IN, R, generator=g), torch.randn(DT_IN, generator=g),
            -torch.rand(DT_IN, N, generator=g) - 0.5)


_IDENTITY = ("which moves nothing: the fold follows Δ back to the softplus only through views and flips of time, "
             "and does not read {} as the identity; the softplus stays where it is")


@pytest.mark.parametrize("reorder, reason", [
    (lambda d: d.roll(0, -1), "rolled along channels (roll), " + _IDENTITY.format("a roll")),
    (lambda d: d.roll(DT_IN, -1), "rolled along channels (roll), " + _IDENTITY.format("a roll")),
    (lambda d: torch.roll(d, BATCH * L * DT_IN),
     "rolled as one flat row of elements (roll), " + _IDENTITY.format("a roll")),
    (lambda d: d.flip(-1).flip(-1),
     "flipped twice along channels (flip, flip_1), " + _IDENTITY.format("the two flips")),
], ids=["roll0", "roll_dim", "roll_flat_numel", "flip_twice"])
def test_delta_reordered_by_an_identity_is_named_as_one(reorder, reason):
    """A roll by whole turns, or the same flip twice, leaves Δ as it is: the reason says so, not
    that Δ moved along channels (which would need delta_bias to move with it). Δ is not folded."""
    fn, args = _delta_program(reorder), _delta_inputs()
    report = explain(fn, *args)
    (miss,) = [m for m in report.misses if m.family == "delta"]
    assert miss.reason.endswith(reason) and "delta_bias" not in miss.reason, miss.reason
    assert "delta" not in report.counts, report.format(graphs=False)
    assert torch.equal(report.output, fn(*args))


def test_delta_rolled_by_one_keeps_the_channels_reason():
    fn, args = _delta_program(lambda d: d.roll(1, -1)), _delta_inputs()
    (miss,) = [m for m in explain(fn, *args).misses if m.family == "delta"]
    assert "moves nothing" not in miss.reason and "delta_bias would have to move" in miss.reason, miss.reason


def test_rolled_window_copied_into_another_cache_gets_a_conv_update_reason():
    """transformers 4.39's conv step, its rolled copy of cache ``s`` copied into another cache ``s2``:
    not the op's update (which rolls one cache in place), and now said so. Both caches and the
    output as eager's."""
    def step(x, s, s2, w):
        rolled = torch.roll(s, shifts=-1, dims=-1)
        rolled[:, :, -1] = x[:, :, 0]
        s2.copy_(rolled)
        return F.silu(torch.sum(rolled * w[:, 0, :], dim=-1)).unsqueeze(-1)

    g = torch.Generator().manual_seed(4)
    x, s, s2, w = (torch.randn(BATCH, DIM, 1, generator=g), torch.randn(BATCH, DIM, 4, generator=g),
                   torch.randn(BATCH, DIM, 4, generator=g), torch.randn(DIM, 1, 4, generator=g))
    caches = (s.clone(), s2.clone())
    with torch.no_grad():
        report = explain(step, x, *caches, w)
        want = step(x, s, s2, w)
    assert "conv_update" not in report.counts, report.format(graphs=False)
    assert [m.reason for m in report.misses if m.family == "conv_update"] == [
        "the rolled window rolled is a roll of l_s_ but is copied into l_s2_, not back into l_s_: the op rolls "
        "one conv state in place, reading and writing the same cache"], report.format(graphs=False)
    assert torch.equal(report.output, want)
    assert torch.equal(caches[0], s) and torch.equal(caches[1], s2)


def test_skip_over_the_scanned_steps_of_a_u_written_in_place_is_not_folded():
    """u written in place between the loop and the skip: ``u[:, :, 1:]`` then holds other values
    than the op read. (Refused by the fold's check of writes to u, which the suffix's reading as
    the op's u relies on.)"""
    def fn(u, delta, A, B, C, D):
        y = _reverse_suffix(u, delta, A, B, C)
        u.mul_(2)
        return y + u[:, :, 1:] * D[:, None]

    args = make_inputs(5)
    report = explain(fn, *[a.clone() for a in args])
    assert "skip" not in report.counts, report.format(graphs=False)
    assert rel_err(report.output, fn(*[a.double() for a in args])) <= TOL[torch.float32]
