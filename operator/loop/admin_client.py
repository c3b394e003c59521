"""The replicas' admin API over HTTP, with the service's bearer token: /admin/config (the
I/O shell the tuner's live changes go through) and vLLM's load/unload_lora_adapter (the
adapter reconcile's); and the public /v1/models, which lists the adapters loaded.

Every answer is read through bounds.read_limited (ADMIN_MAX_BYTES) within the call's total
timeout: a replica that answers more is a failed call, "answer over N bytes"."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable

import aiohttp

from batchpilot.operator.bounds import ADMIN_MAX_BYTES, AnswerTooLarge, clip, read_limited

ADMIN_TIMEOUT_SECONDS = 5.0
# Loading reads the adapter's weights from disk: longer than a config change.
ADAPTER_TIMEOUT_SECONDS = 60.0
PATH = "/admin/config"
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
ADAPTERS_PATH = "/admin/lora_adapters"
ALREADY_LOADED = "has already been loaded"


class AdminError(RuntimeError):
    """A replica refused or did not answer an admin call."""


class AdapterRefused(AdminError):
    """The replica answered and refused (a 4xx): ``status`` its HTTP status, ``message``
    its OpenAI error message (a corrupt or mismatched adapter, requests in flight...). A
    5xx (still loading, draining) is a plain AdminError: it says nothing of the adapter."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def error_message(status: int, body: bytes) -> str:
    """The OpenAI error's message, else the text, clipped: it goes into status and Events."""
    text = body.decode("utf-8", "replace")
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text
    return clip(str(message).strip() or f"HTTP {status}")


class AdminClient:
    def __init__(
        self,
        timeout: float = ADMIN_TIMEOUT_SECONDS,
        adapter_timeout: float = ADAPTER_TIMEOUT_SECONDS,
    ):
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.adapter_timeout = aiohttp.ClientTimeout(total=adapter_timeout)

    async def load_adapter(self, url: str, token: str, name: str, path: str) -> None:
        """Load (idempotent: one already loaded counts as loaded). Raises AdapterRefused
        when the replica refuses it, AdminError when it does not answer."""
        try:
            await self._post(url + LOAD_PATH, token, {"lora_name": name, "lora_path": path})
        except AdapterRefused as e:
            if not (e.status == 400 and ALREADY_LOADED in e.message):
                raise

    async def unload_adapter(self, url: str, token: str, name: str) -> None:
        """Unload (idempotent: 404, not loaded, counts as unloaded). AdapterRefused with 400
        while requests for it are in flight."""
        try:
            await self._post(url + UNLOAD_PATH, token, {"lora_name": name})
        except AdapterRefused as e:
            if e.status != 404:
                raise

    async def list_adapters(self, url: str, token: str) -> dict[str, str] | None:
        """Adapter name -> path from the replica's admin port (the public /v1/models hides
        paths); None when it cannot be read (an older server, a replica starting)."""
        headers = {"Authorization": f"Bearer {token}"}
        try:
            async with (
                aiohttp.ClientSession(timeout=self.timeout) as session,
                session.get(url.rstrip("/") + ADAPTERS_PATH, headers=headers) as resp,
            ):
                if resp.status != 200:
                    return None
                data = json.loads(await read_limited(resp, ADMIN_MAX_BYTES))["data"]
                return {m["id"]: str(m.get("root", "")) for m in data if m.get("parent")}
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return None  # AnswerTooLarge included (a ValueError)

    async def _post(self, url: str, token: str, body: dict) -> None:
        headers = {"Authorization": f"Bearer {token}"}
        try:
            async with (
                aiohttp.ClientSession(timeout=self.adapter_timeout) as session,
                session.post(url, json=body, headers=headers) as resp,
            ):
                answer = await read_limited(resp, ADMIN_MAX_BYTES)
                if 400 <= resp.status < 500:
                    raise AdapterRefused(resp.status, error_message(resp.status, answer))
                if resp.status != 200:  # a 503 while it starts or drains: ask again later
                    message = error_message(resp.status, answer)
                    raise AdminError(clip(f"POST {url}: HTTP {resp.status}: {message}"))
        except (aiohttp.ClientError, TimeoutError, AnswerTooLarge) as e:
            raise AdminError(clip(f"POST {url}: {type(e).__name__}: {e}")) from e

    async def get_config(self, url: str, token: str) -> dict:
        return await self._call("GET", url, token)

    async def patch_config(self, url: str, token: str, changes: dict) -> dict:
        """PATCH live knobs (names.LIVE_KNOBS); the answer is the config now in force."""
        return await self._call("PATCH", url, token, changes)

    async def set_live(
        self, urls: Iterable[str], token: str, changes: dict
    ) -> dict[str, str | None]:
        """PATCH the same live changes to every replica at once: URL -> None when each key
        is answered back in force with exactly the value sent, else why not."""
        urls = list(urls)
        results = await asyncio.gather(
            *(self.patch_config(u, token, changes) for u in urls), return_exceptions=True
        )
        return {u: _failure(r, changes) for u, r in zip(urls, results, strict=True)}

    async def _call(self, method: str, url: str, token: str, body: dict | None = None) -> dict:
        headers = {"Authorization": f"Bearer {token}"}
        try:
            async with (
                aiohttp.ClientSession(timeout=self.timeout) as session,
                session.request(method, url.rstrip("/") + PATH, json=body, headers=headers) as resp,
            ):
                answer = await read_limited(resp, ADMIN_MAX_BYTES)
                if resp.status != 200:
                    message = error_message(resp.status, answer)
                    raise AdminError(clip(f"{method} {url}{PATH}: HTTP {resp.status}: {message}"))
                return json.loads(answer)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # not JSON, AnswerTooLarge
            raise AdminError(clip(f"{method} {url}{PATH}: {type(e).__name__}: {e}")) from e


def _failure(result: object, changes: dict) -> str | None:
    if isinstance(result, BaseException):
        if not isinstance(result, AdminError):
            raise result
        return clip(str(result))
    in_force = result if isinstance(result, dict) else {}
    # A replica may answer 200 yet hold another value (an older server, or one that
    # adjusted it): only what it reports in force counts. What it answered goes into status.
    wrong = [f"{k}={in_force.get(k)}" for k, v in changes.items() if in_force.get(k) != v]
    return clip(f"answered {', '.join(wrong)}") if wrong else None
