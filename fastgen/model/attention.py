"""Attention of a ragged batch over the KV block pool.

Per layer: the new tokens' keys and values are written to their slots first; then
single-token sequences (decodes) are attended in padded, masked calls, one per group of
similar context length, and
each multi-token chunk is attended on its own, causally over its cached keys plus itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..batch import RaggedBatch
from ..cache import KVPool


def ragged_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     batch: RaggedBatch, pool: KVPool, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] (already rotated). Returns [T, H, D]."""
    pool.write(layer, batch.slots, k, v)
    gqa = q.shape[1] != k.shape[1]
    parts: list[torch.Tensor] = []                                     # in flat token order
    for g in batch.decode_groups:
        kc, vc = pool.gather(layer, g.block_tables)                  # [n, L, KVH, D]
        o = F.scaled_dot_product_attention(
            q[g.q_start:g.q_start + g.num_seqs].unsqueeze(2),        # [n, H, 1, D]
            kc.transpose(1, 2), vc.transpose(1, 2),                   # [n, KVH, L, D]
            attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        parts.append(o.squeeze(2))                                    # [n, H, D]
    for c in batch.chunks:
        qs = q[c.q_start:c.q_start + c.num_q].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if c.mask is None:
            ks = k[c.q_start:c.q_start + c.num_q].transpose(0, 1).unsqueeze(0)
            vs = v[c.q_start:c.q_start + c.num_q].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kc, vc = pool.gather(layer, c.block_table.unsqueeze(0))  # [1, L, KVH, D]
            o = F.scaled_dot_product_attention(
                qs, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=c.mask,
                scale=scale, enable_gqa=gqa)
        parts.append(o.squeeze(0).transpose(0, 1))                    # [n, H, D]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
