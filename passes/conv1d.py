"""Family ``conv1d``: the causal depthwise convolution -> ``torch.ops.ssm.causal_conv1d``.

What Mamba code writes, and what dynamo turns it into:

- ``F.conv1d(x, w, b, padding=W-1, groups=dim)[..., :L]`` and HF 5.24's ``causal_conv1d_fn``
  fallback (``F.conv1d(x.to(w.dtype), weight=w.unsqueeze(1), bias, padding=W-1,
  groups=dim)[:, :, :L]``) -> ``torch.conv1d(x, w, b, padding=..., groups=...)`` + getitem;
- ``nn.Conv1d(dim, dim, W, groups=dim, padding=W-1)`` (HF 5.17's ``self.conv1d(h)[..., :L]``),
  inlined as ``torch.conv1d(x, weight, bias, (1,), (W-1,), (1,), dim)`` on parameter placeholders;
- optionally followed by silu: ``F.silu``, ``nn.SiLU`` / HF's ``ACT2FN["silu"]`` (both inline to
  ``F.silu``), or ``y * torch.sigmoid(y)``, also after a transpose back to (batch, L, dim)
  (mamba-minimal: ``rearrange(x, 'b d l -> b l d')`` then ``F.silu``);
- ``F.conv1d(F.pad(x, (W-1, 0)), w, b, groups=dim)``: the input padded on the left only, an
  unpadded conv, no slice (the usual hand-written causal conv); the op reads the unpadded x;
- the activation before the slice, ``F.silu(conv(x))[..., :L]``: an elementwise function
  commutes with the slice, so silu folds into the op as above, and another one of
  ``_ELEMENTWISE`` (gelu, relu, tanh, ...) stays and reads the op's output.

A (batch, L, dim) caller transposes around the conv; the op takes any strides, so the transposed
view goes in as is and the user's transpose after it stays.

The slice is what makes a padded conv causal: with padding W-1 on both sides, output position t
sees inputs t-(W-1)..t, so the FIRST L outputs are the causal conv and the last W-1 see the
right-hand zero padding. Anything else (another padding, a slice not starting at 0, a slice of
another length, another user of the unsliced output) is a different function and is refused,
with the reason recorded. An unpadded conv (HF's decode step over ``cat([conv_state, x])``, which
the decode pass rewrites) is not a candidate at all and is skipped without a record, unless its
input comes from ``F.pad``: a left zero-pad of exactly W-1 is the causal conv, any other pad
(right, wider, non-zero, replicate) a near-miss.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .fx_utils import (OP_ROUNDING, bare_name, context_refusal, depthwise_weight, is_call, is_method, is_number,
                       is_zeros, mutates, named_args, propagate_val, storage_of, target_name, val, view_perm,
                       written_args, written_in_place)
from .manager import PassContext, PassManager

FAMILY = "conv1d"
# The op's kernels unroll the taps; wider kernels aren't Mamba's and aren't supported.
MIN_WIDTH, MAX_WIDTH = 2, 8
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_CONV1D_PARAMS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV1D_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def _conv1d_args(node: torch.fx.Node) -> dict[str, Any]:
    """``torch.conv1d``'s arguments by name, defaults filled in.

    Under dynamic shapes the size arguments are SymInt nodes; they are replaced by their SymInt
    values so the checks can compare them with the tensors' sizes.
    """
    args = dict(_CONV1D_DEFAULTS)
    args.update(zip(_CONV1D_PARAMS, node.args))
    args.update(node.kwargs)
    for name in ("stride", "padding", "dilation", "groups"):
        args[name] = torch.fx.node.map_arg(args[name], val)
    return args


def _single(value: Any) -> Any:
    """``3``, ``(3,)`` and ``[3]`` all mean 3 for a 1-D conv; anything else is returned as is."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        return value[0]
    return value


def _same_size(a: Any, b: Any) -> bool:
    # Sizes may be SymInts under dynamic shapes: equal only if provably so.
    return statically_known_true(a == b)


def _is_full_slice(index: Any, size: Any) -> bool:
    """``:``, or ``0:size`` (or a stop past it) with step 1: every element of an axis of ``size``."""
    if not isinstance(index, slice) or index.start not in (None, 0) or index.step not in (None, 1):
        return False
    return index.stop is None or (isinstance(index.stop, int) and statically_known_true(index.stop >= size))


def _time_slice(index: Any, shape: Any) -> slice | None:
    """The slice on the last of 3 axes (of sizes ``shape``) if ``index`` slices nothing else, else None."""
    if not isinstance(index, tuple):
        return None
    if index and index[0] is Ellipsis:
        if len(index) != 2:
            return None
        last = index[1]
    else:
        if len(index) != 3 or not all(_is_full_slice(i, n) for i, n in zip(index[:2], shape[:2])):
            return None
        last = index[2]
    return last if isinstance(last, slice) else None


def _is_narrow(node: Any) -> bool:
    return is_call(node, torch.narrow) or is_method(node, "narrow")


def _kept_steps(sliced: torch.fx.Node, shape: Any) -> slice | str:
    """The steps ``sliced`` keeps of the conv output (``[..., :L]`` or ``narrow(-1, 0, L)``) as a
    slice, or why it is not a slice of the time axis alone."""
    if _is_narrow(sliced):
        a = named_args(sliced, ("input", "dim", "start", "length"))
        if a.get("dim") not in (2, -1) or not isinstance(a.get("start"), int):
            return f"narrow{sliced.args[1:]!r} is not a narrowing of the time axis alone"
        return slice(a["start"], None, None)
    time = _time_slice(sliced.args[1], shape)
    if time is None:
        return f"index {sliced.args[1]!r} is not a slice of the time axis alone"
    return time


def check_causal_conv(conv: torch.fx.Node, x: torch.fx.Node, weight: Any, args: dict[str, Any],
                      sliced: torch.fx.Node | None, left_padded: bool = False,
                      activated: bool = False) -> str | None:
    """Prove ``sliced`` is a causal depthwise conv of ``x`` the op computes; else the reason it isn't.

    Conditions: x (batch, dim, L) in a supported dtype; weight (dim, 1, W) with groups == dim
    (depthwise, as many outputs as inputs); stride 1; dilation 1; padding exactly W-1;
    2 <= W <= 8; the unsliced output used only by one slice [..., :L] taking the first L steps.
    With ``left_padded`` the conv reads ``x`` zero-padded by W-1 on the left only (proved by
    ``left_pad_source``) and has no padding of its own: its whole output is the causal conv, so
    there is no slice to check. With ``activated`` the slice takes the steps of the conv's silu,
    the silu's only use and the conv's only users (``_activated_slice``).
    """
    xv, wv = val(x), val(weight)
    if not isinstance(xv, torch.Tensor) or xv.dim() != 3:
        return "input is not a batched (batch, dim, L) tensor"
    if xv.dtype not in SUPPORTED_DTYPES:
        return f"dtype {xv.dtype} is not supported (fp32/bf16/fp16)"
    if not isinstance(wv, torch.Tensor) or wv.dim() != 3:
        return "weight is not a 3-D (dim, 1, W) tensor"
    dim, length = xv.shape[1], xv.shape[2]
    groups = args["groups"]
    if not (_same_size(groups, dim) and _same_size(wv.shape[0], dim) and _same_size(wv.shape[1], 1)):
        return (f"not depthwise: groups={groups}, channels={dim}, weight shape {tuple(wv.shape)} "
                "(need groups == channels == out_channels and weight (dim, 1, W))")
    width = wv.shape[2]
    if not isinstance(width, int):
        # The op specialises on W (the taps are unrolled); a symbolic W would need a guard that
        # dynamo, which has already finished, could no longer install.
        return f"kernel width {width} is symbolic, not a constant"
    if _single(args["stride"]) != 1:
        return f"stride {args['stride']} is not 1"
    if _single(args["dilation"]) != 1:
        return f"dilation {args['dilation']} is not 1"
    padding = _single(args["padding"])
    if left_padded:
        # is_unpadded() admitted the conv (padding 0 or "valid"); the pad node holds the W-1.
        padding = width - 1
    if isinstance(padding, str) or not _same_size(padding, width - 1):
        return f"padding {args['padding']!r} is not kernel_size - 1 = {width - 1}: not a causal conv"
    if not (MIN_WIDTH <= width <= MAX_WIDTH):
        return f"kernel width {width} unsupported (the op takes {MIN_WIDTH} <= W <= {MAX_WIDTH})"
    bias = args["bias"]
    if bias is not None and not (isinstance(val(bias), torch.Tensor) and val(bias).dim() == 1):
        return "bias is not a (dim,) tensor"
    if left_padded:
        return None
    if sliced is None or (len(conv.users) != 1 and not activated):
        return _unsliced_reason(conv)
    time = _kept_steps(sliced, val(conv).shape)
    if isinstance(time, str):
        return time
    # Named as the user wrote it: narrow(dim, start, length) or [start:stop:step].
    spelled = (f"narrow{tuple(sliced.args[1:])!r}" if _is_narrow(sliced)
               else f"[..., {'' if time.start is None else time.start}:{'' if time.stop is None else time.stop}"
                    f"{'' if time.step is None else f':{time.step}'}]")
    if time.step not in (None, 1):
        return f"the slice {spelled} steps by {time.step}, not 1: not a causal conv"
    if time.start not in (None, 0):
        return f"the slice {spelled} does not start at step 0: not a causal conv"
    out = val(sliced)
    if not (isinstance(out, torch.Tensor) and _same_size(out.shape[-1], length)):
        return f"the slice {spelled} does not keep exactly the first L={length} steps: not a causal conv"
    return None


def is_unpadded(args: dict[str, Any], weight: Any) -> bool:
    """A conv with no padding on a kernel wider than 1 is not a causal-conv candidate at all.

    It is a 'valid' conv over a window the caller assembled itself (HF's decode step convolves
    ``torch.cat([conv_state, x])`` this way, and the decode pass rewrites that), so refusing it
    here is no near-miss worth reporting.
    """
    padding, wv = _single(args["padding"]), val(weight)
    width = wv.shape[-1] if isinstance(wv, torch.Tensor) and wv.dim() == 3 else None
    unpadded = padding == 0 if isinstance(padding, int) else (isinstance(padding, str) and padding == "valid")
    return unpadded and isinstance(width, int) and width > 1


_PAD_TARGETS = (F.pad, torch._C._nn.pad)


def left_pad_source(node: Any, weight: Any) -> torch.fx.Node | None:
    """``x`` when ``node`` is ``F.pad(x, (W-1, 0))`` with zeros on the time axis, or
    ``torch.cat([zeros(batch, dim, W-1), x], -1)``, else None.

    An unpadded conv over that is exactly the causal conv of x: output t sees x[t-(W-1)..t], the
    W-1 positions before x being the op's zero initial window. Right padding, another width, a
    non-zero fill or another mode (reflect, replicate) is a different function; so is a zeros
    block written in place before the cat (a conv state copied into it: an initial window).
    """
    if is_call(node, torch.cat, torch.concat):
        return _cat_zeros_source(node, weight)
    pads = _time_zero_pads(node, weight)
    if pads is None or not (_same_size(pads[0], val(weight).shape[-1] - 1) and _same_size(pads[1], 0)):
        return None
    x = node.args[0] if node.args else node.kwargs.get("input")
    return x if isinstance(x, torch.fx.Node) else None


def _time_zero_pads(node: Any, weight: Any) -> tuple[Any, Any] | None:
    """``(left, right)`` when ``node`` is ``F.pad(x, (left, right))`` with zeros, padding the time
    axis alone (F.pad's further pairs pad the axes before it, and must be zeros), under a 3-D
    conv weight; else None."""
    if not is_call(node, *_PAD_TARGETS):
        return None
    names = ("input", "pad", "mode", "value")
    a = named_args(node, names)
    if set(a) - set(names):
        return None
    pads = torch.fx.node.map_arg(a.get("pad"), val)
    wv = val(weight)
    if not (isinstance(pads, (tuple, list)) and len(pads) in (2, 4, 6) and isinstance(wv, torch.Tensor)
            and wv.dim() == 3 and all(_same_size(p, 0) for p in pads[2:])):
        return None
    # F.pad's value None means 0 for the constant mode.
    if a.get("mode", "constant") != "constant" or a.get("value") not in (None, 0, 0.0):
        return None
    return pads[0], pads[1]


def _padded_on_both_sides(node: torch.fx.Node, weight: Any) -> bool:
    """``node`` is ``F.pad(x, (W-1, k))`` with zeros, k > 0 (for the reason)."""
    pads = _time_zero_pads(node, weight)
    return (pads is not None and _same_size(pads[0], val(weight).shape[-1] - 1)
            and statically_known_true(pads[1] > 0))


def _first_part(cat: torch.fx.Node) -> Any:
    parts = named_args(cat, ("tensors", "dim")).get("tensors")
    return parts[0] if isinstance(parts, (list, tuple)) and parts else None


def _window_parts(cat: torch.fx.Node, weight: Any) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(front, x)`` when ``cat`` is ``torch.cat([front, x], -1)`` of two 3-D tensors of the same
    dtype, batch and channels, ``front`` W-1 steps long; else None. Same dtype: a cat of mixed
    dtypes promotes one side, and the op would read the other unpromoted."""
    a = named_args(cat, ("tensors", "dim"))
    parts, dim = a.get("tensors"), a.get("dim", 0)
    wv = val(weight)
    if set(a) - {"tensors", "dim"} or not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    front, x = parts
    fv, xv = val(front), val(x)
    if not (isinstance(front, torch.fx.Node) and isinstance(x, torch.fx.Node) and isinstance(fv, torch.Tensor)
            and isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor) and xv.dim() == 3 and fv.dim() == 3
            and wv.dim() == 3 and isinstance(dim, int) and dim % 3 == 2):
        return None
    if (fv.dtype != xv.dtype or not _same_size(fv.shape[0], xv.shape[0]) or not _same_size(fv.shape[1], xv.shape[1])
            or not _same_size(fv.shape[2], wv.shape[-1] - 1)):
        return None
    return front, x


def _cat_zeros_source(cat: torch.fx.Node, weight: Any) -> torch.fx.Node | None:
    parts = _window_parts(cat, weight)
    if parts is None or not is_zeros(parts[0]) or written_in_place(cat.graph, [parts[0]]) is not None:
        return None
    return parts[1]


def carried_window(cat: Any, weight: Any) -> tuple[torch.fx.Node, torch.fx.Node] | str | None:
    """``(state, x)`` when ``cat`` is ``torch.cat([state, x], -1)`` with a state of exactly W-1
    steps of x's batch, channels and dtype that nothing writes in place, and x longer than one
    step; the reason when such a state is written in place other than by a decode step's write
    back; else None.

    An unpadded conv over that is the causal conv of x started from the window ``state``: a
    chunked prefill that carries the last W-1 inputs from the previous chunk. A state the graph
    writes back in place (HF's ``conv_state.copy_(window[-S:])``), and any one-step window, is a
    decode step: the decode pass rewrites those into the update op.
    """
    parts = _window_parts(cat, weight) if is_call(cat, torch.cat, torch.concat) else None
    if parts is None or is_zeros(parts[0]) or statically_known_true(val(parts[1]).shape[2] == 1):
        return None
    state, x = parts
    writer = written_in_place(cat.graph, [state])
    if writer is None:
        return state, x
    if is_method(writer, "copy_") and is_call(writer.args[1], operator.getitem) and writer.args[1].args[0] is cat:
        return None  # the window written back: the decode pass's conv update
    # Even a write after the conv would reach the op: it keeps the state for its backward, where
    # the user's conv keeps the cat's copy.
    return (f"{writer.name} writes the carried state {state.name} in place: the op reads the state itself, "
            "where the conv runs and again in its backward, while the user's conv reads the cat's copy "
            "(a state written back as state.copy_(window[..., -(W-1):]), with nothing in between, is a "
            "decode step's conv update)")


def _unsliced_reason(conv: torch.fx.Node) -> str:
    """Why the padded conv output is not read as a causal conv: who reads it."""
    def named(user: torch.fx.Node) -> str:
        if user.op == "output":
            return "the graph's output"
        # A True among the arguments is an ``inplace`` flag, except as an operand (``c * True``,
        # probe BZ).
        flags = () if is_call(user, *_ARITHMETIC) or is_method(user, *_ARITHMETIC_METHODS) else (
            *user.args[1:], *user.kwargs.values())
        written = (target_name(user).endswith("_") or any(a is True for a in flags)
                   or (is_call(user, operator.setitem) and user.args[0] is conv))  # ``c[..., 1] = 5`` (probe CJ)
        return f"{user.name} ({target_name(user)}{', in place' if written else ''})"
    readers = ", ".join(named(u) for u in conv.users) or "nothing"
    writers = [named(u) for u in conv.users if "in place" in named(u)]
    storage = storage_of(conv)
    if not writers and storage is not None:
        # A write through a view of it (``c[:, :, :][..., 1] = 5``, probe CN) is as much a write.
        writers = [f"{n.name} ({target_name(n)}, through a view)" for n in conv.graph.nodes
                   if mutates(n) and any(storage_of(a) == storage for a in written_args(n))][:1]
    if writers:
        # ``conv(x).relu_()[..., :L]``, ``c.tanh_(); c[..., :L]``: causal once sliced; what is
        # refused is the write (probe BR), not the padding.
        return (f"the padded conv output is read by {readers}, and {', '.join(writers)} writes it in place: the "
                "pass folds an activation of the padded output only where it returns a new tensor (F.silu(c), "
                "c.relu()) and the slice [..., :L] is its only reader, so this one is left as written")
    act = _match_silu(conv)
    act = act[0][0] if act is not None else next((u for u in conv.users if _elementwise_of(u, conv)), None)
    if act is not None and len(conv.users) <= 2:
        readers += f", whose result is read by {', '.join(named(u) for u in act.users) or 'nothing'}"
    returned = any(u.op == "output" for u in conv.users)
    return (f"the padded conv output (L + W - 1 steps) is read by {readers}, not only by one slice [..., :L] "
            "(directly, or through out-of-place elementwise functions of it alone, each read once: activations, "
            "and arithmetic with a Python number, not with a tensor, pow or floor division): its last W - 1 steps "
            "see the right-hand padding, so it is not a causal conv"
            + (" in this graph (a slice after a graph break, in the next graph, is not seen here)" if returned
               else ""))


def _match_silu(y: torch.fx.Node) -> tuple[list[torch.fx.Node], str] | None:
    """The silu applied to ``y`` (nodes to replace, last node first; pattern name), if it is y's only use."""
    users = list(y.users)
    if len(users) == 1 and is_call(users[0], F.silu, torch.nn.functional.silu):
        return [users[0]], "silu"
    if len(users) == 2:
        sig = next((u for u in users if is_call(u, torch.sigmoid) or is_method(u, "sigmoid")), None)
        mul = next((u for u in users if is_call(u, operator.mul, torch.mul) or is_method(u, "mul")), None)
        if (sig is not None and mul is not None and len(sig.users) == 1 and mul in sig.users
                and len(mul.args) == 2 and set(mul.args) == {y, sig} and not mul.kwargs):
            return [mul, sig], "x*sigmoid(x)"
    return None


# Functions of one tensor, elementwise: on the padded output before the slice, the same function
# of the causal conv after it. (silu folds into the op; these stay as the user wrote them.)
_ELEMENTWISE = (F.gelu, F.relu, torch.relu, F.relu6, F.elu, F.selu, F.celu, F.leaky_relu, F.hardtanh, F.hardswish,
                F.hardsigmoid, F.mish, F.softplus, F.softsign, F.logsigmoid, torch.tanh, F.tanh, torch.sigmoid,
                F.sigmoid, torch.exp, torch.abs, torch.neg, operator.neg, torch.square, torch.erf)
_ELEMENTWISE_METHODS = ("relu", "tanh", "sigmoid", "exp", "abs", "neg", "square", "erf")


def _elementwise_of(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    """``node`` is one of ``_ELEMENTWISE`` applied to ``source`` alone, out of place: its other
    arguments are numbers or strings, and none is True (an ``inplace`` flag, by keyword or by
    position as in ``F.relu(y, True)``)."""
    if not (is_call(node, *_ELEMENTWISE) or is_method(node, *_ELEMENTWISE_METHODS)) or not node.args:
        return False
    operands = [*node.args[1:], *node.kwargs.values()]
    return node.args[0] is source and not any(isinstance(a, torch.fx.Node) or a is True for a in operands)


_ARITHMETIC = (operator.mul, operator.add, operator.sub, operator.truediv, torch.mul, torch.add, torch.sub, torch.div)
_ARITHMETIC_METHODS = ("mul", "add", "sub", "div")


def _with_a_number(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    """``node`` is ``source`` times, plus, minus or over a Python number (either side), out of
    place: an elementwise function of ``source`` alone (a conv hook's ``out * 0.7 - 0.2``)."""
    if not (is_call(node, *_ARITHMETIC) or is_method(node, *_ARITHMETIC_METHODS)) or len(node.args) != 2:
        return False
    if set(node.kwargs) - {"alpha"} or not all(is_number(v) for v in node.kwargs.values()):
        return False
    a, b = node.args
    other = b if a is source else a if b is source else None
    return other is not None and is_number(other)


def _activated_slice(conv: torch.fx.Node) -> tuple[torch.fx.Node, Any, list[torch.fx.Node] | None] | None:
    """``act(conv(x))[..., :L]``: elementwise functions of the padded output before the slice
    drops its tail, which are those functions of the causal conv. (the slice, ``_match_silu``'s
    match, None) for silu, which the op absorbs; (the slice, None, the chain) for others (one in
    ``_ELEMENTWISE`` or arithmetic with a number first, then any of those or silu, each the only
    reader of the one before: ``conv(x) * 0.7 - 0.2`` from a forward hook, probe BX), which stay
    and read the op's output. The slice must be the last function's only use."""
    act = _match_silu(conv)
    users = list(conv.users)
    if act is not None:
        last, kept = act[0][0], None
    elif len(users) == 1 and (_elementwise_of(users[0], conv) or _with_a_number(users[0], conv)):
        kept = [users[0]]
        while True:
            nxt = list(kept[-1].users)
            if len(nxt) != 1 or not (_elementwise_of(nxt[0], kept[-1]) or _with_a_number(nxt[0], kept[-1])
                                     or _match_silu(kept[-1]) is not None):
                break
            kept.append(nxt[0])
        last = kept[-1]
    else:
        return None
    after = list(last.users)
    if len(after) == 1 and after[0].args[0] is last and (is_call(after[0], operator.getitem) or _is_narrow(after[0])):
        return after[0], act, kept
    return None


def _single_permutation_user(y: torch.fx.Node) -> torch.fx.Node | None:
    """``y``'s only user if it is an axis permutation of ``y`` (``transpose``, ``permute``,
    ``rearrange``'s permute), else None."""
    users = list(y.users)
    if len(users) == 1 and users[0].args and users[0].args[0] is y and view_perm(users[0]) is not None:
        return users[0]
    return None


def conv1d_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for conv in list(graph.nodes):
        if not is_call(conv, torch.conv1d, F.conv1d):
            continue
        args = _conv1d_args(conv)
        x, weight = args["input"], args["weight"]
        users = list(conv.users)
        sliced = users[0] if len(users) == 1 and (is_call(users[0], operator.getitem) or _is_narrow(users[0])) else None
        activated_first = _activated_slice(conv) if sliced is None else None
        if activated_first is not None:
            sliced = activated_first[0]
        pad, initial = None, None
        if is_unpadded(args, weight):
            source = left_pad_source(x, weight)
            carried = carried_window(x, weight) if source is None else None
            if isinstance(carried, str):
                ctx.miss(FAMILY, carried, [conv])
                continue
            if carried is not None:
                initial, source = carried
            if source is None:
                dilation = _single(args["dilation"])
                if is_call(x, *_PAD_TARGETS) and dilation != 1:
                    # F.pad(x, (d·(W-1), 0)) then a dilated conv is a causal dilated conv: the
                    # dilation, not the pad, is what the op does not take.
                    ctx.miss(FAMILY, f"dilation {dilation} is not 1 (a dilated conv over a padded input)", [conv])
                elif is_call(x, *_PAD_TARGETS) and _padded_on_both_sides(x, weight):
                    # Not wrong: the first L outputs of that conv are the causal conv. But the left
                    # pad alone is the form proved, so say that, not "not a causal conv".
                    ctx.miss(FAMILY, f"the input is zero-padded by {tuple(_time_zero_pads(x, weight))} on the "
                             "time axis, W-1 on the left and more on the right: the first L outputs are a causal "
                             "conv, but the pass rewrites only a pad of (W-1, 0) whose whole conv output is read",
                             [conv])
                elif is_call(x, *_PAD_TARGETS):
                    ctx.miss(FAMILY, f"the input is padded by {x.args[1:]!r} {dict(x.kwargs)!r}, not zeros "
                             "(W-1, 0) on the left only: not a causal conv", [conv])
                elif is_call(x, torch.cat, torch.concat) and is_zeros(_first_part(x)):
                    # Zeros in front look like a causal pad; say why this one is not. (A window of
                    # a state and new input, HF's decode step, is no candidate: no record.)
                    ctx.miss(FAMILY, "the input concatenates zeros in front of x, but not exactly W-1 steps "
                             "of x's batch, channels and dtype on the time axis, never written in "
                             "place: not a causal conv with a zero initial window", [conv])
                continue
            # The conv's whole output is the causal conv of the unpadded input: no slice.
            pad, x, sliced = x, source, None
            # The op reads the unpadded x where the conv runs, the user's pad read it earlier: a
            # write to x in between (``xp = F.pad(x); x.relu_()``) must not reach the op.
            writer = written_in_place(graph, [x])
            if writer is not None:
                ctx.miss(FAMILY, f"{writer.name} writes in place to the padded input's memory: the op would "
                         "read it where the conv runs, not where the user's "
                         + ("cat" if initial is not None else "pad") + " did", [conv])
                continue
            # ``xp[..., :W-1] = conv_state`` fills the pad with an initial window; the op reads x
            # from a zero one.
            writer = written_in_place(graph, [pad])
            if writer is not None:
                ctx.miss(FAMILY, f"{writer.name} writes in place to the padded tensor (an initial window "
                         "copied into the pad?): the op would read x after "
                         + ("the state as the cat read it" if initial is not None else "a zero window"), [conv])
                continue
        if pad is not None:
            activated_first = None
        reason = check_causal_conv(conv, x, weight, args, sliced, left_padded=pad is not None,
                                   activated=activated_first is not None)
        if reason is not None and pad is None and left_pad_source(x, weight) is not None:
            # A causal conv of the padded input is still rewritten; anything else checked on it
            # would name the padded length, which the user's x does not have.
            reason = (f"the input is already zero-padded by W-1 on the left and the conv pads it again by "
                      f"{args['padding']!r}: not a causal conv of the unpadded x ({reason})")
        if reason is not None:
            ctx.miss(FAMILY, reason, [conv])
            continue
        out = conv if pad is not None else sliced
        kept = activated_first[2] if activated_first is not None else None
        act, view = (activated_first[1] if activated_first is not None else _match_silu(out)), None
        if act is None and kept is None:
            # mamba-minimal transposes back to (batch, L, dim) before its silu; silu is
            # elementwise, so it commutes with the transpose and still folds into the op.
            view = _single_permutation_user(out)
            act = _match_silu(view) if view is not None else None
            if act is None:
                view = None
        act_nodes, act_pattern = act if act is not None else ([], None)
        last = act_nodes[0] if act_nodes and activated_first is None else out
        # The op runs where the conv did: the pad, the slice and the activation it absorbs must
        # have run under the same grad mode / autocast / functorch state.
        absorbed = [conv, pad, sliced, view, *act_nodes]
        refusal = context_refusal(graph, absorbed, conv)
        if refusal is not None:
            ctx.miss(FAMILY, refusal, [conv])
            continue
        with graph.inserting_before(conv):
            kernel_weight = depthwise_weight(graph, weight)
            op = graph.call_function(torch.ops.ssm.causal_conv1d.default,
                                     (x, kernel_weight, args["bias"], "silu" if act_nodes else None)
                                     + ((initial,) if initial is not None else ()))
            propagate_val(op)
            result = op
            out_dtype = val(conv if kept is not None else last).dtype
            if val(op).dtype != out_dtype:
                # Under autocast eager's conv runs (and returns) in the autocast dtype while the op
                # returns x's dtype; the user's code downstream must see the dtype it saw in eager.
                result = graph.call_method("to", (op, out_dtype))
                propagate_val(result)
                # Autocast's rounding of the conv output, now the op's own: a scan that reads the
                # op's output keeps the precision the op computed (see ``dropped_rounding``).
                result.meta[OP_ROUNDING] = True
        if "stack_trace" in conv.meta:
            op.meta["stack_trace"] = conv.meta["stack_trace"]
        if view is not None:
            # The user's view now permutes the op's (already activated) output.
            view.replace_input_with(out, result)
            last.replace_all_uses_with(view)
        elif kept is not None:
            # The user's functions now read the causal conv, and the last stands for its slice.
            kept[0].replace_input_with(conv, result)
            for node in kept:
                propagate_val(node)
            sliced.replace_all_uses_with(kept[-1])
        else:
            last.replace_all_uses_with(result)
        if activated_first is not None:
            replaced = [conv, *reversed(act_nodes), sliced]
        else:
            replaced = [conv, *([sliced] if pad is None else []), *reversed(act_nodes)]
        if kept is not None:
            pattern = f"conv1d+{'+'.join(bare_name(n) for n in kept)}[..., :L]"
        elif activated_first is not None:
            pattern = f"conv1d+{act_pattern}[..., :L]"
            act_pattern = None
        elif pad is None:
            pattern = "conv1d[..., :L]"
        elif initial is not None:
            pattern = "cat(state(W-1), x)+conv1d"
        else:
            pattern = "cat(zeros(W-1), x)+conv1d" if is_call(pad, torch.cat, torch.concat) else "pad(W-1, 0)+conv1d"
        if view is not None:
            pattern += "+permute"
        ctx.rewrite(FAMILY, pattern + (f"+{act_pattern}" if act_pattern else ""), replaced,
                    "ssm.causal_conv1d", {"W": int(val(weight).shape[2]),
                                          "activation": "silu" if act_nodes else None,
                                          "bias": args["bias"] is not None,
                                          **({"initial_state": True} if initial is not None else {})})
        for node in replaced[::-1]:
            graph.erase_node(node)
        if pad is not None and not pad.users:
            graph.erase_node(pad)
        if isinstance(weight, torch.fx.Node) and not weight.users and weight.op != "placeholder":
            graph.erase_node(weight)


def register(pm: PassManager) -> None:
    pm.add(FAMILY, conv1d_pass)
