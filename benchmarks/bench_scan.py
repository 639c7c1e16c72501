"""Issue 2 benchmark: the fused selective-scan forward vs baselines and the roofline floor.

Run on a CUDA machine from the repo root:  python benchmarks/bench_scan.py [--sweep]
Writes bench_scan.md (and bench_scan_sweep_<layout>.md with --sweep) to $OUT when it is set.

Setup: batch 8, dim 1536, N 16, L in {1024 .. 16384}, plus batch 1 at L in {128, 2048, 16384};
fp32 and bf16; with z, D, delta_bias and softplus. Columns:
  ours        median ms (CUDA events, triton.testing.do_bench) of the launcher; with an empty
              GPU queue this includes the host-side launch cost
  graph       the same call captured GRAPH_CALLS times in one torch.cuda.CUDAGraph, replayed:
              ms per call of GPU time alone (no host launch cost; the inputs stay in L2 between
              the captured calls when they fit, so short-L rows are slightly optimistic)
  op          median ms of torch.ops.ssm.selective_scan (op.py validation + custom-op dispatch
              on top of the launcher)
  naive       a PyTorch loop over L (short L only)
  assoc       torch.compile of torch._higher_order_ops.associative_scan over the materialised
              (batch, dim, L, N) tensors (skipped when that needs > ~40 GB, or when the time
              budget for compiles is spent)
  floor       max(minimal bytes / measured copy BW, B*D*L*N exps / (SMs * 16/clk * clock))
  %floor      floor / ours;  %floor graph: floor / graph
  peak MB     torch.cuda.max_memory_allocated() above the inputs during our call, beside the
              output bytes (linear memory: the two should be of the same size)
  mamba_ssm   the issue's anchor figures for the CUDA kernel on an H200
--sweep additionally times a grid of tile configs on the main shapes (for tuning the heuristic).
"""
import argparse
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, markdown_table, median_ms, sm_clock_ghz, write_out  # noqa: E402
from common import graph_ms as common_graph_ms  # noqa: E402

from ssm_compile.kernels.selective_scan import op as scan_op  # noqa: E402
from ssm_compile.kernels.selective_scan.triton_fwd import (  # noqa: E402
    ScanFwdConfig,
    scan_fwd_config,
    selective_scan_fwd,
)

DIM, N = 1536, 16
SHAPES = [(8, L) for L in (1024, 2048, 4096, 8192, 16384)] + [(1, L) for L in (128, 2048, 16384)]
# mamba_ssm selective_scan_fwd on an H200, ms, (fp32, bf16), from the issue.
MAMBA = {(8, 1024): (0.450, 0.231), (8, 2048): (0.887, 0.463), (8, 4096): (1.766, 0.896),
         (8, 8192): (3.738, 1.889), (8, 16384): (7.58, 4.33), (1, 2048): (0.146, 0.076),
         (1, 128): (0.033, 0.032)}
NAIVE_MAX_L = 2048
ASSOC_MAX_BYTES = 40e9
ASSOC_BUDGET_S = 150  # compiles of the associative_scan baseline are slow; cap their total
SWEEP_BUDGET_S = 360  # the lead's GPU commands are limited to 10 minutes, main table included
GRAPH_CALLS = 10  # calls per captured graph: one replay's launch cost is spread over them


def make_inputs(batch, L, dtype):
    dev = "cuda"
    return dict(
        u=torch.randn(batch, DIM, L, device=dev, dtype=dtype),
        delta=(torch.randn(batch, DIM, L, device=dev) * 0.5 - 1.0).to(dtype),
        A=-torch.exp(torch.randn(DIM, N, device=dev) * 0.5),
        B=torch.randn(batch, 1, N, L, device=dev, dtype=dtype),
        C=torch.randn(batch, 1, N, L, device=dev, dtype=dtype),
        D=torch.randn(DIM, device=dev),
        z=torch.randn(batch, DIM, L, device=dev, dtype=dtype),
        delta_bias=torch.randn(DIM, device=dev) * 0.3,
    )


def hf_layout(x):
    """The same inputs as nn.Linear-based Mamba code holds them (HF Mamba, mamba_simple): u and
    delta channel-innermost ((batch, L, dim) in memory), z the second half of a (batch, L,
    2 * dim) in_proj output, B and C views of x_proj's (batch, L, dt_rank + 2N) output; y then
    comes out channel-innermost too (kernels/layout.py)."""
    batch, dim, L = x["u"].shape
    n, rank = x["B"].shape[2], -(-dim // 32)  # dt_rank = ceil(d_model / 16), d_model = dim / 2
    xz = torch.cat([x["u"], x["z"]], dim=1).transpose(1, 2).contiguous().transpose(1, 2)
    x_dbl = torch.cat([x["B"].new_zeros(batch, 1, rank, L), x["B"], x["C"]], dim=2)[:, 0].transpose(1, 2).contiguous()
    return dict(x, u=x["u"].transpose(1, 2).contiguous().transpose(1, 2),
                delta=x["delta"].transpose(1, 2).contiguous().transpose(1, 2), z=xz[:, dim:],
                B=x_dbl[..., rank:rank + n].transpose(1, 2)[:, None],
                C=x_dbl[..., rank + n:].transpose(1, 2)[:, None])


def ours(x, config=None):
    return selective_scan_fwd(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                              x["delta_bias"], True, None, False, config=config)[0]


def through_op(x):
    return torch.ops.ssm.selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"],
                                        x["z"], x["delta_bias"], True, None, False)[0]


def graph_ms(fn, x):
    """GPU time per call of fn(x), from GRAPH_CALLS calls replayed in one CUDA graph."""
    return common_graph_ms(lambda: fn(x), GRAPH_CALLS)


def naive(x):
    u, z = x["u"].float(), x["z"].float()
    dt = F.softplus(x["delta"].float() + x["delta_bias"][:, None])
    B, C = x["B"][:, 0].float(), x["C"][:, 0].float()
    h = u.new_zeros(u.shape[0], DIM, N)
    ys = []
    for t in range(u.shape[-1]):
        bu = (dt[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        h = torch.exp(dt[:, :, t, None] * x["A"]) * h + bu
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1) + x["D"][:, None] * u
    return (y * F.silu(z)).to(x["u"].dtype)


def _assoc_fn(u, delta, A, B, C, D, z, delta_bias):
    from torch._higher_order_ops.associative_scan import associative_scan

    dt = F.softplus(delta.float() + delta_bias[:, None])
    a = torch.exp(dt[..., None] * A[:, None, :])  # (batch, dim, L, N)
    b = (dt * u.float())[..., None] * B[:, 0].float().transpose(1, 2)[:, None]

    def combine(x, y):
        return x[0] * y[0], y[0] * x[1] + y[1]

    _, h = associative_scan(combine, (a, b), dim=2, combine_mode="pointwise")
    y = (h * C[:, 0].float().transpose(1, 2)[:, None]).sum(-1) + D[:, None] * u.float()
    return (y * F.silu(z.float())).to(u.dtype)


_assoc_compiled = None


def assoc(x):
    global _assoc_compiled
    if _assoc_compiled is None:
        # One static compile per shape; lift dynamo's recompile cap (renamed across versions)
        # so that later shapes do not silently fall back to eager.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        _assoc_compiled = torch.compile(_assoc_fn, dynamic=False)
    return _assoc_compiled(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                           x["delta_bias"])


def floor_ms(batch, L, elt, bw_gbs, n_sms, clock_ghz):
    nbytes = 4 * batch * DIM * L * elt + 2 * batch * N * L * elt
    exps = batch * DIM * L * N
    return max(nbytes / (bw_gbs * 1e9), exps / (n_sms * 16 * clock_ghz * 1e9)) * 1e3


def try_time(fn, *args, **kw):
    try:
        return median_ms(lambda: fn(*args), **kw)
    except Exception:  # noqa: BLE001 - one broken baseline must not stop the benchmark
        traceback.print_exc()
        return "error"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tile configs")
    ap.add_argument("--sweep-named", action="store_true",
                    help="time only the named candidate tiles of the sweep (a one-minute run)")
    ap.add_argument("--sweep-case", default=None,
                    help="only this sweep case, as dtype:batch:L (e.g. bf16:8:2048)")
    ap.add_argument("--no-table", action="store_true", help="skip the main table (sweep only)")
    ap.add_argument("--layout", choices=("dense", "hf"), default="dense",
                    help="hf: channel-innermost u/delta/z/y as nn.Linear-based Mamba code has them; "
                         "the naive and associative_scan baselines are then skipped")
    args = ap.parse_args()
    start = time.time()
    props = torch.cuda.get_device_properties(0)
    n_sms = props.multi_processor_count
    clock = sm_clock_ghz()
    bw = copy_bandwidth_gbs()
    print(f"{props.name}: {n_sms} SMs, SM clock {clock:.2f} GHz (nvidia-smi max, 1.98 if "
          f"unknown), copy BW {bw:.0f} GB/s (read+write)", flush=True)

    scan_op.register()
    header = ["dtype", "batch", "L", "config", "ours ms", "graph ms", "op ms", "naive ms",
              "assoc ms", "floor ms", "%floor", "%floor graph", "peak MB", "y MB",
              "mamba_ssm ms", "vs mamba"]
    rows = []
    assoc_spent = 0.0
    for dtype in () if args.no_table else (torch.float32, torch.bfloat16):
        elt = torch.finfo(dtype).bits // 8
        for batch, L in SHAPES:
            x = make_inputs(batch, L, dtype)
            if args.layout == "hf":
                x = hf_layout(x)
            cfg = scan_fwd_config(batch, DIM, L, N, DIM, n_sms, args.layout == "hf", elt == 2)
            cfg_s = (f"d{cfg.block_d}/t{cfg.chunk_t}/ln{cfg.lanes_n}/w{cfg.num_warps}"
                     f"/s{cfg.n_segments}/r{cfg.max_registers or '-'}/p{cfg.prefetch}")
            t_ours = try_time(ours, x)
            try:
                t_graph = graph_ms(ours, x)
            except Exception:  # noqa: BLE001 - report the row without the graph timing
                traceback.print_exc()
                t_graph = "error"
            t_op = try_time(through_op, x)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                ours(x)
                torch.cuda.synchronize()
                peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
            except Exception:  # noqa: BLE001
                peak_mb = "error"
            y_mb = batch * DIM * L * elt / 2**20
            t_naive = (try_time(naive, x, warmup_ms=1, rep_ms=1) if L <= NAIVE_MAX_L and args.layout == "dense"
                       else "skip (long L)" if args.layout == "dense" else "skip (layout)")
            assoc_bytes = 5 * batch * DIM * L * N * 4
            if args.layout != "dense":
                t_assoc = "skip (layout)"
            elif assoc_bytes > ASSOC_MAX_BYTES:
                t_assoc = f"skip ({assoc_bytes / 1e9:.0f} GB)"
            elif assoc_spent > ASSOC_BUDGET_S:
                t_assoc = "skip (compile budget)"
            else:
                t0 = time.time()
                t_assoc = try_time(assoc, x)
                assoc_spent += time.time() - t0
                torch.cuda.empty_cache()
            fl = floor_ms(batch, L, elt, bw, n_sms, clock)
            frac = f"{100 * fl / t_ours:.0f}%" if isinstance(t_ours, float) else "-"
            frac_graph = f"{100 * fl / t_graph:.0f}%" if isinstance(t_graph, float) else "-"
            m = MAMBA.get((batch, L))
            m_ms = m[0 if dtype == torch.float32 else 1] if m else "-"
            vs = f"{m_ms / t_ours:.2f}x" if m and isinstance(t_ours, float) else "-"
            dname = "fp32" if dtype == torch.float32 else "bf16"
            rows.append([dname, batch, L, cfg_s, t_ours, t_graph, t_op, t_naive, t_assoc, fl,
                         frac, frac_graph, peak_mb, y_mb, m_ms, vs])
            print(rows[-1], f"[{time.time() - start:.0f}s]", flush=True)
            del x
            torch.cuda.empty_cache()
    text = (f"GPU {props.name}, {n_sms} SMs, clock {clock:.2f} GHz, copy BW {bw:.0f} GB/s\n\n"
            + markdown_table(header, rows))
    if rows:
        write_out("bench_scan.md" if args.layout == "dense" else f"bench_scan_{args.layout}.md", text)
    if args.sweep or args.sweep_named:
        sweep(n_sms, bw, clock, named_only=args.sweep_named, layout=args.layout, only=args.sweep_case)
    print(f"total {time.time() - start:.0f}s")


def named_candidates(default, segs):
    """The candidates of NOTES_scan_fwd.md ("Issue 2, fp32 regression"), always listed; a
    candidate equal to the launcher's default keeps the name "default"."""
    named = {default: "default"}
    for cfg, name in [(ScanFwdConfig(32, 16, 4, 4, segs, None, 1), "t16 uncapped (run 3)"),
                      (ScanFwdConfig(32, 8, 4, 4, segs, None, 1), "t8 (model 1)"),
                      (ScanFwdConfig(32, 16, 4, 4, segs, 128, 1), "t16 cap 128 (model 2)"),
                      (ScanFwdConfig(32, 16, 4, 4, segs, 168, 1), "t16 cap 168, prefetch 1 (run 4 default)"),
                      (ScanFwdConfig(32, 16, 4, 4, segs, 168, 2), "t16 cap 168, prefetch 2"),
                      # Two channels per thread: one B/C tile (read from shared memory by every
                      # thread) serves both, 24 instead of 40 shared loads per 64 elements.
                      (ScanFwdConfig(64, 8, 4, 4, segs, 168, 1), "d64 t8 cap 168"),
                      (ScanFwdConfig(64, 8, 4, 4, segs, 168, 2), "d64 t8 cap 168, prefetch 2"),
                      (ScanFwdConfig(64, 8, 4, 4, segs, None, 1), "d64 t8 uncapped"),
                      (ScanFwdConfig(64, 8, 4, 4, segs, 128, 1), "d64 t8 cap 128")]:
        named.setdefault(cfg, name)
    return named


def grid(batch, seg_options):
    for lanes_n in (2, 4, 8):
        for chunk_t in (8, 16, 32):
            if chunk_t * N // lanes_n > 64:
                continue
            for num_warps in (1, 2, 4, 8):
                # (max_registers, prefetch) variants; only 4-warp tiles are register-bound.
                variants = [(None, 1)]
                if num_warps == 4 and batch > 1:
                    variants += [(168, 1), (128, 1), (96, 1), (80, 1), (None, 2), (168, 2)]
                elif num_warps == 4:
                    variants += [(168, 1), (168, 2)]
                for segs in seg_options:
                    for cap, prefetch in variants:
                        yield ScanFwdConfig((32 // lanes_n) * num_warps, chunk_t, lanes_n, num_warps, segs, cap,
                                            prefetch)


def sweep(n_sms, bw, clock, named_only=False, layout="dense", only=None):
    """Time a grid of tile configs on the headline shapes; the best per shape is the data the
    heuristic in scan_fwd_config should reproduce. ~150 kernel compiles: a few minutes.

    Ranked by CUDA-graph time (GPU time alone: the tiles do not change the host cost).

    4-warp tiles are also timed under per-thread register caps (ptxas maxnreg) that buy one
    more program per SM: 168 = 3 programs, 128 = 4, 96 = 5, 80 = 6 (65536 / (k * 128), rounded
    down to 8). Offline (Triton 3.6, sm_90, fp32): t16 uncapped 180 registers (2 programs),
    t16/r168 no spill, t16/r128 48 B spilled (7 local loads per chunk), t8 uncapped 96,
    t8/r80 32 B spilled (4 local loads per chunk). prefetch = 2 keeps two chunks of loads in
    flight per program (t16: 168 registers uncapped, +3 % instructions)."""
    rows = []
    # Headline shapes first: the sweep stops compiling new configs after SWEEP_BUDGET_S.
    cases = [(torch.float32, 8, 2048, (1,)), (torch.bfloat16, 8, 2048, (1,)),
             (torch.float32, 1, 2048, (8,)), (torch.bfloat16, 1, 2048, (1, 8)),
             (torch.float32, 1, 128, (1,))]
    if only:
        name, b_, l_ = only.split(":")
        cases = [c for c in cases if (c[0] == (torch.float32 if name == "fp32" else torch.bfloat16)
                                      and c[1] == int(b_) and c[2] == int(l_))]
    start, skipped = time.time(), 0
    for dtype, batch, L, seg_options in cases:
        elt = torch.finfo(dtype).bits // 8
        x = make_inputs(batch, L, dtype)
        if layout == "hf":
            x = hf_layout(x)
        results = []
        default = scan_fwd_config(batch, DIM, L, N, DIM, n_sms, layout == "hf", elt == 2)
        named = named_candidates(default, default.n_segments)
        for cfg in (named if named_only else grid(batch, seg_options)):
            if time.time() - start > SWEEP_BUDGET_S:
                skipped += 1
                continue
            try:
                t = graph_ms(lambda x, cfg=cfg: ours(x, cfg), x)
            except Exception:  # noqa: BLE001 - a config may not compile
                traceback.print_exc()
                continue
            results.append((t, cfg))
        print(f"sweep {dtype} batch {batch}: {len(results)} configs [{time.time() - start:.0f}s]",
              flush=True)
        results.sort(key=lambda r: r[0])
        fl = floor_ms(batch, L, elt, bw, n_sms, clock)
        shown = results[:6] + [r for r in results[6:] if r[1] in named]
        for t, cfg in shown:
            rows.append(["fp32" if dtype == torch.float32 else "bf16", batch, L, str(tuple(cfg)),
                         t, f"{100 * fl / t:.0f}%", named.get(cfg, "")])
        del x
        torch.cuda.empty_cache()
    note = ""
    if skipped:
        note = f"{skipped} configs not timed (sweep budget {SWEEP_BUDGET_S} s spent)\n\n"
    write_out(f"bench_scan_sweep_{layout}.md", note + markdown_table(
        ["dtype", "batch", "L",
         "config (block_d, chunk_t, lanes_n, warps, segs, max regs, prefetch)", "graph ms",
         "%floor", ""], rows))


if __name__ == "__main__":
    main()
