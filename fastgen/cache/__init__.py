"""The KV cache: a block allocator (bookkeeping only) and the block pool (the tensors)."""
from .allocator import BlockAllocator, OutOfBlocksError
from .pool import KVPool

__all__ = ["BlockAllocator", "KVPool", "OutOfBlocksError"]
