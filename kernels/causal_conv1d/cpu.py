"""PyTorch implementation of ``ssm::causal_conv1d`` forward and backward, used on CPU.

The causal conv is a depthwise ``F.conv1d`` over ``initial_state ++ x`` with no padding, so
output t sees inputs t-(W-1) .. t. Everything is computed in fp32 (fp64 when an input is fp64)
and cast back, as the Triton kernels do. The (batch, dim, L + W-1) temporaries are linear in L.
"""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..layout import empty_activation


class ConvGrads(NamedTuple):
    """Gradients of ``causal_conv1d``, named so that no caller counts positions.

    Each has its input's shape and dtype; dx has x's layout (``kernels/layout.py``), the others
    are contiguous (the fake implementation promises these layouts, so the CPU path copies its
    strided slices once). ``dbias`` and
    ``dinitial_state`` are empty fp32 tensors of shape (0,) when the matching input was None (a
    custom op cannot return None; this is the selective scan's convention for ``last_state``).
    """

    dx: torch.Tensor
    dweight: torch.Tensor
    dbias: torch.Tensor
    dinitial_state: torch.Tensor


def _compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    # fp64 only exists for gradcheck; every other dtype accumulates in fp32.
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _padded_input(x, weight, initial_state, dtype):
    batch, dim, _ = x.shape
    width = weight.shape[1]
    if initial_state is None:
        prefix = x.new_zeros(batch, dim, width - 1, dtype=dtype)
    else:
        prefix = initial_state.to(dtype)
    return torch.cat([prefix, x.to(dtype)], dim=-1)


def _preactivation(padded, weight, bias, dtype):
    b = None if bias is None else bias.to(dtype)
    return F.conv1d(padded, weight.to(dtype).unsqueeze(1), b, groups=weight.shape[0])


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
    silu: bool,
) -> torch.Tensor:
    """Forward; inputs already validated. Returns y (batch, dim, L) in x's layout and dtype."""
    dtype = _compute_dtype(x, weight, bias, initial_state)
    y = _preactivation(_padded_input(x, weight, initial_state, dtype), weight, bias, dtype)
    if silu:
        y = F.silu(y)
    return empty_activation(x).copy_(y)


def causal_conv1d_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
    silu: bool,
) -> ConvGrads:
    """Backward; inputs already validated. See ``ConvGrads`` for what is returned."""
    dim, width = weight.shape
    seqlen = x.shape[-1]
    dtype = _compute_dtype(dy, x, weight, bias, initial_state)
    padded = _padded_input(x, weight, initial_state, dtype)
    dp = dy.to(dtype)
    if silu:
        # Recompute the pre-activation instead of saving it: it costs one conv, saves an
        # activation-sized buffer. d silu(p)/dp = s * (1 + p * (1 - s)), s = sigmoid(p).
        p = _preactivation(padded, weight, bias, dtype)
        s = torch.sigmoid(p)
        dp = dp * s * (1 + p * (1 - s))
    # y[t] = sum_k w[k] padded[t + k], so dpadded[s] = sum_k w[k] dp[s - k]: a full convolution,
    # i.e. a correlation of dp (zero-padded by W-1 on both sides) with the flipped kernel.
    dpadded = F.conv1d(
        F.pad(dp, (width - 1, width - 1)), weight.to(dtype).flip(-1).unsqueeze(1), groups=dim
    )
    # dweight[d, k] = sum_{b, t} dp[b, d, t] * padded[b, d, t + k]; W <= 8 taps, so a short loop.
    dweight = torch.stack(
        [torch.einsum("bdl,bdl->d", dp, padded[:, :, k : k + seqlen]) for k in range(width)],
        dim=-1,
    )
    if bias is None:
        dbias = x.new_empty(0, dtype=torch.float32)
    else:
        dbias = dp.sum(dim=(0, 2)).to(bias.dtype)
    if initial_state is None:
        dinitial_state = x.new_empty(0, dtype=torch.float32)
    else:
        dinitial_state = dpadded[:, :, : width - 1].to(initial_state.dtype).contiguous()
    return ConvGrads(
        dx=empty_activation(x).copy_(dpadded[:, :, width - 1 :]),
        dweight=dweight.to(weight.dtype).contiguous(),
        dbias=dbias,
        dinitial_state=dinitial_state,
    )
