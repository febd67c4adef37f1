"""Argument checks shared by the reference and Triton kernel wrappers.

Every check raises a ValueError that names the argument, what was expected and what came,
before any kernel runs.
"""

import os

import torch

from kernels.kv_format import SCALE_BYTES, SCALED_DTYPES, cache_kv_heads, cache_token_shape

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# int8 and uint8 (fp8 bytes): rows with their scale (kernels/kv_format)
CACHE_DTYPES = (*FLOAT_DTYPES, *SCALED_DTYPES)


def expect_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    """Raise unless `tensor` has `ndim` dimensions; `layout` names them for the message."""
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(tensor.shape)}")


def expect_dtype(name: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise unless `tensor.dtype` is one of `dtypes`."""
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype {allowed}, got {tensor.dtype}")


def expect_same_device(tensors: dict[str, torch.Tensor]) -> None:
    """Raise unless all tensors live on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def expect_size(name: str, tensor: torch.Tensor, dim: int, size: int, what: str) -> None:
    """Raise unless `tensor.shape[dim] == size`; `what` says where `size` comes from."""
    if tensor.shape[dim] != size:
        raise ValueError(
            f"{name}.shape[{dim}] must equal {what} ({size}), got shape {tuple(tensor.shape)}"
        )


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Check a paged K/V cache pair: [num_blocks, block_size, Hkv, D], same shape and dtype
    (int8, or uint8 for fp8: [num_blocks, block_size, Hkv * D + 2], D divisible by 4)."""
    expect_dtype("k_cache", k_cache, CACHE_DTYPES)
    scaled = k_cache.dtype in SCALED_DTYPES
    if scaled:
        expect_ndim("k_cache", k_cache, 3, "[num_blocks, block_size, num_kv_heads * head_dim + 2]")
        if k_cache.shape[2] <= SCALE_BYTES or (k_cache.shape[2] - SCALE_BYTES) % 4:
            raise ValueError(
                f"an {SCALED_DTYPES[k_cache.dtype]} k_cache's tokens must be num_kv_heads * "
                f"head_dim values (head_dim divisible by 4) and a {SCALE_BYTES}-byte scale, got "
                f"shape {tuple(k_cache.shape)}"
            )
    else:
        expect_ndim("k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache must match k_cache, got {tuple(v_cache.shape)} {v_cache.dtype} vs "
            f"{tuple(k_cache.shape)} {k_cache.dtype}"
        )
    names = ("block_size", "token width") if scaled else ("block_size", "num_kv_heads", "head_dim")
    for dim, what in enumerate(names, start=1):
        if k_cache.shape[dim] < 1:
            raise ValueError(f"k_cache {what} must be at least 1, got shape {tuple(k_cache.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {cache.stride()}")


def check_store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Check the arguments of store_kvcache (see kernels.reference.store_kvcache)."""
    check_kv_caches(k_cache, v_cache)
    expect_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    if value.shape != key.shape:
        raise ValueError(f"value must match key, got {tuple(value.shape)} vs {tuple(key.shape)}")
    token = cache_token_shape(key.shape[1], key.shape[2], k_cache.dtype)
    if tuple(k_cache.shape[2:]) != token:
        raise ValueError(
            f"key heads/head_dim {tuple(key.shape[1:])} make cached tokens of {token}, the "
            f"cache's are {tuple(k_cache.shape[2:])}"
        )
    expect_dtype("key", key, FLOAT_DTYPES)
    if value.dtype != key.dtype:
        raise ValueError(f"value dtype {value.dtype} differs from key dtype {key.dtype}")
    expect_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    expect_dtype("slot_mapping", slot_mapping, (torch.int64,))
    expect_size("slot_mapping", slot_mapping, 0, key.shape[0], "key.shape[0]")
    expect_same_device(
        {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slots": slot_mapping}
    )


def check_query(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Check queries [tokens, Hq, D] against the cache: dtype, head_dim, GQA divisibility."""
    expect_ndim("q", q, 3, "[num_tokens, num_heads, head_dim]")
    expect_dtype("q", q, FLOAT_DTYPES)
    if k_cache.dtype not in SCALED_DTYPES:
        expect_size("q", q, 2, k_cache.shape[3], "the cache's head_dim")
    num_kv_heads = cache_kv_heads(k_cache, q.shape[2])
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"q heads ({q.shape[1]}) must be a multiple of the cache's kv heads ({num_kv_heads})"
        )


def check_block_tables(
    block_tables: torch.Tensor, context_lens: torch.Tensor, num_seqs: int
) -> None:
    """Check block_tables [B, max_blocks] int32 and context_lens [B] int32."""
    expect_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    expect_dtype("block_tables", block_tables, (torch.int32,))
    expect_size("block_tables", block_tables, 0, num_seqs, "the number of sequences")
    expect_ndim("context_lens", context_lens, 1, "[num_seqs]")
    expect_dtype("context_lens", context_lens, (torch.int32,))
    expect_size("context_lens", context_lens, 0, num_seqs, "the number of sequences")


def check_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """Check the arguments of paged_decode_attention."""
    check_kv_caches(k_cache, v_cache)
    check_query(q, k_cache)
    check_block_tables(block_tables, context_lens, q.shape[0])
    expect_same_device(
        {"q": q, "k_cache": k_cache, "block_tables": block_tables, "context_lens": context_lens}
    )


def check_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """Check the arguments of paged_prefill_attention."""
    check_kv_caches(k_cache, v_cache)
    check_query(q, k_cache)
    expect_ndim("cu_seqlens_q", cu_seqlens_q, 1, "[num_seqs + 1]")
    expect_dtype("cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must hold at least one entry (0)")
    check_block_tables(block_tables, context_lens, cu_seqlens_q.shape[0] - 1)
    expect_same_device(
        {"q": q, "k_cache": k_cache, "block_tables": block_tables, "cu_seqlens_q": cu_seqlens_q}
    )


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Check the arguments of linear: x [N, in], weight [out, in], bias [out] or None."""
    expect_ndim("x", x, 2, "[num_tokens, in_features]")
    expect_dtype("x", x, FLOAT_DTYPES)
    expect_ndim("weight", weight, 2, "[out_features, in_features]")
    expect_size("weight", weight, 1, x.shape[1], "x.shape[1]")
    tensors = {"x": x, "weight": weight}
    if bias is not None:
        expect_ndim("bias", bias, 1, "[out_features]")
        expect_size("bias", bias, 0, weight.shape[0], "weight.shape[0]")
        tensors["bias"] = bias
    for name, tensor in tensors.items():
        if tensor.dtype != x.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from x dtype {x.dtype}")
    expect_same_device(tensors)


def check_quantized_linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> None:
    """Check the arguments of linear_quantized: x [N, in], a QuantizedWeight, bias [out]."""
    expect_ndim("x", x, 2, "[num_tokens, in_features]")
    expect_dtype("x", x, FLOAT_DTYPES)
    if x.shape[1] != weight.in_features:
        raise ValueError(
            f"x.shape[1] must equal the weight's in_features ({weight.in_features}), got shape "
            f"{tuple(x.shape)}"
        )
    tensors = {"x": x, "weight": weight.qweight}
    if bias is not None:
        expect_ndim("bias", bias, 1, "[out_features]")
        expect_size("bias", bias, 0, weight.out_features, "the weight's out_features")
        if bias.dtype != x.dtype:
            raise ValueError(f"bias dtype {bias.dtype} differs from x dtype {x.dtype}")
        tensors["bias"] = bias
    expect_same_device(tensors)


def check_silu_and_mul(x: torch.Tensor) -> None:
    """Check the argument of silu_and_mul: [N, 2 * I] floats."""
    expect_ndim("x", x, 2, "[num_tokens, 2 * intermediate_size]")
    expect_dtype("x", x, FLOAT_DTYPES)
    if x.shape[1] % 2 != 0:
        raise ValueError(
            f"x must hold gate and up halves of equal width, got shape {tuple(x.shape)}"
        )


def check_argmax(logits: torch.Tensor) -> None:
    """Check the argument of argmax: [rows, vocab] floats, vocab at least 1."""
    expect_ndim("logits", logits, 2, "[num_rows, vocab_size]")
    expect_dtype("logits", logits, FLOAT_DTYPES)
    if logits.shape[1] < 1:
        raise ValueError(f"logits needs at least one column, got shape {tuple(logits.shape)}")


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Check the arguments of rms_norm: x [N, H], weight [H], residual like x."""
    expect_ndim("x", x, 2, "[num_tokens, hidden_size]")
    expect_dtype("x", x, FLOAT_DTYPES)
    expect_ndim("weight", weight, 1, "[hidden_size]")
    expect_size("weight", weight, 0, x.shape[1], "x.shape[1]")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual must match x, got {tuple(residual.shape)} {residual.dtype} vs "
                f"{tuple(x.shape)} {x.dtype}"
            )
        tensors["residual"] = residual
    expect_same_device(tensors)


def check_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Check the arguments of rotary_embedding."""
    expect_ndim("positions", positions, 1, "[num_tokens]")
    expect_dtype("positions", positions, (torch.int64,))
    expect_ndim("q", q, 3, "[num_tokens, num_heads, head_dim]")
    expect_ndim("k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    expect_dtype("q", q, FLOAT_DTYPES)
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} differs from q dtype {q.dtype}")
    num_tokens, _, head_dim = q.shape
    expect_size("positions", positions, 0, num_tokens, "q.shape[0]")
    expect_size("k", k, 0, num_tokens, "q.shape[0]")
    expect_size("k", k, 2, head_dim, "q's head_dim")
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    expect_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, head_dim]")
    expect_dtype("cos_sin_cache", cos_sin_cache, (torch.float32,))
    expect_size("cos_sin_cache", cos_sin_cache, 1, head_dim, "q's head_dim")
    expect_same_device({"positions": positions, "q": q, "k": k, "cos_sin_cache": cos_sin_cache})


def expect_inner_contiguous(name: str, tensor: torch.Tensor, num_dims: int) -> None:
    """Raise unless the last `num_dims` dimensions are laid out contiguously (Triton wrappers).

    Only the leading dimension may have an arbitrary stride, as a slice of a fused
    projection has.
    """
    expected = 1
    for dim in range(tensor.dim() - 1, tensor.dim() - 1 - num_dims, -1):
        if tensor.shape[dim] > 1 and tensor.stride(dim) != expected:
            raise ValueError(
                f"{name} needs its last {num_dims} dims contiguous, got shape "
                f"{tuple(tensor.shape)} strides {tensor.stride()}; pass {name}.contiguous()"
            )
        expected *= tensor.shape[dim]


def expect_triton_device(name: str, tensor: torch.Tensor) -> None:
    """Raise unless Triton can run on `tensor`'s device: CUDA, or any with TRITON_INTERPRET=1."""
    if tensor.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{name} is on {tensor.device}; Triton kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 set before start for the CPU interpreter)"
        )
