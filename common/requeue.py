"""Putting a request back on the request stream: the one way every process does it.

Three processes re-queue, each for its own reason (docs/serving-contract.md has the table),
all writing the entry with `stream_fields` and capped by `attempts_used_up`; the scheduler
and a draining executor build it with `next_attempt`, the gateway from the attempt its token
router counts (the count that also drops a lost attempt's late tokens):
- the gateway, when the executor running a request is lost (its TokenSink stream broke, or
  its heartbeat stayed gone): as the next attempt, with the tokens already streamed, so the
  client's stream goes on (past max_attempts it finishes the request with an error itself);
- the scheduler, for the assignments left in the inbox of an executor whose heartbeat
  expired: every request it owed, running or not (an executor deletes an assignment once the
  request is done there), as the next attempt;
- an executor that drains, for the assignments it will not run: as the same attempt (they
  never ran).
The attempt count is capped by QueuedRequest.max_attempts, which an executor checks before
it runs a request (a request that kills executors does not kill them all). A gateway also
queues a waiting request again, as the same attempt, after a Redis outage (its entry may
have been lost); only a gateway cancels (a marker the assignment checks).
"""

from __future__ import annotations

from common.keys import PAYLOAD_FIELD
from protos.kvgate.v1 import internal_pb2


def attempts_used_up(request: internal_pb2.QueuedRequest) -> str | None:
    """Why `request` must not run (its attempt is past max_attempts), or None."""
    if request.max_attempts and request.attempt >= request.max_attempts:
        return (
            f"the request lost its executor {request.attempt} times; it is not run again "
            f"(--max-attempts {request.max_attempts})"
        )
    return None


def next_attempt(request: internal_pb2.QueuedRequest) -> internal_pb2.QueuedRequest:
    """A copy of `request` as its next attempt (attempt + 1); the request id, the queue
    deadline and the resume tokens stay as they are."""
    requeued = internal_pb2.QueuedRequest()
    requeued.CopyFrom(request)
    requeued.attempt += 1
    return requeued


def stream_fields(request: internal_pb2.QueuedRequest) -> dict[str, bytes]:
    """The fields of the request stream entry that holds `request`."""
    return {PAYLOAD_FIELD: request.SerializeToString()}
