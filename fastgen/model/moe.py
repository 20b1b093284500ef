"""Mixture-of-experts families: Mixtral, Qwen2-MoE, Qwen3-MoE (the Llama decoder, routed experts
in place of the MLP).

Routing, as each family's transformers implementation defines it: router logits
``x @ gate.T``, softmax in fp32 over all experts, the top ``k`` probabilities; Mixtral always
renormalises them to sum to 1, the Qwen families when ``norm_topk_prob`` is set. Qwen2-MoE adds
a shared expert whose output is scaled by ``sigmoid(shared_expert_gate(x))``. Qwen layers are
sparse where ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``; the
others keep the dense MLP.

Experts run grouped (:meth:`MoE.forward`): the step's (token, expert) pairs are sorted by
expert, and each expert that received tokens multiplies all of them in one product, so the
work grows with the tokens routed (``T * k`` rows), not with ``T * num_experts``; an expert with
no tokens costs nothing.

Checkpoints: Mixtral names its experts ``block_sparse_moe.experts.E.w1/w3/w2`` (gate, up,
down), the Qwen families ``mlp.experts.E.gate_proj/up_proj/down_proj``; both are loaded onto
fused gate/up layers. GGUF (llama.cpp's ``llama`` with experts, ``qwen2moe``, ``qwen3moe``):
the router is ``ffn_gate_inp``, the experts 3-D ``ffn_{gate,up,down}_exps [experts, rows,
cols]`` cut into one tensor per expert at load (older Mixtral files: ``ffn_gate.E``, one per
expert), Qwen2-MoE's shared expert ``ffn_*_shexp`` behind ``ffn_gate_inp_shexp``. Q4_0 / Q4_1 /
Q8_0 experts stay quantized per expert like any linear weight (fastgen.model.quant); other
types are dequantized. transformers' GGUF config mapping knows no Mixtral (it reads a Llama)
and no expert sizes, so the configs are built here from the metadata (:func:`mixtral_gguf_config`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from ..kernels.ops import Ops
from .gguf_file import GgufHeader, base_config, default_rope, rows
from .layers import RowLinear
from .llama import _LAYER_GGUF, _TOP_GGUF, MLP, QK_NORM_GGUF, DecoderLayer, LlamaForCausalLM, llama_config
from .spec import Family, GgufNames, ModelConfig, MoeConfig


class MoE(nn.Module):
    """``forward(x [T, hidden], ops) -> [T, hidden]``: the routed experts' weighted sum (+ the
    gated shared expert)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = RowLinear(cfg.hidden_size, moe.num_experts, bias=False)          # the router
        self.experts = nn.ModuleList(MLP(cfg, moe.expert_size) for _ in range(moe.num_experts))
        self.shared_expert = MLP(cfg, moe.shared_expert_size) if moe.shared_expert_size else None
        self.shared_expert_gate = RowLinear(cfg.hidden_size, 1, bias=False) if moe.shared_expert_size else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in x's dtype, expert ids [T, k])``."""
        probs = F.softmax(self.gate(x).float(), dim=-1)                                # [T, E] fp32
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.flatten()                                                           # [T * k]
        order = torch.argsort(flat, stable=True)             # (token, slot) pairs grouped by expert
        rows = order // self.top_k                           # the token of each sorted pair
        pair_weights = weights.flatten()[order]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # the one host sync
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tokens = rows[start:start + n]
            y = self.experts[e](x[tokens], ops) * pair_weights[start:start + n, None]  # [n, hidden]
            out.index_add_(0, tokens, y)
            start += n
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ops)
        return out


class MoeForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        block = DecoderLayer(cfg, layer)
        if cfg.moe.sparse_layers[layer]:
            block.mlp = MoE(cfg)
        return block

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        if ".block_sparse_moe." in name:    # Mixtral's names onto the shared ones
            name = name.replace(".block_sparse_moe.", ".mlp.")
            for old, new in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
                name = name.replace(old, new)
        if name.endswith(".shared_expert_gate.weight") and tensor.dim() == 1:
            tensor = tensor[None]            # llama.cpp's ffn_gate_inp_shexp is [hidden]: one row
        return name, tensor


def mixtral_config(hf: Any) -> ModelConfig:
    moe = MoeConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                    expert_size=hf.intermediate_size, norm_topk_prob=True,
                    sparse_layers=(True,) * hf.num_hidden_layers)
    return llama_config(hf, moe=moe)


def _qwen_moe(hf: Any, shared: bool) -> MoeConfig:
    if not hf.num_experts:
        raise ModelLoadError(f"{hf.model_type} with num_experts=0 is not a mixture of experts")
    skip = set(hf.mlp_only_layers or ())
    return MoeConfig(num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
                     expert_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                     shared_expert_size=hf.shared_expert_intermediate_size if shared else 0,
                     sparse_layers=tuple(i not in skip and (i + 1) % hf.decoder_sparse_step == 0
                                         for i in range(hf.num_hidden_layers)))


def _gguf_moe(header: GgufHeader) -> dict[str, Any]:
    """Config fields of a llama.cpp MoE file. Every layer is sparse in llama.cpp's layout: a
    layer without a router (``ffn_gate_inp``) is declared dense here, and its dense tensors
    then have no GGUF name to load under (an error naming them)."""
    from gguf import Keys

    num_layers = header.key(Keys.LLM.BLOCK_COUNT)
    experts = header.key(Keys.LLM.EXPERT_COUNT)
    # older files state no expert size: an expert's rows (3-D, or the first one of the per-expert layout)
    expert_size = (header.key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, None) or rows(header, "blk.0.ffn_up_exps.weight")
                   or rows(header, "blk.0.ffn_up.0.weight"))
    if expert_size is None:
        raise KeyError(f"the GGUF file has neither {Keys.LLM.EXPERT_FEED_FORWARD_LENGTH!r} nor expert tensors")
    return dict(base_config(header), num_experts=experts, num_experts_per_tok=header.key(Keys.LLM.EXPERT_USED_COUNT),
                moe_intermediate_size=expert_size,
                intermediate_size=header.key(Keys.LLM.FEED_FORWARD_LENGTH, None) or expert_size,
                rms_norm_eps=header.key(Keys.Attention.LAYERNORM_RMS_EPS),
                rope_parameters=default_rope(header), decoder_sparse_step=1,
                mlp_only_layers=[i for i in range(num_layers) if not header.has(f"blk.{i}.ffn_gate_inp.weight")])


def mixtral_gguf_config(header: GgufHeader) -> Any:
    """A MixtralConfig from llama.cpp's ``llama`` metadata with ``llama.expert_count`` set."""
    from gguf import Keys
    from transformers import MixtralConfig

    c = _gguf_moe(header)
    if c.pop("mlp_only_layers"):
        raise ModelLoadError("a Mixtral GGUF with dense layers (no ffn_gate_inp) is not supported")
    head_dim = header.key(Keys.Attention.KEY_LENGTH, None) or c["hidden_size"] // c["num_attention_heads"]
    if header.key(Keys.Rope.DIMENSION_COUNT, head_dim) != head_dim:
        raise ModelLoadError("a Mixtral GGUF with partial rotary embeddings is not supported")
    return MixtralConfig(**{k: c[k] for k in c if k not in ("num_experts", "moe_intermediate_size",
                                                            "intermediate_size", "decoder_sparse_step")},
                         num_local_experts=c["num_experts"], intermediate_size=c["moe_intermediate_size"],
                         head_dim=head_dim, sliding_window=None)


def qwen2_moe_gguf_config(header: GgufHeader) -> Any:
    from gguf import Keys
    from transformers import Qwen2MoeConfig

    shared = (header.key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, None)
              or rows(header, "blk.0.ffn_up_shexp.weight") or 0)
    # llama.cpp's qwen2moe graph does not renormalise the top-k weights
    return Qwen2MoeConfig(**_gguf_moe(header), shared_expert_intermediate_size=shared, norm_topk_prob=False,
                          qkv_bias=header.has("blk.0.attn_q.bias"), use_sliding_window=False)


def qwen3_moe_gguf_config(header: GgufHeader) -> Any:
    from gguf import Keys
    from transformers import Qwen3MoeConfig

    c = _gguf_moe(header)
    # llama.cpp's qwen3moe graph renormalises the top-k weights
    return Qwen3MoeConfig(**c, head_dim=header.key(Keys.Attention.KEY_LENGTH, None)
                          or c["hidden_size"] // c["num_attention_heads"], norm_topk_prob=True,
                          attention_bias=header.has("blk.0.attn_q.bias"), use_sliding_window=False)


_ATTN_GGUF = {k: v for k, v in _LAYER_GGUF.items() if not k.startswith(("ffn_gate", "ffn_up", "ffn_down"))}
_EXPERTS_GGUF = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
                 "ffn_up_exps": "mlp.experts.{e}.up_proj", "ffn_down_exps": "mlp.experts.{e}.down_proj"}
# older Mixtral files: one 2-D tensor per expert, blk.N.ffn_gate.E
_MIXTRAL_GGUF = {**_ATTN_GGUF, **_EXPERTS_GGUF, "ffn_gate": "mlp.experts.{e}.gate_proj",
                 "ffn_up": "mlp.experts.{e}.up_proj", "ffn_down": "mlp.experts.{e}.down_proj"}
_SHARED_GGUF = {"ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}

MIXTRAL = Family(MoeForCausalLM, mixtral_config,
                 GgufNames("llama", _MIXTRAL_GGUF, _TOP_GGUF, unpermute_qk=True, experts=True,
                           config=mixtral_gguf_config))
QWEN2_MOE = Family(MoeForCausalLM, lambda hf: llama_config(hf, qkv_bias=bool(hf.qkv_bias),
                                                           moe=_qwen_moe(hf, shared=True)),
                   GgufNames("qwen2moe", {**_ATTN_GGUF, **_EXPERTS_GGUF, **_SHARED_GGUF}, _TOP_GGUF,
                             experts=True, config=qwen2_moe_gguf_config))
QWEN3_MOE = Family(MoeForCausalLM, lambda hf: llama_config(hf, qk_norm=True, moe=_qwen_moe(hf, shared=False)),
                   GgufNames("qwen3moe", {**_ATTN_GGUF, **QK_NORM_GGUF, **_EXPERTS_GGUF}, _TOP_GGUF,
                             experts=True, config=qwen3_moe_gguf_config))
