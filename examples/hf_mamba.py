"""Compile an unmodified Hugging Face MambaForCausalLM with backend="ssm": report, parity, timing.

    python examples/hf_mamba.py                                   # tiny random model, CPU
    python examples/hf_mamba.py --device cuda --size 130m --dtype bf16 --seq-len 2048

Weights are random (no downloads). The script prints what the backend rewrote (``explain``),
asserts the compiled logits match eager, and times both (median after warm-up; CUDA events on GPU).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import MambaConfig, MambaForCausalLM

from ssm_compile.report import explain

SIZES = {
    # hidden, layers, vocab, state
    "tiny": dict(hidden_size=64, num_hidden_layers=2, vocab_size=256, state_size=8),
    "130m": dict(hidden_size=768, num_hidden_layers=24, vocab_size=50280, state_size=16),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Relative error of the logits vs eager. Both sides round differently in low precision, and the
# error grows with depth, so the half-precision bounds are looser than a single op's.
PARITY_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--size", default="tiny", choices=list(SIZES))
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--seq-len", type=int, default=None,
                   help="default: 32 (tiny), 256 (130m; the loop form unrolls L steps per layer in dynamo)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--scan", default="hf-default", choices=["hf-default", "loop", "assoc"],
                   help="HF's scan form: its Python loop or torch associative_scan (transformers >= 5.24 "
                        "defaults to assoc; older versions only have the loop)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--show-graphs", action="store_true", help="print the graphs before/after the passes")
    return p.parse_args()


def build_model(size: str, scan: str, device: str, dtype: torch.dtype) -> MambaForCausalLM:
    torch.manual_seed(0)
    extra = {} if scan == "hf-default" else {"use_associative_scan": scan == "assoc"}
    config = MambaConfig(**SIZES[size], **extra)
    return MambaForCausalLM(config).eval().to(device=device, dtype=dtype)


def median_ms(fn, device: str, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    dtype = DTYPES[args.dtype]
    seq_len = args.seq_len or (32 if args.size == "tiny" else 256)
    model = build_model(args.size, args.scan, args.device, dtype)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, seq_len), device=args.device,
                        generator=torch.Generator(device=args.device).manual_seed(1))
    print(f"HF MambaForCausalLM size={args.size} layers={model.config.num_hidden_layers} "
          f"d_model={model.config.hidden_size} state={model.config.state_size} dtype={args.dtype} "
          f"device={args.device} batch={args.batch} seq_len={seq_len} "
          f"scan={'assoc' if getattr(model.config, 'use_associative_scan', False) else 'loop'}")

    with torch.no_grad():
        report = explain(model, ids, use_cache=False)
        print(report.format(graphs=args.show_graphs))

        compiled = torch.compile(model, backend="ssm")
        eager_logits = model(ids, use_cache=False).logits
        t0 = time.perf_counter()
        ssm_logits = compiled(ids, use_cache=False).logits
        print(f"first compiled call (compile + run): {time.perf_counter() - t0:.1f} s")

        err = ((ssm_logits.double() - eager_logits.double()).norm() / eager_logits.double().norm()).item()
        print(f"parity: rel err of logits vs eager = {err:.2e} (tolerance {PARITY_TOL[dtype]:.0e})")
        assert torch.isfinite(ssm_logits).all(), "non-finite logits from the compiled model"
        assert err <= PARITY_TOL[dtype], f"compiled logits differ from eager: rel err {err:.2e}"

        eager_ms = median_ms(lambda: model(ids, use_cache=False), args.device, args.warmup, args.iters)
        ssm_ms = median_ms(lambda: compiled(ids, use_cache=False), args.device, args.warmup, args.iters)
    print(f"eager: {eager_ms:.3f} ms   ssm: {ssm_ms:.3f} ms   speedup: {eager_ms / ssm_ms:.2f}x "
          f"(median of {args.iters} after {args.warmup} warm-up)")


if __name__ == "__main__":
    main()
