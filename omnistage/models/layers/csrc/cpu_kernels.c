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

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef uint16_t h16u __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u16v __attribute__((vector_size(64)));

#if defined(__AVX512F__)
#define ROWS 8 /* 32 vector registers: 2 x 8 accumulators, 2 weight vectors, a broadcast */
#else
#define ROWS 3 /* 16 (AVX2) registers; each 16-float vector is two of them */
#endif

static inline v16 load_f32(const float *p) { return *(const v16u *)p; }

static inline v16 load_bf16(const uint16_t *p) {
    u16v wide = __builtin_convertvector(*(const h16u *)p, u16v) << 16;
    return (v16)wide;
}

static inline void store_f32(float *p, v16 v) { *(v16u *)p = v; }

static inline void store_bf16(uint16_t *p, v16 v) {
    u16v bits = (u16v)v;
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16; /* round to nearest even (finite values) */
    *(h16u *)p = __builtin_convertvector(bits, h16u);
}

/* A broadcast (not `(v16){0} + x`: adding zero is not an identity for -0.0, so that costs an add per use). */
static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

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

/* 32 output columns (a, b) at element `offset` of a float32 or bfloat16 output. */
static inline void store_columns(void *out, int out_bf16, int64_t offset, v16 a, v16 b) {
    if (out_bf16) {
        store_bf16((uint16_t *)out + offset, a);
        store_bf16((uint16_t *)out + offset + 16, b);
    } else {
        store_f32((float *)out + offset, a);
        store_f32((float *)out + offset + 16, b);
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

static inline float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* One kernel per weight type: WT the stored element, LOAD widens 16 of them to float32. */
#define DEFINE_KERNELS(SUFFIX, WT, LOAD)                                                                     \
    /* a[r], b[r]: `rows` (<= ROWS) rows' dot products with a panel's columns 0-15 and 16-31, w [K][32]. */  \
    static inline __attribute__((always_inline)) void panel_dots_##SUFFIX(                                   \
        const int rows, int64_t K, const float *const *x, const WT *w, v16 *a, v16 *b, const WT *pf) {       \
        for (int r = 0; r < rows; r++) a[r] = b[r] = splat(0.0f);                                           \
        for (int64_t k = 0; k < K; k++) {                                                                   \
            if (pf) PREFETCH_K(pf, k, 32 * sizeof(WT));                                                     \
            const v16 wa = LOAD(w + k * 32), wb = LOAD(w + k * 32 + 16);                                    \
            for (int r = 0; r < rows; r++) {                                                                \
                const v16 xb = splat(x[r][k]);                                                              \
                a[r] += xb * wa;                                                                            \
                b[r] += xb * wb;                                                                            \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    /* gate/up over one panel (16 gate, 16 up columns), then SwiGLU: h[r] gets 16 intermediates. */          \
    static inline __attribute__((always_inline)) void gate_up_tile_##SUFFIX(                                 \
        const int rows, int64_t H, const float *const *x, const WT *w, float *const *h) {                    \
        v16 g[ROWS], u[ROWS];                                                                               \
        panel_dots_##SUFFIX(rows, H, x, w, g, u, (const WT *)0);                                            \
        for (int r = 0; r < rows; r++) {                                                                    \
            float gs[16], us[16];                                                                           \
            store_f32(gs, g[r]);                                                                            \
            store_f32(us, u[r]);                                                                            \
            for (int c = 0; c < 16; c++) h[r][c] = silu_times(gs[c], us[c]);                                 \
        }                                                                                                   \
    }                                                                                                       \
    /* down over one panel of 32 hidden columns: y[r] = weight[r] * sums. */                                 \
    static inline __attribute__((always_inline)) void down_tile_##SUFFIX(                                    \
        const int rows, int64_t I, const float *const *h, const WT *w, const float *weight, float *const *y, \
        const WT *pf) {                                                                                     \
        v16 a[ROWS], b[ROWS];                                                                               \
        panel_dots_##SUFFIX(rows, I, h, w, a, b, pf);                                                       \
        for (int r = 0; r < rows; r++) {                                                                    \
            store_f32(y[r], a[r] * splat(weight[r]));                                                       \
            store_f32(y[r] + 16, b[r] * splat(weight[r]));                                                  \
        }                                                                                                   \
    }                                                                                                       \
    DEFINE_PANELS(SUFFIX, WT, float, float)

/* Rows in tiles of ROWS, each tile a call with a constant row count (its accumulators stay in registers). */
#if ROWS == 8
#define ROW_CASES_4_TO_8(f, args)                                                                           \
    case 4: f(4, UNPACK args); break;                                                                       \
    case 5: f(5, UNPACK args); break;                                                                       \
    case 6: f(6, UNPACK args); break;                                                                       \
    case 7: f(7, UNPACK args); break;                                                                       \
    case 8: f(8, UNPACK args); break;
#else
#define ROW_CASES_4_TO_8(f, args)
#endif
#define UNPACK(...) __VA_ARGS__
#define ROW_TILES(rows, f, args)                                                                            \
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {                                                           \
        switch (rows - r0 < ROWS ? rows - r0 : ROWS) {                                                      \
        case 1: f(1, UNPACK args); break;                                                                   \
        case 2: f(2, UNPACK args); break;                                                                   \
        case 3: f(3, UNPACK args); break;                                                                   \
        ROW_CASES_4_TO_8(f, args)                                                                           \
        }                                                                                                   \
    }
/* A panel's rows: x / h rows of type XT / HT, weights WT. */
#define DEFINE_PANELS(SUFFIX, WT, XT, HT)                                                                    \
    static void gate_up_panel_##SUFFIX(int64_t rows, int64_t H, const XT *const *x, const WT *w,             \
                                       HT *const *h) {                                                      \
        ROW_TILES(rows, gate_up_tile_##SUFFIX, (H, x + r0, w, h + r0))                                      \
    }                                                                                                       \
    static void down_panel_##SUFFIX(int64_t rows, int64_t I, const HT *const *h, const WT *w,                \
                                    const float *weight, float *const *y, const WT *next) {                 \
        ROW_TILES(rows, down_tile_##SUFFIX, (I, h + r0, w, weight + r0, y + r0,                             \
                                             r0 > 0 && r0 + ROWS >= rows ? next : (const WT *)0))           \
    }

DEFINE_KERNELS(f32, float, load_f32)
DEFINE_KERNELS(bf16, uint16_t, load_bf16)

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
        const uint16_t *wk = w + k * 32;
        for (int r = 0; r < rows; r++) {
            const __m512i xb = pair(x[r] + k);
            a[r] = dot(a[r], xb, wk);
            b[r] = dot(b[r], xb, wk + 32);
        }
    }
}

static inline __attribute__((always_inline)) void gate_up_tile_bf16dp(
    const int rows, int64_t H, const uint16_t *const *x, const uint16_t *w, uint16_t *const *h) {
    __m512 g[ROWS], u[ROWS];
    panel_dots_bf16dp(rows, H, x, w, g, u, (const uint16_t *)0);
    for (int r = 0; r < rows; r++) {
        float gs[16], us[16];
        _mm512_storeu_ps(gs, g[r]);
        _mm512_storeu_ps(us, u[r]);
        for (int c = 0; c < 16; c++) gs[c] = silu_times(gs[c], us[c]);
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

/* The layer, for one weight type.
 *   x        [T, H] float32 rows
 *   ids      [T, K] int64 selected experts; weights [T, K] float32 routing weights
 *   w13      [E, I/16, H, 32] gate/up panels; w2 [E, HP/32, I, 32] down panels (I, HP: multiples of 16, 32;
 *            padded with zero weights, so padded outputs and intermediates are 0)
 *   out      [T, HP] float32 or bfloat16 (out_bf16)
 *   h        [T*K, I] float32 scratch; y [threads, T*K, 32] float32 scratch
 *   sort     [2*T*K + 2*E + 2] int64 scratch; ptrs [threads, 2*T*K] pointer scratch
 */
#define DEFINE_LAYER(SUFFIX, WT, XT, HT)                                                                     \
    void moe_experts_##SUFFIX(int64_t T, int64_t K, int64_t E, int64_t H, int64_t HP, int64_t I,            \
                              const XT *x,                                                                \
                              const int64_t *ids, const float *weights, const WT *w13, const WT *w2,        \
                              void *out, int out_bf16, HT *h, float *y, int64_t *sort, void **ptrs,         \
                              int threads) {                                                               \
        const int64_t n = T * K;                                                                           \
        int64_t *order = sort, *starts = sort + n;                                                         \
        sort_selections(n, E, ids, order, starts);                                                         \
        const int64_t up_panels = I / 16, down_panels = HP / 32;                                            \
        _Pragma("omp parallel num_threads(threads)") {                                                     \
            int tid = 0;                                                                                   \
            IF_OPENMP(tid = omp_get_thread_num();)                                                          \
            void **rows_in = ptrs + (int64_t)tid * 2 * n, **rows_out = rows_in + n;                         \
            float *ys = y + (int64_t)tid * n * 32;                                                          \
            _Pragma("omp for schedule(static)") for (int64_t p = 0; p < up_panels; p++) {                   \
                for (int64_t e = 0; e < E; e++) {                                                           \
                    const int64_t first = starts[e], count = starts[e + 1] - first;                         \
                    if (!count) continue;                                                                  \
                    for (int64_t j = 0; j < count; j++) {                                                   \
                        rows_in[j] = (void *)(x + (order[first + j] / K) * H);                              \
                        rows_out[j] = h + (first + j) * I + p * 16;                                         \
                    }                                                                                      \
                    gate_up_panel_##SUFFIX(count, H, (const XT *const *)rows_in,                           \
                                           w13 + ((e * up_panels + p) * H) * 32, (HT *const *)rows_out);   \
                }                                                                                          \
            }                                                                                              \
            _Pragma("omp for schedule(static)") for (int64_t p = 0; p < down_panels; p++) {                 \
                for (int64_t e = 0; e < E; e++) {                                                           \
                    const int64_t first = starts[e], count = starts[e + 1] - first;                         \
                    if (!count) continue;                                                                  \
                    float wsel[ROWS];                                                                      \
                    for (int64_t j0 = 0; j0 < count; j0 += ROWS) {                                          \
                        const int64_t m = count - j0 < ROWS ? count - j0 : ROWS;                            \
                        for (int64_t j = 0; j < m; j++) {                                                   \
                            const int64_t s = order[first + j0 + j];                                        \
                            rows_in[j] = h + (first + j0 + j) * I;                                          \
                            rows_out[j] = ys + s * 32;                                                      \
                            wsel[j] = weights[s];                                                          \
                        }                                                                                  \
                        down_panel_##SUFFIX(m, I, (const HT *const *)rows_in,                              \
                                            w2 + ((e * down_panels + p) * I) * 32, wsel, (float *const *)rows_out, \
                                            (const WT *)0);                                                \
                    }                                                                                      \
                }                                                                                          \
                for (int64_t t = 0; t < T; t++) { /* each token's slots in top-k order */                  \
                    v16 a = load_f32(ys + t * K * 32), b = load_f32(ys + t * K * 32 + 16);                  \
                    for (int64_t k = 1; k < K; k++) {                                                       \
                        a += load_f32(ys + (t * K + k) * 32);                                               \
                        b += load_f32(ys + (t * K + k) * 32 + 16);                                          \
                    }                                                                                      \
                    store_columns(out, out_bf16, t * HP + p * 32, a, b);                                    \
                }                                                                                          \
            }                                                                                              \
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
#if defined(__AVX512BF16__)
DEFINE_LAYER(bf16dp, uint16_t, uint16_t, uint16_t)
#endif

/* A linear layer, y = x W^T + bias, on the down projection's tiles (routing weight 1, exact):
 *   x [T, K] rows (XT), w [N/32, K, 32] panels, bias [N] float32 or NULL, out [T, N] float32 or bfloat16;
 *   y [threads, T, 32] float32 scratch, ptrs [threads, 2*T] pointer scratch, ones [T] float32 ones. */
#define DEFINE_LINEAR(SUFFIX, WT, XT)                                                                        \
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
            _Pragma("omp for schedule(static)") for (int64_t p = 0; p < N / 32; p++) {                      \
                down_panel_##SUFFIX(T, K, (const XT *const *)rows_in, w + p * K * 32, ones,                \
                                    (float *const *)rows_out, w + (p + 1) * K * 32);                       \
                const v16 ba = bias ? load_f32(bias + p * 32) : splat(0.0f);                               \
                const v16 bb = bias ? load_f32(bias + p * 32 + 16) : splat(0.0f);                          \
                for (int64_t t = 0; t < T; t++)                                                            \
                    store_columns(out, out_bf16, t * N + p * 32, load_f32(ys + t * 32) + ba,               \
                                  load_f32(ys + t * 32 + 16) + bb);                                        \
            }                                                                                              \
        }                                                                                                  \
    }

DEFINE_LINEAR(f32, float, float)
DEFINE_LINEAR(bf16, uint16_t, float)
#if defined(__AVX512BF16__)
DEFINE_LINEAR(bf16dp, uint16_t, uint16_t)
#endif

/* Paged decode attention: one query row per request attends to its request's cached keys and values, read
 * in place from the paged cache (no gathered copies). Query row rows[i] belongs to request r = reqs[i]; for
 * key/value head g, its query heads h = g*rep .. g*rep+rep-1 take scores s_j = (scale * q).k_j over the keys
 * j < lens[r] at cache slots slots[r, j], a softmax in float32 (max subtracted), and the weighted sum of the
 * values. Threads split the (row, key/value head) pairs.
 *   q [*, H, D], cache [2, cache_slots, KVH, D] (q's element type), out [*, H, D]; D a multiple of 16, at most
 *   MAX_HEAD_DIM; slots [requests, max_kv] int64, lens [requests] int64; scores [threads, rep, max_kv] float32
 *   scratch. */
static inline float hsum(v16 v) {
    float s[16], t = 0.0f;
    store_f32(s, v);
    for (int c = 0; c < 16; c++) t += s[c];
    return t;
}

#define MAX_HEAD_DIM 256
#define DEFINE_DECODE_ATTENTION(SUFFIX, T)                                                                   \
    void decode_attention_##SUFFIX(int64_t n, int64_t H, int64_t KVH, int64_t D, const T *q,                \
                                   const int64_t *rows, const int64_t *reqs, const T *cache,               \
                                   int64_t cache_slots,                                                    \
                                   const int64_t *slots, const int64_t *lens, int64_t max_kv, float scale, \
                                   T *out, float *scores, int threads) {                                   \
        const int64_t rep = H / KVH, vecs = D / 16;                                                        \
        const T *keys = cache, *values = cache + cache_slots * KVH * D;                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                  \
        for (int64_t task = 0; task < n * KVH; task++) {                                                    \
            const int64_t i = task / KVH, g = task % KVH, r = reqs[i], len = lens[r];                     \
            int tid = 0;                                                                                   \
            IF_OPENMP(tid = omp_get_thread_num();)                                                          \
            float *s = scores + (int64_t)tid * rep * max_kv;                                               \
            if (len <= 0) { /* no key (a padded row): zeros */                                             \
                for (int64_t h = 0; h < rep; h++)                                                          \
                    for (int64_t c = 0; c < vecs; c++)                                                     \
                        store_##SUFFIX(out + (rows[i] * H + g * rep + h) * D + c * 16, splat(0.0f));    \
                continue;                                                                                  \
            }                                                                                              \
            v16 qv[MAX_HEAD_DIM / 16];                                                                     \
            for (int64_t h = 0; h < rep; h++) { /* scores, one head at a time (its q in registers) */       \
                const T *qh = q + (rows[i] * H + g * rep + h) * D;                                          \
                for (int64_t c = 0; c < vecs; c++) qv[c] = load_##SUFFIX(qh + c * 16) * splat(scale);    \
                float *sh = s + h * max_kv;                                                                \
                for (int64_t j = 0; j < len; j++) {                                                         \
                    const T *k = keys + (slots[r * max_kv + j] * KVH + g) * D;                              \
                    v16 acc = qv[0] * load_##SUFFIX(k);                                                 \
                    for (int64_t c = 1; c < vecs; c++) acc += qv[c] * load_##SUFFIX(k + c * 16);         \
                    sh[j] = hsum(acc);                                                                     \
                }                                                                                          \
                float top = -INFINITY, total = 0.0f;                                                       \
                for (int64_t j = 0; j < len; j++) top = sh[j] > top ? sh[j] : top;                          \
                for (int64_t j = 0; j < len; j++) total += (sh[j] = expf(sh[j] - top));                     \
                for (int64_t j = 0; j < len; j++) sh[j] /= total;                                           \
            }                                                                                              \
            for (int64_t h = 0; h < rep; h++) { /* values: sum_j p_j v_j */                                 \
                v16 acc[MAX_HEAD_DIM / 16];                                                                \
                for (int64_t c = 0; c < vecs; c++) acc[c] = splat(0.0f);                                   \
                const float *ph = s + h * max_kv;                                                          \
                for (int64_t j = 0; j < len; j++) {                                                         \
                    const T *v = values + (slots[r * max_kv + j] * KVH + g) * D;                            \
                    const v16 p = splat(ph[j]);                                                            \
                    for (int64_t c = 0; c < vecs; c++) acc[c] += p * load_##SUFFIX(v + c * 16);          \
                }                                                                                          \
                T *o = out + (rows[i] * H + g * rep + h) * D;                                               \
                for (int64_t c = 0; c < vecs; c++) store_##SUFFIX(o + c * 16, acc[c]);                 \
            }                                                                                              \
        }                                                                                                  \
    }

DEFINE_DECODE_ATTENTION(f32, float)
DEFINE_DECODE_ATTENTION(bf16, uint16_t)

/* A vocoder residual unit's tail, in place: x += bias + W snake(h) per row, snake(h) = h + (sin(alpha h) scale)^2
 * per channel (SnakeBeta), W a kernel-1 convolution as panels [C/32, C, 32]. One pass reads h and x and
 * writes x, where separate calls make three more passes over these [samples, channels] signals. Threads split
 * the row tiles; a tile's activations stay in a [ROWS, C] float32 buffer per thread (buf [threads, ROWS * C]).
 *   h, x [T, C] float32; alpha, scale, bias [C] float32. */
#pragma omp declare simd simdlen(16) notinbranch
extern float sinf(float);

void snake_pointwise_f32(int64_t T, int64_t C, const float *h, const float *alpha, const float *scale,
                         const float *w, const float *bias, float *x, float *buf, int threads) {
    const int64_t tiles = (T + ROWS - 1) / ROWS;
    _Pragma("omp parallel num_threads(threads)") {
        int tid = 0;
        IF_OPENMP(tid = omp_get_thread_num();)
        float *act = buf + (int64_t)tid * ROWS * C;
        const float *rows_in[ROWS];
        float *rows_out[ROWS];
        float ys[ROWS * 32], ones[ROWS];
        for (int r = 0; r < ROWS; r++) {
            rows_in[r] = act + r * C;
            rows_out[r] = ys + r * 32;
            ones[r] = 1.0f;
        }
        _Pragma("omp for schedule(static)") for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t t0 = tile * ROWS, m = T - t0 < ROWS ? T - t0 : ROWS;
            for (int64_t r = 0; r < m; r++) {
                const float *hr = h + (t0 + r) * C;
                float *ar = act + r * C;
                _Pragma("omp simd") for (int64_t c = 0; c < C; c++) {
                    const float y = sinf(hr[c] * alpha[c]) * scale[c];
                    ar[c] = hr[c] + y * y;
                }
            }
            for (int64_t p = 0; p < C / 32; p++) {
                down_panel_f32(m, C, rows_in, w + p * C * 32, ones, rows_out, (const float *)0);
                for (int64_t r = 0; r < m; r++) {
                    float *xr = x + (t0 + r) * C + p * 32;
                    store_f32(xr, load_f32(xr) + load_f32(bias + p * 32) + load_f32(ys + r * 32));
                    store_f32(xr + 16, load_f32(xr + 16) + load_f32(bias + p * 32 + 16) + load_f32(ys + r * 32 + 16));
                }
            }
        }
    }
}
