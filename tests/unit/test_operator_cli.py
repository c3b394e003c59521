"""`batchpilot operator`: stays slim (no torch, transformers, triton), validates its flags,
and takes its defaults from flags over the environment."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from batchpilot.cli import main
from batchpilot.operator.config import DEFAULT_SERVER_IMAGE, MIN_ADMIN_KEY_CHARS, OperatorConfig

HEAVY = ("torch", "transformers", "triton")


def test_operator_imports_no_heavy_modules_in_a_fresh_interpreter():
    code = (
        "import sys\n"
        "import batchpilot.operator.handlers, batchpilot.operator.cli\n"
        "import batchpilot.operator.crd.manifests\n"
        "from batchpilot.cli import build_parser\n"
        "build_parser(['operator']).parse_args(['operator', '-A'])\n"
        "from batchpilot.operator.handlers import make_registry\n"
        "from batchpilot.operator.config import OperatorConfig\n"
        "make_registry(OperatorConfig())\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_scope_is_required_and_exclusive(capsys):
    assert main(["operator"]) == 2
    assert "-A/--all-namespaces or -n/--namespace" in capsys.readouterr().err
    assert main(["operator", "-A", "-n", "x"]) == 2
    assert main(["operator", "-A", "--standalone", "--peering", "p"]) == 2


def test_config_defaults_env_and_flags(monkeypatch):
    for var in ("BATCHPILOT_SERVER_IMAGE", "BATCHPILOT_RECONCILE_INTERVAL"):
        monkeypatch.delenv(var, raising=False)
    assert OperatorConfig.from_env() == OperatorConfig()
    assert OperatorConfig().server_image == DEFAULT_SERVER_IMAGE
    monkeypatch.setenv("BATCHPILOT_SERVER_IMAGE", "env/img:2")
    monkeypatch.setenv("BATCHPILOT_RECONCILE_INTERVAL", "7.5")
    cfg = OperatorConfig.from_env()
    assert (cfg.server_image, cfg.reconcile_interval) == ("env/img:2", 7.5)
    cfg = OperatorConfig.from_env(server_image="flag/img:3", reconcile_interval=None)
    assert (cfg.server_image, cfg.reconcile_interval) == ("flag/img:3", 7.5)
    monkeypatch.setenv("BATCHPILOT_RECONCILE_INTERVAL", "0")
    with pytest.raises(ValueError, match="reconcile_interval"):
        OperatorConfig.from_env()


def test_crds_print(capsys):
    assert main(["operator", "crds"]) == 0
    out = capsys.readouterr().out
    assert "name: inferenceservices.batchpilot.dev" in out and "kopfpeerings.kopf.dev" in out


def test_kopf_settings():
    import kopf

    from batchpilot.operator.handlers import configure_settings

    settings = kopf.OperatorSettings()
    configure_settings(settings, OperatorConfig())
    assert settings.watching.server_timeout < settings.watching.client_timeout
    assert settings.watching.connect_timeout and settings.networking.request_timeout
    assert settings.persistence.finalizer == "batchpilot.dev/operator"
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)


def test_liveness_flag():
    from batchpilot.cli import build_parser

    def parse(*argv):
        return build_parser(["operator"]).parse_args(["operator", "-A", *argv]).liveness

    assert parse() is None
    assert parse("--liveness") == "http://0.0.0.0:8080/healthz"
    assert parse("--liveness", "http://127.0.0.1:9/healthz") == "http://127.0.0.1:9/healthz"


def test_loop_flags_and_environment(monkeypatch):
    from batchpilot.cli import build_parser
    from batchpilot.operator.cli import config_from_args

    monkeypatch.setenv("BATCHPILOT_METRICS_URLS", "http://127.0.0.1:1, http://127.0.0.1:2")
    monkeypatch.setenv("BATCHPILOT_LOOP_INTERVAL", "5")
    cfg = OperatorConfig.from_env()
    assert cfg.metrics_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert cfg.loop_interval == 5
    args = build_parser(["operator"]).parse_args(
        ["operator", "-A", "--metrics-urls", "http://h:9,http://h:10", "--loop-interval", "2"]
    )
    cfg = config_from_args(args)
    assert cfg.metrics_urls == ["http://h:9", "http://h:10"] and cfg.loop_interval == 2


def test_admin_urls_pair_with_metrics_urls():
    """Each replica's admin API has its own port: given per metrics URL, or that URL's host
    on the admin port (8001)."""
    import pytest
    from pydantic import ValidationError

    from batchpilot.cli import build_parser
    from batchpilot.operator.cli import config_from_args
    from batchpilot.operator.loop.scrape import UrlMetricsSource, on_port

    args = build_parser(["operator"]).parse_args(
        ["operator", "-A", "--metrics-urls", "http://h:9,http://h:10",
         "--admin-urls", "http://h:19,http://h:20"]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert UrlMetricsSource(cfg.metrics_urls, cfg.admin_urls).urls == {
        "http://h:9": "http://h:19",
        "http://h:10": "http://h:20",
    }
    assert UrlMetricsSource(["http://h:9", "http://[fd00::1]:8000"]).urls == {
        "http://h:9": "http://h:8001",
        "http://[fd00::1]:8000": "http://[fd00::1]:8001",
    }
    assert on_port("http://10.0.0.1:8000", 8001) == "http://10.0.0.1:8001"
    with pytest.raises(ValidationError, match="one URL per metrics URL"):
        OperatorConfig(metrics_urls=["http://a:1", "http://b:1"], admin_urls=["http://a:2"])


def test_admin_key_comes_from_the_environment_only(monkeypatch):
    from batchpilot.cli import build_parser

    key = "k3y" * 11  # MIN_ADMIN_KEY_CHARS and more
    monkeypatch.setenv("BATCHPILOT_ADMIN_KEY", key)
    assert OperatorConfig.from_env().admin_key.get_secret_value() == key
    assert "k3y" not in repr(OperatorConfig.from_env())
    help_text = build_parser(["operator"]).format_help() + str(
        build_parser(["operator"])._subparsers._group_actions[0].choices["operator"].format_help()
    )
    assert "--admin-key" not in help_text


def test_a_short_admin_key_is_refused_without_being_shown(monkeypatch, capsys):
    """At start-up, before anything runs: one tenant's token must not give the key away."""
    short = "s3cret-" + "x" * (MIN_ADMIN_KEY_CHARS - 8)
    with pytest.raises(ValidationError) as e:
        OperatorConfig(admin_key=short)
    assert short not in str(e.value)
    assert OperatorConfig(admin_key=short + "x").admin_key.get_secret_value() == short + "x"
    monkeypatch.setenv("BATCHPILOT_ADMIN_KEY", short)
    assert main(["operator", "-A"]) == 2
    err = capsys.readouterr().err
    assert (
        f"admin_key: BATCHPILOT_ADMIN_KEY is shorter than {MIN_ADMIN_KEY_CHARS} characters" in err
    )
    assert "s3cret" not in err


def test_liveness_port_serves_the_operators_metrics():
    import asyncio

    import aiohttp

    from batchpilot.operator import probes
    from batchpilot.server.bench.server_process import free_port

    port = free_port()
    probes.DECISIONS.labels("team-a", "chat", "raise", "keep").inc()
    probes.DESIRED_REPLICAS.labels("team-a", "chat").set(3)

    async def fetch() -> tuple[int, int, str]:
        runner = await probes.serve(f"http://127.0.0.1:{port}/healthz")
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/healthz") as health:
                    health_status = health.status
                async with session.get(f"http://127.0.0.1:{port}/metrics") as metrics:
                    return health_status, metrics.status, await metrics.text()
        finally:
            await runner.cleanup()

    health, status, text = asyncio.run(fetch())
    assert (health, status) == (200, 200)
    assert (
        'batchpilot_operator_decisions_total{kind="raise",name="chat",namespace="team-a",outcome="keep"}'
        in text
    )
    assert 'batchpilot_operator_desired_replicas{name="chat",namespace="team-a"} 3.0' in text
    assert "batchpilot_operator_scrape_failures_total" in text.replace("# HELP ", "")
