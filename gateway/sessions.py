"""Sessions in Redis: one SessionState per key, with a TTL renewed at each turn.

Every tenant has a session id space of its own (the key holds the tenant): a session id
names the caller's own session, and another tenant's session with the same id is never
read, continued or ended; to its caller it does not exist.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from common.keys import RedisKeys
from common.templates import Message
from gateway.errors import Aborted, NotFound
from protos.kvgate.v1 import inference_pb2, internal_pb2

MAX_TURN_WRITES = 16  # check-and-set attempts of record_turn


@dataclass(slots=True)
class Session:
    """A conversation (or a Generate session) and where its KV cache lives."""

    session_id: str
    tenant: str
    messages: list[Message] = field(default_factory=list)
    executor_id: str = ""  # ran the last turn; empty: none yet
    num_turns: int = 0
    created_unix_ms: int = 0

    def to_pb(self) -> internal_pb2.SessionState:
        return internal_pb2.SessionState(
            session_id=self.session_id,
            tenant=self.tenant,
            messages=[
                inference_pb2.ChatMessage(role=m.role, content=m.content) for m in self.messages
            ],
            executor_id=self.executor_id,
            num_turns=self.num_turns,
            created_unix_ms=self.created_unix_ms,
        )

    @classmethod
    def from_pb(cls, state: internal_pb2.SessionState) -> Session:
        return cls(
            session_id=state.session_id,
            tenant=state.tenant,
            messages=[Message(m.role, m.content) for m in state.messages],
            executor_id=state.executor_id,
            num_turns=state.num_turns,
            created_unix_ms=state.created_unix_ms,
        )


class SessionStore:
    """Reads and writes sessions, each under its tenant."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, ttl_s: float) -> None:
        self.client = client
        self.keys = keys
        self.ttl_ms = max(1, int(ttl_s * 1000))

    async def create(self, tenant: str) -> Session:
        """Open a new session with a fresh id."""
        while True:
            session = await self._create(tenant, uuid.uuid4().hex)
            if session is not None:
                return session

    async def _create(self, tenant: str, session_id: str) -> Session | None:
        """Open session `session_id`; None when the id is already taken."""
        session = Session(session_id, tenant, created_unix_ms=int(time.time() * 1000))
        created = await self.client.set(
            self.keys.session(tenant, session_id),
            session.to_pb().SerializeToString(),
            px=self.ttl_ms,
            nx=True,
        )
        return session if created else None

    async def load(self, session_id: str, tenant: str) -> Session:
        """The session `session_id` of `tenant`.

        Raises:
            NotFound: the tenant has no such session (never opened, ended or expired).
        """
        raw = await self.client.get(self.keys.session(tenant, session_id))
        if raw is None:
            raise NotFound(f"session_id: no session {session_id!r} (ended or expired)")
        return Session.from_pb(internal_pb2.SessionState.FromString(raw))

    async def open_or_load(self, session_id: str, tenant: str) -> Session:
        """Load `session_id`, or open it when it does not exist."""
        created = await self._create(tenant, session_id)
        return created if created is not None else await self.load(session_id, tenant)

    async def record_turn(
        self, session: Session, new_messages: list[Message], executor_id: str
    ) -> bool:
        """Append a finished turn to the stored session, renew its TTL, and bring `session` up
        to date with what is stored.

        The turn is appended to the messages stored now, not to those `session` was loaded
        with: another stream on the same session may have added turns since, and they stay
        (a check-and-set: `Redis.transaction` watches the key and runs it again when the key
        changes under it, MAX_TURN_WRITES times at most). A session ended (EndSession) or
        expired meanwhile is not brought back: the turn is not recorded.

        Args:
            session: the caller's copy; updated in place.
            new_messages: the turn's messages (none for a Generate turn).
            executor_id: the executor that ran the turn (empty: keep the stored one).

        Returns:
            False when the session no longer exists (the turn is not recorded).

        Raises:
            Aborted: the session changed under every one of MAX_TURN_WRITES attempts.
        """
        key = self.keys.session(session.tenant, session.session_id)
        attempts = 0

        async def append_turn(pipe: Pipeline) -> Session | None:
            nonlocal attempts
            attempts += 1
            if attempts > MAX_TURN_WRITES:
                raise Aborted(
                    f"session_id: {session.session_id!r} kept changing; send the turn again"
                )
            raw = await pipe.get(key)
            if raw is None:
                await pipe.unwatch()  # nothing left to execute: the turn is not recorded
                return None
            stored = Session.from_pb(internal_pb2.SessionState.FromString(raw))
            stored.messages.extend(new_messages)
            stored.executor_id = executor_id or stored.executor_id
            stored.num_turns += 1
            pipe.multi()
            pipe.set(key, stored.to_pb().SerializeToString(), px=self.ttl_ms)
            return stored

        stored = await self.client.transaction(append_turn, key, value_from_callable=True)
        if stored is None:
            return False
        session.messages = stored.messages
        session.executor_id = stored.executor_id
        session.num_turns = stored.num_turns
        return True

    async def end(self, session_id: str, tenant: str) -> Session:
        """Delete a session and return its last state.

        Raises:
            NotFound: as load.
        """
        session = await self.load(session_id, tenant)
        await self.client.delete(self.keys.session(tenant, session_id))
        return session
