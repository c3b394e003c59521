"""How the closed loop reaches each replica's /metrics.

Two metrics sources share one interface (``MetricsSource``): ``PodMetricsSource`` scrapes
every Ready pod of an InferenceService on its pod IP, ``UrlMetricsSource`` a fixed list of
base URLs (tests, benchmarks, servers outside the cluster). Both return one ``Scrape`` per
replica, with where that replica's admin API listens (its own port, apart from /metrics);
a replica that does not answer, or answers more than METRICS_MAX_BYTES, is a ``Scrape``
with an error, never an exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from batchpilot import names
from batchpilot.operator.bounds import METRICS_MAX_BYTES, AnswerTooLarge, clip, read_limited
from batchpilot.operator.children.meta import ADMIN_PORT, PORT, selector_string

# An overloaded replica answers /metrics slowly (a benchmark saw 15 s): a short timeout
# would read a busy replica as a missing one. It bounds the whole answer, body included.
SCRAPE_TIMEOUT_SECONDS = 10.0
# A source keeps one session, and its connections, across turns (ScrapeSession): at the
# 15 s loop interval a replica's connection is reused by its next turn's scrape, not
# opened anew (a session made and closed per turn was 3% of the operator's py-spy samples
# at 1,000 services, the parse 21%). Idle longer than this, a connection is closed.
KEEPALIVE_SECONDS = 30.0


@dataclass(frozen=True)
class Scrape:
    """One replica's answer: its base URL, the base URL of its admin API (None: unknown, so
    the loop cannot tune it) and either the /metrics text or why there is none."""

    url: str
    text: str | None = None
    error: str | None = None
    admin_url: str | None = None


@dataclass(frozen=True)
class Replica:
    """A Ready replica: its name (the pod's; the URL for a fixed list), its base URL and
    its admin API's base URL."""

    name: str
    url: str
    admin_url: str


class MetricsSource(Protocol):
    async def scrape(self, namespace: str, name: str) -> list[Scrape]: ...


class ReplicaSource(MetricsSource, Protocol):
    async def replicas(self, namespace: str, name: str) -> list[Replica]: ...


class ScrapeSession:
    """One aiohttp session per event loop, kept open: keep-alive connections, no limit on
    their number (each turn scrapes its replicas at once; the timer bounds the turns)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            if self._session is not None and not self._session.closed:
                self._session.detach()  # another event loop's (a test's): not ours to close
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS)
            self._session, self._loop = aiohttp.ClientSession(connector=connector), loop
        return self._session


async def scrape_urls(
    urls: Mapping[str, str],
    timeout: float = SCRAPE_TIMEOUT_SECONDS,
    session: ScrapeSession | None = None,
) -> list[Scrape]:
    """GET <url>/metrics for every base URL (-> its admin URL) at once, over ``session``'s
    connections (else a session of its own); errors become Scrape.error."""
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    if session is not None:
        return await _scrape_all(session.get(), urls, client_timeout)
    async with aiohttp.ClientSession() as own:
        return await _scrape_all(own, urls, client_timeout)


async def _scrape_all(
    session: aiohttp.ClientSession, urls: Mapping[str, str], timeout: aiohttp.ClientTimeout
) -> list[Scrape]:
    return list(
        await asyncio.gather(*(_scrape_one(session, u, a, timeout) for u, a in urls.items()))
    )


async def _scrape_one(
    session: aiohttp.ClientSession, url: str, admin_url: str, timeout: aiohttp.ClientTimeout
) -> Scrape:
    try:
        async with session.get(url.rstrip("/") + "/metrics", timeout=timeout) as resp:
            if resp.status != 200:
                return Scrape(url, error=f"HTTP {resp.status}", admin_url=admin_url)
            # Prometheus' text format is UTF-8; the limit is on the bytes, before decoding.
            text = (await read_limited(resp, METRICS_MAX_BYTES)).decode("utf-8")
            return Scrape(url, text=text, admin_url=admin_url)
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, AnswerTooLarge) as e:
        why = clip(f"{type(e).__name__}: {e}".rstrip(": "))
        return Scrape(url, error=why, admin_url=admin_url)


def on_port(url: str, port: int) -> str:
    """The same host on another port: http://h:8000 -> http://h:<port>."""
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return urlunsplit((parts.scheme, f"{host}:{port}", "", "", ""))


class UrlMetricsSource:
    """A fixed list of replica base URLs (http://host:port), whatever the service, with the
    admin API's base URL of each (default: the same host on the admin port)."""

    def __init__(
        self,
        urls: Sequence[str],
        admin_urls: Sequence[str] | None = None,
        timeout: float = SCRAPE_TIMEOUT_SECONDS,
    ):
        admin = admin_urls or [on_port(u, names.DEFAULT_ADMIN_PORT) for u in urls]
        self.urls = dict(zip(urls, admin, strict=True))
        self.timeout = timeout
        self.session = ScrapeSession()

    async def scrape(self, namespace: str, name: str) -> list[Scrape]:
        return await scrape_urls(self.urls, self.timeout, self.session)

    async def replicas(self, namespace: str, name: str) -> list[Replica]:
        return [Replica(u, u, a) for u, a in self.urls.items()]


class PodMetricsSource:
    """In-cluster: every Ready pod of the service, on its pod IP and the server's port.

    ``core`` is a kubernetes ``CoreV1Api``; its synchronous list call runs in a thread so
    the operator's event loop never blocks on the API server."""

    def __init__(self, core: Any, timeout: float = SCRAPE_TIMEOUT_SECONDS):
        self.core = core
        self.timeout = timeout
        self.session = ScrapeSession()

    async def scrape(self, namespace: str, name: str) -> list[Scrape]:
        replicas = await self.replicas(namespace, name)
        urls = {r.url: r.admin_url for r in replicas}
        return await scrape_urls(urls, self.timeout, self.session)

    async def replicas(self, namespace: str, name: str) -> list[Replica]:
        pods = await asyncio.to_thread(
            self.core.list_namespaced_pod,
            namespace,
            label_selector=selector_string(name),
        )
        return [
            Replica(pod, url, on_port(url, ADMIN_PORT)) for pod, url in ready_pods(pods.items, PORT)
        ]


def ready_pods(pods: Iterable[Any], port: int) -> list[tuple[str, str]]:
    """(name, base URL) of pods that are Ready, have an IP and are not terminating."""
    out = []
    for pod in pods:
        status = pod.status
        if pod.metadata.deletion_timestamp or not status or not status.pod_ip:
            continue
        ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
        if ready:
            host = f"[{status.pod_ip}]" if ":" in status.pod_ip else status.pod_ip
            out.append((pod.metadata.name, f"http://{host}:{port}"))
    return sorted(out, key=lambda p: p[1])


def ready_pod_urls(pods: Iterable[Any], port: int) -> list[str]:
    """Base URLs of pods that are Ready, have an IP and are not terminating."""
    return [url for _, url in ready_pods(pods, port)]
