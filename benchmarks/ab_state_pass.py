"""A/B of the scan backward's state pass inside the whole backward (run 21): ROWS chunks per step.

    python benchmarks/ab_state_pass.py

Standalone, the pass's 25 MB workspaces stay in L2 between replays and any ROWS looks fast
(bench_chunk_state.py); inside the backward the chunk-state kernel has streamed ~200 MB of
inputs since it wrote them. Interleaved rounds, GPU time from CUDA graphs.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_scan_bwd import make_inputs  # noqa: E402
from common import graph_ms  # noqa: E402

from ssm_compile.kernels.selective_scan import triton_bwd as tb  # noqa: E402

for dname, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    x, dy = make_inputs(8, 2048, dtype)
    B4, C4 = x["B"].unsqueeze(1), x["C"].unsqueeze(1)
    res = {1: [], 8: []}
    for _ in range(3):
        for rows in (1, 8):
            tb._PASS_ROWS = rows
            res[rows].append(graph_ms(lambda: tb.selective_scan_bwd(dy, None, x["u"], x["delta"], x["A"], B4, C4, x["D"],
                                                                    x["z"], x["delta_bias"], True, None)))
    print(dname, "batch 8 L 2048 whole backward ms:", {k: [f"{v:.4f}" for v in vs] for k, vs in res.items()})
