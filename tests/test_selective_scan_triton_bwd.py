"""The Triton selective-scan backward against fp64 autograd through the reference.

On a CPU-only machine the kernels run under TRITON_INTERPRET=1 (set by conftest.py), so the
shapes are small; a small ``chunk_size`` makes short sequences cross several chunks.
"""
import dataclasses
from typing import Optional

import pytest
import torch
import triton
import triton.language as tl
from utils import TOL, rel_err

from ssm_compile.kernels.selective_scan.reference import selective_scan_ref
from ssm_compile.kernels.selective_scan.triton_bwd import _pick_row, _state_pass, selective_scan_bwd
from ssm_compile.kernels.triton_common import neg_zero

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Input name -> ScanGrads field.
GRAD_NAMES = {
    "u": "du", "delta": "ddelta", "A": "dA", "B": "dB", "C": "dC", "D": "dD", "z": "dz",
    "delta_bias": "ddelta_bias", "initial_state": "dinitial_state",
}


@dataclasses.dataclass
class Case:
    batch: int = 2
    dim: int = 6
    L: int = 40
    N: int = 4
    G: int = 1
    dtype: torch.dtype = torch.float32
    has_D: bool = True
    has_z: bool = True
    has_bias: bool = True
    softplus: bool = True
    has_init: bool = True
    has_dlast: bool = True
    chunk_size: Optional[int] = 16
    num_splits: Optional[int] = None
    block_d: Optional[int] = None
    num_warps: Optional[int] = None
    # Chunk-kernel loop order ("column" here; "nblock", the launcher's choice for N > 16 on large
    # grids, and "serial", its choice for N <= 16, have their own cases), its state columns per
    # block and channels per pass. None leaves it to the launcher.
    variant: Optional[str] = "column"
    nb: Optional[int] = None
    group_d: Optional[int] = None
    steps: Optional[int] = None  # "serial": consecutive steps per thread
    prefetch: Optional[int] = None  # "nblock": next channel's rows into 0 none, 1 L1, 2 L2 (GPU only)
    stage: Optional[bool] = None  # "serial": run on L-major copies of channel-innermost activations
    max_registers: Optional[int] = None  # "serial": ptxas's register cap (GPU only; spills, same values)
    # Scale of the raw delta: large values test softplus past its threshold and decays that
    # underflow to exactly 0.
    delta_scale: float = 1.0

    def id(self) -> str:
        dt = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]
        flags = "".join(
            name for name, on in (("D", self.has_D), ("z", self.has_z), ("b", self.has_bias),
                                  ("sp", self.softplus), ("h0", self.has_init), ("dl", self.has_dlast)) if on
        )
        extra = "".join(
            f"-{k}{v}" for k, v in (("T", self.chunk_size), ("S", self.num_splits), ("BD", self.block_d),
                                    ("W", self.num_warps), ("", self.variant), ("NB", self.nb),
                                    ("GD", self.group_d), ("ST", self.steps), ("PF", self.prefetch),
                                    ("stage", self.stage), ("R", self.max_registers), ("x", self.delta_scale))
            if v not in (None, 1.0)
        )
        return f"B{self.batch}-D{self.dim}-L{self.L}-N{self.N}-G{self.G}-{dt}-{flags or 'bare'}{extra}"


def make_inputs(case: Case, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, dtype=case.dtype, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(dtype).to(DEVICE)

    b, d, L, N, G = case.batch, case.dim, case.L, case.N, case.G
    # Without softplus, delta is used raw: keep it positive as real step sizes are.
    delta_shift = -0.5 if case.softplus else 0.6
    inputs = dict(
        u=rand(b, d, L),
        delta=rand(b, d, L, scale=0.3 * case.delta_scale, shift=delta_shift * case.delta_scale),
        A=-torch.rand(d, N, generator=g).mul(3.0).add(0.2).to(DEVICE),
        B=rand(b, G, N, L),
        C=rand(b, G, N, L),
        D=rand(d, dtype=torch.float32) if case.has_D else None,
        z=rand(b, d, L) if case.has_z else None,
        delta_bias=rand(d, dtype=torch.float32, scale=0.2) if case.has_bias else None,
        initial_state=rand(b, d, N, dtype=torch.float32) if case.has_init else None,
    )
    dy = rand(b, d, L)
    dlast = rand(b, d, N, dtype=torch.float32) if case.has_dlast else None
    return inputs, dy, dlast


def reference_grads(case: Case, inputs, dy, dlast):
    leaves = {k: v.detach().double().requires_grad_() for k, v in inputs.items() if v is not None}
    y, last = selective_scan_ref(
        **{k: leaves.get(k) for k in inputs}, delta_softplus=case.softplus, return_last_state=True
    )
    loss = (y * dy.double()).sum()
    if dlast is not None:
        loss = loss + (last * dlast.double()).sum()
    loss.backward()
    return {k: v.grad for k, v in leaves.items()}


def run_bwd(case: Case, inputs, dy, dlast):
    return selective_scan_bwd(
        dy, dlast, inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"], inputs["D"],
        inputs["z"], inputs["delta_bias"], case.softplus, inputs["initial_state"],
        tiles=dict(chunk=case.chunk_size, num_splits=case.num_splits, block_d=case.block_d,
                   num_warps=case.num_warps, variant=case.variant, nb=case.nb, group_d=case.group_d,
                   steps=case.steps, prefetch=case.prefetch, stage=case.stage, max_registers=case.max_registers),
    )


CASES = [
    Case(),  # 40 steps = two full chunks of 16 and a ragged one
    Case(L=1),
    Case(L=37, G=2, num_splits=2),  # prime L, grouped B/C, two channel slices per group
    Case(dim=12, G=3, L=23, num_splits=3, block_d=1),
    Case(has_D=False, has_z=False, has_bias=False, softplus=False, has_init=False, has_dlast=False),
    Case(has_z=False, has_init=False),
    Case(has_D=False, has_bias=False, has_dlast=False),
    Case(softplus=False, has_z=False, has_dlast=True, has_init=False),
    Case(dim=5, N=5, L=29),  # N and dim that fill no power-of-two block
    # The chunk-state kernel's wide-N tiles (the forward's): 16 lanes along N; 32 lanes and 4
    # steps per thread.
    Case(dim=2, N=64, L=20),
    Case(batch=1, dim=2, N=256, L=5),  # one batch row: the other cases cover the batch offsets
    Case(L=70, chunk_size=None),  # the default chunk length, one ragged chunk
    # Default tiles (one channel per step, chunk 128) across a chunk boundary, in 3 slices.
    Case(dim=3, L=200, chunk_size=None, num_splits=3),
    # Wide multi-warp tiles, as the benchmark's sweep tries: sums over channels inside a program.
    Case(dim=8, L=40, block_d=4, num_warps=2),
    Case(L=33, delta_scale=30.0),  # softplus past 20; exp(delta*A) underflows to 0
    Case(dtype=torch.bfloat16),
    Case(dtype=torch.float16, L=37, G=2),
]


def nblock(**kw) -> Case:
    return Case(variant="nblock", **kw)


# The "nblock" chunk kernel: state columns in blocks of nb outside the channel loop, dB/dC summed
# over channels in registers, sums over columns carried between blocks in fp32 rows (du/ddelta/dz
# themselves in fp32, rows of their own in bf16/fp16).
NBLOCK_CASES = [
    nblock(nb=2),  # two column blocks (one carry), two full chunks and a ragged one
    nblock(nb=4),  # one block: nothing carried
    nblock(L=1, nb=2),
    # Grouped B/C, 2 slices per group, 2 channels per pass (dB/dC rows added to across passes),
    # 5 columns in blocks of 2 (a ragged last block), prime L.
    nblock(dim=8, G=2, N=5, L=23, nb=2, num_splits=2, group_d=2),
    nblock(has_D=False, has_z=False, has_bias=False, softplus=False, has_init=False, has_dlast=False, nb=2),
    nblock(has_z=False, has_init=False, nb=2, group_d=1),
    nblock(softplus=False, has_D=False, has_bias=False, has_init=False, N=8, nb=4),
    nblock(L=33, delta_scale=30.0, nb=2),  # softplus past 20; decays underflow to 0
    nblock(dtype=torch.bfloat16, nb=2),
    nblock(dtype=torch.float16, has_z=False, G=2, L=37, nb=2, group_d=2),
    # The default chunk (128) across a chunk boundary, default nb and group_d, 3 slices.
    nblock(dim=3, L=200, chunk_size=None, num_splits=3),
    # Several warps per program (on a GPU: the column block spans warps, sums over it cross them).
    nblock(N=8, nb=8, num_warps=2),
    # The prefetch levels (by default 1, L1, for fp32 and 0 otherwise; every other nblock case
    # here runs the default), with groups, column blocks and a ragged tail, so
    # that the clamped prefetch addresses wrap to the group's first channel and the next group's
    # (on a GPU; the interpreter never prefetches).
    nblock(dim=8, G=2, N=5, L=23, nb=2, num_splits=1, group_d=2, prefetch=2),
    nblock(dim=8, G=2, N=5, L=23, nb=2, num_splits=1, group_d=2, prefetch=0),
]


def serial(**kw) -> Case:
    kw.setdefault("dim", 8)
    return Case(variant="serial", **kw)


WIDE_BF16 = serial(batch=1, dim=48, N=16, L=40, block_d=16, num_warps=2, num_splits=1, dtype=torch.bfloat16,
                   chunk_size=32)


# The "serial" chunk kernel: time inside each thread, sub-chunks of `steps`, a forward walk to
# their entry states, then a backward walk; a program walks the channel blocks of its slice of
# a group's channels.
SERIAL_CASES = [
    serial(),  # chunks of 16 = 4 sub-chunks of 4; two full chunks and a ragged one
    serial(N=16, chunk_size=None),  # the default chunk (64): one chunk, a ragged last sub-chunk
    serial(L=1),
    # Grouped B/C (2 blocks of 4 channels per group), N that fills no power of two, prime L, a
    # chunk of 2 sub-chunks.
    serial(dim=32, G=2, N=5, L=23, chunk_size=8, block_d=8),
    serial(dim=48, G=2, L=19),  # 24 channels per group: 3 blocks of 8
    # Slices of several blocks, each adding its dB/dC sums to the slice's partial: 3 blocks in
    # slices of 2 and 1; 8 blocks in one slice; 3 blocks of 16 channels on two warps, bf16, a
    # full chunk and a ragged one, in one batch row (the interpreter took 80 s of CI's time for
    # it at batch 2; 64 channels and L=70 took 120 s for nothing more).
    serial(dim=48, G=2, L=19, num_splits=2),
    serial(dim=64, L=24, block_d=8, num_splits=1),
    WIDE_BF16,
    serial(has_D=False, has_z=False, has_bias=False, softplus=False, has_init=False, has_dlast=False),
    serial(has_z=False, has_init=False),
    serial(softplus=False, has_D=False, has_bias=False, has_init=False, N=8),
    serial(L=33, delta_scale=30.0),  # softplus past 20; decays underflow to 0
    serial(dtype=torch.bfloat16),
    serial(dim=12, G=3, dtype=torch.float16, has_z=False, L=37),  # 4 channels per group
    serial(dim=40, G=2, L=21, block_d=8, num_splits=2),  # 20 channels a group: a ragged last block
    serial(L=70, steps=8, chunk_size=64, N=16),  # 8 steps per thread
    # Under a register cap ptxas spills (run 29 measured it slower at every cap); the values
    # must not change.
    serial(L=70, steps=8, chunk_size=64, N=16, max_registers=168),
    # Several warps per program (on a GPU: the sums over channels cross warps).
    serial(dim=32, N=16, L=24, num_warps=2),
]


@pytest.mark.parametrize("case", CASES + NBLOCK_CASES + SERIAL_CASES, ids=Case.id)
def test_grads_match_fp64_reference(case):
    inputs, dy, dlast = make_inputs(case)
    ref = reference_grads(case, inputs, dy, dlast)
    grads = run_bwd(case, inputs, dy, dlast)
    for name, grad_name in GRAD_NAMES.items():
        out = getattr(grads, grad_name)
        if inputs[name] is None:
            assert out is None, f"{grad_name} should be None when {name} is None"
            continue
        assert out.shape == inputs[name].shape, grad_name
        # Gradients keep their input's dtype; the state gradient is fp32 like the state.
        assert out.dtype == inputs[name].dtype, grad_name
        # fp32 parameters (A, D, delta_bias, initial_state) are accumulated and returned in fp32.
        tol = TOL[case.dtype] if inputs[name].dtype == case.dtype else TOL[torch.float32]
        assert rel_err(out, ref[name]) < tol, f"{grad_name}: rel err {rel_err(out, ref[name]):.2e}"


@pytest.mark.parametrize(
    "batch, dim, L, G, sms",
    [(8, 1536, 2048, 1, 132), (1, 1536, 2048, 1, 132), (8, 1536, 8192, 1, 132), (2, 24, 40, 3, 132), (1, 5, 3, 1, 1)],
    ids=["B8-D1536-L2048-H200", "B1-D1536-L2048-H200", "B8-D1536-L8192-H200", "B2-D24-L40-G3-H200", "B1-D5-L3-cpu"],
)
def test_choose_tiles_fills_the_gpu_and_covers_every_channel(batch, dim, L, G, sms, monkeypatch):
    from ssm_compile.kernels.selective_scan import triton_bwd

    monkeypatch.setattr(triton_bwd, "_num_sms", lambda device: sms)
    tiles = triton_bwd.choose_tiles(batch, dim, L, 16, G, torch.device("cpu"))
    dim_per_group = dim // G
    per_split = -(-dim_per_group // tiles.num_splits)
    per_split = -(-per_split // tiles.block_d) * tiles.block_d
    # The slices tile the group's channels exactly: none is empty, none is missed.
    assert (tiles.num_splits - 1) * per_split < dim_per_group <= tiles.num_splits * per_split
    # ("serial" runs chunks of 8 steps where L is that short.)
    assert tiles.chunk & (tiles.chunk - 1) == 0 and min(16, max(8, L)) <= tiles.chunk <= 128
    # A block covers at most the group's channels rounded up to a power of two ("serial" masks
    # its ragged last block).
    assert tiles.block_d < 2 * dim_per_group
    warps = tiles.num_splits * -(-L // tiles.chunk) * batch * G * tiles.num_warps
    # At most an eighth of the channels get their own slice, so the per-slice dB/dC partials
    # stay far below a (batch, dim, L, N) tensor.
    cap = max(1, dim_per_group // 8)
    assert tiles.num_splits <= cap, tiles
    # Enough resident warps to hide the scans' latency (16 per SM, less what rounding slices to
    # whole channel blocks loses), unless the problem has too few channels (or reached the cap
    # on slices, give or take that rounding) to give them.
    assert (warps >= 0.9 * 16 * sms or tiles.num_splits * tiles.block_d >= dim_per_group
            or tiles.num_splits >= cap // 2), tiles


def test_bad_chunk_names_argument():
    with pytest.raises(ValueError, match="chunk"):
        run_bwd(Case(chunk_size=24), *make_inputs(Case(chunk_size=24)))


def test_bad_prefetch_names_argument():
    case = nblock(prefetch=3)
    with pytest.raises(ValueError, match="prefetch"):
        run_bwd(case, *make_inputs(case))


def test_dlast_state_seeds_the_last_step():
    # With dy = 0, every gradient flows from dlast_state; a kernel that ignored it returns zeros.
    case = Case(has_z=False, has_D=False, L=21)
    inputs, dy, dlast = make_inputs(case)
    dy = torch.zeros_like(dy)
    ref = reference_grads(case, inputs, dy, dlast)
    grads = run_bwd(case, inputs, dy, dlast)
    assert grads.du.abs().max() > 0
    for name in ("u", "delta", "A", "B", "initial_state"):
        assert rel_err(getattr(grads, GRAD_NAMES[name]), ref[name]) < TOL[torch.float32], name


def test_any_strides():
    # Inputs as real models produce them: u/delta/z transposed from (batch, L, dim), B/C sliced
    # out of a (batch, L, 2N) projection, dy from a transposed upstream gradient.
    case = Case(L=19, G=1)
    inputs, dy, dlast = make_inputs(case)

    def time_major(t):
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)

    strided = dict(inputs)
    for name in ("u", "delta", "z"):
        strided[name] = time_major(inputs[name])
    bc = torch.cat([inputs["B"], inputs["C"]], dim=2).permute(0, 3, 1, 2).contiguous()  # (b, L, G, 2N)
    strided["B"] = bc[..., : case.N].permute(0, 2, 3, 1)
    strided["C"] = bc[..., case.N:].permute(0, 2, 3, 1)
    strided["A"] = inputs["A"].t().contiguous().t()
    assert not strided["B"].is_contiguous() and not strided["u"].is_contiguous()
    ref = run_bwd(case, inputs, dy, dlast)
    out = run_bwd(case, strided, time_major(dy), dlast)
    for field in ref._fields:
        a, b = getattr(ref, field), getattr(out, field)
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=field)
    # The kernels run on L-major copies of the channel-innermost activations; the gradients
    # still come back in their inputs' layouts, as the op's fake impl promises.
    for grad, name in (("du", "u"), ("ddelta", "delta"), ("dz", "z")):
        assert getattr(out, grad).stride() == strided[name].stride(), grad


def test_broadcast_upstream_gradient():
    # y.sum().backward() hands the op an expanded dy with all-zero strides.
    case = Case(L=19)
    inputs, dy, dlast = make_inputs(case)
    expanded = dy[:1, :1, :1].expand_as(dy)
    assert expanded.stride() == (0, 0, 0)
    ref = run_bwd(case, inputs, expanded.contiguous(), dlast)
    out = run_bwd(case, inputs, expanded, dlast)
    for field in ref._fields:
        torch.testing.assert_close(getattr(out, field), getattr(ref, field), rtol=0, atol=0, msg=field)


def test_deterministic():
    case = Case(batch=1, dim=12, G=2, L=21, num_splits=2)
    inputs, dy, dlast = make_inputs(case)
    first = run_bwd(case, inputs, dy, dlast)
    second = run_bwd(case, inputs, dy, dlast)
    for field in first._fields:
        assert torch.equal(getattr(first, field), getattr(second, field)), field


def test_nblock_deterministic():
    # dB/dC rows written once per pass, running sums read back by the thread that wrote them,
    # fixed-order sums of the partials: the same bits every run.
    # bf16 (fp32 carry rows of their own), G = 2, 2 passes of 2 channels per slice, N = 6 in blocks
    # of 4 (one carry, a ragged last block).
    case = nblock(dim=8, G=2, L=23, N=6, nb=4, num_splits=1, group_d=2, dtype=torch.bfloat16)
    inputs, dy, dlast = make_inputs(case)
    first = run_bwd(case, inputs, dy, dlast)
    second = run_bwd(case, inputs, dy, dlast)
    for field in first._fields:
        assert torch.equal(getattr(first, field), getattr(second, field)), field


def test_serial_deterministic():
    # Each program owns its dB/dC partial rows: the first channel block stores there, later
    # blocks add by atomics in a fixed order; then fixed-order sums: same bits. Grouped B/C,
    # one slice of three 8-channel blocks per group, a full chunk and a ragged one.
    case = serial(batch=1, dim=48, G=2, L=21, chunk_size=16, steps=4, dtype=torch.bfloat16, block_d=8, num_splits=1)
    inputs, dy, dlast = make_inputs(case)
    first = run_bwd(case, inputs, dy, dlast)
    second = run_bwd(case, inputs, dy, dlast)
    for field in first._fields:
        assert torch.equal(getattr(first, field), getattr(second, field)), field


@pytest.mark.parametrize("case", [serial(dim=40, G=2, L=21, block_d=8, num_splits=2), WIDE_BF16], ids=Case.id)
def test_serial_dC_channel_sum_in_the_other_order(case, monkeypatch):
    # dC's sum over channels adds lane pairs first on Triton < 3.9 (triton_bwd._PAIR_DC), plain
    # halvings on 3.9: CI's Triton takes one order, the GPU's the other, and both must be right.
    # test_grads_match_fp64_reference runs these cases in this Triton's own order; this runs the
    # other one.
    from ssm_compile.kernels.selective_scan import triton_bwd

    monkeypatch.setattr(triton_bwd, "_PAIR_DC", not triton_bwd._PAIR_DC)
    inputs, dy, dlast = make_inputs(case)
    ref = reference_grads(case, inputs, dy, dlast)
    grads = run_bwd(case, inputs, dy, dlast)
    for name, grad_name in GRAD_NAMES.items():
        if inputs[name] is not None:
            tol = TOL[case.dtype] if inputs[name].dtype == case.dtype else TOL[torch.float32]
            assert rel_err(getattr(grads, grad_name), ref[name]) < tol, grad_name


@triton.jit
def _pick_rows_kernel(x_ptr, out_ptr, T: tl.constexpr, R: tl.constexpr):
    offs = tl.arange(0, T)[:, None, None, None] * R + tl.arange(0, R)[None, None, :, None]
    x = tl.load(x_ptr + offs)  # [T, 1, R, 1]
    for i in range(0, T):  # a run-time index, as the serial kernel's sub-chunk
        tl.store(out_ptr + i * R + tl.arange(0, R)[None, :, None], _pick_row(x, i))


@pytest.mark.parametrize("T", [1, 2, 8])
def test_pick_row_every_index(T):
    # The serial kernel reads each sub-chunk's entry state with it: a wrong bit order in the
    # select tree would hand a chunk's sub-chunks each other's states.
    x = torch.randn(T, 4, device=DEVICE)
    out = torch.empty_like(x)
    _pick_rows_kernel[(1,)](x, out, T=T, R=4, num_warps=1)
    assert torch.equal(out, x)


@triton.jit
def _neg_zero_kernel(x_ptr, out_ptr, n):
    offs = tl.arange(0, 8)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, x + neg_zero(), mask=offs < n)
    tl.store(out_ptr + n, neg_zero())


def test_neg_zero_is_the_identity_of_add():
    # +0.0 in its place (Triton 3.6's literal -0.0) would turn -0.0 into +0.0 here.
    x = torch.tensor([-0.0, 0.0, 1.5, -2.0, float("inf")], device=DEVICE)
    out = torch.empty(len(x) + 1, device=DEVICE)
    _neg_zero_kernel[(1,)](x, out, len(x), num_warps=1)
    assert torch.equal(out[:-1].view(torch.int32), x.view(torch.int32))
    assert out[-1].item() == 0.0 and torch.signbit(out[-1]).item()


@pytest.mark.parametrize("n_chunks, dim, N, has_init, has_dlast", [
    (19, 9, 16, False, False),  # 3 blocks of 8 chunks, the last ragged; a ragged channel block
    (19, 5, 5, True, True),  # N that fills no power of two: padded states stay untouched
    (8, 3, 256, True, False),  # one whole block; two warps per program, under one channel
    (1, 2, 4, False, True),
], ids=["C19-D9-N16", "C19-D5-N5-h0-dl", "C8-D3-N256-h0", "C1-D2-N4-dl"])
def test_state_pass_chains_the_chunks(n_chunks, dim, N, has_init, has_dlast):
    # Every backward at L <= 8 * chunk walks a single block of chunks; this walks several, with
    # random workspaces against the recurrence written out (fp64).
    g = torch.Generator().manual_seed(1)
    batch = 2
    hs = torch.randn(batch, n_chunks, dim, N, generator=g)
    rs = torch.randn(batch, n_chunks, dim, N, generator=g)
    total = torch.rand(batch, n_chunks, dim, generator=g) * 2
    A = -torch.rand(dim, N, generator=g) - 0.1
    init = torch.randn(batch, dim, N, generator=g) if has_init else None
    dlast = torch.randn(batch, dim, N, generator=g) if has_dlast else None
    decay = torch.exp(A.double() * total.double()[..., None])  # (batch, chunks, dim, N)
    h = init.double() if has_init else torch.zeros(batch, dim, N, dtype=torch.float64)
    r = dlast.double() if has_dlast else torch.zeros(batch, dim, N, dtype=torch.float64)
    h_ref, r_ref = torch.empty_like(decay), torch.empty_like(decay)
    for c in range(n_chunks):
        h_ref[:, c] = h
        h = decay[:, c] * h + hs[:, c].double()
    for c in reversed(range(n_chunks)):
        r_ref[:, c] = r
        r = decay[:, c] * r + rs[:, c].double()
    dev = dict(device=DEVICE)
    hs_d, rs_d = hs.to(**dev), rs.to(**dev)
    dinit = torch.full((batch, dim, N), float("nan"), **dev) if has_init else None
    _state_pass(A.to(**dev), total.to(**dev), init.to(**dev) if has_init else None,
                dlast.to(**dev) if has_dlast else None, hs_d, rs_d, dinit)
    torch.testing.assert_close(hs_d.cpu().double(), h_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rs_d.cpu().double(), r_ref, rtol=1e-5, atol=1e-5)
    if has_init:
        torch.testing.assert_close(dinit.cpu().double(), r, rtol=1e-5, atol=1e-5)


def test_nblock_mixed_dtypes():
    # Each output carries its running sum in place only when it is fp32 itself: here du (bf16)
    # and dz (fp16) get fp32 rows of their own while ddelta (fp32) is its own row.
    case = nblock(L=37, N=5, nb=2, group_d=2)
    inputs, dy, dlast = make_inputs(case)
    inputs.update(u=inputs["u"].bfloat16(), z=inputs["z"].half(), C=inputs["C"].bfloat16())
    ref = reference_grads(case, inputs, dy, dlast)
    grads = run_bwd(case, inputs, dy, dlast)
    for name, grad_name in GRAD_NAMES.items():
        out = getattr(grads, grad_name)
        assert out.dtype == inputs[name].dtype, grad_name
        assert rel_err(out, ref[name]) < TOL[inputs[name].dtype], f"{grad_name}: rel err {rel_err(out, ref[name]):.2e}"


def test_nblock_matches_column_beyond_rounding():
    # Same arithmetic, different summation order (over columns, over channels).
    case = Case(dim=8, L=24, G=2)
    inputs, dy, dlast = make_inputs(case)
    column = run_bwd(case, inputs, dy, dlast)
    blocks = run_bwd(dataclasses.replace(case, variant="nblock", nb=2, group_d=3, num_splits=2), inputs, dy, dlast)
    for field in column._fields:
        torch.testing.assert_close(getattr(blocks, field), getattr(column, field), rtol=1e-5, atol=1e-6, msg=field)


@pytest.mark.parametrize("case", [nblock(L=19, nb=2), serial(L=19, stage=False), serial(L=19, stage=True)],
                         ids=["nblock", "serial", "serial-staged"])
def test_any_strides(case):
    # nblock: fp32 outputs carry the running sums in place, so du/ddelta/dz's own (time-major)
    # strides are the carry rows' strides. serial: reads time-major activations without staging,
    # or (staged) works on L-major copies and copies the gradients back.
    inputs, dy, dlast = make_inputs(case)

    def time_major(t):
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)

    strided = dict(inputs)
    for name in ("u", "delta", "z"):
        strided[name] = time_major(inputs[name])
    strided["B"] = inputs["B"].transpose(-1, -2).contiguous().transpose(-1, -2)
    ref = run_bwd(case, inputs, dy, dlast)
    out = run_bwd(case, strided, time_major(dy), dlast)
    assert out.du.stride() == strided["u"].stride()
    for field in ref._fields:
        torch.testing.assert_close(getattr(out, field), getattr(ref, field), rtol=1e-6, atol=1e-6, msg=field)


@pytest.mark.parametrize(
    "batch, dim, L, G, sms",
    [(8, 1536, 2048, 1, 132), (1, 1536, 2048, 1, 132), (8, 1536, 8192, 1, 132), (2, 24, 40, 3, 132), (1, 5, 3, 1, 1)],
    ids=["B8-D1536-L2048-H200", "B1-D1536-L2048-H200", "B8-D1536-L8192-H200", "B2-D24-L40-G3-H200", "B1-D5-L3-cpu"],
)
def test_choose_tiles_nblock_whole_waves(batch, dim, L, G, sms, monkeypatch):
    from ssm_compile.kernels.selective_scan import triton_bwd

    monkeypatch.setattr(triton_bwd, "_num_sms", lambda device: sms)
    tiles = triton_bwd.choose_tiles(batch, dim, L, 16, G, torch.device("cpu"), variant="nblock")
    assert tiles.variant == "nblock" and tiles.block_d == 1 and tiles.nb & (tiles.nb - 1) == 0
    dim_per_group = dim // G
    per_split = -(-dim_per_group // tiles.num_splits)
    assert (tiles.num_splits - 1) * per_split < dim_per_group <= tiles.num_splits * per_split
    assert tiles.num_splits <= max(1, dim_per_group // 8), tiles
    programs = tiles.num_splits * -(-L // tiles.chunk) * batch * G
    slots = triton_bwd._NBLOCK_WARPS_PER_SM * sms // tiles.num_warps
    # At most the aimed-for whole waves, and a full first wave unless the channels ran out.
    assert programs <= max(triton_bwd._NBLOCK_WAVES * slots, -(-L // tiles.chunk) * batch * G), tiles
    assert programs >= slots or tiles.num_splits >= max(1, dim_per_group // 8) // 2, tiles


@pytest.mark.parametrize("tiles, match", [(dict(variant="rows"), "variant"), (dict(variant="nblock", nb=3), "nb"),
                                          (dict(variant="nblock", block_d=4), "block_d"),
                                          # 4 partials for 8 channels: too close to (batch, dim, L, N).
                                          (dict(variant="serial", block_d=2, num_splits=4), "num_splits=4"),
                                          (dict(variant="serial", block_d=3), "block_d.*power of two"),
                                          (dict(variant="serial", steps=3), "steps"),
                                          (dict(variant="serial", chunk=256), "chunk"),
                                          (dict(variant="nblock", stage=False), "stage=False"),
                                          (dict(variant="nblock", max_registers=168), "max_registers needs"),
                                          (dict(variant="serial", max_registers=300), "max_registers must")],
                         ids=["variant", "nb", "nblock-block_d", "serial-partials", "serial-block_d", "serial-steps",
                              "serial-chunk", "nblock-unstaged", "nblock-cap", "serial-cap-range"])
def test_bad_tiles_name_field(tiles, match):
    from ssm_compile.kernels.selective_scan.triton_bwd import choose_tiles

    with pytest.raises(ValueError, match=match):
        choose_tiles(2, 8, 40, 4, 1, torch.device("cpu"), **tiles)


def test_serial_names_its_limit_on_n():
    from ssm_compile.kernels.selective_scan.triton_bwd import choose_tiles

    with pytest.raises(ValueError, match="N <= 16, got N=17"):
        choose_tiles(2, 8, 40, 17, 1, torch.device("cpu"), variant="serial")
    # Left to the launcher, a small grid with N = 17 gets the "column" kernel instead.
    assert choose_tiles(2, 8, 40, 17, 1, torch.device("cpu")).variant == "column"
    assert choose_tiles(2, 8, 40, 16, 1, torch.device("cpu")).variant == "serial"


@pytest.mark.parametrize("batch, L, stage", [(8, 2048, True), (1, 2048, True), (1, 512, False), (8, 64, False)],
                         ids=["B8-L2048", "B1-L2048", "B1-L512", "B8-L64"])
def test_serial_stages_channel_innermost_input_on_large_grids(batch, L, stage):
    from ssm_compile.kernels.selective_scan.triton_bwd import choose_tiles

    # 16 (chunk, batch) cells and more: the L-major copies cost less than the serial kernel's
    # slower [steps, channels] loads of channel-innermost rows; below, the host time of the copies
    # counts more (see choose_tiles).
    tiles = choose_tiles(batch, 1536, L, 16, 1, torch.device("cpu"))
    assert tiles.variant == "serial"
    assert tiles.stage is stage
    assert choose_tiles(batch, 1536, L, 16, 1, torch.device("cpu"), stage=not stage).stage is (not stage)
    # N beyond the serial kernel's limit: "nblock" or "column", which always stage.
    assert choose_tiles(batch, 1536, L, 32, 1, torch.device("cpu")).stage is True


def test_splitting_does_not_change_results_beyond_rounding():
    # The channel slices only change how dB/dC partials are grouped before the final sum.
    case = Case(dim=8, L=24)
    inputs, dy, dlast = make_inputs(case)
    one = run_bwd(dataclasses.replace(case, num_splits=1), inputs, dy, dlast)
    four = run_bwd(dataclasses.replace(case, num_splits=4, block_d=2), inputs, dy, dlast)
    for field in one._fields:
        torch.testing.assert_close(getattr(four, field), getattr(one, field), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["column", "nblock", "serial"])
def test_memory_stays_linear(variant):
    # Record every tensor the launcher allocates: none may be as large as (batch, dim, L, N).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        ALLOCATING = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "new_empty", "new_zeros", "full"}

        def __init__(self):
            super().__init__()
            self.numels = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # Only fresh buffers: the interpreter's own storage copies are not the launcher's.
            if isinstance(out, torch.Tensor) and func.__name__.split(".")[0] in self.ALLOCATING:
                self.numels.append(out.numel())
            return out

    # bf16 for "nblock": its running sums over columns then get fp32 rows of their own.
    case = {
        "column": Case(L=32, N=4, dim=16),
        "nblock": nblock(L=48, N=4, dim=8, nb=2, dtype=torch.bfloat16),
        "serial": serial(L=32, N=4, dim=16, chunk_size=16),
    }[variant]
    inputs, dy, dlast = make_inputs(case)
    with Allocations() as allocs:
        run_bwd(case, inputs, dy, dlast)
    assert allocs.numels, "no allocation was seen"
    assert max(allocs.numels) < case.batch * case.dim * case.L * case.N // 2, allocs.numels


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda i, dy, dl: dict(dy=dy[:, :, :-1]), "dy"),
        (lambda i, dy, dl: dict(B=i["B"][:, 0]), "grouped"),
        (lambda i, dy, dl: dict(dlast=dl[:, :, :-1]), "dlast_state"),
    ],
    ids=["dy-shape", "B-3d", "dlast-shape"],
)
def test_bad_input_names_argument(bad, match):
    case = Case(L=8)
    inputs, dy, dlast = make_inputs(case)
    change = bad(inputs, dy, dlast)
    dy = change.pop("dy", dy)
    dlast = change.pop("dlast", dlast)
    inputs.update(change)
    with pytest.raises(ValueError, match=match):
        run_bwd(case, inputs, dy, dlast)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; the interpreter cases above cover CPU")
@pytest.mark.parametrize("variant", ["column", "nblock", "serial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_default_tiles(dtype, variant):
    # Compiled kernels with the launcher's own tile choices on a shape with many chunks.
    case = Case(batch=2, dim=64, L=300, N=16, G=2, dtype=dtype, chunk_size=None, variant=variant)
    inputs, dy, dlast = make_inputs(case)
    ref = reference_grads(case, inputs, dy, dlast)
    grads = run_bwd(case, inputs, dy, dlast)
    for name, grad_name in GRAD_NAMES.items():
        tol = TOL[dtype] if inputs[name].dtype == dtype else TOL[torch.float32]
        assert rel_err(getattr(grads, grad_name), ref[name]) < tol, grad_name
