#!/bin/bash
# The device runs of docs/benchmarks.md and docs/correctness.md, as one script to carry to the GPU
# machine with the binary (see "How to reproduce" in docs/benchmarks.md). Run from the repository root:
#
#   bash tools/device/run.sh STEP...     (outputs under $OUT, default /tmp/out)
#
# Steps (in the order given):
#   checks      prism cuda-check and prism cuda-quant-check (exit status kept in the logs)
#   synth27     a synthetic 27B Q8_0 model directory in /tmp/s27 (about 30 GB of disk)
#   synth27q4   a synthetic 27B Q4_K_M model directory in /tmp/s27q4 (about 17 GB; llama-quantize's
#               Q4_K / Q6_K mix, quantized by prism-gguf: about 2 minutes on 16 cores)
#   synth9 / synth4   synthetic 9B / 4B BF16 model directories in /tmp/s9, /tmp/s4
#   bench27     27B bf16 bench (5 runs after 1 warm-up)
#   bench27-int8  27B int8 bench (calibrates once into /tmp/pc: about 100 s; a calibration file carried
#               in .device-carry/ for the same synthetic file is used instead)
#   bench27-w4a8  27B w4a8 bench on /tmp/s27q4 (calibrates once into /tmp/pc, or uses a carried file; 3 runs
#               after 1 warm-up), then the same model at bf16 for comparison (5 runs after 1 warm-up)
#   bench9 / bench4   9B / 4B bf16 benches (10 runs after 2 warm-ups)
#   loads9      9B bf16 loads from 1, 4, 8 and 16 loader threads (PRISM_LOAD_THREADS), one bench run each
#               after no warm-up (answer digests comparable across them); each killed after 120 s
#   calib27     27B int8 bench that calibrates (no calibration file carried) with PRISM_LOAD_THREADS=8:
#               a calibration run (bf16 projections wrapped in range recorders) loaded from 8 threads on
#               the GPU; killed after 400 s
#   ncu27       ncu kernel times of one warm pass per scenario of the 27B bf16 bench
#   gemm        prism cuda-quant-check --gemm timings of the integer GEMM tiles at 27B shapes (M = 275,
#               2,048, 16,384 and a one-wave steady state; docs/benchmarks.md, third session)
#   gemm-kq     the K-quant tiles (mma.sync TMA, 96-row TMA, the wgmma weight-plane tile) at the fifth
#               session's shapes (docs/benchmarks.md, "K-quant tiles on warpgroup MMA")
#   gemm-q8c    the Q8_0 TMA tiles next to the chained wgmma tile (T128x128Wgc, the chained reduction of
#               prism_quant::chain) at 27B shapes (docs/benchmarks.md, sixth session)
#   quant       prism cuda-quant-check alone (the integer GEMM checks, the chained tile's among them)
#   imma        kernels/bench/imma_rate.cu's loops, from .device-carry/imma_rate (built here: nvcc -O3
#               -gencode=arch=compute_90a,code=sm_90a -o .device-carry/imma_rate kernels/bench/imma_rate.cu)
#   quant-var   prism cuda-quant-check of a second binary, .device-carry/prism-var.xz (a kernel variant
#               must pass it before its timings mean anything)
#   gemm-ab     A/B of the binary against .device-carry/prism-var.xz: every spec of $AB_SPECS (spaces
#               between `FORMAT,K,N,M,TILE,G` specs; default: the decision shape and the large-M Q8_0
#               shapes), run 5 of `--gemm SPEC --runs 6` with each binary in turn, twice (gemm-ab.txt)
#   serve27-int8 / serve27-bf16   prism serve on /tmp/s27 (int8 / bf16) and prism loadgen against it:
#               20 variants of one short question (tools/device/short.jsonl; each sent alone first: cold,
#               distinct evidence) and of the three-question request (shared.jsonl), then 5 s of each
#               from 1 client (repeats: prefix-cache hits); follow-ups (followup.jsonl: 10 pairs, the
#               second asking another question about the first one's ~1,000-token evidence, so each
#               second request alone is a cache hit); then the built-in
#               mix from 64 clients for $LOAD_S seconds (default 60; int8 with --expect-identical);
#               /stats and /metrics after each; outputs serve-*.log, loadgen-*.json, stats-*.json
# Any step: PRISM_STACKS_ON_SIGQUIT=1 in the environment and `kill -QUIT PID` on a hung prism write
# every thread's stack to its stderr (crates/prism-cli/src/stack_dump.rs; carry an unstripped build).
# The binary is taken from .device-carry/prism.xz (xz of a stripped `--features cuda` build; unpacked
# by xz or Python's lzma) or .device-carry/prism.gz, unless /tmp/prism exists.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -x /tmp/prism ]; then
    if [ -f .device-carry/prism.xz ]; then
        if command -v xz > /dev/null; then
            xz -dc .device-carry/prism.xz > /tmp/prism
        else
            python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
                .device-carry/prism.xz > /tmp/prism
        fi
    else
        gzip -dc .device-carry/prism.gz > /tmp/prism
    fi && chmod +x /tmp/prism || exit 1
fi
F=tests/fixtures
R="--ranks $F/qwen35-vocab/qwen3_6.tiktoken --chat-template $F/qwen35-tiny/chat_template.jinja"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
# prism serve on /tmp/s27 at precision $1, loadgen runs against it (outputs tagged $2).
serve27() {
    local precision=$1 tag=$2 port=18700 url=http://127.0.0.1:18700 check=""
    [ "$precision" = bf16 ] || check=--expect-identical
    /tmp/prism serve --gguf /tmp/s27/model.gguf --model-dir /tmp/s27 --device "${DEVICE:-cuda}" --precision "$precision" \
        --port $port > "$OUT/serve-$tag.log" 2>&1 &
    local pid=$! waited=0
    until grep -q "Ready on" "$OUT/serve-$tag.log" 2> /dev/null; do
        sleep 1; waited=$((waited + 1))
        if [ $waited -gt 400 ] || ! kill -0 $pid 2> /dev/null; then
            echo "serve $tag not ready after ${waited}s"; kill $pid 2> /dev/null; return 1
        fi
    done
    echo "serve $tag ready after ${waited}s"
    for r in short shared followup; do
        /tmp/prism loadgen --url $url --requests tools/device/$r.jsonl --clients 1 --duration 5 $check \
            --json-out "$OUT/loadgen-$tag-$r.json" > "$OUT/loadgen-$tag-$r.txt" 2>&1
        echo "loadgen $tag $r rc=$?"
    done
    /tmp/prism loadgen --url $url --clients 64 --duration "${LOAD_S:-60}" --mix-size 64 $check \
        --json-out "$OUT/loadgen-$tag-64.json" > "$OUT/loadgen-$tag-64.txt" 2>&1
    echo "loadgen $tag 64 clients rc=$?"
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' \
        $url/stats > "$OUT/stats-$tag.json"
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' \
        $url/metrics > "$OUT/metrics-$tag.txt"
    kill -TERM $pid; wait $pid
    echo "serve $tag exit rc=$?"
}
for step in "$@"; do
    echo "== $step ($(date -u +%FT%TZ))"
    case "$step" in
        checks)
            /tmp/prism cuda-check --json-out "$OUT/cuda-check.json" > "$OUT/cuda-check.log" 2>&1
            echo "cuda-check rc=$?" | tee -a "$OUT/cuda-check.log"
            /tmp/prism cuda-quant-check --json-out "$OUT/quant.json" > "$OUT/cuda-quant-check.log" 2>&1
            echo "cuda-quant-check rc=$?" | tee -a "$OUT/cuda-quant-check.log" ;;
        serve27-int8) serve27 int8 int8 ;;
        serve27-bf16) serve27 bf16 bf16 ;;
        synth27) /tmp/prism synth --shape 27b --type q8_0 --out /tmp/s27 $R > "$OUT/synth27.log" 2>&1 ;;
        synth27q4) /tmp/prism synth --shape 27b --type q4_k_m --out /tmp/s27q4 $R > "$OUT/synth27q4.log" 2>&1 ;;
        synth9) /tmp/prism synth --shape 9b --type bf16 --out /tmp/s9 $R > "$OUT/synth9.log" 2>&1 ;;
        synth4) /tmp/prism synth --shape 4b --type bf16 --out /tmp/s4 $R > "$OUT/synth4.log" 2>&1 ;;
        bench27) /tmp/prism bench --model-dir /tmp/s27 --device cuda --precision bf16 --runs 5 --warmup 1 > "$OUT/bench-27b-bf16.txt" 2>&1 ;;
        bench27-int8)
            mkdir -p /tmp/pc
            cp .device-carry/calibration-*.json /tmp/pc/ 2> /dev/null
            PRISM_CACHE_DIR=/tmp/pc /tmp/prism bench --model-dir /tmp/s27 --device cuda --precision int8 --runs 3 --warmup 1 > "$OUT/bench-27b-int8.txt" 2>&1 ;;
        bench27-w4a8)
            mkdir -p /tmp/pc
            cp .device-carry/calibration-*.json /tmp/pc/ 2> /dev/null
            RUST_LOG=info PRISM_CACHE_DIR=/tmp/pc /tmp/prism bench --model-dir /tmp/s27q4 --device cuda --precision w4a8 --runs 3 --warmup 1 > "$OUT/bench-27b-w4a8.txt" 2>&1
            echo "   w4a8 rc=$?"
            RUST_LOG=info /tmp/prism bench --model-dir /tmp/s27q4 --device cuda --precision bf16 --runs 5 --warmup 1 > "$OUT/bench-27b-q4km-bf16.txt" 2>&1 ;;
        bench9) /tmp/prism bench --model-dir /tmp/s9 --device cuda --precision bf16 --runs 10 --warmup 2 > "$OUT/bench-9b-bf16.txt" 2>&1 ;;
        loads9)
            for th in 1 4 8 16; do
                PRISM_LOAD_THREADS=$th RUST_LOG=info timeout -s KILL 120 /tmp/prism bench --model-dir /tmp/s9 \
                    --device cuda --precision bf16 --runs 1 --warmup 0 > "$OUT/bench-9b-bf16-t$th.txt" 2>&1
                echo "   threads $th rc=$?"
            done ;;
        calib27)
            rm -rf /tmp/pc-fresh
            PRISM_LOAD_THREADS=8 RUST_LOG=info PRISM_CACHE_DIR=/tmp/pc-fresh timeout -s KILL 400 /tmp/prism bench \
                --model-dir /tmp/s27 --device cuda --precision int8 --runs 1 --warmup 0 > "$OUT/bench-27b-int8-calibrate-t8.txt" 2>&1 ;;
        bench4) /tmp/prism bench --model-dir /tmp/s4 --device cuda --precision bf16 --runs 10 --warmup 2 > "$OUT/bench-4b-bf16.txt" 2>&1 ;;
        ncu27)
            "$NCU" --profile-from-start off --clock-control none --cache-control none \
                --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu-27b.csv" \
                /tmp/prism bench --model-dir /tmp/s27 --device cuda --precision bf16 --runs 1 --warmup 1 \
                --profiler-range > "$OUT/bench-27b-under-ncu.txt" 2>&1 ;;
        gemm)
            for spec in q8_0,65536,1408,1536,T128x128Tma,1 q8_0,65536,1408,1536,T128x128Ws,1 \
                q8_0,17408,5120,275,T96x128Tma,1 q8_0,5120,34816,275,T96x128Tma,1 \
                q8_0,5120,17408,2048,T128x128Tma,1 q8_0,17408,5120,2048,T128x128Tma,1 \
                q4_k,17408,5120,2048,T128x128Tma,1 q4_k,17408,5120,2048,T128x128,1 \
                q4_k,17408,5120,16384,T128x128Tma,1 q4_k,5120,34816,275,T96x128Tma,1 \
                q6_k,17408,5120,2048,T128x128Tma,1 q6_k,17408,5120,275,T96x128Tma,1 \
                q8_0,5120,34816,275,T96x128Tma,1t8 q8_0,5120,17408,256,auto,1; do
                timeout 60 /tmp/prism cuda-quant-check --gemm "$spec" --runs 6 2>&1 | tail -2
            done > "$OUT/gemm-times.txt" ;;
        gemm-kq)
            for spec in q4_k,17408,5120,2048 q4_k,5120,17408,2048 q4_k,5120,34816,275 q4_k,5120,17408,16384 \
                q5_k,5120,17408,2048 q4_k,65536,1408,1536; do
                for tile in T128x128Tma T96x128Tma T128x64Wgp; do
                    timeout 60 /tmp/prism cuda-quant-check --gemm "$spec,$tile,1" --runs 6 2>&1 | tail -1
                done
            done > "$OUT/gemm-kq.txt" ;;
        gemm-q8c)
            for spec in q8_0,5120,17408,2048 q8_0,17408,5120,2048 q8_0,5120,34816,275 q8_0,5120,17408,16384 \
                q8_0,65536,1408,1536 q8_0,5120,17408,128 q8_0,5120,14336,512; do
                for tile in T128x128Tma T96x128Tma T128x128Wgc; do
                    timeout 60 /tmp/prism cuda-quant-check --gemm "$spec,$tile,1" --runs 6 2>&1 | tail -1
                done
            done > "$OUT/gemm-q8c.txt" ;;
        quant)
            /tmp/prism cuda-quant-check --json-out "$OUT/quant.json" > "$OUT/cuda-quant-check.log" 2>&1
            echo "cuda-quant-check rc=$?" | tee -a "$OUT/cuda-quant-check.log" ;;
        quant-var | gemm-ab)
            if [ ! -x /tmp/prism-var ]; then
                xz -dc .device-carry/prism-var.xz > /tmp/prism-var 2> /dev/null ||
                    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
                        .device-carry/prism-var.xz > /tmp/prism-var
                chmod +x /tmp/prism-var || exit 1
            fi
            if [ "$step" = quant-var ]; then
                /tmp/prism-var cuda-quant-check > "$OUT/cuda-quant-check-var.log" 2>&1
                echo "cuda-quant-check (var) rc=$?" | tee -a "$OUT/cuda-quant-check-var.log"
            else
                specs=${AB_SPECS:-"q8_0,5120,34816,275,auto,1 q8_0,17408,5120,275,auto,1 q8_0,5120,17408,2048,auto,1 q8_0,17408,5120,2048,auto,1 q8_0,5120,17408,16384,auto,1 q8_0,5120,14336,512,auto,1"}
                for spec in $specs; do
                    for rep in 1 2; do
                        for bin in prism prism-var; do
                            echo "$bin $(timeout 60 /tmp/$bin cuda-quant-check --gemm "$spec" --runs 6 2>&1 | tail -1)"
                        done
                    done
                done | tee "$OUT/gemm-ab.txt"
            fi ;;
        imma)
            cp .device-carry/imma_rate /tmp/imma_rate && chmod +x /tmp/imma_rate && /tmp/imma_rate > "$OUT/imma-rate.txt" 2>&1 ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
    echo "   $step rc=$?"
done
