"""A free-list allocator of KV block ids. It knows nothing of models or tensors.

``can_allocate(n)`` answers before anything is committed; ``allocate(n)`` either hands
out ``n`` ids or raises without changing state; ``free`` rejects ids that are not
currently allocated (double frees, foreign ids) before releasing any of them.
"""
from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """Raised by :meth:`BlockAllocator.allocate` when fewer than ``n`` blocks are free."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        # Pop from the end: low ids are handed out first, which keeps a small working
        # set of the pool warm in cache.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._allocated = bytearray(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(num_blocks)]
        for i in ids:
            self._allocated[i] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        seen: set[int] = set()
        for i in block_ids:
            if not (0 <= i < self.num_blocks) or not self._allocated[i] or i in seen:
                raise ValueError(f"block {i} is not allocated (double free or foreign id)")
            seen.add(i)
        for i in reversed(block_ids):
            self._allocated[i] = 0
            self._free.append(i)
