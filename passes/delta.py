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

``match_bias`` and the target tuples are shared with ``tail.py``; the scan-op and layout helpers
this pass uses live in ``fx_utils.py``.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .fx_utils import (HALF_DTYPES, Layout, behind_lossless_casts, cast_dtype, context_refusal, dropped_rounding,
                       dtype_of, flip_dims, higher_order_op, hop_name, is_call, is_exp, is_lossless_cast, is_method,
                       layout_source, narrowed_by_program, permute_view, propagate_val, scan_args, named_args,
                       same_shape, scan_nodes, set_scan_args, shape_of, view_chain, written_in_place)
from .manager import PassContext, PassManager

FAMILY = "delta"


SOFTPLUS_TARGETS = (F.softplus, torch._C._nn.softplus, torch.ops.aten.softplus)
LINEAR_TARGETS = (F.linear, torch._C._nn.linear, torch.ops.aten.linear)
ADD_TARGETS = (operator.add, torch.add, torch.ops.aten.add)
MUL_TARGETS = (operator.mul, torch.mul, torch.ops.aten.mul)
SUB_TARGETS = (operator.sub, torch.sub, torch.subtract, torch.ops.aten.sub)
MATMUL_TARGETS = (operator.matmul, torch.matmul)



# ---------------------------------------------------------------------------------------------
# The Δ fold
# ---------------------------------------------------------------------------------------------

class DeltaFold(NamedTuple):
    pre: torch.fx.Node            # the value before bias and softplus, in its own layout
    perm: tuple[int, ...]         # op's delta axis i = pre axis perm[i]
    bias: Optional[torch.fx.Node]  # (dim,) node for delta_bias, or None
    linear: Optional[torch.fx.Node]  # F.linear(x, W, b) whose bias moves into the op
    nodes: list[torch.fx.Node]    # the matched nodes, for the record
    between: list[torch.fx.Node]  # the views and casts around the softplus, replaced as well
    # The op's Δ is the softplus flipped along time (a reverse loop's, which ``unreverse_loops``
    # runs over flipped operands): the op reads the pre-activation flipped the same way.
    flipped: bool = False


def _softplus_default(node: torch.fx.Node) -> Optional[str]:
    """None if ``node`` is torch's default softplus, else why not."""
    args = named_args(node, ("input", "beta", "threshold"))
    beta, threshold = args.get("beta", 1.0), args.get("threshold", 20.0)
    if beta != 1 or threshold != 20:
        return (f"softplus with beta={beta}, threshold={threshold} is not the op's softplus "
                "(beta=1, threshold=20)")
    return None


def _unit_dim_source(node: torch.fx.Node) -> torch.fx.Node:
    """Follow ops that only insert or remove size-1 axes (``b[:, None]``, ``unsqueeze``,
    ``view``/``reshape`` to the same numel) and widening float casts back to the first 1-D
    value. Casts applied to that 1-D value (HF's ``bias.float()``) stay: the op gets the bias as
    the user cast it. A rounding cast on the way (``b[:, None].bfloat16()``) stops the walk: it
    changes the values the op would read, and the op reads any float dtype as fp32 itself, so
    only a cast it would make anyway may go (not one to fp64, which computes more finely)."""
    while isinstance(node, torch.fx.Node) and len(shape_of(node) or ()) != 1:
        src = node.args[0] if node.args else None
        if not isinstance(src, torch.fx.Node):
            break
        dtype = cast_dtype(node)
        if dtype is not None:
            if dtype_of(src) is None or not is_lossless_cast(dtype_of(src), dtype) \
                    or (dtype == torch.float64 and dtype_of(src) != torch.float64):
                break
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
    if (is_method(bias_b, "expand", "expand_as", "broadcast_to") or is_call(bias_b, torch.broadcast_to)) \
            and isinstance(bias_b.args[0], torch.fx.Node):
        # An explicit broadcast (``D.expand(b, l, d)``, einops' ``repeat(D, "d -> b l d")``) holds
        # its input's values wherever the implicit one would: match what it expands.
        return match_bias(bias_b.args[0], pre_shape, dim_axis, dim)
    shape = shape_of(bias_b)
    if shape is None or len(shape) > len(pre_shape):
        return None
    full = (1,) * (len(pre_shape) - len(shape)) + tuple(shape)
    expected = tuple(dim if i == dim_axis else 1 for i in range(len(pre_shape)))
    if full != expected:
        return None
    src = _unit_dim_source(bias_b)
    # A (dim, 1) parameter (``D = nn.Parameter(torch.ones(dim, 1))``) holds the same dim values in
    # the same order as a (dim,) one: ``as_vector`` hands the op its reshape. At dim = 1 every axis
    # is size 1, and any one-element tensor is the (1,) vector (probe BX: a d_model = 1 model).
    sizes = [s for s in (shape_of(src) or ()) if s != 1]
    return src if sizes == [dim] or (dim == 1 and not sizes and shape_of(src) is not None) else None


def as_vector(graph: torch.fx.Graph, node: torch.fx.Node, dim: int, before: torch.fx.Node) -> torch.fx.Node:
    """``node`` (a ``match_bias`` result) as the (dim,) tensor the op reads, reshaped before
    ``before`` when it has size-1 axes; the reshape is a view, so gradients reach the parameter."""
    if same_shape(shape_of(node), (dim,)):
        return node
    with graph.inserting_before(before):
        vector = graph.call_method("reshape", (node, (dim,)))
        propagate_val(vector)
    return vector


class SignedSum(NamedTuple):
    """``left + alpha·right`` (``sub`` False) or ``left - alpha·right`` (``sub`` True)."""

    left: Any
    right: Any
    sub: bool
    alpha: Any  # as written; 1 where the call gives none


def signed_sum(node: Any) -> Optional[SignedSum]:
    """An add or sub of two operands (function, operator or method) with at most an ``alpha``
    keyword, else None: the one reading of ``torch.add(y, X, alpha=...)`` / ``y.sub(X, ...)``
    that ``binary_operands`` and the tail's reasons share."""
    sub = is_call(node, *SUB_TARGETS) or is_method(node, "sub")
    if not (sub or is_call(node, *ADD_TARGETS) or is_method(node, "add")):
        return None
    if len(node.args) != 2 or set(node.kwargs) - {"alpha"}:
        return None
    return SignedSum(node.args[0], node.args[1], sub, node.kwargs.get("alpha", 1))


def exact_sum(s: Optional[SignedSum]) -> bool:
    """``s`` computes ``left + right`` exactly: an add with alpha 1, or a sub with alpha -1 (the
    scale by ±1 rounds nothing). A number only: ``True`` is not taken for 1."""
    return s is not None and type(s.alpha) in (int, float) and s.alpha == (-1 if s.sub else 1)


def binary_operands(node: Any, targets: tuple) -> Optional[tuple[Any, Any]]:
    """``(a, b)`` if ``node`` is a plain two-operand call of ``targets`` (ADD_TARGETS or
    MUL_TARGETS) or the matching tensor method (``a.add(b)``, ``a.mul(b)``).

    A sum may carry ``alpha`` where it changes no bit: ``torch.add(a, b, alpha=1)`` and
    ``torch.sub(a, b, alpha=-1)`` compute ``a + b`` exactly (``exact_sum``)."""
    if targets is ADD_TARGETS:
        s = signed_sum(node)
        return (s.left, s.right) if exact_sum(s) else None
    if (is_call(node, *targets) or is_method(node, "mul")) and len(node.args) == 2 and not node.kwargs:
        return node.args[0], node.args[1]
    return None


def match_delta(delta: Any) -> DeltaFold | str | None:
    """Prove ``delta`` = views(softplus(views(pre + bias))) with elementwise steps only.

    Returns the fold, a near-miss reason (a softplus the op can't compute), or None when
    ``delta`` doesn't come from a softplus at all (nothing to fold, nothing to report).
    """
    if not isinstance(delta, torch.fx.Node):
        return None
    top = layout_source(delta)
    # Softplus and the bias add are elementwise, so they commute with flips of the time axis as
    # they do with the views (probe CO: a reverse loop's Δ went unfolded, with no reason); two
    # flips (a reverse loop over the user's own ``softplus(dt).flip(-1)``, probe CQ) cancel.
    flipped = False
    while flip_dims(top.base) == {top.perm[2]}:
        flipped = not flipped
        below = layout_source(top.base.args[0])
        top = Layout(below.base, tuple(below.perm[p] for p in top.perm), top.lossless and below.lossless)
    softplus = top.base
    if not is_call(softplus, *SOFTPLUS_TARGETS):
        return (_softplus_behind_hop(softplus) or _softplus_written_out(softplus)
                or _softplus_reordered(softplus, top.perm))
    why = _softplus_default(softplus)
    if why is not None:
        return why
    inner = layout_source(named_args(softplus, ("input",))["input"])
    perm = tuple(inner.perm[p] for p in top.perm)
    pre = inner.base
    nodes = [softplus]
    between = [*view_chain(delta, softplus), *view_chain(named_args(softplus, ("input",))["input"], pre)]
    dim_axis = perm[1]
    dim = shape_of(delta)[1]
    if is_call(pre, *LINEAR_TARGETS):
        bias = named_args(pre, ("input", "weight", "bias")).get("bias")
        if bias is not None and dim_axis == len(shape_of(pre)) - 1 and shape_of(bias) == (dim,):
            return DeltaFold(pre, perm, bias, pre, nodes + [pre], between, flipped)
    operands = binary_operands(pre, ADD_TARGETS)
    if operands is not None:
        for x, bias_b in (operands, operands[::-1]):
            if not same_shape(shape_of(x), shape_of(pre)):
                continue
            bias = match_bias(bias_b, shape_of(pre), dim_axis, dim)
            if bias is not None:
                return DeltaFold(x, perm, bias, None, nodes + [pre], between, flipped)
    return DeltaFold(pre, perm, None, None, nodes, between, flipped)


def _softplus_behind_hop(node: torch.fx.Node) -> str | None:
    """Why not, when Δ is a softplus passed through a higher-order op (a custom
    ``autograd.Function`` such as a gradient clip, or a hook): the op's softplus would come with
    its own backward, not the user's. None when Δ comes from anything else."""
    hop = higher_order_op(node)
    if hop is None:
        return None
    for arg in hop.all_input_nodes:
        if is_call(layout_source(arg).base, *SOFTPLUS_TARGETS):
            return (f"Δ is {hop_name(hop)} of the softplus {arg.name} (a custom autograd.Function, or a hook on "
                    "the tensor): folding the softplus into the op would drop what that does in the backward")
    return None


_DELTA_AXES = ("batch", "channels", "time")


def _softplus_reordered(node: torch.fx.Node, perm: tuple[int, ...]) -> str | None:
    """Why not, when Δ is a softplus flipped along other axes than time alone or rolled
    (``softplus(dt_proj(dt)).flip(-1)`` in a (b, L, dim) layout, ``.roll(1, -1)``); ``perm``: the
    op's Δ axis i is ``node``'s axis perm[i]. None when Δ is anything else."""
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    rolled = is_method(node, "roll") or is_call(node, torch.roll)
    if rolled:
        dims, shifts = (named_args(node, ("input", "shifts", "dims")).get(k) for k in ("dims", "shifts"))
    elif is_method(node, "flip") or is_call(node, torch.flip):
        # ``x.flip(1, 2)`` as well as ``x.flip((1, 2))``, which ``flip_dims`` reads.
        dims = node.kwargs.get("dims", node.args[1] if len(node.args) == 2 else node.args[1:])
    else:
        return None
    dims = dims if isinstance(dims, (tuple, list)) or dims is None else (dims,)
    if dims is not None and not all(isinstance(d, int) for d in dims):
        return None
    source = node.args[0]
    # ``x.flip(k).flip(k)``: the second flip undoes the first (probe CS).
    twice = not rolled and flip_dims(source) is not None and flip_dims(source) == flip_dims(node)
    names = f"{source.name}, {node.name}" if twice else node.name
    if twice:
        source = source.args[0]
    softplus = layout_source(source).base
    if not is_call(softplus, *SOFTPLUS_TARGETS):
        return None
    # ``roll`` without dims rolls the flattened tensor: every axis moves.
    axes = set(range(len(perm))) if dims is None else {d % len(perm) for d in dims}
    how = ("rolled as one flat row of elements" if dims is None else
           ("rolled" if rolled else "flipped twice" if twice else "flipped") + " along "
           + " and ".join(_DELTA_AXES[i] for i in range(len(perm)) if perm[i] in axes))
    why = "the fold follows Δ back to the softplus only through views and flips of time"
    if twice or (rolled and _whole_turns(node, shifts, dims)):
        return (f"Δ is the softplus {softplus.name} {how} ({names}), which moves nothing: {why}, and does not "
                f"read {'the two flips' if twice else 'a roll'} as the identity; the softplus stays where it is")
    if rolled and perm[2] in axes:
        why += " (a roll is not a reversal)"
    if perm[1] in axes:
        why += "; along channels the op's per-channel delta_bias would have to move with dt_proj's rows"
    return f"Δ is the softplus {softplus.name} {how} ({node.name}): {why}; the softplus stays where it is"


def _whole_turns(node: torch.fx.Node, shifts: Any, dims: Any) -> bool:
    """``roll(shifts, dims)`` of ``node``'s input shifts every axis it rolls by a multiple of its
    length (``roll(0, -1)``, ``roll(dim, -1)``): each element stays where it is."""
    shape = shape_of(node)
    shifts = shifts if isinstance(shifts, (tuple, list)) else (shifts,)
    if dims is None:
        sizes = [math.prod(shape)] if all(is_concrete_int(s) for s in shape) else [None]
    else:
        sizes = [shape[d] if is_concrete_int(shape[d]) else None for d in dims]
    return (len(shifts) == len(sizes) and None not in sizes
            and all(isinstance(k, int) and int(n) > 0 and k % int(n) == 0 for k, n in zip(shifts, sizes)))


def _softplus_written_out(node: torch.fx.Node) -> str | None:
    """Why not, when Δ is softplus written out, ``log1p(exp(x))`` or ``log(1 + exp(x))``: it
    overflows to inf where exp(x) does, where ``F.softplus`` (the op's) returns x, so the two
    are different functions. None when Δ is anything else."""
    if not (is_call(node, torch.log1p, torch.log) or is_method(node, "log1p", "log")) or len(node.args) != 1:
        return None
    inner = node.args[0]
    log1p = is_call(node, torch.log1p) or is_method(node, "log1p")
    if log1p:
        written = is_exp(inner)
    else:
        operands = binary_operands(inner, ADD_TARGETS)
        written = operands is not None and any(
            o == 1 and type(o) in (int, float) and is_exp(p) for o, p in (operands, operands[::-1]))
    if not written:
        return None
    return (f"Δ is {node.name} = {'log1p(exp(x))' if log1p else 'log(1 + exp(x))'}, softplus "
            "written out: it is inf wherever exp(x) overflows (x > 88 in fp32), where F.softplus, which the op "
            "computes, returns x; not folded")


def weight_product(node: Any, t_dims: Callable[[int], bool], *targets: Any) -> Optional[tuple[Any, Any]]:
    """``(W, T)`` when ``node`` is ``W @ T`` (``MATMUL_TARGETS`` and ``targets``) with a 2-D W and
    a T whose number of dims passes ``t_dims``, else None."""
    if not is_call(node, *MATMUL_TARGETS, *targets) or len(node.args) != 2 or node.kwargs:
        return None
    W, T = node.args
    if len(shape_of(W) or ()) != 2 or not t_dims(len(shape_of(T) or ())):
        return None
    return W, T


def _left_weight_product(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(W, T)`` when ``node`` is ``W @ T`` with a 2-D W and a T of 3 or more dims (HF's
    ``dt_proj.weight @ time_step.transpose(1, 2)``), else None."""
    return weight_product(node, lambda dims: dims >= 3)


def _transposed_product(pre: torch.fx.Node) -> tuple[torch.fx.Node, Optional[tuple[int, int]]]:
    """``(P, (i, j))`` when ``pre`` is ``P.transpose(i, j)`` and nothing else reads P (mamba.py's
    ``(dt_proj.weight @ dt.transpose(1, 2)).transpose(1, 2)``); else ``(pre, None)``."""
    if not (is_method(pre, "transpose") or is_call(pre, torch.transpose)) or len(pre.args) != 3 or pre.kwargs:
        return pre, None
    source, i, j = pre.args
    if not isinstance(source, torch.fx.Node) or not isinstance(i, int) or not isinstance(j, int):
        return pre, None
    if list(source.users) != [pre]:
        return pre, None
    return source, (i, j)


def _as_linear(graph: torch.fx.Graph, W: torch.fx.Node, T: torch.fx.Node) -> torch.fx.Node:
    """``linear(T.mT, W).mT``: the same products and sums as ``W @ T``, in the layout the rest
    of the block wants.

    Eager computes ``W @ T`` as a batched matmul with W broadcast over the batch, and returns it
    (batch, D, L)-contiguous. Inductor runs it as one (batch * L, R) x (R, D) matmul instead,
    whose output is (batch, L, D) in memory, and then copies that into the (batch, D, L) strides
    eager promised: a read and a write of Δ per layer. Written as the linear the op reads through
    a transpose, Δ stays where the matmul put it (the op reads any strides).
    """
    moved = graph.call_method("transpose", (T, -1, -2))
    propagate_val(moved)
    product = graph.call_function(F.linear, (moved, W))
    propagate_val(product)
    back = graph.call_method("transpose", (product, -1, -2))
    propagate_val(back)
    return back


def _program_precision(fold: DeltaFold) -> str | None:
    """Why the op's fp32 bias add and softplus would drop a rounding the program chose: they run
    in 16 bits on a Δ the program rounded to 16 bits itself (probe BN: ``softplus(dt.half() +
    b.half()).float()`` in an fp32 program, 1.5e-3 off eager). A 16-bit model's or autocast's
    Δ comes 16-bit from its linear, and the op computing its softplus in fp32 is its own precision
    (the delta rounding of mamba_ssm's kernels); a bias cast to that Δ's dtype (HF 5.24's
    ``bias.float().to(dt.dtype)`` under autocast) only follows it."""
    narrowed = narrowed_by_program(fold.pre)
    computed = next((n for n in fold.nodes if dtype_of(n) in HALF_DTYPES), None)
    if narrowed is None or computed is None:
        return None
    return (f"{computed.name} computes in {dtype_of(computed)} because {narrowed.name} rounds "
            f"{dtype_of(narrowed.args[0])} to {dtype_of(narrowed)}: eager rounds the bias add and softplus there, "
            "and the op would compute them in fp32")


def _fold(gm: torch.fx.GraphModule, ctx: PassContext, scan: torch.fx.Node) -> None:
    args = scan_args(scan)
    if args["delta_softplus"] or args["delta_bias"] is not None:
        return
    fold = match_delta(args["delta"])
    if isinstance(fold, str):
        ctx.miss(FAMILY, fold, [scan])
    if not isinstance(fold, DeltaFold):
        return
    # The op computes bias add and softplus unrounded: a rounding cast on the way is the
    # program's unless it rounds no finer than the op's inputs already are.
    rounding = dropped_rounding([*fold.nodes, *fold.between], behind_lossless_casts(
        [*(args[k] for k in ("u", "A", "B", "C", "D", "z")), fold.pre, fold.bias]))
    if rounding is None:
        rounding = _program_precision(fold)
    if rounding is not None:
        ctx.miss(FAMILY, rounding, [scan])
        return
    graph = gm.graph
    # The op reads the pre-activation (and the bias, the linear's operands) where it runs, not
    # where the user read them, and the folded linear is recomputed: a write in between
    # (``s = x + b; x.mul_(2)``, ``x = dt_proj(dt); x.add_(c)``) would change what it reads.
    # The sum, the softplus and the views between are recomputed or read past: a write to any of
    # them (``s = dt + b; s[:, 0].mul_(2)``, ``delta.zero_()``) is one the op would not see.
    reads = [fold.pre, fold.bias, *fold.nodes, *fold.between]
    if fold.linear is not None:
        linear_args = named_args(fold.linear, ("input", "weight", "bias"))
        reads += [linear_args["input"], linear_args["weight"]]
    # Only when the product has no other user: otherwise the matmul stays for it, and a second
    # GEMM would cost more than the copy the linear saves.
    matmul, swap = _transposed_product(fold.pre)
    product = _left_weight_product(matmul)
    if product is not None and not all(u in fold.nodes for u in fold.pre.users):
        product = None
    if product is not None:
        reads += list(product)
    # The softplus (and the linear or matmul recomputed at the scan) must have run under the
    # scan's grad mode / autocast / functorch state.
    recomputed = ([fold.linear] if fold.linear is not None else [fold.pre, matmul] if product is not None
                  else [])
    refusal = context_refusal(graph, [scan, *fold.nodes, *recomputed], scan if recomputed else None)
    if refusal is not None:
        ctx.miss(FAMILY, refusal, [scan])
        return
    writer = written_in_place(graph, reads)
    if writer is not None:
        ctx.miss(FAMILY, f"{writer.name} writes in place to memory Δ or its inputs live in: the op would "
                 "compute Δ from them at another point than the user's code did", [scan])
        return
    pre = fold.pre
    with graph.inserting_before(scan):
        if fold.linear is not None:
            linear_args = named_args(fold.linear, ("input", "weight", "bias"))
            pre = graph.call_function(fold.linear.target, (linear_args["input"], linear_args["weight"]))
            propagate_val(pre)
        elif product is not None:
            pre = _as_linear(graph, *product)
            if swap is not None:
                pre = graph.call_method("transpose", (pre, *swap))
                propagate_val(pre)
        new_delta = permute_view(graph, pre, fold.perm)
        if fold.flipped:
            new_delta = graph.call_method("flip", (new_delta, 2))
            propagate_val(new_delta)
    bias = None if fold.bias is None else as_vector(graph, fold.bias, shape_of(new_delta)[1], scan)
    args.update(delta=new_delta, delta_bias=bias, delta_softplus=True)
    set_scan_args(scan, args)
    pattern = "softplus(linear(x, W, b))" if fold.linear is not None else (
        "softplus(x + bias)" if fold.bias is not None else "softplus(x)")
    ctx.rewrite(FAMILY, pattern, fold.nodes, "ssm.selective_scan.default",
                {"delta_bias": fold.bias is not None, "perm": list(fold.perm),
                 **({"time_flipped": True} if fold.flipped else {})})


def delta_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    for scan in scan_nodes(gm.graph):
        _fold(gm, ctx, scan)


def register(pm: PassManager) -> None:
    pm.add("delta", delta_pass)
