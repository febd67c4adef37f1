"""Read a Hugging Face checkpoint folder's config.json into one typed object."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None or {"rope_type": ..., ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 has biases on q/k/v (Llama with attention_bias too)
    o_proj_bias: bool  # Llama with attention_bias: the output projection has one as well
    mlp_bias: bool  # Llama with mlp_bias: gate, up and down projections
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse `config.json` (and `generation_config.json` for EOS ids) of a checkpoint folder.

    Raises:
        FileNotFoundError: the folder or its config.json is missing.
        ValueError: the architecture is not one kvgate implements.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model folder {model_dir} has no config.json")
    raw = json.loads(config_path.read_text())
    missing = [k for k in _REQUIRED_KEYS if k not in raw]
    if missing:
        raise ValueError(f"{config_path} lacks required keys {missing}")
    architecture = _architecture(raw)
    num_heads = raw["num_attention_heads"]
    rope_theta, rope_scaling = _rope(raw)
    return ModelConfig(
        architecture=architecture,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=architecture == "Qwen2ForCausalLM"
        or _llama_flag(raw, architecture, "attention_bias"),
        o_proj_bias=_llama_flag(raw, architecture, "attention_bias"),
        mlp_bias=_llama_flag(raw, architecture, "mlp_bias"),
        sliding_window=_sliding_window(raw),
        eos_token_ids=_eos_token_ids(model_dir, raw),
    )


def _llama_flag(raw: dict, architecture: str, key: str) -> bool:
    """A Llama-only switch (attention_bias, mlp_bias): Mistral and Qwen2 ignore these keys."""
    return architecture == "LlamaForCausalLM" and bool(raw.get(key, False))


def _architecture(raw: dict) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(
        f"unsupported architecture {names or raw.get('model_type')!r}; "
        f"kvgate supports {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(raw: dict) -> tuple[float, dict | None]:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or None
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    if scaling is None and params:
        scaling = params
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return float(theta), scaling


def _sliding_window(raw: dict) -> int | None:
    if raw.get("use_sliding_window") is False:
        return None
    return raw.get("sliding_window")


def _eos_token_ids(model_dir: Path, raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)
