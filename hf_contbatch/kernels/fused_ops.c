/* The small element-wise operations around a decoder layer's GEMMs, one pass each: RMSNorm (sum of
 * squares, reciprocal square root, scale), SiLU-and-mul (silu(gate) * up), the rotary embedding of
 * q and k, and a residual add with the RMSNorm after it; float32, bfloat16 and float16.
 *
 * Built on first use by hf_contbatch/kernels/fused_ops.py with the system C compiler (-O3
 * -march=native -fopenmp, no -ffast-math) and called through ctypes on torch's own OpenMP runtime.
 *
 * Why: transformers' eager modules run these as 5-7 torch ops each (pow, mean, add, rsqrt, mul,
 * cast, mul), every op a dispatch, an allocation and a pass over the activations; on a small model
 * the per-op cost is most of the step ("model other" in benchmarks/bench_breakdown.py).
 *
 * RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019), as
 * transformers' modules compute it, in float32:
 *   r = 1 / sqrt(sum(x * x) / n + eps)          (torch's rsqrt is 1/sqrt; its CPU mean is sum / n)
 *   round_first = 1 (Llama):  y = cast(scale * cast(x * r))   (x * r rounded to the input dtype first)
 *   round_first = 0 (Gemma, OLMo2): y = cast(scale * (x * r)) (product in float32, one rounding)
 * where scale is the float32 weight, or 1 + weight for Gemma (the caller passes it). The sum of
 * squares runs over 16 fixed lanes whatever the vector width, so the AVX-512, AVX2 and scalar builds
 * give the same bits; torch's own reduction order differs, so an output may differ from the
 * module's by an ulp (greedy decoding is checked against transformers' generate).
 *
 * SiLU (Elfwing et al. 2018; Ramachandran et al. 2017): silu(g) = g / (1 + exp(-g)) as torch
 * computes it, with exp from a Cephes-style polynomial (Moshier's expf: range reduction by ln 2 in
 * two parts, degree-6 minimax polynomial; within 2 ulp of the true value), then times up. In
 * bfloat16, as torch: silu rounded to bfloat16, then the product computed in float32 and rounded.
 *
 * Rows are independent; threads take rows when there is enough work (OpenMP `if`).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define FUSED_ISA "avx512f"
#elif defined(__AVX2__)
#define FUSED_ISA "avx2"
#elif defined(__ARM_NEON)
#define FUSED_ISA "neon"
#else
#define FUSED_ISA "generic"
#endif

#define LANES 16            /* partial sums of squares: fixed, so every ISA adds in one order */
#define PARALLEL_MIN 32768  /* elements below which one thread is faster than waking the team */

const char *hf_contbatch_fused_isa(void) { return FUSED_ISA; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, NaN kept quiet: c10::BFloat16's conversion. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* float16 <-> float32, exact widening and round to nearest even as c10::Half (NaN kept a NaN).
 * Where the CPU computes in float16 (AVX512-FP16) or converts it in NEON's vectors, through the
 * compiler's _Float16. Elsewhere on x86 (no AVX512-FP16: Ice Lake, Zen 4 and older) GCC converts
 * _Float16 one value at a time (F16C's scalar VCVTPH2PS, or a libgcc call), which kept the float16
 * loops from vectorizing: 5-10x slower than float32 (benchmarks/bench_half_ops.py, emulated); there
 * the conversions are integer and float selects that vectorize like bfloat16's. */
#if defined(__FLT16_MAX__) && (defined(__AVX512FP16__) || defined(__ARM_NEON))
#define HAS_F16 1
static inline float f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}
static inline uint16_t f32_to_f16(float f) {
    const _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}
static inline float round_f16(float f) { return (float)(_Float16)f; }
#elif defined(__x86_64__) || defined(__i386__)
#define HAS_F16 1
/* Sign, then by class: subnormal or zero (exponent 0: the mantissa times 2^-24, exact in float32),
 * infinity or NaN (exponent 31: float32's exponent 255, payload kept, made quiet as torch and F16C
 * do), normal
 * (exponent rebiased from 15 to 127: + 112 << 23 on the shifted bits). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t mag = h & 0x7fffu;
    const float sub = (float)(int32_t)mag * 0x1p-24f; /* signed: converts in vectors without branches */
    uint32_t sub_bits;
    memcpy(&sub_bits, &sub, 4);
    const uint32_t normal_bits = (mag << 13) + (112u << 23);
    const uint32_t special_bits = (mag << 13) | 0x7f800000u | (mag > 0x7c00u ? 0x400000u : 0u); /* NaN: quiet */
    /* Blended by masks, not selected: with a select GCC 12 moves the float product into the
     * subnormal branch only, and then (trapping math) will not vectorize the loop. */
    const uint32_t is_sub = 0u - (uint32_t)(mag < 0x400u);
    const uint32_t other = mag >= 0x7c00u ? special_bits : normal_bits;
    const uint32_t bits = (sub_bits & is_sub) | (other & ~is_sub) | (uint32_t)(h & 0x8000u) << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}
/* |f| >= 65536 (2^16, past the largest float16 65504 and the halfway point 65520 that rounds up)
 * or infinite: infinity; NaN: the quiet NaN 0x7e00; |f| >= 2^-14 (normal float16): exponent
 * rebiased, the 13 dropped mantissa bits rounded to nearest even by adding 0xfff plus the kept
 * last bit (a carry into the exponent is the right result, up to infinity at 65520); below it
 * (subnormal float16 or zero): |f| * 2^24, exact, rounded to an integer by the 1.5 * 2^23 shifter
 * (the default rounding mode, nearest even; 0x400 when it rounds up into the smallest normal). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t sign = (bits >> 16) & 0x8000u, mag = bits & 0x7fffffffu;
    const uint32_t rebased = mag - (112u << 23);
    const uint32_t normal = (rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13;
    float a;
    memcpy(&a, &mag, 4);
    const uint32_t sub = (uint32_t)(int32_t)((a * 0x1p24f + 12582912.0f) - 12582912.0f); /* < 2^22 when used */
    const uint32_t out = mag > 0x7f800000u ? 0x7e00u : (mag >= 0x47800000u ? 0x7c00u : (mag >= 0x38800000u ? normal : sub));
    return (uint16_t)(sign | out);
}
static inline float round_f16(float f) { return f16_to_f32(f32_to_f16(f)); }
#else
#define HAS_F16 0
#endif

/* The conversions above over arrays, for tests (against torch's, every float16 value). */
#if HAS_F16
void hf_contbatch_fused_f16_to_f32(const uint16_t *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = f16_to_f32(x[i]);
}
void hf_contbatch_fused_f32_to_f16(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = f32_to_f16(x[i]);
}
#endif

/* x86 without AVX512-FP16 but with F16C (every AVX2 CPU): the float16 ops below run on blocks of
 * float32 values, converted 8 at a time by F16C's vectors (VCVTPH2PS exact, VCVTPS2PH round to
 * nearest even: the conversions above, 8 at a time): element-wise conversions, even vectorized,
 * cost more than the ops themselves (each float16 op converts 3-8 times an element). */
#if HAS_F16 && defined(__F16C__) && !defined(__AVX512FP16__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define F16_BLOCKS 1
#define F16_BLOCK 256 /* float32 values per block: a few KiB of stack */
static inline void f16_load(const uint16_t *src, float *dst, int64_t n) {
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + k))));
    for (; k < n; ++k) dst[k] = f16_to_f32(src[k]);
}
static inline void f16_store(const float *src, uint16_t *dst, int64_t n) {
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        _mm_storeu_si128((__m128i *)(dst + k), _mm256_cvtps_ph(_mm256_loadu_ps(src + k), _MM_FROUND_TO_NEAREST_INT));
    for (; k < n; ++k) dst[k] = f32_to_f16(src[k]);
}
static inline void f16_round(float *x, int64_t n) { /* each value rounded to float16 and back */
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(x + k, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + k), _MM_FROUND_TO_NEAREST_INT)));
    for (; k < n; ++k) x[k] = round_f16(x[k]);
}
#else
#define F16_BLOCKS 0
#endif

/* exp(x) for float32: Cephes expf (S. L. Moshier), branch-free so loops vectorize. */

static inline __attribute__((always_inline)) float exp_f32(float x) {
    const float hi = 88.3762626647949f, lo = -103.972077083991796f;
    float big = x > hi ? 1.0f : 0.0f, tiny = x < lo ? 1.0f : 0.0f;
    x = x > hi ? hi : (x < lo ? lo : x);
    /* round to nearest by the 1.5 * 2^23 shifter (exact: no -ffast-math), which vectorizes where floorf may not */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    /* 2^n in two factors: n reaches -150 for x near lo, below the smallest normal exponent */
    int32_t ni = (int32_t)n, n1 = ni >> 1, n2 = ni - n1;
    uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, 4);
    memcpy(&s2, &b2, 4);
    float y = p * s1 * s2;
    y = big != 0.0f ? INFINITY : y;
    return tiny != 0.0f ? 0.0f : y;
}


static inline __attribute__((always_inline)) float silu_f32(float g) { return g / (1.0f + exp_f32(-g)); }

static inline float inv_rms(const float *x, int64_t n, float eps) {
    float acc[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += x[k + l] * x[k + l];
    for (int l = 0; k < n; ++k, ++l) acc[l] += x[k] * x[k];
    for (int w = LANES / 2; w; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return 1.0f / sqrtf(acc[0] / (float)n + eps);
}

/* x [rows] x [n] (row stride x_stride elements), scale [n] float32, y [rows][n] (row stride y_stride). */
void hf_contbatch_rms_norm_f32(const float *x, int64_t rows, int64_t n, int64_t x_stride, const float *scale,
                               float eps, float *y, int64_t y_stride, int32_t threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN && threads > 1) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
        const float *xi = x + i * x_stride;
        float *yi = y + i * y_stride;
        float r = inv_rms(xi, n, eps);
        for (int64_t k = 0; k < n; ++k) yi[k] = scale[k] * (xi[k] * r);
    }
}

/* The half-precision rows: widened to float32 (exact), normalized in float32, rounded once at the
 * end (or, round_first, also before the scale, Llama's order), as torch's ops on the dtype do. */
#define RMS_NORM_HALF(NAME, TO_F32, FROM_F32, ROUND)                                                    \
    void hf_contbatch_rms_norm_##NAME(const uint16_t *x, int64_t rows, int64_t n, int64_t x_stride,     \
                                      const float *scale, float eps, int32_t round_first, uint16_t *y,   \
                                      int64_t y_stride, int32_t threads) {                               \
        _Pragma("omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN && threads > 1) schedule(static)") \
        for (int64_t i = 0; i < rows; ++i) {                                                             \
            const uint16_t *xi = x + i * x_stride;                                                       \
            uint16_t *yi = y + i * y_stride;                                                             \
            float buf[n > 0 ? n : 1];                                                                    \
            for (int64_t k = 0; k < n; ++k) buf[k] = TO_F32(xi[k]);                                      \
            float r = inv_rms(buf, n, eps);                                                              \
            if (round_first)                                                                             \
                for (int64_t k = 0; k < n; ++k) yi[k] = FROM_F32(scale[k] * ROUND(buf[k] * r));          \
            else                                                                                         \
                for (int64_t k = 0; k < n; ++k) yi[k] = FROM_F32(scale[k] * (buf[k] * r));              \
        }                                                                                                \
    }
RMS_NORM_HALF(bf16, bf16_to_f32, f32_to_bf16, round_bf16)
#if HAS_F16 && !F16_BLOCKS
RMS_NORM_HALF(f16, f16_to_f32, f32_to_f16, round_f16)
#endif

/* gate and up [rows][n] with their own row strides (they may be two halves of one fused GEMM
 * output), y [rows][n] contiguous. */
void hf_contbatch_silu_mul_f32(const float *gate, const float *up, int64_t rows, int64_t n, int64_t g_stride,
                               int64_t u_stride, float *y, int32_t threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN && threads > 1) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
        const float *restrict g = gate + i * g_stride, *restrict u = up + i * u_stride;
        float *restrict yi = y + i * n;
#pragma omp simd
        for (int64_t k = 0; k < n; ++k) yi[k] = silu_f32(g[k]) * u[k];
    }
}

#define SILU_MUL_HALF(NAME, TO_F32, FROM_F32, ROUND)                                                  \
    void hf_contbatch_silu_mul_##NAME(const uint16_t *gate, const uint16_t *up, int64_t rows, int64_t n, \
                                      int64_t g_stride, int64_t u_stride, uint16_t *y, int32_t threads) { \
        _Pragma("omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN && threads > 1) schedule(static)") \
        for (int64_t i = 0; i < rows; ++i) {                                                             \
            const uint16_t *restrict g = gate + i * g_stride, *restrict u = up + i * u_stride;           \
            uint16_t *restrict yi = y + i * n;                                                           \
            _Pragma("omp simd")                                                                          \
            for (int64_t k = 0; k < n; ++k) {                                                            \
                float s = ROUND(silu_f32(TO_F32(g[k])));                                                 \
                yi[k] = FROM_F32(s * TO_F32(u[k]));                                                      \
            }                                                                                            \
        }                                                                                                \
    }
SILU_MUL_HALF(bf16, bf16_to_f32, f32_to_bf16, round_bf16)
#if HAS_F16 && !F16_BLOCKS
SILU_MUL_HALF(f16, f16_to_f32, f32_to_f16, round_f16)
#endif

/* Rotary position embedding (Su et al., "RoFormer", 2021) in transformers' rotate-half form, as its
 * eager apply_rotary_pos_emb computes it on one head's d features at one position:
 *   y = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[h:], x[:h]),  h = d / 2 (floor)
 * i.e. with m = d - h, rot[k] = -x[h + k] for k < m, x[k - m] after. Each product is rounded, then
 * the sum (no fused multiply-add: the file is built with -ffp-contract=off), so float32 gives
 * torch's bits; in bfloat16/float16 each op's result is rounded to the dtype as torch's eager ops
 * round it (neg is exact). Negating before the product equals torch's neg-then-mul bit for bit.
 *
 * Partial rotary (Phi-3's form with cos narrower than the head): the first `rot` features of each
 * head are rotated as above with d = rot, the other d - rot copied (transformers' cat of the rotated
 * part and the rest); rot = d for the whole head.
 *
 * x: rows (positions) of `heads` heads of d features, row stride x_stride elements (a column slice
 * of a fused q/k/v GEMM output); cos, sin: [rows][rot] at row stride cs_stride; y: [rows][heads][d]
 * contiguous, the [T, H, D] layout the paged attention reads (the transpose is folded in). */
void hf_contbatch_rotary_f32(const float *x, int64_t rows, int64_t heads, int64_t d, int64_t rot, int64_t x_stride,
                             const float *cos, const float *sin, int64_t cs_stride, float *y, int32_t threads) {
#pragma omp parallel for num_threads(threads) if (rows * heads * d >= PARALLEL_MIN && threads > 1) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t h = rot / 2, m = rot - h;
        const float *c = cos + i * cs_stride, *s = sin + i * cs_stride;
        for (int64_t j = 0; j < heads; ++j) {
            const float *restrict xi = x + i * x_stride + j * d;
            float *restrict yi = y + (i * heads + j) * d;
            for (int64_t k = 0; k < m; ++k) yi[k] = xi[k] * c[k] + (-xi[h + k]) * s[k];
            for (int64_t k = m; k < rot; ++k) yi[k] = xi[k] * c[k] + xi[k - m] * s[k];
            for (int64_t k = rot; k < d; ++k) yi[k] = xi[k];
        }
    }
}

#define ROTARY_HALF(NAME, TO_F32, FROM_F32, ROUND)                                                      \
    void hf_contbatch_rotary_##NAME(const uint16_t *x, int64_t rows, int64_t heads, int64_t d,          \
                                    int64_t rot, int64_t x_stride, const uint16_t *cos,                 \
                                    const uint16_t *sin, int64_t cs_stride, uint16_t *y, int32_t threads) { \
        _Pragma("omp parallel for num_threads(threads) if (rows * heads * d >= PARALLEL_MIN && threads > 1) schedule(static)") \
        for (int64_t i = 0; i < rows; ++i) {                                                                  \
            const int64_t h = rot / 2, m = rot - h;                                                           \
            for (int64_t j = 0; j < heads; ++j) {                                                             \
                const uint16_t *xi = x + i * x_stride + j * d;                                                \
                const uint16_t *c = cos + i * cs_stride, *s = sin + i * cs_stride;                            \
                uint16_t *yi = y + (i * heads + j) * d;                                                       \
                for (int64_t k = 0; k < rot; ++k) {                                                           \
                    float r = k < m ? -TO_F32(xi[h + k]) : TO_F32(xi[k - m]);                                 \
                    float a = ROUND(TO_F32(xi[k]) * TO_F32(c[k])), b = ROUND(r * TO_F32(s[k]));               \
                    yi[k] = FROM_F32(a + b);                                                                  \
                }                                                                                         \
                for (int64_t k = rot; k < d; ++k) yi[k] = xi[k];                                          \
            }                                                                                             \
        }                                                                                                 \
    }
ROTARY_HALF(bf16, bf16_to_f32, f32_to_bf16, round_bf16)
#if HAS_F16 && !F16_BLOCKS
ROTARY_HALF(f16, f16_to_f32, f32_to_f16, round_f16)
#endif

/* A decoder layer's residual add and the RMSNorm after it, one pass over each row:
 *   sum = residual + x            (rounded to the dtype, as torch's add)
 *   y   = RMSNorm(sum)            (as hf_contbatch_rms_norm_*, round_first as there)
 * x and residual [rows][n] at their own row strides; sum and y [rows][n] contiguous. */
void hf_contbatch_add_rms_norm_f32(const float *x, const float *res, int64_t rows, int64_t n, int64_t x_stride,
                                   int64_t r_stride, const float *scale, float eps, float *sum, float *y,
                                   int32_t threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN && threads > 1) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
        const float *restrict xi = x + i * x_stride, *restrict ri = res + i * r_stride;
        float *restrict si = sum + i * n, *restrict yi = y + i * n;
        for (int64_t k = 0; k < n; ++k) si[k] = ri[k] + xi[k];
        float r = inv_rms(si, n, eps);
        for (int64_t k = 0; k < n; ++k) yi[k] = scale[k] * (si[k] * r);
    }
}

#define ADD_RMS_NORM_HALF(NAME, TO_F32, FROM_F32, ROUND)                                                \
    void hf_contbatch_add_rms_norm_##NAME(const uint16_t *x, const uint16_t *res, int64_t rows, int64_t n, \
                                          int64_t x_stride, int64_t r_stride, const float *scale, float eps, \
                                          int32_t round_first, uint16_t *sum, uint16_t *y, int32_t threads) { \
        _Pragma("omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN && threads > 1) schedule(static)") \
        for (int64_t i = 0; i < rows; ++i) {                                                             \
            const uint16_t *xi = x + i * x_stride, *ri = res + i * r_stride;                             \
            uint16_t *si = sum + i * n, *yi = y + i * n;                                                 \
            float buf[n > 0 ? n : 1];                                                                    \
            for (int64_t k = 0; k < n; ++k) {                                                            \
                si[k] = FROM_F32(TO_F32(ri[k]) + TO_F32(xi[k]));                                         \
                buf[k] = TO_F32(si[k]);                                                                  \
            }                                                                                            \
            float r = inv_rms(buf, n, eps);                                                              \
            if (round_first)                                                                             \
                for (int64_t k = 0; k < n; ++k) yi[k] = FROM_F32(scale[k] * ROUND(buf[k] * r));          \
            else                                                                                         \
                for (int64_t k = 0; k < n; ++k) yi[k] = FROM_F32(scale[k] * (buf[k] * r));              \
        }                                                                                                \
    }
ADD_RMS_NORM_HALF(bf16, bf16_to_f32, f32_to_bf16, round_bf16)
#if HAS_F16 && !F16_BLOCKS
ADD_RMS_NORM_HALF(f16, f16_to_f32, f32_to_f16, round_f16)
#endif

/* An RMSNorm of q or k and the rotary embedding after it, one pass over each row: Qwen3's per-head
 * q_norm/k_norm (norm_heads = 1: each head normalized over its d features) or OLMo2's over the whole
 * projection (norm_heads = heads), between the projections and rotary:
 *   n = RMSNorm(x[g])             over each group g of norm_heads * d features, as
 *                                 hf_contbatch_rms_norm_* (scale [norm_heads * d], eps, round_first;
 *                                 rounded to the dtype, as the module returns it)
 *   y = n * cos + rotate_half(n) * sin   per head, as hf_contbatch_rotary_*
 * so the result has the bits of rms_norm then rotary. x: rows of `heads` heads of d features at row
 * stride x_stride (a column slice of a fused q/k/v output); heads a multiple of norm_heads;
 * y [rows][heads][d]. */
#define NORM_ROTARY(NAME, T, TO_F32, FROM_F32, ROUND)                                                    \
    void hf_contbatch_rms_norm_rotary_##NAME(const T *x, int64_t rows, int64_t heads, int64_t d,          \
                                             int64_t x_stride, int64_t norm_heads, const float *scale,   \
                                             float eps, int32_t round_first, const T *cos, const T *sin, \
                                             int64_t cs_stride, T *y, int32_t threads) {                 \
        _Pragma("omp parallel for num_threads(threads) if (rows * heads * d >= PARALLEL_MIN && threads > 1) schedule(static)") \
        for (int64_t i = 0; i < rows; ++i) {                                                             \
            const int64_t h = d / 2, m = d - h, w = norm_heads * d;                                      \
            const T *c = cos + i * cs_stride, *s = sin + i * cs_stride;                                  \
            float buf[w > 0 ? w : 1], nrm[w > 0 ? w : 1];                                                \
            for (int64_t g = 0; g < heads; g += norm_heads) {                                            \
                const T *xg = x + i * x_stride + g * d;                                                  \
                for (int64_t k = 0; k < w; ++k) buf[k] = TO_F32(xg[k]);                                  \
                const float r = inv_rms(buf, w, eps);                                                    \
                if (round_first)                                                                         \
                    for (int64_t k = 0; k < w; ++k) nrm[k] = TO_F32(FROM_F32(scale[k] * ROUND(buf[k] * r))); \
                else                                                                                     \
                    for (int64_t k = 0; k < w; ++k) nrm[k] = TO_F32(FROM_F32(scale[k] * (buf[k] * r)));  \
                for (int64_t j = 0; j < norm_heads; ++j) {                                               \
                    const float *nj = nrm + j * d;                                                       \
                    T *yi = y + (i * heads + g + j) * d;                                                 \
                    for (int64_t k = 0; k < d; ++k) {                                                    \
                        float rot = k < m ? -nj[h + k] : nj[k - m];                                      \
                        float a = ROUND(nj[k] * TO_F32(c[k])), b = ROUND(rot * TO_F32(s[k]));            \
                        yi[k] = FROM_F32(a + b);                                                         \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }
static inline float same_f32(float f) { return f; }
NORM_ROTARY(f32, float, same_f32, same_f32, same_f32)
NORM_ROTARY(bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)
#if HAS_F16
NORM_ROTARY(f16, uint16_t, f16_to_f32, f32_to_f16, round_f16)
#endif

#if F16_BLOCKS
/* The float16 ops in blocks of float32 values (F16_BLOCKS above): the same operations and roundings
 * as the element-wise macros, so the same bits. */
void hf_contbatch_rms_norm_f16(const uint16_t *x, int64_t rows, int64_t n, int64_t x_stride, const float *scale,
                               float eps, int32_t round_first, uint16_t *y, int64_t y_stride, int32_t threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN && threads > 1) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
        float buf[n > 0 ? n : 1], t[F16_BLOCK];
        f16_load(x + i * x_stride, buf, n);
        const float r = inv_rms(buf, n, eps);
        for (int64_t k0 = 0; k0 < n; k0 += F16_BLOCK) {
            const int64_t len = n - k0 < F16_BLOCK ? n - k0 : F16_BLOCK;
            for (int64_t k = 0; k < len; ++k) t[k] = buf[k0 + k] * r;
            if (round_first) f16_round(t, len);
            for (int64_t k = 0; k < len; ++k) t[k] = scale[k0 + k] * t[k];
            f16_store(t, y + i * y_stride + k0, len);
        }
    }
}

void hf_contbatch_silu_mul_f16(const uint16_t *gate, const uint16_t *up, int64_t rows, int64_t n, int64_t g_stride,
                               int64_t u_stride, uint16_t *y, int32_t threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN && threads > 1) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
        float g[F16_BLOCK], u[F16_BLOCK];
        for (int64_t k0 = 0; k0 < n; k0 += F16_BLOCK) {
            const int64_t len = n - k0 < F16_BLOCK ? n - k0 : F16_BLOCK;
            f16_load(gate + i * g_stride + k0, g, len);
            f16_load(up + i * u_stride + k0, u, len);
            for (int64_t k = 0; k < len; ++k) g[k] = silu_f32(g[k]);
            f16_round(g, len); /* silu rounded to float16, then the product, as torch */
            for (int64_t k = 0; k < len; ++k) g[k] = g[k] * u[k];
            f16_store(g, y + i * n + k0, len);
        }
    }
}

void hf_contbatch_rotary_f16(const uint16_t *x, int64_t rows, int64_t heads, int64_t d, int64_t rot,
                             int64_t x_stride, const uint16_t *cos, const uint16_t *sin, int64_t cs_stride, uint16_t *y,
                             int32_t threads) {
#pragma omp parallel for num_threads(threads) if (rows * heads * d >= PARALLEL_MIN && threads > 1) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t h = rot / 2, m = rot - h, w = d > 0 ? d : 1;
        float c[w], s[w], xf[w], a[w], b[w];
        f16_load(cos + i * cs_stride, c, rot);
        f16_load(sin + i * cs_stride, s, rot);
        for (int64_t j = 0; j < heads; ++j) {
            const uint16_t *xi = x + i * x_stride + j * d;
            uint16_t *yi = y + (i * heads + j) * d;
            f16_load(xi, xf, rot);
            for (int64_t k = 0; k < rot; ++k) {
                a[k] = xf[k] * c[k];
                b[k] = (k < m ? -xf[h + k] : xf[k - m]) * s[k];
            }
            f16_round(a, rot);
            f16_round(b, rot);
            for (int64_t k = 0; k < rot; ++k) a[k] = a[k] + b[k];
            f16_store(a, yi, rot);
            for (int64_t k = rot; k < d; ++k) yi[k] = xi[k]; /* partial rotary: the rest copied */
        }
    }
}

void hf_contbatch_add_rms_norm_f16(const uint16_t *x, const uint16_t *res, int64_t rows, int64_t n, int64_t x_stride,
                                   int64_t r_stride, const float *scale, float eps, int32_t round_first, uint16_t *sum,
                                   uint16_t *y, int32_t threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN && threads > 1) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
        float buf[n > 0 ? n : 1], t[F16_BLOCK];
        for (int64_t k0 = 0; k0 < n; k0 += F16_BLOCK) {
            const int64_t len = n - k0 < F16_BLOCK ? n - k0 : F16_BLOCK;
            f16_load(res + i * r_stride + k0, buf + k0, len);
            f16_load(x + i * x_stride + k0, t, len);
            for (int64_t k = 0; k < len; ++k) buf[k0 + k] = buf[k0 + k] + t[k];
            f16_round(buf + k0, len); /* the sum as torch's float16 add leaves it */
            f16_store(buf + k0, sum + i * n + k0, len);
        }
        const float r = inv_rms(buf, n, eps);
        for (int64_t k0 = 0; k0 < n; k0 += F16_BLOCK) {
            const int64_t len = n - k0 < F16_BLOCK ? n - k0 : F16_BLOCK;
            for (int64_t k = 0; k < len; ++k) t[k] = buf[k0 + k] * r;
            if (round_first) f16_round(t, len);
            for (int64_t k = 0; k < len; ++k) t[k] = scale[k0 + k] * t[k];
            f16_store(t, y + i * n + k0, len);
        }
    }
}
#endif

int hf_contbatch_fused_has_f16(void) { return HAS_F16; }

/* ---- A decode step's decoder layers in one call ------------------------------------------------
 *
 * Why: at a decode step of a small model (or of any model at a few requests) the layer's work is
 * a dozen short native calls (the RMSNorms, three GEMMs of packed fused weights, rotary, the K/V
 * store, paged attention, SiLU-and-mul); from Python each costs a ctypes call, a tensor
 * allocation and a few checks, and the weights streaming through the caches between calls evict
 * the interpreter's own working set, so each costs 10-15 us where a loop of the same call costs
 * 5 (benchmarks/bench_decode_program.py). This runs every layer of one step from C, calling the
 * same kernels in the same order with the same arguments as kernels/fused_layer.py's float32 step
 * for the plain pre-norm form (Llama, Mistral, Qwen2): the same bits.
 *
 * The GEMM, K/V store and decode attention live in other libraries (cpu_gemm.c, cpu_decode.c):
 * the caller passes their entry points. */
/* cpu_gemm.c's GEMMs: float32 and VDPBF16PS ones return nothing (kind 0); the widening ones return
 * -1 when their float32 copy of x cannot be allocated (kind 1). x, packed and y are of the weight's
 * dtype (float32, or bfloat16 bits). */
typedef void (*hf_gemm_void_fn)(const void *x, int64_t m, int64_t k, const void *packed, int64_t n,
                                const float *bias, void *y, int64_t num_threads);
typedef int (*hf_gemm_int_fn)(const void *x, int64_t m, int64_t k, const void *packed, int64_t n,
                              const float *bias, void *y, int64_t num_threads);
typedef void (*hf_store_kv_fn)(const void *key, const void *value, int64_t k_stride_t, int64_t k_stride_h,
                               int64_t v_stride_t, int64_t v_stride_h, void *k_pool, void *v_pool,
                               const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim,
                               int64_t elem_bytes);
typedef int64_t (*hf_decode_fn)(const float *q, const void *k_pool, const void *v_pool, int64_t pool_kind,
                                const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs,
                                int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, float scale, float softcap, int64_t sliding_window,
                                int64_t split_heads, int64_t split_context, int64_t num_threads, float *out);

/* One layer: float32 norm scales [hidden]; each projection's GEMM entry point and its kind,
 * packed weight (cpu_gemm.c's panels) and float32 bias or NULL; q/k/v one fused weight [q; k; v],
 * gate and up one [gate; up]; the layer's pools [blocks, block_size, KVH, D] of the model's dtype;
 * the norms' round_first (bfloat16: see the RMSNorm above). */
typedef struct {
    const float *norm1, *norm2;
    void *qkv_gemm, *o_gemm, *gate_up_gemm, *down_gemm;
    const void *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    void *k_pool, *v_pool;
    float eps1, eps2, scale;
    int64_t sliding_window; /* tokens; 0: none */
    int64_t qkv_kind, o_kind, gate_up_kind, down_kind;
    int64_t round_first1, round_first2;
} hf_decode_layer;

static int call_gemm(void *fn, int64_t kind, const void *x, int64_t m, int64_t k, const void *packed, int64_t n,
                     const void *bias, void *y, int64_t threads) {
    if (kind == 1) return ((hf_gemm_int_fn)fn)(x, m, k, packed, n, (const float *)bias, y, threads);
    ((hf_gemm_void_fn)fn)(x, m, k, packed, n, (const float *)bias, y, threads);
    return 0;
}

/* The step: `rows` decoding requests (one query row each), cos/sin [rows][head_dim], slots [rows],
 * block tables [rows][max_blocks] and context lengths [rows] (int32, as the decode kernel reads
 * them), the store and decode attention entry points, and scratch of
 * hf_contbatch_decode_scratch_floats() floats. */
typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate, max_blocks, block_size, threads;
    const float *cos, *sin;
    const int64_t *slots;
    const int32_t *tables, *lens;
    hf_store_kv_fn store;
    hf_decode_fn attend;
    float *scratch;
} hf_decode_step;

int64_t hf_contbatch_decode_scratch_floats(int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads,
                                           int64_t head_dim, int64_t intermediate) {
    const int64_t q = heads * head_dim, kv = kv_heads * head_dim;
    /* h, qkv, rotated q, rotated k, attention out, o_proj out, the other residual buffer, gate/up,
     * activation, down_proj out; and the bfloat16 program's float32 query and attention output */
    return rows * (hidden + (q + 2 * kv) + q + kv + q + hidden + hidden + 2 * intermediate + intermediate + hidden) +
           rows * 2 * q;
}

/* Runs n_layers layers over hidden_in [rows][hidden] into hidden_out [rows][hidden] (not aliasing
 * hidden_in). Returns 0; 1 when the decode attention could not allocate its scratch, 2 when a
 * widening GEMM could not (the caller raises MemoryError; the pools then hold this step's K/V of
 * the layers run so far, which the step's retry overwrites). */
int64_t hf_contbatch_decode_layers_f32(const hf_decode_step *s, const hf_decode_layer *layers, int64_t n_layers,
                                       const float *hidden_in, float *hidden_out) {
    const int64_t rows = s->rows, H = s->hidden, nh = s->heads, kvh = s->kv_heads, D = s->head_dim;
    const int64_t I = s->intermediate, qn = nh * D, kvn = kvh * D, n_qkv = qn + 2 * kvn;
    const int32_t threads = (int32_t)s->threads;
    float *h = s->scratch, *qkv = h + rows * H, *q = qkv + rows * n_qkv, *k = q + rows * qn;
    float *att = k + rows * kvn, *o = att + rows * qn, *other = o + rows * H, *gu = other + rows * H;
    float *act = gu + rows * 2 * I, *dn = act + rows * I;
    const float *x = hidden_in;
    float *total = hidden_out;
    for (int64_t l = 0; l < n_layers; ++l) {
        const hf_decode_layer *L = layers + l;
        /* The residual stream alternates between two buffers (add_rms_norm's sum must not alias its
         * input); the last layer writes hidden_out. */
        total = ((n_layers - 1 - l) % 2 == 0) ? hidden_out : other;
        hf_contbatch_rms_norm_f32(x, rows, H, H, L->norm1, L->eps1, h, H, threads);
        call_gemm(L->qkv_gemm, L->qkv_kind, h, rows, H, L->qkv, n_qkv, L->qkv_bias, qkv, threads);
        hf_contbatch_rotary_f32(qkv, rows, nh, D, D, n_qkv, s->cos, s->sin, D, q, threads);
        hf_contbatch_rotary_f32(qkv + qn, rows, kvh, D, D, n_qkv, s->cos, s->sin, D, k, threads);
        s->store(k, qkv + qn + kvn, kvn, D, n_qkv, D, L->k_pool, L->v_pool, s->slots, rows, kvh, D, 4);
        if (s->attend(q, L->k_pool, L->v_pool, 0, s->tables, s->lens, rows, s->max_blocks, nh, kvh, D, s->block_size,
                      L->scale, 0.0f, L->sliding_window, -1, -1, threads, att))
            return 1;
        call_gemm(L->o_gemm, L->o_kind, att, rows, qn, L->o, H, L->o_bias, o, threads);
        hf_contbatch_add_rms_norm_f32(o, x, rows, H, H, H, L->norm2, L->eps2, total, h, threads);
        call_gemm(L->gate_up_gemm, L->gate_up_kind, h, rows, H, L->gate_up, 2 * I, L->gate_up_bias, gu, threads);
        hf_contbatch_silu_mul_f32(gu, gu + I, rows, I, 2 * I, 2 * I, act, threads);
        call_gemm(L->down_gemm, L->down_kind, act, rows, I, L->down, H, L->down_bias, dn, threads);
        for (int64_t i = 0; i < rows * H; ++i) total[i] = total[i] + dn[i]; /* torch's add_: one rounding */
        x = total;
    }
    return 0;
}

/* hf_contbatch_decode_layers_f32 for bfloat16 models, step for step as kernels/fused_layer.py's
 * bfloat16 step: activations, cos/sin, pools and outputs in bfloat16 (uint16_t bits); the decode
 * attention reads the query widened to float32 and its float32 output is rounded to bfloat16
 * (round to nearest even), as CPUDecodeKernel converts them; the residual add in float32, rounded
 * once (torch's bfloat16 add_). Scratch: hf_contbatch_decode_scratch_floats() floats (more than
 * enough: every bfloat16 buffer takes half a float32 one, and the float32 query and attention
 * output take what the float32 program's rotated q and attention buffers take). */
int64_t hf_contbatch_decode_layers_bf16(const hf_decode_step *s, const hf_decode_layer *layers, int64_t n_layers,
                                        const uint16_t *hidden_in, uint16_t *hidden_out) {
    const int64_t rows = s->rows, H = s->hidden, nh = s->heads, kvh = s->kv_heads, D = s->head_dim;
    const int64_t I = s->intermediate, qn = nh * D, kvn = kvh * D, n_qkv = qn + 2 * kvn;
    const int32_t threads = (int32_t)s->threads;
    float *qf = s->scratch, *attf = qf + rows * qn; /* float32 query and attention output */
    uint16_t *h = (uint16_t *)(attf + rows * qn), *qkv = h + rows * H, *q = qkv + rows * n_qkv, *k = q + rows * qn;
    uint16_t *att = k + rows * kvn, *o = att + rows * qn, *other = o + rows * H, *gu = other + rows * H;
    uint16_t *act = gu + rows * 2 * I, *dn = act + rows * I;
    const uint16_t *x = hidden_in, *cos = (const uint16_t *)s->cos, *sin = (const uint16_t *)s->sin;
    uint16_t *total = hidden_out;
    for (int64_t l = 0; l < n_layers; ++l) {
        const hf_decode_layer *L = layers + l;
        total = ((n_layers - 1 - l) % 2 == 0) ? hidden_out : other;
        hf_contbatch_rms_norm_bf16(x, rows, H, H, L->norm1, L->eps1, (int32_t)L->round_first1, h, H, threads);
        if (call_gemm(L->qkv_gemm, L->qkv_kind, h, rows, H, L->qkv, n_qkv, L->qkv_bias, qkv, threads)) return 2;
        hf_contbatch_rotary_bf16(qkv, rows, nh, D, D, n_qkv, cos, sin, D, q, threads);
        hf_contbatch_rotary_bf16(qkv + qn, rows, kvh, D, D, n_qkv, cos, sin, D, k, threads);
        s->store(k, qkv + qn + kvn, kvn, D, n_qkv, D, L->k_pool, L->v_pool, s->slots, rows, kvh, D, 2);
        for (int64_t i = 0; i < rows * qn; ++i) qf[i] = bf16_to_f32(q[i]);
        if (s->attend(qf, L->k_pool, L->v_pool, 1, s->tables, s->lens, rows, s->max_blocks, nh, kvh, D,
                      s->block_size, L->scale, 0.0f, L->sliding_window, -1, -1, threads, attf))
            return 1;
        for (int64_t i = 0; i < rows * qn; ++i) att[i] = f32_to_bf16(attf[i]);
        if (call_gemm(L->o_gemm, L->o_kind, att, rows, qn, L->o, H, L->o_bias, o, threads)) return 2;
        hf_contbatch_add_rms_norm_bf16(o, x, rows, H, H, H, L->norm2, L->eps2, (int32_t)L->round_first2, total, h,
                                       threads);
        if (call_gemm(L->gate_up_gemm, L->gate_up_kind, h, rows, H, L->gate_up, 2 * I, L->gate_up_bias, gu, threads))
            return 2;
        hf_contbatch_silu_mul_bf16(gu, gu + I, rows, I, 2 * I, 2 * I, act, threads);
        if (call_gemm(L->down_gemm, L->down_kind, act, rows, I, L->down, H, L->down_bias, dn, threads)) return 2;
        for (int64_t i = 0; i < rows * H; ++i) total[i] = f32_to_bf16(bf16_to_f32(total[i]) + bf16_to_f32(dn[i]));
        x = total;
    }
    return 0;
}
