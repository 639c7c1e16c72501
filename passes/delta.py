"""Fold the Δ preprocessing (dt_proj bias + softplus) into ``ssm::selective_scan`` (family ``delta``).

The scan passes (and users calling ``torch.ops.ssm.selective_scan`` directly) hand the op a Δ
that was already computed in plain torch, typically::

    delta = F.softplus(x + bias[:, None])                 # mamba_ssm selective_scan_ref
    delta = F.softplus(F.linear(x, W, b)).transpose(1, 2) # dt_proj(...) (b, L, dim) layouts
    dt = W @ x; dt = dt + bias.to(dt.dtype)[..., None]; dt = F.softplus(dt)   # HF 5.24

The op can do both steps itself (``delta_bias=``, ``delta_softplus=True``), in fp32 registers
instead of two extra (batch, dim, L) round trips through memory. The fold is sound because
softplus and the bias add are elementwise, so they commute with the permutation views between
them and the op: the op receives the pre-bias value through the same views.

Only torch's default softplus (beta=1, threshold=20) is what the op computes; anything else is
a near-miss. The intermediate nodes are left in place: if something else uses them, they keep
computing for that user, and dead ones go with the pass manager's dead-code elimination.

The helpers at the top (finding scan nodes, reading and writing their arguments in schema
order, following permutation views) are shared with ``tail.py`` and ``scan_assoc.py``.
"""
from __future__ import annotations

import operator
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.fx
import torch.nn.functional as F

from .fx_utils import is_call, is_method, permute_view, propagate_val, shape_of, val
from .manager import PassContext, PassManager

FAMILY = "delta"

SCAN_QUALNAME = "ssm::selective_scan"
SCAN_ARG_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus",
                  "initial_state", "return_last_state")
_SCAN_DEFAULTS = {"D": None, "z": None, "delta_bias": None, "delta_softplus": False,
                  "initial_state": None, "return_last_state": False}

SOFTPLUS_TARGETS = (F.softplus, torch._C._nn.softplus, torch.ops.aten.softplus)
LINEAR_TARGETS = (F.linear, torch._C._nn.linear, torch.ops.aten.linear)
ADD_TARGETS = (operator.add, torch.add, torch.ops.aten.add)
MUL_TARGETS = (operator.mul, torch.mul, torch.ops.aten.mul)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CAST_METHODS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                 "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# Scan-op helpers (shared with tail.py and scan_assoc.py)
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


def output_getitem(scan: torch.fx.Node, index: int) -> Optional[torch.fx.Node]:
    """The unique ``getitem(scan, index)`` user, or None (absent or duplicated)."""
    found = [u for u in scan.users if is_call(u, operator.getitem) and u.args[1] == index]
    return found[0] if len(found) == 1 else None


# ---------------------------------------------------------------------------------------------
# Layout helpers: permutation views and dtype casts
# ---------------------------------------------------------------------------------------------

def cast_dtype(node: torch.fx.Node) -> Optional[torch.dtype]:
    """The dtype ``node`` casts its first input to, if it is nothing but a float dtype cast."""
    if is_method(node, *_CAST_METHODS) and len(node.args) == 1 and not node.kwargs:
        return _CAST_METHODS[node.target]
    if is_method(node, "to", "type") and not node.kwargs and len(node.args) == 2:
        dtype = node.args[1]
        if isinstance(dtype, torch.dtype) and dtype in _FLOAT_DTYPES:
            return dtype
    if is_method(node, "to") and set(node.kwargs) == {"dtype"} and len(node.args) == 1:
        dtype = node.kwargs["dtype"]
        if dtype in _FLOAT_DTYPES:
            return dtype
    if is_method(node, "type_as") and len(node.args) == 2:
        out = val(node)
        return out.dtype if isinstance(out, torch.Tensor) and out.dtype in _FLOAT_DTYPES else None
    return None


def is_lossless_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every ``src`` value is exactly representable in ``dst`` (bf16/fp16 -> fp32 -> fp64)."""
    rank = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
    return src == dst or rank.get(dst, 0) > rank.get(src, 0)


def _dims(args: Sequence[Any]) -> list[int]:
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        return list(args[0])
    return list(args)


def view_perm(node: torch.fx.Node) -> Optional[list[int]]:
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
        if not isinstance(src, int) or not isinstance(dst, int):
            return None
        ident.pop(src % n)
        ident.insert(dst % n, src % n)
        return ident
    if is_method(node, "t") or is_call(node, torch.t):
        return ident[::-1] if n == 2 else (ident if n < 2 else None)
    if is_call(node, getattr) and node.args[1] == "mT" and n >= 2:
        ident[-1], ident[-2] = ident[-2], ident[-1]
        return ident
    if is_method(node, "contiguous"):
        return ident
    return None


class Layout(NamedTuple):
    """``node`` axis ``i`` holds ``base`` axis ``perm[i]``; ``lossless`` is False if a rounding
    cast lies between them."""

    base: torch.fx.Node
    perm: tuple[int, ...]
    lossless: bool


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


def inverse(perm: Sequence[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def node_order(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def hoist_before(node: torch.fx.Node, anchor: torch.fx.Node, blocked: torch.fx.Node) -> bool:
    """Move ``node`` (and the inputs it needs) above ``anchor`` so ``anchor`` may use it.

    Returns False, moving nothing, if ``node`` depends on ``blocked`` (the scan itself: a value
    computed from the scan's output can't become one of its inputs). Only called on pure tensor
    ops (the D/z/bias chains the user wrote after the scan), so moving them changes no result.
    """
    order = node_order(anchor.graph)
    to_move: list[torch.fx.Node] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if n is blocked:
            return False
        if order[n] < order[anchor] or n in to_move:
            continue
        if n.op not in ("call_function", "call_method"):
            return False
        to_move.append(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(to_move, key=order.__getitem__):
        anchor.prepend(n)
    return True


# ---------------------------------------------------------------------------------------------
# The Δ fold
# ---------------------------------------------------------------------------------------------

class DeltaFold(NamedTuple):
    pre: torch.fx.Node            # the value before bias and softplus, in its own layout
    perm: tuple[int, ...]         # op's delta axis i = pre axis perm[i]
    bias: Optional[torch.fx.Node]  # (dim,) node for delta_bias, or None
    linear: Optional[torch.fx.Node]  # F.linear(x, W, b) whose bias moves into the op
    nodes: list[torch.fx.Node]    # the matched nodes, for the record


def _softplus_default(node: torch.fx.Node) -> Optional[str]:
    """None if ``node`` is torch's default softplus, else why not."""
    names = ("input", "beta", "threshold")
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    beta, threshold = args.get("beta", 1.0), args.get("threshold", 20.0)
    if beta != 1 or threshold != 20:
        return (f"softplus with beta={beta}, threshold={threshold} is not the op's softplus "
                "(beta=1, threshold=20)")
    return None


def _unit_dim_source(node: torch.fx.Node) -> torch.fx.Node:
    """Follow ops that only insert or remove size-1 axes (``b[:, None]``, ``unsqueeze``,
    ``view``/``reshape`` to the same numel) and float casts back to the first 1-D value. Casts
    applied to that 1-D value (HF's ``bias.float()``) stay: the op gets the bias as the user
    cast it."""
    while isinstance(node, torch.fx.Node) and len(shape_of(node) or ()) != 1:
        src = node.args[0] if node.args else None
        if not isinstance(src, torch.fx.Node):
            break
        if cast_dtype(node) is not None:
            node = src
            continue
        shape, src_shape = shape_of(node), shape_of(src)
        if shape is None or src_shape is None:
            break
        squeezed = [s for s in shape if s != 1] == [s for s in src_shape if s != 1]
        if squeezed and (is_method(node, "unsqueeze", "view", "reshape", "squeeze")
                         or is_call(node, torch.unsqueeze, torch.reshape, torch.squeeze)):
            node = src
            continue
        if squeezed and is_call(node, operator.getitem) and _only_none_and_full_slices(node.args[1]):
            node = src
            continue
        break
    return node


def _only_none_and_full_slices(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in items)


def match_bias(bias_b: Any, pre_shape: tuple, dim_axis: int, dim: int) -> Optional[torch.fx.Node]:
    """The (dim,) node that ``bias_b`` broadcasts along axis ``dim_axis`` of a ``pre_shape``
    tensor, or None if ``bias_b`` is anything else."""
    shape = shape_of(bias_b)
    if shape is None or len(shape) > len(pre_shape):
        return None
    full = (1,) * (len(pre_shape) - len(shape)) + tuple(shape)
    expected = tuple(dim if i == dim_axis else 1 for i in range(len(pre_shape)))
    if full != expected:
        return None
    src = _unit_dim_source(bias_b)
    return src if shape_of(src) == (dim,) else None


def match_delta(delta: Any) -> DeltaFold | str | None:
    """Prove ``delta`` = views(softplus(views(pre + bias))) with elementwise steps only.

    Returns the fold, a near-miss reason (a softplus the op can't compute), or None when
    ``delta`` doesn't come from a softplus at all (nothing to fold, nothing to report).
    """
    if not isinstance(delta, torch.fx.Node):
        return None
    top = layout_source(delta)
    softplus = top.base
    if not is_call(softplus, *SOFTPLUS_TARGETS):
        return None
    why = _softplus_default(softplus)
    if why is not None:
        return why
    inner = layout_source(softplus.args[0])
    perm = tuple(inner.perm[p] for p in top.perm)
    pre = inner.base
    nodes = [softplus]
    dim_axis = perm[1]
    dim = shape_of(delta)[1]
    if is_call(pre, *LINEAR_TARGETS):
        x, weight, bias = (list(pre.args) + [pre.kwargs.get("bias")])[:3]
        if bias is not None and dim_axis == len(shape_of(pre)) - 1 and shape_of(bias) == (dim,):
            return DeltaFold(pre, perm, bias, pre, nodes + [pre])
    if is_call(pre, *ADD_TARGETS) and len(pre.args) == 2 and not pre.kwargs:
        for x, bias_b in (pre.args, pre.args[::-1]):
            if shape_of(x) != shape_of(pre):
                continue
            bias = match_bias(bias_b, shape_of(pre), dim_axis, dim)
            if bias is not None:
                return DeltaFold(x, perm, bias, None, nodes + [pre])
    return DeltaFold(pre, perm, None, None, nodes)


def _fold(gm: torch.fx.GraphModule, ctx: PassContext, scan: torch.fx.Node) -> None:
    args = scan_args(scan)
    if args["delta_softplus"] or args["delta_bias"] is not None:
        return
    fold = match_delta(args["delta"])
    if isinstance(fold, str):
        ctx.miss(FAMILY, fold, [scan])
    if not isinstance(fold, DeltaFold):
        return
    graph = gm.graph
    pre = fold.pre
    with graph.inserting_before(scan):
        if fold.linear is not None:
            x, weight = fold.linear.args[:2]
            pre = graph.call_function(fold.linear.target, (x, weight))
            propagate_val(pre)
        new_delta = permute_view(graph, pre, fold.perm)
    args.update(delta=new_delta, delta_bias=fold.bias, delta_softplus=True)
    set_scan_args(scan, args)
    pattern = "softplus(linear(x, W, b))" if fold.linear is not None else (
        "softplus(x + bias)" if fold.bias is not None else "softplus(x)")
    ctx.rewrite(FAMILY, pattern, fold.nodes, "ssm.selective_scan.default",
                {"delta_bias": fold.bias is not None, "perm": list(fold.perm)})


def delta_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    for scan in scan_nodes(gm.graph):
        _fold(gm, ctx, scan)


def register(pm: PassManager) -> None:
    pm.add("delta", delta_pass)
