"""Prefix-aware routing on real pods in kind (issue 34): one InferenceService of 2 CPU
replicas of the bundled model, a shared-prefix chat workload sent three ways, interleaved:

- ``service``: through the plain Service (kube-proxy picks a pod per connection);
- ``picker``: through GIE's endpoint picker (EPP v1.5.0) with the prefix scorer off
  (``scorers.prefixCache.weight: 0``: queue and KV-cache utilisation only);
- ``prefix``: through the EPP with GIE's approximate ``prefix-cache-scorer`` on.

The EPP is the one the operator deploys (``spec.routing.endpointPicker.deploy``); between
the picker and prefix runs the weight is patched and the operator rolls it. No Gateway can
be built here, so ``pickclient --listen`` (kind-tests/gie/pickclient) stands in for one: it
asks the EPP over ext_proc, as Envoy does, and forwards each request to the picked pod.
The load comes from a pod in the cluster (benchmarks/prefix_routing_client.py); the
prefix-cache hit rate from the replicas' own vllm:prefix_cache_hits / _queries counters.

    .venv/bin/python -m benchmarks.prefix_routing            # ~25 min on 2 busy cores

Reuses the kind tier's cluster (kind-tests/cluster.sh: created if missing, kept after) and
its locally built images (make kind-images kind-gie); builds nothing, pulls nothing.
Writes benchmarks/results/prefix-routing-<YYYYMMDD>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.kind import (  # noqa: E402
    CACHE,
    CLUSTER,
    K8S_VERSION,
    OPERATOR_IMAGE,
    POLL,
    SERVER_IMAGE,
    SERVICE,
    Kind,
    cpu_sample,
    install_operator,
    is_ready,
    patch_spec,
    run,
)
from tests.support.wait import wait_for  # noqa: E402

GIE_VERSION = re.search(
    r"^GIE_VERSION=(\S+)", (REPO / "tests/k8s/versions.env").read_text(), re.M
).group(1)
EPP_IMAGE = f"batchpilot-gie-epp:{GIE_VERSION}"
PICKCLIENT_IMAGE = f"batchpilot-gie-pickclient:{GIE_VERSION}"
POOL_CRD = (
    CACHE / "k8s" / K8S_VERSION / "crds" / f"gie-{GIE_VERSION}"
    / "inference.networking.k8s.io_inferencepools.yaml"
)  # fmt: skip
MODEL = "smollm2-135m-instruct"
PICKER = f"{SERVICE}-epp"  # the operator's name for the deployed picker
GATEWAY, GATEWAY_PORT = "gateway", 8080
WAYS = ("service", "picker", "prefix")
PREFIX_WEIGHT = 3  # GIE's default weight for the prefix-cache scorer
CLIENT_SOURCE = (Path(__file__).parent / "prefix_routing_client.py").read_text()

# Words of the system prompts (~1.08 tokens each with SmolLM2's tokenizer) and the questions.
WORDS = [
    "the",
    "service",
    "answers",
    "questions",
    "about",
    "orders",
    "shipping",
    "returns",
    "billing",
    "accounts",
    "products",
    "warranty",
    "repairs",
    "delivery",
    "customers",
    "policy",
    "support",
    "refunds",
    "invoices",
    "tracking",
    "address",
    "payment",
    "card",
    "discount",
    "coupon",
    "store",
    "online",
    "hours",
    "contact",
    "email",
    "phone",
    "agent",
    "always",
    "never",
    "please",
    "check",
    "confirm",
    "explain",
    "politely",
    "briefly",
    "clearly",
    "before",
    "after",
    "when",
]
QUESTIONS = (
    "Where is my order?", "How do I return a product?", "Can I change my address?",
    "When will my refund arrive?", "Is there a warranty on repairs?", "How do I use a coupon?",
    "What are your store hours?", "Can I pay by card?", "How do I track a delivery?",
    "Who do I contact about billing?", "Can you explain the policy?", "Is shipping free?",
)  # fmt: skip


# --- the workload ------------------------------------------------------------------------


def system_prompts(run_id: str, groups: int, tokens: int, seed: int) -> list[str]:
    """One system prompt per group, ~tokens tokens, unique to the run from its first
    characters on (no run finds another's blocks cached, in a replica or in the EPP)."""
    rng = random.Random(seed)
    words = round(tokens / 1.08)
    return [
        f"[{run_id}/{g}] You are the support assistant of shop {g}. "
        + " ".join(rng.choice(WORDS) for _ in range(words))
        for g in range(groups)
    ]


def conversations(count: int, groups: int, rate: float, turns: tuple[int, int], seed: int):
    """Open-loop Poisson arrivals (rate conversations/s), groups in a shuffled rotation,
    turns uniform in [lo, hi]. The same seed gives the same schedule: each round's three
    runs (one per way) share it."""
    rng = random.Random(seed)
    order = [i % groups for i in range(count)]
    rng.shuffle(order)
    start, out = 0.0, []
    for group in order:
        n = rng.randint(*turns)
        out.append({"start": round(start, 3), "group": group,
                    "questions": rng.sample(QUESTIONS, n)})  # fmt: skip
        start += rng.expovariate(rate)
    return out


# --- the cluster -------------------------------------------------------------------------


def node_has_image(image: str) -> bool:
    """Does the kind node's containerd already hold this Docker image (its config digest)?
    kind load re-imports a 4 GB image otherwise (the node has no crictl)."""
    image_id = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", image],
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
    name = image if "/" in image else f"docker.io/library/{image}"
    ls = subprocess.run(
        ["docker", "exec", f"{CLUSTER}-control-plane", "ctr", "-n", "k8s.io", "images", "ls",
         f"name=={name}"], capture_output=True, text=True,
    ).stdout.splitlines()[1:]  # fmt: skip
    if not image_id or not ls:
        return False
    digest = ls[0].split()[2]
    manifest = subprocess.run(
        ["docker", "exec", f"{CLUSTER}-control-plane", "ctr", "-n", "k8s.io", "content", "get",
         digest], capture_output=True, text=True,
    ).stdout  # fmt: skip
    try:
        return json.loads(manifest)["config"]["digest"] == image_id
    except (ValueError, KeyError):
        return False


def load_images(images: tuple[str, ...]) -> None:
    for image in images:
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
            raise SystemExit(f"{image} is not built: make kind-images kind-gie")
        if not node_has_image(image):
            run("kind", "load", "docker-image", image, "--name", CLUSTER, timeout=1800)


def cluster() -> Kind:
    """The kind tier's cluster, created when missing (never deleted here)."""
    out = run("bash", str(REPO / "kind-tests" / "cluster.sh"), "create", CLUSTER, timeout=3600)
    kubeconfig = Path(out.stdout.strip().splitlines()[-1])
    return Kind(kubeconfig, kubeconfig.parent)


def gateway_objects(namespace: str) -> list[dict]:
    """pickclient --listen in front of the operator's EPP: the stand-in gateway."""
    labels = {"app.kubernetes.io/name": GATEWAY}
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": GATEWAY, "namespace": namespace, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{
                        "name": GATEWAY, "image": PICKCLIENT_IMAGE,
                        "imagePullPolicy": "IfNotPresent",
                        "args": ["--listen", f":{GATEWAY_PORT}", "--addr", f"{PICKER}:9002", "--tls",
                                 "--timeout", "30s"],
                        "ports": [{"name": "http", "containerPort": GATEWAY_PORT}],
                        "readinessProbe": {"httpGet": {"path": "/healthz", "port": GATEWAY_PORT},
                                           "periodSeconds": 2},
                        "resources": {"requests": {"cpu": "50m", "memory": "32Mi"}},
                    }]},
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": GATEWAY, "namespace": namespace, "labels": labels},
            "spec": {"selector": labels,
                     "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http"}]},
        },
    ]  # fmt: skip


def service_spec(namespace: str, prefix_weight: int, kv_cache_memory: str | None) -> dict:
    """The CPU sample with 2 replicas, the InferencePool and the operator's EPP."""
    sample = cpu_sample(namespace)
    sample["spec"]["replicas"] = 2
    if kv_cache_memory:
        sample["spec"]["engine"]["extraArgs"] = [f"--kv-cache-memory={kv_cache_memory}"]
    sample["spec"]["routing"] = {
        "inferencePool": True,
        "endpointPicker": {
            "deploy": True,
            "image": EPP_IMAGE,
            "imagePullPolicy": "IfNotPresent",
            "scorers": {"prefixCache": {"weight": prefix_weight, "mode": "approximate"}},
        },
    }
    return sample


def server_pods(kind: Kind, namespace: str) -> dict[str, str]:
    """Ready server pods: IP -> name."""
    # The server's selector (status.selector): the picker's pods carry the service label too.
    selector = f"app.kubernetes.io/name=batchpilot-server,batchpilot.dev/service={SERVICE}"
    pods = kind.get("pods", "-n", namespace, "-l", selector)["items"]
    return {p["status"]["podIP"]: p["metadata"]["name"] for p in pods if is_ready(p)}


def deployment_ready(kind: Kind, namespace: str, name: str, want: int = 1) -> bool:
    dep = kind.get("deployment", name, "-n", namespace)
    st = dep.get("status", {})
    return (
        st.get("observedGeneration", 0) >= dep["metadata"]["generation"]
        and st.get("updatedReplicas", 0) == want
        and st.get("readyReplicas", 0) == want
        and st.get("replicas", 0) == want
    )


def picker_weight(kind: Kind, namespace: str) -> int | None:
    """The prefix scorer's weight in the running picker's config (None: not rendered)."""
    cm = kind.get("configmap", PICKER, "-n", namespace)
    text = cm["data"]["epp.yaml"]
    m = re.search(r"pluginRef: prefix-cache-scorer\n\s+weight: (\d+)", text)
    return int(m.group(1)) if m else None


def set_prefix_weight(kind: Kind, namespace: str, weight: int, timeout: float = 300) -> None:
    """Patch scorers.prefixCache.weight; wait for the operator's config and the rolled EPP."""
    want = weight or None
    if picker_weight(kind, namespace) != want:
        patch_spec(kind, namespace, {"routing": {"endpointPicker": {
            "scorers": {"prefixCache": {"weight": weight}}}}})  # fmt: skip
        wait_for(f"the picker's config with prefix weight {weight}",
                 lambda: picker_weight(kind, namespace) == want, timeout, interval=POLL)  # fmt: skip
    wait_for("the picker rolled and Ready", lambda: deployment_ready(kind, namespace, PICKER),
             timeout, interval=POLL)  # fmt: skip


def deploy(kind: Kind, namespace: str, prefix_weight: int, kv_cache_memory: str | None,
           timeout: float = 900) -> dict[str, str]:  # fmt: skip
    """The InferencePool CRD, the service (2 Ready replicas), its EPP and the gateway."""
    kind.kubectl("apply", "--server-side", "-f", str(POOL_CRD))
    kind.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                 "crd/inferencepools.inference.networking.k8s.io")  # fmt: skip
    kind.apply(service_spec(namespace, prefix_weight, kv_cache_memory))
    kind.apply(*gateway_objects(namespace))
    wait_for("2 Ready server pods", lambda: len(server_pods(kind, namespace)) == 2, timeout,
             interval=3)  # fmt: skip
    wait_for("the picker Ready", lambda: deployment_ready(kind, namespace, PICKER), timeout,
             interval=POLL)  # fmt: skip
    wait_for("the gateway Ready", lambda: deployment_ready(kind, namespace, GATEWAY), timeout,
             interval=POLL)  # fmt: skip
    return server_pods(kind, namespace)


def run_client(kind: Kind, namespace: str, cfg: dict, timeout: float) -> dict:
    """One run: a pod of the operator image runs the client; its last log line is the result."""
    name = f"load-{uuid.uuid4().hex[:6]}"
    kind.apply({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "load", "image": OPERATOR_IMAGE, "imagePullPolicy": "Never",
            "command": ["python3", "-c", CLIENT_SOURCE, json.dumps(cfg)],
        }]},
    })  # fmt: skip
    try:
        phase = wait_for(
            f"the load pod {name} to finish",
            lambda: kind.get("pod", name, "-n", namespace)["status"].get("phase")
            in ("Succeeded", "Failed") and kind.get("pod", name, "-n", namespace)["status"]["phase"],
            timeout, interval=POLL,
        )  # fmt: skip
        logs = kind.kubectl("logs", "-n", namespace, name).stdout
        if phase != "Succeeded":
            raise AssertionError(f"the load pod {name} failed:\n{logs[-4000:]}")
        return json.loads(logs.strip().splitlines()[-1])
    finally:
        kind.kubectl("delete", "pod", name, "-n", namespace, "--wait=false")


def warm_gateway(kind: Kind, namespace: str, pods: dict[str, str], timeout: float = 180):
    """A tiny request through the gateway until one is answered (the EPP just rolled)."""
    cfg = {"url": f"http://{GATEWAY}:{GATEWAY_PORT}", "model": MODEL, "pods": list(pods),
           "systems": ["Be brief."], "max_tokens": 1, "timeout": 60,
           "conversations": [{"start": 0, "group": 0, "questions": ["Hi"]}]}  # fmt: skip

    def answered() -> bool:
        out = run_client(kind, namespace, cfg, 300)
        return all("error" not in r for r in out["requests"])

    wait_for("a request answered through the gateway", answered, timeout, interval=3)


# --- figures -----------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100)."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, -(-len(s) * q // 100) - 1))] if s else float("nan")


def summarize(out: dict) -> dict:
    reqs = out["requests"]
    ok = [r for r in reqs if "error" not in r and "first" in r]
    ttft = [r["first"] - r["sent"] for r in ok]
    hits = sum(p["hits"] for p in out["pods"].values())
    queries = sum(p["queries"] for p in out["pods"].values())
    span = max((r["done"] for r in ok), default=0) - min((r["sent"] for r in ok), default=0)
    tokens = sum(r.get("output_tokens", 0) for r in ok)
    endpoints: dict[str, int] = {}
    groups: dict[str, dict[str, int]] = {}  # group -> endpoint -> requests
    for r in ok:
        key = (r.get("endpoint") or "").rsplit(":", 1)[0] or "?"
        endpoints[key] = endpoints.get(key, 0) + 1
        g = groups.setdefault(str(r["group"]), {})
        g[key] = g.get(key, 0) + 1
    return {
        "requests": len(reqs),
        "failed": len(reqs) - len(ok),
        "ttft_p50_s": round(percentile(ttft, 50), 3),
        "ttft_p90_s": round(percentile(ttft, 90), 3),
        "hit_rate": round(hits / queries, 4) if queries else None,
        "hit_tokens": hits,
        "query_tokens": queries,
        "output_tok_s": round(tokens / span, 2) if span > 0 else None,
        "span_s": round(span, 1),
        "mean_prompt_tokens": round(statistics.mean(r.get("prompt_tokens", 0) for r in ok), 1)
        if ok else None,
        "per_pod": out["pods"],
        "endpoints": endpoints,
        "group_endpoints": groups,
        "ttft_s": [round(x, 3) for x in ttft],
    }  # fmt: skip


def way_figures(way: str, runs: list[dict]) -> dict:
    """Pooled over the way's runs: TTFTs of every request, hits over queries; output tok/s
    is the runs' mean."""
    ttft = [x for r in runs for x in r["ttft_s"]]
    hits = sum(r["hit_tokens"] for r in runs)
    queries = sum(r["query_tokens"] for r in runs)
    tok = [r["output_tok_s"] for r in runs if r["output_tok_s"]]
    return {
        "way": way,
        "ttft_p50_s": round(percentile(ttft, 50), 3),
        "ttft_p90_s": round(percentile(ttft, 90), 3),
        "hit_rate": round(hits / queries, 4) if queries else None,
        "output_tok_s": round(statistics.mean(tok), 2) if tok else None,
        "requests": sum(r["requests"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "runs": runs,
    }


def run_way(kind: Kind, namespace: str, way: str, pods: dict[str, str], workload: dict,
            round_index: int, timeout: float) -> dict:  # fmt: skip
    """One run of one way: the picker set up for it, then the client's run."""
    if way == "service":
        url = f"http://{SERVICE}:8000"
    else:
        set_prefix_weight(kind, namespace, PREFIX_WEIGHT if way == "prefix" else 0)
        warm_gateway(kind, namespace, pods)
        url = f"http://{GATEWAY}:{GATEWAY_PORT}"
    run_id = f"{round_index}{way[0]}{uuid.uuid4().hex[:4]}"
    cfg = {
        "url": url, "model": MODEL, "pods": list(pods), "max_tokens": workload["max_tokens"],
        "timeout": 600,
        "systems": system_prompts(run_id, workload["groups"], workload["system_tokens"],
                                  seed=1000 + round_index),
        "conversations": conversations(workload["conversations"], workload["groups"],
                                       workload["rate"], tuple(workload["turns"]),
                                       seed=round_index),
    }  # fmt: skip
    started = time.monotonic()
    out = run_client(kind, namespace, cfg, timeout)
    figures = summarize(out)
    figures.update(way=way, round=round_index, wall_s=round(time.monotonic() - started, 1))
    return figures


def machine() -> dict:
    flags = subprocess.run("lscpu | grep Flags", shell=True, capture_output=True, text=True)
    model = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True,
                           text=True)  # fmt: skip
    return {
        "cpu_model": model.stdout.split(":", 1)[-1].strip(),
        "cpu_flags": flags.stdout.split(":", 1)[-1].strip(),
        "nproc": os.cpu_count(),
    }


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def table(ways: list[dict]) -> str:
    lines = ["| way | TTFT P50 (s) | TTFT P90 (s) | hit rate | output tok/s | requests (failed) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for w in ways:
        lines.append(f"| {w['way']} | {w['ttft_p50_s']} | {w['ttft_p90_s']} | {w['hit_rate']} "
                     f"| {w['output_tok_s']} | {w['requests']} ({w['failed']}) |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="runs per way, interleaved")
    ap.add_argument("--groups", type=int, default=6, help="system prompts (shared prefixes)")
    ap.add_argument("--system-tokens", type=int, default=1000, help="tokens per system prompt")
    ap.add_argument("--conversations", type=int, default=18, help="conversations per run")
    ap.add_argument("--turns", type=int, nargs=2, default=(2, 4), help="turns per conversation")
    ap.add_argument("--rate", type=float, default=0.2, help="conversations started per s")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per answer")
    ap.add_argument(
        "--kv-cache-memory",
        default="264MiB",
        help="each replica's KV cache (--kv-cache-memory); '' for the default",
    )
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    ap.add_argument("--keep", action="store_true", help="keep the namespace afterwards")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    workload = {
        "groups": args.groups, "system_tokens": args.system_tokens,
        "conversations": args.conversations, "turns": list(args.turns), "rate": args.rate,
        "max_tokens": args.max_tokens, "kv_cache_memory": args.kv_cache_memory or "default",
        "arrivals": "Poisson (open loop), conversations; turns back to back",
    }  # fmt: skip
    load_start = loadavg()
    kind = cluster()
    load_images((SERVER_IMAGE, OPERATOR_IMAGE, EPP_IMAGE, PICKCLIENT_IMAGE))
    install_operator(kind)
    namespace = f"prefix-bench-{uuid.uuid4().hex[:6]}"
    kind.kubectl("create", "namespace", namespace)
    t0 = time.monotonic()
    try:
        pods = deploy(kind, namespace, PREFIX_WEIGHT, args.kv_cache_memory or None)
        print(f"ready after {time.monotonic() - t0:.0f}s: pods {pods}", flush=True)
        runs: dict[str, list[dict]] = {w: [] for w in args.ways}
        for r in range(args.rounds):
            for way in args.ways:
                fig = run_way(kind, namespace, way, pods, workload, r, timeout=1800)
                assert server_pods(kind, namespace) == pods, "a server pod was replaced"
                runs[way].append(fig)
                print(f"round {r} {way}: hit {fig['hit_rate']} ttft p50 {fig['ttft_p50_s']} "
                      f"p90 {fig['ttft_p90_s']} tok/s {fig['output_tok_s']} "
                      f"failed {fig['failed']}/{fig['requests']} {fig['endpoints']} "
                      f"({fig['wall_s']}s, load {loadavg()[0]})", flush=True)  # fmt: skip
        ways = [way_figures(w, runs[w]) for w in args.ways]
        cache_info = kind.kubectl(
            "exec", "-n", namespace, next(iter(pods.values())), "--", "python3", "-c",
            "import urllib.request as u; print([l for l in u.urlopen("
            "'http://127.0.0.1:8000/metrics').read().decode().splitlines() "
            "if l.startswith('vllm:cache_config_info{')])",
        ).stdout.strip()  # fmt: skip
    finally:
        if not args.keep:
            kind.kubectl("delete", "namespace", namespace, "--wait=false")
    result = {
        "benchmark": "prefix_routing",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cluster": f"kind {CLUSTER}, 1 node; server {SERVER_IMAGE}, EPP {EPP_IMAGE} "
        f"(GIE {GIE_VERSION}), gateway stand-in {PICKCLIENT_IMAGE} (pickclient --listen)",
        "replicas": 2,
        "model": MODEL,
        "cache_config_info": cache_info,
        "workload": workload,
        "machine": machine(),
        "load_average": {"start": load_start, "end": loadavg()},
        "ways": ways,
        "targets": targets(ways),
    }  # fmt: skip
    out = args.out or REPO / "benchmarks" / "results" / (
        f"prefix-routing-{datetime.now(UTC):%Y%m%d}.json"
    )
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(ways))
    print(f"targets: {result['targets']}\nwrote {out}")
    return 0


def ways_by(ways: list[dict], name: str) -> dict | None:
    return next((w for w in ways if w["way"] == name), None)


def targets(ways: list[dict]) -> dict:
    """Issue 34's targets: prefix-aware P90 TTFT at most half the Service's, hit rate 0.8."""
    prefix, service = ways_by(ways, "prefix"), ways_by(ways, "service")
    out = {}
    if prefix and service:
        out["prefix_p90_le_half_service"] = prefix["ttft_p90_s"] <= service["ttft_p90_s"] / 2
    if prefix:
        out["prefix_hit_rate_ge_0_8"] = (prefix["hit_rate"] or 0) >= 0.8
    return out


if __name__ == "__main__":
    sys.exit(main())
