"""One tensor-parallel rank's share of a Llama-family model (--tensor-parallel-size).

Attention heads and MLP columns are split across the ranks, Megatron-style: the fused q/k/v
and gate/up projections are column-parallel (each rank keeps its heads' rows and its share of
the intermediate rows), the output and down projections are row-parallel (each rank keeps the
matching input columns, so the ranks' partial outputs sum to the full one: one all-reduce
after attention, one after the MLP). The row-parallel biases are added once, by rank 0 (the
others hold zeros). Token embeddings, norms and the output layer stay whole on every rank.
"""

from __future__ import annotations

import dataclasses

import torch

from executor.models.config import ModelConfig

TP_FLAG = "--tensor-parallel-size"


def check_divides(config: ModelConfig, num_ranks: int) -> None:
    """Raise ValueError naming the flag unless `num_ranks` splits the heads and MLP columns."""
    counts = {
        "query heads": config.num_attention_heads,
        "key/value heads": config.num_key_value_heads,
        "MLP columns (intermediate_size)": config.intermediate_size,
    }
    bad = [f"{name} ({count})" for name, count in counts.items() if count % num_ranks]
    if bad:
        have = ", ".join(f"{count} {name}" for name, count in counts.items())
        raise ValueError(
            f"{TP_FLAG} {num_ranks} does not divide the model's {' and '.join(bad)}: each rank "
            f"holds an equal share of whole heads and columns (the model has {have})"
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


def shard_state(
    state: dict[str, torch.Tensor], config: ModelConfig, rank: int, num_ranks: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of a kvgate state dict (fused q/k/v and gate/up, as
    loader.to_kvgate_state_dict makes it); the tensors outside the decoder layers are kept."""
    check_divides(config, num_ranks)
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    column_parallel = {
        "self_attn.qkv_proj": (q_size, kv_size, kv_size),
        "mlp.gate_up_proj": (inter, inter),
    }
    row_parallel = ("self_attn.o_proj", "mlp.down_proj")
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
            shard[f"{name}.weight"] = shard[f"{name}.weight"].chunk(num_ranks, dim=1)[rank]
            shard[f"{name}.weight"] = shard[f"{name}.weight"].contiguous()
            if f"{name}.bias" in shard and rank != 0:
                shard[f"{name}.bias"] = torch.zeros_like(shard[f"{name}.bias"])
    return shard
