"""The EPP and pickclient end to end without kind (a developer's check, not a test file):

- the loopback control plane of the cluster tier (tests/k8s/cluster.py; `make k8s-bins`) with
  GIE's InferencePool CRD;
- two Pod objects whose status says Ready at 127.0.0.2 and 127.0.0.3 (nothing runs them; a fake
  vLLM /metrics answers on :8000 at each address) and an InferencePool selecting them;
- manifests.py's ServiceAccount, Role and RoleBinding; the EPP binary run here, as that
  ServiceAccount (its token), with manifests.py's flags and config;
- pickclient: the picks must go to the unloaded pod, then follow the load to the other.

    .venv/bin/python kind-tests/gie/smoke_local.py      (after kind-tests/gie/build.sh)

Needs the ports 9002, 9003, 9090 and 127.0.0.2-3:8000 free. Exit status 0 when the picks
followed the load; the EPP's log is left in a temporary file (printed).
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO / "tests" / "k8s"), str(HERE)]
import cluster as k8s  # noqa: E402
import manifests  # noqa: E402

NS, POOL, MODEL = "gie-smoke", "smol", "smol"
RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
LOAD = {"127.0.0.2": (0, 0.0), "127.0.0.3": (0, 0.0)}  # address -> (waiting, KV usage)


def bin_dir() -> Path:
    return k8s.cache_root() / "gie" / k8s.versions()["GIE_VERSION"] / "bin"


class FakeVllmMetrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        waiting, kv = LOAD[self.server.server_address[0]]
        lines = [
            f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {waiting}',
            f'vllm:num_requests_running{{model_name="{MODEL}"}} 1',
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} {kv}',
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1',
        ]
        body = "".join(f"# TYPE {line.split('{')[0]} gauge\n{line}\n" for line in lines).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def cluster_objects() -> list[dict]:
    items: list[dict] = [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "static"}}]
    for i in range(len(LOAD)):
        items.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{POOL}-{i}", "namespace": NS, "labels": {"app": POOL}},
                "spec": {
                    "nodeName": "static",  # no kubelet or kwok: the status is ours to write
                    "securityContext": RESTRICTED_POD,
                    "containers": [
                        {
                            "name": "s",
                            "image": "none",
                            "ports": [{"containerPort": 8000}],
                            "securityContext": RESTRICTED_CONTAINER,
                        }
                    ],
                },
            }
        )
    items.append(
        {
            "apiVersion": f"{manifests.POOL_GROUP}/v1",
            "kind": "InferencePool",
            "metadata": {"name": POOL, "namespace": NS},
            "spec": {
                "selector": {"matchLabels": {"app": POOL}},
                "targetPorts": [{"number": 8000}],
                "endpointPickerRef": {
                    "name": manifests.epp_name(POOL),
                    "port": {"number": manifests.GRPC_PORT},
                },
            },
        }
    )
    rbac = ("ServiceAccount", "Role", "RoleBinding")
    objects = manifests.epp_objects(NS, POOL, "unused")
    return items + [o for o in objects if o["kind"] in rbac]


def setup(c) -> Path:
    """The objects, the pods' Ready status, and a kubeconfig of the EPP's ServiceAccount."""
    c.run_kubectl("apply", "--server-side", "-f", str(k8s.gie_crd()))
    c.run_kubectl(
        "wait", "--for=condition=Established", "crd/inferencepools.inference.networking.k8s.io"
    )
    namespace = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": NS, "labels": {"pod-security.kubernetes.io/enforce": "restricted"}},
    }
    c.run_kubectl("apply", "-f", "-", input=json.dumps(namespace))
    items = {"apiVersion": "v1", "kind": "List", "items": cluster_objects()}
    c.run_kubectl("apply", "-f", "-", input=json.dumps(items))
    # The whole of manifests.py through admission (the EPP's pod under Pod Security
    # "restricted"), without running it: this script runs the binary itself.
    objects = manifests.epp_objects(NS, POOL, "batchpilot-gie-epp:test")
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "epp-dry-run", "namespace": NS},
        "spec": deployment["spec"]["template"]["spec"],
    }
    dry = {"apiVersion": "v1", "kind": "List", "items": [*objects, pod]}
    c.run_kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(dry))
    for i, ip in enumerate(LOAD):
        ready = [{"type": "Ready", "status": "True"}]
        status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "conditions": ready}
        c.run_kubectl(
            "patch", "pod", f"{POOL}-{i}", "-n", NS, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": status}),
        )  # fmt: skip
    token = c.run_kubectl("create", "token", manifests.epp_name(POOL), "-n", NS).stdout.strip()
    kubeconfig = c.workdir / "epp.kubeconfig"
    cluster = {"server": c.server, "certificate-authority": c.ca_file}
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "epp",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "epp", "user": {"token": token}}],
                "contexts": [{"name": "epp", "context": {"cluster": "c", "user": "epp"}}],
            }
        )
    )
    return kubeconfig


def epp_metrics() -> str:
    url = f"http://127.0.0.1:{manifests.METRICS_PORT}/metrics"
    try:
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return ""
    return "\n".join(line for line in text.splitlines() if line.startswith("inference_pool_"))


def picks(n: int) -> list[str]:
    out = subprocess.run(
        [str(bin_dir() / "pickclient"), f"--addr=127.0.0.1:{manifests.GRPC_PORT}",
         f"--model={MODEL}", f"--count={n}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    got = [json.loads(line) for line in out.stdout.splitlines()]
    print(f"  pickclient exit {out.returncode}: {got}")
    return [g.get("endpoint", "error") for g in got]


def check(kubeconfig: Path) -> bool:
    log = Path(tempfile.mkstemp(prefix="gie-smoke-epp-", suffix=".log")[1])
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "NAMESPACE": NS, "POD_NAME": "smol-epp-0-0"}
    args = manifests.epp_args(NS, POOL, verbosity=int(os.environ.get("EPP_V", "4")))
    with open(log, "w") as f:
        epp = subprocess.Popen([str(bin_dir() / "epp"), *args], stdout=f, stderr=f, env=env)
    try:
        wait(lambda: epp_metrics().count("inference_pool_per_pod_queue_size{") == len(LOAD), 60)
        print(epp_metrics())
        ok = True
        for busy, idle in (("127.0.0.2", "127.0.0.3"), ("127.0.0.3", "127.0.0.2")):
            LOAD.update({busy: (5, 0.8), idle: (0, 0.1)})
            time.sleep(1)  # the EPP scrapes every 50 ms
            print(f"{busy} loaded (5 waiting, KV 0.8), {idle} idle:")
            ok &= set(picks(5)) == {f"{idle}:8000"}
        LOAD.update({a: (0, 0.5) for a in LOAD})
        time.sleep(1)
        print("equal load (random among ties):")
        ok &= "error" not in picks(8)
        time.sleep(6)  # the pool gauges refresh every 5 s
        print(epp_metrics())
        return ok
    finally:
        epp.terminate()
        epp.wait(15)
        print(f"EPP log: {log}")


def wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the EPP did not report both pods")
        time.sleep(1)


def main() -> int:
    for address in LOAD:
        server = http.server.ThreadingHTTPServer((address, 8000), FakeVllmMetrics)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    c = k8s.start_cluster(nodes=1)
    try:
        ok = check(setup(c))
    finally:
        c.stop()
    print("OK: the picks followed the load" if ok else "FAILED: the picks did not follow the load")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
