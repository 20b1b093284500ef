"""Gemma 3 (text; ``gemma3_text``: the 270M and 1B checkpoints), built from the Llama layers.

Where it differs from Llama, as transformers' Gemma3ForCausalLM defines it:
- local (sliding-window) layers interleaved with global ones (``layer_types``), each kind
  with its own RoPE table (``rope_parameters["sliding_attention"]`` / ``["full_attention"]``);
- RMSNorm of every q and k head; softmax scale ``query_pre_attn_scalar ** -0.5``;
- four norms per layer: input, after attention, before and after the MLP, each added to the
  residual after its branch; GELU (tanh approximation) in the gated MLP;
- RMSNorm weights stored as ``w`` and applied as ``1 + w``: :meth:`checkpoint_tensor` adds
  the 1 once at load, so the shared norm kernels apply the weight as they are;
- embeddings scaled by ``sqrt(hidden_size)`` (in the embedding's dtype).

Logit soft-capping and bidirectional attention are rejected, not ignored (no released
Gemma 3 text checkpoint sets them).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..batch import RaggedBatch
from ..errors import ModelLoadError
from .layers import RMSNorm
from .llama import QK_NORM_GGUF, DecoderLayer, LlamaForCausalLM, Step, bound, llama_config, rope_parameters
from .spec import Family, GgufNames, ModelConfig

FULL, LOCAL = 0, 1   # rope_index of global and of sliding-window layers


def gemma3_config(hf: Any) -> ModelConfig:
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(hf, name, None) is not None:
            raise ModelLoadError(f"gemma3 with {name}={getattr(hf, name)} is not supported")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ModelLoadError("gemma3 with use_bidirectional_attention is not supported (not a causal LM)")
    return llama_config(hf, qk_norm=True, act=getattr(hf, "hidden_activation", None) or hf.hidden_act,
                        attn_scale=hf.query_pre_attn_scalar ** -0.5)


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer, rope_index=LOCAL if cfg.window(layer) else FULL)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def bind(self, next_norm: RMSNorm):
        """Gemma's four norms around attention and MLP, bound as DecoderLayer.bind's."""
        attend, feed = bound(self.self_attn), bound(self.mlp)
        post_attn, pre_mlp, post_mlp = (self.post_attention_layernorm, self.pre_feedforward_layernorm,
                                        self.post_feedforward_layernorm)
        pa_w, pa_eps, pre_w, pre_eps = post_attn.weight, post_attn.eps, pre_mlp.weight, pre_mlp.eps
        pm_w, pm_eps, next_w, next_eps = post_mlp.weight, post_mlp.eps, next_norm.weight, next_norm.eps

        def run(normed: torch.Tensor, residual: torch.Tensor, step: Step) -> torch.Tensor:
            ops = step.ops
            a = ops.rms_norm(attend(normed, step), pa_w, pa_eps)
            ops.add_rms_norm_(a, residual, pre_w, pre_eps)
            m = ops.rms_norm(feed(a, ops), pm_w, pm_eps)
            ops.add_rms_norm_(m, residual, next_w, next_eps)
            return m
        return run


class Gemma3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Gemma3DecoderLayer(cfg, layer)

    def rope_tables(self, hf_config: Any, max_positions: int) -> list[tuple[torch.Tensor, float]]:
        return [rope_parameters(hf_config, kind, max_positions) for kind in ("full_attention", "sliding_attention")]

    def embed(self, batch: RaggedBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.token_ids)                      # [T, hidden]
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        if name.endswith("norm.weight"):
            tensor = (tensor.float() + 1.0).to(tensor.dtype)
        return name, tensor


_LAYER_GGUF = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    **QK_NORM_GGUF,
}

GEMMA3 = Family(Gemma3ForCausalLM, gemma3_config,
                GgufNames("gemma3", _LAYER_GGUF, {"token_embd": "model.embed_tokens", "output_norm": "model.norm"},
                          norm_shift=-1.0))
