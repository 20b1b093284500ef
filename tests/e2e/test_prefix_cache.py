"""Prefix caching end to end: greedy outputs with the cache equal those without it, on the
real SmolLM2 and on a tiny random-weight Llama, under splitting, fusing and preemption; the
tenants of a server and the salts of a pipeline never share blocks."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from fastgen.config import CacheConfig, SchedulerConfig
from fastgen.engine import Engine
from fastgen.model.llama import ModelConfig
from fastgen.model.loader import load_hf_config, load_model
from fastgen.pipeline import Pipeline

SHARED = ("You are a careful assistant. Answer briefly and truthfully. " * 3)
PROMPTS = [SHARED + "The capital of France is", SHARED + "List three colors:",
           SHARED + "The capital of France is", SHARED]


def small_engine(base: Engine, *, caching: bool, num_blocks: int, budget: int, policy: str = "splitfuse",
                 model=None, model_config=None, max_seqs: int = 4) -> Engine:
    config = dataclasses.replace(
        base.config, cache=CacheConfig(block_size=8, num_blocks=num_blocks, prefix_caching=caching),
        scheduler=SchedulerConfig(budget_tokens=budget, max_seqs=max_seqs, reserve_blocks=1, policy=policy))
    return Engine(config, model or base.model, base.tokenizer, model_config or base.model_config)


def test_smollm2_greedy_with_prefix_cache_equals_without(smollm2_pipe):
    """Prompts that share a long prefix (and repeat whole), in two rounds so the second is all
    hits, under a 16-token budget (splitting, fusing) and a 10-block pool (preemption)."""
    results = {}
    for caching in (False, True):
        small = small_engine(smollm2_pipe.engine, caching=caching, num_blocks=10, budget=16)
        pipe = Pipeline(small)
        rounds = [pipe(PROMPTS, max_new_tokens=10, do_sample=False, ignore_eos=True) for _ in range(2)]
        results[caching] = [[list(r.token_ids) for r in rs] for rs in rounds], rounds, small
        assert small.allocator.num_used_blocks == 0
        small.allocator.check()
    (off, _, _), (on, rounds, small) = results[False], results[True]
    assert on == off
    assert on[0][0] == on[0][2] == on[1][0]
    cached = [[r.num_cached_tokens for r in rs] for rs in rounds]
    assert all(c > 0 for c in cached[1]), cached                  # round two: every prompt hits
    assert sum(r.num_preemptions for rs in rounds for r in rs) > 0
    assert small.stats().prefix_hit_tokens == sum(map(sum, cached))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_pipe):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(hf).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp("tiny-llama")
    ref.save_pretrained(path)
    base = smollm2_pipe.engine
    model = load_model(str(path), dtype=torch.float32, device=torch.device("cpu"), max_positions=512,
                       kernels=base.config.kernels)
    return base, model, ModelConfig.from_hf(load_hf_config(str(path)))


@pytest.mark.parametrize("policy", ["splitfuse", "prefill-first", "static"])
def test_tiny_greedy_with_prefix_cache_equals_without(tiny, policy):
    """Many requests over three shared prefixes, arriving while others run, in a pool that
    forces preemption: token for token the same with and without the cache."""
    base, model, mcfg = tiny
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 257) for _ in range(n)] for n in (40, 17, 64)]
    prompts = [rng.choice(prefixes) + [rng.randrange(1, 257) for _ in range(rng.randrange(1, 12))]
               for _ in range(14)]
    outs, engines = {}, {}
    for caching in (False, True):
        eng = small_engine(base, caching=caching, num_blocks=24, budget=24, policy=policy, model=model,
                           model_config=mcfg)
        pipe = Pipeline(eng)
        first = pipe(prompts[:7], max_new_tokens=20, do_sample=False, ignore_eos=True)
        second = pipe(prompts[7:], max_new_tokens=20, do_sample=False, ignore_eos=True)
        outs[caching] = [list(r.token_ids) for r in first + second]
        engines[caching] = (eng, first + second)
        assert eng.allocator.num_used_blocks == 0
        eng.allocator.check()
    assert outs[True] == outs[False]
    eng, responses = engines[True]
    assert sum(r.num_cached_tokens for r in responses) > 0
    if policy != "static":
        assert sum(r.num_preemptions for r in responses) > 0


def test_pipeline_salts_partition_the_cache(smollm2_pipe):
    pipe = Pipeline(small_engine(smollm2_pipe.engine, caching=True, num_blocks=64, budget=256))
    [a] = pipe([PROMPTS[0]], max_new_tokens=2, do_sample=False, cache_salt="alice")
    [b] = pipe([PROMPTS[0]], max_new_tokens=2, do_sample=False, cache_salt="bob")
    [c] = pipe([PROMPTS[0]], max_new_tokens=2, do_sample=False, cache_salt="alice")
    [d] = pipe([PROMPTS[0]], max_new_tokens=2, do_sample=False)
    assert a.num_cached_tokens == b.num_cached_tokens == d.num_cached_tokens == 0
    assert c.num_cached_tokens == (c.prompt_length - 1) // 8 * 8
    assert a.token_ids == b.token_ids == c.token_ids == d.token_ids
