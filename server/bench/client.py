"""One streaming request against an OpenAI-compatible /v1/completions endpoint, timed
token by token the way `vllm bench serve` times it."""

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds from send to the first token chunk
    itl: list[float] = field(default_factory=list)  # gaps between successive token chunks
    latency: float = 0.0  # end to end

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; undefined for one-token outputs."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def completion_payload(model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # a vLLM extension; plain OpenAI servers would reject it
        payload["ignore_eos"] = True
    return payload


async def stream_completion(
    client: httpx.AsyncClient, url: str, payload: dict, headers: dict
) -> RequestResult:
    result = RequestResult()
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                data = line.removeprefix("data:").strip()
                if not line.startswith("data:") or not data or data == "[DONE]":
                    continue
                event = json.loads(data)
                now = time.perf_counter()
                # Every chunk with choices is a token event, text or not: a token that ends
                # mid-character streams as empty text, as vLLM's client also counts it.
                if event.get("choices"):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks += 1
                    last = now
                if event.get("usage"):
                    result.prompt_len = event["usage"].get("prompt_tokens", 0)
                    result.output_len = event["usage"].get("completion_tokens", 0)
        result.latency = time.perf_counter() - start
        result.output_len = result.output_len or chunks
        result.success = chunks > 0
        if not result.success:
            result.error = "the stream carried no tokens"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result
