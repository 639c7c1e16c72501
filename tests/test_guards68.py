"""A match must not narrow the shapes a graph serves: comparing symbolic shapes with ``==``
adds a guard for every size it compares, so matching a (dim, 1) D or Δ bias written before the
(batch, dim, L) term it multiplies or adds to guarded ``batch != dim``, and a later call with
batch == dim compiled the whole graph again (run 67's note). The passes compare shapes with
``fx_utils.same_shape``, which decides without guards."""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from ssm_compile.compiler import backend

N, L = 3, 4


def block(u, dt, bias, A, B, C, D, z, bias_first):
    delta = F.softplus(bias[:, None] + dt if bias_first else dt + bias[:, None])
    b, d, _ = u.shape
    h = u.new_zeros(b, d, N)
    ys = []
    for t in range(L):
        h = torch.exp(delta[:, :, t, None] * A) * h + (delta[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1)
    y = y + (D[:, None] * u if bias_first else u * D[:, None])
    return y * F.silu(z)


def inputs(batch, dim, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, dim, L, generator=g, dtype=torch.float64),
            torch.randn(batch, dim, L, generator=g, dtype=torch.float64),
            torch.randn(dim, generator=g, dtype=torch.float64),
            -torch.rand(dim, N, generator=g, dtype=torch.float64) - 0.5,
            torch.randn(batch, N, L, generator=g, dtype=torch.float64),
            torch.randn(batch, N, L, generator=g, dtype=torch.float64),
            torch.randn(dim, generator=g, dtype=torch.float64),
            torch.randn(batch, dim, L, generator=g, dtype=torch.float64)]


@pytest.mark.parametrize("bias_first", [True, False], ids=["factor-first", "factor-second"])
def test_batch_equal_to_dim_reuses_the_dynamic_graph(bias_first):
    compiled = torch.compile(block, backend=backend(inductor=False), dynamic=True)
    for seed, (batch, dim) in enumerate([(2, 6), (6, 6)]):
        args = inputs(batch, dim, seed)
        torch.testing.assert_close(compiled(*args, bias_first), block(*args, bias_first), rtol=1e-10, atol=1e-12)
    assert counters["stats"]["unique_graphs"] == 1, "the batch == dim call compiled a second graph"
    fired = counters["ssm"]
    assert all(fired[f] == 1 for f in ("scan_loop", "delta", "skip", "gate")), dict(fired)
