"""Tile sweep of the causal conv's row-streaming kernels (x with unit stride along dim, HF
Mamba's in_proj view): (BLOCK_D, num_warps, seg_len) against the launcher's choice.

    python benchmarks/sweep_conv_rows.py [--batch 8] [--len 2048] [--dtype bf16] [--bwd]
                                         [--blocks 256 512] [--warps 2 4] [--segs 64 128]

GPU time per call from a CUDA graph (``common.graph_ms``), as a fraction of the copy bandwidth
on the minimal bytes (forward: read x, write y; ``--bwd``, the backward with dy in HF's layout:
read x and dy, write dx, plus the dweight/dbias partial sums), measured in the same run.
"""
import argparse
import itertools

import torch

from common import copy_bandwidth_gbs, graph_ms, markdown_table, write_out
from ssm_compile.kernels.causal_conv1d import reference, triton_conv

DIM, WIDTH = 1536, 4


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--bwd", action="store_true", help="the backward (dx, dweight, dbias) instead")
    p.add_argument("--blocks", type=int, nargs="+", default=[128, 256, 512, 1024], help="BLOCK_D values")
    p.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--segs", type=int, nargs="+", default=[32, 64, 128, 256], help="seg_len values")
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    bw = copy_bandwidth_gbs()
    g = torch.Generator(device="cuda").manual_seed(0)
    xz = torch.randn(args.batch, args.len, 2 * DIM, device="cuda", dtype=dtype, generator=g)
    x = xz.transpose(1, 2)[:, :DIM]
    w = torch.randn(DIM, WIDTH, device="cuda", generator=g) / WIDTH**0.5
    b = torch.randn(DIM, device="cuda", generator=g)
    if args.bwd:
        # dy as the scan's du reaches the conv in the model: channel-innermost.
        dy = torch.randn(args.batch, args.len, DIM, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
        leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
        out = reference.causal_conv1d_ref(*leaves, "silu", None)
        ref = torch.autograd.grad(out, leaves, dy.double())[0]
        nbytes = 3 * x.numel() * x.element_size()
        name = "_bwd_rows_tile"

        def call():
            return triton_conv.causal_conv1d_bwd(dy, x, w, b, None, True).dx
    else:
        ref = reference.causal_conv1d_ref(x.double(), w.double(), b.double(), "silu", None)
        nbytes = 2 * x.numel() * x.element_size()
        name = "_fwd_rows_tile"

        def call():
            return triton_conv.causal_conv1d_fwd(x, w, b, None, True)
    original = getattr(triton_conv, name)
    default = original(x, args.batch, DIM, args.len)
    rows = []
    for block_d, warps, seg in itertools.chain(
            [default], itertools.product(args.blocks, args.warps, args.segs)):
        if block_d * (2 if dtype == torch.bfloat16 else 4) < warps * 32 * 4:
            continue  # fewer than 4 bytes per thread
        if args.bwd and block_d > 2 * warps * 32:
            continue  # more than two channels per thread: 255 registers offline, the limit
        setattr(triton_conv, name, lambda *a, t=(block_d, warps, seg): t)
        try:
            y = call()
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            ms = graph_ms(call)
        finally:
            setattr(triton_conv, name, original)
        rows.append([block_d, warps, seg, "default" if (block_d, warps, seg) == default else "",
                     ms * 1e3, f"{100 * nbytes / (ms * 1e-3) / (bw * 1e9):.0f}%", f"{err:.1e}"])
        print(rows[-1], flush=True)
    rows.sort(key=lambda r: r[4])
    write_out(f"sweep_conv_rows_{'bwd_' if args.bwd else ''}{args.dtype}.md",
              f"B{args.batch} L{args.len} dim {DIM} W{WIDTH} {args.dtype}, copy {bw:.0f} GB/s\n\n"
              + markdown_table(["BLOCK_D", "warps", "seg_len", "", "graph us", "% copy BW", "max err"], rows))


if __name__ == "__main__":
    main()
