/*
 * One work item of paged attention: the query heads of one KV head over one sequence's cached
 * rows (attend_group), with the helpers that read a cache row of any format (float32, bfloat16,
 * float16, int8, fp8) and the per-head-width loops (included by cpu_attention.c, whose header
 * comment describes the layouts; nothing here is exported).
 */
#ifndef KVGATE_CPU_ATTEND_H
#define KVGATE_CPU_ATTEND_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_common.h"

static float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

static void axpy(float *y, float alpha, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

/* Softmax of one row of scores in place. */
static void softmax_in_place(float *scores, int64_t n) {
    float max_score = scores[0];
    for (int64_t t = 1; t < n; ++t) max_score = scores[t] > max_score ? scores[t] : max_score;
    float total = 0.0f;
    for (int64_t t = 0; t < n; ++t) {
        scores[t] = expf(scores[t] - max_score);
        total += scores[t];
    }
    const float inverse_total = 1.0f / total;
    for (int64_t t = 0; t < n; ++t) scores[t] *= inverse_total;
}

/* Where one sequence's cache lives and how it is laid out. */
typedef struct {
    const void *k_cache, *v_cache;
    int cache_dtype;
    const int32_t *block_table;
    int64_t num_kv_heads, head_dim, block_size;
} paged_kv;

/* Head `kv_head` of the cached token in slot `slot` of one cache (k or v): its row. */
static inline const void *cached_row(const paged_kv *kv, const void *cache, int64_t slot,
                                     int64_t kv_head) {
    const int64_t slot_bytes = cache_slot_bytes(kv->cache_dtype, kv->num_kv_heads, kv->head_dim);
    return (const char *)cache + slot * slot_bytes +
           kv_head * kv->head_dim * dtype_size(kv->cache_dtype);
}

/* q . the cached row of n values of `dtype` (int8, fp8: times the token's scale, to_scale
 * bytes after the row's start), in float32. */
static inline __attribute__((always_inline)) float dot_cached(const float *q, const void *row,
                                                              int dtype, int64_t n,
                                                              int64_t to_scale) {
    if (dtype == KVGATE_F32) return dot(q, row, n);
    float sum = 0.0f;
    if (dtype == KVGATE_BF16) {
        const uint16_t *r = row;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) sum += q[i] * bf16_to_f32(r[i]);
        return sum;
    }
    if (dtype == KVGATE_F16) {
        const uint16_t *r = row;
        for (int64_t i = 0; i < n; ++i) sum += q[i] * f16_to_f32(r[i]);
        return sum;
    }
    if (dtype == KVGATE_FP8) {
        const uint8_t *r = row;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) sum += q[i] * fp8_to_f32(r[i]);
        return sum * token_scale(r + to_scale);
    }
    const int8_t *r = row;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += q[i] * (float)r[i];
    return sum * token_scale(r + to_scale);
}

/* y += alpha * the cached row of n values of `dtype` (int8, fp8: times the token's scale,
 * to_scale bytes after the row's start). */
static inline __attribute__((always_inline)) void axpy_cached(float *y, float alpha,
                                                              const void *row, int dtype,
                                                              int64_t n, int64_t to_scale) {
    if (dtype == KVGATE_F32) {
        axpy(y, alpha, row, n);
    } else if (dtype == KVGATE_BF16) {
        const uint16_t *r = row;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) y[i] += alpha * bf16_to_f32(r[i]);
    } else if (dtype == KVGATE_F16) {
        const uint16_t *r = row;
        for (int64_t i = 0; i < n; ++i) y[i] += alpha * f16_to_f32(r[i]);
    } else if (dtype == KVGATE_FP8) {
        const uint8_t *r = row;
        alpha *= token_scale(r + to_scale);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) y[i] += alpha * fp8_to_f32(r[i]);
    } else {
        const int8_t *r = row;
        alpha *= token_scale(r + to_scale);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) y[i] += alpha * (float)r[i];
    }
}

/* The cache slot of each of a sequence's first context_len tokens (walking its block table
 * once, instead of dividing by the block size per token and per pass). */
static void sequence_slots(const paged_kv *kv, int64_t context_len, int64_t *slots) {
    for (int64_t start = 0, b = 0; start < context_len; start += kv->block_size, ++b) {
        const int64_t base = (int64_t)kv->block_table[b] * kv->block_size;
        const int64_t count = context_len - start < kv->block_size ? context_len - start
                                                                   : kv->block_size;
        for (int64_t o = 0; o < count; ++o) slots[start + o] = base + o;
    }
}

/* Tokens whose K or V rows a work item of a 16-bit or int8 cache converts to float32 at a time
 * (into scratch that stays in the L1 cache), so that each row is converted once for all the
 * query heads of its KV head. */
#define CHUNK_TOKENS 32

/* Row t of a chunk of converted rows is slot t of that scratch. */
static const int64_t chunk_slots[CHUNK_TOKENS] = {
    0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
    16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
};

/* The rows of KV head `kv_head` of the n cached tokens in `slots`, of one cache (k or v), as
 * float32 (an int8 row times its scale) into rows[n * head_dim]; head_dim is kv's, passed so
 * that a caller's constant unrolls the row loops. */
static inline __attribute__((always_inline)) void convert_rows(const paged_kv *kv,
                                                               const void *cache, int64_t kv_head,
                                                               const int64_t *slots, int64_t n,
                                                               int64_t head_dim, float *rows) {
    const char *base = (const char *)cache + kv_head * head_dim * dtype_size(kv->cache_dtype);
    const int64_t slot_bytes = cache_slot_bytes(kv->cache_dtype, kv->num_kv_heads, head_dim);
    const int64_t to_scale = scale_offset(kv->num_kv_heads, kv_head, head_dim);
    for (int64_t t = 0; t < n; ++t)
        load_cache_row(base + slots[t] * slot_bytes, kv->cache_dtype, head_dim, to_scale,
                       rows + t * head_dim);
}

#if KVGATE_ISA_LEVEL >= 1
#include "cpu_attention_tiles.h"

/*
 * attend_group for head_dim d = TILE_VL * pieces (64 or 128), by the tile loops of
 * cpu_attention_tiles.h: a float32 or bfloat16 cache read in place, another format's rows
 * converted CHUNK_TOKENS at a time into chunk (CHUNK_TOKENS * d floats), each chunk serving
 * every head of the group. prepared: group * d floats of scratch for the query's form.
 */
static inline __attribute__((always_inline)) void attend_wide(
    const float *q, const paged_kv *kv, int64_t kv_head, int64_t context_len,
    const int64_t *slots, int64_t group, float scale, float *scores, float *out, float *chunk,
    float *prepared, int pieces) {
    const int64_t d = TILE_VL * pieces;
    if (kv->cache_dtype == KVGATE_F32 || kv->cache_dtype == KVGATE_BF16) {
        const int bf16 = kv->cache_dtype == KVGATE_BF16;
        const int64_t row = kv->num_kv_heads * d, offset = kv_head * d * (bf16 ? 2 : 4);
        const char *k = (const char *)kv->k_cache + offset;
        const char *v = (const char *)kv->v_cache + offset;
        /* Each call names its row format, so that each is compiled on its own. */
        if (!bf16) {
            score_tiles(q, k, row, slots, context_len, group, scale, scores, context_len, pieces,
                        ROWS_F32);
#ifdef __AVX512BF16__
        } else if (all_bf16_values(q, group * d)) {
            prepare_query(q, group * d, ROWS_BF16_DOT, prepared);
            score_tiles(prepared, k, row, slots, context_len, group, scale, scores, context_len,
                        pieces, ROWS_BF16_DOT);
#endif
        } else {
            prepare_query(q, group * d, ROWS_BF16, prepared);
            score_tiles(prepared, k, row, slots, context_len, group, scale, scores, context_len,
                        pieces, ROWS_BF16);
        }
        for (int64_t h = 0; h < group; ++h)
            softmax_in_place(scores + h * context_len, context_len);
        if (bf16)
            value_tiles(v, row, slots, context_len, scores, context_len, group, out, 0, pieces,
                        ROWS_BF16);
        else
            value_tiles(v, row, slots, context_len, scores, context_len, group, out, 0, pieces,
                        ROWS_F32);
        return;
    }
    for (int64_t start = 0; start < context_len; start += CHUNK_TOKENS) {
        const int64_t n = context_len - start < CHUNK_TOKENS ? context_len - start : CHUNK_TOKENS;
        convert_rows(kv, kv->k_cache, kv_head, slots + start, n, d, chunk);
        score_tiles(q, chunk, d, chunk_slots, n, group, scale, scores + start, context_len,
                    pieces, ROWS_F32);
    }
    for (int64_t h = 0; h < group; ++h) softmax_in_place(scores + h * context_len, context_len);
    for (int64_t start = 0; start < context_len; start += CHUNK_TOKENS) {
        const int64_t n = context_len - start < CHUNK_TOKENS ? context_len - start : CHUNK_TOKENS;
        convert_rows(kv, kv->v_cache, kv_head, slots + start, n, d, chunk);
        value_tiles(chunk, d, chunk_slots, n, scores + start, context_len, group, out, start > 0,
                    pieces, ROWS_F32);
    }
}
#define KVGATE_ATTEND_WIDE 1
#endif

/* attend_group's loops over one cached row at a time, for any head_dim and cache format. */
static inline __attribute__((always_inline)) void attend_rows(
    const float *q, const paged_kv *kv, int64_t kv_head, int64_t context_len,
    const int64_t *slots, int64_t group, float scale, float *scores, float *out,
    int64_t head_dim, int dtype) {
    const int64_t to_scale = scale_offset(kv->num_kv_heads, kv_head, head_dim);
    for (int64_t t = 0; t < context_len; ++t) {
        const void *key = cached_row(kv, kv->k_cache, slots[t], kv_head);
        for (int64_t h = 0; h < group; ++h)
            scores[h * context_len + t] =
                scale * dot_cached(q + h * head_dim, key, dtype, head_dim, to_scale);
    }
    for (int64_t h = 0; h < group; ++h) {
        softmax_in_place(scores + h * context_len, context_len);
        for (int64_t i = 0; i < head_dim; ++i) out[h * head_dim + i] = 0.0f;
    }
    for (int64_t t = 0; t < context_len; ++t) {
        const void *value = cached_row(kv, kv->v_cache, slots[t], kv_head);
        for (int64_t h = 0; h < group; ++h)
            axpy_cached(out + h * head_dim, scores[h * context_len + t], value, dtype, head_dim,
                        to_scale);
    }
}

/* Heads up to this wide take attend_small, which converts each cached row of a 16-bit or int8
 * cache once for every query head of the group, one row at a time. */
#define SMALL_HEAD_DIM 32

/* attend_rows over the rows of a 16-bit, int8 or fp8 cache (`dtype`), each converted to float32 once
 * into `row` (a few vector stores that stay in the L1 cache, or registers) and then read by
 * every query head of the group: no scratch pass over the sequence's rows, and no per-element
 * conversion inside the dot products. The conversions store whole vectors (cpu_common.h), so
 * the dot product's loads of `row` take the stored values straight from the store buffer. */
static inline __attribute__((always_inline)) void attend_converted(
    const float *q, const paged_kv *kv, int64_t kv_head, int64_t context_len,
    const int64_t *slots, int64_t group, float scale, float *scores, float *out,
    int64_t head_dim, int dtype) {
    const int64_t row_bytes = head_dim * dtype_size(dtype);
    const int64_t slot_bytes = cache_slot_bytes(dtype, kv->num_kv_heads, head_dim);
    const int64_t to_scale = scale_offset(kv->num_kv_heads, kv_head, head_dim);
    const char *keys = (const char *)kv->k_cache + kv_head * row_bytes;
    const char *values = (const char *)kv->v_cache + kv_head * row_bytes;
    float row[SMALL_HEAD_DIM];
    for (int64_t t = 0; t < context_len; ++t) {
        load_cache_row(keys + slots[t] * slot_bytes, dtype, head_dim, to_scale, row);
        for (int64_t h = 0; h < group; ++h)
            scores[h * context_len + t] = scale * dot(q + h * head_dim, row, head_dim);
    }
    for (int64_t h = 0; h < group; ++h) {
        softmax_in_place(scores + h * context_len, context_len);
        for (int64_t i = 0; i < head_dim; ++i) out[h * head_dim + i] = 0.0f;
    }
    for (int64_t t = 0; t < context_len; ++t) {
        load_cache_row(values + slots[t] * slot_bytes, dtype, head_dim, to_scale, row);
        for (int64_t h = 0; h < group; ++h)
            axpy(out + h * head_dim, scores[h * context_len + t], row, head_dim);
    }
}

/* attend_rows for a constant head_dim: a float32 cache read in place, the other formats through
 * attend_converted with the format a constant too (so the row conversion unrolls). */
static inline __attribute__((always_inline)) void attend_small(
    const float *q, const paged_kv *kv, int64_t kv_head, int64_t context_len,
    const int64_t *slots, int64_t group, float scale, float *scores, float *out,
    int64_t head_dim) {
    switch (kv->cache_dtype) {
    case KVGATE_F32:
        attend_rows(q, kv, kv_head, context_len, slots, group, scale, scores, out, head_dim,
                    KVGATE_F32);
        break;
    case KVGATE_BF16:
        attend_converted(q, kv, kv_head, context_len, slots, group, scale, scores, out, head_dim,
                         KVGATE_BF16);
        break;
    case KVGATE_F16:
        attend_converted(q, kv, kv_head, context_len, slots, group, scale, scores, out, head_dim,
                         KVGATE_F16);
        break;
    case KVGATE_I8:
        attend_converted(q, kv, kv_head, context_len, slots, group, scale, scores, out, head_dim,
                         KVGATE_I8);
        break;
    case KVGATE_FP8:
        attend_converted(q, kv, kv_head, context_len, slots, group, scale, scores, out, head_dim,
                         KVGATE_FP8);
        break;
    default: /* a format without its own case: the same loops, the conversion chosen per row */
        attend_converted(q, kv, kv_head, context_len, slots, group, scale, scores, out, head_dim,
                         kv->cache_dtype);
    }
}

/*
 * Attention of `group` query heads (q: group * head_dim floats) that share KV head `kv_head`,
 * over a sequence's first `context_len` cached tokens (in `slots`), into out (group * head_dim
 * floats). scores: group * context_len floats of scratch; kv_rows: (CHUNK_TOKENS + group) *
 * head_dim floats of scratch (the rows a wide head converts at a time, then its query in the
 * form the tiled loops read).
 */
static void attend_group(const float *q, const paged_kv *kv, int64_t kv_head, int64_t context_len,
                         const int64_t *slots, int64_t group, float scale, float *scores,
                         float *out, float *kv_rows) {
    const int64_t head_dim = kv->head_dim;
#ifdef KVGATE_ATTEND_WIDE
    float *prepared = kv_rows + CHUNK_TOKENS * head_dim;
    if (head_dim == 64) {
        attend_wide(q, kv, kv_head, context_len, slots, group, scale, scores, out, kv_rows,
                    prepared, 64 / TILE_VL);
        return;
    }
    if (head_dim == 128) {
        attend_wide(q, kv, kv_head, context_len, slots, group, scale, scores, out, kv_rows,
                    prepared, 128 / TILE_VL);
        return;
    }
#endif
    /* Constant widths let the compiler unroll the row loops of small heads. */
    switch (head_dim) {
    case 8: attend_small(q, kv, kv_head, context_len, slots, group, scale, scores, out, 8); break;
    case 16: attend_small(q, kv, kv_head, context_len, slots, group, scale, scores, out, 16); break;
    case 32: attend_small(q, kv, kv_head, context_len, slots, group, scale, scores, out, 32); break;
    default:
        attend_rows(q, kv, kv_head, context_len, slots, group, scale, scores, out, head_dim,
                    kv->cache_dtype);
    }
}

#endif /* KVGATE_CPU_ATTEND_H */
