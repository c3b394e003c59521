"""The load client of benchmarks/prefix_routing.py. It runs inside the kind cluster, in a pod
of the operator image (python3, standard library only): its source is the pod's
``python3 -c`` program and its one argument is the run's JSON config:

    {"url": "http://smol:8000" | "http://gateway:8080", "model": ..., "pods": [pod IP, ...],
     "systems": [system prompt, ...], "conversations": [{"start": s, "group": g,
     "questions": [...]}, ...], "max_tokens": n, "timeout": s}

Each conversation starts at its ``start`` (seconds after the run's start: open-loop
arrivals) and sends its questions one turn after another, each turn's messages being the
group's system prompt, the turns before it (questions and the answers received) and the
question: streaming chat completions, one new connection per request (so a Service's
kube-proxy spreads them, as it does clients). Before and after, every pod's /metrics is read
for the prefix-cache counters. The last stdout line is the result, one JSON object.
"""

import http.client
import json
import sys
import threading
import time
import urllib.parse
import urllib.request

HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def counters(ip: str) -> dict:
    text = urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=30).read().decode()
    out = {HITS: 0.0, QUERIES: 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def chat(cfg: dict, messages: list, record: dict) -> str:
    """One streamed chat completion; fills record (times, tokens, endpoint, error) and
    returns the answer's text."""
    url = urllib.parse.urlsplit(cfg["url"])
    body = json.dumps({
        "model": cfg["model"], "messages": messages, "max_tokens": cfg["max_tokens"],
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()  # fmt: skip
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=cfg["timeout"])
    text = []
    record["sent"] = time.monotonic()
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        record["status"] = resp.status
        record["endpoint"] = resp.getheader("x-gateway-destination-endpoint")
        if resp.status != 200:
            record["error"] = resp.read().decode(errors="replace")[:300]
            return ""
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    record.setdefault("first", time.monotonic())
                    text.append(piece)
            if chunk.get("usage"):
                record["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                record["output_tokens"] = chunk["usage"]["completion_tokens"]
        record["done"] = time.monotonic()
    except Exception as e:
        record["error"] = repr(e)[:300]
    finally:
        conn.close()
    return "".join(text)


def conversation(cfg: dict, conv: dict, t0: float, records: list, lock: threading.Lock):
    time.sleep(max(0.0, t0 + conv["start"] - time.monotonic()))
    messages = [{"role": "system", "content": cfg["systems"][conv["group"]]}]
    for turn, question in enumerate(conv["questions"]):
        messages.append({"role": "user", "content": question})
        record = {"group": conv["group"], "turn": turn}
        answer = chat(cfg, messages, record)
        with lock:
            records.append(record)
        if "error" in record:
            return
        messages.append({"role": "assistant", "content": answer})


def main() -> None:
    cfg = json.loads(sys.argv[1])
    before = {ip: counters(ip) for ip in cfg["pods"]}
    records: list = []
    lock = threading.Lock()
    t0 = time.monotonic()
    threads = [
        threading.Thread(target=conversation, args=(cfg, c, t0, records, lock))
        for c in cfg["conversations"]
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = {ip: counters(ip) for ip in cfg["pods"]}
    pods = {
        ip: {"hits": after[ip][HITS] - before[ip][HITS],
             "queries": after[ip][QUERIES] - before[ip][QUERIES]}
        for ip in cfg["pods"]
    }  # fmt: skip
    for r in records:  # times relative to the run's start
        for k in ("sent", "first", "done"):
            if k in r:
                r[k] = round(r[k] - t0, 4)
    print(json.dumps({"pods": pods, "requests": records}), flush=True)


if __name__ == "__main__":
    main()
