"""Probe DB (run 69): recurrences of other models that look like Mamba-1 (minGRU/minLSTM, Griffin's
RG-LRU, LRU, S5, S4D-ZOH, HGRN, GateLoop, RetNet, GLA, Mamba-2 SSD, RWKV-4/6) and Mamba-1 steps
with one change each (Δ²·B·u, Δ·B·u·u, exp(Δ·A)·0.99, a clamped state, a second state feeding
the first, y read before and after the update), as loops, ``associative_scan`` and cumsum /
cumprod closed forms. None was rewritten into an ssm op; each gave eager's values and gradients
in fp64, and the Mamba-like ones a true reason. What the probe found:

- HF Zamba's per-head x_proj/dt_proj (one weight per head, applied to every head at once by a
  batched matmul ``W[:, None] @ x``; one scan per head on ``time_step[head]``): x_dt_proj gave no
  reason. It now names the batched products (``x_dt_proj._per_head_products``).
"""
import torch

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
