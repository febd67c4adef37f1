"""Rotary embedding tables: inverse frequencies and the cos/sin cache the kernels read."""

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_type(rope_scaling: dict | None) -> str:
    """The rope_type of a config's rope_scaling dict ("type" is its older spelling)."""
    if rope_scaling is None:
        return "default"
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {supported}")
    return rope_type


def _default_inv_freq(head_dim: int, rope_theta: float) -> torch.Tensor:
    """1 / theta^(2i / D) for i in 0..D/2-1, float32, computed as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (rope_theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by factor, a smooth band between."""
    missing = [key for key in LLAMA3_KEYS if key not in rope_scaling]
    if missing:
        raise ValueError(f"rope_scaling of rope_type 'llama3' lacks {', '.join(missing)}")
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, as transformers computes them.

    Args:
        head_dim: attention head dimension (even).
        rope_theta: base of the geometric frequency progression.
        rope_scaling: the config's rope_scaling dict, or None; rope_type "default" or "llama3".

    Returns:
        [head_dim / 2] float32 on the CPU.
    """
    if head_dim <= 0 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    rope_type = _rope_type(rope_scaling)
    inv_freq = _default_inv_freq(head_dim, rope_theta)
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    return inv_freq


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    rope_theta: float,
    rope_scaling: dict | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Cos/sin table for positions 0..max_position-1, the layout rotary_embedding reads.

    Args:
        head_dim: attention head dimension (even).
        max_position: number of positions in the table.
        rope_theta: base of the geometric frequency progression.
        rope_scaling: the config's rope_scaling dict, or None.
        device: where the table lives.

    Returns:
        [max_position, head_dim] float32: first head_dim/2 columns cos, last head_dim/2 sin.
    """
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    inv_freq = rope_inv_freq(head_dim, rope_theta, rope_scaling)
    positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
