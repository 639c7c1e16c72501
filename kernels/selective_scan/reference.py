"""The spec of ``ssm::selective_scan``: plain PyTorch, fp64, one explicit step per time index.

Slow on purpose (an O(L) Python loop). Tests compare every implementation against it, and
get reference gradients by calling ``.backward()`` through it.
"""
from typing import Optional

import torch
import torch.nn.functional as F


def selective_scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
    initial_state: Optional[torch.Tensor] = None,
    return_last_state: bool = False,
):
    """Reference selective scan, computed entirely in fp64 and differentiable by autograd.

    Args:
        u, delta: (batch, dim, L). z: (batch, dim, L) or None.
        A: (dim, N). D, delta_bias: (dim,) or None.
        B, C: (batch, N, L), or grouped (batch, G, N, L) with dim % G == 0; channel d reads
            group d // (dim // G); or time-invariant, (dim, N).
        initial_state: (batch, dim, N) or None (zeros).

    Returns:
        y as an **fp64** tensor (batch, dim, L), not in u's dtype, so that tests measure the
        error of the implementation under test and not the rounding of the reference;
        ``(y, last_state)`` with last_state (batch, dim, N) fp64 if ``return_last_state``.
    """
    u, delta, A, B, C = (t.double() for t in (u, delta, A, B, C))
    batch, dim, L = u.shape
    if delta_bias is not None:
        delta = delta + delta_bias.double()[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    # One (N, L) slice per channel, (batch, dim, N, L): a time-invariant (dim, N) B or C is the
    # same at every batch and step; a grouped one is repeated over its group's channels.
    def per_channel(X):
        if X.dim() == 2:
            return X[None, :, :, None].expand(batch, dim, X.shape[1], L)
        if X.dim() == 3:
            X = X.unsqueeze(1)
        return X.repeat_interleave(dim // X.shape[1], dim=1)

    B, C = per_channel(B), per_channel(C)

    if initial_state is None:
        h = u.new_zeros(batch, dim, A.shape[1])
    else:
        h = initial_state.double()
    ys = []
    for t in range(L):
        dt = delta[:, :, t, None]  # (batch, dim, 1)
        h = torch.exp(dt * A) * h + dt * B[:, :, :, t] * u[:, :, t, None]
        ys.append((h * C[:, :, :, t]).sum(-1))
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + D.double()[:, None] * u
    if z is not None:
        y = y * F.silu(z.double())
    return (y, h) if return_last_state else y
