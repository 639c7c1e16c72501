"""``ssm::x_dt_proj``: Mamba's x_proj and dt_proj products as one op.

    x_dbl = x @ x_weight^T                       # (..., R + 2N): dt_low, B, C side by side
    dt    = x_dbl[..., :R] @ dt_weight^T         # (..., dim), before dt_proj's bias and softplus

(R = dt_weight.shape[1].) The values are eager's: x_dbl is rounded to x's dtype and dt is
computed from the rounded columns, as two ``F.linear`` calls would. Both outputs are contiguous.
CUDA runs one Triton kernel (``triton_x_dt_proj.py``) where it pays, else the two products;
CPU runs the two products. The backward is four matmuls in torch (``register_autograd``), so
AOTAutograd traces it and inductor schedules it like any other matmul.

Compiled on CUDA, the forward is not an op call in inductor's code either (``kernels/inline.py``):
where the kernel pays, its launch is recorded and inductor launches it; elsewhere the two
products are recorded as the matmuls they are. Either way the call skips the op's dispatch, which
costs more host time than the two small products' GPU time at short L and batch 1.
"""
import functools

import torch
import torch.nn.functional as F

from ..context import register_autograd, without_autocast
from ..inline import register_inline
from . import triton_x_dt_proj

_SCHEMA = "x_dt_proj(Tensor x, Tensor x_weight, Tensor dt_weight) -> (Tensor x_dbl, Tensor dt)"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_x_dt_proj_args(x: torch.Tensor, x_weight: torch.Tensor, dt_weight: torch.Tensor) -> None:
    """Raise ValueError/TypeError naming the argument if the inputs break the op's contract."""
    if x.dim() < 2:
        raise ValueError(f"x_dt_proj: x: expected a (..., rows, K) tensor, got shape {tuple(x.shape)}")
    # fp64 is accepted on CPU only, for gradcheck: the kernel accumulates in fp32.
    allowed = _DTYPES + ((torch.float64,) if x.device.type == "cpu" else ())
    if x.dtype not in allowed:
        raise TypeError(f"x_dt_proj: x: expected dtype float32, bfloat16 or float16 (float64 on CPU only), "
                        f"got {x.dtype}")
    K = x.shape[-1]
    if x_weight.dim() != 2 or x_weight.shape[1] != K:
        raise ValueError(f"x_dt_proj: x_weight: expected shape (R + 2N, K={K}), got {tuple(x_weight.shape)}")
    if dt_weight.dim() != 2 or not 1 <= dt_weight.shape[1] < x_weight.shape[0]:
        raise ValueError(f"x_dt_proj: dt_weight: expected shape (dim, R) with 1 <= R < x_weight.shape[0]="
                         f"{x_weight.shape[0]}, got {tuple(dt_weight.shape)}")
    for name, t in (("x_weight", x_weight), ("dt_weight", dt_weight)):
        if t.dtype != x.dtype:
            raise TypeError(f"x_dt_proj: {name}: expected x's dtype {x.dtype}, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"x_dt_proj: {name}: expected x's device {x.device}, got {t.device}")


def _fake(x, x_weight, dt_weight):
    check_x_dt_proj_args(x, x_weight, dt_weight)
    lead = tuple(x.shape[:-1])
    return x.new_empty(lead + (x_weight.shape[0],)), x.new_empty(lead + (dt_weight.shape[0],))


def _products(x, x_weight, dt_weight):
    x_dbl = F.linear(x, x_weight).contiguous()
    dt = F.linear(x_dbl[..., :dt_weight.shape[1]], dt_weight).contiguous()
    return x_dbl, dt


def _cpu(x, x_weight, dt_weight):
    check_x_dt_proj_args(x, x_weight, dt_weight)
    return _products(x, x_weight, dt_weight)


def _cuda(x, x_weight, dt_weight, traced=False):
    # traced: the forward as a graph records it (kernels/inline.py), the kernel's launch through
    # wrap_triton where it runs, else the products recorded as matmuls.
    check_x_dt_proj_args(x, x_weight, dt_weight)
    # Nothing to launch for an empty x (a batch of 0): the products give the empty (or, for
    # K = 0, zero) outputs.
    if x.numel() > 0 and triton_x_dt_proj.supported(x, x_weight, dt_weight):
        return triton_x_dt_proj.x_dt_proj_fwd(x, x_weight, dt_weight, traced=traced)
    return _products(x, x_weight, dt_weight)


def _traced(x, x_weight, dt_weight):
    return _cuda(x, x_weight, dt_weight, traced=True)


def _setup_context(ctx, inputs, output):
    x, x_weight, dt_weight = inputs
    ctx.save_for_backward(x, x_weight, dt_weight, output[0])


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(0, -2)  # (reshape(-1, K) is ambiguous where K is 0)


def _backward(ctx, g_x_dbl, g_dt):
    x, x_weight, dt_weight, x_dbl = ctx.saved_tensors
    rank = dt_weight.shape[1]
    # Autograd hands None (or nothing) for an output whose value no one differentiated.
    g = torch.zeros_like(x_dbl) if g_x_dbl is None else g_x_dbl
    g_dt_weight = None
    if g_dt is not None:
        # dt = x_dbl[..., :R] @ dt_weight^T: its gradient joins x_dbl's in the first R columns.
        g = torch.cat([g[..., :rank] + g_dt @ dt_weight, g[..., rank:]], dim=-1)
        if ctx.needs_input_grad[2]:
            g_dt_weight = _rows(g_dt).mT @ _rows(x_dbl[..., :rank])
    g_x = g @ x_weight if ctx.needs_input_grad[0] else None
    g_x_weight = _rows(g).mT @ _rows(x) if ctx.needs_input_grad[1] else None
    return g_x, g_x_weight, g_dt_weight


@functools.cache
def register() -> torch.library.Library:
    """Define ``ssm::x_dt_proj`` (idempotent). Returns the ``Library`` fragment that keeps it."""
    lib = torch.library.Library("ssm", "FRAGMENT")
    # flexible_layout: the kernel reads x with any strides (HF hands it a transposed view).
    lib.define(_SCHEMA, tags=(torch.Tag.flexible_layout,))
    lib.impl("x_dt_proj", without_autocast(_cpu, "cpu"), "CPU")
    lib.impl("x_dt_proj", without_autocast(_cuda, "cuda"), "CUDA")
    torch.library.register_fake("ssm::x_dt_proj", _fake, lib=lib)
    register_autograd(lib, "x_dt_proj", _backward, _setup_context)
    # Autocast off as in the real impl: the recorded products must keep the op's dtypes.
    register_inline(lib, "ssm::x_dt_proj", without_autocast(_traced, "cuda"))
    return lib
