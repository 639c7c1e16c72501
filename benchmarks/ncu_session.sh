#!/usr/bin/env bash
# Nsight Compute profiles of the scan kernels (called by gpu_session.sh's `ncu` step).
# For each direction:dtype:kernel-regex: the full section set of one launch, exported as the
# details page and as SASS with per-instruction stall samples (summarised by ncu_stalls.py),
# all packed into $OUT/ncu.tgz (the device call returns at most 8 files). The .ncu-rep files
# are left out (too large). NCU_KERNELS overrides the list.
set -uo pipefail
OUT=${OUT:-/tmp/out}
DIR=$(mktemp -d)
KERNELS=${NCU_KERNELS:-"fwd:bf16:_selective_scan_fwd fwd:fp32:_selective_scan_fwd bwd:fp32:_chunk_bwd bwd:fp32:_chunk_state"}
ncu --version | tail -1
for spec in $KERNELS; do
    IFS=: read -r which dtype regex <<<"$spec"
    name="ncu_${which}_${dtype}${regex}"
    echo "== $name"
    ncu --clock-control none --set full --import-source no -k "regex:$regex" --launch-skip 2 --launch-count 1 \
        -f -o "$DIR/$name" python3 benchmarks/ncu_kernels.py --which "$which" --dtype "$dtype" \
        >"$DIR/$name.run.log" 2>&1 || { echo "ncu failed"; tail -n 15 "$DIR/$name.run.log"; continue; }
    ncu -i "$DIR/$name.ncu-rep" --page details >"$DIR/$name.details.txt" 2>&1
    ncu -i "$DIR/$name.ncu-rep" --page source --csv --print-source sass >"$DIR/$name.sass.csv" 2>&1 \
        || echo "source page export failed: $(tail -n 2 "$DIR/$name.sass.csv")"
    rm -f "$DIR/$name.ncu-rep"
    grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Memory Throughput|DRAM Throughput|L1/TEX Cache Throughput" \
        "$DIR/$name.details.txt" | head -12
    python3 benchmarks/ncu_stalls.py "$DIR/$name.sass.csv" --top 12 2>&1 | tee "$DIR/$name.stalls.txt"
done
tar czf "$OUT/ncu.tgz" -C "$DIR" .
