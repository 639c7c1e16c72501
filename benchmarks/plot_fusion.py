"""Plot the fusion sweep: each level's time relative to split, per config, with the heuristic's pick.

Usage: ``python benchmarks/plot_fusion.py [fusion_sweep.csv] [benchmarks/fusion_sweep.png]``
(the CSV that ``bench_fusion.py`` wrote). matplotlib is a dev tool here, not a dependency.
"""
from __future__ import annotations

import csv
import os
import sys

LEVELS = ("split", "level1", "dt", "level2")
MARKERS = {"split": "s", "level1": "^", "dt": "v", "level2": "o"}


def main(csv_path: str, png_path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_fusion.py needs matplotlib (pip install matplotlib); it is a dev tool, "
                 "not a dependency of ssm-compile")
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"{csv_path} has no rows")
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * 0.16), 5))
    xs = range(len(rows))
    for level in LEVELS:
        rel = [float(r[f"{level}_ms"]) / float(r["split_ms"]) for r in rows]
        ax.scatter(xs, rel, marker=MARKERS[level], s=18, label=level, alpha=0.8)
    picks = [float(r["pick_ms"]) / float(r["split_ms"]) for r in rows]
    ax.scatter(xs, picks, marker="x", s=40, color="black", label="heuristic pick")
    ax.axhline(1.0, color="grey", lw=0.8)
    # The dt-projection levels run up to ~70x split: a linear axis would flatten everything else.
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['dtype']} b{r['batch']} d{r['dim']} L{r['L']} N{r['N']}" for r in rows],
                       rotation=90, fontsize=5)
    ok = sum(r["pick_ok"] == "True" for r in rows)
    ax.set_ylabel("time / split time (lower is faster)")
    ax.set_title(f"Fusion levels on {len(rows)} configs; pick within 5% of best: {ok}/{len(rows)}")
    ax.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(png_path, dpi=150)
    print(f"wrote {png_path}")


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "."), "fusion_sweep.csv")
    dst = sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "fusion_sweep.png")
    main(src, dst)
