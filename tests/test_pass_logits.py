"""The ``logits`` pass: ``linear(x, W).float()`` in half precision becomes one matmul that writes
float32 (``torch.mm(..., out_dtype=torch.float32)``), on CUDA, when no gradient is needed.

The matching is checked on CPU by tracing with fake CUDA tensors (``aten.mm.dtype`` has no CPU
kernel, so the rewrite never fires on real CPU tensors); the numbers are checked on the GPU
against an fp64 product.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import ssm_compile
from ssm_compile.passes import logits as logits_pass
from ssm_compile.passes.manager import PassManager

CUDA = torch.device("cuda", 0)


def fake(mode, shape, dtype=torch.bfloat16, device=CUDA):
    return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), device)


def run_pass(fn, *inputs, grad=False, autocast_to=None):
    """Trace ``fn``, record fake values as dynamo would, run the logits pass; (gm, ctx).

    ``grad``: mark every value as requiring grad, as dynamo records a graph traced with grad
    enabled and a weight that requires it (set after propagation: autograd on fake CUDA
    tensors needs a CUDA build). ``autocast_to``: give the linear that output dtype, as dynamo
    records a linear under autocast (autocast itself needs a CUDA build)."""
    gm = torch.fx.symbolic_trace(fn)
    FakeTensorProp(gm, inputs[0].fake_mode).propagate(*inputs)
    for node in gm.graph.nodes:  # dynamo's graphs carry example_value; FakeTensorProp writes val
        if autocast_to is not None and node.target is torch._C._nn.linear:
            node.meta["val"] = fake(inputs[0].fake_mode, node.meta["val"].shape, autocast_to)
        if "val" in node.meta:
            if grad and node.op != "placeholder" and isinstance(node.meta["val"], torch.Tensor):
                node.meta["val"].requires_grad_(True)
            node.meta["example_value"] = node.meta["val"]
    pm = PassManager()
    logits_pass.register(pm)
    return gm, pm(gm)


def head(x, w):
    return F.linear(x, w).float()


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


@pytest.mark.parametrize("shape", [(2, 5, 16), (7, 16), (2, 3, 4, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rewrites_half_linear_then_float(shape, dtype):
    mode = FakeTensorMode()
    x, w = fake(mode, shape, dtype), fake(mode, (11, 16), dtype)
    before = FakeTensorProp(torch.fx.symbolic_trace(head), mode).propagate(x, w)
    gm, ctx = run_pass(head, x, w)
    assert [r.family for r in ctx.rewrites] == ["logits"] and not ctx.misses
    mm = [n for n in gm.graph.nodes if n.target is torch.mm]
    assert len(mm) == 1 and mm[0].kwargs == {"out_dtype": torch.float32}
    assert "float" not in targets(gm) and torch._C._nn.linear not in targets(gm)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    after = out.meta["val"]
    assert (after.shape, after.dtype, after.device) == (before.shape, torch.float32, before.device)


@pytest.mark.parametrize("spelling", ["float", "to", "to_kw"])
def test_cast_spellings(spelling):
    casts = {"float": lambda y: y.float(), "to": lambda y: y.to(torch.float32),
             "to_kw": lambda y: y.to(dtype=torch.float32)}

    def fn(x, w):
        return casts[spelling](F.linear(x, w))

    mode = FakeTensorMode()
    _, ctx = run_pass(fn, fake(mode, (3, 8)), fake(mode, (5, 8)))
    assert [r.family for r in ctx.rewrites] == ["logits"]


def test_bias_is_a_recorded_miss():
    def fn(x, w, b):
        return F.linear(x, w, b).float()

    mode = FakeTensorMode()
    gm, ctx = run_pass(fn, fake(mode, (3, 8)), fake(mode, (5, 8)), fake(mode, (5,)))
    assert not ctx.rewrites and "bias" in ctx.misses[0].reason
    assert torch.mm not in targets(gm)


def test_gradients_are_a_recorded_miss():
    mode = FakeTensorMode()
    gm, ctx = run_pass(head, fake(mode, (3, 8)), fake(mode, (5, 8)), grad=True)
    assert not ctx.rewrites and "derivative" in ctx.misses[0].reason
    assert torch.mm not in targets(gm)


def test_autocast_is_a_recorded_miss():
    # fp32 input and weight, a bf16 linear: the graph of a linear under autocast.
    mode = FakeTensorMode()
    gm, ctx = run_pass(head, fake(mode, (3, 8), torch.float32), fake(mode, (5, 8), torch.float32),
                       autocast_to=torch.bfloat16)
    assert not ctx.rewrites and "autocast" in ctx.misses[0].reason
    assert torch.mm not in targets(gm)


def test_in_place_write_is_a_recorded_miss():
    def fn(x, w):
        y = F.linear(x, w).float()
        y.mul_(2)
        return y

    mode = FakeTensorMode()
    _, ctx = run_pass(fn, fake(mode, (3, 8)), fake(mode, (5, 8)))
    assert not ctx.rewrites and "in place" in ctx.misses[0].reason


def test_matmul_reads_inputs_as_the_linear_did():
    # An in-place write to x between the linear and its cast: the matmul must take the linear's
    # place, not the cast's.
    def fn(x, w):
        y = F.linear(x, w)
        x.mul_(2)
        return y.float()

    mode = FakeTensorMode()
    gm, ctx = run_pass(fn, fake(mode, (3, 8)), fake(mode, (5, 8)))
    assert [r.family for r in ctx.rewrites] == ["logits"]
    order = [n.target for n in gm.graph.nodes]
    assert order.index(torch.mm) < order.index("mul_")


@pytest.mark.parametrize("case", ["cpu", "cpu with bias", "fp32", "float64 cast", "half output also used",
                                  "1-d input", "1-d weight"])
def test_left_alone_silently(case):
    mode = FakeTensorMode()
    x, w, fn = fake(mode, (3, 8)), fake(mode, (5, 8)), head
    if case.startswith("cpu"):
        x, w = fake(mode, (3, 8), device=torch.device("cpu")), fake(mode, (5, 8), device=torch.device("cpu"))
        if case == "cpu with bias":
            def fn(x, w):
                return F.linear(x, w, w[:, 0]).float()
    elif case == "fp32":
        x, w = fake(mode, (3, 8), torch.float32), fake(mode, (5, 8), torch.float32)
    elif case == "float64 cast":
        def fn(x, w):
            return F.linear(x, w).double()
    elif case == "half output also used":
        def fn(x, w):
            y = F.linear(x, w)
            return y.float(), y
    elif case == "1-d input":
        x = fake(mode, (8,))
    else:
        # A scalar head (probe AI, run 49): the pass raised "b must be 2D" building the mm.
        x, w = fake(mode, (2, 3, 8)), fake(mode, (8,))
    gm, ctx = run_pass(fn, x, w)
    assert not ctx.rewrites and not ctx.misses
    assert torch.mm not in targets(gm)


def test_disable_option_removes_the_pass():
    opts = ssm_compile.config.SSMOptions(disable=("logits",))
    assert "logits" not in opts.enabled_passes
    assert ssm_compile.config.SSMOptions().enabled_passes[-1] == "logits"


# --- GPU: the numbers ------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="aten.mm.dtype runs on CUDA only")


def _rel(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@needs_cuda
@pytest.mark.parametrize("dynamic", [False, True])
def test_cuda_logits_match_fp64(dynamic):
    torch.manual_seed(0)
    x = torch.randn(2, 37, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(301, 64, device="cuda", dtype=torch.bfloat16) / 8
    ref = torch.nn.functional.linear(x.double(), w.double())
    counters["ssm"].clear()
    with torch.no_grad():
        out = torch.compile(head, backend="ssm", dynamic=dynamic)(x, w)
        eager = head(x, w)
    assert counters["ssm"]["logits"] == 1
    assert out.dtype == torch.float32 and out.shape == eager.shape
    # fp32 accumulation without the bf16 rounding: far closer to the exact product than eager.
    assert _rel(out, ref) < 1e-5
    assert _rel(out, ref) < _rel(eager, ref) / 10


@needs_cuda
def test_cuda_autocast_linear_is_left_alone():
    torch.manual_seed(0)
    x = torch.randn(4, 32, device="cuda")
    w = torch.randn(40, 32, device="cuda")

    def fn(x, w):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = F.linear(x, w)
        return y.float()

    counters["ssm"].clear()
    with torch.no_grad():
        out = torch.compile(fn, backend="ssm")(x, w)
        eager = fn(x, w)
    assert counters["ssm"]["logits"] == 0
    torch.testing.assert_close(out, eager)


@needs_cuda
def test_cuda_training_keeps_the_cast_and_its_gradients():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 32, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(40, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counters["ssm"].clear()
    out = torch.compile(head, backend="ssm")(x, w)
    out.square().sum().backward()
    assert counters["ssm"]["logits"] == 0
    w2 = w.detach().clone().requires_grad_()
    head(x, w2).square().sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)


@needs_cuda
def test_cuda_hf_model_logits():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=97, hidden_size=32, state_size=8, num_hidden_layers=2,
                                   expand=2, conv_kernel=4)
    model = transformers.MambaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 97, (2, 33), device="cuda")
    counters["ssm"].clear()
    with torch.no_grad():
        out = torch.compile(model, backend="ssm")(ids, use_cache=False).logits
        eager = model(ids, use_cache=False).logits
    assert counters["ssm"]["logits"] == 1 and out.dtype == torch.float32
    # Against eager bf16: both round the hidden states the same way; they differ by eager's
    # rounding of the logits and by the ssm ops' fp32 internals.
    assert _rel(out, eager.double()) < 2e-2
