"""The program may write, in place, a tensor whose value an op now produces.

An op output in the channel-innermost layout used to be a transpose of a fresh buffer, i.e. a
view. Autograd counts a view that a (multi-output) function returns as one of several views and
refuses in-place writes to it, so a loop that filled a preallocated ``ys`` and then overwrote an
entry raised under grad once the loop became the op (``inductor=False``, and so ``explain``).
The ops now allocate with strides (``kernels/layout.empty_activation``).
"""
import pytest
import torch
from torch._dynamo.utils import counters

from utils import TRITON_DEVICE

import ssm_compile
from ssm_compile.kernels import register_ops


def filled_then_overwritten(u, delta, A, B, C, D):
    dA = torch.exp(delta[..., None] * A)
    dBu = delta[..., None] * B[:, :, None, :] * u[..., None]
    h = torch.zeros(u.shape[0], u.shape[2], A.shape[1], dtype=u.dtype)
    ys = torch.zeros(u.shape, dtype=u.dtype)
    for t in range(u.shape[1]):
        h = dA[:, t] * h + dBu[:, t]
        ys[:, t] = (h * C[:, t, None, :]).sum(-1)
    ys[:, 3] = 0
    ys[:, 5] *= 2
    return ys + u * D


def make_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, L, d, n = 2, 8, 4, 3
    return [torch.randn(b, L, d, generator=g, dtype=torch.float64),
            torch.rand(b, L, d, generator=g, dtype=torch.float64) * 0.5 + 0.05,
            -(torch.rand(d, n, generator=g, dtype=torch.float64) + 0.5),
            torch.randn(b, L, n, generator=g, dtype=torch.float64),
            torch.randn(b, L, n, generator=g, dtype=torch.float64),
            torch.randn(d, generator=g, dtype=torch.float64)]


@pytest.mark.parametrize("inductor", [False, True], ids=["no-inductor", "inductor"])
def test_buffer_written_after_the_loop_trains(inductor):
    args = make_inputs()
    leaves = [a.clone().requires_grad_() for a in args]
    out = torch.compile(filled_then_overwritten, backend=ssm_compile.backend(inductor=inductor))(*leaves)
    assert counters["ssm"]["scan_loop"] == 1
    ref_leaves = [a.clone().requires_grad_() for a in args]
    ref = filled_then_overwritten(*ref_leaves)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * weights).sum(), ref_leaves)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_explain_runs_a_module_that_overwrites_the_buffer():
    u, delta, A, B, C, D = make_inputs()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.A, self.D = torch.nn.Parameter(A.clone()), torch.nn.Parameter(D.clone())

        def forward(self, u, delta, B, C):
            return filled_then_overwritten(u, delta, self.A, B, C, self.D)

    block = Block()
    report = ssm_compile.explain(block, u, delta, B, C)
    assert report.counts["scan_loop"] == 1
    torch.testing.assert_close(report.output, block(u, delta, B, C), rtol=1e-12, atol=1e-12)


def test_channel_innermost_op_outputs_are_not_views():
    """On the GPU where there is one (the Triton launchers allocate the outputs), else the CPU path."""
    register_ops()
    g = torch.Generator().manual_seed(2)
    b, d, L, n, W = 2, 6, 9, 4, 4

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(TRITON_DEVICE)

    def channel_innermost():
        return rand(b, L, d).transpose(1, 2).requires_grad_()

    conv = torch.ops.ssm.causal_conv1d(channel_innermost(), rand(d, W), None, "silu")
    y, _ = torch.ops.ssm.selective_scan(channel_innermost(), rand(b, L, d).abs().transpose(1, 2),
                                        -rand(d, n).abs() - 0.5, rand(b, n, L), rand(b, n, L))
    for out in (conv, y):
        assert out.stride(1) == 1 and not out._is_view()
        out[:, 1] = 0  # raised "Output 0 of Select is a view and is being modified inplace" before
