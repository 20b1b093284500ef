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
fused gate/up layers. llama.cpp stores experts as 3-D tensors; that GGUF layout is not read
(these families load from Hugging Face folders).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from ..kernels.ops import Ops
from .layers import RowLinear
from .llama import MLP, DecoderLayer, LlamaForCausalLM, llama_config
from .spec import Family, ModelConfig, MoeConfig


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


MIXTRAL = Family(MoeForCausalLM, mixtral_config)
QWEN2_MOE = Family(MoeForCausalLM, lambda hf: llama_config(hf, qkv_bias=bool(hf.qkv_bias),
                                                           moe=_qwen_moe(hf, shared=True)))
QWEN3_MOE = Family(MoeForCausalLM, lambda hf: llama_config(hf, qk_norm=True, moe=_qwen_moe(hf, shared=False)))
