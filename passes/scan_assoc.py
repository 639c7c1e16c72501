"""Recognise the ``associative_scan`` form of the selective scan (family ``scan_assoc``).

HF transformers (``use_associative_scan=True``, its default under torch.compile) computes all
states with::

    def combine_fn(left, right):
        return left[0] * right[0], right[0] * left[1] + right[1]
    _, all_states = associative_scan(combine_fn, (discrete_A, deltaB_u), dim=2, combine_mode=m)
    y = torch.matmul(all_states.transpose(1, 2).to(dtype), C.unsqueeze(-1)).squeeze(-1).transpose(1, 2)
    last_state = all_states[:, :, -1]

which materialises (batch, dim, L, N) states. This pass replaces it with one
``ssm.selective_scan`` (linear memory). What dynamo leaves in the graph depends on the mode:

- ``combine_mode="pointwise"`` (HF on CUDA): ``movedim(x, dim, 0)`` of both inputs, one HOP node
  ``torch.ops.higher_order.associative_scan(subgraph, [a, b], ())`` with the combine as a
  subgraph, ``getitem``s, and ``movedim(o, 0, dim)`` back.
- ``combine_mode="generic"`` (HF on CPU): no HOP. Dynamo inlines torch's recursive odd/even scan:
  ``aten.slice`` with step 2, the combine vmapped and inlined between ``_add_batch_dim`` and
  ``_remove_batch_dim``, then ``stack``/``flatten`` interleaves, ``pad``, ``cat``.

Both are proved by one abstract interpretation along the time axis. Each time-major value is a
list with one entry per time position; an entry is the interval ``(i, j)`` of steps whose
composition it holds (a seed holds ``(t, t)``; ``None`` is padding). Slices, pads, cats and
interleaves move entries around; a combine output is checked symbolically (sympy) to be
``a_l*a_r`` or ``a_r*b_l + b_r`` of inputs whose intervals are adjacent (left then right), and
then holds their union. Because that combine is the composition of the affine maps
``h -> a*h + b``, the states output is the scan exactly when its entry ``t`` is ``(0, t)`` for
every t. The combine's order matters: ``a_l*b_r + b_l`` (the right-to-left composition) or any
nonlinear combine is refused.

Under dynamic shapes (a second sequence length makes dynamo recompile with a symbolic L) the
HOP form is proved as is: its combine doesn't depend on L. The generic form's slices and
interleaves do, so it is interpreted again at every L the graph's shape guards admit (they pin
the odd/even recursion, typically to one length); the rewrite happens only if every admitted
length gives the same proof, and a range too wide to enumerate is recorded as a miss.

Then ``passes.discretize.match_discretization`` proves the inputs are exp(Δ·A) and Δ·B·u, and
``index_term`` proves the readout is Σ_n states·C; the last state is ``states[..., -1, ...]``
along the time axis.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
from typing import Any, Optional, Union

import sympy
import torch
import torch.fx
import torch.nn.functional as F

from .discretize import Source, match_discretization
from .fx_utils import (HOIST_BLOCKED, IDENTITY_FACTORS, IDENTITY_SUMMANDS, ContextRegions, addcmul_operands,
                       dropped_rounding, dtype_of, exp_node_behind, float64_readout, grad_enabled_at, hoist_before,
                       is_call, is_method, mutates, node_order, pinned_int, proof_number, proof_sum, readout_decision,
                       shape_of, time_prefix_source, val)
from .manager import PassContext, PassManager
from .readout import split_state_users
from .scan_inplace import InplaceMiss, find_inplace_scans
from .scan_loop import (emit_or_refusal, emit_selective_scan, first_decay_bounded, first_steps_of,
                        group_layout_refusal, mutated, read_through, written_after)

log = logging.getLogger("ssm_compile")

FAMILY = "scan_assoc"

# Dynamo records vmap's functorch calls through ``torch._functorch.predispatch``; the raw
# ``torch._C._functorch`` spellings are accepted too, in case another torch version records those.
_predispatch = torch._functorch.predispatch
_functorch_c = torch._C._functorch
_VMAP_BOOKKEEPING = (_predispatch.lazy_load_decompositions,
                     _predispatch._vmap_increment_nesting, _functorch_c._vmap_increment_nesting,
                     _predispatch._vmap_decrement_nesting, _functorch_c._vmap_decrement_nesting)
_VMAP_DECREMENT = (_predispatch._vmap_decrement_nesting, _functorch_c._vmap_decrement_nesting)
_ADD_BATCH_DIM = (_predispatch._add_batch_dim, _functorch_c._add_batch_dim)
_REMOVE_BATCH_DIM = (_predispatch._remove_batch_dim, _functorch_c._remove_batch_dim)
_ASSOC_HOP = torch.ops.higher_order.associative_scan
_AUTOGRAD_FUNCTION_HOP = torch.ops.higher_order.autograd_function_apply
_SCAN_HOP = torch.ops.higher_order.scan

_SYMPY_BINARY = {
    operator.mul: operator.mul, torch.mul: operator.mul, "mul": operator.mul,
    operator.add: operator.add, torch.add: operator.add, "add": operator.add,
    operator.sub: operator.sub, torch.sub: operator.sub, "sub": operator.sub,
    operator.truediv: operator.truediv, torch.div: operator.truediv, "div": operator.truediv,
}
_SYMPY_UNARY = {operator.neg: operator.neg, torch.neg: operator.neg, "neg": operator.neg}

Interval = Optional[tuple[int, int]]


class _Fail(Exception):
    pass


class _SymbolicLength(_Fail):
    """The generic form was reached with a symbolic time length; ``scan_assoc_pass`` then proves it
    for every length the graph's guards admit instead."""


# Above this many candidate lengths the guards are not enumerated (the graph is left alone).
_MAX_LENGTHS = 1024


@dataclasses.dataclass(frozen=True)
class SymbolicRun:
    """The entries of a time axis of symbolic length (dynamic shapes): every entry is one step
    ``(t, t)`` (``kind="steps"``) or a prefix ``(0, t)`` (``kind="prefixes"``). The HOP form is
    proved at a symbolic length; the generic form's slices need a concrete one, so it is
    re-interpreted at every length its guards admit (``_regions_at_every_length``)."""

    kind: str
    length: Any


@dataclasses.dataclass
class Seq:
    """A time-major value (time on axis 0): entry k holds the composition of steps ``iv[k]``."""

    leaf: torch.fx.Node     # the seed (``movedim(input, dim, 0)``) whose component this is
    iv: Union[tuple[Interval, ...], SymbolicRun]

    def entries(self) -> tuple[Interval, ...]:
        if isinstance(self.iv, SymbolicRun):
            raise _SymbolicLength("the time axis has a symbolic length")
        return self.iv

    def is_steps(self) -> bool:
        if isinstance(self.iv, SymbolicRun):
            return self.iv.kind == "steps"
        return self.iv == tuple((t, t) for t in range(len(self.iv)))

    def is_prefixes(self) -> bool:
        if isinstance(self.iv, SymbolicRun):
            return self.iv.kind == "prefixes"
        return self.iv == tuple((0, t) for t in range(len(self.iv)))


@dataclasses.dataclass
class Batched:
    """A value inside the inlined vmap of the combine: a sympy expression of its inputs."""

    expr: sympy.Expr


@dataclasses.dataclass
class Stacked:
    """``stack([a, b], dim=1)`` of two Seqs, waiting for the ``flatten`` that interleaves them."""

    pairs: tuple[tuple[Interval, Interval], ...]
    leaf: torch.fx.Node


@dataclasses.dataclass
class HopOut:
    outs: list[Seq]


Abstract = Union[Seq, Batched, Stacked, HopOut]


@dataclasses.dataclass(eq=False)
class Region:
    """One associative scan found in the graph, as the interpretation saw it."""

    seeds: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    nodes: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    roles: dict[torch.fx.Node, str] = dataclasses.field(default_factory=dict)
    outputs: list[tuple[torch.fx.Node, Seq]] = dataclasses.field(default_factory=list)
    saw_combine: bool = False
    mode: str = "generic"
    failure: Optional[str] = None
    symbolic: bool = False      # failed only because the time length is symbolic
    proved_lengths: tuple[int, ...] = ()    # the lengths a symbolic-length region was proved at




# ---------------------------------------------------------------------------------------------
# The combine proof
# ---------------------------------------------------------------------------------------------

def _adjacent(left: Interval, right: Interval) -> bool:
    return left is not None and right is not None and left[1] + 1 == right[0]


def _expr_of(node: Any, env: dict[torch.fx.Node, sympy.Expr], identities: tuple[int, ...] = ()) -> sympy.Expr:
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return proof_number(node, identities, _combine_fail)
    if isinstance(node, torch.fx.Node) and node in env:
        return env[node]
    raise _Fail(f"the combine uses {node!r}, which is not one of its inputs or a number")


def _combine_fail(reason: str) -> _Fail:
    return _Fail(f"the combine {reason}")


def _summed(left: sympy.Expr, right: sympy.Expr) -> sympy.Expr:
    return proof_sum(left, right, _combine_fail)


_IDENTITIES = {operator.add: (IDENTITY_SUMMANDS, IDENTITY_SUMMANDS), operator.sub: (IDENTITY_SUMMANDS, IDENTITY_SUMMANDS),
               operator.mul: (IDENTITY_FACTORS, IDENTITY_FACTORS), operator.truediv: ((), IDENTITY_FACTORS)}


def _eval_arith(node: torch.fx.Node, env: dict[torch.fx.Node, sympy.Expr]) -> sympy.Expr:
    """Evaluate one elementwise arithmetic node symbolically; anything else is refused."""
    key = node.target
    fused = addcmul_operands(node)
    if fused is not None:
        # ``torch.addcmul(b_r, a_r, b_l)``: b_r + a_r * b_l, the combine's b half in one call.
        c = _expr_of(fused[0], env, IDENTITY_SUMMANDS)
        a, b = (_expr_of(x, env, IDENTITY_FACTORS) for x in fused[1:])
        return _summed(c, a * b)
    if is_call(node, torch.addcmul) or is_method(node, "addcmul"):
        raise _Fail(f"the combine calls addcmul with {dict(node.kwargs) or 'extra arguments'}: only "
                    "addcmul(c, a, b) with value 1 is c + a*b")
    if node.kwargs:
        raise _Fail(f"the combine calls {node.target} with keyword arguments")
    if key in _SYMPY_BINARY and len(node.args) == 2:
        op = _SYMPY_BINARY[key]
        left, right = (_expr_of(x, env, ids) for x, ids in zip(node.args, _IDENTITIES[op]))
        if op is operator.truediv and right.free_symbols:
            # sympy cancels x / x to 1; the floats do not where x is 0 (a decay that underflowed).
            raise _Fail("the combine divides by one of its inputs, which algebra would cancel where the "
                        "floats give NaN (a decay of 0)")
        if op is operator.add:
            return _summed(left, right)
        if op is operator.sub:
            return _summed(left, -right)
        return op(left, right)
    if key in _SYMPY_UNARY and len(node.args) == 1:
        return _SYMPY_UNARY[key](_expr_of(node.args[0], env))
    raise _Fail(f"the combine applies {getattr(key, '__name__', key)}, which is not linear-recurrence "
                "arithmetic (mul/add/sub/div/neg, addcmul with value 1)")


def prove_combine(sub: torch.fx.GraphModule, num_extra: int = 0) -> tuple[int, int] | str:
    """Check the HOP's combine subgraph is ``(a_l*a_r, a_r*b_l + b_r)`` up to algebra.

    The subgraph takes the flattened leaves ``(x0_l, x1_l, x0_r, x1_r)``, then ``num_extra``
    lifted symbolic sizes, which the arithmetic must not use. Returns ``(p, q)``: leaf ``p`` is
    the multiplier ``a`` and leaf ``q`` the offset ``b``; or why it is not.
    """
    env: dict[torch.fx.Node, sympy.Expr] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 4 + num_extra:
        return f"the combine takes {len(placeholders) - num_extra} inputs; expected two pairs (a, b)"
    placeholders = placeholders[:4]
    syms = sympy.symbols("x0_l x1_l x0_r x1_r")
    env.update(zip(placeholders, syms))
    outs: list[sympy.Expr] = []
    try:
        for node in sub.graph.nodes:
            if node.op in ("call_function", "call_method"):
                env[node] = _eval_arith(node, env)
            elif node.op == "output":
                outs = [_expr_of(o, env) for o in node.args[0]]
            elif node.op != "placeholder":
                return f"the combine contains a {node.op} node"
    except _Fail as e:
        return str(e)
    if len(outs) != 2:
        return f"the combine returns {len(outs)} values; expected 2"
    x0l, x1l, x0r, x1r = syms
    leaves = ((x0l, x0r), (x1l, x1r))
    for p, q in ((0, 1), (1, 0)):
        (al, ar), (bl, br) = leaves[p], leaves[q]
        if (sympy.expand(outs[p] - al * ar) == 0
                and sympy.expand(outs[q] - (ar * bl + br)) == 0):
            return p, q
    return (f"the combine computes ({outs[0]}, {outs[1]}), not the linear-recurrence combine "
            "(a_l*a_r, a_r*b_l + b_r)")


# ---------------------------------------------------------------------------------------------
# The abstract interpretation
# ---------------------------------------------------------------------------------------------

class _Interpreter:
    """Interpret ``gm`` once. With ``lengths`` (symbol -> int) every symbolic size is evaluated at
    that assignment, so the generic form's slices and interleaves can be followed exactly."""

    def __init__(self, gm: torch.fx.GraphModule, lengths: Optional[dict[sympy.Symbol, sympy.Integer]] = None):
        self.gm = gm
        self.lengths = lengths
        self.values: dict[torch.fx.Node, Abstract] = {}
        self.region_of: dict[torch.fx.Node, Region] = {}   # seed -> region
        self.symbols: dict[sympy.Symbol, Seq] = {}
        self.pending: list[torch.fx.Node] = []               # vmap bookkeeping not yet owned
        self.last_region: Optional[Region] = None

    # -- regions --------------------------------------------------------------------------
    def region(self, leaf: torch.fx.Node) -> Region:
        return self.region_of[leaf]

    def merge(self, a: Region, b: Region) -> Region:
        if a is b:
            return a
        a.seeds += b.seeds
        a.nodes += b.nodes
        a.roles.update(b.roles)
        a.outputs += b.outputs
        a.saw_combine |= b.saw_combine
        a.failure = a.failure or b.failure
        for seed in b.seeds:
            self.region_of[seed] = a
        return a

    def set_role(self, region: Region, leaf: torch.fx.Node, role: str) -> None:
        if region.roles.setdefault(leaf, role) != role:
            raise _Fail("one scan input is used both as the multiplier and as the offset")

    # -- driver ---------------------------------------------------------------------------
    def run(self) -> list[Region]:
        for node in self.gm.graph.nodes:
            if is_call(node, *_VMAP_BOOKKEEPING):
                self.pending.append(node)
                if is_call(node, *_VMAP_DECREMENT) and self.last_region is not None:
                    self.last_region.nodes += self.pending
                    self.pending = []
                continue
            inputs = [a for a in node.all_input_nodes if a in self.values]
            if not inputs:
                self._maybe_seed(node)
                continue
            region = self._region_of_value(self.values[inputs[0]])
            for other in inputs[1:]:
                region = self.merge(region, self._region_of_value(self.values[other]))
            if region.failure is not None:
                continue
            try:
                out = self._transfer(node, region)
            except _Fail as e:
                region.failure = str(e)
                region.symbolic = isinstance(e, _SymbolicLength)
                continue
            region.nodes.append(node)
            if self.pending and out is not None:
                region.nodes += self.pending
                self.pending = []
            self.last_region = region
            if out is not None:
                self.values[node] = out
        regions = []
        for r in self.region_of.values():
            if r not in regions and (r.saw_combine or r.mode == "pointwise" or r.symbolic):
                regions.append(r)   # identity: Region compares by object (eq=False)
        return regions

    def _region_of_value(self, v: Abstract) -> Region:
        if isinstance(v, (Seq, Stacked)):
            return self.region(v.leaf)
        if isinstance(v, HopOut):
            return self.region(v.outs[0].leaf)
        # A batched value always has a symbol: constants are never given an abstract value.
        return self.region(self.symbols[next(iter(v.expr.free_symbols))].leaf)

    def _maybe_seed(self, node: torch.fx.Node) -> None:
        if not (is_call(node, torch.movedim) or is_method(node, "movedim")) or len(node.args) != 3:
            return
        x, src, dst = node.args
        shape = shape_of(x)
        if shape is None or dst != 0 or not isinstance(src, int) or len(shape) < 2:
            return
        try:
            length = self._concrete(shape[src])
        except _Fail:
            return   # an axis sized by other symbols than the time length's: not a scan's time axis
        steps = (tuple((t, t) for t in range(length)) if isinstance(length, int)
                 else SymbolicRun("steps", length))
        self.values[node] = Seq(node, steps)
        self.region_of[node] = Region(seeds=[node], nodes=[node])

    # -- transfer functions ---------------------------------------------------------------
    def _concrete(self, x: Any) -> Any:
        """``x`` with its symbolic sizes (SymInts, or nodes computing them) evaluated at
        ``self.lengths``. Without an assignment only the sizes the shape environment has pinned
        to a number become ints (torch 2.11 leaves such SymInts in checkpoint bodies); the
        rest stay as they are."""
        if isinstance(x, (list, tuple)):
            return type(x)(self._concrete(e) for e in x)
        v = val(x) if isinstance(x, torch.fx.Node) else x
        if self.lengths is None:
            pinned = pinned_int(v) if isinstance(v, torch.SymInt) else None
            return x if pinned is None else pinned
        if isinstance(v, torch.SymInt):
            size = v.node.expr.xreplace(self.lengths)
            if not size.is_Integer:
                raise _Fail(f"a size of the scan, {size}, depends on more than the time length")
            return int(size)
        return x

    def _transfer(self, node: torch.fx.Node, region: Region) -> Optional[Abstract]:
        args = [self.values[a] if isinstance(a, torch.fx.Node) and a in self.values else self._concrete(a)
                for a in node.args]
        if is_call(node, torch.ops.aten.slice, torch.ops.aten.slice.Tensor):
            return self._slice(args)
        if is_call(node, *_ADD_BATCH_DIM):
            x, bdim, _level = args
            if not isinstance(x, Seq) or bdim != 0:
                raise _Fail("a vmapped combine input is not batched over time")
            if any(i is None for i in x.entries()):
                raise _Fail("padding reaches a combine")
            region.saw_combine = True
            sym = sympy.Symbol(f"v{len(self.symbols)}")
            self.symbols[sym] = x
            return Batched(sym)
        if is_call(node, *_REMOVE_BATCH_DIM):
            x, _level, _size, out_dim = args
            if not isinstance(x, Batched) or out_dim != 0:
                raise _Fail("a vmapped combine output is not batched over time")
            region.saw_combine = True
            return self._combined(x.expr, region)
        if all(isinstance(a, Batched) or isinstance(a, (int, float)) for a in args) and \
                any(isinstance(a, Batched) for a in args):
            env = {a: self.values[a].expr for a in node.all_input_nodes}
            expr = _eval_arith(node, env)
            if not expr.free_symbols:
                raise _Fail("the combine computes a constant")
            return Batched(expr)
        if is_call(node, torch.stack):
            return self._stack(node, args)
        if is_call(node, torch.flatten) or is_method(node, "flatten"):
            return self._flatten(node, args)
        if is_call(node, F.pad, torch._C._nn.pad):
            return self._pad(node, args)
        if is_call(node, torch.cat, torch.concat):
            return self._cat(node, args)
        if is_call(node, torch.select_copy) and isinstance(args[0], Seq):
            # The HOP's example slice for tracing its subgraph; never read.
            return None
        if is_call(node, _ASSOC_HOP):
            return self._hop(node, args, region)
        if (is_call(node, torch.flip) or is_method(node, "flip")) and isinstance(args[0], Seq):
            # associative_scan(reverse=True) flips time first: h_t would depend on later steps.
            region.saw_combine = True
            raise _Fail("the scan runs in reverse (reverse=True flips time); ssm.selective_scan "
                        "scans forward")
        if is_method(node, "size") and isinstance(args[0], (Seq, Stacked)):
            # vmap reads the batch size of each combine level (``child.size(0)``); dynamo records
            # the read when the size is a SymInt, even one pinned to a number (a dynamic batch
            # with L specialised). A size is no value of the scan.
            return None
        if is_call(node, operator.getitem) and isinstance(args[0], HopOut):
            return args[0].outs[args[1]]
        if (is_call(node, torch.movedim) or is_method(node, "movedim")) and isinstance(args[0], Seq):
            if args[1] != 0:
                raise _Fail("a time-major value is moved from an axis other than time")
            region.outputs.append((node, args[0]))
            return None
        raise _Fail(f"the scan's values reach {node.name} ({node.target}), which is not part of "
                    "torch's associative_scan")

    def _slice(self, args) -> Seq:
        x, dim, *rest = args
        if not isinstance(x, Seq) or dim != 0:
            raise _Fail("a slice of the scan is not along time")
        start, end, step = (rest + [None, None, None])[:3]
        return Seq(x.leaf, x.entries()[slice(start, end, step if step is not None else 1)])

    def _stack(self, node, args) -> Stacked:
        items = node.args[0]
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        seqs = [self.values.get(i) for i in items]
        if dim != 1 or len(seqs) != 2 or not all(isinstance(s, Seq) for s in seqs):
            raise _Fail("a stack in the scan is not the odd/even interleave")
        a, b = seqs
        if a.leaf is not b.leaf or len(a.entries()) != len(b.entries()):
            raise _Fail("the interleave mixes the two scan components")
        return Stacked(tuple(zip(a.entries(), b.entries())), a.leaf)

    def _flatten(self, node, args) -> Seq:
        x = args[0]
        start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
        end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
        if not isinstance(x, Stacked) or start != 0 or end != 1:
            raise _Fail("a flatten in the scan is not the odd/even interleave")
        return Seq(x.leaf, tuple(itertools.chain.from_iterable(x.pairs)))

    def _pad(self, node, args) -> Seq:
        x, pad = args[0], args[1]
        mode = node.kwargs.get("mode", args[2] if len(args) > 2 else "constant")
        ndim = len(shape_of(node.args[0]))
        if (not isinstance(x, Seq) or mode != "constant" or len(pad) != 2 * ndim
                or any(p != 0 for p in pad[:-2])):
            raise _Fail("a pad in the scan is not the interleave's time padding")
        return Seq(x.leaf, (None,) * pad[-2] + x.entries() + (None,) * pad[-1])

    def _cat(self, node, args) -> Seq:
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        seqs = [self.values.get(i) for i in node.args[0]]
        if dim != 0 or not all(isinstance(s, Seq) for s in seqs):
            raise _Fail("a cat in the scan is not along time")
        if len({s.leaf for s in seqs}) != 1:
            raise _Fail("a cat mixes the two scan components")
        return Seq(seqs[0].leaf, tuple(itertools.chain.from_iterable(s.entries() for s in seqs)))

    def _hop(self, node, args, region: Region) -> HopOut:
        region.mode = "pointwise"
        sub_node, xs, extra = node.args
        # With dynamic shapes dynamo lifts the symbolic sizes into the combine as extra inputs;
        # a lifted tensor would be a closure the op can't take.
        if (len(xs) != 2 or sub_node.op != "get_attr"
                or any(isinstance(val(e), torch.Tensor) for e in extra)):
            raise _Fail("the associative_scan HOP must scan exactly two tensors with no tensor "
                        "closed over by the combine")
        seqs = [self.values.get(x) for x in xs]
        if not all(isinstance(s, Seq) for s in seqs):
            raise _Fail("the associative_scan HOP's inputs are not time-major scan inputs")
        if not all(s.is_steps() for s in seqs):
            raise _Fail("the associative_scan HOP's inputs are not single time steps")
        proof = prove_combine(getattr(self.gm, sub_node.target), num_extra=len(extra))
        if isinstance(proof, str):
            raise _Fail(proof)
        p, q = proof
        self.set_role(region, seqs[p].leaf, "a")
        self.set_role(region, seqs[q].leaf, "b")
        region.nodes.append(sub_node)
        region.saw_combine = True
        steps = seqs[0].iv
        prefixes = (SymbolicRun("prefixes", steps.length) if isinstance(steps, SymbolicRun)
                    else tuple((0, t) for t in range(len(steps))))
        return HopOut([Seq(s.leaf, prefixes) for s in seqs])

    def _combined(self, expr: sympy.Expr, region: Region) -> Seq:
        """Interpret one output of the inlined combine as a composition of adjacent steps."""
        syms = sorted(expr.free_symbols, key=str)
        seq = {s: self.symbols[s] for s in syms}
        iv = {s: q.entries() for s, q in seq.items()}
        if len(syms) == 2:
            for left, right in (syms, syms[::-1]):
                if (sympy.expand(expr - left * right) == 0 and seq[left].leaf is seq[right].leaf
                        and all(map(_adjacent, iv[left], iv[right]))):
                    self.set_role(region, seq[left].leaf, "a")
                    return Seq(seq[left].leaf, _union(iv[left], iv[right]))
        if len(syms) == 3:
            for a_r, b_l, b_r in itertools.permutations(syms):
                if (sympy.expand(expr - (a_r * b_l + b_r)) == 0
                        and seq[a_r].leaf is not seq[b_l].leaf and seq[b_l].leaf is seq[b_r].leaf
                        and iv[a_r] == iv[b_r] and all(map(_adjacent, iv[b_l], iv[b_r]))):
                    self.set_role(region, seq[a_r].leaf, "a")
                    self.set_role(region, seq[b_l].leaf, "b")
                    return Seq(seq[b_l].leaf, _union(iv[b_l], iv[b_r]))
        raise _Fail(f"the combine computes {expr}, not a_l*a_r or a_r*b_l + b_r of adjacent steps")


def _union(left: tuple[Interval, ...], right: tuple[Interval, ...]) -> tuple[Interval, ...]:
    return tuple((lo[0], hi[1]) for lo, hi in zip(left, right))


# ---------------------------------------------------------------------------------------------
# Rewrite
# ---------------------------------------------------------------------------------------------

def _rewrite(gm: torch.fx.GraphModule, ctx: PassContext, region: Region) -> None:
    seeds = [s for s in region.seeds if s in region.roles]
    a_seed = next((s for s in seeds if region.roles[s] == "a"), None)
    b_seed = next((s for s in seeds if region.roles[s] == "b"), None)
    if a_seed is None or b_seed is None or len(region.seeds) != 2:
        ctx.miss(FAMILY, "the scan does not combine exactly one multiplier and one offset input",
                 region.seeds)
        return
    states = [n for n, s in region.outputs if s.leaf is b_seed and s.is_prefixes()]
    products = [n for n, s in region.outputs if s.leaf is a_seed and s.is_prefixes()]
    if len(states) != 1 or len(states) + len(products) != len(region.outputs):
        ctx.miss(FAMILY, "the scan's outputs are not the inclusive scan of (a, b)", region.seeds)
        return
    (all_states,) = states
    # From here the scan is recognised: each miss, not explain's orphaned-exp(Δ·A) one, is the
    # reason (probe CG), so it covers the exp the scan reads.
    recognised = _recognised(a_seed.args[0])
    if any(p.users for p in products):
        ctx.miss(FAMILY, "the cumulative product of the multipliers is used; only the states "
                 "can be produced by ssm.selective_scan", products, covers=recognised)
        return
    t_axis = b_seed.args[1] % len(shape_of(b_seed.args[0]))
    if (all_states.args[2] % len(shape_of(all_states)) != t_axis
            or a_seed.args[1] % len(shape_of(a_seed.args[0])) != t_axis):
        ctx.miss(FAMILY, "the scan moves time back to another axis than it came from", [all_states],
                 covers=recognised)
        return
    decision = {"combine_mode": region.mode}
    if region.proved_lengths:
        decision["proved_lengths"] = list(region.proved_lengths)
    rewrite_states(gm, ctx, a_seed.args[0], b_seed.args[0], t_axis, all_states, region.nodes,
                   f"associative_scan({region.mode})", decision, dead=products)


def _recognised(a_full: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes a recognised scan's miss speaks for: its multiplier and the exp(Δ·A) behind it,
    through a flip along time (a scan of ``(dA.flip(t), dBu.flip(t))``)."""
    inner = a_full.args[0] if (is_call(a_full, torch.flip) or is_method(a_full, "flip")) and a_full.args else a_full
    return [a_full, *filter(None, [exp_node_behind(inner)])]


def rewrite_states(gm: torch.fx.GraphModule, ctx: PassContext, a_full: torch.fx.Node, b_full: torch.fx.Node,
                   t_axis: int, all_states: torch.fx.Node, scan_nodes: list[torch.fx.Node], pattern: str,
                   decision: dict[str, Any], dead: list[torch.fx.Node] = ()) -> None:
    """Replace ``all_states`` (the inclusive scan of (a_full, b_full) along ``t_axis``, in
    b_full's layout, computed by ``scan_nodes``) and its readout with one ``ssm.selective_scan``.

    ``dead`` are other outputs of the scan that nothing uses (erased with it). The scan's own
    in-place updates (an in-place parallel scan writes the buffer the states are a view of) go
    with it; any other write to what the op would read is refused.
    """
    length = shape_of(b_full)[t_axis]
    # The scan is recognised: a refusal below is its reason, not explain's orphaned exp(Δ·A).
    recognised = _recognised(a_full)
    a_src, b_src = a_full, b_full
    if isinstance(length, int):
        # A scan over a prefix of precomputed tensors (``(dA[:, :, :k], dBu[:, :, :k])``): step t
        # of the prefix is step t of the whole, and the op reads u, Δ and B through their first k.
        a_src, b_src = time_prefix_source(a_full, t_axis), time_prefix_source(b_full, t_axis)
    disc = match_discretization(a_src, b_src, t_axis)
    if isinstance(disc, str):
        sliced = next((n for n in (a_src, b_src) if (is_call(n, operator.getitem) or is_method(n, "narrow"))
                       and isinstance(n.args[0], torch.fx.Node)), None)
        if sliced is not None:
            disc += (f"; the scan reads {sliced.name}, a slice of {sliced.args[0].name} that is not a prefix of its "
                     f"time axis alone ({sliced.args[0].name}[:, :, k:]?): the op scans from time 0")
        ctx.miss("discretization", disc, [a_full, b_full], covers=recognised)
        return
    if dtype_of(all_states) == torch.float64 and dtype_of(disc.u.node) != torch.float64:
        # The op accumulates in float32 unless u is float64: states the user computes in float64
        # would silently lose precision.
        ctx.miss(FAMILY, f"the states are computed in float64 but u is {dtype_of(disc.u.node)}: the op "
                 "would accumulate in float32", [all_states], covers=recognised)
        return
    roles = disc.b_roles
    # An in-place scan's own updates and views of its buffer use the states node too; those
    # whose every user is in the scan are replaced with it (a view read outside, ``hs[:, -1]``,
    # is not one of them: it must be a last state).
    inside = set(scan_nodes)
    producers = frozenset(n for n in scan_nodes if all(u in inside for u in n.users))
    users = split_state_users(all_states, roles, t_axis, length, producers)
    if isinstance(users, str):
        ctx.miss("readout", users, [all_states], covers=recognised)
        return
    readout, lasts = users
    wide = float64_readout(readout.end, disc.u.node)
    if wide is not None:
        ctx.miss("readout", wide, [readout.end], covers=recognised)
        return
    order = node_order(gm.graph)
    # The op reads the sources themselves, at the readout; the user's code read them through the
    # copies and casts the discretization looks through (``A = A.clone(); A.mul_(2)``), earlier.
    full = {a_full, b_full}
    sources = {disc.u.node, disc.delta.node, disc.A.node, disc.B.node, readout.C}
    reads = read_through(list(full), sources, order) | full | sources
    readout_nodes = [readout.end, *readout.chain, *readout.nodes]
    reads |= read_through(readout_nodes, {readout.C, all_states}, order) | set(readout_nodes)
    own_writes = frozenset(n for n in scan_nodes if mutates(n))
    if mutated(all_states, ignore=own_writes):
        # HF's ``ssm_state = all_states[:, :, -1]`` later copied over by a decode step, say.
        ctx.miss(FAMILY, f"the states ({all_states.name}) are written in place after the scan, through them or a "
                 "view of them (a last state updated in a cache): the op returns y and the last state as new "
                 "tensors, not the states' memory", [all_states], covers=[*recognised, *disc.nodes])
        return
    # A source filled in place before it is made (``xs[:, k] = ...; u = xs.view(...)``) is read
    # after its writes by the user's code and the op alike (``written_after``).
    written = next((n for n in sorted(reads, key=order.__getitem__) if written_after(n, order, own_writes)), None)
    if written is not None:
        # The scan was recognised (probe BC: explain also reported an orphaned exp(Δ·A)).
        ctx.miss(FAMILY, f"a value the scan reads its inputs through ({written.name}) is written in place after it "
                 "is made", [all_states], covers=[*recognised, *disc.nodes])
        return
    anchor = min([readout.end] + lasts, key=order.__getitem__)
    # The op must run under the grad mode / autocast / functorch state the states and the
    # readout ran under.
    graph = gm.graph
    replaced = [*scan_nodes, *disc.nodes, *readout_nodes, *lasts, all_states]
    refusal = (group_layout_refusal(disc, Source(readout.C, readout.C_roles), flip_C=False,
                                    grad=grad_enabled_at(all_states))
               or dropped_rounding([*replaced, *reads], [disc.u.node, disc.delta.node, disc.B.node, readout.C],
                                   also_read=[disc.A.node], inputs_as_read=True)
               or ContextRegions(graph).refusal(replaced, anchor))
    if refusal is not None:
        # The scan was recognised: this miss, not explain's orphaned-exp(Δ·A) one, is the reason.
        ctx.miss(FAMILY, refusal, [all_states], covers=[*recognised, *disc.nodes])
        return
    hoisted = hoist_before(readout.C, anchor, all_states)
    if hoisted is not None:
        ctx.miss("readout", "C is computed from the states" if hoisted == HOIST_BLOCKED else f"C: {hoisted}",
                 [readout.C], covers=recognised)
        return
    size = dict(zip(roles, shape_of(all_states)))
    # Where the signs are not shown, the op starts from b_0 instead (``first_state_is_input``).
    bounded = first_decay_bounded(disc)
    emitted = emit_or_refusal(graph, anchor, lambda: emit_selective_scan(
        graph, first_steps_of(graph, disc, length), Source(readout.C, readout.C_roles),
        y_roles=readout.out_roles, y_dtype=dtype_of(readout.end),
        last_state_roles=tuple(r for r in roles if r != "t") if lasts else None,
        last_state_dtype=dtype_of(lasts[0]) if lasts else None, first_state_is_input=not bounded))
    if isinstance(emitted, str):
        # The scan was recognised: this miss, not explain's orphaned-exp(Δ·A) one, is the reason.
        ctx.miss(FAMILY, emitted, [all_states], covers=[*recognised, *disc.nodes])
        return
    y_user, last_user = emitted
    readout.end.replace_all_uses_with(y_user)
    for node in lasts:
        node.replace_all_uses_with(last_user)
    _erase_dead(graph, [readout.end] + readout.chain + readout.nodes + lasts + [all_states] + list(dead) + scan_nodes)
    decision = {"L": _static(length), "N": _static(size["n"]), **decision, "layout": "".join(roles),
                "last_state": bool(lasts)}
    if not bounded:
        decision["first_state"] = _FIRST_STATE_NOTE
    ctx.rewrite(FAMILY, pattern, scan_nodes, "ssm.selective_scan.default", decision)
    ctx.rewrite("discretization", "exp(Δ·A), Δ·B·u", disc.nodes, "ssm.selective_scan.default",
                {"time_invariant_B": disc.time_invariant_B})
    ctx.rewrite("readout", "Σ_n h·C", readout.nodes, "ssm.selective_scan.default",
                readout_decision("".join(readout.out_roles), readout.end, readout.C_roles))


# For explain: why the op was handed h_{-1} = B_full[t=0] and a Δ copy (``scan_loop.first_decay_bounded``).
_FIRST_STATE_NOTE = ("B_full[t=0] as h_{-1} with Δ[t=0] = 0 (the graph does not show Δ·A <= 0, so exp(Δ·A) at "
                     "t = 0 may be infinite, and the op must not multiply it by a zero state; Δ = softplus(...) "
                     "and A = -exp(A_log) show it and save this copy of Δ)")


def _static(size: Any) -> int | str:
    """A size for the rewrite record: the int, or the symbol's text under dynamic shapes."""
    return size if isinstance(size, int) else str(size)


def _erase_dead(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Erase the replaced nodes that nothing reads any more.

    The vmap bookkeeping calls (nesting levels) go last, and only once every batched value
    between them is gone: a batched value left behind without its nesting level can't run.
    """
    order = node_order(graph)
    alive = sorted(set(nodes), key=order.__getitem__, reverse=True)
    bookkeeping = [n for n in alive if is_call(n, *_VMAP_BOOKKEEPING)]
    # Reverse graph order: a node's users are erased before it is looked at.
    for node in alive:
        if node not in bookkeeping and not node.users and node.op != "placeholder":
            graph.erase_node(node)
    if any(is_call(n, *_ADD_BATCH_DIM, *_REMOVE_BATCH_DIM) for n in graph.nodes if n in order):
        return
    for node in bookkeeping:
        graph.erase_node(node)


def _admissible_lengths(lengths: list[torch.SymInt]) -> tuple[sympy.Symbol, list[int]] | str:
    """Every value of the time length's symbol that the graph's shape guards admit.

    Dynamo runs this graph only for inputs that pass its guards, and the generic form's guards
    pin its recursion (so usually one length, or a few). Proving the scan at each admitted value
    therefore proves the graph for every input it will ever see.
    """
    symbols = set().union(*(s.node.expr.free_symbols for s in lengths))
    if len(symbols) != 1:
        return f"the time length depends on {len(symbols)} symbols; expected one"
    (sym,) = symbols
    shape_env = lengths[0].node.shape_env
    bounds = shape_env.var_to_range[sym]
    # Guards on other sizes too (batch, dim) are left out: that only admits more lengths, each of
    # which is then proved, so the result stays sound. A guard on another input's length that
    # dynamo later found equal to this one (``Eq(s16, s27)``) is read in this one's symbol.
    guards = [e for e in (shape_env.replace(g.expr) for g in shape_env.guards) if e.free_symbols == {sym}]
    upper = bounds.upper
    for bound in (_guarded_upper(g, sym, int(bounds.lower)) for g in guards):
        if bound is not None and bool(bound < upper):
            upper = bound
    if bool(upper > bounds.lower + _MAX_LENGTHS):
        return (f"the time length {sym} ranges over {bounds.lower}..{upper}; a scan whose "
                f"ops depend on it is proved length by length, for at most {_MAX_LENGTHS} lengths")
    admitted = [n for n in range(int(bounds.lower), int(upper) + 1)
                if all(bool(g.xreplace({sym: sympy.Integer(n)})) for g in guards)]
    if not admitted:
        return f"no length of {sym} in {bounds.lower}..{upper} passes the graph's guards"
    return sym, admitted


# Functions of one argument that never decrease as it grows (torch's sympy functions, by name:
# ``OpaqueUnaryFn_log2`` is made at import).
_NONDECREASING = ("CeilToInt", "FloorToInt", "TruncToInt", "RoundToInt", "ToFloat", "OpaqueUnaryFn_log2",
                  "OpaqueUnaryFn_log", "OpaqueUnaryFn_exp", "OpaqueUnaryFn_sqrt")


def _direction(e: sympy.Expr, sym: sympy.Symbol) -> Optional[int]:
    """1 where ``e`` never decreases as ``sym`` grows, -1 where it never increases, 0 where it
    does not depend on it, None where these rules cannot tell."""
    if sym not in e.free_symbols:
        return 0
    if e == sym:
        return 1
    name = type(e).__name__
    if name in _NONDECREASING and len(e.args) == 1:
        return _direction(e.args[0], sym)
    if name in ("FloorDiv", "IntTrueDiv", "FloatTrueDiv") and sym not in e.args[1].free_symbols:
        return _direction(e.args[0], sym) if e.args[1].is_positive else None
    if name == "PowByNatural" and sym not in e.args[0].free_symbols:
        # A natural power of a base of at least 1 grows with the exponent.
        return _direction(e.args[1], sym) if bool(e.args[0] >= 1) else None
    if isinstance(e, sympy.Mul):
        variable = [a for a in e.args if sym in a.free_symbols]
        constant = sympy.Mul(*(a for a in e.args if sym not in a.free_symbols))
        if len(variable) != 1 or not (constant.is_positive or constant.is_negative):
            return None
        inner = _direction(variable[0], sym)
        return None if inner is None else inner * (1 if constant.is_positive else -1)
    if isinstance(e, (sympy.Add, sympy.Max, sympy.Min)):
        directions = {_direction(a, sym) for a in e.args} - {0}
        return directions.pop() if len(directions) == 1 and None not in directions else None
    return None


def _guarded_upper(guard: sympy.Basic, sym: sympy.Symbol, lower: int) -> Optional[int]:
    """The largest length from ``lower`` on that ``guard`` can admit, where a (relaxed) part of
    it reads ``f(sym) <= 0`` with f never decreasing: past the first length where f is positive
    it stays positive. dynamo's guards bound the length that way where its range does not
    (mamba.py's ``2 ** ceil(log2(L)) == 16`` pins L to 9..16 while its range stays 2..int_oo).
    None where no part does so within ``_MAX_LENGTHS`` lengths of ``lower``."""
    parts = guard.args if isinstance(guard, sympy.And) else (guard,)
    excesses = []
    for r in parts:
        if isinstance(r, (sympy.Eq, sympy.Le, sympy.Lt)):
            excesses.append(r.lhs - r.rhs)
        if isinstance(r, (sympy.Eq, sympy.Ge, sympy.Gt)):
            excesses.append(r.rhs - r.lhs)
    best = None
    for f in excesses:
        if _direction(f, sym) != 1:
            continue

        def admits(n: int) -> bool:
            return bool(f.xreplace({sym: sympy.Integer(n)}) <= 0)

        try:
            if not admits(lower):
                return lower - 1
            good, step = lower, 1
            while admits(good + step):
                good += step
                step *= 2
                if good > lower + _MAX_LENGTHS:
                    break
            else:
                # Between good (admitted) and good + step (not): halve the gap.
                bad = good + step
                while bad - good > 1:
                    mid = (good + bad) // 2
                    good, bad = (mid, bad) if admits(mid) else (good, mid)
                best = good if best is None else min(best, good)
        except TypeError:
            # A value sympy cannot order: no bound from this part.
            continue
    return best


def _summary(region: Region) -> tuple:
    """What the rewrite reads from a region, to compare the interpretations at several lengths."""
    return (region.failure, region.mode, tuple(n.name for n in region.nodes),
            tuple(sorted((n.name, r) for n, r in region.roles.items())),
            tuple((n.name, s.leaf.name, s.is_prefixes()) for n, s in region.outputs))


def _regions_at_every_length(gm: torch.fx.GraphModule, symbolic: list[Region],
                             values: dict[torch.fx.Node, Abstract]) -> list[Region]:
    """Re-interpret the regions that stopped at a symbolic length, once per admitted length.

    A region is kept (as interpreted at the first length) only if every length gives the same
    proof; otherwise its failure says at which length it broke. A region that is no scan at all
    at a concrete length (a ``movedim`` that merely looked like a seed) is dropped.
    """
    runs: dict[tuple[sympy.Symbol, int], list[Region]] = {}
    regions = []
    for region in symbolic:
        lengths = [values[s].iv.length for s in region.seeds if isinstance(values[s].iv, SymbolicRun)]
        admissible = _admissible_lengths(lengths)
        if isinstance(admissible, str):
            region.failure = admissible
            regions.append(region)
            continue
        sym, admitted = admissible
        proved: Optional[Region] = None
        for n in admitted:
            if (sym, n) not in runs:
                runs[sym, n] = _Interpreter(gm, {sym: sympy.Integer(n)}).run()
            # The symbolic run stopped each seed at its first slice, before the combine joined
            # them: the concrete region holds this one's seeds and possibly more.
            found = next((r for r in runs[sym, n] if set(region.seeds) <= set(r.seeds)), None)
            if found is None:
                break
            if found.failure is not None:
                region.failure = f"at {sym}={n}: {found.failure}"
                break
            if proved is not None and _summary(found) != _summary(proved):
                region.failure = f"at {sym}={n}: the scan differs from the one at {sym}={admitted[0]}"
                break
            proved = proved or found
        else:
            proved.proved_lengths = tuple(admitted)
            log.debug("scan_assoc: proved the generic form at %s in %s", sym, admitted)
            region = proved
        if found is not None and region not in regions:
            regions.append(region)
    return regions


def scan_assoc_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    interpreter = _Interpreter(gm)
    regions = interpreter.run()
    symbolic = [r for r in regions if r.symbolic]
    if symbolic:
        regions = ([r for r in regions if not r.symbolic]
                   + _regions_at_every_length(gm, symbolic, interpreter.values))
    log.debug("scan_assoc: %d associative scan(s) in the graph", len(regions))
    for region in regions:
        if region.failure is not None:
            ctx.miss(FAMILY, region.failure, region.seeds)
            continue
        _rewrite(gm, ctx, region)
    for found in find_inplace_scans(gm, _admissible_lengths):
        # scan_loop, which runs first, read the in-place updates as a loop and said why that is
        # not one; the in-place scan's own account replaces it. Only at this scan's nodes: a
        # reason met in two sweeps is one miss at the nodes of both (PassContext.miss), and the
        # first sweep's rewrite left it standing for both (probe BE, run 53).
        ctx.withdraw("scan_loop", {n.name for n in found.nodes})
        if isinstance(found, InplaceMiss):
            ctx.miss(FAMILY, f"in-place parallel scan: {found.reason}", found.seeds)
            continue
        decision = {"combine_mode": "in-place"}
        if found.proved_lengths:
            decision["proved_lengths"] = list(found.proved_lengths)
        rewrite_states(gm, ctx, found.a_full, found.b_full, found.t_axis, found.states, found.nodes,
                       "parallel scan (in place)", decision)
    _report_scans_in_autograd_functions(gm, ctx)
    _report_scan_hops(gm, ctx)


def _report_scan_hops(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """torch's own ``scan`` higher-order op (``torch._higher_order_ops.scan``) keeps the step
    function as a subgraph that no pass reads; say so, rather than leave the user guessing."""
    for node in gm.graph.nodes:
        if is_call(node, _SCAN_HOP):
            ctx.miss(FAMILY, "torch's scan higher-order op (torch._higher_order_ops.scan) is not matched: its "
                     "step function is a subgraph, and only unrolled loops, associative_scan and in-place "
                     "parallel scans are proved; the recurrence runs as written", [node])


def _report_scans_in_autograd_functions(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """Under grad, dynamo keeps a custom ``autograd.Function`` (mamba.py's PScan) as one HOP with
    the user's forward and backward as subgraphs. A scan in that forward is not rewritten: the
    op's gradient would replace the user's backward, which nothing proves equal to it. Say so."""
    for node in gm.graph.nodes:
        if not is_call(node, _AUTOGRAD_FUNCTION_HOP) or not node.args:
            continue
        body = node.args[0]
        fwd = getattr(gm, body.target, None) if isinstance(body, torch.fx.Node) and body.op == "get_attr" else None
        if isinstance(fwd, torch.fx.GraphModule) and find_inplace_scans(fwd, _admissible_lengths):
            ctx.miss(FAMILY, "an in-place parallel scan inside a custom autograd.Function: its backward is "
                     "the user's own code, which ssm.selective_scan's gradient would replace, so it is "
                     "left alone (without grad, e.g. under torch.no_grad(), dynamo inlines the forward "
                     "and the scan is rewritten)", [node])


def register(pm: PassManager) -> None:
    pm.add("scan_assoc", scan_assoc_pass)
