"""The metadata of a GGUF file, read with the `gguf` package (no torch: the gateway uses it too).

Keys follow llama.cpp's names: `general.architecture`, `{arch}.block_count`,
`tokenizer.ggml.tokens`, `tokenizer.chat_template`, ... (see the GGUF specification).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader

# Token ids that end a generation: llama.cpp stops at any of them.
END_OF_TURN_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


class GgufFile:
    """One GGUF file: its metadata values by key, and its tensors (memory-mapped)."""

    def __init__(self, path: str | Path) -> None:
        """Open and parse the file's header.

        Raises:
            ValueError: the file is not a GGUF file (the message names it).
        """
        self.path = Path(path)
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, OSError) as error:
            raise ValueError(f"--model {self.path}: not a readable GGUF file ({error})") from error
        self.architecture: str = self.value("general.architecture", "")

    def value(self, key: str, default: Any = None) -> Any:
        """The value stored under `key` (a number, string, bool or list), else `default`."""
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def arch_value(self, name: str, default: Any = None) -> Any:
        """The value of `{architecture}.{name}`, e.g. arch_value("block_count")."""
        return self.value(f"{self.architecture}.{name}", default)

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The EOS, end-of-turn and end-of-message ids the file names, without repeats."""
        ids = (self.value(key) for key in END_OF_TURN_KEYS)
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    def tensor_names(self) -> list[str]:
        return [tensor.name for tensor in self.reader.tensors]
