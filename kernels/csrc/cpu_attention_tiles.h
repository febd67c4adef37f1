/*
 * The inner loops of paged attention for heads of 64 or 128 values, in AVX-512 registers (16
 * floats) or AVX2 ones (8), by the ISA level the file is compiled for (included by
 * cpu_attention.c; nothing here is exported). TILE_VL is the register's floats.
 *
 * Scores: a pass takes TILE_VL cached tokens (a tile) and one query head, accumulates each
 * token's products in its own register and folds the TILE_VL registers into one register of
 * TILE_VL sums (a transpose inside the additions: at AVX-512 45 shuffles and adds where 16
 * horizontal reductions take 128). The tile's rows stay in the L1 cache for the group's other query heads.
 * Values: each cached value row is loaded once for up to 4 (64 values) or 2 (128) query heads
 * at AVX-512 (one at AVX2, 16 registers), whose outputs stay in registers over the whole context.
 * Rows are read where they lie: float32 rows as they are; bfloat16 rows as pairs in 32-bit
 * lanes, the even element shifted up and the odd one masked (both exact float32 values), the
 * query's and output's elements deinterleaved to match; when every query value is a bfloat16
 * value (bfloat16 activations), bfloat16 key rows go through the AVX512-BF16 dot product where
 * the CPU has it, whose products are exact in float32 and whose sums are float32. The next
 * tile's rows are prefetched while the current one is used: a decode step streams the whole
 * cache.
 */
#ifndef KVGATE_CPU_ATTENTION_TILES_H
#define KVGATE_CPU_ATTENTION_TILES_H

#include <immintrin.h>
#include <stdint.h>

/* Tokens ahead of the one in use whose value rows are prefetched. */
#define PREFETCH_TOKENS 8

/* How a work item reads its cached rows, and the form its prepared query takes. */
enum {
    ROWS_F32,      /* float32 rows; query as is */
    ROWS_BF16,     /* bfloat16 rows widened in registers; query deinterleaved per 2 * TILE_VL */
    ROWS_BF16_DOT, /* bfloat16 rows, AVX512-BF16 dot products; query as packed bfloat16 */
};

/* ---- per register width: the operations below, and what needs its own intrinsics ---- */
#if KVGATE_ISA_LEVEL == 2
#define TILE_VL 16
#define VALUE_ACCUMULATORS 16 /* of the 32 registers */
typedef __m512 tvec;
typedef __m512i tveci;
#define tv_zero _mm512_setzero_ps
#define tv_load _mm512_loadu_ps
#define tv_store _mm512_storeu_ps
#define tv_loadi(p) _mm512_loadu_si512(p)
#define tv_mul _mm512_mul_ps
#define tv_fmadd _mm512_fmadd_ps
#define tv_set1 _mm512_set1_ps
#define tv_bits_ps _mm512_castsi512_ps
#define tv_slli _mm512_slli_epi32
#define tv_and_si _mm512_and_si512
#define tv_set1_epi32 _mm512_set1_epi32

/* Lane t of the result: the sum of the lanes of acc[t]. */
static inline __attribute__((always_inline)) __m512 sum_each_lane(const __m512 *acc) {
    __m512 pairs[8], quads[4], octets[2];
    for (int i = 0; i < 8; ++i) /* per 128-bit block: a0+a2, b0+b2, a1+a3, b1+b3 */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                                 _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    for (int i = 0; i < 4; ++i) { /* per block: the block's sums of 4 consecutive registers */
        const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i) /* blocks 0+1 and 2+3 of two quads */
        octets[i] = _mm512_add_ps(
            _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(octets[0], octets[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(octets[0], octets[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The first `count` lanes of v into dst. */
static inline void store_first(float *dst, __m512 v, int64_t count) {
    _mm512_mask_storeu_ps(dst, (__mmask16)((1u << count) - 1u), v);
}

/* 2 * TILE_VL consecutive values (low, then high) as their even ones and their odd ones. */
static inline void deinterleave(__m512 low, __m512 high, __m512 *even, __m512 *odd) {
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                            28, 30);
    *even = _mm512_permutex2var_ps(low, evens, high);
    *odd = _mm512_permutex2var_ps(low, _mm512_add_epi32(evens, _mm512_set1_epi32(1)), high);
}

/* deinterleave's inverse: even and odd values back into order, low then high. */
static inline void interleave(__m512 even, __m512 odd, __m512 *low, __m512 *high) {
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7,
                                            23);
    *low = _mm512_permutex2var_ps(even, first, odd);
    *high = _mm512_permutex2var_ps(even, _mm512_add_epi32(first, _mm512_set1_epi32(8)), odd);
}
#else
#define TILE_VL 8
#define VALUE_ACCUMULATORS 8 /* of the 16 registers */
typedef __m256 tvec;
typedef __m256i tveci;
#define tv_zero _mm256_setzero_ps
#define tv_load _mm256_loadu_ps
#define tv_store _mm256_storeu_ps
#define tv_loadi(p) _mm256_loadu_si256((const __m256i *)(p))
#define tv_mul _mm256_mul_ps
#define tv_fmadd _mm256_fmadd_ps
#define tv_set1 _mm256_set1_ps
#define tv_bits_ps _mm256_castsi256_ps
#define tv_slli _mm256_slli_epi32
#define tv_and_si _mm256_and_si256
#define tv_set1_epi32 _mm256_set1_epi32

static inline __attribute__((always_inline)) __m256 sum_each_lane(const __m256 *acc) {
    /* per 128-bit half: sums of lane pairs, then of quads, of registers 0-3 and 4-7 */
    const __m256 q0 =
        _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 q1 =
        _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20),
                         _mm256_permute2f128_ps(q0, q1, 0x31));
}

static inline void store_first(float *dst, __m256 v, int64_t count) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    memcpy(dst, lanes, sizeof(float) * (size_t)count);
}

static inline void deinterleave(__m256 low, __m256 high, __m256 *even, __m256 *odd) {
    /* per half: l0 l2 h0 h2 | l4 l6 h4 h6, then the 64-bit pairs into order */
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(low, high, _MM_SHUFFLE(2, 0, 2, 0))), 0xd8));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(low, high, _MM_SHUFFLE(3, 1, 3, 1))), 0xd8));
}

static inline void interleave(__m256 even, __m256 odd, __m256 *low, __m256 *high) {
    const __m256 first = _mm256_unpacklo_ps(even, odd), second = _mm256_unpackhi_ps(even, odd);
    *low = _mm256_permute2f128_ps(first, second, 0x20);
    *high = _mm256_permute2f128_ps(first, second, 0x31);
}
#endif

/* Cached tokens a score pass takes together, one lane each; query pieces of TILE_VL values. */
#define TILE_TOKENS TILE_VL
#define MAX_PIECES (128 / TILE_VL)

/* Lanes 0 .. TILE_VL - 1 of a bfloat16 pair register as float32: the even elements, then the
 * odd ones. */
static inline __attribute__((always_inline)) tvec even_bf16(tveci pairs) {
    return tv_bits_ps(tv_slli(pairs, 16));
}

static inline __attribute__((always_inline)) tvec odd_bf16(tveci pairs) {
    return tv_bits_ps(tv_and_si(pairs, tv_set1_epi32((int)0xffff0000u)));
}

/* Every query value of the group (n floats) is a bfloat16 value: its low 16 bits are zero. */
static inline int all_bf16_values(const float *q, int64_t n) {
    uint32_t low = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        memcpy(&bits, q + i, sizeof bits);
        low |= bits & 0xffffu;
    }
    return low == 0;
}

/* The group's query (n floats, n a multiple of 2 * TILE_VL) in the form `rows` reads: as it
 * is, each 2 * TILE_VL values' even ones then their odd ones, or packed bfloat16 (into the
 * first n / 2 floats). */
static inline void prepare_query(const float *q, int64_t n, int rows, float *prepared) {
    for (int64_t i = 0; i < n; i += 2 * TILE_VL) {
        const tvec low = tv_load(q + i), high = tv_load(q + i + TILE_VL);
        if (rows == ROWS_F32) {
            tv_store(prepared + i, low);
            tv_store(prepared + i + TILE_VL, high);
        } else if (rows == ROWS_BF16) {
            tvec even, odd;
            deinterleave(low, high, &even, &odd);
            tv_store(prepared + i, even);
            tv_store(prepared + i + TILE_VL, odd);
        } else {
#ifdef __AVX512BF16__
            _mm512_storeu_si512((uint16_t *)prepared + i,
                                (__m512i)_mm512_cvtne2ps_pbh(high, low));
#endif
        }
    }
}

/* The dot products of one prepared query head (d = TILE_VL * pieces values) with the tile's
 * TILE_TOKENS rows (at = where each starts; a part tile repeats its last row). */
static inline __attribute__((always_inline)) tvec tile_dots(const float *qp,
                                                           const char *const *at, int pieces,
                                                           int rows) {
    tvec acc[TILE_TOKENS], q[MAX_PIECES];
    for (int p = 0; p < pieces; ++p) q[p] = tv_load(qp + TILE_VL * p);
    for (int t = 0; t < TILE_TOKENS; ++t) {
        tvec a;
        if (rows == ROWS_F32) {
            const float *r = (const float *)at[t];
            a = tv_mul(q[0], tv_load(r));
            for (int p = 1; p < pieces; ++p) a = tv_fmadd(q[p], tv_load(r + TILE_VL * p), a);
        } else {
            const uint16_t *r = (const uint16_t *)at[t];
            a = tv_zero();
            for (int p = 0; p < pieces; p += 2) {
                const tveci x = tv_loadi(r + TILE_VL * p);
#ifdef __AVX512BF16__
                if (rows == ROWS_BF16_DOT) {
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_castps_si512(q[p / 2]), (__m512bh)x);
                    continue;
                }
#endif
                a = tv_fmadd(q[p], even_bf16(x), a);
                a = tv_fmadd(q[p + 1], odd_bf16(x), a);
            }
        }
        acc[t] = a;
    }
    return sum_each_lane(acc);
}

/* Prefetch the cache lines of rows tile[0 .. count) (row_bytes each, at k + slot * stride). */
static inline __attribute__((always_inline)) void prefetch_rows(const char *k, int64_t stride,
                                                               const int64_t *tile,
                                                               int64_t count, int64_t row_bytes) {
    for (int64_t t = 0; t < count; ++t)
        for (int64_t b = 0; b < row_bytes; b += 64)
            _mm_prefetch(k + tile[t] * stride + b, _MM_HINT_T0);
}

/*
 * scores[h * scores_stride + t] = scale * q_h . key t for the group's heads and the n tokens of
 * `slots` (key t at k + slots[t] * row elements of the format `rows` reads); qp: the prepared
 * query, TILE_VL * pieces values per head.
 */
static inline __attribute__((always_inline)) void score_tiles(
    const float *qp, const void *k, int64_t row, const int64_t *slots, int64_t n, int64_t group,
    float scale, float *scores, int64_t scores_stride, int pieces, int rows) {
    const int64_t element = rows == ROWS_F32 ? 4 : 2, d = TILE_VL * pieces;
    for (int64_t start = 0; start < n; start += TILE_TOKENS) {
        const int64_t count = n - start < TILE_TOKENS ? n - start : TILE_TOKENS;
        const int64_t ahead = n - start - count < TILE_TOKENS ? n - start - count : TILE_TOKENS;
        prefetch_rows(k, row * element, slots + start + count, ahead, d * element);
        const char *at[TILE_TOKENS];
        for (int t = 0; t < TILE_TOKENS; ++t)
            at[t] = (const char *)k + slots[start + (t < count ? t : count - 1)] * row * element;
        for (int64_t h = 0; h < group; ++h) {
            const float *qh = qp + h * (rows == ROWS_BF16_DOT ? d / 2 : d);
            const tvec dots = tile_dots(qh, at, pieces, rows);
            store_first(scores + h * scores_stride + start, tv_mul(tv_set1(scale), dots), count);
        }
    }
}

/*
 * out[h] = (accumulate ? out[h] : 0) + sum over t of weights[h * weights_stride + t] * value t,
 * for `heads` heads (out: heads * TILE_VL * pieces floats), over the n tokens of `slots` (value
 * t at v + slots[t] * row elements, float32 or bfloat16 as `rows` says; accumulate only for
 * float32).
 */
static inline __attribute__((always_inline)) void value_heads(
    const void *v, int64_t row, const int64_t *slots, int64_t n, const float *weights,
    int64_t weights_stride, float *out, int accumulate, int heads, int pieces, int rows) {
    const int64_t d = TILE_VL * pieces, element = rows == ROWS_F32 ? 4 : 2;
    tvec acc[4][MAX_PIECES], x[MAX_PIECES];
    for (int h = 0; h < heads; ++h)
        for (int p = 0; p < pieces; ++p)
            acc[h][p] = accumulate ? tv_load(out + h * d + TILE_VL * p) : tv_zero();
    for (int64_t t = 0; t < n; ++t) {
        if (t + PREFETCH_TOKENS < n)
            prefetch_rows(v, row * element, slots + t + PREFETCH_TOKENS, 1, d * element);
        if (rows == ROWS_F32) {
            const float *r = (const float *)v + slots[t] * row;
            for (int p = 0; p < pieces; ++p) x[p] = tv_load(r + TILE_VL * p);
        } else {
            const uint16_t *r = (const uint16_t *)v + slots[t] * row;
            for (int p = 0; p < pieces; p += 2) {
                const tveci pairs = tv_loadi(r + TILE_VL * p);
                x[p] = even_bf16(pairs);
                x[p + 1] = odd_bf16(pairs);
            }
        }
        for (int h = 0; h < heads; ++h) {
            const tvec w = tv_set1(weights[h * weights_stride + t]);
            for (int p = 0; p < pieces; ++p) acc[h][p] = tv_fmadd(w, x[p], acc[h][p]);
        }
    }
    for (int h = 0; h < heads; ++h)
        for (int p = 0; p < pieces; p += 2) {
            float *o = out + h * d + TILE_VL * p;
            tvec low = acc[h][p], high = acc[h][p + 1];
            if (rows != ROWS_F32) interleave(acc[h][p], acc[h][p + 1], &low, &high);
            tv_store(o, low);
            tv_store(o + TILE_VL, high);
        }
}

/* value_heads for every head of the group, VALUE_ACCUMULATORS / pieces heads at a time (at
 * least one, at most 4). */
static inline __attribute__((always_inline)) void value_tiles(
    const void *v, int64_t row, const int64_t *slots, int64_t n, const float *weights,
    int64_t weights_stride, int64_t group, float *out, int accumulate, int pieces, int rows) {
    const int64_t d = TILE_VL * pieces;
    const int64_t at_once = pieces < VALUE_ACCUMULATORS ? VALUE_ACCUMULATORS / pieces : 1;
    for (int64_t h = 0; h < group; h += at_once) {
        const float *w = weights + h * weights_stride;
        switch (group - h < at_once ? group - h : at_once) {
        case 1: value_heads(v, row, slots, n, w, weights_stride, out + h * d, accumulate, 1,
                            pieces, rows);
            break;
        case 2: value_heads(v, row, slots, n, w, weights_stride, out + h * d, accumulate, 2,
                            pieces, rows);
            break;
        case 3: value_heads(v, row, slots, n, w, weights_stride, out + h * d, accumulate, 3,
                            pieces, rows);
            break;
        default: value_heads(v, row, slots, n, w, weights_stride, out + h * d, accumulate, 4,
                             pieces, rows);
        }
    }
}

#endif
