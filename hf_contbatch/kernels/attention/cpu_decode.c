/* Paged decode attention for CPU, float32: one query token per sequence, keys and values read in
 * place from the KV pool's pages through each sequence's block table (no gather, no copy).
 *
 * Built on first use by hf_contbatch/attention/cpu_kernel.py with the system C compiler
 * (-O3 -march=native -ffast-math -fopenmp) and called through ctypes. OpenMP here is the libgomp
 * torch itself loads (same soname), so the kernel shares torch's thread team.
 *
 * Layouts (all contiguous): q and out [num_seqs, num_heads, head_dim]; k_pool and v_pool
 * [num_blocks, block_size, num_kv_heads, head_dim]; block_tables int32 [num_seqs, max_blocks];
 * seq_lens int32 [num_seqs] (context length including this step's token, whose K/V are stored).
 * Grouped-query attention: query head h reads KV head h / (num_heads / num_kv_heads).
 * softcap <= 0: none, else scores become softcap * tanh(score / softcap) (Gemma 2).
 * sliding_window <= 0: none, else only the last sliding_window positions are attended (keys
 * with position > seq_len - 1 - sliding_window, as the torch path masks them).
 *
 * Work split: one OpenMP task per sequence, or with split_heads != 0 one per (sequence, KV head),
 * so that a step of a few long sequences (the decode tail) still keeps every thread busy. A task
 * makes one pass over its key rows computing the scores of all its query heads (each row loaded
 * once for all of them), a float32 softmax per head, then one pass over its value rows
 * accumulating every head's output. Rows are walked in order, so within a page the reads are
 * sequential; at each row the same row of the next page is prefetched, which hides the jump
 * between pages.
 * head_dim 32, 64 and 128 get code with the dimension as a constant (loops fully unrolled into
 * 8-float vectors); any other head_dim runs the same code with a runtime dimension and a scalar
 * tail for head_dim % 8.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* 8 floats; aligned(4) lets loads and stores be unaligned. GCC/Clang vector extensions. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline float hsum8(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, const int64_t D) {
    v8 acc = {0};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) acc += *(const v8 *)(a + d) * *(const v8 *)(b + d);
    float s = hsum8(acc);
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

static inline __attribute__((always_inline)) void axpy(float *y, float p, const float *x, const int64_t D) {
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) *(v8 *)(y + d) += p * *(const v8 *)(x + d);
    for (; d < D; d++) y[d] += p * x[d];
}

/* Prefetch `bytes` from p (one line per 64 bytes). */
static inline void prefetch_span(const float *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b);
}

/* One task: nh query heads (qs, o: [nh][D]) over positions [start, len) of one sequence; k_pool and
 * v_pool already offset to the task's first KV head; scores: nh * (len - start) floats of scratch. */
static inline __attribute__((always_inline)) void attend(const float *qs, const float *k_pool, const float *v_pool,
                                                         const int32_t *table, int64_t start, int64_t len,
                                                         int64_t nh, int64_t groups, int64_t row, const int64_t D,
                                                         int64_t block_size, float scale, float softcap,
                                                         float *scores, float *o) {
    const int64_t page = block_size * row, n = len - start, span = (nh / groups) * D * 4;
    int64_t i = 0;
    for (int64_t pos = start; pos < len; pos++, i++) {
        const int64_t blk = pos / block_size, off = (pos % block_size) * row;
        if (pos + block_size < len) prefetch_span(k_pool + (int64_t)table[blk + 1] * page + off, span);
        const float *kr = k_pool + (int64_t)table[blk] * page + off;
        for (int64_t h = 0; h < nh; h++) scores[h * n + i] = dot(qs + h * D, kr + (h / groups) * D, D) * scale;
    }
    for (int64_t h = 0; h < nh; h++) {
        float *sc = scores + h * n;
        if (softcap > 0.f)
            for (int64_t j = 0; j < n; j++) sc[j] = softcap * tanhf(sc[j] / softcap);
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) sc[j] = expf(sc[j] - mx);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) sum += sc[j];
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t j = 0; j < n; j++) sc[j] *= inv;
    }
    for (int64_t x = 0; x < nh * D; x++) o[x] = 0.f;
    i = 0;
    for (int64_t pos = start; pos < len; pos++, i++) {
        const int64_t blk = pos / block_size, off = (pos % block_size) * row;
        if (pos + block_size < len) prefetch_span(v_pool + (int64_t)table[blk + 1] * page + off, span);
        const float *vr = v_pool + (int64_t)table[blk] * page + off;
        for (int64_t h = 0; h < nh; h++) axpy(o + h * D, scores[h * n + i], vr + (h / groups) * D, D);
    }
}

/* Returns 0, or 1 when scratch memory could not be allocated (the caller raises MemoryError). */
int64_t hf_contbatch_paged_decode_f32(const float *q, const float *k_pool, const float *v_pool,
                                   const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs,
                                   int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, float scale, float softcap, int64_t sliding_window,
                                   int64_t split_heads, float *out) {
    const int64_t groups = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats per token in a page */
    const int64_t splits = split_heads ? num_kv_heads : 1;
    const int64_t nh = num_heads / splits;
    int64_t failed = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < num_seqs * splits; t++) {
        const int64_t s = t / splits, g0 = (t % splits) * (num_kv_heads / splits);
        const int64_t len = seq_lens[s];
        const int64_t start = (sliding_window > 0 && len > sliding_window) ? len - sliding_window : 0;
        const int64_t n = len - start;
        const int64_t at = (s * num_heads + g0 * groups) * head_dim;
        if (n <= 0) {
            for (int64_t x = 0; x < nh * head_dim; x++) out[at + x] = 0.f;
            continue;
        }
        const int32_t *table = block_tables + s * max_blocks;
        const float *kp = k_pool + g0 * head_dim, *vp = v_pool + g0 * head_dim;
        float *scores = (float *)malloc(sizeof(float) * (size_t)(nh * n));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
#define ATTEND(DIM) \
    attend(q + at, kp, vp, table, start, len, nh, groups, row, DIM, block_size, scale, softcap, scores, out + at)
        switch (head_dim) {
            case 32: ATTEND(32); break;
            case 64: ATTEND(64); break;
            case 128: ATTEND(128); break;
            default: ATTEND(head_dim); break;
        }
#undef ATTEND
        free(scores);
    }
    return failed;
}
