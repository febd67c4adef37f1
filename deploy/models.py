"""Which model the local stack serves, and a seeded random tiny model when there is none."""

from __future__ import annotations

import json
import os
from pathlib import Path

from common.model_files import default_gguf_path

ROOT = Path(__file__).resolve().parent.parent
SHARED_MODEL = ROOT.parent / "shared" / "models" / "stories260K"
TINY_MODEL_DIR = ROOT / ".run" / "tiny-random-llama"
# Architecture of the built model: small enough to build and run in seconds on a CPU.
TINY_CONFIG = dict(
    vocab_size=259,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=256,
    eos_token_id=257,
    tie_word_embeddings=True,
)


def choose_model() -> Path:
    """KVGATE_MODEL, else SmolLM2-135M-Instruct (GGUF) when `make setup` has cached it, else
    ../shared/models/stories260K when present, else a built tiny model.

    Returns: the GGUF file or model folder.
    """
    configured = os.environ.get("KVGATE_MODEL")
    if configured:
        return Path(configured)
    if default_gguf_path().is_file():
        return default_gguf_path()
    if (SHARED_MODEL / "config.json").is_file():
        return SHARED_MODEL
    if not (TINY_MODEL_DIR / "config.json").is_file():
        build_tiny_model(TINY_MODEL_DIR)
    return TINY_MODEL_DIR


def build_tiny_model(folder: Path, seed: int = 0) -> None:
    """Writes a Llama checkpoint with seeded random weights and a byte-level tokenizer.

    Args:
        folder: where config.json, model.safetensors and the tokenizer files go.
        seed: torch seed of the weights; the same seed gives the same model.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG))
    model.save_pretrained(folder, safe_serialization=True)
    _write_byte_tokenizer(folder)


def _write_byte_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab = {token: index for index, token in enumerate(sorted(vocab, key=vocab.get))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>", "<unk>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(special, indent=2))
