"""Phi-3 (and Phi-3.5 / Phi-4-mini where the rotary is whole): the Llama decoder with the QKV and
gate/up projections fused in the checkpoint (``qkv_proj``, ``gate_up_proj``, loaded as shipped),
LongRoPE ("su") scaling, and a sliding window where the config sets one.

LongRoPE: transformers rotates with the short factors while a sequence is within
``original_max_position_embeddings`` and re-rotates the whole sequence with the long factors
past it; a KV cache cannot follow that switch, so fastgen serves up to the original context
(the default ``max_model_len`` of a LongRoPE checkpoint) with the short factors and their
attention scaling, exactly as transformers computes them there, and rejects a longer
``max_model_len``. No GGUF layout is read for this family (load it from a Hugging Face folder).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .llama import LlamaForCausalLM, llama_config
from .spec import Family, ModelConfig


def phi3_config(hf: Any) -> ModelConfig:
    cfg = llama_config(hf)
    params = getattr(hf, "rope_parameters", None) or {}
    if params.get("rope_type") == "longrope":
        original = params.get("original_max_position_embeddings") or hf.original_max_position_embeddings
        cfg = dataclasses.replace(cfg, max_position_embeddings=min(cfg.max_position_embeddings, original))
    return cfg


PHI3 = Family(LlamaForCausalLM, phi3_config)
