/* float32 GEMM for the small row counts of serving steps: y[M][N] = x[M][K] . W^T (+ bias).
 *
 * Built on first use by hf_contbatch/kernels/linears/native_gemm.py with the system C compiler
 * (-O3 -march=native -fopenmp, no -ffast-math) and called through ctypes on torch's own OpenMP
 * runtime.
 *
 * Why our own: a decode step multiplies a few to a few dozen rows by every weight of the model, so
 * it streams the weights from memory once per step, and is bound by how fast the weights stream.
 * oneDNN's brgemm (what torch offers) reads them well below the memory's bandwidth at these row
 * counts; this kernel streams them close to it (benchmarks/bench_gemm.py compares the two).
 *
 * The layout and loop nest follow the BLIS/GotoBLAS design (Goto & van de Geijn, "Anatomy of
 * High-Performance Matrix Multiplication", ACM TOMS 2008; the 6x16 register tile of BLIS's
 * Haswell kernel): W is packed once into panels of NR = 16 output columns, [ceil(N/16)][K][16]
 * (zero columns pad the last panel), so a panel streams sequentially. Threads take whole panels
 * (each weight byte is read by one thread); inside a panel, rows go in blocks of at most MB, the
 * panel in slices of KC input features that stay in L1 while every row tile of up to 6 rows
 * passes over them with 12 vector accumulators (tiles of 7 rows, 14 accumulators, for 7 and
 * 13-14 rows). One to three rows (a notebook's single request, the end of a batch) take a narrow
 * path whose tiles span 2-4 panels instead (see NARROW).
 *
 * Exactness: each output is one fused multiply-add chain over k = 0..K-1 in order (no
 * reassociation: compiled without -ffast-math), whatever M, the row's position in the batch, the
 * tile it lands in, or the other columns packed beside it. So a row's result does not depend on
 * the batch it runs in, and sibling projections packed together (q/k/v) give the bits they give
 * apart.
 */
#include <stdint.h>
#include <string.h>

/* 8 floats; aligned(4) lets loads and stores be unaligned. GCC/Clang vector extensions compile to
 * AVX2/FMA with -march=native on x86 and to NEON on arm64. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

#define NR 16  /* output columns per panel: two 8-float vectors */
#define MR 6   /* rows per register tile: 6 x 2 accumulators + 2 weight vectors + 1 broadcast */
#define MB 96  /* rows per block: their accumulators (6 KB) stay in L1 */
#define KC 256 /* input features per panel slice: 16 KB of weights, in L1 for every row tile */

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

/* acc[r][0..15] += sum over kk < kc of x[r][kk] * w[kk][0..15], for r < ROWS.
 * PREFETCH: a thread's panels lie one after another in memory and it walks their slices in order,
 * so the line one slice (16 KB) ahead is the same position in the next slice, of this panel or of
 * its next one. Fetching it while the current slice is multiplied hides the memory latency of the
 * first pass over each slice (better than 1 KB ahead at 16-32 rows, no worse at 64). */
#define TILE(ROWS)                                                                                  \
    static inline void tile_##ROWS(const float *x, int64_t ldx, const float *w, int64_t kc, float *acc) { \
        v8 a[ROWS][2];                                                                              \
        for (int r = 0; r < ROWS; r++) {                                                            \
            a[r][0] = *(const v8 *)(acc + r * NR);                                                  \
            a[r][1] = *(const v8 *)(acc + r * NR + 8);                                              \
        }                                                                                           \
        for (int64_t kk = 0; kk < kc; kk++) {                                                       \
            const v8 w0 = *(const v8 *)(w + kk * NR), w1 = *(const v8 *)(w + kk * NR + 8);          \
            /* the next slice (PREFETCH); integer arithmetic: it may lie past the buffer's end */ \
            __builtin_prefetch((const void *)((uintptr_t)w + (uintptr_t)((kk + KC) * NR * 4)));      \
            for (int r = 0; r < ROWS; r++) {                                                        \
                const float xv = x[r * ldx + kk];                                                   \
                a[r][0] += xv * w0;                                                                 \
                a[r][1] += xv * w1;                                                                 \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < ROWS; r++) {                                                            \
            *(v8 *)(acc + r * NR) = a[r][0];                                                        \
            *(v8 *)(acc + r * NR + 8) = a[r][1];                                                    \
        }                                                                                           \
    }
TILE(1)
TILE(2)
TILE(3)
TILE(4)
TILE(5)
TILE(6)
TILE(7)

/* 1-3 rows: a tile of ROWS rows gives only 2 * ROWS multiply-add chains, and each chain waits
 * for its previous FMA (several cycles of latency), so a one-panel tile runs at a fraction of the
 * FMA throughput. These tiles span G panels instead (8-12 accumulators), over all of K at once.
 * Each output is still one in-order FMA chain over k, so the bits equal those of the general path.
 * Prefetch: each panel's stream one slice (KC features) ahead, as there. With them 1-3 rows read
 * the weights about as fast as the memory gives them (benchmarks/bench_gemm.py). */
#define NARROW(ROWS, G)                                                                               \
    static inline void narrow_##ROWS##_##G(const float *x, int64_t k, const float *w, float *out) {   \
        v8 a[ROWS][G][2];                                                                             \
        for (int r = 0; r < ROWS; r++)                                                                \
            for (int g = 0; g < G; g++) a[r][g][0] = a[r][g][1] = (v8){0};                             \
        for (int64_t kk = 0; kk < k; kk++) {                                                          \
            v8 w0[G], w1[G];                                                                          \
            for (int g = 0; g < G; g++) {                                                             \
                const float *wg = w + (g * k + kk) * NR;                                              \
                w0[g] = *(const v8 *)wg;                                                              \
                w1[g] = *(const v8 *)(wg + 8);                                                        \
                __builtin_prefetch((const void *)((uintptr_t)wg + (uintptr_t)(KC * NR * 4)));          \
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
                *(v8 *)(out + (r * G + g) * NR + 8) = a[r][g][1];                                     \
            }                                                                                         \
    }
NARROW(1, 4)
NARROW(2, 2)
NARROW(3, 2)
NARROW(1, 1)
NARROW(2, 1)
NARROW(3, 1)

/* m <= 3 rows: threads take groups of G panels (G = 4 for one row, else 2); a last group of
 * fewer panels goes one panel at a time. out: acc [m][G][16] per group, copied to y with bias. */
static void gemm_narrow(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                        float *y, int64_t num_threads) {
    const int64_t panels = (n + NR - 1) / NR, G = m == 1 ? 4 : 2;
    const int64_t groups = (panels + G - 1) / G;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t gi = 0; gi < groups; gi++) {
        float acc[3 * 4 * NR] __attribute__((aligned(32)));
        const int64_t p0 = gi * G, np = panels - p0 < G ? panels - p0 : G;
        const float *w = packed + p0 * k * NR;
        if (np == G) {
            if (m == 1) narrow_1_4(x, k, w, acc);
            else if (m == 2) narrow_2_2(x, k, w, acc);
            else narrow_3_2(x, k, w, acc);
        } else {
            for (int64_t g = 0; g < np; g++) {
                float one[3 * NR] __attribute__((aligned(32)));
                if (m == 1) narrow_1_1(x, k, w + g * k * NR, one);
                else if (m == 2) narrow_2_1(x, k, w + g * k * NR, one);
                else narrow_3_1(x, k, w + g * k * NR, one);
                for (int64_t r = 0; r < m; r++) memcpy(acc + (r * G + g) * NR, one + r * NR, sizeof(float) * NR);
            }
        }
        for (int64_t r = 0; r < m; r++)
            for (int64_t g = 0; g < np; g++) {
                const int64_t col0 = (p0 + g) * NR, cols = n - col0 < NR ? n - col0 : NR;
                float *yr = y + r * n + col0;
                const float *ar = acc + (r * G + g) * NR;
                if (bias)
                    for (int64_t j = 0; j < cols; j++) yr[j] = ar[j] + bias[col0 + j];
                else
                    memcpy(yr, ar, sizeof(float) * (size_t)cols);
            }
    }
}

/* x [m][k] row-major, packed from hf_contbatch_gemm_pack_f32, bias [n] or NULL, y [m][n] row-major. */
void hf_contbatch_gemm_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                           const float *bias, float *y, int64_t num_threads) {
    if (m <= 3) {
        gemm_narrow(x, m, k, packed, n, bias, y, num_threads);
        return;
    }
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        float acc[MB * NR] __attribute__((aligned(32)));
        const int64_t col0 = p * NR, cols = n - col0 < NR ? n - col0 : NR;
        for (int64_t row0 = 0; row0 < m; row0 += MB) {
            const int64_t rows = m - row0 < MB ? m - row0 : MB;
            memset(acc, 0, sizeof(float) * (size_t)(rows * NR));
            /* Tiles of near-equal height (32 rows: 6+6+5+5+5+5, not 6x5+2), of up to 7 rows (14
             * accumulators; the weights become FMA memory operands) where that saves a pass over
             * each slice and there are at most 14 rows: 7 rows in one tile instead of 4+3, 13-14
             * in two instead of three. At more rows the 7-row tile's loads of the weights cost more
             * than the saved passes. */
            const int64_t tiles = rows <= 2 * (MR + 1) && (rows + MR) / (MR + 1) < (rows + MR - 1) / MR
                                      ? (rows + MR) / (MR + 1)
                                      : (rows + MR - 1) / MR;
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                const int64_t kc = k - k0 < KC ? k - k0 : KC;
                const float *w = packed + (p * k + k0) * NR;
                int64_t r0 = 0;
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t left = rows - r0, h = (left + (tiles - t) - 1) / (tiles - t);
                    const float *xt = x + (row0 + r0) * k + k0;
                    float *at = acc + r0 * NR;
                    switch (h) {
                        case 1: tile_1(xt, k, w, kc, at); break;
                        case 2: tile_2(xt, k, w, kc, at); break;
                        case 3: tile_3(xt, k, w, kc, at); break;
                        case 4: tile_4(xt, k, w, kc, at); break;
                        case 5: tile_5(xt, k, w, kc, at); break;
                        case 6: tile_6(xt, k, w, kc, at); break;
                        default: tile_7(xt, k, w, kc, at); break;
                    }
                    r0 += h;
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                float *yr = y + (row0 + r) * n + col0;
                const float *ar = acc + r * NR;
                if (bias)
                    for (int64_t j = 0; j < cols; j++) yr[j] = ar[j] + bias[col0 + j];
                else
                    memcpy(yr, ar, sizeof(float) * (size_t)cols);
            }
        }
    }
}
