"""Tool calls read back from a chat answer's text as it streams, for OpenAI's `tool_calls`.

Two readers, one interface (`feed` each piece of text, `finish` at the end, `calls` read and
whether they are `complete`, none cut short by a stop string or max_tokens): CallListReader
reads a forced call's JSON list, `[{"name": "f", "arguments": {...}}, ...]`, which its grammar
writes exactly so (the arguments stream out as they come); HermesReader reads the calls a
model writes unforced ("auto") between <tool_call> and </tool_call>, and passes the rest on
as content (a call is sent whole once its closing tag is there).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from common.templates import HERMES_CALL_CLOSE, HERMES_CALL_OPEN

CALL_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]+)", "arguments": ')


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class ReadCall:
    """A call read so far."""

    call_id: str
    name: str
    arguments: str = ""  # the JSON text read so far (all of it once the call is complete)


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a streamed call: its start (id and name given) or more of its arguments."""

    index: int  # the call's position in the answer's tool_calls
    call_id: str  # set on the call's first delta only
    name: str  # set on the call's first delta only
    arguments: str

    def as_json(self) -> dict:
        """As OpenAI streams it (chat.completion.chunk's delta.tool_calls[])."""
        if not self.call_id:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.call_id, "type": "function", "function": function}


@dataclass(slots=True)
class Reading:
    """What one piece of text turned into: content and call deltas."""

    content: str = ""
    deltas: list[ToolCallDelta] = field(default_factory=list)


def merged_deltas(deltas: list[ToolCallDelta]) -> list[dict]:
    """The deltas of one chunk, a call's consecutive pieces joined into one."""
    items: list[dict] = []
    for delta in deltas:
        if items and items[-1]["index"] == delta.index and not delta.call_id:
            items[-1]["function"]["arguments"] += delta.arguments
        else:
            items.append(delta.as_json())
    return items


class CallListReader:
    """Reads a forced call's list; its grammar guarantees the layout, so the reader only
    finds each call's head and the end of its arguments (JSON depth, strings skipped)."""

    def __init__(self) -> None:
        self.calls: list[ReadCall] = []
        self.complete = False  # the list's closing "]" was read
        self._text = ""
        self._pos = 0
        self._in_arguments = False
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> Reading:
        self._text += text
        reading = Reading()
        while self._pos < len(self._text):
            if self._in_arguments:
                if fragment := self._scan_arguments():
                    self.calls[-1].arguments += fragment
                    reading.deltas.append(ToolCallDelta(len(self.calls) - 1, "", "", fragment))
                if self._in_arguments:
                    break
            elif self._text[self._pos] == "{":
                if not self._read_head(reading):
                    break  # the head is not all here yet
            else:
                self.complete = self._text[self._pos] == "]"
                self._pos += 1  # "[", ", ", a call's closing "}", "]"
        return reading

    def finish(self) -> Reading:
        return Reading()

    def _read_head(self, reading: Reading) -> bool:
        head = CALL_HEAD.match(self._text, self._pos)
        if head is None:
            return False
        call = ReadCall(new_call_id(), head.group(1))
        self.calls.append(call)
        reading.deltas.append(ToolCallDelta(len(self.calls) - 1, call.call_id, call.name, ""))
        self._pos = head.end()
        self._in_arguments = True
        return True

    def _scan_arguments(self) -> str:
        """The arguments' text up to their end or the text's; leaves them when they end."""
        start = self._pos
        while self._pos < len(self._text):
            char = self._text[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._in_arguments = False
                    break
        return self._text[start : self._pos]


class HermesReader:
    """Reads <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks naming one of
    `tool_names`; text outside them, and a block that is no such call, is content."""

    def __init__(self, tool_names: set[str]) -> None:
        self.tool_names = tool_names
        self.calls: list[ReadCall] = []
        self._pending = ""  # text held back: a block not closed yet, or a tag's beginning
        self._in_call = False

    @property
    def complete(self) -> bool:
        """No call is open."""
        return not self._in_call

    def feed(self, text: str) -> Reading:
        self._pending += text
        reading = Reading()
        content = []
        while True:
            if not self._in_call:
                at = self._pending.find(HERMES_CALL_OPEN)
                if at < 0:
                    cut = len(self._pending) - _tag_start_len(self._pending, HERMES_CALL_OPEN)
                    content.append(self._pending[:cut])
                    self._pending = self._pending[cut:]
                    break
                content.append(self._pending[:at])
                self._pending = self._pending[at:]
                self._in_call = True
            end = self._pending.find(HERMES_CALL_CLOSE)
            if end < 0:
                break
            end += len(HERMES_CALL_CLOSE)
            block, self._pending = self._pending[:end], self._pending[end:]
            self._in_call = False
            if not self._read_call(block, reading):
                content.append(block)
        reading.content = "".join(content)
        return reading

    def finish(self) -> Reading:
        """The text held back, as content (a block never closed is no call)."""
        reading = Reading(self._pending)
        self._pending = ""
        return reading

    def _read_call(self, block: str, reading: Reading) -> bool:
        inner = block[len(HERMES_CALL_OPEN) : -len(HERMES_CALL_CLOSE)]
        try:
            call = json.loads(inner)
        except (ValueError, RecursionError):
            return False
        if not isinstance(call, dict):
            return False
        name = call.get("name")
        if not isinstance(name, str) or name not in self.tool_names:
            return False
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return False
        if not isinstance(arguments, dict):
            return False
        read = ReadCall(new_call_id(), call["name"], json.dumps(arguments, ensure_ascii=False))
        self.calls.append(read)
        index = len(self.calls) - 1
        reading.deltas.append(ToolCallDelta(index, read.call_id, read.name, read.arguments))
        return True


def _tag_start_len(text: str, tag: str) -> int:
    """How many of text's last characters are the beginning of `tag` (held back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
