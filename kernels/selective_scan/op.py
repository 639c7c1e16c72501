"""The ``ssm::selective_scan`` op: validation, fake impl, CPU/CUDA dispatch, autograd.

``register()`` defines two ops (nothing happens at import):

* ``ssm::selective_scan`` -- the forward, differentiable through an ``Autograd``-key kernel
  backed by a ``torch.autograd.Function``;
* ``ssm::selective_scan_backward`` -- its gradients, an op of its own with a fake impl so that
  AOTAutograd and inductor keep the backward opaque instead of tracing into a kernel.

Both run the chunked PyTorch code in ``cpu.py`` on CPU and the Triton launchers on CUDA.

The ops are defined on a ``torch.library.Library`` fragment (backend, fake and autograd kernels
registered one by one) rather than with ``torch.library.custom_op``: custom_op wraps every call
in several Python layers (its autograd kernel, an output-aliasing check, a dynamo-disable
wrapper), about 13 µs per call, which dominated batch-1, short-L and decode steps. For the same
reason the real impls remember which input signatures (shapes, dtypes, devices) already passed
``check_selective_scan_inputs``; the fake impl always checks, so bad inputs still fail at
compile time. ``benchmarks/host_overhead_ops.py`` measures what is left.

Dtype policy (checked by ``check_selective_scan_inputs``):

* u, delta, B, C, z, D, delta_bias: fp32, bf16 or fp16, independently of each other;
  everything is accumulated in fp32 and each gradient has its input's dtype.
* A, initial_state: fp32 (A is -exp(A_log.float()) in every Mamba implementation, and the
  state is fp32 by contract); last_state is returned in fp32.
* fp64 is accepted for any of them **on CPU only**: it is the verification mode used by
  ``gradcheck``. When any input is fp64 the whole computation runs in fp64 and last_state is
  fp64. The Triton kernels have no fp64 path, so fp64 on CUDA is an error.

Output layouts, which the fake impls promise and so every backend must produce exactly
(inductor trusts them): y takes u's layout (``kernels/layout.py``: channel-innermost u, as
``nn.Linear``-based Mamba code holds it, gives a channel-innermost y, which out_proj then reads
without a copy; any other u gives a contiguous y); last_state and the gradients dA, dB, dC,
dD, ddelta_bias, dinitial_state are contiguous; du, ddelta and dz are ``torch.empty_like``
their input (a transposed u gets a transposed du, which the transpose's own backward then
needs no copy for).

The ops carry the ``flexible_layout`` tag: the kernels read any strides, so inductor may hand
them its own buffers as they are (an ``nn.Linear`` output in its (batch, L, dim) layout, say)
instead of copying each input into the strides eager had. Inductor re-runs the fake impl on
the strides it chose, so the promised output layouts follow.
"""
import functools
from typing import Optional

import torch
from torch import _C

from ..context import refuse_forward_ad, refuse_functorch_grad, registration_guard, without_autocast
from ..inline import register_inline
from ..layout import empty_activation
from . import cpu, invariant

_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SUPPORTED_DEVICES = ("cpu", "cuda")
MAX_DSTATE = 256

_SCHEMA = (
    "selective_scan(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D=None, Tensor? z=None, "
    "Tensor? delta_bias=None, bool delta_softplus=False, Tensor? initial_state=None, "
    "bool return_last_state=False) -> (Tensor y, Tensor last_state)"
)
# Absent optional inputs get an empty (0,) gradient: a schema cannot return None.
_BACKWARD_SCHEMA = (
    "selective_scan_backward(Tensor dy, Tensor? dlast_state, Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, "
    "Tensor? D, Tensor? z, Tensor? delta_bias, bool delta_softplus, Tensor? initial_state) -> "
    "(Tensor du, Tensor ddelta, Tensor dA, Tensor dB, Tensor dC, Tensor dD, Tensor dz, "
    "Tensor ddelta_bias, Tensor dinitial_state)"
)
# Arguments of _SelectiveScan.apply (the dispatch keyset, then ssm::selective_scan's inputs in
# schema order), so that backward can return gradients by name.
_APPLY_ARGS = (
    "keyset", "u", "delta", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "initial_state",
    "return_last_state",
)


# Input signatures that passed check_selective_scan_inputs, each with its state dtype. Both
# depend only on shapes, dtypes and devices, and a lookup costs about half of a full check.
# Bounded so that a stream of ever-new shapes cannot grow it without limit.
_VALIDATED: dict = {}
_MAX_VALIDATED = 4096


def _checked_state_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state) -> torch.dtype:
    """``check_selective_scan_inputs`` for real (never fake) tensors, skipped for a known
    signature; returns ``cpu.compute_dtype`` of the inputs.

    Fake impls must not use it: their sizes may be symbolic, and SymInts are not hashable.
    """
    tensors = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    key = tuple([None if t is None else (t.shape, t.dtype, t.device) for t in tensors])
    state_dtype = _VALIDATED.get(key)
    if state_dtype is None:
        check_selective_scan_inputs(*tensors)
        state_dtype = cpu.compute_dtype(*tensors)
        if len(_VALIDATED) >= _MAX_VALIDATED:
            _VALIDATED.clear()
        _VALIDATED[key] = state_dtype
    return state_dtype


def _expect_shape(name: str, t: torch.Tensor, shape: tuple, meaning: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"selective_scan: {name} must have shape {meaning} = {tuple(shape)}, got {tuple(t.shape)}"
        )


def check_selective_scan_inputs(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    delta_bias: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
) -> None:
    """Raise ValueError/TypeError/RuntimeError naming the offending argument; else return.

    Runs in every impl, the fake one included, so that bad inputs fail at compile time. The
    device *type* is left to the real impls (``_check_device``): fake and meta tensors must
    pass here.
    """
    tensors = {
        "u": u, "delta": delta, "A": A, "B": B, "C": C, "D": D, "z": z,
        "delta_bias": delta_bias, "initial_state": initial_state,
    }
    for name, t in tensors.items():
        required = name in ("u", "delta", "A", "B", "C")
        if not (isinstance(t, torch.Tensor) or (t is None and not required)):
            raise TypeError(f"selective_scan: {name} must be a Tensor{'' if required else ' or None'}, "
                            f"got {type(t).__name__}")
    device = u.device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise RuntimeError(
                f"selective_scan: all tensors must be on one device, but {name} is on {t.device} "
                f"while u is on {device}"
            )

    # The Triton kernels have no fp64 path; everywhere else fp64 is the verification mode.
    fp64_ok = device.type != "cuda"
    for name, t in tensors.items():
        if t is None:
            continue
        ok = (torch.float32,) if name in ("A", "initial_state") else _ACTIVATION_DTYPES
        if fp64_ok:
            ok += (torch.float64,)
        if t.dtype not in ok:
            extra = " (fp64 is supported on CPU only)" if t.dtype == torch.float64 else ""
            raise TypeError(
                f"selective_scan: {name} must have a dtype in {[str(d) for d in ok]}, "
                f"got {t.dtype}{extra}"
            )

    if u.dim() != 3:
        raise ValueError(f"selective_scan: u must be 3-D (batch, dim, L), got shape {tuple(u.shape)}")
    batch, dim, seqlen = u.shape
    if seqlen < 1:
        raise ValueError(f"selective_scan: u must have L >= 1 time steps, got shape {tuple(u.shape)}")
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(
            f"selective_scan: A must have shape (dim, N) with dim = {dim}, got {tuple(A.shape)}"
        )
    dstate = A.shape[1]
    if not 1 <= dstate <= MAX_DSTATE:
        raise ValueError(
            f"selective_scan: A's state size N = A.shape[1] must be in [1, {MAX_DSTATE}], got {dstate}"
        )
    _expect_shape("delta", delta, (batch, dim, seqlen), "(batch, dim, L)")
    if z is not None:
        _expect_shape("z", z, (batch, dim, seqlen), "(batch, dim, L)")
    if D is not None:
        _expect_shape("D", D, (dim,), "(dim,)")
    if delta_bias is not None:
        _expect_shape("delta_bias", delta_bias, (dim,), "(dim,)")
    if initial_state is not None:
        _expect_shape("initial_state", initial_state, (batch, dim, dstate), "(batch, dim, N)")

    if invariant.any_time_invariant(B, C):
        invariant.check_pair(B, C, batch, dim, dstate, seqlen)
        return
    if B.dim() not in (3, 4):
        raise ValueError(
            f"selective_scan: B must be (batch, N, L), grouped (batch, G, N, L) or time-invariant "
            f"(dim, N), got shape {tuple(B.shape)}"
        )
    groups = 1 if B.dim() == 3 else B.shape[1]
    if groups < 1 or dim % groups != 0:
        raise ValueError(
            f"selective_scan: B's group count G = {groups} must divide dim = {dim} "
            f"(B has shape {tuple(B.shape)})"
        )
    if B.dim() == 3:
        _expect_shape("B", B, (batch, dstate, seqlen), "(batch, N, L)")
    else:
        _expect_shape("B", B, (batch, groups, dstate, seqlen), "(batch, G, N, L)")
    if C.dim() != B.dim():
        raise ValueError(
            f"selective_scan: C must have the same layout as B {tuple(B.shape)}, got shape "
            f"{tuple(C.shape)}"
        )
    _expect_shape("C", C, B.shape, "B.shape")


def _check_device(u: torch.Tensor) -> None:
    if u.device.type not in _SUPPORTED_DEVICES:
        raise RuntimeError(
            f"selective_scan: tensors on device type '{u.device.type}' are not supported "
            f"(u is on {u.device}); supported device types: {list(_SUPPORTED_DEVICES)}"
        )


@functools.cache
def _triton_launchers():
    """The Triton launcher modules, imported on the first CUDA call (a cached lookup after that,
    cheaper than an import statement per call)."""
    from . import triton_bwd, triton_fwd

    return triton_fwd, triton_bwd


def _selective_scan_impl(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None,
    return_last_state=False,
):
    state_dtype = _checked_state_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    _check_device(u)
    return _forward(_triton_launchers()[0] if u.is_cuda else cpu, state_dtype, u, delta, A, B, C, D, z,
                    delta_bias, delta_softplus, initial_state, return_last_state)


def _forward(launcher, state_dtype, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
             return_last_state, **launch_options):
    """The launcher's forward on checked inputs, with the (0,) placeholder for a last state
    that was not asked for."""
    y, last_state = launcher.selective_scan_fwd(
        u, delta, A, *invariant.launcher_views(B, C, *u.shape), D, z, delta_bias, delta_softplus, initial_state,
        return_last_state, **launch_options,
    )
    if last_state is None:
        last_state = u.new_empty((0,), dtype=state_dtype)
    return y, last_state


def _selective_scan_traced(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None,
    return_last_state=False,
):
    # The forward as a graph records it on CUDA (kernels/inline.py): the full check (the cached
    # one hashes sizes, which traced tensors may not have), then the launches through wrap_triton.
    check_selective_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    state_dtype = cpu.compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    return _forward(_triton_launchers()[0], state_dtype, u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                    initial_state, return_last_state, traced=True)


def _selective_scan_fake(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None,
    return_last_state=False,
):
    check_selective_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    state_dtype = cpu.compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    batch, dim, seqlen = u.shape
    y = empty_activation(u)
    shape = (batch, dim, A.shape[1]) if return_last_state else (0,)
    return y, u.new_empty(shape, dtype=state_dtype)


def _absent(u: torch.Tensor) -> torch.Tensor:
    """Placeholder gradient for an absent optional input (mapped back to None by autograd)."""
    return u.new_empty((0,))


def _check_incoming_grads(dy, dlast_state, u, A) -> None:
    """The incoming gradients' shapes, dtypes and devices (the inputs are checked separately)."""
    batch, dim, seqlen = u.shape
    expected = {"dy": (dy, (batch, dim, seqlen), "(batch, dim, L)")}
    if dlast_state is not None:
        expected["dlast_state"] = (dlast_state, (batch, dim, A.shape[1]), "(batch, dim, N)")
    fp64_ok = u.device.type != "cuda"
    for name, (t, shape, meaning) in expected.items():
        if t.device != u.device:
            raise RuntimeError(
                f"selective_scan_backward: {name} is on {t.device} while u is on {u.device}"
            )
        if t.dtype not in _ACTIVATION_DTYPES + ((torch.float64,) if fp64_ok else ()):
            raise TypeError(f"selective_scan_backward: {name} has unsupported dtype {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"selective_scan_backward: {name} must have shape {meaning} = {shape}, "
                f"got {tuple(t.shape)}"
            )


def _backward_impl(dy, dlast_state, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state):
    _checked_state_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    _check_incoming_grads(dy, dlast_state, u, A)
    _check_device(u)
    launcher_fwd, launcher = _triton_launchers() if u.is_cuda else (cpu, cpu)
    if invariant.any_time_invariant(B, C):
        # Returns dB/dC in B/C's own shapes, reduced without a (batch, dim, N, L) buffer.
        grads = invariant.backward(launcher_fwd.selective_scan_fwd, launcher.selective_scan_bwd, dy, dlast_state,
                                   u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state)
        dB, dC = grads.dB, grads.dC
    else:
        grads = launcher.selective_scan_bwd(
            dy, dlast_state, u, delta, A, *invariant.launcher_views(B, C, *u.shape), D, z, delta_bias, delta_softplus,
            initial_state,
        )
        # Give dB/dC back in B/C's own layout; squeezing the size-1 group dim keeps them contiguous.
        dB = grads.dB.squeeze(1) if B.dim() == 3 else grads.dB
        dC = grads.dC.squeeze(1) if C.dim() == 3 else grads.dC
    return (
        grads.du, grads.ddelta, grads.dA, dB, dC,
        _absent(u) if grads.dD is None else grads.dD,
        _absent(u) if grads.dz is None else grads.dz,
        _absent(u) if grads.ddelta_bias is None else grads.ddelta_bias,
        _absent(u) if grads.dinitial_state is None else grads.dinitial_state,
    )


def _backward_fake(dy, dlast_state, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state):
    check_selective_scan_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    _check_incoming_grads(dy, dlast_state, u, A)

    def dense(t):
        return _absent(u) if t is None else t.new_empty(t.shape)

    def strided_like(t):
        return _absent(u) if t is None else torch.empty_like(t)

    return (
        strided_like(u), strided_like(delta), dense(A), dense(B), dense(C), dense(D),
        strided_like(z), dense(delta_bias), dense(initial_state),
    )


class _SelectiveScan(torch.autograd.Function):
    """The autograd node of ``ssm::selective_scan``, applied by its ``Autograd``-key kernel.

    ``keyset`` is the dispatch keyset the op was called with: forward redispatches below
    autograd with it (as ``register_autograd`` does), so that dispatch modes and functorch
    layers active at the call are honoured.
    """

    @staticmethod
    def forward(ctx, keyset, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
                return_last_state):
        with _C._AutoDispatchBelowAutograd():
            y, last_state = torch.ops.ssm.selective_scan.default.redispatch(
                keyset & _C._after_autograd_keyset, u, delta, A, B, C, D, z, delta_bias,
                delta_softplus, initial_state, return_last_state,
            )
        # Only the inputs are saved: the backward recomputes the states it needs.
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state)
        ctx.delta_softplus = delta_softplus
        ctx.return_last_state = return_last_state
        return y, last_state

    @staticmethod
    def backward(ctx, grad_y, grad_last_state):
        u, delta, A, B, C, D, z, delta_bias, initial_state = ctx.saved_tensors
        # Without return_last_state the (0,) placeholder output carries no gradient.
        dlast_state = grad_last_state if ctx.return_last_state else None
        args = (grad_y, dlast_state, u, delta, A, B, C, D, z, delta_bias, ctx.delta_softplus, initial_state)
        if torch.is_grad_enabled():
            # create_graph=True: go through the backward op's autograd kernel, which refuses.
            grad_tuple = torch.ops.ssm.selective_scan_backward.default(*args)
        else:
            # Nothing is recorded anyway, so skip the (Python) autograd kernel's dispatch hop.
            with _C._AutoDispatchBelowAutograd():
                grad_tuple = torch.ops.ssm.selective_scan_backward.default(*args)
        du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state = grad_tuple
        grads = {
            "u": du, "delta": ddelta, "A": dA, "B": dB, "C": dC, "D": dD, "z": dz,
            "delta_bias": ddelta_bias, "initial_state": dinitial_state,
        }
        for name, given in (("D", D), ("z", z), ("delta_bias", delta_bias), ("initial_state", initial_state)):
            if given is None:
                del grads[name]  # it is only the (0,) placeholder
        # The keyset, the flags (delta_softplus, return_last_state) and absent inputs get no gradient.
        return tuple(grads.get(name) for name in _APPLY_ARGS)


def _selective_scan_autograd(
    keyset, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
    initial_state=None, return_last_state=False,
):
    # The dispatcher drops trailing arguments equal to their defaults, hence the defaults here.
    refuse_forward_ad("ssm::selective_scan", u, delta, A, B, C, D, z, delta_bias, initial_state)
    if _C.is_grad_enabled() and _C._any_requires_grad(u, delta, A, B, C, D, z, delta_bias, initial_state):
        refuse_functorch_grad("ssm::selective_scan")
        return _SelectiveScan.apply(
            keyset, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, return_last_state
        )
    with _C._AutoDispatchBelowAutograd():
        return torch.ops.ssm.selective_scan.default.redispatch(
            keyset & _C._after_autograd_keyset, u, delta, A, B, C, D, z, delta_bias, delta_softplus,
            initial_state, return_last_state,
        )


class _RefuseDoubleBackward(torch.autograd.Function):
    """Autograd node for ``ssm::selective_scan_backward``: its own backward is not implemented."""

    @staticmethod
    def forward(ctx, keyset, *args):
        with _C._AutoDispatchBelowAutograd():
            return torch.ops.ssm.selective_scan_backward.default.redispatch(
                keyset & _C._after_autograd_keyset, *args
            )

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "selective_scan: double backward (create_graph=True through ssm::selective_scan) is "
            "not supported: ssm::selective_scan_backward has no autograd formula"
        )


def _backward_autograd(keyset, *args):
    if _C.is_grad_enabled() and _C._any_requires_grad(*args):
        return _RefuseDoubleBackward.apply(keyset, *args)
    with _C._AutoDispatchBelowAutograd():
        return torch.ops.ssm.selective_scan_backward.default.redispatch(
            keyset & _C._after_autograd_keyset, *args
        )


@functools.cache
def register() -> torch.library.Library:
    """Define ``ssm::selective_scan`` and ``ssm::selective_scan_backward`` (idempotent).

    Returns the ``Library`` fragment; the cache keeps it alive, which keeps the ops defined.
    """
    lib = torch.library.Library("ssm", "FRAGMENT")
    # flexible_layout: see the module docstring (the kernels read any strides).
    lib.define(_SCHEMA, tags=(torch.Tag.flexible_layout,))
    lib.define(_BACKWARD_SCHEMA, tags=(torch.Tag.flexible_layout,))
    for name, impl, fake, autograd in (
        ("selective_scan", _selective_scan_impl, _selective_scan_fake, _selective_scan_autograd),
        ("selective_scan_backward", _backward_impl, _backward_fake, _backward_autograd),
    ):
        for device_key in ("CPU", "CUDA"):
            lib.impl(name, without_autocast(impl, device_key.lower()), device_key)
        torch.library.register_fake(f"ssm::{name}", fake, lib=lib)
        lib.impl(name, autograd, "Autograd", with_keyset=True)
    # Compiled on CUDA, the forward is its kernel's launch(es) in inductor's code. The backward
    # stays an op: several launches whose partial sums its launcher reduces, in a training step
    # where GPU time dominates.
    register_inline(lib, "ssm::selective_scan", _selective_scan_traced)
    return lib


_ensure_registered = registration_guard(register)


def selective_scan_fn(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    initial_state: Optional[torch.Tensor] = None,
):
    """Mamba-1 selective scan, with mamba_ssm's ``selective_scan_fn`` calling convention.

    Computes, per channel d with state h (N,) starting at ``initial_state`` (or zeros)::

        delta = softplus(delta + delta_bias) if delta_softplus else delta + delta_bias
        h_t = exp(delta_t * A[d]) * h_{t-1} + delta_t * B_t * u_t
        y_t = C_t . h_t + D[d] * u_t;   y = y * silu(z)

    Args:
        u: (batch, dim, L) input, fp32/bf16/fp16 (fp64 on CPU only).
        delta: (batch, dim, L) time steps, before bias and softplus.
        A: (dim, N) fp32 state matrix (diagonal per channel); 1 <= N <= 256.
        B, C: (batch, N, L), or grouped (batch, G, N, L) with dim % G == 0; channel d uses
            group d // (dim // G). Either may be time-invariant, (dim, N) (mamba_ssm's
            ``is_variable_B/C`` false); the other is then (dim, N), (batch, N, L) or grouped with
            G = 1 or dim.
        D: optional (dim,) skip connection.
        (B, C, z, D, delta_bias may each be fp32/bf16/fp16, whatever u's dtype is.)
        z: optional (batch, dim, L) gate; the output is multiplied by silu(z).
        delta_bias: optional (dim,) added to delta.
        delta_softplus: apply softplus to delta (+ bias).
        return_last_state: also return the state after the last step.
        initial_state: optional (batch, dim, N) fp32 state before the first step.

    Returns:
        y: (batch, dim, L) in u's dtype; or ``(y, last_state)`` with last_state
        (batch, dim, N) fp32 if ``return_last_state``.

    Example::

        >>> u = torch.randn(2, 64, 128); delta = torch.rand(2, 64, 128)
        >>> A = -torch.rand(64, 16); B = torch.randn(2, 16, 128); C = torch.randn(2, 16, 128)
        >>> y, h = selective_scan_fn(u, delta, A, B, C, delta_softplus=True, return_last_state=True)
        >>> y.shape, h.shape
        (torch.Size([2, 64, 128]), torch.Size([2, 64, 16]))
    """
    _ensure_registered()
    y, last_state = torch.ops.ssm.selective_scan(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, return_last_state
    )
    return (y, last_state) if return_last_state else y
