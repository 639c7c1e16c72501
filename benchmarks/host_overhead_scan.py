"""Host-side cost per call of the selective-scan forward (issue 2, short-L / batch-1 gap).

    python benchmarks/host_overhead_scan.py            # CPU: kernel launches replaced by no-ops
    python benchmarks/host_overhead_scan.py --cuda     # GPU: real launches, host time per call

CPU mode measures our Python (op layer + launcher + Triton's per-launch wrappers above the
JITFunction) with ``JITFunction.run`` stubbed out, so it runs without a GPU and without the
interpreter; ``--cuda`` adds Triton's own dispatch and the driver launch. Both print median
microseconds per call of
  launcher   ``triton_fwd.selective_scan_fwd`` (what bench_scan.py times)
  op         ``torch.ops.ssm.selective_scan`` (op.py's validation + custom-op dispatch + launcher)
  triton     (--cuda only) Triton's own ``JITFunction.run`` for the output launch, replayed with
             the arguments the launcher passed: the part of "launcher" that is Triton's
for N 16 at batch 1, L = 128 (no time split), batch 1, L = 2048 (time split) and batch 8,
L = 2048; dim 1536 on CUDA. CPU mode uses dim 64: the host path does not depend on dim, but CPU
allocations of tens of MB (y at dim 1536) cost tens of µs of page mapping, which the CUDA
caching allocator does not.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, write_out  # noqa: E402

from ssm_compile.kernels.selective_scan import cpu, op  # noqa: E402
from ssm_compile.kernels.selective_scan import triton_fwd  # noqa: E402

N = 16
DIM = 1536  # main() sets 64 in CPU mode (see the docstring)


def _jit_functions():
    """Every @triton.jit kernel of triton_fwd.py (unwrapping @triton.heuristics if present)."""
    from triton.runtime.jit import JITFunction

    found = []
    for name in dir(triton_fwd):
        obj = getattr(triton_fwd, name)
        if not isinstance(obj, JITFunction):
            obj = getattr(obj, "fn", None)  # a Heuristics / Autotuner wrapper
        if isinstance(obj, JITFunction):
            found.append(obj)
    return found


def stub_launches():
    """Replace every kernel launch by a no-op (an instance attribute shadows JITFunction.run)."""
    for jf in _jit_functions():
        jf.run = lambda *args, **kwargs: None


def make_inputs(batch, L, device):
    return dict(
        u=torch.randn(batch, DIM, L, device=device),
        delta=torch.rand(batch, DIM, L, device=device),
        A=-torch.rand(DIM, N, device=device),
        B=torch.randn(batch, N, L, device=device),
        C=torch.randn(batch, N, L, device=device),
        D=torch.randn(DIM, device=device),
        z=torch.randn(batch, DIM, L, device=device),
        delta_bias=torch.randn(DIM, device=device),
    )


def per_call_us(fn, calls=200, repeats=15, sync=None):
    """Median over repeats of (wall time of `calls` back-to-back calls) / calls, in µs.

    On CUDA the clock stops before the synchronize: launches are asynchronous, so this is the
    host time to enqueue, not the GPU time (200 calls stay well below the launch-queue depth,
    where the host would start to wait for the GPU)."""
    for _ in range(20):
        fn()
    samples = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    if sync:
        sync()
    return statistics.median(samples)


def triton_run_us(launch_once, sync):
    """Host µs of JITFunction.run alone, with the arguments of the launcher's last launch."""
    jf = triton_fwd._selective_scan_fwd_kernel
    real_run = jf.run
    recorded = []

    def recording_run(*args, **kwargs):
        recorded.append((args, kwargs))
        return real_run(*args, **kwargs)

    jf.run = recording_run
    try:
        launch_once()
    finally:
        del jf.run  # back to the class's method
    args, kwargs = recorded[-1]
    return per_call_us(lambda: real_run(*args, **kwargs), sync=sync)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", action="store_true", help="real launches on the GPU")
    args = ap.parse_args()
    device = "cuda" if args.cuda else "cpu"
    global DIM
    DIM = 1536 if args.cuda else 64
    op.register()
    if not args.cuda:
        stub_launches()
        # Route the op's CPU dispatch to the Triton launcher, so that the op column measures
        # op.py's own overhead on top of the same (stubbed) launcher.
        cpu.selective_scan_fwd = triton_fwd.selective_scan_fwd
    sync = torch.cuda.synchronize if args.cuda else None
    rows = []
    for batch, L in ((1, 128), (1, 2048), (8, 2048)):
        x = make_inputs(batch, L, device)
        B4, C4 = x["B"].unsqueeze(1), x["C"].unsqueeze(1)

        def launcher():
            triton_fwd.selective_scan_fwd(x["u"], x["delta"], x["A"], B4, C4, x["D"], x["z"],
                                          x["delta_bias"], True, None, False)

        def the_op():
            torch.ops.ssm.selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"],
                                         x["z"], x["delta_bias"], True, None, False)

        cfg = triton_fwd.scan_fwd_config(batch, DIM, L, N, DIM, 132)
        rows.append([batch, DIM, L, cfg.n_segments, per_call_us(launcher, sync=sync),
                     per_call_us(the_op, sync=sync),
                     triton_run_us(launcher, sync) if args.cuda else "-"])
        print(rows[-1], flush=True)
    mode = "CUDA (real launches)" if args.cuda else "CPU (JITFunction.run stubbed)"
    write_out(f"host_overhead_scan_{device}.md", f"{mode}, µs per call\n\n" + markdown_table(
        ["batch", "dim", "L", "segments", "launcher µs", "op µs", "triton run µs"], rows))


if __name__ == "__main__":
    main()
