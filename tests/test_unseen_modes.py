"""Probe BX (run 58): PyTorch features around a compiled Mamba block.

Recorded behaviour before this round:
- A compiled function that runs its block inside ``with torch.inference_mode():`` had its
  rewritten graph fail to compile (AOTAutograd cannot take a view of a parameter made inside
  inference mode, which plain ``aot_eager`` shows on such code as well), and the backend fell
  back to the graph without rewrites, with eager's values. But the failed trace's frames held
  inference mode's guard, so the mode stayed on after the call returned: the caller's next
  eager step raised "Inference tensors cannot be saved for backward".
- A conv whose padded output goes through ``* 0.7`` (and ``- 0.2``) before its ``[..., :L]``
  slice (a forward hook on the conv) was called "not a causal conv", though a function of the
  padded output sliced is that function of the causal conv.
"""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ssm_compile.report import explain

D, W, L = 6, 4, 7


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(D, D, W, groups=D, padding=W - 1)

    def forward(self, x):
        return F.silu(self.conv(x)[..., :L])


def test_inference_mode_inside_the_compiled_function_is_off_again_after_it(caplog):
    block = Conv()

    def fn(x):
        with torch.inference_mode():
            return block(x) * 2

    x = torch.randn(2, D, L)
    with caplog.at_level(logging.WARNING, logger="ssm_compile"):
        out = torch.compile(fn, backend="ssm")(x)
    torch.testing.assert_close(out, fn(x))
    # The rewritten graph did fail here (the reason the mode was left on): the test covers the
    # path it means to.
    assert any("compiled without ssm rewrites" in r.getMessage() for r in caplog.records)
    assert not torch.is_inference_mode_enabled()
    # The caller's next training step, eagerly.
    loss = block(x.requires_grad_()).square().sum()
    loss.backward()
    assert block.conv.weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("after", [
    pytest.param(lambda c: c * 0.7, id="times-a-number"),
    pytest.param(lambda c: (0.7 * c - 0.2), id="times-then-minus"),
    pytest.param(lambda c: torch.add(c, 0.5, alpha=2.0).tanh(), id="add-alpha-then-tanh"),
    pytest.param(lambda c: F.silu(c / 3.0), id="over-a-number-then-silu"),
    # operator.neg, as ``-c`` traces (probe BZ), then silu and a number.
    pytest.param(lambda c: F.silu(-c) * 3, id="minus-then-silu-then-times"),
])
def test_arithmetic_on_the_padded_conv_before_its_slice_is_a_causal_conv(after):
    block = Conv()

    def fn(x):
        return F.silu(after(block.conv(x))[..., :L])

    x = torch.randn(2, D, L, requires_grad=True)
    report = explain(fn, x)
    assert report.counts.get("conv1d") == 1, str(report)
    want = fn(x)
    want_grads = torch.autograd.grad(want.square().sum(), [x, block.conv.weight, block.conv.bias])
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ssm")(x)
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got.square().sum(), [x, block.conv.weight, block.conv.bias]), want_grads):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("after", [
    pytest.param(lambda c: torch.div(c, 2, rounding_mode="floor"), id="floor-division"),
    pytest.param(lambda c: c * c.mean(), id="times-a-tensor"),
    pytest.param(lambda c: c * 0.7 + c, id="read-twice"),
])
def test_other_functions_of_the_padded_conv_are_left_alone(after):
    block = Conv()

    def fn(x):
        return after(block.conv(x))[..., :L]

    x = torch.randn(2, D, L)
    report = explain(fn, x)
    assert "conv1d" not in report.counts, str(report)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend="ssm")(x), fn(x))


def test_a_one_channel_block_folds_its_skip():
    # d_model = 1: D of shape (1,) broadcast along a dim axis of size 1 was "not a (dim,) vector".
    from test_unseen_scan6 import _disc

    def fn(u, delta, A, B, C, D):
        dA, dBu = _disc(u, delta, A, B)
        h = u.new_zeros(2, 1, 4)
        ys = []
        for t in range(u.shape[2]):
            h = dA[:, :, t] * h + dBu[:, :, t]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
        return torch.stack(ys, -1) + u * D[:, None]

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 1, 6, generator=g), torch.rand(2, 1, 6, generator=g) + 0.1,
            -torch.rand(1, 4, generator=g) - 0.5, torch.randn(2, 4, 6, generator=g), torch.randn(2, 4, 6, generator=g),
            torch.randn(1, generator=g)]
    report = explain(fn, *args)
    assert report.counts.get("skip") == 1, str(report)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend="ssm")(*args), fn(*args))


def test_a_bool_operand_is_not_called_an_inplace_flag():
    # ``c * True`` is arithmetic with a bool (not taken), not ``inplace=True`` (probe BZ: the
    # reason said the product wrote the conv output in place).
    block = Conv()

    def fn(x):
        return (block.conv(x) * True)[..., :L]

    reasons = [m.reason for m in explain(fn, torch.randn(2, D, L)).misses if m.family == "conv1d"]
    assert reasons and not any("in place" in r for r in reasons), reasons
    assert "not with a tensor, pow or floor division" in reasons[0], reasons
