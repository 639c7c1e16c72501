"""After the rewrites: keep the strides the user's code relies on.

An ssm op returns its activations in the layout ``kernels/layout.py`` gives them, which need
not be the layout the replaced subgraph had in eager: a loop that stacks its per-step outputs
along dim 1 of a (batch, dim, L) input makes a (batch, L, dim)-contiguous result, the op a
(batch, dim, L)-contiguous one. The values are the same, the strides are not, and two things
in user code see strides:

* ``.view`` fails on a layout it cannot view (``y.view(b * l, d)`` after the rewrite above);
* the graph's outputs reach the caller, which may ``.view`` them or check their layout.

``settle_layouts`` re-runs the rewritten graph on fake tensors and mends both: a ``.view``
that no longer applies becomes ``.reshape`` (the same values; a copy where no view exists) when
nothing in the graph writes in place to the memory of the view or of its base and the view is
not returned, since only such a write or a caller holding both tensors could tell the copy from
a view; and an output whose strides
changed is given eager's strides back (permute, ``contiguous``, permute back: one copy, only
there). An output that is not dense (a slice) has no copy with eager's strides; where it is a
slice of an op output, the op output is copied into eager's layout instead and the slice taken
of the copy, when no write in place and no other returned alias could tell
(``_restore_viewed_bases``).
A ``.view`` that cannot be mended so raises, and the backend then compiles the graph
without ssm rewrites (``compiler._run_passes``) rather than fail or change what it computes.

A third thing sees strides: a random op (dropout, ``rand_like``, ``bernoulli``) fills its result
in its input's memory order, so the same seed puts the same numbers on other elements when an
op output reaches it in another layout. Such an input gets eager's order back (one copy before
the draw, and for an in-place draw a write back), draw by draw (``_restore_first_random_input``).
"""
from __future__ import annotations

import inspect
import logging
import operator
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from torch._prims_common import compute_elementwise_output_logical_to_physical_perm
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                          UnsupportedOperatorException)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, statically_known_true

from .fx_utils import (draws_random, fake_dispatch, inverse, is_call, is_method, mutates, node_order, set_val, storage_of,
                       storage_of_value, val, written_args)

try:
    from torch._prims_common import is_non_overlapping_and_dense_or_false as _is_dense
except ImportError:  # older torch spells it without the suffix
    from torch._prims_common import is_non_overlapping_and_dense as _is_dense

log = logging.getLogger("ssm_compile")

# Tensor.view(shape) and Tensor.view_as(other), and their reshaping twins. ``view(dtype)``
# reinterprets bytes instead and does not care about strides, so it is never rewritten.
_RESHAPE_OF = {"view": "reshape", "view_as": "reshape_as"}


class LayoutError(RuntimeError):
    """A ``.view`` the rewrites made impossible and that cannot become ``.reshape``."""


class ViewedBase(NamedTuple):
    """What a non-dense output views, as traced: the output's strides follow from the base's."""
    views: tuple[torch.fx.Node, ...]  # the view calls from the output back to the base, output first
    order: list[int] | None           # the base's dim order (None: not dense)
    storage: Any
    shape: tuple


class OutputLayout(NamedTuple):
    order: list[int] | None  # dim order, outermost first, of a dense output; None otherwise
    storage: Any             # the traced value's storage, to see which outputs alias each other
    base: ViewedBase | None = None  # for a non-dense output that views another node's value


def output_layouts(gm: torch.fx.GraphModule) -> list[OutputLayout | None]:
    """The layouts of the graph's tensor outputs as dynamo traced them (None: not a tensor).

    Read before the rewrites: the node a non-dense output views (the loop's ``torch.stack``) is
    replaced by an op output and erased, so its eager layout is only known from here.
    """
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return [_output_layout(a) if isinstance(a, torch.fx.Node) and isinstance(val(a), torch.Tensor) else None
            for a in pytree.tree_leaves(out.args)]


def _output_layout(node: torch.fx.Node) -> OutputLayout:
    order = _dim_order(val(node))
    if order is not None:
        return OutputLayout(order, storage_of(node))
    views, base = [], node
    while _is_plain_view(base):
        views.append(base)
        base = base.args[0]
    if not views:
        return OutputLayout(None, storage_of(node))
    return OutputLayout(None, storage_of(node),
                        ViewedBase(tuple(views), _dim_order(val(base)), storage_of(base), tuple(val(base).shape)))


def _draw_order(value: torch.Tensor) -> list[int]:
    """The dim order in which a random op fills a tensor shaped and laid out like ``value``:
    ``empty_like`` (``rand_like``, dropout's mask, a bernoulli) keeps a dense input's order, and
    lays any other input's result out densely in the order of its strides, as this perm does."""
    result = compute_elementwise_output_logical_to_physical_perm(value)
    perm = result[0] if isinstance(result, tuple) else result
    return [d for d in perm if not statically_known_true(value.shape[d] == 1)]


RandomInputs = dict  # random node -> {argument position or keyword: its draw order as traced}

# Marks the ``contiguous`` of a copy made for a draw's order (``_check_aliasing`` leaves it out).
_DRAW_COPY = "ssm_draw_order_copy"

# Draws whose numbers do not follow their input's layout: channel dropouts draw one number per
# (batch, channel) into a fresh tensor of their own.
_LAYOUT_FREE_DRAWS = ("dropout1d", "dropout2d", "dropout3d", "feature_alpha_dropout")


def random_input_layouts(gm: torch.fx.GraphModule) -> RandomInputs:
    """For every node that draws random numbers, the draw order of its tensor arguments as
    dynamo traced them: read before the rewrites, which may hand such a node an op output laid
    out otherwise (``causal_conv1d``'s (batch, dim, L) for eager's transposed conv output), so
    that the same generator state would fill the same numbers into other elements."""
    layouts: RandomInputs = {}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method") or not draws_random(n):
            continue
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        memory_format = n.kwargs.get("memory_format", torch.preserve_format)
        # (A dropout in eval mode, ``training=False``, draws nothing: it returns its input.)
        if (name in _LAYOUT_FREE_DRAWS or memory_format is not torch.preserve_format
                or _bound_arguments(n).get("training", True) is False):
            continue
        orders = {key: _draw_order(val(a)) for key, a in [*enumerate(n.args), *n.kwargs.items()]
                  if isinstance(a, torch.fx.Node) and isinstance(val(a), torch.Tensor)}
        if orders:
            layouts[n] = orders
    return layouts


def _bound_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """A Python function's arguments by name (``F.dropout``'s ``training``, ``inplace``); empty for
    a builtin or an op without a Python signature."""
    if node.op != "call_function":
        return {}
    try:
        return dict(inspect.signature(node.target).bind_partial(*node.args, **node.kwargs).arguments)
    except (TypeError, ValueError):
        return {}


def _writes_in_place(node: torch.fx.Node) -> list[torch.fx.Node]:
    """What a random ``node`` writes in place: ``x.uniform_()``'s x, ``F.dropout(x, inplace=True)``'s x."""
    written = written_args(node)
    if (_bound_arguments(node).get("inplace") is True and node.args and isinstance(node.args[0], torch.fx.Node)
            and node.args[0] not in written):
        written = [node.args[0], *written]
    return written


def _restore_first_random_input(gm: torch.fx.GraphModule, values: dict, traced: RandomInputs) -> list[str]:
    """Give the first random node (in graph order) whose tensor arguments the rewrites laid out
    otherwise their traced draw order back, one copy each: its numbers then land where eager's
    did, seed for seed. A written argument (``t.uniform_()``) gets the drawn copy written back
    (``t.copy_(...)``), and the node's users read that, so the write still reaches ``t``.
    Returns the changes; none when every random node draws as traced. One node at a time: a
    copy changes the layouts of what is computed from it, so the caller runs the graph again."""
    for node in gm.graph.nodes:
        if node not in traced or node not in values:
            continue  # not a random node, or erased by a rewrite
        written = _writes_in_place(node)
        changes = []
        for key, want in traced[node].items():
            arg = node.args[key] if isinstance(key, int) else node.kwargs[key]
            value = values.get(arg) if isinstance(arg, torch.fx.Node) else None
            if not isinstance(value, torch.Tensor) or _draw_order(value) == want:
                continue
            with gm.graph.inserting_before(node):
                copy = _copy_in_order(gm, arg, value, want)
            copy.args[0].meta[_DRAW_COPY] = True  # its contiguous()
            if isinstance(key, int):
                node.update_arg(key, copy)
            else:
                node.update_kwarg(key, copy)
            if arg in written:
                users = [u for u in node.users]
                with gm.graph.inserting_after(node):
                    back = gm.graph.call_method("copy_", (arg, node))
                set_val(back, value)
                for user in users:
                    user.replace_input_with(node, back)
            changes.append(f"{node.name} draws random numbers over {arg.name}: dim order "
                           f"{_draw_order(value)} -> eager's {want}" + (", written back" if arg in written else ""))
        if changes:
            return changes
    return []


# Views whose strides follow from their input's strides alone, so that a base with eager's
# strides gives them eager's strides too. Not ``reshape``/``flatten``/``contiguous`` (a view or
# a copy depending on the strides) and not ``as_strided`` (strides given outright).
_PLAIN_VIEW_METHODS = ("view", "view_as", "transpose", "permute", "t", "select", "narrow", "unsqueeze",
                       "squeeze", "expand", "expand_as", "movedim", "moveaxis", "swapaxes", "swapdims",
                       "diagonal", "unfold")
_PLAIN_VIEW_FUNCTIONS = (operator.getitem, torch.transpose, torch.permute, torch.select, torch.narrow,
                         torch.unsqueeze, torch.squeeze, torch.movedim, torch.swapaxes, torch.diagonal, torch.t)


def _is_plain_view(n: torch.fx.Node) -> bool:
    """``n`` views its first argument (basic indexing included, advanced indexing copies: told
    apart by the traced storages) through one of the plain views above."""
    if not (is_method(n, *_PLAIN_VIEW_METHODS) or is_call(n, *_PLAIN_VIEW_FUNCTIONS)):
        return False
    source = n.args[0] if n.args else None
    if not (isinstance(source, torch.fx.Node) and isinstance(val(source), torch.Tensor)
            and isinstance(val(n), torch.Tensor)):
        return False
    storage = storage_of(n)
    return storage is not None and storage == storage_of(source)


def _dim_order(value: torch.Tensor) -> list[int] | None:
    """The order (outermost first) in which a dense tensor's dims lie in memory, without its
    size-1 dims (whose strides address nothing); None for a tensor that is not dense.

    Orders rather than strides, so that shapes that are symbols (dynamic shapes) compare and
    restore the same way as fixed ones: the restore needs only the order.
    """
    if not _is_dense(value):
        return None
    result = compute_elementwise_output_logical_to_physical_perm(value)
    perm = result[0] if isinstance(result, tuple) else result  # a (perm, flag) pair on newer torch
    return [d for d in perm if not statically_known_true(value.shape[d] == 1)]


def _fresh_input(value: Any) -> Any:
    # A new fake tensor with the placeholder's metadata, so that running the graph (in-place
    # metadata changes such as ``t_()`` included) cannot touch dynamo's example values.
    if not isinstance(value, torch.Tensor):
        return value
    fresh = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    if not value.requires_grad:
        return fresh
    if value.is_leaf or torch._debug_has_internal_overlap(fresh) == 1:
        return fresh.requires_grad_()
    # A non-leaf input keeps its history: a caller's activation, or a buffer the graph itself
    # writes a grad-requiring value into (``cache.copy_(h)``: dynamo's example value carries the
    # write's history after tracing). In-place writes to it are legal, where on a leaf that
    # requires grad they raise; a copy from a grad-requiring scalar makes it such a non-leaf and
    # keeps its strides.
    return fresh.copy_(torch.zeros((), dtype=value.dtype, device=value.device, requires_grad=True))


# Dynamo's graphs switch global state on and off with calls (autocast regions, the vmap levels
# of an inlined associative_scan). Running the graph runs them; a run that stops between an
# enter and its exit must not leave the state switched on for the compile that follows.


class _Propagate(torch.fx.Interpreter):
    """Runs the graph on fake tensors, mending ``.view`` calls that the new layouts broke, and
    keeping every node's new fake value (``values``) for the aliasing checks after the run."""

    def __init__(self, gm: torch.fx.GraphModule, mode: Any):
        super().__init__(gm, garbage_collect_values=True)
        self.mode = mode
        self.values: dict[torch.fx.Node, Any] = {}
        self.mended: list[str] = []
        self.open_autocast: list[Any] = []
        self.open_vmap = 0

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except DataDependentOutputException:
            # ``p.item()`` of a float that dynamic shapes made an input (a dropout's p): dynamo
            # traced it to a symbol, which the rest of the graph can use as it did.
            traced = val(n)
            if not (is_method(n, "item") and isinstance(traced, (torch.SymFloat, torch.SymInt, torch.SymBool))):
                raise
            result = traced
        except Exception as e:  # noqa: BLE001  (fake kernels raise several types for a bad view)
            if not (n.op == "call_method" and n.target in _RESHAPE_OF and _is_stride_error(n, e)):
                raise
            # The same values, a copy where no view exists. Whether a copy is safe here (no
            # write to, and no return of, the memory involved) is decided after the run, on
            # the new values (``_check_aliasing``), since writes can come later in the graph.
            self.mended.append(f"{n.name}: .{n.target} -> .{_RESHAPE_OF[n.target]}")
            n.target = _RESHAPE_OF[n.target]
            if "size" in n.kwargs:  # view(size=...) is reshape(shape=...)
                kwargs = dict(n.kwargs)
                kwargs["shape"] = kwargs.pop("size")
                n.kwargs = kwargs
            result = super().run_node(n)
            set_val(n, result)
        self.values[n] = result
        self._track_state(n, result)
        return result

    def get_attr(self, target: str, args: tuple, kwargs: dict) -> Any:
        # Under inductor's global ``freezing``, dynamo puts parameters in the graph as attributes
        # (get_attr) instead of inputs: real tensors, which a fake run must see as fake ones.
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor):
            value = self.mode.from_tensor(value, static_shapes=True)
        return value

    def _track_state(self, n: torch.fx.Node, result: Any) -> None:
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name == "_enter_autocast":
            self.open_autocast.append(result)
        elif name == "_exit_autocast" and self.open_autocast:
            self.open_autocast.pop()
        elif name == "_vmap_increment_nesting":
            self.open_vmap += 1
        elif name == "_vmap_decrement_nesting":
            self.open_vmap -= 1

    def close_open_state(self) -> None:
        while self.open_autocast:
            torch.amp.autocast_mode._exit_autocast(self.open_autocast.pop())
        for _ in range(self.open_vmap):
            torch._C._functorch._vmap_decrement_nesting()
        self.open_vmap = 0


# Calls whose result is a view of their input or a copy depending on the input's strides. On an
# ssm op's output, whose strides may differ from eager's, one of them may copy where eager's
# viewed (or the reverse); ``as_strided`` reads memory by eager's strides outright.
_STRIDE_DEPENDENT_METHODS = ("reshape", "reshape_as", "flatten", "contiguous")
_STRIDE_DEPENDENT_FUNCTIONS = (torch.reshape, torch.flatten)


def _stride_dependent(n: torch.fx.Node) -> bool:
    return is_method(n, *_STRIDE_DEPENDENT_METHODS) or is_call(n, *_STRIDE_DEPENDENT_FUNCTIONS)


def _as_strided(n: torch.fx.Node) -> bool:
    return is_method(n, "as_strided") or is_call(n, torch.as_strided)


_FAKE_RUN_LIMITS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException,
                    GuardOnDataDependentSymNode)


def _check_aliasing(gm: torch.fx.GraphModule, values: dict, out_node: torch.fx.Node,
                    traced: list[OutputLayout | None]) -> None:
    """Raise ``LayoutError`` where the new layouts could change what the program computes.

    A view-or-copy call (``reshape``, ``flatten``, ``contiguous``, a mended ``.view``) on the
    memory of an ssm op's output may now copy where eager viewed, or view where eager copied.
    That is invisible unless something writes in place to that memory or to the call's result,
    or the caller can: where the result is returned, the outputs must share memory exactly as
    eager's did (``traced``), and no gradient may be recorded through the op (its backward may
    have saved the memory the caller would then write). ``as_strided`` on that memory would
    read it by eager's strides: the same. Decided on the new fake values, whose storages are
    the rewritten graph's real aliasing.
    """
    ops = {n for n in values if n.op == "call_function" and getattr(n.target, "namespace", None) == "ssm"}
    outputs = [n for n in values if n in ops or (is_call(n, operator.getitem) and n.args[0] in ops)]
    op_memory = {storage_of_value(values[n]) for n in outputs} - {None}
    if not op_memory:
        return
    # (Not the copies the draw-order restore made: eager has no view there to tell them from.)
    risky = [n for n in values if (_stride_dependent(n) or _as_strided(n)) and not n.meta.get(_DRAW_COPY)
             and n.args and isinstance(n.args[0], torch.fx.Node) and storage_of_value(values.get(n.args[0])) in op_memory]
    if not risky:
        return
    for n in risky:
        if _as_strided(n):
            raise LayoutError(f"{n.name} = {n.format_node()} reads an ssm op's output by explicit "
                              "strides, and the op's layout need not be eager's")
    memory = op_memory | {storage_of_value(values[n]) for n in risky}
    leaves = [storage_of_value(values.get(a)) if isinstance(a, torch.fx.Node) else None
              for a in pytree.tree_leaves(out_node.args)]
    grad = any(isinstance(values[n], torch.Tensor) and values[n].requires_grad for n in outputs)
    for n in risky:
        storage = storage_of_value(values[n])
        if storage not in leaves:
            continue
        if grad or not _shares_as_traced(leaves, traced, storage):
            raise LayoutError(f"{n.name} = {n.format_node()} may copy where eager viewed an ssm op's output "
                              f"(or view where eager copied), and it is returned, so a caller could tell: "
                              + ("the op records a gradient" if grad else "the outputs share memory otherwise"))
    for m in values:
        if mutates(m) and any(storage_of_value(values.get(a)) in memory for a in written_args(m)):
            raise LayoutError(f"{m.name} writes in place to memory that "
                              f"{', '.join(n.name for n in risky)} may now copy instead of view")


def _shares_as_traced(leaves: list[Any], traced: list[OutputLayout | None], storage: Any) -> bool:
    """The outputs in ``storage`` (by their new values' storages, ``leaves``) share memory with
    each other and with no other output, as the traced ones did."""
    if len(leaves) != len(traced):
        return False
    here = [i for i, s in enumerate(leaves) if s == storage]
    eager = {traced[i].storage if traced[i] is not None else None for i in here}
    if len(eager) != 1 or None in eager:
        return False
    (eager_storage,) = eager
    return all(traced[i] is None or (traced[i].storage == eager_storage) == (i in here) for i in range(len(traced)))


def _is_stride_error(n: torch.fx.Node, e: Exception) -> bool:
    # view(dtype) is not a shape view; the message is the one torch's view meta raises.
    if n.target == "view" and any(isinstance(a, torch.dtype) for a in n.args[1:]):
        return False
    return "view" in str(e) and "stride" in str(e)


def settle_layouts(gm: torch.fx.GraphModule, traced: list[OutputLayout | None],
                   random_inputs: RandomInputs | None = None) -> list[str]:
    """Mend ``gm`` (rewritten) so that its views apply, its outputs keep their ``traced`` layouts,
    and its random draws their ``random_inputs`` draw orders (``random_input_layouts``).

    Returns a line per change, for the log. Raises ``LayoutError`` where a view cannot be
    mended, where the new layouts could change aliasing a program can observe, and where the
    rewritten graph no longer runs on fake tensors. A graph without fake inputs, or one that
    needs dynamo's machinery to run (data-dependent values), is left unchecked.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [val(n) for n in placeholders]
    mode = next((v.fake_mode for v in values if isinstance(v, torch._subclasses.FakeTensor)), None)
    if mode is None or any(v is None for v in values):
        return []
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    with fake_dispatch(mode), torch.set_grad_enabled(torch.is_grad_enabled()):
        interp, outputs = _run_fake(gm, values, mode)
        changes = list(interp.mended)
        for _ in range(len(random_inputs or {})):
            if outputs is None:
                break
            drawn = _restore_first_random_input(gm, interp.values, random_inputs)
            if not drawn:
                break
            changes += drawn
            interp, outputs = _run_fake(gm, values, mode)  # the copy's layout reaches what follows it
        if outputs is not None:
            _check_aliasing(gm, interp.values, out_node, traced)
            outputs = pytree.tree_leaves(outputs)
            changes += _restore_viewed_bases(gm, interp.values, out_node, outputs, traced)
            changes += _restore_outputs(gm, out_node, outputs, traced)
    if changes:
        gm.recompile()
    return changes


def _run_fake(gm: torch.fx.GraphModule, values: list, mode: Any) -> tuple[_Propagate, list | None]:
    """Run ``gm`` on fresh fake inputs like ``values`` (under the caller's fake ``mode``): the
    interpreter (its mended views, its values) and the outputs, None where the graph needs
    dynamo's machinery to run. Raises ``LayoutError`` where the rewritten graph no longer runs."""
    interp = _Propagate(gm, mode)
    try:
        return interp, interp.run(*[_fresh_input(v) for v in values])
    except LayoutError:
        raise
    except _FAKE_RUN_LIMITS as e:
        # What a plain interpreter cannot run without dynamo's machinery (a data-dependent
        # shape, ``nonzero``): not the rewrites' doing. Left unchecked.
        log.info("ssm layout check: the graph did not run on fake tensors here (%s); its views "
                 "and output layouts are not checked", type(e).__name__)
        return interp, None
    except Exception as e:  # noqa: BLE001  (anything else is the rewritten graph's)
        # Dynamo built the graph by running every node on fake tensors, so a node that no
        # longer runs is one the rewrites broke (a view inside a checkpointed function that
        # receives an op output, say): compile without them.
        raise LayoutError(f"the rewritten graph does not run on fake tensors: {type(e).__name__}: {e}") from e
    finally:
        interp.close_open_state()


def _restore_outputs(gm, out_node, outputs, traced) -> list[str]:
    changes = []
    leaves, spec = pytree.tree_flatten(out_node.args)
    for i, (arg, value, want) in enumerate(zip(leaves, outputs, traced)):
        if not isinstance(arg, torch.fx.Node) or want is None or not isinstance(value, torch.Tensor):
            continue
        have = _dim_order(value)
        if want.order is None:
            # Eager returned a non-dense tensor: a slice of something bigger, like HF's
            # ``all_states[:, :, -1]`` that the op's dense last_state replaces. No copy has its
            # strides, and refusing would drop every such rewrite, so it is left (and logged):
            # a caller's ``.view`` of a non-dense tensor is as fragile in eager as here. Slices
            # of an op output got eager's strides already where they could (``_restore_viewed_bases``).
            log.info("ssm layout check: output %d is not dense in eager; its layout is left", i)
            continue
        if have == want.order:
            continue
        if any(j != i and other is not None and other.storage == want.storage and want.storage is not None
               for j, other in enumerate(traced)):
            # Outputs that were views of one another in eager: a copy for one of them would let
            # the caller see that they no longer share memory.
            raise LayoutError(f"output {i} ({arg.name}) needs eager's layout back, and shares its "
                              "memory with another output")
        with gm.graph.inserting_before(out_node):
            leaves[i] = _copy_in_order(gm, arg, value, want.order)
        changes.append(f"output {i} ({arg.name}): dim order {have} -> eager's {want.order}")
    if changes:
        out_node.args = pytree.tree_unflatten(leaves, spec)
    return changes


def _copy_in_order(gm: torch.fx.GraphModule, arg: torch.fx.Node, value: torch.Tensor,
                   order: list[int]) -> torch.fx.Node:
    """Insert (at the graph's insertion point) a copy of ``arg`` laid out in dim ``order``:
    permute, ``contiguous``, permute back. Runs under the caller's fake mode, so the new nodes
    get fake values like every other."""
    # Size-1 dims go innermost: where they sit changes no address.
    perm = order + [d for d in range(value.dim()) if d not in order]
    moved = gm.graph.call_method("permute", (arg, *perm))
    dense = gm.graph.call_method("contiguous", (moved,))
    back = gm.graph.call_method("permute", (dense, *inverse(perm)))
    set_val(moved, value.permute(perm))
    set_val(dense, val(moved).contiguous())
    set_val(back, val(dense).permute(inverse(perm)))
    return back


def _op_output(n: Any) -> bool:
    """``n`` is a tensor an ssm op returned (its own fresh memory: the ops are functional)."""
    if not isinstance(n, torch.fx.Node):
        return False
    if is_call(n, operator.getitem) and isinstance(n.args[0], torch.fx.Node):
        n = n.args[0]
    return n.op == "call_function" and getattr(n.target, "namespace", None) == "ssm"


def _rewritten_base(leaf: Any, viewed: ViewedBase) -> torch.fx.Node | None:
    """The op output that the traced view calls of ``viewed`` now view, if they all survived the
    rewrites unchanged and the base they viewed became an op output; else None."""
    views = viewed.views
    if leaf is not views[0] or any(n.args[0] is not m for n, m in zip(views, views[1:])):
        return None
    base = views[-1].args[0]
    return base if _op_output(base) else None


def _restore_viewed_bases(gm, values, out_node, outputs, traced) -> list[str]:
    """Give a non-dense output eager's strides by giving the op output it views eager's layout.

    A returned slice of the loop's stacked output (``y[:, :3]``) views the op's output after the
    rewrite and takes its strides, channel-innermost where eager's were L-innermost; no copy of
    the slice itself has eager's strides. A copy of the op output in eager's layout, inserted
    right after the op and viewed by the same calls, does. Only those view calls are moved onto
    the copy; the op's other users keep its own layout. That is sound only where nothing can
    tell the copy from the memory it replaces: nothing in the graph writes in place to the op
    output's memory (a write before or after the view would miss the copy, or the copy miss
    it), and every returned tensor sharing that memory moves onto the copy with the others (the
    caller sees them alias as in eager). Elsewhere the output is left in the op's layout, as a
    non-dense output always was (``_restore_outputs``); its values are right either way.
    """
    leaves, spec = pytree.tree_flatten(out_node.args)
    groups: dict[torch.fx.Node, list[int]] = {}
    for i, (leaf, want) in enumerate(zip(leaves, traced)):
        if want is not None and want.base is not None and want.base.order is not None:
            base = _rewritten_base(leaf, want.base)
            if base is not None:
                groups.setdefault(base, []).append(i)
    changes = []
    for base, viewing in groups.items():
        eager = traced[viewing[0]].base
        value = values.get(base)
        have = _dim_order(value) if isinstance(value, torch.Tensor) else None
        if have is None or have == eager.order:
            continue
        direct, why = _why_base_stays(base, viewing, values, leaves, traced)
        if why is not None:
            log.info("ssm layout check: %s keeps the op's strides (a view of %s, whose layout is "
                     "not eager's): %s", ", ".join(f"output {i}" for i in viewing), base.name, why)
            continue
        # A real copy: ``have`` differs from eager's order in a dim longer than 1, so the
        # permuted op output is never contiguous already.
        with gm.graph.inserting_before(base.next):
            copy = _copy_in_order(gm, base, value, eager.order)
        values[copy] = val(copy)
        moved = {traced[i].base.views[-1] for i in viewing}
        for n in moved:
            n.replace_input_with(base, copy)
        order = node_order(gm.graph)
        for n in sorted({v for i in viewing for v in traced[i].base.views}, key=order.__getitem__):
            values[n] = _run_again(n, values)
            set_val(n, values[n])
        for i in direct:
            leaves[i] = copy
        for i in viewing + direct:
            outputs[i] = values[leaves[i]]
        changes.append(f"{', '.join(f'output {i} ({leaves[i].name})' for i in viewing)}: views of "
                       f"{base.name}, whose copy in eager's dim order {eager.order} (the op's is {have}) "
                       "they now view")
    if changes:
        out_node.args = pytree.tree_unflatten(leaves, spec)
    return changes


def _why_base_stays(base, viewing, values, leaves, traced) -> tuple[list[int], str | None]:
    """The outputs that are ``base`` itself, and why ``base`` may not be copied (None: it may)."""
    eager = traced[viewing[0]].base
    if any(traced[i].base.storage != eager.storage or traced[i].base.order != eager.order for i in viewing[1:]):
        return [], "the outputs viewed different tensors in eager"
    value = values[base]
    if len(value.shape) != len(eager.shape) or not all(
            statically_known_true(a == b) for a, b in zip(value.shape, eager.shape)):
        return [], f"its shape {tuple(value.shape)} is not the traced base's {eager.shape}"
    memory = storage_of_value(value)
    if memory is None:
        return [], "its memory is unknown, so its aliases cannot be told"
    for m in values:
        if mutates(m) and any(storage_of_value(values.get(a)) == memory for a in written_args(m)):
            return [], f"{m.name} writes in place to its memory, which a copy would split"
    direct = []
    for j, leaf in enumerate(leaves):
        if j in viewing or not isinstance(leaf, torch.fx.Node) or storage_of_value(values.get(leaf)) != memory:
            continue
        want = traced[j]
        if leaf is not base or want is None or want.order != eager.order or want.storage != eager.storage:
            return [], f"output {j} ({leaf.name}) shares its memory and would not move onto the copy"
        direct.append(j)
    return direct, None


def _run_again(n: torch.fx.Node, values: dict) -> Any:
    """``n``'s value from its arguments' (fake) ``values``: for view calls moved onto a copy."""
    args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), values.__getitem__)
    if n.op == "call_method":
        return getattr(args[0], n.target)(*args[1:], **kwargs)
    return n.target(*args, **kwargs)
