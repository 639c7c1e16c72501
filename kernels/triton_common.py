"""Triton device functions shared by the forward and backward kernels."""
import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

# log2(e): kernels fold it into A once so that exp(delta*A) is a single exp2. A constexpr,
# because a jit function may only read module globals that are constexprs when compiled
# for a GPU (the interpreter is more lenient, which hides the mistake on CPU).
LOG2E = tl.constexpr(1.4426950408889634)
# Under TRITON_INTERPRET=1 (CPU tests) kernels run as NumPy, which has no inline assembly. The
# interpreter reads the same variable when @triton.jit runs, so this agrees with it.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
# Compile options every launch passes. FMA contraction: Triton 3.9 warns that its default turns
# off in 3.10; the kernels' instruction counts, register budgets (ssm_compile.heuristic) and
# tested tolerances were all measured with it on, so they ask for it rather than inherit a
# default. (The interpreter ignores compile options.)
LAUNCH_OPTIONS = {"enable_fp_fusion": True}
_UNCAPPED = {**LAUNCH_OPTIONS, "maxnreg": None}


def launcher(kernel, traced: bool, max_registers: Optional[int] = None):
    """(what to launch, extra launch options): ``kernel`` with LAUNCH_OPTIONS and the register
    cap ``max_registers`` (Triton's ``maxnreg``; None = ptxas's choice), or for a launch that a
    graph records (``kernels/inline.py``) its ``wrap_triton`` wrapper without them.

    wrap_triton records kernel arguments, launch sizes, num_warps and num_stages, so inductor
    compiles a recorded launch with Triton's defaults otherwise, whose FMA contraction is on
    through Triton 3.9, as LAUNCH_OPTIONS asks. It drops ``maxnreg``, and the scan forward's cap
    is worth 2-8 % of its time even where ptxas needs fewer registers (``scan_fwd_config``). So
    a capped kernel is recorded as a one-config ``triton.autotune`` whose config carries the cap
    among its keyword arguments (``_capped``): inductor's generated code re-creates each config
    from a dict (``config_from_dict``), which takes ``maxnreg`` from the dict as a compile
    option, and Triton's own launch of a config passes it to the compile the same way. The
    launch's num_warps goes into that config as wrap_triton puts it into any launch's.
    """
    if traced:
        from torch.library import wrap_triton

        return wrap_triton(kernel if max_registers is None else _capped(kernel, max_registers)), {}
    return kernel, _UNCAPPED if max_registers is None else {**LAUNCH_OPTIONS, "maxnreg": max_registers}


@functools.lru_cache(maxsize=None)
def _capped(kernel, max_registers: int):
    """``kernel`` as a one-config autotune carrying ``maxnreg`` (see ``launcher``); cached, so that
    every capped launch of a kernel is the same object to inductor."""
    return triton.autotune(configs=[triton.Config({"maxnreg": max_registers})], key=[])(kernel)


@functools.cache
def num_sms(device_index) -> int:
    """SMs of a CUDA device (its index; None: the current one), read once: the launchers ask on
    every call."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@triton.jit
def neg_zero():
    """-0.0, the exact identity of +, built from its bits.

    Triton 3.6 turns a literal -0.0 into +0.0 (its TTIR constant loses the sign; 3.9 keeps it),
    and x + 0.0 is not x (it maps -0.0 to +0.0), so a masked sum meant to fold to a register
    read (``_last_step``, the backward's ``_row``) kept one add per element: 32 FADD and 32
    FFMA with a zero operand per sub-chunk in the serial backward walk (sm_90, fp32; 1038 ->
    989 instructions). H200 run 31, batch 8 L=2048: scan backward 1.460 -> 1.447 ms fp32, 1.461
    -> 1.449 ms bf16.
    """
    return tl.full([], -2147483648, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def linear_combine(a1, b1, a2, b2):
    # Step (a1, b1) is applied first, then (a2, b2):
    #   h -> a2 * (a1 * h + b1) + b2 = (a1 * a2) * h + (a2 * b1 + b2).
    # The order matters: swapping it gives a plausible-looking but wrong prefix.
    return a1 * a2, a2 * b1 + b2


@triton.jit
def finite_decay_rate(A):
    # A = -inf (an overflowed -exp(A_log)) becomes the most negative float, +inf the largest, once
    # per program. The kernels give a padded time step dt = 0, and 0 * inf = NaN would reach the
    # carried state and the backward's adjoint; with the finite value the padded step is the
    # identity (exp2(0) = 1), as is a real step with dt exactly 0. At t = 0 that is eager's value (an
    # associative_scan never forms its first decay; the CPU path does the same). Later, eager's
    # exp(0 * -inf) is NaN, and so is the CPU path's (probe CN, run 62): there the kernels differ. A
    # real step with |dt| >= 2**-120 decays to exp2(dt * -3.4e38) = 0 (or grows to inf), as with the
    # infinity. Below that the stand-in is not the infinity: exp2(1e-39 * -3.4e38) = 0.79 where
    # eager's is 0 (probe CL, run 61). Exact would be a select per element in the loop, in a kernel
    # bound by its instruction issue, for an A_log above 88 together with a dt below 1e-36 (or
    # exactly 0 after the first step). NaN stays NaN.
    return tl.where(A == float("-inf"), -3.4028234663852886e38,
                    tl.where(A == float("inf"), 3.4028234663852886e38, A))


@triton.jit
def softplus(x, FAST_MATH: tl.constexpr = False):
    # torch.nn.functional.softplus with beta=1, threshold=20 (identity above 20), to fp32
    # rounding. softplus(x) = max(x, 0) + log1p(e) with e = exp(-|x|) in (0, 1], and
    # log1p(e) = 2 * atanh(s) with s = e / (2 + e) in (0, 1/3]:
    #   2 * atanh(s) = 2s * (1 + w/3 + w^2/5 + ... + w^6/13),  w = s^2 <= 1/9,
    # truncated where the next term is below 2^-26 relative. Compared with tl.log (a libdevice
    # polynomial) plus the 1 + e cancellation fix this is ~20 instead of ~35 instructions per
    # element (sm_90 SASS), has no accuracy loss for tiny e (s ~ e / 2 keeps full precision)
    # and cannot overflow: the exponent is never positive. FAST_MATH: see _rcp_approx.
    if FAST_MATH:
        e = _exp_neg_approx(tl.abs(x))
        s = e * _rcp_approx(2.0 + e)
    else:
        e = tl.exp(-tl.abs(x))
        s = e / (2.0 + e)
    w = s * s
    p = 1.0 / 13.0
    p = p * w + 1.0 / 11.0
    p = p * w + 1.0 / 9.0
    p = p * w + 1.0 / 7.0
    p = p * w + 1.0 / 5.0
    p = p * w + 1.0 / 3.0
    p = p * w + 1.0
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + 2.0 * s * p)


@triton.jit
def silu(x, FAST_MATH: tl.constexpr = False):
    if FAST_MATH:
        y = x * _rcp_approx(1.0 + _exp_neg_approx(x))
    else:
        y = x / (1.0 + tl.exp(-x))
    return y


@triton.jit
def _exp_neg_approx(x):
    # exp(-x) as one MUFU.EX2 that flushes subnormal results to 0 (only for x > 87, where the
    # callers' results are 0 or x anyway); tl.exp's subnormal handling costs ~3 more
    # instructions per call.
    return tl.exp2(-x * LOG2E)


@triton.jit
def _rcp_approx(x):
    # 1 / x for the activations above, whose denominators are >= 1 or +inf: on the GPU
    # rcp.approx.ftz (1 ulp), one MUFU.RCP, instead of Triton's IEEE division (~10 instructions
    # and a slow-path branch).
    #
    # Measured (H200, Triton 3.6, batch 8, L=2048, run 18): with these in softplus and silu the
    # scan backward ran 2.515 -> 2.372 ms (fp32) and 2.356 -> 2.153 ms (bf16), but the forward
    # scan ran 0.2256 -> 0.2323 ms (bf16, HF's layout) although its chunk loop had 646 -> 600
    # instructions offline (Triton 3.9). So the scan forward does not pass FAST_MATH; the scan
    # backward and the conv kernels do (conv: run 29, see causal_conv1d/triton_conv.py).
    # Run 29 re-measured the forward (0.2250 -> 0.2319 ms) and tried Triton's own approximate
    # division, tl.fdiv (div.full.f32: MUFU.RCP and a range check, no inline assembly that could
    # bind ptxas's schedule) in place of this: the forward 0.2330 ms, and the scan backward 1-2.5 %
    # slower than with this (fp32 1.753 -> 1.771, bf16 1.636 -> 1.676 ms at batch 8, L=2048).
    if _INTERPRETED:
        r = 1.0 / x
    else:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    return r


@triton.jit
def sigmoid_approx(x):
    # 1 / (1 + e^-x) to ~2 ulp: for gradients, whose tolerances are far above that.
    return _rcp_approx(1.0 + _exp_neg_approx(x))


@triton.jit
def prefetch(ptrs, LEVEL: tl.constexpr):
    # Pull the lines holding ``ptrs`` into L1 (LEVEL 1) or L2 (LEVEL 2) ahead of the loads that
    # need them: a hint with no value and no register kept live (a software-pipelined load would
    # hold its tile in registers across the loop body, which kernels at the 255-register cap
    # cannot afford). The addresses must be valid (PTX leaves prefetches of invalid addresses
    # undefined): callers clamp them. GPU only: the interpreter has no inline assembly, so
    # callers guard this with a constexpr.
    if LEVEL == 1:
        tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L1 [$1];", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def project_dt(dt_low, w_dt, PRECISION: tl.constexpr):
    """A chunk's delta, [T, R] dt_low x [R, D] W_dt^T, in fp32 (the fused dt projection).

    The tensor-core product accumulates in fp32 (``PRECISION``: tl.dot's input_precision, see
    ``dt_dot_meta``) and is rounded through dt_low's dtype, as the split path's matmul output
    is, so every level feeds the scan the same delta.
    """
    return dot_acc(dt_low, w_dt, None, PRECISION).to(dt_low.dtype).to(tl.float32)


@triton.jit
def dot_acc(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` (``a @ b`` for ``acc`` None) on the tensor cores, in fp32
    (``PRECISION``: tl.dot's input_precision, which only fp32 operands read). Under
    TRITON_INTERPRET=1 16-bit operands are widened first: the interpreter's NumPy dot reads bf16
    operands wrongly (Triton 3.9: errors of ~1e10 on a 16 x 16 x 32 product), and products of
    16-bit values are exact in fp32, so widening changes no value."""
    if _INTERPRETED:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


def dt_dot_meta(rank: int, dtype: torch.dtype) -> tuple[int, str]:
    """``(DT_RANK_PAD, DOT_PRECISION)`` for a fused dt projection of rank R in ``dtype``.

    tl.dot needs K >= 16 (16-bit operands), so R is padded to a power of two >= 16. fp32
    operands take three tf32 products (~fp32 accuracy) instead of the FMA path, whose 256 FMAs
    per thread and chunk would cost a third of the scan itself.
    """
    return max(16, 1 << max(rank - 1, 0).bit_length()), ("tf32x3" if dtype == torch.float32 else "ieee")
