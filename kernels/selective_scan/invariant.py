"""Time-invariant B or C for ``ssm::selective_scan``: a (dim, N) tensor, mamba_ssm's
``is_variable_B`` / ``is_variable_C`` false (S4D-style code, ``selective_scan_ref`` with a fixed B).

The launchers (``cpu.py``, the Triton ones) take B and C as (batch, G, N, L) with one G for
both. A (dim, N) one reaches them as a stride-0 view with G = dim, no copy, and so must the
other: a (batch, N, L) or (batch, 1, N, L) one through a stride-0 group axis, a grouped one only
when its G is already dim (``check_pair`` refuses the rest).

The forward needs nothing more. The backward does: with G = dim the launchers return dB and dC
per (batch, channel, state, step), a (batch, dim, N, L) tensor, and summing that afterwards (over
batch and time for a (dim, N) input, over channels for a (batch, N, L) one) would write N values
per channel and step, the memory the op exists to avoid. ``backward`` therefore runs the launcher
over time segments, last segment first. Segment k starts from the state that one forward sweep
over the segments kept at its start, receives as its last state's gradient the previous call's
d initial_state, and has its (batch, dim, N, S) dB/dC reduced before the next call. With
``S = ceil(L / N)`` steps (at least ``min(L, MIN_SEGMENT)``) those buffers hold about
batch·dim·L values, and the kept states batch·dim·N per segment for at most N segments: no
N·L term. The reductions run in a fixed order, so the gradients are deterministic.
"""
import torch

from .cpu import compute_dtype
from .grads import ScanGrads

# Shortest segment worth a launcher call: below it the calls' fixed cost dominates, and the
# (batch, dim, N, MIN_SEGMENT) buffers stay small next to the (batch, dim, L) activations.
MIN_SEGMENT = 64


def any_time_invariant(B: torch.Tensor, C: torch.Tensor) -> bool:
    return B.dim() == 2 or C.dim() == 2


def check_pair(B: torch.Tensor, C: torch.Tensor, batch: int, dim: int, dstate: int, seqlen: int) -> None:
    """Shapes of a B/C pair of which at least one is (dim, N); raises ValueError naming it."""
    for name, t in (("B", B), ("C", C)):
        other = "C" if name == "B" else "B"
        if t.dim() == 2:
            if tuple(t.shape) != (dim, dstate):
                raise ValueError(f"selective_scan: a time-invariant {name} must have shape (dim, N) = "
                                 f"{(dim, dstate)}, got {tuple(t.shape)}")
        elif t.dim() == 3:
            if tuple(t.shape) != (batch, dstate, seqlen):
                raise ValueError(f"selective_scan: {name} must have shape (batch, N, L) = "
                                 f"{(batch, dstate, seqlen)}, got {tuple(t.shape)}")
        elif t.dim() == 4:
            if tuple(t.shape) not in ((batch, 1, dstate, seqlen), (batch, dim, dstate, seqlen)):
                raise ValueError(
                    f"selective_scan: with a time-invariant {other} (dim, N), a grouped {name} must have "
                    f"G = 1 or G = dim (the op reads both per channel then), shape (batch, 1, N, L) or "
                    f"{(batch, dim, dstate, seqlen)}, got {tuple(t.shape)}")
        else:
            raise ValueError(f"selective_scan: {name} must be (dim, N), (batch, N, L) or grouped "
                             f"(batch, G, N, L), got shape {tuple(t.shape)}")


def per_channel(X: torch.Tensor, batch: int, dim: int, seqlen: int) -> torch.Tensor:
    """X as the launchers' (batch, G = dim, N, L), a stride-0 view of a (dim, N), (batch, N, L)
    or (batch, 1 or dim, N, L) tensor."""
    if X.dim() == 2:
        return X[None, :, :, None].expand(batch, dim, X.shape[1], seqlen)
    if X.dim() == 3:
        X = X.unsqueeze(1)
    return X.expand(batch, dim, X.shape[2], seqlen)


def launcher_views(B: torch.Tensor, C: torch.Tensor, batch: int, dim: int, seqlen: int):
    """B and C as every launcher takes them, (batch, G, N, L) views with one G: a 3-D one gets
    G = 1, and a pair with a (dim, N) member gets G = dim."""
    if any_time_invariant(B, C):
        return per_channel(B, batch, dim, seqlen), per_channel(C, batch, dim, seqlen)
    return tuple(X.unsqueeze(1) if X.dim() == 3 else X for X in (B, C))


def segment_length(seqlen: int, dstate: int, min_segment: int | None = None) -> int:
    # MIN_SEGMENT read at the call, so that a test can shorten the segments module-wide.
    return min(seqlen, max(-(-seqlen // dstate), MIN_SEGMENT if min_segment is None else min_segment))


class _Reduced:
    """One of B/C whose per-channel gradient is reduced segment by segment."""

    def __init__(self, X: torch.Tensor, cdtype: torch.dtype, batch: int, dim: int, seqlen: int):
        self.X = X
        # A (dim, N) or ungrouped X has no dim-sized axis of its own: its gradient is a sum over
        # segments or channels, so the launcher gets (and returns) it in the compute dtype, and it
        # is rounded to X's dtype once at the end. A per-channel (batch, dim, N, L) X is the
        # user's own tensor at that size; each of its gradient's elements comes from one call.
        self.summed = not (X.dim() == 4 and X.shape[1] == dim and dim > 1)
        src = X.to(cdtype) if self.summed else X
        self.view = per_channel(src, batch, dim, seqlen)
        if X.dim() == 2:
            self.grad = torch.zeros(X.shape, dtype=cdtype, device=X.device)
        else:
            self.grad = torch.empty(X.shape, dtype=cdtype if self.summed else X.dtype, device=X.device)

    def segment(self, start: int, end: int) -> torch.Tensor:
        return self.view[..., start:end]

    def add(self, g: torch.Tensor, start: int, end: int) -> None:
        """Fold a segment's (batch, dim, N, S) gradient in."""
        if self.X.dim() == 2:
            self.grad += g.sum((0, 3))
        elif not self.summed:
            self.grad[..., start:end] = g
        else:
            self.grad.view(g.shape[0], -1, g.shape[2], self.X.shape[-1])[:, 0, :, start:end] = g.sum(1)

    def result(self) -> torch.Tensor:
        return self.grad.to(self.X.dtype)


def backward(scan_fwd, scan_bwd, dy, dlast_state, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
             min_segment: int | None = None) -> ScanGrads:
    """``scan_bwd`` (a launcher's ``selective_scan_bwd``) for a (dim, N) B or C, segment by segment
    (module docstring); ``scan_fwd``, the same launcher family's forward, finds the segments' states.

    B and C as the op takes them (2-, 3- or 4-D, checked by ``check_pair``); dB and dC are
    returned in those shapes and dtypes.
    """
    batch, dim, seqlen = u.shape
    cdtype = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    seg = segment_length(seqlen, A.shape[1], min_segment)
    starts = list(range(0, seqlen, seg))
    rB, rC = (_Reduced(X, cdtype, batch, dim, seqlen) for X in (B, C))
    # D's and the bias's gradients are sums over the segments too: computed wide, rounded once.
    Dw = None if D is None else D.to(cdtype)
    biasw = None if delta_bias is None else delta_bias.to(cdtype)

    def part(x, start, end):
        return None if x is None else x[..., start:end]

    # The state at each segment's start: a forward sweep that keeps nothing else.
    states, h = [], initial_state
    for start in starts[:-1]:
        end = start + seg
        states.append(h)
        _, h = scan_fwd(
            u[..., start:end], delta[..., start:end], A, rB.segment(start, end), rC.segment(start, end), None,
            None, biasw, delta_softplus, h, True)
    states.append(h)

    du, ddelta = torch.empty_like(u), torch.empty_like(delta)
    dz = None if z is None else torch.empty_like(z)
    dA = torch.zeros(A.shape, dtype=cdtype, device=A.device)
    dD = None if D is None else torch.zeros(D.shape, dtype=cdtype, device=D.device)
    dbias = None if delta_bias is None else torch.zeros(delta_bias.shape, dtype=cdtype, device=u.device)
    carry = dlast_state
    for k in reversed(range(len(starts))):
        start, end = starts[k], min(starts[k] + seg, seqlen)
        g = scan_bwd(
            dy[..., start:end], carry, u[..., start:end], delta[..., start:end], A, rB.segment(start, end),
            rC.segment(start, end), Dw, part(z, start, end), biasw, delta_softplus, states[k])
        du[..., start:end] = g.du
        ddelta[..., start:end] = g.ddelta
        if dz is not None:
            dz[..., start:end] = g.dz
        dA += g.dA
        if dD is not None:
            dD += g.dD
        if dbias is not None:
            dbias += g.ddelta_bias
        rB.add(g.dB, start, end)
        rC.add(g.dC, start, end)
        carry = g.dinitial_state
    return ScanGrads(
        du=du, ddelta=ddelta, dA=dA.to(A.dtype), dB=rB.result(), dC=rC.result(),
        dD=None if dD is None else dD.to(D.dtype), dz=dz,
        ddelta_bias=None if dbias is None else dbias.to(delta_bias.dtype),
        dinitial_state=carry if initial_state is not None else None,
    )
