"""The latency and size histograms of /metrics: their Prometheus text format, what a finished request adds to each,
and what the server reports after a few requests."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from pwruntime.metrics import Histogram, RequestMetrics, buckets_1_2_5, scalar
from server_fixtures import base_url, client, metrics_text, model  # noqa: F401 (fixtures)

HISTOGRAMS = ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_prompt_tokens", "request_generation_tokens")


def test_histogram_text_is_cumulative_and_ends_with_inf():
    h = Histogram("wait_seconds", "How long.", [1, 2, 5])
    for value in (0.5, 1.0, 1.5, 7.0):  # a value on a bound falls in that bound's bucket
        h.observe(value)
    assert h.render() == ["# HELP pagedweight_wait_seconds How long.", "# TYPE pagedweight_wait_seconds histogram",
                          'pagedweight_wait_seconds_bucket{le="1.0"} 2', 'pagedweight_wait_seconds_bucket{le="2.0"} 3',
                          'pagedweight_wait_seconds_bucket{le="5.0"} 3', 'pagedweight_wait_seconds_bucket{le="+Inf"} 4',
                          "pagedweight_wait_seconds_sum 10.0", "pagedweight_wait_seconds_count 4"]
    with pytest.raises(ValueError, match="increasing"):
        Histogram("x", "x", [2, 1])
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100) and buckets_1_2_5(4096)[-1] == 2000
    assert scalar("steps_total", "counter", 7) == ["# TYPE pagedweight_steps_total counter",
                                                   "pagedweight_steps_total 7"]
    assert scalar("mean_bits", "gauge", 3.5)[-1] == "pagedweight_mean_bits 3.5"


def _output(tokens: int, first: float | None, prompt: int = 3):
    return SimpleNamespace(request_id=0, arrival_time=1.0, first_token_time=first, finish_time=2.0,
                           token_ids=[7] * tokens, prompt_token_ids=[1] * prompt)


def test_a_finished_request_adds_one_observation_to_each_histogram():
    m = RequestMetrics(4096)
    m.observe(_output(5, first=1.2))
    m.observe(_output(1, first=1.5, prompt=40))  # one token: no time per output token
    m.observe(_output(0, first=None))  # aborted before its first token: no time to first token
    samples = _samples(m.render())
    assert [samples[f"{name}_count"] for name in HISTOGRAMS] == [2, 1, 3, 3, 3]
    assert samples["time_to_first_token_seconds_sum"] == pytest.approx(0.2 + 0.5)
    assert samples["time_per_output_token_seconds_sum"] == pytest.approx(0.8 / 4)
    assert samples["e2e_request_latency_seconds_sum"] == pytest.approx(3.0)
    assert samples["request_prompt_tokens_sum"] == 46 and samples['request_prompt_tokens_bucket{le="5.0"}'] == 2
    assert samples["request_generation_tokens_sum"] == 6


def test_each_gap_between_a_request_s_tokens_is_one_observation():
    m = RequestMetrics(4096)
    m.tokens([(1, 0.5), (2, 0.5)])           # first tokens: no gap
    m.tokens([(1, 0.6), (2, 0.75)])
    m.tokens([(1, 1.1)])
    m.observe(SimpleNamespace(request_id=1, arrival_time=0.0, first_token_time=0.5, finish_time=1.1, token_ids=[7] * 3,
                              prompt_token_ids=[1]))
    m.tokens([(1, 2.0)])                     # a new request under a reused id starts afresh
    samples = _samples(m.render())
    assert samples["inter_token_latency_seconds_count"] == 3
    assert samples["inter_token_latency_seconds_sum"] == pytest.approx(0.1 + 0.25 + 0.5)
    assert samples['inter_token_latency_seconds_bucket{le="0.1"}'] == 1


def test_two_tokens_give_one_time_per_output_token():
    m = RequestMetrics(4096)
    m.observe(_output(2, first=1.25))   # finished at 2.0: one gap after the first token
    samples = _samples(m.render())
    assert samples["time_per_output_token_seconds_count"] == 1
    assert samples["time_per_output_token_seconds_sum"] == pytest.approx(0.75)


def test_numpy_integers_print_as_integers_and_repeated_bounds_are_refused():
    """A count that is a numpy integer (numpy sums, as the page table makes) is written as an integer too."""
    assert scalar("kv_blocks_free", "gauge", np.int64(12)) == ["# TYPE pagedweight_kv_blocks_free gauge",
                                                               "pagedweight_kv_blocks_free 12"]
    with pytest.raises(ValueError, match="increasing"):
        Histogram("x", "x", [1, 1, 2])


def _samples(lines) -> dict[str, float]:
    """Sample name (with its labels) -> value, of Prometheus text lines."""
    return {line.rsplit(" ", 1)[0].removeprefix("pagedweight_"): float(line.rsplit(" ", 1)[1])
            for line in lines if line and not line.startswith("#")}


def test_metrics_after_requests(client, base_url):
    before = _samples(metrics_text(base_url).splitlines())
    kw = dict(model="demo", prompt="And God said unto Moses", max_tokens=4, temperature=0,
              extra_body={"ignore_eos": True})
    client.completions.create(**kw)
    client.completions.create(n=2, **kw)  # two engine requests
    assert len(list(client.completions.create(stream=True, **kw))) >= 2
    text = metrics_text(base_url)
    after = _samples(text.splitlines())
    for name in HISTOGRAMS:
        assert f"# TYPE pagedweight_{name} histogram" in text
        assert after[f"{name}_count"] - before.get(f"{name}_count", 0) == 4, name
        assert after[f'{name}_bucket{{le="+Inf"}}'] == after[f"{name}_count"]
        assert after[f"{name}_sum"] > before.get(f"{name}_sum", 0)
        buckets = sorted((float(m[1].replace("+Inf", "inf")), count) for key, count in after.items()
                         if (m := re.fullmatch(rf'{name}_bucket\{{le="(.*)"\}}', key)))
        assert len(buckets) > 5 and [c for _, c in buckets] == sorted(c for _, c in buckets)  # cumulative
    assert after["request_generation_tokens_sum"] - before.get("request_generation_tokens_sum", 0) == 16
    # four requests of four tokens: three gaps each
    assert after["inter_token_latency_seconds_count"] - before.get("inter_token_latency_seconds_count", 0) == 12
    assert after["generated_tokens_total"] - before["generated_tokens_total"] == 16
