/* specframe: products of float32 rows with weights held in GGUF-style blocks (see block_weights.py).

   y[r, n] = sum_k x[r, k] * w[n, k] for r < rows, n < out, k < in (in a multiple of 32), where
   w[n, k] = scales[n, k/32] * q[n, k] + mins[n, k/32]:
     bits 4: q in 0..15, 16 bytes per block of 32, byte j holding element j (low nibble) and j + 16 (high);
     bits 8: q in -128..127, one signed byte per element, and no mins.
   Each block is turned back into float32 exactly as the dequantised weights were computed (scale * q is exact in
   float32; adding the min rounds once, as a fused multiply-add also does), then multiplied in float32.
   Built with AVX2 and FMA; threads from OpenMP (PyTorch's own runtime, loaded before this library). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 4 /* weight rows dequantised together: each input row is read once per tile */

static void dequantise4(const uint8_t *q, const float *scales, const float *mins, long blocks, float *out) {
    const __m128i low = _mm_set1_epi8(0x0f);
    for (long b = 0; b < blocks; b++) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(q + 16 * b));
        __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        __m256 d = _mm256_set1_ps(scales[b]), m = _mm256_set1_ps(mins[b]);
        float *o = out + 32 * b;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m));
        _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m));
        _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m));
        _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m));
    }
}

static void dequantise8(const int8_t *q, const float *scales, long blocks, float *out) {
    for (long b = 0; b < blocks; b++) {
        __m256 d = _mm256_set1_ps(scales[b]);
        for (int j = 0; j < 32; j += 8) {
            __m128i v = _mm_loadl_epi64((const __m128i *)(q + 32 * b + j));
            _mm256_storeu_ps(out + 32 * b + j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
        }
    }
}

static float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* rows of x times `count` (<= TILE) dequantised weight rows w[count][in], into y[r * out + first + j] */
static void tile_products(const float *x, long rows, long in, const float *w, int count, float *y, long out,
                          long first) {
    long r = 0;
    if (count == TILE) { /* two input rows by four weight rows: eight independent sums (an odd count ends with three) */
        for (; r + 2 <= rows && r + 3 != rows; r += 2) {
            const float *x0 = x + r * in, *x1 = x0 + in;
            __m256 s00 = _mm256_setzero_ps(), s01 = s00, s02 = s00, s03 = s00;
            __m256 s10 = s00, s11 = s00, s12 = s00, s13 = s00;
            for (long k = 0; k < in; k += 8) {
                __m256 a = _mm256_loadu_ps(x0 + k), b = _mm256_loadu_ps(x1 + k);
                __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + in + k);
                __m256 w2 = _mm256_loadu_ps(w + 2 * in + k), w3 = _mm256_loadu_ps(w + 3 * in + k);
                s00 = _mm256_fmadd_ps(a, w0, s00), s01 = _mm256_fmadd_ps(a, w1, s01);
                s02 = _mm256_fmadd_ps(a, w2, s02), s03 = _mm256_fmadd_ps(a, w3, s03);
                s10 = _mm256_fmadd_ps(b, w0, s10), s11 = _mm256_fmadd_ps(b, w1, s11);
                s12 = _mm256_fmadd_ps(b, w2, s12), s13 = _mm256_fmadd_ps(b, w3, s13);
            }
            float *y0 = y + r * out + first, *y1 = y0 + out;
            y0[0] = sum8(s00), y0[1] = sum8(s01), y0[2] = sum8(s02), y0[3] = sum8(s03);
            y1[0] = sum8(s10), y1[1] = sum8(s11), y1[2] = sum8(s12), y1[3] = sum8(s13);
        }
    }
    if (count == TILE && r + 3 == rows) { /* the last three input rows by four weight rows: twelve sums */
        const float *x0 = x + r * in, *x1 = x0 + in, *x2 = x1 + in;
        __m256 s00 = _mm256_setzero_ps(), s01 = s00, s02 = s00, s03 = s00;
        __m256 s10 = s00, s11 = s00, s12 = s00, s13 = s00;
        __m256 s20 = s00, s21 = s00, s22 = s00, s23 = s00;
        for (long k = 0; k < in; k += 8) {
            __m256 a = _mm256_loadu_ps(x0 + k), b = _mm256_loadu_ps(x1 + k), c = _mm256_loadu_ps(x2 + k);
            __m256 wj = _mm256_loadu_ps(w + k);
            s00 = _mm256_fmadd_ps(a, wj, s00), s10 = _mm256_fmadd_ps(b, wj, s10), s20 = _mm256_fmadd_ps(c, wj, s20);
            wj = _mm256_loadu_ps(w + in + k);
            s01 = _mm256_fmadd_ps(a, wj, s01), s11 = _mm256_fmadd_ps(b, wj, s11), s21 = _mm256_fmadd_ps(c, wj, s21);
            wj = _mm256_loadu_ps(w + 2 * in + k);
            s02 = _mm256_fmadd_ps(a, wj, s02), s12 = _mm256_fmadd_ps(b, wj, s12), s22 = _mm256_fmadd_ps(c, wj, s22);
            wj = _mm256_loadu_ps(w + 3 * in + k);
            s03 = _mm256_fmadd_ps(a, wj, s03), s13 = _mm256_fmadd_ps(b, wj, s13), s23 = _mm256_fmadd_ps(c, wj, s23);
        }
        float *y0 = y + r * out + first, *y1 = y0 + out, *y2 = y1 + out;
        y0[0] = sum8(s00), y0[1] = sum8(s01), y0[2] = sum8(s02), y0[3] = sum8(s03);
        y1[0] = sum8(s10), y1[1] = sum8(s11), y1[2] = sum8(s12), y1[3] = sum8(s13);
        y2[0] = sum8(s20), y2[1] = sum8(s21), y2[2] = sum8(s22), y2[3] = sum8(s23);
        r += 3;
    }
    if (count == TILE && r < rows) { /* a single input row by four weight rows */
        const float *xr = x + r * in;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (long k = 0; k < in; k += 8) {
            __m256 a = _mm256_loadu_ps(xr + k);
            s0 = _mm256_fmadd_ps(a, _mm256_loadu_ps(w + k), s0);
            s1 = _mm256_fmadd_ps(a, _mm256_loadu_ps(w + in + k), s1);
            s2 = _mm256_fmadd_ps(a, _mm256_loadu_ps(w + 2 * in + k), s2);
            s3 = _mm256_fmadd_ps(a, _mm256_loadu_ps(w + 3 * in + k), s3);
        }
        float *yr = y + r * out + first;
        yr[0] = sum8(s0), yr[1] = sum8(s1), yr[2] = sum8(s2), yr[3] = sum8(s3);
        r++;
    }
    for (; r < rows; r++) { /* a short tile (the last weight rows): one product at a time */
        const float *xr = x + r * in;
        for (int j = 0; j < count; j++) {
            const float *wj = w + j * in;
            __m256 s0 = _mm256_setzero_ps();
            for (long k = 0; k < in; k += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + k), _mm256_loadu_ps(wj + k), s0);
            y[r * out + first + j] = sum8(s0);
        }
    }
}

/* returns 0, or 1 where a thread's buffer could not be allocated (y is then incomplete) */
int block_products(const float *x, long rows, long in, const void *q, int bits, const float *scales,
                   const float *mins, long out, float *y, int threads) {
    long blocks = in / 32, tiles = (out + TILE - 1) / TILE;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *w = aligned_alloc(64, sizeof(float) * TILE * in);
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long t = 0; t < tiles; t++) {
            if (w == NULL) continue;
            long first = t * TILE;
            int count = out - first < TILE ? (int)(out - first) : TILE;
            for (int j = 0; j < count; j++) {
                long n = first + j;
                if (bits == 4)
                    dequantise4((const uint8_t *)q + 16 * blocks * n, scales + blocks * n, mins + blocks * n, blocks,
                                w + j * in);
                else
                    dequantise8((const int8_t *)q + 32 * blocks * n, scales + blocks * n, blocks, w + j * in);
            }
            tile_products(x, rows, in, w, count, y, out, first);
        }
        free(w);
    }
    return failed;
}
