"""The LM head's logits: bf16 matmul then ``.float()`` (HF MambaForCausalLM) against one matmul
that writes fp32 directly (``torch.mm(..., out_dtype=torch.float32)``), eager and under inductor.

    python benchmarks/probe_logits.py [--tokens 16384] [--vocab 50280] [--hidden 768]

Answers, for the end-to-end forward (issue 5): what the separate cast costs, whether cuBLAS's
fp32-output path is as fast as its bf16 one at this shape, and whether this torch's inductor
lowers ``aten.mm.dtype`` (and keeps it one kernel).
"""
import argparse
import traceback

import torch
import torch.nn.functional as F

from common import copy_bandwidth_gbs, markdown_table, median_ms, matmul_tflops, write_out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--vocab", type=int, default=50280)
    p.add_argument("--hidden", type=int, default=768)
    args = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16) * args.hidden ** -0.5
    bw = copy_bandwidth_gbs()
    tf = matmul_tflops()
    flops = 2 * args.tokens * args.hidden * args.vocab
    out_bytes = 4 * args.tokens * args.vocab

    def cast_after(x, w):
        return F.linear(x, w).float()

    def fp32_out(x, w):
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    def bf16_only(x, w):
        return F.linear(x, w)

    rows = []
    ref = torch.mm(x.double(), w.double().t())
    for name, fn in [("linear bf16 (no cast)", bf16_only), ("linear bf16 + .float()", cast_after),
                     ("mm out_dtype=fp32", fp32_out)]:
        for mode in ("eager", "inductor"):
            try:
                f = fn if mode == "eager" else torch.compile(fn, dynamic=False)
                y = f(x, w)
                err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                ms = median_ms(lambda: f(x, w))
                rows.append([name, mode, ms, f"{flops / ms / 1e9:.0f}", f"{err:.2e}"])
            except Exception:  # noqa: BLE001 - report what does not run and go on
                traceback.print_exc()
                rows.append([name, mode, "error", "-", "-"])
            print(rows[-1], flush=True)
    text = (f"copy BW {bw:.0f} GB/s, matmul {tf:.0f} TFLOP/s; floor {flops / tf / 1e9:.3f} ms "
            f"matmul + {out_bytes / bw / 1e6:.3f} ms fp32 logits write\n\n"
            + markdown_table(["variant", "mode", "graph ms", "TFLOP/s", "max err / max |ref|"], rows))
    write_out("probe_logits.md", text)


if __name__ == "__main__":
    main()
