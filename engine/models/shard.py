"""One tensor-parallel rank's share of a Llama-family model (--tensor-parallel-size).

Attention heads and MLP columns are split across the ranks, Megatron-style: the fused q/k/v
and gate/up projections are column-parallel (each rank keeps its heads' rows and its share of
the intermediate rows), the output and down projections are row-parallel (each rank keeps the
matching input columns, so the ranks' partial outputs sum to the full one: one all-reduce
after attention, one after the MLP). The row-parallel biases are added once, by rank 0 (the
others hold zeros). Token embeddings, norms and the output layer stay whole on every rank.

Weight-only quantized layers are quantized whole first and then split the same way, so every
rank serves exactly the N = 1 weights: rows with their scales, columns at group boundaries (a
per-channel int8 row keeps its one scale).
"""

from __future__ import annotations

import dataclasses

import torch

from engine.models.config import ModelConfig
from kernels.quant import QuantizedWeight, concat_rows

TP_FLAG = "--tensor-parallel-size"


def check_divides(config: ModelConfig, num_ranks: int) -> None:
    """Raise ValueError naming the flag unless `num_ranks` splits the heads and MLP columns."""
    counts = {
        "query heads": config.num_attention_heads,
        "key/value heads": config.num_key_value_heads,
        "MLP columns (intermediate_size)": config.intermediate_size,
    }
    bad = [f"{count} {name}" for name, count in counts.items() if count % num_ranks]
    if bad:
        listed = bad[-1] if len(bad) == 1 else f"{', '.join(bad[:-1])} or {bad[-1]}"
        raise ValueError(
            f"{TP_FLAG} {num_ranks} does not divide the model's {listed} (each rank holds an "
            "equal share of whole heads and MLP columns)"
        )


def shard_config(config: ModelConfig, num_ranks: int) -> ModelConfig:
    """The config of one rank's share: its heads and MLP columns (head_dim unchanged)."""
    check_divides(config, num_ranks)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // num_ranks,
        num_key_value_heads=config.num_key_value_heads // num_ranks,
        intermediate_size=config.intermediate_size // num_ranks,
    )


def _layout(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], tuple[str, str]]:
    """Column-parallel modules with the row sizes of their fused parts, and the row-parallel
    modules (names within a layer)."""
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    column_parallel = {
        "self_attn.qkv_proj": (q_size, kv_size, kv_size),
        "mlp.gate_up_proj": (inter, inter),
    }
    return column_parallel, ("self_attn.o_proj", "mlp.down_proj")


def shard_state(
    state: dict[str, torch.Tensor], config: ModelConfig, rank: int, num_ranks: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of a kvgate state dict (fused q/k/v and gate/up, as
    loader.to_kvgate_state_dict makes it; a quantized layer's weight already taken out); the
    tensors outside the decoder layers are kept."""
    check_divides(config, num_ranks)
    column_parallel, row_parallel = _layout(config)
    shard = dict(state)
    for layer in range(config.num_hidden_layers):
        for module, sizes in column_parallel.items():
            for kind in ("weight", "bias"):
                name = f"layers.{layer}.{module}.{kind}"
                if name in shard:
                    parts = shard[name].split(sizes)
                    shard[name] = torch.cat([p.chunk(num_ranks)[rank] for p in parts])
        for module in row_parallel:
            name = f"layers.{layer}.{module}"
            if f"{name}.weight" in shard:
                weight = shard[f"{name}.weight"].chunk(num_ranks, dim=1)[rank]
                shard[f"{name}.weight"] = weight.contiguous()
            if f"{name}.bias" in shard and rank != 0:
                shard[f"{name}.bias"] = torch.zeros_like(shard[f"{name}.bias"])
    return shard


def shard_quantized(
    quantized: dict[str, QuantizedWeight], config: ModelConfig, rank: int, num_ranks: int
) -> dict[str, QuantizedWeight]:
    """Rank `rank`'s share of the quantized decoder layers (module name -> weight, as
    quantize.quantize_state returns them); the output layer is kept whole.

    Raises:
        ValueError: a row-parallel layer's share of input columns splits its quantized groups.
    """
    column_parallel, row_parallel = _layout(config)
    shard = dict(quantized)
    for layer in range(config.num_hidden_layers):
        for module, sizes in column_parallel.items():
            if (weight := shard.get(f"layers.{layer}.{module}")) is not None:
                starts = [sum(sizes[:i]) for i in range(len(sizes))]
                shard[f"layers.{layer}.{module}"] = concat_rows([
                    _rows(weight, start + rank * size // num_ranks, size // num_ranks)
                    for start, size in zip(starts, sizes, strict=True)
                ])  # fmt: skip
        for module in row_parallel:
            if (weight := shard.get(f"layers.{layer}.{module}")) is not None:
                name = f"layers.{layer}.{module}"
                shard[name] = shard_columns(name, weight, rank, num_ranks)
    return shard


def _rows(weight: QuantizedWeight, start: int, count: int) -> QuantizedWeight:
    rows = slice(start, start + count)
    zeros = None if weight.zeros is None else weight.zeros[rows].contiguous()
    return QuantizedWeight(weight.bits, weight.qweight[rows].contiguous(),
                           weight.scales[rows].contiguous(), zeros, weight.group_size)  # fmt: skip


def shard_columns(name: str, weight: QuantizedWeight, rank: int, num_ranks: int) -> QuantizedWeight:
    """Rank `rank`'s share of the input columns of a quantized row-parallel layer `name`.

    Raises:
        ValueError: the share would cut a quantization group (naming the flag and sizes).
    """
    width = weight.in_features // num_ranks
    group = weight.group_size
    if group == weight.in_features and weight.bits == 8:  # one scale per row: every share keeps it
        qweight = weight.qweight[:, rank * width : (rank + 1) * width].contiguous()
        return QuantizedWeight(8, qweight, weight.scales, None, width)
    if width % group:
        raise ValueError(
            f"{TP_FLAG} {num_ranks} splits {name}'s {weight.in_features} input columns into "
            f"shares of {width}, which cut its quantized groups of {group} (int{weight.bits}); "
            f"use a size whose shares are whole groups, or --quantization none"
        )
    packed = width // (2 if weight.bits == 4 else 1)
    groups = slice(rank * width // group, (rank + 1) * width // group)
    zeros = None if weight.zeros is None else weight.zeros[:, groups].contiguous()
    qweight = weight.qweight[:, rank * packed : (rank + 1) * packed].contiguous()
    return QuantizedWeight(
        weight.bits, qweight, weight.scales[:, groups].contiguous(), zeros, group
    )
