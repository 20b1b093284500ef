"""Requests through ``Engine.step()``: one long prefill against the matmul roofline, steady decode
at several batch sizes (batch 1 against the bandwidth bound), and the model forward's time against
tokens per step (the curve that picks ``DEFAULT_BUDGET_TOKENS``)."""
from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..batch import SeqInput, build_batch
from ..config import DEFAULT_BUDGET_TOKENS
from ..request import FinishReason, SamplingParams
from .machine import FLOPS_FORMULA, WEIGHT_BYTES_FORMULA, MachineLimits, ModelCosts
from .timing import Sizes, Summary, time_calls, timed_forward


def random_prompt(rng: random.Random, vocab_size: int, num_tokens: int) -> list[int]:
    low = min(256, vocab_size // 2)  # keep clear of the special tokens at the start of the vocab
    return [rng.randrange(low, vocab_size) for _ in range(num_tokens)]


def release(engine, request_ids: list[str]) -> None:
    """Abort whatever is still running and forget every request; raise if one failed
    (a failed forward finishes its requests at once, which would look very fast)."""
    errors = []
    for rid in request_ids:
        engine.abort(rid)
        response = engine.response(rid)
        if response.finish_reason is FinishReason.ERROR:
            errors.append(f"{rid}: {response.error}")
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, e.g. {errors[0]}")


# -- prefill ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrefillResult:
    num_tokens: int
    budget_tokens: int
    num_steps: int
    tokens_per_s: float              # of the whole steps (median)
    forward_tokens_per_s: float      # of the model forwards alone (median)
    gflop: float
    achieved_gflops: float
    roofline_gflops: float           # the model dtype's matmul peak
    roofline_ratio: float
    forward_roofline_ratio: float
    step: Summary
    forward: Summary
    flops_formula: str = FLOPS_FORMULA
    # each timed run against the roofline measured right before and after it (the higher of the
    # two), the median over the runs (see paired_ratio); None where no limit was measured so
    paired_ratio: float | None = None
    paired_rooflines: tuple[float, ...] = ()


def paired_ratio(achieved: list[float], limits: list[float]) -> tuple[float, tuple[float, ...]]:
    """The median of each run's rate over the higher of the limits measured just before and just
    after it (``limits`` holds one more figure than ``achieved``: before the first run, then after
    each), and the limits each run was held to. On a VM whose speed swings between phases (this
    project's AMX host: oneDNN's bf16 matmul at 794 and 1,914 GFLOP/s in one run), a limit measured
    minutes away from a run can belong to another phase; the neighbours of a run share its phase."""
    if len(limits) != len(achieved) + 1 or not achieved:
        raise ValueError(f"paired_ratio: {len(achieved)} runs need {len(achieved) + 1} limits, got {len(limits)}")
    held = tuple(max(a, b) for a, b in zip(limits, limits[1:]))
    return statistics.median(r / h for r, h in zip(achieved, held)), held


def bench_prefill(engine, costs: ModelCosts, sizes: Sizes, matmul_gflops: float,
                  rng: random.Random, limit: Callable[[], float] | None = None) -> PrefillResult:
    """``limit``: where given, measures the roofline (GFLOP/s) again; it is called before the
    first timed run and after each, for :func:`paired_ratio`."""
    num_tokens = min(sizes.prefill_tokens, engine.config.max_model_len - 1)
    budget = engine.config.scheduler.budget_tokens
    max_steps = math.ceil(num_tokens / budget) + 2
    params = SamplingParams(max_new_tokens=1, do_sample=False, ignore_eos=True)
    step_s, forward_s, num_steps, limits = [], [], 0, []
    deadline = time.perf_counter() + sizes.max_measure_s * 2
    with timed_forward(engine) as fwd:
        for i in tqdm(range(1 + sizes.num_repeats), desc="prefill", leave=False, disable=None):
            if i == 1 and limit is not None:
                limits.append(limit())
            # a fresh prompt each run: a repeated one would be served from the prefix cache
            rid = engine.add_request(random_prompt(rng, engine.model_config.vocab_size, num_tokens), params)
            fwd.times_s.clear()
            t0 = time.perf_counter()
            for num_steps in range(1, max_steps + 1):
                engine.step()
                if not engine.has_unfinished():
                    break
            elapsed = time.perf_counter() - t0
            release(engine, [rid])
            if i > 0:  # the first run is warmup
                step_s.append(elapsed)
                forward_s.append(sum(fwd.times_s))
                if limit is not None:
                    limits.append(limit())
            if i > 0 and time.perf_counter() > deadline:
                break
    flops = costs.prefill_flops(num_tokens)
    med, fmed = statistics.median(step_s), statistics.median(forward_s)
    paired, held = (None, ()) if limit is None else paired_ratio([flops / t / 1e9 for t in step_s], limits)
    return PrefillResult(num_tokens, budget, num_steps, num_tokens / med, num_tokens / fmed, flops / 1e9,
                         flops / med / 1e9, matmul_gflops, flops / med / 1e9 / matmul_gflops,
                         flops / fmed / 1e9 / matmul_gflops, Summary.of(step_s), Summary.of(forward_s),
                         paired_ratio=paired, paired_rooflines=held)


@dataclass(frozen=True)
class ChunkResult:
    """One prompt chunk's forward at a later position (its earlier keys in the cache): the step
    a long prompt takes under Dynamic SplitFuse, attention over the keys before it included."""
    num_tokens: int
    start: int
    forward_ms: float                # median of the repeats
    gflop: float
    achieved_gflops: float
    roofline_gflops: float
    roofline_ratio: float
    forward: Summary
    paired_ratio: float | None = None       # as PrefillResult's
    paired_rooflines: tuple[float, ...] = ()


def bench_chunk(engine, costs: ModelCosts, sizes: Sizes, roofline_gflops: float, rng: random.Random,
                num_tokens: int = 256, start: int = 1792,
                limit: Callable[[], float] | None = None) -> ChunkResult | None:
    """The model forward of ``num_tokens`` prompt tokens at position ``start``, after one forward
    of the first ``start`` (a private KV pool: the engine's blocks are left alone); None where the
    model is shorter. The chunk writes the same cache slots each time, so it repeats exactly."""
    if start + num_tokens > engine.config.max_model_len:
        return None
    bs, dev = engine.config.cache.block_size, engine.config.device
    pool = engine.new_pool(math.ceil((start + num_tokens) / bs))
    blocks = list(range(pool.num_blocks))
    ids = random_prompt(rng, engine.model_config.vocab_size, start + num_tokens)
    head = build_batch([SeqInput(ids[:start], 0, blocks, 1)], bs, dev)
    chunk = build_batch([SeqInput(ids[start:], start, blocks, 1)], bs, dev)
    times, limits = [], []
    with torch.inference_mode():
        engine.model(head, pool)
        deadline = time.perf_counter() + sizes.max_measure_s
        for i in range(1 + sizes.num_repeats):
            if i == 1 and limit is not None:
                limits.append(limit())
            t0 = time.perf_counter()
            engine.model(chunk, pool)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i:
                times.append(time.perf_counter() - t0)
                if limit is not None:
                    limits.append(limit())
            if i and time.perf_counter() > deadline:
                break
    flops = costs.chunk_flops(num_tokens, start)
    med = statistics.median(times)
    paired, held = (None, ()) if limit is None else paired_ratio([flops / t / 1e9 for t in times], limits)
    return ChunkResult(num_tokens, start, med * 1e3, flops / 1e9, flops / med / 1e9, roofline_gflops,
                       flops / med / 1e9 / roofline_gflops, Summary.of(times), paired, held)


# -- decode -------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeResult:
    batch_size: int
    tokens_per_s: float              # batch_size / median step
    step: Summary
    forward: Summary
    host_overhead_s: float           # mean step - mean forward
    host_overhead_fraction: float
    num_skipped_steps: int           # steps that were not pure decode (a request finished or was preempted)
    context_tokens: tuple[int, int]  # the first and last timed step's context


def bench_decode(engine, batch_size: int, sizes: Sizes, sampling: SamplingParams,
                 rng: random.Random) -> DecodeResult:
    """Time ``Engine.step()`` while all ``batch_size`` requests decode (no prompt work)."""
    num_warmup = 2
    prompts = [random_prompt(rng, engine.model_config.vocab_size, sizes.decode_prompt_tokens)
               for _ in range(batch_size)]
    ids = [engine.add_request(p, sampling) for p in prompts]
    started: set[str] = set()
    step_s: list[float] = []
    forward_s: list[float] = []
    num_mixed = 0
    try:
        # the requests that already decode take one token of each step's budget
        budget = engine.config.scheduler.budget_tokens
        max_prefill_steps = math.ceil(batch_size * sizes.decode_prompt_tokens / max(1, budget - batch_size)) + 2
        for _ in range(max_prefill_steps):
            started.update(o.request_id for o in engine.step() if o.new_token_ids)
            if len(started) == batch_size:
                break
        if len(started) < batch_size:
            raise RuntimeError(f"only {len(started)} of {batch_size} requests started decoding "
                               f"after {max_prefill_steps} steps")
        deadline = time.perf_counter() + sizes.max_measure_s
        with timed_forward(engine) as fwd:
            bar = tqdm(range(num_warmup + sizes.num_decode_steps), desc=f"decode batch {batch_size}",
                       leave=False, disable=None)
            for i in bar:
                fwd.times_s.clear()
                t0 = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - t0
                stats = engine.stats()
                if stats.last_step_decode_tokens != batch_size or stats.last_step_prompt_tokens:
                    num_mixed += 1  # a request finished or was preempted: not a pure decode step
                elif i >= num_warmup:
                    step_s.append(elapsed)
                    forward_s.append(sum(fwd.times_s))
                if step_s and time.perf_counter() > deadline:
                    break
    finally:
        release(engine, ids)
    if not step_s:
        raise RuntimeError(f"no pure decode step at batch {batch_size} ({num_mixed} mixed steps)")
    step, forward = Summary.of(step_s), Summary.of(forward_s)
    overhead_s = step.mean_s - forward.mean_s
    return DecodeResult(batch_size, batch_size / step.median_s, step, forward, overhead_s, overhead_s / step.mean_s,
                        num_mixed, (sizes.decode_prompt_tokens + num_warmup + 1,
                                    sizes.decode_prompt_tokens + num_warmup + len(step_s)))


@dataclass(frozen=True)
class DecodeBound:
    """Batch-1 decode against reading every weight once per step at the measured bandwidth."""

    tokens_per_s: float
    bound_tokens_per_s: float
    ratio: float
    weight_bytes: int
    bandwidth_gbps: float
    formula: str = WEIGHT_BYTES_FORMULA


def decode_bandwidth(decode: list[DecodeResult], machine: MachineLimits, costs: ModelCosts) -> DecodeBound:
    d1 = next(d for d in decode if d.batch_size == 1)
    bound_tps = machine.decode_bound_gbps * 1e9 / costs.weight_bytes
    return DecodeBound(d1.tokens_per_s, bound_tps, d1.tokens_per_s / bound_tps, costs.weight_bytes,
                       machine.decode_bound_gbps)


# -- forward time against tokens per step ---------------------------------------------------

@dataclass(frozen=True)
class CurvePoint:
    tokens_per_step: int
    ms_per_step: float               # median
    tokens_per_s: float
    times: Summary


@dataclass(frozen=True)
class ForwardCurve:
    points: tuple[CurvePoint, ...]
    suggested_budget_tokens: int
    suggestion_rule: str = "smallest tokens per step within 10% of the best tokens/s"
    default_budget_tokens: int = DEFAULT_BUDGET_TOKENS


def bench_forward_curve(engine, sizes: Sizes, rng: random.Random) -> ForwardCurve:
    """``model(build_batch([one fresh prompt chunk of n tokens]), pool)`` for each n, on a private pool."""
    block_size, device = engine.config.cache.block_size, engine.config.device
    pool = engine.new_pool(math.ceil(max(sizes.step_tokens) / block_size))
    points = []
    for n in tqdm(sizes.step_tokens, desc="forward curve", leave=False, disable=None):
        seq = SeqInput(token_ids=random_prompt(rng, engine.model_config.vocab_size, n), start_pos=0,
                       block_ids=list(range(math.ceil(n / block_size))), num_logits=1)
        batch = build_batch([seq], block_size, device)
        times = time_calls(lambda: engine.model(batch, pool), device, num_warmup=1,
                           num_repeats=sizes.num_repeats, max_s=sizes.max_measure_s, desc=f"forward {n}")
        med = statistics.median(times)
        points.append(CurvePoint(n, med * 1e3, n / med, Summary.of(times)))
    best = max(p.tokens_per_s for p in points)
    knee = next(p.tokens_per_step for p in points if p.tokens_per_s >= 0.9 * best)
    return ForwardCurve(tuple(points), knee)
