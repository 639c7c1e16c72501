"""The ``scan_assoc`` pass: ``associative_scan`` over (exp(Δ·A), Δ·B·u) -> ssm.selective_scan.

Both forms dynamo produces are covered: ``combine_mode="generic"`` (what HF picks on CPU: an
inlined odd/even scan with a vmapped combine) and ``combine_mode="pointwise"`` (HF on CUDA: the
``associative_scan`` HOP with the combine as a subgraph). ``associative_scan`` refuses
"pointwise" for CPU tensors before tracing, so ``pointwise_scan`` below replays its pointwise
branch (movedim, the HOP, movedim back) to get that graph on CPU.
"""
import functools

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from expecttest import assert_expected_inline
from torch._dynamo.utils import counters
from torch._higher_order_ops.associative_scan import (associative_scan, associative_scan_op,
                                                      wrap_combine_fn_flat)
from utils import TOL, rel_err

from ssm_compile.passes import delta as delta_pass
from ssm_compile.passes import scan_assoc
from ssm_compile.passes import tail as tail_pass
from ssm_compile.passes.fx_utils import normalized_graph_str
from ssm_compile.passes.manager import PassContext, PassManager

BATCH, DIM, N = 2, 5, 4


@pytest.fixture(scope="module", autouse=True)
def registered():
    # The rewritten graphs call torch.ops.ssm.*; the op must exist before they are traced.
    from ssm_compile.kernels.selective_scan import op

    op.register()


class Captured:
    """A backend running scan_assoc (and optionally delta + tail) on dynamo's graph.

    ``manager=False`` runs the pass alone without the manager's dead-code elimination, which
    would drop the vmap bookkeeping calls of an associative scan left in place (see the report).
    """

    def __init__(self, fold=False, manager=True):
        self.fold, self.manager = fold, manager
        self.gm, self.ctx = None, None

    def __call__(self, gm, example_inputs):
        if self.manager:
            pm = PassManager()
            scan_assoc.register(pm)
            if self.fold:
                delta_pass.register(pm)
                tail_pass.register(pm)
            self.ctx = pm(gm)
        else:
            self.ctx = PassContext()
            scan_assoc.scan_assoc_pass(gm, self.ctx)
            gm.graph.lint()
            gm.recompile()
        self.gm = gm
        return gm.forward


def compile_and_run(fn, *args, **kw):
    cap = Captured(**kw)
    out = torch.compile(fn, backend=cap, fullgraph=True)(*args)
    return cap, out


def pointwise_scan(combine_fn, xs, dim):
    """``associative_scan(combine_fn, xs, dim, combine_mode="pointwise")`` minus its CUDA check."""
    leaves, spec = pytree.tree_flatten(xs)
    leaves = [torch.movedim(x, dim, 0) for x in leaves]
    flat = functools.partial(wrap_combine_fn_flat, combine_fn=combine_fn, spec=spec, num_leaves=len(leaves))
    out = associative_scan_op(flat, leaves, additional_inputs=())
    return pytree.tree_unflatten([torch.movedim(o, 0, dim) for o in out], spec)


def run_scan(mode, combine_fn, xs, dim):
    if mode == "pointwise":
        return pointwise_scan(combine_fn, xs, dim)
    return associative_scan(combine_fn, xs, dim=dim, combine_mode="generic")


def make_inputs(length, dtype=torch.float32, layout="bdl"):
    """Random (never zero) inputs in HF's argument order: u, dt, A, B, C, D, z, delta_bias."""
    g = torch.Generator().manual_seed(length)
    act = (BATCH, DIM, length) if layout == "bdl" else (BATCH, length, DIM)
    bc = (BATCH, N, length) if layout == "bdl" else (BATCH, length, N)
    return (
        torch.randn(act, generator=g).to(dtype),
        (torch.randn(act, generator=g) * 0.5).to(dtype),
        -torch.rand(DIM, N, generator=g) - 0.5,
        torch.randn(bc, generator=g).to(dtype),
        torch.randn(bc, generator=g).to(dtype),
        torch.randn(DIM, generator=g),
        torch.randn(act, generator=g).to(dtype),
        torch.randn(DIM, generator=g) * 0.5,
    )


def check_close(out, ref, dtype=torch.float32):
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert rel_err(o, r) <= TOL[dtype], rel_err(o, r)


def from_A_log(fn):
    """``fn`` with A = -exp(A_log) computed inside, as a model's mixer computes it before calling
    HF's ``mamba_selective_scan``: compiled whole, the graph shows exp(Δ·A) <= 1, so the op starts
    from a zero state. With A passed in, it starts from B_full[t=0] (``test_A_passed_in``)."""
    def with_A_log(hidden_states, dt, A_log, B, C, D, z, delta_bias, **kw):
        return fn(hidden_states, dt, -torch.exp(A_log), B, C, D, z, delta_bias, **kw)
    return with_A_log


def A_log_inputs(*args, **kw):
    """``make_inputs`` with A replaced by its A_log."""
    args = list(make_inputs(*args, **kw))
    args[2] = torch.log(-args[2])
    return args


def fired(*families):
    return {f: counters["ssm"][f] for f in families}


def reference(fn, *args):
    """Eager: the generic scan runs eagerly; the pointwise form only traced, so use generic."""
    return fn(*args, mode="generic")


# --- combines ---------------------------------------------------------------------------------

def combine_hf(left, right):
    a_left, b_left = left
    a_right, b_right = right
    return a_left * a_right, a_right * b_left + b_right


def combine_rewritten(left, right):
    # The same map, spelled differently: sympy proves it equal.
    return right[0] * left[0], right[1] + left[1] * right[0]


def combine_addcmul(left, right):
    # S5 / mamba-jax ports: the b half as one call, torch.addcmul(b_r, a_r, b_l) = b_r + a_r * b_l.
    return left[0] * right[0], torch.addcmul(right[1], right[0], left[1])


def combine_addcmul_method(left, right):
    return left[0] * right[0], right[1].addcmul(left[1], right[0])


def combine_addcmul_wrong_order(left, right):
    # b_l + a_l * b_r: the right-to-left composition, spelled as addcmul.
    return left[0] * right[0], torch.addcmul(left[1], left[0], right[1])


def combine_addcmul_scaled(left, right):
    return left[0] * right[0], torch.addcmul(right[1], right[0], left[1], value=0.5)


def combine_swapped_leaves(left, right):
    # Leaves passed as (b, a): the pass finds which one is the multiplier.
    b_left, a_left = left
    b_right, a_right = right
    return a_right * b_left + b_right, a_left * a_right


def combine_wrong_order(left, right):
    # The right-to-left composition: h = a_l*b_r + b_l is a different recurrence.
    a_left, b_left = left
    a_right, b_right = right
    return a_left * a_right, a_left * b_right + b_left


def combine_nonlinear(left, right):
    a_left, b_left = left
    a_right, b_right = right
    return a_left * a_right, torch.tanh(a_right * b_left + b_right)


def combine_divides(left, right):
    # Algebra cancels a_l / a_l; the floats give NaN where a decay underflowed to 0.
    a_left, b_left = left
    a_right, b_right = right
    return a_left * a_right, a_right * b_left + b_right * a_left / a_left


def combine_quadratic(left, right):
    a_left, b_left = left
    a_right, b_right = right
    return a_left * a_right, a_right * b_left * b_left + b_right


# --- the user code ----------------------------------------------------------------------------

def hf_selective_scan(hidden_states, dt, A, B, C, D, z, delta_bias, mode="generic", combine=combine_hf,
                      a_plus_one=False, return_products=False):
    """transformers 5.24 ``mamba_selective_scan`` (use_associative_scan=True), line for line."""
    input_dtype = hidden_states.dtype
    dt = dt + delta_bias.to(dt.dtype)[..., None]
    dt = F.softplus(dt)
    B = B.transpose(1, 2)
    C = C.transpose(1, 2)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    if a_plus_one:
        discrete_A = discrete_A + 1
    discrete_B = dt[:, :, :, None] * B[:, None, :, :].float()
    deltaB_u = discrete_B * hidden_states[:, :, :, None].float()
    if combine is combine_swapped_leaves:
        all_states, products = run_scan(mode, combine, (deltaB_u, discrete_A), dim=2)
    else:
        products, all_states = run_scan(mode, combine, (discrete_A, deltaB_u), dim=2)
    scan_output = torch.matmul(all_states.transpose(1, 2).to(input_dtype), C.unsqueeze(-1))
    scan_output = scan_output.squeeze(-1).transpose(1, 2)
    ssm_state = all_states[:, :, -1]
    scan_output = scan_output + hidden_states * D[None, :, None]
    scan_output = scan_output * F.silu(z)
    if return_products:
        return scan_output, products
    return scan_output, ssm_state


def ref_style(u, delta, A, B, C, D, z, delta_bias, mode="generic"):
    """mamba_ssm selective_scan_ref's einsums, (batch, dim, L), with an einsum readout."""
    delta = F.softplus(delta + delta_bias[..., None].float())
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    _, x = run_scan(mode, combine_hf, (deltaA, deltaB_u), dim=2)
    y = torch.einsum("bdln,bnl->bdl", x, C)
    return y + u * D[:, None], x[:, :, -1, :]


def time_invariant_B(u, delta, A, B, C, D, z, delta_bias, mode="generic"):
    """selective_scan_ref with a time-invariant B (dim, N): grouped B with G = dim in the op."""
    B_dn = B[0, :, : u.shape[1]].transpose(0, 1)
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,dn,bdl->bdln", delta, B_dn, u)
    _, x = run_scan(mode, combine_hf, (deltaA, deltaB_u), dim=2)
    return torch.einsum("bdln,bnl->bdl", x, C)


def minimal_style(u, delta, A, B, C, D, z, delta_bias, mode="generic"):
    """mamba-minimal's (batch, L, dim) layout, time on axis 1, readout as a broadcast sum."""
    delta = F.softplus(delta + delta_bias)
    deltaA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
    deltaB_u = torch.einsum("bld,bln,bld->bldn", delta, B, u)
    _, x = run_scan(mode, combine_rewritten, (deltaA, deltaB_u), dim=1)
    y = (x * C[:, :, None, :]).sum(-1)
    return (y + u * D) * F.silu(z)


# --- positive cases ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["generic", "pointwise"])
@pytest.mark.parametrize("length", [2, 5, 13], ids=lambda n: f"L{n}")
def test_hf_form(length, mode):
    fn = from_A_log(hf_selective_scan)
    args = A_log_inputs(length)
    ref = reference(fn, *args)
    cap, out = compile_and_run(functools.partial(fn, mode=mode), *args, fold=True)
    assert fired("scan_assoc", "discretization", "readout", "delta", "skip", "gate") == dict(
        scan_assoc=1, discretization=1, readout=1, delta=1, skip=1, gate=1), cap.ctx.misses
    assert cap.ctx.rewrites[0].decision["combine_mode"] == mode
    assert "first_state" not in cap.ctx.rewrites[0].decision
    check_close(out, ref)


@pytest.mark.parametrize("mode", ["generic", "pointwise"])
@pytest.mark.parametrize("length", [2, 7], ids=lambda n: f"L{n}")
def test_A_passed_in(length, mode):
    # HF's mamba_selective_scan compiled on its own takes A as an argument: nothing shows
    # exp(Δ·A) finite at t = 0, so the op starts from B_full[t=0] (with Δ[t=0] = 0, a copy of Δ
    # that the softplus is not folded through); the skip and the gate still fold.
    args = make_inputs(length)
    ref = reference(hf_selective_scan, *args)
    cap, out = compile_and_run(functools.partial(hf_selective_scan, mode=mode), *args, fold=True)
    assert fired("scan_assoc", "discretization", "readout", "delta", "skip", "gate") == dict(
        scan_assoc=1, discretization=1, readout=1, delta=0, skip=1, gate=1), cap.ctx.misses
    assert cap.ctx.rewrites[0].decision["first_state"].startswith("B_full[t=0] as h_{-1} with Δ[t=0] = 0")
    check_close(out, ref)


@pytest.mark.parametrize("form", ["hf", "in_place"])
@pytest.mark.parametrize("case", ["first_decay_inf", "positive_A"])
def test_an_unbounded_first_decay_keeps_the_scans_first_state(form, case):
    # Probe CC (run 59): Δ not from softplus and A passed in. An associative or in-place
    # parallel scan's first state is B_full[t=0]; a scan from a zero state computes
    # exp(Δ·A)[t=0] * 0 + B_full[t=0], NaN where that decay is infinite, and NaN reached the whole
    # channel. The values are eager's, and so are the gradients where eager's are finite.
    import ssm_compile

    g = torch.Generator().manual_seed(3)
    u, delta, B, C = (torch.randn(BATCH, DIM, 6, generator=g), torch.rand(BATCH, DIM, 6, generator=g) + 0.1,
                      torch.randn(BATCH, N, 6, generator=g), torch.randn(BATCH, N, 6, generator=g))
    if case == "first_decay_inf":
        A = -torch.rand(DIM, N, generator=g) * 1e3 - 1e3
        delta[:, :, 0] = -torch.rand(BATCH, DIM, generator=g) - 0.5  # Δ·A at t = 0 far above 88
    else:
        A = torch.rand(DIM, N, generator=g) * 5 + 5  # growing states, finite at every step

    def scan(u, delta, A, B, C):
        dA = torch.exp(delta[..., None] * A[:, None, :])
        dBu = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
        if form == "hf":
            states = associative_scan(combine_hf, (dA, dBu), dim=2, combine_mode="generic")[1]
        else:  # mamba.py's PScan: Blelloch's up and down sweeps in place on padded copies
            from test_pass_scan_inplace import _down, _up

            L = dA.shape[2]
            T = 1 << (L - 1).bit_length()
            Ac, Xc = F.pad(dA, (0, 0, 0, T - L)), F.pad(dBu, (0, 0, 0, T - L))
            _up(Ac, Xc, T)
            _down(Ac, Xc, T)
            states = Xc[:, :, :L]
        return (states * C.transpose(1, 2)[:, None]).sum(-1)

    # Autograd cannot differentiate the in-place sweep in eager (it overwrites what it saved).
    grads = form == "hf"
    args = [t.requires_grad_(grads) for t in (u, delta, A, B, C)]
    ref = scan(*args)
    assert ref.isfinite().all()
    report = ssm_compile.explain(scan, *args)
    families = {r.family for r in report.rewrites}
    assert families >= {"scan_assoc", "discretization"}, report
    assert any("first_state" in r.decision for r in report.rewrites), report
    torch._dynamo.reset()
    out = torch.compile(scan, backend="ssm")(*args)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if not grads:
        return
    for got, want in zip(torch.autograd.grad(out, args, torch.ones_like(out)),
                         torch.autograd.grad(ref, args, torch.ones_like(ref))):
        # exp(Δ·A) at t = 0 is inf and unused; torch's generic scan still multiplies its zero
        # gradient through it (0 * inf = NaN in eager's dΔ and dA there). The true gradient is
        # finite, and so is the op's.
        assert got.isfinite().all()
        ok = want.isfinite()
        torch.testing.assert_close(got[ok], want[ok], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["generic", "pointwise"])
@pytest.mark.parametrize("form", ["ref_style", "minimal_style", "swapped_leaves", "addcmul", "addcmul_method", "bf16",
                                  "time_invariant_B"])
def test_other_forms(form, mode):
    fn, layout, dtype = {
        "ref_style": (ref_style, "bdl", torch.float32),
        "minimal_style": (minimal_style, "bld", torch.float32),
        "swapped_leaves": (functools.partial(hf_selective_scan, combine=combine_swapped_leaves), "bdl",
                           torch.float32),
        "addcmul": (functools.partial(hf_selective_scan, combine=combine_addcmul), "bdl", torch.float32),
        "addcmul_method": (functools.partial(hf_selective_scan, combine=combine_addcmul_method), "bdl", torch.float32),
        "bf16": (hf_selective_scan, "bdl", torch.bfloat16),
        "time_invariant_B": (time_invariant_B, "bdl", torch.float32),
    }[form]
    fn = from_A_log(fn)
    args = A_log_inputs(7, dtype, layout)
    ref = reference(fn, *args)
    cap, out = compile_and_run(functools.partial(fn, mode=mode), *args, fold=True)
    assert fired("scan_assoc", "discretization", "readout") == dict(
        scan_assoc=1, discretization=1, readout=1), cap.ctx.misses
    assert counters["ssm"]["delta"] == (0 if form == "time_invariant_B" else 1)
    check_close(out, ref, dtype)
    text = normalized_graph_str(cap.gm)
    # The one exp left is A = -exp(A_log)'s.
    assert text.count("torch.exp(") == 1 and "matmul" not in text and "einsum" not in text


def test_rewrite_needs_no_dead_code_elimination():
    # The pass itself removes the whole scan, the vmap nesting calls included: a batched value
    # left without its nesting level could not run.
    args = make_inputs(9)
    cap, out = compile_and_run(hf_selective_scan, *args, manager=False)
    assert counters["ssm"]["scan_assoc"] == 1
    check_close(out, reference(hf_selective_scan, *args))
    text = normalized_graph_str(cap.gm)
    assert "batch_dim" not in text and "vmap" not in text and "lazy_load" not in text


def test_pointwise_dynamic_length():
    # Under dynamic shapes the HOP scans a symbolic L (the generic form can't: its recursion
    # depends on L); dynamo lifts the sizes into the combine, which must not use them.
    cap = Captured(fold=True)
    fn = torch.compile(functools.partial(hf_selective_scan, mode="pointwise"), backend=cap, dynamic=True)
    for length in (5, 9):
        args = make_inputs(length)
        check_close(fn(*args), reference(hf_selective_scan, *args))
    # Every graph dynamo compiled (it may specialise once more) had its scan rewritten.
    assert counters["ssm"]["scan_assoc"] == counters["stats"]["unique_graphs"] >= 1, cap.ctx.misses
    assert isinstance(cap.ctx.rewrites[0].decision["L"], str)
    assert "associative_scan" not in normalized_graph_str(cap.gm)


def test_generic_dynamic_length_is_proved_at_every_admitted_length():
    # The generic form's slices need concrete sizes; with a symbolic L the pass re-runs its proof
    # at every length the graph's guards admit (they pin the odd/even recursion, so few remain).
    cap = Captured(fold=True)
    fn = torch.compile(functools.partial(hf_selective_scan, mode="generic"), backend=cap, dynamic=True)
    for length in (6, 12):
        args = make_inputs(length)
        check_close(fn(*args), reference(hf_selective_scan, *args))
    assert counters["ssm"]["scan_assoc"] == counters["stats"]["unique_graphs"] >= 1, cap.ctx.misses
    symbolic = [r.decision for r in cap.ctx.rewrites if r.family == "scan_assoc" and isinstance(r.decision["L"], str)]
    assert symbolic, "no graph had a symbolic L"
    assert 12 in symbolic[-1]["proved_lengths"]
    assert "batch_dim" not in normalized_graph_str(cap.gm)


@pytest.mark.parametrize("length", [2, 3, 5], ids=lambda n: f"L{n}")
def test_generic_form_with_a_dynamic_batch(length):
    """``dynamic=True`` at these lengths specialises L but keeps the batch symbolic: vmap then
    reads each combine level's size (``child.size(0)``), a pinned SymInt dynamo records as a node.
    That read used to stop the proof (HF generate's first dynamic prefill kept its layer 0 scan,
    and its cached state's storage offset then cost a recompile)."""
    cap = Captured(fold=True)
    fn = torch.compile(functools.partial(hf_selective_scan, mode="generic"), backend=cap, dynamic=True)
    args = make_inputs(length)
    check_close(fn(*args), reference(hf_selective_scan, *args))
    assert counters["ssm"]["scan_assoc"] == counters["stats"]["unique_graphs"] == 1, cap.ctx.misses


def test_generic_dynamic_length_with_too_many_lengths_is_a_miss(monkeypatch):
    # When the guards leave more lengths than the pass will enumerate, the scan stays as it is
    # and the miss says why.
    monkeypatch.setattr(scan_assoc, "_MAX_LENGTHS", 0)
    cap = Captured()
    fn = torch.compile(functools.partial(hf_selective_scan, mode="generic"), backend=cap, dynamic=True)
    args = make_inputs(12)
    check_close(fn(*args), reference(hf_selective_scan, *args))
    assert counters["ssm"]["scan_assoc"] == 0
    assert any(m.family == "scan_assoc" and "proved length by length" in m.reason for m in cap.ctx.misses), \
        cap.ctx.misses


def test_hf_generic_snapshot():
    cap, _ = compile_and_run(from_A_log(hf_selective_scan), *A_log_inputs(6), fold=True)
    assert_expected_inline(normalized_graph_str(cap.gm), """\
%L_A_log_ = placeholder
%L_B_ = placeholder
%L_C_ = placeholder
%L_D_ = placeholder
%L_delta_bias_ = placeholder
%L_dt_ = placeholder
%L_hidden_states_ = placeholder
%L_z_ = placeholder
%exp_1 = torch.exp(%L_A_log_)
%neg_1 = operator.neg(%exp_1)
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%L_hidden_states_, %L_dt_, %neg_1, %L_B_, %L_C_, %L_D_, %L_z_, %L_delta_bias_, True, None, True)
%getitem_1 = operator.getitem(%selective_scan_1, 0)
%getitem_2 = operator.getitem(%selective_scan_1, 1)
%permute_1 = .permute(%getitem_1, 0, 2, 1)
%contiguous_1 = .contiguous(%permute_1)
%permute_2 = .permute(%contiguous_1, 0, 2, 1)
return (%permute_2, %getitem_2)
""")


def test_pointwise_snapshot_scan_only():
    # scan_assoc alone: Δ, the skip and the gate stay in plain torch around the op.
    cap, _ = compile_and_run(functools.partial(hf_selective_scan, mode="pointwise"), *make_inputs(6))
    assert_expected_inline(normalized_graph_str(cap.gm), """\
%L_args_0_ = placeholder
%L_args_1_ = placeholder
%L_args_2_ = placeholder
%L_args_3_ = placeholder
%L_args_4_ = placeholder
%L_args_5_ = placeholder
%L_args_6_ = placeholder
%L_args_7_ = placeholder
%getitem_1 = operator.getitem(%L_args_7_, (..., None))
%add_1 = operator.add(%L_args_1_, %getitem_1)
%softplus_1 = torch._C._nn.softplus(%add_1)
%getitem_2 = operator.getitem(%L_args_0_, (:, :, 0))
%getitem_3 = operator.getitem(%softplus_1, (:, :, 0))
%getitem_4 = operator.getitem(%L_args_3_, (:, None, :, 0))
%mul_1 = operator.mul(%getitem_3, %getitem_2)
%getitem_5 = operator.getitem(%mul_1, (:, :, None))
%mul_2 = operator.mul(%getitem_5, %getitem_4)
%getitem_6 = operator.getitem(%softplus_1, (..., :1))
%zeros_like_1 = torch.zeros_like(%getitem_6)
%getitem_7 = operator.getitem(%softplus_1, (..., 1:))
%cat_1 = torch.cat([%zeros_like_1, %getitem_7], -1)
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%L_args_0_, %cat_1, %L_args_2_, %L_args_3_, %L_args_4_, None, None, None, False, %mul_2, True)
%getitem_8 = operator.getitem(%selective_scan_1, 0)
%getitem_9 = operator.getitem(%selective_scan_1, 1)
%getitem_10 = operator.getitem(%L_args_5_, (None, :, None))
%mul_3 = operator.mul(%L_args_0_, %getitem_10)
%add_2 = operator.add(%getitem_8, %mul_3)
%silu_1 = torch.nn.functional.silu(%L_args_6_)
%mul_4 = operator.mul(%add_2, %silu_1)
%permute_1 = .permute(%mul_4, 0, 2, 1)
%contiguous_1 = .contiguous(%permute_1)
%permute_2 = .permute(%contiguous_1, 0, 2, 1)
return (%permute_2, %getitem_9)
""")


# --- negative cases ---------------------------------------------------------------------------

def uses_states(u, delta, A, B, C, D, z, delta_bias, mode="generic"):
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    _, x = run_scan(mode, combine_hf, (deltaA, deltaB_u), dim=2)
    # The (batch, dim, L, N) states themselves are an output: nothing to rewrite into.
    return torch.einsum("bdln,bnl->bdl", x, C), x.sum(-1)


def reversed_scan(u, delta, A, B, C, D, z, delta_bias, mode="generic"):
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    _, x = associative_scan(combine_hf, (deltaA, deltaB_u), dim=2, reverse=True, combine_mode="generic")
    return torch.einsum("bdln,bnl->bdl", x, C)


NEGATIVE = {
    # name: (fn, modes, (family, reason fragment))
    "wrong_order": (functools.partial(hf_selective_scan, combine=combine_wrong_order),
                    ("generic", "pointwise"), ("scan_assoc", "a_r*b_l + b_r")),
    "addcmul_wrong_order": (functools.partial(hf_selective_scan, combine=combine_addcmul_wrong_order),
                            ("generic", "pointwise"), ("scan_assoc", "a_r*b_l + b_r")),
    "addcmul_scaled": (functools.partial(hf_selective_scan, combine=combine_addcmul_scaled),
                       ("generic", "pointwise"), ("scan_assoc", "addcmul")),
    "nonlinear": (functools.partial(hf_selective_scan, combine=combine_nonlinear),
                  ("generic", "pointwise"), ("scan_assoc", "tanh")),
    "quadratic": (functools.partial(hf_selective_scan, combine=combine_quadratic),
                  ("generic", "pointwise"), ("scan_assoc", "combine computes")),
    "divides": (functools.partial(hf_selective_scan, combine=combine_divides),
                ("generic", "pointwise"), ("scan_assoc", "divides by one of its inputs")),
    "not_exp_dA": (functools.partial(hf_selective_scan, a_plus_one=True), ("generic", "pointwise"),
                   ("discretization", "exp")),
    "products_used": (functools.partial(hf_selective_scan, return_products=True), ("generic", "pointwise"),
                      ("scan_assoc", "cumulative product")),
    "states_used": (uses_states, ("generic", "pointwise"), ("readout", "neither a readout")),
    "reversed": (reversed_scan, ("generic",), ("scan_assoc", "reverse")),
}


@pytest.mark.parametrize("case,mode", [(c, m) for c, (_, modes, _) in NEGATIVE.items() for m in modes],
                         ids=lambda x: x)
def test_refused(case, mode):
    fn, _, (family, fragment) = NEGATIVE[case]
    args = make_inputs(6)
    cap, out = compile_and_run(functools.partial(fn, mode=mode), *args, manager=False)
    assert fired("scan_assoc", "discretization", "readout") == dict(scan_assoc=0, discretization=0, readout=0)
    reasons = [m.reason for m in cap.ctx.misses if m.family == family]
    assert any(fragment in r for r in reasons), cap.ctx.misses
    assert "selective_scan" not in normalized_graph_str(cap.gm)
    if mode == "generic":
        # The graph left in place still computes what eager does (the pointwise HOP has no
        # CPU kernel, so only its generic twin runs here).
        check_close(out, fn(*args, mode="generic"))


def test_prove_combine_directly():
    def trace(fn):
        return torch.fx.symbolic_trace(lambda al, bl, ar, br: list(fn((al, bl), (ar, br))))

    assert scan_assoc.prove_combine(trace(combine_hf)) == (0, 1)
    assert scan_assoc.prove_combine(trace(combine_rewritten)) == (0, 1)
    assert scan_assoc.prove_combine(trace(combine_swapped_leaves)) == (1, 0)
    assert scan_assoc.prove_combine(trace(combine_addcmul)) == (0, 1)
    assert scan_assoc.prove_combine(trace(combine_addcmul_method)) == (0, 1)
    assert "not the linear-recurrence combine" in scan_assoc.prove_combine(trace(combine_wrong_order))
    assert "tanh" in scan_assoc.prove_combine(trace(combine_nonlinear))
    assert "divides by one of its inputs" in scan_assoc.prove_combine(trace(combine_divides))
    # Numbers are exact to the algebra, not to the floats: (2 * b_r) / 2 overflows where b_r
    # exceeds half the largest float, b_r + 1e16 - 1e16 loses b_r. Only 0 and ±1 are taken.
    assert "the number 2" in scan_assoc.prove_combine(trace(lambda l, r: (l[0] * r[0], r[0] * l[1] + (2 * r[1]) / 2)))
    assert "the number 1e+16" in scan_assoc.prove_combine(
        trace(lambda l, r: (l[0] * r[0], r[0] * l[1] + 1e16 + r[1] - 1e16)))
    assert scan_assoc.prove_combine(trace(lambda l, r: (l[0] * r[0] * 1, r[0] * l[1] + r[1] - 0))) == (0, 1)
    # A term that both sides of a sum hold cancels to the algebra, gives inf - inf in floats.
    assert "share the term" in scan_assoc.prove_combine(
        trace(lambda l, r: (l[0] * r[0], r[0] * l[1] + r[1] + l[1] - l[1])))


@pytest.mark.parametrize("readout", ["flipped-states", "flipped-C"])
def test_reverse_scan_of_flipped_operands(readout):
    """associative_scan over (dA.flip(t), dBu.flip(t)): exp(Δ·A).flip(t) is exp(Δ.flip(t)·A), so the
    op scans u, Δ and B flipped (run 60; probe BK, run 54, had it named a flipped exp and left
    alone). Read out on the scan's own states (with C flipped to match), it is rewritten; read
    out after flipping the states back, the readout is what is refused, with that reason."""
    from ssm_compile import explain

    g = torch.Generator().manual_seed(0)
    b, d, L, N = 2, 4, 5, 3
    u, delta = torch.randn(b, d, L, generator=g), torch.rand(b, d, L, generator=g) + 0.1
    A = -torch.rand(d, N, generator=g) - 0.5
    B, C = torch.randn(b, N, L, generator=g), torch.randn(b, N, L, generator=g)

    def fn(u, delta, A, B, C):
        dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
        dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
        _, hs = associative_scan(lambda l, r: (l[0] * r[0], r[0] * l[1] + r[1]), (dA.flip(2), dBu.flip(2)), dim=2,
                                 combine_mode="generic")
        if readout == "flipped-C":
            return torch.einsum("bdln,bnl->bdl", hs, C.flip(2)).flip(2)
        return torch.einsum("bdln,bnl->bdl", hs.flip(2), C)

    report = explain(fn, u, delta, A, B, C)
    if readout == "flipped-C":
        assert "scan_assoc" in [r.family for r in report.rewrites], report.format(graphs=False)
    else:
        assert not report.rewrites
        assert any("neither a readout" in m.reason for m in report.misses), report.format(graphs=False)
    torch.testing.assert_close(report.output, fn(u, delta, A, B, C), rtol=1e-5, atol=1e-6)
