// runc-capfix: installed in the kind node as /usr/local/sbin/runc (ahead of Debian's
// /usr/sbin/runc on containerd's PATH). On hosts whose capability bounding set lacks some
// capabilities (CAP_SYS_RESOURCE on some VMs), runc fails to create privileged containers
// ("unable to apply caps: operation not permitted"). This drops every capability missing
// from the bounding set from the OCI spec (bundle config.json for create/run, the --process
// file for exec), then execs the real runc. Where nothing is missing it changes nothing.
package main

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

const realRunc = "/usr/sbin/runc"

var capNames = strings.Fields(`CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID
SETUID SETPCAP LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK
IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE
SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP
MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF
CHECKPOINT_RESTORE`)

// missing returns the capabilities (CAP_*) absent from this process's bounding set.
func missing() map[string]bool {
	out := map[string]bool{}
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return out
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "CapBnd:") {
			continue
		}
		mask, err := strconv.ParseUint(strings.TrimSpace(strings.TrimPrefix(line, "CapBnd:")), 16, 64)
		if err != nil {
			return out
		}
		for i, n := range capNames {
			if mask>>uint(i)&1 == 0 {
				out["CAP_"+n] = true
			}
		}
	}
	return out
}

// strip edits the JSON file at path in place; nested: the capabilities sit under "process".
func strip(path string, nested bool, drop map[string]bool) {
	data, err := os.ReadFile(path)
	if err != nil {
		return
	}
	var spec map[string]any
	if json.Unmarshal(data, &spec) != nil {
		return
	}
	proc := spec
	if nested {
		p, ok := spec["process"].(map[string]any)
		if !ok {
			return
		}
		proc = p
	}
	caps, ok := proc["capabilities"].(map[string]any)
	if !ok {
		return
	}
	for set, v := range caps {
		list, ok := v.([]any)
		if !ok {
			continue
		}
		kept := []any{}
		for _, c := range list {
			if s, ok := c.(string); !ok || !drop[s] {
				kept = append(kept, c)
			}
		}
		caps[set] = kept
	}
	if out, err := json.Marshal(spec); err == nil {
		_ = os.WriteFile(path, out, 0o600)
	}
}

func has(args []string, word string) bool {
	for _, a := range args {
		if a == word {
			return true
		}
	}
	return false
}

func main() {
	args := os.Args[1:]
	if drop := missing(); len(drop) > 0 {
		switch {
		case has(args, "create") || has(args, "run"):
			bundle := "."
			for i, a := range args {
				if (a == "--bundle" || a == "-b") && i+1 < len(args) {
					bundle = args[i+1]
				} else if strings.HasPrefix(a, "--bundle=") {
					bundle = strings.TrimPrefix(a, "--bundle=")
				}
			}
			strip(filepath.Join(bundle, "config.json"), true, drop)
		case has(args, "exec"):
			for i, a := range args {
				if (a == "--process" || a == "-p") && i+1 < len(args) {
					strip(args[i+1], false, drop)
				} else if strings.HasPrefix(a, "--process=") {
					strip(strings.TrimPrefix(a, "--process="), false, drop)
				}
			}
		}
	}
	err := syscall.Exec(realRunc, append([]string{"runc"}, args...), os.Environ())
	os.Stderr.WriteString("runc-capfix: exec " + realRunc + ": " + err.Error() + "\n")
	os.Exit(127)
}
