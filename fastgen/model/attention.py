"""Attention of a ragged batch over the KV block pool: two backends behind one seam.

A backend gets the step's :class:`~fastgen.batch.RaggedBatch` once (``plan``), builds the
metadata it needs, and is then called per layer with the rotated q, k, v of every token
(k and v already stored in the pool) and the layer's sliding window: with ``window`` > 0
the query at position p sees the keys at positions p - window + 1 .. p only (Mistral,
Gemma 3's local layers; transformers' ``kv_idx > q_idx - sliding_window``), with 0 the
whole context.

- :class:`SdpaAttention` (any device): decodes in padded, masked SDPA calls, one per group
  of similar context length; a chunk from position 0 attends its fresh keys (causal SDPA);
  a continuing chunk gathers its blocks out of the pool and attends them with a mask.
- :class:`PagedAttention` (CPU, native kernels): every sequence of the step, decodes and
  chunks, in one call of ``torch.ops.fastgen.paged_attention``, which reads the pool in
  place (no gather, no mask, no padding). Measured on the 2-core Zen 5 host, one layer of
  SmolLM2 (9 heads, 3 KV heads, head dim 64), bf16 (`make bench`, 11:15 UTC): 32 decodes
  x 4k keys 8.6 ms against 122 ms for gather + SDPA; a 256-query chunk at position 1,792
  3.5 ms (320 GFLOP/s) against 8.9 ms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import torch
import torch.nn.functional as F

from ..kernels import fast_op

from ..batch import RaggedBatch
from ..cache import KVPool


@dataclass(frozen=True)
class ChunkPlan:
    """A multi-token slice of the flat batch, attended one sequence at a time."""

    q_start: int
    num_q: int
    start_pos: int
    block_table: torch.Tensor        # [num_blocks] int64, device
    mask: torch.Tensor | None        # [1, 1, num_q, num_blocks * block_size] additive; None when start_pos == 0
    # sliding window -> its mask, same shape as ``mask`` (or [1, 1, num_q, num_q] over the
    # chunk's own keys when start_pos == 0; None there while the chunk fits in the window)
    window_masks: Mapping[int, torch.Tensor | None]


@dataclass(frozen=True)
class DecodeGroup:
    """Adjacent single-token sequences of similar context length, attended in one SDPA call."""

    q_start: int
    num_seqs: int
    block_tables: torch.Tensor       # [num_seqs, max_blocks] int64 (padded with block 0)
    mask: torch.Tensor               # [num_seqs, 1, 1, max_blocks * block_size] additive (0 / -inf)
    window_masks: Mapping[int, torch.Tensor]   # sliding window -> its mask, same shape


@dataclass(frozen=True)
class SdpaPlan:
    decode_groups: tuple[DecodeGroup, ...]
    chunks: tuple[ChunkPlan, ...]


@dataclass(frozen=True)
class PagedPlan:
    q_starts: torch.Tensor           # [S + 1] int32
    start_pos: torch.Tensor          # [S] int32
    block_tables: torch.Tensor       # [S, max_blocks] int32 (padded with 0)


class AttentionBackend(Protocol):
    name: str

    def plan(self, batch: RaggedBatch) -> Any:
        """Per-step metadata, built once for every layer."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any,
                 pool: KVPool, scale: float, window: int = 0) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] (rotated, already in the pool). Returns [T, H, D].
        ``window``: the layer's sliding window (0: none), one of the backend's ``windows``."""


def decode_group_sizes(num_blocks: list[int]) -> list[int]:
    """Group sizes for decodes sorted by block count: a group closes when the next sequence
    needs more than twice the blocks of the group's first (so padding at most doubles the
    gathered keys), and at most 4 groups are made."""
    sizes: list[int] = []
    first = 0
    for i, n in enumerate(num_blocks):
        if sizes and (n <= 2 * num_blocks[first] or len(sizes) == 4):
            sizes[-1] += 1
        else:
            sizes.append(1)
            first = i
    return sizes


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where visible, -inf elsewhere, in the model dtype (a boolean mask would be
    converted by SDPA in every layer)."""
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.tensor(float("-inf"), dtype=dtype, device=visible.device))


def _long(x: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long, device=device)


def _chunk_plans(batch: RaggedBatch, dtype: torch.dtype, device: torch.device,
                 windows: tuple[int, ...]) -> tuple[ChunkPlan, ...]:
    chunks = []
    bs = batch.block_size
    for s in range(batch.num_decodes, batch.num_seqs):
        q_start, n = batch.q_starts[s], batch.q_starts[s + 1] - batch.q_starts[s]
        start, blocks = batch.start_pos[s], batch.block_tables[s]
        q_pos = torch.arange(start, start + n, device=device)[:, None]
        # keys: the chunk's own (from position 0) or every gathered block (continuing)
        key_pos = torch.arange(n if start == 0 else len(blocks) * bs, device=device)[None, :]
        causal = key_pos <= q_pos
        mask = None if start == 0 else _additive(causal, dtype).view(1, 1, n, -1)
        window_masks = {w: None if start == 0 and n <= w else
                        _additive(causal & (key_pos > q_pos - w), dtype).view(1, 1, n, -1) for w in windows}
        chunks.append(ChunkPlan(q_start, n, start, _long(list(blocks), device), mask, window_masks))
    return tuple(chunks)


def _attend_chunk(layer: int, q, k, v, c: ChunkPlan, pool: KVPool, scale: float, gqa: bool,
                  window: int) -> torch.Tensor:
    """One chunk's attention output ``[n, H, D]``."""
    qs = q[c.q_start:c.q_start + c.num_q].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    mask = c.window_masks[window] if window else c.mask
    if c.start_pos == 0:
        ks = k[c.q_start:c.q_start + c.num_q].transpose(0, 1).unsqueeze(0)
        vs = v[c.q_start:c.q_start + c.num_q].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=gqa)
    else:
        kc, vc = pool.gather(layer, c.block_table.unsqueeze(0))  # [1, L, KVH, D]
        o = F.scaled_dot_product_attention(
            qs, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)


def _attend_chunks(out: torch.Tensor, layer: int, q, k, v, chunks: tuple[ChunkPlan, ...], pool: KVPool,
                   scale: float, gqa: bool, window: int) -> None:
    for c in chunks:
        out[c.q_start:c.q_start + c.num_q] = _attend_chunk(layer, q, k, v, c, pool, scale, gqa, window)


class SdpaAttention:
    name = "sdpa"

    def __init__(self, dtype: torch.dtype, device: torch.device, windows: tuple[int, ...] = ()) -> None:
        self.dtype, self.device = dtype, device
        self.windows = tuple(sorted({w for w in windows if w > 0}))   # a mask per window, per step

    def plan(self, batch: RaggedBatch) -> SdpaPlan:
        bs, dev = batch.block_size, self.device
        tables = batch.block_tables[:batch.num_decodes]
        groups = []
        start = 0
        for size in decode_group_sizes([len(b) for b in tables]):
            group = tables[start:start + size]
            lens = [p + 1 for p in batch.start_pos[start:start + size]]
            width = max(len(b) for b in group)
            key_pos = torch.arange(width * bs, device=dev)
            seq_len = _long(lens, dev)[:, None]
            mask = _additive(key_pos[None, :] < seq_len, self.dtype).view(size, 1, 1, -1)
            window_masks = {w: _additive((key_pos[None, :] < seq_len) & (key_pos[None, :] >= seq_len - w),
                                         self.dtype).view(size, 1, 1, -1) for w in self.windows}
            groups.append(DecodeGroup(start, size, _long([list(b) + [0] * (width - len(b)) for b in group], dev),
                                      mask, window_masks))
            start += size
        return SdpaPlan(tuple(groups), _chunk_plans(batch, self.dtype, dev, self.windows))

    def __call__(self, layer, q, k, v, plan: SdpaPlan, pool, scale, window=0):
        gqa = q.shape[1] != k.shape[1]
        if not plan.decode_groups and len(plan.chunks) == 1:  # one part: no scratch output
            return _attend_chunk(layer, q, k, v, plan.chunks[0], pool, scale, gqa, window)
        out = torch.empty_like(q)
        for g in plan.decode_groups:
            kc, vc = pool.gather(layer, g.block_tables)                  # [n, L, KVH, D]
            o = F.scaled_dot_product_attention(
                q[g.q_start:g.q_start + g.num_seqs].unsqueeze(2),        # [n, H, 1, D]
                kc.transpose(1, 2), vc.transpose(1, 2),                   # [n, KVH, L, D]
                attn_mask=g.window_masks[window] if window else g.mask, scale=scale, enable_gqa=gqa)
            out[g.q_start:g.q_start + g.num_seqs] = o.squeeze(2)
        _attend_chunks(out, layer, q, k, v, plan.chunks, pool, scale, gqa, window)
        return out


class PagedAttention:
    """Every sequence of the step, decodes and chunks, in one kernel call per layer."""

    name = "paged"

    def __init__(self, dtype: torch.dtype, device: torch.device, windows: tuple[int, ...] = ()) -> None:
        self.device = device            # dtype: the pool's and q's, read by the kernel; windows: any
        self._kernel = fast_op("paged_attention")   # a direct call: ~1 us less than torch.ops' overload
        self._kernel_i8 = fast_op("paged_attention_i8")   # an 8-bit pool (kv_cache_dtype="int8")

    def plan(self, batch: RaggedBatch) -> PagedPlan:
        ns = batch.num_seqs
        width = max(len(b) for b in batch.block_tables)
        ints = torch.tensor([*batch.q_starts, *batch.start_pos,
                             *(x for b in batch.block_tables for x in (*b, *[0] * (width - len(b))))],
                            dtype=torch.int32).to(self.device)
        return PagedPlan(ints[:ns + 1], ints[ns + 1:2 * ns + 1], ints[2 * ns + 1:].view(ns, width))

    def __call__(self, layer, q, k, v, plan: PagedPlan, pool, scale, window=0):
        if pool.quantized:
            return self._kernel_i8(q.contiguous(), pool.keys[layer], pool.values[layer], pool.key_scales[layer],
                                   pool.value_scales[layer], plan.q_starts, plan.start_pos, plan.block_tables, scale,
                                   window)
        return self._kernel(q.contiguous(), pool.keys[layer], pool.values[layer], plan.q_starts,
                            plan.start_pos, plan.block_tables, scale, window)
