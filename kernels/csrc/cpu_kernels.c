/*
 * CPU kernels that touch each element once: rotary embedding, the KV-cache store, greedy
 * argmax, RMSNorm with its residual add, and SiLU-and-multiply, each one pass in C where the
 * PyTorch reference runs several tensor ops (and allocates a tensor for each).
 *
 * Activations are float32 or bfloat16 (cpu_common.h); arithmetic is float32, and a result is
 * rounded to the activation dtype exactly where the PyTorch reference rounds it, so the
 * bfloat16 results equal the reference's up to the last bit of a sum taken in another order.
 * The caller (kernels/cpu.py) checks shapes, dtypes and strides before every call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

/*
 * out[:D/2] = x1 * cos - x2 * sin and out[D/2:] = x2 * cos + x1 * sin per head, with cos and
 * sin the halves of a cos_sin row. Products and sums are rounded separately, as the PyTorch
 * reference rounds them (no fused multiply-add), then to `dtype`.
 */
__attribute__((optimize("fp-contract=off"))) void
kvgate_rotate_heads(const void *x, int dtype, int64_t stride, int64_t num_heads,
                    int64_t head_dim, const float *cos_sin, float *out) {
    const int64_t half = head_dim / 2;
    const float *cos = cos_sin, *sin = cos_sin + half;
    for (int64_t h = 0; h < num_heads; ++h) {
        float *o1 = out + h * head_dim, *o2 = o1 + half;
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = load_elem(x, dtype, (h * head_dim + i) * stride);
            const float x2 = load_elem(x, dtype, (h * head_dim + half + i) * stride);
            const float a = x1 * cos[i], b = x2 * sin[i];
            const float c = x2 * cos[i], d = x1 * sin[i];
            o1[i] = round_to(dtype, a - b);
            o2[i] = round_to(dtype, c + d);
        }
    }
}

/*
 * Rotary embedding of x [num_tokens, num_heads, head_dim] (heads packed, tokens `token_stride`
 * elements apart) into out (contiguous), both of `dtype`, at each token's position. Returns the
 * index of the first token whose position is outside [0, max_position), or -1 (and then
 * nothing was written).
 */
int64_t kvgate_rotary(const int64_t *positions, const float *cos_sin, int64_t max_position,
                      const void *x, int dtype, int64_t token_stride, int64_t num_tokens,
                      int64_t num_heads, int64_t head_dim, void *out, int num_threads) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_position) return t;
    const int64_t width = num_heads * head_dim, size = dtype_size(dtype);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_tokens > 64) reduction(| : failed)
    {
        float *rotated = malloc(sizeof(float) * (size_t)width);
        if (rotated == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t) {
            if (rotated == NULL) continue;
            kvgate_rotate_heads((const char *)x + t * token_stride * size, dtype, 1, num_heads,
                                head_dim, cos_sin + positions[t] * head_dim, rotated);
            store_row((char *)out + t * width * size, dtype, rotated, width);
        }
        free(rotated);
    }
    return failed ? -2 : -1;
}

/* row_width elements of src_dtype into dst of dst_dtype (rounded when narrower). */
static void convert_row(const void *src, int src_dtype, void *dst, int dst_dtype,
                        int64_t row_width) {
    if (src_dtype == dst_dtype) {
        memcpy(dst, src, (size_t)(row_width * dtype_size(src_dtype)));
        return;
    }
    for (int64_t i = 0; i < row_width; ++i)
        store_elem(dst, dst_dtype, i, load_elem(src, src_dtype, i));
}

/*
 * Copy each token's key and value rows (row_width elements of src_dtype, contiguous; tokens
 * key_stride / value_stride elements apart) into the cache slot slot_mapping[t] as cache_dtype;
 * -1 skips. Returns the index of the first token whose slot is outside [-1, num_slots), or -1
 * (and then every row was written; on an error nothing is).
 */
int64_t kvgate_store_kvcache(const void *key, int64_t key_stride, const void *value,
                             int64_t value_stride, int src_dtype, void *k_cache, void *v_cache,
                             int cache_dtype, const int64_t *slot_mapping, int64_t num_tokens,
                             int64_t row_width, int64_t num_slots) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (slot_mapping[t] < -1 || slot_mapping[t] >= num_slots) return t;
    const int64_t src_size = dtype_size(src_dtype), row_bytes = row_width * dtype_size(cache_dtype);
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        convert_row((const char *)key + t * key_stride * src_size, src_dtype,
                    (char *)k_cache + slot * row_bytes, cache_dtype, row_width);
        convert_row((const char *)value + t * value_stride * src_size, src_dtype,
                    (char *)v_cache + slot * row_bytes, cache_dtype, row_width);
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
 * RMSNorm with an optional residual add first, in Hugging Face's order: r = x + residual
 * (rounded to dtype), out = weight * (r * (1 / sqrt(mean(r^2) + eps))) (the product in
 * parentheses rounded to dtype, then the whole). Every [rows, hidden] operand has one layout:
 * row-major (column_major 0; rows *_ld elements apart) or column-major (column_major 1; columns
 * *_ld elements apart), the layout of activations computed as weight @ hidden^T. out and
 * out_residual are dense (ld = hidden or rows). With residual NULL, r is x and out_residual is
 * not written. Each row's sum of squares runs in the same order whatever its batch mates.
 */
#define RMS_ROW_BLOCK 16

typedef struct {
    const void *x, *residual, *weight;
    void *out, *out_residual;
    int64_t x_ld, res_ld, rows, hidden;
    int dtype;
    float eps;
} rms_args;

static float rms_scale(float sum_of_squares, int64_t hidden, float eps) {
    const float mean = sum_of_squares / (float)hidden;
    return (float)(1.0 / sqrt((double)(mean + eps)));
}

/* Element j of row i of a [rows, hidden] operand with leading dimension ld. */
static inline int64_t at(int column_major, int64_t i, int64_t j, int64_t ld) {
    return column_major ? j * ld + i : i * ld + j;
}

/* Rows first .. first + count - 1: sums of squares in one pass, then the outputs. */
static void rms_norm_block(const rms_args *a, int column_major, int64_t first, int64_t count) {
    const int64_t dense_ld = column_major ? a->rows : a->hidden;
    const void *summed = a->residual != NULL ? a->out_residual : a->x;
    const int64_t summed_ld = a->residual != NULL ? dense_ld : a->x_ld;
    float sum_of_squares[RMS_ROW_BLOCK] = {0.0f}, scale[RMS_ROW_BLOCK];
    for (int64_t j = 0; j < a->hidden; ++j) {
        for (int64_t i = first; i < first + count; ++i) {
            float value = load_elem(a->x, a->dtype, at(column_major, i, j, a->x_ld));
            if (a->residual != NULL) {
                value += load_elem(a->residual, a->dtype, at(column_major, i, j, a->res_ld));
                value = round_to(a->dtype, value);
                store_elem(a->out_residual, a->dtype, at(column_major, i, j, dense_ld), value);
            }
            sum_of_squares[i - first] += value * value;
        }
    }
    for (int64_t i = 0; i < count; ++i) scale[i] = rms_scale(sum_of_squares[i], a->hidden, a->eps);
    for (int64_t j = 0; j < a->hidden; ++j) {
        const float w = load_elem(a->weight, a->dtype, j);
        for (int64_t i = first; i < first + count; ++i) {
            const float r = load_elem(summed, a->dtype, at(column_major, i, j, summed_ld));
            const float normed = round_to(a->dtype, r * scale[i - first]);
            store_elem(a->out, a->dtype, at(column_major, i, j, dense_ld), w * normed);
        }
    }
}

void kvgate_rms_norm(const void *x, int64_t x_ld, const void *residual, int64_t res_ld,
                     const void *weight, void *out, void *out_residual, int64_t rows,
                     int64_t hidden, int column_major, int dtype, float eps, int num_threads) {
    const rms_args a = {x, residual, weight, out, out_residual, x_ld, res_ld, rows, hidden,
                        dtype, eps};
    /* A row-major block is one row: its elements are read in order. */
    const int64_t block = column_major ? RMS_ROW_BLOCK : 1;
    const int64_t blocks = (rows + block - 1) / block;
    const int parallel = rows * hidden >= (1 << 16);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * block;
        rms_norm_block(&a, column_major, first, rows - first < block ? rows - first : block);
    }
}

/*
 * out = silu(gate) * up, the gated activation of a Llama MLP, with silu(g) = g / (1 + e^-g)
 * rounded to dtype before the product (as torch rounds F.silu's result). The operands are
 * `outer` runs of `inner` contiguous elements: run o of gate starts at x + o * x_stride, of up
 * at x + o * x_stride + up_offset, of out at out + o * out_stride (row-major: a run is a token's
 * features; column-major: a feature's tokens).
 */
void kvgate_silu_and_mul(const void *x, int64_t x_stride, int64_t up_offset, void *out,
                         int64_t out_stride, int64_t outer, int64_t inner, int dtype,
                         int num_threads) {
    const int parallel = outer * inner >= (1 << 15);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t o = 0; o < outer; ++o) {
        for (int64_t i = 0; i < inner; ++i) {
            const float gate = load_elem(x, dtype, o * x_stride + i);
            const float up = load_elem(x, dtype, o * x_stride + up_offset + i);
            const float activated = round_to(dtype, gate / (1.0f + expf(-gate)));
            store_elem(out, dtype, o * out_stride + i, activated * up);
        }
    }
}
