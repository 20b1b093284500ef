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
