#!/usr/bin/python3
"""OCI runtime shim for hosts whose capability bounding set is narrower than runc assumes.

Some VMs (Firecracker guests, nested containers) lack e.g. CAP_SYS_RESOURCE in the bounding
set, so `docker run --privileged` and `docker exec` into a privileged container fail with
"unable to apply caps: operation not permitted". This shim removes from the OCI spec every
capability the host cannot grant, then execs the real runc. It edits the bundle's config.json
for create/run and the --process file for exec (kind drives everything through `docker exec`).

Installed by kind-tests/host-setup.sh only when the bounding set is missing capabilities.
"""

import json
import os
import sys

REAL_RUNC = os.environ.get("BATCHPILOT_REAL_RUNC", "/usr/sbin/runc")
# Linux capability numbers (include/uapi/linux/capability.h), 0..40.
NAMES = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
]


def bounding_set() -> set[str]:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapBnd:"):
                mask = int(line.split()[1], 16)
                return {"CAP_" + n for i, n in enumerate(NAMES) if mask >> i & 1}
    return {"CAP_" + n for n in NAMES}


def strip(path: str, nested: bool) -> None:
    try:
        with open(path) as f:
            spec = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return
    allowed = bounding_set()
    proc = spec.get("process", {}) if nested else spec
    caps = proc.get("capabilities") or {}
    for kind, names in caps.items():
        caps[kind] = [c for c in names if c in allowed]
    with open(path, "w") as f:
        json.dump(spec, f)


def main(args: list[str]) -> None:
    if "create" in args or "run" in args:
        bundle = "."
        for flag in ("--bundle", "-b"):
            if flag in args and args.index(flag) + 1 < len(args):
                bundle = args[args.index(flag) + 1]
        strip(os.path.join(bundle, "config.json"), nested=True)
    elif "exec" in args:
        for i, a in enumerate(args):
            if a in ("--process", "-p") and i + 1 < len(args):
                strip(args[i + 1], nested=False)
            elif a.startswith("--process="):
                strip(a.split("=", 1)[1], nested=False)
    os.execv(REAL_RUNC, ["runc", *args])


if __name__ == "__main__":
    main(sys.argv[1:])
