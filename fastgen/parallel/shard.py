"""Which part of each weight a tensor-parallel rank holds (pure arithmetic, no processes).

Megatron-style sharding of the Llama-shaped decoder:

- attention: each rank holds whole KV groups (a KV head and the query heads that read it),
  so its attention is an ordinary GQA over fewer heads; the fused QKV projection is split by
  rows (column-parallel), the output projection by input features (row-parallel);
- MLP: the intermediate features are split; gate/up by rows, down by input features;
- the embedding and the output head are split over the vocabulary.

Counts that do not divide evenly are split as evenly as the layers allow: SmolLM2's 3 KV
groups (9 query heads) over 2 ranks give one rank 2 groups and the other 1. When there are
more ranks than KV heads, each KV head is replicated on ``size / num_kv_heads`` ranks, which
split its query heads; a config neither rule fits is rejected with its numbers.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from ..errors import ModelLoadError
from ..model.quant import GROUP, QuantRows
from ..model.spec import ModelConfig

Range = tuple[int, int]


def split_evenly(total: int, parts: int, unit: int = 1) -> list[Range]:
    """``[start, stop)`` of each of ``parts`` contiguous shares of ``total`` (in whole ``unit``s),
    the first ones one unit larger where it does not divide."""
    units, extra = divmod(total // unit, parts)
    out, start = [], 0
    for p in range(parts):
        n = (units + (p < extra)) * unit
        out.append((start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class Shard:
    """One rank's share, in heads, KV heads, intermediate features and vocabulary rows."""

    rank: int
    size: int
    heads: Range
    kv_heads: Range
    intermediate: Range
    vocab: Range
    head_dim: int

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this rank's model: the same layers over its heads and features."""
        return dataclasses.replace(cfg, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate[1] - self.intermediate[0],
                                   vocab_size=self.vocab[1] - self.vocab[0])

    # -- checkpoint tensors -> this rank's part -------------------------------------------------

    def _rows(self, name: str, cfg: ModelConfig) -> list[tuple[Range, Range]] | None:
        """For a column-parallel tensor: ``(full part range, this rank's range)`` per fused part,
        in rows; None when ``name`` is not column-parallel."""
        hd, q, kv = self.head_dim, cfg.num_heads * self.head_dim, cfg.num_kv_heads * self.head_dim
        mine_q = (self.heads[0] * hd, self.heads[1] * hd)
        mine_kv = (self.kv_heads[0] * hd, self.kv_heads[1] * hd)
        inter = cfg.intermediate_size
        if re.search(r"self_attn\.q_proj$", name):
            return [((0, q), mine_q)]
        if re.search(r"self_attn\.[kv]_proj$", name):
            return [((0, kv), mine_kv)]
        if re.search(r"self_attn\.qkv_proj$", name):      # shipped fused (Phi-3)
            return [((0, q), mine_q), ((q, q + kv), mine_kv), ((q + kv, q + 2 * kv), mine_kv)]
        if re.search(r"mlp\.(gate|up)_proj$", name):
            return [((0, inter), self.intermediate)]
        if re.search(r"mlp\.gate_up_proj$", name):
            return [((0, inter), self.intermediate), ((inter, 2 * inter), self.intermediate)]
        if re.search(r"(^|\.)(embed_tokens|lm_head)$", name):
            return [((0, cfg.vocab_size), self.vocab)]
        return None

    def _columns(self, name: str) -> Range | None:
        """For a row-parallel weight: this rank's input features; None otherwise."""
        if re.search(r"self_attn\.o_proj$", name):
            return self.heads[0] * self.head_dim, self.heads[1] * self.head_dim
        if re.search(r"mlp\.down_proj$", name):
            return self.intermediate
        return None

    def tensor(self, name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (HF naming); replicated tensors (norms)
        are returned whole. A row-parallel bias is kept by rank 0 only (added once after the
        all-reduce)."""
        module, _, kind = name.rpartition(".")
        rows = self._rows(module, cfg)
        if rows is not None:
            return torch.cat([t[lo + a:lo + b] for (lo, _), (a, b) in rows]) if len(rows) > 1 else \
                t[rows[0][1][0]:rows[0][1][1]]
        cols = self._columns(module)
        if cols is not None:
            if kind == "bias":
                return t if self.rank == 0 else torch.zeros_like(t)
            return t[:, cols[0]:cols[1]]
        return t

    def quant(self, name: str, q: QuantRows, cfg: ModelConfig) -> QuantRows:
        """This rank's part of a weight kept quantized (GGUF as shipped)."""
        module = name.rpartition(".")[0]
        rows = self._rows(module, cfg)
        if rows is not None:
            parts = [q.rows(lo + a, lo + b) for (lo, _), (a, b) in rows]
            return parts[0] if len(parts) == 1 else QuantRows.cat(parts)
        cols = self._columns(module)
        if cols is not None:
            try:
                return q.columns(*cols)
            except ValueError as e:
                raise ModelLoadError(f"{name}: this rank's input features {cols[0]}:{cols[1]} do not fall on "
                                     f"the quantization's groups of {GROUP}; load with quantization='none'") from e
        return q


def shard_plan(cfg: ModelConfig, size: int) -> list[Shard]:
    """Every rank's :class:`Shard` of ``cfg`` over ``size`` ranks; :class:`ModelLoadError` naming
    the numbers when the attention heads cannot be split."""
    if not isinstance(size, int) or size < 1:
        raise ModelLoadError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    if heads % kv:
        raise ModelLoadError(f"{heads} attention heads are not a multiple of {kv} KV heads")
    group = heads // kv
    if size <= kv:
        kv_ranges = split_evenly(kv, size)
        head_ranges = [(a * group, b * group) for a, b in kv_ranges]
    else:
        rep = size // kv
        if size % kv or group % rep:
            raise ModelLoadError(
                f"tensor_parallel_size={size} cannot shard {heads} attention heads over {kv} KV heads: with more "
                f"ranks than KV heads, each KV head is replicated on size/num_kv_heads ranks, which needs "
                f"{size} to be a multiple of {kv} and the {group} query heads of each KV head to be a multiple "
                f"of {size // kv if size % kv == 0 else size / kv:g}; use a tensor_parallel_size that divides {kv}"
                f" or is a multiple of it")
        kv_ranges = [(r // rep, r // rep + 1) for r in range(size)]
        per = group // rep
        head_ranges = [((r // rep) * group + (r % rep) * per, (r // rep) * group + (r % rep + 1) * per)
                       for r in range(size)]
    inter = cfg.intermediate_size
    unit = GROUP if inter % GROUP == 0 and inter // GROUP >= size else 1
    if inter // unit < size:
        raise ModelLoadError(f"tensor_parallel_size={size} exceeds the {inter} intermediate features")
    inter_ranges = split_evenly(inter, size, unit)
    vocab_ranges = split_evenly(cfg.vocab_size, size)
    return [Shard(r, size, head_ranges[r], kv_ranges[r], inter_ranges[r], vocab_ranges[r], cfg.head_dim)
            for r in range(size)]
