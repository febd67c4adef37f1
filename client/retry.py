"""Sending a call again after a status that says none of it ran.

UNAVAILABLE (refused before it was queued, or dropped from the queue when no executor or
Redis was there; the retry is a new run) and ABORTED (a session turn that met another; the
turn was not recorded) are safe to send again unchanged, under the same request_id
(docs/failures.md). A call is sent again only while no response has come, so a stream is
never retried halfway, and never past the call's deadline, which covers every attempt.

Unary calls (Tokenize, GetModelInfo, EndSession) are retried by gRPC itself, under the
retry policy of SERVICE_CONFIG, a gRPC service config any client of any language can set on
its channel (docs/failures.md prints it). Streams (Generate) are retried here instead
(`stream_with_retries`): with grpcio 1.85, server-streaming calls under that policy whose
connection broke before their first response (the gateway killed) never ended, not even at
their deadline (8 of 8 calls, with the server back 1 s or 5 s later; without the policy
each ended UNAVAILABLE at once).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc
from grpc import aio

from common.redis_conn import Backoff
from protos.kvgate.v1 import inference_pb2

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED})
T = TypeVar("T")
_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
# The methods with one request and one response: gRPC's retry policy is safe for them.
UNARY_METHODS = tuple(
    m.name for m in _SERVICE.methods if not (m.client_streaming or m.server_streaming)
)
# The channel's service config: UNARY_METHODS retried on RETRYABLE_CODES, up to 4 tries,
# the pause before each retry random below 0.25 s, 0.5 s, then 1 s (gRPC's jittered
# exponential backoff), all within the call's deadline. Retry throttling stops retries on a
# channel while most calls fail (each failure costs a token of 10, each success gives back
# 0.1; retries stop below 5), so that an outage does not meet 4 times the calls.
SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": _SERVICE.full_name, "method": name} for name in UNARY_METHODS],
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.25s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": sorted(code.name for code in RETRYABLE_CODES),
            },
        }
    ],
    "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
}


def channel_options(retry: bool) -> list[tuple[str, object]]:
    """gRPC channel options: SERVICE_CONFIG's retries of unary calls, or none at all."""
    if not retry:
        return [("grpc.enable_retries", 0)]
    return [("grpc.service_config", json.dumps(SERVICE_CONFIG)), ("grpc.enable_retries", 1)]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Up to `max_attempts` tries; before each retry a pause drawn from `backoff` (at random
    below a ceiling that starts at 0.25 s and doubles up to 2 s)."""

    max_attempts: int = 4
    backoff: Backoff = Backoff(initial_s=0.25, max_s=2.0)


NO_RETRY = RetryPolicy(max_attempts=1)


def _time_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def retry_pause(
    error: grpc.RpcError,
    answered: bool,
    attempt: int,
    policy: RetryPolicy,
    pause: float,
    deadline: float | None,
) -> float | None:
    """`pause` before sending a failed stream again, or None when its error is final: the
    stream had answered, it was the last attempt, the status is not retryable, or the pause
    would pass the deadline (time.monotonic(); None: none)."""
    time_left = _time_left(deadline)
    if (
        answered
        or attempt == policy.max_attempts
        or error.code() not in RETRYABLE_CODES
        or (time_left is not None and pause >= time_left)
    ):
        return None
    return pause


def stream_with_retries(
    start: Callable[[float | None], Iterable[T]], policy: RetryPolicy, timeout_s: float | None
) -> Iterator[T]:
    """The responses of a call, sent again on a RETRYABLE_CODES status before its first
    response.

    Args:
        start: starts one attempt given its timeout (what is left of the deadline).
        timeout_s: the deadline of all attempts together; None: none.

    Raises:
        grpc.RpcError: the status of the last attempt.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pauses = policy.backoff.delays()
    for attempt in range(1, policy.max_attempts + 1):
        call: Iterable[T] = ()
        answered = False
        try:
            call = start(_time_left(deadline))
            for response in call:
                answered = True
                yield response
            return
        except grpc.RpcError as error:
            pause = retry_pause(error, answered, attempt, policy, next(pauses), deadline)
            if pause is None:
                raise
            time.sleep(pause)
        finally:
            if isinstance(call, grpc.Call):
                call.cancel()  # the caller stopped reading; nothing once the call has ended


async def astream_with_retries(
    start: Callable[[float | None], AsyncIterable[T]], policy: RetryPolicy, timeout_s: float | None
) -> AsyncIterator[T]:
    """stream_with_retries for grpc.aio calls: the same policy, pauses on the event loop."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pauses = policy.backoff.delays()
    for attempt in range(1, policy.max_attempts + 1):
        call: AsyncIterable[T] | None = None
        answered = False
        try:
            call = start(_time_left(deadline))
            async for response in call:
                answered = True
                yield response
            return
        except grpc.RpcError as error:
            pause = retry_pause(error, answered, attempt, policy, next(pauses), deadline)
            if pause is None:
                raise
            await asyncio.sleep(pause)
        finally:
            if isinstance(call, aio.Call):
                call.cancel()  # the caller stopped reading; nothing once the call has ended
