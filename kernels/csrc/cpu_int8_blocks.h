/*
 * int8 weights against activations rounded to int8 (cpu_linear.c's small-batch int8 kernel,
 * for weights whose x_int8 is set: kernels/quant.py's QuantizedWeight.int8_activations).
 *
 * Each row of x is rounded to int8 in blocks of 32 values exactly as for int4 weights
 * (cpu_int4.h's round_x_block / round_block_codes: kernels/quant.py's quantize_activations,
 * llama.cpp's Q8_0 blocks), so that a block of 32 weights meets its 32 x values in integer
 * multiply-adds. Both sides are signed: the weights' absolute values are the unsigned operand
 * and x takes the weight's sign (llama.cpp's sign trick), so |w| * (sign(w) x) = w x. VNNI's
 * vpdpbusd adds each 4 byte products into a 32-bit lane; without it (the AVX2 level, AVX-512
 * CPUs before VNNI) vpmaddubsw adds each 2 into a 16-bit lane (at most 2 * 128 * 127 = 32512,
 * exact) and vpmaddwd each 2 of those into a 32-bit lane: the same 32-bit sums. With w = q *
 * scale (the row's or the group's; groups are whole blocks), a block's share of an output is
 *     sum_j w_j x_j = scale * dx * sum_j q_j qx_j,
 * an exact integer sum times x's block scale (in float32 lanes, summed over the blocks) and the
 * weight's scale (per channel: once, on the finished sum; per group: with x's).
 *
 * Quantized x, per row: q [k] int8 (the row's values in order; a vector of weights, 32 bytes at
 * AVX2 or 64 at AVX-512, lines up with the same features of x), and lanes [k / 32 * 8] float32,
 * block b's dx in lanes 8 b .. 8 b + 7: the 8 lanes into which the dot product sums its block.
 */
#ifndef KVGATE_CPU_INT8_BLOCKS_H
#define KVGATE_CPU_INT8_BLOCKS_H

/* Whether the weight rows are read one after the other (each one's ROW_BLOCK-row work item a
 * row at a time) rather than ROW_BLOCK rows side by side: the integer int8 kernel against one
 * row of x. Side by side, 4 rows of a few hundred bytes read from memory at half the rate of
 * one row at a time (SmolLM2's 49152 x 576 int8 output layer at AVX2: 3.3-3.6 against 1.7-1.8
 * ms, one thread), and the integer kernel's one chain of float32 multiply-adds (one per 32 or
 * 64 weights) keeps up with the memory; the weight-only int8 kernel's (one per 8 or 16) would
 * not. */
static inline int reads_rows_in_turn(const kvgate_linear_weights *wt, int64_t m) {
    return m == 1 && wt->kind == KVGATE_W_INT8 && wt->x_int8;
}

#ifdef KVGATE_VECTOR
#define KVGATE_INT8_INTEGER 1
#define Q8_LANES 8 /* 32-bit lanes of sums per block of 32 bytes */

typedef struct q8_x {
    int8_t *q;    /* [m, k] */
    float *lanes; /* [m, k / 32 * Q8_LANES] */
} q8_x;

/* Bytes of the quantized x of m rows of k values (q, then lanes). */
static inline size_t q8_x_bytes(int64_t m, int64_t k) {
    return (size_t)(m * k) + sizeof(float) * (size_t)(m * (k / 32) * Q8_LANES);
}

/* m dense float32 rows of ld (>= k, k a multiple of 32) rounded into x's arrays, cut from
 * `memory` (q8_x_bytes(m, k), aligned for floats). */
static q8_x q8_quantize_x(const float *xf, int64_t m, int64_t k, int64_t ld, char *memory) {
    const int64_t blocks = k / 32;
    q8_x x = {(int8_t *)(memory + sizeof(float) * (size_t)(m * blocks * Q8_LANES)),
              (float *)memory};
    for (int64_t i = 0; i < m; ++i) {
        for (int64_t b = 0; b < blocks; ++b) {
            int8_t *q = x.q + i * k + 32 * b;
#ifdef KVGATE_AVX512
            __m512i q_lo, q_hi;
            const float scale = round_x_block(xf + i * ld + 32 * b, &q_lo, &q_hi);
            _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q_lo));
            _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(q_hi));
#else
            const float scale = round_block_codes(xf + i * ld + 32 * b, 1, q);
#endif
            for (int lane = 0; lane < Q8_LANES; ++lane)
                x.lanes[(i * blocks + b) * Q8_LANES + lane] = scale;
        }
    }
    return x;
}

/* ---- per register width: Q8_BLOCKS blocks of 32 bytes to a vector ---- */
#ifdef KVGATE_AVX512
#define Q8_BLOCKS 2
typedef __mmask64 q8_signs; /* the weights' signs, as x takes them */

/* The bytes of blocks b, b + 1 at p (zero past `left` blocks: nothing past them is read). */
static inline __m512i q8_bytes(const int8_t *p, int64_t left) {
    return _mm512_maskz_loadu_epi8(left >= 2 ? ~(__mmask64)0 : (__mmask64)0xffffffffu, p);
}

/* x's scale lanes of blocks b, b + 1 (zero past `left` blocks). */
static inline __m512 q8_lanes(const float *p, int64_t left) {
    return _mm512_maskz_loadu_ps(left >= 2 ? (__mmask16)0xffff : (__mmask16)0xff, p);
}

static inline q8_signs q8_signs_of(__m512i w) { return _mm512_movepi8_mask(w); }

/* The 32-bit lane sums of |w| times x with w's signs (each lane: 4 products). */
static inline __m512i q8_dot(__m512i w_abs, q8_signs negative, __m512i x) {
    const __m512i signed_x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w_abs, signed_x);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(w_abs, signed_x), _mm512_set1_epi16(1));
#endif
}

/* The group scales of blocks b, b + 1 of a weight row, each in its block's 8 lanes. */
static inline __m512 q8_group_lanes(const float *row_scales, int64_t b, int64_t group_size,
                                    int64_t left) {
    const __m512 first = _mm512_set1_ps(row_scales[b * 32 / group_size]);
    if (left < 2) return first;
    return _mm512_mask_blend_ps((__mmask16)0xff00, first,
                                _mm512_set1_ps(row_scales[(b + 1) * 32 / group_size]));
}
#define vabs_epi8 _mm512_abs_epi8
#else
#define Q8_BLOCKS 1
typedef __m256i q8_signs;

static inline __m256i q8_bytes(const int8_t *p, int64_t left) {
    (void)left; /* a vector is one whole block */
    return _mm256_loadu_si256((const __m256i *)p);
}

static inline __m256 q8_lanes(const float *p, int64_t left) {
    (void)left;
    return _mm256_loadu_ps(p);
}

static inline q8_signs q8_signs_of(__m256i w) { return w; }

static inline __m256i q8_dot(__m256i w_abs, q8_signs w, __m256i x) {
    const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

static inline __m256 q8_group_lanes(const float *row_scales, int64_t b, int64_t group_size,
                                    int64_t left) {
    (void)left;
    return _mm256_set1_ps(row_scales[b * 32 / group_size]);
}
#define vabs_epi8 _mm256_abs_epi8
#endif

/* a##r##i += the block sums of weight row r against x row i, times x's block scales (and,
 * per group, the weight's). */
#define Q8_DOT(r, i)                                                                        \
    a##r##i = vfmadd(vcvt_epi32_ps(q8_dot(w_abs, signs, xb##i)),                           \
                     per_channel ? xl##i : vmul(xl##i, s_lanes), a##r##i)

/*
 * int8 rows row0 .. row0 + R - 1 against quantized x rows i0 .. i0 + M - 1, Q8_BLOCKS blocks at
 * a time: each weight vector's absolute values and signs once, then one dot product per row of
 * x, its lanes' integer sums converted and scaled in float32 by x's block scales.
 */
static inline __attribute__((always_inline)) void q8_block(
    const linear_io *io, const int8_t *q, const float *scales, int64_t group_size, int64_t row0,
    const int R, int64_t i0, const int M) {
    const int64_t k = io->k, blocks = k / 32, groups = k / group_size;
    const int per_channel = group_size == k;
    const q8_x *xq = io->x8;
    DECLARE_ALL_ACCUMULATORS;
    for (int64_t b = 0; b < blocks; b += Q8_BLOCKS) {
        const int64_t left = blocks - b;
/* x row i's bytes and scale lanes for these blocks (rows past M: row 0's, never used). */
#define X_ROW(i)                                                                            \
        const int64_t at##i = i0 + (M > (i) ? (i) : 0);                                     \
        const veci xb##i = q8_bytes(xq->q + at##i * k + 32 * b, left);                      \
        const vecf xl##i = q8_lanes(xq->lanes + (at##i * blocks + b) * Q8_LANES, left)
        X_ROW(0);
        X_ROW(1);
        X_ROW(2);
        X_ROW(3);
#undef X_ROW
#define Q8_ROW(r)                                                                           \
        do {                                                                                \
            const int8_t *src = q + (row0 + (r)) * k + 32 * b;                              \
            if (Q8_BLOCKS == 2 || (b & 1) == 0) /* once per 64 bytes */                     \
                _mm_prefetch((const char *)src + PREFETCH_BYTES, _MM_HINT_T0);              \
            const veci w = q8_bytes(src, left);                                             \
            const veci w_abs = vabs_epi8(w);                                                \
            const q8_signs signs = q8_signs_of(w);                                          \
            const vecf s_lanes = per_channel                                                \
                ? vzero()                                                                   \
                : q8_group_lanes(scales + (row0 + (r)) * groups, b, group_size, left);      \
            Q8_DOT(r, 0);                                                                   \
            if (M > 1) Q8_DOT(r, 1);                                                        \
            if (M > 2) Q8_DOT(r, 2);                                                        \
            if (M > 3) Q8_DOT(r, 3);                                                        \
        } while (0)
        FOR_ROWS(Q8_ROW);
#undef Q8_ROW
    }
#define Q8_OUT(r) WRITE_ROW(r, per_channel ? scales[row0 + (r)] : 1.0f)
    FOR_ROWS(Q8_OUT);
#undef Q8_OUT
}
#undef Q8_DOT

/* The extra bytes kvgate_linear allocates after packed x for weights `wt`. */
#define Q8_X_BYTES(wt, m, k) ((wt)->kind == KVGATE_W_INT8 && (wt)->x_int8 ? q8_x_bytes(m, k) : 0)

#else

#define Q8_X_BYTES(wt, m, k) 0
#endif
#endif
