"""vmap levels, buffers written under grad, and torch's scan HOP (adversarial probe, run 37).

Found by the probe and fixed:
- A real scan outside a ``torch.vmap`` whose skip and gate run inside it: the tail folds took the
  batched values of the vmap level (``_add_batch_dim`` outputs) as the scan op's D and z, an op
  emitted outside the level. Only the layout pass's fake run caught it, by failing, which dropped
  every rewrite of the graph. ``ContextRegions`` now keeps vmap levels apart: a rewrite may read
  or replace a node inside a level only together with the whole level (as ``scan_assoc`` does
  with an inlined ``associative_scan`` combine), else it is a near-miss with a reason, and the
  rest of the graph is still rewritten.
- ``cache.copy_(h_last)`` into a graph input under grad mode: dynamo's example value of the
  buffer carries the write's history, and the layout pass re-ran the graph on a fresh *leaf*
  that requires grad, where the ``copy_`` raises; every rewrite was dropped. A fresh input now
  keeps the example's leafness.
- torch's ``scan`` higher-order op left no reason in ``explain``.

Every case checks the outputs (and, where there is a parameter, the gradients) against eager.
"""
import pytest
import torch
import torch.nn.functional as F

import ssm_compile

VMAP_REASON = "inside a vmap level"


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _scan(u, delta, A, B, C):
    # A selective scan in the (batch, dim, L) style of selective_scan_ref.
    b, d, L = u.shape
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    h = torch.zeros(b, d, A.shape[1], dtype=u.dtype)
    ys = []
    for t in range(L):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, 2), h


def _inputs(b=2, d=6, n=4, L=7, dtype=torch.float64):
    g = _gen()

    def r(*s):
        return torch.randn(*s, generator=g, dtype=dtype)

    u, delta = r(b, d, L), F.softplus(r(b, d, L))
    A = -(torch.rand(d, n, generator=g, dtype=dtype) + 0.5)
    return u, delta, A, r(b, n, L), r(b, n, L)


def _reasons(report, family=None):
    return [m.reason for m in report.misses if family is None or m.family == family]


def test_tail_inside_a_vmap_level_is_refused_and_the_scan_outside_still_rewritten():
    u, delta, A, B, C = _inputs()
    g = _gen(1)
    D, z = torch.randn(3, 6, generator=g, dtype=u.dtype), torch.randn(3, 2, 6, 7, generator=g, dtype=u.dtype)

    def f(u, delta, A, B, C, D, z):
        y = _scan(u, delta, A, B, C)[0]
        return torch.vmap(lambda y, u, D, z: (y + u * D[:, None]) * F.silu(z), in_dims=(None, None, 0, 0))(y, u, D, z)

    report = ssm_compile.explain(f, u, delta, A, B, C, D, z)
    assert report.counts["scan_loop"] == 1, report.format(graphs=False)
    assert any(VMAP_REASON in r for r in _reasons(report, "skip")), report.format(graphs=False)
    assert report.counts["skip"] == 0 and report.counts["gate"] == 0
    torch.testing.assert_close(report.output, f(u, delta, A, B, C, D, z), rtol=1e-12, atol=1e-12)


def test_scan_inside_vmap_over_directions_is_refused_with_a_reason_and_matches_eager():
    # VMamba-style: K directions of one scan, vmapped; the scan's nodes hold batched values.
    u, delta, A, B, C = _inputs()
    K = 3
    us, deltas = torch.stack([u, u.flip(-1), u * 0.5]), torch.stack([delta] * K)
    Bs, Cs = torch.stack([B] * K), torch.stack([C, C.flip(-1), C])
    A = A.clone().requires_grad_()

    def f(us, deltas, A, Bs, Cs):
        return torch.vmap(lambda u, dl, B, C: _scan(u, dl, A, B, C)[0])(us, deltas, Bs, Cs)

    report = ssm_compile.explain(f, us, deltas, A, Bs, Cs)
    assert sum(report.counts.values()) == 0
    assert any(VMAP_REASON in r for r in _reasons(report)), report.format(graphs=False)
    assert not any("raised" in r for r in _reasons(report)), report.format(graphs=False)
    want = f(us, deltas, A, Bs, Cs)
    torch.testing.assert_close(report.output, want)
    (grad_want,) = torch.autograd.grad(want.square().sum(), A)
    (grad_got,) = torch.autograd.grad(report.output.square().sum(), A)
    torch.testing.assert_close(grad_got, grad_want)


def test_vmapped_causal_conv_is_refused_not_crashed():
    g = _gen(2)
    x, w, bias = torch.randn(3, 2, 6, 9, generator=g), torch.randn(3, 6, 1, 4, generator=g), torch.randn(3, 6, generator=g)

    def conv(x, w, bias):
        return F.silu(F.conv1d(x, w, bias, padding=3, groups=6)[..., :9])

    def f(x, w, bias):
        return torch.vmap(conv)(x, w, bias)

    report = ssm_compile.explain(f, x, w, bias)
    assert report.counts["conv1d"] == 0
    assert any(VMAP_REASON in r for r in _reasons(report, "conv1d")), report.format(graphs=False)
    torch.testing.assert_close(report.output, f(x, w, bias))


@pytest.mark.parametrize("grad_mode", [False, True])
def test_state_copied_into_a_buffer_under_grad_mode_keeps_the_rewrite(grad_mode):
    u, delta, A, B, C = _inputs(dtype=torch.float32)
    W = torch.randn(6, 6, generator=_gen(3))

    def f(u, delta, A, B, C, W, cache):
        y, h = _scan(torch.tanh(u + W[:, :1]), delta, A, B, C)
        cache.copy_(h)  # a recurrent cache written in place, as HF's cache_params does
        return y

    W_eager, W_comp = W.clone().requires_grad_(grad_mode), W.clone().requires_grad_(grad_mode)
    cache_eager, cache_comp = torch.zeros(2, 6, 4), torch.zeros(2, 6, 4)
    with torch.set_grad_enabled(grad_mode):
        y_eager = f(u, delta, A, B, C, W_eager, cache_eager)
        report = ssm_compile.explain(f, u, delta, A, B, C, W_comp, cache_comp)
    assert report.counts["scan_loop"] == 1, report.format(graphs=False)
    y_comp = report.output
    torch.testing.assert_close(y_comp, y_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache_comp, cache_eager, rtol=1e-5, atol=1e-5)
    if grad_mode:
        (y_eager.square().sum() + cache_eager.sum()).backward()
        (y_comp.square().sum() + cache_comp.sum()).backward()
        torch.testing.assert_close(W_comp.grad, W_eager.grad, rtol=1e-4, atol=1e-5)


def test_torch_scan_higher_order_op_is_reported():
    from torch._higher_order_ops.scan import scan as scan_hop
    u, delta, A, B, C = _inputs()

    def f(u, delta, A, B, C):
        dA = torch.exp(torch.einsum("bdl,dn->lbdn", delta, A))
        dBu = torch.einsum("bdl,bnl,bdl->lbdn", delta, B, u)

        def step(h, xs):
            a, bu, c = xs
            h = a * h + bu
            return h, torch.einsum("bdn,bn->bd", h, c)

        h0 = torch.zeros(u.shape[0], u.shape[1], A.shape[1], dtype=u.dtype)
        h_last, ys = scan_hop(step, h0, (dA, dBu, C.permute(2, 0, 1)))
        return ys.permute(1, 2, 0), h_last

    report = ssm_compile.explain(f, u, delta, A, B, C)
    assert any("scan higher-order op" in r for r in _reasons(report, "scan_assoc")), report.format(graphs=False)
    for got, want in zip(report.output, f(u, delta, A, B, C)):
        torch.testing.assert_close(got, want)
