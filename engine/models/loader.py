"""Load a checkpoint straight into kvgate's modules: a Hugging Face folder (safetensors, single
file or sharded) or a GGUF file (engine/models/gguf.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from common.model_files import gguf_file
from engine.models.config import ModelConfig, load_model_config
from engine.models.gguf import read_gguf_checkpoint
from engine.models.llama import LlamaForCausalLM
from engine.models.quantize import apply_quantized, quantize_state
from engine.models.shard import shard_config, shard_quantized, shard_state
from kernels.quant import QuantizedWeight, concat_rows, with_int8_activations

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
    tied = config.tie_word_embeddings or "lm_head.weight" not in state
    if tied and "embed_tokens.weight" in state:  # absent: read from a quantized output layer
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return state


def load_model(
    model: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str = "none",
    rank: int = 0,
    num_ranks: int = 1,
    int8_activations: bool = False,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model that `model` names (a checkpoint folder or a GGUF file) on `device`
    in `dtype`, its linear layers weight-only quantized when `quantization` is "int8" or
    "int4" (from the checkpoint's own weights before they are cast to `dtype`, or GGUF blocks
    already in the format kept as they are). With `num_ranks` > 1 the module holds tensor
    parallel rank `rank`'s share (engine/models/shard.py), and its
    `config` is that share's; the config returned is the whole model's. With
    `int8_activations` its int8 layers multiply x rounded to int8 blocks (kernels.quant's
    with_int8_activations).

    Raises:
        FileNotFoundError: config.json or the weights are missing.
        ValueError: unsupported architecture or tensor type, or the weights do not fit the
            config.
    """
    gguf = gguf_file(model)
    kept: dict[str, QuantizedWeight] = {}
    if gguf is not None:
        config, tensors, kept_hf = read_gguf_checkpoint(gguf, quantization)
        kept = to_kvgate_quantized(config, kept_hf, tensors)
    else:
        config = load_model_config(model)
        tensors = read_checkpoint(Path(model))
    state = to_kvgate_state_dict(config, tensors)
    del tensors
    quantized = quantize_state(state, config.num_hidden_layers, quantization, kept)
    built_config = config
    if num_ranks > 1:
        state = shard_state(state, config, rank, num_ranks)
        quantized = shard_quantized(quantized, config, rank, num_ranks)
        built_config = shard_config(config, num_ranks)
    if int8_activations:
        quantized = {name: with_int8_activations(w) for name, w in quantized.items()}
    # Copied when quantized: a tensor still mapped from the checkpoint file would keep the
    # whole file's pages resident (safetensors maps it), float weights included.
    copy = bool(quantized)
    state = {name: t.to(device=device, dtype=dtype, copy=copy) for name, t in state.items()}
    with torch.device("meta"):
        built = LlamaForCausalLM(built_config)
    taken = {f"{name}.weight" for name in quantized}
    if config.tie_word_embeddings and "lm_head" in quantized:
        taken.add("embed_tokens.weight")  # read from the quantized output layer
    _load_dense(built, state, taken, model)
    if config.tie_word_embeddings and not quantized:
        built.lm_head.weight = built.embed_tokens.weight
    apply_quantized(built, quantized, device, config.tie_word_embeddings)
    return built.eval().requires_grad_(False), config


def _load_dense(built: LlamaForCausalLM, state: dict, quantized: set[str], model: object) -> None:
    """Load every dense tensor; the quantized layers' weights are the only ones left out."""
    try:
        result = built.load_state_dict(state, strict=not quantized, assign=True)
    except RuntimeError as e:
        raise ValueError(f"weights in {model} do not match its config: {e}") from e
    missing, unexpected = sorted(set(result.missing_keys) - quantized), result.unexpected_keys
    if missing or unexpected:
        raise ValueError(f"weights in {model} do not match its config: missing "
                         f"{missing}, unexpected {sorted(unexpected)}")  # fmt: skip


def to_kvgate_quantized(
    config: ModelConfig, kept: dict[str, QuantizedWeight], tensors: dict[str, torch.Tensor]
) -> dict[str, QuantizedWeight]:
    """Rename quantized Hugging Face modules to ours and fuse q/k/v and gate/up, as
    `to_kvgate_state_dict` does dense ones. A fused layer whose parts are not all kept in one
    format gets its kept parts dequantized into `tensors` instead (fused and quantized there)."""
    renamed = {}
    for name, weight in kept.items():
        match = _LAYER.match(f"{name}.weight")
        renamed[name if match is None else f"layers.{match[1]}.{match[2]}"] = weight
    for layer in range(config.num_hidden_layers):
        for fused, parts in _FUSED.items():
            names = [f"layers.{layer}.{p}" for p in parts]
            weights = [renamed.pop(n) for n in names if n in renamed]
            if len(weights) == len(parts) and _one_format(weights):
                renamed[f"layers.{layer}.{fused}"] = concat_rows(weights)
                continue
            for part in parts:  # some parts dense already, or formats that differ
                if (weight := kept.get(f"model.layers.{layer}.{part}")) is not None:
                    tensors[f"model.layers.{layer}.{part}.weight"] = weight.dequantize()
    return renamed


def _one_format(weights: list[QuantizedWeight]) -> bool:
    return len({(w.bits, w.group_size) for w in weights}) == 1
