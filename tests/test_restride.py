"""restride_into: layout-changing copies of (batch, dim, L) activations (Triton; interpreted on CPU)."""
import pytest
import torch

from ssm_compile.kernels.restride import restride_into

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def channel_innermost(shape, dtype):
    batch, dim, L = shape
    return torch.empty(batch, L, dim, dtype=dtype, device=DEVICE).transpose(1, 2)


def l_major(shape, dtype):
    return torch.empty(shape, dtype=dtype, device=DEVICE)


def sliced(shape, dtype):
    # A non-dense source: every other channel of a wider tensor, as a chunk of a projection is.
    batch, dim, L = shape
    return torch.empty(batch, 2 * dim, L, dtype=dtype, device=DEVICE)[:, ::2]


@pytest.mark.parametrize("shape", [(2, 70, 130), (1, 3, 1), (3, 64, 64)], ids=["ragged", "tiny", "one-tile"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("src_layout, dst_layout", [(channel_innermost, l_major), (l_major, channel_innermost),
                                                    (sliced, channel_innermost), (l_major, l_major)],
                         ids=["ci-to-l", "l-to-ci", "sliced-to-ci", "l-to-l"])
def test_copies_every_element(shape, dtype, src_layout, dst_layout):
    src = src_layout(shape, dtype)
    src.copy_(torch.randn(shape, device=DEVICE).to(dtype))
    dst = dst_layout(shape, dtype)
    strides = dst.stride()
    out = restride_into(dst, src)
    assert out is dst and dst.stride() == strides
    assert torch.equal(dst, src)


@pytest.mark.parametrize("dst", [
    lambda: torch.empty(2, 5, 7, device=DEVICE),
    lambda: torch.empty(2, 5, 6, dtype=torch.bfloat16, device=DEVICE),
], ids=["shape", "dtype"])
def test_bad_input_names_argument(dst):
    with pytest.raises(ValueError, match="dst and src"):
        restride_into(dst(), torch.randn(2, 5, 6, device=DEVICE))
