#!/usr/bin/env python3
"""Summarize an Nsight Compute source page (per-SASS-instruction counters) of one kernel launch.

Input: the CSV of `ncu -i REPORT.ncu-rep --page source --print-source sass --csv` (optionally gzipped),
as recorded in docs/device-runs/. Prints the warp-stall samples and executed instructions by opcode,
the samples by stall reason, and the instructions with the most samples (with their two main stall
reasons). Used for the integer GEMM analysis in docs/optimization-log.md.

    python3 tools/ncu_source_summary.py FILE.csv[.gz] [TOP] [--roles]

`--roles` (warp-specialized kernels): the same summary twice, for the instructions before the
producers' `USETMAXREG.DEALLOC` (the shared prologue and the compute warps) and from it on (the
producer warpgroup, laid out after the compute warps' code by ptxas in our kernels). The producers
spend most of their time waiting on the `empty` barriers, which otherwise dominates the stall samples
of the whole kernel.
"""
import collections
import csv
import gzip
import sys


def number(text):
    try:
        return float(text)
    except ValueError:
        return 0.0


def summarize(label, header, data, top):
    col = {name: i for i, name in enumerate(header)}
    samples_col = col["Warp Stall Sampling (All Samples)"]
    executed_col = col["Instructions Executed"]
    source_col = col["Source"]
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(number(r[samples_col]) for _, r in data) or 1.0
    executed = sum(number(r[executed_col]) for _, r in data) or 1.0
    print(f"{label}: {total:.0f} samples, {executed:.3g} warp instructions")

    by_op, exec_op, by_stall = collections.Counter(), collections.Counter(), collections.Counter()
    for _, r in data:
        words = [w for w in r[source_col].split() if not w.startswith("@")]
        op = words[0].split(".")[0] if words else "?"
        by_op[op] += number(r[samples_col])
        exec_op[op] += number(r[executed_col])
        for c in stall_cols:
            by_stall[c] += number(r[col[c]])
    print("samples by opcode (share of samples, share of executed instructions):")
    for op, v in by_op.most_common(18):
        print(f"  {op:10s} {100 * v / total:5.1f}%  {100 * exec_op[op] / executed:5.1f}%")
    print("samples by stall reason:")
    for c, v in by_stall.most_common(10):
        print(f"  {c:24s} {100 * v / total:5.1f}%")
    print(f"top {top} instructions (index, share of samples, executions, SASS, main stalls):")
    order = sorted(data, key=lambda ir: -number(ir[1][samples_col]))[:top]
    for i, r in order:
        stalls = sorted(((number(r[col[c]]), c) for c in stall_cols), reverse=True)[:2]
        stalls = ", ".join(f"{c[6:]} {100 * v / total:.1f}%" for v, c in stalls if v > 0)
        print(f"  {i:5d} {100 * number(r[samples_col]) / total:5.2f}% {number(r[executed_col]):9.0f}"
              f"  {r[source_col].strip()[:60]:60s} {stalls}")


def main():
    args = [a for a in sys.argv[1:] if a != "--roles"]
    roles = "--roles" in sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    path = args[0]
    top = int(args[1]) if len(args) > 1 else 25
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    # Row 0 names the kernel, row 1 is the header.
    header, data = rows[1], list(enumerate(rows[2:]))
    kernel = rows[0][1] if len(rows[0]) > 1 else ""
    if not roles:
        summarize(kernel, header, data, top)
        return
    source_col = header.index("Source")
    split = next((i for i, r in data if "USETMAXREG.DEALLOC" in r[source_col]), None)
    if split is None:
        sys.exit(f"{path}: no USETMAXREG.DEALLOC: not a warp-specialized kernel with register hand-off")
    summarize(f"{kernel} compute warps (and prologue)", header, data[:split], top)
    print()
    summarize(f"{kernel} producer warpgroup", header, data[split:], top)


if __name__ == "__main__":
    main()
