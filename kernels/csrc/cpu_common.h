/*
 * What every CPU kernel file shares: the element types a tensor may have and their conversions
 * to and from float32, in which all arithmetic is done.
 *
 * bfloat16 is the upper half of a float32. Rounding to it is to nearest, ties to even, and a
 * NaN becomes the quiet NaN 0x7FC0: the rounding torch's c10::BFloat16 does, so a kernel that
 * rounds where the PyTorch reference rounds gives the same bits.
 */
#ifndef KVGATE_CPU_COMMON_H
#define KVGATE_CPU_COMMON_H

#include <stdint.h>
#include <string.h>

/* Element types, as kernels/cpu_build.py numbers them. */
enum { KVGATE_F32 = 0, KVGATE_BF16 = 1 };

static inline float bf16_to_f32(uint16_t bits) {
    const uint32_t widened = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &widened, sizeof value);
    return value;
}

static inline uint16_t f32_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u; /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* float32 value of element i of an array of `dtype`. */
static inline float load_elem(const void *base, int dtype, int64_t i) {
    return dtype == KVGATE_BF16 ? bf16_to_f32(((const uint16_t *)base)[i])
                                : ((const float *)base)[i];
}

static inline void store_elem(void *base, int dtype, int64_t i, float value) {
    if (dtype == KVGATE_BF16)
        ((uint16_t *)base)[i] = f32_to_bf16(value);
    else
        ((float *)base)[i] = value;
}

/* value rounded to `dtype` and back: what storing it in a tensor of that dtype keeps. */
static inline float round_to(int dtype, float value) {
    return dtype == KVGATE_BF16 ? bf16_to_f32(f32_to_bf16(value)) : value;
}

/* n contiguous elements of `dtype` into float32. */
static inline void load_row(const void *src, int dtype, int64_t n, float *dst) {
    if (dtype == KVGATE_BF16) {
        const uint16_t *s = src;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

/* n float32 values into contiguous elements of `dtype`. */
static inline void store_row(void *dst, int dtype, const float *src, int64_t n) {
    if (dtype == KVGATE_BF16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

static inline int64_t dtype_size(int dtype) { return dtype == KVGATE_BF16 ? 2 : 4; }

/* Rotary embedding (rotate_half style) of one token's `num_heads` heads of x (element (h, d) at
 * x[(h * head_dim + d) * stride], of `dtype`) with cos = cos_sin[:head_dim / 2] and sin the
 * half after, into out[num_heads * head_dim] as float32 values rounded to `dtype`, as the
 * PyTorch reference rounds them. Defined in cpu_kernels.c. */
void kvgate_rotate_heads(const void *x, int dtype, int64_t stride, int64_t num_heads,
                         int64_t head_dim, const float *cos_sin, float *out);

/* A linear layer's weight, [out_features, in_features], in one of these formats
 * (kernels/quant.py for the quantized ones), and its bias (activation dtype) or NULL. */
enum { KVGATE_W_F32 = 0, KVGATE_W_BF16 = 1, KVGATE_W_INT8 = 2, KVGATE_W_INT4 = 3 };
typedef struct {
    int kind;
    const void *q;               /* the weights, or the quantized values */
    const void *scales, *zeros;  /* int8: float32 scales; int4: float16 scales and zeros */
    const void *bias;
    int64_t group_size, out_features, in_features;
} kvgate_linear_weights;

/* y = x @ w^T + bias for m rows of x (element (i, j) at x[i * row_stride + j * col_stride],
 * of x_dtype) into out, column-major: out[r * m + i]. Returns 0, or 1 when out of memory.
 * Defined in cpu_linear.c. */
int kvgate_linear(const kvgate_linear_weights *w, const void *x, int x_dtype, int64_t row_stride,
                  int64_t col_stride, int64_t m, void *out, int out_dtype, int num_threads);

/* Defined in cpu_kernels.c (see there). */
void kvgate_rms_norm(const void *x, int64_t x_ld, const void *residual, int64_t res_ld,
                     const void *weight, void *out, void *out_residual, int64_t rows,
                     int64_t hidden, int column_major, int dtype, float eps, int num_threads);
void kvgate_silu_and_mul(const void *x, int64_t x_stride, int64_t up_offset, void *out,
                         int64_t out_stride, int64_t outer, int64_t inner, int dtype,
                         int num_threads);

/* One step's attention inputs, shared by every layer (kernels/cpu.py builds it once per step
 * and has checked every index in it). The step's tokens are packed: num_decode one-token
 * sequences first, then the prefill sequences' tokens. */
typedef struct {
    const int64_t *positions;    /* [num_tokens] */
    const float *cos_sin;        /* [max_position, head_dim] */
    const int64_t *slot_mapping; /* [num_tokens], -1: not stored */
    const int32_t *decode_tables, *decode_lens;
    const int32_t *prefill_tables, *cu_seqlens, *prefill_lens;
    int64_t num_tokens, num_decode, decode_width, num_prefill_seqs, prefill_width;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int num_threads;
} kvgate_attention_step;

/* Defined in cpu_attention.c (see there). */
int kvgate_attention_layer(const kvgate_attention_step *st, const void *qkv, int act_dtype,
                           int64_t token_stride, int64_t feature_stride, void *k_cache,
                           void *v_cache, int cache_dtype, void *out, float *q_rotated);

#endif
