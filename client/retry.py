"""Sending a call again after a status that says none of it ran.

UNAVAILABLE (refused before it was queued, or dropped from the queue when no executor or
Redis was there; the retry is a new run) and ABORTED (a session turn that met another; the
turn was not recorded) are safe to send again unchanged, under the same request_id
(docs/failures.md). A call is sent again only while no response has come, so a stream is
never retried halfway, and never past the call's deadline, which covers every attempt.

The retries are the client's own, not gRPC's retry policy (a service config): with grpcio
1.85, server-streaming calls under that policy whose connection broke before their first
response (the gateway killed) never ended, not even at their deadline (8 of 8 calls, with
the server back 1 s or 5 s later; without the policy each ended UNAVAILABLE at once).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

from common.redis_conn import Backoff

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED})
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Up to `max_attempts` tries; before each retry a pause drawn from `backoff` (at random
    below a ceiling that starts at 0.25 s and doubles up to 2 s)."""

    max_attempts: int = 4
    backoff: Backoff = Backoff(initial_s=0.25, max_s=2.0)


NO_RETRY = RetryPolicy(max_attempts=1)


def _time_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


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
            pause = next(pauses)
            time_left = _time_left(deadline)
            if (
                answered
                or attempt == policy.max_attempts
                or error.code() not in RETRYABLE_CODES
                or (time_left is not None and pause >= time_left)
            ):
                raise
            time.sleep(pause)
        finally:
            if isinstance(call, grpc.Call):
                call.cancel()  # the caller stopped reading; nothing once the call has ended


def call_with_retries(
    call: Callable[[float | None], T], policy: RetryPolicy, timeout_s: float | None
) -> T:
    """The response of a unary call, sent again as `stream_with_retries` would."""
    for response in stream_with_retries(lambda timeout: (call(timeout),), policy, timeout_s):
        return response
    raise AssertionError("a unary call ended without a response or an error")
