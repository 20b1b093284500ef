"""Every family with a llama.cpp layout loads from GGUF: a tiny random model converted as llama.cpp
converts it (tests/model/gguf_convert.py, names from gguf-py's table), loaded through fastgen's
loader, gives transformers' logits on the HF folder of the same weights (fp32, through ragged
schedules); MoE steps where experts receive no tokens included; quantized files too."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fastgen.errors import ModelLoadError
from fastgen.model import loader
from fastgen.model.llama import ModelConfig
from fastgen.model.loader import load_hf_config, load_model
from fastgen.model.moe import MoE
from fastgen.model.quant import QuantWeight

from .gguf_convert import convert, round_to
from .ragged import ragged_logits
from .test_parity import FALCON, TINY, _kernels


def _configs():
    from transformers import FalconConfig, MixtralConfig, Phi3Config, PhiConfig, Qwen2MoeConfig, Qwen3MoeConfig

    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}
    return {  # name: (arch, HF config, options of the conversion)
        "mixtral": ("llama", MixtralConfig(**TINY, num_local_experts=8, num_experts_per_tok=2), {}),
        "mixtral-per-expert": ("llama", MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
                               {"per_expert": True}),
        "mixtral-q8_0": ("llama", MixtralConfig(**TINY, num_local_experts=8, num_experts_per_tok=2),
                         {"qtype": "Q8_0"}),
        "qwen2_moe": ("qwen2moe", Qwen2MoeConfig(**TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=48), {}),
        "qwen3_moe": ("qwen3moe", Qwen3MoeConfig(**TINY, head_dim=16, num_experts=8, num_experts_per_tok=3,
                                                 moe_intermediate_size=32, norm_topk_prob=True), {}),
        "phi3": ("phi3", Phi3Config(**TINY, pad_token_id=0), {}),
        "phi3-longrope": ("phi3", Phi3Config(**{**TINY, "max_position_embeddings": 512}, pad_token_id=0,
                                             original_max_position_embeddings=128, rope_parameters=longrope), {}),
        "phi2": ("phi2", PhiConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=256,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.375}), {}),
        "phi2-q4_0": ("phi2", PhiConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=256,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.375}), {"qtype": "Q4_0"}),
        "falcon-7b-shape": ("falcon", FalconConfig(**FALCON, multi_query=True, parallel_attn=True, bias=False), {}),
        "falcon-new-arch": ("falcon", FalconConfig(**FALCON, new_decoder_architecture=True, num_kv_heads=2,
                                                   bias=True), {}),
    }


@pytest.fixture(autouse=True)
def _meta_cache_in_tmp(tmp_path, monkeypatch):
    """The converted config/tokenizer of each test file stays in the test's folder."""
    monkeypatch.setattr(loader, "_gguf_meta_dir", lambda path: tmp_path / "gguf-meta")
    loader._load_gguf_meta_at.cache_clear()


def _reference(hf_config, folder, qtype: str | None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():   # random init leaves some weights at exactly 0/1; perturb them all
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
            if qtype is not None and p.dim() >= 2 and p.shape[-1] % 32 == 0:
                p.copy_(torch.from_numpy(round_to(qtype, p.numpy())))
    ref.save_pretrained(folder)
    return ref


@pytest.mark.parametrize("name", list(_configs()))
def test_gguf_file_matches_transformers_on_the_hf_folder(name, tmp_path):
    arch, hf_config, options = _configs()[name]
    ref = _reference(hf_config, tmp_path / "hf", options.get("qtype"))
    path = str(tmp_path / f"{name}.gguf")
    convert(tmp_path / "hf", path, arch, **options)

    gguf_config = load_hf_config(path)
    assert gguf_config.model_type == hf_config.model_type
    cfg = ModelConfig.from_hf(gguf_config)
    want = ModelConfig.from_hf(hf_config)   # the same numbers (eps stored as fp32; the ids: the tokenizer's)
    assert cfg == dataclasses.replace(want, rms_norm_eps=float(np.float32(want.rms_norm_eps)), bos_token_id=256,
                                      eos_token_ids=(256,))
    quantized = "qtype" in options
    model = load_model(path, dtype=torch.float32, device=torch.device("cpu"),
                       max_positions=min(256, cfg.max_position_embeddings),
                       kernels=_kernels("native" if quantized else "torch"), quantization="auto")
    if quantized:   # the shipped blocks are what the decode rows multiply (experts and fused parts alike)
        layer = model.layers[0]
        linear = layer.mlp.experts[0].gate_up_proj if cfg.moe else layer.self_attn.qkv_proj
        assert isinstance(linear.format, QuantWeight)
    idle = _count_idle_expert_steps(model)
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (1, 5, 23, 40)]
    with torch.no_grad():
        wants = [ref(torch.tensor([seq])).logits[0] for seq in sequences]
    for schedule_seed in (3, 4):
        got = ragged_logits(model, cfg, sequences, block_size=4, seed=schedule_seed)
        for logits, want in zip(got, wants):
            torch.testing.assert_close(logits, want, atol=2e-5, rtol=1e-4)
    if cfg.moe:
        assert idle["steps"] > 0, "no step left an expert without tokens"


def _count_idle_expert_steps(model) -> dict[str, int]:
    """Counts the MoE steps in which some expert received no token."""
    idle = {"steps": 0}
    for m in model.modules():
        if isinstance(m, MoE):
            def hook(moe, args, out):
                _, ids = moe.route(args[0])
                idle["steps"] += int(len(set(ids.flatten().tolist())) < len(moe.experts))
            m.register_forward_hook(hook)
    return idle


def test_unsupported_gguf_architecture_is_named_with_the_supported_ones(tmp_path):
    import gguf

    for arch, expect in (("bloom", r"'bloom' is not supported; supported: \[.*'falcon'.*'phi2'.*'qwen2moe'"),
                         ("opt", r"'opt' is not supported.*\['opt'\] from Hugging Face folders only: llama.cpp "
                                 r"defines no GGUF layout")):
        path = str(tmp_path / f"{arch}.gguf")
        writer = gguf.GGUFWriter(path, arch)
        writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ModelLoadError, match=expect):
            load_model(path, dtype=torch.float32, device=torch.device("cpu"), max_positions=8)


def test_gguf_moe_file_without_expert_sizes_says_which_key_is_missing(tmp_path):
    import gguf

    path = str(tmp_path / "qwen3moe.gguf")
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_expert_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="cannot build the 'qwen3moe' config: .*no metadata key 'qwen3moe.block_count'"):
        load_hf_config(path)
