/*
 * Paged attention on the CPU, reading the block cache in place, and one layer's whole attention
 * step (rotary embedding, KV-cache store, attention) in one call.
 *
 * The PyTorch reference (kernels/reference.py) gathers every sequence's blocks into one padded
 * tensor before attending: on a CPU that copy, repeated each layer of each step, costs more
 * than the attention itself. These kernels walk the block table instead, one (sequence or
 * query token, KV head) per work item, so each cached key and value is read once per step per
 * item and nothing is copied; the query heads that share a KV head are served together.
 *
 * Layouts (contiguous unless a stride is passed):
 *   q            [num_tokens, num_heads, head_dim]        (activation dtype: float32, bfloat16)
 *   k_cache      [num_blocks, block_size, num_kv_heads, head_dim], v_cache the same (cache dtype:
 *                float32, bfloat16, float16; an int8 or fp8 cache's tokens are
 *                num_kv_heads * head_dim bytes and a bfloat16 scale, cpu_common.h)
 *   block_tables [num_seqs, max_blocks] int32
 *   context_lens [num_seqs] int32, tokens in the cache for each sequence (>= 1)
 *   out          [num_tokens, num_heads, head_dim]        (activation dtype)
 * Scores, softmax and sums are float32 whatever the dtypes. The activation and cache dtypes are
 * separate arguments: a bfloat16 cache may serve float32 activations and the other way round.
 * Heads of 64 or 128 values run the register-tiled loops of cpu_attention_tiles.h (AVX-512 and
 * AVX2 levels), which read float32 and bfloat16 rows in place. The rows of another 16-bit, int8 or other cache format are
 * converted to float32 once per work item, rather than once per query head inside each dot
 * product: a chunk of tokens at a time into scratch for wide heads, one row at a time for
 * narrow heads (head_dim <= 32).
 * The caller (kernels/cpu.py) checks shapes, dtypes, strides and tables before every call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_common.h"
#include "cpu_transpose.h"

/* Multiply-adds of attention below which one thread does the whole step's attention. */
#define MIN_PARALLEL_WORK (1 << 18)

#include "cpu_attend.h"

static int64_t max_context_len(const int32_t *context_lens, int64_t num_seqs) {
    int64_t longest = 0;
    for (int64_t s = 0; s < num_seqs; ++s)
        longest = context_lens[s] > longest ? context_lens[s] : longest;
    return longest;
}

/*
 * Index of the first sequence whose context length or block table entries are out of range
 * (a context of 0 or beyond its table, or a block id outside the cache), or -1 when all are
 * valid. Only the entries a sequence's context uses are read; the rest may hold anything.
 */
int64_t kvgate_first_invalid_sequence(const int32_t *block_tables, const int32_t *context_lens,
                                      int64_t num_seqs, int64_t max_blocks, int64_t block_size,
                                      int64_t num_blocks) {
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t context_len = context_lens[s];
        const int64_t used_blocks = (context_len + block_size - 1) / block_size;
        if (context_len < 1 || used_blocks > max_blocks) return s;
        for (int64_t b = 0; b < used_blocks; ++b) {
            const int32_t block = block_tables[s * max_blocks + b];
            if (block < 0 || block >= num_blocks) return s;
        }
    }
    return -1;
}

/* Index of the first of n values outside [low, high), or -1. */
int64_t kvgate_first_out_of_range(const int64_t *values, int64_t n, int64_t low, int64_t high) {
    for (int64_t i = 0; i < n; ++i)
        if (values[i] < low || values[i] >= high) return i;
    return -1;
}

/* Per-thread scratch of the attention loops: scores, a query group and its output, a chunk of
 * wide heads' converted K or V rows (float32), and a sequence's cache slots. scores is NULL when
 * malloc failed. */
typedef struct {
    float *scores, *q, *out, *kv_rows;
    int64_t *slots;
} attention_scratch;

static attention_scratch scratch_alloc(int64_t group, int64_t head_dim, int64_t max_context) {
    attention_scratch s;
    const int64_t rows = (CHUNK_TOKENS + group) * head_dim;
    const int64_t floats = group * max_context + 2 * group * head_dim + rows;
    s.slots = malloc(sizeof(int64_t) * (size_t)(max_context > 0 ? max_context : 1));
    s.scores = s.slots == NULL ? NULL : malloc(sizeof(float) * (size_t)(floats > 0 ? floats : 1));
    s.q = s.scores + group * max_context;
    s.out = s.q + group * head_dim;
    s.kv_rows = s.out + group * head_dim;
    return s;
}

static void scratch_free(attention_scratch *s) {
    free(s->scores);
    free(s->slots);
}

/*
 * One work item: the `group` query heads of KV head `kv_head` of query row `q_row` (q of
 * q_dtype, rows q_stride elements apart, heads contiguous) over context_len cached tokens, into
 * row `out_row` of out (contiguous [rows, num_heads, head_dim] of out_dtype).
 */
static void attend_item(const void *q, int q_dtype, int64_t q_stride, int64_t q_row,
                        const paged_kv *kv, int64_t kv_head, int64_t context_len, int64_t group,
                        float scale, const attention_scratch *s, void *out, int out_dtype,
                        int64_t out_row) {
    const int64_t width = group * kv->head_dim;
    const int64_t q_offset = q_row * q_stride + kv_head * width;
    load_row((const char *)q + q_offset * dtype_size(q_dtype), q_dtype, width, s->q);
    sequence_slots(kv, context_len, s->slots);
    attend_group(s->q, kv, kv_head, context_len, s->slots, group, scale, s->scores, s->out,
                 s->kv_rows);
    const int64_t out_offset = (out_row * kv->num_kv_heads + kv_head) * width;
    store_row((char *)out + out_offset * dtype_size(out_dtype), out_dtype, s->out, width);
}

/*
 * Decode attention: one query token per sequence, work items (sequence, KV head). Returns 0 on
 * success, 1 when a scratch buffer could not be allocated. The caller has checked the tables
 * with kvgate_first_invalid_sequence.
 */
int kvgate_paged_decode_attention(const void *q, int act_dtype, const void *k_cache,
                                  const void *v_cache, int cache_dtype,
                                  const int32_t *block_tables, const int32_t *context_lens,
                                  void *out, int64_t num_seqs, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  int64_t max_blocks, float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t max_context = max_context_len(context_lens, num_seqs);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        attention_scratch s = scratch_alloc(group, head_dim, max_context);
        if (s.scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * num_kv_heads; ++item) {
            if (s.scores == NULL) continue;
            const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
            const paged_kv kv = {k_cache, v_cache, cache_dtype, block_tables + seq * max_blocks,
                                 num_kv_heads, head_dim, block_size};
            attend_item(q, act_dtype, num_heads * head_dim, seq, &kv, kv_head, context_lens[seq],
                        group, scale, &s, out, act_dtype, seq);
        }
        scratch_free(&s);
    }
    return failed;
}

/* The sequence that owns packed query token `token`, searched from `seq` (a previous answer). */
static int64_t owning_sequence(const int32_t *cu_seqlens, int64_t token, int64_t seq) {
    while (cu_seqlens[seq + 1] <= token) ++seq;
    while (cu_seqlens[seq] > token) --seq;
    return seq;
}

/* Prefill work item `item` (token, KV head) of packed queries, whose rows start at row_offset of
 * q and out; `seq` is where the search for the owning sequence starts. Returns that sequence. */
static int64_t prefill_item(const void *q, int q_dtype, int64_t q_stride, const paged_kv *base,
                            const int32_t *block_tables, int64_t max_blocks,
                            const int32_t *cu_seqlens, const int32_t *context_lens, int64_t item,
                            int64_t seq, int64_t group, float scale, const attention_scratch *s,
                            void *out, int out_dtype, int64_t row_offset) {
    const int64_t token = item / base->num_kv_heads, kv_head = item % base->num_kv_heads;
    seq = owning_sequence(cu_seqlens, token, seq);
    const int64_t context = context_lens[seq] - (cu_seqlens[seq + 1] - token) + 1;
    paged_kv kv = *base;
    kv.block_table = block_tables + seq * max_blocks;
    attend_item(q, q_dtype, q_stride, row_offset + token, &kv, kv_head, context, group, scale, s,
                out, out_dtype, row_offset + token);
    return seq;
}

/*
 * Causal attention of packed new tokens over their sequences' cached tokens: query token i of
 * sequence s (q rows cu_seqlens[s] .. cu_seqlens[s + 1] - 1, the sequence's last tokens) attends
 * to keys 0 .. its own position; work items (query token, KV head). q's tokens are q_stride
 * elements apart (heads contiguous). Returns 0 on success, 1 when a scratch buffer could not be
 * allocated. The caller has checked the tables with kvgate_first_invalid_sequence and that no
 * sequence has more queries than context.
 */
int kvgate_paged_prefill_attention(const void *q, int act_dtype, int64_t q_stride,
                                   const void *k_cache, const void *v_cache, int cache_dtype,
                                   const int32_t *block_tables, const int32_t *cu_seqlens,
                                   const int32_t *context_lens, void *out, int64_t num_seqs,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, int64_t max_blocks, float scale,
                                   int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t num_items = (int64_t)cu_seqlens[num_seqs] * num_kv_heads;
    const int64_t max_context = max_context_len(context_lens, num_seqs);
    const paged_kv base = {k_cache, v_cache, cache_dtype, block_tables, num_kv_heads, head_dim,
                           block_size};
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        attention_scratch s = scratch_alloc(group, head_dim, max_context);
        if (s.scores == NULL) failed = 1;
        int64_t seq = 0;
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < num_items; ++item) {
            if (s.scores == NULL) continue;
            seq = prefill_item(q, act_dtype, q_stride, &base, block_tables, max_blocks,
                               cu_seqlens, context_lens, item, seq, group, scale, &s, out,
                               act_dtype, 0);
        }
        scratch_free(&s);
    }
    return failed;
}

/*
 * Rotary embedding of one token's query and key heads (qkv row: q heads, k heads, v heads, of
 * act_dtype, elements `feature_stride` apart) into q_rotated (float32, rounded to act_dtype),
 * and its key and value into cache slot `slot` (skipped when -1). key: num_kv_heads * head_dim
 * floats of scratch.
 */
static void rotate_and_store(const kvgate_attention_step *st, const char *row, int act_dtype,
                             int64_t feature_stride, int64_t t, void *k_cache, void *v_cache,
                             int cache_dtype, float *q_rotated, float *key) {
    const int64_t d = st->head_dim, q_width = st->num_heads * d, kv_width = st->num_kv_heads * d;
    const int64_t element = dtype_size(act_dtype) * feature_stride;
    const float *cos_sin = st->cos_sin + st->positions[t] * d;
    kvgate_rotate_heads(row, act_dtype, feature_stride, st->num_heads, d, cos_sin,
                        q_rotated + t * q_width);
    const int64_t slot = st->slot_mapping[t];
    if (slot < 0) return;
    const int64_t slot_bytes = cache_slot_bytes(cache_dtype, st->num_kv_heads, d);
    kvgate_rotate_heads(row + q_width * element, act_dtype, feature_stride, st->num_kv_heads, d,
                        cos_sin, key);
    store_cache_rows((char *)k_cache + slot * slot_bytes, cache_dtype, key, st->num_kv_heads, d);
    const char *value = row + (q_width + kv_width) * element;
    for (int64_t i = 0; i < kv_width; ++i) key[i] = load_elem(value, act_dtype, i * feature_stride);
    store_cache_rows((char *)v_cache + slot * slot_bytes, cache_dtype, key, st->num_kv_heads, d);
}

/* Tokens of a column-major q/k/v whose features are copied row-major together. */
#define ROTARY_TILE_TOKENS 16

/*
 * The first phase of kvgate_attention_layer, shared out among the threads of the enclosing
 * parallel region: rotate_and_store for every token. A column-major qkv (token_stride 1) is
 * copied row-major ROTARY_TILE_TOKENS tokens at a time into a tile first (cpu_transpose.h).
 * key: rotate_and_store's scratch. Every thread of the region must call it; one whose key is
 * NULL does no work. Returns 1 when key is NULL or the tile could not be allocated, else 0.
 */
static int rotate_and_store_all(const kvgate_attention_step *st, const void *qkv, int act_dtype,
                                int64_t token_stride, int64_t feature_stride, void *k_cache,
                                void *v_cache, int cache_dtype, float *q_rotated, float *key) {
    const int64_t size = dtype_size(act_dtype);
    if (token_stride != 1 || feature_stride == 1) {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < st->num_tokens; ++t)
            if (key != NULL)
                rotate_and_store(st, (const char *)qkv + t * token_stride * size, act_dtype,
                             feature_stride, t, k_cache, v_cache, cache_dtype, q_rotated, key);
        return key == NULL;
    }
    const int64_t width = (st->num_heads + 2 * st->num_kv_heads) * st->head_dim;
    void *tile = malloc(sizeof(float) * (size_t)(ROTARY_TILE_TOKENS * width));
#pragma omp for schedule(static)
    for (int64_t t0 = 0; t0 < st->num_tokens; t0 += ROTARY_TILE_TOKENS) {
        const int64_t count = st->num_tokens - t0 < ROTARY_TILE_TOKENS ? st->num_tokens - t0
                                                                       : ROTARY_TILE_TOKENS;
        if (key == NULL || tile == NULL) continue;
        transpose_tile(qkv, act_dtype, feature_stride, t0, count, width, tile);
        for (int64_t t = 0; t < count; ++t)
            rotate_and_store(st, (const char *)tile + t * width * size, act_dtype, 1, t0 + t,
                             k_cache, v_cache, cache_dtype, q_rotated, key);
    }
    free(tile);
    return key == NULL || tile == NULL;
}

/*
 * One layer's attention for the whole step: rotary embedding of every token's query and key,
 * its key and value stored in the cache, then decode attention of the one-token sequences and
 * causal prefill attention of the rest, all inside one parallel region (the stores finish
 * before any attention reads the cache). qkv: [num_tokens, (num_heads + 2 * num_kv_heads) *
 * head_dim] of act_dtype, element (t, f) at qkv[t * token_stride + f * feature_stride] (row-
 * or column-major). out: contiguous [num_tokens, num_heads * head_dim] of act_dtype.
 * q_rotated: num_tokens * num_heads * head_dim floats of scratch. Returns 0 on success, 1 when
 * a scratch buffer could not be allocated.
 */
int kvgate_attention_layer(const kvgate_attention_step *st, const void *qkv, int act_dtype,
                           int64_t token_stride, int64_t feature_stride, void *k_cache,
                           void *v_cache, int cache_dtype, void *out, float *q_rotated) {
    const int64_t group = st->num_heads / st->num_kv_heads, d = st->head_dim;
    const int64_t decode_items = st->num_decode * st->num_kv_heads;
    const int64_t num_items = st->num_tokens * st->num_kv_heads;
    const int64_t longest = max_context_len(st->decode_lens, st->num_decode);
    const int64_t prefill_longest = max_context_len(st->prefill_lens, st->num_prefill_seqs);
    int64_t max_context = longest > prefill_longest ? longest : prefill_longest;
    /* The score scratch also holds one token's rotated keys in the first phase. */
    const int64_t key_floats = (st->num_kv_heads * d + group - 1) / group;
    max_context = max_context > key_floats ? max_context : key_floats;
    const paged_kv decode = {k_cache, v_cache, cache_dtype, st->decode_tables, st->num_kv_heads,
                             d, st->block_size};
    paged_kv prefill = decode;
    prefill.block_table = st->prefill_tables;
    /* A small step (one stream at a short context) costs less than waking the other threads. */
    int64_t context_tokens = 0;
    for (int64_t s = 0; s < st->num_decode; ++s) context_tokens += st->decode_lens[s];
    for (int64_t s = 0; s < st->num_prefill_seqs; ++s)
        context_tokens += st->prefill_lens[s] * (st->cu_seqlens[s + 1] - st->cu_seqlens[s]);
    const int parallel = context_tokens * st->num_heads * d >= MIN_PARALLEL_WORK;
    int failed = 0;
#pragma omp parallel num_threads(st->num_threads) if (parallel) reduction(| : failed)
    {
        attention_scratch s = scratch_alloc(group, d, max_context);
        if (s.scores == NULL) failed = 1;
        failed |= rotate_and_store_all(st, qkv, act_dtype, token_stride, feature_stride, k_cache,
                                       v_cache, cache_dtype, q_rotated, s.scores);
        int64_t seq = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            if (s.scores == NULL) continue;
            if (item < decode_items) {
                const int64_t token = item / st->num_kv_heads;
                paged_kv kv = decode;
                kv.block_table = st->decode_tables + token * st->decode_width;
                attend_item(q_rotated, KVGATE_F32, st->num_heads * d, token, &kv,
                            item % st->num_kv_heads, st->decode_lens[token], group, st->scale,
                            &s, out, act_dtype, token);
            } else {
                seq = prefill_item(q_rotated, KVGATE_F32, st->num_heads * d, &prefill,
                                   st->prefill_tables, st->prefill_width, st->cu_seqlens,
                                   st->prefill_lens, item - decode_items, seq, group, st->scale,
                                   &s, out, act_dtype, st->num_decode);
            }
        }
        scratch_free(&s);
    }
    return failed;
}

/* Whether heads of 64 and 128 values take the register tiles of cpu_attention_tiles.h (every
 * level but the portable one; the kernel tests check it). */
int kvgate_attention_tiles_built(void) {
#ifdef KVGATE_ATTEND_WIDE
    return 1;
#else
    return 0;
#endif
}
