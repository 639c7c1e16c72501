"""Write a half-precision linear's widened output straight from the matmul (family ``logits``).

Causal-LM heads end in ``lm_head(h).float()`` (HF's MambaForCausalLM, and most others): a bf16
matmul writes (tokens, vocab) bf16 logits, then a separate kernel reads them back and writes fp32.
At a 130m model's shape (16384 tokens x 50280 vocab) that cast moves 5 GB and, measured on the
H200 (``benchmarks/probe_logits.py``), the pair takes 3.05 ms under inductor where one matmul
that writes fp32 from its fp32 accumulator (``torch.mm(..., out_dtype=torch.float32)``, cuBLAS)
takes 2.26 ms: 0.8 ms of a ~16 ms forward.

What changes numerically: eager rounds each fp32-accumulated logit to bf16 and widens it; the
rewrite keeps the accumulator's fp32 value. Both are the same function up to that rounding, and
the rewrite's result is the closer one to the exact product (the probe: max error 1.2e-6 against
2.5e-3 of the largest logit). This is the same latitude inductor takes by default
(``emulate_precision_casts=False``: fused intermediates stay in fp32), and the one the ``ssm``
ops take everywhere (fp32 inside, one rounding at the end). ``disable=("logits",)`` keeps
eager's rounding.

Matched: ``linear(x, W)`` with no bias, x and W both bf16 or both fp16, whose only user is a
cast to float32, on CUDA (``aten.mm.dtype`` has no CPU kernel). Left alone, with the reason
recorded for ``explain``: a bias (inductor has no fp32-output addmm, and adding it afterwards
would cost the pass over the logits this saves), a graph that needs gradients of the matmul
(``aten.mm.dtype`` has no derivative), a linear that autocast runs in another dtype than its
inputs', and anything that writes in place to the linear's output or its cast.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from .delta import LINEAR_TARGETS
from .fx_utils import cast_dtype, context_refusal, dtype_of, is_call, propagate_val, set_val, val, written_in_place
from .manager import PassContext, PassManager

FAMILY = "logits"
_HALF = (torch.bfloat16, torch.float16)


def _reason_to_keep(linear: torch.fx.Node, cast: torch.fx.Node, graph: torch.fx.Graph) -> str | None:
    """Why this CUDA linear + cast is kept as it is, or None to rewrite it."""
    x, w = linear.args[0], linear.args[1]
    out = val(linear)
    bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    if bias is not None:
        return "the linear has a bias: there is no fp32-output matmul with a bias epilogue to fold it into"
    if out.requires_grad:
        return ("the matmul needs gradients and aten.mm.dtype (the fp32-output matmul) has no "
                "derivative; kept as a half-precision matmul and a cast")
    if written_in_place(graph, [linear, cast]) is not None:
        return "the linear's output or its float32 cast is written in place"
    if not dtype_of(x) == dtype_of(w) == out.dtype:
        # Autocast: the linear ran in another dtype than its inputs have, and the matmul that
        # would replace it is not on autocast's lists.
        return (f"the linear computes in {out.dtype} from {dtype_of(x)} input and {dtype_of(w)} weight "
                "(autocast); kept as it is")
    return None


def logits_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for cast in list(graph.nodes):
        if cast_dtype(cast) != torch.float32:
            continue
        linear = cast.args[0]
        if not is_call(linear, *LINEAR_TARGETS) or len(linear.args) < 2 or len(linear.users) != 1:
            continue
        # Not near-misses, nothing to report: no fp32-output matmul off CUDA, or not half precision.
        product = val(linear)
        # A 1-D weight (a scalar head, linear(h, w) of shape (..., )) is a matrix-vector product: no mm.
        if (product.device.type != "cuda" or product.dtype not in _HALF or val(linear.args[0]).dim() < 2
                or val(linear.args[1]).dim() != 2):
            continue
        reason = _reason_to_keep(linear, cast, graph) or context_refusal(graph, [linear, cast], linear)
        if reason:
            ctx.miss(FAMILY, reason, [linear, cast])
            continue
        x, w = linear.args[0], linear.args[1]
        # At the linear, not at the cast: an in-place write to x or W between the two must not
        # be seen by the matmul.
        with graph.inserting_before(linear):
            # The leading dims as graph values, not constants: they may be symbolic.
            size = graph.call_method("size", (x,))
            lead = graph.call_function(operator.getitem, (size, slice(None, -1)))
            x2 = graph.call_method("flatten", (x, 0, -2))
            wt = graph.call_method("t", (w,))
            mm = graph.call_function(torch.mm, (x2, wt), {"out_dtype": torch.float32})
            out = graph.call_method("unflatten", (mm, 0, lead))
            set_val(size, val(x).size())
            set_val(lead, val(x).size()[:-1])
            for node in (x2, wt, mm, out):
                propagate_val(node)
        cast.replace_all_uses_with(out)
        graph.erase_node(cast)
        graph.erase_node(linear)
        ctx.rewrite(FAMILY, "linear(x, W).float() -> mm(x, W.T, out_dtype=float32)", [linear, cast],
                    "torch.mm(out_dtype=torch.float32)",
                    {"shape": tuple(val(out).shape), "from": str(dtype_of(x))})


def register(pm: PassManager) -> None:
    pm.add(FAMILY, logits_pass)
