"""Block hashes: the one definition used by the prefix cache, the offload tiers, the
Redis index and the gateway's router (docs/architecture.md).

A full block's hash is ``blake2b(digest_size=16)`` over
``parent_hash || extra_key || token_ids as little-endian int32``; the first block's
parent is 16 zero bytes. Only full blocks are hashed. This module imports no torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_SIZE = 16
ROOT_PARENT = bytes(HASH_SIZE)

BlockHash = bytes


def make_extra_key(model_id: str, cache_salt: str | None = None) -> bytes:
    """Everything besides token ids that changes KV content, as bytes.

    Length-prefixed fields so ("ab", "c") and ("a", "bc") never collide.
    """
    parts = [model_id.encode(), (cache_salt or "").encode()]
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    if len(parent) != HASH_SIZE:
        raise ValueError(f"parent hash must be {HASH_SIZE} bytes, got {len(parent)}")
    h = hashlib.blake2b(digest_size=HASH_SIZE)
    h.update(parent)
    h.update(extra_key)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return h.digest()


def hash_blocks(token_ids: Sequence[int], block_size: int, extra_key: bytes = b"",
                parent: BlockHash = ROOT_PARENT, start: int = 0) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids[start:]``, chained from ``parent``.

    ``start`` must be a multiple of ``block_size``; a trailing partial block is not hashed.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if start % block_size:
        raise ValueError("start must be block aligned")
    out: list[BlockHash] = []
    for i in range(start, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[i:i + block_size], extra_key)
        out.append(parent)
    return out
