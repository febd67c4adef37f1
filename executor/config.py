"""Configuration of the in-process engine (one dataclass, validated at start)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    """What an `Engine` needs; every field is validated in `__post_init__`."""

    model: str
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_cache_gib: float = 1.0  # CPU: memory given to the KV cache
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory for weights + KV
    num_gpu_blocks: int | None = None  # fixes the block count (tests, benchmarks)
    enable_prefix_caching: bool = True
    session_ttl_s: float = 600.0
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    quantization: str = "none"  # weight-only: none, int8 (per channel), int4 (groups of 32)
    kernels: str | None = None  # None: KVGATE_KERNELS or the device default
    seed: int = 0
    retain_freed_memory: bool = True  # CPU: glibc keeps freed activations (executor/host_memory)
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps

    def __post_init__(self) -> None:
        _require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "block_size",
            "a power of two from 1 to 128",
            self.block_size,
        )
        _require(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            ">= 1",
            self.max_num_batched_tokens,
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            ">= 1",
            self.max_model_len,
        )
        _require(self.kv_cache_gib > 0, "kv_cache_gib", "> 0", self.kv_cache_gib)
        _require(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            "in (0, 1]",
            self.gpu_memory_utilization,
        )
        _require(
            self.num_gpu_blocks is None or self.num_gpu_blocks >= 1,
            "num_gpu_blocks",
            ">= 1",
            self.num_gpu_blocks,
        )
        _require(self.session_ttl_s > 0, "session_ttl_s", "> 0", self.session_ttl_s)
        _require(
            self.dtype in (None, "float32", "float16", "bfloat16"),
            "dtype",
            "one of float32, float16, bfloat16",
            self.dtype,
        )
        _require(
            self.quantization in ("none", "int8", "int4"),
            "quantization",
            "one of none, int8, int4",
            self.quantization,
        )
        _require(
            not (self.device == "cpu" and self.dtype == "float16"),
            "dtype",
            "float32 or bfloat16 on the CPU",
            self.dtype,
        )
        _require(
            self.device == "cpu" or self.device.startswith("cuda"),
            "device",
            "'cpu' or 'cuda[:N]'",
            self.device,
        )


def _require(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


def check_device_present(device: str) -> None:
    """Raise ValueError naming --device when it is a CUDA device this machine lacks."""
    import torch  # here: the config itself is read without torch

    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine's torch sees no CUDA device")
    try:
        index = torch.device(device).index
    except RuntimeError:
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}") from None
    if index is not None and index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(f"--device {device}: there are {count} CUDA devices (0 to {count - 1})")
