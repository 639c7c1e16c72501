"""fp64 specification of ``ssm::x_dt_proj``, for the tests."""
import torch
import torch.nn.functional as F


def x_dt_proj_ref(x: torch.Tensor, x_weight: torch.Tensor, dt_weight: torch.Tensor):
    """(x_dbl, dt) in fp64 from inputs of any dtype, rounding where eager rounds: x_dbl to x's
    dtype before dt_proj reads its first R columns."""
    x_dbl = F.linear(x.double(), x_weight.double())
    low = x_dbl.to(x.dtype).double()[..., :dt_weight.shape[1]]
    return x_dbl, F.linear(low, dt_weight.double())
