"""After the rewrites: keep the strides the user's code relies on.

An ssm op returns its activations in the layout ``kernels/layout.py`` gives them, which need
not be the layout the replaced subgraph had in eager: a loop that stacks its per-step outputs
along dim 1 of a (batch, dim, L) input makes a (batch, L, dim)-contiguous result, the op a
(batch, dim, L)-contiguous one. The values are the same, the strides are not, and two things
in user code see strides:

* ``.view`` fails on a layout it cannot view (``y.view(b * l, d)`` after the rewrite above);
* the graph's outputs reach the caller, which may ``.view`` them or check their layout.

``settle_layouts`` re-runs the rewritten graph on fake tensors and mends both: a ``.view``
that no longer applies becomes ``.reshape`` (the same values; a copy where no view exists) when
nothing in the graph writes in place to the memory of the view or of its base and the view is
not returned, since only such a write or a caller holding both tensors could tell the copy from
a view; and an output whose strides
changed is given eager's strides back (permute, ``contiguous``, permute back: one copy, only
there). A ``.view`` that cannot be mended so raises, and the backend then compiles the graph
without ssm rewrites (``compiler._run_passes``) rather than fail or change what it computes.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.utils._pytree as pytree

from .fx_utils import inverse, set_val, val, written_in_place

log = logging.getLogger("ssm_compile")

# Tensor.view(shape) and Tensor.view_as(other), and their reshaping twins. ``view(dtype)``
# reinterprets bytes instead and does not care about strides, so it is never rewritten.
_RESHAPE_OF = {"view": "reshape", "view_as": "reshape_as"}


class LayoutError(RuntimeError):
    """A ``.view`` the rewrites made impossible and that cannot become ``.reshape``."""


def output_strides(gm: torch.fx.GraphModule) -> list[tuple[int, ...] | None]:
    """The strides of the graph's tensor outputs as dynamo traced them (None where unknown)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return [_concrete_strides(val(a)) if isinstance(a, torch.fx.Node) else None
            for a in pytree.tree_leaves(out.args)]


def _concrete_strides(value: Any) -> tuple[int, ...] | None:
    # Symbolic strides (dynamic shapes) are not compared: restoring them would need the
    # symbols as graph values, and a layout decided per shape is what inductor guards anyway.
    if not isinstance(value, torch.Tensor):
        return None
    strides = value.stride()
    return tuple(strides) if all(type(s) is int for s in strides) else None


def _fresh_input(value: Any) -> Any:
    # A new fake tensor with the placeholder's metadata, so that running the graph (in-place
    # metadata changes such as ``t_()`` included) cannot touch dynamo's example values.
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device,
                               requires_grad=value.requires_grad)


class _Propagate(torch.fx.Interpreter):
    """Runs the graph on fake tensors, mending ``.view`` calls that the new layouts broke."""

    def __init__(self, gm: torch.fx.GraphModule, returned: set[torch.fx.Node]):
        super().__init__(gm, garbage_collect_values=True)
        self.returned = returned
        self.mended: list[str] = []

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            return super().run_node(n)
        except Exception as e:  # noqa: BLE001  (fake kernels raise several types for a bad view)
            if not (n.op == "call_method" and n.target in _RESHAPE_OF and _is_stride_error(n, e)):
                raise
            writer = written_in_place(self.module.graph, [n, n.args[0]])
            if writer is not None or n in self.returned:
                why = (f"{writer.name} writes in place to its memory" if writer is not None
                       else "the view is returned")
                raise LayoutError(
                    f"{n.name} = {n.format_node()} cannot view the rewritten op's output layout, and "
                    f"{why}, so a copy could be told from a view") from e
            self.mended.append(f"{n.name}: .{n.target} -> .{_RESHAPE_OF[n.target]}")
            n.target = _RESHAPE_OF[n.target]
            return super().run_node(n)


def _is_stride_error(n: torch.fx.Node, e: Exception) -> bool:
    # view(dtype) is not a shape view; the message is the one torch's view meta raises.
    if n.target == "view" and any(isinstance(a, torch.dtype) for a in n.args[1:]):
        return False
    return "view" in str(e) and "stride" in str(e)


def settle_layouts(gm: torch.fx.GraphModule, traced_strides: list[tuple[int, ...] | None]) -> list[str]:
    """Mend ``gm`` (rewritten) so that its views apply and its outputs keep ``traced_strides``.

    Returns a line per change, for the log. Raises ``LayoutError`` where a view cannot be mended.
    A graph that cannot be run on fake tensors here (no fake inputs, or an op without a fake
    kernel) is left as it is: AOTAutograd runs it the same way next and reports the failure.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [val(n) for n in placeholders]
    mode = next((v.fake_mode for v in values if isinstance(v, torch._subclasses.FakeTensor)), None)
    if mode is None or any(v is None for v in values):
        return []
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned = {a for a in pytree.tree_leaves(out_node.args) if isinstance(a, torch.fx.Node)}
    interp = _Propagate(gm, returned)
    with mode, torch.set_grad_enabled(torch.is_grad_enabled()):
        inputs = [_fresh_input(v) for v in values]
        try:
            outputs = interp.run(*inputs)
        except LayoutError:
            raise
        except Exception:  # noqa: BLE001  (see the docstring: not ours to report)
            log.debug("ssm layout check: the rewritten graph did not run on fake tensors", exc_info=True)
            outputs = None
        changes = list(interp.mended)
        if outputs is not None:
            changes += _restore_outputs(gm, out_node, pytree.tree_leaves(outputs), traced_strides)
    if changes:
        gm.recompile()
    return changes


def _restore_outputs(gm, out_node, outputs, traced_strides) -> list[str]:
    changes = []
    leaves, spec = pytree.tree_flatten(out_node.args)
    for i, (arg, value, want) in enumerate(zip(leaves, outputs, traced_strides)):
        if not isinstance(arg, torch.fx.Node) or want is None or not isinstance(value, torch.Tensor):
            continue
        have = _concrete_strides(value)
        if have is None or _same_layout(value.shape, have, want):
            continue
        perm = _dense_order(value.shape, want)
        if perm is None:
            # Eager returned a non-dense tensor (a slice of something bigger): no copy has its
            # strides, and none of our ops is the last step of one. Left, and said.
            log.info("ssm layout check: output %d has strides %s, eager %s (not dense; left)", i, have, want)
            continue
        with gm.graph.inserting_before(out_node):
            moved = gm.graph.call_method("permute", (arg, *perm))
            dense = gm.graph.call_method("contiguous", (moved,))
            back = gm.graph.call_method("permute", (dense, *inverse(perm)))
        # Runs under the caller's fake mode: the new nodes get fake values like every other.
        set_val(moved, value.permute(perm))
        set_val(dense, val(moved).contiguous())
        set_val(back, val(dense).permute(inverse(perm)))
        leaves[i] = back
        changes.append(f"output {i} ({arg.name}): strides {have} -> eager's {want}")
    if changes:
        out_node.args = pytree.tree_unflatten(leaves, spec)
    return changes


def _same_layout(shape, a, b) -> bool:
    # A size-1 dim's stride is never used to address anything.
    return all(x == y for n, x, y in zip(shape, a, b) if n != 1)


def _dense_order(shape, strides) -> list[int] | None:
    """The dim order (outermost first) in which ``strides`` are those of a dense tensor."""
    order = sorted(range(len(shape)), key=lambda d: (-strides[d], d))
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and strides[d] != expected:
            return None
        expected *= shape[d]
    return order
