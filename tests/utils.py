"""Shared test helpers: the per-dtype tolerance table, the relative-error metric, pass-capture
backends and tiny HF Mamba-family models."""
import torch

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

