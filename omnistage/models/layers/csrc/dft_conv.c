/* Wide causal convolutions as products of small DFTs (dft_conv.py): the transforms around torch's batched GEMM.
 *
 * A convolution of K taps (dilation d) over an item's rows of C channels (L rows: its T outputs' K - 1 rows of
 * context first) is cut into blocks of N inputs: block (base, r) reads the rows t0, t0 + d, ..., t0 + (N - 1) d
 * (t0 = base S d + r, S = N - K + 1; rows past the item's last are zeros) and gives the outputs t0, t0 + d, ...,
 * t0 + (S - 1) d that are below T (a dilated convolution is d plain ones on interleaved rows). Blocks never span
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
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_CHUNK 128 /* channels a block's transform keeps in flight, at most (chunks split C evenly) */
#define MAX_N 64 /* N: a power of two up to this */

static inline float get_f32(const float *p) { return *p; }
static inline void put_f32(float *p, float v) { *p = v; }
static inline float get_bf16(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline void put_bf16(uint16_t *p, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    *p = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* nearest even (finite values) */
}

/* Block m's item and first row in it: an item has bases * d blocks (bases = ceil(T / (S d))). */
static inline int64_t block_start(int64_t m, int64_t TO, int64_t S, int64_t d, int64_t *item) {
    const int64_t per_item = (TO + S * d - 1) / (S * d) * d, k = m % per_item;
    *item = m / per_item;
    return (k / d) * S * d + k % d;
}

/* Vectors of the build's native width (GCC lowers wider generic vectors through the stack). */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX2__)
#define LANES 8
#else
#define LANES 4
#endif
#define VECS (MAX_CHUNK / LANES)
typedef float vf __attribute__((vector_size(LANES * 4)));

static inline vf splat(float x) {
#if LANES == 16
    return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#elif LANES == 8
    return (vf){x, x, x, x, x, x, x, x};
#else
    return (vf){x, x, x, x};
#endif
}

/* Channels a chunk takes: C split evenly into chunks of at most MAX_CHUNK, rounded up to whole vectors (96
 * channels: one chunk of 96, not 64 + a half-empty one). */
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
            const int64_t p = 2 + 3 * (f - 1);
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
            const int64_t p = 2 + 3 * (f - 1);
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
#define DEFINE_FORWARD(SUFFIX, T)                                                                             \
    void dft_forward_##SUFFIX(int64_t L, int64_t TO, int64_t C, int64_t m0, int64_t M, int64_t N, int64_t S,   \
                              int64_t d, const T *x, const float *tw, T *planes, int threads) {               \
        const int64_t P = 2 + 3 * (N / 2 - 1);                                                                 \
        const int64_t CHUNK = chunk_width(C);                                                                  \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                      \
        for (int64_t mi = 0; mi < M; mi++) {                                                                   \
            int64_t item;                                                                                      \
            const int64_t t0 = block_start(m0 + mi, TO, S, d, &item);                                          \
            vf xs[MAX_N][VECS], out[2 + 3 * (MAX_N / 2 - 1)][VECS];                                       \
            for (int64_t c0 = 0; c0 < C; c0 += CHUNK) {                                                        \
                const int64_t w = C - c0 < CHUNK ? C - c0 : CHUNK;                                             \
                for (int64_t n = 0; n < N; n++) {                                                              \
                    const int64_t t = t0 + n * d;                                                              \
                    int64_t c = 0;                                                                             \
                    float *row = (float *)xs[n];                                                               \
                    if (t < L)                                                                                 \
                        for (; c < w; c++) row[c] = get_##SUFFIX(x + (item * L + t) * C + c0 + c);             \
                    for (; c < CHUNK; c++) row[c] = 0.0f;                                                      \
                }                                                                                              \
                forward_block(N, CHUNK / LANES, xs, tw, out);                                                                 \
                for (int64_t p = 0; p < P; p++) {                                                              \
                    T *dst = planes + (p * M + mi) * C + c0;                                                   \
                    const float *row = (const float *)out[p];                                                  \
                    for (int64_t c = 0; c < w; c++) put_##SUFFIX(dst + c, row[c]);                             \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }

/* Planes [P][M][C] of blocks m0 .. -> out [B, T, C] (+ bias, + residual [B, T, C] where given): each item's
 * outputs below T. */
#define DEFINE_INVERSE(SUFFIX, T)                                                                             \
    void dft_inverse_##SUFFIX(int64_t TO, int64_t C, int64_t m0, int64_t M,                                    \
                              int64_t N, int64_t K, int64_t d, const T *planes, const float *tw,               \
                              const float *bias, const T *residual, T *out, int threads) {                     \
        const int64_t S = N - K + 1, P = 2 + 3 * (N / 2 - 1), CHUNK = chunk_width(C);                          \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                      \
        for (int64_t mi = 0; mi < M; mi++) {                                                                   \
            int64_t item;                                                                                      \
            const int64_t t0 = block_start(m0 + mi, TO, S, d, &item);                                          \
            int64_t dest[MAX_N]; /* output row of block position j, -1: not kept */                            \
            int any = 0;                                                                                       \
            for (int64_t j = 0; j < N; j++) {                                                                  \
                dest[j] = -1;                                                                                  \
                const int64_t t = t0 + (j - (K - 1)) * d;                                                      \
                if (j < K - 1 || t >= TO) continue;                                                            \
                dest[j] = item * TO + t;                                                                       \
                any = 1;                                                                                       \
            }                                                                                                  \
            if (!any) continue;                                                                                \
            vf in[2 + 3 * (MAX_N / 2 - 1)][VECS], y[MAX_N][VECS];                                         \
            for (int64_t c0 = 0; c0 < C; c0 += CHUNK) {                                                        \
                const int64_t w = C - c0 < CHUNK ? C - c0 : CHUNK;                                             \
                for (int64_t p = 0; p < P; p++) {                                                              \
                    const T *src = planes + (p * M + mi) * C + c0;                                             \
                    int64_t c = 0;                                                                             \
                    float *row = (float *)in[p];                                                               \
                    for (; c < w; c++) row[c] = get_##SUFFIX(src + c);                                         \
                    for (; c < CHUNK; c++) row[c] = 0.0f;                                                      \
                }                                                                                              \
                inverse_block(N, K, CHUNK / LANES, in, tw, y);                                                                \
                for (int64_t j = K - 1; j < N; j++) {                                                          \
                    if (dest[j] < 0) continue;                                                                 \
                    T *o = out + dest[j] * C + c0;                                                             \
                    const T *r = residual ? residual + dest[j] * C + c0 : 0;                                   \
                    for (int64_t c = 0; c < w; c++) {                                                          \
                        float v = ((const float *)y[j])[c];                                                    \
                        if (bias) v += bias[c0 + c];                                                           \
                        if (r) v += get_##SUFFIX(r + c);                                                       \
                        put_##SUFFIX(o + c, v);                                                                \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }

#define TILE_I 8   /* input channels a tile of the weight's planes holds */
#define TILE 64    /* output channels: each plane row written 256 bytes at a time */
/* A convolution weight [CO][CI][K] -> its planes [P][CI][CO] for blocks of N (the taps reversed: a block's
 * output j is the circular convolution's), TILE_I x TILE (input, output) channels at a time: each output
 * channel's taps read in one run, each plane's rows written TILE outputs at a time. */
#define DEFINE_WEIGHT(SUFFIX, T)                                                                              \
    void dft_weight_##SUFFIX(int64_t CO, int64_t CI, int64_t K, int64_t N, const T *weight, const float *tw,   \
                             T *planes, int threads) {                                                        \
        const int64_t H = N / 2, plane = CI * CO, tiles_o = (CO + TILE - 1) / TILE;                            \
        const int64_t P = 2 + 3 * (H - 1), tiles = tiles_o * ((CI + TILE_I - 1) / TILE_I);                         \
        float cf[MAX_N / 2 + 1][MAX_N], sf[MAX_N / 2 + 1][MAX_N]; /* cos, sin(2 pi f q / N) */                 \
        for (int64_t f = 0; f <= H; f++)                                                                       \
            for (int64_t q = 0; q < K; q++) {                                                                  \
                cf[f][q] = tw[(f * q) & (N - 1)];                                                              \
                sf[f][q] = tw[N + ((f * q) & (N - 1))];                                                        \
            }                                                                                                  \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                      \
        for (int64_t tile = 0; tile < tiles; tile++) {                                                         \
            const int64_t ci0 = tile / tiles_o * TILE_I, co0 = tile % tiles_o * TILE;                            \
            const int64_t ni = CI - ci0 < TILE_I ? CI - ci0 : TILE_I, no = CO - co0 < TILE ? CO - co0 : TILE;      \
            float buf[2 + 3 * (MAX_N / 2 - 1)][TILE_I][TILE];                                                    \
            for (int64_t i = 0; i < ni; i++) {                                                                 \
                float h[MAX_N][TILE] = {{0}}; /* reversed taps, TILE output channels side by side */           \
                for (int64_t o = 0; o < no; o++) {                                                             \
                    const T *taps = weight + ((co0 + o) * CI + ci0 + i) * K;                                   \
                    for (int64_t q = 0; q < K; q++) h[q][o] = get_##SUFFIX(taps + K - 1 - q);                  \
                }                                                                                              \
                for (int64_t f = 0; f <= H; f++) {                                                             \
                    float re[TILE] = {0}, im[TILE] = {0};                                                      \
                    for (int64_t q = 0; q < K; q++)                                                            \
                        for (int o = 0; o < TILE; o++) {                                                       \
                            re[o] += cf[f][q] * h[q][o];                                                       \
                            im[o] -= sf[f][q] * h[q][o];                                                       \
                        }                                                                                      \
                    if (f == 0 || f == H) {                                                                    \
                        for (int o = 0; o < TILE; o++) buf[f == 0 ? 0 : 1][i][o] = re[o];                      \
                        continue;                                                                              \
                    }                                                                                          \
                    const int64_t p = 2 + 3 * (f - 1);                                                         \
                    for (int o = 0; o < TILE; o++) {                                                           \
                        buf[p][i][o] = re[o];                                                                  \
                        buf[p + 1][i][o] = im[o] - re[o];                                                      \
                        buf[p + 2][i][o] = re[o] + im[o];                                                      \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
            for (int64_t p = 0; p < P; p++)                                                                    \
                for (int64_t i = 0; i < ni; i++) {                                                             \
                    T *dst = planes + p * plane + (ci0 + i) * CO + co0;                                        \
                    for (int64_t o = 0; o < no; o++) put_##SUFFIX(dst + o, buf[p][i][o]);                      \
                }                                                                                              \
        }                                                                                                      \
    }

DEFINE_FORWARD(f32, float)
DEFINE_FORWARD(bf16, uint16_t)
DEFINE_INVERSE(f32, float)
DEFINE_INVERSE(bf16, uint16_t)
DEFINE_WEIGHT(f32, float)
DEFINE_WEIGHT(bf16, uint16_t)
