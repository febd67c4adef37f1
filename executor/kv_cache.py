"""Paged KV cache manager: block pool, block tables, prefix cache and session pins.

Blocks are reference counted. A block with no reference is free; if it holds a full,
hashed block of tokens it stays findable in the prefix cache until it is reused
(least recently freed first). A finished request with a session id hands its blocks to
the session, which keeps them referenced until the session's next turn, `release_session`,
its TTL, or eviction under memory pressure (least recently used session first).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from common.prefix import next_block_hash
from executor.request import Request


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is published in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens behind block_hash, to confirm a hit


@dataclass(slots=True)
class Session:
    """The KV a finished turn left behind for the session's next turn."""

    session_id: str
    cache_salt: str | None
    token_ids: list[int]  # tokens whose K/V the blocks hold, in order
    block_ids: list[int]  # one reference each, owned by the session
    last_used_s: float = 0.0


@dataclass(slots=True)
class PrefixHit:
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


class KVCacheManager:
    """Owns every KV block; requests and sessions hold references to them."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        session_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.session_ttl_s = session_ttl_s
        self._clock = clock
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._hash_to_block: dict[int, int] = {}  # publication order
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # LRU first
        self.num_evicted_blocks = 0
        self.num_evicted_sessions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    # ---- hashing ------------------------------------------------------------------------

    def update_block_hashes(self, req: Request) -> None:
        """Extend `req.block_hashes` to cover every full block of its tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= req.num_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            tokens = req.all_token_ids[i * bs : (i + 1) * bs]
            req.block_hashes.append(next_block_hash(parent, tokens, req.cache_salt or ""))

    def register_computed_blocks(self, req: Request) -> None:
        """Publish the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(req)
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        bs = self.block_size
        for i in range(req.num_registered_blocks, num_full):
            block = self.blocks[req.block_table[i]]
            block_hash = req.block_hashes[i]
            if block.block_hash is None and block_hash not in self._hash_to_block:
                block.block_hash = block_hash
                block.token_ids = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
                self._hash_to_block[block_hash] = block.block_id
        req.num_registered_blocks = max(req.num_registered_blocks, num_full)

    # ---- admission ----------------------------------------------------------------------

    def acquire_cached_prefix(self, req: Request) -> int:
        """Give a request with no blocks the longest cached prefix of its tokens.

        The session's own blocks and the prefix cache are both tried; the longer hit wins. A
        hit never covers the last token, whose logits the request still needs. The caller
        releases the session once the request is admitted (this turn replaces it).

        Returns:
            The number of tokens whose K/V the request now holds.
        """
        assert not req.block_table and req.num_computed_tokens == 0
        max_tokens = req.num_tokens - 1
        session_hit = self._match_session(req, max_tokens)
        prefix_hit = self._match_prefix(req, max_tokens)
        hit = session_hit if session_hit.num_tokens >= prefix_hit.num_tokens else prefix_hit
        for block_id in hit.block_ids:
            self._incref(block_id)
        if hit is session_hit and session_hit.num_tokens % self.block_size:
            self._unpublish(hit.block_ids[-1])  # its tail will be overwritten by this request
        req.block_table = list(hit.block_ids)
        req.num_computed_tokens = hit.num_tokens
        req.num_registered_blocks = hit.num_tokens // self.block_size if hit is prefix_hit else 0
        return hit.num_tokens

    def num_cached_prefix_tokens(self, req: Request) -> int:
        """The tokens `acquire_cached_prefix` would give the request now, taking nothing."""
        max_tokens = req.num_tokens - 1
        session_hit = self._match_session(req, max_tokens)
        return max(session_hit.num_tokens, self._match_prefix(req, max_tokens).num_tokens)

    def _match_prefix(self, req: Request, max_tokens: int) -> PrefixHit:
        hit = PrefixHit()
        if not self.enable_prefix_caching:
            return hit
        self.update_block_hashes(req)
        bs = self.block_size
        for i in range(min(max_tokens // bs, len(req.block_hashes))):
            block_id = self._hash_to_block.get(req.block_hashes[i])
            tokens = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hit.block_ids.append(block_id)
        hit.num_tokens = len(hit.block_ids) * bs
        return hit

    def _match_session(self, req: Request, max_tokens: int) -> PrefixHit:
        session = self.sessions.get(req.session_id) if req.session_id is not None else None
        if session is None or session.cache_salt != req.cache_salt:
            return PrefixHit()
        num_common = _common_prefix_len(session.token_ids, req.all_token_ids, max_tokens)
        num_full = num_common // self.block_size
        block_ids = session.block_ids[:num_full]
        partial = num_common % self.block_size
        if partial and self.blocks[session.block_ids[num_full]].ref_count == 1:
            block_ids.append(session.block_ids[num_full])  # held by the session alone
        else:
            num_common = num_full * self.block_size
        return PrefixHit(block_ids, num_common)

    # ---- allocation ---------------------------------------------------------------------

    def num_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Blocks to add to the request's table so it can hold `num_new_tokens` more."""
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_table))

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of K/V; False (and no change) if full."""
        needed = self.num_blocks_needed(req, num_new_tokens)
        if not self._make_room(needed):
            return False
        for _ in range(needed):
            req.block_table.append(self._pop_free_block())
        return True

    def free(self, req: Request) -> None:
        """Drop the request's references; its published blocks stay in the prefix cache."""
        for block_id in reversed(req.block_table):
            self._decref(block_id)
        req.block_table = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0

    def _make_room(self, num_blocks: int) -> bool:
        """Free enough blocks by evicting sessions (LRU first), but only if that suffices."""
        if self.num_free_blocks >= num_blocks:
            return True
        if self.num_free_blocks + self._num_session_only_blocks() < num_blocks:
            return False  # evicting every session would not help: keep them
        while self.num_free_blocks < num_blocks:
            self._evict_session(next(iter(self.sessions)))
        return True

    def _num_session_only_blocks(self) -> int:
        """Blocks that releasing every session would free (no request holds them)."""
        session_refs: Counter[int] = Counter()
        for session in self.sessions.values():
            session_refs.update(session.block_ids)
        return sum(1 for b, n in session_refs.items() if self.blocks[b].ref_count == n)

    def _pop_free_block(self) -> int:
        if self._free_plain:
            block_id = self._free_plain.pop()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            self._unpublish(block_id)
            self.num_evicted_blocks += 1
        self.blocks[block_id].ref_count = 1
        return block_id

    def _incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free_cached[block_id]
        block.ref_count += 1

    def _decref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed twice")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._free_cached[block_id] = None
            else:
                self._free_plain.append(block_id)

    def _unpublish(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._hash_to_block[block.block_hash]
            block.block_hash = None
            block.token_ids = ()

    # ---- sessions -----------------------------------------------------------------------

    def pin_session(self, req: Request) -> None:
        """Hand a finished request's blocks to its session instead of freeing them."""
        assert req.session_id is not None
        self.release_session(req.session_id)
        num_kv_tokens = req.num_computed_tokens
        self.sessions[req.session_id] = Session(
            session_id=req.session_id,
            cache_salt=req.cache_salt,
            token_ids=req.all_token_ids[:num_kv_tokens],
            block_ids=req.block_table,
            last_used_s=self._clock(),
        )
        req.block_table = []
        req.num_computed_tokens = 0

    def release_session(self, session_id: str, cache_salt: str | None = None, *,
                        any_tenant: bool = True) -> bool:  # fmt: skip
        """Drop a session's pins; with `any_tenant=False` only the tenant `cache_salt`'s.

        Returns:
            Whether a session was released.
        """
        session = self.sessions.get(session_id)
        if session is None or not (any_tenant or session.cache_salt == cache_salt):
            return False
        del self.sessions[session_id]
        for block_id in reversed(session.block_ids):
            self._decref(block_id)
        return True

    def expire_sessions(self) -> int:
        """Release sessions idle longer than `session_ttl_s`; returns how many."""
        deadline = self._clock() - self.session_ttl_s
        expired = [s.session_id for s in self.sessions.values() if s.last_used_s < deadline]
        for session_id in expired:
            self.release_session(session_id)
        return len(expired)

    def _evict_session(self, session_id: str) -> None:
        self.release_session(session_id)
        self.num_evicted_sessions += 1

    def cached_block_hashes(self, limit: int) -> list[int]:
        """Hashes of the most recently published blocks still in the prefix cache, newest first."""
        newest = reversed(self._hash_to_block)
        return [h for h, _ in zip(newest, range(limit), strict=False)]

    def num_session_blocks(self) -> int:
        """Blocks held by sessions (a block shared by two sessions counts twice)."""
        return sum(len(s.block_ids) for s in self.sessions.values())


def _common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
