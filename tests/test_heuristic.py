"""The fusion heuristic: register model, occupancy, the decision rule, overrides, correction, cache."""
import dataclasses

import pytest
import torch

from ssm_compile import heuristic as h

ALL = ("split", "level1", "dt", "level2")
H200 = h.DeviceLimits()


@pytest.fixture(autouse=True)
def fresh():
    h.clear_cache()
    yield
    h.clear_cache()


def problem(**kw):
    base = dict(batch=8, dim=1536, L=2048, N=16, groups=1, width=4, dt_rank=96,
                act_dtype=torch.bfloat16, delta_dtype=torch.bfloat16, conv_has_other_users=True,
                legal=ALL, device="cuda")
    base.update(kw)
    return h.Problem(**base)


def shape(level="split", n_per_thread=4, chunk_t=16, num_warps=4, width=4, act_bytes=2):
    return h.KernelShape(level, n_per_thread, chunk_t, num_warps, 32, width, h.FUSES_DT[level],
                         act_bytes, dt_rank_pad=64 if h.FUSES_DT[level] else 0)


class FakeCompiler:
    """Stands in for Triton: reports fixed register counts per level and counts compiles."""

    def __init__(self, regs, spills=None):
        self.regs, self.spills, self.calls = regs, spills or {}, []

    def __call__(self, prob, level, ks):
        self.calls.append(level)
        return self.regs[level], self.spills.get(level, 0)


@pytest.mark.parametrize("level", ALL)
def test_estimate_is_monotonic_in_state_slice_and_chunk(level):
    by_n = [h.estimate_registers(shape(level, n_per_thread=n)) for n in (1, 2, 4, 8, 16)]
    by_t = [h.estimate_registers(shape(level, chunk_t=t)) for t in (2, 4, 8, 16, 32)]
    assert by_n == sorted(by_n) and len(set(by_n)) == len(by_n)
    assert by_t == sorted(by_t) and len(set(by_t)) == len(by_t)


def test_estimate_grows_with_fused_stages_and_wider_dtypes():
    regs = {lv: h.estimate_registers(shape(lv)) for lv in ALL}
    assert regs["split"] < regs["level1"] < regs["level2"]
    assert regs["split"] < regs["dt"] < regs["level2"]
    assert h.estimate_registers(shape(act_bytes=4)) > h.estimate_registers(shape(act_bytes=2))


def test_decision_registers_grow_with_N_while_the_launcher_keeps_4_lanes():
    # N = 2 .. 16 keep lanes_n <= 4, so every doubling of N lands in each thread's tile (or
    # doubles chunk_t). From N = 32 on the launcher spreads N over more lanes and shrinks the
    # chunk, so the per-thread tile (and the estimate) is flat again: monotonic per tile only.
    # (Level 1: the dt stage's share of its operands also varies with the channel block, which
    # the launcher narrows as lanes_n grows.)
    ests = [h.decide(problem(N=n), "level1").est_regs for n in (2, 4, 8, 16)]
    assert ests == sorted(ests) and len(set(ests)) == len(ests)
    flat = {h.decide(problem(N=n), "level1").est_regs for n in (32, 64, 128)}
    assert len(flat) == 1 and flat.pop() < ests[-1]


@pytest.mark.parametrize("regs, warps, expected", [
    (64, 4, 0.5), (128, 4, 0.25), (168, 4, 0.1875), (170, 4, 0.125), (255, 4, 0.125),
    (32, 4, 1.0), (168, 8, 0.125),
], ids=lambda v: str(v))
def test_occupancy_against_hand_computed_values(regs, warps, expected):
    # 168 registers: 5376 per warp, 3 programs of 4 warps in 65536; 170 rounds to 176: only 2.
    assert h.occupancy(regs, warps, H200) == expected


def test_occupancy_is_monotonic_in_registers():
    occ = [h.occupancy(r, 4, H200) for r in range(16, 256, 8)]
    assert occ == sorted(occ, reverse=True)


def test_falls_back_to_split_when_fused_levels_spill():
    fake = FakeCompiler({"split": 120, "level1": 180, "dt": 250, "level2": 255},
                        spills={"dt": 40, "level2": 96})
    d = h.decide(problem(), "fused", compile_fn=fake)
    assert d.level == "split"
    assert "spills" in d.reason
    assert d.candidates["level2"].actual_regs == 255 and d.candidates["level2"].spills == 96


def test_falls_back_when_occupancy_collapses():
    # The seed's case: fusing takes ~40 -> ~90 registers and occupancy from 50% to 25%.
    fake = FakeCompiler({"split": 40, "level1": 60, "dt": 90, "level2": 90})
    d = h.decide(problem(), "fused", compile_fn=fake)
    assert d.level == "split" and "occupancy" in d.reason
    # 40 registers: 12 programs of 4 warps (75%); 90 -> 96: 5 programs (31%) < 0.75 x 75%.
    assert d.split_occupancy == 0.75 and d.candidates["dt"].occupancy == 0.3125


def test_fused_picks_the_deepest_level_that_pays_and_fits():
    fake = FakeCompiler({"split": 120, "level1": 124, "dt": 126, "level2": 126})
    d = h.decide(problem(), "fused", compile_fn=fake)
    assert d.level == "level2" and "fuse='fused'" in d.reason
    assert d.actual_regs == 126 and d.saved_bytes > 0
    # Level 1 alone never pays while x_proj reads the conv output...
    d1 = h.decide(problem(legal=("split", "level1")), "fused", compile_fn=fake)
    assert d1.level == "split" and "saves no HBM traffic" in d1.reason
    # ...and does when nothing else does.
    d2 = h.decide(problem(legal=("split", "level1"), conv_has_other_users=False), "fused", compile_fn=fake)
    assert d2.level == "level1"


def test_auto_keeps_split_where_the_sweep_found_no_fused_level_faster():
    # The same fits as above: "fused" would take level 2, but no fused level is in AUTO_LEVELS
    # (none beat split on the H200), and auto says so instead of trusting saved bytes.
    assert h.AUTO_LEVELS == ("split",)
    fake = FakeCompiler({"split": 120, "level1": 124, "dt": 126, "level2": 126})
    d = h.decide(problem(), compile_fn=fake)
    assert d.level == "split" and "beat it" in d.reason and "level2" in d.reason
    # Only split's kernel is compiled to read its registers; the others keep their estimates,
    # which explain still shows.
    assert fake.calls == ["split"] and d.actual_regs == 120
    assert d.candidates["level2"].actual_regs is None and d.candidates["level2"].est_regs > 0


def test_auto_takes_a_level_once_it_is_in_auto_levels(monkeypatch):
    # The rule itself, for when a fused kernel does win: fits and pays -> picked; spills -> not.
    monkeypatch.setattr(h, "AUTO_LEVELS", ("split", "dt"))
    d = h.decide(problem(), compile_fn=FakeCompiler({"split": 120, "level1": 124, "dt": 126, "level2": 126}))
    assert d.level == "dt" and "saves" in d.reason
    h.clear_cache()
    d = h.decide(problem(), compile_fn=FakeCompiler({"split": 120, "level1": 124, "dt": 250, "level2": 255},
                                                    spills={"dt": 40}))
    assert d.level == "split" and "dt: spills" in d.reason


def test_conv_levels_step_aside_when_the_split_kernel_needs_its_time_split():
    # The conv levels' kernel walks all of L in one program; the dt level is the level-0 kernel
    # and splits L like split does, so it stays a candidate.
    d = h.decide(problem(batch=1, dim=256, L=8192), "fused", compile_fn=FakeCompiler(dict.fromkeys(ALL, 64)))
    assert d.level == "dt" and "segments" in d.reason and "level1/level2" in d.reason
    h.clear_cache()
    no_dt = problem(batch=1, dim=256, L=8192, legal=("split", "level1"))
    d = h.decide(no_dt, "fused", compile_fn=FakeCompiler(dict.fromkeys(ALL, 64)))
    assert d.level == "split" and "segments" in d.reason


def test_compiled_registers_correct_the_estimate_for_other_shapes():
    fake = FakeCompiler({"split": 100, "level1": 120, "dt": 130, "level2": 150})
    h.decide(problem(), "level2", compile_fn=fake)
    other = problem(N=64)  # another tile, so another specialization
    assert h.kernel_shape(other, "level2", H200) != h.kernel_shape(problem(), "level2", H200)
    est_raw = h.estimate_registers(h.kernel_shape(other, "level2", H200))
    ratio = 150 / h.estimate_registers(h.kernel_shape(problem(), "level2", H200))
    d = h.decide(other, "level2")  # no compiler: the corrected estimate stands
    assert d.actual_regs is None
    assert d.est_regs == round(est_raw * ratio)


@pytest.mark.parametrize("override, expected", [
    ("split", "split"), ("level1", "level1"), ("dt", "dt"), ("level2", "level2"),
])
def test_override_is_honoured(override, expected):
    d = h.decide(problem(), override)
    assert d.level == expected and "override" in d.reason


def test_override_of_an_illegal_level_keeps_split():
    d = h.decide(problem(legal=("split", "level1")), "level2")
    assert d.level == "split" and "not legal" in d.reason


def test_bad_override_raises():
    with pytest.raises(ValueError, match="fuse must be one of"):
        h.decide(problem(), "everything")


def test_decisions_are_cached_per_shape_class_and_device():
    fake = FakeCompiler({"split": 120, "level1": 124, "dt": 126, "level2": 126})
    first = h.decide(problem(L=2000), compile_fn=fake)
    compiles = len(fake.calls)
    again = h.decide(problem(L=2048), compile_fn=fake)  # same power-of-two class
    assert not first.cached and again.cached and again.level == first.level
    assert len(fake.calls) == compiles
    other_device = h.decide(problem(L=2048), "auto", compile_fn=fake, device=torch.device("cpu"))
    assert other_device.cached  # CPU uses the H200 defaults: the same "device"
    assert not h.decide(problem(L=4096), compile_fn=fake).cached


def test_decision_record_as_dict_has_the_numbers_explain_shows():
    d = h.decide(problem(), "level2").as_dict()
    for key in ("level", "reason", "est_regs", "actual_regs", "occupancy", "split_occupancy",
                "saved_bytes", "candidates"):
        assert key in d
    assert all(f"{lv}: " in d["candidates"] for lv in ALL)


def test_device_limits_default_to_h200_off_cuda():
    lim = h.device_limits(torch.device("cpu"))
    assert dataclasses.asdict(lim) == dataclasses.asdict(H200)
    assert lim.sm_count == 132 and lim.regs_per_sm == 65536 and lim.max_regs_per_thread == 255


def test_compiled_stats_reads_triton_metadata_and_tolerates_missing_fields():
    class Compiled:
        n_regs, n_spills = 168, 0

        def __init__(self):
            self.inited = False

        def _init_handles(self):
            self.inited = True

    c = Compiled()
    assert h.compiled_stats(c) == (168, 0) and c.inited
    assert h.compiled_stats(None) is None
    assert h.compiled_stats(object()) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to compile the kernel")
def test_compile_and_measure_on_gpu():
    d = h.decide(problem(), "level2", device=torch.device("cuda"))
    assert d.actual_regs is not None and 0 < d.actual_regs <= 255
