"""The chart's admin key (templates/admin-key-secret.yaml), with the real helm: a render that
cannot look the Secret up (`helm template`, as Argo CD runs it) keeps a given key, the schema
refuses a short one, nothing in the operator's pod template follows the key (a new render
rolls no pod), and helm install, upgrade, uninstall and install again keep the one key."""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path

import pytest
import yaml

from batchpilot.operator.config import MIN_ADMIN_KEY_CHARS

CHART = Path(__file__).resolve().parents[2] / "charts" / "batchpilot"
KEY = "gitops-admin-key-" + "0123456789abcdef" * 2


def render(k8s, *args: str) -> list[dict]:
    out = k8s.run_helm("template", "bp", str(CHART), "--namespace", "batchpilot-system", *args)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def named(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def key_of(secret: dict) -> str:
    return base64.b64decode(secret["data"]["key"]).decode()


def rendered_key(docs: list[dict]) -> str:
    return key_of(named(docs, "Secret", "bp-batchpilot-admin-key"))


def operator_deployment(docs: list[dict]) -> dict:
    return named(docs, "Deployment", "bp-batchpilot")


def test_a_given_key_is_rendered_as_given_and_kept_on_uninstall(k8s):
    docs = render(k8s, "--set", f"operator.adminKey.value={KEY}")
    assert rendered_key(docs) == KEY
    secret = named(docs, "Secret", "bp-batchpilot-admin-key")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert render(k8s, "--set", f"operator.adminKey.value={KEY}") == docs, "no new key"


def test_a_new_render_rolls_no_operator_pod(k8s):
    """Without a key to keep, each `helm template` makes another; the operator's Deployment
    does not follow it (no checksum of the key in its pod template)."""
    first, second = render(k8s), render(k8s)
    assert rendered_key(first) != rendered_key(second)
    assert len(rendered_key(first)) >= MIN_ADMIN_KEY_CHARS
    assert operator_deployment(first) == operator_deployment(second)


@pytest.mark.parametrize(
    "values, needle",
    [
        ([f"operator.adminKey.value={KEY[: MIN_ADMIN_KEY_CHARS - 1]}"], "minLength"),
        ([f"operator.adminKey.value={KEY}", "operator.adminKey.existingSecret=mine"],
         "set existingSecret or value, not both"),
    ],
)  # fmt: skip
def test_a_short_key_or_two_sources_are_refused(k8s, values, needle):
    args = [a for v in values for a in ("--set", v)]
    out = k8s.run_helm("template", "bp", str(CHART), *args, check=False)
    assert out.returncode != 0 and needle in out.stderr, out.stderr


def test_install_upgrade_and_reinstall_keep_the_key(k8s, namespace):
    release = f"key-{uuid.uuid4().hex[:6]}"
    secret = f"{release}-batchpilot-admin-key"
    install = ["--namespace", namespace, "--set", "activator.enabled=false"]

    def key() -> str:
        out = k8s.run_kubectl("get", "secret", secret, "-n", namespace, "-o", "json")
        return key_of(json.loads(out.stdout))

    try:
        k8s.run_helm("install", release, str(CHART), *install)
        first = key()
        assert len(first) == 48
        k8s.run_helm("upgrade", release, str(CHART), *install)
        assert key() == first  # looked up, not made again
        k8s.run_helm("uninstall", release, "--namespace", namespace, "--wait")
        assert key() == first  # kept
        k8s.run_helm("install", release, str(CHART), *install)
        assert key() == first  # adopted again: no service gets a new token
    finally:
        k8s.run_helm("uninstall", release, "--namespace", namespace, "--wait", check=False)
