"""Metrics from the timestamps a client sees: latency distributions, throughput, and the paper's
effective throughput under an SLA.

Per request (times from :class:`RequestRecord`, in seconds):

- TTFT: first token time - arrival;
- token gaps: the differences between consecutive token times (vLLM's "ITL");
- TPOT: (last token time - first token time) / (generated tokens - 1), for 2+ tokens;
- end-to-end: end of the stream - arrival.

**The SLA of DeepSpeed-FastGen** (arXiv 2401.08671, section "effective throughput"): a request
meets it at generation rate ``R`` tokens/s iff

1. ``TTFT <= num_prompt_tokens / 512`` s (the prompt "read" at 512 tokens/s), and
2. the exponential moving average of its token gaps, ``ema_1 = gap_1`` and
   ``ema_k = a * gap_k + (1 - a) * ema_{k-1}`` with ``a = 2 / (span + 1)``, span 16, is below
   ``1 / R`` s after every token (a request with one token has no gap and meets it).

Effective throughput at ``R`` = request throughput x the fraction of requests that meet the SLA;
over a client sweep, the best of its points. Goodput (``vllm bench serve --goodput``) counts the
requests whose TTFT, TPOT and end-to-end latency are each within their SLO, per second.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """What a client saw of one request. Filled in by a target while the request runs; times
    are seconds from the start of the run (one clock for every request of the run)."""

    index: int
    num_prompt_tokens: int              # as sent: exact (see workload.Corpus)
    max_new_tokens: int
    arrival_s: float                    # sent (Poisson: its scheduled arrival)
    token_times_s: list[float] = field(default_factory=list)  # each token (HTTP: each text chunk)
    finish_s: float | None = None       # the stream ended; None while running or if cut off
    num_output_tokens: int = 0          # generated (HTTP: usage.completion_tokens when reported)
    reported_prompt_tokens: int | None = None  # HTTP: usage.prompt_tokens when reported
    cached_prompt_tokens: int | None = None   # prompt tokens served by the prefix cache, when reported
    error: str | None = None            # failed, or cut off by the run's time limit

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_s is not None and bool(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def token_gaps_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        n = max(self.num_output_tokens, len(self.token_times_s))
        if n < 2 or len(self.token_times_s) < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


# -- distributions ------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default): rank ``q/100 * (n - 1)`` of the sorted values."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    s = sorted(values)
    rank = q / 100 * (len(s) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


@dataclass(frozen=True)
class Dist:
    """Mean and percentiles of a sample (all None when it is empty)."""

    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> "Dist":
        v = list(values)
        if not v:
            return cls(0)
        p = {f"p{q}": percentile(v, q) for q in PERCENTILES}
        return cls(len(v), mean=sum(v) / len(v), max=max(v), **p)


# -- the paper's SLA -------------------------------------------------------------------------

@dataclass(frozen=True)
class SLA:
    """The paper's SLA: prompt read at ``prompt_tokens_per_s``; generation at each rate of
    ``gen_tokens_per_s``, judged on the EMA (span ``ema_span``) of the token gaps."""

    prompt_tokens_per_s: float = 512.0
    gen_tokens_per_s: tuple[float, ...] = (2.0, 4.0, 6.0)
    ema_span: int = 16

    def __post_init__(self) -> None:
        if self.prompt_tokens_per_s <= 0 or any(r <= 0 for r in self.gen_tokens_per_s) or self.ema_span < 1:
            raise ValueError(f"SLA rates and span must be positive: {self}")


def ema(values: Sequence[float], span: int) -> list[float]:
    """Exponential moving average after each value: ``ema_1 = v_1``,
    ``ema_k = a * v_k + (1 - a) * ema_{k-1}``, ``a = 2 / (span + 1)`` (pandas' ``adjust=False``)."""
    alpha = 2.0 / (span + 1)
    out: list[float] = []
    for v in values:
        out.append(v if not out else alpha * v + (1 - alpha) * out[-1])
    return out


def meets_ttft(record: RequestRecord, sla: SLA) -> bool:
    ttft = record.ttft_s
    return ttft is not None and ttft <= record.num_prompt_tokens / sla.prompt_tokens_per_s


def meets_generation(record: RequestRecord, gen_tokens_per_s: float, span: int) -> bool:
    limit = 1.0 / gen_tokens_per_s
    return all(e < limit for e in ema(record.token_gaps_s, span))


def meets_sla(record: RequestRecord, sla: SLA, gen_tokens_per_s: float) -> bool:
    """The paper's criterion for one request at one generation rate (see the module docstring)."""
    return (record.completed and meets_ttft(record, sla)
            and meets_generation(record, gen_tokens_per_s, sla.ema_span))


# -- goodput (vllm bench serve) ----------------------------------------------------------------

@dataclass(frozen=True)
class GoodputSLO:
    """``vllm bench serve --goodput``: a request is good iff every SLO given holds (seconds)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2e_s))

    def good(self, record: RequestRecord) -> bool:
        if not record.completed:
            return False
        checks = ((self.ttft_s, record.ttft_s), (self.tpot_s, record.tpot_s), (self.e2e_s, record.e2e_s))
        # a request with a single token has no TPOT: vLLM counts it as 0
        return all(slo is None or (value or 0.0) <= slo for slo, value in checks)


# -- one load point ------------------------------------------------------------------------------

@dataclass(frozen=True)
class SLAResult:
    gen_tokens_per_s: float
    num_met: int
    fraction: float                  # of completed requests
    effective_throughput: float      # requests/s that met the SLA: throughput * fraction


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_completed: int
    num_failed: int                  # failed or cut off by the time limit (see the records' errors)
    duration_s: float                # start of the run -> end of its last request
    request_throughput: float        # completed requests / duration
    output_token_throughput: float   # generated tokens of completed requests / duration
    total_token_throughput: float    # prompt + generated tokens of completed requests / duration
    ttft_s: Dist
    token_gap_s: Dist                # every gap of every completed request, pooled
    tpot_s: Dist
    e2e_s: Dist
    sla: tuple[SLAResult, ...]
    goodput: float | None            # good requests / duration (None without an SLO)
    num_prompt_token_mismatches: int  # HTTP: usage.prompt_tokens != the tokens sent
    prefix_hit_rate: float | None = None   # cached / prompt tokens of completed requests that report it


def summarize(records: Sequence[RequestRecord], duration_s: float, sla: SLA,
              slo: GoodputSLO = GoodputSLO()) -> Summary:
    done = [r for r in records if r.completed]
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    num_out = sum(r.num_output_tokens for r in done)
    num_in = sum(r.num_prompt_tokens for r in done)
    sla_results = []
    for rate in sla.gen_tokens_per_s:
        met = sum(meets_sla(r, sla, rate) for r in done)
        fraction = met / len(done) if done else 0.0
        sla_results.append(SLAResult(rate, met, fraction, per_s(len(done)) * fraction))
    return Summary(
        num_requests=len(records), num_completed=len(done), num_failed=len(records) - len(done),
        duration_s=duration_s, request_throughput=per_s(len(done)),
        output_token_throughput=per_s(num_out), total_token_throughput=per_s(num_in + num_out),
        ttft_s=Dist.of(r.ttft_s for r in done),
        token_gap_s=Dist.of(g for r in done for g in r.token_gaps_s),
        tpot_s=Dist.of(r.tpot_s for r in done if r.tpot_s is not None),
        e2e_s=Dist.of(r.e2e_s for r in done),
        sla=tuple(sla_results),
        goodput=per_s(sum(slo.good(r) for r in done)) if slo.is_set else None,
        num_prompt_token_mismatches=sum(1 for r in records if r.reported_prompt_tokens is not None
                                        and r.reported_prompt_tokens != r.num_prompt_tokens),
        prefix_hit_rate=_hit_rate(done))


def _hit_rate(done: Sequence[RequestRecord]) -> float | None:
    known = [r for r in done if r.cached_prompt_tokens is not None]
    total = sum(r.num_prompt_tokens for r in known)
    return sum(r.cached_prompt_tokens for r in known) / total if known and total else None


def best_effective_throughput(summaries: Sequence[Summary], gen_tokens_per_s: float) -> tuple[float, int | None]:
    """The paper's effective throughput of a sweep: the best point's, and that point's index
    (None when no point has a request that met the SLA)."""
    best, at = 0.0, None
    for i, s in enumerate(summaries):
        for r in s.sla:
            if r.gen_tokens_per_s == gen_tokens_per_s and r.effective_throughput > best:
                best, at = r.effective_throughput, i
    return best, at
