/* Paged prefill attention for CPU: the query rows of prompt chunks (any number of tokens, starting
 * anywhere in their request's context: a fresh prompt, a chunk of a chunked prefill, the rest of a
 * prompt after a prefix-cache hit) over their context, read in place from the KV pool's pages
 * through each request's block table. Causal, grouped-query, optional sliding window and logit
 * softcap. Pools of float32 or bfloat16 (widened to float32 as they are read: exact); queries,
 * scores, the softmax and the output in float32.
 *
 * Algorithm: FlashAttention's tiling with the online softmax (Dao et al., "FlashAttention: Fast and
 * Memory-Efficient Exact Attention with IO-Awareness", 2022; the running maximum and sum of Milakov
 * and Gimelshein, "Online normalizer calculation for softmax", 2018): a task holds a tile of query
 * rows of one KV head (some query tokens x the query heads that share that KV head) and walks the
 * keys in blocks of KB up to the tile's causal limit, keeping per row the running maximum m, the
 * running sum l and the unnormalised output O (all in float32, in L1-sized scratch):
 *     S = Q K^T (scale folded into Q), m' = max(m, rowmax S), P = exp(S - m'),
 *     l = l exp(m - m') + rowsum P, O = O exp(m - m') + P V, and at the end O / l.
 * Layout choice for a CPU: the tile's queries are stored transposed, Qt[d][row], so one vector holds
 * VW rows and S is computed as S^T[key][row] by broadcasting one key element against a vector of
 * rows (no horizontal sums); the softmax bookkeeping is then vertical (one lane per row), and
 * P V broadcasts P^T[key][row] against a vector of V's head dimension. Keys and values of a block
 * are first copied (widened) into float32 scratch, zero-padded to the vector width, so paging,
 * bfloat16 and odd head sizes cost one pass over the block and the inner loops are uniform.
 *
 * Built on first use by hf_contbatch/kernels/attention/cpu_prefill.py with the system C compiler
 * (-O3 -march=native -ffast-math -fopenmp) and called through ctypes; OpenMP is the libgomp torch
 * loads, with the caller's thread count (torch.get_num_threads()).
 *
 * Vector width: VW floats, 16 where the compiler targets AVX-512 (__AVX512F__, i.e. -march=native
 * on a CPU that has it: the build is per CPU), 4 on x86 without AVX (SSE), else 8 (AVX/AVX2, or two
 * NEON registers elsewhere);
 * GCC/Clang vector extensions, no intrinsics, so every target compiles the same code.
 * -ffast-math assumes no infinities: masked scores are -1e30 (finite) and their probabilities are
 * set to exactly 0, never computed as exp(-inf).
 *
 * Layouts: q and out float32 rows with element (t, h, d) at q[t * q_st + h * q_sh + d] (the row
 * index t is the request's query_start_loc entry minus row_base); k_pool and v_pool contiguous
 * [num_blocks, block_size, num_kv_heads, head_dim]; block_tables int32 with row stride bt_stride;
 * query_start_loc int32 [num_reqs + 1]; seq_lens int32 [num_reqs] (context including the chunk,
 * whose K/V are already stored). Query token i of request b (of q_len) sits at position
 * seq_len - q_len + i and sees keys max(0, pos - window + 1) .. pos (window <= 0: from 0).
 * Query head h reads KV head h / (num_heads / num_kv_heads). softcap <= 0: none, else scores
 * become softcap * tanh(score / softcap) (Gemma 2).
 *
 * int8 pools (hf_contbatch_paged_prefill_q8): K and V int8 with one float32 scale per token and KV
 * head each, k_scale/v_scale [num_blocks, block_size, num_kv_heads] (kv_quant.py: symmetric absmax /
 * 127). A row is dequantized as it is copied into the block's float32 scratch (q * scale, the same
 * float32 product as kv_quant.dequantize_kv), so everything after the copy is the float path and
 * the pool is read at a quarter of float32's bytes. Where the CPU has AVX512-BF16 and the query is a
 * bfloat16 model's (q_bf16), the keys are instead copied as bfloat16 (an int8 value is exact in
 * bfloat16) and the scores formed by vdpbf16ps: exact products, float32 sums, twice the products per
 * instruction of float32 FMAs, each key's scale (times the softmax scale) applied once to its dot
 * products (scores_q8_bf16); the values keep the float32 path.
 */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1 /* vdpbf16ps: the int8-key scores of bfloat16 queries, see scores_q8_bf16 */
#endif
#if defined(__F16C__)
#include <immintrin.h> /* float16 rows widened by F16C's vectors: widen_row */
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#define ACC_REGS 16 /* accumulators the P V microkernel keeps in registers (32 vector registers) */
#define JB 4        /* keys per step of the S microkernel: JB x NC accumulators + NC query vectors */
#elif defined(__x86_64__) && !defined(__AVX__)
/* x86 without AVX: SSE's 4-float registers. 8-float vectors there were split into pairs by the
 * compiler, and that build took 28 s to compile against 10 s at this width. */
#define VW 4
#define ACC_REGS 8 /* 16 vector registers */
#define JB 2
#else
#define VW 8
#define ACC_REGS 8 /* 16 vector registers */
#define JB 2
#endif
#define MAXC 4         /* vectors of rows per tile: a tile holds up to MAXC * VW query rows */
#define KB 32          /* keys per block */
#define MASKED -1e30f
#define SERIAL_FLOPS 1000000 /* below this many floating-point operations a call runs on one thread */  /* the score of a masked key (finite: -ffast-math assumes no infinities) */

typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4), aligned(4)));

#define INLINE static inline __attribute__((always_inline))

INLINE vf splat(float a) { return (vf){0} + a; }
INLINE vf vsel(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }
INLINE vf vmax(vf a, vf b) { return vsel(a > b, a, b); }
INLINE vf vmin(vf a, vf b) { return vsel(a < b, a, b); }

/* exp(x) per lane for x <= 88 (here always <= 0), exactly 0 below -87.3 (where expf is subnormal or
 * 0). Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for exp(r) (the
 * coefficients of Cephes' expf, S. Moshier), and 2^n put into the exponent bits: about 1 ulp. */
INLINE vf vexp(vf x) {
    const vi under = x < splat(-87.33654f);
    x = vmin(vmax(x, splat(-87.33654f)), splat(88.f));
    const vf t = x * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(t, vi); /* truncates towards 0: floor for t >= 0 */
    n += (vi)(__builtin_convertvector(n, vf) > t); /* -1 where t < 0 was not an integer: floor */
    const vf nf = __builtin_convertvector(n, vf);
    const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const vf y = p * r * r + r + 1.f;
    const vi two_n = (n + 127) << 23;
    return vsel(under, splat(0.f), y * (vf)two_n);
}

/* Pool element kinds (each a compile-time constant in the specialised tiles). */
#define DT_F32 0
#define DT_BF16 1
#define DT_I8 2
#define DT_F16 3 /* where the compiler has _Float16 (HAS_F16) */
#if defined(__FLT16_MAX__)
#define HAS_F16 1
#else
#define HAS_F16 0
#endif
int hf_contbatch_prefill_has_f16(void) { return HAS_F16; }

/* Row of D pool elements into dst as float32, zeros up to Dp: float32 copied; bfloat16 (the upper
 * half of a float32) and float16 widened, exact; int8 times the row's scale s (one rounding, as the
 * reference). */
INLINE void widen_row(float *dst, const void *src, int64_t D, int64_t Dp, const int bf16, float s) {
    if (bf16 == DT_I8) {
        const int8_t *b = (const int8_t *)src;
        for (int64_t d = 0; d < D; d++) dst[d] = (float)b[d] * s;
#if HAS_F16
    } else if (bf16 == DT_F16) {
        const _Float16 *h = (const _Float16 *)src;
        int64_t d = 0;
#if defined(__F16C__)
        /* F16C's vector conversion: without AVX512-FP16, GCC converts _Float16 one value at a time
         * (float16 prefill 1.4x float32's time under benchmarks' --emulate-cpu no-bf16) */
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
#endif
        for (; d < D; d++) dst[d] = (float)h[d];
#endif
    } else if (bf16) {
        const uint16_t *s = (const uint16_t *)src;
        uint32_t *o = (uint32_t *)dst;
        for (int64_t d = 0; d < D; d++) o[d] = (uint32_t)s[d] << 16;
    } else {
        memcpy(dst, src, (size_t)D * 4);
    }
    for (int64_t d = D; d < Dp; d++) dst[d] = 0.f;
}

/* S^T[j][row] = sum_d Qt[d][row] K[j][d] for keys j < nkp (a multiple of JB), rows NC * VW: per d,
 * NC vectors of rows times JB broadcast key elements into JB x NC register accumulators. */
INLINE void scores(const float *Qt, int64_t R, const float *Kb, int64_t ldk, int64_t nkp, const int64_t D,
                   float *S, const int NC) {
    for (int64_t j = 0; j < nkp; j += JB) {
        vf acc[JB][MAXC];
        for (int jj = 0; jj < JB; jj++)
            for (int c = 0; c < NC; c++) acc[jj][c] = splat(0.f);
        const float *k = Kb + j * ldk;
        for (int64_t d = 0; d < D; d++) {
            vf qv[MAXC];
            for (int c = 0; c < NC; c++) qv[c] = *(const vf *)(Qt + d * R + c * VW);
            for (int jj = 0; jj < JB; jj++) {
                const float kd = k[jj * ldk + d];
                for (int c = 0; c < NC; c++) acc[jj][c] += qv[c] * kd;
            }
        }
        for (int jj = 0; jj < JB; jj++)
            for (int c = 0; c < NC; c++) *(vf *)(S + (j + jj) * R + c * VW) = acc[jj][c];
    }
}

#if HAVE_DPBF16
/* int8 keys of a bfloat16 model's queries (AVX512-BF16): an int8 value (|q| <= 127) and a query that
 * is a bfloat16 are both exact in bfloat16, and vdpbf16ps forms each product exactly in float32 and
 * adds it to a float32 accumulator (two products per lane per instruction: half the instructions of
 * float32 FMAs). So S^T[j][row] = (sum_d q[row][d] k8[j][d]) * ksc[j], with ksc the key's scale times
 * the softmax scale, is the float32 dot product of the dequantized key up to float rounding (the
 * scale applied once per key, not per element).
 * Qt2: [D / 2][R] pairs of bfloat16 (query elements d, d + 1 of a row); Kb16: [nkp][ldk] bfloat16
 * keys (int8 values), rows past nk zero. */
INLINE void scores_q8_bf16(const uint32_t *Qt2, int64_t R, const uint16_t *Kb16, int64_t ldk, int64_t nkp,
                           const int64_t D, float *S, const int NC, const float *ksc) {
    for (int64_t j = 0; j < nkp; j += JB) {
        __m512 acc[JB][MAXC];
        for (int jj = 0; jj < JB; jj++)
            for (int c = 0; c < NC; c++) acc[jj][c] = _mm512_setzero_ps();
        const uint16_t *k = Kb16 + j * ldk;
        for (int64_t d = 0; d < D; d += 2) {
            __m512bh qv[MAXC];
            for (int c = 0; c < NC; c++) qv[c] = (__m512bh)_mm512_loadu_si512(Qt2 + (d / 2) * R + c * VW);
            for (int jj = 0; jj < JB; jj++) {
                uint32_t pair;
                memcpy(&pair, k + jj * ldk + d, 4);
                const __m512bh kv = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int c = 0; c < NC; c++) acc[jj][c] = _mm512_dpbf16_ps(acc[jj][c], qv[c], kv);
            }
        }
        for (int jj = 0; jj < JB; jj++) {
            const __m512 f = _mm512_set1_ps(ksc[j + jj]);
            for (int c = 0; c < NC; c++) _mm512_storeu_ps(S + (j + jj) * R + c * VW, _mm512_mul_ps(acc[jj][c], f));
        }
    }
}

/* Row of D int8 (D a multiple of 16) as bfloat16 (exact: |q| <= 127 has 7 significant bits). */
INLINE void widen_row_i8_bf16(uint16_t *dst, const int8_t *src, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + d))));
        _mm256_storeu_si256((__m256i *)(dst + d), (__m256i)_mm512_cvtneps_pbh(f));
    }
}
#endif

/* O[row] = O[row] * alpha[row] + sum_{j < nk} P^T[j][row] V[j] for all R rows, DV vectors of V's
 * (padded) head dimension: RB rows x DV vectors of accumulators, each V vector loaded once for RB rows. */
INLINE void accumulate(float *O, int64_t R, const float *P, const float *alpha, const float *Vb, int64_t nk,
                       const int64_t DV) {
    const int64_t Dp = DV * VW;
    const int64_t RB = DV >= ACC_REGS ? 1 : DV * 2 > ACC_REGS ? 1 : DV * 4 > ACC_REGS ? 2 : DV * 8 > ACC_REGS ? 4 : 8;
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
        vf acc[8][ACC_REGS > 16 ? ACC_REGS : 16];
        if (DV > ACC_REGS) { /* a head dimension wider than the registers: no blocking */
            for (int64_t r = r0; r < r0 + RB; r++) {
                float *o = O + r * Dp;
                const float a = alpha[r];
                for (int64_t x = 0; x < Dp; x++) o[x] *= a;
                for (int64_t j = 0; j < nk; j++) {
                    const float p = P[j * R + r];
                    const float *v = Vb + j * Dp;
                    for (int64_t x = 0; x < Dp; x++) o[x] += p * v[x];
                }
            }
            continue;
        }
        for (int64_t rr = 0; rr < RB; rr++)
            for (int64_t v = 0; v < DV; v++) acc[rr][v] = *(vf *)(O + (r0 + rr) * Dp + v * VW) * alpha[r0 + rr];
        for (int64_t j = 0; j < nk; j++) {
            const float *vrow = Vb + j * Dp;
            const float *p = P + j * R + r0;
            for (int64_t rr = 0; rr < RB; rr++) {
                const float pr = p[rr];
                for (int64_t v = 0; v < DV; v++) acc[rr][v] += *(const vf *)(vrow + v * VW) * pr;
            }
        }
        for (int64_t rr = 0; rr < RB; rr++)
            for (int64_t v = 0; v < DV; v++) *(vf *)(O + (r0 + rr) * Dp + v * VW) = acc[rr][v];
    }
}

/* One tile: query tokens [t0, t0 + nq) of a request (rows of q/out), at positions qpos0.., query
 * heads [h0, h0 + hg) of KV head kvh; scratch from the caller (see hf_contbatch_paged_prefill). */
typedef struct {
    const float *q;
    int64_t q_st, q_sh;
    float *out;
    int64_t o_st, o_sh;
    const void *k_pool, *v_pool;
    const float *k_scale, *v_scale; /* int8 pools: [slots, num_kv_heads] scales, else NULL */
    int q_bf16;                     /* every query element is a bfloat16 value (a bfloat16 model's) */
    int64_t num_kv_heads;
    int64_t row;  /* pool elements per token: num_kv_heads * head_dim */
    int64_t block_size, window;
    float scale, softcap;
} Args;

INLINE void tile(const Args *a, const int32_t *table, int64_t t0, int64_t nq, int64_t qpos0, int64_t h0, int64_t hg,
                 int64_t kvh, const int64_t D, const int64_t DV, const int bf16, float *buf) {
    const int64_t Dp = DV * VW;
    const int64_t rows = nq * hg, NC = (rows + VW - 1) / VW, R = NC * VW;
    float *Qt = buf;              /* [D][R] */
    float *O = Qt + D * R;        /* [R][Dp] */
    float *S = O + R * Dp;        /* [KB][R] */
    float *Kb = S + KB * R;       /* [KB][Dp] */
    float *Vb = Kb + KB * Dp;     /* [KB][Dp] */
    float *m = Vb + KB * Dp;      /* [R] running maximum */
    float *l = m + R;             /* [R] running sum */
    float *alpha = l + R;         /* [R] rescale of this block */
    int32_t *pos = (int32_t *)(alpha + R); /* [R] position of each row's query token */
    for (int64_t r = 0; r < R; r++) {
        const int64_t qi = r < rows ? r / hg : nq - 1;
        pos[r] = (int32_t)(qpos0 + qi);
        m[r] = MASKED;
        l[r] = 0.f;
        for (int64_t d = 0; d < D; d++) Qt[d * R + r] = 0.f;
    }
#if HAVE_DPBF16
    /* int8 keys and bfloat16 queries: scores by vdpbf16ps (scores_q8_bf16), the softmax scale
     * folded into each key's scale, the query kept as its bfloat16 bits in pairs. */
    const int dp = bf16 == DT_I8 && a->q_bf16 && D % 16 == 0;
    uint32_t *Qt2 = (uint32_t *)Qt; /* [D / 2][R], in Qt's scratch */
    uint16_t *Kb16 = (uint16_t *)Kb; /* [KB][Dp], in Kb's scratch */
    float ksc_b[KB];
#else
    const int dp = 0;
#endif
    (void)dp;
    for (int64_t r = 0; r < rows; r++) {
        const float *src = a->q + (t0 + r / hg) * a->q_st + (h0 + r % hg) * a->q_sh;
#if HAVE_DPBF16
        if (dp) {
            for (int64_t d = 0; d < D; d += 2) {
                uint32_t lo, hi;
                memcpy(&lo, src + d, 4);
                memcpy(&hi, src + d + 1, 4);
                Qt2[(d / 2) * R + r] = (lo >> 16) | (hi & 0xffff0000u);
            }
            continue;
        }
#endif
        for (int64_t d = 0; d < D; d++) Qt[d * R + r] = src[d] * a->scale;
    }
    memset(O, 0, sizeof(float) * (size_t)(R * Dp));
    const int64_t pos_min = qpos0, pos_max = qpos0 + nq - 1, window = a->window;
    const int64_t k_lo = (window > 0 && pos_min - window + 1 > 0) ? pos_min - window + 1 : 0;
    const int64_t k_hi = pos_max + 1;
    const int64_t bs = a->block_size, elem = bf16 == DT_I8 ? 1 : bf16 ? 2 : 4;
    const int64_t head_at = kvh * D;
    for (int64_t j0 = k_lo; j0 < k_hi; j0 += KB) {
        const int64_t nk = k_hi - j0 < KB ? k_hi - j0 : KB;
        const int64_t nkp = (nk + JB - 1) / JB * JB;
        for (int64_t j = 0; j < nk; j++) {
            const int64_t p = j0 + j;
            const int64_t slot = (int64_t)table[p / bs] * bs + p % bs, at = slot * a->row + head_at;
            const int64_t sat = slot * a->num_kv_heads + kvh;
            const float ksc = bf16 == DT_I8 ? a->k_scale[sat] : 1.f, vsc = bf16 == DT_I8 ? a->v_scale[sat] : 1.f;
#if HAVE_DPBF16
            if (dp) {
                widen_row_i8_bf16(Kb16 + j * Dp, (const int8_t *)a->k_pool + at, D);
                ksc_b[j] = ksc * a->scale;
            } else
#endif
                widen_row(Kb + j * Dp, (const char *)a->k_pool + at * elem, D, Dp, bf16, ksc);
            widen_row(Vb + j * Dp, (const char *)a->v_pool + at * elem, D, Dp, bf16, vsc);
        }
#if HAVE_DPBF16
        if (dp) {
            for (int64_t j = nk; j < nkp; j++) {
                memset(Kb16 + j * Dp, 0, sizeof(uint16_t) * (size_t)Dp);
                ksc_b[j] = 0.f;
            }
            switch (NC) {
                case 1: scores_q8_bf16(Qt2, R, Kb16, Dp, nkp, D, S, 1, ksc_b); break;
                case 2: scores_q8_bf16(Qt2, R, Kb16, Dp, nkp, D, S, 2, ksc_b); break;
                case 3: scores_q8_bf16(Qt2, R, Kb16, Dp, nkp, D, S, 3, ksc_b); break;
                default: scores_q8_bf16(Qt2, R, Kb16, Dp, nkp, D, S, 4, ksc_b); break;
            }
        } else
#endif
        {
            for (int64_t j = nk; j < nkp; j++) memset(Kb + j * Dp, 0, sizeof(float) * (size_t)Dp);
            switch (NC) {
                case 1: scores(Qt, R, Kb, Dp, nkp, D, S, 1); break;
                case 2: scores(Qt, R, Kb, Dp, nkp, D, S, 2); break;
                case 3: scores(Qt, R, Kb, Dp, nkp, D, S, 3); break;
                default: scores(Qt, R, Kb, Dp, nkp, D, S, 4); break;
            }
        }
        /* A block needs masking where some row cannot see some key: its last key is past the
         * tile's first query, or its first key has left the window of the tile's last query. */
        const int masking = j0 + nk - 1 > pos_min || (window > 0 && j0 <= pos_max - window);
        for (int64_t c = 0; c < NC; c++) {
            const vi pv = *(const vi *)(pos + c * VW);
            const vf m_old = *(const vf *)(m + c * VW);
            vf mx = m_old;
            for (int64_t j = 0; j < nk; j++) {
                vf s = *(vf *)(S + j * R + c * VW);
                if (a->softcap > 0.f) {
                    float *sl = (float *)&s;
#pragma omp simd
                    for (int x = 0; x < VW; x++) sl[x] = a->softcap * tanhf(sl[x] / a->softcap);
                }
                if (masking) {
                    const vi jv = (vi){0} + (int32_t)(j0 + j);
                    vi ok = jv <= pv;
                    if (window > 0) ok &= jv > pv - (int32_t)window;
                    s = vsel(ok, s, splat(MASKED));
                }
                *(vf *)(S + j * R + c * VW) = s;
                mx = vmax(mx, s);
            }
            const vf rescale = vexp(m_old - mx);
            vf sum = splat(0.f);
            for (int64_t j = 0; j < nk; j++) {
                vf p = vexp(*(vf *)(S + j * R + c * VW) - mx);
                if (masking) {
                    const vi jv = (vi){0} + (int32_t)(j0 + j);
                    vi ok = jv <= pv;
                    if (window > 0) ok &= jv > pv - (int32_t)window;
                    p = vsel(ok, p, splat(0.f));
                }
                *(vf *)(S + j * R + c * VW) = p;
                sum += p;
            }
            *(vf *)(l + c * VW) = *(vf *)(l + c * VW) * rescale + sum;
            *(vf *)(m + c * VW) = mx;
            *(vf *)(alpha + c * VW) = rescale;
        }
        accumulate(O, R, S, alpha, Vb, nk, DV);
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dst = a->out + (t0 + r / hg) * a->o_st + (h0 + r % hg) * a->o_sh;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t d = 0; d < D; d++) dst[d] = O[r * Dp + d] * inv;
    }
}

/* The tile with the head dimension (32, 64, 128: constants, loops unrolled) and the pool dtype
 * specialised; other head sizes run the same code with a runtime dimension. */
static void run_tile(const Args *a, const int32_t *table, int64_t t0, int64_t nq, int64_t qpos0, int64_t h0,
                     int64_t hg, int64_t kvh, int64_t D, int bf16, float *buf) {
#define TILE(DIM, BF16) tile(a, table, t0, nq, qpos0, h0, hg, kvh, DIM, ((DIM) + VW - 1) / VW, BF16, buf)
    if (bf16 == DT_I8) {
        switch (D) {
            case 32: TILE(32, DT_I8); break;
            case 64: TILE(64, DT_I8); break;
            case 128: TILE(128, DT_I8); break;
            default: TILE(D, DT_I8); break;
        }
#if HAS_F16
    } else if (bf16 == DT_F16) {
        switch (D) {
            case 32: TILE(32, DT_F16); break;
            case 64: TILE(64, DT_F16); break;
            case 128: TILE(128, DT_F16); break;
            default: TILE(D, DT_F16); break;
        }
#endif
    } else if (bf16) {
        switch (D) {
            case 32: TILE(32, 1); break;
            case 64: TILE(64, 1); break;
            case 128: TILE(128, 1); break;
            default: TILE(D, 1); break;
        }
    } else {
        switch (D) {
            case 32: TILE(32, 0); break;
            case 64: TILE(64, 0); break;
            case 128: TILE(128, 0); break;
            default: TILE(D, 0); break;
        }
    }
#undef TILE
}

typedef struct {
    int64_t req, kvh, h0, hg, t0, nq, cost;
} Task;

static int by_cost_desc(const void *x, const void *y) {
    const int64_t a = ((const Task *)x)->cost, b = ((const Task *)y)->cost;
    return (a < b) - (a > b);
}

/* Attention of the query rows of requests [first_req, num_reqs) (see the layouts above); dt: DT_F32,
 * DT_BF16, or DT_I8 with k_scale/v_scale. Work: one task per (request, KV head, head subgroup, tile of
 * query tokens), a tile holding up to MAXC * VW rows, tasks run longest first (a causal tile's
 * cost grows with its last position) over num_threads OpenMP threads. Returns 0, or 1 when memory
 * for the task list or the scratch could not be allocated (the caller raises MemoryError). */
static int64_t paged_prefill(const float *q, int64_t q_st, int64_t q_sh, const void *k_pool, const void *v_pool,
                             int dt, const float *k_scale, const float *v_scale, const int32_t *block_tables,
                             int64_t bt_stride, const int32_t *query_start_loc, const int32_t *seq_lens,
                             int64_t first_req, int64_t num_reqs, int64_t row_base, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float softcap,
                             int64_t sliding_window, int64_t num_threads, float *out, int64_t o_st, int64_t o_sh,
                             int q_bf16) {
    const int64_t groups = num_heads / num_kv_heads;
    const int64_t hg = groups < MAXC * VW ? groups : MAXC * VW; /* query heads per tile */
    const int64_t subgroups = (groups + hg - 1) / hg;
    const int64_t tokens = (MAXC * VW) / hg; /* query tokens per tile (>= 1) */
    int64_t num_tasks = 0;
    for (int64_t b = first_req; b < num_reqs; b++) {
        const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b];
        num_tasks += num_kv_heads * subgroups * ((q_len + tokens - 1) / tokens);
    }
    if (num_tasks == 0) return 0;
    Task *tasks = (Task *)malloc(sizeof(Task) * (size_t)num_tasks);
    if (!tasks) return 1;
    int64_t n = 0;
    for (int64_t b = first_req; b < num_reqs; b++) {
        const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b];
        const int64_t ctx0 = seq_lens[b] - q_len;
        for (int64_t t = 0; t < q_len; t += tokens) {
            const int64_t nq = q_len - t < tokens ? q_len - t : tokens;
            const int64_t last = ctx0 + t + nq;
            const int64_t keys = sliding_window > 0 && last > sliding_window + nq ? sliding_window + nq : last;
            for (int64_t k = 0; k < num_kv_heads; k++)
                for (int64_t s = 0; s < subgroups; s++) {
                    const int64_t h0 = k * groups + s * hg;
                    const int64_t nh = groups - s * hg < hg ? groups - s * hg : hg;
                    tasks[n++] = (Task){b, k, h0, nh, t, nq, keys * nq * nh};
                }
        }
    }
    qsort(tasks, (size_t)num_tasks, sizeof(Task), by_cost_desc);
    const int64_t Dp = (head_dim + VW - 1) / VW * VW, R = MAXC * VW;
    const size_t scratch = sizeof(float) * (size_t)(head_dim * R + R * Dp + KB * R + 2 * KB * Dp + 4 * R) + 64;
    const Args args = {.q = q, .q_st = q_st, .q_sh = q_sh, .out = out, .o_st = o_st, .o_sh = o_sh,
                       .k_pool = k_pool, .v_pool = v_pool, .k_scale = k_scale, .v_scale = v_scale,
                       .num_kv_heads = num_kv_heads, .row = num_kv_heads * head_dim, .block_size = block_size,
                       .window = sliding_window, .scale = scale, .softcap = softcap, .q_bf16 = q_bf16};
    const int bf16 = dt;
    int64_t failed = 0;
    /* A step whose attention is a few microseconds of work runs on the calling thread: waking
     * the team would cost as much (and far more when another process holds the other cores). */
    int64_t pairs = 0;
    for (int64_t i = 0; i < num_tasks; i++) pairs += tasks[i].cost;
    if (pairs * head_dim * 4 < SERIAL_FLOPS) num_threads = 1;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > num_tasks) num_threads = num_tasks;
#pragma omp parallel num_threads(num_threads)
    {
        char *raw = (char *)malloc(scratch + 64);
        float *buf = raw ? (float *)(((uintptr_t)raw + 63) & ~(uintptr_t)63) : NULL;
        if (!raw) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tasks; i++) {
            if (!buf) continue;
            const Task *tk = tasks + i;
            const int64_t q_len = query_start_loc[tk->req + 1] - query_start_loc[tk->req];
            const int64_t qpos0 = seq_lens[tk->req] - q_len + tk->t0;
            run_tile(&args, block_tables + tk->req * bt_stride, query_start_loc[tk->req] - row_base + tk->t0, tk->nq,
                     qpos0, tk->h0, tk->hg, tk->kvh, head_dim, bf16, buf);
        }
        free(raw);
    }
    free(tasks);
    return failed;
}

/* pool_kind: 0 for float32 pools, 1 for bfloat16 ones, 3 for float16 ones (DT_F16, builds with
 * hf_contbatch_prefill_has_f16()) (see paged_prefill). */
int64_t hf_contbatch_paged_prefill(const float *q, int64_t q_st, int64_t q_sh, const void *k_pool, const void *v_pool,
                                   int64_t pool_kind, const int32_t *block_tables, int64_t bt_stride,
                                   const int32_t *query_start_loc, const int32_t *seq_lens, int64_t first_req,
                                   int64_t num_reqs, int64_t row_base, int64_t num_heads, int64_t num_kv_heads,
                                   int64_t head_dim, int64_t block_size, float scale, float softcap,
                                   int64_t sliding_window, int64_t num_threads, float *out, int64_t o_st,
                                   int64_t o_sh) {
    const int dt = pool_kind == DT_BF16 ? DT_BF16 : (HAS_F16 && pool_kind == DT_F16) ? DT_F16 : DT_F32;
    return paged_prefill(q, q_st, q_sh, k_pool, v_pool, dt, NULL, NULL, block_tables,
                         bt_stride, query_start_loc, seq_lens, first_req, num_reqs, row_base, num_heads, num_kv_heads,
                         head_dim, block_size, scale, softcap, sliding_window, num_threads, out, o_st, o_sh, 0);
}

/* int8 pools with float32 scales [num_blocks, block_size, num_kv_heads] for K and for V; otherwise as
 * hf_contbatch_paged_prefill. q_bf16 != 0: every element of q is a bfloat16 value (the caller widened
 * a bfloat16 query), which lets AVX512-BF16 CPUs compute the scores with vdpbf16ps (scores_q8_bf16). */
int64_t hf_contbatch_paged_prefill_q8(const float *q, int64_t q_st, int64_t q_sh, const int8_t *k_pool,
                                      const int8_t *v_pool, const float *k_scale, const float *v_scale,
                                      const int32_t *block_tables, int64_t bt_stride, const int32_t *query_start_loc,
                                      const int32_t *seq_lens, int64_t first_req, int64_t num_reqs, int64_t row_base,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                      float scale, float softcap, int64_t sliding_window, int64_t num_threads,
                                      float *out, int64_t o_st, int64_t o_sh, int64_t q_bf16) {
    return paged_prefill(q, q_st, q_sh, k_pool, v_pool, DT_I8, k_scale, v_scale, block_tables, bt_stride,
                         query_start_loc, seq_lens, first_req, num_reqs, row_base, num_heads, num_kv_heads, head_dim,
                         block_size, scale, softcap, sliding_window, num_threads, out, o_st, o_sh, q_bf16 != 0);
}
