"""Why the dt level (W_dt @ dt_low inside the scan kernel) is slower than split: registers,
spills and time of the scan kernel alone, with and without the fused projection.

    python benchmarks/probe_dt_fusion.py

HF's layouts at the headline shape (batch 8, dim 1536, L 2048, N 16, R 48): u and z are
channels-last halves of in_proj's output, dt_low/B/C views of x_proj's. Per dtype it times
(CUDA-graph replay, median): the split scan alone on a precomputed delta, split = dt_proj
matmul + scan, and the fused launcher under a few tile variants (register cap, prefetch
depth), printing each compile's n_regs / n_spills.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import graph_ms  # noqa: E402
from ssm_compile.heuristic import compiled_stats  # noqa: E402
from ssm_compile.kernels.selective_scan.triton_fwd import scan_fwd_config, selective_scan_fwd_launch  # noqa: E402
from ssm_compile.kernels.triton_common import num_sms  # noqa: E402


def main():
    batch, dim, L, N, R = 8, 1536, 2048, 16, 48
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        xz = torch.randn(batch, L, 2 * dim, device="cuda", dtype=dtype)
        u, z = xz.transpose(1, 2).chunk(2, dim=1)
        x_dbl = torch.randn(batch, L, R + 2 * N, device="cuda", dtype=dtype)
        dt_low, B, C = (t.transpose(1, 2) for t in torch.split(x_dbl, [R, N, N], dim=-1))
        B, C = B.unsqueeze(1), C.unsqueeze(1)
        W = torch.randn(dim, R, device="cuda", dtype=dtype) / R ** 0.5
        A = -torch.rand(dim, N, device="cuda") - 0.5
        D, bias = torch.randn(dim, device="cuda"), torch.randn(dim, device="cuda") * 0.3 - 2
        delta = torch.nn.functional.linear(dt_low.transpose(1, 2), W).transpose(1, 2)
        base = scan_fwd_config(batch, dim, L, N, dim, num_sms(0), True, dtype != torch.float32)

        def scan(cfg=None, fused=False, proj=False):
            d = torch.nn.functional.linear(dt_low.transpose(1, 2), W).transpose(1, 2) if proj else delta
            return selective_scan_fwd_launch(u, dt_low if fused else d, A, B, C, D, z, bias, True, None,
                                             False, dt_weight=W if fused else None, config=cfg)

        rows = [("scan alone", lambda: scan(base), base),
                ("dt_proj + scan (split)", lambda: scan(base, proj=True), base)]
        for name, cfg in (("dt fused, default tiles", base),
                          ("dt fused, no register cap", base._replace(max_registers=None)),
                          ("dt fused, prefetch 2", base._replace(prefetch=2)),
                          ("dt fused, cap 176", base._replace(max_registers=176))):
            rows.append((name, (lambda c: lambda: scan(c, fused=True))(cfg), cfg))
        for name, fn, cfg in rows:
            ms = graph_ms(fn, calls=5)
            stats = compiled_stats(fn()[2])
            print(f"{str(dtype):15s} {name:28s} {ms:.4f} ms  regs/spills {stats}  config {tuple(cfg)}",
                  flush=True)


if __name__ == "__main__":
    main()
