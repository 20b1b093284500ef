"""Attention of a ragged batch over the KV block pool.

Per layer: the new tokens' keys and values are written to their slots first; then
single-token sequences (decodes) are attended together in one padded, masked call, and
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
    nd = batch.num_decodes
    parts: list[torch.Tensor] = []                                     # in flat token order
    if nd:
        kc, vc = pool.gather(layer, batch.decode_block_tables)      # [nd, L, KVH, D]
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2),                                      # [nd, H, 1, D]
            kc.transpose(1, 2), vc.transpose(1, 2),                   # [nd, KVH, L, D]
            attn_mask=batch.decode_mask, scale=scale, enable_gqa=gqa)
        parts.append(o.squeeze(2))                                    # [nd, H, D]
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
