#!/usr/bin/env bash
# Build the loopback control plane used by the `cluster` test tier (`make k8s-bins`).
#
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl  <- k8s.io/kubernetes
#       through the wrapper module tests/k8s/tools (staging modules -> published v0.X.Y twins)
#   etcd   <- go.etcd.io/etcd/server/v3 through the wrapper module tests/k8s/tools/etcd
#   kwok   <- go install sigs.k8s.io/kwok/cmd/kwok@KWOK_VERSION
#   helm   <- go install helm.sh/helm/v3/cmd/helm@HELM_VERSION
#   llmd-kvevents <- tests/k8s/tools/llmd-kvevents over github.com/llm-d/llm-d-kv-cache@LLMD_KV_CACHE_VERSION
#   GIE's InferencePool CRD <- go mod download sigs.k8s.io/gateway-api-inference-extension@GIE_VERSION
#
# Output: ${BATCHPILOT_CACHE:-$HOME/.cache/batchpilot}/k8s/<K8S_VERSION>/bin/
# The Go module and build caches live under the same cache root, so a fresh clone reuses them.
# Idempotent: a component whose binary and version stamp are present is not rebuilt.
# Progress goes to stderr; the LAST line of stdout is the bin directory.
# Any failed component makes the script exit non-zero and name the component.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE="${BATCHPILOT_CACHE:-$HOME/.cache/batchpilot}"
ROOT="$CACHE/k8s/$K8S_VERSION"
BIN="$ROOT/bin"
LOGS="$ROOT/build-logs"
mkdir -p "$BIN" "$LOGS"

export GOMODCACHE="$CACHE/go/mod"
export GOCACHE="$CACHE/go/build"
export GOTOOLCHAIN=local
export GOFLAGS="-buildvcs=false -trimpath"
export CGO_ENABLED=0
export GOWORK=off

log() { echo "[k8s-bins] $*" >&2; }

if ! command -v go >/dev/null 2>&1; then
    log "ERROR: the Go toolchain (go) is not on PATH; it is required to build the control plane."
    exit 1
fi

# stamp_ok NAME VERSION BINARIES... : true when every binary exists and the stamp matches.
stamp_ok() {
    local name="$1" version="$2"
    shift 2
    [[ -f "$BIN/.$name.version" && "$(cat "$BIN/.$name.version")" == "$version" ]] || return 1
    local b
    for b in "$@"; do [[ -x "$BIN/$b" ]] || return 1; done
}

# run_logged NAME CMD... : run with output into $LOGS/NAME.log, time it, show the tail on failure.
run_logged() {
    local name="$1"
    shift
    local start=$SECONDS
    log "building $name ... (log: $LOGS/$name.log)"
    if ! "$@" >"$LOGS/$name.log" 2>&1; then
        log "ERROR: building $name failed after $((SECONDS - start))s; last lines of $LOGS/$name.log:"
        tail -n 30 "$LOGS/$name.log" >&2
        return 1
    fi
    log "built $name in $((SECONDS - start))s"
    echo "$name $((SECONDS - start))s $(date -u +%FT%TZ)" >>"$LOGS/times.txt"
}

build_kubernetes() {
    local minor="${K8S_VERSION#v1.}"
    minor="${minor%%.*}"
    local pkg="k8s.io/component-base/version"
    local ld="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ld="$ld -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    local tmp="$BIN/.tmp-kubernetes"
    rm -rf "$tmp" && mkdir -p "$tmp"
    (
        cd "$HERE/tools"
        nice -n 10 go build -mod=readonly -ldflags="$ld" -o "$tmp/" \
            k8s.io/kubernetes/cmd/kube-apiserver \
            k8s.io/kubernetes/cmd/kube-controller-manager \
            k8s.io/kubernetes/cmd/kube-scheduler \
            k8s.io/kubernetes/cmd/kubectl
    ) || return 1
    mv -f "$tmp"/* "$BIN/" && rmdir "$tmp"
}

build_etcd() {
    local tmp="$BIN/.tmp-etcd"
    rm -rf "$tmp" && mkdir -p "$tmp"
    (
        cd "$HERE/tools/etcd"
        nice -n 10 go build -mod=readonly -ldflags="-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3
    ) || return 1
    mv -f "$tmp/etcd" "$BIN/etcd" && rmdir "$tmp"
}

build_install() { # build_install PKG@VERSION
    local tmp="$BIN/.tmp-install"
    rm -rf "$tmp" && mkdir -p "$tmp"
    (cd "$tmp" && GOBIN="$tmp" nice -n 10 go install -ldflags="-s -w" "$1") || return 1
    mv -f "$tmp"/* "$BIN/" && rmdir "$tmp"
}

build_llmd_kvevents() {
    local tmp="$BIN/.tmp-llmd-kvevents"
    rm -rf "$tmp" && mkdir -p "$tmp"
    (
        cd "$HERE/tools/llmd-kvevents"
        nice -n 10 go build -mod=readonly -ldflags="-s -w" -o "$tmp/llmd-kvevents" .
    ) || return 1
    mv -f "$tmp/llmd-kvevents" "$BIN/" && rmdir "$tmp"
}

failed=()
component() { # component NAME VERSION "BINARIES" CMD...
    local name="$1" version="$2" bins="$3"
    shift 3
    # shellcheck disable=SC2086
    if stamp_ok "$name" "$version" $bins; then
        log "$name $version: present, skipping"
        return 0
    fi
    if run_logged "$name" "$@"; then
        echo "$version" >"$BIN/.$name.version"
    else
        failed+=("$name $version")
    fi
}

component kubernetes "$K8S_VERSION" "kube-apiserver kube-controller-manager kube-scheduler kubectl" \
    build_kubernetes
component etcd "$ETCD_VERSION" "etcd" build_etcd
component kwok "$KWOK_VERSION" "kwok" build_install "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
component helm "$HELM_VERSION" "helm" build_install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
# Its stamp carries the harness's own source too, so an edit to it rebuilds.
LLMD_STAMP="$LLMD_KV_CACHE_VERSION-$(cat "$HERE"/tools/llmd-kvevents/{main.go,go.mod} | sha1sum | cut -c1-8)"
component llmd-kvevents "$LLMD_STAMP" "llmd-kvevents" build_llmd_kvevents

# Not a binary: the CRD file as the module ships it, under the cache's crds/ folder.
GIE_CRD="$ROOT/crds/gie-$GIE_VERSION/inference.networking.k8s.io_inferencepools.yaml"
fetch_gie_crd() {
    local module="sigs.k8s.io/gateway-api-inference-extension@$GIE_VERSION"
    go mod download "$module" || return 1
    mkdir -p "$(dirname "$GIE_CRD")"
    cp "$GOMODCACHE/$module/config/crd/bases/$(basename "$GIE_CRD")" "$GIE_CRD.tmp"
    chmod u+w "$GIE_CRD.tmp" && mv -f "$GIE_CRD.tmp" "$GIE_CRD"
}
if [[ -f "$GIE_CRD" ]]; then
    log "gie-crd $GIE_VERSION: present, skipping"
elif ! run_logged gie-crd fetch_gie_crd; then
    failed+=("gie-crd $GIE_VERSION")
fi

if ((${#failed[@]})); then
    log "ERROR: failed to build: ${failed[*]} (logs in $LOGS)"
    exit 1
fi
echo "$BIN"
