"""Write inductor's generated code for the 130m-shaped HF Mamba forward under backend="ssm"
(a few layers, so the compile is short), and list the kernels that copy whole activations.

    python benchmarks/dump_e2e_code.py --layers 2 --len 2048 --out $OUT/e2e_code.py

Why: the end-to-end profile spends ~26 us per layer in each of three inductor kernels named after
clone/transpose (benchmarks/profiles/profile_e2e_ssm_L2048.txt), about 10 % of the forward; this
shows which graph values they copy, so the op layouts can be chosen to avoid them.
"""
import argparse
import re
import sys
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import VOCAB, build  # noqa: E402

import ssm_compile  # noqa: E402,F401


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model = build(True, torch.bfloat16, layers=args.layers).eval()
    ids = torch.randint(0, VOCAB, (args.batch, args.len), device="cuda")
    compiled = torch.compile(model, backend="ssm")
    with torch.no_grad():
        _, codes = run_and_get_code(compiled, ids)
    Path(args.out).write_text("\n\n# ======== next graph ========\n\n".join(codes))
    # Inductor names each kernel after the graph nodes fused into it; list the copies with the
    # buffers they read and write (the call lines in the wrapper), so a reader can map them back.
    for code in codes:
        for m in re.finditer(r"^\s*(triton_\w*(clone|copy)\w*)\.run\((.*)$", code, re.M):
            print(m.group(1), "(", m.group(3)[:160])
        for m in re.finditer(r"^(\s*buf\d+ = empty_strided_cuda\(.*)$", code, re.M):
            print(m.group(1).strip()[:160])


if __name__ == "__main__":
    main()
