"""Shared test helpers: the per-dtype tolerance table and the relative-error metric."""
import torch

# Relative-error tolerances (||out - ref|| / ||ref||) against an fp64 reference, per input dtype.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values in output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
