"""A skip or gate that the program computes in a finer dtype than the scan's y (probe CR, run 63).

The op returns y + D·u and y·silu(z) in y's dtype. Eager sums a bf16 scan's y with D·u against an
fp32 D (or gates it by an fp32 z) in fp32, and an fp32 scan's y with an fp64 D·u in fp64. Folding
either as it stood rounded the whole sum to y's dtype: with D·u dominant, 4e4x eager's error in
bf16 and 7e4x in fp64. Now the bf16 case gives the op an fp32 copy of u (the op returns the fp32
sum), and the fp64 case is left alone with a reason.
"""
import pytest
import torch
import torch.nn.functional as F

import ssm_compile
from ssm_compile.compiler import backend

B_, D_, L_, N_ = 2, 6, 9, 4


def scan(u, delta, A, B, C):
    """A loop in u's dtype: bf16 arithmetic for bf16 inputs (A included), as a model cast whole."""
    dA = torch.exp(delta.unsqueeze(-1) * A[:, None, :])
    dBu = delta.unsqueeze(-1) * B.transpose(1, 2).unsqueeze(1) * u.unsqueeze(-1)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append((h * C[:, :, t].unsqueeze(1)).sum(-1))
    return torch.stack(ys, -1)


def skip_fp32_D(u, delta, A, B, C, D, z):
    return scan(u, delta, A, B, C) + u * D[:, None]


def skip_widened(u, delta, A, B, C, D, z):
    return scan(u, delta, A, B, C).float() + u.float() * D[:, None]


def gate_fp32_z(u, delta, A, B, C, D, z):
    return scan(u, delta, A, B, C) * F.silu(z)


def skip_fp64(u, delta, A, B, C, D, z):
    return scan(u, delta, A, B, C) + u.double() * D.double()[:, None]


def gate_fp64(u, delta, A, B, C, D, z):
    return scan(u, delta, A, B, C) * F.silu(z.double())


def inputs(scan_dtype):
    g = torch.Generator().manual_seed(3)
    # C small and D (or z) large: the tail dominates y, so a rounding of the sum to y's dtype shows.
    return dict(
        u=torch.randn(B_, D_, L_, generator=g).to(scan_dtype).requires_grad_(),
        delta=F.softplus(torch.randn(B_, D_, L_, generator=g)).to(scan_dtype).requires_grad_(),
        A=(-torch.rand(D_, N_, generator=g) - 0.5).to(scan_dtype).requires_grad_(),
        B=torch.randn(B_, N_, L_, generator=g).to(scan_dtype).requires_grad_(),
        C=(torch.randn(B_, N_, L_, generator=g) * 1e-3).to(scan_dtype).requires_grad_(),
        D=(torch.randn(D_, generator=g) * 1e3).requires_grad_(),
        z=(torch.randn(B_, D_, L_, generator=g) * 8).requires_grad_(),
    )


def fp64(args):
    return {k: v.detach().double().requires_grad_() for k, v in args.items()}


def errors(fn, args):
    """(eager's, compiled's) largest error against the fp64 evaluation of ``fn``, over the output."""
    ref = fn(**fp64(args))
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend(inductor=False))(**args)
    eager = fn(**args)
    assert out.dtype == eager.dtype
    return (eager.double() - ref).abs().max().item(), (out.double() - ref).abs().max().item()


@pytest.mark.parametrize("fn, family", [(skip_fp32_D, "skip"), (skip_widened, "skip"), (gate_fp32_z, "gate")],
                         ids=["skip", "skip-widened", "gate"])
def test_a_bf16_scans_fp32_tail_folds_with_an_fp32_y(fn, family):
    args = inputs(torch.bfloat16)
    report = ssm_compile.explain(fn, *args.values())
    (rewrite,) = [r for r in report.rewrites if r.family == family]
    assert "fp32 copy" in rewrite.decision.get("u", ""), rewrite.decision
    eager_err, err = errors(fn, args)
    # Eager's sum is fp32 and its y is tiny: a sum rounded to bf16 was ~8 off (4e4x eager's error).
    assert err <= 2 * eager_err + 1e-3, (err, eager_err)
    # Gradients: the op's fp32 y drops only its own rounding of y.
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(**args)
    ref = fn(**args)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, list(args.values()), grad, allow_unused=True)
    want = torch.autograd.grad(ref, list(args.values()), grad, allow_unused=True)
    for name, g, w in zip(args, got, want, strict=True):
        assert (g is None) == (w is None), name
        if w is None:  # z of a skip, D of a gate
            continue
        assert g.dtype == w.dtype, name
        torch.testing.assert_close(g.float(), w.float(), rtol=3e-2, atol=3e-2 * w.float().abs().max().item(),
                                   msg=name)


@pytest.mark.parametrize("fn, family, term", [(skip_fp64, "skip", "y + D·u"), (gate_fp64, "gate", "y·silu(z)")],
                         ids=["skip", "gate"])
def test_an_fp32_scans_fp64_tail_is_left_alone(fn, family, term):
    args = inputs(torch.float32)
    report = ssm_compile.explain(fn, *args.values())
    assert not [r for r in report.rewrites if r.family == family], report.format(graphs=False)
    assert any(m.family == family and f"computes {term} in torch.float64, finer than the scan's y (torch.float32)"
               in m.reason for m in report.misses), report.format(graphs=False)
    assert [r.family for r in report.rewrites].count("scan_loop") == 1
    eager_err, err = errors(fn, args)
    # The fold rounded the fp64 sum to fp32: 5e-5 off where eager is ~1e-9.
    assert err <= 2 * eager_err + 1e-8, (err, eager_err)
