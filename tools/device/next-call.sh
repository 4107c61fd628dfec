#!/bin/bash
# The next device call, ready (written 2026-12-08, ninth session, when no machine was lent): the GPU
# share kernels' and tensor parallelism's device checks (integer_matmul, model_integer, tensor_parallel;
# the whole-product kernels' sm_90a code is byte-identical to 823b0d5's), then the think bench's steady
# rate (events + host profile), 64 clients with thoughts, the engine bench. Build first (CUDA release
# prism into .device-carry/prism.xz, `bash tools/device/build-tests.sh`), keep the unstripped prism for
# tools/host_profile.py, then: device run `LIMIT=560 bash tools/device/next-call.sh`, carry .device-carry.
set -u
OUT=${OUT:-/tmp/out}; export OUT
mkdir -p $OUT/m
cd "$(dirname "$0")/../.."
[ -x /tmp/prism ] || { xz -dc .device-carry/prism.xz > /tmp/prism && chmod +x /tmp/prism; }
[ -x /tmp/device-tests ] || { xz -dc .device-carry/device-tests.xz > /tmp/device-tests && chmod +x /tmp/device-tests; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $OUT/m/gpu.txt 2>&1
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
BATCH=1,32; [ "${MEM:-0}" -gt 100000 ] && BATCH=1,64
echo "mem $MEM batch $BATCH"
save() { tar czf $OUT/all.tgz --exclude='*.ncu-rep' -C $OUT m 2>/dev/null; }
t0=$(date +%s)
el() { echo $(( $(date +%s)-t0 )); }
F=tests/fixtures; R="--ranks $F/qwen35-vocab/qwen3_6.tiktoken --chat-template $F/qwen35-tiny/chat_template.jinja"
timeout 180 /tmp/device-tests --test-threads=1 --nocapture --exact integer_matmul model_integer tensor_parallel > $OUT/m/checks.log 2>&1; echo "checks rc=$? $(el)s"; save
grep -E "^test |test result|FAIL|differ" $OUT/m/checks.log | grep -v " ok$" | head -8; grep -c "share" $OUT/m/checks.log
timeout 150 /tmp/prism synth --shape 27b --type q8_0 --out /tmp/s27 $R > $OUT/m/synth27.log 2>&1; echo "synth27 rc=$? $(el)s"; save
timeout 180 /tmp/prism bench --model-dir /tmp/s27 --device cuda --precision int8 --think 64 --think-batch $BATCH --runs 1 --profile events --host-profile $OUT/m/host-profile-think.txt > $OUT/m/think-27b-int8.json 2> $OUT/m/think-27b-int8.log; echo "think rc=$? $(el)s"; save
grep -E "thoughts:|steady" $OUT/m/think-27b-int8.log | head -4
[ $(( ${LIMIT:-575} - $(el) )) -gt 150 ] && { OUT=$OUT/m THINK_LOAD=64 LOAD_S=30 timeout 150 bash tools/device/run.sh serve27-think; echo "serve-think $(el)s"; save; tail -3 $OUT/m/loadgen-think-64.txt; }
left=$(( ${LIMIT:-575} - $(el) ))
[ $left -gt 100 ] && { timeout $left /tmp/prism bench --model-dir /tmp/s27 --device cuda --precision int8 --runs 5 --warmup 1 --json --engine > $OUT/m/bench-27b-int8.json 2> $OUT/m/bench-27b-int8.log; echo "bench27 rc=$? $(el)s"; save; }
save
