"""Merge conv1d -> scan and dt_proj -> scan into ``ssm::fused_mamba_scan`` (family ``fuse``).

Runs after the conv/scan/delta/tail/xproj passes, on the graph they left::

    u     = ssm.causal_conv1d(x, w, b, 'silu')            # also read by x_proj
    delta = W_dt @ dt_low.transpose(1, 2)                  # HF; or F.linear(dt_low, W_dt).mT
    y, _  = ssm.selective_scan(u, delta, A, B, C, D, z, bias, True, None, False)

and, where ``ssm_compile.heuristic.decide`` says a fused level pays (or the ``fuse`` option
forces one), replaces the scan by ``ssm.fused_mamba_scan(x, dt_low_view, ..., conv_weight=w,
conv_bias=b, conv_activation='silu', dt_weight=W_dt)``. The conv stays when something else
(x_proj) still reads its output; the dt matmul and the old scan go with dead-code elimination.

Soundness (``check_fusable``): the conv feeds u directly with no initial state; the matmul's
operands are (dim, R) and (batch, R, L) with no cast between them and delta; a scan with an
initial state or a used last state (a prefill that fills a cache) can only take the "dt" level,
whose kernel is the level-0 scan's and carries both; nothing requires grad when grad mode is on (the
fused op is forward-only; the split ops have the backward kernels). Each failure is a miss
with its reason; a legal site the heuristic keeps split is a miss whose reason carries the
decision's numbers, so ``explain`` shows every decision.
"""
from __future__ import annotations

import operator
from typing import Any, NamedTuple, Optional

import torch
import torch.fx

from .delta import LINEAR_TARGETS, MATMUL_TARGETS
from .fx_utils import (context_refusal, grad_enabled_at, is_call, is_method, propagate_val, scan_args,
                       same_sizes, scan_nodes, shape_of, val, written_in_place)
from .manager import PassContext, PassManager

FAMILY = "fuse"
CONV_QUALNAME = "ssm::causal_conv1d"


class DtProj(NamedTuple):
    weight: torch.fx.Node  # (dim, R)
    low: torch.fx.Node  # (batch, R, L), possibly a view we must insert (see ``low_transpose``)
    low_transpose: bool  # True: ``low`` is (batch, L, R) and needs ``.transpose(1, 2)``
    nodes: list[torch.fx.Node]


class FuseSite(NamedTuple):
    scan: torch.fx.Node
    args: dict[str, Any]
    conv: Optional[torch.fx.Node]
    conv_args: tuple  # (x, weight, bias, activation) when ``conv``
    dt: Optional[DtProj]
    stateful: bool  # initial_state given or last state returned: the conv levels are out


def _is_conv(node: Any) -> bool:
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    target = node.target
    name = target.name() if isinstance(target, torch._ops.OpOverload) else getattr(
        target, "_qualified_op_name", None)
    return name == CONV_QUALNAME


def _conv_args(conv: torch.fx.Node) -> Optional[tuple]:
    names = ("x", "weight", "bias", "activation", "initial_state")
    args = dict(zip(names, (None,) * 5))
    args.update(zip(names, conv.args))
    args.update(conv.kwargs)
    if args["initial_state"] is not None:
        return None
    return args["x"], args["weight"], args["bias"], args["activation"]


def _swaps_last_two(node: Any) -> bool:
    """``node`` is ``t.transpose(1, 2)`` (either order, negative axes too) or ``t.permute(0, 2, 1)``
    of a 3-D tensor."""
    if shape_of(node) is None or len(shape_of(node)) != 3:
        return False
    if is_method(node, "transpose") and len(node.args) == 3:
        return sorted(int(d) % 3 for d in node.args[1:]) == [1, 2]
    if is_method(node, "permute"):
        dims = node.args[1] if len(node.args) == 2 else node.args[1:]
        return [int(d) % 3 for d in dims] == [0, 2, 1]
    return False


def match_dt_proj(delta: Any) -> Optional[DtProj]:
    """``delta`` = W_dt @ dt_low_T (HF) or F.linear(dt_low, W_dt).transpose(1, 2), no bias (the
    delta pass has already moved a dt_proj bias into the scan's delta_bias)."""
    if is_call(delta, *MATMUL_TARGETS) and len(delta.args) == 2 and not delta.kwargs:
        weight, low = delta.args
        if shape_of(weight) is not None and len(shape_of(weight)) == 2:
            return DtProj(weight, low, False, [delta])
        return None
    if _swaps_last_two(delta):
        lin = delta.args[0]
        if is_call(lin, *LINEAR_TARGETS) and len(lin.args) >= 2:
            bias = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
            if bias is None:
                return DtProj(lin.args[1], lin.args[0], True, [delta, lin])
    return None


def check_fusable(scan: torch.fx.Node) -> FuseSite | str | None:
    """The site's pieces if some fused level is sound here, else the reason it is not (None
    when neither a conv nor a dt projection feeds the scan: nothing to fuse, no near-miss)."""
    args = scan_args(scan)
    stateful = args["initial_state"] is not None or bool(args["return_last_state"])
    if any(not is_call(u, operator.getitem) for u in scan.users):
        return "the scan's outputs are used other than through getitem"
    u, delta = args["u"], args["delta"]
    tensors = [args[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    if any(isinstance(t, torch.fx.Node) and not isinstance(val(t), torch.Tensor) for t in tensors):
        return "an input has no fake value"
    uv, dv = val(u), val(delta)
    if not all(isinstance(s, int) for s in uv.shape):
        return "symbolic shapes: the fusion decision needs concrete sizes"

    conv = conv_args = None
    if _is_conv(u):
        conv_args = _conv_args(u)
        xv = val(conv_args[0]) if conv_args is not None else None
        if conv_args is None:
            pass
        elif not isinstance(xv, torch.Tensor) or not same_sizes(xv.shape, uv.shape) or xv.dtype != uv.dtype:
            conv_args = None
        else:
            conv = u

    dt = match_dt_proj(delta)
    if dt is not None:
        wv, lv = val(dt.weight), val(dt.low)
        batch, dim, L = dv.shape
        low_shape = (batch, L, wv.shape[-1]) if dt.low_transpose else (batch, wv.shape[-1], L)
        if (not isinstance(wv, torch.Tensor) or not isinstance(lv, torch.Tensor)
                or tuple(wv.shape) != (dim, wv.shape[1]) or tuple(lv.shape) != low_shape
                or wv.dtype != dv.dtype or lv.dtype != dv.dtype):
            dt = None
    if conv is None and dt is None:
        return None  # nothing to fuse: not a near-miss, just another scan
    if stateful and dt is None:
        return ("the scan carries an initial or last state (prefill with a cache) and only the conv "
                "could fuse: the conv levels' kernel carries no state; kept split")

    # A fused level recomputes the conv and the dt projection inside one op at the scan.
    refusal = context_refusal(scan.graph, [scan, conv, *(dt.nodes if dt is not None else ())])
    if refusal is not None:
        return refusal
    # ... from the conv's input and weights and from dt_low and W_dt, read there: a write to any
    # of them after the user's conv or product read it, or to their results (u, Δ) before the
    # scan, is one the fused op would not see.
    recomputed = ([conv, *conv_args[:3]] if conv is not None else []) + (
        [dt.weight, dt.low, *dt.nodes] if dt is not None else [])
    writer = written_in_place(scan.graph, [n for n in recomputed if isinstance(n, torch.fx.Node)])
    if writer is not None:
        return (f"{writer.name} writes in place to the conv's or the dt projection's inputs or results, "
                "which a fused level recomputes at the scan: kept split")
    # The grad mode where the scan runs, not the one the graph is compiled under: a forward that
    # opens ``torch.enable_grad()`` itself, called under ``torch.no_grad()``, records grads.
    if grad_enabled_at(scan):
        inputs = tensors + ([conv_args[1], conv_args[2]] if conv is not None else [])
        inputs += [args["initial_state"]]
        inputs += [dt.weight, dt.low] if dt is not None else []
        if any(isinstance(t, torch.fx.Node) and val(t).requires_grad for t in inputs):
            return ("an input requires grad: kept split (ssm.fused_mamba_scan is forward-only; "
                    "the split ops have the backward kernels)")
    return FuseSite(scan, args, conv, conv_args or (), dt, stateful)


def _problem(site: FuseSite):
    from ssm_compile.heuristic import Problem
    from ssm_compile.kernels.layout import dim_innermost

    uv, dv, Bv, Cv = (val(site.args[k]) for k in ("u", "delta", "B", "C"))
    batch, dim, L = uv.shape
    # A (dim, N) B or C is read per channel: the kernels see G = dim (kernels/selective_scan/invariant.py).
    groups = dim if 2 in (Bv.dim(), Cv.dim()) else Bv.shape[1] if Bv.dim() == 4 else 1
    legal = ["split"]
    conv_levels = site.conv is not None and not site.stateful
    if conv_levels:
        legal.append("level1")
    if site.dt is not None:
        legal.append("dt")
        if conv_levels:
            legal.append("level2")
    others = [n for n in site.conv.users if n is not site.scan] if site.conv is not None else []
    return Problem(
        batch=batch, dim=dim, L=L, N=val(site.args["A"]).shape[1], groups=groups,
        width=val(site.conv_args[1]).shape[1] if site.conv is not None else 0,
        dt_rank=val(site.dt.weight).shape[1] if site.dt is not None else 0,
        act_dtype=uv.dtype, delta_dtype=dv.dtype, conv_has_other_users=bool(others),
        legal=tuple(legal), device=uv.device.type, channel_innermost=dim_innermost(uv),
    ), uv.device


def _emit(gm: torch.fx.GraphModule, site: FuseSite, level: str) -> torch.fx.Node:
    from ssm_compile.heuristic import FUSES_CONV, FUSES_DT

    graph, a = gm.graph, site.args
    x, conv_w, conv_b, act = (a["u"], None, None, None)
    if FUSES_CONV[level]:
        x, conv_w, conv_b, act = site.conv_args
    delta, dt_w = a["delta"], None
    with graph.inserting_before(site.scan):
        if FUSES_DT[level]:
            dt_w, delta = site.dt.weight, site.dt.low
            if site.dt.low_transpose:
                delta = graph.call_method("transpose", (delta, 1, 2))
                propagate_val(delta)
        fused_args = (x, delta, a["A"], a["B"], a["C"], a["D"], a["z"], a["delta_bias"],
                      a["delta_softplus"], conv_w, conv_b, act, dt_w)
        if site.stateful:
            fused_args += (a["initial_state"], a["return_last_state"])
        fused = graph.call_function(torch.ops.ssm.fused_mamba_scan.default, fused_args)
        propagate_val(fused)
        # The fused op's outputs are the scan's, (y, last_state): each getitem moves over.
        for old in list(site.scan.users):
            new = graph.call_function(operator.getitem, (fused, old.args[1]))
            propagate_val(new)
            old.replace_all_uses_with(new)
            graph.erase_node(old)
    # The old scan is dead now. Erase it here: the manager's dead-code elimination keeps calls
    # through an op packet (a user's direct call), whose purity it cannot read from a schema.
    graph.erase_node(site.scan)
    return fused


def fuse_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    from ssm_compile.heuristic import FUSES_CONV, FUSES_DT, decide
    from ssm_compile.kernels.fused.op import register as register_fused

    override = ctx.options.get("fuse", "auto")
    if override == "split":
        return
    for scan in scan_nodes(gm.graph):
        site = check_fusable(scan)
        if site is None:
            continue
        if isinstance(site, str):
            ctx.miss(FAMILY, site, [scan])
            continue
        problem, device = _problem(site)
        decision = decide(problem, override, device=device)
        if decision.level == "split":
            # The register and occupancy figures describe a CUDA launch; elsewhere they mean nothing.
            numbers = (f" ({decision.est_regs} est. registers, actual {decision.actual_regs}, occupancy "
                       f"{decision.occupancy:.3f})" if problem.device == "cuda" else "")
            ctx.miss(FAMILY, f"kept split{numbers}: {decision.reason}", [scan])
            continue
        register_fused()
        fused = _emit(gm, site, decision.level)
        replaced = [scan]
        if FUSES_CONV[decision.level]:
            replaced.append(site.conv)
        if FUSES_DT[decision.level]:
            replaced.extend(site.dt.nodes)
        ctx.rewrite(FAMILY, decision.level, replaced, fused.name, decision=decision.as_dict())


def register(pm: PassManager) -> None:
    pm.add(FAMILY, fuse_pass)
