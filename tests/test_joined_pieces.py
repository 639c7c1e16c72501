"""Two spellings of a loop's pieces that hid a rewrite (probe CT, run 64).

- A bare ``squeeze()`` on the readout (zeta / kyegomez style, ``(H @ C.unsqueeze(-1)).squeeze()``)
  where only the product's last axis has size 1 is ``squeeze(-1)``; the skip ``y + D*u`` after it was
  neither folded nor named. ``name_squeezed_axes`` names the axis; with two size-1 axes (batch 1) the
  squeeze is left as written.
- A loop over chunks that stacks each chunk's outputs and joins the chunks with ``cat`` along the
  stacked axis computes one stack of every step's output; the scan was left alone ("stack collects
  only the first 4 of the recurrence's 11 per-step outputs"). ``join_stacked_cats`` writes it as that
  stack, but only where the stacks are read by the cat alone and run in its grad mode.
"""
import pytest
import torch
import torch.nn.functional as F

import ssm_compile
from torch._dynamo.utils import counters
from utils import check_explained_against_fp64


def discretize(u, delta, A, B):
    return torch.exp(delta.unsqueeze(-1) * A), (delta * u).unsqueeze(-1) * B.unsqueeze(2)


def inputs(batch=2, length=11, dim=6, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, length, dim, generator=g), F.softplus(torch.randn(batch, length, dim, generator=g)),
            -torch.rand(dim, n, generator=g) - 0.3, torch.randn(batch, length, n, generator=g),
            torch.randn(batch, length, n, generator=g), torch.randn(dim, generator=g)]


def squeeze_then_skip(u, delta, A, B, C, D):
    dA, dBu = discretize(u, delta, A, B)
    h = torch.zeros_like(dA[:, 0])
    hs = []
    for t in range(u.shape[1]):
        h = dA[:, t] * h + dBu[:, t]
        hs.append(h)
    y = (torch.stack(hs, 1) @ C.unsqueeze(-1)).squeeze()
    return y + D * u


def squeezed_step_readouts(u, delta, A, B, C, D):
    dA, dBu = discretize(u, delta, A, B)
    h = torch.zeros_like(dA[:, 0])
    ys = []
    for t in range(u.shape[1]):
        h = dA[:, t] * h + dBu[:, t]
        ys.append((h @ C[:, t, :, None]).squeeze())  # (b, d, 1) -> (b, d)
    return torch.stack(ys, 1) + u * D


def chunk_stacks(u, delta, A, B, C, chunk=4, first_without_grad=False):
    """The scan over chunks of time (11 steps: 4, 4 and a ragged 3), the state carried across,
    each chunk's outputs stacked along time; with ``first_without_grad`` the first chunk's stack
    runs under ``no_grad``, outside the cat's grad mode (its output holds no history)."""
    dA, dBu = discretize(u, delta, A, B)
    h = torch.zeros_like(dA[:, 0])
    outs = []
    for c0 in range(0, u.shape[1], chunk):
        ys = []
        for t in range(c0, min(c0 + chunk, u.shape[1])):
            h = dA[:, t] * h + dBu[:, t]
            ys.append((h * C[:, t, None, :]).sum(-1))
        with torch.set_grad_enabled(torch.is_grad_enabled() and not (first_without_grad and c0 == 0)):
            outs.append(torch.stack(ys, dim=1))
    return outs


def chunked(u, delta, A, B, C, D):
    return torch.cat(chunk_stacks(u, delta, A, B, C), dim=1) + u * D


def chunked_negative_axis(u, delta, A, B, C, D, chunk=5):
    dA, dBu = discretize(u, delta, A, B)
    h = torch.zeros_like(dA[:, 0])
    outs = []
    for c0 in range(0, u.shape[1], chunk):
        ys = [((h := dA[:, t] * h + dBu[:, t]) @ C[:, t, :, None])[..., 0] for t in range(c0, min(c0 + chunk, u.shape[1]))]
        outs.append(torch.stack(ys, -2))  # (b, steps, d): axis -2 of the stack, -2 of the cat
    return torch.cat(outs, -2) + u * D


def chunked_first_without_grad(u, delta, A, B, C, D):
    return torch.cat(chunk_stacks(u, delta, A, B, C, first_without_grad=True), 1) + u * D


def chunked_with_a_stack_returned(u, delta, A, B, C, D):
    outs = chunk_stacks(u, delta, A, B, C)
    return torch.cat(outs, 1) + u * D, outs[0]


def families(report):
    return sorted(r.family for r in report.rewrites)


@pytest.mark.parametrize("fn, expected", [
    (squeeze_then_skip, ["discretization", "readout", "scan_loop", "skip"]),
    (squeezed_step_readouts, ["discretization", "readout", "scan_loop", "skip"]),
], ids=["stacked-then-skip", "per-step"])
def test_a_bare_squeeze_with_one_unit_axis_is_rewritten(fn, expected):
    args = [a.requires_grad_() for a in inputs()]
    report = ssm_compile.explain(fn, *args)
    assert families(report) == expected, report.format(graphs=False)
    check_explained_against_fp64(report, fn, args)


def test_a_bare_squeeze_with_two_unit_axes_folds_the_skip_that_broadcasts_them_back():
    # Batch 1: squeeze() drops the batch axis too, so y is (L, d) and the skip broadcasts it back
    # against (1, L, d): y + D·u in y's own shape, which the op computes (zeta's readout, probe CY
    # F5; left as written before run 68).
    args = [a.requires_grad_() for a in inputs(batch=1)]
    report = ssm_compile.explain(squeeze_then_skip, *args)
    assert families(report) == ["discretization", "readout", "scan_loop", "skip"], report.format(graphs=False)
    check_explained_against_fp64(report, squeeze_then_skip, args)


def test_a_bare_squeeze_under_dynamic_shapes():
    # Symbolic batch, length and channels are known not to be 1, so the product's last axis is
    # still the only size-1 axis.
    compiled = torch.compile(squeeze_then_skip, backend="ssm", dynamic=True)
    for length in (11, 7):
        a = inputs(length=length, seed=length)
        torch.testing.assert_close(compiled(*a), squeeze_then_skip(*a), rtol=1e-5, atol=1e-5)
    assert counters["ssm"]["skip"] >= 1 and counters["ssm"]["scan_loop"] >= 1, dict(counters["ssm"])


@pytest.mark.parametrize("fn", [chunked, chunked_negative_axis], ids=["stack-1", "stack-minus-3"])
def test_chunks_stacked_then_joined_by_cat_are_one_scan(fn):
    args = [a.requires_grad_() for a in inputs()]
    report = ssm_compile.explain(fn, *args)
    assert families(report).count("scan_loop") == 1 and "readout" in families(report), report.format(graphs=False)
    check_explained_against_fp64(report, fn, args)


@pytest.mark.parametrize("fn", [chunked_first_without_grad, chunked_with_a_stack_returned],
                         ids=["stack-under-no-grad", "stack-returned"])
def test_stacks_the_cat_does_not_own_are_not_joined(fn):
    # Not joined: the scan is rewritten step by step (each y_t the op's y at t, run 65), and the
    # user's stacks and cat stay as written, the no_grad one included.
    args = [a.requires_grad_() for a in inputs()]
    report = ssm_compile.explain(fn, *args)
    collectors = [r.decision["collector"] for r in report.rewrites if r.family == "scan_loop"]
    assert collectors == ["per-step"], report.format(graphs=False)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(*args)
    ref = fn(*args)
    outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
    for o, r in zip(outs, refs, strict=True):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    grads = [torch.randn_like(r) for r in refs]
    got = torch.autograd.grad(outs, args, grads)
    want = torch.autograd.grad(refs, args, grads)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# Writes between the first stack and the cat (probe CU): the joined stack would read the items
# where the cat runs, after the write, where eager's first stack copied them before it.
def setitem_between(x, y):
    h = x * 2
    a = torch.stack([h, y], 1)
    h[0] = 5.0
    return torch.cat([a, torch.stack([h, y], 1)], 1)


def state_view_updated_in_place(x, W):
    H = torch.zeros(x.shape[0], 2, 4)
    h = H[:, 0]
    parts = []
    for lo, hi in ((0, 2), (2, 4)):
        ys = []
        for t in range(lo, hi):
            h.mul_(0.5).add_(x[:, t] @ W)
            ys.append(h)
        parts.append(torch.stack(ys, 1))
    return torch.cat(parts, 1)


def callers_state_copied_into(x, a, state):
    parts = []
    for lo, hi in ((0, 3), (3, 6)):
        ys = []
        for t in range(lo, hi):
            state.copy_(a * state + x[:, t])
            ys.append(state)
        parts.append(torch.stack(ys, 1))
    return torch.cat(parts, 1)


@pytest.mark.parametrize("fn, shapes, grad", [
    (setitem_between, [(2, 3), (2, 3)], True),
    (state_view_updated_in_place, [(2, 4, 4), (4, 4)], True),
    (callers_state_copied_into, [(2, 6, 4), (4,), (2, 4)], False),
], ids=["setitem", "view-state-in-place", "callers-state-copy_"])
def test_stacks_with_a_write_before_the_cat_are_not_joined(fn, shapes, grad):
    g = torch.Generator().manual_seed(7)
    args = [torch.randn(*s, generator=g) for s in shapes]
    eager_args = [a.clone().requires_grad_(grad) for a in args]
    compiled_args = [a.clone().requires_grad_(grad) for a in args]
    ref = fn(*eager_args)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ssm")(*compiled_args)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(compiled_args, eager_args, strict=True):  # the caller's state as eager left it
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-6, atol=1e-6)
    if grad:
        dy = torch.randn_like(ref)
        for got, want in zip(torch.autograd.grad(out, compiled_args, dy), torch.autograd.grad(ref, eager_args, dy),
                             strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def nested_cats_then_scan(u, delta, A, B, C, D):
    # The inner cat becomes a stack that the outer cat joins in turn; the scan after it must keep
    # its rewrite (the second join raised KeyError, and the graph lost every rewrite).
    pieces = torch.cat([torch.cat([torch.stack([u, delta], 1), torch.stack([delta, u], 1)], 1),
                        torch.stack([u, u], 1)], 1)
    return chunked(u, delta, A, B, C, D) + pieces.sum(1)


def test_nested_cats_of_stacks_are_joined_in_turn():
    args = [a.requires_grad_() for a in inputs()]
    report = ssm_compile.explain(nested_cats_then_scan, *args)
    assert not [m for m in report.misses if "raised" in m.reason], report.format(graphs=False)
    assert "scan_loop" in families(report), report.format(graphs=False)
    check_explained_against_fp64(report, nested_cats_then_scan, args)
