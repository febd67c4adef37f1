/*
 * Dense float32 linear layers at decode batch sizes above the small-batch kernels' (9 to 64
 * rows of x): out = w @ x^T as an outer-product kernel that reads the weights where they lie.
 * bfloat16 weights too, for CPUs without AMX tiles (kernels/cpu_linear.py routes them here with
 * x widened to float32): a block's chunk of weights is widened exactly into an L1 buffer just
 * before the block runs over it, so the sums are float32 sums of exact products and the weights
 * come from memory at half float32's bytes. int8 weights in groups of a multiple of 16 and int4
 * weights the same way (kvgate_linear_columns_chunks): a block's chunk dequantized into the L1
 * buffer as kvgate_dequantize does it, so the sums equal the float32 kernel's over the
 * dequantized weights (int4: against x rounded to its rows' int8 blocks by the caller).
 *
 * At these sizes MKL's sgemm (torch.mm) copies the weight into packed panels on every call,
 * and each step's weights come from memory, not the cache: it runs the layers of a 64-row
 * decode step well below the rate it multiplies a 2048-square matrix at. Here 6 weight rows
 * meet all the rows of x (up to 4 vectors of 16) in up to 24 registers: at 64 rows each step
 * of the inner loop loads 4 vectors of x and broadcasts one weight of each of the 6 rows into
 * 24 multiply-adds. x goes through in chunks of COLUMNS_K_CHUNK features (32 KB at 64 rows)
 * that stay in the L1 cache while a panel of a thread's blocks (up to 1020 weight rows) passes
 * over them; the panel's partial sums wait in `out` between chunks (up to 255 KB: the L2
 * cache, where a whole output layer's, 12 MB for SmolLM2's at 64 rows, would not stay). The
 * next block's weight rows are prefetched while the current block runs.
 *
 * x: x^T, dense [k, m] float32 (element (i, j), row i and feature j, at x[j * m + i]): the
 * engine's column-major activations, read in place (kernels/cpu_linear.py transposes any other
 * layout first). out: [n, m] float32,
 * out[r * m + i] row i's output r (the column-major result of kernels/cpu_linear.py). bias:
 * [n] float32 or NULL.
 */
#include <omp.h>
#include <stdint.h>

#include "cpu_common.h"

#define COLUMNS_MAX_ROWS 64 /* rows of x: 4 vectors of 16 */
#define COLUMNS_K_CHUNK 128 /* features of x a pass over the blocks takes */

/* Weight rows a block multiplies at once: 24 accumulators at 64 rows of x. Taller blocks for
 * fewer rows of x (8 or 12 rows of weights, as many accumulators) ran 5-25% slower: more
 * streams of weights than the prefetchers follow. */
#define COLUMNS_W_ROWS 6

/* Blocks whose partial sums a pass over x's chunks keeps (170 blocks, 1020 rows: 255 KB of
 * sums at 64 rows of x, in the L2 cache). */
#define COLUMNS_PANEL_BLOCKS 170

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* The accumulators of weight row r: a##r##v for vectors v < V (V a constant at every call, so
 * the unused ones compile away). */
#define COLUMNS_DECLARE(r)                                                                  \
    __m512 a##r##0, a##r##1, a##r##2, a##r##3;                                              \
    const float *w##r = w + ((r) < rows ? (r) : 0) * w_ld;                                  \
    columns_start(out + ((r) < rows ? (r) : 0) * m, V, last, first, &a##r##0, &a##r##1,     \
                  &a##r##2, &a##r##3)
#define COLUMNS_FMA(r)                                                                      \
    do {                                                                                    \
        const __m512 b = _mm512_set1_ps(w##r[j]);                                           \
        a##r##0 = _mm512_fmadd_ps(b, x0, a##r##0);                                          \
        if (V > 1) a##r##1 = _mm512_fmadd_ps(b, x1, a##r##1);                               \
        if (V > 2) a##r##2 = _mm512_fmadd_ps(b, x2, a##r##2);                               \
        if (V > 3) a##r##3 = _mm512_fmadd_ps(b, x3, a##r##3);                               \
    } while (0)
#define COLUMNS_STORE(r)                                                                    \
    if ((r) < rows)                                                                         \
    columns_finish(out + (r) * m, V, last, bias != NULL ? bias[r] : 0.0f, a##r##0, a##r##1, \
                   a##r##2, a##r##3)
#define COLUMNS_PREFETCH(r)                                                                 \
    _mm_prefetch((const char *)(w##r + next + j), _MM_HINT_T0)
#define COLUMNS_EACH_ROW(STEP) STEP(0); STEP(1); STEP(2); STEP(3); STEP(4); STEP(5)

/* The lanes of vector v of a row of m values: all 16 but in the last vector. */
static inline __attribute__((always_inline)) __mmask16 columns_mask(int v, int V, __mmask16 last) {
    return v == V - 1 ? last : (__mmask16)0xffff;
}

/* A block row's partial sums: zero for the first chunk, else what the last chunk left. */
static inline __attribute__((always_inline)) void columns_start(const float *row, int V,
                                                                __mmask16 last, int first,
                                                                __m512 *a0, __m512 *a1,
                                                                __m512 *a2, __m512 *a3) {
    __m512 *acc[4] = {a0, a1, a2, a3};
    for (int v = 0; v < 4; ++v)
        *acc[v] = first || v >= V ? _mm512_setzero_ps()
                                  : _mm512_maskz_loadu_ps(columns_mask(v, V, last), row + 16 * v);
}

static inline __attribute__((always_inline)) void columns_finish(float *row, int V,
                                                                 __mmask16 last, float bias,
                                                                 __m512 a0, __m512 a1,
                                                                 __m512 a2, __m512 a3) {
    const __m512 acc[4] = {a0, a1, a2, a3}, b = _mm512_set1_ps(bias);
    for (int v = 0; v < V; ++v)
        _mm512_mask_storeu_ps(row + 16 * v, columns_mask(v, V, last), _mm512_add_ps(acc[v], b));
}

/*
 * A block of `rows` (<= COLUMNS_W_ROWS) weight rows, w_ld floats apart (w: the first row's
 * weight of the chunk's first feature), over `count` features of x (x: that feature's row of
 * x^T, rows m floats apart), added to the block's `out` rows unless `first`. bias: the block's
 * biases, added (on the last chunk) unless NULL. `next`: the offset from a row of this block
 * to the same row of the block that follows, prefetched (0: none).
 */
static inline __attribute__((always_inline)) void columns_block(
    const float *w, int64_t w_ld, const float *x, const float *bias, float *out, int64_t m,
    int rows, int64_t count, int64_t next, int first, const int V, __mmask16 last) {
    COLUMNS_EACH_ROW(COLUMNS_DECLARE);
    for (int64_t j = 0; j < count; ++j) {
        if ((j & 15) == 0 && next != 0) {
            COLUMNS_EACH_ROW(COLUMNS_PREFETCH);
        }
        const float *xj = x + j * m;
        const __m512 x0 = _mm512_maskz_loadu_ps(columns_mask(0, V, last), xj);
        const __m512 x1 = V > 1 ? _mm512_maskz_loadu_ps(columns_mask(1, V, last), xj + 16) : x0;
        const __m512 x2 = V > 2 ? _mm512_maskz_loadu_ps(columns_mask(2, V, last), xj + 32) : x0;
        const __m512 x3 = V > 3 ? _mm512_maskz_loadu_ps(columns_mask(3, V, last), xj + 48) : x0;
        COLUMNS_EACH_ROW(COLUMNS_FMA);
    }
    COLUMNS_EACH_ROW(COLUMNS_STORE);
}

/*
 * The same block for bfloat16 weights (w: as above, rows w_ld elements apart): each row's
 * chunk widened exactly into `wide` (float32 rows COLUMNS_K_CHUNK apart, which stay in the L1
 * cache) with the next block's chunk prefetched, then the float32 block over `wide`. Widening
 * takes 3 vector instructions per 16 weights, which meet 64 multiply-adds at 64 rows of x.
 */
static inline __attribute__((always_inline)) void columns_block_bf16(
    const uint16_t *w, int64_t w_ld, const float *x, const float *bias, float *out, int64_t m,
    int rows, int64_t count, int64_t next, int first, const int V, __mmask16 last,
    float *wide) {
    for (int r = 0; r < rows; ++r) {
        const uint16_t *src = w + r * w_ld;
        for (int64_t j = 0; j < count; j += 16) {
            const __mmask16 mask =
                count - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - j)) - 1u);
            const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, src + j));
            _mm512_mask_storeu_ps(wide + r * COLUMNS_K_CHUNK + j, mask,
                                  _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
            if (next != 0 && (j & 31) == 0)
                _mm_prefetch((const char *)(src + next + j), _MM_HINT_T0);
        }
    }
    columns_block(wide, COLUMNS_K_CHUNK, x, bias, out, m, rows, count, 0, first, V, last);
}

/*
 * The same block for int8 weights with a float32 scale per group of `group_size` features (a
 * multiple of 16): q and scales point at the block's first row (rows q_ld and `groups` apart),
 * the chunk starts at feature `begin`. Each row's chunk is dequantized (q * scale, the float32
 * product kvgate_dequantize makes) into `wide`, in the L1 cache, then the float32 block runs
 * over it; the next block's chunk is prefetched once per 64 bytes.
 */
static inline __attribute__((always_inline)) void columns_block_int8(
    const int8_t *q, int64_t q_ld, const float *scales, int64_t groups, int64_t group_size,
    int64_t begin, const float *x, float *out, int64_t m, int rows, int64_t count, int64_t next,
    int first, const int V, __mmask16 last, float *wide) {
    for (int r = 0; r < rows; ++r) {
        const int8_t *src = q + r * q_ld;
        int64_t g = begin / group_size, group_end = (g + 1) * group_size;
        __m512 scale = _mm512_set1_ps(scales[r * groups + g]);
        for (int64_t j = 0; j < count; j += 16) {
            if (begin + j == group_end) {
                group_end += group_size;
                scale = _mm512_set1_ps(scales[r * groups + ++g]);
            }
            const __mmask16 mask =
                count - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - j)) - 1u);
            const __m512 values =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, src + j)));
            _mm512_mask_storeu_ps(wide + r * COLUMNS_K_CHUNK + j, mask,
                                  _mm512_mul_ps(values, scale));
            if (next != 0 && (j & 63) == 0)
                _mm_prefetch((const char *)(src + next + j), _MM_HINT_T0);
        }
    }
    columns_block(wide, COLUMNS_K_CHUNK, x, NULL, out, m, rows, count, 0, first, V, last);
}

/*
 * The same block for int4 weights (kernels/quant.py's layout: a block of 32 weights in 16 bytes,
 * value j in byte j's low nibble and value j + 16 in its high one; w = q * scale + zero with a
 * float16 scale and zero per group of `group_size`, a multiple of 32): q, scales and zeros
 * point at the block's first row (rows q_ld bytes and `groups` apart), the chunk (whole blocks
 * of 32) starts at feature `begin`. Dequantized into `wide` as kvgate_dequantize does it.
 */
static inline __attribute__((always_inline)) void columns_block_int4(
    const uint8_t *q, int64_t q_ld, const uint16_t *scales, const uint16_t *zeros, int64_t groups,
    int64_t group_size, int64_t begin, const float *x, float *out, int64_t m, int rows,
    int64_t count, int64_t next, int first, const int V, __mmask16 last, float *wide) {
    const __m512i low_nibble = _mm512_set1_epi32(15);
    for (int r = 0; r < rows; ++r) {
        const uint8_t *src = q + r * q_ld;
        int64_t g = begin / group_size, group_end = (g + 1) * group_size;
        __m512 scale = _mm512_set1_ps(_cvtsh_ss(scales[r * groups + g]));
        __m512 zero = _mm512_set1_ps(_cvtsh_ss(zeros[r * groups + g]));
        for (int64_t j = 0; j < count; j += 32) {
            if (begin + j == group_end) {
                group_end += group_size, ++g;
                scale = _mm512_set1_ps(_cvtsh_ss(scales[r * groups + g]));
                zero = _mm512_set1_ps(_cvtsh_ss(zeros[r * groups + g]));
            }
            const __m512i bytes =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + j / 2)));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low_nibble));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
            float *dst = wide + r * COLUMNS_K_CHUNK + j;
            _mm512_storeu_ps(dst, _mm512_fmadd_ps(lo, scale, zero));
            _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(hi, scale, zero));
            if (next != 0 && (j & 127) == 0)
                _mm_prefetch((const char *)(src + next + j / 2), _MM_HINT_T0);
        }
    }
    columns_block(wide, COLUMNS_K_CHUNK, x, NULL, out, m, rows, count, 0, first, V, last);
}

/* Elements (int4: bytes) from one weight row to the next. */
static inline int64_t columns_ld(const kvgate_linear_weights *wt) {
    return wt->kind == KVGATE_W_INT4 ? wt->in_features / 2 : wt->in_features;
}

/* The block of rows row0 .. row0 + rows - 1 over the chunk at feature `begin`, by kind. */
static inline __attribute__((always_inline)) void columns_block_of(
    const kvgate_linear_weights *wt, int64_t row0, int64_t begin, int64_t groups,
    const float *xc, const float *bias, float *out, int64_t m, int rows, int64_t width,
    int64_t next, int first, const int V, __mmask16 last, float *wide) {
    const int64_t ld = columns_ld(wt), at = row0 * ld + begin;
    switch (wt->kind) {
    case KVGATE_W_INT8:
        columns_block_int8((const int8_t *)wt->q + at, ld,
                           (const float *)wt->scales + row0 * groups, groups, wt->group_size,
                           begin, xc, out, m, rows, width, next, first, V, last, wide);
        break;
    case KVGATE_W_INT4:
        columns_block_int4((const uint8_t *)wt->q + row0 * ld + begin / 2, ld,
                           (const uint16_t *)wt->scales + row0 * groups,
                           (const uint16_t *)wt->zeros + row0 * groups, groups, wt->group_size,
                           begin, xc, out, m, rows, width, next, first, V, last, wide);
        break;
    case KVGATE_W_BF16:
        columns_block_bf16((const uint16_t *)wt->q + at, ld, xc, bias, out, m, rows, width, next,
                           first, V, last, wide);
        break;
    default:
        columns_block((const float *)wt->q + at, ld, xc, bias, out, m, rows, width, next, first,
                      V, last);
    }
}

/* Blocks p0 .. p1 - 1 (a panel), chunk by chunk of x's features. */
static void columns_panel(const kvgate_linear_weights *wt, const float *x, const float *bias,
                          float *out, int64_t m, int64_t p0, int64_t p1, float *wide) {
    const int V = (int)((m + 15) / 16), R = COLUMNS_W_ROWS;
    const __mmask16 last = (__mmask16)((1u << (m - 16 * (V - 1))) - 1u);
    const int64_t n = wt->out_features, k = wt->in_features;
    const int64_t groups = wt->group_size > 0 ? k / wt->group_size : 0;
    for (int64_t begin = 0; begin < k; begin += COLUMNS_K_CHUNK) {
        const int64_t width = k - begin < COLUMNS_K_CHUNK ? k - begin : COLUMNS_K_CHUNK;
        const int first_chunk = begin == 0, last_chunk = begin + width == k;
        for (int64_t b = p0; b < p1; ++b) {
            const int64_t row0 = b * R;
            const int rows = n - row0 < R ? (int)(n - row0) : R;
            const int64_t next = b + 1 < p1 ? R * columns_ld(wt) : 0;
            const float *block_bias = bias != NULL && last_chunk ? bias + row0 : NULL;
            const float *xc = x + begin * m;
            float *block_out = out + row0 * m;
            /* V a constant in each case. */
#define COLUMNS_CASE(v)                                                                     \
    case v:                                                                                 \
        columns_block_of(wt, row0, begin, groups, xc, block_bias, block_out, m, rows,       \
                         width, next, first_chunk, v, last, wide);                          \
        break
            switch (V) {
                COLUMNS_CASE(1);
                COLUMNS_CASE(2);
                COLUMNS_CASE(3);
                COLUMNS_CASE(4);
            }
        }
    }
}


#else
/*
 * Without AVX-512: the same blocks, chunks, panels and order of sums in 8-lane vectors of the
 * compiler's (AVX2 at the avx2 level, pairs of SSE registers at the portable one). A block
 * meets x's rows COLUMNS_GROUP at a time: 6 weight rows x 2 vectors of 8 are 12 accumulators,
 * which with 2 vectors of x and a broadcast weight fill AVX2's 16 registers; a block's chunk of
 * weights (3 KB) stays in the L1 cache while the groups pass over it.
 */
#include <string.h>

typedef float columns_vec __attribute__((vector_size(32)));
#define COLUMNS_LANES 8
#ifdef __AVX__
#define COLUMNS_GROUP_VECTORS 2
#else
#define COLUMNS_GROUP_VECTORS 1 /* SSE: 8 registers of accumulators */
#endif
#define COLUMNS_GROUP (COLUMNS_LANES * COLUMNS_GROUP_VECTORS)

/* `lanes` (1..8) floats at p, the rest zero. */
static inline columns_vec columns_load(const float *p, int lanes) {
    columns_vec v = {0};
    if (lanes == COLUMNS_LANES)
        memcpy(&v, p, sizeof v);
    else
        memcpy(&v, p, sizeof(float) * (size_t)lanes);
    return v;
}

static inline void columns_store(float *p, columns_vec v, int lanes) {
    memcpy(p, &v, sizeof(float) * (size_t)lanes);
}

/*
 * A block of `rows` weight rows (w: the chunk's first weight of the first row, rows w_ld
 * apart) over `count` features of x's rows i0 .. i0 + V * 8 - 1 (x: the chunk's first feature
 * of row i0, features m apart; `tail` lanes in the last vector), added to `out` (row i0 of the
 * block's first output row) unless `first`; bias added unless NULL.
 */
static inline __attribute__((always_inline)) void columns_group(
    const float *w, int64_t w_ld, const float *x, const float *bias, float *out, int64_t m,
    int rows, int64_t count, int first, const int V, int tail) {
    columns_vec a[COLUMNS_W_ROWS][COLUMNS_GROUP_VECTORS];
    const float *wr[COLUMNS_W_ROWS];
    for (int r = 0; r < COLUMNS_W_ROWS; ++r) {
        wr[r] = w + (r < rows ? r : 0) * w_ld;
        for (int v = 0; v < V; ++v) {
            const int lanes = v == V - 1 ? tail : COLUMNS_LANES;
            a[r][v] = first || r >= rows ? (columns_vec){0}
                                         : columns_load(out + r * m + COLUMNS_LANES * v, lanes);
        }
    }
    for (int64_t j = 0; j < count; ++j) {
        columns_vec xv[COLUMNS_GROUP_VECTORS];
        for (int v = 0; v < V; ++v)
            xv[v] = columns_load(x + j * m + COLUMNS_LANES * v, v == V - 1 ? tail : COLUMNS_LANES);
        for (int r = 0; r < COLUMNS_W_ROWS; ++r) {
            const float b = wr[r][j];
            for (int v = 0; v < V; ++v) a[r][v] += b * xv[v];
        }
    }
    for (int r = 0; r < rows; ++r) {
        const float b = bias != NULL ? bias[r] : 0.0f;
        for (int v = 0; v < V; ++v)
            columns_store(out + r * m + COLUMNS_LANES * v, a[r][v] + b,
                          v == V - 1 ? tail : COLUMNS_LANES);
    }
}

/* The block over every group of x's m rows (V a constant in each call of columns_group). */
static void columns_block(const float *w, int64_t w_ld, const float *x, const float *bias,
                          float *out, int64_t m, int rows, int64_t count, int first) {
    for (int64_t i0 = 0; i0 < m; i0 += COLUMNS_GROUP) {
        const int64_t left = m - i0;
        const int V = left > COLUMNS_LANES && COLUMNS_GROUP_VECTORS > 1 ? 2 : 1;
        const int tail = (int)(left - COLUMNS_LANES * (V - 1) >= COLUMNS_LANES
                                   ? COLUMNS_LANES
                                   : left - COLUMNS_LANES * (V - 1));
        /* A whole last vector named by a constant: its loads in the inner loop are plain
         * vector loads, not a copy of a variable length through the stack. */
        if (V == 2 && tail == COLUMNS_LANES)
            columns_group(w, w_ld, x + i0, bias, out + i0, m, rows, count, first, 2,
                          COLUMNS_LANES);
        else if (V == 2)
            columns_group(w, w_ld, x + i0, bias, out + i0, m, rows, count, first, 2, tail);
        else if (tail == COLUMNS_LANES)
            columns_group(w, w_ld, x + i0, bias, out + i0, m, rows, count, first, 1,
                          COLUMNS_LANES);
        else
            columns_group(w, w_ld, x + i0, bias, out + i0, m, rows, count, first, 1, tail);
    }
}

/* The 32 weights of an int4 block (16 bytes at src: weight j in byte j's low nibble, j + 16 in
 * its high one) as q * scale + zero into dst[32]: 8 at a time in AVX2 registers, else one at a
 * time. */
static inline void int4_block_values(const uint8_t *src, float scale, float zero, float *dst) {
#ifdef __AVX2__
    const __m256 s = _mm256_set1_ps(scale), z = _mm256_set1_ps(zero);
    for (int j = 0; j < 16; j += 8) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + j)));
        const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi32(15));
        _mm256_storeu_ps(dst + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), s, z));
        const __m256i high = _mm256_srli_epi32(bytes, 4);
        _mm256_storeu_ps(dst + 16 + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), s, z));
    }
#else
    for (int j = 0; j < 16; ++j) {
        dst[j] = (float)(src[j] & 15) * scale + zero;
        dst[j + 16] = (float)(src[j] >> 4) * scale + zero;
    }
#endif
}

/* A block's chunk of weights (rows row0 .. row0 + rows - 1, features begin .. begin + count -
 * 1) as float32 into `wide` (rows COLUMNS_K_CHUNK apart): widened bfloat16, or dequantized as
 * kvgate_dequantize does it (int8 q * scale, int4 q * scale + zero). */
static void columns_widen(const kvgate_linear_weights *wt, int64_t row0, int rows, int64_t begin,
                          int64_t count, float *wide) {
    const int64_t k = wt->in_features, groups = wt->group_size > 0 ? k / wt->group_size : 0;
    for (int r = 0; r < rows; ++r) {
        const int64_t row = row0 + r;
        float *dst = wide + r * COLUMNS_K_CHUNK;
        if (wt->kind == KVGATE_W_BF16) {
            const uint16_t *src = (const uint16_t *)wt->q + row * k + begin;
            for (int64_t j = 0; j < count; ++j) dst[j] = bf16_to_f32(src[j]);
        } else if (wt->kind == KVGATE_W_INT8) {
            const int8_t *src = (const int8_t *)wt->q + row * k + begin;
            const float *scales = (const float *)wt->scales + row * groups;
            for (int64_t j = 0; j < count;) { /* a group's run at a time: a loop that vectorizes */
                const int64_t g = (begin + j) / wt->group_size;
                const int64_t end = (g + 1) * wt->group_size - begin;
                const int64_t stop = end < count ? end : count;
                for (; j < stop; ++j) dst[j] = (float)src[j] * scales[g];
            }
        } else {
            const uint8_t *src = (const uint8_t *)wt->q + row * (k / 2) + begin / 2;
            for (int64_t b = 0; b < count; b += 32) { /* a block of 32 in 16 bytes */
                const int64_t g = row * groups + (begin + b) / wt->group_size;
                int4_block_values(src + b / 2, f16_to_f32(((const uint16_t *)wt->scales)[g]),
                                  f16_to_f32(((const uint16_t *)wt->zeros)[g]), dst + b);
            }
        }
    }
}

/* Blocks p0 .. p1 - 1 (a panel), chunk by chunk of x's features. */
static void columns_panel(const kvgate_linear_weights *wt, const float *x, const float *bias,
                          float *out, int64_t m, int64_t p0, int64_t p1, float *wide) {
    const int64_t n = wt->out_features, k = wt->in_features, R = COLUMNS_W_ROWS;
    for (int64_t begin = 0; begin < k; begin += COLUMNS_K_CHUNK) {
        const int64_t width = k - begin < COLUMNS_K_CHUNK ? k - begin : COLUMNS_K_CHUNK;
        const int first_chunk = begin == 0, last_chunk = begin + width == k;
        for (int64_t b = p0; b < p1; ++b) {
            const int64_t row0 = b * R;
            const int rows = n - row0 < R ? (int)(n - row0) : (int)R;
            const float *block_bias = bias != NULL && last_chunk ? bias + row0 : NULL;
            float *block_out = out + row0 * m;
            if (wt->kind == KVGATE_W_F32) {
                columns_block((const float *)wt->q + row0 * k + begin, k, x + begin * m,
                              block_bias, block_out, m, rows, width, first_chunk);
                continue;
            }
            columns_widen(wt, row0, rows, begin, width, wide);
            columns_block(wide, COLUMNS_K_CHUNK, x + begin * m, block_bias, block_out, m, rows,
                          width, first_chunk);
        }
    }
}

#endif

/* A thread's blocks first .. first + count - 1, a panel at a time. */
static void columns_blocks(const kvgate_linear_weights *wt, const float *x, const float *bias,
                           float *out, int64_t m, int64_t first, int64_t count) {
    float wide[COLUMNS_W_ROWS * COLUMNS_K_CHUNK] __attribute__((aligned(64)));
    for (int64_t p0 = first; p0 < first + count; p0 += COLUMNS_PANEL_BLOCKS) {
        const int64_t p1 = p0 + COLUMNS_PANEL_BLOCKS < first + count ? p0 + COLUMNS_PANEL_BLOCKS
                                                                     : first + count;
        columns_panel(wt, x, bias, out, m, p0, p1, wide);
    }
}

/* Each thread's share of the blocks of wt's rows. */
static void columns_threads(const kvgate_linear_weights *wt, const float *bias, const float *x,
                            int64_t m, float *out, int num_threads) {
    const int64_t blocks = (wt->out_features + COLUMNS_W_ROWS - 1) / COLUMNS_W_ROWS;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t first = blocks * t / count, stop = blocks * (t + 1) / count;
        columns_blocks(wt, x, bias, out, m, first, stop - first);
    }
}

/*
 * n float32 weight rows [n, k] (dequantized rows of a quantized layer) times x (dense [k, m],
 * 1 <= m <= COLUMNS_MAX_ROWS) into out (n rows of m), on the calling thread
 * (kvgate_linear_columns_quantized in cpu_linear.c).
 */
void kvgate_columns_rows(const float *w, const float *x, float *out, int64_t n, int64_t k,
                         int64_t m) {
    const kvgate_linear_weights wt = {.kind = KVGATE_W_F32, .q = w, .out_features = n,
                                      .in_features = k};
    columns_blocks(&wt, x, NULL, out, m, 0, (n + COLUMNS_W_ROWS - 1) / COLUMNS_W_ROWS);
}

/* Whether kvgate_linear_columns is built: at every ISA level (AVX-512 registers, or the
 * compiler's 8-lane vectors). */
int kvgate_linear_columns_available(void) { return 1; }

/*
 * out = w @ x^T (+ bias) for m (1 .. COLUMNS_MAX_ROWS) rows of x; w: [n, k] float32, or
 * bfloat16 when `bf16` (widened exactly a chunk at a time: float32 sums of exact products).
 * x: x^T, dense [k, m]. Returns 0, or 2 when m is out of range.
 */
int kvgate_linear_columns(const void *w, int bf16, const float *bias, const float *x, int64_t m,
                          int64_t n, int64_t k, float *out, int num_threads) {
    if (m < 1 || m > COLUMNS_MAX_ROWS) return 2;
    const kvgate_linear_weights wt = {.kind = bf16 ? KVGATE_W_BF16 : KVGATE_W_F32, .q = w,
                                      .out_features = n, .in_features = k};
    columns_threads(&wt, bias, x, m, out, num_threads);
    return 0;
}

/*
 * Whether kvgate_linear_columns_chunks takes these weights: int8 in groups of a multiple of 16
 * (float32 scales), or int4 (kernels/quant.py's layout, groups a multiple of 32).
 */
int kvgate_columns_takes_chunks(const kvgate_linear_weights *wt) {
    const int64_t g = wt->group_size;
    if (g < 1 || wt->in_features % g != 0) return 0;
    return (wt->kind == KVGATE_W_INT8 && g % 16 == 0) || (wt->kind == KVGATE_W_INT4 && g % 32 == 0);
}

/*
 * out = w @ x^T for m (1 .. COLUMNS_MAX_ROWS) rows of x and weights kvgate_columns_takes_chunks
 * takes, each block's chunk dequantized into the L1 cache as kvgate_dequantize dequantizes it.
 * x: x^T, dense [k, m] (for int4, rounded to its rows' int8 blocks by the caller). Returns 0, or
 * 2 when m is out of range or the weights are not taken.
 */
int kvgate_linear_columns_chunks(const kvgate_linear_weights *wt, const float *x, int64_t m,
                                 float *out, int num_threads) {
    if (m < 1 || m > COLUMNS_MAX_ROWS || !kvgate_columns_takes_chunks(wt)) return 2;
    columns_threads(wt, NULL, x, m, out, num_threads);
    return 0;
}
