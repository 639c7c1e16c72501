"""``ssm::x_dt_proj`` (x_proj and dt_proj as one op) and the pass that emits it.

The kernel runs under TRITON_INTERPRET=1 on CPU tensors here (on the GPU when there is one);
every value is checked against an fp64 reference that rounds where eager rounds (x_dbl to the
input dtype before dt_proj reads it), or against eager itself.
"""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from utils import TOL, TRITON_DEVICE, MinimalMambaBlock, PassCapture, perturbed, rel_err, traced_without_interpreter

from ssm_compile.kernels.x_dt_proj import triton_x_dt_proj
from ssm_compile.kernels.x_dt_proj.reference import x_dt_proj_ref as reference
from ssm_compile.passes import conv1d, delta, discretize, readout, scan_assoc, scan_loop, tail, x_dt_proj  # noqa: F401

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module", autouse=True)
def _ops():
    from ssm_compile.kernels import register_ops

    register_ops()


def make(lead, K, R, N, dim, dtype, layout="rows", seed=0, device="cpu"):
    """Random x (..., K) in the given layout, and weights at the scale of a model's."""
    g = torch.Generator().manual_seed(seed)
    if layout == "rows":
        x = torch.randn(*lead, K, generator=g)
    else:  # "lmajor": the (batch, K, L) transposed, as an L-major conv output reaches x_proj
        x = torch.randn(lead[0], K, *lead[1:], generator=g).transpose(1, -1)
    wx = torch.randn(R + 2 * N, K, generator=g) / K ** 0.5
    wdt = torch.randn(dim, R, generator=g) / R ** 0.5
    return tuple(t.to(dtype).to(device) for t in (x, wx, wdt))


# (leading dims, K, R, N, dim, layout, tiles): ragged row counts against BLOCK_M, R and 2N that
# are not powers of two (or below tl.dot's 16), dim not a multiple of BLOCK_D, the widest R the op launches the kernel for.
KERNEL_CASES = {
    "rows": ((2, 37), 96, 6, 8, 96, "rows", None),
    "lmajor": ((2, 37), 96, 6, 8, 96, "lmajor", None),
    "2d": ((75,), 64, 5, 4, 40, "rows", None),
    "4d": ((2, 3, 11), 32, 3, 2, 24, "rows", None),
    "R48": ((1, 130), 64, 48, 16, 200, "rows", triton_x_dt_proj.Tiles(32, 32, 64, 4, 3)),
    "R64": ((1, 40), 64, 64, 16, 72, "lmajor", triton_x_dt_proj.Tiles(32, 32, 64, 4, 2)),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_matches_fp64(case, dtype):
    lead, K, R, N, dim, layout, tiles = KERNEL_CASES[case]
    x, wx, wdt = make(lead, K, R, N, dim, DTYPES[dtype], layout, device=TRITON_DEVICE)
    tiles = tiles or triton_x_dt_proj.Tiles(block_m=32, block_k=32, block_d=32, num_stages=2)
    x_dbl, dt = triton_x_dt_proj.x_dt_proj_fwd(x, wx, wdt, tiles)
    ref_x_dbl, ref_dt = reference(x.cpu(), wx.cpu(), wdt.cpu())
    assert x_dbl.shape == ref_x_dbl.shape and dt.shape == ref_dt.shape
    assert x_dbl.is_contiguous() and dt.is_contiguous() and x_dbl.dtype == dt.dtype == x.dtype
    # One rounding of each output to the dtype on top of fp32 sums: the dtype's own tolerance.
    assert rel_err(x_dbl.cpu(), ref_x_dbl) < TOL[DTYPES[dtype]]
    assert rel_err(dt.cpu(), ref_dt) < TOL[DTYPES[dtype]]


def test_kernel_default_tiles_match_eager():
    # The tiles the op launches with, on a row count above the op's threshold for the kernel.
    x, wx, wdt = make((2, 8200), 64, 6, 8, 64, torch.bfloat16, "lmajor", device=TRITON_DEVICE)
    assert triton_x_dt_proj.supported(x, wx, wdt) == (TRITON_DEVICE == "cuda")
    x_dbl, dt = triton_x_dt_proj.x_dt_proj_fwd(x, wx, wdt)
    ref_x_dbl, ref_dt = reference(x.cpu(), wx.cpu(), wdt.cpu())
    assert rel_err(x_dbl.cpu(), ref_x_dbl) < TOL[torch.bfloat16]
    assert rel_err(dt.cpu(), ref_dt) < TOL[torch.bfloat16]


def test_op_is_the_two_linears():
    x, wx, wdt = make((2, 9), 32, 4, 3, 20, torch.float32, "lmajor")
    x_dbl, dt = torch.ops.ssm.x_dt_proj(x, wx, wdt)
    ref = F.linear(x, wx)
    assert torch.equal(x_dbl, ref)
    assert torch.equal(dt, F.linear(ref[..., :4], wdt))


def test_supported_by_shape():
    x, wx, wdt = make((1, 8), 32, 4, 3, 20, torch.float32)
    assert not triton_x_dt_proj.supported(x, wx, wdt)  # too few rows for the kernel to pay
    big = torch.empty(1, triton_x_dt_proj.MIN_ROWS, 32)
    wide = torch.empty(200, 32)  # R = 160 (Mamba-2.8b): past the kernel's register tiles
    assert not triton_x_dt_proj.supported(big, wide, torch.empty(20, 160))


def test_int32_column_offsets_are_refused():
    # An L-major x, (1, L, K) as the view of a (1, K, L) tensor: column k sits k * L elements in.
    L = 2**31 // 31 + 1
    far = torch.empty(1, 32, L, device="meta").transpose(1, 2)
    assert not triton_x_dt_proj.column_offsets_fit(far)
    assert triton_x_dt_proj.column_offsets_fit(torch.empty(1, 32, L - 2, device="meta").transpose(1, 2))
    assert triton_x_dt_proj.column_offsets_fit(torch.empty(1, L, 32, device="meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU counterpart: test_kernel_*)")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_op_forward_backward(dtype):
    x, wx, wdt = make((2, 8192), 256, 16, 16, 512, DTYPES[dtype], "lmajor", device="cuda")
    assert triton_x_dt_proj.supported(x, wx, wdt)
    leaves = [t.detach().requires_grad_() for t in (x, wx, wdt)]
    x_dbl, dt = torch.ops.ssm.x_dt_proj(*leaves)
    g1, g2 = torch.randn_like(x_dbl), torch.randn_like(dt)
    grads = torch.autograd.grad([x_dbl, dt], leaves, [g1, g2])
    refs = [t.detach().cpu().double().requires_grad_() for t in (x, wx, wdt)]
    r1 = F.linear(refs[0], refs[1])
    r2 = F.linear(r1[..., :16], refs[2])
    ref_grads = torch.autograd.grad([r1, r2], refs, [g1.cpu().double(), g2.cpu().double()])
    assert rel_err(x_dbl.cpu(), r1) < TOL[DTYPES[dtype]]
    assert rel_err(dt.cpu(), reference(x.cpu(), wx.cpu(), wdt.cpu())[1]) < TOL[DTYPES[dtype]]
    for got, ref in zip(grads, ref_grads):
        assert rel_err(got.cpu(), ref) < 4 * TOL[DTYPES[dtype]]


# --- the forward handed to inductor (kernels/inline.py) -------------------------------------------

def _traced_x_dt_proj(device, rows):
    """The forward as AOTAutograd traces it (``FunctionalTensorMode``), on fake tensors of
    Mamba-130m's x_proj/dt_proj shapes with ``rows`` rows of x."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        x = torch.empty(rows // 512, 1536, 512, dtype=torch.bfloat16, device=device).transpose(1, 2)
        wx = torch.empty(80, 1536, dtype=torch.bfloat16, device=device)
        wdt = torch.empty(1536, 48, dtype=torch.bfloat16, device=device)
    gm = make_fx(dispatch_functionalize(lambda *a: torch.ops.ssm.x_dt_proj(*a)), tracing_mode="fake")(x, wx, wdt)
    return sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})


_X_DT_TRACE_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_x_dt_proj as t
# supported() reads the device's shared memory, which a machine without a GPU lacks (an H200's).
t.triton_x_dt_proj._shared_memory = lambda index: 232448
from ssm_compile.kernels import register_ops
register_ops()
print(json.dumps({d: t._traced_x_dt_proj(d, 16384) for d in ("cuda", "cpu")}))
"""


def test_functionalization_inlines_the_forward():
    """On CUDA, where the op would launch its kernel (16384 rows), the forward becomes the
    kernel's wrap_triton launch; on CPU the op stays. Traced with fake CUDA tensors in a
    subprocess without TRITON_INTERPRET (under which the rule keeps the op whole), so it runs
    without a GPU. (The other CUDA branch, the two products recorded as matmuls, slices a fake
    CUDA tensor, which a CPU-only torch refuses: the GPU test below covers it.)"""
    traced = traced_without_interpreter(_X_DT_TRACE_SCRIPT)
    op = "ssm.x_dt_proj.default"
    assert "triton_kernel_wrapper_functional" in traced["cuda"] and op not in traced["cuda"], traced
    assert "aten.mm.default" not in traced["cuda"], traced
    assert op in traced["cpu"] and "triton_kernel_wrapper_functional" not in traced["cpu"], traced


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU counterpart: the tracing test above)")
@pytest.mark.parametrize("rows", [16384, 4096])
def test_inductor_launches_the_kernel_or_the_products_itself(rows):
    """A training step under inductor on CUDA: no op call in the forward's code (the kernel at
    16384 rows, inductor's matmuls at 4096), values equal to eager's, gradients within tolerance."""
    from torch._inductor.utils import run_and_get_code

    leaves = [t.requires_grad_() for t in make((rows // 512, 512), 1536, 48, 16, 1536, torch.bfloat16,
                                                "lmajor", device="cuda")]

    def step(forward):
        x_dbl, dt = forward(*leaves)
        loss = x_dbl.float().square().sum() + dt.float().square().sum()
        return x_dbl, dt, torch.autograd.grad(loss, leaves)

    x_dbl_e, dt_e, grads_e = step(torch.ops.ssm.x_dt_proj)
    (x_dbl_c, dt_c, grads_c), codes = run_and_get_code(step, torch.compile(lambda *a: torch.ops.ssm.x_dt_proj(*a)))
    code = "\n".join(codes)
    assert "torch.ops.ssm.x_dt_proj" not in code
    assert ("_x_dt_proj_kernel" in code) == (rows >= triton_x_dt_proj.MIN_ROWS)
    # The kernel is the op's own launch (bitwise); inductor's matmuls may pick other cuBLAS tiles.
    if rows >= triton_x_dt_proj.MIN_ROWS:
        assert torch.equal(x_dbl_c, x_dbl_e) and torch.equal(dt_c, dt_e)
    else:
        assert rel_err(x_dbl_c, x_dbl_e) < TOL[torch.bfloat16] and rel_err(dt_c, dt_e) < TOL[torch.bfloat16]
    for got, want in zip(grads_c, grads_e):
        assert rel_err(got, want) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_opcheck(dtype):
    x, wx, wdt = make((2, 9), 32, 4, 3, 20, DTYPES[dtype], "lmajor")
    args = tuple(t.requires_grad_() for t in (x, wx, wdt))
    torch.library.opcheck(torch.ops.ssm.x_dt_proj.default, args)


def test_gradcheck_fp64():
    args = tuple(t.requires_grad_() for t in make((2, 5), 8, 3, 2, 6, torch.float64, "lmajor"))
    assert torch.autograd.gradcheck(lambda *a: torch.ops.ssm.x_dt_proj(*a), args)
    # One output differentiated alone: the other's gradient arrives as None.
    assert torch.autograd.gradcheck(lambda *a: torch.ops.ssm.x_dt_proj(*a)[1], args)
    assert torch.autograd.gradcheck(lambda *a: torch.ops.ssm.x_dt_proj(*a)[0], args)


@pytest.mark.parametrize("lead, K", [((0, 9), 32), ((2, 0), 32), ((2, 9), 0)], ids=["batch0", "L0", "K0"])
def test_empty_input_gives_eagers_products(lead, K):
    # As F.linear does: empty outputs, or zeros where only K is 0 (an empty sum).
    x = torch.randn(*lead, K, requires_grad=True)
    wx, wdt = torch.randn(10, K, requires_grad=True), torch.randn(20, 4, requires_grad=True)
    x_dbl, dt = torch.ops.ssm.x_dt_proj(x, wx, wdt)
    ref_dbl = F.linear(x, wx)
    ref_dt = F.linear(ref_dbl[..., :4], wdt)
    assert torch.equal(x_dbl, ref_dbl) and torch.equal(dt, ref_dt)
    grads = torch.autograd.grad((x_dbl.sum() + dt.sum()), (x, wx, wdt))
    refs = torch.autograd.grad((ref_dbl.sum() + ref_dt.sum()), (x, wx, wdt))
    for g, r in zip(grads, refs, strict=True):
        assert torch.equal(g, r)
    torch.library.opcheck(torch.ops.ssm.x_dt_proj.default, (x.detach(), wx.detach(), wdt.detach()))


def _bad(**changes):
    x, wx, wdt = make((2, 9), 32, 4, 3, 20, torch.float32)
    return {**dict(x=x, x_weight=wx, dt_weight=wdt), **changes}


BAD_INPUTS = {
    "x-1d": (_bad(x=torch.randn(32)), ValueError, r"^x_dt_proj: x: expected a \(\.\.\., rows, K\) tensor"),
    "x-int": (_bad(x=torch.ones(2, 9, 32, dtype=torch.int32)), TypeError, r"^x_dt_proj: x: expected dtype"),
    "x_weight-K": (_bad(x_weight=torch.randn(10, 31)), ValueError, r"^x_dt_proj: x_weight: expected shape \(R \+ 2N, K=32\)"),
    "dt_weight-R": (_bad(dt_weight=torch.randn(20, 10)), ValueError, r"^x_dt_proj: dt_weight: expected shape \(dim, R\)"),
    "dt_weight-dtype": (_bad(dt_weight=torch.randn(20, 4, dtype=torch.float64)), TypeError, r"^x_dt_proj: dt_weight: expected x's dtype"),
    "x_weight-device": (_bad(x_weight=torch.randn(10, 32, device="meta")), ValueError, r"^x_dt_proj: x_weight: expected x's device"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_inputs_name_the_argument(name):
    inputs, error, match = BAD_INPUTS[name]
    with pytest.raises(error, match=match):
        torch.ops.ssm.x_dt_proj(**inputs)


def test_forward_ad_is_refused():
    import torch.autograd.forward_ad as fwAD

    x, wx, wdt = make((2, 9), 32, 4, 3, 20, torch.float64)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD"):
        torch.ops.ssm.x_dt_proj(fwAD.make_dual(x, torch.randn_like(x)), wx, wdt)


# --- the pass -----------------------------------------------------------------------------------

def _compiled(model, *args):
    cap = PassCapture(conv1d, scan_loop, scan_assoc, delta, tail, x_dt_proj)
    out = torch.compile(model, backend=cap, fullgraph=True)(*args)
    return cap, out


def _x_dt_ops(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.ssm.x_dt_proj.default]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hf_mamba_is_rewritten_and_trains_like_eager(dtype):
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    cfg = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                      conv_kernel=4, time_step_rank=3)
    model = perturbed(MambaForCausalLM(cfg)).to(DTYPES[dtype])
    ids = torch.randint(0, 64, (2, 12))
    ref = model(ids, use_cache=False).logits
    ref_grads = torch.autograd.grad(ref.float().square().mean(), list(model.parameters()))
    torch._dynamo.reset()
    cap = PassCapture(conv1d, scan_loop, scan_assoc, delta, tail, x_dt_proj)
    out = torch.compile(model, backend=cap)(ids, use_cache=False).logits
    assert len(_x_dt_ops(cap.gm)) == 2
    assert [r.family for r in cap.ctx.rewrites].count("x_dt_proj") == 2
    assert rel_err(out, ref.double()) < TOL[DTYPES[dtype]]
    grads = torch.autograd.grad(out.float().square().mean(), list(model.parameters()))
    for (name, _), got, want in zip(model.named_parameters(), grads, ref_grads):
        assert rel_err(got, want.double()) < 4 * TOL[DTYPES[dtype]], name


def test_minimal_block_is_rewritten():
    torch.manual_seed(0)
    block = perturbed(MinimalMambaBlock())
    x = torch.randn(2, 10, 16)
    cap, out = _compiled(block, x)
    assert len(_x_dt_ops(cap.gm)) == 1
    (record,) = [r for r in cap.ctx.rewrites if r.family == "x_dt_proj"]
    assert record.decision == {"R": 2, "x_dbl_cols": 10, "dim": 32, "runs": "the two products (cpu)"}
    assert rel_err(out, block(x).double()) < TOL[torch.float32]


class XDt(nn.Module):
    """x_proj -> split -> dt_proj -> softplus -> scan, with the variations the near-misses need."""

    def __init__(self, variant, dim=8, R=3, N=4):
        super().__init__()
        self.variant, self.R, self.N = variant, R, N
        self.x_proj = nn.Linear(dim, R + 2 * N, bias=variant == "x_proj_bias")
        # "written": without a bias, so that the delta pass (which would recompute a biased
        # dt_proj at the scan) leaves the product where it is and this pass meets the write.
        self.dt_proj = nn.Linear(R, dim, bias=variant != "written")
        self.A = nn.Parameter(-torch.rand(dim, N) - 0.5)

    def forward(self, x):  # x: (batch, L, dim)
        from ssm_compile.kernels.selective_scan.op import selective_scan_fn

        if self.variant.startswith("rows"):
            return self._rows_forward(x)
        if self.variant in ("einsum", "einsum_ellipsis"):  # x_proj as an einsum (unseen code, run 51)
            x_dbl = torch.einsum("bld,ed->ble" if self.variant == "einsum" else "...d,ed->...e", x,
                                 self.x_proj.weight)
        elif self.variant == "einsum_permuted":  # (batch, R + 2N, L): not a linear, transposed back
            x_dbl = torch.einsum("bld,ed->bel", x, self.x_proj.weight).transpose(1, 2)
        elif self.variant == "einsum_broadcast":  # a size-1 d broadcast against W's: x[..., :1] * W.sum(1)
            x_dbl = torch.einsum("bld,ed->ble", x[..., :1], self.x_proj.weight)
        else:
            x_dbl = self.x_proj(x)
        R, N = self.R, self.N
        if self.variant == "middle_columns":  # dt from columns N..N+R: not x_dbl's first R
            B, dt, C = x_dbl.split([N, R, N], dim=-1)
        elif self.variant == "slice":
            dt, B, C = x_dbl[..., :R], x_dbl[..., R:R + N], x_dbl[..., R + N:]
        elif self.variant == "slice_from_the_end":
            dt, B, C = x_dbl[..., :-2 * N], x_dbl[..., -2 * N:-N], x_dbl[..., -N:]
        elif self.variant == "split_keywords":
            dt, B, C = torch.split(x_dbl, split_size_or_sections=[R, N, N], dim=-1)
        elif self.variant == "tensor_split":
            dt, B, C = torch.tensor_split(x_dbl, [R, R + N], dim=-1)
        elif self.variant == "tensor_split_method":
            dt, B, C = x_dbl.tensor_split((R, R + N), -1)
        elif self.variant == "split_empty_first":  # an empty piece before dt: dt is still the first R (probe CN)
            _, dt, B, C = x_dbl.split([0, R, N, N], dim=-1)
        elif self.variant == "tensor_split_at_zero":  # likewise: pieces [:0], [0:R], ...
            _, dt, B, C = torch.tensor_split(x_dbl, [0, R, R + N], dim=-1)
        elif self.variant == "tensor_split_negative":  # indices from the end: piece 1 is [0:-2N] (probe CQ)
            _, dt, B, C = torch.tensor_split(x_dbl, [0, -2 * N, -N], dim=-1)
        elif self.variant == "chunk":  # with R == N the chunks are split([R, N, N])'s pieces (probe CR)
            dt, B, C = x_dbl.chunk(3, dim=-1)
        elif self.variant == "torch_chunk":
            dt, B, C = torch.chunk(x_dbl, 3, -1)
        elif self.variant == "chunk_halves":  # R == 2N: ceil((R + 2N) / 2) = R columns, then B and C
            dt, BC = x_dbl.chunk(2, -1)
            B, C = BC.split([N, N], dim=-1)
        elif self.variant == "chunk_last":  # ceil((3 + 8) / 3) = 4, 4, 3 columns: dt is the last chunk
            B, C, dt = x_dbl.chunk(3, -1)
        elif self.variant == "offset_slice":  # columns 1..R: one column past dt's
            dt, B, C = x_dbl[..., 1:R + 1], x_dbl[..., R:R + N], x_dbl[..., R + N:]
        elif self.variant == "offset_narrow":
            dt, B, C = x_dbl.narrow(-1, 1, R), x_dbl[..., R:R + N], x_dbl[..., R + N:]
        elif self.variant == "tensor_split_late":  # first piece ends at R + 1: dt_proj reads R + 1 columns
            dt, B, C = torch.tensor_split(x_dbl, [R + 1, R + N], dim=-1)
            B = torch.cat([dt[..., R:], B], dim=-1)[..., :N]
            dt = dt[..., :R]
        else:
            dt, B, C = x_dbl.split([R, N, N], dim=-1)
        if self.variant == "written":  # x_dbl written in place after dt_proj read it
            dt_pre = self.dt_proj(dt)
            x_dbl.mul_(2)
        elif self.variant == "bias_add_method":  # the bias added by the method (probe AI, run 49)
            dt_pre = F.linear(dt, self.dt_proj.weight).add(self.dt_proj.bias)
        elif self.variant in ("einsum", "einsum_ellipsis", "einsum_permuted", "einsum_broadcast"):
            dt_pre = torch.einsum("blr,dr->bld", dt, self.dt_proj.weight) + self.dt_proj.bias
        elif self.variant == "einsum_dt_transposed":  # W_dt read as (R, dim): another product
            w = self.dt_proj.weight.reshape(self.R, -1)
            dt_pre = torch.einsum("blr,rd->bld", dt, w) + self.dt_proj.bias
        elif self.variant == "mambapy":  # mamba.py's batched product, transposed back (probe CT, run 64)
            dt_pre = (self.dt_proj.weight @ dt.transpose(1, 2)).transpose(1, 2) + self.dt_proj.bias
        elif self.variant in ("matmul_t", "matmul_T"):  # the linear written as a product (probe AI, run 49)
            w = self.dt_proj.weight
            dt_pre = dt @ (w.t() if self.variant == "matmul_t" else w.T) + self.dt_proj.bias
        elif self.variant == "tanh":  # dt_proj reads a function of the columns (probe CM, run 61)
            dt_pre = self.dt_proj(torch.tanh(dt))
        elif self.variant == "scaled_left":  # likewise, a number times them (probe CN: no reason was given)
            dt_pre = self.dt_proj(2.0 * dt)
        elif self.variant == "where":
            dt_pre = self.dt_proj(torch.where(dt > 0, dt, 0.0))
        elif self.variant == "round_trip":  # through fp64 and back: the reason names the last cast
            dt_pre = self.dt_proj(dt.double().float())
        elif self.variant == "cast":  # dt_proj reads a rounded copy: another precision
            dt_pre = F.linear(dt.to(torch.bfloat16), self.dt_proj.weight.to(torch.bfloat16)).float()
        else:
            dt_pre = self.dt_proj(dt)
        delta = F.softplus(dt_pre)
        y = selective_scan_fn(x.transpose(1, 2), delta.transpose(1, 2), self.A, B.transpose(1, 2),
                              C.transpose(1, 2))
        return y, x_dbl

    def _rows_forward(self, x):
        # mamba_simple's reference path: x_proj on (batch * L) rows, dt_proj as the 2-D product
        # W_dt @ dt.t() reshaped to (dim, batch, L) and moved to (batch, dim, L).
        from ssm_compile.kernels.selective_scan.op import selective_scan_fn

        b, L, dim = x.shape
        R, N = self.R, self.N
        x_dbl = self.x_proj(x.reshape(b * L, dim))
        if self.variant == "rows_middle_columns":
            B, dt, C = x_dbl.split([N, R, N], dim=-1)
        else:
            dt, B, C = x_dbl.split([R, N, N], dim=-1)
        dt_t = dt.T if self.variant == "rows_T" else dt.t()
        dt = (self.dt_proj.weight @ dt_t).reshape(-1, b, L).permute(1, 0, 2)
        delta = F.softplus(dt + self.dt_proj.bias[:, None])
        B, C = (t.reshape(b, L, N).transpose(1, 2) for t in (B, C))
        # A copy of x_dbl: returning x_dbl itself would return the base of the reshaped B and C,
        # whose reshapes the layout check cannot prove to be views of the op's output.
        return selective_scan_fn(x.transpose(1, 2), delta, self.A, B, C), x_dbl.clone()


@pytest.mark.parametrize("variant", ["split", "slice", "slice_from_the_end", "split_keywords", "rows", "rows_T",
                                     "bias_add_method", "matmul_t", "matmul_T", "einsum", "einsum_ellipsis",
                                     "tensor_split", "tensor_split_method", "split_empty_first",
                                     "tensor_split_at_zero", "tensor_split_negative", "mambapy"])
def test_forms_are_rewritten(variant):
    torch.manual_seed(0)
    model = XDt(variant)
    x = torch.randn(2, 7, 8)
    cap, (y, x_dbl) = _compiled(model, x)
    ref_y, ref_x_dbl = model(x)
    assert len(_x_dt_ops(cap.gm)) == 1
    # dt_proj's bias and the softplus reach the scan as its delta_bias and delta_softplus.
    (scan,) = [n for n in cap.gm.graph.nodes if n.target is torch.ops.ssm.selective_scan.default]
    assert scan.args[7] is not None and scan.args[8] is True, scan.args
    assert torch.equal(x_dbl, ref_x_dbl)  # x_dbl, also a graph output, is the op's first output
    assert rel_err(y, ref_y.double()) < TOL[torch.float32]


@pytest.mark.parametrize("variant, R, N", [("chunk", 4, 4), ("torch_chunk", 4, 4), ("chunk_halves", 4, 2)])
def test_chunk_whose_first_piece_is_dt_is_rewritten(variant, R, N):
    """``x_dbl.chunk(k, -1)``'s first piece is x_dbl's first ceil((R + 2N) / k) columns: dt's R here
    (probe CR, run 63: left alone with no reason while the same split was rewritten)."""
    torch.manual_seed(0)
    model = XDt(variant, R=R, N=N)
    x = torch.randn(2, 7, 8, requires_grad=True)
    cap, (y, x_dbl) = _compiled(model, x)
    x_ref = x.detach().clone().requires_grad_()
    ref_y, ref_x_dbl = model(x_ref)
    assert len(_x_dt_ops(cap.gm)) == 1
    (record,) = [r for r in cap.ctx.rewrites if r.family == "x_dt_proj"]
    assert record.decision["R"] == R and record.decision["x_dbl_cols"] == R + 2 * N, record.decision
    assert torch.equal(x_dbl, ref_x_dbl)
    assert rel_err(y, ref_y.double()) < TOL[torch.float32]
    g_y, g_dbl = torch.randn_like(y), torch.randn_like(x_dbl)
    params = [x, *model.parameters()]
    got = torch.autograd.grad((y, x_dbl), params, (g_y, g_dbl))
    want = torch.autograd.grad((ref_y, ref_x_dbl), [x_ref, *model.parameters()], (g_y, g_dbl))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert rel_err(a, b.double()) < 4 * TOL[torch.float32], i


NEAR_MISSES = {
    # variant: the miss reason's start (None: not an x_dt_proj site at all, nothing to report)
    # (Probe CJ, run 61: a later piece of the split was left alone with no reason.)
    "middle_columns": "dt_proj reads piece 1 of the split of x_proj's output x_dbl, not its first columns",
    "x_proj_bias": "dt_proj reads the first 3 columns of x_dbl, which adds a bias",
    "written": "mul_",
    "cast": "dt_proj reads x_proj's first columns cast to torch.bfloat16, not the columns themselves",
    "tanh": "dt_proj reads tanh = torch.tanh of x_proj's first columns, not the columns themselves",
    "scaled_left": "dt_proj reads mul = operator.mul of x_proj's first columns, not the columns themselves",
    "where": "dt_proj reads where = torch.where of x_proj's first columns, not the columns themselves",
    "round_trip": "dt_proj reads x_proj's first columns cast to torch.float32, not the columns themselves",
    "rows_middle_columns": None,
    # dt_proj does read x_dbl's first columns, but not from a product the op computes (a
    # forward hook that rescales x_proj's output is the same case: test_rescaled_x_proj_says_so).
    "einsum_permuted": "dt_proj reads the first 3 columns of x_dbl, which is .transpose, not a bias-free",
    "einsum_broadcast": "dt_proj reads the first 3 columns of x_dbl, which is torch.functional.einsum, not",
    "einsum_dt_transposed": None,
    "tensor_split_late": "dt_proj reads the first 3 columns of dt, which is a piece of torch.tensor_split, not",
    # (Probe CR, run 63: both were left alone with no reason.)
    "chunk_last": "dt_proj reads piece 2 of the chunk of x_proj's output x_dbl, not its first columns",
    "offset_slice": "dt_proj reads columns 1:4 of x_proj's output x_dbl, not its first 3: ssm.x_dt_proj computes "
                    "dt from the first R columns",
    "offset_narrow": "dt_proj reads columns 1:4 of x_proj's output x_dbl, not its first 3",
}


@pytest.mark.parametrize("variant", list(NEAR_MISSES))
def test_near_misses_are_left_alone(variant):
    torch.manual_seed(0)
    model = XDt(variant)
    x = torch.randn(2, 7, 8)
    # no_grad: autograd forbids the in-place write to a split's base when grads are recorded.
    with torch.no_grad():
        cap, (y, x_dbl) = _compiled(model, x)
        torch._dynamo.reset()
        ref_y, ref_x_dbl = model(x)
    assert not _x_dt_ops(cap.gm)
    misses = [m.reason for m in cap.ctx.misses if m.family == "x_dt_proj"]
    if NEAR_MISSES[variant] is None:
        assert not misses
    else:
        assert misses and misses[0].startswith(NEAR_MISSES[variant]), misses
    assert torch.equal(x_dbl, ref_x_dbl)
    # "cast" runs dt_proj in bf16: the scan's other folds may round differently from eager there.
    assert rel_err(y, ref_y.double()) < TOL[torch.bfloat16 if variant == "cast" else torch.float32]


def test_rescaled_x_proj_says_so():
    # A forward hook that rescales x_proj's output (probe BX, run 58): dt_proj reads columns of
    # the product times 1.5, which the op does not compute; it used to be refused silently.
    torch.manual_seed(0)
    model = XDt("split")
    model.x_proj.register_forward_hook(lambda mod, args, out: out * 1.5)
    x = torch.randn(2, 7, 8)
    cap, (y, x_dbl) = _compiled(model, x)
    assert not _x_dt_ops(cap.gm)
    misses = [m.reason for m in cap.ctx.misses if m.family == "x_dt_proj"]
    # The product's node name is Dynamo's (hook_result on torch 2.13).
    assert len(misses) == 1 and misses[0].startswith("dt_proj reads the first 3 columns of ") and (
        "which is operator.mul, not a bias-free linear of x: ssm.x_dt_proj computes only the two bias-free "
        "products, so x_proj and dt_proj stay as they are") in misses[0], misses
    torch._dynamo.reset()
    ref_y, ref_x_dbl = model(x)
    assert torch.equal(x_dbl, ref_x_dbl)
    assert rel_err(y, ref_y.double()) < TOL[torch.float32]


def test_fp64_is_left_alone_with_a_reason():
    # The op takes fp64 on CPU only (for gradcheck): an fp64 model's products stay, and explain
    # says so, as the conv pass does for its fp64 conv.
    torch.manual_seed(0)
    model = XDt("split").double()
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    cap, (y, _) = _compiled(model, x)
    misses = [m.reason for m in cap.ctx.misses if m.family == "x_dt_proj"]
    assert not _x_dt_ops(cap.gm) and any("run in torch.float64" in r for r in misses), misses
    torch._dynamo.reset()
    assert rel_err(y, model(x)[0]) < TOL[torch.float64]


def test_mixed_dtypes_are_a_near_miss():
    # dt_proj's weight in fp32 and x_proj's in bf16: eager's dt_proj promotes nothing (F.linear
    # refuses mixed dtypes), so the user casts; a cast between them is not an x_dt_proj site,
    # while an autocast region that changes a product's dtype is reported.
    torch.manual_seed(0)
    model = XDt("split")
    x = torch.randn(2, 7, 8)

    def under_autocast(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    cap, (y, _) = _compiled(under_autocast, x)
    assert not _x_dt_ops(cap.gm)
    misses = [m.reason for m in cap.ctx.misses if m.family == "x_dt_proj"]
    assert misses and "mix dtypes" in misses[0], misses
    torch._dynamo.reset()
    assert rel_err(y, under_autocast(x)[0].double()) < TOL[torch.bfloat16]


def test_dt_of_no_columns_keeps_the_other_rewrites():
    # R = 0 (``x_dbl.split([0, N, N])``, dt_proj of no columns is its bias): the pass built an op
    # that refused R = 0 inside it, and the graph lost every rewrite (probe CQ, run 62).
    from ssm_compile.kernels.selective_scan.op import selective_scan_fn
    from ssm_compile.report import explain

    def fn(x, w_x, w_dt, bias, A):
        x_dbl = F.linear(x, w_x)
        dt, B, C = x_dbl.split([0, 4, 4], dim=-1)
        delta = F.softplus(F.linear(dt, w_dt, bias))
        return selective_scan_fn(x.transpose(1, 2), delta.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2))

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 7, 8, generator=g), 0.3 * torch.randn(8, 8, generator=g), torch.randn(8, 0, generator=g),
            torch.randn(8, generator=g), -torch.rand(8, 4, generator=g) - 0.5)
    torch._dynamo.reset()
    report = explain(fn, *args)
    assert [r.family for r in report.rewrites] == ["delta"], str(report)
    assert not [m for m in report.misses if m.family == "x_dt_proj" or "internal" in m.reason], str(report)
    torch.testing.assert_close(report.output, fn(*args))
