"""Ordinary torch settings around the backend: inductor's global ``freezing`` flag, compiling a
``torch.export``'ed module, a dynamo restart during the compile, and what ``explain`` leaves
behind."""
import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from utils import TOL, MinimalMambaBlock, rel_err

from ssm_compile.report import explain

BLOCK = ("conv1d", "x_dt_proj", "delta", "discretization", "scan_loop", "readout", "skip", "gate")


def block_and_input(seed=0, length=8):
    torch.manual_seed(seed)
    block = MinimalMambaBlock(d_model=8)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return block.eval(), torch.randn(2, length, 8)


def test_global_freezing_keeps_every_rewrite():
    """With ``torch._inductor.config.freezing = True`` dynamo reads the parameters as attributes
    where they are first used (``get_attr`` nodes), not as inputs. The layout check's fake run
    met them as real tensors and dropped every rewrite; the skip's D and dt_proj's weight read
    as computed after the scan and after x_proj."""
    block, x = block_and_input()
    with inductor_config.patch(freezing=True), torch.no_grad():
        report = explain(block, x)
        assert all(report.counts.get(f) == 1 for f in BLOCK), report.format(graphs=False)
        assert rel_err(report.output, block.double()(x.double())) <= TOL[torch.float32]
        block.float()
        counters.clear()
        out = torch.compile(block, backend="ssm")(x)
    assert all(counters["ssm"][f] == 1 for f in BLOCK), dict(counters["ssm"])
    assert rel_err(out, block.double()(x.double())) <= TOL[torch.float32]


def test_an_exported_module_is_left_alone_with_a_reason():
    """``torch.export``'s module is a graph of aten ops, which no matcher reads: computed right,
    not rewritten, and explain says why instead of reporting nothing."""
    block, x = block_and_input()
    exported = torch.export.export(block, (x,)).module()
    report = explain(exported, x)
    assert not report.counts, report.format(graphs=False)
    (miss,) = [m for m in report.misses if m.family == "graph"]
    assert "aten ops" in miss.reason and "aten::exp" in miss.reason and "compile the original module" in miss.reason
    assert rel_err(report.output, block.double()(x.double())) <= TOL[torch.float32]


def aten_softmax(x):
    e = torch.ops.aten.exp.default(x)
    return torch.ops.aten.div.Tensor(e, torch.ops.aten.sum.dim_IntList(e, [-1], True))


def test_a_graph_without_mamba_ops_gets_no_aten_reason():
    assert not explain(lambda x: torch.ops.aten.mul.Tensor(x, 2.0) + 1, torch.randn(3)).misses
    assert not explain(aten_softmax, torch.randn(2, 3)).misses


def clamped_block(block):
    def run(x, bound: float):
        return block(x.clamp(min=-bound))
    return run


def test_a_dynamo_restart_does_not_count_the_rewrites_twice():
    """Under ``dynamic=True`` a float argument is a symbol; ``clamp`` specialises it, and
    AOTAutograd's float pass then makes dynamo trace the frame again, so the backend compiles the
    graph twice. The first compile's rewrites were counted as well."""
    block, x = block_and_input()
    counters.clear()
    out = torch.compile(clamped_block(block), backend="ssm", dynamic=True)(x, 0.5)
    assert counters["stats"]["calls_captured"] > 100, "no restart: the test no longer exercises one"
    assert all(counters["ssm"][f] == 1 for f in BLOCK), dict(counters["ssm"])
    assert rel_err(out, block.double()(x.double().clamp(min=-0.5))) <= TOL[torch.float32]


def test_explain_restores_every_counter():
    block, x = block_and_input()
    counters["stats"]["unique_graphs"] += 5
    counters["ssm"]["conv1d"] += 3
    held = counters["stats"]
    before = {name: dict(c) for name, c in counters.items()}
    report = explain(block, x)
    assert report.counts.get("scan_loop") == 1
    assert {name: dict(c) for name, c in counters.items() if c} == {k: v for k, v in before.items() if v}
    assert counters["stats"] is held


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
