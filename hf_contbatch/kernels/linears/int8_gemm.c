/* Int8 GEMMs for serving steps, built on first use by hf_contbatch/kernels/linears/int8_gemm.py
 * with the system C compiler (-O3 -march=native -fopenmp, no -ffast-math) and called through ctypes.
 *
 * 1. Weight-only (hf_contbatch_int8_gemm): y[M][N] = (x[M][K] . Wq^T) * s[N] (+ bias), x and y
 *    float32, Wq int8 (symmetric, one scale per output channel: torchao's int8 weight-only scheme).
 * 2. Int8 activations (hf_contbatch_int8_vnni_gemm): each row of x quantized to int8 on the fly
 *    (symmetric, one scale per row), int8 x int8 products summed in int32 with VNNI's VPDPBUSD,
 *    y = acc * (sx[row] * s[N]) (+ bias).
 *
 * ---- 1. Weight-only: dequantize in registers -------------------------------------------------------
 *
 * Why: a decode step streams every weight once; int8 weights are a quarter of float32's bytes, so
 * the kernel must keep up with the memory at a quarter of the bytes per weight: four times the
 * multiply-adds per byte of the float32 GEMM (cpu_gemm.c). The weights are dequantized in registers
 * (as in weight-only kernels such as torch's _weight_int8pack_mm and llama.cpp's): the NR int8
 * weights of one input feature of a panel come in one load (64 bytes with AVX-512) and are widened to
 * four int32 vectors by shifts (load_panel_shift: the faster on Zen 5) or by VPMOVSXBD's
 * load-and-widen (load_panel_movsx: the faster on Intel Xeon, 15-20% at one row, where 512-bit shifts
 * share port 0 with the conversions; the tuner times both, NativeInt8GEMM and NativeInt8MovsxGEMM),
 * converted to float32 (VCVTDQ2PS) and multiplied into float32 accumulators with FMA, x broadcast
 * from memory. The per-channel scale is applied once per output, after the sum.
 *
 * Layout: W is packed once into panels of NR = 4 vectors of output columns (64 with AVX-512, 32
 * with 256-bit vectors), [ceil(N/NR)][K][NR] (zero columns pad the last panel), columns interleaved
 * within a feature as load_panel reads them: with AVX-512 one input feature of a panel is one 64-byte
 * cache line, so a panel is one sequential stream.
 *
 * Why it was compute-bound before (16-column panels, one accumulator per row, a vector-extension
 * int8 -> float conversion): GCC 12 compiled that conversion to one scalar VCVTSI2SS a weight, and at
 * one row each output's FMA chain waits for its previous FMA (4 cycles), 16 weights per 4 cycles.
 * Limit now: one float32 FMA per weight per row, so from about four rows on (a single core's FMA peak
 * against its share of the memory bandwidth at one byte a weight) it is FMA-bound like the float32
 * GEMM; W8A8 (part 2) is the path past that. Here a tile of R rows spans G panels, R x G x 4 independent chains
 * (G = 2 for up to 3 rows with AVX-512, for 1 row with 256-bit vectors; else G = 1 and up to 6 / 3
 * rows): at least 8 chains in flight, enough to cover the FMA latency on two FMA pipes.
 *
 * Blocking (the BLIS/GotoBLAS loop nest as in cpu_gemm.c): rows in blocks of MB, the panels in
 * slices of KC input features (16 KB of int8 with AVX-512) that stay in L1 while each row tile passes
 * over them; accumulators live in a per-block buffer between slices. At decode (one row block) each
 * thread takes a contiguous range of panels of near-equal count; with more rows, (panel group, row
 * block) units; either way each weight byte is read by one thread per row block.
 *
 * Exactness: each output's sum is one in-order FMA chain over k = 0..K-1 (no -ffast-math; a slice
 * boundary stores and reloads the accumulator, which rounds nothing), so a row's result does not
 * depend on the batch it runs in, the tile it lands in or sibling columns packed beside it. Against
 * F.linear(x, Wq * s) only the order of rounding differs (the scale is applied after the sum).
 *
 * Vectors are GCC/Clang vector extensions: with -march=native they compile to AVX-512, to AVX2/FMA
 * or to NEON, so each ISA path is the compiler's for the CPU it builds on (the feature macros below
 * name it), and hf_contbatch_int8_runtime_ok() checks at load that the CPU running it has that ISA
 * (a library cached on disk for another CPU of the same family string must not be run).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#define INT8_ISA "avx512f"
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
#define INT8_ISA "avx2"
#elif defined(__ARM_NEON)
#define VW 8
#define INT8_ISA "neon"
#else
#define VW 8
#define INT8_ISA "generic"
#endif

#define NV 4            /* vectors per panel */
#define NR (NV * VW)    /* output columns per panel */
/* KC, PF (and KCQ, QPF of part 2) may be set with -D for A/B builds in one process (benchmarks) */
#ifndef KC
#define KC 256 /* input features per slice: KC x NR bytes (16 KB / 8 KB) stay in L1 */
#endif
#define MB 64           /* rows per block: MB x NR float accumulators (16 KB / 8 KB) */
/* bytes ahead in a panel's stream to prefetch: 4 KB read 1-4 rows at 64-107% of the copy bandwidth
 * where 1 KB read them at 62-104% (one thread, SmolLM2-360M's shapes, A/B in one process; 16 KB no
 * better) */
#ifndef PF
#define PF 4096
#endif
#if VW == 16
#define RMAX1 6 /* rows of a one-panel tile: 24 of 32 registers accumulate */
#define RMAX2 3 /* rows of a two-panel tile: 24 accumulators */
#else
#define RMAX1 3 /* 12 of 16 registers */
#define RMAX2 1 /* 8 accumulators */
#endif

typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vw32 __attribute__((vector_size(VW * 4), aligned(4)));

int64_t hf_contbatch_int8_nr(void) { return NR; }
const char *hf_contbatch_int8_isa(void) { return INT8_ISA; }

/* 1 when the CPU running this has the vector ISA the library was compiled for. */
int hf_contbatch_int8_runtime_ok(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    int ok = 1;
#if defined(__AVX512F__)
    ok = ok && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#elif defined(__AVX2__) && defined(__FMA__)
    ok = ok && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    ok = ok && __builtin_cpu_supports("avx512vnni");
#elif defined(__AVXVNNI__)
    ok = ok && __builtin_cpu_supports("avxvnni");
#endif
    return ok;
#else
    return 1;
#endif
}

/* w [n][k] int8 -> out [ceil(n/NR)][k][NR], zero padded. */
void hf_contbatch_int8_pack(const int8_t *w, int64_t n, int64_t k, int8_t *out) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        int8_t *dst = out + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                /* byte j % 4 of 32-bit lane j / 4 holds column (j % 4) * VW + j / 4 (see load_panel) */
                const int64_t row = p * NR + (j % 4) * VW + j / 4;
                dst[kk * NR + j] = row < n ? w[row * k + kk] : 0;
            }
    }
}

/* The NR = 4 x VW int8 weights of one input feature of a panel -> 4 vectors of VW floats, from one
 * NR-byte load (64 bytes with AVX-512): pack puts column v * VW + i in byte v of 32-bit lane i, so
 * vector v is (lane << (24 - 8v)) >> 24 (arithmetic shift: sign-extended), converted with
 * VCVTDQ2PS. On Zen 5 shifts run on more ports than VPMOVSXBD's cross-lane shuffle, which (one per
 * 16 weights) capped the one-row kernel there at about half its memory bandwidth (on Intel Xeon it
 * is the other way: load_panel_movsx); and GCC 12 compiles a
 * direct int8 -> float __builtin_convertvector to one scalar conversion a lane (the old kernel's
 * bottleneck). */
static inline void load_panel_shift(const int8_t *p, vf out[NV]) {
    vw32 raw;
    memcpy(&raw, p, sizeof(raw));
    out[0] = __builtin_convertvector((raw << 24) >> 24, vf);
    out[1] = __builtin_convertvector((raw << 16) >> 24, vf);
    out[2] = __builtin_convertvector((raw << 8) >> 24, vf);
    out[3] = __builtin_convertvector(raw >> 24, vf);
}

/* The same NR bytes widened by VPMOVSXBD, VW consecutive bytes a vector (load and widen in one
 * instruction): vector v lane i holds byte b = v * VW + i, i.e. column (b % 4) * VW + b / 4 of the
 * panel, so the accumulators hold the columns permuted and the store un-permutes them (MOVSX_COL).
 * The same packed layout as the shifts, the same in-order FMA chain per column: the same bits.
 * Which is faster depends on the CPU (Intel's 512-bit shifts and conversions share one port, where
 * VPMOVSXBD takes the shuffle port; on Zen 5 the shifts won), so both are candidates the tuner times
 * (NativeInt8MovsxGEMM). */
#if defined(__AVX512F__)
#define HAS_MOVSX 1
static inline void load_panel_movsx(const int8_t *p, vf out[NV]) {
    for (int v = 0; v < NV; v++)
        out[v] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + v * VW))));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define HAS_MOVSX 1
static inline void load_panel_movsx(const int8_t *p, vf out[NV]) {
    for (int v = 0; v < NV; v++)
        out[v] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + v * VW))));
}
#else
#define HAS_MOVSX 0
#define load_panel_movsx load_panel_shift /* never called: hf_contbatch_int8_has_movsx() is 0 */
#endif
/* Where column j of a panel sits in load_panel_movsx's accumulators: byte 4 * (j % VW) + j / VW. */
#define MOVSX_COL(j) (4 * ((j) % VW) + (j) / VW)

/* 1 when this build has the VPMOVSXBD path (x86 with AVX2 or AVX-512). */
int hf_contbatch_int8_has_movsx(void) { return HAS_MOVSX; }

/* acc[r][g*NR + 0..NR-1] += sum over kk < kc of x[r][kk] * w_g[kk][0..NR-1], r < R, g < G; panel g's
 * slice at w + g * pstride. acc rows are G*NR floats apart. */
#define TILE(R, G, L)                                                                                \
    static inline void tile_##R##_##G##_##L(const float *x, int64_t ldx, const int8_t *w, int64_t pstride, \
                                      int64_t kc, float *acc) {                                      \
        vf a[R][G][NV];                                                                              \
        for (int r = 0; r < R; r++)                                                                  \
            for (int g = 0; g < G; g++)                                                              \
                for (int v = 0; v < NV; v++) memcpy(&a[r][g][v], acc + (r * G + g) * NR + v * VW, sizeof(vf)); \
        for (int64_t kk = 0; kk < kc; kk++) {                                                        \
            vf wv[G][NV];                                                                            \
            for (int g = 0; g < G; g++) {                                                            \
                const int8_t *wg = w + g * pstride + kk * NR;                                        \
                __builtin_prefetch((const void *)((uintptr_t)wg + PF));                              \
                load_panel_##L(wg, wv[g]);                                                           \
            }                                                                                        \
            for (int r = 0; r < R; r++) {                                                            \
                const float xv = x[r * ldx + kk];                                                    \
                for (int g = 0; g < G; g++)                                                          \
                    for (int v = 0; v < NV; v++) a[r][g][v] += xv * wv[g][v];                        \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < R; r++)                                                                  \
            for (int g = 0; g < G; g++)                                                              \
                for (int v = 0; v < NV; v++) memcpy(acc + (r * G + g) * NR + v * VW, &a[r][g][v], sizeof(vf)); \
    }
#if RMAX1 > 3
#define TILES(L) TILE(1, 1, L) TILE(2, 1, L) TILE(3, 1, L) TILE(4, 1, L) TILE(5, 1, L) TILE(6, 1, L)
#else
#define TILES(L) TILE(1, 1, L) TILE(2, 1, L) TILE(3, 1, L)
#endif
#if RMAX2 > 1
#define TILES2(L) TILE(1, 2, L) TILE(2, 2, L) TILE(3, 2, L)
#else
#define TILES2(L) TILE(1, 2, L)
#endif
TILES(shift)
TILES2(shift)
#if HAS_MOVSX
TILES(movsx)
TILES2(movsx)
#endif

#define RUN_TILE(L)                                                                                  \
    static void run_tile_##L(int64_t h, int64_t g, const float *x, int64_t ldx, const int8_t *w,    \
                             int64_t pstride, int64_t kc, float *acc) {                              \
        if (g == 2) {                                                                                \
            if (h == 1 || RMAX2 == 1) { tile_1_2_##L(x, ldx, w, pstride, kc, acc); return; }         \
            RUN_TILE2_REST(L)                                                                        \
        }                                                                                            \
        switch (h) {                                                                                 \
            case 1: tile_1_1_##L(x, ldx, w, pstride, kc, acc); return;                               \
            case 2: tile_2_1_##L(x, ldx, w, pstride, kc, acc); return;                               \
            RUN_TILE1_REST(L)                                                                        \
        }                                                                                            \
    }
#if RMAX2 > 1
#define RUN_TILE2_REST(L)                                                                            \
    if (h == 2) tile_2_2_##L(x, ldx, w, pstride, kc, acc);                                           \
    else tile_3_2_##L(x, ldx, w, pstride, kc, acc);                                                  \
    return;
#else
#define RUN_TILE2_REST(L)
#endif
#if RMAX1 > 3
#define RUN_TILE1_REST(L)                                                                            \
    case 3: tile_3_1_##L(x, ldx, w, pstride, kc, acc); return;                                       \
    case 4: tile_4_1_##L(x, ldx, w, pstride, kc, acc); return;                                       \
    case 5: tile_5_1_##L(x, ldx, w, pstride, kc, acc); return;                                       \
    default: tile_6_1_##L(x, ldx, w, pstride, kc, acc); return;
#else
#define RUN_TILE1_REST(L) default: tile_3_1_##L(x, ldx, w, pstride, kc, acc); return;
#endif
RUN_TILE(shift)
#if HAS_MOVSX
RUN_TILE(movsx)
#endif

/* Panels p0 .. p0 + np - 1 (np <= G) for rows row0 .. row0 + rows - 1 (rows <= MB): the slices of KC
 * features, row tiles of near-equal height, then the scales (and bias) per output. */
static void gemm_unit(const float *x, int64_t k, const int8_t *packed, int64_t n, const float *scales, const float *bias, float *y, int64_t p0, int64_t np,
                      int64_t row0, int64_t rows, int64_t rmax, int movsx) {
    float acc[MB * 2 * NR] __attribute__((aligned(64)));
    const int64_t tiles = (rows + rmax - 1) / rmax;
    memset(acc, 0, sizeof(float) * (size_t)(rows * np * NR));
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t kc = k - k0 < KC ? k - k0 : KC;
        const int8_t *w = packed + (p0 * k + k0) * NR;
        int64_t r0 = 0;
        for (int64_t t = 0; t < tiles; t++) { /* tiles of near-equal height */
            const int64_t left = rows - r0, h = (left + (tiles - t) - 1) / (tiles - t);
            const float *xt = x + (row0 + r0) * k + k0;
#if HAS_MOVSX
            if (movsx)
                run_tile_movsx(h, np, xt, k, w, k * NR, kc, acc + r0 * np * NR);
            else
#endif
                run_tile_shift(h, np, xt, k, w, k * NR, kc, acc + r0 * np * NR);
            r0 += h;
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < np; g++) {
            const int64_t col0 = (p0 + g) * NR, cols = n - col0 < NR ? n - col0 : NR;
            const float *ar = acc + (r * np + g) * NR, *s = scales + col0;
            float *yr = y + (row0 + r) * n + col0;
            float v[NR];
            if (movsx)
                for (int64_t j = 0; j < cols; j++) v[j] = ar[MOVSX_COL(j)];
            else
                memcpy(v, ar, sizeof(float) * (size_t)cols);
            if (bias)
                for (int64_t j = 0; j < cols; j++) yr[j] = v[j] * s[j] + bias[col0 + j];
            else
                for (int64_t j = 0; j < cols; j++) yr[j] = v[j] * s[j];
        }
}

/* y[m][n] = (x[m][k] . W^T) * scales[n] + bias[n]; packed from hf_contbatch_int8_pack; movsx: widen
 * with VPMOVSXBD (only where hf_contbatch_int8_has_movsx(); the same results).
 *
 * Threads: with one row block (m <= MB: decode and small prefills) each thread takes a contiguous
 * range of panels of near-equal count (the ranges differ by at most one panel), walked G at a time;
 * units of G panels dealt out whole would give one thread a G-panel unit more than the other (a
 * 960 x 320 weight's five panels: 4 against 1; 1,600 columns: 14 against 11). With more row blocks,
 * (panel group, row block) units, so each weight byte is still read by one thread per block row. */
void hf_contbatch_int8_gemm(const float *x, int64_t m, int64_t k, const int8_t *packed, int64_t n,
                            const float *scales, const float *bias, float *y, int64_t threads, int64_t movsx) {
    const int64_t panels = (n + NR - 1) / NR;
    /* Two panels a tile where the rows alone give too few independent FMA chains. */
    const int64_t G = m <= RMAX2 ? 2 : 1, rmax = G == 2 ? RMAX2 : RMAX1;
    const int mv = HAS_MOVSX && movsx;
    if (m <= MB) {
        const int64_t team = threads < panels ? threads : panels;
#pragma omp parallel num_threads(team) if (team > 1)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t pb = t * panels / nt, pe = (t + 1) * panels / nt;
            for (int64_t p0 = pb; p0 < pe; p0 += G)
                gemm_unit(x, k, packed, n, scales, bias, y, p0, pe - p0 < G ? pe - p0 : G, 0, m, rmax, mv);
        }
        return;
    }
    const int64_t groups = (panels + G - 1) / G, blocks = (m + MB - 1) / MB, units = groups * blocks;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && units > 1)
    for (int64_t u = 0; u < units; u++) {
        const int64_t gi = u / blocks, row0 = (u % blocks) * MB;
        const int64_t p0 = gi * G, np = panels - p0 < G ? panels - p0 : G;
        const int64_t rows = m - row0 < MB ? m - row0 : MB;
        gemm_unit(x, k, packed, n, scales, bias, y, p0, np, row0, rows, rmax, mv);
    }
}

/* ---- 2. Int8 activations: VPDPBUSD ---------------------------------------------------------------
 *
 * Each row of x is quantized on the fly, symmetric with one scale per row (dynamic per-token
 * activation quantization, as in LLM.int8()'s vector-wise quantization, Dettmers et al. 2022, and
 * oneDNN's / vLLM's W8A8): sx = absmax(x[r]) / 127 (1 for a zero row), xq = rint(x / sx) (round half
 * to even) in [-127, 127]. VPDPBUSD multiplies unsigned by signed bytes, so the kernel feeds
 * xu = xq + 128 (0..255) and removes the offset afterwards with the weight's column sums, which pack
 * computes once: sum_k xu*w = sum_k xq*w + 128 * colsum(w). Then y = (acc - 128*colsum) * sx * s[n]
 * (+ bias), rounded to float32 once per factor.
 *
 * int32 overflow: |xu * w| <= 255 * 127, so the sum stays below 2^31 for K <= 65,000; the Python side
 * refuses larger K.
 *
 * Layout: K padded to a multiple of 4 (zero weights), panels of NRQ = 4 vectors of int32 output
 * columns, [ceil(N/NRQ)][K4/4][NRQ][4]: one 32-bit broadcast of four activation bytes and one load of
 * NRQ x 4 weight bytes feed NV VPDPBUSDs per row. Tiles of up to 6 rows (AVX-512) / 3 rows (256-bit)
 * x 4 vectors, slices of KCQ quads (16 KB of weights with AVX-512) kept in L1, as above.
 *
 * Where the time goes (measured on Zen 5, 2026-12-02, busy machine: ratios only): the micro-kernel
 * alone, on a slice in L1, runs at 97% of a register-only VPDPBUSD loop; a whole 256- or 1,024-row call
 * at 62-87% of it on one thread (thread CPU time), a 32-row call at 52-73%. What was lost before: x converted to a float32 copy and y back
 * (torch passes), a scalar quantization loop (scalar division and a libm fmaxf call per element),
 * a fresh multi-MB scratch buffer per call (page faults), two OpenMP regions per call, and at decode
 * the memory idle while the row tiles after the first ran from L1. Now: x read as float32 or bfloat16
 * and y written in its dtype here, one vectorized quantization pass, one parallel region, and each
 * tile prefetching its share of the next weight slice. Tried without a measurable gain (left out):
 * x bytes grouped per row tile (one stream a tile instead of six rows), a software prefetch of the
 * next tile's x, prefetching the next slice to L2 only, 8 KB slices.
 *
 * One row (decode; Xeon with AVX512-VNNI, 2026-12-05, one thread's CPU time): in L1 a 960 x 960 call
 * takes 10 us where the weight-only kernel takes 31-38 us, so the time is the memory's. One panel
 * stream a thread with the next slice prefetched read SmolLM2-360M's shapes at 56-89% of the copy
 * bandwidth; prefetching 2 KB ahead in the stream instead, and two panels a tile (two streams,
 * qtile_pair), at 90-114% (the k/v projection's five panels, one call of 20 us, at about 60%: a
 * call's fixed costs). Prefetching the next panel a whole panel ahead was worse.
 *
 * Paths: AVX512-VNNI (_mm512_dpbusd_epi32, 16 columns a vector), AVX-VNNI (_mm256_dpbusd_avx_epi32,
 * 8), AVX2 without VNNI (the sums emulated exactly, below), else portable C with the same layout and
 * results (exact integer sums): correct but slow, so the tuner picks it only where nothing else runs int8. */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define QW 16
#define VNNI_ISA "avx512vnni"
#define QRMAX 6
typedef int32_t vi __attribute__((vector_size(64), aligned(4)));
static inline vi dpbusd(vi acc, vi u, vi w) { return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)w); }
#elif defined(__AVXVNNI__)
#define QW 8
#define VNNI_ISA "avxvnni"
#define QRMAX 3
typedef int32_t vi __attribute__((vector_size(32), aligned(4)));
static inline vi dpbusd(vi acc, vi u, vi w) { return (vi)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, (__m256i)w); }
#elif defined(__AVX2__)
#define QW 8
#define VNNI_ISA "avx2-madd"
#define QRMAX 3
typedef int32_t vi __attribute__((vector_size(32), aligned(4)));
/* VPDPBUSD emulated with the same exact int32 sums: the bytes widened to int16 (u zero-, w
 * sign-extended), VPMADDWD adding products in pairs (VPMADDUBSW would saturate: 255 x 127 x 2 >
 * 32767), VPHADDD adding pairs of pairs and VPERMQ putting the quads back in lane order. About 8
 * instructions where VNNI has one, but 5-10x the scalar loop below, which was all a CPU without
 * VNNI had (AMD Zen 3, 2026-12-05: every W8A8 kernel ran at 6-8 GOP/s, 3-5x slower than bf16's
 * F.linear). */
static inline vi dpbusd(vi acc, vi u, vi w) {
    const __m256i uu = (__m256i)u, ww = (__m256i)w;
    const __m256i p = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(uu)),
                                        _mm256_cvtepi8_epi16(_mm256_castsi256_si128(ww)));
    const __m256i q = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(uu, 1)),
                                        _mm256_cvtepi8_epi16(_mm256_extracti128_si256(ww, 1)));
    return (vi)_mm256_add_epi32((__m256i)acc, _mm256_permute4x64_epi64(_mm256_hadd_epi32(p, q), 0xD8));
}
#else
#define QW 8
#define VNNI_ISA "generic"
#define QRMAX 3
typedef int32_t vi __attribute__((vector_size(32), aligned(4)));
static inline vi dpbusd(vi acc, vi u, vi w) {
    uint8_t ub[4 * QW];
    int8_t wb[4 * QW];
    memcpy(ub, &u, sizeof(ub));
    memcpy(wb, &w, sizeof(wb));
    for (int l = 0; l < QW; l++)
        for (int t = 0; t < 4; t++) acc[l] += (int32_t)ub[4 * l + t] * (int32_t)wb[4 * l + t];
    return acc;
}
#endif
#define NRQ (NV * QW) /* output columns per panel */
/* bytes ahead in a panel's stream that a one-tile (decode) call prefetches: 2 KB read one row at
 * 69-104% of the one-thread copy bandwidth (copy GB/s counting read + written) where the next-slice
 * prefetch (16 KB ahead) read it at 56-89%; 1-3 KB within noise of each other, 4 KB and 8 KB worse
 * (SmolLM2-360M's shapes, one thread's CPU time, A/B in one process, Xeon with AVX512-VNNI,
 * 2026-12-05, shared machine) */
#ifndef QPF
#define QPF 2048
#endif
#ifndef KCQ
#define KCQ 64 /* quads (4 input features) per slice: KCQ x NRQ x 4 bytes */
#endif

int64_t hf_contbatch_int8_vnni_nr(void) { return NRQ; }
const char *hf_contbatch_int8_vnni_isa(void) { return VNNI_ISA; }

/* w [n][k] int8 -> out [ceil(n/NRQ)][ceil(k/4)][NRQ][4] (zero padded), colsum [n] = sum_k w[n][k]. */
void hf_contbatch_int8_vnni_pack(const int8_t *w, int64_t n, int64_t k, int8_t *out, int32_t *colsum) {
    const int64_t panels = (n + NRQ - 1) / NRQ, k4 = (k + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        int8_t *dst = out + p * k4 * NRQ * 4;
        for (int64_t q = 0; q < k4; q++)
            for (int64_t j = 0; j < NRQ; j++)
                for (int64_t t = 0; t < 4; t++) {
                    const int64_t row = p * NRQ + j, kk = 4 * q + t;
                    dst[(q * NRQ + j) * 4 + t] = row < n && kk < k ? w[row * k + kk] : 0;
                }
        for (int64_t j = 0; j < NRQ && p * NRQ + j < n; j++) {
            int32_t sum = 0;
            for (int64_t kk = 0; kk < k; kk++) sum += w[(p * NRQ + j) * k + kk];
            colsum[p * NRQ + j] = sum;
        }
    }
}

/* ---- Activation quantization: one pass per row, float32 or bfloat16 in -----------------------------
 *
 * xu [m][k4*4] = rint(x / sx) + 128 (pad bytes 128: their weights are 0), sx [m], in the row-major
 * byte layout the micro-kernel broadcasts from (four bytes of one row per VPDPBUSD). x is read as it
 * is (bfloat16 widened in registers: a bfloat16 is the top half of its float32), so no float32 copy
 * of x is made. Vectorized with AVX-512 (16 lanes, masked tails) or AVX2 (8 lanes); the division is
 * IEEE (VDIVPS, as the scalar one) and VCVTPS2DQ rounds half to even like rintf under the default
 * rounding mode, so every path gives the scalar loop's bytes. Each row depends on itself only. */
static inline float bf16_bits_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float load_x(const void *x, int bf16, int64_t i) {
    return bf16 ? bf16_bits_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline uint8_t quantize_one(float v, float s) {
    float q = __builtin_rintf(v / s);
    q = q > 127.f ? 127.f : q < -127.f ? -127.f : q; /* x / sx can round past 127 by an ulp */
    return (uint8_t)(int32_t)(q + 128.f);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline __m512 load16(const void *x, int bf16, int64_t i, __mmask16 mk) {
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)x + i)), 16));
    return _mm512_maskz_loadu_ps(mk, (const float *)x + i);
}

static void quantize_row(const void *x, int bf16, int64_t k, uint8_t *u, float *sx) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        const __mmask16 mk = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x, bf16, i, mk)));
    }
    const float a = _mm512_reduce_max_ps(amax), s = a > 0.f ? a / 127.f : 1.f;
    *sx = s;
    const __m512 vs = _mm512_set1_ps(s);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(128);
    for (int64_t i = 0; i < k; i += 16) {
        const __mmask16 mk = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
        __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(load16(x, bf16, i, mk), vs));
        q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);
        _mm512_mask_cvtepi32_storeu_epi8(u + i, mk, q);
    }
}
#elif defined(__AVX2__)
static inline __m256 load8(const void *x, int bf16, int64_t i) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    return _mm256_loadu_ps((const float *)x + i);
}

static void quantize_row(const void *x, int bf16, int64_t k, uint8_t *u, float *sx) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 amax8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) amax8 = _mm256_max_ps(amax8, _mm256_and_ps(load8(x, bf16, i), absmask));
    float lanes[8], a = 0.f;
    _mm256_storeu_ps(lanes, amax8);
    for (int l = 0; l < 8; l++) a = fmaxf(a, lanes[l]);
    for (; i < k; i++) a = fmaxf(a, fabsf(load_x(x, bf16, i)));
    const float s = a > 0.f ? a / 127.f : 1.f;
    *sx = s;
    const __m256 vs = _mm256_set1_ps(s);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127), off = _mm256_set1_epi32(128);
    for (i = 0; i + 8 <= k; i += 8) {
        __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(load8(x, bf16, i), vs));
        q = _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(q, lo), hi), off); /* 1..255 */
        const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(u + i), _mm_packus_epi16(w16, w16));
    }
    for (; i < k; i++) u[i] = quantize_one(load_x(x, bf16, i), s);
}
#else
static void quantize_row(const void *x, int bf16, int64_t k, uint8_t *u, float *sx) {
    float a = 0.f;
    for (int64_t i = 0; i < k; i++) a = fmaxf(a, fabsf(load_x(x, bf16, i)));
    const float s = a > 0.f ? a / 127.f : 1.f;
    *sx = s;
    for (int64_t i = 0; i < k; i++) u[i] = quantize_one(load_x(x, bf16, i), s);
}
#endif

static void quantize_rows(const void *x, int bf16, int64_t m, int64_t k, int64_t k4, uint8_t *xu, float *sx) {
    const size_t esize = bf16 ? 2 : 4;
    for (int64_t r = 0; r < m; r++) {
        uint8_t *ur = xu + r * k4 * 4;
        quantize_row((const char *)x + (size_t)(r * k) * esize, bf16, k, ur, sx + r);
        for (int64_t kk = k; kk < k4 * 4; kk++) ur[kk] = 128;
    }
}

/* float32 -> bfloat16 bits, round to nearest even (as torch's Tensor.to(torch.bfloat16)); NaN -> 0x7fc0. */
static inline uint16_t f32_to_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ---- The micro-kernel: R rows x NV vectors of int32 accumulators -----------------------------------
 *
 * Per quad of inputs: NV weight vectors loaded once, four activation bytes of each row broadcast from
 * memory (VPBROADCASTD), R x NV independent VPDPBUSD chains (24 with AVX-512: enough for two VNNI pipes
 * times their latency). Prefetch: while the tiles of a slice run from L1, each tile prefetches its
 * share of the next slice's lines (pf: its first line, pfs: bytes between its lines of successive
 * quads, pfn lines a quad), so at decode the next slice streams in from memory while this one is
 * computed (one row tile alone would leave the memory idle for the other tiles' time). */
#define QTILE(R)                                                                                     \
    static inline void qtile_##R(const uint8_t *xu, int64_t ldx, const int8_t *w, int64_t kq, int32_t *acc, \
                                 const char *pf, int64_t pfs, int pfn) {                             \
        vi a[R][NV];                                                                                 \
        for (int r = 0; r < R; r++)                                                                  \
            for (int v = 0; v < NV; v++) memcpy(&a[r][v], acc + r * NRQ + v * QW, sizeof(vi));      \
        for (int64_t q = 0; q < kq; q++) {                                                           \
            vi wv[NV];                                                                               \
            for (int v = 0; v < NV; v++) memcpy(&wv[v], w + (q * NRQ + v * QW) * 4, sizeof(vi));     \
            for (int i = 0; i < pfn; i++) __builtin_prefetch(pf + q * pfs + i * 64);                 \
            for (int r = 0; r < R; r++) {                                                            \
                int32_t quad;                                                                        \
                memcpy(&quad, xu + r * ldx + 4 * q, 4);                                              \
                vi u = (vi){0} + quad;                                                               \
                for (int v = 0; v < NV; v++) a[r][v] = dpbusd(a[r][v], u, wv[v]);                    \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < R; r++)                                                                  \
            for (int v = 0; v < NV; v++) memcpy(acc + r * NRQ + v * QW, &a[r][v], sizeof(vi));      \
    }
QTILE(1)
QTILE(2)
QTILE(3)
#if QRMAX > 3
QTILE(4)
QTILE(5)
QTILE(6)
#endif

static void run_qtile(int64_t h, const uint8_t *xu, int64_t ldx, const int8_t *w, int64_t kq, int32_t *acc,
                      const char *pf, int64_t pfs, int pfn) {
    switch (h) {
        case 1: qtile_1(xu, ldx, w, kq, acc, pf, pfs, pfn); return;
        case 2: qtile_2(xu, ldx, w, kq, acc, pf, pfs, pfn); return;
#if QRMAX > 3
        case 3: qtile_3(xu, ldx, w, kq, acc, pf, pfs, pfn); return;
        case 4: qtile_4(xu, ldx, w, kq, acc, pf, pfs, pfn); return;
        case 5: qtile_5(xu, ldx, w, kq, acc, pf, pfs, pfn); return;
        default: qtile_6(xu, ldx, w, kq, acc, pf, pfs, pfn); return;
#else
        default: qtile_3(xu, ldx, w, kq, acc, pf, pfs, pfn); return;
#endif
    }
}

/* One row, two panels at once (wa, wb: their slices of kq quads), 2 x NV int32 accumulators (acc: wa's
 * NRQ then wb's): twice the independent VPDPBUSD chains of qtile_1 and, above all, two weight streams
 * in flight with QPF bytes prefetched ahead in each (one stream a thread read a decode row at about
 * 80% of what two did). */
static inline void qtile_pair(const uint8_t *xu, const int8_t *wa, const int8_t *wb, int64_t kq, int32_t *acc) {
    vi a[2][NV];
    for (int s = 0; s < 2; s++)
        for (int v = 0; v < NV; v++) memcpy(&a[s][v], acc + s * NRQ + v * QW, sizeof(vi));
    for (int64_t q = 0; q < kq; q++) {
        int32_t quad;
        memcpy(&quad, xu + 4 * q, 4);
        const vi u = (vi){0} + quad;
        for (int s = 0; s < 2; s++) {
            const int8_t *w = (s ? wb : wa) + q * NRQ * 4;
            for (int v = 0; v < NV; v++) {
                vi wv;
                memcpy(&wv, w + v * QW * 4, sizeof(vi));
                a[s][v] = dpbusd(a[s][v], u, wv);
            }
            for (int i = 0; i < NRQ * 4 / 64; i++) __builtin_prefetch(w + QPF + i * 64);
        }
    }
    for (int s = 0; s < 2; s++)
        for (int v = 0; v < NV; v++) memcpy(acc + s * NRQ + v * QW, &a[s][v], sizeof(vi));
}

/* Bytes of scratch hf_contbatch_int8_vnni_gemm needs for m rows of k features. */
int64_t hf_contbatch_int8_vnni_scratch(int64_t m, int64_t k) { return m * ((k + 3) / 4) * 4 + m * 4 + 64; }

/* One output row's cols columns: y = (acc - 128 * colsum) * (sx * s) (+ bias), float32 or bfloat16
 * (rounded once from the float32 value, as torch's cast). Plain loops the compiler vectorizes. */
static inline void store_row(const int32_t *restrict ar, const int32_t *restrict colsum, const float *restrict s,
                             const float *restrict bias, float s_row, int64_t cols, void *yr, int bf16) {
    float v[NRQ];
    for (int64_t j = 0; j < cols; j++) v[j] = (float)(ar[j] - 128 * colsum[j]) * (s_row * s[j]);
    if (bias)
        for (int64_t j = 0; j < cols; j++) v[j] += bias[j];
    if (bf16) {
        uint16_t *restrict yb = (uint16_t *)yr;
        for (int64_t j = 0; j < cols; j++) yb[j] = f32_to_bf16_bits(v[j]);
    } else {
        memcpy(yr, v, sizeof(float) * (size_t)cols);
    }
}

/* y[m][n] = (quant(x) . W^T) * sx[m] * scales[n] + bias[n]; x and y float32 (bf16 = 0) or bfloat16
 * (bf16 = 1); scales and bias float32; packed/colsum from hf_contbatch_int8_vnni_pack; scratch of
 * hf_contbatch_int8_vnni_scratch(m, k) bytes.
 *
 * Threads take (panel, row block) units, panel-major: at decode (one block) each weight byte is read by
 * one thread; at prefill each thread's panels stay in its L2 while its row blocks pass over them. */
void hf_contbatch_int8_vnni_gemm(const void *x, int64_t m, int64_t k, const int8_t *packed, const int32_t *colsum,
                                 int64_t n, const float *scales, const float *bias, void *y, uint8_t *scratch,
                                 int64_t threads, int64_t bf16) {
    const int64_t k4 = (k + 3) / 4, panels = (n + NRQ - 1) / NRQ;
    const size_t esize = bf16 ? 2 : 4;
    float *sx = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    uint8_t *xu = (uint8_t *)(sx + m);
    const int64_t blocks = (m + MB - 1) / MB, units = panels * blocks;
    const int64_t panel_bytes = k4 * NRQ * 4, lines_per_quad = NRQ * 4 / 64;
    if (m == 1) {
        /* Decode: the row quantized once here (no barrier), then each thread a contiguous range of
         * panels of near-equal count, two panels at a time (qtile_pair). */
        quantize_rows(x, (int)bf16, 1, k, k4, xu, sx);
        const int64_t team = threads < panels ? threads : panels;
#pragma omp parallel num_threads(team) if (team > 1)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t pb = t * panels / nt, pe = (t + 1) * panels / nt;
            for (int64_t p = pb; p < pe; p += 2) {
                int32_t acc[2 * NRQ] __attribute__((aligned(64)));
                const int64_t np = pe - p < 2 ? pe - p : 2;
                const int8_t *panel = packed + p * panel_bytes;
                memset(acc, 0, sizeof(acc));
                for (int64_t q0 = 0; q0 < k4; q0 += KCQ) {
                    const int64_t kq = k4 - q0 < KCQ ? k4 - q0 : KCQ;
                    const int8_t *w = panel + q0 * NRQ * 4;
                    if (np == 2)
                        qtile_pair(xu + 4 * q0, w, w + panel_bytes, kq, acc);
                    else
                        run_qtile(1, xu + 4 * q0, k4 * 4, w, kq, acc, (const char *)w + QPF, NRQ * 4,
                                  (int)lines_per_quad);
                }
                for (int64_t g = 0; g < np; g++) {
                    const int64_t col0 = (p + g) * NRQ, cols = n - col0 < NRQ ? n - col0 : NRQ;
                    store_row(acc + g * NRQ, colsum + col0, scales + col0, bias ? bias + col0 : NULL, sx[0], cols,
                              (char *)y + (size_t)col0 * esize, (int)bf16);
                }
            }
        }
        return;
    }
    /* One parallel region (each costs a fork and a join, microseconds against a decode call's tens):
     * the rows' quantization, the implicit barrier, then the units. */
#pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            quantize_rows((const char *)x + (size_t)(r * k) * esize, (int)bf16, 1, k, k4, xu + r * k4 * 4, sx + r);
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            int32_t acc[MB * NRQ] __attribute__((aligned(64)));
            const int64_t p = u / blocks, row0 = (u % blocks) * MB;
            const int64_t rows = m - row0 < MB ? m - row0 : MB, tiles = (rows + QRMAX - 1) / QRMAX;
            const int8_t *panel = packed + p * panel_bytes;
            /* each tile prefetches pfn lines a quad of the next slice; the tiles together cover it */
            const int pfn = (int)((lines_per_quad + tiles - 1) / tiles);
            memset(acc, 0, sizeof(int32_t) * (size_t)(rows * NRQ));
            for (int64_t q0 = 0; q0 < k4; q0 += KCQ) {
                const int64_t kq = k4 - q0 < KCQ ? k4 - q0 : KCQ;
                const int8_t *w = panel + q0 * NRQ * 4;
                /* what this thread reads next, prefetched by the tiles: with one row tile (decode),
                 * QPF bytes ahead in this panel's stream (nothing else runs from this slice while a
                 * whole next slice would stream in); else the next slice: this panel's next, or
                 * (after its last) the next row block's first (the same panel, in cache) or the next
                 * panel's first */
                const char *next = (const char *)(tiles == 1 ? w + QPF
                                                  : q0 + KCQ < k4 ? w + kq * NRQ * 4
                                                  : row0 + MB < m ? panel : panel + panel_bytes);
                int64_t r0 = 0;
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t left = rows - r0, h = (left + (tiles - t) - 1) / (tiles - t);
                    run_qtile(h, xu + (row0 + r0) * k4 * 4 + 4 * q0, k4 * 4, w, kq, acc + r0 * NRQ,
                              next + t * pfn * 64, tiles * pfn * 64, pfn);
                    r0 += h;
                }
            }
            const int64_t col0 = p * NRQ, cols = n - col0 < NRQ ? n - col0 : NRQ;
            for (int64_t r = 0; r < rows; r++)
                store_row(acc + r * NRQ, colsum + col0, scales + col0, bias ? bias + col0 : NULL, sx[row0 + r], cols,
                          (char *)y + (size_t)((row0 + r) * n + col0) * esize, (int)bf16);
        }
    }
}

/* ---- 3. The passes around a library int8 GEMM (torch._int_mm: oneDNN's VNNI / AMX-int8) -----------
 *
 * w8a8_torch.IntMMW8A8GEMM runs the scheme above as three calls: rows quantized here to signed int8
 * (xq [m][k], sx [m]), the int32 sums by torch._int_mm, and the sums scaled here into the output.
 * torch's elementwise version of the two passes (float32 copy of x, abs, amax, where, div, round,
 * clamp, cast; then float, two multiplies, bias, cast) cost more than the AMX GEMM at prefill row
 * counts (SmolLM2-360M's shapes, 64-1,024 rows, one thread, 2026-12-05): one read of x and one write
 * of y each here. */

/* xq [m][k] = rint(x / sx) in [-127, 127], sx [m] = absmax(x[r]) / 127 (1 for a zero row): the bytes
 * of quantize_row (the part-2 kernel's, offset by 128 there) and of w8a8_torch.quantize_rows (same
 * float32 division, round half to even, clamp). x float32 (bf16 = 0) or bfloat16 (bf16 = 1). */
void hf_contbatch_int8_quantize_s8(const void *x, int64_t m, int64_t k, int64_t bf16, int8_t *xq, float *sx,
                                   int64_t threads) {
    const size_t esize = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m > 1)
    for (int64_t r = 0; r < m; r++) {
        uint8_t *u = (uint8_t *)xq + r * k;
        quantize_row((const char *)x + (size_t)(r * k) * esize, (int)bf16, k, u, sx + r);
        for (int64_t i = 0; i < k; i++) u[i] ^= 0x80; /* xq + 128 -> xq (two's complement) */
    }
}

/* y[r][j] = ((float)acc[r][j] * sx[r]) * s[j] (+ bias[j]), each operation rounded to float32 in that
 * order (torch's acc.float().mul_(sx).mul_(s).add_(bias): no fused multiply-add, hence the attribute
 * against the build's -ffp-contract=fast), then rounded once to bfloat16 (nearest even) where
 * bf16 = 1. The order differs from part 2's (acc * (sx * s)): the two W8A8 paths share their int32
 * sums, not always their last float bit. */
__attribute__((optimize("fp-contract=off"))) void hf_contbatch_int8_scale_out(
    const int32_t *acc, int64_t m, int64_t n, const float *sx, const float *s, const float *bias, void *y,
    int64_t bf16, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m > 1)
    for (int64_t r = 0; r < m; r++) {
        const int32_t *restrict ar = acc + r * n;
        const float sr = sx[r];
        for (int64_t j0 = 0; j0 < n; j0 += 256) {
            const int64_t cols = n - j0 < 256 ? n - j0 : 256;
            float v[256];
            for (int64_t j = 0; j < cols; j++) v[j] = (float)ar[j0 + j] * sr;
            for (int64_t j = 0; j < cols; j++) v[j] = v[j] * s[j0 + j];
            if (bias)
                for (int64_t j = 0; j < cols; j++) v[j] = v[j] + bias[j0 + j];
            if (bf16) {
                uint16_t *restrict yb = (uint16_t *)y + r * n + j0;
                for (int64_t j = 0; j < cols; j++) yb[j] = f32_to_bf16_bits(v[j]);
            } else {
                memcpy((float *)y + r * n + j0, v, sizeof(float) * (size_t)cols);
            }
        }
    }
}
