"""The pass manager: runs the pattern passes in order and records what each one did.

Every rewrite bumps ``torch._dynamo.utils.counters["ssm"][family]``; every miss keeps its
reason so that ``ssm_compile.explain`` can say why a near-miss was left alone.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import operator
import pathlib
from typing import Any, Callable

import torch
from torch._dynamo.utils import counters

from .discretize import unscanned_discretizations
from .einops_calls import expand_einops_calls
from .fx_utils import INPLACE_OPERATORS, hop_name, mutates, val
from .casts import (drop_identity_conversions, fold_round_trip_casts, fold_widening_casts_into_ops,
                    narrow_widened_op_reads)
from .inplace import caller_state_recurrences, rewrite_local_writes
from .keywords import positional_operands
from .layout import output_layouts, random_input_layouts, settle_layouts
from .pieces import (join_stacked_cats, name_squeezed_axes, read_reshape_round_trips, read_single_cats, read_unit_pieces,
                     read_whole_pieces, whole_setitems_as_copies)

log = logging.getLogger("ssm_compile")

PassFn = Callable[[torch.fx.GraphModule, "PassContext"], None]


@dataclasses.dataclass
class Rewrite:
    family: str
    pattern: str
    replaced: list[str]
    emitted: str
    decision: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Miss:
    family: str
    reason: str
    nodes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PassContext:
    """What the passes share for one graph: the options, and the record of rewrites and misses."""

    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    rewrites: list[Rewrite] = dataclasses.field(default_factory=list)
    misses: list[Miss] = dataclasses.field(default_factory=list)
    # Nodes a near-miss speaks for without naming them (a refused scan's exp(Δ·A)).
    covered: set[torch.fx.Node] = dataclasses.field(default_factory=set)

    def rewrite(self, family: str, pattern: str, replaced: list[torch.fx.Node], emitted: str,
                decision: dict[str, Any] | None = None) -> None:
        names = [n.name for n in replaced]
        self.rewrites.append(Rewrite(family, pattern, names, emitted, decision or {}))
        counters["ssm"][family] += 1
        log.debug("ssm rewrite %s (%s): %d nodes -> %s", family, pattern, len(names), emitted)

    def miss(self, family: str, reason: str, nodes: list[torch.fx.Node] = (),
             covers: list[torch.fx.Node] = ()) -> None:
        self.covered.update(covers)
        same = next((m for m in self.misses if (m.family, m.reason) == (family, reason)), None)
        if same is not None:
            # A pass that meets the same near-miss once per step (a stale dA[:, :, 0] read by
            # each step) says so once, at every node it met it.
            same.nodes.extend(n.name for n in nodes if n.name not in same.nodes)
            return
        self.misses.append(Miss(family, reason, [n.name for n in nodes]))
        log.debug("ssm near-miss %s: %s", family, reason)

    def withdraw(self, family: str, names: set[str], reason: str | None = None) -> None:
        """Take ``family``'s misses (those with ``reason``, if given) off the nodes ``names``, which a
        later pass has accounted for; a miss left with no node goes. Only at those nodes: a reason
        met at several places is one miss at the nodes of all (``miss``)."""
        met = [m for m in self.misses if m.family == family and (reason is None or m.reason == reason)
               and set(m.nodes) & names]
        for m in met:
            m.nodes = [n for n in m.nodes if n not in names]
        emptied = {id(m) for m in met if not m.nodes}
        self.misses = [m for m in self.misses if id(m) not in emptied]


_INPLACE_OPERATORS = (operator.setitem, *INPLACE_OPERATORS)
# Namespaces whose public functions compute values and touch no global state.
_PURE_MODULES = ("torch", "torch.functional", "torch.nn.functional", "torch._C._nn", "torch._C._linalg",
                 "torch._C._special", "torch._C._fft", "torch.linalg", "torch.special", "torch.fft")
# Dynamo records nn.Module usage logging in the graph; dropping it once unused changes nothing.
_REMOVABLE_CALLS = (torch._C._log_api_usage_once,)
# Random sampling advances the generator even when its result is unused: dropping it would shift
# every later random number relative to eager.
_RANDOM_PREFIXES = ("rand", "normal", "bernoulli", "multinomial", "poisson", "dropout", "alpha_dropout",
                    "feature_alpha_dropout", "native_dropout", "rrelu")
# Tensor methods without a trailing underscore that still act on the world.
_IMPURE_METHODS = ("backward", "register_hook", "retain_grad", "record_stream", "share_memory_", "tolist", "item")


def _removable_if_unused(node: torch.fx.Node) -> bool:
    """Whether dead-code elimination may drop ``node`` once nothing uses it.

    Dynamo's torch-level graph is full of calls FX's ``Node.is_impure`` calls pure but are not:
    in-place methods (``x_dbl.mul_(2)``, whose write later readers of ``x_dbl`` see) and the
    functorch bookkeeping of an inlined ``associative_scan``/``vmap`` (``_vmap_increment_nesting``,
    ``_add_batch_dim``), whose removal breaks the graph at run time. So only what is known to be
    a pure computation is removable: out-of-place tensor methods, operator arithmetic, ops with a
    non-mutating schema, and public functions of the torch namespaces.
    """
    if node.op in ("placeholder", "output", "get_attr"):
        return node.op == "get_attr"
    # ``mutates`` also knows the in-place flags FX does not (``F.relu(x, inplace=True)``,
    # ``F.silu(x, True)``): dropping such a call would leave later readers of x unwritten.
    if node.is_impure() or "out" in node.kwargs or mutates(node):
        return False
    target = node.target
    if str(getattr(target, "__name__", target)).startswith(_RANDOM_PREFIXES):
        return False
    if node.op == "call_method":
        return not target.endswith("_") and not target.startswith("_") and target not in _IMPURE_METHODS
    if node.op != "call_function":
        return False
    if target in _REMOVABLE_CALLS:
        return True
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return not schema.is_mutable
    if isinstance(target, torch._ops.OpOverloadPacket):
        # ``torch.ops.aten.silu(z)``: ``mutates`` found no overload writing an operand, and FX's
        # purity test (random ops, effects) has passed above.
        return True
    if getattr(target, "__module__", None) in ("_operator", "operator"):
        return target not in _INPLACE_OPERATORS
    name = getattr(target, "__name__", "_")
    return (getattr(target, "__module__", None) in _PURE_MODULES and not name.startswith("_")
            and not name.endswith("_"))


# Activation checkpointing (torch.utils.checkpoint, HF's gradient_checkpointing_enable) makes
# dynamo put each checkpointed layer in a subgraph called through one of these higher-order ops.
# The subgraph is a plain function of its inputs that AOTAutograd re-runs in backward, so a
# rewrite inside it is as sound as one at the top level, and without it a checkpointed Mamba
# layer would keep its (batch, dim, L, N) tensors.
_CHECKPOINT_HOPS = ("tag_activation_checkpoint", "wrap_activation_checkpoint")


def _eliminate_dead_code(gm: torch.fx.GraphModule) -> None:
    """``_remove_dead_nodes``, then recompile."""
    _remove_dead_nodes(gm.graph)
    gm.recompile()


def _drop_rewritten_step_chains(gm: torch.fx.GraphModule, ctx: PassContext, misses_before: int) -> None:
    """Take scan_loop's ``NO_STEP_CHAIN`` misses of this graph off the nodes a later pass rewrote
    away (a miss left with none goes). Per-head decode steps on slices of one stacked state (HF Zamba's
    ``for head in range(n_heads)`` over ``cache[:, head]``, each head with its own decay) read to
    scan_loop as a chain whose step 1 recomputes its exp; the decode pass then rewrites each step
    into ``ssm.selective_state_update``, and no recurrence is left for the reason to speak of. Kept,
    it was a near-miss of a graph whose every step was rewritten, and it turned off inductor's CPU
    vectorisation for the whole decode graph (``compiler._unvectorised_cpu_recurrence``)."""
    # (Here, not at import: scan_loop imports this module.)
    from .scan_loop import FAMILY, NO_STEP_CHAIN

    left = {n.name for n in gm.graph.nodes}
    kept = []
    for m in ctx.misses[misses_before:]:
        if m.family == FAMILY and m.reason == NO_STEP_CHAIN and m.nodes:
            # (One miss holds every place the reason was met: only the rewritten ones go.)
            m.nodes = [name for name in m.nodes if name in left]
            if not m.nodes:
                continue
        kept.append(m)
    ctx.misses[misses_before:] = kept


def _remove_dead_nodes(graph: torch.fx.Graph) -> None:
    """Dead-code elimination of ``graph`` alone with ``_removable_if_unused``. Not FX's
    ``eliminate_dead_code``: whatever purity test it is given, it then recurses into the
    subgraphs of higher-order ops (a checkpoint, ``cond``, a custom ``autograd.Function``) with
    its own, which takes ``v[:, 1:].add_(u)`` with an unused result for dead code (probe AR,
    run 50: such a write inside a body was dropped whenever the graph around it was rewritten,
    4.5 off eager). A checkpoint body the passes enter gets its own call."""
    for node in reversed(list(graph.nodes)):
        if not node.users and _removable_if_unused(node):
            graph.erase_node(node)


def _checkpoint_bodies(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    bodies = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "_name", None) not in _CHECKPOINT_HOPS:
            continue
        body = node.args[0] if node.args else None
        if isinstance(body, torch.fx.Node) and body.op == "get_attr":
            sub = getattr(gm, body.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                bodies.append(sub)
    return bodies


def _report_other_bodies(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """A reason for each ``exp(Δ·A)`` in the body of a higher-order op other than a checkpoint
    (a custom ``autograd.Function``'s forward, which dynamo keeps as one under grad): the passes
    do not enter those, and without a word ``explain`` would show nothing for that code."""
    for node in gm.graph.nodes:
        if (not isinstance(node.target, torch._ops.HigherOrderOperator)
                or node.target.name() in _CHECKPOINT_HOPS):
            continue
        for arg in node.all_input_nodes:
            body = getattr(gm, arg.target, None) if arg.op == "get_attr" else None
            if not isinstance(body, torch.fx.GraphModule):
                continue
            found = [n.name for sub in body.modules() if isinstance(sub, torch.fx.GraphModule)
                     for n in unscanned_discretizations(sub)]
            if found:
                ctx.miss("scan", f"exp(Δ·A) ({', '.join(found)}) is computed inside the body of {node.name} "
                         f"({hop_name(node)}: a custom autograd.Function's forward under grad, "
                         "say), which the passes do not enter; that code runs as written", [node])


def _with_bodies(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """``gm`` and, recursively, the checkpointed subgraphs it calls, outermost first."""
    modules, seen = [gm], {id(gm)}
    for module in modules:
        for body in _checkpoint_bodies(module):
            if id(body) not in seen:
                seen.add(id(body))
                modules.append(body)
    return modules


def _attribute_reads_first(gm: torch.fx.GraphModule) -> None:
    """Move every ``get_attr`` to the top of the graph, after the inputs.

    Under inductor's global ``freezing`` flag dynamo reads parameters as attributes of the graph
    module where they are first used, instead of taking them as inputs. The matchers read node
    order as the order values are computed (a skip's D "computed after" the scan, dt_proj's weight
    after x_proj) and would refuse. An attribute read computes nothing and its value does not
    change during a run, so where it stands changes nothing."""
    nodes = list(gm.graph.nodes)
    first_call = next((i for i, n in enumerate(nodes) if n.op not in ("placeholder", "get_attr")), len(nodes))
    late = [n for n in nodes[first_call:] if n.op == "get_attr"]
    if not late:
        return
    anchor = nodes[first_call]
    for node in late:
        anchor.prepend(node)
    gm.recompile()


# aten ops that together mark Mamba-like code the passes cannot read in an aten graph: the
# discretisation's exp and Δ's softplus (an exp alone is any softmax).
_ATEN_SIGNS = ("exp", "softplus")


def _backward_hooked(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The tensors a hook is registered on through compiled autograd's backward state: the
    trampoline's first argument, or a node dynamo marked as hooked."""
    hooked = []
    for node in gm.graph.nodes:
        if node.meta.get("has_backward_hook"):
            hooked.append(node)
        elif (node.op == "call_function" and getattr(node.target, "__name__", "") == "_register_hook_trampoline"
              and node.args and isinstance(node.args[0], torch.fx.Node)):
            hooked.append(node.args[0])
    return list(dict.fromkeys(hooked))


def _report_aten_graph(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """A reason for a graph of aten ops (``torch.export``'s ``ep.module()``, a graph traced by
    ``make_fx``): dynamo records such a program's calls as ``torch.ops.aten.*`` overloads, which no
    matcher reads, so a Mamba block in it is left alone without any other miss to say so."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    aten = [n for n in calls if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten"]
    if not calls or 2 * len(aten) < len(calls):
        return
    signs = sorted({n.target.name() for n in aten if n.target._opname in _ATEN_SIGNS})
    if len(signs) == len(_ATEN_SIGNS):
        ctx.miss("graph", f"{len(aten)} of the graph's {len(calls)} calls are aten ops ({', '.join(signs)} among "
                 "them), as in a torch.export'ed or make_fx-traced program: the passes read the torch-level "
                 "calls dynamo records from Python code, so nothing here is rewritten; compile the original "
                 "module instead", aten[:1])


@functools.lru_cache(maxsize=1)
def _sources_digest() -> bytes:
    """Hash of every Python source of the installed package, read once per process (the code that
    runs is the code that was imported). A cached artifact has all of it baked in:
    - the passes, every module and not only those that register one: the shared matchers
      (fx_utils, discretize, readout) decide what gets rewritten too;
    - the backend's compile driver and settings (``ssm_compile/``): how AOTAutograd compiles the
      rewritten graph (the backward ahead, no donated buffers);
    - the kernels package: each op's fake implementation, its ``register_autograd`` backward and,
      on CUDA, the Triton launches inductor inlines are traced into the artifact. Without them a
      new version that changed only a backward kept serving the old one's gradients from a warm
      cache (probe AW, run 51).
    """
    h = hashlib.sha256()
    for name, path in source_files():
        h.update(name.encode())
        h.update(path.read_bytes())
    return h.digest()


def source_files() -> list[tuple[str, pathlib.Path]]:
    """(name relative to its package root, path) of the package's Python sources: ``ssm_compile``,
    ``ssm_compile.passes`` and ``ssm_compile.kernels``, wherever the install put them."""
    import ssm_compile
    import ssm_compile.kernels

    roots = (pathlib.Path(ssm_compile.__file__).parent, pathlib.Path(__file__).parent,
             pathlib.Path(ssm_compile.kernels.__file__).parent)
    return [(f"{root.name}/{path.relative_to(root).as_posix()}", path)
            for root in roots for path in sorted(root.rglob("*.py"))]


class PassManager:
    """An ordered list of named passes. Pass modules add themselves through ``register(pm)``."""

    def __init__(self, options: dict[str, Any] | None = None):
        self.options = dict(options or {})
        self.passes: list[tuple[str, PassFn]] = []

    def add(self, name: str, fn: PassFn) -> None:
        self.passes.append((name, fn))

    def __call__(self, gm: torch.fx.GraphModule) -> PassContext:
        ctx = PassContext(options=self.options)
        # The graph and its checkpointed subgraphs, each with its outputs' layouts as traced.
        modules = _with_bodies(gm)
        traced = [output_layouts(m) for m in modules]
        random_inputs = [random_input_layouts(m) for m in modules]
        self._run(gm, ctx, set())
        if ctx.rewrites:
            # Innermost first: a subgraph's outputs are what its caller's graph reads.
            for module, layouts, draws in reversed(list(zip(modules, traced, random_inputs))):
                # (narrow_widened_op_reads leaves round trips for fold_round_trip_casts: in this order.)
                folds = (read_single_cats(module, same_strides=False) + narrow_widened_op_reads(module)
                         + fold_round_trip_casts(module) + fold_widening_casts_into_ops(module))
                if folds:
                    _eliminate_dead_code(module)
                for change in folds + settle_layouts(module, layouts, draws):
                    log.info("ssm after the rewrites: %s", change)
        return ctx

    def _run(self, gm: torch.fx.GraphModule, ctx: PassContext, seen: set[int], body: bool = False) -> None:
        seen.add(id(gm))
        hooked = _backward_hooked(gm)
        if hooked:
            # Under compiled autograd dynamo registers a tensor hook as a call that nothing reads
            # (``_register_hook_trampoline(t, backward_state)``): a rewrite that replaced t, or a
            # pre-pass that pointed its users elsewhere, would leave the hook on a tensor the
            # backward never reaches, silently dropping what it does to the gradient (probe BA).
            names = ", ".join(n.name for n in hooked[:4]) + (", ..." if len(hooked) > 4 else "")
            ctx.miss("graph", f"compiled autograd registers backward hooks on {names} in this graph, and a "
                     "rewrite or a pre-pass could move a hooked value off the backward's path, so that its "
                     "hook never runs: the graph is left as traced", hooked[:1])
            return
        before, misses_before = len(ctx.rewrites), len(ctx.misses)
        if body:
            # Dynamo dead-code-eliminates its root graph but not a checkpoint body: under dynamic
            # shapes the body keeps the unused ``x.size()`` / ``size[i]`` / ``s0 == 0`` nodes of
            # the traced code, which the matchers would take for other users of the scan's values.
            _eliminate_dead_code(gm)
        # Before the matchers: they refuse every in-place write, and a state the code allocated
        # and updates in place (``h *= dA; h += dBu``) is as much a recurrence as ``h = dA*h + dBu``.
        # Only here, on dynamo's graph: the rewrites read who shares memory with whom from the
        # nodes' fake values, which a pass's replacements leave stale on the nodes after them.
        _attribute_reads_first(gm)
        # Operands by position first: every pass after it reads them so.
        keyword_changes = positional_operands(gm) + drop_identity_conversions(gm) + whole_setitems_as_copies(gm)
        callers_states = caller_state_recurrences(gm.graph)
        # einops calls next: the others and the matchers see only torch calls.
        einops_changes, einops_kept = expand_einops_calls(gm)
        for node, reason in einops_kept:
            ctx.miss("einops", reason, [node])
        for change in (keyword_changes + einops_changes + rewrite_local_writes(gm) + read_whole_pieces(gm)
                       + read_reshape_round_trips(gm) + name_squeezed_axes(gm) + join_stacked_cats(gm)
                       + read_single_cats(gm) + read_unit_pieces(gm)):
            log.info("ssm before the rewrites: %s", change)
        for name, fn in self.passes:
            rewrites = len(ctx.rewrites)
            fn(gm, ctx)
            gm.graph.lint()
            if len(ctx.rewrites) > rewrites:
                # What a rewrite replaced stays in the graph until nothing uses it: a later pass
                # would take it for a user of the values it read (the next scan's Δ·u product of
                # this scan's y looked like a gate on y).
                _remove_dead_nodes(gm.graph)
        _drop_rewritten_step_chains(gm, ctx, misses_before)
        left = set(gm.graph.nodes) if callers_states else set()
        for write in callers_states:
            if write in left:  # not a decode loop the decode pass rewrote step by step
                state = write.args[0]
                ctx.miss("scan_loop", f"the state is the caller's tensor {state.name}, multiplied and added to in place "
                         "at every step: the caller reads the final state from it, and the scan passes rewrite only a "
                         f"state the graph makes; start from a copy ({state.name}.clone()) or update out of place "
                         "(h = dA*h + dBu, then copy the last state back) to have the loop rewritten", [write])
        if len(ctx.rewrites) > before:
            # Clean up what the rewrites orphaned; a graph no pass rewrote keeps every node dynamo
            # put in it.
            _eliminate_dead_code(gm)  # recompiles
        else:
            gm.recompile()
        self._report_unscanned(gm, ctx, before, misses_before)
        if len(ctx.rewrites) == before:
            _report_aten_graph(gm, ctx)
        for body in _checkpoint_bodies(gm):
            if id(body) not in seen:
                self._run(body, ctx, seen, body=True)
        _report_other_bodies(gm, ctx)

    @staticmethod
    def _report_unscanned(gm: torch.fx.GraphModule, ctx: PassContext, rewrites_before: int,
                          misses_before: int) -> None:
        """A reason for each ``exp(Δ·A)`` the passes left in ``gm`` that no rewrite or miss of
        this graph already speaks for: without one, code whose recurrence no scan pass proves
        (a doubling scan, say) would get an empty ``explain``."""
        spoken = {name for r in ctx.rewrites[rewrites_before:] for name in r.replaced}
        spoken |= {name for m in ctx.misses[misses_before:] for name in m.nodes}
        # A scan pass that recognised the recurrence and refused it (a rounding cast, a reset)
        # names a step of it, a few nodes below the exp: that miss already speaks for the exp.
        scan_misses = {name for m in ctx.misses[misses_before:] if m.family.startswith("scan_") for name in m.nodes}
        for node in unscanned_discretizations(gm):
            near, frontier = set(), [node]
            for _ in range(4):
                frontier = [u for n in frontier for u in n.users if u not in near]
                near.update(frontier)
            if node.name in spoken or node in ctx.covered or any(n.name in scan_misses for n in near):
                continue
            users = ", ".join(u.name for u in node.users) or "none"
            ctx.miss("scan", f"exp(Δ·A) at {node.name} materialises a {tuple(val(node).shape)} tensor and no "
                     f"scan over it was recognised (its users: {users}): the scan passes prove sequential "
                     "loops, associative_scan and in-place parallel sweeps, so this recurrence runs as "
                     "written", [node])

    def uuid(self) -> str:
        """Hash of the package's sources (``_sources_digest``), the pass order and the options,
        for inductor's cache keys."""
        h = hashlib.sha256(_sources_digest())
        for name, _ in self.passes:
            h.update(name.encode())
        h.update(repr(sorted(self.options.items())).encode())
        return h.hexdigest()

    def cache_key_pass(self, inner: Any = None) -> "torch._inductor.custom_graph_pass.CustomGraphPass":
        """A post-grad inductor pass that carries this manager's ``uuid()`` into inductor's caches.

        Our passes run on dynamo's graph, before AOTAutograd, so inductor never sees them: its FX
        graph cache and AOTAutograd cache key only on the graph they receive. Installed as
        ``post_grad_custom_post_pass``, whose ``uuid()`` those caches hash, this makes a change in a
        pass (or in the options) miss the cache instead of reusing an artifact compiled from a
        graph an older pass produced. ``inner`` is what was configured there before (None, a pass,
        or a list of passes); it still runs, and its uuid joins ours.
        """
        from torch._inductor.custom_graph_pass import CustomGraphPass

        uuid = self.uuid()
        inners = [] if inner is None else list(inner) if isinstance(inner, (list, tuple)) else [inner]

        class _SSMCacheKeyPass(CustomGraphPass):
            def __call__(self, graph: torch.fx.Graph) -> None:
                for p in inners:
                    p(graph)

            def uuid(self) -> Any:
                inner_uuids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in inners]
                # An inner pass without a uuid makes the graph uncacheable, as it would be alone.
                if any(u is None for u in inner_uuids):
                    return None
                return (uuid, *inner_uuids) if inner_uuids else uuid

        return _SSMCacheKeyPass()
