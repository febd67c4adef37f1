"""KVCacheManager driven the way the step scheduler drives it, by a hypothesis state machine.

The test keeps a shadow copy of the KV pool: when a request "computes" a position it writes
(cache salt, tokens up to and including that position) into the slot, since that is what
the K/V there depends on. Every request's computed positions, every session's tokens and
every published block are then checked against the shadow: a request must never read K/V
written for other tokens or for another salt, whatever mix of prefix hits, session turns,
preemptions, expiries and evictions led there. With a host tier the shadow has host blocks
too, and the copies the manager queues are run on it before anything reads or writes K/V
(as the engine runs them before a forward pass): swapped-out requests and offloaded
sessions must find their own K/V when they come back. The shadow and its checks are in
kv_cache_shadow.py.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from common.sampling_params import SamplingParams
from engine.kv_cache import KVCacheManager, SessionKey
from engine.request import Request
from tests.unit.kv_cache_shadow import Content, FakeClock, ShadowChecks

VOCAB = st.integers(0, 3)  # tiny, so prefixes repeat and the cache hits often
# Prompts often start with a shared "system prompt", as in real traffic: blocks get shared.
SYSTEM_PROMPTS = st.sampled_from([[0, 1, 2, 0, 1, 2, 0], [], [1, 1, 0, 0, 2, 2]])
PROMPTS = st.tuples(SYSTEM_PROMPTS, st.lists(VOCAB, min_size=1, max_size=8)).map(
    lambda parts: parts[0] + parts[1]
)
CACHE_SALTS = st.sampled_from([None, "a", "b"])
# (session_id, cache_salt): s0 and s1 (drawn most) share a tenant, so their sessions share
# blocks; s2 changes tenant between turns, so its KV must not be reused across the change.
SESSIONS = st.sampled_from(
    [("s0", None), ("s1", None), (None, None), (None, "a"), (None, "b"), ("s2", "a"), ("s2", "b")]
    + [("s0", None), ("s1", None)]
)
MAX_LIVE_REQUESTS = 4
MAX_REQUEST_TOKENS = 16  # a request finishes (LENGTH) once it holds this many tokens
EOS = 3  # sampling it finishes the request (STOP), so turns end and sessions get pinned
SESSION_TTL_S = 10.0


def draw_request(data: st.DataObject, requests: list[Request]) -> Request:
    """One of `requests`, drawn by id so that a failing example prints short."""
    by_id = {r.request_id: r for r in requests}
    return by_id[data.draw(st.sampled_from(sorted(by_id)), label="request")]


class KVCacheMachine(ShadowChecks, RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([2, 4]),
        num_blocks=st.integers(8, 32),
        enable_prefix_caching=st.sampled_from([True, True, True, False]),
        num_host_blocks=st.sampled_from([0, 0, 4, 12, 40]),
        swap_preempted=st.booleans(),
    )
    def init_cache(
        self,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool,
        num_host_blocks: int,
        swap_preempted: bool,
    ) -> None:
        self.clock = FakeClock()
        self.kv = KVCacheManager(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            session_ttl_s=SESSION_TTL_S,
            clock=self.clock,
            num_host_blocks=num_host_blocks,
        )
        self.bs = block_size
        self.swap_preempted = swap_preempted
        self.shadow: list[list[Content | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.shadow_host: list[list[Content | None]] = [
            [None] * block_size for _ in range(num_host_blocks)
        ]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.pending: dict[str, int] = {}  # request_id -> tokens allocated, not yet computed
        # (tenant's salt, session id) -> what pin_session got
        self.pinned: dict[SessionKey, tuple[str | None, list[int], float]] = {}
        self.transcripts: list[tuple[str | None, str | None, list[int]]] = []
        self.last_turn: dict[str, int] = {}  # session_id -> its last pinned turn's transcript
        self.hash_contents: dict[int, Content] = {}  # every block hash a request produced
        self.num_evicted_sessions = 0  # evictions accounted for in `pinned`
        self.ids = itertools.count()

    # ---- helpers ------------------------------------------------------------------------

    def new_request(self, prompt: list[int], session_id: str | None, salt: str | None) -> Request:
        n = next(self.ids)
        return Request(f"r{n}", prompt, SamplingParams(), n, session_id=session_id, cache_salt=salt)

    def submit(self, req: Request, chunk: int) -> None:
        self.waiting.append(req)
        self.try_admit(req, chunk)

    def try_admit(self, req: Request, chunk: int) -> bool:
        """The scheduler's admission: cached prefix, then slots for a chunk, else back off."""
        if req.host_block_table:  # swapped out: its blocks come back, nothing else changes
            num_new = min(req.num_tokens - req.num_computed_tokens, chunk)
            host_table = list(req.host_block_table)
            if not self.kv.swap_in(req, num_new):
                assert req.host_block_table == host_table and not req.block_table
                return False
            self.waiting.remove(req)
            self.running.append(req)
            self.pending[req.request_id] = num_new
            return True
        num_cached = self.kv.acquire_cached_prefix(req)
        assert num_cached < req.num_tokens, (
            f"a hit may not cover the last token: {req.request_id} has {req.num_tokens} tokens "
            f"and got a hit of {num_cached}"
        )
        assert req.num_computed_tokens == num_cached
        assert len(req.block_table) == -(-num_cached // self.bs), (
            f"a hit of {num_cached} tokens should hold {-(-num_cached // self.bs)} blocks, "
            f"holds {req.block_table}"
        )
        self.assert_holds_own_kv(req, num_cached, "prefix hit")
        num_new = min(req.num_tokens - num_cached, chunk)
        table_after_hit = list(req.block_table)
        if not self.kv.allocate_slots(req, num_new):
            assert req.block_table == table_after_hit, "a failed allocation changed the table"
            self.kv.free(req)
            return False
        if req.session_id is not None:  # this turn replaces its tenant's session
            own = self.kv._find_session(req.session_id, req.cache_salt) is not None
            released = self.kv.release_session(req.session_id, req.cache_salt)
            assert released == own, f"release of {req.session_id} returned {released}"
            if released:
                self.pinned.pop((req.cache_salt, req.session_id))
        self.waiting.remove(req)
        self.running.append(req)
        self.pending[req.request_id] = num_new
        return True

    def run_forward(self, req: Request, token_id: int) -> None:
        start = req.num_computed_tokens
        stop = start + self.pending.pop(req.request_id)
        assert len(req.block_table) * self.bs >= stop, (
            f"{req.request_id} was scheduled up to token {stop} but holds only "
            f"{len(req.block_table)} blocks of {self.bs}"
        )
        self.run_swaps()
        self.assert_holds_own_kv(req, start, "attention before compute")
        self.write_kv(req, start, stop)
        req.num_computed_tokens = stop
        self.kv.register_computed_blocks(req)
        self.record_hashes(req)
        if stop == req.num_tokens:
            req.all_token_ids.append(token_id)
            if token_id == EOS or req.num_tokens >= MAX_REQUEST_TOKENS:
                self.finish(req, abort=False)

    def finish(self, req: Request, abort: bool) -> None:
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.pending.pop(req.request_id, None)
        self.transcripts.append((req.session_id, req.cache_salt, list(req.all_token_ids)))
        if req.session_id is not None and not abort:
            self.account_for_evicted_sessions()
            self.last_turn[req.session_id] = len(self.transcripts) - 1
            tokens = req.all_token_ids[: req.num_computed_tokens]
            self.kv.pin_session(req)
            key = (req.cache_salt, req.session_id)
            self.pinned.pop(key, None)  # a new pin is the most recently used
            self.pinned[key] = (req.cache_salt, tokens, self.clock.now_s)
        else:
            self.kv.free(req)

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pending.pop(req.request_id, None)
        if not (self.swap_preempted and self.kv.swap_out(req)):
            self.kv.free(req)
        self.waiting.append(req)

    def allocate_or_preempt(self, req: Request, num_new: int) -> bool:
        """The scheduler's loop: preempt the newest unscheduled request until the step fits."""
        while not self.kv.allocate_slots(req, num_new):
            victim = max(
                (r for r in self.running if r.request_id not in self.pending),
                key=lambda r: r.sort_key,
            )
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def just_sampled(self) -> list[Request]:
        return [
            r
            for r in self.running
            if r.request_id not in self.pending and r.num_computed_tokens == r.num_tokens - 1
        ]

    def unscheduled_running(self) -> list[Request]:
        return [
            r
            for r in self.running
            if r.request_id not in self.pending and r.num_computed_tokens < r.num_tokens
        ]

    # ---- rules --------------------------------------------------------------------------

    @precondition(lambda self: len(self.waiting) + len(self.running) < MAX_LIVE_REQUESTS)
    @rule(
        prompt=PROMPTS,
        session=SESSIONS,
        chunk=st.integers(1, 12),
    )
    def add_request(
        self, prompt: list[int], session: tuple[str | None, str | None], chunk: int
    ) -> None:
        self.submit(self.new_request(prompt, *session), chunk)

    @precondition(
        lambda self: self.transcripts and len(self.waiting) + len(self.running) < MAX_LIVE_REQUESTS
    )
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def add_next_turn(self, data: st.DataObject, chunk: int) -> None:
        """A request built on an earlier one's tokens: the next chat turn, or a retry."""
        sources = self.transcripts[-4:]
        sources += [(r.session_id, r.cache_salt, r.all_token_ids) for r in self.running]
        sources += [self.transcripts[self.last_turn[sid]] for sid in self.kv.session_ids()] * 2
        session_id, salt, tokens = data.draw(st.sampled_from(sources))
        keep = data.draw(st.sampled_from([len(tokens), None]))  # all of it, or up to a point
        if keep is None:
            keep = data.draw(st.integers(0, len(tokens)))
        prompt = tokens[:keep] + data.draw(st.lists(VOCAB, min_size=0 if keep else 1, max_size=4))
        if data.draw(st.integers(0, 3)) == 0:
            session_id, salt = data.draw(SESSIONS)  # another conversation from the same text
        self.submit(self.new_request(prompt, session_id, salt), chunk)

    @precondition(
        lambda self: (
            len(self.waiting) + len(self.running) < MAX_LIVE_REQUESTS
            and any(len(s.token_ids) > 1 for s in self.all_sessions())
        )
    )
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def edit_session_turn(self, data: st.DataObject, chunk: int) -> None:
        """The user edits an earlier message: the turn diverges inside the session's KV.

        Now and then the same session id comes from another tenant, whose turn must not see
        this tenant's KV (nor replace its session: it pins a session of its own).
        """
        editable = sorted((s.key for s in self.all_sessions() if len(s.token_ids) > 1), key=str)
        salt, session_id = data.draw(st.sampled_from(editable))
        _, tokens, _ = self.pinned[(salt, session_id)]
        if data.draw(st.integers(0, 3)) == 0:
            salt = data.draw(CACHE_SALTS)
        cut = data.draw(st.integers(1, len(tokens) - 1))
        edited = (tokens[cut] + data.draw(st.integers(1, 3))) % 4
        prompt = tokens[:cut] + [edited] + data.draw(st.lists(VOCAB, max_size=4))
        self.submit(self.new_request(prompt, session_id, salt), chunk)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def admit(self, data: st.DataObject, chunk: int) -> None:
        self.try_admit(draw_request(data, self.waiting), chunk)

    @precondition(lambda self: self.waiting or self.running)
    @rule(data=st.data(), budget=st.integers(1, 16))
    def step(self, data: st.DataObject, budget: int) -> None:
        """A whole scheduler step: running requests, then waiting ones, then the forward."""
        preempted = False
        for req in sorted(self.running, key=lambda r: r.sort_key):
            if budget == 0:
                break
            if req not in self.running or req.request_id in self.pending:
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            num_running = len(self.running)
            if self.allocate_or_preempt(req, num_new):
                self.pending[req.request_id] = num_new
                budget -= num_new
            preempted = preempted or len(self.running) < num_running
        for req in sorted(self.waiting, key=lambda r: r.sort_key):
            if preempted or budget == 0 or not self.try_admit(req, budget):
                break
            budget -= self.pending[req.request_id]
        for req in [r for r in self.running if r.request_id in self.pending]:
            self.run_forward(req, data.draw(VOCAB))

    @precondition(lambda self: self.unscheduled_running())
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def schedule_running(self, data: st.DataObject, chunk: int) -> None:
        """Give a running request its next chunk (or its one decode token)."""
        req = draw_request(data, self.unscheduled_running())
        num_new = min(req.num_tokens - req.num_computed_tokens, chunk)
        if self.allocate_or_preempt(req, num_new):
            self.pending[req.request_id] = num_new

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), token_id=VOCAB)
    def compute(self, data: st.DataObject, token_id: int) -> None:
        """The forward pass: write the scheduled K/V, publish full blocks, maybe sample."""
        req = draw_request(data, [r for r in self.running if r.request_id in self.pending])
        self.run_forward(req, token_id)

    @precondition(lambda self: any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running))
    @rule(data=st.data(), token_id=VOCAB)
    def decode(self, data: st.DataObject, token_id: int) -> None:
        """A whole decode step for one request: one slot, compute it, sample the next token."""
        ready = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        req = draw_request(data, ready)
        if req.request_id not in self.pending:
            if not self.allocate_or_preempt(req, 1):
                return
            self.pending[req.request_id] = 1
        self.run_forward(req, token_id)

    @precondition(lambda self: self.just_sampled())
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        """A request sampled its last token; its session (if any) keeps its KV."""
        self.finish(draw_request(data, self.just_sampled()), abort=False)

    @precondition(lambda self: self.waiting or self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def interrupt(self, data: st.DataObject, preempt: bool) -> None:
        """Preempt a running request between steps, or abort any request (nothing is pinned)."""
        candidates = [r for r in self.running if r.request_id not in self.pending]
        if preempt and candidates:
            self.preempt(draw_request(data, candidates))
        else:
            self.finish(draw_request(data, self.waiting + self.running), abort=True)

    @precondition(lambda self: self.kv.session_ids())
    @rule(data=st.data(), salt=CACHE_SALTS)
    def release_session(self, data: st.DataObject, salt: str | None) -> None:
        """A client ends a conversation: its tenant's session of that id, no other."""
        ids = sorted(set(self.kv.session_ids())) + ["never-pinned"]
        session_id = data.draw(st.sampled_from(ids))
        expected = (salt, session_id) in self.pinned
        others = [key for key in self.pinned if key != (salt, session_id)]
        released = self.kv.release_session(session_id, salt)
        assert released == expected, f"release of {session_id} returned {released}"
        if released:
            del self.pinned[(salt, session_id)]
        left = {s.key for s in self.all_sessions()}
        assert set(others) <= left, f"releasing {(salt, session_id)} dropped {set(others) - left}"

    @precondition(lambda self: self.kv.session_ids())
    @rule(dt_s=st.sampled_from([1.0, 4.0, SESSION_TTL_S + 1]))
    def time_passes(self, dt_s: float) -> None:
        """The clock moves on and the engine expires idle sessions, as each step begins."""
        self.clock.now_s += dt_s
        deadline = self.clock.now_s - SESSION_TTL_S
        stale = {s.key for s in self.all_sessions() if s.last_used_s < deadline}
        assert self.kv.expire_sessions() == len(stale)
        kept = {s.key for s in self.all_sessions()}
        assert not stale & kept, f"sessions {stale & kept} outlived their TTL"
        for key in stale:
            del self.pinned[key]

    @precondition(lambda self: self.kv.sessions)
    @rule(
        prompt=st.lists(VOCAB, min_size=1, max_size=8),
        salt=CACHE_SALTS,
        publish=st.booleans(),
    )
    def evict_under_pressure(self, prompt: list[int], salt: str | None, publish: bool) -> None:
        """A hog takes blocks until none is left, writes them, and goes away."""
        num_tokens = (self.kv.num_blocks + 1) * self.bs
        hog = self.new_request((prompt * num_tokens)[:num_tokens], None, salt)
        evicted_before = self.kv.num_evicted_sessions
        sessions_before = len(self.kv.session_ids())
        k = 1
        while self.kv.allocate_slots(hog, k * self.bs):
            k += 1
        assert self.kv.num_free_blocks == 0, (
            f"allocation failed with {self.kv.num_free_blocks} blocks still free"
        )
        # a session survives full pressure only if evicting it would free nothing
        request_held = {b for r in self.running + self.waiting + [hog] for b in r.block_table}
        for session in self.sessions():
            alone = set(session.block_ids) - request_held
            assert not alone, f"session {session.session_id} kept blocks {alone} under pressure"
        evicted = self.kv.num_evicted_sessions - evicted_before
        assert evicted == sessions_before - len(self.kv.session_ids())
        self.run_swaps()  # the copies of offloaded sessions read their blocks first
        written = len(hog.block_table) * self.bs
        self.write_kv(hog, 0, written)
        if publish:
            hog.num_computed_tokens = written
            self.kv.register_computed_blocks(hog)
            self.record_hashes(hog)
        self.kv.free(hog)

    # ---- invariants ---------------------------------------------------------------------

    @invariant()
    def kv_cache_is_consistent(self) -> None:
        """Checked after every rule (one invariant, so a failing example prints short)."""
        self.run_swaps()
        self.check_ref_counts_match_references()
        self.check_host_blocks_have_one_owner_each()
        self.check_free_lists_hold_each_free_block_once()
        self.check_blocks_are_never_shared_across_salts()
        self.check_requests_hold_their_own_kv()
        self.check_sessions_hold_their_turns_kv()
        self.check_published_blocks_hold_what_their_hash_names()

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for req in list(self.running + self.waiting):
            self.finish(req, abort=False)
        for session in self.all_sessions():
            assert self.kv.release_session(session.session_id, session.cache_salt)
        assert self.kv.num_free_blocks == self.kv.num_blocks, (
            f"with nothing live, all {self.kv.num_blocks} blocks should be free, "
            f"{self.kv.num_free_blocks} are"
        )
        assert self.kv.host.num_free_blocks == self.kv.host.num_blocks, "host blocks still held"


KVCacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_behaves_like_the_scheduler_expects = KVCacheMachine.TestCase
