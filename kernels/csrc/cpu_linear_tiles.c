/*
 * Linear layers with per-channel int8 weights on the CPU's AMX tile unit, above the
 * small-batch kernels' batch sizes: out = (q @ x^T) * scale (+ bias) for float32 or bfloat16 x.
 * Products are bfloat16 x bfloat16, exact in float32, summed in float32, and the numerics are
 * those of weight-only int8, not of bfloat16:
 *
 * - every int8 value is exactly a bfloat16 (8 significant bits), and the per-channel scale
 *   multiplies the finished float32 sum, so the weights are exact;
 * - float32 x is split into two bfloat16 parts, x = hi + lo (hi x rounded to bfloat16, lo the
 *   rest rounded to bfloat16: 16 significant bits together, a relative error of at most 2^-17
 *   a value), and both parts' products with a weight tile go into the same float32
 *   accumulator tile; bfloat16 x is exact in one part. The bound holds for |x| from 2^-109
 *   to 3.39e38: the conversion and the tile unit flush denormals to zero (an error under
 *   2^-126 a value below), and hi of a larger x rounds to inf (its outputs NaN). An infinite
 *   x gives the reference's infinities; a sum q . x past float32's largest value is inf
 *   before the scale makes it small (the reference's x . (q * scale) is not).
 *
 * A tile product costs the tile unit what a sixteenth of its products would cost the vector
 * unit in float32, so two of them per value still leave a decode step's time mostly to
 * reading the weights once and converting them.
 *
 * Per call: x^T (dense [k, m], the engine's column-major activations) is packed once into the
 * tiles' pair layout (both parts), by all threads; then each thread takes work items of 16
 * weight rows (128 when x has more than 64 rows: those stay in the L2 cache while every group
 * of 64 rows of x meets them), converts an item's rows to bfloat16 in its own buffer (zero
 * past k), and runs the tiles over it: accumulator tile v (v < 4) holds a block of 16 weight
 * rows' outputs for 16 rows of x. out: [n, m] of out_dtype, out[r * m + i] row i's output r
 * (the column-major result of kernels/cpu_linear.py).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#define TILE_ROWS 16      /* weight rows a block takes, and rows of x a tile holds */
#define TILE_K 32         /* features a tile product takes (32 bfloat16 = 64 bytes a row) */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) &&         \
    defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define KVGATE_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux gives a process the tile registers' state only when it asks (arch_prctl). */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* The tile configuration (palette 1): every tile used is 16 rows of 64 bytes. Tiles 0-3
 * accumulate, 4 holds weights, 5 and 6 the two parts of x. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = TILE_ROWS;
    }
    _tile_loadconfig(&cfg);
}

/* The bfloat16 bits of v rounded to nearest, as the high half of 32-bit lanes (a float32). */
static inline __m512i bf16_high(__m512 v) {
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16);
}

/* 16 values of x (float32 or bfloat16, `mask` of them) as float32. */
static inline __m512 load16(const void *x, int dtype, int64_t at, __mmask16 mask) {
    if (dtype == KVGATE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + at)), 16));
    return _mm512_maskz_loadu_ps(mask, (const float *)x + at);
}

/* Lane j of a's and b's bfloat16 bits (bf16_high): a's in the low half, b's in the high. */
static inline __m512i pair_lanes(__m512i a, __m512i b) {
    return _mm512_mask_blend_epi16((__mmask32)0xaaaaaaaau, _mm512_srli_epi32(a, 16), b);
}

/* x - hi, the part of x that its bfloat16 high part hi leaves: 0 where x is infinite (hi is
 * then x, and inf - inf would make every output of its row NaN where the reference has inf). */
static inline __m512 low_part(__m512 x, __m512i hi) {
    const __mmask16 infinite = _mm512_fpclass_ps_mask(x, 0x18); /* +inf, -inf */
    return _mm512_maskz_sub_ps((__mmask16)~infinite, x, _mm512_castsi512_ps(hi));
}

/*
 * x^T [k, m] into the tiles' layout: for x's rows 16 v .. 16 v + 15 and feature pair p (2 p,
 * 2 p + 1), 64 bytes at part + (v * pairs + p) * 32 bfloat16 hold (row j, feature 2 p + e) at
 * 2 j + e; zero past m and k. hi, and lo unless NULL (bfloat16 x: hi is x). Pairs p0 .. p1 - 1
 * for every v.
 */
static void pack_pairs(const void *x, int dtype, int64_t k, int64_t m, int64_t pairs, int64_t p0,
                       int64_t p1, uint16_t *hi, uint16_t *lo) {
    for (int64_t v = 0; v < (m + 15) / 16; ++v) {
        const int64_t left = m - 16 * v;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        for (int64_t p = p0; p < p1; ++p) {
            const int64_t f = 2 * p, at = (v * pairs + p) * 32;
            const __m512 a = f < k ? load16(x, dtype, f * m + 16 * v, mask) : _mm512_setzero_ps();
            const __m512 b =
                f + 1 < k ? load16(x, dtype, (f + 1) * m + 16 * v, mask) : _mm512_setzero_ps();
            const __m512i ah = bf16_high(a), bh = bf16_high(b);
            _mm512_storeu_si512(hi + at, pair_lanes(ah, bh));
            if (lo == NULL) continue;
            const __m512i al = bf16_high(low_part(a, ah)), bl = bf16_high(low_part(b, bh));
            _mm512_storeu_si512(lo + at, pair_lanes(al, bl));
        }
    }
}

/* Int8 weight rows row0 .. row0 + rows - 1 (k a row) as bfloat16 values into 16 rows of `ld`
 * bfloat16, zero past k and past `rows`. */
static void convert_rows(const int8_t *q, int64_t k, int64_t row0, int rows, int64_t ld,
                         uint16_t *dst) {
    for (int r = 0; r < TILE_ROWS; ++r) {
        uint16_t *d = dst + r * ld;
        if (r >= rows) {
            memset(d, 0, sizeof(uint16_t) * (size_t)ld);
            continue;
        }
        const int8_t *s = q + (row0 + r) * k;
        for (int64_t j = 0; j < ld; j += 32) {
            const int64_t left = k - j;
            const __mmask32 mask = left >= 32 ? (__mmask32)0xffffffffu
                                   : left <= 0 ? 0
                                               : (__mmask32)((1u << left) - 1u);
            const __m256i bytes = _mm256_maskz_loadu_epi8(mask, s + j);
            const __m128i low = _mm256_castsi256_si128(bytes);
            const __m128i high = _mm256_extracti128_si256(bytes, 1);
            const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(low));
            const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(high));
            _mm512_storeu_si512(d + j, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
        }
    }
}

/* One block's accumulators for V (1 .. 4) tiles of x's rows and P (1 or 2) parts of x, both
 * constants at each call, over `chunks` chunks of TILE_K features; weights w (16 rows, `ld`
 * bfloat16 apart). */
#define TILES_PRODUCT(v)                                                                    \
    do {                                                                                    \
        if (V > (v)) {                                                                      \
            _tile_loadd(5, hi + ((v) * pairs + c * 16) * 32, 64);                           \
            _tile_dpbf16ps(v, 4, 5);                                                        \
            if (P > 1) {                                                                    \
                _tile_loadd(6, lo + ((v) * pairs + c * 16) * 32, 64);                       \
                _tile_dpbf16ps(v, 4, 6);                                                    \
            }                                                                               \
        }                                                                                   \
    } while (0)
#define TILES_STORE(v)                                                                      \
    if (V > (v)) _tile_stored(v, sums + (v) * 256, 64)

static inline __attribute__((always_inline)) void tiles_block(
    const uint16_t *w, int64_t ld, const uint16_t *hi, const uint16_t *lo, int64_t pairs,
    int64_t chunks, float *sums, const char *fetch, int64_t fetch_lines, const int V,
    const int P) {
    _tile_zero(0);
    if (V > 1) _tile_zero(1);
    if (V > 2) _tile_zero(2);
    if (V > 3) _tile_zero(3);
    for (int64_t c = 0; c < chunks; ++c) {
        for (int64_t l = c * fetch_lines; l < (c + 1) * fetch_lines; ++l)
            _mm_prefetch(fetch + 64 * l, _MM_HINT_T0);
        _tile_loadd(4, w + c * TILE_K, ld * 2);
        TILES_PRODUCT(0);
        TILES_PRODUCT(1);
        TILES_PRODUCT(2);
        TILES_PRODUCT(3);
    }
    TILES_STORE(0);
    TILES_STORE(1);
    TILES_STORE(2);
    TILES_STORE(3);
}

/* What a call's work items share. */
typedef struct {
    const kvgate_linear_weights *wt;
    const uint16_t *hi, *lo; /* x packed; lo NULL for one part */
    int64_t m, ld, pairs, chunks, per_item;
    void *out;
    int out_dtype, bias_dtype; /* the bias has x's dtype */
} tiles_io;

/* A block's sums (V tiles of 16 x 16 in `sums`) times the rows' scales, plus the bias,
 * into out, for weight rows row0 .. row0 + rows - 1 and x's rows i0 .. i0 + 16 V - 1 (those
 * below m). */
static void store_block(const tiles_io *io, const float *sums, int V, int64_t row0, int rows,
                        int64_t i0) {
    const kvgate_linear_weights *wt = io->wt;
    for (int r = 0; r < rows; ++r) {
        const int64_t row = row0 + r;
        const __m512 s = _mm512_set1_ps(((const float *)wt->scales)[row]);
        const __m512 b =
            _mm512_set1_ps(wt->bias != NULL ? load_elem(wt->bias, io->bias_dtype, row) : 0.0f);
        for (int v = 0; v < V; ++v) {
            const int64_t left = io->m - i0 - 16 * v, at = row * io->m + i0 + 16 * v;
            const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
            const __m512 value = _mm512_fmadd_ps(_mm512_load_ps(sums + v * 256 + r * 16), s, b);
            if (io->out_dtype == KVGATE_BF16)
                _mm256_mask_storeu_epi16((uint16_t *)io->out + at, mask,
                                         (__m256i)_mm512_cvtneps_pbh(value));
            else
                _mm512_mask_storeu_ps((float *)io->out + at, mask, value);
        }
    }
}

/* Work item `item`: convert its weight rows, then every group of 64 rows of x against each of its
 * blocks of 16 weight rows. */
static void tiles_item(const tiles_io *io, int64_t item, uint16_t *w, float *sums) {
    const int64_t n = io->wt->out_features, k = io->wt->in_features, ld = io->ld;
    const int64_t first = item * io->per_item;
    const int64_t rows = n - first < io->per_item ? n - first : io->per_item;
    const int64_t x_blocks = (io->m + 15) / 16, groups = (x_blocks + 3) / 4;
    for (int64_t b = 0; b < rows; b += TILE_ROWS)
        convert_rows(io->wt->q, k, first + b, rows - b < TILE_ROWS ? (int)(rows - b) : TILE_ROWS,
                     ld, w + b * ld);
    /* The next item's weights (a thread's items follow one another) are asked for while this
     * one's tiles run, a share of them each chunk: a decode step reads them from memory.
     * Prefetches never fault, past the weights or not. */
    const int64_t after = n - first - rows;
    const int64_t next_rows = after < io->per_item ? after : io->per_item;
    const char *fetch = (const char *)io->wt->q + (first + rows) * k;
    const int64_t blocks = (rows + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t steps = groups * blocks * io->chunks;
    const int64_t fetch_lines = (next_rows * k / 64 + steps - 1) / steps;
    int64_t step = 0;
    for (int64_t g = 0; g < groups; ++g) {
        const int V = x_blocks - 4 * g < 4 ? (int)(x_blocks - 4 * g) : 4;
        const int64_t offset = 4 * g * io->pairs * 32;
        const uint16_t *hi = io->hi + offset, *lo = io->lo != NULL ? io->lo + offset : NULL;
        for (int64_t b = 0; b < rows; b += TILE_ROWS, step += io->chunks) {
            const uint16_t *wb = w + b * ld;
            const int64_t pairs = io->pairs, chunks = io->chunks;
            const char *f = fetch + 64 * fetch_lines * step;
            /* V and the part count constants in each case */
#define TILES_CASE(v)                                                                       \
    case v:                                                                                 \
        if (lo != NULL)                                                                     \
            tiles_block(wb, ld, hi, lo, pairs, chunks, sums, f, fetch_lines, v, 2);         \
        else                                                                                \
            tiles_block(wb, ld, hi, lo, pairs, chunks, sums, f, fetch_lines, v, 1);         \
        break
            switch (V) {
                TILES_CASE(1);
                TILES_CASE(2);
                TILES_CASE(3);
                TILES_CASE(4);
            }
#undef TILES_CASE
            store_block(io, sums, V, first + b, rows - b < TILE_ROWS ? (int)(rows - b) : TILE_ROWS,
                        64 * g);
        }
    }
}
#endif

/* Whether kvgate_linear_tiles runs here: built with AMX and the kernel lets this process use
 * the tile registers (asked once). */
int kvgate_linear_tiles_available(void) {
#ifdef KVGATE_TILES
    /* -1 not asked yet, then 0 or 1; atomic: first callers may race, and each stores the same
     * answer. */
    static int tiles_permitted = -1;
    int permitted = __atomic_load_n(&tiles_permitted, __ATOMIC_ACQUIRE);
    if (permitted < 0) {
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        __atomic_store_n(&tiles_permitted, permitted, __ATOMIC_RELEASE);
    }
    return permitted;
#else
    return 0;
#endif
}

/*
 * out = (q @ x^T) * scales[row] (+ bias) as above for per-channel int8 weights (wt: q [n, k],
 * scales [n] float32, group_size = k) and m rows of x given as x^T, dense [k, m] of x_dtype
 * (float32 or bfloat16); the bias (or NULL) of x_dtype; out of out_dtype (float32 or
 * bfloat16). Returns 0, 1 when out of memory, 2 when the arguments are not these or the kernel
 * cannot run here.
 */
int kvgate_linear_tiles(const kvgate_linear_weights *wt, const void *x, int x_dtype, int64_t m,
                        void *out, int out_dtype, int num_threads) {
#ifdef KVGATE_TILES
    const int64_t k = wt->in_features, n = wt->out_features;
    if (m < 1 || k < 1 || wt->kind != KVGATE_W_INT8 || wt->group_size != k ||
        !kvgate_linear_tiles_available())
        return 2;
    if ((x_dtype != KVGATE_F32 && x_dtype != KVGATE_BF16) ||
        (out_dtype != KVGATE_F32 && out_dtype != KVGATE_BF16))
        return 2;
    tiles_io io = {.wt = wt, .m = m, .out = out, .out_dtype = out_dtype, .bias_dtype = x_dtype};
    io.chunks = (k + TILE_K - 1) / TILE_K;
    io.ld = io.chunks * TILE_K;
    io.pairs = io.ld / 2;
    const int64_t x_blocks = (m + 15) / 16;
    io.per_item = x_blocks <= 4 ? TILE_ROWS : 8 * TILE_ROWS;
    const int64_t items = (n + io.per_item - 1) / io.per_item;
    const int parts = x_dtype == KVGATE_F32 ? 2 : 1;
    const size_t part = sizeof(uint16_t) * (size_t)(x_blocks * io.pairs * 32);
    uint16_t *hi = aligned_alloc(64, parts * part);
    if (hi == NULL) return 1;
    io.hi = hi;
    io.lo = parts == 2 ? hi + part / sizeof(uint16_t) : NULL;
    int failed = 0;
    const int threads = num_threads > 0 ? num_threads : 1;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
        pack_pairs(x, x_dtype, k, m, io.pairs, io.pairs * t / count, io.pairs * (t + 1) / count,
                   hi, (uint16_t *)io.lo);
        uint16_t *w = aligned_alloc(64, sizeof(uint16_t) * (size_t)(io.per_item * io.ld));
        float sums[4 * 256] __attribute__((aligned(64)));
        if (w == NULL) failed = 1;
        configure_tiles();
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item)
            if (w != NULL) tiles_item(&io, item, w, sums);
        _tile_release();
        free(w);
    }
    free(hi);
    return failed;
#else
    (void)wt, (void)x, (void)x_dtype, (void)m, (void)out, (void)out_dtype, (void)num_threads;
    return 2;
#endif
}
