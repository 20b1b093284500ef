"""The KV block pool: one preallocated key and value tensor per layer.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` of
a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its flat *slot* is ``block_id * block_size + offset``. Everything
is allocated once, in the constructor; the hot path only writes into and reads from
these tensors.
"""
from __future__ import annotations

import torch


class KVPool:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, spare_blocks: int = 0) -> None:
        """``spare_blocks`` more blocks past ``num_blocks``, never handed out by the allocator: where
        the padding rows of a CUDA-graphed decode step write their keys and values
        (fastgen/model/cuda_graphs.py)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.spare_blocks = spare_blocks
        shape = (num_blocks + spare_blocks, block_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def spare_slot(self) -> int | None:
        """The first slot of the spare blocks, or None without them."""
        return self.num_blocks * self.block_size if self.spare_blocks else None

    @classmethod
    def for_model(cls, config, *, num_kv_heads: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device, spare_blocks: int = 0) -> "KVPool":
        """The one place a model's numbers become a pool's shape: ``config.num_layers`` layers
        (a ModelConfig's) of ``[num_blocks, block_size, num_kv_heads, config.head_dim]``;
        ``num_kv_heads`` is what this rank holds (all of them without tensor parallelism)."""
        return cls(num_layers=config.num_layers, num_blocks=num_blocks, block_size=block_size,
                   num_kv_heads=num_kv_heads, head_dim=config.head_dim, dtype=dtype, device=device,
                   spare_blocks=spare_blocks)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v`` (shape ``[num_tokens, num_kv_heads, head_dim]``) at flat ``slots``."""
        kf = self.keys[layer].view(-1, *self.keys[layer].shape[2:])
        vf = self.values[layer].view(-1, *self.values[layer].shape[2:])
        kf.index_copy_(0, slots, k)
        vf.index_copy_(0, slots, v)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks for each row of ``block_tables`` ``[num_seqs, max_blocks]``.

        Returns two tensors ``[num_seqs, max_blocks * block_size, num_kv_heads, head_dim]``;
        positions past a sequence's length hold stale data and must be masked.
        """
        n, m = block_tables.shape
        k = self.keys[layer].index_select(0, block_tables.reshape(-1))
        v = self.values[layer].index_select(0, block_tables.reshape(-1))
        return (k.view(n, m * self.block_size, *k.shape[2:]),
                v.view(n, m * self.block_size, *v.shape[2:]))
