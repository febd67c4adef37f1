"""FinishReason to and from the `kvgate.v1.FinishReason` enum: the one mapping of both sides."""

from __future__ import annotations

from common.finish_reason import FinishReason
from protos.kvgate.v1 import inference_pb2

_TO_PB = {
    FinishReason.STOP: inference_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: inference_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: inference_pb2.FINISH_REASON_ERROR,
}
_FROM_PB = {value: reason for reason, value in _TO_PB.items()}


def finish_reason_to_pb(reason: FinishReason) -> inference_pb2.FinishReason:
    """Returns: the message's value for `reason`."""
    return _TO_PB[reason]


def finish_reason_from_pb(value: inference_pb2.FinishReason) -> FinishReason | None:
    """Returns: the reason a message's value stands for; None for FINISH_REASON_UNSPECIFIED
    (or a value this version does not know)."""
    return _FROM_PB.get(value)
