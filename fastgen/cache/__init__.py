"""The KV cache: a block allocator (bookkeeping, reference counts, cached-free blocks), the
content addresses of full blocks (prefix caching) and the block pool (the tensors)."""
from .allocator import BlockAllocator, OutOfBlocksError
from .pool import KVPool
from .prefix import block_hash, root_hash

__all__ = ["BlockAllocator", "KVPool", "OutOfBlocksError", "block_hash", "root_hash"]
