/* Weight-only quantized matrix products (see quant_kernels.py): y[M, N] = x[M, K] . W[N, K]^T, and a whole
 * routed-expert SwiGLU layer in one call, with W stored quantized and dequantized in registers.
 *
 * Formats (the weight's, chosen by the layer; activations stay float32 or bfloat16, sums are float32):
 *   int4: uint8 [N, K/2], two values per byte, even input index in the low nibble, each offset by 8 (the
 *         bytes of compressed-tensors' pack-quantized words), one scale per `group` inputs of a row;
 *   int8: int8 [N, K], one scale per row.
 * Scales are float32 or bfloat16.
 *
 * Why: in a decode step every weight is read once for a few rows, so the step costs the weights' bytes. A
 * 4-bit weight is a quarter of bfloat16's bytes only if it is never widened in memory: here 32 values (16
 * bytes) become four float vectors in registers and meet every row of the tile there. Activation rows are
 * widened to float32 once per call, stored in the order the weights come out in (no shuffle per weight).
 * Each row takes 4 independent FMA chains, scaled once per group; rows go in pairs sharing each dequantized
 * weight vector. Measured on AVX2 (Zen 3, one core, 2048 inputs): the nibble-to-float trick below reads
 * 9.1 G weights/s, widening with vpmovsxbd + vcvtdq2ps and scaling every vector 3.7.
 *
 * A row's sums run in one fixed order whatever its batch mates and the thread count.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define Q_AVX2 1
#else
#define Q_AVX2 0
#endif

/* 2: the AVX2 + FMA path was built; 0: portable C. */
int quant_isa(void) { return Q_AVX2 ? 2 : 0; }

static inline float widen_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t narrow_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return (uint16_t)((u >> 16) | ((u & 0xffffu) ? 0x40u : 0u));
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* round to nearest even */
}

static inline float scale_at(const void *s, int s_bf16, int64_t i) {
    return s_bf16 ? widen_bf16(((const uint16_t *)s)[i]) : ((const float *)s)[i];
}

static inline float load_act(const void *x, int bf16, int64_t i) {
    return bf16 ? widen_bf16(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline void store_act(void *y, int bf16, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)y)[i] = narrow_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* Row `src` ([K], float32 or bfloat16) -> float32 `dst` in the order the weights come out of `weights32`
 * (int4: per 32-input block, inputs 0, 4, .., 28, then 1, 5, .., 29, then 2, .., then 3, ..). */
static inline void widen_row(int bits, int64_t K, const void *src, int bf16, float *dst) {
    if (bits == 8) {
        for (int64_t k = 0; k < K; k++) dst[k] = load_act(src, bf16, k);
        return;
    }
    for (int64_t k = 0; k < K; k += 32)
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 8; i++) dst[k + 8 * j + i] = load_act(src, bf16, k + 4 * i + j);
}

#if Q_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 weights of a row at input k as 4 float vectors, in the order `widen_row` gives the inputs. int4: each
 * 32-bit lane takes 2 bytes (4 nibbles: inputs 4i..4i+3); a nibble OR-ed into the mantissa of 2^23 is the
 * float 2^23 + q exactly, so one subtraction gives q - 8 (no integer-to-float conversion). int8: widened and
 * converted, 8 at a time. */
static inline __attribute__((always_inline)) void weights32(const int bits, const uint8_t *w, int64_t k,
                                                            __m256 f[4]) {
    if (bits == 4) {
        const __m256i mask = _mm256_set1_epi32(0x0F), magic = _mm256_set1_epi32(0x4B000000);
        const __m256 offset = _mm256_set1_ps(8388608.0f + 8.0f);
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + k / 2)));
        f[0] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(v, mask), magic)), offset);
        f[1] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v, 4), mask),
                                                                magic)), offset);
        f[2] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v, 8), mask),
                                                                magic)), offset);
        f[3] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_srli_epi32(v, 12), magic)), offset);
    } else {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + k));
        __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
        f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    }
}

/* One output row x MR (1 or 2) activation rows: per row 4 independent FMA chains over a group, summed and
 * scaled at its end; every row takes exactly this order whatever MR, so a row's result does not depend on its
 * batch mates. Two rows share each dequantized weight vector (14 of the 16 registers in use). */
static inline __attribute__((always_inline)) void tile(const int bits, const int MR, int64_t group,
                                                       const uint8_t *w, const void *s, int s_bf16, int64_t groups,
                                                       const float *xp, int64_t ldx, float *out, int64_t ldo) {
    __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < groups; g++) {
        __m256 acc[2][4];
#pragma GCC unroll 2
        for (int m = 0; m < MR; m++)
            acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = _mm256_setzero_ps();
        for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
            __m256 f[4];
            weights32(bits, w, k, f);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
#pragma GCC unroll 2
                for (int m = 0; m < MR; m++)
                    acc[m][j] = _mm256_fmadd_ps(f[j], _mm256_loadu_ps(xp + m * ldx + k + 8 * j), acc[m][j]);
        }
        __m256 sc = _mm256_set1_ps(scale_at(s, s_bf16, g));
#pragma GCC unroll 2
        for (int m = 0; m < MR; m++) {
            __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3]));
            total[m] = _mm256_fmadd_ps(sum, sc, total[m]);
        }
    }
#pragma GCC unroll 2
    for (int m = 0; m < MR; m++) out[m * ldo] = hsum8(total[m]);
}
#else
/* Weight j of a 32-input block at input k, in `widen_row`'s order. */
static inline float weight_at(int bits, const uint8_t *w, int64_t k, int j) {
    if (bits == 8) return (float)(int8_t)w[k + j];
    int64_t input = k + 4 * (j % 8) + j / 8; /* lane j % 8 holds inputs 4i..4i+3; vector j / 8 picks one */
    uint8_t byte = w[input / 2];
    return (float)((input & 1 ? byte >> 4 : byte & 0x0F) - 8);
}

static inline void tile(int bits, int MR, int64_t group, const uint8_t *w, const void *s, int s_bf16,
                        int64_t groups, const float *xp, int64_t ldx, float *out, int64_t ldo) {
    for (int m = 0; m < MR; m++) {
        float total = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            float part = 0.0f;
            for (int64_t k = g * group; k < (g + 1) * group; k += 32)
                for (int j = 0; j < 32; j++) part += weight_at(bits, w, k, j) * xp[m * ldx + k + j];
            total += part * scale_at(s, s_bf16, g);
        }
        out[m * ldo] = total;
    }
}
#endif

/* Output rows [n0, n1) of y[M, N] (float32, ldo) from float32 activations xp [M, K] (ldx), rows in pairs. */
static inline __attribute__((always_inline)) void rows_range_of(const int bits, int64_t M, int64_t K,
                                                                int64_t group, const uint8_t *w, const void *s,
                                                                int s_bf16, const float *xp, int64_t ldx, float *y,
                                                                int64_t ldo, int64_t n0, int64_t n1) {
    int64_t row_bytes = bits == 4 ? K / 2 : K, groups = K / group, scale_bytes = s_bf16 ? 2 : 4;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wn = w + n * row_bytes;
        const void *sn = (const char *)s + n * groups * scale_bytes;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) tile(bits, 2, group, wn, sn, s_bf16, groups, xp + m * ldx, ldx, y + m * ldo + n, ldo);
        if (m < M) tile(bits, 1, group, wn, sn, s_bf16, groups, xp + m * ldx, ldx, y + m * ldo + n, ldo);
    }
}

/* The tiles specialised per format (a constant `bits` lets the compiler keep the accumulators in registers). */
static void rows_range_4(int64_t M, int64_t K, int64_t group, const uint8_t *w, const void *s, int s_bf16,
                         const float *xp, int64_t ldx, float *y, int64_t ldo, int64_t n0, int64_t n1) {
    rows_range_of(4, M, K, group, w, s, s_bf16, xp, ldx, y, ldo, n0, n1);
}

static void rows_range_8(int64_t M, int64_t K, int64_t group, const uint8_t *w, const void *s, int s_bf16,
                         const float *xp, int64_t ldx, float *y, int64_t ldo, int64_t n0, int64_t n1) {
    rows_range_of(8, M, K, group, w, s, s_bf16, xp, ldx, y, ldo, n0, n1);
}

static inline void rows_range(int bits, int64_t M, int64_t K, int64_t group, const uint8_t *w, const void *s,
                              int s_bf16, const float *xp, int64_t ldx, float *y, int64_t ldo, int64_t n0,
                              int64_t n1) {
    (bits == 4 ? rows_range_4 : rows_range_8)(M, K, group, w, s, s_bf16, xp, ldx, y, ldo, n0, n1);
}

#define CHUNK 16 /* output rows per work item */

/* y[M, N] = x[M, K] . W^T (+ bias[N], float32, optional), x and y float32 or bfloat16. `xp`: scratch of M * K
 * floats; `yf`: scratch of M * N floats. */
void quant_linear(int bits, int64_t M, int64_t N, int64_t K, int64_t group, const uint8_t *w, const void *s,
                  int s_bf16, const void *x, int x_bf16, const float *bias, void *y, int y_bf16, float *xp,
                  float *yf, int threads) {
    int64_t items = (N + CHUNK - 1) / CHUNK;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) widen_row(bits, K, (const char *)x + m * K * (x_bf16 ? 2 : 4), x_bf16, xp + m * K);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < items; i++) {
            int64_t n0 = i * CHUNK, n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
            rows_range(bits, M, K, group, w, s, s_bf16, xp, K, yf, N, n0, n1);
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) store_act(y, y_bf16, m * N + n, yf[m * N + n] + (bias ? bias[n] : 0.0f));
    }
}

/* A routed SwiGLU expert layer: x [S, H] (rows sorted by expert, `counts` [E] rows each) -> out [S, H], each
 * row through its expert's gate_up [E, 2I, H] (gate rows first) and down [E, H, I]; no routing weights (the
 * caller weights and sums the slots). Scratch: xp S * H, h S * 2I, hp S * I floats, starts E + 1 int64. One
 * parallel region, a barrier between the phases; each phase's work items are (expert, 16 output rows). */
void quant_moe(int bits_up, int bits_down, int64_t S, int64_t E, int64_t H, int64_t I, int64_t group_up,
               int64_t group_down, const int64_t *counts, const void *x, int x_bf16, const uint8_t *wu,
               const void *su, const uint8_t *wd, const void *sd, int s_bf16, void *out, int out_bf16, float *xp,
               float *h, float *hp, int64_t *starts, int threads) {
    int64_t active = 0;
    starts[0] = 0;
    for (int64_t e = 0; e < E; e++) starts[e + 1] = starts[e] + counts[e];
    int64_t *ids = starts + E + 1; /* the experts with rows: scratch holds E more */
    for (int64_t e = 0; e < E; e++)
        if (counts[e]) ids[active++] = e;
    int64_t up_rows = 2 * I, up_bytes = bits_up == 4 ? H / 2 : H, down_bytes = bits_down == 4 ? I / 2 : I;
    int64_t up_items = (up_rows + CHUNK - 1) / CHUNK, down_items = (H + CHUNK - 1) / CHUNK;
    int64_t up_groups = H / group_up, down_groups = I / group_down, sb = s_bf16 ? 2 : 4;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < S; m++) widen_row(bits_up, H, (const char *)x + m * H * (x_bf16 ? 2 : 4), x_bf16, xp + m * H);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < active * up_items; i++) {
            int64_t e = ids[i / up_items], n0 = (i % up_items) * CHUNK;
            int64_t n1 = n0 + CHUNK < up_rows ? n0 + CHUNK : up_rows, r0 = starts[e];
            rows_range(bits_up, counts[e], H, group_up, wu + e * up_rows * up_bytes,
                       (const char *)su + e * up_rows * up_groups * sb, s_bf16, xp + r0 * H, H, h + r0 * up_rows,
                       up_rows, n0, n1);
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < S; m++) {
            const float *g = h + m * up_rows, *u = g + I;
            float *dst = hp + m * I;
            for (int64_t k = 0; k < I; k++) {
                float v = g[k] / (1.0f + expf(-g[k])) * u[k];
                int64_t at = k;
                if (bits_down == 4) { /* widen_row's int4 input order */
                    int64_t base = k & ~(int64_t)31, r = k & 31;
                    at = base + 8 * (r & 3) + r / 4;
                }
                dst[at] = v;
            }
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < active * down_items; i++) {
            int64_t e = ids[i / down_items], n0 = (i % down_items) * CHUNK;
            int64_t n1 = n0 + CHUNK < H ? n0 + CHUNK : H, r0 = starts[e];
            rows_range(bits_down, counts[e], I, group_down, wd + e * H * down_bytes,
                       (const char *)sd + e * H * down_groups * sb, s_bf16, hp + r0 * I, I, xp + r0 * H, H, n0, n1);
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < S; m++)
            for (int64_t n = 0; n < H; n++) store_act(out, out_bf16, m * H + n, xp[m * H + n]);
    }
}
