"""x_proj and dt_proj as one op, ``ssm::x_dt_proj`` (family ``x_dt_proj``).

After the delta pass has moved dt_proj's bias and softplus into the scan, what is left of Δ is
two thin products back to back::

    x_dbl = F.linear(x, W_x)                          # (..., R + 2N)
    dt_low, B, C = torch.split(x_dbl, [R, N, N], dim=-1)
    delta = F.linear(dt_low, W_dt)                    # (..., dim), read by ssm.selective_scan

(HF's ``W_dt @ dt_low.transpose(1, 2)`` reaches this pass in the same form: the delta pass
writes it as the linear.) mamba_simple's reference path spells dt_proj as a 2-D product on rows,
``W_dt @ dt_low.t()`` (dim, rows), then reshapes and permutes it to (batch, dim, L); the op's dt
transposed is that product. The pass replaces both products by one
``ssm.x_dt_proj(x, W_x, W_dt)`` emitted where x_proj was; B and C keep their split of its first
output. On CUDA that is one kernel instead of two cuBLAS calls, a memset and a copy of dt_low
(``kernels/x_dt_proj``).

The scan only anchors the match (this is a Mamba block's Δ): dt_proj is found by following Δ's
single-input steps that keep its values (views, reshapes, casts), and the rewrite replaces dt_proj
by an equal value, so those steps and any other user of dt_proj see what they saw.

Soundness: the op computes exactly the two linears (same rounding points), so the rewrite holds
when
- dt_proj's input is the first R columns of x_proj's output, through views that give back the
  same tensor (a split's or tensor_split's first piece, a chunk's first piece when its
  ceil(W / k) columns are R, ``x_dbl[..., :R]``, ``x_dbl.narrow(-1, 0, R)``) and copies of the
  same values and gradient (``dt.clone()``, ``dt.to(dt.dtype, copy=True)``,
  ``torch.cat([dt, B], -1)[..., :R]``: not ``dt.detach()``),
  and R is W_dt's second dimension (in the 2-D product form, that input transposed: ``.t()``,
  ``.T``, ``.transpose(0, 1)``, ``.permute(1, 0)``);
- each product is a linear (``F.linear``, ``x @ W.t()``, or an einsum that is one:
  ``'bld,ed->ble'``), neither has a bias, and every tensor (x, both weights, both outputs) has one floating
  dtype: no cast or autocast region changes a product's precision;
- dt is now computed where x_proj ran, earlier than the user's code did, so nothing may write in
  place to x_dbl (any view of it), to a copy of it on the way, or to W_dt, W_dt must exist there,
  and both products must run under one grad mode / autocast state with no functorch level between;
- the op saves x_dbl for its backward where eager's dt_proj saved the copy: under grad, a copy
  stays when x_dbl's memory is returned (the caller may write it before the backward).
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, NamedTuple, Optional

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .delta import LINEAR_TARGETS, MATMUL_TARGETS, weight_product
from .fx_utils import (Layout, caller_storages, context_refusal, dtype_of, grad_enabled_at, is_call, is_cast,
                       is_lossless_cast, is_method, layout_source, mutates, named_args, node_order, propagate_val,
                       protects_saved_input, same_sizes, scan_args, scan_nodes, shape_of, storage_of, target_name, val,
                       view_chain, written_in_place)
from .manager import PassContext, PassManager

FAMILY = "x_dt_proj"
_SPLITS = (torch.split, torch.functional.split, torch.split_with_sizes)
_CATS = (torch.cat, torch.concat, torch.concatenate)
# Calls that return their input's values (a copy, or the tensor itself) when dtype, device and
# shape stay: the keywords name only what may change the copy's strides or its timing.
_COPY_METHODS = ("clone", "to", "contiguous", "float", "double", "half", "bfloat16", "type")
_COPY_KEYWORDS = {"memory_format", "copy", "non_blocking", "dtype", "device"}
# The op's dtypes on every device (fp64 only on CPU, for gradcheck: not worth a rewrite).
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class Site(NamedTuple):
    x_proj: torch.fx.Node   # F.linear(x, W_x)
    dt_proj: torch.fx.Node  # F.linear(dt_low, W_dt), or W_dt @ dt_low^T on 2-D rows (``rows_product``)
    x: Any
    x_weight: torch.fx.Node
    dt_weight: torch.fx.Node
    nodes: list[torch.fx.Node]  # from dt_low back to x_proj's output, for the record and checks
    rows_product: bool = False


def _linear(node: Any) -> Optional[tuple[Any, Any]]:
    """``(input, weight)`` of a bias-free ``F.linear``, or of the same product written
    ``input @ weight.t()`` (``.T``, ``transpose(0, 1)``, ``permute(1, 0)``: a 2-D weight's
    transposed view) or ``torch.einsum('bld,ed->ble', input, weight)``, else None."""
    if is_call(node, torch.einsum, torch.functional.einsum):
        return _einsum_linear(node)
    if is_call(node, *MATMUL_TARGETS) and len(node.args) == 2 and not node.kwargs:
        x, weight_t = node.args
        if not isinstance(weight_t, torch.fx.Node) or len(shape_of(weight_t) or ()) != 2:
            return None
        top = layout_source(weight_t, allow_casts=False)
        return (x, top.base) if top.perm == (1, 0) and top.base is not weight_t else None
    if not is_call(node, *LINEAR_TARGETS):
        return None
    args = named_args(node, ("input", "weight", "bias"))
    if args.get("bias") is not None or "input" not in args or "weight" not in args:
        return None
    return args["input"], args["weight"]


def _einsum_linear(node: torch.fx.Node) -> Optional[tuple[Any, Any]]:
    """``(input, weight)`` when the einsum is ``F.linear(input, weight)``: two operands, a 2-D
    weight ``'ec'`` whose second letter is the input's last axis, and an output that is the
    input's subscripts with that axis replaced by ``e`` (``'...d,ed->...e'``, ``'bld,ed->ble'``).
    A permuted output, a repeated letter (a diagonal), an implicit output or a broadcast
    contracted axis is not a linear."""
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or len(operands) != 2 or node.kwargs or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    subscripts = inputs.split(",")
    if len(subscripts) != 2:
        return None
    xs, ws = subscripts
    ellipsis = xs.startswith("...")
    letters = xs[3:] if ellipsis else xs
    if (not letters.isalpha() or len(set(letters)) != len(letters) or len(ws) != 2 or not ws.isalpha()
            or ws[1] != letters[-1] or ws[0] in letters):
        return None
    if out != ("..." if ellipsis else "") + letters[:-1] + ws[0]:
        return None
    x, weight = operands
    x_shape, w_shape = shape_of(x), shape_of(weight)
    if x_shape is None or w_shape is None or len(w_shape) != 2 or (
            len(x_shape) < len(letters) if ellipsis else len(x_shape) != len(letters)):
        return None
    # einsum broadcasts a size-1 axis against its letter's other axes: x[..., :1] with a (E, D)
    # weight is x times W's row sums, not a linear.
    if not statically_known_true(x_shape[-1] == w_shape[1]):
        return None
    return x, weight


def _weight_views(product: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes between ``x @ W.t()``'s second operand and W (none for ``F.linear``)."""
    if not is_call(product, *MATMUL_TARGETS):
        return []
    weight_t = product.args[1]
    return view_chain(weight_t, layout_source(weight_t, allow_casts=False).base)


def _last_axis(axis: Any, node: torch.fx.Node) -> bool:
    shape = shape_of(node)
    return isinstance(axis, int) and shape is not None and axis % len(shape) == len(shape) - 1


def _leading_columns(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, int]]:
    """``(x_dbl, R)`` when ``node`` is x_dbl's first R columns (last axis), else None."""
    piece = node.args[1] if is_call(node, operator.getitem) and len(node.args) == 2 else None
    if isinstance(piece, int) and not isinstance(piece, bool) and piece >= 0 and (
            is_call(node.args[0], *_SPLITS) or is_method(node.args[0], "split", "split_with_sizes")):
        split = node.args[0]
        args = named_args(split, ("tensor", "split_size_or_sections", "dim") if split.op == "call_function"
                          else ("self", "split_size", "dim"))
        source = args.get("tensor", args.get("self"))
        sizes = args.get("split_size_or_sections", args.get("split_size"))
        axis = args.get("dim", 0)
        if not isinstance(source, torch.fx.Node) or not _last_axis(axis, source):
            return None
        if isinstance(sizes, (list, tuple)):
            # A piece after empty ones starts at column 0 too (``x_dbl.split([0, R, N, N])``, probe CN).
            if piece >= len(sizes) or not all(_is_int(s) for s in sizes[:piece + 1]) or any(sizes[:piece]):
                return None
            return source, sizes[piece]
        return (source, sizes) if piece == 0 and _is_int(sizes) else None
    if isinstance(piece, int) and not isinstance(piece, bool) and piece >= 0 and (
            is_call(node.args[0], torch.tensor_split) or is_method(node.args[0], "tensor_split")):
        return _tensor_split_leading(node.args[0], piece)
    if piece == 0 and (is_call(node.args[0], torch.chunk) or is_method(node.args[0], "chunk")):
        return _chunk_leading(node.args[0])
    if is_method(node, "narrow") or is_call(node, torch.narrow):
        source, axis, start, length = (list(node.args) + [None] * 4)[:4]
        if isinstance(source, torch.fx.Node) and _last_axis(axis, source) and start == 0 and isinstance(length, int):
            return source, length
        return None
    indexed = _last_axis_index(node)
    if indexed is not None:
        source, last = indexed
        if isinstance(last, slice) and last.start in (None, 0) and last.step in (None, 1) and isinstance(last.stop, int):
            if last.stop >= 0:
                return source, last.stop
            # x_dbl[..., :-2 * N]: the columns left of the last 2N, on a last axis of known width.
            width = shape_of(source)[-1]
            if isinstance(width, int) and width + last.stop > 0:
                return source, width + last.stop
    return None


def _symbolic_columns(node: torch.fx.Node) -> Optional[str]:
    """Why ``node``, the first columns of a linear's output up to a size known only when the graph
    runs (``x_dbl[:, :delta_rank]`` with ``delta_rank = W_dt.shape[1]`` under ``dynamic=True``), is
    not read as x_proj's first R columns; None for any other node."""
    def symbolic(b: Any) -> bool:
        return isinstance(b, (torch.fx.Node, torch.SymInt))

    source = width = None
    indexed = _last_axis_index(node)
    if indexed is not None and isinstance(indexed[1], slice):
        cut = indexed[1]
        if cut.start in (None, 0) and cut.step in (None, 1) and symbolic(cut.stop):
            source, width = indexed[0], cut.stop
    elif is_method(node, "narrow") or is_call(node, torch.narrow):
        base, axis, start, length = (list(node.args) + [None] * 4)[:4]
        if isinstance(base, torch.fx.Node) and _last_axis(axis, base) and start == 0 and symbolic(length):
            source, width = base, length
    elif is_call(node, operator.getitem) and node.args[1] == 0 and (
            is_call(node.args[0], *_SPLITS) or is_method(node.args[0], "split", "split_with_sizes")):
        split = node.args[0]
        base, sizes, axis = (list(split.args) + [None, 0])[:3]
        first = sizes[0] if isinstance(sizes, (list, tuple)) and sizes else sizes
        if isinstance(base, torch.fx.Node) and _last_axis(axis, base) and symbolic(first):
            source, width = base, first
    if source is None:
        return None
    if _linear(source) is None:
        # Not x_proj's output whatever the width: the reason static sizes would get.
        return _not_x_proj(source, width.name if isinstance(width, torch.fx.Node) else width)
    return (f"dt_proj reads {node.name}, the first columns of x_proj's output {source.name} up to a size known "
            "only when the graph runs (symbolic: under dynamic=True a weight passed as a plain tensor has "
            "symbolic sizes, an nn.Parameter's stay static): the pass proves on static sizes that dt_proj reads "
            "exactly x_proj's first R columns, R being dt_proj's weight's second size, so x_proj and dt_proj "
            "stay as they are")


def _last_axis_index(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, Any]]:
    """``(x, i)`` when ``node`` is ``x[..., i]``, every axis but the last taken whole, else None."""
    if not (is_call(node, operator.getitem) and isinstance(node.args[0], torch.fx.Node)):
        return None
    source, index = node.args
    items = list(index) if isinstance(index, tuple) else [index]
    ndim = len(shape_of(source) or ())
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + [slice(None)] * (ndim - len(items) + 1) + items[at + 1:]
    if len(items) != ndim or ndim == 0 or any(i != slice(None) for i in items[:-1]):
        return None
    return source, items[-1]


def _offset_columns(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, int, int]]:
    """``(x_dbl, start, stop)`` when ``node`` is x_dbl's columns start:stop (last axis, unit step,
    bounds as the slice or ``narrow`` reads them on a width known here) and start is past column 0
    (``x_dbl[..., 1:R + 1]``); else None."""
    if is_method(node, "narrow") or is_call(node, torch.narrow):
        source, axis, start, length = (list(node.args) + [None] * 4)[:4]
        if not (isinstance(source, torch.fx.Node) and _last_axis(axis, source) and _is_int(start)
                and _is_int(length)):
            return None
        width = shape_of(source)[-1]
        if not _is_int(width):
            return None
        start = start + width if start < 0 else start
        bounds = (start, start + length)
    else:
        indexed = _last_axis_index(node)
        width = shape_of(indexed[0])[-1] if indexed is not None else None
        if indexed is None or not isinstance(indexed[1], slice) or not _is_int(width) or not all(
                b is None or _is_int(b) for b in (indexed[1].start, indexed[1].stop, indexed[1].step)):
            return None
        source = indexed[0]
        start, stop, step = indexed[1].indices(width)
        if step != 1:
            return None
        bounds = (start, stop)
    return (source, *bounds) if 0 < bounds[0] < bounds[1] else None


def _chunk_leading(chunk: torch.fx.Node) -> Optional[tuple[torch.fx.Node, int]]:
    """``(x_dbl, R)`` for the first piece of ``torch.chunk(x_dbl, k, dim)`` along the last axis of
    a width W known here: chunk cuts pieces of ceil(W / k) columns (the last one shorter), so the
    first is x_dbl's first min(ceil(W / k), W) columns; else None."""
    args = named_args(chunk, ("input", "chunks", "dim"))
    source, chunks = args.get("input", args.get("self")), args.get("chunks")
    if not isinstance(source, torch.fx.Node) or not _last_axis(args.get("dim", 0), source) or not _is_int(chunks):
        return None
    width = shape_of(source)[-1]
    if not _is_int(width) or chunks < 1:
        return None
    return source, min(-(-width // chunks), width)


# How many ops back from dt_proj's input a function of x_proj's first columns is named (a
# weighted RMS norm is about six: pow, mean, add, rsqrt, mul, mul by the weight).
_FUNCTION_DEPTH = 8


def _deep_function(dt_proj: torch.fx.Node) -> Optional[str]:
    """Why not, when dt_proj (a linear) reads a value computed from x_proj's first columns through
    more ops than ``_later_piece`` looks at (HF Jamba's ``dt_layernorm(time_step)``, a weighted RMS
    norm: probe DA, no reason was given), within ``_FUNCTION_DEPTH`` ops; else None. Asked after
    ``_later_piece``, whose reasons for a piece of a cat or of a split are the closer ones."""
    found = _linear(dt_proj)
    if found is None or not isinstance(found[0], torch.fx.Node):
        return None
    low = _read_through_copies(found[0])[0].base
    for node in _inputs_within(low, _FUNCTION_DEPTH):
        columns = _leading_columns(_read_through_copies(node, allow_casts=True)[0].base)
        if columns is not None and _linear(columns[0]) is not None:
            return (f"dt_proj reads {low.name}, computed from x_proj's first columns {node.name} through "
                    "several ops, not the columns themselves: ssm.x_dt_proj computes the two products "
                    "back to back, so they stay as they are")
    return None


def _inputs_within(node: torch.fx.Node, depth: int):
    """The nodes ``node`` is computed from, nearest first, up to ``depth`` ops back (each once)."""
    seen, frontier = {node}, [node]
    for _ in range(depth):
        frontier = [a for n in frontier if n.op in ("call_function", "call_method")
                    for a in n.all_input_nodes if a not in seen]
        seen.update(frontier)
        yield from frontier


def _dt_proj_of_columns(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a linear (with or without a bias) of x_proj's first columns."""
    if not is_call(node, *LINEAR_TARGETS):
        return False
    low = named_args(node, ("input", "weight", "bias")).get("input")
    if not isinstance(low, torch.fx.Node):
        return False
    columns = _leading_columns(_read_through_copies(low)[0].base)
    return columns is not None and _linear(columns[0]) is not None


def _function_of_dt_proj(source: torch.fx.Node) -> Optional[str]:
    """Why not, when Δ's producer ``source`` is not dt_proj but a function of it within
    ``_FUNCTION_DEPTH`` ops (``exp(dt_proj(dt))``, ``relu(...)``, ``softplus(...).clamp(min)``,
    a second bias the delta pass left in Δ; probe DC: no reason was given), or dt_proj itself
    with a bias the delta pass did not move into the scan; else None. Asked last: the other
    reasons name a closer cause."""
    if _dt_proj_of_columns(source):
        return (f"dt_proj {source.name} keeps its bias (the delta pass did not move it into the scan): "
                "ssm.x_dt_proj computes the bias-free product, so the two products stay as they are")
    for node in _inputs_within(source, _FUNCTION_DEPTH):
        if _dt_proj_of_columns(node):
            return (f"Δ is {source.name} = {target_name(source)} of a value computed from dt_proj {node.name} "
                    "(of x_proj's first columns), not dt_proj itself up to its bias and softplus, which the "
                    "scan takes: ssm.x_dt_proj replaces a dt_proj that is Δ, so the two products stay as "
                    "they are")
    return None


def _per_head_products(dt_proj: torch.fx.Node) -> Optional[str]:
    """Why not, when Δ is one head's slice of a batched dt_proj of the first columns of a batched
    x_proj, else None. HF Zamba keeps one x_proj and one dt_proj weight per head (``(H, R + 2N, hd)``,
    ``(H, hd, R)``), applies both to every head at once (``W[:, None] @ x``) and runs one scan per
    head on ``time_step[head]``: probe DB, no reason was given. The op takes one 2-D weight per
    product; each head's slice is such a pair, but the graph computes every head in one batched
    product, which a rewrite at each head's scan would split into H."""
    if not (is_call(dt_proj, operator.getitem) and isinstance(dt_proj.args[0], torch.fx.Node)
            and _is_int(dt_proj.args[1])):
        return None
    product = dt_proj.args[0]
    if not is_call(product, *MATMUL_TARGETS) or len(product.args) != 2 or product.kwargs or any(
            len(shape_of(a) or ()) < 3 for a in product.args):
        return None
    for operand in product.args:
        columns = _leading_columns(layout_source(operand, allow_casts=False).base)
        if columns is None:
            continue
        x_proj = layout_source(columns[0], allow_casts=False).base
        if is_call(x_proj, *MATMUL_TARGETS) and all(len(shape_of(a) or ()) >= 3 for a in x_proj.args):
            return (f"Δ is one head's slice ({dt_proj.name}) of {product.name}, a dt_proj batched over heads (one "
                    f"weight per head) of the first {columns[1]} columns of {x_proj.name}, an x_proj batched the "
                    "same way: ssm.x_dt_proj takes one 2-D weight per product, and these products compute every "
                    "head at once, so they stay as they are")
    return None


def _later_piece(dt_proj: torch.fx.Node, axis_names: dict[int, str]) -> Optional[str]:
    """Why not, when dt_proj (a linear) reads a function of x_proj's first columns, a piece of a
    split of x_proj's output other than the first (``B, C, dt = x_dbl.split([N, N, R], -1)``, probe
    CJ: no reason was given), or a piece of a cat of them that is not its leading columns (probe
    CS); else None. ``axis_names``: dt_proj's input axes that are Δ's batch and time axes."""
    found = _linear(dt_proj)
    top = _read_through_copies(found[0])[0] if found is not None and isinstance(found[0], torch.fx.Node) else None
    low = top.base if top is not None else None
    # ``dt_proj(tanh(dt))`` (probe CM: no reason was given), ``dt_proj(2.0 * dt)``, ``where(dt > 0,
    # dt, 0)`` or a rounded copy of them (``dt.double().float()``, probe CN): any operand, read
    # through views, casts and copies, that is x_proj's first columns.
    operands = low.all_input_nodes if isinstance(low, torch.fx.Node) and low.op in ("call_function",
                                                                                  "call_method") else []
    read = [_read_through_copies(arg, allow_casts=True) for arg in operands]
    chain = next((passed for source, passed in read if (c := _leading_columns(source.base)) is not None
                  and _linear(c[0]) is not None), None)
    if chain is not None:
        if is_method(low, "detach") or is_call(low, torch.detach):
            return (f"dt_proj reads {low.name} = x_proj's first columns detached: no gradient reaches x_proj "
                    "through dt_proj, where ssm.x_dt_proj's backward would send one, so the two products stay "
                    "as they are")
        if mutates(low):
            what = f"x_proj's first columns as {low.name} = {target_name(low)} writes them in place"
        elif is_cast(low):
            what = "x_proj's first columns " + _casts(low, chain)
        else:
            what = f"{low.name} = {target_name(low)} of x_proj's first columns"
        return (f"dt_proj reads {what}, not the columns themselves: ssm.x_dt_proj "
                "computes the two products back to back, so they stay as they are")
    piece = _piece(low) if isinstance(low, torch.fx.Node) else None
    if piece is not None and is_call(piece[0], *_CATS):
        why = _cat_piece(*piece, axis_names if top.perm == tuple(range(len(top.perm))) else {})
        if why is not None:
            return why
    offset = _offset_columns(low) if isinstance(low, torch.fx.Node) else None
    if offset is not None and _linear(offset[0]) is not None:
        source, start, stop = offset
        return (f"dt_proj reads columns {start}:{stop} of x_proj's output {source.name}, not its first "
                f"{stop - start}: ssm.x_dt_proj computes dt from the first R columns, so the two products stay "
                "as they are")
    if not (is_call(low, operator.getitem) and isinstance(low.args[1], int) and low.args[1] > 0):
        return None
    split = low.args[0]
    chunk = is_call(split, torch.chunk) or is_method(split, "chunk")
    if not (chunk or is_call(split, *_SPLITS, torch.tensor_split)
            or is_method(split, "split", "split_with_sizes", "tensor_split")):
        return None
    source = split.args[0] if split.args else None
    if not isinstance(source, torch.fx.Node) or _linear(source) is None:
        return None
    return (f"dt_proj reads piece {low.args[1]} of the {'chunk' if chunk else 'split'} of x_proj's output "
            f"{source.name}, not its first columns: ssm.x_dt_proj computes dt from the first R columns (dt, B, C "
            "order), so the two products stay as they are")


def _axis_names(delta: torch.fx.Node, dt_proj: torch.fx.Node) -> dict[int, str]:
    """dt_proj's axes (and its input's: a linear keeps the leading ones) that are the op's Δ's
    batch and time axes, where Δ is dt_proj through permutations; else none."""
    top = layout_source(delta)
    if top.base is not dt_proj or len(top.perm) != 3:
        return {}
    return {top.perm[0]: "the batch axis", top.perm[2]: "the time axis"}


def _piece(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, int, int, int]]:
    """``(x, axis, start, stop)`` when ``node`` is x's elements start:stop along one axis, every
    other axis whole: ``x[..., a:b]``, ``x[:, a:b]``, ``x.narrow(axis, a, n)``, piece k of
    ``x.split(sizes, axis)`` or of ``x.chunk(k, axis)``; x's size along that axis known here."""
    if is_method(node, "narrow") or is_call(node, torch.narrow):
        source, axis, start, length = (list(node.args) + [None] * 4)[:4]
        shape = shape_of(source) if isinstance(source, torch.fx.Node) else None
        size = shape[axis] if shape and isinstance(axis, int) else None
        if not (_is_int(size) and _is_int(start) and _is_int(length)):
            return None
        start = start + size if start < 0 else start
        return source, axis % len(shape), start, start + length
    if not is_call(node, operator.getitem) or not isinstance(node.args[0], torch.fx.Node):
        return None
    source, index = node.args
    if isinstance(val(source), torch.Tensor):
        items = list(index) if isinstance(index, tuple) else [index]
        ndim = len(shape_of(source))
        if Ellipsis in items:
            at = items.index(Ellipsis)
            items = items[:at] + [slice(None)] * (ndim - len(items) + 1) + items[at + 1:]
        cut = [i for i, item in enumerate(items) if item != slice(None)]
        if len(items) > ndim or len(cut) != 1 or not isinstance(items[cut[0]], slice):
            return None
        axis, size, bounds = cut[0], shape_of(source)[cut[0]], items[cut[0]]
        if not _is_int(size) or not all(b is None or _is_int(b) for b in (bounds.start, bounds.stop, bounds.step)):
            return None
        start, stop, step = bounds.indices(size)
        return (source, axis, start, stop) if step == 1 and start < stop else None
    split = source
    if not _is_int(index) or not (is_call(split, *_SPLITS, torch.chunk) or is_method(split, "split", "chunk")):
        return None
    chunk = is_call(split, torch.chunk) or is_method(split, "chunk")
    args = named_args(split, ("input", "chunks", "dim") if chunk else ("tensor", "split_size_or_sections", "dim"))
    source = args.get("input", args.get("tensor", args.get("self")))
    sizes = args.get("chunks") if chunk else args.get("split_size_or_sections", args.get("split_size"))
    axis = args.get("dim", 0)
    if not isinstance(source, torch.fx.Node) or shape_of(source) is None or not isinstance(axis, int):
        return None
    axis %= len(shape_of(source))
    size = shape_of(source)[axis]
    if not _is_int(size):
        return None
    if chunk:
        sizes = -(-size // sizes) if _is_int(sizes) and sizes > 0 else None
    if _is_int(sizes) and sizes > 0:
        sizes = [min(sizes, size - k) for k in range(0, size, sizes)]
    if not isinstance(sizes, (list, tuple)) or index >= len(sizes) or not all(_is_int(k) for k in sizes):
        return None
    start = sum(sizes[:index])
    return source, axis, start, start + sizes[index]


def _operand(node: Any) -> Optional[str]:
    """What a cat's operand is of x_proj's output: its first columns, or a function of them
    (read through views, casts and copies); else None."""
    if not isinstance(node, torch.fx.Node):
        return None
    base = _read_through_copies(node, allow_casts=True)[0].base

    def first_columns(x: torch.fx.Node) -> bool:
        c = _leading_columns(_read_through_copies(x, allow_casts=True)[0].base)
        return c is not None and _linear(c[0]) is not None

    if first_columns(base):
        return "x_proj's first columns"
    if base.op in ("call_function", "call_method") and any(first_columns(x) for x in base.all_input_nodes):
        return f"{target_name(base)} of x_proj's first columns"
    return None


def _cat_piece(cat: torch.fx.Node, axis: int, start: int, stop: int, axis_names: dict[int, str]) -> Optional[str]:
    """Why not, when dt_proj reads elements start:stop along ``axis`` of a cat (``cat``) one of
    whose operands is x_proj's first columns or a function of them, and they are not the cat's
    leading columns that x_dt_proj reads through (``_cat_head``): a later operand's columns
    (``torch.cat([B, dt], -1)[..., N:]``), or a piece along another axis than the columns
    (``torch.cat([dt, dt2], 0)[:b]``); else None."""
    args = named_args(cat, ("tensors", "dim"))
    tensors, dim = args.get("tensors"), args.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int) or dim % len(shape_of(cat)) != axis:
        return None
    described = [_operand(t) for t in tensors]
    sizes = [shape_of(t)[axis] if isinstance(t, torch.fx.Node) and len(shape_of(t) or ()) == len(shape_of(cat))
             else None for t in tensors]
    if not any(described) or not all(_is_int(k) for k in sizes):
        return None
    ends = list(itertools.accumulate(sizes))
    read = [k for k, end in enumerate(ends) if end - sizes[k] < stop and start < end]
    first, last = read[0], read[-1]

    def operand(k: int) -> str:
        return f"{tensors[k].name}{' = ' + described[k] if described[k] else ''}"

    whole = (start, stop) == (ends[first] - sizes[first], ends[first])
    last_axis = axis == len(shape_of(cat)) - 1
    if first == last == 0 and whole and last_axis:
        # The leading columns that ``_cat_head`` reads through where the cat keeps dt's dtype: not
        # refused for being a cat's piece.
        return None
    if first != last:
        part = f"parts of its operands {first} ({operand(first)}) to {last} ({operand(last)})"
    elif whole:
        part = f"its operand {first} ({operand(first)})"
    else:
        part = f"part of its operand {first} ({operand(first)})"
    if last_axis:
        where, how = (f"columns {start}:{stop} of {cat.name}, a torch.cat along the last axis",
                      "only as its first R columns where its first operand is those R columns")
    else:
        along = axis_names.get(axis, f"axis {axis}")
        where, how = (f"{start}:{stop} along {along} of {cat.name}, a torch.cat along {along}",
                      "only along the last axis, as its first operand's columns")
    return (f"dt_proj reads {where}, which are {part}: ssm.x_dt_proj computes dt from x_proj's first R columns, "
            f"and the pass reads them through a cat {how} (torch.cat([dt, B], -1)[..., :R]), so the two products "
            "stay as they are")


def _casts(cast: torch.fx.Node, chain: list[torch.fx.Node]) -> str:
    """How ``cast`` (what dt_proj reads) and the casts on ``chain`` below it change x_proj's
    first columns: the last dtype, after each rounding on the way (``dt.bfloat16().float()``), and
    whether a cast is a copy (``dt.to(torch.bfloat16, copy=True)``, which x_dt_proj does not read
    through as it reads a copy in dt's own dtype)."""
    def copy(node: torch.fx.Node) -> bool:
        return node.kwargs.get("copy") is True

    rounded = [f"rounded to {dtype_of(n)} by {n.name}{' (a copy)' if copy(n) else ''}" for n in reversed(chain)
               if is_cast(n) and not is_lossless_cast(dtype_of(n.args[0]), dtype_of(n))]
    return " and ".join([*rounded, f"{'copied' if copy(cast) else 'cast'} to {dtype_of(cast)}"])


def _tensor_split_leading(split: torch.fx.Node, piece: int) -> Optional[tuple[torch.fx.Node, int]]:
    """``(x_dbl, R)`` when piece ``piece`` of ``torch.tensor_split`` along the last axis is
    x_dbl's first R columns: a piece from index 0 (the first one, or one after empty pieces:
    ``tensor_split(x_dbl, [0, R, R + N])``), or, for a number of sections s of a width W, the
    first piece's W // s (+1 when s does not divide W); else None."""
    args = named_args(split, ("input", "sections", "dim"))
    source = args.get("input", args.get("self"))
    # Its overloads name the second argument ``indices``, ``sections`` or ``tensor_indices_or_sections``.
    sections = next((args[k] for k in ("sections", "indices", "indices_or_sections", "tensor_indices_or_sections")
                     if k in args), None)
    if not isinstance(source, torch.fx.Node) or not _last_axis(args.get("dim", 0), source):
        return None
    width = shape_of(source)[-1]
    if not isinstance(width, int):
        return None
    if isinstance(sections, (list, tuple)):
        # Pieces are x[..., i_{k-1}:i_k] with i_{-1} = 0, each index read as a slice bound: a
        # negative one counts from the end, and all are clamped to [0, W] (``[0, -2 * N, -N]``,
        # probe CQ).
        bounds = [0, *sections]
        if piece >= len(sections) or not all(_is_int(i) for i in bounds[:piece + 2]):
            return None
        start, stop = (min(max(i + width if i < 0 else i, 0), width) for i in bounds[piece:piece + 2])
        return (source, stop) if start == 0 and 0 < stop < width else None
    if piece == 0 and _is_int(sections) and sections > 1:
        return source, width // sections + (1 if width % sections else 0)
    return None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _value_copy(node: Any) -> bool:
    """``node`` gives back its input's values in the same dtype, device and shape, with the
    identity as its gradient: ``dt.clone()``, ``torch.clone(dt)``, ``dt.to(dt.dtype,
    copy=True)``, ``dt.to(memory_format=...)``, ``dt.float()`` of an fp32 dt. (``dt.detach()``
    has the values but no gradient: not one.)"""
    if not (is_method(node, *_COPY_METHODS) or is_call(node, torch.clone)) or not node.args:
        return False
    src, out = node.args[0], val(node)
    if not isinstance(src, torch.fx.Node) or not isinstance(out, torch.Tensor) or set(node.kwargs) - _COPY_KEYWORDS:
        return False
    if any(isinstance(a, torch.fx.Node) for a in [*node.args[1:], *node.kwargs.values()]):
        return False  # ``dt.to(other)``: other's dtype and device, read from a tensor
    v = val(src)
    return (isinstance(v, torch.Tensor) and v.dtype == out.dtype and v.device == out.device
            and same_sizes(v.shape, out.shape))


def _cat_head(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """``t`` when ``node`` is the first R columns of a cat along the last axis whose first operand
    ``t`` is R columns wide, in the cat's dtype (``torch.cat([dt, B], -1)[..., :R]``): those
    columns are t's values, and their gradient is t's; else None."""
    found = _leading_columns(node)
    cat = found[0] if found is not None else None
    if not is_call(cat, *_CATS):
        return None
    args = named_args(cat, ("tensors", "dim"))
    tensors = args.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors or not _last_axis(args.get("dim", 0), cat):
        return None
    head = tensors[0]
    head_val, cat_val = val(head) if isinstance(head, torch.fx.Node) else None, val(cat)
    if not isinstance(head_val, torch.Tensor) or head_val.dtype != cat_val.dtype or head_val.dim() != cat_val.dim():
        return None
    return head if _is_int(head_val.shape[-1]) and head_val.shape[-1] == found[1] else None


def _read_through_copies(node: torch.fx.Node, allow_casts: bool = False) -> tuple[Layout, list[torch.fx.Node]]:
    """``layout_source(node)`` followed on through value copies (``_value_copy``) and a cat's
    leading operand (``_cat_head``), with the nodes passed on the way (views, copies, the cat and
    the piece of it read), for the context and in-place write checks."""
    perm = tuple(range(len(shape_of(node) or ())))
    chain: list[torch.fx.Node] = []
    lossless = True
    while True:
        top = layout_source(node, allow_casts=allow_casts)
        perm, lossless = tuple(top.perm[p] for p in perm), lossless and top.lossless
        chain += view_chain(node, top.base)
        head = _cat_head(top.base)
        # A cast that is a copy (``dt.to(torch.bfloat16, copy=True)``), which ``layout_source`` does
        # not follow, changes the values as a cast does.
        if _value_copy(top.base) or (allow_casts and is_cast(top.base)):
            chain.append(top.base)
            node = top.base.args[0]
        elif head is not None:
            chain += [top.base, _leading_columns(top.base)[0]]
            node = head
        else:
            return Layout(top.base, perm, lossless), chain


def _kept_apart(chain: list[torch.fx.Node]) -> Optional[torch.fx.Node]:
    """The copy on ``chain`` that keeps what dt_proj saves for its backward apart from memory the
    caller holds (``protects_saved_input``; a cat copies its leading operand), else None."""
    for node in chain:
        if _value_copy(node) and protects_saved_input(node):
            return node
        if is_call(node, *_CATS) and grad_enabled_at(node) and storage_of(
                named_args(node, ("tensors",))["tensors"][0]) in caller_storages(node.graph):
            return node
    return None


def match(scan: torch.fx.Node) -> Site | str | None:
    """The site if the scan's Δ is dt_proj of x_proj's first R columns and the rewrite is sound;
    a near-miss reason; or None (Δ is not such a product: nothing to say)."""
    delta = scan_args(scan)["delta"]
    if not isinstance(delta, torch.fx.Node):
        return None
    dt_proj = _value_source(delta)
    # ``W @ dt.t()`` reads both ways: as mamba_simple's rows product of the weight, and as
    # ``x @ w.t()`` with W as x. The reading whose low-rank operand is x_dbl's first columns holds.
    symbolic = None
    for rows_product, dt_args in ((False, _linear(dt_proj)), (True, _rows_product(dt_proj))):
        if dt_args is None:
            continue
        low, dt_weight = dt_args
        if not isinstance(low, torch.fx.Node) or not isinstance(dt_weight, torch.fx.Node):
            continue
        top, chain = _read_through_copies(low)
        if top.perm != ((1, 0) if rows_product else tuple(range(len(top.perm)))):
            continue
        columns = _leading_columns(top.base)
        if columns is not None:
            break
        symbolic = symbolic or _symbolic_columns(top.base)
    else:
        return (_later_piece(dt_proj, _axis_names(delta, dt_proj)) or symbolic or _deep_function(dt_proj)
                or _per_head_products(dt_proj) or _function_of_dt_proj(dt_proj))
    x_dbl, rank = columns
    x_args = _linear(x_dbl)
    if x_args is None:
        return (is_call(x_dbl, *_CATS) and _cat_piece(x_dbl, len(shape_of(x_dbl)) - 1, 0, rank, {})
                or _not_x_proj(x_dbl, rank))
    x, x_weight = x_args
    tensors = [x, x_weight, x_dbl, low, dt_weight, dt_proj]
    values = [val(t) if isinstance(t, torch.fx.Node) else None for t in tensors]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return "an input of x_proj/dt_proj has no fake value"
    wx, wdt = values[1], values[4]
    # R = 0 (``x_dbl.split([0, N, N])``: dt_proj of no columns is its bias alone) is no product the
    # op computes; the op would refuse it inside the pass (probe CQ).
    if (values[0].dim() < 2 or wx.dim() != 2 or wdt.dim() != 2 or wdt.shape[1] != rank
            or not 1 <= rank < wx.shape[0]):
        return None
    dtypes = {v.dtype for v in values}
    if len(dtypes) == 1 and next(iter(dtypes)) not in _FLOATS:
        return (f"x_proj/dt_proj run in {next(iter(dtypes))}: the op takes fp32, bf16 or fp16 (its kernel "
                "accumulates in fp32), so the two products stay as they are")
    if len(dtypes) != 1:
        return (f"x_proj/dt_proj mix dtypes ({', '.join(sorted(str(d) for d in dtypes))}): a cast or an "
                "autocast region sets a product's precision, which the op would not reproduce")
    nodes = [x_dbl, top.base, *chain]
    refusal = context_refusal(scan.graph, [x_dbl, *nodes, dt_proj], anchor=x_dbl)
    if refusal is not None:
        return refusal
    copy = _kept_apart(chain)
    if copy is not None:
        return (f"{copy.name} copies the columns dt_proj reads, and {x_dbl.name}'s memory is returned (itself or "
                "a view): the caller may write it before the backward, which would read ssm.x_dt_proj's saved "
                f"{x_dbl.name} where eager's reads the copy, so the two products stay as they are")
    order = node_order(scan.graph)
    if order[dt_weight] > order[x_dbl]:
        return "dt_proj's weight is computed after x_proj: dt cannot be computed where x_proj runs"
    # The op reads the weights and x_dbl's columns where x_proj runs, past what the user's code
    # read them through: a copy (``W.t().contiguous()``, ``dt.clone()``, a cat of dt) or a view.
    # A write to any of them (``dt = dt.clone(); dt.mul_(2)``), or to a weight after the copy
    # was made, is one the op would not see.
    followed = [*chain, *_weight_views(x_dbl), *_weight_views(dt_proj)]
    writer = written_in_place(scan.graph, [x_dbl, dt_weight, x_weight, *followed])
    if writer is not None:
        return (f"{writer.name} writes in place to x_proj's output, a weight or a copy or view of them the "
                "products read: dt, computed where x_proj runs, would read them at another point than the "
                "user's code did")
    return Site(x_dbl, dt_proj, x, x_weight, dt_weight, nodes, rows_product)


def _not_x_proj(x_dbl: torch.fx.Node, rank: int) -> str:
    """Why dt_proj's low-rank input, the first ``rank`` columns of ``x_dbl``, is not read from a
    product the op computes (a forward hook that rescales x_proj's output lands here)."""
    if is_call(x_dbl, *LINEAR_TARGETS) and named_args(x_dbl, ("input", "weight", "bias")).get("bias") is not None:
        what = "adds a bias"
    elif is_call(x_dbl, operator.getitem) and isinstance(x_dbl.args[0], torch.fx.Node):
        what = f"is a piece of {target_name(x_dbl.args[0])}, not a bias-free linear of x"
    else:
        what = f"is {target_name(x_dbl)}, not a bias-free linear of x"
    return (f"dt_proj reads the first {rank} columns of {x_dbl.name}, which {what}: ssm.x_dt_proj computes "
            "only the two bias-free products, so x_proj and dt_proj stay as they are")


def _value_source(node: torch.fx.Node) -> torch.fx.Node:
    """The first node back from ``node`` that is not a view, reshape or cast of its input: Δ's
    producer, up to steps that keep its values."""
    while True:
        base = layout_source(node).base
        source = base.args[0] if base.args else None
        if ((is_method(base, "reshape", "view") or is_call(base, torch.reshape)) and isinstance(source, torch.fx.Node)
                and isinstance(val(source), torch.Tensor) and isinstance(val(base), torch.Tensor)
                and val(source).dtype == val(base).dtype):  # not .view(dtype), which reinterprets bits
            node = source
            continue
        return base


def _rows_product(node: torch.fx.Node) -> Optional[tuple[Any, Any]]:
    """``(T, W)`` when ``node`` is ``W @ T`` of two 2-D tensors (mamba_simple's
    ``dt_proj.weight @ dt.t()``), else None; the caller checks that T is dt_low transposed."""
    product = weight_product(node, lambda dims: dims == 2, torch.mm)
    return None if product is None else product[::-1]


def _rewrite(gm: torch.fx.GraphModule, ctx: PassContext, scan: torch.fx.Node, site: Site) -> None:
    graph = gm.graph
    with graph.inserting_before(site.x_proj):
        op = graph.call_function(torch.ops.ssm.x_dt_proj.default, (site.x, site.x_weight, site.dt_weight))
        propagate_val(op)
        x_dbl = graph.call_function(operator.getitem, (op, 0))
        propagate_val(x_dbl)
        dt = graph.call_function(operator.getitem, (op, 1))
        propagate_val(dt)
        if site.rows_product:
            # W_dt @ dt_low^T is the op's (rows, dim) dt transposed: the same values, as a view.
            dt = graph.call_method("t", (dt,))
            propagate_val(dt)
    site.dt_proj.replace_all_uses_with(dt)
    site.x_proj.replace_all_uses_with(x_dbl)
    graph.erase_node(site.dt_proj)
    graph.erase_node(site.x_proj)
    wx, wdt = val(site.x_weight), val(site.dt_weight)
    ctx.rewrite(FAMILY, ("W_dt @ x_dbl[:, :R].t()" if site.rows_product else "linear(x_dbl[..., :R], W_dt)")
                + " of x_dbl = linear(x, W_x)",
                [site.x_proj, *site.nodes[1:], site.dt_proj], "ssm.x_dt_proj.default",
                {"R": wdt.shape[1], "x_dbl_cols": wx.shape[0], "dim": wdt.shape[0], "runs": _runs(site)})


def _runs(site: Site) -> str:
    """What the op will run at this site, for ``explain`` (the op decides per call)."""
    from ssm_compile.kernels.x_dt_proj import triton_x_dt_proj

    x, wx, wdt = val(site.x), val(site.x_weight), val(site.dt_weight)
    if x.device.type != "cuda":
        return f"the two products ({x.device.type})"
    if not all(isinstance(s, int) for s in x.shape):
        return "decided per call (symbolic rows)"
    if triton_x_dt_proj.supported(x, wx, wdt):
        return "the Triton kernel"
    return (f"the two products (the kernel takes >= {triton_x_dt_proj.MIN_ROWS} rows, R <= "
            f"{triton_x_dt_proj.MAX_RANK_PAD}, 2N <= {triton_x_dt_proj.MAX_BC_PAD})")


def x_dt_proj_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    from ssm_compile.kernels.x_dt_proj.op import register

    for scan in scan_nodes(gm.graph):
        site = match(scan)
        if site is None:
            continue
        if isinstance(site, str):
            ctx.miss(FAMILY, site, [scan])
            continue
        register()
        _rewrite(gm, ctx, scan, site)


def register(pm: PassManager) -> None:
    pm.add(FAMILY, x_dt_proj_pass)
