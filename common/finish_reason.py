"""Why a request finished: one vocabulary for the engine, the gateway and their logs and metrics.

Kept free of generated code so the in-process engine needs none; the protobuf mapping is
common/finish_reason_pb.py.
"""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id, or a stop string (gateway)
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the caller stopped it (a cancelled Chat turn)
    ERROR = "error"  # it failed alone; error_message says why
