"""Summarise an ncu SASS export (``ncu -i R --page source --csv --print-source sass``): stall
samples by reason over the whole kernel, and the instructions with the most samples.

    python benchmarks/ncu_stalls.py ncu_fwd_bf16_selective_scan_fwd.sass.csv [--top 30]
"""
import argparse
import collections
import csv


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    with open(args.csv, newline="") as f:
        lines = list(csv.reader(f))
    header_at = next(i for i, r in enumerate(lines) if r and r[0] == "Address")
    header = lines[header_at]
    rows = [dict(zip(header, r)) for r in lines[header_at + 1:] if len(r) == len(header)]
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]

    def num(x):
        try:
            return float(x)
        except ValueError:
            return 0.0

    total = sum(num(r["Warp Stall Sampling (All Samples)"]) for r in rows)
    by_reason = collections.Counter()
    by_opcode = collections.Counter()
    for r in rows:
        for k in reasons:
            by_reason[k] += num(r[k])
        op = r["Source"].split()[0] if r["Source"].split() else "?"
        if op.startswith("@"):
            op = r["Source"].split()[1]
        by_opcode[op.split(".")[0]] += num(r["Warp Stall Sampling (All Samples)"])
    print(f"{len(rows)} instructions, {total:.0f} samples")
    print("by reason: " + ", ".join(f"{k[6:]} {v / total:.1%}" for k, v in by_reason.most_common(10)))
    print("by opcode: " + ", ".join(f"{k} {v / total:.1%}" for k, v in by_opcode.most_common(12)))
    execd = collections.Counter()
    for r in rows:
        op = r["Source"].split()
        op = (op[1] if op and op[0].startswith("@") and len(op) > 1 else op[0] if op else "?").split(".")[0]
        execd[op] += num(r["Instructions Executed"])
    tot_exec = sum(execd.values())
    print("executed mix: " + ", ".join(f"{k} {v / tot_exec:.1%}" for k, v in execd.most_common(14)))
    top = sorted(rows, key=lambda r: -num(r["Warp Stall Sampling (All Samples)"]))[: args.top]
    for r in top:
        main_reasons = sorted(((num(r[k]), k[6:]) for k in reasons), reverse=True)[:2]
        print(f"{num(r['Warp Stall Sampling (All Samples)']) / total:6.2%}  {r['Address'][-5:]}  "
              f"{r['Source'].strip()[:60]:60s}  " + ", ".join(f"{n} {v:.0f}" for v, n in main_reasons if v))


if __name__ == "__main__":
    main()
