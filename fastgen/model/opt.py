"""OPT (Meta's Open Pre-trained Transformers, 125M-66B with LayerNorm before each block): learned
absolute positions instead of RoPE, LayerNorm with a bias, multi-head attention and a ReLU MLP
(``fc1``/``fc2``), biases on every projection, the output projection tied to the embedding.

Positions: transformers adds an offset of 2 to each token's position in the learned table
(:data:`POSITION_OFFSET`). The attention layers are the shared ones with an identity rotation
(a RoPE table of cos 1, sin 0), so both kernel paths write the keys and attend as for any other
family. OPT-350m (LayerNorm after each block, ``word_embed_proj_dim`` != ``hidden_size``) and
non-ReLU activations are rejected. No GGUF layout: llama.cpp defines no OPT architecture, so
there is no OPT GGUF to read (load it from a Hugging Face folder).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..batch import RaggedBatch
from ..errors import ModelLoadError
from .layers import ColumnLinear, LayerNorm, RowLinear
from .llama import Attention, LayerNormCausalLM, Step
from .spec import Family, ModelConfig, eos_ids

POSITION_OFFSET = 2


def opt_config(hf: Any) -> ModelConfig:
    unsupported = {
        "do_layer_norm_before=False (OPT-350m)": not hf.do_layer_norm_before,
        f"word_embed_proj_dim={hf.word_embed_proj_dim} != hidden_size":
            (hf.word_embed_proj_dim or hf.hidden_size) != hf.hidden_size,
        f"activation_function={hf.activation_function!r}": hf.activation_function != "relu",
        "layer_norm_elementwise_affine=False": not hf.layer_norm_elementwise_affine,
        "_remove_final_layer_norm=True": bool(getattr(hf, "_remove_final_layer_norm", False)),
    }
    bad = [what for what, is_set in unsupported.items() if is_set]
    if bad:
        raise ModelLoadError(f"opt with {', '.join(bad)} is not supported")
    bias = bool(hf.enable_bias)
    return ModelConfig(
        model_type=hf.model_type, vocab_size=hf.vocab_size, num_layers=hf.num_hidden_layers,
        num_kv_heads=hf.num_attention_heads, head_dim=hf.hidden_size // hf.num_attention_heads,
        max_position_embeddings=hf.max_position_embeddings, bos_token_id=hf.bos_token_id,
        eos_token_ids=eos_ids(hf), hidden_size=hf.hidden_size, intermediate_size=hf.ffn_dim,
        num_heads=hf.num_attention_heads, rms_norm_eps=1e-5,   # nn.LayerNorm's eps, as transformers builds it
        tie_word_embeddings=bool(hf.tie_word_embeddings), qkv_bias=bias, o_bias=bias, mlp_bias=bias,
        hidden_act="relu", layer_windows=(0,) * hf.num_hidden_layers)


class OptDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn_layer_norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc1 = ColumnLinear(cfg.hidden_size, [cfg.intermediate_size], bias=cfg.mlp_bias)
        self.fc2 = RowLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), step)
        return x + self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))


class OptForCausalLM(LayerNormCausalLM):
    def __init__(self, cfg: ModelConfig, hf_config: Any, max_positions: int) -> None:
        super().__init__(cfg, hf_config, max_positions)
        num = hf_config.max_position_embeddings + POSITION_OFFSET
        self.embed_positions = nn.Embedding(num, cfg.hidden_size, _weight=torch.empty(num, cfg.hidden_size))

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return OptDecoderLayer(cfg, layer)

    def rope_tables(self, hf_config: Any, max_positions: int) -> list[tuple[torch.Tensor, float]]:
        return [(torch.zeros(self.config.head_dim // 2), 1.0)]   # cos 1, sin 0: no rotation

    def embed(self, batch: RaggedBatch) -> torch.Tensor:
        return self.embed_tokens(batch.token_ids) + self.embed_positions(batch.positions + POSITION_OFFSET)

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        name = name.removeprefix("decoder.").replace(".self_attn.out_proj.", ".self_attn.o_proj.")
        if name.startswith("final_layer_norm."):
            name = "norm." + name.removeprefix("final_layer_norm.")
        return name, tensor


OPT = Family(OptForCausalLM, opt_config)
