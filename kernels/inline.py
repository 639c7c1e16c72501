"""Handing an op's Triton launches to inductor when a graph is compiled.

An ``ssm`` op called from inductor's generated code costs its dispatch, our launcher and
Triton's ``JITFunction.run`` (argument specialisation, launch metadata): ~60-130 µs of host time
a call on the H200's host (``benchmarks/host_overhead_ops.py``), where inductor launches its own
kernels through a static launcher in ~10 µs. Where the host is the limit (decode steps, short
sequences, batch 1, without CUDA graphs) that difference is the step's speed.

``register_inline`` gives an op a ``FunctionalTensorMode`` rule, the mechanism
``torch.library.triton_op`` uses. AOTAutograd traces every graph it compiles under that mode;
there the op, on CUDA tensors of static sizes, runs ``traced_impl`` instead: the op's own checks
and launcher, launching through ``torch.library.wrap_triton``, which records each launch in the
graph. Inductor then compiles those launches into its code. The kernels, their launch sizes and
their outputs' layouts are the op's, so the result is the same.

Inductor compiles a recorded launch from the kernel's source and the sources of the helpers it
calls, each under its own name. A kernel must therefore call its helpers by their own names, not
through an import alias: ``causal_conv1d``'s forward kernels called ``silu`` as ``silu_fn``, and on
torch 2.11 inlining them raised ``NameError('silu_fn is not defined')`` in inductor's compile (run
24). The decode ops and ``causal_conv1d``'s forward register the rule. The scan forward does not:
its launch sets ``maxnreg``, a compile option that ``wrap_triton`` does not record, and its speed
rests on that register cap.

The op stays whole (``mode.__torch_dispatch__``) on CPU; with symbolic sizes, from which a
launcher cannot choose its tiles; under Triton's interpreter, whose kernels run as NumPy on host
memory; for tensor subclasses other than fake and functional tensors; and under
``torch.export``, which keeps custom ops whole (``decompose_custom_triton_ops``), as it does for
``triton_op``. Eager calls never see the rule.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch


@functools.cache
def _traced_tensor_types() -> tuple:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return (FakeTensor, FunctionalTensor)


@functools.cache
def _interpreted() -> bool:
    from .triton_common import _INTERPRETED

    return bool(_INTERPRETED)


def _static_cuda(args) -> bool:
    """Every tensor in ``args`` is on CUDA with concrete sizes and strides."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(
        t.is_cuda and all(type(s) is int for s in (*t.shape, *t.stride())) for t in tensors)


def inlines(types, args, kwargs) -> bool:
    """Whether a call with these (``__torch_dispatch__``-normalised) arguments is inlined."""
    return (getattr(torch._functorch.config, "decompose_custom_triton_ops", True)
            and all(t is torch.Tensor or issubclass(t, _traced_tensor_types()) for t in types)
            and not kwargs and _static_cuda(args) and not _interpreted())


# Qualified names of the ops that have the rule: the backend retries a failed compile of a graph
# holding one of them with the ops whole before it gives up its rewrites (ssm_compile/compiler.py).
INLINED: set[str] = set()


def register_inline(lib: torch.library.Library, qualname: str, traced_impl: Callable[..., Any]) -> None:
    """Give ``qualname`` (``"ssm::name"``) the rule above; ``traced_impl`` takes the op's
    positional arguments and launches through ``wrap_triton``."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    INLINED.add(qualname)

    def rule(mode, op, types, args, kwargs):
        if inlines(types, args, kwargs):
            with mode:
                return traced_impl(*args)
        return mode.__torch_dispatch__(op, types, args, kwargs)

    torch.library.register_torch_dispatch(qualname, FunctionalTensorMode, rule, lib=lib)
