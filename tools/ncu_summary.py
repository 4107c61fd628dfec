#!/usr/bin/env python3
"""Summarize an `ncu --csv --metrics gpu__time_duration.sum` log of `prism bench --profiler-range`.

The bench opens one profiler range per scenario (short, shared, long), each around one warm pass.
A pass starts with the embedding lookup (`is_u32_*` kernels); the read-out adds a few small kernels
after it. Usage: ncu_summary.py LOG.csv[.gz] [N_TOP]
"""
import collections
import csv
import gzip
import sys

UNIT = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0}


def kernels(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = [l for l in f if not l.startswith("==")]
    rows = list(csv.reader(lines))
    hdr, rows = rows[0], rows[1:]
    k, v, u, g, b = (hdr.index(x) for x in ("Kernel Name", "Metric Value", "Metric Unit", "Grid Size", "Block Size"))
    return [(r[k], float(r[v].replace(",", "")) * UNIT[r[u]], r[g], r[b]) for r in rows]


def passes(ks):
    """Index ranges of the passes: a pass starts at an embedding lookup that follows a GEMM-heavy run."""
    starts = [0]
    for i, (name, *_ ) in enumerate(ks):
        # The pass's embedding lookup comes right after the previous pass's read-out GEMMs: a start
        # is an `is_u32` kernel with at least 100 kernels since the last start.
        if name.startswith("is_u32") and i - starts[-1] > 100:
            starts.append(i)
    ranges = list(zip(starts, starts[1:] + [len(ks)]))
    # A tail of a few kernels after the last start is the last pass's read-out: merge it back.
    while len(ranges) > 1 and ranges[-1][1] - ranges[-1][0] < 100:
        (a, _), (_, b) = ranges[-2], ranges[-1]
        ranges[-2:] = [(a, b)]
    return ranges


def family(name, grid, block):
    if name.startswith("qgemm"):  # the integer GEMMs (kernels/quant_gemm.cu): keep their tile names
        return f"{name} grid {grid}"
    if any(s in name for s in ("nvjet", "gemm", "cublas", "cutlass", "xmma")):
        return f"GEMM (cuBLAS) grid {grid}"
    return f"{name[:40]} grid {grid} block {block}"


def category(name):
    """The coarse split of a pass: GEMMs, the delta rule, attention, the rest."""
    if name.startswith(("qgemm", "qgemv")) or any(s in name for s in ("nvjet", "gemm", "cublas", "cutlass", "xmma")):
        return "GEMMs"
    if "delta_rule" in name:
        return "delta rule"
    if "flash" in name or "kv_append" in name or "attention" in name:
        return "attention"
    return "the rest"


def main():
    ks = kernels(sys.argv[1])
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    names = ["short", "shared", "long"]
    for p, (a, b) in enumerate(passes(ks)):
        seg = ks[a:b]
        total = sum(t for _, t, _, _ in seg)
        label = names[p] if p < len(names) else str(p)
        print(f"\npass {p} ({label}): {len(seg)} kernels, {total:.2f} ms of kernel time")
        cats = collections.Counter()
        for name, t, _, _ in seg:
            cats[category(name)] += t
        print("  " + ", ".join(f"{c} {t:.2f} ms" for c, t in cats.most_common()))
        agg = collections.defaultdict(lambda: [0, 0.0])
        for name, t, g, bl in seg:
            f = agg[family(name, g, bl)]
            f[0] += 1
            f[1] += t
        print(f"{'ms':>9} {'calls':>6} {'us each':>9}  kernel")
        for key, (c, t) in sorted(agg.items(), key=lambda x: -x[1][1])[:top]:
            print(f"{t:9.2f} {c:6d} {1000 * t / c:9.1f}  {key}")


if __name__ == "__main__":
    main()
