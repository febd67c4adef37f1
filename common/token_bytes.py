"""Each token's own bytes, read from a `tokenizers` vocabulary: what a token adds to the text,
its leading space included, even when it holds only part of a UTF-8 character (which no
decoding of the token alone can show). OpenAI's logprobs report them as a token's `bytes`.

Two vocabularies are read exactly: byte-level BPE (GPT-2's, SmolLM2's: every byte is written
as one printable character) and SentencePiece with byte fallback (Llama's, stories260K's:
`▁` is a space, `<0x0A>` one byte). Added tokens are their text. Any other decoder falls back
to decoding the token alone.
"""

from __future__ import annotations

import functools
import json
import re

from tokenizers import Tokenizer

SPACE_MARK = "\u2581"  # SentencePiece's `▁`
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: each character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in chars.items()}


def decoder_kind(tokenizer: Tokenizer) -> str:
    """ "byte_level", "sentencepiece" or "other", from the tokenizer's decoder."""
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        return "sentencepiece"
    return "other"


class TokenBytes:
    """The bytes of each token id of one tokenizer (cached)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.kind = decoder_kind(tokenizer)
        self.added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one per served model, kept for its life)
    def of(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self.kind == "byte_level":
            alphabet = byte_level_alphabet()
            if all(char in alphabet for char in piece):
                return bytes(alphabet[char] for char in piece)
        elif self.kind == "sentencepiece":
            if match := BYTE_PIECE.fullmatch(piece):
                return bytes([int(match.group(1), 16)])
            return piece.replace(SPACE_MARK, " ").encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def text(self, token_id: int) -> str:
        """The token's text: its bytes as UTF-8, a partial character as U+FFFD."""
        return self.of(token_id).decode("utf-8", errors="replace")
