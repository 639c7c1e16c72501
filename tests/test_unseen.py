"""An adversarial review: Mamba-1 code and look-alikes that no pass was written against.

The passes must match by what code computes. Two failure modes are checked, worst first:

1. an unsound rewrite: a look-alike that is NOT ``h_t = exp(Δ_t·A)⊙h_{t-1} + Δ_t·B_t·u_t,
   y_t = C_t·h_t (+ D·u_t)(·silu(z_t))`` gets rewritten, or a rewrite drops or changes something
   (a bias, a scale, a group mapping, a softplus variant, the order of skip and gate). Each
   look-alike must be left alone with a reason in ``explain`` and give eager's result bit for bit,
   or (for the tail folds, where the scan itself is real) fold only what is provably the op's;
2. a missed rewrite of real Mamba-1 code in another style (``torch.bmm`` readouts, a ``while``
   loop, einops' grouped ``repeat`` as dynamo traces it, mamba_ssm's ``selective_scan_ref``).

The styles come from public Mamba code (mamba_ssm's ``selective_scan_ref`` and
``selective_state_update``, mamba-minimal, mamba.py, VMamba-style flips, S6 layers written from
the paper), rewritten here in a few lines each. Cases run the full pipeline without inductor
(``explain`` uses ``backend(inductor=False)``); one case goes through ``backend="ssm"``.

Decision recorded here (``test_low_precision_state_is_rewritten_and_at_least_as_accurate``): a
state the user keeps in bf16 (``torch.zeros(..., dtype=u.dtype)``, or rounded to bf16 each step) is
rewritten. The op accumulates low-precision inputs in fp32 (its contract, and mamba_ssm's CUDA
kernel's), so the rewrite differs from eager only by eager's own bf16 rounding of the state and is
at least as close to the exact recurrence. The opposite case, a float64 state with fp32 inputs,
is refused (test_variants.py): there the op would be *less* accurate than the user's code. The
same policy covers a Δ rounded to bf16 before the folded softplus
(``test_rounded_delta_is_folded_and_at_least_as_accurate``): every pass treats a float-to-float
cast as value-preserving, except where the state's float64 accuracy would be lost.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._higher_order_ops.associative_scan import associative_scan
from utils import TOL, PassCapture, rel_err

from ssm_compile.kernels.decode import op as decode_op
from ssm_compile.passes import decode, scan_loop
from ssm_compile.report import explain

BATCH, DIM, N, L, G = 2, 6, 4, 7, 3
SCAN = ("scan_loop", "discretization", "readout")
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


def make_inputs(dtype=torch.float32, length=L):
    g = torch.Generator().manual_seed(0)
    u = torch.randn(BATCH, DIM, length, generator=g)
    delta = torch.rand(BATCH, DIM, length, generator=g) * 0.5 + 0.05
    A = -torch.rand(DIM, N, generator=g) - 0.5
    B = torch.randn(BATCH, N, length, generator=g)
    C = torch.randn(BATCH, N, length, generator=g)
    return u.to(dtype), delta.to(dtype), A, B.to(dtype), C.to(dtype)


def make_tail_inputs():
    """u, a raw dt (softplus still to apply), A, B, C, D, z and a dt bias."""
    g = torch.Generator().manual_seed(1)
    u, _, A, B, C = make_inputs()
    return (u, torch.randn(BATCH, DIM, L, generator=g), A, B, C, torch.randn(DIM, generator=g),
            torch.randn(BATCH, DIM, L, generator=g), torch.randn(DIM, generator=g) * 0.5)


def make_grouped_inputs():
    g = torch.Generator().manual_seed(5)
    u, delta, A, _, _ = make_inputs()
    return u, delta, A, torch.randn(BATCH, G, N, L, generator=g), torch.randn(BATCH, G, N, L, generator=g)


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def assert_close(out, ref, tol=TOL[torch.float32]):
    for o, r in zip(as_tuple(out), as_tuple(ref), strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert rel_err(o, r) <= tol


def scan_families(report):
    return {f: n for f, n in report.counts.items() if f in ("scan_loop", "scan_assoc")}


def assert_left_alone(fn, args, reason, family="scan_loop"):
    report = explain(fn, *args)
    assert not scan_families(report), report.format(graphs=False)
    assert any(reason in m.reason for m in report.misses if m.family == family), report.format(graphs=False)
    # The untouched graph runs eagerly: bit for bit eager's result.
    for o, r in zip(as_tuple(report.output), as_tuple(fn(*args)), strict=True):
        assert torch.equal(o, r)


def disc(u, delta, A, B):
    return torch.exp(torch.einsum("bdl,dn->bdln", delta, A)), torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)


def loop(dA, dBu, C, dtype=None):
    """The plain scan over precomputed A_full, B_full (batch, dim, L, N), readout by einsum, from a
    zero state of ``dtype`` (torch's default when None)."""
    h = torch.zeros(dA.shape[0], dA.shape[1], dA.shape[3], dtype=dtype)
    ys = []
    for i in range(dA.shape[2]):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]))
    return torch.stack(ys, dim=2)


def scan_with(update=lambda a_t, h, x_t: a_t * h + x_t,
              readout=lambda h, C, t: torch.einsum("bdn,bn->bd", h, C[:, :, t])):
    """``scan_y`` with its state update ``update(dA_t, h, dBu_t)`` or its readout
    ``readout(h, C, t)`` written another way."""
    def fn(u, delta, A, B, C):
        dA, dBu = disc(u, delta, A, B)
        h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
        ys = []
        for t in range(u.shape[2]):
            h = update(dA[:, :, t], h, dBu[:, :, t])
            ys.append(readout(h, C, t))
        return torch.stack(ys, dim=2)
    return fn


def scan_y(u, delta, A, B, C):
    return loop(*disc(u, delta, A, B), C)


# --- real Mamba-1 code in other styles: rewritten -----------------------------------------------

def bmm_readout(u, delta, A, B, C):
    """The readout as ``torch.bmm`` (a batched matrix-vector product per step)."""
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append(torch.bmm(h, C[:, :, i].unsqueeze(-1)).squeeze(-1))
    return torch.stack(ys, dim=2)


def matmul_index_readout(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append((h @ C[:, :, i, None])[..., 0])
    return torch.stack(ys, dim=-1)


def while_loop(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    i = 0
    while i < u.shape[2]:
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]))
        i += 1
    return torch.stack(ys, dim=2)


def bld_per_step_cat(u, delta, A, B, C):
    """(batch, L, dim) layout, discretised inside the loop, ``y.unsqueeze(1)`` collected by cat."""
    x, delta, B, C = (t.transpose(1, 2) for t in (u, delta, B, C))
    h = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    ys = []
    for i in range(x.shape[1]):
        dA = torch.exp(delta[:, i].unsqueeze(-1) * A)
        h = dA * h + (delta[:, i] * x[:, i]).unsqueeze(-1) * B[:, i].unsqueeze(1)
        ys.append((h @ C[:, i].unsqueeze(-1)).squeeze(-1).unsqueeze(1))
    return torch.cat(ys, dim=1)


def bld_precomputed_deltaA(u, delta, A, B, C):
    """mamba-minimal: ``deltaA = exp(einsum('bld,dn->bldn'))`` precomputed, state in u's dtype."""
    x, delta, B, C = (t.transpose(1, 2) for t in (u, delta, B, C))
    deltaA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
    deltaB_u = torch.einsum("bld,bln,bld->bldn", delta, B, x)
    h = torch.zeros(x.shape[0], x.shape[2], A.shape[1], dtype=x.dtype)
    ys = []
    for i in range(x.shape[1]):
        h = deltaA[:, i] * h + deltaB_u[:, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, i]))
    return torch.stack(ys, dim=1)


def flipped_scan(u, delta, A, B, C):
    """A backward (Vim/VMamba-style) direction: scan the flipped sequence, flip the output back."""
    u, delta, B, C = (t.flip(-1) for t in (u, delta, B, C))
    return scan_y(u, delta, A, B, C).flip(-1)


def clamped_delta(u, delta, A, B, C):
    """Δ clamped after softplus: Δ is then the clamp's output (softplus is not folded past it)."""
    return scan_y(u, F.softplus(delta - 1.0).clamp(min=0.1), A, B, C)


def last_state_used(u, delta, A, B, C):
    """The last state returned and also used in the output (chunked inference)."""
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]))
    return torch.stack(ys, dim=2) + h.sum(-1, keepdim=True), h * 2


def rolled_B(u, delta, A, B, C):
    """Δ·B'·u with B' = roll(B) a tensor of its own: a real scan (with that B), rewritten."""
    dA, _ = disc(u, delta, A, B)
    return loop(dA, torch.einsum("bdl,bnl,bdl->bdln", delta, B.roll(1, -1), u), C)


def _time_major_loop(a, x, C):
    """The scan over axis 1 of (batch, L, dim, N) decays and inputs."""
    h = torch.zeros(a.shape[0], a.shape[2], a.shape[3])
    ys = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + x[:, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, -1)


def permuted_after_exp(u, delta, A, B, C):
    """exp(Δ·A) permuted to loop over axis 1 after the exp (run 39's probe: no scan was found)."""
    dA, dBu = disc(u, delta, A, B)
    return _time_major_loop(dA.permute(0, 2, 1, 3), dBu.permute(0, 2, 1, 3), C)


def transposed_contiguous_after_exp(u, delta, A, B, C):
    """pscan's ``deltaA.transpose(1, 2)``, as a ``.contiguous()`` copy."""
    dA, dBu = disc(u, delta, A, B)
    return _time_major_loop(dA.transpose(1, 2).contiguous(), dBu.transpose(1, 2).contiguous(), C)


# Each step recomputes the whole cast C before slicing its own step: a loop invariant, the same
# values every step (run 40: was "does not repeat step 0's").
recomputed_each_step = scan_with(readout=lambda h, C, t: torch.einsum("bdn,bn->bd", h, C.double().float()[:, :, t]))


@pytest.mark.parametrize("fn", [bmm_readout, matmul_index_readout, while_loop, bld_per_step_cat, bld_precomputed_deltaA,
                                flipped_scan, clamped_delta, last_state_used, rolled_B, permuted_after_exp,
                                transposed_contiguous_after_exp, recomputed_each_step],
                         ids=["bmm-readout", "matmul-[...,0]-readout", "while-loop", "bld-per-step-cat",
                              "bld-precomputed-deltaA", "flipped-sequence", "clamped-delta", "last-state-used",
                              "rolled-B", "exp(...).permute", "exp(...).transpose.contiguous", "recomputed-each-step"])
def test_real_style_is_rewritten(fn):
    args = make_inputs()
    report = explain(fn, *args)
    assert {f: report.counts[f] for f in SCAN} == dict.fromkeys(SCAN, 1), report.format(graphs=False)
    assert_close(report.output, fn(*args))


def selective_scan_ref(u, delta, A, B, C, D, z, delta_bias):
    """mamba_ssm's ``selective_scan_ref`` (grouped B/C, every option on), written out by hand:
    einops' ``repeat(B, "B G N L -> B (G H) N L")`` is what dynamo traces it to."""
    dtype_in = u.dtype
    u, delta = u.float(), delta.float()
    delta = F.softplus(delta + delta_bias[..., None].float())
    batch, dim, dstate = u.shape[0], A.shape[0], A.shape[1]
    groups, length = B.shape[1], B.shape[3]

    def repeat(t):
        return t.unsqueeze(2).expand(-1, -1, dim // groups, -1, -1).reshape(batch, dim, dstate, length)

    B, C = repeat(B.float()), repeat(C.float())
    x = A.new_zeros((batch, dim, dstate))
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bdnl,bdl->bdln", delta, B, u)
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        y = torch.einsum("bdn,bdn->bd", x, C[:, :, :, i])
        if i == u.shape[2] - 1:
            last_state = x
        ys.append(y)
    y = torch.stack(ys, dim=2)
    out = y + u * D[:, None]
    out = out * F.silu(z)
    return out.to(dtype=dtype_in), last_state


def test_selective_scan_ref_grouped_end_to_end_with_inductor():
    u, dt, A, _, _, D, z, bias = make_tail_inputs()
    _, _, _, Bg, Cg = make_grouped_inputs()
    args = (u, dt, A, Bg, Cg, D, z, bias)
    out = torch.compile(selective_scan_ref, backend="ssm", fullgraph=True)(*args)
    assert {f: counters["ssm"][f] for f in SCAN + ("delta", "skip", "gate")} == dict.fromkeys(
        SCAN + ("delta", "skip", "gate"), 1)
    assert_close(out, selective_scan_ref(*args))


# --- groups: d // H is the op's mapping; any other per-channel B/C is read as it is (G = dim) -----

def grouped_loop(u, delta, A, B, C):
    """selective_scan_ref's grouped branch on per-channel (batch, dim, N, L) B and C."""
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = torch.einsum("bdl,bdnl,bdl->bdln", delta, B, u)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append(torch.einsum("bdn,bdn->bd", h, C[:, :, :, i]))
    return torch.stack(ys, dim=2)


def repeat_groups(t, heads, tiled=False):
    """einops ``repeat(t, 'b g n l -> b (g h) n l')`` as dynamo traces it (unsqueeze, expand,
    reshape); ``tiled`` is ``'b g n l -> b (h g) n l'``: channel d then reads group d % G."""
    b, g, n, length = t.shape
    if tiled:
        return t.unsqueeze(1).expand(b, heads, g, n, length).reshape(b, g * heads, n, length)
    return t.unsqueeze(2).expand(b, g, heads, n, length).reshape(b, g * heads, n, length)


def grouped_einops(u, delta, A, B, C):
    H = u.shape[1] // B.shape[1]
    return grouped_loop(u, delta, A, repeat_groups(B, H), repeat_groups(C, H))


def grouped_einops_tiled(u, delta, A, B, C):
    H = u.shape[1] // B.shape[1]
    return grouped_loop(u, delta, A, repeat_groups(B, H, tiled=True), repeat_groups(C, H, tiled=True))


def grouped_B_tiled_C_interleaved(u, delta, A, B, C):
    H = u.shape[1] // B.shape[1]
    return grouped_loop(u, delta, A, B.repeat(1, H, 1, 1), C.repeat_interleave(H, dim=1))


def grouped_B_interleaved_C_tiled(u, delta, A, B, C):
    H = u.shape[1] // B.shape[1]
    return grouped_loop(u, delta, A, repeat_groups(B, H), repeat_groups(C, H, tiled=True))


def grouped_index_mod(u, delta, A, B, C):
    idx = torch.arange(u.shape[1]) % B.shape[1]
    return grouped_loop(u, delta, A, B[:, idx], C[:, idx])


def vmamba_groups(t, heads):
    """VMamba's ``selective_scan_torch``: a unit axis by ``view``, copies by ``repeat``, merged by ``view``."""
    b, g, n, length = t.shape
    return t.view(b, g, 1, n, length).repeat(1, 1, heads, 1, 1).view(b, g * heads, n, length)


def none_expand_groups(t, heads):
    b, g, n, length = t.shape
    return t[:, :, None].expand(b, g, heads, n, length).reshape(b, g * heads, n, length)


def unsqueeze_tile_flatten_groups(t, heads):
    return t.unsqueeze(2).tile(1, 1, heads, 1, 1).flatten(1, 2)


def vmamba_groups_tiled(t, heads):
    """The same ops with the copies before the groups: channel d reads group d % G."""
    b, g, n, length = t.shape
    return t.view(b, 1, g, n, length).repeat(1, heads, 1, 1, 1).view(b, g * heads, n, length)


def _rewritten_grouped_scan(fn):
    """(the capture, its ssm.selective_scan node) of ``fn`` on grouped inputs, checked rewritten
    and equal to eager."""
    args = make_grouped_inputs()
    cap = PassCapture(scan_loop)
    out = torch.compile(fn, backend=cap, fullgraph=True)(*args)
    assert [r.family for r in cap.ctx.rewrites] == list(SCAN)
    assert_close(out, fn(*args))
    return cap, next(n for n in cap.gm.graph.nodes if n.target == torch.ops.ssm.selective_scan.default)


@pytest.mark.parametrize("spelling", [repeat_groups, vmamba_groups, none_expand_groups, unsqueeze_tile_flatten_groups],
                         ids=["einops", "view-repeat-view", "none-expand-reshape", "unsqueeze-tile-flatten"])
def test_group_broadcast_spellings_reach_the_op_as_the_users_groups(spelling):
    """Every spelling of "insert an axis after the groups, broadcast it, merge it" is d // H:
    einops' ``repeat(t, 'b g n l -> b (g h) n l')`` as dynamo traces it, VMamba's, and mixes."""
    def fn(u, delta, A, B, C):
        H = u.shape[1] // B.shape[1]
        return grouped_loop(u, delta, A, spelling(B, H), spelling(C, H))

    cap, scan = _rewritten_grouped_scan(fn)
    # B and C go in as the (batch, G, N, L) tensors: no (batch, dim, N, L) copy or view is left.
    assert scan.args[3].name == "l_b_" and scan.args[4].name == "l_c_"
    assert not any(n.op == "call_method" and n.target in ("reshape", "repeat", "tile", "expand")
                   for n in cap.gm.graph.nodes)


def grouped_vmamba_tiled(u, delta, A, B, C):
    H = u.shape[1] // B.shape[1]
    return grouped_loop(u, delta, A, vmamba_groups_tiled(B, H), vmamba_groups_tiled(C, H))


def grouped_tiled_sum_readout(u, delta, A, B, C):
    """Tiled groups read out by (h * C[t]).sum(-1): that product also looks like a step's decay."""
    H = u.shape[1] // B.shape[1]
    Bt, Ct = vmamba_groups_tiled(B, H), vmamba_groups_tiled(C, H)
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = torch.einsum("bdl,bdnl,bdl->bdln", delta, Bt, u)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append((h * Ct[:, :, :, i]).sum(-1))
    return torch.stack(ys, dim=2)


@pytest.mark.parametrize("fn", [grouped_einops_tiled, grouped_vmamba_tiled, grouped_index_mod,
                                grouped_tiled_sum_readout],
                         ids=["einops-(h g)", "repeat-(h g)", "index-d%G", "tiled-sum-readout"])
def test_other_group_mappings_are_read_per_channel(fn):
    """Channel d reading group d % G is no group broadcast the op has, but the program's own
    per-channel B and C are its grouped layout with G = dim: the op reads those copies."""
    _, scan = _rewritten_grouped_scan(fn)
    assert [tuple(n.meta["example_value"].shape) for n in scan.args[3:5]] == [(BATCH, DIM, N, L)] * 2


@pytest.mark.parametrize("fn", [grouped_B_tiled_C_interleaved, grouped_B_interleaved_C_tiled],
                         ids=["B-tiled-C-interleaved", "B-interleaved-C-tiled"])
def test_B_and_C_in_two_group_counts_are_left_alone(fn):
    """B per channel (G = dim) and C a group broadcast (G = 3), or the other way round: the op
    reads B and C with one group count."""
    assert_left_alone(fn, make_grouped_inputs(), f"B is read in {DIM} groups and C in {G}"
                      if fn is grouped_B_tiled_C_interleaved else f"B is read in {G} groups and C in {DIM}")
    # One loop, one reason.
    misses = [m.reason for m in explain(fn, *make_grouped_inputs()).misses if m.family == "scan_loop"]
    assert len(misses) == 1, misses


# --- look-alikes of the recurrence: left alone, with a reason -----------------------------------

def euler_decay(u, delta, A, B, C):
    return loop(1 + torch.einsum("bdl,dn->bdln", delta, A), disc(u, delta, A, B)[1], C)


def sigmoid_decay(u, delta, A, B, C):
    return loop(torch.sigmoid(torch.einsum("bdl,dn->bdln", delta, A)), disc(u, delta, A, B)[1], C)


def exp2_decay(u, delta, A, B, C):
    return loop(torch.exp2(torch.einsum("bdl,dn->bdln", delta, A)), disc(u, delta, A, B)[1], C)


def exp_of_sum(u, delta, A, B, C):
    return loop(torch.exp(delta[..., None] + A[None, :, None, :]), disc(u, delta, A, B)[1], C)


def two_deltas(u, delta, A, B, C):
    """Two dt projections: exp(Δ₁·A) with Δ₂·B·u."""
    return loop(disc(u, delta, A, B)[0], disc(u, delta * 0.5 + 0.1, A, B)[1], C)


def delta_squared(u, delta, A, B, C):
    return loop(disc(u, delta, A, B)[0], torch.einsum("bdl,bdl,bnl,bdl->bdln", delta, delta, B, u), C)


def sqrt_delta_in_B(u, delta, A, B, C):
    return loop(disc(u, delta, A, B)[0], torch.einsum("bdl,bnl,bdl->bdln", delta.sqrt(), B, u), C)


def no_delta_in_B(u, delta, A, B, C):
    return loop(disc(u, delta, A, B)[0], torch.einsum("bnl,bdl->bdln", B, u), C)


def B_full_plus_bias(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    return loop(dA, dBu + 0.1, C)


def decay_batch_flipped(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    return loop(dA.flip(0), dBu, C)


def A_per_step(u, delta, A, B, C, A_t):
    """A indexed by time (A_t: (L, dim, N)): not a time-invariant A."""
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = torch.exp(delta[:, :, t, None] * A_t[t]) * h + delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=2)


def A_per_step_full(u, delta, A, B, C, A_t):
    return loop(torch.exp(torch.einsum("bdl,ldn->bdln", delta, A_t)), disc(u, delta, A, B)[1], C)


def B_next_step(u, delta, A, B, C):
    """B_{t+1} with Δ_t and u_t (over L - 1 steps)."""
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2] - 1):
        h = dA[:, :, t] * h + delta[:, :, t, None] * B[:, None, :, t + 1] * u[:, :, t, None]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=2)


def decay_previous_step(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(1, u.shape[2]):
        h = dA[:, :, t - 1] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=2)


def C_previous_step(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(1, u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t - 1]))
    return torch.stack(ys, dim=2)


def readout_of_previous_state(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h_prev = h
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h_prev, C[:, :, t]))
    return torch.stack(ys, dim=2)


def readout_C_batch_flipped(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C.flip(0)[:, :, t]))
    return torch.stack(ys, dim=2)


def step_with(update):
    """A scan whose state update is ``update(dA_t, h, dBu_t)``."""
    return scan_with(update=update)


def readout_with(readout):
    """A scan whose readout is ``readout(h, C_t)``."""
    return scan_with(readout=lambda h, C, t: readout(h, C[:, :, t]))


def injected_state_midway(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        if t == 3:
            h = h + 0.25
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=2)


def stride_2_loop(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(0, u.shape[2], 2):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=2)


def stride_3_step_loop(u, delta, A, B, C):
    """The discretisation in the step, every third step from t = 1."""
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(1, u.shape[2], 3):
        dt = delta[:, :, t, None]
        h = torch.exp(dt * A) * h + dt * B[:, None, :, t] * u[:, :, t, None]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=2)


def outputs_reversed(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys[::-1], dim=2)


def output_also_accumulated(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys, acc = [], 0
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        y = torch.einsum("bdn,bn->bd", h, C[:, :, t])
        acc = acc + y
        ys.append(y)
    return torch.stack(ys, dim=2), acc


def mid_state_returned(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        if t == 2:
            mid = h
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=2), mid


def all_states_returned(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    hs = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        hs.append(h)
    return torch.stack(hs, dim=2)


def a_t_inputs():
    return make_inputs() + (-torch.rand(L, DIM, N, generator=torch.Generator().manual_seed(2)) - 0.5,)


def _recomputed_C_readout(make_C):
    """A scan whose step t reads C as ``make_C(C, t)``, recomputed every step."""
    return scan_with(readout=lambda h, C, t: torch.einsum("bdn,bn->bd", h, make_C(C, t)[:, :, t]))


def _C_written_mid_loop(C, i):
    if i == 3:
        C.mul_(2.0)  # the loop's C changes at step 3: later steps read other values
    return C.float()


@pytest.mark.parametrize("make_C", [lambda C, i: C + 1e-3 * torch.randn_like(C), _C_written_mid_loop],
                         ids=["C-noised-per-step", "C-written-mid-loop"])
def test_recomputed_C_that_changes_is_left_alone(make_C):
    # A C each step recomputes is one loop invariant only when it is computed alike from values
    # nobody writes: fresh noise per step, or a C written part-way, must keep the loop as written.
    fn = _recomputed_C_readout(make_C)
    args = make_inputs()
    report = explain(fn, *(a.clone() for a in args))
    assert not scan_families(report), report.format(graphs=False)
    assert any("does not repeat step 0's" in m.reason for m in report.misses), report.format(graphs=False)
    if make_C is _C_written_mid_loop:
        assert torch.equal(report.output, fn(*(a.clone() for a in args)))


LOOK_ALIKES = [
    pytest.param(_recomputed_C_readout(lambda C, i: C * (1.0 + i)), "does not repeat step 0's",
                 id="C-scaled-per-step"),
    pytest.param(euler_decay, "A_full is not exp(Δ·A)", id="1+dt*A"),
    pytest.param(sigmoid_decay, "A_full is not exp(Δ·A)", id="sigmoid(dt*A)"),
    pytest.param(exp2_decay, "A_full is not exp(Δ·A)", id="exp2(dt*A)"),
    pytest.param(exp_of_sum, "expected exp(Δ·A)", id="exp(dt+A)"),
    pytest.param(two_deltas, "none of which is A_full's Δ", id="two-dt-projections"),
    pytest.param(delta_squared, "not two graph values u and B", id="dt*dt*B*u"),
    pytest.param(sqrt_delta_in_B, "none of which is A_full's Δ", id="sqrt(dt)*B*u"),
    pytest.param(no_delta_in_B, "not a product Δ·B·u", id="B*u"),
    pytest.param(B_full_plus_bias, "not a product Δ·B·u", id="dt*B*u+c"),
    pytest.param(decay_batch_flipped, "A_full is not exp(Δ·A)", id="decay-batch-flipped"),
    pytest.param(B_next_step, "addend reads time 1 where its multiplier reads time 0", id="B[t+1]"),
    pytest.param(decay_previous_step, "adds B_full at time index 1, not 0: the decay and the input term read different steps", id="decay[t-1]"),
    pytest.param(C_previous_step, "starts at time index 1", id="C[t-1]"),
    pytest.param(readout_of_previous_state, "lagged readout", id="C_t*h_{t-1}"),
    pytest.param(readout_C_batch_flipped, "does not repeat step 0's", id="C-batch-flipped"),
    pytest.param(step_with(lambda a, h, b: a * (0.5 * h) + b), "computes with the number 0.5", id="0.5*h"),
    pytest.param(step_with(lambda a, h, b: 0.5 * (a * h + b)), "computes with the number 0.5", id="0.5*(a*h+b)"),
    pytest.param(step_with(lambda a, h, b: (a * h + b).clamp(-0.5, 0.5)), "(clamp)", id="clamped-state"),
    pytest.param(step_with(lambda a, h, b: a * h.roll(1, 0) + b), "(roll)", id="state-rolled-across-batch"),
    pytest.param(step_with(lambda a, h, b: a * h.flip(-1) + b), "(flip)", id="state-flipped"),
    pytest.param(step_with(lambda a, h, b: a * h * h + b), "not linear", id="a*h*h+b"),
    pytest.param(injected_state_midway, "starts at time index 3", id="state-injected-midway"),
    pytest.param(stride_2_loop, "the loop steps through time 2 indices at a time", id="range(0,L,2)"),
    pytest.param(stride_3_step_loop, "the loop steps through time 3 indices at a time", id="range(1,L,3)-in-step"),
    pytest.param(mid_state_returned, "intermediate state h_2 is used outside", id="mid-state-returned"),
    # A real scan with no readout: the op has no states output (missed, not wrong). (A loop
    # whose only result is the last state is rewritten: test_final_state_loops.py.)
    pytest.param(all_states_returned, "neither a readout", id="all-states-returned"),
    pytest.param(readout_with(lambda h, c: torch.einsum("bdn,bn->bn", h, c)), "sum over exactly the state axis",
                 id="readout-sums-dim"),
    pytest.param(readout_with(lambda h, c: torch.einsum("bdn,bdn,bn->bd", h, h, c)), "not a contraction",
                 id="readout-h*h*C"),
    pytest.param(readout_with(lambda h, c: (h.abs() * c[:, None]).sum(-1)), "not a contraction", id="readout-|h|"),
    pytest.param(readout_with(lambda h, c: (h * c[:, None]).mean(-1)), "not a contraction", id="readout-mean"),
    pytest.param(readout_with(lambda h, c: (h[..., :2] * c[:, None, :2]).sum(-1)), "not a contraction",
                 id="readout-partial-state"),
]


@pytest.mark.parametrize("fn, reason", LOOK_ALIKES)
def test_look_alike_is_left_alone(fn, reason):
    assert_left_alone(fn, make_inputs(), reason)


def stacked_readout(readout):
    """The states stacked after the loop, (batch, dim, L, N), read out by ``readout(states, C)``."""
    def fn(u, delta, A, B, C):
        dA, dBu = disc(u, delta, A, B)
        h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
        hs = []
        for t in range(u.shape[2]):
            h = dA[:, :, t] * h + dBu[:, :, t]
            hs.append(h)
        return readout(torch.stack(hs, dim=2), C)
    return fn


def squeezed_readout_batch_1(u, delta, A, B, C):
    """Batch 1: ``squeeze()`` drops the batch axis too, and y_t is (dim,)."""
    dA, dBu = disc(u, delta, A, B)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append((h @ C[:, :, t, None]).squeeze())
    return torch.stack(ys, dim=-1)


# Contractions of h_t with C_t that the matchers do not read (probe CR, run 63: both were said to be
# "not a contraction of h_t with C_t"): a sum given a dtype, which accumulates and returns y in it,
# and a squeeze naming no axis where it would drop a batch axis of size 1 as well (with one size-1
# axis it is that axis' squeeze, rewritten: tests/test_joined_pieces.py).
SUM_DTYPE = "sums the product of the state and C with dtype=torch.float64: y is accumulated and returned in " \
            "torch.float64, not in the product's torch.float32, and the scan matchers read only a sum that names no dtype"
SQUEEZE = ".squeeze() (Σ of the state times C) names no axis: it drops every size-1 axis, a batch or dim axis of " \
          "size 1 too, and the scan matchers read a squeeze only by the axes it names (squeeze(-1))"
LOOSE_READOUTS = [
    pytest.param(readout_with(lambda h, c: (h * c[:, None]).sum(-1, dtype=torch.float64)), BATCH, SUM_DTYPE,
                 id="sum-dtype-fp64"),
    pytest.param(readout_with(lambda h, c: (h * c[:, None]).sum(-1, dtype=torch.float32)), BATCH,
                 "with dtype=torch.float32: y is accumulated and returned in torch.float32, and the scan matchers "
                 "read only a sum that names no dtype", id="sum-dtype-own"),
    pytest.param(squeezed_readout_batch_1, 1, SQUEEZE, id="squeeze-no-dim-batch-1"),
    pytest.param(stacked_readout(lambda hs, C: (hs * C.transpose(1, 2)[:, None]).sum(-1, dtype=torch.float64)),
                 BATCH, SUM_DTYPE, id="stacked-sum-dtype-fp64"),
]


@pytest.mark.parametrize("fn, batch, reason", LOOSE_READOUTS)
def test_loose_readout_left_alone_says_how(fn, batch, reason):
    args = [a[:batch] if a.dim() == 3 else a for a in make_inputs()]
    assert_left_alone(fn, args, reason)
    torch._dynamo.reset()
    grad_args = [a.clone().requires_grad_() for a in args]
    out = torch.compile(fn, backend="ssm")(*grad_args)
    ref_args = [a.clone().requires_grad_() for a in args]
    ref = fn(*ref_args)
    assert out.dtype == ref.dtype and rel_err(out, ref) <= TOL[torch.float32]
    g = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, grad_args, g), torch.autograd.grad(ref, ref_args, g), strict=True):
        assert rel_err(got, want) <= TOL[torch.float32]


def test_outputs_stacked_last_step_first_are_the_ops_y_flipped():
    """``stack(ys[::-1])`` of a forward loop is its y flipped in time: rewritten as the op's y
    flipped (run 60; it was left alone as "not collected in time order"), eager's values."""
    args = make_inputs()
    report = explain(outputs_reversed, *args)
    assert "scan_loop" in report.counts, report.format(graphs=False)
    assert rel_err(report.output, outputs_reversed(*[a.double() for a in args])) <= TOL[torch.float32]


@pytest.mark.parametrize("fn, reason", [
    pytest.param(A_per_step, "exactly one factor of exp(Δ·A) must be a time slice", id="A[t]-per-step"),
    pytest.param(A_per_step_full, "one must not (A)", id="A[t]-precomputed"),
])
def test_time_varying_A_is_left_alone(fn, reason):
    assert_left_alone(fn, a_t_inputs(), reason)


def C_shared_by_batch_then_real_scan(u, delta, A, B, C):
    """A scan whose readout C broadcasts over the batch (a (1, N, L) C), then a real one. The first
    must be refused with a reason (it used to raise inside the pass, which compiled the whole graph
    without rewrites) and the second still rewritten."""
    dA, dBu = disc(u, delta, A, B)
    C1 = C[:1]
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append((h * C1[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=2), scan_y(u, delta, A, B, C)


def C_one_state_then_real_scan(u, delta, A, B, C):
    dA, dBu = disc(u, delta, A, B)
    C1 = C[:, :1]
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append((h * C1[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=2), scan_y(u, delta, A, B, C)


@pytest.mark.parametrize("fn", [C_shared_by_batch_then_real_scan, C_one_state_then_real_scan],
                         ids=["C-(1,N,L)", "C-(B,1,L)"])
def test_broadcast_C_is_refused_and_the_graph_keeps_its_other_rewrites(fn):
    args = make_inputs()
    report = explain(fn, *args)
    assert report.counts["scan_loop"] == 1, report.format(graphs=False)
    assert any("C_t broadcasts along a size-1 axis" in m.reason for m in report.misses), report.format(graphs=False)
    refused, rewritten = report.output
    ref_refused, ref_rewritten = fn(*args)
    assert torch.equal(refused, ref_refused)
    assert_close(rewritten, ref_rewritten)


# --- the scan is real, the tail is not quite the op's: fold only what is proved -----------------

def tail(delta_of, finish):
    """A real scan on ``delta_of(dt, bias)``, then ``finish(y, u, D, z, dt)``."""
    def fn(u, dt, A, B, C, D, z, bias):
        return finish(scan_y(u, delta_of(dt, bias), A, B, C), u, D, z, dt)
    return fn


def _sp(dt, b):
    return F.softplus(dt + b[:, None])


def _y(y, u, D, z, dt):
    return y


def _pre_conv_skip(u, dt, A, B, C, D, z, bias):
    x = F.silu(u)
    return scan_y(x, F.softplus(dt), A, B, C) + u * D[:, None]


def _post_conv_skip(u, dt, A, B, C, D, z, bias):
    x = F.silu(u)
    return scan_y(x, F.softplus(dt), A, B, C) + x * D[:, None]


def _delta_also_returned(u, dt, A, B, C, D, z, bias):
    delta = F.softplus(dt + bias[:, None])
    return scan_y(u, delta, A, B, C), delta


def _pre_skip_y_also_returned(u, dt, A, B, C, D, z, bias):
    y = scan_y(u, F.softplus(dt), A, B, C)
    return (y + u * D[:, None]) * F.silu(z), y


SKIP_GATE = lambda y, u, D, z, dt: (y + u * D[:, None]) * F.silu(z)  # noqa: E731

TAILS = [
    # (fn, families folded besides the scan's, a reason that must be recorded or None)
    pytest.param(tail(_sp, SKIP_GATE), {"delta", "skip", "gate"}, None, id="reference-tail"),
    pytest.param(tail(lambda dt, b: F.softplus(dt + b[:, None], beta=1, threshold=20), SKIP_GATE),
                 {"delta", "skip", "gate"}, None, id="softplus-explicit-beta=1"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: (y + u * D[None, :, None]) * (z * torch.sigmoid(z))),
                 {"delta", "skip", "gate"}, None, id="z*sigmoid(z)-is-silu"),
    pytest.param(tail(lambda dt, b: F.softplus(F.linear(dt.transpose(1, 2), torch.eye(DIM) * 0.5, b), beta=1)
                      .transpose(1, 2), SKIP_GATE), {"delta", "skip", "gate"}, None, id="F.linear-dt-softplus-beta=1"),
    pytest.param(tail(lambda dt, b: F.softplus(dt + b[:, None], beta=2), _y), set(), "beta=2", id="softplus-beta=2"),
    pytest.param(tail(lambda dt, b: F.softplus(dt + b[:, None], 2.0), _y), set(), "beta=2.0",
                 id="softplus-positional-beta=2"),
    pytest.param(tail(lambda dt, b: F.softplus(dt + b[:, None], threshold=1), _y), set(), "threshold=1",
                 id="softplus-threshold=1"),
    pytest.param(tail(lambda dt, b: F.softplus(F.softplus(dt + b[:, None])), _y), {"delta"}, None,
                 id="softplus-twice"),
    pytest.param(tail(lambda dt, b: F.softplus(dt) + b[:, None].abs(), _y), set(), None, id="bias-after-softplus"),
    pytest.param(tail(lambda dt, b: torch.log1p(torch.exp(dt + b[:, None])), _y), set(), None,
                 id="log1p(exp)-not-folded"),
    pytest.param(tail(lambda dt, b: F.softplus(dt + 0.5 * b[:, None]), _y), {"delta"}, None, id="bias-scaled"),
    pytest.param(tail(lambda dt, b: F.softplus(dt - b[:, None]), _y), {"delta"}, None, id="bias-subtracted"),
    pytest.param(_delta_also_returned, {"delta"}, None, id="delta-also-returned"),
    pytest.param(_pre_conv_skip, {"delta"}, "the skip multiplies l_u_, not the scan's u", id="skip-D*u-before-conv"),
    pytest.param(_post_conv_skip, {"delta", "skip"}, None, id="skip-D*u-after-conv"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: y + F.softplus(dt) * D[:, None]), {"delta"}, "not the scan's u",
                 id="skip-D*dt"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: y + z * D[:, None]), {"delta"}, "not the scan's u", id="skip-D*z"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: y + u.roll(1, -1) * D[:, None]), {"delta"}, "not the scan's u",
                 id="skip-u[t-1]"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: y + u * u * D[:, None]), {"delta"}, "not the scan's u",
                 id="skip-D*u*u"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: y + y * D[:, None]), {"delta"}, "not the scan's u", id="skip-D*y"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: y + u * z[:, :, :1]), {"delta"}, "is not a (dim,) vector",
                 id="skip-D-per-batch"),
    # One number for every channel is the op's skip with D broadcast to (dim,) (run 60).
    pytest.param(tail(_sp, lambda y, u, D, z, dt: y + u * D[0]), {"delta", "skip"}, None, id="skip-scalar-D"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: y - u * D[:, None]), {"delta"}, "subtracts D·u from y",
                 id="skip-subtracted"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: D[:, None] * u - y), {"delta"}, "subtracts y from D·u",
                 id="y-subtracted-from-skip"),
    # Hydra's diagonal correction: a per-step coefficient, no D of either sign (probe AZ, run 52).
    pytest.param(tail(_sp, lambda y, u, D, z, dt: y - (dt * z) * u), {"delta"}, "which is not a (dim,) vector D",
                 id="per-step-term-subtracted"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: y + (u * D[:, None] + 1.0)), {"delta"}, None, id="skip-plus-const"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: (y + u * D[:, None]) * torch.sigmoid(z)), {"delta", "skip"},
                 "the gate is sigmoid, not silu", id="gate-sigmoid(z)"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: (y + u * D[:, None]) * (z * torch.sigmoid(dt))), {"delta", "skip"},
                 "the sigmoid reads another node than the factor", id="gate-z*sigmoid(dt)"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: y * F.silu(z) + u * D[:, None]), {"delta", "gate"},
                 "D·u is added after the z gate", id="gate-before-skip"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: (y + u * D[:, None]) * (F.silu(z) + 1)), {"delta", "skip"}, None,
                 id="gate-silu(z)+1"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: (y + u * D[:, None]) / F.silu(z)), {"delta", "skip"}, None,
                 id="gate-divides"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: (y + u * D[:, None]) * F.silu(z).flip(0)), {"delta", "skip"}, None,
                 id="gate-batch-flipped"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: (y + u * D[:, None]) * F.silu(z).detach()), {"delta", "skip"},
                 "silu(z).detach()", id="gate-detached"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: (y + u * D[:, None]) * F.silu(z.flip(-1))),
                 {"delta", "skip", "gate"}, None, id="gate-of-flipped-z-is-a-z"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: y * F.silu(z) * F.silu(z)), {"delta", "gate"}, None,
                 id="gate-twice"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: y + u * D[:, None] + u * D[:, None]), {"delta", "skip"}, None,
                 id="skip-twice"),
    pytest.param(_pre_skip_y_also_returned, {"delta"}, "has other users besides the skip", id="pre-skip-y-returned"),
    # A bidirectional block's (y_fwd + y_bwd.flip(-1)) + u * D: the skip reaches y through a sum.
    pytest.param(tail(_sp, lambda y, u, D, z, dt: (y + z) + u * D[:, None]), {"delta"},
                 "folding would reassociate the sum", id="skip-after-a-sum"),
    pytest.param(tail(_sp, lambda y, u, D, z, dt: (y + z) * 2.0 + u * D[:, None]), {"delta"}, None,
                 id="skip-after-a-scaled-sum"),
]


def _z_written_after_the_scan(y, u, D, z, dt):
    z.mul_(2)
    return y * F.silu(z + 0.5)


def _D_written_after_the_scan(y, u, D, z, dt):
    D[0] = 5.0
    return y + u * (D * 1.5)[:, None]


def _z_written_through_a_view(y, u, D, z, dt):
    w = z * 1.0
    w[:, :, 1:].add_(1.0)
    return y * F.silu(w + 0.5)


def _z_dropped_out_after_another_draw(y, u, D, z, dt):
    noise = F.dropout(dt, 0.5)
    return y * F.silu(F.dropout(z, 0.5)) + noise


def _z_read_before_and_after_its_write(y, u, D, z, dt):
    t = z * 1.0
    z.mul_(2)
    return y * F.silu(t + z)


def _z_written_by_foreach(y, u, D, z, dt):
    torch._foreach_mul_([z], 2.0)
    return y * F.silu(z + 0.5)


def _z_written_by_imul_method(y, u, D, z, dt):
    z.__imul__(2.0)
    return y * F.silu(z + 0.5)


def _z_gumbel_after_another_draw(y, u, D, z, dt):
    noise = torch.rand_like(dt)
    return y * F.silu(F.gumbel_softmax(z)) + noise


def _gate_silu_inplace_kwarg(y, u, D, z, dt):
    return y * F.silu(z, inplace=True)


def _gate_silu_inplace_positional(y, u, D, z, dt):
    return y * F.silu(z, True)


# (finish, family, reason): the gate's z or the skip's D is computed after the scan from memory
# written after the scan, or draws random numbers after another draw. Folding moves that
# computation above the scan: it would read the memory before the write (9.8 off eager), or
# take the other draw's numbers.
HOIST_HAZARDS = [
    pytest.param(_z_written_after_the_scan, "gate", "mul_ writes memory", id="z-input-mul_"),
    pytest.param(_D_written_after_the_scan, "skip", "setitem writes memory", id="D-input-setitem"),
    pytest.param(_z_written_through_a_view, "gate", "add_ writes memory", id="z-temp-view-add_"),
    pytest.param(_z_dropped_out_after_another_draw, "gate", "draws random numbers", id="z-dropout"),
    pytest.param(_z_read_before_and_after_its_write, "gate", "mul_ writes memory", id="z-read-before-and-after"),
    pytest.param(_z_written_by_foreach, "gate", "_foreach_mul_ writes memory", id="z-foreach_mul_"),
    pytest.param(_z_written_by_imul_method, "gate", "writes memory", id="z.__imul__"),
    pytest.param(_z_gumbel_after_another_draw, "gate", "draws random numbers", id="z-gumbel_softmax"),
    # Not a move: the gate itself writes silu(z) into the caller's z, which the op's gate would not.
    pytest.param(_gate_silu_inplace_kwarg, "gate", "silu(z, inplace=True)", id="gate-silu-inplace"),
    pytest.param(_gate_silu_inplace_positional, "gate", "silu(z, inplace=True)", id="gate-silu-inplace-positional"),
]


@pytest.mark.parametrize("finish, family, reason", HOIST_HAZARDS)
def test_tail_value_is_not_moved_past_a_write_or_a_draw(finish, family, reason):
    fn = tail(_sp, finish)
    args = make_tail_inputs()
    eager_args, compiled_args = [a.clone() for a in args], [a.clone() for a in args]
    torch.manual_seed(0)
    report = explain(fn, *compiled_args)
    torch.manual_seed(0)
    expected = fn(*eager_args)
    assert family not in report.counts and any(reason in m.reason for m in report.misses), report.format(graphs=False)
    assert_close(report.output, expected)
    for a, e in zip(compiled_args, eager_args, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("fn, folded, reason", TAILS)
def test_tail_folds_only_what_is_the_op(fn, folded, reason):
    args = make_tail_inputs()
    report = explain(fn, *args)
    tail_families = {f for f in report.counts if f in ("delta", "skip", "gate")}
    assert report.counts["scan_loop"] == 1 and tail_families == folded, report.format(graphs=False)
    if reason is not None:
        assert any(reason in m.reason for m in report.misses), report.format(graphs=False)
    assert_close(report.output, fn(*args))


# --- low-precision state: a decision ------------------------------------------------------------

def bf16_state(u, delta, A, B, C):
    """Everything in u's dtype, the state too (``torch.zeros(..., dtype=u.dtype)``)."""
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A.to(delta.dtype)))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    return loop(dA, dBu, C, u.dtype)


def state_rounded_each_step(u, delta, A, B, C):
    """An fp32 scan whose state is rounded to bf16 after every step (a bf16 state cache)."""
    dA, dBu = disc(u.float(), delta.float(), A, B.float())
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = (dA[:, :, i] * h + dBu[:, :, i]).to(torch.bfloat16).float()
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i].float()))
    return torch.stack(ys, dim=2)


def fp64_reference(u, delta, A, B, C):
    return scan_y(*(t.double() for t in (u, delta, A, B, C)))


@pytest.mark.parametrize("fn", [bf16_state, state_rounded_each_step], ids=["bf16-state", "state-rounded-to-bf16"])
def test_low_precision_state_is_rewritten_and_at_least_as_accurate(fn):
    args = make_inputs(torch.bfloat16, length=24)
    report = explain(fn, *args)
    ref, eager = fp64_reference(*args), fn(*args)
    assert {f: report.counts[f] for f in SCAN} == dict.fromkeys(SCAN, 1)
    assert report.output.dtype == eager.dtype
    # The op accumulates in fp32: no further from the exact recurrence than eager's bf16 state,
    # and within bf16 accuracy of eager itself.
    assert rel_err(report.output, ref) <= rel_err(eager, ref) + 1e-3
    assert rel_err(report.output, eager) <= TOL[torch.bfloat16]


def bf16_model_loop(u, delta, A, B, C):
    """A model cast to bf16 whose A = -exp(A_log) skips .float(): A is bf16, so is every product,
    and the state is bf16 from its first step."""
    return loop(*disc(u, delta, A, B), C, u.dtype)


def bf16_model_assoc(u, delta, A, B, C):
    return torch.einsum("bdln,bnl->bdl", _states(u, delta, A, B), C)


@pytest.mark.parametrize("fn, family", [(bf16_model_loop, "scan_loop"), (bf16_model_assoc, "scan_assoc")],
                         ids=["loop", "assoc"])
def test_bf16_A_is_widened_for_the_op(fn, family):
    """The op takes an fp32 A; a bf16 A widens exactly. Before, the op refused the inputs ("A must
    have a dtype in fp32, fp64") and the whole scan ran as written."""
    u, delta, A, B, C = make_inputs(torch.bfloat16, length=24)
    args = (u, delta, A.bfloat16(), B, C)
    report = explain(fn, *args)
    assert report.counts[family] == 1 and report.counts["readout"] == 1, report.format(graphs=False)
    ref, eager = fp64_reference(*args), fn(*args)
    assert report.output.dtype == eager.dtype
    assert rel_err(report.output, ref) <= rel_err(eager, ref) + 1e-3
    assert rel_err(report.output, eager) <= TOL[torch.bfloat16]


def fp32_scan_of_bf16_inputs(u, delta, A, B, C):
    """bf16 activations upcast, the whole scan and y in fp32 (selective_scan_ref without its
    final cast). The passes find u through the cast; the op must not then return a bf16 y."""
    u, delta, B, C = u.float(), delta.float(), B.float(), C.float()
    return scan_y(u, delta, A, B, C)


def fp32_assoc_scan_of_bf16_inputs(u, delta, A, B, C):
    u, delta, B, C = u.float(), delta.float(), B.float(), C.float()
    return torch.einsum("bdln,bnl->bdl", _states(u, delta, A, B), C)


@pytest.mark.parametrize("fn, family", [(fp32_scan_of_bf16_inputs, "scan_loop"),
                                        (fp32_assoc_scan_of_bf16_inputs, "scan_assoc")], ids=["loop", "assoc"])
def test_fp32_scan_of_bf16_inputs_keeps_fp32_accuracy(fn, family):
    args = make_inputs(torch.bfloat16, length=16)
    report = explain(fn, *args)
    assert report.counts[family] == 1 and report.counts["readout"] == 1
    # Before the fix the op read the bf16 u and returned y rounded to bf16: ~2e-3 from eager.
    assert_close(report.output, fn(*args))


def test_selective_scan_ref_bf16_folds_its_tail():
    u, dt, A, _, _, D, z, bias = make_tail_inputs()
    _, _, _, Bg, Cg = make_grouped_inputs()
    args = tuple(t.bfloat16() if t.dim() > 1 and t is not A else t for t in (u, dt, A, Bg, Cg, D, z, bias))
    report = explain(selective_scan_ref, *args)
    assert {f: report.counts[f] for f in SCAN + ("delta", "skip", "gate")} == dict.fromkeys(
        SCAN + ("delta", "skip", "gate"), 1)
    (y, last), (y_ref, last_ref) = report.output, selective_scan_ref(*args)
    assert y.dtype == torch.bfloat16 and rel_err(y, y_ref) <= TOL[torch.bfloat16]
    assert_close(last, last_ref)


def delta_rounded_to_bf16(u, dt, A, B, C, D, z, bias):
    """Δ's pre-activation rounded to bf16 before softplus (a bf16 dt_proj): the delta fold hands
    the op dt and the bias, and the op computes softplus(dt + bias) unrounded. With bf16 inputs
    that rounds no finer than they are (``fx_utils.dropped_rounding``); the same rounding in an
    fp32 program is its function, and is kept (``test_rounding_casts``)."""
    return scan_y(u.float(), F.softplus((dt + bias[:, None]).to(torch.bfloat16)).float(), A, B.float(), C.float())


def test_rounded_delta_of_bf16_inputs_is_folded_and_at_least_as_accurate():
    args = tuple(t.bfloat16() if t.dim() == 3 else t for t in make_tail_inputs())
    u, dt, A, B, C, _, _, bias = (t.double() for t in args)
    ref = scan_y(u, F.softplus(dt + bias[:, None]), A, B, C)
    report = explain(delta_rounded_to_bf16, *args)
    eager = delta_rounded_to_bf16(*args)
    assert report.counts["delta"] == 1 and report.counts["scan_loop"] == 1, report.summary()
    assert rel_err(report.output, ref) <= rel_err(eager, ref)
    assert rel_err(report.output, eager) <= TOL[torch.bfloat16]


# --- associative_scan: the combine, the direction and the states' uses --------------------------

def _combine(left, right):
    return left[0] * right[0], right[0] * left[1] + right[1]


def _combine_right_to_left(left, right):
    return left[0] * right[0], left[0] * right[1] + left[1]


def _states(u, delta, A, B, combine=_combine, reverse=False):
    _, hs = associative_scan(combine, disc(u, delta, A, B), dim=2, reverse=reverse, combine_mode="generic")
    return hs


def assoc_scan(u, delta, A, B, C):
    hs = _states(u, delta, A, B)
    return torch.einsum("bdln,bnl->bdl", hs, C), hs[:, :, -1]


def assoc_reverse(u, delta, A, B, C):
    return torch.einsum("bdln,bnl->bdl", _states(u, delta, A, B, reverse=True), C)


def assoc_right_to_left(u, delta, A, B, C):
    return torch.einsum("bdln,bnl->bdl", _states(u, delta, A, B, _combine_right_to_left), C)


def assoc_first_state(u, delta, A, B, C):
    hs = _states(u, delta, A, B)
    return torch.einsum("bdln,bnl->bdl", hs, C), hs[:, :, 0]


def assoc_lagged_readout(u, delta, A, B, C):
    return torch.einsum("bdln,bnl->bdl", _states(u, delta, A, B)[:, :, :-1], C[:, :, 1:])


def assoc_time_flipped_readout(u, delta, A, B, C):
    return torch.einsum("bdln,bnl->bdl", _states(u, delta, A, B).flip(2), C)


def test_associative_scan_is_rewritten():
    args = make_inputs()
    report = explain(assoc_scan, *args)
    assert report.counts["scan_assoc"] == 1 and report.counts["readout"] == 1
    assert_close(report.output, assoc_scan(*args))


@pytest.mark.parametrize("fn, family, reason", [
    pytest.param(assoc_reverse, "scan_assoc", "runs in reverse", id="reverse=True"),
    pytest.param(assoc_right_to_left, "scan_assoc", "not a_l*a_r or a_r*b_l + b_r", id="right-to-left-combine"),
    pytest.param(assoc_first_state, "readout", "neither a readout", id="states[0]-as-last"),
    pytest.param(assoc_lagged_readout, "readout", "neither a readout", id="lagged-readout"),
    pytest.param(assoc_time_flipped_readout, "readout", "neither a readout", id="flipped-states"),
])
def test_associative_look_alike_is_left_alone(fn, family, reason):
    assert_left_alone(fn, make_inputs(), reason, family=family)


# --- causal conv look-alikes --------------------------------------------------------------------

def conv_inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, DIM, 9, generator=g), torch.randn(DIM, 1, 4, generator=g) / 4, torch.randn(DIM, generator=g)


def _conv(x, w, b):
    return F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1])


def conv_tail_slice(x, w, b):
    """The LAST L outputs: y[t] sees x[t .. t+W-1], the future."""
    return _conv(x, w, b)[..., -x.shape[-1]:]


def conv_right_padded(x, w, b):
    return F.conv1d(F.pad(x, (0, w.shape[-1] - 1)), w, b, groups=x.shape[1])


def conv_gelu(x, w, b):
    return F.gelu(_conv(x, w, b)[..., :x.shape[-1]])


def conv_times_sigmoid_of_input(x, w, b):
    return _conv(x, w, b)[..., :x.shape[-1]] * torch.sigmoid(x)


def conv_times_sigmoid_2y(x, w, b):
    y = _conv(x, w, b)[..., :x.shape[-1]]
    return y * torch.sigmoid(2 * y)


@pytest.mark.parametrize("fn, activation", [
    pytest.param(conv_gelu, None, id="gelu-not-folded"),
    pytest.param(conv_times_sigmoid_of_input, None, id="y*sigmoid(x)-not-folded"),
    pytest.param(conv_times_sigmoid_2y, None, id="y*sigmoid(2y)-not-folded"),
])
def test_conv_activation_look_alike_is_not_folded(fn, activation):
    args = conv_inputs()
    report = explain(fn, *args)
    (rewrite,) = [r for r in report.rewrites if r.family == "conv1d"]
    assert rewrite.decision["activation"] == activation
    assert_close(report.output, fn(*args))


def conv_left_padded(x, w, b):
    """The hand-written causal conv: zeros padded on the left, an unpadded conv, no slice."""
    return F.silu(F.conv1d(F.pad(x, (w.shape[-1] - 1, 0)), w, b, groups=x.shape[1]))


def conv_left_padded_with_ones(x, w, b):
    return F.conv1d(F.pad(x, (w.shape[-1] - 1, 0), value=1.0), w, b, groups=x.shape[1])


def conv_left_padded_too_little(x, w, b):
    return F.conv1d(F.pad(x, (w.shape[-1] - 2, 0)), w, b, groups=x.shape[1])


def conv_replicate_padded(x, w, b):
    return F.conv1d(F.pad(x, (w.shape[-1] - 1, 0), mode="replicate"), w, b, groups=x.shape[1])


def conv_padded_twice(x, w, b):
    """Padded by W-1 twice (F.pad, then the conv's own padding), sliced to x's L: lags x by W-1."""
    return F.conv1d(F.pad(x, (w.shape[-1] - 1, 0)), w, b, padding=w.shape[-1] - 1, groups=x.shape[1])[
        ..., :x.shape[-1]]


def conv_of_the_padded_input(x, w, b):
    """A causal conv of the padded input itself (its first L+W-1 outputs): that is still the op's."""
    xp = F.pad(x, (w.shape[-1] - 1, 0))
    return F.conv1d(xp, w, b, padding=w.shape[-1] - 1, groups=x.shape[1])[..., :xp.shape[-1]]


def test_causal_conv_of_a_padded_input_is_rewritten():
    args = conv_inputs()
    report = explain(conv_of_the_padded_input, *args)
    assert [r.family for r in report.rewrites] == ["conv1d"], report.format(graphs=False)
    assert_close(report.output, conv_of_the_padded_input(*args))


def test_left_padded_conv_is_rewritten():
    args = conv_inputs()
    report = explain(conv_left_padded, *args)
    (rewrite,) = report.rewrites
    assert rewrite.pattern == "pad(W-1, 0)+conv1d+silu" and rewrite.decision == {"W": 4, "activation": "silu",
                                                                                  "bias": True}
    assert "pad" not in report.graphs[0].after
    assert_close(report.output, conv_left_padded(*args))


@pytest.mark.parametrize("fn, reason", [
    pytest.param(conv_tail_slice, "does not start at step 0", id="last-L-outputs"),
    pytest.param(conv_right_padded, "not zeros (W-1, 0) on the left only", id="right-padded"),
    pytest.param(conv_left_padded_with_ones, "not zeros (W-1, 0) on the left only", id="left-padded-with-ones"),
    pytest.param(conv_left_padded_too_little, "not zeros (W-1, 0) on the left only", id="left-padded-W-2"),
    pytest.param(conv_replicate_padded, "not zeros (W-1, 0) on the left only", id="replicate-padded"),
    pytest.param(conv_padded_twice, "already zero-padded by W-1 on the left and the conv pads it again",
                 id="padded-twice"),
])
def test_non_causal_conv_is_left_alone(fn, reason):
    report = explain(fn, *conv_inputs())
    assert not report.rewrites, report.format(graphs=False)
    assert any(reason in m.reason for m in report.misses if m.family == "conv1d"), report.format(graphs=False)
    assert torch.equal(report.output, fn(*conv_inputs()))


# --- decode steps: look-alikes of selective_state_update ----------------------------------------

@pytest.fixture(scope="module")
def decode_registered():
    decode_op.register()


def step_inputs(state_dtype=torch.float32):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return dict(state=r(BATCH, DIM, N).to(state_dtype), x=r(BATCH, DIM), dt=r(BATCH, DIM),
                A=-torch.rand(DIM, N, generator=g) - 0.1, B=r(BATCH, N), C=r(BATCH, N), D=r(DIM), z=r(BATCH, DIM),
                dt_bias=r(DIM))


def _step(dt_of=lambda dt, b: dt, decay=lambda dt, A: torch.exp(dt.unsqueeze(-1) * A),
          update=lambda s, a, b: s * a + b, finish=lambda y, x, D, z: y, read=lambda s: s):
    def fn(state, x, dt, A, B, C, D, z, dt_bias):
        dt = dt_of(dt, dt_bias)
        state.copy_(update(state, decay(dt, A), dt.unsqueeze(-1) * B.unsqueeze(1) * x.unsqueeze(-1)))
        return finish(torch.einsum("bdn,bn->bd", read(state), C), x, D, z)
    return fn


def _two_dt_step(state, x, dt, A, B, C, D, z, dt_bias):
    dA = torch.exp(dt.unsqueeze(-1) * A)
    state.copy_(state * dA + F.softplus(dt).unsqueeze(-1) * B.unsqueeze(1) * x.unsqueeze(-1))
    return torch.einsum("bdn,bn->bd", state, C)


def _silu_x_step(state, x, dt, A, B, C, D, z, dt_bias):
    """The scan reads silu(x) (after the conv); the skip reads the raw x."""
    xs = F.silu(x)
    state.copy_(state * torch.exp(dt.unsqueeze(-1) * A) + dt.unsqueeze(-1) * B.unsqueeze(1) * xs.unsqueeze(-1))
    return torch.einsum("bdn,bn->bd", state, C) + D * x


def _state_cloned_first(state, x, dt, A, B, C, D, z, dt_bias):
    old = state.clone()
    state.copy_(state * torch.exp(dt.unsqueeze(-1) * A) + dt.unsqueeze(-1) * B.unsqueeze(1) * x.unsqueeze(-1))
    return torch.einsum("bdn,bn->bd", state, C) + (old * C[:, None]).sum(-1)


def _stepped_twice(state, x, dt, A, B, C, D, z, dt_bias):
    dA = torch.exp(dt.unsqueeze(-1) * A)
    dBu = dt.unsqueeze(-1) * B.unsqueeze(1) * x.unsqueeze(-1)
    state.copy_(state * dA + dBu)
    state.copy_(state * dA + dBu)
    return torch.einsum("bdn,bn->bd", state, C)


def _half_state_written(state, x, dt, A, B, C, D, z, dt_bias):
    new = state * torch.exp(dt.unsqueeze(-1) * A) + dt.unsqueeze(-1) * B.unsqueeze(1) * x.unsqueeze(-1)
    state[:, :, :2] = new[:, :, :2]
    return torch.einsum("bdn,bn->bd", new, C)


_SKIP_GATE = lambda y, x, D, z: (y + D * x) * F.silu(z)  # noqa: E731

STEPS = [
    # (fn, state dtype, rewritten, what must hold)
    pytest.param(_step(dt_of=lambda dt, b: F.softplus(dt + b), finish=_SKIP_GATE), torch.float32, True,
                 id="reference-step"),
    pytest.param(_step(decay=lambda dt, A: torch.sigmoid(dt.unsqueeze(-1) * A)), torch.float32, False,
                 id="sigmoid-decay"),
    pytest.param(_step(decay=lambda dt, A: 1 + dt.unsqueeze(-1) * A), torch.float32, False, id="1+dt*A-decay"),
    pytest.param(_two_dt_step, torch.float32, False, id="two-dts"),
    pytest.param(_step(update=lambda s, a, b: 0.5 * s * a + b), torch.float32, False, id="0.5*state"),
    pytest.param(_step(update=lambda s, a, b: (s * a + b).clamp(-1, 1)), torch.float32, False, id="clamped-state"),
    pytest.param(_step(update=lambda s, a, b: s.roll(1, 0) * a + b), torch.float32, False, id="state-rolled-batch"),
    pytest.param(_step(dt_of=lambda dt, b: F.softplus(dt + b, beta=2)), torch.float32, False, id="softplus-beta=2"),
    pytest.param(_step(dt_of=lambda dt, b: F.softplus(dt + b, threshold=1)), torch.float32, False,
                 id="softplus-threshold=1"),
    pytest.param(_step(dt_of=lambda dt, b: F.softplus(F.softplus(dt + b))), torch.float32, True, id="softplus-twice"),
    pytest.param(_step(dt_of=lambda dt, b: F.softplus(dt) + b), torch.float32, True, id="bias-after-softplus"),
    pytest.param(_step(finish=lambda y, x, D, z: (y + D * x) * torch.sigmoid(z)), torch.float32, True,
                 id="sigmoid-gate"),
    pytest.param(_step(finish=lambda y, x, D, z: y * F.silu(z) + D * x), torch.float32, True, id="gate-before-skip"),
    pytest.param(_step(finish=lambda y, x, D, z: y + D * z), torch.float32, True, id="skip-D*z"),
    pytest.param(_step(finish=lambda y, x, D, z: y - D * x), torch.float32, True, id="skip-subtracted"),
    pytest.param(_step(finish=lambda y, x, D, z: y * F.silu(z.flip(0))), torch.float32, True, id="gate-batch-flipped"),
    pytest.param(_silu_x_step, torch.float32, True, id="skip-of-pre-activation-x"),
    pytest.param(_state_cloned_first, torch.float32, False, id="old-state-read-through-clone"),
    pytest.param(_stepped_twice, torch.float32, False, id="two-updates"),
    pytest.param(_half_state_written, torch.float32, False, id="part-of-state-written"),
    pytest.param(_step(read=lambda s: s.float()), torch.bfloat16, False, id="bf16-state"),
    pytest.param(_step(read=lambda s: s.float()), torch.float64, False, id="fp64-state"),
]


@pytest.mark.parametrize("fn, state_dtype, rewritten", STEPS)
def test_decode_step_look_alike(decode_registered, fn, state_dtype, rewritten):
    """A rewrite must leave outputs and the written state as eager's (the CPU op computes the same
    fp32 operations in the same order); a refusal must leave the step untouched."""
    inputs = step_inputs(state_dtype)
    eager_in = {k: v.clone() for k, v in inputs.items()}
    comp_in = {k: v.clone() for k, v in inputs.items()}
    cap = PassCapture(decode)
    ref = fn(**eager_in)
    out = torch.compile(fn, backend=cap, fullgraph=True)(**comp_in)
    assert [r.family for r in cap.ctx.rewrites if r.family == "state_update"] == (["state_update"] if rewritten else [])
    if not rewritten:
        assert torch.equal(out, ref) and torch.equal(comp_in["state"], eager_in["state"])
    else:
        assert_close(out, ref)
        assert rel_err(comp_in["state"], eager_in["state"]) <= TOL[torch.float32]
    # Only the state is written: every other input is as it was.
    assert all(torch.equal(comp_in[k], inputs[k]) for k in inputs if k != "state")


def _grouped_step(tiled):
    """A decode step on grouped B, C (batch, G, N) broadcast to channels by einops' repeat:
    ``'b g n -> b (g h) n'`` (channel d reads group d // H) or, tiled, ``'(h g)'`` (d % G)."""
    def fn(state, x, dt, A, B, C):
        H = x.shape[1] // B.shape[1]
        Bx, Cx = (t.unsqueeze(1 if tiled else 2).expand(*((-1, H, -1, -1) if tiled else (-1, -1, H, -1)))
                  .reshape(t.shape[0], x.shape[1], t.shape[2]) for t in (B, C))
        state.copy_(state * torch.exp(dt.unsqueeze(-1) * A) + dt.unsqueeze(-1) * Bx * x.unsqueeze(-1))
        return torch.einsum("bdn,bdn->bd", state, Cx)
    return fn


@pytest.mark.parametrize("tiled, op_B_shape", [(False, (BATCH, G, N)), (True, (BATCH, DIM, N))],
                         ids=["(g h)-groups-reach-the-op", "(h g)-per-channel"])
def test_decode_step_with_einops_groups(decode_registered, tiled, op_B_shape):
    """The op gets the user's groups only for the d // H mapping; the tiled one is passed per
    channel (one group per channel), which is exact either way."""
    g = torch.Generator().manual_seed(0)
    inputs = dict(state=torch.randn(BATCH, DIM, N, generator=g), x=torch.randn(BATCH, DIM, generator=g),
                  dt=torch.rand(BATCH, DIM, generator=g), A=-torch.rand(DIM, N, generator=g),
                  B=torch.randn(BATCH, G, N, generator=g), C=torch.randn(BATCH, G, N, generator=g))
    eager_in = {k: v.clone() for k, v in inputs.items()}
    comp_in = {k: v.clone() for k, v in inputs.items()}
    fn = _grouped_step(tiled)
    cap = PassCapture(decode)
    ref = fn(**eager_in)
    out = torch.compile(fn, backend=cap, fullgraph=True)(**comp_in)
    assert [r.family for r in cap.ctx.rewrites] == ["state_update"]
    (op,) = [n for n in cap.gm.graph.nodes if n.target == torch.ops.ssm.selective_state_update.default]
    assert tuple(op.args[4].meta["example_value"].shape) == op_B_shape
    assert_close(out, ref)
    assert rel_err(comp_in["state"], eager_in["state"]) <= TOL[torch.float32]
