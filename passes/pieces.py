"""Before the rewrites: a split piece that is the whole tensor is that tensor, and so is a cat of
one tensor; a loop's width-1 pieces are selects.

transformers 5.25's ``mamba_scan_forward`` cuts every scan input in two before the scan,
``torch.tensor_split(x, [L - k], dim)``, where k is the number of recurrent states the cache asks
to keep (0 unless it records them). With k = 0 the first piece is all of x, and the scan reads
``tensor_split(time_step, [L], 2)[0]`` where earlier versions read ``time_step``. The piece computes
nothing, but a matcher that follows a value back to its producer (x_dt_proj finds dt_proj behind
Δ) stops at the split. Other Mamba code does the same with ``torch.split(x, [L, 0])`` or a
``chunk(1)``.

A piece whose fake value has x's sizes, strides and storage offset is a view with x's exact
metadata: every read and every in-place write through it touches the same elements as through
x, and autograd routes its gradient to x unchanged. So its users can read x instead. Only
statically known equalities count (no guard is added on a symbolic size); anything else, a
piece that is part of x, or an x of unknown shape, is left as it is.

The same function then joins what it split, ``torch.cat(all_outputs, dim=2)``, with one output
when no state is kept: a copy of the scan's output, on the path from the gate to out_proj.
(Inductor drops a one-input cat itself, but only after our passes, and the ``inductor=False``
path of ``explain`` would run the copy.) Reading x where the code read ``cat([x])`` differs only
in memory: the result aliases x. So it is done only when nothing else reads x, x owns its memory
(no other node views it, offset 0) and that memory is not the caller's, nothing in the graph
writes in place at all to x's or the cat's memory (or to memory of unknown origin), the cat's
metadata is not changed in place, both run in one grad mode, and the cat's strides are x's (or,
after the rewrites, the layout pass will mend what relies on them: ``read_single_cats``).

A loop that takes each step as a width-1 piece that keeps the time axis (``x[:, :, t:t + 1]``,
``x.narrow(2, t, 1)``, ``zip(x.split(1, 2), ...)``, ``x.chunk(L, 2)``) reads the same values as one
that selects step t and puts the axis back, ``x.select(2, t).unsqueeze(2)``: both are views of x
with the same sizes and offset. The matchers read a select as a time slice and an unsqueeze as a
broadcast, so ``read_unit_pieces`` writes the pieces so, where the two also have the same
strides (the size-1 axis' stride can differ, on a channels-last x say, and conv2d or pooling
choose their output's layout from it, which later code may read: probe BB, run 52). Only where
one tensor is cut into two or more such pieces along one axis (a loop's steps), and only pieces
nobody writes or reshapes in place, returns, or reads the strides of.

A reshape of a reshape back to the tensor's own sizes (``h.view(b, d * n)`` stored as a flat
state, ``.view(b, d, n)`` at the next step) is, where its fake value has x's sizes, strides,
storage offset and storage, a view with x's exact metadata, as a whole piece is: its users can
read x (``read_reshape_round_trips``). A reshape that copied (a non-contiguous x) has its own
storage and is left alone. Without this, a loop whose state round-trips through a flat shape
had its state update start at the reshape, and the last step did not repeat the others.

A bare ``x.squeeze()`` drops every size-1 axis of x. Where exactly one axis has size 1 and every
other size is known not to be 1 (a symbolic size is not 1: dynamo specialises 0 and 1), it is
``x.squeeze(axis)``, the same view, and ``name_squeezed_axes`` writes it so: the matchers read
only a squeeze with its axis (zeta-style readouts, ``(H @ C.unsqueeze(-1)).squeeze()``, hid the
skip after them). With two or more size-1 axes (batch 1) it is left as written.

A loop that walks time in chunks, stacks each chunk's outputs and joins the chunks with ``cat``
along the stacked axis (``cat([stack(ys_0, 1), stack(ys_1, 1), ...], 1)``) computes the stack of
all the steps' outputs in order, with the same values, dtype, sizes and strides.
``join_stacked_cats`` writes it as that one stack, so the scan matchers see every step's output
collected, where each stack is read by the cat alone and runs in the cat's grad and autocast
state (a stack under ``no_grad`` holds no history; the joined stack would), and where nothing
writes in place between the first stack and the cat (the joined stack reads every item where the
cat runs).

``t[:] = v`` and ``t[...] = v`` (every index a whole slice or an ellipsis) write v into all of t,
converting and broadcasting it as ``t.copy_(v)`` does (``Tensor.__setitem__`` does that copy):
``whole_setitems_as_copies`` writes them so, and the passes that read a state or window write
read one spelling (probe CV: ``conv_state[:] = torch.roll(conv_state, -1, -1)`` in a decode step
was left alone with no reason, where ``conv_state.copy_(...)`` was rewritten).
"""
from __future__ import annotations

import collections
import operator
from typing import Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .fx_utils import (METADATA_MUTATIONS, ContextRegions, is_call, is_method, metadata_mutated, metadata_writes, mutates,
                       propagate_val, reads_alike_to_autograd, same_sizes, storage_of, unit_piece, val, written_args)

_SPLIT_FUNCTIONS = (torch.tensor_split, torch.split, torch.functional.split, torch.split_with_sizes, torch.chunk,
                    torch.hsplit, torch.vsplit, torch.dsplit)
_SPLIT_METHODS = ("tensor_split", "split", "split_with_sizes", "chunk", "hsplit", "vsplit", "dsplit")
_CATS = (torch.cat, torch.concat, torch.concatenate)


def _whole(piece: torch.fx.Node, returned: set, regions: ContextRegions, writes: tuple) -> torch.fx.Node | None:
    """The split's input when ``piece`` (``split(x, ...)[i]``) is all of it and reading x
    instead changes nothing a program can see, else None.

    Besides equal metadata that means: the piece is not returned (the caller would get x's
    tensor object itself, where ``unsqueeze_`` on one would now change the other), neither it nor
    x has its metadata changed in place (the fake values then show the graph's end, not the
    point of the read), and autograd sees the same graph (a piece taken under ``no_grad`` of an x
    with history has none)."""
    if not is_call(piece, operator.getitem) or not isinstance(piece.args[1], int):
        return None
    split = piece.args[0]
    if not (is_call(split, *_SPLIT_FUNCTIONS) or is_method(split, *_SPLIT_METHODS)):
        return None
    source = split.args[0] if split.args else split.kwargs.get("input", split.kwargs.get("tensor"))
    return _read_as(piece, source, returned, regions, writes) if isinstance(source, torch.fx.Node) else None


def _read_as(node: torch.fx.Node, source: torch.fx.Node, returned: set, regions: ContextRegions,
             writes: tuple) -> torch.fx.Node | None:
    """``source`` when ``node``'s fake value has its dtype, sizes, strides and storage offset and
    reading ``source`` instead changes nothing a program can see (``_whole``), else None."""
    p, x = val(node), val(source)
    if not isinstance(p, torch.Tensor) or not isinstance(x, torch.Tensor) or p.dtype != x.dtype:
        return None
    if not (same_sizes(p.shape, x.shape) and same_sizes(p.stride(), x.stride())
            and statically_known_true(p.storage_offset() == x.storage_offset())):
        return None
    if node in returned or metadata_mutated(node, writes) or metadata_mutated(source, writes):
        return None
    return source if reads_alike_to_autograd(node, source, regions) else None


_RESHAPE_METHODS = ("view", "reshape", "flatten", "unflatten")
_RESHAPE_FUNCTIONS = (torch.reshape, torch.flatten, torch.unflatten)


def _is_reshape(node: torch.fx.Node) -> bool:
    return is_method(node, *_RESHAPE_METHODS) or is_call(node, *_RESHAPE_FUNCTIONS)


def _round_trip_source(node: torch.fx.Node, returned: set, regions: ContextRegions,
                       writes: tuple) -> torch.fx.Node | None:
    """x when ``node`` reshapes a reshape of x back to x's exact view (module docstring)."""
    if not _is_reshape(node) or not node.args or not _is_reshape(node.args[0]) or not node.args[0].args:
        return None
    source = node.args[0].args[0]
    # A reshape that copied has its own storage, whatever its metadata.
    if not isinstance(source, torch.fx.Node) or storage_of(node) is None or storage_of(node) != storage_of(source):
        return None
    return _read_as(node, source, returned, regions, writes)


def _read_through(gm: torch.fx.GraphModule, source_of: Callable[..., torch.fx.Node | None],
                  say: Callable[[torch.fx.Node, torch.fx.Node], str]) -> list[str]:
    """Point the users of every node that ``source_of`` reads as another tensor at that tensor;
    a line each (``say``). The node, and its input once nothing reads it, are erased here rather
    than left to dead-code elimination: the matchers count a value's users (the delta pass folds
    dt_proj's product into the scan only when nothing else reads it), and a dead node still counts."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned = {n for n in pytree.tree_leaves(out.args) if isinstance(n, torch.fx.Node)}
    regions, writes = ContextRegions(gm.graph), metadata_writes(gm.graph)
    changes = []
    for node in list(gm.graph.nodes):
        source = source_of(node, returned, regions, writes)
        if source is None:
            continue
        inner = node.args[0]
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
        if not inner.users:
            gm.graph.erase_node(inner)
        changes.append(say(node, source))
    return changes


def read_reshape_round_trips(gm: torch.fx.GraphModule) -> list[str]:
    """Point the users of every reshape round trip at the tensor it started from; a line each."""
    return _read_through(gm, _round_trip_source,
                         lambda node, x: f"{node.name} reshapes {x.name} back to its own view: its users read {x.name}")


def read_whole_pieces(gm: torch.fx.GraphModule) -> list[str]:
    """Point the users of every whole piece at the split's input (and drop the split once no
    piece is read); a line per piece."""
    return _read_through(gm, _whole, lambda node, x: f"{node.name} is all of {x.name}: its users read {x.name}")


def read_single_cats(gm: torch.fx.GraphModule, same_strides: bool = True) -> list[str]:
    """Replace ``cat([x])`` by x where no one can tell them apart (module docstring); a line each.

    ``same_strides=False`` is for the pass manager's cleanup after the rewrites, which
    ``settle_layouts`` follows: there x is typically an op output in the op's layout (HF's
    associative_scan path leaves a non-contiguous y, so the cat could not go before the
    rewrites), and the strides the code after the cat relies on (its ``.view`` calls, the graph's
    outputs) are mended there as for any op output.
    """
    graph = gm.graph
    caller = {storage_of(n) for n in graph.nodes if n.op in ("placeholder", "get_attr")}
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    caller.update(storage_of(n) for n in pytree.tree_leaves(out.args) if isinstance(n, torch.fx.Node))
    written = [storage_of(w) for n in graph.nodes if mutates(n) for w in written_args(n)]
    # How many nodes hold each storage: x owns its memory when it alone does. (A fold erases the
    # cat, whose storage is its own, so the counts stay right for the cats after it.)
    holders = collections.Counter(storage_of(n) for n in graph.nodes)
    regions, writes = ContextRegions(graph), metadata_writes(graph)
    changes = []
    for cat in list(graph.nodes):
        if not is_call(cat, *_CATS) or not cat.args or not isinstance(cat.args[0], (list, tuple)):
            continue
        if len(cat.args[0]) != 1 or not isinstance(cat.args[0][0], torch.fx.Node):
            continue
        (x,) = cat.args[0]
        c, v = val(cat), val(x)
        s_x, s_c = storage_of(x), storage_of(cat)
        if not isinstance(c, torch.Tensor) or not isinstance(v, torch.Tensor) or s_x is None or s_c is None:
            continue
        if list(x.users) != [cat] or c.dtype != v.dtype or not same_sizes(c.shape, v.shape):
            continue
        if same_strides and not same_sizes(c.stride(), v.stride()):
            continue
        if any(s_x == other for other in caller if other is not None):
            continue
        if any(w is None or w == s_x or w == s_c for w in written):
            continue
        # x must own its memory from offset 0: as a view (``cat([z[1]])``) its offset and its
        # neighbours would show through ``as_strided`` or a later view of the result.
        if not statically_known_true(v.storage_offset() == 0) or holders[s_x] != 1:
            continue
        if metadata_mutated(cat, writes) or metadata_mutated(x, writes) or not reads_alike_to_autograd(cat, x, regions):
            continue
        cat.replace_all_uses_with(x)
        graph.erase_node(cat)
        changes.append(f"{cat.name} is a cat of {x.name} alone: its users read {x.name}")
    return changes


# What reads a tensor's strides rather than its values: the one difference between a unit piece
# and the select that replaces it.
_STRIDE_READERS_METHODS = ("as_strided", "as_strided_", "stride", "set_", "data_ptr", "untyped_storage")


def _plain_unit_piece(node: torch.fx.Node, returned: set, writes: tuple) -> tuple[torch.fx.Node, int, int] | None:
    found = unit_piece(node)
    if found is None or node in returned or metadata_mutated(node, writes):
        return None
    if is_method(node, "unsqueeze") or is_call(node, torch.unsqueeze):
        return None  # already a select put back
    for user in node.users:
        if (mutates(user) and node in written_args(user)) or is_method(user, *_STRIDE_READERS_METHODS) \
                or is_call(user, torch.as_strided):
            return None
    return found


def read_unit_pieces(gm: torch.fx.GraphModule) -> list[str]:
    """Write each width-1 piece of a loop's steps as a select put back (module docstring); a
    line per tensor."""
    graph = gm.graph
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    returned = {n for n in pytree.tree_leaves(out.args) if isinstance(n, torch.fx.Node)}
    groups: dict[tuple[torch.fx.Node, int], list[tuple[torch.fx.Node, int]]] = collections.defaultdict(list)
    writes = metadata_writes(graph)
    for node in graph.nodes:
        found = _plain_unit_piece(node, returned, writes)
        if found is not None:
            base, axis, index = found
            groups[(base, axis)].append((node, index))
    changes = []
    for (base, axis), pieces in groups.items():
        size = val(base).shape[axis]
        if len({i % size if isinstance(size, int) else i for _, i in pieces}) < 2:
            continue
        done = 0
        for piece, index in pieces:
            with graph.inserting_before(piece):
                sel = graph.call_method("select", (base, axis, index))
                put_back = graph.call_method("unsqueeze", (sel, axis))
            for new in (sel, put_back):
                new.meta.update({k: v for k, v in piece.meta.items() if k not in ("val", "example_value")})
            propagate_val(sel)
            p, q = val(piece), propagate_val(put_back)
            if not (same_sizes(p.stride(), q.stride()) and statically_known_true(p.storage_offset() == q.storage_offset())):
                # The size-1 axis' stride differs (a channels-last base): conv2d, pooling and
                # group_norm pick their output's memory format from it, and code after them may
                # read that layout (probe BB). Left as it is.
                graph.erase_node(put_back)
                graph.erase_node(sel)
                continue
            done += 1
            piece.replace_all_uses_with(put_back)
            source = piece.args[0] if is_call(piece, operator.getitem) else None
            graph.erase_node(piece)
            if source is not None and not source.users:
                graph.erase_node(source)
        if done:
            changes.append(f"{done} width-1 pieces of {base.name} along axis {axis} read as "
                           f"{base.name}.select({axis}, t).unsqueeze({axis})")
    if changes:
        graph.lint()
        gm.recompile()
    return changes


def name_squeezed_axes(gm: torch.fx.GraphModule) -> list[str]:
    """Write each bare ``x.squeeze()`` as ``x.squeeze(axis)`` where exactly one axis of x has size 1
    (module docstring); a line each."""
    graph = gm.graph
    changes = []
    for node in graph.nodes:
        bare = (is_method(node, "squeeze") or is_call(node, torch.squeeze)) and len(node.args) == 1 and not node.kwargs
        if not bare or not isinstance(node.args[0], torch.fx.Node):
            continue
        v = val(node.args[0])
        if not isinstance(v, torch.Tensor):
            continue
        ones = [i for i, s in enumerate(v.shape) if statically_known_true(s == 1)]
        # Every other axis must be known not to be 1; a size the graph leaves open could be 1 at a
        # call this graph serves, and bare squeeze() would drop it there.
        if len(ones) != 1 or not all(statically_known_true(s != 1) for i, s in enumerate(v.shape) if i != ones[0]):
            continue
        node.args = (node.args[0], ones[0])
        changes.append(f"{node.name} squeezes {node.args[0].name}'s only size-1 axis: read as squeeze({ones[0]})")
    if changes:
        gm.recompile()
    return changes


def _whole_index(index, ndim: int) -> bool:
    """``index`` selects all of a tensor of ``ndim`` axes: whole slices and at most one ellipsis."""
    items = index if isinstance(index, tuple) else (index,)
    whole = [isinstance(i, slice) and i == slice(None, None, None) for i in items]
    ellipses = sum(i is Ellipsis for i in items)
    return all(w or i is Ellipsis for w, i in zip(whole, items)) and ellipses <= 1 and sum(whole) <= ndim


def whole_setitems_as_copies(gm: torch.fx.GraphModule) -> list[str]:
    """Write each ``t[:] = v`` / ``t[...] = v`` of a tensor v as ``t.copy_(v)`` (module docstring);
    a line each."""
    graph = gm.graph
    changes = []
    for node in list(graph.nodes):
        if not is_call(node, operator.setitem) or len(node.args) != 3 or node.kwargs or node.users:
            continue
        target, index, value = node.args
        if not (isinstance(target, torch.fx.Node) and isinstance(value, torch.fx.Node)
                and isinstance(val(target), torch.Tensor) and isinstance(val(value), torch.Tensor)
                and _whole_index(index, val(target).dim())):
            continue
        with graph.inserting_before(node):
            copy = graph.call_method("copy_", (target, value))
        copy.meta = dict(node.meta)
        copy.meta["val"] = val(target)
        graph.erase_node(node)
        changes.append(f"{copy.name}: {target.name}[{index!r}] = {value.name} written as {target.name}.copy_({value.name})")
    if changes:
        graph.lint()
        gm.recompile()
    return changes


def _stack_axis(node: torch.fx.Node) -> int | None:
    """The output axis along which ``node`` (``torch.stack(items, axis)``) stacks, made non-negative."""
    if not is_call(node, torch.stack) or node.kwargs or not node.args or not isinstance(node.args[0], (list, tuple)):
        return None
    axis = node.args[1] if len(node.args) > 1 else 0
    v = val(node)
    if not isinstance(axis, int) or not isinstance(v, torch.Tensor):
        return None
    return axis % v.dim()


def _writes(node: torch.fx.Node) -> bool:
    """``node`` writes a tensor's values (in place, ``out=``) or its sizes and strides (``t_()``)."""
    return mutates(node) or (node.op == "call_method" and node.target in METADATA_MUTATIONS)


def _between(first: torch.fx.Node, last: torch.fx.Node, order: dict) -> list[torch.fx.Node]:
    """The nodes strictly between ``first`` and ``last`` in graph order."""
    return [n for n, i in order.items() if order[first] < i < order[last]]


def join_stacked_cats(gm: torch.fx.GraphModule) -> list[str]:
    """Write ``cat([stack(xs, k), stack(ys, k), ...], k)`` as ``stack(xs + ys + ..., k)`` (module
    docstring); a line each."""
    graph = gm.graph
    regions = ContextRegions(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    changes = []
    for cat in list(graph.nodes):
        if not is_call(cat, *_CATS) or cat.kwargs or not cat.args or not isinstance(cat.args[0], (list, tuple)):
            continue
        stacks = list(cat.args[0])
        c = val(cat)
        axis = cat.args[1] if len(cat.args) > 1 else 0
        if len(stacks) < 2 or not isinstance(c, torch.Tensor) or not isinstance(axis, int):
            continue
        if not all(isinstance(s, torch.fx.Node) and _stack_axis(s) == axis % c.dim() for s in stacks):
            continue
        # The stacks must be read by this cat alone (once each) and run in its grad and autocast
        # state: then nothing but the cat sees them, and the joined stack has the cat's history.
        if any(list(s.users) != [cat] or stacks.count(s) != 1 for s in stacks):
            continue
        if regions.refusal([cat, *stacks]) is not None:
            continue
        # The joined stack reads every item where the cat runs, the first stacks' items later than
        # they did: a write in between (``h[0] = 5``, ``x.add_(1)``, ``torch.mul(h, 3, out=h)``,
        # ``h.t_()``) to an item, its base or a view of it would show in the joined stack only
        # (probe CU). Any write there refuses the join; which memory it touches is not needed.
        if any(_writes(n) for n in _between(min(stacks, key=order.__getitem__), cat, order)):
            continue
        items = [item for s in stacks for item in s.args[0]]
        with graph.inserting_before(cat):
            joined = graph.call_function(torch.stack, (items, axis % c.dim()))
        joined.meta.update({k: v for k, v in cat.meta.items() if k not in ("val", "example_value")})
        j = propagate_val(joined)
        if j.dtype != c.dtype or not same_sizes(j.shape, c.shape) or not same_sizes(j.stride(), c.stride()):
            graph.erase_node(joined)
            continue
        cat.replace_all_uses_with(joined)
        # The joined stack may itself be a stack of a later cat (nested cats): it runs where the cat did.
        order[joined] = order.pop(cat)
        graph.erase_node(cat)
        for s in stacks:
            del order[s]
            graph.erase_node(s)
        changes.append(f"{cat.name} joins {len(stacks)} stacks along their stacked axis {axis % c.dim()}: "
                       f"read as one stack of their {len(items)} items")
    if changes:
        graph.lint()
        gm.recompile()
    return changes
