"""Families ``state_update`` and ``conv_update``: the single-token decode step -> the decode ops.

During ``generate()`` HF Mamba (transformers 5.17 and 5.24 alike) runs, per layer and token, the
torch fallbacks of ``causal_conv1d_update`` and ``mamba_selective_state_update``. The cache
tensors (``cache.layers[i].conv_states[0]`` / ``recurrent_states[0]``: what 5.24's
``get_conv_state`` / ``get_recurrent_state`` return and 5.17 reads directly) reach the decode
graph as placeholders (``L_kwargs_cache_layers_0_conv_states_0_``) that the graph mutates with
``copy_``; the cache object itself only shows up in dynamo's guards (``has_previous_state``),
so the decode graph is compiled once and reused for every token. Dynamo captures, per layer:

conv_update::

    hs = torch.cat([conv_state, x], dim=-1).to(w.dtype)          # (batch, dim, S + T)
    conv_state.copy_(hs[:, :, -S:])                               # roll the window
    y = torch.conv1d(hs, w.unsqueeze(1), bias, padding=0, groups=dim)[:, :, -T:]
    y = F.silu(y).to(x.dtype)                                     # activation, cast optional

state_update::

    dt = softplus(dt + dt_bias.to(dt.dtype))                      # bias, softplus optional
    dA = torch.exp(dt.float()[..., None] * A.float())
    dBx = dt.float()[..., None] * B.float()[:, None, :] * x.float()[..., None]
    h = state.float() * dA + dBx
    state.copy_(h.to(state.dtype))
    y = torch.matmul(h.to(C.dtype), C.unsqueeze(-1)).squeeze(-1)  # or (h * C[:, None, :]).sum(-1)
    y = ((y + x * D) * F.silu(z)).to(x.dtype)                     # skip, gate, cast optional

Other code spells the same steps differently, so both families match what a step computes:

* state_update: the new state ``h = read(state) * decay + addend`` (also ``torch.addcmul``) is
  written with ``state.copy_(h)``, with ``state.mul_(dA).add_(dBx)`` (or ``*=``/``+=``), or not
  at all (a step that returns its new state: the op then updates a clone). The decay and the
  input term are proved with ``discretize.index_term``, the evaluator the scan passes use:
  ``decay == exp(dt[b, c] · A[c, n])`` and ``addend == dt[b, c] · B[b, n] · x[b, c]`` with the same
  dt, whatever mix of ``[..., None]``/``unsqueeze``/einsum/casts spells it; B may be a user's
  product (Jamba's normed B) or grouped (``repeat_interleave`` over channels). The readout is any
  ``y[b, c] = Σ_n h[b, c, n] · C[b, n]`` (matmul, einsum, mul-sum) of ``h`` or of the state read
  back after the write (mamba_ssm's ``selective_state_update_ref``). The channel c is one axis
  (dim), or two (heads, headdim) that the op takes flattened: mamba_ssm's layout with a heads
  axis is Mamba-1 with dim = heads * headdim per (head, channel) pair.
* conv_update, window forms: the state is rolled by ``conv_state.copy_(torch.roll(conv_state,
  -1, -1)); conv_state[..., -1] = x`` (mamba_simple's ``step``), by ``conv_state.copy_(torch.cat(
  [conv_state[..., 1:], x[..., None]], -1))``, or that cat is returned instead of written
  (mamba.py's ``step``: the op then updates a clone). The output is ``Σ_k w[d, k] · window[b, d, k]``
  (mul-sum or einsum, ``+ b``) of a window of W = S inputs, or ``conv1d(cat([conv_state, x]), w,
  b, padding=P)[..., t]`` at the t whose taps are the last W inputs.

Each rewrite emits one op at the place of the pattern's last node, so the op's single read and
write of the state lands later than the original ones. That is sound only if nothing else
touches the state: the check functions demand that the state's only users are the pattern's
read, its writes and its one readout after them, and that nothing reads the state's memory
through another alias between the step's write and the op. The op also reads x, dt, A, B, C,
D, z and the weights later than the step did: nothing may write their memory (through any view
or aliasing input, ``out=`` included) between the step's first read and the op. Casts are
looked through: the ops accumulate in fp32, which is at least as precise as any cast chain they
replace (each rewrite records the casts it dropped).

The prefill step is not handled here: its ``mamba_selective_scan(..., return_last_state=True)``
is the scan passes' pattern (they emit ``ssm.selective_scan(..., return_last_state=True)``), and
``update_recurrent_state(final_state)`` / ``update_conv_state`` stay plain ``copy_``s into the
cache, whose tensors the prefill graph creates itself (``torch.zeros``) unless the caller
allocated them beforehand (needed for CUDA graphs, see ``examples/generate.py``).
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Any, Callable, Iterator

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .delta import ADD_TARGETS, MUL_TARGETS, SUB_TARGETS, SignedSum, binary_operands, exact_sum, signed_sum
from .discretize import Factor, IndexTerm, grouped_source, index_term, product_parts, two_sides
from .fx_utils import (INPLACE_OPERATORS, addcmul_operands, bare_name, context_refusal, depthwise_weight,
                       dropped_rounding, exp_behind, exp_node_behind, is_call, is_cast, is_exp, is_lossless_cast,
                       is_metadata, is_method, is_ssm_op, is_zeros, mutates, named_args, node_order, op_region,
                       pinned_int, propagate_val, silu_input, storage_of, target_name, time_slice, val, written_args,
                       written_in_place)
from .manager import PassContext, PassManager
from .scan_loop import DEEP_STEP, ONE_STEP, decay_computed_in_step

STATE_FAMILY = "state_update"
CONV_FAMILY = "conv_update"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_N = 256
MIN_W, MAX_W = 2, 8

_CAST_METHODS = ("float", "double", "to", "half", "bfloat16", "type", "type_as")
_MUL = (operator.mul, torch.mul)
_SOFTPLUS = (F.softplus, torch.nn.functional.softplus, torch._C._nn.softplus)
class Miss(Exception):
    """A near-miss: the anchor looked like a decode step but a proof step failed."""


def _proved(ctx: PassContext, family: str, anchor: torch.fx.Node, match: Callable[[], Any],
            check: Callable[[Any], str | None]) -> Any:
    """``match()``'s result once ``check`` accepts it; None when there is nothing to rewrite.

    A ``Miss`` raised by the matcher and a reason returned by the check are both recorded as a
    near-miss at ``anchor``; a matcher returning None (not a decode step at all) records nothing.
    """
    try:
        m = match()
    except Miss as miss:
        ctx.miss(family, str(miss), [anchor])
        return None
    if m is None:
        return None
    reason = check(m)
    if reason is not None:
        ctx.miss(family, reason, [anchor])
        return None
    return m


# ---------------------------------------------------------------------------------------------
# Small structural helpers
# ---------------------------------------------------------------------------------------------

def _tensor(node: Any) -> torch.Tensor | None:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def _records_grad(nodes: list[Any]) -> str | None:
    """Why the step must stay as written when autograd records through it, or None.

    The decode ops are inference-only (their backward refuses by name): a step whose values
    require grad, training through an unrolled decode loop say, keeps its own ops."""
    for n in nodes:
        t = _tensor(n)
        if t is not None and t.requires_grad:
            return (f"{n.name} requires grad: gradients flow through this step, and the decode ops are "
                    "inference-only")
    return None


def _same(a: Any, b: Any) -> bool:
    # Sizes may be SymInts under dynamic shapes: equal only if provably so.
    return statically_known_true(a == b)


def _record(size: Any) -> int | str:
    """A size for a rewrite record without guarding on it (``int()`` of a SymInt specializes it)."""
    n = pinned_int(size)
    return n if n is not None else str(size)


def _same_shape(a: Any, shape: tuple) -> bool:
    t = _tensor(a)
    return t is not None and t.dim() == len(shape) and all(_same(x, y) for x, y in zip(t.shape, shape))


def _is_cast(node: Any) -> bool:
    """A float-to-float dtype conversion that keeps shape and device (``.float()``, ``.to(dtype)``)."""
    if not is_method(node, *_CAST_METHODS) or not node.args:
        return False
    src, out = _tensor(node.args[0]), _tensor(node)
    return (src is not None and out is not None and src.device == out.device
            and tuple(src.shape) == tuple(out.shape)
            and src.dtype.is_floating_point and out.dtype.is_floating_point)


def _is_cast_of(node: Any, src: Any) -> bool:
    """``node`` casts ``src`` (not merely uses it, as ``.to(other)`` uses ``other`` for its dtype)."""
    return _is_cast(node) and node.args[0] is src


def _peel(node: Any) -> tuple[Any, list[torch.fx.Node]]:
    """Follow casts back to their source: (source, the casts passed, outermost first)."""
    casts = []
    while _is_cast(node):
        casts.append(node)
        node = node.args[0]
    return node, casts


def _sum_operands(node: Any, inplace: bool = False) -> tuple[Any, Any] | None:
    """The two summands of an exact sum (``+``, ``torch.add``, ``.add``, and ``alpha`` where it
    rounds nothing: ``torch.add(.., alpha=1)``, ``torch.sub(.., alpha=-1)``), else None. With
    ``inplace``, ``a += b`` too."""
    if inplace and is_call(node, operator.iadd) and len(node.args) == 2 and not node.kwargs:
        return node.args[0], node.args[1]
    rsub = _rsub(node)
    if rsub is not None:
        return (rsub.left, rsub.right) if exact_sum(rsub) else None
    return binary_operands(node, ADD_TARGETS)


def _rsub(node: Any) -> SignedSum | None:
    """``torch.rsub(a, b, alpha=k)`` = b - k·a, read as the difference it is, else None."""
    if is_call(node, torch.rsub) and len(node.args) == 2 and not set(node.kwargs) - {"alpha"}:
        return SignedSum(node.args[1], node.args[0], True, node.kwargs.get("alpha", 1))
    return None


def _operands(node: Any, targets: tuple, method: str) -> tuple[Any, Any] | None:
    """The two operands of a binary ``targets``/``.method`` node without extra args, else None."""
    if is_call(node, *targets) or is_method(node, method):
        if len(node.args) == 2 and not node.kwargs:
            return node.args[0], node.args[1]
    return None


def _unsqueezed(node: Any, axis: int) -> Any | None:
    """The tensor that ``node`` unsqueezes at ``axis`` (``t[..., None]``, ``t[:, None]``, ``t.unsqueeze(axis)``).

    ``axis`` is -1 (append) or 1 (after batch). Casts around are looked through.
    """
    node, _ = _peel(node)
    out = _tensor(node)
    if out is None or not isinstance(node, torch.fx.Node):
        return None
    src = None
    if is_method(node, "unsqueeze") or is_call(node, torch.unsqueeze):
        src = node.args[0]
    elif is_call(node, operator.getitem) and any(i is None for i in _as_tuple(node.args[1])):
        src = node.args[0]
    s = _tensor(src)
    if s is None or out.dim() != s.dim() + 1:
        return None
    expected = list(s.shape)
    expected.insert(axis if axis >= 0 else len(expected), 1)
    if not all(_same(a, b) for a, b in zip(out.shape, expected)):
        return None
    # Shapes agree; also make sure it is a pure view (no stride, no reversal) by the index form.
    if is_call(node, operator.getitem) and not all(i is None or i is Ellipsis or i == slice(None)
                                                    for i in _as_tuple(node.args[1])):
        return None
    if (is_method(node, "unsqueeze") or is_call(node, torch.unsqueeze)) and node.args[1] not in (
            axis, axis + s.dim() + 1 if axis < 0 else axis - s.dim() - 1):
        return None
    return _peel(src)[0]


def _as_tuple(index: Any) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def _single_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _follow_casts(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """Walk forward through single-user casts: (last node, the casts walked)."""
    casts = []
    while True:
        nxt = _single_user(node)
        if nxt is None or not _is_cast_of(nxt, node):
            return node, casts
        casts.append(nxt)
        node = nxt


def _narrowing(casts: list[torch.fx.Node]) -> list[str]:
    """Casts that round (to a dtype narrower than their input): the op computes these in fp32."""
    out = []
    for c in casts:
        src, dst = _tensor(c.args[0]).dtype, _tensor(c).dtype
        if torch.finfo(dst).bits < torch.finfo(src).bits or (dst != src and torch.finfo(dst).bits == 16):
            out.append(f"{c.name}:{src}->{dst}".replace("torch.", ""))
    return out


def _rounding_refusal(sources: list[Any], sinks: list[Any], last: torch.fx.Node,
                      order: dict[torch.fx.Node, int], dropped: list | None = None) -> str | None:
    """Why the op, reading ``sources`` and standing for ``sinks``, would drop a rounding the step
    makes (``fx_utils.dropped_rounding``: only one no finer than the op's inputs may go), or None.

    The casts that end the step at ``last`` stay the program's: the op's output is cast to
    ``last``'s dtype, the same rounding, as long as none of them rounds finer than that dtype.
    """
    out_dtype, trailing, node = _tensor(last).dtype, set(), last
    while is_cast(node) and is_lossless_cast(out_dtype, _tensor(node).dtype):
        trailing.add(node)
        node = node.args[0]
    region = [n for n in op_region(sources, [s for s in sinks if s is not None], order, values_only=True)
              if n not in trailing]
    if dropped is not None:
        # What the op computes without the program's roundings, for its record.
        dropped.extend(n for n in region if is_cast(n))
    return dropped_rounding(region, sources)


def _widen_for(graph: torch.fx.Graph, x: torch.fx.Node, out_dtype: torch.dtype) -> torch.fx.Node:
    """``x`` cast up to ``out_dtype`` when that is wider, so the op's output (x's dtype) loses nothing."""
    xd = _tensor(x).dtype
    if xd == out_dtype or torch.finfo(out_dtype).bits <= torch.finfo(xd).bits:
        return x
    wide = graph.call_method("to", (x, out_dtype))
    propagate_val(wide)
    return wide


def _cast_to(graph: torch.fx.Graph, node: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    if _tensor(node).dtype == dtype:
        return node
    out = graph.call_method("to", (node, dtype))
    propagate_val(out)
    return out


def _copy_into(node: torch.fx.Node) -> torch.fx.Node | None:
    """The ``target.copy_(node)`` that ``node`` (through casts) feeds, if any."""
    for user in node.users:
        if _is_cast_of(user, node):
            found = _copy_into(user)
            if found is not None:
                return found
        elif is_method(user, "copy_") and len(user.args) == 2 and user.args[1] is node:
            return user
    return None


# ---------------------------------------------------------------------------------------------
# In-place writes between the user's reads and the op's
# ---------------------------------------------------------------------------------------------
#
# Each op is emitted at the end of the pattern it replaces, so it reads its inputs there, after
# the user's code read them, and writes its state there, after the user's code wrote it. A write
# in between to an input's memory (``dt.mul_(2)``, ``x[...] = v``, ``F.silu(z, True)``, a write
# to the tensor an input is a view of, or to a second input aliasing it) would change what the op
# sees; a read of the state's memory in between (through an alias the state's users do not show)
# would see the state before the op's write. Either way the rewrite is refused.

def _ancestors(*nodes: torch.fx.Node) -> set[torch.fx.Node]:
    """``nodes`` (a step's output and its writes) and every node they are computed from: where the
    step's own reads of its inputs are."""
    seen, stack = set(), [n for n in nodes if n is not None]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _between(order: dict[torch.fx.Node, int], start: int, end: int) -> Iterator[torch.fx.Node]:
    """The nodes strictly after order ``start`` and strictly before order ``end`` (``order`` lists
    the graph's nodes in order, so this walks only up to ``end``)."""
    return itertools.islice(order, start + 1, max(start + 1, end))


def _written_between(node: torch.fx.Node, order: dict[torch.fx.Node, int], start: int, end: int,
                     own: tuple = ()) -> torch.fx.Node | None:
    """The first node between orders ``start`` and ``end`` (not one of ``own``, the writes the op
    replaces) that writes in place to memory ``node``'s value lives in; unknown storages count as
    shared."""
    storage = storage_of(node)
    for n in _between(order, start, end):
        if n in own:
            continue
        written = [storage_of(a) for a in written_args(n) if isinstance(val(a), torch.Tensor)]
        if written and (storage is None or any(w is None or w == storage for w in written)):
            return n
    return None


def _read_between(node: torch.fx.Node, order: dict[torch.fx.Node, int], start: int, end: int,
                  allowed: set) -> torch.fx.Node | None:
    """The first node between orders ``start`` and ``end``, not in ``allowed``, that takes a value
    living in ``node``'s memory (a view or alias of it, whatever input it came in by)."""
    storage = storage_of(node)
    for n in _between(order, start, end):
        if n in allowed or n.op == "output":
            continue
        shared = [storage_of(a) for a in n.all_input_nodes if isinstance(val(a), torch.Tensor)]
        if any(s is None or storage is None or s == storage for s in shared):
            return n
    return None


def _inputs_written(inputs: dict[str, Any], scope: set[torch.fx.Node], order: dict[torch.fx.Node, int],
                    end: int) -> str | None:
    """Why the op, reading ``inputs`` at order ``end``, would see other values than the step's
    reads of them (the earliest of their users in ``scope``); None if it would not."""
    for name, node in inputs.items():
        if not isinstance(node, torch.fx.Node):
            continue
        start = min((order[u] for u in node.users if u in scope and u in order), default=end)
        writer = _written_between(node, order, start, end)
        if writer is not None:
            return (f"{writer.name} writes {name} ({node.name}) in place after the step reads it and before the "
                    "op would: the op would read the written value")
    return None


def _intermediates_written(inputs: list[Any], step: set[torch.fx.Node], outputs: list[torch.fx.Node],
                           state: torch.fx.Node, order: dict[torch.fx.Node, int]) -> str | None:
    """Why the op, which computes the step's values (softplus(dt + b), exp(dt·A), dt·B·x, the
    gate) from ``inputs`` itself, would miss a write to one of them: a mutating node before the
    last of ``outputs`` that is no node of ``step`` (the outputs' ancestors; ``dA[:, 0].mul_(2)``,
    ``g.detach().zero_()``) and writes memory such a value lives in. The state's own memory is
    ``_state_moved``'s to check. None if there is no such write."""
    computed = step - _ancestors(*[n for n in inputs if isinstance(n, torch.fx.Node)])
    # Views of the inputs (``B.unsqueeze(1)``) share the inputs' memory, which the op reads where
    # it runs; a write to it is ``_inputs_written``'s (between the step's read and the op) to judge.
    storages = ({storage_of(n) for n in computed if isinstance(val(n), torch.Tensor)}
                - {storage_of(n) for n in inputs if isinstance(n, torch.fx.Node)} - {None, storage_of(state)})
    end = max(order[n] for n in outputs if n is not None)
    for node in _between(order, -1, end):
        if node in step or not mutates(node):
            continue
        written = {storage_of(a) for a in written_args(node) if isinstance(val(a), torch.Tensor)}
        if written & storages:
            return (f"{node.name} writes in place to a value the step computes (through a view or an alias): "
                    "the op computes that value itself and would not see the write")
    return None


def _state_moved(state: torch.fx.Node, order: dict[torch.fx.Node, int], read: int, written: int, end: int,
                 own: tuple, allowed: set, what: str) -> str | None:
    """Why moving the state's read (order ``read``) and write (the ``own`` writes, the first at
    order ``written``) to the op at order ``end`` would change an answer; None if it would not."""
    writer = _written_between(state, order, read, end, own)
    if writer is not None:
        return (f"{writer.name} writes the {what}'s memory between the step's read of it and the op: the op "
                "would read the written value")
    reader = _read_between(state, order, written, end, allowed | set(own))
    if reader is not None:
        return (f"{reader.name} reads the {what}'s memory between the step's write and the op: it would see "
                "the old value")
    return None


# ---------------------------------------------------------------------------------------------
# state_update
# ---------------------------------------------------------------------------------------------

# The roles of the state's axes: the op's layout (batch, dim, N), or mamba_ssm's with a heads
# axis (batch, heads, headdim, N), which is the same recurrence per (head, channel) pair: the op
# takes it as dim = heads * headdim channels.
_STATE_ROLES = {3: ("b", "d", "n"), 4: ("b", "h", "p", "n")}
_ROLE_NAMES = {"b": "batch", "d": "dim", "h": "heads", "p": "headdim", "n": "state", "1": "size-1", "?": "other"}


def _roles(state: torch.fx.Node) -> tuple[str, ...]:
    return _STATE_ROLES[_tensor(state).dim()]


@dataclasses.dataclass
class Update:
    """Where a step writes ``h = read(state) * decay + addend`` and how.

    ``form`` is ``"copy_"`` (``state.copy_(h)``), ``"in-place"`` (``state.mul_(decay).add_(addend)``,
    also as two statements or ``*=`` / ``+=``:
    ``h`` is None, the state itself holds the new value) or ``"returned"`` (``h`` is a new tensor
    and the state is not written: the op then updates a clone). ``reader`` is the node that reads
    the old state; ``writes`` are the in-place nodes the op replaces.
    """

    form: str
    state: torch.fx.Node
    h: torch.fx.Node | None
    reader: torch.fx.Node
    read_casts: list[torch.fx.Node]
    decay: Any
    addend: Any
    writes: list[torch.fx.Node]


def _split_update(h: Any, is_state) -> tuple[torch.fx.Node, torch.fx.Node, list, Any, Any] | None:
    """Read ``h`` as ``read(state) * decay + addend``: (state, reader, read casts, decay, addend).

    ``h`` is ``a * b + c`` in any order of the sum and of the product, or ``torch.addcmul(c, a, b)``
    (value 1, the same sum of products). ``is_state(node)`` says which operand may be the state.
    """
    candidates = []
    fused = addcmul_operands(h)
    if fused is not None:
        candidates.append((h, fused[1:], fused[0]))
    terms = _sum_operands(h)
    if terms is not None:
        for a, b in (terms, terms[::-1]):
            product = _peel(a)[0]
            factors = _operands(product, _MUL, "mul")
            if factors is not None:
                candidates.append((product, factors, b))
    for product, factors, addend in candidates:
        for s_read, decay in (factors, factors[::-1]):
            src, casts = _peel(s_read)
            if is_state(src):
                return src, (casts[-1] if casts else product), casts, decay, addend
    return None


def _inexact_update(h: Any, state: torch.fx.Node) -> str | None:
    """Why not, when ``h`` is a sum or difference of a product that reads ``state`` and another
    term that is not the plain sum state * dA + dBx (``torch.sub(state * dA, dBx, alpha=2)``,
    ``state * dA - dBx``). None otherwise."""
    s = signed_sum(h) or _rsub(h)
    if s is None or exact_sum(s):
        return None
    reads_state = [x for x in (s.left, s.right)
                   if (pair := _operands(_peel(x)[0], _MUL, "mul")) is not None
                   and any(_peel(f)[0] is state for f in pair)]
    if not reads_state:
        return None
    a, b = (x.name if isinstance(x, torch.fx.Node) else repr(x) for x in (s.left, s.right))
    scaled = f"{s.alpha}·{b} (its alpha={s.alpha})" if s.alpha != 1 else b
    return (f"the new state {h.name} computes {a} {'-' if s.sub else '+'} {scaled}, not the update "
            "state * dA + dBx: the op adds dBx to the decayed state")


def _is_state(node: Any) -> bool:
    t = _tensor(node)
    return isinstance(node, torch.fx.Node) and t is not None and t.dim() in _STATE_ROLES


def _is_graph_input(node: Any) -> bool:
    # A state that comes from outside the graph: a decode step's cache, or its rows gathered by
    # index. Inside an unrolled loop the state is an intermediate, and a step of it is the scan
    # passes' business unless the step computes its own decay (``_is_step_state``).
    return _is_state(node) and (node.op in ("placeholder", "get_attr") or _gathered(node))


def _new_state_of(node: Any, op_name: str) -> bool:
    """``node`` is the new state (output 1) of a functional decode op named ``op_name``, which
    this pass emitted for an earlier step that returned its new state."""
    if not is_call(node, operator.getitem) or node.args[1] != 1:
        return False
    op = node.args[0]
    return (isinstance(op, torch.fx.Node) and isinstance(op.target, torch._ops.OpOverload)
            and op.target._schema.name == op_name)


def _is_step_state(node: Any) -> bool:
    """A state a decode step may read besides a graph input: the new state an earlier step's op
    returned, or a fresh zeros tensor (mamba.py's ``h is None`` first step), as in several decode
    steps compiled in one graph (``MambaLM.generate``'s loop over ``step``). ``find_update`` also
    asks that the step compute its decay itself (``scan_loop.decay_computed_in_step``): a loop
    over time slices is the scan passes' business."""
    return _is_state(node) and (is_zeros(node) or _new_state_of(node, "ssm::selective_state_update_functional"))


def _gathered(node: Any) -> bool:
    """``pool[idx]`` or ``pool.index_select(dim, idx)`` of a graph input by an index tensor: a new
    tensor (advanced indexing copies) holding a cache pool's rows, as a continuous-batching server
    gathers each request's state (probe BW). The write back (``pool[idx] = new``,
    ``index_copy_``) is the user's, after the step."""
    if not isinstance(node, torch.fx.Node):
        return False
    def copies(i: Any) -> bool:
        # A 0-d integer index selects like an int: ``pool[torch.tensor(2)]`` is a view of the pool.
        t = _tensor(i) if isinstance(i, torch.fx.Node) else None
        return t is not None and t.dim() >= 1 and not t.is_floating_point()

    if is_call(node, operator.getitem):
        base, index = node.args[0], _as_tuple(node.args[1])
        by_tensor = any(copies(i) for i in index)
    elif is_call(node, torch.index_select) or is_method(node, "index_select"):
        base, by_tensor = node.args[0], len(node.args) == 3 and copies(node.args[2])
    else:
        return False
    return (by_tensor and isinstance(base, torch.fx.Node) and base.op in ("placeholder", "get_attr")
            and not any(_writes(user) for user in node.users))


def _equal_view(node: Any, other: torch.fx.Node) -> bool:
    """``node`` is another indexing of the same tensor with the same constant indices as ``other``."""
    return (isinstance(node, torch.fx.Node) and node is not other and node.op == other.op == "call_function"
            and node.target is other.target is operator.getitem and node.args == other.args and not node.kwargs)


def _nearest_ancestors(value: Any, limit: int) -> set[torch.fx.Node]:
    """``value`` and up to ``limit`` of its nearest ancestors, breadth first (the nodes a step's
    formula is made of; ``_linear_inside``'s depth-first walk would spend its budget on one branch)."""
    seen, frontier = set(), [value]
    while frontier and len(seen) < limit:
        node = frontier.pop(0)
        if isinstance(node, torch.fx.Node) and node not in seen:
            seen.add(node)
            frontier.extend(node.all_input_nodes)
    return seen


def _linear_inside(value: Any, state: torch.fx.Node, limit: int = 16) -> torch.fx.Node | None:
    """A node among the last ``limit`` ancestors of ``value`` that is a linear update of ``state``
    (``state * decay + addend``), or None: what a non-linear recurrence wraps (``tanh(...)``)."""
    seen, stack = set(), [value]
    while stack and len(seen) < limit:
        node = stack.pop()
        if not isinstance(node, torch.fx.Node) or node in seen:
            continue
        seen.add(node)
        if _split_update(node, lambda n: n is state) is not None:
            return node
        stack.extend(node.all_input_nodes)
    return None


def _from_ssm_op(node: Any) -> bool:
    """``node`` is an output of one of this package's ops (``getitem`` of ``ssm.selective_scan``)."""
    return is_ssm_op(node.args[0] if is_call(node, operator.getitem) else node)


def _writes(node: torch.fx.Node) -> bool:
    """``node`` writes its first argument (``copy_``, ``mul_``, ``+=``, ``t[i] = v``)."""
    return ((node.op == "call_method" and node.target.endswith("_"))
            or is_call(node, operator.setitem, *INPLACE_OPERATORS))


def _in_place(node: Any, method: str, op: Any) -> bool:
    """``node`` is ``a.method(b)`` or ``a op= b`` (``operator.iadd``), with no other arguments."""
    return ((is_method(node, method) or is_call(node, op)) and len(node.args) == 2 and not node.kwargs)


def find_update(node: torch.fx.Node, order: dict[torch.fx.Node, int]) -> Update | None:
    """The state update anchored at ``node`` (a ``copy_``, an ``add_`` or a sum), or None.

    Raises ``Miss`` for a write into a 3-D state of a function of a linear update that is not
    itself linear in the state (``state.copy_(tanh(state * dA + dBx))``).
    """
    if is_method(node, "copy_") and len(node.args) == 2 and not node.kwargs:
        state = node.args[0]
        if not _is_state(state):
            return None
        h = _peel(node.args[1])[0]
        split = _split_update(h, lambda n: n is state)
        if split is None and _from_ssm_op(h):
            # The last state of a scan the scan passes rewrote (a chunk's loop, then
            # ``self.h.copy_(h)``): a whole sequence's update, no decode step (probe BU).
            return None
        if split is None:
            twin = _split_update(h, lambda n: _equal_view(n, state))
            if twin is not None:
                raise Miss(f"the step reads the state through {twin[0].name} and writes it through {state.name}, "
                           "another view equal to it (cache[i] indexed twice): index the cache once and use that "
                           "view for both to have the step rewritten")
            if _linear_inside(h, state) is not None:
                raise Miss(f"the new state is {target_name(h)}(state * dA + ...), not the update state * dA + dBx "
                           "itself (a nonlinear function, or a rescaling the decay exp(dt * A) does not hold)")
            inexact = _inexact_update(h, state)
            if inexact is not None:
                raise Miss(inexact)
            near = _nearest_ancestors(h, limit=16)
            if state in near and any(is_exp(n) for n in near):
                raise Miss(f"the new state {target_name(h)} reads the state and a decay exp(...), but is not "
                           "state * dA + dBx: the state is masked, scaled or combined before the decay multiplies it")
            return None
        _, reader, casts, decay, addend = split
        return Update("copy_", state, h, reader, casts, decay, addend, [node])
    if _in_place(node, "add_", operator.iadd):
        mul = node.args[0]
        if not _in_place(mul, "mul_", operator.imul):
            # ``state.mul_(dA); state.add_(dBx)``: the state's use right before the add_.
            earlier = [n for n in mul.users if order[n] < order[node]] if isinstance(mul, torch.fx.Node) else []
            mul = max(earlier, key=order.__getitem__) if earlier else None
            if not (_in_place(mul, "mul_", operator.imul) and mul.args[0] is node.args[0]):
                return None
        if _is_state(mul.args[0]):
            return Update("in-place", mul.args[0], None, mul, [], mul.args[1], node.args[1], [mul, node])
        return None
    if is_call(node, *ADD_TARGETS, *SUB_TARGETS, torch.rsub, torch.addcmul) or is_method(node, "add", "sub", "addcmul"):
        split = _split_update(node, lambda n: _is_graph_input(n) or _is_step_state(n))
        if split is None:
            return None
        state, reader, casts, decay, addend = split
        if not _is_graph_input(state) and not decay_computed_in_step(_peel(decay)[0]):
            return None
        if any(_writes(user) for user in state.users):
            return None  # a step that writes its state: the copy_ / in-place anchors' business
        exp_node = _peel(decay)[0]
        if not is_exp(exp_node):
            scaled = _scaled_exp(exp_node)
            if scaled is not None:
                # A step that decays its state by exp(dt * A) times a factor (``state * dA * 0.99 +
                # dBx``): probe DB found it left alone with no reason (the copy_ form says why).
                raise Miss(f"the state decay is {exp_node.name} = {scaled.name} times another factor, not exp(dt * A) "
                           "itself: the op decays the state by exp(dt * A) alone")
            return None  # some other sum with an input in it: no sign of a decode step
        return Update("returned", state, node, reader, casts, decay, addend, [])
    return None


def _scaled_exp(node: Any) -> torch.fx.Node | None:
    """The exp that ``node``, a product, multiplies by another factor, or None."""
    if not (is_call(node, *MUL_TARGETS) or is_method(node, "mul")) or len(node.args) != 2:
        return None
    return next((f for f in (_peel(a)[0] for a in node.args) if is_exp(f)), None)


class RoleMap(dict):
    """Label -> role of the state's axes; ``ones`` are the roles whose axis has size 1 (a single
    head), which a size-1 axis of any operand matches whether or not the evaluator labelled it."""

    def __init__(self, labels: tuple[int, ...], roles: tuple[str, ...], shape: tuple):
        super().__init__(zip(labels, roles))
        self.ones = frozenset(r for r, s in zip(roles, shape) if statically_known_true(s == 1))


def _label_roles(labels: tuple[int, ...], shape: tuple, role: RoleMap) -> tuple[str, ...]:
    """The role of each axis ("1" for an unlabelled size-1 axis it broadcasts, "?" for other)."""
    return tuple(role.get(lab, "1" if statically_known_true(size == 1) else "?") for lab, size in zip(labels, shape))


def _factor_roles(term: IndexTerm, factor: Factor, role: RoleMap) -> tuple[str, ...]:
    return _label_roles(term.factor_labels(factor), _tensor(factor.node).shape, role)


def _fits(have: tuple[str, ...], want: tuple[str, ...], role: RoleMap) -> bool:
    return len(have) == len(want) and all(h == w or (h == "1" and w in role.ones) for h, w in zip(have, want))


def _names(roles: tuple[str, ...]) -> str:
    return ", ".join(_ROLE_NAMES.get(r, r) for r in roles)


def _state_role_map(term: IndexTerm, roles: tuple[str, ...], shape: tuple, what: str) -> RoleMap:
    labels = term.out_labels()
    if len(set(labels)) != len(labels):
        raise Miss(f"{what}'s axes are not distinct ({_names(roles)}) axes")
    return RoleMap(labels, roles, shape)


def _core(roles: tuple[str, ...]) -> tuple[str, ...]:
    """The roles of a factor's real axes: size-1 axes it broadcasts along dropped."""
    return tuple(r for r in roles if r != "1")


def _value_with_roles(term: IndexTerm, factors: list[Factor], role: RoleMap, want: tuple[str, ...]
                      ) -> torch.fx.Node | None:
    """A graph value that holds exactly the product of ``factors`` with axes ``want``: a single
    factor itself, or a node the term looked through (``x_t[..., 0]`` of a (batch, 1, dim) leaf;
    ``(w * B_raw * rsqrt(...))[:, 0]``, Jamba's normed B). The op then reads the user's own
    value: no new arithmetic, no new rounding."""
    if len(factors) == 1 and _fits(_factor_roles(term, factors[0], role), want, role):
        return factors[0].node
    for node, t in product_parts(term, factors):
        if _fits(_label_roles(t.out_labels(), _tensor(node).shape, role), want, role):
            return node
    return None


def _factor_value(term: IndexTerm, factor: Factor, role: RoleMap, want: tuple[str, ...], name: str
                  ) -> torch.fx.Node:
    node = _value_with_roles(term, [factor], role, want)
    if node is None:
        raise Miss(f"{name} (axes {_names(_factor_roles(term, factor, role))}) is not a ({_names(want)}) value")
    return node


def _prove_discretization(u: Update) -> dict[str, Any]:
    """``decay == exp(dt[b, c] · A[c, n])`` and ``addend == dt[b, c] · B[b, n] · x[b, c]`` with one dt,
    where c is the channel: (dim,) or (heads, headdim)."""
    shape = tuple(_tensor(u.state).shape)
    roles = _roles(u.state)
    chan = roles[1:-1]
    bc, cn = ("b", *chan), (*chan, "n")
    exp_node = _peel(u.decay)[0]
    if not is_exp(exp_node):
        behind = exp_node_behind(exp_node)
        stepped = time_slice(exp_node)
        if behind is not None and stepped is not None and exp_node_behind(stepped[0]) is behind:
            steps = _tensor(stepped[0]).shape[stepped[1]]
            if steps == 1:
                # A prefill of one token written as the whole-sequence loop (probe BU): the
                # sequence's exp has one step, and the op would need it per step, not sliced.
                raise Miss(f"the state decay is time step 0 of exp(...) of shape {tuple(_tensor(behind).shape)}, "
                           "a sequence of one step computed whole and then sliced: the decode op takes the step's "
                           "own exp(dt * A), without the time axis (the scan passes leave one-step loops alone)")
            raise Miss(f"the state decay is one time step of exp(...) of shape "
                       f"{tuple(_tensor(behind).shape)}, made for a whole sequence: each in-place update of the "
                       "state is a step of a scan over time, not a decode step (the scan passes say why the loop "
                       "was not rewritten)")
        if behind is not None and not _same_shape(behind, shape):
            raise Miss(f"the state decay is exp(...) of shape {tuple(_tensor(behind).shape)} broadcast to the state's "
                       f"{shape} through views (a decay shared along an axis of the state, e.g. a scalar decay per "
                       "head, as in Mamba-2): the op decays each channel and state by exp(dt * A) of the state's shape")
        raise Miss("the state decay is not exp(dt * A)")
    if not _same_shape(exp_node, shape):
        raise Miss(f"the decay exp(...) has shape {tuple(_tensor(exp_node).shape)}, not the state's {shape}")
    at = index_term(exp_node, allow_exp=True)
    inner = at.exp_of
    if inner is None or inner.summed or len(inner.factors) < 2:
        raise Miss("the exponent of the decay is not a product dt * A")
    role = _state_role_map(at, roles, shape, "the decay")
    stops: tuple[torch.fx.Node, ...] = ()
    if len(inner.factors) > 2:
        # dt or A is a product the user computed (dt * mask, A * scale): one value must hold
        # each side, and the input term must use the same dt value (see discretize's
        # _exponent_groupings for the scan's form of this).
        stops = _exponent_stops(at, inner.factors, role, bc, cn)
        at = index_term(exp_node, stops, allow_exp=True)
        inner = at.exp_of
        if inner is None or inner.summed or len(inner.factors) != 2:
            raise Miss("the exponent of the decay is not a product dt * A")
        role = _state_role_map(at, roles, shape, "the decay")
    cores = [_core(_factor_roles(at, f, role)) for f in inner.factors]
    # dt is the factor with the batch axis. Either factor may lack an axis of size 1 that a view
    # (``x.unsqueeze(1)`` for one head) adds; _factor_value then finds that view.
    dts = [f for f, c in zip(inner.factors, cores) if "b" in c and set(c) <= set(bc)]
    if len(dts) != 1:
        raise Miss(f"the exponent is not dt * A with dt of axes ({_names(bc)})")
    dt_f = dts[0]
    a_f = next(f for f in inner.factors if f is not dt_f)
    A = _value_with_roles(at, [a_f], role, cn)
    if A is None:
        a_roles = _factor_roles(at, a_f, role)
        raise Miss(f"A has shape {tuple(_tensor(a_f.node).shape)} with axes ({_names(a_roles)}), expected "
                   f"({_names(cn)}): exp(dt * A) must decay each channel by its own row of A")
    dt = _factor_value(at, dt_f, role, bc, "dt")
    dt_core = _core(_factor_roles(at, dt_f, role))

    addend = _peel(u.addend)[0]
    bt = index_term(addend, stops) if _same_shape(addend, shape) else None
    if bt is None or bt.summed or len(bt.factors) < 3:
        raise Miss("the input term is not a product of dt, B and x of the state's shape")
    brole = _state_role_map(bt, roles, shape, "the input term")
    dts = [f for f in bt.factors if f.node is dt_f.node and _core(_factor_roles(bt, f, brole)) == dt_core]
    if len(dts) != 1:
        raise Miss("the input term does not scale by the same dt as the decay")
    x, B = _split_x_B(bt, [f for f in bt.factors if f is not dts[0]], brole, chan)
    casts = [n for n in at.looked_through + bt.looked_through if is_cast(n)]
    return dict(dt=dt, A=A, x=x, B=B, casts=casts)


def _exponent_stops(at: IndexTerm, factors: list[Factor], role: RoleMap, bc: tuple[str, ...],
                    cn: tuple[str, ...]) -> tuple[torch.fx.Node, ...]:
    """For an exponent of three or more factors: the values that hold dt (the factors with the
    batch axis, and perhaps a per-channel scale) and A (those with the state axis, perhaps the
    scale), each an existing graph value; the first grouping for which both exist."""
    cores = [_core(_factor_roles(at, f, role)) for f in factors]
    to_dt = [f for f, c in zip(factors, cores) if "b" in c]
    to_A = [f for f, c in zip(factors, cores) if "n" in c and "b" not in c]
    free = [f for f, c in zip(factors, cores) if "b" not in c and "n" not in c]
    if to_dt and to_A and len(free) <= 3:
        for dt_group, A_group in two_sides(to_dt, to_A, free):
            dt = _value_with_roles(at, dt_group, role, bc)
            A = _value_with_roles(at, A_group, role, cn)
            if dt is not None and A is not None:
                return tuple(n for n, group in ((dt, dt_group), (A, A_group)) if len(group) > 1)
    raise Miss(f"the exponent of the decay is a product of {len(factors)} factors, and no graph value holds the ones "
               f"with the batch axis (dt, axes ({_names(bc)})) apart from A ({_names(cn)})")


def _state_operand(term: IndexTerm, factors: list[Factor], role: RoleMap, chan: tuple[str, ...]
                   ) -> torch.fx.Node | None:
    """The one value holding the product of ``factors`` as B or C in the op's grouped layout, else None.

    (batch, N) is one group. A value per channel (batch, dim, N), or per head (batch, heads, N),
    is already grouped, with one group per channel (head); behind a ``repeat_interleave`` over
    that axis it is its source (batch, G, N): channel (head) c reads group c // (size / G), the op's
    rule for dim = heads * headdim channels as well.
    """
    value = _value_with_roles(term, factors, role, ("b", "n"))
    if value is not None:
        return value
    per_group = _value_with_roles(term, factors, role, ("b", chan[0], "n"))
    if per_group is None:
        return None
    src = grouped_source(per_group, ("b", "d", "n"))
    return src.node if src.roles == ("b", "g", "n") else per_group


def _split_x_B(term: IndexTerm, factors: list[Factor], role: RoleMap, chan: tuple[str, ...]
               ) -> tuple[torch.fx.Node, torch.fx.Node]:
    """Split the input term's factors besides dt into x (batch, channel) and B (with the state axis).

    A factor with the state axis belongs to B, one with a channel axis to x; one with neither (an
    RMS norm's per-token ``rsqrt``, (batch, 1, 1)) may belong to either, so each way is tried.
    Each side must be one graph value the user computed (``_value_with_roles``).
    """
    to_B, to_x, free = [], [], []
    for f in factors:
        core = _core(_factor_roles(term, f, role))
        if "?" in core:
            raise Miss(f"a factor of the input term has axes ({_names(_factor_roles(term, f, role))})")
        (to_B if "n" in core else to_x if set(core) & set(chan) else free).append(f)
    for B_group, x_group in two_sides(to_B, to_x, free):
        x = _value_with_roles(term, x_group, role, ("b", *chan))
        B = _state_operand(term, B_group, role, chan)
        if x is not None and B is not None:
            return x, B
    raise Miss("the input term is not dt[..., None] * B[:, None, :] * x[..., None]: its factors besides dt are "
               f"not two values x ({_names(('b', *chan))}) and B (batch, N) or grouped B ({len(to_x)} with a "
               f"channel axis, {len(to_B)} with the state axis, {len(free)} with neither)")


def _peel_dt(dt: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node | None, bool, list]:
    """``dt = softplus(dt_raw + dt_bias)`` (bias and softplus optional): (dt_raw, dt_bias, softplus, casts)."""
    dt_softplus, dt_bias = False, None
    dt_raw, dt_casts = _peel(dt)
    if is_call(dt_raw, *_SOFTPLUS):
        beta = dt_raw.kwargs.get("beta", dt_raw.args[1] if len(dt_raw.args) > 1 else 1)
        threshold = dt_raw.kwargs.get("threshold", dt_raw.args[2] if len(dt_raw.args) > 2 else 20)
        if beta != 1 or threshold != 20:
            raise Miss(f"softplus(beta={beta}, threshold={threshold}) is not the op's softplus(beta=1, threshold=20)")
        dt_softplus = True
        dt_raw, casts = _peel(dt_raw.args[0])
        dt_casts += casts
    pair = _sum_operands(dt_raw)
    if pair is not None:
        for p, q in (pair, pair[::-1]):
            pv, qv = _tensor(_peel(p)[0]), _tensor(_peel(q)[0])
            # A bias per channel (dim,) or (heads, headdim), broadcast over the batch.
            if (pv is not None and qv is not None and pv.dim() == qv.dim() + 1
                    and all(_same(a, b) for a, b in zip(pv.shape[1:], qv.shape))):
                dt_raw, dt_bias = _peel(p)[0], _peel(q)[0]
                dt_casts += _peel(p)[1] + _peel(q)[1]
                break
    return dt_raw, dt_bias, dt_softplus, dt_casts


def _readout_at(node: torch.fx.Node, src: torch.fx.Node, roles: tuple[str, ...]) -> torch.fx.Node | None:
    """C if ``node`` computes ``y[b, c] = Σ_n src[b, c, n] · C[b, n]`` (C maybe grouped), else None."""
    term = index_term(node, stop=[src], allow_sum=True)
    if term is None or term.exp_of is not None or term.sign != 1 or len(term.factors) < 2:
        return None
    mine = [f for f in term.factors if f.node is src]
    if len(mine) != 1:
        return None
    labels = term.factor_labels(mine[0])
    if len(set(labels)) != len(roles):
        return None
    role = RoleMap(labels, roles, tuple(_tensor(src).shape))
    if (not _fits(_label_roles(term.out_labels(), _tensor(node).shape, role), roles[:-1], role)
            or term.summed_labels() != {labels[-1]}):
        return None
    return _state_operand(term, [f for f in term.factors if f is not mine[0]], role, roles[1:-1])


def _match_readout(user: torch.fx.Node, src: torch.fx.Node, roles: tuple[str, ...]
                   ) -> tuple[torch.fx.Node, torch.fx.Node, list] | None:
    """Follow ``user`` (a use of ``src``) forward through single users to a C-readout of ``src``:
    (readout node, C, the nodes from ``user`` to it)."""
    node, chain = user, []
    for _ in range(4):
        chain.append(node)
        C = _readout_at(node, src, roles)
        if C is not None:
            return node, C, chain
        nxt = _single_user(node)
        if nxt is None:
            return None
        node = nxt
    return None


def _is_copy_chain(user: torch.fx.Node, copy: torch.fx.Node, src: torch.fx.Node) -> bool:
    """Whether ``user`` (a use of ``src``) only leads, through casts, into the state's ``copy``."""
    if user is copy:
        return True
    if _is_cast_of(user, src):
        return len(user.users) == 1 and _is_copy_chain(next(iter(user.users)), copy, user)
    return False


def _shares_storage(node: Any, state: torch.fx.Node) -> bool:
    """``node``'s tensor value may live in ``state``'s memory (an unknown storage counts as shared)."""
    if _tensor(node) is None:
        return False
    mine, theirs = storage_of(node), storage_of(state)
    return mine is None or theirs is None or mine == theirs


def _decode_op_state(node: torch.fx.Node) -> Any:
    """The state a decode op node writes in place (its schema's ``Tensor(a!)``), or None."""
    # By schema name: ``torch.ops.ssm.*`` exist only once registered, and this runs on graphs
    # that may hold none.
    name = node.target._schema.name if isinstance(node.target, torch._ops.OpOverload) else None
    if name == "ssm::selective_state_update":
        return node.args[0]
    if name == "ssm::causal_conv1d_update":
        return node.args[1]
    return None


def _state_writes(state: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that write ``state`` (a recurrent or a conv state) itself: in-place methods on
    it, and the decode op a rewrite of an earlier step put in place of its writes."""
    return [n for n in state.users
            if (n.args and n.args[0] is state and _writes(n)) or _decode_op_state(n) is state]


def _alias_use_elsewhere(alias: torch.fx.Node, state: torch.fx.Node, writes: list[torch.fx.Node],
                         order: dict) -> str | None:
    """What makes ``alias`` (a value in ``state``'s memory, made between two of its ``writes``)
    read or write the state elsewhere than at its own place in the node order: a use, through
    further aliases, that writes in place or comes after the state's next write (and so sees a
    later step's value). None when every use reads before that write: the alias then reads the
    state exactly where it stands (HF's and Vim's ``ssm_state.to(dtype)`` before each step's
    readout), a use of the state the node order places like any other."""
    after = [w for w in writes if order[w] > order[alias]]
    nxt = min(after, key=order.__getitem__) if after else None
    seen, stack = set(), [alias]
    while stack:
        for user in stack.pop().users:
            if user in seen or is_metadata(user):
                continue
            seen.add(user)
            if mutates(user) and any(_shares_storage(a, state) for a in written_args(user)):
                return f"{user.name} writes in place, a write of the state the node order does not show"
            if nxt is not None and order.get(user, len(order)) > order[nxt]:
                return f"{user.name} reads after {nxt.name}, the state's next write, though the alias stands before it"
            # A tuple of views (``chunk``) or a view shares the memory: its uses are the alias's.
            if _tensor(user) is None or _shares_storage(user, state):
                stack.append(user)
    return None


def _step_window(state: torch.fx.Node, own_writes: list[torch.fx.Node], start: int, end: int,
                 order: dict) -> tuple[float, float, str | None]:
    """The node-order window (lo, hi) between the write to ``state`` before a step (whose reads
    start at ``start`` and whose writes ``own_writes`` end at ``end``) and the write after it,
    when other steps write the same state in this graph (a decode loop compiled as a whole, each
    step unrolled onto the one state node); (-inf, inf) otherwise.

    Outside the window every use of the state is separated from this step by another write, so
    it sees another step's value whatever this step's rewrite does. That holds only when each
    use of the state is one the order can see: an alias of the state (a view, a cast to its own
    dtype) besides its writes must be used where it stands (``_alias_use_elsewhere``), and no
    other step's write may have a user but its own
    ``add_`` (``state.mul_(dA).add_(dBx)``). Else the window is the whole graph, as for one step,
    and the third item says why the steps could not be told apart (None where there are none).
    """
    whole = (float("-inf"), float("inf"))
    writes = _state_writes(state)
    others = [w for w in writes if w not in own_writes]
    if not others:
        return (*whole, None)
    steps = (f"{state.name} is written in place {len(writes)} times in this graph (decode steps compiled as a "
             "whole)")
    for n in state.users:
        if n not in writes and n.op != "output" and _shares_storage(n, state):
            elsewhere = _alias_use_elsewhere(n, state, writes, order)
            if elsewhere is not None:
                return (*whole, f"{steps}, and {n.name} is an alias of it (a view, or a cast to its own dtype) "
                                f"that {elsewhere}")
    for w in others:
        if _decode_op_state(w) is state:
            continue  # the decode ops return a fresh output, not the state
        for user in w.users:
            if not (_in_place(user, "add_", operator.iadd) and user.args[0] is w and not user.users):
                return (*whole, f"{steps}, and {user.name} reads another step's write {w.name}")
    inside = next((w for w in others if start <= order[w] <= end), None)
    if inside is not None:
        return (*whole, f"{steps}, and {inside.name} writes it between this step's reads and its update")
    before = [w for w in others if order[w] < start]
    lo = max((order[w] for w in before), default=float("-inf"))
    if before:
        prev = max(before, key=order.__getitem__)
        # Two writes with nothing reading the state between them are one update written in two
        # statements (``state.copy_(f(state)); state.copy_(g(state))``), not two decode steps:
        # the window does not split it. A step ends where its result is read (or in the op).
        if _decode_op_state(prev) is not state and not any(
                lo < order[n] < start for n in state.users if n not in writes):
            return (*whole, None)
    return lo, min((order[w] for w in others if order[w] > end), default=float("inf")), None


def _new_state_reads(u: Update, order: dict, hi: float) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Every (value, user) through which the step's result can be read: the users of ``h`` (but
    its write), and reads of the state (or of the in-place nodes, its aliases) after the write
    and before the next step's write (order ``hi``; later reads see that step's value)."""
    reads = []
    if u.h is not None:
        reads += [(u.h, user) for user in u.h.users if not (u.writes and _is_copy_chain(user, u.writes[-1], u.h))]
    if u.writes:
        after = order[u.writes[-1]]
        for alias in [u.state, *u.writes]:
            reads += [(alias, user) for user in alias.users
                      if user not in u.writes and after < order[user] < hi]
    return reads


def match_state_update(u: Update, order: dict[torch.fx.Node, int]) -> dict[str, Any]:
    """The decode step around update ``u``: discretisation, readout and tail, or ``Miss``.
    ``order`` is the graph's node order (``fx_utils.node_order``)."""
    m = _prove_discretization(u)
    dt_raw, dt_bias, dt_softplus, dt_casts = _peel_dt(m["dt"])
    lo, hi, steps = ((float("-inf"), float("inf"), None) if u.form == "returned"
                     else _step_window(u.state, u.writes, order[u.reader], order[u.writes[-1]], order))
    if u.writes:
        before = [n for n in u.state.users if n is not u.reader and n not in u.writes
                  and lo < order[n] < order[u.writes[-1]]]
        if before and steps is not None:
            raise Miss(f"{steps}: the state's uses {[n.name for n in before]} cannot be assigned to one step, "
                       "and moving this step's update into one op could change what they see")
        if before:
            raise Miss(f"the state is also used by {[n.name for n in before]} before its update (a readout of "
                       "the old state?): moving the update into one op could change what they see")
    reads = _new_state_reads(u, order, hi)
    readouts = [(src, user, r) for src, user in reads if user.op != "output"
                for r in [_match_readout(user, src, _roles(u.state))] if r is not None]
    if len(readouts) != 1:
        users = [user.name for _, user in reads]
        if not readouts:
            raise Miss(f"the new state's uses {users} are not (h * C[:, None, :]).sum(-1) or another C-readout "
                       "Σ_n h[b, d, n] · C[b, n]")
        if steps is not None:
            raise Miss(f"{steps}: the new state has {len(readouts)} C-readouts, which cannot be assigned to one step")
        raise Miss(f"the new state has {len(readouts)} C-readouts (expected exactly one)")
    src, first, (y, C, chain) = readouts[0]
    last, tail = _match_tail(y, m["x"])
    others = [user for s, user in reads if user is not first]
    if order[last] > hi:
        raise Miss("the step's output is complete only after the next step writes the state")
    if hi < float("inf"):
        # The next step's reads come after this step's output, where the op has written the
        # state: they see the new state, as they do now.
        others = [n for n in others if order[n] < order[last]]
    if u.form != "returned" and others:
        raise Miss(f"the state is also used by {[n.name for n in others]} after its update: moving the update "
                   "into one op could change what they see")
    early = [n.name for n in others if order[n] < order[last]]
    if early:
        raise Miss(f"the new state is also used by {early} before the step's output is complete")
    return dict(update=u, state=u.state, x=m["x"], dt=dt_raw, A=m["A"], B=m["B"], C=C, D=tail["D"], z=tail["z"],
                dt_bias=dt_bias, dt_softplus=dt_softplus, readout_src=src, readout_first=first, last=last,
                window=(lo, hi), order=order,
                chain=chain + tail["nodes"], casts=m["casts"] + dt_casts)


def _match_tail(y: torch.fx.Node, x: torch.fx.Node) -> tuple[torch.fx.Node, dict[str, Any]]:
    """Optional ``+ x * D``, ``* silu(z)`` and casts after the readout: (last node, pieces).

    ``out += x * D`` (``operator.iadd``) counts as a sum: ``out`` is the readout's fresh result,
    whose only user is the ``+=``.
    """
    D = z = None
    node, nodes = y, []
    while True:
        nxt = _single_user(node)
        if nxt is None:
            break
        if _is_cast_of(nxt, node):
            node = nxt
            nodes.append(nxt)
            continue
        add = _sum_operands(nxt, inplace=True)
        if add is not None and is_call(nxt, operator.iadd) and add[0] is not node:
            add = None  # ``other += y`` writes other, not the readout's own fresh result
        if add is not None and D is None and z is None and node in add:
            other = add[1] if add[0] is node else add[0]
            skip = _operands(_peel(other)[0], _MUL, "mul")
            if skip is not None:
                for p, q in (skip, skip[::-1]):
                    qv = _tensor(_peel(q)[0])
                    # D per channel; its exact shape is check_state_update's business.
                    if _peel(p)[0] is x and qv is not None and 1 <= qv.dim() < _tensor(x).dim():
                        D = _peel(q)[0]
                        break
            if D is not None:
                node = nxt
                nodes.append(nxt)
                continue
            break
        mul = _operands(nxt, _MUL, "mul")
        if mul is not None and z is None and node in mul:
            other = mul[1] if mul[0] is node else mul[0]
            if silu_input(other) is not None:
                z = _peel(other.args[0])[0]
                node = nxt
                nodes.append(nxt)
                continue
        break
    return node, dict(D=D, z=z, nodes=nodes)


def check_state_update(m: dict[str, Any]) -> str | None:
    """Shapes and dtypes the op takes, and that the state is touched by nothing else; else why not."""
    u: Update = m["update"]
    st, x = _tensor(m["state"]), _tensor(m["x"])
    batch, *chan, N = st.shape
    chan = tuple(chan)
    if st.dtype != torch.float32:
        return f"the state is {st.dtype}; the op keeps its state in fp32"
    if u.h is not None and _tensor(u.h).dtype != torch.float32:
        return f"the new state is computed in {_tensor(u.h).dtype}; the op computes it in fp32"
    if not statically_known_true(1 <= N) or not statically_known_true(N <= MAX_N):
        return f"N={N} state channels are outside the op's 1..{MAX_N}"
    if len(chan) == 2:
        # Heads are flattened into channels: the op must write the caller's state through a
        # (batch, heads * headdim, N) view, which needs static sizes and mergeable strides.
        if not all(isinstance(s, int) for s in chan):
            return f"heads x headdim = {chan} are not static sizes"
        if st.stride(1) != chan[1] * st.stride(2):
            return (f"the state's strides {st.stride()} do not let (heads, headdim) merge into one channel "
                    "axis without a copy (the op must write the state itself)")
    bc = (batch, N) if _tensor(m["B"]).dim() == 2 else (batch, _tensor(m["B"]).shape[1], N)
    expect = {"x": (batch, *chan), "dt": (batch, *chan), "A": (*chan, N), "B": bc, "C": bc,
              "D": chan, "z": (batch, *chan), "dt_bias": chan}
    for name, shape in expect.items():
        node = m[name]
        if node is None:
            continue
        if not _same_shape(node, shape):
            got = tuple(_tensor(node).shape) if _tensor(node) is not None else None
            return f"{name} has shape {got}, expected {shape}"
        if _tensor(node).dtype not in SUPPORTED_DTYPES:
            return f"{name} has dtype {_tensor(node).dtype}, not one of fp32/bf16/fp16"
        if _tensor(node).device != st.device:
            return f"{name} is on {_tensor(node).device}, the state on {st.device}"
    # Channel c (head c // headdim) reads group c // (dim // G): G must divide the heads too.
    if len(bc) == 3 and not statically_known_true(chan[0] % bc[1] == 0):
        return f"B has {bc[1]} groups, which do not divide {chan[0]} {'heads' if len(chan) == 2 else 'channels'}"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"x has dtype {x.dtype}"
    order, last = m["order"], m["last"]
    m["region_casts"] = []
    reason = _rounding_refusal([m[name] for name in ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias")],
                               [last, u.h, *u.writes], last, order, m["region_casts"])
    if reason is not None:
        return reason
    step = _ancestors(last, u.h, *u.writes)
    reason = _inputs_written({name: m[name] for name in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")},
                             step, order, order[last])
    if reason is not None:
        return reason
    reason = _intermediates_written([m[name] for name in ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias")],
                                    step, [last, u.h, *u.writes], m["state"], order)
    if reason is not None:
        return reason
    if u.form == "returned":
        # The state is only read (the op updates a clone made where it is read): other users
        # see the same value as before.
        return None
    allowed = {u.reader, *u.writes, m["readout_first"]}
    lo, hi = m["window"]
    # With other steps' writes around this one (``_step_window``), uses outside the window see
    # their values, and uses after this step's output (the next step's reads) see the op's.
    others = [n for n in m["state"].users if n not in allowed and lo < order[n] < hi and not is_metadata(n)
              and not (hi < float("inf") and order[n] > order[last])]
    # A cast to the state's own dtype returns the state itself, so a cast with other users is an
    # alias of the state that would see the update at a different point.
    others += [n for c in u.read_casts for n in c.users if len(c.users) > 1]
    others += [n for w in u.writes[:-1] for n in w.users if n not in allowed]
    if others:
        return (f"the state is also used by {[n.name for n in others]}: moving its update into one op "
                "could change what they see")
    if u.writes[-1].users and u.writes[-1] is not m["readout_src"]:
        return f"the value of {u.writes[-1].name} (the written state) is used"
    return _state_moved(m["state"], order, order[u.reader], order[u.writes[0]], order[last], tuple(u.writes),
                        {u.reader, *u.read_casts, *m["chain"]}, "state")


# Views that keep their base's storage offset: a mutating op's write through them lands where
# inductor expects it. (A view that indexes, ``cache[i]`` or a slice, moves the offset.)
_OFFSET_FREE_VIEWS = ("view", "flatten", "unflatten", "unsqueeze", "squeeze", "transpose", "permute", "movedim", "t")


# Views that index a stacked cache (``cache[layer]``) or reshape a state.
_INDEXING_VIEWS = ("getitem", "select", "view", "unsqueeze", "squeeze", "flatten", "unflatten")


def _view_of_input(node: torch.fx.Node, views: tuple[str, ...], inputs: tuple[str, ...] = ("placeholder",)) -> bool:
    """Whether ``node`` is a graph input (a node of an op in ``inputs``), or reaches one through
    calls named in ``views`` alone."""
    while node.op in ("call_method", "call_function"):
        if bare_name(node) not in views or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return False
        node = node.args[0]
    return node.op in inputs


def _offset_free_view_of_input(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a graph input, or reaches one through views that keep its offset."""
    return _view_of_input(node, _OFFSET_FREE_VIEWS)


def _call_update(graph: torch.fx.Graph, op: Any, functional_op: Any, args: tuple, state_at: int,
                 write_back: torch.fx.Node | None, functional: bool = False
                 ) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None]:
    """Emit a decode op at the insertion point: (the op node, y, the new state or None).

    The mutating op writes ``args[state_at]`` itself only where that is a graph input or a view of
    one with the same storage offset. Any other state (a view of a stacked cache, ``cache[i]``)
    goes through the functional twin, and the
    new state is copied into ``write_back`` (None: the step returns it, and nothing is written):
    inductor (torch 2.13) addresses a mutating custom op's write to a view with a storage offset
    wrongly under dynamic shapes, and the write to a clone of such a view even with static ones
    (or of a caller's view passed in as the state, under dynamic shapes). ``functional`` asks for
    the twin whatever the state is.
    """
    if not functional and _offset_free_view_of_input(args[state_at]):
        node = graph.call_function(op, args)
        propagate_val(node)
        return node, node, None
    node = graph.call_function(functional_op, args)
    propagate_val(node)
    y, new = (graph.call_function(operator.getitem, (node, i)) for i in (0, 1))
    propagate_val(y)
    propagate_val(new)
    if write_back is not None:
        propagate_val(graph.call_method("copy_", (write_back, new)))
    return node, y, new


# The functional twins, by name: the ops exist only once ``kernels.decode.op.register()`` ran.
_FUNCTIONAL_UPDATES = ("ssm::selective_state_update_functional", "ssm::causal_conv1d_update_functional")


def _read_in_place_of_copy(graph: torch.fx.Graph, state: torch.fx.Node) -> bool:
    """Whether a step that returns its new state may hand its op ``state`` itself rather than the
    copy taken where the step reads it (which keeps later writes to the state from the op, whose
    read lands at the step's readout).

    That copy is needless when ``state`` is the new state an earlier step's functional op returned
    (through views: the heads layout's ``unflatten``), a buffer no caller holds, and nothing writes
    its memory in place once it is made: it then holds one value wherever it is read. Chained
    steps in one graph (mamba.py's ``step`` over several tokens) took one copy of the
    (batch, dim, N) state and of the conv window per step. The functional op only reads it, so
    other reads of it, after the step or returned, are left as they were."""
    node = state
    while is_method(node, "unflatten", "view", "flatten") and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    op = node.args[0] if is_call(node, operator.getitem) and node.args[1] == 1 else None
    fresh = (is_ssm_op(op) and isinstance(op.target, torch._ops.OpOverload)
             and op.target._schema.name in _FUNCTIONAL_UPDATES)
    return fresh and written_in_place(graph, [node, state], after_made=True) is None


def _flatten(graph: torch.fx.Graph, node: torch.fx.Node, axis: int) -> torch.fx.Node:
    """``node.flatten(axis, axis + 1)``: the (heads, headdim) axes as one channel axis."""
    out = graph.call_method("flatten", (node, axis, axis + 1))
    propagate_val(out)
    return out


def _erase_unused(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Erase ``nodes`` (the matched chain the op replaced), latest first, each once nothing uses it.

    In-place nodes among them (``out += ...``, the state writes) are not dead code to the pass
    manager's clean-up, so they are erased here explicitly.
    """
    order = node_order(graph)
    for node in sorted(set(nodes), key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)


def _find_state_step(node: torch.fx.Node, order: dict[torch.fx.Node, int]) -> tuple[Update, dict] | None:
    """The update anchored at ``node`` and its matched step, or None if ``node`` anchors none."""
    u = find_update(node, order)
    return None if u is None else (u, match_state_update(u, order))


def _unexplained_state_writes(graph: torch.fx.Graph, ctx: PassContext) -> None:
    """A miss for a graph-input state (or a layer of a stacked one) that is still written in place
    by a decay (``mul_`` by an exp) after the pass, when no miss names those writes: a step in another order
    (``state.add_(dBx).mul_(dA)``, a readout between the ``mul_`` and the ``add_``) matches no
    anchor, and would otherwise leave no record in ``explain``."""
    reported = {name for m in ctx.misses for name in m.nodes}
    for ph in graph.nodes:
        if not _is_state(ph) or not _view_of_input(ph, _INDEXING_VIEWS, ("placeholder", "get_attr")):
            continue
        writes, frontier = [], [ph]
        while frontier:  # writes to the state, and to the aliases its in-place methods return
            n = frontier.pop()
            for user in n.users:
                if user.args and user.args[0] is n and _writes(user) and user not in writes:
                    writes.append(user)
                    frontier.append(user)
        decays = [w for w in writes if _in_place(w, "mul_", operator.imul) and exp_behind(w.args[1])]
        if not decays or any(w.name in reported for w in writes):
            continue
        ctx.miss(STATE_FAMILY, f"the state {ph.name} is multiplied in place by a decay exp(...), but the step is "
                 "not state.mul_(exp(dt*A)).add_(dt*B*x) (or state.copy_ of the sum) followed by its readout: "
                 "the writes are in another order, or something reads the state between them; left alone",
                 decays[:1])


def state_update_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    order = node_order(graph)
    for node in list(graph.nodes):
        if node not in order:
            continue  # erased by an earlier rewrite
        found = _proved(ctx, STATE_FAMILY, node, lambda: _find_state_step(node, order),
                        lambda found: check_state_update(found[1]))
        if found is None:
            continue
        u, m = found
        last = m["last"]
        # The op runs at the readout, under the grad mode / autocast the step ran under.
        refusal = (context_refusal(graph, [node, u.reader, *m["chain"], m["readout_first"], last, *u.writes], last)
                   or _records_grad([*m["chain"], last]))
        if refusal is not None:
            ctx.miss(STATE_FAMILY, refusal, [node])
            continue
        out_dtype = _tensor(last).dtype
        state = m["state"]
        if u.form == "returned" and not _read_in_place_of_copy(graph, state):
            # The step does not write its state: the op reads a copy taken where the step reads
            # the state, so later writes to it, if any, are not seen.
            with graph.inserting_before(u.reader):
                state = graph.call_method("clone", (m["state"],))
                propagate_val(state)
        chan = tuple(_tensor(m["state"]).shape[1:-1])
        with graph.inserting_before(last):
            x = _widen_for(graph, m["x"], out_dtype)
            args = [state, x, m["dt"], m["A"], m["B"], m["C"], m["D"], m["z"], m["dt_bias"]]
            if len(chan) == 2:
                # (heads, headdim) -> heads * headdim channels; the state's flatten is a view
                # (check_state_update proved its strides merge), so the op writes the caller's state.
                args = [_flatten(graph, a, 0 if name in ("A", "D", "dt_bias") else 1)
                        if name not in ("B", "C") and a is not None else a
                        for name, a in zip(("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias"), args)]
            # A step that returns its new state (and writes none) gets the functional twin:
            # the mutating op on a clone of the state is what inductor gets wrong when the state
            # is a caller's view with an offset (cache[1] passed in) under dynamic shapes.
            op, result, new = _call_update(
                graph, torch.ops.ssm.selective_state_update.default,
                torch.ops.ssm.selective_state_update_functional.default, (*args, m["dt_softplus"]), 0,
                None if u.form == "returned" else args[0], functional=u.form == "returned")
            if len(chan) == 2:
                result = graph.call_method("unflatten", (result, 1, chan))
                propagate_val(result)
                if new is not None and u.form == "returned":
                    new = graph.call_method("unflatten", (new, 1, chan))
                    propagate_val(new)
            result = _cast_to(graph, result, out_dtype)
        if "stack_trace" in node.meta:
            op.meta["stack_trace"] = node.meta["stack_trace"]
        last.replace_all_uses_with(result)
        if u.form == "returned":
            u.h.replace_all_uses_with(new)
        # Before the erase: the record reads each cast's input. dt's own casts are peeled
        # outside the region (the op reads dt_raw) and counted with it.
        dropped = _narrowing(list(dict.fromkeys(m["casts"] + m["region_casts"])))
        # scan_loop, which runs first, may have read the step's decay product (an operand of the
        # update's sum) as a one-step loop left alone; this rewrite accounts for it.
        step = [node, u.reader, *([u.h, *u.h.all_input_nodes] if u.h is not None else [])]
        ctx.withdraw("scan_loop", {n.name for n in step}, ONE_STEP)
        # Steps that compute their own decay, chained in one graph: scan_loop named them as a
        # recurrence left alone; each step is rewritten here.
        ctx.withdraw("scan_loop", {n.name for n in step}, DEEP_STEP)
        _erase_unused(graph, m["chain"] + [m["readout_first"], last] + u.writes)
        order = node_order(graph)
        ctx.rewrite(STATE_FAMILY, f"state*exp(dt*A)+dt*B*x ({u.form}); C-readout"
                    + ("+D*x" if m["D"] is not None else "") + ("*silu(z)" if m["z"] is not None else ""),
                    [node, last], "ssm.selective_state_update",
                    {"form": u.form, "writes": "state" if new is None else "new state, copied" if u.form != "returned"
                     else "new state", "N": int(_tensor(m["state"]).shape[-1]), "channels": chan,
                     "dt_softplus": m["dt_softplus"],
                     "dt_bias": m["dt_bias"] is not None, "D": m["D"] is not None, "z": m["z"] is not None,
                     "groups": int(_tensor(m["B"]).shape[1]) if _tensor(m["B"]).dim() == 3 else 1,
                     "rounding_casts_dropped": dropped})
    _unexplained_state_writes(graph, ctx)


# ---------------------------------------------------------------------------------------------
# conv_update
# ---------------------------------------------------------------------------------------------

def _last_axis_slice(index: Any) -> slice | None:
    index = _as_tuple(index)
    if len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice):
        return index[1]
    if len(index) == 3 and index[0] == slice(None) and index[1] == slice(None) and isinstance(index[2], slice):
        return index[2]
    return None


def _is_suffix(index: Any, total: Any, keep: Any) -> bool:
    """``index`` takes exactly the last ``keep`` of ``total`` positions on the last axis."""
    s = _last_axis_slice(index)
    if s is None or s.stop is not None or s.step not in (None, 1) or s.start is None:
        return False
    start = val(s.start)  # under dynamic shapes ``-state_len`` is a graph node holding a SymInt
    return isinstance(start, (int, torch.SymInt)) and (_same(start, -keep) or _same(start, total - keep))


def _keeps_all(index: Any, total: Any) -> bool:
    """``index`` takes all ``total`` positions of the last axis (``[..., :T]`` of a length-T axis)."""
    s = _last_axis_slice(index)
    if s is None or s.step not in (None, 1):
        return False
    start, stop = val(s.start), val(s.stop)
    return ((start is None or _same(start, 0) or _same(start, -total))
            and (stop is None or isinstance(stop, (int, torch.SymInt)) and statically_known_true(stop >= total)))


_CONV1D_PARAMS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _single(value: Any) -> Any:
    return value[0] if isinstance(value, (tuple, list)) and len(value) == 1 else value


def match_conv_update(cat: torch.fx.Node) -> dict[str, Any] | None:
    """Structure of a rolling conv update starting at ``torch.cat([conv_state, x], -1)``.

    None if ``cat`` is not such an anchor (its first input is not ``copy_``-ed back into);
    raises ``Miss`` if the anchor is there but a piece is not.
    """
    if len(cat.args) < 1 or not isinstance(cat.args[0], (list, tuple)) or len(cat.args[0]) != 2:
        return None
    conv_state, x = cat.args[0]
    dim_arg = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
    sv, xv = _tensor(conv_state), _tensor(x)
    if sv is None or xv is None or sv.dim() != 3 or xv.dim() != 3 or dim_arg not in (-1, 2):
        return None
    hs, cat_casts = _follow_casts(cat)
    users = list(hs.users)
    roll = [u for u in users if is_call(u, operator.getitem)]
    copies = [c for r in roll for c in [_copy_into(r)] if c is not None and c.args[0] is conv_state]
    if not copies:
        return None
    S, T = sv.shape[2], xv.shape[2]
    convs = [u for u in users if is_call(u, torch.conv1d, F.conv1d)]
    if len(users) != 2 or len(roll) != 1 or len(convs) != 1 or len(copies) != 1:
        raise Miss("the concatenated window is used by something other than one roll and one conv1d")
    state_slice, copy, conv = roll[0], copies[0], convs[0]
    if not _is_suffix(state_slice.args[1], S + T, S):
        raise Miss(f"the state is rolled with {state_slice.args[1]!r}, not the last S={S} positions")
    args = named_args(conv, _CONV1D_PARAMS)
    if args.get("input") is not hs:
        raise Miss("the window is not the conv1d's input")
    w3 = _tensor(args.get("weight"))
    groups, dim = args.get("groups", 1), xv.shape[1]
    if (w3 is None or w3.dim() != 3 or not _same(w3.shape[0], dim) or not _same(w3.shape[1], 1)
            or not _same(groups, dim)):
        raise Miss(f"conv1d is not depthwise (weight {None if w3 is None else tuple(w3.shape)}, groups={groups})")
    for name, ok in (("stride", 1), ("padding", 0), ("dilation", 1)):
        if _single(args.get(name, ok)) != ok:
            raise Miss(f"conv1d {name}={args[name]!r}, expected {ok} for a rolling-window conv")
    W = w3.shape[2]
    out_slice = _single_user(conv)
    sliced = out_slice is not None and is_call(out_slice, operator.getitem)
    if sliced and (_is_suffix(out_slice.args[1], S + T - W + 1, T)
                   or statically_known_true(S == W - 1) and _keeps_all(out_slice.args[1], T)):
        node = out_slice
    elif statically_known_true(S == W - 1):
        # A window of W-1 states: the conv's T outputs are the step's outputs already (a chunk
        # carried between calls), and whoever reads them reads the op's instead.
        node = conv
    else:
        raise Miss(f"the conv output is not sliced to its last T={T} steps")
    activation = None
    node, _ = _follow_casts(node)
    nxt = _single_user(node)
    if nxt is not None and silu_input(nxt) is not None:
        node, activation = nxt, "silu"
    node, _ = _follow_casts(node)
    return dict(cat=cat, conv_state=conv_state, x=x, copy=copy, conv=conv, weight=args["weight"],
                bias=args.get("bias"), W=W, S=S, T=T, activation=activation, last=node,
                casts=cat_casts)


def check_conv_update(m: dict[str, Any]) -> str | None:
    """Widths, dtypes, and that the conv state is touched by nothing else; else why not."""
    W, S = pinned_int(m["W"]), m["S"]
    if W is None or not MIN_W <= W <= MAX_W:
        return f"kernel width W={m['W']} unsupported (the op takes {MIN_W} <= W <= {MAX_W})"
    if not statically_known_true(S >= W - 1):
        return f"the state holds S={S} inputs, fewer than W-1={W - 1}"
    for name in ("x", "conv_state", "weight", "bias"):
        t = _tensor(m[name]) if m[name] is not None else None
        if m[name] is not None and (t is None or t.dtype not in SUPPORTED_DTYPES):
            return f"{name} has dtype {None if t is None else t.dtype}, not one of fp32/bf16/fp16"
    if m["bias"] is not None and _tensor(m["bias"]).dim() != 1:
        return "bias is not a (dim,) tensor"
    # A read of the state's shape (``conv_states.size()`` under dynamic shapes, HF's ``[..., -W:]``
    # bound) sees the same shape after the update (probe BS).
    others = [u for u in m["conv_state"].users if u is not m["cat"] and u is not m["copy"] and not is_metadata(u)]
    if others:
        return (f"the conv state is also used by {[u.name for u in others]}: moving its update into one op "
                "could change what they see")
    if m["copy"].users:
        return "the value of conv_state.copy_(...) is used"
    # The op goes where the conv1d is: it reads x there, and rolls the state there.
    order = node_order(m["cat"].graph)
    end = order[m["conv"]]
    reason = _rounding_refusal([m["x"], m["conv_state"], m["weight"], m["bias"]], [m["last"], m["copy"]],
                               m["last"], order)
    if reason is not None:
        return reason
    reason = _inputs_written({"x": m["x"], "weight": m["weight"], "bias": m["bias"]},
                             _ancestors(m["last"], m["copy"]), order, end)
    if reason is not None:
        return reason
    return _state_moved(m["conv_state"], order, order[m["cat"]], order[m["copy"]], end, (m["copy"],), {m["cat"]},
                        "conv state")


def conv_update_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for cat in list(graph.nodes):
        if not is_call(cat, torch.cat):
            continue
        m = _proved(ctx, CONV_FAMILY, cat, lambda: match_conv_update(cat), check_conv_update)
        if m is None:
            continue
        last = m["last"]
        refusal = (context_refusal(graph, [cat, m["copy"], m["conv"], last], m["conv"])
                   or _records_grad([cat, m["conv"], last]))
        if refusal is not None:
            ctx.miss(CONV_FAMILY, refusal, [cat])
            continue
        out_dtype = _tensor(last).dtype
        with graph.inserting_before(m["conv"]):
            x = _widen_for(graph, m["x"], out_dtype)
            op, result, new = _call_update(
                graph, torch.ops.ssm.causal_conv1d_update.default, torch.ops.ssm.causal_conv1d_update_functional.default,
                (x, m["conv_state"], depthwise_weight(graph, m["weight"]), m["bias"], m["activation"]), 1,
                m["conv_state"])
            result = _cast_to(graph, result, out_dtype)
        if "stack_trace" in cat.meta:
            op.meta["stack_trace"] = cat.meta["stack_trace"]
        last.replace_all_uses_with(result)
        ctx.rewrite(CONV_FAMILY, "cat; copy_(window[-S:]); conv1d(window)[-T:]" + ("+silu" if m["activation"] else ""),
                    [cat, m["copy"], m["conv"], last], "ssm.causal_conv1d_update",
                    {"W": int(m["W"]), "S": _record(m["S"]), "activation": m["activation"], "bias": m["bias"] is not None,
                     "writes": "state" if new is None else "new state, copied",
                     "rounding_casts_dropped": _narrowing(m["casts"])})
        graph.erase_node(m["copy"])


# ---------------------------------------------------------------------------------------------
# conv_update, window form: the state is the window itself (mamba_simple's ``step``)
# ---------------------------------------------------------------------------------------------
#
#     conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1)); conv_state[:, :, -1] = x
#  or conv_state.copy_(torch.cat([conv_state[..., 1:], x[..., None]], -1))
#  or rolled = torch.roll(conv_state, -1, -1); rolled[:, :, -1] = x; conv_state.copy_(rolled)
#     y = (conv_state * w).sum(-1) + b                  # w (dim, W), W = S: the whole window (or rolled)
#     y = F.silu(y).to(dtype)                            # activation, casts optional
#
# The new window is the last S inputs of cat(conv_state, x), which is what the op keeps, and
# y[b, d] = Σ_k w[d, k] · window[b, d, k] is the op's output for a width-S conv.

def _shift(node: torch.fx.Node) -> tuple[Any, Any] | None:
    """(shifts, dims) of ``torch.roll(t, shifts, dims)`` / ``t.roll(...)``, else None."""
    if not (is_call(node, torch.roll) or is_method(node, "roll")) or set(node.kwargs) - {"shifts", "dims"}:
        return None
    args = named_args(node, ("input", "shifts", "dims"))
    return _single(args.get("shifts")), _single(args.get("dims"))


def _is_last_position(index: Any, S: Any) -> bool:
    """``index`` selects the last position of the last axis of a 3-D tensor (``[:, :, -1]``, ``[..., -1]``)."""
    index = _as_tuple(index)
    if len(index) == 2 and index[0] is Ellipsis or len(index) == 3 and index[:2] == (slice(None), slice(None)):
        last = index[-1]
        return isinstance(last, int) and not isinstance(last, bool) and (last == -1 or _same(last, S - 1))
    return False


def _shifted_window(cat: Any, is_state) -> dict[str, Any] | None:
    """``torch.cat([conv_state[..., 1:], x[..., None]], -1)``: the window after one new input.

    None if ``cat`` does not start with a slice of the last axis of a tensor ``is_state`` accepts;
    ``Miss`` if it does but drops or appends something else.
    """
    if not is_call(cat, torch.cat):
        return None
    pieces = cat.args[0] if cat.args and isinstance(cat.args[0], (list, tuple)) else None
    dim_arg = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
    if not pieces or dim_arg not in (-1, 2):
        return None
    first = _peel(pieces[0])[0]
    if not is_call(first, operator.getitem) or _tensor(first.args[0]) is None or _tensor(first.args[0]).dim() != 3:
        return None
    cs = first.args[0]
    S = _tensor(cs).shape[2]
    keep = _last_axis_slice(first.args[1])
    if keep is None or not is_state(cs):
        return None
    if len(pieces) != 2:
        raise Miss(f"the new window is a cat of {len(pieces)} pieces, not conv_state[..., T:] and the new input")
    x3 = pieces[1]
    xv = _tensor(x3)
    if keep.stop is not None or keep.step not in (None, 1) or not isinstance(keep.start, int):
        raise Miss(f"the new window keeps conv_state[{first.args[1]!r}], not its last inputs")
    if xv is None or xv.dim() != 3 or not _same(xv.shape[2], 1):
        raise Miss(f"the new window appends {None if xv is None else tuple(xv.shape)}, not one input (batch, dim, 1)")
    dropped = keep.start + pinned_int(S) if keep.start < 0 and pinned_int(S) is not None else keep.start
    if dropped != 1:
        raise Miss(f"the window drops {dropped} old inputs but appends 1 new input")
    return dict(cs=cs, S=S, x=_unsqueezed(x3, -1), x3=x3, reads=[first], window=cat)


def _last_slot_writes(node: torch.fx.Node, S: Any) -> list[torch.fx.Node]:
    """The ``node[..., -1] = x`` writes to ``node`` itself."""
    return [n for n in node.users if is_call(n, operator.setitem) and len(n.args) == 3 and n.args[0] is node
            and _is_last_position(n.args[1], S)]


def find_window_write(copy: torch.fx.Node, order: dict[torch.fx.Node, int]) -> dict[str, Any] | None:
    """A window roll ending in ``copy`` (``conv_state.copy_(...)``): x (batch, dim), the old-state
    reads and the writes; None if ``copy`` is not one, ``Miss`` if it nearly is."""
    cs = copy.args[0]
    sv = _tensor(cs)
    if sv is None or sv.dim() != 3 or not isinstance(cs, torch.fx.Node):
        return None
    S = sv.shape[2]
    src, _ = _peel(copy.args[1])
    shifted = _shifted_window(src, lambda n: n is cs)
    if shifted is not None:
        return {**shifted, "writes": [copy], "form": "copy_"}
    roll = _shift(src)
    if roll is None:
        return None
    if src.args[0] is not cs:
        other = src.args[0]
        if isinstance(other, torch.fx.Node) and any(order[n] < order[copy] for n in _last_slot_writes(src, S)):
            # transformers 4.39's step with the copy going to another cache than the one rolled
            # (probe CS): the op rolls one conv state in place, reading and writing the same cache.
            raise Miss(f"the rolled window {src.name} is a roll of {other.name} but is copied into {cs.name}, not "
                       f"back into {other.name}: the op rolls one conv state in place, reading and writing the "
                       "same cache")
        return None
    shifts, dims = roll
    if dims not in (-1, 2):
        raise Miss(f"the window is rolled with shifts={shifts!r}, dims={dims!r}, not along its last axis")
    if not isinstance(shifts, int):
        # (A Python int the trace made a symbol under dynamic=True, say; probe CV named the axis.)
        raise Miss(f"the window is rolled along its last axis by shifts={shifts!r}, a value the graph does not "
                   "fix: the op rolls by exactly one slot")
    after = [n for n in _last_slot_writes(cs, S) if order[n] > order[copy]]
    # transformers 4.39 writes x into the rolled copy before copying it into the cache, and reads
    # that copy out: the cache and the copy both end up holding the new window.
    rolled = _last_slot_writes(src, S)
    before = [n for n in rolled if order[n] < order[copy]]
    if not after and not before and not (shifts == -1 or _same(shifts, S - 1)):
        # Rolled the other way (newest input first, written at index 0): the shift is the reason,
        # not a missing write at index -1 (probe CV).
        raise Miss(f"the window is rolled with shifts={shifts}, not -1 (oldest input out at the front, its slot at "
                   "the end for the one new input)")
    if not after and not before:
        late = [n.name for n in rolled]
        raise Miss("conv_state[..., -1] = x is written neither to the conv state after the copy_ nor to the "
                   "rolled window before it" + (f" ({late} writes the rolled window after the copy_: the state keeps "
                                                "its oldest input in the slot where the op's new state has x)"
                                                if late else ""))
    setitem = min(after, key=order.__getitem__) if after else max(before, key=order.__getitem__)
    # roll by -1 (or S - 1) moves the oldest input to the end, where x overwrites it.
    if not (shifts == -1 or _same(shifts, S - 1)):
        raise Miss(f"the window is rolled with shifts={shifts}, not -1 (oldest input out at the front, its slot at "
                   "the end for the one new input)")
    x = setitem.args[2]
    if _tensor(x) is None or _tensor(x).dim() != 2:
        return None
    if not _same_shape(x, tuple(sv.shape[:2])):
        # The write broadcasts x (one input for every batch row, say); the op reads x as given.
        raise Miss(f"the window's last slot is written {tuple(_tensor(x).shape)}, broadcast to its (batch, dim) = "
                   f"{tuple(sv.shape[:2])}: the op takes one new input per batch row and channel")
    if after:
        return dict(cs=cs, S=S, x=x, x3=None, reads=[src], writes=[copy, setitem], window=None, form="roll")
    early = [n.name for n in src.users if order[n] < order[setitem]]
    if early:
        raise Miss(f"the rolled window is used by {early} before x is written into its last slot: the op never "
                   "holds that window (it rolls the state and writes x in one step)")
    return dict(cs=cs, S=S, x=x, x3=None, reads=[src], writes=[setitem, copy], window=src, form="rolled copy")


def _window_readout_at(node: torch.fx.Node, src: torch.fx.Node) -> torch.fx.Node | None:
    """The weight w if ``node`` computes ``y[b, d] = Σ_k src[b, d, k] · w[d, k]``, else None."""
    term = index_term(node, stop=[src], allow_sum=True)
    if term is None or term.exp_of is not None or term.sign != 1 or len(term.factors) != 2:
        return None
    mine = [f for f in term.factors if f.node is src]
    labels = term.factor_labels(mine[0]) if len(mine) == 1 else ()
    if len(set(labels)) != 3:
        return None
    role = RoleMap(labels, ("b", "d", "k"), tuple(_tensor(src).shape))
    if (not _fits(_label_roles(term.out_labels(), _tensor(node).shape, role), ("b", "d"), role)
            or term.summed_labels() != {labels[2]}):
        return None
    return _value_with_roles(term, [f for f in term.factors if f is not mine[0]], role, ("d", "k"))


def _match_window_readout(user: torch.fx.Node, src: torch.fx.Node) -> dict[str, Any] | None:
    """``Σ_k src[..., k] · w[:, k]`` (mul-sum, einsum, casts of src looked through) from ``user`` on,
    then ``+ b``, silu and casts."""
    node, nodes, weight = user, [], None
    for _ in range(4):
        nodes.append(node)
        weight = _window_readout_at(node, src)
        if weight is not None:
            break
        node = _single_user(node)
        if node is None:
            return None
    if weight is None:
        return None
    end, bias, activation = node, None, None
    nxt = _single_user(end)
    add = _sum_operands(nxt) if nxt is not None else None
    if add is not None and end in add:
        other = _peel(add[1] if add[0] is end else add[0])[0]
        if _tensor(other) is not None and _tensor(other).dim() == 1:
            bias, end = other, nxt
            nodes.append(nxt)
    end, casts = _follow_casts(end)
    nodes += casts
    nxt = _single_user(end)
    if nxt is not None and silu_input(nxt) is not None:
        activation, end = "silu", nxt
        nodes.append(nxt)
        end, casts = _follow_casts(end)
        nodes += casts
    return dict(weight=weight, bias=bias, activation=activation, last=end, nodes=nodes)


def _is_window_input(node: Any) -> bool:
    """A 3-D conv state that the graph never writes (a step that returns its new window instead,
    as mamba.py's ``MambaBlock.step`` does): from outside the graph, fresh zeros, or the new
    window an earlier step's op returned (steps compiled in one graph)."""
    return (isinstance(node, torch.fx.Node)
            and (node.op in ("placeholder", "get_attr") or _gathered(node) or is_zeros(node)
                 or _new_state_of(node, "ssm::causal_conv1d_update_functional"))
            and _tensor(node) is not None and _tensor(node).dim() == 3
            and not any(_writes(user) for user in node.users))


def _match_full_window_conv(full: torch.fx.Node, cs: torch.fx.Node, x3: torch.fx.Node) -> dict[str, Any] | None:
    """``F.conv1d(torch.cat([cs, x3], -1), w, b, padding=P, groups=dim)[:, :, t]`` at the t whose
    taps are the last W inputs, then silu and casts: the op's output for the new input."""
    if not is_call(full, torch.cat) or not full.args or not isinstance(full.args[0], (list, tuple)):
        return None
    pieces = full.args[0]
    if (len(pieces) != 2 or full.kwargs.get("dim", full.args[1] if len(full.args) > 1 else 0) not in (-1, 2)
            or _peel(pieces[0])[0] is not cs or _peel(pieces[1])[0] is not _peel(x3)[0]):
        return None
    window, casts = _follow_casts(full)
    conv = _single_user(window)
    if conv is None or not is_call(conv, torch.conv1d, F.conv1d):
        return None
    args = named_args(conv, _CONV1D_PARAMS)
    w3, dim = _tensor(args.get("weight")), _tensor(cs).shape[1]
    padding = _single(args.get("padding", 0))
    if (args.get("input") is not window or w3 is None or w3.dim() != 3 or not _same(w3.shape[0], dim)
            or not _same(w3.shape[1], 1) or not _same(args.get("groups", 1), dim) or not isinstance(padding, int)
            or _single(args.get("stride", 1)) != 1 or _single(args.get("dilation", 1)) != 1):
        return None
    W, length = pinned_int(w3.shape[2]), pinned_int(_tensor(cs).shape[2] + 1)
    if W is None or length is None:
        raise Miss(f"the conv state's width {_tensor(cs).shape[2]} or the kernel's {w3.shape[2]} is a dynamic "
                   "size: the output position whose taps are the last W inputs is not known")
    sel = _single_user(conv)
    index = _as_tuple(sel.args[1]) if sel is not None and is_call(sel, operator.getitem) else ()
    if not (len(index) == 2 and index[0] is Ellipsis or len(index) == 3 and index[:2] == (slice(None), slice(None))):
        return None
    t, out_len = index[-1], length + 2 * padding - W + 1
    if not isinstance(t, int) or isinstance(t, bool) or not -out_len <= t < out_len:
        return None
    if t % out_len != length - W + padding:
        raise Miss(f"the conv output is read at position {t % out_len}, not {length - W + padding}, the one whose "
                   "taps are the last W inputs (the new one last)")
    end, tail = _follow_casts(sel)
    nodes = [full, *casts, conv, sel, *tail]
    activation = None
    nxt = _single_user(end)
    if nxt is not None and silu_input(nxt) is not None:
        activation = "silu"
        end, tail = _follow_casts(nxt)
        nodes += [nxt, *tail]
    return dict(weight=args["weight"], bias=args.get("bias"), activation=activation, last=end, nodes=nodes, W=W)


def match_returned_window(cat: torch.fx.Node, order: dict[torch.fx.Node, int]) -> dict[str, Any] | None:
    """A step that returns its new window ``cat([cs[..., 1:], x[..., None]], -1)`` and computes its
    output from the window (``(window * w).sum(-1)``) or from ``conv1d(cat([cs, x]))``; None if
    ``cat`` is no such window or nothing reads the output out, ``Miss`` if one nearly is."""
    try:
        m = _shifted_window(cat, _is_window_input)
    except Miss:
        return None  # a cat of some input's slice, with no sign of a decode step
    if m is None:
        return None
    cs = m["cs"]
    found = [(user, r) for user in cat.users for r in [_match_window_readout(user, cat)] if r is not None]
    found = [(user, {**r, "W": m["S"]}) for user, r in found]
    found += [(user, r) for user in cs.users if user is not m["reads"][0]
              for r in [_match_full_window_conv(user, cs, m["x3"])] if r is not None]
    if not found:
        return None
    if len(found) > 1:
        raise Miss(f"the new input is read out {len(found)} times ({[user.name for user, _ in found]})")
    first, r = found[0]
    early = [user.name for user in cat.users if user is not first and order[user] < order[r["last"]]]
    if early:
        raise Miss(f"the new window is used by {early} before the step's output is complete")
    return {**m, **r, "first": first, "writes": [], "form": "returned"}


def match_window_update(copy: torch.fx.Node, order: dict[torch.fx.Node, int]) -> dict[str, Any] | None:
    """A window roll (``find_window_write``) and its one readout, or None / ``Miss``."""
    m = find_window_write(copy, order)
    if m is None:
        return None
    cs, written = m["cs"], m["writes"][-1]
    lo, hi, steps = _step_window(cs, m["writes"], min(order[n] for n in m["reads"]), order[written], order)
    before = [n for n in cs.users if n not in m["reads"] + m["writes"] and lo < order[n] < order[written]]
    if before and steps is not None:
        raise Miss(f"{steps}: the conv state's uses {[n.name for n in before]} cannot be assigned to one step, "
                   "and moving this step's update into one op could change what they see")
    if before:
        raise Miss(f"the conv state is also used by {[n.name for n in before]} before its update: moving the "
                   "update into one op could change what they see")
    reads = [(cs, n) for n in cs.users if order[written] < order[n] < hi]
    reads += [(w, n) for w in m["writes"] for n in w.users]
    if m["window"] is not None:
        reads += [(m["window"], n) for n in m["window"].users
                  if n not in m["writes"] and not _is_copy_chain(n, copy, m["window"])]
    found = [(src, user, r) for src, user in reads for r in [_match_window_readout(user, src)] if r is not None]
    if len(found) == 1 and hi < float("inf"):
        last = found[0][2]["last"]
        if order[last] > hi:
            raise Miss("the step's output is complete only after the next step writes the conv state")
        # The next step's reads come after this step's output, where the op has written the
        # window: they see the new window, as they do now.
        reads = [(src, n) for src, n in reads if order[n] < order[last]]
    if len(found) != 1 or len(reads) != 1:
        raise Miss(f"the new window is used by {[user.name for _, user in reads]}, not by exactly one "
                   "(window * weight).sum(-1) readout")
    src, first, r = found[0]
    return {**m, **r, "first": first, "W": m["S"]}


def _wider_than_the_op(last: torch.fx.Node) -> str | None:
    """Why not, when the conv step's output is computed in a dtype the op does not compute in (an
    fp32 step whose weight is widened to fp64: probe CM, where the op was built with an fp64 x,
    raised inside the pass and cost the graph every rewrite); else None."""
    dtype = _tensor(last).dtype
    if dtype in SUPPORTED_DTYPES:
        return None
    return (f"the step computes its output in {dtype} (a factor, such as the weight, is {dtype}): the op "
            "computes in fp32 and returns fp32/bf16/fp16")


def check_window_update(m: dict[str, Any]) -> str | None:
    """The weight's taps line up with the window, widths and dtypes the op takes; else why not."""
    S, W, weight = m["S"], pinned_int(m["W"]), _tensor(m["weight"])
    dim = _tensor(m["cs"]).shape[1]
    if W is None:
        return f"kernel width W={m['W']} is not a static size"
    expect = (dim, W) if weight.dim() == 2 else (dim, 1, W)
    if not _same_shape(m["weight"], expect):
        return f"the weight has shape {tuple(weight.shape)}, expected {expect}: one tap per window slot"
    if not MIN_W <= W <= MAX_W:
        return f"kernel width W={W} unsupported (the op takes {MIN_W} <= W <= {MAX_W})"
    if not statically_known_true(S >= W - 1):
        return f"the state holds S={S} inputs, fewer than W-1={W - 1}"
    for name in ("x", "cs", "weight", "bias"):
        node = m["x3"] if name == "x" and m["x"] is None else m[name]
        t = _tensor(node) if node is not None else None
        if node is not None and (t is None or t.dtype not in SUPPORTED_DTYPES):
            return f"{name} has dtype {None if t is None else t.dtype}, not one of fp32/bf16/fp16"
    wide = _wider_than_the_op(m["last"])
    if wide is not None:
        return wide
    if m["bias"] is not None and not _same_shape(m["bias"], (dim,)):
        return f"bias has shape {tuple(_tensor(m['bias']).shape)}, expected ({dim},)"
    # The op goes right before the step's output: it reads x, the weight and the bias there, and
    # rolls the window there.
    order = node_order(m["last"].graph)
    end = order[m["last"]]
    scope = _ancestors(m["last"], *m["writes"], m["window"])
    reason = _rounding_refusal([m["x"] if m["x"] is not None else m["x3"], m["cs"], m["weight"], m["bias"]],
                               [m["last"], *m["writes"], m["window"]], m["last"], order)
    if reason is not None:
        return reason
    reason = _inputs_written({"x": m["x"] if m["x"] is not None else m["x3"], "weight": m["weight"], "bias": m["bias"]},
                             scope, order, end)
    if reason is not None:
        return reason
    if m["form"] == "returned":
        if _tensor(m["window"]).dtype != _tensor(m["cs"]).dtype:
            # The cat promoted the window past the state's dtype (a bf16 state, fp32 x): the op's
            # new state, in the state's dtype, would round the newest input the returned window holds.
            return (f"the returned window is {_tensor(m['window']).dtype}, the conv state "
                    f"{_tensor(m['cs']).dtype}: the op's new window would be rounded to the state's dtype")
        # The op's copy of the window is taken before the window's first use (window_update_pass):
        # the step's own reads of it must all see that value.
        cs, reads = m["cs"], [order[n] for n in m["cs"].users if n in scope]
        writer = _written_between(cs, order, min(order[n] for n in cs.users), max(reads, default=0))
        if writer is not None:
            return (f"{writer.name} writes the conv state's memory between its first use and the step's read of "
                    "it: the op's copy of the window would miss the write")
        return None
    return _state_moved(m["cs"], order, min(order[n] for n in m["reads"]), order[m["writes"][0]], end,
                        tuple(m["writes"]), {*m["reads"], *m["nodes"], m["first"]}, "conv state")


def _kept_rounding(graph: torch.fx.Graph, tap: torch.fx.Node, out_dtype: torch.dtype) -> torch.fx.Node:
    """``tap`` (rounded into a window narrower than ``out_dtype``) widened to ``out_dtype`` with
    its rounding kept: inductor folds a plain cast down and back up (``ssm::round_through``
    says when), so the widened value is rounded again through the op, which changes nothing
    where the fold did not happen."""
    dtype = _tensor(tap).dtype
    wide = _widen_for(graph, tap, out_dtype)
    if wide is tap:
        return tap
    kept = graph.call_function(torch.ops.ssm.round_through.default, (wide, dtype))
    propagate_val(kept)
    return kept


def _newest_tap(graph: torch.fx.Graph, m: dict[str, Any]) -> torch.fx.Node:
    """The new input as the step's readout sees it in the window: x as appended (``x3``, with
    the program's casts), promoted by the cat, then stored in the conv state (roll and copy_
    forms). A bf16 state under fp32 activations rounds the newest tap like every other, and the
    op, which reads x itself, must be handed x rounded the same way."""
    if m["x3"] is None:  # roll: conv_state[..., -1] = x
        x, dtypes = m["x"], [_tensor(m["cs"]).dtype]
    else:
        x = graph.call_method("squeeze", (m["x3"], -1))
        propagate_val(x)
        dtypes = [_tensor(m["window"]).dtype] + ([_tensor(m["cs"]).dtype] if m["form"] == "copy_" else [])
    for dtype in dtypes:
        x = _cast_to(graph, x, dtype)
    return x


def window_update_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    order = node_order(graph)
    for node in list(graph.nodes):
        if node not in order:
            continue  # erased by an earlier rewrite
        if is_method(node, "copy_") and len(node.args) == 2 and not node.kwargs:
            matcher = match_window_update
        elif is_call(node, torch.cat):
            matcher = match_returned_window
        else:
            continue
        m = _proved(ctx, CONV_FAMILY, node, lambda: matcher(node, order), check_window_update)
        if m is None:
            continue
        last = m["last"]
        refusal = (context_refusal(graph, [node, m["first"], last, *m["nodes"], *m["writes"],
                                           min(m["cs"].users, key=order.__getitem__)], last)
                   or _records_grad([*m["nodes"], last]))
        if refusal is not None:
            ctx.miss(CONV_FAMILY, refusal, [node])
            continue
        out_dtype = _tensor(last).dtype
        cs = m["cs"]
        if m["form"] == "returned" and not _read_in_place_of_copy(graph, cs):
            # The step leaves its input window alone: the op reads a copy taken before the
            # window's first read.
            with graph.inserting_before(min(m["cs"].users, key=order.__getitem__)):
                cs = graph.call_method("clone", (m["cs"],))
                propagate_val(cs)
        with graph.inserting_before(last):
            tap = _newest_tap(graph, m)
            x = _kept_rounding(graph, tap, out_dtype)
            weight = m["weight"] if _tensor(m["weight"]).dim() == 2 else depthwise_weight(graph, m["weight"])
            op, result, new = _call_update(
                graph, torch.ops.ssm.causal_conv1d_update.default, torch.ops.ssm.causal_conv1d_update_functional.default,
                (x, cs, weight, m["bias"], m["activation"]), 1, None if m["form"] == "returned" else cs,
                functional=m["form"] == "returned")
            result = _cast_to(graph, result, out_dtype)
        if "stack_trace" in node.meta:
            op.meta["stack_trace"] = node.meta["stack_trace"]
        last.replace_all_uses_with(result)
        if m["form"] == "returned":
            m["window"].replace_all_uses_with(new)
        # The conv pass may have refused the step's conv1d as a sequence conv (mamba.py's module,
        # padded by W - 1, read at one step: "not a slice of the time axis alone", probe CO); this
        # rewrite accounts for it.
        ctx.withdraw("conv1d", {n.name for n in m["nodes"] + [m["first"], last]})
        _erase_unused(graph, m["nodes"] + [m["first"], last] + m["writes"])
        order = node_order(graph)
        ctx.rewrite(CONV_FAMILY, {"roll": "roll; window[-1] = x", "rolled copy": "rolled[-1] = x; copy_(rolled)",
                                  "copy_": "copy_(cat(window[1:], x))",
                                  "returned": "cat(window[1:], x) returned"}[m["form"]]
                    + ("; conv1d(cat(window, x))[t]" if _tensor(m["weight"]).dim() == 3 else "; (window * w).sum(-1)")
                    + ("+b" if m["bias"] is not None else "") + ("+silu" if m["activation"] else ""),
                    [node, last], "ssm.causal_conv1d_update",
                    {"W": int(m["W"]), "S": _record(m["S"]), "activation": m["activation"],
                     "bias": m["bias"] is not None, "form": m["form"],
                     "writes": "state" if new is None else "new state" if m["form"] == "returned" else "new state, copied"})


def register(pm: PassManager) -> None:
    pm.add(CONV_FAMILY, conv_update_pass)
    pm.add(f"{CONV_FAMILY}_window", window_update_pass)
    pm.add(STATE_FAMILY, state_update_pass)
