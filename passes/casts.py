"""Drop casts that change no value the code computes.

Before the rewrites, ``drop_identity_conversions``: a conversion that returns its own input
(``h.float()`` on an fp32 h, ``x.contiguous()`` on a contiguous x).

Three folds run by the pass manager once the rewrites are done:

* ``narrow_widened_op_reads``: a scan op handed an fp32 copy of a bf16/fp16 u only so that it
  returns y in fp32 (the tail folds' ``_widen_op_y``), whose y is only ever cast back down, reads
  u itself (below).
* ``fold_round_trip_casts``: a widening cast that a narrowing cast undoes (below).
* ``fold_widening_casts_into_ops``: a parameter widened to fp32 only to be handed to an ssm op
  that widens it to fp32 itself (HF's ``D=self.D.float()``; its ``dt_proj.bias.float()`` usually
  goes by the round-trip fold first). In a bf16 model each such cast is a kernel of its own on
  every forward (one per layer in the 130m HF model's profile, ~1.1 us plus a launch gap) and a
  cast back in every backward.

A rewrite that replaces an fp32 value (HF's ``scan_output + hidden_states * D.float()``) with an
op output in the activations' dtype (bf16) casts the output back up, so that the code after it
sees the dtype it had. When that code casts straight back down (``out_proj(y.transpose(1,
2).to(bf16))``), the pair is an identity: every bf16 value is exact in fp32. Inductor does not
fold it, and runs it as a read and a write of the whole activation. ``fold_round_trip_casts``
makes the down-cast read the op output directly, through the same views (which commute with
an elementwise cast).

A skip or gate that eager computes in fp32 after a bf16 scan (HF's ``hidden_states * D`` with an
fp32 D) is folded by giving the op an fp32 copy of u, so that it returns the fp32 sum
(``passes/tail.py``). HF then casts the result straight back to bf16 for out_proj. The ops compute
in fp32 whatever u's dtype and round y once, when they store it, so a bf16 u gives exactly the
down-cast of the fp32 y; the copy of u (a read and a write of the whole activation in fp32), the
fp32 y and its down-cast cost 2.4 ms of a 17.8 ms 130m forward (H100, batch 8, L=2048, run 68).
``narrow_widened_op_reads`` hands the op u itself and puts an up-cast on its y, which the
down-casts then undo: the round trip below.

The result is then a view of the op output where it was a new tensor. Only an in-place write
to either, or a caller holding both, could tell; so a pair is left alone when anything in the
graph writes to the memory of the op output, of the up-cast or the views after it, or of the
down-cast's result, or when the down-cast's result or a view of it is returned. (Writes elsewhere, a cache update say, do not matter.)
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from .fx_utils import (cast_dtype, context_refusal, dtype_of, is_lossless_cast, is_method, mutates, output_getitem,
                       propagate_val, protects_saved_input, storage_of, val, written_args, written_in_place)

# Conversions that return their receiver itself when there is nothing to convert.
_SELF_RETURNING = ("to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous", "cpu", "cuda")


def drop_identity_conversions(gm: torch.fx.GraphModule) -> list[str]:
    """Make the users of ``x.to(x.dtype)``, ``x.float()`` on an fp32 x, ``x.contiguous()`` on a
    contiguous x (and the like) read x; a line per conversion.

    Eager returns x itself from such a call, and so does dynamo's fake run, whose value for the
    node is then x's very fake tensor: that identity, not a reading of the arguments, is the
    test, so a conversion that copies (``copy=True``, a memory format, another device) or rounds
    keeps its node. The users read the same tensor object as before, so gradients and in-place
    writes reach exactly what they reached. Without this, a step that converts the state before
    using it (``h = dA * h.float() + dBu`` in an fp32 loop) has its state update start at the
    conversion, and the loop's last step, with no conversion after it, did not repeat the others.
    The node goes too: the matchers count the users of x, and a dead one would be one of them.
    """
    # Memory written in place keeps its conversions: the matchers' refusals of such writes name
    # the nodes the code wrote (``A.float().mul_(s)``), and nothing is gained there. The written
    # storages are collected once (``written_in_place`` per node would walk the graph per node,
    # and an unrolled loop has thousands); a write to memory of unknown origin counts for all.
    writers = [n for n in gm.graph.nodes if mutates(n)]
    written = {storage_of(a) for n in writers for a in written_args(n) if isinstance(val(a), torch.Tensor)}
    dropped = []
    for node in list(gm.graph.nodes):
        if node.op != "call_method" or node.target not in _SELF_RETURNING or not node.args:
            continue
        src = node.args[0]
        out = val(node)
        if not (isinstance(src, torch.fx.Node) and isinstance(out, torch.Tensor) and out is val(src)):
            continue
        storage = storage_of(src)
        if writers and (storage is None or None in written or storage in written):
            continue
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        dropped.append(f"{node.name}: .{node.target}() returns {src.name} itself; its users read {src.name}")
    return dropped


# Views that only relabel axes: they apply to any tensor, and commute with a dtype cast.
_AXIS_VIEWS = ("transpose", "permute", "t", "unsqueeze", "squeeze")


# ssm ops whose named arguments may come in any of fp32/bf16/fp16 and are read as fp32 on every
# path (the Triton kernels load and widen; the CPU paths compute in fp32, or fp64 when an input
# is fp64), and whose outputs' dtypes do not depend on those arguments' dtypes. Each gradient
# comes back in its input's dtype, rounded once from fp32, which is what the dropped cast's
# backward did.
_WIDENED_BY_OP = {
    "selective_scan": ("D", "delta_bias"),
    "fused_mamba_scan": ("D", "delta_bias"),
    "selective_state_update": ("D", "dt_bias"),
}
_NARROW_FLOATS = (torch.bfloat16, torch.float16)


def fold_widening_casts_into_ops(gm: torch.fx.GraphModule) -> list[str]:
    """Let the ssm ops of ``_WIDENED_BY_OP`` read ``p`` where they read ``p.float()`` (p bf16 or
    fp16); a line per fold. Only a cast to fp32 folds: a cast to fp64 puts the CPU op in its fp64
    mode, which reading p would not. Orphaned casts are left to the caller's dead-code elimination.
    """
    graph = gm.graph
    folds = []
    for op in graph.nodes:
        if op.op != "call_function" or getattr(op.target, "namespace", None) != "ssm":
            continue
        names = _WIDENED_BY_OP.get(op.target._schema.name.split("::")[-1])
        if not names:
            continue
        positions = {a.name: i for i, a in enumerate(op.target._schema.arguments)}
        for name in names:
            i = positions[name]
            in_args = i < len(op.args)
            cast = op.args[i] if in_args else op.kwargs.get(name)
            if not isinstance(cast, torch.fx.Node) or cast_dtype(cast) != torch.float32:
                continue
            src = cast.args[0]
            if not isinstance(src, torch.fx.Node) or dtype_of(src) not in _NARROW_FLOATS:
                continue
            # A write to p between the cast and the op would reach the op after the fold; a
            # cast under no_grad feeding an op under grad (or the reverse) cuts a gradient that
            # reading p would not.
            if (written_in_place(graph, [src, cast]) is not None or context_refusal(graph, [cast, op]) is not None
                    or protects_saved_input(cast)):
                continue
            if in_args:
                op.update_arg(i, src)
            else:
                op.update_kwarg(name, src)
            folds.append(f"{op.name}: {name} reads {src.name} ({dtype_of(src)}) instead of its fp32 cast")
    return folds


def _only_narrowed(y: torch.fx.Node, narrow: torch.dtype) -> bool:
    """Every use of ``y`` is a cast to ``narrow``, through axis views."""
    stack = [y]
    while stack:
        node = stack.pop()
        for user in node.users:
            if is_method(user, *_AXIS_VIEWS) and user.args[0] is node:
                stack.append(user)
            elif cast_dtype(user) != narrow or user.args[0] is not node:
                return False
    return True


def narrow_widened_op_reads(gm: torch.fx.GraphModule) -> list[str]:
    """Let a ``selective_scan`` that reads ``u = x.to(float32)`` (x bf16 or fp16) read x, where
    every use of its y is a cast back to x's dtype through axis views; a line per fold.

    The op's y has u's dtype; it computes in fp32 either way and rounds y once when it stores
    it, so y from x is the down-cast of y from the fp32 copy. An fp64 input puts the op in its
    fp64 mode, where the fp32 y would be rounded twice, and is left alone. y's users then read
    ``y.to(float32)``, which the down-casts undo: ``fold_round_trip_casts`` (run after this)
    removes the pair where nothing can tell, and where it cannot, the values are the same.
    """
    graph = gm.graph
    folds = []
    for op in list(graph.nodes):
        if (op.op != "call_function" or getattr(op.target, "namespace", None) != "ssm"
                or op.target._schema.name.split("::")[-1] != "selective_scan"):
            continue
        cast, y = op.args[0], output_getitem(op, 0)
        if y is None or not isinstance(cast, torch.fx.Node) or cast_dtype(cast) != torch.float32:
            continue
        src = cast.args[0]
        narrow = dtype_of(src) if isinstance(src, torch.fx.Node) else None
        if narrow not in _NARROW_FLOATS or not _only_narrowed(y, narrow):
            continue
        # The op's own rule for the dtype it computes in (fp64 where an input is fp64).
        from ssm_compile.kernels.selective_scan.cpu import compute_dtype

        tensors = [val(a) for a in pytree.tree_leaves((op.args, op.kwargs)) if isinstance(a, torch.fx.Node)]
        if compute_dtype(*[t for t in tensors if isinstance(t, torch.Tensor)]) != torch.float32:
            continue
        if (written_in_place(graph, [src, cast]) is not None or context_refusal(graph, [cast, op]) is not None
                or protects_saved_input(cast)):
            continue
        op.update_arg(0, src)
        propagate_val(op)
        propagate_val(y)
        with graph.inserting_after(y):
            up = graph.call_method("to", (y, torch.float32))
        y.replace_all_uses_with(up, delete_user_cb=lambda user: user is not up)
        propagate_val(up)
        folds.append(f"{op.name}: u reads {src.name} ({narrow}) instead of its fp32 copy; y is only cast back to it")
    return folds


def fold_round_trip_casts(gm: torch.fx.GraphModule) -> list[str]:
    """Fold ``x.to(wide) -> views -> .to(x.dtype)`` into ``x -> views``; a line per fold.

    The orphaned up-casts stay in the graph: the caller's dead-code elimination (the pass
    manager's, which knows which calls write in place) removes them.
    """
    graph = gm.graph
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    # Storages of what the graph returns: a returned view of the down-cast would, after the
    # fold, be a view of the op output (or of a user's input), where eager returned new memory.
    returned = {storage_of(a) for a in pytree.tree_leaves(out_node.args) if isinstance(a, torch.fx.Node)}
    folds = []
    for down in list(graph.nodes):
        narrow = cast_dtype(down)
        if narrow is None or storage_of(down) in returned or storage_of(down) is None:
            continue
        views, node = [], down.args[0]
        while is_method(node, *_AXIS_VIEWS):
            views.append(node)
            node = node.args[0]
        wide = cast_dtype(node)
        if wide is None:
            continue
        src = node.args[0]
        if dtype_of(src) != narrow or not is_lossless_cast(narrow, wide) or narrow == wide:
            continue
        # The up-cast and the views between count too: ``up.mul_(3)`` before the down-cast
        # changes what it reads.
        if written_in_place(graph, [src, node, *views, down]) is not None:
            continue
        # A round trip that starts under no_grad and ends with grad on (or the reverse) cuts a
        # gradient that reading src itself would not.
        if context_refusal(graph, [node, *views, down]) is not None:
            continue
        new = src
        with graph.inserting_before(down):
            for view in reversed(views):
                new = graph.call_method(view.target, (new, *view.args[1:]), dict(view.kwargs))
                propagate_val(new)
        down.replace_all_uses_with(new)
        graph.erase_node(down)
        folds.append(f"{src.name}: .to({wide}) ... .to({narrow}) folded")
    return folds
