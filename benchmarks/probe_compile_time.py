"""Cold compile time of the 130m-shaped HF Mamba forward under backend="ssm": the default
("inlined": the ops' launches in inductor's code and, since run 27, inductor's C++ wrapper), the
same with the Python wrapper ("python", ``cpp_wrapper=False``), and the ops whole with the Python
wrapper ("whole", ``inline_launches=False, cpp_wrapper=False``, the pre-run-25 code path).

    python benchmarks/probe_compile_time.py [--len 512] [--batch 8] [--variants inlined python whole]

Each variant runs in a subprocess of its own with empty inductor and Triton caches, so both
compile every kernel from scratch; the figure is the first call's wall time (dynamo, the passes,
AOTAutograd, inductor, the Triton compiles and the run), as ``bench_e2e.py``'s compile column.
Appends to $OUT/probe_compile_time.md.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_out  # noqa: E402

_CHILD = """
import json, sys, time
import torch
import ssm_compile
sys.path.insert(0, sys.argv[1])
from bench_e2e import VOCAB, build
options = json.loads(sys.argv[2])
batch, L = int(sys.argv[3]), int(sys.argv[4])
model = build(True, torch.bfloat16).eval()
ids = torch.randint(0, VOCAB, (batch, L), device="cuda")
fn = torch.compile(model, backend=ssm_compile.backend(**options))
with torch.no_grad():
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(ids)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    start = time.perf_counter()
    fn(ids)
    torch.cuda.synchronize()
print(json.dumps({"first_call_s": first, "second_call_s": time.perf_counter() - start}))
"""


# variant -> backend options
VARIANTS = {
    "inlined": {},
    "python": {"cpp_wrapper": False},
    "whole": {"inline_launches": False, "cpp_wrapper": False},
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = p.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for variant in args.variants:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            out = subprocess.run([sys.executable, "-c", _CHILD, here, json.dumps(VARIANTS[variant]),
                                  str(args.batch), str(args.len)],
                                 env=env, capture_output=True, text=True)
        if out.returncode:
            rows.append(f"| {variant} | failed: {out.stderr.strip().splitlines()[-1][:200]} | |")
        else:
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(f"| {variant} | {r['first_call_s']:.1f} | {r['second_call_s'] * 1e3:.1f} |")
        print(rows[-1], flush=True)
    text = (f"130m-shaped HF Mamba forward, batch {args.batch}, L {args.len}, bf16, backend ssm, cold caches\n\n"
            "| launches | first call s (compile) | second call ms |\n|---|---|---|\n" + "\n".join(rows) + "\n")
    write_out("probe_compile_time.md", text, append=True)


if __name__ == "__main__":
    main()
