"""A bf16 scan whose skip eager sums in fp32 (HF's ``hidden_states * D`` against an fp32 D) is
folded by handing the op an fp32 copy of u (``tail._widen_op_y``), so that it returns the fp32
sum. Where the program casts that sum straight back to bf16 (HF, before out_proj), the op reads
u itself (``casts.narrow_widened_op_reads``): the fp32 copy of u, the fp32 y and its down-cast
were 2.4 ms of a 17.8 ms 130m forward on an H100 (run 68). The values must not move at all: the
op computes in fp32 either way and rounds y once."""
import re

import pytest
import torch
import torch.nn.functional as F

import ssm_compile
from ssm_compile.report import explain

BF16 = torch.bfloat16


def _u_of_scan(report):
    """The name of the graph value the (one) selective_scan reads as u, and the names made by a
    cast to fp32, from the rewritten graph's code."""
    (graph,) = report.graphs
    (u,) = re.findall(r"torch\.ops\.ssm\.selective_scan\.default\((\w+),", graph.after)
    widened = set(re.findall(r"^\s*(\w+) = \w+\.to\(torch\.float32\)", graph.after, re.M))
    return u, widened


def tiny_hf_mamba():
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=4,
                      use_associative_scan=True)
    torch.manual_seed(0)
    model = MambaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.to(BF16)


def test_hf_bf16_scan_reads_its_own_u_and_keeps_every_bit(monkeypatch):
    model = tiny_hf_mamba()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    report = explain(model, ids)
    u, widened = _u_of_scan(report)
    assert u not in widened, report.graphs[0].after
    assert report.counts["skip"] == 1 and report.counts["gate"] == 1, report.format(graphs=False)
    logits = report.output.logits
    model.zero_grad()
    logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    # The same compile with the op handed the fp32 copy, as before: the same bits, values and gradients.
    monkeypatch.setattr(ssm_compile.passes.manager, "narrow_widened_op_reads", lambda module: [])
    before = explain(model, ids)
    u_before, widened_before = _u_of_scan(before)
    assert u_before in widened_before, before.graphs[0].after
    assert torch.equal(before.output.logits, logits)
    model.zero_grad()
    before.output.logits.float().square().mean().backward()
    for name, p in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=0, msg=name)
    with torch.no_grad():
        eager = model(ids).logits
    torch.testing.assert_close(logits.float(), eager.float(), rtol=2e-2, atol=2e-2)


def _scan_then_fp32_skip(u, delta, A, B, C, D, narrow):
    """A bf16 loop read out in bf16, then a skip against an fp32 D: eager sums it in fp32; with
    ``narrow`` the result goes back to bf16 through a transpose, else it is returned in fp32."""
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1], dtype=torch.float32)
    ys = []
    for t in range(u.shape[-1]):
        dA = torch.exp(delta[:, :, t, None].float() * A)
        h = dA * h + (delta[:, :, t] * u[:, :, t]).float()[..., None] * B[:, None, :, t].float()
        ys.append((h.to(BF16) * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1) + u * D[:, None]
    return y.transpose(1, 2).to(BF16) if narrow else y


def _inputs():
    g = torch.Generator().manual_seed(3)
    b, d, n, length = 2, 6, 3, 5
    return [torch.randn(b, d, length, generator=g).to(BF16), (torch.rand(b, d, length, generator=g) + 0.1).to(BF16),
            -torch.rand(d, n, generator=g) - 0.5, torch.randn(b, n, length, generator=g).to(BF16),
            torch.randn(b, n, length, generator=g).to(BF16), torch.randn(d, generator=g)]


@pytest.mark.parametrize("narrow", [True, False], ids=["cast-back", "fp32-result"])
def test_the_fp32_copy_goes_only_where_the_result_is_cast_back(narrow):
    args = _inputs()
    report = explain(_scan_then_fp32_skip, *args, narrow)
    assert report.counts["scan_loop"] == 1 and report.counts["skip"] == 1, report.format(graphs=False)
    u, widened = _u_of_scan(report)
    # An fp32 result read as such keeps the op's fp32 y, and so its fp32 copy of u.
    assert (u in widened) != narrow, report.graphs[0].after
    got, want = report.output, _scan_then_fp32_skip(*args, narrow)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
