"""Phi-2 (``phi``): attention and MLP in parallel on one LayerNorm, added to the residual
together; partial rotary embeddings (``partial_rotary_factor``, 0.4 for Phi-2); a GELU (tanh)
MLP ``fc1``/``fc2``; biases on every projection and on the output head; multi-head attention.

Partial rotary on the shared RoPE ops, which rotate the pairs (i, i + D/2) of a whole head:
transformers rotates the pairs (i, i + R/2) of the first R dims and passes the rest through.
The q and k rows of each head are reordered at load so that its rotary pairs land on the ops'
pairs and the pass-through dims on pairs whose frequency is 0 (cos 1, sin 0). Attention scores
are dot products of q and k, which one permutation of both leaves unchanged; v is not touched.

GGUF (llama.cpp's ``phi2``): ``attn_qkv`` (all q heads, then k, then v, with its bias; files
converted from the new HF layout have ``attn_q``/``attn_k``/``attn_v``), ``attn_norm`` a
LayerNorm, ``ffn_up``/``ffn_down`` = ``fc1``/``fc2``, ``output`` with a bias; the rotary width
is ``{arch}.rope.dimension_count``. llama.cpp rotates the half-split layout, as HF does: no
Q/K permutation beyond the one above (applied to quantized rows too). transformers has no
``phi2`` GGUF config mapping, so the config is built here (:func:`phi_gguf_config`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from .gguf_file import GgufHeader, base_config, default_rope
from .layers import ColumnLinear, LayerNorm, RowLinear
from .llama import Attention, LayerNormCausalLM, Step
from .spec import QKV, Family, GgufNames, ModelConfig, eos_ids, layer_windows


def phi_config(hf: Any) -> ModelConfig:
    if hf.qk_layernorm:
        raise ModelLoadError("phi with qk_layernorm is not supported")
    if hf.hidden_act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ModelLoadError(f"phi with hidden_act={hf.hidden_act!r} is not supported (gelu_new)")
    heads = hf.num_attention_heads
    return ModelConfig(
        model_type=hf.model_type, vocab_size=hf.vocab_size, num_layers=hf.num_hidden_layers,
        num_kv_heads=hf.num_key_value_heads or heads, head_dim=hf.hidden_size // heads,
        max_position_embeddings=hf.max_position_embeddings, bos_token_id=hf.bos_token_id,
        eos_token_ids=eos_ids(hf), hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
        num_heads=heads, rms_norm_eps=hf.layer_norm_eps, tie_word_embeddings=bool(hf.tie_word_embeddings),
        qkv_bias=True, o_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh", layer_windows=layer_windows(hf))


def rotary_dims(hf: Any, head_dim: int) -> int:
    params = getattr(hf, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ModelLoadError(f"phi with RoPE type {params['rope_type']!r} is not supported (default only)")
    r = int(head_dim * params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
    if r % 2:
        raise ModelLoadError(f"phi: {r} rotary dims is odd")
    return r


def head_permutation(head_dim: int, rot: int) -> torch.Tensor:
    """``new[j] = old[perm[j]]`` within a head: rotary pairs (i, i + rot/2) -> (i, i + D/2), the
    pass-through dims after them in each half."""
    half, pass_half = rot // 2, (head_dim - rot) // 2
    first = [*range(half), *range(rot, rot + pass_half)]
    second = [*range(half, rot), *range(rot + pass_half, head_dim)]
    return torch.tensor(first + second)


class PhiDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.fc1 = ColumnLinear(cfg.hidden_size, [cfg.intermediate_size], bias=True)
        self.fc2 = RowLinear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        h = self.input_layernorm(x)
        return self.self_attn(h, step) + self.fc2(F.gelu(self.fc1(h), approximate="tanh")) + x


class PhiForCausalLM(LayerNormCausalLM):
    def __init__(self, cfg: ModelConfig, hf_config: Any, max_positions: int) -> None:
        super().__init__(cfg, hf_config, max_positions)
        if not cfg.tie_word_embeddings:
            self.lm_head = RowLinear(cfg.hidden_size, cfg.vocab_size, bias=True)
        self.perm = head_permutation(cfg.head_dim, rotary_dims(hf_config, cfg.head_dim))

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return PhiDecoderLayer(cfg, layer)

    def rope_tables(self, hf_config: Any, max_positions: int) -> list[tuple[torch.Tensor, float]]:
        d = self.config.head_dim
        rot = rotary_dims(hf_config, d)
        theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
        return [(torch.cat([inv, torch.zeros((d - rot) // 2)]), 1.0)]   # frequency 0: passed through

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        name = name.replace(".self_attn.dense.", ".self_attn.o_proj.").replace(".mlp.fc", ".fc")
        if name.startswith("final_layernorm."):
            name = "norm." + name.removeprefix("final_layernorm.")
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            d = self.config.head_dim
            rows = tensor.reshape(-1, d, *tensor.shape[1:])                 # [heads, D, (hidden)]
            tensor = rows[:, self.perm].reshape(tensor.shape)
        return name, tensor

    def checkpoint_quant(self, name: str, quant):
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            d = self.config.head_dim
            heads = quant.qweight.shape[0] // d
            quant = quant.select((torch.arange(heads)[:, None] * d + self.perm).flatten())
        return name, quant


def phi_gguf_config(header: GgufHeader) -> Any:
    from gguf import Keys
    from transformers import PhiConfig

    c = base_config(header)
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    rotary = header.key(Keys.Rope.DIMENSION_COUNT, head_dim)
    return PhiConfig(**c, intermediate_size=header.key(Keys.LLM.FEED_FORWARD_LENGTH),
                     layer_norm_eps=header.key(Keys.Attention.LAYERNORM_EPS),
                     rope_parameters=default_rope(header, rotary / head_dim), hidden_act="gelu_new",
                     qk_layernorm=False)


_LAYER_GGUF = {
    "attn_norm": "input_layernorm", "attn_qkv": QKV,
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_up": "fc1", "ffn_down": "fc2",
}
_TOP_GGUF = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

PHI = Family(PhiForCausalLM, phi_config, GgufNames("phi2", _LAYER_GGUF, _TOP_GGUF, config=phi_gguf_config))
