"""Tensor-parallel shard plans (no processes): every head, feature and vocabulary row has one
owner, each rank's query heads read its own KV heads, a rank's parts of a weight reassemble
the whole product, and a config that cannot be split is refused with its numbers."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgen.errors import ModelLoadError
from fastgen.model.quant import quantize
from fastgen.model.spec import ModelConfig
from fastgen.parallel.shard import shard_plan, split_evenly


def config(heads: int, kv: int, inter: int = 128, vocab: int = 100, head_dim: int = 16) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=vocab, num_layers=2, num_kv_heads=kv, head_dim=head_dim,
                       max_position_embeddings=64, bos_token_id=None, eos_token_ids=(0,),
                       hidden_size=heads * head_dim, intermediate_size=inter, num_heads=heads, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, qkv_bias=True, o_bias=True, mlp_bias=False, hidden_act="silu")


def test_smollm2_three_kv_groups_over_two_ranks():
    """SmolLM2-135M: 9 query heads in 3 KV groups, 1536 intermediate features, 49152 tokens."""
    a, b = shard_plan(config(9, 3, inter=1536, vocab=49152, head_dim=64), 2)
    assert (a.kv_heads, a.heads, b.kv_heads, b.heads) == ((0, 2), (0, 6), (2, 3), (6, 9))
    assert (a.intermediate, b.intermediate) == ((0, 768), (768, 1536))
    assert (a.vocab, b.vocab) == ((0, 24576), (24576, 49152))
    local = b.local_config(config(9, 3, inter=1536, vocab=49152, head_dim=64))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (3, 1, 768, 24576)


def test_more_ranks_than_kv_heads_replicates_them():
    plan = shard_plan(config(8, 2), 4)
    assert [s.kv_heads for s in plan] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.heads for s in plan] == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize("heads,kv,size,numbers", [
    (9, 3, 4, ["tensor_parallel_size=4", "9 attention heads", "3 KV heads"]),
    (2, 2, 4, ["tensor_parallel_size=4", "2 attention heads", "2 KV heads"]),
])
def test_unsplittable_heads_are_refused_with_their_numbers(heads, kv, size, numbers):
    with pytest.raises(ModelLoadError) as e:
        shard_plan(config(heads, kv), size)
    assert all(n in str(e.value) for n in numbers), str(e.value)


def test_too_many_ranks_for_the_mlp_is_refused():
    with pytest.raises(ModelLoadError, match="exceeds the 3 intermediate features"):
        shard_plan(config(4, 4, inter=3), 4)


@settings(max_examples=200, deadline=None)
@given(kv=st.integers(1, 8), group=st.integers(1, 6), size=st.integers(1, 8), inter=st.integers(1, 300),
       vocab=st.integers(8, 500))
def test_every_head_feature_and_token_has_one_owner(kv, group, size, inter, vocab):
    heads = kv * group
    try:
        plan = shard_plan(config(heads, kv, inter=inter, vocab=vocab), size)
    except ModelLoadError:
        splittable_heads = size <= kv or (size % kv == 0 and group % (size // kv) == 0)
        assert not splittable_heads or inter < size
        return
    assert len(plan) == size and [s.rank for s in plan] == list(range(size))
    # query heads, intermediate features and vocabulary rows: a partition in rank order
    for field, total in (("heads", heads), ("intermediate", inter), ("vocab", vocab)):
        ranges = [getattr(s, field) for s in plan]
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(r[1] > r[0] for r in ranges)
    for s in plan:
        # each query head reads KV head h // group, which this rank holds, in uniform groups
        assert s.num_heads % s.num_kv_heads == 0
        local_group = s.num_heads // s.num_kv_heads
        for i, h in enumerate(range(*s.heads)):
            assert h // group == s.kv_heads[0] + i // local_group
    assert set(range(kv)) == {h for s in plan for h in range(*s.kv_heads)}
    if size <= kv:  # no KV head is stored twice, and shares differ by at most one group
        assert sum(s.num_kv_heads for s in plan) == kv
        assert max(s.num_kv_heads for s in plan) - min(s.num_kv_heads for s in plan) <= 1


def _full_weights(cfg: ModelConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    names = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
    w = {f"model.layers.0.self_attn.{n}.weight": torch.randn(shape, generator=gen) for n, shape in names.items()}
    w["model.layers.0.self_attn.q_proj.bias"] = torch.randn(q, generator=gen)
    w["model.layers.0.self_attn.o_proj.bias"] = torch.randn(h, generator=gen)
    w["model.layers.0.mlp.down_proj.weight"] = torch.randn(h, cfg.intermediate_size, generator=gen)
    w["model.layers.0.mlp.gate_proj.weight"] = torch.randn(cfg.intermediate_size, h, generator=gen)
    w["model.embed_tokens.weight"] = torch.randn(cfg.vocab_size, h, generator=gen)
    w["model.layers.0.input_layernorm.weight"] = torch.randn(h, generator=gen)
    return w


@pytest.mark.parametrize("heads,kv,size", [(9, 3, 2), (6, 6, 4), (8, 2, 4)])
def test_the_parts_of_each_weight_make_the_whole(heads, kv, size):
    cfg = config(heads, kv, inter=96, vocab=101)
    full = _full_weights(cfg, torch.Generator().manual_seed(0))
    plan = shard_plan(cfg, size)
    parts = [{n: s.tensor(n, t, cfg) for n, t in full.items()} for s in plan]
    x = torch.randn(3, cfg.num_heads * cfg.head_dim, dtype=torch.float64)
    # row-parallel: the partial products (and the bias once) sum to the full product
    o = "model.layers.0.self_attn.o_proj"
    summed = sum(x[:, s.heads[0] * 16:s.heads[1] * 16] @ p[o + ".weight"].double().T + p[o + ".bias"].double()
                 for s, p in zip(plan, parts))
    torch.testing.assert_close(summed, x @ full[o + ".weight"].double().T + full[o + ".bias"].double())
    # column-parallel and vocabulary rows: each rank's rows are the full tensor's at its ranges
    for s, p in zip(plan, parts):
        q = p["model.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"][s.heads[0] * 16:s.heads[1] * 16])
        assert torch.equal(p["model.layers.0.self_attn.k_proj.weight"],
                           full["model.layers.0.self_attn.k_proj.weight"][s.kv_heads[0] * 16:s.kv_heads[1] * 16])
        assert torch.equal(p["model.embed_tokens.weight"], full["model.embed_tokens.weight"][s.vocab[0]:s.vocab[1]])
        assert torch.equal(p["model.layers.0.input_layernorm.weight"], full["model.layers.0.input_layernorm.weight"])
    assert sum(p["model.embed_tokens.weight"].shape[0] for p in parts) == 101


def test_fused_checkpoint_tensors_are_cut_per_part():
    """Phi-3 ships qkv_proj and gate_up_proj fused: each rank gets its rows of every part."""
    cfg = config(6, 3, inter=64)
    a, b = shard_plan(cfg, 2)
    q, kv = 6 * 16, 3 * 16
    fused = torch.arange(q + 2 * kv, dtype=torch.float32)[:, None].expand(-1, 4)
    rows = b.tensor("model.layers.0.self_attn.qkv_proj.weight", fused, cfg)[:, 0].long().tolist()
    assert rows == [*range(4 * 16, 6 * 16), *range(q + 2 * 16, q + 3 * 16), *range(q + kv + 2 * 16, q + 2 * kv)]
    gate_up = torch.arange(128, dtype=torch.float32)[:, None]
    assert a.tensor("model.layers.0.mlp.gate_up_proj.weight", gate_up, cfg)[:, 0].long().tolist() == \
        [*range(0, 32), *range(64, 96)]


def test_quantized_rows_are_cut_like_the_dense_ones():
    cfg = config(4, 2, inter=128, head_dim=32)
    w = torch.randn(cfg.hidden_size, cfg.intermediate_size)
    q = quantize(w, 4)
    for s in shard_plan(cfg, 2):
        part = s.quant("model.layers.0.mlp.down_proj.weight", q, cfg)
        torch.testing.assert_close(part.dequantize(), q.dequantize()[:, s.intermediate[0]:s.intermediate[1]])
        rows = s.quant("model.layers.0.self_attn.q_proj.weight", quantize(torch.randn(128, 128), 8), cfg)
        assert rows.qweight.shape[0] == s.num_heads * 32


def test_split_evenly():
    assert split_evenly(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_evenly(96, 2, 32) == [(0, 64), (64, 96)]
