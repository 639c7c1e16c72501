"""Compile the forward scan kernel for sm_90 without a GPU and count what its SASS does.

    python benchmarks/sass_scan_fwd.py [--dtype bf16|fp32] [--config 32,16,4,4,1,168,2]
        [--layout dense|hf] [--dt-rank R] [--dump out.sass]

Prints registers, spill bytes (``cuobjdump -res-usage``), and the opcode mix of the chunk loop's
body (the largest basic block between the loop's label and its back-branch). The offline numbers
in benchmarks/NOTES_scan_fwd.md come from this kind of compile: it is how a kernel change is
checked for registers and instruction count before device time is spent on it.
"""
import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ssm_compile.kernels.selective_scan.triton_fwd import ScanFwdConfig, _selective_scan_fwd_kernel
from ssm_compile.kernels.triton_common import LAUNCH_OPTIONS, dt_dot_meta

_PTR_ARGS = ("u_ptr", "delta_ptr", "A_ptr", "B_ptr", "C_ptr", "D_ptr", "z_ptr", "delta_bias_ptr",
             "h0_ptr", "y_ptr", "last_ptr", "seg_a_ptr", "seg_b_ptr", "dt_w_ptr")
_ACT_PTRS = ("u_ptr", "delta_ptr", "B_ptr", "C_ptr", "z_ptr", "y_ptr", "dt_w_ptr")


def compile_fwd(dtype: str, cfg: ScanFwdConfig, n: int = 16, layout: str = "dense", dt_rank: int = 0,
                store_last: bool = False):
    """``dt_rank`` > 0: the dt projection fused (delta_ptr is dt_low, unit stride along the rank
    on HF's layout, as x_proj's output view has it)."""
    kern = _selective_scan_fwd_kernel
    elt = {"bf16": "bf16", "fp32": "fp32"}[dtype]
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    lanes_n = cfg.lanes_n
    consts = dict(BLOCK_D=cfg.block_d, CHUNK_T=cfg.chunk_t, N_PER_THREAD=max(1, n // lanes_n),
                  LANES_N=lanes_n, SEGMENT_TOTALS=False, DELTA_SOFTPLUS=True, HAS_D=True, HAS_Z=True,
                  HAS_DELTA_BIAS=True, HAS_INIT=False, STORE_LAST=store_last, TIME_SPLIT=False,
                  PREFETCH=cfg.prefetch,
                  DT_RANK_PAD=dt_dot_meta(dt_rank, torch_dtype)[0] if dt_rank else 0,
                  DOT_PRECISION=dt_dot_meta(dt_rank, torch_dtype)[1],
                  N_RAGGED=max(1, n // lanes_n) * lanes_n != n)
    ptr_types = {p: f"*{elt}" if p in _ACT_PTRS else "*fp32" for p in _PTR_ARGS}
    # Unit strides, as Triton's specialisation sees them: along L for dense (batch, dim, L)
    # activations; along dim for channel-innermost ones (nn.Linear-based Mamba code, the HF model),
    # whose B/C are x_proj's (batch, L, dt_rank + 2N) output, unit stride along N.
    unit = (("stride_u_l", "stride_delta_l", "stride_z_l", "stride_y_l", "stride_B_l", "stride_C_l")
            if layout == "dense" else
            ("stride_u_d", "stride_delta_d", "stride_z_d", "stride_y_d", "stride_B_n", "stride_C_n"))
    unit += ("stride_A_n", "stride_D", "stride_delta_bias", "stride_h0_n", "stride_dtw_r")
    return compile_sm90(kern, consts, ptr_types, unit, cfg.num_warps, cfg.max_registers)


def compile_sm90(kern, consts: dict, ptr_types: dict, unit_strides, num_warps: int, maxnreg=None):
    """Compile ``kern`` for sm_90 as a launch would specialise it: ``consts`` as constexprs,
    pointers typed by ``ptr_types`` (16-byte aligned), the ``unit_strides`` as the constant 1,
    every other argument an int32 divisible by 16 except ``batch``."""
    sig, constexprs = {}, {}
    for name in kern.arg_names:
        if name in consts:
            sig[name] = "constexpr"
            constexprs[name] = consts[name]
        elif name in unit_strides:
            sig[name] = "constexpr"
            constexprs[name] = 1
        else:
            sig[name] = ptr_types.get(name, "i32")
    attrs = {(kern.arg_names.index(p),): [["tt.divisibility", 16]] for p in ptr_types}
    # A launch marks every integer argument that is a multiple of 16 as such, and that changes
    # the code (mask constancy, hence load vector widths: 740 instead of 796 loop instructions,
    # bf16, HF's layout): at the headline shape (batch 8, dim 1536, L 2048, N 16) every size
    # and stride but batch is one. Offline counts before run 17 lacked this.
    for name, kind in sig.items():
        if kind == "i32" and name != "batch":
            attrs[(kern.arg_names.index(name),)] = [["tt.divisibility", 16]]
    opts = {"num_warps": num_warps, **LAUNCH_OPTIONS}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    src = ASTSource(fn=kern, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def summarize(kernel, dump=None) -> tuple[dict, int, collections.Counter]:
    """Registers / stack / local bytes (``cuobjdump -res-usage``), and the longest loop's length
    and opcode mix; writes the SASS to ``dump`` when given."""
    sass, res = sass_of(kernel.asm["cubin"])
    if dump:
        with open(dump, "w") as f:
            f.write(sass)
    usage = {key: (m.group(1) if (m := re.search(rf"{key.upper()}:(\d+)", res)) else None)
             for key in ("reg", "stack", "local")}
    n, mix = loop_mix(sass)
    return usage, n, mix


def sass_of(cubin: bytes) -> tuple[str, str]:
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
        res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    return sass, res


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """Opcode counts of the longest innermost loop body: from a backward branch's target to the
    branch, with no other backward branch inside (an outer loop, such as the serial backward's
    walk over channel blocks, would count its inner loops' bodies too)."""
    inst = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            inst.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for i, (addr, text) in enumerate(inst):
        m = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((next(k for k, (a, _) in enumerate(inst) if a >= int(m.group(1), 16)), i))
    innermost = [(j, i) for j, i in loops if not any(j <= i2 < i for _, i2 in loops)]
    best = max(innermost, key=lambda loop: loop[1] - loop[0], default=(0, -1))
    mix = collections.Counter()
    for _, text in inst[best[0]:best[1] + 1]:
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split(" ")[0].split(".")[0]
        mix[op] += 1
    return best[1] - best[0] + 1, mix


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--config", default="32,16,4,4,1,168,2",
                   help="block_d,chunk_t,lanes_n,warps,segments,max_registers(0=none),prefetch")
    p.add_argument("--layout", default="dense", choices=("dense", "hf"))
    p.add_argument("--dt-rank", type=int, default=0, help="> 0: the dt projection fused, rank R")
    p.add_argument("--store-last", action="store_true",
                   help="the last state stored too, as a forward that fills a cache runs it")
    p.add_argument("--dump", default=None)
    args = p.parse_args()
    v = [int(x) for x in args.config.split(",")]
    cfg = ScanFwdConfig(v[0], v[1], v[2], v[3], v[4], v[5] or None, v[6])
    k = compile_fwd(args.dtype, cfg, layout=args.layout, dt_rank=args.dt_rank, store_last=args.store_last)
    usage, n, mix = summarize(k, args.dump)
    print(f"{args.dtype} {args.layout} {tuple(cfg)}: regs {usage['reg']}, stack {usage['stack']}, "
          f"local {usage['local']}; loop {n} instructions")
    print("  " + ", ".join(f"{op} {c}" for op, c in mix.most_common(18)))


if __name__ == "__main__":
    main()
