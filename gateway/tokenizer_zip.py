"""The served model's tokenizer as the zip that routers of vLLM's engine API unpack
(`GetTokenizer`): Hugging Face tokenizer files at the zip's root, streamed in chunks with the
zip's SHA-256 on the last one.

From a checkpoint folder the zip holds its tokenizer and config files as they are; from a
GGUF file, the tokenizer transformers builds from it (the gateway's own, saved with
`save_pretrained`) and a config.json of its special tokens and limits. A model that ships no
chat template gets kvgate's default one (common/templates.py) as `chat_template.jinja`, so
that a router renders conversations as the gateway does.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from common.gguf_metadata import GgufFile
from common.model_files import gguf_file
from common.model_text import ModelText
from common.templates import DEFAULT_CHAT_TEMPLATE

CHUNK_BYTES = 64 * 1024
# The files of a checkpoint folder a router's tokenizer loader reads.
FOLDER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True, slots=True)
class TokenizerZip:
    """The zip's bytes and their SHA-256 (hex)."""

    data: bytes
    sha256: str

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[bytes, str]]:
        """(piece, sha256 on the last piece only, else "")."""
        for start in range(0, len(self.data), chunk_bytes):
            end = start + chunk_bytes
            yield self.data[start:end], self.sha256 if end >= len(self.data) else ""


def model_files(model: str, model_text: ModelText) -> dict[str, bytes]:
    """The tokenizer files of `model` by name (see the module's docstring)."""
    gguf = gguf_file(model)
    files = _gguf_files(gguf, model_text) if gguf else _folder_files(Path(model))
    if model_text.chat_template.is_default and CHAT_TEMPLATE_FILE not in files:
        files[CHAT_TEMPLATE_FILE] = DEFAULT_CHAT_TEMPLATE.encode()
    return files


def _folder_files(folder: Path) -> dict[str, bytes]:
    paths = [folder / name for name in FOLDER_FILES]
    return {path.name: path.read_bytes() for path in paths if path.is_file()}


def _gguf_files(path: Path, model_text: ModelText) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as saved:
        model_text.hf_tokenizer.save_pretrained(saved)
        files = {p.name: p.read_bytes() for p in Path(saved).iterdir() if p.is_file()}
    limits = model_text.limits
    architecture = GgufFile(path).architecture
    config = {
        "model_type": architecture,
        "vocab_size": limits.vocab_size,
        "max_position_embeddings": limits.max_model_len,
        "bos_token_id": limits.bos_token_id,
        "eos_token_id": list(limits.eos_token_ids),
    }
    files["config.json"] = json.dumps(config, indent=2).encode()
    return files


def build_tokenizer_zip(model: str, model_text: ModelText) -> TokenizerZip:
    """The zip of `model`'s tokenizer files (deflated, in name order: the same bytes for the
    same files)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in sorted(model_files(model, model_text).items()):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            archive.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    data = buffer.getvalue()
    return TokenizerZip(data, hashlib.sha256(data).hexdigest())
