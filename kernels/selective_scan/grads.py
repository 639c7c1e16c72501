"""The gradient bundle that every selective-scan backward implementation returns."""
from typing import NamedTuple, Optional

import torch


class ScanGrads(NamedTuple):
    """Gradients of ``selective_scan``, named so that no caller counts positions.

    Each has the shape and dtype of its input (dB/dC in the 4-D grouped layout
    ``(batch, G, N, L)``), except ``dinitial_state`` which is fp32 like the state. An entry is
    ``None`` exactly when the matching optional input was ``None``.
    """

    du: torch.Tensor
    ddelta: torch.Tensor
    dA: torch.Tensor
    dB: torch.Tensor
    dC: torch.Tensor
    dD: Optional[torch.Tensor]
    dz: Optional[torch.Tensor]
    ddelta_bias: Optional[torch.Tensor]
    dinitial_state: Optional[torch.Tensor]
