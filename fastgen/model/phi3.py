"""Phi-3 (and Phi-3.5 / Phi-4-mini where the rotary is whole): the Llama decoder with the QKV and
gate/up projections fused in the checkpoint (``qkv_proj``, ``gate_up_proj``, loaded as shipped),
LongRoPE ("su") scaling, and a sliding window where the config sets one.

LongRoPE: transformers rotates with the short factors while a sequence is within
``original_max_position_embeddings`` and re-rotates the whole sequence with the long factors
past it; a KV cache cannot follow that switch, so fastgen serves up to the original context
(the default ``max_model_len`` of a LongRoPE checkpoint) with the short factors and their
attention scaling, exactly as transformers computes them there, and rejects a longer
``max_model_len``.

GGUF (llama.cpp's ``phi3``): ``attn_qkv`` and ``ffn_up`` (gate then up) are fused as in the HF
checkpoint and cut into their parts at load (so that Q4_0/Q4_1/Q8_0 parts stay quantized);
LongRoPE's factors are the tensors ``rope_factors_short``/``rope_factors_long``, read into the
config with ``{arch}.rope.scaling.original_context_length`` and ``.attn_factor``; no Q/K
permutation (llama.cpp rotates Phi-3 in the half-split layout). transformers' GGUF config
mapping for ``phi3`` drops the LongRoPE factors, so the config is built here (:func:`phi3_gguf_config`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ModelLoadError
from .gguf_file import GgufHeader, base_config, default_rope
from .llama import _TOP_GGUF, LlamaForCausalLM, llama_config
from .spec import QKV, Family, GgufNames, ModelConfig, Split


def phi3_config(hf: Any) -> ModelConfig:
    cfg = llama_config(hf)
    params = getattr(hf, "rope_parameters", None) or {}
    if params.get("rope_type") == "longrope":
        original = params.get("original_max_position_embeddings") or hf.original_max_position_embeddings
        cfg = dataclasses.replace(cfg, max_position_embeddings=min(cfg.max_position_embeddings, original))
    return cfg


def phi3_gguf_config(header: GgufHeader) -> Any:
    from gguf import Keys
    from transformers import Phi3Config

    c = base_config(header)
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    rotary = header.key(Keys.Rope.DIMENSION_COUNT, head_dim)
    rope = default_rope(header, rotary / head_dim)
    short, long = header.tensor("rope_factors_short.weight"), header.tensor("rope_factors_long.weight")
    extra = {}
    if (short is None) != (long is None):
        raise ModelLoadError("a phi3 GGUF with only one of rope_factors_short / rope_factors_long")
    if short is not None:
        original = header.key(Keys.Rope.SCALING_ORIG_CTX_LEN)
        rope.update(rope_type="longrope", short_factor=[float(f) for f in short.data.astype("float32")],
                    long_factor=[float(f) for f in long.data.astype("float32")],
                    original_max_position_embeddings=original)
        attn_factor = header.key(Keys.Rope.SCALING_ATTN_FACTOR, None)
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
        extra["original_max_position_embeddings"] = original
    return Phi3Config(**c, **extra, intermediate_size=header.key(Keys.LLM.FEED_FORWARD_LENGTH),
                      rms_norm_eps=header.key(Keys.Attention.LAYERNORM_RMS_EPS), rope_parameters=rope,
                      sliding_window=header.key(Keys.Attention.SLIDING_WINDOW, None))


GATE_UP = Split(("mlp.gate_proj", "mlp.up_proj"), lambda cfg: (cfg.intermediate_size,) * 2)
_LAYER_GGUF = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_qkv": QKV, "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_up": GATE_UP, "ffn_down": "mlp.down_proj",
}

PHI3 = Family(LlamaForCausalLM, phi3_config, GgufNames("phi3", _LAYER_GGUF, _TOP_GGUF, config=phi3_gguf_config))
