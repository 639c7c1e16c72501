"""Shared test helpers: the per-dtype tolerance table and the relative-error metric."""
import torch

# Relative-error tolerances (||out - ref|| / ||ref||) against an fp64 reference, per input dtype.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    # Compared on the reference's device: GPU outputs are checked against CPU fp64 references.
    out, ref = out.detach().double().to(ref.device), ref.detach().double()
    assert torch.isfinite(out).all(), "non-finite values in output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()

# Where the Triton kernels run in tests: on the GPU when there is one, else on CPU tensors under
# TRITON_INTERPRET=1 (set by conftest.py).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
