"""The protos: lint-clean, fully commented, generated code importable and relative."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.protogen import PROTO_ROOT
from protos.kvgate.v1 import inference_pb2, internal_pb2
from scheduler.streams import StreamEntry, to_pending

PROTO_FILES = sorted(PROTO_ROOT.rglob("*.proto"))
FIELD = re.compile(r"^\s*(optional |repeated )?[\w.]+ \w+ = \d+;")
ENUM_VALUE = re.compile(r"^\s*([A-Z0-9_]+) = \d+;")


def _buf() -> str | None:
    local = Path(sys.executable).parent / "buf"
    return str(local) if local.exists() else shutil.which("buf")


@pytest.mark.skipif(_buf() is None, reason="buf is not installed (pip install buf-bin)")
def test_buf_lint_is_clean():
    result = subprocess.run([_buf(), "lint", str(PROTO_ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, f"buf lint found problems:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("path", PROTO_FILES, ids=lambda p: p.name)
def test_every_field_and_enum_value_has_a_comment(path: Path):
    lines = path.read_text().splitlines()
    uncommented = [
        line.strip()
        for previous, line in zip(lines, lines[1:], strict=False)
        if (FIELD.match(line) or ENUM_VALUE.match(line)) and not previous.strip().startswith("//")
    ]
    assert uncommented == [], f"{path.name}: fields without a comment above them: {uncommented}"


def test_enum_values_carry_their_enum_prefix():
    for module in (inference_pb2, internal_pb2):
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
            wrong = [v.name for v in enum.values if not v.name.startswith(prefix)]
            assert wrong == [], f"{enum.name} values without prefix {prefix}: {wrong}"


def test_generated_modules_import_each_other_relatively():
    generated = sorted(PROTO_ROOT.rglob("*_pb2*.py*"))
    assert generated, "no generated code under protos/: run `make proto`"
    absolute = [p.name for p in generated if "from kvgate.v1 import" in p.read_text()]
    assert absolute == [], f"absolute imports left in {absolute}"


def test_queued_request_round_trips_with_its_sampling_params():
    request = internal_pb2.QueuedRequest(
        request_id="r1",
        reply_to="127.0.0.1:5000",
        prompt_token_ids=[1, 403, 407],
        resume_token_ids=[261],
        params=inference_pb2.SamplingParams(max_tokens=8, temperature=0.0, stop=["."]),
    )
    decoded = internal_pb2.QueuedRequest.FromString(request.SerializeToString())
    assert decoded == request
    assert decoded.params.HasField("temperature"), (
        "temperature=0 must be distinguishable from unset"
    )


def test_an_assignment_envelope_reads_as_the_inbox_message_it_stands_for():
    queued = internal_pb2.QueuedRequest(
        request_id="t/r1", tenant="t", prompt_token_ids=[1, 2, 3], attempt=2,
        params=inference_pb2.SamplingParams(max_tokens=7, temperature=0.5),
    )  # fmt: skip
    placed = {"executor_id": "e1", "assigned_unix_ms": 1234, "scheduler_id": "s1"}
    envelope = internal_pb2.AssignmentEnvelope(
        assignment=internal_pb2.PlacedRequest(request=queued.SerializeToString(), **placed)
    )
    expected = internal_pb2.InboxMessage(
        assignment=internal_pb2.Assignment(request=queued, **placed)
    )
    read = internal_pb2.InboxMessage.FromString(envelope.SerializeToString())
    assert read == expected, f"the envelope read as {read}, expected {expected}"
    assert envelope.SerializeToString() == expected.SerializeToString()


def test_the_scheduler_passes_a_queued_request_on_as_the_gateways_bytes():
    """One parse per process: the scheduler reads what it places by, and hands the executor
    the payload the gateway wrote, byte for byte, even a field it does not know (here 999,
    as from a newer gateway)."""
    queued = internal_pb2.QueuedRequest(request_id="t/r1", tenant="t", prompt_token_ids=[1, 2])
    unknown_field = bytes([0xB8, 0x3E, 0x07])  # field 999, varint 7
    payload = unknown_field + queued.SerializeToString()  # re-serialized, it would come last
    entry = StreamEntry(entry_id="1-0", payload=payload, queued_unix_us=0)
    pending = to_pending(entry, block_size=16, now_s=0.0, queued_s=0.0)
    assert pending is not None and pending.request_id == "t/r1"
    assert pending.payload == payload  # not parsed and written again
    envelope = internal_pb2.AssignmentEnvelope(
        assignment=internal_pb2.PlacedRequest(request=pending.payload, executor_id="e1")
    )
    written = envelope.SerializeToString()
    assert payload in written, "the inbox entry does not hold the gateway's bytes as written"
    read = internal_pb2.InboxMessage.FromString(written)
    assert read.assignment.request.request_id == "t/r1"
