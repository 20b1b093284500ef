"""An allocator of KV block ids with reference counts and content-addressed full blocks.
It knows nothing of models or tensors.

A block is in one of three states:

- *free*: holds nothing anyone wants; on the free list;
- *referenced*: ``ref > 0`` requests hold it in their block tables; never handed out again,
  never evicted, never written by anyone but the request that is filling it;
- *cached-free*: ``ref == 0`` but its contents are registered under a hash (a full block of
  a known token prefix, see :mod:`fastgen.cache.prefix`); it counts as free and is evicted
  least-recently-used when a block is needed, or taken back by :meth:`share` on a cache hit.

``can_allocate(n)`` answers before anything is committed; ``allocate(n)`` either hands
out ``n`` ids or raises without changing state; ``free`` rejects ids that are not
currently referenced (double frees, foreign ids) before releasing any of them, and drops one
reference of each.
"""
from __future__ import annotations

from collections import OrderedDict


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
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}             # registered block -> its hash
        self._block_of: dict[bytes, int] = {}            # hash -> registered block
        self._cached_free: OrderedDict[int, None] = OrderedDict()   # ref == 0 and registered, LRU first
        self.num_evictions = 0

    # -- counts ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus cached-free (evictable)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request references."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash (referenced or cached-free)."""
        return len(self._block_of)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # -- plain allocation -------------------------------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` fresh blocks, each with one reference; cached-free blocks are
        evicted (least recently used first) once the free list is empty."""
        if not self.can_allocate(num_blocks):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        ids = []
        for _ in range(num_blocks):
            if self._free:
                i = self._free.pop()
            else:
                i, _ = self._cached_free.popitem(last=False)
                del self._block_of[self._hash_of.pop(i)]
                self.num_evictions += 1
            self._ref[i] = 1
            ids.append(i)
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference of each id. A block nobody references any more becomes free,
        or cached-free when registered. Release ``block_ids`` in table order: their tail is
        then the least recently used and evicted first, so a prefix outlives its suffix."""
        seen: set[int] = set()
        for i in block_ids:  # a table never holds a block twice
            if not (0 <= i < self.num_blocks) or not self._ref[i] or i in seen:
                raise ValueError(f"block {i} is not allocated (double free or foreign id)")
            seen.add(i)
        for i in reversed(block_ids):
            self._ref[i] -= 1
            if self._ref[i] == 0:
                if i in self._hash_of:
                    self._cached_free[i] = None
                else:
                    self._free.append(i)

    # -- content addressing -------------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks registered under the longest prefix of ``hashes`` (changes nothing)."""
        hits = []
        for h in hashes:
            i = self._block_of.get(h)
            if i is None:
                break
            hits.append(i)
        return hits

    def share_cost(self, block_ids: list[int]) -> int:
        """How many free blocks :meth:`share` of ``block_ids`` would consume (the cached-free ones:
        a block some request already references is counted once, by its first holder)."""
        return sum(1 for i in block_ids if self._ref[i] == 0)

    def share(self, block_ids: list[int]) -> None:
        """Take one reference on each registered block (a cache hit)."""
        for i in block_ids:
            if i not in self._hash_of:
                raise ValueError(f"block {i} is not a cached block")
        for i in block_ids:
            if self._ref[i] == 0:
                del self._cached_free[i]
            self._ref[i] += 1

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Record that referenced, full ``block_id`` holds the tokens ``block_hash`` names.
        False (and nothing changes) when another block already holds them: two requests
        that computed the same prefix at once keep one copy in the cache, the other block
        returns to the free list when released."""
        if self._ref[block_id] == 0:
            raise ValueError(f"block {block_id} is not allocated; only held blocks are registered")
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def drop_cached(self) -> int:
        """Forget every cached-free block (they become plain free blocks); held blocks keep their
        names. Returns how many were dropped (vLLM's ``reset_prefix_cache``)."""
        n = len(self._cached_free)
        while self._cached_free:
            i, _ = self._cached_free.popitem(last=False)
            del self._block_of[self._hash_of.pop(i)]
            self._free.append(i)
        return n

    def is_registered(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def check(self) -> None:
        """Assert the allocator's invariants (tests call it after every operation)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice on the free list"
        cached = set(self._cached_free)
        assert not free & cached, "a block is both free and cached-free"
        for i in range(self.num_blocks):
            r = self._ref[i]
            assert r >= 0
            if r > 0:
                assert i not in free and i not in cached, f"referenced block {i} is on a free list"
            else:
                assert (i in free) != (i in cached), f"unreferenced block {i} is lost or on both lists"
                assert (i in cached) == (i in self._hash_of), f"block {i}: cached-free iff registered"
        assert all(self._block_of[h] == i for i, h in self._hash_of.items())
        assert len(self._block_of) == len(self._hash_of)
