"""Families ``state_update`` and ``conv_update``: the single-token decode step -> the decode ops.

During ``generate()`` HF Mamba (transformers 5.17 and 5.24 alike) runs, per layer and token, the
torch fallbacks of ``causal_conv1d_update`` and ``mamba_selective_state_update``. The cache
tensors (``cache.layers[i].conv_states[0]`` / ``recurrent_states[0]``: what 5.24's
``get_conv_state`` / ``get_recurrent_state`` return and 5.17 reads directly) reach the decode
graph as placeholders (``L_kwargs_cache_layers_0_conv_states_0_``) that the graph mutates with
``copy_``; the cache object itself only shows up in dynamo's guards (``has_previous_state``),
so the decode graph is compiled once and reused for every token. Dynamo captures, per layer:

conv_update::

    hs = torch.cat([conv_state, x], dim=-1).to(w.dtype)          # (batch, dim, S + T)
    conv_state.copy_(hs[:, :, -S:])                               # roll the window
    y = torch.conv1d(hs, w.unsqueeze(1), bias, padding=0, groups=dim)[:, :, -T:]
    y = F.silu(y).to(x.dtype)                                     # activation, cast optional

state_update::

    dt = softplus(dt + dt_bias.to(dt.dtype))                      # bias, softplus optional
    dA = torch.exp(dt.float()[..., None] * A.float())
    dBx = dt.float()[..., None] * B.float()[:, None, :] * x.float()[..., None]
    h = state.float() * dA + dBx
    state.copy_(h.to(state.dtype))
    y = torch.matmul(h.to(C.dtype), C.unsqueeze(-1)).squeeze(-1)  # or (h * C[:, None, :]).sum(-1)
    y = ((y + x * D) * F.silu(z)).to(x.dtype)                     # skip, gate, cast optional

Each rewrite emits one op at the place of the pattern's last node, so the op's single read and
write of the state lands later than the original ones. That is sound only if nothing else
touches the state: the check functions demand that the state's only users are the pattern's
read and its ``copy_``. Casts are looked through: the ops accumulate in fp32, which is at least
as precise as any cast chain they replace (each rewrite records the casts it dropped).

The prefill step is not handled here: its ``mamba_selective_scan(..., return_last_state=True)``
is the scan passes' pattern (they emit ``ssm.selective_scan(..., return_last_state=True)``), and
``update_recurrent_state(final_state)`` / ``update_conv_state`` stay plain ``copy_``s into the
cache, whose tensors the prefill graph creates itself (``torch.zeros``) unless the caller
allocated them beforehand (needed for CUDA graphs, see ``examples/generate.py``).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .fx_utils import depthwise_weight, is_call, is_method, propagate_val, val
from .manager import PassContext, PassManager

STATE_FAMILY = "state_update"
CONV_FAMILY = "conv_update"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_N = 256
MIN_W, MAX_W = 2, 8

_CAST_METHODS = ("float", "to", "half", "bfloat16", "type")
_MUL = (operator.mul, torch.mul)
_ADD = (operator.add, torch.add)
_SOFTPLUS = (F.softplus, torch.nn.functional.softplus, torch._C._nn.softplus)
_SILU = (F.silu, torch.nn.functional.silu)


class Miss(Exception):
    """A near-miss: the anchor looked like a decode step but a proof step failed."""


# ---------------------------------------------------------------------------------------------
# Small structural helpers
# ---------------------------------------------------------------------------------------------

def _tensor(node: Any) -> torch.Tensor | None:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def _same(a: Any, b: Any) -> bool:
    # Sizes may be SymInts under dynamic shapes: equal only if provably so.
    return statically_known_true(a == b)


def _same_shape(a: Any, shape: tuple) -> bool:
    t = _tensor(a)
    return t is not None and t.dim() == len(shape) and all(_same(x, y) for x, y in zip(t.shape, shape))


def _is_cast(node: Any) -> bool:
    """A float-to-float dtype conversion that keeps shape and device (``.float()``, ``.to(dtype)``)."""
    if not is_method(node, *_CAST_METHODS) or not node.args:
        return False
    src, out = _tensor(node.args[0]), _tensor(node)
    return (src is not None and out is not None and src.device == out.device
            and tuple(src.shape) == tuple(out.shape)
            and src.dtype.is_floating_point and out.dtype.is_floating_point)


def _is_cast_of(node: Any, src: Any) -> bool:
    """``node`` casts ``src`` (not merely uses it, as ``.to(other)`` uses ``other`` for its dtype)."""
    return _is_cast(node) and node.args[0] is src


def _peel(node: Any) -> tuple[Any, list[torch.fx.Node]]:
    """Follow casts back to their source: (source, the casts passed, outermost first)."""
    casts = []
    while _is_cast(node):
        casts.append(node)
        node = node.args[0]
    return node, casts


def _operands(node: Any, targets: tuple, method: str) -> tuple[Any, Any] | None:
    """The two operands of a binary ``targets``/``.method`` node without extra args, else None."""
    if is_call(node, *targets) or is_method(node, method):
        if len(node.args) == 2 and not node.kwargs:
            return node.args[0], node.args[1]
    return None


def _mul_leaves(node: Any, limit: int = 4) -> list[Any] | None:
    """Flatten a product tree ``a * b * c`` (any association, casts looked through) into factors."""
    ops = _operands(node, _MUL, "mul")
    if ops is None:
        return [node]
    leaves = []
    for operand in ops:
        inner, _ = _peel(operand)
        sub = _mul_leaves(inner, limit) if _operands(inner, _MUL, "mul") is not None else [operand]
        if sub is None:
            return None
        leaves += sub
    return leaves if len(leaves) <= limit else None


def _unsqueezed(node: Any, axis: int) -> Any | None:
    """The tensor that ``node`` unsqueezes at ``axis`` (``t[..., None]``, ``t[:, None]``, ``t.unsqueeze(axis)``).

    ``axis`` is -1 (append) or 1 (after batch). Casts around are looked through.
    """
    node, _ = _peel(node)
    out = _tensor(node)
    if out is None or not isinstance(node, torch.fx.Node):
        return None
    src = None
    if is_method(node, "unsqueeze") or is_call(node, torch.unsqueeze):
        src = node.args[0]
    elif is_call(node, operator.getitem) and any(i is None for i in _as_tuple(node.args[1])):
        src = node.args[0]
    s = _tensor(src)
    if s is None or out.dim() != s.dim() + 1:
        return None
    expected = list(s.shape)
    expected.insert(axis if axis >= 0 else len(expected), 1)
    if not all(_same(a, b) for a, b in zip(out.shape, expected)):
        return None
    # Shapes agree; also make sure it is a pure view (no stride, no reversal) by the index form.
    if is_call(node, operator.getitem) and not all(i is None or i is Ellipsis or i == slice(None)
                                                    for i in _as_tuple(node.args[1])):
        return None
    if (is_method(node, "unsqueeze") or is_call(node, torch.unsqueeze)) and node.args[1] not in (
            axis, axis + s.dim() + 1 if axis < 0 else axis - s.dim() - 1):
        return None
    return _peel(src)[0]


def _as_tuple(index: Any) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def _squeezed_last(node: Any) -> Any | None:
    if (is_method(node, "squeeze") or is_call(node, torch.squeeze)) and node.args[1:] in ((-1,), (2,)):
        return node.args[0]
    if is_call(node, operator.getitem) and _as_tuple(node.args[1]) in ((Ellipsis, 0), (slice(None), slice(None), 0)):
        return node.args[0]
    return None


def _single_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _follow_casts(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """Walk forward through single-user casts: (last node, the casts walked)."""
    casts = []
    while True:
        nxt = _single_user(node)
        if nxt is None or not _is_cast_of(nxt, node):
            return node, casts
        casts.append(nxt)
        node = nxt


def _narrowing(casts: list[torch.fx.Node]) -> list[str]:
    """Casts that round (to a dtype narrower than their input): the op computes these in fp32."""
    out = []
    for c in casts:
        src, dst = _tensor(c.args[0]).dtype, _tensor(c).dtype
        if torch.finfo(dst).bits < torch.finfo(src).bits or (dst != src and torch.finfo(dst).bits == 16):
            out.append(f"{c.name}:{src}->{dst}".replace("torch.", ""))
    return out


def _widen_for(graph: torch.fx.Graph, x: torch.fx.Node, out_dtype: torch.dtype) -> torch.fx.Node:
    """``x`` cast up to ``out_dtype`` when that is wider, so the op's output (x's dtype) loses nothing."""
    xd = _tensor(x).dtype
    if xd == out_dtype or torch.finfo(out_dtype).bits <= torch.finfo(xd).bits:
        return x
    wide = graph.call_method("to", (x, out_dtype))
    propagate_val(wide)
    return wide


def _cast_to(graph: torch.fx.Graph, node: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    if _tensor(node).dtype == dtype:
        return node
    out = graph.call_method("to", (node, dtype))
    propagate_val(out)
    return out


def _copy_into(node: torch.fx.Node) -> torch.fx.Node | None:
    """The ``target.copy_(node)`` that ``node`` (through casts) feeds, if any."""
    for user in node.users:
        if _is_cast_of(user, node):
            found = _copy_into(user)
            if found is not None:
                return found
        elif is_method(user, "copy_") and len(user.args) == 2 and user.args[1] is node:
            return user
    return None


# ---------------------------------------------------------------------------------------------
# state_update
# ---------------------------------------------------------------------------------------------

def match_state_update(copy: torch.fx.Node) -> dict[str, Any] | None:
    """Structure of a state update ending in ``copy``; None if ``copy`` is not such an anchor.

    Raises ``Miss`` when the anchor (``state.copy_(state' * dA + dBx)``) is there but a piece is not.
    """
    state = copy.args[0]
    h, _ = _peel(copy.args[1])
    terms = _operands(h, _ADD, "add")
    st = _tensor(state)
    if terms is None or st is None or st.dim() != 3:
        return None
    # h = read(state) * dA + dBx, in either order of the sum and of the product.
    decay = dbx = None
    for a, b in (terms, terms[::-1]):
        product = _peel(a)[0]
        factors = _operands(product, _MUL, "mul")
        if factors is None:
            continue
        for s_read, dA in (factors, factors[::-1]):
            src, casts = _peel(s_read)
            if src is state:
                # The node that reads the state: its innermost cast, or the product itself.
                decay, dbx, state_read, read_casts = dA, b, casts[-1] if casts else product, casts
                break
        if decay is not None:
            break
    if decay is None:
        # Not a recurrence on this state (e.g. the prefill writing a scan's last state into the
        # cache): not this pattern at all, so no near-miss either.
        return None

    exp_node, _ = _peel(decay)
    if not is_call(exp_node, torch.exp) and not is_method(exp_node, "exp"):
        raise Miss("the state decay is not exp(dt * A)")
    da_factors = _operands(_peel(exp_node.args[0])[0], _MUL, "mul")
    if da_factors is None:
        raise Miss("the exponent of the decay is not a product dt * A")
    dt = A = None
    for p, q in (da_factors, da_factors[::-1]):
        dt_src = _unsqueezed(p, -1)
        if dt_src is not None and _tensor(_peel(q)[0]) is not None and _tensor(_peel(q)[0]).dim() == 2:
            dt, A = dt_src, _peel(q)[0]
            break
    if dt is None:
        raise Miss("the exponent is not dt[..., None] * A with A of shape (dim, N)")

    leaves = _mul_leaves(_peel(dbx)[0])
    if leaves is None or len(leaves) != 3:
        raise Miss("the input term is not a product of exactly dt, B and x")
    dt_leaf = [leaf for leaf in leaves if _unsqueezed(leaf, -1) is dt]
    if len(dt_leaf) != 1:
        raise Miss("the input term does not scale by the same dt as the decay")
    rest = [leaf for leaf in leaves if leaf is not dt_leaf[0]]
    x = B = None
    for p, q in (rest, rest[::-1]):
        xs, bs = _unsqueezed(p, -1), _unsqueezed(q, 1)
        if xs is not None and bs is not None:
            x, B = xs, bs
            break
    if x is None:
        raise Miss("the input term is not dt[..., None] * B[:, None, :] * x[..., None]")

    # dt may be softplus(dt_raw + dt_bias).
    dt_softplus, dt_bias = False, None
    dt_raw, dt_casts = _peel(dt)
    if is_call(dt_raw, *_SOFTPLUS):
        beta = dt_raw.kwargs.get("beta", dt_raw.args[1] if len(dt_raw.args) > 1 else 1)
        threshold = dt_raw.kwargs.get("threshold", dt_raw.args[2] if len(dt_raw.args) > 2 else 20)
        if beta != 1 or threshold != 20:
            raise Miss(f"softplus(beta={beta}, threshold={threshold}) is not the op's softplus(beta=1, threshold=20)")
        dt_softplus = True
        dt_raw, casts = _peel(dt_raw.args[0])
        dt_casts += casts
    pair = _operands(dt_raw, _ADD, "add")
    if pair is not None:
        for p, q in (pair, pair[::-1]):
            pv, qv = _tensor(_peel(p)[0]), _tensor(_peel(q)[0])
            if pv is not None and qv is not None and pv.dim() == 2 and qv.dim() == 1:
                dt_raw, dt_bias = _peel(p)[0], _peel(q)[0]
                dt_casts += _peel(p)[1] + _peel(q)[1]
                break

    # The readout: every use of h other than the state write is the one readout.
    readout_users = [u for u in h.users if not _copy_into_chain(u, copy, h)]
    if len(readout_users) != 1:
        raise Miss(f"the new state has {len(readout_users)} readout uses (expected exactly one C-readout)")
    y, C, readout_casts = _match_readout(readout_users[0], h)
    y, tail = _match_tail(y, x)
    return dict(copy=copy, state=state, state_read=state_read, read_casts=read_casts, h=h, x=x, dt=dt_raw,
                A=A, B=B, C=C, D=tail["D"], z=tail["z"], dt_bias=dt_bias, dt_softplus=dt_softplus, last=y,
                casts=dt_casts + readout_casts)


def _copy_into_chain(user: torch.fx.Node, copy: torch.fx.Node, src: torch.fx.Node) -> bool:
    """Whether ``user`` (a use of ``src``) only leads, through casts, into the state's ``copy``."""
    if user is copy:
        return True
    if _is_cast_of(user, src):
        return len(user.users) == 1 and _copy_into_chain(next(iter(user.users)), copy, user)
    return False


def _match_readout(first: torch.fx.Node, h: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, list]:
    """``y = C . h`` per channel, starting from the use ``first`` of h: (readout node, C, casts on h)."""
    casts: list[torch.fx.Node] = []
    node, user = h, first
    if _is_cast_of(first, h):
        node, more = _follow_casts(first)
        casts = [first, *more]
        user = _single_user(node)
    if user is None:
        raise Miss("the new state's readout cast has several users")
    pair = _operands(user, (torch.matmul, operator.matmul), "matmul")
    if pair is not None and pair[0] is node:
        C = _unsqueezed(pair[1], -1)
        sq = _single_user(user)
        if C is None or sq is None or _squeezed_last(sq) is not user:
            raise Miss("the readout is not matmul(h, C.unsqueeze(-1)).squeeze(-1)")
        return sq, C, casts
    pair = _operands(user, _MUL, "mul")
    if pair is not None and node in pair:
        C = _unsqueezed(pair[1] if pair[0] is node else pair[0], 1)
        red = _single_user(user)
        if (C is None or red is None or not (is_method(red, "sum") or is_call(red, torch.sum))
                or red.args[1:] not in ((-1,), (2,)) or red.kwargs.get("keepdim", False)):
            raise Miss("the readout is not (h * C[:, None, :]).sum(-1)")
        return red, C, casts
    raise Miss(f"the new state is read by {user.op} {user.target!r}, not a C-readout")


def _match_tail(y: torch.fx.Node, x: torch.fx.Node) -> tuple[torch.fx.Node, dict[str, Any]]:
    """Optional ``+ x * D``, ``* silu(z)`` and casts after the readout: (last node, pieces)."""
    D = z = None
    node = y
    while True:
        nxt = _single_user(node)
        if nxt is None:
            break
        if _is_cast_of(nxt, node):
            node = nxt
            continue
        add = _operands(nxt, _ADD, "add")
        if add is not None and D is None and z is None and node in add:
            other = add[1] if add[0] is node else add[0]
            skip = _operands(other, _MUL, "mul")
            if skip is not None:
                for p, q in (skip, skip[::-1]):
                    qv = _tensor(_peel(q)[0])
                    if _peel(p)[0] is x and qv is not None and qv.dim() == 1:
                        D = _peel(q)[0]
                        break
            if D is not None:
                node = nxt
                continue
            break
        mul = _operands(nxt, _MUL, "mul")
        if mul is not None and z is None and node in mul:
            other = mul[1] if mul[0] is node else mul[0]
            if is_call(other, *_SILU) and len(other.args) == 1 and not other.kwargs:
                z = _peel(other.args[0])[0]
                node = nxt
                continue
        break
    return node, dict(D=D, z=z)


def check_state_update(m: dict[str, Any]) -> str | None:
    """Shapes and dtypes the op takes, and that the state is touched by nothing else; else why not."""
    st, x = _tensor(m["state"]), _tensor(m["x"])
    batch, dim, N = st.shape
    if st.dtype != torch.float32:
        return f"the state is {st.dtype}; the op keeps its state in fp32"
    if not statically_known_true(N <= MAX_N):
        return f"N={N} state channels exceed the op's {MAX_N}"
    expect = {"x": (batch, dim), "dt": (batch, dim), "A": (dim, N), "B": (batch, N), "C": (batch, N),
              "D": (dim,), "z": (batch, dim), "dt_bias": (dim,)}
    for name, shape in expect.items():
        node = m[name]
        if node is None:
            continue
        if not _same_shape(node, shape):
            got = tuple(_tensor(node).shape) if _tensor(node) is not None else None
            return f"{name} has shape {got}, expected {shape}"
        if _tensor(node).dtype not in SUPPORTED_DTYPES:
            return f"{name} has dtype {_tensor(node).dtype}, not one of fp32/bf16/fp16"
        if _tensor(node).device != st.device:
            return f"{name} is on {_tensor(node).device}, the state on {st.device}"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"x has dtype {x.dtype}"
    others = [u for u in m["state"].users if u is not m["copy"] and u is not m["state_read"]]
    # A cast to the state's own dtype returns the state itself, so a cast with other users is an
    # alias of the state that would see the update at a different point.
    others += [u for c in m["read_casts"] for u in c.users if len(c.users) > 1]
    if others:
        return (f"the state is also used by {[u.name for u in others]}: moving its update into one op "
                "could change what they see")
    return None


def state_update_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for copy in list(graph.nodes):
        if not (is_method(copy, "copy_") and len(copy.args) == 2 and not copy.kwargs):
            continue
        try:
            m = match_state_update(copy)
        except Miss as miss:
            ctx.miss(STATE_FAMILY, str(miss), [copy])
            continue
        if m is None:
            continue
        reason = check_state_update(m)
        if reason is None and copy.users:
            reason = "the value of state.copy_(...) is used"
        if reason is not None:
            ctx.miss(STATE_FAMILY, reason, [copy])
            continue
        last = m["last"]
        out_dtype = _tensor(last).dtype
        with graph.inserting_before(last):
            x = _widen_for(graph, m["x"], out_dtype)
            op = graph.call_function(torch.ops.ssm.selective_state_update.default,
                                     (m["state"], x, m["dt"], m["A"], m["B"], m["C"], m["D"], m["z"],
                                      m["dt_bias"], m["dt_softplus"]))
            propagate_val(op)
            result = _cast_to(graph, op, out_dtype)
        if "stack_trace" in copy.meta:
            op.meta["stack_trace"] = copy.meta["stack_trace"]
        last.replace_all_uses_with(result)
        ctx.rewrite(STATE_FAMILY, "state*exp(dt*A)+dt*B*x; copy_; C-readout"
                    + ("+D*x" if m["D"] is not None else "") + ("*silu(z)" if m["z"] is not None else ""),
                    [copy, m["h"], last], "ssm.selective_state_update",
                    {"N": int(_tensor(m["state"]).shape[2]), "dt_softplus": m["dt_softplus"],
                     "dt_bias": m["dt_bias"] is not None, "D": m["D"] is not None, "z": m["z"] is not None,
                     "rounding_casts_dropped": _narrowing(m["casts"])})
        graph.erase_node(copy)


# ---------------------------------------------------------------------------------------------
# conv_update
# ---------------------------------------------------------------------------------------------

def _last_axis_slice(index: Any) -> slice | None:
    index = _as_tuple(index)
    if len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice):
        return index[1]
    if len(index) == 3 and index[0] == slice(None) and index[1] == slice(None) and isinstance(index[2], slice):
        return index[2]
    return None


def _is_suffix(index: Any, total: Any, keep: Any) -> bool:
    """``index`` takes exactly the last ``keep`` of ``total`` positions on the last axis."""
    s = _last_axis_slice(index)
    if s is None or s.stop is not None or s.step not in (None, 1) or s.start is None:
        return False
    return _same(s.start, -keep) or _same(s.start, total - keep)


_CONV1D_PARAMS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _single(value: Any) -> Any:
    return value[0] if isinstance(value, (tuple, list)) and len(value) == 1 else value


def match_conv_update(cat: torch.fx.Node) -> dict[str, Any] | None:
    """Structure of a rolling conv update starting at ``torch.cat([conv_state, x], -1)``.

    None if ``cat`` is not such an anchor (its first input is not ``copy_``-ed back into);
    raises ``Miss`` if the anchor is there but a piece is not.
    """
    if len(cat.args) < 1 or not isinstance(cat.args[0], (list, tuple)) or len(cat.args[0]) != 2:
        return None
    conv_state, x = cat.args[0]
    dim_arg = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
    sv, xv = _tensor(conv_state), _tensor(x)
    if sv is None or xv is None or sv.dim() != 3 or xv.dim() != 3 or dim_arg not in (-1, 2):
        return None
    hs, cat_casts = _follow_casts(cat)
    users = list(hs.users)
    roll = [u for u in users if is_call(u, operator.getitem)]
    copies = [c for r in roll for c in [_copy_into(r)] if c is not None and c.args[0] is conv_state]
    if not copies:
        return None
    S, T = sv.shape[2], xv.shape[2]
    convs = [u for u in users if is_call(u, torch.conv1d, F.conv1d)]
    if len(users) != 2 or len(roll) != 1 or len(convs) != 1 or len(copies) != 1:
        raise Miss("the concatenated window is used by something other than one roll and one conv1d")
    state_slice, copy, conv = roll[0], copies[0], convs[0]
    if not _is_suffix(state_slice.args[1], S + T, S):
        raise Miss(f"the state is rolled with {state_slice.args[1]!r}, not the last S={S} positions")
    args = dict(zip(_CONV1D_PARAMS, conv.args))
    args.update(conv.kwargs)
    if args.get("input") is not hs:
        raise Miss("the window is not the conv1d's input")
    w3 = _tensor(args.get("weight"))
    groups, dim = args.get("groups", 1), xv.shape[1]
    if (w3 is None or w3.dim() != 3 or not _same(w3.shape[0], dim) or not _same(w3.shape[1], 1)
            or not _same(groups, dim)):
        raise Miss(f"conv1d is not depthwise (weight {None if w3 is None else tuple(w3.shape)}, groups={groups})")
    for name, ok in (("stride", 1), ("padding", 0), ("dilation", 1)):
        if _single(args.get(name, ok)) != ok:
            raise Miss(f"conv1d {name}={args[name]!r}, expected {ok} for a rolling-window conv")
    W = w3.shape[2]
    out_slice = _single_user(conv)
    if (out_slice is None or not is_call(out_slice, operator.getitem)
            or not _is_suffix(out_slice.args[1], S + T - W + 1, T)):
        raise Miss(f"the conv output is not sliced to its last T={T} steps")
    node, activation = out_slice, None
    node, _ = _follow_casts(node)
    nxt = _single_user(node)
    if nxt is not None and is_call(nxt, *_SILU) and len(nxt.args) == 1 and not nxt.kwargs:
        node, activation = nxt, "silu"
    node, _ = _follow_casts(node)
    return dict(cat=cat, conv_state=conv_state, x=x, copy=copy, conv=conv, weight=args["weight"],
                bias=args.get("bias"), W=W, S=S, T=T, activation=activation, last=node,
                casts=cat_casts)


def check_conv_update(m: dict[str, Any]) -> str | None:
    """Widths, dtypes, and that the conv state is touched by nothing else; else why not."""
    W, S = m["W"], m["S"]
    if not isinstance(W, int) or not MIN_W <= W <= MAX_W:
        return f"kernel width W={W} unsupported (the op takes {MIN_W} <= W <= {MAX_W})"
    if not statically_known_true(S >= W - 1):
        return f"the state holds S={S} inputs, fewer than W-1={W - 1}"
    for name in ("x", "conv_state", "weight", "bias"):
        t = _tensor(m[name]) if m[name] is not None else None
        if m[name] is not None and (t is None or t.dtype not in SUPPORTED_DTYPES):
            return f"{name} has dtype {None if t is None else t.dtype}, not one of fp32/bf16/fp16"
    if m["bias"] is not None and _tensor(m["bias"]).dim() != 1:
        return "bias is not a (dim,) tensor"
    others = [u for u in m["conv_state"].users if u is not m["cat"] and u is not m["copy"]]
    if others:
        return (f"the conv state is also used by {[u.name for u in others]}: moving its update into one op "
                "could change what they see")
    if m["copy"].users:
        return "the value of conv_state.copy_(...) is used"
    return None


def conv_update_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for cat in list(graph.nodes):
        if not is_call(cat, torch.cat):
            continue
        try:
            m = match_conv_update(cat)
        except Miss as miss:
            ctx.miss(CONV_FAMILY, str(miss), [cat])
            continue
        if m is None:
            continue
        reason = check_conv_update(m)
        if reason is not None:
            ctx.miss(CONV_FAMILY, reason, [cat])
            continue
        last = m["last"]
        out_dtype = _tensor(last).dtype
        with graph.inserting_before(m["conv"]):
            x = _widen_for(graph, m["x"], out_dtype)
            op = graph.call_function(torch.ops.ssm.causal_conv1d_update.default,
                                     (x, m["conv_state"], depthwise_weight(graph, m["weight"]), m["bias"],
                                      m["activation"]))
            propagate_val(op)
            result = _cast_to(graph, op, out_dtype)
        if "stack_trace" in cat.meta:
            op.meta["stack_trace"] = cat.meta["stack_trace"]
        last.replace_all_uses_with(result)
        ctx.rewrite(CONV_FAMILY, "cat; copy_(window[-S:]); conv1d(window)[-T:]" + ("+silu" if m["activation"] else ""),
                    [cat, m["copy"], m["conv"], last], "ssm.causal_conv1d_update",
                    {"W": int(m["W"]), "S": int(m["S"]), "activation": m["activation"], "bias": m["bias"] is not None,
                     "rounding_casts_dropped": _narrowing(m["casts"])})
        graph.erase_node(m["copy"])


def register(pm: PassManager) -> None:
    pm.add(CONV_FAMILY, conv_update_pass)
    pm.add(STATE_FAMILY, state_update_pass)
