"""Shared test helpers: the per-dtype tolerance table, the relative-error metric, pass-capture
backends, tiny HF Mamba-family models and a hand-written mamba-minimal block."""
import torch
import torch.nn.functional as F
from torch import nn

# Relative-error tolerances (||out - ref|| / ||ref||) against an fp64 reference, per input dtype.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    # Compared on the reference's device: GPU outputs are checked against CPU fp64 references.
    out, ref = out.detach().double().to(ref.device), ref.detach().double()
    assert torch.isfinite(out).all(), "non-finite values in output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()

# Where the Triton kernels run in tests: on the GPU when there is one, else on CPU tensors under
# TRITON_INTERPRET=1 (set by conftest.py).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class PassCapture:
    """A dynamo backend that runs only the given pass modules, keeping the rewritten graph and the
    pass context for assertions, then runs the graph eagerly."""

    def __init__(self, *pass_modules):
        self.pass_modules = pass_modules
        self.gm, self.ctx = None, None

    def __call__(self, gm, example_inputs):
        from ssm_compile.passes.manager import PassManager

        pm = PassManager()
        for module in self.pass_modules:
            module.register(pm)
        self.ctx = pm(gm)
        self.gm = gm
        return gm.forward


def compile_with_passes(fn, *args, passes):
    """Compile ``fn`` (fullgraph) through a ``PassCapture`` of ``passes`` and call it once."""
    cap = PassCapture(*passes)
    out = torch.compile(fn, backend=cap, fullgraph=True)(*args)
    return cap, out


# --- tiny HF Mamba-family models for the variant tests --------------------------------------

def perturbed(model):
    """Random weights everywhere (HF and mamba.py initialise D, conv bias and norms to constants,
    which would let a wrong term vanish)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def tiny_falcon_mamba(vocab_size, **config):
    """Two FalconMamba layers (RMS norms on B, C and Δ before the scan), random weights."""
    import transformers

    cfg = transformers.FalconMambaConfig(vocab_size=vocab_size, hidden_size=16, state_size=4, num_hidden_layers=2,
                                         time_step_rank=4, conv_kernel=4, **config)
    torch.manual_seed(0)
    return perturbed(transformers.FalconMambaForCausalLM(cfg))


def tiny_jamba(vocab_size, **config):
    """Four Jamba layers: mamba, attention, mamba, attention; one expert (a dense MLP) everywhere."""
    import transformers

    cfg = transformers.JambaConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        attn_layer_period=2, attn_layer_offset=1, num_experts=1, num_experts_per_tok=1,
        expert_layer_period=1, expert_layer_offset=0, **config)
    torch.manual_seed(0)
    return perturbed(transformers.JambaForCausalLM(cfg))


class MinimalMambaBlock(nn.Module):
    """A hand-written Mamba block in (batch, L, dim) layout, mamba-minimal style: einsum
    discretisation and a Python time loop (the training and device-parity tests share it)."""

    def __init__(self, d_model=16, d_state=4, expand=2, d_conv=4, dt_rank=2):
        super().__init__()
        d_inner = expand * d_model
        self.d_inner, self.dt_rank, self.d_state = d_inner, dt_rank, d_state
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1).float().repeat(d_inner, 1)))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, x):
        b, L, _ = x.shape
        xz = self.in_proj(x)
        x, z = xz.split(self.d_inner, dim=-1)
        x = F.silu(self.conv1d(x.transpose(1, 2))[:, :, :L].transpose(1, 2))
        A = -torch.exp(self.A_log.float())
        delta, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(self.dt_proj(delta))
        deltaA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
        deltaB_u = torch.einsum("bld,bln,bld->bldn", delta, B, x)
        h = torch.zeros(b, self.d_inner, self.d_state, device=x.device)
        ys = []
        for i in range(L):
            h = deltaA[:, i] * h + deltaB_u[:, i]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, i, :]))
        y = torch.stack(ys, dim=1) + x * self.D
        return self.out_proj(y * F.silu(z))


def in_layout_of(y: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether an op's activation output ``y`` has the layout the ops promise for input ``x``
    (``kernels/layout.py``): a channel-innermost x (unit stride along dim, dim and L > 1) gives
    a y that is contiguous as (batch, L, dim); any other x gives a contiguous (batch, dim, L) y."""
    if x.shape[1] > 1 and x.shape[2] > 1 and x.stride(1) == 1:
        return y.transpose(1, 2).is_contiguous() and not y.is_contiguous()
    return y.is_contiguous()


# The small scan problem of the layout tests (test_unseen_layouts.py, test_layout_sliced_outputs.py):
# batch, dim, N, L.
SCAN_SHAPE = (2, 6, 4, 8)


def channel_innermost(t: torch.Tensor) -> torch.Tensor:
    """The same (batch, dim, L) values, stored (batch, L, dim): an nn.Linear output transposed."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def scan_inputs(length=SCAN_SHAPE[3], dtype=torch.float32, layout="ci", seed=0):
    """Random u, delta, A, B, C of ``SCAN_SHAPE`` (``length`` steps); u and delta
    channel-innermost unless ``layout`` is "dense"."""
    batch, dim, n, _ = SCAN_SHAPE
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(batch, dim, length, generator=g)
    delta = torch.rand(batch, dim, length, generator=g) * 0.5 + 0.05
    A = -torch.rand(dim, n, generator=g) - 0.5
    B = torch.randn(batch, n, length, generator=g)
    C = torch.randn(batch, n, length, generator=g)
    if layout == "ci":
        u, delta = channel_innermost(u), channel_innermost(delta)
    return u.to(dtype), delta.to(dtype), A, B.to(dtype), C.to(dtype)


def scan_y(u, delta, A, B, C):
    """mamba_ssm ``selective_scan_ref``'s loop in (batch, dim, L), stacked along L: eager's y is
    (batch, dim, L)-contiguous whatever u's layout."""
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1], dtype=dA.dtype)
    ys = []
    for i in range(u.shape[2]):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]))
    return torch.stack(ys, dim=2)


def traced_without_interpreter(script: str):
    """Run ``script`` (given the tests' folder as ``sys.argv[1]``) in a fresh interpreter without
    TRITON_INTERPRET, under which the ops' inline rule keeps them whole, and return the JSON value
    its last output line prints. The tracing tests record launches on fake CUDA tensors there,
    which needs no GPU."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script, os.path.dirname(os.path.abspath(__file__))], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_compiled_against_fp64(fn, args):
    """Compile ``fn`` through every ssm pass (no inductor, fullgraph) and compare its outputs, and
    the gradients of ``args`` under random output gradients, with eager's in fp64 (the probe tests'
    check of a rewrite). A tuple output is compared output by output."""
    from ssm_compile.compiler import backend

    torch._dynamo.reset()
    check_against_fp64(torch.compile(fn, backend=backend(inductor=False), fullgraph=True)(*args), fn, args)


def check_explained_against_fp64(report, fn, args):
    """``check_compiled_against_fp64`` for ``report = explain(fn, *args)``, whose output is that
    compile's (the same passes, no inductor), so ``fn`` is not compiled again."""
    assert_one_graph(report)
    check_against_fp64(report.output, fn, args)


def assert_one_graph(report):
    """What ``fullgraph=True`` asserts of a compile, for ``explain``'s (which compiles without it):
    one graph, no graph break, no frame run eagerly."""
    assert len(report.graphs) == 1 and not report.graph_breaks and not report.untraced, report.format(graphs=False)


def check_against_fp64(out, fn, args):
    """``out``, what compiled ``fn`` returned on ``args``, against eager in fp64: the outputs, and
    the gradients of ``args`` under random output gradients (a tuple output output by output)."""
    wide = [a.detach().double().requires_grad_() for a in args]
    ref = fn(*wide)
    outs, refs = (list(out), list(ref)) if isinstance(out, tuple) else ([out], [ref])
    for o, r in zip(outs, refs, strict=True):
        assert rel_err(o, r) <= TOL[torch.float32]
    grads = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, args, grads)
    want = torch.autograd.grad(refs, wide, [g.double() for g in grads])
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) <= TOL[torch.float32]


def scan_bdl(dA, dBu, u, B, C):
    """The loop over precomputed (batch, dim, L, ·) decays and input terms, einsum readout: the
    state's N is B's, whatever size-1 axis dA broadcasts."""
    h = u.new_zeros(u.shape[0], u.shape[1], B.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    return torch.stack(ys, dim=2)
