"""``ssm::fused_mamba_scan``: the selective scan with the conv1d and/or the dt projection fused in.

Fusion levels (see ``triton_fused.py`` for what each one saves):

* level 1: ``conv_weight`` given: x is the pre-conv input, u = act(conv(x) + conv_bias);
* level 2: level 1 and ``dt_weight`` (dim, R) given: ``delta`` is dt_low (batch, R, L) and
  the kernel computes W_dt @ dt_low itself (then delta_bias and softplus as usual);
* ``dt_weight`` without ``conv_weight`` fuses the dt projection alone (x is u). This level runs
  the level-0 scan kernel, so it also takes ``initial_state`` and ``return_last_state`` (a
  prefill that fills a cache, HF's default forward); the conv levels do not.

The outputs are the scan op's: ``(y, last_state)``, last_state (0,) unless requested.

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
from ..context import register_autograd, without_autocast
from ..layout import empty_activation
from ..selective_scan import cpu as scan_cpu
from ..selective_scan.invariant import launcher_views
from ..selective_scan.op import check_selective_scan_inputs

_SCHEMA = (
    "(Tensor x, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D=None, Tensor? z=None, "
    "Tensor? delta_bias=None, bool delta_softplus=False, Tensor? conv_weight=None, "
    "Tensor? conv_bias=None, str? conv_activation=None, Tensor? dt_weight=None, "
    "Tensor? initial_state=None, bool return_last_state=False) -> (Tensor y, Tensor last_state)"
)
_SILU = ("silu", "swish")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_fused_inputs(x, delta, A, B, C, D, z, delta_bias, conv_weight, conv_bias,
                       conv_activation, dt_weight, initial_state=None, return_last_state=False) -> None:
    """Raise ValueError/TypeError/RuntimeError naming the argument; else return.

    The scan's own checks run with x standing for u (same shape) and, when the dt projection
    is fused, with a delta of u's shape; dt_low and dt_weight are checked here.
    """
    if x.dim() != 3:
        raise ValueError(f"fused_mamba_scan: x must be 3-D (batch, dim, L), got shape {tuple(x.shape)}")
    batch, dim, seqlen = x.shape
    if conv_weight is None and dt_weight is None:
        # Nothing to fuse: the CUDA launcher has no kernel for it, and accepting it here (as the
        # CPU path and the fake did) left the refusal to the first CUDA run of a compiled graph.
        raise ValueError("fused_mamba_scan: neither conv_weight nor dt_weight is given, so there is nothing to "
                         "fuse: call ssm::selective_scan for the scan alone")
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
    try:
        check_selective_scan_inputs(x, scan_delta, A, B, C, D, z, delta_bias, initial_state)
    except (ValueError, TypeError, RuntimeError) as e:
        raise type(e)(f"fused_mamba_scan: the scan's inputs (x in u's place{', with a delta of its shape' if dt_weight is not None else ''}): {e}") from e
    if conv_weight is not None and (initial_state is not None or return_last_state):
        raise ValueError("fused_mamba_scan: initial_state/return_last_state need the conv unfused "
                         "(conv_weight=None): the conv levels' kernel carries no state")
    if conv_weight is not None:
        try:
            check_causal_conv1d_args(x, conv_weight, conv_bias, conv_activation, None, op=None)
        except (ValueError, TypeError) as e:
            raise type(e)(f"fused_mamba_scan: conv inputs (weight=conv_weight, bias=conv_bias, "
                          f"activation=conv_activation): {e}") from e
    elif conv_bias is not None or conv_activation is not None:
        raise ValueError("fused_mamba_scan: conv_bias/conv_activation given without conv_weight")


def _cpu_impl(x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
              conv_weight=None, conv_bias=None, conv_activation=None, dt_weight=None,
              initial_state=None, return_last_state=False):
    # The split path, step by step: what the fused kernel must reproduce.
    u = x
    if conv_weight is not None:
        u = conv_cpu.causal_conv1d_fwd(x, conv_weight, conv_bias, None, conv_activation in _SILU)
    if dt_weight is not None:
        delta = torch.matmul(dt_weight.to(delta.dtype), delta)
    return scan_cpu.selective_scan_fwd(u, delta, A, *launcher_views(B, C, *x.shape), D, z, delta_bias,
                                       delta_softplus, initial_state, return_last_state)


def _state_dtype(x, delta, A, B, C, D, z, delta_bias, initial_state):
    # The scan's: fp32, fp64 when an input is fp64 (CPU); the projected delta has x's role.
    return scan_cpu.compute_dtype(x, delta, A, B, C, D, z, delta_bias, initial_state)


def _impl(x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
          conv_weight=None, conv_bias=None, conv_activation=None, dt_weight=None,
          initial_state=None, return_last_state=False):
    check_fused_inputs(x, delta, A, B, C, D, z, delta_bias, conv_weight, conv_bias,
                       conv_activation, dt_weight, initial_state, return_last_state)
    if x.device.type == "cpu":
        y, last_state = without_autocast(_cpu_impl, "cpu")(
            x, delta, A, B, C, D, z, delta_bias, delta_softplus, conv_weight, conv_bias,
            conv_activation, dt_weight, initial_state, return_last_state)
    elif x.device.type == "cuda":
        from .triton_fused import fused_scan_fwd

        launch = fused_scan_fwd(x, delta, A, *launcher_views(B, C, *x.shape), D, z, delta_bias, delta_softplus,
                                conv_weight, conv_bias, conv_activation in _SILU, dt_weight,
                                initial_state=initial_state, return_last_state=return_last_state)
        y, last_state = launch.y, launch.last_state
    else:
        raise RuntimeError(f"fused_mamba_scan: x is on {x.device}; supported device types: cpu, cuda")
    if last_state is None:
        last_state = x.new_empty((0,), dtype=_state_dtype(x, delta, A, B, C, D, z, delta_bias, initial_state))
    return y, last_state


def _fake(x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
          conv_weight=None, conv_bias=None, conv_activation=None, dt_weight=None,
          initial_state=None, return_last_state=False):
    check_fused_inputs(x, delta, A, B, C, D, z, delta_bias, conv_weight, conv_bias,
                       conv_activation, dt_weight, initial_state, return_last_state)
    batch, dim, _ = x.shape
    shape = (batch, dim, A.shape[1]) if return_last_state else (0,)
    state_dtype = _state_dtype(x, delta, A, B, C, D, z, delta_bias, initial_state)
    return empty_activation(x), x.new_empty(shape, dtype=state_dtype)


def _setup_context(ctx, inputs, output):
    pass


def _backward(ctx, grad_y, grad_last_state):
    raise RuntimeError(
        "ssm::fused_mamba_scan is forward-only (inference): the fuse pass emits it only when no "
        "input requires grad. For training, compile with the default options (the pass keeps the "
        "split ssm.causal_conv1d + ssm.selective_scan ops, which have backward kernels) or "
        "fuse='split'.")


@functools.cache
def register() -> torch.library.Library:
    """Define ``ssm::fused_mamba_scan`` (idempotent). Returns the ``Library`` fragment that keeps it."""
    lib = torch.library.Library("ssm", "FRAGMENT")
    lib.define(f"fused_mamba_scan{_SCHEMA}")
    # One kernel for every device: _impl names the devices it does not support.
    lib.impl("fused_mamba_scan", _impl, "CompositeExplicitAutograd")
    torch.library.register_fake("ssm::fused_mamba_scan", _fake, lib=lib)
    register_autograd(lib, "fused_mamba_scan", _backward, _setup_context)
    return lib
