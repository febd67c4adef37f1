"""Choose the kernel backend for a device: Triton on CUDA, the C kernels on the CPU.

`cpu` is the PyTorch reference with paged attention, rotary embedding, the KV-cache store, the
greedy argmax, RMSNorm, SiLU-and-multiply and linear layers replaced by the C kernels
(kernels/cpu*.py; float32 and bfloat16); where those cannot be built or the dtype is another,
the reference runs and the log says why.
"""

import dataclasses
import functools
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.attention_step import AttentionStep
from kernels.decoder import DecoderWeights

logger = logging.getLogger("kvgate.kernels")

BACKEND_ENV = "KVGATE_KERNELS"
BACKENDS = ("triton", "cpu", "reference")


@dataclass(frozen=True)
class KernelBackend:
    """One set of kernels, all with the signatures of kernels.reference."""

    name: str
    store_kvcache: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    argmax: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[..., torch.Tensor]
    linear_quantized: Callable[..., torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # Once per step: check the step's indices and build what `attention` reads in each layer.
    prepare_attention: Callable[..., AttentionStep]
    # One layer: rotary embedding, KV-cache store and paged attention of a fused q/k/v.
    attention: Callable[..., torch.Tensor]
    # Once per model and cache: describe the decoder stack to the kernels.
    prepare_decoder: Callable[[DecoderWeights], DecoderWeights]
    # Every decoder layer of a step (kernels.decoder).
    decoder_layers: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # The ISA level the C kernels were built for (kernels/cpu_build.py's ISA_LEVELS); None
    # where they do not run.
    cpu_isa: str | None = None


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _why_triton_cannot_run(device: torch.device) -> str | None:
    """A reason Triton kernels cannot run on `device`, or None when they can."""
    if not _triton_importable():
        return "the triton package is not installed (pip install triton, Linux x86_64 only)"
    if device.type != "cuda" and not _interpreter_on():
        return (
            f"device is {device} and TRITON_INTERPRET is not 1 (Triton needs a CUDA device, "
            "or TRITON_INTERPRET=1 set before start to run it in the slow CPU interpreter)"
        )
    return None


def _requested_backend(backend: str | None) -> str | None:
    """The backend asked for by argument or by KVGATE_KERNELS; None when neither says."""
    requested = backend if backend is not None else os.environ.get(BACKEND_ENV) or None
    if requested is not None and requested not in BACKENDS:
        raise ValueError(
            f"{BACKEND_ENV}={requested!r} is not a kernel backend; allowed: {', '.join(BACKENDS)}"
        )
    return requested


def _choose_backend(device: torch.device, requested: str | None, dtype: torch.dtype) -> str:
    if requested == "reference":
        return "reference"
    if requested == "cpu" or (requested is None and device.type == "cpu"):
        return _choose_cpu(device, requested, dtype)
    if requested is None and device.type != "cuda":
        return "reference"
    reason = _why_triton_cannot_run(device)
    if requested == "triton" and reason is not None:
        raise RuntimeError(
            f"{BACKEND_ENV}=triton cannot run: {reason}. Unset {BACKEND_ENV} or set it to "
            "'reference' to run the PyTorch reference kernels instead."
        )
    if requested is None and reason is not None:
        logger.warning(
            "Triton kernels cannot run on %s: %s; using the reference kernels", device, reason
        )
        return "reference"
    return "triton"


CPU_DTYPES = (torch.float32, torch.bfloat16)


def _why_cpu_cannot_run(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"device is {device}, not the CPU"
    if dtype not in CPU_DTYPES:
        return f"dtype is {dtype}; the CPU kernels run float32 and bfloat16"
    from kernels import cpu_build

    return cpu_build.why_unavailable()


def _choose_cpu(device: torch.device, requested: str | None, dtype: torch.dtype) -> str:
    reason = _why_cpu_cannot_run(device, dtype)
    if reason is None:
        return "cpu"
    if requested == "cpu":
        raise RuntimeError(
            f"{BACKEND_ENV}=cpu cannot run: {reason}. Unset {BACKEND_ENV} or set it to "
            "'reference' to run the PyTorch reference kernels instead."
        )
    logger.warning("CPU kernels cannot run: %s; using the reference kernels", reason)
    return "reference"


def _reference_backend() -> KernelBackend:
    from kernels import reference

    return KernelBackend(
        name="reference",
        store_kvcache=reference.store_kvcache,
        paged_decode_attention=reference.paged_decode_attention,
        paged_prefill_attention=reference.paged_prefill_attention,
        rms_norm=reference.rms_norm,
        rotary_embedding=reference.rotary_embedding,
        argmax=reference.argmax,
        linear=reference.linear,
        linear_quantized=reference.linear_quantized,
        silu_and_mul=reference.silu_and_mul,
        prepare_attention=reference.prepare_attention,
        attention=reference.attention,
        prepare_decoder=reference.prepare_decoder,
        decoder_layers=reference.decoder_layers,
    )


def _cpu_backend() -> KernelBackend:
    """The reference kernels, with the ones kernels/cpu.py has in C replaced."""
    from kernels import cpu, cpu_attention, cpu_build, cpu_decoder, cpu_linear

    return dataclasses.replace(
        _reference_backend(),
        name="cpu",
        cpu_isa=cpu_build.isa_level(),
        store_kvcache=cpu.store_kvcache,
        paged_decode_attention=cpu_attention.paged_decode_attention,
        paged_prefill_attention=cpu_attention.paged_prefill_attention,
        rotary_embedding=cpu.rotary_embedding,
        argmax=cpu.argmax,
        rms_norm=cpu.rms_norm,
        linear=cpu_linear.linear,
        linear_quantized=cpu_linear.linear_quantized,
        silu_and_mul=cpu.silu_and_mul,
        prepare_attention=cpu_attention.prepare_attention,
        attention=cpu_attention.attention,
        prepare_decoder=cpu_decoder.prepare_decoder,
        decoder_layers=cpu_decoder.decoder_layers,
    )


def _triton_backend() -> KernelBackend:
    # Imported here: triton is optional, and TRITON_INTERPRET is read when kernels are defined.
    # Argmax and SiLU-and-multiply stay the reference's (torch on the GPU); dense linear layers
    # are torch's too (kernels/cuda.py).
    from kernels import cuda, reference, triton_attention, triton_cache, triton_norm, triton_quant
    from kernels.decoder import decoder_layers_with

    attention = reference.attention_with(
        triton_norm.rotary_embedding,
        triton_cache.store_kvcache,
        triton_attention.paged_decode_attention,
        triton_attention.paged_prefill_attention,
    )
    return dataclasses.replace(
        _reference_backend(),
        name="triton",
        store_kvcache=triton_cache.store_kvcache,
        paged_decode_attention=triton_attention.paged_decode_attention,
        paged_prefill_attention=triton_attention.paged_prefill_attention,
        rms_norm=triton_norm.rms_norm,
        rotary_embedding=triton_norm.rotary_embedding,
        linear=cuda.linear,
        linear_quantized=triton_quant.linear_quantized,
        attention=attention,
        decoder_layers=decoder_layers_with(
            cuda.linear,
            triton_quant.linear_quantized,
            triton_norm.rms_norm,
            attention,
            reference.silu_and_mul,
        ),
    )


@functools.cache
def _log_choice(name: str, device_type: str, cpu_isa: str | None) -> None:
    if cpu_isa is None:
        logger.info("kernel backend %s on %s", name, device_type)
    else:
        logger.info("kernel backend %s on %s, ISA level %s", name, device_type, cpu_isa)


_BUILDERS = {"triton": _triton_backend, "cpu": _cpu_backend, "reference": _reference_backend}


def get_kernels(
    device: torch.device, backend: str | None = None, dtype: torch.dtype = torch.float32
) -> KernelBackend:
    """The kernels to run on `device` for a model of `dtype`. The KV cache's format is the
    kernels' own argument (kernels/kv_format.py): Triton, the reference and the C kernels take
    any of its formats.

    Args:
        device: where the model and KV cache live.
        backend: "triton", "cpu" or "reference"; None reads KVGATE_KERNELS, and when that is
            unset too, picks Triton on CUDA, the CPU kernels on the CPU (float32, bfloat16)
            and the reference kernels where those cannot run.
        dtype: the model's dtype.

    Returns:
        The chosen KernelBackend.

    Raises:
        ValueError: the backend name is unknown, or KVGATE_CPU_ISA names an ISA level this CPU
            cannot run.
        RuntimeError: a backend was asked for where it cannot run.
    """
    device = torch.device(device)
    name = _choose_backend(device, _requested_backend(backend), dtype)
    kernels = _BUILDERS[name]()
    _log_choice(name, device.type, kernels.cpu_isa)
    return kernels
