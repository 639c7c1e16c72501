"""Operands passed by keyword (``torch.add(input=a, other=b)``) are read as if passed by position.

Run 52 left these as misses: the matchers read operands by position, and a scan whose update,
decay or readout was spelled with keywords was not rewritten, with no reason given.
``passes/keywords.py`` now moves each keyword that names a positional parameter into its place
before the matchers run. Each program is checked against eager in fp64 (values and gradients)
and for the rewrites it should get; the near-misses spelled with keywords stay misses.
"""
import torch
import torch.nn.functional as F
from torch import nn

from ssm_compile.passes.keywords import positional_operands
from ssm_compile.report import explain

BATCH, DIM, N, L = 2, 4, 3, 6
F64 = torch.float64


def scan_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, DIM, L, generator=g, dtype=F64), torch.randn(BATCH, DIM, L, generator=g, dtype=F64),
            -torch.rand(DIM, N, generator=g, dtype=F64) - 0.1, torch.randn(BATCH, N, L, generator=g, dtype=F64),
            torch.randn(BATCH, N, L, generator=g, dtype=F64), torch.randn(DIM, generator=g, dtype=F64),
            torch.randn(BATCH, DIM, L, generator=g, dtype=F64), torch.randn(DIM, generator=g, dtype=F64))


def functions(u, delta, A, B, C, D, z, bias):
    delta = F.softplus(input=torch.add(input=delta, other=bias[:, None]))
    h = u.new_zeros(BATCH, DIM, N)
    ys = []
    for t in range(L):
        dA = torch.exp(input=torch.mul(input=delta[:, :, t, None], other=A))
        dBu = torch.mul(input=torch.mul(input=delta[:, :, t, None], other=B[:, None, :, t]), other=u[:, :, t, None])
        h = torch.add(input=torch.mul(input=dA, other=h), other=dBu)
        ys.append(torch.sum(input=torch.mul(input=h, other=C[:, None, :, t]), dim=-1))
    y = torch.stack(tensors=ys, dim=2)
    y = torch.add(input=y, other=torch.mul(input=u, other=D[:, None]))
    return torch.mul(input=y, other=F.silu(input=z))


def methods(u, delta, A, B, C, D, z, bias):
    delta = F.softplus(delta.add(other=bias[:, None]))
    h = u.new_zeros(BATCH, DIM, N)
    ys = []
    for t in range(L):
        dA = delta[:, :, t, None].mul(other=A).exp()
        dBu = delta[:, :, t, None].mul(other=B[:, None, :, t]).mul(other=u[:, :, t, None])
        h = h.mul(other=dA).add(other=dBu)
        ys.append(h.mul(other=C[:, None, :, t]).sum(dim=-1, keepdim=False))
    y = torch.stack(ys, dim=-1).add(other=u.mul(other=D[:, None]))
    return y.mul(other=F.silu(z))


SCAN_FAMILIES = ("scan_loop", "discretization", "readout", "delta", "skip", "gate")


def run(fn, *args):
    """Values and gradients of ``fn`` under every pass (no inductor) against eager; the report of that
    compile."""
    eager_args = [a.clone().requires_grad_() for a in args]
    fast_args = [a.clone().requires_grad_() for a in args]
    ref = fn(*eager_args)
    report = explain(fn, *fast_args)
    out = report.output
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(ref)
    (ref * weights).sum().backward()
    (out * weights).sum().backward()
    for name, e, f in zip("u delta A B C D z bias".split(), eager_args, fast_args):
        torch.testing.assert_close(f.grad, e.grad, rtol=1e-9, atol=1e-11, msg=name)
    return report


def test_scan_spelled_with_functions_and_keywords():
    report = run(functions, *scan_inputs())
    assert {f: report.counts[f] for f in SCAN_FAMILIES} == dict.fromkeys(SCAN_FAMILIES, 1), report.format(graphs=False)


def test_scan_spelled_with_methods_and_keywords():
    report = run(methods, *scan_inputs(1))
    assert {f: report.counts[f] for f in SCAN_FAMILIES} == dict.fromkeys(SCAN_FAMILIES, 1), report.format(graphs=False)


class KeywordBlock(nn.Module):
    """A Mamba block in (batch, L, dim) layout whose every functional call names its operands."""

    def __init__(self, d_model=6, d_state=N, d_conv=3, dt_rank=2):
        super().__init__()
        d_inner = 2 * d_model
        self.d_inner, self.dt_rank, self.d_state, self.d_conv = d_inner, dt_rank, d_state, d_conv
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv_w = nn.Parameter(torch.randn(d_inner, 1, d_conv) * 0.3)
        self.conv_b = nn.Parameter(torch.randn(d_inner) * 0.1)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_w = nn.Parameter(torch.randn(d_inner, dt_rank) * 0.3)
        self.dt_b = nn.Parameter(torch.randn(d_inner) * 0.1)
        self.A_log = nn.Parameter(torch.log(torch.rand(d_inner, d_state) + 0.5))
        self.D = nn.Parameter(torch.randn(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, x):
        b, length, _ = x.shape
        x, z = torch.split(tensor=self.in_proj(x), split_size_or_sections=self.d_inner, dim=-1)
        x = F.conv1d(input=x.transpose(1, 2), weight=self.conv_w, bias=self.conv_b, padding=self.d_conv - 1,
                     groups=self.d_inner)
        x = F.silu(input=torch.narrow(input=x, dim=2, start=0, length=length)).transpose(1, 2)
        delta, B, C = torch.split(tensor=F.linear(input=x, weight=self.x_proj.weight),
                                  split_size_or_sections=[self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(input=F.linear(input=delta, weight=self.dt_w, bias=self.dt_b))
        A = torch.neg(input=torch.exp(input=self.A_log))
        h = x.new_zeros(b, self.d_inner, self.d_state)
        ys = []
        for i in range(length):
            dA = torch.exp(input=torch.mul(input=delta[:, i, :, None], other=A))
            dBu = torch.mul(input=torch.mul(input=delta[:, i, :, None], other=B[:, i, None, :]), other=x[:, i, :, None])
            h = torch.add(input=torch.mul(input=dA, other=h), other=dBu)
            ys.append(torch.matmul(input=h, other=C[:, i, :, None]).squeeze(-1))
        y = torch.add(input=torch.stack(tensors=ys, dim=1), other=torch.mul(input=x, other=self.D))
        return self.out_proj(torch.mul(input=y, other=F.silu(input=z)))


def test_block_spelled_with_keywords_is_rewritten_whole():
    # fp32: the conv1d and x_dt_proj ops take fp32/bf16/fp16 only; compared with eager in fp32.
    torch.manual_seed(0)
    block = KeywordBlock()
    x = torch.randn(BATCH, 7, 6)
    ref = block(x)
    report = explain(block, x)
    torch.testing.assert_close(report.output, ref, rtol=1e-5, atol=1e-6)
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    report.output.square().sum().backward()
    for name, p in block.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    fired = {f for f, n in report.counts.items() if n}
    assert {"conv1d", "scan_loop", "discretization", "readout", "delta", "skip", "gate", "x_dt_proj"} <= fired, \
        report.format(graphs=False)


def scaled_update(u, delta, A, B, C, D, z, bias):
    """h = dA·h + 2·dBu through ``alpha``: not the op's update."""
    h = u.new_zeros(BATCH, DIM, N)
    ys = []
    for t in range(L):
        dA = torch.exp(input=torch.mul(input=delta[:, :, t, None], other=A))
        dBu = delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        h = torch.add(input=torch.mul(input=dA, other=h), other=dBu, alpha=2)
        ys.append(torch.sum(input=h * C[:, None, :, t], dim=-1))
    return torch.stack(ys, dim=2)


def sharper_softplus(u, delta, A, B, C, D, z, bias):
    """softplus with beta=2 passed by keyword, then a textbook scan: Δ's fold must see the beta."""
    delta = F.softplus(input=delta + bias[:, None], beta=2)
    h = u.new_zeros(BATCH, DIM, N)
    ys = []
    for t in range(L):
        h = torch.exp(delta[:, :, t, None] * A) * h + delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=2)


def test_keyword_near_misses_stay_misses():
    report = run(scaled_update, *scan_inputs(2))
    assert report.counts["scan_loop"] == 0, report.format(graphs=False)
    report = run(sharper_softplus, *scan_inputs(3))
    assert report.counts["scan_loop"] == 1 and report.counts["delta"] == 0, report.format(graphs=False)


def test_only_parameters_in_order_move():
    def f(x, y):
        return (torch.add(input=x, other=y, alpha=3), torch.sum(x, keepdim=True, dim=1),
                F.softplus(input=x, threshold=5.0), torch.div(input=x, other=y, rounding_mode="floor"),
                x.mul(other=y), torch.exp(input=x, out=torch.empty_like(x)))

    gm = torch.fx.symbolic_trace(f)
    x, y = torch.randn(3, 4), torch.rand(3, 4) + 1
    ref = gm(x, y)
    changes = positional_operands(gm)
    gm.recompile()
    calls = {n.name: (n.args, n.kwargs) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
    assert [(len(a), sorted(k)) for a, k in calls.values()] == [
        (2, ["alpha"]), (3, []), (1, ["threshold"]), (2, ["rounding_mode"]), (2, []), (1, []), (1, ["out"])]
    assert len(changes) == 6, changes  # add, sum, softplus, div, .mul, exp: 6 kinds, empty_like had no keyword
    for o, r in zip(gm(x, y), ref):
        torch.testing.assert_close(o, r)



def grouped_by_keyword(u, delta, A, Bg, Cg):
    """Grouped B/C repeated to every channel by ``torch.repeat_interleave(input=...)``, time slices
    taken by ``torch.unbind(input=...)``."""
    Bm = torch.repeat_interleave(input=Bg, repeats=DIM // 2, dim=1)
    Cm = torch.repeat_interleave(input=Cg, repeats=DIM // 2, dim=1)
    h = u.new_zeros(BATCH, DIM, N)
    ys = []
    steps = zip(torch.unbind(input=delta, dim=2), torch.unbind(input=u, dim=2), Bm.unbind(dim=3), Cm.unbind(dim=3))
    for dt, ut, bt, ct in steps:
        h = torch.exp(dt[..., None] * A) * h + dt[..., None] * bt * ut[..., None]
        ys.append((h * ct).sum(-1))
    return torch.stack(ys, dim=2)


def test_grouped_and_unbound_by_keyword():
    """``repeat_interleave(input=...)`` made the scan pass raise IndexError (it read args[0]), and
    the graph lost every rewrite; ``unbind(input=...)`` got no rewrite and no reason (probe BH)."""
    u, delta, A, B, C, *_ = scan_inputs(5)
    g = torch.Generator().manual_seed(6)
    Bg, Cg = (torch.randn(BATCH, 2, N, L, generator=g, dtype=F64) for _ in "BC")
    report = explain(grouped_by_keyword, u, delta.abs(), A, Bg, Cg)
    torch.testing.assert_close(report.output, grouped_by_keyword(u, delta.abs(), A, Bg, Cg), rtol=1e-10, atol=1e-12)
    assert report.counts["scan_loop"] == 1 and report.counts["readout"] == 1, report.format(graphs=False)


def conv_step_by_keyword(x, window, w, b):
    window.copy_(torch.roll(input=window, shifts=-1, dims=-1))
    window[:, :, -1] = x
    return F.silu(input=torch.sum(input=window * w, dim=-1) + b)


def test_decode_conv_step_rolled_by_keyword():
    """``torch.roll(input=...)`` in a decode conv step got no rewrite and no reason (probe BH)."""
    g = torch.Generator().manual_seed(7)
    x, window, w, b = torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, 4, generator=g), \
        torch.randn(DIM, 4, generator=g), torch.randn(DIM, generator=g)
    ref_window, got_window = window.clone(), window.clone()
    ref = conv_step_by_keyword(x, ref_window, w, b)
    report = explain(conv_step_by_keyword, x, got_window, w, b)
    assert report.counts["conv_update"] == 1, report.format(graphs=False)
    torch.testing.assert_close(report.output, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_window, ref_window, rtol=0, atol=0)
