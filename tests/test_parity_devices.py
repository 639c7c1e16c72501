"""Issue 3's parity list on every available device, through the full backend (passes + inductor).

The three forms real code takes — HF ``MambaForCausalLM``, a mamba-minimal block in (batch, L, dim)
layout and a mamba_ssm ``selective_scan_ref``-style function in (batch, dim, L) layout — compiled
with ``backend="ssm"`` must match eager: rel err 1e-5 in fp32, bf16 within its tolerance of the
fp64 reference. CPU always; CUDA where a GPU is present (visibly skipped otherwise).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from utils import TOL, rel_err

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a CUDA GPU"))]
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


class MinimalBlock(nn.Module):
    """mamba-minimal's MambaBlock: (batch, L, dim), einsum discretisation, Python time loop."""

    def __init__(self, d_model=16, d_inner=32, d_state=8, dt_rank=4, d_conv=4):
        super().__init__()
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1).float().repeat(d_inner, 1)))
        self.D = nn.Parameter(torch.randn(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)
        self.dt_rank, self.d_state = dt_rank, d_state

    def forward(self, x):
        L = x.shape[1]
        x, res = self.in_proj(x).chunk(2, dim=-1)
        x = F.silu(self.conv1d(x.transpose(1, 2))[:, :, :L].transpose(1, 2))
        A = -torch.exp(self.A_log.float())
        delta, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(self.dt_proj(delta))
        deltaA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
        deltaB_u = torch.einsum("bld,bln,bld->bldn", delta, B, x)
        h = torch.zeros(x.shape[0], x.shape[2], self.d_state, device=x.device, dtype=deltaA.dtype)
        ys = []
        for i in range(L):
            h = deltaA[:, i] * h + deltaB_u[:, i]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, i, :]))
        y = torch.stack(ys, dim=1) + x * self.D
        return self.out_proj(y * F.silu(res))


def scan_ref_style(u, delta, A, B, C, D, z, delta_bias):
    """mamba_ssm ``selective_scan_ref`` (batch, dim, L) with softplus, D skip and z gate; it
    computes in fp32 (``.float()`` there), here in ``promote(dtype, fp32)`` so that the same
    function in fp64 is the reference."""
    dtype_in, f = u.dtype, torch.promote_types(u.dtype, torch.float32)
    u, delta = u.to(f), F.softplus(delta.to(f) + delta_bias[..., None].to(f))
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B.to(f), u)
    x = A.new_zeros((u.shape[0], A.shape[0], A.shape[1]))
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i].to(f)))
    out = torch.stack(ys, dim=2) + u * D[:, None]
    return (out * F.silu(z.to(f))).to(dtype_in)


def rewritten_families():
    return {k for k, v in counters["ssm"].items() if v}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("assoc", [False, True], ids=["loop", "assoc"])
def test_hf_mamba(device, assoc):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2,
                                      time_step_rank=4, use_bias=True, use_associative_scan=assoc)
    model = transformers.MambaForCausalLM(config).to(device).eval()
    ids = torch.randint(0, 64, (2, 14), device=device)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        out = torch.compile(model, backend="ssm")(ids, use_cache=False).logits
    assert {"conv1d", "scan_assoc" if assoc else "scan_loop", "delta", "skip", "gate"} <= rewritten_families()
    assert rel_err(out, ref) <= TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
def test_mamba_minimal_block(device):
    torch.manual_seed(0)
    block = MinimalBlock().to(device)
    x = torch.randn(2, 12, 16, device=device)
    with torch.no_grad():
        ref = block(x)
        out = torch.compile(block, backend="ssm")(x)
    assert {"conv1d", "scan_loop", "delta", "skip", "gate"} <= rewritten_families()
    assert rel_err(out, ref) <= TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_selective_scan_ref_style(device, dtype):
    g = torch.Generator().manual_seed(0)
    b, d, n, L = 2, 24, 8, 19
    args = [torch.randn(b, d, L, generator=g).to(dtype), (torch.randn(b, d, L, generator=g) * 0.5).to(dtype),
            -torch.rand(d, n, generator=g) - 0.5, torch.randn(b, n, L, generator=g).to(dtype),
            torch.randn(b, n, L, generator=g).to(dtype), torch.randn(d, generator=g),
            torch.randn(b, d, L, generator=g).to(dtype), torch.randn(d, generator=g) * 0.3]
    args = [a.to(device) for a in args]
    out = torch.compile(scan_ref_style, backend="ssm")(*args)
    assert {"scan_loop", "delta", "skip", "gate"} <= rewritten_families()
    if dtype == torch.float32:
        assert rel_err(out, scan_ref_style(*args)) <= TOL[torch.float32]
    else:
        ref = scan_ref_style(*[a.double() for a in args])
        assert out.dtype == dtype and rel_err(out, ref) <= TOL[dtype]
