"""The causal conv fused into ``ssm.x_dt_proj``'s kernel, against the two kernels it replaces.

    python benchmarks/bench_conv_x_dt_proj.py [--sweep]

In a Mamba block the conv's output u is read by x_proj (and by the scan). Run apart, the conv
kernel reads x and writes u, then the x_dt_proj kernel reads u back and writes x_dbl and dt.
Fused, one kernel reads x, writes u, x_dbl and dt: one read of u and one launch fewer.

Per shape and dtype, x is HF's (the first half of a (batch, L, 2 * dim) in_proj output, seen as
(batch, dim, L)), and the GPU time (CUDA-graph replay) of
- ``split``: ``ssm::causal_conv1d``'s kernel then ``ssm::x_dt_proj``'s kernel on u,
- ``fused``: ``conv_x_dt_proj_fwd`` with the default tiles (``--sweep``: also the five fastest
  of a tile sweep at the first shape in bf16),
the fused kernel's minimal bytes (x read, u, x_dbl and dt written) as a fraction of the copy
bandwidth measured in the same run, and the largest difference of each output from split's.
Writes $OUT/bench_conv_x_dt_proj.md when OUT is set.
"""
import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, graph_ms, markdown_table, write_out  # noqa: E402

from ssm_compile.kernels.causal_conv1d import triton_conv  # noqa: E402
from ssm_compile.kernels.x_dt_proj import triton_x_dt_proj as kx  # noqa: E402

SHAPES = [(8, 2048, 1536, 48, 16), (4, 4096, 1536, 48, 16), (8, 2048, 2048, 64, 16)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make(batch, L, dim, R, N, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    xz = torch.randn(batch, L, 2 * dim, device="cuda", dtype=dtype, generator=g)
    x = xz[..., :dim].transpose(1, 2)
    cw = torch.randn(dim, 4, device="cuda", dtype=dtype, generator=g) / 2
    cb = torch.randn(dim, device="cuda", dtype=dtype, generator=g)
    wx = torch.randn(R + 2 * N, dim, device="cuda", dtype=dtype, generator=g) / dim ** 0.5
    wdt = torch.randn(dim, R, device="cuda", dtype=dtype, generator=g) / R ** 0.5
    return x, cw, cb, wx, wdt


def split(x, cw, cb, wx, wdt):
    u = triton_conv.causal_conv1d_fwd(x, cw, cb, None, True)
    return (u, *kx.x_dt_proj_fwd(u.transpose(1, 2), wx, wdt))


def sweep_tiles():
    for bm, warps, stages, conv_k, conv_bk in itertools.product((32, 64, 128), (4, 8), (2, 3), (256, 512), (64, 128, 256)):
        if bm * conv_bk <= 32 * 32 * warps * 4:  # at most 32 elements a thread per tap
            yield kx.Tiles(bm, 64, 64, warps, stages, conv_k, conv_bk)


def diffs(a, b):
    return " / ".join(f"{(p.float() - q.float()).abs().max().item():.1e}" for p, q in zip(a, b))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="sweep the fused kernel's tiles at the first shape")
    args = p.parse_args()
    copy = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows, best_rows = [], []
    for (batch, L, dim, R, N), (dname, dtype) in itertools.product(SHAPES, DTYPES.items()):
        x, cw, cb, wx, wdt = make(batch, L, dim, R, N, dtype)
        M, E, size = batch * L, R + 2 * N, dtype.itemsize
        nbytes = (3 * M * dim + M * E) * size
        gbs = lambda ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731
        ref = split(x, cw, cb, wx, wdt)
        t_split = graph_ms(lambda: split(x, cw, cb, wx, wdt))
        t_conv = graph_ms(lambda: triton_conv.causal_conv1d_fwd(x, cw, cb, None, True))
        tiles = kx.choose_conv_tiles(dtype)
        fused = lambda t: kx.conv_x_dt_proj_fwd(x, cw, cb, True, wx, wdt, t)  # noqa: E731
        t_fused = graph_ms(lambda: fused(tiles))
        rows.append([f"{batch}x{L} dim {dim} R {R}", dname, t_split, t_conv, t_fused, f"{t_split / t_fused:.2f}x",
                     f"{gbs(t_fused) / copy:.0%}", diffs(fused(tiles), ref), str(tiles)])
        print(rows[-1], flush=True)
        if args.sweep and (batch, L, dim, R, N) == SHAPES[0] and dtype == torch.bfloat16:
            results = []
            for t in sweep_tiles():
                if kx.shared_bytes(t, R, 2 * N, dtype) > torch.cuda.get_device_properties(0).shared_memory_per_block_optin:
                    continue
                try:
                    results.append((graph_ms(lambda: fused(t)), t))
                except Exception as e:  # noqa: BLE001 - out of shared memory/registers: skip that tile
                    print(f"{t}: {type(e).__name__}", flush=True)
            results.sort(key=lambda r: r[0])
            for ms, t in results[:5]:
                best_rows.append([f"{batch}x{L} dim {dim} R {R}", dname, ms, f"{t_split / ms:.2f}x",
                                  f"{gbs(ms) / copy:.0%}", diffs(fused(t), ref), str(t)])
                print(best_rows[-1], flush=True)
        del x, cw, cb, wx, wdt, ref
    text = (f"copy bandwidth {copy:.0f} GB/s; GPU ms from CUDA-graph replay; x is HF's in_proj view\n\n"
            + markdown_table(["shape", "dtype", "split ms", "of which conv", "fused ms", "split / fused",
                              "fused, of copy BW", "max |diff| u / x_dbl / dt", "tiles"], rows))
    if best_rows:
        text += "\n\nTile sweep, five fastest per shape:\n\n" + markdown_table(
            ["shape", "dtype", "ms", "split / this", "of copy BW", "max |diff| u / x_dbl / dt", "tiles"], best_rows)
    write_out("bench_conv_x_dt_proj.md", text)


if __name__ == "__main__":
    main()
