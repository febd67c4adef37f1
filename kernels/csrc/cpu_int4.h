/*
 * int4 weights against activations rounded to int8 (cpu_linear.c's small-batch int4 kernel).
 *
 * Each row of x is rounded to int8 in blocks of 32 values, as kernels/quant.py's
 * quantize_activations does (scale = max |x| * float32(1/127), q = round(x * (1 / scale))), so
 * that a block of 32 weights meets its 32 x values in integer multiply-adds: VNNI's vpdpbusd
 * multiplies 64 unsigned bytes (nibbles) by 64 signed bytes and adds each 4 products into a
 * 32-bit lane; without VNNI (the AVX2 level, AVX-512 CPUs before it) vpmaddubsw adds each 2
 * products into a 16-bit lane (at most 2 * 15 * 127, exact; the low and high nibbles' pairs
 * added there too, at most 7620) and vpmaddwd each 2 of those into a 32-bit lane: the same 32-bit
 * sums, in 64-byte (AVX-512) or 32-byte (AVX2) registers. With w = q * scale + zero
 * (kernels/quant.py), a block's share of an output is
 *     sum_j w_j x_j = scale * dx * sum_j q_j qx_j + zero * dx * sum_j qx_j,
 * an exact integer sum times two scales, plus the zero times the x block's own sum.
 *
 * Quantized x, per row, in chunks of the blocks a vector of weights holds (INT4_BLOCKS: n = 4
 * at AVX-512, 2 at AVX2; the last chunk zero-padded):
 *   q:     32 n bytes a chunk: the n blocks' values 0..15 (block b's at 16 b), then their
 *          values 16..31. A weight block's 16 bytes hold its values j and j + 16 in the low and
 *          high nibbles of byte j, so a chunk's 16 n weight bytes masked to their low nibbles
 *          line up with the first 16 n x bytes, and shifted to their high nibbles with the last;
 *   lanes: 4 n floats a chunk, block b's dx in lanes 4 b .. 4 b + 3: the lanes into which the
 *          dot product sums block b's products;
 *   sums:  n floats a chunk, dx * sum_j qx_j of each block (what the weight's zero multiplies).
 *
 * The scale, its inverse and the rounding use the embedded-rounding intrinsics (AVX-512), or
 * plain C compiled without -ffast-math (below it): -ffast-math may rewrite float divisions (a
 * reciprocal estimate, or a product by an inverse), and the quantization must equal the
 * reference's to the bit. The portable level dequantizes the weights instead (cpu_linear.c),
 * against x's rounded values q * scale.
 */
#ifndef KVGATE_CPU_INT4_H
#define KVGATE_CPU_INT4_H

#ifdef KVGATE_AVX512
/* The activations' rounding (AVX-512 F; the VNNI kernel below and the 9-64-row path of
 * cpu_linear.c use it). */
#define ROUNDED (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* The lanes of v that hold a NaN, by an integer test (-ffast-math lets the compiler assume a
 * float comparison never meets one). A block that holds a NaN gets a NaN scale, as the
 * reference's (torch.amax passes it on), so every output of its row is NaN. */
static inline __mmask16 nan_lanes(__m512 v) {
    const __m512i magnitude =
        _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff));
    return _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
}

static inline __m512 quiet_nans(void) { return _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)); }

/* A block of 32 floats at src rounded to int8: its scale (max |x| * float32(1/127), NaN when
 * the block holds one) and values q_lo (the first 16) and q_hi, each round-half-even(x * (1 /
 * scale)) in -127..127. */
static inline float round_x_block(const float *src, __m512i *q_lo, __m512i *q_hi) {
    const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const int has_nan = (nan_lanes(lo) | nan_lanes(hi)) != 0;
    const __m128 scale = has_nan
        ? _mm512_castps512_ps128(quiet_nans())
        : _mm_mul_round_ss(_mm_set_ss(amax), _mm_set_ss((float)(1.0 / 127.0)), ROUNDED);
    const float scale_f = _mm_cvtss_f32(scale);
    const __m512 inverse = !has_nan && scale_f > 0.0f
        ? _mm512_broadcastss_ps(_mm_div_round_ss(_mm_set_ss(1.0f), scale, ROUNDED))
        : _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
#define ROUND_HALF(v)                                                                       \
    _mm512_min_epi32(high, _mm512_max_epi32(low, _mm512_cvt_roundps_epi32(                  \
                                                      _mm512_mul_round_ps(v, inverse, ROUNDED), ROUNDED)))
    *q_lo = ROUND_HALF(lo);
    *q_hi = ROUND_HALF(hi);
#undef ROUND_HALF
    return scale_f;
}

/* x^T (dense [k, m] float32, k a multiple of 32) as the float32 values of its rows' int8
 * blocks (q * scale: kernels/quant.py's round_activations) into out, also [k, m]. 16 rows of x
 * at a time, one in each lane: round_x_block's arithmetic, lane by lane. */
static void round_x_columns(const float *x, int64_t k, int64_t m, float *out) {
    const __m512 inverse_127 = _mm512_set1_ps((float)(1.0 / 127.0)), one = _mm512_set1_ps(1.0f);
    const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
    for (int64_t i = 0; i < m; i += 16) {
        const __mmask16 rows = m - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (m - i)) - 1u);
        for (int64_t j0 = 0; j0 < k; j0 += 32) {
            const float *src = x + j0 * m + i;
            __m512 amax = _mm512_setzero_ps();
            __mmask16 nan = 0;
            for (int j = 0; j < 32; ++j) {
                const __m512 v = _mm512_maskz_loadu_ps(rows, src + j * m);
                amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
                nan |= nan_lanes(v);
            }
            const __m512 scale = _mm512_mask_mov_ps(
                _mm512_mul_round_ps(amax, inverse_127, ROUNDED), nan, quiet_nans());
            const __mmask16 positive =
                _mm512_cmp_ps_mask(scale, _mm512_setzero_ps(), _CMP_GT_OQ) & (__mmask16)~nan;
            const __m512 inverse = _mm512_maskz_div_round_ps(positive, one, scale, ROUNDED);
            for (int j = 0; j < 32; ++j) {
                const __m512 v = _mm512_maskz_loadu_ps(rows, src + j * m);
                const __m512i nearest =
                    _mm512_cvt_roundps_epi32(_mm512_mul_round_ps(v, inverse, ROUNDED), ROUNDED);
                const __m512i q = _mm512_min_epi32(high, _mm512_max_epi32(low, nearest));
                _mm512_mask_storeu_ps(out + (j0 + j) * m + i, rows,
                                      _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale));
            }
        }
    }
}
#undef ROUNDED
#endif

#ifndef KVGATE_AVX512
/* A block of 32 values (src[j * stride]) rounded to int8 as round_x_block: round-half-even(x *
 * (1 / scale)) into codes[32], clamped to -127..127 (0 where the product is no number);
 * returns scale (NaN when the block holds one). Not fast-math: the reference's operations. */
__attribute__((optimize("no-fast-math"))) static float round_block_codes(const float *src,
                                                                         int64_t stride,
                                                                         int8_t *codes) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) { /* a NaN, once met, stays: the reference's amax */
        const float v = src[j * stride];
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits); /* a NaN by its bits, whatever the flags */
        const int nan = (bits & 0x7fffffffu) > 0x7f800000u;
        amax = fabsf(v) > amax || nan ? fabsf(v) : amax;
    }
    const float scale = amax * (float)(1.0 / 127.0);
    const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int j = 0; j < 32; ++j) {
        const float q = __builtin_rintf(src[j * stride] * inverse);
        codes[j] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q == q ? q : 0.0f);
    }
    return scale;
}

/* x's rounded values q * scale (kernels/quant.py's round_activations): row i's value j at
 * src[i * row_stride + j * feature_stride] into the same place of dst (which may be src). */
static void round_x_strided(const float *src, float *dst, int64_t m, int64_t k,
                            int64_t row_stride, int64_t feature_stride) {
    int8_t codes[32];
    for (int64_t i = 0; i < m; ++i) {
        for (int64_t b = 0; b < k; b += 32) {
            const int64_t at = i * row_stride + b * feature_stride;
            const float scale = round_block_codes(src + at, feature_stride, codes);
            for (int j = 0; j < 32; ++j) dst[at + j * feature_stride] = (float)codes[j] * scale;
        }
    }
}

#ifdef KVGATE_VECTOR
/* x^T (dense [k, m]) rounded into out ([k, m]), as the AVX-512 round_x_columns: 8 rows of x at
 * a time, one in each lane, with round_block_codes' arithmetic (the rows past the last 8 by
 * round_x_strided). */
__attribute__((optimize("no-fast-math"))) static void round_x_columns(const float *x, int64_t k,
                                                                      int64_t m, float *out) {
    const __m256 inverse_127 = _mm256_set1_ps((float)(1.0 / 127.0)), one = _mm256_set1_ps(1.0f);
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    const __m256i infinity = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet_nan = _mm256_set1_epi32(0x7fc00000);
    const __m256i low = _mm256_set1_epi32(-127), high = _mm256_set1_epi32(127);
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
        for (int64_t j0 = 0; j0 < k; j0 += 32) {
            const float *src = x + j0 * m + i;
            __m256 amax = _mm256_setzero_ps();
            __m256i nan = _mm256_setzero_si256();
            for (int j = 0; j < 32; ++j) {
                const __m256 v = _mm256_loadu_ps(src + j * m);
                const __m256i bits = _mm256_and_si256(_mm256_castps_si256(v), magnitude);
                amax = _mm256_max_ps(amax, _mm256_castsi256_ps(bits));
                nan = _mm256_or_si256(nan, _mm256_cmpgt_epi32(bits, infinity));
            }
            const __m256 scale = _mm256_blendv_ps(_mm256_mul_ps(amax, inverse_127),
                                                  _mm256_castsi256_ps(quiet_nan),
                                                  _mm256_castsi256_ps(nan));
            const __m256 positive = _mm256_cmp_ps(scale, _mm256_setzero_ps(), _CMP_GT_OQ);
            const __m256 inverse = _mm256_and_ps(positive, _mm256_div_ps(one, scale));
            for (int j = 0; j < 32; ++j) {
                const __m256 v = _mm256_loadu_ps(src + j * m);
                const __m256i nearest = _mm256_cvtps_epi32(_mm256_mul_ps(v, inverse));
                const __m256i q = _mm256_min_epi32(high, _mm256_max_epi32(low, nearest));
                _mm256_storeu_ps(out + (j0 + j) * m + i,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(q), scale));
            }
        }
    }
    round_x_strided(x + i, out + i, m - i, k, 1, m);
}
#else
/* x^T (dense [k, m]) rounded into out ([k, m]), as the AVX-512 round_x_columns. */
static inline void round_x_columns(const float *x, int64_t k, int64_t m, float *out) {
    round_x_strided(x, out, m, k, 1, m);
}
#endif
#endif

#ifdef KVGATE_VECTOR
#define KVGATE_INT4_INTEGER 1

/* Blocks to a vector of weight bytes (16 bytes a block), and to a chunk of x. */
#ifdef KVGATE_AVX512
#define INT4_BLOCKS 4
#else
#define INT4_BLOCKS 2
#endif
#define INT4_X_CHUNK (32 * INT4_BLOCKS) /* x values (INT4_BLOCKS blocks of 32) per chunk */
#define INT4_LANES (4 * INT4_BLOCKS)    /* 32-bit lanes of a vector: 4 per block */
#define INT4_BLOCK_CHUNK 256 /* blocks whose weight scales and zeros are converted at a time */

typedef struct int4_x {
    int8_t *q;      /* [m, chunks * INT4_X_CHUNK] */
    float *lanes;   /* [m, chunks * INT4_LANES] */
    float *sums;    /* [m, chunks * INT4_BLOCKS] */
    int64_t chunks; /* per row */
} int4_x;

/* Bytes of the quantized x of m rows of k values (q, then lanes, then sums). */
static inline size_t int4_x_bytes(int64_t m, int64_t k) {
    const int64_t chunks = (k + INT4_X_CHUNK - 1) / INT4_X_CHUNK;
    return (size_t)(m * chunks * (INT4_X_CHUNK + (INT4_LANES + INT4_BLOCKS) * sizeof(float)));
}

/* Cut `memory` (int4_x_bytes(m, k), zeroed) into x's arrays. */
static inline int4_x int4_x_layout(char *memory, int64_t m, int64_t k) {
    const int64_t chunks = (k + INT4_X_CHUNK - 1) / INT4_X_CHUNK;
    int4_x x = {(int8_t *)memory, NULL, NULL, chunks};
    x.lanes = (float *)(memory + m * chunks * INT4_X_CHUNK);
    x.sums = x.lanes + m * chunks * INT4_LANES;
    return x;
}

/* Block b of row i (32 floats at src) into x: its int8 values, its scale and its sum. */
static inline void quantize_x_block(const float *src, int64_t i, int64_t b, const int4_x *x) {
    const int64_t chunk = i * x->chunks + b / INT4_BLOCKS, in_chunk = b % INT4_BLOCKS;
    int8_t *q = x->q + chunk * INT4_X_CHUNK + 16 * in_chunk;
#ifdef KVGATE_AVX512
    __m512i q_lo, q_hi;
    const float scale = round_x_block(src, &q_lo, &q_hi);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q_lo));
    _mm_storeu_si128((__m128i *)(q + 16 * INT4_BLOCKS), _mm512_cvtepi32_epi8(q_hi));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
#else
    int8_t codes[32];
    const float scale = round_block_codes(src, 1, codes);
    memcpy(q, codes, 16);
    memcpy(q + 16 * INT4_BLOCKS, codes + 16, 16);
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) sum += codes[j];
#endif
    float *lanes = x->lanes + chunk * INT4_LANES + 4 * in_chunk;
    for (int lane = 0; lane < 4; ++lane) lanes[lane] = scale;
    x->sums[chunk * INT4_BLOCKS + in_chunk] = scale * (float)sum;
}

/* m dense float32 rows of ld (>= k) into x, k a multiple of 32; x's memory is zeroed. */
static void quantize_x(const float *xf, int64_t m, int64_t k, int64_t ld, const int4_x *x) {
    for (int64_t i = 0; i < m; ++i)
        for (int64_t b = 0; b < k / 32; ++b) quantize_x_block(xf + i * ld + 32 * b, i, b, x);
}

/*
 * The float16 scales and zeros of a weight row, one per block: the row's own arrays where the
 * group is a block (32), else (groups of 64, 96, ...) a float32 copy of blocks b0 .. b0 +
 * count - 1 made by int4_block_scales, zero-padded to whole chunks of 4 blocks.
 */
typedef struct {
    const uint16_t *scales, *zeros; /* group 32: from block b0 on */
    const float *s, *z;             /* other groups */
} int4_row_scales;

static void int4_block_scales(const uint16_t *scales, const uint16_t *zeros, int64_t group_size,
                              int64_t b0, int64_t count, float *s, float *z) {
    for (int64_t b = 0; b < count; ++b) {
        const int64_t g = (b0 + b) * 32 / group_size;
        s[b] = _cvtsh_ss(scales[g]);
        z[b] = _cvtsh_ss(zeros[g]);
    }
    for (int64_t b = count; b % 4 != 0; ++b) s[b] = z[b] = 0.0f;
}

/* ---- per register width: INT4_BLOCKS weight blocks (16 bytes each) to a vector, their
 * scales spread over each block's 4 lanes of sums ---- */
#ifdef KVGATE_AVX512
/* The bytes of blocks c .. c + 3 at p (zero past `left` blocks: nothing past them is read). */
static inline __m512i int4_weight_bytes(const uint8_t *p, int64_t left) {
    const __mmask64 mask = left >= 4 ? ~(__mmask64)0 : ((__mmask64)1 << (16 * left)) - 1;
    return _mm512_maskz_loadu_epi8(mask, p);
}

/* The scales of blocks c .. c + 3, each in its block's 4 lanes (zero past `left` blocks). */
static inline __m512 int4_scale_lanes(const int4_row_scales *rs, int64_t c, int64_t left) {
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m128 four;
    if (rs->scales == NULL) {
        four = _mm_loadu_ps(rs->s + c);
    } else {
        const __mmask8 mask = left >= 4 ? 0xf : (__mmask8)((1u << left) - 1u);
        four = _mm_cvtph_ps(_mm_maskz_loadu_epi16(mask, rs->scales + c));
    }
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four));
}

/* The zero terms of `count` blocks: the row's zeros times x's block sums, in 16 lanes that are
 * summed with the rest at the end (masked loads: nothing past `count` is read). */
static inline __m512 int4_zero_terms(const int4_row_scales *rs, const float *sums, int64_t count) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < count; b += 16) {
        const __mmask16 mask = tail_mask16(count - b);
        const __m512 z = rs->zeros != NULL
            ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, rs->zeros + b))
            : _mm512_maskz_loadu_ps(mask, rs->z + b);
        acc = _mm512_fmadd_ps(z, _mm512_maskz_loadu_ps(mask, sums + b), acc);
    }
    return acc;
}

#define vloadu_si(p) _mm512_loadu_si512(p)
#define vand_si _mm512_and_si512
#define vsrli_epi16 _mm512_srli_epi16
#define vset1_epi8 _mm512_set1_epi8
#define vcvt_epi32_ps _mm512_cvtepi32_ps
#ifdef __AVX512VNNI__
/* lo . x_lo + hi . x_hi, 4 byte products to a 32-bit lane (unsigned lo, hi; signed x). */
static inline __m512i dot_bytes(__m512i lo, __m512i x_lo, __m512i hi, __m512i x_hi) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x_lo), hi, x_hi);
}
#else
static inline __m512i dot_bytes(__m512i lo, __m512i x_lo, __m512i hi, __m512i x_hi) {
    const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(lo, x_lo),
                                           _mm512_maddubs_epi16(hi, x_hi));
    return _mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
}
#endif
#else
static inline __m256i int4_weight_bytes(const uint8_t *p, int64_t left) {
    if (left >= 2) return _mm256_loadu_si256((const __m256i *)p);
    return _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
}

static inline __m256 int4_scale_lanes(const int4_row_scales *rs, int64_t c, int64_t left) {
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m128 two;
    if (rs->scales == NULL) { /* zero-padded to whole chunks: the second is there */
        two = _mm_castpd_ps(_mm_load_sd((const double *)(rs->s + c)));
    } else {
        uint32_t pair = rs->scales[c];
        if (left >= 2) pair |= (uint32_t)rs->scales[c + 1] << 16;
        two = _mm_cvtph_ps(_mm_cvtsi32_si128((int)pair));
    }
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), spread);
}

static inline __m256 int4_zero_terms(const int4_row_scales *rs, const float *sums, int64_t count) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= count; b += 8) {
        const __m256 z = rs->zeros != NULL
            ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rs->zeros + b)))
            : _mm256_loadu_ps(rs->z + b);
        acc = _mm256_fmadd_ps(z, _mm256_loadu_ps(sums + b), acc);
    }
    float rest = 0.0f;
    for (; b < count; ++b)
        rest += (rs->zeros != NULL ? _cvtsh_ss(rs->zeros[b]) : rs->z[b]) * sums[b];
    return _mm256_add_ps(acc, _mm256_setr_ps(rest, 0, 0, 0, 0, 0, 0, 0));
}

#define vloadu_si(p) _mm256_loadu_si256((const __m256i *)(p))
#define vand_si _mm256_and_si256
#define vsrli_epi16 _mm256_srli_epi16
#define vset1_epi8 _mm256_set1_epi8
#define vcvt_epi32_ps _mm256_cvtepi32_ps

static inline __m256i dot_bytes(__m256i lo, __m256i x_lo, __m256i hi, __m256i x_hi) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo),
                                           _mm256_maddubs_epi16(hi, x_hi));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
#endif

/* a##r##i += the zero terms of weight row r against x row i. */
#define INT4_ZERO_TERM(r, i) \
    a##r##i = vadd(a##r##i, int4_zero_terms(&rows[r], sums + (i) * sums_ld, count))
#define INT4_ZERO_TERMS(r)                          \
    do {                                            \
        INT4_ZERO_TERM(r, 0);                       \
        if (M > 1) INT4_ZERO_TERM(r, 1);            \
        if (M > 2) INT4_ZERO_TERM(r, 2);            \
        if (M > 3) INT4_ZERO_TERM(r, 3);            \
    } while (0)

/* a##r##i += block sums of weight row r against x row i, times the blocks' two scales. */
#define INT4_DOT(r, i)                                                                      \
    do {                                                                                    \
        const vecf sums_ = vcvt_epi32_ps(dot_bytes(lo, xlo##i, hi, xhi##i));                \
        a##r##i = vfmadd(sums_, vmul(s_lanes, xl##i), a##r##i);                             \
    } while (0)

/*
 * int4 rows row0 .. row0 + R - 1 against quantized x rows i0 .. i0 + M - 1, INT4_BLOCKS blocks
 * (16 weight bytes each) at a time: the nibbles masked and shifted into two vectors of bytes,
 * one dot_bytes per row of x against the x bytes of the same blocks (the low nibbles' at 16 b
 * in x's chunk, the high ones' 64 bytes further), and the lanes' integer sums (4 per block)
 * scaled in float32 by the weight block's scale times x's (both spread over the block's lanes).
 */
static inline __attribute__((always_inline)) void int4_block(
    const linear_io *io, const uint8_t *q, const uint16_t *scales, const uint16_t *zeros,
    int64_t group_size, int64_t row0, const int R, int64_t i0, const int M) {
    const int64_t k = io->k, blocks = k / 32, row_bytes = k / 2, groups = k / group_size;
    const int4_x *xq = io->xq;
    float s_blk[ROW_BLOCK][INT4_BLOCK_CHUNK], z_blk[ROW_BLOCK][INT4_BLOCK_CHUNK];
    const veci nibble = vset1_epi8(15);
    DECLARE_ALL_ACCUMULATORS;
    for (int64_t b0 = 0; b0 < blocks; b0 += INT4_BLOCK_CHUNK) {
        const int64_t count = blocks - b0 < INT4_BLOCK_CHUNK ? blocks - b0 : INT4_BLOCK_CHUNK;
        int4_row_scales rows[ROW_BLOCK];
        for (int r = 0; r < R; ++r) {
            const uint16_t *s_row = scales + (row0 + r) * groups, *z_row = zeros + (row0 + r) * groups;
            if (group_size == 32) {
                rows[r] = (int4_row_scales){s_row + b0, z_row + b0, NULL, NULL};
            } else {
                int4_block_scales(s_row, z_row, group_size, b0, count, s_blk[r], z_blk[r]);
                rows[r] = (int4_row_scales){NULL, NULL, s_blk[r], z_blk[r]};
            }
        }
        const float *sums = xq->sums + i0 * xq->chunks * INT4_BLOCKS + b0;
        const int64_t sums_ld = xq->chunks * INT4_BLOCKS;
        FOR_ROWS(INT4_ZERO_TERMS);
        for (int64_t c = 0; c < count; c += INT4_BLOCKS) {
            const int64_t chunk = (b0 + c) / INT4_BLOCKS, left = count - c;
            const int8_t *xb = xq->q + (i0 * xq->chunks + chunk) * INT4_X_CHUNK;
            const float *xlb = xq->lanes + (i0 * xq->chunks + chunk) * INT4_LANES;
            const int64_t xb_ld = xq->chunks * INT4_X_CHUNK, xl_ld = xq->chunks * INT4_LANES;
/* x row i's bytes and scale lanes for these blocks (rows past M: row 0's, never used). */
#define X_ROW(i)                                                                            \
            const int64_t at##i = M > (i) ? (i) : 0;                                        \
            const veci xlo##i = vloadu_si(xb + at##i * xb_ld);                              \
            const veci xhi##i = vloadu_si(xb + at##i * xb_ld + 16 * INT4_BLOCKS);           \
            const vecf xl##i = vloadu(xlb + at##i * xl_ld)
            X_ROW(0);
            X_ROW(1);
            X_ROW(2);
            X_ROW(3);
#undef X_ROW
#define INT4_ROW(r)                                                                         \
            do {                                                                            \
                const uint8_t *src = q + (row0 + (r)) * row_bytes + (b0 + c) * 16;          \
                if ((c & 3) == 0) /* once per 64 bytes */                                   \
                    _mm_prefetch((const char *)src + PREFETCH_BYTES, _MM_HINT_T0);          \
                const veci bytes = int4_weight_bytes(src, left);                            \
                const veci lo = vand_si(bytes, nibble);                                     \
                const veci hi = vand_si(vsrli_epi16(bytes, 4), nibble);                     \
                const vecf s_lanes = int4_scale_lanes(&rows[r], c, left);                   \
                INT4_DOT(r, 0);                                                             \
                if (M > 1) INT4_DOT(r, 1);                                                  \
                if (M > 2) INT4_DOT(r, 2);                                                  \
                if (M > 3) INT4_DOT(r, 3);                                                  \
            } while (0)
            FOR_ROWS(INT4_ROW);
#undef INT4_ROW
        }
    }
    FOR_ROWS(UNSCALED_OUT);
}
#undef INT4_DOT
#undef INT4_ZERO_TERM
#undef INT4_ZERO_TERMS

/* The extra bytes kvgate_linear allocates after packed x for weights of `kind`. */
#define INT4_X_BYTES(kind, m, k) ((kind) == KVGATE_W_INT4 ? int4_x_bytes(m, k) : 0)

#else

#define INT4_X_BYTES(kind, m, k) 0

/* m dense rows of ld floats (k a multiple of 32) rounded in place (the portable level's x
 * against its dequantized weights). */
static inline void round_x_blocks(float *x, int64_t m, int64_t k, int64_t ld) {
    round_x_strided(x, x, m, k, ld, 1);
}
#endif
#endif
