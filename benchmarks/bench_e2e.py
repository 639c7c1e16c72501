"""End-to-end forward benchmark of a 130m-shaped HF Mamba on the GPU.

  python benchmarks/bench_e2e.py [--lens 512 2048] [--batch 8] [--dtype bf16] [--loop-len 128]

Columns: backend="ssm", eager HF, inductor on the associative_scan path, inductor on the loop
path (one layer, small L only: its compile time grows with L — the issue quotes 346 s for one
layer at L=1024 — so the model figure is that layer's time x 24, marked as extrapolated).
Reports tokens/s, compile time, and the fraction of the roofline floor, where the floor is the
matmul FLOPs at the measured matmul rate plus the minimal bytes at the measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import ssm_compile

from common import copy_bandwidth_gbs, dynamo_folds_is_exporting, event_median_ms, markdown_table, matmul_tflops, median_ms, write_out

D_MODEL, N_LAYER, VOCAB, N_STATE, EXPAND, D_CONV = 768, 24, 50280, 16, 2, 4


def build(use_assoc: bool, dtype, layers: int = N_LAYER):
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(vocab_size=VOCAB, hidden_size=D_MODEL, state_size=N_STATE, num_hidden_layers=layers,
                      expand=EXPAND, conv_kernel=D_CONV, use_associative_scan=use_assoc)
    torch.manual_seed(0)
    return MambaForCausalLM(cfg).to("cuda", dtype)


def floor_ms(batch: int, seqlen: int, dtype_bytes: int, tflops: float, gbs: float) -> float:
    """Matmul FLOPs at the measured rate + minimal HBM bytes at the measured copy bandwidth."""
    di, r = EXPAND * D_MODEL, -(-D_MODEL // 16)
    tok = batch * seqlen
    flops = 2 * tok * (N_LAYER * (D_MODEL * 2 * di + di * (r + 2 * N_STATE) + r * di + di * D_MODEL) + D_MODEL * VOCAB)
    # Per layer, every matmul output must reach HBM once and be read once: in_proj (2*di),
    # conv output feeding x_proj (di), x_proj output (r + 2N), scan output (di), out_proj (d_model),
    # plus the residual stream read once. Weights are read once; logits written once, in fp32:
    # HF's MambaForCausalLM returns ``lm_head(...).float()`` whatever the model's dtype (until run
    # 15 this counted them at the model's dtype, 0.39 ms less at batch 8, L=2048).
    per_layer = tok * (2 * D_MODEL + 2 * (2 * di + di + (r + 2 * N_STATE) + di)) * dtype_bytes
    weights = (N_LAYER * (D_MODEL * 2 * di + di * (r + 2 * N_STATE) + r * di + di * D_MODEL + di * (D_CONV + N_STATE + 3))
               + VOCAB * D_MODEL) * dtype_bytes
    nbytes = N_LAYER * per_layer + weights + tok * VOCAB * 4
    return flops / (tflops * 1e12) * 1e3 + nbytes / (gbs * 1e9) * 1e3


def timed_compile(fn, *args):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def assoc_core(hidden, in_w, in_b, conv_w, conv_b, xproj_w, dt_w, dt_b, A_log, D, out_w, out_b, rank: int, n: int):
    """HF MambaMixer's forward with torch's associative_scan called directly (the baseline the
    issue asks for where transformers leaves the unrolled loop in the compiled graph). Tensors
    only, so one ``torch.compile`` of it serves every layer (the training baseline)."""
    from torch._higher_order_ops.associative_scan import associative_scan

    L = hidden.shape[1]
    xz = F.linear(hidden, in_w, in_b).transpose(1, 2)
    x, z = xz.chunk(2, dim=1)
    x = F.silu(F.conv1d(x, conv_w, conv_b, padding=conv_w.shape[-1] - 1, groups=x.shape[1])[..., :L])
    dt, B, C = torch.split(F.linear(x.transpose(1, 2), xproj_w), [rank, n, n], dim=-1)
    dt = F.softplus(F.linear(dt, dt_w, dt_b)).transpose(1, 2).float()
    A = -torch.exp(A_log.float())
    dA = torch.exp(A[None, :, None, :] * dt[..., None])
    dBu = dt[..., None] * B[:, None].float() * x[..., None].float()

    def combine(left, right):
        return left[0] * right[0], right[0] * left[1] + right[1]

    _, h = associative_scan(combine, (dA, dBu), dim=2, combine_mode="pointwise")
    y = torch.matmul(h.transpose(1, 2), C.float().unsqueeze(-1)).squeeze(-1).transpose(1, 2)
    y = (y + x * D[None, :, None]) * F.silu(z)
    return F.linear(y.transpose(1, 2).to(hidden.dtype), out_w, out_b)


def mixer_assoc(mixer, hidden, core=assoc_core):
    return core(hidden, mixer.in_proj.weight, mixer.in_proj.bias, mixer.conv1d.weight, mixer.conv1d.bias,
                mixer.x_proj.weight, mixer.dt_proj.weight, mixer.dt_proj.bias, mixer.A_log, mixer.D,
                mixer.out_proj.weight, mixer.out_proj.bias, mixer.time_step_rank, mixer.ssm_state_size)


def scan_path(dtype, backend) -> str:
    """Which scan form dynamo captures from this transformers for ``backend`` ("ssm": ours;
    "torch": any other backend, observed through one that runs the ssm passes on a copy of the
    graph): compile a 1-layer model at a small L and read which pass fired. The loop form unrolls
    L steps per layer, so its compile time grows with L x layers."""
    from ssm_compile.compiler import SSMBackend
    from ssm_compile.config import SSMOptions

    counters.clear()
    torch._dynamo.reset()
    probe = build(True, dtype, layers=1).eval()
    ssm = SSMBackend(SSMOptions.from_kwargs(inductor=False))
    fn = ssm if backend == "ssm" else _observe_only(ssm)
    with torch.no_grad():
        torch.compile(probe, backend=fn)(torch.randint(0, VOCAB, (1, 32), device="cuda"))
    fired = dict(counters["ssm"])
    torch._dynamo.reset()
    return "assoc" if fired.get("scan_assoc") else "loop" if fired.get("scan_loop") else "none"


def _observe_only(ssm):
    """A backend that is not ours (so dynamo_compat leaves torch's behaviour alone) but runs the
    ssm passes on a copy of the graph to see which scan form torch's own backends receive."""
    import copy

    from ssm_compile.kernels import register_ops

    register_ops()

    def observe(gm, example_inputs):
        ssm.pass_manager()(copy.deepcopy(gm))
        return gm.forward

    return observe


def with_direct_assoc(model, core=assoc_core):
    """A copy of ``model`` whose mixers call torch's associative_scan directly (``mixer_assoc``):
    the inductor associative_scan baseline where torch's own backends see HF's loop. ``core``
    may be a compiled ``assoc_core``, shared by all layers."""
    import copy
    import functools

    twin = copy.deepcopy(model)
    for layer in twin.backbone.layers:
        layer.mixer.forward = functools.partial(lambda mixer, h, **_: mixer_assoc(mixer, h, core), layer.mixer)
    return twin


def train_step_ms(model, fn, ids, micro: int = 1):
    """One AdamW step on the whole batch. With ``micro`` > 1 the batch goes through in that many
    equal micro-batches whose gradients accumulate (the same step: HF's loss is a token mean and
    every micro-batch has the same token count), for a baseline whose activations do not fit."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        for part in ids.chunk(micro):
            (fn(part, labels=part).loss / micro).backward()
        opt.step()

    return step


LOOP_HEADER = ["loop-form model", "L", "compile s", "graphs", "loop rewrites", "fwd ms", "tokens/s", "time/ssm",
               "logits rel err"]


def loop_model_rows(args, dtype, notes, over_budget):
    """The whole model on HF's unrolled-loop path (``use_associative_scan=False``), every
    backend compiling the repeated block once (regional compilation: ``block.compile()`` on
    each of the 24 MambaBlocks; dynamo reuses the first block's code for the rest, so the
    compile time is one block's, not 24 x L steps of tracing). This is how the loop path can be
    measured at model scale at all: compiling the whole model at once unrolls 24 x L steps.
    ``use_cache=False`` because HF's cache object is guarded per layer index, which would make
    every block compile anew. Rows: eager, then ssm and inductor, each regional (the forward
    part has ssm on the whole associative_scan-form model); the error is against eager's
    logits."""
    import copy

    L = args.loop_model_len
    net = build(False, dtype).eval()
    ids = torch.randint(0, VOCAB, (args.batch, L), device="cuda")
    tok = args.batch * L
    rows = []
    with torch.no_grad():
        ref = net(ids, use_cache=False).logits.float()

        def add(name, fn, slow=False):
            torch._dynamo.reset()
            counters.clear()
            print(f"loop-form model: {name} at L={L} ...", flush=True)
            try:
                c = timed_compile(lambda: fn(ids, use_cache=False)) if fn is not net else 0.0
                out = fn(ids, use_cache=False).logits.float()
                call = lambda: fn(ids, use_cache=False)  # noqa: E731
                # Eager and inductor's loop take ~1 s per call: a few event-timed calls.
                ms = event_median_ms(call, warmup=1, iters=3) if slow else median_ms(call)
                err = ((out - ref).norm() / ref.norm()).item()
                if counters["graph_break"]:
                    notes.append(f"loop-form model {name}: graph breaks {dict(counters['graph_break'])}")
                rows.append([name, L, c, counters["stats"]["unique_graphs"], counters["ssm"].get("scan_loop", 0), ms,
                             tok / ms * 1e3, None, err])
                print(f"  compile {c:.1f} s, {ms:.2f} ms", flush=True)
            except Exception as e:  # noqa: BLE001 - a failing baseline must not end the run
                notes.append(f"loop-form model {name} L={L}: {type(e).__name__}: {str(e)[:300]}")
                print(notes[-1], flush=True)

        def regional(backend=None):
            twin = copy.deepcopy(net)
            for block in twin.backbone.layers:
                block.compile(**({} if backend is None else {"backend": backend}))
            return twin

        add("eager", net, slow=True)
        add("ssm (regional)", regional(ssm_compile.backend()))
        if not over_budget(f"inductor regional loop path at L={L}"):
            add("inductor loop path (regional)", regional(), slow=True)
    ssm_ms = next((r[5] for r in rows if r[0] == "ssm (regional)"), float("nan"))
    for r in rows:
        r[7] = r[5] / ssm_ms
    print(markdown_table(LOOP_HEADER, rows), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--loop-len", type=int, default=128, help="L for the one-layer inductor loop-path baseline")
    p.add_argument("--loop-model-len", type=int, default=512,
                   help="L for the whole-model loop-path comparison (part loopmodel, regional compilation)")
    p.add_argument("--train-lens", type=int, nargs="+", default=[2048, 128],
                   help="L of the training-step comparison; the short one is where associative_scan's "
                        "O(L^2) backward still fits")
    p.add_argument("--time-budget", type=float, default=300, help="seconds; later baselines are skipped")
    p.add_argument("--parts", default="forward,layer,train",
                   help="which of forward,layer,loopmodel,train to run")
    p.add_argument("--no-assoc", action="store_true",
                   help="skip the forward's inductor associative_scan rows (a re-measure of our side only)")
    p.add_argument("--fuse-variants", nargs="*", default=[],
                   help="also time backend='ssm' with these fuse overrides (CUDA graphs), e.g. dt split")
    p.add_argument("--profile", action="store_true",
                   help="also profile the ssm forward at each L (profile_e2e_ssm_L<L>.txt)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    start = time.perf_counter()
    notes = []

    def over_budget(what: str) -> bool:
        if time.perf_counter() - start > args.time_budget:
            notes.append(f"skipped {what}: time budget of {args.time_budget:.0f} s used up")
            return True
        return False

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    nbytes = torch.finfo(dtype).bits // 8
    gbs, tflops = copy_bandwidth_gbs(), matmul_tflops()
    print(f"copy bandwidth {gbs:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
    ssm_path, torch_path = scan_path(dtype, "ssm"), scan_path(dtype, "torch")
    notes.append(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}: "
                 f"dynamo folds is_exporting() to True: {dynamo_folds_is_exporting()}; scan form under "
                 f"backend='ssm': {ssm_path!r}, under torch's own backends: {torch_path!r}")
    print(notes[-1], flush=True)

    rows = []
    model = build(True, dtype).eval()

    def model_fp32():
        # The same weights in fp32 (an exact cast).
        import copy

        return copy.deepcopy(model).float()
    # Inductor on the associative_scan path: HF's own branch where torch's backends reach it,
    # otherwise the same weights with associative_scan called directly in every mixer.
    assoc_model = model if torch_path == "assoc" else with_direct_assoc(model)
    assoc_name = "inductor assoc (HF)" if torch_path == "assoc" else "inductor assoc (direct)"
    for L in args.lens if "forward" in parts else []:
        # A fresh compile per length: the compile-time column is then a cold compile at that L.
        torch._dynamo.reset()
        ids = torch.randint(0, VOCAB, (args.batch, L), device="cuda")
        tok = args.batch * L
        fl = floor_ms(args.batch, L, nbytes, tflops, gbs)
        with torch.no_grad():
            ref = model(ids).logits.float()
            res = {"eager": (0.0, median_ms(lambda: model(ids), warmup_ms=1, rep_ms=1))}
            graphs0, breaks0 = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
            ssm = torch.compile(model, backend="ssm")
            c = timed_compile(ssm, ids)
            out = ssm(ids).logits.float()
            # A random 24-layer bf16 model is far from its own fp32 twin (RESULTS.md, "CUDA
            # parity"), so ssm-vs-eager in bf16 measures the model's sensitivity. The parity check
            # is against the fp32 twin run eagerly: ssm's bf16 error should not exceed eager's.
            twin = model_fp32()
            ref32 = twin(ids).logits.float()
            del twin

            def err(x):
                return ((x - ref32).norm() / ref32.norm()).item()

            notes.append(f"L={L}: logits rel err against the eager fp32 model: eager {args.dtype} {err(ref):.2e}, "
                         f"ssm {args.dtype} {err(out):.2e} (ssm vs eager {args.dtype}: "
                         f"{((out - ref).norm() / ref.norm()).item():.2e})")
            print(notes[-1], flush=True)
            res["ssm"] = (c, median_ms(lambda: ssm(ids)))
            if args.profile:
                # Where the host time of the short-sequence forward goes (issue 5: host-bound at
                # L=512): self CPU time per op over 3 calls, with the graph and break counts.
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                             record_shapes=True) as prof:
                    for _ in range(3):
                        ssm(ids)
                    torch.cuda.synchronize()
                # The second table splits the matmuls by shape (in_proj, x_proj, dt_proj,
                # out_proj, the LM head), to set each against its own FLOP and byte floor.
                write_out(f"profile_e2e_ssm_L{L}.txt",
                          f"graphs {counters['stats']['unique_graphs'] - graphs0}, graph breaks "
                          f"{sum(counters['graph_break'].values()) - breaks0}\n"
                          + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                          + "\n\nBy input shape, by GPU time:\n"
                          + prof.key_averages(group_by_input_shape=True).table(
                              sort_by="self_cuda_time_total", row_limit=25))
            if not over_budget(f"ssm with CUDA graphs at L={L}"):
                # mode="reduce-overhead": the same kernels replayed from a CUDA graph, without the
                # per-op host cost that dominates the short sequence.
                torch._dynamo.reset()
                ssm_cg = torch.compile(model, backend=ssm_compile.backend(mode="reduce-overhead"))

                def run_cg():
                    torch.compiler.cudagraph_mark_step_begin()
                    return ssm_cg(ids)

                c = timed_compile(lambda: (run_cg(), run_cg()))
                res["ssm (CUDA graphs)"] = (c, median_ms(run_cg))
            for fuse in args.fuse_variants:
                if over_budget(f"ssm fuse={fuse!r} with CUDA graphs at L={L}"):
                    break
                torch._dynamo.reset()
                variant = torch.compile(model, backend=ssm_compile.backend(mode="reduce-overhead", fuse=fuse))

                def run_variant():
                    torch.compiler.cudagraph_mark_step_begin()
                    return variant(ids)

                c = timed_compile(lambda: (run_variant(), run_variant()))
                notes.append(f"L={L}: fuse={fuse!r} logits rel err against the eager fp32 model: "
                             f"{err(run_variant().logits.float()):.2e}")
                res[f"ssm fuse={fuse} (CUDA graphs)"] = (c, median_ms(run_variant))
            if not args.no_assoc and not over_budget(f"{assoc_name} at L={L}"):
                try:
                    ind = torch.compile(assoc_model)
                    c = timed_compile(ind, ids)
                    res[assoc_name] = (c, median_ms(lambda: ind(ids)))
                except Exception as e:  # noqa: BLE001 - a failing baseline must not end the run
                    notes.append(f"{assoc_name} failed at L={L}: {type(e).__name__}: {str(e)[:300]}")
        for name, (c, ms) in res.items():
            rows.append([name, L, c, ms, tok / ms * 1e3, fl / ms, ms / res["ssm"][1]])
        print(markdown_table(["variant", "L", "compile s", "fwd ms", "tokens/s", "floor/time", "time/ssm"], rows),
              flush=True)

    # Inductor on the unrolled-loop path, one layer at a small L (compile time grows with L; the
    # issue quotes 346 s for one layer at L=1024), next to ssm on the same layer.
    layer_rows = []
    mixer = build(False, dtype, layers=1).backbone.layers[0].mixer.eval()
    L = args.loop_len
    h = torch.randn(args.batch, L, D_MODEL, device="cuda", dtype=dtype)
    with torch.no_grad():
        for name, fn in [] if "layer" not in parts else [("ssm", torch.compile(mixer, backend="ssm")),
                         ("inductor loop path", torch.compile(mixer)),
                         ("inductor assoc (direct)", torch.compile(lambda t: mixer_assoc(mixer, t))),
                         ("eager loop", mixer)]:
            if over_budget(f"one-layer {name}"):
                continue
            torch._dynamo.reset()
            try:
                c = timed_compile(fn, h)
                layer_rows.append([name, L, c, median_ms(lambda: fn(h))])
            except Exception as e:  # noqa: BLE001
                notes.append(f"layer {name} failed: {type(e).__name__}: {str(e)[:300]}")
    print(markdown_table(["one layer", "L", "compile s", "fwd ms"], layer_rows), flush=True)

    loop_rows = loop_model_rows(args, dtype, notes, over_budget) if "loopmodel" in parts else []

    train_rows = []
    model = assoc_model = None  # the forward part's copies: free their memory for training
    torch.cuda.empty_cache()
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    # Each length's rows in turn; the associative_scan baseline at the long length goes last,
    # since its backward (an (L, L) transition matrix per (batch, dim, N) element in torch's
    # implementation) is the one most likely to fail there.
    plan = [(L, name) for L in args.train_lens for name in ("ssm", "eager", assoc_name)]
    plan.sort(key=lambda p: p[1] == assoc_name and p[0] == max(args.train_lens))
    core = torch.compile(assoc_core)
    for L, name in plan if "train" in parts else []:
        if name != "ssm" and over_budget(f"training step {name} at L={L}"):
            continue
        ids = torch.randint(0, VOCAB, (args.batch, L), device="cuda")
        micro = 1
        if name == "eager":
            # HF's eager path keeps exp(Δ·A), Δ·B and Δ·B·u as fp32 (batch, dim, L, N) tensors for
            # backward in every layer, plus one (batch, dim, N) state per step. Where that does
            # not fit, the same step runs as accumulated micro-batches.
            eager_gib = N_LAYER * args.batch * EXPAND * D_MODEL * L * N_STATE * 4 * 4 / 2**30
            while eager_gib / micro > 0.6 * total_gib and micro < args.batch:
                micro *= 2
        label = name if micro == 1 else f"{name} ({micro} accumulated micro-batches)"
        torch._dynamo.reset()
        net = build(True, dtype).train()
        if name == assoc_name and torch_path != "assoc":
            # The optimizer must step the parameters that the timed model trains: the twin's.
            net = with_direct_assoc(net, core)
        if name == "ssm":
            run = torch.compile(net, backend="ssm")
        elif name == assoc_name and torch_path == "assoc":
            run = torch.compile(net)
        else:  # eager, or the twin whose mixers call the compiled associative_scan core
            run = net
        print(f"train step: {label} at L={L} ...", flush=True)
        try:
            step = train_step_ms(net, run, ids, micro)
            c = timed_compile(step)
            # The baselines take seconds per step: a few event-timed steps, not do_bench's dozens.
            # (eager at L=2048 took 161 s a step in run 11, so there the first step is the only warm-up.)
            slow = c > 5 and name == "eager"
            ms = median_ms(step) if name == "ssm" else event_median_ms(step, warmup=0 if slow else 1,
                                                                     iters=1 if slow else 3)
            train_rows.append([label, L, c, ms, args.batch * L / ms * 1e3, torch.cuda.max_memory_allocated() / 2**30])
            print(f"  first step {c:.1f} s, step {ms:.2f} ms", flush=True)
        except Exception as e:  # noqa: BLE001 - e.g. a baseline running out of memory
            notes.append(f"train {label} L={L}: {type(e).__name__}: {str(e)[:300]}")
            print(notes[-1], flush=True)
        del net, run
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    by_len = {}
    for row in train_rows:
        by_len.setdefault(row[1], {})[row[0]] = row[3]
    for row in train_rows:
        row.append(row[3] / by_len[row[1]]["ssm"] if "ssm" in by_len[row[1]] else float("nan"))
    train_header = ["train step", "L", "first step s", "step ms", "tokens/s", "peak GiB", "time/ssm"]
    print(markdown_table(train_header, train_rows), flush=True)

    write_out("bench_e2e.md", "\n\n".join([
        f"130m-shaped HF Mamba (24 layers, d_model 768), batch {args.batch}, {args.dtype}; "
        f"copy {gbs:.0f} GB/s, matmul {tflops:.0f} TFLOP/s (measured in this run)",
        markdown_table(["variant", "L", "compile s", "fwd ms", "tokens/s", "floor/time", "time/ssm"], rows),
        markdown_table(["one layer", "L", "compile s", "fwd ms"], layer_rows),
        markdown_table(LOOP_HEADER, loop_rows),
        markdown_table(train_header, train_rows),
        "\n".join(f"- {n}" for n in notes)]))


if __name__ == "__main__":
    main()
