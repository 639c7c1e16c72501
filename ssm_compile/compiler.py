"""The ``ssm`` torch.compile backend.

``torch.compile(model, backend="ssm")`` finds this module through the ``torch_dynamo_backends``
entry point, so user code needs no import of ours. The backend runs the pattern passes on
dynamo's FX graph (before AOTAutograd, so every ``ssm`` op is one node that brings its own
autograd formula) and hands the rewritten graph to inductor, which still fuses everything else.

``ssm_compile.backend(**options)`` returns a configured backend:

    model = torch.compile(model, backend=ssm_compile.backend(inductor=False))
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import gc
import logging
import pathlib
import traceback
from typing import Any, Callable, Mapping
from unittest import mock

import torch

from .config import SSMOptions

log = logging.getLogger("ssm_compile")


@dataclasses.dataclass
class GraphRecord:
    """What the passes did to one dynamo graph (collected by ``ssm_compile.explain``)."""

    before: str
    after: str
    rewrites: list
    misses: list
    options: dict


def _code(gm: torch.fx.GraphModule) -> str:
    """The graph's Python code, followed by that of its subgraphs (checkpointed layers are one),
    whose rewrites a reader would otherwise not see."""
    parts = [gm.code]
    for name, sub in gm.named_children():
        if isinstance(sub, torch.fx.GraphModule):
            parts.append(f"\n# subgraph {name}\n{sub.code}")
    return "".join(parts)


def _graph_modules(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """``gm`` and its subgraphs (checkpoint bodies), which the pass manager rewrites too."""
    return [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]


def _failed_pass(error: BaseException) -> str:
    """The pass module (e.g. ``scan_assoc``) in whose code ``error`` was raised, for the report."""
    from ssm_compile import passes

    package = pathlib.Path(passes.__file__).parent
    names = [pathlib.Path(frame.filename).stem for frame in traceback.extract_tb(error.__traceback__)
             if pathlib.Path(frame.filename).parent == package and pathlib.Path(frame.filename).stem != "manager"]
    return names[0] if names else "passes"


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` that the passes' in-place rewrites of ``graph`` leave as it was.

    Graph deepcopy copies the nodes and their meta dicts (sharing the fake values in them), but not
    what dynamo keeps on the nodes themselves (a placeholder's ``_dynamo_source``, which
    AOTAutograd reads), so those attributes are carried over; the copy keeps node order and names.
    """
    # The copy allocates a few objects per node; on a long unrolled loop (tens of thousands of
    # nodes, with dynamo's whole trace still alive) that triggers full cyclic-GC passes, which
    # made the copy 5x slower than with collection paused (0.2 against 1.2 s at L=2048).
    collecting = gc.isenabled()
    gc.disable()
    try:
        copied = copy.deepcopy(graph)
    finally:
        if collecting:
            gc.enable()
    for old, new in zip(graph.nodes, copied.nodes, strict=True):
        present = vars(new)
        for attr, value in vars(old).items():
            # Only what the copy lacks: where Node keeps its links (graph, _prev, args, users) in
            # its __dict__ rather than in C slots, copying those would tie the copy to the original.
            if attr not in present:
                setattr(new, attr, value)
    return copied


class _Undo:
    """Puts every graph of a module back as dynamo built it, and takes back the rewrite counts."""

    def __init__(self, gm: torch.fx.GraphModule):
        from torch._dynamo.utils import counters

        self.saved = [(m, _copy_graph(m.graph)) for m in _graph_modules(gm)]
        self.counts = collections.Counter(counters["ssm"])

    def __call__(self) -> None:
        for module, graph in self.saved:
            module.graph = graph  # the setter re-owns the graph and recompiles the module
        self.take_back_counts()

    def take_back_counts(self) -> None:
        from torch._dynamo.utils import counters

        counters["ssm"].clear()
        counters["ssm"].update(self.counts)


def _run_passes(pm, gm: torch.fx.GraphModule, undo: _Undo):
    """Run the passes on ``gm`` in place; if one raises, put every graph back as dynamo built it.

    The backend must never break a program that runs eagerly: a pass that fails on a graph it did
    not expect (a shape its check function forgot, say) leaves that graph unrewritten, with the
    reason recorded as a near-miss for ``explain`` and logged, instead of failing the compile. The
    rewrites it already counted are taken back, since none of them survives.
    """
    from ssm_compile.passes.manager import PassContext

    try:
        return pm(gm)
    except Exception as e:  # noqa: BLE001  (any failure of ours must fall back, not crash the user)
        undo()
        family = _failed_pass(e)
        reason = (f"pass {family} raised {type(e).__name__}: {e}; this graph is compiled without "
                  "ssm rewrites")
        log.warning("ssm backend: %s", reason)
        log.debug("ssm backend: pass failure traceback", exc_info=True)
        ctx = PassContext(options=pm.options)
        ctx.miss(family, reason)
        return ctx


@contextlib.contextmanager
def _backward_compiled_now():
    """AOTAutograd compiles a graph's backward at its first ``.backward()`` unless told
    otherwise, outside the compile fallback's reach; with rewrites, compile it with the forward,
    so that a failure there also falls back (the flag is missing on older torch: a no-op).

    No saved tensor is donated to that backward. A backward compiled ahead may reuse its saved
    tensors' memory only if no ``backward()`` keeps the graph, and AOTAutograd raises at a
    ``backward(retain_graph=True)`` otherwise; a lazily compiled one learns at its first call
    whether the graph is kept and donates only then, which is why plain inductor (static shapes)
    accepts ``retain_graph`` and, without this, the rewritten graph did not. Turning
    ``donated_buffer`` off for the compile would not do: the check runs at backward time
    against the global flag and counts "not collected" as donated, so the collection itself
    returns none (where this torch has it)."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        yield
        return
    from torch._functorch._aot_autograd import graph_compile

    with contextlib.ExitStack() as stack:
        stack.enter_context(functorch_config.patch(force_non_lazy_backward_lowering=True))
        if hasattr(graph_compile, "collect_bw_donated_buffer_idxs"):
            stack.enter_context(mock.patch.object(graph_compile, "collect_bw_donated_buffer_idxs",
                                                  lambda *args, **kwargs: []))
        yield


def _launches_kept_in_ops(options: SSMOptions):
    """With ``inline_launches=False``, AOTAutograd keeps the ssm ops whole instead of tracing
    their Triton launches (``kernels/inline.py`` reads the flag). It is functorch's own config,
    so AOTAutograd's cache tells the two apart."""
    import torch._functorch.config as functorch_config

    if options.inline_launches or not hasattr(functorch_config, "decompose_custom_triton_ops"):
        return contextlib.nullcontext()
    return functorch_config.patch(decompose_custom_triton_ops=False)


def _grad_modes() -> tuple[bool, bool]:
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def _release_failed_trace(error: BaseException, modes: tuple[bool, bool]) -> None:
    """Give back the grad modes a failed compile left on. Tracing a graph that enters
    ``torch.inference_mode()`` holds the mode's guard in the traced frames; a compile that raises
    inside it leaves those frames, and so the mode, alive in the exception's traceback, and the
    caller's later eager code ran in inference mode (probe BX: "Inference tensors cannot be
    saved for backward" in the next training step). Clearing the frames drops the guard."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    if _grad_modes() != modes:
        gc.collect()
    if _grad_modes() != modes:
        log.warning("ssm backend: a failed compile left grad mode %s and inference mode %s on, where they were "
                    "%s and %s", *_grad_modes(), *modes)
        torch.set_grad_enabled(modes[0])


def _holds_inlined_ops(gm: torch.fx.GraphModule) -> bool:
    """The graph calls an op whose launches AOTAutograd may hand to inductor (kernels/inline.py)."""
    from ssm_compile.kernels.inline import INLINED

    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and n.target.name() in INLINED for n in gm.graph.nodes)


def _forward_ad_active() -> bool:
    """A ``torch.autograd.forward_ad.dual_level`` is open where dynamo compiles the frame, so its
    inputs may carry tangents (dynamo records no node for them)."""
    import torch.autograd.forward_ad as forward_ad

    return forward_ad._current_level >= 0


def _unvectorised_cpu_recurrence(options: SSMOptions, ctx, example_inputs) -> SSMOptions:
    """``options`` with inductor's CPU vectorisation off (``cpp.simdlen=1``) for a CPU graph that
    still holds a recurrence the scan pass saw and left alone, else ``options`` itself.

    Inductor's vectorised C++ code miscompiles such unrolled loops: on torch 2.13 (AVX-512) a
    Mamba-1 loop with N >= 8 left to inductor comes back 28 to 78 off eager, without any ssm
    rewrite (``benchmarks/inductor_cpu_recurrence.py`` reproduces it with ``backend="inductor"``);
    scalar code computes it right. Such a graph is slow anyway (the loop stays unrolled), and a
    user's own ``cpp.simdlen`` is left as it is. Recurrences the passes do not recognise at all
    get no such guard: they are inductor's, as under ``backend="inductor"``.
    """
    if "cpp.simdlen" in options.inductor_config or not any(m.family == "scan_loop" for m in ctx.misses):
        return options
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if not tensors or any(x.device.type != "cpu" for x in tensors):
        return options
    if options.inductor:  # (with inductor=False, as under explain, only the record shows it)
        log.warning("ssm backend: this CPU graph keeps a recurrence the scan pass left alone; it is compiled "
                    "with inductor's cpp.simdlen=1, as inductor's vectorised CPU code miscompiles such loops")
    return dataclasses.replace(options, inductor_config={**options.inductor_config, "cpp.simdlen": 1})


def _auto_cpp_wrapper(options: SSMOptions, example_inputs) -> bool:
    """Auto's choice for one rewritten graph: the C++ wrapper where the graph runs on CUDA, is
    compiled for inference, and no CUDA graphs are asked for (CUDA graphs already take the
    launches off the host, and the C++ wrapper would turn them off under inductor's graph
    partition). A graph AOTAutograd will differentiate (grad mode on and an input that requires
    grad, its own test) keeps the Python wrapper: there the C++ one took the host-bound training
    step (130m, batch 8, L=128) from 77.9 to 66.9 ms but its first step from 45 to 187 s, and
    at training lengths the step is GPU-bound, so the wait would buy little (benchmarks/RESULTS.md,
    run 28); ``cpp_wrapper=True`` asks for it."""
    import torch._inductor.config as inductor_config

    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if not any(x.device.type == "cuda" for x in tensors):
        return False
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        return False
    patches = options.config_patches()
    return not patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs)


class SSMBackend:
    """A configured ``ssm`` backend: ``backend(gm, example_inputs) -> compiled callable``.

    Args:
        options: validated ``SSMOptions``.
        on_graph: called with a ``GraphRecord`` for every graph compiled (``explain`` uses it);
            recording costs a graph print, so it is off unless asked for.
    """

    def __init__(self, options: SSMOptions | None = None,
                 on_graph: Callable[[GraphRecord], None] | None = None):
        self.options = options or SSMOptions()
        self.on_graph = on_graph

    def pass_manager(self):
        from ssm_compile.passes import build_pass_manager

        return build_pass_manager(self.options)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                 options: Mapping[str, Any] | None = None) -> Callable[..., Any]:
        if (mode is not None and mode != "default") or options:
            # ``torch.compile(m, backend=ssm_compile.backend(...), mode=..., options=...)`` hands
            # its mode and options to the backend at each compile: they apply on top of ours.
            configured = SSMBackend(self.options.with_compile_args(mode, options), self.on_graph)
            return configured(gm, example_inputs)
        from ssm_compile.kernels import register_ops

        # The rewritten graph calls torch.ops.ssm.*, which must exist before it is traced.
        register_ops()
        pm = self.pass_manager()
        before = _code(gm) if self.on_graph is not None else ""
        if _forward_ad_active():
            return self._forward_ad_graph(pm, gm, before)
        undo = _Undo(gm)
        ctx = _run_passes(pm, gm, undo)
        log.info("ssm backend: %d rewrite(s), %d near-miss(es) in a graph of %d nodes",
                 len(ctx.rewrites), len(ctx.misses), len(gm.graph.nodes))
        options = _unvectorised_cpu_recurrence(self.options, ctx, example_inputs)
        if self.on_graph is not None:
            record_options = dict(pm.options)
            if options is not self.options:
                record_options["inductor_config"] = dict(options.inductor_config)
            self.on_graph(GraphRecord(before=before, after=_code(gm), rewrites=list(ctx.rewrites),
                                      misses=list(ctx.misses), options=record_options))
        if not options.inductor:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        if not ctx.rewrites:
            return compile_fx(gm, example_inputs, config_patches=self.config_patches(pm, options))
        try:
            compiled, error = self._compile_rewritten(compile_fx, pm, gm, example_inputs, options)
        except torch._dynamo.exc.RestartAnalysis:
            # Dynamo traces the frame again and hands this backend the new graph, whose rewrites
            # are counted then (under dynamic=True, AOTAutograd restarts after tensorifying a
            # float input): counted here too, every rewrite would count twice.
            undo.take_back_counts()
            raise
        if error is None:
            return compiled
        # The rewritten graph failed to trace or compile (something the layout check could not
        # see, say). Dynamo's own graph is what eager runs, so compiling that instead keeps the
        # program working; if it fails too, that error is the program's, and it propagates.
        undo()
        log.warning("ssm backend: compiling the rewritten graph raised %s: %s; this graph is "
                    "compiled without ssm rewrites", type(error).__name__, error)
        log.debug("ssm backend: compile failure traceback", exc_info=error)
        return compile_fx(gm, example_inputs, config_patches=self.config_patches(pm, options))

    def _compile_rewritten(self, compile_fx, pm, gm: torch.fx.GraphModule, example_inputs,
                           options: SSMOptions) -> tuple[Callable[..., Any] | None, Exception | None]:
        """(the compiled rewritten graph, None), or (None, the exception its compile raised).

        Before it counts as failed, the compile is retried without what this backend chose on
        its own: the C++ wrapper where auto turned it on (it needs a host C++ toolchain, and
        compiles the launches differently), then, for a graph holding ops whose launches
        AOTAutograd hands to inductor (kernels/inline.py), with the ops whole: inductor compiles
        an inlined launch from the kernel's source, which kernels/inline.py says can trip, and
        the ops whole keep the rewrites.
        """
        if options.cpp_wrapper is None and _auto_cpp_wrapper(options, example_inputs):
            # Where auto says no, nothing is patched: inductor's own setting (the user's) stands.
            options = dataclasses.replace(options, cpp_wrapper=True)
        modes = _grad_modes()
        while True:
            try:
                with _backward_compiled_now(), _launches_kept_in_ops(options):
                    return compile_fx(gm, example_inputs, config_patches=self.config_patches(pm, options)), None
            except torch._dynamo.exc.RestartAnalysis:
                raise  # dynamo's own control flow, not a failure
            except Exception as e:  # noqa: BLE001  (see _run_passes: never fail what runs eagerly)
                _release_failed_trace(e, modes)
                if options.cpp_wrapper and self.options.cpp_wrapper is None:
                    log.warning("ssm backend: compiling with the C++ wrapper raised %s: %s; retrying "
                                "without it (cpp_wrapper=False)", type(e).__name__, e)
                    options = dataclasses.replace(options, cpp_wrapper=False)
                elif options.inline_launches and _holds_inlined_ops(gm):
                    log.warning("ssm backend: compiling with the ops' launches inlined raised %s: %s; retrying "
                                "with the ops whole (inline_launches=False)", type(e).__name__, e)
                    options = dataclasses.replace(options, inline_launches=False)
                else:
                    return None, e

    def _forward_ad_graph(self, pm, gm: torch.fx.GraphModule, before: str) -> Callable[..., Any]:
        """Dynamo's graph as it is, run eagerly: under a forward-AD dual level the ssm ops (no
        forward-mode formula) would raise, and inductor's compiled graph drops the tangents."""
        from ssm_compile.passes.manager import PassContext

        reason = ("forward-mode AD is active (a torch.autograd.forward_ad dual level): the ssm ops have "
                  "no forward-mode formula, so this graph is not rewritten and runs as dynamo built it")
        log.info("ssm backend: %s", reason)
        ctx = PassContext(options=pm.options)
        ctx.miss("backend", reason)
        if self.on_graph is not None:
            self.on_graph(GraphRecord(before=before, after=_code(gm), rewrites=[], misses=list(ctx.misses),
                                      options=dict(pm.options)))
        return gm.forward

    def config_patches(self, pm, options: SSMOptions) -> dict[str, Any]:
        """Inductor config patches for one compile with ``options`` (the backend's, or those with
        auto's choices made for one graph), with the pass manager's cache-key pass."""
        import torch._inductor.config as inductor_config

        patches = options.config_patches()
        inner = patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
        patches["post_grad_custom_post_pass"] = pm.cache_key_pass(inner)
        return patches

    def __repr__(self) -> str:
        return f"SSMBackend({self.options})"


def backend(**options: Any) -> SSMBackend:
    """A configured ``ssm`` backend, to pass as ``torch.compile(model, backend=...)``.

    Args:
        **options: ``SSMOptions`` fields (``fuse``, ``passes``, ``disable``, ``inductor``,
            ``mode``, ``inductor_config``); any other key is an inductor config patch.
    Returns:
        an ``SSMBackend``; its options were validated here, so typos fail now.
    Example:
        >>> model = torch.compile(model, backend=ssm_compile.backend(disable={"xproj"}))
    """
    return SSMBackend(SSMOptions.from_kwargs(**options))


def ssm_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                options: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """The ``backend="ssm"`` entry point; ``torch.compile``'s ``mode``/``options`` land here."""
    return SSMBackend()(gm, example_inputs, mode=mode, options=options)


# Must run before dynamo traces the first frame for backend="ssm"; this import (through the
# entry point, or ssm_compile.backend) is the only code of ours that runs that early. See
# dynamo_compat for why, and for how the change stays limited to our own traces.
from . import dynamo_compat  # noqa: E402  (kept beside the install() call it is imported for)

dynamo_compat.install()

