#!/usr/bin/env bash
# CI provisioning for the kind tier (run as root by .ci/run; never run implicitly on a
# developer machine). Idempotent:
#   - installs Docker's engine, debootstrap and busybox-static from the Debian archive;
#   - only where the capability bounding set lacks capabilities runc asks for (some VMs lack
#     CAP_SYS_RESOURCE): installs kind-tests/host/runc-capfix.py as Docker's default runtime;
#   - starts dockerd when no engine answers.
# Exit 0 with a message (not an error) when it cannot provision (not root, no apt-get): the
# kind tier then skips with its reason.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log() { echo "[host-setup] $*" >&2; }

if [[ $(id -u) != 0 ]]; then log "not root: skipping host provisioning"; exit 0; fi
export DEBIAN_FRONTEND=noninteractive
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
[[ -x /bin/busybox ]] || need+=(busybox-static)
if ((${#need[@]})); then
  if ! command -v apt-get >/dev/null; then log "no apt-get: cannot install ${need[*]}"; exit 0; fi
  log "installing ${need[*]}"
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${need[@]}" iptables ca-certificates >/dev/null
fi

# kind bind-mounts /lib/modules; some VMs have none.
mkdir -p /lib/modules /etc/docker

bnd=$(awk '/^CapBnd:/{print $2}' /proc/self/status)
full=$(( (1 << 41) - 1 ))   # CAP_CHOWN..CAP_CHECKPOINT_RESTORE
want='{}'
if (( (0x$bnd & full) != full )); then
  log "capability bounding set $bnd lacks capabilities: using the runc capfix runtime"
  install -m 0755 "$HERE/host/runc-capfix.py" /usr/local/bin/batchpilot-runc-capfix
  want='{"runtimes":{"capfix":{"path":"/usr/local/bin/batchpilot-runc-capfix"}},"default-runtime":"capfix"}'
fi
restart=0
if [[ "$want" != '{}' && "$(cat /etc/docker/daemon.json 2>/dev/null)" != "$want" ]]; then
  echo "$want" > /etc/docker/daemon.json
  restart=1
fi

if docker info >/dev/null 2>&1; then
  if ((restart)); then
    if [[ -f /var/run/docker.pid ]]; then
      log "daemon.json changed: restarting dockerd"
      kill "$(cat /var/run/docker.pid)"
      for _ in $(seq 60); do docker info >/dev/null 2>&1 || break; sleep 1; done
    else
      log "daemon.json changed but dockerd is not ours to restart"
    fi
  fi
fi
if ! docker info >/dev/null 2>&1; then
  log "starting dockerd (log /var/log/batchpilot-dockerd.log)"
  nohup dockerd >/var/log/batchpilot-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
docker info --format 'docker {{.ServerVersion}} runtime={{.DefaultRuntime}} cgroup v{{.CgroupVersion}}' >&2
