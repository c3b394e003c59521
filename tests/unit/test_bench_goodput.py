import pytest

from batchpilot.server.bench.client import RequestResult
from batchpilot.server.bench.goodput import goodput, meets_slo, parse_slo
from batchpilot.server.bench.results import aggregate, request_metrics


def test_parse_slo_accepts_comma_and_vllm_space_forms_in_milliseconds():
    assert parse_slo("ttft:500,tpot:50") == {"ttft": 0.5, "tpot": 0.05}
    assert parse_slo("ttft:500 e2el:2000") == {"ttft": 0.5, "e2el": 2.0}
    assert parse_slo(None) == {}
    assert parse_slo("") == {}


@pytest.mark.parametrize("text", ["ttft", "itl:5", "ttft:0", "ttft:-3", "ttft:abc"])
def test_parse_slo_rejects_malformed_items(text):
    with pytest.raises(ValueError):
        parse_slo(text)


def test_a_request_is_good_only_when_every_bound_holds():
    slo = {"ttft": 0.5, "tpot": 0.05}
    assert meets_slo({"ttft": 0.5, "tpot": 0.05, "e2el": 9.0}, slo)  # bounds are inclusive
    assert not meets_slo({"ttft": 0.51, "tpot": 0.01, "e2el": 1.0}, slo)
    assert not meets_slo({"ttft": 0.1, "tpot": 0.06, "e2el": 1.0}, slo)


def test_goodput_counts_good_requests_per_second():
    requests = [
        {"ttft": 0.1, "tpot": 0.01, "e2el": 1.0},
        {"ttft": 0.9, "tpot": 0.01, "e2el": 1.0},
        {"ttft": 0.2, "tpot": 0.02, "e2el": 1.0},
    ]
    assert goodput(requests, {"ttft": 0.5}, duration_s=2.0) == 1.0
    assert goodput(requests, {}, duration_s=2.0) == 1.5  # no SLO: every request counts
    with pytest.raises(ValueError):
        goodput(requests, {}, duration_s=0.0)


def test_tpot_excludes_the_first_token_and_is_undefined_for_one_token():
    r = RequestResult(success=True, output_len=5, ttft=0.2, latency=1.0)
    assert r.tpot == pytest.approx(0.2)
    assert RequestResult(success=True, output_len=1, ttft=0.2, latency=0.2).tpot is None
    assert request_metrics(RequestResult(success=True, output_len=1, ttft=0.2, latency=0.3)) == {
        "ttft": 0.2,
        "tpot": 0.0,
        "e2el": 0.3,
    }


def test_aggregate_counts_failures_and_measures_only_completed_requests():
    ok = RequestResult(True, "", 10, 5, 0.1, [0.05, 0.05, 0.1, 0.1], 0.4)
    slow = RequestResult(True, "", 20, 3, 0.7, [0.1, 0.1], 0.9)
    failed = RequestResult(False, "HTTP 500: boom", 0, 0, 0.0, [], 0.0)
    out = aggregate([ok, slow, failed], duration_s=2.0, slo={"ttft": 0.5})
    assert (out["completed"], out["failed"]) == (2, 1)
    assert out["total_output_tokens"] == 8 and out["total_input_tokens"] == 30
    assert out["output_throughput"] == 4.0
    assert out["request_throughput"] == 1.0
    assert out["request_goodput"] == 0.5  # only `ok` meets ttft <= 500 ms
    assert out["mean_ttft_ms"] == pytest.approx(400.0)
    assert out["median_itl_ms"] == pytest.approx(100.0)  # six gaps from both requests
    assert out["mean_tpot_ms"] == pytest.approx((75.0 + 100.0) / 2)
    assert out["errors"] == ["", "", "HTTP 500: boom"]
