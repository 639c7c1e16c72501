"""Small helpers shared by the passes: fake values, target matching, graph text, layout views.

The passes run on dynamo's FX graph (torch-level IR, before AOTAutograd): ``call_function`` on
``torch.*`` / ``operator.*`` / ``F.*``, ``call_method`` on tensor methods, fake tensors in
``node.meta["example_value"]`` (``"val"`` once something has propagated it). Everything here is
generic; no pattern knowledge lives in this file.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
import types
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import sympy
import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef

_CAST_METHODS = ("float", "half", "bfloat16", "double", "to", "type", "type_as")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# ``node.meta`` key marking a cast a rewrite emitted as an op's own output rounding (to the dtype
# the replaced code produced), as opposed to a cast the user wrote.
OP_ROUNDING = "ssm_op_rounding"
# ``node.meta`` key marking the flip along time a reverse loop's rewrite puts after the op: the
# op ran over flipped time, and this flip gives the loop's outputs back in its own order.
REVERSED_OUTPUT = "ssm_reversed_output"

SCAN_QUALNAME = "ssm::selective_scan"
SCAN_ARG_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus",
                  "initial_state", "return_last_state")
_SCAN_DEFAULTS = {"D": None, "z": None, "delta_bias": None, "delta_softplus": False,
                  "initial_state": None, "return_last_state": False}
_CAST_METHOD_DTYPES = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                       "bfloat16": torch.bfloat16}

__all__ = [
    "named_args",
    "mutates",
    "written_args",
    "written_in_place",
    "storage_of",
    "val",
    "set_val",
    "propagate_val",
    "is_tensor_node",
    "is_call",
    "is_method",
    "is_cast",
    "target_name",
    "kind_name",
    "normalized_graph_str",
    "dtype_of",
    "ndim_of",
    "shape_of",
    "permute_view",
    "time_slice",
    "parse_slice",
    "parse_index",
    "getitem",
    "SCAN_ARG_NAMES",
    "is_scan_node",
    "scan_nodes",
    "scan_args",
    "set_scan_args",
    "output_getitem",
    "cast_dtype",
    "is_lossless_cast",
    "view_perm",
    "Layout",
    "layout_source",
    "inverse",
    "node_order",
    "hoist_before",
    "HOIST_BLOCKED",
    "follow_views",
    "depthwise_weight",
    "is_context_boundary",
    "ContextRegions",
    "context_refusal",
    "grad_enabled_at",
    "detach_note",
    "narrowed_by_program",
]


def val(node: Any) -> Any:
    """The fake value of ``node`` (``meta["val"]``, else dynamo's ``meta["example_value"]``), or None.

    Non-Node arguments (ints, floats, None) are returned unchanged so callers can treat graph
    values and literals alike.
    """
    if not isinstance(node, torch.fx.Node):
        return node
    meta = node.meta
    return meta.get("val", meta.get("example_value"))


def set_val(node: torch.fx.Node, value: Any) -> None:
    """Record ``value`` under both keys, so dynamo-style and AOT-style readers both see it."""
    node.meta["val"] = value
    node.meta["example_value"] = value


def _fake_mode(values: Iterable[Any]):
    # The values' own mode, not the tracing context's: inside a backend, dynamo has already
    # switched the context to a fresh mode for AOTAutograd, and mixing the two is an error.
    from torch._subclasses.fake_tensor import FakeTensor

    return next((v.fake_mode for v in values if isinstance(v, FakeTensor)), None)


class _DropFakeTypeErrorLog(logging.Filter):
    """FakeTensorMode logs every TypeError an op raises, with its traceback, at ERROR level. An ssm
    op's fake impl raises one when it refuses inputs (A in bf16); the pass turns that into a
    near-miss that ``explain`` reports, so the traceback would only look like a crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "fake tensor raised TypeError"


_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")
_DROP_FAKE_TYPE_ERROR = _DropFakeTypeErrorLog()


@contextlib.contextmanager
def fake_dispatch(mode: Any) -> Iterator[None]:
    """Inside ``mode`` (the graph's fake mode), the dispatch dynamo runs its fake values under
    (``get_fake_value``): the Python dispatcher, through which composite ops (``F.linear``,
    ``matmul``) take their SymInt-aware decompositions. Without it, torch 2.11's C++ linear reads
    a 3-D input's sizes as ints on its fast path, and each read adds a guard pinning batch and L:
    a graph compiled under ``dynamic=True`` would recompile for every shape.

    The unbacked symbols a fake run creates (``eps.item()`` of a float that ``dynamic=True``
    passes as a tensor) are discarded: left pending in the shape env, AOTAutograd's trace of the
    graph would later fail on them (PendingUnbackedSymbolNotFound), and the backend would drop
    every rewrite. Every fake run of the passes goes through here."""
    shape_env = getattr(mode, "shape_env", None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mode)
        stack.enter_context(enable_python_dispatcher())
        if shape_env is not None:
            stack.enter_context(shape_env.ignore_fresh_unbacked_symbols())
        yield


def propagate_val(node: torch.fx.Node, mode_of: Any = None) -> Any:
    """Compute and record ``node``'s fake value by running its target on its inputs' fake values.

    Passes call this on the nodes they emit, so later passes (and ``explain``) can read shapes and
    dtypes from the rewritten graph exactly as from dynamo's. A factory (``torch.full``) has no
    fake inputs: it runs in the mode of ``mode_of``, a node of the same graph.
    """
    args = torch.fx.node.map_arg(node.args, val)
    kwargs = torch.fx.node.map_arg(node.kwargs, val)
    flat = torch.utils._pytree.tree_leaves((args, kwargs, val(mode_of)))
    mode = _fake_mode(flat)
    if mode is None:
        raise RuntimeError(f"propagate_val: no fake inputs found for node {node.name!r}")
    _FAKE_LOG.addFilter(_DROP_FAKE_TYPE_ERROR)
    try:
        with fake_dispatch(mode):
            if node.op == "call_function":
                out = node.target(*args, **kwargs)
            elif node.op == "call_method":
                self_arg, *rest = args
                out = getattr(self_arg, node.target)(*rest, **kwargs)
            else:
                raise RuntimeError(f"propagate_val: cannot run a {node.op} node ({node.name!r})")
    finally:
        _FAKE_LOG.removeFilter(_DROP_FAKE_TYPE_ERROR)
    set_val(node, out)
    return out


def is_tensor_node(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(val(node), torch.Tensor)


def is_call(node: Any, *targets: Any) -> bool:
    """``node`` is a ``call_function`` of one of ``targets`` (OpOverloadPackets match any overload)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    for t in targets:
        if node.target is t:
            return True
        if isinstance(t, torch._ops.OpOverloadPacket) and getattr(node.target, "overloadpacket", None) is t:
            return True
    return False


def is_method(node: Any, *names: str) -> bool:
    """``node`` is a ``call_method`` whose method name is one of ``names``."""
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target in names


SILU_TARGETS = (torch.nn.functional.silu, torch._C._nn.silu, torch.ops.aten.silu)


def silu_input(node: Any) -> torch.fx.Node | None:
    """``x`` when ``node`` is ``silu(x)`` returning a new tensor: ``F.silu(x)``, with ``inplace``
    False by position or keyword (``nn.SiLU()`` and HF's ``ACT2FN["silu"]`` record
    ``F.silu(x, False)``), ``aten.silu(x)``, or ``x.silu()``. None otherwise, an in-place silu
    included."""
    if is_call(node, *SILU_TARGETS):
        if not 1 <= len(node.args) <= 2 or set(node.kwargs) - {"inplace"}:
            return None
        if node.args[1:] not in ((), (False,)) or node.kwargs.get("inplace", False) is not False:
            return None
    elif not (is_method(node, "silu") and len(node.args) == 1 and not node.kwargs):
        return None
    x = node.args[0]
    return x if isinstance(x, torch.fx.Node) else None


def addcmul_operands(node: Any) -> tuple[Any, Any, Any] | None:
    """``(c, a, b)`` if ``node`` is ``torch.addcmul(c, a, b)`` or ``c.addcmul(a, b)`` with value 1:
    ``c + a * b``, a sum of a product spelled as one call."""
    if ((is_call(node, torch.addcmul) or is_method(node, "addcmul")) and len(node.args) == 3
            and set(node.kwargs) <= {"value"} and node.kwargs.get("value", 1) == 1):
        return node.args[0], node.args[1], node.args[2]
    return None


# The symbolic proofs (scan_loop's step, scan_assoc's combine) take numbers and sums exactly; the
# floats do not. To sympy ``dA*h + 1e16 - 1e16 + dBu`` is ``dA*h + dBu``, where the floats lose
# dA*h in the 1e16; ``x*1e200*1e200/1e200/1e200`` is x, where the floats overflow. So a number is
# taken only where it changes nothing (0 added, ±1 multiplied or divided by), and a sum whose two
# sides share a term, which algebra merges or cancels, is refused (``proof_sum``).
IDENTITY_SUMMANDS = (0,)
IDENTITY_FACTORS = (1, -1)


def proof_number(a: Any, identities: tuple[int, ...], refuse: Callable[[str], Exception], where: str = "") -> sympy.Integer:
    """The Python number ``a`` as an exact sympy integer if it is among ``identities``; else raise
    ``refuse`` with the reason (``where`` names the node, as " in add")."""
    if isinstance(a, (int, float)) and not isinstance(a, bool) and a in identities:
        return sympy.Integer(int(a))
    raise refuse(f"computes with the number {a!r}{where}: the proof takes it exactly, where the floats round "
                 "(a sum absorbs a term, a product overflows); only 0 added and ±1 multiplied are taken")


def proof_sum(left: sympy.Expr, right: sympy.Expr, refuse: Callable[[str], Exception], where: str = "") -> sympy.Expr:
    """``left + right``, or raise ``refuse`` when both sides hold a term (up to a numeric factor).

    Expanded, such a term is merged or cancelled by the algebra but rounded, absorbed or turned
    into inf - inf = NaN by the floats: ``(dA*h + x) - x`` is not dA*h where x is 1e16 or inf."""
    def terms(e: sympy.Expr) -> set[sympy.Expr]:
        return {t.as_coeff_Mul()[1] for t in sympy.Add.make_args(sympy.expand(e)) if t != 0}
    common = terms(left) & terms(right)
    if common:
        raise refuse(f"adds two sides that share the term {min(common, key=str)}{where}: the proof would merge or "
                     "cancel them, the floats round them (or give inf - inf = NaN)")
    return left + right


def is_exp(node: Any) -> bool:
    """``torch.exp(x)`` or ``x.exp()``."""
    return is_call(node, torch.exp) or is_method(node, "exp")


def is_cast(node: Any) -> bool:
    """A dtype cast (or a no-op ``.to(device=...)``): same values up to rounding, same axes."""
    if not is_method(node, *_CAST_METHODS):
        return False
    if node.target == "type_as" and (len(node.args) != 2 or node.kwargs):
        return False
    if node.target in ("to", "type"):
        extra = list(node.args[1:]) + [v for k, v in node.kwargs.items() if k in ("dtype", "device")]
        # ``x.to(other)`` takes other's dtype (and device, checked equal below): a cast too, with
        # other as its template only (probe BR: ``x.to(z.bfloat16())`` rounds x to bf16).
        template = node.target == "to" and len(node.args) == 2 and isinstance(val(node.args[1]), torch.Tensor)
        if not template and any(isinstance(a, torch.fx.Node) for a in extra):
            return False
        if any(k not in ("dtype", "device", "copy", "non_blocking") for k in node.kwargs):
            return False
    out, src = val(node), val(node.args[0])
    return (
        isinstance(out, torch.Tensor)
        and isinstance(src, torch.Tensor)
        and out.dtype in _FLOAT_DTYPES
        and src.dtype in _FLOAT_DTYPES
        and same_sizes(out.shape, src.shape)
        and out.device == src.device
    )


def dtype_of(node: Any) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def ndim_of(node: Any) -> int | None:
    v = val(node)
    return v.dim() if isinstance(v, torch.Tensor) else None


def same_sizes(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two size (or stride) tuples are equal, SymInts only where provably so (no guard
    is added)."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def same_shape(a: Sequence[Any] | None, b: Sequence[Any] | None) -> bool:
    """``same_sizes`` of two ``shape_of`` results, False where either is unknown. A plain ``==`` of
    symbolic shapes adds a guard for every size it compares (``batch != dim`` when a (dim, 1) D is
    compared with a (batch, dim, L) product), which recompiles the graph when a later call makes
    them equal; a match must not narrow the shapes the graph serves."""
    return a is not None and b is not None and same_sizes(a, b)


def shape_of(node: Any) -> tuple | None:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def target_name(node: torch.fx.Node) -> str:
    """A stable, qualified name for a node's target: ``torch.exp``, ``operator.mul``, ``.permute``."""
    target = node.target
    if node.op == "call_method":
        return f".{target}"
    if node.op != "call_function":
        return str(target)
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"torch.ops.{target}"
    if getattr(target, "__module__", None) == "_operator":
        return f"operator.{target.__name__}"
    try:
        return torch.fx.node._get_qualified_name(target)
    except (RuntimeError, AttributeError):
        return getattr(target, "__name__", repr(target))


def kind_name(node: torch.fx.Node) -> str:
    """The short kind a node is renumbered under in ``normalized_graph_str``."""
    if node.op == "placeholder":
        return "arg"
    if node.op == "get_attr":
        return "attr"
    if node.op == "output":
        return "output"
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_module":
        return "module"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        # ssm.selective_scan.default -> selective_scan
        return target._opname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", "call").lstrip("_")


def _fmt_slice(s: slice) -> str:
    parts = ["" if x is None else _fmt_arg(x, {}) for x in (s.start, s.stop)]
    text = ":".join(parts)
    if s.step is not None:
        text += f":{_fmt_arg(s.step, {})}"
    return text


def _fmt_arg(a: Any, names: dict[torch.fx.Node, str]) -> str:
    if isinstance(a, torch.fx.Node):
        return f"%{names.get(a, a.name)}"
    if isinstance(a, slice):
        return _fmt_slice(a)
    if isinstance(a, tuple):
        inner = ", ".join(_fmt_arg(x, names) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if isinstance(a, list):
        return "[" + ", ".join(_fmt_arg(x, names) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_fmt_arg(v, names)}" for k, v in a.items()) + "}"
    if a is Ellipsis:
        return "..."
    if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(a)
    return repr(a)


def _fmt_meta(node: torch.fx.Node) -> str:
    v = val(node)
    if isinstance(v, torch.Tensor):
        dt = str(v.dtype).removeprefix("torch.")
        return f"{dt}{list(v.shape)}"
    if isinstance(v, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in v):
        return "(" + ", ".join(f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}" for x in v) + ")"
    return ""


def normalized_graph_str(gm: torch.fx.GraphModule | torch.fx.Graph, with_meta: bool = False) -> str:
    """Stable text of a graph, for ``assertExpectedInline`` snapshots.

    Node names are renumbered per kind in graph order (``exp_1``, ``selective_scan_1``,
    ``getitem_3``), so snapshots don't depend on the names dynamo derived from intermediate
    values or on how many nodes a pass erased. Placeholders are named by their source name
    (``%L_u_``) and listed sorted by it: the order of a frame's inputs in dynamo's graph differs
    between torch versions (signature order in 2.11, first use in 2.13). ``with_meta`` appends
    ``dtype[shape]`` of each value.
    """
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    counts: dict[str, int] = {}
    names: dict[torch.fx.Node, str] = {}
    lines = []
    placeholders = sorted((n for n in graph.nodes if n.op == "placeholder"), key=lambda n: str(n.target))
    for node in placeholders + [n for n in graph.nodes if n.op != "placeholder"]:
        if node.op == "output":
            lines.append(f"return {_fmt_arg(node.args[0], names)}")
            continue
        if node.op == "placeholder":
            names[node] = str(node.target)
            rhs = "placeholder"
        else:
            kind = kind_name(node)
            counts[kind] = counts.get(kind, 0) + 1
            names[node] = f"{kind}_{counts[kind]}"
            if node.op == "get_attr":
                rhs = f"get_attr[{node.target}]"
            else:
                args = [_fmt_arg(a, names) for a in node.args]
                args += [f"{k}={_fmt_arg(v, names)}" for k, v in node.kwargs.items()]
                rhs = f"{target_name(node)}({', '.join(args)})"
        meta = f"  # {_fmt_meta(node)}" if with_meta and _fmt_meta(node) else ""
        lines.append(f"%{names[node]} = {rhs}{meta}")
    return "\n".join(lines) + "\n"


def pinned_int(size: Any) -> int | None:
    """``size`` as a Python int: an int, or a SymInt that the shape environment has already pinned
    to a number (under dynamic shapes a size that a static one fixes, e.g. a conv window's width
    by its product with a static weight; torch 2.11 also leaves such SymInts in checkpoint
    bodies); None for a size that is really symbolic. Reading it adds no guard."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        return size.node.maybe_as_int()
    return None


def detach_note(node: Any) -> str:
    """Why a scan operand built by the program reads as none of the op's: it is ``x.detach()``
    (probe BO). The op differentiates through every input it reads, so a cut inside the scan
    (``exp(Δ·A).detach()``, ``C[:, :, t].detach()``) has no place in it. Empty otherwise."""
    if not (isinstance(node, torch.fx.Node) and (is_method(node, "detach") or is_call(node, torch.detach))):
        return ""
    src = node.args[0] if node.args else node.kwargs.get("input")
    return (f" (it is {getattr(src, 'name', src)}.detach(), {node.name}: the program cuts the gradient there, "
            "inside the scan, and the op's own gradient would flow through it)")


def higher_order_op(node: Any) -> torch.fx.Node | None:
    """The higher-order op call that makes ``node`` (through getitems of its outputs), or None.
    Dynamo turns a custom ``autograd.Function`` and a hook on an intermediate tensor into one:
    what it does in the backward is the user's, and no op of ours may replace it."""
    while is_call(node, operator.getitem) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    if isinstance(node, torch.fx.Node) and node.op == "call_function" \
            and isinstance(node.target, torch._ops.HigherOrderOperator):
        return node
    return None


def hop_name(hop: torch.fx.Node) -> str:
    return f"torch.ops.higher_order.{hop.target.name()}"


def time_slice(node: Any) -> tuple[torch.fx.Node, int, int] | None:
    """``(base, axis, index)`` if ``node`` selects one index along one axis of ``base``.

    Accepts ``x[:, :, i]``, ``x[..., i, :]``, ``x[:, None, :, i]``, ``x.select(axis, i)``, item i
    of ``x.unbind(axis)``, and a width-1 piece squeezed along its axis (``x.narrow(axis, i, 1)``,
    ``x[:, :, i:i + 1]`` or item i of ``x.split(1, axis)``, then ``.squeeze(axis)`` or index 0
    along the axis: the same view as the select); negative indices are normalised, so
    ``x[:, -1]`` at step 0 reads as index L-1 (and is refused as a lag).
    """
    parsed = parse_slice(node)
    return None if parsed is None else parsed[:3]


def parse_slice(node: Any) -> tuple[torch.fx.Node, int, int, list[int | None]] | None:
    """``time_slice`` plus, for each axis of the base, the axis of ``node`` it became (None: the sliced axis)."""
    if not isinstance(node, torch.fx.Node):
        return None
    if is_call(node, torch.select) or is_method(node, "select"):
        if len(node.args) != 3 or node.kwargs:
            return None
        base, axis, idx = node.args
        vb = val(base)
        if not isinstance(axis, int) or not isinstance(vb, torch.Tensor):
            return None
        axis %= vb.dim()
        index = (slice(None),) * axis + (idx,)
    elif is_call(node, operator.getitem) and unbind_source(node.args[0]) is not None:
        # ``for x_t in x.unbind(dim)``: item i of the unbind is x.select(dim, i).
        base, axis = unbind_source(node.args[0])
        idx = node.args[1]
        if not isinstance(idx, int) or isinstance(idx, bool):
            return None
        index = (slice(None),) * axis + (idx,)
    elif is_call(node, operator.getitem):
        base, index = node.args
    elif is_method(node, "squeeze") or is_call(node, torch.squeeze):
        piece = squeezed_unit_piece(node)
        if piece is None:
            return None
        base, axis, idx = piece
        index = (slice(None),) * axis + (idx,)
    else:
        return None
    parsed = parse_index(base, index)
    if parsed is not None and parsed[2] == 0:
        # Index 0 of a width-1 piece along the same axis (``x[:, :, t:t + 1][:, :, 0]``, a
        # ``chunk(L, 2)`` item's ``[:, :, 0]``) is the same view as the select of x at t, as the
        # piece's squeeze is.
        piece = unit_piece(parsed[0], parsed[1])
        if piece is not None:
            return piece[0], parsed[1], piece[2], parsed[3]
    return parsed


def squeezed_unit_piece(squeeze: torch.fx.Node) -> tuple[torch.fx.Node, int, int] | None:
    """``(x, axis, i)`` if ``squeeze`` removes ``axis`` from a width-1 piece of ``x`` starting at
    i along that axis (``unit_piece``). Only an explicit squeeze axis counts: a bare
    ``squeeze()`` would also drop any other axis of size 1."""
    if len(squeeze.args) != 2 or squeeze.kwargs:
        return None
    piece, axis = squeeze.args
    vp = val(piece)
    if not isinstance(piece, torch.fx.Node) or not isinstance(vp, torch.Tensor) or not isinstance(axis, int):
        return None
    return unit_piece(piece, axis % vp.dim()) if vp.dim() else None


def unit_piece(piece: Any, axis: int | None = None) -> tuple[torch.fx.Node, int, int] | None:
    """``(x, axis, i)`` if ``piece`` is the width-1 piece of ``x`` at i along ``axis``, the axis
    kept: ``x.narrow(axis, i, 1)``, ``x[..., i:i + 1, ...]`` (every other axis whole), item i of
    ``x.split(1, axis)`` or of ``x.chunk(n, axis)`` / ``torch.tensor_split(x, n, axis)`` where x
    has n along the axis, or ``x.select(axis, i).unsqueeze(axis)``. ``axis`` None: the one axis
    the piece narrows."""
    vp = val(piece)
    if not isinstance(piece, torch.fx.Node) or not isinstance(vp, torch.Tensor) or vp.dim() == 0:
        return None
    found = _unit_piece(piece, vp)
    if found is None or not statically_known_true(vp.shape[found[1]] == 1) or (axis is not None and found[1] != axis):
        return None
    return found


def _unit_piece(piece: torch.fx.Node, vp: torch.Tensor) -> tuple[torch.fx.Node, int, int] | None:
    if is_method(piece, "narrow") or is_call(piece, torch.narrow):
        if len(piece.args) != 4 or piece.kwargs:
            return None
        base, dim, start, length = piece.args
        vb = val(base)
        if not isinstance(vb, torch.Tensor) or vb.dim() != vp.dim() or not isinstance(dim, int) or length != 1:
            return None
        return _unit_start(base, dim % vb.dim(), start)
    if is_method(piece, "unsqueeze") or is_call(piece, torch.unsqueeze):
        if len(piece.args) != 2 or piece.kwargs or not isinstance(piece.args[1], int):
            return None
        axis = piece.args[1] % vp.dim()
        sel = piece.args[0]
        if not (is_call(sel, torch.select) or is_method(sel, "select")) or len(sel.args) != 3 or sel.kwargs:
            return None
        base, dim, idx = sel.args
        vb = val(base)
        if not isinstance(vb, torch.Tensor) or vb.dim() != vp.dim() or not isinstance(dim, int) or dim % vb.dim() != axis:
            return None
        return _unit_start(base, axis, idx)
    if not is_call(piece, operator.getitem):
        return None
    src, item = piece.args
    if isinstance(item, int) and not isinstance(item, bool):
        return _split_item(src, item, vp)
    index = item if isinstance(item, tuple) else (item,)
    vs = val(src)
    if not isinstance(vs, torch.Tensor) or vs.dim() != vp.dim() or len(index) > vs.dim():
        return None
    narrowed = [k for k, x in enumerate(index) if not (isinstance(x, slice) and x == slice(None))]
    if len(narrowed) != 1:
        return None
    x = index[narrowed[0]]
    # ``x[..., i:i + 1]``, or an open stop (``x[..., -1:]``, ``x[..., L - 1:]``) whose width the
    # caller checks is 1.
    if not (isinstance(x, slice) and x.step in (None, 1) and isinstance(x.start, int)
            and (x.stop is None or isinstance(x.stop, int) and x.stop - x.start == 1 and (x.start >= 0) == (x.stop > 0))):
        return None
    return _unit_start(src, narrowed[0], x.start)


def _split_item(src: Any, item: int, vp: torch.Tensor) -> tuple[torch.fx.Node, int, int] | None:
    """Item ``item`` of a split into width-1 pieces: ``split(1, axis)``, or ``chunk(n, axis)`` /
    ``tensor_split(x, n, axis)`` with n the axis' size (known statically: a symbolic size could
    give pieces of other widths)."""
    if is_method(src, "split") or is_call(src, torch.split, torch.functional.split):
        names = ("split_size_or_sections", "split_size")
    elif is_method(src, "chunk") or is_call(src, torch.chunk):
        names = ("chunks",)
    elif is_method(src, "tensor_split") or is_call(src, torch.tensor_split):
        names = ("indices_or_sections", "sections")
    else:
        return None
    kwargs = dict(src.kwargs)
    base = src.args[0] if src.args else kwargs.pop("input", kwargs.pop("self", None))
    size = src.args[1] if len(src.args) > 1 else next((kwargs.pop(n) for n in names if n in kwargs), None)
    dim = src.args[2] if len(src.args) > 2 else kwargs.pop("dim", 0)
    vb = val(base)
    if (kwargs or len(src.args) > 3 or not isinstance(vb, torch.Tensor) or vb.dim() != vp.dim()
            or not isinstance(dim, int) or not isinstance(size, int) or isinstance(size, bool)):
        return None
    dim %= vb.dim()
    width = vb.shape[dim]
    if names[0] == "split_size_or_sections":
        if size != 1:
            return None
    elif not (isinstance(width, int) and size == width):
        return None
    return _unit_start(base, dim, item)


def _unit_start(base: torch.fx.Node, axis: int, start: int) -> tuple[torch.fx.Node, int, int] | None:
    # A negative start counts from the end, as in a select; ``parse_index`` normalises it.
    return (base, axis, start) if isinstance(start, int) and not isinstance(start, bool) else None


def unbind_source(node: Any) -> tuple[torch.fx.Node, int] | None:
    """``(x, dim)`` if ``node`` is ``x.unbind(dim)`` / ``torch.unbind(x, dim)``, dim normalised."""
    if not (is_call(node, torch.unbind) or is_method(node, "unbind")) or not node.args:
        return None
    x = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    vx = val(x)
    if not isinstance(x, torch.fx.Node) or not isinstance(vx, torch.Tensor) or not isinstance(dim, int):
        return None
    if set(node.kwargs) - {"dim"} or len(node.args) > 2:
        return None
    return x, dim % vx.dim()


def parse_index(base: Any, index: Any) -> tuple[torch.fx.Node, int, int, list[int | None]] | None:
    """``parse_slice`` for ``base[index]`` (also the target of ``operator.setitem``)."""
    index = index if isinstance(index, tuple) else (index,)
    vb = val(base)
    if not isinstance(base, torch.fx.Node) or not isinstance(vb, torch.Tensor):
        return None
    ints = [x for x in index if isinstance(x, int) and not isinstance(x, bool)]
    if len(ints) != 1 or sum(x is Ellipsis for x in index) > 1:
        return None
    if not all(x is None or x is Ellipsis or isinstance(x, int) or (isinstance(x, slice) and x == slice(None))
               for x in index):
        return None
    n_real = sum(1 for x in index if x is not None and x is not Ellipsis)
    full: list[Any] = []
    for x in index:
        full.extend([slice(None)] * (vb.dim() - n_real) if x is Ellipsis else [x])
    full.extend([slice(None)] * (vb.dim() - sum(1 for x in full if x is not None)))
    base_to_out: list[int | None] = []
    out_axis = 0
    axis = idx = None
    for x in full:
        if x is None:
            out_axis += 1
        elif isinstance(x, int):
            axis, idx = len(base_to_out), x
            base_to_out.append(None)
        else:
            base_to_out.append(out_axis)
            out_axis += 1
    size = vb.shape[axis]
    if idx < 0:
        # Only a concrete length says which step ``x[:, -1]`` is.
        if not is_concrete_int(size):
            return None
        idx += int(size)
    # A symbolic time axis is accepted: unrolling specialises the length of the tensor the loop
    # ranges over, while another tensor the loop indexes (dynamo's recompile at a new length)
    # keeps a fresh symbol that is only known to be long enough. Callers compare that length
    # with the loop's before relying on it.
    if not (0 <= idx and statically_known_true(idx < size)):
        return None
    return base, axis, idx, base_to_out


def permute_view(graph: torch.fx.Graph, node: torch.fx.Node, perm: Sequence[int]) -> torch.fx.Node:
    """Insert ``node.permute(perm)`` (a view, no copy) unless ``perm`` is the identity.

    Call inside ``graph.inserting_*`` to control placement; the new node gets a fake value.
    """
    perm = tuple(int(p) for p in perm)
    if perm == tuple(range(len(perm))):
        return node
    out = graph.call_method("permute", (node, perm))
    propagate_val(out)
    return out


def getitem(graph: torch.fx.Graph, node: torch.fx.Node, index: Any) -> torch.fx.Node:
    """Insert ``operator.getitem(node, index)`` with its fake value."""
    out = graph.call_function(operator.getitem, (node, index))
    propagate_val(out)
    return out


# ---------------------------------------------------------------------------------------------
# Scan-op helpers (used by delta.py, tail.py, fuse.py and the scan passes)
# ---------------------------------------------------------------------------------------------

def is_scan_node(node: Any) -> bool:
    """``node`` calls ``ssm::selective_scan`` (the packet, as a user's direct call records it, or
    ``.default``, as the scan passes emit it)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.name() == SCAN_QUALNAME
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name == SCAN_QUALNAME
    return False


def scan_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if is_scan_node(n)]


def scan_args(node: torch.fx.Node) -> dict[str, Any]:
    """The op's arguments by schema name, whether they were passed positionally or by keyword."""
    out = dict(_SCAN_DEFAULTS)
    out.update(zip(SCAN_ARG_NAMES, node.args))
    out.update(node.kwargs)
    return out


def set_scan_args(node: torch.fx.Node, args: dict[str, Any]) -> None:
    """Rewrite ``node`` as ``ssm.selective_scan.default`` with all eleven arguments positional,
    the form the scan passes emit, so later passes and snapshots see one canonical call."""
    node.target = torch.ops.ssm.selective_scan.default
    node.args = tuple(args[name] for name in SCAN_ARG_NAMES)
    node.kwargs = {}


def output_getitem(scan: torch.fx.Node, index: int) -> torch.fx.Node | None:
    """The unique ``getitem(scan, index)`` user, or None (absent or duplicated)."""
    found = [u for u in scan.users if is_call(u, operator.getitem) and u.args[1] == index]
    return found[0] if len(found) == 1 else None


# ---------------------------------------------------------------------------------------------
# Layout helpers: permutation views and dtype casts
# ---------------------------------------------------------------------------------------------

def cast_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype ``node`` casts its first input to, if it is nothing but a float dtype cast."""
    if is_method(node, *_CAST_METHOD_DTYPES) and len(node.args) == 1 and not node.kwargs:
        return _CAST_METHOD_DTYPES[node.target]
    if is_method(node, "to", "type") and not node.kwargs and len(node.args) == 2:
        dtype = node.args[1]
        if isinstance(dtype, torch.dtype) and dtype in _FLOAT_DTYPES:
            return dtype
    if is_method(node, "to") and set(node.kwargs) == {"dtype"} and len(node.args) == 1:
        dtype = node.kwargs["dtype"]
        if dtype in _FLOAT_DTYPES:
            return dtype
    # ``x.to(other)`` takes other's dtype and device: a float dtype cast like ``type_as`` where
    # ``is_cast`` proves the device unchanged (probe DD: ``y.to(u) + u * D`` left the skip and
    # gate unfolded, with no reason, where ``y.to(u.dtype)`` folded).
    template = is_method(node, "to") and len(node.args) == 2 and not node.kwargs \
        and isinstance(val(node.args[1]), torch.Tensor) and is_cast(node)
    if template or (is_method(node, "type_as") and len(node.args) == 2):
        out = val(node)
        return out.dtype if isinstance(out, torch.Tensor) and out.dtype in _FLOAT_DTYPES else None
    return None


def readout_decision(layout: str, y: Any, c_roles: tuple[str, ...]) -> dict[str, str]:
    """A readout rewrite's decision for ``explain``: the layout; a C that is the same at every
    step (``c_roles`` without "t"); and, where the readout ``y`` the
    op replaces is 16-bit (autocast's einsum or matmul, a 16-bit model's readout), that eager's
    product reads h rounded to that dtype while the op contracts its fp32 state and rounds y
    once (README, autocast)."""
    decision = {"layout": layout}
    if "t" not in c_roles:
        decision["C"] = "time-invariant, (dim, N)" if "d" in c_roles else "time-invariant, (N,) for every channel"
    dtype = dtype_of(y)
    if dtype in HALF_DTYPES:
        decision["y"] = f"contracted in fp32, rounded once to {dtype} (eager's product reads h rounded to it)"
    return decision


def float64_readout(y: Any, u: Any) -> str | None:
    """Why a readout ``y`` cannot be the op's: eager contracts it in float64 (a float64 C, or
    an initial state, promotes it) while the op, whose state and contraction are float64 only for
    a float64 u, would contract in float32 and widen y afterwards. Else None."""
    if dtype_of(y) == torch.float64 and dtype_of(u) != torch.float64:
        return (f"the readout is computed in float64 (C or the state is float64) but u is {dtype_of(u)}: "
                "the op would contract in float32 and only widen y to float64")
    return None


def is_lossless_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every ``src`` value is exactly representable in ``dst`` (bf16/fp16 -> fp32 -> fp64)."""
    rank = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
    return src == dst or rank.get(dst, 0) > rank.get(src, 0)


def dropped_rounding(nodes: Iterable[Any], inputs: Iterable[Any], also_read: Iterable[Any] = (),
                     inputs_as_read: bool = False) -> str | None:
    """Why an op that reads ``inputs`` cannot replace ``nodes``: one of them rounds, or None.

    The ops keep fp32 states (fp64 ones for fp64 inputs) and round once, at their outputs. A
    narrowing cast among the nodes they replace is a rounding the op does not make. It is
    accepted only when its dtype holds every value of the op's narrowest floating input: HF's
    ``ssm_state.to(dtype)`` in a bf16 model, whose inputs are bf16 already, rounds no finer than
    the inputs were, and the op's fp32 state is at least as accurate as the program's. Rounding
    finer than that (``h = h.bfloat16()`` each step of an fp32 loop, ``bf16(Δ·B)`` there) is the
    program's function, which the op would change. So is a rounding of an input itself that the
    program then computes with in a wider dtype (``A.bfloat16().float()`` where the op reads A,
    rather than ``A.to(delta.dtype)`` in bf16 arithmetic): ``also_read`` are inputs that count
    for that alone (A and an initial state, whose fp32 is the op's choice, not the activations').
    With ``inputs_as_read`` (the scan passes, whose op reads each source as the graph holds it), an
    activation of ``inputs`` rounded is the program's whatever it computes in afterwards (fp32
    inputs cast to bf16 at the top of a bf16 block). The decode passes read a step's rounded x
    through ``ssm::round_through`` themselves.
    """
    inputs = [n for n in inputs if isinstance(n, torch.fx.Node)]
    floats = [d for d in (dtype_of(n) for n in inputs) if d in _FLOAT_DTYPES]
    read = inputs + [n for n in also_read if isinstance(n, torch.fx.Node)]
    for n in nodes:
        if not is_cast(n):
            continue
        src, dst = dtype_of(n.args[0]), dtype_of(n)
        if is_lossless_cast(src, dst):
            continue
        # A rewrite's own output rounding (``OP_ROUNDING``: autocast's dtype for the causal conv's
        # output) is not the program quantizing an input: the op reading the unrounded output
        # computes at least as precisely as eager under autocast did.
        widened = _widened_after(n)
        # ``A.bfloat16().float()``: the program quantizes what the op reads at full precision,
        # then computes with it in the wider dtype. An activation the op reads (u, Δ, B, C) is
        # the program's also where it then computes in the narrow dtype (fp32 inputs cast to bf16
        # at the top of a bf16 block, probe BY): the other inputs' 16 bits do not make this
        # input's rounding any less the program's.
        rounded = (None if n.meta.get(OP_ROUNDING) or not (widened or inputs_as_read) else
                   _rounded_input(n.args[0], read if widened else inputs))
        if rounded is not None and not is_lossless_cast(dtype_of(rounded), dst):
            then = "then computes with it in a wider dtype" if widened else "then computes with the rounded value"
            return (f"{n.name} rounds {src} to {dst}: it quantizes the op's input {rounded.name}, which the "
                    f"program {then}; the op would read it unrounded")
        if any(is_lossless_cast(f, dst) for f in floats):
            continue
        return (f"{n.name} rounds {src} to {dst}, which cannot hold every value of the op's inputs "
                f"({', '.join(sorted({str(f) for f in floats}))}): the op would not make this rounding, "
                "it reads its inputs and keeps its states unrounded")
    return None


VIEW_OPS = ("view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "select", "narrow",
            "__getitem__", "getitem", "t", "unflatten", "flatten", "movedim", "as_strided", "chunk", "split", "unbind")
# Ops whose elements are elements of their first argument: a cast of one rounds those values.
_ELEMENT_VIEWS = frozenset(VIEW_OPS + ("expand_as", "contiguous"))


def bare_name(node: torch.fx.Node) -> str:
    """A call's target without its namespace: ``view`` for ``x.view(...)`` and ``torch.view``."""
    return node.target if node.op == "call_method" else getattr(node.target, "__name__", "")


def exp_node_behind(node: Any, depth: int = 6) -> torch.fx.Node | None:
    """The exp that ``node`` is, or is through at most ``depth`` casts and element views; else None."""
    for _ in range(depth):
        if not isinstance(node, torch.fx.Node) or not node.args:
            return None
        if is_exp(node):
            return node
        if not (is_cast(node) or node.op in ("call_method", "call_function") and bare_name(node) in _ELEMENT_VIEWS):
            return None
        node = node.args[0]
    return None


def exp_behind(node: Any, depth: int = 6) -> bool:
    """Whether ``node`` is an exp, or is one through at most ``depth`` casts and element views."""
    return exp_node_behind(node, depth) is not None


def _widened_after(cast: torch.fx.Node) -> bool:
    """Whether a use of ``cast`` (through element views) computes in a dtype wider than its own: a
    round trip, or arithmetic that promotes the rounded value back."""
    narrow, stack, seen = dtype_of(cast), list(cast.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op in ("call_method", "call_function") and bare_name(user) in _ELEMENT_VIEWS:
            stack.extend(user.users)
            continue
        wide = dtype_of(user)
        if wide in _FLOAT_DTYPES and wide != narrow and is_lossless_cast(narrow, wide):
            return True
    return False


def _rounded_input(node: Any, inputs: list[torch.fx.Node]) -> torch.fx.Node | None:
    """The op input that ``node`` is made of by views and lossless casts alone, when that input is
    wider than ``node`` (then a narrowing cast of ``node`` rounds the input itself), else None."""
    while isinstance(node, torch.fx.Node):
        if node in inputs:
            return node
        if is_cast(node):
            if not is_lossless_cast(dtype_of(node.args[0]), dtype_of(node)):
                return None
        elif node.op not in ("call_method", "call_function") or bare_name(node) not in _ELEMENT_VIEWS:
            return None
        node = node.args[0] if node.args else None
    return None


def _widened_from(node: Any) -> Any:
    """What ``node`` is a lossless widening of, through element views and lossless casts."""
    while isinstance(node, torch.fx.Node) and node.args:
        if is_cast(node) and is_lossless_cast(dtype_of(node.args[0]), dtype_of(node)):
            node = node.args[0]
        elif not is_cast(node) and node.op in ("call_method", "call_function") and bare_name(node) in _ELEMENT_VIEWS:
            node = node.args[0]
        else:
            break
    return node


def narrowed_by_program(node: Any) -> torch.fx.Node | None:
    """The cast that makes ``node`` (through element views) by rounding a wider floating value,
    or None. 16-bit arithmetic on such a value is a precision the program chose for it
    (``softplus(dt.half() + b.half())`` in an fp32 program, ``silu(z.bfloat16())``), unlike
    the arithmetic of a 16-bit model or of autocast, whose values come 16-bit from a linear."""
    node = _widened_from(node)
    while isinstance(node, torch.fx.Node) and is_cast(node):
        src, dst = dtype_of(node.args[0]), dtype_of(node)
        if src not in _FLOAT_DTYPES or dst not in _FLOAT_DTYPES:
            return None
        origin = _widened_from(node.args[0])
        if dtype_of(origin) not in _FLOAT_DTYPES or not is_lossless_cast(dtype_of(origin), dst):
            return node
        # ``z.float().to(torch.bfloat16)`` of a bf16 z rounds nothing: the values were bf16.
        node = origin
    return None


def behind_lossless_casts(nodes: Iterable[Any]) -> list[torch.fx.Node]:
    """``nodes`` and what each is a lossless cast (and view) of: the inputs an op reads, for
    ``dropped_rounding``, as narrow as the program's own values are (HF's ``hidden_states.float()``
    of a bf16 model holds bf16 values)."""
    out = [n for n in nodes if isinstance(n, torch.fx.Node)]
    return out + [src.base for src in map(layout_source, out) if src.lossless]


# Methods that read only the dtype, device or shape of their other tensor arguments.
_METADATA_OF_OTHERS = frozenset({"to", "type_as", "view_as", "reshape_as", "expand_as"})


def data_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The inputs whose values ``node``'s value is computed from: not those it reads a dtype or a
    shape off (``x.type_as(other)``), nor sizes (``is_metadata``)."""
    if node.op == "call_method" and node.target in _METADATA_OF_OTHERS:
        first = node.args[0] if node.args else None
        return [first] if isinstance(first, torch.fx.Node) else []
    return [a for a in node.all_input_nodes if not is_metadata(a)]


def is_metadata(node: torch.fx.Node) -> bool:
    """A size, dim, dtype or device (not a number read off a tensor's values by ``item``)."""
    if node.op in ("call_method", "call_function") and bare_name(node) in ("item", "tolist", "_local_scalar_dense"):
        return False
    return isinstance(val(node), (int, torch.SymInt, torch.Size, torch.dtype, torch.device)) and not isinstance(
        val(node), bool)


def op_region(sources: Iterable[Any], sinks: Iterable[torch.fx.Node],
              pos: dict[torch.fx.Node, int], keep_upstream: bool = False,
              values_only: bool = False) -> list[torch.fx.Node]:
    """What an op that reads ``sources`` and stands for ``sinks`` computes: the nodes that depend
    on a source and that a sink depends on (sinks included), in graph order.

    What a source is itself computed from (``x_proj`` before B, when u is also a source) is the
    op's input, not its work, and is left out, unless ``keep_upstream``: a node that feeds one
    source may also lie on another source's way to the sinks (``Cf = C.bfloat16().float()``
    read by the readout and summed into Δ), and then the op computes past it too. The search
    stops at the first source, so it costs the size of the region, not of the graph. With
    ``values_only`` the region follows only the values nodes compute from (``data_inputs``):
    ``x.type_as(zb)`` reads zb's dtype alone, so a rounding zb = z.bfloat16() is no part of the
    values the op computes (probe BR).
    """
    inputs = data_inputs if values_only else (lambda n: n.all_input_nodes)
    srcs = {s for s in sources if isinstance(s, torch.fx.Node)}
    if not srcs:
        return []
    lo = min(pos[s] for s in srcs)
    upstream: set[torch.fx.Node] = set()
    stack = [] if keep_upstream else list(srcs)
    while stack:
        for i in stack.pop().all_input_nodes:
            if i not in upstream and pos[i] > lo:
                upstream.add(i)
                stack.append(i)
    reach: dict[torch.fx.Node, bool] = {s: True for s in srcs}
    stack = [n for n in sinks if isinstance(n, torch.fx.Node)]
    while stack:
        n = stack[-1]
        if n in reach:
            stack.pop()
            continue
        pending = [i for i in inputs(n) if i not in reach and pos[i] > lo]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        reach[n] = any(reach.get(i, False) for i in inputs(n))
    return sorted((n for n, r in reach.items() if r and n not in srcs and n not in upstream), key=pos.__getitem__)


def _dims(args: Sequence[Any]) -> list[int]:
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        return list(args[0])
    return list(args)


def view_perm(node: torch.fx.Node) -> list[int] | None:
    """If ``node`` is a pure axis permutation of its first input, ``sigma`` with
    ``node`` axis ``m`` = input axis ``sigma[m]``; else None. ``.contiguous()`` counts (it copies,
    but the values are the same)."""
    if not isinstance(node, torch.fx.Node) or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    out = val(node)
    if not isinstance(out, torch.Tensor):
        return None
    n = out.dim()
    ident = list(range(n))
    if (is_method(node, "transpose", "swapaxes", "swapdims")
            or is_call(node, torch.transpose, torch.swapaxes, torch.swapdims)):
        if len(node.args) != 3 or node.kwargs:
            return None
        i, j = (d % n for d in node.args[1:])
        ident[i], ident[j] = ident[j], ident[i]
        return ident
    if is_method(node, "permute") or is_call(node, torch.permute):
        dims = node.kwargs.get("dims", None) or _dims(node.args[1:])
        return [d % n for d in dims] if sorted(d % n for d in dims) == ident else None
    if is_method(node, "movedim", "moveaxis") or is_call(node, torch.movedim, torch.moveaxis):
        src, dst = node.args[1:3] if len(node.args) == 3 else (None, None)
        src, dst = ([src], [dst]) if isinstance(src, int) and isinstance(dst, int) else (src, dst)
        if (not isinstance(src, (list, tuple)) or not isinstance(dst, (list, tuple)) or len(src) != len(dst)
                or not all(isinstance(d, int) for d in (*src, *dst))):
            return None
        src, dst = [d % n for d in src], [d % n for d in dst]
        if len(set(src)) != len(src) or len(set(dst)) != len(dst):
            return None
        # torch.movedim: each source axis lands at its destination; the other axes keep their
        # order in the places left (probe CW: ``movedim((2, 3), (3, 2))`` was not seen through).
        perm: list[int | None] = [None] * n
        for s_, d_ in zip(src, dst):
            perm[d_] = s_
        rest = iter(i for i in ident if i not in src)
        return [next(rest) if p is None else p for p in perm]
    if is_method(node, "t") or is_call(node, torch.t):
        return ident[::-1] if n == 2 else (ident if n < 2 else None)
    if is_call(node, getattr) and node.args[1] == "mT" and n >= 2:
        ident[-1], ident[-2] = ident[-2], ident[-1]
        return ident
    if is_call(node, getattr) and node.args[1] == "T":  # every axis reversed (a transpose in 2-D)
        return ident[::-1]
    if is_method(node, "contiguous"):
        return ident
    return None


class Layout(NamedTuple):
    """``node`` axis ``i`` holds ``base`` axis ``perm[i]``; ``lossless`` is False if a rounding
    cast lies between them."""

    base: torch.fx.Node
    perm: tuple[int, ...]
    lossless: bool


def flip_dims(node: Any) -> frozenset | None:
    """The axes ``node`` flips (``x.flip(k)``, ``torch.flip(x, dims)``), else None."""
    if not (isinstance(node, torch.fx.Node) and (is_method(node, "flip") or is_call(node, torch.flip))
            and len(node.args) == 2 and not node.kwargs):
        return None
    dims = node.args[1] if isinstance(node.args[1], (tuple, list)) else (node.args[1],)
    if not all(isinstance(d, int) for d in dims):
        return None
    return frozenset(d % len(shape_of(node)) for d in dims)


def layout_source(node: torch.fx.Node, allow_casts: bool = True) -> Layout:
    """Follow permutation views (and float casts when ``allow_casts``) back from ``node``."""
    perm = list(range(len(shape_of(node) or ())))
    lossless = True
    while True:
        sigma = view_perm(node)
        if sigma is not None:
            perm = [sigma[p] for p in perm]
            node = node.args[0]
            continue
        dtype = cast_dtype(node) if allow_casts else None
        if dtype is not None and isinstance(node.args[0], torch.fx.Node):
            src = val(node.args[0])
            if not isinstance(src, torch.Tensor) or src.dtype not in _FLOAT_DTYPES:
                break
            lossless = lossless and is_lossless_cast(src.dtype, dtype)
            node = node.args[0]
            continue
        break
    return Layout(node, tuple(perm), lossless)


def view_chain(node: torch.fx.Node, stop: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes from ``node`` back to (not including) ``stop`` along first arguments: the views
    and casts ``layout_source`` followed to its ``base``."""
    chain = []
    while node is not stop:
        chain.append(node)
        node = node.args[0]
    return chain


def inverse(perm: Sequence[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def node_order(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


# ``hoist_before``'s answer when the value depends on the node it was to be moved above.
HOIST_BLOCKED = "computed from the node it would have to be moved above"


def hoist_before(node: torch.fx.Node, anchor: torch.fx.Node, blocked: torch.fx.Node) -> str | None:
    """Move ``node`` (and the inputs it needs) above ``anchor`` so ``anchor`` may use it.

    Returns None when done; otherwise moves nothing and returns why: ``HOIST_BLOCKED`` if ``node``
    depends on ``blocked`` (the scan itself: a value computed from the scan's output can't become
    one of its inputs), or a context refusal if a node to move would leave its grad-mode /
    autocast / functorch region. Only called on pure tensor ops (the D/z/bias chains the user
    wrote after the scan), so moving them within a region changes no result.
    """
    order = node_order(anchor.graph)
    to_move: list[torch.fx.Node] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if n is blocked:
            return HOIST_BLOCKED
        if order[n] < order[anchor] or n in to_move:
            continue
        if n.op not in ("call_function", "call_method"):
            return HOIST_BLOCKED
        to_move.append(n)
        stack.extend(n.all_input_nodes)
    if to_move:
        refusal = ContextRegions(anchor.graph).refusal(to_move, anchor) or _move_refusal(to_move, anchor, order)
        if refusal is not None:
            return refusal
    for n in sorted(to_move, key=order.__getitem__):
        anchor.prepend(n)
    return None


# Ops that draw random numbers, by name (torch's function, method and aten spellings): moved
# past another draw, one would take the other's numbers from the generator. The fragments also
# catch what exact names miss (F.gumbel_softmax, an op a library wraps whole): a false positive
# only refuses a move. The exact names are those no fragment covers.
_RANDOM_FRAGMENTS = ("rand", "dropout", "gumbel", "bernoulli", "multinomial", "poisson", "sample", "noise")
_RANDOM_NAMES = frozenset({"normal", "normal_", "log_normal_", "uniform_", "exponential_", "geometric_", "cauchy_",
                           "rrelu"})


def draws_random(node: torch.fx.Node) -> bool:
    """``node`` draws random numbers (by its op's tag, else by name; see above)."""
    if getattr(node.target, "tags", None) and torch.Tag.nondeterministic_seeded in node.target.tags:
        return True
    name = bare_name(node).split(".")[0]
    return name in _RANDOM_NAMES or any(f in name for f in _RANDOM_FRAGMENTS)


def _move_refusal(to_move: list[torch.fx.Node], anchor: torch.fx.Node, order: dict[torch.fx.Node, int]) -> str | None:
    """Why moving ``to_move`` above ``anchor`` could change what they compute, or None: one of
    them writes in place or draws random numbers, or memory one of them reads is written between
    ``anchor`` and where it was (``w.mul_(2); z = w + 0.5`` after the scan: z hoisted above the
    scan would read w before the write)."""
    for n in to_move:
        if mutates(n):
            return f"{n.name} writes in place, and would be moved above {anchor.name}"
        if draws_random(n):
            return f"{n.name} draws random numbers, and would be moved above {anchor.name} and the draws between"
    # The last mover to read each storage: a write before it changes what it reads, even when an
    # earlier mover read the same memory before the write (t = z * 1; z.mul_(2); t + z).
    readers: dict[Any, torch.fx.Node] = {}
    for n in sorted(to_move, key=order.__getitem__):
        for a in n.all_input_nodes:
            if isinstance(val(a), torch.Tensor):
                readers[storage_of(a)] = n
    moved = set(to_move)
    last = max(order[n] for n in to_move)
    last_reader = max(readers.values(), key=order.__getitem__, default=None)
    for node in anchor.graph.nodes:
        if order[node] < order[anchor] or node in moved or not mutates(node):
            continue
        if order[node] > last:
            break
        for w in [storage_of(a) for a in written_args(node) if isinstance(val(a), torch.Tensor)]:
            # An unknown storage (None) on either side counts as shared with every reader.
            reader = last_reader if w is None or None in readers else readers.get(w)
            if reader is not None and order[node] < order[reader]:
                return f"{node.name} writes memory that {reader.name} reads, between {anchor.name} and {reader.name}"
    return None


def follow_views(node: torch.fx.Node) -> tuple[torch.fx.Node, tuple[int, ...], list[torch.fx.Node]]:
    """Follow ``node`` forward through single-user permutation views and float casts.

    Returns ``(end, perm, chain)``: ``end`` axis ``i`` holds ``node`` axis ``perm[i]``; ``chain`` is
    the nodes passed, in order. A rewrite that replaces ``node`` can then hand ``end``'s users one
    permuted view instead of re-creating the user's chain of transposes.
    """
    perm, chain = tuple(range(len(shape_of(node) or ()))), []
    while len(node.users) == 1:
        (user,) = node.users
        if not user.args or user.args[0] is not node:
            break
        sigma = view_perm(user)
        back = _unit_round_trip(user)
        if back is not None:
            # ``y[..., None].squeeze(-1)``: a readout collected with a size-1 axis, then squeezed
            # (probe CG) is y itself.
            chain.append(user)
            user = back
        elif sigma is not None:
            perm = tuple(perm[s] for s in sigma)
        elif cast_dtype(user) is None:
            break
        node = user
        chain.append(user)
    return node, perm, chain


def _unit_round_trip(node: torch.fx.Node) -> torch.fx.Node | None:
    """The single user of ``node`` that squeezes the one size-1 axis ``node`` inserts into its
    input (``x[:, :, None]`` or ``x.unsqueeze(k)``, then ``.squeeze(k)``), else None."""
    src = node.args[0] if node.args else None
    if not isinstance(src, torch.fx.Node) or not isinstance(val(src), torch.Tensor) or len(node.users) != 1:
        return None
    ndim = val(src).dim() + 1
    if is_call(node, operator.getitem):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        nones = [i for i, x in enumerate(index) if x is None]
        dots = [i for i, x in enumerate(index) if x is Ellipsis]
        rest = [x for x in index if x is not None and x is not Ellipsis]
        if len(nones) != 1 or len(dots) > 1 or len(index) - len(dots) > ndim or any(x != slice(None) for x in rest):
            return None
        # After an Ellipsis the index counts from the last axis (``y[..., None]``).
        axis = nones[0] if not dots or nones[0] < dots[0] else ndim - (len(index) - nones[0])
    elif (is_method(node, "unsqueeze") or is_call(node, torch.unsqueeze)) and len(node.args) == 2 \
            and isinstance(node.args[1], int) and not node.kwargs:
        axis = node.args[1] % ndim
    else:
        return None
    (squeeze,) = node.users
    if not (is_method(squeeze, "squeeze") or is_call(squeeze, torch.squeeze)) or squeeze.args[0] is not node \
            or len(squeeze.args) != 2 or squeeze.kwargs or not isinstance(squeeze.args[1], int):
        return None
    return squeeze if squeeze.args[1] % ndim == axis else None


def depthwise_weight(graph: torch.fx.Graph, weight: torch.fx.Node) -> torch.fx.Node:
    """A depthwise conv's (dim, 1, W) weight as the (dim, W) the ssm conv ops take, with no copy:
    the 2-D tensor the user unsqueezed, else a ``squeeze(1)`` view inserted at the insertion point."""
    if (is_method(weight, "unsqueeze") or is_call(weight, torch.unsqueeze)) and weight.args[1:] == (1,):
        source = weight.args[0]
        if isinstance(val(source), torch.Tensor) and val(source).dim() == 2:
            return source
    squeezed = graph.call_method("squeeze", (weight, 1))
    propagate_val(squeezed)
    return squeezed


def named_args(node: torch.fx.Node, names: Sequence[str]) -> dict[str, Any]:
    """``node``'s arguments by parameter name, however the user passed them (``F.linear(x,
    weight=W)``, ``F.softplus(input=x)`` put them in kwargs). No defaults are filled in."""
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    return args


# ---------------------------------------------------------------------------------------------
# In-place writes: a pass that makes an op read a value at another point in the graph than the
# user's code did must first prove nothing writes that value's memory in between.
# ---------------------------------------------------------------------------------------------

def mutates(node: torch.fx.Node) -> bool:
    """``node`` writes one of its inputs in place, or into an ``out=`` tensor."""
    return bool(_out_nodes(node)) or _writes_an_input(node)


def _out_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The ``out=`` tensors of a call (``torch.mul(x, 3, out=x)``)."""
    out = node.kwargs.get("out") if node.op == "call_function" else None
    return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.fx.Node)]


# In-place operator methods as dynamo may record them (``z.__imul__(2)``).
_INPLACE_DUNDERS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift"))


# The augmented assignments as dynamo records them on a tensor (``sv **= 2`` is
# ``operator.ipow(sv, 2)``): each writes its first operand in place.
INPLACE_OPERATORS = frozenset(getattr(operator, f"i{op}") for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift"))


def _is_foreach_inplace(node: torch.fx.Node) -> bool:
    """``torch._foreach_mul_([z], 2)``: writes every tensor of its first (list) argument."""
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return name.startswith("_foreach_") and name.endswith("_")


def _writes_an_input(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _INPLACE_DUNDERS or _inplace_name(node.target)
    if _is_foreach_inplace(node):
        return True
    if node.op != "call_function":
        return False
    if node.target is operator.setitem or node.target in INPLACE_OPERATORS:
        return True
    # torch.relu_ / torch.sigmoid_ / torch._add_relu_, and F.relu(x, inplace=True) / F.silu(x, True)
    # as dynamo records them.
    if _inplace_name(getattr(node.target, "__name__", "")):
        return True
    if _inplace_flag(node):
        return True
    if _writing_packet(node.target) or _writing_body(node) or _opaque_python_call(node):
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


# Modules whose plain Python functions dynamo records as calls (``torch.functional.split``,
# ``F.silu``, ``operator.add``): their writes are known by name, flag or schema.
_KNOWN_MODULES = ("torch", "operator", "_operator", "math", "builtins", "einops", "functools")


def _opaque_python_call(node: torch.fx.Node) -> bool:
    """A call of a Python function of the user's that dynamo did not trace into
    (``torch._dynamo.allow_in_graph``): what it does to its tensors is not seen, so it may write
    any of them (probe BD, run 52)."""
    target = node.target
    if not isinstance(target, types.FunctionType):
        return False
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] not in _KNOWN_MODULES and any(
        isinstance(val(a), torch.Tensor) for a in node.all_input_nodes)


def _receiver(node: torch.fx.Node) -> Any:
    """The tensor an in-place call without a schema writes: its first operand, positional or by
    keyword (``torch.neg_(input=t)``, ``F.silu(input=t, inplace=True)``, ``_foreach_mul_(self=[t])``)."""
    if node.args:
        return node.args[0]
    return next((node.kwargs[k] for k in ("input", "self", "tensor", "tensors") if k in node.kwargs), None)


def _inplace_name(name: str) -> bool:
    # ``mul_``, ``_add_relu_``, ``_index_put_impl_``; not a dunder (``__getitem__``).
    return name.endswith("_") and not name.endswith("__")


def _writing_packet(target: Any) -> bool:
    """An op overload packet (``torch.ops.ns.op``, as dynamo records a custom op called without an
    overload) with an overload that writes an argument (``mutates_args``, whatever its name). An
    ``out=`` overload's keyword-only ``out`` does not count (``torch.ops.aten.silu(z)`` writes
    nothing): ``_out_nodes`` sees a call that passes one."""
    if not isinstance(target, torch._ops.OpOverloadPacket):
        return False
    for name in target.overloads():
        schema = getattr(getattr(target, name, None), "_schema", None)
        if schema is not None and any(a.alias_info is not None and a.alias_info.is_write and not a.kwarg_only
                                      for a in schema.arguments):
            return True
    return False


def _writing_body(node: torch.fx.Node) -> bool:
    """A higher-order op whose body writes in place (a checkpoint body that scales its argument or
    a tensor it captured, both passed in as operands): taken as writing every tensor operand."""
    if not isinstance(node.target, torch._ops.HigherOrderOperator):
        return False
    module = node.graph.owning_module
    for arg in node.all_input_nodes:
        body = getattr(module, arg.target, None) if arg.op == "get_attr" and module is not None else None
        if isinstance(body, torch.fx.GraphModule) and any(
                mutates(n) for sub in body.modules() if isinstance(sub, torch.fx.GraphModule) for n in sub.graph.nodes):
            return True
    return False


def _inplace_flag(node: torch.fx.Node) -> bool:
    if node.kwargs.get("inplace") is True:
        return True
    try:
        index = _inplace_position(node.target)
    except TypeError:  # an unhashable callable: no cached signature, and none of torch's in-place ones
        index = None
    return index is not None and index < len(node.args) and node.args[index] is True


@functools.lru_cache(maxsize=None)
def _inplace_position(target: Any) -> int | None:
    """Where ``target`` takes ``inplace`` positionally (``F.silu(x, True)``), or None. Cached: the
    passes ask for every node of every graph."""
    try:
        params = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("inplace") if "inplace" in params else None


def is_number(value: Any) -> bool:
    """A Python int or float, not a bool (which is an int to Python, a flag to the ops)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_zeros(node: Any) -> bool:
    """``node`` is the number 0 or a fresh tensor of zeros (``torch.zeros``, ``zeros_like``,
    ``new_zeros``, a ``full``/``new_full`` of 0). Whether it is written in place later is the
    caller's question (``written_in_place``)."""
    if is_number(node):
        return node == 0
    if not isinstance(node, torch.fx.Node):
        return False
    if is_call(node, torch.zeros, torch.zeros_like) or is_method(node, "new_zeros"):
        return True
    if is_call(node, torch.full) or is_method(node, "new_full"):
        # torch.full(size, fill); t.new_full(size, fill) has t in front.
        at = 2 if node.op == "call_method" else 1
        fill = node.args[at] if len(node.args) > at else node.kwargs.get("fill_value")
        return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill == 0
    return False


def written_in_place(graph: torch.fx.Graph, nodes: list[Any], after_made: bool = False,
                     since: torch.fx.Node | None = None) -> torch.fx.Node | None:
    """The first node of ``graph`` that writes in place to memory one of ``nodes`` lives in (any
    view of it), or None. A pass that makes an op read ``nodes`` at another place in the graph
    than the user did may only do so when this is None. Unknown storages count as shared.

    ``after_made``: only a write at or after the node itself counts. One before it (a buffer
    filled in place, then viewed or cast without a copy: VMamba's cross-scan, probe CB) is in
    the node's value wherever it is read. ``since``: only a write at or after that node counts,
    for every one of ``nodes`` (two reads of one memory, each through its own views or copies:
    ``first_read``)."""
    nodes = [n for n in nodes if isinstance(n, torch.fx.Node)]
    storages = [storage_of(n) for n in nodes]
    pos = node_order(graph) if after_made or since is not None else {}
    for node in graph.nodes:
        if not mutates(node):
            continue
        written = [storage_of(a) for a in written_args(node) if isinstance(val(a), torch.Tensor)]
        for n, storage in zip(nodes, storages):
            if after_made and pos[node] < pos[n] or since is not None and pos[node] < pos[since]:
                continue
            if storage is None or any(w is None or w == storage for w in written):
                return node
    return None


def first_read(nodes: list[torch.fx.Node]) -> torch.fx.Node:
    """The earliest node on the views and casts from each of ``nodes`` back to its
    ``layout_source`` base (the node itself where it is the base). Memory the base shares is read
    no earlier: a cast copies it where the cast is, a view where its reader is. A write before it
    is in every one of the values; one after it may be in some and not in others (u.float()
    made before ``u[..., -1] = 0``, a view of u made after it: probe CE)."""
    order = node_order(nodes[0].graph)
    chain = [c for n in nodes for c in view_chain(n, layout_source(n).base) or [n]]
    return min(chain, key=order.__getitem__)


def written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """What ``node`` writes in place: the receiver of ``x.mul_()`` / ``x[i] = v`` / ``x += y``, the
    ``Tensor(a!)`` arguments of an op, and ``out=`` tensors. ``state.copy_(x)`` writes state, not x."""
    written: list[Any] = []
    if _writes_an_input(node):
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is not None:
            named = dict(zip((a.name for a in schema.arguments), node.args))
            named.update(node.kwargs)
            written = [named.get(a.name) for a in schema.arguments
                       if a.alias_info is not None and a.alias_info.is_write]
        elif _is_foreach_inplace(node) and isinstance(_receiver(node), (list, tuple)):
            written = list(_receiver(node))
        elif _writing_packet(node.target) or _writing_body(node) or _opaque_python_call(node):
            # Which operand is written is not read off here: every tensor operand may be.
            written = [a for a in node.all_input_nodes if isinstance(val(a), torch.Tensor)]
        else:
            written = [_receiver(node)]
    return [a for a in written if isinstance(a, torch.fx.Node)] + _out_nodes(node)


def caller_storages(graph: torch.fx.Graph) -> set:
    """The storages the caller holds once the graph returns: its inputs' and its outputs'.

    Parameters (leaves that require grad) are left out: one changes between a forward and its
    backward only by an explicit ``no_grad`` write, an optimiser's, which comes after the backward.
    Cached on the graph: the passes add no inputs, and their outputs are new tensors.
    """
    cached = getattr(graph, "_ssm_caller_storages", None)
    if cached is not None:
        return cached
    storages = set()
    inputs = [val(n) for n in graph.nodes if n.op in ("placeholder", "get_attr")]
    if not any(isinstance(v, torch.Tensor) and v.requires_grad for v in inputs):
        # Nothing the graph reads requires grad: it records no backward, and saves nothing.
        graph._ssm_caller_storages = storages
        return storages
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            v = val(node)
            if isinstance(v, torch.Tensor) and not (v.requires_grad and v.is_leaf):
                storages.add(storage_of(node))
        elif node.op == "output":
            storages.update(storage_of(n) for n in torch.utils._pytree.tree_leaves(node.args)
                            if isinstance(n, torch.fx.Node))
    storages.discard(None)
    graph._ssm_caller_storages = storages
    return storages


def protects_saved_input(copy: torch.fx.Node) -> bool:
    """Whether ``copy`` (a ``.contiguous()``, ``.clone()`` or cast the user wrote) keeps a tensor an
    op saves for its backward apart from memory the caller can write before that backward: a
    graph input's or a returned tensor's, read under grad mode. Eager's backward reads the copy, so
    a write to the source between the forward and the backward (``x_dbl.mul_(2)`` on a returned
    ``x_dbl``) cannot reach it. An op made to read the source instead would save a view created
    inside the compiled graph, which shares no version counter with the caller's tensor: no error,
    wrong gradients. A rewrite must keep such a copy.
    """
    src = copy.args[0] if copy.args else None
    # A cast to the dtype a tensor has, or ``.contiguous()`` of a contiguous one, returns the
    # tensor itself: the same memory, no copy, nothing kept apart.
    if not isinstance(src, torch.fx.Node) or storage_of(copy) == storage_of(src) is not None:
        return False
    # The storage test first: it is a set lookup, grad_enabled_at walks the graph.
    return storage_of(src) in caller_storages(copy.graph) and grad_enabled_at(copy)


def storage_of(node: torch.fx.Node) -> StorageWeakRef | None:
    """The (fake) storage ``node``'s value lives in; views of one tensor share it. None if unknown."""
    return storage_of_value(val(node))


def storage_of_value(value: Any) -> StorageWeakRef | None:
    """``storage_of`` for a value at hand (a fake value computed outside the node's meta)."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


# ---------------------------------------------------------------------------------------------
# Context regions: dynamo records grad-mode, autocast and functorch state changes as nodes of
# the graph (``with torch.no_grad():`` becomes ``torch._C._set_grad_enabled(False)`` ... ``(True)``).
# A node computes under the state set by the boundaries before it, so an op that replaces nodes
# must run where they ran: on the other side of such a node, autograd (or autocast) sees another
# function than the user's code.
# ---------------------------------------------------------------------------------------------

# Matched by name (and a torch module), so that the ``torch._C``, ``torch._C._functorch`` and
# ``torch._functorch.predispatch`` spellings that different torch versions record all count.
_BOUNDARY_NAMES = frozenset({
    # grad mode and inference mode
    "_set_grad_enabled", "set_grad_enabled", "_enter_inference_mode", "_exit_inference_mode",
    "_set_fwd_grad_enabled", "set_fwd_grad_enabled",
    # autocast
    "_enter_autocast", "_exit_autocast", "set_autocast_enabled", "_set_autocast_enabled",
    "set_autocast_dtype", "set_autocast_cache_enabled", "clear_autocast_cache",
    # functorch grad/jvp transforms (torch.func.grad, vjp, jacrev, jvp) and forward-mode AD
    "_grad_increment_nesting", "_grad_decrement_nesting", "_jvp_increment_nesting",
    "_jvp_decrement_nesting", "_func_increment_nesting", "_func_decrement_nesting",
    "_wrap_for_grad", "_unwrap_for_grad", "_set_tensor_requires_grad",
    "set_inplace_requires_grad_allowed", "set_single_level_autograd_function_allowed",
    "_enter_dual_level", "_exit_dual_level", "_make_dual", "_unpack_dual",
    # saved-tensor hooks (torch.autograd.graph.disable_saved_tensors_hooks)
    "_saved_tensors_hooks_disable", "_saved_tensors_hooks_enable",
})
# Opening a grad/jvp transform level, and closing one: between them the ops would see
# functorch-wrapped tensors, for which they have no rules.
_TRANSFORM_ENTER = frozenset({"_grad_increment_nesting", "_jvp_increment_nesting", "_func_increment_nesting"})
_TRANSFORM_EXIT = frozenset({"_grad_decrement_nesting", "_jvp_decrement_nesting", "_func_decrement_nesting"})
# Modules whose functions set global autograd, autocast or functorch state; a call into them that
# returns no tensor is taken for a setter even when its name is not listed above.
_STATEFUL_MODULES = ("torch._C", "torch._C._autograd", "torch._C._functorch", "torch.autograd",
                     "torch._functorch", "torch.amp", "torch.cuda.amp", "torch.cpu.amp")
# Calls of those modules that touch no grad or autocast state: nn.Module usage logging, and
# vmap's nesting. vmap changes neither the grad mode nor precision, so it is no boundary of the
# grad key; but the values inside a level are batched, so ``ContextRegions`` keeps the levels
# apart on their own: an op may take in or replace a node inside a level only together with the
# whole level (``scan_assoc`` replacing an inlined ``associative_scan`` combine, which runs
# vmapped).
_NEUTRAL_NAMES = frozenset({"_log_api_usage_once", "lazy_load_decompositions", "_vmap_increment_nesting",
                            "_vmap_decrement_nesting", "_add_batch_dim", "_remove_batch_dim"})


def _target_module_and_name(node: torch.fx.Node) -> tuple[str, str]:
    target = node.target
    return getattr(target, "__module__", None) or "", getattr(target, "__name__", None) or ""


def _grad_mode_set_by(node: torch.fx.Node) -> bool | None:
    """The flag of a ``torch._C._set_grad_enabled(flag)`` node (what ``torch.no_grad()`` and
    ``set_grad_enabled`` record); None for any other node."""
    name = _target_module_and_name(node)[1]
    if name in ("_set_grad_enabled", "set_grad_enabled") and len(node.args) == 1 and isinstance(node.args[0], bool):
        return node.args[0]
    return None


def is_context_boundary(node: torch.fx.Node) -> bool:
    """``node`` changes the grad mode, autocast, saved-tensor hooks or a functorch transform
    level for the nodes after it (what dynamo records for ``torch.no_grad()``,
    ``torch.autocast``, ``torch.func.grad`` ...), or is an unknown call into the modules that
    hold such state and returns no tensor (conservatively a setter too)."""
    if node.op != "call_function" or isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    module, name = _target_module_and_name(node)
    if not module.startswith("torch") or name in _NEUTRAL_NAMES:
        return False
    if name in _BOUNDARY_NAMES:
        return True
    stateful = module == "torch._C" or any(module == m or module.startswith(m + ".") for m in _STATEFUL_MODULES[1:])
    if not stateful:
        return False
    out = val(node)
    return not isinstance(out, torch.Tensor) and not (
        isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out))


def _describe(node: torch.fx.Node) -> str:
    module, name = _target_module_and_name(node)
    return f"{module}.{name} at {node.name}" if module else f"{name or node.target} at {node.name}"


# Ops whose precision autocast changes (its lower-precision list, on CPU and CUDA): a value one
# of them computed in an autocast region is rounded differently anywhere else. Every other op a
# pass folds (elementwise arithmetic, activations, views, casts) computes the same in or out of
# a region, and the ssm ops themselves run with autocast off (kernels/context.py).
_AUTOCAST_LOWP = frozenset({"einsum", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "mv",
                            "linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "prelu", "chain_matmul",
                            "linalg_multi_dot", "multi_dot", "tensordot", "_convolution", "convolution"})


def _autocast_sensitive(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _AUTOCAST_LOWP or node.target in ("__matmul__", "__rmatmul__")
    if node.op != "call_function":
        return False
    if node.target in (operator.matmul, operator.imatmul):
        return True
    target = node.target
    name = target.name().split("::")[-1].split(".")[0] if isinstance(target, torch._ops.OpOverload) else (
        getattr(target, "__name__", None) or "")
    return name in _AUTOCAST_LOWP


class ContextRegions:
    """The context each node of a graph runs under, as dynamo recorded it.

    Two keys per node. The grad key is (the number of grad-affecting boundaries other than
    ``_set_grad_enabled`` before it: functorch levels, saved-tensor hooks, inference mode,
    unknown setters; the grad mode, from the mode the graph is compiled under, which dynamo
    guards on, and the ``_set_grad_enabled`` nodes before it). The autocast key is the stack of
    ``_enter_autocast`` nodes open at it (plus any unknown autocast setter before it). Nodes with
    equal keys run under the same state, however many boundaries lie between them.
    ``transform`` maps a grad key's first element to the functorch grad/jvp level it lies in.
    ``vmap_level`` maps each node to the ``_vmap_increment_nesting`` node of the innermost vmap
    level it runs in (None outside every level; a level's closing node lies outside it).
    """

    def __init__(self, graph: torch.fx.Graph):
        self.key: dict[torch.fx.Node, tuple[tuple, tuple]] = {}
        self.boundaries: list[tuple[int, torch.fx.Node]] = []
        self.position: dict[torch.fx.Node, int] = {}
        self.transform: dict[int, torch.fx.Node | None] = {0: None}
        others, enabled, amp = 0, torch.is_grad_enabled(), ()
        opened: list[torch.fx.Node] = []
        self.vmap_level: dict[torch.fx.Node, torch.fx.Node | None] = {}
        vmaps: list[torch.fx.Node] = []
        for i, node in enumerate(graph.nodes):
            self.position[node] = i
            vmap_call = _target_module_and_name(node)[1] if node.op == "call_function" else ""
            if vmap_call == "_vmap_decrement_nesting" and vmaps:
                vmaps.pop()
            self.vmap_level[node] = vmaps[-1] if vmaps else None
            if vmap_call == "_vmap_increment_nesting":
                vmaps.append(node)
            if is_context_boundary(node):
                self.boundaries.append((i, node))
                name = _target_module_and_name(node)[1]
                flag = _grad_mode_set_by(node)
                if flag is not None:
                    enabled = flag
                elif name == "_enter_autocast":
                    amp = amp + (node,)
                elif name == "_exit_autocast" and amp and node.args and node.args[0] is amp[-1]:
                    amp = amp[:-1]
                elif "autocast" in name:
                    amp = amp + (node,)  # an unknown autocast change: never undone
                else:
                    if name in _TRANSFORM_ENTER:
                        opened.append(node)
                    elif name in _TRANSFORM_EXIT and opened:
                        opened.pop()
                    others += 1
                    self.transform[others] = opened[-1] if opened else None
            self.key[node] = ((others, enabled), amp)

    def at_insertion(self, anchor: torch.fx.Node) -> tuple[tuple, tuple]:
        """The keys a node inserted right before ``anchor`` would run under."""
        prev = anchor.prev
        return self.key[prev] if prev in self.key else ((0, torch.is_grad_enabled()), ())

    def _wanted(self, nodes: Iterable[Any]) -> tuple[set, set]:
        members = [n for n in nodes if isinstance(n, torch.fx.Node) and n in self.key]
        return ({self.key[n][0] for n in members}, {self.key[n][1] for n in members if _autocast_sensitive(n)})

    def settle(self, anchor: torch.fx.Node, nodes: Iterable[Any]) -> torch.fx.Node:
        """``anchor`` moved forward past placeholders and boundary nodes (which compute no tensor,
        so the op reads the same values there) until a node inserted before it runs under the
        context of ``nodes`` (outside an autocast region they are not in); ``anchor`` itself when
        they span contexts or none is found before a tensor op."""
        nodes = [n for n in nodes if isinstance(n, torch.fx.Node)]
        grad, amp = self._wanted(nodes)
        if len(grad) != 1 or len(amp) > 1:
            return anchor
        amp = amp or {min(self.key[n][1] for n in nodes if n in self.key)}

        def fits(at: torch.fx.Node) -> bool:
            g, a = self.at_insertion(at)
            return g in grad and a in amp

        replaced = set(nodes)
        moved = anchor
        # Never past a boundary that reads a replaced value (``_unwrap_for_grad(y)``): the op's
        # outputs must exist before their users.
        while (not fits(moved) and moved.op != "output"
               and (moved.op == "placeholder" or is_context_boundary(moved))
               and not replaced.intersection(moved.all_input_nodes)):
            moved = moved.next
        return moved if fits(moved) else anchor

    def _crossed(self, nodes: list[torch.fx.Node], anchor: torch.fx.Node | None) -> str:
        spots = [self.position[n] for n in nodes if n in self.position]
        if anchor is not None and anchor in self.position:
            spots.append(self.position[anchor] - 1)
        lo, hi = min(spots), max(spots)
        inside = [b for i, b in self.boundaries if lo < i <= hi] or [b for _, b in self.boundaries]
        return _describe(inside[0]) + (f", and {len(inside) - 1} more" if len(inside) > 1 else "")

    def _vmap_refusal(self, nodes: list[torch.fx.Node], anchor: torch.fx.Node | None) -> str | None:
        # A node inside a vmap level holds a batched value (other sizes than it shows outside);
        # an op emitted outside the level cannot read it, nor replace it. Only a rewrite that
        # takes the whole level (its opening node among ``nodes``) may reach inside.
        members = set(nodes)
        levels = {self.vmap_level.get(n) for n in nodes}
        if anchor is not None and anchor.prev in self.vmap_level:
            levels.add(self.vmap_level[anchor.prev])
        for level in levels:
            if level is not None and level not in members:
                return (f"the matched nodes or the op's place lie inside a vmap level ({_describe(level)}) "
                        "that the rewrite does not replace whole: the values there are batched")
        return None

    def refusal(self, nodes: Iterable[Any], anchor: torch.fx.Node | None = None) -> str | None:
        """Why an op replacing (or folding, or recomputing at ``anchor``) ``nodes``, inserted before
        ``anchor``, would not compute what they did; None if it would: they and the insertion point
        run under one grad mode with no functorch level or other grad-affecting boundary between,
        outside any functorch grad/jvp transform, and the ones autocast changes (matmuls, convs)
        under one autocast state, the insertion point's too when ``anchor`` is given."""
        nodes = [n for n in nodes if isinstance(n, torch.fx.Node)]
        vmap = self._vmap_refusal(nodes, anchor)
        if vmap is not None:
            return vmap
        grad, amp = self._wanted(nodes)
        at = self.at_insertion(anchor) if anchor is not None else None
        for kind, own in enumerate((grad, amp)):
            keys = own | ({at[kind]} if at is not None and (kind == 0 or own) else set())
            if len(keys) > 1:
                crossed = self._crossed(nodes, anchor)
                if len(own) > 1:
                    return f"the matched nodes span a grad-mode/autocast/functorch boundary ({crossed})"
                return (f"the op would be emitted across a grad-mode/autocast/functorch boundary ({crossed}) "
                        "from the nodes it replaces")
        others = next(iter(grad), at[0] if at is not None else (0, True))[0]
        opener = self.transform.get(others)
        if opener is not None:
            return (f"the matched nodes run inside a torch.func grad/jvp transform ({_describe(opener)}): "
                    "the ssm ops have no functorch rules")
        return None


def context_refusal(graph: torch.fx.Graph, nodes: Iterable[Any], anchor: torch.fx.Node | None = None) -> str | None:
    """``ContextRegions(graph).refusal(nodes, anchor)``: for a pass that checks one rewrite."""
    return ContextRegions(graph).refusal(nodes, anchor)


# In-place changes of a tensor's sizes, strides or offset: after one, a node's fake value shows the
# metadata of the graph's end, not of the point where the node is read.
METADATA_MUTATIONS = frozenset({"t_", "transpose_", "swapdims_", "swapaxes_", "unsqueeze_", "squeeze_",
                                "as_strided_", "resize_", "resize_as_", "set_", "detach_", "requires_grad_"})


def reads_alike_to_autograd(node: torch.fx.Node, source: torch.fx.Node,
                            regions: ContextRegions | None = None) -> bool:
    """Whether reading ``source`` where the code read ``node`` (a view or copy of it with the same
    values) gives autograd the same graph: ``node`` and ``source`` run in one grad-mode /
    functorch region, and where grad mode is off at ``node`` (which then holds no history),
    ``source`` holds none either. ``regions``: the graph's, when the caller has them already."""
    nodes = [n for n in (source, node) if n.op not in ("placeholder", "get_attr")]
    if (regions or ContextRegions(node.graph)).refusal(nodes) is not None:
        return False
    value = val(source)
    return grad_enabled_at(node) or not (isinstance(value, torch.Tensor) and value.requires_grad)


def metadata_writes(graph: torch.fx.Graph) -> tuple[set, bool]:
    """The storages of the tensors whose sizes, strides or offset some node of ``graph`` changes in
    place (``y.t_()``), and whether one such node's receiver has no known storage: the set
    ``metadata_mutated`` reads, made once per graph."""
    storages, unknown = set(), False
    for u in graph.nodes:
        if u.op == "call_method" and u.target in METADATA_MUTATIONS and u.args and isinstance(u.args[0], torch.fx.Node):
            s = storage_of(u.args[0])
            unknown = unknown or s is None
            storages.add(s)
    return storages, unknown


def metadata_mutated(node: torch.fx.Node, writes: tuple[set, bool]) -> bool:
    """Whether ``node``'s sizes, strides or offset may change in place (``writes``:
    ``metadata_writes`` of its graph). By storage, not by the receiver node: ``x.add_(0)`` returns
    x itself as another node, and ``xa.t_()`` then transposes x (probe BM, run 54); a view of x
    being restrided counts too, which is only cautious."""
    storages, unknown = writes
    if not storages:
        return False
    s = storage_of(node)
    return unknown or s is None or s in storages


def grad_enabled_at(node: torch.fx.Node) -> bool:
    """Whether grad mode may be on where ``node`` runs: the mode the graph is compiled under,
    changed by the ``_set_grad_enabled(flag)`` nodes before it. Any other boundary that is not
    about autocast (a functorch level, inference mode, an unknown setter) makes the answer True,
    the safe one for a forward-only op."""
    enabled = torch.is_grad_enabled()
    for n in node.graph.nodes:
        if n is node:
            break
        if not is_context_boundary(n):
            continue
        flag = _grad_mode_set_by(n)
        if flag is not None:
            enabled = flag
        elif "autocast" not in _target_module_and_name(n)[1]:
            enabled = True
    return enabled


def is_ssm_op(node: Any) -> bool:
    """``node`` calls one of this package's ops (``torch.ops.ssm.*``, overload or packet)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace == "ssm"
    return isinstance(target, torch._ops.OpOverloadPacket) and target._qualified_op_name.startswith("ssm::")


def time_prefix_source(node: torch.fx.Node, axis: int) -> torch.fx.Node:
    """``x`` when ``node`` is a prefix of ``x`` along ``axis`` alone (``x[:, :, :k]``,
    ``x[..., :k, :]``, ``x.narrow(axis, 0, k)``, a prefix of a prefix), else ``node``. Step t of
    the prefix is step t of ``x``, so a loop over the prefix's steps is one over ``x``'s first
    steps."""
    while True:
        src = _prefix_of(node, axis)
        if src is None:
            return node
        node = src


def _prefix_of(node: torch.fx.Node, axis: int) -> torch.fx.Node | None:
    """``x`` when ``node`` is one slice of ``x`` that keeps the first steps of ``axis`` and all of
    every other axis; else None."""
    vx = val(node.args[0]) if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(vx, torch.Tensor):
        return None
    if is_call(node, torch.narrow) or is_method(node, "narrow"):
        a = named_args(node, ("input", "dim", "start", "length"))
        dim, start = a.get("dim"), a.get("start")
        if not (isinstance(dim, int) and dim % vx.dim() == axis and isinstance(start, int)):
            return None
        # A negative start counts from the end: -size is the first step.
        first = start == 0 or (start < 0 and isinstance(vx.shape[axis], int) and start + vx.shape[axis] == 0)
        return node.args[0] if first else None
    if not is_call(node, operator.getitem):
        return None
    items = _index_items(node, vx)
    if items is None:
        return None
    for i, item in enumerate(items):
        if not isinstance(item, slice) or item.start not in (None, 0) or item.step not in (None, 1):
            return None
        if i != axis and item.stop is not None:
            return None
    return node.args[0]


def _index_items(node: torch.fx.Node, vx: torch.Tensor) -> tuple | None:
    """The items of ``node``'s index (a getitem of a tensor like ``vx``), one per leading axis,
    or None where there are more items than axes."""
    items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if items.count(Ellipsis) == 1:
        # ``x[..., :k, :]``: the ellipsis stands for the axes the other items leave out.
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (vx.dim() - len(items) + 1) + items[at + 1:]
    return None if len(items) > vx.dim() else items


def same_prefix(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same first steps of one tensor along one axis, with the same shape:
    two spellings of one value (the skip's ``u[..., :k]`` beside the narrowed u that the scan pass
    hands the op for a loop over k steps)."""
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return False
    va, vb = val(a), val(b)
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)) or not same_sizes(va.shape, vb.shape):
        return False
    for axis in range(va.dim()):
        base = time_prefix_source(a, axis)
        if base is time_prefix_source(b, axis) and (base is not a or base is not b):
            return True
    return False


def same_suffix(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same last steps of one tensor along one axis, with the same shape:
    two spellings of one value (the skip's ``u[..., 1:]`` beside the ``u.narrow(-1, -k, k)`` that
    the scan pass hands the op, flipped, for a reverse loop that stops before step 0)."""
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return False
    va, vb = val(a), val(b)
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)) or not same_sizes(va.shape, vb.shape):
        return False
    return any(_suffix_of(a, axis) is not None and _suffix_of(a, axis) is _suffix_of(b, axis)
               for axis in range(va.dim()))


def _suffix_of(node: torch.fx.Node, axis: int) -> torch.fx.Node | None:
    """``x`` when ``node`` is one slice of ``x`` that keeps the last steps of ``axis`` and all of
    every other axis (``x[:, :, k:]``, ``x.narrow(axis, -k, k)``); else None. Sizes must be
    numbers: the end of the slice is checked against the end of the axis."""
    vx = val(node.args[0]) if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(vx, torch.Tensor) or not is_concrete_int(vx.shape[axis]) or int(vx.shape[axis]) == 0:
        return None
    size = int(vx.shape[axis])
    if is_call(node, torch.narrow) or is_method(node, "narrow"):
        a = named_args(node, ("input", "dim", "start", "length"))
        dim, start, length = a.get("dim"), a.get("start"), a.get("length")
        if not (isinstance(dim, int) and dim % vx.dim() == axis and isinstance(start, int) and isinstance(length, int)):
            return None
        return node.args[0] if start % size + length == size else None
    if not is_call(node, operator.getitem):
        return None
    items = _index_items(node, vx)
    if items is None:
        return None
    for i, item in enumerate(items):
        if not isinstance(item, slice) or item.step not in (None, 1):
            return None
        if item.stop is not None or (i != axis and item.start not in (None, 0)):
            return None
    return node.args[0]


# sign_of's vocabulary, by the function's or method's name (call_function targets only from
# torch and operator, so that a user's function of the same name is not read as one of these).
_NONNEGATIVE = frozenset(("exp", "exp2", "softplus", "sigmoid", "special_expit", "relu", "relu6", "abs", "square",
                          "sqrt", "cosh"))
# Ops whose every element is an element of their first argument (views, copies, casts: rounding
# keeps a sign), or of their tensor argument for split-like ops read through getitem.
_SIGN_KEEPING = frozenset(VIEW_OPS + ("expand_as", "contiguous", "clone", "detach", "repeat", "repeat_interleave",
                                      "broadcast_to", "tensor_split", "split_with_sizes", "float", "double",
                                      "half", "bfloat16", "to", "type", "type_as",
                                      # Reorderings of the elements (a user's ``softplus(dt).flip(-1)``,
                                      # probe CQ):
                                      "flip", "roll"))
_CASTS = frozenset(("float", "double", "half", "bfloat16", "to", "type", "type_as"))


def _sign_vocabulary_name(node: torch.fx.Node) -> str | None:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        module = getattr(node.target, "__module__", None) or ""
        if module == "_operator" or module.startswith("torch"):
            return getattr(node.target, "__name__", None)
    return None


def sign_of(value: Any, depth: int = 16) -> int:
    """1 if every element of ``value`` is provably >= 0 (or NaN), -1 if provably <= 0 (or NaN),
    0 if the graph does not show either. From the ops that make it (``softplus``, ``exp``,
    ``-exp(A_log)``, products and sums of known signs, views and casts) and only where nothing
    writes into their memory, never from values: a placeholder's sign is unknown."""
    if is_number(value):
        return 1 if value >= 0 else -1
    if not isinstance(value, torch.fx.Node) or depth == 0:
        return 0
    name = _sign_vocabulary_name(value)
    if name is None:
        return 0
    if is_tensor_node(value) and written_in_place(value.graph, [value]) is not None:
        # The op's sign is not its value's once something writes into it (``s = softplus(x);
        # s[:, :, 0] = -1; delta = s * 2``): that write may come before any reader's own check.
        return 0
    args = value.args
    first = args[0] if args else None
    if name == "softplus":
        # log(1 + exp(beta·x)) / beta: non-positive for a negative beta (probe CE).
        beta = value.kwargs.get("beta", args[1] if len(args) > 1 else 1)
        return 1 if is_number(beta) and beta > 0 else 0
    if name in _NONNEGATIVE:
        return 1
    if name in _SIGN_KEEPING or name in ("getitem", "__getitem__"):
        out, src = val(value), val(first) if isinstance(first, torch.fx.Node) else None
        if isinstance(out, torch.Tensor) and not out.is_floating_point():
            return 0  # a cast to bool or an unsigned type maps -0.5 to 1 (probe CE)
        if (name not in _CASTS and isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
                and out.dtype != src.dtype):
            return 0  # ``x.view(dtype)`` reinterprets the bits
        return sign_of(first, depth - 1)
    if name in ("neg", "negative"):
        return -sign_of(first, depth - 1)
    if name in ("clamp", "clamp_min", "clip"):
        low = value.kwargs.get("min", args[1] if len(args) > 1 else None)
        high = None if name == "clamp_min" else value.kwargs.get("max", args[2] if len(args) > 2 else None)
        # clamp(x, 0, -1) is -1 everywhere: torch applies max after min (probe CE).
        bounded = high is None or is_number(high) and is_number(low) and high >= low
        return 1 if is_number(low) and low >= 0 and bounded else 0
    if len(args) != 2 or value.kwargs:
        return 0
    second = args[1]
    if name in ("mul", "multiply"):
        if first is second:
            return 1  # x * x
        return sign_of(first, depth - 1) * sign_of(second, depth - 1)
    if name in ("truediv", "div", "divide"):
        # Only by a non-zero number: x / -0.0 flips the sign, and a "non-negative" tensor may hold -0.0.
        return sign_of(first, depth - 1) * sign_of(second) if is_number(second) and second != 0 else 0
    if name in ("add", "sub", "subtract"):
        left, right = sign_of(first, depth - 1), sign_of(second, depth - 1)
        if name != "add":
            right = -right
        return left if left == right else 0
    if name in ("pow", "float_power"):
        if is_number(second) and float(second).is_integer() and int(second) % 2 == 0:
            return 1
        return 1 if sign_of(first, depth - 1) == 1 else 0
    return 0
