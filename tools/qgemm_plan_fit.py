#!/usr/bin/env python3
"""How well the integer GEMM's launch plan picks, against a measured tile sweep; and a refit.

Input: a `prism cuda-quant-check` log (optionally gzipped), whose "v2 tile sweep" block times every
tile × part-group count at a few M per shape, next to the plan's modelled time ("model ms").

For every (format, K, N, M) of the sweep it compares the launch the cost model would pick with the
fastest measured one and prints the average and worst "regret" (how much slower the pick ran). The
current model's regret is read straight off the log's "model ms" column. A grid of alternative
constants (fixed cycles a CTA, extra seconds a split launch) is then evaluated with a Python mirror of
`cuda_plan::model_seconds` — the mirror first checks that it reproduces the log's "model ms" column
with the constants of the binary that wrote it (`--fixed 3000 --launch 3e-6` before any refit) and
stops if it does not, so a drifted mirror cannot mislead.

    python3 tools/qgemm_plan_fit.py LOG[.gz] [--fixed CYCLES --launch SECONDS] [--rate TILE=MACS ...] [--try-rate TILE=MACS ...]

`--rate TILE=MACS` (repeatable) sets a tile's modelled rate to the one of the binary that wrote the log:
a Q8_0 tile by name (`696885d` had T96x128Ws=950; 900 since `9fdbe7a`), a K-quant TMA tile as
`K32/T96x128Tma=690` or `Q6K/T128x128Tma=…` (`520455f` had K32/T96x128Tma=690, Q6K/T96x128Tma=700;
600 both since). `--try-rate TILE=MACS` (same forms) changes a rate for the refit grid only, to try a
new rate against a sweep of a binary that still had the old one. Rows of tiles this mirror does not know (ones
measured and dropped, like T128x128W16) are left out, with a line saying so. Only Hopper-sized limits (132 SMs, 228 KiB an SM) are mirrored. Host-timed single launches vary by
about ±10 % between runs, so regrets below that are noise.

Not mirrored: the tail split (`cuda_plan::model_seconds_tail`, since `960ebb9`). The sweep times tiles
and part groups only, so the picks compared here are the plan's best without a tail; where the real
plan takes a tail (two or more whole waves and a partial one), the log's timing table shows it.
"""
import collections
import gzip
import math
import sys

SMS = 132
SMEM_PER_SM = 228 * 1024
CLOCK_HZ = 1.75e9
DRAM_BYTES_PER_S = 3.0e12

# (bm, CTAs per SM built for, modelled MAC / SM / clock, shared memory bytes) per (format, tile), as in
# cuda_plan::v2_tile_plan. Warp-specialized tiles exist for Q8_0 only; elsewhere they are T128x128.
STAGE = {  # bytes of one stage, per (format, bm)
    ("Q8_0", 64): 64 * 128 + 128 * 128 + 2048,
    ("Q8_0", 96): 96 * 128 + 128 * 128 + 2048,
    ("Q8_0", 128): 128 * 128 + 128 * 128 + 2048,
    ("K32", 64): 64 * 256 + 128 * 256 + 512 + 512 + 1024 + 1024 + 64 * 32,
    ("K32", 128): 128 * 256 + 128 * 256 + 512 + 512 + 1024 + 1024 + 128 * 32,
    ("Q6K", 64): 64 * 256 + 128 * 256 + 512 + 2048,
    ("Q6K", 128): 128 * 256 + 128 * 256 + 512 + 2048,
}


Q8_0_TILES = {
    "T64x128": (64, 2, 700.0, 4, 0),
    "T128x128": (128, 1, 900.0, 4, 0),
    "T128x128Ws": (128, 1, 1000.0, 4, 64),
    "T96x128Ws": (96, 1, 900.0, 4, 64),
    # TMA tiles: the barriers plus 1 KiB to align the stages.
    "T128x128Tma": (128, 1, 1100.0, 4, 64 + 1024),
    "T96x128Tma": (96, 1, 990.0, 4, 64 + 1024),
}
KNOWN_TILES = set(Q8_0_TILES)
K_TMA_RATES = {("K32", 128): 770.0, ("K32", 96): 600.0, ("Q6K", 128): 780.0, ("Q6K", 96): 600.0}


def tile_plan(fmt, tile):
    if fmt == "Q8_0":
        bm, ctas, rate, stages, bars = Q8_0_TILES[tile]
        return bm, ctas, rate, stages * STAGE[("Q8_0", bm)] + bars
    kind = "Q6K" if fmt == "Q6K" else "K32"
    if tile in ("T128x128Tma", "T96x128Tma"):
        # The K-quant TMA tiles: 3 stages rounded up to whole KiB, barriers, 1 KiB of alignment.
        bm = 128 if tile == "T128x128Tma" else 96
        rate = K_TMA_RATES[(kind, bm)]
        stage = bm * 256 + 128 * 256 + (512 + 512 + 1024 + 1024 + bm * 32 if kind == "K32" else 512 + 2048)
        return bm, 1, rate, 3 * ((stage + 1023) // 1024 * 1024) + 48 + 1024
    if tile in ("T128x128Ws", "T96x128Ws"):
        tile = "T128x128"
    bm, ctas = (64, 2) if tile == "T64x128" else (128, 1)
    rate = {("K32", 64): 550.0, ("K32", 128): 700.0, ("Q6K", 64): 500.0, ("Q6K", 128): 650.0}[(kind, bm)]
    raw = 2 * STAGE[(kind, bm)]
    return bm, ctas, rate, (raw + 127) // 128 * 128


def model_seconds(fmt, tile, m, n, k, g, fixed, launch):
    bm, ctas_per_sm, rate, smem = tile_plan(fmt, tile)
    resident = min(ctas_per_sm, SMEM_PER_SM // (smem + 1024))
    ctas = math.ceil(m / bm) * math.ceil(n / 128) * g
    waves = math.ceil(ctas / (SMS * resident))
    t = waves * (bm * 128 * (k / g) * resident / rate + fixed) / CLOCK_HZ
    if g > 1:
        t += (2 * g + 1) * m * n * 4 / DRAM_BYTES_PER_S + launch
    return t


def read_sweep(path):
    opener = gzip.open if path.endswith(".gz") else open
    rows, inside = [], False
    with opener(path, "rt") as f:
        for line in f:
            if line.startswith("v2 tile sweep"):
                inside = True
                continue
            parts = line.split()
            if inside and len(parts) >= 9 and parts[0] in ("Q8_0", "Q4K", "Q5K", "Q6K"):
                fmt, k, n, m, tile, g, ms, _tops, model = parts[:9]
                rows.append((fmt, int(k), int(n), int(m), tile, int(g), float(ms), float(model)))
    if not rows:
        sys.exit(f"{path}: no 'v2 tile sweep' block")
    return rows


def regret(groups, pick):
    losses = []
    for key, runs in groups.items():
        best = min(ms for (_t, _g, ms, _model) in runs)
        t, g, ms = pick(key, runs)
        losses.append((ms / best - 1, key, t, g))
    losses.sort(reverse=True)
    return sum(l for l, *_ in losses) / len(losses), losses


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    path, fixed, launch = args[0], 3000.0, 3e-6
    if "--fixed" in args:
        fixed = float(args[args.index("--fixed") + 1])
    if "--launch" in args:
        launch = float(args[args.index("--launch") + 1])
    def set_rate(spec):
        tile, value = spec.split("=")
        if "/" in tile:  # a K-quant TMA tile: K32/T96x128Tma or Q6K/T128x128Tma
            kind, name = tile.split("/")
            K_TMA_RATES[(kind, 128 if name == "T128x128Tma" else 96)] = float(value)
            return
        bm, ctas, _rate, stages, bars = Q8_0_TILES[tile]
        Q8_0_TILES[tile] = (bm, ctas, float(value), stages, bars)

    for i, a in enumerate(args):
        if a == "--rate":
            set_rate(args[i + 1])
    rows = read_sweep(path)
    unknown = sorted({r[4] for r in rows if r[4] not in KNOWN_TILES})
    if unknown:
        print(f"left out: rows of {', '.join(unknown)} (tiles this mirror does not know)")
        rows = [r for r in rows if r[4] in KNOWN_TILES]
    groups = collections.defaultdict(list)
    for fmt, k, n, m, tile, g, ms, model in rows:
        groups[(fmt, k, n, m)].append((tile, g, ms, model))

    # The mirror must reproduce the binary's own model column.
    worst = max(abs(model_seconds(f, t, m, n, k, g, fixed, launch) * 1e3 - model) / model
                for f, k, n, m, t, g, _ms, model in rows)
    if worst > 0.01:
        sys.exit(f"the Python mirror differs from the log's 'model ms' by up to {100 * worst:.1f} %: "
                 "update tile_plan / model_seconds here to the binary's cuda_plan.rs")

    def logged_pick(_key, runs):
        t, g, ms, _ = min(runs, key=lambda r: r[3])
        return t, g, ms

    avg, losses = regret(groups, logged_pick)
    print(f"{len(groups)} shapes; the binary's plan: average regret {100 * avg:.1f} %")
    for loss, key, t, g in losses[:5]:
        print(f"  {100 * loss:5.1f} %  {key}: picked {t} G={g}")

    # Candidate rates for the grid only (the binary's own are the --rate values above).
    for i, a in enumerate(args):
        if a == "--try-rate":
            set_rate(args[i + 1])
    print("refit grid (fixed cycles a CTA × extra seconds a split launch): average regret")
    for f in (3000.0, 5000.0, 10000.0, 20000.0):
        cells = []
        for l in (3e-6, 10e-6, 20e-6, 50e-6):
            def pick(key, runs, f=f, l=l):
                fmt, k, n, m = key
                t, g, ms, _ = min(runs, key=lambda r: model_seconds(fmt, r[0], m, n, k, r[1], f, l))
                return t, g, ms
            cells.append(f"{100 * regret(groups, pick)[0]:5.1f} %")
        print(f"  {f:7.0f}: " + "  ".join(f"{l * 1e6:.0f} µs {c}" for l, c in zip((3e-6, 10e-6, 20e-6, 50e-6), cells)))


if __name__ == "__main__":
    main()
