"""conftest's step-at-a-time ``tl.associative_scan`` for Triton's interpreter against the
interpreter's own element-at-a-time scan: the same bits, forward and reverse, along every axis of
a 3-D tile and of a 1-D one, with the kernels' combine (``linear_combine``) and with a combine of
one operand."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from ssm_compile.kernels.triton_common import linear_combine

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the patch is to Triton's CPU interpreter, which a CUDA run does not use")


@triton.jit
def _mul_add(a, b):
    return a * b + 0.5


@triton.jit
def _scan3_kernel(a_ptr, b_ptr, out_a_ptr, out_b_ptr, X: tl.constexpr, Y: tl.constexpr, Z: tl.constexpr,
                  AXIS: tl.constexpr, REVERSE: tl.constexpr, PAIR: tl.constexpr):
    offs = (tl.arange(0, X)[:, None, None] * Y * Z + tl.arange(0, Y)[None, :, None] * Z
            + tl.arange(0, Z)[None, None, :])
    a = tl.load(a_ptr + offs)
    b = tl.load(b_ptr + offs)
    if PAIR:
        sa, sb = tl.associative_scan((a, b), AXIS, linear_combine, reverse=REVERSE)
        tl.store(out_a_ptr + offs, sa)
    else:
        sb = tl.associative_scan(b, AXIS, _mul_add, reverse=REVERSE)
    tl.store(out_b_ptr + offs, sb)


@triton.jit
def _scan1_kernel(a_ptr, b_ptr, out_a_ptr, out_b_ptr, X: tl.constexpr, REVERSE: tl.constexpr):
    offs = tl.arange(0, X)
    sa, sb = tl.associative_scan((tl.load(a_ptr + offs), tl.load(b_ptr + offs)), 0, linear_combine,
                                 reverse=REVERSE)
    tl.store(out_a_ptr + offs, sa)
    tl.store(out_b_ptr + offs, sb)


def _run(kernel, shape, **meta):
    g = torch.Generator().manual_seed(0)
    a = torch.rand(shape, generator=g) * 0.9 + 0.05
    b = torch.randn(shape, generator=g)
    out_a, out_b = torch.full_like(a, float("nan")), torch.full_like(b, float("nan"))
    sizes = dict(zip("XYZ", shape))
    kernel[(1,)](a, b, out_a, out_b, **sizes, **meta)
    return a, b, out_a, out_b


def _both(kernel, shape, monkeypatch, **meta):
    from triton.runtime import interpreter

    fast = _run(kernel, shape, **meta)
    monkeypatch.setattr(interpreter.ScanOps, "generic_scan", interpreter.ScanOps.generic_scan_by_element)
    slow = _run(kernel, shape, **meta)
    return fast, slow


def _sequential(a, b, axis, reverse):
    """h_k = a_k * h_{k-1} + b_k along ``axis`` in fp32, the combine's own order of operations."""
    a, b = np.moveaxis(a.numpy(), axis, 0), np.moveaxis(b.numpy(), axis, 0)
    if reverse:
        a, b = a[::-1], b[::-1]
    pa, pb = np.empty_like(a), np.empty_like(b)
    pa[0], pb[0] = a[0], b[0]
    for k in range(1, len(a)):
        pa[k], pb[k] = pa[k - 1] * a[k], a[k] * pb[k - 1] + b[k]
    if reverse:
        pa, pb = pa[::-1], pb[::-1]
    return torch.from_numpy(np.moveaxis(pa, 0, axis).copy()), torch.from_numpy(np.moveaxis(pb, 0, axis).copy())


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("pair", [True, False], ids=["linear_combine", "one_operand"])
def test_step_scan_matches_element_scan_bit_for_bit(axis, reverse, pair, monkeypatch):
    shape = (4, 8, 2)
    fast, slow = _both(_scan3_kernel, shape, monkeypatch, AXIS=axis, REVERSE=reverse, PAIR=pair)
    a, b = fast[0], fast[1]
    assert torch.equal(fast[3], slow[3])
    if pair:
        assert torch.equal(fast[2], slow[2])
        want_a, want_b = _sequential(a, b, axis, reverse)
        assert torch.equal(fast[2], want_a) and torch.equal(fast[3], want_b)
    assert not fast[3].isnan().any()


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_step_scan_of_one_axis(reverse, monkeypatch):
    fast, slow = _both(_scan1_kernel, (16,), monkeypatch, REVERSE=reverse)
    assert torch.equal(fast[2], slow[2]) and torch.equal(fast[3], slow[3])
    want_a, want_b = _sequential(fast[0], fast[1], 0, reverse)
    assert torch.equal(fast[2], want_a) and torch.equal(fast[3], want_b)
