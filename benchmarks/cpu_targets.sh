#!/usr/bin/env bash
# Issue 23's CPU targets on one machine, every arm in turn (benchmarks/HISTORY.md, "Issue
# 23's targets on AMD Zen 4"): the decode step at 40 and 1 sequences in bf16 and float32
# (three runs each, alternated), offline at 32 for dtype auto and float32, online at 32
# streams against offline (two runs), the seed's script (two runs) and, where Docker and
# the server image are there, the CPU quota against pinned CPUs.
# Run from the repository root after `make venv` on a quiet machine: nothing else on its
# CPUs. Results: $OUT (default benchmarks/results/cpu-targets-<date>).
set -euo pipefail
BP=${BP:-.venv/bin/batchpilot}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results/cpu-targets-$(date -u +%Y%m%d-%H%M%S)}
IMAGE=${IMAGE:-batchpilot-server:e2e}
PORT=${PORT:-8123}
mkdir -p "$OUT"
{ lscpu; git rev-parse HEAD; } >"$OUT/machine.txt"

for run in 1 2 3; do
    for dtype in bfloat16 float32; do
        for batch in 40 1; do
            log="$OUT/step-$dtype-$batch-$run.txt"
            echo "load $(cut -d' ' -f1 /proc/loadavg)" >"$log"
            $PY benchmarks/decode_step.py --dtype $dtype --batch $batch --temperature 0.7 >>"$log" 2>&1
        done
    done
done

for dtype in auto float32; do
    $BP bench offline --dtype $dtype --concurrency 32 --num-prompts 32 --output-lens 16,64,128 \
        --sequential-num-prompts 4 --efficiency-steps 0 \
        --systems continuous,hf-sequential,hf-generate-batch \
        --result-dir "$OUT/offline-$dtype" >"$OUT/offline-$dtype.txt" 2>&1
done

for run in 1 2; do
    $BP bench sweep --policies continuous --values 32 --max-num-seqs 32 --num-prompts 32 \
        --output-lens 16,64,128 --result-dir "$OUT/sweep-$run" >"$OUT/sweep-$run.txt" 2>&1
done

$BP serve --port "$PORT" --served-model-name local-model >"$OUT/seed-server.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER' EXIT
until curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; do kill -0 $SERVER; sleep 1; done
for run in 1 2; do
    $PY benchmarks/seed_load.py --url "http://127.0.0.1:$PORT" --result-dir "$OUT" >"$OUT/seed-$run.txt" 2>&1
done
kill -INT $SERVER && wait $SERVER || true
trap - EXIT

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    IMAGE=$IMAGE CPUS=1 CPUSET=0 REPEATS=2 OUT=$OUT bash benchmarks/cpu_quota.sh >"$OUT/cpu-quota.txt" 2>&1
else
    echo "no image $IMAGE: the CPU quota arm was not run" | tee "$OUT/cpu-quota.txt"
fi
echo "results: $OUT"
