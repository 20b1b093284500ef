"""The engine benchmark's prefill measures prefill: each timed run is a prompt the prefix cache
has not seen (a repeated prompt was served from the cache and printed 16x the matmul roofline)."""
from __future__ import annotations

import random

import pytest


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from fastgen.engine import Engine
    from tests.tiny_model import make_tiny_model

    folder = make_tiny_model(str(tmp_path_factory.mktemp("tiny-bench")))
    return Engine.from_pretrained(folder, dtype="float32", budget_tokens=64, num_blocks=256,
                                  prefix_caching=True)


def test_prefill_runs_are_not_served_from_the_prefix_cache(tiny_engine):
    from fastgen.bench.machine import model_costs
    from fastgen.bench.prefill_decode import bench_prefill
    from fastgen.bench.timing import QUICK

    assert tiny_engine.config.cache.prefix_caching
    before = tiny_engine.stats().prefix_hit_tokens
    result = bench_prefill(tiny_engine, model_costs(tiny_engine), QUICK, 100.0, random.Random(0))
    assert tiny_engine.stats().prefix_hit_tokens == before      # every run computed its whole prompt
    assert result.num_steps >= QUICK.prefill_tokens // 64       # 256 tokens at 64 a step: 4 steps or more


def test_paired_ratio_holds_each_run_to_the_higher_of_its_neighbouring_limits():
    """A limit measured in another phase of the VM does not decide a run's ratio: each run is held
    to the higher of the limits measured just before and just after it, and the median is taken."""
    from fastgen.bench.prefill_decode import paired_ratio

    # three runs at 500 GFLOP/s; the limit swings 1000 -> 2000 -> 1000 -> 1000
    ratio, held = paired_ratio([500.0, 500.0, 500.0], [1000.0, 2000.0, 1000.0, 1000.0])
    assert held == (2000.0, 2000.0, 1000.0)
    assert ratio == 0.25                     # median of 0.25, 0.25, 0.5
    with pytest.raises(ValueError, match="limits"):
        paired_ratio([500.0], [1000.0])


def test_the_prefill_measures_its_limit_beside_every_timed_run(tiny_engine):
    from fastgen.bench.machine import model_costs
    from fastgen.bench.prefill_decode import bench_chunk, bench_prefill
    from fastgen.bench.timing import QUICK

    calls = []

    def limit() -> float:
        calls.append(1)
        return 100.0 * len(calls)            # a rising limit: each run is held to the one after it

    result = bench_prefill(tiny_engine, model_costs(tiny_engine), QUICK, 100.0, random.Random(0), limit=limit)
    runs = result.step.num_samples
    assert len(calls) == runs + 1
    assert result.paired_rooflines == tuple(100.0 * (i + 2) for i in range(runs))
    assert result.paired_ratio is not None and result.paired_ratio < result.roofline_ratio
    calls.clear()
    chunk = bench_chunk(tiny_engine, model_costs(tiny_engine), QUICK, 100.0, random.Random(0), 16, 32, limit=limit)
    assert chunk is not None and len(calls) == chunk.forward.num_samples + 1


def test_the_prompt_goals_take_the_lower_of_the_whole_run_and_the_paired_ratio(tiny_engine):
    """Across a phase change the paired ratio can flatter (a slow phase slowed oneDNN's matmul more
    than fastgen's forward): the goal is held to the lower of the two figures."""
    from dataclasses import replace
    from types import SimpleNamespace

    from fastgen.bench.engine_report import goals
    from fastgen.bench.machine import model_costs
    from fastgen.bench.prefill_decode import bench_prefill
    from fastgen.bench.timing import QUICK

    result = bench_prefill(tiny_engine, model_costs(tiny_engine), QUICK, 100.0, random.Random(0))
    other = SimpleNamespace(ratio=0.5, fraction=0.05)
    high = replace(result, roofline_ratio=0.4, paired_ratio=0.9)
    low = replace(result, roofline_ratio=0.8, paired_ratio=0.3)
    assert goals(high, other, other)[0].measured == 0.4
    assert goals(low, other, other)[0].measured == 0.3
    assert goals(replace(result, roofline_ratio=0.75, paired_ratio=None), other, other)[0].passed
