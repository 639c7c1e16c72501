"""Family ``scan_loop``: an unrolled Python time loop that is a selective scan.

Dynamo unrolls ``for i in range(L): h = A_full[:, :, i] * h + B_full[:, :, i]; ys.append(C_t · h)``
into L copies of the same few nodes. This pass

1. anchors on ``α_0 * H`` (a ``mul``, or the product inside ``addcmul``): α_0 a time slice
   ``A_full[..., 0, ...]`` (indexing, ``select`` or an ``unbind`` item), or a computation on time
   slices that all read t=0 (code that discretises inside the loop); H is the initial state
   (zeros, or any tensor that broadcasts to the state: it becomes ``initial_state``);
2. proves step 0 symbolically: with every node that does not depend on H replaced by a symbol,
   h_0 must be exactly ``α·H + β`` — linear, no other terms — where α and β are the slices t=0
   of two tensors (A_full, B_full), or per-step values computed from slices t=0;
3. checks that every later step t is the same computation with every time index shifted by t
   (a structural walk, linear in graph size), which makes the step-0 proof hold for all t;
4. proves the readout of h_0 is ``Σ_n h_0 · C_full[t=0]`` (einsum, matmul, product + sum) and
   that the per-step outputs are collected once, in time order, along one axis (``stack``,
   ``cat`` of unsqueezed outputs, or writes into a fresh buffer: ``out[:, :, t] = y``,
   ``out[:, t].copy_(y)``); or, when the states themselves are stacked (mamba.py's
   ``selective_scan_seq``), that the stack is read out once as ``Σ_n states · C_full``
   (``readout.match_readout``) and otherwise only at its last step; or, when the collected
   value is user code on top of the contraction (a skip ``+ D*u_t``, a ``silu(z_t)`` gate or a
   scale written inside the loop), that it reads h_t only through ``r_t = Σ_n h_t · C_full[t]``:
   then each r_t becomes the op's output at time t and the user's code after it stays;
5. proves ``A_full = exp(Δ·A)``, ``B_full = Δ·B·u`` (``discretize.match_discretization``), or
   the same for one step's values (``discretize.match_step_discretization``);
6. replaces the loop by one ``ssm.selective_scan`` on permuted views of the sources.

Anything that does not fit is left untouched and recorded with ``ctx.miss``; so is an unrolled
linear recurrence no anchor reached (an EMA ``h = c*h + x_t``, a gated RNN with a 3-D decay).
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable, Iterator, TypeVar

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from .discretize import (
    Discretized,
    Source,
    flipped_step_delta,
    grouped_source,
    index_term,
    match_discretization,
    match_full_decay_step_input,
    match_step_decay_full_input,
    match_step_discretization,
    view_source,
)
from .fx_utils import (
    HALF_DTYPES,
    IDENTITY_FACTORS,
    IDENTITY_SUMMANDS,
    VIEW_OPS,
    ContextRegions,
    addcmul_operands,
    bare_name,
    data_inputs,
    exp_behind,
    grad_enabled_at,
    is_zeros,
    named_args,
    storage_of,
    storage_of_value,
    is_call,
    is_exp,
    OP_ROUNDING,
    REVERSED_OUTPUT,
    dropped_rounding,
    float64_readout,
    higher_order_op,
    hop_name,
    proof_number,
    proof_sum,
    readout_decision,
    op_region,
    is_cast,
    is_lossless_cast,
    is_method,
    is_number,
    detach_note,
    dtype_of,
    mutates,
    parse_index,
    parse_slice,
    permute_view,
    propagate_val,
    shape_of,
    sign_of,
    time_prefix_source,
    time_slice,
    unbind_source,
    val,
    written_args,
    written_in_place,
)
from .manager import PassContext
from .readout import loose_readout, split_state_users

FAMILY = "scan_loop"
ONE_STEP = ("a one-step loop is left alone: the decay is a slice of a tensor with a single time step (a decode "
            "step, or a sequence stepped one token at a time with each step's values computed on their own, "
            "which leaves no sequence-long A_full/B_full to scan)")
NOT_A_CONTRACTION = "the readout is not a contraction of h_t with C_t"
# A product exp(·)[i] * H whose next "step" computes its exp from other values: per-head decode
# steps on one stacked cache (HF Zamba's ``for head in range(n_heads)`` over ``cache[:, head]``)
# read like that, and the decode pass takes each of them (it withdraws this at its steps).
NO_STEP_CHAIN = ("no state chain: step 1's exp(...) is not step 0's with every time index + 1 (a value recomputed "
                 "in every step that is not a time slice, or one computed from time slices through more than six "
                 "ops, such as a projection applied inside the loop?)")
DEEP_STEP = ("a linear recurrence h = exp(·)*h + x in which every step computes its decay from values the pass "
             "does not read as time slices of one tensor (computed from x[:, t] through more than six ops, as "
             "x_proj and dt_proj applied inside the loop are): left alone; Δ, B and C computed for the whole "
             "sequence before the loop are read step by step and proved")

_MUL = (operator.mul, torch.mul)
_COLLECTORS = (torch.stack, torch.cat)
_Emitted = TypeVar("_Emitted")
# Python's in-place operators on tensors mutate the previous state, which a later readout may read.


# ---------------------------------------------------------------------------------------------
# Regions and the structural walk
# ---------------------------------------------------------------------------------------------

def _between(src: torch.fx.Node, dst: torch.fx.Node, pos: dict[torch.fx.Node, int]) -> list[torch.fx.Node] | None:
    """Nodes that depend on ``src`` and that ``dst`` depends on (``dst`` included), in graph
    order (``fx_utils.op_region`` of one source); None when ``dst`` does not depend on ``src``."""
    return op_region([src], [dst], pos) or None


# Deterministic ops that read nothing but their arguments: a loop-invariant value that code
# recomputes in every step with these (``A.unsqueeze(0)``, ``-torch.exp(A_log)``, ``A.float()``)
# is the same value in every step, as long as nothing it reads is written in place.
_PURE_METHODS = frozenset({
    "unsqueeze", "squeeze", "view", "reshape", "transpose", "permute", "expand", "expand_as", "flatten",
    "unflatten", "movedim", "t", "contiguous", "clone", "detach", "float", "double", "half", "bfloat16", "to",
    "type_as", "neg", "exp", "log", "abs", "mul", "add", "sub", "div", "__getitem__",
})
_PURE_FUNCTIONS = frozenset({
    operator.getitem, operator.neg, operator.mul, operator.add, operator.sub, operator.truediv, getattr,
    torch.exp, torch.neg, torch.log, torch.abs, torch.mul, torch.add, torch.sub, torch.div, torch.unsqueeze,
    torch.squeeze, torch.transpose, torch.permute, torch.reshape, torch.clone, torch.nn.functional.softplus,
})


def _is_pure(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _PURE_METHODS
    return node.op == "call_function" and node.target in _PURE_FUNCTIONS


class _SliceBase:
    """The tensor a time slice reads, as a leaf key holds it: equal to another step's when it is
    the same node or, where every step recomputes it alike (``C.float()[:, None, :, t]``), the
    same loop invariant. Only a differing node is keyed structurally, so the common case (one
    tensor sliced by every step) costs nothing more; step 0's node is the one used."""

    __slots__ = ("node",)

    def __init__(self, node: torch.fx.Node):
        self.node = node

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _SliceBase):
            return False
        if self.node is other.node:
            return True
        mine = _leaf_key(self.node, 0, 1)
        return mine[0] == "inv" and mine == _leaf_key(other.node, 0, 1)

    def __hash__(self) -> int:
        return 0


def _leaf_key(node: torch.fx.Node, t: int, depth: int = 0) -> tuple:
    """How a leaf of step ``t`` is compared with step 0's.

    A time slice is keyed by (base, axis, index - t), the base being one node in every step or a
    loop invariant each step recomputes alike (``_SliceBase``); a small computation on time
    slices (e.g. ``C[:, i].unsqueeze(-1)``) by its op and its inputs' keys; so is a loop-invariant
    value that every step recomputes with deterministic ops from graph values nobody writes in
    place ("inv").
    Anything else must be the very same node in every step — keying it structurally would equate
    two ``randn`` calls.
    """
    ts = time_slice(node)
    if ts is not None:
        base, axis, idx = ts
        return ("slice", _SliceBase(base), axis, idx - t)
    if depth < 6 and node.op in ("call_function", "call_method"):
        kinds: dict[torch.fx.Node, str] = {}

        def key(a):
            if isinstance(a, torch.fx.Node):
                k = _leaf_key(a, t, depth + 1)
                kinds[a] = k[0]
                return k
            if isinstance(a, (list, tuple)):
                return (type(a).__name__,) + tuple(key(x) for x in a)
            if isinstance(a, dict):
                return ("dict",) + tuple((k, key(v)) for k, v in sorted(a.items()))
            return ("literal", type(a).__name__, repr(a))

        k = (node.op, node.target, key(node.args), key(node.kwargs))
        if {"slice", "op"} & set(kinds.values()):
            return ("op",) + k
        # An "inv" input was checked when it was keyed; any other input is one node in every step.
        if _is_pure(node) and not mutated(node, *(a for a, kind in kinds.items() if kind != "inv")):
            return ("inv",) + k
    return ("node", node)


def _may_have_key(node: torch.fx.Node, key: tuple) -> bool:
    """False where ``_leaf_key(node, t)`` cannot equal ``key`` for any t, from what the key's
    kind fixes (a time slice, or the node's op and target, or the node itself); True otherwise.
    Keying a node walks its inputs and their writes: a search over every product of a graph
    with many loops spent minutes there (a tiny Zamba, run 65), nearly all on nodes of another op."""
    kind = key[0]
    if kind == "slice":
        return time_slice(node) is not None
    if kind in ("op", "inv"):
        return node.op == key[1] and node.target == key[2] and time_slice(node) is None
    return node is key[1]


def _args_match(tmpl: Any, cand: Any, bind: dict[torch.fx.Node, torch.fx.Node], t: int) -> bool:
    if isinstance(tmpl, torch.fx.Node):
        if tmpl in bind:
            return cand is bind[tmpl]
        return isinstance(cand, torch.fx.Node) and _leaf_key(tmpl, 0) == _leaf_key(cand, t)
    if isinstance(tmpl, (list, tuple)):
        return (
            type(tmpl) is type(cand)
            and len(tmpl) == len(cand)
            and all(_args_match(a, b, bind, t) for a, b in zip(tmpl, cand))
        )
    if isinstance(tmpl, dict):
        return (
            isinstance(cand, dict)
            and tmpl.keys() == cand.keys()
            and all(_args_match(tmpl[k], cand[k], bind, t) for k in tmpl)
        )
    return type(tmpl) is type(cand) and tmpl == cand


def _count_steps(template: list[torch.fx.Node], H: torch.fx.Node, h0: torch.fx.Node) -> int:
    """How many steps repeat step 0's ``template`` (H -> h0) with time indices shifted, from 0."""
    h, t = h0, 1
    while True:
        bind = {H: h}
        if _walk(template, bind, t) is not None:
            return t
        h, t = bind[h0], t + 1


def _walk(template: list[torch.fx.Node], bind: dict[torch.fx.Node, torch.fx.Node], t: int) -> str | None:
    """Find step ``t``'s copy of each template node; ``bind`` maps step 0's nodes to step t's.

    Returns None on success, or the name of the template node that has no copy.
    """
    for n in template:
        anchor = next((a for a in n.all_input_nodes if a in bind), None)
        if anchor is None:
            return n.name
        found = None
        for cand in bind[anchor].users:
            if (
                cand.op == n.op
                and cand.target == n.target
                and _args_match(n.args, cand.args, bind, t)
                and _args_match(n.kwargs, cand.kwargs, bind, t)
            ):
                found = cand
                break
        if found is None:
            return n.name
        bind[n] = found
    return None


# ---------------------------------------------------------------------------------------------
# The symbolic proof of one step
# ---------------------------------------------------------------------------------------------

# Factories that read only their input's shape, dtype and device.
_NEW_LIKE = (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like)


class _NotElementwise(Exception):
    pass


class _StateTerms(Exception):
    """The step's state terms cancel or merge (see ``_state_enters_once``)."""


def _sym_eval(region: list[torch.fx.Node], h_prev: torch.fx.Node, H: sympy.Symbol
              ) -> tuple[dict[torch.fx.Node, sympy.Expr], dict[sympy.Symbol, torch.fx.Node]]:
    """Evaluate the step's nodes as sympy expressions of H and one symbol per leaf node."""
    env: dict[torch.fx.Node, sympy.Expr] = {h_prev: H}
    leaves: dict[sympy.Symbol, torch.fx.Node] = {}

    def arg(a, identities: tuple[int, ...] = ()):
        if isinstance(a, torch.fx.Node):
            if a not in env:
                s = sympy.Symbol(f"leaf{len(leaves)}")
                leaves[s] = a
                env[a] = s
            return env[a]
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return number(a, identities)
        raise _NotElementwise(f"argument {a!r}")

    def number(a, identities: tuple[int, ...]):
        if not isinstance(a, (int, float)) or isinstance(a, bool):
            raise _NotElementwise(f"a scale factor {a!r} that is not a number")
        return proof_number(a, identities, _StateTerms, f" in {name}")

    def summed(left, right):
        return proof_sum(left, right, _StateTerms, f" in {name}")

    for n in region:
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
        if n.target is getattr and len(n.args) == 2 and isinstance(n.args[1], str):
            name = f".{n.args[1]}"  # h.mT as the code wrote it, not FX's getattr
        if mutates(n):
            raise _NotElementwise(f"in-place {name}")
        a = n.args
        if is_cast(n):
            env[n] = arg(a[0])
            continue
        extra_kw = set(n.kwargs)
        # torch.add/sub(x, y, alpha=c) is x ± c*y (c ±1: a scaled addend is no step of the op).
        if (is_call(n, operator.add, torch.add) or is_method(n, "add")) and extra_kw <= {"alpha"} and len(a) == 2:
            env[n] = summed(arg(a[0], IDENTITY_SUMMANDS),
                            number(n.kwargs.get("alpha", 1), IDENTITY_FACTORS) * arg(a[1], IDENTITY_SUMMANDS))
        elif (is_call(n, operator.sub, torch.sub) or is_method(n, "sub")) and extra_kw <= {"alpha"} and len(a) == 2:
            env[n] = summed(arg(a[0], IDENTITY_SUMMANDS),
                            -number(n.kwargs.get("alpha", 1), IDENTITY_FACTORS) * arg(a[1], IDENTITY_SUMMANDS))
        elif (is_call(n, *_MUL) or is_method(n, "mul")) and not extra_kw and len(a) == 2:
            left, right = arg(a[0], IDENTITY_FACTORS), arg(a[1], IDENTITY_FACTORS)
            env[n] = left * right
            if (H in left.free_symbols and H in right.free_symbols
                    and sympy.diff(env[n], H, 2) == 0):
                # Two factors that hold the state and multiply to something linear in it:
                # exp(y)·exp(-y) is 1 to sympy, inf·0 = NaN in floats where y overflows. (h·h
                # stays quadratic and is refused below as not linear.)
                raise _StateTerms(f"multiplies two values that both hold the state in {name}: the proof would "
                                  "merge or cancel them (exp(y)·exp(-y) = 1), the floats do not")
        elif (is_call(n, operator.truediv, torch.div) or is_method(n, "div")) and not extra_kw and len(a) == 2:
            # By a number only: sympy cancels x / x to 1, the floats give NaN where x is 0.
            env[n] = arg(a[0]) / number(a[1], IDENTITY_FACTORS)
        elif (is_call(n, operator.neg, torch.neg) or is_method(n, "neg")) and not extra_kw and len(a) == 1:
            env[n] = -arg(a[0])
        elif (is_call(n, torch.addcmul) or is_method(n, "addcmul")) and len(a) == 3 and extra_kw <= {"value"}:
            env[n] = summed(arg(a[0], IDENTITY_SUMMANDS), number(n.kwargs.get("value", 1), IDENTITY_FACTORS)
                            * arg(a[1], IDENTITY_FACTORS) * arg(a[2], IDENTITY_FACTORS))
        elif (is_call(n, torch.tanh) or is_method(n, "tanh")) and len(a) == 1:
            env[n] = sympy.tanh(arg(a[0]))
        elif is_exp(n) and len(a) == 1:
            env[n] = sympy.exp(arg(a[0]))
        elif (is_call(n, torch.sigmoid) or is_method(n, "sigmoid")) and len(a) == 1:
            env[n] = 1 / (1 + sympy.exp(-arg(a[0])))
        elif (is_call(n, *_NEW_LIKE) or is_method(n, "new_zeros", "new_ones", "new_empty", "new_full")) and any(
                isinstance(x, torch.fx.Node) and x in env and H in env[x].free_symbols for x in a[:1]):
            # zeros_like(h) reads only h's shape: a second state started from it between two of h's
            # steps is what the step reads (probe DB: "uses zeros_like" named no second state).
            raise _NotElementwise(f"{name} of the state: a second recurrence started from a tensor of h's shape "
                                  "whose states h's update reads?")
        else:
            raise _NotElementwise(str(name))
        _state_enters_once(n, a, env, H, name)
    return env, leaves


def _state_enters_once(n: torch.fx.Node, args: tuple, env: dict, H: sympy.Symbol, name: str) -> None:
    """Raise unless the previous state H enters ``n`` through at most one summand, and survives it.

    Sympy cancels and merges terms that floats do not: ``dA*h + dBu - 0.0*h`` and
    ``... + h - h`` are ``dA*h + dBu`` to it, but NaN in floats once h is inf, where the op's
    scan gives inf. A step whose state enters twice is left alone rather than proved equal."""
    held = [x for x in args if isinstance(x, torch.fx.Node) and x in env and H in env[x].free_symbols]
    if held and H not in env[n].free_symbols:
        raise _StateTerms(f"cancels the state out in {name} (h - h, 0·h): NaN in floats where h is not "
                          "finite, 0 to the proof")
    # addcmul(c, a, b) = c + a·b: two summands, the second made of two factors.
    summands = [args[:1], args[1:]] if name == "addcmul" else [(x,) for x in args]
    twice = sum(1 for terms in summands if any(x in held for x in terms))
    if twice > 1 and (is_call(n, operator.add, torch.add, operator.sub, torch.sub, torch.addcmul)
                      or is_method(n, "add", "sub", "addcmul")):
        raise _StateTerms(f"adds two terms that both hold the state in {name} (h + c·h): the proof would "
                          "merge them, the floats do not")


# ---------------------------------------------------------------------------------------------
# The match
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LoopMatch:
    L: int
    disc: Discretized
    state_roles: tuple[str, ...]            # roles of h_t's axes, e.g. ("b", "d", "n")
    init: torch.fx.Node | None              # initial state, None when it is zeros
    C: Source | None                        # C_full and its axis roles; None where no readout is used
    out: "Collected"                        # how the per-step outputs are collected
    h_last: torch.fx.Node
    last_users: list[torch.fx.Node]         # users of h_{L-1} outside the loop
    last_views: list[torch.fx.Node]         # ``states[:, -1]`` of stacked states: the last state too
    loop_nodes: list[torch.fx.Node]         # step + readout nodes of every step, in graph order
    late_writes: list[torch.fx.Node]        # in-place writes to a source after the loop's last read


def _same_size(a, b) -> bool:
    # Decided without adding guards: a symbolic size that is not provably equal does not match.
    return statically_known_true(a == b)


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(_same_size(x, y) for x, y in zip(a, b))


def _unit_broadcast(src, dst) -> bool:
    """``src`` is ``dst`` with at most one axis of size 1 (same rank): a multiplier the update
    broadcasts along that axis, if any."""
    if len(src) != len(dst):
        return False
    wider = [(a, b) for a, b in zip(src, dst) if not _same_size(a, b)]
    return len(wider) <= 1 and all(statically_known_true(a == 1) for a, _ in wider)


def _broadcasts_to(src, dst) -> bool:
    """``src`` broadcasts to exactly ``dst`` (aligned on the right, each axis equal or 1)."""
    if len(src) > len(dst):
        return False
    return all(_same_size(a, b) or statically_known_true(a == 1) for a, b in zip(reversed(src), reversed(dst)))


def _size_repr(s) -> int | str:
    return int(s) if is_concrete_int(s) else str(s)


def _negative_index(node: torch.fx.Node) -> bool:
    """``node`` selects with a negative integer index (``x[:, :, -1]``, ``x.select(2, -1)``)."""
    if is_call(node, torch.select) or is_method(node, "select"):
        index = node.args[2:3]
    elif is_call(node, operator.getitem):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    else:
        return False
    return any(isinstance(x, int) and not isinstance(x, bool) and x < 0 for x in index)


def _too_short(name: str, size, L: int) -> str | None:
    """Why the loop's L steps may not all lie on ``name``'s time axis of length ``size``, or None.

    The axis need not be exactly L long: when dynamo recompiles at a new length, the tensor the
    loop ranges over has its length specialised, but a tensor the loop only indexes (C, or u in
    code that discretises per step) keeps a fresh symbol that is only known to be at least L.
    The loop reads its first L steps, and so does the op, through ``first_steps``. Decided
    without adding guards: a length not provably long enough is refused.
    """
    if statically_known_true(size >= L):
        return None
    return f"{name}'s time axis ({_size_repr(size)}) is not provably at least the loop's length {L}"


def first_steps(graph: torch.fx.Graph, src: Source, L: int, from_end: bool = False) -> Source:
    """``src`` as the loop reads it, through its first L steps: itself when its time axis is
    provably L long, else a narrowed view (no copy). ``from_end``: the loop reads ``src``'s flip
    (``Discretized.flip_time``), whose first L steps are ``src``'s last L."""
    if "t" not in src.roles:
        return src
    axis = src.roles.index("t")
    if _same_size(val(src.node).shape[axis], L):
        return src
    return Source(_node(graph, "call_method", "narrow", src.node, axis, -L if from_end else 0, L), src.roles)


def first_steps_of(graph: torch.fx.Graph, disc: Discretized, L: int) -> Discretized:
    """``disc`` with u, Δ and B as the scan reads them through its first L steps (``first_steps``,
    from their ends where the scan reads them flipped)."""
    return dataclasses.replace(disc, **{k: first_steps(graph, getattr(disc, k), L, disc.flip_time)
                                        for k in ("u", "delta", "B")})


_NOT_THE_ANCHOR = "the state's multiplier at step 0 is not A_full[t=0]"
# A product of a time slice and a value that no later step multiplies: said of a candidate alone,
# and dropped next to a loop whose real anchor gave its own reason (``_beside_a_reason``).
_NO_CHAIN = "no state chain: A_full[t=1] does not multiply a value computed from the step-0 state"
# The loop's first state is B_full[t=0] itself, read before a loop from t = 1 (``h = dBu[:, 0]``,
# or ``h = dBu[:, t] if h is None else ...``): match_loop's answer, which ``_rewrite_one`` takes up.
_PEELED = ("the loop's first state is itself a time slice (h = B_full[t=0], then h = A_full[t]*h + B_full[t] "
           "from t = 1)")


def _flip_in_every_step(a0: torch.fx.Node) -> str | None:
    """Why step 1's exp(Δ·A) does not repeat step 0's when step 0 reads Δ as a time slice of a
    flip that only that step reads (``delta.flip(0)[:, :, t]`` in the loop body): each step flips
    Δ anew, and the steps' slices are compared only where they read one tensor, or one that each
    step recomputes by views, casts and elementwise ops (``_leaf_key``). None otherwise."""
    found = flipped_step_delta(a0)
    if found is None or found[2] != "slice":
        return None
    what, flip, _ = found
    read = [time_slice(user) for user in flip.users]
    if None in read or len({r[2] for r in read}) != 1:
        return None
    # One text for every step (each is a candidate anchor): the misses merge into one record.
    return (f"no state chain: step 1's exp(...) is not step 0's with every time index + 1: the step reads Δ as a "
            f"time slice of {what}, a flip that no other step reads (each step flips Δ anew), and the scan pass "
            "compares the steps' slices only where they read one tensor, or one that every step recomputes by "
            "views, casts or elementwise ops, which a flip is not")


_BUFFER_FACTORIES = (torch.empty, torch.zeros, torch.ones, torch.full, torch.empty_like, torch.zeros_like,
                     torch.ones_like, torch.full_like)
_BUFFER_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full")


def _collects(c: torch.fx.Node, y: torch.fx.Node) -> bool:
    """``c`` stores ``y`` as one step's output: an item of stack/cat, a setitem value, a copy_ source."""
    if is_call(c, *_COLLECTORS):
        return isinstance(c.args[0], (list, tuple)) and y in c.args[0]
    if is_call(c, operator.setitem):
        return len(c.args) == 3 and c.args[2] is y
    if is_method(c, "copy_"):
        return len(c.args) == 2 and c.args[1] is y and not c.kwargs
    return False


@dataclasses.dataclass
class Collected:
    kind: str                               # "stack", "cat", "setitem", "copy_", "states", or
                                            # "last state only" (no readout is used)
    out_node: torch.fx.Node                 # the value that holds all outputs after the loop
    out_users: list[torch.fx.Node]          # its users after the loop, to be redirected
    writes: list[torch.fx.Node]             # the collecting nodes, erased with the loop
    roles: tuple[str, ...]                  # roles of out_node's axes
    # kind "per-step": each step's readout r_t, replaced by a time slice of the op's output; the
    # user's code after it (a skip, a gate, a scale) and the collection stay as they are.
    step_readouts: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    # The outputs are stored last step first (a reverse loop's ``stack(ys[::-1])`` or ``out[:, t]
    # = y_t``, read forward over the flipped tensors): the collection is the op's y flipped in time.
    reversed_time: bool = False


def _collect(ys: list[torch.fx.Node], y_roles: list[str | None], pos) -> Collected | None:
    """Every y_t stored once, in one place, at time index t, with nothing reading it early: the
    collection the op's y replaces whole. None otherwise: the caller then replaces each y_t alone
    (``Collected("per-step")``) and keeps the user's collecting code, so no reason is needed."""
    c = next(c for c in ys[0].users if _collects(c, ys[0]))
    if is_call(c, *_COLLECTORS):
        items = list(c.args[0])
        backwards = len(ys) > 1 and items == ys[::-1]
        if (items != ys and not backwards) or any(set(y.users) != {c} for y in ys):
            return None
        dim = c.args[1] if len(c.args) > 1 else c.kwargs.get("dim", 0)
        if is_call(c, torch.stack):
            roles = list(y_roles)
            roles.insert(dim % (len(y_roles) + 1), "t")
        else:
            dim %= len(y_roles)
            if y_roles[dim] is not None:
                return None
            roles = ["t" if i == dim else r for i, r in enumerate(y_roles)]
        # A size-1 axis each y_t keeps (``h @ C_t[..., None]``, ``sum(-1, keepdim=True)``) stays in
        # the stacked output: role "1", which the op's y gets as an added axis.
        roles = ["1" if r is None else r for r in roles]
        return Collected(c.target.__name__, c, list(c.users), [c], tuple(roles), reversed_time=backwards)

    # A preallocated buffer: out[:, :, t] = y_t, or out[:, t].copy_(y_t).
    for y in ys:
        users = list(y.users)
        if len(users) != 1 or not _collects(users[0], y) or is_call(users[0], *_COLLECTORS):
            return None
    stored = [(y, next(iter(y.users))) for y in ys]
    slots = _buffer_slots(stored, pos, "the output buffer", "step {t}'s output")
    backwards = False
    if isinstance(slots, str) and len(ys) > 1:
        # Stored last step first, out[:, L-1-t] = y_t: the op's y flipped in time.
        slots = _buffer_slots(stored, pos, "the output buffer", "step {t}'s output", backwards=True)
        backwards = True
    if isinstance(slots, str):
        return None
    buf, axis, axis_map, writes = slots
    roles = ["t" if o is None else y_roles[o] for o in axis_map]
    if None in roles or len([o for o in axis_map if o is not None]) != len(y_roles):
        return None
    later = [u for u in buf.users if u not in set(writes)]
    return Collected(writes[-1].target if isinstance(writes[-1].target, str) else "setitem",
                     buf, later, writes, tuple(roles), reversed_time=backwards)


def _buffer_slots(stored: list[tuple[torch.fx.Node, torch.fx.Node]], pos, what: str, item: str,
                  backwards: bool = False) -> tuple[torch.fx.Node, int, tuple, list[torch.fx.Node]] | str:
    """Each step's value written into one slot of one preallocated buffer, ``buf[:, :, t] = v_t``
    or ``buf[:, t].copy_(v_t)`` (``stored``: (v_t, its write) in time order): (the buffer, its
    time axis, the write's axis map, the write nodes), or why not. The buffer must be freshly
    allocated, exactly as long as the loop, and untouched by anything else before the last write.
    ``what`` names the buffer and ``item`` (with ``{t}``) the values in the reasons."""
    writes: list[torch.fx.Node] = []
    buf = axis = axis_map = None
    for t, (_, w) in enumerate(stored):
        if is_call(w, operator.setitem):
            parsed = parse_index(w.args[0], w.args[1])
            step_writes = [w]
        else:
            view = w.args[0]
            parsed = parse_slice(view)
            if set(view.users) != {w}:
                return f"{item.format(t=t)}'s slot of {what} is used elsewhere"
            step_writes = [view, w]
        if parsed is None:
            return f"{item.format(t=t)} is not stored at one time index of a buffer"
        b, ax, idx, amap = parsed
        if buf is None:
            buf, axis, axis_map = b, ax, amap
        if b is not buf or ax != axis or idx != (len(stored) - 1 - t if backwards else t) or amap != axis_map:
            return (_part_of_buffer(stored, what)
                    or f"{item.format(t=t)} is stored at the wrong place of {what} (index {idx} of axis {ax})")
        slot = [size for i, size in enumerate(val(b).shape) if i != ax]
        if not _same_shape(slot, val(stored[t][0]).shape):
            # The write would broadcast the value over the slot (a batch-1 state into a batch-2
            # buffer): the slot holds copies the loop never computed.
            return (f"{item.format(t=t)} has shape {tuple(val(stored[t][0]).shape)}, its slot of {what} "
                    f"{tuple(slot)}: the write broadcasts")
        writes.extend(step_writes)
    if not (is_call(buf, *_BUFFER_FACTORIES) or is_method(buf, *_BUFFER_METHODS)):
        return f"{what} is not a freshly allocated tensor"
    if not _same_size(val(buf).shape[axis], len(stored)):
        return (f"{what}'s time axis ({_size_repr(val(buf).shape[axis])}) is not provably the "
                f"loop's length {len(stored)}")
    last_write = max(pos[w] for w in writes)
    if any(pos[u] < last_write for u in buf.users if u not in set(writes)):
        return f"{what} is read or written inside the loop"
    return buf, axis, tuple(axis_map), writes


def _part_of_buffer(stored: list[tuple[torch.fx.Node, torch.fx.Node]], what: str) -> str | None:
    """Why the loop's writes, one per step into consecutive slots of one buffer, miss some of its
    slots (a reverse walk from L-1 that stops before step 0, a loop from t = 1), or None when the
    writes are not such a run. Step t's slot is right for the walk; the buffer is not the op's
    output: its unwritten slots keep what they held before the loop."""
    parsed = [parse_index(w.args[0], w.args[1]) if is_call(w, operator.setitem) else parse_slice(w.args[0])
              for _, w in stored]
    if None in parsed or len({(b, ax, tuple(amap)) for b, ax, _, amap in parsed}) != 1:
        return None
    b, ax = parsed[0][0], parsed[0][1]
    idx = [p[2] for p in parsed]
    size = val(b).shape[ax]
    step = 1 if idx[-1] >= idx[0] else -1
    if not is_concrete_int(size) or idx != list(range(idx[0], idx[-1] + step, step)) or len(idx) >= int(size):
        return None
    lo, hi = min(idx), max(idx)
    gaps = [(a, z) for a, z in ((0, lo - 1), (hi + 1, int(size) - 1)) if z >= a]
    missing = " and ".join(f"{a}..{z}" if z > a else f"{a}" for a, z in gaps)
    many = len(gaps) > 1 or gaps[0][1] > gaps[0][0]
    return (f"the loop walks {what} {'back' if step < 0 else 'forward'} from index {idx[0]} to index {idx[-1]} "
            f"of axis {ax} (length {size}): {'indices' if many else 'index'} {missing} "
            f"{'are' if many else 'is'} never written by the loop and keep{'' if many else 's'} what the buffer "
            "held before it; the op's output holds one value per step walked")


# Ops whose result may share memory with their input: views, and conversions that return the input
# itself when there is nothing to convert (``A.float()`` of a float A, ``x.contiguous()``).
_ALIASING_OPS = frozenset(VIEW_OPS + (
    "view_as", "reshape_as", "expand_as", "swapaxes", "swapdims", "diagonal", "detach", "contiguous", "float",
    "double", "half", "bfloat16", "to", "type", "type_as",
    # vmap's batched view of its operand: a write inside the vmapped function writes the operand.
    "_add_batch_dim"))
_ALIAS_ATTRS = frozenset({"T", "mT", "H", "mH", "real", "imag", "data"})


def _is_inplace(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """``user`` writes ``node``'s memory: an ``out=`` argument, or an in-place op on it (methods,
    ``operator.i*``, ``setitem``, ``torch.relu_``, ``F.relu(x, inplace=True)``, ``Tensor(a!)``)."""
    return node in written_args(user)


def _aliases(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """``user`` may share ``node``'s memory (a view, ``.T``, a no-op conversion, ``.data``, the
    pieces of a ``split``). By name for the ops known to, and otherwise by the fake values: any
    result of ``user`` in the storage of ``node`` (``ravel``, ``moveaxis``, ``positive``,
    ``torch._C._autograd._get_data_attr``, ``tensor_split``'s tuple and its items)."""
    if user.op not in ("call_function", "call_method") or node not in user.all_input_nodes:
        return False
    if user.args and user.args[0] is node:
        if user.target is getattr and user.args[1] in _ALIAS_ATTRS:
            return True
        if user.target is not getattr and bare_name(user) in _ALIASING_OPS:
            return True
    mine = _storages(val(node))
    return bool(mine) and not mine.isdisjoint(_storages(val(user)))


def _storages(value: Any) -> set:
    return {s for s in map(storage_of_value, pytree.tree_leaves(value)) if s is not None}


def mutated(*nodes: torch.fx.Node, ignore: frozenset[torch.fx.Node] = frozenset()) -> bool:
    """The memory of one of ``nodes`` is written in place somewhere in the graph: through the node,
    its base (what it is a view of) or any view of that base, however deep (``A.T.mul_()`` changes
    A), by a node not in ``ignore``. Nodes with one base share one walk of its views: asking about
    every time slice of a (batch, dim, L, N) tensor costs one walk, not L."""
    return next(_writes(nodes, ignore), None) is not None


def written_after(node: torch.fx.Node, pos: dict[torch.fx.Node, int],
                  ignore: frozenset[torch.fx.Node] = frozenset(), walks: dict | None = None) -> bool:
    """Some node not in ``ignore`` writes ``node``'s memory in place at or after ``node``'s own
    place. A write before it (a buffer filled in place, then viewed: VMamba's cross-scan written
    as ``xs = x.new_empty(...); xs[:, k] = ...; u = xs.view(...)``) is done before anything can
    read ``node``'s value, so an op that reads ``node`` anywhere after it reads what the user's
    code read. ``walks``: a dict to share between calls on one unchanged graph (``_writes``)."""
    return any(pos[w] >= pos[node] for w in _writes((node,), ignore, walks))


def _writes(nodes, ignore, walks: dict | None = None):
    # Up through every operand a node may alias, not only its first positional one: a view taken
    # by keyword (``torch.narrow(input=xs, ...)``), or one of several results that alias their
    # inputs (``torch.broadcast_tensors(w, xs)[1]``) (probe BC, run 52).
    roots: set[torch.fx.Node] = set()
    tops: set[torch.fx.Node] = set()
    up = list(nodes)
    while up:
        node = up.pop()
        if node in roots:
            continue
        roots.add(node)
        above = [a for a in node.all_input_nodes if _aliases(node, a)]
        if not above:
            tops.add(node)
        up.extend(a for a in above if a not in roots)
    inputs = _aliased_inputs(roots)
    # Every root is reached from a top down through aliases, so the walk down from the tops and
    # the aliased inputs finds what the walk from all the roots finds. Each time slice of one
    # (batch, dim, L, N) tensor has the same tops: asked about L slices one by one, the walk over
    # the tensor's L views is done once, where ``walks`` is given (it was done L times, and the
    # HF loop's pass took 53 s at L=1024, run 54).
    key = (frozenset(tops | inputs), ignore)
    if walks is not None and key in walks:
        yield from walks[key]
        return
    found = []
    start = tops | inputs
    seen = set(start)
    stack = list(start)
    while stack:
        n = stack.pop()
        for user in n.users:
            if _is_inplace(user, n) and user not in ignore:
                found.append(user)
            if user not in seen and _aliases(user, n):
                seen.add(user)
                stack.append(user)
    if walks is not None:
        walks[key] = found
    yield from found


def _aliased_inputs(roots: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The graph inputs that share memory with one of the input ``roots`` without an FX edge
    between them: a caller may pass ``u`` and ``u[:, :3]`` as two arguments, and a write through
    one changes the other. Only inputs can alias that way (every alias made inside the graph is a
    view edge the walk follows), so only their fake storages are compared."""
    inputs = [r for r in roots if r.op in ("placeholder", "get_attr") and isinstance(val(r), torch.Tensor)]
    if not inputs:
        return set()
    storages = {storage_of(r) for r in inputs}
    graph = inputs[0].graph
    candidates = [*graph.find_nodes(op="placeholder"), *graph.find_nodes(op="get_attr")]
    if None in storages:
        # An input of unknown storage may alias any other.
        return {c for c in candidates if isinstance(val(c), torch.Tensor)}
    return {c for c in candidates if c not in roots and storage_of(c) in storages}


def _varies_per_step(node: torch.fx.Node, loop: set[torch.fx.Node], L: int) -> str | None:
    """Why ``node``, an operand every step reads, may differ from step to step, or None: it is
    computed from the loop's nodes, or from time slices (each step's copy reads its own step).
    Only the values it is computed from count: ``C.type_as(x_t)`` or ``C.view_as(h)`` takes a
    dtype or a shape from a step, the same at every step (which puts it in the readout's region:
    the walk from the state reaches it through that edge, so only its data inputs are followed)."""
    stack = data_inputs(node)
    seen = set(stack)
    while stack:
        n = stack.pop()
        if n in loop:
            return f"is computed from the loop's own values ({n.name}: the state or a step's values)"
        for a in data_inputs(n):
            if a not in seen:
                seen.add(a)
                stack.append(a)
    if _step_kind(node, L) != "same":
        return "is computed from time slices, a different value at each step"
    return None


def _step_kind(node: torch.fx.Node, L: int, depth: int = 0) -> str:
    """"same" unless ``node``'s value comes, through its data inputs, from a time slice; as far
    down as ``_leaf_key`` looks (below that, the walk matched every step to this very node).
    A slice that each of L steps shifts by one needs an axis of at least L; an index into a
    shorter one (HF Zamba's per-head ``A[h]``) is one value for every step."""
    ts = time_slice(node)
    if ts is not None:
        size = val(ts[0]).shape[ts[1]] if isinstance(val(ts[0]), torch.Tensor) else None
        if not (is_concrete_int(size) and int(size) < L):
            return "slice"
    if depth < 6 and node.op in ("call_function", "call_method"):
        if any(_step_kind(a, L, depth + 1) != "same" for a in data_inputs(node)):
            return "op"
    return "same"


def _written_in_place(node: torch.fx.Node) -> torch.fx.Node | None:
    """The first in-place write to ``node``'s memory, through it or any view of it, or None."""
    seen, stack = {node}, [node]
    while stack:
        n = stack.pop()
        for user in n.users:
            if _is_inplace(user, n):
                return user
            if user not in seen and _aliases(user, n):
                seen.add(user)
                stack.append(user)
    return None


def read_through(loop_nodes: list[torch.fx.Node], sources: set[torch.fx.Node], pos) -> set[torch.fx.Node]:
    """Every value the loop reads from its sources on: the loop's inputs and their ancestors back to
    the sources (casts, clones and views the passes look through to find the sources). What is
    above a source is not walked: the op reads the source itself."""
    first = min(pos[s] for s in sources)
    loop = set(loop_nodes)
    seen: set[torch.fx.Node] = set()
    stack = [a for n in loop_nodes for a in n.all_input_nodes if a not in loop]
    while stack:
        n = stack.pop()
        if n in seen or n in loop or pos[n] < first:
            continue
        seen.add(n)
        if n not in sources:
            stack.extend(n.all_input_nodes)
    return seen


def _levels_after(h0: torch.fx.Node, exclude: set[torch.fx.Node], hops: int) -> Iterator[list[torch.fx.Node]]:
    """The nodes ``h0`` reaches through its users, one list per hop (each node once, none in
    ``exclude``), for at most ``hops`` hops."""
    seen, frontier = {h0}, [h0]
    for _ in range(hops):
        frontier = list(dict.fromkeys(u for n in frontier for u in n.users if u not in exclude and u not in seen))
        if not frontier:
            return
        seen.update(frontier)
        yield frontier


def _find_readout(h0: torch.fx.Node, exclude: set[torch.fx.Node]) -> torch.fx.Node | None:
    """The first node after ``h0`` (not in ``exclude``) that a stack/cat collects."""
    return next((u for level in _levels_after(h0, exclude, 32) for u in level
                 if any(_collects(c, u) for c in u.users)), None)


def _uncollected_readout(h0: torch.fx.Node, exclude: set[torch.fx.Node], state_roles: tuple[str, ...], L: int,
                         disc: Discretized) -> torch.fx.Node | str | None:
    """The first node after ``h0`` (not in ``exclude``, a few hops at most) that is a contraction
    ``Σ_n h_0 · C_full[t=0]``, for readouts no stack/cat collects; else the reason of a
    contraction with C read at another step (probe CW: a lagged readout summed over time was
    said to use h_0 "outside the recurrence"), else None."""
    lag = None
    for level in _levels_after(h0, exclude, 6):
        for n in level:
            proved = _match_contraction(n, h0, state_roles, L, disc)
            if not isinstance(proved, str):
                return n
            if lag is None and "(lagged readout)" in proved:
                lag = proved
    return lag


def _match_step_readout(y0: torch.fx.Node, h0: torch.fx.Node, rregion: list[torch.fx.Node], h: list[torch.fx.Node],
                        state_roles: tuple[str, ...], L: int, disc: Discretized, pos: dict[torch.fx.Node, int]
                        ) -> tuple[Source, torch.fx.Node, Collected, list[list[torch.fx.Node]]] | str:
    """Prove ``y0 = Σ_n h_0 · C_full[t=0]``, that every step repeats it and that the outputs are
    collected once, in order. Returns (C source, C_full, the collection, each step's readout nodes)."""
    proved = _match_contraction(y0, h0, state_roles, L, disc)
    if isinstance(proved, str):
        return proved
    c_src, c_base, y_roles = proved
    readouts, ys = _repeat_readout(rregion, h0, y0, h, L)
    if isinstance(readouts, str):
        return readouts
    short = _c_too_short(c_src, L)
    if short is not None:
        return short
    collected = any(_collects(c, ys[0]) for c in ys[0].users)
    out = _collect(ys, y_roles, pos) if collected else None
    if out is None:
        # The outputs are proved readouts, but not stored once each in one stack, cat or buffer
        # (a cat of several loops' outputs, a cat grown step by step, ``select_scatter``, a sum
        # over time): each y_t becomes the op's y at t (a size-1 axis the readout keeps, role
        # "1", kept), and the user's code that collects them stays as it is, as for a readout
        # inside a longer expression (``_match_readout_with_tail``).
        roles = tuple("1" if r is None else r for r in y_roles) + ("t",)
        out = Collected("per-step", y0, [], [], roles, ys)
    return c_src, c_base, out, readouts


def _match_readout(y0: torch.fx.Node, h0: torch.fx.Node, rregion: list[torch.fx.Node], h: list[torch.fx.Node],
                   state_roles: tuple[str, ...], L: int, disc: Discretized, pos: dict[torch.fx.Node, int]
                   ) -> tuple[Source, torch.fx.Node, Collected, list[list[torch.fx.Node]]] | str:
    """``_match_step_readout`` for the per-step output ``y0``, then a readout inside a longer
    expression (``_match_readout_with_tail``); else the reason, the most specific one found."""
    found = _match_step_readout(y0, h0, rregion, h, state_roles, L, disc, pos)
    if found == NOT_A_CONTRACTION:
        found = _match_readout_with_tail(y0, h0, rregion, h, state_roles, L, disc, pos) or found
    if found == NOT_A_CONTRACTION:
        found = next(filter(None, (loose_readout(n, h0) for n in rregion)), found + _detached_state_note(y0, h0))
    return found


def _state_use_reason(h: list[torch.fx.Node], steps: list[list[torch.fx.Node]], readout: list[torch.fx.Node],
                      t: int, state_roles: tuple[str, ...], L: int, disc: Discretized,
                      pos: dict[torch.fx.Node, int]) -> str | None:
    """Why state h_t, used outside the recurrence and its proved readout, is not rewritten, where
    the use is a readout of its own (probe CX): a second proved readout of the state (the op reads
    each state out once), or a per-step output that no stack, cat or buffer collects and that is
    no readout the matchers prove (the reason a collected one gets). None otherwise."""
    ht = h[t]
    nxt = set(steps[t + 1]) if t + 1 < L else set()
    exclude = nxt | set(readout)
    second = _uncollected_readout(ht, exclude, state_roles, L, disc)
    if isinstance(second, torch.fx.Node):
        first = f" besides its readout {readout[-1].name}" if readout else ""
        return (f"state h_{t} is read out twice: {second.name} is a second contraction Σ_n h_{t}·C{first}; the op "
                "reads each state out once, through one C, and returns no states for another readout")
    if readout or t:
        return None
    # The per-step output: the values computed from h_t but from no later state, that a value
    # computed from a later state (a running sum, a cat grown step by step) or an output reads.
    later = set().union(*_levels_after(h[t + 1], set(), len(pos)))
    region = set()
    for level in _levels_after(ht, exclude | later, 32):
        region.update(level)
    outs = sorted((n for n in region if any(u not in region for u in n.users)), key=pos.__getitem__)
    if not outs:
        return None
    rregion = _between(ht, outs[0], pos)
    if rregion is None:
        return None
    found = _match_readout(outs[0], ht, rregion, h, state_roles, L, disc, pos)
    return found if isinstance(found, str) else None


def _repeat_readout(rregion: list[torch.fx.Node], h0: torch.fx.Node, y0: torch.fx.Node, h: list[torch.fx.Node],
                    L: int) -> tuple[list[list[torch.fx.Node]], list[torch.fx.Node]] | tuple[str, None]:
    """Every step's copy of step 0's readout region (shifted by t) and its output y_t."""
    readouts = [rregion]
    ys = [y0]
    for t in range(1, L):
        bind = {h0: h[t]}
        missing = _walk(rregion, bind, t)
        if missing is not None:
            return f"step {t}'s readout does not repeat step 0's (no copy of {missing})", None
        readouts.append([bind[n] for n in rregion])
        ys.append(bind[y0])
    return readouts, ys


def _match_readout_with_tail(y0: torch.fx.Node, h0: torch.fx.Node, rregion: list[torch.fx.Node],
                             h: list[torch.fx.Node], state_roles: tuple[str, ...], L: int, disc: Discretized, pos
                             ) -> tuple[Source, torch.fx.Node, Collected, list[list[torch.fx.Node]]] | str | None:
    """The collected y_t is not the contraction itself but a function of it that reads the state
    only through it (``y = C_t·h_t + D*u_t``, ``silu(z_t)`` gates, scales written inside the loop):
    find ``r_0 = Σ_n h_0 · C_full[t=0]`` on the way to y_0. Only each r_t is replaced (by the op's
    output at time t); the user's code after it stays, so nothing about it needs proving beyond
    that h_t reaches it through r_t alone. None when no such r_0 exists, a reason when C_full
    is not provably long enough."""
    for r0 in rregion:
        if r0 is y0:
            continue
        proved = _match_contraction(r0, h0, state_roles, L, disc)
        if isinstance(proved, str):
            continue
        c_src, c_base, r_roles = proved
        if None in r_roles:
            continue
        sub = _between(h0, r0, pos)
        if sub is None:
            continue
        inner = set(sub) - {r0}
        # Past r_0, nothing may read the state or a partial readout of it: h_0 reaches y_0 only
        # through r_0, so replacing r_0 by the op's value is exact whatever follows.
        if any(a in inner or a is h0 for n in rregion if n not in sub for a in n.all_input_nodes):
            continue
        readouts, rs = _repeat_readout(sub, h0, r0, h, L)
        if isinstance(readouts, str):
            return None
        short = _c_too_short(c_src, L)
        if short is not None:
            return short
        out = Collected("per-step", r0, [], [], tuple(r_roles) + ("t",), rs)
        return c_src, c_base, out, readouts
    return None


def _time_len(src: Source):
    """The length of ``src``'s time axis (an int or a SymInt)."""
    return val(src.node).shape[src.roles.index("t")]


def _sources_too_short(disc: Discretized, L: int) -> str | None:
    """Why u, Δ or B (the op's sources, read through their first L steps) may be too short."""
    for name, src in (("u", disc.u), ("delta", disc.delta), ("B", disc.B)):
        if "t" in src.roles:
            short = _too_short(name, _time_len(src), L)
            if short is not None:
                return short
    return None


def _c_too_short(c_src: Source, L: int) -> str | None:
    # Checked once every step's readout is known to repeat step 0's: a C read at a fixed time is
    # reported as that, not as a length it could not be proven to have. A time-invariant C has
    # no time axis to be short.
    return _too_short("C_full", _time_len(c_src), L) if "t" in c_src.roles else None


def _detached_state_note(y0: torch.fx.Node, h0: torch.fx.Node) -> str:
    """Why a readout reads as no contraction with h_t when it contracts ``h_t.detach()`` (probe BP):
    the note ``detach_note`` gives, or empty. (A readout is a few nodes deep: the walk down from
    the detach stops after 6.)"""
    for d in h0.users:
        if not detach_note(d):
            continue
        level = {d}
        for _ in range(6):
            if y0 in level:
                return detach_note(d)
            level = {u for n in level for u in n.users}
    return ""


def _match_contraction(y0: torch.fx.Node, h0: torch.fx.Node, state_roles: tuple[str, ...], L: int,
                       disc: Discretized) -> tuple[Source, torch.fx.Node, list[str | None]] | str:
    """Prove ``y0 = Σ_n h_0 · C_full[t=0]``. Returns (C source, C_full, roles of y0's axes)."""
    rt = index_term(y0, stop=[h0], allow_sum=True)
    if rt is None or len(rt.factors) != 2 or not any(f.node is h0 for f in rt.factors):
        return NOT_A_CONTRACTION
    fh = next(f for f in rt.factors if f.node is h0)
    fc = next(f for f in rt.factors if f is not fh)
    role = dict(zip(rt.factor_labels(fh), state_roles))
    if len(role) != 3:
        return "the readout indexes h_t on a diagonal"
    n_lab = next(lab for lab, r in role.items() if r == "n")
    if rt.summed_labels() != {n_lab}:
        return "the readout does not sum over exactly the state axis"
    c_slice = time_slice(fc.node)
    if c_slice is None:
        if _negative_index(fc.node):
            # time_slice normalises a negative index only against a concrete length.
            return ("the readout's C_t at step 0 counts from the end of a time axis of symbolic length "
                    "(C[..., t-k]?): which step it reads is not known")
        c_labels = rt.factor_labels(fc)
        if not all(lab in role for lab in c_labels):
            return "the readout's C_t is not a time slice of one tensor"
        c_roles = [role[lab] for lab in c_labels]
        if "b" in c_roles:
            # A (dim, N) C built from the state is refused later, per step, with the reason below;
            # a per-batch one ends here, so it gets that reason here (probe AT, run 51).
            if _computed_from(fc.node, h0):
                return (f"the readout's C at step 0 ({fc.node.name}) has no time axis but is computed from the "
                        "loop's own values (the state h_0): the readout is not linear in the state")
            if sorted(c_roles) != ["b", "n"]:
                # Only step 0 is seen here: a C computed per step from other values (the previous
                # step's readout, probe CX) has no time slice either.
                return (f"the readout's C at step 0 ({fc.node.name}, indexed by {c_roles}) is no time slice of "
                        "one tensor: read as the same C at every step, ssm.selective_scan takes a C without "
                        "a time axis only as (dim, state), (state) or (batch, state); a C computed anew at "
                        "every step from other values is no C the op reads")
        if len(set(c_roles)) != len(c_roles) or "n" not in c_roles:
            return f"the readout's time-invariant C ({fc.node.name}) is indexed by {c_roles}, not (dim, state)"
        # The same C at every step, (dim, N) or (N,) (mamba_ssm's is_variable_C=False), or one per
        # batch element, (batch, N): ``mutated`` in match_loop makes sure nothing writes it between
        # the steps.
        y_roles = _readout_roles(rt, role, y0)
        return y_roles if isinstance(y_roles, str) else (view_source(fc.node, c_roles), fc.node, y_roles)
    c_base, _, c_idx = c_slice
    if c_idx != 0:
        # Only step 0 is seen here: C[..., t+k], C[..., t-1] (index L-1 at step 0) and a C read
        # at one fixed time look alike.
        return (f"the readout of h_0 reads C at time index {c_idx}, not 0: a readout of C at time t{c_idx:+d} "
                "(lagged readout) does, and so do C[..., t-k] wrapping around, C read in reverse time "
                "(C[..., L-1-t]), a C read at one fixed time, a packed sequence's C[..., start+t] and a readout "
                "of the state before its update (C[t] with h_(t-1)). A C sliced to the loop's steps first "
                "(C[..., start:end], read at t) is read at time t")
    leaf_roles = [role.get(lab) for lab in rt.factor_labels(fc)]
    c_roles = ["t" if o is None else leaf_roles[o] for o in parse_slice(fc.node)[3]]
    if None in c_roles:
        # A size-1 axis inserted before the loop (``Cs = C.mT.unsqueeze(1)`` read as ``Cs[:, :, t]``):
        # the tensor it was inserted into has the real axes.
        c_base, c_roles = _without_unit_axes(c_base, c_roles)
    if None in c_roles:
        # A size-1 axis C_t broadcasts along (one C for the whole batch, or for every state): the
        # op reads C with real (batch, state) axes, and sorting the roles would compare None.
        return f"C_t broadcasts along a size-1 axis (axis roles {c_roles}); the op needs C as (batch, state, time)"
    if sorted(c_roles) == ["b", "d", "n", "t"]:
        c_src = grouped_source(c_base, c_roles)
    elif sorted(c_roles) == ["b", "n", "t"]:
        c_src = view_source(c_base, c_roles)
    else:
        shared = ""
        if "d" not in disc.A.roles and "d" in leaf_roles and "b" not in leaf_roles:
            # (Probe CI, run 61: B read along the channels made the reading that swaps Δ's axes the
            # one proved, and C, indexed as Mamba's, was then blamed alone.)
            shared = (" (A has only a state axis, so Δ's batch and channel axes were told apart by u and B: "
                      "the axis C reads by is the one they read as the channels; B or C is not indexed as "
                      "(batch, state))")
        return f"C_t must be indexed by (batch, state), got {leaf_roles}{shared}"
    y_roles = _readout_roles(rt, role, y0)
    return y_roles if isinstance(y_roles, str) else (c_src, c_base, y_roles)


def _computed_from(node: torch.fx.Node, h0: torch.fx.Node, limit: int = 64) -> bool:
    """``node``'s value is computed from ``h0`` within ``limit`` nodes upstream: a readout factor
    built from the state (``C[:, :, t] + h.mean(1)``), which no time-invariant or per-step C can
    be. A dtype or shape read off the state (``C.type_as(h)``) is not its value."""
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack and len(seen) < limit:
        n = stack.pop()
        if n is h0:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(data_inputs(n))
    return False


def _without_unit_axes(node: torch.fx.Node, roles: list[str | None]) -> tuple[torch.fx.Node, list[str | None]]:
    """``node`` and its axis ``roles`` (None: a size-1 axis), looked through the views that
    inserted its size-1 axes (``x.unsqueeze(1)``, ``x[:, None]``) to the tensor without them;
    unchanged where a None axis is not size 1 or was not inserted by a view."""
    shape = shape_of(node)
    if shape is None or any(r is None and not statically_known_true(shape[i] == 1) for i, r in enumerate(roles)):
        return node, roles
    t = index_term(node)
    if t is None or t.summed or len(t.factors) != 1:
        return node, roles
    out, leaf = t.out_labels(), t.factor_labels(t.factors[0])
    role = dict(zip(out, roles))
    if len(set(out)) != len(out) or len(set(leaf)) != len(leaf) or not set(leaf) <= set(out) \
            or any(role[lab] is not None for lab in out if lab not in leaf):
        return node, roles
    return t.factors[0].node, [role[lab] for lab in leaf]


def _readout_roles(rt, role: dict, y0: torch.fx.Node) -> list[str | None] | str:
    """The roles of the readout y0's axes (None: a size-1 axis), which must be (batch, dim)."""
    y_roles = []
    for lab, size in zip(rt.out_labels(), val(y0).shape):
        r = role.get(lab)
        if r is None and not statically_known_true(size == 1):
            return "the readout output has an axis that is not batch or dim"
        y_roles.append(r)
    if sorted(r for r in y_roles if r) != ["b", "d"]:
        return "the readout output is not indexed by (batch, dim)"
    return y_roles


def _match_stacked_readout(stacked: torch.fx.Node, h: list[torch.fx.Node], state_roles: tuple[str, ...], L: int
                           ) -> tuple[Source, Collected, list[torch.fx.Node]] | str:
    """The states themselves are stacked (``hs = torch.stack(hs, dim=1)``) and read out after the
    loop, ``y = (hs @ C.unsqueeze(-1)).squeeze(3)``: the readout is proved on the stacked tensor as
    for the associative scan's states, and ``hs[:, -1]`` is the last state.

    Returns (C source, the collection with ``out_node`` the readout, the last-state views).
    """
    backwards = len(h) > 1 and list(stacked.args[0]) == h[::-1]
    if list(stacked.args[0]) != h and not backwards:
        return "the stacked states are not every step's state, once, in the loop's order or its reverse"
    dim = stacked.args[1] if len(stacked.args) > 1 else stacked.kwargs.get("dim", 0)
    if not isinstance(dim, int):
        return "the states are stacked along a non-constant axis"
    roles = list(state_roles)
    roles.insert(dim % (len(roles) + 1), "t")
    return _readout_of_states(stacked, tuple(roles), L, [stacked], backwards)


def _readout_of_states(states: torch.fx.Node, roles: tuple[str, ...], L: int, collecting: list[torch.fx.Node],
                       backwards: bool = False) -> tuple[Source, Collected, list[torch.fx.Node]] | str:
    """The one readout of all the states (and the last-state views) after the loop, on the
    tensor that holds them (``states``, with axis ``roles``), which ``collecting`` fills:
    (C source, the collection with ``out_node`` the readout, the last-state views).

    ``backwards``: the loop's step s stored its state at slot L-1-s (a reverse walk's states put
    back in time order, ``hs.insert(0, h)``, read forward over the flipped tensors). The readout
    at slot p is then the op's y at step L-1-p with C read at p: the op reads C flipped in time
    and its y is flipped back (``Collected.reversed_time``)."""
    producers = frozenset(c for c in collecting if c is not states)
    users = split_state_users(states, roles, roles.index("t"), L, producers=producers)
    if isinstance(users, str):
        return users
    readout, last_views = users
    if backwards and last_views:
        return (f"the states are stored last step first (a reverse walk's states kept in time order), and "
                f"{last_views[0].name} reads their slot at time index L-1, which holds the walk's first state: the "
                "op returns only its last")
    c_src = Source(readout.C, readout.C_roles)
    if "t" in c_src.roles and not _same_size(_time_len(c_src), L):
        return "C_full's time axis does not have the loop's length"
    erased = [*collecting, *last_views, *readout.chain, *readout.nodes, readout.end]
    out = Collected("states", readout.end, list(readout.end.users), list(dict.fromkeys(erased)), readout.out_roles,
                    reversed_time=backwards)
    return c_src, out, last_views


def _state_buffer_writes(h: list[torch.fx.Node], pos
                         ) -> tuple[torch.fx.Node, int, tuple, list[torch.fx.Node], bool] | str | None:
    """The states written into a preallocated buffer, ``H[:, :, t] = h`` (or ``H[:, :, t].copy_(h)``)
    each step (``_buffer_slots``), a reason when some state is written but not as one slot per
    step, or None when h_0 is not written into a buffer at all. The last item says whether step t
    wrote slot L-1-t (a reverse walk read over the flipped tensors, storing its states in time
    order)."""
    if not any(_collects(u, h[0]) and not is_call(u, *_COLLECTORS) for u in h[0].users):
        return None
    stored = []
    for t, ht in enumerate(h):
        found = [u for u in ht.users if _collects(u, ht) and not is_call(u, *_COLLECTORS)]
        if len(found) != 1:
            return f"state h_{t} is not written into the states' buffer exactly once"
        stored.append((ht, found[0]))
    slots = _buffer_slots(stored, pos, "the states' buffer", "state h_{t}")
    backwards = False
    if isinstance(slots, str) and len(h) > 1:
        flipped = _buffer_slots(stored, pos, "the states' buffer", "state h_{t}", backwards=True)
        slots, backwards = (flipped, True) if not isinstance(flipped, str) else (slots, False)
    if isinstance(slots, str):
        return slots
    if val(slots[0]).dtype != val(h[0]).dtype:
        # A write into a narrower buffer rounds every state; the op would not.
        return f"the states' buffer is {val(slots[0]).dtype}, the states {val(h[0]).dtype}"
    return (*slots, backwards)


def _match_buffered_readout(buffered, state_roles: tuple[str, ...], L: int
                            ) -> tuple[Source, Collected, list[torch.fx.Node]] | str:
    """The states written into a buffer and read out after the loop: as for stacked states, the
    readout is proved on the buffer, whose only other users are the writes."""
    buf, axis, axis_map, writes, backwards = buffered
    if any(o is not None and not 0 <= o < len(state_roles) for o in axis_map):
        return "the states' buffer has axes the state does not have"
    roles = tuple("t" if o is None else state_roles[o] for o in axis_map)
    if sorted(r for r in roles if r != "t") != sorted(state_roles) or len(roles) != len(state_roles) + 1:
        return "the states' buffer's axes do not match the state's"
    return _readout_of_states(buf, roles, L, writes, backwards)


def _lagged_step(products: list[tuple[torch.fx.Node, Any, Any]], key0: tuple, state: torch.fx.Node,
                 t: int) -> str | None:
    """The lag reason when step ``t``'s product of the decay (step 0's shifted by ``t``) and the
    state before it has an input term that reads another time index than ``t``; else None."""
    for m, p, q in products:
        for a, x in ((p, q), (q, p)):
            if x is state and isinstance(a, torch.fx.Node) and _leaf_key(a, t) == key0:
                lagged = sorted(i for i in _addend_indices(m) if i != t)
                if lagged:
                    return _lag_reason(lagged[0], t)
    return None


def _of_one_step(node: Any, index: int, depth: int = 0) -> bool:
    """``node`` is computed, through at most a few ops, from time slices at ``index`` only (a view
    or product of the same step's inputs, such as ``delta[:, :, t].unsqueeze(-1)``): no state."""
    ts = time_slice(node)
    if ts is not None:
        return ts[2] == index
    if depth >= 3 or not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    inputs = node.all_input_nodes
    return bool(inputs) and all(_of_one_step(a, index, depth + 1) for a in inputs)


def match_loop(anchor: torch.fx.Node, a0: torch.fx.Node, H: torch.fx.Node,
               products: _Products, pos) -> LoopMatch | str | None:
    """Try to prove that the recurrence anchored at ``anchor`` = ``a0 * H`` is a selective scan.

    Returns the match, a reason string, or None when ``a0 * H`` does not even start a chain
    of steps (an ordinary product, not worth a miss record).
    """
    key0 = _leaf_key(a0, 0)
    per_step = key0[0] == "op"
    first = _key_slices(key0)[0]
    base, axis = first[1].node, first[2]
    # The loop has as many steps as the sliced tensor's time axis is long; when that length is a
    # symbol (a tensor the loop indexes but does not range over, after dynamo's recompile at a
    # new length), the steps are counted below instead, and every source is checked to be long
    # enough for them.
    length = val(base).shape[axis]
    L = int(length) if is_concrete_int(length) else None
    if L is not None and L < 2:
        # Worth a miss only when the "decay" is an exp, as a decode step's is: a product of any
        # slice with a size-1 axis (x[:, 0] * rsqrt(...) in a norm) is not a step of anything.
        return ONE_STEP if exp_behind(a0) or exp_behind(base) else None
    # h_0 is what step 1's multiplier (α_0 with every time index + 1) multiplies, computed from
    # this anchor (two loops from one H and one α_0 slice have two anchors, each its own h_0).
    # Of several such products, the state nearest H is this loop's: a second loop started from
    # the anchor's state (a reverse loop) also multiplies its own state by α_1, many steps on.
    def step_one_state(source: torch.fx.Node, shift: int = 1) -> torch.fx.Node | None:
        found = None
        for _, p, q in products:
            for a1, x in ((p, q), (q, p)):
                if (isinstance(a1, torch.fx.Node) and isinstance(x, torch.fx.Node) and pos[x] > pos[H]
                        and (found is None or pos[x] < pos[found]) and _may_have_key(a1, key0)
                        and products.leaf_key(a1, shift) == key0
                        and (x is source or _between(source, x, pos) is not None)):
                    found = x
        return found

    def strided_steps() -> str | None:
        # Step 1 found k > 1 indices on: range(start, L, k) (probe, run 51: this read as "no state chain").
        stride = next((k for k in (2, 3, 4) if step_one_state(anchor, k) is not None), None)
        if stride is None:
            return None
        return (f"the loop steps through time {stride} indices at a time (range(start, L, {stride})?, or each step "
                f"reads the state from {stride} steps back: hp, h = h, A_full[t] * hp + B_full[t]): the next "
                f"step's multiplier reads every time index + {stride}, so the recurrence skips time steps, and "
                "ssm.selective_scan scans every step")

    h0 = step_one_state(anchor)
    if h0 is None and step_one_state(H) is not None:
        # H's chain goes on through another product (this one is a readout's h_t * C[t], say),
        # whose own anchor proves or refuses it.
        return None
    if h0 is None:
        # (A decay of one value per channel, A (dim, 1), has size 1 along the states.)
        if per_step and not (is_exp(a0) and isinstance(val(H), torch.Tensor)
                             and _unit_broadcast(val(a0).shape, val(H).shape)):
            return None
        if per_step:
            if _made_by_step_key(H, key0, depth=3):
                return _REVERSE_SCAN
            strided = strided_steps()
            if strided is not None:
                return strided
            flipped = _flip_in_every_step(a0)
            if flipped is not None:
                return flipped
            if _of_one_step(H, first[3]) and written_in_place(H.graph, [H]) is None:
                # exp(k[:, t]) * v[:, t] (RWKV-4's e^k·v): two of one step's inputs, no state, so
                # no chain to miss; the loop's real anchor, if any, gives its own reason (probe DB:
                # "no state chain" was said of it). A slice written in place is a state kept in a
                # caller's buffer (Zamba's cache[:, head], which the decode pass takes up).
                return None
            # exp(...) of time slices multiplying a state-shaped value looks like a step; say why
            # it is not one (e.g. a loop-invariant value such as -A recomputed in every step is a
            # different node per step, and only time slices are compared shifted).
            return NO_STEP_CHAIN
        sa, sh = time_slice(a0), time_slice(H)
        if sa is not None and _made_by_step_at(H, sa[0], sa[1], 1, depth=3) is not None:
            return _reverse_walk_reason(_reverse_walk_start(H, sa[0], sa[1]), 0, val(sa[0]).shape[sa[1]])
        # (Not for a time axis of 2: an in-place parallel scan's pairs, Xa[..., 1] += Aa[..., 1] *
        # Xa[..., 0], look the same, and are scan_inplace's to explain.)
        if sa is not None and sh is not None and {sa[2], sh[2]} == {0, 1} and (L is None or L > 2):
            # ``_rewrite_one`` writes step 0 out and proves the loop from there (``_write_first_step``).
            return _PEELED
        if sh is not None or (sa is not None and _of_one_step(H, sa[2])):
            # A product of two time slices (B̄[t] * x[t] inside a step, or Δ[t].unsqueeze(-1) *
            # B[t]): no state to chain. The loop's real anchor, if any, gives its own reason.
            return None
        return strided_steps() or _NO_CHAIN
    region = _between(H, h0, pos)
    if L is None:
        L = _count_steps(region, H, h0)
        short = _too_short("the first step's sliced tensor", length, L)
        if short is not None:
            return short
    Hs = sympy.Symbol("H")
    try:
        env, leaves = _sym_eval(region, H, Hs)
    except _NotElementwise as e:
        return f"the state update uses an op that is not an elementwise add/mul ({e})"
    except _StateTerms as e:
        return f"the state update {e}"
    f = sympy.expand(env[h0])
    alpha = sympy.expand(sympy.diff(f, Hs))
    beta = sympy.expand(f.subs(Hs, 0))
    if Hs in alpha.free_symbols or sympy.expand(f - alpha * Hs - beta) != 0:
        return "the state update is not linear in the previous state"
    if alpha not in leaves or beta not in leaves:
        # In the graph's names, not the proof's leaf symbols (probe BY: "h*(leaf0) + (-leaf1)").
        named = {sym: sympy.Symbol(_leaf_name(node)) for sym, node in leaves.items()}
        return (f"the state update is h*({alpha.xreplace(named)}) + ({beta.xreplace(named)}); expected "
                "A_full[t]*h + B_full[t] with two time slices")
    a_leaf, b_leaf = leaves[alpha], leaves[beta]
    shape = val(h0).shape
    # A_full[t] may have size 1 along an axis where the state is wider: the proof below then reads
    # it as exp(Δ·A) with A's state axis broadcast (``_A_along_states``). Along the batch or channel axes it is no
    # such decay: Δ would lack an axis that B_full has, and the proof fails.
    if not _same_shape(val(b_leaf).shape, shape) or not _unit_broadcast(val(a_leaf).shape, shape):
        return "the state update broadcasts: A_full[t], B_full[t] and h_t differ in shape"
    if _leaf_key(a_leaf, 0) != key0:
        return _NOT_THE_ANCHOR
    # Each coefficient is a time slice of a precomputed tensor (A_full, B_full) or computed in
    # the step from time slices (exp(Δ[t]·A), Δ[t]·B[t]·u[t]); the two may differ (a per-step
    # exp with a precomputed Δ·B·u saves the (batch, dim, L, N) decay, or the other way round).
    a_base = b_base = None
    b_slice = time_slice(b_leaf)
    if b_slice is not None:
        b_base, b_axis, b_idx = b_slice
        if b_idx != 0:
            return (f"the step that multiplies h by A_full at time index 0 adds B_full at time index {b_idx}, not 0: "
                    "the decay and the input term read different steps (one of them lags the other, or the input "
                    "term is added before the decay multiplies it: h = A_full[t] * (h + B_full[t]))")
        if val(b_base).dim() != 4:
            return "B_full is not a 4-D tensor"
    if per_step:
        if b_base is not None:
            short = _too_short("B_full", val(b_base).shape[b_axis], L)
            if short is not None:
                return short
            disc = match_step_decay_full_input(a_leaf, time_prefix_source(b_base, b_axis), b_axis)
        else:
            disc = match_step_discretization(a_leaf, b_leaf)
        if isinstance(disc, str):
            return f"discretization: {disc}"
        disc, t0 = disc
        if t0 != 0 and b_base is not None:
            # exp(Δ[min(t + 1, L - 1)]·A) * h + dBu[t]: the input term reads step 0 (probe BY).
            return _lag_reason(0, t0)
        if t0 != 0:
            return (f"the state update at step 0 reads its inputs at time index {t0}, not 0 (a loop that starts "
                    "late from a state computed before it, e.g. range(1, L) after a first step written out, or a "
                    "state reset): a scan is rewritten when it runs every step from t = 0")
        # The loop's length was read off the first slice's tensor; ``zip(u.unbind(-1),
        # delta.unbind(-1), ...)`` stops at its shortest input, so with sources of known lengths
        # the loop can have no more steps than the shortest: the walk below proves each of them.
        known = [int(n) for n in (_time_len(src) for src in (disc.u, disc.delta, disc.B) if "t" in src.roles)
                 if is_concrete_int(n)]
        if known and 2 <= min(known) < L:
            L = min(known)
        short = _sources_too_short(disc, L)
        if short is not None:
            return short
    else:
        a_base, a_axis = base, axis
        if b_base is None:
            # Proved at step 0, before the walk, so that an input term read at another time
            # (u[t - 1]) is named as such rather than as a step that does not repeat.
            disc = match_full_decay_step_input(time_prefix_source(a_base, a_axis), a_axis, b_leaf, 0)
            if isinstance(disc, str):
                return f"discretization: {disc}"
    init = None
    if not is_zeros(H):
        if not isinstance(val(H), torch.Tensor) or not _broadcasts_to(val(H).shape, shape):
            got = tuple(val(H).shape) if isinstance(val(H), torch.Tensor) else type(val(H))
            return f"initial state shape {got} does not broadcast to the state shape {tuple(shape)}"
        init = H

    # Every later step must repeat step 0 with time indices shifted by t.
    steps = [region]
    h = [h0]
    # The tensors whose time slices step 0 reads: A_full, or, when the step discretises, the
    # bases of its two coefficients' slices (Δ, u, B).
    read = ({(a_base, a_axis)} if a_base is not None else
            {(s[1].node, s[2]) for leaf in (a_leaf, b_leaf) for s in _key_slices(_leaf_key(leaf, 0))})
    for t in range(1, L):
        bind = {H: h[-1]}
        missing = _walk(region, bind, t)
        if missing is not None:
            if t >= 2 and read and all(_reads_from_step(b, ax, 1) and not _reads_from_step(b, ax, t)
                                       for b, ax in read):
                # Nothing reads those tensors at step t or later: the loop covers the first t
                # steps only (``range(L - 3)``). The op reads its sources' first t steps through
                # narrowed views; the collection below must hold exactly these t outputs. (A
                # skipped or reset step still reads them later, and keeps this reason.) Each must
                # be read at step 1 as well: a base that every step recomputes (``delta.float()``
                # in the step) is another node in each, and says nothing about later steps.
                L = t
                break
            later = next((b for b, ax in read if _reads_from_step(b, ax, t)), None) if t >= 2 else None
            tail = (f"; a loop over the first {t} steps only is rewritten when nothing reads its stepped inputs "
                    f"at step {t} or later, and {later.name} is read there or as a whole"
                    if later is not None else "")
            lag = _lagged_step(products, key0, h[-1], t)
            if lag is not None:
                # u[max(t - 1, 0)] or dBu[max(t - 1, 0)]: step 0 reads both at 0, step 1 no longer
                # pairs them (probe BY: "no copy of h_1" said nothing of the lag).
                return lag
            rounding = next((n for n in region if is_cast(n) and not is_lossless_cast(dtype_of(n.args[0]), dtype_of(n))),
                            None)
            if rounding is not None:
                # A rounding of the state between its uses (h.bfloat16().float() before the
                # product) puts the step's boundary at the cast, and the last step has none after
                # it: the walk's failure, but not the reason the loop stays (probe BM, run 54).
                return (f"the state is rounded at every step ({rounding.name}: {dtype_of(rounding.args[0])} to "
                        f"{dtype_of(rounding)}): ssm.selective_scan keeps its state unrounded, so it would not "
                        "make this rounding")
            return f"step {t} does not repeat step 0's state update (no copy of {missing}){tail}"
        steps.append([bind[n] for n in region])
        h.append(bind[h0])

    # Readout: per step (the first value after h_0 that a stack/cat collects), or of all the
    # states at once after the loop, when the states themselves are stacked.
    stacked = next((c for c in h0.users if is_call(c, torch.stack) and _collects(c, h0)), None)
    buffered = _state_buffer_writes(h, pos) if stacked is None else None
    if isinstance(buffered, str):
        return buffered
    step1 = set(steps[1])
    # No readout at all: a loop that only carries the state to its end (a prefill that fills a
    # cache, a chunk's state). The op then reads out nothing the program uses, and its last
    # state stands for h_{L-1}; the checks below still prove that no earlier state or step value
    # is used outside the recurrence.
    last_only = False
    if stacked is None and buffered is None:
        y0 = _find_readout(h0, step1)
        last_only = y0 is None
        if not last_only:
            rregion = _between(h0, y0, pos)
            if rregion is None or step1.intersection(rregion):
                return "the readout of step 0 depends on a later state"
    if not per_step:
        if b_base is not None:
            # Checked at the loop's own length, which the walk above may have found shorter than
            # A_full's time axis (``range(L - 3)``).
            short = _too_short("B_full", val(b_base).shape[b_axis], L)
            if short is not None:
                return short
            disc = match_discretization(time_prefix_source(a_base, a_axis), time_prefix_source(b_base, b_axis),
                                        (a_axis, b_axis))
        if isinstance(disc, str):
            return f"discretization: {disc}"
        # Equal to A_full's length wherever it is concrete; checked for the op's narrowed reads.
        short = _sources_too_short(disc, L)
        if short is not None:
            return short
    state_roles = tuple(r for r in disc.a_roles if r != "t")
    if last_only:
        # A readout whose outputs no stack, cat or buffer collects (summed over time, written
        # with ``select_scatter``): found as the contraction itself, then replaced step by step.
        y0 = _uncollected_readout(h0, step1, state_roles, L, disc)
        if isinstance(y0, str):
            return y0
        if y0 is not None:
            rregion = _between(h0, y0, pos)
            if rregion is None or step1.intersection(rregion):
                return "the readout of step 0 depends on a later state"
            last_only = False
    if stacked is not None or buffered is not None:
        found = (_match_stacked_readout(stacked, h, state_roles, L) if stacked is not None
                 else _match_buffered_readout(buffered, state_roles, L))
        if isinstance(found, str):
            return found
        c_src, out, last_views = found
        c_base = c_src.node
        readouts = [[] for _ in range(L)]
        states, collecting = (stacked, [stacked]) if stacked is not None else (buffered[0], buffered[3])
        if mutated(states, ignore=frozenset(collecting)):
            # Through a last-state view, say: the op returns no states tensor to write.
            return "the states' tensor is written in place after the loop (through itself or a view of it)"
        if last_views and mutated(h[-1]):
            # The states' last slot and h_L are two tensors in the loop; the op's last state
            # would stand for both, and a write to one would show in the other.
            return "the last state is written in place after the loop, and the states' last slot is read too"
    elif last_only:
        c_src = c_base = None
        out = Collected("last state only", h[-1], [], [], ("b", "d", "t"))
        readouts = [[] for _ in range(L)]
        last_views = []
    else:
        found = _match_readout(y0, h0, rregion, h, state_roles, L, disc, pos)
        if isinstance(found, str):
            return found
        c_src, c_base, out, readouts = found
        last_views = []

    # Nothing inside the loop may be used from outside, except the last state.
    collected_states = {stacked} if stacked is not None else set(buffered[3]) if buffered is not None else set()
    for t in range(L):
        allowed = set(steps[t]) | set(readouts[t]) | (set(steps[t + 1]) if t + 1 < L else set()) | collected_states
        for n in steps[t]:
            if t == L - 1 and n is h[t]:
                continue
            outside = [u for u in n.users if u not in allowed]
            if outside:
                what = f"intermediate state h_{t}" if n is h[t] else f"a value of step {t}"
                written = _written_in_place(n)
                if written is not None:
                    # A write the in-place pass could not take out of place (to a view, a part,
                    # or one that autograd must see): a partial reset or a nonlinear update.
                    op = written.target if isinstance(written.target, str) else getattr(
                        written.target, "__name__", str(written.target))
                    return (f"{what} is written in place ({op} at {written.name}, on "
                            f"{'it' if written.args[0] is n else 'a view of it'}): a reset or an update that "
                            "is not h = A_full[t]*h + B_full[t], which the scan passes do not rewrite")
                if n is h[t]:
                    why = _state_use_reason(h, steps, readouts[t], t, state_roles, L, disc, pos)
                    if why is not None:
                        return why
                return f"{what} is used outside the recurrence"
        for n in readouts[t]:
            if out.step_readouts and n is out.step_readouts[t]:
                continue
            if any(u not in readouts[t] and u not in out.writes for u in n.users):
                return f"step {t}'s readout value is used outside the loop"
    loop_nodes = set().union(*steps, *readouts)
    last_users = [u for u in h[-1].users if u not in loop_nodes and u not in collected_states]
    if last_only and not last_users:
        return "no per-step readout of the state is collected by stack/cat, the states are not stacked, and the last state is not used"

    # A, and a B or C without a time axis, are read once by the op: each must be one value for
    # every step. The walk matches a per-step computation on time slices (``C + u[:, :, t].mean(0)``,
    # ``sigmoid(B * u[:, :, t].mean(0))``) step by step, and a C read off the state
    # (``h.detach().mean(0)``) as part of the readout: neither is time-invariant (probe AG).
    for name, node in (("A", disc.A.node), ("B", disc.B.node), ("C", c_base)):
        if name == "C" and c_src is None:
            continue
        if name != "A" and (name == "B" and not disc.time_invariant_B or name == "C" and "t" in c_src.roles):
            continue
        varies = _varies_per_step(node, loop_nodes, L)
        if varies is not None:
            return ("the readout's C" if name == "C" else f"{name}") + (
                f" ({node.name}) has no time axis but {varies}: it is not one value for every step, "
                f"which is how ssm.selective_scan reads a{'n' if name == 'A' else ''} {name} without one"
                + detach_note(node))

    # The op reads its inputs once, where it is placed; a value mutated in place anywhere would
    # make that read differ from what the loop saw.
    sources = {"u": disc.u.node, "delta": disc.delta.node, "A": disc.A.node, "B": disc.B.node}
    if c_base is not None:
        sources["C"] = c_base
    sources.update({name: node for name, node in (("A_full", a_base), ("B_full", b_base)) if node is not None})
    if init is not None:
        sources["initial state"] = init
    # A write after the whole loop (``x.mul_(2)`` once the scan is done) comes after every read
    # the loop and its discretisation make, and after the op's own read (placed after its last
    # input, checked where the op is emitted): it changes nothing the op reads.
    walks: dict = {}
    # (A stack or cat of the per-step outputs reads no input; Python evaluates ``return
    # torch.stack(ys), ...`` after statements that follow the loop.)
    last_read = max(pos[n] for n in (*loop_nodes, *disc.nodes, *out.writes) if not is_call(n, *_COLLECTORS))
    late_writes: list[torch.fx.Node] = []

    def early_write(node):
        # (A view of a source made after the source's fills, ``u.unsqueeze(-1)``, shares the memory
        # written before it: only writes at or after a node's own place count.)
        writes = sorted((w for w in _writes((node,), frozenset(), walks) if pos[w] >= pos[node]), key=pos.__getitem__)
        late_writes.extend(w for w in writes if pos[w] > last_read)
        return next((w for w in writes if pos[w] <= last_read), None)

    for name, node in sources.items():
        early = early_write(node)
        if early is not None:
            # The walk follows shared memory: B and C split from one x_proj output are both
            # "mutated" when either is written, so the message says it may be through another view.
            return (f"{name} is mutated in place (it, or a view sharing its memory, is written by {early.name} "
                    f"after {node.name} is made, before the loop's last read)")
    if any(early_write(n) is not None for n in disc.nodes):
        return "a value between the sources and A_full/B_full is mutated in place"
    # The loop may read a source through a copy the passes look through (``A = A.clone()``) that
    # is written in place between steps, while the op reads the source itself once.
    if any(early_write(n) is not None for n in read_through(sorted(loop_nodes, key=pos.__getitem__),
                                                             set(sources.values()), pos)):
        return "a value the loop reads its inputs through is written in place"
    # Where the op records a backward, it saves its inputs (the initial state too, which
    # recomputes the states), and a later write would reach them: a version-counter error, or,
    # through ``.data``, wrong gradients (probe BR). Eager's loop saves only what each product needs.
    if late_writes and grad_enabled_at(h[0]) and any(
            isinstance(val(n), torch.Tensor) and val(n).requires_grad for n in sources.values()):
        return (f"{late_writes[0].name} writes an input of the scan in place after the loop while gradients are "
                "recorded: the op saves its inputs for its backward, and the write would reach what it saved")
    if val(h[-1]).dtype == torch.float64 and val(disc.u.node).dtype != torch.float64:
        # The op accumulates in float32 unless u is float64: a state the user keeps in float64
        # (for accuracy) would silently lose precision.
        # (Probe CM, run 61: "u is float32" read as false where the loop reads ``u.double()``.)
        return (f"the state is accumulated in float64 but u, where the pass finds it behind lossless casts "
                f"(``u.double()`` is read as u), is {val(disc.u.node).dtype}: the op accumulates in u's dtype, "
                "so it would accumulate in float32")
    wide = float64_readout(out.out_node, disc.u.node)
    if wide is not None:
        return wide
    for name, src in (("u", disc.u), ("delta", disc.delta), ("A", disc.A), ("B", disc.B)):
        if val(src.node).dtype == torch.float64 and val(src.node).device.type != "cpu":
            return f"{name} is float64; ssm.selective_scan has no float64 kernel on {val(src.node).device}"
    return LoopMatch(
        L=L,
        disc=disc,
        state_roles=state_roles,
        init=init,
        C=c_src,
        out=out,
        h_last=h[-1],
        last_users=last_users,
        last_views=last_views,
        loop_nodes=sorted(loop_nodes, key=pos.__getitem__),
        late_writes=list(dict.fromkeys(late_writes)),
    )


# ---------------------------------------------------------------------------------------------
# The rewrite
# ---------------------------------------------------------------------------------------------

def _cast(graph: torch.fx.Graph, node: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    if val(node).dtype == dtype:
        return node
    return _node(graph, "call_method", "to", node, dtype)


def _node(graph: torch.fx.Graph, op: str, target: Any, *args: Any) -> torch.fx.Node:
    n = graph.create_node(op, target, args)
    propagate_val(n)
    return n


def _per_channel(src: Source | None, disc: Discretized) -> bool:
    """``src`` is B or C in the grouped layout with one group per channel (G = dim)."""
    if src is None or "g" not in src.roles:
        return False
    dim = val(disc.u.node).shape[disc.u.roles.index("d")]
    return statically_known_true(val(src.node).shape[src.roles.index("g")] == dim)


def group_layout_refusal(disc: Discretized, C: Source | None, *, flip_C: bool, grad: bool) -> str | None:
    """Why the op cannot read B and C in one grouped layout without a (batch, dim, N, L) tensor
    of its own, or None.

    A per-channel B or C (G = dim, ``grouped_source``) is read as the program has it, but the op
    reads B and C with one G: a B or C shared by the channels then reaches it as a stride-0
    per-channel view, whose gradient the op computes per channel, N values per channel and step.
    A time flip (``Discretized.flip_time``, or ``flip_C``: C read in reversed order) copies a
    per-channel tensor whole. ``grad``: gradients are recorded where the op runs.
    """
    groups = [(name, src, val(src.node).shape[src.roles.index("g")])
              for name, src in (("B", disc.B), ("C", C)) if src is not None and "g" in src.roles]
    if len(groups) == 2 and not statically_known_true(groups[0][2] == groups[1][2]):
        return (f"B is read in {groups[0][2]} groups and C in {groups[1][2]}: ssm.selective_scan reads B and C with "
                "one group count (one of them per channel and the other a group broadcast, or broadcasts of two "
                "group counts)")
    for name, src, _ in groups:
        if not _per_channel(src, disc):
            continue
        if name == "B" and disc.flip_time or name == "C" and flip_C:
            return (f"{name} is per channel (batch, dim, N, L) and read in reversed time: the op would read a "
                    "flipped copy of it, a (batch, dim, N, L) tensor")
        other, other_name = (C, "C") if name == "B" else (disc.B, "B")
        shared = other is not None and "g" not in other.roles and "b" in other.roles
        if shared and grad and val(other.node).requires_grad:
            return (f"{name} is per channel (batch, dim, N, L) and {other_name} is shared by the channels, with "
                    f"gradients recorded: the op reads B and C with one group count, so it would compute "
                    f"{other_name}'s gradient per channel, a (batch, dim, N, L) tensor")
    return None


def emit_selective_scan(
    graph: torch.fx.Graph,
    disc: Discretized,
    C: Source,
    *,
    y_roles: tuple[str, ...],
    y_dtype: torch.dtype,
    initial_state: Source | None = None,
    last_state_roles: tuple[str, ...] | None = None,
    last_state_dtype: torch.dtype | None = None,
    first_state_is_input: bool = False,
) -> tuple[torch.fx.Node, torch.fx.Node | None]:
    """Insert ``ssm.selective_scan`` and the views around it at the graph's insertion point.

    Shared by the scan passes so every form is emitted the same way: inputs as permuted views
    (never copies), y and the last state permuted back to the user's layout and cast to the
    user's dtype.

    Args:
        disc: the proven discretisation (sources of u, Δ, A, B and their axis roles).
        C: C_full and its axis roles (b, n, t in some order; b, g, n, t when grouped; d, n or n
            for a time-invariant C).
        y_roles / y_dtype: layout ("b", "d", "t" in some order; "1" for a size-1 axis) and dtype of
            the output to produce.
        initial_state: h_{-1} and its roles (b, d, n in some order; leading ones may be missing
            and axes may be size 1, broadcast as in the user's update), or None for zeros.
        last_state_roles / last_state_dtype: the layout and dtype of the last state to produce, or
            None when nobody uses it (then return_last_state=False).
        first_state_is_input: the user's first state is B_full[t=0] itself, with no h_{-1} (an
            associative or in-place parallel scan), where the op would compute exp(Δ·A)[t=0]·0 +
            B_full[t=0]: NaN where that decay is infinite. The op then starts from
            h_{-1} = Δ_0·B_0·u_0 with Δ_0 = 0 (a decay of exactly 1 and no input term at t = 0):
            the first state is B_full[t=0] for every value, and the gradients of Δ_0, B_0 and u_0
            flow through h_{-1}. Costs a copy of Δ, so the caller asks for it only where the
            graph does not show the decay finite.

    Returns:
        ``(y, last_state_or_None)``, nodes in the requested layouts and dtypes.
    """
    u = permute_view(graph, disc.u.node, disc.u.perm_to("bdt"))
    if val(u).dtype in HALF_DTYPES and y_dtype != val(u).dtype:
        # The op returns y in u's dtype, and the sources are found through the user's casts: code
        # that upcasts 16-bit inputs and keeps y in fp32 (selective_scan_ref before its final
        # cast, a mixed-precision block) would otherwise get a y rounded to 16 bits, far less
        # accurate than its own. An fp32 copy of u is exact, and the op accumulates in fp32 as
        # before. (fp32 at most: the state is fp32 either way, and there is no fp64 GPU kernel.)
        u = _cast(graph, u, torch.float32)
    delta = permute_view(graph, disc.delta.node, disc.delta.perm_to("bdt"))
    A = _decay(graph, disc.A, u, disc.B)
    if val(A).dtype in HALF_DTYPES:
        # A kept in 16 bits (a model cast to bf16 whose A = -exp(A_log) skips .float()): the op
        # takes an fp32 A. The widening is exact; the op then forms Δ·A in fp32, as it does the
        # rest of the discretisation that such a program rounds to 16 bits.
        A = _cast(graph, A, torch.float32)
    if disc.negate_A:
        A = _node(graph, "call_function", operator.neg, A)
    # A B or C with a batch axis but no time axis is one per batch element: the op reads it as a
    # (batch, N, L) one, the same at every step.
    c_per_step = "t" in C.roles or "b" in C.roles
    if "t" not in C.roles and "b" in C.roles:
        Cv = _per_batch(graph, C, u)
    elif "t" not in C.roles:
        Cv = _time_invariant(graph, C, u)
    else:
        Cv = permute_view(graph, C.node, C.perm_to("bgnt" if "g" in C.roles else "bnt"))
    if disc.flip_time:
        # The loop read exp(Δ·A) and Δ·B·u flipped along time: the op reads their sources so.
        u, delta = (_node(graph, "call_method", "flip", x, (-1,)) for x in (u, delta))
    if disc.time_invariant_B and "b" not in disc.B.roles:
        B = _time_invariant(graph, disc.B, u)
    elif "g" in disc.B.roles:
        B = permute_view(graph, disc.B.node, disc.B.perm_to("bgnt"))
        if disc.flip_time:
            B = _node(graph, "call_method", "flip", B, (-1,))
        if "g" not in C.roles and c_per_step:
            # The op reads B and C in one layout: share C across groups through a stride-0 view.
            groups = _node(graph, "call_method", "size", B, 1)
            C4 = _node(graph, "call_function", operator.getitem, Cv, (slice(None), None))
            Cv = _node(graph, "call_method", "expand", C4, -1, groups, -1, -1)
    else:
        if disc.time_invariant_B:
            B = _per_batch(graph, disc.B, u)
        else:
            B = permute_view(graph, disc.B.node, disc.B.perm_to("bnt"))
            if disc.flip_time:
                # (Before a group expand: the flip copies (batch, N, L), not G of them.)
                B = _node(graph, "call_method", "flip", B, (-1,))
        if "g" in C.roles:
            groups = _node(graph, "call_method", "size", Cv, 1)
            B4 = _node(graph, "call_function", operator.getitem, B, (slice(None), None))
            B = _node(graph, "call_method", "expand", B4, -1, groups, -1, -1)
    init = None
    if first_state_is_input:
        assert initial_state is None, "a scan whose first state is its first input term has no h_{-1}"
        delta, init = _first_state_from_input(graph, u, delta, B)
    if initial_state is not None:
        init, roles = initial_state.node, initial_state.roles
        missing = tuple(r for r in "bdn" if r not in roles)
        if missing:
            # h_{-1} broadcast along leading state axes: add them as size-1 axes, then expand.
            init = _node(graph, "call_function", operator.getitem, init, (None,) * len(missing))
            roles = missing + roles
        init = permute_view(graph, init, Source(init, roles).perm_to("bdn"))
        sizes = (val(u).shape[0], val(u).shape[1], val(A).shape[1])
        if not all(statically_known_true(a == b) for a, b in zip(val(init).shape, sizes)):
            # A stride-0 view: the op reads the broadcast state without a (batch, dim, N) copy.
            init = _node(graph, "call_method", "expand", init, _node(graph, "call_method", "size", u, 0),
                         _node(graph, "call_method", "size", u, 1), _node(graph, "call_method", "size", A, 1))
        init = _cast(graph, init, torch.float64 if val(u).dtype == torch.float64 else torch.float32)
    want_last = last_state_roles is not None
    scan = _node(graph, "call_function", torch.ops.ssm.selective_scan.default,
                 u, delta, A, B, Cv, None, None, None, False, init, want_last)
    y = _node(graph, "call_function", operator.getitem, scan, 0)
    y = permute_view(graph, y, tuple("bdt".index(r) for r in y_roles if r != "1"))
    if "1" in y_roles:
        # The size-1 axes a keepdim readout kept, where the user's y has them.
        y = _node(graph, "call_function", operator.getitem, y,
                  tuple(None if r == "1" else slice(None) for r in y_roles))
    cast = _cast(graph, y, y_dtype)
    if cast is not y:
        # This cast is the op's own output rounding (the readout's dtype: autocast's bf16 einsum,
        # a bf16 model's readout), not one the user wrote: folding the tail moves it after the
        # tail (tail._widen_chain), where the op rounds once.
        cast.meta[OP_ROUNDING] = True
    y = cast
    last = None
    if want_last:
        last = _node(graph, "call_function", operator.getitem, scan, 1)
        last = permute_view(graph, last, tuple("bdn".index(r) for r in last_state_roles))
        last = _cast(graph, last, last_state_dtype)
    return y, last


def _decay(graph: torch.fx.Graph, A: Source, u: torch.fx.Node, B: Source) -> torch.fx.Node:
    """A as the op takes it, (dim, N). One shared by the channels (roles (n,), or (1, n) kept
    2-D) or by the states ((d, 1), or (d,) read as A[:, None]) is read through a stride-0 (dim, N)
    expand: no copy, and its backward sums dA over the broadcast axis as the user's broadcast does."""
    node, roles = A.node, A.roles
    if len(roles) == 1:
        node = _node(graph, "call_function", operator.getitem, node,
                     (None, slice(None)) if roles == ("n",) else (slice(None), None))
        roles = ("1", "n") if roles == ("n",) else (roles[0], "1")
    missing = iter(r for r in "dn" if r not in roles)
    named = tuple(next(missing) if r == "1" else r for r in roles)
    node = permute_view(graph, node, Source(node, named).perm_to("dn"))
    if "1" not in roles:
        return node
    sizes = [_node(graph, "call_method", "size", u, 1) if "d" not in roles else -1,
             _node(graph, "call_method", "size", B.node, B.roles.index("n")) if "n" not in roles else -1]
    return _node(graph, "call_method", "expand", node, *sizes)


def _first_state_from_input(graph: torch.fx.Graph, u: torch.fx.Node, delta: torch.fx.Node, B: torch.fx.Node
                            ) -> tuple[torch.fx.Node, torch.fx.Node]:
    """``(Δ with Δ_0 = 0, h_{-1} = Δ_0·B_0·u_0)`` in the op's layouts, from its (batch, dim, L) u and
    Δ and its B: (batch, N, L), (batch, G, N, L) or time-invariant (dim, N). See
    ``emit_selective_scan``'s ``first_state_is_input``. Computed in the op's accumulation dtype."""
    wide = torch.float64 if val(u).dtype == torch.float64 else torch.float32
    u0 = _cast(graph, _node(graph, "call_function", operator.getitem, u, (slice(None), slice(None), 0)), wide)
    d0 = _cast(graph, _node(graph, "call_function", operator.getitem, delta, (slice(None), slice(None), 0)), wide)
    ndim = val(B).dim()
    if ndim == 2:  # (dim, N), the same at every step
        B0 = _node(graph, "call_function", operator.getitem, B, (None,))
    elif ndim == 3:  # (batch, N, L)
        B0 = _node(graph, "call_function", operator.getitem, B, (slice(None), None, slice(None), 0))
    else:  # (batch, G, N, L): channel d reads group d // (dim / G)
        B0 = _node(graph, "call_function", operator.getitem, B, (Ellipsis, 0))
    # The op's order: (Δ·u)·B.
    du = _node(graph, "call_function", operator.mul, d0, u0)
    if ndim == 4:
        # (batch, dim) as (batch, G, dim / G), each group's channels against its B row.
        du = _node(graph, "call_method", "unflatten", du, 1, (_node(graph, "call_method", "size", B0, 1), -1))
        B0 = _node(graph, "call_function", operator.getitem, B0, (slice(None), slice(None), None))
    du = _node(graph, "call_function", operator.getitem, du, (slice(None),) * val(du).dim() + (None,))
    h0 = _node(graph, "call_function", operator.mul, du, _cast(graph, B0, wide))
    if ndim == 4:
        h0 = _node(graph, "call_method", "flatten", h0, 1, 2)
    return _delta_from_step_one(graph, delta), h0


def first_decay_bounded(disc: Discretized) -> bool:
    """Whether the ops that make Δ and A show Δ·A <= 0 (so exp(Δ·A) is in [0, 1], or NaN only
    from a NaN in Δ or an infinite Δ times A = 0, where B_full = Δ·B·u is not finite either). A = -inf
    with Δ = 0 gives no NaN in the op: its kernels and CPU path read A = -inf as the most negative
    float, so that step is the identity (probe CI: Δ = softplus(-120) = 0 at t = 0).

    A scan whose first state is ``b_0`` itself (an associative or in-place parallel scan, where no
    decay multiplies anything before it; a loop from t = 1 after ``h = B_full[t=0]``) is the op's
    from a zero state only where this holds: ``ssm.selective_scan`` without an initial state
    computes ``a_0 * 0 + b_0``, NaN where ``a_0`` is infinite (probe CC: a negative Δ with a
    strongly negative A), and its backward carries the same product."""
    delta, a = sign_of(disc.delta.node), sign_of(disc.A.node) * (-1 if disc.negate_A else 1)
    return delta * a == -1


def _delta_from_step_one(graph: torch.fx.Graph, delta: torch.fx.Node) -> torch.fx.Node:
    """Δ with Δ[..., 0] = 0: a decay of exactly 1 (for any finite A) and no input term at t = 0."""
    head = _node(graph, "call_function", torch.zeros_like,
                 _node(graph, "call_function", operator.getitem, delta, (Ellipsis, slice(None, 1))))
    rest = _node(graph, "call_function", operator.getitem, delta, (Ellipsis, slice(1, None)))
    return _node(graph, "call_function", torch.cat, [head, rest], -1)


def _per_batch(graph: torch.fx.Graph, src: Source, u: torch.fx.Node) -> torch.fx.Node:
    """A (batch, N) B or C, the same at every step, as the op's (batch, N, L) one: a stride-0
    view over time (no copy; the view's backward sums the gradient over time)."""
    bn = permute_view(graph, src.node, src.perm_to("bn"))
    bn1 = _node(graph, "call_function", operator.getitem, bn, (slice(None), slice(None), None))
    return _node(graph, "call_method", "expand", bn1, -1, -1, _node(graph, "call_method", "size", u, 2))


def _time_invariant(graph: torch.fx.Graph, src: Source, u: torch.fx.Node) -> torch.fx.Node:
    """A B or C that is the same at every batch element and step, as the op takes it: (dim, N)
    (mamba_ssm's is_variable_B/C=False), a (N,) one shared by the channels through a stride-0
    view. The op reduces its gradient over time and batch without a (batch, dim, N, L) buffer."""
    if src.roles == ("n",):
        row = _node(graph, "call_function", operator.getitem, src.node, (None, slice(None)))
        return _node(graph, "call_method", "expand", row, _node(graph, "call_method", "size", u, 1), -1)
    return permute_view(graph, src.node, src.perm_to("dn"))


def emit_or_refusal(graph: torch.fx.Graph, anchor: torch.fx.Node, emit: Callable[[], _Emitted]) -> _Emitted | str:
    """``emit()``'s nodes inserted before ``anchor``; or, if the op refuses the inputs, the graph
    as it was and the reason.

    The op's fake impl validates its inputs (N <= 256, dtypes, ...) while the nodes are emitted:
    a refusal there is a miss that leaves the user's scan in place, not a failed compile.
    """
    before = set(graph.nodes)
    try:
        with graph.inserting_before(anchor):
            return emit()
    except (RuntimeError, ValueError, TypeError) as e:
        for n in reversed([n for n in graph.nodes if n not in before]):
            graph.erase_node(n)
        return f"ssm.selective_scan refused the inputs: {e}"


def _emit_scan(graph: torch.fx.Graph, m: LoopMatch) -> tuple[torch.fx.Node, torch.fx.Node | None]:
    # A broadcast h_{-1} (e.g. a learned (dim, N) state shared by the batch) has the state's
    # trailing roles.
    init = None if m.init is None else Source(m.init, m.state_roles[len(m.state_roles) - val(m.init).dim():])
    if m.C is None and "g" in m.disc.B.roles and not _per_channel(m.disc.B, m.disc):
        # Only the last state is used, B in groups: the op reads C in B's groups, so a zero C
        # shaped like B (probe CW: a time-invariant zero C made the op refuse the grouped B).
        C = first_steps(graph, Source(_node(graph, "call_function", torch.zeros_like, m.disc.B.node),
                                      m.disc.B.roles), m.L)
    elif m.C is None:
        # Only the last state is used: the op still reads a C, and a zero one shared by the
        # channels (a stride-0 (dim, N) view of N zeros) makes its unused y cheap and finite. (A
        # per-channel B, G = dim, is read with it too: a zero C like it would be N values per channel
        # and step.)
        n = _node(graph, "call_method", "size", m.disc.B.node, m.disc.B.roles.index("n"))
        C = Source(_node(graph, "call_method", "new_zeros", m.disc.u.node, (n,)), ("n",))
    else:
        C = first_steps(graph, m.C, m.L)
    if m.out.kind == "states" and m.out.reversed_time and "t" in C.roles:
        # The states were stored last step first and read out with C in their slots' order: the
        # op's step s reads C at slot L-1-s (``_readout_of_states``).
        C = Source(_node(graph, "call_method", "flip", C.node, (C.roles.index("t"),)), C.roles)
    return emit_selective_scan(
        graph,
        first_steps_of(graph, m.disc, m.L),
        C,
        y_roles=m.out.roles,
        y_dtype=val(m.out.out_node).dtype,
        initial_state=init,
        last_state_roles=m.state_roles if m.last_users or m.last_views else None,
        last_state_dtype=val(m.h_last).dtype,
    )


def _emit(gm: torch.fx.GraphModule, m: LoopMatch, pos) -> str | None:
    """Replace the loop by the op; on failure leave the graph as it was and say why."""
    graph = gm.graph
    d = m.disc
    inputs = [d.u.node, d.delta.node, d.A.node, d.B.node] + [n for n in (m.C and m.C.node, m.init) if n is not None]
    last_input = max(inputs, key=pos.__getitem__)
    users = m.out.out_users + m.last_users + [u for v in m.last_views for u in v.users]
    users += [u for r in m.out.step_readouts for u in r.users]
    if users and pos[last_input] >= min(pos[u] for u in users):
        return "an input of the scan is computed after the scan's outputs are used"
    anchor = last_input.next
    while anchor.op == "placeholder":
        anchor = anchor.next
    layout = group_layout_refusal(d, m.C, flip_C=m.out.kind == "states" and m.out.reversed_time,
                                  grad=grad_enabled_at(m.h_last))
    if layout is not None:
        return layout
    # The op must run under the grad mode / autocast / functorch state the loop ran under.
    regions = ContextRegions(graph)
    replaced = [*m.loop_nodes, *d.nodes, *m.out.writes]
    sources = [d.u.node, d.delta.node, d.B.node] + ([m.C.node] if m.C is not None else [])
    # The op also stands in for what lies between its sources and the loop (casts on C the
    # readout was proved through): a rounding there is the program's too, also where the rounded
    # copy feeds another source as well (a rounded C summed into Δ: probe BJ, run 53, 1.7e-3 off).
    rounding = dropped_rounding([*replaced, *op_region(sources, m.loop_nodes, pos, keep_upstream=True,
                                                        values_only=True)], sources,
                                also_read=[d.A.node] + ([m.init] if m.init is not None else []),
                                inputs_as_read=True)
    if rounding is not None:
        return rounding
    anchor = regions.settle(anchor, replaced)
    refusal = regions.refusal(replaced, anchor)
    if refusal is not None:
        return refusal
    early = next((w for w in m.late_writes if pos[w] < pos[anchor]), None)
    if early is not None:
        return (f"{early.name} writes an input of the scan in place after the loop, but before the place the "
                f"op would read it ({anchor.name})")

    def emit():
        y, last = _emit_scan(graph, m)
        # Per-step readouts: r_t becomes y[..., t] (the op's y has its time axis last here).
        steps = [_node(graph, "call_method", "select", y, -1, t) for t in range(len(m.out.step_readouts))]
        return y, last, steps

    emitted = emit_or_refusal(graph, anchor, emit)
    if isinstance(emitted, str):
        return emitted
    y, last, steps = emitted
    for r, step in zip(m.out.step_readouts, steps, strict=True):
        r.replace_all_uses_with(step)
    if m.out.reversed_time:
        with graph.inserting_after(y):
            y = graph.call_method("flip", (y, (m.out.roles.index("t"),)))
        propagate_val(y)
        y.meta[REVERSED_OUTPUT] = True
    for user in m.out.out_users:
        user.replace_input_with(m.out.out_node, y)
    for user in m.last_users:
        user.replace_input_with(m.h_last, last)
    for view in m.last_views:
        view.replace_all_uses_with(last)
    doomed = sorted(set(m.out.writes) | set(m.loop_nodes), key=pos.__getitem__)
    for n in reversed(doomed):
        if not n.users:
            graph.erase_node(n)
    # A buffer the outputs were written into is not among the erased writes: erase it once unread.
    if m.out.kind in ("setitem", "copy_") and not m.out.out_node.users:
        graph.erase_node(m.out.out_node)
    return None


def _layout(roles: tuple[str, ...]) -> str:
    return "".join("l" if r == "t" else r for r in roles)


def _downstream(node: torch.fx.Node, hops: int = 4) -> set[torch.fx.Node]:
    seen, frontier = {node}, [node]
    for _ in range(hops):
        frontier = [u for n in frontier for u in n.users if u not in seen]
        seen.update(frontier)
    return seen


def _beside_a_reason(gm: torch.fx.GraphModule, misses: list) -> list:
    """``misses`` less each ``_NO_CHAIN`` whose product feeds, within a few ops, what the anchor of
    another scan_loop miss feeds: a skip ``D * x[t]`` or a step's ``Δ[t] * x[t]`` next to a loop
    that was refused for its own reason (probe BT) is no loop of its own."""
    generic = [x for x in misses if x.family == FAMILY and x.reason == _NO_CHAIN]
    if not generic:
        return misses
    named = {n.name: n for n in gm.graph.nodes}
    reasoned = [_downstream(named[name]) for x in misses if x.family == FAMILY and x.reason != _NO_CHAIN
                for name in x.nodes if name in named]
    def beside(x) -> bool:
        near = [_downstream(named[name]) for name in x.nodes if name in named]
        return any(a & b for a in near for b in reasoned)
    return [x for x in misses if not (x in generic and beside(x))]


def scan_loop_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """Rewrite every provable unrolled scan loop in ``gm`` into ``ssm.selective_scan``."""
    from ..kernels.selective_scan import op as scan_op

    scan_op.register()
    # ctx is shared with the other graphs of the same compile (checkpointed layers' subgraphs),
    # whose node names can repeat this graph's: only this call's misses are about this graph.
    first_miss, first_rewrite = len(ctx.misses), len(ctx.rewrites)
    unreverse_loops(gm)
    tried: set[tuple[torch.fx.Node, torch.fx.Node]] = set()
    while _rewrite_one(gm, ctx, tried):
        pass
    # A candidate tried before its loop's real anchor (a product inside the step, such as B̄[t]*x_t)
    # left a miss about nodes that the loop's rewrite (its scan, discretisation, readout) then
    # replaced: the loop is not missed.
    replaced = {name for r in ctx.rewrites[first_rewrite:] for name in r.replaced}
    ctx.misses[first_miss:] = [x for x in ctx.misses[first_miss:]
                               if not (x.family == FAMILY and x.nodes and set(x.nodes) <= replaced)]
    # A product that only looked like a step's decay (the readout's h*C[t] of a loop whose real
    # anchor was refused for its own reason) says nothing more about that loop.
    if any(x.family == FAMILY and x.reason != _NOT_THE_ANCHOR for x in ctx.misses[first_miss:]):
        ctx.misses[first_miss:] = [x for x in ctx.misses[first_miss:] if x.reason != _NOT_THE_ANCHOR]
    ctx.misses[first_miss:] = _beside_a_reason(gm, ctx.misses[first_miss:])
    # Recurrences the anchors never reached (an EMA, a gated RNN) still get a reason in explain.
    muls = [n for n in gm.graph.nodes
            if (is_call(n, *_MUL) or is_method(n, "mul")) and len(n.args) == 2 and not n.kwargs]
    reported = {name for x in ctx.misses[first_miss:] if x.family == FAMILY for name in x.nodes}
    given = {x.reason for x in ctx.misses[first_miss:] if x.family == FAMILY}
    for m, c, H, _ in _unmatched_recurrences(muls, reported):
        reason = _recurrence_reason(m, c, H)
        if reason not in given:
            # (A loop refused for a lag at step 1 leaves steps 1.. as a chain of their own with
            # the same lag.)
            ctx.miss(FAMILY, reason, [m])
    reported |= {name for x in ctx.misses[first_miss:] if x.family == FAMILY for name in x.nodes}
    # A walk backwards that stops short of index 0 has no step at t = 0 for an anchor to start from.
    for m, c, _, steps in _unmatched_recurrences(muls, reported, shift=-1):
        ts = time_slice(c)
        if ts is not None and val(ts[0]).dim() == 4:
            ctx.miss(FAMILY, _reverse_walk_reason(ts[2], ts[2] - steps + 1, val(ts[0]).shape[ts[1]]), [m])
    reported |= {name for x in ctx.misses[first_miss:] if x.family == FAMILY for name in x.nodes}
    deep = _deep_step_recurrence(muls, reported)
    if deep is not None:
        ctx.miss(FAMILY, DEEP_STEP, [deep])
    lerp = _lerp_recurrence(gm.graph)
    if lerp is not None:
        ctx.miss(FAMILY, "a linear recurrence written with torch.lerp (h = lerp(x_t, h, w_t) = w_t*h + "
                 "(1 - w_t)*x_t, or lerp(h, x_t, w_t)): its input term carries the decay's complement, "
                 "not Δ·B·u, so ssm.selective_scan cannot compute it; left alone", [lerp])
    closed = _closed_form_scans(gm)
    if closed:
        ctx.miss(FAMILY, "a closed-form scan (a running sum or product of the per-step decay over "
                 "the time axis, then exp): only recurrences written as a time loop or with "
                 "associative_scan are rewritten; each runs as written", closed)


def _lerp_recurrence(graph: torch.fx.Graph) -> torch.fx.Node | None:
    """The first of three or more ``torch.lerp`` calls chained through their start or end
    argument (an unrolled recurrence in one call per step), or None. No product anchors such a
    loop, so without this it would leave no record in ``explain``."""
    lerps = [n for n in graph.nodes if is_call(n, torch.lerp) or is_method(n, "lerp")]
    prev = {}
    for n in lerps:
        for a in n.args[:2]:
            if isinstance(a, torch.fx.Node) and (is_call(a, torch.lerp) or is_method(a, "lerp")):
                prev[n] = a
    nxt = {v: k for k, v in prev.items()}
    for n in lerps:
        if n in nxt and n not in prev:
            length, m = 1, n
            while m in nxt:
                m, length = nxt[m], length + 1
            if length >= 3:
                return n
    return None


_RUNNING = ("cumsum", "cumprod")


def _closed_form_scans(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Each ``cumsum``/``cumprod`` over a (batch, L, dim, N)-like tensor that a scan in closed
    form is built on (``exp(cumsum(Δ·A))``, ``cumprod(exp(Δ·A))``, Mamba-2's segsum; one per
    layer). For explain only: nothing is rewritten from them."""
    found = []
    for node in gm.graph.nodes:
        name = bare_name(node)
        if node.op not in ("call_function", "call_method") or name not in _RUNNING:
            continue
        value = val(node)
        if not (isinstance(value, torch.Tensor) and value.dim() >= 4):
            continue
        source = node.args[0] if node.args else None
        if value.is_complex():
            # Heinsen's log-space sequence takes the log of signed values as complex numbers, and
            # its running sums meet in a logcumsumexp (probe CO: no reason was given). A complex
            # cumsum without one is no scan (a rotary phase; probe CQ).
            if name == "cumsum" and _reaches(node, ("logcumsumexp",), 3):
                found.append(node)
        elif value.is_floating_point() and (name == "cumprod" and _feeds_from_exp(source)
                                            or name == "cumsum" and _reaches_exp(node, depth=4)):
            found.append(node)
    return found


def _feeds_from_exp(node: Any) -> bool:
    while isinstance(node, torch.fx.Node) and is_cast(node):
        node = node.args[0]
    return is_exp(node)


def _reaches_exp(node: torch.fx.Node, depth: int) -> bool:
    # exp(S), exp(-S), exp(S[:, :, None] - S[:, None, :]), and that masked (``masked_fill`` with -inf
    # above the diagonal, probe BY): a few elementwise or indexing steps. A real exp: the exp of a
    # complex value is a rotation (a rotary phase exp(1j * cumsum(theta)), probe CQ), no decay.
    return _reaches(node, ("exp",), depth, lambda u: not _is_complex(u))


def _reaches(node: torch.fx.Node, names: tuple[str, ...], depth: int,
             accept: Callable[[torch.fx.Node], bool] = lambda u: True) -> bool:
    """A call named in ``names`` (and passing ``accept``) reads ``node`` within ``depth`` steps of
    its users."""
    if depth == 0:
        return False
    return any(bare_name(u) in names and accept(u) or _reaches(u, names, depth - 1, accept) for u in node.users)


def _is_complex(node: torch.fx.Node) -> bool:
    value = val(node)
    return isinstance(value, torch.Tensor) and value.is_complex()


def _key_slices(key: Any) -> list[tuple]:
    """The ("slice", base, axis, index) entries inside a leaf key (base a ``_SliceBase``)."""
    if isinstance(key, tuple):
        if key and key[0] == "slice":
            return [key]
        return [s for k in key for s in _key_slices(k)]
    return []


class _Products(list):
    """``_products``' list, with the leaf keys of its factors computed so far: one search per
    anchor goes over every product, and keys hold as long as the graph does (every change to
    the graph computes the products anew)."""

    def __init__(self):
        super().__init__()
        self.keys: dict[tuple[torch.fx.Node, int], tuple] = {}

    def leaf_key(self, node: torch.fx.Node, t: int) -> tuple:
        key = self.keys.get((node, t))
        if key is None:
            key = self.keys[node, t] = _leaf_key(node, t)
        return key


def _products(graph: torch.fx.Graph) -> _Products:
    """Every product ``p * q`` in the graph as (node, p, q): ``mul``, and the product inside
    ``addcmul(b, p, q)`` (value 1), which spells ``h = B_full[t] + A_full[t] * h`` in one call."""
    found = _Products()
    for n in graph.nodes:
        if (is_call(n, *_MUL) or is_method(n, "mul")) and len(n.args) == 2 and not n.kwargs:
            found.append((n, n.args[0], n.args[1]))
        elif addcmul_operands(n) is not None:
            found.append((n, n.args[1], n.args[2]))
    return found


def _reads_from_step(base: torch.fx.Node, axis: int, index: int) -> bool:
    """Something reads ``base`` along ``axis`` at ``index`` or later: a time slice there, or
    any use that is not a time slice (a view, the whole tensor), counted as one. A use that
    reads only its shape and dtype (``u.new_zeros(...)`` for the state, ``u.size()``) reads no
    step. An unbind along ``axis`` reads the steps whose items are used: ``zip`` over
    unbinds of unequal lengths stops at the shortest, and leaves the longer ones' tails unread;
    a prefix along ``axis`` reads its steps."""
    for n in base.users:
        if (is_method(n, *_BUFFER_METHODS, "size", "dim") or is_call(n, torch.zeros_like, torch.empty_like)) \
                and n.args and n.args[0] is base and base not in n.args[1:] and base not in n.kwargs.values():
            continue
        if unbind_source(n) == (base, axis) and _unbind_items_before(n, val(base).shape[axis], index):
            continue
        if n is not base and time_prefix_source(n, axis) is base and _at_most(val(n).shape[axis], index):
            # ``u[:, :, :k]`` after a loop over the first k steps (a D skip on them) reads no later step.
            continue
        ts = time_slice(n)
        if ts is None or ts[0] is not base or ts[1] != axis or ts[2] >= index:
            return True
    return False


def _at_most(size: Any, index: int) -> bool:
    return is_concrete_int(size) and int(size) <= index


def _unbind_items_before(unbind: torch.fx.Node, size: Any, index: int) -> bool:
    """Every used item of ``unbind`` (of ``size`` items) has an index below ``index``; any other
    use of the tuple (passed whole, indexed by a slice) counts as reading every item."""
    for item in unbind.users:
        i = item.args[1] if is_call(item, operator.getitem) else None
        if not isinstance(i, int) or isinstance(i, bool):
            return False
        if item.users and not (0 <= i < index or (i < 0 and is_concrete_int(size) and i + int(size) < index)):
            return False
    return True


def unreverse_loops(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Read the time slices of a loop that walks time backwards as slices of the flipped tensor.

    A loop ``for t in reversed(range(L))`` reads ``x[:, L-1]`` first and ``x[:, 0]`` last: a
    reverse scan, which ssm.selective_scan (forward from t = 0) does not compute as it stands.
    ``x[:, i]`` is ``x.flip(1)[:, L-1-i]`` for every i and every x, so each pass of the graph
    over x's indices L-1, L-2, ..., lo in that order (three at least; the whole axis, or the part
    a loop over ``range(L - 1, lo - 1, -1)`` covers) is replaced with slices of the flip: the same
    values, and the loop then reads the flipped tensors forward, which the scan passes prove as any
    forward loop (the readouts come out in the flipped order, which is how the loop produced them). Reads of x in another order (a forward loop over
    the same C or dA, a bidirectional block) keep their slices. A tensor written in place anywhere
    keeps every slice (its flip would be a copy taken at one point), and so does every pass that a
    kept slice falls among, which would leave a loop reading some tensors flipped and others not.
    Returns the flip nodes added (possibly none)."""
    graph = gm.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[tuple[torch.fx.Node, int], list[tuple[torch.fx.Node, int]]] = {}
    for node in graph.nodes:
        ts = time_slice(node)
        if ts is not None:
            groups.setdefault((ts[0], ts[1]), []).append((node, ts[2]))
    passes, kept = [], []
    for (base, axis), slices in groups.items():
        ordered = sorted(slices, key=lambda s: pos[s[0]])
        size = val(base).shape[axis]
        found = [] if written_in_place(graph, [base]) is not None else [
            p for p in _reverse_passes(ordered)
            # A pass that stops short of x's last step (hi < L-1) is a loop over the flip's late
            # steps, which no scan rewrite covers: its slices are kept. A length dynamo left
            # symbolic (C only indexed, known to be at least the loop's length) is the loop's.
            if not is_concrete_int(size) or max(i for _, i in p) == int(size) - 1]
        taken = {node for p in found for node, _ in p}
        passes += [(base, axis, p) for p in found]
        kept += [node for node, _ in ordered if node not in taken]
    # A pass among whose reads a kept slice falls would flip only part of what its loop reads,
    # which explain would call a lag: it is kept too, until none is.
    while True:
        spans = [range(min(pos[n] for n, _ in p), max(pos[n] for n, _ in p) + 1) for _, _, p in passes]
        clash = [i for i, span in enumerate(spans) if any(pos[n] in span for n in kept)]
        if not clash:
            break
        kept += [n for i in clash for n, _ in passes[i][2]]
        passes = [p for i, p in enumerate(passes) if i not in clash]
    flips = []
    for base, axis, slices in passes:
        # A pass stopping at lo > 0 becomes a loop over the first steps of the flip, which the
        # passes prove as any prefix. Where x's length is symbolic, its first hi + 1 steps are
        # flipped (the loop's steps, as ``first_steps`` reads a forward loop's).
        length = max(i for _, i in slices) + 1
        with graph.inserting_before(min((n for n, _ in slices), key=pos.__getitem__)):
            size = val(base).shape[axis]
            piece = base
            if not (is_concrete_int(size) and int(size) == length):
                piece = graph.call_method("narrow", (base, axis, 0, length))
                propagate_val(piece)
            flipped = graph.call_method("flip", (piece, (axis,)))
        propagate_val(flipped)
        for node, i in slices:
            kind, index = _flipped_slice(node, i, length)
            with graph.inserting_before(node):
                if kind == "select":
                    new = graph.call_method("select", (flipped, axis, index))
                else:
                    new = graph.call_function(operator.getitem, (flipped, index))
            propagate_val(new)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        flips.append(flipped)
    return flips


def _reverse_passes(slices: list[tuple[torch.fx.Node, int]]) -> list[list[tuple[torch.fx.Node, int]]]:
    """The passes of ``slices`` (one tensor's time slices, ``(node, index)`` in graph order) that
    read indices hi, hi-1, ..., lo, each the same number of times, and nothing else in between.

    A pass is a run of non-increasing indices covering lo..hi with no gap, three steps at least (a
    pair read second-first, ``im, re = z[..., 1], z[..., 0]``, is no scan worth a copy). A run
    that starts with more reads of hi than of the other indices began with the last read of a
    forward loop over the same tensor (``0, ..., L-1`` then ``L-1, ..., 0``), and one that ends
    with more reads of lo runs into the first read of the next: those reads are the forward
    loop's, and stay out of the pass."""
    runs, run = [], []
    for s in slices:
        if run and s[1] > run[-1][1]:
            runs.append(run)
            run = []
        run.append(s)
    runs.append(run)
    found = []
    for run in runs:
        if not run or any(i < 0 for _, i in run):
            continue
        counts: dict[int, int] = {}
        for _, i in run:
            counts[i] = counts.get(i, 0) + 1
        lo, hi = min(counts), max(counts)
        if hi == lo:
            continue
        each = min(counts.values())
        run = run[counts[hi] - each:len(run) - (counts[lo] - each)]
        counts[hi] = counts[lo] = each
        if (hi - lo + 1 >= 3 and set(counts) == set(range(lo, hi + 1)) and set(counts.values()) == {each}
                and all(_flipped_slice(node, i, hi + 1) is not None for node, i in run)):
            found.append(run)
    return found


def _flipped_slice(node: torch.fx.Node, index: int, length: int) -> tuple[str, Any] | None:
    """How ``node`` (index ``index`` of a time axis ``length`` long) reads the flipped tensor:
    ``("select", L-1-i)`` where its value is the plain select (a select, an unbind item, a
    squeezed width-1 piece), ``("getitem", new index)`` for an index tuple with one integer (the
    time index: other axes kept, sliced whole or added), else None."""
    mirrored = length - 1 - index
    if is_call(node, operator.getitem) and unbind_source(node.args[0]) is None:
        key = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        ints = [k for k, x in enumerate(key) if isinstance(x, int) and not isinstance(x, bool)]
        others = [x for x in key if not (isinstance(x, int) and not isinstance(x, bool))]
        if len(ints) != 1 or any(not (x is None or x is Ellipsis or x == slice(None)) for x in others):
            return None
        key = tuple(mirrored if k == ints[0] else x for k, x in enumerate(key))
        return "getitem", key
    return "select", mirrored


_REVERSE_SCAN = ("the loop walks time backwards (the state the step at t=0 multiplies was made by the step at "
                 "t=1: a reverse scan, e.g. indices L-1-t), and its time slices could not all be read as slices "
                 "of the flipped tensors, which makes a reverse loop a forward one: a tensor it reads is "
                 "written in place, read in another order elsewhere (another loop), or sliced in a form not "
                 "mirrored (unbind, split, a copy_ into a slot); or the loop covers part of the time axis, "
                 "or fewer than 3 steps; or the decay and the input term are read in opposite time orders "
                 "(A_full[L-1-t] with B_full[t]: no scan in either direction). Left alone; where every "
                 "tensor is read last step first, flipping its inputs and output (x.flip(-1)) yourself "
                 "gives a forward loop that is rewritten")


def _made_by_step_key(node: Any, key0: tuple, depth: int) -> bool:
    """The per-step form of ``_made_by_step_at``: ``node`` is computed, within ``depth``
    elementwise nodes, by a product with a factor that is step 0's multiplier with every time
    index + 1 (the step at t = 1's ``exp(Δ[1]·A)``)."""
    if depth == 0 or not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    factors = node.args if (is_call(node, *_MUL) or is_method(node, "mul")) and len(node.args) == 2 else ()
    if any(isinstance(f, torch.fx.Node) and _leaf_key(f, 1) == key0 for f in factors):
        return True
    return any(_made_by_step_key(a, key0, depth - 1) for a in node.args if isinstance(a, torch.fx.Node))


def _made_by_step_at(node: Any, base: torch.fx.Node, axis: int, index: int, depth: int) -> Any:
    """The state that a product with a factor ``base`` sliced at ``index`` along ``axis``
    multiplies, where ``node`` is computed from that product within ``depth`` elementwise nodes
    (``node`` is then the state a step at that time index made); else None."""
    if depth == 0 or not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    if (is_call(node, *_MUL) or is_method(node, "mul")) and len(node.args) == 2:
        for f, state in (node.args, node.args[::-1]):
            ts = time_slice(f)
            if ts is not None and ts[0] is base and ts[1] == axis and ts[2] == index:
                return state
    return next((found for a in node.args if isinstance(a, torch.fx.Node)
                 if (found := _made_by_step_at(a, base, axis, index, depth - 1)) is not None), None)


def _reverse_walk_start(state: Any, base: torch.fx.Node, axis: int) -> int:
    """The time index that a walk backwards through ``base``'s time slices starts at, ``state``
    being what its step at index 0 multiplies: the step at 1 made it, and so on back to the
    walk's first step."""
    index = 0
    while (state := _made_by_step_at(state, base, axis, index + 1, depth=3)) is not None:
        index += 1
    return index


def _reverse_walk_reason(hi: int, lo: int, size: Any) -> str:
    """Why a loop that walks time backwards from index ``hi`` down to ``lo``, along an axis ``size``
    long, is left alone."""
    if is_concrete_int(size) and hi < int(size) - 1:
        # Over the flipped tensors this is a loop from a later step (``unreverse_loops`` keeps its
        # slices), as ``range(2, L)`` is forward.
        return (f"the loop walks time backwards from time index {hi}, not from the last one ({int(size) - 1}), down "
                f"to {lo} (range({hi}, {lo - 1}, -1)?): read over the flipped tensors it is a loop that starts "
                f"late, at step {int(size) - 1 - hi}, from a state made before it (a late start or a state reset): "
                "left alone; a reverse walk is rewritten where it starts at the last time index")
    if lo == 0:
        return _REVERSE_SCAN
    return (f"the loop walks time backwards from the last time index down to {lo} (range(L - 1, {lo - 1}, -1)?), "
            "and its time slices could not all be read as slices of the flipped tensors, which makes a reverse "
            "loop over the last steps a forward one over the first: a tensor it reads is written in place, read in "
            "another order elsewhere (another loop), or sliced in a form not mirrored (unbind, split, a copy_ into "
            "a slot), or the decay and the input term are read in opposite time orders. Left alone")


def _anchors(products: list[tuple[torch.fx.Node, Any, Any]]):
    """Candidate first steps ``α_0 * H``: α_0 a slice t=0 of a 4-D tensor (A_full[t=0]), or a
    computation on time slices that all read t=0 (per-step discretisation). Yields
    (mul node, α_0, H)."""
    late, earliest = [], {}
    for m, p, q in products:
        for a0, H in ((p, q), (q, p)):
            if not isinstance(a0, torch.fx.Node) or not (isinstance(val(H), torch.Tensor) or is_number(H)):
                continue
            ts = time_slice(a0)
            if ts is not None:
                if ts[2] == 0 and val(ts[0]).dim() == 4:
                    yield m, a0, H
                continue
            key = _leaf_key(a0, 0)
            found = _key_slices(key)
            if key[0] == "op" and found and len({k[3] for k in found}) == 1:
                k = found[0][3]
                shifted = _leaf_key(a0, k)
                earliest[shifted] = min(k, earliest.get(shifted, k))
                if k == 0:
                    yield m, a0, H
                else:
                    late.append((k, shifted, m, a0, H))
    # A per-step chain whose earliest step reads time index k > 0 (``range(1, L)`` after a
    # first step written before the loop) is tried from that step, so that it is explained:
    # match_loop refuses a start other than 0. Later steps of a chain are not tried again.
    for k, shifted, m, a0, H in late:
        if earliest[shifted] == k:
            yield m, a0, H


def _exact_number(x: Any, dtype: torch.dtype) -> bool:
    """A tensor of ``dtype`` holding ``x`` multiplies as eager's ``t * x`` does. A float32 or
    float64 product converts the number to its own dtype, as a tensor of it holds it (unless that
    overflows); a float16 or bfloat16 one to float32, so there the number must be exact."""
    if not dtype.is_floating_point:
        return False
    try:
        held = float(torch.tensor(x, dtype=dtype))
    except (OverflowError, RuntimeError):  # an int beyond any float (10**400)
        return False
    if dtype in (torch.float32, torch.float64):
        return math.isfinite(held) or not math.isfinite(x)
    return held == x


def _state_tensor(graph: torch.fx.Graph, anchor: torch.fx.Node, a0: torch.fx.Node, H: Any) -> torch.fx.Node | None:
    """``h = 0.0`` (or another number) before the loop: step 0 is ``α_0 * 0.0 + β_0``. The number
    becomes a 0-d tensor of α_0's dtype and device holding it, which ``anchor`` multiplies
    instead: the same products elementwise (NaN for an infinite α_0, -0.0 for a negative one),
    so the chain is proved as from ``torch.zeros(())``, which becomes no initial state, or from
    a filled tensor, which broadcasts to the state as ``initial_state``. (0-d, not ``full_like``
    of α_0: that would keep the (batch, dim, L, N) tensor α_0 is a slice of alive for its
    shape.) None where the tensor would not hold what eager multiplies by (``_exact_number``)."""
    dtype = val(a0).dtype
    if not _exact_number(H, dtype):
        return None
    with graph.inserting_before(anchor):
        filled = graph.call_function(torch.full, ((), H), {"dtype": dtype, "device": val(a0).device})
    propagate_val(filled, mode_of=a0)
    at = 1 if anchor.args[0] is a0 else 0
    anchor.args = tuple(filled if i == at else a for i, a in enumerate(anchor.args))
    return filled


@dataclasses.dataclass
class _FirstStep:
    """Step 0 of a loop from t = 1, written into the graph by ``_write_first_step``."""
    zero: torch.fx.Node            # the zero state it starts from
    a0: torch.fx.Node              # A_full[t=0], a slice the graph did not have
    anchor: torch.fx.Node          # A_full[0] * zero, the copy of step 1's product
    nodes: list[torch.fx.Node]     # every node added, in graph order (the state h_0 last)
    h: torch.fx.Node               # the user's first state, B_full[t=0], whose readers now read h_0


def _write_first_step(graph: torch.fx.Graph, anchor: torch.fx.Node, h: torch.fx.Node, a1: torch.fx.Node,
                      products: list[tuple[torch.fx.Node, Any, Any]], pos) -> _FirstStep | str:
    """``h = B_full[t=0]``, then ``h = A_full[t]*h + B_full[t]`` from t = 1 (``anchor`` is step 1's
    ``a1 * h``): step 1's nodes copied as a step 0 from a zero state, ``A_full[0]*0 + B_full[0]``
    with this very ``h`` as its B_full[0], and h's readers moved onto the copy's state. That loop
    is the user's wherever A_full[0] is finite (``A_full[0]*0 + x`` is then x), which the caller
    proves before it rewrites (``first_decay_bounded``); it undoes the copy otherwise
    (``_undo_first_step``). Returns the copy, or why none is written."""
    (b_base, axis, _), a_base = time_slice(h), time_slice(a1)[0]
    if time_slice(a1)[1] != axis or val(a_base).dim() != 4 or val(b_base).dim() != 4:
        return "A_full and B_full are not two 4-D tensors sliced along one time axis"
    # h_1: what step 2's A_full[2] multiplies, made from h.
    h1 = None
    for _, p, q in products:
        for a2, x in ((p, q), (q, p)):
            if (isinstance(x, torch.fx.Node) and time_slice(a2) == (a_base, axis, 2) and pos[x] >= pos[anchor]
                    and (h1 is None or pos[x] < pos[h1]) and _between(h, x, pos) is not None):
                h1 = x
    if h1 is None:
        return "no step at t = 2 multiplies a state made from h by A_full[2]"
    region = _between(h, h1, pos)
    leaves = {}
    for n in region:
        for x in n.all_input_nodes:
            if x in region or x is h or x in leaves:
                continue
            ts = time_slice(x)
            if ts is None or ts[0] not in (a_base, b_base) or ts[1] != axis or ts[2] != 1:
                return (f"step 1 reads {x.name}, which is not A_full[1] or B_full[1]: only a step on slices of "
                        "the precomputed A_full and B_full is written out for t = 0")
            leaves[x] = ts[0]
    last = max(h, a_base, key=pos.__getitem__)
    if any(pos[u] <= pos[last] for u in h.users):
        return f"h is read ({min(h.users, key=pos.__getitem__).name}) before A_full ({a_base.name}) is made"
    readers = list(h.users)
    added: list[torch.fx.Node] = []
    with graph.inserting_before(last.next):
        zero = graph.call_function(torch.zeros, ((),), {"dtype": val(h).dtype, "device": val(h).device})
        propagate_val(zero, mode_of=h)
        a0 = graph.call_method("select", (a_base, axis, 0))
        propagate_val(a0)
        added += [zero, a0]
        env = {h: zero, **{x: h if base is b_base else a0 for x, base in leaves.items()}}
        for n in region:
            env[n] = graph.node_copy(n, env.__getitem__)
            propagate_val(env[n])
            added.append(env[n])
    for user in readers:
        user.replace_input_with(h, env[h1])
    return _FirstStep(zero, a0, env[anchor], added, h)


def _undo_first_step(graph: torch.fx.Graph, first: _FirstStep) -> None:
    """The graph as it was before ``_write_first_step``."""
    first.nodes[-1].replace_all_uses_with(first.h)
    for n in reversed(first.nodes):
        graph.erase_node(n)


def _first_step_reason(first: _FirstStep | str, m: LoopMatch | str | None) -> str | None:
    """Why a loop from t = 1 after ``h = B_full[t=0]`` is left alone, or None where it is rewritten."""
    if isinstance(first, str):
        return f"{_PEELED}, and its step at t = 0 is not written out to prove it as a scan from h = 0: {first}"
    if m is None or isinstance(m, str):
        return (f"{_PEELED}, read as a scan from h = 0 with its step at t = 0 written out, which is left alone: "
                f"{m or _NO_CHAIN}")
    if not first_decay_bounded(m.disc):
        return (f"{_PEELED}: that equals a scan from h = 0 only where exp(Δ·A) at t = 0 is finite, which the ops "
                f"that make Δ ({m.disc.delta.node.name}) and A ({m.disc.A.node.name}) do not show (Δ·A <= 0, which "
                "Δ = softplus(...) and A = -exp(A_log) show); start from h = zeros and run every step from t = 0 "
                "to have it rewritten")
    return None


def _is_add(node: Any) -> bool:
    return (is_call(node, operator.add, torch.add) or is_method(node, "add")) and len(node.args) == 2 \
        and not node.kwargs


def _coeff_key(c: Any, t: int) -> tuple:
    """How a decay coefficient of step ``t`` compares with step 0's (a literal is itself). For
    explain only: a higher-order op's body (a custom autograd.Function's forward, a tensor hook)
    is a new attribute in every step, compared here by its code."""
    if not isinstance(c, torch.fx.Node):
        return ("literal", type(c).__name__, repr(c))
    gm = c.graph.owning_module

    def bodies(key):
        if isinstance(key, tuple) and len(key) == 2 and key[0] == "node" and isinstance(key[1], torch.fx.Node):
            n = key[1]
            body = getattr(gm, n.target, None) if n.op == "get_attr" and isinstance(n.target, str) else None
            return ("body", _body_signature(body)) if isinstance(body, torch.fx.GraphModule) else key
        return tuple(bodies(k) for k in key) if isinstance(key, tuple) else key

    return bodies(_leaf_key(c, t))


def _addends(m: torch.fx.Node) -> Iterator[tuple[torch.fx.Node, Any]]:
    """``(a, x)`` for each ``a = m + x`` (either operand order) that reads ``m``."""
    for a in m.users:
        if _is_add(a):
            yield a, a.args[1] if a.args[0] is m else a.args[0]


def _next_step(m: torch.fx.Node, c: Any, shift: int = 1) -> tuple[torch.fx.Node, Any] | None:
    """For ``m = c * H`` feeding ``h = m + x_t``: the next step's ``c' * h`` with ``c'`` being
    ``c`` shifted ``shift`` steps in time, and the addend's time shift checked likewise."""
    for a, x0 in _addends(m):
        if not isinstance(x0, torch.fx.Node) or not _key_slices(_leaf_key(x0, 0)):
            continue
        for m2 in a.users:
            if not (is_call(m2, *_MUL) or is_method(m2, "mul")) or len(m2.args) != 2 or m2.kwargs:
                continue
            c2 = m2.args[1] if m2.args[0] is a else m2.args[0]
            if _coeff_key(c2, shift) != _coeff_key(c, 0):
                continue
            for a2 in m2.users:
                if _is_add(a2):
                    x1 = a2.args[1] if a2.args[0] is m2 else a2.args[0]
                    if isinstance(x1, torch.fx.Node) and _leaf_key(x1, shift) == _leaf_key(x0, 0):
                        return m2, c2
    return None


def _unmatched_recurrences(muls: list[torch.fx.Node], reported: set[str], shift: int = 1):
    """Unrolled linear recurrences ``h = c_t * h + x_t`` (three steps or more) with no scan_loop
    record yet, each step reading its slices ``shift`` time indices after the step before (-1: a
    walk backwards through time); yields (first step's product, its coefficient, its other
    operand, the number of steps)."""
    nxt: dict[torch.fx.Node, tuple[torch.fx.Node, Any]] = {}
    first: dict[torch.fx.Node, tuple[Any, Any]] = {}
    for m in muls:
        for c, H in ((m.args[0], m.args[1]), (m.args[1], m.args[0])):
            step = _next_step(m, c, shift)
            if step is not None:
                nxt[m] = step
                first[m] = (c, H)
                break
    later = {m2 for m2, _ in nxt.values()}
    for m, (c, H) in first.items():
        if m in later or nxt[m][0] not in nxt:
            continue
        chain = [m]
        while chain[-1] in nxt:
            chain.append(nxt[chain[-1]][0])
        if not any(n.name in reported for n in chain):
            yield m, c, H, len(chain)


def decay_computed_in_step(c: Any) -> bool:
    """``c`` is an exp that ``_leaf_key`` reads as no time slice: computed in its step from
    per-step values, deeper than its depth (x_proj and dt_proj applied inside the loop, or a
    decode step's own projections). A chain of such steps is no scan of time slices for this
    pass; the decode pass takes each step (``passes/decode.py``)."""
    return (isinstance(c, torch.fx.Node) and time_slice(c) is None and not _key_slices(_leaf_key(c, 0))
            and exp_behind(c))


def _deep_step_recurrence(muls: list[torch.fx.Node], reported: set[str]) -> torch.fx.Node | None:
    """The first product of a chain of three or more steps ``h' = c * h + x`` whose every ``c`` is
    an exp that ``_leaf_key`` reads as no time slice (computed in the step from per-step values,
    deeper than its depth: probe CF's Mamba-1 with x_proj and dt_proj inside the loop), none of
    whose products has a reason yet; else None. Without it such a loop had no reason at all."""
    mulset = set(muls)

    def coefficient(m: torch.fx.Node, state: torch.fx.Node) -> Any:
        c = m.args[1] if m.args[0] is state else m.args[0]
        return c if decay_computed_in_step(c) else None

    def following(m: torch.fx.Node) -> torch.fx.Node | None:
        for a, _ in _addends(m):
            for m2 in a.users:
                if m2 in mulset and a in m2.args and coefficient(m2, a) is not None:
                    return m2
        return None

    nxt = {m: following(m) for m in muls if any(coefficient(m, h) is not None for h in m.args)}
    later = {m2 for m2 in nxt.values() if m2 is not None}
    for m in nxt:
        if m in later:
            continue
        chain = [m]
        while nxt.get(chain[-1]) is not None and len(chain) < 3:
            chain.append(nxt[chain[-1]])
        if len(chain) == 3 and not any(n.name in reported for n in chain):
            return m
    return None


def _body_signature(body: torch.fx.GraphModule) -> tuple:
    """A subgraph's nodes with their inputs as positions: equal for two bodies that differ only
    in names (dynamo names a body's placeholder after the value passed in)."""
    index = {n: i for i, n in enumerate(body.graph.nodes)}
    return tuple((n.op, str(n.target) if n.op != "placeholder" else "",
                  repr(torch.fx.map_arg((n.args, n.kwargs), lambda a: index[a])))
                 for n in body.graph.nodes)


def _addend_indices(m: torch.fx.Node) -> set:
    """The time indices the input term added to ``m = c * H`` reads its slices at."""
    for _, x0 in _addends(m):
        if isinstance(x0, torch.fx.Node):
            return {s[3] for s in _key_slices(_leaf_key(x0, 0))}
    return set()


def _leaf_name(node: torch.fx.Node) -> str:
    """A proof leaf as a user reads it: ``dA[t=0]`` for a time slice of ``dA``, else its name."""
    ts = time_slice(node)
    return node.name if ts is None else f"{ts[0].name}[t={ts[2]}]"


def _lag_reason(addend_index: int, decay_index: int) -> str:
    return (f"a linear recurrence whose input term reads time index {addend_index} in the step whose decay "
            f"reads time index {decay_index}: the input term and the decay read different steps (one lags the "
            "other), which ssm.selective_scan cannot compute; left alone")


def _recurrence_reason(m: torch.fx.Node, c: Any, H: Any) -> str:
    """Why an unrolled linear recurrence (first step ``m = c * H``) that no anchor started from
    is left alone."""
    hop = higher_order_op(c)
    if hop is not None:
        return (f"the decay passes through {hop_name(hop)} in every step (a custom "
                "autograd.Function, or a hook on the tensor): the op's own gradient would replace what it does "
                "in the backward; left alone")
    ts = time_slice(c) if isinstance(c, torch.fx.Node) else None
    slices = _key_slices(_leaf_key(c, 0)) if isinstance(c, torch.fx.Node) and ts is None else []
    if slices:
        first = {s[3] for s in slices}
        if is_exp(c) and len(first) == 1 and first != {0}:
            k = next(iter(first))
            lagged = sorted(i for i in _addend_indices(m) if i != k)
            if lagged:
                # The steps repeat from t = k only because step k - 1 read the input term at a
                # clamped index (B[max(t - 1, 0)]): a lag, not a late start (probe BF, run 53).
                return _lag_reason(lagged[0], k)
            # exp(Δ[t]·A) computed in the step, the earliest step the chain reaches reading time
            # index k > 0: a loop over range(k, L) from a state made before it.
            return (f"a linear recurrence whose first step reads its inputs at time index {k}, not 0 "
                    "(a loop that starts late from a state computed before it, or a state reset): "
                    "left alone; a scan is rewritten when it runs every step from t = 0")
        return ("a linear recurrence h = a_t*h + x_t whose decay a_t is not a time slice of exp(Δ·A); "
                "left alone")
    if ts is None and exp_behind(c):
        # exp(Δ·A) with a Δ that has no time axis (S4D's learned per-channel step, probe AZ): the
        # op takes Δ per (batch, dim, time), and no proof here reads one from a Δ without time.
        return ("a linear recurrence h = exp(Δ·A)*h + x_t whose Δ has no time axis (the same step at every t, "
                "as in S4D): left alone, since ssm.selective_scan reads Δ per (batch, dim, time); a Δ "
                "materialised per (batch, dim, time) before the loop (dt[None, :, None].repeat(b, 1, L), "
                "dt[:, None] * torch.ones(b, d, L)) passes this check, an expand of it does not; the "
                "rest of the recurrence (a Δ·B·u input term, a real A) is then checked as for any scan")
    if ts is None:
        return ("a linear recurrence h = c*h + x_t with a time-invariant decay c (an EMA), not exp(Δ_t·A): "
                "left alone, since ssm.selective_scan would compute c as exp(log c), which is not exactly c")
    if val(ts[0]).dim() != 4:
        return (f"a linear recurrence h = a_t*h + x_t whose decay is a time slice of a {val(ts[0]).dim()}-D "
                "tensor, not of a (batch, dim, time, state) exp(Δ·A): left alone")
    if is_number(H) and val(c).dtype.is_floating_point and not _exact_number(H, val(c).dtype):
        return (f"a linear recurrence from the number {H!r} as its initial state, which {val(c).dtype} does not "
                "hold exactly: eager multiplies the first decay by the number itself (in float32 for a 16-bit "
                "state), and the op would start from its rounding to the state's dtype; left alone "
                "(torch.full(shape, value) of that dtype is rewritten)")
    if not isinstance(H, torch.fx.Node):
        return (f"a linear recurrence from an initial state {H!r} that is not a tensor of the state's shape: "
                "left alone")
    lagged = sorted(i for i in _addend_indices(m) if i != ts[2])
    if lagged:
        # deltaA[:, :, t + 1] * h + dBu[:, :, t], or dBu[:, :, max(t - 1, 0)] from step 1 on: the
        # chain's steps pair a decay with another step's input term, whatever step it starts at
        # (probe BY: this read as a reset or a late start).
        return _lag_reason(lagged[0], ts[2])
    return (f"a linear recurrence that starts at time index {ts[2]}, not 0 (a state reset or a late start "
            "splits the loop): left alone")


def _rewrite_one(gm: torch.fx.GraphModule, ctx: PassContext, tried: set) -> bool:
    graph = gm.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    products = _products(graph)
    for user, a0, H in _anchors(products):
        if (user, a0) in tried:
            continue
        tried.add((user, a0))
        number = None
        if not isinstance(H, torch.fx.Node):
            filled = _state_tensor(graph, user, a0, H)
            if filled is None:
                continue
            number, H = H, filled
            pos, products = {n: i for i, n in enumerate(graph.nodes)}, _products(graph)
        m = match_loop(user, a0, H, products, pos)
        if number is not None and m == _NO_CHAIN:
            m = None  # a slice times a number that starts no loop (``C[:, :, 0] * 2.0``): no recurrence
        first = None
        if m is _PEELED:
            first = _write_first_step(graph, user, a0, H, products, pos)
            if not isinstance(first, str):
                pos, products = {n: i for i, n in enumerate(graph.nodes)}, _products(graph)
                m = match_loop(first.anchor, first.a0, first.zero, products, pos)
            m = _first_step_reason(first, m) or m
        err = m if m is None or isinstance(m, str) else _emit(gm, m, pos)
        if isinstance(first, _FirstStep) and (m is None or err is not None):
            _undo_first_step(graph, first)
            pos, products = {n: i for i, n in enumerate(graph.nodes)}, _products(graph)
        if m is None or err is not None:
            if number is not None:
                # Not rewritten: the user's own product by the number comes back.
                user.args = tuple(number if a is H else a for a in user.args)
                graph.erase_node(H)
                pos, products = {n: i for i, n in enumerate(graph.nodes)}, _products(graph)
            if err is not None:
                ctx.miss(FAMILY, err, [user])
            continue
        decision = {
            "L": m.L,
            "N": _size_repr(val(m.disc.B.node).shape[m.disc.B.roles.index("n")]),
            "layout": _layout(m.disc.a_roles),
            "initial_state": m.init is not None,
            "return_last_state": bool(m.last_users or m.last_views),
            "collector": m.out.kind,
        }
        if first is not None:
            for n in (first.zero, first.a0):
                if not n.users:
                    graph.erase_node(n)
            decision["first_state"] = ("B_full[t=0], read before a loop from t = 1: the op's step 0 from a zero "
                                       "state, since the ops that make Δ and A show Δ·A <= 0")
        emitted = "ssm.selective_scan"
        ctx.rewrite(FAMILY, "unrolled h = A_full[t]*h + B_full[t]", m.loop_nodes, emitted, decision)
        ctx.rewrite("discretization", "exp(Δ·A), Δ·B·u", m.disc.nodes, emitted,
                    {"time_invariant_B": m.disc.time_invariant_B})
        if m.C is not None:
            ctx.rewrite("readout", f"Σ_n h·C, {decision['collector']}", [], emitted,
                        readout_decision(_layout(m.out.roles), m.out.out_node, m.C.roles))
        return True
    return False


def register(pm) -> None:
    pm.add(FAMILY, scan_loop_pass)
