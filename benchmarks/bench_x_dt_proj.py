"""x_proj + dt_proj: ``ssm.x_dt_proj``'s kernel against the two cuBLAS products it replaces.

    python benchmarks/bench_x_dt_proj.py [--sweep]

Per shape, dtype and x layout (``rows``: x is (batch, L, K) with K innermost, as HF's conv output
reaches x_proj after the layout pass; ``lmajor``: x is a transposed (batch, K, L) tensor): the
GPU time (CUDA-graph replay, no host launch cost) of
- ``eager``: ``F.linear(x, W_x)`` then ``F.linear(x_dbl[..., :R], W_dt)`` (two cuBLAS calls),
- ``inductor``: the same function under torch.compile (what the backend ran before this op),
- ``ours``: the Triton kernel with the default tiles (and, with ``--sweep``, the best of a tile
  sweep at each shape),
the bytes it must move at least (x read, x_dbl and dt written, the weights read once) as a
fraction of the device copy bandwidth measured in the same run, and the kernel's relative error
against fp64 for both outputs. Writes $OUT/bench_x_dt_proj.md when OUT is set.
"""
import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, graph_ms, markdown_table, write_out  # noqa: E402

from ssm_compile.kernels.x_dt_proj import triton_x_dt_proj as kx  # noqa: E402

# (batch, L, dim, R, N): the 130m shape (d_model 768) at the two end-to-end lengths, batch 1, and
# the 2.8b shape (d_model 2560: dim 5120, R 160).
SHAPES = [(8, 2048, 1536, 48, 16), (8, 512, 1536, 48, 16), (1, 2048, 1536, 48, 16), (8, 2048, 5120, 160, 16)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make(batch, L, dim, R, N, dtype, layout):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (batch, L, dim) if layout == "rows" else (batch, dim, L)
    x = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    x = x if layout == "rows" else x.transpose(1, 2)
    wx = torch.randn(R + 2 * N, dim, device="cuda", dtype=dtype, generator=g) / dim ** 0.5
    wdt = torch.randn(dim, R, device="cuda", dtype=dtype, generator=g) / R ** 0.5
    return x, wx, wdt


def two_linears(x, wx, wdt):
    x_dbl = F.linear(x, wx)
    return x_dbl, F.linear(x_dbl[..., :wdt.shape[1]], wdt)


def rel_errs(out, x, wx, wdt):
    xr = F.linear(x.double(), wx.double())
    dr = F.linear(xr.to(x.dtype).double()[..., :wdt.shape[1]], wdt.double())
    return [((o.double() - r).norm() / r.norm()).item() for o, r in zip(out, (xr, dr))]


def sweep_tiles():
    for bm, bk, bd, warps, stages in itertools.product((32, 64, 128), (64, 128), (64, 128, 256), (4, 8), (3, 4)):
        yield kx.Tiles(bm, bk, bd, warps, stages)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="also sweep tiles at the first shape (both dtypes, both layouts)")
    p.add_argument("--no-inductor", action="store_true")
    args = p.parse_args()
    copy = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows, best_rows = [], []
    compiled = torch.compile(two_linears)
    for (batch, L, dim, R, N), (dname, dtype), layout in itertools.product(SHAPES, DTYPES.items(), ("rows", "lmajor")):
        x, wx, wdt = make(batch, L, dim, R, N, dtype, layout)
        M, E, size = batch * L, R + 2 * N, dtype.itemsize
        nbytes = (M * dim + M * E + M * dim + E * dim + dim * R) * size
        gbs = lambda ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731
        eager = graph_ms(lambda: two_linears(x, wx, wdt))
        ind = float("nan") if args.no_inductor else graph_ms(lambda: compiled(x, wx, wdt))
        ok = kx.supported(x, wx, wdt)
        tiles = kx.choose_tiles(dtype) if ok else None
        ours = graph_ms(lambda: kx.x_dt_proj_fwd(x, wx, wdt, tiles)) if ok else float("nan")
        errs = rel_errs(kx.x_dt_proj_fwd(x, wx, wdt, tiles), x, wx, wdt) if ok else [float("nan")] * 2
        rows.append([f"{batch}x{L} dim {dim} R {R}", dname, layout, eager, ind, ours, f"{eager / ours:.2f}x",
                     f"{gbs(ours) / copy:.0%}", f"{errs[0]:.1e} / {errs[1]:.1e}", str(tiles)])
        print(rows[-1], flush=True)
        if args.sweep and ok and (batch, L, dim, R, N) == SHAPES[0]:
            results = []
            for t in sweep_tiles():
                try:
                    ms = graph_ms(lambda: kx.x_dt_proj_fwd(x, wx, wdt, t))
                except Exception as e:  # noqa: BLE001 - out of shared memory/registers: skip that tile
                    print(f"{t}: {type(e).__name__}", flush=True)
                    continue
                results.append((ms, t))
            results.sort(key=lambda r: r[0])
            for ms, t in results[:5]:
                errs = rel_errs(kx.x_dt_proj_fwd(x, wx, wdt, t), x, wx, wdt)
                best_rows.append([f"{batch}x{L} dim {dim} R {R}", dname, layout, ms, f"{gbs(ms) / copy:.0%}",
                                  f"{errs[0]:.1e} / {errs[1]:.1e}", str(t)])
                print(best_rows[-1], flush=True)
        del x, wx, wdt
    text = (f"copy bandwidth {copy:.0f} GB/s; GPU ms from CUDA-graph replay\n\n"
            + markdown_table(["shape", "dtype", "x layout", "eager ms", "inductor ms", "ours ms", "eager / ours",
                              "ours, of copy BW", "rel err x_dbl / dt", "tiles"], rows))
    if best_rows:
        text += "\n\nTile sweep, five fastest per shape:\n\n" + markdown_table(
            ["shape", "dtype", "x layout", "ms", "of copy BW", "rel err x_dbl / dt", "tiles"], best_rows)
    write_out("bench_x_dt_proj.md", text)


if __name__ == "__main__":
    main()
