"""Memory layout of the (batch, dim, L) activations the ssm ops allocate.

Mamba code keeps its activations in one of two layouts. Code that projects with ``nn.Linear``
and transposes to (batch, dim, L) for the conv and the scan (HF Mamba, mamba_simple,
mamba-minimal) holds them with the channel axis innermost: (batch, L, dim) in memory. Code
written against mamba_ssm's kernels holds them with L innermost. An op output in the other
layout costs a full copy on the way to the next ``nn.Linear`` (x_proj after the conv,
out_proj after the scan), and a ``.view`` written against the caller's layout would fail. So an
op's activation output takes its main input's layout: channel-innermost in, channel-innermost
out; anything else gets the plain contiguous (batch, dim, L) layout.

The fake implementations call the same function on the same (fake) input, so the strides they
promise are the ones the kernels produce, whatever strides inductor hands the op.
"""
import torch


def dim_innermost(t: torch.Tensor) -> bool:
    """Whether a (batch, dim, L) tensor has unit stride along dim.

    A size-1 dim or L leaves the question without an answer that matters; such tensors take
    the contiguous layout.
    """
    return t.shape[1] > 1 and t.shape[2] > 1 and t.stride(1) == 1


def empty_activation(ref: torch.Tensor) -> torch.Tensor:
    """A new dense tensor of ``ref``'s (batch, dim, L) shape and dtype, in ``ref``'s layout (see above).

    Allocated with its strides rather than as a transpose: an op output that is a view counts, for
    autograd, as one of several views a function returned, and the caller's in-place write to it
    (``ys[:, 3] = 0`` on the buffer the op's y replaced) would raise.
    """
    batch, dim, seqlen = ref.shape
    if dim_innermost(ref):
        return torch.empty_strided((batch, dim, seqlen), (seqlen * dim, 1, dim), dtype=ref.dtype, device=ref.device)
    return torch.empty((batch, dim, seqlen), dtype=ref.dtype, device=ref.device)
