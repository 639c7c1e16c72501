"""The scan backward's chunk-state kernel and state pass on the H200, over tiles, and the whole
backward.

    python benchmarks/bench_chunk_state.py

GPU time from CUDA-graph replay (``common.graph_ms``), batch 8 and 1, L=2048, dim 1536, N 16, on
the L-major copies the "nblock" backward hands the kernel and on channel-innermost activations
(what "serial" hands it). Every tile's outputs are checked against the default tile's. The state
pass is timed over ``ROWS`` (chunks whose loads it issues at once; 1 is a walk of one chunk per
step, as before run 21). Writes
``$OUT/bench_chunk_state.md`` when OUT is set. Run 21 compared the closed-form kernel this one
replaced (RESULTS.md, run 21).
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from bench_scan_bwd import DIM, N, make_inputs  # noqa: E402
from common import graph_ms, markdown_table, write_out  # noqa: E402

from ssm_compile.kernels.selective_scan import triton_bwd as tb  # noqa: E402
from ssm_compile.kernels.triton_common import LAUNCH_OPTIONS  # noqa: E402

# (block_d, chunk_t, lanes_n, warps, maxnreg); None: the launcher's choice (_state_tiles).
TILES = [None, (32, 16, 4, 4, 168), (32, 16, 4, 4, None), (32, 8, 4, 4, None), (32, 4, 4, 4, 168),
         (16, 8, 4, 2, 168), (64, 8, 4, 8, 168)]


def launch_state(tile, u, delta, dy, z, A, B, C, bias, chunk):
    batch, dim, L = u.shape
    n_chunks = triton.cdiv(L, chunk)
    f32 = dict(device=u.device, dtype=torch.float32)
    hs, rs = torch.empty(batch, n_chunks, dim, N, **f32), torch.empty(batch, n_chunks, dim, N, **f32)
    total = torch.empty(batch, n_chunks, dim, **f32)
    if tile is None:
        st = tb._state_tiles(batch * n_chunks, dim, chunk, N, dim, torch.cuda.get_device_properties(0).multi_processor_count)
        tile = (st.block_d, st.chunk_t, st.lanes_n, st.num_warps, st.max_registers)
    block_d, chunk_t, lanes_n, warps, cap = tile

    def run():
        tb._chunk_state_kernel[(triton.cdiv(dim, block_d), batch, n_chunks)](
            u, delta, dy, z, A, B, C, bias, hs, rs, total, dim, L, N, n_chunks, dim,
            *u.stride(), *delta.stride(), *dy.stride(), *z.stride(), *A.stride(), *B.stride(), *C.stride(),
            DELTA_SOFTPLUS=True, HAS_Z=True, HAS_DELTA_BIAS=True, BLOCK_D=block_d, CHUNK_T=chunk_t,
            N_PER_THREAD=N // lanes_n, LANES_N=lanes_n, CHUNK=chunk, num_warps=warps, maxnreg=cap,
            **LAUNCH_OPTIONS)
    return run, (hs, rs, total), tile


def main():
    rows, notes = [], []
    for dname, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for batch in (8, 1):
            x, dy = make_inputs(batch, 2048, dtype)
            B4, C4 = x["B"].unsqueeze(1), x["C"].unsqueeze(1)
            chunk = tb.choose_tiles(batch, DIM, 2048, N, 1, dy.device).chunk
            for layout in ("L-major", "channel-innermost"):
                def lay(t):
                    return t if layout == "L-major" else t.transpose(1, 2).contiguous().transpose(1, 2)
                args = tuple(lay(t) for t in (x["u"], x["delta"], dy, x["z"])) + (
                    x["A"], B4, C4, x["delta_bias"], chunk)
                ref_out = None
                for tile in TILES:
                    try:
                        run, out, used = launch_state(tile, *args)
                        run()
                        if ref_out is None:
                            ref_out, err = out, 0.0
                        else:
                            err = max(((o - r).norm() / r.norm()).item() for o, r in zip(out, ref_out))
                        ms = graph_ms(run)
                        rows.append([dname, batch, layout, "default" if tile is None else "", used, f"{ms:.4f}",
                                     f"{err:.1e}"])
                    except Exception as e:  # noqa: BLE001 - one tile failing is a row, not a crash
                        rows.append([dname, batch, layout, "", tile, "-", f"{type(e).__name__}: {e}"[:80]])
            ms = graph_ms(lambda: tb.selective_scan_bwd(dy, None, x["u"], x["delta"], x["A"], B4, C4, x["D"],
                                                        x["z"], x["delta_bias"], True, None))
            notes.append(f"{dname} batch {batch}: the whole backward (L-major inputs) {ms:.4f} ms")
    pass_rows = []
    default_rows = tb._PASS_ROWS
    for batch in (8, 1):
        n_chunks = triton.cdiv(2048, tb.choose_tiles(batch, DIM, 2048, N, 1, torch.device("cuda")).chunk)
        g = torch.Generator(device="cuda").manual_seed(1)
        A = -torch.rand(DIM, N, device="cuda", generator=g) - 0.1
        total = torch.rand(batch, n_chunks, DIM, device="cuda", generator=g)
        state = torch.randn(batch, DIM, N, device="cuda", generator=g)
        ws = [torch.randn(batch, n_chunks, DIM, N, device="cuda", generator=g) for _ in range(2)]
        outs = {}
        for rows_ in (1, 4, 8, 16):
            hs, rs, dinit = ws[0].clone(), ws[1].clone(), torch.empty_like(state)

            def run(hs=hs, rs=rs, dinit=dinit, rows_=rows_):
                tb._PASS_ROWS = rows_
                tb._state_pass(A, total, state, state, hs, rs, dinit)
            run()
            outs[rows_] = (hs.clone(), rs.clone(), dinit.clone())
            ms = graph_ms(run)  # in place: replays chain already-chained workspaces, same work
            err = max(((o - r).norm() / r.norm()).item() for o, r in zip(outs[rows_], outs[1]))
            gbs = 4 * ws[0].numel() * 4 / (ms * 1e-3) / 1e9
            pass_rows.append([batch, n_chunks, rows_, f"{ms:.4f}", f"{gbs:.0f}", f"{err:.1e}"])
    tb._PASS_ROWS = default_rows
    text = markdown_table(["dtype", "batch", "layout", "", "tile (block_d, chunk_t, lanes_n, warps, cap)", "ms",
                           "max rel diff vs default"], rows)
    text += "\n\nState pass (hs, rs fp32 read and written in place; GB/s on those bytes):\n\n" + markdown_table(
        ["batch", "chunks", "ROWS", "ms", "GB/s", "max rel diff vs ROWS=1"], pass_rows)
    text += "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    print(text)
    write_out("bench_chunk_state.md", text)


if __name__ == "__main__":
    main()
