"""Grad-mode, autocast, functorch and forward-AD context around a Mamba scan, and graph inputs that
alias each other (the adversarial prober's families A-D, /work/probes/REPORT.md).

Dynamo records ``torch.no_grad()``, ``torch.enable_grad()``, ``torch.autocast`` and ``torch.func``
transforms as nodes inside the graph. A rewrite that puts an op on the other side of such a node
from the nodes it replaces gives the same values but other gradients (or another precision), so
the passes number the graph's context regions (``passes.fx_utils.ContextRegions``) and refuse, with
a reason, a rewrite whose replaced nodes, folded nodes and insertion point are not in one region.

Every case compares values AND gradients with eager in float64 (float32 where an op needs it), and
checks either the rewrite or the reason in ``explain``. Positive controls: the same code without
the boundary, and a block entirely under ``torch.no_grad()`` or entirely inside
``torch.enable_grad()``, are still rewritten.
"""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._higher_order_ops.associative_scan import associative_scan
from utils import MinimalMambaBlock

import ssm_compile
from ssm_compile.report import explain

BOUNDARY = "grad-mode/autocast/functorch boundary"


def inputs(dtype=torch.float64, b=2, d=6, L=7, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(u=torch.randn(b, d, L, generator=g, dtype=dtype),
                delta=torch.rand(b, d, L, generator=g, dtype=dtype) * 0.5 + 0.05,
                A=-(torch.rand(d, n, generator=g, dtype=dtype) + 0.5),
                B=torch.randn(b, n, L, generator=g, dtype=dtype), C=torch.randn(b, n, L, generator=g, dtype=dtype),
                D=torch.randn(d, generator=g, dtype=dtype), z=torch.randn(b, d, L, generator=g, dtype=dtype),
                dt=torch.randn(b, d, L, generator=g, dtype=dtype), dt_bias=torch.randn(d, generator=g, dtype=dtype))


def disc(u, delta, A, B):
    return torch.exp(torch.einsum("bdl,dn->bdln", delta, A)), torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)


def run_loop(dA, dBu, C, no_grad_steps=()):
    h = torch.zeros(dA.shape[0], dA.shape[1], dA.shape[3], dtype=dA.dtype)
    ys = []
    for t in range(dA.shape[2]):
        if t in no_grad_steps:
            with torch.no_grad():
                h = dA[:, :, t] * h + dBu[:, :, t]
        else:
            h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, 2)


def scan(u, delta, A, B, C):
    return run_loop(*disc(u, delta, A, B), C)


def fwd_bwd(fn, args, backend=None):
    """Output and the gradients of every floating argument for a fixed random cotangent."""
    xs = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    f = fn if backend is None else torch.compile(fn, backend=backend)
    y = f(*xs)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(99), dtype=y.dtype)
    if y.requires_grad:
        (y * cot).sum().backward()
    return y.detach(), [x.grad for x in xs]


def assert_same(fn, args, tol=1e-10, backend=None):
    """Compiled (``inductor=False`` unless told) values and gradients equal eager's; returns the
    ssm rewrite counts."""
    y_ref, g_ref = fwd_bwd(fn, args)
    torch._dynamo.reset()
    counters.clear()
    y, g = fwd_bwd(fn, args, backend or ssm_compile.backend(inductor=False))
    counts = dict(counters["ssm"])
    torch._dynamo.reset()
    assert torch.allclose(y, y_ref, rtol=tol, atol=tol), counts
    for i, (a, r) in enumerate(zip(g, g_ref, strict=True)):
        assert (a is None) == (r is None), (i, counts)
        if r is not None:
            assert torch.allclose(a, r, rtol=tol, atol=tol), (i, counts, (a - r).abs().max())
    return counts


def reasons(fn, args, family):
    return [m.reason for m in explain(fn, *args).misses if m.family == family]


def scan_args(x):
    return [x["u"], x["delta"], x["A"], x["B"], x["C"]]


# ---------------------------------------------------------------------------------------------
# Family A: grad mode inside the graph
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("steps", [(0, 1, 2), (3,), (5, 6)])
def test_no_grad_steps_inside_the_loop_are_refused(steps):
    def fn(u, delta, A, B, C):
        return run_loop(*disc(u, delta, A, B), C, no_grad_steps=steps)

    args = scan_args(inputs())
    counts = assert_same(fn, args)
    assert "scan_loop" not in counts
    assert any(BOUNDARY in r for r in reasons(fn, args, "scan_loop"))


def test_scan_under_no_grad_then_used_with_grad():
    def fn(u, delta, A, B, C):
        with torch.no_grad():
            y = scan(u, delta, A, B, C)
        return y + u

    counts = assert_same(fn, scan_args(inputs()))
    assert counts.get("scan_loop") == 1  # rewritten inside the no_grad region, which is sound


def test_frozen_A_under_no_grad_is_rewritten_after_the_region():
    def fn(u, delta, A_log, B, C):
        with torch.no_grad():
            A = -torch.exp(A_log)
        return scan(u, delta, A, B, C)

    x = inputs()
    counts = assert_same(fn, [x["u"], x["delta"], torch.log(-x["A"]), x["B"], x["C"]])
    assert counts.get("scan_loop") == 1


def test_discretisation_under_no_grad_is_refused():
    def fn(u, delta, A, B, C):
        with torch.no_grad():
            dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
        dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
        return run_loop(dA, dBu, C)

    args = scan_args(inputs())
    counts = assert_same(fn, args)
    assert "scan_loop" not in counts
    assert any(BOUNDARY in r for r in reasons(fn, args, "scan_loop"))


def test_skip_and_softplus_under_no_grad_are_not_folded():
    def fn(u, dt, A, B, C, D, z, dt_bias):
        with torch.no_grad():
            delta = F.softplus(dt + dt_bias[:, None])
        y = scan(u, delta, A, B, C)
        with torch.no_grad():
            skip = u * D[:, None]
        return (y + skip) * F.silu(z)

    x = inputs()
    args = [x["u"], x["dt"], x["A"], x["B"], x["C"], x["D"], x["z"], x["dt_bias"]]
    counts = assert_same(fn, args)
    assert counts.get("scan_loop") == 1 and "delta" not in counts and "skip" not in counts
    assert any(BOUNDARY in r for r in reasons(fn, args, "delta"))
    assert any(BOUNDARY in r for r in reasons(fn, args, "skip"))


def test_gate_under_no_grad_is_not_folded():
    def fn(u, A, B, C, delta, z):
        y = scan(u, delta, A, B, C)
        with torch.no_grad():
            g = F.silu(z)
        return y * g

    x = inputs()
    args = [x["u"], x["A"], x["B"], x["C"], x["delta"], x["z"]]
    counts = assert_same(fn, args)
    assert counts.get("scan_loop") == 1 and "gate" not in counts
    assert any(BOUNDARY in r for r in reasons(fn, args, "gate"))


def test_positive_control_tail_without_boundary_still_folds():
    def fn(u, dt, A, B, C, D, z, dt_bias):
        delta = F.softplus(dt + dt_bias[:, None])
        return (scan(u, delta, A, B, C) + u * D[:, None]) * F.silu(z)

    x = inputs()
    counts = assert_same(fn, [x["u"], x["dt"], x["A"], x["B"], x["C"], x["D"], x["z"], x["dt_bias"]])
    assert all(counts.get(f) == 1 for f in ("scan_loop", "delta", "skip", "gate")), counts


def combine(left, right):
    return left[0] * right[0], right[0] * left[1] + right[1]


def test_assoc_scan_states_under_no_grad_are_refused():
    def fn(u, delta, A, B, C):
        with torch.no_grad():
            dA, dBu = disc(u, delta, A, B)
            _, hs = associative_scan(combine, (dA, dBu), dim=2, combine_mode="generic")
        return torch.einsum("bdln,bnl->bdl", hs, C)

    args = scan_args(inputs(L=4))
    counts = assert_same(fn, args)
    assert "scan_assoc" not in counts
    assert any(BOUNDARY in r for r in reasons(fn, args, "scan_assoc"))


def test_assoc_scan_positive_control():
    def fn(u, delta, A, B, C):
        _, hs = associative_scan(combine, disc(u, delta, A, B), dim=2, combine_mode="generic")
        return torch.einsum("bdln,bnl->bdl", hs, C)

    assert assert_same(fn, scan_args(inputs(L=4))).get("scan_assoc") == 1


def conv_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 8, 11, generator=g), torch.randn(8, 1, 4, generator=g), torch.randn(8, generator=g)]


def test_conv_silu_under_no_grad_is_refused():
    def fn(x, w, b):
        c = F.conv1d(x, w, b, padding=3, groups=8)[..., :11]
        with torch.no_grad():
            s = F.silu(c)
        return s + x

    counts = assert_same(fn, conv_inputs(), tol=1e-5)
    assert "conv1d" not in counts
    assert any(BOUNDARY in r for r in reasons(fn, conv_inputs(), "conv1d"))

    def control(x, w, b):
        return F.silu(F.conv1d(x, w, b, padding=3, groups=8)[..., :11]) + x

    assert assert_same(control, conv_inputs(), tol=1e-5).get("conv1d") == 1


def test_torch_func_grad_of_a_scan_is_refused():
    def fn(u, delta, A, B, C):
        return torch.func.grad(lambda d: scan(u, d, A, B, C).pow(2).sum())(delta)

    args = scan_args(inputs())
    ref = fn(*args)
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend=ssm_compile.backend(inductor=False))(*args)
    assert "scan_loop" not in counters["ssm"]
    torch._dynamo.reset()
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-10)
    assert any("torch.func" in r or BOUNDARY in r for r in reasons(fn, args, "scan_loop"))


def test_fused_level_under_enable_grad_inside_no_grad():
    torch.manual_seed(0)
    blk = MinimalMambaBlock()

    class EnableGradInside(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blk = blk

        def forward(self, x):
            with torch.enable_grad():
                return self.blk(x)

    m, x = EnableGradInside(), torch.randn(2, 5, 16)
    torch._dynamo.reset()
    with torch.no_grad():
        ref = m(x)
        out = torch.compile(m, backend=ssm_compile.backend(fuse="level2", inductor=False))(x)
    torch._dynamo.reset()
    assert out.requires_grad and ref.requires_grad
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)
    out.sum().backward()  # raised "fused_mamba_scan is forward-only" before


# Positive controls: a whole block under no_grad, or inside an enable_grad region covering it.
@pytest.mark.parametrize("wrap", ["no_grad", "enable_grad"])
def test_whole_block_inside_one_region_keeps_its_rewrites(wrap):
    torch.manual_seed(0)
    blk = MinimalMambaBlock()
    x = torch.randn(2, 5, 16)

    def fn(x):
        with (torch.no_grad() if wrap == "no_grad" else torch.enable_grad()):
            return blk(x)

    ref = fn(x)
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend=ssm_compile.backend(inductor=False))(x)
    counts = dict(counters["ssm"])
    torch._dynamo.reset()
    assert all(counts.get(f) == 1 for f in ("conv1d", "scan_loop", "delta", "skip", "gate")), counts
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)
    if wrap == "enable_grad":
        out.sum().backward()
        grads = [p.grad.clone() for p in blk.parameters()]
        blk.zero_grad()
        ref.sum().backward()
        for a, r in zip(grads, [p.grad for p in blk.parameters()], strict=True):
            assert torch.allclose(a, r, rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# bug_13: forward-mode AD
# ---------------------------------------------------------------------------------------------

def test_forward_ad_is_refused_at_compile_time_and_by_the_op():
    x = inputs()
    tangent = torch.randn_like(x["delta"])

    def run(f):
        with fwAD.dual_level():
            y = f(x["u"], fwAD.make_dual(x["delta"], tangent), x["A"], x["B"], x["C"])
            return fwAD.unpack_dual(y).tangent

    ref = run(scan)
    torch._dynamo.reset()
    counters.clear()
    out = run(torch.compile(scan, backend=ssm_compile.backend(inductor=False)))
    assert "scan_loop" not in counters["ssm"]
    torch._dynamo.reset()
    assert out is not None and torch.allclose(out, ref, rtol=1e-10, atol=1e-10)
    with fwAD.dual_level():
        report = explain(scan, x["u"], fwAD.make_dual(x["delta"], tangent), x["A"], x["B"], x["C"])
    assert any("forward-mode AD" in m.reason for m in report.misses)
    # A graph compiled without a dual level and called with one: the op says so, no silent None.
    f = torch.compile(scan, backend=ssm_compile.backend(inductor=False))
    f(*scan_args(x))
    with pytest.raises(RuntimeError, match="forward-mode AD"):
        run(f)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# bug_09: graph inputs that alias each other
# ---------------------------------------------------------------------------------------------

def test_write_through_an_aliasing_input_is_seen():
    def fn(u, delta, A, B, C, w):
        dA, dBu = disc(u, delta, A, B)
        w.mul_(2)  # writes u's memory through another argument
        return run_loop(dA, dBu, C * 1.0)

    x = inputs()
    u_e, u_c = x["u"].clone(), x["u"].clone()
    ref = fn(u_e, x["delta"], x["A"], x["B"], x["C"], u_e[:, :3])
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend=ssm_compile.backend(inductor=False))(
        u_c, x["delta"], x["A"], x["B"], x["C"], u_c[:, :3])
    torch._dynamo.reset()
    assert "scan_loop" not in counters["ssm"]
    assert torch.equal(out, ref) and torch.equal(u_c, u_e)
    u2 = x["u"].clone()
    assert any("mutated in place" in r
               for r in reasons(fn, [u2, x["delta"], x["A"], x["B"], x["C"], u2[:, :3]], "scan_loop"))


# ---------------------------------------------------------------------------------------------
# bug_14: autocast
# ---------------------------------------------------------------------------------------------

def test_scan_after_an_autocast_region_keeps_fp32():
    W = torch.randn(4, 4, generator=torch.Generator().manual_seed(5))

    def fn(u, delta, A, B, C):
        dA, dBu = disc(u, delta, A, B)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            Cp = torch.einsum("bnl,nm->bml", C, W).float()
        return run_loop(dA, dBu, Cp)

    args = scan_args(inputs(dtype=torch.float32))
    ref = fn(*args)
    torch._dynamo.reset()
    out = torch.compile(fn, backend=ssm_compile.backend(inductor=False))(*args)
    torch._dynamo.reset()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_op_is_shielded_from_ambient_autocast():
    x = inputs(dtype=torch.float32)
    args = scan_args(x)
    ref = ssm_compile.selective_scan_fn(*args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ssm_compile.selective_scan_fn(*args)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    conv = conv_inputs()
    ref = torch.ops.ssm.causal_conv1d(conv[0], conv[1][:, 0], conv[2], "silu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.ops.ssm.causal_conv1d(conv[0], conv[1][:, 0], conv[2], "silu")
    assert torch.equal(out, ref)
