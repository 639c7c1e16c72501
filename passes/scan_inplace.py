"""Recognise a parallel scan written as in-place updates of views (family ``scan_assoc``).

mamba.py's ``PScan`` (a Blelloch up-sweep and down-sweep) and similar hand-written scans clone
the discretised ``A_full`` and ``B_full`` (or zero-pad them to a power of two) and then update
strided views of the two copies in place, e.g. for one level of the up-sweep::

    Aa = A.view(B, D, T // 2, 2, -1); Xa = X.view(B, D, T // 2, 2, -1)
    Xa[:, :, :, 1].add_(Aa[:, :, :, 1].mul(Xa[:, :, :, 0]))
    Aa[:, :, :, 1].mul_(Aa[:, :, :, 0])

Dynamo inlines such code into the graph when nothing requires grad (inside an
``autograd.Function`` under grad it stays a subgraph of the Function's own forward and backward,
which this pass leaves alone). The states come out as a (batch, L, dim, N) view of the X copy.

The proof is an abstract interpretation of the graph along the time axis, like the generic
``associative_scan`` form's in ``scan_assoc``, but over buffers with in-place writes:

* Every tracked tensor is a view of a buffer (a copy of A_full or B_full, or a temporary). Its
  geometry comes from applying the graph's own view ops (``view``, ``transpose``, slices with
  steps, ``select``, ...) to zero-stride coordinate tensors, one per axis of the copied tensor:
  the strides and offset of each result say, for every axis of the view, which axis of the copy
  it walks and how. A view is accepted when each of its axes walks exactly one axis of the copy,
  and every axis other than time is walked whole and in order; time may be split, strided and
  sliced freely. An empty view (the top level of a down sweep that starts there, as the
  Fleuret-style PScan of VMamba and zeta does) reads and writes nothing.
* A symbolic time length (a recompile at a second length) is evaluated at every length the
  graph's guards admit, and the scan proved at each. Any other symbolic size (a dynamic batch)
  is taken at its traced value, where the views' symbolic sizes show that the proof holds at
  every value: it may size only whole axes other than time, never time or an index.
* Each time position of a buffer holds what it is in the algebra of ``h_t = a_t h_{t-1} + b_t``:
  ``("a", l, h)`` is ``a_l ... a_h``; ``("b", lo, hi, h)`` is ``Σ_{s=lo..hi} (a_{s+1} ... a_h) b_s``,
  the inputs of steps lo..hi carried to step h; a padding zero is ``ZERO``. Products and sums are
  accepted only where they compose adjacent pieces (``a[l..h] * b[lo..l-1]``,
  ``b[lo..m] + b[m+1..hi]``, both carried to the same h); anything else is junk, which must not
  reach the states read out.
* The states are proved when the tensor read outside the scan holds ``("b", 0, t, t)`` at time t
  for every step, in the layout of ``B_full``. Which copy is A and which is B follows from the
  first product that mixes them (the later step's value multiplies).

That is the inclusive scan in exact arithmetic; the floats differ from the sequential recurrence
only in the order of the additions, as for ``associative_scan``. The rewrite itself (the
discretisation, the readout, the op) is ``scan_assoc``'s.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Optional

import sympy
import torch
import torch.fx
import torch.nn.functional as F

from .fx_utils import is_call, is_method, mutates, shape_of, val

ZERO = ("zero",)
JUNK = ("junk",)
# The user's code runs the same ops on its tensors; these are the ones a view can be made with.
_VIEW_METHODS = ("view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "select", "narrow",
                 "movedim", "swapaxes", "swapdims")
_VIEW_FUNCTIONS = (operator.getitem, torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze,
                   torch.select, torch.narrow, torch.movedim, torch.swapaxes, torch.reshape)
_MUL = (operator.mul, torch.mul)
_ADD = (operator.add, torch.add)


class _Fail(Exception):
    pass


@dataclasses.dataclass(eq=False)
class _Buffer:
    items: list[Any]


@dataclasses.dataclass(eq=False)
class _View:
    """A tracked tensor: a view of ``buffer`` whose coordinate along axis k of the copied
    tensor is given, for every element, by ``coords[k]`` (a zero-stride int64 view)."""

    buffer: _Buffer
    coords: list[torch.Tensor]
    group: "_Group"
    # The view's sizes as the graph has them, time lengths evaluated: what ``coords`` take at
    # the traced value of any other symbolic size (a dynamic batch) holds only where these say so.
    sizes: tuple[sympy.Expr, ...] = ()


@dataclasses.dataclass(eq=False)
class _Group:
    """The copies that meet in one scan, and everything the interpretation learnt about it."""

    seeds: list[torch.fx.Node]                 # the clone / pad nodes
    sources: list[torch.fx.Node]               # what they copy (A_full, B_full)
    shape: tuple[int, ...]
    t_axis: int
    sizes: tuple[sympy.Expr, ...]              # ``shape`` as the graph has it (see ``_View.sizes``)
    roles: dict[torch.fx.Node, str] = dataclasses.field(default_factory=dict)   # seed -> "a" / "b"
    nodes: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    # (the reading node, the tracked value it reads, that value's axis roles and entries then)
    exits: list[tuple[torch.fx.Node, torch.fx.Node, tuple[Any, ...], list[Any]]] = dataclasses.field(
        default_factory=list)
    combined: bool = False                     # a product mixed the two copies
    written: set[int] = dataclasses.field(default_factory=set)   # ids of the buffers updated in place
    failure: Optional[str] = None
    # An index or slice bound that depends on a symbolic size other than the time length, taken
    # at its traced value to follow the rest: why the scan is not proved, unless it fails first.
    indexed_by: Optional[str] = None


@dataclasses.dataclass
class InplaceMiss:
    """An in-place scan that was not proved: its copies, why, and the nodes interpreted."""

    seeds: list[torch.fx.Node]
    reason: str
    nodes: list[torch.fx.Node]


@dataclasses.dataclass
class InplaceScan:
    """A proved in-place scan: the rewrite's inputs."""

    a_full: torch.fx.Node
    b_full: torch.fx.Node
    t_axis: int
    states: torch.fx.Node
    nodes: list[torch.fx.Node]
    proved_lengths: tuple[int, ...] = ()     # under a symbolic length: every length proved


def _traced_value(sym: sympy.Symbol, shape_env: Any) -> sympy.Integer:
    """The value dynamo traced the symbolic size ``sym`` at (a data-dependent size has none)."""
    values = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val
    if sym not in values:
        raise _Fail(f"a size of the scan, {sym}, is data-dependent")
    return sympy.Integer(values[sym])


def _geometry(view: _View, t_axis: int) -> tuple[tuple[Any, ...], list[int]]:
    """(the role of each axis of ``view``: the copied axis it walks or None for size 1, and the
    buffer positions of its elements in row-major order over the time axes); raises ``_Fail``
    when an axis walks two copied axes, or a non-time axis is not walked whole and in order.

    A symbolic size other than the time length (a dynamic batch) is interpreted at its traced
    value; the view is then accepted only where its sizes say the same at every value: a time
    axis of a size that does not depend on it, and each axis of such a size walking the copied
    axis of that very size (so whole, as the traced value shows)."""
    shape = view.coords[0].shape
    if 0 in shape:
        # An empty view (a sweep's top level, ``Xa[:, :, 1:, 0]`` of one pair) reads and writes nothing.
        if 0 not in view.sizes:
            raise _Fail("a view of the scan's buffers is empty at the traced value of a symbolic size, "
                        "and not at every value")
        return (None,) * len(shape), []
    roles: list[Any] = []
    for i, size in enumerate(shape):
        if size == 1:
            roles.append(None)
            continue
        walked = [k for k, c in enumerate(view.coords) if c.stride(i) != 0 and c.shape[i] > 1]
        if len(walked) != 1:
            raise _Fail("a view mixes the time axis with another axis")
        if walked[0] == t_axis and view.sizes[i].free_symbols:
            raise _Fail(f"a view of the scan's buffers walks the time axis over {view.sizes[i]}, a symbolic "
                        "size other than the time length")
        roles.append(walked[0])
    for k, c in enumerate(view.coords):
        if k == t_axis or c.untyped_storage().nbytes() // 8 <= 1:
            continue
        axes = [i for i, r in enumerate(roles) if r == k]
        full = c.untyped_storage().nbytes() // 8
        if (len(axes) != 1 or shape[axes[0]] != full or c.stride(axes[0]) != 1
                or c.storage_offset() != 0):
            raise _Fail("a view of the scan's buffers does not cover a non-time axis whole")
        if view.sizes[axes[0]] != view.group.sizes[k]:
            raise _Fail(f"a view of the scan's buffers covers the axis of size {view.group.sizes[k]} whole only "
                        f"at its traced value (the view's axis has size {view.sizes[axes[0]]})")
    index = tuple(slice(None) if r == t_axis else 0 for r in roles)
    positions = view.coords[t_axis][index].reshape(-1).tolist()
    return tuple(roles), positions


class _Algebra:
    """Products and sums of the buffers' entries; binds each copy's role on first use."""

    def __init__(self, group: _Group):
        self.group = group

    def _role(self, seed: torch.fx.Node, role: str) -> None:
        roles = self.group.roles
        if roles.setdefault(seed, role) != role:
            raise _Fail("one copy is used both as the multiplier and as the offset")
        if list(roles.values()).count(role) > 1:
            raise _Fail("two copies play the same part in the scan")

    def _other(self, seed: torch.fx.Node, role: str) -> None:
        """``seed`` takes the role left over once ``role`` is taken by another copy."""
        taken = [s for s, r in self.group.roles.items() if r == role and s != seed]
        if taken:
            self._role(seed, "b" if role == "a" else "a")

    def norm(self, e: Any) -> Any:
        if e[0] == "leaf" and e[1] in self.group.roles:
            return ("a", e[2], e[2]) if self.group.roles[e[1]] == "a" else ("b", e[2], e[2], e[2])
        return e

    def mul(self, u: Any, v: Any) -> Any:
        if u is JUNK or v is JUNK or u == ZERO or v == ZERO:
            # A padding zero in a product: 0 * inf is NaN, which no clean entry may absorb.
            return JUNK
        u, v = self.norm(u), self.norm(v)
        if u[0] == "leaf" or v[0] == "leaf":
            return self._mul_leaf(u, v)
        if u[0] == "b":
            u, v = v, u
        if u[0] == "a" and v[0] == "a":
            if u[2] + 1 == v[1]:
                return ("a", u[1], v[2])
            if v[2] + 1 == u[1]:
                return ("a", v[1], u[2])
            return JUNK
        if u[0] == "a" and v[0] == "b" and v[3] + 1 == u[1]:
            self.group.combined = True
            return ("b", v[1], v[2], u[2])
        return JUNK

    def _mul_leaf(self, u: Any, v: Any) -> Any:
        if u[0] != "leaf":
            u, v = v, u
        if v[0] == "leaf":
            if u[1] == v[1]:
                self._role(u[1], "a")
            elif u[2] == v[2] + 1:
                self._role(u[1], "a")
                self._role(v[1], "b")
            elif v[2] == u[2] + 1:
                self._role(v[1], "a")
                self._role(u[1], "b")
            else:
                return JUNK
        elif v[0] == "b":
            self._role(u[1], "a")
        else:
            self._other(u[1], "a")
            if u[1] not in self.group.roles:
                return JUNK
        return self.mul(self.norm(u), self.norm(v))

    def add(self, u: Any, v: Any) -> Any:
        if u is JUNK or v is JUNK:
            return JUNK
        if u == ZERO:
            return v
        if v == ZERO:
            return u
        for e in (u, v):
            if e[0] == "leaf" and e[1] not in self.group.roles:
                self._role(e[1], "b")
        u, v = self.norm(u), self.norm(v)
        if u[0] != "b" or v[0] != "b" or u[3] != v[3]:
            return JUNK
        if u[2] + 1 == v[1]:
            return ("b", u[1], v[2], u[3])
        if v[2] + 1 == u[1]:
            return ("b", v[1], u[2], u[3])
        return JUNK


class _Interpreter:
    """One walk of the graph with one choice of the copies' time axis."""

    def __init__(self, gm: torch.fx.GraphModule, t_axis: int,
                 lengths: Optional[dict[sympy.Symbol, sympy.Integer]] = None):
        self.gm = gm
        self.t_axis = t_axis
        self.lengths = lengths          # symbol -> value: every symbolic size evaluated there
        self.values: dict[torch.fx.Node, _View] = {}
        self.groups: list[_Group] = []
        self.symbolic: list[torch.SymInt] = []   # time lengths of copies seen without ``lengths``

    def concrete(self, x: Any, shape: bool = False, index: Optional[_Group] = None) -> Any:
        """``x`` with its symbolic sizes (SymInts, or nodes computing them) evaluated at
        ``self.lengths``; a size that stays symbolic raises ``_Fail``, unless ``x`` is a shape
        (a tensor's, or a view's shape argument): there it is taken at its traced value, and
        ``_geometry`` checks the view's symbolic sizes against the copies'. An index or a slice
        bound of ``index``'s buffers is taken so too, but the time positions it picks may change
        with the size, so the group is then not proved (``indexed_by``)."""
        if isinstance(x, (list, tuple)):
            return type(x)(self.concrete(e, shape, index) for e in x)
        if isinstance(x, slice):
            return slice(*(self.concrete(e, shape, index) for e in (x.start, x.stop, x.step)))
        v = val(x) if isinstance(x, torch.fx.Node) else x
        if isinstance(v, torch.SymInt):
            size = v.node.expr.xreplace(self.lengths or {})
            if not size.is_Integer and index is not None and not shape:
                index.indexed_by = index.indexed_by or (
                    f"{size}, a symbolic size other than the time length, indexes or slices the scan's buffers "
                    "(the time positions it picks may change with it, so the traced value proves nothing)")
            if not size.is_Integer and (shape or index is not None):
                traced = {s: _traced_value(s, v.node.shape_env) for s in size.free_symbols}
                if any(n < 2 for n in traced.values()):
                    raise _Fail(f"a size of the scan, {size}, is symbolic and was traced below 2")
                size = size.xreplace(traced)
            if not size.is_Integer:
                raise _Fail(f"a size of the scan, {size}, is symbolic")
            return int(size)
        if isinstance(x, torch.fx.Node):
            raise _Fail(f"{x.name} is not a size")
        return x

    def sizes(self, node: torch.fx.Node) -> tuple[sympy.Expr, ...]:
        """``node``'s shape as the graph has it, with the time lengths evaluated."""
        return tuple(s.node.expr.xreplace(self.lengths or {}) if isinstance(s, torch.SymInt) else sympy.Integer(s)
                     for s in shape_of(node))

    def run(self) -> list[_Group]:
        for node in self.gm.graph.nodes:
            tracked = [a for a in node.all_input_nodes if a in self.values]
            if not tracked:
                self._maybe_seed(node)
                continue
            groups = {id(self.values[a].group): self.values[a].group for a in tracked}
            group = self._merge(list(groups.values()))
            out = None
            if group.failure is None:
                try:
                    out = self._transfer(node, group)
                except _Fail as e:
                    group.failure = str(e)
                except (RuntimeError, IndexError, ValueError, TypeError):
                    # The user's view cannot be applied to the coordinate tensors (e.g. a view that
                    # merges time with another axis): not a geometry this proof follows.
                    group.failure = f"{node.name} reshapes the scan's buffers in a way the proof does not follow"
            if group.failure is not None:
                # What a failed group computes stays marked, so that the copies it meets later
                # join it (and the near-miss names both).
                self.values[node] = _View(_Buffer([]), [], group)
                continue
            if out is None:
                continue
            group.nodes.append(node)
            self.values[node] = out
        return self.groups

    def _merge(self, groups: list[_Group]) -> _Group:
        first = groups[0]
        for other in groups[1:]:
            if (other.shape, other.sizes) != (first.shape, first.sizes):
                first.failure = first.failure or "the scan's two copies differ in shape"
            first.seeds += other.seeds
            first.sources += other.sources
            first.nodes += other.nodes
            first.exits += other.exits
            first.combined |= other.combined
            first.written |= other.written
            first.roles.update(other.roles)
            first.failure = first.failure or other.failure
            first.indexed_by = first.indexed_by or other.indexed_by
            for v in self.values.values():
                if v.group is other:
                    v.group = first
            self.groups.remove(other)
        return first

    def _maybe_seed(self, node: torch.fx.Node) -> None:
        padded = is_call(node, F.pad, torch._C._nn.pad)
        if is_method(node, "clone") or is_call(node, torch.clone):
            if node.kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
                return
        elif not padded:
            return
        src = node.args[0] if node.args else None
        vs = val(src) if isinstance(src, torch.fx.Node) else None
        if not isinstance(vs, torch.Tensor) or vs.dim() != 4 or not vs.is_floating_point():
            return
        # mamba.py pads to the next power of two by an amount computed from the length: known
        # once the source's length is, as is the copy's.
        for length in (shape_of(node)[self.t_axis], vs.shape[self.t_axis]):
            try:
                self.concrete(length)
            except _Fail:
                if self.lengths is None and isinstance(length, torch.SymInt):
                    self.symbolic.append(length)
                return
        pad_after = self._time_pad(node) if padded else 0
        if pad_after is None:
            return
        try:
            shape = self.concrete(tuple(shape_of(node)), shape=True)
        except _Fail:
            return
        if shape[self.t_axis] < 2:
            return
        sizes = self.sizes(node)
        group = _Group([node], [src], shape, self.t_axis, sizes, nodes=[node])
        self.groups.append(group)
        items = [("leaf", node, t) for t in range(shape[self.t_axis] - pad_after)] + [ZERO] * pad_after
        self.values[node] = _View(_Buffer(items), self._coords(shape), group, sizes)

    def _time_pad(self, node: torch.fx.Node) -> Optional[int]:
        """Zeros appended to the time axis alone by ``F.pad`` (None for any other padding)."""
        try:
            pad = self.concrete(node.args[1] if len(node.args) > 1 else node.kwargs.get("pad"))
        except _Fail:
            return None
        mode = node.kwargs.get("mode", node.args[2] if len(node.args) > 2 else "constant")
        value = node.kwargs.get("value", node.args[3] if len(node.args) > 3 else None)
        if mode != "constant" or value not in (None, 0, 0.0) or not isinstance(pad, (tuple, list)):
            return None
        if len(pad) % 2 or not all(isinstance(p, int) for p in pad):
            return None
        # F.pad's pairs run from the last axis backwards.
        pairs = {3 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}
        if any(p != (0, 0) for axis, p in pairs.items() if axis != self.t_axis):
            return None
        before, after = pairs.get(self.t_axis, (0, 0))
        return after if before == 0 and after >= 0 else None

    @staticmethod
    def _coords(shape: tuple[int, ...]) -> list[torch.Tensor]:
        return [torch.arange(size).as_strided(shape, [1 if i == k else 0 for i in range(len(shape))])
                for k, size in enumerate(shape)]

    def _temp(self, node: torch.fx.Node, like: _View, items: list[Any], group: _Group) -> _View:
        """``node``'s value, a fresh tensor shaped like ``like``: its own buffer, laid out
        row-major over time."""
        t = self.t_axis
        shape = like.coords[0].shape
        time_axes = [i for i, c in enumerate(like.coords[t].stride()) if c != 0 and shape[i] > 1]
        strides, step = [0] * len(shape), 1
        for i in reversed(time_axes):
            strides[i], step = step, step * shape[i]
        coords = list(like.coords)
        coords[t] = torch.arange(max(step, 1)).as_strided(shape, strides)
        return _View(_Buffer(items), coords, group, self.sizes(node))

    def _apply_view(self, node: torch.fx.Node, view: _View) -> _View:
        method = node.target if node.op == "call_method" else None
        reshaped = method in ("view", "reshape") or node.target is torch.reshape
        args = [None, *self.concrete(tuple(node.args[1:]), shape=reshaped, index=view.group)]
        if _has_node(node.kwargs):
            raise _Fail(f"{node.name} views the scan's buffers with sizes computed in the graph")
        # Only ops whose result is a view of their input: writes through it reach the buffer.
        # Indexing with lists or bools copies (a write to the copy leaves the buffer as it was),
        # and so does a reshape that cannot view; ``view(dtype)`` reinterprets the bytes.
        if is_call(node, operator.getitem):
            _check_basic_index(node, args[1])
        if method == "reshape" or node.target is torch.reshape:
            out = val(node)
            if not (isinstance(out, torch.Tensor) and out._is_view()):
                raise _Fail(f"{node.name} reshapes the scan's buffers into a copy")
            method = "view"
        if any(isinstance(a, torch.dtype) for a in args[1:]) or any(isinstance(a, torch.dtype) for a in node.kwargs.values()):
            raise _Fail(f"{node.name} reinterprets the scan's buffers as another dtype")
        coords = []
        for c in view.coords:
            if method is not None:
                coords.append(getattr(c, method)(*args[1:], **node.kwargs))
            else:
                coords.append(node.target(c, *args[1:], **node.kwargs))
        # The coordinates must have followed the user's tensor exactly.
        if tuple(coords[0].shape) != self.concrete(tuple(shape_of(node)), shape=True):
            raise _Fail(f"{node.name} views the scan's buffers in a way the proof does not follow")
        return _View(view.buffer, coords, view.group, self.sizes(node))

    def _transfer(self, node: torch.fx.Node, group: _Group) -> Optional[_View]:
        views = [self.values.get(a) if isinstance(a, torch.fx.Node) else None for a in node.args]
        first = views[0] if views else None
        if first is not None and (is_method(node, *_VIEW_METHODS) or is_call(node, *_VIEW_FUNCTIONS)):
            if any(v is not None for v in views[1:]):
                raise _Fail(f"{node.name} indexes the scan's buffers with a tensor")
            return self._apply_view(node, first)
        if is_method(node, "mul_", "add_") or is_call(node, operator.imul, operator.iadd):
            return self._in_place(node, group, views)
        if is_call(node, operator.setitem) or is_method(node, "copy_"):
            return self._copy(node, group, views)
        if is_method(node, "mul", "add") or is_call(node, *_MUL, *_ADD):
            return self._binary(node, group, views)
        if node.op in ("call_function", "call_method") and mutates(node):
            raise _Fail(f"{node.name} writes the scan's buffers with {node.target}, which is not "
                        "a linear-recurrence update")
        return self._exit(node, group)

    def _copy(self, node: torch.fx.Node, group: _Group, views: list[Optional[_View]]) -> None:
        """``x[index] = v`` and ``x.copy_(v)`` from another tracked tensor of the same shape and
        axes: the entries move. (``x[r] += y`` reaches the graph as an in-place add on the view
        and a setitem of that view onto itself, which changes nothing.)"""
        if node.kwargs or len(node.args) != (3 if is_call(node, operator.setitem) else 2):
            raise _Fail(f"{node.name} writes the scan's buffers with {node.target} in a form the proof does not follow")
        target, value = views[0], views[-1]
        if target is None or value is None:
            raise _Fail(f"{node.name} writes something else than the scan's own values into its buffers")
        if is_call(node, operator.setitem):
            index = self.concrete(node.args[1], index=group)
            _check_basic_index(node, index)
            # Its sizes are the value's: dynamo guards that the value fits the target it traced.
            target = _View(target.buffer, [operator.getitem(c, index) for c in target.coords], group, value.sizes)
        if target.coords[0].shape != value.coords[0].shape:
            raise _Fail(f"{node.name} copies a differently shaped value into the scan's buffers")
        roles_t, pos_t = _geometry(target, self.t_axis)
        roles_v, pos_v = _geometry(value, self.t_axis)
        if roles_t != roles_v:
            raise _Fail(f"{node.name} copies into the scan's buffers with the axes in another order")
        # No value: the node is part of the scan (erased with it, and a write _states orders).
        group.nodes.append(node)
        if value.buffer is target.buffer:
            if pos_v == pos_t:
                return None
            raise _Fail(f"{node.name} copies one part of a scan buffer onto another")
        if len(set(pos_t)) != len(pos_t):
            raise _Fail(f"{node.name} writes one time position of the scan's buffers twice")
        items = [value.buffer.items[q] for q in pos_v]
        for p, e in zip(pos_t, items):
            target.buffer.items[p] = e
        group.written.add(id(target.buffer))
        return None

    def _exit(self, node: torch.fx.Node, group: _Group) -> None:
        """``node`` reads the tracked values it takes as finished tensors: the scan's outputs.
        What they hold now is kept; it may return an alias of a buffer (``contiguous()``,
        ``.float()`` of fp32), so ``_states`` refuses any update of the buffers after it."""
        for a in node.all_input_nodes:
            v = self.values.get(a)
            if v is not None:
                roles, positions = _geometry(v, self.t_axis)
                group.exits.append((node, a, roles, [v.buffer.items[p] for p in positions]))
        return None

    def _operands(self, node: torch.fx.Node, views: list[Optional[_View]]) -> tuple[_View, _View]:
        if len(node.args) != 2 or node.kwargs or any(v is None for v in views):
            raise _Fail(f"{node.name} combines the scan's buffers with something else than another "
                        "of its buffers")
        x, y = views
        if x.coords[0].shape != y.coords[0].shape:
            raise _Fail(f"{node.name} broadcasts one of the scan's buffers against another")
        return x, y

    def _combine(self, node: torch.fx.Node, group: _Group, x: _View, y: _View, is_mul: bool) -> list[Any]:
        roles_x, pos_x = _geometry(x, self.t_axis)
        roles_y, pos_y = _geometry(y, self.t_axis)
        if roles_x != roles_y:
            raise _Fail(f"{node.name} combines the scan's buffers with their axes in different orders")
        algebra = _Algebra(group)
        op = algebra.mul if is_mul else algebra.add
        return [op(x.buffer.items[p], y.buffer.items[q]) for p, q in zip(pos_x, pos_y)]

    def _binary(self, node: torch.fx.Node, group: _Group, views: list[Optional[_View]]) -> Optional[_View]:
        if len(node.args) == 2 and not node.kwargs and sum(v is not None for v in views) == 1:
            # A product with something else (the readout's ``hs * C``) reads the buffer as it is.
            return self._exit(node, group)
        x, y = self._operands(node, views)
        is_mul = is_method(node, "mul") or is_call(node, *_MUL)
        return self._temp(node, x, self._combine(node, group, x, y, is_mul), group)

    def _in_place(self, node: torch.fx.Node, group: _Group, views: list[Optional[_View]]) -> _View:
        x, y = self._operands(node, views)
        is_mul = is_method(node, "mul_") or is_call(node, operator.imul)
        results = self._combine(node, group, x, y, is_mul)
        positions = _geometry(x, self.t_axis)[1]
        if len(set(positions)) != len(positions):
            raise _Fail(f"{node.name} writes one time position of the scan's buffers twice")
        if y.buffer is x.buffer:
            # ``A[s:].mul_(A[:-s])`` reads positions it writes at other indices. Torch refuses
            # only some such overlaps; where it does not, eager reads values already updated in
            # an order set by memory layout, not the values before the update assumed here.
            written = {p: i for i, p in enumerate(positions)}
            if any(written.get(q, j) != j for j, q in enumerate(_geometry(y, self.t_axis)[1])):
                raise _Fail(f"{node.name} reads positions of the scan's buffer that it also writes")
        for p, e in zip(positions, results):
            x.buffer.items[p] = e
        group.written.add(id(x.buffer))
        return x


def _check_basic_index(node: torch.fx.Node, index: Any) -> None:
    """Indexing by ints, slices, None and Ellipsis makes a view; lists, bools and tensors copy
    (a write to the copy leaves the buffer as it was), so they are refused."""
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, bool) or not isinstance(i, (int, slice, type(None), type(Ellipsis))) for i in items):
        raise _Fail(f"{node.name} indexes the scan's buffers with {index!r}, which copies")


def _updated_in_place(seeds: list[torch.fx.Node], limit: int = 10_000) -> bool:
    """Something downstream of ``seeds`` writes in place: for two copies that met in one op and
    then lost the proof, the sign that they were a scan's buffers (and worth a near-miss)."""
    seen, stack = set(seeds), list(seeds)
    while stack and len(seen) < limit:
        for user in stack.pop().users:
            if mutates(user):
                return True
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return False


def _has_node(x: Any) -> bool:
    found = []
    torch.fx.node.map_arg(x, found.append)
    return bool(found)


def _states(group: _Group, concrete: Callable[..., Any]) -> InplaceScan | str:
    """The proved scan of ``group``, or why its exits are not the states of a scan."""
    if group.failure is not None:
        return group.failure
    if group.indexed_by is not None:
        return group.indexed_by
    roles = group.roles
    if sorted(roles.values()) != ["a", "b"] or len(group.seeds) != 2:
        return "the in-place scan does not update exactly one multiplier copy and one offset copy"
    if not group.exits:
        return "nothing reads the in-place scan's states"
    inside = set(group.nodes)
    order = {n: i for i, n in enumerate(group.seeds[0].graph.nodes)}
    first_read = min(order[user] for user, _, _, _ in group.exits)
    late = [n for n in group.nodes if mutates(n) and order[n] > first_read]
    if late:
        return (f"{late[0].name} updates the scan's buffers after they are read outside it (the read may "
                "be an alias that sees the update)")
    read = {a for _, a, _, _ in group.exits}
    # The states, and possibly views of them taken off their time axis (``hs[:, -1]``, the last
    # state), which the rewrite checks as it does the states' other users.
    roots = [a for a in read if not (a.args and a.args[0] in read)]
    if len(roots) != 1:
        return f"the in-place scan's buffers are read outside it through {len(roots)} values; expected the states alone"
    (states,) = roots
    if any(a is not states and a.args[0] is not states for a in read):
        return "the in-place scan's buffers are read through views of views of the states"
    seed = {r: s for s, r in roles.items()}
    b_full = group.sources[group.seeds.index(seed["b"])]
    a_full = group.sources[group.seeds.index(seed["a"])]
    shape = concrete(tuple(shape_of(b_full)), shape=True)
    # Axis k of the states must walk axis k of the copies (B_full's layout), time at every step.
    layout = tuple(k if size > 1 else None for k, size in enumerate(shape))
    want = [("b", 0, t, t) for t in range(shape[group.t_axis])]
    for user, src, axes, items in group.exits:
        if src is not states:
            continue
        entries = [_Algebra(group).norm(e) for e in items]
        if axes == layout and 0 < len(entries) < len(want) and entries == want[1:len(entries) + 1]:
            return ("the in-place scan's states are read from time 1 on: row 0 of its copies is an initial state "
                    "(as mamba.py's PScan makes with H_0 concatenated ahead of the data), which the rewrite "
                    "does not hand to the op as its initial_state")
        if axes != layout or concrete(tuple(shape_of(states)), shape=True) != shape:
            return "the in-place scan's states are not laid out as B_full"
        if entries != want:
            return (f"what {user.name} reads of the in-place scan is not the inclusive scan of "
                    "(A_full, B_full) at every step")
    for n in group.nodes:
        if n not in read and any(u not in inside for u in n.users):
            return f"{n.name}, an intermediate of the in-place scan, is used outside it"
    return InplaceScan(a_full, b_full, group.t_axis, states, group.nodes)


def _proofs(gm: torch.fx.GraphModule, t_axis: int, lengths: Optional[dict[sympy.Symbol, sympy.Integer]]
            ) -> tuple[dict[tuple[str, ...], InplaceScan | InplaceMiss], list[torch.SymInt]]:
    """One interpretation: each group's proof or failure (keyed by its copies' names), and the
    symbolic time lengths of copies it could not follow."""
    interpreter = _Interpreter(gm, t_axis, lengths)
    out: dict[tuple[str, ...], InplaceScan | InplaceMiss] = {}
    for group in interpreter.run():
        # Only two copies that are both updated in place, or that a product mixed the way a scan
        # does, are reported: other copies written in place are no scan, nor a near-miss of one.
        both_written = len(group.seeds) == 2 and all(
            id(interpreter.values[s].buffer) in group.written for s in group.seeds)
        failed_update = len(group.seeds) == 2 and group.failure is not None and _updated_in_place(group.seeds)
        if group.combined or both_written or failed_update:
            result = _states(group, interpreter.concrete)
            out[tuple(sorted(s.name for s in group.seeds))] = (
                result if isinstance(result, InplaceScan) else InplaceMiss(group.seeds, result, group.nodes))
    return out, interpreter.symbolic


def _at_every_length(gm: torch.fx.GraphModule, t_axis: int, lengths: list[torch.SymInt],
                     admissible: Callable[[list[torch.SymInt]], Any]
                     ) -> dict[tuple[str, ...], InplaceScan | InplaceMiss]:
    """Under a symbolic time length (dynamo's recompile at a second length) the views' sizes are
    symbolic; the graph is interpreted at every length its guards admit, and a scan is proved
    only if it is proved, the same way, at each of them."""
    found = admissible(lengths)
    if isinstance(found, str):
        # Say so for the scans the graph holds at the length it was traced with; a scan that is
        # no scan there (a batch axis taken for time) keeps its own reason.
        env = lengths[0].node.shape_env
        hint = {s: _traced_value(s, env) for s in lengths[0].node.expr.free_symbols}
        traced = _proofs(gm, t_axis, hint)[0]
        return {key: InplaceMiss(r.nodes[:1], f"the time length is symbolic: {found}", r.nodes)
                if isinstance(r, InplaceScan) else r
                for key, r in traced.items()}
    sym, admitted = found
    proved: dict[tuple[str, ...], InplaceScan | InplaceMiss] = {}
    for n in admitted:
        for key, result in _proofs(gm, t_axis, {sym: sympy.Integer(n)})[0].items():
            first = proved.setdefault(key, result)
            if isinstance(first, InplaceMiss):
                continue
            if isinstance(result, InplaceMiss):
                proved[key] = InplaceMiss(result.seeds, f"at {sym}={n}: {result.reason}", result.nodes)
            elif (result.states, result.nodes) != (first.states, first.nodes):
                proved[key] = InplaceMiss(first.nodes[:1], f"at {sym}={n}: the scan differs from the one at "
                                          f"{sym}={admitted[0]}", first.nodes)
    for result in proved.values():
        if isinstance(result, InplaceScan):
            result.proved_lengths = tuple(admitted)
    return proved


def find_inplace_scans(gm: torch.fx.GraphModule, admissible: Callable[[list[torch.SymInt]], Any]
                       ) -> list[InplaceScan | InplaceMiss]:
    """Every in-place parallel scan in ``gm``: proved, or why not.

    Each axis of the copies is tried as the time axis in turn. ``admissible`` gives the lengths
    a symbolic time length can take under the graph's guards, ``(symbol, [lengths])``, or a
    reason string when there are too many to try.
    """
    found: dict[tuple[str, ...], InplaceScan | InplaceMiss] = {}
    for t_axis in range(4):
        proofs, symbolic = _proofs(gm, t_axis, None)
        if symbolic:
            proofs.update(_at_every_length(gm, t_axis, symbolic, admissible))
        for key, result in proofs.items():
            # A proof at any time axis wins; among misses, the axis that was followed furthest
            # (the others typically fail at the first view) has the informative reason.
            best = found.get(key)
            if (best is None or isinstance(result, InplaceScan)
                    or isinstance(best, InplaceMiss) and len(result.nodes) > len(best.nodes)):
                found[key] = result
    return list(found.values())
