"""Where the scan backward's ddelta differs from the CPU path when A holds -inf and dt = 0 at t = 0
(run 61): prints, per backward variant and with/without the -inf entry, the largest difference and
where it is, and any non-finite entries.

    python benchmarks/repros/inf_decay_zero_dt_bwd.py
"""
import torch

from ssm_compile.kernels.selective_scan import cpu, triton_bwd

dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(1)
b, d, L, N = 2, 4, 40, 4
u, z, dy = (torch.randn(b, d, L, generator=g) for _ in range(3))
delta = torch.randn(b, d, L, generator=g) * 0.5 - 1
A0 = -torch.rand(d, N, generator=g) - 0.2
B, C = (torch.randn(b, 1, N, L, generator=g) for _ in range(2))
D, bias = torch.randn(d, generator=g), torch.randn(d, generator=g) * 0.1
delta[:, :, 0] = -120.0
for with_inf in (False, True):
    A = A0.clone()
    if with_inf:
        A[0, 0] = -float("inf")
    args = (dy, None, u, delta, A, B, C, D, z, bias, True, None)
    want = cpu.selective_scan_bwd(*args)
    for variant in ("column", "serial", "nblock"):
        got = triton_bwd.selective_scan_bwd(*[x.to(dev) if isinstance(x, torch.Tensor) else x for x in args[:10]],
                                            True, None, tiles={"variant": variant})
        for name in ("du", "ddelta", "dA", "dB", "dC"):
            w, t = getattr(want, name), getattr(got, name).cpu()
            diff = (w - t).abs()
            i = int(diff.nan_to_num(float("inf")).argmax())
            idx = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), w.shape))
            print(f"inf={with_inf} {variant} {name}: max diff {diff.max().item():.3g} at {idx} "
                  f"(cpu {w[idx].item():.6g}, triton {t[idx].item():.6g}); non-finite triton "
                  f"{int((~t.isfinite()).sum())}, cpu {int((~w.isfinite()).sum())}")
