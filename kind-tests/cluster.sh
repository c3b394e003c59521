#!/usr/bin/env bash
# The e2e's kind cluster, built from the local toolchain (no registry is ever contacted).
#
#   cluster.sh create [NAME]   node image (toolchain/build.sh: cached, or built) + kind create
#                              + CoreDNS answering cluster.local only + wait for Ready
#   cluster.sh delete [NAME]
#   cluster.sh kubeconfig [NAME]   print the kubeconfig path
# env: BATCHPILOT_KIND_NODE_IMAGE: use this node image instead of building the local one.
# NAME defaults to batchpilot-e2e. The kubeconfig goes to $BATCHPILOT_CACHE/kind/kubeconfig-NAME
# (or $KIND_KUBECONFIG). Progress on stderr.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
# shellcheck source=../tests/k8s/versions.env
source "$REPO/tests/k8s/versions.env"
CACHE="${BATCHPILOT_CACHE:-$HOME/.cache/batchpilot}"
export PATH="$CACHE/kind/bin:$CACHE/k8s/$K8S_VERSION/bin:$PATH"
cmd="${1:-create}"
NAME="${2:-batchpilot-e2e}"
KCFG="${KIND_KUBECONFIG:-$CACHE/kind/kubeconfig-$NAME}"
log() { echo "[cluster] $*" >&2; }

case "$cmd" in
kubeconfig) echo "$KCFG" ;;
delete) kind delete cluster --name "$NAME" >&2 ;;
create)
    s=$SECONDS
    config="$HERE/kind-config.yaml"
    if [[ -n "${BATCHPILOT_KIND_NODE_IMAGE:-}" ]]; then
        # A standard node image (e.g. kindest/node, where a registry is reachable): it brings
        # kind's own CNI, so the config keeps the default CNI.
        image="$BATCHPILOT_KIND_NODE_IMAGE"
        config="$(mktemp)"
        grep -v 'disableDefaultCNI' "$HERE/kind-config.yaml" >"$config"
    else
        image="$(bash "$HERE/toolchain/build.sh" node | tail -n 1)"
    fi
    log "node image $image ready after $((SECONDS - s))s"
    mkdir -p "$(dirname "$KCFG")"
    if kind get clusters 2>/dev/null | grep -qx "$NAME"; then
        log "cluster $NAME exists: reusing it"
        kind get kubeconfig --name "$NAME" >"$KCFG"
    else
        [[ -d /lib/modules ]] || mkdir -p /lib/modules 2>/dev/null || true
        kind create cluster --name "$NAME" --image "$image" --config "$config" \
            --kubeconfig "$KCFG" >&2
        log "kind create: $((SECONDS - s))s"
        # kubeadm's own CoreDNS manifests, minus `forward` (to the host's resolver) and `loop`.
        docker exec "$NAME-control-plane" kubeadm init phase addon coredns --print-manifest \
            --config /kind/kubeadm.conf |
            sed -e '/^ *forward \. /,/^ *}/d' -e '/^ *loop$/d' |
            kubectl --kubeconfig "$KCFG" apply -f - >&2
    fi
    kubectl --kubeconfig "$KCFG" wait --for=condition=Ready nodes --all --timeout=300s >&2
    kubectl --kubeconfig "$KCFG" -n kube-system rollout status deploy/coredns --timeout=300s >&2
    log "cluster $NAME ready after $((SECONDS - s))s (KUBECONFIG=$KCFG)"
    echo "$KCFG"
    ;;
*)
    echo "usage: $0 create|delete|kubeconfig [NAME]" >&2
    exit 2
    ;;
esac
