/* The fast option's CPU kernels on weights in panel layout (see cpu_kernels.py): routed SwiGLU experts and
 * linear layers, for batches of any size, reading each weight once per call.
 *
 * Built at first use for the host CPU. One call serves a whole MoE layer:
 *   1. the (token, slot) selections are sorted by expert (a stable counting sort);
 *   2. gate/up: for each panel of 16 intermediate columns (gate and up side by side, [H][32] per panel),
 *      every expert's rows take their dot products in registers, R rows at a time, then SwiGLU;
 *   3. down: for each panel of 32 hidden columns ([I][32]), every expert's rows, weighted by their routing
 *      weight, then each token's slots summed in top-k order.
 * Threads split the panels of each phase (one barrier between the phases), so every thread streams its own
 * share of every expert's weights and no two threads write the same output.
 *
 * A linear layer is the down phase alone (one expert, weight 1) over all rows.
 *
 * Why: a decode batch gives each expert a few rows; GEMM libraries then stream the weights at a fraction of
 * the read bandwidth and pay a call per expert. Here the cost is the weights' bytes at a few rows, and the
 * FMA units' peak (R rows x 32 columns of accumulators per weight load) at many.
 *
 * Weights: float32 or bfloat16 (raw 16-bit words, widened exactly, or with AVX512-BF16 taken in pairs by its
 * dot products); sums in float32. Each output row's sums run in one fixed order whatever the other rows and
 * the thread count, so a row's result does not depend on its batch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Vectors of the build's native width (GCC lowers wider generic vectors on AVX2 through the stack and general
 * registers, ~5x slower): a 32-column panel row is PV of them. */
#if defined(__AVX512F__)
#define LANES 16
#define ROWS 8 /* 32 vector registers: 8 x 2 accumulators, 2 weight vectors, a broadcast */
#else
#define LANES 8
#define ROWS 6 /* 16 (AVX2) registers: 6 x 2 accumulators over half a panel, 2 weight vectors, a broadcast */
#endif
#define PV (32 / LANES)
/* Vector clones at that width (libmvec's _ZGVeN16 / _ZGVdN8 sinf, expf): a clone wider than the build's vectors
 * is not used, and the loop stays scalar; libmvec has no 8-lane SSE clone (a portable build stays scalar). */
#if defined(__AVX512F__)
#define DECLARE_SIMD _Pragma("omp declare simd simdlen(16) notinbranch")
#elif defined(__AVX2__)
#define DECLARE_SIMD _Pragma("omp declare simd simdlen(8) notinbranch")
#else
#define DECLARE_SIMD
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef float vfu __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint16_t hu __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t uv __attribute__((vector_size(LANES * 4)));

static inline vf load_f32(const float *p) { return *(const vfu *)p; }

#if LANES == 8 && defined(__AVX2__)
#include <immintrin.h>
/* (GCC widens a generic 8 x 16-bit vector 4 lanes at a time plus an insert; vpmovzxwd takes all 8) */
static inline vf load_bf16(const uint16_t *p) {
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
#else
static inline vf load_bf16(const uint16_t *p) {
    uv wide = __builtin_convertvector(*(const hu *)p, uv) << 16;
    return (vf)wide;
}
#endif

static inline void store_f32(float *p, vf v) { *(vfu *)p = v; }

static inline void store_bf16(uint16_t *p, vf v) {
    uv bits = (uv)v;
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16; /* round to nearest even (finite values) */
    *(hu *)p = __builtin_convertvector(bits, hu);
}

/* A broadcast (not `(vf){0} + x`: adding zero is not an identity for -0.0, so that costs an add per use). */
static inline vf splat(float x) {
#if LANES == 16
    return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
    return (vf){x, x, x, x, x, x, x, x};
#endif
}

/* A linear layer's panels for more than ROWS rows: while the last row tile reads its panel again from the
 * caches, the next panel streams into L2 (the lines at the same input index k: w [K][32], or [K/2][32][2] in
 * pairs), so memory stays busy between the first tiles of two panels. 16 rows, 13 code-predictor-shaped
 * layers, the two builds alternating in one process: 2-7% faster in float32, 0-25% in bfloat16 (into L1
 * instead, float32 was 2-8% slower). */
#define PREFETCH_K(pf, k, bytes)                                                                            \
    do {                                                                                                    \
        __builtin_prefetch((const char *)((pf) + (k) * 32), 0, 2);                                          \
        if ((bytes) > 64) __builtin_prefetch((const char *)((pf) + (k) * 32) + 64, 0, 2);                    \
    } while (0)
/* A panel read once (a tile's first pass over it) asks for the lines AHEAD_BYTES ahead of the ones it reads:
 * the hardware prefetcher restarts at every 4 KB boundary, and a MoE layer's panels are read a few KB here, a
 * few KB there (128 KB per expert and panel at the released widths, experts in turn). Past a panel's end these
 * are the next panel's first lines, which a linear layer's thread reads next. One released-width MoE layer
 * (2048 x 768, 128 experts, top-8), 2 threads, alternating builds: 1 token 5.1-5.6 -> 3.1-3.6 ms, 16 tokens
 * 52-60 -> 30-40 ms (float32 on bfloat16 pairs and bfloat16 alike; 8 KB ahead was no better). */
#define AHEAD_BYTES 4096
static inline __attribute__((always_inline)) void prefetch_ahead(const void *at, int bytes) {
    const char *p = (const char *)at + AHEAD_BYTES;
    __builtin_prefetch(p, 0, 2);
    if (bytes > 64) __builtin_prefetch(p + 64, 0, 2);
}

static inline float widen(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t narrow(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16); /* round to nearest even (finite values) */
}

static inline float get_f32(const float *p) { return *p; }
static inline void put_f32(float *p, float v) { *p = v; }
static inline float round_f32(float v) { return v; }
static inline float get_bf16(const uint16_t *p) { return widen(*p); }
static inline void put_bf16(uint16_t *p, float v) { *p = narrow(v); }
static inline float round_bf16(float v) { return widen(narrow(v)); }

/* 32 output columns (PV vectors) at element `offset` of a float32 or bfloat16 output. */
static inline void store_columns(void *out, int out_bf16, int64_t offset, const vf *v) {
    for (int i = 0; i < PV; i++) {
        if (out_bf16) store_bf16((uint16_t *)out + offset + i * LANES, v[i]);
        else store_f32((float *)out + offset + i * LANES, v[i]);
    }
}

/* Stable counting sort of the T*K selections by expert: order[j] = flat (token * K + slot) index, expert e's
 * selections at order[starts[e] .. starts[e + 1]). */
static void sort_selections(int64_t n, int64_t E, const int64_t *ids, int64_t *order, int64_t *starts) {
    memset(starts, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t s = 0; s < n; s++) starts[ids[s] + 1]++;
    for (int64_t e = 0; e < E; e++) starts[e + 1] += starts[e];
    int64_t *next = starts + E + 1; /* E more slots of scratch */
    memcpy(next, starts, (size_t)E * sizeof(int64_t));
    for (int64_t s = 0; s < n; s++) order[next[ids[s]]++] = s;
}

DECLARE_SIMD
extern float expf(float);
/* SwiGLU's silu(g) * u with a vector clone at the build's width (libmvec's expf) for loops over lanes: the experts'
 * gate/up tiles and the decoder pass's MLP. (glibc's scalar expf, called per intermediate, was ~10% of a
 * small-preset MoE layer at ~4 rows an expert.) */
DECLARE_SIMD
static inline float swiglu_lane(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* panel_dots' inner loop over inputs k0 .. k1 for columns i0 .. i0 + part, PF the prefetch each k issues. A
 * whole AVX2 panel on 3 rows (12 accumulators) broadcasts its rows first, then widens one weight vector at a time:
 * 16 registers. Holding the panel's 4 weight vectors instead spilled, at half the speed of 2 or 4 rows (3 rows x
 * 512 x 4096, 1 Zen 3 thread, warm: 41 -> 62-74 GFLOP/s; a MoE layer's experts get 3 rows as often as 4). The
 * same products in the same order either way. */
#define PANEL_K_LOOP(SUFFIX, WT, LOAD, PF)                                                                   \
    do {                                                                                                    \
        _Pragma("GCC unroll 2") for (int64_t k = k0; k < k1; k++) {                                         \
            PF;                                                                                             \
            if (PV > 2 && part == PV && rows * PV > 8) {                                                    \
                vf xb[ROWS];                                                                                \
                for (int r = 0; r < rows; r++) xb[r] = splat(row_at_##SUFFIX(x, wide, widen_rows, r, k, k0)); \
                for (int i = 0; i < PV; i++) {                                                              \
                    const vf wv = LOAD(w + k * 32 + (i0 + i) * LANES);                                      \
                    for (int r = 0; r < rows; r++) s[r][i] += xb[r] * wv;                                   \
                }                                                                                           \
                continue;                                                                                   \
            }                                                                                               \
            vf wk[PV];                                                                                      \
            for (int i = 0; i < part; i++) wk[i] = LOAD(w + k * 32 + (i0 + i) * LANES);                     \
            for (int r = 0; r < rows; r++) {                                                                \
                const vf xb = splat(row_at_##SUFFIX(x, wide, widen_rows, r, k, k0));                        \
                for (int i = 0; i < part; i++) s[r][i] += xb * wk[i];                                       \
            }                                                                                               \
        }                                                                                                   \
    } while (0)

/* One kernel per weight type: WT the stored element, LOAD widens LANES of them to float32. */
#define DEFINE_KERNELS(SUFFIX, WT, LOAD, XT, XS)                                                             \
    /* row r's input k: from the chunk's widened copy, or as stored */                                     \
    static inline __attribute__((always_inline)) float row_at_##SUFFIX(const XT *const *x, float (*wide)[64], \
                                                                       int widened, int r, int64_t k,      \
                                                                       int64_t k0) {                       \
        return widened ? wide[r][k - k0] : get_##XS(x[r] + k);                                              \
    }                                                                                                       \
    /* acc[r][i]: `rows` (<= ROWS) rows' dot products with a panel's columns i*LANES .., w [K][32]; the rows \
     * (and the SwiGLU intermediates written) of type XT, read and written by get_##XS / put_##XS. */         \
    static inline __attribute__((always_inline)) void panel_dots_##SUFFIX(                                   \
        const int rows, int64_t K, const XT *const *x, const WT *w, vf (*acc)[PV], const WT *pf) {           \
        /* The whole panel at once where its accumulators fit 12 registers (AVX-512, PV 2; AVX2 up to 3 rows:  \
         * independent sums hide the FMA latency at few rows); else (AVX2, 4-6 rows) each half in turn, so 6   \
         * rows fit the 16 registers: over 64 inputs at a time (8 KB of the panel), so the second half reads    \
         * them from L1, not as a second strided pass over memory. Each column's sum runs in k order. */        \
        const int part = PV <= 2 || rows * PV <= 12 ? PV : 2;                                               \
        /* bfloat16 rows, 4 or more: each chunk's inputs widened once into `wide` (exact: the same products \
         * in the same order), so a broadcast is one load; widening per broadcast cost AVX2's 6-row tile ~3 \
         * more instructions per row and k (bfloat16 linear layers 1.2-1.45x faster at 4-64 rows, the same \
         * at 1-3) */                                                                                       \
        const int widen_rows = sizeof(XT) == 2 && rows > 3;                                                 \
        /* (halves over a whole panel of at most 16 KB, which stays in L1 for the second half: ~2-5% at 96-256 \
         * inputs, fewer accumulator spills) */                                                            \
        const int64_t chunk = widen_rows || (part < PV && K * 32 * (int64_t)sizeof(WT) > 16384) ? 64 : K;   \
        float wide[ROWS][64];                                                                               \
        for (int r = 0; r < rows; r++)                                                                      \
            for (int i = 0; i < PV; i++) acc[r][i] = splat(0.0f);                                           \
        for (int64_t k0 = 0; k0 < K; k0 += chunk) {                                                         \
            const int64_t k1 = K - k0 < chunk ? K : k0 + chunk;                                             \
            for (int r = 0; widen_rows && r < rows; r++)                                                    \
                for (int64_t k = k0; k < k1; k++) wide[r][k - k0] = get_##XS(x[r] + k);                    \
            for (int i0 = 0; i0 < PV; i0 += part) {                                                         \
                vf s[ROWS][PV];                                                                             \
                for (int r = 0; r < rows; r++)                                                              \
                    for (int i = 0; i < part; i++) s[r][i] = acc[r][i0 + i];                                \
                /* (the prefetch chosen outside the k loop: a test per k cost AVX2's 6-row tile a sixth of \
                 * its instructions, ~26 per 12 FMAs) */                                                   \
                if (i0 != 0) PANEL_K_LOOP(SUFFIX, WT, LOAD, (void)0);                                      \
                else if (pf) PANEL_K_LOOP(SUFFIX, WT, LOAD, PREFETCH_K(pf, k, 32 * sizeof(WT)));           \
                else PANEL_K_LOOP(SUFFIX, WT, LOAD, prefetch_ahead(w + k * 32, 32 * sizeof(WT)));          \
                for (int r = 0; r < rows; r++)                                                              \
                    for (int i = 0; i < part; i++) acc[r][i0 + i] = s[r][i];                                \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    DEFINE_TILES(SUFFIX, WT, XT, XS)

/* The row tiles on a variant's panel_dots: rows XT (read by get_##XS), weights WT. */
#define DEFINE_TILES(SUFFIX, WT, XT, XS)                                                                     \
    /* gate/up over one panel (16 gate, 16 up columns), then SwiGLU: h[r] gets 16 intermediates. */          \
    static inline __attribute__((always_inline)) void gate_up_tile_##SUFFIX(                                 \
        const int rows, int64_t H, const XT *const *x, const WT *w, XT *const *h, const WT *pf) {            \
        vf acc[ROWS][PV];                                                                                   \
        panel_dots_##SUFFIX(rows, H, x, w, acc, pf);                                                        \
        for (int r = 0; r < rows; r++) {                                                                    \
            float gu[32];                                                                                   \
            for (int i = 0; i < PV; i++) store_f32(gu + i * LANES, acc[r][i]);                              \
            float hs[16];                                                                                   \
            _Pragma("omp simd") for (int c = 0; c < 16; c++) hs[c] = swiglu_lane(gu[c], gu[16 + c]);        \
            for (int c = 0; c < 16; c++) put_##XS(h[r] + c, hs[c]);                                         \
        }                                                                                                   \
    }                                                                                                       \
    /* down over one panel of 32 hidden columns: y[r] = weight[r] * sums. */                                 \
    static inline __attribute__((always_inline)) void down_tile_##SUFFIX(                                    \
        const int rows, int64_t I, const XT *const *h, const WT *w, const float *weight, float *const *y,    \
        const WT *pf) {                                                                                     \
        vf acc[ROWS][PV];                                                                                   \
        panel_dots_##SUFFIX(rows, I, h, w, acc, pf);                                                        \
        for (int r = 0; r < rows; r++)                                                                      \
            for (int i = 0; i < PV; i++) store_f32(y[r] + i * LANES, acc[r][i] * splat(weight[r]));         \
    }                                                                                                       \
    DEFINE_PANELS(SUFFIX, WT, XT, XT)

/* Rows in tiles of ROWS, each tile a call with a constant row count (its accumulators stay in registers). */
/* (both builds' tiles have at least 6 rows; AVX-512's 8) */
#if ROWS == 8
#define ROW_CASES_7_TO_8(f, args)                                                                           \
    case 7: f(7, UNPACK args); break;                                                                       \
    case 8: f(8, UNPACK args); break;
#else
#define ROW_CASES_7_TO_8(f, args)
#endif
#define UNPACK(...) __VA_ARGS__
#define ROW_TILES(rows, f, args)                                                                            \
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {                                                           \
        switch (rows - r0 < ROWS ? rows - r0 : ROWS) {                                                      \
        case 1: f(1, UNPACK args); break;                                                                   \
        case 2: f(2, UNPACK args); break;                                                                   \
        case 3: f(3, UNPACK args); break;                                                                   \
        case 4: f(4, UNPACK args); break;                                                                   \
        case 5: f(5, UNPACK args); break;                                                                   \
        case 6: f(6, UNPACK args); break;                                                                   \
        ROW_CASES_7_TO_8(f, args)                                                                           \
        }                                                                                                   \
    }
/* A panel's rows: x / h rows of type XT / HT, weights WT. The last row tile reads the panel `next` (NULL: none)
 * into L2 as it goes, in step with its own reads (PREFETCH_K); the others read ahead in their own panel. */
#define DEFINE_PANELS(SUFFIX, WT, XT, HT)                                                                    \
    static inline void gate_up_panel_##SUFFIX(int64_t rows, int64_t H, const XT *const *x, const WT *w,     \
                                              HT *const *h, const WT *next) {                               \
        ROW_TILES(rows, gate_up_tile_##SUFFIX, (H, x + r0, w, h + r0, r0 + ROWS >= rows ? next : (const WT *)0)) \
    }                                                                                                       \
    static void down_panel_##SUFFIX(int64_t rows, int64_t I, const HT *const *h, const WT *w,                \
                                    const float *weight, float *const *y, const WT *next) {                 \
        ROW_TILES(rows, down_tile_##SUFFIX, (I, h + r0, w, weight + r0, y + r0,                             \
                                             r0 + ROWS >= rows ? next : (const WT *)0))                     \
    }

DEFINE_KERNELS(f32, float, load_f32, float, f32)
DEFINE_KERNELS(bf16, uint16_t, load_bf16, float, f32)
/* bfloat16 rows on widened bfloat16 weights: the decoder kernels' bfloat16 variant without dot products. */
DEFINE_KERNELS(bf16x, uint16_t, load_bf16, uint16_t, bf16)

#if LANES == 16
/* float32 rows on bfloat16 weights in pairs of inputs ([K/2][32][2]: the AMX kernels' and the dot-product
 * variant's layout), each widened exactly: the decoder kernels' float32 layers on AMX weights at few rows
 * (amx_kernels.c's tiles waste most of their 16 rows there). Each column sums in k order as the float32
 * panels do, so a bfloat16-valued weight gives their bits. K even. */
typedef uint32_t uvu __attribute__((vector_size(64), aligned(4)));

static inline __attribute__((always_inline)) void panel_dots_f32p(
    const int rows, int64_t K, const float *const *x, const uint16_t *w, vf (*acc)[PV], const uint16_t *pf) {
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = splat(0.0f);
    for (int64_t k = 0; k < K; k += 2) {
        if (pf) PREFETCH_K(pf, k, 128);
        else prefetch_ahead(w + k * 32, 128);
        const uv lo = *(const uvu *)(w + k * 32), hi = *(const uvu *)(w + k * 32 + 32);
        const vf even0 = (vf)(lo << 16), odd0 = (vf)(lo & 0xffff0000u), even1 = (vf)(hi << 16);
        const vf odd1 = (vf)(hi & 0xffff0000u);
        for (int r = 0; r < rows; r++) {
            const vf a = splat(x[r][k]), b = splat(x[r][k + 1]);
            acc[r][0] += a * even0;
            acc[r][1] += a * even1;
            acc[r][0] += b * odd0;
            acc[r][1] += b * odd1;
        }
    }
}
DEFINE_TILES(f32p, uint16_t, float, f32)
#else
/* AVX2: float32 rows on bfloat16 weights in the plain [K][32] layout, each widened exactly as it is read (the
 * `bf16` tiles); pairs would need 17 of the 16 registers at 6 rows. The same products in the same order: the
 * float32 panels' bits, from half the bytes. */
static inline __attribute__((always_inline)) void panel_dots_f32p(
    const int rows, int64_t K, const float *const *x, const uint16_t *w, vf (*acc)[PV], const uint16_t *pf) {
    panel_dots_bf16(rows, K, x, w, acc, pf);
}
DEFINE_TILES(f32p, uint16_t, float, f32)
#endif
/* Whether the f32p panels hold their inputs in pairs ([K/2][32][2]: AVX-512 builds) or plainly ([K][32]). */
int f32p_in_pairs(void) { return LANES == 16; }

#if defined(__AVX512BF16__)
/* bfloat16 with AVX512-BF16 dot products (two products per float32 lane and instruction, no widening): rows
 * and the SwiGLU intermediate in bfloat16 (as the reference keeps them), weights in pairs of hidden
 * (intermediate) indices: a panel is [H/2][32 columns][2]. */
#include <immintrin.h>

static inline __m512i pair(const uint16_t *p) {
    int32_t bits;
    memcpy(&bits, p, sizeof bits);
    return _mm512_set1_epi32(bits);
}

static inline __m512 dot(__m512 acc, __m512i x, const uint16_t *w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)_mm512_loadu_si512(w));
}

/* a[r], b[r]: `rows` rows' dot products with a panel's columns 0-15 and 16-31, w [K/2][32][2]. */
static inline __attribute__((always_inline)) void panel_dots_bf16dp(
    const int rows, int64_t K, const uint16_t *const *x, const uint16_t *w, __m512 *a, __m512 *b,
    const uint16_t *pf) {
    for (int r = 0; r < rows; r++) a[r] = b[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        if (pf) PREFETCH_K(pf, k, 128);
        else prefetch_ahead(w + k * 32, 128);
        const uint16_t *wk = w + k * 32;
        for (int r = 0; r < rows; r++) {
            const __m512i xb = pair(x[r] + k);
            a[r] = dot(a[r], xb, wk);
            b[r] = dot(b[r], xb, wk + 32);
        }
    }
}

static inline __attribute__((always_inline)) void gate_up_tile_bf16dp(
    const int rows, int64_t H, const uint16_t *const *x, const uint16_t *w, uint16_t *const *h, const uint16_t *pf) {
    __m512 g[ROWS], u[ROWS];
    panel_dots_bf16dp(rows, H, x, w, g, u, pf);
    for (int r = 0; r < rows; r++) {
        float gs[16], us[16];
        _mm512_storeu_ps(gs, g[r]);
        _mm512_storeu_ps(us, u[r]);
        _Pragma("omp simd") for (int c = 0; c < 16; c++) gs[c] = swiglu_lane(gs[c], us[c]);
        store_bf16(h[r], load_f32(gs));
    }
}

static inline __attribute__((always_inline)) void down_tile_bf16dp(
    const int rows, int64_t I, const uint16_t *const *h, const uint16_t *w, const float *weight, float *const *y,
    const uint16_t *pf) {
    __m512 a[ROWS], b[ROWS];
    panel_dots_bf16dp(rows, I, h, w, a, b, pf);
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(y[r], a[r] * splat(weight[r]));
        _mm512_storeu_ps(y[r] + 16, b[r] * splat(weight[r]));
    }
}

DEFINE_PANELS(bf16dp, uint16_t, uint16_t, uint16_t)
#endif

/* The panel a thread reads after expert e's panel p (experts' panels [E, panels, ...], those with rows only, p
 * before p + 1), as an index e' * panels + p', or -1: none. Its reads prefetch it in step (a MoE layer's panels
 * lie apart: the prefetcher would start over on each). */
static inline int64_t next_chunk(const int64_t *starts, int64_t E, int64_t e, int64_t p, int64_t panels) {
    for (int64_t n = e + 1; n < E; n++)
        if (starts[n + 1] > starts[n]) return n * panels + p;
    if (p + 1 >= panels) return -1;
    for (int64_t n = 0; n <= e; n++)
        if (starts[n + 1] > starts[n]) return n * panels + p + 1;
    return -1;
}

/* The layer's two phases for one weight type, run by every thread of the enclosing parallel region (orphaned
 * `omp for`s, each ending in its barrier), on selections already sorted by expert (order, starts).
 *   x        [T, H] rows (XT)
 *   weights  [T, K] float32 routing weights
 *   w13      [E, I/16, H, 32] gate/up panels; w2 [E, HP/32, I, 32] down panels (I, HP: multiples of 16, 32;
 *            padded with zero weights, so padded outputs and intermediates are 0)
 *   out      [T, HP] float32 or bfloat16 (out_bf16)
 *   h        [T*K, I] scratch (HT); ys [T*K, 32] float32, rows_in / rows_out [T*K]: this thread's scratch
 */
#define DEFINE_MOE_PHASES(SUFFIX, WT, XT, HT)                                                                \
    static void moe_phases_##SUFFIX(int64_t T, int64_t K, int64_t E, int64_t H, int64_t HP, int64_t I,      \
                                    const XT *x, const int64_t *order, const int64_t *starts,              \
                                    const float *weights, const WT *w13, const WT *w2, void *out,          \
                                    int out_bf16, HT *h, float *ys, void **rows_in, void **rows_out) {     \
        const int64_t up_panels = I / 16, down_panels = HP / 32;                                            \
        _Pragma("omp for schedule(static)") for (int64_t p = 0; p < up_panels; p++) {                       \
            for (int64_t e = 0; e < E; e++) {                                                               \
                const int64_t first = starts[e], count = starts[e + 1] - first;                             \
                if (!count) continue;                                                                      \
                for (int64_t j = 0; j < count; j++) {                                                       \
                    rows_in[j] = (void *)(x + (order[first + j] / K) * H);                                  \
                    rows_out[j] = h + (first + j) * I + p * 16;                                             \
                }                                                                                          \
                const int64_t at = next_chunk(starts, E, e, p, up_panels);                                 \
                gate_up_panel_##SUFFIX(count, H, (const XT *const *)rows_in,                               \
                                       w13 + ((e * up_panels + p) * H) * 32, (HT *const *)rows_out,        \
                                       at < 0 ? (const WT *)0 : w13 + at * H * 32);                        \
            }                                                                                              \
        }                                                                                                  \
        _Pragma("omp for schedule(static)") for (int64_t p = 0; p < down_panels; p++) {                     \
            for (int64_t e = 0; e < E; e++) {                                                               \
                const int64_t first = starts[e], count = starts[e + 1] - first;                             \
                if (!count) continue;                                                                      \
                float wsel[ROWS];                                                                          \
                for (int64_t j0 = 0; j0 < count; j0 += ROWS) {                                              \
                    const int64_t m = count - j0 < ROWS ? count - j0 : ROWS;                                \
                    for (int64_t j = 0; j < m; j++) {                                                       \
                        const int64_t s = order[first + j0 + j];                                            \
                        rows_in[j] = h + (first + j0 + j) * I;                                              \
                        rows_out[j] = ys + s * 32;                                                          \
                        wsel[j] = weights[s];                                                              \
                    }                                                                                      \
                    const int64_t at = j0 + ROWS >= count ? next_chunk(starts, E, e, p, down_panels) : -1;  \
                    down_panel_##SUFFIX(m, I, (const HT *const *)rows_in,                                  \
                                        w2 + ((e * down_panels + p) * I) * 32, wsel, (float *const *)rows_out, \
                                        at < 0 ? (const WT *)0 : w2 + at * I * 32);                        \
                }                                                                                          \
            }                                                                                              \
            for (int64_t t = 0; t < T; t++) { /* each token's slots in top-k order */                      \
                vf sum[PV];                                                                                \
                for (int i = 0; i < PV; i++) sum[i] = load_f32(ys + t * K * 32 + i * LANES);                \
                for (int64_t k = 1; k < K; k++)                                                             \
                    for (int i = 0; i < PV; i++) sum[i] += load_f32(ys + (t * K + k) * 32 + i * LANES);     \
                store_columns(out, out_bf16, t * HP + p * 32, sum);                                         \
            }                                                                                              \
        }                                                                                                  \
    }

/* The layer, for one weight type: the phases above over ids [T, K] (int64 selected experts) sorted here.
 *   y        [threads, T*K, 32] float32 scratch; sort [2*T*K + 2*E + 2] int64 scratch; ptrs [threads, 2*T*K]
 */
#define DEFINE_LAYER(SUFFIX, WT, XT, HT)                                                                     \
    DEFINE_MOE_PHASES(SUFFIX, WT, XT, HT)                                                                    \
    void moe_experts_##SUFFIX(int64_t T, int64_t K, int64_t E, int64_t H, int64_t HP, int64_t I,            \
                              const XT *x,                                                                \
                              const int64_t *ids, const float *weights, const WT *w13, const WT *w2,        \
                              void *out, int out_bf16, HT *h, float *y, int64_t *sort, void **ptrs,         \
                              int threads) {                                                               \
        const int64_t n = T * K;                                                                           \
        int64_t *order = sort, *starts = sort + n;                                                         \
        sort_selections(n, E, ids, order, starts);                                                         \
        _Pragma("omp parallel num_threads(threads)") {                                                     \
            int tid = 0;                                                                                   \
            IF_OPENMP(tid = omp_get_thread_num();)                                                          \
            void **rows_in = ptrs + (int64_t)tid * 2 * n;                                                   \
            moe_phases_##SUFFIX(T, K, E, H, HP, I, x, order, starts, weights, w13, w2, out, out_bf16, h,   \
                                y + (int64_t)tid * n * 32, rows_in, rows_in + n);                          \
        }                                                                                                  \
    }

#ifdef _OPENMP
#include <omp.h>
#define IF_OPENMP(code) code
#else
#define IF_OPENMP(code)
#endif

DEFINE_LAYER(f32, float, float, float)
DEFINE_LAYER(bf16, uint16_t, float, float)
/* float32 rows on bfloat16 panels: a float32 model's experts where its weights are bfloat16 values */
DEFINE_LAYER(f32p, uint16_t, float, float)
DEFINE_MOE_PHASES(bf16x, uint16_t, uint16_t, uint16_t)
#if defined(__AVX512BF16__)
DEFINE_LAYER(bf16dp, uint16_t, uint16_t, uint16_t)
#endif

/* A value as a tensor of the output's type holds it: rounded through bfloat16 when the output is bfloat16. */
static inline vf as_stored(vf v, int bf16) {
    if (!bf16) return v;
    uint16_t tmp[LANES];
    store_bf16(tmp, v);
    return load_bf16(tmp);
}

static inline vf load_columns(const void *out, int out_bf16, int64_t offset) {
    return out_bf16 ? load_bf16((const uint16_t *)out + offset) : load_f32((const float *)out + offset);
}

/* A linear layer's panels shared among the threads of the enclosing parallel region (an orphaned `omp for`,
 * ending in its barrier): out[t] = x[t] W^T + bias, or with `add` out[t] += (x[t] W^T + bias) rounded to
 * out's type first (a residual, as separate ops would round). rows_in / rows_out / ys: this thread's. */
#define DEFINE_LINEAR_PANELS(SUFFIX, WT, XT)                                                                 \
    static void linear_panels_##SUFFIX(int64_t T, int64_t K, int64_t N, const XT *const *rows_in,           \
                                       const WT *w, const float *bias, void *out, int out_bf16, int add,    \
                                       const float *ys, float *const *rows_out, const float *ones) {        \
        _Pragma("omp for schedule(static)") for (int64_t p = 0; p < N / 32; p++) {                          \
            /* (one tile: its reads ahead run into the next panel, contiguous) */                          \
            down_panel_##SUFFIX(T, K, rows_in, w + p * K * 32, ones, rows_out,                             \
                                T > ROWS ? w + (p + 1) * K * 32 : (const WT *)0);                         \
            vf b[PV];                                                                                      \
            for (int i = 0; i < PV; i++) b[i] = bias ? load_f32(bias + p * 32 + i * LANES) : splat(0.0f);  \
            for (int64_t t = 0; t < T; t++) {                                                              \
                const int64_t at = t * N + p * 32;                                                         \
                vf v[PV];                                                                                  \
                for (int i = 0; i < PV; i++) {                                                             \
                    v[i] = load_f32(ys + t * 32 + i * LANES) + b[i];                                       \
                    if (add) v[i] = as_stored(v[i], out_bf16) + load_columns(out, out_bf16, at + i * LANES); \
                }                                                                                          \
                store_columns(out, out_bf16, at, v);                                                       \
            }                                                                                              \
        }                                                                                                  \
    }

/* A linear layer, y = x W^T + bias, on the down projection's tiles (routing weight 1, exact):
 *   x [T, K] rows (XT), w [N/32, K, 32] panels, bias [N] float32 or NULL, out [T, N] float32 or bfloat16;
 *   y [threads, T, 32] float32 scratch, ptrs [threads, 2*T] pointer scratch, ones [T] float32 ones. */
#define DEFINE_LINEAR(SUFFIX, WT, XT)                                                                        \
    DEFINE_LINEAR_PANELS(SUFFIX, WT, XT)                                                                     \
    void linear_##SUFFIX(int64_t T, int64_t K, int64_t N, const XT *x, const WT *w, const float *bias,        \
                         void *out, int out_bf16, float *y, void **ptrs, const float *ones, int threads) {  \
        _Pragma("omp parallel num_threads(threads)") {                                                     \
            int tid = 0;                                                                                   \
            IF_OPENMP(tid = omp_get_thread_num();)                                                          \
            void **rows_in = ptrs + (int64_t)tid * 2 * T, **rows_out = rows_in + T;                         \
            float *ys = y + (int64_t)tid * T * 32;                                                          \
            for (int64_t t = 0; t < T; t++) {                                                              \
                rows_in[t] = (void *)(x + t * K);                                                          \
                rows_out[t] = ys + t * 32;                                                                 \
            }                                                                                              \
            linear_panels_##SUFFIX(T, K, N, (const XT *const *)rows_in, w, bias, out, out_bf16, 0, ys,     \
                                   (float *const *)rows_out, ones);                                        \
        }                                                                                                  \
    }

DEFINE_LINEAR(f32, float, float)
DEFINE_LINEAR(bf16x, uint16_t, uint16_t)
DEFINE_LINEAR(f32p, uint16_t, float)
#if defined(__AVX512BF16__)
DEFINE_LINEAR(bf16dp, uint16_t, uint16_t)
#endif

/* Paged decode attention: one query row per request attends to its request's cached keys and values, read
 * in place from the paged cache (no gathered copies). Query row rows[i] belongs to request r = reqs[i]; for
 * key/value head g, its query heads h = g*rep .. g*rep+rep-1 take scores s_j = (scale * q).k_j over the keys
 * j < lens[r] at cache slots slots[r, j], a softmax in float32 (max subtracted), and the weighted sum of the
 * values. Threads split the (row, key/value head) pairs.
 *   q [*, H, D], cache [2, cache_slots, KVH, D] (q's element type), out [*, H, D]; D a multiple of 16, at most
 *   MAX_HEAD_DIM; slots [requests, max_kv] int64, lens [requests] int64; scores [threads, max_kv] float32
 *   scratch. */
static inline float hsum(vf v) {
    float s[LANES], t = 0.0f;
    store_f32(s, v);
    for (int c = 0; c < LANES; c++) t += s[c];
    return t;
}

#define MAX_HEAD_DIM 256
/* One query head's attention over `len` positions (float32 scores and softmax, the max subtracted): position
 * j's key and value at keys / values + at(j) * stride, at(j) = slots ? slots[j] : j; q scaled first. s: `len`
 * floats of scratch; D a multiple of 16. */
#define DEFINE_ATTEND_HEAD(SUFFIX, T)                                                                        \
    static inline void attend_head_##SUFFIX(int64_t D, int64_t len, const T *q, float scale, const T *keys,  \
                                            const T *values, int64_t stride, const int64_t *slots, float *s, \
                                            T *out) {                                                       \
        const int64_t vecs = D / LANES;                                                                        \
        vf qv[MAX_HEAD_DIM / LANES], acc[MAX_HEAD_DIM / LANES];                                                  \
        for (int64_t c = 0; c < vecs; c++) qv[c] = load_##SUFFIX(q + c * LANES) * splat(scale);                \
        float top = -INFINITY, total = 0.0f;                                                                \
        for (int64_t j = 0; j < len; j++) {                                                                 \
            const T *k = keys + (slots ? slots[j] : j) * stride;                                            \
            vf dot = qv[0] * load_##SUFFIX(k);                                                             \
            for (int64_t c = 1; c < vecs; c++) dot += qv[c] * load_##SUFFIX(k + c * LANES);                    \
            s[j] = hsum(dot);                                                                               \
            top = s[j] > top ? s[j] : top;                                                                  \
        }                                                                                                   \
        for (int64_t j = 0; j < len; j++) total += (s[j] = expf(s[j] - top));                               \
        for (int64_t j = 0; j < len; j++) s[j] /= total;                                                    \
        for (int64_t c = 0; c < vecs; c++) acc[c] = splat(0.0f);                                            \
        for (int64_t j = 0; j < len; j++) {                                                                 \
            const T *v = values + (slots ? slots[j] : j) * stride;                                          \
            const vf p = splat(s[j]);                                                                      \
            for (int64_t c = 0; c < vecs; c++) acc[c] += p * load_##SUFFIX(v + c * LANES);                     \
        }                                                                                                   \
        for (int64_t c = 0; c < vecs; c++) store_##SUFFIX(out + c * LANES, acc[c]);                            \
    }
DEFINE_ATTEND_HEAD(f32, float)
DEFINE_ATTEND_HEAD(bf16, uint16_t)

#define DEFINE_DECODE_ATTENTION(SUFFIX, T)                                                                   \
    void decode_attention_##SUFFIX(int64_t n, int64_t H, int64_t KVH, int64_t D, const T *q,                \
                                   const int64_t *rows, const int64_t *reqs, const T *cache,               \
                                   int64_t cache_slots,                                                    \
                                   const int64_t *slots, const int64_t *lens, int64_t max_kv, float scale, \
                                   T *out, float *scores, int threads) {                                   \
        const int64_t rep = H / KVH;                                                                       \
        const T *keys = cache, *values = cache + cache_slots * KVH * D;                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                  \
        for (int64_t task = 0; task < n * KVH; task++) {                                                    \
            const int64_t i = task / KVH, g = task % KVH, r = reqs[i], len = lens[r];                     \
            int tid = 0;                                                                                   \
            IF_OPENMP(tid = omp_get_thread_num();)                                                          \
            for (int64_t h = 0; h < rep; h++) {                                                            \
                const int64_t at = (rows[i] * H + g * rep + h) * D;                                        \
                if (len <= 0) { /* no key (a padded row): zeros */                                         \
                    for (int64_t c = 0; c < D / LANES; c++) store_##SUFFIX(out + at + c * LANES, splat(0.0f)); \
                    continue;                                                                              \
                }                                                                                          \
                attend_head_##SUFFIX(D, len, q + at, scale, keys + g * D, values + g * D, KVH * D,          \
                                     slots + r * max_kv, scores + (int64_t)tid * max_kv, out + at);         \
            }                                                                                              \
        }                                                                                                  \
    }

DEFINE_DECODE_ATTENTION(f32, float)
DEFINE_DECODE_ATTENTION(bf16, uint16_t)

DECLARE_SIMD
extern float sinf(float);

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* sin(t) up to its sign (SnakeBeta squares it): t = k pi + r, |r| <= pi / 2 (pi in three parts of at most 12 bits,
 * so k pi's parts are exact for |k| < 4096), then an odd degree-9 polynomial fitted to sin on [-pi/2, pi/2] (error
 * 1.7e-8 before float32 rounding; ~1.2e-7 measured, as libmvec's); lanes beyond 8192 or NaN take libmvec's sinf.
 * Half the instructions of libmvec's call, whose vector sines were half of a 32-channel residual unit's tail.
 * Explicit FMAs: every kernel inlining it gets the same bits. */
#if LANES == 16
typedef __m512 vn;
typedef __mmask16 lanes_mask;
#define V_(op) _mm512_##op
__m512 _ZGVeN16v_sinf(__m512 x);
#define SINF_LANES _ZGVeN16v_sinf
#define ROUND_LANES(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define FAR_LANES(t) _mm512_cmp_ps_mask(_mm512_abs_ps(t), _mm512_set1_ps(8192.0f), _CMP_NLE_UQ)
#define ANY_LANE(m) (m)
#define BLEND_LANES(m, a, b) _mm512_mask_blend_ps(m, a, b)
#else
typedef __m256 vn;
typedef __m256 lanes_mask;
#define V_(op) _mm256_##op
__m256 _ZGVdN8v_sinf(__m256 x);
#define SINF_LANES _ZGVdN8v_sinf
#define ROUND_LANES(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define FAR_LANES(t) _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), t), _mm256_set1_ps(8192.0f), _CMP_NLE_UQ)
#define ANY_LANE(m) _mm256_movemask_ps(m)
#define BLEND_LANES(m, a, b) _mm256_blendv_ps(a, b, m)
#endif
static inline vn sin_unsigned(vn t) {
    const vn k = ROUND_LANES(V_(mul_ps)(t, V_(set1_ps)(0.318309886183790672f)));
    vn r = V_(fnmadd_ps)(k, V_(set1_ps)(3.140625f), t);
    r = V_(fnmadd_ps)(k, V_(set1_ps)(9.677410125732422e-4f), r);
    r = V_(fnmadd_ps)(k, V_(set1_ps)(-8.742277657347586e-8f), r);
    const vn r2 = V_(mul_ps)(r, r);
    vn p = V_(fmadd_ps)(V_(set1_ps)(2.6000548132e-6f), r2, V_(set1_ps)(-1.9806614728e-4f));
    p = V_(fmadd_ps)(p, r2, V_(set1_ps)(8.3330171183e-3f));
    p = V_(fmadd_ps)(p, r2, V_(set1_ps)(-1.6666656733e-1f));
    const vn poly = V_(fmadd_ps)(V_(mul_ps)(p, r2), r, r);
    const lanes_mask far = FAR_LANES(t);
    return ANY_LANE(far) ? BLEND_LANES(far, poly, SINF_LANES(t)) : poly;
}

/* SnakeBeta of LANES float32 values: u + (sin(u alpha) scale)^2. */
static inline vn snake_lanes(vn u, vn alpha, vn scale) {
    const vn y = V_(mul_ps)(sin_unsigned(V_(mul_ps)(u, alpha)), scale);
    return V_(fmadd_ps)(y, y, u);
}

/* SnakeBeta of n float32 values (src may be dst); a last part vector goes through a zero-padded copy, so each
 * value's bits are its lane's arithmetic wherever it stands. */
static void snake_f32(int64_t n, const float *src, const float *alpha, const float *scale, float *dst) {
    int64_t c = 0;
    for (; c + LANES <= n; c += LANES)
        V_(storeu_ps)(dst + c, snake_lanes(V_(loadu_ps)(src + c), V_(loadu_ps)(alpha + c), V_(loadu_ps)(scale + c)));
    if (c < n) {
        float part[3][LANES] = {{0}};
        memcpy(part[0], src + c, (size_t)(n - c) * sizeof(float));
        memcpy(part[1], alpha + c, (size_t)(n - c) * sizeof(float));
        memcpy(part[2], scale + c, (size_t)(n - c) * sizeof(float));
        V_(storeu_ps)(part[0], snake_lanes(V_(loadu_ps)(part[0]), V_(loadu_ps)(part[1]), V_(loadu_ps)(part[2])));
        memcpy(dst + c, part[0], (size_t)(n - c) * sizeof(float));
    }
}
#else
/* SnakeBeta of n float32 values (src may be dst), with libm's (or a vector clone's) sinf. */
static void snake_f32(int64_t n, const float *src, const float *alpha, const float *scale, float *dst) {
    _Pragma("omp simd") for (int64_t c = 0; c < n; c++) {
        const float y = sinf(src[c] * alpha[c]) * scale[c];
        dst[c] = src[c] + y * y;
    }
}
#endif

/* SnakeBeta of n values of a row of the type, rounded to it as a stored activation is, into float32 dst. */
#define DEFINE_SNAKE_SPAN(SUFFIX, TS, T)                                                                      \
    static inline void snake_span_##SUFFIX(int64_t n, const T *v, const float *alpha, const float *scale,      \
                                           float *dst) {                                                      \
        if (sizeof(T) == sizeof(float)) {                                                                      \
            snake_f32(n, (const float *)v, alpha, scale, dst);                                                 \
            return;                                                                                            \
        }                                                                                                      \
        for (int64_t c = 0; c < n; c++) dst[c] = get_##TS(v + c);                                              \
        snake_f32(n, dst, alpha, scale, dst);                                                                  \
        for (int64_t c = 0; c < n; c++) dst[c] = round_##TS(dst[c]);                                           \
    }
DEFINE_SNAKE_SPAN(f32, f32, float)
DEFINE_SNAKE_SPAN(bf16, bf16, uint16_t)

/* The code predictor's residual draws (code_predictor._draw_residual_codes), one call per code group for the whole
 * batch: where sampled[b], row b's k largest logits (NaN first, then larger first; equal ones in index order),
 * their softmax, the smallest prefix of them whose mass reaches top_p (the first always kept), and the race
 * argmax(p / noise[b]) over that prefix (its first maximum): codes[b] = the winner's index; else best[b]. The
 * softmax's normalisation is folded into the prefix test (mass before j >= top_p * total) and left out of the
 * race (a common positive factor). Per 16-row group torch's ops took ~0.6 ms, a top-k over [16, 2048] half of it.
 *   logits [B, V] float32, rows ldl apart; noise [B, k] float32 > 0, rows ldn apart (k <= MAX_DRAW, k <= V);
 *   sampled [B] bytes; best, codes [B] int64. */
#define MAX_DRAW 256
#define DRAW_BLOCK 16 /* values per block maximum (block_candidates) */
#define DRAW_BLOCKS 512 /* block maxima a row may have there (V <= 8192) */
#define DRAW_SPARE 1024 /* candidates it may keep */
static inline int drawn_before(float a, float b) { return (isnan(a) && !isnan(b)) || a > b; }

/* The k candidates of a row in order (n = min(k, V) of them): every value inserted into a sorted list. */
static int64_t insert_candidates(const float *row, int64_t V, int64_t k, float *top, int64_t *ids) {
    int64_t n = 0;
    for (int64_t v = 0; v < V; v++) { /* (a full list drops its last) */
        const float x = row[v];
        if (n == k && !drawn_before(x, top[k - 1])) continue;
        int64_t at = n < k ? n : k - 1;
        for (; at > 0 && drawn_before(x, top[at - 1]); at--) top[at] = top[at - 1], ids[at] = ids[at - 1];
        top[at] = x, ids[at] = v;
        n += n < k;
    }
    return n;
}

/* The k-th largest of a[0 .. n) (no NaN; a is reordered): Hoare's selection. */
static float kth_largest(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    const int64_t want = k - 1;
    while (lo < hi) {
        const float pivot = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                const float t = a[i];
                a[i++] = a[j], a[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

/* insert_candidates' result, faster: the k-th largest of the rows' block maxima bounds the k-th largest value
 * from below (k values reach it), so only values at or above it (~3% of random logits) are sorted, in index
 * order, stably. Rows with NaN, few blocks or many candidates take insert_candidates (~11 us a 2048-value row on
 * Zen 3, against ~3 us here). */
static int64_t block_candidates(const float *row, int64_t V, int64_t k, float *top, int64_t *ids) {
    const int64_t blocks = V / DRAW_BLOCK;
    if (blocks < k || blocks > DRAW_BLOCKS) return insert_candidates(row, V, k, top, ids);
    float maxima[DRAW_BLOCKS], value[DRAW_SPARE];
    int64_t index[DRAW_SPARE], count = 0;
    int nan = 0;
    for (int64_t b = 0; b < blocks; b++) {
        float m = row[b * DRAW_BLOCK];
        for (int64_t i = 0; i < DRAW_BLOCK; i++) {
            const float x = row[b * DRAW_BLOCK + i];
            nan |= x != x;
            m = x > m ? x : m;
        }
        maxima[b] = m;
    }
    for (int64_t v = blocks * DRAW_BLOCK; v < V; v++) nan |= row[v] != row[v];
    if (nan) return insert_candidates(row, V, k, top, ids);
    const float bound = kth_largest(maxima, blocks, k);
    for (int64_t v = 0; v < V; v++) {
        if (!(row[v] >= bound)) continue;
        if (count == DRAW_SPARE) return insert_candidates(row, V, k, top, ids);
        value[count] = row[v], index[count++] = v;
    }
    for (int64_t c = 1; c < count; c++) { /* stable: equal values keep their index order */
        const float x = value[c];
        const int64_t id = index[c];
        int64_t at = c;
        for (; at > 0 && x > value[at - 1]; at--) value[at] = value[at - 1], index[at] = index[at - 1];
        value[at] = x, index[at] = id;
    }
    memcpy(top, value, (size_t)k * sizeof(float));
    memcpy(ids, index, (size_t)k * sizeof(int64_t));
    return k;
}

void residual_draws(int64_t B, int64_t V, int64_t k, const float *logits, int64_t ldl, const float *noise,
                    int64_t ldn, const uint8_t *sampled, const int64_t *best, float top_p, int64_t *codes,
                    int threads) {
    _Pragma("omp parallel for num_threads(B < threads ? (int)B : threads) schedule(static)")
    for (int64_t b = 0; b < B; b++) {
        if (!sampled[b]) {
            codes[b] = best[b];
            continue;
        }
        const float *row = logits + b * ldl, *nb = noise + b * ldn;
        float top[MAX_DRAW], e[MAX_DRAW];
        int64_t ids[MAX_DRAW];
        const int64_t n = block_candidates(row, V, k, top, ids);
        float total = 0.0f;
        for (int64_t j = 0; j < n; j++) total += (e[j] = expf(top[j] - top[0]));
        const float reach = top_p * total;
        int64_t pick = 0;
        float win = e[0] / nb[0], before = e[0];
        for (int64_t j = 1; j < n && !(before >= reach); before += e[j], j++) {
            const float score = e[j] / nb[j];
            if (score > win) win = score, pick = j;
        }
        codes[b] = ids[pick];
    }
}

/* One row tile over a panel's 32 columns, the bias added from the accumulators: out[r] = bias + the dots, or with
 * `add` out[r] += bias + the dots (snake_pointwise's residual); bias and out at the panel's first column, out's rows
 * `ld` apart. */
static inline __attribute__((always_inline)) void bias_tile_f32(const int rows, int64_t K, const float *const *in,
                                                                const float *w, const float *bias, float *out,
                                                                int64_t ld, const int add) {
    vf acc[ROWS][PV];
    panel_dots_f32(rows, K, in, w, acc, (const float *)0);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < PV; i++) {
            const vf b = load_f32(bias + i * LANES);
            store_f32(out + r * ld + i * LANES, (add ? load_f32(out + r * ld + i * LANES) + b : b) + acc[r][i]);
        }
}

/* A vocoder residual unit's tail, in place: x += bias + W snake(h) per row, snake(h) = h + (sin(alpha h) scale)^2
 * per channel (SnakeBeta), W a kernel-1 convolution as panels [C/32, C, 32]. One pass reads h and x and
 * writes x, where separate calls make three more passes over these [samples, channels] signals. Threads split
 * the row tiles; a tile's activations stay in a [ROWS, C] float32 buffer per thread (buf [threads, ROWS * C]).
 * (Adding into x from the accumulators, not through a stored copy of the sums: 1.03-1.09x at 16 x T rows of 32-768
 * channels, 2 Zen 3 threads; the same bits.)
 *   h, x [T, C] float32; alpha, scale, bias [C] float32. */
void snake_pointwise_f32(int64_t T, int64_t C, const float *h, const float *alpha, const float *scale,
                         const float *w, const float *bias, float *x, float *buf, int threads) {
    const int64_t tiles = (T + ROWS - 1) / ROWS;
    _Pragma("omp parallel num_threads(threads)") {
        int tid = 0;
        IF_OPENMP(tid = omp_get_thread_num();)
        float *act = buf + (int64_t)tid * ROWS * C;
        const float *rows_in[ROWS];
        for (int r = 0; r < ROWS; r++) rows_in[r] = act + r * C;
        _Pragma("omp for schedule(static)") for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t t0 = tile * ROWS, m = T - t0 < ROWS ? T - t0 : ROWS;
            for (int64_t r = 0; r < m; r++) snake_f32(C, h + (t0 + r) * C, alpha, scale, act + r * C);
            for (int64_t p = 0; p < C / 32; p++)
                ROW_TILES(m, bias_tile_f32,
                          (C, rows_in + r0, w + p * C * 32, bias + p * 32, x + (t0 + r0) * C + p * 32, C, 1))
        }
    }
}

/* A vocoder's transposed convolution with kernel 2 * stride (CausalConvTranspose1d's channels-last GEMM) in one pass,
 * without AMX: out[b][j] = bias + [a_j, a_{j+1}] W for j < R, where item b's inputs a_0 .. a_R are its `left` row
 * then its TX rows of x (items flagged in `start`, or all where left is NULL: x's rows from the first, its last row
 * repeated past the end), each through SnakeBeta a = v + (sin(alpha v) scale)^2 (none where alpha is NULL). A job's
 * inputs are activated once into the thread's buffer, where consecutive rows are the pairs the panels read (K = 2C
 * in place), so neither the concatenation after `left` nor the pairs are made in memory, and the bias is added from
 * the accumulators. Threads split jobs of up to `rows` outputs of an item; a job runs panel by panel (the panel
 * stays in L2 across its row tiles).
 *   x [B, TX, C], left [B, 1, C] or NULL, start [B] bytes or NULL, alpha / scale [C] or NULL, float32;
 *   w [N/32, 2C, 32] float32 panels (the pairs GEMM's columns: stride samples x output channels), bias [N];
 *   out [B, R, N]; buf [threads, (rows + 1) C] float32; rows <= PAIRS_ROWS_MAX. */
#define PAIRS_ROWS_MAX 96
void conv_pairs_f32(int64_t B, int64_t TX, int64_t R, int64_t C, int64_t N, int64_t rows, const float *x,
                    const float *left, const uint8_t *start, const float *alpha, const float *scale, const float *w,
                    const float *bias, float *out, float *buf, int threads) {
    const int64_t tiles = (R + rows - 1) / rows;
    _Pragma("omp parallel num_threads(threads)") {
        int tid = 0;
        IF_OPENMP(tid = omp_get_thread_num();)
        float *act = buf + (int64_t)tid * (rows + 1) * C;
        const float *rows_in[PAIRS_ROWS_MAX];
        for (int64_t r = 0; r < rows; r++) rows_in[r] = act + r * C;
        _Pragma("omp for schedule(static)") for (int64_t job = 0; job < B * tiles; job++) {
            const int64_t b = job / tiles, j0 = job % tiles * rows, m = R - j0 < rows ? R - j0 : rows;
            const int after_left = left && !(start && start[b]);
            for (int64_t i = 0; i <= m; i++) { /* input j0 + i */
                const int64_t e = j0 + i - after_left;
                const float *v = e < 0 ? left + b * C : x + (b * TX + (e < TX ? e : TX - 1)) * C;
                if (alpha) snake_f32(C, v, alpha, scale, act + i * C);
                else memcpy(act + i * C, v, (size_t)C * sizeof(float));
            }
            for (int64_t p = 0; p < N / 32; p++)
                ROW_TILES(m, bias_tile_f32,
                          (2 * C, rows_in + r0, w + p * 2 * C * 32, bias + p * 32, out + (b * R + j0 + r0) * N + p * 32, N,
                           0))
        }
    }
}

/* A few-output convolution of SnakeBeta'd rows (the vocoder's last layer: C channels -> O outputs, K taps at
 * dilation `dil`), plus bias: out[b][t][o] = bias[o] + sum over k, c of w[o][k][c] * a[b][t + k dil][c], where
 * item b's input rows are its H rows of `left` as they are, then its TX rows of x through SnakeBeta (a = v +
 * (sin(alpha v) scale)^2, rounded to the rows' type as a stored activation would be). One pass reads x once,
 * where SnakeBeta, a GEMM to K O columns and K shifted sums made five over [B, T, C] signals (a 32-channel
 * float32 signal of 768k rows, 2 threads: ~8 ms, against ~19 ms for those passes). Threads split tiles of
 * SNAKE_TILE output rows, whose activations (with the (K - 1) dil rows before them) stay in the thread's buffer;
 * per output row the taps' products are summed
 * in C / LANES lanes, then across them.
 *   x [B, TX, C], left [B, H, C] (H = (K - 1) dil; may be NULL for H = 0) of the type, C a multiple of LANES;
 *   alpha, scale, bias [C], [C], [O] float32; w [O, K, C] float32; out [B, H + TX - (K - 1) dil, O] of the type;
 *   buf [threads, (SNAKE_TILE + SNAKE_ROWS + (K - 1) dil) C] float32 (a tile's last rows read past its own). */
#define SNAKE_TILE 256
#define SNAKE_ROWS 4 /* output rows summed at once: independent accumulator chains */
#define SNAKE_AHEAD 8192 /* bytes of input prefetched ahead (8 to 32 KB: 1.8x faster than none, 32-channel float32) */
#define DEFINE_SNAKE_CONV(SUFFIX, TS, T)                                                                      \
    void snake_conv_##SUFFIX(int64_t B, int64_t H, int64_t TX, int64_t C, int64_t K, int64_t dil, int64_t O,     \
                             const T *x, const T *left, const float *alpha, const float *scale, const float *w, \
                             const float *bias, T *out, float *buf, int threads) {                              \
        const int64_t halo = (K - 1) * dil, TO = H + TX - halo, tiles = (TO + SNAKE_TILE - 1) / SNAKE_TILE;      \
        _Pragma("omp parallel num_threads(threads)") {                                                         \
            int tid = 0;                                                                                       \
            IF_OPENMP(tid = omp_get_thread_num();)                                                             \
            float *act = buf + (int64_t)tid * (SNAKE_TILE + SNAKE_ROWS + halo) * C;                            \
            _Pragma("omp for schedule(static)") for (int64_t job = 0; job < B * tiles; job++) {                \
                const int64_t b = job / tiles, t0 = job % tiles * SNAKE_TILE;                                  \
                const int64_t m = TO - t0 < SNAKE_TILE ? TO - t0 : SNAKE_TILE;                                 \
                for (int64_t i = 0; i < m + halo; i++) { /* input row t0 + i */                               \
                    float *a = act + i * C;                                                                    \
                    const int64_t e = t0 + i;                                                                  \
                    if (e < H) {                                                                               \
                        const T *v = left + (b * H + e) * C;                                                   \
                        for (int64_t c = 0; c < C; c++) a[c] = get_##TS(v + c);                                \
                    } else {                                                                                   \
                        const T *v = x + (b * TX + e - H) * C;                                                 \
                        for (int64_t c = 0; c < C; c += 64 / sizeof(T)) /* (the loads wait on memory otherwise) */ \
                            __builtin_prefetch((const char *)(v + c) + SNAKE_AHEAD, 0, 3);                      \
                        snake_span_##SUFFIX(C, v, alpha, scale, a);                                            \
                    }                                                                                          \
                }                                                                                              \
                memset(act + (m + halo) * C, 0, (size_t)(SNAKE_ROWS - 1) * C * sizeof(float)); /* read, unused */ \
                for (int64_t r = 0; r < m; r += SNAKE_ROWS)                                                    \
                    for (int64_t o = 0; o < O; o++) {                                                          \
                        vf acc[SNAKE_ROWS];                                                                    \
                        const int64_t n = m - r < SNAKE_ROWS ? m - r : SNAKE_ROWS;                             \
                        for (int i = 0; i < SNAKE_ROWS; i++) acc[i] = splat(0.0f);                             \
                        for (int64_t k = 0; k < K; k++) {                                                      \
                            const float *a = act + (r + k * dil) * C, *wk = w + (o * K + k) * C;               \
                            for (int64_t c = 0; c < C; c += LANES) {                                           \
                                const vf wc = load_f32(wk + c);                                                \
                                for (int i = 0; i < SNAKE_ROWS; i++) acc[i] += load_f32(a + i * C + c) * wc;   \
                            }                                                                                  \
                        }                                                                                      \
                        for (int64_t i = 0; i < n; i++)                                                        \
                            put_##TS(out + ((b * TO + t0 + r + i) * O + o), hsum(acc[i]) + bias[o]);            \
                    }                                                                                          \
            }                                                                                                  \
        }                                                                                                      \
    }
DEFINE_SNAKE_CONV(f32, f32, float)
DEFINE_SNAKE_CONV(bf16, bf16, uint16_t)

#define SNAKE_SPAN 256 /* values a bfloat16 row activates at a time (a multiple of LANES) */
/* Row e of item b's [left; SnakeBeta(x)] (left's H rows as they are, then x's TX rows activated by snake_conv's
 * loop: the same vector sine and rounding) into dst: snake_rows' and snake_kept's rows. */
#define DEFINE_SNAKE_ROW(SUFFIX, TS, T)                                                                       \
    static inline void snake_row_##SUFFIX(int64_t b, int64_t e, int64_t H, int64_t TX, int64_t C, const T *left, \
                                          const T *x, const float *alpha, const float *scale, T *dst) {       \
        if (e < H) {                                                                                           \
            memcpy(dst, left + (b * H + e) * C, (size_t)C * sizeof(T));                                        \
            return;                                                                                            \
        }                                                                                                      \
        const T *v = x + (b * TX + e - H) * C;                                                                 \
        if (sizeof(T) == sizeof(float)) {                                                                      \
            snake_f32(C, (const float *)v, alpha, scale, (float *)dst);                                        \
            return;                                                                                            \
        }                                                                                                      \
        float part[SNAKE_SPAN];                                                                                \
        for (int64_t c0 = 0; c0 < C; c0 += SNAKE_SPAN) {                                                       \
            const int64_t n = C - c0 < SNAKE_SPAN ? C - c0 : SNAKE_SPAN;                                       \
            snake_span_##SUFFIX(n, v + c0, alpha + c0, scale + c0, part);                                      \
            for (int64_t c = 0; c < n; c++) put_##TS(dst + c0 + c, part[c]);                                   \
        }                                                                                                      \
    }

/* SnakeBeta over [B, TX, C] rows after their left context (H rows a item, may be NULL for H = 0): out [B, H + TX,
 * C], one pass over the rows (threads split them), where a separate concatenation made another over the
 * output. */
#define DEFINE_SNAKE_ROWS(SUFFIX, T)                                                                          \
    void snake_rows_##SUFFIX(int64_t B, int64_t H, int64_t TX, int64_t C, const T *context, const T *x,         \
                             const float *alpha, const float *scale, T *out, int threads) {                   \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                      \
        for (int64_t row = 0; row < B * (H + TX); row++)                                                       \
            snake_row_##SUFFIX(row / (H + TX), row % (H + TX), H, TX, C, context, x, alpha, scale, out + row * C); \
    }

/* A stream's next left context for snake_conv: kept [B, H, C] = rows valid[b] .. valid[b] + H - 1 of item b's
 * [left; SnakeBeta(x)], so the next chunk reads the values one-shot decoding's kernel computes. */
#define DEFINE_SNAKE_KEPT(SUFFIX, T)                                                                          \
    void snake_kept_##SUFFIX(int64_t B, int64_t H, int64_t TX, int64_t C, const T *left, const T *x,            \
                             const int64_t *valid, const float *alpha, const float *scale, T *kept) {          \
        for (int64_t b = 0; b < B; b++)                                                                        \
            for (int64_t r = 0; r < H; r++)                                                                    \
                snake_row_##SUFFIX(b, valid[b] + r, H, TX, C, left, x, alpha, scale, kept + (b * H + r) * C);  \
    }
DEFINE_SNAKE_ROW(f32, f32, float)
DEFINE_SNAKE_ROW(bf16, bf16, uint16_t)
DEFINE_SNAKE_ROWS(f32, float)
DEFINE_SNAKE_ROWS(bf16, uint16_t)
DEFINE_SNAKE_KEPT(f32, float)
DEFINE_SNAKE_KEPT(bf16, uint16_t)

/* weight * (x / rms(x)), the normalised row rounded to the model's type before the weight (Qwen3), into
 * float32 `out` (rounded as stored) or the model's type `stored`. */
#define DEFINE_ROW_NORM(TS, T)                                                                               \
    static inline void row_norm_##TS(int64_t n, const T *x, const float *weight, float eps, float *out,     \
                                     T *stored) {                                                          \
        float part[16] = {0}; /* 16 running sums (one 4-cycle chain of n additions took ~2000 cycles at 512) */ \
        int64_t c0 = 0;                                                                                     \
        for (; c0 + 16 <= n; c0 += 16)                                                                      \
            for (int i = 0; i < 16; i++) part[i] += get_##TS(x + c0 + i) * get_##TS(x + c0 + i);            \
        for (int i = 0; c0 + i < n; i++) part[i] += get_##TS(x + c0 + i) * get_##TS(x + c0 + i);           \
        for (int w = 8; w > 0; w /= 2)                                                                      \
            for (int i = 0; i < w; i++) part[i] += part[i + w];                                             \
        const float squares = part[0], inv = 1.0f / sqrtf(squares / (float)n + eps);                       \
        for (int64_t c = 0; c < n; c++) {                                                                   \
            const float v = weight[c] * round_##TS(get_##TS(x + c) * inv);                                 \
            if (out) out[c] = round_##TS(v);                                                                \
            else put_##TS(stored + c, v);                                                                   \
        }                                                                                                   \
    }
DEFINE_ROW_NORM(f32, float)
DEFINE_ROW_NORM(bf16, uint16_t)

/* Qwen3 decoder layers, all of them in one parallel region (Qwen3: RMSNorm, q/k/v, per-head q/k RMSNorm, rotary,
 * attention over cached keys, o, RMSNorm, then a SwiGLU MLP or routed SwiGLU experts with an optional
 * sigmoid-gated shared expert; residuals): rows split between the threads for the row-wise steps, panels for
 * the linear layers and the experts, (row, query head) pairs for attention. Each of these would otherwise be a
 * call of its own, with its own dispatch and fork and join of the threads, on a few rows. Values are rounded
 * to the model's type where its separate ops store a tensor (bfloat16: after each norm, linear layer, rotary,
 * attention, residual, the experts' sum, the shared expert's gate and product; SwiGLU once).
 *
 * Two callers: the code predictor's passes (`frame`: B requests of S rows at positions pos0 .. pos0+S-1, keys
 * and values in per-request caches [B, Q, NKV, D]) and decode steps of the paged decoders (`paged`: one row per
 * request, keys and values in the paged cache [2, slots, NKV, D] at its slot tables).
 *
 *   layers: L rows of L_WIDTH entries (below); norm weights float32, panels from pack_linear / pack_experts in
 *     the model's type, caches of the model's type. H % 32 == 0, D even and at most MAX_HEAD_DIM. A quantized
 *     model's projections, MLPs and experts are instead quantized weights (L_QUANT), which quant_kernels.c's
 *     phases compute inside this region (through B_QLINEAR / B_QMOE): a decode step of a quantized decoder is
 *     one call too, where layer by layer each layer costs ~1 ms of calls at the released widths.
 *   dims: R rows, H, NQ query heads, NKV key/value heads, D head size, NQKV (>= (NQ + 2 NKV) D, the q/k/v
 *     panels' width), rows_max (>= R and >= R * top-k: scratch rows per thread), max_kv (keys per row at most),
 *     mode (0 frame, 1 paged), then frame: B, S, pos0, Q; and for the head (frame only): V, VP.
 *   bufs (B_*): x [R, H] (updated in place), cos, sin (float32 [*, D], the values the model uses: frame rows by
 *     position, paged rows by row), the paged geometry (slot of each row's key and value, the row's request,
 *     each request's key count, its slots [requests, max_kv]), then scratch (below), and the output head.
 *   eps: the norms' epsilon; scale: the attention's. */
enum { /* a layer's row of the table */
    L_NORM1, L_QKV, L_QNORM, L_KNORM, L_O, L_NORM2, L_KC, L_VC, /* attention */
    L_GU, L_DOWN, L_INTER, /* dense SwiGLU MLP, or the shared expert (L_GU 0: none): gate rows first */
    L_ROUTER, L_EUP, L_EDOWN, L_EXPERTS, L_TOPK, L_EINTER, L_NORM_TOPK, L_SGATE, /* L_ROUTER 0: dense MLP */
    L_QUANT, /* bit i set: entry i (L_QKV, L_O, L_GU, L_DOWN; L_EUP for both experts) is a quantized weight's words */
    L_AMX, /* bit i set: entry i (L_QKV, L_O, L_GU, L_DOWN) is an AMX weight's words (amx_kernels.c); L_EUP's:
            * the experts' bfloat16 pair panels run on AMX tiles (float32 rows) */
    L_WIDTH
};
enum { /* bufs */
    B_X, B_COS, B_SIN, B_PUT, B_REQ, B_LENS, B_SLOTS, /* inputs */
    B_GEO, B_NORMED, B_QKV, B_ATTN, B_GU, B_ACT, B_LOGITS, B_SG, B_MOE, B_HEXP, B_Y, B_ROUTE_W, B_IDS, B_SORT,
    B_PTRS, B_ONES, B_SCORES, /* scratch: GEO int64 [4 R]; model's type: NORMED [R, H], QKV [R, NQKV], ATTN
                               [R, NQ D], GU [R, 2I'], ACT [R, I], LOGITS [R, E'], SG [R, 32], MOE [R, H],
                               HEXP [R k, I_e]; float32: Y [threads, rows_max, 32], ROUTE_W [R k]; IDS [R k],
                               SORT [2 R k + 2 E + 2] int64; PTRS [threads, 2 rows_max]; ONES [rows_max] float32
                               ones; SCORES [threads, max_kv] float32 (last: its size follows the context) */
    B_HEAD_NORM, B_HEAD, B_HEAD_LOGITS, B_PICKS, B_LAST, /* frame: each request's last row through the final
                               norm (float32 [H]), the head's panels, logits [B, VP] (model's type), argmax picks
                               [B] int64 (the first of equal maxima), scratch [B, H]; B_HEAD_NORM NULL: none;
                               paged: every row through the final norm (in place), then where B_HEAD is given
                               every row's logits [R, VP] on the head's panels (no picks) */
    B_QLINEAR, B_QMOE, B_QX, B_QY, B_QHP, B_QIDS, B_QWHERE, /* quantized weights (L_QUANT): quant_kernels.c's
                               phase_linear / phase_moe, and their scratch (float32 QX, QY, QHP; int64 QIDS
                               [E + 1], QWHERE [R k]); 0 where no layer has any */
    B_AMX, B_AMX_SCRATCH, B_AMX_STRIDE, /* AMX weights (L_AMX): amx_kernels.c's amx_phase_linear, its planes'
                               scratch (bfloat16) and each thread's share of it in elements; 0 where none */
    B_AMX_EXPERTS, /* amx_kernels.c's amx_phase_experts, for routed experts on AMX tiles (L_AMX's L_EUP bit) */
    B_WIDTH
};
/* quant_kernels.c's phases (orphaned `omp for`s, run by every thread of the layers' parallel region). */
typedef void (*quant_linear_fn)(const int64_t *w, int64_t M, const void *const *rows, int x_bf16, void *out,
                                int64_t ldo, int out_bf16, int add, float *xp, float *yf);
typedef void (*amx_linear_fn)(const int64_t *w, int64_t M, const void *const *rows, int x_bf16, void *out,
                              int64_t ldo, int out_bf16, int add, uint16_t *scratch, int part_rows);
typedef void (*amx_experts_fn)(const int64_t *dims, const float *x, const int64_t *order, const int64_t *starts,
                               const float *weights, const uint16_t *w13, const uint16_t *w2, float *out, float *h,
                               uint16_t *scratch, int tid, int threads);
typedef void (*quant_moe_fn)(const int64_t *w_up, const int64_t *w_down, int64_t T, int64_t K, int64_t E,
                             const int64_t *starts, const int64_t *order, const float *weights, const void *x,
                             int x_bf16, void *out, int out_bf16, float *xp, float *h, float *hp, int64_t *ids,
                             int64_t *where);
/* A layer's linear layer `slot` over rows_in: quantized (L_QUANT) or panels of N (padded) columns; out's rows
 * are N wide either way. */
/* AMX weights ([K/2][32][2] bfloat16, K a multiple of 32) on AMX tiles through amx_kernels.c's phase at every row
 * count, so a row's result never depends on its batch mates: bfloat16 rows as they are, float32 rows as three exact
 * parts summed part by part (part_rows: a third of the tile products at few rows). Code predictor frames at the
 * released widths (2 layers, 2 threads, Xeon Emerald Rapids, ms), bfloat16 dot-product panels -> AMX tiles: 1 row
 * 26-29 -> 27-28, 4 rows 92 -> 47, 16 rows 175 -> 77; float32 on the pair panels (f32p) -> AMX part rows, the
 * two alternating in one process (medians): 1 row 25.7 -> 24.5, 4 rows 27.8 -> 26.8, 16 rows 67.4 -> 43.9. */
#define LAYER_LINEAR(SUFFIX, T, WT, slot, K, N, out, add)                                                  \
    do {                                                                                                   \
        if (a[L_QUANT] >> (slot) & 1)                                                                      \
            ((quant_linear_fn)bufs[B_QLINEAR])((const int64_t *)a[slot], R, (const void *const *)rows_in, bf16, \
                                               out, N, bf16, add, (float *)bufs[B_QX], (float *)bufs[B_QY]); \
        else if (a[L_AMX] >> (slot) & 1)                                                                   \
            ((amx_linear_fn)bufs[B_AMX])((const int64_t *)a[slot], R, (const void *const *)rows_in, bf16, out, N, \
                                         bf16, add, (uint16_t *)bufs[B_AMX_SCRATCH] + tid * bufs[B_AMX_STRIDE], 1); \
        else                                                                                               \
            linear_panels_##SUFFIX(R, K, N, (const T *const *)rows_in, (const WT *)a[slot], 0, out, bf16, add, \
                                   ys, (float *const *)rows_out, ones);                                    \
    } while (0)
#define MAX_EXPERTS 512

static inline int64_t round32(int64_t n) { return (n + 31) / 32 * 32; }

/* The rows' geometry, GEO = put [R] (slot of the row's key and value), rope [R] (row of the cos/sin tables),
 * len [R] (keys it attends to), keys [R] (its first key's slot, or with slot tables its table's offset). */
static void row_geometry(const int64_t *dims, const int64_t *bufs) {
    const int64_t R = dims[0], max_kv = dims[7];
    int64_t *put = (int64_t *)bufs[B_GEO], *rope = put + R, *len = rope + R, *keys = len + R;
    for (int64_t r = 0; r < R; r++) {
        if (dims[8] == 0) { /* frame: request b's row at position pos0 + r % S, its cache b */
            const int64_t S = dims[10], Q = dims[12], b = r / S, pos = dims[11] + r % S;
            put[r] = b * Q + pos, rope[r] = pos, len[r] = pos + 1, keys[r] = b * Q;
        } else {
            const int64_t req = ((const int64_t *)bufs[B_REQ])[r];
            put[r] = ((const int64_t *)bufs[B_PUT])[r], rope[r] = r;
            len[r] = ((const int64_t *)bufs[B_LENS])[req], keys[r] = req * max_kv;
        }
    }
}

#define DEFINE_DECODER_LAYERS(SUFFIX, TS, WT, T)                                                              \
    /* Route each row: softmax (float32) over its router logits, the top k (the first of equal values first), \
     * optionally renormalised, rounded to the model's type as a tensor of it holds them. */                 \
    static inline void route_row_##SUFFIX(const T *logits, int64_t E, int64_t K, int norm_topk, int64_t *ids,  \
                                          float *weights) {                                                \
        float p[MAX_EXPERTS], top = -INFINITY, total = 0.0f, picked = 0.0f;                                 \
        char taken[MAX_EXPERTS] = {0};                                                                     \
        for (int64_t e = 0; e < E; e++) top = get_##TS(logits + e) > top ? get_##TS(logits + e) : top;     \
        for (int64_t e = 0; e < E; e++) total += (p[e] = expf(get_##TS(logits + e) - top));                \
        for (int64_t e = 0; e < E; e++) p[e] /= total;                                                     \
        for (int64_t k = 0; k < K; k++) { /* (NaN scores: some expert all the same, never out of range) */ \
            int64_t best = 0;                                                                              \
            while (taken[best]) best++;                                                                    \
            for (int64_t e = best + 1; e < E; e++)                                                         \
                if (!taken[e] && p[e] > p[best]) best = e;                                                 \
            ids[k] = best, weights[k] = p[best], picked += p[best];                                        \
            taken[best] = 1;                                                                               \
        }                                                                                                  \
        for (int64_t k = 0; k < K; k++) weights[k] = round_##TS(norm_topk ? weights[k] / picked : weights[k]); \
    }                                                                                                      \
    static void layer_##SUFFIX(const int64_t *a, const int64_t *dims, const int64_t *bufs, float eps,       \
                               float scale, int tid) {                                                     \
        const int64_t R = dims[0], H = dims[1], NQ = dims[2], NKV = dims[3], D = dims[4], NQKV = dims[5];  \
        const int64_t rows_max = dims[6], max_kv = dims[7], rep = NQ / NKV, half = D / 2, bf16 = sizeof(T) == 2; \
        const int64_t *put = (const int64_t *)bufs[B_GEO], *rope = put + R, *lens = rope + R, *keys = lens + R; \
        const int64_t *slot_tables = (const int64_t *)bufs[B_SLOTS];                                       \
        const float *cos_t = (const float *)bufs[B_COS], *sin_t = (const float *)bufs[B_SIN];              \
        const float *ones = (const float *)bufs[B_ONES];                                                   \
        T *x = (T *)bufs[B_X], *normed = (T *)bufs[B_NORMED], *qkv = (T *)bufs[B_QKV];                     \
        T *attn = (T *)bufs[B_ATTN], *gu = (T *)bufs[B_GU], *act = (T *)bufs[B_ACT];                       \
        void **rows_in = (void **)bufs[B_PTRS] + (int64_t)tid * 2 * rows_max, **rows_out = rows_in + rows_max; \
        float *ys = (float *)bufs[B_Y] + (int64_t)tid * rows_max * 32;                                     \
        float *s = (float *)bufs[B_SCORES] + (int64_t)tid * max_kv, row[MAX_HEAD_DIM];                     \
        const float *norm1 = (const float *)a[L_NORM1], *qnorm = (const float *)a[L_QNORM];                \
        const float *knorm = (const float *)a[L_KNORM], *norm2 = (const float *)a[L_NORM2];                \
        T *kc = (T *)a[L_KC], *vc = (T *)a[L_VC];                                                          \
        for (int64_t r = 0; r < R; r++) rows_out[r] = ys + r * 32;                                         \
        /* input norm, q/k/v */                                                                            \
        _Pragma("omp for schedule(static)") for (int64_t r = 0; r < R; r++)                                 \
            row_norm_##TS(H, x + r * H, norm1, eps, 0, normed + r * H);                                    \
        for (int64_t r = 0; r < R; r++) rows_in[r] = normed + r * H;                                       \
        LAYER_LINEAR(SUFFIX, T, WT, L_QKV, H, NQKV, qkv, 0);                                               \
        /* q/k norms, rotary; k and v into the caches */                                                   \
        _Pragma("omp for schedule(static)") for (int64_t task = 0; task < R * (NQ + NKV); task++) {         \
            const int64_t r = task / (NQ + NKV), head = task % (NQ + NKV);                                 \
            T *src = qkv + r * NQKV + head * D;                                                            \
            row_norm_##TS(D, src, head < NQ ? qnorm : knorm, eps, row, 0);                                 \
            T *dst = head < NQ ? src : kc + (put[r] * NKV + (head - NQ)) * D;                              \
            const float *cs = cos_t + rope[r] * D, *sn = sin_t + rope[r] * D;                              \
            for (int64_t d = 0; d < half; d++) /* (two loops: each vectorises) */                          \
                put_##TS(dst + d, round_##TS(row[d] * cs[d]) + round_##TS(-row[d + half] * sn[d]));         \
            for (int64_t d = half; d < D; d++)                                                             \
                put_##TS(dst + d, round_##TS(row[d] * cs[d]) + round_##TS(row[d - half] * sn[d]));          \
            if (head >= NQ) { /* its value head too */                                                     \
                const T *v = qkv + r * NQKV + (NQ + NKV) * D + (head - NQ) * D;                            \
                memcpy(vc + (put[r] * NKV + (head - NQ)) * D, v, (size_t)D * sizeof(T));                   \
            }                                                                                              \
        }                                                                                                  \
        /* attention: row r over its lens[r] keys (consecutive slots from keys[r], or its slot table's) */  \
        _Pragma("omp for schedule(static)") for (int64_t task = 0; task < R * NQ; task++) {                 \
            const int64_t r = task / NQ, h = task % NQ, g = h / rep, len = lens[r];                        \
            const int64_t *slots = slot_tables ? slot_tables + keys[r] : 0, first = slots ? 0 : keys[r];   \
            const T *q = qkv + r * NQKV + h * D, *k0 = kc + (first * NKV + g) * D, *v0 = vc + (first * NKV + g) * D; \
            T *o = attn + r * NQ * D + h * D;                                                              \
            if (len <= 0) { /* no key (a padded row): zeros */                                             \
                for (int64_t d = 0; d < D; d++) put_##TS(o + d, 0.0f);                                     \
                continue;                                                                                  \
            }                                                                                              \
            if (D % 16 == 0) { /* 16 lanes at a time (head sizes 64, 128) */                               \
                attend_head_##TS(D, len, q, scale, k0, v0, NKV * D, slots, s, o);                          \
                continue;                                                                                  \
            }                                                                                              \
            float top = -INFINITY, total = 0.0f;                                                           \
            for (int64_t j = 0; j < len; j++) {                                                            \
                const T *k = k0 + (slots ? slots[j] : j) * NKV * D;                                        \
                float dot = 0.0f;                                                                          \
                for (int64_t d = 0; d < D; d++) dot += get_##TS(q + d) * get_##TS(k + d);                  \
                s[j] = dot * scale;                                                                        \
                top = s[j] > top ? s[j] : top;                                                             \
            }                                                                                              \
            for (int64_t j = 0; j < len; j++) total += (s[j] = expf(s[j] - top));                          \
            for (int64_t d = 0; d < D; d++) row[d] = 0.0f;                                                 \
            for (int64_t j = 0; j < len; j++) {                                                            \
                const T *v = v0 + (slots ? slots[j] : j) * NKV * D;                                        \
                const float p = s[j] / total;                                                              \
                for (int64_t d = 0; d < D; d++) row[d] += p * get_##TS(v + d);                             \
            }                                                                                              \
            for (int64_t d = 0; d < D; d++) put_##TS(o + d, row[d]);                                       \
        }                                                                                                  \
        for (int64_t r = 0; r < R; r++) rows_in[r] = attn + r * NQ * D;                                    \
        LAYER_LINEAR(SUFFIX, T, WT, L_O, NQ * D, H, x, 1);                                                 \
        /* post-attention norm; the dense MLP or the shared expert's gate/up (and its gate), the router */  \
        _Pragma("omp for schedule(static)") for (int64_t r = 0; r < R; r++)                                 \
            row_norm_##TS(H, x + r * H, norm2, eps, 0, normed + r * H);                                    \
        for (int64_t r = 0; r < R; r++) rows_in[r] = normed + r * H;                                       \
        const int64_t I = a[L_INTER], NGU = round32(2 * I), E = a[L_EXPERTS], K = a[L_TOPK];                \
        T *logits = (T *)bufs[B_LOGITS], *sg = (T *)bufs[B_SG], *moe = (T *)bufs[B_MOE];                   \
        if (a[L_GU]) LAYER_LINEAR(SUFFIX, T, WT, L_GU, H, NGU, gu, 0);                                     \
        if (a[L_ROUTER])                                                                                   \
            linear_panels_##SUFFIX(R, H, round32(E), (const T *const *)rows_in, (const WT *)a[L_ROUTER], 0,   \
                                   logits, bf16, 0, ys, (float *const *)rows_out, ones);                   \
        if (a[L_SGATE])                                                                                    \
            linear_panels_##SUFFIX(R, H, 32, (const T *const *)rows_in, (const WT *)a[L_SGATE], 0, sg, bf16, 0, \
                                   ys, (float *const *)rows_out, ones);                                    \
        /* SwiGLU (dense MLP or shared expert); routing */                                                 \
        int64_t *ids = (int64_t *)bufs[B_IDS];                                                             \
        float *route_w = (float *)bufs[B_ROUTE_W];                                                         \
        _Pragma("omp for schedule(static)") for (int64_t r = 0; r < R; r++) {                               \
            if (a[L_GU]) {                                                                                 \
                const T *gate = gu + r * NGU, *up = gate + I;                                              \
                T *out = act + r * I;                                                                      \
                _Pragma("omp simd") for (int64_t i = 0; i < I; i++)                                        \
                    put_##TS(out + i, swiglu_lane(get_##TS(gate + i), get_##TS(up + i)));                  \
            }                                                                                              \
            if (a[L_ROUTER])                                                                               \
                route_row_##SUFFIX(logits + r * round32(E), E, K, (int)a[L_NORM_TOPK], ids + r * K,        \
                                   route_w + r * K);                                                       \
        }                                                                                                  \
        if (!a[L_ROUTER]) { /* dense: down + residual */                                                   \
            for (int64_t r = 0; r < R; r++) rows_in[r] = act + r * I;                                      \
            LAYER_LINEAR(SUFFIX, T, WT, L_DOWN, I, H, x, 1);                                               \
            return;                                                                                        \
        }                                                                                                  \
        int64_t *order = (int64_t *)bufs[B_SORT], *starts = order + R * K;                                  \
        _Pragma("omp single") sort_selections(R * K, E, ids, order, starts);                               \
        if (a[L_QUANT] >> L_EUP & 1)                                                                       \
            ((quant_moe_fn)bufs[B_QMOE])((const int64_t *)a[L_EUP], (const int64_t *)a[L_EDOWN], R, K, E, starts, \
                                         order, route_w, normed, bf16, moe, bf16, (float *)bufs[B_QX],     \
                                         (float *)bufs[B_QY], (float *)bufs[B_QHP], (int64_t *)bufs[B_QIDS], \
                                         (int64_t *)bufs[B_QWHERE]);                                       \
        else if (a[L_AMX] >> L_EUP & 1) { /* float32 rows, bfloat16 pair panels as AMX tiles */            \
            const int64_t edims[6] = {R, K, E, H, H, a[L_EINTER]};                                          \
            int threads = 1;                                                                               \
            IF_OPENMP(threads = omp_get_num_threads();)                                                     \
            ((amx_experts_fn)bufs[B_AMX_EXPERTS])(edims, (const float *)normed, order, starts, route_w,   \
                                                  (const uint16_t *)a[L_EUP], (const uint16_t *)a[L_EDOWN], \
                                                  (float *)moe, (float *)bufs[B_HEXP],                     \
                                                  (uint16_t *)bufs[B_AMX_SCRATCH] + tid * bufs[B_AMX_STRIDE], \
                                                  tid, threads);                                           \
        } else                                                                                             \
            moe_phases_##SUFFIX(R, K, E, H, H, a[L_EINTER], normed, order, starts, route_w, (const WT *)a[L_EUP], \
                                (const WT *)a[L_EDOWN], moe, bf16, (T *)bufs[B_HEXP], ys, rows_in, rows_out); \
        if (a[L_GU]) { /* the shared expert's down projection, into gu's rows */                           \
            for (int64_t r = 0; r < R; r++) {                                                              \
                rows_in[r] = act + r * I;                                                                  \
                rows_out[r] = ys + r * 32;                                                                 \
            }                                                                                              \
            LAYER_LINEAR(SUFFIX, T, WT, L_DOWN, I, H, gu, 0);                                              \
        }                                                                                                  \
        /* x += experts + sigmoid(shared gate) * shared expert */                                          \
        _Pragma("omp for schedule(static)") for (int64_t r = 0; r < R; r++) {                               \
            const float gate = a[L_SGATE] ? round_##TS(1.0f / (1.0f + expf(-get_##TS(sg + r * 32)))) : 1.0f; \
            for (int64_t c = 0; c < H; c++) {                                                              \
                float v = get_##TS(moe + r * H + c);                                                       \
                if (a[L_GU]) v = round_##TS(v + round_##TS(gate * get_##TS(gu + r * H + c)));               \
                put_##TS(x + r * H + c, get_##TS(x + r * H + c) + v);                                      \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    void decoder_layers_##SUFFIX(const int64_t *dims, const int64_t *layers, int64_t L, const int64_t *bufs, \
                                 float eps, float scale, int threads) {                                    \
        row_geometry(dims, bufs);                                                                          \
        _Pragma("omp parallel num_threads(threads)") {                                                     \
            int tid = 0;                                                                                   \
            IF_OPENMP(tid = omp_get_thread_num();)                                                          \
            for (int64_t l = 0; l < L; l++) layer_##SUFFIX(layers + l * L_WIDTH, dims, bufs, eps, scale, tid); \
            if (bufs[B_HEAD_NORM]) { /* the final norm (paged: every row, in place; frame: each request's last \
                                      * row, into LAST), then the head (frame: always, and the argmax; paged:  \
                                      * where given, on the panels: a separate head call's bits) */            \
                const int paged = dims[8] == 1;                                                                \
                const int64_t H = dims[1], N = paged ? dims[0] : dims[9], S = dims[10], V = dims[13], VP = dims[14]; \
                T *x = (T *)bufs[B_X], *normed = paged ? x : (T *)bufs[B_LAST], *logits = (T *)bufs[B_HEAD_LOGITS]; \
                void **rows_in = (void **)bufs[B_PTRS] + (int64_t)tid * 2 * dims[6], **rows_out = rows_in + dims[6]; \
                float *ys = (float *)bufs[B_Y] + (int64_t)tid * dims[6] * 32;                                  \
                _Pragma("omp for schedule(static)") for (int64_t n = 0; n < N; n++)                            \
                    row_norm_##TS(H, x + (paged ? n : n * S + S - 1) * H, (const float *)bufs[B_HEAD_NORM], eps, 0, \
                                  normed + n * H);                                                             \
                for (int64_t n = 0; bufs[B_HEAD] && n < N; n++) {                                              \
                    rows_in[n] = normed + n * H;                                                               \
                    rows_out[n] = ys + n * 32;                                                                 \
                }                                                                                              \
                if (!paged && sizeof(WT) == 2 && bufs[B_AMX] && H % 32 == 0) { /* pair panels are AMX's B tiles */ \
                    const int64_t words[4] = {bufs[B_HEAD], VP, H, H};                                         \
                    ((amx_linear_fn)bufs[B_AMX])(words, N, (const void *const *)rows_in, sizeof(T) == 2, logits, VP, \
                                                 sizeof(T) == 2, 0,                                            \
                                                 (uint16_t *)bufs[B_AMX_SCRATCH] + tid * bufs[B_AMX_STRIDE], 1); \
                } else if (bufs[B_HEAD]) {                                                                     \
                    linear_panels_##SUFFIX(N, H, VP, (const T *const *)rows_in, (const WT *)bufs[B_HEAD], 0, logits, \
                                           sizeof(T) == 2, 0, ys, (float *const *)rows_out,                    \
                                           (const float *)bufs[B_ONES]);                                       \
                }                                                                                              \
                if (!paged) {                                                                                  \
                    int64_t *picks = (int64_t *)bufs[B_PICKS];                                                 \
                    _Pragma("omp for schedule(static)") for (int64_t b = 0; b < N; b++) {                      \
                        int64_t best = 0;                                                                      \
                        for (int64_t v = 1; v < V; v++)                                                        \
                            if (get_##TS(logits + b * VP + v) > get_##TS(logits + b * VP + best)) best = v;    \
                        picks[b] = best;                                                                       \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                  \
    }

DEFINE_DECODER_LAYERS(f32, f32, float, float)
/* a float32 model whose panels are bfloat16 (its weights bfloat16 values): half the bytes, the same bits */
DEFINE_DECODER_LAYERS(f32p, f32, uint16_t, float)
/* (AMX CPUs have AVX512-BF16: bfloat16 decoders with AMX weights take the dot-product variant, never this one) */
DEFINE_DECODER_LAYERS(bf16x, bf16, uint16_t, uint16_t)
#if defined(__AVX512BF16__)
DEFINE_DECODER_LAYERS(bf16dp, bf16, uint16_t, uint16_t)
#endif

/* Wide causal convolutions as products of small DFTs (dft_conv.py): the transforms around torch's batched GEMM.
 *
 * A convolution of K taps (dilation d) over an item's rows of C channels (its H = (K - 1) d rows of left context
 * as they are, then TX rows, through SnakeBeta where alpha is given, as snake_conv reads them: T = TX outputs) is
 * cut into blocks of N inputs: block (base, r) reads the rows t0, t0 + d, ..., t0 + (N - 1) d (t0 = base S d + r,
 * S = N - K + 1; rows past the item's last are zeros) and gives the outputs t0, t0 + d, ..., t0 + (S - 1) d that
 * are below T (a dilated convolution is d plain ones on interleaved rows). Blocks never span
 * two items: an item's values (a NaN, a huge one) reach no other item's outputs. Per block the
 * convolution is a product per frequency: N / 2 + 1 of them, the first and the last real, the others complex
 * and each made of three real products (Gauss: (a + b i)(c + e i) = k1 - k3 + (k1 + k2) i with k1 = c (a + b),
 * k2 = a (e - c), k3 = b (c + e)). So a block's inputs become P = 2 + 3 (N / 2 - 1) planes of C values, each
 * plane a GEMM over all blocks against a [C_in, C_out] weight plane, and the planes' products go back to S
 * outputs: 1.8 multiply-adds an output per weight at N = 32 where the direct convolution makes K = 7.
 *
 * Planes: 0 the sum (frequency 0), 1 the alternating sum (N / 2), then for f = 1 .. N / 2 - 1: re + im, re,
 * im of the input's transform and Wr, Wi - Wr, Wr + Wi of the weight's. Rows in float32 or bfloat16 (raw
 * 16-bit words; the transforms in float32, the planes in the rows' type). */
/* Channels a block's transform keeps in flight, at most (chunks split C evenly; its rows stay in L1). */
#define MAX_CHUNK 64
#define MAX_N 64 /* N: a power of two up to this */
#define VECS (MAX_CHUNK / LANES)
#define PLANES(N) (2 + 3 * ((N) / 2 - 1)) /* planes of a block of N inputs */
#define PLANE(f) (2 + 3 * ((f) - 1))      /* the first of complex frequency f's three planes */

/* Block m's item and first row in it: an item has bases * d blocks (bases = ceil(T / (S d))). */
static inline int64_t block_start(int64_t m, int64_t TO, int64_t S, int64_t d, int64_t *item) {
    const int64_t per_item = (TO + S * d - 1) / (S * d) * d, k = m % per_item;
    *item = m / per_item;
    return (k / d) * S * d + k % d;
}

/* Channels a chunk takes: C split evenly into chunks of at most MAX_CHUNK, rounded up to whole vectors (96
 * channels: two chunks of 48, not 64 + a half-empty one). */
static inline int64_t chunk_width(int64_t C) {
    const int64_t chunks = (C + MAX_CHUNK - 1) / MAX_CHUNK, even = (C + chunks - 1) / chunks;
    return (even + LANES - 1) / LANES * LANES;
}

/* A block's N input rows (xs, CHUNK channels each) -> its P planes' rows (the planes' layout above): the real
 * transform's sums, x[n] and x[N - n] paired (cos is even, sin odd). */
static void forward_block(int64_t N, int vecs, const vf (*restrict xs)[VECS], const float *restrict tw,
                          vf (*restrict planes)[VECS]) {
    const int64_t H = N / 2;
    const float *cs = tw, *sn = tw + N;
    for (int v = 0; v < vecs; v++) {
        vf ev[MAX_N / 2], od[MAX_N / 2];
        const vf x0 = xs[0][v], xh = xs[H][v];
        vf dc = x0 + xh, ny = (H & 1) ? x0 - xh : x0 + xh;
        for (int64_t n = 1; n < H; n++) {
            ev[n] = xs[n][v] + xs[N - n][v];
            od[n] = xs[n][v] - xs[N - n][v];
            dc += ev[n];
            ny = (n & 1) ? ny - ev[n] : ny + ev[n];
        }
        planes[0][v] = dc;
        planes[1][v] = ny;
        for (int64_t f = 1; f < H; f++) {
            vf re = (f & 1) ? x0 - xh : x0 + xh, im = splat(0.0f);
            for (int64_t n = 1; n < H; n++) {
                re += splat(cs[(f * n) & (N - 1)]) * ev[n];
                im -= splat(sn[(f * n) & (N - 1)]) * od[n];
            }
            const int64_t p = PLANE(f);
            planes[p][v] = re + im;
            planes[p + 1][v] = re;
            planes[p + 2][v] = im;
        }
    }
}

/* A block's P planes' rows (products) -> its outputs y[j] for j = K - 1 .. N - 1 (y[j] = (Y0 + (-1)^j Y_H +
 * sum_f 2 (Yr cos - Yi sin)) / N, j and N - j sharing the sums; Gauss: Yr = k1 - k3, Yi = k1 + k2). */
static void inverse_block(int64_t N, int64_t K, int vecs, const vf (*restrict planes)[VECS],
                          const float *restrict tw, vf (*restrict y)[VECS]) {
    const int64_t H = N / 2;
    const float *cs = tw, *sn = tw + N;
    const vf scale = splat(1.0f / (float)N), two = splat(2.0f);
    for (int v = 0; v < vecs; v++) {
        vf yr[MAX_N / 2], yi[MAX_N / 2];
        for (int64_t f = 1; f < H; f++) {
            const int64_t p = PLANE(f);
            yr[f] = two * (planes[p][v] - planes[p + 2][v]);
            yi[f] = two * (planes[p][v] + planes[p + 1][v]);
        }
        for (int64_t j = 1; j <= H; j++) {
            if (j < K - 1 && N - j < K - 1) continue;
            vf ev = (j & 1) ? planes[0][v] - planes[1][v] : planes[0][v] + planes[1][v], od = splat(0.0f);
            for (int64_t f = 1; f < H; f++) {
                ev += splat(cs[(f * j) & (N - 1)]) * yr[f];
                od += splat(sn[(f * j) & (N - 1)]) * yi[f];
            }
            y[j][v] = (ev - od) * scale;
            y[N - j][v] = (ev + od) * scale; /* (j = H: od is 0) */
        }
    }
}

/* Input blocks m0 .. m0 + M - 1 -> planes [P][M][C]. tw: cos(2 pi q / N) for q < N, then sin. */
#define DEFINE_FORWARD(SUFFIX, T)                                                                                    \
    void dft_forward_##SUFFIX(int64_t H, int64_t TX, int64_t TO, int64_t C, int64_t m0, int64_t M, int64_t N,        \
                              int64_t S, int64_t d, const T *left, const T *x, const float *alpha,                   \
                              const float *scale, const float *tw, T *planes, int threads) {                         \
        const int64_t P = PLANES(N);                                                                                 \
        const int64_t CHUNK = chunk_width(C);                                                                        \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                            \
        for (int64_t mi = 0; mi < M; mi++) {                                                                         \
            int64_t item;                                                                                            \
            const int64_t t0 = block_start(m0 + mi, TO, S, d, &item);                                                \
            vf xs[MAX_N][VECS], out[PLANES(MAX_N)][VECS];                                                            \
            for (int64_t c0 = 0; c0 < C; c0 += CHUNK) {                                                              \
                const int64_t w = C - c0 < CHUNK ? C - c0 : CHUNK;                                                   \
                for (int64_t n = 0; n < N; n++) {                                                                    \
                    const int64_t t = t0 + n * d;                                                                    \
                    int64_t c = 0;                                                                                   \
                    float *row = (float *)xs[n];                                                                     \
                    if (t < H && left)                                                                               \
                        for (; c < w; c++) row[c] = get_##SUFFIX(left + (item * H + t) * C + c0 + c);                \
                    else if (t >= H && t < H + TX) {                                                                 \
                        const T *v = x + (item * TX + t - H) * C + c0;                                               \
                        if (alpha) {                                                                                 \
                            snake_span_##SUFFIX(w, v, alpha + c0, scale + c0, row);                                  \
                            c = w;                                                                                   \
                        } else                                                                                       \
                            for (; c < w; c++) row[c] = get_##SUFFIX(v + c);                                         \
                    }                                                                                                \
                    for (; c < CHUNK; c++) row[c] = 0.0f;                                                            \
                }                                                                                                    \
                forward_block(N, CHUNK / LANES, xs, tw, out);                                                        \
                for (int64_t p = 0; p < P; p++) {                                                                    \
                    T *dst = planes + (p * M + mi) * C + c0;                                                         \
                    const float *row = (const float *)out[p];                                                        \
                    for (int64_t c = 0; c < w; c++) put_##SUFFIX(dst + c, row[c]);                                   \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
    }

/* Planes [P][M][C] of blocks m0 .. -> out [B, T, C] (+ bias, + residual [B, T, C] where given): each item's
 * outputs below T. */
#define DEFINE_INVERSE(SUFFIX, T)                                                                                    \
    void dft_inverse_##SUFFIX(int64_t TO, int64_t C, int64_t m0, int64_t M,                                          \
                              int64_t N, int64_t K, int64_t d, const T *planes, const float *tw,                     \
                              const float *bias, const T *residual, T *out, int threads) {                           \
        const int64_t S = N - K + 1, P = PLANES(N), CHUNK = chunk_width(C);                                          \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                            \
        for (int64_t mi = 0; mi < M; mi++) {                                                                         \
            int64_t item;                                                                                            \
            const int64_t t0 = block_start(m0 + mi, TO, S, d, &item);                                                \
            int64_t dest[MAX_N]; /* output row of block position j, -1: not kept */                                  \
            int any = 0;                                                                                             \
            for (int64_t j = 0; j < N; j++) {                                                                        \
                dest[j] = -1;                                                                                        \
                const int64_t t = t0 + (j - (K - 1)) * d;                                                            \
                if (j < K - 1 || t >= TO) continue;                                                                  \
                dest[j] = item * TO + t;                                                                             \
                any = 1;                                                                                             \
            }                                                                                                        \
            if (!any) continue;                                                                                      \
            vf in[PLANES(MAX_N)][VECS], y[MAX_N][VECS];                                                              \
            for (int64_t c0 = 0; c0 < C; c0 += CHUNK) {                                                              \
                const int64_t w = C - c0 < CHUNK ? C - c0 : CHUNK;                                                   \
                for (int64_t p = 0; p < P; p++) {                                                                    \
                    const T *src = planes + (p * M + mi) * C + c0;                                                   \
                    int64_t c = 0;                                                                                   \
                    float *row = (float *)in[p];                                                                     \
                    for (; c < w; c++) row[c] = get_##SUFFIX(src + c);                                               \
                    for (; c < CHUNK; c++) row[c] = 0.0f;                                                            \
                }                                                                                                    \
                inverse_block(N, K, CHUNK / LANES, in, tw, y);                                                       \
                for (int64_t j = K - 1; j < N; j++) {                                                                \
                    if (dest[j] < 0) continue;                                                                       \
                    T *o = out + dest[j] * C + c0;                                                                   \
                    const T *r = residual ? residual + dest[j] * C + c0 : 0;                                         \
                    for (int64_t c = 0; c < w; c++) {                                                                \
                        float v = ((const float *)y[j])[c];                                                          \
                        if (bias) v += bias[c0 + c];                                                                 \
                        if (r) v += get_##SUFFIX(r + c);                                                             \
                        put_##SUFFIX(o + c, v);                                                                      \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
    }

#define TILE_I 8   /* input channels a tile of the weight's planes holds */
#define TILE 64    /* output channels: each plane row written 256 bytes at a time */
/* A convolution weight [CO][CI][K] -> its planes [P][CI][CO] for blocks of N (the taps reversed: a block's
 * output j is the circular convolution's), TILE_I x TILE (input, output) channels at a time: each output
 * channel's taps read in one run, each plane's rows written TILE outputs at a time. */
#define DEFINE_WEIGHT(SUFFIX, T)                                                                                     \
    void dft_weight_##SUFFIX(int64_t CO, int64_t CI, int64_t K, int64_t N, const T *weight, const float *tw,         \
                             T *planes, int threads) {                                                               \
        const int64_t H = N / 2, plane = CI * CO, tiles_o = (CO + TILE - 1) / TILE;                                  \
        const int64_t P = PLANES(N), tiles = tiles_o * ((CI + TILE_I - 1) / TILE_I);                                 \
        float cf[MAX_N / 2 + 1][MAX_N], sf[MAX_N / 2 + 1][MAX_N]; /* cos, sin(2 pi f q / N) */                       \
        for (int64_t f = 0; f <= H; f++)                                                                             \
            for (int64_t q = 0; q < K; q++) {                                                                        \
                cf[f][q] = tw[(f * q) & (N - 1)];                                                                    \
                sf[f][q] = tw[N + ((f * q) & (N - 1))];                                                              \
            }                                                                                                        \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                            \
        for (int64_t tile = 0; tile < tiles; tile++) {                                                               \
            const int64_t ci0 = tile / tiles_o * TILE_I, co0 = tile % tiles_o * TILE;                                \
            const int64_t ni = CI - ci0 < TILE_I ? CI - ci0 : TILE_I, no = CO - co0 < TILE ? CO - co0 : TILE;        \
            float buf[PLANES(MAX_N)][TILE_I][TILE];                                                                  \
            for (int64_t i = 0; i < ni; i++) {                                                                       \
                float h[MAX_N][TILE] = {{0}}; /* reversed taps, TILE output channels side by side */                 \
                for (int64_t o = 0; o < no; o++) {                                                                   \
                    const T *taps = weight + ((co0 + o) * CI + ci0 + i) * K;                                         \
                    for (int64_t q = 0; q < K; q++) h[q][o] = get_##SUFFIX(taps + K - 1 - q);                        \
                }                                                                                                    \
                for (int64_t f = 0; f <= H; f++) {                                                                   \
                    float re[TILE] = {0}, im[TILE] = {0};                                                            \
                    for (int64_t q = 0; q < K; q++)                                                                  \
                        for (int o = 0; o < TILE; o++) {                                                             \
                            re[o] += cf[f][q] * h[q][o];                                                             \
                            im[o] -= sf[f][q] * h[q][o];                                                             \
                        }                                                                                            \
                    if (f == 0 || f == H) {                                                                          \
                        for (int o = 0; o < TILE; o++) buf[f == 0 ? 0 : 1][i][o] = re[o];                            \
                        continue;                                                                                    \
                    }                                                                                                \
                    const int64_t p = PLANE(f);                                                                      \
                    for (int o = 0; o < TILE; o++) {                                                                 \
                        buf[p][i][o] = re[o];                                                                        \
                        buf[p + 1][i][o] = im[o] - re[o];                                                            \
                        buf[p + 2][i][o] = re[o] + im[o];                                                            \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
            for (int64_t p = 0; p < P; p++)                                                                          \
                for (int64_t i = 0; i < ni; i++) {                                                                   \
                    T *dst = planes + p * plane + (ci0 + i) * CO + co0;                                              \
                    for (int64_t o = 0; o < no; o++) put_##SUFFIX(dst + o, buf[p][i][o]);                            \
                }                                                                                                    \
        }                                                                                                            \
    }

DEFINE_FORWARD(f32, float)
DEFINE_FORWARD(bf16, uint16_t)
DEFINE_INVERSE(f32, float)
DEFINE_INVERSE(bf16, uint16_t)
DEFINE_WEIGHT(f32, float)
DEFINE_WEIGHT(bf16, uint16_t)
