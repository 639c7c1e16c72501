"""The spec of ``ssm::fused_mamba_scan``: the split path written out in fp64.

u = act(causal_conv1d(x)) when a conv is fused, delta = W_dt @ dt_low when the dt projection is
fused, then the selective scan of ``kernels/selective_scan/reference.py`` (an explicit time
loop). Slow on purpose; tests compare every implementation against it.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from ..selective_scan.reference import selective_scan_ref


def fused_mamba_scan_ref(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
    conv_weight: Optional[torch.Tensor] = None,
    conv_bias: Optional[torch.Tensor] = None,
    conv_activation: Optional[str] = None,
    dt_weight: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    return_last_state: bool = False,
):
    """Reference fused scan in fp64; returns y as an fp64 (batch, dim, L) tensor, and the last
    state (batch, dim, N) too if ``return_last_state``.

    Args:
        x: (batch, dim, L), the conv input if ``conv_weight`` (dim, W) is given, else u.
        delta: (batch, dim, L), or dt_low (batch, R, L) if ``dt_weight`` (dim, R) is given.
        The rest as in ``selective_scan_ref``; ``conv_activation`` is None or "silu".
    """
    u = x.double()
    if conv_weight is not None:
        width = conv_weight.shape[1]
        padded = F.pad(u, (width - 1, 0))
        seqlen = u.shape[-1]
        u = sum(conv_weight.double()[:, k, None] * padded[:, :, k:k + seqlen] for k in range(width))
        if conv_bias is not None:
            u = u + conv_bias.double()[:, None]
        if conv_activation in ("silu", "swish"):
            u = F.silu(u)
    delta = delta.double()
    if dt_weight is not None:
        delta = torch.einsum("dr,brl->bdl", dt_weight.double(), delta)
    return selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
                              return_last_state)
