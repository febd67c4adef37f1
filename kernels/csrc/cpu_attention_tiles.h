/*
 * The inner loops of paged attention for heads of 64 or 128 values, in AVX-512 registers
 * (included by cpu_attention.c; nothing here is exported).
 *
 * Scores: a pass takes 16 cached tokens (a tile) and one query head, accumulates each token's
 * products in its own register and folds the 16 registers into one register of 16 sums (a
 * transpose inside the additions: 45 shuffles and adds where 16 horizontal reductions take
 * 128). The tile's rows stay in the L1 cache for the group's other query heads.
 * Values: each cached value row is loaded once for up to 4 (64 values) or 2 (128) query heads,
 * whose outputs stay in registers over the whole context.
 * Rows are read where they lie: float32 rows as they are; bfloat16 rows as pairs in 32-bit
 * lanes, the even element shifted up and the odd one masked (both exact float32 values), the
 * query's and output's elements deinterleaved to match; when every query value is a bfloat16
 * value (bfloat16 activations), bfloat16 key rows go through the AVX512-BF16 dot product,
 * whose products are exact in float32 and whose sums are float32. The next tile's rows are
 * prefetched while the current one is used: a decode step streams the whole cache.
 */
#ifndef KVGATE_CPU_ATTENTION_TILES_H
#define KVGATE_CPU_ATTENTION_TILES_H

#include <immintrin.h>
#include <stdint.h>

/* Cached tokens a score pass takes together, one lane each. */
#define TILE_TOKENS 16
/* Tokens ahead of the one in use whose value rows are prefetched. */
#define PREFETCH_TOKENS 8

/* How a work item reads its cached rows, and the form its prepared query takes. */
enum {
    ROWS_F32,      /* float32 rows; query as is */
    ROWS_BF16,     /* bfloat16 rows widened in registers; query deinterleaved per 32 values */
    ROWS_BF16_DOT, /* bfloat16 rows, AVX512-BF16 dot products; query as packed bfloat16 */
};

/* Lane t of the result: the sum of the lanes of acc[t]. */
static inline __attribute__((always_inline)) __m512 sum_each_of_16(const __m512 *acc) {
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

/* Lanes 0-15 of a bfloat16 pair register as float32: the even elements, then the odd ones. */
static inline __attribute__((always_inline)) __m512 even_bf16(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}

static inline __attribute__((always_inline)) __m512 odd_bf16(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
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

/* The group's query (n floats, n a multiple of 32) in the form `rows` reads: as it is, each 32
 * values' 16 even ones then 16 odd ones, or packed bfloat16 (into the first n / 2 floats). */
static inline void prepare_query(const float *q, int64_t n, int rows, float *prepared) {
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                            28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    for (int64_t i = 0; i < n; i += 32) {
        const __m512 low = _mm512_loadu_ps(q + i), high = _mm512_loadu_ps(q + i + 16);
        if (rows == ROWS_F32) {
            _mm512_storeu_ps(prepared + i, low);
            _mm512_storeu_ps(prepared + i + 16, high);
        } else if (rows == ROWS_BF16) {
            _mm512_storeu_ps(prepared + i, _mm512_permutex2var_ps(low, evens, high));
            _mm512_storeu_ps(prepared + i + 16, _mm512_permutex2var_ps(low, odds, high));
        } else {
#ifdef __AVX512BF16__
            _mm512_storeu_si512((uint16_t *)prepared + i,
                                (__m512i)_mm512_cvtne2ps_pbh(high, low));
#endif
        }
    }
}

/* The dot products of one prepared query head (d = 16 * pieces values) with the tile's 16
 * rows (at = where each starts; a part tile repeats its last row). */
static inline __attribute__((always_inline)) __m512 tile_dots(const float *qp,
                                                             const char *const *at, int pieces,
                                                             int rows) {
    __m512 acc[TILE_TOKENS], q[8];
    for (int p = 0; p < pieces; ++p) q[p] = _mm512_loadu_ps(qp + 16 * p);
    for (int t = 0; t < TILE_TOKENS; ++t) {
        __m512 a;
        if (rows == ROWS_F32) {
            const float *r = (const float *)at[t];
            a = _mm512_mul_ps(q[0], _mm512_loadu_ps(r));
            for (int p = 1; p < pieces; ++p)
                a = _mm512_fmadd_ps(q[p], _mm512_loadu_ps(r + 16 * p), a);
        } else {
            const uint16_t *r = (const uint16_t *)at[t];
            a = _mm512_setzero_ps();
            for (int p = 0; p < pieces; p += 2) {
                const __m512i x = _mm512_loadu_si512(r + 16 * p);
#ifdef __AVX512BF16__
                if (rows == ROWS_BF16_DOT) {
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_castps_si512(q[p / 2]), (__m512bh)x);
                    continue;
                }
#endif
                a = _mm512_fmadd_ps(q[p], even_bf16(x), a);
                a = _mm512_fmadd_ps(q[p + 1], odd_bf16(x), a);
            }
        }
        acc[t] = a;
    }
    return sum_each_of_16(acc);
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
 * query, 16 * pieces values per head.
 */
static inline __attribute__((always_inline)) void score_tiles(
    const float *qp, const void *k, int64_t row, const int64_t *slots, int64_t n, int64_t group,
    float scale, float *scores, int64_t scores_stride, int pieces, int rows) {
    const int64_t element = rows == ROWS_F32 ? 4 : 2, d = 16 * pieces;
    for (int64_t start = 0; start < n; start += TILE_TOKENS) {
        const int64_t count = n - start < TILE_TOKENS ? n - start : TILE_TOKENS;
        const int64_t ahead = n - start - count < TILE_TOKENS ? n - start - count : TILE_TOKENS;
        prefetch_rows(k, row * element, slots + start + count, ahead, d * element);
        const __mmask16 lanes = (__mmask16)((1u << count) - 1u);
        const char *at[TILE_TOKENS];
        for (int t = 0; t < TILE_TOKENS; ++t)
            at[t] = (const char *)k + slots[start + (t < count ? t : count - 1)] * row * element;
        for (int64_t h = 0; h < group; ++h) {
            const float *qh = qp + h * (rows == ROWS_BF16_DOT ? d / 2 : d);
            const __m512 dots = tile_dots(qh, at, pieces, rows);
            _mm512_mask_storeu_ps(scores + h * scores_stride + start, lanes,
                                  _mm512_mul_ps(_mm512_set1_ps(scale), dots));
        }
    }
}

/*
 * out[h] = (accumulate ? out[h] : 0) + sum over t of weights[h * weights_stride + t] * value t,
 * for `heads` heads (out: heads * 16 * pieces floats), over the n tokens of `slots` (value t at
 * v + slots[t] * row elements, float32 or bfloat16 as `rows` says; accumulate only for float32).
 */
static inline __attribute__((always_inline)) void value_heads(
    const void *v, int64_t row, const int64_t *slots, int64_t n, const float *weights,
    int64_t weights_stride, float *out, int accumulate, int heads, int pieces, int rows) {
    const int64_t d = 16 * pieces, element = rows == ROWS_F32 ? 4 : 2;
    __m512 acc[4][8], x[8];
    for (int h = 0; h < heads; ++h)
        for (int p = 0; p < pieces; ++p)
            acc[h][p] = accumulate ? _mm512_loadu_ps(out + h * d + 16 * p) : _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
        if (t + PREFETCH_TOKENS < n)
            prefetch_rows(v, row * element, slots + t + PREFETCH_TOKENS, 1, d * element);
        if (rows == ROWS_F32) {
            const float *r = (const float *)v + slots[t] * row;
            for (int p = 0; p < pieces; ++p) x[p] = _mm512_loadu_ps(r + 16 * p);
        } else {
            const uint16_t *r = (const uint16_t *)v + slots[t] * row;
            for (int p = 0; p < pieces; p += 2) {
                const __m512i pairs = _mm512_loadu_si512(r + 16 * p);
                x[p] = even_bf16(pairs);
                x[p + 1] = odd_bf16(pairs);
            }
        }
        for (int h = 0; h < heads; ++h) {
            const __m512 w = _mm512_set1_ps(weights[h * weights_stride + t]);
            for (int p = 0; p < pieces; ++p) acc[h][p] = _mm512_fmadd_ps(w, x[p], acc[h][p]);
        }
    }
    const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
    for (int h = 0; h < heads; ++h)
        for (int p = 0; p < pieces; p += 2) {
            float *o = out + h * d + 16 * p;
            if (rows == ROWS_F32) {
                _mm512_storeu_ps(o, acc[h][p]);
                _mm512_storeu_ps(o + 16, acc[h][p + 1]);
            } else { /* even and odd lanes back into order */
                _mm512_storeu_ps(o, _mm512_permutex2var_ps(acc[h][p], low, acc[h][p + 1]));
                _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(acc[h][p], high, acc[h][p + 1]));
            }
        }
}

/* value_heads for every head of the group, 64 / (4 * pieces) heads at a time. */
static inline __attribute__((always_inline)) void value_tiles(
    const void *v, int64_t row, const int64_t *slots, int64_t n, const float *weights,
    int64_t weights_stride, int64_t group, float *out, int accumulate, int pieces, int rows) {
    const int64_t at_once = 16 / pieces, d = 16 * pieces;
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
