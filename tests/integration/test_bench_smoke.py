"""Each `batchpilot bench` subcommand end to end on the tiny random Llama, small enough to run
in seconds: the JSON each writes has the promised shape and the numbers add up."""

import json

import pytest

from batchpilot.cli import main
from batchpilot.server.bench.server_process import running_server
from batchpilot.server.bench.workload import make_workload

TINY = ["--dtype", "float32"]
SERVE_FLAGS = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB"]


def only_json(directory, pattern):
    files = sorted(directory.glob(pattern))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_offline_compares_every_system_on_the_same_work(tiny_path, tmp_path):
    argv = ["bench", "offline", "--model", tiny_path, *TINY, "--concurrency", "4",
            "--num-prompts", "8", "--output-lens", "4,12", "--sequential-num-prompts", "2",
            "--efficiency-steps", "3", "--result-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    result = only_json(tmp_path, "offline-*.json")
    wanted = sum(r.output_len for r in make_workload(8, 0, (4, 12)))
    systems = {s["name"]: s for s in result["systems"]}
    assert set(systems) == {
        "batchpilot continuous",
        "batchpilot static",
        "hf sequential generate()",
        "hf static batching",
        "hf generate_batch (paged|sdpa)",
    }
    for name, s in systems.items():
        assert s["output_tok_s"] > 0 and s["useful_tok_s"] > 0, name
        if name != "hf sequential generate()":
            assert s["num_requests"] == 8 and s["useful_tokens"] == wanted, name
    assert systems["hf sequential generate()"]["num_requests"] == 2
    # Padding rows run to the longest output in their batch; nobody else computes waste.
    assert systems["hf static batching"]["computed_tokens"] > wanted
    assert systems["batchpilot continuous"]["computed_tokens"] == wanted
    assert systems["batchpilot continuous"]["batchpilot_speedup"] == 1.0
    eff = result["engine_efficiency"]
    assert eff["batch_size"] == 4 and eff["decode_steps"] == 3
    assert eff["efficiency"] == pytest.approx(eff["engine_decode_tok_s"] / eff["raw_forward_tok_s"])
    # The machine and the roofline it scales every system by, measured in the same run.
    host = result["machine"]
    assert host["dtype"] == "float32" and host["matmul_peak_gflops"] > 0 and host["params"] > 0
    assert result["roofline_seconds"] > 0
    assert all(s["roofline_fraction"] > 0 for s in systems.values())


def test_serve_measures_every_request_against_a_live_server(tiny_path, tmp_path):
    with running_server(
        ["--model", tiny_path, *TINY, *SERVE_FLAGS], tmp_path / "server.log"
    ) as url:
        argv = ["bench", "serve", "--url", url, "--num-prompts", "6", "--output-lens", "3,9",
                "--request-rate", "50", "--max-concurrency", "4", "--slo", "ttft:60000,tpot:60000",
                "--result-dir", str(tmp_path / "out")]  # fmt: skip
        assert main(argv) == 0
    result = only_json(tmp_path / "out", "serve-*.json")
    lens = [r.output_len for r in make_workload(6, 0, (3, 9))]
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["output_lens"] == lens  # ignore_eos made every length exact
    assert result["total_output_tokens"] == sum(lens)
    assert all(n > 0 for n in result["input_lens"])
    # One gap per streamed event after the first. An event carries one token, or several
    # when the client fell behind the engine and the server coalesced them (as vLLM does),
    # so a request has at most one gap per token after the first, and none at all when its
    # whole output was ready before the client read the first event (CI saw that for 3 tokens).
    assert all(len(gaps) <= n - 1 for gaps, n in zip(result["itls"], lens, strict=True))
    assert sum(len(gaps) for gaps in result["itls"]) >= 1
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p50", "p90", "p99"):
            assert result[f"{stat}_{metric}_ms"] > 0, (stat, metric)
    assert result["p99_e2el_ms"] >= result["median_e2el_ms"] >= result["median_ttft_ms"]


def test_sweep_starts_servers_and_plots_continuous_against_static(tiny_path, tmp_path):
    argv = ["bench", "sweep", "--model", tiny_path, *TINY, "--values", "1,2",
            "--max-num-seqs", "2", "--num-prompts", "4", "--output-lens", "4",
            "--serve-args", " ".join(SERVE_FLAGS), "--result-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    summary = only_json(tmp_path, "sweep-*.json")
    points = {(p["policy"], p["max_concurrency"]) for p in summary["points"]}
    assert points == {("continuous", 1), ("continuous", 2), ("static", 1), ("static", 2)}
    assert all(p["completed"] == 4 and p["failed"] == 0 for p in summary["points"])
    # Where the clients match the server's batch limit, the same work also ran offline.
    at_limit = [p for p in summary["points"] if p["max_concurrency"] == 2]
    for p in at_limit:
        assert p["online_over_offline"] == pytest.approx(
            p["output_throughput"] / p["offline_output_throughput"]
        )
    png = tmp_path / summary["plot"].rsplit("/", 1)[-1]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list(tmp_path.glob("serve-*.json"))) == 4  # one file per run as well


def test_interference_keeps_decoders_decoding_through_the_long_prefill(tiny_path, tmp_path):
    argv = ["bench", "interference", "--model", tiny_path, *TINY, "--num-decoders", "2",
            "--long-prompt-len", "1500", "--steady-steps", "3", "--chunk-sizes", "256",
            "--result-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    result = only_json(tmp_path, "interference-*.json")
    settings = {s["label"]: s for s in result["settings"]}
    assert set(settings) == {"off", "on, 256-token budget"}
    off, on = settings["off"], settings["on, 256-token budget"]
    # Without chunking the 1500-token prompt is one step; with a 256-token budget it takes at
    # least six, and the decoders make a token in each of them.
    assert on["num_itl_samples"] >= off["num_itl_samples"] + 2 * 5
    for s in (off, on):
        assert s["p99_itl_ms"] >= s["median_itl_ms"] > 0
        assert s["long_prompt_ttft_ms"] > 0
