"""Print explain's scan misses for the tiny HF Zamba of tests/test_variants.py (a device-host check:
on torch 2.11 its per-head scans were left alone in run 48)."""
import sys

import torch

sys.path.insert(0, "tests")
from test_variants import L, VOCAB, tiny_zamba  # noqa: E402

import ssm_compile  # noqa: E402

model = tiny_zamba()
ids = torch.randint(0, VOCAB, (2, L), generator=torch.Generator().manual_seed(1))
report = ssm_compile.explain(model, ids, use_cache=False)
print(report.summary())
seen = set()
for m in report.misses:
    if m.family in ("scan_loop", "scan_assoc", "scan", "discretization", "readout") and m.reason not in seen:
        seen.add(m.reason)
        print(f"[{m.family}] {m.reason}")
