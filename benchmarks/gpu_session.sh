#!/usr/bin/env bash
# One device-machine call: install the package, then run the named steps, logging under $OUT.
#   bash benchmarks/gpu_session.sh env tests check scan bwd conv e2e generate
# Each step's full log goes to $OUT/<step>.log; a failing step does not stop the others.
# The device machine has no package index: test-only wheels it lacks (expecttest) travel in
# .whl/ (ignored by git; pass it in the device call's `carry`), fetched here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl expecttest pytest-xdist execnet einops
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { echo "install failed"; tail -n 20 "$OUT/install.log"; }

step() {
    local name=$1; shift
    local t0=$SECONDS
    # A per-step limit: a step that hangs (a compile that never ends) must not take the
    # results of the steps after it down with the whole device call.
    timeout "${STEP_TIMEOUT:-300}" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc $((SECONDS - t0))s"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}

for s in "$@"; do
    case $s in
        env) step env bash -c 'nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"' ;;
        # The tests take ~5 min on the H200 (run 10: 240 of 248 in 285 s).
        tests) STEP_TIMEOUT=${TESTS_TIMEOUT:-420} step tests python3 -m pytest -q -p no:cacheprovider tests/test_selective_scan_triton_fwd.py \
                   tests/test_selective_scan_triton_bwd.py tests/test_fused.py tests/test_causal_conv1d.py \
                   tests/test_decode_ops.py tests/test_selective_scan_op.py tests/test_parity_devices.py \
                   tests/test_generate_example.py tests/test_pass_logits.py tests/test_x_dt_proj.py -k "cuda or triton or Triton or gpu or fused" ;;
        # The whole suite (CPU pass tests, interpreter kernels and CUDA kernels) under the device's
        # torch/triton/transformers, spread over its cores; needs pytest-xdist and execnet in .whl/.
        fullsuite) STEP_TIMEOUT=${FULL_TIMEOUT:-540} step fullsuite python3 -m pytest -q -p no:cacheprovider \
                       -n ${WORKERS:-14} --dist worksteal -rfEs tests ;;
        # The 130m forward (and with SPEED_ARGS=--train a training step) against the last recorded
        # figure for the card: run it after fullsuite, which checks values but not speed.
        speed) step speed python3 benchmarks/speed_check.py ${SPEED_ARGS:-} ;;
        # Named test files only (FILES="tests/a.py tests/b.py"), spread over the cores: for a call
        # with too little device time left for the whole suite.
        files) STEP_TIMEOUT=${FULL_TIMEOUT:-540} step files python3 -m pytest -q -p no:cacheprovider \
                   -n ${WORKERS:-14} --dist worksteal -rfEs ${FILES} ;;
        # Host time per op call with real launches, and cProfile's split of it by function.
        host) step host bash -c 'python3 benchmarks/host_overhead_ops.py --cuda --profile && python3 benchmarks/host_overhead_scan.py --cuda' ;;
        # Nsight Compute on the scan kernels at the headline shape: per kernel the details page
        # (stall reasons, occupancy, pipes) and the SASS with per-instruction stall samples.
        ncu) step ncu bash benchmarks/ncu_session.sh ;;
        # The whole model on HF's loop path, every backend compiling the block once (regional).
        loopmodel) STEP_TIMEOUT=${LOOP_TIMEOUT:-540} step loopmodel python3 benchmarks/bench_e2e.py --parts loopmodel \
                       --loop-model-len ${LOOP_MODEL_LEN:-512} --time-budget 500 ;;
        probe) step probe python3 benchmarks/probe_scan_path.py ;;
        check) step check python3 benchmarks/check_scan_gpu.py ;;
        # cuBLAS's memsets per matmul of the 130m forward, per BLAS library.
        gemms) step gemms python3 benchmarks/probe_gemm_memsets.py ;;
        scan) step scan python3 benchmarks/bench_scan.py ;;
        sweep) step sweep python3 benchmarks/bench_scan.py --sweep-named ;;
        bwd) step bwd python3 benchmarks/bench_scan_bwd.py ;;
        bwdsweep) step bwdsweep python3 benchmarks/bench_scan_bwd.py --sweep --baselines ;;
        # Op-level fwd+bwd baselines only (no tile sweep): eager, inductor loop, inductor assoc.
        bwdbase) step bwdbase python3 benchmarks/bench_scan_bwd.py --baselines ;;
        gentest) step gentest python3 -m pytest -q -p no:cacheprovider tests/test_generate_example.py -k cuda ;;
        bwdmatch) step bwdmatch python3 benchmarks/bench_scan_bwd.py --sweep --sweep-match "${SWEEP_MATCH:-prefetch}" ;;
        bwdnblock) step bwdnblock python3 benchmarks/bench_scan_bwd.py --sweep --sweep-match nblock ;;
        bwdlayouts) step bwdlayouts python3 benchmarks/bench_scan_bwd.py --layouts ;;
        bwdserial) step bwdserial python3 benchmarks/bench_scan_bwd.py --sweep --sweep-match serial ;;
        # The chunk-state kernel: closed-form sums against the forward-tiled scan, over tiles.
        chunkstate) step chunkstate python3 benchmarks/bench_chunk_state.py ;;
        bwdtests) step bwdtests python3 -m pytest -q -p no:cacheprovider tests/test_selective_scan_triton_bwd.py ;;
        conv) step conv python3 benchmarks/bench_conv1d.py ;;
        convtests) step convtests python3 -m pytest -q -p no:cacheprovider tests/test_causal_conv1d.py -k "cuda or triton or Triton or rows" ;;
        # Inductor's wrapper and kernels for the whole 130m forward under backend="ssm".
        dumpcode) step dumpcode python3 benchmarks/dump_e2e_code.py --layers ${DUMP_LAYERS:-24} --out "$OUT/e2e_code.py" ;;
        # The conv's row-streaming forward: tile sweep on HF's in_proj view, bf16 then fp32.
        convrows) step convrows bash -c 'python3 benchmarks/sweep_conv_rows.py && python3 benchmarks/sweep_conv_rows.py --dtype fp32' ;;
        convrowsbwd) step convrowsbwd bash -c 'python3 benchmarks/sweep_conv_rows.py --bwd && python3 benchmarks/sweep_conv_rows.py --bwd --dtype fp32' ;;
        # The LM head: bf16 matmul + .float() against one fp32-output matmul (passes/logits.py).
        logits) step logits python3 benchmarks/probe_logits.py ;;
        # The forward scan's tiles on HF's channel-innermost activations.
        scanhf) step scanhf python3 benchmarks/bench_scan.py --sweep-named --layout hf ;;
        e2e) step e2e python3 benchmarks/bench_e2e.py --time-budget ${E2E_BUDGET:-150} --parts ${E2E_PARTS:-forward,layer,train} --profile ${E2E_ARGS:-} ;;
        # Chosen configurations of the fusion sweep: FUSION_ONLY="bf16,8,1536,2048,16;...".
        fusiononly) step fusiononly python3 benchmarks/bench_fusion.py --only "${FUSION_ONLY}" ;;
        profiletrain) step profiletrain python3 benchmarks/profile_train.py --len ${TRAIN_PROFILE_LEN:-128} ;;
        fusion) step fusion python3 benchmarks/bench_fusion.py --quick ;;
        # FUSION_START continues the fixed shuffled grid where an earlier run stopped (run 10: 28).
        fusionsweep) step fusionsweep python3 benchmarks/bench_fusion.py --time-budget ${FUSION_BUDGET:-300} \
                         --start-at ${FUSION_START:-0} ;;
        generate) step generate python3 benchmarks/bench_generate.py --time-budget ${GEN_BUDGET:-330} \
                      --profile ${GEN_PROFILE:-ssm} ;;
        # ssm.x_dt_proj's kernel against the two cuBLAS products, with a tile sweep at the 130m shape.
        xdt) step xdt python3 benchmarks/bench_x_dt_proj.py ${XDT_ARGS:---sweep} ;;
        xdttests) step xdttests python3 -m pytest -q -p no:cacheprovider tests/test_x_dt_proj.py ;;
        # The end-to-end forward per backend option set, interleaved (PROBE_VARIANTS: names in the script).
        e2eopts) step e2eopts python3 benchmarks/probe_e2e_options.py --len ${PROBE_LEN:-2048} --repeats ${PROBE_REPEATS:-3} \
                      --variants ${PROBE_VARIANTS:-default} ;;
        # The training step per scan-backward tile choice, interleaved (BWD_VARIANTS in the script).
        trainopts) step trainopts python3 benchmarks/probe_e2e_options.py --train --len ${PROBE_LEN:-2048} \
                       --repeats ${PROBE_REPEATS:-3} --variants ${TRAIN_VARIANTS:-default bwd_nblock bwd_serial_unstaged} ;;
        *) echo "unknown step $s" ;;
    esac
done
