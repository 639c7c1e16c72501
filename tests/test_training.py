"""Training parity: 20 optimizer steps under backend="ssm" track eager step for step (issue 4)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from utils import MinimalMambaBlock, perturbed

STEPS = 20


class TinyLM(nn.Module):
    def __init__(self, vocab=37, d_model=16, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(MinimalMambaBlock(d_model) for _ in range(layers))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids, labels):
        h = self.emb(ids)
        for blk in self.blocks:
            h = h + blk(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def hf_model(use_assoc):
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(vocab_size=37, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
                      time_step_rank=2, use_associative_scan=use_assoc)
    torch.manual_seed(0)
    return MambaForCausalLM(cfg)


def train(model, step_fn, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        loss = step_fn(ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def batches(vocab=37, L=12):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (2, L), generator=g) for _ in range(STEPS)]


@pytest.mark.parametrize("use_assoc, checkpointing", [(False, False), (True, False), (True, True)],
                         ids=["loop", "assoc", "assoc-gradient-checkpointing"])
def test_hf_mamba_training_parity(use_assoc, checkpointing, hf_checkpointing_traceable):
    # With gradient checkpointing dynamo puts every layer in a checkpoint subgraph; the passes
    # rewrite inside it (without that, a checkpointed layer kept its (batch, dim, L, N) tensors).
    torch._dynamo.reset()
    counters.clear()
    eager = hf_model(use_assoc).train()
    if checkpointing:
        eager.gradient_checkpointing_enable()
    compiled = copy.deepcopy(eager)
    fast = torch.compile(compiled, backend="ssm")
    data = batches()
    ref = train(eager, lambda ids: eager(ids, labels=ids).loss, data)
    got = train(compiled, lambda ids: fast(ids, labels=ids).loss, data)
    assert counters["ssm"]["scan_assoc" if use_assoc else "scan_loop"] >= 2, dict(counters["ssm"])
    for step, (r, g) in enumerate(zip(ref, got)):
        assert abs(r - g) <= 1e-4, f"step {step}: eager {r} vs ssm {g}"
    assert ref[-1] < ref[0], "training did not reduce the loss; the parity check would be vacuous"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; the CPU cases above run the same check")
@pytest.mark.parametrize("use_assoc", [False, True], ids=["loop", "assoc"])
def test_hf_mamba_training_parity_cuda(use_assoc):
    # The Triton forward and backward kernels (the CPU cases run the chunked PyTorch path).
    torch._dynamo.reset()
    counters.clear()
    eager = hf_model(use_assoc).cuda().train()
    compiled = copy.deepcopy(eager)
    fast = torch.compile(compiled, backend="ssm")
    data = [ids.cuda() for ids in batches()]
    ref = train(eager, lambda ids: eager(ids, labels=ids).loss, data)
    got = train(compiled, lambda ids: fast(ids, labels=ids).loss, data)
    assert counters["ssm"]["scan_assoc" if use_assoc else "scan_loop"] >= 2, dict(counters["ssm"])
    for step, (r, g) in enumerate(zip(ref, got)):
        assert abs(r - g) <= 1e-4, f"step {step}: eager {r} vs ssm {g}"
    assert ref[-1] < ref[0], "training did not reduce the loss; the parity check would be vacuous"


def test_handwritten_block_training_parity():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = TinyLM()
    compiled = copy.deepcopy(eager)
    fast = torch.compile(compiled, backend="ssm")
    data = batches()
    ref = train(eager, lambda ids: eager(ids, ids), data)
    got = train(compiled, lambda ids: fast(ids, ids), data)
    assert counters["ssm"]["scan_loop"] >= 2, dict(counters["ssm"])
    for step, (r, g) in enumerate(zip(ref, got)):
        assert abs(r - g) <= 1e-4, f"step {step}: eager {r} vs ssm {g}"
    assert ref[-1] < ref[0]


def _block_and_input():
    torch.manual_seed(0)
    block = perturbed(MinimalMambaBlock(8))
    x = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    return block, x


def test_backward_twice_through_a_retained_graph():
    # The rewritten graph's backward is compiled with its forward (the compile fallback's
    # reach); AOTAutograd then raised at backward(retain_graph=True) because that backward
    # had been handed the saved tensors' memory to reuse. Plain inductor accepts this, so must we.
    torch._dynamo.reset()
    counters.clear()
    block, x = _block_and_input()
    ref = block(x).pow(2).sum()
    g_ref, = torch.autograd.grad(ref, x)
    out = torch.compile(block, backend="ssm")(x).pow(2).sum()
    assert counters["ssm"]["scan_loop"] == 1, dict(counters["ssm"])
    out.backward(retain_graph=True)
    first = x.grad.clone()
    out.backward()
    assert (first - g_ref).norm() <= 1e-5 * g_ref.norm()
    assert torch.allclose(x.grad, 2 * first, rtol=1e-6, atol=0)


def test_double_backward_is_refused_as_under_inductor():
    # Not silently wrong: AOTAutograd's compiled functions have no double backward, and says so.
    torch._dynamo.reset()
    block, x = _block_and_input()
    out = torch.compile(block, backend="ssm")(x).pow(2).sum()
    g, = torch.autograd.grad(out, x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()
