#!/usr/bin/env bash
# Build the local kind toolchain: no container registry is ever contacted.
#
#   kind                       <- go install sigs.k8s.io/kind@KIND_VERSION
#   kubelet, kubeadm, kube-proxy <- k8s.io/kubernetes through the wrapper module ./k8s-node
#                                 (tests/k8s/tools' requires and replaces + these three tools)
#   kube-apiserver, -controller-manager, -scheduler, kubectl, etcd <- tests/k8s/build.sh
#   CNI plugins (ptp, host-local, loopback, portmap) <- github.com/containernetworking/plugins
#   coredns                    <- github.com/coredns/coredns
#   pause, runc-capfix         <- ./pause, ./runc-capfix (this project's own)
#   node OS                    <- debootstrap DEBIAN_SUITE (systemd, containerd, runc, iptables)
#   node image                 <- that rootfs + kind's base files (entrypoint, systemd units and
#                                 containerd config, read from the kind module in the Go module
#                                 cache) + every image kubeadm expects, preloaded and pinned
#
# The CNI is not kindnetd: the cluster config sets networking.disableDefaultCNI and the node
# image carries ./cni/10-batchpilot.conflist (ptp + host-local), which a single node needs.
#
# Everything is cached under ${BATCHPILOT_CACHE:-~/.cache/batchpilot}/kind: binaries and the
# rootfs are stamped, and the node image is saved as node-<key>.tar.gz, where <key> hashes
# every input of the recipe. A warm run only `docker load`s it (or finds it in Docker).
#
# Usage: build.sh [STAGE...]   stages: bins rootfs node (default: all; `node` implies the rest)
# The LAST line of stdout is the node image's tag.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"
# shellcheck source=../../tests/k8s/versions.env
source "$REPO/tests/k8s/versions.env"

CACHE="${BATCHPILOT_CACHE:-$HOME/.cache/batchpilot}"
ROOT="$CACHE/kind"
BIN="$ROOT/bin"
LOGS="$ROOT/build-logs"
K8SBIN="$CACHE/k8s/$K8S_VERSION/bin"
mkdir -p "$BIN" "$LOGS"

export GOMODCACHE="$CACHE/go/mod"
export GOCACHE="$CACHE/go/build"
export GOTOOLCHAIN=local
export GOFLAGS="-buildvcs=false -trimpath"
export CGO_ENABLED=0
export GOWORK=off
# Only the module proxy (never a VCS host).
export GOPROXY="${GOPROXY_KIND:-https://proxy.golang.org}"
export PATH="$BIN:$K8SBIN:/usr/local/go/bin:$PATH"

log() { echo "[kind-toolchain] $*" >&2; }

# The recipe's key: every file that shapes the node image.
key() {
    (
        cd "$REPO"
        cat tests/k8s/versions.env
        find kind-tests/toolchain -type f -not -name '*.md' | LC_ALL=C sort | xargs sha1sum
    ) | sha1sum | cut -c1-12
}
KEY="$(key)"
NODE_IMAGE="batchpilot.local/kind-node:$K8S_VERSION-$KEY"
NODE_TGZ="$ROOT/node-$K8S_VERSION-$KEY.tar.gz"

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

stamped() { # stamped NAME STAMP CMD... : run CMD unless $BIN/.NAME holds STAMP.
    local name="$1" stamp="$2"
    shift 2
    if [[ -f "$BIN/.$name" && "$(cat "$BIN/.$name")" == "$stamp" ]]; then return 0; fi
    timed "$name" "$@"
    echo "$stamp" >"$BIN/.$name"
}

gi() { GOBIN="$BIN" nice -n 10 go install -ldflags="-s -w" "$@"; }
gb() { # gb DIR OUT PKG... : go build in a wrapper module
    local dir="$1" out="$2"
    shift 2
    (cd "$dir" && nice -n 10 go build -mod=readonly -ldflags="${LDFLAGS:--s -w}" -o "$out" "$@")
}

node_bins() {
    local minor="${K8S_VERSION#v1.}" pkg="k8s.io/component-base/version"
    minor="${minor%%.*}"
    LDFLAGS="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    LDFLAGS="$LDFLAGS -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    LDFLAGS="$LDFLAGS" gb "$HERE/k8s-node" "$BIN/" \
        k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubeadm k8s.io/kubernetes/cmd/kube-proxy
}

stage_bins() {
    local cni=github.com/containernetworking/plugins/plugins
    stamped kind "$KIND_VERSION" gi "sigs.k8s.io/kind@$KIND_VERSION"
    stamped cni "$CNI_PLUGINS_VERSION" gi "$cni/main/ptp@$CNI_PLUGINS_VERSION" \
        "$cni/ipam/host-local@$CNI_PLUGINS_VERSION" "$cni/main/loopback@$CNI_PLUGINS_VERSION" \
        "$cni/meta/portmap@$CNI_PLUGINS_VERSION"
    stamped pause "$(cat "$HERE"/pause/* | sha1sum | cut -c1-12)" gb "$HERE/pause" "$BIN/pause" .
    stamped runc-capfix "$(cat "$HERE"/runc-capfix/* | sha1sum | cut -c1-12)" \
        gb "$HERE/runc-capfix" "$BIN/runc-capfix" .
    # One big Go build at a time: let a running control-plane build finish first.
    local waited=0
    while pgrep -f "tests/k8s/build.sh" >/dev/null; do
        ((waited)) || log "waiting for the running tests/k8s/build.sh"
        waited=1
        sleep 10
    done
    stamped coredns "$COREDNS_VERSION" gi "github.com/coredns/coredns@$COREDNS_VERSION"
    if [[ ! -x "$K8SBIN/kube-apiserver" || ! -x "$K8SBIN/etcd" ]]; then
        log "control plane missing in $K8SBIN: running tests/k8s/build.sh"
        bash "$REPO/tests/k8s/build.sh" >/dev/null
    fi
    stamped k8s-node "$K8S_VERSION-$(sha1sum "$HERE/k8s-node/go.sum" | cut -c1-12)" node_bins
}

ROOTFS="$ROOT/rootfs-$DEBIAN_SUITE"
# Packages of the node OS (kind's base image installs the same set from Debian).
NODE_PACKAGES=systemd,systemd-sysv,dbus,libseccomp2,conntrack,iptables,nftables,iproute2,ethtool
NODE_PACKAGES=$NODE_PACKAGES,util-linux,mount,kmod,pigz,bash,ca-certificates,procps,jq
NODE_PACKAGES=$NODE_PACKAGES,containerd,runc,e2fsprogs

stage_rootfs() {
    local stamp="$DEBIAN_SUITE $NODE_PACKAGES"
    if [[ -f "$ROOTFS/.batchpilot-stamp" && "$(cat "$ROOTFS/.batchpilot-stamp")" == "$stamp" ]]; then
        return 0
    fi
    command -v debootstrap >/dev/null || {
        log "ERROR: debootstrap is missing (kind-tests/host-setup.sh installs it)"
        return 1
    }
    rm -rf "$ROOTFS"
    timed debootstrap-node nice -n 10 debootstrap --variant=minbase --include="$NODE_PACKAGES" \
        "$DEBIAN_SUITE" "$ROOTFS" "$DEBIAN_MIRROR"
    echo "$stamp" >"$ROOTFS/.batchpilot-stamp"
}

# --- images: every image kubeadm (and this recipe) expects, built FROM scratch or FROM a
# small local base holding iptables for kube-proxy.
WORK="$ROOT/work"

iptables_base() { # a FROM-scratch base with iptables/nft/conntrack + their libraries + busybox
    local ctx="$WORK/iptables" r="$WORK/iptables/root" f l
    rm -rf "$ctx" && mkdir -p "$r"/{bin,usr/sbin,etc,tmp,run,lib64}
    local files=(/usr/sbin/xtables-legacy-multi /usr/sbin/xtables-nft-multi /usr/sbin/conntrack /bin/ip)
    for f in "$ROOTFS"/usr/lib/x86_64-linux-gnu/xtables/*.so; do files+=("${f#"$ROOTFS"}"); done
    for f in "${files[@]}"; do
        mkdir -p "$r$(dirname "$f")" && cp -aL "$ROOTFS$f" "$r$f"
        for l in $(chroot "$ROOTFS" ldd "$f" 2>/dev/null | grep -o '/[^ ]*'); do
            [[ -e "$r$l" ]] || { mkdir -p "$r$(dirname "$l")" && cp -aL "$ROOTFS$l" "$r$l"; }
        done
    done
    cp -aL "$ROOTFS/lib64/ld-linux-x86-64.so.2" "$r/lib64/"
    cp -a "$ROOTFS/etc/protocols" "$ROOTFS/etc/services" "$r/etc/" 2>/dev/null || true
    cp /bin/busybox "$r/bin/busybox"
    for a in sh cat grep ls mkdir rm sleep ln echo test timeout; do ln -sf busybox "$r/bin/$a"; done
    local m v x
    for m in legacy nft; do for v in iptables ip6tables; do for x in "" -save -restore; do
        ln -sf "xtables-$m-multi" "$r/usr/sbin/$v-$m$x"
    done; done; done
    # kube-proxy calls plain `iptables`: pick the backend the node uses (kind's entrypoint
    # chooses legacy or nft the same way, by which one holds rules), re-link, exec.
    cat >"$r/usr/sbin/iptables-wrapper" <<'WRAP'
#!/bin/sh
legacy=$( (iptables-legacy-save; ip6tables-legacy-save) 2>/dev/null | grep -c '^-')
nft=$( (timeout 5 sh -c "iptables-nft-save; ip6tables-nft-save") 2>/dev/null | grep -c '^-')
if [ "${legacy:-0}" -ge "${nft:-0}" ]; then mode=legacy; else mode=nft; fi
for v in iptables ip6tables; do for x in "" -save -restore; do
  ln -sf "$v-$mode$x" "/usr/sbin/$v$x"
done; done
exec "$0" "$@"
WRAP
    chmod 0755 "$r/usr/sbin/iptables-wrapper"
    for v in iptables ip6tables; do for x in "" -save -restore; do
        ln -sf iptables-wrapper "$r/usr/sbin/$v$x"
    done; done
    printf 'FROM scratch\nCOPY root/ /\nENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n' \
        >"$ctx/Dockerfile"
    docker build -q -t "batchpilot.local/kind-iptables:$KEY" "$ctx" >/dev/null
}

component_image() { # component_image TAG FROM ENTRYPOINT_JSON BINARY:DEST
    local tag="$1" from="$2" entry="$3" src="${4%%:*}" dest="${4#*:}"
    local ctx name
    name="$(basename "$src")"
    ctx="$WORK/img-$name"
    rm -rf "$ctx" && mkdir -p "$ctx" && cp "$src" "$ctx/"
    {
        echo "FROM $from"
        echo "COPY $name $dest"
        [[ -z "$entry" ]] || echo "ENTRYPOINT $entry"
    } >"$ctx/Dockerfile"
    docker build -q -t "$tag" "$ctx" >/dev/null
    docker save -o "$WORK/images/$name.tar" "$tag"
}

images() {
    rm -rf "$WORK" && mkdir -p "$WORK/images"
    iptables_base
    local r=registry.k8s.io k=$K8SBIN
    component_image "$r/kube-apiserver:$K8S_VERSION" scratch '' "$k/kube-apiserver:/usr/local/bin/"
    component_image "$r/kube-controller-manager:$K8S_VERSION" scratch '' \
        "$k/kube-controller-manager:/usr/local/bin/"
    component_image "$r/kube-scheduler:$K8S_VERSION" scratch '' "$k/kube-scheduler:/usr/local/bin/"
    component_image "$r/etcd:$ETCD_IMAGE_TAG" scratch '' "$k/etcd:/usr/local/bin/"
    component_image "$r/kube-proxy:$K8S_VERSION" "batchpilot.local/kind-iptables:$KEY" '' \
        "$BIN/kube-proxy:/usr/local/bin/"
    component_image "$r/coredns/coredns:$COREDNS_IMAGE_TAG" scratch '["/coredns"]' "$BIN/coredns:/"
    component_image "$r/pause:$PAUSE_IMAGE_TAG" scratch '["/pause"]' "$BIN/pause:/"
}

base_image() { # kind's base image, from the debootstrap rootfs (no registry)
    local kb="$GOMODCACHE/sigs.k8s.io/kind@$KIND_VERSION/images/base/files" r="$WORK/base"
    [[ -d "$kb" ]] || (cd "$WORK" && go mod download "sigs.k8s.io/kind@$KIND_VERSION")
    rm -rf "$r" && cp -a "$ROOTFS" "$r" && rm -f "$r/.batchpilot-stamp"
    mkdir -p "$r/kind/bin" "$r/etc/containerd" "$r/etc/default" "$r/etc/sysctl.d" \
        "$r/etc/systemd/system/kubelet.service.d" "$r/etc/kubernetes/manifests" "$r/opt/cni/bin" \
        "$r/etc/cni/net.d" "$r/usr/local/sbin" "$r/kind/manifests"
    install -m 0755 "$kb"/usr/local/bin/* "$r/usr/local/bin/"
    install -m 0755 "$kb"/kind/bin/* "$r/kind/bin/"
    install -m 0644 "$kb/etc/crictl.yaml" "$r/etc/"
    install -m 0644 "$kb/etc/containerd/config.toml" "$r/etc/containerd/"
    install -m 0644 "$kb/etc/default/kubelet" "$r/etc/default/"
    install -m 0644 "$kb"/etc/sysctl.d/* "$r/etc/sysctl.d/"
    install -m 0644 "$kb"/etc/systemd/system/*.service "$kb"/etc/systemd/system/*.slice \
        "$r/etc/systemd/system/"
    install -m 0644 "$kb"/etc/systemd/system/kubelet.service.d/* \
        "$r/etc/systemd/system/kubelet.service.d/"
    # The sandbox image is the pause kubeadm expects, so one pause image serves both.
    sed -i "s#sandbox_image = .*#sandbox_image = \"registry.k8s.io/pause:$PAUSE_IMAGE_TAG\"#" \
        "$r/etc/containerd/config.toml"
    # Without CAP_SYS_RESOURCE nothing may lower oom_score_adj (the kubelet asks -998 for static
    # pods): clamp containers to containerd's own value, as kind does for rootless nodes.
    if [[ "${RESTRICT_OOM_SCORE_ADJ:-auto}" == 1 ]] || { [[ "${RESTRICT_OOM_SCORE_ADJ:-auto}" == auto ]] &&
        (((0x$(awk '/^CapBnd:/{print $2}' /proc/self/status) >> 24 & 1) == 0)); }; then
        sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' \
            "$r/etc/containerd/config.toml"
    fi
    # Debian puts containerd in /usr/bin; kind's units run /usr/local/bin/containerd.
    local b
    for b in containerd ctr containerd-shim-runc-v2; do ln -sf "/usr/bin/$b" "$r/usr/local/bin/$b"; done
    # The kind base image's cleanup.
    find "$r/lib/systemd/system/sysinit.target.wants/" -name systemd-tmpfiles-setup.service -delete
    rm -f "$r"/lib/systemd/system/multi-user.target.wants/* "$r"/etc/systemd/system/*.wants/* \
        "$r"/lib/systemd/system/local-fs.target.wants/* \
        "$r"/lib/systemd/system/sockets.target.wants/*udev* \
        "$r"/lib/systemd/system/sockets.target.wants/*initctl* \
        "$r"/lib/systemd/system/basic.target.wants/*
    echo "ReadKMsg=no" >>"$r/etc/systemd/journald.conf"
    ln -sf /usr/lib/systemd/systemd "$r/sbin/init"
    chroot "$r" systemctl enable kubelet.service containerd.service undo-mount-hacks.service >/dev/null
    chroot "$r" systemctl mask systemd-binfmt.service >/dev/null
    chroot "$r" sh -c 'ctr oci spec | jq ".hooks.createContainer[.hooks.createContainer | length] |= . + {\"path\": \"/kind/bin/mount-product-files.sh\"}" | jq "del(.process.rlimits)" > /etc/containerd/cri-base.json'
    # This project's pieces: CNI plugins + config, the runc shim, Kubernetes node binaries.
    install -m 0755 "$BIN"/{ptp,host-local,loopback,portmap} "$r/opt/cni/bin/"
    install -m 0644 "$HERE/cni/10-batchpilot.conflist" "$r/etc/cni/net.d/"
    install -m 0755 "$BIN/runc-capfix" "$r/usr/local/sbin/runc"
    install -m 0755 "$BIN/kubelet" "$BIN/kubeadm" "$K8SBIN/kubectl" "$r/usr/bin/"
    echo "$K8S_VERSION" >"$r/kind/version"
    install -m 0644 "$HERE/default-storage.yaml" "$r/kind/manifests/default-storage.yaml"
    rm -rf "$r"/usr/share/doc/* "$r"/usr/share/man/* "$r"/usr/share/locale/* \
        "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/*.bin "$r"/var/cache/apt/archives/*.deb
    tar -C "$r" -c . | docker import --change 'ENV container=docker' \
        --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' - \
        "batchpilot.local/kind-base:$KEY-imported" >/dev/null
    # docker import cannot set STOPSIGNAL.
    printf 'FROM %s\nSTOPSIGNAL SIGRTMIN+3\n' "batchpilot.local/kind-base:$KEY-imported" |
        docker build -q -t "batchpilot.local/kind-base:$KEY" - >/dev/null
    docker rmi "batchpilot.local/kind-base:$KEY-imported" >/dev/null
    rm -rf "$r"
}

node_image() { # what `kind build node-image` does, with every image from a local tar
    local cid="batchpilot-kind-build-$$"
    docker run -d --name "$cid" --entrypoint=sleep --security-opt seccomp=unconfined \
        "batchpilot.local/kind-base:$KEY" infinity >/dev/null
    # shellcheck disable=SC2064
    trap "docker rm -f -v $cid >/dev/null 2>&1 || true" RETURN
    local x=(docker exec "$cid")
    "${x[@]}" bash -c 'nohup containerd >/var/log/containerd-build.log 2>&1 & echo $! >/run/ctrd.pid'
    "${x[@]}" bash -c 'for i in $(seq 60); do [ -S /run/containerd/containerd.sock ] && ctr version >/dev/null 2>&1 && exit 0; sleep 0.5; done; exit 1'
    local t img
    for t in "$WORK"/images/*.tar; do
        docker exec -i "$cid" ctr --namespace=k8s.io images import --all-platforms --no-unpack \
            --digests - <"$t" >/dev/null
    done
    # Pinned images survive the kubelet's image garbage collection.
    for img in $("${x[@]}" ctr --namespace=k8s.io images list -q); do
        "${x[@]}" ctr --namespace=k8s.io images label "$img" io.cri-containerd.pinned=pinned >/dev/null
    done
    local have missing=()
    have="$("${x[@]}" ctr --namespace=k8s.io images list -q)"
    for img in $("${x[@]}" kubeadm config images list --kubernetes-version "$K8S_VERSION" 2>/dev/null); do
        grep -qx "$img" <<<"$have" || missing+=("$img")
    done
    if ((${#missing[@]})); then
        log "ERROR: images kubeadm expects are missing: ${missing[*]} (fix versions.env)"
        return 1
    fi
    "${x[@]}" bash -c 'kill $(cat /run/ctrd.pid); for i in $(seq 40); do kill -0 $(cat /run/ctrd.pid) 2>/dev/null || break; sleep 0.5; done; rm -f /run/ctrd.pid /var/log/containerd-build.log'
    docker commit --change 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]' \
        --change 'ENV HTTP_PROXY="" HTTPS_PROXY="" NO_PROXY=""' "$cid" "$NODE_IMAGE" >/dev/null
    rm -rf "$WORK"
    log "saving $NODE_TGZ"
    rm -f "$ROOT"/node-*.tar.gz
    docker save "$NODE_IMAGE" | gzip -1 >"$NODE_TGZ.tmp" && mv -f "$NODE_TGZ.tmp" "$NODE_TGZ"
}

stage_node() {
    if docker image inspect "$NODE_IMAGE" >/dev/null 2>&1; then
        log "node image $NODE_IMAGE: present"
    elif [[ -f "$NODE_TGZ" ]]; then
        timed node-image-load docker load -i "$NODE_TGZ"
    else
        stage_bins
        stage_rootfs
        timed node-images images
        timed node-base-image base_image
        timed node-image node_image
        # The base and component images live on inside the node image only.
        docker rmi "batchpilot.local/kind-base:$KEY" "batchpilot.local/kind-iptables:$KEY" >/dev/null 2>&1 || true
        docker images --format '{{.Repository}}:{{.Tag}}' | grep '^registry.k8s.io/' |
            xargs -r docker rmi >/dev/null 2>&1 || true
    fi
}

stages=("$@")
((${#stages[@]})) || stages=(node)
for s in "${stages[@]}"; do
    case "$s" in
    bins) stage_bins ;;
    rootfs) stage_rootfs ;;
    node) stage_node ;;
    key) ;;
    *)
        log "unknown stage $s (bins, rootfs, node, key)"
        exit 2
        ;;
    esac
done
echo "$NODE_IMAGE"
