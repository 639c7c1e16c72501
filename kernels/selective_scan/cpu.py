"""Chunked PyTorch selective scan: the CPU implementation behind ``ssm::selective_scan``.

Same interface as the Triton launchers (B and C already in the grouped layout
``(batch, G, N, L)``, inputs already validated by the op layer). The sequence is processed
``chunk_len`` steps at a time, so the largest temporaries are ``(chunk_len, batch, dim, N)``;
a ``(batch, dim, L, N)`` tensor is never built.

Inside a chunk everything that does not depend on the state (the discretisation, the readout
and all the gradient reductions) is vectorised over the chunk, and only the recurrence
``h_t = a_t * h_{t-1} + b_t`` itself steps through time: one ``addcmul`` per step on a
contiguous ``(batch, dim, N)`` slice of a time-major chunk buffer. That is exact (the same
order of operations as the reference) and, unlike dividing by prefix products of
``a = exp(delta * A)``, cannot underflow into 0/0.

Everything is computed in fp32 (fp64 when any input is fp64, the verification mode that the
op allows on CPU only), and results are cast back to each input's dtype.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from ..layout import empty_activation
from .grads import ScanGrads

# Chunk length: the (T, batch, dim, N) chunk buffers stay a few MB for a Mamba-130m layer,
# while the vectorised per-chunk work amortises PyTorch's per-op overhead.
CHUNK_LEN = 64

# torch.nn.functional.softplus's default threshold: above it softplus is the identity, and so
# is its derivative.
_SOFTPLUS_THRESHOLD = 20.0


def compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """fp64 when any given tensor is fp64 (CPU verification mode), else fp32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _time_major(x: torch.Tensor, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """x[..., start:end] moved to (T, ...) as a dense buffer in ``dtype``.

    The explicit copy is the chunk's cast to the compute dtype anyway; doing it time-major
    makes every per-step slice ``buf[t]`` contiguous.
    """
    chunk = x[..., start:end]
    dims = (chunk.dim() - 1,) + tuple(range(chunk.dim() - 1))
    out = torch.empty(tuple(chunk.shape[d] for d in dims), dtype=dtype, device=x.device)
    return out.copy_(chunk.permute(dims))


def _store(dst: torch.Tensor, start: int, src: torch.Tensor) -> None:
    """Write a time-major chunk result (T, ...) into dst[..., start:start + T] (casting)."""
    dims = tuple(range(1, src.dim())) + (0,)
    dst[..., start:start + src.shape[0]] = src.permute(dims)


class _Chunk:
    """One chunk's discretised inputs in the compute dtype, time-major and grouped.

    Shapes (T = chunk length, P = dim // G): ``u, delta_raw, dt``: (T, batch, dim);
    ``u5, dt5``: (T, batch, G, P, 1); ``B5, C5``: (T, batch, G, 1, N); ``a``: (T, batch, G, P, N).
    """

    def __init__(self, u, delta, A5, B, C, delta_bias, delta_softplus, start, end, cdtype):
        batch, dim, _ = u.shape
        groups = B.shape[1]
        self.length = end - start
        grouped = (self.length, batch, groups, dim // groups, 1)
        self.u = _time_major(u, start, end, cdtype)
        self.delta_raw = _time_major(delta, start, end, cdtype)
        if delta_bias is not None:
            self.delta_raw += delta_bias.to(cdtype)
        self.dt = F.softplus(self.delta_raw) if delta_softplus else self.delta_raw
        self.u5 = self.u.view(grouped)
        self.dt5 = self.dt.view(grouped)
        self.B5 = _time_major(B, start, end, cdtype).unsqueeze(3)
        self.C5 = _time_major(C, start, end, cdtype).unsqueeze(3)
        # The first step (t = 0) with dt = 0 is the identity, also where A is infinite (an
        # overflowed -exp(A_log)), instead of exp(0 * -inf) = NaN: that decay multiplies the zero
        # start state, and an associative_scan never forms it (eager's first state is dt * B * u = 0;
        # probe CI), nor does the h_-1 start, whose dt at t = 0 the pass sets to 0. Every other step
        # keeps eager's exp(dt * A): NaN for dt = 0 with A = -inf, as eager's loop and scan are
        # there (probe CN), and 0 for a tiny dt (probe CL: a finite stand-in for -inf gave
        # exp(-1e-39 * 3.4e38) = 0.71).
        rate = self.dt5 * A5
        if start == 0:
            rate[0] = torch.where(self.dt5[0] == 0, 0.0, rate[0])
        self.a = torch.exp(rate)

    def states(self, h_start: torch.Tensor) -> torch.Tensor:
        """States h_t after every step of the chunk, (T, batch, G, P, N)."""
        hs = self.dt5 * self.u5 * self.B5  # b_t, overwritten in place by h_t
        h = h_start
        for t in range(self.length):
            h = torch.addcmul(hs[t], self.a[t], h, out=hs[t])
        return hs

    def readout(self, hs: torch.Tensor) -> torch.Tensor:
        """sum_n C_t[n] * h_t[n] per channel, (T, batch, dim)."""
        return torch.matmul(hs, self.C5.transpose(-1, -2)).view(self.u.shape)


def _prepare(u, A, B, initial_state, cdtype):
    """A and the initial state in the grouped layout, in the compute dtype."""
    batch, dim, _ = u.shape
    groups, nstate = B.shape[1], B.shape[2]
    # A is a tiny (dim, N) parameter, so the copy costs nothing; dense, so that what is computed
    # from it (dA, the decays, through them the initial state's gradient) is dense whatever A's
    # strides, as the op's fake impl promises.
    A5 = A.to(cdtype).reshape(groups, dim // groups, nstate).contiguous()
    if initial_state is None:
        h = torch.zeros(batch, groups, dim // groups, nstate, dtype=cdtype, device=u.device)
    else:
        h = initial_state.to(cdtype).reshape(batch, groups, dim // groups, nstate)
    return A5, h


def selective_scan_fwd(
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, return_last_state,
    chunk_len: int = CHUNK_LEN,
):
    """Forward selective scan. Returns ``(y, last_state or None)``; y in u's layout and dtype."""
    batch, dim, L = u.shape
    cdtype = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    A5, h = _prepare(u, A, B, initial_state, cdtype)
    y = empty_activation(u)
    for start in range(0, L, chunk_len):
        end = min(start + chunk_len, L)
        chunk = _Chunk(u, delta, A5, B, C, delta_bias, delta_softplus, start, end, cdtype)
        hs = chunk.states(h)
        # Copy the last state out so the chunk buffer can be freed and last_state is dense.
        h = hs[-1].clone()
        y_c = chunk.readout(hs)
        if D is not None:
            y_c = y_c + D.to(cdtype) * chunk.u
        if z is not None:
            y_c = y_c * F.silu(_time_major(z, start, end, cdtype))
        _store(y, start, y_c)
    last_state = h.view(batch, dim, B.shape[2]) if return_last_state else None
    return y, last_state


def selective_scan_bwd(
    dy, dlast_state, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
    chunk_len: int = CHUNK_LEN,
) -> ScanGrads:
    """Gradients of ``selective_scan_fwd`` with respect to every tensor input.

    Nothing from the forward is saved: one forward sweep recomputes the state at each chunk
    boundary, then the chunks are walked in reverse, each recomputing its interior states and
    running the adjoint recurrence ``dh_t = C_t * dy_t + a_{t+1} * dh_{t+1}`` backwards in time.
    """
    batch, dim, L = u.shape
    groups, nstate = B.shape[1], B.shape[2]
    cdtype = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    A5, h = _prepare(u, A, B, initial_state, cdtype)
    starts = range(0, L, chunk_len)

    def chunk_at(start):
        end = min(start + chunk_len, L)
        return _Chunk(u, delta, A5, B, C, delta_bias, delta_softplus, start, end, cdtype)

    # Boundary states: batch * dim * N * (L / chunk_len) values, freed when this returns.
    boundary = []
    for start in starts:
        boundary.append(h)
        h = chunk_at(start).states(h)[-1].clone()

    # Layouts as the op's fake impl states them: du/ddelta/dz like their inputs, the rest dense.
    du = torch.empty_like(u)
    ddelta = torch.empty_like(delta)
    dB = torch.empty(batch, groups, nstate, L, dtype=B.dtype, device=u.device)
    dC = torch.empty(batch, groups, nstate, L, dtype=C.dtype, device=u.device)
    dz = None if z is None else torch.empty_like(z)
    dA = torch.zeros_like(A5)
    dD = None if D is None else torch.zeros(dim, dtype=cdtype, device=u.device)
    ddelta_bias = None if delta_bias is None else torch.zeros(dim, dtype=cdtype, device=u.device)
    dh = torch.zeros_like(h) if dlast_state is None else dlast_state.to(cdtype).reshape(h.shape)

    for start, h_start in zip(reversed(starts), reversed(boundary)):
        chunk = chunk_at(start)
        end = start + chunk.length
        hs = chunk.states(h_start)
        dy_c = _time_major(dy, start, end, cdtype)
        if z is not None:
            # The gate's gradient needs the ungated output, recomputed here.
            y_c = chunk.readout(hs)
            if D is not None:
                y_c = y_c + D.to(cdtype) * chunk.u
            z_c = _time_major(z, start, end, cdtype)
            sig = torch.sigmoid(z_c)
            # d silu(z)/dz = sigmoid(z) * (1 + z * (1 - sigmoid(z))).
            _store(dz, start, dy_c * y_c * sig * (1 + z_c * (1 - sig)))
            dy_c = dy_c * z_c * sig
        if D is not None:
            dD += (dy_c * chunk.u).sum((0, 1))
        dy5 = dy_c.view(chunk.u5.shape)
        # dC_t[n] = sum over the group's channels of h_t[n] * dy_t: a (N, P) @ (P, 1) product.
        _store(dC, start, torch.matmul(hs.transpose(-1, -2), dy5).squeeze(-1))

        # Adjoint recurrence. The chunk's last state also feeds whatever follows the chunk (the
        # next chunk's start, or last_state), whose gradient dh is added to that step.
        dhs = chunk.C5 * dy5  # (T, batch, G, P, N), overwritten in place by dh_t
        dhs[-1] += dh
        for t in range(chunk.length - 2, -1, -1):
            torch.addcmul(dhs[t], chunk.a[t + 1], dhs[t + 1], out=dhs[t])
        dh = chunk.a[0] * dhs[0]

        h_prev = torch.cat([h_start.unsqueeze(0), hs[:-1]])
        d_dtA = dhs * h_prev * chunk.a  # gradient of the exponent delta_t * A
        dA += (d_dtA * chunk.dt5).sum((0, 1))
        dhs_B = torch.matmul(dhs, chunk.B5.transpose(-1, -2))  # sum_n dh_t[n] * B_t[n]
        ddt = (d_dtA * A5).sum(-1, keepdim=True) + dhs_B * chunk.u5
        du_c = (dhs_B * chunk.dt5).view(chunk.u.shape)
        if D is not None:
            du_c += dy_c * D.to(cdtype)
        _store(dB, start, torch.matmul(dhs.transpose(-1, -2), chunk.dt5 * chunk.u5).squeeze(-1))

        ddt = ddt.view(chunk.u.shape)
        if delta_softplus:
            raw = chunk.delta_raw
            ddt = torch.where(raw > _SOFTPLUS_THRESHOLD, ddt, ddt * torch.sigmoid(raw))
        if delta_bias is not None:
            ddelta_bias += ddt.sum((0, 1))
        _store(du, start, du_c)
        _store(ddelta, start, ddt)

    return ScanGrads(
        du=du,
        ddelta=ddelta,
        dA=dA.view(dim, nstate).to(A.dtype),
        dB=dB,
        dC=dC,
        dD=None if D is None else dD.to(D.dtype),
        dz=dz,
        ddelta_bias=None if delta_bias is None else ddelta_bias.to(delta_bias.dtype),
        dinitial_state=(
            None if initial_state is None else dh.reshape(batch, dim, nstate).to(initial_state.dtype).contiguous()
        ),
    )
