"""Make ``torch.compiler.is_exporting()`` answer correctly while dynamo traces for ``backend="ssm"``.

Before pytorch/pytorch#176499 (torch 2.11 has the bug, 2.13 the fix), dynamo folded every call
to ``torch.compiler.is_exporting()`` into the constant ``True``, also under plain
``torch.compile``. HF's Mamba family picks its scan with
``is_torchdynamo_compiling() and not is_torchdynamo_exporting()``, so on those releases a
compiled HF model always takes the Python time loop: dynamo unrolls it L times per layer and
compile time grows with L x layers (a 24-layer model at L=256 did not finish tracing in 150 s on
an H200), although the same model takes ``associative_scan`` (compile time independent of L)
on a fixed torch.

The fix here is the upstream one — read ``torch.compiler._is_exporting_flag``, which
``torch.export`` sets, instead of the folded constant — applied only to traces whose backend is
ours, so other backends in the process keep their torch's behaviour. It has to be in place
before dynamo traces the first frame, and the only code of ours that runs then is the import
that resolves ``backend="ssm"``; hence ``install()`` runs when ``ssm_compile.compiler`` is
imported.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

log = logging.getLogger("ssm_compile")

_MARK = "_ssm_compile_is_exporting_fix"


def _is_ours(compiler_fn: Any) -> bool:
    """Whether dynamo's (possibly wrapped) compiler function is an ``ssm`` backend."""
    from .compiler import SSMBackend, ssm_backend

    seen = set()
    fn = compiler_fn
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if fn is ssm_backend or isinstance(fn, SSMBackend):
            return True
        # dynamo's wrappers: convert-frame / debug wrappers, torch.compile's mode/options wrapper,
        # functools.wraps.
        fn = (getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
              or getattr(fn, "__wrapped__", None))
    return False


def install() -> bool:
    """Wrap dynamo's handler for ``torch.compiler.is_exporting`` (idempotent).

    Returns:
        whether the wrapper is in place; False where this torch lacks the pieces it needs
        (then nothing is changed and HF code may take its loop path under ``backend="ssm"``).
    """
    try:
        from torch._dynamo.variables import ConstantVariable
        from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

        handlers = TorchInGraphFunctionVariable._get_handlers()
    except (ImportError, AttributeError) as e:
        log.info("is_exporting fix not installed: this torch's dynamo has no handler table (%s)", e)
        return False
    target = torch.compiler.is_exporting
    original = handlers.get(target)
    if original is None or not hasattr(torch.compiler, "_is_exporting_flag"):
        log.info("is_exporting fix not installed: no dynamo handler or export flag in this torch")
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def handler(self, tx, *args, **kwargs):
        # The original keeps its argument checks and marks the side effects as inconsistent
        # (the value differs between tracing and eager); only the value it folds is replaced.
        result = original(self, tx, *args, **kwargs)
        if _is_ours(getattr(tx.output, "compiler_fn", None)):
            return ConstantVariable.create(bool(torch.compiler._is_exporting_flag))
        return result

    setattr(handler, _MARK, True)
    handlers[target] = handler
    return True
