"""Correctness of the compiled forward kernel on a GPU at large shapes (up to L = 65536).

Run on a CUDA machine from the repo root:  python benchmarks/check_scan_gpu.py
Exits non-zero if any case fails; writes check_scan_gpu.md to $OUT when it is set.

Each case runs the kernel on the full problem, asserts y and last_state are finite everywhere,
that the peak memory of the call is linear (outputs + segment workspace),
and compares a slice of channels (all of L) with the fp64 explicit-loop reference on the CPU:
materialising (batch, dim, L, N) in fp64 for L = 65536 is out of the question, and the scan is
independent per channel, so a channel slice checks the same arithmetic the kernel did for all.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from common import markdown_table, write_out  # noqa: E402
from utils import TOL, rel_err  # noqa: E402

from ssm_compile.kernels.selective_scan.reference import selective_scan_ref  # noqa: E402
from ssm_compile.kernels.selective_scan.triton_fwd import (  # noqa: E402
    scan_fwd_config,
    selective_scan_fwd,
)

# (batch, dim, L, N, G, dtype, with initial_state, transposed storage)
CASES = [
    (1, 1536, 65536, 16, 1, torch.bfloat16, False, False),
    (2, 256, 65536, 16, 1, torch.bfloat16, True, False),
    (2, 256, 16384, 16, 1, torch.float32, True, False),
    (1, 1536, 16384, 16, 1, torch.float32, False, False),
    (8, 1536, 2048, 16, 1, torch.bfloat16, False, False),
    (1, 1536, 2048, 16, 1, torch.float32, True, False),
    (1, 1536, 128, 16, 1, torch.float16, False, False),
    (2, 512, 8192, 64, 2, torch.float16, True, False),
    (1, 256, 4096, 256, 1, torch.float32, True, False),
    (2, 256, 3001, 16, 4, torch.bfloat16, True, True),
    # dim // G = 3: one-channel programs, where time spans lanes (cross-lane scan and
    # last-state extraction) instead of living in one thread.
    (2, 24, 4097, 16, 8, torch.bfloat16, True, False),
    (1, 64, 5000, 1, 1, torch.float32, True, False),
]
SLICE = 8  # channels compared against the CPU fp64 reference (taken from the first group)


def make(batch, dim, L, N, G, dtype, with_init, transposed):
    dev = "cuda"
    x = dict(
        u=torch.randn(batch, dim, L, device=dev).to(dtype),
        delta=(torch.randn(batch, dim, L, device=dev) * 0.5 - 1.0).to(dtype),
        A=-torch.exp(torch.randn(dim, N, device=dev) * 0.5),
        B=torch.randn(batch, G, N, L, device=dev).to(dtype),
        C=torch.randn(batch, G, N, L, device=dev).to(dtype),
        D=torch.randn(dim, device=dev),
        z=torch.randn(batch, dim, L, device=dev).to(dtype),
        delta_bias=torch.randn(dim, device=dev) * 0.3,
        initial_state=torch.randn(batch, dim, N, device=dev) if with_init else None,
    )
    if transposed:
        for k in ("u", "delta", "z"):
            x[k] = x[k].transpose(0, 2).contiguous().transpose(0, 2)
        for k in ("B", "C"):
            x[k] = x[k].permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    return x


def run_case(case):
    batch, dim, L, N, G, dtype, with_init, transposed = case
    x = make(*case)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y, last = selective_scan_fwd(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                                 x["delta_bias"], True, x["initial_state"], True)
    torch.cuda.synchronize()
    # Linear memory: outputs plus at most the segment workspace (2 * 7 * batch * dim * N fp32),
    # never anything of size batch * dim * L * N.
    peak = torch.cuda.max_memory_allocated() - base
    linear = peak <= y.nbytes + last.nbytes + 2 * 7 * batch * dim * N * 4 + (1 << 20)
    finite = bool(torch.isfinite(y).all() and torch.isfinite(last).all())
    k = min(SLICE, dim // G)
    cpu = {name: (None if v is None else v.cpu()) for name, v in x.items()}
    y_ref, last_ref = selective_scan_ref(
        cpu["u"][:, :k], cpu["delta"][:, :k], cpu["A"][:k], cpu["B"][:, :1], cpu["C"][:, :1],
        cpu["D"][:k], cpu["z"][:, :k], cpu["delta_bias"][:k], True,
        None if cpu["initial_state"] is None else cpu["initial_state"][:, :k], True)
    err_y = rel_err(y[:, :k].cpu(), y_ref) if finite else float("inf")
    err_h = rel_err(last[:, :k].cpu(), last_ref) if finite else float("inf")
    ok = finite and linear and err_y < TOL[dtype] and err_h < TOL[dtype]
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = scan_fwd_config(batch, dim, L, N, dim // G, n_sms)
    return ok, finite, err_y, err_h, cfg, peak / 2**20


def main():
    rows, failed = [], 0
    for case in CASES:
        t0 = time.time()
        batch, dim, L, N, G, dtype, with_init, transposed = case
        try:
            ok, finite, err_y, err_h, cfg, peak_mb = run_case(case)
        except Exception as e:  # noqa: BLE001 - report every case, then fail at the end
            ok, finite, err_y, err_h, cfg, peak_mb = (False, False, float("nan"), float("nan"),
                                                      repr(e)[:80], float("nan"))
        failed += not ok
        rows.append([f"B{batch}-D{dim}-L{L}-N{N}-G{G}-{str(dtype)[6:]}"
                     + ("-h0" if with_init else "") + ("-T" if transposed else ""),
                     str(tuple(cfg)) if not isinstance(cfg, str) else cfg,
                     "yes" if finite else "NO", f"{err_y:.2e}", f"{err_h:.2e}",
                     f"{TOL[dtype]:.0e}", f"{peak_mb:.1f}", "ok" if ok else "FAIL",
                     f"{time.time() - t0:.1f}"])
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    write_out("check_scan_gpu.md", markdown_table(
        ["case", "config", "finite", "rel err y", "rel err last", "tol", "peak MB", "", "s"],
        rows))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
