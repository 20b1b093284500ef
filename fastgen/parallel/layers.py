"""The tensor-parallel pieces of a rank's model: weight formats that finish a sharded product,
and the vocabulary-parallel embedding.

A rank's model is the family's own model class built from its shard's config (fewer heads,
fewer intermediate features, a slice of the vocabulary: fastgen.parallel.shard); three
things then differ, each through an existing seam:

- a row-parallel layer's weight format (attention output, down projection) all-reduces the
  partial products (:class:`AllReduced`: one all-reduce after attention, one after the MLP);
- the output head's format gathers each rank's vocabulary slice of the logits on rank 0
  (:class:`VocabGathered`);
- the embedding looks up the ids of its slice and all-reduces (:class:`VocabParallelEmbedding`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from ..model.layers import ColumnLinear, Linear, RowLinear
from .group import TPGroup
from .shard import Shard


class _Finishing:
    """A format that computes through ``inner`` and then finishes the product across the ranks;
    its memory is the inner format's."""

    suffix = ""

    def __init__(self, inner, group: TPGroup) -> None:
        self.inner, self.group = inner, group
        self.name = f"{inner.name}+{self.suffix}"

    @property
    def num_bytes(self) -> int:
        return self.inner.num_bytes

    @property
    def stream_bytes(self) -> int:
        return self.inner.stream_bytes


class AllReduced(_Finishing):
    """A row-parallel layer's format: this rank's partial product, summed over the ranks."""

    suffix = "all-reduce"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner.matmul(x))


class VocabGathered(_Finishing):
    """The output head's format: logits of this rank's vocabulary slice, gathered on rank 0."""

    suffix = "vocab-gather"

    def __init__(self, inner, group: TPGroup, sizes: list[int]) -> None:
        super().__init__(inner, group)
        self.sizes = sizes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.gather_vocab(self.inner.matmul(x), self.sizes)


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``start:start + n`` of the embedding; ids outside give zeros, summed over the ranks."""

    def __init__(self, weight: torch.Tensor, start: int, group: TPGroup) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight)
        self.weight.requires_grad_(False)
        self.start, self.group = start, group
        self.quant: nn.Module | None = None

    def hold_quantized(self, embedding: nn.Module) -> None:
        """Gather from this rank's quantized rows (a QuantEmbedding, shared with the head)
        instead of the dense slice, which is freed."""
        if embedding.num_embeddings != self.num_embeddings:
            raise ValueError(f"quantized rows {embedding.num_embeddings} != this rank's {self.num_embeddings}")
        self.quant = embedding
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        local = local.masked_fill(outside, 0)
        x = self.quant(local) if self.quant is not None else F.embedding(local, self.weight)
        x.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(x)


ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
COLUMN_PARALLEL = ("self_attn.qkv_proj", "mlp.gate_up_proj")


def check_shardable(model: nn.Module, model_type: str) -> None:
    """:class:`ModelLoadError` unless every linear layer of ``model`` is one this module shards."""
    for name, m in model.named_modules():
        if not isinstance(m, Linear) or name == "lm_head":
            continue
        if not name.endswith(ROW_PARALLEL + COLUMN_PARALLEL):
            raise ModelLoadError(f"tensor parallelism shards the Llama-shaped decoders (attention heads, a gated "
                                 f"MLP); {model_type} has layer {name!r} it does not know how to split")
        if name.endswith(ROW_PARALLEL) != isinstance(m, RowLinear) or \
                name.endswith(COLUMN_PARALLEL) != isinstance(m, ColumnLinear):
            raise ModelLoadError(f"{model_type}: layer {name!r} is not laid out for tensor parallelism")


def use_vocab_parallel_embedding(model: nn.Module, shard: Shard, group: TPGroup) -> None:
    """Before loading: the embedding becomes this rank's vocabulary slice."""
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight.data, shard.vocab[0], group)


def finish_formats(model: nn.Module, shards: list[Shard], group: TPGroup) -> None:
    """After ``model.prepare()``: row-parallel layers all-reduce, the head gathers the vocabulary."""
    for name, m in model.named_modules():
        if isinstance(m, RowLinear) and name.endswith(ROW_PARALLEL):
            m.format = AllReduced(m.format, group)
    model.head.format = VocabGathered(model.head.format, group, [s.vocab[1] - s.vocab[0] for s in shards])
    # the native layer stack (fastgen/model/stack.py) holds the formats it found: build it again,
    # from these (it then declines the all-reducing ones and the layers' closures run)
    model.__dict__["_stack"] = None
