#!/bin/bash
# The device runs of docs/benchmarks.md and docs/correctness.md, as one script to carry to the GPU
# machine with the binary (see "How to reproduce" in docs/benchmarks.md). Run from the repository root:
#
#   bash tools/device/run.sh STEP...     (outputs under $OUT, default /tmp/out)
#
# Steps (in the order given):
#   checks      the device checks (tests/device: kernels and the fixture model against their CPU twins,
#               the integer matmul's included) from .device-carry/device-tests.xz, built here by
#               tools/device/build-tests.sh; log in checks.log (exit status kept), every check's row in
#               checks.json
#   hang-probe  issue #24's intermittent model_bf16 hang: `device-tests --exact model_bf16` (every other
#               run after kv_fp8, in one process) in a loop for $PROBE_S seconds (default 120), with
#               PRISM_STACKS_ON_SIGQUIT=1; a run alive after 20 s gets nvidia-smi, its threads' states and
#               system calls, two `kill -QUIT` stack dumps 2 s apart into its log (raw return addresses and
#               the memory map: symbolize here with addr2line on the unstripped device-tests the carried
#               one came from), then is killed (hang-probe/ and hang-probe.txt); PROBE_PAIRS=1: every run
#               after kv_fp8; INITCHECK=1: then compute-sanitizer --tool initcheck on model_bf16 (it did
#               not finish within its 120 s on 2026-12-05)
#   ncu-vision  ncu kernel times of the device checks' vision tower test (the fixture's tiny tower,
#               then the 27B-shape one: $NCU_SKIP launches skipped, default 1,500, then $NCU_COUNT,
#               default 3,000) from .device-carry/device-tests.xz (ncu-vision.csv)
#   synth27     a synthetic 27B Q8_0 model directory in /tmp/s27 (about 30 GB of disk)
#   synth27q4   a synthetic 27B Q4_K_M model directory in /tmp/s27q4 (about 17 GB; llama-quantize's
#               Q4_K / Q6_K mix, quantized by prism-gguf: about 2 minutes on 16 cores)
#   synth9 / synth4   synthetic 9B / 4B BF16 model directories in /tmp/s9, /tmp/s4
#   gemm        prism gemm-bench: the integer GEMM at the 27B projection shapes next to cuBLAS int8 and
#               bf16 (gemm-bench.txt, gemm-bench.json); $GEMM_ARGS: more gemm-bench flags (--shape K,N,M …)
#   bench27     27B bf16 bench (5 runs after 1 warm-up): bench-27b-bf16.json (prism bench --json), log
#   bench27-int8  27B int8 bench of /tmp/s27 (5 runs after 1 warm-up): bench-27b-int8.json, log; with
#               $PROFILE (sync or events) set, each scenario also profiled; with ENGINE=1 also through the
#               engine the server runs (its median next to the direct path's) and a prefix-cache follow-up
#               (the short request after the three-question one, cache on: the report's "followup");
#               with ENGINE_BATCH=6,16 also that many distinct three-question requests in one pass of
#               the engine (the report's "engine_batches"; profiled too with $PROFILE); NARROW=N: the
#               integer products of 3 to N rows on the narrow kernel (bench and think27: --narrow-rows);
#               SWAPPED=N: those up to N rows past the narrow kernel's on the swapped tile (--swapped-rows);
#               TP=2|4: also each scenario through the engine over the model split over that many devices
#               sharing the GPU (the report's "tensor_parallel", digests required equal to one device's);
#               PDL=on|off: programmatic dependent launch (bench and think27: --programmatic-launch;
#               think27 takes PDL=on,off: both, each run in turn on one model load)
#   bench9 / bench4   9B / 4B bf16 benches (10 runs after 2 warm-ups)
#   synth4q / bench4-int8   a synthetic 4B Q8_0 model directory in /tmp/s4q; its int8 bench (10 runs after
#               2 warm-ups, through the engine too, events profile: bench-4b-int8.json) — issue #20's 4B
#               target (short ≤ 6 ms)
#   ncu-gemm    ncu's full section set on one launch (after 3) of the kernels matching $NCU_KERNEL (default
#               qgemm_wgs: the swapped tile) in `prism gemm-bench --shape $GEMM_SHAPE` (default
#               5120,34816,32: the 27B's gate | up at 32 rows): ncu-gemm.ncu-rep and its details page
#   loads9      9B bf16 loads from 1, 4, 8 and 16 loader threads (--load-threads), one bench run each
#               after no warm-up (answer digests comparable across them); each killed after 120 s
#   ncu27       ncu kernel times of one warm pass per scenario of the 27B bench at $PREC (default bf16;
#               ncu-27b-$PREC.csv; tools/ncu_summary.py sums it by kernel)
#   ncu-kernel  ncu's full section set (--set full) on $NCU_COUNT (default 1) launches of the kernels
#               matching $NCU_KERNEL (a regex) after $NCU_SKIP (default 0) of them, in the 27B bench's warm
#               passes at $PREC (default int8): ncu-kernel.ncu-rep and its details page as text
#   ncu-think27 ncu kernel times of $NCU_COUNT launches (default 3,000: two or three decode steps) after
#               the first $NCU_SKIP (default 20,000) while $NCU_THINK_BATCH (default 64) thoughts decode at
#               once on /tmp/s27 at int8 (ncu-think.csv; tools/ncu_summary.py sums it by kernel)
#   serve27-int8 / serve27-bf16   prism serve on /tmp/s27 (int8 / bf16) and prism loadgen against it:
#               20 variants of one short question (tools/device/short.jsonl) and of the three-question
#               request (shared.jsonl), each sent once from 1 client (cold: new evidence); follow-ups
#               (followup.jsonl: 10 pairs, the second asking another question about the first one's
#               ~1,000-token evidence: a prefix-cache hit); then the built-in mix from 64 clients for
#               $LOAD_S seconds (default 60); after each, answers re-sent alone and compared (int8 with
#               --expect-identical); then the three-question request made 4,096 distinct (its own evidence
#               each) from 64 clients for $LOAD_S seconds (loadgen-TAG-shared64.json: issue #19's target);
#               /stats and /metrics at the end; outputs serve-*.log, loadgen-*.json,
#               stats-*.json. $LOADS picks loads (default "short shared followup mix shared64"),
#               $SERVE_FLAGS adds serve flags, $TAG_SUFFIX tells the outputs of two such runs apart
#   eval27      prism eval of a generated $EVAL_N-item suite (default 2,000; tools/device/make_suite.py) on
#               /tmp/s27 at bf16, then at int8 with --compare against the bf16 run (outputs eval-bf16/,
#               eval-int8/ with results.json, report.md, reliability.png; logs eval-*.log)
#   think27     thought decoding of /tmp/s27 at int8 through the engine (prism bench --think): one thought
#               of $THINK tokens (default 128) alone, then 64 at once ($THINK_BATCH, default 1,64; 64 does not fit
#               an H100's memory next to the 27B, where THINK_BATCH=1,32), then each profiled (think-27b-int8.json;
#               $PROFILE: sync, the default, events, or none for no profiled run; $THINK_RUNS timed runs of each, default 1)
#   serve27-think  prism serve on /tmp/s27 at int8 as a v1.1 AutoThink model (the synthetic directory's
#               decision_config.json gets "family": "v1.1") and loadgen from 64 clients for $LOAD_S seconds:
#               the three-question requests of shared.jsonl made 512 distinct, with think_mode auto, gate 0.9,
#               think_budget $THINK_LOAD (default 256) and return_thought; answers (thoughts included)
#               re-sent alone and compared (--expect-identical); outputs loadgen-think-64.*, stats-think.json;
#               $THINK_SERVE_ARGS: more `prism serve` flags (e.g. --max-batch-tokens 2048), $THINK_TAG: a
#               suffix for the outputs' names (several settings in one call)
#   images27    issue #22's images target on the synthetic 27B at int8 (needs /tmp/s27 from synth27): the
#               27B's vision tower (`prism synth --mmproj-only`: 27 blocks, width 1152, F16, random weights)
#               written to /tmp/s27v unless there, then prism serve --model-dir /tmp/s27 --mmproj
#               /tmp/s27v/mmproj-Qwen3.5-27B-synth-F16.gguf (kept out of /tmp/s27 so the other steps load no
#               tower) and prism loadgen from 1 client over HTTP: requests of 8 frames of 640x360 (PNG) and
#               24 questions (tools/device/make_images.py, each with frames of its own): 1 warm-up, then 5
#               distinct (cold: the tower runs on each; loadgen-images-cold.json), then one of them 5 times
#               (its evidence from the prefix cache; loadgen-images-repeat.json); /stats at the end
#               (stats-images.json: vision.ms_per_image is the tower's time per image); log serve-images.log
# bench27-int8 and think27 with HOST_PROFILE=1: also a host profile (host-profile-bench.txt /
# host-profile-think.txt; here: python3 tools/host_profile.py FILE target/release/prism, the unstripped
# binary the carried one was stripped from).
# Any step: PRISM_STACKS_ON_SIGQUIT=1 in the environment and `kill -QUIT PID` on a hung prism write
# every thread's stack to its stderr (crates/prism-model/src/stack_dump.rs; carry an unstripped build).
# The binaries are taken from .device-carry/NAME.xz (xz of a stripped `--features cuda` build; unpacked
# by xz or Python's lzma) or .device-carry/NAME.gz, unless /tmp/NAME exists: NAME is prism for every
# step but checks, hang-probe and ncu-vision, which need only device-tests.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
unpack() {
    local name=$1
    [ -x "/tmp/$name" ] && return 0
    if [ -f ".device-carry/$name.xz" ]; then
        if command -v xz > /dev/null; then
            xz -dc ".device-carry/$name.xz" > "/tmp/$name"
        else
            python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
                ".device-carry/$name.xz" > "/tmp/$name"
        fi
    else
        gzip -dc ".device-carry/$name.gz" > "/tmp/$name"
    fi && chmod +x "/tmp/$name"
}
# think27's profile flag: sync unless $PROFILE says events, or none (no profiled run).
think_profile() {
    case "${PROFILE:-sync}" in
        none) ;;
        *) echo "--profile ${PROFILE:-sync}" ;;
    esac
}
for step in "$@"; do
    if [ "$step" != checks ] && [ "$step" != ncu-vision ] && [ "$step" != hang-probe ]; then
        unpack prism || exit 1
        break
    fi
done
F=tests/fixtures
R="--ranks $F/qwen35-vocab/qwen3_6.tiktoken --chat-template $F/qwen35-tiny/chat_template.jinja"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
# The body of GET $1, on stdout.
http_get() {
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' "$1"
}
# Waits until the prism serve of process $1, logging to $OUT/serve-$2.log, says it is ready (400 s at most);
# kills it and fails where it does not.
wait_ready() {
    local pid=$1 name=$2 waited=0
    until grep -q "Ready on" "$OUT/serve-$name.log" 2> /dev/null; do
        sleep 1; waited=$((waited + 1))
        if [ $waited -gt 400 ] || ! kill -0 $pid 2> /dev/null; then
            echo "serve $name not ready after ${waited}s"; kill $pid 2> /dev/null; return 1
        fi
    done
    echo "serve $name ready after ${waited}s"
}
# prism serve on /tmp/s27 as a v1.1 AutoThink model at int8, 64 clients with thoughts.
serve27_think() {
    local port=18701 url=http://127.0.0.1:18701
    python3 - /tmp/s27/decision_config.json <<'PY'
import json, sys
path = sys.argv[1]
config = json.load(open(path))
config["family"] = "v1.1"
json.dump(config, open(path, "w"))
PY
    python3 - tools/device/shared.jsonl /tmp/thoughts.jsonl "${THINK_LOAD:-256}" <<'PY'
import json, sys
base = [json.loads(line) for line in open(sys.argv[1])]
with open(sys.argv[2], "w") as out:
    for i in range(512):
        request = json.loads(json.dumps(base[i % len(base)]))
        request["state"]["ticket"] = f"Ticket {5000 + i}: " + request["state"]["ticket"].split(": ", 1)[-1]
        request.update({"think_mode": "auto", "gate": 0.9, "think_budget": int(sys.argv[3]), "return_thought": True})
        out.write(json.dumps(request) + "\n")
PY
    local tag=${THINK_TAG:-}
    /tmp/prism serve --gguf /tmp/s27/model.gguf --model-dir /tmp/s27 --device cuda --precision int8 \
        --port $port ${THINK_SERVE_ARGS:-} > "$OUT/serve-think$tag.log" 2>&1 &
    local pid=$!
    wait_ready $pid "think" || return 1
    /tmp/prism loadgen --url $url --requests /tmp/thoughts.jsonl --clients 64 --duration "${LOAD_S:-60}" \
        --check 32 --expect-identical --json-out "$OUT/loadgen-think-64$tag.json" > "$OUT/loadgen-think-64$tag.txt" 2>&1
    echo "loadgen think 64 clients rc=$?"
    http_get $url/stats > "$OUT/stats-think$tag.json"
    kill -TERM $pid; wait $pid
    echo "serve think exit rc=$?"
}
# prism serve on /tmp/s27 with the 27B's vision tower at int8, 8 frames and 24 questions a request.
images27() {
    local port=18702 url=http://127.0.0.1:18702 mmproj=/tmp/s27v/mmproj-Qwen3.5-27B-synth-F16.gguf
    if [ ! -f $mmproj ]; then
        /tmp/prism synth --shape 27b --type q8_0 --mmproj-only --out /tmp/s27v > "$OUT/synth27v.log" 2>&1 \
            || { echo "synth of the vision tower failed"; return 1; }
    fi
    python3 tools/device/make_images.py 1 0 /tmp/images-warm.jsonl
    python3 tools/device/make_images.py 5 1 /tmp/images-cold.jsonl
    head -1 /tmp/images-cold.jsonl > /tmp/images-repeat.jsonl
    /tmp/prism serve --gguf /tmp/s27/model.gguf --model-dir /tmp/s27 --mmproj $mmproj --device cuda \
        --precision int8 --max-body-bytes 33554432 --port $port > "$OUT/serve-images.log" 2>&1 &
    local pid=$!
    wait_ready $pid "images" || return 1
    for tag in warm cold repeat; do
        local n=5
        [ $tag = warm ] && n=1
        /tmp/prism loadgen --url $url --requests /tmp/images-$tag.jsonl --clients 1 --duration 120 \
            --max-requests $n --check $n --expect-identical --json-out "$OUT/loadgen-images-$tag.json" \
            > "$OUT/loadgen-images-$tag.txt" 2>&1
        echo "loadgen images $tag rc=$?"
    done
    http_get $url/stats > "$OUT/stats-images.json"
    python3 -c 'import json, sys; v = json.load(open(sys.argv[1])).get("vision"); print("vision tower:", v)' \
        "$OUT/stats-images.json"
    kill -TERM $pid; wait $pid
    echo "serve images exit rc=$?"
}
# prism serve on /tmp/s27 at precision $1, loadgen runs against it (outputs tagged $2).
serve27() {
    local precision=$1 tag=$2${TAG_SUFFIX:-} port=18700 url=http://127.0.0.1:18700 check="" loads=" ${LOADS:-short shared followup mix shared64} "
    [ "$precision" = bf16 ] || check=--expect-identical
    # $SERVE_FLAGS: more `prism serve` flags (an engine limit to compare); $LOADS: which loads run.
    /tmp/prism serve --gguf /tmp/s27/model.gguf --model-dir /tmp/s27 --device "${DEVICE:-cuda}" --precision "$precision" \
        --port $port ${SERVE_FLAGS:-} > "$OUT/serve-$tag.log" 2>&1 &
    local pid=$!
    wait_ready $pid "$tag" || return 1
    # Cold: 20 distinct short / three-question requests from one client, each sent once (new evidence).
    for r in short shared; do
        [[ $loads == *" $r "* ]] || continue
        /tmp/prism loadgen --url $url --requests tools/device/$r.jsonl --clients 1 --duration 60 \
            --max-requests 20 --check 20 $check --json-out "$OUT/loadgen-$tag-$r.json" > "$OUT/loadgen-$tag-$r.txt" 2>&1
        echo "loadgen $tag $r rc=$?"
    done
    # Follow-ups: 10 pairs, the second asking about the first one's evidence (a prefix-cache hit).
    if [[ $loads == *" followup "* ]]; then
        /tmp/prism loadgen --url $url --requests tools/device/followup.jsonl --clients 1 --duration 60 \
            --max-requests 20 --check 20 $check --json-out "$OUT/loadgen-$tag-followup.json" > "$OUT/loadgen-$tag-followup.txt" 2>&1
        echo "loadgen $tag followup rc=$?"
    fi
    # 64 clients on the built-in mix (a quarter of the requests repeat an earlier evidence).
    if [[ $loads == *" mix "* ]]; then
        /tmp/prism loadgen --url $url --clients 64 --duration "${LOAD_S:-60}" --check 128 $check \
            --json-out "$OUT/loadgen-$tag-64.json" > "$OUT/loadgen-$tag-64.txt" 2>&1
        echo "loadgen $tag 64 clients rc=$?"
    fi
    # 64 clients on the bench's three-question request, each with its own evidence (issue #19's
    # throughput target): shared.jsonl made 4,096 distinct by a ticket number.
    if [[ $loads == *" shared64 "* ]]; then
        python3 - tools/device/shared.jsonl /tmp/shared-distinct.jsonl <<'PY'
import json, sys
base = [json.loads(line) for line in open(sys.argv[1])]
with open(sys.argv[2], "w") as out:
    for i in range(4096):
        request = json.loads(json.dumps(base[i % len(base)]))
        request["state"]["ticket"] = f"Ticket {9000 + i}: " + request["state"]["ticket"].split(": ", 1)[-1]
        out.write(json.dumps(request) + "\n")
PY
        /tmp/prism loadgen --url $url --requests /tmp/shared-distinct.jsonl --clients 64 --duration "${LOAD_S:-60}" \
            --check 64 $check --json-out "$OUT/loadgen-$tag-shared64.json" > "$OUT/loadgen-$tag-shared64.txt" 2>&1
        echo "loadgen $tag shared 64 clients rc=$?"
    fi
    http_get $url/stats > "$OUT/stats-$tag.json"
    http_get $url/metrics > "$OUT/metrics-$tag.txt"
    kill -TERM $pid; wait $pid
    echo "serve $tag exit rc=$?"
}
for step in "$@"; do
    echo "== $step ($(date -u +%FT%TZ))"
    case "$step" in
        checks)
            unpack device-tests || exit 1
            PRISM_DEVICE_JSON="$OUT/checks.json" /tmp/device-tests --test-threads=1 --nocapture \
                > "$OUT/checks.log" 2>&1
            echo "checks rc=$?" | tee -a "$OUT/checks.log" ;;
        serve27-int8) serve27 int8 int8 ;;
        serve27-bf16) serve27 bf16 bf16 ;;
        serve27-think) serve27_think ;;
        images27) images27 ;;
        think27)
            /tmp/prism bench --model-dir /tmp/s27 --device cuda --precision int8 --think "${THINK:-128}" \
                --think-batch "${THINK_BATCH:-1,64}" --runs "${THINK_RUNS:-1}" $(think_profile) ${HOST_PROFILE:+--host-profile $OUT/host-profile-think.txt} \
                ${NARROW:+--narrow-rows $NARROW} ${SWAPPED:+--swapped-rows $SWAPPED} ${PDL:+--programmatic-launch $PDL} \
                > "$OUT/think-27b-int8.json" 2> "$OUT/think-27b-int8.log"
            echo "think27 rc=$?" ;;
        eval27)
            python3 tools/device/make_suite.py "${EVAL_N:-2000}" /tmp/suite.jsonl
            for p in bf16 int8; do
                cmp=""
                [ $p = int8 ] && cmp="--compare $OUT/eval-bf16/results.json"
                /tmp/prism eval /tmp/suite.jsonl --gguf /tmp/s27/model.gguf --model-dir /tmp/s27 \
                    --device cuda --precision $p --out "$OUT/eval-$p" $cmp > "$OUT/eval-$p.log" 2>&1
                echo "eval27 $p rc=$?"
            done ;;
        synth27) /tmp/prism synth --shape 27b --type q8_0 --out /tmp/s27 $R > "$OUT/synth27.log" 2>&1 ;;
        synth27q4) /tmp/prism synth --shape 27b --type q4_k_m --out /tmp/s27q4 $R > "$OUT/synth27q4.log" 2>&1 ;;
        synth9) /tmp/prism synth --shape 9b --type bf16 --out /tmp/s9 $R > "$OUT/synth9.log" 2>&1 ;;
        synth4) /tmp/prism synth --shape 4b --type bf16 --out /tmp/s4 $R > "$OUT/synth4.log" 2>&1 ;;
        gemm) /tmp/prism gemm-bench ${GEMM_ARGS:-} --json-out "$OUT/gemm-bench.json" > "$OUT/gemm-bench.txt" 2>&1
            echo "gemm-bench rc=$?" ;;
        bench27) /tmp/prism bench --model-dir /tmp/s27 --device cuda --precision bf16 --runs 5 --warmup 1 --json \
                > "$OUT/bench-27b-bf16.json" 2> "$OUT/bench-27b-bf16.log" ;;
        bench27-int8)
            /tmp/prism bench --model-dir /tmp/s27 --device cuda --precision int8 --runs 5 --warmup 1 --json \
                ${PROFILE:+--profile $PROFILE} ${ENGINE:+--engine} ${ENGINE_BATCH:+--engine-batch $ENGINE_BATCH} \
                ${HOST_PROFILE:+--host-profile $OUT/host-profile-bench.txt} ${NARROW:+--narrow-rows $NARROW} ${SWAPPED:+--swapped-rows $SWAPPED} ${PDL:+--programmatic-launch $PDL} \
                ${TP:+--tp $TP} > "$OUT/bench-27b-int8.json" 2> "$OUT/bench-27b-int8.log"
            echo "bench27-int8 rc=$?" ;;
        bench9) /tmp/prism bench --model-dir /tmp/s9 --device cuda --precision bf16 --runs 10 --warmup 2 > "$OUT/bench-9b-bf16.txt" 2>&1 ;;
        loads9)
            for th in 1 4 8 16; do
                RUST_LOG=info timeout -s KILL 120 /tmp/prism bench --load-threads $th --model-dir /tmp/s9 \
                    --device cuda --precision bf16 --runs 1 --warmup 0 > "$OUT/bench-9b-bf16-t$th.txt" 2>&1
                echo "   threads $th rc=$?"
            done ;;
        bench4) /tmp/prism bench --model-dir /tmp/s4 --device cuda --precision bf16 --runs 10 --warmup 2 > "$OUT/bench-4b-bf16.txt" 2>&1 ;;
        synth4q) /tmp/prism synth --shape 4b --type q8_0 --out /tmp/s4q $R > "$OUT/synth4q.log" 2>&1 ;;
        bench4-int8)
            /tmp/prism bench --model-dir /tmp/s4q --device cuda --precision int8 --runs 10 --warmup 2 --json \
                --engine --profile events > "$OUT/bench-4b-int8.json" 2> "$OUT/bench-4b-int8.log"
            echo "bench4-int8 rc=$?" ;;
        ncu-gemm)
            "$NCU" --clock-control none --set full -k "regex:${NCU_KERNEL:-qgemm_wgs}" --launch-skip 3 \
                --launch-count 1 -o "$OUT/ncu-gemm" /tmp/prism gemm-bench --shape "${GEMM_SHAPE:-5120,34816,32}" \
                --runs 5 > "$OUT/ncu-gemm.txt" 2>&1
            echo "ncu-gemm rc=$?"
            "$NCU" --import "$OUT/ncu-gemm.ncu-rep" --page details > "$OUT/ncu-gemm-details.txt" 2>&1 ;;
        ncu27)
            "$NCU" --profile-from-start off --clock-control none --cache-control none \
                --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu-27b-${PREC:-bf16}.csv" \
                /tmp/prism bench --model-dir /tmp/s27 --device cuda --precision "${PREC:-bf16}" --runs 1 --warmup 1 \
                --profiler-range > "$OUT/bench-27b-under-ncu.txt" 2>&1
            echo "ncu27 rc=$?" ;;
        ncu-kernel)
            "$NCU" --profile-from-start off --clock-control none --set full -k "regex:$NCU_KERNEL" \
                --launch-skip "${NCU_SKIP:-0}" --launch-count "${NCU_COUNT:-1}" -o "$OUT/ncu-kernel" \
                /tmp/prism bench --model-dir /tmp/s27 --device cuda --precision "${PREC:-int8}" --runs 1 --warmup 1 \
                --profiler-range > "$OUT/bench-27b-under-ncu-kernel.txt" 2>&1
            echo "ncu-kernel rc=$?"
            "$NCU" --import "$OUT/ncu-kernel.ncu-rep" --page details > "$OUT/ncu-kernel-details.txt" 2>&1 ;;
        hang-probe)
            unpack device-tests || exit 1
            P=$OUT/hang-probe; mkdir -p "$P"
            CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
            end=$(( $(date +%s) + ${PROBE_S:-120} )); i=0; hangs=0
            while [ "$(date +%s)" -lt "$end" ] && [ $hangs -lt 1 ]; do
                i=$((i + 1))
                if [ $((i % 2)) -eq 1 ] || [ "${PROBE_PAIRS:-0}" = 1 ]; then
                    args="--exact kv_fp8 model_bf16"
                else
                    args="--exact model_bf16"
                fi
                PRISM_STACKS_ON_SIGQUIT=1 /tmp/device-tests --test-threads=1 --nocapture $args > "$P/run-$i.log" 2>&1 &
                pid=$!
                for _ in $(seq 1 40); do kill -0 $pid 2> /dev/null || break; sleep 0.5; done
                if kill -0 $pid 2> /dev/null; then
                    hangs=$((hangs + 1)); echo "run $i ($args): alive after 20 s" | tee -a "$OUT/hang-probe.txt"
                    nvidia-smi > "$P/hang-$i-smi.txt" 2>&1
                    for round in 1 2; do
                        for t in /proc/$pid/task/*; do
                            echo "$(basename "$t") $(cat "$t/comm") $(cut -d' ' -f3,14,15 "$t/stat") $(cat "$t/wchan" 2> /dev/null) syscall: $(cat "$t/syscall" 2> /dev/null)"
                        done > "$P/hang-$i-tasks-$round.txt" 2>&1
                        kill -QUIT $pid; sleep 2
                    done
                    cp /proc/$pid/maps "$P/hang-$i-maps.txt" 2> /dev/null
                    kill -9 $pid
                fi
                wait $pid; echo "run $i ($args) rc=$?" >> "$OUT/hang-probe.txt"
            done
            echo "hang-probe: $i runs, $hangs alive after 20 s" | tee -a "$OUT/hang-probe.txt"
            if [ "${INITCHECK:-0}" = 1 ]; then
                timeout 120 "$CS" --tool initcheck --print-limit 30 /tmp/device-tests --test-threads=1 --nocapture \
                    --exact model_bf16 > "$P/initcheck-model_bf16.txt" 2>&1
                echo "initcheck model_bf16 rc=$?" | tee -a "$OUT/hang-probe.txt"
            fi ;;
        ncu-vision)
            unpack device-tests || exit 1
            "$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
                --launch-skip "${NCU_SKIP:-1500}" --launch-count "${NCU_COUNT:-3000}" --log-file "$OUT/ncu-vision.csv" \
                /tmp/device-tests --test-threads=1 --nocapture vision_tower > "$OUT/vision-under-ncu.txt" 2>&1
            echo "ncu-vision rc=$?" ;;
        ncu-think27)
            "$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
                --launch-skip "${NCU_SKIP:-20000}" --launch-count "${NCU_COUNT:-3000}" --log-file "$OUT/ncu-think.csv" \
                /tmp/prism bench --model-dir /tmp/s27 --device cuda --precision int8 --think "${THINK:-48}" \
                --think-batch "${NCU_THINK_BATCH:-64}" --runs 1 > "$OUT/think-under-ncu.txt" 2>&1
            echo "ncu-think27 rc=$?" ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
    echo "   $step rc=$?"
done
