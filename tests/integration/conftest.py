"""Fixtures the integration modules share; the helpers behind them are in tests/support/."""

from __future__ import annotations

import pytest

from tests.support.cluster import Api, install_crds
from tests.support.models import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    """A tiny random Llama (tests/support/models.py), made once per module."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def api(k8s, namespace, monkeypatch) -> Api:
    """The CRDs installed, and the operator (kopf's login and our client) pointed at the
    cluster through $KUBECONFIG. test_operator_cluster.py overrides it with its own."""
    install_crds(k8s)
    monkeypatch.setenv("KUBECONFIG", k8s.kubeconfig)
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(var, raising=False)
    return Api(k8s, namespace)
