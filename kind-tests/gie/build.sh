#!/usr/bin/env bash
# Build the Gateway API Inference Extension's endpoint picker (EPP) and ./pickclient from the
# Go module proxy (no VCS host, no container registry), for the kind tier's EPP test.
#
#   epp         <- sigs.k8s.io/gateway-api-inference-extension/cmd/epp@GIE_VERSION
#                  (tests/k8s/versions.env) through this wrapper module (go.mod: require + tool)
#   pickclient  <- ./pickclient: an Envoy-like ext_proc client that asks the EPP for picks
#   images      <- batchpilot-gie-epp:GIE_VERSION and batchpilot-gie-pickclient:GIE_VERSION,
#                  FROM scratch + the static binary, `docker build --network none`; only where
#                  `docker info` works (the pickclient image runs it as a gateway in the cluster)
#
# Binaries go to ${BATCHPILOT_CACHE:-~/.cache/batchpilot}/gie/<GIE_VERSION>/bin/, stamped
# (a stamp that matches skips the build); the Go module and build caches are the ones the
# other builds use. The image carries its inputs' hash as a label: an unchanged one is kept.
# Progress goes to stderr; the LAST line of stdout is the bin directory.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
# shellcheck source=../../tests/k8s/versions.env
source "$REPO/tests/k8s/versions.env"

CACHE="${BATCHPILOT_CACHE:-$HOME/.cache/batchpilot}"
ROOT="$CACHE/gie/$GIE_VERSION"
BIN="$ROOT/bin"
LOGS="$ROOT/build-logs"
EPP_IMAGE="${EPP_IMAGE:-batchpilot-gie-epp:$GIE_VERSION}"
PICKCLIENT_IMAGE="${PICKCLIENT_IMAGE:-batchpilot-gie-pickclient:$GIE_VERSION}"
mkdir -p "$BIN" "$LOGS"

export GOMODCACHE="$CACHE/go/mod"
export GOCACHE="$CACHE/go/build"
export GOTOOLCHAIN=local
export GOFLAGS="-buildvcs=false -trimpath"
export CGO_ENABLED=0
export GOWORK=off
export GOPROXY="${GOPROXY_KIND:-https://proxy.golang.org}"

log() { echo "[gie] $*" >&2; }

command -v go >/dev/null || {
    log "ERROR: the Go toolchain (go) is not on PATH"
    exit 1
}
if ! grep -q "sigs.k8s.io/gateway-api-inference-extension $GIE_VERSION\b" "$HERE/go.mod"; then
    log "ERROR: $HERE/go.mod does not require GIE $GIE_VERSION (tests/k8s/versions.env): update it"
    exit 1
fi

timed() { # timed NAME CMD... : run with output into $LOGS/NAME.log; show the tail on failure.
    local name="$1" start=$SECONDS
    shift
    log "building $name ... (log: $LOGS/$name.log)"
    if ! "$@" >"$LOGS/$name.log" 2>&1; then
        log "ERROR: $name failed after $((SECONDS - start))s; last lines of $LOGS/$name.log:"
        tail -n 30 "$LOGS/$name.log" >&2
        return 1
    fi
    log "built $name in $((SECONDS - start))s"
    echo "$name $((SECONDS - start))s $(date -u +%FT%TZ)" >>"$LOGS/times.txt"
}

stamped() { # stamped NAME STAMP CMD... : run CMD unless $BIN/NAME exists and $BIN/.NAME holds STAMP.
    local name="$1" stamp="$2"
    shift 2
    if [[ -x "$BIN/$name" && -f "$BIN/.$name" && "$(cat "$BIN/.$name")" == "$stamp" ]]; then
        log "$name: present, skipping"
        return 0
    fi
    timed "$name" "$@"
    echo "$stamp" >"$BIN/.$name"
}

gb() { # gb OUT PKG : go build in the wrapper module, through a temporary name
    (cd "$HERE" && nice -n 10 go build -mod=readonly -ldflags="-s -w" -o "$BIN/.tmp-$1" "$2") &&
        mv -f "$BIN/.tmp-$1" "$BIN/$1"
}

MODSUM="$(cat "$HERE/go.mod" "$HERE/go.sum" | sha1sum | cut -c1-12)"
stamped epp "$GIE_VERSION-$MODSUM" gb epp sigs.k8s.io/gateway-api-inference-extension/cmd/epp
stamped pickclient "$(cat "$HERE/go.mod" "$HERE/go.sum" "$HERE"/pickclient/*.go | sha1sum | cut -c1-12)" \
    gb pickclient ./pickclient

image() { # image TAG BINARY DOCKERFILE : FROM scratch + the static binary, kept while unchanged
    local tag="$1" binary="$2" dockerfile="$3" ctx="$ROOT/image-ctx-$2" inputs
    rm -rf "$ctx" && mkdir -p "$ctx"
    cp "$BIN/$binary" "$ctx/"
    cp "$HERE/$dockerfile" "$ctx/Dockerfile"
    inputs="$(cd "$ctx" && sha1sum "$binary" Dockerfile | sha1sum | cut -c1-12)"
    if [[ "$(docker image inspect -f '{{index .Config.Labels "batchpilot.inputs"}}' "$tag" 2>/dev/null)" == "$inputs" ]]; then
        log "$tag: up to date"
    else
        timed "image-$binary" env DOCKER_BUILDKIT=0 docker build --network none \
            --label "batchpilot.inputs=$inputs" -t "$tag" "$ctx"
        log "$tag: $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')"
    fi
    rm -rf "$ctx"
}

if docker info >/dev/null 2>&1; then
    image "$EPP_IMAGE" epp Dockerfile
    image "$PICKCLIENT_IMAGE" pickclient Dockerfile.pickclient
else
    log "no Docker engine (docker info failed): skipping the images $EPP_IMAGE, $PICKCLIENT_IMAGE"
fi
echo "$BIN"
