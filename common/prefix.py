"""Stable hashes of prompt blocks, shared by the executor's KV cache and the scheduler.

The hashes chain (a block's hash covers every token before it) and are salted by the
tenant, so equal hashes mean an equal, shareable prefix. The executor's prefix cache is
keyed by these very hashes and reports them in its heartbeat; the scheduler hashes a
queued prompt the same way to estimate each executor's cache hit. blake2b, not Python's
`hash`, so that every process agrees.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def next_block_hash(parent: int | None, block_token_ids: Sequence[int], salt: str = "") -> int:
    """Hash of one full block given its parent's hash (None for the first block).

    Args:
        parent: the previous block's hash, or None at the start of a sequence.
        block_token_ids: the block's token ids.
        salt: the tenant; different salts give unrelated hashes.

    Returns:
        An unsigned 64-bit hash.
    """
    if parent is None:
        parent_bytes = hashlib.blake2b(salt.encode(), digest_size=8).digest()
    else:
        parent_bytes = parent.to_bytes(8, "little")
    block = array("I", block_token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(parent_bytes + block, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[int]:
    """Chained 64-bit hashes of the full blocks of `token_ids`.

    Args:
        token_ids: a prompt's token ids.
        block_size: tokens per KV block; the trailing partial block is not hashed.
        salt: the tenant; different salts give unrelated hashes.

    Returns:
        One unsigned 64-bit hash per full block, in order.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = next_block_hash(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes
