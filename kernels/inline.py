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
24). The decode ops, the forwards of ``causal_conv1d`` and ``selective_scan``, and ``x_dt_proj``
register the rule (``x_dt_proj`` records its kernel's launch where the op would launch it, and its
two matmuls elsewhere).

The scan forward's launch sets ``maxnreg``, a compile option that ``wrap_triton`` does not record,
and the cap is worth 2-8 % of the kernel's time even where ptxas needs fewer registers than the
cap (H200, Triton 3.6, batch 8, L=2048, HF's layout, run 26: uncapped bf16 0.2434 against
0.2258 ms at 133 against 161 registers, fp32 0.2381 against 0.2343 ms at 163 both;
``benchmarks/bench_scan_variants.py --caps 0,128``). Its launcher therefore records the kernel as
a one-config ``triton.autotune`` with the cap in the config's keyword arguments, which inductor's
generated code turns back into the compile option (``triton_common.launcher``).

What a recorded launch costs at compile time: torch works out which of a kernel's tensors it
reads and writes by compiling the kernel to TTIR and walking it, once when functionalization
records the launch and again at each stage after (AOTAutograd's passes, inductor's lowering),
for every launch, though 24 layers launch the same kernel with the same arguments (the open
upstream pull request pytorch#193227 would record the answer once). For the scan and conv kernels that is 0.27-0.37 s an
analysis (Triton 3.9, sm_90), and on the H200 the 130m forward's cold compile took 65 s with
the launches inlined against 26 s with the ops whole (run 26, ``benchmarks/probe_compile_time.py``).
``memoize_access_analysis`` keeps each answer for this package's kernels: the analysis reads
nothing but the kernel, the argument names, the tensors' dtypes and the other arguments'
values, so those are the key, and a launch with the same key gets the same answer.

The op stays whole (``mode.__torch_dispatch__``) on CPU; with symbolic sizes, from which a
launcher cannot choose its tiles; under Triton's interpreter, whose kernels run as NumPy on host
memory; for tensor subclasses other than fake and functional tensors; and under
``torch.export``, which keeps custom ops whole (``decompose_custom_triton_ops``), as it does for
``triton_op``. Eager calls never see the rule.
"""
from __future__ import annotations

import copy
import functools
import logging
from typing import Any, Callable, Optional

import torch

log = logging.getLogger("ssm_compile")


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


# The kernels whose access analysis is kept: this package's (its modules' names start so).
_OWN_MODULES = __name__.rsplit(".", 2)[0] + "."
# torch's analysis of a recorded launch, by the name each torch version gives it.
_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")
_NOT_KEYED = object()
_MAX_MEMO = 4096


def _analysis_value(v: Any) -> Any:
    """What the access analysis reads of one launch argument (``_NOT_KEYED`` if it cannot be
    keyed): a tensor's dtype (the analysis replaces every tensor with a 2-element one of that
    dtype), one marker for every symbolic size (the analysis puts 2 in for each), a plain value
    as it is."""
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype)
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("symbolic",)
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype)):
        return (type(v).__name__, v)
    get_dtype = getattr(v, "get_dtype", None)  # inductor's IR nodes (TensorBox, buffers)
    if callable(get_dtype):
        try:
            return ("tensor", get_dtype())
        except Exception:  # noqa: BLE001 - a node without a dtype: leave the launch unkeyed
            return _NOT_KEYED
    return _NOT_KEYED


def _analysis_key(kernel: Any, kwargs: Any, rest: tuple, extra: dict) -> Optional[tuple]:
    """The memo key of one analysis call, or None where the call is not this package's kernel
    or holds anything the key would not capture (TMA descriptors, symbolic expressions)."""
    fn = getattr(kernel, "fn", kernel)  # a triton.autotune wraps the JITFunction
    if not str(getattr(fn, "module", "")).startswith(_OWN_MODULES) or extra or not isinstance(kwargs, dict):
        return None
    if any(r for r in rest):  # TMA descriptor metadata: none of ours has any
        return None
    values = tuple((name, _analysis_value(v)) for name, v in sorted(kwargs.items()))
    # A launch with launch options (num_warps) gets a new one-config autotuner around the kernel
    # each time; the analysis reads its first config's keyword arguments, so those are the key.
    configs = tuple(
        (tuple((name, _analysis_value(v)) for name, v in sorted(c.kwargs.items())), c.num_warps, c.num_stages,
         getattr(c, "maxnreg", None))
        for c in getattr(kernel, "configs", ()))
    if any(v is _NOT_KEYED for _, v in values) or any(
            v is _NOT_KEYED for c in configs for _, v in c[0]):
        return None
    return (fn, configs, values)


def memoize_access_analysis() -> None:
    """Keep torch's read/write analysis of this package's recorded launches (see the module
    docstring), once per process. A torch without the analysis under a known name is left
    alone: the launches then cost what torch makes them cost."""
    from torch._higher_order_ops import triton_kernel_wrap

    name = next((n for n in _ANALYSES if hasattr(triton_kernel_wrap, n)), None)
    if name is None:
        log.debug("ssm inline: torch has none of %s; launches analysed as torch does", _ANALYSES)
        return
    original = getattr(triton_kernel_wrap, name)
    if getattr(original, "_ssm_memo", None) is not None:
        return
    memo: dict = {}

    @functools.wraps(original)
    def memoized(kernel, kwargs, *rest, **extra):
        try:
            key = _analysis_key(kernel, kwargs, rest, extra)
        except Exception:  # noqa: BLE001 - a launch of a shape the key does not know: not kept
            key = None
        if key is None:
            return original(kernel, kwargs, *rest, **extra)
        if key not in memo:
            if len(memo) >= _MAX_MEMO:  # a stream of ever-new shapes must not grow it without bound
                memo.clear()
            memo[key] = original(kernel, kwargs, *rest, **extra)
        # A copy: callers may add to what they are handed.
        return copy.deepcopy(memo[key])

    memoized._ssm_memo = memo
    setattr(triton_kernel_wrap, name, memoized)


# Qualified names of the ops that have the rule: the backend retries a failed compile of a graph
# holding one of them with the ops whole before it gives up its rewrites (ssm_compile/compiler.py).
INLINED: set[str] = set()


def register_inline(lib: torch.library.Library, qualname: str, traced_impl: Callable[..., Any],
                    functional_impl: Optional[Callable[..., Any]] = None, written: Optional[int] = None) -> None:
    """Give ``qualname`` (``"ssm::name"``) the rule above; ``traced_impl`` takes the op's
    positional arguments and launches through ``wrap_triton``. ``functional_impl``, if given,
    replaces the whole op where it is not inlined (same arguments, traced under the mode).

    ``written``: the position of the argument an in-place op writes. ``traced_impl`` then writes
    nothing it was given: it returns ``(result, new)``, ``new`` a tensor its launch filled, and
    the argument is given ``new``'s value the way functionalization applies any write (replace,
    commit, sync), hidden from autograd as a recorded launch's own write is. A launch that wrote
    the argument itself would be cloned first (``triton_kernel_wrapper_functional``), and that
    clone is what inductor got wrong (``kernels/decode/op.py``)."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode, PythonFunctionalizeAPI

    INLINED.add(qualname)
    memoize_access_analysis()

    def rule(mode, op, types, args, kwargs):
        if inlines(types, args, kwargs):
            with mode:
                out = traced_impl(*args)
            if written is None:
                return out
            result, new = out
            ctx = PythonFunctionalizeAPI(mode)
            target = args[written]
            ctx.replace(target, FunctionalTensor.from_functional(new))
            ctx.mark_mutation_hidden_from_autograd(target)
            ctx.commit_update(target)
            ctx.sync(target)
            return result
        if functional_impl is not None:
            with mode:
                return functional_impl(*args, **kwargs)
        return mode.__torch_dispatch__(op, types, args, kwargs)

    torch.library.register_torch_dispatch(qualname, FunctionalTensorMode, rule, lib=lib)
