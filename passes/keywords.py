"""Before the rewrites: operands passed by keyword are passed by position.

``torch.add(input=a, other=b)`` and ``torch.add(a, b)`` bind the same parameters, so they are the
same call. Dynamo records each as written, and the matchers read operands by position: a scan
spelled ``torch.add(input=torch.mul(input=dA, other=h), other=dBu)``, or a readout spelled
``torch.sum(input=h * C, dim=-1)``, was a miss (run 52's note). Rather than teach every matcher
both spellings, this pass moves each keyword that names a positional parameter into its place,
for the calls the matchers read, before any of them runs.

Only a keyword whose parameter directly follows the ones already given moves (``torch.sum(x,
keepdim=True)`` keeps ``keepdim`` by name, as ``dim`` is missing), so the call binds exactly as
before. Keyword-only parameters (``alpha``, ``out``, ``dtype``, ``rounding_mode``, ``value``) stay
keywords: the matchers that accept a call check those by name, and refuse the ones they do not
know.
"""
from __future__ import annotations

import collections

import torch
import torch.fx
import torch.nn.functional as F

from .fx_utils import target_name

_BINARY = ("input", "other")
_UNARY = ("input",)

# A call's positional-or-keyword parameters, in order, as torch's Python signatures name them.
_FUNCTIONS: dict[object, tuple[str, ...]] = {
    **{f: _BINARY for f in (torch.add, torch.sub, torch.subtract, torch.mul, torch.multiply, torch.div,
                            torch.divide, torch.true_divide, torch.matmul, torch.maximum, torch.minimum)},
    **{f: _UNARY for f in (torch.exp, torch.exp2, torch.expm1, torch.log, torch.log1p, torch.neg,
                           torch.negative, torch.sigmoid, torch.tanh, torch.abs, torch.clone, torch.sqrt,
                           torch.rsqrt, torch.square)},
    torch.bmm: ("input", "mat2"),
    torch.addcmul: ("input", "tensor1", "tensor2"),
    torch.sum: ("input", "dim", "keepdim"),
    torch.mean: ("input", "dim", "keepdim"),
    torch.cumsum: ("input", "dim"),
    torch.cumprod: ("input", "dim"),
    torch.unsqueeze: ("input", "dim"),
    torch.squeeze: ("input", "dim"),
    torch.select: ("input", "dim", "index"),
    torch.narrow: ("input", "dim", "start", "length"),
    torch.transpose: ("input", "dim0", "dim1"),
    torch.movedim: ("input", "source", "destination"),
    torch.permute: ("input", "dims"),
    torch.flip: ("input", "dims"),
    torch.reshape: ("input", "shape"),
    torch.where: ("condition", "input", "other"),
    torch.stack: ("tensors", "dim"),
    torch.cat: ("tensors", "dim"),
    torch.split: ("tensor", "split_size_or_sections", "dim"),
    torch.chunk: ("input", "chunks", "dim"),
    torch.repeat_interleave: ("input", "repeats", "dim"),
    torch.unbind: ("input", "dim"),
    torch.roll: ("input", "shifts", "dims"),
    torch.tensor_split: ("input", "indices_or_sections", "dim"),
    torch.flatten: ("input", "start_dim", "end_dim"),
    torch.unflatten: ("input", "dim", "sizes"),
    torch.index_select: ("input", "dim", "index"),
    torch.gather: ("input", "dim", "index"),
    torch.broadcast_to: ("input", "size"),
    torch.tile: ("input", "dims"),
    torch.pow: ("input", "exponent"),
    torch.clamp: ("input", "min", "max"),
    torch.lerp: ("input", "end", "weight"),
    torch.mm: ("input", "mat2"),
    torch.mv: ("input", "vec"),
    torch.outer: ("input", "vec2"),
    torch.linalg.vecdot: ("x", "y"),
    F.softplus: ("input", "beta", "threshold"),
    F.silu: ("input", "inplace"),
    F.linear: ("input", "weight", "bias"),
    F.conv1d: ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    F.pad: ("input", "pad", "mode", "value"),
}

# The same for methods, after ``self``.
_METHODS: dict[str, tuple[str, ...]] = {
    **{m: ("other",) for m in ("add", "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide",
                               "matmul", "maximum", "minimum")},
    "bmm": ("mat2",),
    "addcmul": ("tensor1", "tensor2"),
    "sum": ("dim", "keepdim"),
    "mean": ("dim", "keepdim"),
    "cumsum": ("dim",),
    "cumprod": ("dim",),
    "unsqueeze": ("dim",),
    "squeeze": ("dim",),
    "select": ("dim", "index"),
    "narrow": ("dim", "start", "length"),
    "transpose": ("dim0", "dim1"),
    "movedim": ("source", "destination"),
    "flip": ("dims",),
    "split": ("split_size", "dim"),
    "chunk": ("chunks", "dim"),
    "repeat_interleave": ("repeats", "dim"),
    "unbind": ("dim",),
    "roll": ("shifts", "dims"),
    "tensor_split": ("indices_or_sections", "dim"),
    "flatten": ("start_dim", "end_dim"),
    "unflatten": ("dim", "sizes"),
    "index_select": ("dim", "index"),
    "gather": ("dim", "index"),
    "pow": ("exponent",),
    "clamp": ("min", "max"),
    "lerp": ("end", "weight"),
    "type_as": ("other",),
}


def _parameters(node: torch.fx.Node) -> tuple[tuple[str, ...], int] | None:
    """The positional parameters of ``node``'s call and how many of ``node.args`` precede them."""
    if node.op == "call_method":
        params = _METHODS.get(node.target)
        return None if params is None else (params, 1)
    if node.op == "call_function":
        try:
            params = _FUNCTIONS.get(node.target)
        except TypeError:  # an unhashable callable: none of the calls above
            return None
        return None if params is None else (params, 0)
    return None


def positional_operands(gm: torch.fx.GraphModule) -> list[str]:
    """Move keyword operands into their positions (module docstring); one line per call kind."""
    moved: collections.Counter[str] = collections.Counter()
    for node in gm.graph.nodes:
        if not node.kwargs:
            continue
        found = _parameters(node)
        if found is None:
            continue
        params, skip = found
        args, kwargs = list(node.args), dict(node.kwargs)
        at = len(args) - skip
        while 0 <= at < len(params) and params[at] in kwargs:
            args.append(kwargs.pop(params[at]))
            at += 1
        if len(args) > len(node.args):
            node.args, node.kwargs = tuple(args), kwargs
            moved[target_name(node)] += 1
    return [f"{count} call(s) of {name} take their keyword operands by position" for name, count in moved.items()]
