"""Readouts of a whole (batch, dim, time, state) tensor of states: ``y = Σ_n states · C``.

Shared by the scan forms that produce every state before reading them out: HF's
``associative_scan`` (``scan_assoc``) and loops that stack the states and read them out after
the loop (mamba.py's ``selective_scan_seq``: ``hs = torch.stack(hs, 1); y = (hs @ C[..., None])``,
``scan_loop``). ``match_readout`` proves the readout with ``discretize.index_term``;
``last_state_index`` recognises ``states[..., -1, ...]``; ``split_state_users`` sorts every user
of the states into those two kinds.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx

from .discretize import index_term, product_source
from .fx_utils import dtype_of, follow_views, is_call, is_cast, is_method, named_args, shape_of, storage_of

__all__ = ["Readout", "match_readout", "last_state_index", "loose_readout", "split_state_users"]


@dataclasses.dataclass
class Readout:
    end: torch.fx.Node          # the node whose value is y in ``out_roles`` layout ("1": a size-1 axis)
    C: torch.fx.Node
    C_roles: tuple[str, ...]
    out_roles: tuple[str, ...]
    nodes: list[torch.fx.Node]  # what the index proof looked through
    chain: list[torch.fx.Node] = dataclasses.field(default_factory=list)  # states -> end


def _same_states(states: torch.fx.Node) -> list[torch.fx.Node]:
    """``states`` and its no-op casts (``.to(its own dtype)``, ``.float()`` of fp32), which return
    the very tensor. The op replaces the states, so reading them through such a cast needs no
    copy kept apart from a caller's write (``protects_saved_input``, where ``index_term`` would
    otherwise stop): HF's assoc branch reads ``states.to(input_dtype)`` and returns
    ``states[:, :, -1]`` (fuzz seed 249)."""
    own = storage_of(states)
    return [states] + [u for u in states.users
                       if is_cast(u) and own is not None and storage_of(u) == own and dtype_of(u) == dtype_of(states)]


def _complete_readout(node: torch.fx.Node, states: torch.fx.Node, roles: tuple[str, ...]
                      ) -> Optional[Readout]:
    same = _same_states(states)
    term = index_term(node, stop=same, allow_sum=True)
    if term is None or term.exp_of is not None or len(term.factors) < 2:
        return None
    mine = [f for f in term.factors if f.node in same]
    others = [f for f in term.factors if f.node not in same]
    if len(mine) != 1:
        return None
    role = {}
    for lab, r in zip(term.factor_labels(mine[0]), roles):
        if role.setdefault(lab, r) != r:
            return None
    out = term.out_labels()
    # A label of the output the states don't have is a size-1 axis the readout keeps
    # (``sum(-1, keepdim=True)``, a C[..., None] broadcast): role "1", which the op's y gets as
    # an unsqueeze. A wider one is a broadcast of C along an axis of its own: not a readout.
    shape = shape_of(node)
    if shape is None or len(shape) != len(out):
        return None
    if any(lab not in role and not _is_one(size) for lab, size in zip(out, shape)):
        return None
    # C may be a product (weight · rms_normalised(C_raw), Jamba's inner norm): one graph value
    # must hold exactly that product.
    c_src = product_source(term, others, role)
    if c_src is None:
        return None
    out_roles = tuple(role.get(x, "1") for x in out)
    n_label = next(lab for lab, r in role.items() if r == "n")
    # C per (batch, step), or time-invariant: (dim, N) or (N,), mamba_ssm's is_variable_C=False,
    # or (batch, N), one per batch element (the op reads it as a stride-0 (batch, N, L) view).
    if (sorted(c_src.roles) not in (["b", "n", "t"], ["d", "n"], ["n"], ["b", "n"])
            or sorted(r for r in out_roles if r != "1") != ["b", "d", "t"]
            or term.summed_labels() != {n_label}):
        return None
    return Readout(node, c_src.node, c_src.roles, out_roles, term.looked_through)


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


def match_readout(user: torch.fx.Node, states: torch.fx.Node, roles: tuple[str, ...]
                  ) -> Optional[Readout]:
    """Follow ``user`` forward (single users) to the first node that is Σ_n states·C, or, when
    that one keeps size-1 axes (``h @ C[..., None]``), to the last one of the nodes right after
    it that still is (``.squeeze(-1)``): the op's y then needs no axes added and removed."""
    node, chain, found = user, [], None
    for _ in range(8):
        chain.append(node)
        complete = _complete_readout(node, states, roles)
        if complete is None and found is not None:
            break
        if complete is not None:
            found = dataclasses.replace(complete, chain=list(chain))
            if "1" not in complete.out_roles:
                break
        if len(node.users) != 1:
            break
        (node,) = node.users
    return None if found is None else _through_views(found)


def _loose_chain(user: torch.fx.Node, states: torch.fx.Node) -> Optional[str]:
    """``loose_readout``'s reason for the first node on ``user``'s chain of single users (as far as
    ``match_readout`` looks) that has one, else None."""
    node = user
    for _ in range(8):
        reason = loose_readout(node, states)
        if reason is not None or len(node.users) != 1:
            return reason
        (node,) = node.users
    return None


def _through_views(readout: Readout) -> Readout:
    """Absorb the permutations and casts right after the readout (HF's ``.transpose(1, 2)``), so
    the op's ``y`` reaches the user through one permute instead of a chain of views."""
    end, perm, chain = follow_views(readout.end)
    return dataclasses.replace(readout, end=end, out_roles=tuple(readout.out_roles[p] for p in perm),
                               chain=readout.chain + chain)


def _reads_product(node: object, states: torch.fx.Node, summed: bool) -> bool:
    """``node`` is Σ states·C (``summed``) or the elementwise states·C the sum reads: two factors,
    one of them the states."""
    if not isinstance(node, torch.fx.Node):
        return False
    term = index_term(node, stop=[states], allow_sum=True)
    return (term is not None and term.exp_of is None and len(term.factors) == 2
            and sum(f.node is states for f in term.factors) == 1 and bool(term.summed) == summed)


def loose_readout(node: torch.fx.Node, states: torch.fx.Node) -> Optional[str]:
    """Why ``node``, a step of a readout of ``states`` with C, is one the readout matchers do not
    read, where it is a sum given a dtype (``(h * C).sum(-1, dtype=torch.float64)``) or a
    ``squeeze()`` naming no axis (``(h @ C[..., None]).squeeze()``); None where it is neither."""
    if is_call(node, torch.sum) or is_method(node, "sum"):
        x, dtype = named_args(node, ("input", "dim", "keepdim")).get("input"), node.kwargs.get("dtype")
        if dtype is None or not _reads_product(x, states, summed=False):
            return None
        widened = "" if dtype == dtype_of(x) else f", not in the product's {dtype_of(x)}"
        return (f"the readout {node.name} sums the product of the state and C with dtype={dtype}: y is accumulated "
                f"and returned in {dtype}{widened}, and the scan matchers read only a sum that names no dtype")
    if (is_call(node, torch.squeeze) or is_method(node, "squeeze")) and len(node.args) == 1 and not node.kwargs:
        if not _reads_product(node.args[0], states, summed=True):
            return None
        return (f"the readout {node.name} = {node.args[0].name}.squeeze() (Σ of the state times C) names no axis: it "
                "drops every size-1 axis, a batch or dim axis of size 1 too, and the scan matchers read a squeeze "
                "only by the axes it names (squeeze(-1))")
    return None


def last_state_index(node: torch.fx.Node, states: torch.fx.Node, t_axis: int, length: int) -> bool:
    """``node`` is ``states[..., -1, ...]`` (the last time step, every other axis whole)."""
    ndim = len(shape_of(states))
    if is_method(node, "select") or is_call(node, torch.select):
        dim, index = node.args[1:3] if len(node.args) == 3 else (None, None)
        return (isinstance(dim, int) and dim % ndim == t_axis and isinstance(index, int)
                and (index == -1 or (isinstance(length, int) and index == length - 1)))
    if not (is_call(node, operator.getitem) and node.args[0] is states):
        return False
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if len(idx) > ndim or len(idx) <= t_axis:
        return False
    for axis, i in enumerate(idx):
        if axis == t_axis:
            if not (isinstance(i, int) and (i == -1 or (isinstance(length, int) and i == length - 1))):
                return False
        elif i != slice(None):
            return False
    return True


def split_state_users(states: torch.fx.Node, roles: tuple[str, ...], t_axis: int, length: int,
                      producers: frozenset[torch.fx.Node] = frozenset()
                      ) -> tuple[Readout, list[torch.fx.Node]] | str:
    """Every user of ``states`` must be the one readout Σ_n h·C or a view of the last state:
    nothing else may see the (batch, dim, time, state) tensor the op never materialises.
    ``producers`` are users that compute the states (an in-place scan's updates of its own
    buffer), replaced with them.

    Returns (the readout, the last-state views) or the reason the states cannot be replaced.
    """
    readouts, lasts = [], []
    for user in states.users:
        if user in producers:
            continue
        if last_state_index(user, states, t_axis, length):
            lasts.append(user)
            continue
        readout = match_readout(user, states, roles)
        if readout is None:
            return (_loose_chain(user, states)
                    or f"the states are used by {user.name}, which is neither a readout Σ_n h·C nor the last state")
        readouts.append(readout)
    if len(readouts) != 1:
        return f"expected one readout of the states, found {len(readouts)}"
    return readouts[0], lasts

