"""Routed experts run grouped: one product per expert over all of its tokens, none for an expert
without tokens, and the block's output equals transformers' sparse MoE block."""
from __future__ import annotations

import pytest
import torch

from fastgen.model.loader import load_model
from fastgen.model.moe import MoE

from .test_parity import random_checkpoint

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def _configs():
    from transformers import MixtralConfig, Qwen2MoeConfig

    return {"mixtral": MixtralConfig(**TINY, num_local_experts=8, num_experts_per_tok=2),
            "qwen2_moe": Qwen2MoeConfig(**TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=24)}


@pytest.mark.parametrize("name", list(_configs()))
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_experts_run_grouped_and_match_transformers(name, num_tokens, tmp_path):
    ref = random_checkpoint(_configs()[name], tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"), max_positions=64)
    moe = model.layers[0].mlp
    assert isinstance(moe, MoE)
    calls: dict[int, list[int]] = {}
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda mod, args, out, e=e: calls.setdefault(e, []).append(args[0].shape[0]))
    x = torch.randn(num_tokens, TINY["hidden_size"], generator=torch.Generator().manual_seed(num_tokens))
    got = moe(x, model.ops)
    with torch.no_grad():
        want = ref.model.layers[0].mlp(x[None])[0]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    _, ids = moe.route(x)
    routed = torch.bincount(ids.flatten(), minlength=8).tolist()
    # each expert with tokens multiplied them all at once; the others were never called
    assert calls == {e: [n] for e, n in enumerate(routed) if n}
    if num_tokens < 4:
        assert routed.count(0) >= 8 - 2 * num_tokens     # experts that received no tokens
