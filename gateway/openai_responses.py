"""The OpenAI objects kvgate answers with: chat.completion(.chunk) and text_completion,
their usage and logprobs, and the server-sent events that carry a stream."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from common.finish_reason import FinishReason
from common.token_bytes import TokenBytes
from gateway.generation import Chunk, Usage
from gateway.openai_echo import vllm_prompt_logprobs
from gateway.openai_tools import ToolChoice, ToolPlan
from gateway.tool_call_output import (
    CallListReader,
    HermesReader,
    ReadCall,
    Reading,
    merged_deltas,
)
from protos.kvgate.v1 import inference_pb2

DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(payload: dict) -> bytes:
    """One server-sent event holding `payload` as JSON."""
    return b"data: " + dumps(payload) + b"\n\n"


def dumps(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def usage_json(usages: list[Usage]) -> dict:
    """OpenAI's usage of one or more prompts' generations; cached_tokens: the prefix cache's."""
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in usages)},
    }


def finish_reason_json(reason: FinishReason | None, called: bool = False) -> str | None:
    """stop, length, or vLLM's abort and error; tool_calls for an answer that stopped
    after calling tools (`called`: its calls are complete)."""
    if reason is None:
        return None
    return "tool_calls" if called and reason == FinishReason.STOP else str(reason)


def tool_calls_json(calls: list[ReadCall]) -> list[dict]:
    """A chat message's tool_calls."""
    return [
        {
            "id": c.call_id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


def call_reader(plan: ToolPlan | None) -> CallListReader | HermesReader | None:
    """The reader of one choice's calls (None: the answer is text only)."""
    if plan is None or plan.choice is ToolChoice.NONE:
        return None
    if plan.forced:
        return CallListReader()
    return HermesReader({t.name for t in plan.callable})


class TokenText:
    """Each token's text and bytes, for logprobs: what the token adds to the text, its
    leading space included (common/token_bytes.py); a token holding part of a UTF-8
    character reads as U+FFFD, its `bytes` exact."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.token_bytes = TokenBytes(tokenizer)

    def of(self, token_id: int) -> str:
        return self.token_bytes.text(token_id)

    def bytes_of(self, token_id: int) -> list[int]:
        return list(self.token_bytes.of(token_id))


def chat_logprobs(logprobs: list[inference_pb2.TokenLogprob], text: TokenText) -> dict:
    """A chat choice's logprobs: {content: [{token, logprob, bytes, top_logprobs}]}."""

    def entry(token_id: int, logprob: float) -> dict:
        return {"token": text.of(token_id), "logprob": logprob, "bytes": text.bytes_of(token_id)}

    content = []
    for lp in logprobs:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(top.token_id, top.logprob) for top in lp.top]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    logprobs: list[inference_pb2.TokenLogprob], text: TokenText, text_offset: int
) -> dict:
    """A text choice's logprobs: parallel lists of tokens, logprobs, alternatives, offsets
    (an echoed prompt's first token has a null logprob and alternatives)."""
    tokens, offsets = [], []
    for lp in logprobs:
        offsets.append(text_offset)
        tokens.append(text.of(lp.token_id))
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [
            None if lp.top is None else {text.of(t.token_id): t.logprob for t in lp.top}
            for lp in logprobs
        ],
        "text_offset": offsets,
    }


@dataclass(slots=True)
class Choice:
    """What one prompt's generation has produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[inference_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    prompt_logprobs: list[inference_pb2.TokenLogprob] | None = None


class ResponseShape:
    """The objects of one endpoint's answer: `chat` (chat.completion) or not (text_completion)."""

    def __init__(
        self,
        chat: bool,
        model: str,
        request_id: str,
        with_logprobs: bool,
        text: TokenText,
        tool_plan: ToolPlan | None = None,
        prompt_logprobs: bool = False,
    ):
        self.chat = chat
        self.model = model
        self.request_id = request_id
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.with_logprobs = with_logprobs
        self.text = text
        self.text_offsets: dict[int, int] = {}  # completions: characters streamed by choice
        self.tool_plan = tool_plan  # chat: what tool calls to read from the text
        self.prompt_logprobs = prompt_logprobs  # report vLLM's prompt_logprobs
        # chat: each streamed choice's call reader (None: text only)
        self.readers: dict[int, CallListReader | HermesReader | None] = {}

    def _object(self, kind: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(self, index: int, logprobs: list[inference_pb2.TokenLogprob]) -> dict | None:
        if not self.with_logprobs:
            return None
        if self.chat:
            return chat_logprobs(logprobs, self.text)
        offset = self.text_offsets.get(index, 0)
        return completion_logprobs(logprobs, self.text, offset)

    def whole(self, choices: list[Choice]) -> dict:
        """The answer of a request that did not stream."""
        items = []
        for choice in choices:
            text = "".join(choice.text)
            item = {
                "index": choice.index,
                "logprobs": self._logprobs(choice.index, choice.logprobs),
            }
            called = False
            if self.chat:
                item["message"], called = self._message(text)
            else:
                item["text"] = text
            item["finish_reason"] = finish_reason_json(choice.finish_reason, called)
            self._add_prompt_logprobs(item, choice.prompt_logprobs)
            items.append(item)
        kind = "chat.completion" if self.chat else "text_completion"
        answer = self._object(kind, items)
        answer["usage"] = usage_json([c.usage for c in choices if c.usage is not None])
        if self.chat and self.prompt_logprobs and items:  # vLLM's: one list, the answer's
            answer["prompt_logprobs"] = items[0].pop("prompt_logprobs", None)
        return answer

    def _add_prompt_logprobs(self, item: dict, entries: list | None) -> None:
        if self.prompt_logprobs and entries is not None:
            item["prompt_logprobs"] = vllm_prompt_logprobs(entries, self.text)

    def _message(self, text: str) -> tuple[dict, bool]:
        """A whole chat answer's message: its content, and its tool_calls when it made any;
        and whether it called tools (all its calls complete)."""
        reader = call_reader(self.tool_plan)
        if reader is None:
            return {"role": "assistant", "content": text}, False
        content = reader.feed(text).content + reader.finish().content
        if not reader.calls:
            return {"role": "assistant", "content": content}, False
        calls = tool_calls_json(reader.calls)
        message = {"role": "assistant", "content": content or None, "tool_calls": calls}
        return message, reader.complete

    def first_chunks(self, num_choices: int) -> list[dict]:
        """Chat streams open each choice with the assistant's role (and no content when
        the answer is a forced call)."""
        if not self.chat:
            return []
        forced = self.tool_plan is not None and self.tool_plan.forced
        delta = {"role": "assistant", "content": None if forced else ""}
        return [self._chunk(index, delta, None, None) for index in range(num_choices)]

    def _chat_delta(self, index: int, chunk: Chunk) -> tuple[dict, bool]:
        """A chat chunk's delta, and whether the choice has called tools so far."""
        if index not in self.readers:
            self.readers[index] = call_reader(self.tool_plan)
        reader = self.readers[index]
        if reader is None:
            return {"content": chunk.text}, False
        reading = reader.feed(chunk.text)
        if chunk.finish_reason is not None:
            rest = reader.finish()
            reading = Reading(reading.content + rest.content, reading.deltas + rest.deltas)
        delta = {"content": reading.content} if reading.content else {}
        if reading.deltas:
            delta["tool_calls"] = merged_deltas(reading.deltas)
        return delta, bool(reader.calls) and reader.complete

    def chunk(self, index: int, chunk: Chunk) -> dict:
        """A stream's chunk of one choice."""
        logprobs = self._logprobs(index, chunk.logprobs)
        if self.chat:
            delta, called = self._chat_delta(index, chunk)
            reason = finish_reason_json(chunk.finish_reason, called)
            answer = self._chunk(index, delta, logprobs, reason)
        else:
            reason = finish_reason_json(chunk.finish_reason)
            self.text_offsets[index] = self.text_offsets.get(index, 0) + len(chunk.text)
            item = {"index": index, "text": chunk.text, "logprobs": logprobs}
            item["finish_reason"] = reason
            answer = self._object("text_completion", [item])
        self._add_prompt_logprobs(answer["choices"][0], chunk.prompt_logprobs)
        return answer

    def _chunk(self, index: int, delta: dict, logprobs: dict | None, reason: str | None) -> dict:
        item = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return self._object("chat.completion.chunk", [item])

    def usage_chunk(self, usages: list[Usage]) -> dict:
        """stream_options.include_usage: the last chunk, with no choices."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        answer = self._object(kind, [])
        answer["usage"] = usage_json(usages)
        return answer
