"""CPU implementations of the decode ops: plain PyTorch, fp32 accumulation, state updated in place.

Inputs are already validated by the op layer; B and C come grouped, (batch, G, N), and the conv
input comes as (batch, dim, T). A decode step only ever touches state-sized tensors, so the
(batch, dim, N) temporaries here are no larger than the state itself.
"""
from typing import Optional

import torch
import torch.nn.functional as F


def selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus) -> torch.Tensor:
    batch, dim = x.shape
    G, N = B.shape[1], B.shape[2]
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    # Channels are grouped as (G, dim // G) so each group's B/C row broadcasts over its channels
    # without a repeat_interleave copy.
    dt_g = dt.view(batch, G, dim // G, 1)
    x_g = x.float().view(batch, G, dim // G, 1)
    h = state.view(batch, G, dim // G, N)
    dA = torch.exp(dt_g * A.float().view(G, dim // G, N))
    h_new = h * dA + dt_g * B.float().unsqueeze(2) * x_g  # [batch, G, dim // G, N]
    state.copy_(h_new.view(batch, dim, N))
    y = (h_new * C.float().unsqueeze(2)).sum(-1).view(batch, dim)
    if D is not None:
        y = y + D.float() * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def causal_conv1d_update(x, conv_state, weight, bias: Optional[torch.Tensor], activation: Optional[str]):
    dim, W = weight.shape
    S, T = conv_state.shape[-1], x.shape[-1]
    if dim == 0:
        # No channel: F.conv1d refuses groups=0, and there is no state to roll.
        return torch.empty_like(x)
    # Only the last W - 1 past inputs reach the output; the rest of the state just rolls.
    window = torch.cat([conv_state[:, :, S - (W - 1):].float(), x.float()], dim=-1)  # [batch, dim, W - 1 + T]
    y = F.conv1d(window, weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=dim)
    if activation == "silu":
        y = F.silu(y)
    if T >= S:
        conv_state.copy_(x[:, :, T - S:])
    else:
        # Shift through a temporary: copy_ between overlapping views of one buffer is undefined.
        conv_state.copy_(torch.cat([conv_state[:, :, T:], x.to(conv_state.dtype)], dim=-1))
    return y.to(x.dtype)
