"""In-place arithmetic on tensors the graph itself allocated, written out of place.

Hand-written recurrences often update the state in place: ``h *= dA; h += dBu``, or
``h = h.mul_(dA).add_(dBu)`` on a state the code made with ``torch.zeros``. Dynamo records those
as in-place nodes, and the matchers, which must refuse any write they cannot account for, would
leave such a loop unrolled. This rewrite runs before them and replaces each in-place write to a
tensor the graph allocated (and nothing else can see) by the out-of-place op, handing every
later reader the value it saw in the user's code.

Soundness: a storage is rewritten only when
- its tensor (the root) is computed in the graph by a call, not passed in, and no other node
  shares its memory (no views, no inputs, no outputs of ops that return an alias);
- every write to it is one of the arithmetic or unary elementwise ops below on the whole tensor,
  in the order the graph runs them (no ``copy_``, no ``x[i] = v``, no ``out=``, no other mutating
  op);
- the out-of-place op gives the same dtype and shape (``h += x`` keeps h's dtype where
  ``h + x`` would promote);
- the root and all its writes run under one grad mode, outside any functorch transform: under
  ``no_grad`` an in-place write changes a value autograd still holds the old graph for, which an
  out-of-place op would not;
- a write inside an autocast region is an op that autocast leaves alone (``_AUTOCAST_NEUTRAL``):
  in-place ops are never autocast, out-of-place ``exp`` or ``pow`` are.
Each reader then reads the value of the latest write before it, which is what it read in place.
Who shares memory with whom is read from the nodes' fake values, so the pass manager runs this
once, on dynamo's graph, before any rewrite could leave those values stale.
Writes to inputs, to views and through aliases stay as they are, and the matchers' own write
checks still see them.

A ``clone`` that only guarded its source against such writes (``h = h.clone(); h.mul_(dA)``)
guards nothing once they are gone: ``_drop_unobserved_clones`` reads the source instead when no
one can tell the two apart (below).
"""
from __future__ import annotations

import bisect
import logging
import operator
from typing import Any

import torch
import torch.fx

from .fx_utils import (ContextRegions, mutates, propagate_val, protects_saved_input, reads_alike_to_autograd, same_sizes,
                       storage_of, val, written_args as _written)

log = logging.getLogger("ssm_compile")

_FUNCTIONS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
              operator.itruediv: operator.truediv}
# The unary elementwise ones matter for the explanation more than for speed: a loop that does
# ``h.mul_(dA).add_(dBu); h.tanh_()`` reaches the scan matchers out of place, which then name the
# nonlinear update instead of meeting an opaque write.
_METHODS = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div", "addcmul_": "addcmul",
            "addcdiv_": "addcdiv", "neg_": "neg", "tanh_": "tanh", "sigmoid_": "sigmoid", "relu_": "relu",
            "exp_": "exp", "abs_": "abs", "sqrt_": "sqrt", "square_": "square", "pow_": "pow", "clamp_": "clamp",
            "clamp_min_": "clamp_min", "clamp_max_": "clamp_max"}


# The out-of-place ops that no autocast list names, on any device: inside an autocast region they
# compute what the in-place write did. In-place ops are never autocast, but out of place exp, pow
# (and square, which is pow), sqrt, addcmul and addcdiv may be (CUDA's fp32 and promote lists): in
# a region ``h.exp()`` returns fp32 where ``h.exp_()`` kept h's fp16, so those stay in place.
# The fake values that check each replacement's dtype are computed outside any region and cannot
# tell.
_AUTOCAST_NEUTRAL = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, "add", "sub", "mul",
                               "div", "neg", "tanh", "sigmoid", "relu", "abs", "clamp", "clamp_min", "clamp_max",
                               torch.zeros_like, torch.full_like})


def _among(storage: Any, storages: Any) -> bool:
    # StorageWeakRef compares by its C pointer and cannot be compared with None.
    return storage is not None and any(storage == other for other in storages if other is not None)


# Writes that overwrite every element (a reset, ``h.zero_()``), by the function that makes the
# same tensor anew; like them it carries no gradient to the value it replaces.
_FILLS = {"zero_": torch.zeros_like, "fill_": torch.full_like}


def _out_of_place(node: torch.fx.Node) -> tuple[str, Any] | None:
    if node.op == "call_function" and node.target in _FUNCTIONS:
        return "call_function", _FUNCTIONS[node.target]
    if node.op == "call_method" and node.target in _METHODS:
        return "call_method", _METHODS[node.target]
    if node.op == "call_method" and node.target in _FILLS and not _requires_grad(node.args[0]):
        # zeros_like/full_like start no autograd history, where ``h.zero_()`` of a tensor that
        # requires grad keeps one (a zero gradient, but a defined one): only a tensor without
        # history is refilled out of place.
        return "call_function", _FILLS[node.target]
    return None


def _requires_grad(node: Any) -> bool:
    value = val(node)
    return not isinstance(value, torch.Tensor) or value.requires_grad


def _chains(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Each tensor written by the arithmetic in-place ops, with its writes in graph order (each
    write's first argument is the tensor or an earlier write's result)."""
    root_of: dict[torch.fx.Node, torch.fx.Node] = {}
    chains: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if _out_of_place(node) is None or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        root = root_of.get(node.args[0], node.args[0])
        root_of[node] = root
        chains.setdefault(root, []).append(node)
    return chains


def _by_storage(graph: torch.fx.Graph) -> dict[Any, list[torch.fx.Node]]:
    """The tensor nodes of ``graph`` by the fake storage their values live in."""
    index: dict[Any, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        s = storage_of(n)
        if s is not None:
            index.setdefault(s, []).append(n)
    return index


def _chain(root: torch.fx.Node, writes: list[torch.fx.Node], regions: ContextRegions,
           by_storage: dict[Any, list[torch.fx.Node]]) -> str | None:
    """Why the writes to ``root`` cannot be written out of place, or None."""
    if root.op not in ("call_function", "call_method") or mutates(root) or not isinstance(val(root), torch.Tensor):
        return "its tensor is not computed in the graph"
    members = {root, *writes}
    storages = [storage_of(n) for n in members]
    if any(st is None for st in storages):
        return "its memory is unknown"
    for s in set(storages):
        other = next((n for n in by_storage.get(s, ()) if n not in members), None)
        if other is not None:
            return f"{other.name} shares its memory (a view or an alias)"
    for n in members:
        for user in n.users:
            if user not in members and mutates(user):
                return f"{user.name} writes it through another op"
    keys = {regions.key[n][0] for n in members}
    if len(keys) > 1:
        return "a grad-mode or functorch boundary lies between its writes"
    for w in writes:
        if regions.key[w][1] and _out_of_place(w)[1] not in _AUTOCAST_NEUTRAL:
            return f"{w.name} is written under autocast, which its out-of-place op would obey and {w.target} does not"
    if regions.transform.get(next(iter(keys))[0]) is not None:
        return "it is written inside a torch.func transform"
    return None


def _functionalize(graph: torch.fx.Graph) -> list[str]:
    """Rewrite in place the in-place arithmetic on graph-allocated tensors; returns what changed.

    The graph's order, storages and contexts are read once, so that a loop of L steps that each
    update a fresh state in place (L chains) costs O(nodes), not O(L * nodes). A replacement
    takes the place just before the write it replaces (order - 0.5)."""
    regions = ContextRegions(graph)
    by_storage = _by_storage(graph)
    order: dict[torch.fx.Node, float] = {n: i for i, n in enumerate(graph.nodes)}
    changes: list[str] = []
    for root, writes in _chains(graph).items():
        refusal = _chain(root, writes, regions, by_storage)
        if refusal is not None:
            log.debug("ssm in-place writes to %s kept: %s", root.name, refusal)
            continue
        members = {root, *writes}
        # The value each position of the graph sees: the root, then each write's replacement.
        current = root
        replaced: dict[torch.fx.Node, torch.fx.Node] = {}
        ok = True
        for w in writes:
            kind, target = _out_of_place(w)
            with graph.inserting_before(w):
                new = graph.create_node(kind, target,
                                        torch.fx.node.map_arg(w.args, lambda a: current if a in members else a),
                                        torch.fx.node.map_arg(w.kwargs, lambda a: current if a in members else a))
            new.meta = {k: v for k, v in w.meta.items() if k not in ("val", "example_value")}
            order[new] = order[w] - 0.5
            try:
                out = propagate_val(new)
            except Exception as e:  # noqa: BLE001 - fake propagation failing means: leave it as written
                log.debug("ssm in-place write %s kept: %s", w.name, e)
                ok = False
            if ok and not (isinstance(out, torch.Tensor) and out.dtype == val(root).dtype
                           and same_sizes(out.shape, val(root).shape)):
                ok = False
            replaced[w] = new
            if not ok:
                break
            current = new
        if not ok:
            for new in replaced.values():
                graph.erase_node(new)
            continue
        # Every other reader of the storage reads the latest write before it (writes are in
        # graph order, so their places are sorted).
        at = [order[w] for w in writes]
        emitted = set(replaced.values())
        for n in [root, *writes]:
            for user in list(n.users):
                if user in members or user in emitted:
                    continue
                k = bisect.bisect_left(at, order[user])
                user.replace_input_with(n, replaced[writes[k - 1]] if k else root)
        for w in reversed(writes):
            w.replace_all_uses_with(replaced[w])
            graph.erase_node(w)
        changes.append(f"{len(writes)} in-place write(s) to {root.name} written out of place")
    return changes


def _is_clone(node: torch.fx.Node) -> bool:
    if not ((node.op == "call_function" and node.target is torch.clone)
            or (node.op == "call_method" and node.target == "clone")):
        return False
    fmt = node.kwargs.get("memory_format", torch.preserve_format)
    return len(node.args) == 1 and fmt in (torch.preserve_format, torch.contiguous_format)


# Elementwise arithmetic, the algebra of a recurrence's step: a clone read only by these is a
# guard against writes. (Copies on the way into an op are the x_proj pass's to judge and record.)
_ARITHMETIC_FUNCTIONS = (operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
                         torch.add, torch.sub, torch.mul, torch.div, torch.addcmul, torch.neg)
_ARITHMETIC_METHODS = ("add", "sub", "mul", "div", "addcmul", "neg")


def _is_arithmetic(node: torch.fx.Node) -> bool:
    if "out" in node.kwargs:
        return False
    return ((node.op == "call_function" and node.target in _ARITHMETIC_FUNCTIONS)
            or (node.op == "call_method" and node.target in _ARITHMETIC_METHODS))


def _writers(graph: torch.fx.Graph, order: dict) -> list[tuple[int, list]]:
    """(place, storages written) of every in-place write; None for a tensor of unknown memory."""
    return [(order[n], [storage_of(a) for a in _written(n)]) for n in graph.nodes if mutates(n)]


def _exact_clones(graph: torch.fx.Graph):
    """``(clone, source, source's storage, clone's storage)`` for every ``clone`` with its
    source's dtype and strides: the only copies the rewrites below may read as their source (a
    later ``view`` that worked on the copy's layout then works on the source's)."""
    for node in list(graph.nodes):
        if not _is_clone(node) or not isinstance(node.args[0], torch.fx.Node):
            continue
        src = node.args[0]
        s_src, s_copy = storage_of(src), storage_of(node)
        a, c = val(src), val(node)
        if s_src is None or s_copy is None or a.dtype != c.dtype or not same_sizes(a.stride(), c.stride()):
            continue
        yield node, src, s_src, s_copy


def _drop_unobserved_clones(graph: torch.fx.Graph) -> list[str]:
    """Make the readers of ``c = x.clone()`` read ``x`` where that cannot change what they see.

    Sound when nothing writes x's memory after the clone (the copy's only purpose; a write to a
    tensor of unknown memory counts as one), and every reader of the copy is out-of-place
    elementwise arithmetic: none writes it, returns it, views it or aliases it, so no caller and
    no later write can tell the copy from x. Values and gradients are the same (clone is the
    identity for both, unless the clone is made under ``no_grad`` of an x with history:
    ``reads_alike_to_autograd``), and so are the strides: only a copy with x's own strides goes,
    so that no later ``view`` that worked on the copy's layout can fail on x's. A clone of memory the caller
    holds stays (``protects_saved_input``): the caller could write x before the backward.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    writers = _writers(graph, order)
    regions = ContextRegions(graph)
    changes: list[str] = []
    for node, src, s_src, s_copy in _exact_clones(graph):
        readers = list(node.users)
        if not readers or not all(_is_arithmetic(u) and not _among(storage_of(u), (s_copy, s_src)) for u in readers):
            continue
        if protects_saved_input(node) or not reads_alike_to_autograd(node, src, regions):
            continue
        if any(at > order[node] and any(w is None or _among(w, (s_src, s_copy)) for w in written)
               for at, written in writers):
            continue
        for u in readers:
            u.replace_input_with(node, src)
        graph.erase_node(node)
        changes.append(f"{node.name} (a clone of {src.name} no one writes) read as {src.name}")
    return changes


def _write_through_staging_clones(graph: torch.fx.Graph) -> list[str]:
    """Write ``x`` itself where the code stages its new value in a clone of it:

        n = x.clone(); ...reads of n...; n.copy_(v); x.copy_(n)   ->   ...reads of x...; x.copy_(v)

    transformers 5.25 updates a cached recurrent state this way in its decode step (the clone
    keeps the cache's old state for a recorded history, and ``update_recurrent_state`` copies the
    new one back), and the decode pass, like eager code before 5.25, expects the state read and
    then written once.

    Sound when the clone is x's exact copy (dtype, strides), every other reader of n (or of a view
    of n) runs before ``n.copy_(v)`` and writes nothing, and nothing writes x's memory between
    the clone and ``x.copy_(n)`` nor reads it between the two copies: then the readers see x's
    value as they saw n's, and x ends with v cast to its dtype, as it did through n. Both copies
    must run in one grad mode / autocast / functorch region with the clone, and their results must
    be unused; a clone made under ``no_grad`` of an x with history is not x to autograd.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    writers = _writers(graph, order)
    regions = ContextRegions(graph)
    changes: list[str] = []
    for node, src, s_src, s_copy in _exact_clones(graph):
        stage = [u for u in node.users if _is_copy(u) and u.args[0] is node and u.args[1] is not node]
        back = [u for u in node.users if _is_copy(u) and u.args[0] is src and u.args[1] is node]
        if len(stage) != 1 or len(back) != 1 or stage[0].users or back[0].users:
            continue
        (w1,), (w2,) = stage, back
        # ``S.copy_(v)`` with v a view of S (``n.copy_(S.flip(-1))``) would copy S onto itself.
        if _among(storage_of(w1.args[1]), (s_src,)):
            continue
        if (not order[node] < order[w1] < order[w2] or regions.refusal([node, w1, w2], w1) is not None
                or not reads_alike_to_autograd(node, src, regions)):
            continue
        readers = [u for u in node.users if u not in (w1, w2)]
        # A view of n, or ``n.float()`` on an fp32 n (which returns n itself), is n too: its
        # readers count as n's.
        seen, stack, ok = set(), list(readers), True
        while stack and ok:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            ok = order[u] < order[w1] and not mutates(u)
            if _among(storage_of(u), (s_copy,)):
                stack.extend(u.users)
        if not ok:
            continue
        if any(order[node] < at < order[w2] and any(w is None or _among(w, (s_src,)) for w in written)
               for at, written in writers):
            continue
        between = [n for n in graph.nodes if order[w1] < order[n] < order[w2]]
        if any(_among(storage_of(i), (s_src,)) for n in between for i in n.all_input_nodes):
            continue
        for u in readers:
            u.replace_input_with(node, src)
        w1.update_arg(0, src)
        graph.erase_node(w2)
        graph.erase_node(node)
        changes.append(f"{node.name} (a clone of {src.name} copied back by {w2.name}) written as {src.name}")
    return changes


def _is_copy(node: torch.fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "copy_" and len(node.args) == 2
            and not node.kwargs.get("non_blocking", False))


_STEP_WRITES = {operator.imul: "mul", operator.iadd: "add", "mul_": "mul", "add_": "add", "addcmul_": "add"}


def caller_state_recurrences(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Graph inputs updated in place by a multiply and an add at three or more steps
    (``h = h0; h.mul_(dA[:, t]).add_(dBu[:, t])``): a recurrence on the caller's own tensor,
    which the writes above leave in place (the caller sees the final state in it) and so no scan
    pass reads. Returns each such input's first write, for the reason explain gives; one step
    is a decode step, which passes/decode.py handles."""
    found = []
    for root, writes in _chains(graph).items():
        if root.op != "placeholder":
            continue
        kinds = [_STEP_WRITES.get(w.target) for w in writes]
        if min(kinds.count("mul"), kinds.count("add")) >= 3:
            found.append(writes[0])
    return found


def rewrite_local_writes(gm: torch.fx.GraphModule) -> list[str]:
    """The rewrites of this module on ``gm`` (staging clones, writes, then the clones they leave
    unguarded); returns what changed."""
    changes = _write_through_staging_clones(gm.graph) + _functionalize(gm.graph) + _drop_unobserved_clones(gm.graph)
    if changes:
        gm.graph.lint()
        gm.recompile()
    return changes
