"""Compile the scan backward's chunk-state kernel for sm_90 without a GPU; registers, spills and
the chunk loop's opcode mix (as ``sass_scan_fwd.py`` does for the forward).

    python benchmarks/sass_chunk_state.py [--dtype bf16|fp32] [--layout dense|hf] [--cap 168]

The backward hands the kernel L-major copies ("dense") for its "nblock" variant and the op's own
layout ("hf", channel-innermost) for "serial".
"""
import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_scan_fwd import compile_sm90, loop_mix, sass_of  # noqa: E402

from ssm_compile.kernels.selective_scan.triton_bwd import _chunk_state_kernel  # noqa: E402

_PTRS = ("u_ptr", "delta_ptr", "dy_ptr", "z_ptr", "A_ptr", "B_ptr", "C_ptr", "delta_bias_ptr",
         "hs_ptr", "rs_ptr", "total_ptr")
_ACTS = ("u_ptr", "delta_ptr", "dy_ptr", "z_ptr", "B_ptr", "C_ptr")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--layout", default="dense", choices=("dense", "hf"))
    p.add_argument("--cap", type=int, default=168, help="maxnreg (0: none)")
    p.add_argument("--config", default="32,8,4,4,128", help="block_d,chunk_t,lanes_n,warps,chunk")
    args = p.parse_args()
    block_d, chunk_t, lanes_n, warps, chunk = (int(x) for x in args.config.split(","))
    consts = dict(DELTA_SOFTPLUS=True, HAS_Z=True, HAS_DELTA_BIAS=True, BLOCK_D=block_d, CHUNK_T=chunk_t,
                  N_PER_THREAD=16 // lanes_n, LANES_N=lanes_n, CHUNK=chunk)
    unit = (("stride_u_l", "stride_delta_l", "stride_dy_l", "stride_z_l", "stride_B_l", "stride_C_l")
            if args.layout == "dense" else
            ("stride_u_d", "stride_delta_d", "stride_dy_d", "stride_z_d", "stride_B_n", "stride_C_n"))
    ptr_types = {p: f"*{args.dtype}" if p in _ACTS else "*fp32" for p in _PTRS}
    k = compile_sm90(_chunk_state_kernel, consts, ptr_types, unit + ("stride_A_n",), warps, args.cap or None)
    sass, res = sass_of(k.asm["cubin"])
    regs, local = re.search(r"REG:(\d+)", res), re.search(r"LOCAL:(\d+)", res)
    n, mix = loop_mix(sass)
    print(f"{args.dtype} {args.layout} cap {args.cap}: regs {regs and regs.group(1)}, local "
          f"{local and local.group(1)}; loop {n} instructions")
    print("  " + ", ".join(f"{op} {c}" for op, c in mix.most_common(18)))


if __name__ == "__main__":
    main()
