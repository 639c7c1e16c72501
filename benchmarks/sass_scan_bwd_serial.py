"""Compile the backward's "serial" chunk kernel for sm_90 without a GPU and count its SASS.

    python benchmarks/sass_scan_bwd_serial.py [--dtype bf16|fp32] [--layout dense|hf]
        [--steps 8] [--chunk 64] [--block-d 8] [--warps 1] [--maxnreg R] [--dump out.sass]

Prints registers, spills and the opcode mix of the longest loop body (the backward walk over a
sub-chunk), as ``sass_scan_fwd.py`` does for the forward: the offline check of a kernel change
before device time is spent on it.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_scan_fwd import compile_sm90, summarize  # noqa: E402

from ssm_compile.kernels.selective_scan.triton_bwd import _PAIR_DC, _chunk_bwd_serial_kernel  # noqa: E402

_ACT_PTRS = ("dy_ptr", "u_ptr", "delta_ptr", "B_ptr", "C_ptr", "z_ptr", "du_ptr", "ddelta_ptr", "dz_ptr")
_F32_PTRS = ("A_ptr", "D_ptr", "delta_bias_ptr", "hs_ptr", "rs_ptr", "dA_part_ptr", "dB_part_ptr",
             "dC_part_ptr", "dD_part_ptr", "ddb_part_ptr")


def compile_serial(dtype: str, steps: int, chunk: int, block_d: int, warps: int, layout: str, n: int = 16,
                   lanes_n: int = 4, maxnreg=None):
    kern = _chunk_bwd_serial_kernel
    elt = {"bf16": "bf16", "fp32": "fp32"}[dtype]
    consts = dict(DELTA_SOFTPLUS=True, HAS_D=True, HAS_Z=True, HAS_DELTA_BIAS=True, BLOCK_D=block_d, T=steps,
                  N_PER_THREAD=n // lanes_n, LANES_N=lanes_n, CHUNK=chunk,
                  PAIR_DC=_PAIR_DC)
    ptr_types = {p: f"*{elt}" for p in _ACT_PTRS} | {p: "*fp32" for p in _F32_PTRS}
    acts = ("dy", "u", "delta", "z", "du", "ddelta", "dz")
    unit = [f"stride_{a}_{'l' if layout == 'dense' else 'd'}" for a in acts]
    unit += ["stride_B_l", "stride_C_l"] if layout == "dense" else ["stride_B_n", "stride_C_n"]
    return compile_sm90(kern, consts, ptr_types, unit + ["stride_A_n"], warps, maxnreg)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--layout", default="dense", choices=("dense", "hf"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--block-d", type=int, default=8)
    p.add_argument("--warps", type=int, default=1)
    p.add_argument("--maxnreg", type=int, default=None)
    p.add_argument("--dump", default=None)
    args = p.parse_args()
    k = compile_serial(args.dtype, args.steps, args.chunk, args.block_d, args.warps, args.layout,
                       maxnreg=args.maxnreg)
    usage, n, mix = summarize(k, args.dump)
    elems = args.steps * 16 // 4  # elements per thread per sub-chunk (4 states of T steps)
    print(f"{args.dtype} {args.layout} steps {args.steps} chunk {args.chunk} block_d {args.block_d} "
          f"warps {args.warps}: regs {usage['reg']}, stack {usage['stack']}; "
          f"loop {n} instructions ({n / elems:.1f} per element)")
    print("  " + ", ".join(f"{op} {c}" for op, c in mix.most_common(22)))


if __name__ == "__main__":
    main()
