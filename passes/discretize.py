"""Prove that two tensors are Mamba's zero-order-hold discretisation, and find its sources.

A scan pass finds a linear recurrence ``h_t = A_full[t] * h_{t-1} + B_full[t]``; the recurrence
is ``ssm.selective_scan`` only if, for some Δ, A, B, u::

    A_full[b, d, t, n] == exp(Δ[b, d, t] * A[d, n])
    B_full[b, d, t, n] == Δ[b, d, t] * B[b, n, t] * u[b, d, t]     (or B[d, n]: time-invariant)

with the *same* Δ in both. User code spells this with broadcasting (``A[None, :, None, :] *
dt[..., None]``), einsum (``'bdl,dn->bdln'``), transposes and dtype casts. Instead of matching
spellings, ``index_term`` evaluates a node as an index expression — a product of leaf tensors
whose axes carry labels, plus the labels summed over — by looking through products, einsum,
views that only add/drop/permute/broadcast axes, and dtype casts. The proof is then a statement
about labels: which leaf carries which of (batch, dim, time, state).

``match_step_discretization`` proves the same for code that discretises inside its loop, one
step at a time, from time slices of the full Δ, B, u. The same evaluator proves readouts
(``Σ_n h[b, d, n] · C[b, n]``); ``scan_loop`` and ``scan_assoc`` import it.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import re
from typing import Any, Sequence

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .fx_utils import (bare_name, detach_note, dtype_of, exp_node_behind, flip_dims, higher_order_op, hop_name, is_call,
                       is_cast, is_exp, is_method, layout_source, named_args, ndim_of, parse_slice,
                       protects_saved_input, squeezed_unit_piece, unit_piece, val, view_chain, view_perm)

__all__ = [
    "Source",
    "Discretized",
    "IndexTerm",
    "index_term",
    "match_discretization",
    "match_step_discretization",
    "unscanned_discretizations",
    "view_source",
    "grouped_source",
    "product_parts",
    "two_sides",
    "product_source",
    "ROLES",
]

# Role letters: batch, dim (channel), time, state.
ROLES = ("b", "d", "t", "n")

_MUL = (operator.mul, torch.mul, torch.Tensor.mul)


@dataclasses.dataclass(frozen=True)
class Source:
    """A graph value feeding the scan and the role of each of its axes, e.g. ``roles=("b","t","d")``."""

    node: torch.fx.Node
    roles: tuple[str, ...]

    def perm_to(self, order: str) -> tuple[int, ...]:
        """The permutation that brings this value into ``order`` (a string of role letters)."""
        return tuple(self.roles.index(r) for r in order)


# A B without a time axis, sorted roles: one per channel and state (mamba_ssm's is_variable_B=False),
# one per state shared by the channels, or one per batch element and state (the same at every step).
_INVARIANT_B_ROLES = (["d", "n"], ["n"], ["b", "n"])


@dataclasses.dataclass
class Discretized:
    """The proof's result: what ``ssm.selective_scan`` needs, each with its axis roles.

    ``B.roles`` is ``("b","n","t")`` in some order for the selective case, ``("b","g","n","t")``
    for grouped B (the source before its ``repeat_interleave`` over channels), or a time-invariant
    B: ``("d","n")`` (which the op takes as it is), ``("n",)`` or ``("b","n")`` (the op reads those
    through stride-0 views). ``a_roles``/``b_roles`` are the roles of A_full's and B_full's
    axes. ``nodes`` are the nodes the proof looked through (for the rewrite record).
    """

    u: Source
    delta: Source
    A: Source
    B: Source
    a_roles: tuple[str, ...]
    b_roles: tuple[str, ...]
    nodes: list[torch.fx.Node]
    negate_A: bool = False  # A_full = exp(-(Δ·A)): the op gets -A
    # A_full and B_full are the flips along time of the proved exp(Δ·A) and Δ·B·u (a reverse
    # loop read forward, ``unreverse_loops``): the op reads u, Δ and B flipped along time.
    flip_time: bool = False

    @property
    def time_invariant_B(self) -> bool:
        return "t" not in self.B.roles


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[int, int] = {}
        self._next = itertools.count()

    def fresh(self) -> int:
        x = next(self._next)
        self.parent[x] = x
        return x

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, x: int, y: int) -> None:
        self.parent[self.find(x)] = self.find(y)


@dataclasses.dataclass
class Factor:
    node: torch.fx.Node
    labels: tuple[int, ...]  # one label per axis of node's value


@dataclasses.dataclass
class IndexTerm:
    """``out[labels] = Σ_{summed} Π factors`` (optionally wrapped in one ``exp``).

    Labels are union-find ids; call ``resolve`` before comparing them.
    """

    factors: list[Factor]
    out: tuple[int, ...]
    summed: set[int]
    uf: _UnionFind
    exp_of: "IndexTerm | None" = None
    looked_through: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    # Set on the term ``index_term`` returns: the term of every node it looked through, in the
    # same labels, so a caller can find which graph value holds a sub-product of the factors.
    parts: dict[torch.fx.Node, list["IndexTerm"]] = dataclasses.field(default_factory=dict)
    # -1 when the product is negated (``exp(-Δ·A)``); only evaluated with ``allow_neg``.
    sign: int = 1

    def factor_labels(self, f: Factor) -> tuple[int, ...]:
        return tuple(self.uf.find(x) for x in f.labels)

    def out_labels(self) -> tuple[int, ...]:
        return tuple(self.uf.find(x) for x in self.out)

    def summed_labels(self) -> set[int]:
        return {self.uf.find(x) for x in self.summed}


def _size(node: Any, i: int):
    return val(node).shape[i]


def _is_one(s) -> bool:
    return statically_known_true(s == 1)


def _same(s1, s2) -> bool:
    return statically_known_true(s1 == s2)


def _dims_arg(node: torch.fx.Node, pos: int, name: str):
    if len(node.args) > pos:
        rest = node.args[pos:]
        return rest[0] if len(rest) == 1 else tuple(rest)
    return node.kwargs.get(name)


def _spell_ellipsis(ins: list[str], out: str, values: list[Any]) -> tuple[list[str], str] | None:
    """Replace einsum's ``...`` by letters: the k-th axis from the right of every ``...`` is one
    index (``'...dn,...n->...d'``), as einsum broadcasts them; size-1 axes are dealt with by the
    caller exactly as for named axes."""
    if "..." not in "".join(ins) + out:
        return ins, out
    if any(s.replace("...", "", 1).count(".") for s in ins + [out]):
        return None
    spare = [ch for ch in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if ch not in "".join(ins) + out]
    widths = []
    for sub, v in zip(ins, values):
        if not isinstance(v, torch.Tensor):
            return None
        widths.append(v.dim() - (len(sub) - 3) if "..." in sub else 0)
    width = max(widths)
    if min(widths) < 0 or width > len(spare):
        return None
    letters = spare[:width]
    ins = [sub.replace("...", "".join(letters[width - w:])) for sub, w in zip(ins, widths)]
    return ins, out.replace("...", "".join(letters))


class _Evaluator:
    """Evaluate a node as an IndexTerm, stopping at ``stop`` nodes and at anything not
    structural (those become leaf factors with fresh labels)."""

    def __init__(self, stop: set[torch.fx.Node], allow_exp: bool, allow_sum: bool, allow_neg: bool = False):
        self.stop = stop
        self.allow_exp = allow_exp
        self.allow_neg = allow_neg
        self.allow_sum = allow_sum
        self.uf = _UnionFind()
        self.parts: dict[torch.fx.Node, list[IndexTerm]] = {}

    def leaf(self, node: torch.fx.Node) -> IndexTerm:
        labels = tuple(self.uf.fresh() for _ in range(val(node).dim()))
        return IndexTerm([Factor(node, labels)], labels, set(), self.uf)

    def term(self, node: Any, top: bool = False) -> IndexTerm | None:
        v = val(node)
        if not isinstance(node, torch.fx.Node) or not isinstance(v, torch.Tensor):
            return None
        if node in self.stop:
            return self.leaf(node)
        t = self._structural(node, top)
        if t is None:
            return self.leaf(node)
        t.looked_through.append(node)
        self.parts.setdefault(node, []).append(t)
        return t

    def _structural(self, node: torch.fx.Node, top: bool) -> IndexTerm | None:
        # Each branch returns None when the node is not a pure relabelling/product; it then
        # becomes a leaf, which keeps the evaluator sound: it never claims more than it proved.
        if top and self.allow_exp and is_exp(node):
            if len(node.args) != 1 or node.kwargs:
                # ``torch.exp(x, out=y)`` writes y: not read as an exp here (a leaf). (An exp by
                # keyword, ``torch.exp(input=x)``, reaches here positional: passes/keywords.py.)
                return None
            inner = self.term(node.args[0])
            if inner is None:
                return None
            return IndexTerm([], inner.out, set(), self.uf, exp_of=inner,
                             looked_through=inner.looked_through)
        if self.allow_neg and (is_call(node, operator.neg, torch.neg) or is_method(node, "neg")) \
                and len(node.args) == 1 and not node.kwargs:
            # -(Δ·A) is Δ·(-A) exactly (negation is exact and rounding is symmetric), so an
            # exponent's matcher can hand the op a negated A.
            inner = self.term(node.args[0])
            return None if inner is None else dataclasses.replace(inner, sign=-inner.sign)
        copy = (is_method(node, "contiguous", "clone") and len(node.args) == 1
                and set(node.kwargs) <= {"memory_format"})
        if is_cast(node) or copy:
            # Same values: the op reads any strides, so the copy is not needed for the scan,
            # unless it keeps what the op saves apart from memory the caller may write. A copy
            # (or a cast to the same dtype, ``.to(dtype, copy=True)``) of an exp is still that
            # exp (probe CX: ``exp(Δ·A).clone()`` was "not exp(Δ·A)"); a cast that changes the
            # dtype is not, as the exp's rounding is part of the value.
            same = copy or dtype_of(node) == dtype_of(node.args[0])
            # The op reads Δ and A, never the exp's value: a copy of the exp keeps nothing the op
            # saves apart from the caller, so only a copy of a value the op would read must stay.
            of_exp = top and same and self.allow_exp and is_exp(node.args[0])
            return None if protects_saved_input(node) and not of_exp else self.term(node.args[0], top and same)
        if is_call(node, *_MUL) or is_method(node, "mul"):
            if len(node.args) != 2 or node.kwargs:
                return None
            return self._mul(node, node.args[0], node.args[1])
        if is_call(node, torch.einsum, torch.functional.einsum):
            return self._einsum(node)
        if is_call(node, torch.matmul, operator.matmul) or is_method(node, "matmul"):
            return self._matmul(node)
        if (is_call(node, torch.bmm) or is_method(node, "bmm")) and len(node.args) == 2 and not node.kwargs:
            # bmm is matmul restricted to two 3-D operands with the same batch size (it refuses
            # anything else at run time), and _matmul checks the batch sizes match: same term.
            return self._matmul(node)
        if self.allow_sum and (is_call(node, torch.sum) or is_method(node, "sum")):
            return self._sum(node)
        if self.allow_sum and is_call(node, torch.linalg.vecdot):
            return self._vecdot(node)
        return self._view(node, top)

    def _vecdot(self, node) -> IndexTerm | None:
        """``linalg.vecdot(x, y, dim=d)`` is ``sum(x.conj() * y, d)`` over the broadcast shape;
        for real x the conjugate is x itself."""
        if len(node.args) != 2 or set(node.kwargs) - {"dim"}:
            return None
        x, y = node.args
        if not all(isinstance(a, torch.fx.Node) and isinstance(val(a), torch.Tensor)
                   and val(a).is_floating_point() for a in (x, y)):
            return None
        dim = node.kwargs.get("dim", -1)
        shape = torch.broadcast_shapes(val(x).shape, val(y).shape)
        if not isinstance(dim, int) or not shape:
            return None
        t = self._mul(node, x, y, shape)
        if t is None:
            return None
        d = dim % len(t.out)
        return self._combine([t], t.out[:d] + t.out[d + 1:], {t.out[d]})

    def _mul(self, node, x, y, out_shape=None) -> IndexTerm | None:
        tx, ty = self.term(x), self.term(y)
        if tx is None or ty is None:
            return None
        out_shape = val(node).shape if out_shape is None else out_shape
        out: list[int] = []
        rank = len(out_shape)
        for i in range(rank):
            labels = []
            for t, src in ((tx, x), (ty, y)):
                j = i - (rank - len(t.out))
                if j >= 0 and _same(_size(src, j), out_shape[i]):
                    labels.append(t.out[j])
            if not labels:
                labels = [self.uf.fresh()]
            for other in labels[1:]:
                self.uf.union(other, labels[0])
            out.append(labels[0])
        return self._combine([tx, ty], tuple(out), set())

    def _combine(self, terms, out, summed) -> IndexTerm | None:
        if any(t.exp_of is not None for t in terms):
            return None
        factors = [f for t in terms for f in t.factors]
        summed = set(summed).union(*(t.summed for t in terms))
        through = [n for t in terms for n in t.looked_through]
        sign = 1
        for t in terms:
            sign *= t.sign
        return IndexTerm(factors, out, summed, self.uf, looked_through=through, sign=sign)

    def _einsum(self, node) -> IndexTerm | None:
        eq, *ops = node.args
        if isinstance(eq, str) and len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = list(ops[0])
        if not isinstance(eq, str) or node.kwargs:
            return None
        eq = eq.replace(" ", "")
        m = re.fullmatch(r"([a-zA-Z,.]+)->([a-zA-Z.]*)", eq)
        if m is None:
            return None
        ins, outs = m.group(1).split(","), m.group(2)
        if len(ins) != len(ops):
            return None
        spelled = _spell_ellipsis(ins, outs, [val(o) for o in ops])
        if spelled is None:
            return None
        ins, outs = spelled
        if len(set(outs)) != len(outs):
            return None
        terms = [self.term(o) for o in ops]
        if any(t is None for t in terms):
            return None
        letter: dict[str, int] = {}
        # Whether every axis a letter has labelled so far is of size 1: such a letter is either a
        # real index of size 1 (batch 1: the same in every operand) or broadcast against a later
        # operand's full axis, which then owns it.
        only_ones: dict[str, bool] = {}
        for sub, t, o in zip(ins, terms, ops):
            if len(sub) != len(t.out):
                return None
            for ch, lab, i in zip(sub, t.out, range(len(sub))):
                one = _is_one(_size(o, i))
                if ch not in letter:
                    letter[ch], only_ones[ch] = lab, one
                elif one and not only_ones[ch]:
                    # A size-1 operand axis broadcasts against the letter's full axis: no index.
                    continue
                elif only_ones[ch] and not one:
                    # The earlier size-1 axes broadcast against this one, which owns the letter.
                    letter[ch], only_ones[ch] = lab, False
                else:
                    self.uf.union(lab, letter[ch])
        if any(ch not in letter for ch in outs):
            return None
        summed = {letter[ch] for ch in letter if ch not in outs}
        return self._combine(terms, tuple(letter[ch] for ch in outs), summed)

    def _matmul(self, node) -> IndexTerm | None:
        x, y = node.args[0], node.args[1]
        tx, ty = self.term(x), self.term(y)
        if tx is None or ty is None or len(tx.out) < 2 or len(ty.out) < 2:
            return None
        self.uf.union(tx.out[-1], ty.out[-2])
        # Batch axes broadcast as in an elementwise product (aligned from the right; a size-1
        # axis of one operand takes the other's), e.g. C[:, None, None, :, t] @ h.unsqueeze(-1).
        bx, by = tx.out[:-2], ty.out[:-2]
        out_batch = val(node).shape[:-2]
        rank = len(out_batch)
        out = []
        for i in range(rank):
            labels = []
            for b, src in ((bx, x), (by, y)):
                j = i - (rank - len(b))
                if j >= 0 and _same(_size(src, j), out_batch[i]):
                    labels.append(b[j])
            if not labels:
                return None
            for other in labels[1:]:
                self.uf.union(other, labels[0])
            out.append(labels[0])
        return self._combine([tx, ty], tuple(out) + (tx.out[-2], ty.out[-1]), {tx.out[-1]})

    def _sum(self, node) -> IndexTerm | None:
        # sum(input, dim, keepdim=False, *, dtype=None): a second positional is keepdim, not a
        # second axis (``x.sum(-1, True)``).
        a = named_args(node, ("input", "dim", "keepdim"))
        x, dims, keepdim = a.get("input"), a.get("dim"), a.get("keepdim", False)
        if (dims is None or not isinstance(keepdim, bool) or len(node.args) > 3
                or set(node.kwargs) - {"dim", "keepdim"}):
            return None
        t = self.term(x)
        if t is None:
            return None
        rank = len(t.out)
        dims = [dims] if isinstance(dims, int) else list(dims)
        # An empty list sums every axis (``sum([])``), not none.
        if not dims or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            return None
        dims = {d % rank for d in dims}
        # keepdim leaves a size-1 axis where each summed one was: a new label, as unsqueeze's.
        out = tuple(self.uf.fresh() if i in dims else lab
                    for i, lab in enumerate(t.out) if keepdim or i not in dims)
        return self._combine([t], out, {t.out[i] for i in dims})

    def _view(self, node, top: bool) -> IndexTerm | None:
        """Views that only insert/drop size-1 axes, permute, or broadcast-expand. At the top, a
        view of ``exp(...)`` (``exp(Δ[t]·A).unsqueeze(-1)``) is exp of the same view of its
        argument: a view moves, inserts or repeats elements, which commutes with an elementwise exp."""
        if not node.args:
            return None
        x = node.args[0]
        src = val(x)
        if not isinstance(x, torch.fx.Node) or not isinstance(src, torch.Tensor):
            return None
        out_shape = val(node).shape
        if is_method(node, "unsqueeze") or is_call(node, torch.unsqueeze):
            t = self.term(x, top)
            if t is None:
                return None
            dim = _dims_arg(node, 1, "dim") % (len(t.out) + 1)
            return self._relabel(t, t.out[:dim] + (self.uf.fresh(),) + t.out[dim:])
        if is_method(node, "permute") or is_call(node, torch.permute):
            perm = _dims_arg(node, 1, "dims")
            if isinstance(perm, int):
                perm = (perm,)
            t = self.term(x, top)
            if t is None or not all(isinstance(p, int) for p in perm):
                return None
            return self._relabel(t, tuple(t.out[p % len(t.out)] for p in perm))
        if is_method(node, "transpose", "swapaxes") or is_call(node, torch.transpose):
            t = self.term(x, top)
            d0, d1 = node.args[1:3] if len(node.args) >= 3 else (None, None)
            if t is None or not isinstance(d0, int) or not isinstance(d1, int):
                return None
            out = list(t.out)
            d0, d1 = d0 % len(out), d1 % len(out)
            out[d0], out[d1] = out[d1], out[d0]
            return self._relabel(t, tuple(out))
        if is_method(node, "expand", "expand_as"):
            t = self.term(x, top)
            if t is None:
                return None
            lead = len(out_shape) - len(t.out)
            out = [self.uf.fresh() for _ in range(lead)]
            for i, lab in enumerate(t.out):
                out.append(lab if _same(src.shape[i], out_shape[lead + i]) else self.uf.fresh())
            return self._relabel(t, tuple(out))
        if is_method(node, "squeeze") or is_call(node, torch.squeeze):
            if squeezed_unit_piece(node) is not None:
                # ``x.narrow(t, i, 1).squeeze(t)``, ``x.split(1, t)[i].squeeze(t)``: a select,
                # so a leaf like ``x[..., i]`` (time_slice reads it), not a relabelled piece.
                return None
            dims = _dims_arg(node, 1, "dim")
            if dims is None:
                return None
            dims = [dims] if isinstance(dims, int) else list(dims)
            return self._drop_ones(x, [d % src.dim() for d in dims], top)
        if is_method(node, "view", "reshape") or is_call(node, torch.reshape):
            return self._reshape_ones(x, out_shape, top)
        if is_call(node, operator.getitem):
            return self._getitem(node, x, src, top)
        perm = view_perm(node)
        if perm is not None:
            # The other spellings of a permutation (``movedim``, ``swapdims``, ``.mT``, ``.t()``):
            # the same values with axes relabelled, as permute above (probe CV: ``dBu.movedim(2,
            # -1)`` was "not a product Δ·B·u" where the same movedim of exp(Δ·A) was seen through).
            t = self.term(x, top)
            return None if t is None else self._relabel(t, tuple(t.out[p] for p in perm))
        return None

    def _relabel(self, t: IndexTerm, out: tuple[int, ...]) -> IndexTerm:
        return IndexTerm(t.factors, out, t.summed, self.uf, t.exp_of, t.looked_through, sign=t.sign)

    def _drop_ones(self, x, dims, top: bool) -> IndexTerm | None:
        src = val(x)
        dims = [d for d in dims if _is_one(src.shape[d])]
        t = self.term(x, top)
        if t is None:
            return None
        return self._relabel(t, tuple(lab for i, lab in enumerate(t.out) if i not in dims))

    def _reshape_ones(self, x, out_shape, top: bool) -> IndexTerm | None:
        src = val(x).shape
        keep_in = [i for i, s in enumerate(src) if not _is_one(s)]
        keep_out = [i for i, s in enumerate(out_shape) if not _is_one(s)]
        if len(keep_in) != len(keep_out) or not all(
            _same(src[i], out_shape[j]) for i, j in zip(keep_in, keep_out)
        ):
            return None
        t = self.term(x, top)
        if t is None:
            return None
        out = [self.uf.fresh() for _ in out_shape]
        for i, j in zip(keep_in, keep_out):
            out[j] = t.out[i]
        return self._relabel(t, tuple(out))

    def _getitem(self, node, x, src, top: bool) -> IndexTerm | None:
        idx = node.args[1]
        idx = idx if isinstance(idx, tuple) else (idx,)
        n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
        if sum(1 for i in idx if i is Ellipsis) > 1:
            return None
        expanded: list[Any] = []
        for i in idx:
            if i is Ellipsis:
                expanded.extend([slice(None)] * (src.dim() - n_real))
            else:
                expanded.append(i)
        expanded.extend([slice(None)] * (src.dim() - sum(1 for i in expanded if i is not None)))
        out: list[Any] = []
        axis = 0
        for i in expanded:
            if i is None:
                out.append(self.uf.fresh())
                continue
            if isinstance(i, slice) and i == slice(None):
                out.append(("keep", axis))
            elif isinstance(i, int) and _is_one(src.shape[axis]) and i in (0, -1):
                pass
            else:
                return None
            axis += 1
        t = self.term(x, top)
        if t is None:
            return None
        return self._relabel(t, tuple(t.out[o[1]] if isinstance(o, tuple) else o for o in out))


def index_term(node: torch.fx.Node, stop: Sequence[torch.fx.Node] = (), *, allow_exp: bool = False,
               allow_sum: bool = False, allow_neg: bool = False) -> IndexTerm | None:
    """Evaluate ``node`` as an index expression (see module docstring); None if it isn't a tensor.

    ``stop`` nodes are always leaves. ``allow_exp`` lets the top node be ``exp(...)``;
    ``allow_sum`` lets ``sum(dim)`` contract axes (readouts); ``allow_neg`` looks through
    negations, counting them in the term's ``sign`` (otherwise a negation is a leaf).
    """
    ev = _Evaluator(set(stop), allow_exp, allow_sum, allow_neg)
    t = ev.term(node, top=True)
    if t is not None:
        t.parts = ev.parts
    return t


def view_source(node: torch.fx.Node, roles: Sequence[str]) -> Source:
    """The value ``node`` is a pure view/cast of, with its axis roles (``node`` itself if none).

    ``roles`` are the roles of ``node``'s axes. Looking through transposes, permutes, size-1
    axis edits and dtype casts lets the op read the original tensor through one permuted view
    instead of a chain of them.
    """
    t = index_term(node)
    if t is None or t.summed or len(t.factors) != 1:
        return Source(node, tuple(roles))
    out = t.out_labels()
    leaf = t.factor_labels(t.factors[0])
    if len(set(out)) != len(out) or sorted(out) != sorted(leaf):
        return Source(node, tuple(roles))
    role = dict(zip(out, roles))
    return Source(t.factors[0].node, tuple(role[lab] for lab in leaf))


def _unit_axis_source(node: Any) -> tuple[torch.fx.Node, list[int]] | None:
    """``x`` and the positions j at which ``node`` is ``x`` with one size-1 axis inserted:
    ``x.unsqueeze(j)``, ``x[:, :, None]``, or a ``view`` / ``reshape`` whose shape only adds a 1.

    A view may admit several j (next to another size-1 axis); they give the same values, so the
    caller may take whichever fits its roles.
    """
    if not isinstance(node, torch.fx.Node) or not node.args:
        return None
    x = node.args[0]
    if not (isinstance(x, torch.fx.Node) and isinstance(val(x), torch.Tensor)
            and isinstance(val(node), torch.Tensor)):
        return None
    rank = val(x).dim()
    if (is_call(node, torch.unsqueeze) or is_method(node, "unsqueeze")) and len(node.args) == 2:
        j = node.args[1]
        return (x, [j % (rank + 1)]) if isinstance(j, int) else None
    if is_call(node, operator.getitem):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if index.count(None) != 1 or index.count(Ellipsis) > 1:
            return None
        if Ellipsis in index:
            e = index.index(Ellipsis)
            index = index[:e] + (slice(None),) * (rank + 1 - len(index)) + index[e + 1:]
        full = slice(None)
        if len(index) > rank + 1 or any(i is not None and i != full for i in index):
            return None
        return x, [index.index(None)]
    if is_method(node, "reshape", "view") or is_call(node, torch.reshape):
        xs, vs = val(x).shape, val(node).shape
        if len(vs) != rank + 1:
            return None
        js = [j for j in range(rank + 1) if statically_known_true(vs[j] == 1)
              and all(statically_known_true(a == b) for a, b in zip(xs, vs[:j] + vs[j + 1:]))]
        return (x, js) if js else None
    return None


def _broadcast_unit_axis(node: Any) -> tuple[torch.fx.Node, list[int]] | None:
    """``node`` broadcasts one inserted size-1 axis of a tensor to H copies, as ``expand``,
    ``broadcast_to``, or ``repeat`` / ``tile`` with every other count 1 (a copy, the same
    values): the inserting node's source and the candidate positions of that axis."""
    if not isinstance(node, torch.fx.Node) or not node.args:
        return None
    inner = node.args[0]
    unit = _unit_axis_source(inner)
    if unit is None:
        return None
    if is_method(node, "expand") or is_call(node, torch.broadcast_to):
        # expand may only grow size-1 axes; the inserted one is among them, and the reshape's
        # shape check pins which axes grew.
        return unit
    if is_method(node, "repeat", "tile"):
        reps = node.args[1:]
        if len(reps) == 1 and isinstance(reps[0], (tuple, list, torch.Size)):
            reps = tuple(reps[0])
        if node.kwargs or len(reps) != val(inner).dim():
            return None
        x, js = unit
        ones = [i for i, r in enumerate(reps) if statically_known_true(val(r) == 1)]
        js = [j for j in js if set(ones) >= set(range(len(reps))) - {j}]
        return (x, js) if js else None
    return None


def _expand_reshape_group(node: torch.fx.Node, roles: Sequence[str]) -> Source | None:
    """Undo a group broadcast spelled as a new axis: einops' ``repeat(x, "b g n l -> b (g h) n l")``,
    which dynamo traces as ``x.unsqueeze(k + 1).expand(..., H, ...).reshape(..., G * H, ...)``
    (mamba_ssm's ``selective_scan_ref``), and VMamba's ``selective_scan_torch``,
    ``B.view(b, K, 1, N, L).repeat(1, 1, H, 1, 1).view(b, K * H, N, L)``; any mix of the
    insertion, broadcast and merge spellings that ``_unit_axis_source``, ``_broadcast_unit_axis``
    and a row-major reshape / flatten admit.

    Only the new axis right *after* the group axis k gives channel d = g·H + h, i.e. group d // H;
    the op's rule. ``"(h g)"`` (the new axis before k) tiles the groups, channel d reading group
    d % G: a different function, so it is refused here.
    """
    if not ((is_method(node, "reshape", "view", "flatten") or is_call(node, torch.reshape, torch.flatten))
            and node.args):
        return None
    expand = node.args[0]
    found = _broadcast_unit_axis(expand)
    if found is None:
        return None
    x, js = found
    # A row-major reshape is determined by its target shape alone, so checking the shapes below
    # checks the merge, whichever op spelled it.
    xs, es, out = val(x).shape, val(expand).shape, val(node).shape
    if len(xs) != len(roles) or len(out) != len(roles) or len(es) != len(xs) + 1:
        return None
    for j in js:
        k = j - 1
        if k < 0 or roles[k] != "d":
            continue
        # Only the new axis is broadcast; the reshape keeps every other axis and merges (G, H)
        # into one.
        if not all(statically_known_true(es[i if i < j else i + 1] == xs[i]) for i in range(len(xs))):
            continue
        if not all(statically_known_true(out[i] == xs[i]) for i in range(len(xs)) if i != k):
            continue
        if not statically_known_true(out[k] == xs[k] * es[j]):
            continue
        g_roles = tuple(roles[:k]) + ("g",) + tuple(roles[k + 1:])
        return view_source(x, g_roles)
    return None


def grouped_source(node: torch.fx.Node, roles: Sequence[str]) -> Source:
    """A per-channel B or C (``roles`` has "d") in the op's grouped layout, axis "g".

    Grouped B/C (batch, G, N, L) reach per-channel code repeated H = dim // G times along the
    channel axis (channel d uses group d // H), which is exactly the op's grouped layout: a
    ``x.repeat_interleave(H, dim=k)`` along the dim axis is undone to x, axis k = "g", and so is
    the einops spelling of the same broadcast (``_expand_reshape_group``). Any other per-channel
    value is itself the grouped layout with G = dim, one group per channel (mamba_ssm's
    ``selective_scan_fn`` documents B (batch, G, N, L) with G = dim; its reference's einops repeat
    then has H = 1, which dynamo's values make a view the evaluator looks through, probe CY): the
    op reads it as it is. That covers a broadcast in another order too (``"b g n l -> b (h g) n
    l"``, channel d reading group d % G): the op reads the program's own per-channel copy.
    """
    undone = _undo_group_broadcast(node, roles)
    if undone is not None:
        return undone
    return Source(node, tuple("g" if r == "d" else r for r in roles))


def _undo_group_broadcast(node: torch.fx.Node, roles: Sequence[str]) -> Source | None:
    if not (is_call(node, torch.repeat_interleave) or is_method(node, "repeat_interleave")):
        return _expand_reshape_group(node, roles)
    x = node.args[0]
    reps = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if set(node.kwargs) - {"repeats", "dim", "output_size"} or not isinstance(reps, int):
        return None
    if not isinstance(dim, int) or not isinstance(val(x), torch.Tensor) or val(x).dim() != len(roles):
        return None
    dim %= len(roles)
    if roles[dim] != "d":
        return None
    g_roles = tuple(roles[:dim]) + ("g",) + tuple(roles[dim + 1:])
    return view_source(x, g_roles)


def _roles_of(term: IndexTerm, f: Factor, role: dict[int, str]) -> tuple[str, ...] | None:
    labels = term.factor_labels(f)
    if len(set(labels)) != len(labels) or any(lab not in role for lab in labels):
        return None
    return tuple(role[lab] for lab in labels)


def _broadcast_roles(term: IndexTerm, f: Factor, role: dict[int, str]) -> tuple[str | None, ...] | None:
    """The role of each axis of a factor; None for a size-1 axis it broadcasts along."""
    roles: list[str | None] = []
    for lab, size in zip(term.factor_labels(f), val(f.node).shape):
        if lab in role:
            roles.append(role[lab])
        elif _is_one(size):
            roles.append(None)
        else:
            return None
    named = [r for r in roles if r is not None]
    return tuple(roles) if len(set(named)) == len(named) else None


def product_source(term: IndexTerm, group: list[Factor], role: dict[int, str]) -> Source | None:
    """A graph value that is exactly the product of the factors in ``group``, with its roles.

    A single factor is its own value. Several (B = weight · rms_normalised(B_raw), as Jamba and
    mambapy's inner layer norms write it) must already be multiplied together by one node the
    evaluator looked through: the op then reads the user's own product, so no new arithmetic
    (and no new rounding) is introduced.
    """
    if len(group) == 1:
        roles = _roles_of(term, group[0], role)
        if roles is not None:
            return Source(group[0].node, roles)
        # An axis the product does not have, looked through by the evaluator (a one-group B read
        # as ``B[:, :, 0]``): the user's view that drops it, if the graph holds one, is the value
        # the op reads (probe BT).
    for node, t in product_parts(term, group):
        labels = t.out_labels()
        if len(set(labels)) != len(labels) or any(lab not in role for lab in labels):
            continue
        return view_source(node, tuple(role[lab] for lab in labels))
    return None


def product_parts(term: IndexTerm, factors: list[Factor]):
    """``(node, its term)`` for each node the evaluator looked through whose value is exactly the
    product of ``factors`` (no sum, no exp, no sign): where the user computed that product."""
    ids = {id(f) for f in factors}
    for node, terms in term.parts.items():
        for t in terms:
            if (not t.summed and t.exp_of is None and t.sign == 1 and len(t.factors) == len(ids)
                    and {id(f) for f in t.factors} == ids):
                yield node, t


def _view_with_roles(term: IndexTerm, src: Source, role: dict[int, str], want: str) -> Source | None:
    """A node the evaluator looked through that is ``src.node`` alone, only viewed (no sum, no exp,
    no sign: the same values, with size-1 axes added or axes permuted), whose axes have exactly
    the roles in ``want``; None if there is none."""
    for node, terms in term.parts.items():
        for t in terms:
            if (t.summed or t.exp_of is not None or t.sign != 1 or len(t.factors) != 1
                    or t.factors[0].node is not src.node):
                continue
            labels = t.out_labels()
            if len(set(labels)) != len(labels) or any(lab not in role for lab in labels):
                continue
            roles = tuple(role[lab] for lab in labels)
            if sorted(roles) == sorted(want):
                return Source(node, roles)
    return None


def two_sides(first: list[Factor], second: list[Factor], free: list[Factor]):
    """Every way to split a product's factors between two values: ``first`` and ``second`` stay on
    their side, each of ``free`` (a factor that may belong to either, such as a per-token RMS
    ``rsqrt`` or a per-channel scale) goes to one. Yields ``(first_group, second_group)``, both
    non-empty."""
    for sides in itertools.product((0, 1), repeat=len(free)):
        one = first + [f for f, side in zip(free, sides) if side == 0]
        two = second + [f for f, side in zip(free, sides) if side == 1]
        if one and two:
            yield one, two


def _split_input_factors(term: IndexTerm, factors: list[Factor], role: dict[int, str]
                         ) -> tuple[Source, Source] | str:
    """Split B_full's factors other than Δ into u (batch, dim, time) and B (with the state axis).

    A factor with the state axis belongs to B, one with the dim axis (and no state axis) to u; a
    factor with neither (e.g. an RMS norm's per-token ``rsqrt``, (batch, time, 1)) may belong to
    either, so each way is tried. Each side must be one existing graph value (``product_source``).
    """
    to_B, to_u, free = [], [], []
    for f in factors:
        roles = _broadcast_roles(term, f, role)
        if roles is None:
            return _foreign_axis(term, f, role)
        if "n" in roles:
            to_B.append(f)
        elif "d" in roles:
            to_u.append(f)
        else:
            free.append(f)
    if not to_B or not (to_u or free):
        return "expected factors Δ, B (with the state axis) and u"
    for B_group, u_group in two_sides(to_B, to_u, free):
        B_src, u_src = product_source(term, B_group, role), product_source(term, u_group, role)
        if B_src is not None and u_src is not None:
            return u_src, B_src
    if len(to_B) > 1 or len(to_u) > 1 or free:
        return ("the factors besides Δ are not two graph values u and B; "
                f"found {len(to_B)} with the state axis, {len(to_u)} with the dim axis, {len(free)} with neither")
    bad = next((f for f in factors if _roles_of(term, f, role) is None), factors[0])
    return _foreign_axis(term, bad, role)


def _foreign_axis(term: IndexTerm, f: Factor, role: dict[int, str]) -> str:
    """Why factor ``f`` fits no role: its axes, named where they have one (an axis the product's
    output does not have, such as the two axes (heads, headdim) of a flattened Mamba-2's x seen
    through its reshape, has none)."""
    names = {"b": "batch", "d": "dim", "t": "time", "n": "state"}
    axes = [names.get(role.get(lab), "?") if not _is_one(size) or lab in role else "1"
            for lab, size in zip(term.factor_labels(f), val(f.node).shape)]
    spelled = f"a factor, {f.node.name} of shape {tuple(val(f.node).shape)}, has axes ({', '.join(axes)})"
    if "?" in axes:
        return spelled + ": '?' is an axis that is not one of (batch, dim, time, state)"
    return (spelled + ": its size-1 axis is one the product does not have (dropped by an index such as "
            "B[:, None, :, 0]), and no value in the graph holds it without that axis (index it in a step "
            "of its own, B[:, :, 0], to have it read)")


def _time_axes(axes) -> tuple[int, int]:
    if isinstance(axes, int):
        return axes, axes
    a, b = axes
    return int(a), int(b)


@dataclasses.dataclass
class _Decay:
    """What the state's multiplier proves, from A_full (``exp(Δ ⊗ A)``) or from one step's
    ``exp(Δ[t0] ⊗ A)``: the input term must then be a product with the same Δ."""

    delta: Source  # the full Δ, roles (b, d, t) in some order
    A: Source
    state_roles: tuple[str, ...]  # the state's axes, in the order the multiplier has them
    a_roles: tuple[str, ...]  # A_full's axes; the step form's are the state's followed by "t"
    nodes: list[torch.fx.Node]
    negate_A: bool
    stops: tuple[torch.fx.Node, ...] = ()  # values that are Δ or A, leaves for the input term too
    t0: int | None = None  # the step form's time index
    sliced: tuple[torch.fx.Node, tuple[str, ...]] | None = None  # the step form's Δ slice base, roles
    # The other reading where A shares the channel axis with Δ: that axis as the batch
    # (``_batch_reading``), proved only to say why the decay is no op's (``_A_along_batch``).
    other: "_Decay | None" = None

    def is_delta(self, node: torch.fx.Node, roles: tuple[str, ...]) -> bool:
        """``node`` with axis ``roles`` is this Δ: the node the multiplier read, or a permuted view
        of it (mamba-minimal slices ``delta.transpose(1, 2)[:, t]`` where its einsum looked
        through the transpose), with the same axes. Never through a cast: a rounded copy of Δ
        is another value."""
        if self.sliced is not None:
            return node is self.sliced[0] and tuple(roles) == self.sliced[1]
        base, perm, _ = layout_source(node, allow_casts=False)
        return base is self.delta.node and tuple(self.delta.roles[p] for p in perm) == tuple(roles)


def match_discretization(a_full: torch.fx.Node, b_full: torch.fx.Node, axes: int | tuple[int, int]
                         ) -> Discretized | str:
    """Prove ``a_full == exp(Δ ⊗ A)`` and ``b_full == Δ · B · u`` with one Δ, or say why not.

    Args:
        a_full: the node whose time slices multiply the state (4-D, e.g. ``deltaA`` (b, d, L, N)).
        b_full: the node whose time slices are added to the state (4-D, same axis roles).
        axes: the time axis of both (an int), or ``(time_axis_of_a_full, time_axis_of_b_full)``.

    Returns:
        A ``Discretized`` with the source nodes of u, Δ, A, B and the role of each of their
        axes (``Source.perm_to("bdt")`` gives the permutation to the op's layout), and the roles
        of a_full's and b_full's axes; or a string saying why it is not a discretisation.

    Example:
        ``deltaA = exp(einsum('bdl,dn->bdln', delta, A))``,
        ``deltaB_u = einsum('bdl,bnl,bdl->bdln', delta, B, u)``:
        ``match_discretization(deltaA, deltaB_u, 2)`` gives ``u=Source(u, ("b","d","t"))``,
        ``B=Source(B, ("b","n","t"))``, ``a_roles == b_roles == ("b","d","t","n")``.
        ``exp(-delta[..., None] * A_pos)`` is proved too, with ``negate_A`` set.
    """
    ta, tb = _time_axes(axes)
    flipped = _time_flip(a_full, ta), _time_flip(b_full, tb)
    if None not in flipped:
        # exp(Δ·A).flip(t) is exp(Δ.flip(t)·A), and likewise Δ·B·u: the flips' sources are proved,
        # and the op reads u, Δ and B flipped along time.
        disc = match_discretization(flipped[0], flipped[1], axes)
        # (A toggle: two flips are none, probe CH.)
        return disc if isinstance(disc, str) else dataclasses.replace(disc, flip_time=not disc.flip_time)
    return _with_negation(lambda neg: _match_full_decay(a_full, ta, neg, lambda d: _full_input(b_full, tb, d)))


def _time_flip(node: torch.fx.Node, axis: int) -> torch.fx.Node | None:
    """What ``node`` flips when it is ``x.flip(axis)`` (``torch.flip(x, [axis])``) along its time
    axis ``axis`` alone; else None."""
    if not (is_call(node, torch.flip) or is_method(node, "flip")) or node.kwargs or len(node.args) != 2:
        return None
    x, dims = node.args
    dims = (dims,) if isinstance(dims, int) else dims
    value = val(node)
    if not isinstance(x, torch.fx.Node) or not isinstance(value, torch.Tensor) or not isinstance(dims, (tuple, list)):
        return None
    if len(dims) != 1 or not isinstance(dims[0], int) or dims[0] % value.dim() != axis % value.dim():
        return None
    return x


def match_full_decay_step_input(a_full: torch.fx.Node, t_axis: int, beta: torch.fx.Node, t0: int
                                ) -> Discretized | str:
    """The mixed form: A_full precomputed (``exp(Δ ⊗ A)``, time axis ``t_axis``), the input term
    computed in the loop (``beta == Δ[t0]·B[t0]·u[t0]``, from time slices of the same Δ)."""
    return _with_negation(lambda neg: _match_full_decay(a_full, t_axis, neg, lambda d: _step_input(beta, d, t0)))


def _with_negation(match):
    # Negations are looked through only when the plain reading fails: a user's ``A = -exp(A_log)``
    # then stays the op's A itself, and the plain reading's reason is the one reported.
    found = match(False)
    if isinstance(found, str):
        negated = match(True)
        if not isinstance(negated, str):
            return negated
    return found


def _match_full_decay(a_full: torch.fx.Node, ta: int, allow_neg: bool, prove_input):
    """Prove ``a_full == exp(Δ ⊗ A)``, then ``prove_input(decay)`` for the input term."""
    va = val(a_full)
    if not isinstance(va, torch.Tensor):
        return "A_full is not a tensor"
    if va.dim() != 4:
        return f"A_full must be 4-D (batch, dim, time, state) in some order, got {va.dim()}-D"

    # A permutation of exp(Δ·A) (``exp(...).permute(0, 2, 1, 3)`` to loop over axis 1, pscan's
    # ``deltaA.transpose(1, 2)``, a ``.contiguous()`` copy) holds the same values: the proof runs
    # on the exp, and its roles are carried back to a_full's axes (a_full axis i = axis
    # a_perm[i] of the exp).
    a_exp, a_perm, _ = layout_source(a_full, allow_casts=False)
    a_views = view_chain(a_full, a_exp)
    at = index_term(a_exp, allow_exp=True, allow_neg=allow_neg)
    if at is None or at.exp_of is None:
        if is_cast(a_exp) and exp_node_behind(a_exp) is not None:
            return (f"A_full is exp(Δ·A) cast by {a_exp.name} from {dtype_of(a_exp.args[0])} to {dtype_of(a_exp)}: "
                    "the op computes the decay from Δ and A in its own precision (fp32, fp64 for fp64 inputs) and "
                    "never rounds it to another dtype, so it would drop the rounding the program computes with")
        if (is_call(a_exp, torch.flip) or is_method(a_exp, "flip")) and exp_node_behind(a_exp.args[0]) is not None:
            # associative_scan over (dA.flip(t), dBu.flip(t)), flipped back after: a reverse scan.
            dims = a_exp.args[1] if len(a_exp.args) > 1 else a_exp.kwargs.get("dims")
            if _time_flip(a_exp, a_perm[ta % len(a_perm)]) is None:
                return (f"A_full is not exp(Δ·A) but exp(Δ·A) flipped along {dims} by {a_exp.name}, which is not "
                        "its time axis alone: the op reads the channels and states in their order")
            return (f"A_full is exp(Δ·A) flipped along time by {a_exp.name}, and B_full is not Δ·B·u flipped "
                    "along time with it (a precomputed decay with an input term computed in the step, or the "
                    "other way round, is not proved through the flip); the two flipped together are a scan "
                    "from the last step back, which is rewritten over u, Δ and B flipped")
        return "A_full is not exp(Δ·A)" + _hop_note(a_exp) + detach_note(a_exp) + _input_note(a_full)
    inner = at.exp_of
    a_out = [at.out_labels()[p] for p in a_perm]
    if inner.summed:
        return f"A_full is exp of a contraction with {len(inner.summed)} summed axes; expected exp(Δ·A)"
    if len(inner.factors) < 2:
        # exp(Δ·A + s), exp(2·Δ·A), exp(logsigmoid(x)): one opaque value, not Δ times A.
        x = inner.factors[0].node.name if inner.factors else "a constant"
        return (f"A_full is exp({x}), and {x} is not a product of a time-varying Δ and A (a sum, a "
                "number or another function of them?); expected exp(Δ·A)")
    if len(set(a_out)) != 4:
        return "A_full's axes are not four distinct indices"
    if len(inner.factors) == 2:
        return _prove_input(_full_decay(ta, a_perm, a_views, at, ()), prove_input)
    # More factors: Δ or A is itself a product the user computed (Δ·mask for padded steps,
    # softplus(dt)·scale, A·scale). Each side must be one graph value that is exactly the product
    # of its factors (``product_parts``); the proof then runs with those values as leaves, so
    # the input term must use the same Δ value and no arithmetic is regrouped.
    first = None
    for stops in _exponent_groupings(at, inner, a_out[ta % 4]):
        ast = index_term(a_exp, stops, allow_exp=True, allow_neg=allow_neg)
        found = _prove_input(_full_decay(ta, a_perm, a_views, ast, stops), prove_input)
        if not isinstance(found, str):
            return found
        first = first or found
    return first or (f"A_full is exp of a product of {len(inner.factors)} factors, and no graph value holds "
                     "the time-varying ones (Δ) apart from the others (A); expected exp(Δ·A)")


def _exponent_groupings(at: IndexTerm, inner: IndexTerm, t_lab: int):
    """Ways to read exp's product of three or more factors as exp(Δ·A), each as the graph values
    to stop at: factors with the time axis go to Δ; the others (A, and a per-channel or scalar
    scale that may belong to either side) are tried on both sides, as few as 2**3 ways."""
    timed = [f for f in inner.factors if t_lab in at.factor_labels(f)]
    free = [f for f in inner.factors if t_lab not in at.factor_labels(f)]
    if not timed or not free or len(free) > 3:
        return
    for d_group, a_group in two_sides(timed, [], free):
        stops = []
        for group in (d_group, a_group):
            if len(group) > 1:
                part = next(product_parts(at, group), None)
                if part is None:
                    break
                stops.append(part[0])
        else:
            yield tuple(stops)


def _shared_A_roles(n_lab: set, d_lab: set, b_lab: set) -> list[dict[int, str]] | None:
    """The two role readings of exp(Δ ⊗ A) when A has one axis, which Δ lacks (one decay per
    state, shared by every channel: ``einsum('bdl,n->bdln', Δ, A)``, probe CB): the decay alone
    cannot tell Δ's batch axis from its channel axis, so each is tried as either. None for any
    other labelling. (The labels' sets are left as they are.)"""
    if d_lab or len(n_lab) != 1 or len(b_lab) != 2:
        return None
    (n,), (x, y) = tuple(n_lab), sorted(b_lab)
    return [{x: "b", y: "d", n: "n"}, {y: "b", x: "d", n: "n"}]


def _decay_labels(out: set[int], sd: set[int], sa: set[int]) -> tuple[set[int], set[int], set[int]]:
    """The labels of exp(Δ ⊗ A)'s state, channel and batch axes, from ``out`` (its axes but time),
    ``sd`` (Δ's) and ``sa`` (A's). An axis of A missing from ``out`` is a size-1 one broadcast
    against Δ's (A (1, N): one decay per state, kept 2-D), which indexes nothing. Where A has a
    channel axis and no other, the state axis is the one of ``out`` neither factor has: a size-1
    axis a view inserted (``A[:, None]``, ``delta[..., None]``: one decay per channel, shared by
    the states), or an expand's (the state's N)."""
    sa = sa & out
    n_lab, d_lab, b_lab = sa - sd, sa & sd, sd - sa
    if not n_lab and d_lab:
        n_lab = out - sa - sd
    return n_lab, d_lab, b_lab


# A's roles, sorted, that the op can read (``scan_loop._decay``): "1" is a size-1 axis broadcast
# (A (dim, 1), (1, N)), and a missing axis one broadcast by a view (A (dim,) as A[:, None]).
_A_ROLES = (["d", "n"], ["n"], ["1", "n"], ["d"], ["1", "d"])


def _decay_roles(term: IndexTerm, f: Factor, role: dict[int, str]) -> tuple[str, ...] | None:
    """The roles of A's axes ("1" for a size-1 axis it broadcasts along), if the op can read them."""
    roles = _broadcast_roles(term, f, role)
    if roles is None:
        return None
    roles = tuple("1" if r is None else r for r in roles)
    return roles if sorted(roles) in _A_ROLES else None


def _A_along_states(disc: Discretized) -> Discretized:
    """``disc`` with A's state axis read as a broadcast one where it has size 1 and B's has not:
    one decay per channel, shared by the N states (S4D-real with a shared decay, a flattened
    Mamba-2's ``A[:, None]``), which the state update broadcasts against B's N. The op reads that
    A expanded to (dim, N); where N is 1 too, A is a (dim, N) A as it is."""
    if "n" not in disc.A.roles:
        return disc
    if not _is_one(val(disc.A.node).shape[disc.A.roles.index("n")]) or _is_one(
            val(disc.B.node).shape[disc.B.roles.index("n")]):
        return disc
    return dataclasses.replace(disc, A=Source(disc.A.node, tuple("1" if r == "n" else r for r in disc.A.roles)))


def _batch_reading(term: IndexTerm, fa: Factor, role: dict[int, str]) -> tuple[dict[int, str], tuple[str, ...]] | None:
    """The decay's other reading where A shares the channel axis with Δ (``role``): that axis as
    Δ's batch and Δ's other one as the channels, with A's roles so read; None where A has no
    channel axis. The decay alone cannot tell the two apart (``_decay_labels`` takes A's axis that
    Δ has for the channels); the input term can."""
    swapped = {lab: {"b": "d", "d": "b"}.get(r, r) for lab, r in role.items()}
    A_roles = _broadcast_roles(term, fa, swapped)
    if A_roles is None or "b" not in A_roles:
        return None
    return swapped, tuple("1" if r is None else r for r in A_roles)


def _A_along_batch(found: str, decay: _Decay, prove_input) -> str:
    """``found``, the input term's refusal under the decay's reading, or, where the input term
    proves under the other one (``decay.other``: A's axis that Δ has is the axis B reads as its
    batch, B being (batch, state, time) as the op's), why the decay is no op's: A varies along
    batch. (Read the first way, the same program has a B per channel; both are said.)"""
    if decay.other is None:
        return found
    proved = prove_input(decay.other)
    if isinstance(proved, str) or sorted(proved.B.roles) != ["b", "n", "t"]:
        return found
    A = decay.A.node
    return (f"A varies along batch: the axis that {A.name} (shape {tuple(val(A).shape)}) shares with Δ is B's batch "
            "axis (B read as the op's (batch, state, time) B), so each batch element has its own decay; "
            "ssm.selective_scan takes a (dim, N) A, one decay per channel and state, the same for every batch "
            "element (read as the channel axis instead, it would make B vary along the channels)")


def _prove_input(decays: list[_Decay] | str, prove_input):
    """``prove_input`` on the decay's reading, or on each of a shared A's two. Those two differ
    only in which of Δ's axes is the batch: the input term must settle it (u by (batch, dim), B by
    (batch, state)), so the proof holds only where exactly one reading does; where both do
    (nothing in the step tells batch from channels), the op's roles are not proved."""
    if isinstance(decays, str):
        return decays
    found = [prove_input(d) for d in decays]
    proved = [f for f in found if not isinstance(f, str)]
    if len(proved) == 1:
        return _A_along_states(proved[0])
    if proved:
        return ("A has only a state axis (one decay per state, shared by the channels), and nothing in the step "
                "tells Δ's batch axis from its channel axis (B and u read both alike): the op's (batch, dim) "
                "roles are not proved")
    return _A_along_batch(found[0], decays[0], prove_input)


def _full_decay(ta: int, a_perm, a_views: list, at: IndexTerm | None, stops: tuple[torch.fx.Node, ...]
                ) -> list[_Decay] | str:
    """A_full's half of the proof, once exp's product has two factors, Δ and A (``stops``: the
    graph values that are Δ or A, evaluated as leaves on the input side as well). Two readings
    where A has no channel axis (``_shared_A_roles``), for ``_prove_input`` to choose from."""
    if at is None or at.exp_of is None or len(at.exp_of.factors) != 2 or at.exp_of.summed:
        return "A_full is not exp(Δ·A)"
    inner = at.exp_of
    a_out = [at.out_labels()[p] for p in a_perm]
    if len(set(a_out)) != 4:
        return "A_full's axes are not four distinct indices"
    t_lab = a_out[ta % 4]
    f0, f1 = inner.factors
    l0, l1 = set(at.factor_labels(f0)), set(at.factor_labels(f1))
    if t_lab in l0 and t_lab not in l1:
        fd, fa, sd, sa = f0, f1, l0, l1
    elif t_lab in l1 and t_lab not in l0:
        fd, fa, sd, sa = f1, f0, l1, l0
    else:
        return "A_full: exactly one factor of exp(Δ·A) must vary with time (Δ) and one must not (A)"
    n_lab, d_lab, b_lab = _decay_labels(set(a_out) - {t_lab}, sd - {t_lab}, sa)
    shared = _shared_A_roles(n_lab, d_lab, b_lab)
    if shared is None and (len(n_lab) != 1 or len(d_lab) != 1 or len(b_lab) != 1):
        return ("A_full: A must be indexed by (dim, state) and Δ by (batch, dim, time)"
                + _size_one_note(fa.node, per_channel=bool(sa & sd)))

    def decay(role: dict[int, str], A_roles: tuple[str, ...] | None) -> _Decay | str:
        a_roles = tuple(role[x] for x in a_out)
        delta_roles = _roles_of(at, fd, role)
        if delta_roles is None or sorted(delta_roles) != ["b", "d", "t"]:
            return "A_full: Δ must have exactly the axes (batch, dim, time)"
        return _Decay(delta=Source(fd.node, delta_roles), A=Source(fa.node, A_roles),
                      state_roles=tuple(r for r in a_roles if r != "t"), a_roles=a_roles,
                      nodes=list(dict.fromkeys(a_views + at.looked_through)), negate_A=inner.sign < 0, stops=stops)

    decays = []
    for role in shared or [{b_lab.pop(): "b", d_lab.pop(): "d", n_lab.pop(): "n"}]:
        role[t_lab] = "t"
        if set(a_out) != set(role):
            return "A_full's axes are not (batch, dim, time, state)"
        A_roles = _decay_roles(at, fa, role)
        found = decay(role, A_roles)
        if isinstance(found, str):
            return found
        if A_roles is None:
            return "A_full: A must have exactly the axes (dim, state)"
        batch = None if shared else _batch_reading(at, fa, role)
        other = decay(*batch) if batch is not None else None
        decays.append(dataclasses.replace(found, other=other if isinstance(other, _Decay) else None))
    return decays


def _same_call(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are two nodes of one call on the same arguments (for a reason only)."""
    return (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) and a is not b and a.op == b.op
            and a.op in ("call_function", "call_method") and a.target == b.target and a.args == b.args
            and a.kwargs == b.kwargs)


def _full_input(b_full: torch.fx.Node, tb: int, decay: _Decay) -> Discretized | str:
    """B_full's half of the proof: ``b_full == Δ · B · u`` with the decay's Δ."""
    vb = val(b_full)
    if not isinstance(vb, torch.Tensor):
        return "B_full is not a tensor"
    if vb.dim() != 4:
        return f"B_full must be 4-D (batch, dim, time, state) in some order, got {vb.dim()}-D"
    bt = index_term(b_full, decay.stops)
    if bt is None or bt.summed or len(bt.factors) < 3:
        n = 0 if bt is None else len(bt.factors)
        base = layout_source(b_full).base
        return f"B_full is not a product Δ·B·u (found {n} factors)" + _hop_note(base) + detach_note(base)
    deltas = []
    for f in bt.factors:
        if decay.sliced is not None and f.node is decay.sliced[0]:
            deltas.append((f, decay.sliced[1]))
        elif f.node is decay.delta.node:
            deltas.append((f, decay.delta.roles))
    if not deltas:
        delta = decay.delta.node
        twin = next((f.node for f in bt.factors if _same_call(f.node, delta)), None)
        if twin is not None:
            # F.softplus(dt) written twice, once for each term (probe DB: "or another Δ?" was said).
            return (f"B_full's Δ {twin.name} is a second call of {bare_name(delta)} on A_full's Δ's inputs, not "
                    f"{delta.name} itself: the proof matches Δ by node; compute Δ once and use it in both terms "
                    "to have the scan rewritten")
        names = ", ".join(f.node.name for f in bt.factors)
        return (f"B_full is a product of ({names}), none of which is A_full's Δ ({delta.name}): not the "
                "Δ·B·u of the Euler discretisation (exact ZOH's (exp(Δ·A) - 1) / A · B, or another Δ?)")
    b_out = bt.out_labels()
    if len(set(b_out)) != 4:
        return "B_full's axes are not four distinct indices"
    brole: dict[int, str] = {}
    fdb, delta_roles = deltas[0]
    for lab, r in zip(bt.factor_labels(fdb), delta_roles):
        brole[lab] = r
    if b_out[tb % 4] not in brole or brole[b_out[tb % 4]] != "t":
        return "B_full: Δ's time axis is not B_full's time axis (Δ at a different time index)"
    rest_out = [lab for lab in b_out if lab not in brole]
    if len(rest_out) != 1:
        return "B_full: Δ in B_full is not indexed like Δ in A_full"
    brole[rest_out[0]] = "n"
    b_roles = tuple(brole[x] for x in b_out)
    if tuple(r for r in b_roles if r != "t") != decay.state_roles:
        return "A_full and B_full slices have different axis orders; the state update would not line up"
    others = [f for f in bt.factors if f is not fdb]
    split = _split_input_factors(bt, others, brole)
    if isinstance(split, str):
        return f"B_full: {split}"
    u_src, B_src = split
    # At batch 1, code that folds batch into time (mamba_simple's x_proj over "(b l) d") gives B
    # as (L, N): the batch axis only appears in a view of it that inserts the size-1 axis.
    if sorted(B_src.roles) == ["n", "t"]:
        B_src = _view_with_roles(bt, B_src, brole, "bnt") or B_src
    if sorted(u_src.roles) == ["d", "t"]:
        u_src = _view_with_roles(bt, u_src, brole, "bdt") or u_src
    if sorted(u_src.roles) != ["b", "d", "t"]:
        return "B_full: u must have exactly the axes (batch, dim, time)"
    if sorted(B_src.roles) == ["b", "d", "n", "t"]:
        B_src = grouped_source(B_src.node, B_src.roles)
    elif sorted(B_src.roles) != ["b", "n", "t"] and sorted(B_src.roles) not in _INVARIANT_B_ROLES:
        return (f"B_full: B must be indexed by (batch, state, time), (dim, state), (state) or (batch, state), "
                f"got {B_src.roles}")
    return Discretized(u=u_src, delta=decay.delta, A=decay.A, B=B_src, a_roles=decay.a_roles, b_roles=b_roles,
                       nodes=list(dict.fromkeys(decay.nodes + bt.looked_through)), negate_A=decay.negate_A)


def _slice_roles(term: IndexTerm, f: Factor, role: dict[int, str]) -> tuple[torch.fx.Node, int, tuple[str, ...]] | None:
    """For a factor that is a time slice ``x[..., t, ...]``: (x, t, roles of x's axes), the sliced
    axis being "t". Axes the slice added with None must be size 1 (they carry no index)."""
    parsed = parse_slice(f.node)
    if parsed is None:
        return None
    base, _, idx, axis_map = parsed
    labels = term.factor_labels(f)
    roles = []
    for m in axis_map:
        if m is None:
            roles.append("t")
        elif labels[m] in role:
            roles.append(role[labels[m]])
        else:
            return None
    if len(set(roles)) != len(roles):
        return None
    return base, idx, tuple(roles)


def match_step_discretization(alpha: torch.fx.Node, beta: torch.fx.Node) -> tuple[Discretized, int] | str:
    """The per-step form: prove ``alpha == exp(Δ[t0] ⊗ A)`` and ``beta == Δ[t0]·B[t0]·u[t0]``.

    Code that discretises inside its loop (``dA = exp(delta[:, :, t, None] * A)``) has no
    A_full/B_full tensors; each factor is a time slice of a full tensor instead. Every slice
    must be at the same time index t0, and Δ must be sliced from the same tensor along the same
    axis in both.

    Args:
        alpha, beta: the state's multiplier and addend at one step (same shape: the state's).

    Returns:
        ``(Discretized, t0)``: the sources are the *full* tensors (roles include "t"); A_full and
        B_full do not exist, so ``a_roles``/``b_roles`` are the state's roles followed by "t"
        (the layout they would have if stacked along a trailing time axis). Or a reason string.
    """
    return _with_negation(lambda neg: _match_step_decay(alpha, neg, lambda d: _step_input(beta, d, d.t0)))


def match_step_decay_full_input(alpha: torch.fx.Node, b_full: torch.fx.Node, t_axis: int
                                ) -> tuple[Discretized, int] | str:
    """The mixed form: the multiplier computed in the loop (``alpha == exp(Δ[t0] ⊗ A)``), the
    input term precomputed (``b_full == Δ·B·u``, time axis ``t_axis``, with the same Δ)."""
    return _with_negation(lambda neg: _match_step_decay(alpha, neg, lambda d: _full_input(b_full, t_axis, d)))


def _hop_note(node: Any) -> str:
    """Why a full term reads as no product at all when a higher-order op makes it: a hook on it or a
    custom autograd.Function, whose backward no op may replace (probe BA)."""
    hop = higher_order_op(node)
    if hop is None:
        return ""
    return (f" (it is the output of {hop_name(hop)}, a custom autograd.Function or a hook on the tensor: what "
            "it does in the backward is the program's, and the op's own gradient would replace it)")


def _size_one_note(node: Any, per_channel: bool) -> str:
    """Why A (``node``) can fail the role proof when it has fewer real axes than (dim, state): a
    size-1 axis (A (dim, 1), (1, N)) indexes nothing and reads as a broadcast one, and a 1-D A
    broadcast over the states or the channels has one axis; the other roles must then come from
    Δ and the state's axes (``_decay_labels``, ``_shared_A_roles``).
    ``per_channel``: A shares an index with Δ (the channels'), else its indices are Δ-free."""
    value = val(node) if isinstance(node, torch.fx.Node) else None
    ones = [i for i, s in enumerate(value.shape) if statically_known_true(s == 1)] if isinstance(
        value, torch.Tensor) else []
    if ones:
        return (f" (A has shape {tuple(value.shape)}: its size-1 axis {ones[0]} indexes nothing, so it reads as "
                "a broadcast axis, and A's roles are proved only where Δ has a batch and a channel axis besides "
                "time and the state axis is A's other one or one the state update broadcasts it along)")
    if isinstance(value, torch.Tensor) and value.dim() == 1 and per_channel:
        # A flattened Mamba-2: ``A.repeat_interleave(P)[:, None]`` (probe BT).
        return (f" (A is {node.name}, of shape {tuple(value.shape)}, broadcast over the state axis: one decay per "
                "channel, as a flattened Mamba-2's scalar decay per head, which is proved only where Δ has a "
                "batch and a channel axis besides time and the state axis is the one other axis)")
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        # One decay per state shared by every channel (probe CB: ``einsum('bdl,n->bdln', Δ, A)``),
        # proved only where Δ has both a batch and a channel axis (``_shared_A_roles``).
        return (f" (A is {node.name}, of shape {tuple(value.shape)}, broadcast over the channels: one decay per "
                "state, shared by every channel, which the pass proves only where Δ has a batch and a channel "
                "axis besides time)")
    return ""


def _input_note(node: Any) -> str:
    """Why a decay reads as no exp(Δ·A) when it is an input of the graph being proved (a time
    slice or permuted view of one): a function argument, or the operand of a checkpoint body
    whose exp(Δ·A) its caller computed. Empty otherwise."""
    base = node
    while isinstance(base, torch.fx.Node) and base.op != "placeholder":
        sliced = parse_slice(base)
        if sliced is not None:
            base = sliced[0]
            continue
        source = layout_source(base, allow_casts=False).base
        if source is base:
            return ""
        base = source
    if not isinstance(base, torch.fx.Node):
        return ""
    return (f" ({'it' if base is node else f'{node.name} is read from {base.name}, which'} is an input of the "
            "graph being proved, a function argument or a checkpoint body's operand; if it is exp(Δ·A), that is "
            "computed outside, where the scan pass cannot see Δ and A)")


def _kept_time_axis_note(alpha: torch.fx.Node) -> str:
    """Why a multiplier read as ``x[:, t:t + 1]`` fails: that step keeps x's time axis at size 1,
    so the state carries an extra axis, and no state of that shape is proved here."""
    piece = unit_piece(alpha)
    if piece is None:
        return ""
    base, axis, _ = piece
    return (f" (it is step t of {base.name} with its time axis {axis} kept at size 1, as x[:, t:t + 1] "
            "reads it: the state then has a size-1 axis, which the scan pass does not prove; a step "
            "read as x[:, t] is)")


def flipped_step_delta(alpha: Any) -> tuple[str, torch.fx.Node, str] | None:
    """Where one step's multiplier ``alpha`` is exp(Δ·A) with Δ read through a flip: a flipped
    tensor's time slice (``delta.flip(0)[:, :, t]``, ``kind`` "slice") or a time slice flipped
    (``delta[:, :, t].flip(0)``, ``kind`` "flip"): ``(what, flip, kind)``, ``what`` naming the Δ axes
    the flip reverses ("Δ flipped along batch"). The roles come from A's axes as the decay's proof
    reads them (A shares the channel axis with Δ; Δ's other axis is the batch); an axis they
    leave open is named by its index. None for any other multiplier."""
    for allow_neg in (False, True):
        at = index_term(alpha, allow_exp=True, allow_neg=allow_neg)
        if at is None or at.exp_of is None or at.exp_of.summed or len(at.exp_of.factors) != 2:
            continue
        out = set(at.out_labels())
        for fd in at.exp_of.factors:
            fa = next(f for f in at.exp_of.factors if f is not fd)
            labels = at.factor_labels(fd)
            sliced = parse_slice(fd.node)
            if sliced is not None and flip_dims(sliced[0]) is not None:
                flip, kind, t_axis, axis_map = sliced[0], "slice", sliced[1], sliced[3]
                flipped = {d: "t" if d == t_axis else labels[axis_map[d]] for d in flip_dims(flip)}
                sd = {labels[m] for m in axis_map if m is not None}
            elif (flip_dims(fd.node) is not None and parse_slice(fd.node.args[0]) is not None
                  and len(labels) == ndim_of(fd.node)):
                flip, kind = fd.node, "flip"
                flipped = {d: labels[d] for d in flip_dims(flip)}
                sd = set(labels)
            else:
                continue
            n_lab, d_lab, b_lab = _decay_labels(out, sd & out, set(at.factor_labels(fa)))
            names = {lab: name for group, name in ((b_lab, "batch"), (d_lab, "channels"), (n_lab, "states"))
                     if len(group) == 1 for lab in group}
            names["t"] = "time"
            axes = " and ".join(names.get(lab, f"its axis {d}") for d, lab in sorted(flipped.items()))
            return f"Δ flipped along {axes}", flip, kind
    return None


def _flipped_factor_note(alpha: torch.fx.Node) -> str:
    """Why exp(Δ·A) has no time-slice factor when Δ's step is a time slice flipped along another
    axis (``delta[:, :, t].flip(0)``): the pass reads Δ only as a slice of one tensor."""
    found = flipped_step_delta(alpha)
    if found is None or found[2] != "flip":
        return ""
    what, flip, _ = found
    return (f": Δ's step is {flip.name}, the time slice {flip.args[0].name} flipped ({what}), and the pass does "
            "not read a flipped time slice as a time slice")


def _match_step_decay(alpha: torch.fx.Node, allow_neg: bool, prove_input):
    """Prove ``alpha == exp(Δ[t0] ⊗ A)``, then ``prove_input(decay)``; ``(Discretized, t0)``."""
    at = index_term(alpha, allow_exp=True, allow_neg=allow_neg)
    if at is None or at.exp_of is None:
        return ("the state's multiplier is not exp(Δ·A)" + _kept_time_axis_note(alpha) + detach_note(alpha)
                + _input_note(alpha))
    inner = at.exp_of
    if inner.summed or len(inner.factors) != 2:
        return "the state's multiplier is not exp of a product Δ·A"
    out = at.out_labels()
    if len(set(out)) != 3:
        return "the state is not 3-D (batch, dim, state)"
    sliced = [f for f in inner.factors if parse_slice(f.node) is not None]
    if len(sliced) != 1:
        return "exactly one factor of exp(Δ·A) must be a time slice (Δ)" + _flipped_factor_note(alpha)
    fd = sliced[0]
    fa = next(f for f in inner.factors if f is not fd)
    # Δ's own axes: a size-1 axis the slice inserts (``delta[:, :, t, None]``) indexes nothing of Δ.
    labels = at.factor_labels(fd)
    sd = {labels[m] for m in parse_slice(fd.node)[3] if m is not None} & set(out)
    sa = set(at.factor_labels(fa))
    n_lab, d_lab, b_lab = _decay_labels(set(out), sd, sa)
    shared = _shared_A_roles(n_lab, d_lab, b_lab) if set(out) == n_lab | b_lab else None
    if shared is None and (len(n_lab) != 1 or len(d_lab) != 1 or len(b_lab) != 1
                           or set(out) != n_lab | d_lab | b_lab):
        return ("the state's multiplier: A must be indexed by (dim, state) and Δ by (batch, dim)"
                + _size_one_note(fa.node, per_channel=bool(sa & sd)))

    def decay(role: dict[int, str], A_roles: tuple[str, ...] | None) -> _Decay | str:
        d_slice = _slice_roles(at, fd, role)
        if d_slice is None or sorted(d_slice[2]) != ["b", "d", "t"]:
            return "the state's multiplier: Δ must be a time slice of a (batch, dim, time) tensor"
        delta_base, t0, delta_roles = d_slice
        state_roles = tuple(role[x] for x in out)
        # Δ's base is a leaf for the input term too: a precomputed Δ·B·u (the mixed form) built
        # from a Δ the user computed (softplus(dt) * mask) then names it as a factor.
        return _Decay(delta=view_source(delta_base, delta_roles), A=Source(fa.node, A_roles),
                      state_roles=state_roles, a_roles=state_roles + ("t",), nodes=list(at.looked_through),
                      negate_A=inner.sign < 0, stops=(delta_base,), t0=t0, sliced=(delta_base, delta_roles))

    decays = []
    for role in shared or [{b_lab.pop(): "b", d_lab.pop(): "d", n_lab.pop(): "n"}]:
        A_roles = _decay_roles(at, fa, role)
        if A_roles is None:
            return "the state's multiplier: A must have exactly the axes (dim, state)"
        found = decay(role, A_roles)
        if isinstance(found, str):
            return found
        batch = None if shared else _batch_reading(at, fa, role)
        other = decay(*batch) if batch is not None else None
        decays.append(dataclasses.replace(found, other=other if isinstance(other, _Decay) else None))
    found = _prove_input(decays, prove_input)
    return found if isinstance(found, str) else (found, decays[0].t0)


def _step_input(beta: torch.fx.Node, decay: _Decay, t0: int) -> Discretized | str:
    """One step's input term: ``beta == Δ[t0]·B[t0]·u[t0]`` with the decay's Δ, every factor a
    time slice at ``t0`` (or a time-invariant B (dim, state)). A slice of a precomputed product of
    two of them stands for its factors (``_partial_product``)."""
    bt = index_term(beta, decay.stops)
    if bt is None or bt.summed or len(bt.factors) not in (2, 3):
        return "the state's addend is not a product Δ·B·u" + detach_note(beta)
    b_out = bt.out_labels()
    if len(set(b_out)) != 3:
        return "the state's addend is not 3-D"
    brole = dict(zip(b_out, decay.state_roles))
    # Each item: a time slice (node, index, roles), or a factor that is not one (a B (dim, state)).
    items: list[tuple[str, Any]] = []
    nodes = list(bt.looked_through)
    for f in bt.factors:
        sl = _slice_roles(bt, f, brole)
        parts = None if sl is None or len(bt.factors) == 3 else _partial_product(sl, decay)
        if parts is None:
            items.append(("slice", sl) if sl is not None else ("other", _roles_of(bt, f, brole), f.node))
            continue
        split, through = parts
        items.extend(split)
        nodes += through
    if len(items) != 3:
        if len(bt.factors) == 2:
            # One factor is a whole precomputed tensor read at t (a B̄ = Δ·B) that is not exactly
            # a product of two of Δ, B, u: a constant, a sum (Δ·B + eps) or a third factor in it.
            return ("the state's addend is a product of two factors, and neither is a precomputed Δ·B or Δ·u "
                    "read at this step (exactly those two factors, no constant, sum or third factor)")
        return f"the state's addend is not a product Δ·B·u (it has {len(items)} factors)"
    u_src = B_src = None
    found_delta = False
    for item in items:
        if item[0] == "other":
            _, roles, node = item
            if roles is None or sorted(roles) not in _INVARIANT_B_ROLES or B_src is not None:
                return ("the state's addend: a factor is neither a time slice nor a time-invariant B (dim, state), "
                        "(state) or (batch, state)")
            B_src = Source(node, roles)
            continue
        base, idx, roles = item[1]
        if idx != t0:
            return (f"the state's addend reads time {idx} where its multiplier reads time {t0} (a lag, or the "
                    "input term added before the decay multiplies it: h = exp(Δ[t]·A) * (h + Δ[t]·B[t]·u[t]))")
        if not found_delta and decay.is_delta(base, roles):
            found_delta = True
        elif sorted(roles) == ["b", "d", "t"] and u_src is None:
            u_src = view_source(base, roles)
        elif "n" in roles and B_src is None:
            B_src = view_source(base, roles)
            if sorted(roles) == ["b", "d", "n", "t"]:
                B_src = grouped_source(B_src.node, B_src.roles)
            elif sorted(roles) != ["b", "n", "t"]:
                return f"the state's addend: B must be indexed by (batch, state, time), got {roles}"
        elif not found_delta:
            return "the state's addend does not use the same Δ as its multiplier"
        else:
            return "the state's addend has an unexpected factor"
    if not found_delta:
        return "the state's addend does not use the same Δ as its multiplier"
    if u_src is None or B_src is None:
        return "the state's addend: expected factors Δ, B and u"
    virtual = decay.state_roles + ("t",)
    return Discretized(u=u_src, delta=decay.delta, A=decay.A, B=B_src, a_roles=decay.a_roles, b_roles=virtual,
                       nodes=list(dict.fromkeys(decay.nodes + nodes)), negate_A=decay.negate_A)


def _partial_product(sl: tuple[torch.fx.Node, int, tuple[str, ...]], decay: _Decay):
    """A time slice ``base[..., t0, ...]`` of a precomputed product of two of Δ, B, u (the
    paper's discretized B̄ = Δ·B, multiplied by x_t in the step; Δ·u times B_t; B·u times Δ_t):
    its two factors as items for ``_step_input``, which then checks that the three are one Δ (the
    multiplier's), one B and one u; and the nodes looked through. None when ``base`` is no such
    product (it is then an ordinary factor).

    A product of whole-sequence tensors read at t0 is the product of their values at t0, so the
    factors are time slices at t0 of the tensors the product reads."""
    base, idx, roles = sl
    if sorted(roles) not in (["b", "d", "n", "t"], ["b", "d", "t"]):
        return None
    pt = index_term(base, decay.stops)
    if pt is None or pt.summed or len(pt.factors) != 2 or len(set(pt.out_labels())) != len(roles):
        return None
    prole = dict(zip(pt.out_labels(), roles))
    split = []
    for f in pt.factors:
        froles = _roles_of(pt, f, prole)
        if froles is None:
            return None
        if "t" not in froles:
            if sorted(froles) not in _INVARIANT_B_ROLES:
                return None
            split.append(("other", froles, f.node))  # a time-invariant B
        else:
            split.append(("slice", (f.node, idx, froles)))
    return split, [base, *pt.looked_through]


def unscanned_discretizations(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The ``exp(Δ·A)`` nodes left in ``gm`` that materialise a 4-D (batch, dim, time, state) tensor.

    Run after the passes: a recurrence they proved took its ``exp(Δ·A)`` into the op, so one still
    in the graph feeds a recurrence no scan pass recognised (a Hillis-Steele doubling scan, a
    cumulative-product closed form, a recurrence computed outside the graph), or a value the user
    reads directly. The shape test is the proof's own: exp of a product of two factors, one
    varying over three of the four axes (Δ) and one over the remaining axis and one shared with
    Δ (A); which of Δ's axes is time does not matter here.
    """
    found = []
    for node in gm.graph.nodes:
        if not is_exp(node):
            continue
        v = val(node)
        if not isinstance(v, torch.Tensor) or v.dim() != 4:
            continue
        term = index_term(node, allow_exp=True, allow_neg=True)
        inner = term.exp_of if term is not None else None
        if inner is None or inner.summed or len(inner.factors) != 2 or len(set(term.out_labels())) != 4:
            continue
        l0, l1 = (set(term.factor_labels(f)) for f in inner.factors)
        small, big = sorted((l0, l1), key=len)
        if len(big) == 3 and len(small) == 2 and len(small & big) == 1 and small | big == set(term.out_labels()):
            found.append(node)
    return found
