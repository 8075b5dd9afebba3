/* Weight-only int8 GEMM for serving steps: y[M][N] = (x[M][K] . Wq^T) * s[N] (+ bias), x and y
 * float32, Wq int8 (symmetric, one scale per output channel: torchao's int8 weight-only scheme).
 *
 * Built on first use by hf_contbatch/kernels/linears/int8_gemm.py with the system C compiler
 * (-O3 -march=native -fopenmp, no -ffast-math) and called through ctypes.
 *
 * Why: a decode step streams every weight once; int8 weights are a quarter of float32's bytes. The
 * weights are dequantized in registers ("dequantize-in-register", as in weight-only kernels such as
 * torch's _weight_int8pack_mm and llama.cpp's): each int8 vector is loaded, widened to int32,
 * converted to float32 and multiplied into float32 accumulators with FMA; the per-channel scale is
 * applied once per output at the end. Activations stay float32, so there is no activation
 * quantization error.
 *
 * Layout: W is packed once into panels of NR = 16 output columns, [ceil(N/NR)][K][NR] (zero
 * columns pad the last panel), so a panel streams sequentially. Threads take whole panels; inside a
 * panel, rows go in tiles of up to MR = 8 rows, each with one accumulator vector per row, so the
 * load and conversion of a weight vector is shared by the tile's rows.
 *
 * Vectors are GCC/Clang vector extensions: with -march=native they compile to AVX-512
 * (vpmovsxbd + vcvtdq2ps + vfmadd on one zmm), to AVX2 (two ymm halves) or to NEON, so each ISA
 * path is the compiler's for the CPU it builds on (the feature macros below name it), and
 * hf_contbatch_int8_runtime_ok() checks at load that the CPU running it has that ISA (a library
 * cached on disk for another CPU of the same family string must not be run).
 *
 * Exactness: each output's sum is one in-order FMA chain over k = 0..K-1 (no -ffast-math), so a
 * row's result does not depend on the batch it runs in, the tile it lands in or sibling columns
 * packed beside it. Against F.linear(x, Wq * s) only the order of rounding differs (the scale is
 * applied after the sum rather than to each weight).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define INT8_ISA "avx512f"
#elif defined(__AVX2__) && defined(__FMA__)
#define INT8_ISA "avx2"
#elif defined(__ARM_NEON)
#define INT8_ISA "neon"
#else
#define INT8_ISA "generic"
#endif

#define NR 16
#define MR 8

typedef float vf __attribute__((vector_size(NR * 4), aligned(4)));
typedef int8_t vb __attribute__((vector_size(NR), aligned(1)));

int64_t hf_contbatch_int8_nr(void) { return NR; }
const char *hf_contbatch_int8_isa(void) { return INT8_ISA; }

/* 1 when the CPU running this has the vector ISA the library was compiled for. */
int hf_contbatch_int8_runtime_ok(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
#if defined(__AVX512F__)
    return __builtin_cpu_supports("avx512f") ? 1 : 0;
#elif defined(__AVX2__) && defined(__FMA__)
    return (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 1 : 0;
#else
    return 1;
#endif
#else
    return 1;
#endif
}

/* w [n][k] int8 -> out [ceil(n/NR)][k][NR], zero padded. */
void hf_contbatch_int8_pack(const int8_t *w, int64_t n, int64_t k, int8_t *out) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++) {
        int8_t *dst = out + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++) {
            for (int64_t j = 0; j < NR; j++) {
                int64_t row = p * NR + j;
                dst[kk * NR + j] = row < n ? w[row * k + kk] : 0;
            }
        }
    }
}

static inline vf load_w(const int8_t *p) {
    vb b;
    memcpy(&b, p, NR);
    return __builtin_convertvector(b, vf);
}

static inline void store_row(float *y, vf acc, const float *s, const float *bias, int64_t cols) {
    float tmp[NR];
    memcpy(tmp, &acc, sizeof(tmp));
    for (int64_t j = 0; j < cols; j++) {
        float v = tmp[j] * s[j];
        y[j] = bias ? v + bias[j] : v;
    }
}

/* One tile of R rows over one panel: R accumulators kept in registers (R fixed per instance). */
#define TILE(R)                                                                                    \
    static void tile_##R(const float *x, int64_t k, const int8_t *panel, float *y, int64_t n,      \
                         const float *s, const float *bias, int64_t cols) {                        \
        vf acc[R];                                                                                 \
        for (int r = 0; r < R; r++) acc[r] = (vf){0};                                              \
        for (int64_t kk = 0; kk < k; kk++) {                                                       \
            vf w = load_w(panel + kk * NR);                                                        \
            for (int r = 0; r < R; r++) acc[r] += x[r * k + kk] * w;                               \
        }                                                                                          \
        for (int r = 0; r < R; r++) store_row(y + r * n, acc[r], s, bias, cols);                   \
    }
TILE(1)
TILE(2)
TILE(3)
TILE(4)
TILE(5)
TILE(6)
TILE(7)
TILE(8)

typedef void (*tile_fn)(const float *, int64_t, const int8_t *, float *, int64_t, const float *, const float *,
                        int64_t);
static const tile_fn TILES[MR + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8};

/* y[m][n] = (x[m][k] . W^T) * scales[n] + bias[n]; packed from hf_contbatch_int8_pack. */
void hf_contbatch_int8_gemm(const float *x, int64_t m, int64_t k, const int8_t *packed, int64_t n,
                            const float *scales, const float *bias, float *y, int64_t threads) {
    int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && panels > 1)
    for (int64_t p = 0; p < panels; p++) {
        const int8_t *panel = packed + p * k * NR;
        int64_t col = p * NR;
        int64_t cols = n - col < NR ? n - col : NR;
        const float *b = bias ? bias + col : 0;
        for (int64_t i = 0; i < m; i += MR) {
            int64_t rows = m - i < MR ? m - i : MR;
            TILES[rows](x + i * k, k, panel, y + i * n + col, n, scales + col, b, cols);
        }
    }
}
