"""Configuration of the in-process engine (`EngineConfig`) and its flags, which the executor
process and `python -m engine.generate` share.

The dataclass is validated at start; a field out of range raises EngineConfigError naming the
field, which a process reports under its flag.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, fields

from common.config import (
    DEFAULT_MODEL,
    env_bool,
    env_float,
    env_int,
    env_str,
)
from common.model_files import MODEL_HELP
from engine.speculative_config import SpeculativeConfig

# Orders of the waiting queue within a priority level: first come, first served, or longest
# prefix match first (the most prompt tokens already in the prefix or session cache).
POLICIES = ("fcfs", "lpm")
# What happens to a running request whose KV blocks are taken back: its blocks are copied to
# the host tier and back when it resumes (swap), or dropped and recomputed (recompute).
PREEMPTION_MODES = ("swap", "recompute")
# Formats of the KV cache: auto (the model's dtype), 16-bit floats, or int8 or fp8 (float8 e4m3)
# with one bfloat16 scale per cached token for all its KV heads (kernels/kv_format.py).
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8")


class EngineConfigError(ValueError):
    """An EngineConfig field out of range."""

    def __init__(self, field: str, allowed: str, value: object) -> None:
        super().__init__(f"{field} must be {allowed}, got {value!r}")
        self.field = field  # the EngineConfig field
        self.allowed = allowed  # its range, in words
        self.value = value


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
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; float32, float16, bfloat16, int8, fp8
    quantization: str = "none"  # weight-only: none, int8 (per channel), int4 (groups of 32)
    # int8 layers (int8's, int4's output layer) multiply x rounded to int8 blocks of 32, as
    # int4 layers always do: integer products on the CPU (docs/cpu-speed.md)
    int8_activations: bool = False
    kernels: str | None = None  # None: KVGATE_KERNELS or the device default
    retain_freed_memory: bool = True  # CPU: glibc keeps freed activations (engine/host_memory)
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    policy: str = "fcfs"  # order of the waiting queue within a priority: fcfs or lpm
    lpm_aging_steps: int = 64  # lpm: a request waiting this many steps goes before younger ones
    swap_space_gib: float = 0.0  # host memory for KV blocks leaving the device; 0: no host tier
    preemption_mode: str | None = None  # swap or recompute; None: swap when there is a host tier
    # Ranks (processes, one device each on CUDA) splitting the heads and MLP columns.
    tensor_parallel_size: int = 1
    # Speculative decoding: n-gram or draft-model proposals (engine/speculative.py); None: off.
    speculative_config: SpeculativeConfig | None = None

    @property
    def swaps_on_preemption(self) -> bool:
        """Whether a preempted request's blocks go to the host tier (else it is recomputed)."""
        mode = self.preemption_mode or ("swap" if self.swap_space_gib > 0 else "recompute")
        return mode == "swap"

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_formats()
        self._check_scheduling()
        self._check_tensor_parallel()
        _require(
            self.speculative_config is None
            or isinstance(self.speculative_config, SpeculativeConfig),
            "speculative_config",
            "a SpeculativeConfig or None",
            self.speculative_config,
        )

    def _check_sizes(self) -> None:
        """Batch, cache and session sizes."""
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
        for name in ("kv_cache_gib", "swap_space_gib", "session_ttl_s"):
            value = getattr(self, name)
            _require(math.isfinite(value), name, "a finite number", value)
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

    def _check_formats(self) -> None:
        """Number formats and the device."""
        _require(
            self.dtype in (None, "float32", "float16", "bfloat16"),
            "dtype",
            "one of float32, float16, bfloat16",
            self.dtype,
        )
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            "one of " + ", ".join(KV_CACHE_DTYPES),
            self.kv_cache_dtype,
        )
        _require(
            self.quantization in ("none", "int8", "int4"),
            "quantization",
            "one of none, int8, int4",
            self.quantization,
        )
        _require(
            not self.int8_activations or self.quantization != "none",
            "int8_activations",
            "only with quantization int8 or int4",
            self.int8_activations,
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

    def _check_scheduling(self) -> None:
        """The waiting queue's policy, the host tier and preemption."""
        _require(self.policy in POLICIES, "policy", "one of " + ", ".join(POLICIES), self.policy)
        _require(self.lpm_aging_steps >= 1, "lpm_aging_steps", ">= 1", self.lpm_aging_steps)
        _require(self.swap_space_gib >= 0, "swap_space_gib", ">= 0", self.swap_space_gib)
        _require(
            self.swap_space_gib * (1 << 30) < host_memory_bytes(),
            "swap_space_gib",
            f"less than this machine's memory ({host_memory_bytes() / (1 << 30):.1f} GiB)",
            self.swap_space_gib,
        )
        _require(
            self.swap_space_gib == 0 or self.tensor_parallel_size == 1,
            "swap_space_gib",
            "0 with --tensor-parallel-size > 1 (the host tier holds one rank's KV)",
            self.swap_space_gib,
        )
        _require(
            self.preemption_mode in (None, *PREEMPTION_MODES),
            "preemption_mode",
            "one of " + ", ".join(PREEMPTION_MODES),
            self.preemption_mode,
        )
        _require(
            self.preemption_mode != "swap" or self.swap_space_gib > 0,
            "preemption_mode",
            "recompute when --swap-space-gib is 0 (swap needs a host tier)",
            self.preemption_mode,
        )

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        _require(isinstance(tp, int) and 1 <= tp <= 64, "tensor_parallel_size", "in [1, 64]", tp)
        _require(
            tp == 1 or self.device == "cpu" or self.enforce_eager,
            "enforce_eager",
            "set with tensor_parallel_size above 1 on CUDA (decode CUDA graphs are not "
            "captured across ranks)",
            self.enforce_eager,
        )


def host_memory_bytes() -> int:
    """Returns: this machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _require(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise EngineConfigError(field, allowed, value)


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


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add a flag (env KVGATE_<NAME> as default) for each EngineConfig field an operator sets."""
    add = parser.add_argument
    add(
        "--model",
        default=env_str("KVGATE_MODEL", DEFAULT_MODEL),
        help=MODEL_HELP,
    )
    add("--device", default=env_str("KVGATE_DEVICE", "cpu"))
    _add_memory_flags(add)
    _add_format_flags(add)
    _add_scheduling_flags(add)
    add(
        "--speculative-config",
        default=env_str("KVGATE_SPECULATIVE_CONFIG", ""),
        help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"model": DRAFT_PATH, '
        '"num_speculative_tokens": 4} (docs/speculative.md); empty: off',
    )
    add(
        "--tensor-parallel-size",
        type=int,
        default=env_int("KVGATE_TENSOR_PARALLEL_SIZE", 1),
        help="ranks splitting the attention heads and MLP columns (one process, and on CUDA "
        "one device, each); the model's head counts must divide by it",
    )


def _add_memory_flags(add) -> None:
    """Batch and KV cache sizes."""
    add("--block-size", type=int, default=env_int("KVGATE_BLOCK_SIZE", 16))
    add("--max-num-seqs", type=int, default=env_int("KVGATE_MAX_NUM_SEQS", 64))
    add(
        "--max-num-batched-tokens",
        type=int,
        default=env_int("KVGATE_MAX_NUM_BATCHED_TOKENS", 2048),
    )
    add(
        "--max-model-len",
        type=int,
        default=env_int("KVGATE_MAX_MODEL_LEN", 0),
        help="0: the model's max_position_embeddings",
    )
    add("--kv-cache-gib", type=float, default=env_float("KVGATE_KV_CACHE_GIB", 1.0))
    add(
        "--num-gpu-blocks",
        type=int,
        default=env_int("KVGATE_NUM_GPU_BLOCKS", 0),
        help="0: sized from --kv-cache-gib or --gpu-memory-utilization",
    )
    add(
        "--gpu-memory-utilization",
        type=float,
        default=env_float("KVGATE_GPU_MEMORY_UTILIZATION", 0.9),
    )
    add("--session-ttl-s", type=float, default=env_float("KVGATE_SESSION_TTL_S", 600.0))
    add(
        "--swap-space-gib",
        type=float,
        default=env_float("KVGATE_SWAP_SPACE_GIB", 0.0),
        help="host memory for KV blocks that leave the device (preempted requests, idle "
        "sessions); pinned on CUDA. 0: none",
    )
    add(
        "--preemption-mode",
        choices=("auto", *PREEMPTION_MODES),
        default=env_str("KVGATE_PREEMPTION_MODE", "auto"),
        help="a preempted request's KV: swap (to the host tier, resumed without recomputing) "
        "or recompute; auto: swap when --swap-space-gib > 0",
    )


def _add_format_flags(add) -> None:
    """Number formats and the speed switches."""
    add(
        "--dtype",
        choices=("auto", "float32", "float16", "bfloat16"),
        default=env_str("KVGATE_DTYPE", "auto"),
        help="weights and KV cache: auto (float32 on CPU, bfloat16 on CUDA), float32, "
        "float16 or bfloat16",
    )
    add(
        "--kv-cache-dtype",
        default=env_str("KVGATE_KV_CACHE_DTYPE", "auto"),
        help="KV cache format: auto (the model's dtype), float32, float16, bfloat16, "
        "int8 or fp8 (float8 e4m3; both with a bfloat16 scale per token)",
    )
    add(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=env_bool("KVGATE_ENABLE_PREFIX_CACHING", True),
        help="reuse the K/V of cached prompt prefixes across requests",
    )
    add(
        "--retain-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=env_bool("KVGATE_RETAIN_FREED_MEMORY", True),
        help="CPU: keep freed activation memory in the process for reuse (glibc)",
    )
    add(
        "--quantization",
        default=env_str("KVGATE_QUANTIZATION", "none"),
        help="weight-only: none, int8 (per channel) or int4 (groups of 32)",
    )
    add(
        "--int8-activations",
        action=argparse.BooleanOptionalAction,
        default=env_bool("KVGATE_INT8_ACTIVATIONS", False),
        help="with --quantization: int8 layers multiply activations rounded to int8 blocks of "
        "32 (integer products, as int4 layers always do)",
    )
    add(
        "--enforce-eager",
        action="store_true",
        default=env_bool("KVGATE_ENFORCE_EAGER", False),
        help="CUDA: run decode steps without CUDA graphs",
    )


def _add_scheduling_flags(add) -> None:
    """Prefix reuse and the waiting queue's order."""
    add(
        "--policy",
        choices=POLICIES,
        default=env_str("KVGATE_EXECUTOR_POLICY", "fcfs"),
        help="order of waiting requests within a priority: fcfs, or lpm (longest cached "
        "prefix first, with aging)",
    )
    add(
        "--lpm-aging-steps",
        type=int,
        default=env_int("KVGATE_LPM_AGING_STEPS", 64),
        help="lpm: a request waiting this many steps goes before every younger one",
    )


def pop_engine_config(values: dict[str, object]) -> EngineConfig:
    """Take the engine flags' values (`add_engine_flags`'s, by field name) out of `values`.

    Returns:
        Their EngineConfig (0 for --max-model-len and --num-gpu-blocks, `auto` for --dtype
        and --preemption-mode: unset); the other flags' values stay in `values`.

    Raises:
        ValueError: naming the flag of the field out of range.
    """
    engine = {f.name: values.pop(f.name) for f in fields(EngineConfig) if f.name in values}
    for name in ("max_model_len", "num_gpu_blocks"):
        engine[name] = engine[name] or None
    for name in ("dtype", "preemption_mode"):
        if engine.get(name) == "auto":
            engine[name] = None
    if isinstance(engine.get("speculative_config"), str):
        text = engine["speculative_config"]
        try:
            engine["speculative_config"] = SpeculativeConfig.from_json(text) if text else None
        except ValueError as error:
            raise ValueError(f"--speculative-config: {error}") from None
    try:
        return EngineConfig(**engine)
    except EngineConfigError as error:
        flag = "--" + error.field.replace("_", "-")
        raise ValueError(f"{flag} must be {error.allowed}, got {error.value!r}") from None
