"""Time the post-rewrite stages (cast fold, layout check) against the whole pass manager and
the compile, on a 24-layer HF Mamba (CPU; the stages' cost depends on the node count, not on
tensor sizes).

    python benchmarks/pass_stage_time.py
"""
import time

import torch
from transformers import MambaConfig, MambaForCausalLM

import ssm_compile  # noqa: F401  (registers backend="ssm")
import ssm_compile.passes.manager as manager


def main() -> None:
    spent = {"layout check": 0.0, "cast fold": 0.0, "all passes": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    manager.settle_layouts = timed("layout check", manager.settle_layouts)
    manager.fold_round_trip_casts = timed("cast fold", manager.fold_round_trip_casts)
    manager.PassManager.__call__ = timed("all passes", manager.PassManager.__call__)
    cfg = MambaConfig(vocab_size=100, hidden_size=64, state_size=16, num_hidden_layers=24, expand=2,
                      conv_kernel=4, use_associative_scan=True)
    model = MambaForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (2, 64))
    t0 = time.perf_counter()
    with torch.no_grad():
        torch.compile(model, backend="ssm")(ids)
    total = time.perf_counter() - t0
    print(", ".join(f"{k} {v:.3f} s" for k, v in spent.items()) + f"; compile {total:.1f} s")


if __name__ == "__main__":
    main()
