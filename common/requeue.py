"""Putting a request back on the request stream: the one way every process does it.

Three processes re-queue, each for its own reason, and all through `next_attempt`
(docs/serving-contract.md has the table):
- the gateway, when the executor running a request is lost (its TokenSink stream broke, or
  its heartbeat stayed gone): with the tokens already streamed, so the client's stream goes
  on; capped by the gateway's --max-attempts, past which the request finishes with
  FINISH_REASON_ERROR (a request that kills executors does not kill them all);
- the scheduler, for the assignments left unread in the inbox of an executor whose heartbeat
  expired (they never ran);
- an executor that drains, for the assignments it will not run (they never ran).
A gateway also queues a waiting request again, as the same attempt, after a Redis outage
(its entry may have been lost); only a gateway cancels (a marker the assignment checks).
"""

from __future__ import annotations

from common.keys import PAYLOAD_FIELD
from protos.kvgate.v1 import internal_pb2


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
