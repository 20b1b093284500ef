"""Falcon (``falcon``: 7B/40B/180B and the new-decoder-architecture checkpoints) with RoPE.

The variants, as transformers' FalconDecoderLayer defines them:
- ``new_decoder_architecture``: grouped KV heads (``num_kv_heads``); attention and MLP in
  parallel on two LayerNorms (``ln_attn``, ``ln_mlp``) or one (``num_ln_in_parallel_attn=1``);
- otherwise multi-query (one KV head, ``multi_query``) or multi-head attention; in parallel on
  one LayerNorm (``parallel_attn``), or sequential with a second norm (``post_attention_layernorm``);
- a ``gelu`` MLP ``dense_h_to_4h``/``dense_4h_to_h``; biases where ``bias`` says.

The fused ``query_key_value`` rows are reordered at load into the shared layout (all q heads,
then k, then v): the new architecture interleaves them per KV group (``[g q heads, k, v]``
per group), multi-head Falcon per head (``[q, k, v]`` per head). ALiBi checkpoints (Falcon-RW)
are rejected.

GGUF (llama.cpp's ``falcon``): llama.cpp's converter already reordered ``attn_qkv`` to all q
heads, then k, then v (cut into its parts at load, no reordering); ``attn_norm`` is the MLP's
LayerNorm (``ln_mlp``, or the one shared norm) and ``attn_norm_2``, where present (40B/180B),
the attention's (``ln_attn``); no Q/K permutation (half-split RoPE). The variant follows from
the file: two norms or several KV heads = the new architecture, else multi-query, both in
parallel. transformers' GGUF mapping for ``falcon`` drops the KV heads and the LayerNorm eps,
so the config is built here (:func:`falcon_gguf_config`).
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
from .spec import QKV, Family, GgufNames, ModelConfig, eos_ids


def num_kv_heads(hf: Any) -> int:
    if hf.new_decoder_architecture:
        return hf.num_kv_heads
    return 1 if hf.multi_query else hf.num_attention_heads


def falcon_config(hf: Any) -> ModelConfig:
    if hf.alibi:
        raise ModelLoadError("falcon with alibi (Falcon-RW) is not supported; fastgen's falcon uses RoPE")
    if hf.activation != "gelu":
        raise ModelLoadError(f"falcon with activation={hf.activation!r} is not supported (gelu)")
    if hf.new_decoder_architecture and not hf.parallel_attn and hf.num_ln_in_parallel_attn == 1:
        raise ModelLoadError("falcon with a sequential new-architecture block is not supported")
    heads, bias = hf.num_attention_heads, bool(hf.bias)
    return ModelConfig(
        model_type=hf.model_type, vocab_size=hf.vocab_size, num_layers=hf.num_hidden_layers,
        num_kv_heads=num_kv_heads(hf), head_dim=hf.hidden_size // heads,
        max_position_embeddings=hf.max_position_embeddings, bos_token_id=hf.bos_token_id,
        eos_token_ids=eos_ids(hf), hidden_size=hf.hidden_size, intermediate_size=hf.ffn_hidden_size,
        num_heads=heads, rms_norm_eps=hf.layer_norm_epsilon, tie_word_embeddings=bool(hf.tie_word_embeddings),
        qkv_bias=bias, o_bias=bias, mlp_bias=bias, hidden_act="gelu", layer_windows=(0,) * hf.num_hidden_layers)


class FalconDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, hf: Any) -> None:
        super().__init__()
        self.parallel = bool(hf.new_decoder_architecture or hf.parallel_attn)
        two_norms = bool(hf.new_decoder_architecture) and (hf.num_ln_in_parallel_attn or 2) == 2
        eps = cfg.rms_norm_eps
        if two_norms:
            self.ln_attn, self.ln_mlp = LayerNorm(cfg.hidden_size, eps), LayerNorm(cfg.hidden_size, eps)
        else:
            self.input_layernorm = LayerNorm(cfg.hidden_size, eps)
            self.ln_attn = self.ln_mlp = self.input_layernorm
        if not self.parallel:
            self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(cfg, layer)
        self.fc1 = ColumnLinear(cfg.hidden_size, [cfg.intermediate_size], bias=cfg.mlp_bias)
        self.fc2 = RowLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        a = self.self_attn(self.ln_attn(x), step)
        if self.parallel:
            return (self.mlp(self.ln_mlp(x)) + a) + x
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class FalconForCausalLM(LayerNormCausalLM):
    def __init__(self, cfg: ModelConfig, hf_config: Any, max_positions: int) -> None:
        self._hf = hf_config          # read by make_layer, which the base __init__ calls
        super().__init__(cfg, hf_config, max_positions)

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return FalconDecoderLayer(cfg, layer, self._hf)

    def _qkv_rows(self) -> torch.Tensor:
        """Row order taking ``query_key_value`` to [q heads, k heads, v heads]."""
        cfg, hf = self.config, self._hf
        d, h, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        heads = torch.arange((h + 2 * kvh) * d).view(-1, d)           # checkpoint head slots
        if hf.new_decoder_architecture:
            g = heads.view(kvh, h // kvh + 2, d)                         # per group: g q, k, v
            order = [g[:, :-2].reshape(-1, d), g[:, -2], g[:, -1]]
        elif not hf.multi_query:
            per = heads.view(h, 3, d)                                    # per head: q, k, v
            order = [per[:, 0], per[:, 1], per[:, 2]]
        else:
            return heads.flatten()                                       # already q..., k, v
        return torch.cat([o.reshape(-1) for o in order])

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        name = name.removeprefix("transformer.")
        for old, new in (("word_embeddings.", "embed_tokens."), ("ln_f.", "norm."), ("h.", "layers.")):
            if name.startswith(old):
                name = new + name.removeprefix(old)
        for old, new in ((".self_attention.query_key_value.", ".self_attn.qkv_proj."),
                         (".self_attention.dense.", ".self_attn.o_proj."),
                         (".mlp.dense_h_to_4h.", ".fc1."), (".mlp.dense_4h_to_h.", ".fc2.")):
            name = name.replace(old, new)
        if ".self_attn.qkv_proj." in name:
            tensor = tensor[self._qkv_rows()]
        if ".ln_mlp." in name and not self._two_norms:   # GGUF's attn_norm of a one-norm layer
            name = name.replace(".ln_mlp.", ".input_layernorm.")
        return name, tensor

    @property
    def _two_norms(self) -> bool:
        return hasattr(self.layers[0], "ln_mlp") and self.layers[0].ln_mlp is not self.layers[0].ln_attn


def falcon_gguf_config(header: GgufHeader) -> Any:
    from gguf import Keys
    from transformers import FalconConfig

    c = base_config(header)
    kv_heads, two_norms = c.pop("num_key_value_heads"), header.has("blk.0.attn_norm_2.weight")
    new_arch = two_norms or kv_heads > 1
    return FalconConfig(**c, num_kv_heads=kv_heads, new_decoder_architecture=new_arch, multi_query=not new_arch,
                        parallel_attn=True, num_ln_in_parallel_attn=2 if two_norms else 1,
                        ffn_hidden_size=header.key(Keys.LLM.FEED_FORWARD_LENGTH),
                        layer_norm_epsilon=header.key(Keys.Attention.LAYERNORM_EPS),
                        bias=header.has("blk.0.attn_qkv.bias"), alibi=False, activation="gelu",
                        rope_parameters=default_rope(header))


_LAYER_GGUF = {"attn_norm": "ln_mlp", "attn_norm_2": "ln_attn", "attn_qkv": QKV,
               "attn_output": "self_attn.o_proj", "ffn_up": "fc1", "ffn_down": "fc2"}
_TOP_GGUF = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

FALCON = Family(FalconForCausalLM, falcon_config,
                GgufNames("falcon", _LAYER_GGUF, _TOP_GGUF, config=falcon_gguf_config))
