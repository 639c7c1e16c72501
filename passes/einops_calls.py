"""Before the rewrites: an einops call reads as the torch calls einops makes for it.

einops up to 0.8.1 registers ``rearrange``, ``repeat``, ``reduce``, ``einsum``, ``pack`` and
``unpack`` with dynamo (``allow_in_graph``) at its first call on a tensor, so dynamo's graph holds
each such call as one opaque node, and AOTAutograd traces into it only after our passes (einops
0.8.2 leaves torch >= 2.8 to trace them, and the graph holds their torch calls already). Much
Mamba code is written with einops: mamba-minimal's discretisation is
``einsum(delta, A, 'b l d_in, d_in n -> b l d_in n')``, mamba_ssm's reference path rearranges
and repeats B and C. Behind an opaque node the matchers cannot see exp(Δ·A) or Δ·B·u, and such a model would keep its (batch, dim, L, N) tensors and its unrolled loop.

So each einops call is replaced by the torch calls einops itself makes for it. They are recorded
by running the call on the node's fake inputs under a ``TorchFunctionMode``: einops turns a
pattern into a fixed recipe for the input's shape (a reshape, a permute, a reduction, an
unsqueeze and expand, a reshape; or one ``torch.einsum`` with the axis names renamed to letters).
AOTAutograd would trace the same calls out of the opaque node, so the graph computes the same
function with the same views and the same guards; nothing here names an einops function, and
whatever einops version is installed decides what is recorded.

A call is left as it is when its recording
- returns anything but one tensor (``pack``, ``unpack``),
- reads a tensor the recording cannot name (one einops made without a torch call),
- takes a tensor property by attribute (``x.mT``), which a method node cannot express,
- or passes a symbolic size that is not a sum, product or floor division of the symbolic sizes
  dynamo passes into the graph; those are computed there as dynamo computes sizes
  (``operator.mul`` of the size placeholders).
Only calls whose function lives in the ``einops`` package are expanded: other opaque functions
(a user's ``allow_in_graph``) may do anything, and recording their torch calls would not show it.
"""
from __future__ import annotations

import contextlib
import logging
import operator
from typing import Any

import sympy

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._sympy.functions import FloorDiv

from .fx_utils import ContextRegions, _fake_mode, _target_module_and_name, fake_dispatch, set_val, val


_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


_QUIET = _Quiet()


class _Refused(Exception):
    """Why a recorded call cannot be written as graph nodes."""


class _Recorder(TorchFunctionMode):
    """Records every torch-level call made inside it, with its arguments and result.

    A mode's handler runs with the mode switched off, so the calls torch makes inside a recorded
    call (``einsum``'s own reshapes) are not recorded: only what einops asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


def _is_einops_call(node: torch.fx.Node) -> bool:
    module = getattr(node.target, "__module__", None) or ""
    return node.op == "call_function" and (module == "einops" or module.startswith("einops."))


def _tensor_method(func: Any) -> str | None:
    """The method name under which dynamo's graph would call ``func``, if it is a Tensor method."""
    name = getattr(func, "__name__", None)
    if name is None or name.startswith("__"):
        return None
    if getattr(torch.Tensor, name, None) is func or getattr(torch._C.TensorBase, name, None) is func:
        return name
    return None


def _symbols(graph: torch.fx.Graph) -> dict[sympy.Symbol, torch.fx.Node]:
    """The placeholders through which dynamo passes each symbolic size into the graph."""
    found = {}
    for node in graph.find_nodes(op="placeholder"):
        value = val(node)
        if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            found.setdefault(value.node.expr, node)
    return found


def _check_expression(expr: sympy.Expr, symbols: dict[sympy.Symbol, torch.fx.Node]) -> None:
    if expr.is_Integer:
        return
    if isinstance(expr, sympy.Symbol):
        if expr not in symbols:
            raise _Refused(f"its size {expr} is no input of the graph")
        return
    if isinstance(expr, (sympy.Add, sympy.Mul, FloorDiv)):
        for arg in expr.args:
            _check_expression(arg, symbols)
        return
    raise _Refused(f"its size {expr} is not a sum, product or floor division of the graph's sizes")


def _size_node(graph: torch.fx.Graph, expr: sympy.Expr, symbols: dict[sympy.Symbol, torch.fx.Node]) -> Any:
    """Nodes computing the symbolic size ``expr`` from the graph's size inputs, as dynamo writes
    size arithmetic (``operator.mul`` of the placeholders); ``_check_expression`` passed it."""
    if expr.is_Integer:
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        return symbols[expr]
    op = (operator.add if isinstance(expr, sympy.Add) else operator.mul if isinstance(expr, sympy.Mul)
          else operator.floordiv)
    terms = [_size_node(graph, arg, symbols) for arg in expr.args]
    result = terms[0]
    for term in terms[1:]:
        node = graph.call_function(op, (result, term))
        set_val(node, op(val(result), val(term)))
        result = node
    return result


def _context(node: torch.fx.Node, regions: ContextRegions) -> list[Any]:
    """Context managers for the grad mode and autocast state ``node`` runs under in the graph
    (an autocast region the traced code opened): the recording must see the dtypes and
    ``requires_grad`` the call has there, and autocast decides whether some calls run at all
    (a bf16 operand against an fp32 one)."""
    (_, grad_enabled), amp = regions.key[node]
    managers = [torch.set_grad_enabled(grad_enabled)]
    for enter in amp:
        args = [*enter.args, *enter.kwargs.values()]
        if _target_module_and_name(enter)[1] != "_enter_autocast" or any(isinstance(a, torch.fx.Node) for a in args):
            raise _Refused(f"it runs under an autocast state set by {enter.name}, which the recording cannot repeat")
        managers.append(torch.amp.autocast(*enter.args, **enter.kwargs))
    return managers


def _record(node: torch.fx.Node, regions: ContextRegions) -> tuple[list, Any, dict[int, torch.fx.Node]]:
    """Run the einops call on its inputs' fake values, in its grad mode and autocast state;
    returns the recorded calls, the result and the graph node of each input tensor by the fake
    value's id."""
    inputs: dict[int, torch.fx.Node] = {}

    def fake(arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            value = val(arg)
            if isinstance(value, torch.Tensor):
                inputs[id(value)] = arg
            return value
        return arg

    args = torch.fx.node.map_arg(node.args, fake)
    kwargs = torch.fx.node.map_arg(node.kwargs, fake)
    mode = _fake_mode(pytree.tree_leaves((args, kwargs)))
    if mode is None:
        raise _Refused("its inputs have no fake values")
    recorder = _Recorder()
    with contextlib.ExitStack() as stack:
        # A call that fails on fake inputs stays, with its reason in explain: FakeTensorMode's
        # own ERROR-level traceback for it would only look like a crash.
        _FAKE_LOG.addFilter(_QUIET)
        stack.callback(_FAKE_LOG.removeFilter, _QUIET)
        stack.enter_context(fake_dispatch(mode))
        for manager in _context(node, regions):
            stack.enter_context(manager)
        # Last: entering autocast under a TorchFunctionMode would be recorded as a call.
        stack.enter_context(recorder)
        out = node.target(*args, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise _Refused(f"it returns a {type(out).__name__}, not one tensor")
    return recorder.calls, out, inputs


def _plan(calls: list, out: Any, inputs: dict[int, torch.fx.Node],
          symbols: dict[sympy.Symbol, torch.fx.Node]) -> list[tuple[str | None, Any, tuple, dict, Any]]:
    """The recorded calls that make tensors, as (method name or None, function, args, kwargs,
    result), with every tensor argument checked to be an input or an earlier result, and every
    symbolic size to be one ``_size_node`` can compute."""
    known = set(inputs)
    plan = []
    for func, args, kwargs, result in calls:
        if not isinstance(result, torch.Tensor):
            if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(result)):
                raise _Refused(f"{getattr(func, '__name__', func)} returns several tensors")
            continue  # a shape or dtype read: its value is a constant in later arguments
        method = _tensor_method(func)
        if method is None and getattr(func, "__name__", "") == "__get__":
            raise _Refused("it reads a tensor property by attribute")
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and id(leaf) not in known:
                raise _Refused(f"{getattr(func, '__name__', func)} reads a tensor no torch call made")
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, (torch.SymFloat, torch.SymBool)):
                raise _Refused(f"{getattr(func, '__name__', func)} takes a symbolic {type(leaf).__name__}")
            if isinstance(leaf, torch.SymInt):
                _check_expression(leaf.node.expr, symbols)
        plan.append((method, func, args, kwargs, result))
        known.add(id(result))
    if id(out) not in known:
        raise _Refused("its result is no tensor a torch call made")
    return plan


def _emit(graph: torch.fx.Graph, node: torch.fx.Node, plan: list, out: Any, inputs: dict[int, torch.fx.Node],
          symbols: dict[sympy.Symbol, torch.fx.Node]) -> torch.fx.Node:
    env = dict(inputs)

    def as_node(arg: Any) -> Any:
        if isinstance(arg, torch.SymInt):
            return _size_node(graph, arg.node.expr, symbols)
        return env[id(arg)] if isinstance(arg, torch.Tensor) else arg

    with graph.inserting_before(node):
        for method, func, args, kwargs, result in plan:
            args, kwargs = pytree.tree_map(as_node, (args, kwargs))
            new = graph.call_method(method, args, kwargs) if method else graph.call_function(func, args, kwargs)
            new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "example_value")})
            set_val(new, result)
            env[id(result)] = new
    return env[id(out)]


def expand_einops_calls(gm: torch.fx.GraphModule) -> tuple[list[str], list[tuple[torch.fx.Node, str]]]:
    """Replace each einops call in ``gm`` by the torch calls it makes. Returns what changed, and
    each call left as it is with why (the pass manager reports them: a call the matchers cannot
    see into may be why a rewrite further on is missed)."""
    changes, kept = [], []
    symbols = _symbols(gm.graph)
    regions = ContextRegions(gm.graph)
    for node in [n for n in gm.graph.nodes if _is_einops_call(n)]:
        name = f"{node.target.__module__}.{node.target.__name__}"
        try:
            calls, out, inputs = _record(node, regions)
            plan = _plan(calls, out, inputs, symbols)
        except _Refused as why:
            kept.append((node, f"{name} at {node.name} stays one call, which the passes cannot see into: {why}"))
            continue
        except Exception as exc:  # noqa: BLE001  (what einops raised on these fake inputs: the call stays)
            kept.append((node, f"{name} at {node.name} stays one call, which the passes cannot see into: "
                               f"recording it on fake inputs raised {type(exc).__name__}: {exc}"))
            continue
        result = _emit(gm.graph, node, plan, out, inputs, symbols)
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        done = ", ".join(m or getattr(f, "__name__", str(f)) for m, f, *_ in plan) or "its input"
        changes.append(f"{name} at {node.name} read as {done}")
    if changes:
        gm.graph.lint()
        gm.recompile()
    return changes, kept
