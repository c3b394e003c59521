"""The replicas' /admin/config over HTTP, with the service's bearer token (the I/O shell
the tuner's live changes go through)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import aiohttp

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
                if resp.status != 200:
                    raise AdminError(
                        f"{method} {url}{PATH}: HTTP {resp.status}: {await resp.text()}"
                    )
                return await resp.json()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise AdminError(f"{method} {url}{PATH}: {type(e).__name__}: {e}") from e


def _failure(result: object, changes: dict) -> str | None:
    if isinstance(result, BaseException):
        if not isinstance(result, AdminError):
            raise result
        return str(result)
    in_force = result if isinstance(result, dict) else {}
    # A replica may answer 200 yet hold another value (an older server, or one that
    # adjusted it): only what it reports in force counts.
    wrong = [f"{k}={in_force.get(k)}" for k, v in changes.items() if in_force.get(k) != v]
    return f"answered {', '.join(wrong)}" if wrong else None
