"""The replicas' /admin/config over HTTP, with the service's bearer token (the I/O shell
the tuner's live changes go through)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import aiohttp

from batchpilot import names

ADMIN_TIMEOUT_SECONDS = 5.0
PATH = "/admin/config"


class AdminError(RuntimeError):
    """A replica refused or did not answer an admin call."""


class AdminClient:
    def __init__(self, timeout: float = ADMIN_TIMEOUT_SECONDS):
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def get_config(self, url: str, token: str) -> dict:
        return await self._call("GET", url, token)

    async def patch_config(self, url: str, token: str, changes: dict) -> dict:
        """PATCH live knobs (names.LIVE_KNOBS); the answer is the config now in force."""
        return await self._call("PATCH", url, token, changes)

    async def set_max_num_seqs(
        self, urls: Iterable[str], token: str, value: int
    ) -> dict[str, str | None]:
        """Set max_num_seqs on every replica at once: URL -> None, or why it failed."""
        urls = list(urls)
        results = await asyncio.gather(
            *(self.patch_config(u, token, {names.MAX_NUM_SEQS.name: value}) for u in urls),
            return_exceptions=True,
        )
        return {u: _failure(r, value) for u, r in zip(urls, results, strict=True)}

    async def _call(self, method: str, url: str, token: str, body: dict | None = None) -> dict:
        headers = {"Authorization": f"Bearer {token}"}
        try:
            async with (
                aiohttp.ClientSession(timeout=self.timeout) as session,
                session.request(method, url.rstrip("/") + PATH, json=body, headers=headers) as resp,
            ):
                if resp.status != 200:
                    raise AdminError(
                        f"{method} {url}{PATH}: HTTP {resp.status}: {await resp.text()}"
                    )
                return await resp.json()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise AdminError(f"{method} {url}{PATH}: {type(e).__name__}: {e}") from e


def _failure(result: object, value: int) -> str | None:
    if isinstance(result, BaseException):
        if not isinstance(result, AdminError):
            raise result
        return str(result)
    in_force = result.get(names.MAX_NUM_SEQS.name) if isinstance(result, dict) else None
    return None if in_force == value else f"answered {names.MAX_NUM_SEQS.name}={in_force}"
