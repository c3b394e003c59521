#!/usr/bin/env bash
# Issue 23, item 3: the server image under a CPU quota against the same CPUs pinned.
#
#   pinned  docker run --cpuset-cpus $CPUSET       affinity = the budget
#   quota   docker run --cpus $CPUS                affinity = every CPU; threads from the
#                                                  cgroup quota (server/platform/cpu_budget.py)
#   old     docker run --cpus $CPUS ... --cpu-threads $(nproc)
#                                                  one thread per visible CPU, as before
#
# `batchpilot bench serve` runs against each arm $REPEATS times (arms interleaved), then the
# summary prints each arm's output throughput and quota/pinned, which should be >= 0.9.
# Before the fix, on a 2-CPU machine with CPUS=1: quota 28.3 and 25.5 tok/s against pinned
# 57.4 and 55.4.
#
# Needs Docker and the server image (`make image-server`, or IMAGE=...), and a quiet
# machine: nothing else on its CPUs. Results: $OUT/cpu-quota-<arm>-<n>-<date>.json; each
# container's "CPU engine: N threads: <source>" log line is printed beside its figure.
# Binding is measured the same way: EXTRA_ENV="OMP_PROC_BIND=close OMP_PLACES=cores".
set -euo pipefail
VERSION=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' batchpilot/__init__.py)
IMAGE=${IMAGE:-ghcr.io/batchpilot/batchpilot-server:$VERSION}
CPUS=${CPUS:-1}                 # the budget, in CPUs (--cpus)
CPUSET=${CPUSET:-0}             # as many CPUs pinned (--cpuset-cpus): 0 for 1, 0-1 for 2
REPEATS=${REPEATS:-2}
ARMS=${ARMS:-pinned quota old}
PORT=${PORT:-8124}
BP=${BP:-.venv/bin/batchpilot}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
EXTRA_ENV=${EXTRA_ENV:-}        # space-separated NAME=value for every server container
CLIENT=${CLIENT:-}              # e.g. "taskset -c 1" to keep the load generator off CPU 0
read -r -a BENCH_ARGS <<<"${BENCH_ARGS:---max-concurrency 8 --num-prompts 32 --output-lens 16,64,128}"
STAMP=$(date -u +%Y%m%d-%H%M%S)
NAME=batchpilot-cpu-quota-$$

docker image inspect "$IMAGE" >/dev/null || { echo "no image $IMAGE: make image-server" >&2; exit 1; }
mkdir -p "$OUT"
trap 'docker rm -f "$NAME" >/dev/null 2>&1 || true' EXIT

limits() {  # the docker flags and the server's extra args of one arm
    case $1 in
        pinned) echo "--cpuset-cpus $CPUSET" ;;
        quota) echo "--cpus $CPUS" ;;
        old) echo "--cpus $CPUS -- --cpu-threads $(nproc)" ;;
        *) echo "unknown arm $1" >&2; exit 1 ;;
    esac
}

run_arm() {  # arm, repeat
    local spec docker_flags server_args=() env_flags=() file
    spec=$(limits "$1")
    read -r -a docker_flags <<<"${spec%% -- *}"
    [[ $spec == *" -- "* ]] && read -r -a server_args <<<"${spec#* -- }"
    for kv in $EXTRA_ENV; do env_flags+=(-e "$kv"); done
    docker run -d --rm --name "$NAME" -p "127.0.0.1:$PORT:8000" "${docker_flags[@]}" \
        "${env_flags[@]}" "$IMAGE" "${server_args[@]}" >/dev/null
    until curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; do
        docker inspect "$NAME" >/dev/null 2>&1 || { echo "server of arm $1 exited" >&2; exit 1; }
        sleep 1
    done
    file=cpu-quota-$1-$2-$STAMP.json
    $CLIENT "$BP" bench serve --url "http://127.0.0.1:$PORT" "${BENCH_ARGS[@]}" \
        --result-dir "$OUT" --result-filename "$file" >/dev/null
    echo "$1 #$2: $(docker logs "$NAME" 2>&1 | grep -m1 -o 'CPU engine: .*' || echo 'no thread line')"
    docker rm -f "$NAME" >/dev/null
}

for n in $(seq 1 "$REPEATS"); do
    for arm in $ARMS; do run_arm "$arm" "$n"; done
done

"$PY" - "$OUT" "$STAMP" $ARMS <<'EOF'
import json, statistics, sys
from pathlib import Path

out, stamp, arms = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
tok = {a: [json.loads(p.read_text())["output_throughput"]
           for p in sorted(out.glob(f"cpu-quota-{a}-*-{stamp}.json"))] for a in arms}
for arm, values in tok.items():
    print(f"{arm:<8}" + "  ".join(f"{v:.1f}" for v in values) + " tok/s")
if tok.get("pinned") and tok.get("quota"):
    ratio = statistics.median(tok["quota"]) / statistics.median(tok["pinned"])
    print(f"quota / pinned (medians): {ratio:.2f} ({'ok' if ratio >= 0.9 else 'under 0.9'})")
EOF
