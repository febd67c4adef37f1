"""Attention, KV-cache, RMSNorm, rotary and linear kernels: Triton, C, and their PyTorch twins."""

from kernels.attention_step import AttentionStep
from kernels.dispatch import KernelBackend, get_kernels
from kernels.rotary import build_cos_sin_cache

__all__ = ["AttentionStep", "KernelBackend", "build_cos_sin_cache", "get_kernels"]
