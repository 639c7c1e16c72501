"""``ssm::causal_conv1d``: depthwise causal conv1d with fused bias and silu.

Layers: Triton kernels in ``triton_conv.py`` (CUDA), PyTorch in ``cpu.py`` (CPU), the fp64 spec in
``reference.py``; this file defines the ``torch.library`` ops, their fake implementations, the
autograd formula (through a second op, ``ssm::causal_conv1d_backward``, so that the backward is
also a single opaque kernel under AOTAutograd), and the public wrapper ``causal_conv1d_fn``.
Nothing is registered until ``register()`` is called.

Host cost per call is what batch-1 and short-L training steps pay on top of the kernels, so the
autograd kernel is a plain ``torch.autograd.Function`` behind the ``Autograd`` key (what
``register_autograd`` builds, minus its per-call argument re-packing), and the real kernels
remember which input signatures already passed ``check_causal_conv1d_args``
(``benchmarks/host_overhead_ops.py`` measures it).
"""
import functools
from typing import NamedTuple, Optional

import torch
from torch import _C

from ..context import refuse_forward_ad, refuse_functorch_grad, registration_guard, without_autocast
from ..inline import register_inline
from ..layout import empty_activation
from . import cpu, triton_conv

_FWD_SCHEMA = (
    "causal_conv1d(Tensor x, Tensor weight, Tensor? bias=None, str? activation=None, "
    "Tensor? initial_state=None) -> Tensor"
)
_BWD_SCHEMA = (
    "causal_conv1d_backward(Tensor dy, Tensor x, Tensor weight, Tensor? bias, str? activation, "
    "Tensor? initial_state) -> (Tensor dx, Tensor dweight, Tensor dbias, Tensor dinitial_state)"
)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# mamba_ssm and the causal-conv1d package accept "swish" as a synonym of silu.
_ACTIVATIONS = (None, "silu", "swish")
MIN_WIDTH, MAX_WIDTH = 2, 8


# Input signatures (shapes, dtypes, devices, activation) that passed check_causal_conv1d_args:
# validity depends on nothing else, and a lookup costs about half of a full check. Bounded so
# that a stream of ever-new shapes cannot grow it without limit.
_VALIDATED: set = set()
_MAX_VALIDATED = 4096


def _check_args_cached(x, weight, bias, activation, initial_state) -> None:
    """``check_causal_conv1d_args`` for real (never fake) tensors, skipped for a known signature.

    Fake impls must not use it: their sizes may be symbolic, and SymInts are not hashable.
    """
    tensors = (x, weight, bias, initial_state)
    key = tuple([None if t is None else (t.shape, t.dtype, t.device) for t in tensors] + [activation])
    if key in _VALIDATED:
        return
    check_causal_conv1d_args(x, weight, bias, activation, initial_state)
    if len(_VALIDATED) >= _MAX_VALIDATED:
        _VALIDATED.clear()
    _VALIDATED.add(key)


def _check_tensor(name: str, t: torch.Tensor, shape: tuple, device: torch.device, op: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{op}{name}: expected shape {shape}, got {tuple(t.shape)}")
    # fp64 is accepted on CPU only, for gradcheck: the Triton kernels accumulate in fp32, so
    # fp64 on CUDA would silently lose precision.
    allowed = _DTYPES + ((torch.float64,) if device.type == "cpu" else ())
    if t.dtype not in allowed:
        raise TypeError(
            f"{op}{name}: expected dtype float32, bfloat16 or float16 (float64 on CPU only), "
            f"got {t.dtype}"
        )
    if t.device != device:
        raise ValueError(f"{op}{name}: expected device {device} (x's device), got {t.device}")


def check_causal_conv1d_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Optional[str],
    initial_state: Optional[torch.Tensor],
    op: Optional[str] = "causal_conv1d",
) -> None:
    """Raise ValueError/TypeError naming the argument if the inputs break the op's contract.

    ``op`` heads each message; None leaves it to a caller that wraps the error in its own context
    (``fused_mamba_scan``)."""
    op = f"{op}: " if op else ""
    for name, t, required in (("x", x, True), ("weight", weight, True), ("bias", bias, False),
                              ("initial_state", initial_state, False)):
        if not (isinstance(t, torch.Tensor) or (t is None and not required)):
            raise TypeError(f"{op}{name}: expected a Tensor{'' if required else ' or None'}, "
                            f"got {type(t).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{op}x: expected a (batch, dim, seqlen) tensor, got shape {tuple(x.shape)}")
    batch, dim, _ = x.shape
    _check_tensor("x", x, tuple(x.shape), x.device, op)
    if weight.dim() != 2 or weight.shape[0] != dim:
        raise ValueError(f"{op}weight: expected shape (dim={dim}, W), got {tuple(weight.shape)}")
    width = weight.shape[1]
    if not MIN_WIDTH <= width <= MAX_WIDTH:
        raise ValueError(
            f"{op}weight: expected width W in [{MIN_WIDTH}, {MAX_WIDTH}], got shape "
            f"{tuple(weight.shape)} (W={width})"
        )
    _check_tensor("weight", weight, (dim, width), x.device, op)
    if bias is not None:
        _check_tensor("bias", bias, (dim,), x.device, op)
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, (batch, dim, width - 1), x.device, op)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{op}activation: expected None, 'silu' or 'swish', got {activation!r}")


def _check_grad(dy: torch.Tensor, x: torch.Tensor) -> None:
    _check_tensor("dy", dy, tuple(x.shape), x.device, "causal_conv1d_backward: ")


def _is_silu(activation: Optional[str]) -> bool:
    return activation in ("silu", "swish")


def _fwd_fake(x, weight, bias=None, activation=None, initial_state=None):
    check_causal_conv1d_args(x, weight, bias, activation, initial_state)
    return empty_activation(x)


def _fwd_cpu(x, weight, bias=None, activation=None, initial_state=None):
    _check_args_cached(x, weight, bias, activation, initial_state)
    if x.numel() == 0:
        return empty_activation(x)
    return cpu.causal_conv1d_fwd(x, weight, bias, initial_state, _is_silu(activation))


def _fwd_cuda(x, weight, bias=None, activation=None, initial_state=None):
    _check_args_cached(x, weight, bias, activation, initial_state)
    if x.numel() == 0:
        return empty_activation(x)  # (a launch grid may not be empty)
    return triton_conv.causal_conv1d_fwd(x, weight, bias, initial_state, _is_silu(activation))


def _fwd_traced(x, weight, bias=None, activation=None, initial_state=None):
    # The forward as a graph records it on CUDA (kernels/inline.py): the full check (the cached
    # one hashes sizes, which traced tensors may not have), then the launch through wrap_triton.
    check_causal_conv1d_args(x, weight, bias, activation, initial_state)
    if x.numel() == 0:
        return empty_activation(x)
    return triton_conv.causal_conv1d_fwd(x, weight, bias, initial_state, _is_silu(activation), traced=True)


def _bwd_fake(dy, x, weight, bias, activation, initial_state):
    check_causal_conv1d_args(x, weight, bias, activation, initial_state)
    _check_grad(dy, x)
    absent = x.new_empty(0, dtype=torch.float32)
    return (
        empty_activation(x),
        weight.new_empty(weight.shape),
        absent if bias is None else bias.new_empty(bias.shape),
        absent.clone() if initial_state is None else initial_state.new_empty(initial_state.shape),
    )


def _bwd_of_empty(x, weight, bias, initial_state):
    """The gradients where x holds no element: y is empty, so nothing reaches any input."""
    absent = x.new_empty(0, dtype=torch.float32)
    return (
        empty_activation(x),
        torch.zeros_like(weight),
        absent if bias is None else torch.zeros_like(bias),
        absent.clone() if initial_state is None else torch.zeros_like(initial_state),
    )


def _bwd_cpu(dy, x, weight, bias, activation, initial_state):
    _check_args_cached(x, weight, bias, activation, initial_state)
    _check_grad(dy, x)
    if x.numel() == 0:
        return _bwd_of_empty(x, weight, bias, initial_state)
    return tuple(cpu.causal_conv1d_bwd(dy, x, weight, bias, initial_state, _is_silu(activation)))


def _bwd_cuda(dy, x, weight, bias, activation, initial_state):
    _check_args_cached(x, weight, bias, activation, initial_state)
    _check_grad(dy, x)
    if x.numel() == 0:
        return _bwd_of_empty(x, weight, bias, initial_state)
    grads = triton_conv.causal_conv1d_bwd(dy, x, weight, bias, initial_state, _is_silu(activation))
    return tuple(grads)


class _ApplyGrads(NamedTuple):
    """Gradients of ``_CausalConv1d.apply``'s arguments, by name (autograd reads it as a tuple)."""

    keyset: None
    x: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    activation: None
    initial_state: Optional[torch.Tensor]


class _CausalConv1d(torch.autograd.Function):
    """The autograd node of ``ssm::causal_conv1d``, applied by its ``Autograd``-key kernel.

    ``keyset`` is the dispatch keyset the op was called with: forward redispatches below
    autograd with it (as ``register_autograd`` does), so that dispatch modes and functorch
    layers active at the call are honoured.
    """

    @staticmethod
    def forward(ctx, keyset, x, weight, bias, activation, initial_state):
        with _C._AutoDispatchBelowAutograd():
            y = torch.ops.ssm.causal_conv1d.default.redispatch(
                keyset & _C._after_autograd_keyset, x, weight, bias, activation, initial_state
            )
        ctx.save_for_backward(x, weight, bias, initial_state)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, initial_state = ctx.saved_tensors
        args = (dy, x, weight, bias, ctx.activation, initial_state)
        if torch.is_grad_enabled():
            # create_graph=True: go through the backward op's autograd kernel, which refuses.
            grads = cpu.ConvGrads(*torch.ops.ssm.causal_conv1d_backward.default(*args))
        else:
            # Nothing is recorded anyway, so skip the (Python) autograd kernel's dispatch hop.
            with _C._AutoDispatchBelowAutograd():
                grads = cpu.ConvGrads(*torch.ops.ssm.causal_conv1d_backward.default(*args))
        # The op returns empty placeholders for absent inputs; autograd wants None there.
        return _ApplyGrads(
            keyset=None,
            x=grads.dx,
            weight=grads.dweight,
            bias=None if bias is None else grads.dbias,
            activation=None,  # a string has no gradient
            initial_state=None if initial_state is None else grads.dinitial_state,
        )


def _fwd_autograd(keyset, x, weight, bias=None, activation=None, initial_state=None):
    # The dispatcher drops trailing arguments equal to their defaults, hence the defaults here.
    refuse_forward_ad("ssm::causal_conv1d", x, weight, bias, initial_state)
    if _C.is_grad_enabled() and _C._any_requires_grad(x, weight, bias, initial_state):
        refuse_functorch_grad("ssm::causal_conv1d")
        return _CausalConv1d.apply(keyset, x, weight, bias, activation, initial_state)
    with _C._AutoDispatchBelowAutograd():
        return torch.ops.ssm.causal_conv1d.default.redispatch(
            keyset & _C._after_autograd_keyset, x, weight, bias, activation, initial_state
        )


class _RefuseDoubleBackward(torch.autograd.Function):
    """Autograd node for ``ssm::causal_conv1d_backward``: its own backward is not implemented."""

    @staticmethod
    def forward(ctx, keyset, *args):
        with _C._AutoDispatchBelowAutograd():
            return torch.ops.ssm.causal_conv1d_backward.default.redispatch(
                keyset & _C._after_autograd_keyset, *args
            )

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "causal_conv1d: double backward (create_graph=True through ssm::causal_conv1d) is not "
            "supported: ssm::causal_conv1d_backward has no autograd formula"
        )


def _bwd_autograd(keyset, *args):
    if _C.is_grad_enabled() and _C._any_requires_grad(*args):
        return _RefuseDoubleBackward.apply(keyset, *args)
    with _C._AutoDispatchBelowAutograd():
        return torch.ops.ssm.causal_conv1d_backward.default.redispatch(
            keyset & _C._after_autograd_keyset, *args
        )


@functools.cache
def register() -> torch.library.Library:
    """Define ``ssm::causal_conv1d`` and ``ssm::causal_conv1d_backward`` (idempotent).

    Returns the ``Library`` fragment; the cache keeps it alive, which keeps the ops defined.
    """
    lib = torch.library.Library("ssm", "FRAGMENT")
    # flexible_layout: the kernels read any strides, so inductor may pass its buffers as they
    # are instead of copying them into eager's strides; it re-runs the fake impl on its choice.
    lib.define(_FWD_SCHEMA, tags=(torch.Tag.flexible_layout,))
    lib.define(_BWD_SCHEMA, tags=(torch.Tag.flexible_layout,))
    lib.impl("causal_conv1d", without_autocast(_fwd_cpu, "cpu"), "CPU")
    lib.impl("causal_conv1d", without_autocast(_fwd_cuda, "cuda"), "CUDA")
    lib.impl("causal_conv1d_backward", without_autocast(_bwd_cpu, "cpu"), "CPU")
    lib.impl("causal_conv1d_backward", without_autocast(_bwd_cuda, "cuda"), "CUDA")
    torch.library.register_fake("ssm::causal_conv1d", _fwd_fake, lib=lib)
    torch.library.register_fake("ssm::causal_conv1d_backward", _bwd_fake, lib=lib)
    lib.impl("causal_conv1d", _fwd_autograd, "Autograd", with_keyset=True)
    lib.impl("causal_conv1d_backward", _bwd_autograd, "Autograd", with_keyset=True)
    # Compiled on CUDA, the forward is its kernel's launch in inductor's code. The backward stays
    # an op: its launcher sums partials in several launches, and its host cost is the training
    # step's, where the GPU time dominates.
    register_inline(lib, "ssm::causal_conv1d", _fwd_traced)
    return lib


_ensure_registered = registration_guard(register)


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """Depthwise causal conv1d with fused bias and activation (the causal-conv1d package's call).

    ``y[b, d, t] = bias[d] + sum_k weight[d, k] * x[b, d, t - (W-1) + k]``, then silu if asked,
    where inputs before time 0 come from ``initial_state`` (zeros when None). Differentiable in
    x, weight, bias and initial_state. Triton kernels on CUDA, PyTorch on CPU.

    Args:
        x: (batch, dim, seqlen), fp32/bf16/fp16, any strides.
        weight: (dim, W) with 2 <= W <= 8.
        bias: (dim,) or None.
        initial_state: (batch, dim, W-1), the W-1 inputs that precede x, or None for zeros.
        activation: None, "silu" or "swish" (the same as "silu").

    Returns:
        y: (batch, dim, seqlen) in x's dtype and layout (channel-innermost x gives a
            channel-innermost y; anything else a contiguous one).

    Example:
        >>> x = torch.randn(2, 64, 128)
        >>> weight, bias = torch.randn(64, 4), torch.randn(64)
        >>> y = causal_conv1d_fn(x, weight, bias, activation="silu")
        >>> y.shape
        torch.Size([2, 64, 128])
    """
    _ensure_registered()
    return torch.ops.ssm.causal_conv1d(x, weight, bias, activation, initial_state)
