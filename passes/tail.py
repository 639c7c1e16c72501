"""Fold the scan's tail, the D skip and the z gate, into ``ssm::selective_scan`` (families
``skip`` and ``gate``).

After the scan, Mamba code finishes the SSM output in plain torch::

    y = y + u * D[None, :, None]          # HF 5.24 (``y + u * rearrange(D, "d -> d 1")``)
    y = y * F.silu(z)                     # or ``y * z * torch.sigmoid(z)``

The op computes exactly ``(C·h + D·u) * silu(z)`` when given ``D=`` and ``z=``, in fp32
registers, saving two (batch, dim, L) round trips through memory. Each fold is proved, not
guessed:

- The skip's ``u`` must be the op's ``u``: the same graph value (up to lossless float casts) read
  in the same layout as ``y`` at that point. In (batch, L, dim) code ``y`` comes back through a
  transpose and the skip reads the untransposed ``u``; the permutations are composed and compared
  axis by axis.
- ``D`` must be a (dim,) vector broadcast along the dim axis of ``y``, or one number for every
  channel (a Python number, or a floating tensor of one element: ``nn.Parameter(torch.ones(1))``),
  which the op reads broadcast to (dim,).
- The gate must be silu of a tensor of ``y``'s shape; the op receives it permuted to its own
  (batch, dim, L) layout as a view.
- Order matters: the op gates after the skip. ``y * silu(z) + D * u`` is a different function;
  its gate still folds (the op then computes ``(C·h) * silu(z)``) and the skip is left in place,
  recorded as a near-miss.
- ``y`` must have no other user on the way (if the pre-skip ``y`` is also returned, folding
  would change that value).
"""
from __future__ import annotations

import operator
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from .delta import ADD_TARGETS, MUL_TARGETS, as_vector, binary_operands, exact_sum, match_bias, signed_sum
from .fx_utils import (HALF_DTYPES, HOIST_BLOCKED, OP_ROUNDING, REVERSED_OUTPUT, SILU_TARGETS, Layout, addcmul_operands,
                       behind_lossless_casts, cast_dtype, context_refusal, dropped_rounding, dtype_of, first_read,
                       flip_dims, follow_views, higher_order_op, hoist_before, hop_name, inverse, is_call, is_method,
                       layout_source, narrowed_by_program, output_getitem, permute_view, propagate_val, same_prefix,
                       same_shape, same_suffix, scan_args, scan_nodes, set_scan_args, shape_of, silu_input, target_name,
                       val, view_chain, written_in_place)
from .manager import PassContext, PassManager

SIGMOID_TARGETS = (torch.sigmoid, torch.ops.aten.sigmoid, F.sigmoid)
# Activations that look like a gate but aren't the op's silu: reported as near-misses.
_OTHER_GATES = (F.gelu, torch._C._nn.gelu, torch.relu, F.relu, torch.tanh, F.softplus,
                torch._C._nn.softplus)


class YChain(NamedTuple):
    """The scan's ``y`` followed forward through views and casts: ``top`` axis ``i`` holds op
    axis ``perm[i]`` of ``y`` (batch, dim, L); ``nodes`` are the views and casts passed.
    ``flipped``: the chain also passes the flip along time that a reverse loop's rewrite puts
    after the op (``scan_loop.REVERSED_OUTPUT``), so ``top`` at time t is the op's y at L-1-t."""

    top: torch.fx.Node
    perm: tuple[int, ...]
    nodes: list[torch.fx.Node]
    flipped: bool = False
    # Where ``top`` is a bare ``squeeze()`` (``_bare_squeeze``): the node before it, which holds y
    # with the axes ``perm`` describes. None where ``top`` does.
    full: Optional[torch.fx.Node] = None

    @property
    def value(self) -> torch.fx.Node:
        """The node holding y in the layout ``perm`` describes: what a folded tail is replaced by."""
        return self.top if self.full is None else self.full


def follow_y(y: torch.fx.Node) -> YChain:
    top, perm, nodes = follow_views(y)
    (flip,) = top.users if len(top.users) == 1 else (None,)
    if flip is None or not flip.meta.get(REVERSED_OUTPUT) or _flip_axis(flip) != perm.index(2):
        return _squeezed(YChain(top, perm, nodes))
    # A reverse loop's outputs: the op ran over flipped time, and its y is flipped back. A skip
    # or gate after that flip folds with its u and z read flipped as well (``_unflipped``).
    end, after, more = follow_views(flip)
    return _squeezed(YChain(end, tuple(perm[p] for p in after), [*nodes, flip, *more], True))


def _adds_unit_axes(node: torch.fx.Node, src: torch.fx.Node) -> bool:
    """``node`` is ``src`` with size-1 axes inserted and nothing else (``src[..., None]``,
    ``src[None]``, ``src.unsqueeze(k)``)."""
    if (is_method(node, "unsqueeze") or is_call(node, torch.unsqueeze)) and not node.kwargs:
        return len(node.args) == 2 and node.args[0] is src and isinstance(node.args[1], int)
    if not is_call(node, operator.getitem) or node.args[0] is not src:
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    return None in index and all(i is None or i is Ellipsis or i == slice(None) for i in index)


def _bare_squeeze(top: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes of ``top.squeeze()``, a squeeze naming no axis, maybe of ``top`` with size-1 axes
    inserted (``top[..., None].squeeze()``: a readout's kept axis), right after ``top``, where the
    axes of ``top`` it keeps are known (every size is provably 1 or is kept); else []. zeta's
    ``selective_scan_seq`` reads out ``(hs @ C.unsqueeze(-1)).squeeze()``, which at batch 1 drops
    the batch axis too, and with one channel the dim axis. Whether a tail after it can fold is
    ``_squeeze_refusal``'s to say."""
    nodes, node = [], top
    while len(node.users) == 1:
        (user,) = node.users
        if not _adds_unit_axes(user, node):
            break
        nodes.append(user)
        node = user
    if len(node.users) != 1:
        return []
    (squeeze,) = node.users
    if not ((is_method(squeeze, "squeeze") or is_call(squeeze, torch.squeeze)) and squeeze.args[0] is node
            and len(squeeze.args) == 1 and not squeeze.kwargs):
        return []
    full, kept = shape_of(top), shape_of(squeeze)
    if full is None or kept is None:
        return []
    if not same_shape([s for s in full if not statically_known_true(s == 1)], kept):
        return []
    return [*nodes, squeeze]


def _squeezed(chain: YChain) -> YChain:
    """``chain`` followed on through ``_bare_squeeze``'s nodes, if there are any."""
    nodes = _bare_squeeze(chain.top)
    if not nodes:
        return chain
    return chain._replace(top=nodes[-1], nodes=[*chain.nodes, *nodes], full=chain.top)


def _squeeze_refusal(chain: YChain, result: torch.fx.Node, term: str, does: str) -> str | None:
    """Why the ``term`` (skip or gate) whose value is ``result`` cannot fold through the squeeze of
    y at the chain's top (the op ``does`` what the term does, in y's shape), or None: no squeeze,
    or one the term undoes.

    Broadcasting lines up trailing axes and puts size-1 axes back in front only. So the squeezed y
    broadcast back holds y's values where y has them exactly when the axes the squeeze dropped are
    y's leading ones (the kept axes, padded with ones in front, are y's shape), and the term then
    reads y's values as the op's output would give them when its result has y's shape. A squeeze
    that drops any other axis (one channel, one step, a size-1 axis in the middle) cannot be
    undone by broadcasting: whatever the term computes, its result is not y's shape with y's
    values in it, so it is left as written."""
    if chain.full is None:
        return None
    full, kept, got = shape_of(chain.full), shape_of(chain.top), shape_of(result)
    if same_shape((1,) * (len(full) - len(kept)) + kept, full):
        if same_shape(got, full):
            return None
        return (f"y reaches the {term} through {chain.top.name}, a squeeze() that drops its leading size-1 axes, "
                f"and the {term}'s result {list(got)} does not broadcast them back to y's {list(full)}: "
                f"the op {does} in y's shape")
    dropped = [i for i, s in enumerate(full) if statically_known_true(s == 1)]
    return (f"y reaches the {term} through {chain.top.name}, a squeeze() that drops y's size-1 axes {dropped} of "
            f"{list(full)}, not only leading ones: broadcasting puts size-1 axes back in front only, so the "
            f"{term}'s result {list(got)} cannot hold y's values where y has them, and the op {does} in y's shape")


def _drop_squeeze(chain: YChain) -> None:
    """Erase the squeeze a fold left unused (``chain.top`` back to ``chain.full``): a later fold
    (the gate after the skip) must find y with no other user."""
    node = chain.top
    while chain.full is not None and node is not chain.full and not node.users:
        source = node.args[0]
        node.graph.erase_node(node)
        node = source


def _flip_axis(node: Any) -> Optional[int]:
    """The one axis ``node`` flips, else None."""
    dims = flip_dims(node)
    return next(iter(dims)) if dims is not None and len(dims) == 1 else None


def _unflipped(u_op: Any) -> Optional[Layout]:
    """Where the op's ``u`` is the flip along time of a value (a reverse loop's operand), that
    value's layout with the op's axes (op axis ``i`` is axis ``perm[i]`` of ``base``), else None."""
    outer = layout_source(u_op)
    if _flip_axis(outer.base) != outer.perm[2]:
        return None
    inner = layout_source(outer.base.args[0])
    return Layout(inner.base, tuple(inner.perm[p] for p in outer.perm), outer.lossless and inner.lossless)


def _flips_of(node: Any) -> tuple[Any, frozenset]:
    """``node`` followed back through flips to what they flip, and the axes flipped an odd number
    of times."""
    axes: frozenset = frozenset()
    while (dims := flip_dims(node)) is not None:
        axes ^= dims
        node = node.args[0]
    return node, axes


def _same_flips(graph: torch.fx.Graph, a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same flips of one tensor that nothing writes in place (a reverse
    loop's u as ``unreverse_loops`` flips it, beside the user's own ``u.flip(-1)``, or
    ``u.flip(-1).flip(-1)`` beside u: probe CL)."""
    base, axes = _flips_of(a)
    return (a is not b and (base, axes) == _flips_of(b) and isinstance(base, torch.fx.Node)
            and written_in_place(graph, [base]) is None)


def _op_u(u_op: Any, chain: YChain) -> Optional[Layout]:
    """The op's u as the skip after ``chain`` must read it: itself, or what it flips when the
    chain flips y back (None if it flips nothing)."""
    return _unflipped(u_op) if chain.flipped else layout_source(u_op)


def _rounds_coarser(node: torch.fx.Node, dtype: torch.dtype) -> bool:
    """``node`` is a cast to a less precise dtype than ``dtype``: one ``_widen_chain`` retargets."""
    target = cast_dtype(node)
    return target is not None and torch.finfo(target).eps > torch.finfo(dtype).eps


def _widen_chain(chain: YChain, dtype: torch.dtype) -> YChain:
    """Retarget the chain's casts to a less precise dtype than ``dtype`` (the tail's) to ``dtype``.

    Folding moves the tail (skip, gate) in front of the chain: the casts that rounded y alone
    would then round y + D·u or y·silu(z). Where the user's code computes the tail in a wider
    dtype (type promotion against an fp32 D, an autocast region ending at the readout), eager
    keeps the tail's result in that dtype, and so must the rewrite; the cast, now applied to the
    op's output before the tail instead of after, only loses what the op did not round.
    """
    graph = chain.top.graph
    nodes, full = [], chain.full
    for node in chain.nodes:
        if _rounds_coarser(node, dtype):
            with graph.inserting_after(node):
                wide = graph.call_method("to", (node.args[0], dtype))
            node.replace_all_uses_with(wide)
            graph.erase_node(node)
            full = wide if node is full else full
            node = wide
        propagate_val(node)
        nodes.append(node)
    return YChain(nodes[-1] if nodes else chain.top, chain.perm, nodes, full=full)


def _widening_refusal(scan: torch.fx.Node, chain: YChain, dtype: torch.dtype, folded: Any) -> str | None:
    """Why ``_widen_chain(chain, dtype)`` would change the program, or None.

    Retargeting a cast drops the rounding it made. That is only the op's own rounding moved
    when the scan rewrite emitted the cast for the readout's dtype (``OP_ROUNDING``: an autocast
    bf16 readout) or, as ``fx_utils.dropped_rounding`` allows, when the cast rounds no finer than
    the op's inputs (a bf16 model's readout promoted against an fp32 D). ``y.bfloat16().float()``
    written in an fp32 program rounds finer, and that rounding is the program's.
    """
    retargeted = [n for n in chain.nodes if _rounds_coarser(n, dtype) and not n.meta.get(OP_ROUNDING)]
    args = scan_args(scan)
    inputs = behind_lossless_casts([*(args[k] for k in ("u", "delta", "A", "B", "C", "D", "z")), folded])
    return dropped_rounding(retargeted, inputs)


def _finer_tail(scan: torch.fx.Node, dtype: torch.dtype, term: str) -> tuple[bool, str | None]:
    """Whether folding a tail that eager computes in ``dtype`` needs the op's y in fp32, and why
    it cannot be folded at all (or None).

    The op returns y + D·u and y·silu(z) in its y's dtype (u's). A tail the program computes in a
    finer dtype is not rounded to y's dtype by eager: a bf16 scan's y added to D·u against an fp32
    D, or gated by an fp32 z, sums in fp32. The fold then gives the op an fp32 copy of u (exact), so
    that it returns the fp32 sum; what it drops is its own rounding of y, which the rule of
    ``fx_utils.dropped_rounding`` lets go. An fp64 tail after an fp32 y (an fp64 D or z) cannot be
    had that way on the GPU, which has no fp64 kernel, and would be rounded to fp32 (probe CR: 5e-5
    off an fp64 output where eager is 7e-10): left alone, as an fp64 C readout is."""
    y = output_getitem(scan, 0)
    y_dtype = dtype_of(y) if y is not None else None
    if (y_dtype is None or not (dtype.is_floating_point and y_dtype.is_floating_point)
            or torch.finfo(dtype).eps >= torch.finfo(y_dtype).eps):
        return False, None
    if dtype == torch.float32:
        return True, None
    return False, (f"the program computes {term} in {dtype}, finer than the scan's y ({y_dtype}): the op "
                   f"would return it rounded to {y_dtype}, a rounding eager does not make (the GPU kernels have no "
                   "fp64 y to give it)")


def _widen_op_y(graph: torch.fx.Graph, scan: torch.fx.Node, args: dict[str, Any]) -> None:
    """Give the op an fp32 copy of u, so that it returns y (and its tail) in fp32."""
    with graph.inserting_before(scan):
        args["u"] = graph.call_method("to", (args["u"], torch.float32))
    propagate_val(args["u"])
    set_scan_args(scan, args)
    propagate_val(scan)
    for out in scan.users:
        propagate_val(out)


def _find_tail(ctx: PassContext, scan: torch.fx.Node, family: str,
               match: Callable[[torch.fx.Node, YChain], Any]) -> Optional[tuple[YChain, torch.fx.Node, Any]]:
    """The first user of the scan's ``y`` chain that ``match`` recognises, as ``(chain, user,
    match result)``; None, recording why under ``family`` if it was a near-miss, when there is
    none or ``y`` has other users (folding would change what they read)."""
    y = output_getitem(scan, 0)
    if y is None:
        return None
    chain = follow_y(y)
    for user in list(chain.top.users):
        found = match(user, chain)
        if found is None:
            continue
        if isinstance(found, str):
            ctx.miss(family, found, [user])
            return None
        if any(other is not user and not _reads_shape_only(other, chain.top) for other in chain.top.users):
            # (The rewrite's own flip of a reverse loop's outputs is no node of the user's: probe CL.)
            named = ("the loop's outputs" if chain.top.meta.get(REVERSED_OUTPUT) else chain.top.name)
            ctx.miss(family, f"y ({named}) has other users besides the {family}", [user])
            return None
        return chain, user, found
    if family == "gate":
        through = _gated_after_a_function(chain.top)
        if through is not None:
            ctx.miss(family, through[1], [through[0]])
            return None
    hooked = _hooked_y(chain.top)
    if hooked is not None:
        ctx.miss(family, f"y ({chain.top.name}) passes through {hop_name(hooked)} (a hook on the tensor, or a custom "
                 f"autograd.Function) before the sum or product after it: no {family} is folded across it, "
                 "since the op's output would bypass what it does in the backward", [hooked])
    return None


def _gated_after_a_function(y: torch.fx.Node) -> Optional[tuple[torch.fx.Node, str]]:
    """``(gate, why)`` when a silu gate multiplies a function of y rather than y (an
    ``nn.Dropout`` between the scan and the gate, probe BS): the op gates y itself. None otherwise,
    and where that function is a sum (``_gate_after_a_sum`` says why)."""
    for f in y.users:
        if f.op not in ("call_function", "call_method") or binary_operands(f, ADD_TARGETS) is not None:
            continue
        for g in f.users:
            factors = binary_operands(g, MUL_TARGETS)
            if factors is None or f not in factors or factors[0] is factors[1]:
                continue
            if _silu_input(factors[1] if factors[0] is f else factors[0]) is not None:
                return g, (f"the gate {g.name} multiplies {f.name} ({target_name(f)} of y), not y: the op gates y "
                           "itself, so nothing between the scan and the gate may change it")
    return None


def _hooked_y(y: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The higher-order op that reads ``y`` and whose output some sum or product reads (where a
    skip or gate would be: a hook on y, probe BA), or None."""
    for user in y.users:
        hop = higher_order_op(user)
        if hop is None:
            continue
        outs = [hop, *(u for u in hop.users if is_call(u, operator.getitem))]
        if any(binary_operands(r, ADD_TARGETS) is not None or binary_operands(r, MUL_TARGETS) is not None
               for o in outs for r in o.users):
            return hop
    return None


def _reads_shape_only(user: torch.fx.Node, y: torch.fx.Node) -> bool:
    """``user`` reads nothing of ``y`` but its shape (``D.expand_as(y)``, ``y.size(-1)``), which the
    fold leaves as it is: the op's output replaces y and y + D*x has y's shape."""
    if is_method(user, "expand_as", "view_as", "reshape_as"):
        return len(user.args) == 2 and user.args[1] is y and user.args[0] is not y and not user.kwargs
    return is_method(user, "size", "dim", "numel") and user.args[0] is y


def _fold_refusal(scan: torch.fx.Node, chain: YChain, folded: list[torch.fx.Node], value: torch.fx.Node,
                  name: str) -> str | None:
    """Why ``folded`` (a skip or gate, reading ``value``, the op's argument ``name``) cannot be
    folded into ``scan``: it would move into another grad-mode / autocast / functorch region than
    the user's code computed it in, or ``value`` cannot be moved above the scan. None once
    ``value`` has been moved there."""
    refusal = context_refusal(scan.graph, [scan, *chain.nodes, *folded])
    if refusal is not None:
        return refusal
    # (A Python number, a skip's D, is no node to move.)
    hoisted = hoist_before(value, scan, scan) if isinstance(value, torch.fx.Node) else None
    if hoisted == HOIST_BLOCKED:
        return f"{name} is computed from the scan's output"
    return None if hoisted is None else f"{name}: {hoisted}"


_TERM_LIMIT = 64


def _written_term(graph: torch.fx.Graph, roots: list[torch.fx.Node], stops: set) -> str | None:
    """Why folding the term ``roots`` would lose an in-place write, or None: the start of a
    reason naming the node that writes to the memory of ``roots`` or of what they are computed
    from, back to ``stops`` (y and the values the op reads itself). The op recomputes the whole
    term from those values, so a write to an intermediate of it (``skip[:, :, 0] = 0``, a write
    through a transpose of the product, ``g = silu(z); g.view(-1)[:5] = 0``) would be lost."""
    term, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        # Sizes (``u.size(0)`` under dynamic shapes) and other non-tensors hold no memory.
        if (not isinstance(node, torch.fx.Node) or node in term or node in stops
                or not isinstance(val(node), torch.Tensor)):
            continue
        term.add(node)
        if len(term) > _TERM_LIMIT:
            return f"the term is computed through more than {_TERM_LIMIT} nodes, too many to check for writes to"
        if node.op not in ("placeholder", "get_attr"):
            stack.extend(node.all_input_nodes)
    # A write before a value is made (a buffer filled in place, then viewed or cast without a
    # copy: VMamba's cross-scan, probe CB) is in it for the user's term and the op's alike.
    writer = written_in_place(graph, sorted(term, key=lambda n: n.name), after_made=True)
    return None if writer is None else f"{writer.name} writes in place to the memory of a value in"


def _replace_with(node: torch.fx.Node, replacement: torch.fx.Node) -> None:
    """Make ``node``'s users read ``replacement`` instead, cast to ``node``'s dtype if the user's
    code produced another one (type promotion against an fp32 ``D`` makes bf16 code fp32)."""
    graph = node.graph
    if dtype_of(replacement) != dtype_of(node):
        with graph.inserting_after(node):
            replacement = graph.call_method("to", (replacement, dtype_of(node)))
            propagate_val(replacement)
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)


# ---------------------------------------------------------------------------------------------
# Skip: y + u * D
# ---------------------------------------------------------------------------------------------

class Skip(NamedTuple):
    add: torch.fx.Node
    D: torch.fx.Node
    nodes: list[torch.fx.Node]
    factors: tuple[Any, Any]  # the product's (u, D) operands as the user's code reads them


def match_skip(add: torch.fx.Node, chain: YChain, u_op: Any) -> Skip | str | None:
    """Prove ``add`` = ``chain.top + u * D`` (or ``torch.addcmul(chain.top, u, D)``) with the op's
    ``u`` and a (dim,) ``D``.

    None if ``add`` isn't an add of a product to ``y`` at all; a reason string for near-misses.
    """
    if is_call(add, torch.addcmul) or is_method(add, "addcmul"):
        # torch.addcmul(y, u, D): the same y + u * D in one call, with no product node of its own.
        if not add.args or add.args[0] is not chain.top:
            return None
        fused = addcmul_operands(add)
        if fused is None:
            return f"torch.addcmul(y, ...) with {dict(add.kwargs)} is not the op's y + u * D"
        other, factors = None, fused[1:]
    else:
        operands = binary_operands(add, ADD_TARGETS)
        if operands is None or chain.top not in operands or operands[0] is operands[1]:
            return _skip_subtracted(add, chain, u_op)
        other = operands[1] if operands[0] is chain.top else operands[0]
        # The product may be computed in another layout and permuted back (``(u.mT * D).mT``).
        behind = layout_source(other, allow_casts=False)
        product, sigma, views = behind.base, behind.perm, view_chain(other, behind.base)
        factors = binary_operands(product, MUL_TARGETS)
        if factors is None:
            return _skip_by_einsum(product, chain, u_op) or _skip_after_a_sum(add, chain, u_op)
    top_shape = shape_of(chain.value)
    refusal = _squeeze_refusal(chain, add, "skip", "adds D·u to y")
    if refusal is not None:
        return refusal
    if not same_shape(shape_of(add), top_shape):
        return f"the skip broadcasts y from {list(top_shape)} to {list(shape_of(add))}"
    if other is None:
        product, sigma, views = None, tuple(range(len(top_shape))), []
    # Axis i of y lines up with axis sigma[i] of the product.
    product_shape = shape_of(product) if product is not None else top_shape
    dim_axis = sigma[chain.perm.index(1)]
    op_u = _op_u(u_op, chain)
    if op_u is None:
        return "y is flipped back along time after a reverse scan whose u the op does not read flipped"
    reasons = []
    for u_like, d_like in (factors, factors[::-1]):
        if not same_shape(shape_of(u_like), product_shape):
            continue
        D = match_bias(d_like, product_shape, dim_axis, product_shape[dim_axis])
        if D is None:
            D = _one_number(d_like, len(product_shape), product_shape[dim_axis])
        if D is None:
            where = (f"the dim axis {dim_axis} of y" if not views else
                     f"the product's axis {dim_axis}, which its permutation turns into y's dim axis "
                     f"{chain.perm.index(1)}")
            reasons.append(f"{d_like.name if hasattr(d_like, 'name') else d_like!r} is not a "
                           f"(dim,) vector broadcast along {where}")
            continue
        skip_u = layout_source(u_like)
        if (skip_u.base is not op_u.base and (chain.flipped or not same_prefix(skip_u.base, op_u.base))
                and not same_suffix(skip_u.base, op_u.base) and not _same_flips(add.graph, skip_u.base, op_u.base)):
            # (A loop over the first k steps: the op reads u narrowed to k steps, the user's skip
            # its own u[..., :k], the same value; probe BY. A reverse loop that stops before step
            # 0: the op reads u's last k steps, the skip u[..., 1:]; probe CS.)
            # (Said as proved, not as a fact: a gather by a reversed arange is the same value as
            # a flip, but the pass does not read it as one; probe CN.)
            reasons.append(f"the skip multiplies {u_like.name}, not the scan's u (nor a value the pass proves "
                           "equal to it: u through views, lossless casts and flips)")
            continue
        if not (skip_u.lossless and op_u.lossless):
            reasons.append("a rounding cast lies between the skip's u and the scan's u")
            continue
        if any(skip_u.perm[sigma[i]] != op_u.perm[chain.perm[i]] for i in range(len(top_shape))):
            reasons.append("the skip reads u in another layout than y (axes don't line up)")
            continue
        return Skip(add, D, [add] if other is None else [add, *views, product], (u_like, d_like))
    return "; ".join(reasons) if reasons else None


def _one_number(d_like: Any, ndim: int, dim: Any) -> Any:
    """``d_like`` when it is one number for every channel (a Python int or float, or a floating
    tensor of one element with no more axes than the product: a 0-dim or (1,) parameter), which
    ``_d_vector`` broadcasts to the op's (dim,) D; else None. The channel count must be a number:
    the broadcast is built with it."""
    if not is_concrete_int(dim):
        return None
    if type(d_like) in (int, float):
        return d_like
    value = val(d_like) if isinstance(d_like, torch.fx.Node) else None
    if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() <= ndim
            and all(statically_known_true(s == 1) for s in value.shape)):
        return d_like
    return None


def _d_vector(graph: torch.fx.Graph, D: Any, dim: int, scan: torch.fx.Node, u: torch.fx.Node) -> torch.fx.Node:
    """The op's (dim,) D for a matched skip's ``D``: ``as_vector``'s view of a (dim,)-valued one; a
    one-element tensor broadcast by a view (so its gradient is the sum over channels, as eager's);
    a Python number as a filled vector in the dtype eager multiplies it in (u's opmath dtype)."""
    if isinstance(D, torch.fx.Node):
        if statically_known_true(dim == 1) or any(not statically_known_true(s == 1) for s in shape_of(D)):
            return as_vector(graph, D, dim, scan)
        with graph.inserting_before(scan):
            one = graph.call_method("reshape", (D, (1,)))
            propagate_val(one)
            vector = graph.call_method("expand", (one, dim))
            propagate_val(vector)
        return vector
    with graph.inserting_before(scan):
        vector = graph.call_method("new_full", (u, (dim,), D),
                                   {"dtype": torch.promote_types(dtype_of(u), torch.float32)})
        propagate_val(vector)
    return vector


def _skip_subtracted(sub: torch.fx.Node, chain: YChain, u_op: Any) -> str | None:
    """Why not, when ``sub`` is ``y - u·X`` or ``u·X - y`` with the scan's u (a skip of the other
    sign), or a sum that scales one side by its ``alpha`` (``torch.add(y, u·X, alpha=2)``), which
    the op (``y + D·u``) does not compute. None for anything else."""
    y = chain.top
    found = signed_sum(sub)
    if found is None or y not in sub.args or (not found.sub and found.alpha == 1):
        return None
    is_sub, alpha = found.sub, found.alpha
    term = sub.args[1] if sub.args[0] is y else sub.args[0]
    u = _user_u(u_op, chain)
    if not _product_of(term, u):
        return None
    # Only a (dim,) coefficient makes the subtracted term a D·u of the other sign: a per-step one
    # (Hydra's diagonal correction (C_t·B_t)·Δ_t·u_t, probe AZ) is no skip whatever its sign.
    coeff = next((f for f in binary_operands(term, MUL_TARGETS)
                  if not (isinstance(f, torch.fx.Node) and layout_source(f).base is u)), None)
    shape = shape_of(coeff) if isinstance(coeff, torch.fx.Node) else None
    dim = shape_of(u_op)[1] if shape_of(u_op) is not None else None
    # (Only the reason depends on this: sizes not provably 1 count as wide.)
    wide = [s for s in (shape or ()) if not statically_known_true(s == 1)]
    if dim is not None and (len(wide) > 1 or len(wide) == 1 and not statically_known_true(wide[0] == dim)):
        return (f"{sub.name} {'subtracts' if is_sub else 'adds'} the product of the scan's u and {coeff.name} "
                f"(shape {list(shape)}), "
                "which is not a (dim,) vector D: not the op's skip y + D·u")
    if alpha != 1:
        a, b = ("y" if x is y else x.name for x in sub.args)
        spelled = f"{a} {'-' if is_sub else '+'} {alpha}·{b}"
        return f"{sub.name} computes {spelled} (its alpha={alpha}), not y + D·u: the op adds D·u to y"
    return f"{sub.name} subtracts {'D·u from y' if sub.args[0] is y else 'y from D·u'}: the op adds D·u to y"


def _user_u(u_op: Any, chain: YChain) -> Any:
    """The u the user's skip after ``chain`` reads: past the op's own flip where the chain flips y
    back (a reverse loop's tail, probe CN: its subtracted skip had no reason)."""
    found = _op_u(u_op, chain)
    return (found or layout_source(u_op)).base


def _product_of(node: Any, u: torch.fx.Node) -> bool:
    """``node`` is a two-factor product with a factor that is ``u`` (through views and casts)."""
    factors = binary_operands(node, MUL_TARGETS)
    return factors is not None and any(isinstance(f, torch.fx.Node) and layout_source(f).base is u for f in factors)


def _skip_by_einsum(product: Any, chain: YChain, u_op: Any) -> str | None:
    """Why not, when the term added to y is an einsum of the scan's u (``einsum('bld,d->bld', u,
    D)``, probe DC: no reason before). The skip is proved only from a product ``u * D`` (or
    ``addcmul``), whose factors the proof reads; an einsum's operands would need their labels
    mapped to y's axes first, and autocast treats einsum as one of its lower-precision ops
    (``fx_utils._AUTOCAST_LOWP``) where it leaves a product alone, so the two are not one
    computation everywhere."""
    if not is_call(product, torch.einsum, torch.functional.einsum):
        return None
    u = _user_u(u_op, chain)
    if not any(isinstance(f, torch.fx.Node) and layout_source(f).base is u for f in product.args[1:]):
        return None
    return (f"the term added to y is {product.name} = torch.einsum({product.args[0]!r}, ...) of the scan's u: "
            "the pass reads a D·u skip only as a product u * D (or torch.addcmul), so it is left as written")


def _skip_after_a_sum(add: torch.fx.Node, chain: YChain, u_op: Any) -> str | None:
    """Why not, when ``add`` = y + X (X no product) is itself added to a product of the scan's u,
    as in a bidirectional ``(y_fwd + y_bwd.flip(-1)) + u * D``: the op's D skip is added to y
    alone, so folding would reassociate the user's sum. None when nothing downstream looks like
    the skip (the common case: y + X is the residual or another direction's output)."""
    op_u = _user_u(u_op, chain)
    for user in add.users:
        operands = binary_operands(user, ADD_TARGETS)
        if operands is None or add not in operands:
            continue
        if _product_of(operands[1] if operands[0] is add else operands[0], op_u):
            return (f"the skip (a product of the scan's u, {user.name}) is added to {add.name} = y + another term, "
                    "not to y: the op adds D·u to y alone, and folding would reassociate the sum")
    return None


def _try_skip(gm: torch.fx.GraphModule, ctx: PassContext, scan: torch.fx.Node) -> bool:
    args = scan_args(scan)
    found = _find_tail(ctx, scan, "skip", lambda user, chain: match_skip(user, chain, args["u"]))
    if found is None:
        return False
    chain, user, skip = found
    if args["z"] is not None:
        ctx.miss("skip", "D·u is added after the z gate: y*silu(z) + D*u is not the op's "
                 "(y + D*u)*silu(z)", [user])
        return False
    if args["D"] is not None:
        ctx.miss("skip", "the scan already has a D", [user])
        return False
    widen_y, refusal = _finer_tail(scan, dtype_of(skip.add), "y + D·u")
    refusal = (refusal
               or _widening_refusal(scan, chain, dtype_of(skip.add), skip.D)
               or _fold_refusal(scan, chain, skip.nodes, skip.D, "D"))
    if refusal is not None:
        ctx.miss("skip", refusal, [user])
        return False
    # The op reads D (and u) where the scan is, the user's D·u reads them where it is written. A
    # write before the values it writes are read by either (VMamba's cross-scan fills a buffer in
    # place, then views it as u: probe CB) is seen by both alike; one after the first read of u's
    # memory by either may be seen by one only.
    u_reads = [args["u"], skip.factors[0]]
    writer = (written_in_place(gm.graph, [skip.D], after_made=True)
              or written_in_place(gm.graph, u_reads, since=first_read(u_reads)))
    if writer is not None:
        ctx.miss("skip", f"{writer.name} writes D or u in place after the op or the user's D·u first reads it: the "
                 "fold moves the op's read of them, so the two could read different values", [user])
        return False
    writer = _written_term(gm.graph, [*skip.nodes[1:], *skip.factors],
                           {chain.top, skip.D, _op_u(args["u"], chain).base})
    if writer is not None:
        ctx.miss("skip", f"{writer} the D·u product the fold computes from u and D itself", [user])
        return False
    args["D"] = _d_vector(gm.graph, skip.D, shape_of(chain.value)[chain.perm.index(1)], scan, args["u"])
    set_scan_args(scan, args)
    if widen_y:
        _widen_op_y(gm.graph, scan, args)
    chain = _widen_chain(chain, dtype_of(skip.add))
    _replace_with(skip.add, chain.value)
    _drop_squeeze(chain)
    decision = {"perm": list(chain.perm)}
    if chain.full is not None:
        decision["y"] = "squeeze() of its leading size-1 axes, broadcast back by the skip"
    if widen_y:
        decision["u"] = ("fp32 copy (eager sums y + D·u in fp32; u itself where the program casts the result back, "
                         "casts.narrow_widened_op_reads)")
    ctx.rewrite("skip", "y + u * D", skip.nodes, "ssm.selective_scan.default", decision)
    return True


# ---------------------------------------------------------------------------------------------
# Gate: y * silu(z)
# ---------------------------------------------------------------------------------------------

class Gate(NamedTuple):
    out: torch.fx.Node   # the node whose value is y * silu(z)
    z: torch.fx.Node
    nodes: list[torch.fx.Node]


def _silu_input(g: Any) -> Optional[torch.fx.Node]:
    """``z`` if ``g`` is ``silu(z)``, ``z * sigmoid(z)`` or ``sigmoid(z) * z``."""
    z = silu_input(g)
    if z is not None:
        return z
    factors = binary_operands(g, MUL_TARGETS)
    if factors is not None:
        for z, s in (factors, factors[::-1]):
            if _sigmoid_input(s) is z:
                return z
    return None


def _is_inplace_silu(g: Any) -> bool:
    if is_call(g, *SILU_TARGETS):
        return bool(g.kwargs.get("inplace", False) or (len(g.args) > 1 and g.args[1]))
    return is_method(g, "silu_") or is_call(g, torch.ops.aten.silu_)


def _is_detach(node: Any) -> bool:
    return (is_method(node, "detach") or is_call(node, torch.detach)) and len(node.args) == 1


def _sigmoid_input(s: Any) -> Optional[torch.fx.Node]:
    if (is_call(s, *SIGMOID_TARGETS) or is_method(s, "sigmoid")) and len(s.args) == 1:
        return s.args[0]
    return None


def match_gate(mul: torch.fx.Node, chain: YChain) -> Gate | str | None:
    """Prove ``mul`` (possibly with the next mul) computes ``chain.top * silu(z)``."""
    factors = binary_operands(mul, MUL_TARGETS)
    if factors is None or chain.top not in factors or factors[0] is factors[1]:
        return _gate_after_a_sum(mul, chain.top)
    g = factors[1] if factors[0] is chain.top else factors[0]
    out, nodes = mul, [mul]
    z = _silu_input(g)
    if z is None and len(mul.users) == 1:
        # (y * sigmoid(z)) * z and (y * z) * sigmoid(z): the gate split over two muls.
        (outer,) = mul.users
        outer_factors = binary_operands(outer, MUL_TARGETS)
        if outer_factors is not None and mul in outer_factors:
            h = outer_factors[1] if outer_factors[0] is mul else outer_factors[0]
            for zz, s in ((g, h), (h, g)):
                if _sigmoid_input(s) is zz:
                    # The gate's nodes are the two muls and the sigmoid (g may be z itself).
                    z, out, nodes, g = zz, outer, [mul, outer], s
    if z is None:
        if is_call(g, *_OTHER_GATES) or is_call(g, *SIGMOID_TARGETS):
            return f"the gate is {g.name}, not silu: the op computes y * silu(z)"
        if _is_detach(g) and _silu_input(g.args[0]) is not None:
            return f"the gate is {g.name} = silu(z).detach(): the op's gate would send gradients to z"
        factors = binary_operands(g, MUL_TARGETS)
        if factors is not None and any(map(_is_detach, factors)):
            bare = tuple(f.args[0] if _is_detach(f) else f for f in factors)
            if any(_sigmoid_input(s) is zz for zz, s in (bare, bare[::-1])):
                return (f"the gate is {g.name} = z * sigmoid(z) with a detached factor: the op's gate would "
                        "send gradients through both")
        hop = higher_order_op(g)
        if hop is not None and any(_silu_input(a) is not None for a in hop.all_input_nodes):
            return (f"the gate is {hop_name(hop)} of silu(z) (a custom autograd.Function, or a hook on the tensor): "
                    "the op's gate would drop what that does in the backward")
        sig = next((_sigmoid_input(f) for f in factors or () if _sigmoid_input(f) is not None), None)
        if sig is not None:
            other = factors[1] if _sigmoid_input(factors[0]) is sig else factors[0]
            return (f"the gate is {g.name} = {getattr(other, 'name', other)} * sigmoid({getattr(sig, 'name', sig)}): "
                    "the sigmoid reads another node than the factor it multiplies (a copy or view of it is not "
                    "proved to be the same z), and the op computes y * silu(z) of one z")
        if _is_inplace_silu(g):
            return (f"the gate is {g.name} = silu(z, inplace=True), which also writes silu(z) into z: "
                    "the op's gate would leave z as it was")
        if isinstance(g, torch.fx.Node) and any(_silu_input(a) is not None for a in g.all_input_nodes):
            # ``2 * silu(z)``, ``silu(z) + 1`` (probe CG: no reason was given).
            return (f"the gate is {g.name} = {target_name(g)} of silu(z) and another value, not silu(z) itself: "
                    "the op computes y * silu(z)")
        return None
    refusal = _squeeze_refusal(chain, out, "gate", "gates y")
    if refusal is not None:
        return refusal
    if not same_shape(shape_of(z), shape_of(chain.value)) or not same_shape(shape_of(out), shape_of(chain.value)):
        return f"the gate's z has shape {shape_of(z)}, y has {shape_of(chain.value)}"
    return Gate(out, z, nodes + [g])


def _gate_after_a_sum(add: torch.fx.Node, y: torch.fx.Node) -> str | None:
    """Why not, when ``add`` = y + X (or y - X, X - y) and a user of it is a silu gate (a second
    D·u term, a residual added or subtracted before the gate): the op gates y, with its own D·u,
    alone. None otherwise."""
    found = signed_sum(add)
    if found is None or y not in add.args:
        return None
    # y - X, or a sum that scales X by its alpha, is another sum all the same; an exact sum is y + X.
    operands = (found.left, found.right)
    sub, alpha = (False, 1) if exact_sum(found) else (found.sub, found.alpha)
    for user in add.users:
        factors = binary_operands(user, MUL_TARGETS)
        if factors is None or add not in factors:
            continue
        if _silu_input(factors[1] if factors[0] is add else factors[0]) is not None:
            other = getattr(operands[1] if operands[0] is y else operands[0], "name", "X")
            a, b = ("y" if x is y else other for x in operands)
            spelled = f"{a} {'-' if sub else '+'} {'' if alpha == 1 else f'{alpha}·'}{b}"
            return (f"the gate {user.name} multiplies {add.name} = {spelled}, not y: "
                    "the op gates y (with its own D·u) alone")
    return None


def _try_gate(gm: torch.fx.GraphModule, ctx: PassContext, scan: torch.fx.Node) -> bool:
    args = scan_args(scan)
    found = _find_tail(ctx, scan, "gate", match_gate)
    if found is None:
        return False
    chain, user, gate = found
    if args["z"] is not None:
        ctx.miss("gate", "the scan already has a z", [user])
        return False
    narrowed = narrowed_by_program(gate.z) if dtype_of(gate.z) in HALF_DTYPES else None
    widen_y, refusal = _finer_tail(scan, dtype_of(gate.out), "y·silu(z)")
    refusal = (refusal
               or _widening_refusal(scan, chain, dtype_of(gate.out), gate.z)
               or _fold_refusal(scan, chain, gate.nodes, gate.z, "z")
               or (None if narrowed is None else
                   f"silu(z) runs in {dtype_of(gate.z)} because {narrowed.name} rounds z from "
                   f"{dtype_of(narrowed.args[0])}: eager rounds silu(z) there, and the op would compute it in fp32"))
    if refusal is not None:
        ctx.miss("gate", refusal, [user])
        return False
    writer = written_in_place(gm.graph, [gate.z], after_made=True)
    if writer is not None:
        ctx.miss("gate", f"{writer.name} writes z in place after it is made, so the op would read it at another "
                 "point than the user's silu(z) does", [user])
        return False
    writer = _written_term(gm.graph, [n for n in gate.nodes if n is not gate.out], {chain.top, gate.z})
    if writer is not None:
        ctx.miss("gate", f"{writer} the gate the fold computes from z itself", [user])
        return False
    with gm.graph.inserting_before(scan):
        args["z"] = permute_view(gm.graph, gate.z, inverse(chain.perm))
        if chain.flipped:
            # The op gates its y, which runs over flipped time: z is read flipped too.
            args["z"] = gm.graph.call_method("flip", (args["z"], (-1,)))
            propagate_val(args["z"])
    set_scan_args(scan, args)
    if widen_y:
        _widen_op_y(gm.graph, scan, args)
    chain = _widen_chain(chain, dtype_of(gate.out))
    _replace_with(gate.out, chain.value)
    _drop_squeeze(chain)
    decision = {"perm": list(chain.perm)}
    if chain.full is not None:
        decision["y"] = "squeeze() of its leading size-1 axes, broadcast back by the gate"
    if widen_y:
        decision["u"] = ("fp32 copy (eager computes y·silu(z) in fp32; u itself where the program casts the result "
                         "back, casts.narrow_widened_op_reads)")
    if dtype_of(gate.z) in HALF_DTYPES:
        # Eager computes silu of a 16-bit z in that dtype and rounds it; the op keeps it in fp32
        # (a rounding no finer than z's own, which ``dropped_rounding`` lets go). Said, not hidden.
        decision["silu"] = f"fp32 (eager rounds silu(z) to {dtype_of(gate.z)})"
    ctx.rewrite("gate", "y * silu(z)", gate.nodes, "ssm.selective_scan.default", decision)
    return True


def tail_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    for scan in scan_nodes(gm.graph):
        skipped = _try_skip(gm, ctx, scan)
        if _try_gate(gm, ctx, scan) and not skipped:
            # Only to explain: a skip after the gate is left alone, and the miss says why.
            _try_skip(gm, ctx, scan)


def register(pm: PassManager) -> None:
    pm.add("tail", tail_pass)
