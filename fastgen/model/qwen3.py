"""Qwen3: the Llama-family decoder with an RMSNorm on every q and k head before RoPE and no
QKV bias (``attention_bias`` says so); sliding windows through ``layer_types`` when
``use_sliding_window`` is set. One registry entry, :data:`QWEN3`.
"""
from __future__ import annotations

from .llama import _LAYER_GGUF, _TOP_GGUF, QK_NORM_GGUF, LlamaForCausalLM, llama_config
from .spec import Family, GgufNames

QWEN3 = Family(LlamaForCausalLM, lambda hf: llama_config(hf, qk_norm=True),
               GgufNames("qwen3", {**_LAYER_GGUF, **QK_NORM_GGUF}, _TOP_GGUF))
