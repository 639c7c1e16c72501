"""Fusion-level sweep on the GPU: time every level of the Mamba block's middle and the heuristic's pick.

What is timed, per config, is the part of a Mamba-1 mixer between in_proj and out_proj, with
HF's layouts (x and z are channels-last halves of the in_proj output, dt_low/B/C are views of
x_proj's output):

* split:  u = conv(x); x_dbl = x_proj(u); delta = W_dt @ dt_low^T; y = selective_scan(u, delta, ...)
* level1: u = conv(x); x_dbl = x_proj(u); delta = W_dt @ dt_low^T; y = fused(x, delta, conv)
* dt:     u = conv(x); x_dbl = x_proj(u);                           y = fused(u, dt_low^T, dt_proj)
* level2: u = conv(x); x_dbl = x_proj(u);                           y = fused(x, dt_low^T, conv, dt_proj)

(the conv runs in every level because x_proj needs u; see kernels/fused/triton_fused.py).
Each level's y is checked against split's. The heuristic (``ssm_compile.heuristic.decide``,
compiling and reading n_regs/n_spills on this GPU) picks a level per config; the sweep reports
how often the pick is within 5% of the fastest level (target >= 90%) and how often each level
wins (a level that never wins is to be dropped).

Usage (on the GPU machine, from the repo root): ``python benchmarks/bench_fusion.py``
(``--quick``: 4 bf16 configs, a smoke test of every level on the GPU in well under a minute).
Writes ``fusion_sweep.csv`` and ``fusion_sweep.md`` to $OUT (or the current directory).
Sweep: N in {16, 64, 128}, dim in {768, 1536, 5120}, L in {512, 2048, 8192}, batch in {1, 8},
bf16/fp32 (108 configs); a time guard stops early (keeping the results so far) before 8 min.
"""
from __future__ import annotations

import argparse
import csv
import functools
import itertools
import random
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import graph_ms, markdown_table, median_ms, write_out  # noqa: E402

from ssm_compile import heuristic  # noqa: E402

LEVELS = ("split", "level1", "dt", "level2")
NS, DIMS, LS, BATCHES = (16, 64, 128), (768, 1536, 5120), (512, 2048, 8192), (1, 8)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WIDTH = 4
MEMORY_LIMIT = 60e9
TIME_BUDGET_S = 7 * 60
WITHIN = 1.05


def make_block(batch, dim, L, N, dtype):
    R = math.ceil(dim / 16)
    dev = "cuda"
    xz = torch.randn(batch, L, 2 * dim, device=dev, dtype=dtype).transpose(1, 2)
    x, z = xz.chunk(2, dim=1)
    return dict(
        x=x, z=z, R=R, N=N,
        conv_w=torch.randn(dim, WIDTH, device=dev, dtype=dtype) / WIDTH,
        conv_b=torch.randn(dim, device=dev, dtype=dtype) * 0.1,
        x_proj_w=torch.randn(R + 2 * N, dim, device=dev, dtype=dtype) / math.sqrt(dim),
        dt_w=torch.randn(dim, R, device=dev, dtype=dtype) / math.sqrt(R),
        dt_bias=torch.randn(dim, device=dev, dtype=torch.float32) * 0.3 - 2.0,
        A=-torch.rand(dim, N, device=dev, dtype=torch.float32) - 0.5,
        D=torch.randn(dim, device=dev, dtype=torch.float32),
    )


def run_level(level, p):
    ops = torch.ops.ssm
    u = ops.causal_conv1d(p["x"], p["conv_w"], p["conv_b"], "silu")
    x_dbl = F.linear(u.transpose(1, 2), p["x_proj_w"])
    R, N = p["R"], p["N"]
    dt_low_t = x_dbl[..., :R].transpose(1, 2)
    B = x_dbl[..., R:R + N].transpose(1, 2)
    C = x_dbl[..., R + N:].transpose(1, 2)
    common = (p["A"], B, C, p["D"], p["z"], p["dt_bias"], True)
    if level == "split":
        delta = p["dt_w"] @ dt_low_t
        return ops.selective_scan(u, delta, *common)[0]
    if level == "level1":
        delta = p["dt_w"] @ dt_low_t
        return ops.fused_mamba_scan(p["x"], delta, *common, p["conv_w"], p["conv_b"], "silu", None)[0]
    if level == "dt":
        return ops.fused_mamba_scan(u, dt_low_t, *common, None, None, None, p["dt_w"])[0]
    return ops.fused_mamba_scan(p["x"], dt_low_t, *common, p["conv_w"], p["conv_b"], "silu", p["dt_w"])[0]


def main(quick: bool = False, time_budget_s: float = TIME_BUDGET_S, start_at: int = 0,
         only: str = ""):
    from ssm_compile.kernels.causal_conv1d import op as conv_op
    from ssm_compile.kernels.fused import op as fused_op
    from ssm_compile.kernels.selective_scan import op as scan_op

    scan_op.register(), conv_op.register(), fused_op.register()
    torch.manual_seed(0)
    device = torch.device("cuda")
    limits = heuristic.device_limits(device)
    print(f"device: {torch.cuda.get_device_name()} ({limits.sm_count} SMs, "
          f"{limits.regs_per_sm} regs/SM)", flush=True)
    start = time.time()
    rows, stopped = [], None
    configs = list(itertools.product(DTYPES, BATCHES, DIMS, LS, NS))
    # A fixed shuffle, so that a run cut short by the time budget still samples the whole grid.
    random.Random(0).shuffle(configs)
    if quick:
        configs = list(itertools.product(["bf16"], BATCHES, [768], [512, 2048], [16]))
    if only:
        configs = [(d, int(b), int(dim), int(L), int(N))
                   for d, b, dim, L, N in (c.split(",") for c in only.split(";"))]
    # A later call continues where a budget-limited one stopped (same shuffle).
    configs = configs[start_at:]
    for dname, batch, dim, L, N in configs:
        if time.time() - start > time_budget_s:
            stopped = f"time budget reached after {len(rows)} of {len(configs)} configs"
            break
        dtype = DTYPES[dname]
        elems = batch * dim * L
        if elems * dtype.itemsize * 8 > MEMORY_LIMIT:
            continue
        p = make_block(batch, dim, L, N, dtype)
        ref = run_level("split", p).float()
        times, host, errs = {}, {}, {}
        for level in LEVELS:
            y = run_level(level, p).float()
            errs[level] = ((y - ref).norm() / ref.norm()).item()
            # GPU time (CUDA-graph replay) decides: it is what the register/occupancy trade-off
            # changes. The host-launched time, where Python launch cost can hide the kernels at
            # small shapes, is reported beside it.
            run = functools.partial(run_level, level, p)
            times[level] = graph_ms(run, calls=5)
            host[level] = median_ms(run, warmup_ms=5, rep_ms=20)
        problem = heuristic.Problem(
            batch=batch, dim=dim, L=L, N=N, groups=1, width=WIDTH, dt_rank=p["R"], act_dtype=dtype,
            delta_dtype=dtype, conv_has_other_users=True, legal=LEVELS, device="cuda")
        decision = heuristic.decide(problem, device=device)
        best = min(times, key=times.get)
        row = dict(dtype=dname, batch=batch, dim=dim, L=L, N=N,
                   **{f"{lv}_ms": round(times[lv], 4) for lv in LEVELS},
                   best=best, pick=decision.level, pick_ms=round(times[decision.level], 4),
                   pick_ok=times[decision.level] <= WITHIN * times[best],
                   host_best=min(host, key=host.get),
                   host_pick_ok=host[decision.level] <= WITHIN * min(host.values()),
                   est_regs=decision.est_regs, actual_regs=decision.actual_regs,
                   occupancy=round(decision.occupancy, 4),
                   max_rel_err=float(f"{max(errs.values()):.3g}"), reason=decision.reason)
        rows.append(row)
        print(row, flush=True)
        del p, ref
        torch.cuda.empty_cache()

    report(rows, f"configs measured: {len(rows)} of {len(configs)}" + (f" ({stopped})" if stopped else ""),
           f"wall time: {time.time() - start:.0f} s")


def rescore(csv_path: str) -> None:
    """Re-pick every row of an earlier sweep's CSV with the current heuristic, scored against
    that sweep's measured per-level times (no GPU: the H200's default limits and the register
    estimates stand in for a compile)."""
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        times = {lv: float(r[f"{lv}_ms"]) for lv in LEVELS}
        dtype = DTYPES[r["dtype"]]
        batch, dim, L, N = (int(r[k]) for k in ("batch", "dim", "L", "N"))
        problem = heuristic.Problem(
            batch=batch, dim=dim, L=L, N=N, groups=1, width=WIDTH, dt_rank=math.ceil(dim / 16),
            act_dtype=dtype, delta_dtype=dtype, conv_has_other_users=True, legal=LEVELS, device="cuda")
        decision = heuristic.decide(problem)
        r.update(pick=decision.level, pick_ms=times[decision.level],
                 pick_ok=times[decision.level] <= WITHIN * min(times.values()),
                 host_pick_ok="n/a", est_regs=decision.est_regs, actual_regs="",
                 occupancy=round(decision.occupancy, 4), reason=decision.reason)
        for k in ("batch", "dim", "L", "N", "max_rel_err", *(f"{lv}_ms" for lv in LEVELS)):
            r[k] = float(r[k]) if k.endswith(("_ms", "err")) else int(r[k])
    report(rows, f"rescored {len(rows)} configs of {csv_path} with the current heuristic "
                 "(measured times from that run; host-launched picks not rescored)")


def report(rows: list[dict], *notes: str) -> None:
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "fusion_sweep.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    header = [k for k in rows[0] if k != "reason"]
    ok = sum(r["pick_ok"] for r in rows)
    host_checked = [r["host_pick_ok"] for r in rows if isinstance(r["host_pick_ok"], bool)]
    host_ok = sum(host_checked)
    wins = {lv: sum(r["best"] == lv for r in rows) for lv in LEVELS}
    summary = [
        notes[0],
        f"pick within 5% of the fastest level: {ok}/{len(rows)} = {ok / max(len(rows), 1):.1%} "
        "(target >= 90%; GPU time from CUDA-graph replay)",
        f"the same with host-launched timing: {host_ok}/{len(host_checked)} = "
        f"{host_ok / max(len(host_checked), 1):.1%}",
        "fastest-level counts: " + ", ".join(f"{lv} {n}" for lv, n in wins.items()),
        f"worst level-vs-split relative error: {max(r['max_rel_err'] for r in rows):.3g}",
        *notes[1:],
    ]
    text = "\n".join(["# Fusion sweep", "", *[f"- {s}" for s in summary], "",
                      markdown_table(header, [[r[k] for k in header] for r in rows])])
    write_out("fusion_sweep.md", text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 bf16 configs only")
    parser.add_argument("--time-budget", type=float, default=TIME_BUDGET_S,
                        help="seconds; the sweep stops there and reports the configs measured")
    parser.add_argument("--start-at", type=int, default=0,
                        help="skip the first configs of the (fixed) shuffled grid, to continue a run")
    parser.add_argument("--only", default="",
                        help='these configs instead of the grid: "dtype,batch,dim,L,N;..."')
    parser.add_argument("--rescore", metavar="CSV",
                        help="re-pick an earlier run's rows with the current heuristic (no GPU)")
    args = parser.parse_args()
    if args.rescore:
        rescore(args.rescore)
    elif not torch.cuda.is_available():
        sys.exit("bench_fusion.py needs a CUDA GPU")
    else:
        main(quick=args.quick, time_budget_s=args.time_budget, start_at=args.start_at, only=args.only)
