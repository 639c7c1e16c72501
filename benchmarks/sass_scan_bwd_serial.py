"""Compile the backward's "serial" chunk kernel for sm_90 without a GPU and count its SASS.

    python benchmarks/sass_scan_bwd_serial.py [--dtype bf16|fp32] [--layout dense|hf]
        [--steps 8] [--chunk 64] [--block-d 32] [--warps 4] [--maxnreg R] [--dump out.sass]

Prints registers, spills and the opcode mix of the longest loop body (the backward walk over a
sub-chunk), as ``sass_scan_fwd.py`` does for the forward: the offline check of a kernel change
before device time is spent on it.
"""
import argparse
import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_scan_fwd import loop_mix, sass_of  # noqa: E402

from ssm_compile.kernels.selective_scan.triton_bwd import _chunk_bwd_serial_kernel  # noqa: E402
from ssm_compile.kernels.triton_common import LAUNCH_OPTIONS  # noqa: E402

_ACT_PTRS = ("dy_ptr", "u_ptr", "delta_ptr", "B_ptr", "C_ptr", "z_ptr", "du_ptr", "ddelta_ptr", "dz_ptr")
_F32_PTRS = ("A_ptr", "D_ptr", "delta_bias_ptr", "hs_ptr", "rs_ptr", "dA_part_ptr", "dB_part_ptr",
             "dC_part_ptr", "dD_part_ptr", "ddb_part_ptr")


def compile_serial(dtype: str, steps: int, chunk: int, block_d: int, warps: int, layout: str, n: int = 16,
                   lanes_n: int = 4, maxnreg=None):
    kern = _chunk_bwd_serial_kernel
    elt = {"bf16": "bf16", "fp32": "fp32"}[dtype]
    consts = dict(DELTA_SOFTPLUS=True, HAS_D=True, HAS_Z=True, HAS_DELTA_BIAS=True, BLOCK_D=block_d, T=steps,
                  N_PER_THREAD=n // lanes_n, LANES_N=lanes_n, CHUNK=chunk)
    sig, constexprs = {}, {}
    for name in kern.arg_names:
        if name in consts:
            sig[name] = "constexpr"
            constexprs[name] = consts[name]
        elif name in _ACT_PTRS:
            sig[name] = f"*{elt}"
        elif name in _F32_PTRS:
            sig[name] = "*fp32"
        else:
            sig[name] = "i32"
    acts = ("dy", "u", "delta", "z", "du", "ddelta", "dz")
    unit = [f"stride_{a}_{'l' if layout == 'dense' else 'd'}" for a in acts]
    unit += ["stride_B_l", "stride_C_l"] if layout == "dense" else ["stride_B_n", "stride_C_n"]
    for name in unit + ["stride_A_n"]:
        sig[name] = "constexpr"
        constexprs[name] = 1
    attrs = {(kern.arg_names.index(p),): [["tt.divisibility", 16]] for p in _ACT_PTRS + _F32_PTRS}
    for name, kind in sig.items():
        if kind == "i32" and name != "batch":
            attrs[(kern.arg_names.index(name),)] = [["tt.divisibility", 16]]
    opts = {"num_warps": warps, **LAUNCH_OPTIONS}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    src = ASTSource(fn=kern, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--layout", default="dense", choices=("dense", "hf"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--block-d", type=int, default=32)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--maxnreg", type=int, default=None)
    p.add_argument("--dump", default=None)
    args = p.parse_args()
    k = compile_serial(args.dtype, args.steps, args.chunk, args.block_d, args.warps, args.layout,
                       maxnreg=args.maxnreg)
    sass, res = sass_of(k.asm["cubin"])
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(sass)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    n, mix = loop_mix(sass)
    elems = args.steps * 16 // 4  # elements per thread per sub-chunk (4 states of T steps)
    print(f"{args.dtype} {args.layout} steps {args.steps} chunk {args.chunk} block_d {args.block_d} "
          f"warps {args.warps}: regs {regs and regs.group(1)}, stack {stack and stack.group(1)}; "
          f"loop {n} instructions ({n / elems:.1f} per element)")
    print("  " + ", ".join(f"{op} {c}" for op, c in mix.most_common(22)))


if __name__ == "__main__":
    main()
