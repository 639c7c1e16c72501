"""``ssm::fused_mamba_scan``: the selective scan with the conv1d and/or the dt projection fused in.

Fusion levels (see ``triton_fused.py`` for what each one saves):

* level 1: ``conv_weight`` given: x is the pre-conv input, u = act(conv(x) + conv_bias);
* level 2: level 1 and ``dt_weight`` (dim, R) given: ``delta`` is dt_low (batch, R, L) and
  the kernel computes W_dt @ dt_low itself (then delta_bias and softplus as usual);
* ``dt_weight`` without ``conv_weight`` fuses the dt projection alone (x is u).

Layers: Triton kernel and launcher in ``triton_fused.py`` (CUDA); on CPU the split ops' own
CPU paths composed; the fp64 spec in ``reference.py``.

The op is forward only. It is what the ``fuse`` pass emits for inference graphs; when any input
requires grad the pass keeps the split ops, whose backward kernels already exist, instead of
recomputing through them here. Its autograd formula therefore only raises, with a message that
says so, rather than letting autograd fail with a generic "not differentiable" error.
Nothing is registered until ``register()`` is called.
"""
import functools

import torch

from ..causal_conv1d import cpu as conv_cpu
from ..causal_conv1d.op import check_causal_conv1d_args
from ..context import without_autocast
from ..layout import empty_activation
from ..selective_scan import cpu as scan_cpu
from ..selective_scan.op import check_selective_scan_inputs

_SCHEMA = (
    "(Tensor x, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D=None, Tensor? z=None, "
    "Tensor? delta_bias=None, bool delta_softplus=False, Tensor? conv_weight=None, "
    "Tensor? conv_bias=None, str? conv_activation=None, Tensor? dt_weight=None) -> Tensor"
)
_SILU = ("silu", "swish")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_fused_inputs(x, delta, A, B, C, D, z, delta_bias, conv_weight, conv_bias,
                       conv_activation, dt_weight) -> None:
    """Raise ValueError/TypeError/RuntimeError naming the argument; else return.

    The scan's own checks run with x standing for u (same shape) and, when the dt projection
    is fused, with a delta of u's shape; dt_low and dt_weight are checked here.
    """
    if x.dim() != 3:
        raise ValueError(f"fused_mamba_scan: x must be 3-D (batch, dim, L), got shape {tuple(x.shape)}")
    batch, dim, seqlen = x.shape
    if dt_weight is not None:
        if dt_weight.dim() != 2 or dt_weight.shape[0] != dim:
            raise ValueError(f"fused_mamba_scan: dt_weight must have shape (dim={dim}, R), "
                             f"got {tuple(dt_weight.shape)}")
        rank = dt_weight.shape[1]
        if tuple(delta.shape) != (batch, rank, seqlen):
            raise ValueError(f"fused_mamba_scan: with dt_weight, delta is dt_low and must have shape "
                             f"(batch, R, L) = {(batch, rank, seqlen)}, got {tuple(delta.shape)}")
        for name, t in (("delta", delta), ("dt_weight", dt_weight)):
            if t.device != x.device:
                raise RuntimeError(f"fused_mamba_scan: {name} is on {t.device} while x is on {x.device}")
            ok = _DTYPES + ((torch.float64,) if x.device.type != "cuda" else ())
            if t.dtype not in ok:
                raise TypeError(f"fused_mamba_scan: {name} must have a dtype in {[str(d) for d in ok]} "
                                f"(fp64 on CPU only), got {t.dtype}")
    scan_delta = x if dt_weight is not None else delta
    check_selective_scan_inputs(x, scan_delta, A, B, C, D, z, delta_bias, None)
    if conv_weight is not None:
        try:
            check_causal_conv1d_args(x, conv_weight, conv_bias, conv_activation, None)
        except (ValueError, TypeError) as e:
            raise type(e)(f"fused_mamba_scan: conv inputs (weight=conv_weight, bias=conv_bias, "
                          f"activation=conv_activation): {e}") from e
    elif conv_bias is not None or conv_activation is not None:
        raise ValueError("fused_mamba_scan: conv_bias/conv_activation given without conv_weight")


def _cpu_impl(x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
              conv_weight=None, conv_bias=None, conv_activation=None, dt_weight=None):
    # The split path, step by step: what the fused kernel must reproduce.
    u = x
    if conv_weight is not None:
        u = conv_cpu.causal_conv1d_fwd(x, conv_weight, conv_bias, None, conv_activation in _SILU)
    if dt_weight is not None:
        delta = torch.matmul(dt_weight.to(delta.dtype), delta)
    grouped = (lambda t: t.unsqueeze(1) if t.dim() == 3 else t)
    y, _ = scan_cpu.selective_scan_fwd(u, delta, A, grouped(B), grouped(C), D, z, delta_bias,
                                       delta_softplus, None, False)
    return y


def _impl(x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
          conv_weight=None, conv_bias=None, conv_activation=None, dt_weight=None):
    check_fused_inputs(x, delta, A, B, C, D, z, delta_bias, conv_weight, conv_bias,
                       conv_activation, dt_weight)
    if x.device.type == "cpu":
        return without_autocast(_cpu_impl, "cpu")(x, delta, A, B, C, D, z, delta_bias, delta_softplus, conv_weight,
                         conv_bias, conv_activation, dt_weight)
    if x.device.type != "cuda":
        raise RuntimeError(f"fused_mamba_scan: x is on {x.device}; supported device types: cpu, cuda")
    from .triton_fused import fused_scan_fwd

    grouped = (lambda t: t.unsqueeze(1) if t.dim() == 3 else t)
    return fused_scan_fwd(x, delta, A, grouped(B), grouped(C), D, z, delta_bias, delta_softplus,
                          conv_weight, conv_bias, conv_activation in _SILU, dt_weight).y


def _fake(x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
          conv_weight=None, conv_bias=None, conv_activation=None, dt_weight=None):
    check_fused_inputs(x, delta, A, B, C, D, z, delta_bias, conv_weight, conv_bias,
                       conv_activation, dt_weight)
    return empty_activation(x)


def _setup_context(ctx, inputs, output):
    pass


def _backward(ctx, grad_y):
    raise RuntimeError(
        "ssm::fused_mamba_scan is forward-only (inference): the fuse pass emits it only when no "
        "input requires grad. For training, compile with the default options (the pass keeps the "
        "split ssm.causal_conv1d + ssm.selective_scan ops, which have backward kernels) or "
        "fuse='split'.")


@functools.cache
def register():
    """Define ``ssm::fused_mamba_scan`` (idempotent). Returns the ``CustomOpDef``."""
    op = torch.library.custom_op("ssm::fused_mamba_scan", _impl, mutates_args=(), schema=_SCHEMA)
    op.register_fake(_fake)
    op.register_autograd(_backward, setup_context=_setup_context)
    return op
