/* Matrix products on Intel AMX tiles (Sapphire Rapids and later): convolutions over [rows, channels] signals
 * as implicit GEMMs (a linear layer is the one-tap case), bfloat16 products summed in float32.
 *
 * Why: the vocoders' convolutions and the DiT's linear layers are compute-bound GEMMs with hundreds to thousands
 * of rows. A TDPBF16PS instruction takes 16 x 16 x 32 bfloat16 products in 16 cycles, eight times what the FMA
 * units do in float32 in that time.
 *
 * Float32 inputs stay float32-accurate: a float32 value is the sum of three bfloat16 values (hi = x's upper
 * 16 bits, mid = the rest's, lo = what is left, which has at most 8 significant bits), so with weights that are
 * bfloat16 values exactly (checkpoints are stored in bfloat16) every product of a part and a weight is exact
 * in float32 and x.w is the float32 sum of the three parts' products (`parts` 3); the result differs from a
 * float32 GEMM's by float32 summation rounding only. `parts` 1 is a plain bfloat16 product (bfloat16 inputs).
 *
 * Layouts:
 *   planes  bfloat16, CP a multiple of 32 (zero past the signal's C channels): a job's input rows split into a
 *           thread's buffer, [parts][CP/32][rows][32] (amx_conv, amx_unit: split_rows), or a phase call's rows,
 *           [parts][rows][CP + 32] (amx_phase_linear);
 *   weights [NP/32][taps * CP / 2][32][2] bfloat16: per block of 32 outputs, pairs of consecutive inputs
 *           (input k = tap * CP + channel), each pair's two values side by side per output (the layout of an
 *           AMX B tile, two of which cover the block's 32 outputs);
 *   out     [rows][ldo] float32 or bfloat16, N valid outputs per row.
 */
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out AMX tile state only to processes that ask for it: 0 when granted. */
int amx_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static inline __m512i round_bf16(__m512 v) { /* 16 floats -> 16 bfloat16 (nearest even) in the low halves */
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
}

static inline __m512 widen_bf16(__m512i halves) { return _mm512_castsi512_ps(_mm512_slli_epi32(halves, 16)); }

/* glibc's 16-lane sinf (libmvec): sin_unsigned's arguments past its reduction */
__m512 _ZGVeN16v_sinf(__m512 x);

/* sin(t) up to its sign (SnakeBeta squares it), for the activation on the way into the planes: t = k pi + r, |r| <=
 * pi / 2 (pi in parts of at most 12 bits, so k pi's parts are exact for |k| < 4096), then an odd polynomial fitted
 * to sin on [-pi/2, pi/2]. `precise` (float32 rows): pi in three parts, degree 9 (error 1.7e-8 before float32
 * rounding: ~1.2e-7 measured, as libmvec); else (bfloat16 rows, rounded to 8 bits next) two parts, degree 7 (error
 * < 9e-7). Vectors with an argument beyond 8192 or NaN take libmvec's sinf. A third fewer instructions than
 * libmvec's sinf, whose calls were a third of a 96-channel bfloat16 residual unit's time and a sixth of a float32
 * one's. */
static inline __m512 sin_unsigned(__m512 t, const int precise) {
    if (_mm512_cmp_ps_mask(_mm512_abs_ps(t), _mm512_set1_ps(8192.0f), _CMP_NLE_UQ)) return _ZGVeN16v_sinf(t);
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(0.318309886183790672f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(3.140625f), t), p;
    if (precise) {
        r = _mm512_fnmadd_ps(k, _mm512_set1_ps(9.677410125732422e-4f), r);
        r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-8.742277657347586e-8f), r);
    } else {
        r = _mm512_fnmadd_ps(k, _mm512_set1_ps(9.67653589793e-4f), r);
    }
    const __m512 r2 = _mm512_mul_ps(r, r);
    if (precise) {
        p = _mm512_fmadd_ps(_mm512_set1_ps(2.6000548132e-6f), r2, _mm512_set1_ps(-1.9806614728e-4f));
        p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(8.3330171183e-3f));
        p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(-1.6666656733e-1f));
    } else {
        p = _mm512_fmadd_ps(_mm512_set1_ps(-1.8492179515e-4f), r2, _mm512_set1_ps(8.3123659715e-3f));
        p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(-1.6665680707e-1f));
    }
    return _mm512_fmadd_ps(_mm512_mul_ps(p, r2), r, r);
}

/* 16 values (of the mask's lanes; zeros past them) of a float32 or bfloat16 row, as float32. */
static inline __m512 load16(const void *x, int x_bf16, __mmask16 m) {
    return x_bf16 ? widen_bf16(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)x)))
                  : _mm512_maskz_loadu_ps(m, (const float *)x);
}

/* SnakeBeta of 16 values: v + (sin(v alpha) scale)^2 per channel (zero past the mask stays zero); `precise`:
 * float32 rows (sin_unsigned). Every kernel that activates rows (split_row, snake_kept) takes these bits. */
static inline __m512 snake16(__m512 v, const float *alpha, const float *scale, __mmask16 m, int precise) {
    const __m512 t = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, alpha));
    const __m512 y = _mm512_mul_ps(sin_unsigned(t, precise), _mm512_maskz_loadu_ps(m, scale));
    return _mm512_fmadd_ps(y, y, v);
}

/* One row (float32 or bfloat16, C channels) -> `parts` planes' rows of CP channels (`plane` elements apart; each
 * 32 channels `kstride` elements after the previous 32: 32 for rows as they are), zero past C, through SnakeBeta
 * where `alpha` is given. Three parts: hi = the value's upper 16 bits (truncated), mid = the rest's, lo = what is
 * left (at most 8 significant bits: exact in bfloat16), packed 32 channels at a time by VCVTNE2PS2BF16 (exact on
 * values that are bfloat16 already; it reads subnormal inputs, below 1.2e-38, as zero). Two masks and two
 * subtractions a part where rounding each part took a widening of the rounded part: an activated float32 row's
 * split 0.83x the time, the small preset's float32 Code2Wav 0.98x. One part (bfloat16 rows) is the value rounded
 * to nearest even. */
static inline void split_row(const void *x, int x_bf16, int64_t C, int64_t CP, int parts, uint16_t *p0,
                             int64_t plane, int64_t kstride, const float *alpha, const float *scale) {
    for (int64_t c = 0; c < CP; c += 32) {
        __m512 v[2];
        for (int h = 0; h < 2; h++) {
            const int64_t cc = c + 16 * h, n = C - cc >= 16 ? 16 : C - cc > 0 ? C - cc : 0;
            const __mmask16 m = (__mmask16)((1u << n) - 1u);
            v[h] = load16((const char *)x + cc * (x_bf16 ? 2 : 4), x_bf16, m);
            if (alpha) v[h] = snake16(v[h], alpha + cc, scale + cc, m, !x_bf16);
        }
        uint16_t *at = p0 + (c >> 5) * kstride;
        const __m512 upper = _mm512_castsi512_ps(_mm512_set1_epi32((int)0xffff0000u));
        for (int p = 0; p < parts; p++) {
            __m512 part0 = v[0], part1 = v[1];
            if (p + 1 < parts) { /* this part the upper bits, the next ones the rest (exact) */
                part0 = _mm512_and_ps(v[0], upper);
                part1 = _mm512_and_ps(v[1], upper);
                v[0] = _mm512_sub_ps(v[0], part0);
                v[1] = _mm512_sub_ps(v[1], part1);
            }
            _mm512_storeu_si512((void *)(at + p * plane), (__m512i)_mm512_cvtne2ps_pbh(part1, part0));
        }
    }
}

/* A plane row of zeros in each part (split_row's layout). */
static inline void zero_row(uint16_t *p0, int64_t CP, int parts, int64_t plane, int64_t kstride) {
    for (int p = 0; p < parts; p++)
        for (int64_t c = 0; c < CP; c += 32) memset(p0 + p * plane + (c >> 5) * kstride, 0, 64);
}

/* 32 (or `cols` < 32) outputs of one row from the accumulators' float32 `acc`, plus bias, plus `old` (a row in
 * out's type, or none), into out. `stream`: whole 16-output stores go past the cache (non-temporal), so out's lines
 * are not read in first: a vocoder's large outputs are written once and read by the next layer's jobs much later
 * (the small preset's float32 Code2Wav 0.95x the time, its bfloat16 one 0.95x). */
static inline void store_row(const float *acc, const float *bias, const void *old, void *out, int out_bf16,
                             int64_t cols, int stream) {
    for (int64_t c = 0; c < cols; c += 16) {
        const int64_t n = cols - c >= 16 ? 16 : cols - c;
        const __mmask16 m = (__mmask16)((1u << n) - 1u);
        __m512 v = _mm512_loadu_ps(acc + c);
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + c));
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + c;
            if (old) /* the product rounded as stored, then the sum (as separate ops would round) */
                v = _mm512_add_ps(widen_bf16(round_bf16(v)), load16((const uint16_t *)old + c, 1, m));
            const __m256i r = _mm512_cvtepi32_epi16(round_bf16(v));
            if (stream && n == 16) _mm256_stream_si256((__m256i *)o, r);
            else _mm256_mask_storeu_epi16(o, m, r);
        } else {
            float *o = (float *)out + c;
            if (old) v = _mm512_add_ps(v, load16((const float *)old + c, 0, m));
            if (stream && n == 16) _mm512_stream_ps(o, v);
            else _mm512_mask_storeu_ps(o, m, v);
        }
    }
}

static inline int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline void load_tile_config(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* A weight block's step 4 KB ahead (the hardware prefetcher stops at 4 KB boundaries): few rows stream their
 * weights at the memory's rate (an output head's 16 rows ~2x faster; 1 row as fast as panels). */
static inline void prefetch_step(const uint16_t *wk) {
    for (int i = 0; i < 2048; i += 64) _mm_prefetch((const char *)wk + 4096 + i, _MM_HINT_T0);
}

/* acc [32][32] float32 = planes' rows (32 from `a`, CP channels a row, rows lda elements apart and 32 channels
 * kstride after the previous 32 (split_row's layout), `plane` elements between parts; tap t's
 * rows start t * dil rows further) times the weight block `wb` ([K/2][32][2], K = taps * CP); `prefetch`: each
 * step's weights 4 KB ahead (prefetch_step). */
static inline __attribute__((target("amx-tile,amx-bf16"))) void block_32x32(
    const uint16_t *a, int64_t CP, int64_t lda, int64_t kstride, int64_t K, int64_t dil, int parts, int64_t plane,
    const uint16_t *wb, float *acc, int prefetch) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t *wk = wb; /* 16 input pairs x 32 outputs x 2 a step, k = tap * CP + c0 ascending */
    for (int64_t tap = 0; tap < K / CP; tap++) {
        for (int64_t c0 = 0; c0 < CP; c0 += 32, wk += 32 * 32) {
            if (prefetch) prefetch_step(wk);
            _tile_loadd(6, wk, 128);
            _tile_loadd(7, wk + 32, 128);
            const uint16_t *ak = a + tap * dil * lda + (c0 >> 5) * kstride;
            for (int p = 0; p < parts; p++) {
                _tile_loadd(4, ak + p * plane, lda * 2);
                _tile_loadd(5, ak + p * plane + 16 * lda, lda * 2);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
    _tile_stored(0, acc, 128);
    _tile_stored(1, acc + 16, 128);
    _tile_stored(2, acc + 16 * 32, 128);
    _tile_stored(3, acc + 16 * 32 + 16, 128);
}

/* A job's planes: rows [first, first + count) of batch item b's TI input rows, split into `parts` planes of CP
 * channels (`plane` elements apart), 32 channels at a time: each plane is CP / 32 blocks of its rows' 32 channels
 * (an A tile's 16 rows x 32 channels one contiguous 1 KB at any row offset: one stream for the prefetcher and no
 * cache set conflicts, where rows of CP channels, a tap's rows read at a dilation's offset, were 16 strided rows
 * per tile). The input's first H rows of an item are `left`'s (contiguous [B, H, C], as they are, or through
 * SnakeBeta too where `snake_left`), the rest x's ([B, TI - H] rows ldx elements apart), through SnakeBeta where
 * `alpha` is given (per channel: alpha, scale); rows past TI are zeros (the last row block's padding rows read
 * them; their outputs are not stored). */
static void split_rows(const void *x, int64_t ldx, const void *left, int64_t H, const float *alpha,
                       const float *scale, int snake_left, int x_bf16, int64_t b, int64_t TI, int64_t first,
                       int64_t count, int64_t C, int64_t CP, int parts, uint16_t *planes, int64_t plane) {
    const size_t esize = x_bf16 ? 2 : 4;
    const int64_t kstride = plane / CP * 32;
    for (int64_t r = 0; r < count; r++) {
        const int64_t e = first + r;
        uint16_t *dst = planes + r * 32;
        if (e < H) {
            split_row((const char *)left + (b * H + e) * C * esize, x_bf16, C, CP, parts, dst, plane, kstride,
                      snake_left ? alpha : 0, scale);
        } else if (e < TI) {
            split_row((const char *)x + (b * (TI - H) + e - H) * ldx * esize, x_bf16, C, CP, parts, dst, plane,
                      kstride, alpha, scale);
        } else {
            zero_row(dst, CP, parts, plane, kstride);
        }
    }
}

/* A job's output blocks nb0 .. nb1 - 1 for rows m0 .. m1 - 1 (32-row blocks; rows from TO on are not stored)
 * from its planes (split_rows' layout), into out0 (row m0's outputs; rows ldo elements apart, N valid outputs),
 * plus bias, plus old0's rows where given (out0's layout; out0 itself to accumulate); `stream`: see store_row. */
static inline __attribute__((target("amx-tile,amx-bf16"))) void job_blocks(
    const uint16_t *planes, int64_t CP, int64_t K, int64_t dil, int parts, int64_t plane, const uint16_t *w,
    int64_t nb0, int64_t nb1, int64_t m0, int64_t m1, int64_t TO, int64_t N, const float *bias, char *out0,
    int64_t ldo, int out_bf16, const char *old0, int stream, float *acc) {
    const size_t esize = out_bf16 ? 2 : 4;
    for (int64_t nb = nb0; nb < nb1; nb++) {
        for (int64_t m = m0; m < m1; m += 32) {
            block_32x32(planes + (m - m0) * 32, CP, 32, plane / CP * 32, K, dil, parts, plane, w + nb * K * 32, acc,
                        0);
            const int64_t rows = TO - m < 32 ? TO - m : 32, n0 = nb * 32, cols = N - n0 < 32 ? N - n0 : 32;
            for (int64_t r = 0; r < rows; r++) {
                const size_t at = ((m - m0 + r) * ldo + n0) * esize;
                store_row(acc + r * 32, bias ? bias + n0 : 0, old0 ? old0 + at : 0, out0 + at, out_bf16, cols, stream);
            }
        }
    }
}

/* The convolution: out[b * TO + t][n] (+)= bias[n] + sum over taps and channels of in[b][t + tap * dil][c] *
 * w[n][tap][c], in[b] = item b's H rows of `left` then its TI - H rows of x, through SnakeBeta if `alpha` (the
 * rows of `left` too where `snake_left`; see split_rows; float32 or bfloat16 rows, C channels; three parts for
 * float32). Each job (up to `mchunk` output rows of one batch item, a multiple of 32; a share of the output
 * blocks) first splits the input rows it reads into
 * this thread's planes (`scratch`, `stride` elements a thread: (mchunk + (taps - 1) dil) * CP * parts), which then
 * stay in L2 while the weights stream through: the signal is read once, no planes go through memory. */
__attribute__((target("amx-tile,amx-bf16"))) void amx_conv(
    int64_t B, int64_t TI, int64_t TO, int64_t C, int64_t CP, int64_t taps, int64_t dil, const void *x, int64_t ldx,
    const void *left, int64_t H, const float *alpha, const float *scale, int snake_left, int x_bf16,
    const uint16_t *w, int64_t N, const float *bias, void *out, int64_t ldo, int out_bf16, int accumulate,
    int64_t mchunk, uint16_t *scratch, int64_t stride, int threads) {
    const int parts = x_bf16 ? 1 : 3;
    const int64_t K = taps * CP, nblocks = (N + 31) / 32, halo = (taps - 1) * dil;
    const int64_t row_blocks = (TO + 31) / 32, chunks = (row_blocks + mchunk / 32 - 1) / (mchunk / 32);
    const int64_t plane = (mchunk + halo) * CP;
    /* Output blocks split into groups when there are too few row chunks to keep every thread busy. */
    int64_t groups = (2 * threads + B * chunks - 1) / (B * chunks);
    if (groups > nblocks) groups = nblocks;
    if (groups < 1) groups = 1;
    const int64_t per_group = (nblocks + groups - 1) / groups;
    const size_t esize = out_bf16 ? 2 : 4;
    const int stream = !accumulate && (uintptr_t)out % 64 == 0 && ldo * esize % 64 == 0; /* whole lines a block */
#pragma omp parallel num_threads(threads)
    {
        const int tid = thread_id();
        uint16_t *planes = scratch + tid * stride;
        load_tile_config();
        float acc[32 * 32] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic)
        for (int64_t job = 0; job < B * chunks * groups; job++) {
            const int64_t b = job / (chunks * groups), chunk = job / groups % chunks, group = job % groups;
            const int64_t m0 = chunk * mchunk, m1 = m0 + mchunk < row_blocks * 32 ? m0 + mchunk : row_blocks * 32;
            const int64_t nb1 = (group + 1) * per_group < nblocks ? (group + 1) * per_group : nblocks;
            split_rows(x, ldx, left, H, alpha, scale, snake_left, x_bf16, b, TI, m0, m1 - m0 + halo, C, CP, parts,
                       planes, plane);
            char *out0 = (char *)out + (b * TO + m0) * ldo * esize;
            job_blocks(planes, CP, K, dil, parts, plane, w, group * per_group, nb1, m0, m1, TO, N, bias, out0, ldo,
                       out_bf16, accumulate ? out0 : 0, stream, acc);
        }
        _tile_release();
        if (stream) _mm_sfence(); /* the streamed lines out before the caller reads them */
    }
}

/* A vocoder residual unit's two convolutions in one pass: h = conv1(snake1([left; x])) + bias1 (C -> C, `taps`
 * taps at `dil`, as amx_conv computes and stores it, rounded to x's type), then out = x + conv2(snake2(h)) + bias2
 * (one tap, C -> C, as amx_conv accumulates it into a residual x), so out has amx_conv's bits twice over (out is
 * not x: later jobs still read the rows of x before their own). Each job (up to `mchunk` rows of one batch item)
 * computes all of conv1's outputs for its rows into the thread's buffer and feeds them straight to conv2: h never
 * goes through memory (written and read back it is most of a 96-channel kernel-1 convolution's time). conv2's
 * sums take x's rows as they store (no copy of x into out first) and stream out past the cache (store_row;
 * residual units 0.91-0.96x the time at 32-256 channels, float32 and bfloat16). Scratch
 * per thread (`stride` uint16): conv1's planes ((mchunk + (taps - 1) dil) * CP * parts), conv2's (mchunk * CP *
 * parts), h (mchunk * C * 2). */
__attribute__((target("amx-tile,amx-bf16"))) void amx_unit(
    int64_t B, int64_t TI, int64_t TO, int64_t C, int64_t CP, int64_t taps, int64_t dil, const void *x,
    const void *left, int64_t H, const float *alpha1, const float *scale1, int x_bf16, const uint16_t *w1,
    const float *bias1, const float *alpha2, const float *scale2, const uint16_t *w2, const float *bias2, void *out,
    int64_t mchunk, uint16_t *scratch, int64_t stride, int threads) {
    const int parts = x_bf16 ? 1 : 3;
    const int64_t K = taps * CP, nblocks = (C + 31) / 32, halo = (taps - 1) * dil;
    const int64_t row_blocks = (TO + 31) / 32, chunks = (row_blocks + mchunk / 32 - 1) / (mchunk / 32);
    const int64_t plane = (mchunk + halo) * CP, plane2 = mchunk * CP;
    const size_t esize = x_bf16 ? 2 : 4;
    const int stream = (uintptr_t)out % 64 == 0 && C * esize % 64 == 0;
#pragma omp parallel num_threads(threads)
    {
        const int tid = thread_id();
        uint16_t *planes = scratch + tid * stride, *planes2 = planes + plane * parts;
        char *h = (char *)(planes2 + plane2 * parts);
        load_tile_config();
        float acc[32 * 32] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic)
        for (int64_t job = 0; job < B * chunks; job++) {
            const int64_t b = job / chunks, m0 = job % chunks * mchunk;
            const int64_t m1 = m0 + mchunk < row_blocks * 32 ? m0 + mchunk : row_blocks * 32;
            split_rows(x, C, left, H, alpha1, scale1, 0, x_bf16, b, TI, m0, m1 - m0 + halo, C, CP, parts, planes,
                       plane);
            job_blocks(planes, CP, K, dil, parts, plane, w1, 0, nblocks, m0, m1, TO, C, bias1, h, C, x_bf16, 0, 0, acc);
            for (int64_t r = 0; r < m1 - m0; r++) {
                if (m0 + r < TO) {
                    split_row(h + r * C * esize, x_bf16, C, CP, parts, planes2 + r * 32, plane2, mchunk * 32, alpha2,
                              scale2);
                } else {
                    zero_row(planes2 + r * 32, CP, parts, plane2, mchunk * 32);
                }
            }
            const int64_t at = (b * TO + m0) * C * esize; /* x's rows are the residual */
            job_blocks(planes2, CP, CP, 1, parts, plane2, w2, 0, nblocks, m0, m1, TO, C, bias2, (char *)out + at, C,
                       x_bf16, (const char *)x + at, stream, acc);
        }
        _tile_release();
        if (stream) _mm_sfence();
    }
}

/* acc [16][32] float32 for up to 16 rows (one linear layer's few rows, `plane` elements between parts): as
 * block_32x32 with half the rows, the same sums in the same order. */
static inline __attribute__((target("amx-tile,amx-bf16"))) void block_16x32(
    const uint16_t *a, int64_t CP, int64_t lda, int parts, int64_t plane, const uint16_t *wb, float *acc) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < CP; k += 32) {
        const uint16_t *wk = wb + k * 32;
        prefetch_step(wk);
        _tile_loadd(6, wk, 128);
        _tile_loadd(7, wk + 32, 128);
        for (int p = 0; p < parts; p++) {
            _tile_loadd(4, a + p * plane + k, lda * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    _tile_stored(0, acc, 128);
    _tile_stored(1, acc + 16, 128);
}

/* float32 rows with their three parts as rows of their own (`part_rows`): a group of up to PART_GROUP rows is
 * 3 * count plane rows, part p of row i at plane row p * count + i (so one 16-row tile holds all parts of up to 5
 * rows), and a row's product is (hi.w + mid.w) + lo.w, each part summed over k on its own. A tile's rows never mix,
 * so a row's bits do not depend on its batch mates at any count; few rows take a third of the interleaved parts'
 * tile products (1 row: 2 products per 32 inputs and 32 outputs, not 6). `seg`: the group's planes; acc: [48][32]
 * float32, then the count rows' sums. */
#define PART_GROUP 16
#define PART_SEG ((3 * PART_GROUP + 15) / 16 * 16) /* plane rows of a group */
static inline __attribute__((target("amx-tile,amx-bf16"))) void block_part_rows(
    const uint16_t *seg, int64_t count, int64_t CP, int64_t lda, const uint16_t *wb, float *acc) {
    const int64_t T = (3 * count + 15) / 16;
    if (T == 1) { /* one tile of rows: block_16x32's sums */
        block_16x32(seg, CP, lda, 1, 0, wb, acc);
    } else if (T == 2) { /* two tiles of rows: block_32x32's sums */
        block_32x32(seg, CP, lda, 32, CP, 1, 1, 0, wb, acc, 1);
    } else { /* three A tiles: accumulators t (outputs 0-15) and 3 + t (16-31); the A and B tiles take turns
              * in tiles 6 and 7, each A tile loaded twice per k (the second time from L1) */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        for (int64_t k = 0; k < CP; k += 32) {
            const uint16_t *wk = wb + k * 32, *ak = seg + k;
            prefetch_step(wk);
#define HALF(outputs, a0, a1, a2) /* 16 outputs' B tile, then the three A tiles into accumulators a0-a2 */   \
    _tile_loadd(7, wk + (outputs), 128);                                                                       \
    _tile_loadd(6, ak, lda * 2);                                                                               \
    _tile_dpbf16ps(a0, 6, 7);                                                                                  \
    _tile_loadd(6, ak + 16 * lda, lda * 2);                                                                    \
    _tile_dpbf16ps(a1, 6, 7);                                                                                  \
    _tile_loadd(6, ak + 32 * lda, lda * 2);                                                                    \
    _tile_dpbf16ps(a2, 6, 7);
            HALF(0, 0, 1, 2)
            HALF(32, 3, 4, 5)
#undef HALF
        }
        _tile_stored(0, acc, 128);
        _tile_stored(1, acc + 16 * 32, 128);
        _tile_stored(2, acc + 32 * 32, 128);
        _tile_stored(3, acc + 16, 128);
        _tile_stored(4, acc + 16 * 32 + 16, 128);
        _tile_stored(5, acc + 32 * 32 + 16, 128);
    }
    for (int64_t i = 0; i < count; i++)
        for (int c = 0; c < 32; c += 16) {
            const __m512 hi = _mm512_loadu_ps(acc + i * 32 + c), mid = _mm512_loadu_ps(acc + (count + i) * 32 + c);
            const __m512 lo = _mm512_loadu_ps(acc + (2 * count + i) * 32 + c);
            _mm512_storeu_ps(acc + i * 32 + c, _mm512_add_ps(_mm512_add_ps(hi, mid), lo));
        }
}

/* Up to PART_GROUP float32 rows (C values, CP padded) as block_part_rows' planes at seg (rows lda apart): part p
 * of row i at plane row p * count + i, zero rows up to the tiles' end. */
static inline void split_part_rows(const void *const *rows, int64_t count, int64_t C, int64_t CP, int64_t lda,
                                   uint16_t *seg) {
    for (int64_t i = 0; i < count; i++) split_row(rows[i], 0, C, CP, 3, seg + i * lda, count * lda, 32, 0, 0);
    memset(seg + 3 * count * lda, 0, (size_t)((3 * count + 15) / 16 * 16 - 3 * count) * lda * 2);
}

/* A linear layer inside the caller's parallel region (cpu_kernels.c's decoder kernels, as quant_kernels.c's
 * phases): every thread of the region calls it. Each thread splits the M rows (pointers, float32 or bfloat16)
 * into its own planes (`scratch`, amx_kernels.phase_scratch: no barrier before the product), then the 32 x 32
 * output blocks (16 x 32 for up to 16 rows: the same sums) are shared out (an orphaned omp for, ending in its
 * barrier). float32 rows with `part_rows` (the decoder kernels: any row count takes it) are summed part by part
 * (block_part_rows), otherwise as amx_conv sums them. w: the weight's words (data address, N, CP, C); out's rows
 * ldo apart; add: out += the product, rounded to out's type first. */
__attribute__((target("amx-tile,amx-bf16"))) void amx_phase_linear(
    const int64_t *w, int64_t M, const void *const *rows, int x_bf16, void *out, int64_t ldo, int out_bf16,
    int add, uint16_t *scratch, int part_rows) {
    const uint16_t *data = (const uint16_t *)w[0];
    const int64_t N = w[1], CP = w[2], C = w[3];
    const int parts = x_bf16 ? 1 : 3, by_part = parts == 3 && part_rows;
    const int64_t lda = CP + 32; /* plane rows 64 bytes longer than a row: 1024-channel rows 2 KB apart shared two
                                  * L1 sets */
    const int64_t MP = by_part ? (M + PART_GROUP - 1) / PART_GROUP * PART_SEG : M <= 16 ? 16 : (M + 31) / 32 * 32;
    const int64_t plane = MP * lda, group_rows = by_part ? PART_GROUP : 32, groups = (M + group_rows - 1) / group_rows;
    if (by_part) {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t count = M - g * PART_GROUP < PART_GROUP ? M - g * PART_GROUP : PART_GROUP;
            split_part_rows(rows + g * PART_GROUP, count, C, CP, lda, scratch + g * PART_SEG * lda);
        }
    } else {
        for (int64_t r = 0; r < MP; r++) {
            if (r < M) {
                split_row(rows[r], x_bf16, C, CP, parts, scratch + r * lda, plane, 32, 0, 0);
            } else {
                for (int p = 0; p < parts; p++) memset(scratch + p * plane + r * lda, 0, (size_t)CP * 2);
            }
        }
    }
    load_tile_config();
    float acc[PART_SEG * 32] __attribute__((aligned(64)));
    const int64_t nblocks = (N + 31) / 32;
    const size_t esize = out_bf16 ? 2 : 4;
#pragma omp for schedule(static)
    for (int64_t job = 0; job < nblocks * groups; job++) {
        const int64_t nb = job / groups, m = job % groups * group_rows, n0 = nb * 32;
        const int64_t count = M - m < group_rows ? M - m : group_rows, cols = N - n0 < 32 ? N - n0 : 32;
        if (by_part)
            block_part_rows(scratch + m / PART_GROUP * PART_SEG * lda, count, CP, lda, data + nb * CP * 32, acc);
        else if (MP == 16)
            block_16x32(scratch, CP, lda, parts, plane, data + nb * CP * 32, acc);
        else
            block_32x32(scratch + m * lda, CP, lda, 32, CP, 1, parts, plane, data + nb * CP * 32, acc, 0);
        for (int64_t r = 0; r < count; r++) {
            char *o = (char *)out + ((m + r) * ldo + n0) * esize;
            store_row(acc + r * 32, 0, add ? o : 0, o, out_bf16, cols, 0);
        }
    }
    _tile_release();
}

/* The routed experts of a MoE layer, float32 rows, inside the decoder kernels' parallel region (every thread calls
 * it; cpu_kernels.c's moe_phases_f32p computes the same layer on its FMA panels): the experts' bfloat16 pair panels
 * are AMX B tiles as they are (gate/up panel p: 16 gate then 16 up outputs [H/2][32][2]; down panel q: 32 hidden
 * outputs [I/2][32][2]), and each expert's rows are split once per thread (part by part, block_part_rows: a row's
 * bits do not depend on its batch mates) for all of the thread's panels. A thread takes a fixed share of each
 * phase's panels; its down outputs (columns) are its own, so each token's experts add up there in expert order
 * with no buffer per selection. Where experts see a few rows each (16 tokens, top-4 of 16 experts: ~4), the
 * FMA panels are compute-bound; 1-row experts are memory-bound on both (cpu_kernels.py chooses per layer).
 *   dims: T tokens, K selections a token, E experts, H (x's row length, a multiple of 32), HP (out's), I (the
 *   intermediate, a multiple of 32); x [T, H] float32; order / starts: the selections sorted by expert; weights
 *   [T K] float32 routing weights; w13 [E, I/16, H/2, 32, 2], w2 [E, HP/32, I/2, 32, 2] bfloat16; out [T, HP]
 *   float32 (written); h [T K, I] float32 scratch; scratch: this thread's planes (PART_SEG * (max(H, I) + 32)
 *   bfloat16 values). Ends with a barrier. */
__m512 _ZGVeN16v_expf(__m512 x); /* glibc's 16-lane expf (libmvec) */

/* SwiGLU of 16 gate and 16 up values: g / (1 + e^-g) u. */
static inline __m512 silu_mul(__m512 g, __m512 u) {
    const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

static inline void share(int64_t n, int tid, int threads, int64_t *first, int64_t *last) {
    const int64_t per = n / threads, extra = n % threads;
    *first = tid * per + (tid < extra ? tid : extra);
    *last = *first + per + (tid < extra);
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_phase_experts(
    const int64_t *dims, const float *x, const int64_t *order, const int64_t *starts, const float *weights,
    const uint16_t *w13, const uint16_t *w2, float *out, float *h, uint16_t *scratch, int tid, int threads) {
    const int64_t T = dims[0], K = dims[1], E = dims[2], H = dims[3], HP = dims[4], I = dims[5];
    const int64_t up_panels = I / 16, down_panels = HP / 32;
    const void *rows[PART_GROUP];
    float acc[PART_SEG * 32] __attribute__((aligned(64)));
    int64_t p0, p1;
    load_tile_config();
    /* gate/up, then SwiGLU into h (16 intermediates a panel) */
    share(up_panels, tid, threads, &p0, &p1);
    const int64_t lda = H + 32;
    for (int64_t e = 0; p0 < p1 && e < E; e++)
        for (int64_t g = starts[e]; g < starts[e + 1]; g += PART_GROUP) {
            const int64_t count = starts[e + 1] - g < PART_GROUP ? starts[e + 1] - g : PART_GROUP;
            for (int64_t j = 0; j < count; j++) rows[j] = x + order[g + j] / K * H;
            split_part_rows(rows, count, H, H, lda, scratch);
            for (int64_t p = p0; p < p1; p++) {
                block_part_rows(scratch, count, H, lda, w13 + (e * up_panels + p) * H * 32, acc);
                for (int64_t j = 0; j < count; j++)
                    _mm512_storeu_ps(h + (g + j) * I + p * 16,
                                     silu_mul(_mm512_loadu_ps(acc + j * 32), _mm512_loadu_ps(acc + j * 32 + 16)));
            }
        }
#pragma omp barrier
    /* down, times each selection's routing weight, added up per token in expert order (this thread's columns) */
    share(down_panels, tid, threads, &p0, &p1);
    for (int64_t t = 0; t < T; t++) memset(out + t * HP + p0 * 32, 0, (size_t)(p1 - p0) * 32 * sizeof(float));
    const int64_t ldh = I + 32;
    for (int64_t e = 0; p0 < p1 && e < E; e++)
        for (int64_t g = starts[e]; g < starts[e + 1]; g += PART_GROUP) {
            const int64_t count = starts[e + 1] - g < PART_GROUP ? starts[e + 1] - g : PART_GROUP;
            for (int64_t j = 0; j < count; j++) rows[j] = h + (g + j) * I;
            split_part_rows(rows, count, I, I, ldh, scratch);
            for (int64_t p = p0; p < p1; p++) {
                block_part_rows(scratch, count, I, ldh, w2 + (e * down_panels + p) * I * 32, acc);
                for (int64_t j = 0; j < count; j++) {
                    const int64_t sel = order[g + j];
                    float *o = out + sel / K * HP + p * 32;
                    const __m512 wsel = _mm512_set1_ps(weights[sel]);
                    for (int c = 0; c < 32; c += 16)
                        _mm512_storeu_ps(o + c, _mm512_add_ps(_mm512_loadu_ps(o + c),
                                                              _mm512_mul_ps(_mm512_loadu_ps(acc + j * 32 + c), wsel)));
                }
            }
        }
    _tile_release();
#pragma omp barrier
}

/* A stream's next left context for a convolution whose kernel activates its inputs (amx_conv, amx_unit): kept
 * [B, H, C] = rows valid[b] .. valid[b] + H - 1 of item b's [left; SnakeBeta(x)] (left [B, H, C] as it is, x [B,
 * T, C]; x's dtype), activated by split_row's arithmetic, so the next chunk reads the values one-shot decoding's
 * kernel activates. In Python (gathers and a compiled SnakeBeta) it was ~2% of a streamed chunk's decode. */
void snake_kept(int64_t B, int64_t H, int64_t T, int64_t C, const void *left, const void *x, const int64_t *valid,
                const float *alpha, const float *scale, int x_bf16, void *kept) {
    const size_t esize = x_bf16 ? 2 : 4;
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < H; r++) {
            const int64_t e = valid[b] + r;
            char *dst = (char *)kept + (b * H + r) * C * esize;
            if (e < H) {
                memcpy(dst, (const char *)left + (b * H + e) * C * esize, (size_t)C * esize);
                continue;
            }
            const char *src = (const char *)x + (b * T + e - H) * C * esize;
            for (int64_t c = 0; c < C; c += 16) {
                const __mmask16 m = (__mmask16)(C - c >= 16 ? 0xffffu : (1u << (C - c)) - 1u);
                const __m512 v = snake16(load16(src + c * esize, x_bf16, m), alpha + c, scale + c, m, !x_bf16);
                if (x_bf16) /* rounded as split_row's single part */
                    _mm256_mask_storeu_epi16((uint16_t *)dst + c, m, (__m256i)_mm512_cvtneps_pbh(v));
                else
                    _mm512_mask_storeu_ps((float *)dst + c, m, v);
            }
        }
}

/* A linear layer over few rows (amx_kernels.linear: the decode rows of an output head) in a region of its own:
 * amx_phase_linear splits the rows once per thread, where amx_conv's jobs would each split theirs again (one
 * job per 32 outputs: 4752 splits of the same row for a 152064-word vocabulary). `scratch`: `stride` bfloat16
 * values per thread (amx_kernels.phase_scratch). */
__attribute__((target("amx-tile,amx-bf16"))) void amx_linear_rows(
    const int64_t *w, int64_t M, const void *const *rows, int x_bf16, void *out, int out_bf16, uint16_t *scratch,
    int64_t stride, int threads, int part_rows) {
#pragma omp parallel num_threads(threads)
    amx_phase_linear(w, M, rows, x_bf16, out, w[1], out_bf16, 0, scratch + (int64_t)thread_id() * stride, part_rows);
}
#endif
