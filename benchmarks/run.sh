#!/usr/bin/env bash
# The exact commands behind benchmarks/README.md. Run from the repository root after
# `make venv`; results land in benchmarks/results/. Nothing leaves 127.0.0.1.
set -euo pipefail
BP=${BP:-.venv/bin/batchpilot}
OUT=${OUT:-benchmarks/results}

# 1. Offline: batchpilot continuous and static against transformers, 32 concurrent requests.
$BP bench offline --concurrency 32 --num-prompts 64 --sequential-num-prompts 8 \
    --efficiency-steps 16 --result-dir "$OUT"

# 2. Prefill interference: 8 decoders, one 1600-token prompt, chunked prefill off and on.
$BP bench interference --num-decoders 8 --long-prompt-len 1600 --chunk-sizes 32,64,256 \
    --result-dir "$OUT"

# 3. Online sweep: a server per policy, clients at 2, 8 and 32 concurrent streams, plus the
#    same workload offline at 32 for the online/offline ratio.
$BP bench sweep --values 2,8,32 --max-num-seqs 32 --num-prompts 48 \
    --slo ttft:2000,tpot:200 --result-dir "$OUT"

# 4. The seed's load script (issue 13): 40 concurrent completions, then one by one, against
#    a server that serves the model under the seed's name. guidellm and llama.cpp, run
#    beside it in benchmarks/README.md, live in their own virtualenvs and are not run here.
.venv/bin/batchpilot serve --port 8123 --served-model-name local-model &
SERVER=$!
trap 'kill -INT $SERVER; wait $SERVER' EXIT
until curl -sf http://127.0.0.1:8123/ready >/dev/null; do kill -0 $SERVER || exit 1; sleep 1; done
.venv/bin/python benchmarks/seed_load.py --url http://127.0.0.1:8123 --result-dir "$OUT"
