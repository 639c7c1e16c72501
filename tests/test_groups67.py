"""B and C with one group per channel (G = dim), which probe CY (run 67) found left alone.

mamba_ssm's ``selective_scan_fn`` documents B/C as (batch, G, N, L); with G = dim its reference
runs ``repeat(B, "B G N L -> B (G H) N L", H=1)``, whose unsqueeze / expand / reshape dynamo's
values make a view the passes look through, and pure-torch ports skip the repeat. Either way B is
per channel, which ``ssm.selective_scan`` takes as its grouped layout with G = dim; the reason
given was that a per-channel B "is only accepted as a group broadcast", the form the code has.

Rewrites are checked against eager in fp64, values and gradients. Where a per-channel B would
make the op read B and C in two group counts, or copy or differentiate a (batch, dim, N, L)
tensor of its own, the scan is left alone with that reason.
"""
import pytest
import torch
from torch._dynamo.utils import counters
from utils import assert_one_graph, rel_err

from ssm_compile.compiler import backend
from ssm_compile.report import explain

einops = pytest.importorskip("einops", reason="einops is in the test extra (pyproject.toml); install it")
from einops import repeat  # noqa: E402

BATCH, DIM, N, L = 2, 4, 3, 5
SCAN = {"scan_loop": 1, "discretization": 1, "readout": 1}


def inputs(groups=DIM, batch=BATCH, C_shape=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(batch, DIM, L, generator=g, dtype=torch.float64)
    delta = torch.rand(batch, DIM, L, generator=g, dtype=torch.float64) * 0.5 + 0.05
    A = -(torch.rand(DIM, N, generator=g, dtype=torch.float64) + 0.3)
    B = torch.randn(batch, groups, N, L, generator=g, dtype=torch.float64)
    C = torch.randn(*(C_shape or (batch, groups, N, L)), generator=g, dtype=torch.float64)
    return [x.requires_grad_() for x in (u, delta, A, B, C)]


def selective_scan_ref(u, delta, A, B, C):
    """mamba_ssm's reference, its grouped branch (variable B and C of shape (batch, G, N, L))."""
    dim = A.shape[0]
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    B = repeat(B, "B G N L -> B (G H) N L", H=dim // B.shape[1])
    deltaB_u = torch.einsum("bdl,bdnl,bdl->bdln", delta, B, u)
    C = repeat(C, "B G N L -> B (G H) N L", H=dim // C.shape[1])
    x = A.new_zeros((u.shape[0], dim, A.shape[1]))
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bdn->bd", x, C[:, :, :, i]))
    return torch.stack(ys, dim=2)


def per_channel_loop(u, delta, A, B, C, flip=False, last=False):
    """The grouped loop on a (batch, dim, N, L) B as given (a pure-torch ``selective_scan_fn`` with
    G = dim skips the repeat); C per channel or shared (batch, N, L). ``flip``: A_full and B_full
    read in reversed time; ``last``: only the last state is returned."""
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = torch.einsum("bdl,bdnl,bdl->bdln", delta, B, u)
    if flip:
        dA, dBu = dA.flip(2), dBu.flip(2)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        h = dA[:, :, i] * h + dBu[:, :, i]
        if C.dim() == 4:
            ys.append(torch.einsum("bdn,bdn->bd", h, C[:, :, :, i]))
        else:
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]))
    return h if last else torch.stack(ys, dim=2)


def in_step_loop(u, delta, A, B, C):
    """Discretised inside the loop, as the Angiography port of ``selective_scan_fn`` writes it."""
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        dt = delta[:, :, i]
        h = torch.exp(dt[..., None] * A) * h + (dt * u[:, :, i])[..., None] * B[:, :, :, i]
        ys.append((h * C[:, :, :, i]).sum(-1))
    return torch.stack(ys, dim=2)


def check_rewritten(fn, args, counts=SCAN):
    """``fn``'s scan rewritten as ``counts`` says, and its values and gradients eager's (fp64)."""
    report = explain(fn, *args)
    assert {f: report.counts.get(f) for f in counts} == counts, report.format(graphs=False)
    assert not report.misses, report.format(graphs=False)
    assert_one_graph(report)
    want = fn(*args)
    assert rel_err(report.output, want) <= 1e-12
    w = torch.randn_like(want)
    got_grads = torch.autograd.grad(report.output, args, w, allow_unused=True, materialize_grads=True)
    want_grads = torch.autograd.grad(want, args, w, allow_unused=True, materialize_grads=True)
    for g, x in zip(got_grads, want_grads, strict=True):
        assert rel_err(g, x) <= 1e-12


def check_left_alone(fn, args, reason):
    report = explain(fn, *args)
    assert "scan_loop" not in report.counts, report.format(graphs=False)
    misses = [m.reason for m in report.misses if m.family == "scan_loop"]
    assert len(misses) == 1 and reason in misses[0], report.format(graphs=False)
    assert torch.equal(report.output, fn(*args))


def test_selective_scan_ref_with_one_group_per_channel_is_rewritten():
    check_rewritten(selective_scan_ref, inputs())


@pytest.mark.parametrize("fn", [per_channel_loop, in_step_loop], ids=["full-terms", "in-step"])
def test_a_per_channel_B_and_C_are_the_grouped_layout(fn):
    check_rewritten(fn, inputs())


def test_only_the_last_state_with_a_per_channel_B():
    """No C: the op reads a zero one shared by the channels, not one shaped like B."""
    check_rewritten(lambda *a: per_channel_loop(*a, last=True), inputs(), {"scan_loop": 1, "discretization": 1})


def test_a_second_batch_size_stays_rewritten():
    """Dynamo's automatic dynamic shapes recompile with a symbolic batch: the group axis is still
    the channels'."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(per_channel_loop, backend=backend(inductor=False))
    for batch in (2, 3):
        args = inputs(batch=batch, seed=batch)
        got_args = [a.detach().clone().requires_grad_() for a in args]
        got, want = compiled(*got_args), per_channel_loop(*args)
        assert rel_err(got, want) <= 1e-12
        w = torch.randn_like(want)
        for g, x in zip(torch.autograd.grad(got, got_args, w), torch.autograd.grad(want, args, w), strict=True):
            assert rel_err(g, x) <= 1e-12
    assert counters["ssm"]["scan_loop"] == 2


def test_B_per_channel_and_C_in_groups_are_left_alone():
    """B per channel, C a group broadcast of 2 groups: the op reads B and C with one group count."""
    def fn(u, delta, A, B, C):
        return per_channel_loop(u, delta, A, B, C.repeat_interleave(2, dim=1))

    check_left_alone(fn, inputs(C_shape=(BATCH, 2, N, L)), f"B is read in {DIM} groups and C in 2")


def test_a_C_shared_by_the_channels_under_grad_is_left_alone():
    """The op would read the (batch, N, L) C per channel, and compute its gradient so."""
    args = inputs(C_shape=(BATCH, N, L))
    check_left_alone(per_channel_loop, args, "C is shared by the channels, with gradients recorded")
    with torch.no_grad():
        report = explain(per_channel_loop, *args)
        assert {f: report.counts.get(f) for f in SCAN} == SCAN, report.format(graphs=False)
        assert rel_err(report.output, per_channel_loop(*args)) <= 1e-12


def test_a_per_channel_B_read_in_reversed_time_is_left_alone():
    """The op would read a flipped copy of B, a (batch, dim, N, L) tensor of its own."""
    check_left_alone(lambda *a: per_channel_loop(*a, flip=True), inputs(),
                     "B is per channel (batch, dim, N, L) and read in reversed time")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels' G = dim path needs CUDA "
                    "(the CPU tests above run the op's chunked PyTorch path)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_per_channel_B_on_cuda_matches_fp64(dtype):
    # The rewritten reference runs the Triton forward and backward with groups == dim; compared with
    # the fp64 loop on the same (rounded) inputs, values and gradients.
    torch.manual_seed(0)
    ref_args = [x.detach() for x in inputs()]
    args = [x.to("cuda", dtype if i != 2 else torch.float32).requires_grad_() for i, x in enumerate(ref_args)]
    want_in = [x.detach().double().cpu().requires_grad_() for x in args]
    want = selective_scan_ref(*want_in)
    got = torch.compile(selective_scan_ref, backend="ssm")(*args)
    assert counters["ssm"]["scan_loop"] == 1, dict(counters["ssm"])
    w = torch.randn(want.shape, dtype=torch.float64)
    grads = torch.autograd.grad((got.double().cpu() * w).sum(), args)
    grads_want = torch.autograd.grad((want * w).sum(), want_in)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(got.double().cpu(), want) <= tol
    for g, gw in zip(grads, grads_want):
        assert rel_err(g.double().cpu(), gw) <= tol
