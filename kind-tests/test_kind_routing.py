"""Prefix-aware routing on real pods (issue 34): the operator deploys GIE's endpoint picker
(EPP v1.5.0) with the approximate prefix-cache scorer for a 2-replica service; a short
shared-prefix chat workload goes once through the plain Service (kube-proxy) and once
through the EPP (pickclient --listen standing in for a gateway), and the replicas' own
prefix-cache counters show the prefix-aware way hitting more than the Service.
benchmarks/prefix_routing.py measures the same on a longer workload, with TTFT.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from benchmarks import prefix_routing as bench
from tests.support.kind import CLUSTER, Kind, run, teardown

pytestmark = pytest.mark.kind

# 3 groups of ~600-token system prompts, 6 conversations of 2-3 turns: ~15 requests a way.
WORKLOAD = {
    "groups": 3,
    "system_tokens": 600,
    "conversations": 6,
    "turns": [2, 3],
    "rate": 0.3,
    "max_tokens": 8,
}


def missing() -> str | None:
    if not bench.POOL_CRD.is_file():
        return f"GIE's InferencePool CRD is not fetched ({bench.POOL_CRD}): make k8s-bins"
    for image in (bench.EPP_IMAGE, bench.PICKCLIENT_IMAGE):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
            return f"the image {image} is not built: make kind-gie"
    return None


@pytest.fixture(scope="module")
def routed(kind: Kind, namespace: str, operator, report) -> Iterator[dict[str, str]]:
    if reason := missing():
        pytest.skip(reason)
    for image in (bench.EPP_IMAGE, bench.PICKCLIENT_IMAGE):
        run("kind", "load", "docker-image", image, "--name", CLUSTER, timeout=600)
    try:
        pods = bench.deploy(kind, namespace, bench.PREFIX_WEIGHT, kv_cache_memory=None)
    except AssertionError as e:
        report(str(e))
    yield pods
    teardown(kind, namespace)
    kind.kubectl("delete", "-f", str(bench.POOL_CRD), "--ignore-not-found", "--wait=true")


def test_prefix_aware_routing_hits_more_than_the_service(kind, namespace, routed, report):
    figures = {}
    for way in ("service", "prefix"):
        try:
            figures[way] = bench.run_way(kind, namespace, way, routed, WORKLOAD, 0, timeout=600)
        except AssertionError as e:
            report(str(e))
        f = figures[way]
        print(f"{way}: hit rate {f['hit_rate']} ({f['hit_tokens']:.0f}/{f['query_tokens']:.0f}"
              f" tokens), TTFT p50 {f['ttft_p50_s']} s p90 {f['ttft_p90_s']} s, "
              f"{f['requests']} requests, per group {f['group_endpoints']}, {f['wall_s']} s")  # fmt: skip
    assert bench.server_pods(kind, namespace) == routed, "a server pod was replaced"
    for way, f in figures.items():
        assert f["failed"] == 0 and f["requests"] >= 12, (way, f)
    # Every request through the EPP went to one of the two replicas.
    assert set(figures["prefix"]["endpoints"]) <= set(routed), figures["prefix"]["endpoints"]
    assert figures["prefix"]["hit_rate"] > figures["service"]["hit_rate"], figures
