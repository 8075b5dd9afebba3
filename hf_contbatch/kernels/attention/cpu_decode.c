/* Paged decode attention for CPU: one query token per sequence, keys and values read in place from
 * the KV pool's pages through each sequence's block table (no gather, no copy). Pools of float32,
 * or of bfloat16 (widened to float32 as they are read: exact); queries, scores, the softmax and the
 * output in float32.
 *
 * Built on first use by hf_contbatch/kernels/attention/cpu_kernel.py with the system C compiler
 * (-O3 -march=native -ffast-math -fopenmp) and called through ctypes. OpenMP here is the libgomp
 * torch itself loads (same soname), so the kernel shares torch's thread team.
 *
 * int8 pools (hf_contbatch_paged_decode_q8): K and V int8 with one float32 scale per token and KV head
 * each, k_scale/v_scale [num_blocks, block_size, num_kv_heads] (kv_quant.py: symmetric absmax / 127).
 * A key row is widened to float32 and dotted with the query, the sum multiplied by the row's scale;
 * a value row is accumulated with weight p * scale: the scales never touch the head's channels.
 * hf_contbatch_store_kv_q8 quantizes this step's rows on write (float32 or bfloat16 inputs).
 *
 * Layouts (all contiguous): q and out float32 [num_seqs, num_heads, head_dim]; k_pool and v_pool
 * [num_blocks, block_size, num_kv_heads, head_dim]; block_tables int32 [num_seqs, max_blocks];
 * seq_lens int32 [num_seqs] (context length including this step's token, whose K/V are stored).
 * Grouped-query attention: query head h reads KV head h / (num_heads / num_kv_heads).
 * softcap <= 0: none, else scores become softcap * tanh(score / softcap) (Gemma 2).
 * sliding_window <= 0: none, else only the last sliding_window positions are attended (keys
 * with position > seq_len - 1 - sliding_window, as the torch path masks them).
 *
 * Partitions: a sequence's attended positions [start, len) are cut into partitions of PARTITION
 * tokens counted from `start` (the last one shorter). Each partition gives, per query head, its
 * largest score m, the sum l of exp(score - m) over its keys and the values weighted by those
 * exponentials (unnormalised); one combine then rescales every partition to the largest m of the
 * sequence and divides by the rescaled sum (flash-decoding / split-K: Tri Dao et al., "Flash-Decoding
 * for long-context inference", 2023). The cut depends on the sequence alone, and the combine walks
 * partitions in order, so a sequence's output has the same bits whichever work split computed it
 * and whatever else is in the batch.
 *
 * Work split: one OpenMP task per sequence (its partitions in turn, combined in the task), or with
 * split_context != 0 one task per partition (the task finishing a sequence combines it), so that
 * one long sequence is spread over all threads; with split_heads != 0 each of those tasks is cut
 * further into one per KV head. A task makes one pass over its key rows computing the scores of
 * all its query heads (each row loaded once for all of them), the exponentials per head, then one
 * pass over its value rows accumulating every head's weighted values. Rows are walked in order, so
 * within a page the reads are sequential; at each row the same row of the next page is
 * prefetched, which hides the jump between pages. split_heads / split_context < 0: chosen here
 * from the batch (paged_decode). num_threads: the most threads to run on (the caller passes torch's
 * thread count; < 1: OpenMP's default), never more than there are tasks.
 * head_dim 32, 64 and 128 get code with the dimension as a constant (loops fully unrolled into
 * vectors of VW floats: 16 with AVX-512, else 8); any other head_dim runs the same code with a
 * runtime dimension and a scalar tail. The pool dtype is a constant too (always-inline functions
 * called with a literal flag), so each combination compiles to its own loop.
 */
#if defined(__AVX__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
/* VW floats; aligned(4)/(2) let loads and stores be unaligned. GCC/Clang vector extensions. */
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef int8_t vb __attribute__((vector_size(VW), aligned(1)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

/* Pool element kinds, the `dt` argument of the helpers below (each a compile-time constant in the
 * specialised loops). */
#define DT_F32 0
#define DT_BF16 1
#define DT_I8 2
#define DT_F16 3 /* where the compiler has _Float16 (HAS_F16) */
#define DT_SIZE(dt) ((dt) == DT_I8 ? 1 : (dt) == DT_F32 ? 4 : 2)
#if defined(__FLT16_MAX__)
#define HAS_F16 1
#if defined(__AVX512F__) || (defined(__F16C__) && defined(__AVX2__))
#include <immintrin.h>
#endif
#else
#define HAS_F16 0
#endif
int hf_contbatch_decode_has_f16(void) { return HAS_F16; }

#define INLINE static inline __attribute__((always_inline))

/* At least this many K (and as many V) elements in one store before it is split over the threads:
 * about 400 tokens of a 5-KV-head, head_dim-64 model (tens of microseconds on one core: below that,
 * waking the team and, on a busy machine, waiting for a core cost about as much as the work). */
#define STORE_PAR_ELEMS 131072

/* The sum of x's lanes as a tree of vector adds (log2(VW) steps): it runs once per key and query
 * head, and the plain loop compiled to a chain of scalar adds as long as the vector. */
INLINE float hsum(vf x) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)x);
#elif defined(__AVX__)
    __m128 h = _mm_add_ps(_mm256_castps256_ps128((__m256)x), _mm256_extractf128_ps((__m256)x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#else
    float s = 0.f;
    for (int i = 0; i < VW / 2; i++) s += x[i] + x[i + VW / 2];
    return s;
#endif
}

/* VW int8 as floats (exact). GCC scalarises __builtin_convertvector from int8 to float, so the
 * AVX-512 and AVX2 paths sign-extend and convert with intrinsics (vpmovsxbd, vcvtdq2ps). */
INLINE vf load_i8(const void *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return __builtin_convertvector(__builtin_convertvector(*(const vb *)p, vi), vf);
#endif
}

/* VW pool elements from p as floats: a bf16 is the upper half of a float32, so widening is exact;
 * an int8 converts exactly too (its scale is applied by the caller). */
INLINE vf load(const void *p, const int dt) {
    if (dt == DT_I8) return load_i8(p);
    if (dt == DT_F32) return *(const vf *)p;
#if HAS_F16
    if (dt == DT_F16) { /* exact too: VCVTPH2PS where the CPU has it */
#if VW == 16
        return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && defined(__AVX2__)
        return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
        typedef _Float16 vf16 __attribute__((vector_size(VW * 2), aligned(2)));
        return __builtin_convertvector(*(const vf16 *)p, vf);
#endif
    }
#endif
    const vu wide = __builtin_convertvector(*(const vh *)p, vu) << 16;
    vf out;
    memcpy(&out, &wide, sizeof out);
    return out;
}

INLINE float load_one(const void *p, const int dt) {
    if (dt == DT_I8) return (float)*(const int8_t *)p;
    if (dt == DT_F32) return *(const float *)p;
#if HAS_F16
    if (dt == DT_F16) return (float)*(const _Float16 *)p;
#endif
    const uint32_t u = (uint32_t) * (const uint16_t *)p << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* p + i elements of the pool's dtype */
INLINE const void *at(const void *p, int64_t i, const int dt) {
    return (const char *)p + i * DT_SIZE(dt);
}

INLINE float dot(const float *a, const void *b, const int64_t D, const int dt) {
    vf acc = {0};
    int64_t d = 0;
    for (; d + VW <= D; d += VW) acc += *(const vf *)(a + d) * load(at(b, d, dt), dt);
    float s = hsum(acc);
    for (; d < D; d++) s += a[d] * load_one(at(b, d, dt), dt);
    return s;
}

INLINE void axpy(float *y, float p, const void *x, const int64_t D, const int dt) {
    int64_t d = 0;
    for (; d + VW <= D; d += VW) *(vf *)(y + d) += p * load(at(x, d, dt), dt);
    for (; d < D; d++) y[d] += p * load_one(at(x, d, dt), dt);
}

/* Prefetch `bytes` from p (one line per 64 bytes). */
static inline void prefetch_span(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b);
}

/* Each of nh rows of n scores (softcap > 0: capped first) replaced by exp(score - m), m the row's
 * largest score, written to m[h], and the sum of the exponentials to l[h]. */
INLINE void exp_rows(float *scores, int64_t nh, int64_t n, float softcap, float *m, float *l) {
    for (int64_t h = 0; h < nh; h++) {
        float *sc = scores + h * n;
        if (softcap > 0.f)
            for (int64_t j = 0; j < n; j++) sc[j] = softcap * tanhf(sc[j] / softcap);
        float mx = sc[0];
        for (int64_t j = 1; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) sc[j] = expf(sc[j] - mx);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) sum += sc[j];
        m[h] = mx;
        l[h] = sum;
    }
}

/* The scale of KV head g's row at position pos: an int8 pool's (scales [slots][kvh]); 1 for a float
 * pool, whose products it then leaves exact (x * 1.f == x). */
INLINE float row_scale(const float *scales, const int32_t *table, int64_t pos, int64_t block_size, int64_t kvh,
                       int64_t g, const int dt) {
    if (dt != DT_I8) return 1.f;
    return scales[((int64_t)table[pos / block_size] * block_size + pos % block_size) * kvh + g];
}

/* One partition: nh query heads (qs, o: [nh][D]) over positions [start, len) of one sequence; k_pool
 * and v_pool (and, for int8 pools, ks/vs: the scales) already offset to the task's first KV head;
 * kvh: KV heads per token (the scales' row); scores: nh * (len - start) floats of scratch; dt: the
 * pool's element kind (DT_F32, DT_BF16, DT_I8); seq_len: the sequence's length (the next page is
 * prefetched up to there, across the partition's end). Writes each head's largest score to m[h], its sum of
 * exponentials to l[h] and its exponential-weighted values, unnormalised, to o (see "Partitions").
 * Each key (value) row of a KV head is loaded once for all the query heads of its group. With D a
 * multiple of VW up to 128 (a constant for 32, 64 and 128) the row is widened into D / VW vector
 * registers (bf16 and int8 conversions are exact); any other D goes through dot() / axpy() per query
 * head, with a scalar tail. An int8 row's token-head scale multiplies each dot product once (each value's
 * weight p once), never the channels. */
INLINE void attend(const float *qs, const void *k_pool, const void *v_pool, const float *ks, const float *vs,
                   const int32_t *table, int64_t start, int64_t len, int64_t seq_len, int64_t nh, int64_t groups,
                   int64_t row, int64_t kvh, const int64_t D, int64_t block_size, float scale, float softcap,
                   float *scores, float *o, float *m, float *l, const int dt) {
    enum { MAXV = 128 / VW };
    const int in_regs = D % VW == 0 && D <= 128; /* a constant wherever D is */
    const int64_t NV = D / VW, nkv = nh / groups, page = block_size * row, n = len - start;
    const int64_t span = nkv * D * DT_SIZE(dt);
    int64_t i = 0;
    for (int64_t pos = start; pos < len; pos++, i++) {
        const int64_t blk = pos / block_size, off = (pos % block_size) * row;
        if (pos + block_size < seq_len) prefetch_span(at(k_pool, (int64_t)table[blk + 1] * page + off, dt), span);
        const void *kr = at(k_pool, (int64_t)table[blk] * page + off, dt);
        for (int64_t g = 0; g < nkv; g++) {
            const float sg = scale * row_scale(ks, table, pos, block_size, kvh, g, dt);
            if (in_regs) {
                vf kw[MAXV];
                for (int64_t v = 0; v < NV; v++) kw[v] = load(at(kr, g * D + v * VW, dt), dt);
                for (int64_t h = g * groups; h < (g + 1) * groups; h++) {
                    const float *qh = qs + h * D;
                    vf acc = *(const vf *)qh * kw[0];
                    for (int64_t v = 1; v < NV; v++) acc += *(const vf *)(qh + v * VW) * kw[v];
                    scores[h * n + i] = hsum(acc) * sg;
                }
            } else {
                for (int64_t h = g * groups; h < (g + 1) * groups; h++)
                    scores[h * n + i] = dot(qs + h * D, at(kr, g * D, dt), D, dt) * sg;
            }
        }
    }
    exp_rows(scores, nh, n, softcap, m, l);
    for (int64_t x = 0; x < nh * D; x++) o[x] = 0.f;
    i = 0;
    for (int64_t pos = start; pos < len; pos++, i++) {
        const int64_t blk = pos / block_size, off = (pos % block_size) * row;
        if (pos + block_size < seq_len) prefetch_span(at(v_pool, (int64_t)table[blk + 1] * page + off, dt), span);
        const void *vr = at(v_pool, (int64_t)table[blk] * page + off, dt);
        for (int64_t g = 0; g < nkv; g++) {
            const float sg = row_scale(vs, table, pos, block_size, kvh, g, dt);
            if (in_regs) {
                vf vw[MAXV];
                for (int64_t v = 0; v < NV; v++) vw[v] = load(at(vr, g * D + v * VW, dt), dt);
                for (int64_t h = g * groups; h < (g + 1) * groups; h++) {
                    const float p = scores[h * n + i] * sg;
                    float *oh = o + h * D;
                    for (int64_t v = 0; v < NV; v++) *(vf *)(oh + v * VW) += p * vw[v];
                }
            } else {
                for (int64_t h = g * groups; h < (g + 1) * groups; h++)
                    axpy(o + h * D, scores[h * n + i] * sg, at(vr, g * D, dt), D, dt);
            }
        }
    }
}

/* One partition with the head dimension (32, 64, 128: constants) and the pool dtype specialised. */
static void attend_task(const float *qs, const void *kp, const void *vp, const float *ks, const float *vs,
                        const int32_t *table, int64_t start, int64_t len, int64_t seq_len, int64_t nh,
                        int64_t groups, int64_t row, int64_t kvh, int64_t D, int64_t block_size, float scale,
                        float softcap, float *scores, float *o, float *m, float *l, int dt) {
#define ATTEND(DIM, DT)                                                                                            \
    attend(qs, kp, vp, ks, vs, table, start, len, seq_len, nh, groups, row, kvh, DIM, block_size, scale, softcap, \
           scores, o, m, l, DT)
#define ATTEND_DIMS(DT)                     \
    switch (D) {                            \
        case 32: ATTEND(32, DT); break;     \
        case 64: ATTEND(64, DT); break;     \
        case 128: ATTEND(128, DT); break;   \
        default: ATTEND(D, DT); break;      \
    }
    if (dt == DT_I8) {
        ATTEND_DIMS(DT_I8)
    } else if (dt == DT_BF16) {
        ATTEND_DIMS(DT_BF16)
#if HAS_F16
    } else if (dt == DT_F16) {
        ATTEND_DIMS(DT_F16)
#endif
    } else {
        ATTEND_DIMS(DT_F32)
    }
#undef ATTEND_DIMS
#undef ATTEND
}

/* Tokens per partition (see "Partitions"): a multiple of the usual block sizes, long enough that a
 * partition's combine (nh * (D + 2) floats) is small beside its keys and values, short enough that
 * one sequence of a few hundred tokens still spreads over the threads. */
#define PARTITION 64

/* One partition's results in a scratch row of num_heads * (D + 2) floats: the weighted values
 * [num_heads][D], then m [num_heads], then l [num_heads]. */
#define PART_FLOATS(num_heads, D) ((num_heads) * ((D) + 2))

/* A sequence's output for heads [h0, h0 + nh): its nparts partitions' rows (parts, PART_FLOATS(num_heads,
 * D) floats apart) rescaled to the largest m and summed in partition order, over the rescaled sum of
 * exponentials. One partition: its values over its l. Not inlined: both work splits then run the same
 * instructions, hence give the same bits. */
__attribute__((noinline)) static void combine(const float *parts, int64_t nparts, int64_t num_heads, int64_t h0,
                                              int64_t nh, int64_t D, float *out) {
    const int64_t stride = PART_FLOATS(num_heads, D);
    const float *m = parts + num_heads * D, *l = m + num_heads;
    for (int64_t h = h0; h < h0 + nh; h++) {
        float *oh = out + (h - h0) * D;
        float mx = m[h];
        for (int64_t p = 1; p < nparts; p++) mx = m[p * stride + h] > mx ? m[p * stride + h] : mx;
        float sum = 0.f;
        for (int64_t d = 0; d < D; d++) oh[d] = 0.f;
        for (int64_t p = 0; p < nparts; p++) {
            const float w = nparts == 1 ? 1.f : expf(m[p * stride + h] - mx);
            sum += w * l[p * stride + h];
            const float *op = parts + p * stride + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) oh[d] += w * op[d];
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) oh[d] *= inv;
    }
}

/* Positions [*start, *len) sequence s attends (sliding_window > 0: the last sliding_window), and
 * their number of partitions (0 when there are none). */
static int64_t sequence_span(const int32_t *seq_lens, int64_t s, int64_t sliding_window, int64_t *start,
                             int64_t *len) {
    *len = seq_lens[s];
    *start = (sliding_window > 0 && *len > sliding_window) ? *len - sliding_window : 0;
    return *len > *start ? (*len - *start + PARTITION - 1) / PARTITION : 0;
}

static int64_t paged_decode(const float *q, const void *k_pool, const void *v_pool, const float *k_scale,
                            const float *v_scale, int dt, const int32_t *block_tables, const int32_t *seq_lens,
                            int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, float softcap, int64_t sliding_window,
                            int64_t split_heads, int64_t split_context, int64_t num_threads, float *out) {
    const int64_t groups = num_heads / num_kv_heads, D = head_dim;
    const int64_t row = num_kv_heads * head_dim; /* elements per token in a page */
    const int64_t pf = PART_FLOATS(num_heads, D);
    if (num_threads < 1) num_threads = omp_get_max_threads();
    /* first[s]: sequence s's first partition in the batch's numbering; first[num_seqs]: all of them
     * (on the stack for a usual batch: this runs once per layer per step). */
    int64_t on_stack[256];
    int64_t *first = num_seqs < 256 ? on_stack : (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (!first) return 1;
    first[0] = 0;
    int64_t longest = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t start, len;
        const int64_t np = sequence_span(seq_lens, s, sliding_window, &start, &len);
        first[s + 1] = first[s] + np;
        longest = np > longest ? np : longest;
    }
    const int64_t total = first[num_seqs];
    /* Fewer sequences than a few per thread leave threads idle (and one long context on one thread):
     * split each sequence's partitions into tasks; if that is still too few, split by KV head too
     * (unless the whole batch is one partition: too little work to wake another thread for). */
    const int64_t busy = 4 * num_threads;
    if (split_context < 0) split_context = num_seqs < busy && longest > 1;
    if (split_heads < 0) split_heads = (split_context ? total : num_seqs) < busy && total > 1;
    const int64_t splits = split_heads ? num_kv_heads : 1;
    const int64_t nh = num_heads / splits;
    const int64_t units = split_context ? total : num_seqs;
    /* No more threads than tasks: waking a thread with nothing to do costs more than a short task
     * (and, on a busy machine, waiting for a core to run it on). */
    if (num_threads > units * splits) num_threads = units * splits > 0 ? units * splits : 1;
    /* Split by partition: every partition's results, combined after the barrier. */
    float *parts = split_context ? (float *)malloc(sizeof(float) * (size_t)(total * pf)) : NULL;
    if (split_context && total > 0 && !parts) {
        if (first != on_stack) free(first);
        return 1;
    }
    /* Split by partition: tasks of a sequence done so far; the one that completes the sequence
     * combines it, so the team meets only once, at the end (on a busy machine every barrier can wait
     * for a thread that is not running). A sequence with nothing attended has no task: zeros here. */
    int64_t done_on_stack[256];
    int64_t *done = NULL;
    if (split_context) {
        done = num_seqs < 256 ? done_on_stack : (int64_t *)malloc(sizeof(int64_t) * (size_t)num_seqs);
        if (!done) {
            free(parts);
            if (first != on_stack) free(first);
            return 1;
        }
        for (int64_t s = 0; s < num_seqs; s++) {
            done[s] = 0;
            if (first[s + 1] == first[s])
                for (int64_t x = 0; x < num_heads * D; x++) out[s * num_heads * D + x] = 0.f;
        }
    }
    int64_t failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* This thread's scratch: a partition's scores, and (one task per sequence) every partition's
         * results, the longest sequence's many. */
        float *scratch = (float *)malloc(sizeof(float) * (size_t)(nh * PARTITION + (split_context ? 0 : longest * pf)));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t t = 0; t < units * splits; t++) {
            if (!scratch) continue;
            const int64_t u = t / splits, g0 = (t % splits) * (num_kv_heads / splits), h0 = g0 * groups;
            /* The sequence and its partitions [p0, p1) this task computes. */
            int64_t s = u, p0 = 0, p1;
            if (split_context) {
                int64_t lo = 0, hi = num_seqs - 1; /* the last s with first[s] <= u */
                while (lo < hi) {
                    const int64_t mid = (lo + hi + 1) / 2;
                    if (first[mid] <= u) lo = mid;
                    else hi = mid - 1;
                }
                s = lo;
                p0 = u - first[s];
                p1 = p0 + 1;
            }
            int64_t start, len;
            const int64_t np = sequence_span(seq_lens, s, sliding_window, &start, &len);
            if (!split_context) p1 = np;
            float *o = out + (s * num_heads + h0) * D;
            if (np == 0) { /* nothing attended (an empty context): zeros */
                for (int64_t x = 0; x < nh * D; x++) o[x] = 0.f;
                continue;
            }
            float *mine = split_context ? parts + first[s] * pf : scratch + nh * PARTITION;
            for (int64_t p = p0; p < p1; p++) {
                const int64_t a = start + p * PARTITION, b = a + PARTITION < len ? a + PARTITION : len;
                float *res = mine + p * pf;
                attend_task(q + (s * num_heads + h0) * D, at(k_pool, g0 * D, dt), at(v_pool, g0 * D, dt),
                            k_scale ? k_scale + g0 : NULL, v_scale ? v_scale + g0 : NULL,
                            block_tables + s * max_blocks, a, b, len, nh, groups, row, num_kv_heads, D, block_size,
                            scale, softcap, scratch, res + h0 * D, res + num_heads * D + h0,
                            res + num_heads * D + num_heads + h0, dt);
            }
            if (!split_context)
                combine(mine, np, num_heads, h0, nh, D, o);
            /* release: this task's results; acquire: every other task's, for the last one */
            else if (__atomic_add_fetch(&done[s], 1, __ATOMIC_ACQ_REL) == np * splits)
                combine(mine, np, num_heads, 0, num_heads, D, out + s * num_heads * D);
        }
        free(scratch);
    }
    if (done && done != done_on_stack) free(done);
    free(parts);
    if (first != on_stack) free(first);
    return failed;
}

/* pool_kind: 0 for float32 pools, 1 for bfloat16 ones, 3 for float16 ones (DT_F16: builds with
 * hf_contbatch_decode_has_f16()). Returns 0, or 1 when scratch memory could not be allocated (the
 * caller raises MemoryError). */
int64_t hf_contbatch_paged_decode(const float *q, const void *k_pool, const void *v_pool, int64_t pool_kind,
                                  const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs,
                                  int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t block_size, float scale, float softcap, int64_t sliding_window,
                                  int64_t split_heads, int64_t split_context, int64_t num_threads, float *out) {
    const int dt = pool_kind == DT_BF16 ? DT_BF16 : (HAS_F16 && pool_kind == DT_F16) ? DT_F16 : DT_F32;
    return paged_decode(q, k_pool, v_pool, NULL, NULL, dt, block_tables, seq_lens,
                        num_seqs, max_blocks, num_heads, num_kv_heads, head_dim, block_size, scale, softcap,
                        sliding_window, split_heads, split_context, num_threads, out);
}

/* int8 pools with float32 scales [num_blocks, block_size, num_kv_heads] for K and for V; otherwise as
 * hf_contbatch_paged_decode. */
int64_t hf_contbatch_paged_decode_q8(const float *q, const int8_t *k_pool, const int8_t *v_pool, const float *k_scale,
                                     const float *v_scale, const int32_t *block_tables, const int32_t *seq_lens,
                                     int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                                     int64_t head_dim, int64_t block_size, float scale, float softcap,
                                     int64_t sliding_window, int64_t split_heads, int64_t split_context,
                                     int64_t num_threads, float *out) {
    return paged_decode(q, k_pool, v_pool, k_scale, v_scale, DT_I8, block_tables, seq_lens, num_seqs, max_blocks,
                        num_heads, num_kv_heads, head_dim, block_size, scale, softcap, sliding_window, split_heads,
                        split_context, num_threads, out);
}

/* Store one step's K and V rows into their slots: key/value element (h, t, d) at
 * key + t * stride_t + h * stride_h + d (the [1, KVH, T, D] tensors transformers passes, often
 * transposed views), pool row of slot s at pool + (s * num_kv_heads + h) * head_dim; elem_bytes 4
 * (float32) or 2 (bfloat16), the pools' dtype. One call for both pools: an index_copy_ per pool
 * costs more than the copy at a decode step's few rows. */
void hf_contbatch_store_kv(const void *key, const void *value, int64_t k_stride_t, int64_t k_stride_h,
                           int64_t v_stride_t, int64_t v_stride_h, void *k_pool, void *v_pool,
                           const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim,
                           int64_t elem_bytes) {
    const size_t row = (size_t)(head_dim * elem_bytes);
    for (int64_t t = 0; t < num_tokens; t++) {
        char *kd = (char *)k_pool + slots[t] * num_kv_heads * (int64_t)row;
        char *vd = (char *)v_pool + slots[t] * num_kv_heads * (int64_t)row;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            memcpy(kd + h * (int64_t)row, (const char *)key + (t * k_stride_t + h * k_stride_h) * elem_bytes, row);
            memcpy(vd + h * (int64_t)row, (const char *)value + (t * v_stride_t + h * v_stride_h) * elem_bytes, row);
        }
    }
}

/* Quantize one row of D elements (float32, or bfloat16 when dt is DT_BF16) to int8: scale = max|x| / 127
 * (0 for an all-zero row), q = x * (1 / scale) rounded to nearest, ties to even (as torch.round),
 * which lies in [-127, 127] by construction (|x| <= max|x|; the clamp guards the last ulp). One pass
 * to find the absmax and one to scale, round and narrow, both VW lanes wide where the compiler
 * targets AVX-512 or AVX2 (vcvtps2dq rounds to nearest even; vpmovsdb narrows with saturation),
 * a scalar tail for head sizes not a multiple of VW. The reference (kv_quant.quantize_kv) divides
 * by the scale: the product with its reciprocal can differ in the last ulp, so a value within an
 * ulp of a half-integer may round one step apart (tests allow that, and only that). */
INLINE void quantize_row(const void *x, const int dt, int64_t D, int8_t *q, float *scale) {
    float amax = 0.f;
    int64_t d = 0;
#if defined(__AVX512F__)
    __m512 m = _mm512_setzero_ps();
    for (; d + VW <= D; d += VW) m = _mm512_max_ps(m, _mm512_abs_ps((__m512)load(at(x, d, dt), dt)));
    amax = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (; d + VW <= D; d += VW) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, (__m256)load(at(x, d, dt), dt)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    amax = _mm_cvtss_f32(h);
#endif
    for (; d < D; d++) {
        const float v = fabsf(load_one(at(x, d, dt), dt));
        amax = v > amax ? v : amax;
    }
    const float s = amax / 127.f;
    *scale = s;
    const float inv = amax > 0.f ? 127.f / amax : 0.f; /* not 1 / s: the two divisions then overlap */
    d = 0;
#if defined(__AVX512F__)
    for (; d + VW <= D; d += VW) {
        const __m512i r = _mm512_cvtps_epi32((__m512)(load(at(x, d, dt), dt) * inv));
        _mm_storeu_si128((__m128i *)(q + d), _mm512_cvtsepi32_epi8(r));
    }
#elif defined(__AVX2__)
    for (; d + VW <= D; d += VW) {
        const __m256i r = _mm256_cvtps_epi32((__m256)(load(at(x, d, dt), dt) * inv));
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storel_epi64((__m128i *)(q + d), _mm_packs_epi16(w, w));
    }
#endif
    for (; d < D; d++) {
        float v = rintf(load_one(at(x, d, dt), dt) * inv);
        v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;
        q[d] = (int8_t)v;
    }
}

#if defined(__AVX512F__) || defined(__AVX2__)
/* quantize_row for D a constant multiple of VW (32, 64, 128): the row is loaded (and widened) once
 * into D / VW registers that both passes use; same results as quantize_row. */
INLINE void quantize_row_regs(const void *x, const int dt, const int64_t D, int8_t *q, float *scale) {
    enum { MAXV = 128 / VW };
    vf xs[MAXV];
    for (int64_t v = 0; v < D / VW; v++) xs[v] = load(at(x, v * VW, dt), dt);
#if defined(__AVX512F__)
    __m512 m = _mm512_abs_ps((__m512)xs[0]);
    for (int64_t v = 1; v < D / VW; v++) m = _mm512_max_ps(m, _mm512_abs_ps((__m512)xs[v]));
    const float amax = _mm512_reduce_max_ps(m);
#else
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_andnot_ps(sign, (__m256)xs[0]);
    for (int64_t v = 1; v < D / VW; v++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, (__m256)xs[v]));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float amax = _mm_cvtss_f32(h);
#endif
    *scale = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t v = 0; v < D / VW; v++) {
#if defined(__AVX512F__)
        _mm_storeu_si128((__m128i *)(q + v * VW), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32((__m512)(xs[v] * inv))));
#else
        const __m256i r = _mm256_cvtps_epi32((__m256)(xs[v] * inv));
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storel_epi64((__m128i *)(q + v * VW), _mm_packs_epi16(w, w));
#endif
    }
}
#define QUANTIZE_FIXED(x, dt, D, q, s) quantize_row_regs(x, dt, D, q, s)
#else
#define QUANTIZE_FIXED(x, dt, D, q, s) quantize_row(x, dt, D, q, s)
#endif

/* The rows of num_tokens tokens (key/value/slots already offset to the first), serially; the input
 * dtype and the head size (32, 64, 128) constants in each loop. */
static void store_q8_rows(const void *key, const void *value, int64_t k_stride_t, int64_t k_stride_h,
                          int64_t v_stride_t, int64_t v_stride_h, int8_t *k_pool, int8_t *v_pool, float *k_scale,
                          float *v_scale, const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads,
                          int64_t head_dim, int dt) {
#define STORE_ROWS(BF16, DIM, QUANT)                                                                    \
    for (int64_t t = 0; t < num_tokens; t++) {                                                           \
        const int64_t base = slots[t] * num_kv_heads;                                                    \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                                     \
            QUANT(at(key, t * k_stride_t + h * k_stride_h, BF16), BF16, DIM, k_pool + (base + h) * DIM,  \
                  k_scale + base + h);                                                                   \
            QUANT(at(value, t * v_stride_t + h * v_stride_h, BF16), BF16, DIM, v_pool + (base + h) * DIM, \
                  v_scale + base + h);                                                                   \
        }                                                                                                \
    }
#define STORE_DIMS(BF16)                                          \
    switch (head_dim) {                                           \
        case 32: STORE_ROWS(BF16, 32, QUANTIZE_FIXED); break;     \
        case 64: STORE_ROWS(BF16, 64, QUANTIZE_FIXED); break;     \
        case 128: STORE_ROWS(BF16, 128, QUANTIZE_FIXED); break;   \
        default: STORE_ROWS(BF16, head_dim, quantize_row); break; \
    }
    if (dt == DT_BF16) {
        STORE_DIMS(DT_BF16)
    } else {
        STORE_DIMS(DT_F32)
    }
#undef STORE_DIMS
#undef STORE_ROWS
}

/* Store one step's K and V rows quantized (the int8 layout of hf_contbatch_paged_decode_q8): inputs as
 * hf_contbatch_store_kv with in_bf16 0 (float32) or 1 (bfloat16); pool row of slot s at
 * pool + (s * num_kv_heads + h) * head_dim, its scale at scales[s * num_kv_heads + h].
 * A prompt chunk (many tokens) is split over the threads, each a contiguous share of the tokens
 * (slots are distinct: no two tokens write one row); a decode step's few rows stay on the calling
 * thread, where waking the team would cost more than the work. */
void hf_contbatch_store_kv_q8(const void *key, const void *value, int64_t k_stride_t, int64_t k_stride_h,
                              int64_t v_stride_t, int64_t v_stride_h, int8_t *k_pool, int8_t *v_pool, float *k_scale,
                              float *v_scale, const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads,
                              int64_t head_dim, int64_t in_bf16) {
    const int dt = in_bf16 ? DT_BF16 : DT_F32;
    if (num_tokens * num_kv_heads * head_dim < STORE_PAR_ELEMS) {
        store_q8_rows(key, value, k_stride_t, k_stride_h, v_stride_t, v_stride_h, k_pool, v_pool, k_scale, v_scale,
                      slots, num_tokens, num_kv_heads, head_dim, dt);
        return;
    }
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t t0 = num_tokens * id / nt, t1 = num_tokens * (id + 1) / nt;
        store_q8_rows(at(key, t0 * k_stride_t, dt), at(value, t0 * v_stride_t, dt), k_stride_t, k_stride_h,
                      v_stride_t, v_stride_h, k_pool, v_pool, k_scale, v_scale, slots + t0, t1 - t0, num_kv_heads,
                      head_dim, dt);
    }
}
