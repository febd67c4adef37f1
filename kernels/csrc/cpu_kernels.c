/*
 * CPU kernels: paged decode attention reading the block cache in place, rotary embedding, the
 * KV-cache store, greedy argmax and RMSNorm, each one pass in C where the PyTorch reference
 * runs several tensor ops.
 *
 * The PyTorch reference (kernels/reference.py, paged_decode_attention) gathers every
 * sequence's blocks into one padded tensor before attending: on a CPU that copy, repeated
 * each layer of each step, costs more than the attention itself. The decode kernel here walks
 * the block table instead, one sequence per work item, so each cached key and value is read
 * once per step and nothing is copied.
 *
 * Decode attention layouts (all contiguous, float32):
 *   q            [num_seqs, num_heads, head_dim]
 *   k_cache      [num_blocks, block_size, num_kv_heads, head_dim], v_cache the same
 *   block_tables [num_seqs, max_blocks] int32
 *   context_lens [num_seqs] int32, tokens in the cache for each sequence (>= 1)
 *   out          [num_seqs, num_heads, head_dim]
 * The caller (kernels/cpu.py) checks shapes, dtypes and strides before every call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/*
 * Attention of all query heads of one sequence: scores block by block (each cached token's
 * row of all KV heads is read once, contiguously), a softmax per head, then the weighted sum
 * of values block by block. Query head h reads KV head h / group.
 */
static void attend_one_sequence(const float *q, const float *k_cache, const float *v_cache,
                                const int32_t *block_table, int64_t context_len, float *out,
                                float *scores, int64_t num_heads, int64_t group,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                float scale) {
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    for (int64_t start = 0; start < context_len; start += block_size) {
        const float *keys = k_cache + block_table[start / block_size] * block_stride;
        const int64_t count = context_len - start < block_size ? context_len - start : block_size;
        for (int64_t t = 0; t < count; ++t) {
            const float *row = keys + t * token_stride;
            for (int64_t h = 0; h < num_heads; ++h)
                scores[h * context_len + start + t] =
                    scale * dot(q + h * head_dim, row + (h / group) * head_dim, head_dim);
        }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
        softmax_in_place(scores + h * context_len, context_len);
        for (int64_t i = 0; i < head_dim; ++i) out[h * head_dim + i] = 0.0f;
    }
    for (int64_t start = 0; start < context_len; start += block_size) {
        const float *values = v_cache + block_table[start / block_size] * block_stride;
        const int64_t count = context_len - start < block_size ? context_len - start : block_size;
        for (int64_t t = 0; t < count; ++t) {
            const float *row = values + t * token_stride;
            for (int64_t h = 0; h < num_heads; ++h)
                axpy(out + h * head_dim, scores[h * context_len + start + t],
                     row + (h / group) * head_dim, head_dim);
        }
    }
}

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

/*
 * Returns 0 on success, 1 when a scratch buffer could not be allocated. The caller has
 * checked the tables with kvgate_first_invalid_sequence.
 */
int kvgate_paged_decode_attention_f32(const float *q, const float *k_cache,
                                      const float *v_cache, const int32_t *block_tables,
                                      const int32_t *context_lens, float *out, int64_t num_seqs,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                      int64_t block_size, int64_t max_blocks, float scale,
                                      int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t max_context = max_context_len(context_lens, num_seqs);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_context));
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t seq = 0; seq < num_seqs; ++seq) {
            if (scores == NULL) continue;
            attend_one_sequence(q + seq * num_heads * head_dim, k_cache, v_cache,
                                block_tables + seq * max_blocks, context_lens[seq],
                                out + seq * num_heads * head_dim, scores, num_heads, group,
                                num_kv_heads, head_dim, block_size, scale);
        }
        free(scores);
    }
    return failed;
}

/*
 * Causal attention of packed new tokens over their sequences' cached tokens: query token i of
 * sequence s (q rows cu_seqlens[s] .. cu_seqlens[s + 1] - 1, the sequence's last tokens) attends
 * to keys 0 .. its own position, read in place through the block table like decode; one query
 * token per work item. q and out are [num_tokens, num_heads, head_dim], q's tokens q_stride
 * floats apart. Returns 0 on success, 1 when a scratch buffer could not be allocated. The
 * caller has checked the tables with kvgate_first_invalid_sequence and that no sequence has
 * more queries than context.
 */
int kvgate_paged_prefill_attention_f32(const float *q, int64_t q_stride, const float *k_cache,
                                       const float *v_cache, const int32_t *block_tables,
                                       const int32_t *cu_seqlens, const int32_t *context_lens,
                                       float *out, int64_t num_seqs, int64_t num_heads,
                                       int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, int64_t max_blocks, float scale,
                                       int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t num_tokens = cu_seqlens[num_seqs];
    const int64_t max_context = max_context_len(context_lens, num_seqs);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_context));
        if (scores == NULL) failed = 1;
        int64_t seq = 0;
#pragma omp for schedule(dynamic, 4)
        for (int64_t token = 0; token < num_tokens; ++token) {
            if (scores == NULL) continue;
            while (cu_seqlens[seq + 1] <= token) ++seq;
            while (cu_seqlens[seq] > token) --seq;
            const int64_t context = context_lens[seq] - (cu_seqlens[seq + 1] - token) + 1;
            attend_one_sequence(q + token * q_stride, k_cache, v_cache,
                                block_tables + seq * max_blocks, context,
                                out + token * num_heads * head_dim, scores, num_heads, group,
                                num_kv_heads, head_dim, block_size, scale);
        }
        free(scores);
    }
    return failed;
}

/*
 * Rotary embedding, rotate_half style, of x [num_tokens, num_heads, head_dim] (head_dim
 * contiguous, heads packed, tokens `token_stride` floats apart) into out (contiguous):
 * out[:D/2] = x1 * cos - x2 * sin and out[D/2:] = x2 * cos + x1 * sin, with cos and sin the
 * halves of cos_sin's row at the token's position. Products and sums are rounded separately,
 * as the PyTorch reference rounds them (no fused multiply-add).
 * Returns the index of the first token whose position is outside [0, max_position), or -1
 * (and then nothing was written).
 */
__attribute__((optimize("fp-contract=off"))) int64_t
kvgate_rotary_f32(const int64_t *positions, const float *cos_sin, int64_t max_position,
                  const float *x, int64_t token_stride, int64_t num_tokens, int64_t num_heads,
                  int64_t head_dim, float *out, int num_threads) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_position) return t;
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens > 64)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *cos = cos_sin + positions[t] * head_dim;
        const float *sin = cos + half;
        for (int64_t h = 0; h < num_heads; ++h) {
            const float *x1 = x + t * token_stride + h * head_dim;
            const float *x2 = x1 + half;
            float *o1 = out + (t * num_heads + h) * head_dim;
            float *o2 = o1 + half;
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i] * cos[i], b = x2[i] * sin[i];
                const float c = x2[i] * cos[i], d = x1[i] * sin[i];
                o1[i] = a - b;
                o2[i] = c + d;
            }
        }
    }
    return -1;
}

/*
 * Copy each token's key and value rows (num_kv_heads * head_dim floats, contiguous; tokens
 * key_stride / value_stride floats apart) into the cache slot slot_mapping[t]; -1 skips.
 * Returns the index of the first token whose slot is outside [-1, num_slots), or -1 (and
 * then every row was written; on an error nothing is).
 */
int64_t kvgate_store_kvcache_f32(const float *key, int64_t key_stride, const float *value,
                                 int64_t value_stride, float *k_cache, float *v_cache,
                                 const int64_t *slot_mapping, int64_t num_tokens, int64_t row,
                                 int64_t num_slots) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (slot_mapping[t] < -1 || slot_mapping[t] >= num_slots) return t;
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row, key + t * key_stride, sizeof(float) * (size_t)row);
        memcpy(v_cache + slot * row, value + t * value_stride, sizeof(float) * (size_t)row);
    }
    return -1;
}

/*
 * The index of the largest value along the last dimension of x [rows, cols] (strides in
 * floats), as torch.argmax has it: the first on ties, and a NaN counts as larger than any
 * number. `best` is scratch space for `rows` floats. Logits computed as weight @ hidden^T are
 * column-major (row_stride 1): then the loop runs down the columns, every row at once.
 */
__attribute__((optimize("no-finite-math-only"))) void
kvgate_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t row_stride,
                  int64_t col_stride, int64_t *out, float *best) {
    for (int64_t r = 0; r < rows; ++r) {
        best[r] = x[r * row_stride];
        out[r] = 0;
    }
    if (row_stride == 1) {
        for (int64_t c = 1; c < cols; ++c) {
            const float *column = x + c * col_stride;
            for (int64_t r = 0; r < rows; ++r) {
                const float value = column[r];
                const int take = (value > best[r]) | ((value != value) & (best[r] == best[r]));
                best[r] = take ? value : best[r];
                out[r] = take ? c : out[r];
            }
        }
        return;
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * row_stride;
        for (int64_t c = 1; c < cols; ++c) {
            const float value = row[c * col_stride];
            if (value > best[r] || (value != value && best[r] == best[r])) {
                best[r] = value;
                out[r] = c;
            }
        }
    }
}

/*
 * RMSNorm with an optional residual add first, in Hugging Face's order: r = x + residual,
 * out = weight * (r * (1 / sqrt(mean(r^2) + eps))). Every [rows, hidden] operand has the same
 * layout: row-major (column_major 0; rows *_ld floats apart) or column-major (column_major 1;
 * columns *_ld floats apart), the layout of activations computed as weight @ hidden^T. out and
 * out_residual are dense (ld = hidden or rows). With residual NULL, r is x and out_residual
 * is not written. Each row's sum of squares runs in the same order whatever its batch mates.
 */
#define RMS_ROW_BLOCK 16

static float rms_scale(float sum_of_squares, int64_t hidden, float eps) {
    const float mean = sum_of_squares / (float)hidden;
    return (float)(1.0 / sqrt((double)(mean + eps)));
}

static void rms_norm_rows(const float *x, int64_t x_ld, const float *residual, int64_t res_ld,
                          const float *weight, float *out, float *out_residual, int64_t row,
                          int64_t hidden, float eps) {
    const float *xr = x + row * x_ld;
    const float *summed = xr;
    float sum_of_squares = 0.0f;
    if (residual != NULL) {
        const float *rr = residual + row * res_ld;
        float *sr = out_residual + row * hidden;
        for (int64_t j = 0; j < hidden; ++j) {
            const float value = xr[j] + rr[j];
            sr[j] = value;
            sum_of_squares += value * value;
        }
        summed = sr;
    } else {
        for (int64_t j = 0; j < hidden; ++j) sum_of_squares += xr[j] * xr[j];
    }
    const float scale = rms_scale(sum_of_squares, hidden, eps);
    float *o = out + row * hidden;
    for (int64_t j = 0; j < hidden; ++j) o[j] = weight[j] * (summed[j] * scale);
}

static void rms_norm_column_block(const float *x, int64_t x_ld, const float *residual,
                                  int64_t res_ld, const float *weight, float *out,
                                  float *out_residual, int64_t first, int64_t count,
                                  int64_t rows, int64_t hidden, float eps) {
    float sum_of_squares[RMS_ROW_BLOCK] = {0.0f};
    float scale[RMS_ROW_BLOCK];
    for (int64_t j = 0; j < hidden; ++j) {
        const float *xc = x + j * x_ld + first;
        if (residual != NULL) {
            const float *rc = residual + j * res_ld + first;
            float *sc = out_residual + j * rows + first;
            for (int64_t i = 0; i < count; ++i) {
                const float value = xc[i] + rc[i];
                sc[i] = value;
                sum_of_squares[i] += value * value;
            }
        } else {
            for (int64_t i = 0; i < count; ++i) sum_of_squares[i] += xc[i] * xc[i];
        }
    }
    for (int64_t i = 0; i < count; ++i) scale[i] = rms_scale(sum_of_squares[i], hidden, eps);
    for (int64_t j = 0; j < hidden; ++j) {
        const float *summed = residual != NULL ? out_residual + j * rows + first
                                               : x + j * x_ld + first;
        float *o = out + j * rows + first;
        for (int64_t i = 0; i < count; ++i) o[i] = weight[j] * (summed[i] * scale[i]);
    }
}

void kvgate_rms_norm_f32(const float *x, int64_t x_ld, const float *residual, int64_t res_ld,
                         const float *weight, float *out, float *out_residual, int64_t rows,
                         int64_t hidden, int column_major, float eps, int num_threads) {
    const int parallel = rows * hidden >= (1 << 16);
    if (!column_major) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
        for (int64_t row = 0; row < rows; ++row)
            rms_norm_rows(x, x_ld, residual, res_ld, weight, out, out_residual, row, hidden, eps);
        return;
    }
    const int64_t blocks = (rows + RMS_ROW_BLOCK - 1) / RMS_ROW_BLOCK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * RMS_ROW_BLOCK;
        const int64_t count = rows - first < RMS_ROW_BLOCK ? rows - first : RMS_ROW_BLOCK;
        rms_norm_column_block(x, x_ld, residual, res_ld, weight, out, out_residual, first,
                              count, rows, hidden, eps);
    }
}
