"""Mamba code written with einops (``passes/einops_calls.py``).

einops' functions reach the backend as opaque graph nodes; the pass replaces each by the torch
calls einops makes for it, so the matchers see the discretisation, the group broadcast and the
layout changes. mamba-minimal and mamba_ssm's ``selective_scan_ref`` are written here from the
public code with their einops calls kept. The checks: every block family is rewritten, outputs
and gradients match an fp64 eager run, a near-miss written with einops is still refused, einops
calls that are not Mamba code compute what eager computes, and a call the pass cannot write out
(``pack``) stays one node.
"""
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from utils import TOL, rel_err

import ssm_compile
from ssm_compile.report import explain

einops = pytest.importorskip("einops", reason="einops is in the test extra (pyproject.toml); install it")
from einops import einsum, pack, rearrange, reduce, repeat, unpack  # noqa: E402

BLOCK = ("conv1d", "x_dt_proj", "delta", "discretization", "scan_loop", "readout", "skip", "gate")
EINOPS_FUNCTIONS = (einsum, pack, rearrange, reduce, repeat, unpack)


def _registered(fn) -> bool:
    """Whether dynamo keeps ``fn`` as one opaque call. ``is_callable_allowed`` first runs the
    registration that dynamo itself makes for einops at its first sight of an einops object: on
    torch 2.11 with einops 0.8.2 that registration is ``allow_in_graph`` (torch 2.11 looks for a
    flag that einops 0.8.2 no longer sets), on torch 2.13 it is none. Reading
    ``_allowed_callable_ids`` before it, as this file did, said "traced" on torch 2.11 and then
    met opaque calls in the graph."""
    from torch._dynamo import trace_rules

    return trace_rules.is_callable_allowed(fn)


@pytest.fixture(params=["traced", "opaque"])
def opaque(request):
    """How dynamo meets einops. einops 0.8.2 lets torch >= 2.8 trace its functions, so the graph
    holds the torch calls they make ("traced"; where dynamo or einops registers them anyway, as
    torch 2.11 does with einops 0.8.2, this case is opaque too). einops up to 0.8.1 registered
    them with ``allow_in_graph`` at its first call on a tensor: one opaque node per call, which
    ``passes/einops_calls.py`` expands ("opaque", done here as einops did it and undone
    afterwards). Yields whether the calls are opaque."""
    from torch._dynamo import trace_rules

    if request.param == "traced":
        yield all(_registered(f) for f in EINOPS_FUNCTIONS)
        return
    fresh = [f for f in EINOPS_FUNCTIONS if not _registered(f)]
    torch._dynamo.allow_in_graph(fresh)
    try:
        yield True
    finally:
        for f in fresh:
            trace_rules._allowed_callable_ids.remove(id(f))
        torch._dynamo.reset()


class MinimalBlock(nn.Module):
    """johnma2006/mamba-minimal's MambaBlock, einops calls as written there."""

    def __init__(self, d_model=8, d_state=4, expand=2, d_conv=4):
        super().__init__()
        self.d_inner = d_inner = expand * d_model
        self.dt_rank = math.ceil(d_model / 16)
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner)
        A = repeat(torch.arange(1, d_state + 1), "n -> d n", d=d_inner)
        self.A_log = nn.Parameter(torch.log(A.float()) + 0.1 * torch.randn(d_inner, d_state))
        self.D = nn.Parameter(torch.randn(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, x):
        _, l, _ = x.shape
        x, res = self.in_proj(x).split([self.d_inner, self.d_inner], dim=-1)
        x = rearrange(x, "b l d_in -> b d_in l")
        x = self.conv1d(x)[:, :, :l]
        x = F.silu(rearrange(x, "b d_in l -> b l d_in"))
        y = self.ssm(x) * F.silu(res)
        return self.out_proj(y)

    def ssm(self, x):
        n = self.A_log.shape[1]
        A = -torch.exp(self.A_log.float())
        delta, B, C = self.x_proj(x).split([self.dt_rank, n, n], dim=-1)
        delta = F.softplus(self.dt_proj(delta))
        return self.selective_scan(x, delta, A, B, C, self.D.float())

    def selective_scan(self, u, delta, A, B, C, D):
        b, l, d_in = u.shape
        deltaA = torch.exp(einsum(delta, A, "b l d_in, d_in n -> b l d_in n"))
        deltaB_u = einsum(delta, B, u, "b l d_in, b l n, b l d_in -> b l d_in n")
        x = torch.zeros((b, d_in, A.shape[1]), device=u.device)
        ys = []
        for i in range(l):
            x = self.step(deltaA[:, i], x, deltaB_u[:, i])
            ys.append(einsum(x, C[:, i, :], "b d_in n, b n -> b d_in"))
        return torch.stack(ys, dim=1) + u * D

    @staticmethod
    def step(dA, x, dBu):
        return dA * x + dBu


class SquashedMinimalBlock(MinimalBlock):
    """A near-miss: the state goes through tanh each step, which no scan computes."""

    @staticmethod
    def step(dA, x, dBu):
        return torch.tanh(dA * x + dBu)


def selective_scan_ref(u, delta, A, B, C, D, z, delta_bias):
    """mamba_ssm's ``selective_scan_ref`` (real A, variable B and C, softplus, last state)."""
    dtype_in = u.dtype
    u, delta = u.float(), delta.float()
    delta = F.softplus(delta + delta_bias[..., None].float())
    batch, dim, dstate = u.shape[0], A.shape[0], A.shape[1]
    B, C = B.float(), C.float()
    x = A.new_zeros((batch, dim, dstate))
    ys = []
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    if B.dim() == 3:
        deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    else:
        B = repeat(B, "B G N L -> B (G H) N L", H=dim // B.shape[1])
        deltaB_u = torch.einsum("bdl,bdnl,bdl->bdln", delta, B, u)
    if C.dim() == 4:
        C = repeat(C, "B G N L -> B (G H) N L", H=dim // C.shape[1])
    last_state = None
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        if C.dim() == 3:
            y = torch.einsum("bdn,bn->bd", x, C[:, :, i])
        else:
            y = torch.einsum("bdn,bdn->bd", x, C[:, :, :, i])
        if i == u.shape[2] - 1:
            last_state = x
        ys.append(y)
    y = torch.stack(ys, dim=2)
    out = (y + u * rearrange(D, "d -> d 1")) * F.silu(z)
    return out.to(dtype=dtype_in), last_state


def scan_inputs(groups, length, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch, dim, n = 2, 8, 4
    bc = (batch, n, length) if groups == 0 else (batch, groups, n, length)
    tensors = dict(u=(batch, dim, length), delta=(batch, dim, length), B=bc, C=bc, z=(batch, dim, length),
                   D=(dim,), delta_bias=(dim,))
    out = {k: torch.randn(*s, generator=g, dtype=dtype) for k, s in tensors.items()}
    out["A"] = -torch.rand(dim, n, generator=g, dtype=dtype) - 0.5
    return out


def call_ref(inputs):
    return selective_scan_ref(**inputs)


@pytest.mark.parametrize("groups", [0, 2], ids=["shared_BC", "grouped_BC"])
def test_selective_scan_ref_with_einops_is_rewritten(groups, opaque):
    inputs = scan_inputs(groups, length=10)
    report = explain(call_ref, inputs)
    assert ("einops_einops_rearrange" in str(report)) == opaque
    for family in ("delta", "discretization", "scan_loop", "readout", "skip", "gate"):
        assert report.counts.get(family) == 1, report.format(graphs=False)
    # The reference computes in fp32 whatever it is given (``u.float()``): eager's fp32 run is
    # the reference here.
    for out, expected in zip(report.output, call_ref(inputs)):
        assert rel_err(out, expected) <= TOL[torch.float32]


def test_grouped_selective_scan_ref_under_dynamic_shapes(opaque):
    """Under ``dynamic=True`` einops' repeat computes its sizes from the symbolic batch and groups;
    the pass writes those sizes out as dynamo writes size arithmetic, so a second length and a
    second batch are rewritten in the recompiled graphs too."""
    compiled = torch.compile(call_ref, backend=ssm_compile.backend(inductor=False), dynamic=True)
    for length in (10, 13):
        counters.clear()
        inputs = scan_inputs(2, length, seed=length)
        grads = {k: v.requires_grad_() for k, v in inputs.items()}
        out, last = compiled(grads)
        assert counters["ssm"]["scan_loop"] == 1 and counters["ssm"]["delta"] == 1, dict(counters["ssm"])
        eager = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
        ref, ref_last = call_ref(eager)
        assert rel_err(out, ref) <= TOL[torch.float32] and rel_err(last, ref_last) <= TOL[torch.float32]
        (out.sum() + last.square().sum()).backward()
        (ref.sum() + ref_last.square().sum()).backward()
        for k in inputs:
            assert rel_err(grads[k].grad, eager[k].grad) <= 1e-4, k


def test_mamba_minimal_block_is_rewritten_and_trains_like_eager(opaque):
    torch.manual_seed(0)
    block = MinimalBlock()
    x = torch.randn(2, 12, 8)
    report = explain(block, x)
    for family in BLOCK:
        assert report.counts.get(family) == 1, report.format(graphs=False)
    before, after = str(report).split("-- graph after --")
    assert ("einops_einops_einsum" in before) == opaque and "einops" not in after
    ref = block.double()(x.double())
    assert rel_err(report.output, ref) <= TOL[torch.float32]

    block.float()
    eager_out = block(x)
    eager_grads = torch.autograd.grad(eager_out.square().sum(), list(block.parameters()))
    compiled = torch.compile(block, backend="ssm")
    out = compiled(x)
    grads = torch.autograd.grad(out.square().sum(), list(block.parameters()))
    assert rel_err(out, eager_out) <= TOL[torch.float32]
    for name, got, want in zip(dict(block.named_parameters()), grads, eager_grads):
        assert rel_err(got, want) <= 1e-4, name


def test_near_miss_written_with_einops_is_still_refused(opaque):
    torch.manual_seed(0)
    block = SquashedMinimalBlock()
    x = torch.randn(2, 8, 8)
    report = explain(block, x)
    assert "scan_loop" not in report.counts, report.format(graphs=False)
    assert any(m.family == "scan_loop" and "not linear" in m.reason for m in report.misses), report.format(graphs=False)
    assert rel_err(report.output, block.double()(x.double())) <= TOL[torch.float32]


def other_einops(x, w):
    """einops calls that are not Mamba code: composite axes, a reduction, a repeat with a new
    axis, a multi-letter einsum; each written out by the pass, all computing what eager does."""
    heads = rearrange(x, "b l (h p) -> b h l p", p=2)
    pooled = reduce(heads, "b h l p -> b h p", "mean")
    tiled = repeat(pooled, "b h p -> b h p r", r=3)
    mixed = einsum(x, w, "batch len dim, dim out -> batch out len")
    return tiled.sum(-1), mixed, rearrange(mixed, "b o l -> (b l) o")


def test_einops_calls_that_are_not_mamba_compute_what_eager_computes(caplog, opaque):
    x, w = torch.randn(2, 5, 6), torch.randn(6, 3)
    with caplog.at_level(logging.INFO, logger="ssm_compile"):
        out = torch.compile(other_einops, backend=ssm_compile.backend(inductor=False), fullgraph=True)(x, w)
    written = [r.getMessage() for r in caplog.records if "read as" in r.getMessage()]
    assert len(written) == (5 if opaque else 0), written
    for got, want in zip(out, other_einops(x.double(), w.double())):
        assert got.shape == want.shape and rel_err(got, want) <= TOL[torch.float32]


def packed(x, y):
    both, shapes = pack([x, y], "b * d")
    return both * 2, shapes


@pytest.mark.parametrize("opaque", ["opaque"], indirect=True)
def test_a_call_that_returns_more_than_a_tensor_stays_one_call_with_a_reason(opaque):
    x, y = torch.randn(2, 3, 4), torch.randn(2, 4)
    report = explain(packed, x, y)
    (miss,) = [m for m in report.misses if m.family == "einops"]
    assert "einops.packing.pack at pack stays one call" in miss.reason and "not one tensor" in miss.reason
    assert torch.equal(report.output[0], packed(x, y)[0])


class AutocastMinimalBlock(MinimalBlock):
    """The block with its own bf16 autocast region, opened inside the compiled code."""

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x)


@pytest.mark.parametrize("opaque", ["opaque"], indirect=True)
def test_calls_inside_an_autocast_region_are_recorded_under_it(opaque):
    """The readout's ``einsum(x, C, ...)`` of an fp32 state and a bf16 C only runs under the
    region's autocast; recorded outside it, it failed, stayed opaque, and the scan was refused
    with a reason about the readout."""
    torch.manual_seed(0)
    block = AutocastMinimalBlock()
    x = torch.randn(2, 10, 8)
    report = explain(block, x)
    for family in ("conv1d", "delta", "discretization", "scan_loop", "readout", "skip", "gate"):
        assert report.counts.get(family) == 1, report.format(graphs=False)
    assert not [m for m in report.misses if m.family == "einops"], report.format(graphs=False)
    ref = block(x)
    assert ref.dtype == report.output.dtype
    assert rel_err(report.output, block.double()(x.double())) <= 2 * rel_err(ref, block.double()(x.double()))


def einsum_in_regions(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = einsum(x, w, "b i, i j -> b j")
    with torch.no_grad():
        frozen = einsum(x, w, "b i, i j -> b j")
    return low, frozen


@pytest.mark.parametrize("opaque", ["opaque"], indirect=True)
def test_recorded_values_carry_the_regions_dtype_and_grad_mode(opaque):
    from utils import PassCapture

    from ssm_compile.passes import conv1d

    cap = PassCapture(conv1d)
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 5)
    low, frozen = torch.compile(einsum_in_regions, backend=cap, fullgraph=True)(x, w)
    values = {n.name: n.meta["val"] for n in cap.gm.graph.nodes if n.op == "call_function" and "einsum" in n.name}
    assert sorted((str(v.dtype), v.requires_grad) for v in values.values()) == [
        ("torch.bfloat16", True), ("torch.float32", False)], values
    assert low.dtype == torch.bfloat16 and not frozen.requires_grad
