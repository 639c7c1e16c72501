"""Shared test helpers: the per-dtype tolerance table and the relative-error metric."""
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
