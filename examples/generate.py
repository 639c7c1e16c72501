"""Greedy generation with Hugging Face Mamba: eager vs ``torch.compile(backend="ssm")``.

    python examples/generate.py                                     # tiny random model, CPU
    python examples/generate.py --device cuda --size 130m --dtype bf16
    python examples/generate.py --device cuda --size 130m --dtype bf16 --cuda-graphs

The model keeps random weights (nothing is downloaded); greedy decoding of the same weights must
give the same tokens with and without the backend. Only ``model.forward`` is compiled, so
``generate()`` stays the stock Hugging Face loop: one graph for the prefill, one for every decode
step, in which the backend has put ``ssm::causal_conv1d_update`` and ``ssm::selective_state_update``.

``--cuda-graphs`` compiles with ``ssm_compile.backend(mode="reduce-overhead")``. CUDA graphs replay
fixed addresses, so the cache must exist before compilation: Hugging Face marks cache tensors
static only when they are created outside a compiled region, which ``static_cache`` arranges.
"""
import argparse
import inspect
import time

import torch
from transformers import DynamicCache, MambaConfig, MambaForCausalLM

import ssm_compile

SIZES = {
    "tiny": dict(vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2),
    "130m": dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# How generate() takes a cache: transformers 5.24's Mamba takes the standard ``past_key_values``
# (its forward calls it ``cache``); 5.17's takes only its forward's own name, ``cache_params``.
CACHE_KW = ("past_key_values" if "cache" in inspect.signature(MambaForCausalLM.forward).parameters
            else "cache_params")


def build_model(size: str, device: str, dtype: torch.dtype) -> MambaForCausalLM:
    torch.manual_seed(0)
    config = MambaConfig(**SIZES[size], expand=2, conv_kernel=4)
    model = MambaForCausalLM(config).to(device=device, dtype=dtype).eval()
    # Random weights emit EOS at random; never stopping early keeps every run the same length.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def static_cache(model: MambaForCausalLM, batch: int) -> DynamicCache:
    """A Mamba cache whose conv and recurrent states are allocated now, outside any compiled code."""
    cfg = model.config
    p = next(model.parameters())
    cache = DynamicCache(config=cfg)
    for layer in cache.layers:
        layer.lazy_initialization(conv_states=torch.zeros(batch, cfg.intermediate_size, cfg.conv_kernel,
                                                          dtype=p.dtype, device=p.device),
                                  conv_kernel_size=cfg.conv_kernel)
        # The ssm ops keep the recurrent state in fp32 whatever the activation dtype.
        layer.lazy_initialization(recurrent_states=torch.zeros(batch, cfg.intermediate_size, cfg.state_size,
                                                               dtype=torch.float32, device=p.device))
    return cache


def generate(model, prompt, new_tokens, cache=None):
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(prompt))
    if cache is not None:
        cache.reset()
        kwargs[CACHE_KW] = cache
    return model.generate(prompt, **kwargs)


def timed(fn, device):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cuda-graphs", action="store_true", help='backend(mode="reduce-overhead")')
    args = parser.parse_args()
    if args.cuda_graphs and args.device != "cuda":
        parser.error("--cuda-graphs needs --device cuda")

    model = build_model(args.size, args.device, DTYPES[args.dtype])
    prompt = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt_len),
                           generator=torch.Generator().manual_seed(0)).to(args.device)
    n_tokens = args.batch * args.new_tokens

    generate(model, prompt, 2)  # warm up the eager kernels
    eager, t_eager = timed(lambda: generate(model, prompt, args.new_tokens), args.device)
    print(f"eager: {t_eager:.2f} s, {n_tokens / t_eager:.1f} tokens/s")

    if args.cuda_graphs:
        backend, cache = ssm_compile.backend(mode="reduce-overhead"), static_cache(model, args.batch)
    else:
        backend, cache = "ssm", None
    model.forward = torch.compile(model.forward, backend=backend)
    _, t_compile = timed(lambda: generate(model, prompt, args.new_tokens, cache), args.device)
    print(f"ssm first call (compiles the prefill and decode graphs): {t_compile:.1f} s")
    compiled, t_ssm = timed(lambda: generate(model, prompt, args.new_tokens, cache), args.device)
    print(f"ssm{' + CUDA graphs' if args.cuda_graphs else ''}: {t_ssm:.2f} s, {n_tokens / t_ssm:.1f} tokens/s "
          f"({t_eager / t_ssm:.1f}x eager)")

    counts = dict(torch._dynamo.utils.counters["ssm"])
    print(f"rewrites: {counts}")
    same = torch.equal(eager, compiled)
    print(f"tokens identical to eager: {same}")
    print("generated:", compiled[0, args.prompt_len:args.prompt_len + 16].tolist(), "...")
    if not same:
        diverge = (eager != compiled).int().argmax(dim=1)
        print(f"first differing position per sequence: {diverge.tolist()}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
