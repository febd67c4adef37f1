"""Stable hashes of prompt blocks, shared by executors (who report them) and the scheduler.

The hashes chain like the KV cache's (a block's hash covers every token before
it) and are salted by the tenant, so equal hashes mean an equal, shareable
prefix. They use blake2b, not Python's `hash`, to agree across processes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


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
    parent = hashlib.blake2b(salt.encode(), digest_size=8).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = array("I", token_ids[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes
