"""Incremental detokenization that never emits half a UTF-8 character.

Tokens are decoded in a sliding window (as vLLM and TGI do): the text of
`tokens[prefix_offset:]` minus the text of `tokens[prefix_offset:read_offset]`
is the new text. While a byte-fallback token leaves a character incomplete the
window's text ends with U+FFFD, so nothing is emitted until the bytes complete
it. The window starts inside the prompt so that leading spaces come out right.
"""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as context for the first completion tokens.
PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a completion's tokens, as they come, into text deltas."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]) -> None:
        """Start after the prompt.

        Args:
            tokenizer: the model's tokenizer.
            prompt_token_ids: the prompt; its last tokens are context, never emitted.
        """
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens and return the text they complete (may be empty)."""
        self.token_ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever text is still held back (the completion has ended)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.token_ids))
        if len(full_text) <= len(prefix_text) and not final:
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=True)
