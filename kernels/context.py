"""What the ops' kernels do about ambient state they must not inherit from the caller.

- Autocast: each op promises its own precision (fp32 accumulation, outputs in the inputs'
  dtypes). Autocast casts the torch ops a kernel calls internally (the CPU paths are einsums
  and matmuls), so under an ambient ``torch.autocast`` the CPU scan would silently run in bf16.
  ``without_autocast`` runs a kernel with autocast off for its device.
- Forward-mode AD: the ops have no forward-mode formula. A dual tensor that reaches one would
  lose its tangent without a word (the autograd kernel only looks at ``requires_grad``), so
  ``refuse_forward_ad`` raises instead. It must run in the op's ``Autograd`` kernel:
  ``torch.func.jvp`` / ``jacfwd`` wrap the tangents at their own level, and the kernels below
  autograd only ever see the unwrapped primals. ``register_autograd`` gives the ops that use
  torch's generated autograd kernel that check.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable

import torch
import torch.autograd.forward_ad as forward_ad
from torch._library.autograd import make_autograd_impl


def without_autocast(impl: Callable[..., Any], device_type: str) -> Callable[..., Any]:
    """``impl`` (a CPU or CUDA kernel of an op) run with ``device_type`` autocast disabled."""

    @functools.wraps(impl)
    def run(*args: Any, **kwargs: Any) -> Any:
        # Checked first: the context manager costs more than the check on the (usual) path
        # without autocast, and the decode ops run once per token and layer.
        if not torch.is_autocast_enabled(device_type):
            return impl(*args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return impl(*args, **kwargs)

    return run


def refuse_functorch_grad(op_name: str) -> None:
    """Raise, naming the op, where a torch.func transform is active and a gradient is wanted.

    The ops' autograd nodes redispatch with the caller's keyset below autograd and save their
    inputs on ``ctx`` in ``forward``; functorch's grad/vjp/jacrev need a ``setup_context`` form
    instead, and would otherwise fail with torch's generic autograd.Function message. vmap of
    the forward alone does not come here (nothing requires grad) and works."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(
            f"{op_name}: torch.func transforms that differentiate (grad, vjp, jacrev, jacfwd over "
            "grad) are not supported by the op's autograd formula; use torch.autograd.grad or "
            ".backward(), or call the code without the ssm ops (eager, or torch.compile with "
            "another backend)")


def refuse_forward_ad(op_name: str, *args: Any) -> None:
    """Raise if a forward-mode AD tangent rides on one of ``args`` (inside ``dual_level``)."""
    # No dual level open: no tensor can carry a tangent (the usual, cheap case).
    if forward_ad._current_level < 0:
        return
    if any(isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None for a in args):
        raise RuntimeError(
            f"{op_name}: forward-mode AD (forward_ad dual tensors, torch.func.jvp, jacfwd) is not supported: "
            "the op has no forward-mode formula, so the tangent would be lost. Compute the JVP "
            "without the ssm ops (eager code, or torch.compile under a dual level, which leaves the "
            "graph unrewritten)")


def register_autograd(lib: torch.library.Library, name: str, backward: Callable[..., Any],
                      setup_context: Callable[..., Any]) -> None:
    """``torch.library.register_autograd`` for ``ssm::<name>`` of ``lib``, refusing tangents.

    torch's generated kernel redispatches below autograd whenever nothing requires grad, so a
    forward-mode tangent (``forward_ad``, ``torch.func.jvp``, ``jacfwd``) would come back
    dropped or as zeros. This registers that same generated kernel behind
    ``refuse_forward_ad``, and behind ``refuse_functorch_grad`` where a gradient is wanted."""
    qualname = f"ssm::{name}"
    generated = make_autograd_impl(getattr(torch.ops.ssm, name).default,
                                   types.SimpleNamespace(_backward_fn=backward, _setup_context_fn=setup_context))

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_forward_ad(qualname, *args, *kwargs.values())
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in (*args, *kwargs.values())):
            refuse_functorch_grad(qualname)
        return generated(keyset, *args, **kwargs)

    lib.impl(name, kernel, "Autograd", with_keyset=True)


def registration_guard(register: Callable[[], Any]) -> Callable[[], bool]:
    """A call that makes sure ``register`` (an op module's ``functools.cache``-d definition) has
    run, for the public wrappers. Dynamo runs it eagerly while tracing, instead of tracing into
    the cache (its lru_cache warning) and the Library's constructor (which it refuses: a graph
    break, or an error under fullgraph=True), so a wrapper's first call may be a compiled one."""

    @torch.compiler.assume_constant_result
    def ensure() -> bool:
        register()
        return True

    return ensure
