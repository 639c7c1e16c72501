"""Selective-scan backward on the GPU: our Triton kernels against eager, inductor and mamba_ssm.

Run on the H200: ``python benchmarks/bench_scan_bwd.py`` (under 90 s: the backward-only table,
the per-kernel split and our fwd+bwd); ``--sweep`` adds the tile sweep (~3-5 min, 23
candidates; ``--sweep-match nblock`` keeps only the H17 "nblock" ones, ~1.5 min) and
``--baselines`` the eager/inductor fwd+bwd baselines (~3 min). Prints markdown tables and
writes ``$OUT/bench_scan_bwd.md`` when OUT is set. Each baseline runs inside its own
try block, so one that fails (or is missing on this torch) leaves a note, not a crash.

Tables:
1. backward only (our launcher called directly, after one forward), against the mamba_ssm
   CUDA backward anchors, with the fraction of device copy bandwidth achieved on the minimal
   bytes (read u, delta, z, B, C, dy; write du, ddelta, dz, dB, dC);
2. the per-kernel split at the main shape (fp32 and bf16);
3. with ``--sweep``: a tile sweep at the main shape, to pick the launcher defaults;
4. forward+backward through ``torch.ops.ssm.selective_scan`` with peak memory, beside eager
   autograd (reference-style PyTorch that materialises (batch, dim, L, N)), inductor on the
   unrolled loop and inductor on ``associative_scan``; the last two only at small L.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth_gbs, event_median_ms, graph_ms, markdown_table, median_ms, peak_mib, write_out  # noqa: E402

from ssm_compile.kernels.selective_scan.triton_bwd import choose_tiles, selective_scan_bwd  # noqa: E402

DIM, N = 1536, 16
SHAPES = [(8, 2048), (8, 8192), (1, 2048)]  # (batch, L)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# mamba_ssm selective_scan_cuda backward on the H200, z + softplus (ms).
MAMBA_BWD_MS = {
    ("fp32", 8, 2048): 2.11, ("fp32", 8, 8192): 8.34, ("fp32", 1, 2048): 0.375,
    ("bf16", 8, 2048): 1.82, ("bf16", 8, 8192): 7.12, ("bf16", 1, 2048): 0.322,
}
# The unrolled loop compiles one graph node per step, and associative_scan's backward is
# O(L^2): both are capped at a small L where they still compile in under a minute.
LOOP_L = 128
# associative_scan's backward builds an (L, L) transition matrix per (batch, dim, N) element:
# 13 GB per copy at batch 8, L=128 in fp32, 51 GB at L=256 (where it may run out of memory;
# the table then carries a note, which is the measurement).
ASSOC_LS = (128, 256)
# Later sections are skipped (with a note) past these marks (seconds from the start; the
# default run, without --sweep or --baselines, ends well before either).
SWEEP_BUDGET_S = 330
TIME_BUDGET_S = 480


def make_inputs(batch, L, dtype, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, dt=dtype, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale + shift).to(dt)

    x = dict(
        u=rand(batch, DIM, L),
        delta=rand(batch, DIM, L, scale=0.5, shift=-1.0),
        # S4D-real initialisation, as Mamba uses.
        A=-torch.arange(1, N + 1, device="cuda", dtype=torch.float32).repeat(DIM, 1),
        B=rand(batch, N, L),
        C=rand(batch, N, L),
        D=rand(DIM, dt=torch.float32),
        z=rand(batch, DIM, L),
        delta_bias=rand(DIM, dt=torch.float32, scale=0.1, shift=-3.0),
    )
    if requires_grad:
        for t in x.values():
            t.requires_grad_()
    return x, rand(batch, DIM, L)


def minimal_bytes(batch, L, dtype):
    elt = torch.finfo(dtype).bits // 8
    # 4 reads + 3 writes of (batch, dim, L); B, C read and dB, dC written.
    return elt * (7 * batch * DIM * L + 4 * batch * N * L)


def bwd_call(x, dy, **tiles):
    B4, C4 = x["B"].unsqueeze(1), x["C"].unsqueeze(1)
    return lambda: selective_scan_bwd(
        dy, None, x["u"], x["delta"], x["A"], B4, C4, x["D"], x["z"], x["delta_bias"], True, None,
        tiles=tiles or None,
    )


# --- baselines ----------------------------------------------------------------------------

def scan_eager(u, delta, A, B, C, D, z, delta_bias):
    """mamba_ssm ``selective_scan_ref`` style: (batch, dim, L, N) tensors and a Python loop."""
    dtype_in = u.dtype
    u, delta, B, C, z = (t.float() for t in (u, delta, B, C, z))
    delta = F.softplus(delta + delta_bias[:, None])
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    x = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    y = torch.stack(ys, dim=2) + u * D[:, None]
    return (y * F.silu(z)).to(dtype_in)


def scan_assoc(u, delta, A, B, C, D, z, delta_bias):
    from torch._higher_order_ops.associative_scan import associative_scan

    dtype_in = u.dtype
    u, delta, B, C, z = (t.float() for t in (u, delta, B, C, z))
    delta = F.softplus(delta + delta_bias[:, None])
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)

    def combine(left, right):
        # (a1, b1) then (a2, b2): h -> a2 * (a1 * h + b1) + b2.
        return left[0] * right[0], right[0] * left[1] + right[1]

    _, h = associative_scan(combine, (deltaA, deltaB_u), dim=2, combine_mode="pointwise")
    y = torch.einsum("bdln,bnl->bdl", h, C) + u * D[:, None]
    return (y * F.silu(z)).to(dtype_in)


def scan_ours(u, delta, A, B, C, D, z, delta_bias):
    y, _ = torch.ops.ssm.selective_scan(u, delta, A, B, C, D, z, delta_bias, True, None, False)
    return y


def fwd_bwd(fn, x, dy):
    def step():
        for t in x.values():
            t.grad = None
        fn(**x).backward(dy)
    return step


# --- tables -------------------------------------------------------------------------------

def backward_table(copy_gbs, notes):
    rows = []
    for dname, dtype in DTYPES.items():
        for batch, L in SHAPES:
            try:
                x, dy = make_inputs(batch, L, dtype)
                ms = median_ms(bwd_call(x, dy))
                # GPU time alone: at batch 1 the host's launch path may be what ms measures.
                gms = graph_ms(bwd_call(x, dy))
                mem = peak_mib(bwd_call(x, dy))
                anchor = MAMBA_BWD_MS[(dname, batch, L)]
                target = anchor / 1.5 if batch > 1 else anchor
                frac = minimal_bytes(batch, L, dtype) / (ms * 1e-3) / 1e9 / copy_gbs
                rows.append([dname, batch, L, ms, gms, anchor, anchor / ms, "yes" if ms <= target else "NO",
                             100 * frac, mem])
                del x, dy
            except Exception as e:  # noqa: BLE001 - keep the other shapes
                notes.append(f"backward {dname} B{batch} L{L}: {type(e).__name__}: {e}")
    header = ["dtype", "batch", "L", "ours bwd ms", "graph ms", "mamba_ssm ms", "speedup", "target met",
              "% copy BW (min bytes)", "peak MiB"]
    return markdown_table(header, rows)


# Candidates for the launcher defaults (see benchmarks/NOTES_scan_bwd.md, "H12"). Chunk-kernel
# registers and SASS instructions per (d, t, n) element in its n-loop, sm_90 / triton 3.6:
SWEEP = [
    dict(chunk=128, block_d=1, num_warps=1),  # the default: 122 regs, 56 instr/elt, no barrier
    dict(chunk=64, block_d=16, num_warps=4),  # H3's tiles: 247 regs, 73 instr/elt, 42 BAR/iter
    dict(chunk=64, block_d=2, num_warps=1),  # 168 regs, 75 instr/elt
    dict(chunk=32, block_d=4, num_warps=1),  # 168 regs, 70 instr/elt
    dict(chunk=64, block_d=4, num_warps=2),  # 199 regs, 94 instr/elt
    dict(chunk=256, block_d=1, num_warps=2),  # 250 regs, 100 instr/elt (rows cross warps)
    # 186 regs, 97 instr/elt, 46 BAR/iter, but half the dB/dC read-modify-write traffic per
    # element: if it comes close to the default, that traffic (L2) is what limits the default.
    dict(chunk=128, block_d=2, num_warps=2),
    dict(chunk=128, block_d=1, num_warps=1, num_splits=8),  # half the default's programs
    dict(chunk=128, block_d=1, num_warps=1, num_splits=34),  # twice the default's programs
    # 2176 programs for 2112 one-warp slots (16 per SM): if a second wave of 64 programs costs a
    # whole program's time, 16 slices (2048 programs, one wave) is much faster than the default.
    dict(chunk=128, block_d=1, num_warps=1, num_splits=16),
    # H17, variant "nblock" (NOTES "H17"): state columns in blocks of nb outside the channel loop,
    # dB/dC summed over channels in registers, no read-modify-write per (channel, column).
    # Instructions per (d, t, n) averaged over a channel's 16 columns (the default: 64.6):
    dict(variant="nblock", nb=4),  # 254 regs (8 warps/SM), 60.7/elt; 33 slices, group_d 8
    dict(variant="nblock", nb=4, group_d=4),
    dict(variant="nblock", nb=4, group_d=16),
    dict(variant="nblock", nb=4, group_d=64),  # ~the whole slice per pass: L2 working set 3x larger
    dict(variant="nblock", nb=4, num_splits=8),  # 1024 programs, one wave
    dict(variant="nblock", nb=4, num_splits=64),
    # Run 15: the default prefetches the next channel's rows into L1 (prefetch=1); Nsight
    # Compute had 23 % of the kernel's stall samples on the first uses of those loads.
    dict(variant="nblock", nb=4, prefetch=0),
    dict(variant="nblock", nb=4, prefetch=2),  # into L2 only
    dict(variant="nblock", nb=2),  # 191 regs (10 warps/SM), 79/elt, 8 blocks
    dict(variant="nblock", nb=8, chunk=64, num_warps=1),  # 252 regs, 74/elt, 2 blocks
    dict(variant="nblock", nb=8, num_warps=2),  # 255 regs (24 B stack), 77/elt, cross-warp sums
    dict(variant="nblock", nb=16, num_warps=4),  # 255 regs, 168 B spilled, 93/elt, one block
    # Variant "serial" (NOTES "Serial"): the forward kernel's tiles, time inside each thread, a
    # forward walk to the sub-chunk entry states and a backward walk; 8 steps, chunks of 64.
    # Run 23: 2 warps (16 channels a block) 1.915 ms fp32, 4 warps 2.371, 8 warps 5.886, one
    # block per program. Now a program walks the blocks of its slice of channels, adding dB/dC
    # into the slice's partial: the slices (num_splits; 1536 channels = 192 blocks of 8 at one
    # warp, 96 of 16 at two) trade the partials' traffic against fewer, longer programs.
    dict(variant="serial", num_warps=1),
    dict(variant="serial", num_warps=1, num_splits=192),
    dict(variant="serial", num_warps=1, num_splits=64),
    dict(variant="serial", num_warps=1, num_splits=32),
    dict(variant="serial", num_warps=1, num_splits=8),
    dict(variant="serial", num_warps=2),
    dict(variant="serial", num_warps=2, num_splits=96),
    dict(variant="serial", num_warps=2, num_splits=32),
    dict(variant="serial", num_warps=2, num_splits=16),
]
# bf16 re-times this many of the fastest fp32 candidates.
SWEEP_BF16_TOP = 4


def max_rel_diff(grads, ref):
    """Largest relative difference over all gradients: a candidate that is fast but wrong on the
    GPU (a race the CPU interpreter cannot show) must not win the sweep."""
    worst = 0.0
    for field in ref._fields:
        a, b = getattr(grads, field), getattr(ref, field)
        if b is not None:
            worst = max(worst, ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item())
    return worst


def sweep_table(notes, start, match=None, batch=8):
    rows, fp32_ms = [], []
    x, dy = make_inputs(batch, 2048, torch.float32)
    default = choose_tiles(batch, DIM, 2048, N, 1, x["u"].device)
    ref = bwd_call(x, dy)()
    rows.append(["fp32", f"default {tuple(default)}", median_ms(bwd_call(x, dy)), "0"])
    for cfg in SWEEP:
        if match and match not in str(cfg):
            continue
        if time.time() - start > SWEEP_BUDGET_S:
            notes.append("tile sweep cut short by the time budget")
            break
        try:
            diff = max_rel_diff(bwd_call(x, dy, **cfg)(), ref)
            ms = median_ms(bwd_call(x, dy, **cfg))
            rows.append(["fp32", str(cfg), ms, f"{diff:.1e}"])
            if diff < 1e-4:
                fp32_ms.append((ms, cfg))
            else:
                notes.append(f"sweep fp32 {cfg}: gradients differ from the default's by {diff:.1e}; not ranked")
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
            notes.append(f"sweep fp32 {cfg}: {type(e).__name__}: {e}")
    del x, dy, ref
    # bf16 moves half the bytes but runs the same fp32 arithmetic: re-time only the leaders.
    x, dy = make_inputs(batch, 2048, torch.bfloat16)
    ref = bwd_call(x, dy)()
    for _, cfg in sorted(fp32_ms, key=lambda r: r[0])[:SWEEP_BF16_TOP]:
        if time.time() - start > SWEEP_BUDGET_S:
            notes.append("bf16 tile sweep cut short by the time budget")
            break
        try:
            diff = max_rel_diff(bwd_call(x, dy, **cfg)(), ref)
            rows.append(["bf16", str(cfg), median_ms(bwd_call(x, dy, **cfg)), f"{diff:.1e}"])
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
            notes.append(f"sweep bf16 {cfg}: {type(e).__name__}: {e}")
    del x, dy, ref
    ranked = [cfg for _, cfg in sorted(fp32_ms, key=lambda r: r[0])]
    table = markdown_table(["dtype", "tiles (chunk, block_d, num_splits, warps, "
                            "variant, nb, group_d)", f"bwd ms B{batch} L2048", "max rel diff vs default"], rows)
    return table, ranked


def channel_innermost(t):
    """The same values with channels innermost in memory ((batch, L, dim) storage), the layout
    HF-style code (nn.Linear outputs transposed) hands the op."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


# The default ("serial", staged from 16 cells on; run 23), the chunk kernel it replaced, and
# "serial" on one and two warps. (Run 23's "serial" with stage=False on channel-innermost rows:
# 2.465 against 1.984 ms staged, bf16 batch 8 L=2048; within 0.01 ms below 16 cells.)
LAYOUT_CANDIDATES = [{}, dict(variant="nblock"), dict(variant="serial", num_warps=1),
                     dict(variant="serial", num_warps=2)]
# Training shapes of the 130m model (batch 8; L=128 is the host-bound case) and batch 1.
LAYOUT_SHAPES = ((8, 2048), (1, 2048), (8, 128), (1, 512))


def layouts_table(notes):
    """Backward time with L-major and channel-innermost activations, per chunk-kernel variant.

    "nblock"/"column" always stage L-major copies of channel-innermost u, delta, z and dy (and
    copy the gradients back); "serial" can also load [steps, channels] tiles of either layout
    as they are (stage=False). This table says where skipping the copies pays for the slower
    loads, at training shapes.
    """
    rows = []
    for batch, L in LAYOUT_SHAPES:
        for dname in ("bf16", "fp32"):
            x, dy = make_inputs(batch, L, DTYPES[dname])
            ref = bwd_call(x, dy)()
            for layout in ("L-major", "channel-innermost"):
                xs, dys = x, dy
                if layout != "L-major":
                    xs = dict(x, **{k: channel_innermost(x[k]) for k in ("u", "delta", "z")})
                    dys = channel_innermost(dy)
                for cfg in LAYOUT_CANDIDATES:
                    try:
                        diff = max_rel_diff(bwd_call(xs, dys, **cfg)(), ref)
                        rows.append([f"B{batch} L{L}", dname, layout, str(cfg or "default"),
                                     median_ms(bwd_call(xs, dys, **cfg)), graph_ms(bwd_call(xs, dys, **cfg)),
                                     f"{diff:.1e}"])
                    except Exception as e:  # noqa: BLE001 - one failing candidate must not stop the table
                        notes.append(f"layouts {batch} {L} {dname} {layout} {cfg}: {type(e).__name__}: {e}")
            del x, dy, ref
            torch.cuda.empty_cache()
    return markdown_table(["shape", "dtype", "activation layout", "tiles", "bwd ms", "graph ms", "max rel diff"], rows)


def caps_table(notes, caps):
    """The backward with the default tiles, the serial chunk kernel compiled under each register
    cap (``Tiles.max_registers``; 0 = none) at 8 and 4 steps a thread: fewer registers let more
    one-warp programs share an SM (255 -> 8, 200 -> 10, 168 -> 12 warps) at the cost of spills.
    L-major activations, GPU time from CUDA-graph replay, and the chunk kernel's share."""
    rows = []
    for batch, L in ((8, 2048), (1, 2048)):
        for dname in ("fp32", "bf16"):
            x, dy = make_inputs(batch, L, DTYPES[dname])
            ref = bwd_call(x, dy)()
            for steps in (8, 4) if batch > 1 else (8,):
                for cap in caps:
                    try:
                        ms, chunk_ms, diff, _, _ = tiles_timing(x, dy, ref, variant="serial", steps=steps,
                                                             max_registers=cap or None)
                        rows.append([f"B{batch} L{L}", dname, steps, cap or "-", ms, f"{chunk_ms:.3f}", f"{diff:.1e}"])
                        print(rows[-1], flush=True)
                    except Exception as e:  # noqa: BLE001 - one failing cap must not stop the table
                        notes.append(f"caps {batch} {L} {dname} steps {steps} cap {cap}: {type(e).__name__}: {e}")
            del x, dy, ref
            torch.cuda.empty_cache()
    return markdown_table(["shape", "dtype", "steps", "maxnreg", "bwd graph ms", "chunk kernel ms",
                           "max rel diff"], rows)


def fwd_bwd_table(notes, start, baselines):
    rows = []
    try:
        from ssm_compile.kernels.selective_scan import op

        op.register()
    except Exception as e:  # noqa: BLE001 - the op layer may not exist yet
        notes.append(f"torch.ops.ssm.selective_scan unavailable: {type(e).__name__}: {e}")
        return "(no fwd+bwd table)"
    plan = [("ours", scan_ours, b, L, dn) for dn in DTYPES for b, L in SHAPES]
    if baselines:
        plan += [("eager", scan_eager, b, L, dn) for dn in DTYPES for b, L in SHAPES if L <= 2048]
        assoc = torch.compile(scan_assoc)
        for L in ASSOC_LS:
            plan += [("ours", scan_ours, 8, L, "fp32"), ("eager", scan_eager, 8, L, "fp32"),
                     ("inductor assoc_scan", assoc, 8, L, "fp32")]
        # Last: the unrolled loop is the slowest to compile.
        plan += [("inductor loop", torch.compile(scan_eager), 8, LOOP_L, "fp32")]
    for name, fn, batch, L, dname in plan:
        if time.time() - start > TIME_BUDGET_S:
            notes.append(f"skipped {name} B{batch} L{L} {dname}: time budget")
            continue
        try:
            x, dy = make_inputs(batch, L, DTYPES[dname], requires_grad=True)
            step = fwd_bwd(fn, x, dy)
            t0 = time.time()
            step()  # compile / warm-up
            first_s = time.time() - t0
            ms = median_ms(step) if name == "ours" else event_median_ms(step, warmup=1, iters=3)
            rows.append([name, dname, batch, L, ms, peak_mib(step), first_s])
            del x, dy, step
        except Exception as e:  # noqa: BLE001 - a failing baseline must not stop the others
            notes.append(f"fwd+bwd {name} B{batch} L{L} {dname}: {type(e).__name__}: {str(e)[:300]}")
        torch.cuda.empty_cache()
    return markdown_table(["impl", "dtype", "batch", "L", "fwd+bwd ms", "peak MiB", "first call s"], rows)


def kernel_ms(call) -> dict[str, float]:
    """GPU ms per call of ``call`` (a backward) by kernel name, from the profiler (5 calls)."""
    from torch.profiler import ProfilerActivity, profile

    call()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / 5 / 1000 for e in prof.key_averages()}


def tiles_timing(x, dy, ref, **tiles):
    """(GPU ms from CUDA-graph replay, the chunk kernel's ms from the profiler, the largest
    relative difference from ``ref``'s grads, the grads, every kernel's ms by name) of the
    backward under ``tiles``."""
    call = bwd_call(x, dy, **tiles)
    grads = call()
    kernels = kernel_ms(call)
    chunk_ms = sum(ms for name, ms in kernels.items() if "chunk_bwd" in name)
    return graph_ms(call), chunk_ms, max_rel_diff(grads, ref), grads, kernels


def kernel_split(notes, dname="fp32", tiles=None, batch=8, L=2048):
    """Per-kernel CUDA time of one backward (which of the kernels dominates)."""
    try:
        x, dy = make_inputs(batch, L, DTYPES[dname])
        rows = [[name[:60], ms] for name, ms in kernel_ms(bwd_call(x, dy, **(tiles or {}))).items()]
        rows.sort(key=lambda r: -r[1])
        label = f"kernel (B{batch} L{L} {dname}{', ' + str(tiles) if tiles else ''})"
        return markdown_table([label, "ms per backward"], rows[:6])
    except Exception as e:  # noqa: BLE001 - the profiler is a diagnostic only
        notes.append(f"profiler: {type(e).__name__}: {e}")
        return "(no kernel split)"


def main():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="also time the tile sweep (~3-5 min)")
    p.add_argument("--sweep-match", default=None,
                   help="only sweep candidates whose dict contains this text, e.g. nblock")
    p.add_argument("--baselines", action="store_true",
                   help="also time eager and inductor fwd+bwd (~3 min, mostly compiling)")
    p.add_argument("--sweep-batch", type=int, default=8, help="batch of the sweep's shape (L=2048)")
    p.add_argument("--layouts", action="store_true",
                   help="only the activation-layout table (L-major against channel-innermost, ~1 min)")
    p.add_argument("--caps", type=int, nargs="*", default=None,
                   help="only the register-cap table of the default tiles: these maxnreg values "
                        "(0: none), with steps 8 and 4")
    args = p.parse_args()
    start = time.time()
    notes = []
    copy_gbs = copy_bandwidth_gbs()
    props = torch.cuda.get_device_properties(0)
    parts = []

    def emit(*texts):
        # Print each table as soon as it exists, so a run cut short still reports.
        for text in texts:
            print(text, flush=True)
            parts.append(text)

    emit(f"# selective-scan backward ({props.name}, torch {torch.__version__}, "
         f"triton {__import__('triton').__version__})",
         f"dim {DIM}, N {N}, z + delta_bias + softplus + D. Device copy bandwidth: {copy_gbs:.0f} GB/s.")
    if args.caps is not None:
        emit("## Register caps of the serial chunk kernel", caps_table(notes, args.caps or [0, 200, 168]))
        if notes:
            emit("## Notes", "\n".join(f"- {n}" for n in notes))
        write_out("bench_scan_bwd_caps.md", "\n\n".join(parts))
        return
    if args.layouts:
        emit("## Activation layouts", layouts_table(notes))
        if notes:
            emit("## Notes", "\n".join(f"- {n}" for n in notes))
        write_out("bench_scan_bwd_layouts.md", "\n\n".join(parts))
        return
    emit("## Backward only", backward_table(copy_gbs, notes))
    emit("## Per-kernel split", kernel_split(notes, "fp32"), kernel_split(notes, "bf16"),
         kernel_split(notes, "fp32", batch=1), kernel_split(notes, "bf16", batch=1))
    if args.sweep:
        table, ranked = sweep_table(notes, start, args.sweep_match, args.sweep_batch)
        emit("## Tile sweep", table)
        if ranked:
            emit("Per-kernel split of the fastest fp32 candidate:",
                 kernel_split(notes, "fp32", ranked[0], batch=args.sweep_batch))
        for variant in ("nblock", "serial"):
            best = [cfg for cfg in ranked if cfg.get("variant") == variant]
            if best and best[0] is not ranked[0]:
                emit(f"Per-kernel split of the fastest {variant} candidate:",
                     kernel_split(notes, "fp32", best[0], batch=args.sweep_batch))
    emit("## Forward + backward (op level)",
         f"inductor loop capped at L={LOOP_L}, inductor associative_scan at L in {ASSOC_LS}; eager at L <= 2048"
         + ("." if args.baselines else " (baselines not run: pass --baselines)."),
         fwd_bwd_table(notes, start, args.baselines), f"Total benchmark time {time.time() - start:.0f} s.")
    if notes:
        emit("## Notes", "\n".join(f"- {n}" for n in notes))
    write_out("bench_scan_bwd.md", "\n\n".join(parts))


if __name__ == "__main__":
    main()
