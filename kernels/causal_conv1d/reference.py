"""fp64 reference for ``ssm::causal_conv1d``: the spec that the tests compare against.

An explicit loop over time, written for clarity rather than speed; it is differentiable, so the
tests also take its gradients as the reference for the backward kernels.
"""
from typing import Optional

import torch
import torch.nn.functional as F


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    initial_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y[b, d, t] = bias[d] + sum_k weight[d, k] * x[b, d, t - (W-1) + k], then optional silu.

    x: (batch, dim, L); weight: (dim, W); bias: (dim,); initial_state: (batch, dim, W-1), the
    W-1 inputs that precede x (zeros when None). Returns y (batch, dim, L) in fp64.
    """
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    x, weight = x.double(), weight.double()
    if initial_state is None:
        initial_state = x.new_zeros(batch, dim, width - 1)
    # Time index s of `padded` is input time s - (W-1): the window for output t is s = t .. t+W-1.
    padded = torch.cat([initial_state.double(), x], dim=-1)
    ys = []
    for t in range(seqlen):
        y_t = (padded[:, :, t : t + width] * weight).sum(-1)
        if bias is not None:
            y_t = y_t + bias.double()
        ys.append(y_t)
    y = torch.stack(ys, dim=-1)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    return y
