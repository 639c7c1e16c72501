"""Decode steps and a skip that probe CY (run 67, finding F5) found left alone with no reason.

- mamba.py's ``MambaBlock.step`` called for several tokens in one graph, from the caches
  ``MambaLM.generate`` starts with (``h = None``, so ``h = zeros``; a zero conv window): only the
  first conv update was rewritten, and nothing said why. Each step reads the state and window
  the step before it returned; a step that computes its own decay (x_proj and dt_proj in the
  step) now reads the previous step's op output, or the zeros, as a decode step's state, and
  every step is rewritten.
- Vim's in-place ``step`` run 4 times in one graph: the state update was refused for every step
  because ``ssm_state.to(dtype)`` (an alias of the state) exists, although each one is read
  before the next step's write. An alias whose uses all come before the next write is placed
  where it stands; one read after the next write is refused with the reason naming that read.
- zeta's ``selective_scan_seq`` at batch 1: ``(hs @ C.unsqueeze(-1)).squeeze()`` drops the batch
  axis and ``y + D * x`` broadcasts it back. The skip is now folded through the squeeze (and a
  gate after it); a skip whose result stays squeezed is refused with that reason.

Values (and gradients where the code has them) are compared with eager on random inputs.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from utils import TOL, rel_err

from ssm_compile.compiler import backend
from ssm_compile.kernels.decode import op as decode_op
from ssm_compile.report import explain

D_MODEL, DIM, N, W = 3, 6, 3, 4


@pytest.fixture(autouse=True)
def decode_registered():
    # The rewritten graphs call torch.ops.ssm.*; the ops must exist before they are traced.
    decode_op.register()


def fired():
    return dict(counters["ssm"])


def _perturbed(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return module


class MambaPyBlock(nn.Module):
    """alxndrTL/mamba.py's ``MambaBlock.step`` / ``ssm_step``, as written (sizes shrunk)."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(D_MODEL, 2 * DIM, bias=False)
        self.conv1d = nn.Conv1d(DIM, DIM, kernel_size=W, groups=DIM, padding=W - 1)
        self.x_proj = nn.Linear(DIM, 1 + 2 * N, bias=False)
        self.dt_proj = nn.Linear(1, DIM)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32).repeat(DIM, 1)))
        self.D = nn.Parameter(torch.ones(DIM))
        self.out_proj = nn.Linear(DIM, D_MODEL, bias=False)
        _perturbed(self)

    def step(self, x, cache):
        h, inputs = cache
        x, z = self.in_proj(x).chunk(2, dim=1)
        x_cache = x.unsqueeze(2)
        x = self.conv1d(torch.cat([inputs, x_cache], dim=2))[:, :, W - 1]
        y, h = self.ssm_step(F.silu(x), h)
        output = self.out_proj(y * F.silu(z))
        return output, (h, torch.cat([inputs[:, :, 1:], x_cache], dim=2))

    def ssm_step(self, x, h):
        A = -torch.exp(self.A_log.float())
        delta, B, C = torch.split(self.x_proj(x), [1, N, N], dim=-1)
        delta = F.softplus(self.dt_proj(delta))
        deltaA = torch.exp(delta.unsqueeze(-1) * A)
        BX = delta.unsqueeze(-1) * B.unsqueeze(1) * x.unsqueeze(-1)
        if h is None:
            h = torch.zeros(x.size(0), DIM, N, device=deltaA.device)
        h = deltaA * h + BX
        y = (h @ C.unsqueeze(-1)).squeeze(2)
        return y + self.D * x, h


def generate_steps(block, xs, inputs0):
    """``MambaLM.generate``'s loop over ``step``, from its caches ``(None, zeros)``."""
    with torch.no_grad():
        cache, outs = (None, inputs0), []
        for t in range(xs.shape[1]):
            out, cache = block.step(xs[:, t], cache)
            outs.append(out)
        return torch.stack(outs, 1), cache[0], cache[1]


def time_sliced_loop(dA, dBx, C):
    """A loop over precomputed time slices from ``h = zeros``: the scan passes' business."""
    h = torch.zeros(dA.shape[0], dA.shape[1], dA.shape[3])
    ys = []
    for t in range(dA.shape[2]):
        h = dA[:, :, t] * h + dBx[:, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, -1)


def test_mambapy_steps_in_one_graph_are_each_rewritten():
    block = MambaPyBlock()
    g = torch.Generator().manual_seed(1)
    xs, inputs0 = torch.randn(2, 2, D_MODEL, generator=g), torch.zeros(2, DIM, W - 1)
    report = explain(generate_steps, block, xs, inputs0)
    # The first step's state is the zeros of ``h is None``; the later ones, and every window after
    # the first, are what the step before returned: each step's op reads the previous op's output.
    assert report.counts == {"state_update": 2, "conv_update": 2}, report.format(graphs=False)
    for o, r in zip(report.output, generate_steps(block, xs, inputs0), strict=True):
        assert rel_err(o, r) <= TOL[torch.float32]
    # scan_loop's "recurrence left alone" and conv1d's miss are accounted for by the rewrites.
    assert not report.misses, report.format(graphs=False)
    # The same chain over time slices of a precomputed exp(Δ·A), with the scan pass off, is not
    # taken step by step by the decode pass: its decay is no value the step computes itself.
    torch._dynamo.reset()
    counters.clear()
    dt = torch.rand(2, DIM, 3, generator=g)
    sliced = (torch.exp(dt[..., None] * -torch.rand(DIM, 1, N, generator=g)),
              dt[..., None] * torch.randn(2, 1, 3, N, generator=g), torch.randn(2, N, 3, generator=g))
    with torch.no_grad():
        out = torch.compile(time_sliced_loop, backend=backend(inductor=False, disable=("scan_loop",)))(*sliced)
    assert counters["ssm"]["state_update"] == 0, fired()
    assert torch.equal(out, time_sliced_loop(*sliced))


def test_mambapy_steps_under_grad_say_why():
    # Gradients through the steps: the decode ops are inference-only, and each step says so.
    block = MambaPyBlock()
    g = torch.Generator().manual_seed(2)
    xs = torch.randn(2, 2, D_MODEL, generator=g, requires_grad=True)

    def steps(xs, inputs0):
        cache, outs = (None, inputs0), []
        for t in range(xs.shape[1]):
            out, cache = block.step(xs[:, t], cache)
            outs.append(out)
        return torch.stack(outs, 1)

    report = explain(steps, xs, torch.zeros(2, DIM, W - 1))
    assert not report.rewrites, report.format(graphs=False)
    grad_misses = [m for m in report.misses if m.family == "state_update" and "requires grad" in m.reason]
    assert grad_misses, report.format(graphs=False)


# --- Vim's in-place step, 4 tokens in one graph ----------------------------------------------

class VimStep(nn.Module):
    """hustvl/Vim's ``Mamba.step`` torch path (mamba_simple), caches written in place."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(D_MODEL, 2 * DIM, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(DIM, W))
        self.conv_bias = nn.Parameter(torch.randn(DIM))
        self.x_proj = nn.Linear(DIM, 1 + 2 * N, bias=False)
        self.dt_proj = nn.Linear(1, DIM)
        self.A_log = nn.Parameter(torch.log(torch.rand(DIM, N) + 0.5))
        self.D = nn.Parameter(torch.randn(DIM))
        _perturbed(self)

    def step(self, x, conv_state, ssm_state, late_read=False):
        dtype = x.dtype
        x, z = self.in_proj(x).chunk(2, dim=-1)
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
        conv_state[:, :, -1] = x
        x = F.silu(torch.sum(conv_state * self.conv_weight, dim=-1) + self.conv_bias).to(dtype=dtype)
        dt, B, C = torch.split(self.x_proj(x), [1, N, N], dim=-1)
        dt = F.softplus(F.linear(dt, self.dt_proj.weight) + self.dt_proj.bias.to(dtype=dt.dtype))
        dA = torch.exp(torch.einsum("bd,dn->bdn", dt, -torch.exp(self.A_log.float())))
        ssm_state.copy_(ssm_state * dA + x[:, :, None] * torch.einsum("bd,bn->bdn", dt, B))
        state = ssm_state.to(dtype)
        if late_read:
            return state, C, x, z
        y = torch.einsum("bdn,bn->bd", state, C) + self.D.to(dtype) * x
        return y * F.silu(z)


def vim_steps(m, xs, conv_state, ssm_state):
    with torch.no_grad():
        return torch.stack([m.step(xs[:, t], conv_state, ssm_state) for t in range(xs.shape[1])], 1)


def vim_late_readout(m, xs, conv_state, ssm_state):
    """Step 0's ``ssm_state.to(dtype)`` is read out after step 1 has written the state."""
    with torch.no_grad():
        state, C, x, z = m.step(xs[:, 0], conv_state, ssm_state, late_read=True)
        y1 = m.step(xs[:, 1], conv_state, ssm_state)
        y0 = (torch.einsum("bdn,bn->bd", state, C) + m.D * x) * F.silu(z)
        return y0, y1


def _vim_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 4, D_MODEL, generator=g), torch.randn(2, DIM, W, generator=g),
            torch.randn(2, DIM, N, generator=g))


@pytest.mark.parametrize("fn, state_updates, reason", [
    (vim_steps, 4, None),
    # Every step's state update stays: the alias of step 0 is read after step 1's write, where
    # the node order would place its read before it.
    (vim_late_readout, 0, "and state is an alias of it (a view, or a cast to its own dtype) that einsum_5 reads "
                          "after copy__3, the state's next write, though the alias stands before it"),
], ids=["4-steps", "alias-read-after-next-write"])
def test_vim_in_place_steps_with_a_cast_of_the_state(fn, state_updates, reason):
    m = VimStep()
    xs, conv_state, ssm_state = _vim_inputs(4)
    eager = [conv_state.clone(), ssm_state.clone()]
    compiled = [conv_state.clone(), ssm_state.clone()]
    ref = fn(m, xs, *eager)
    report = explain(fn, m, xs, *compiled)
    assert report.counts["state_update"] == state_updates, report.format(graphs=False)
    out = report.output
    for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,), strict=True):
        assert rel_err(o, r) <= TOL[torch.float32]
    for c, e in zip(compiled, eager, strict=True):
        assert rel_err(c, e) <= TOL[torch.float32]
    misses = [x.reason for x in report.misses if x.family == "state_update"]
    assert (any(reason in r for r in misses) if reason else not misses), report.format(graphs=False)


# --- zeta's selective_scan_seq at batch 1 ----------------------------------------------------

def selective_scan_seq(x, delta, A, B, C, D, z=None, squeeze_x=False):
    """kyegomez/zeta's ``selective_scan_seq`` (x (batch, L, dim)); ``z``: a gate after the skip;
    ``squeeze_x``: the skip reads x squeezed too, so its result stays squeezed."""
    deltaA = torch.exp(delta.unsqueeze(-1) * A)
    BX = delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
    h = torch.zeros(x.size(0), x.size(2), A.shape[1])
    hs = []
    for t in range(x.shape[1]):
        h = deltaA[:, t] * h + BX[:, t]
        hs.append(h)
    hs = torch.stack(hs, dim=1)
    y = (hs @ C.unsqueeze(-1)).squeeze()
    y = y + D * (x.squeeze() if squeeze_x else x)
    return y if z is None else y * F.silu(z)


def _scan_inputs(batch, gate):
    g = torch.Generator().manual_seed(5)
    L = 5
    args = [torch.randn(batch, L, DIM, generator=g), F.softplus(torch.randn(batch, L, DIM, generator=g)),
            -(torch.rand(DIM, N, generator=g) + 0.3), torch.randn(batch, L, N, generator=g),
            torch.randn(batch, L, N, generator=g), torch.randn(DIM, generator=g)]
    if gate:
        args.append(torch.randn(batch, L, DIM, generator=g))
    return [a.requires_grad_() for a in args]


@pytest.mark.parametrize("gate", [False, True], ids=["skip", "skip-and-gate"])
def test_skip_folds_through_a_squeeze_of_the_batch_axis(gate):
    args = _scan_inputs(1, gate)
    report = explain(selective_scan_seq, *args)
    out = report.output
    assert report.counts["scan_loop"] == 1 and report.counts["skip"] == 1, report.format(graphs=False)
    assert report.counts["gate"] == (1 if gate else 0), report.format(graphs=False)
    wide = [a.detach().double().requires_grad_() for a in args]
    ref = selective_scan_seq(*wide)
    assert out.shape == ref.shape == (1, 5, DIM)
    assert rel_err(out, ref) <= TOL[torch.float32]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    for got, want in zip(torch.autograd.grad(out, args, grad), torch.autograd.grad(ref, wide, grad.double()),
                         strict=True):
        assert rel_err(got, want) <= TOL[torch.float32]


def test_skip_whose_result_stays_squeezed_says_why():
    args = _scan_inputs(1, gate=False)
    fn = lambda *a: selective_scan_seq(*a, squeeze_x=True)  # noqa: E731
    report = explain(fn, *args)
    assert "skip" not in report.counts, report.format(graphs=False)
    assert any("a squeeze() that drops its leading size-1 axes, and the skip's result [5, 6] does not broadcast "
               "them back to y's [1, 5, 6]" in m.reason for m in report.misses if m.family == "skip"), \
        report.format(graphs=False)
    assert rel_err(report.output, fn(*args)) <= TOL[torch.float32]
