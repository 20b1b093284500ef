"""Content addresses of full KV blocks: a hash chain over token ids, rooted in the keys that
must keep caches apart.

Block ``k`` of a sequence is named ``H(name of block k-1, its block_size token ids)``, and
block 0's parent is the sequence's *root*: ``H(model, tenant, salt)``. Two sequences share a
block only when the model, the tenant, the salt and every token up to the end of that block
are equal. SHA-256, so that nobody can make two prefixes collide on purpose (a
non-cryptographic hash over attacker-chosen tokens would let one tenant name another's
blocks); hashing a 32-token block costs about a microsecond, once per block filled.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence


def root_hash(*keys: str | None) -> bytes:
    """The root of a chain: length-prefixed ``keys`` (``None`` and ``""`` differ), hashed."""
    h = hashlib.sha256(b"fastgen-prefix-v1")
    for key in keys:
        if key is None:
            h.update(b"\xff")
        else:
            raw = key.encode("utf-8", "surrogatepass")
            h.update(struct.pack("<Q", len(raw)) + raw)
    return h.digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The name of a full block holding ``token_ids`` after the block named ``parent``."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()
