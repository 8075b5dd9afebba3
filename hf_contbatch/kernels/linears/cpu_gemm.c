/* GEMM for the small row counts of serving steps: y[M][N] = x[M][K] . W^T (+ bias), float32 and,
 * on CPUs with AVX512-BF16, bfloat16 with float32 accumulation.
 *
 * Built on first use by hf_contbatch/kernels/linears/native_gemm.py with the system C compiler
 * (-O3 -march=native -fopenmp, no -ffast-math) and called through ctypes on torch's own OpenMP
 * runtime.
 *
 * Why our own: a decode step multiplies a few to a few dozen rows by every weight of the model, so
 * it streams the weights from memory once per step, and is bound by how fast the weights stream.
 * oneDNN's brgemm (what torch offers) reads them below the memory's bandwidth at these row counts
 * on some CPUs; this kernel streams them close to it (benchmarks/bench_gemm.py compares the two,
 * and the engine times both on the CPU at hand before choosing: kernels/linears/autotune.py).
 *
 * The layout and loop nest follow the BLIS/GotoBLAS design (Goto & van de Geijn, "Anatomy of
 * High-Performance Matrix Multiplication", ACM TOMS 2008; the 6x16 register tile of BLIS's
 * Haswell kernel, two vectors wide): W is packed once into panels of NR output columns (two
 * vectors: 32 with AVX-512, 16 with 256-bit vectors), [ceil(N/NR)][K][NR] (zero columns pad the
 * last panel), so a panel streams sequentially. Threads take whole panels (each weight byte is read
 * by one thread); inside a panel, rows go in blocks of at most MB, the panel in slices of KC input
 * features that stay in L1 while every row tile of up to MR rows passes over them with 2 x MR vector
 * accumulators (MR = 10 of AVX-512's 32 registers; 6 of AVX2's 16, with tiles of 7 rows for 7 and
 * 13-14 rows). One to three rows (a
 * notebook's single request, the end of a batch) take a narrow path whose tiles span 2-4 panels
 * instead (see NARROW).
 *
 * Exactness (float32): each output is one fused multiply-add chain over k = 0..K-1 in order (no
 * reassociation: compiled without -ffast-math), whatever M, the row's position in the batch, the
 * tile it lands in, the other columns packed beside it, or the vector width. So a row's result does
 * not depend on the batch it runs in, sibling projections packed together (q/k/v) give the bits
 * they give apart, and the AVX-512 build gives the bits of the 256-bit one.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* One vector of VW floats; aligned(4) lets loads and stores be unaligned. GCC/Clang vector
 * extensions compile to AVX-512 (VW 16) or AVX2/FMA (VW 8) with -march=native on x86, and to NEON
 * on arm64. */
#if defined(__AVX512F__)
#define VW 16
#define GEMM_ISA "avx512f"
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
#define GEMM_ISA "avx2"
#elif defined(__ARM_NEON)
#define VW 8
#define GEMM_ISA "neon"
#else
#define VW 8
#define GEMM_ISA "generic"
#endif
typedef float v8 __attribute__((vector_size(VW * 4), aligned(4)));

#define NR (2 * VW) /* output columns per panel: two vectors */
/* rows per register tile: MR x 2 accumulators + 2 weight vectors + 1 broadcast must fit the vector
 * registers (32 with AVX-512: 10 rows; 16 with AVX2: 6, with 7-row tiles where they save a pass) */
#if VW == 16
#define MR 10
#else
#define MR 6
#endif
#define MB 96       /* rows per block: their accumulators stay in L1 */
/* input features per panel slice: KC x NR floats (16 KB with AVX-512, 16 KB with 256-bit vectors),
 * in L1 for every row tile, with room for the next slice being prefetched (a 32 KB AVX-512 slice and
 * its successor would not fit a 48 KB L1 together) */
#if VW == 16
#define KC 128
#else
#define KC 256
#endif

/* What this build is: the output columns per packed panel, and the instruction set its vectors
 * compile to (the Python side sizes packed weights with the first, and reports the second). */
int64_t hf_contbatch_gemm_nr(void) { return NR; }
const char *hf_contbatch_gemm_isa(void) { return GEMM_ISA; }

void hf_contbatch_gemm_pack_f32(const float *w, int64_t n, int64_t k, float *out) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                out[(p * k + kk) * NR + j] = col < n ? w[col * k + kk] : 0.f;
            }
}

/* Rows per block for an m-row call with k input features: the block's x rows (rows x k floats) stay in
 * L2 while the thread's panels stream past them, so x is read from memory once, and the weights once
 * per block. One block up to MB rows; beyond, blocks of MB rows, fewer where MB rows of x would not fit X_L2_BYTES (a budget
 * that leaves room in a 1 MB L2 for the weight slices streaming through), but at least MB_MIN rows:
 * below that the weights, read again for every block, would cost more than x did. */
#define X_L2_BYTES (384 * 1024)
#define MB_MIN 40
static int64_t row_block(int64_t m, int64_t row_bytes, int64_t mr) {
    if (m <= MB) return m; /* one block: each weight read once */
    int64_t mb = X_L2_BYTES / (row_bytes > 0 ? row_bytes : 1);
    mb = mb / mr * mr;
    return mb > MB ? MB : mb < MB_MIN ? MB_MIN : mb;
}

/* ---- weight loads: VW float32 weights from VW stored ones ------------------------------------------
 *
 * The same tiles serve float32 weights and half-precision ones widened to float32 in registers:
 * bfloat16 is the top half of a float32, so widening is a zero extension and a 16-bit shift
 * (exact, any CPU with vectors); float16 goes through F16C / AVX-512's VCVTPH2PS (exact too). The
 * products and sums are float32 FMAs in the same order as for float32 weights, so a half-precision
 * weight gives the bits the float32 kernel gives on its widened copy, with half the bytes to
 * stream (decode reads every weight once a step: half the bytes is up to twice the speed). */
typedef uint16_t vh __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
static inline v8 load_w_f32(const float *p) { return *(const v8 *)p; }
/* explicit on x86: GCC's tuning for 256-bit vectors splits the generic form into halves */
static inline v8 load_w_wbf16(const uint16_t *p) {
#if VW == 16
    return (v8)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__)
    return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    return (v8)(__builtin_convertvector(*(const vh *)p, vu) << 16);
#endif
}
#if defined(__F16C__) && (VW == 16 || (VW == 8 && defined(__AVX2__)))
#define HAS_F16 1
static inline v8 load_w_wf16(const uint16_t *p) {
#if VW == 16
    return (v8)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#endif
}
#else
#define HAS_F16 0
#endif

/* float32 <-> the 16-bit formats, one value (x rows in, y rows out): round to nearest even */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t to_bf16(float f) { /* NaN kept a NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

enum { OUT_F32, OUT_BF16, OUT_F16 };

/* y row segment (cols outputs from column col0) = acc (+ bias), in the output's format */
static inline void store_row(void *y, int kind, int64_t off, const float *acc, const float *bias, int64_t col0,
                             int64_t cols) {
    if (kind == OUT_F32) {
        float *yr = (float *)y + off;
        if (bias)
            for (int64_t j = 0; j < cols; j++) yr[j] = acc[j] + bias[col0 + j];
        else
            memcpy(yr, acc, sizeof(float) * (size_t)cols);
        return;
    }
    uint16_t *yr = (uint16_t *)y + off;
    for (int64_t j = 0; j < cols; j++) {
        const float v = bias ? acc[j] + bias[col0 + j] : acc[j];
#if HAS_F16
        yr[j] = kind == OUT_BF16 ? to_bf16(v) : _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
#else
        yr[j] = to_bf16(v);
#endif
    }
}

/* acc[r][0..NR-1] += sum over kk < kc of x[r][kk] * w[kk][0..NR-1], for r < ROWS; the weights of
 * type WT, widened by load_w_T (f32: as stored; wbf16, wf16: widened).
 * PREFETCH: a thread's panels lie one after another in memory and it walks their slices in order,
 * so the line one slice (KC x NR weights) ahead is the same position in the next slice, of this
 * panel or of its next one. Fetching it while the current slice is multiplied hides the memory latency of the
 * first pass over each slice (better than 1 KB ahead at 16-32 rows, no worse at 64). Every line of
 * it: fetching only the first of a float32 row's two lines left 4-16 rows at 41-67% of the copy
 * bandwidth, both lines 52-87% (one thread, SmolLM2-360M's shapes, A/B in one process). */
#define TILE(T, WT, ROWS)                                                                           \
    static inline void tile_##T##_##ROWS(const float *x, int64_t ldx, const WT *w, int64_t kc, float *acc) { \
        v8 a[ROWS][2];                                                                              \
        for (int r = 0; r < ROWS; r++) {                                                            \
            a[r][0] = *(const v8 *)(acc + r * NR);                                                  \
            a[r][1] = *(const v8 *)(acc + r * NR + VW);                                              \
        }                                                                                           \
        for (int64_t kk = 0; kk < kc; kk++) {                                                       \
            const v8 w0 = load_w_##T(w + kk * NR), w1 = load_w_##T(w + kk * NR + VW);               \
            /* the next slice (PREFETCH); integer arithmetic: it may lie past the buffer's end */ \
            __builtin_prefetch((const void *)((uintptr_t)w + (uintptr_t)((kk + KC) * NR * sizeof(WT)))); \
            if (NR * sizeof(WT) > 64) /* a float32 AVX-512 row of the panel is two lines: both */ \
                __builtin_prefetch((const void *)((uintptr_t)w + (uintptr_t)((kk + KC) * NR * sizeof(WT) + 64))); \
            for (int r = 0; r < ROWS; r++) {                                                        \
                const float xv = x[r * ldx + kk];                                                   \
                a[r][0] += xv * w0;                                                                 \
                a[r][1] += xv * w1;                                                                 \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < ROWS; r++) {                                                            \
            *(v8 *)(acc + r * NR) = a[r][0];                                                        \
            *(v8 *)(acc + r * NR + VW) = a[r][1];                                                    \
        }                                                                                           \
    }

/* 1-3 rows: a tile of ROWS rows gives only 2 * ROWS multiply-add chains, and each chain waits
 * for its previous FMA (several cycles of latency), so a one-panel tile runs at a fraction of the
 * FMA throughput. These tiles span G panels instead (8-12 accumulators), over all of K at once.
 * Each output is still one in-order FMA chain over k, so the bits equal those of the general path.
 * Prefetch: each panel's stream one slice (KC features) ahead, as there. With them 1-3 rows read
 * the weights about as fast as the memory gives them (benchmarks/bench_gemm.py). */
#define NARROW(T, WT, ROWS, G)                                                                        \
    static inline void narrow_##T##_##ROWS##_##G(const float *x, int64_t k, const WT *w, float *out) { \
        v8 a[ROWS][G][2];                                                                             \
        for (int r = 0; r < ROWS; r++)                                                                \
            for (int g = 0; g < G; g++) a[r][g][0] = a[r][g][1] = (v8){0};                             \
        for (int64_t kk = 0; kk < k; kk++) {                                                          \
            v8 w0[G], w1[G];                                                                          \
            for (int g = 0; g < G; g++) {                                                             \
                const WT *wg = w + (g * k + kk) * NR;                                                 \
                w0[g] = load_w_##T(wg);                                                               \
                w1[g] = load_w_##T(wg + VW);                                                          \
                __builtin_prefetch((const void *)((uintptr_t)wg + (uintptr_t)(KC * NR * sizeof(WT)))); \
            }                                                                                         \
            for (int r = 0; r < ROWS; r++) {                                                          \
                const float xv = x[r * k + kk];                                                       \
                for (int g = 0; g < G; g++) {                                                         \
                    a[r][g][0] += xv * w0[g];                                                         \
                    a[r][g][1] += xv * w1[g];                                                         \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        for (int r = 0; r < ROWS; r++)                                                                \
            for (int g = 0; g < G; g++) {                                                             \
                *(v8 *)(out + (r * G + g) * NR) = a[r][g][0];                                         \
                *(v8 *)(out + (r * G + g) * NR + VW) = a[r][g][1];                                     \
            }                                                                                         \
    }

/* Rows the narrow path takes. Wider tiles for 4-6 rows (2 panels, 24 accumulators with AVX-512)
 * measured no different from the one-panel tiles once those prefetch every line (bench A/B, 1
 * thread, medium shapes), so they are left out. */
#define NARROW_MAX 3

/* m <= NARROW_MAX rows: threads take groups of G panels (G = 4 for one row, else 2); a last group of
 * fewer panels goes one panel at a time. out: acc [m][G][NR] per group, stored to y with bias. */
#define GEMM_NARROW(T, WT)                                                                             \
    static void gemm_narrow_##T(const float *x, int64_t m, int64_t k, const WT *packed, int64_t n,      \
                                const float *bias, void *y, int out_kind, int64_t num_threads) {       \
        const int64_t panels = (n + NR - 1) / NR, G = m == 1 ? 4 : 2;                                  \
        const int64_t groups = (panels + G - 1) / G;                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                          \
        for (int64_t gi = 0; gi < groups; gi++) {                                                      \
            float acc[NARROW_MAX * 2 * NR] __attribute__((aligned(64))); /* >= 1 row x 4 panels */     \
            const int64_t p0 = gi * G, np = panels - p0 < G ? panels - p0 : G;                         \
            const WT *w = packed + p0 * k * NR;                                                        \
            if (np == G) {                                                                             \
                switch (m) {                                                                           \
                    case 1: narrow_##T##_1_4(x, k, w, acc); break;                                     \
                    case 2: narrow_##T##_2_2(x, k, w, acc); break;                                     \
                    default: narrow_##T##_3_2(x, k, w, acc); break;                                    \
                }                                                                                      \
            } else {                                                                                   \
                for (int64_t g = 0; g < np; g++) {                                                     \
                    float one[NARROW_MAX * NR] __attribute__((aligned(64)));                           \
                    const WT *wg = w + g * k * NR;                                                     \
                    switch (m) {                                                                       \
                        case 1: narrow_##T##_1_1(x, k, wg, one); break;                                \
                        case 2: narrow_##T##_2_1(x, k, wg, one); break;                                \
                        default: narrow_##T##_3_1(x, k, wg, one); break;                               \
                    }                                                                                  \
                    for (int64_t r = 0; r < m; r++)                                                    \
                        memcpy(acc + (r * G + g) * NR, one + r * NR, sizeof(float) * NR);              \
                }                                                                                      \
            }                                                                                          \
            for (int64_t r = 0; r < m; r++)                                                            \
                for (int64_t g = 0; g < np; g++) {                                                     \
                    const int64_t col0 = (p0 + g) * NR, cols = n - col0 < NR ? n - col0 : NR;          \
                    store_row(y, out_kind, r * n + col0, acc + (r * G + g) * NR, bias, col0, cols);    \
                }                                                                                      \
        }                                                                                              \
    }

/* x [m][k] row-major float32, packed panels of WT weights ([ceil(n/NR)][k][NR]), bias [n] or NULL,
 * y [m][n] row-major in the out_kind format.
 * Loop order (4+ rows): row blocks outermost, each thread's panels inside (the same panels for every
 * block: a static schedule over the same count), so a block of x is reused from L2 by every panel of
 * the thread; a panel's k-slices inside that, each in L1 while every row tile passes over it. With
 * panels outermost (each thread's panel against all of x), x was read from memory or L3 once per
 * panel as soon as it outgrew L2 (1,024 prefill rows of 960 features are 3.9 MB): 15-25% slower.
 * Tiles of near-equal height (32 rows with MR 6: 6+6+5+5+5+5, not 6x5+2). With 256-bit vectors,
 * tiles of up to 7 rows (14 accumulators; the weights become FMA memory operands) where that saves a
 * pass over each slice and there are at most 14 rows: 7 rows in one tile instead of 4+3, 13-14 in
 * two instead of three. At more rows the 7-row tile's loads of the weights cost more than the saved
 * passes. */
#if VW == 16
#define TILE_COUNT(rows) (((rows) + MR - 1) / MR)
#else
#define TILE_COUNT(rows)                                                                                \
    ((rows) <= 2 * (MR + 1) && ((rows) + MR) / (MR + 1) < ((rows) + MR - 1) / MR ? ((rows) + MR) / (MR + 1) \
                                                                                 : ((rows) + MR - 1) / MR)
#endif
/* The row tiles of a block over one k-slice W (of weight type T): heights as TILE_COUNT splits them. */
#define TILES(T, W)                                                                                     \
    {                                                                                                   \
        int64_t r0 = 0;                                                                                 \
        for (int64_t t = 0; t < tiles; t++) {                                                           \
            const int64_t left = rows - r0, h = (left + (tiles - t) - 1) / (tiles - t);                 \
            const float *xt = x + (row0 + r0) * k + k0;                                                 \
            float *at = acc + r0 * NR;                                                                  \
            switch (h) {                                                                                \
                case 1: tile_##T##_1(xt, k, W, kc, at); break;                                          \
                case 2: tile_##T##_2(xt, k, W, kc, at); break;                                          \
                case 3: tile_##T##_3(xt, k, W, kc, at); break;                                          \
                case 4: tile_##T##_4(xt, k, W, kc, at); break;                                          \
                case 5: tile_##T##_5(xt, k, W, kc, at); break;                                          \
                case 6: tile_##T##_6(xt, k, W, kc, at); break;                                          \
                case 7: tile_##T##_7(xt, k, W, kc, at); break;                                          \
                case 8: tile_##T##_8(xt, k, W, kc, at); break;                                          \
                case 9: tile_##T##_9(xt, k, W, kc, at); break;                                          \
                default: tile_##T##_10(xt, k, W, kc, at); break;                                        \
            }                                                                                           \
            r0 += h;                                                                                    \
        }                                                                                               \
    }

/* WIDEN_ONCE: half-precision weights under a block of WIDEN_ONCE_ROWS rows or more (prefill) are
 * widened once per k-slice into a float32 copy in L1 (KC x NR floats, 16 KB) that every row tile then
 * reads with the float32 tiles, instead of each tile widening the same values again: the slice's
 * conversions are paid once per block rather than once per tile. The values and the FMA order are
 * the same, so the bits are too. Fewer rows widen in their loads: with two to four tiles the copy's
 * writes and reads cost more than the conversions they save (bf16, SmolLM2-360M's shapes, one
 * thread, A/B in one process: 0.74-1.0x at 11-32 rows, 1.03-1.11x at 64-512 rows). */
#define WIDEN_ONCE_ROWS 48
#define WIDEN_ONCE_f32 0
#define WIDEN_ONCE_wbf16 1
#define WIDEN_ONCE_wf16 1
#define WIDEN_SLICE(T, WT)                                                                              \
    static inline void widen_slice_##T(const WT *w, int64_t kc, float *dst) {                           \
        for (int64_t kk = 0; kk < kc; kk++) {                                                           \
            *(v8 *)(dst + kk * NR) = load_w_##T(w + kk * NR);                                           \
            *(v8 *)(dst + kk * NR + VW) = load_w_##T(w + kk * NR + VW);                                 \
            /* the next slice, as the tiles' PREFETCH does (they now read the copy) */                  \
            __builtin_prefetch((const void *)((uintptr_t)w + (uintptr_t)((kk + KC) * NR * sizeof(WT))));  \
        }                                                                                               \
    }
WIDEN_SLICE(f32, float)
WIDEN_SLICE(wbf16, uint16_t)
#if HAS_F16
WIDEN_SLICE(wf16, uint16_t)
#endif

#define GEMM_CORE(T, WT)                                                                               \
    TILE(T, WT, 1) TILE(T, WT, 2) TILE(T, WT, 3) TILE(T, WT, 4) TILE(T, WT, 5) TILE(T, WT, 6)          \
    TILE(T, WT, 7) TILE(T, WT, 8) TILE(T, WT, 9) TILE(T, WT, 10)                                       \
    NARROW(T, WT, 1, 4) NARROW(T, WT, 2, 2) NARROW(T, WT, 3, 2)                                        \
    NARROW(T, WT, 1, 1) NARROW(T, WT, 2, 1) NARROW(T, WT, 3, 1)                                        \
    GEMM_NARROW(T, WT)                                                                                 \
    static void gemm_core_##T(const float *x, int64_t m, int64_t k, const WT *packed, int64_t n,        \
                              const float *bias, void *y, int out_kind, int64_t num_threads) {         \
        if (m <= NARROW_MAX) {                                                                         \
            gemm_narrow_##T(x, m, k, packed, n, bias, y, out_kind, num_threads);                       \
            return;                                                                                    \
        }                                                                                              \
        const int64_t panels = (n + NR - 1) / NR, mb = row_block(m, 4 * k, MR);                        \
        _Pragma("omp parallel num_threads(num_threads)") {                                             \
            float acc[MB * NR] __attribute__((aligned(64)));                                           \
            float wide[WIDEN_ONCE_##T ? KC * NR : 1] __attribute__((aligned(64)));                     \
            (void)wide;                                                                                \
            for (int64_t row0 = 0; row0 < m; row0 += mb) {                                             \
                const int64_t rows = m - row0 < mb ? m - row0 : mb, tiles = TILE_COUNT(rows);          \
                /* nowait: every block gives each thread the same panels; blocks write disjoint rows */ \
                _Pragma("omp for schedule(static) nowait")                                             \
                for (int64_t p = 0; p < panels; p++) {                                                 \
                    const int64_t col0 = p * NR, cols = n - col0 < NR ? n - col0 : NR;                 \
                    memset(acc, 0, sizeof(float) * (size_t)(rows * NR));                               \
                    for (int64_t k0 = 0; k0 < k; k0 += KC) {                                           \
                        const int64_t kc = k - k0 < KC ? k - k0 : KC;                                  \
                        const WT *w = packed + (p * k + k0) * NR;                                      \
                        if (WIDEN_ONCE_##T && rows >= WIDEN_ONCE_ROWS) {                               \
                            /* many row tiles pass over this slice: widen it once (WIDEN_ONCE) */      \
                            widen_slice_##T(w, kc, wide);                                              \
                            TILES(f32, wide)                                                           \
                        } else {                                                                       \
                            TILES(T, w)                                                                \
                        }                                                                              \
                    }                                                                                  \
                    for (int64_t r = 0; r < rows; r++)                                                 \
                        store_row(y, out_kind, (row0 + r) * n + col0, acc + r * NR, bias, col0, cols); \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
    }
GEMM_CORE(f32, float)
GEMM_CORE(wbf16, uint16_t)
#if HAS_F16
GEMM_CORE(wf16, uint16_t)
#endif

/* ---- float32 prefill: x packed into row tiles (AVX-512) -------------------------------------------
 *
 * At prefill row counts the row tiles above ran at 52-75% of the FMA peak (benchmarks/bench_gemm.py
 * --prefill-anchor): each tile broadcasts its x values from MR rows k floats apart (ten address
 * streams; at k = 2048 all ten rows fall in the same L1 sets, as do the weight slice's lines), and
 * GCC keeps the last row's accumulators in the weight registers, copying them back every step (two
 * vector moves per 20 FMAs). Here x is first copied, by the threads together, into row blocks of
 * tiles of at most MRP rows laid out [block][k-slice][tile][kk][row] (GotoBLAS's packed A), so a tile reads
 * its broadcasts from one sequential stream; with one pointer for x the tile has registers for 14 rows
 * (28 accumulators, 2 weight vectors, 1 broadcast: 31 of 32), which loads each weight vector for 14
 * rows instead of 10; and the multiply-adds are written as intrinsics, which GCC allocates without the
 * copies. A tile of 14 rows over a 128-feature slice in L1 ran at 87-89% of one core's FMA peak against
 * 82-84% for the 10-row tile (one process, thread CPU time).
 * Loop order: each thread takes a contiguous range of panels and walks it in chunks of panels filling
 * half of L2; every row block of (packed) x passes over a chunk before the next one is read. So each
 * weight byte comes from memory once per call, and the x block (a quarter of L2 at most) from L2 for
 * every panel of the chunk but the first. The row-block-outermost order of the unpacked path reads the
 * whole weight once per 96-row block instead: a 1,024-row prefill chunk streamed each weight from
 * memory (a VM's share of L3 holds little) eleven times. With x packed, the whole of it is copied
 * first (one barrier a call: with one per block, a thread the machine had descheduled held the other
 * up at every block).
 * Measured (bench_gemm.py --prefill-anchor --threads 1 --cpu-time, weights streamed from memory, on a
 * loaded 2-vCPU VM): 57% of the FMA peak against 52% for the unpacked tiles over SmolLM2-360M's
 * prefill shapes, 63% against 59% over the small anchor's; oneDNN and F.linear (MKL) 63-73% there. It is
 * not always faster (the copy of x, the chunk order's passes over x), so it is the timed candidate
 * "native-packx" (NativePackedXGEMM) beside "native", which keeps the unpacked tiles.
 * Exactness: each output is still one FMA chain over k in order (the FMA intrinsic is the contraction
 * the tiles above get from -ffp-contract=fast), so the bits are those of every other path. */
#if VW == 16 && defined(__AVX512F__)
#define PACK_X 1
#define MRP 14      /* rows per packed tile */
#define MBP 112     /* rows per block at most: 8 tiles; their accumulators 14 KB, in L1 */
#define PACK_X_ROWS 32 /* fewer rows keep the unpacked tiles: the copy of x is then a larger share */
static inline v8 vfma(float x, v8 w, v8 a) { return (v8)_mm512_fmadd_ps(_mm512_set1_ps(x), (__m512)w, (__m512)a); }

/* acc[r][0..NR-1] += sum over kk < kc of xp[kk][r] * w[kk][0..NR-1], r < ROWS; xp the tile's packed
 * x (ROWS floats per input feature). Prefetch as TILE's. */
#define TILEP(ROWS)                                                                                      \
    static inline void tilep_##ROWS(const float *xp, const float *w, int64_t kc, float *acc) {           \
        v8 a0[ROWS], a1[ROWS];                                                                           \
        for (int r = 0; r < ROWS; r++) {                                                                 \
            a0[r] = *(const v8 *)(acc + r * NR);                                                         \
            a1[r] = *(const v8 *)(acc + r * NR + VW);                                                    \
        }                                                                                                \
        for (int64_t kk = 0; kk < kc; kk++) {                                                            \
            const v8 w0 = load_w_f32(w + kk * NR), w1 = load_w_f32(w + kk * NR + VW);                    \
            __builtin_prefetch((const void *)((uintptr_t)w + (uintptr_t)((kk + KC) * NR * sizeof(float)))); \
            __builtin_prefetch((const void *)((uintptr_t)w + (uintptr_t)((kk + KC) * NR * sizeof(float) + 64))); \
            for (int r = 0; r < ROWS; r++) {                                                             \
                a0[r] = vfma(xp[kk * ROWS + r], w0, a0[r]);                                              \
                a1[r] = vfma(xp[kk * ROWS + r], w1, a1[r]);                                              \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < ROWS; r++) {                                                                 \
            *(v8 *)(acc + r * NR) = a0[r];                                                               \
            *(v8 *)(acc + r * NR + VW) = a1[r];                                                          \
        }                                                                                                \
    }
TILEP(1) TILEP(2) TILEP(3) TILEP(4) TILEP(5) TILEP(6) TILEP(7)
TILEP(8) TILEP(9) TILEP(10) TILEP(11) TILEP(12) TILEP(13) TILEP(14)

/* This CPU's L2 bytes per core as it reports them, 1 MB where it reports none. */
static int64_t l2_bytes(void) {
#ifdef _SC_LEVEL2_CACHE_SIZE
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l2 > 0) return l2;
#endif
    return 1 << 20;
}

/* Tile t of `tiles` near-equal ones over `rows` rows: its first row and height (at most MRP). */
static inline void tile_span(int64_t t, int64_t tiles, int64_t rows, int64_t *r0, int64_t *h) {
    *r0 = t * rows / tiles;
    *h = (t + 1) * rows / tiles - *r0;
}

/* hf_contbatch_gemm_f32 with x packed per row block (see above). Returns 0, or -1 when the packed
 * copy's buffer cannot be allocated (nothing written then: the caller takes the unpacked path). */
static int gemm_f32_packed_x(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                             const float *bias, float *y, int64_t num_threads) {
    const int64_t panels = (n + NR - 1) / NR, l2 = l2_bytes();
    /* row blocks whose x takes a quarter of L2 at most, whole tiles */
    int64_t mb = l2 / 4 / (4 * k);
    mb = mb / MRP * MRP;
    mb = mb > MBP ? MBP : mb < MRP ? MRP : mb;
    if (m <= mb) mb = m;
    /* panels per chunk: half of L2 */
    int64_t chunk = l2 / 2 / (k * NR * (int64_t)sizeof(float));
    chunk = chunk < 1 ? 1 : chunk;
    float *xp = (float *)malloc(sizeof(float) * (size_t)(m * k));
    if (!xp) return -1;
    const int64_t blocks = (m + mb - 1) / mb, block_tiles = (mb + MRP - 1) / MRP;
#pragma omp parallel num_threads(num_threads)
    {
        float acc[MBP * NR] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < blocks * block_tiles; i++) {
            const int64_t row0 = i / block_tiles * mb, rows = m - row0 < mb ? m - row0 : mb;
            const int64_t t = i % block_tiles, tiles = (rows + MRP - 1) / MRP;
            if (t >= tiles) continue; /* the last block's missing tiles */
            int64_t r0, h;
            tile_span(t, tiles, rows, &r0, &h);
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                const int64_t kc = k - k0 < KC ? k - k0 : KC;
                float *dst = xp + row0 * k + k0 * rows + r0 * kc;
                const float *src = x + (row0 + r0) * k + k0;
                /* written in order: h read streams, one write stream */
                for (int64_t kk = 0; kk < kc; kk++)
                    for (int64_t r = 0; r < h; r++) dst[kk * h + r] = src[r * k + kk];
            }
        }
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t p_begin = tid * panels / nth, p_end = (tid + 1) * panels / nth;
        for (int64_t c0 = p_begin; c0 < p_end; c0 += chunk) {
            const int64_t c1 = c0 + chunk < p_end ? c0 + chunk : p_end;
            for (int64_t row0 = 0; row0 < m; row0 += mb) {
                const int64_t rows = m - row0 < mb ? m - row0 : mb, tiles = (rows + MRP - 1) / MRP;
                const float *xb = xp + row0 * k;
                for (int64_t p = c0; p < c1; p++) {
                    const int64_t col0 = p * NR, cols = n - col0 < NR ? n - col0 : NR;
                    memset(acc, 0, sizeof(float) * (size_t)(rows * NR));
                    for (int64_t k0 = 0; k0 < k; k0 += KC) {
                        const int64_t kc = k - k0 < KC ? k - k0 : KC;
                        const float *w = packed + (p * k + k0) * NR;
                        for (int64_t t = 0; t < tiles; t++) {
                            int64_t r0, h;
                            tile_span(t, tiles, rows, &r0, &h);
                            const float *xt = xb + k0 * rows + r0 * kc;
                            float *at = acc + r0 * NR;
                            switch (h) {
                                case 1: tilep_1(xt, w, kc, at); break;
                                case 2: tilep_2(xt, w, kc, at); break;
                                case 3: tilep_3(xt, w, kc, at); break;
                                case 4: tilep_4(xt, w, kc, at); break;
                                case 5: tilep_5(xt, w, kc, at); break;
                                case 6: tilep_6(xt, w, kc, at); break;
                                case 7: tilep_7(xt, w, kc, at); break;
                                case 8: tilep_8(xt, w, kc, at); break;
                                case 9: tilep_9(xt, w, kc, at); break;
                                case 10: tilep_10(xt, w, kc, at); break;
                                case 11: tilep_11(xt, w, kc, at); break;
                                case 12: tilep_12(xt, w, kc, at); break;
                                case 13: tilep_13(xt, w, kc, at); break;
                                default: tilep_14(xt, w, kc, at); break;
                            }
                        }
                    }
                    for (int64_t r = 0; r < rows; r++)
                        store_row(y, OUT_F32, (row0 + r) * n + col0, acc + r * NR, bias, col0, cols);
                }
            }
        }
    }
    free(xp);
    return 0;
}
#else
#define PACK_X 0
#endif

/* x [m][k] float32 row-major, packed from hf_contbatch_gemm_pack_f32, bias [n] or NULL, y [m][n]
 * float32 row-major: the unpacked row tiles (and the narrow path for 1-3 rows). */
void hf_contbatch_gemm_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                           const float *bias, float *y, int64_t num_threads) {
    gemm_core_f32(x, m, k, packed, n, bias, y, OUT_F32, num_threads);
}

/* hf_contbatch_gemm_f32 with x packed (above) from PACK_X_ROWS rows on, on builds that have the packed
 * tiles (AVX-512); fewer rows, other builds, or no memory for the packed copy: the unpacked tiles.
 * The same bits either way; which is faster per shape and row count is timed by the engine
 * (kernels/linears/autotune.py, the "native-packx" candidate). */
void hf_contbatch_gemm_f32_packed_x(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                                    const float *bias, float *y, int64_t num_threads) {
#if PACK_X
    if (m >= PACK_X_ROWS && k > 0 && gemm_f32_packed_x(x, m, k, packed, n, bias, y, num_threads) == 0) return;
#endif
    gemm_core_f32(x, m, k, packed, n, bias, y, OUT_F32, num_threads);
}

/* Rows from which hf_contbatch_gemm_f32_packed_x packs x (0: this build never does). */
int64_t hf_contbatch_gemm_pack_x_rows(void) {
#if PACK_X
    return PACK_X_ROWS;
#else
    return 0;
#endif
}

/* Half-precision weights widened in registers (any CPU with vectors; float16 where F16C is):
 * packed by hf_contbatch_gemm_pack_h16 into the float32 layout with 16-bit values, [ceil(n/NR)][k][NR].
 * x [m][k] and y [m][n] in the weights' format, bias [n] float32 or NULL. x is widened to float32
 * once (exact), the products accumulated in float32 as hf_contbatch_gemm_f32 does, and each output
 * rounded once to nearest even. Returns 0, or -1 when the float32 copy of x cannot be allocated. */
void hf_contbatch_gemm_pack_h16(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                out[(p * k + kk) * NR + j] = col < n ? w[col * k + kk] : 0;
            }
}

int hf_contbatch_gemm_has_f16(void) { return HAS_F16; }

/* x widened into a float32 buffer of m * k (x is a small share of the bytes: the weights dominate) */
static float *widen_x(const uint16_t *x, int64_t m, int64_t k, int is_f16, float *stack, int64_t stack_len) {
    const int64_t len = m * k;
    float *xf = len <= stack_len ? stack : (float *)malloc(sizeof(float) * (size_t)len);
    if (!xf) return NULL;
#pragma omp parallel for schedule(static) if (len >= (1 << 16))
    for (int64_t i = 0; i < len; i++) {
#if HAS_F16
        xf[i] = is_f16 ? _cvtsh_ss(x[i]) : bf16_to_f32(x[i]);
#else
        (void)is_f16;
        xf[i] = bf16_to_f32(x[i]);
#endif
    }
    return xf;
}

#define HALF_ENTRY(T, IS_F16, OUT)                                                                     \
    int hf_contbatch_gemm_##T(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n, \
                               const float *bias, uint16_t *y, int64_t num_threads) {                  \
        float stack[8 * 4096] __attribute__((aligned(64))); /* decode's few rows: no allocation */      \
        float *xf = widen_x(x, m, k, IS_F16, stack, 8 * 4096);                                         \
        if (!xf) return -1;                                                                            \
        gemm_core_##T(xf, m, k, packed, n, bias, y, OUT, num_threads);                                 \
        if (xf != stack) free(xf);                                                                     \
        return 0;                                                                                      \
    }
HALF_ENTRY(wbf16, 0, OUT_BF16)
#if HAS_F16
HALF_ENTRY(wf16, 1, OUT_F16)
#endif

/* Panels p0..p1-1 of a widening layout ([P][k][NR] 16-bit) widened into dst [k][(p1 - p0) * NR]
 * float32, row-major: the transposed weight columns p0 * NR ... for a float32 GEMM
 * (widen_gemm.py: prefill's many rows by torch's float32 GEMM, no float32 copy of the weight
 * kept). Exact (bf16: a shift; fp16: VCVTPH2PS). One pass: each 16-bit value read once, each
 * float written once, in the order dst is laid out, so a cache-sized dst stays in cache for the
 * GEMM. is_f16 needs HAS_F16. */
void hf_contbatch_gemm_widen_panels(const uint16_t *panels, int64_t k, int64_t p0, int64_t p1, int is_f16,
                                     float *dst, int64_t num_threads) {
    const int64_t width = (p1 - p0) * NR;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (k * width >= (1 << 18))
    for (int64_t kk = 0; kk < k; kk++)
        for (int64_t p = p0; p < p1; p++) {
            const uint16_t *src = panels + (p * k + kk) * NR;
            float *out = dst + kk * width + (p - p0) * NR;
#if HAS_F16
            if (is_f16) {
                for (int64_t j = 0; j < NR; j += VW) *(v8 *)(out + j) = load_w_wf16(src + j);
                continue;
            }
#else
            (void)is_f16;
#endif
            for (int64_t j = 0; j < NR; j++) out[j] = bf16_to_f32(src[j]);
        }
}

/* ---- bfloat16 with float32 accumulation (AVX512-BF16: VDPBF16PS) ----------------------------------
 *
 * W is packed as for float32 but in pairs of input features: [ceil(N/32)][K/2][32][2] bf16, so one
 * 64-byte load holds 16 columns x 2 features and VDPBF16PS adds both products of each column into a
 * float32 accumulator (x's pair broadcast to every column). K must be even (the pair layout); the
 * Python side checks it. Accumulation is float32 over k in order, two features a step; the output
 * is rounded to bf16 once, at the end (round to nearest even), plus a float32 bias before that. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
int hf_contbatch_gemm_has_bf16(void) { return 1; }

#define NRB 32 /* output columns per bf16 panel: two vectors of 16 float32 accumulators */
#define MRB 8  /* rows per bf16 tile: 16 accumulators (more rows reuse each loaded weight pair more) */

void hf_contbatch_gemm_pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    const int64_t panels = (n + NRB - 1) / NRB, k2 = k / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k2; kk++)
            for (int64_t j = 0; j < NRB; j++) {
                const int64_t col = p * NRB + j;
                uint16_t *o = out + ((p * k2 + kk) * NRB + j) * 2;
                o[0] = col < n ? w[col * k + 2 * kk] : 0;
                o[1] = col < n ? w[col * k + 2 * kk + 1] : 0;
            }
}

/* acc[r][0..31] += x[r][2kk..2kk+1] . w[kk][0..31][0..1] for kk < k2, r < ROWS */
#define TILE_BF16(ROWS)                                                                              \
    static inline void tile_bf16_##ROWS(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t k2, \
                                        float *acc) {                                                \
        __m512 a[ROWS][2];                                                                           \
        for (int r = 0; r < ROWS; r++) {                                                             \
            a[r][0] = _mm512_loadu_ps(acc + r * NRB);                                                \
            a[r][1] = _mm512_loadu_ps(acc + r * NRB + 16);                                           \
        }                                                                                            \
        for (int64_t kk = 0; kk < k2; kk++) {                                                        \
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kk * NRB * 2);                      \
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + kk * NRB * 2 + 32);                 \
            /* the next slice, both lines of its 128-byte row (as the float32 tiles) */              \
            __builtin_prefetch((const void *)((uintptr_t)w + (uintptr_t)((kk + KC / 2) * NRB * 4)));\
            __builtin_prefetch((const void *)((uintptr_t)w + (uintptr_t)((kk + KC / 2) * NRB * 4 + 64)));\
            for (int r = 0; r < ROWS; r++) {                                                         \
                int32_t pair;                                                                        \
                memcpy(&pair, x + r * ldx + 2 * kk, 4);                                              \
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                               \
                a[r][0] = _mm512_dpbf16_ps(a[r][0], xv, w0);                                         \
                a[r][1] = _mm512_dpbf16_ps(a[r][1], xv, w1);                                         \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < ROWS; r++) {                                                             \
            _mm512_storeu_ps(acc + r * NRB, a[r][0]);                                                \
            _mm512_storeu_ps(acc + r * NRB + 16, a[r][1]);                                           \
        }                                                                                            \
    }
TILE_BF16(1)
TILE_BF16(2)
TILE_BF16(3)
TILE_BF16(4)
TILE_BF16(5)
TILE_BF16(6)
TILE_BF16(7)
TILE_BF16(8)


/* x [m][k] bf16 row-major (k even), packed from hf_contbatch_gemm_pack_bf16, bias [n] float32 or
 * NULL, y [m][n] bf16 row-major. Loop order as in hf_contbatch_gemm_f32: row blocks outermost, so a
 * block of x stays in L2 while the thread's panels stream past it. */
void hf_contbatch_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                            const float *bias, uint16_t *y, int64_t num_threads) {
    const int64_t panels = (n + NRB - 1) / NRB, k2 = k / 2, kc2 = KC / 2, mb = row_block(m, 2 * k, MRB);
#pragma omp parallel num_threads(num_threads)
    {
        float acc[MB * NRB] __attribute__((aligned(64)));
        for (int64_t row0 = 0; row0 < m; row0 += mb) {
            const int64_t rows = m - row0 < mb ? m - row0 : mb;
            const int64_t tiles = (rows + MRB - 1) / MRB;
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; p++) {
                const int64_t col0 = p * NRB, cols = n - col0 < NRB ? n - col0 : NRB;
                memset(acc, 0, sizeof(float) * (size_t)(rows * NRB));
                for (int64_t k0 = 0; k0 < k2; k0 += kc2) {
                    const int64_t kc = k2 - k0 < kc2 ? k2 - k0 : kc2;
                    const uint16_t *w = packed + (p * k2 + k0) * NRB * 2;
                    int64_t r0 = 0;
                    for (int64_t t = 0; t < tiles; t++) {
                        const int64_t left = rows - r0, h = (left + (tiles - t) - 1) / (tiles - t);
                        const uint16_t *xt = x + (row0 + r0) * k + 2 * k0;
                        float *at = acc + r0 * NRB;
                        switch (h) {
                            case 1: tile_bf16_1(xt, k, w, kc, at); break;
                            case 2: tile_bf16_2(xt, k, w, kc, at); break;
                            case 3: tile_bf16_3(xt, k, w, kc, at); break;
                            case 4: tile_bf16_4(xt, k, w, kc, at); break;
                            case 5: tile_bf16_5(xt, k, w, kc, at); break;
                            case 6: tile_bf16_6(xt, k, w, kc, at); break;
                            case 7: tile_bf16_7(xt, k, w, kc, at); break;
                            default: tile_bf16_8(xt, k, w, kc, at); break;
                        }
                        r0 += h;
                    }
                }
                for (int64_t r = 0; r < rows; r++) {
                    uint16_t *yr = y + (row0 + r) * n + col0;
                    const float *ar = acc + r * NRB;
                    for (int64_t j = 0; j < cols; j++) yr[j] = to_bf16(bias ? ar[j] + bias[col0 + j] : ar[j]);
                }
            }
        }
    }
}
#else
int hf_contbatch_gemm_has_bf16(void) { return 0; }
#endif
