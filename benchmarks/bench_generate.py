"""Generation benchmark: HF Mamba-130m-shaped model (random weights, bf16) on one GPU.

Measures, per configuration and batch size:
- TTFT: the prefill of a 2048-token prompt, through the argmax of the first new token;
- decode tokens/s: greedy single-token steps continuing from that prefill.

Configurations: ``eager`` (HF's torch fallbacks), ``inductor`` (``torch.compile`` default),
``ssm`` (``backend="ssm"``), ``ssm-py`` (the same with inductor's Python wrapper instead of the
C++ one that the backend picks on CUDA), ``ssm-ops`` (the decode ops kept whole rather than
inlined into inductor's code) and ``ssm-cg`` (``ssm_compile.backend(mode="reduce-overhead")``,
CUDA graphs). Every configuration gets the same pre-allocated cache (``static_cache``): HF marks
cache tensors static only when they are created outside compiled code, which CUDA graphs need,
and reusing one cache across runs (``cache.reset()``) keeps the graphs' addresses valid.

The greedy loop calls ``model.forward`` directly (not ``generate()``) so that the numbers are the
model's, not the generation loop's. Runs within ~6 minutes: batch 1 for every configuration
first (the 5x decode target is at batch 1), then batch 16; whatever would exceed
``--time-budget`` is reported as skipped. Works with torch 2.11 / transformers 5.17 (whose
``forward`` calls the cache ``cache_params``) and later.

    python benchmarks/bench_generate.py [--batches 1,16] [--configs eager,inductor,ssm,ssm-cg]
"""
from __future__ import annotations

import argparse
import inspect
import time

import torch
from common import dynamo_folds_is_exporting, markdown_table, write_out
from torch._dynamo.utils import counters
from transformers import DynamicCache, MambaConfig, MambaForCausalLM

import ssm_compile

CONFIG_130M = dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24, expand=2, conv_kernel=4)
CACHE_KW = "cache" if "cache" in inspect.signature(MambaForCausalLM.forward).parameters else "cache_params"


def static_cache(model, batch):
    cfg, p = model.config, next(model.parameters())
    cache = DynamicCache(config=cfg)
    for layer in cache.layers:
        layer.lazy_initialization(conv_states=torch.zeros(batch, cfg.intermediate_size, cfg.conv_kernel,
                                                          dtype=p.dtype, device=p.device),
                                  conv_kernel_size=cfg.conv_kernel)
        layer.lazy_initialization(recurrent_states=torch.zeros(batch, cfg.intermediate_size, cfg.state_size,
                                                               dtype=torch.float32, device=p.device))
    return cache


def make_forward(model, name):
    if name == "eager":
        return model.forward
    if name == "inductor":
        return torch.compile(model.forward)
    if name == "ssm":
        return torch.compile(model.forward, backend="ssm")
    if name == "ssm-py":
        return torch.compile(model.forward, backend=ssm_compile.backend(cpp_wrapper=False))
    if name == "ssm-ops":
        # The decode ops kept whole, launched through their own op layer and Triton's run():
        # the path before the ops' launches were handed to inductor (kernels/inline.py).
        return torch.compile(model.forward, backend=ssm_compile.backend(inline_launches=False))
    if name == "ssm-cg":
        return torch.compile(model.forward, backend=ssm_compile.backend(mode="reduce-overhead"))
    raise ValueError(f"unknown config {name!r}")


def step(forward, ids, cache, cudagraphs):
    if cudagraphs:
        # Each call starts a new CUDA-graph generation: the previous logits are consumed already.
        torch.compiler.cudagraph_mark_step_begin()
    out = forward(input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_KW: cache})
    return out.logits[:, -1].argmax(-1, keepdim=True)


def sync_time(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def run_config(model, name, batch, prompt, decode_tokens, timed_reps, eager_prefill=False, profile=False):
    forward = make_forward(model, name)
    cg = name == "ssm-cg"
    cache = static_cache(model, batch)

    def prefill():
        cache.reset()
        if eager_prefill:
            return step(model.forward, prompt, cache, False)
        return step(forward, prompt, cache, cg)

    def decode(tok, n):
        toks = [tok]
        for _ in range(n):
            toks.append(step(forward, toks[-1], cache, cg))
        return torch.cat(toks, dim=1)

    # Warm-up: compiles (and, for CUDA graphs, records) the prefill and decode graphs.
    t0 = time.perf_counter()
    warm_reps = 1 if name == "eager" else 2
    for _ in range(warm_reps):
        tok = prefill()
        decode(tok, 3)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0

    ttft = min(sync_time(prefill)[1] for _ in range(timed_reps))
    tok = prefill()
    tokens, t_dec = sync_time(lambda: decode(tok, decode_tokens))
    r = dict(ttft_ms=ttft * 1e3, decode_tps=batch * decode_tokens / t_dec, warm_s=warm_s, tokens=tokens.cpu(),
             graphs=counters["stats"]["unique_graphs"], breaks=sum(counters["graph_break"].values()))
    if profile:
        # Where a host-bound decode step spends its time: self CPU time per op over 8 steps.
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        # The step's own output as input: a slice of ``tokens`` has other strides (a recompile).
        tok = prefill()
        decode(tok, 2)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            decode(tok, 8)
            torch.cuda.synchronize()
        r["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        # The same steps under cProfile: which Python functions (ours, dynamo's guards, Triton's
        # launcher, inductor's wrapper) the host time is spent in; torch.profiler sees only ops.
        import cProfile
        import io
        import pstats

        prof_py = cProfile.Profile()
        prof_py.enable()
        decode(tok, 8)
        torch.cuda.synchronize()
        prof_py.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof_py, stream=out).sort_stats("tottime")
        stats.print_stats(45)
        stats.sort_stats("cumulative").print_stats(45)
        r["profile"] += "\n\ncProfile, 8 decode steps\n" + out.getvalue()
    return r


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16")
    # CUDA graphs first: if the budget runs out, the slow-compiling inductor baseline goes first.
    parser.add_argument("--configs", default="eager,ssm-cg,ssm,inductor")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--time-budget", type=float, default=330.0, help="seconds; later runs are skipped")
    parser.add_argument("--profile", default="",
                        help="configs (comma-separated) whose batch-1 decode steps are also profiled "
                             "(torch.profiler; tables written as profile_<config>.txt)")
    args = parser.parse_args()
    start = time.perf_counter()

    torch.manual_seed(0)
    model = MambaForCausalLM(MambaConfig(**CONFIG_130M)).to("cuda", torch.bfloat16).eval()
    batches = [int(b) for b in args.batches.split(",")]
    configs = args.configs.split(",")
    rows, eager, took = [], {}, {}
    # Where dynamo folds is_exporting() to True (torch 2.11), torch's own backends see HF's time
    # loop, and inductor would unroll the 2048-step prefill x 24 layers (not done in minutes):
    # its prefill then runs eagerly and only its decode step is compiled.
    folded = dynamo_folds_is_exporting()
    for batch in batches:
        prompt = torch.randint(0, CONFIG_130M["vocab_size"], (batch, args.prompt_len),
                               generator=torch.Generator().manual_seed(batch)).cuda()
        for name in configs:
            elapsed = time.perf_counter() - start
            # A larger batch costs about what the first one did (compilation dominates).
            expected = took.get(name, 0.0)
            if elapsed + expected > args.time_budget:
                rows.append([name, batch, "-", "-", "-", "-",
                             f"skipped (time budget: {elapsed:.0f} s used, ~{expected:.0f} s needed)"])
                continue
            torch._dynamo.reset()
            counters.clear()
            t_config = time.perf_counter()
            try:
                with torch.no_grad():
                    r = run_config(model, name, batch, prompt, args.decode_tokens, 1 if name == "eager" else 3,
                                   eager_prefill=folded and name == "inductor",
                                   profile=batch == 1 and name in args.profile.split(","))
            except Exception as e:  # noqa: BLE001 - one failing configuration must not hide the others
                rows.append([name, batch, "-", "-", "-", "-", f"error: {type(e).__name__}: {str(e)[:120]}"])
                continue
            finally:
                torch.cuda.empty_cache()
                took[name] = time.perf_counter() - t_config
            if "profile" in r:
                write_out(f"profile_{name}.txt", r["profile"])
            if name == "eager":
                eager[batch] = r
            ref = eager.get(batch)
            speedup = f"{r['decode_tps'] / ref['decode_tps']:.2f}x" if ref else "-"
            same = "-" if ref is None else str(torch.equal(r["tokens"], ref["tokens"]))
            if folded and name == "inductor":
                same += "; prefill eager (HF loop path under this torch)"
            rows.append([name, batch, f"{r['ttft_ms']:.1f}", f"{r['decode_tps']:.1f}", speedup,
                         f"{r['warm_s']:.1f}", f"greedy tokens = eager: {same}; {r['graphs']} graphs, "
                                               f"{r['breaks']} graph breaks"])
            print(" | ".join(map(str, rows[-1])), flush=True)  # kept if a later config hangs

    import transformers

    head = (f"## bench_generate: HF Mamba-130m shape, random weights, bf16, prompt {args.prompt_len}, "
            f"{args.decode_tokens} decode steps\n\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}. TTFT = best of the timed prefills; decode tokens/s = "
            "batch x steps / time; speedup = decode tokens/s vs eager at the same batch. Warm-up includes "
            "compilation (and CUDA-graph recording). With random bf16 weights greedy tokens may legitimately "
            "diverge after a near-tie; it is reported, not asserted.\n\n")
    table = markdown_table(["config", "batch", "TTFT ms", "decode tok/s", "decode speedup", "warm-up s", "notes"], rows)
    write_out("bench_generate.md", head + table + f"\n\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
