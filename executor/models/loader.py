"""Load safetensors weights (single file or sharded) straight into kvgate's modules."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from executor.models.config import ModelConfig, load_model_config
from executor.models.llama import LlamaForCausalLM
from executor.models.quantize import apply_quantized, quantize_state

_FUSED = {  # our fused parameter -> checkpoint parameters concatenated along dim 0
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise FileNotFoundError(f"model folder {model_dir} is missing shards {missing}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"model folder {model_dir} has no model.safetensors or model.safetensors.index.json"
    )


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                tensors[name] = f.get_tensor(name)
    return tensors


def to_kvgate_state_dict(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict:
    """Rename checkpoint tensors to our module names and fuse q/k/v and gate/up."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _LAYER.match(name)
        if match is None:
            state[name.removeprefix("model.")] = tensor
        else:
            layer, module, kind = match.groups()
            state[f"layers.{layer}.{module}.{kind}"] = tensor
    for layer in range(config.num_hidden_layers):
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"layers.{layer}.{p}.{kind}" for p in parts]
                if all(n in state for n in names):
                    state[f"layers.{layer}.{fused}.{kind}"] = torch.cat(
                        [state.pop(n) for n in names]
                    )
    if config.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return state


def load_model(
    model_dir: str | Path, device: torch.device, dtype: torch.dtype, quantization: str = "none"
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model of a Hugging Face checkpoint folder on `device` in `dtype`, its linear
    layers weight-only quantized when `quantization` is "int8" or "int4" (from the checkpoint's
    own weights, before they are cast to `dtype`).

    Raises:
        FileNotFoundError: config.json or the weights are missing.
        ValueError: unsupported architecture, or the weights do not fit the config.
    """
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    state = to_kvgate_state_dict(config, read_checkpoint(model_dir))
    tied_table = state.get("embed_tokens.weight")
    quantized = quantize_state(state, config.num_hidden_layers, quantization)
    # Copied when quantized: a tensor still mapped from the checkpoint file would keep the
    # whole file's pages resident (safetensors maps it), float weights included.
    copy = bool(quantized)
    state = {name: t.to(device=device, dtype=dtype, copy=copy) for name, t in state.items()}
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    taken = {f"{name}.weight" for name in quantized}
    if tied_table is not None and "embed_tokens.weight" not in state:
        taken.add("embed_tokens.weight")
    _load_dense(model, state, taken, model_dir)
    if config.tie_word_embeddings and not quantized:
        model.lm_head.weight = model.embed_tokens.weight
    apply_quantized(model, quantized, device, config.tie_word_embeddings)
    return model.eval().requires_grad_(False), config


def _load_dense(model: LlamaForCausalLM, state: dict, quantized: set[str], model_dir: Path) -> None:
    """Load every dense tensor; the quantized layers' weights are the only ones left out."""
    try:
        result = model.load_state_dict(state, strict=not quantized, assign=True)
    except RuntimeError as e:
        raise ValueError(f"weights in {model_dir} do not match its config.json: {e}") from e
    missing, unexpected = sorted(set(result.missing_keys) - quantized), result.unexpected_keys
    if missing or unexpected:
        raise ValueError(f"weights in {model_dir} do not match its config.json: missing "
                         f"{missing}, unexpected {sorted(unexpected)}")  # fmt: skip
