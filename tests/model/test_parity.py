"""Logits parity with transformers: tiny random configs of every family (sliding windows shorter
than the longest sequence) and the real SmolLM2 GGUF."""
from __future__ import annotations

import pytest
import torch

from fastgen.model.llama import ModelConfig
from fastgen.model.loader import iter_gguf_tensors, load_hf_config, load_model

from .ragged import ragged_logits

TINY = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

FALCON = dict(vocab_size=257, hidden_size=64, ffn_hidden_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, alibi=False)


def _tiny_configs():
    from transformers import (FalconConfig, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, OPTConfig, Phi3Config, PhiConfig,
                              Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    return {
        "llama": LlamaConfig(**TINY, tie_word_embeddings=False),
        "llama-tied-llama3-rope": LlamaConfig(
            **TINY, tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32}),
        "llama-mha-linear-rope": LlamaConfig(
            **{**TINY, "num_key_value_heads": 4},
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        "mistral": MistralConfig(**TINY, sliding_window=None),
        # every layer sees its last 13 positions only: windows start inside a block of 4
        "mistral-window-13": MistralConfig(**TINY, sliding_window=13),
        "qwen2": Qwen2Config(**TINY, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True),
        # layer 0 global, layer 1 a window of 6; a QKV bias
        "qwen3-window-bias": Qwen3Config(**TINY, head_dim=16, use_sliding_window=True, sliding_window=6,
                                         max_window_layers=1, attention_bias=True),
        # a local layer (window 9, its own RoPE theta) then a global one (linear RoPE scaling),
        # an attention scale that is not head_dim ** -0.5
        "gemma3": Gemma3TextConfig(
            **TINY, head_dim=16, query_pre_attn_scalar=12, sliding_window=9,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}}),
        # 8 experts, 2 per token: most experts get no tokens in a step of a few tokens
        "mixtral": MixtralConfig(**TINY, num_local_experts=8, num_experts_per_tok=2),
        # a dense layer (mlp_only_layers), a sparse one with a gated shared expert; top-k not renormalised
        "qwen2_moe": Qwen2MoeConfig(**TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, mlp_only_layers=[0]),
        # fused qkv/gate_up in the checkpoint; LongRoPE within the original context of 128
        "phi3-longrope": Phi3Config(
            **{**TINY, "max_position_embeddings": 512}, original_max_position_embeddings=128, pad_token_id=0,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                             "short_factor": [1.0 + 0.1 * i for i in range(8)],
                             "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
        # learned positions, LayerNorm, multi-head attention, ReLU MLP, biases
        "opt": OPTConfig(vocab_size=257, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=256, word_embed_proj_dim=64),
        # parallel attention and MLP, 6 of 16 head dims rotated, biases (and on the head)
        "phi": PhiConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.375}),
        # Falcon-7B's shape: multi-query, attention and MLP in parallel on one LayerNorm, no biases
        "falcon-7b-shape": FalconConfig(**FALCON, multi_query=True, parallel_attn=True, bias=False),
        # the new architecture: 2 KV heads, their q heads interleaved per group, two LayerNorms, biases
        "falcon-new-arch": FalconConfig(**FALCON, new_decoder_architecture=True, num_kv_heads=2, bias=True),
        # multi-head, sequential attention then MLP
        "falcon-sequential": FalconConfig(**FALCON, multi_query=False, parallel_attn=False, bias=True),
        "qwen3_moe": Qwen3MoeConfig(**TINY, head_dim=16, num_experts=8, num_experts_per_tok=3,
                                    moe_intermediate_size=32, norm_topk_prob=True),
    }


def _kernels(kind: str) -> str:
    """"native" must build on the test machine (it has a C++ compiler): a failure is a failure."""
    if kind == "native":
        from fastgen import kernels

        assert kernels.load(), "fastgen's native CPU kernels did not build"
    return kind


def random_checkpoint(hf_config, path):
    """transformers' model of ``hf_config`` in fp32 with seeded random weights, saved to ``path``
    as an HF checkpoint; returns the model (the reference)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():  # random init leaves some weights at exactly 0/1; perturb them all
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(path)
    return ref


@pytest.mark.parametrize("kind", ["torch", "native"])
@pytest.mark.parametrize("name", list(_tiny_configs()))
def test_tiny_model_matches_transformers(name, kind, tmp_path):
    hf_config = _tiny_configs()[name]
    ref = random_checkpoint(hf_config, tmp_path)

    cfg = ModelConfig.from_hf(load_hf_config(str(tmp_path)))
    assert cfg.layer_windows == _windows(hf_config)
    model = load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"),
                       max_positions=min(256, cfg.max_position_embeddings), kernels=_kernels(kind))
    assert model.kernels == kind
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (1, 5, 23, 40, 67)]
    with torch.no_grad():
        wants = [ref(torch.tensor([seq])).logits[0] for seq in sequences]
    paths: dict[str, int] = {}
    for schedule_seed in (3, 4, 5):
        got = ragged_logits(model, cfg, sequences, block_size=4, seed=schedule_seed, paths=paths)
        for logits, want in zip(got, wants):
            torch.testing.assert_close(logits, want, atol=2e-5, rtol=1e-4)
    assert all(paths.get(p) for p in ("decode", "fresh", "continuing")), paths


def _windows(hf_config) -> tuple[int, ...]:
    """The windows each test config is meant to have (so that a config that silently lost
    its window cannot pass as a full-attention model)."""
    return {13: (13, 13), 6: (0, 6), 9: (9, 0)}.get(getattr(hf_config, "sliding_window", None) or 0, (0, 0)) \
        if getattr(hf_config, "use_sliding_window", True) else (0, 0)


def test_longrope_is_served_within_its_original_context_only(tmp_path):
    from fastgen.errors import ModelLoadError

    hf_config = _tiny_configs()["phi3-longrope"]
    assert ModelConfig.from_hf(hf_config).max_position_embeddings == 128   # the default max_model_len
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="max_model_len <= 128"):
        load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"), max_positions=129)


def test_qwen2_has_qkv_bias_and_it_is_loaded(tmp_path):
    from transformers import Qwen2Config

    cfg = ModelConfig.from_hf(Qwen2Config(**TINY))
    assert cfg.qkv_bias and not cfg.o_bias


@pytest.mark.parametrize("kind", ["torch", "native"])
def test_smollm2_gguf_matches_transformers(kind, smollm2_path, smollm2_reference):
    hf_config = load_hf_config(smollm2_path)
    cfg = ModelConfig.from_hf(hf_config)
    model = load_model(smollm2_path, dtype=torch.float32, device=torch.device("cpu"), max_positions=512,
                       hf_config=hf_config, kernels=_kernels(kind))
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (3, 30, 70)]
    got = ragged_logits(model, cfg, sequences, block_size=16, seed=5, max_chunk=24)
    for seq, logits in zip(sequences, got):
        with torch.no_grad():
            want = smollm2_reference(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(logits, want, atol=2e-3, rtol=1e-3)


def test_gguf_dequantized_weights_match_transformers_loader(smollm2_path, smollm2_reference):
    """Our GGUF reader (names, Q/K un-permutation, dequantization) agrees with transformers'."""
    cfg = ModelConfig.from_hf(load_hf_config(smollm2_path))
    ref = dict(smollm2_reference.named_parameters())
    seen = 0
    for name, tensor in iter_gguf_tensors(smollm2_path, cfg):
        if name.startswith("model.layers.") and not name.startswith(("model.layers.0.", "model.layers.29.")):
            continue
        torch.testing.assert_close(tensor, ref[name].detach(), atol=0, rtol=0)
        seen += 1
    assert seen == 2 * 9 + 2


@pytest.mark.parametrize("kind", ["torch", "native"])
def test_bf16_packed_weights_match_transformers_bf16(kind, tmp_path):
    """The bf16 path (oneDNN-packed weights on CPU) agrees with transformers in bf16."""
    from transformers import AutoModelForCausalLM

    from fastgen.model.layers import PackedWeight

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_tiny_configs()["llama"], dtype=torch.float32).eval()
    ref.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype=torch.bfloat16, device=torch.device("cpu"), max_positions=256,
                       kernels=_kernels(kind))
    cfg = ModelConfig.from_hf(load_hf_config(str(tmp_path)))
    packed = PackedWeight.supported(torch.device("cpu"), torch.bfloat16)
    want = "dense+gemv" if kind == "native" else ("onednn-packed" if packed else "dense")
    assert model.layers[0].mlp.down_proj.format.name == want
    ref = ref.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    sequences = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (9, 33)]
    got = ragged_logits(model, cfg, sequences, block_size=8, seed=6)
    for seq, logits in zip(sequences, got):
        with torch.no_grad():
            want = ref(torch.tensor([seq])).logits[0].float()
        torch.testing.assert_close(logits, want, atol=0.05, rtol=0.05)
        assert (logits.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
