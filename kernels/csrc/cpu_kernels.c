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
/* Contiguous heads (stride 1), typed so the loops vectorize. */
#define ROTATE_CONTIGUOUS(name, T, LOAD, ROUND)                                               \
    __attribute__((optimize("fp-contract=off"))) static void name(                            \
        const T *x, int64_t num_heads, int64_t head_dim, const float *cos, float *out) {      \
        const int64_t half = head_dim / 2;                                                    \
        const float *sin = cos + half;                                                        \
        for (int64_t h = 0; h < num_heads; ++h) {                                             \
            const T *x1 = x + h * head_dim, *x2 = x1 + half;                                  \
            float *o1 = out + h * head_dim, *o2 = o1 + half;                                  \
            for (int64_t i = 0; i < half; ++i) {                                              \
                const float a = LOAD(x1[i]) * cos[i], b = LOAD(x2[i]) * sin[i];               \
                const float c = LOAD(x2[i]) * cos[i], d = LOAD(x1[i]) * sin[i];               \
                o1[i] = ROUND(a - b);                                                         \
                o2[i] = ROUND(c + d);                                                         \
            }                                                                                 \
        }                                                                                     \
    }

#define ROUND_F32(v) (v)
#define ROUND_BF16(v) bf16_to_f32(f32_to_bf16(v))
ROTATE_CONTIGUOUS(rotate_contiguous_f32, float, (float), ROUND_F32)
ROTATE_CONTIGUOUS(rotate_contiguous_bf16, uint16_t, bf16_to_f32, ROUND_BF16)

__attribute__((optimize("fp-contract=off"))) void
kvgate_rotate_heads(const void *x, int dtype, int64_t stride, int64_t num_heads,
                    int64_t head_dim, const float *cos_sin, float *out) {
    if (stride == 1) {
        if (dtype == KVGATE_BF16)
            rotate_contiguous_bf16(x, num_heads, head_dim, cos_sin, out);
        else
            rotate_contiguous_f32(x, num_heads, head_dim, cos_sin, out);
        return;
    }
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

/*
 * Copy each token's key and value rows (num_kv_heads * head_dim elements of src_dtype,
 * contiguous; tokens key_stride / value_stride elements apart) into the cache slot
 * slot_mapping[t] as cache_dtype (int8, fp8: quantized per token, cpu_common.h); -1 skips. Returns
 * the index of the first token whose slot is outside [-1, num_slots), or -1 (and then every
 * row was written; on an error nothing is).
 */
int64_t kvgate_store_kvcache(const void *key, int64_t key_stride, const void *value,
                             int64_t value_stride, int src_dtype, void *k_cache, void *v_cache,
                             int cache_dtype, const int64_t *slot_mapping, int64_t num_tokens,
                             int64_t num_kv_heads, int64_t head_dim, int64_t num_slots) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (slot_mapping[t] < -1 || slot_mapping[t] >= num_slots) return t;
    const int64_t src_size = dtype_size(src_dtype);
    const int64_t row_bytes = cache_slot_bytes(cache_dtype, num_kv_heads, head_dim);
    const int64_t width = num_kv_heads * head_dim;
    float *row = malloc(sizeof(float) * (size_t)width);
    if (row == NULL) return -2;
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        load_row((const char *)key + t * key_stride * src_size, src_dtype, width, row);
        store_cache_rows((char *)k_cache + slot * row_bytes, cache_dtype, row, num_kv_heads,
                         head_dim);
        load_row((const char *)value + t * value_stride * src_size, src_dtype, width, row);
        store_cache_rows((char *)v_cache + slot * row_bytes, cache_dtype, row, num_kv_heads,
                         head_dim);
    }
    free(row);
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

/*
 * Column-major rows first .. first + count - 1 (count <= RMS_ROW_BLOCK): sums of squares in one
 * pass down the features, then the outputs; the inner loops run along the rows, contiguous.
 * T is the element type, LOAD/STORE convert it from/to float32 (STORE rounds as the dtype's).
 */
#define RMS_COLUMNS(name, T, LOAD, STORE)                                                     \
    static void name(const rms_args *a, int64_t first, int64_t count) {                       \
        const T *x = (const T *)a->x + first, *residual = a->residual;                        \
        T *out = (T *)a->out + first;                                                         \
        T *out_residual = a->residual != NULL ? (T *)a->out_residual + first : NULL;          \
        const T *summed = residual != NULL ? out_residual : x;                                \
        const int64_t summed_ld = residual != NULL ? a->rows : a->x_ld;                       \
        float sum_of_squares[RMS_ROW_BLOCK] = {0.0f}, scale[RMS_ROW_BLOCK];                   \
        for (int64_t j = 0; j < a->hidden; ++j) {                                             \
            for (int64_t i = 0; i < count; ++i) {                                             \
                float value = LOAD(x[j * a->x_ld + i]);                                       \
                if (residual != NULL) {                                                       \
                    value += LOAD(residual[j * a->res_ld + first + i]);                       \
                    STORE(out_residual[j * a->rows + i], value);                              \
                    value = LOAD(out_residual[j * a->rows + i]);                              \
                }                                                                             \
                sum_of_squares[i] += value * value;                                           \
            }                                                                                 \
        }                                                                                     \
        for (int64_t i = 0; i < count; ++i)                                                   \
            scale[i] = rms_scale(sum_of_squares[i], a->hidden, a->eps);                       \
        for (int64_t j = 0; j < a->hidden; ++j) {                                             \
            const float w = LOAD(((const T *)a->weight)[j]);                                  \
            for (int64_t i = 0; i < count; ++i) {                                             \
                T normed;                                                                     \
                STORE(normed, LOAD(summed[j * summed_ld + i]) * scale[i]);                    \
                STORE(out[j * a->rows + i], w * LOAD(normed));                                \
            }                                                                                 \
        }                                                                                     \
    }

/* Row-major row `row`: the sum of squares along it, then its outputs. */
#define RMS_ROW(name, T, LOAD, STORE)                                                         \
    static void name(const rms_args *a, int64_t row) {                                        \
        const T *x = (const T *)a->x + row * a->x_ld;                                         \
        T *out = (T *)a->out + row * a->hidden;                                               \
        const T *summed = x;                                                                  \
        float sum_of_squares = 0.0f;                                                          \
        if (a->residual != NULL) {                                                            \
            const T *residual = (const T *)a->residual + row * a->res_ld;                     \
            T *sum = (T *)a->out_residual + row * a->hidden;                                  \
            for (int64_t j = 0; j < a->hidden; ++j) STORE(sum[j], LOAD(x[j]) + LOAD(residual[j])); \
            summed = sum;                                                                     \
        }                                                                                     \
        for (int64_t j = 0; j < a->hidden; ++j) sum_of_squares += LOAD(summed[j]) * LOAD(summed[j]); \
        const float scale = rms_scale(sum_of_squares, a->hidden, a->eps);                     \
        const T *weight = a->weight;                                                          \
        for (int64_t j = 0; j < a->hidden; ++j) {                                             \
            T normed;                                                                         \
            STORE(normed, LOAD(summed[j]) * scale);                                           \
            STORE(out[j], LOAD(weight[j]) * LOAD(normed));                                    \
        }                                                                                     \
    }

#define LOAD_F32(v) (v)
#define STORE_F32(dst, v) ((dst) = (v))
#define LOAD_BF16(v) bf16_to_f32(v)
#define STORE_BF16(dst, v) ((dst) = f32_to_bf16(v))

RMS_COLUMNS(rms_columns_f32, float, LOAD_F32, STORE_F32)
RMS_COLUMNS(rms_columns_bf16, uint16_t, LOAD_BF16, STORE_BF16)
RMS_ROW(rms_row_f32, float, LOAD_F32, STORE_F32)
RMS_ROW(rms_row_bf16, uint16_t, LOAD_BF16, STORE_BF16)

#if KVGATE_ISA_LEVEL >= 1
#include <immintrin.h>

/* ---- per register width: RMS_VL float32 lanes; load_lanes and store_lanes take `count`
 * (<= RMS_VL) contiguous elements of `dtype` into lanes, and back (rounded as f32_to_bf16; no
 * NaN reaches here from finite activations) ---- */
#if KVGATE_ISA_LEVEL == 2
#define RMS_VL 16
typedef __m512 rms_vec;
#define rv_load _mm512_loadu_ps
#define rv_store _mm512_storeu_ps
#define rv_add _mm512_add_ps
#define rv_mul _mm512_mul_ps
#define rv_fmadd _mm512_fmadd_ps
#define rv_set1 _mm512_set1_ps

static inline __m512 load_lanes(const void *p, int dtype, int64_t count) {
    const __mmask16 mask = (__mmask16)((1u << count) - 1u);
    if (dtype == KVGATE_F32) return _mm512_maskz_loadu_ps(mask, p);
    const __m256i half = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

static inline __m512 store_lanes(void *p, int dtype, int64_t count, __m512 value) {
    const __mmask16 mask = (__mmask16)((1u << count) - 1u);
    if (dtype == KVGATE_F32) {
        _mm512_mask_storeu_ps(p, mask, value);
        return value;
    }
    const __m512i bits = _mm512_castps_si512(value);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(rounded));
    return _mm512_castsi512_ps(_mm512_slli_epi32(rounded, 16));
}
#else
#define RMS_VL 8
typedef __m256 rms_vec;
#define rv_load _mm256_loadu_ps
#define rv_store _mm256_storeu_ps
#define rv_add _mm256_add_ps
#define rv_mul _mm256_mul_ps
#define rv_fmadd _mm256_fmadd_ps
#define rv_set1 _mm256_set1_ps

/* The lanes under count, as _mm256_maskload_ps and _mm256_maskstore_ps take them. */
static inline __m256i first_lanes(int64_t count) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), lanes);
}

static inline __m256 load_lanes(const void *p, int dtype, int64_t count) {
    if (dtype == KVGATE_F32) return _mm256_maskload_ps(p, first_lanes(count));
    __m128i half = _mm_setzero_si128();
    memcpy(&half, p, sizeof(uint16_t) * (size_t)count);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

static inline __m256 store_lanes(void *p, int dtype, int64_t count, __m256 value) {
    if (dtype == KVGATE_F32) {
        _mm256_maskstore_ps(p, first_lanes(count), value);
        return value;
    }
    const __m256i bits = _mm256_castps_si256(value);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    /* the 8 16-bit values into the low 128 bits: packed per half, then the halves joined */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    memcpy(p, &packed, sizeof(uint16_t) * (size_t)count);
    return _mm256_castsi256_ps(_mm256_slli_epi32(rounded, 16));
}
#endif

/*
 * Column-major rows first .. first + count - 1 (count <= RMS_WIDE_BLOCK), RMS_VL rows to a
 * vector. Each feature's run of count contiguous rows is read whole before the next feature's:
 * with one vector of rows per pass (64 bytes of float32 a feature, x_ld rows apart), a prefill
 * of 2048 rows put every feature of the pass 8 KB apart, in the same few cache sets, and ran ten
 * times slower than the row-major norm of the same data. The sums of squares run down the
 * features in the same order either way.
 */
#define RMS_WIDE_BLOCK 256
static void rms_columns_vector(const rms_args *a, int64_t first, int64_t count) {
    const int dtype = a->dtype;
    const int64_t size = dtype_size(dtype);
    const int64_t vectors = (count + RMS_VL - 1) / RMS_VL;
    int64_t lanes[RMS_WIDE_BLOCK / RMS_VL];
    for (int64_t v = 0; v < vectors; ++v)
        lanes[v] = count - RMS_VL * v < RMS_VL ? count - RMS_VL * v : RMS_VL;
    const char *x = (const char *)a->x + first * size;
    char *out = (char *)a->out + first * size;
    char *sum = a->residual != NULL ? (char *)a->out_residual + first * size : NULL;
    const char *summed = sum != NULL ? sum : x;
    const int64_t summed_ld = sum != NULL ? a->rows : a->x_ld;
    float squares[RMS_WIDE_BLOCK] = {0.0f}, scales[RMS_WIDE_BLOCK];
    for (int64_t j = 0; j < a->hidden; ++j) {
        for (int64_t v = 0; v < vectors; ++v) {
            const int64_t row = RMS_VL * v;
            rms_vec value = load_lanes(x + (j * a->x_ld + row) * size, dtype, lanes[v]);
            if (sum != NULL) {
                const char *r = (const char *)a->residual + (j * a->res_ld + first + row) * size;
                value = store_lanes(sum + (j * a->rows + row) * size, dtype, lanes[v],
                                    rv_add(value, load_lanes(r, dtype, lanes[v])));
            }
            rv_store(squares + row, rv_fmadd(value, value, rv_load(squares + row)));
        }
    }
    for (int64_t i = 0; i < count; ++i) scales[i] = rms_scale(squares[i], a->hidden, a->eps);
    float normed_lanes[RMS_VL];
    for (int64_t j = 0; j < a->hidden; ++j) {
        const rms_vec w = rv_set1(load_elem(a->weight, dtype, j));
        for (int64_t v = 0; v < vectors; ++v) {
            const int64_t row = RMS_VL * v;
            const rms_vec value =
                load_lanes(summed + (j * summed_ld + row) * size, dtype, lanes[v]);
            /* normed rounded to the dtype before the weight multiplies it, as the reference. */
            rms_vec normed = rv_mul(value, rv_load(scales + row));
            if (dtype != KVGATE_F32) normed = store_lanes(normed_lanes, dtype, lanes[v], normed);
            store_lanes(out + (j * a->rows + row) * size, dtype, lanes[v], rv_mul(w, normed));
        }
    }
}
#define KVGATE_RMS_VECTOR 1
#endif

static void rms_norm_block(const rms_args *a, int column_major, int64_t first, int64_t count) {
    const int bf16 = a->dtype == KVGATE_BF16;
#ifdef KVGATE_RMS_VECTOR
    if (column_major) {
        rms_columns_vector(a, first, count);
        return;
    }
#endif
    if (column_major) {
        (bf16 ? rms_columns_bf16 : rms_columns_f32)(a, first, count);
        return;
    }
    for (int64_t row = first; row < first + count; ++row)
        (bf16 ? rms_row_bf16 : rms_row_f32)(a, row);
}

void kvgate_rms_norm(const void *x, int64_t x_ld, const void *residual, int64_t res_ld,
                     const void *weight, void *out, void *out_residual, int64_t rows,
                     int64_t hidden, int column_major, int dtype, float eps, int num_threads) {
    /* One row held column-major with no gaps is one contiguous row: the row-major loop reads
     * it in order (the column-major one would take a masked vector per element). */
    if (column_major && rows == 1 && x_ld == 1 && (residual == NULL || res_ld == 1))
        column_major = 0;
    const rms_args a = {x, residual, weight, out, out_residual, x_ld, res_ld, rows, hidden,
                        dtype, eps};
    /* A row-major block is one row: its elements are read in order. */
    int64_t block = column_major ? RMS_ROW_BLOCK : 1;
#ifdef KVGATE_RMS_VECTOR
    if (column_major) {
        /* The widest blocks that still give every thread one (whole vectors of rows). */
        const int64_t threads = num_threads > 0 ? num_threads : 1;
        const int64_t per_thread = (rows + threads - 1) / threads;
        block = (per_thread + RMS_VL - 1) / RMS_VL * RMS_VL;
        block = block > RMS_WIDE_BLOCK ? RMS_WIDE_BLOCK : block < RMS_VL ? RMS_VL : block;
    }
#endif
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
/* One run of `inner` contiguous elements, typed so that the loop vectorizes (expf included). */
#define SILU_RUN(name, T, LOAD, STORE)                                                  \
    static void name(const T *gate, const T *up, T *out, int64_t inner) {               \
        for (int64_t i = 0; i < inner; ++i) {                                           \
            const float g = LOAD(gate[i]);                                              \
            T activated;                                                                \
            STORE(activated, g / (1.0f + expf(-g)));                                    \
            STORE(out[i], LOAD(activated) * LOAD(up[i]));                               \
        }                                                                               \
    }

SILU_RUN(silu_run_f32, float, LOAD_F32, STORE_F32)
SILU_RUN(silu_run_bf16, uint16_t, LOAD_BF16, STORE_BF16)

void kvgate_silu_and_mul(const void *x, int64_t x_stride, int64_t up_offset, void *out,
                         int64_t out_stride, int64_t outer, int64_t inner, int dtype,
                         int num_threads) {
    const int parallel = outer * inner >= (1 << 15);
    const int64_t size = dtype_size(dtype);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t o = 0; o < outer; ++o) {
        const char *gate = (const char *)x + o * x_stride * size;
        const char *up = gate + up_offset * size;
        char *dst = (char *)out + o * out_stride * size;
        if (dtype == KVGATE_BF16)
            silu_run_bf16((const uint16_t *)gate, (const uint16_t *)up, (uint16_t *)dst, inner);
        else
            silu_run_f32((const float *)gate, (const float *)up, (float *)dst, inner);
    }
}

/* n float32 values as float8 e4m3 bytes, and n bytes back (cpu_common.h's f32_to_fp8 and
 * fp8_row_to_f32, which the fp8 KV cache's store and attention use), for the tests that hold
 * them to torch's conversion. */
void kvgate_fp8_from_f32(const float *x, int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_fp8(x[i]);
}

void kvgate_fp8_to_f32(const uint8_t *data, int64_t n, float *out) {
    fp8_row_to_f32(data, n, 1.0f, out);
}

/* The ISA level this library was compiled for (KVGATE_ISA_LEVEL): kernels/cpu_build.py checks
 * it against the level it built, so a build that lost its flags is an error, not a slow path. */
int kvgate_isa_level(void) { return KVGATE_ISA_LEVEL; }

/* Whether the column-major RMSNorm runs in vector registers (every level but the portable one;
 * the kernel tests check it, so a level that lost its vector code fails them). */
int kvgate_rms_norm_vector_built(void) {
#ifdef KVGATE_RMS_VECTOR
    return 1;
#else
    return 0;
#endif
}
