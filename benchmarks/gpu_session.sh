#!/usr/bin/env bash
# One device-machine call: install the package, then run the named steps, logging under $OUT.
#   bash benchmarks/gpu_session.sh env tests check scan bwd conv e2e generate
# Each step's full log goes to $OUT/<step>.log; a failing step does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { echo "install failed"; tail -n 20 "$OUT/install.log"; }

step() {
    local name=$1; shift
    local t0=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc $((SECONDS - t0))s"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}

for s in "$@"; do
    case $s in
        env) step env bash -c 'nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"' ;;
        tests) step tests python3 -m pytest -q -x --timeout=600 tests -p no:cacheprovider ;;
        check) step check python3 benchmarks/check_scan_gpu.py ;;
        scan) step scan python3 benchmarks/bench_scan.py ;;
        bwd) step bwd python3 benchmarks/bench_scan_bwd.py ;;
        conv) step conv python3 benchmarks/bench_conv1d.py ;;
        e2e) step e2e python3 benchmarks/bench_e2e.py ;;
        generate) step generate python3 benchmarks/bench_generate.py ;;
        *) echo "unknown step $s" ;;
    esac
done
