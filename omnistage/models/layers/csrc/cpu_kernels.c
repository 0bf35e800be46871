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

/* A value as a tensor of the output's type holds it: rounded through bfloat16 when the output is bfloat16. */
static inline v16 as_stored(v16 v, int bf16) {
    if (!bf16) return v;
    uint16_t tmp[16];
    store_bf16(tmp, v);
    return load_bf16(tmp);
}

static inline v16 load_columns(const void *out, int out_bf16, int64_t offset) {
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
            down_panel_##SUFFIX(T, K, rows_in, w + p * K * 32, ones, rows_out, w + (p + 1) * K * 32);      \
            const v16 ba = bias ? load_f32(bias + p * 32) : splat(0.0f);                                   \
            const v16 bb = bias ? load_f32(bias + p * 32 + 16) : splat(0.0f);                              \
            for (int64_t t = 0; t < T; t++) {                                                              \
                v16 a = load_f32(ys + t * 32) + ba, b = load_f32(ys + t * 32 + 16) + bb;                   \
                const int64_t at = t * N + p * 32;                                                         \
                if (add) {                                                                                 \
                    a = as_stored(a, out_bf16) + load_columns(out, out_bf16, at);                          \
                    b = as_stored(b, out_bf16) + load_columns(out, out_bf16, at + 16);                     \
                }                                                                                          \
                store_columns(out, out_bf16, at, a, b);                                                    \
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
 *   MAX_HEAD_DIM; slots [requests, max_kv] int64, lens [requests] int64; scores [threads, max_kv] float32
 *   scratch. */
static inline float hsum(v16 v) {
    float s[16], t = 0.0f;
    store_f32(s, v);
    for (int c = 0; c < 16; c++) t += s[c];
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
        const int64_t vecs = D / 16;                                                                        \
        v16 qv[MAX_HEAD_DIM / 16], acc[MAX_HEAD_DIM / 16];                                                  \
        for (int64_t c = 0; c < vecs; c++) qv[c] = load_##SUFFIX(q + c * 16) * splat(scale);                \
        float top = -INFINITY, total = 0.0f;                                                                \
        for (int64_t j = 0; j < len; j++) {                                                                 \
            const T *k = keys + (slots ? slots[j] : j) * stride;                                            \
            v16 dot = qv[0] * load_##SUFFIX(k);                                                             \
            for (int64_t c = 1; c < vecs; c++) dot += qv[c] * load_##SUFFIX(k + c * 16);                    \
            s[j] = hsum(dot);                                                                               \
            top = s[j] > top ? s[j] : top;                                                                  \
        }                                                                                                   \
        for (int64_t j = 0; j < len; j++) total += (s[j] = expf(s[j] - top));                               \
        for (int64_t j = 0; j < len; j++) s[j] /= total;                                                    \
        for (int64_t c = 0; c < vecs; c++) acc[c] = splat(0.0f);                                            \
        for (int64_t j = 0; j < len; j++) {                                                                 \
            const T *v = values + (slots ? slots[j] : j) * stride;                                          \
            const v16 p = splat(s[j]);                                                                      \
            for (int64_t c = 0; c < vecs; c++) acc[c] += p * load_##SUFFIX(v + c * 16);                     \
        }                                                                                                   \
        for (int64_t c = 0; c < vecs; c++) store_##SUFFIX(out + c * 16, acc[c]);                            \
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
                    for (int64_t c = 0; c < D / 16; c++) store_##SUFFIX(out + at + c * 16, splat(0.0f));   \
                    continue;                                                                              \
                }                                                                                          \
                attend_head_##SUFFIX(D, len, q + at, scale, keys + g * D, values + g * D, KVH * D,          \
                                     slots + r * max_kv, scores + (int64_t)tid * max_kv, out + at);         \
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

/* The code predictor's decoder layers for one pass of a frame (Qwen3: RMSNorm, q/k/v, per-head q/k RMSNorm,
 * rotary, attention over the frame's cached positions, o, RMSNorm, SwiGLU; residuals), all layers in one
 * parallel region: rows split between the threads for the row-wise steps, panels for the linear layers,
 * (row, key/value head) pairs for attention. Each of these would otherwise be a call of its own, with its own
 * fork and join of the threads, on a few rows. Values are rounded to the model's type where its separate ops
 * store a tensor (bfloat16: after each norm, linear layer, rotary, attention and residual; SwiGLU once).
 *   dims: B requests, S rows per request (request-major, at positions pos0 .. pos0+S-1), pos0, H, NQ query
 *     heads, NKV key/value heads, D head size, I intermediate size, Q frame positions (the caches' length),
 *     and the linear layers' padded output widths NQKV (>= (NQ + 2 NKV) D) and NGU (>= 2I); H % 32 == 0.
 *   layers: L blocks of 10 addresses: input norm weight (float32 [H]), q/k/v panels, q norm, k norm weights
 *     (float32 [D]), o panels, post-attention norm weight (float32 [H]), gate/up panels (the gate's rows
 *     first), down panels, K cache, V cache ([B, Q, NKV, D] of the model's type).
 *   bufs: x [B S, H] (updated in place), cos, sin (float32 [Q, D], the values the model uses), then scratch:
 *     normed [R, H], qkv [R, NQKV], attn [R, NQ D], gate/up [R, NGU], act [R, I] (model's type), y [threads,
 *     R, 32] float32, ptrs [threads, 2 R], ones [R] float32 ones, scores [threads, Q] float32; and for the
 *     output head (bufs[12] NULL: none): the final norm's weight (float32 [H]), the head's panels, logits
 *     [B, VP] of the model's type, the picks [B] int64 (each request's argmax, the first of equal maxima),
 *     normed last rows [B, H] scratch; dims[11], dims[12]: the vocabulary V and its padded width VP.
 *   eps: the norms' epsilon; scale: the attention's. */
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

#pragma omp declare simd simdlen(16) notinbranch
extern float expf(float);
/* silu_times with a 16-lane clone (libmvec's expf), for the pass's SwiGLU loop; silu_times itself stays scalar
 * (glibc's expf): the expert kernel's results keep their bits. */
#pragma omp declare simd simdlen(16) notinbranch
static inline float swiglu_lane(float g, float u) { return g / (1.0f + expf(-g)) * u; }

static inline float get_f32(const float *p) { return *p; }
static inline void put_f32(float *p, float v) { *p = v; }
static inline float round_f32(float v) { return v; }
static inline float get_bf16(const uint16_t *p) { return widen(*p); }
static inline void put_bf16(uint16_t *p, float v) { *p = narrow(v); }
static inline float round_bf16(float v) { return widen(narrow(v)); }

/* weight * (x / rms(x)), the normalised row rounded to the model's type before the weight (Qwen3), into
 * float32 `out` (rounded as stored) or the model's type `stored`. */
#define DEFINE_ROW_NORM(TS, T)                                                                               \
    static inline void row_norm_##TS(int64_t n, const T *x, const float *weight, float eps, float *out,     \
                                     T *stored) {                                                          \
        float squares = 0.0f;                                                                               \
        for (int64_t c = 0; c < n; c++) squares += get_##TS(x + c) * get_##TS(x + c);                       \
        const float inv = 1.0f / sqrtf(squares / (float)n + eps);                                           \
        for (int64_t c = 0; c < n; c++) {                                                                   \
            const float v = weight[c] * round_##TS(get_##TS(x + c) * inv);                                 \
            if (out) out[c] = round_##TS(v);                                                                \
            else put_##TS(stored + c, v);                                                                   \
        }                                                                                                   \
    }
DEFINE_ROW_NORM(f32, float)
DEFINE_ROW_NORM(bf16, uint16_t)

#define DEFINE_PASS(SUFFIX, TS, WT, T)                                                                       \
    void cp_pass_##SUFFIX(const int64_t *dims, const int64_t *layers, int64_t L, const int64_t *bufs,       \
                          float eps, float scale, int threads) {                                           \
        const int64_t B = dims[0], S = dims[1], pos0 = dims[2], H = dims[3], NQ = dims[4], NKV = dims[5];  \
        const int64_t D = dims[6], I = dims[7], Q = dims[8], NQKV = dims[9], NGU = dims[10];               \
        const int64_t R = B * S, rep = NQ / NKV, half = D / 2, bf16 = sizeof(T) == 2;                      \
        T *x = (T *)bufs[0];                                                                               \
        const float *cos_t = (const float *)bufs[1], *sin_t = (const float *)bufs[2];                      \
        T *normed = (T *)bufs[3], *qkv = (T *)bufs[4], *attn = (T *)bufs[5], *gu = (T *)bufs[6];           \
        T *act = (T *)bufs[7];                                                                             \
        float *y = (float *)bufs[8], *scores = (float *)bufs[11];                                          \
        void **ptrs = (void **)bufs[9];                                                                    \
        const float *ones = (const float *)bufs[10];                                                       \
        _Pragma("omp parallel num_threads(threads)") {                                                     \
            int tid = 0;                                                                                   \
            IF_OPENMP(tid = omp_get_thread_num();)                                                          \
            void **rows_in = ptrs + (int64_t)tid * 2 * R, **rows_out = rows_in + R;                         \
            float *ys = y + (int64_t)tid * R * 32, *s = scores + (int64_t)tid * Q;                          \
            for (int64_t r = 0; r < R; r++) rows_out[r] = ys + r * 32;                                     \
            float row[MAX_HEAD_DIM];                                                                       \
            for (int64_t l = 0; l < L; l++) {                                                              \
                const int64_t *a = layers + l * 10;                                                        \
                const float *norm1 = (const float *)a[0], *qnorm = (const float *)a[2];                    \
                const float *knorm = (const float *)a[3], *norm2 = (const float *)a[5];                    \
                const WT *w_qkv = (const WT *)a[1], *w_o = (const WT *)a[4], *w_gu = (const WT *)a[6];     \
                const WT *w_down = (const WT *)a[7];                                                       \
                T *kc = (T *)a[8], *vc = (T *)a[9];                                                        \
                /* input norm */                                                                           \
                _Pragma("omp for schedule(static)") for (int64_t r = 0; r < R; r++)                         \
                    row_norm_##TS(H, x + r * H, norm1, eps, 0, normed + r * H);                            \
                for (int64_t r = 0; r < R; r++) rows_in[r] = normed + r * H;                               \
                linear_panels_##SUFFIX(R, H, NQKV, (const T *const *)rows_in, w_qkv, 0, qkv, bf16, 0, ys,   \
                                       (float *const *)rows_out, ones);                                    \
                /* q/k norms, rotary; k and v into the caches */                                           \
                _Pragma("omp for schedule(static)") for (int64_t task = 0; task < R * (NQ + NKV); task++) { \
                    const int64_t r = task / (NQ + NKV), head = task % (NQ + NKV);                         \
                    const int64_t b = r / S, pos = pos0 + r % S;                                           \
                    T *src = qkv + r * NQKV + head * D;                                                    \
                    row_norm_##TS(D, src, head < NQ ? qnorm : knorm, eps, row, 0);                         \
                    T *dst = head < NQ ? src : kc + ((b * Q + pos) * NKV + (head - NQ)) * D;               \
                    const float *cs = cos_t + pos * D, *sn = sin_t + pos * D;                              \
                    for (int64_t d = 0; d < D; d++) {                                                      \
                        const float turned = d < half ? -row[d + half] : row[d - half];                    \
                        put_##TS(dst + d, round_##TS(row[d] * cs[d]) + round_##TS(turned * sn[d]));        \
                    }                                                                                      \
                    if (head >= NQ) { /* its value head too */                                             \
                        const T *v = qkv + r * NQKV + (NQ + NKV) * D + (head - NQ) * D;                    \
                        memcpy(vc + ((b * Q + pos) * NKV + (head - NQ)) * D, v, (size_t)D * sizeof(T));    \
                    }                                                                                      \
                }                                                                                          \
                /* attention over positions 0 .. pos of the request's frame */                             \
                _Pragma("omp for schedule(static)") for (int64_t task = 0; task < R * NQ; task++) {         \
                    const int64_t r = task / NQ, h = task % NQ, g = h / rep, b = r / S, len = pos0 + r % S + 1; \
                    const T *q = qkv + r * NQKV + h * D;                                                   \
                    T *o = attn + r * NQ * D + h * D;                                                      \
                    if (D % 16 == 0) { /* 16 lanes at a time (head sizes 64, 128) */                       \
                        const T *k0 = kc + b * Q * NKV * D + g * D, *v0 = vc + b * Q * NKV * D + g * D;    \
                        attend_head_##TS(D, len, q, scale, k0, v0, NKV * D, (const int64_t *)0, s, o);     \
                        continue;                                                                          \
                    }                                                                                      \
                    float top = -INFINITY, total = 0.0f;                                                   \
                    for (int64_t j = 0; j < len; j++) {                                                    \
                        const T *k = kc + ((b * Q + j) * NKV + g) * D;                                     \
                        float dot = 0.0f;                                                                  \
                        for (int64_t d = 0; d < D; d++) dot += get_##TS(q + d) * get_##TS(k + d);          \
                        s[j] = dot * scale;                                                                \
                        top = s[j] > top ? s[j] : top;                                                     \
                    }                                                                                      \
                    for (int64_t j = 0; j < len; j++) total += (s[j] = expf(s[j] - top));                  \
                    for (int64_t d = 0; d < D; d++) row[d] = 0.0f;                                         \
                    for (int64_t j = 0; j < len; j++) {                                                    \
                        const T *v = vc + ((b * Q + j) * NKV + g) * D;                                     \
                        const float p = s[j] / total;                                                      \
                        for (int64_t d = 0; d < D; d++) row[d] += p * get_##TS(v + d);                     \
                    }                                                                                      \
                    for (int64_t d = 0; d < D; d++) put_##TS(o + d, row[d]);                               \
                }                                                                                          \
                for (int64_t r = 0; r < R; r++) rows_in[r] = attn + r * NQ * D;                            \
                linear_panels_##SUFFIX(R, NQ * D, H, (const T *const *)rows_in, w_o, 0, x, bf16, 1, ys,    \
                                       (float *const *)rows_out, ones);                                    \
                /* post-attention norm, SwiGLU MLP */                                                      \
                _Pragma("omp for schedule(static)") for (int64_t r = 0; r < R; r++)                         \
                    row_norm_##TS(H, x + r * H, norm2, eps, 0, normed + r * H);                           \
                for (int64_t r = 0; r < R; r++) rows_in[r] = normed + r * H;                               \
                linear_panels_##SUFFIX(R, H, NGU, (const T *const *)rows_in, w_gu, 0, gu, bf16, 0, ys,     \
                                       (float *const *)rows_out, ones);                                    \
                _Pragma("omp for schedule(static)") for (int64_t r = 0; r < R; r++) {                       \
                    const T *gate = gu + r * NGU, *up = gate + I;                                          \
                    T *out = act + r * I;                                                                  \
                    _Pragma("omp simd") for (int64_t i = 0; i < I; i++)                                    \
                        put_##TS(out + i, swiglu_lane(get_##TS(gate + i), get_##TS(up + i)));             \
                }                                                                                          \
                for (int64_t r = 0; r < R; r++) rows_in[r] = act + r * I;                                  \
                linear_panels_##SUFFIX(R, I, H, (const T *const *)rows_in, w_down, 0, x, bf16, 1, ys,      \
                                       (float *const *)rows_out, ones);                                    \
            }                                                                                              \
            if (bufs[12]) { /* each request's last row: final norm, output head, argmax */                \
                const int64_t V = dims[11], VP = dims[12];                                                 \
                T *last = (T *)bufs[16], *logits = (T *)bufs[14];                                          \
                int64_t *picks = (int64_t *)bufs[15];                                                      \
                _Pragma("omp for schedule(static)") for (int64_t b = 0; b < B; b++)                         \
                    row_norm_##TS(H, x + (b * S + S - 1) * H, (const float *)bufs[12], eps, 0, last + b * H); \
                for (int64_t b = 0; b < B; b++) rows_in[b] = last + b * H;                                 \
                linear_panels_##SUFFIX(B, H, VP, (const T *const *)rows_in, (const WT *)bufs[13], 0, logits, \
                                       bf16, 0, ys, (float *const *)rows_out, ones);                       \
                _Pragma("omp for schedule(static)") for (int64_t b = 0; b < B; b++) {                       \
                    int64_t best = 0;                                                                      \
                    for (int64_t v = 1; v < V; v++)                                                        \
                        if (get_##TS(logits + b * VP + v) > get_##TS(logits + b * VP + best)) best = v;     \
                    picks[b] = best;                                                                       \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }

DEFINE_PASS(f32, f32, float, float)
#if defined(__AVX512BF16__)
DEFINE_PASS(bf16dp, bf16, uint16_t, uint16_t)
#endif
