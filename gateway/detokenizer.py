"""Incremental detokenization that never emits half a UTF-8 character, on tokenizers'
`DecodeStream`.

A DecodeStream decodes a sliding window of tokens and returns the text a step adds, or None
while the window's text does not grow or ends with U+FFFD (a byte-fallback token left a
character incomplete). It starts on the prompt's last tokens so that leading spaces come
out right. What it does not do is done here:
- it takes the text of its first tokens as said already only when that text ends on a whole
  character, else it returns it with the first completion text: the context ends on one;
- at the end of a completion, `flush` returns the text of the tokens it still holds back;
- a decoder that rewrites text already returned (its output is not monotonic in the tokens)
  makes it raise: that step is answered by how far the text grew, and it starts again after.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens kept as context for the first completion tokens.
PROMPT_CONTEXT_TOKENS = 6
# How DecodeStream.step's error (a plain Exception) starts when the decoder rewrote its text.
INVALID_PREFIX = "Invalid prefix"
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a completion's tokens, as they come, into text deltas."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        """Start after the prompt.

        Args:
            tokenizer: the model's tokenizer.
            prompt_token_ids: the prompt; its last tokens are context, never emitted.
            skip_special_tokens: leave special tokens (BOS, EOS, control tokens) out of the text.
        """
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._token_ids = self._context(prompt_token_ids)  # then the completion's tokens
        self._stream = self._new_stream(self._token_ids)
        self._num_held = 0  # trailing tokens whose text the stream holds back

    def add(self, token_ids: list[int]) -> str:
        """Append tokens and return the text they complete (may be empty)."""
        if not token_ids:
            return ""
        text = self._step(token_ids)
        self._token_ids.extend(token_ids)
        if text is None:
            self._num_held += len(token_ids)
            return ""
        self._num_held = 0
        return text

    def flush(self) -> str:
        """Return whatever text is still held back (the completion has ended): an incomplete
        character comes out as U+FFFD."""
        held = self._token_ids[len(self._token_ids) - self._num_held :]
        self._num_held = 0
        return self._decode(held) if held else ""

    def _step(self, token_ids: list[int]) -> str | None:
        try:
            return self._stream.step(self.tokenizer, token_ids)
        except Exception as error:  # the binding raises no narrower type
            if not str(error).startswith(INVALID_PREFIX):
                raise
        held_from = len(self._token_ids) - self._num_held
        context = self._token_ids[max(0, held_from - PROMPT_CONTEXT_TOKENS) : held_from]
        window = context + self._token_ids[held_from:] + token_ids
        self._stream = self._new_stream(window)
        before, after = self._decode(context), self._decode(window)
        return after[len(before) :] if len(after) > len(before) else None

    def _context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last tokens, less those of a character the prompt leaves incomplete."""
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        while context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context.pop()
        return context

    def _new_stream(self, token_ids: list[int]) -> DecodeStream:
        return DecodeStream(ids=token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
