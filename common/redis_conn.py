"""Redis clients, built in one place; what counts as an outage; the backoff of the loops
that wait one out.

URLs (redis://, rediss://, unix://, redis+sentinel://) are read by common/redis_url.py.
redis-py's Sentinel support finds the master and follows a failover: a connection to a
demoted master is dropped and the next one asks the sentinels again.

Clients are created without redis-py's own retries, so that a call fails within its socket
timeout when Redis is down (the gateway answers UNAVAILABLE); each long-running loop
catches the error itself, logs once per outage, and tries again after the next `Backoff`
delay. An asyncio client can be given a connection budget: at most `max_connections`, a
call waiting at most `pool_wait_s` for one, after which ConnectionBudgetExhausted. Its read
timeout counts only the time its event loop was free to read (LoopFreeReads).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.redis_url import SENTINEL_SCHEME, parse_sentinel_url

# Error replies that mean "this Redis cannot serve now" (a failover, a restart, a busy script,
# memory or disk trouble), for those redis-py raises as a plain ResponseError. READONLY,
# LOADING, OOM, MASTERDOWN and TRYAGAIN get classes of their own (OUTAGE_CLASSES).
OUTAGE_REPLY_CODES = ("BUSY", "UNBLOCKED", "NOREPLICAS", "MISCONF", "MASTERDOWN", "CLUSTERDOWN")
OUTAGE_CLASSES = (
    redis.ConnectionError,  # connection lost or refused, LOADING, no master known to sentinels
    redis.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ClusterDownError,  # MASTERDOWN
    redis.exceptions.TryAgainError,
)


class ConnectionBudgetExhausted(redis.exceptions.MaxConnectionsError):
    """Every connection of a client's budget stayed in use for the whole wait."""

    def __init__(self, max_connections: int, wait_s: float) -> None:
        super().__init__(
            f"all {max_connections} Redis connections of this gateway's budget "
            f"(--redis-max-connections) stayed busy for {wait_s * 1000:g} ms"
        )
        self.max_connections = max_connections


def is_outage(error: BaseException) -> bool:
    """Whether `error` means Redis cannot serve right now (wait and try again), as opposed
    to a client's own limit (ConnectionBudgetExhausted) or a mistake in the command."""
    if isinstance(error, redis.exceptions.MaxConnectionsError):
        return False
    if isinstance(error, OUTAGE_CLASSES):
        return True
    if isinstance(error, redis.ResponseError):
        return str(error).split(" ", 1)[0] in OUTAGE_REPLY_CODES
    return False


# redis-py's message for a command of a pipeline that failed quotes the whole command,
# binary values (a serialized protobuf) included: "Command # 1 (SET key b'\\n...' PX 3000) of
# pipeline caused error: READONLY ...".
_PIPELINE_ERROR = re.compile(
    r"Command # (\d+) \((\S+).*\) of pipeline caused error: (.*)", re.DOTALL
)


def describe(error: BaseException) -> str:
    """`error`'s message for a log line or a status: of a pipeline's command, only its name
    is kept ("READONLY You can't write against a read only replica. (SET, command 1 of a
    pipeline)")."""
    text = str(error)
    match = _PIPELINE_ERROR.fullmatch(text)
    if match is None:
        return text
    number, command, reason = match.groups()
    return f"{reason} ({command.upper()}, command {number} of a pipeline)"


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter.

    Delay i is uniform in [0, min(max_s, initial_s * 2**i)].
    """

    initial_s: float = 0.05
    max_s: float = 2.0

    def delays(self) -> Iterator[float]:
        """An endless sequence of delays in seconds."""
        ceiling = self.initial_s
        while True:
            yield random.uniform(0.0, ceiling)
            ceiling = min(self.max_s, ceiling * 2)


class OutageLog:
    """Logs the first error of an outage and the recovery, not every failed try in between."""

    def __init__(self, logger, what: str) -> None:
        self._log = logger
        self._what = what
        self.down = False

    def failed(self, error: BaseException) -> None:
        if not self.down:
            kind = "unreachable" if is_outage(error) else "answered with an error"
            self._log.warning(
                "%s: redis %s (%s); retrying with backoff", self._what, kind, describe(error)
            )
            self.down = True

    def succeeded(self) -> None:
        if self.down:
            self._log.info("%s: redis reachable again", self._what)
            self.down = False


# The errors redis-py's discover_master collected, each after its sentinel client's repr:
# "<redis.client.Redis(<...>)>)>)> - network:ConnectionError, <redis.client.Redis(...".
_SENTINEL_ERROR = re.compile(r"\)> - (.*?)(?=, <redis\.|$)", re.DOTALL)
# The address redis-py repeats in each connection error ("Error 111 connecting to host:port.
# Connection refused."), already named once among the sentinels asked.
_ADDRESS_IN_ERROR = re.compile(r" connecting to \S+?\.(?= )")


def _no_master(sentinels, master_name: str, error: redis.ConnectionError) -> redis.ConnectionError:
    """`error` (a MasterNotFoundError) again, its message naming the master and the sentinels
    asked, and each distinct reason they failed, without the long repr of each sentinel's
    client or the address each connection error repeats (the message stays short whatever
    the sentinels' names and number)."""
    asked = ", ".join(
        f"{kwargs.get('host')}:{kwargs.get('port')}"
        for kwargs in (sentinel.connection_pool.connection_kwargs for sentinel in sentinels)
    )
    reasons = [_ADDRESS_IN_ERROR.sub(":", r) for r in _SENTINEL_ERROR.findall(str(error))]
    why = "; ".join(dict.fromkeys(reasons))  # each distinct reason once, in the order met
    why = why or "none of those that answered knows it as a master in good state"
    return type(error)(f"no master named {master_name!r} from the sentinels {asked} ({why})")


class _Sentinel(redis.sentinel.Sentinel):
    """redis-py's Sentinel; a master not found is reported by _no_master."""

    def discover_master(self, service_name):
        try:
            return super().discover_master(service_name)
        except redis.sentinel.MasterNotFoundError as error:
            raise _no_master(self.sentinels, service_name, error) from None


class _AsyncSentinel(aiosentinel.Sentinel):
    """redis-py's asyncio Sentinel; a master not found is reported by _no_master."""

    async def discover_master(self, service_name):
        try:
            return await super().discover_master(service_name)
        except aiosentinel.MasterNotFoundError as error:
            raise _no_master(self.sentinels, service_name, error) from None


def _client_kwargs(timeout_s: float) -> dict[str, object]:
    return {
        "socket_connect_timeout": timeout_s,
        "socket_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }


class _BudgetMixin:
    """A BlockingConnectionPool whose wait running out raises ConnectionBudgetExhausted."""

    async def get_connection(self, *args, **kwargs):
        try:
            return await super().get_connection(*args, **kwargs)
        except redis.ConnectionError as error:
            if isinstance(error.__cause__, asyncio.TimeoutError):
                raise ConnectionBudgetExhausted(self.max_connections, self.timeout) from None
            raise


# How often a read's timer checks whether the event loop was late (busy elsewhere).
LAG_TICK_S = 0.05


class _LagTick:
    """Moves `deadline` later by however late the event loop came back to it each tick."""

    def __init__(self, deadline: asyncio.Timeout) -> None:
        self._loop = asyncio.get_running_loop()
        self._deadline = deadline
        self._schedule()

    def _schedule(self) -> None:
        self._due = self._loop.time() + LAG_TICK_S
        self._handle = self._loop.call_at(self._due, self._run)

    def _run(self) -> None:
        late_s = self._loop.time() - self._due
        when = self._deadline.when()
        if late_s > 0 and when is not None:
            self._deadline.reschedule(when + late_s)
        self._schedule()

    def cancel(self) -> None:
        self._handle.cancel()


@contextlib.asynccontextmanager
async def loop_free_timeout(timeout_s: float):
    """asyncio.timeout, but counting only the time the event loop was free: a loop busy for
    seconds elsewhere (thousands of streams on a loaded host) does not use the time up.

    Raises:
        TimeoutError: as asyncio.timeout.
    """
    async with asyncio.timeout(timeout_s) as deadline:
        tick = _LagTick(deadline)
        try:
            yield
        finally:
            tick.cancel()


class LoopFreeReads:
    """A redis.asyncio connection mixin: its socket timeout on reads is a loop_free_timeout.
    A plain one fails a call whose reply came in time when the loop turned to it late (the
    timer and the reply are handled in the same turn of the loop, the timer first)."""

    async def read_response(
        self, disable_decoding=False, timeout=None, *, disconnect_on_error=True, push_request=False
    ):
        read = super().read_response
        if timeout is not None or self.socket_timeout is None:
            return await read(
                disable_decoding,
                timeout,
                disconnect_on_error=disconnect_on_error,
                push_request=push_request,
            )
        try:
            async with loop_free_timeout(self.socket_timeout):
                return await read(
                    disable_decoding,
                    math.inf,  # no timer of its own
                    disconnect_on_error=disconnect_on_error,
                    push_request=push_request,
                )
        except TimeoutError:
            raise redis.TimeoutError(f"Timeout reading from {self._host_error()}") from None


def _with_loop_free_reads(client: aioredis.Redis) -> aioredis.Redis:
    pool = client.connection_pool
    base = pool.connection_class
    pool.connection_class = type(f"LoopFree{base.__name__}", (LoopFreeReads, base), {})
    return client


class BudgetedPool(_BudgetMixin, aioredis.BlockingConnectionPool):
    pass


class BudgetedSentinelPool(
    _BudgetMixin, aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool
):
    pass


def connect(
    url: str,
    *,
    timeout_s: float = 1.0,
    max_connections: int = 64,
    pool_wait_s: float = 0.1,
) -> aioredis.Redis:
    """An asyncio Redis client that fails within about `timeout_s` when Redis does not answer.

    Args:
        url: one of URL_SCHEMES' forms.
        timeout_s: connect and socket timeout; blocking commands (XREAD BLOCK) must block less.
        max_connections: the connection budget.
        pool_wait_s: how long a call waits for a connection when all are busy.

    Returns:
        A client with no automatic retries; connections are made lazily.
    """
    kwargs = _client_kwargs(timeout_s) | {
        "max_connections": max_connections,
        "timeout": pool_wait_s,
        "health_check_interval": 0,
    }
    if url.startswith(f"{SENTINEL_SCHEME}://"):
        parsed = parse_sentinel_url(url)
        sentinel = _AsyncSentinel(
            list(parsed.sentinels),
            sentinel_kwargs=_client_kwargs(timeout_s),
        )
        return _with_loop_free_reads(
            sentinel.master_for(
                parsed.master_name,
                connection_pool_class=BudgetedSentinelPool,
                db=parsed.db,
                username=parsed.username,
                password=parsed.password,
                **kwargs,
            )
        )
    return _with_loop_free_reads(aioredis.Redis.from_pool(BudgetedPool.from_url(url, **kwargs)))


def connect_sync(url: str, *, timeout_s: float = 1.0) -> redis.Redis:
    """A blocking Redis client; the same contract as `connect`, without a budget."""
    if url.startswith(f"{SENTINEL_SCHEME}://"):
        parsed = parse_sentinel_url(url)
        sentinel = _Sentinel(list(parsed.sentinels), sentinel_kwargs=_client_kwargs(timeout_s))
        return sentinel.master_for(
            parsed.master_name,
            db=parsed.db,
            username=parsed.username,
            password=parsed.password,
            **_client_kwargs(timeout_s),
        )
    return redis.Redis.from_url(url, **_client_kwargs(timeout_s))
