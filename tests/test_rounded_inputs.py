"""An input the program rounds, then computes with in a wider dtype, is read rounded.

FalconMamba's ``rms_forward(B)`` and Jamba's B/C layer norm (transformers 4.x slow_forward) in a
bf16 model compute ``B = (B.float() * rsqrt(...)).to(bf16)``, and the discretisation then reads
``B[:, None].float()``. The scan proofs look through casts and found the fp32 product as B: an op
reading it would drop the rounding, so the scan was refused ("it quantizes the op's input ...,
the op would read it unrounded"). The cast is the program's only use of the product inside the
scan, so the op now reads the cast itself (``fx_utils.rounded_read``): the rounded values, widened
by the op exactly as the program's ``.float()`` widens them. The result is eager's up to the
order of fp32 arithmetic.

A rounding the op would not reproduce stays refused: of a product the op computes (Δ·B), of an
input the scan also reads unrounded, of an fp64 input (the op's fp64 state depends on its
inputs' dtypes), and a Δ fold that would compute the softplus past the rounded Δ the scan reads.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._higher_order_ops.associative_scan import associative_scan

from ssm_compile.passes import scan_loop
from ssm_compile.passes.fx_utils import (READ_ROUNDED, dtype_of, is_cast, layout_source, scan_args,
                                         scan_nodes)
from ssm_compile.report import explain
from utils import compile_with_passes

b, d, n, L = 2, 4, 3, 6


def rms_forward(x, eps=1e-6):
    """FalconMamba's rms_forward: fp32 normalisation, rounded back to the input's dtype."""
    dtype = x.dtype
    x = x.to(torch.float32)
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def assoc_states(dA, dBu, dim):
    _, h = associative_scan(lambda l, r: (l[0] * r[0], r[0] * l[1] + r[1]), (dA, dBu), dim=dim,
                            combine_mode="generic")
    return h


def falcon_scan(norm_B=True, norm_C=True, form="loop"):
    """transformers 4.x FalconMamba slow_forward's scan: u (b d l) bf16, Δ (b d l) fp32, A fp32,
    B and C (b l n) bf16 rounded by rms_forward, discretised and read out in fp32."""
    def fn(u, dts, A, B, C):
        if norm_B:
            B = rms_forward(B)
        if norm_C:
            C = rms_forward(C)
        dA = torch.exp(A[None, :, None, :] * dts[:, :, :, None])
        dBu = dts[:, :, :, None] * B[:, None, :, :].float() * u[:, :, :, None].float()
        if form == "assoc":
            h = assoc_states(dA, dBu, 2)
            return (h * C[:, None, :, :].float()).sum(-1)
        h = torch.zeros(u.shape[0], A.shape[0], A.shape[1])
        ys = []
        for i in range(u.shape[2]):
            h = dA[:, :, i, :] * h + dBu[:, :, i, :]
            ys.append(torch.matmul(h, C[:, i, :].float().unsqueeze(-1))[:, :, 0])
        return torch.stack(ys, dim=-1)
    return fn


def jamba_scan(u, dts, A, B, C, wB, wC):
    """Jamba's B/C layer norm (a weight times the rounded normalisation, in bf16), then fp32."""
    B = wB * rms_forward(B)
    C = wC * rms_forward(C)
    dA = torch.exp(A[None, :, None, :] * dts[:, :, :, None])
    dBu = dts[:, :, :, None] * B[:, None, :, :].float() * u[:, :, :, None].float()
    h = torch.zeros(u.shape[0], A.shape[0], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = dA[:, :, i, :] * h + dBu[:, :, i, :]
        ys.append(torch.matmul(h, C[:, i, :].float().unsqueeze(-1))[:, :, 0])
    return torch.stack(ys, dim=-1)


def falcon_inputs(seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    args = [torch.randn(b, d, L, generator=g).bfloat16(), F.softplus(torch.randn(b, d, L, generator=g)),
            -torch.rand(d, n, generator=g) - 0.5, torch.randn(b, L, n, generator=g).bfloat16(),
            torch.randn(b, L, n, generator=g).bfloat16()]
    if requires_grad:
        args = [a.requires_grad_() for a in args]
    return args


def check_rewritten(fn, args, family="scan_loop"):
    report = explain(fn, *args)
    assert report.counts[family] == 1, str(report)
    with torch.no_grad():
        ref = fn(*args)
    # Eager's function, roundings included: only the order of the fp32 arithmetic differs. A B or
    # C read unrounded moves the result by ~1e-3 (bf16's 2^-8 relative error, summed over N).
    torch.testing.assert_close(report.output, ref, rtol=1e-5, atol=1e-5)
    return report


@pytest.mark.parametrize("form", ["loop", "assoc"])
@pytest.mark.parametrize("norm_B, norm_C", [(True, False), (False, True), (True, True)],
                         ids=["rms-B", "rms-C", "rms-B-and-C"])
def test_rms_rounded_B_and_C_are_read_rounded(norm_B, norm_C, form):
    family = "scan_loop" if form == "loop" else "scan_assoc"
    fn = falcon_scan(norm_B, norm_C, form)
    args = falcon_inputs()
    check_rewritten(fn, args, family)
    # The rounding matters at this tolerance: the same program without it is 1e-3 off.
    unrounded = falcon_scan(False, False, form)
    normed = [a.float() for a in args]
    if norm_B:
        normed[3] = rms_forward(normed[3])
    if norm_C:
        normed[4] = rms_forward(normed[4])
    assert (unrounded(*normed) - fn(*args)).abs().max() > 1e-4


def test_the_op_reads_the_rounding_cast():
    """The op's B and C are the ``.to(bf16)`` nodes (through permuted views), not the products."""
    torch._dynamo.reset()
    cap, _ = compile_with_passes(falcon_scan(), *falcon_inputs(), passes=[scan_loop])
    torch._dynamo.reset()
    (scan,) = scan_nodes(cap.gm.graph)
    args = scan_args(scan)
    for name in ("B", "C"):
        src = layout_source(args[name], allow_casts=False).base
        assert is_cast(src) and dtype_of(src) == torch.bfloat16 and dtype_of(src.args[0]) == torch.float32, \
            src.format_node()
    # The loop's readout found C's cast itself (it reads C by time slices, not through casts)
    # before this change; B's was found behind it and replaced by it, and marked so that no
    # later fold computes past it.
    assert layout_source(args["B"], allow_casts=False).base.meta.get(READ_ROUNDED)


def test_gradients_read_the_rounded_B():
    """u's and Δ's gradients are products with B: eager's use the rounded B, so must the op's."""
    fn = falcon_scan()
    args = falcon_inputs(requires_grad=True)
    # fp32 u, so that its gradient is not rounded to bf16 itself.
    args[0] = args[0].detach().float().requires_grad_()
    report = explain(fn, *args)
    assert report.counts["scan_loop"] == 1, str(report)
    ref = fn(*args)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(*args)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    go = torch.randn_like(ref)
    grads = torch.autograd.grad(out, args, go)
    refs = torch.autograd.grad(ref, args, go)
    for got, want in zip(grads[:3], refs[:3]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # B's and C's gradients reach the bf16 casts in bf16 (eager's ``.float()`` backward rounds
    # them, as the op rounds its gradient of a bf16 input): equal up to a bf16 rounding.
    for got, want in zip(grads[3:], refs[3:]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_jamba_layer_norm_still_rewritten():
    """Jamba's weight * rms(B) is a bf16 product: the op reads it, as before."""
    g = torch.Generator().manual_seed(1)
    args = falcon_inputs() + [torch.randn(n, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()]
    check_rewritten(jamba_scan, args)


def _fp32_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, d, L, generator=g), F.softplus(torch.randn(b, d, L, generator=g)),
            -torch.rand(d, n, generator=g) - 0.5, torch.randn(b, L, n, generator=g), torch.randn(b, L, n, generator=g),
            torch.randn(d, generator=g)]


def _loop(dA, dBu, C):
    h = torch.zeros(dA.shape[0], dA.shape[1], dA.shape[3], dtype=dA.dtype)
    ys = []
    for i in range(dA.shape[2]):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append((h * C[:, None, i, :]).sum(-1))
    return torch.stack(ys, -1)


def u_rounded_skip_unrounded(u, dts, A, B, C, D):
    """u quantized for the scan, the skip reads it unrounded: the scan reads the rounded u, and
    the skip, which the op would compute from that u, stays out of it."""
    uq = u.bfloat16()
    dA = torch.exp(A[None, :, None, :] * dts[..., None])
    dBu = dts[..., None] * B[:, None].float() * uq.float()[..., None]
    return _loop(dA, dBu, C) + u * D[:, None]


def delta_rounded_after_softplus(u, dts, A, B, C, D):
    """A bf16 model whose Δ is a softplus in fp32 rounded back to bf16, then widened for the
    discretisation: the scan reads the rounded Δ; the Δ fold, which would compute the softplus
    in the op past the rounding, is refused."""
    delta = F.softplus(dts.float() + D[:, None]).bfloat16()
    dA = torch.exp(A[None, :, None, :] * delta.float()[..., None])
    dBu = delta.float()[..., None] * B[:, None].float() * u.float()[..., None]
    return _loop(dA, dBu, C.float())


def test_rounded_u_is_read_rounded_and_the_unrounded_skip_stays_out():
    args = _fp32_inputs()
    report = check_rewritten(u_rounded_skip_unrounded, args)
    assert report.counts["skip"] == 0, str(report)
    assert any("rounding cast lies between the skip's u and the scan's u" in m.reason
               for m in report.misses), str(report)


def test_rounded_delta_is_read_rounded_and_not_folded_past():
    args = _fp32_inputs()
    args[0], args[3], args[4] = args[0].bfloat16(), args[3].bfloat16(), args[4].bfloat16()
    report = check_rewritten(delta_rounded_after_softplus, args)
    assert report.counts["delta"] == 0, str(report)
    assert any(m.family == "delta" and "the scan reads that rounded value as its input" in m.reason
               for m in report.misses), str(report)


def delta_and_u_one_rounded_tensor(u, dts, A, B, C, D):
    """Δ and u are the same rounded softplus: the op reads it as both, and the Δ fold would still
    compute past the rounding for Δ."""
    x = F.softplus(dts + D[:, None]).bfloat16()
    dA = torch.exp(A[None, :, None, :] * x.float()[..., None])
    dBu = x.float()[..., None] * B[:, None] * x.float()[..., None]
    return _loop(dA, dBu, C)


def test_rounded_delta_that_is_also_u_is_not_folded_past():
    report = check_rewritten(delta_and_u_one_rounded_tensor, _fp32_inputs())
    assert report.counts["delta"] == 0, str(report)
    assert any(m.family == "delta" and "the scan reads that rounded value as its input" in m.reason
               for m in report.misses), str(report)


# --- near-misses: the rounding is not one the op can read ------------------------------------

def product_rounded(u, dts, A, B, C, D):
    """Δ·B rounded to bf16 in an fp32 program: the op computes that product itself, unrounded."""
    dA = torch.exp(A[None, :, None, :] * dts[..., None])
    dB = (dts[..., None] * B[:, None]).bfloat16().float()
    return _loop(dA, dB * u[..., None], C)


def input_term_rounded(u, dts, A, B, C, D):
    """The whole Δ·B·u rounded to bf16 in an fp32 program."""
    dA = torch.exp(A[None, :, None, :] * dts[..., None])
    dBu = (dts[..., None] * B[:, None] * u[..., None]).bfloat16().float()
    return _loop(dA, dBu, C)


def delta_rounded_for_B_only(u, dts, A, B, C, D):
    """Δ rounded in Δ·B·u but not in exp(Δ·A): the op reads one Δ for both."""
    dA = torch.exp(A[None, :, None, :] * dts[..., None])
    dBu = dts.bfloat16().float()[..., None] * B[:, None] * u[..., None]
    return _loop(dA, dBu, C)


def B_rounded_and_unrounded(u, dts, A, B, C, D):
    """B rounded for the discretisation, read unrounded as the readout's C."""
    dA = torch.exp(A[None, :, None, :] * dts[..., None])
    dBu = dts[..., None] * B.bfloat16().float()[:, None] * u[..., None]
    return _loop(dA, dBu, B)


def fp64_B_rounded_to_fp32(u, dts, A, B, C, D):
    """An fp64 program rounding B to fp32: the op's fp64 state is chosen from its inputs' dtypes,
    and reading an fp32 B is left alone (kept refused, conservatively)."""
    dA = torch.exp(A[None, :, None, :] * dts[..., None])
    dBu = dts[..., None] * B.float().double()[:, None] * u[..., None]
    return _loop(dA, dBu, C)


@pytest.mark.parametrize("fn, dtype, reason", [
    (product_rounded, torch.float32, "rounds torch.float32 to torch.bfloat16"),
    (input_term_rounded, torch.float32, "rounds torch.float32 to torch.bfloat16"),
    (delta_rounded_for_B_only, torch.float32, "rounds torch.float32 to torch.bfloat16: it quantizes the op's input"),
    (B_rounded_and_unrounded, torch.float32, "rounds torch.float32 to torch.bfloat16: it quantizes the op's input"),
    (fp64_B_rounded_to_fp32, torch.float64, "rounds torch.float64 to torch.float32: it quantizes the op's input"),
], ids=["dB-rounded", "dBu-rounded", "delta-rounded-for-B-only", "B-rounded-and-unrounded", "fp64-B-to-fp32"])
def test_rounding_the_op_cannot_read_is_kept(fn, dtype, reason):
    args = [a.to(dtype) for a in _fp32_inputs()]
    report = explain(fn, *args)
    assert report.counts["scan_loop"] == 0, str(report)
    assert any(reason in m.reason for m in report.misses), [m.reason for m in report.misses]
    # Left alone, the graph runs as written.
    with torch.no_grad():
        assert torch.equal(report.output, fn(*args))
