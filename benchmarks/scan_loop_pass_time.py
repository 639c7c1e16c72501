"""How much the scan_loop pass adds to dynamo's trace time for a long unrolled loop (CPU).

Budget: the passes may add at most 10% to dynamo's trace time for an unrolled L=1024 loop.
Usage: python benchmarks/scan_loop_pass_time.py [--length 1024] [--inplace]

``--inplace`` writes the loop's state update in place (``h = h * dA; h += dBu``), a chain of
writes per step that passes/inplace.py rewrites out of place before the matchers run.
"""
import argparse
import time

import torch

from ssm_compile.compiler import _run_passes, _Undo
from ssm_compile.passes import scan_loop
from ssm_compile.passes.manager import PassManager


INPLACE = False


def hf_loop(u, dt, A, B, C):
    """transformers' mamba_selective_scan loop branch."""
    input_dtype = u.dtype
    B = B.transpose(1, 2)
    C = C.transpose(1, 2)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    deltaB_u = dt[:, :, :, None] * B[:, None, :, :].float() * u[:, :, :, None].float()
    ssm_state = torch.zeros(u.shape[0], u.shape[1], A.shape[-1], dtype=input_dtype, device=u.device)
    scan_outputs = []
    for index in range(u.shape[2]):
        if INPLACE:
            ssm_state = ssm_state * discrete_A[:, :, index]
            ssm_state += deltaB_u[:, :, index]
        else:
            ssm_state = discrete_A[:, :, index] * ssm_state + deltaB_u[:, :, index]
        scan_output = torch.matmul(ssm_state.to(input_dtype), C[:, index, :].unsqueeze(-1))
        scan_outputs.append(scan_output[:, :, 0])
    return torch.stack(scan_outputs, dim=-1), ssm_state


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--inplace", action="store_true")
    args = p.parse_args()
    global INPLACE
    INPLACE = args.inplace
    from ssm_compile.kernels.selective_scan import op

    op.register()
    L = args.length
    inputs = (torch.randn(2, 16, L), torch.rand(2, 16, L) * 0.1, -torch.rand(16, 8), torch.randn(2, 8, L),
              torch.randn(2, 8, L))
    pass_time = {}

    def backend(gm, example_inputs):
        pm = PassManager()
        scan_loop.register(pm)
        # What the backend runs: the passes, behind the copy that lets a failing pass be undone.
        t0 = time.perf_counter()
        ctx = _run_passes(pm, gm, _Undo(gm))
        pass_time["s"] = time.perf_counter() - t0
        pass_time["rewrites"] = [r.family for r in ctx.rewrites]
        return gm.forward

    def plain(gm, example_inputs):
        return gm.forward

    torch._dynamo.reset()
    t0 = time.perf_counter()
    torch.compile(hf_loop, backend=plain, fullgraph=True)(*inputs)
    trace = time.perf_counter() - t0
    torch._dynamo.reset()
    torch.compile(hf_loop, backend=backend, fullgraph=True)(*inputs)
    print(f"L={L}{' (in place)' if INPLACE else ''}: dynamo trace {trace:.2f} s, scan_loop pass {pass_time['s']:.3f} s "
          f"({100 * pass_time['s'] / trace:.1f}% of trace, incl. the graph copy for the fallback), "
          f"rewrites {pass_time['rewrites']}")


if __name__ == "__main__":
    main()
