"""Inter-token latency: `traces.results.TokenGaps` and what the simulator reports of it (`itl_s`, `max_itl_s`)."""
from __future__ import annotations

import numpy as np
import pytest
from sim_fixtures import tiny_sim

from traces.results import TokenGaps, request_columns, request_summary


def test_token_gaps_keep_every_gap_and_each_request_s_longest():
    g = TokenGaps(3)
    g.settled([0, 1], 1.0)            # first tokens: no gap yet
    assert g.all().size == 0 and np.isnan(g.max_s).all()
    g.settled([0, 1, 2], 1.5)         # request 2's first token
    g.settled([0], 3.5)
    g.settled(np.array([1, 0]), np.array([4.0, 3.75]))   # a time a row
    np.testing.assert_allclose(np.sort(g.all()), [0.25, 0.5, 0.5, 2.0, 2.5])
    np.testing.assert_allclose(g.max_s[:2], [2.0, 2.5])
    assert np.isnan(g.max_s[2])       # one token: no gap
    np.testing.assert_allclose(g.last_s, [3.75, 4.0, 1.5])


def test_the_summary_and_the_request_columns_carry_them():
    g = TokenGaps(2)
    for t in (0.0, 0.1, 0.2, 1.2):
        g.settled([0], t)
    g.settled([1], 0.5)
    req = request_columns([5, 6], ["a", "a"], [0.0, 0.4], [3, 3], [4, 1], [0.0, 0.5], [1.2, 0.5], [0, 0],
                          ["length", "length"], max_itl_s=g.max_s)
    np.testing.assert_allclose(req["max_itl_s"], [1.0, np.nan])
    s = request_summary(req, g.all())
    assert s["itl_s"]["max"] == pytest.approx(1.0) and s["itl_s"]["p50"] == pytest.approx(0.1)
    assert "itl_s" not in request_summary(req) and "max_itl_s" not in request_columns(
        [5], ["a"], [0.0], [3], [2], [0.1], [0.2], [0], ["length"])


def test_the_simulator_s_gaps_add_up_to_each_request_s_decode_time():
    sim = tiny_sim("pagedweight", kv_blocks=24, n=24)
    res = sim.run()
    r, s = res.requests, res.summary
    assert (r["preemptions"] == 0).all() and s["completed"] == 24
    gaps = (r["output_tokens"] - 1).sum()
    # every token after a request's first is one gap, and a request's gaps span its first token to its last
    assert s["itl_s"]["mean"] * gaps == pytest.approx(np.sum(r["finish_s"] - r["first_token_s"]), rel=1e-9)
    many = r["output_tokens"] > 1
    assert (r["max_itl_s"][many] >= r["tpot_s"][many] * (1 - 1e-12)).all()   # the longest gap >= the mean
    assert np.isnan(r["max_itl_s"][~many]).all()
    assert s["itl_s"]["max"] == pytest.approx(np.nanmax(r["max_itl_s"]))
