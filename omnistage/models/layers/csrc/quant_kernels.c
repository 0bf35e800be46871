/* Weight-only quantized matrix products (see quant_kernels.py): y[M, N] = x[M, K] . W[N, K]^T, and a whole
 * routed-expert SwiGLU layer in one call, with W stored quantized and dequantized in registers.
 *
 * Formats (the weight's, chosen by the layer; activations stay float32 or bfloat16, sums are float32):
 *   int4: uint8 [N, K/2], two values per byte, even input index in the low nibble, each offset by 8 (the
 *         bytes of compressed-tensors' pack-quantized words), one scale per `group` inputs of a row;
 *   int8: int8 [N, K], one scale per `group` inputs of a row (per channel: the group is K).
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
 *
 * With AVX-512 (F + BW; VNNI fuses each product and sum) the bfloat16 path's integer products run at 512 bits:
 * 128 int4 weights per 64-byte load. Measured on Sapphire Rapids, 2 threads, a released-width Thinker of 8
 * layers: decode 20.5 / 33.0 / 57.8 tokens/s at 1 / 4 / 16 requests against 17.1 / 28.6 / 49.6 with the AVX2
 * path on the same machine (before the prefetch below).
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
/* AVX-512 (F + BW) widens the bfloat16 path's integer products to 512 bits: 128 int4 weights per load. */
#if Q_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define Q_AVX512 1
#else
#define Q_AVX512 0
#endif

/* How far ahead of its loads the int path asks for weight bytes (one cache line per 64-byte step): without it a
 * core's loads wait on memory, which halved the read rate of a decode step's weights (Sapphire Rapids, 2 threads:
 * a 5120 x 2048 int4 layer at one row 584 -> 283 us, a 128-expert layer at 16 tokens 21.8 -> 11.3 ms). */
#define PREFETCH_BYTES 2048

/* 3: AVX-512 (with AVX2 + FMA) was built; 2: AVX2 + FMA; 0: portable C. */
int quant_isa(void) { return Q_AVX512 ? 3 : Q_AVX2 ? 2 : 0; }

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

/* The bfloat16 path: activation rows as 16-bit fixed point per group of inputs (`quantize_row_i16`), weights
 * widened to int16 in registers, products summed exactly in int32 by vpmaddwd (16 per instruction), each
 * group's sum scaled once (weight scale x activation scale). 32 weights cost 10 instructions here against 20
 * on the float path. */
static inline __attribute__((always_inline)) void iweights32(const int bits, const uint8_t *w, int64_t k,
                                                             __m256i *a, __m256i *b) {
    if (bits == 4) { /* 16 bytes: low nibbles are inputs k, k+2, .., high ones k+1, k+3, .. (0..15, offset 8) */
        const __m128i mask = _mm_set1_epi8(0x0F);
        __m128i v = _mm_loadu_si128((const __m128i *)(w + k / 2));
        *a = _mm256_cvtepu8_epi16(_mm_and_si128(v, mask));
        *b = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), mask));
    } else {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + k));
        *a = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
        *b = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
    }
}

/* How many int4 weights the int path unpacks per load for activation chunks of `ag` inputs: 128 (`iweights128`,
 * AVX-512), 64 (`iweights64`) or 32 (`iweights32`). */
static inline int int4_step(int64_t ag) {
    if (Q_AVX512 && ag % 128 == 0) return 128;
    return ag % 64 == 0 ? 64 : 32;
}

/* 64 int4 weights at input k (32 bytes) as four int16 vectors: low nibbles of bytes 0-7 | 16-23, 8-15 | 24-31,
 * then the high nibbles likewise (`order_row_i16` puts the inputs in this order). */
static inline __attribute__((always_inline)) void iweights64(const uint8_t *w, int64_t k, __m256i v[4]) {
    const __m256i mask = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    __m256i b = _mm256_loadu_si256((const __m256i *)(w + k / 2));
    __m256i lo = _mm256_and_si256(b, mask), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
    v[0] = _mm256_unpacklo_epi8(lo, zero);
    v[1] = _mm256_unpackhi_epi8(lo, zero);
    v[2] = _mm256_unpacklo_epi8(hi, zero);
    v[3] = _mm256_unpackhi_epi8(hi, zero);
}

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* One output row x MR (1..4) activation rows of int16 (xq, ldx) quantized in chunks of `ag` inputs (a divisor
 * of the weight's group; at most 128, so an int32 sum cannot overflow: 127 x 32767 x 128 < 2^31), their scales
 * xs and sums xsum ([MR][chunks], ldg): out[m * ldo]. Each chunk's int32 sums are converted and scaled as a
 * vector (no horizontal sum per chunk); int4's offset of 8 comes off each chunk's integer sum through xsum
 * (exact). The integer sums are exact, so a row's result does not depend on MR. */
static inline __attribute__((always_inline)) void itile(const int bits, const int MR, int64_t K, int64_t group,
                                                        int64_t ag, const uint8_t *w, const void *s, int s_bf16,
                                                        const int16_t *xq, int64_t ldx, const float *xs,
                                                        const int32_t *xsum, int64_t ldg, float *out, int64_t ldo) {
    __m256 total[4];
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) total[m] = _mm256_setzero_ps();
    const int wide = bits == 4 && int4_step(ag) > 32; /* (here 64: a 128 step takes itile512) */
    /* The weight scale's index, kept by counting chunks (ag divides the group): a division per chunk cost more
     * than the chunk's products. */
    const int64_t per_scale = group / ag;
    int64_t si = 0, left = per_scale;
    for (int64_t c = 0; c < K / ag; c++) {
        __m256i acc[4];
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_si256();
        if (wide) {
            for (int64_t k = c * ag; k < (c + 1) * ag; k += 64) {
                __m256i v[4];
                _mm_prefetch((const char *)(w + k / 2) + PREFETCH_BYTES, _MM_HINT_T0);
                iweights64(w, k, v);
#pragma GCC unroll 4
                for (int m = 0; m < MR; m++) {
                    const __m256i *x = (const __m256i *)(xq + m * ldx + k);
                    __m256i p0 = _mm256_add_epi32(_mm256_madd_epi16(v[0], _mm256_loadu_si256(x)),
                                                  _mm256_madd_epi16(v[1], _mm256_loadu_si256(x + 1)));
                    __m256i p1 = _mm256_add_epi32(_mm256_madd_epi16(v[2], _mm256_loadu_si256(x + 2)),
                                                  _mm256_madd_epi16(v[3], _mm256_loadu_si256(x + 3)));
                    acc[m] = _mm256_add_epi32(acc[m], _mm256_add_epi32(p0, p1));
                }
            }
        } else {
            for (int64_t k = c * ag; k < (c + 1) * ag; k += 32) {
                __m256i a, b;
                if (bits == 8 || k % 64 == 0) _mm_prefetch((const char *)(w + k * bits / 8) + PREFETCH_BYTES, _MM_HINT_T0);
                iweights32(bits, w, k, &a, &b);
#pragma GCC unroll 4
                for (int m = 0; m < MR; m++) {
                    const __m256i *x = (const __m256i *)(xq + m * ldx + k);
                    acc[m] = _mm256_add_epi32(acc[m], _mm256_add_epi32(_mm256_madd_epi16(a, _mm256_loadu_si256(x)),
                                                                       _mm256_madd_epi16(b, _mm256_loadu_si256(x + 1))));
                }
            }
        }
        float sw = scale_at(s, s_bf16, si);
        if (--left == 0) si++, left = per_scale;
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
            __m256i sum = acc[m];
            if (bits == 4) /* the nibbles' offset of 8, exactly, off the integer sum's first lane */
                sum = _mm256_sub_epi32(sum, _mm256_zextsi128_si256(_mm_cvtsi32_si128(8 * xsum[m * ldg + c])));
            total[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(sw * xs[m * ldg + c]), total[m]);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) out[m * ldo] = hsum8(total[m]);
}

#if Q_AVX512
/* acc + the pairwise int16 products of w and x, in int32 (one instruction with AVX512-VNNI). */
static inline __attribute__((always_inline)) __m512i dot_add(__m512i acc, __m512i w, __m512i x) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

/* 128 int4 weights at input k (64 bytes) as four int16 vectors, per 128-bit lane as `iweights64` does. */
static inline __attribute__((always_inline)) void iweights128(const uint8_t *w, int64_t k, __m512i v[4]) {
    const __m512i mask = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    __m512i b = _mm512_loadu_si512((const void *)(w + k / 2));
    __m512i lo = _mm512_and_si512(b, mask), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), mask);
    v[0] = _mm512_unpacklo_epi8(lo, zero);
    v[1] = _mm512_unpackhi_epi8(lo, zero);
    v[2] = _mm512_unpacklo_epi8(hi, zero);
    v[3] = _mm512_unpackhi_epi8(hi, zero);
}

/* `itile` at 512 bits, for chunks of a multiple of 128 inputs, over NR (1 or 2) output rows at once (weight rows
 * w and w + ldw, scales s and s + lds): each activation vector loaded meets both rows' weights, so a step's loads
 * feed twice the products (with one row the loads, not the products, set the pace). Per (row, activation row)
 * one int32 sum per chunk (two below 3 activation rows, for the products' latency), scaled once per chunk; the
 * integer sums are exact, so a row's result depends neither on NR nor on MR. */
static inline __attribute__((always_inline)) void itile512(const int bits, const int NR, const int MR, int64_t K,
                                                           int64_t group, int64_t ag, const uint8_t *w, int64_t ldw,
                                                           const void *s, int64_t lds, int s_bf16,
                                                           const int16_t *xq, int64_t ldx, const float *xs,
                                                           const int32_t *xsum, int64_t ldg, float *out,
                                                           int64_t ldo) {
    const int SPLIT = MR < 3 ? 2 : 1;
    __m512 total[2][4];
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) total[r][m] = _mm512_setzero_ps();
    const int64_t per_scale = group / ag; /* (the scale's index by counting chunks, as in `itile`) */
    int64_t si = 0, left = per_scale;
    for (int64_t c = 0; c < K / ag; c++) {
        __m512i acc[2][4][2];
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++) acc[r][m][0] = acc[r][m][1] = _mm512_setzero_si512();
        for (int64_t k = c * ag; k < (c + 1) * ag; k += 128) {
            __m512i v[2][4]; /* v[r][j] meets activation vector j of the step */
#pragma GCC unroll 2
            for (int r = 0; r < NR; r++) {
                const uint8_t *wr = w + r * ldw;
                if (bits == 4) {
                    _mm_prefetch((const char *)(wr + k / 2) + PREFETCH_BYTES, _MM_HINT_T0);
                    iweights128(wr, k, v[r]);
                } else { /* (128 inputs a step: 2 cache lines) */
                    _mm_prefetch((const char *)(wr + k) + PREFETCH_BYTES, _MM_HINT_T0);
                    _mm_prefetch((const char *)(wr + k) + PREFETCH_BYTES + 64, _MM_HINT_T0);
                    __m512i b0 = _mm512_loadu_si512((const void *)(wr + k)), b1 = _mm512_loadu_si512((const void *)(wr + k + 64));
                    v[r][0] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(b0));
                    v[r][1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(b0, 1));
                    v[r][2] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(b1));
                    v[r][3] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(b1, 1));
                }
            }
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++) {
                const __m512i *x = (const __m512i *)(xq + m * ldx + k);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const __m512i xv = _mm512_loadu_si512(x + j);
#pragma GCC unroll 2
                    for (int r = 0; r < NR; r++) {
                        __m512i *a = &acc[r][m][SPLIT == 2 ? j & 1 : 0];
                        *a = dot_add(*a, v[r][j], xv);
                    }
                }
            }
        }
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) {
            const float sw = scale_at(s, s_bf16, r * lds + si);
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++) {
                __m512i sum = SPLIT == 2 ? _mm512_add_epi32(acc[r][m][0], acc[r][m][1]) : acc[r][m][0];
                if (bits == 4) sum = _mm512_mask_sub_epi32(sum, 1, sum, _mm512_set1_epi32(8 * xsum[m * ldg + c]));
                total[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(sw * xs[m * ldg + c]), total[r][m]);
            }
        }
        if (--left == 0) si++, left = per_scale;
    }
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) out[m * ldo + r] = _mm512_reduce_add_ps(total[r][m]);
}
#endif
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

#if Q_AVX2
/* The int16 path's activation chunk: the weight's group where it is at most 128 inputs, else 128 where it
 * divides the group, else 32 (int8 per channel: the group is the whole row). */
static inline int64_t act_chunk(int64_t group) {
    return group <= 128 ? group : (group % 128 == 0 ? 128 : 32);
}

/* Row `src` ([K], float32 or bfloat16) -> int16 `dst` in the order `iweights32` gives the weights (int4: per
 * 32-input block, inputs 0, 2, .., 30 then 1, 3, .., 31), per chunk of `ag` inputs one scale (its largest
 * magnitude / 32767: rounding error at most 2^-16 of it, below bfloat16's own 2^-9) and the sum of its values. */
static inline __m256 load8(const void *src, int bf16, int64_t k) {
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + k))), 16));
    return _mm256_loadu_ps((const float *)src + k);
}

/* [a0 .. a7], [b0 .. b7] -> evens [a0 a2 a4 a6 b0 b2 b4 b6], odds [a1 .. b7]. */
static inline void deinterleave(__m256 a, __m256 b, __m256 *even, __m256 *odd) {
    __m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
}

/* 16 int32 (two vectors, in order) -> 16 int16 at dst. */
static inline void store16(int16_t *dst, __m256i lo, __m256i hi) {
    _mm256_storeu_si256((__m256i *)dst, _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), _MM_SHUFFLE(3, 1, 2, 0)));
}

static void quantize_row_i16(int64_t K, int64_t ag, const void *src, int bf16, int16_t *dst, float *xs,
                             int32_t *xsum) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t c = 0; c < K / ag; c++) {
        __m256 mx = _mm256_setzero_ps();
        for (int64_t k = c * ag; k < (c + 1) * ag; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(load8(src, bf16, k), magnitude));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
        __m256i sum = _mm256_setzero_si256();
        for (int64_t k = c * ag; k < (c + 1) * ag; k += 32) {
            __m256 v0 = load8(src, bf16, k), v1 = load8(src, bf16, k + 8), v2 = load8(src, bf16, k + 16),
                   v3 = load8(src, bf16, k + 24);
            /* (round to nearest even, as lrintf; |v| * inv <= 32767) */
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
            store16(dst + k, i0, i1);
            store16(dst + k + 16, i2, i3);
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
        }
        xs[c] = amax / 32767.0f;
        xsum[c] = hsum_i32(sum);
    }
}

/* Row `src` (int16, natural order) -> `dst` in the order the int path reads the weights: int4 in steps of 128 or
 * 64 inputs as `iweights128` / `iweights64` unpack them (per 128-bit lane: the low nibbles of its bytes 0-7, then
 * 8-15, then the high nibbles likewise), else per 32 inputs evens then odds (`iweights32`); int8 unchanged. */
static void order_row_i16(int bits, int64_t K, int64_t ag, const int16_t *src, int16_t *dst) {
    if (bits == 8) {
        memcpy(dst, src, (size_t)K * sizeof(int16_t));
        return;
    }
    const int step = int4_step(ag);
    if (step > 32) {
        uint8_t where[128]; /* each input's place within its step (once per row, not per step) */
        for (int i = 0; i < step; i++) {
            int j = i / 2, lane = j / 16, b = j % 16, vec = 2 * (i & 1) + (b >= 8);
            where[i] = (uint8_t)((step / 4) * vec + 8 * lane + b % 8);
        }
        for (int64_t k = 0; k < K; k += step)
            for (int i = 0; i < step; i++) dst[k + where[i]] = src[k + i];
        return;
    }
    for (int64_t k = 0; k < K; k += 32)
        for (int i = 0; i < 32; i++) dst[k + (i & 1 ? 16 + i / 2 : i / 2)] = src[k + i];
}

/* Activation rows per block of `irows_range_of`: one tile's rows meet every output row of the work item before
 * the next tile's, so they (16 KB at 2048 inputs) and the item's weights stay in L1; a prefill's rows (5 MB for
 * 1266 tokens x 2048 inputs) once streamed from L3 for every output row (2 threads, AMD EPYC Zen 4, a 5120 x
 * 2048 int4 layer at 512 rows: 84 -> 50 ms; blocks of 32 rows: 61 ms). */
#define ROW_BLOCK 4

/* Output rows n .. n + NR of activation rows [m0, m1) (tiles of up to 4 rows), int16 path. */
#define ITILE_ROWS(CALL)                                                                                        \
    int64_t m = m0;                                                                                             \
    for (; m + 4 <= m1; m += 4) CALL(4);                                                                        \
    switch (m1 - m) {                                                                                           \
    case 3: CALL(3); break;                                                                                     \
    case 2: CALL(2); break;                                                                                     \
    case 1: CALL(1); break;                                                                                     \
    default: break;                                                                                             \
    }

static inline __attribute__((always_inline)) void irows_range_of(const int bits, int64_t M, int64_t K,
                                                                 int64_t group, const uint8_t *w, const void *s,
                                                                 int s_bf16, const int16_t *xq, const float *xs,
                                                                 const int32_t *xsum, float *y, int64_t ldo,
                                                                 int64_t n0, int64_t n1) {
    int64_t row_bytes = bits == 4 ? K / 2 : K, groups = K / group, scale_bytes = s_bf16 ? 2 : 4;
    int64_t ag = act_chunk(group), ldg = K / ag;
#if Q_AVX512
    const int wide = bits == 4 ? int4_step(ag) == 128 : ag % 128 == 0;
#endif
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        const int64_t m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
#if Q_AVX512
        if (wide) {
            for (int64_t n = n0; n < n1; n += m1 - m0 > 1 ? 2 : 1) {
                const uint8_t *wn = w + n * row_bytes;
                const void *sn = (const char *)s + n * groups * scale_bytes;
#define T512(NR, MR) itile512(bits, NR, MR, K, group, ag, wn, row_bytes, sn, groups, s_bf16, xq + m * K, K,      \
                              xs + m * ldg, xsum + m * ldg, ldg, y + m * ldo + n, ldo)
#define PAIR(MR) T512(2, MR)
#define ONE(MR) T512(1, MR)
                if (n + 2 <= n1 && m1 - m0 > 1) { /* (one activation row: the weights' read sets the pace) */
                    ITILE_ROWS(PAIR)
                } else {
                    ITILE_ROWS(ONE)
                }
#undef ONE
#undef PAIR
#undef T512
            }
            continue;
        }
#endif
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *wn = w + n * row_bytes;
            const void *sn = (const char *)s + n * groups * scale_bytes;
#define T256(MR) itile(bits, MR, K, group, ag, wn, sn, s_bf16, xq + m * K, K, xs + m * ldg, xsum + m * ldg, ldg, \
                       y + m * ldo + n, ldo)
            ITILE_ROWS(T256)
#undef T256
        }
    }
}
#undef ITILE_ROWS

static void irows_range_4(int64_t M, int64_t K, int64_t group, const uint8_t *w, const void *s, int s_bf16,
                          const int16_t *xq, const float *xs, const int32_t *xsum, float *y, int64_t ldo, int64_t n0,
                          int64_t n1) {
    irows_range_of(4, M, K, group, w, s, s_bf16, xq, xs, xsum, y, ldo, n0, n1);
}

static void irows_range_8(int64_t M, int64_t K, int64_t group, const uint8_t *w, const void *s, int s_bf16,
                          const int16_t *xq, const float *xs, const int32_t *xsum, float *y, int64_t ldo, int64_t n0,
                          int64_t n1) {
    irows_range_of(8, M, K, group, w, s, s_bf16, xq, xs, xsum, y, ldo, n0, n1);
}
#endif

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

/* Activations of one call, widened once: float32 rows (`xp`, float path), or int16 rows + chunk scales + sums
 * (bfloat16 on AVX2), carved from one scratch of M * K + 2 * M * (K / 32) floats. */
typedef struct {
    int int16;
    int64_t rows;
    float *xp;
    int16_t *xq;
    float *xs;
    int32_t *xsum;
} Acts;

static inline Acts acts_in(int x_bf16, int64_t M, int64_t K, float *scratch) {
    Acts a = {0, M, scratch, 0, 0, 0};
#if Q_AVX2
    if (x_bf16) { /* int16 rows, then as many int16 for each row before ordering, then scales and sums */
        a.int16 = 1;
        a.xq = (int16_t *)scratch;
        a.xs = scratch + M * K;
        a.xsum = (int32_t *)(a.xs + M * (K / 32));
    }
#endif
    return a;
}

static inline void acts_row(int bits, int64_t K, int64_t group, const void *src, int bf16, Acts a, int64_t m) {
#if Q_AVX2
    if (a.int16) {
        int64_t ag = act_chunk(group);
        int16_t *natural = a.xq + (a.rows + m) * K;
        quantize_row_i16(K, ag, src, bf16, natural, a.xs + m * (K / ag), a.xsum + m * (K / ag));
        order_row_i16(bits, K, ag, natural, a.xq + m * K);
        return;
    }
#endif
    widen_row(bits, K, src, bf16, a.xp + m * K);
}

/* Output rows [n0, n1) for activation rows [r0, r0 + M) of `a`. */
static inline void rows_of(int bits, int64_t M, int64_t K, int64_t group, const uint8_t *w, const void *s,
                           int s_bf16, Acts a, int64_t r0, float *y, int64_t ldo, int64_t n0, int64_t n1) {
#if Q_AVX2
    if (a.int16) {
        int64_t ag = act_chunk(group);
        (bits == 4 ? irows_range_4 : irows_range_8)(M, K, group, w, s, s_bf16, a.xq + r0 * K, a.xs + r0 * (K / ag),
                                                    a.xsum + r0 * (K / ag), y, ldo, n0, n1);
        return;
    }
#endif
    rows_range(bits, M, K, group, w, s, s_bf16, a.xp + r0 * K, K, y, ldo, n0, n1);
}

#define CHUNK 16 /* output rows per work item */

/* The phases below are orphaned `omp for`s (each ending in its barrier): every thread of the enclosing parallel
 * region calls them, so the decoder kernels (cpu_kernels.c, through the addresses `phase_linear` /
 * `phase_moe`) run quantized layers inside their own region, as one call here does in a region of its own.
 *
 * A quantized weight as the decoder kernels' layer table points to it (int64 words): bits, group (int8: K),
 * N (rows; per expert for stacked experts), K, scales in bfloat16, the data's and the scales' addresses. */
enum { W_BITS, W_GROUP, W_N, W_K, W_SBF16, W_DATA, W_SCALES };

/* x [M] rows (row m at rows[m], or at x + m * K without rows) times W^T -> out [M] rows of ldo elements:
 * out = y + bias, or with `add` out += y rounded to out's type first (a residual, as separate ops round).
 * Scratch: xp M * K + 2 * M * (K / 32) floats, yf M * N floats. */
static void linear_phases(const int64_t *w, int64_t M, const void *x, const void *const *rows, int x_bf16,
                          const float *bias, void *out, int64_t ldo, int out_bf16, int add, float *xp, float *yf) {
    const int bits = (int)w[W_BITS];
    const int64_t group = w[W_GROUP], N = w[W_N], K = w[W_K], items = (N + CHUNK - 1) / CHUNK;
    const uint8_t *data = (const uint8_t *)w[W_DATA];
    const void *scales = (const void *)w[W_SCALES];
    Acts acts = acts_in(x_bf16, M, K, xp);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        acts_row(bits, K, group, rows ? rows[m] : (const char *)x + m * K * (x_bf16 ? 2 : 4), x_bf16, acts, m);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; i++) {
        int64_t n0 = i * CHUNK, n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
        rows_of(bits, M, K, group, data, scales, (int)w[W_SBF16], acts, 0, yf, N, n0, n1);
    }
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float v = yf[m * N + n] + (bias ? bias[n] : 0.0f);
            if (add) v = (out_bf16 ? widen_bf16(narrow_bf16(v)) : v) + load_act(out, out_bf16, m * ldo + n);
            store_act(out, out_bf16, m * ldo + n, v);
        }
}

/* y[M, N] = x[M, K] . W^T (+ bias[N], float32, optional), x and y float32 or bfloat16. `xp`: scratch of
 * M * K + 2 * M * (K / 32) floats; `yf`: scratch of M * N floats. */
void quant_linear(int bits, int64_t M, int64_t N, int64_t K, int64_t group, const uint8_t *w, const void *s,
                  int s_bf16, const void *x, int x_bf16, const float *bias, void *y, int y_bf16, float *xp,
                  float *yf, int threads) {
    const int64_t words[] = {bits, group, N, K, s_bf16, (int64_t)w, (int64_t)s};
#pragma omp parallel num_threads(threads)
    linear_phases(words, M, x, 0, x_bf16, bias, y, N, y_bf16, 0, xp, yf);
}

/* Routed SwiGLU experts: S selections sorted by expert (`starts` [E + 1]: expert e's at starts[e] ..
 * starts[e + 1]), selection j's row x[order[j] / K] (without `order`: x[j]), through its expert's gate_up
 * (w_up: [E, 2I, H], gate rows first) and down (w_down: [E, H, I]). With `weights` (per flat selection
 * t * K + k) out[t] = the sum of token t's K slots in top-k order, each times its weight (float32, rounded once);
 * without, out[j] = selection j's row. Scratch (floats): xp S * H + 2 * S * (H / 32), h S * 2I,
 * hp S * I + 2 * S * (I / 32); int64 ids E + 1, where S (with weights). Work items: (expert, 16 output
 * rows). */
static void moe_phases(const int64_t *w_up, const int64_t *w_down, int64_t S, int64_t K, int64_t E,
                       const int64_t *starts, const int64_t *order, const float *weights, const void *x, int x_bf16,
                       void *out, int out_bf16, float *xp, float *h, float *hp, int64_t *ids, int64_t *where) {
    const int bits_up = (int)w_up[W_BITS], bits_down = (int)w_down[W_BITS], s_bf16 = (int)w_up[W_SBF16];
    const int64_t H = w_up[W_K], I = w_down[W_K], up_rows = 2 * I, group_up = w_up[W_GROUP],
                  group_down = w_down[W_GROUP], sb = s_bf16 ? 2 : 4;
    const int64_t up_bytes = bits_up == 4 ? H / 2 : H, down_bytes = bits_down == 4 ? I / 2 : I;
    const int64_t up_items = (up_rows + CHUNK - 1) / CHUNK, down_items = (H + CHUNK - 1) / CHUNK;
    const int64_t up_scales = up_rows * (H / group_up) * sb, down_scales = H * (I / group_down) * sb;
    const uint8_t *wu = (const uint8_t *)w_up[W_DATA], *wd = (const uint8_t *)w_down[W_DATA];
    const char *su = (const char *)w_up[W_SCALES], *sd = (const char *)w_down[W_SCALES];
#pragma omp single
    { /* the experts with rows, then their count */
        int64_t n = 0;
        for (int64_t e = 0; e < E; e++)
            if (starts[e + 1] > starts[e]) ids[n++] = e;
        ids[E] = n;
    }
    const int64_t active = ids[E];
    Acts up = acts_in(x_bf16, S, H, xp), down = acts_in(x_bf16, S, I, hp);
#pragma omp for schedule(static)
    for (int64_t j = 0; j < S; j++) {
        const int64_t row = order ? order[j] / K : j;
        if (weights) where[order ? order[j] : j] = j;
        acts_row(bits_up, H, group_up, (const char *)x + row * H * (x_bf16 ? 2 : 4), x_bf16, up, j);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < active * up_items; i++) {
        int64_t e = ids[i / up_items], n0 = (i % up_items) * CHUNK;
        int64_t n1 = n0 + CHUNK < up_rows ? n0 + CHUNK : up_rows, r0 = starts[e];
        rows_of(bits_up, starts[e + 1] - r0, H, group_up, wu + e * up_rows * up_bytes, su + e * up_scales, s_bf16,
                up, r0, h + r0 * up_rows, up_rows, n0, n1);
    }
#pragma omp for schedule(static)
    for (int64_t j = 0; j < S; j++) {
        float *g = h + j * up_rows; /* SwiGLU written over the gate half, then taken as the down rows */
        const float *u = g + I;
        for (int64_t k = 0; k < I; k++) g[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
        acts_row(bits_down, I, group_down, g, 0, down, j);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < active * down_items; i++) {
        int64_t e = ids[i / down_items], n0 = (i % down_items) * CHUNK;
        int64_t n1 = n0 + CHUNK < H ? n0 + CHUNK : H, r0 = starts[e];
        /* (the up phase's activations are done with: its scratch takes the float output) */
        rows_of(bits_down, starts[e + 1] - r0, I, group_down, wd + e * H * down_bytes, sd + e * down_scales, s_bf16,
                down, r0, xp + r0 * H, H, n0, n1);
    }
    const int64_t T = weights ? S / K : S;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < H; n++) {
            float v = weights ? 0.0f : xp[t * H + n];
            for (int64_t k = 0; weights && k < K; k++) v += xp[where[t * K + k] * H + n] * weights[t * K + k];
            store_act(out, out_bf16, t * H + n, v);
        }
}

/* A routed SwiGLU expert layer: T tokens x [T, H], each with K selections through its expert's gate_up
 * [E, 2I, H] (gate rows first) and down [E, H, I]. `order` [T * K]: the flat (token, slot) selections sorted by
 * expert, `counts` [E] selections each; with `weights` [T * K] (float32) out [T, H] holds each token's K expert
 * outputs weighted and summed in slot order, in float32, rounded once. Without `order` and `weights` (K = 1): x
 * holds the T rows already sorted by expert and out [T, H] each row's expert output (the caller weights and sums).
 * Scratch (floats, S = T * K selections): xp S * H + 2 * S * (H / 32), h S * 2I, hp S * I + 2 * S * (I / 32);
 * starts 2E + 2 int64; `where` S int64 (with weights). One parallel region, a barrier between the phases. */
void quant_moe(int bits_up, int bits_down, int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, int64_t group_up,
               int64_t group_down, const int64_t *counts, const int64_t *order, const float *weights, const void *x,
               int x_bf16, const uint8_t *wu, const void *su, const uint8_t *wd, const void *sd, int s_bf16,
               void *out, int out_bf16, float *xp, float *h, float *hp, int64_t *starts, int64_t *where,
               int threads) {
    const int64_t up[] = {bits_up, group_up, 2 * I, H, s_bf16, (int64_t)wu, (int64_t)su};
    const int64_t down[] = {bits_down, group_down, H, I, s_bf16, (int64_t)wd, (int64_t)sd};
    starts[0] = 0;
    for (int64_t e = 0; e < E; e++) starts[e + 1] = starts[e] + counts[e];
#pragma omp parallel num_threads(threads)
    moe_phases(up, down, T * K, K, E, starts, order, weights, x, x_bf16, out, out_bf16, xp, h, hp, starts + E + 1,
               where);
}

/* The decoder kernels' entry points into the phases (called by every thread of their parallel region). */
void phase_linear(const int64_t *w, int64_t M, const void *const *rows, int x_bf16, void *out, int64_t ldo,
                  int out_bf16, int add, float *xp, float *yf) {
    linear_phases(w, M, 0, rows, x_bf16, 0, out, ldo, out_bf16, add, xp, yf);
}

void phase_moe(const int64_t *w_up, const int64_t *w_down, int64_t T, int64_t K, int64_t E, const int64_t *starts,
               const int64_t *order, const float *weights, const void *x, int x_bf16, void *out, int out_bf16,
               float *xp, float *h, float *hp, int64_t *ids, int64_t *where) {
    moe_phases(w_up, w_down, T * K, K, E, starts, order, weights, x, x_bf16, out, out_bf16, xp, h, hp, ids, where);
}

/* A bfloat16 weight's linear layer, y[M, N] = x[M, K] . W[N, K]^T (+ bias): for CPUs without bfloat16
 * arithmetic, where torch's bfloat16 GEMM is emulated (the released Thinker's 152064-row output head, 2
 * threads, AVX2: 53 / 152 / 558 ms at 1 / 4 / 16 rows). Weights widened in registers (exact), rows widened to
 * float32 once; per row 2 FMA chains in one fixed order, up to 4 rows share each weight vector. */
#if Q_AVX2
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __attribute__((always_inline)) void dtile(const int MR, int64_t K, const uint16_t *w, const float *xp,
                                                        int64_t ldx, float *out, int64_t ldo) {
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m256 a = widen8(w + k), b = widen8(w + k + 8);
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
            acc[m][0] = _mm256_fmadd_ps(a, _mm256_loadu_ps(xp + m * ldx + k), acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(b, _mm256_loadu_ps(xp + m * ldx + k + 8), acc[m][1]);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) out[m * ldo] = hsum8(_mm256_add_ps(acc[m][0], acc[m][1]));
}
#else
static inline void dtile(int MR, int64_t K, const uint16_t *w, const float *xp, int64_t ldx, float *out,
                         int64_t ldo) {
    for (int m = 0; m < MR; m++) {
        float total = 0.0f;
        for (int64_t k = 0; k < K; k++) total += widen_bf16(w[k]) * xp[m * ldx + k];
        out[m * ldo] = total;
    }
}
#endif

void dense_bf16(int64_t M, int64_t N, int64_t K, const uint16_t *w, const void *x, int x_bf16, const float *bias,
                void *y, int y_bf16, float *xp, float *yf, int threads) {
    int64_t items = (N + CHUNK - 1) / CHUNK;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) xp[m * K + k] = load_act(x, x_bf16, m * K + k);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < items; i++) {
            int64_t n1 = (i + 1) * CHUNK < N ? (i + 1) * CHUNK : N;
            for (int64_t n = i * CHUNK; n < n1; n++) {
                const uint16_t *wn = w + n * K;
                int64_t m = 0;
                for (; m + 4 <= M; m += 4) dtile(4, K, wn, xp + m * K, K, yf + m * N + n, N);
                switch (M - m) {
                case 3: dtile(3, K, wn, xp + m * K, K, yf + m * N + n, N); break;
                case 2: dtile(2, K, wn, xp + m * K, K, yf + m * N + n, N); break;
                case 1: dtile(1, K, wn, xp + m * K, K, yf + m * N + n, N); break;
                default: break;
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) store_act(y, y_bf16, m * N + n, yf[m * N + n] + (bias ? bias[n] : 0.0f));
    }
}

/* Read n bytes (a multiple of 32) once over `threads` threads and return their byte sum: the machine's read
 * bandwidth as a streaming kernel sees it (the benchmarks' memory-bandwidth bound). */
int64_t read_bytes(const uint8_t *p, int64_t n, int threads) {
    int64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(threads)
    for (int64_t block = 0; block < n / 4096; block++) {
        const uint8_t *q = p + block * 4096;
#if Q_AVX2
        __m256i acc = _mm256_setzero_si256();
        for (int i = 0; i < 4096; i += 32)
            acc = _mm256_add_epi64(acc, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(q + i)),
                                                        _mm256_setzero_si256()));
        int64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, acc);
        total += lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
        for (int i = 0; i < 4096; i++) total += q[i];
#endif
    }
    return total;
}
