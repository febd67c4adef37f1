/*
 * What every CPU kernel file shares: the element types a tensor may have and their conversions
 * to and from float32, in which all arithmetic is done.
 *
 * bfloat16 is the upper half of a float32. Rounding to it is to nearest, ties to even, and a
 * NaN becomes the quiet NaN 0x7FC0: the rounding torch's c10::BFloat16 does, so a kernel that
 * rounds where the PyTorch reference rounds gives the same bits. float16 (IEEE binary16) rounds
 * to nearest, ties to even, as torch's c10::Half does; values from 65520 up become infinity.
 * The F16C / AVX-512 instructions convert it where the CPU has them, integer code elsewhere.
 * float8 e4m3 (torch.float8_e4m3fn: sign, 4 exponent bits of bias 7, 3 mantissa bits, 0x7F and
 * 0xFF NaN, no infinities) is encoded and decoded by integer code on the float32 bits: nearest,
 * ties to even, subnormals kept, beyond +-448 saturated (kernels/kv_format.py).
 */
#ifndef KVGATE_CPU_COMMON_H
#define KVGATE_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* The ISA level this file is compiled for (kernels/cpu_build.py builds one library per level):
 * 2 with AVX-512 F and BW, 1 with AVX2, FMA and F16C, 0 with neither (the portable code). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVGATE_ISA_LEVEL 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVGATE_ISA_LEVEL 1
#else
#define KVGATE_ISA_LEVEL 0
#endif

/* Element types, as kernels/cpu_build.py numbers them. KVGATE_I8, KVGATE_F16 and KVGATE_FP8 are
 * KV-cache formats only. An int8 cached token (K or V) is num_kv_heads * head_dim int8 values,
 * then one bfloat16 scale for all of them (2 bytes), and reads back as value * scale
 * (kernels/kv_format.py says why one scale per token); an fp8 token is the same with e4m3 bytes
 * for values. */
enum { KVGATE_F32 = 0, KVGATE_BF16 = 1, KVGATE_I8 = 2, KVGATE_F16 = 3, KVGATE_FP8 = 4 };

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

static inline float f16_to_f32(uint16_t half) {
#ifdef __F16C__
    return _cvtsh_ss(half);
#else
    const uint32_t sign = (uint32_t)(half & 0x8000u) << 16;
    uint32_t exponent = (half >> 10) & 0x1fu, mantissa = half & 0x3ffu, bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | mantissa << 13; /* infinity, NaN */
    } else if (exponent != 0) {
        bits = sign | (exponent + 112u) << 23 | mantissa << 13;
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: mantissa * 2^-24, normalized */
        exponent = 113u;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            --exponent;
        }
        bits = sign | exponent << 23 | (mantissa & 0x3ffu) << 13;
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
#endif
}

/* q + 1 when the `shift` low bits dropped from it (`rest`) are over half, or half and q odd. */
static inline uint32_t round_half_even(uint32_t q, uint32_t rest, int shift) {
    const uint32_t half = 1u << (shift - 1);
    return q + (rest > half || (rest == half && (q & 1u)));
}

static inline uint16_t f32_to_f16(float value) {
#ifdef __F16C__
    return (uint16_t)_cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN */
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520: infinity */
    if (magnitude >= 0x38800000u) { /* normal: rebase the exponent, drop 13 mantissa bits */
        const uint32_t rebased = magnitude - 0x38000000u;
        return (uint16_t)(sign | round_half_even(rebased >> 13, rebased & 0x1fffu, 13));
    }
    const int exponent = (int)(magnitude >> 23);
    if (exponent < 102) return (uint16_t)sign; /* under 2^-25: rounds to zero */
    /* subnormal: the value in units of 2^-24 */
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const int shift = 126 - exponent;
    return (uint16_t)(sign | round_half_even(mantissa >> shift, mantissa & ((1u << shift) - 1),
                                             shift));
#endif
}

/* value as float8 e4m3 bits. */
static inline uint8_t f32_to_fp8(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t sign = (bits >> 24) & 0x80u, magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return (uint8_t)(sign | 0x7fu); /* NaN */
    if (magnitude >= 0x43e00000u) return (uint8_t)(sign | 0x7eu); /* from 448 (infinity too) */
    if (magnitude >= 0x3c800000u) { /* normal: rebase the exponent, drop 20 mantissa bits */
        const uint32_t rebased = magnitude - 0x3c000000u;
        return (uint8_t)(sign | round_half_even(rebased >> 20, rebased & 0xfffffu, 20));
    }
    const int exponent = (int)(magnitude >> 23);
    if (exponent < 117) return (uint8_t)sign; /* under 2^-10: rounds to zero */
    /* subnormal: the value in units of 2^-9 */
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const int shift = 141 - exponent;
    return (uint8_t)(sign | round_half_even(mantissa >> shift, mantissa & ((1u << shift) - 1),
                                            shift));
}

/* float8 e4m3 bits as float32: a normal value rebased from exponent bias 7 to 127, a subnormal
 * k * 2^-9 as the float k times 2^-9 (exact), 0x7F the NaN torch reads it as. No branches and
 * no table, so a loop of them vectorizes (AVX-512 gathers from a table are slower). */
static inline float fp8_to_f32(uint8_t byte) {
    const uint32_t magnitude = byte & 0x7fu;
    const float subnormal = (float)magnitude * 0x1p-9f;
    uint32_t bits;
    memcpy(&bits, &subnormal, sizeof bits);
    bits = magnitude >= 8u ? (magnitude << 20) + 0x3c000000u : bits;
    bits = (magnitude == 0x7fu ? 0x7ff00000u : bits) | (uint32_t)(byte & 0x80u) << 24;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* float32 value of element i of an array of `dtype`. */
static inline float load_elem(const void *base, int dtype, int64_t i) {
    if (dtype == KVGATE_BF16) return bf16_to_f32(((const uint16_t *)base)[i]);
    if (dtype == KVGATE_F16) return f16_to_f32(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

static inline void store_elem(void *base, int dtype, int64_t i, float value) {
    if (dtype == KVGATE_BF16)
        ((uint16_t *)base)[i] = f32_to_bf16(value);
    else if (dtype == KVGATE_F16)
        ((uint16_t *)base)[i] = f32_to_f16(value);
    else
        ((float *)base)[i] = value;
}

/* value rounded to `dtype` and back: what storing it in a tensor of that dtype keeps. */
static inline float round_to(int dtype, float value) {
    return dtype == KVGATE_BF16 ? bf16_to_f32(f32_to_bf16(value)) : value;
}

/* n contiguous float16 values into float32: 16 at a time where AVX-512 converts them, 8 at a
 * time where F16C does (narrow heads' rows), one at a time for the rest. */
static inline void load_f16_row(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#endif
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

#define KVGATE_F16_ROUNDING (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline void store_f16_row(uint16_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), KVGATE_F16_ROUNDING));
#endif
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), KVGATE_F16_ROUNDING));
#endif
    for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

/* n contiguous bfloat16 values into float32, with one vector store per 16 (AVX-512) or 8
 * (AVX2) values: a narrow row stored in halves and then read whole (as the dot products that
 * follow read it) waits for both stores to retire instead of taking the forwarded value. */
static inline void load_bf16_row(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
#endif
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
#endif
    for (; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

/* n contiguous elements of `dtype` into float32. */
static inline void load_row(const void *src, int dtype, int64_t n, float *dst) {
    if (dtype == KVGATE_BF16) {
        load_bf16_row(src, n, dst);
    } else if (dtype == KVGATE_F16) {
        load_f16_row(src, n, dst);
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

/* n float32 values into contiguous elements of `dtype`. */
static inline void store_row(void *dst, int dtype, const float *src, int64_t n) {
    if (dtype == KVGATE_BF16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
    } else if (dtype == KVGATE_F16) {
        store_f16_row(dst, src, n);
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

static inline int64_t dtype_size(int dtype) {
    return dtype == KVGATE_BF16 || dtype == KVGATE_F16       ? 2
           : dtype == KVGATE_I8 || dtype == KVGATE_FP8 ? 1
                                                       : 4;
}

static inline int is_scaled(int dtype) { return dtype == KVGATE_I8 || dtype == KVGATE_FP8; }

/* Bytes of one cached token's K (or V) in a cache of `dtype`: num_kv_heads rows of head_dim
 * values, and after them an int8 or fp8 token's bfloat16 scale (kernels/kv_format.py). */
static inline int64_t cache_slot_bytes(int dtype, int64_t num_kv_heads, int64_t head_dim) {
    return num_kv_heads * head_dim * dtype_size(dtype) + (is_scaled(dtype) ? 2 : 0);
}

/* Bytes from the start of head kv_head's row to its token's scale (int8, fp8). */
static inline int64_t scale_offset(int64_t num_kv_heads, int64_t kv_head, int64_t head_dim) {
    return (num_kv_heads - kv_head) * head_dim;
}

/* The bfloat16 scale of a cached int8 or fp8 token, at `at`, as float32. */
static inline float token_scale(const void *at) {
    uint16_t bits;
    memcpy(&bits, at, sizeof bits);
    return bf16_to_f32(bits);
}

/* max|x| over n values divided by `max_code` (127 or 448), rounded up to a bfloat16 (so that no
 * value is pushed past max_code by the scale's rounding): its 16 bits, and the float32 it is. */
__attribute__((optimize("no-fast-math"))) static inline uint16_t token_scale_bits(
    const float *x, int64_t n, float max_code, float *scale) {
    float max_abs = 0.0f;
    for (int64_t i = 0; i < n; ++i) max_abs = fabsf(x[i]) > max_abs ? fabsf(x[i]) : max_abs;
    const float exact = max_abs / max_code;
    uint32_t bits;
    memcpy(&bits, &exact, sizeof bits);
    bits = (bits + 0xFFFFu) & 0xFFFF0000u;
    memcpy(scale, &bits, sizeof bits);
    return (uint16_t)(bits >> 16);
}

/* n values (one token's heads) into int8 cache bytes: s = max|x| / 127 rounded up to a
 * bfloat16, round(x / s) half to even, 0 where s = 0, then s's 2 bytes. Not fast-math, so x / s
 * rounds as the PyTorch reference's does. */
__attribute__((optimize("no-fast-math"))) static inline void quantize_row(const float *x,
                                                                           int64_t n,
                                                                           int8_t *row) {
    float scale;
    const uint16_t bits = token_scale_bits(x, n, 127.0f, &scale);
    for (int64_t i = 0; i < n; ++i) {
        const float q = scale > 0.0f ? nearbyintf(x[i] / scale) : 0.0f;
        row[i] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
    }
    memcpy(row + n, &bits, sizeof bits);
}

/* n values (one token's heads) into fp8 cache bytes: s = max|x| / 448 rounded up to a
 * bfloat16, x / s as e4m3 (f32_to_fp8), 0 where s = 0, then s's 2 bytes. Not fast-math, so
 * x / s rounds as the PyTorch reference's does. */
__attribute__((optimize("no-fast-math"))) static inline void quantize_fp8_row(const float *x,
                                                                               int64_t n,
                                                                               uint8_t *row) {
    float scale;
    const uint16_t bits = token_scale_bits(x, n, 448.0f, &scale);
    for (int64_t i = 0; i < n; ++i) row[i] = f32_to_fp8(scale > 0.0f ? x[i] / scale : 0.0f);
    memcpy(row + n, &bits, sizeof bits);
}

#ifdef __AVX2__
/* e4m3 bytes (widened to 16-bit lanes) as the float16 of value / 256: the sign moves to bit 15
 * and the exponent and mantissa bits to bits 7..13, which float16 (exponent bias 15, not 7)
 * reads as the same value times 2^-8, subnormals included. The NaN pattern (magnitude 0x7f)
 * becomes a float16 NaN. Every e4m3 value is exact in float16, and the caller's scale times
 * 256 restores it: one rounding, as fp8_to_f32(byte) * scale. mm: _mm256 (16 lanes) or _mm (8),
 * si: si256 or si128. */
#define FP8_AS_F16(mm, si, bytes)                                                             \
    mm##_blendv_epi8(                                                                         \
        mm##_or_##si(mm##_and_##si(mm##_slli_epi16(bytes, 8), mm##_set1_epi16((short)0x8000)), \
                     mm##_and_##si(mm##_slli_epi16(bytes, 7), mm##_set1_epi16(0x3f80))),       \
        mm##_set1_epi16(0x7e00),                                                              \
        mm##_cmpeq_epi16(mm##_and_##si(bytes, mm##_set1_epi16(0x7f)), mm##_set1_epi16(0x7f)))
#endif

/* n e4m3 bytes times scale as float32: 16 at a time in AVX-512 registers, 8 at a time in AVX2
 * ones, one at a time for the rest. */
static inline void fp8_row_to_f32(const uint8_t *values, int64_t n, float scale, float *dst) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 scale16 = _mm512_set1_ps(scale * 256.0f);
    for (; i + 16 <= n; i += 16) {
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(values + i)));
        const __m512 unscaled = _mm512_cvtph_ps(FP8_AS_F16(_mm256, si256, bytes));
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(unscaled, scale16));
    }
#endif
#ifdef __AVX2__
    const __m256 scale8 = _mm256_set1_ps(scale * 256.0f);
    for (; i + 8 <= n; i += 8) {
        const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(values + i)));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(FP8_AS_F16(_mm, si128, bytes)),
                                                scale8));
    }
#endif
    for (; i < n; ++i) dst[i] = fp8_to_f32(values[i]) * scale;
}

/* One token's num_heads rows of head_dim float32 values into a cache slot of `dtype` (int8,
 * fp8: quantized together, with one scale). */
static inline void store_cache_rows(void *dst, int dtype, const float *src, int64_t num_heads,
                                    int64_t head_dim) {
    if (dtype == KVGATE_FP8)
        quantize_fp8_row(src, num_heads * head_dim, dst);
    else if (dtype == KVGATE_I8)
        quantize_row(src, num_heads * head_dim, dst);
    else
        store_row(dst, dtype, src, num_heads * head_dim);
}

/* One cached row of `dtype` (head_dim values) as float32; an int8 or fp8 row times its token's
 * scale, `to_scale` bytes after the row's start (scale_offset). */
static inline void load_cache_row(const void *src, int dtype, int64_t head_dim, int64_t to_scale,
                                  float *dst) {
    if (dtype == KVGATE_FP8) {
        fp8_row_to_f32(src, head_dim, token_scale((const char *)src + to_scale), dst);
        return;
    }
    if (dtype != KVGATE_I8) {
        load_row(src, dtype, head_dim, dst);
        return;
    }
    const int8_t *values = src;
    const float scale = token_scale(values + to_scale);
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (; i + 16 <= head_dim; i += 16) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(values + i));
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)),
                                                scale16));
    }
#endif
#ifdef __AVX2__
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (; i + 8 <= head_dim; i += 8) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)(values + i));
        _mm256_storeu_ps(dst + i,
                         _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale8));
    }
#endif
    for (; i < head_dim; ++i) dst[i] = (float)values[i] * scale;
}

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
    int x_int8; /* int8 weights: x rounded to int8 blocks of 32 first, as int4's always is */
} kvgate_linear_weights;

/* y = x @ w^T + bias for m rows of x (element (i, j) at x[i * row_stride + j * col_stride],
 * of x_dtype) into out, column-major: out[r * m + i]. Returns 0, or 1 when out of memory.
 * Defined in cpu_linear.c. */
int kvgate_linear(const kvgate_linear_weights *w, const void *x, int x_dtype, int64_t row_stride,
                  int64_t col_stride, int64_t m, void *out, int out_dtype, int num_threads);

/* Defined in cpu_linear_columns.c (see there). */
void kvgate_columns_rows(const float *w, const float *x, float *out, int64_t n, int64_t k,
                         int64_t m);
int kvgate_linear_columns(const void *w, int bf16, const float *bias, const float *x, int64_t m,
                          int64_t n, int64_t k, float *out, int num_threads);
int kvgate_columns_takes_chunks(const kvgate_linear_weights *wt);
int kvgate_linear_columns_chunks(const kvgate_linear_weights *wt, const float *x, int64_t m,
                                 float *out, int num_threads);

/* Defined in cpu_linear.c (see there). */
int kvgate_linear_columns_quantized(const kvgate_linear_weights *wt, const float *x, int64_t m,
                                    float *out, int num_threads);

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
