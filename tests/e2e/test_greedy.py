"""Greedy generation on the real SmolLM2 (fp32) equals transformers' greedy generate, token for token."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fastgen.config import CacheConfig, SchedulerConfig
from fastgen.engine import Engine
from fastgen.request import SamplingParams
from fastgen.pipeline import Pipeline

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a short story about a robot who learns to paint. Once upon a time,",
    "List three colors:",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference_outputs(smollm2_reference, smollm2_pipe):
    tok = smollm2_pipe.tokenizer
    outs = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = smollm2_reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                             eos_token_id=None, pad_token_id=tok.eos_token_id)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


def test_greedy_alone_matches_transformers(smollm2_pipe, reference_outputs):
    for prompt, want in zip(PROMPTS, reference_outputs):
        [r] = smollm2_pipe([prompt], max_new_tokens=NEW_TOKENS, do_sample=False, ignore_eos=True)
        assert list(r.token_ids) == want, prompt


@pytest.mark.parametrize("policy", ["splitfuse", "prefill-first", "static"])
def test_greedy_concurrent_split_and_preempted_matches_transformers(smollm2_pipe, reference_outputs, policy):
    """A 7-token budget forces prompt splitting and fusing, sampled traffic shares the batches,
    and a 6-block KV pool (block size 8) cannot hold everyone, so requests get preempted and
    recomputed; the greedy outputs must still equal the reference."""
    engine = smollm2_pipe.engine
    config = dataclasses.replace(
        engine.config, cache=CacheConfig(block_size=8, num_blocks=6),
        scheduler=SchedulerConfig(budget_tokens=7, max_seqs=6, reserve_blocks=1, policy=policy))
    small = Engine(config, engine.model, engine.tokenizer, engine.model_config)
    noise = [small.add_request("Write a poem about the sea", SamplingParams(max_new_tokens=12, seed=i))
             for i in range(2)]
    responses = Pipeline(small)(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False, ignore_eos=True)
    for prompt, r, want in zip(PROMPTS, responses, reference_outputs):
        assert list(r.token_ids) == want, prompt
    if policy == "splitfuse":
        assert sum(r.num_preemptions for r in responses) > 0
    while small.has_unfinished():
        small.step()
    for rid in noise:
        assert small.response(rid).generated_length == 12
    assert small.allocator.num_free_blocks == 6


def test_prompt_and_output_logprobs_match_transformers_when_split(smollm2_pipe, smollm2_reference):
    engine = smollm2_pipe.engine
    config = dataclasses.replace(engine.config, scheduler=SchedulerConfig(budget_tokens=5, max_seqs=4, reserve_blocks=0))
    small = Engine(config, engine.model, engine.tokenizer, engine.model_config)
    prompt = PROMPTS[2]
    [r] = Pipeline(small)([prompt], max_new_tokens=3, do_sample=False, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    ids = small.tokenizer(prompt).input_ids + list(r.token_ids)
    with torch.no_grad():
        want = torch.log_softmax(smollm2_reference(torch.tensor([ids])).logits[0].float(), dim=-1)
    n = r.prompt_length
    assert len(r.prompt_logprobs) == n - 1
    for pos, lp in enumerate(r.prompt_logprobs, start=1):
        assert lp.token_id == ids[pos]
        assert lp.logprob == pytest.approx(want[pos - 1, ids[pos]].item(), abs=2e-3)
    for k, lp in enumerate(r.logprobs):
        assert lp.logprob == pytest.approx(want[n - 1 + k, ids[n + k]].item(), abs=2e-3)

