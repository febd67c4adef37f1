/*
 * Every decoder layer of a decode step in one call: for each layer, RMSNorm with the
 * residual add, the fused q/k/v projection, rotary + KV store + attention, the output
 * projection, RMSNorm, the fused gate/up projection, SiLU-and-multiply and the down projection,
 * each by the kernel the step would run one call at a time (cpu_kernels.c, cpu_linear.c,
 * cpu_attention.c), with no Python between them.
 *
 * At one stream a decode step of a small model is some 240 kernel calls; their Python wrappers
 * and argument conversions cost more than a third of the step. Here a step makes one call.
 * Activations are column-major [features, m] buffers of the activation dtype, the layout the
 * linear kernels write and the other kernels read in place; the attention output is row-major.
 *
 * Up to small_rows tokens the linear layers run on the small-batch kernels (kvgate_linear).
 * Above that, up to 64, on the outer-product kernels that kernels/cpu_linear.py takes for them
 * one call at a time (the caller checks that it would for every weight): x^T widened to float32
 * (and transposed, for the attention's row-major output), float32 sums, the bias added in
 * float32, and the result rounded once to the activation dtype, as that path does with torch.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu_common.h"

typedef struct {
    const void *input_norm, *post_norm; /* [hidden] of the activation dtype */
    kvgate_linear_weights qkv, o, gate_up, down;
    void *k_cache, *v_cache;
} kvgate_layer;

typedef struct {
    const kvgate_layer *layers;
    int64_t num_layers, hidden, intermediate;
    float eps;
    int act_dtype, cache_dtype;
    int64_t small_rows; /* the most tokens the small-batch linear kernels take */
} kvgate_decoder;

/* The activation buffers of one call, column-major [features, m]; above small_rows tokens also
 * the linear layers' float32 scratch: x^T [in, m] and the sums [out, m]. */
typedef struct {
    char *hidden, *normed, *qkv, *attn, *gate_up, *act;
    float *q_rotated, *x32, *sums32;
} buffers;

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    const int64_t ab = a > b ? a : b;
    return ab > c ? ab : c;
}

static char *take(char **cursor, int64_t elements, int64_t element_size) {
    char *start = *cursor;
    *cursor += (elements * element_size + 63) / 64 * 64;
    return start;
}

/* One block of memory cut into the buffers; NULL when malloc failed. */
static void *alloc_buffers(const kvgate_decoder *d, const kvgate_attention_step *st, int64_t m,
                           buffers *b) {
    const int64_t size = dtype_size(d->act_dtype), q_width = st->num_heads * st->head_dim;
    const int64_t qkv_width = q_width + 2 * st->num_kv_heads * st->head_dim;
    const int64_t inputs = max3(d->hidden, q_width, d->intermediate);
    const int64_t outputs = max3(qkv_width, d->hidden, 2 * d->intermediate);
    const int64_t wide = m > d->small_rows;
    const int64_t widths[] = {d->hidden, d->hidden, qkv_width, q_width, 2 * d->intermediate,
                              d->intermediate, q_width, wide * inputs, wide * outputs};
    int64_t total = 0;
    for (int i = 0; i < 9; ++i) total += (widths[i] * m * (i >= 6 ? 4 : size) + 63) / 64 * 64;
    char *block = aligned_alloc(64, (size_t)(total > 0 ? total : 64));
    if (block == NULL) return NULL;
    char *cursor = block;
    b->hidden = take(&cursor, d->hidden * m, size);
    b->normed = take(&cursor, d->hidden * m, size);
    b->qkv = take(&cursor, qkv_width * m, size);
    b->attn = take(&cursor, q_width * m, size);
    b->gate_up = take(&cursor, 2 * d->intermediate * m, size);
    b->act = take(&cursor, d->intermediate * m, size);
    b->q_rotated = (float *)take(&cursor, q_width * m, 4);
    b->x32 = (float *)take(&cursor, wide * inputs * m, 4);
    b->sums32 = (float *)take(&cursor, wide * outputs * m, 4);
    return block;
}

/* Seconds spent in each kind of kernel since the last read, when timing is on (profiling:
 * bench/cpu.py profile_step). Kinds: 0 RMSNorm, 1 linear, 2 attention, 3 SiLU-and-multiply. */
enum { TIMED_NORM, TIMED_LINEAR, TIMED_ATTENTION, TIMED_ACTIVATION, TIMED_KINDS };
static int timing_on;
static double timed_seconds[TIMED_KINDS];

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define TIMED(kind, call)                                     \
    do {                                                      \
        const double start_ = timing_on ? now_s() : 0.0;      \
        call;                                                 \
        if (timing_on) timed_seconds[kind] += now_s() - start_; \
    } while (0)

/* Turn timing on or off; returns the seconds per kind so far in out[TIMED_KINDS] and resets. */
void kvgate_decoder_timing(int on, double *out) {
    for (int i = 0; i < TIMED_KINDS; ++i) {
        out[i] = timed_seconds[i];
        timed_seconds[i] = 0.0;
    }
    timing_on = on;
}

/* n float32 sums (and the bias, of the activation dtype, per output row of m) into out of the
 * activation dtype, rounded once. */
static void finish_sums(const float *sums, const void *bias, int dtype, int64_t n, int64_t m,
                        void *out, int threads) {
    const int parallel = n * m >= (1 << 16);
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
    for (int64_t r = 0; r < n; ++r) {
        const float b = bias != NULL ? load_elem(bias, dtype, r) : 0.0f;
        const float *from = sums + r * m;
        if (dtype == KVGATE_F32) {
            float *to = (float *)out + r * m;
            for (int64_t i = 0; i < m; ++i) to[i] = from[i] + b;
        } else {
            uint16_t *to = (uint16_t *)out + r * m;
            for (int64_t i = 0; i < m; ++i) to[i] = f32_to_bf16(from[i] + b);
        }
    }
}

/*
 * out (column-major [n, m] of the activation dtype) = w @ x^T + bias for m tokens of x (element
 * (i, j) at x[i * row_stride + j * col_stride]): the small-batch kernel up to small_rows tokens,
 * else the outer-product kernels over x^T widened to float32 (see the top of the file). Returns
 * 0, 1 when out of memory, 2 when the kernel cannot take these weights.
 */
static int layer_linear(const kvgate_decoder *d, const kvgate_linear_weights *w, const void *x,
                        int64_t row_stride, int64_t col_stride, int64_t m, void *out,
                        const buffers *b, int threads) {
    const int dtype = d->act_dtype;
    if (m <= d->small_rows)
        return kvgate_linear(w, x, dtype, row_stride, col_stride, m, out, dtype, threads);
    const int64_t n = w->out_features, k = w->in_features;
    const float *x_t = x;
    if (dtype != KVGATE_F32 || row_stride != 1 || col_stride != m) {
        if (row_stride == 1 && col_stride == m) {
            load_row(x, dtype, k * m, b->x32);
        } else {
            for (int64_t j = 0; j < k; ++j)
                for (int64_t i = 0; i < m; ++i)
                    b->x32[j * m + i] = load_elem(x, dtype, i * row_stride + j * col_stride);
        }
        x_t = b->x32;
    }
    const int dense = w->kind == KVGATE_W_F32 || w->kind == KVGATE_W_BF16;
    if (dense && dtype == KVGATE_F32)
        return kvgate_linear_columns(w->q, 0, w->bias, x_t, m, n, k, out, threads);
    /* The kernel would add the bias to the finished float32 sum: the same one addition. */
    const int failed =
        dense ? kvgate_linear_columns(w->q, w->kind == KVGATE_W_BF16, NULL, x_t, m, n, k,
                                      b->sums32, threads)
              : kvgate_linear_columns_quantized(w, x_t, m, b->sums32, threads);
    if (!failed) finish_sums(b->sums32, w->bias, dtype, n, m, out, threads);
    return failed;
}

/* One layer; hidden holds its input and receives its output, residual the running sum. */
static int run_layer(const kvgate_decoder *d, const kvgate_layer *layer,
                     const kvgate_attention_step *st, const buffers *b, void *residual,
                     int first, int64_t m, int threads) {
    const int dtype = d->act_dtype;
    const int64_t q_width = st->num_heads * st->head_dim;
    int failed = 0;
    /* Layer 0 has no residual yet: the sum is its input itself. */
    if (first) memcpy(residual, b->hidden, (size_t)(d->hidden * m * dtype_size(dtype)));
    TIMED(TIMED_NORM, kvgate_rms_norm(b->hidden, m, first ? NULL : residual, m, layer->input_norm,
                                      b->normed, first ? NULL : residual, m, d->hidden, 1, dtype,
                                      d->eps, threads));
    /* A failed kernel ends the layer: nothing after it reads its unwritten output. */
    TIMED(TIMED_LINEAR,
          failed = layer_linear(d, &layer->qkv, b->normed, 1, m, m, b->qkv, b, threads));
    if (failed) return failed;
    TIMED(TIMED_ATTENTION,
          failed = kvgate_attention_layer(st, b->qkv, dtype, 1, m, layer->k_cache,
                                          layer->v_cache, d->cache_dtype, b->attn, b->q_rotated));
    if (failed) return failed;
    TIMED(TIMED_LINEAR,
          failed = layer_linear(d, &layer->o, b->attn, q_width, 1, m, b->hidden, b, threads));
    if (failed) return failed;
    TIMED(TIMED_NORM, kvgate_rms_norm(b->hidden, m, residual, m, layer->post_norm, b->normed,
                                      residual, m, d->hidden, 1, dtype, d->eps, threads));
    TIMED(TIMED_LINEAR, failed = layer_linear(d, &layer->gate_up, b->normed, 1, m, m,
                                               b->gate_up, b, threads));
    if (failed) return failed;
    TIMED(TIMED_ACTIVATION, kvgate_silu_and_mul(b->gate_up, m, d->intermediate * m, b->act, m,
                                                d->intermediate, m, dtype, threads));
    TIMED(TIMED_LINEAR,
          failed = layer_linear(d, &layer->down, b->act, 1, m, m, b->hidden, b, threads));
    return failed;
}

/*
 * Run every layer on the step's m tokens. hidden_in: [m, hidden] row-major embeddings.
 * hidden_out and residual_out: [hidden, m] column-major, the last layer's output and the
 * running residual sum (what the final norm takes). Returns 0 on success, 1 when out of
 * memory, 2 when a linear kernel cannot take its weights (the caller's routing rules that
 * out). The caller (kernels/cpu_decoder.py) has checked the step and the weights.
 */
int kvgate_decode_layers(const kvgate_decoder *d, const kvgate_attention_step *st,
                         const void *hidden_in, void *hidden_out, void *residual_out, int64_t m,
                         int num_threads) {
    buffers b;
    void *block = alloc_buffers(d, st, m, &b);
    if (block == NULL) return 1;
    const int dtype = d->act_dtype;
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < d->hidden; ++j)
            store_elem(b.hidden, dtype, j * m + i, load_elem(hidden_in, dtype, i * d->hidden + j));
    int failed = 0;
    for (int64_t l = 0; l < d->num_layers && !failed; ++l)
        failed = run_layer(d, &d->layers[l], st, &b, residual_out, l == 0, m, num_threads);
    memcpy(hidden_out, b.hidden, (size_t)(d->hidden * m * dtype_size(dtype)));
    free(block);
    return failed;
}
