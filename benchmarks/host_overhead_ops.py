"""Host-side cost per call of the ``ssm`` custom ops, with the kernels stubbed out (issues 2, 4, 6).

    python benchmarks/host_overhead_ops.py           # CPU: the CPU implementations stubbed
    python benchmarks/host_overhead_ops.py --cuda    # CUDA: the Triton launchers stubbed, then real

Each op's compute (the chunked PyTorch code on CPU, the Triton launcher on CUDA) is replaced by
a stub that only allocates its outputs, so what is left is exactly the op layer: validation,
the dispatcher, the autograd wrapper and the fake-free eager path. Rows, for a batch-1 tiny
shape where this overhead is the whole cost:

  fwd             the op on inputs that do not require grad (inference, decode)
  fwd (grad)      the op on inputs that require grad (builds the autograd node)
  fwd+bwd         forward and ``torch.autograd.grad`` of every differentiable input

plus eager ``F.conv1d`` + silu forward+backward at the same shape as a yardstick (not stubbed:
it is what issue 4 compares ``causal_conv1d`` with).

``--cuda`` also times the real launches (``real`` column): median host time per call of 200
back-to-back calls, clock stopped before the synchronize (what the CPU spends to enqueue), and
``sync`` with the synchronize inside the clock (bounded by the GPU when it is slower).
"""
import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, write_out  # noqa: E402

from ssm_compile.kernels.causal_conv1d import cpu as conv_cpu  # noqa: E402
from ssm_compile.kernels.causal_conv1d import op as conv_op  # noqa: E402
from ssm_compile.kernels.decode import cpu as decode_cpu  # noqa: E402
from ssm_compile.kernels.decode import op as decode_op  # noqa: E402
from ssm_compile.kernels.selective_scan import cpu as scan_cpu  # noqa: E402
from ssm_compile.kernels.selective_scan import op as scan_op  # noqa: E402
from ssm_compile.kernels.selective_scan.grads import ScanGrads  # noqa: E402

BATCH, DIM, L, N, W = 1, 64, 16, 16, 4


def _scan_fwd_stub(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, return_last_state):
    y = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    last = torch.empty(u.shape[0], u.shape[1], A.shape[1], device=u.device) if return_last_state else None
    return y, last


def _scan_bwd_stub(dy, dlast_state, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state):
    def like(t):
        return None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device)

    return ScanGrads(like(u), like(delta), like(A), like(B), like(C), like(D), like(z), like(delta_bias),
                     like(initial_state))


def _conv_fwd_stub(x, weight, bias, initial_state, silu):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _conv_bwd_stub(dy, x, weight, bias, initial_state, silu):
    absent = torch.empty(0, device=x.device)
    return conv_cpu.ConvGrads(
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        torch.empty(weight.shape, dtype=weight.dtype, device=x.device),
        absent if bias is None else torch.empty(bias.shape, dtype=bias.dtype, device=x.device),
        absent if initial_state is None else torch.empty(initial_state.shape, device=x.device),
    )


def _decode_stub(x, *args):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _conv_update_stub(x, conv_state, weight, bias, activation):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@contextlib.contextmanager
def stubbed(device: str):
    """Replace each op's compute by an allocation of its outputs (module attributes, restored after)."""
    if device == "cuda":
        from ssm_compile.kernels.causal_conv1d import triton_conv
        from ssm_compile.kernels.decode import triton_decode
        from ssm_compile.kernels.selective_scan import triton_bwd, triton_fwd

        targets = [(triton_fwd, "selective_scan_fwd", _scan_fwd_stub),
                   (triton_bwd, "selective_scan_bwd", _scan_bwd_stub),
                   (triton_conv, "causal_conv1d_fwd", _conv_fwd_stub),
                   (triton_conv, "causal_conv1d_bwd", _conv_bwd_stub),
                   (triton_decode, "selective_state_update", _decode_stub),
                   (triton_decode, "causal_conv1d_update", _conv_update_stub)]
    else:
        targets = [(scan_cpu, "selective_scan_fwd", _scan_fwd_stub),
                   (scan_cpu, "selective_scan_bwd", _scan_bwd_stub),
                   (conv_cpu, "causal_conv1d_fwd", _conv_fwd_stub),
                   (conv_cpu, "causal_conv1d_bwd", _conv_bwd_stub),
                   (decode_cpu, "selective_state_update", _decode_stub),
                   (decode_cpu, "causal_conv1d_update", _conv_update_stub)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in targets]
    try:
        for mod, name, stub in targets:
            setattr(mod, name, stub)
        yield
    finally:
        for mod, name, orig in saved:
            setattr(mod, name, orig)


def per_call_us(fn, sync, calls=200, repeats=15, sync_inside=False):
    """Median over repeats of (wall time of ``calls`` back-to-back calls) / calls, in µs."""
    for _ in range(20):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if sync_inside:
            sync()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return statistics.median(samples)


def cases(device: str):
    """(name, fn) for every op and mode; inputs made once, grads asked of every float input."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, grad=False):
        t = torch.randn(*shape, generator=g).to(device)
        return t.requires_grad_(grad)

    def scan_inputs(grad):
        return dict(u=rand(BATCH, DIM, L, grad=grad), delta=rand(BATCH, DIM, L, grad=grad),
                    A=(-rand(DIM, N).abs()).requires_grad_(grad), B=rand(BATCH, N, L, grad=grad),
                    C=rand(BATCH, N, L, grad=grad), D=rand(DIM, grad=grad), z=rand(BATCH, DIM, L, grad=grad),
                    delta_bias=rand(DIM, grad=grad))

    def conv_inputs(grad):
        return dict(x=rand(BATCH, DIM, L, grad=grad), weight=rand(DIM, W, grad=grad), bias=rand(DIM, grad=grad))

    def scan(kw):
        return torch.ops.ssm.selective_scan(kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"],
                                            kw["delta_bias"], True, None, False)[0]

    def conv(kw):
        return torch.ops.ssm.causal_conv1d(kw["x"], kw["weight"], kw["bias"], "silu", None)

    def eager_conv(kw):
        y = F.conv1d(kw["x"], kw["weight"].unsqueeze(1), kw["bias"], padding=W - 1, groups=DIM)[..., :L]
        return F.silu(y)

    def fwd_bwd(op, kw):
        y = op(kw)
        return torch.autograd.grad(y, list(kw.values()), torch.ones_like(y))

    scan_plain, scan_grad = scan_inputs(False), scan_inputs(True)
    conv_plain, conv_grad = conv_inputs(False), conv_inputs(True)
    state = rand(BATCH, DIM, N)
    x1, dt1, A1, B1, C1, D1, z1, dtb1 = (rand(BATCH, DIM), rand(BATCH, DIM), -rand(DIM, N).abs(), rand(BATCH, N),
                                         rand(BATCH, N), rand(DIM), rand(BATCH, DIM), rand(DIM))
    conv_state, w1, b1 = rand(BATCH, DIM, W - 1), rand(DIM, W), rand(DIM)
    return [
        ("selective_scan", "fwd", lambda: scan(scan_plain)),
        ("selective_scan", "fwd (grad)", lambda: scan(scan_grad)),
        ("selective_scan", "fwd+bwd", lambda: fwd_bwd(scan, scan_grad)),
        ("causal_conv1d", "fwd", lambda: conv(conv_plain)),
        ("causal_conv1d", "fwd (grad)", lambda: conv(conv_grad)),
        ("causal_conv1d", "fwd+bwd", lambda: fwd_bwd(conv, conv_grad)),
        ("eager F.conv1d + silu (yardstick, never stubbed)", "fwd+bwd", lambda: fwd_bwd(eager_conv, conv_grad)),
        ("selective_state_update", "fwd", lambda: torch.ops.ssm.selective_state_update(
            state, x1, dt1, A1, B1, C1, D1, z1, dtb1, True)),
        ("causal_conv1d_update", "fwd", lambda: torch.ops.ssm.causal_conv1d_update(
            x1, conv_state, w1, b1, "silu")),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda", action="store_true", help="run on the GPU, also timing real launches")
    parser.add_argument("--profile", action="store_true",
                        help="also write cProfile's top functions (by own time) of the real calls of each case")
    args = parser.parse_args()
    device = "cuda" if args.cuda else "cpu"
    sync = torch.cuda.synchronize if args.cuda else (lambda: None)
    scan_op.register()
    conv_op.register()
    decode_op.register()

    rows = []
    all_cases = cases(device)
    with stubbed(device):
        stub_us = [per_call_us(fn, sync) for _, _, fn in all_cases]
    for (op_name, mode, fn), stub in zip(all_cases, stub_us):
        row = [op_name, mode, stub]
        if args.cuda:
            row += [per_call_us(fn, sync), per_call_us(fn, sync, sync_inside=True)]
        rows.append(row)
    header = ["op", "mode", "stubbed µs"] + (["real µs", "real+sync µs"] if args.cuda else [])
    title = (f"Host µs per call, batch {BATCH}, dim {DIM}, L {L}, N {N}, W {W}, fp32, {device}, "
             f"torch {torch.__version__}\n\n")
    write_out(f"host_overhead_ops_{device}.md", title + markdown_table(header, rows))
    if args.profile:
        write_out(f"host_profile_ops_{device}.txt", profile_cases(all_cases, sync))


def profile_cases(all_cases, sync, calls=300, top=30):
    """cProfile of ``calls`` real calls per case: where the host time goes, by function."""
    out = []
    for op_name, mode, fn in all_cases:
        for _ in range(20):
            fn()
        sync()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        sync()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        out.append(f"### {op_name} {mode}: {calls} calls\n{text.getvalue()}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
