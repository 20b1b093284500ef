"""The benchmark's metrics on hand-computed cases: percentiles, the paper's EMA SLA, effective
throughput over a sweep, goodput."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fastgen.bench.metrics import (SLA, Dist, GoodputSLO, RequestRecord, best_effective_throughput, ema,
                                   meets_sla, percentile, summarize)

ALPHA = 2 / 17  # span 16


def record(prompt: int = 512, ttft: float = 0.5, gaps: list[float] = (), arrival: float = 0.0,
           index: int = 0) -> RequestRecord:
    """A completed request: first token ``ttft`` after ``arrival``, then one token per gap."""
    times = [arrival + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(index=index, num_prompt_tokens=prompt, max_new_tokens=len(times), arrival_s=arrival,
                         token_times_s=times, finish_s=times[-1], num_output_tokens=len(times))


# -- percentiles ---------------------------------------------------------------------------------

def test_percentile_hand_cases():
    v = [4.0, 1.0, 3.0, 2.0]            # sorted 1 2 3 4; rank q/100 * 3
    assert percentile(v, 0) == 1.0
    assert percentile(v, 50) == pytest.approx(2.5)
    assert percentile(v, 90) == pytest.approx(3.7)   # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(v, 95) == pytest.approx(3.85)
    assert percentile(v, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 101):
        v = rng.exponential(size=n).tolist()
        for q in (0, 1, 50, 90, 95, 99, 100):
            assert percentile(v, q) == pytest.approx(float(np.percentile(v, q)))


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_dist():
    d = Dist.of([1.0, 2.0, 3.0, 4.0])
    assert (d.count, d.mean, d.p50, d.max) == (4, 2.5, 2.5, 4.0)
    assert Dist.of([]) == Dist(0)


# -- the EMA SLA ---------------------------------------------------------------------------------

def test_ema_hand_computed():
    assert ema([], 16) == []
    assert ema([0.3], 16) == [0.3]                    # starts at the first gap
    e = ema([0.1, 1.0, 0.1], 16)
    assert e[1] == pytest.approx(ALPHA * 1.0 + (1 - ALPHA) * 0.1)       # 0.20588...
    assert e[2] == pytest.approx(ALPHA * 0.1 + (1 - ALPHA) * e[1])
    assert ema([0.2] * 40, 16) == pytest.approx([0.2] * 40)


def test_ema_span_one_is_the_gap_itself():
    assert ema([0.1, 0.9, 0.3], 1) == [0.1, 0.9, 0.3]


def test_sla_ttft_is_prompt_over_512():
    sla = SLA()
    assert meets_sla(record(prompt=512, ttft=1.0), sla, 4)        # exactly 512/512 s: allowed
    assert not meets_sla(record(prompt=512, ttft=1.001), sla, 4)
    assert meets_sla(record(prompt=1024, ttft=1.9), sla, 4)
    assert not meets_sla(record(prompt=100, ttft=0.2), sla, 4)   # 100/512 = 0.195 s


def test_sla_one_slow_gap_after_steady_ones():
    # 15 gaps of 0.2 s, then a 1.0 s stall: EMA = 2/17 * 1.0 + 15/17 * 0.2 = 0.294 s
    r = record(ttft=0.1, gaps=[0.2] * 15 + [1.0])
    assert ema(r.token_gaps_s, 16)[-1] == pytest.approx(ALPHA * 1.0 + (1 - ALPHA) * 0.2)
    assert meets_sla(r, SLA(), 2)        # limit 0.5 s
    assert not meets_sla(r, SLA(), 4)    # limit 0.25 s: broken by the stall
    assert not meets_sla(r, SLA(), 6)    # limit 0.1667 s: broken from the first gap


def test_sla_stall_averaged_out_by_the_ema():
    # a single 0.5 s gap after 0.1 s gaps: EMA = 2/17 * 0.5 + 15/17 * 0.1 = 0.147 s < 0.25 s
    r = record(ttft=0.1, gaps=[0.1] * 10 + [0.5] + [0.1] * 5)
    assert max(ema(r.token_gaps_s, 16)) == pytest.approx(ALPHA * 0.5 + (1 - ALPHA) * 0.1)
    assert meets_sla(r, SLA(), 4)
    assert not meets_sla(r, SLA(), 8)    # limit 0.125 s


def test_sla_first_gap_counts_in_full_and_limit_is_strict():
    assert not meets_sla(record(ttft=0.1, gaps=[0.3, 0.01, 0.01]), SLA(), 4)   # ema_1 = 0.3 > 0.25
    assert not meets_sla(record(ttft=0.5, gaps=[0.25] * 5), SLA(), 4)          # "below" 1/R (exact binary times)
    assert meets_sla(record(ttft=0.1, gaps=[0.2499] * 5), SLA(), 4)


def test_sla_single_token_and_failed_requests():
    assert meets_sla(record(ttft=0.1, gaps=[]), SLA(), 6)      # no gap to judge
    failed = record(ttft=0.1)
    failed.error = "boom"
    assert not meets_sla(failed, SLA(), 2)


def test_sla_is_configurable():
    r = record(prompt=256, ttft=0.9, gaps=[0.4] * 3)
    assert not meets_sla(r, SLA(), 2)                                      # 256/512 = 0.5 s
    assert meets_sla(r, SLA(prompt_tokens_per_s=256, gen_tokens_per_s=(2,)), 2)
    with pytest.raises(ValueError):
        SLA(gen_tokens_per_s=(0.0,))


# -- per-request latencies -------------------------------------------------------------------------

def test_request_latencies():
    r = record(ttft=0.5, gaps=[0.1, 0.3], arrival=2.0)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.token_gaps_s == pytest.approx([0.1, 0.3])
    assert r.tpot_s == pytest.approx(0.2)
    assert r.e2e_s == pytest.approx(0.9)
    assert record(gaps=[]).tpot_s is None


def test_tpot_uses_the_reported_token_count():
    # HTTP: two chunks carried 5 tokens -> TPOT over 4 intervals
    r = record(ttft=0.5, gaps=[0.8])
    r.num_output_tokens = 5
    assert r.tpot_s == pytest.approx(0.2)


# -- summaries and effective throughput --------------------------------------------------------------

def test_summarize_hand_computed():
    good = [record(prompt=512, ttft=0.5, gaps=[0.1] * 4, index=i) for i in range(3)]   # 5 tokens each
    slow = record(prompt=512, ttft=2.0, gaps=[0.1] * 4, index=3)                         # TTFT > 1 s
    cut = RequestRecord(4, 512, 5, 0.0, token_times_s=[0.5], error="cut off")
    s = summarize(good + [slow, cut], duration_s=2.0, sla=SLA())
    assert (s.num_requests, s.num_completed, s.num_failed) == (5, 4, 1)
    assert s.request_throughput == pytest.approx(2.0)
    assert s.output_token_throughput == pytest.approx(20 / 2)
    assert s.total_token_throughput == pytest.approx((4 * 512 + 20) / 2)
    for r in s.sla:
        assert r.num_met == 3
        assert r.fraction == pytest.approx(0.75)
        assert r.effective_throughput == pytest.approx(1.5)
    assert s.ttft_s.mean == pytest.approx((3 * 0.5 + 2.0) / 4)
    assert s.token_gap_s.count == 16 and s.token_gap_s.p50 == pytest.approx(0.1)
    assert s.goodput is None


def _sweep_point(throughput: float, fraction: float, n: int = 20) -> list:
    """Records whose summary over 1 s has the given throughput and SLA fraction."""
    num_met = round(fraction * n)
    return [record(ttft=0.5 if i < num_met else 5.0, gaps=[0.1], index=i) for i in range(n)], n / throughput


def test_effective_throughput_is_the_best_point_of_the_sweep():
    sla = SLA(gen_tokens_per_s=(4.0,))
    summaries = [summarize(*_sweep_point(t, f), sla=sla) for t, f in ((1.0, 1.0), (2.0, 0.75), (3.0, 0.4))]
    assert [s.sla[0].effective_throughput for s in summaries] == pytest.approx([1.0, 1.5, 1.2])
    best, at = best_effective_throughput(summaries, 4.0)
    assert (best, at) == (pytest.approx(1.5), 1)
    assert best_effective_throughput(summaries, 2.0) == (0.0, None)     # a rate not measured
    none_met = [summarize(*_sweep_point(1.0, 0.0), sla=sla)]
    assert best_effective_throughput(none_met, 4.0) == (0.0, None)


def test_goodput_like_vllm():
    recs = [record(ttft=0.2, gaps=[0.05] * 3, index=0),     # good
            record(ttft=0.2, gaps=[0.5] * 3, index=1),      # TPOT 0.5 s > 0.1 s
            record(ttft=3.0, gaps=[0.05] * 3, index=2),     # TTFT 3 s > 1 s
            record(ttft=0.2, gaps=[], index=3)]             # one token: TPOT counts as 0
    slo = GoodputSLO(ttft_s=1.0, tpot_s=0.1)
    s = summarize(recs, duration_s=4.0, sla=SLA(), slo=slo)
    assert s.goodput == pytest.approx(2 / 4)
    assert not GoodputSLO().is_set
    assert GoodputSLO(e2e_s=0.1).good(recs[0]) is False


def test_prompt_token_mismatches_are_counted():
    a, b = record(prompt=10), record(prompt=10, index=1)
    a.reported_prompt_tokens, b.reported_prompt_tokens = 10, 11
    assert summarize([a, b], 1.0, SLA()).num_prompt_token_mismatches == 1
    assert not math.isnan(summarize([], 1.0, SLA()).request_throughput)
