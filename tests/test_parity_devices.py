"""Issue 3's parity list on every available device, through the full backend (passes + inductor).

The three forms real code takes — HF ``MambaForCausalLM``, a mamba-minimal block in (batch, L, dim)
layout and a mamba_ssm ``selective_scan_ref``-style function in (batch, dim, L) layout — compiled
with ``backend="ssm"`` must match eager: rel err 1e-5 in fp32, bf16 within its tolerance of the
fp64 reference. CPU always; CUDA where a GPU is present (visibly skipped otherwise).
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from utils import TOL, MinimalMambaBlock, perturbed, rel_err

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a CUDA GPU"))]
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


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
    block = perturbed(MinimalMambaBlock(d_model=16, d_state=8, dt_rank=4)).to(device)
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
