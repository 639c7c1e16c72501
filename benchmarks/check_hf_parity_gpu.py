"""HF MambaForCausalLM through backend="ssm" against eager on the GPU (issue 3's CUDA parity).

  python benchmarks/check_hf_parity_gpu.py

Tiny random configs over use_bias / use_conv_bias / time_step_rank / use_associative_scan in
fp32 (target rel err 1e-5) and bf16, plus the 130m shape at L=512 in bf16; prints one line per
case with the relative error of the logits and which ssm passes fired.
"""
from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from transformers import MambaConfig, MambaForCausalLM

CASES = [
    dict(use_bias=False, use_conv_bias=True, time_step_rank="auto", use_associative_scan=True),
    dict(use_bias=True, use_conv_bias=False, time_step_rank=4, use_associative_scan=True),
    dict(use_bias=False, use_conv_bias=True, time_step_rank="auto", use_associative_scan=False),
]


def one(cfg_kw, dtype, L, batch=2, big=False):
    shape = (dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24) if big
             else dict(vocab_size=128, hidden_size=64, state_size=16, num_hidden_layers=2))
    torch.manual_seed(0)
    model = MambaForCausalLM(MambaConfig(**shape, **cfg_kw)).to("cuda", dtype).eval()
    ids = torch.randint(0, shape["vocab_size"], (batch, L), device="cuda")
    counters.clear()
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits.double()
        out = torch.compile(model, backend="ssm")(ids, use_cache=False).logits.double()
    err = ((out - ref).norm() / ref.norm()).item()
    print(f"{'130m' if big else 'tiny'} {dtype} L={L} {cfg_kw}: rel err {err:.2e}; "
          f"rewrites {dict(counters['ssm'])}", flush=True)


def main():
    for kw in CASES:
        one(kw, torch.float32, 40)
    one(CASES[0], torch.bfloat16, 40)
    one(dict(use_associative_scan=True), torch.bfloat16, 512, batch=1, big=True)


if __name__ == "__main__":
    main()
