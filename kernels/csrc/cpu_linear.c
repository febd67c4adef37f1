/*
 * Linear layers at small batch on the CPU: y = x @ w^T for a few rows of x, with w in float32,
 * bfloat16, int8 or int4 (weight-only quantized), reading every weight once per call.
 *
 * At decode batch sizes a linear layer is a matrix-vector product whose time is the time to
 * read the weights; these kernels keep the weights in their own format all the way into the
 * registers and multiply there, in float32 (bfloat16: AVX512-BF16 dot products, exact products
 * summed in float32, or widened exactly in the registers without them). Four weight rows and
 * up to four rows of x are done together, so each weight is loaded and converted once per four
 * rows of x. int8 weights are read a group at a time, the group's scale a vector constant,
 * never applied per weight. int4 weights meet x rounded to int8 blocks of 32 in integer
 * multiply-adds (cpu_int4.h: VNNI, or vpmaddubsw + vpmaddwd), each block's sums scaled once.
 * The same kernels run in AVX-512 registers (16 floats) or AVX2 ones (8), by the ISA level the
 * file is compiled for (kernels/cpu_build.py); the portable level multiplies one dequantized
 * weight row at a time. For larger batches the caller multiplies with torch instead, quantized
 * weights dequantized first (kvgate_dequantize).
 *
 * Quantized formats (kernels/quant.py):
 *   int8  q [n, k] int8, scales [n, k / group_size] float32: w = q * scale (per-channel:
 *         group_size = k).
 *   int4  q [n, k / 2] uint8; within each block of 32 weights of a row, byte j holds weight j in
 *         its low nibble and weight j + 16 in its high nibble (GGUF's Q4_0/Q4_1 layout);
 *         scales and zeros [n, k / group_size] float16: w = q * scale + zero, q in 0..15.
 *         group_size is a multiple of 32 and divides k.
 * x [m, k] has any strides and the activation dtype; it is copied into a dense float32 (or
 * bfloat16) scratch first, and for int4 weights rounded to int8 blocks (kernels/quant.py's
 * quantize_activations). out is column-major: out[r * m + i] is row i's output r, of
 * out_dtype (the activation dtype, or float32 for logits); the bias has the activation dtype.
 * The caller (kernels/cpu_linear.py) checks shapes, dtypes and strides.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if KVGATE_ISA_LEVEL >= 1
#include <immintrin.h>
#define KVGATE_VECTOR 1 /* the vector kernels below: AVX-512 or AVX2 registers */
#endif
#if KVGATE_ISA_LEVEL == 2
#define KVGATE_AVX512 1
#endif

#define ROW_BLOCK 4 /* weight rows per work item */
#define X_BLOCK 4   /* rows of x per pass over a work item's weights */
/* How far ahead of the weights being multiplied the quantized kernels ask for the next ones,
 * once per cache line: their rows are short (a few hundred bytes), too short for the hardware
 * prefetcher to reach full speed on each, but a thread's rows follow one another in memory.
 * At one stream of SmolLM2 with int8 weights, 8 KB ahead took the layers' weight reads from
 * 8.7 to 7.4 ms a step (median of 8 rounds) against 2 KB ahead with a prefetch per 16 bytes. */
#define PREFETCH_BYTES 8192

/* Copy x (m rows, k columns, element (i, j) at x[i * row_stride + j * col_stride] of x_dtype)
 * into dense row-major float32 (or bfloat16 when to_bf16) rows of `ld` elements, zero-padded. */
static void pack_x(const void *x, int x_dtype, int64_t row_stride, int64_t col_stride, int64_t m,
                   int64_t k, int64_t ld, int to_bf16, void *packed) {
    for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < ld; ++j) {
            const float v = j < k ? load_elem(x, x_dtype, i * row_stride + j * col_stride) : 0.0f;
            if (to_bf16)
                ((uint16_t *)packed)[i * ld + j] = f32_to_bf16(v);
            else
                ((float *)packed)[i * ld + j] = v;
        }
    }
}

/* What every kernel below needs besides its weights. */
struct int4_x;
struct q8_x;

typedef struct {
    const void *x; /* packed: [m, ld] float32 or bfloat16 */
    const struct int4_x *xq; /* int4 weights: x rounded to int8 blocks (cpu_int4.h) */
    const struct q8_x *x8;   /* int8 weights with x_int8: the same (cpu_int8_blocks.h) */
    int64_t m, k, ld, n;
    const void *bias;
    int bias_dtype;
    void *out;
    int out_dtype;
} linear_io;

static void write_out(const linear_io *io, int64_t row, int64_t i, float value) {
    if (io->bias != NULL) value += load_elem(io->bias, io->bias_dtype, row);
    store_elem(io->out, io->out_dtype, row * io->m + i, value);
}

#ifndef KVGATE_VECTOR
/* ---- portable version: one weight row against every row of x ---- */

static void row_generic(const linear_io *io, int64_t row, const float *w_row, float *xf) {
    for (int64_t i = 0; i < io->m; ++i) {
        const float *xi = xf + i * io->ld;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < io->k; ++j) sum += w_row[j] * xi[j];
        write_out(io, row, i, sum);
    }
}
#endif

#ifdef KVGATE_VECTOR
/* ---- ROW_BLOCK rows x up to X_BLOCK rows of x, VL weights at a time, in AVX-512 registers
 * (16 floats) or AVX2 ones (8) ---- */
#ifdef KVGATE_AVX512
typedef __m512 vecf;
#define VL 16
#define vzero _mm512_setzero_ps
#define vfmadd _mm512_fmadd_ps
#define vadd _mm512_add_ps
#define vmul _mm512_mul_ps
#define vset1 _mm512_set1_ps
#define vloadu _mm512_loadu_ps
#define vreduce _mm512_reduce_add_ps

static inline __mmask16 tail_mask16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

static inline __m512 int8_weights(const int8_t *p, __mmask16 mask) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
}

/* The next VL weights at p, of which `left` (when under VL) are the row's or group's: the
 * others read as zero, and nothing past them is read. */
static inline vecf f32_weights(const float *p, int64_t left) {
    return _mm512_maskz_loadu_ps(tail_mask16(left), p);
}

static inline vecf i8_weights(const int8_t *p, int64_t left) {
    return int8_weights(p, tail_mask16(left));
}

typedef __m512i veci;

/* VL bfloat16 weights widened exactly (the bits shifted into a float32's upper half). */
static inline vecf bf16_weights(const uint16_t *p, int64_t left) {
    const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail_mask16(left), p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}
#else
typedef __m256 vecf;
#define VL 8
#define vzero _mm256_setzero_ps
#define vfmadd _mm256_fmadd_ps
#define vadd _mm256_add_ps
#define vmul _mm256_mul_ps
#define vset1 _mm256_set1_ps
#define vloadu _mm256_loadu_ps

static inline float vreduce(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

/* As the AVX-512 versions: `left` (when under VL) weights are read, the others are zero. */
static inline vecf f32_weights(const float *p, int64_t left) {
    if (left >= VL) return _mm256_loadu_ps(p);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), lanes));
}

static inline vecf i8_weights(const int8_t *p, int64_t left) {
    if (left >= VL) /* one vpmovsxbd from memory */
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    int64_t bytes = 0;
    memcpy(&bytes, p, (size_t)left);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bytes)));
}

typedef __m256i veci;

static inline vecf bf16_weights(const uint16_t *p, int64_t left) {
    __m128i half = _mm_setzero_si128();
    if (left >= VL)
        half = _mm_loadu_si128((const __m128i *)p);
    else
        memcpy(&half, p, sizeof(uint16_t) * (size_t)left);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
#endif

/*
 * The kernels below keep ROW_BLOCK x X_BLOCK accumulators in named registers: a##r##i is
 * weight row r against x row i. R (rows) and M (x rows) are constants at every call
 * (vector_rows_of), so the unused ones and the branches on R and M compile away.
 */
#define DECLARE_ACCUMULATORS(r) \
    vecf a##r##0 = vzero(), a##r##1 = a##r##0, a##r##2 = a##r##0, a##r##3 = a##r##0

/* a##r##i += w * x##i for the M rows of x. */
#define ACCUMULATE(r, w, x)                                             \
    do {                                                                \
        a##r##0 = vfmadd(w, x##0, a##r##0);                    \
        if (M > 1) a##r##1 = vfmadd(w, x##1, a##r##1);         \
        if (M > 2) a##r##2 = vfmadd(w, x##2, a##r##2);         \
        if (M > 3) a##r##3 = vfmadd(w, x##3, a##r##3);         \
    } while (0)

/* Loads of x rows 0..M-1 at column j into x##name##i. */
#define LOAD_X(name, load, j)                                             \
    const vecf x##name##0 = load(x + (j));                              \
    const vecf x##name##1 = M > 1 ? load(x + io->ld + (j)) : x##name##0; \
    const vecf x##name##2 = M > 2 ? load(x + 2 * io->ld + (j)) : x##name##0; \
    const vecf x##name##3 = M > 3 ? load(x + 3 * io->ld + (j)) : x##name##0

#define WRITE_ROW(r, scale)                                                                  \
    do {                                                                                     \
        write_out(io, row0 + (r), i0, (scale) * vreduce(a##r##0));              \
        if (M > 1) write_out(io, row0 + (r), i0 + 1, (scale) * vreduce(a##r##1)); \
        if (M > 2) write_out(io, row0 + (r), i0 + 2, (scale) * vreduce(a##r##2)); \
        if (M > 3) write_out(io, row0 + (r), i0 + 3, (scale) * vreduce(a##r##3)); \
    } while (0)

#define DECLARE_ALL_ACCUMULATORS \
    DECLARE_ACCUMULATORS(0);     \
    DECLARE_ACCUMULATORS(1);     \
    DECLARE_ACCUMULATORS(2);     \
    DECLARE_ACCUMULATORS(3)

/* Writes every row's outputs, unscaled. */
#define UNSCALED_OUT(r) WRITE_ROW(r, 1.0f)

#define FOR_ROWS(STEP) \
    do {               \
        STEP(0);       \
        if (R > 1) {   \
            STEP(1);   \
            STEP(2);   \
            STEP(3);   \
        }              \
    } while (0)

/* name##r = vector_of_row(r) for rows row0 .. row0 + R - 1 (unused rows repeat row 0's). */
#define ROW_VECTORS(name, vector_of_row)                    \
    const vecf name##0 = vector_of_row(0);                \
    const vecf name##1 = R > 1 ? vector_of_row(1) : name##0; \
    const vecf name##2 = R > 1 ? vector_of_row(2) : name##0; \
    const vecf name##3 = R > 1 ? vector_of_row(3) : name##0

/* Features start .. end - 1, VL at a time: whole vectors by WHOLE(r) for every row (a constant
 * width, so the loads need no tail test and the accumulators stay in registers), then the last
 * part vector, if any, by TAIL(r). x##v##i holds x row i's features j .. j + VL - 1. */
#define WHOLE_VECTORS_THEN_TAIL(start, end, WHOLE, TAIL) \
    do {                                                 \
        int64_t j = start;                               \
        for (; j + VL <= (end); j += VL) {               \
            LOAD_X(v, vloadu, j);                        \
            FOR_ROWS(WHOLE);                             \
        }                                                \
        if (j < (end)) {                                 \
            LOAD_X(v, vloadu, j);                        \
            FOR_ROWS(TAIL);                              \
        }                                                \
    } while (0)

/*
 * int8 rows row0 .. row0 + R - 1 (R is 1 or ROW_BLOCK) against x rows i0 .. i0 + M - 1, a group
 * at a time (per-channel: one group of k), 16 weights at a time within it, so a vector never
 * spans two groups whatever the group size and the group's scale is one broadcast per row.
 */
static inline __attribute__((always_inline)) void int8_block(
    const linear_io *io, const int8_t *q, const float *scales, int64_t group_size, int64_t row0,
    const int R, int64_t i0, const int M) {
    const int64_t k = io->k, groups = k / group_size;
    const int per_channel = group_size == k;
    const float *x = (const float *)io->x + i0 * io->ld;
    DECLARE_ALL_ACCUMULATORS;
    for (int64_t g = 0; g < groups; ++g) {
#define GROUP_SCALE(r) vset1(scales[(row0 + (r)) * groups + g])
        ROW_VECTORS(s, GROUP_SCALE);
#undef GROUP_SCALE
        const int64_t end = (g + 1) * group_size;
#define INT8_ROW(r, left)                                                               \
            do {                                                                        \
                const int8_t *src = q + (row0 + (r)) * k + j;                           \
                if ((j & 63) < VL) /* once per 64 bytes, whatever the group size */     \
                    _mm_prefetch((const char *)src + PREFETCH_BYTES, _MM_HINT_T0);      \
                vecf w = i8_weights(src, left);                                         \
                if (!per_channel) w = vmul(w, s##r);                                    \
                ACCUMULATE(r, w, xv);                                                   \
            } while (0)
#define INT8_WHOLE(r) INT8_ROW(r, VL)
#define INT8_TAIL(r) INT8_ROW(r, end - j)
        WHOLE_VECTORS_THEN_TAIL(g * group_size, end, INT8_WHOLE, INT8_TAIL);
#undef INT8_ROW
#undef INT8_WHOLE
#undef INT8_TAIL
    }
#define INT8_OUT(r) WRITE_ROW(r, per_channel ? scales[row0 + (r)] : 1.0f)
    FOR_ROWS(INT8_OUT);
#undef INT8_OUT
}

/* float32 rows (bf16 0), or bfloat16 rows widened exactly in the registers (float32 sums of
 * exact products, where there is no AVX512-BF16 dot product), row0 .. row0 + R - 1 against
 * float32 x rows i0 .. i0 + M - 1. */
static inline __attribute__((always_inline)) void dense_block(
    const linear_io *io, const void *w, const int bf16, int64_t row0, const int R, int64_t i0,
    const int M) {
    const int64_t k = io->k;
    const float *x = (const float *)io->x + i0 * io->ld;
    DECLARE_ALL_ACCUMULATORS;
#define DENSE_ROW(r, left)                                                                  \
    do {                                                                                    \
        const int64_t at = (row0 + (r)) * k + j;                                            \
        const vecf wr = bf16 ? bf16_weights((const uint16_t *)w + at, left)                 \
                             : f32_weights((const float *)w + at, left);                    \
        ACCUMULATE(r, wr, xv);                                                              \
    } while (0)
#define DENSE_WHOLE(r) DENSE_ROW(r, VL)
#define DENSE_TAIL(r) DENSE_ROW(r, k - j)
    WHOLE_VECTORS_THEN_TAIL(0, k, DENSE_WHOLE, DENSE_TAIL);
#undef DENSE_ROW
#undef DENSE_WHOLE
#undef DENSE_TAIL
    FOR_ROWS(UNSCALED_OUT);
}

#ifdef __AVX512BF16__
static inline __m512 bf16_pairs(const uint16_t *p) { return (__m512)_mm512_loadu_si512(p); }

/* a##r##i += w . x##i over pairs of bfloat16 (exact products, float32 sums). */
#define DOT_BF16(r, w, x)                                                                     \
    do {                                                                                      \
        a##r##0 = _mm512_dpbf16_ps(a##r##0, (__m512bh)(w), (__m512bh)x##0);                   \
        if (M > 1) a##r##1 = _mm512_dpbf16_ps(a##r##1, (__m512bh)(w), (__m512bh)x##1);        \
        if (M > 2) a##r##2 = _mm512_dpbf16_ps(a##r##2, (__m512bh)(w), (__m512bh)x##2);        \
        if (M > 3) a##r##3 = _mm512_dpbf16_ps(a##r##3, (__m512bh)(w), (__m512bh)x##3);        \
    } while (0)

/* bfloat16 rows against bfloat16 x rows: pairs of exact products summed in float32. */
static inline __attribute__((always_inline)) void bf16_block(
    const linear_io *io, const uint16_t *w, int64_t row0, const int R, int64_t i0, const int M) {
    const int64_t k = io->k;
    const uint16_t *x = (const uint16_t *)io->x + i0 * io->ld;
    DECLARE_ALL_ACCUMULATORS;
    for (int64_t j = 0; j < k; j += 32) {
        const int64_t left = k - j;
        const __mmask32 mask = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1u);
        LOAD_X(v, bf16_pairs, j);
#define BF16_ROW(r)                                                                         \
        do {                                                                                \
            const __m512i wr = _mm512_maskz_loadu_epi16(mask, w + (row0 + (r)) * k + j);    \
            DOT_BF16(r, wr, xv);                                                            \
        } while (0)
        FOR_ROWS(BF16_ROW);
#undef BF16_ROW
    }
    FOR_ROWS(UNSCALED_OUT);
}
#define KVGATE_BF16_DOT 1
#endif
#endif

#include "cpu_int4.h"
#include "cpu_int8_blocks.h"

typedef kvgate_linear_weights weights;

/* Row `row` of the weights as float32 into w_row (the portable path and dequantization). */
static void dequantize_row(const weights *wt, int64_t row, int64_t k, float *w_row) {
    if (wt->kind == KVGATE_W_F32 || wt->kind == KVGATE_W_BF16) {
        const int dtype = wt->kind == KVGATE_W_F32 ? KVGATE_F32 : KVGATE_BF16;
        load_row((const char *)wt->q + row * k * dtype_size(dtype), dtype, k, w_row);
        return;
    }
    const int64_t groups = k / wt->group_size, size = wt->group_size;
    if (wt->kind == KVGATE_W_INT8) { /* a group at a time: loops the compiler vectorizes */
        const int8_t *q = (const int8_t *)wt->q + row * k;
        for (int64_t g = 0; g < groups; ++g) {
            const float scale = ((const float *)wt->scales)[row * groups + g];
            for (int64_t j = g * size; j < (g + 1) * size; ++j) w_row[j] = (float)q[j] * scale;
        }
        return;
    }
    const uint8_t *q = (const uint8_t *)wt->q + row * (k / 2);
    for (int64_t b = 0; b < k; b += 32) { /* a block of 32 weights in 16 bytes */
        const int64_t g = row * groups + b / size;
        const float scale = f16_to_f32(((const uint16_t *)wt->scales)[g]);
        const float zero = f16_to_f32(((const uint16_t *)wt->zeros)[g]);
        for (int j = 0; j < 16; ++j) {
            w_row[b + j] = (float)(q[b / 2 + j] & 15) * scale + zero;
            w_row[b + j + 16] = (float)(q[b / 2 + j] >> 4) * scale + zero;
        }
    }
}

#ifdef KVGATE_AVX512
/* dequantize_row for int8 and int4, 16 weights at a time. */
static void dequantize_row_vector(const weights *wt, int64_t row, int64_t k, float *w_row) {
    const int64_t groups = k / wt->group_size;
    if (wt->kind == KVGATE_W_INT8) {
        const int8_t *q = (const int8_t *)wt->q + row * k;
        const float *scales = (const float *)wt->scales + row * groups;
        for (int64_t g = 0; g < groups; ++g) {  /* each vector stops at its group's end */
            const __m512 scale = _mm512_set1_ps(scales[g]);
            const int64_t end = (g + 1) * wt->group_size;
            for (int64_t j = g * wt->group_size; j < end; j += 16) {
                const __mmask16 mask = tail_mask16(end - j);
                _mm512_mask_storeu_ps(w_row + j, mask, _mm512_mul_ps(int8_weights(q + j, mask), scale));
            }
        }
        return;
    }
    const uint8_t *q = (const uint8_t *)wt->q + row * (k / 2);
    const uint16_t *scales = (const uint16_t *)wt->scales + row * groups;
    const uint16_t *zeros = (const uint16_t *)wt->zeros + row * groups;
    const __m512i low_nibble = _mm512_set1_epi32(15);
    for (int64_t j = 0; j < k; j += 32) {
        const int64_t g = j / wt->group_size;
        const __m512 scale = _mm512_set1_ps(_cvtsh_ss(scales[g]));
        const __m512 zero = _mm512_set1_ps(_cvtsh_ss(zeros[g]));
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j / 2)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low_nibble));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        _mm512_storeu_ps(w_row + j, _mm512_fmadd_ps(lo, scale, zero));
        _mm512_storeu_ps(w_row + j + 16, _mm512_fmadd_ps(hi, scale, zero));
    }
}

/* n float32 values into dst of `dtype`, bfloat16 rounded to nearest even as f32_to_bf16. */
static void store_row_vector(const float *src, int64_t n, void *dst, int dtype) {
    if (dtype == KVGATE_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    const __m512i rounding = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), infinity = _mm512_set1_epi32(0x7f800000);
    const __m512i quiet_nan = _mm512_set1_epi32(0x7fc0);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 mask = tail_mask16(n - j);
        const __m512i bits = _mm512_castps_si512(_mm512_maskz_loadu_ps(mask, src + j));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
        __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(rounding, odd)), 16);
        const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, magnitude), infinity);
        rounded = _mm512_mask_mov_epi32(rounded, nan, quiet_nan);
        _mm256_mask_storeu_epi16((uint16_t *)dst + j, mask, _mm512_cvtepi32_epi16(rounded));
    }
}
#endif

#ifdef KVGATE_VECTOR
/* One (R, M) instance of the kernel of `wt`'s kind, with R and M constants. */
#define KVGATE_BLOCK(R, M)                                                                  \
    do {                                                                                    \
        if (wt->kind == KVGATE_W_INT8 && wt->x_int8)                                        \
            q8_block(io, wt->q, wt->scales, wt->group_size, row0, R, i0, M);                \
        else if (wt->kind == KVGATE_W_INT8)                                                 \
            int8_block(io, wt->q, wt->scales, wt->group_size, row0, R, i0, M);              \
        else if (wt->kind == KVGATE_W_INT4)                                                 \
            INT4_BLOCK(R, M);                                                               \
        else if (wt->kind == KVGATE_W_F32)                                                  \
            dense_block(io, wt->q, 0, row0, R, i0, M);                                           \
        else                                                                                \
            BF16_BLOCK(R, M);                                                               \
    } while (0)
#ifdef KVGATE_BF16_DOT
#define BF16_BLOCK(R, M) bf16_block(io, wt->q, row0, R, i0, M)
#else
#define BF16_BLOCK(R, M) dense_block(io, wt->q, 1, row0, R, i0, M)
#endif
#define INT4_BLOCK(R, M) int4_block(io, wt->q, wt->scales, wt->zeros, wt->group_size, row0, R, i0, M)

static void vector_rows_of(const linear_io *io, const weights *wt, int64_t row0, int64_t i0,
                           int R, int M) {
    if (R == ROW_BLOCK) {
        switch (M) {
            case 1: KVGATE_BLOCK(ROW_BLOCK, 1); break;
            case 2: KVGATE_BLOCK(ROW_BLOCK, 2); break;
            case 3: KVGATE_BLOCK(ROW_BLOCK, 3); break;
            default: KVGATE_BLOCK(ROW_BLOCK, 4); break;
        }
        return;
    }
    switch (M) {
        case 1: KVGATE_BLOCK(1, 1); break;
        case 2: KVGATE_BLOCK(1, 2); break;
        case 3: KVGATE_BLOCK(1, 3); break;
        default: KVGATE_BLOCK(1, 4); break;
    }
}

static void vector_rows(const linear_io *io, const weights *wt, int64_t row0, int R) {
    for (int64_t i0 = 0; i0 < io->m; i0 += X_BLOCK) {
        const int M = io->m - i0 < X_BLOCK ? (int)(io->m - i0) : X_BLOCK;
        vector_rows_of(io, wt, row0, i0, R, M);
    }
}
#endif

static void run_rows(const linear_io *io, const weights *wt, int64_t row0, int R, float *w_row) {
#ifdef KVGATE_VECTOR /* every kind has a vector kernel at the AVX-512 and AVX2 levels */
    (void)w_row;
    vector_rows(io, wt, row0, R);
#else
    for (int r = 0; r < R; ++r) {
        dequantize_row(wt, row0 + r, io->k, w_row);
        row_generic(io, row0 + r, w_row, (float *)io->x);
    }
#endif
}

/* Zero elements after the packed x rows (see kvgate_linear). */
#define X_TAIL 16

/* Whether the bfloat16 kernel multiplies bfloat16 x directly (else x is packed as float32). */
static int packs_bf16(int kind) {
#ifdef KVGATE_BF16_DOT
    return kind == KVGATE_W_BF16;
#else
    (void)kind;
    return 0;
#endif
}

int kvgate_linear(const weights *wt, const void *x, int x_dtype, int64_t row_stride,
                  int64_t col_stride, int64_t m, void *out, int out_dtype, int num_threads) {
    const int64_t k = wt->in_features, n = wt->out_features, ld = (k + 31) / 32 * 32;
    const int to_bf16 = packs_bf16(wt->kind);
    /* A 16-wide load that starts inside an int8 group of a size no multiple of 16 reads up to
     * 15 elements past the group's end: in the last row, past the packed rows, into X_TAIL zeros
     * (the weights there are masked to zero, but 0 * NaN from stray memory is NaN). */
    const size_t elem = to_bf16 ? 2 : 4, bytes = (size_t)(m * ld) * elem;
    const size_t int4_bytes = INT4_X_BYTES(wt->kind, m, k) + Q8_X_BYTES(wt, m, k);
    char *packed = malloc(bytes + X_TAIL * elem + int4_bytes);
    if (packed == NULL) return 1;
    memset(packed + bytes, 0, X_TAIL * elem + int4_bytes);
    pack_x(x, x_dtype, row_stride, col_stride, m, k, ld, to_bf16, packed);
    linear_io io = {packed, NULL, NULL, m, k, ld, n, wt->bias, x_dtype, out, out_dtype};
    const int rounds_x = wt->kind == KVGATE_W_INT4 || (wt->kind == KVGATE_W_INT8 && wt->x_int8);
#ifdef KVGATE_INT4_INTEGER
    int4_x xq;
    if (wt->kind == KVGATE_W_INT4) {
        xq = int4_x_layout(packed + bytes + X_TAIL * elem, m, k);
        quantize_x((const float *)packed, m, k, ld, &xq);
        io.xq = &xq;
    }
    q8_x x8;
    if (rounds_x && wt->kind == KVGATE_W_INT8) {
        x8 = q8_quantize_x((const float *)packed, m, k, ld, packed + bytes + X_TAIL * elem);
        io.x8 = &x8;
    }
#else
    if (rounds_x) round_x_blocks((float *)packed, m, k, ld);
#endif
    const int64_t blocks = (n + ROW_BLOCK - 1) / ROW_BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *w_row = malloc(sizeof(float) * (size_t)k);
        if (w_row == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            if (w_row == NULL) continue;
            const int64_t row0 = b * ROW_BLOCK;
            const int R = n - row0 < ROW_BLOCK ? (int)(n - row0) : ROW_BLOCK;
            if (R == ROW_BLOCK && !reads_rows_in_turn(wt, m))
                run_rows(&io, wt, row0, ROW_BLOCK, w_row);
            else
                for (int r = 0; r < R; ++r) run_rows(&io, wt, row0 + r, 1, w_row);
        }
        free(w_row);
    }
    free(packed);
    return failed;
}

/* Rows row0 .. row0 + count - 1 of the weights as dense [count, in_features] of out_dtype.
 * Returns 0, or 1 when out of memory. */
int kvgate_dequantize(const weights *wt, int64_t row0, int64_t count, void *out, int out_dtype,
                      int num_threads) {
    const int64_t k = wt->in_features;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *w_row = malloc(sizeof(float) * (size_t)k);
        if (w_row == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < count; ++r) {
            if (w_row == NULL) continue;
            void *dst = (char *)out + r * k * dtype_size(out_dtype);
#ifdef KVGATE_AVX512
            if (wt->kind == KVGATE_W_INT8 || wt->kind == KVGATE_W_INT4) {
                dequantize_row_vector(wt, row0 + r, k, w_row);
                store_row_vector(w_row, k, dst, out_dtype);
                continue;
            }
#endif
            dequantize_row(wt, row0 + r, k, w_row);
            store_row(dst, out_dtype, w_row, k);
        }
        free(w_row);
    }
    return failed;
}

/* Weight rows a thread dequantizes at a time for kvgate_linear_columns_quantized's int8 layers
 * in groups that are no multiple of 16: 8 blocks of the outer-product kernel, 48 x k floats
 * (288 KB at k = 1536: the L2 cache). */
#define COLUMNS_QUANTIZED_ROWS 48

/*
 * out = w @ x^T for int8 or int4 weights and m (1 .. 64) rows of float32 x, given as x^T: dense
 * [k, m] (for int4 rounded here to its rows' int8 blocks, kernels/quant.py's
 * round_activations). int8 in groups of a multiple of 16 and int4 run the outer-product kernel
 * with each block's chunk dequantized into the L1 cache (kvgate_linear_columns_chunks,
 * cpu_linear_columns.c); int8 in other groups dequantizes a slice of weight rows to
 * float32 into a thread's buffer, then runs the kernel over it. out: [n, m]. Returns 0, 1 when
 * out of memory, 2 when the weights are not int8 or int4 or m is out of range.
 */
int kvgate_linear_columns_quantized(const weights *wt, const float *x, int64_t m, float *out,
                                    int num_threads) {
    if (wt->kind != KVGATE_W_INT8 && wt->kind != KVGATE_W_INT4) return 2;
    const int64_t k = wt->in_features, n = wt->out_features;
    if (wt->kind == KVGATE_W_INT4 || wt->x_int8) {
        float *rounded = malloc(sizeof(float) * (size_t)(k * m));
        if (rounded == NULL) return 1;
        round_x_columns(x, k, m, rounded);
        /* int8: the weight-only paths below over the rounded x */
        const kvgate_linear_weights weight_only = {wt->kind, wt->q, wt->scales, wt->zeros,
                                                   wt->bias, wt->group_size, n, k, 0};
        const int failed = wt->kind == KVGATE_W_INT4
            ? kvgate_linear_columns_chunks(wt, rounded, m, out, num_threads)
            : kvgate_linear_columns_quantized(&weight_only, rounded, m, out, num_threads);
        free(rounded);
        return failed;
    }
    if (kvgate_columns_takes_chunks(wt))
        return kvgate_linear_columns_chunks(wt, x, m, out, num_threads);
    const int64_t slices = (n + COLUMNS_QUANTIZED_ROWS - 1) / COLUMNS_QUANTIZED_ROWS;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *rows = malloc(sizeof(float) * (size_t)(COLUMNS_QUANTIZED_ROWS * k));
        if (rows == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t s = 0; s < slices; ++s) {
            if (rows == NULL) continue;
            const int64_t row0 = s * COLUMNS_QUANTIZED_ROWS;
            const int64_t count =
                n - row0 < COLUMNS_QUANTIZED_ROWS ? n - row0 : COLUMNS_QUANTIZED_ROWS;
            for (int64_t r = 0; r < count; ++r)
#ifdef KVGATE_AVX512
                dequantize_row_vector(wt, row0 + r, k, rows + r * k);
#else
                dequantize_row(wt, row0 + r, k, rows + r * k);
#endif
            kvgate_columns_rows(rows, x, out + row0 * m, count, k, m);
        }
        free(rows);
    }
    return failed;
}

/* Whether the small-batch int8 kernel of weights with x_int8 sums its blocks in integer
 * multiply-adds (cpu_int8_blocks.h: every level but the portable one; the kernel tests check
 * it). */
int kvgate_int8_integer_built(void) {
#ifdef KVGATE_INT8_INTEGER
    return 1;
#else
    return 0;
#endif
}

/* Whether the small-batch int4 kernel sums its blocks in integer multiply-adds (cpu_int4.h:
 * every level but the portable one; the kernel tests check it). */
int kvgate_int4_integer_built(void) {
#ifdef KVGATE_INT4_INTEGER
    return 1;
#else
    return 0;
#endif
}
