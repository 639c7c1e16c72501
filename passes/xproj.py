"""Family ``x_proj_split``: the x_proj output reaches the ssm ops as views, never as copies.

Mamba splits the x_proj output into dt, B, C (``torch.split(x_dbl, [R, N, N], dim=-1)``) and
then lays B and C out as (batch, N, L). Code written for mamba_ssm's CUDA kernels follows that
with ``.contiguous()`` (``rearrange(B, "(b l) n -> b n l", l=L).contiguous()``), because those
kernels needed unit stride. The ``ssm`` ops read any strides, so the copy is pure HBM traffic:
this pass removes ``.contiguous()`` / ``.clone()`` on the way from a split output to an ssm op
argument when the copy's value goes nowhere else.

Soundness: a copy also protects its consumer from later in-place writes to the source, so a
copy stays when anything along the way (the split's input, its outputs, the views) or anything
else sharing the split input's storage (another view of x_proj's output) is mutated in place,
when the op argument is one the op itself writes (a decode op's state), and when x_proj's output
is a graph input or a returned tensor under grad mode: the caller may write it before the
backward, which reads what the op saved (``protects_saved_input``).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from .fx_utils import (context_refusal, is_call, is_method, is_ssm_op, mutates, protects_saved_input,
                       written_in_place)
from .manager import PassContext, PassManager

FAMILY = "x_proj_split"

_COPY_METHODS = ("contiguous", "clone")
# Value-preserving steps a split output may take on its way to the op (views, and the casts and
# copies that don't change which elements are read).
_VIEW_METHODS = ("transpose", "permute", "view", "reshape", "unsqueeze", "squeeze", "t", "expand",
                 "select", "narrow", "flatten", "unflatten", "float", "half", "bfloat16", "to", "mT")
_VIEW_FUNCTIONS = (torch.transpose, torch.permute, torch.reshape, torch.unsqueeze, torch.squeeze,
                   torch.t, torch.select, torch.narrow, torch.flatten, operator.getitem)
_SPLITS = (torch.split, torch.functional.split, torch.split_with_sizes)


def _is_split(node: Any) -> bool:
    return is_call(node, *_SPLITS) or is_method(node, "split", "split_with_sizes")


def _is_copy(node: Any) -> bool:
    if is_call(node, torch.clone):
        return True
    if not is_method(node, *_COPY_METHODS):
        return False
    # contiguous(memory_format=channels_last) and friends change strides on purpose; leave them.
    memory_format = node.kwargs.get("memory_format", torch.contiguous_format)
    return memory_format in (torch.contiguous_format, torch.preserve_format)


def _is_step(node: Any) -> bool:
    if _is_copy(node) or is_method(node, *_VIEW_METHODS):
        return True
    # getitem on a split's output tuple ends the walk (handled by the caller); getitem on a
    # tensor is indexing, a view.
    return is_call(node, *_VIEW_FUNCTIONS) and bool(node.args) and not _is_split(node.args[0])


def _schema(op: torch.fx.Node) -> torch.FunctionSchema:
    # Code that calls torch.ops.ssm.x(...) itself leaves the overload packet in the graph; the
    # passes emit the .default overload.
    target = op.target
    return (target.default if isinstance(target, torch._ops.OpOverloadPacket) else target)._schema


def check_copy_removable(path: list[torch.fx.Node], split: torch.fx.Node) -> str | None:
    """Why the copies on ``path`` (op argument first, split output last) must stay, or None.

    Every node from the op argument back to the last copy has exactly one user, so the copy's
    value reaches only the op; nothing aliasing the split's input is written in place.
    """
    last_copy = max(i for i, n in enumerate(path) if _is_copy(n))
    if any(len(n.users) != 1 for n in path[:last_copy + 1]):
        return "a copy (or a view of it) has other users besides the ssm op"
    if any(protects_saved_input(n) for n in path if _is_copy(n)):
        return (f"{split.args[0].name} is a graph input or a returned tensor, which the caller may write "
                "before the backward: the copy keeps what the op saves for it apart")
    aliases = [split.args[0], split, *split.users, *path]
    for node in aliases:
        if isinstance(node, torch.fx.Node) and any(mutates(u) for u in node.users):
            return f"{node.name} is written in place, so the copy protects the op's input"
    # Another view of the same memory (``xdbl[..., r:].mul_(2)``, or of a cast on the path that
    # made new memory: ``Bd = B.double(); Bd.view(-1).mul_(2)``) writes the copied elements
    # without being a user of anything on the path: compare storages, not nodes.
    writer = written_in_place(split.graph, [split.args[0], *path])
    if writer is not None:
        return (f"{writer.name} writes in place to memory the split's input (or a value on the way to "
                "the copy) shares, so the copy protects the op's input")
    return None


def _path_to_split(arg: Any) -> tuple[list[torch.fx.Node], torch.fx.Node] | None:
    """The steps from an op argument back to a split output, and the split, if it comes from one."""
    path, node = [], arg
    while isinstance(node, torch.fx.Node):
        if is_call(node, operator.getitem) and _is_split(node.args[0]):
            return path + [node], node.args[0]
        if not _is_step(node):
            return None
        path.append(node)
        node = node.args[0]
    return None


def xproj_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for op in [n for n in graph.nodes if is_ssm_op(n)]:
        schema_args = _schema(op).arguments
        named = [(a.name, a, op.args[i] if i < len(op.args) else op.kwargs.get(a.name))
                 for i, a in enumerate(schema_args)]
        for name, schema_arg, arg in named:
            found = _path_to_split(arg)
            if found is None:
                continue
            path, split = found
            copies = [n for n in path if _is_copy(n)]
            if not copies:
                continue
            written = schema_arg.alias_info is not None and schema_arg.alias_info.is_write
            # A copy made under another grad mode than the op's (``with torch.no_grad(): x =
            # x.contiguous()``) cuts the gradient the op would otherwise send to x.
            reason = ("the op writes this argument in place, so it must stay a copy" if written
                      else context_refusal(graph, [op, *copies]) or check_copy_removable(path, split))
            if reason is not None:
                ctx.miss(FAMILY, f"{name}: {reason}", copies)
                continue
            ctx.rewrite(FAMILY, "split -> copy -> ssm op", copies, str(op.target),
                        {"arg": name, "removed": [n.target if n.op == "call_method" else "clone" for n in copies]})
            for copy in copies:
                copy.replace_all_uses_with(copy.args[0])
                graph.erase_node(copy)


def register(pm: PassManager) -> None:
    pm.add("xproj", xproj_pass)
