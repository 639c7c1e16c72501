"""Probe DA (run 69): Mamba-1 code nobody had shown the passes, found wrong or misreported.

- HF Zamba's decode runs one ``mamba_selective_state_update`` per head on ``cache[:, head]`` of
  one stacked state, each head with its own decay. scan_loop read the heads as a chain whose
  step 1 recomputes its exp and left a ``[scan_loop]`` "no state chain" near-miss, although the
  decode pass then rewrote every head's step: explain reported a recurrence left alone in a graph
  that kept none, and the compiler, reading that miss, compiled Zamba's whole decode graph with
  inductor's CPU vectorisation off (``cpp.simdlen=1``). The miss is now taken off the steps the
  decode pass rewrote (``manager._drop_rewritten_step_chains``).
- HF Jamba normalises x_proj's Δ columns (``dt_layernorm``, a weighted RMS norm) before dt_proj:
  x_dt_proj, which computes dt_proj of the columns themselves, was left alone with no reason
  (only a function one op deep was named). A function of the columns within a few ops is now
  named (``x_dt_proj._deep_function``).
"""
import torch
import torch.nn.functional as F

from ssm_compile.kernels.decode import op as decode_op
from ssm_compile.report import explain

HEADS, BATCH, DIM, N = 2, 2, 3, 4


def per_head_decode(state, x, dt, A_log, B, C, dt_bias):
    """Zamba's decode step (sizes shrunk): the heads' states are slices of one (batch, heads,
    dim, N) cache, each updated in place by its own step."""
    A = -torch.exp(A_log.float())
    outs = []
    for head in range(HEADS):
        s = state[:, head]
        delta = F.softplus(dt[head] + dt_bias[head])
        dA = torch.exp(delta[..., None] * A[head])
        dBx = (delta[..., None] * B[head][:, None, :]) * x[head][..., None]
        s.copy_(s * dA + dBx)
        outs.append(torch.matmul(s, C[head][..., None]).squeeze(-1).unsqueeze(-1))
    return torch.cat(outs, 1)


def test_per_head_decode_steps_leave_no_scan_loop_miss():
    decode_op.register()
    g = torch.Generator().manual_seed(0)
    state = torch.randn(BATCH, HEADS, DIM, N, generator=g)
    args = [torch.randn(HEADS, BATCH, DIM, generator=g), torch.randn(HEADS, BATCH, DIM, generator=g),
            torch.rand(HEADS, DIM, N, generator=g).log(), torch.randn(HEADS, BATCH, N, generator=g),
            torch.randn(HEADS, BATCH, N, generator=g), torch.randn(HEADS, DIM, generator=g)]
    want_state = state.clone()
    want = per_head_decode(want_state, *args)
    got_state = state.clone()
    report = explain(per_head_decode, got_state, *args)
    assert report.counts == {"state_update": HEADS}, report.format(graphs=False)
    assert not report.misses, report.format(graphs=False)
    assert "cpp.simdlen" not in report.graphs[0].options.get("inductor_config", {}), report.graphs[0].options
    torch.testing.assert_close(report.output, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_state, want_state, rtol=1e-6, atol=1e-6)


# --- x_dt_proj: dt_proj of a normed Δ (HF Jamba's dt_layernorm) -----------------------------

class NormedDtBlock(torch.nn.Module):
    """mamba-minimal's block with Jamba's weighted RMS norm on x_proj's Δ columns before dt_proj."""

    def __init__(self, dim=8, n=4, rank=2):
        super().__init__()
        self.rank, self.n = rank, n
        self.x_proj = torch.nn.Linear(dim, rank + 2 * n, bias=False)
        self.dt_proj = torch.nn.Linear(rank, dim)
        self.dt_norm = torch.nn.Parameter(torch.rand(rank) + 0.5)
        self.A_log = torch.nn.Parameter(torch.rand(dim, n).log())

    def forward(self, x):  # (batch, L, dim)
        dt, B, C = self.x_proj(x).split([self.rank, self.n, self.n], dim=-1)
        dt = self.dt_norm * (dt * torch.rsqrt(dt.pow(2).mean(-1, keepdim=True) + 1e-6))
        delta = F.softplus(self.dt_proj(dt))
        dA = torch.exp(delta[..., None] * -torch.exp(self.A_log))
        dBu = delta[..., None] * B[:, :, None, :] * x[..., None]
        h = x.new_zeros(x.shape[0], x.shape[2], self.n)
        ys = []
        for t in range(x.shape[1]):
            h = dA[:, t] * h + dBu[:, t]
            ys.append((h * C[:, t, None, :]).sum(-1))
        return torch.stack(ys, 1)


def test_dt_proj_of_a_normed_delta_says_why_x_dt_proj_is_left_alone():
    """The norm is several ops deep: x_dt_proj, which computes dt_proj of the columns themselves,
    was left alone without a reason (probe DA, HF Jamba)."""
    torch.manual_seed(0)
    block = NormedDtBlock()
    x = torch.randn(2, 6, 8)
    report = explain(block, x)
    assert report.counts["scan_loop"] == 1 and not report.counts.get("x_dt_proj"), report.format(graphs=False)
    reasons = [m.reason for m in report.misses if m.family == "x_dt_proj"]
    assert any("computed from x_proj's first columns" in r for r in reasons), report.format(graphs=False)
    with torch.no_grad():
        torch.testing.assert_close(report.output, block(x), rtol=1e-5, atol=1e-6)
