"""sum_partials: the backward kernels' partial sums, reduced in one launch (Triton; interpreted on CPU)."""
import pytest
import torch

from ssm_compile.kernels.partials import MAX_SEGMENTS, sum_partials

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fp64_total(partial, reduce_dims):
    return partial.double().sum(tuple(range(reduce_dims)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_sums_every_segment_into_its_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    # Shapes as the scan backward makes them, ragged against their blocks (partials._blocks):
    # rows past the 64 a step takes (two steps, the second ragged), columns past a block, one
    # row, one column, and a reduction over two leading axes.
    shapes = [((3, 5, 37, 16), 2), ((13, 2, 1, 16, 300), 1), ((1, 257), 1), ((9, 1), 1), ((2, 50, 70), 2)]
    partials = [torch.randn(shape, generator=g).to(DEVICE) for shape, _ in shapes]
    jobs = [(p, r, p.shape[r:], dtype) for p, (_, r) in zip(partials, shapes)]
    outs = sum_partials(jobs)
    for out, p, (_, r) in zip(outs, partials, shapes):
        assert out.dtype == dtype and out.shape == p.shape[r:] and out.is_contiguous()
        ref = _fp64_total(p, r)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.double(), ref.to(dtype).double(), rtol=tol, atol=tol * ref.abs().max().item())


def test_reshapes_to_the_requested_shape_and_keeps_one_job():
    p = torch.randn(6, 4 * 3, device=DEVICE)
    (out,) = sum_partials([(p, 1, (4, 3), torch.float32)])
    assert out.shape == (4, 3)
    torch.testing.assert_close(out.double(), _fp64_total(p, 1).view(4, 3), rtol=1e-6, atol=1e-5)


def test_same_bits_every_run():
    p = torch.randn(40, 1000, device=DEVICE)
    first = sum_partials([(p, 1, (1000,), torch.float32)])[0]
    second = sum_partials([(p, 1, (1000,), torch.float32)])[0]
    assert torch.equal(first, second)


def test_empty_reduction_is_zero():
    (out,) = sum_partials([(torch.empty(0, 5, device=DEVICE), 1, (5,), torch.float32)])
    assert torch.equal(out, torch.zeros(5, device=DEVICE))


@pytest.mark.parametrize("jobs, match", [
    (lambda: [], "expected 1 to"),
    (lambda: [(torch.randn(2, 3, device=DEVICE), 1, (3,), torch.float32)] * (MAX_SEGMENTS + 1), "expected 1 to"),
    (lambda: [(torch.randn(2, 3, device=DEVICE).double(), 1, (3,), torch.float32)], "contiguous fp32"),
    (lambda: [(torch.randn(3, 2, device=DEVICE).t(), 1, (3,), torch.float32)], "contiguous fp32"),
    (lambda: [(torch.randn(2, 3, device=DEVICE), 1, (4,), torch.float32)], "cannot give shape"),
], ids=["none", "too-many", "fp64", "strided", "shape"])
def test_bad_input_is_refused(jobs, match):
    with pytest.raises(ValueError, match=match):
        sum_partials(jobs())
