"""Probe DA (run 69): Mamba-1 code nobody had shown the passes, found wrong or misreported.

- HF Zamba's decode runs one ``mamba_selective_state_update`` per head on ``cache[:, head]`` of
  one stacked state, each head with its own decay. scan_loop read the heads as a chain whose
  step 1 recomputes its exp and left a ``[scan_loop]`` "no state chain" near-miss, although the
  decode pass then rewrote every head's step: explain reported a recurrence left alone in a graph
  that kept none, and the compiler, reading that miss, compiled Zamba's whole decode graph with
  inductor's CPU vectorisation off (``cpp.simdlen=1``). The miss is now taken off the steps the
  decode pass rewrote (``manager._drop_rewritten_step_chains``).
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
