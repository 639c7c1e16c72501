"""The spec of the decode ops: plain PyTorch in fp64, one explicit step per token.

Nothing here mutates its inputs: each function returns the new state next to the output, so
tests can compare both against an op that updates its state in place.
"""
from typing import Optional

import torch
import torch.nn.functional as F


def selective_state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One recurrence step of the selective SSM, in fp64.

    Args:
        state: (batch, dim, N). x, dt, z: (batch, dim). A: (dim, N). D, dt_bias: (dim,).
        B, C: (batch, N), or grouped (batch, G, N) with dim % G == 0 (channel d reads group
            d // (dim // G)).

    Returns:
        ``(y, new_state)``: y (batch, dim) and new_state (batch, dim, N), both fp64.
    """
    x, dt, A, B, C, h = (t.double() for t in (x, dt, A, B, C, state))
    dim = x.shape[1]
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = F.softplus(dt)
    if B.dim() == 2:
        B, C = B.unsqueeze(1), C.unsqueeze(1)
    B = B.repeat_interleave(dim // B.shape[1], dim=1)  # (batch, dim, N)
    C = C.repeat_interleave(dim // C.shape[1], dim=1)
    h = torch.exp(dt[..., None] * A) * h + dt[..., None] * B * x[..., None]
    y = (h * C).sum(-1)
    if D is not None:
        y = y + D.double() * x
    if z is not None:
        y = y * F.silu(z.double())
    return y, h


def causal_conv1d_update_ref(x, conv_state, weight, bias=None, activation: Optional[str] = None):
    """T steps of the depthwise causal conv over a rolling window of past inputs, in fp64.

    Args:
        x: (batch, dim) or (batch, dim, T). conv_state: (batch, dim, S), S >= W - 1, the S
            inputs before x (oldest first). weight: (dim, W). bias: (dim,).

    Returns:
        ``(y, new_conv_state)``: y shaped like x, new_conv_state (batch, dim, S) = the last S
        inputs of cat(conv_state, x); both fp64.
    """
    squeeze = x.dim() == 2
    x = x.double().unsqueeze(-1) if squeeze else x.double()
    window, w = conv_state.double(), weight.double()
    S, W = window.shape[-1], w.shape[-1]
    ys = []
    for t in range(x.shape[-1]):
        full = torch.cat([window, x[:, :, t : t + 1]], dim=-1)  # (batch, dim, S + 1)
        y = (full[:, :, S + 1 - W :] * w).sum(-1)
        window = full[:, :, 1:]
        if bias is not None:
            y = y + bias.double()
        if activation in ("silu", "swish"):
            y = F.silu(y)
        ys.append(y)
    y = torch.stack(ys, dim=-1)
    return (y.squeeze(-1) if squeeze else y), window
