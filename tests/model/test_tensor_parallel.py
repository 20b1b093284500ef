"""Tensor parallelism on this machine: two processes over gloo against one process.

Greedy outputs (and their logprobs) equal TP=1 token for token in fp32, on tiny GQA and MHA
configs whose heads split evenly and unevenly, with and without biases and tied embeddings,
and on the real SmolLM2 (its 9 query heads in 3 KV groups split 6 + 3); each rank holds about
half of the weights and exactly its KV heads' share of the KV pool; a rank that dies ends the
replica with an error naming it, at once."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from fastgen.engine import Engine
from fastgen.pipeline import Pipeline
from fastgen.errors import ModelLoadError, RankFailedError
from fastgen.parallel.replica import weight_bytes
from fastgen.request import SamplingParams

PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,", "def fibonacci(n):", "Once upon a time"]
OPTS = dict(dtype="float32", budget_tokens=64, num_blocks=64)


def tiny_folder(tmp_path_factory, name: str, model_type: str = "llama", **overrides) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastgen.model.loader import default_model_path, load_tokenizer

    folder = str(tmp_path_factory.mktemp(name))
    tokenizer = load_tokenizer(default_model_path())
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
              vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    kw.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), dtype=torch.float32).eval()
    with torch.no_grad():  # wider logits than the default init: greedy choices far from ties
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def greedy(engine: Engine, n: int = 16) -> list[tuple[tuple[int, ...], list[float]]]:
    pipe = Pipeline(engine)
    out = pipe(PROMPTS, max_new_tokens=n, do_sample=False, ignore_eos=True, logprobs=0)
    return [(r.token_ids, [lp.logprob for lp in r.logprobs]) for r in out]


def assert_same(tp1, tp2) -> None:
    for (ids1, lp1), (ids2, lp2) in zip(tp1, tp2):
        assert ids1 == ids2
        torch.testing.assert_close(torch.tensor(lp2), torch.tensor(lp1), atol=2e-4, rtol=0)


CONFIGS = {
    # name: (model_type, overrides) -- heads/KV heads and how they split over 2 ranks
    "gqa-even": ("llama", {}),                                               # 4/2: 2+2 heads, 1+1 KV
    "gqa-uneven": ("llama", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                                 vocab_size=49153)),                         # 3 groups: 4+2 heads, odd vocab
    "mha-uneven": ("llama", dict(hidden_size=80, num_attention_heads=5, num_key_value_heads=5,
                                 intermediate_size=100)),                    # 3+2 heads, 50+50 features
    "qwen2-bias-untied": ("qwen2", dict(tie_word_embeddings=False)),         # q/k/v biases, own lm_head
    "qwen3-qk-norm": ("qwen3", dict(head_dim=16)),                           # per-head norms
    "phi3-fused": ("phi3", dict(pad_token_id=0)),                            # qkv/gate_up shipped fused
    "gemma3": ("gemma3_text", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"])),
}


@pytest.mark.parametrize("name", [*CONFIGS, "gqa-even-over-gloo"])
def test_two_ranks_equal_one_token_for_token(tmp_path_factory, monkeypatch, name):
    if name.endswith("-over-gloo"):   # collectives through gloo instead of shared memory
        monkeypatch.setenv("FASTGEN_TP_SHM", "0")
        name = name.removesuffix("-over-gloo")
    model_type, overrides = CONFIGS[name]
    folder = tiny_folder(tmp_path_factory, name, model_type, **overrides)
    one = Engine.from_pretrained(folder, **OPTS)
    expected = greedy(one)
    two = Engine.from_pretrained(folder, tensor_parallel_size=2, **OPTS)
    try:
        assert_same(expected, greedy(two))
        # the pool of each rank holds its own KV heads: rank 0's here
        assert two.pool.keys[0].shape[2] == two.model.shards[0].num_kv_heads
        assert (two.model.group.shm is None) == (os.environ.get("FASTGEN_TP_SHM") == "0")
    finally:
        two.close()


def test_real_smollm2_two_ranks_equal_one_and_hold_half(smollm2_pipe):
    """SmolLM2-135M as shipped (Q4_1 rows kept quantized, cut per rank), fp32."""
    expected = greedy(smollm2_pipe.engine, 32)
    engine = Engine.from_pretrained(None, tensor_parallel_size=2, **OPTS)
    try:
        assert_same(expected, greedy(engine, 32))
        ranks = engine.model.rank_memory([engine.pool])
        one = smollm2_pipe.engine
        one_weights = weight_bytes(one.model)
        one_kv = one.pool.num_bytes * OPTS["num_blocks"] / one.config.cache.num_blocks
        for r, mem in enumerate(ranks):
            share = engine.model.shards[r].num_kv_heads / 3        # SmolLM2: 3 KV heads
            assert mem["kv_bytes"] == pytest.approx(one_kv * share)
            assert 0.40 < mem["weight_bytes"] / one_weights < 0.60, (r, mem, one_weights)
        assert sum(m["weight_bytes"] for m in ranks) == pytest.approx(one_weights, rel=0.02)
    finally:
        engine.close()


def test_a_dead_rank_ends_the_replica_with_a_clear_error(tmp_path_factory):
    folder = tiny_folder(tmp_path_factory, "dies")
    engine = Engine.from_pretrained(folder, tensor_parallel_size=2, **OPTS)
    try:
        engine.add_request("Hello", SamplingParams(max_new_tokens=4, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        worker = engine.model.group.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        rid = engine.add_request("Hello again", SamplingParams(max_new_tokens=4, temperature=0.0))
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 exited with code -9"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 10
        assert engine.response(rid).finish_reason.value == "error"
    finally:
        engine.close()


def test_unsplittable_config_is_refused_before_any_rank_starts(tmp_path_factory):
    folder = tiny_folder(tmp_path_factory, "odd", hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=4 cannot shard 3 attention heads over 3 KV"):
        Engine.from_pretrained(folder, tensor_parallel_size=4, **OPTS)


def test_a_family_without_a_sharding_rule_is_refused_naming_its_layer(tmp_path_factory):
    folder = tiny_folder(tmp_path_factory, "moe", "mixtral", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ModelLoadError, match=r"mixtral has layer .layers.0.mlp.gate. it does not know how to split"):
        Engine.from_pretrained(folder, tensor_parallel_size=2, **OPTS)
