import logging
import os
import sys
from pathlib import Path

# `python -m pytest` from the repository root puts the root on sys.path, and there the top-level
# kernels/ folder (installed as ssm_compile.kernels) shadows Hugging Face's `kernels` package,
# which transformers (5.25 installs it) imports: "cannot import name 'CUDAProperties' from
# 'kernels'". The package is importable through its install, so the root is dropped here, before
# any test module imports transformers.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

import torch  # noqa: E402

# On a CPU-only machine the Triton kernels run under the interpreter. This must be set before
# any @triton.jit decorator runs, so it happens here, before the test modules import kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402  (after the TRITON_INTERPRET switch above, on purpose)
from torch._dynamo.utils import counters  # noqa: E402


def _interpret_helpers_without_repatching() -> None:
    """Triton's interpreter patches ``triton.language`` before a launch and restores it after,
    and it patches again on every call of a ``@triton.jit`` helper inside the launch: an
    ``inspect.getmembers`` walk over the language modules per call. The scan backward's kernels
    call helpers thousands of times per launch, and the walks took about a third of their
    interpreted time (cProfile, Triton 3.9). Inside a launch the modules a helper sees are
    already patched, and the re-patch finds no builtin left to replace (a patched member is no
    longer a builtin), so skipping it changes nothing the helper computes. A helper whose module
    sees a language module the launch did not patch (``triton.language.core`` from
    ``standard.zeros``) is still patched as before. Where the interpreter's internals differ
    from these, nothing is changed."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch is None or scope_type is None or not hasattr(tl.core, "is_builtin"):
        return

    def patch_unless_patched(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):
            return scope_type()
        return patch(fn)

    interpreter._patch_lang = patch_unless_patched


def _interpret_scans_a_step_at_a_time() -> None:
    """The interpreter runs a ``tl.associative_scan`` with a user combine (the kernels' linear
    recurrence) one element at a time: for every element of the tile it wraps the element and its
    predecessor's result as scalar tensors and calls the combine on them, so a [32, 4, 16, 4] tile
    costs 8192 Python-level combines. That was about 70 % of an interpreted scan-backward test
    (cProfile, Triton 3.9). A combine is elementwise by contract, so calling it once per step of
    the scanned axis on the whole slice computes, element by element, the same operations on the
    same operands in the same order: step k's slice is combine(result of step k-1, input k), step
    0 is the input. Where the interpreter's scan differs from the one this replaces (no
    ``ScanOps.generic_scan``, or a ``to_tensor`` helper it does not have), nothing is changed."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    scan_ops = getattr(interpreter, "ScanOps", None)
    if scan_ops is None or not hasattr(scan_ops, "generic_scan") or not hasattr(scan_ops, "to_tensor"):
        return

    def generic_scan(self, input):
        datas = [arg.handle.data for arg in input]
        outs = [np.empty_like(d) for d in datas]
        lead = (slice(None),) * self.axis
        for out, data in zip(outs, datas):
            out[lead + (0,)] = data[lead + (0,)]
        for k in range(1, datas[0].shape[self.axis]):
            acc = [self.to_tensor(out[lead + (k - 1,)], arg.dtype) for out, arg in zip(outs, input)]
            cur = [self.to_tensor(data[lead + (k,)], arg.dtype) for data, arg in zip(datas, input)]
            ret = self.combine_fn.fn(*acc, *cur)
            for out, r in zip(outs, ret if isinstance(ret, tuple) else (ret,)):
                value = r.handle.data if isinstance(r, tl.core.tensor) else r
                # A 1-D scan's slice is one element, which to_tensor wraps as a 1-element array.
                out[lead + (k,)] = value.reshape(out[lead + (k,)].shape) if np.ndim(value) else value
        return [self.to_tensor(out, arg.dtype) for out, arg in zip(outs, input)]

    # The element-at-a-time original stays reachable for tests/test_interpreter_scan.py, which
    # checks the two bit for bit.
    scan_ops.generic_scan_by_element = scan_ops.generic_scan
    scan_ops.generic_scan = generic_scan


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpret_helpers_without_repatching()
    _interpret_scans_a_step_at_a_time()

# Under pytest-xdist (`-n 2`, what CI runs on its 2 cores) each worker process gets its share of
# the cores for torch's intra-op threads, instead of every worker starting one thread per core
# and the processes oversubscribing the machine.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test starts with empty dynamo caches and ssm counters, so the rewrites it counts and
    the recompiles it sees are its own."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_opt_einsum(monkeypatch):
    """Where opt_einsum is installed (the H200 machine has it, CI does not), torch.einsum plans a
    contraction of three or more operands with it, and its path search does Python arithmetic on
    the sizes: dynamo specialises the batch and length symbols there, for any backend (plain
    inductor and "eager" too), and a dynamic batch recompiles. The tests of what the passes do
    with symbolic sizes use torch's own contraction order, so that they test the passes."""
    monkeypatch.setattr(torch.backends.opt_einsum, "enabled", False)


@pytest.fixture
def quiet_ssm_log():
    """Only errors from the ``ssm_compile`` logger: a refused rewrite or a fallback logs its
    reason (with the whole failing node); tests that use this read the reasons from ``explain``
    or the records instead."""
    logger = logging.getLogger("ssm_compile")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.fixture
def hf_checkpointing_traceable():
    """transformers 5.25's checkpointed layers under dynamo, with any backend (plain inductor and
    "eager" too): the ``kernels`` package's kernelized forward, which 5.25 wraps around the mixer,
    sets a ``CompileableContextVar`` inside the checkpoint, so
    dynamo graph-breaks at every checkpointed layer ("HOP: Unsafe side effect") and runs the
    layers eagerly, so no backend sees them. Torch's hint for that break is the flag set here,
    which a user of 5.25 who compiles a checkpointed model must set too (README). Earlier
    transformers need nothing, and get nothing, so the tests see what their users see."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).release < (5, 25):
        yield
        return
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        yield
