/*
 * A column-major activation tile copied row-major: what the attention step reads when a linear
 * layer has written q/k/v column-major (included by cpu_attention.c; nothing here is exported).
 */
#ifndef KVGATE_CPU_TRANSPOSE_H
#define KVGATE_CPU_TRANSPOSE_H

#include <stdint.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* r[i] lane j becomes r[j] lane i (16 x 16 values of 32 bits): pairs of lanes, then of 64-bit
 * lanes, then a 4 x 4 transpose of 128-bit blocks, 64 shuffles in all. */
static inline void transpose_16x16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) /* u[4i + m], block k: lane 4k + m of rows 4i .. 4i + 3 */
        for (int m = 0; m < 4; ++m) {
            const __m512d a = _mm512_castps_pd(t[4 * i + (m >> 1)]);
            const __m512d b = _mm512_castps_pd(t[4 * i + 2 + (m >> 1)]);
            r[4 * i + m] = _mm512_castpd_ps(m & 1 ? _mm512_unpackhi_pd(a, b)
                                                  : _mm512_unpacklo_pd(a, b));
        }
    for (int m = 0; m < 4; ++m) {
        const __m512 s0 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x44);
        const __m512 s1 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xee);
        const __m512 s2 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x44);
        const __m512 s3 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xee);
        t[m] = _mm512_shuffle_f32x4(s0, s2, 0x88);
        t[4 + m] = _mm512_shuffle_f32x4(s0, s2, 0xdd);
        t[8 + m] = _mm512_shuffle_f32x4(s1, s3, 0x88);
        t[12 + m] = _mm512_shuffle_f32x4(s1, s3, 0xdd);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

/* transpose_tile for 16 tokens and a width that is a multiple of 16, 16 features at a time in
 * registers (16-bit values widened to 32-bit lanes and narrowed back). */
static inline void transpose_tile_16(const void *qkv, int dtype, int64_t feature_stride,
                                     int64_t t0, int64_t width, void *rows) {
    __m512 r[16];
    for (int64_t f = 0; f < width; f += 16) {
        for (int i = 0; i < 16; ++i) {
            const int64_t at = (f + i) * feature_stride + t0;
            r[i] = dtype_size(dtype) == 4
                       ? _mm512_loadu_ps((const float *)qkv + at)
                       : _mm512_castsi512_ps(_mm512_cvtepu16_epi32(
                             _mm256_loadu_si256((const __m256i *)((const uint16_t *)qkv + at))));
        }
        transpose_16x16(r);
        for (int j = 0; j < 16; ++j) {
            if (dtype_size(dtype) == 4)
                _mm512_storeu_ps((float *)rows + j * width + f, r[j]);
            else
                _mm256_storeu_si256((__m256i *)((uint16_t *)rows + j * width + f),
                                    _mm512_cvtepi32_epi16(_mm512_castps_si512(r[j])));
        }
    }
}
#endif

/* Tokens t0 .. t0 + count - 1 of a column-major qkv (feature f of token t at element
 * t + f * feature_stride, of `dtype`) into `count` rows of `width` elements, reading each of
 * qkv's cache lines once rather than once per token. */
static inline void transpose_tile(const void *qkv, int dtype, int64_t feature_stride,
                                  int64_t t0, int64_t count, int64_t width, void *rows) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (count == 16 && width % 16 == 0) {
        transpose_tile_16(qkv, dtype, feature_stride, t0, width, rows);
        return;
    }
#endif
    if (dtype_size(dtype) == 4) {
        const float *src = (const float *)qkv + t0;
        float *dst = rows;
        for (int64_t f = 0; f < width; ++f)
            for (int64_t t = 0; t < count; ++t) dst[t * width + f] = src[f * feature_stride + t];
    } else {
        const uint16_t *src = (const uint16_t *)qkv + t0;
        uint16_t *dst = rows;
        for (int64_t f = 0; f < width; ++f)
            for (int64_t t = 0; t < count; ++t) dst[t * width + f] = src[f * feature_stride + t];
    }
}

#endif
