"""Probe DD (run 69): casts around the tail folds in bf16 / fp16 blocks.

``y.to(u) + u * D`` casts the fp32 scan's y to u's dtype by a template tensor, the same cast as
``y.to(u.dtype)``; the tail pass followed only the latter, so the skip and the gate stayed
unfolded, and explain gave no reason."""
import torch
import torch.nn.functional as F

from ssm_compile.report import explain

from utils import TOL, assert_one_graph, rel_err, scan_inputs

BF16 = torch.bfloat16


def _scan_fp32(u, delta, A, B, C):
    """A loop in fp32 over 16-bit activations (mamba's selective_scan_ref): y is fp32."""
    u, delta, B, C = u.float(), delta.float(), B.float(), C.float()
    dA = torch.exp(delta.unsqueeze(-1) * A[:, None, :])
    dBu = delta.unsqueeze(-1) * B.transpose(1, 2).unsqueeze(1) * u.unsqueeze(-1)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append((h * C[:, :, t].unsqueeze(1)).sum(-1))
    return torch.stack(ys, -1)


def skip_gate_cast_by_template(u, delta, A, B, C, D, z):
    return (_scan_fp32(u, delta, A, B, C).to(u) + u * D[:, None]) * F.silu(z)


def test_a_cast_to_another_tensors_dtype_is_followed_to_the_skip_and_gate():
    u, delta, A, B, C = scan_inputs(dtype=BF16)
    g = torch.Generator().manual_seed(5)
    D, z = torch.randn(u.shape[1], generator=g).to(BF16), torch.randn(u.shape, generator=g).to(BF16)
    args = [t.requires_grad_() for t in (u, delta, A, B, C, D, z)]
    report = explain(skip_gate_cast_by_template, *args)
    assert_one_graph(report)
    assert report.counts["skip"] == 1 and report.counts["gate"] == 1, report.format(graphs=False)
    wide = [a.detach().double().requires_grad_() for a in args]
    ref = skip_gate_cast_by_template(*wide)
    eager = skip_gate_cast_by_template(*args)
    assert report.output.dtype == eager.dtype == BF16
    # The op computes in fp32 and rounds once: as close to fp64 as eager, to bf16's rounding.
    assert rel_err(report.output, ref) <= max(rel_err(eager, ref), TOL[BF16] / 4)
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(report.output, args, grad.to(BF16))
    want = torch.autograd.grad(ref, wide, grad)
    for name, a, c, w in zip("u delta A B C D z".split(), args, got, want):
        assert c.dtype == a.dtype, name
        assert rel_err(c, w) <= TOL[BF16], name

