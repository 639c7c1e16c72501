"""Probe DB (run 69): recurrences of other models that look like Mamba-1 (minGRU/minLSTM, Griffin's
RG-LRU, LRU, S5, S4D-ZOH, HGRN, GateLoop, RetNet, GLA, Mamba-2 SSD, RWKV-4/6) and Mamba-1 steps
with one change each (Δ²·B·u, Δ·B·u·u, exp(Δ·A)·0.99, a clamped state, a second state feeding
the first, y read before and after the update), as loops, ``associative_scan`` and cumsum /
cumprod closed forms. None was rewritten into an ssm op; each gave eager's values and gradients
in fp64, and the Mamba-like ones a true reason. What the probe found:

- HF Zamba's per-head x_proj/dt_proj (one weight per head, applied to every head at once by a
  batched matmul ``W[:, None] @ x``; one scan per head on ``time_step[head]``): x_dt_proj gave no
  reason. It now names the batched products (``x_dt_proj._per_head_products``).
- RWKV-4's WKV loop: its ``exp(k[:, t]) * v[:, t]``, a product of one step's inputs, was taken
  for a scan's first step and got "no state chain: step 1's exp(...) is not step 0's with every
  time index + 1", which is false (it is, and there is no state). Such a product now gets no
  reason of its own; the decayed states ``a`` and ``b`` keep theirs.
- A second Mamba state started from ``torch.zeros_like(h)`` and added into h's update: "the state
  update uses an op that is not an elementwise add/mul (zeros_like)", which no step does. The
  reason now says that a tensor of h's shape starts a second recurrence that h's update reads.
- A decode step that returns ``state * exp(dt·A) * 0.99 + dt·B·x`` was left alone with no reason
  (the ``copy_`` form of the same step had one); it now says the decay is exp(dt·A) times a factor.
- A Mamba-1 scan that calls ``F.softplus(dt)`` once for the decay and again for the input term
  (the same Δ, two nodes) was left alone with "none of which is A_full's Δ ... or another Δ?"; the
  reason now says the Δ is computed twice and that computing it once gets the scan rewritten.
"""
import torch
import torch.nn.functional as F

import ssm_compile
from ssm_compile.report import explain

HEADS, BATCH, HEAD_DIM, L, R, N = 2, 2, 3, 5, 2, 3


def per_head_projections(x, W_x, W_dt, A_log, D):
    """Zamba's mixer between its conv and its scans (sizes shrunk): x is (heads, batch, hd, L)."""
    params = (W_x[:, None] @ x).transpose(-1, -2)            # (heads, batch, L, R + 2N)
    dt, B, C = torch.split(params, [R, N, N], dim=-1)
    dt = W_dt[:, None] @ dt.transpose(-1, -2)                # (heads, batch, hd, L)
    A = -torch.exp(A_log)
    ys = [ssm_compile.selective_scan_fn(x[h], dt[h], A[h], B[h].transpose(1, 2), C[h].transpose(1, 2), D[h],
                                        delta_softplus=True) for h in range(HEADS)]
    return torch.cat(ys, 1)


def test_per_head_batched_x_and_dt_proj_get_a_reason():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(HEADS, BATCH, HEAD_DIM, L, generator=g), torch.randn(HEADS, R + 2 * N, HEAD_DIM, generator=g),
            torch.randn(HEADS, HEAD_DIM, R, generator=g), torch.rand(HEADS, HEAD_DIM, N, generator=g).log(),
            torch.randn(HEADS, HEAD_DIM, generator=g)]
    report = explain(per_head_projections, *args)
    assert not report.counts.get("x_dt_proj"), report.format(graphs=False)
    reasons = [m.reason for m in report.misses if m.family == "x_dt_proj"]
    assert len(reasons) == HEADS and all("batched over heads" in r and "one 2-D weight per product" in r
                                         for r in reasons), report.format(graphs=False)
    torch.testing.assert_close(report.output, per_head_projections(*args), rtol=1e-6, atol=1e-6)


def rwkv4_wkv(k, v, w, u):
    """RWKV-4's WKV in its naive form: two states with one time-invariant decay exp(-exp(w))."""
    decay = torch.exp(-torch.exp(w))
    a = k.new_zeros(k.shape[0], k.shape[2])
    b = k.new_zeros(k.shape[0], k.shape[2])
    outs = []
    for t in range(k.shape[1]):
        ek, euk = torch.exp(k[:, t]), torch.exp(u + k[:, t])
        outs.append((a + euk * v[:, t]) / (b + euk))
        a = decay * a + ek * v[:, t]
        b = decay * b + ek
    return torch.stack(outs, 1)


def test_rwkv4_input_products_get_no_state_chain_reason():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(BATCH, L, HEAD_DIM, generator=g), torch.randn(BATCH, L, HEAD_DIM, generator=g),
            torch.randn(HEAD_DIM, generator=g), torch.randn(HEAD_DIM, generator=g)]
    report = explain(rwkv4_wkv, *args)
    assert not report.counts, report.format(graphs=False)
    assert report.misses and not any("no state chain" in m.reason for m in report.misses), report.format(graphs=False)
    assert all("whose Δ has no time axis" in m.reason for m in report.misses), report.format(graphs=False)
    torch.testing.assert_close(report.output, rwkv4_wkv(*args), rtol=0, atol=0)


def second_state_feeds_first(u, dt, A_log, B, C):
    """A Mamba-1 scan whose update also adds a second Mamba state h2 (not one selective scan)."""
    delta = F.softplus(dt)
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, -torch.exp(A_log)))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    h = u.new_zeros(u.shape[0], u.shape[1], A_log.shape[1])
    h2 = torch.zeros_like(h)
    ys = []
    for t in range(u.shape[2]):
        h2 = dA[:, :, t] * h2 + dBu[:, :, t]
        h = dA[:, :, t] * h + dBu[:, :, t] + 0.5 * h2
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, 2)


def test_second_state_from_zeros_like_is_named():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(BATCH, HEAD_DIM, L, generator=g), torch.randn(BATCH, HEAD_DIM, L, generator=g),
            torch.rand(HEAD_DIM, N, generator=g).log(), torch.randn(BATCH, N, L, generator=g),
            torch.randn(BATCH, N, L, generator=g)]
    report = explain(second_state_feeds_first, *args)
    assert not report.counts, report.format(graphs=False)
    assert any("zeros_like of the state: a second recurrence" in m.reason for m in report.misses
               if m.family == "scan_loop"), report.format(graphs=False)
    torch.testing.assert_close(report.output, second_state_feeds_first(*args), rtol=0, atol=0)


def leaky_decode_step(state, x, dt, A_log, B, C):
    """One Mamba-1 decode step whose decay is exp(Δ·A)·0.99 (not the op's function)."""
    delta = F.softplus(dt)
    dA = torch.exp(delta[..., None] * -torch.exp(A_log)) * 0.99
    state = state * dA + delta[..., None] * B[:, None, :] * x[..., None]
    return (state * C[:, None, :]).sum(-1), state


def test_scaled_decode_decay_gets_a_reason():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(BATCH, HEAD_DIM, N, generator=g), torch.randn(BATCH, HEAD_DIM, generator=g),
            torch.randn(BATCH, HEAD_DIM, generator=g), torch.rand(HEAD_DIM, N, generator=g).log(),
            torch.randn(BATCH, N, generator=g), torch.randn(BATCH, N, generator=g)]
    report = explain(leaky_decode_step, *args)
    assert not report.counts, report.format(graphs=False)
    assert [m.family for m in report.misses] == ["state_update"], report.format(graphs=False)
    assert "times another factor, not exp(dt * A)" in report.misses[0].reason, report.format(graphs=False)
    for got, want in zip(report.output, leaky_decode_step(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def delta_computed_twice(u, dt, A_log, B, C):
    """A Mamba-1 scan whose Δ = softplus(dt) is computed once for each term."""
    dA = torch.exp(torch.einsum("bdl,dn->bdln", F.softplus(dt), -torch.exp(A_log)))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", F.softplus(dt), B, u)
    h = u.new_zeros(u.shape[0], u.shape[1], A_log.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, 2)


def test_delta_computed_twice_is_named():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(BATCH, HEAD_DIM, L, generator=g), torch.randn(BATCH, HEAD_DIM, L, generator=g),
            torch.rand(HEAD_DIM, N, generator=g).log(), torch.randn(BATCH, N, L, generator=g),
            torch.randn(BATCH, N, L, generator=g)]
    report = explain(delta_computed_twice, *args)
    assert not report.counts, report.format(graphs=False)
    assert any("is a second call of softplus on A_full's Δ's inputs" in m.reason for m in report.misses
               if m.family == "scan_loop"), report.format(graphs=False)
    torch.testing.assert_close(report.output, delta_computed_twice(*args), rtol=0, atol=0)
