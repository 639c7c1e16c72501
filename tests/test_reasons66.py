"""Scan loops that probe CX (run 66) found left alone with false reasons, or missed.

- A decay copied before the loop (``exp(Δ·A).clone()``, ``.to(same dtype, copy=True)``) was
  "not exp(Δ·A)", or a rounding "from torch.float64 to torch.float64": it is the exp itself,
  and is now rewritten. A cast that changes the dtype still names its rounding.
- A readout that is no contraction, when no stack, cat or buffer collects it (summed over time),
  was "intermediate state h_0 is used outside the recurrence"; it now gets the reason the same
  readout gets when stacked.
- Two proved readouts of one state were "used outside the recurrence"; the reason now says the
  state is read out twice.
- A readout's C computed from the previous readout was said to be "the same C at every step".

Rewrites are checked against eager in fp64, values and gradients; refusals keep eager's values.
"""
import pytest
import torch
from utils import check_compiled_against_fp64

from ssm_compile.report import explain

BATCH, DIM, L, N = 2, 4, 6, 3


def inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(BATCH, DIM, L, generator=g, dtype=dtype)
    delta = torch.rand(BATCH, DIM, L, generator=g, dtype=dtype) * 0.5 + 0.05
    A = -(torch.rand(DIM, N, generator=g, dtype=dtype) + 0.5)
    B = torch.randn(BATCH, N, L, generator=g, dtype=dtype)
    C = torch.randn(BATCH, N, L, generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (u, delta, A, B, C)]


def _loop(decay_of, readout=lambda h, C, t: torch.einsum("bdn,bn->bd", h, C[:, :, t]), collect=torch.stack):
    """The textbook loop over a precomputed decay ``decay_of(exp(Δ·A))``; each step's readout
    ``readout(h, C, t)``, collected by ``collect(list)``."""
    def fn(u, delta, A, B, C):
        dA = decay_of(torch.exp(torch.einsum("bdl,dn->bdln", delta, A)))
        dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
        h = u.new_zeros(BATCH, DIM, N)
        ys = []
        for t in range(L):
            h = dA[:, :, t] * h + dBu[:, :, t]
            ys.append(readout(h, C, t))
        return collect(ys)
    return fn


def _stack(ys):
    return torch.stack(ys, -1)


def _sum(ys):
    total = 0
    for y in ys:
        total = total + y
    return total


def _scan_misses(fn, args):
    report = explain(fn, *args)
    torch.testing.assert_close(report.output, fn(*args), rtol=1e-12, atol=1e-12)
    return report, [m.reason for m in report.misses if m.family == "scan_loop"]


@pytest.mark.parametrize("decay_of", [
    lambda dA: dA.clone(),
    lambda dA: dA.clone(memory_format=torch.contiguous_format),
    lambda dA: dA.to(dA.dtype, copy=True),
    lambda dA: dA.contiguous().clone(),
], ids=["clone", "clone-contiguous-format", "to-same-dtype-copy", "contiguous-clone"])
def test_a_copied_decay_is_the_exp(decay_of):
    fn = _loop(decay_of, collect=_stack)
    report = explain(fn, *inputs())
    assert report.counts.get("scan_loop") == 1, report.format(graphs=False)
    check_compiled_against_fp64(fn, inputs(torch.float32))


def test_a_decay_cast_to_another_dtype_names_its_rounding():
    """exp in fp32, widened to fp64: the program's decay holds fp32's rounding, which the op's
    own exp would not have. The reason says so, without claiming the op works in fp32."""
    fn = _loop(lambda dA: dA.float().to(torch.float64), collect=_stack)
    _, reasons = _scan_misses(fn, inputs())
    assert any("cast by" in r and "from torch.float32 to torch.float64" in r for r in reasons), reasons
    assert not any("in fp32 and never rounds" in r for r in reasons), reasons


@pytest.mark.parametrize("readout, says", [
    (lambda h, C, t: torch.einsum("bdn,bn->bd", h[:, :, :2], C[:, :2, t]), "not a contraction of h_t with C_t"),
    (lambda h, C, t: torch.einsum("bdn,bn->bd", h.flip(-1), C[:, :, t]), "not a contraction of h_t with C_t"),
    (lambda h, C, t: torch.einsum("bdn,bn->bd", h.detach(), C[:, :, t]), "detach: the program cuts the gradient"),
], ids=["part-of-the-state", "flipped-state", "detached-state"])
@pytest.mark.parametrize("collect", [_stack, _sum], ids=["stacked", "summed"])
def test_a_readout_that_is_no_contraction_gets_one_reason_however_collected(readout, says, collect):
    """Stacked, these had the reason; summed over time, "h_0 is used outside the recurrence"."""
    _, reasons = _scan_misses(_loop(lambda dA: dA, readout, collect), inputs())
    assert any(says in r for r in reasons), reasons
    assert not any("used outside the recurrence" in r for r in reasons), reasons


def test_two_readouts_of_one_state_say_so():
    def fn(u, delta, A, B, C):
        dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
        dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
        h = u.new_zeros(BATCH, DIM, N)
        ys, zs = [], []
        for t in range(L):
            h = dA[:, :, t] * h + dBu[:, :, t]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
            zs.append(torch.einsum("bdn,bn->bd", h, C[:, :, t].flip(-1)))
        return torch.stack(ys, -1) + 2 * torch.stack(zs, -1)

    _, reasons = _scan_misses(fn, inputs())
    assert any("is read out twice" in r for r in reasons), reasons


def test_a_C_computed_from_the_previous_readout_is_not_called_the_same_at_every_step():
    def fn(u, delta, A, B, C):
        dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
        dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
        h = u.new_zeros(BATCH, DIM, N)
        y = torch.zeros_like(u[:, :, 0])
        ys = []
        for t in range(L):
            h = dA[:, :, t] * h + dBu[:, :, t]
            y = (h * (C[:, None, :, t] + 0.1 * torch.tanh(y)[..., None])).sum(-1)
            ys.append(y)
        return torch.stack(ys, -1)

    _, reasons = _scan_misses(fn, inputs())
    assert reasons and not any("the same C" in r and "at every step:" in r for r in reasons), reasons
    assert any("is no time slice of one tensor" in r for r in reasons), reasons


def test_a_C_read_in_reverse_time_is_not_called_a_lag_alone():
    """``C[:, :, L-1-t]``: step 0 reads index L-1, the only fact the reason states; it was "uses C at
    time t+5", false from step 1 on."""
    fn = _loop(lambda dA: dA, lambda h, C, t: torch.einsum("bdn,bn->bd", h, C[:, :, L - 1 - t]), _stack)
    _, reasons = _scan_misses(fn, inputs())
    assert any(f"reads C at time index {L - 1}, not 0" in r and "reverse time" in r for r in reasons), reasons


def test_a_copy_of_a_returned_decay_is_the_exp_under_grad():
    """The loop reads ``exp(Δ·A).clone()`` and the program returns the exp itself. A copy of a
    caller-visible tensor read under grad is kept where the op would read that tensor; the op
    reads Δ and A, never the exp, so this copy is looked through (it was "not exp(Δ·A)")."""
    def fn(u, delta, A, B, C):
        decay = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
        y = _loop(lambda dA: decay.clone())(u, delta, A, B, C)
        return y, decay

    report = explain(fn, *inputs())
    assert report.counts.get("scan_loop") == 1, report.format(graphs=False)
    check_compiled_against_fp64(fn, inputs(torch.float32))
