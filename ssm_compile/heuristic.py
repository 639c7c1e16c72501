"""How far to fuse a Mamba block: a register-budget / occupancy model with Triton's word as check.

Fusing a stage into the scan kernel saves HBM traffic but costs registers, and registers set
occupancy: the scan kernel already holds a [chunk_t x N/lanes] tile per thread (~170 registers
for N = 16 on sm_90, 3 programs of 4 warps per SM), so a stage that pushes it past 255 spills
and one that crosses an allocation step loses a program per SM. The decision:

1. Estimate registers per thread of each candidate level from N (the per-thread slice of the
   state), the chunk length (steps each thread walks serially), num_warps, the fused stages and
   the dtypes (``estimate_registers``); scale by what Triton reported for earlier compiles.
2. Turn registers into occupancy with the device's limits (``occupancy``). The yardstick
   "split" is the level-0 scan kernel; the dt level is that kernel with its dt stage, the conv
   levels the fused kernel on the same tiles.
3. A fused level fits only if it saves HBM bytes at all (level 1 saves nothing when x_proj
   also reads the conv output: see ``kernels/fused/triton_fused.py``), does not spill, keeps
   occupancy at >= ``OCCUPANCY_RATIO`` of the split scan kernel's, and, for the conv levels,
   the split kernel does not need its time split (their kernel has none). ``fuse="fused"``
   takes the deepest level that fits. ``fuse="auto"`` takes the deepest that fits among
   ``AUTO_LEVELS``: the levels that won at least one configuration of the H200 sweep
   (``benchmarks/bench_fusion.py``). None has: split was fastest in all 108 configurations of
   runs 10-12 (level 1 took 1.1-7x its time, the dt/level-2 kernels 2-30x with the dt
   projection as an FMA loop) and in all 8 of run 19 (the projection as a tensor-core product:
   dt 1.06-1.9x, level 2 1.5-6.7x), so auto keeps split and says so; the fused levels stay
   available as explicit overrides.
4. On CUDA, first compile each legal level's kernel (a tiny launch: registers depend on the
   constexprs only), read ``n_regs``/``n_spills``, and use those numbers instead of the
   estimate; the ratio actual/estimate per level also corrects later estimates for
   specializations not compiled yet (e.g. a decision made off-GPU in the same process).

Decisions are cached per (shape class, device); ``DecisionRecord.as_dict()`` is what the fuse
pass attaches to ``ctx.rewrite`` so that ``explain`` shows the numbers.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Callable, Optional

import torch

log = logging.getLogger("ssm_compile")

# Levels, shallowest first. "dt" fuses the dt projection alone (conv output read as u): not
# one of the numbered levels, but the combination with the traffic win and no conv.
LEVELS = ("split", "level1", "dt", "level2")
FUSES_CONV = {"split": False, "level1": True, "dt": False, "level2": True}
FUSES_DT = {"split": False, "level1": False, "dt": True, "level2": True}
# User overrides (the backend's ``fuse`` option): "auto" decides among AUTO_LEVELS; "fused"
# takes the deepest legal level that fits the register budget.
OVERRIDES = ("auto", "split", "fused") + LEVELS[1:]
# Levels "auto" may pick: those faster than split in at least one configuration of the H200
# fusion sweep (benchmarks/RESULTS.md, runs 10-12 and 19: none of the fused ones).
AUTO_LEVELS = ("split",)

# A fused level must keep at least this fraction of the split scan kernel's occupancy.
OCCUPANCY_RATIO = 0.75
# Register model coefficients (registers per thread), fitted to ptxas counts of the level-0
# kernel on sm_90 (N = 16, chunk 16: ~170) and corrected at run time by ``record_compiled``.
_BASE_REGS = 32  # pointers, strides, loop state, per-channel scalars
_REGS_PER_TILE_ELEM = 2  # the scan's (a, b) pair per element of the per-thread tile
_MAX_REGS_PER_THREAD = 255


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """What bounds occupancy on one device (defaults: an H200, sm_90)."""

    name: str = "H200 (defaults)"
    sm_count: int = 132
    regs_per_sm: int = 65536
    max_regs_per_thread: int = _MAX_REGS_PER_THREAD
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    reg_alloc_unit: int = 256  # registers are allocated per warp in units of this many


@functools.cache
def device_limits(device: Optional[torch.device] = None) -> DeviceLimits:
    """The limits of ``device`` read from the driver on CUDA; H200 defaults elsewhere."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return DeviceLimits()
    props = torch.cuda.get_device_properties(device)
    # regs_per_multiprocessor / max_threads_per_multi_processor are missing in some torch
    # versions; fall back to the sm_90 values.
    return DeviceLimits(
        name=props.name,
        sm_count=props.multi_processor_count,
        regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
        max_threads_per_sm=getattr(props, "max_threads_per_multi_processor", 2048),
    )


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """The compile-time facts that set a kernel's register count (its constexpr specialization)."""

    level: str
    n_per_thread: int  # next_pow2(N) / lanes_n: the state slice each thread holds
    chunk_t: int  # serial steps per thread per chunk
    num_warps: int
    block_d: int
    width: int  # conv taps W (1 when the conv is not fused)
    dt_fused: bool  # the dt projection runs inside the kernel
    act_bytes: int  # activation dtype size: bf16/fp16 tiles pack two per register
    # Levels without the conv run the level-0 kernel with its own register cap and prefetch
    # depth; the conv levels' kernel has neither (None, 1).
    max_registers: Optional[int] = None
    prefetch: int = 1
    dt_rank_pad: int = 0  # R padded for the tensor-core dt product (0: not fused)


def estimate_registers(ks: KernelShape) -> int:
    """Registers per thread of ``ks`` by the linear model (before any correction).

    Per thread: the scan's tile is chunk_t * n_per_thread elements with two live values each,
    plus the A and carry slices, plus a raw [chunk_t] load in flight (half that for 16-bit).
    The conv keeps an accumulator and two taps in flight ([chunk_t] each, time is per thread)
    plus W weights. The dt projection is a [chunk_t, R] x [R, block_d] tensor-core product
    per chunk: its share of W_dt^T (held for the whole program), of the dt_low tile and of the
    fp32 product, each spread over the program's threads.
    """
    tile = ks.chunk_t * ks.n_per_thread
    regs = _BASE_REGS + _REGS_PER_TILE_ELEM * tile + 2 * ks.n_per_thread
    regs += math.ceil(ks.chunk_t * ks.act_bytes / 4)
    if FUSES_CONV[ks.level]:
        regs += 3 * ks.chunk_t + ks.width
    if ks.dt_fused:
        threads = 32 * ks.num_warps
        packed = ks.dt_rank_pad * ks.act_bytes / 4  # registers per row of R 16/32-bit values
        regs += math.ceil(packed * (ks.block_d + ks.chunk_t) / threads)
        regs += math.ceil(ks.chunk_t * ks.block_d / threads)
    return regs


def occupancy(regs: int, num_warps: int, limits: DeviceLimits) -> float:
    """Fraction of the SM's thread slots filled by programs of ``num_warps`` using ``regs``."""
    regs = min(max(regs, 1), limits.max_regs_per_thread)
    per_warp = math.ceil(math.ceil(regs / 8) * 8 * 32 / limits.reg_alloc_unit) * limits.reg_alloc_unit
    programs = min(limits.regs_per_sm // (per_warp * num_warps),
                   limits.max_threads_per_sm // (32 * num_warps), limits.max_blocks_per_sm)
    return programs * num_warps * 32 / limits.max_threads_per_sm


@dataclasses.dataclass(frozen=True)
class Problem:
    """One call site: what the pass knows about it, all hashable (the cache key's shape class)."""

    batch: int
    dim: int
    L: int
    N: int
    groups: int
    width: int  # conv W (0 if there is no conv in front of the scan)
    dt_rank: int  # R (0 if delta is not W_dt @ dt_low)
    act_dtype: torch.dtype
    delta_dtype: torch.dtype
    conv_has_other_users: bool  # x_proj reads the conv output too (always, in a Mamba block)
    legal: tuple[str, ...]  # levels the pass proved sound here, "split" included
    device: str = "cuda"
    # u/z have unit stride along dim (nn.Linear-based code such as HF's): the level-0 kernel's
    # tiles depend on it (scan_fwd_config's prefetch depth).
    channel_innermost: bool = True

    def shape_class(self) -> tuple:
        # L to its power of two: the tile choice and the time-split decision depend on L only
        # through chunk counts, and recompiling for every length would be wasteful.
        return dataclasses.replace(self, L=1 << max(self.L - 1, 0).bit_length())


@dataclasses.dataclass
class LevelEstimate:
    level: str
    est_regs: int
    actual_regs: Optional[int]
    spills: Optional[int]
    occupancy: float
    saved_bytes: int

    @property
    def regs(self) -> int:
        return self.actual_regs if self.actual_regs is not None else self.est_regs


@dataclasses.dataclass
class DecisionRecord:
    """The heuristic's answer with its numbers (what ``explain`` shows)."""

    level: str
    reason: str
    est_regs: int
    actual_regs: Optional[int]
    occupancy: float
    split_occupancy: float
    saved_bytes: int
    candidates: dict[str, LevelEstimate]
    cached: bool = False

    def as_dict(self) -> dict:
        return {
            "level": self.level, "reason": self.reason, "est_regs": self.est_regs,
            "actual_regs": self.actual_regs, "occupancy": round(self.occupancy, 4),
            "split_occupancy": round(self.split_occupancy, 4), "saved_bytes": self.saved_bytes,
            "cached": self.cached,
            # One readable string, since explain prints the decision as key=value pairs.
            "candidates": "; ".join(
                f"{e.level}: {e.est_regs} est/{e.actual_regs} actual regs, occ {e.occupancy:.3f}, "
                f"saves {e.saved_bytes} B" for e in self.candidates.values()),
        }


# (device name, KernelShape) -> (n_regs, n_spills) that Triton reported.
_COMPILED: dict[tuple, tuple[int, int]] = {}
# (device name, level) -> actual / estimated registers, from the latest compile of that level.
_CORRECTION: dict[tuple, float] = {}
# (device name, shape class, override) -> DecisionRecord
_DECISIONS: dict[tuple, DecisionRecord] = {}


def clear_cache() -> None:
    """Forget compiled-kernel facts, corrections and decisions (tests use it)."""
    _COMPILED.clear()
    _CORRECTION.clear()
    _DECISIONS.clear()


def record_compiled(limits: DeviceLimits, ks: KernelShape, n_regs: int, n_spills: int) -> None:
    """Store what Triton reported for ``ks`` and the correction for its level."""
    _COMPILED[(limits.name, ks)] = (int(n_regs), int(n_spills))
    _CORRECTION[(limits.name, ks.level)] = n_regs / max(estimate_registers(ks), 1)
    log.info("ssm heuristic: %s compiled to %d registers (%d spilled), estimated %d",
             ks.level, n_regs, n_spills, estimate_registers(ks))


def compiled_stats(compiled: object) -> Optional[tuple[int, int]]:
    """``(n_regs, n_spills)`` of a Triton compiled kernel, or None if it has none (interpreter).

    The handles (and with them n_regs/n_spills) are loaded lazily by some Triton versions; the
    attribute names are the same in triton 3.6 and 3.9 but guarded all the same.
    """
    if compiled is None:
        return None
    init = getattr(compiled, "_init_handles", None)
    if callable(init):
        init()
    n_regs, n_spills = getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
    if not isinstance(n_regs, int) or n_regs <= 0:
        return None
    return n_regs, int(n_spills or 0)


def kernel_shape(problem: Problem, level: str, limits: DeviceLimits) -> KernelShape:
    """The constexpr specialization the launcher would compile for ``level`` at ``problem``:
    the conv levels' kernel (``fused_config``'s tiles) or, for split and dt, the level-0 scan
    kernel (``scan_fwd_config``'s, with its register cap and prefetch depth)."""
    from ssm_compile.kernels.fused.triton_fused import fused_config
    from ssm_compile.kernels.selective_scan.triton_fwd import _next_pow2, scan_fwd_config

    act_bytes = torch.empty((), dtype=problem.act_dtype).element_size()
    if FUSES_CONV[level]:
        cfg = fused_config(problem.batch, problem.dim, problem.L, problem.N,
                           problem.dim // problem.groups, limits.sm_count)
    else:
        cfg = scan_fwd_config(problem.batch, problem.dim, problem.L, problem.N,
                              problem.dim // problem.groups, limits.sm_count,
                              problem.channel_innermost, act_bytes == 2)
    block_n = _next_pow2(problem.N)
    return KernelShape(
        level=level, n_per_thread=max(1, block_n // cfg.lanes_n), chunk_t=cfg.chunk_t,
        num_warps=cfg.num_warps, block_d=cfg.block_d,
        width=problem.width if FUSES_CONV[level] else 1,
        dt_fused=FUSES_DT[level],
        act_bytes=act_bytes,
        max_registers=cfg.max_registers, prefetch=cfg.prefetch,
        dt_rank_pad=max(16, _next_pow2(problem.dt_rank)) if FUSES_DT[level] else 0,
    )


def saved_bytes(problem: Problem, level: str) -> int:
    """HBM bytes a level saves over split for one call (the model of triton_fused.py)."""
    elems = problem.batch * problem.dim * problem.L
    act = torch.empty((), dtype=problem.act_dtype).element_size()
    delta = torch.empty((), dtype=problem.delta_dtype).element_size()
    saved = 0
    if FUSES_CONV[level] and not problem.conv_has_other_users:
        saved += 2 * elems * act  # u is neither written by the conv nor read by the scan
    if FUSES_DT[level]:
        saved += 2 * elems * delta  # delta is neither written by dt_proj nor read by the scan
    return saved


def _estimate(problem: Problem, level: str, limits: DeviceLimits) -> LevelEstimate:
    ks = kernel_shape(problem, level, limits)
    est = estimate_registers(ks)
    compiled = _COMPILED.get((limits.name, ks))
    if compiled is None:
        est = round(est * _CORRECTION.get((limits.name, level), 1.0))
    actual, spills = compiled if compiled is not None else (None, None)
    regs = actual if actual is not None else est
    return LevelEstimate(level, est, actual, spills, occupancy(regs, ks.num_warps, limits),
                         saved_bytes(problem, level))


def _time_split(problem: Problem, limits: DeviceLimits) -> int:
    from ssm_compile.kernels.selective_scan.triton_fwd import scan_fwd_config

    return scan_fwd_config(problem.batch, problem.dim, problem.L, problem.N,
                           problem.dim // problem.groups, limits.sm_count).n_segments


def _rejection(est: LevelEstimate, split: LevelEstimate, limits: DeviceLimits) -> Optional[str]:
    if est.saved_bytes <= 0:
        return "saves no HBM traffic (the conv output is still written for x_proj)"
    if (est.spills or 0) > 0 or est.regs > limits.max_regs_per_thread:
        return f"spills ({est.regs} registers > {limits.max_regs_per_thread})"
    if est.occupancy < OCCUPANCY_RATIO * split.occupancy:
        return (f"occupancy {est.occupancy:.3f} < {OCCUPANCY_RATIO} x split's "
                f"{split.occupancy:.3f}")
    return None


def _choose(problem: Problem, override: str, limits: DeviceLimits) -> DecisionRecord:
    legal = [lv for lv in LEVELS if lv in problem.legal]
    ests = {lv: _estimate(problem, lv, limits) for lv in legal}
    split = ests["split"]

    def record(level: str, reason: str) -> DecisionRecord:
        e = ests[level]
        return DecisionRecord(level, reason, e.est_regs, e.actual_regs, e.occupancy,
                              split.occupancy, e.saved_bytes, ests)

    if override == "split":
        return record("split", "user override fuse='split'")
    if override in LEVELS:
        if override in ests:
            return record(override, f"user override fuse={override!r}")
        return record("split", f"user override fuse={override!r} is not legal here "
                               f"(legal: {legal}); kept split")
    if override == "auto" and problem.device != "cuda":
        return record("split", f"on {problem.device} the fused op runs the split ops' own code: "
                               "fusing gains nothing there")
    prefix = "fuse='fused': " if override == "fused" else ""
    candidates = legal[1:] if override == "fused" else [lv for lv in legal[1:] if lv in AUTO_LEVELS]
    if not candidates:
        return record("split", f"no fused level is legal here (legal: {legal})" if len(legal) == 1 else
                      f"auto keeps split: no fused level ({', '.join(legal[1:])}) beat it in any "
                      "configuration of the H200 fusion sweep; fuse='fused' forces the deepest that fits")
    reasons = []
    segments = _time_split(problem, limits)
    if segments > 1 and any(FUSES_CONV[lv] for lv in candidates):
        # The conv levels' kernel walks all of L in one program; the dt level is the level-0
        # kernel and splits L as split does.
        reasons.append(f"{'/'.join(lv for lv in candidates if FUSES_CONV[lv])}: the split scan splits "
                       f"L into {segments} segments to fill {limits.sm_count} SMs; the conv levels' "
                       "kernel cannot")
        candidates = [lv for lv in candidates if not FUSES_CONV[lv]]
    for level in reversed(candidates):
        why = _rejection(ests[level], split, limits)
        if why is None:
            passed_over = f" (passed over: {'; '.join(reasons)})" if reasons else ""
            return record(level, f"{prefix}saves {ests[level].saved_bytes} B at occupancy "
                                 f"{ests[level].occupancy:.3f} (split {split.occupancy:.3f})"
                                 + passed_over)
        reasons.append(f"{level}: {why}")
    return record("split", prefix + "; ".join(reasons))


CompileFn = Callable[[Problem, str, KernelShape], Optional[tuple[int, int]]]


def decide(problem: Problem, override: str = "auto", *,
           device: Optional[torch.device] = None,
           compile_fn: Optional[CompileFn] = None) -> DecisionRecord:
    """Choose the fusion level for ``problem`` (cached per shape class, device and override).

    Args:
        problem: the call site's facts (from the fuse pass).
        override: the backend's ``fuse`` option, one of ``OVERRIDES``.
        device: the device the graph runs on; its limits come from the driver on CUDA.
        compile_fn: compiles a level's kernel and returns Triton's ``(n_regs, n_spills)``
            (None when it cannot tell); defaults to ``compile_and_measure`` on CUDA and to
            nothing elsewhere (the estimate stands).
    Returns:
        a ``DecisionRecord`` (``cached=True`` when it came from the cache).
    """
    if override not in OVERRIDES:
        raise ValueError(f"fuse must be one of {OVERRIDES}, got {override!r}")
    if "split" not in problem.legal:
        raise ValueError(f"problem.legal must contain 'split', got {problem.legal}")
    limits = device_limits(device)
    key = (limits.name, problem.shape_class(), override)
    if key in _DECISIONS:
        return dataclasses.replace(_DECISIONS[key], cached=True)
    if compile_fn is None and device is not None and device.type == "cuda":
        compile_fn = compile_and_measure
    if compile_fn is not None:
        # Check the model against the compiler for every level the decision can take (the
        # estimate alone could reject a level that actually fits): each specialization
        # compiles once per process, and registers depend on the constexprs only, so a tiny
        # launch is enough. Under auto that is split and AUTO_LEVELS: compiling a probe of a
        # level auto cannot pick would cost compile time for a number nobody uses.
        probed = [lv for lv in problem.legal if override != "auto" or lv == "split" or lv in AUTO_LEVELS]
        for level in probed:
            ks = kernel_shape(problem, level, limits)
            if (limits.name, ks) not in _COMPILED:
                stats = compile_fn(problem, level, ks)
                if stats is not None:
                    record_compiled(limits, ks, *stats)
    decision = _choose(problem, override, limits)
    _DECISIONS[key] = decision
    return decision


def compile_and_measure(problem: Problem, level: str, ks: KernelShape) -> Optional[tuple[int, int]]:
    """Compile ``level``'s kernel for ``problem``'s specialization on the current CUDA device by
    launching it once on a tiny problem (registers depend on the constexprs only, not on sizes),
    and return Triton's ``(n_regs, n_spills)``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # The fuse pass calls this while dynamo compiles; the probe needs real tensors and no grad.
    with unset_fake_temporarily(), torch.no_grad():
        return _probe_launch(problem, level, ks)


def _probe_launch(problem: Problem, level: str, ks: KernelShape) -> Optional[tuple[int, int]]:
    from ssm_compile.kernels.fused.triton_fused import fused_scan_fwd
    from ssm_compile.kernels.selective_scan.triton_fwd import (ScanFwdConfig, _next_pow2,
                                                               selective_scan_fwd_launch)

    dev = torch.device("cuda")
    dtype = problem.act_dtype
    g = problem.groups
    # Sizes are multiples of 16 like the real ones: Triton specializes integers on that.
    dim = 16 * ks.block_d * g
    L = 16 * ks.chunk_t
    R = max(problem.dt_rank, 1)
    rand = functools.partial(torch.randn, device=dev)
    # HF's layouts (Triton specializes on unit strides): x, z are channels-last halves of the
    # in_proj output; dt_low, B, C are views of the x_proj output.
    x, z = rand(1, L, 2 * dim, dtype=dtype).transpose(1, 2).chunk(2, dim=1)
    x_dbl = rand(1, L, R + 2 * problem.N, dtype=dtype)
    dt_low, B, C = (t.transpose(1, 2) for t in torch.split(x_dbl, [R, problem.N, problem.N], dim=-1))
    B, C = B.unsqueeze(1).expand(1, g, -1, -1), C.unsqueeze(1).expand(1, g, -1, -1)
    conv_w = rand(dim, ks.width, dtype=dtype) if FUSES_CONV[level] else None
    conv_b = rand(dim, dtype=dtype) if FUSES_CONV[level] else None
    dt_w = rand(dim, R, dtype=problem.delta_dtype) if FUSES_DT[level] else None
    # Split's delta is dt_proj's output: channels-last like x.
    delta = (dt_low.to(problem.delta_dtype) if dt_w is not None
             else rand(1, L, dim, dtype=problem.delta_dtype).transpose(1, 2))
    cfg = ScanFwdConfig(ks.block_d, ks.chunk_t, _next_pow2(problem.N) // ks.n_per_thread,
                        ks.num_warps, 1, ks.max_registers, ks.prefetch)
    A = -torch.rand(dim, problem.N, device=dev)
    if not FUSES_CONV[level]:
        # Split and dt run the level-0 kernel: probe that kernel, not the conv levels' one.
        _, _, compiled = selective_scan_fwd_launch(x, delta, A, B, C, rand(dim), z, rand(dim), True, None,
                                                   False, dt_weight=dt_w, config=cfg)
        return compiled_stats(compiled)
    launch = fused_scan_fwd(x, delta, A, B, C, rand(dim), z, rand(dim), True, conv_w, conv_b, True, dt_w,
                            config=cfg)
    return compiled_stats(launch.compiled)
