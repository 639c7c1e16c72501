"""Mamba-1 code the passes were not written for, on the training and decode paths.

``test_unseen.py`` checks forward rewrites of unseen code; this file checks what happens when
people TRAIN or DECODE with it. Failure modes, worst first: a silently wrong result (gradients,
per-step outputs, cache state), a crash, a missed rewrite. Every case compares against eager with
random non-zero inputs, and asserts which ``ssm`` families fired or which miss was recorded.

Training cases run every pass without inductor (``backend(inductor=False)``): the rewrite and the
ops' autograd are under test, and inductor's CPU compile would dominate the run time.

Recorded behaviour:
- A decode loop compiled as a whole (4 steps unrolled onto one state node in one graph) is
  rewritten step by step, 4 state updates and 4 conv updates, also through inductor. Before
  passes/decode.py's ``_step_window`` none was (every step saw the other steps' uses of the state
  as its own). A step is still left alone, with a reason, where the node order cannot prove the
  other uses see what they saw (a view of the state written between steps, a readout after the
  next step's write, a read of the state before the next step's write, two writes with no read
  between them).
- A state read twice after its update (two readouts) is left alone with a reason, exact.
- A bf16 decode state is refused ("the op keeps its state in fp32"), so it stays exact.
- A conv window kept as a Python list of tensors has no state tensor in the graph to update in
  place: the conv step is not rewritten (and dynamo recompiles per step, guarding the list); the
  state step still is, and the result is eager's.
- Double backward (``create_graph=True``) through an ssm op fails with an error naming the op;
  the first-order grads taken with ``create_graph=True`` are right.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint
from utils import TOL, rel_err, tiny_falcon_mamba, tiny_jamba

from ssm_compile.compiler import backend
from ssm_compile.kernels.decode import op as decode_op
from ssm_compile.report import explain

BF16 = torch.bfloat16
FP32_GRAD_TOL = 1e-4
D_MODEL, D_STATE, L = 8, 4, 9
TRAIN_FAMILIES = ("conv1d", "scan_loop", "discretization", "readout", "delta")
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`",
                                        "ignore:`gradient_checkpointing_enable` is deprecated")


def fired():
    return dict(counters["ssm"])


def perturb(module, seed=0):
    """Random weights everywhere (so a dropped term cannot hide behind a constant init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return module


# --- training -------------------------------------------------------------------------------

class Block(nn.Module):
    """A hand-written Mamba block (batch, L, dim), mamba-minimal style, with the knobs real code
    turns: A or A_log as the parameter, no D / z / dt bias, B and C tied (one projection), a
    learned or input initial state, the final state returned for the loss to use."""

    def __init__(self, A_param="A_log", D=True, z=True, dt_bias=True, tied=False, h0=None, ret_state=False):
        super().__init__()
        torch.manual_seed(0)
        di = 2 * D_MODEL
        self.di, self.rank, self.n = di, 2, D_STATE
        self.use_z, self.tied, self.h0_mode, self.ret_state, self.A_param = z, tied, h0, ret_state, A_param
        self.in_proj = nn.Linear(D_MODEL, (2 if z else 1) * di, bias=False)
        self.conv1d = nn.Conv1d(di, di, 4, groups=di, padding=3)
        self.x_proj = nn.Linear(di, self.rank + (1 if tied else 2) * D_STATE, bias=False)
        self.dt_proj = nn.Linear(self.rank, di, bias=dt_bias)
        A_log = torch.log(torch.rand(di, D_STATE) + 0.5)
        if A_param == "A_log":
            self.A_log = nn.Parameter(A_log)
        else:
            self.A = nn.Parameter(-torch.exp(A_log))
        self.D = nn.Parameter(torch.randn(di)) if D else None
        if h0 == "param":
            self.h0 = nn.Parameter(torch.randn(di, D_STATE) * 0.5)
        self.out_proj = nn.Linear(di, D_MODEL, bias=False)
        perturb(self)

    def forward(self, x, h0=None):
        b, length, _ = x.shape
        xz = self.in_proj(x)
        if self.use_z:
            x, z = xz.split(self.di, dim=-1)
        else:
            x = xz
        x = F.silu(self.conv1d(x.transpose(1, 2))[:, :, :length].transpose(1, 2))
        A = -torch.exp(self.A_log.float()) if self.A_param == "A_log" else self.A
        if self.tied:
            delta, B = self.x_proj(x).split([self.rank, self.n], dim=-1)
            C = B
        else:
            delta, B, C = self.x_proj(x).split([self.rank, self.n, self.n], dim=-1)
        # The scan in fp32 whatever the parameters' dtype, as mamba_ssm's selective_scan_ref does
        # (the .float() casts are no-ops for an fp32 model).
        delta, B, C = F.softplus(self.dt_proj(delta)).float(), B.float(), C.float()
        dA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
        dBu = torch.einsum("bld,bln,bld->bldn", delta, B, x.float())
        if self.h0_mode == "param":
            h = self.h0.expand(b, -1, -1)
        elif self.h0_mode == "input":
            h = h0
        else:
            h = torch.zeros(b, self.di, self.n, device=x.device, dtype=torch.float32)
        ys = []
        for i in range(length):
            h = dA[:, i] * h + dBu[:, i]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, i, :]))
        y = torch.stack(ys, dim=1).to(x.dtype)
        if self.D is not None:
            y = y + x * self.D
        if self.use_z:
            y = y * F.silu(z)
        out = self.out_proj(y)
        return (out, h) if self.ret_state else out


def loss_of(out):
    """A loss that weights every output element differently; a returned state enters it too."""
    if isinstance(out, tuple):
        y, h = out
        return (y.float() ** 2).sum() + (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum()
    return (out.float() ** 2).sum()


def block_inputs(with_h0=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(2, L, D_MODEL, generator=g).to(dtype)]
    if with_h0:
        args.append(torch.randn(2, 2 * D_MODEL, D_STATE, generator=g))
    return args


def leaf_copies(args):
    return [a.detach().clone().requires_grad_() for a in args]


def assert_grads_match(eager_module, compiled_module, eager_args, compiled_args, tol=FP32_GRAD_TOL):
    compiled_params = dict(compiled_module.named_parameters())
    for name, p in eager_module.named_parameters():
        assert p.grad is not None and compiled_params[name].grad is not None, name
        assert rel_err(compiled_params[name].grad, p.grad) <= tol, name
    for i, (e, c) in enumerate(zip(eager_args, compiled_args, strict=True)):
        assert rel_err(c.grad, e.grad) <= tol, f"input {i}"


BLOCK_CASES = {
    "final-state-in-loss": dict(ret_state=True),
    "learned-initial-state": dict(h0="param"),
    "input-initial-state": dict(h0="input"),
    "input-initial-state-and-final-state": dict(h0="input", ret_state=True),
    "A-parameter": dict(A_param="A"),
    "no-D": dict(D=False),
    "no-z": dict(z=False),
    "no-dt-bias": dict(dt_bias=False),
    "tied-B-C": dict(tied=True),
}


@pytest.mark.parametrize("options", BLOCK_CASES.values(), ids=BLOCK_CASES.keys())
def test_block_gradients_match_eager(options):
    eager = Block(**options)
    compiled = copy.deepcopy(eager)
    args = leaf_copies(block_inputs(with_h0=options.get("h0") == "input"))
    cargs = leaf_copies(args)
    loss_of(eager(*args)).backward()
    loss_of(torch.compile(compiled, backend=backend(inductor=False))(*cargs)).backward()
    expected = {f: 1 for f in TRAIN_FAMILIES}
    expected.update(skip=int(options.get("D", True)), gate=int(options.get("z", True)))
    assert {f: counters["ssm"][f] for f in expected} == expected, fired()
    assert_grads_match(eager, compiled, args, cargs)


def two_chunks(block, x, h0, detach=False):
    """Chunked training: the first chunk's final state is the second chunk's initial state, so
    d last_state and d initial_state both carry gradient (or none, truncated by ``detach``)."""
    y1, h = block(x[:, :5], h0)
    y2, h2 = block(x[:, 5:], h.detach() if detach else h)
    return torch.cat([y1, y2], dim=1), h2


def initial_state_also_in_loss(block, x, h0):
    y, h = block(x, h0 * 1.5)
    return y, h + h0.flip(0) * 0.3


@pytest.mark.parametrize("fn, scans", [(two_chunks, 2), (lambda b, x, h0: two_chunks(b, x, h0, detach=True), 2),
                                       (initial_state_also_in_loss, 1)],
                         ids=["two-chunks", "two-chunks-detached", "initial-state-also-in-loss"])
def test_state_carried_between_scans(fn, scans):
    eager = Block(h0="input", ret_state=True)
    compiled = copy.deepcopy(eager)
    args = leaf_copies(block_inputs(with_h0=True))
    cargs = leaf_copies(args)
    loss_of(fn(eager, *args)).backward()
    loss_of(torch.compile(lambda x, h0: fn(compiled, x, h0), backend=backend(inductor=False))(*cargs)).backward()
    assert counters["ssm"]["scan_loop"] == scans and counters["ssm"]["conv1d"] == scans, fired()
    assert_grads_match(eager, compiled, args, cargs)


def test_checkpointed_user_block():
    eager = Block()
    compiled = copy.deepcopy(eager)
    args = leaf_copies(block_inputs())
    cargs = leaf_copies(args)
    loss_of(checkpoint(eager, *args, use_reentrant=False)).backward()
    fast = torch.compile(lambda x: checkpoint(compiled, x, use_reentrant=False), backend=backend(inductor=False))
    loss_of(fast(*cargs)).backward()
    assert all(counters["ssm"][f] == 1 for f in (*TRAIN_FAMILIES, "skip", "gate")), fired()
    assert_grads_match(eager, compiled, args, cargs)


def test_backward_twice_with_retain_graph():
    eager = Block(ret_state=True)
    compiled = copy.deepcopy(eager)
    args = leaf_copies(block_inputs())
    cargs = leaf_copies(args)
    for module, a in ((eager, args), (torch.compile(compiled, backend=backend(inductor=False)), cargs)):
        loss = loss_of(module(*a))
        loss.backward(retain_graph=True)
        loss.backward()
    assert counters["ssm"]["scan_loop"] == 1, fired()
    assert_grads_match(eager, compiled, args, cargs)


@pytest.mark.parametrize("with_conv", [True, False], ids=["block", "scan-only"])
def test_double_backward_fails_naming_the_op(with_conv):
    # First-order grads with create_graph=True are right; differentiating them again must raise,
    # naming the op, never return numbers.
    if with_conv:
        eager = Block()
        compiled = torch.compile(copy.deepcopy(eager), backend=backend(inductor=False))
        args = leaf_copies(block_inputs())
        op_name = "causal_conv1d"
    else:
        def scan(u, delta, A, B, C):
            dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
            dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
            h = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
            ys = []
            for i in range(u.shape[2]):
                h = dA[:, :, i] * h + dBu[:, :, i]
                ys.append((h * C[:, None, :, i]).sum(-1))
            return torch.stack(ys, dim=2)
        g = torch.Generator().manual_seed(2)
        args = [torch.randn(2, 6, 5, generator=g), torch.rand(2, 6, 5, generator=g) * 0.5 + 0.05,
                -torch.rand(6, 4, generator=g) - 0.5, torch.randn(2, 4, 5, generator=g),
                torch.randn(2, 4, 5, generator=g)]
        args = leaf_copies(args)
        eager, compiled = scan, torch.compile(scan, backend=backend(inductor=False))
        op_name = "selective_scan"
    cargs = leaf_copies(args)
    ref = torch.autograd.grad(loss_of(eager(*args)), args[0])[0]
    (grad,) = torch.autograd.grad(loss_of(compiled(*cargs)), cargs[0], create_graph=True)
    assert counters["ssm"]["scan_loop"] == 1, fired()
    assert rel_err(grad, ref) <= FP32_GRAD_TOL
    with pytest.raises(RuntimeError, match=rf"{op_name}.*double backward"):
        (grad ** 2).sum().backward()


def test_bf16_parameters_with_fp32_master_copies():
    # Mixed-precision training by hand: bf16 model, fp32 master weights that receive its grads.
    base = Block()
    reference = copy.deepcopy(base).double()
    x = block_inputs()[0]
    x64 = x.double().requires_grad_()
    loss_of(reference(x64)).backward()
    grads = {}
    for name, compile_it in (("eager", False), ("ssm", True)):
        model = copy.deepcopy(base).to(BF16)
        master = {n: p.detach().float().clone().requires_grad_() for n, p in model.named_parameters()}
        xb = x.to(BF16).requires_grad_()
        fn = torch.compile(model, backend=backend(inductor=False)) if compile_it else model
        loss_of(fn(xb)).backward()
        for n, p in model.named_parameters():
            master[n].grad = p.grad.float()
        grads[name] = ({n: m.grad for n, m in master.items()}, xb.grad)
    assert all(counters["ssm"][f] == 1 for f in TRAIN_FAMILIES), fired()
    ref_grads = dict(reference.named_parameters())
    (eager_grads, eager_dx), (ssm_grads, ssm_dx) = grads["eager"], grads["ssm"]
    for name, g in [*ssm_grads.items(), ("x", ssm_dx)]:
        ref = x64.grad if name == "x" else ref_grads[name].grad
        eager_g = eager_dx if name == "x" else eager_grads[name]
        assert g.dtype == (BF16 if name == "x" else torch.float32)
        err = rel_err(g, ref)
        # Within bf16's tolerance of fp64, or no worse than twice eager-in-bf16's own error where
        # eager itself misses that tolerance (dt_proj.bias: eager's bf16 grad is 2.9e-2 off).
        assert err <= max(TOL[BF16], 2 * rel_err(eager_g, ref)), (name, err)


def tiny_zamba():
    from test_variants import tiny_zamba as make

    return make()


@pytest.mark.parametrize("make, scans, convs", [
    (lambda: tiny_falcon_mamba(64), 2, 2),
    (lambda: tiny_jamba(64), 2, 2),
    (tiny_zamba, 12, 6),
], ids=["falcon-mamba", "jamba", "zamba"])
def test_hf_gradient_checkpointing(make, scans, convs, hf_checkpointing_traceable):
    eager = make().train()
    eager.gradient_checkpointing_enable()
    compiled = copy.deepcopy(eager)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    eager_loss = eager(ids, labels=ids, use_cache=False).loss
    eager_loss.backward()
    loss = torch.compile(compiled, backend=backend(inductor=False))(ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert counters["ssm"]["scan_assoc"] + counters["ssm"]["scan_loop"] == scans, fired()
    assert counters["ssm"]["conv1d"] == convs, fired()
    assert abs(loss.item() - eager_loss.item()) <= 1e-5
    compiled_params = dict(compiled.named_parameters())
    for name, p in eager.named_parameters():
        if p.grad is None:  # parameters the loss does not reach (unused attention pieces)
            assert compiled_params[name].grad is None, name
            continue
        assert rel_err(compiled_params[name].grad, p.grad) <= FP32_GRAD_TOL, name


# --- decode ---------------------------------------------------------------------------------

DIM, N, W = 6, 4, 4


@pytest.fixture
def decode_registered():
    # The rewritten graphs call torch.ops.ssm.*; the ops must exist before they are traced.
    decode_op.register()


class StepBlock(nn.Module):
    """A mamba_simple ``step``-style module that keeps its caches in buffers and updates them in
    place: the state by ``self.h.copy_(...)`` or ``self.h.mul_(dA).add_(dBu)``, the conv window by
    roll + ``[..., -1] = x``, or as a Python list of (batch, dim) tensors."""

    def __init__(self, batch=2, state_form="copy_", conv_form="roll", state_dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        di = 2 * D_MODEL
        self.di, self.rank, self.state_form, self.conv_form = di, 2, state_form, conv_form
        self.in_proj = nn.Linear(D_MODEL, 2 * di, bias=False)
        self.conv1d = nn.Conv1d(di, di, W, groups=di, padding=W - 1)
        self.x_proj = nn.Linear(di, self.rank + 2 * D_STATE, bias=False)
        self.dt_proj = nn.Linear(self.rank, di)
        self.A_log = nn.Parameter(torch.log(torch.rand(di, D_STATE) + 0.5))
        self.D = nn.Parameter(torch.randn(di))
        self.out_proj = nn.Linear(di, D_MODEL, bias=False)
        perturb(self)
        self.reset(batch, state_dtype)

    def reset(self, batch, state_dtype=torch.float32):
        g = torch.Generator().manual_seed(batch)
        self.register_buffer("h", torch.randn(batch, self.di, D_STATE, generator=g).to(state_dtype))
        if self.conv_form == "list":
            self.window = [torch.randn(batch, self.di, generator=g) for _ in range(W - 1)]
        else:
            self.register_buffer("conv_state", torch.randn(batch, self.di, W, generator=g))

    def caches(self):
        return [self.h, *(self.window if self.conv_form == "list" else [self.conv_state])]

    def forward(self, x):
        x, z = self.in_proj(x).chunk(2, dim=-1)
        w = self.conv1d.weight.squeeze(1)
        if self.conv_form == "list":
            full = [*self.window, x]
            self.window = full[1:]
            x = (torch.stack(full, dim=-1) * w).sum(-1) + self.conv1d.bias
        else:
            self.conv_state.copy_(torch.roll(self.conv_state, shifts=-1, dims=-1))
            self.conv_state[:, :, -1] = x
            x = torch.sum(self.conv_state * w, dim=-1) + self.conv1d.bias
        x = F.silu(x)
        dt, B, C = self.x_proj(x).split([self.rank, D_STATE, D_STATE], dim=-1)
        dt = F.softplus(self.dt_proj(dt))
        A = -torch.exp(self.A_log.float())
        dA = torch.exp(torch.einsum("bd,dn->bdn", dt, A))
        dBu = torch.einsum("bd,bn,bd->bdn", dt, B, x)
        if self.state_form == "copy_":
            self.h.copy_(self.h * dA + dBu)
        else:
            self.h.mul_(dA).add_(dBu)
        y = torch.einsum("bdn,bn->bd", self.h.to(dt.dtype), C) + self.D * x
        return self.out_proj(y * F.silu(z))


def decode_steps(eager, compiled, batches=(2, 2, 2), mode=torch.no_grad):
    """Run both modules step by step; per-step outputs and every cache must match eager's."""
    fast = torch.compile(compiled, backend=backend(inductor=False))
    g = torch.Generator().manual_seed(3)
    for step, batch in enumerate(batches):
        if step and batch != batches[step - 1]:
            eager.reset(batch)
            compiled.reset(batch)
        x = torch.randn(batch, D_MODEL, generator=g)
        with mode():
            ref, out = eager(x), fast(x)
        assert rel_err(out, ref) <= TOL[torch.float32], f"step {step}"
        for i, (c, e) in enumerate(zip(compiled.caches(), eager.caches(), strict=True)):
            assert c.dtype == e.dtype and rel_err(c, e) <= TOL[torch.float32], f"step {step}, cache {i}"


@pytest.mark.parametrize("state_form, mode", [("copy_", torch.no_grad), ("mul_add_", torch.no_grad),
                                              ("copy_", torch.inference_mode)],
                         ids=["copy_", "mul_-add_", "copy_-inference_mode"])
def test_step_with_buffer_state(decode_registered, state_form, mode):
    eager = StepBlock(state_form=state_form)
    decode_steps(eager, copy.deepcopy(eager), mode=mode)
    assert counters["ssm"]["state_update"] == 1 and counters["ssm"]["conv_update"] == 1, fired()


def test_step_with_batch_size_changing(decode_registered):
    eager = StepBlock()
    decode_steps(eager, copy.deepcopy(eager), batches=(2, 3, 1, 2))
    # One graph per distinct batch size at most (then dynamo's dynamic batch): each rewritten.
    assert counters["ssm"]["state_update"] == counters["ssm"]["conv_update"] >= 2, fired()


def test_step_with_list_conv_window(decode_registered):
    eager = StepBlock(conv_form="list")
    compiled = copy.deepcopy(eager)
    decode_steps(eager, compiled)
    # No conv state tensor is written in the graph, so there is no conv step to rewrite; the
    # state step is (once per step: dynamo guards on the list's tensors and recompiles).
    assert counters["ssm"]["conv_update"] == 0 and counters["ssm"]["state_update"] >= 1, fired()


def test_step_with_bf16_state_is_refused(decode_registered):
    eager = StepBlock(state_dtype=BF16)
    decode_steps(eager, copy.deepcopy(eager))
    assert counters["ssm"]["state_update"] == 0 and counters["ssm"]["conv_update"] == 1, fired()
    with torch.no_grad():
        report = explain(StepBlock(state_dtype=BF16), torch.randn(2, D_MODEL))
    assert any("keeps its state in fp32" in m.reason for m in report.misses if m.family == "state_update"), \
        report.format(graphs=False)


def step(state, conv_state, x, w, cb, dt, A, B, C, Dp, z, dt_bias):
    """One functional decode step writing both caches in place (mamba_simple ``step``)."""
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    x = F.silu(torch.sum(conv_state * w, dim=-1) + cb)
    dt = F.softplus(dt + dt_bias)
    state.copy_(state * torch.exp(dt.unsqueeze(-1) * A) + dt.unsqueeze(-1) * B.unsqueeze(1) * x.unsqueeze(-1))
    y = (state * C.unsqueeze(1)).sum(-1) + Dp * x
    return y * F.silu(z)


def four_steps(state, conv_state, x, w, cb, dt, A, B, C, Dp, z, dt_bias):
    """A decode loop compiled as a whole: 4 steps unrolled by dynamo into one graph."""
    return torch.stack([step(state, conv_state, x[t], w, cb, dt[t], A, B[t], C[t], Dp, z[t], dt_bias)
                        for t in range(4)])


def _update(state, x, dt, A, B):
    return state * torch.exp(dt.unsqueeze(-1) * A) + dt.unsqueeze(-1) * B.unsqueeze(1) * x.unsqueeze(-1)


def _readout(state, C):
    return (state * C.unsqueeze(1)).sum(-1)


def four_in_place_steps(state, conv_state, x, w, cb, dt, A, B, C, Dp, z, dt_bias):
    """The unrolled loop with ``state.mul_(dA).add_(dBx)`` steps."""
    ys = []
    for t in range(4):
        dt_t = F.softplus(dt[t] + dt_bias)
        state.mul_(torch.exp(dt_t.unsqueeze(-1) * A)).add_(dt_t.unsqueeze(-1) * B[t].unsqueeze(1) * x[t].unsqueeze(-1))
        ys.append((_readout(state, C[t]) + Dp * x[t]) * F.silu(z[t]))
    return torch.stack(ys)


def four_steps_state_reset_between(state, conv_state, x, w, cb, dt, A, B, C, Dp, z, dt_bias):
    """A write of part of the state between steps (``state[:, 1] = c``). Nothing reads the state
    between that write and the next step's, so the two count as one update written in two
    statements: only the first step is rewritten."""
    ys = []
    for t in range(4):
        ys.append(step(state, conv_state, x[t], w, cb, dt[t], A, B[t], C[t], Dp, z[t], dt_bias))
        state[:, 1] = 0.25
    return torch.stack(ys)


def four_steps_view_written_between(state, conv_state, x, w, cb, dt, A, B, C, Dp, z, dt_bias):
    """A view of the state written between steps: an alias the node order cannot follow."""
    ys = []
    for t in range(4):
        ys.append(step(state, conv_state, x[t], w, cb, dt[t], A, B[t], C[t], Dp, z[t], dt_bias))
        state[:, 0].mul_(0.5)
    return torch.stack(ys)


def four_steps_snapshot_between(state, conv_state, x, w, cb, dt, A, B, C, Dp, z, dt_bias):
    """The state read (``state * 1.0``) after every step, before the next step's write."""
    ys, snaps = [], []
    for t in range(4):
        ys.append(step(state, conv_state, x[t], w, cb, dt[t], A, B[t], C[t], Dp, z[t], dt_bias))
        snaps.append(state * 1.0)
    return torch.stack(ys), torch.stack(snaps)


def readout_after_next_write(state, conv_state, x, w, cb, dt, A, B, C, Dp, z, dt_bias):
    """Step 0's readout comes after step 1's write: it reads step 1's state."""
    state.copy_(_update(state, x[0], F.softplus(dt[0] + dt_bias), A, B[0]))
    state.copy_(_update(state, x[1], F.softplus(dt[1] + dt_bias), A, B[1]))
    return _readout(state, C[0]) + Dp * x[0], _readout(state, C[1]) + Dp * x[1]


def _roll_in(conv_state, x):
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x


def conv_view_written_between(state, conv_state, x, w, cb, dt, A, B, C, Dp, z, dt_bias):
    """A view of the conv window written between conv steps."""
    ys = []
    for t in range(4):
        _roll_in(conv_state, x[t])
        ys.append(F.silu(torch.sum(conv_state * w, dim=-1) + cb))
        conv_state[:, 0].mul_(0.5)
    return torch.stack(ys)


def conv_readout_after_next_roll(state, conv_state, x, w, cb, dt, A, B, C, Dp, z, dt_bias):
    """Each conv step's readout comes after the next step's roll."""
    ys = []
    for t in range(2):
        _roll_in(conv_state, x[t])
        out = torch.sum(conv_state * w, dim=-1)
        _roll_in(conv_state, x[t] * 2)
        ys.append(out + cb)
    return torch.stack(ys)


def read_twice(state, conv_state, x, w, cb, dt, A, B, C, Dp, z, dt_bias):
    """The new state read again after the step: a second readout, a scaled copy, a clone."""
    y = step(state, conv_state, x, w, cb, dt, A, B, C, Dp, z, dt_bias)
    return y, (state * C.flip(0).unsqueeze(1)).sum(-1), state * 2, state.clone()


def cloned_after(state, conv_state, x, w, cb, dt, A, B, C, Dp, z, dt_bias):
    """One readout, and the new state also returned (cloned) for the caller."""
    return step(state, conv_state, x, w, cb, dt, A, B, C, Dp, z, dt_bias), state.clone()


def step_inputs(steps=None):
    g = torch.Generator().manual_seed(0)

    def r(*shape, per_step=False):
        return torch.randn(*((steps,) if per_step and steps else ()), *shape, generator=g)

    return dict(state=r(2, DIM, N), conv_state=r(2, DIM, W), x=r(2, DIM, per_step=True), w=r(DIM, W), cb=r(DIM),
                dt=r(2, DIM, per_step=True), A=-torch.rand(DIM, N, generator=g) - 0.1, B=r(2, N, per_step=True),
                C=r(2, N, per_step=True), Dp=r(DIM), z=r(2, DIM, per_step=True), dt_bias=r(DIM))


@pytest.mark.parametrize("fn, steps, fired_state, fired_conv, miss", [
    (four_steps, 4, 4, 4, None),
    (four_in_place_steps, 4, 4, 0, None),
    (four_steps_state_reset_between, 4, 1, 4, ("state_update", "before its update")),
    (four_steps_view_written_between, 4, 0, 4, ("state_update", "is an alias of it (a view, or a cast to its own "
                                                 "dtype) that mul_ writes in place, a write of the state the node "
                                                 "order does not show")),
    (four_steps_snapshot_between, 4, 1, 4, ("state_update", "before its update")),
    (readout_after_next_write, 2, 0, 0, ("state_update", "C-readout")),
    (conv_view_written_between, 4, 0, 0, ("conv_update", "times in this graph (decode steps compiled as a whole), "
                                          "and getitem_1 is an alias of it")),
    (conv_readout_after_next_roll, 2, 0, 0, ("conv_update", "only after the next step writes the conv state")),
    (read_twice, None, 0, 1, ("state_update", "the new state has 2 C-readouts")),
    (cloned_after, None, 0, 1, ("state_update", "after its update")),
], ids=["4-step-loop", "4-in-place-steps", "4-steps-state-reset-between", "4-steps-view-written-between",
       "4-steps-snapshot-between", "readout-after-next-write", "conv-view-written-between",
       "conv-readout-after-next-roll", "state-read-twice", "state-cloned-after"])
def test_functional_decode_graphs(decode_registered, fn, steps, fired_state, fired_conv, miss):
    # Several steps on one state in one graph are rewritten step by step only where the node order
    # proves every other use of the state sees what it saw before (passes/decode.py _step_window).
    inputs = step_inputs(steps)
    eager_in = {k: v.clone() for k, v in inputs.items()}
    comp_in = {k: v.clone() for k, v in inputs.items()}
    ref = fn(**eager_in)
    out = torch.compile(fn, backend=backend(inductor=False), fullgraph=True)(**comp_in)
    assert counters["ssm"]["state_update"] == fired_state and counters["ssm"]["conv_update"] == fired_conv, fired()
    for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,), strict=True):
        assert rel_err(o, r) <= TOL[torch.float32]
    for name in ("state", "conv_state"):
        assert rel_err(comp_in[name], eager_in[name]) <= TOL[torch.float32], name
    if miss:
        family, reason = miss
        report = explain(fn, **{k: v.clone() for k, v in inputs.items()})
        assert any(reason in m.reason for m in report.misses if m.family == family), report.format(graphs=False)


def test_four_step_loop_through_inductor(decode_registered):
    # AOTAutograd functionalizes the 4 in-place ops on each cache; the writes must land in order.
    inputs = step_inputs(4)
    eager_in = {k: v.clone() for k, v in inputs.items()}
    comp_in = {k: v.clone() for k, v in inputs.items()}
    ref = four_steps(**eager_in)
    out = torch.compile(four_steps, backend="ssm", fullgraph=True)(**comp_in)
    assert counters["ssm"]["state_update"] == 4 and counters["ssm"]["conv_update"] == 4, fired()
    assert rel_err(out, ref) <= TOL[torch.float32]
    for name in ("state", "conv_state"):
        assert rel_err(comp_in[name], eager_in[name]) <= TOL[torch.float32], name


def _functional_step(h, x, dt, A, B, C):
    """A decode step that returns its new state instead of writing it in place."""
    h = torch.exp(dt[..., None] * A) * h + dt[..., None] * B[:, None] * x[..., None]
    return (h @ C[..., None]).squeeze(-1), h


def test_step_that_records_gradients_keeps_its_ops(decode_registered):
    # Training through an unrolled decode step: the decode ops have no backward, so the step stays
    # as written (and is still rewritten where nothing requires grad).
    g = torch.Generator().manual_seed(11)
    h, dt = torch.randn(2, 8, 4, generator=g), torch.rand(2, 8, generator=g)
    A, B, C = -torch.rand(8, 4, generator=g), torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    x = torch.randn(2, 8, generator=g).requires_grad_()
    ref, = torch.autograd.grad(_functional_step(h, x, dt, A, B, C)[0].sum(), x)
    torch._dynamo.reset()
    counters.clear()
    y, _ = torch.compile(_functional_step, backend=backend(inductor=False))(h, x, dt, A, B, C)
    grad, = torch.autograd.grad(y.sum(), x)
    assert counters["ssm"]["state_update"] == 0, dict(counters["ssm"])
    assert rel_err(grad, ref) < TOL[torch.float32]
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        y, _ = torch.compile(_functional_step, backend=backend(inductor=False))(h, x, dt, A, B, C)
    assert counters["ssm"]["state_update"] == 1, dict(counters["ssm"])
    assert rel_err(y, _functional_step(h, x, dt, A, B, C)[0]) < TOL[torch.float32]
    torch._dynamo.reset()


# --- dynamic sizes: a functional conv step, checkpointed training at a second length ---------

def _recording(fn, dynamic=None):
    from ssm_compile.compiler import SSMBackend, SSMOptions
    records = []
    return torch.compile(fn, backend=SSMBackend(SSMOptions(inductor=False), on_graph=records.append),
                         dynamic=dynamic), records


def test_functional_window_step_is_rewritten_under_dynamic_shapes():
    """mamba.py's step conv (the window returned, not written) under ``dynamic=True``: the window's
    width is a SymInt that its product with the static (dim, W) weight pins to W. Read as a
    number (no guard added) it is the op's W; before, ``isinstance(W, int)`` refused it."""
    dim, W = 6, 4

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.cb = nn.Parameter(torch.randn(dim, W)), nn.Parameter(torch.randn(dim))

        def forward(self, x, cs):
            cs = torch.cat([cs[:, :, 1:], x[:, :, None]], dim=-1)
            return F.silu((cs * self.w).sum(-1) + self.cb), cs

    step = Step()
    compiled, records = _recording(step, dynamic=True)
    x, cs = torch.randn(2, dim), torch.randn(2, dim, W)
    with torch.no_grad():
        out, new_cs = compiled(x, cs)
        ref, ref_cs = step(x, cs)
    assert rel_err(out, ref) <= TOL[torch.float32] and torch.equal(new_cs, ref_cs)
    assert [r.family for g in records for r in g.rewrites].count("conv_update") == 1, \
        [m.reason for g in records for m in g.misses]


def test_checkpointed_hf_training_rewrites_every_length(hf_checkpointing_traceable):
    """HF with non-reentrant checkpointing, called at a second length: dynamo recompiles with a
    symbolic L, and the checkpoint bodies (which dynamo does not dead-code-eliminate) kept unused
    ``x.size()`` nodes that the scan matcher took for other users of the scan's values. Bodies are
    now cleaned before the passes: every layer's scan is rewritten at both lengths."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(transformers.MambaConfig(
        hidden_size=32, num_hidden_layers=2, state_size=4, vocab_size=64))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    twin = copy.deepcopy(model)
    compiled, records = _recording(lambda ids: model(ids, labels=ids).loss)
    for length in (8, 12):
        ids = torch.randint(0, 64, (2, length))
        loss, ref = compiled(ids), twin(ids, labels=ids).loss
        loss.backward()
        ref.backward()
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) <= 1e-4
    scans = [r.family for g in records for r in g.rewrites].count("scan_assoc")
    assert scans == 4, [m.reason for g in records for m in g.misses]   # 2 layers x 2 graphs
