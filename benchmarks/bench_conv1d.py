"""Benchmark ``ssm::causal_conv1d`` (Triton) against F.conv1d + slice + silu, eager and inductor.

Shapes: batch 8 (and 1, to check that the grid fills the GPU), dim 1536, W=4, L in {2048, 8192},
bf16 and fp32, with bias and silu; x is contiguous (batch, dim, L), or the strided view HF Mamba
passes (the x half of the (batch, L, 2*dim) in_proj output, transposed). Predictions for our
kernels are in benchmarks/NOTES_conv1d.md. For each case it times the forward alone and
forward+backward, and reports the bandwidth achieved on the minimal bytes moved (forward: read x,
write y; backward: read x and dy, write dx; the (dim, W) parameters are negligible) as a fraction
of the copy bandwidth measured in the same run.
It also checks our output and gradients against eager before timing, so a wrong kernel cannot
post a good number.

Run on a GPU:  python benchmarks/bench_conv1d.py   (writes $OUT/bench_conv1d.md when OUT is set)
Needs torch >= 2.11, triton >= 3.6; takes about a minute on an H200.
"""
import logging
import os
import sys

import torch
import torch.nn.functional as F

from ssm_compile.kernels.causal_conv1d.op import causal_conv1d_fn, register

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import event_median_ms  # noqa: E402

DIM, WIDTH = 1536, 4
# (dtype name, batch, L, x layout)
# Nine cases keep the run (mostly inductor compiles) under two minutes.
CASES = (
    [("bf16", 8, seqlen, layout) for seqlen in (2048, 8192)
     for layout in ("contiguous", "in_proj view")]
    + [("fp32", 8, seqlen, "contiguous") for seqlen in (2048, 8192)]
    + [("fp32", 8, 2048, "in_proj view")]
    + [("bf16", 1, 2048, layout) for layout in ("contiguous", "in_proj view")]
)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Relative error allowed against eager (eager itself rounds differently in bf16).
CHECK_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}

log = logging.getLogger("ssm_compile.bench")


def eager_conv(x, weight, bias):
    seqlen = x.shape[-1]
    y = F.conv1d(x, weight.unsqueeze(1), bias, padding=WIDTH - 1, groups=x.shape[1])[..., :seqlen]
    return F.silu(y)


def ours(x, weight, bias):
    return causal_conv1d_fn(x, weight, bias, activation="silu")


def copy_bandwidth_gbs():
    """Device-to-device copy bandwidth (read + write bytes / time) on a 1 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = event_median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def check(x, weight, bias, dy):
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
    y_ours = ours(*leaves)
    g_ours = torch.autograd.grad(y_ours, leaves, dy)
    leaves32 = [t.detach().float().requires_grad_() for t in (x, weight, bias)]
    y_ref = eager_conv(*leaves32)
    g_ref = torch.autograd.grad(y_ref, leaves32, dy.float())
    errs = [rel_err(y_ours, y_ref)] + [rel_err(a, b) for a, b in zip(g_ours, g_ref)]
    return max(errs)


def make_x(dtype, batch, seqlen, layout, g):
    if layout == "in_proj view":
        # HF MambaMixer: in_proj(h).transpose(1, 2).chunk(2, dim=1)[0], strides (2*dim*L, 1, 2*dim).
        xz = torch.randn(batch, seqlen, 2 * DIM, device="cuda", dtype=dtype, generator=g)
        return xz.transpose(1, 2)[:, :DIM]
    return torch.randn(batch, DIM, seqlen, device="cuda", dtype=dtype, generator=g)


def bench_shape(dtype, batch, seqlen, layout, copy_gbs):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = make_x(dtype, batch, seqlen, layout, g)
    weight = torch.randn(DIM, WIDTH, device="cuda", dtype=dtype, generator=g) / WIDTH**0.5
    bias = torch.randn(DIM, device="cuda", dtype=dtype, generator=g)
    dy = torch.randn(x.shape, device="cuda", dtype=dtype, generator=g)
    err = check(x, weight, bias, dy)
    if not err < CHECK_TOL[dtype]:
        raise RuntimeError(
            f"ours differs from eager: rel err {err:.2e} ({dtype}, L={seqlen}, {layout})"
        )

    unit = x.numel() * x.element_size()
    minimal_bytes = {"fwd": 2 * unit, "fwd+bwd": 5 * unit}
    torch._dynamo.reset()
    impls = {
        "ssm (Triton)": ours,
        "eager conv1d+slice+silu": eager_conv,
        "inductor conv1d+slice+silu": torch.compile(eager_conv, dynamic=False),
    }
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
    rows = []
    for name, fn in impls.items():
        def fwd(fn=fn):
            with torch.no_grad():
                fn(x, weight, bias)

        def fwd_bwd(fn=fn):
            torch.autograd.grad(fn(*leaves), leaves, dy)

        for pass_name, run in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            ms = event_median_ms(run)
            gbs = minimal_bytes[pass_name] / ms / 1e6
            rows.append((pass_name, name, ms, gbs, gbs / copy_gbs))
    return err, rows


def main():
    if not torch.cuda.is_available():
        sys.exit("bench_conv1d.py needs a CUDA GPU")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    register()
    # Exact fp32 for the eager baseline's conv, so the correctness check compares like with like.
    torch.backends.cudnn.allow_tf32 = False
    copy_gbs = copy_bandwidth_gbs()
    lines = [
        f"# causal_conv1d: dim {DIM}, W={WIDTH}, bias + silu",
        "",
        f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
        f"copy bandwidth {copy_gbs:.0f} GB/s (1 GiB D2D copy, read+write).",
        "Minimal bytes: fwd = read x + write y; fwd+bwd adds read x, read dy, write dx.",
        "Cells: time in us (% of copy bandwidth on minimal bytes); speedup = eager / ours.",
        "",
        "| dtype | B | L | x layout | pass | ssm (Triton) | eager | inductor | vs eager "
        "| vs inductor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype_name, batch, seqlen, layout in CASES:
        err, rows = bench_shape(DTYPES[dtype_name], batch, seqlen, layout, copy_gbs)
        log.info("%s B=%d L=%d %s: max rel err vs eager %.2e", dtype_name, batch, seqlen, layout,
                 err)
        by = {(p, name.split()[0]): (ms, frac) for p, name, ms, _, frac in rows}
        for pass_name in ("fwd", "fwd+bwd"):
            cells = [by[(pass_name, impl)] for impl in ("ssm", "eager", "inductor")]
            ours_ms = cells[0][0]
            lines.append(
                f"| {dtype_name} | {batch} | {seqlen} | {layout} | {pass_name} | "
                + " | ".join(f"{ms * 1e3:.1f} ({100 * frac:.0f}%)" for ms, frac in cells)
                + f" | {cells[1][0] / ours_ms:.2f}x | {cells[2][0] / ours_ms:.2f}x |"
            )
    table = "\n".join(lines) + "\n"
    log.info("%s", table)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "bench_conv1d.md"), "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
