/* Paged decode attention for CPU, float32: one query token per sequence, keys and values read in
 * place from the KV pool's pages through each sequence's block table (no gather, no copy).
 *
 * Built on first use by hf_contbatch/attention/cpu_kernel.py with the system C compiler
 * (-O3 -march=native -fopenmp) and called through ctypes. OpenMP here is the libgomp torch itself
 * loads (same soname), so the kernel shares torch's thread team.
 *
 * Layouts (all contiguous): q and out [num_seqs, num_heads, head_dim]; k_pool and v_pool
 * [num_blocks, block_size, num_kv_heads, head_dim]; block_tables int32 [num_seqs, max_blocks];
 * seq_lens int32 [num_seqs] (context length including this step's token, whose K/V are stored).
 * Grouped-query attention: query head h reads KV head h / (num_heads / num_kv_heads).
 * softcap <= 0: none, else scores become softcap * tanh(score / softcap) (Gemma 2).
 * sliding_window <= 0: none, else only the last sliding_window + 1 positions are attended
 * (keys with position > seq_len - 1 - sliding_window, as the torch path masks them).
 * One OpenMP task per sequence: one pass over its key rows computes the scores of every query head
 * (each row loaded once for all heads), then a float32 softmax per head, then one pass over its
 * value rows accumulates every head's output. Pages are read where they are (no gather).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void hf_contbatch_paged_decode_f32(const float *q, const float *k_pool, const float *v_pool,
                                   const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs,
                                   int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, float scale, float softcap, int64_t sliding_window,
                                   float *out) {
    const int64_t groups = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats per token in a page */
    const int64_t page = block_size * row;       /* floats per block */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = seq_lens[s];
        const int64_t start = (sliding_window > 0 && len > sliding_window) ? len - sliding_window : 0;
        const int64_t n = len - start;
        if (n <= 0) continue;
        const int32_t *table = block_tables + s * max_blocks;
        /* scores [num_heads][n]; one pass over this sequence's pages serves every head */
        float *scores = (float *)malloc(sizeof(float) * (size_t)(num_heads * n));
        float *acc = (float *)calloc((size_t)(num_heads * head_dim), sizeof(float));
        const float *qs = q + s * num_heads * head_dim;
        int64_t i = 0;
        for (int64_t pos = start; pos < len; pos++, i++) {
            const float *kr = k_pool + (int64_t)table[pos / block_size] * page + (pos % block_size) * row;
            for (int64_t h = 0; h < num_heads; h++) {
                const float *qh = qs + h * head_dim;
                const float *kh = kr + (h / groups) * head_dim;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
                scores[h * n + i] = dot * scale;
            }
        }
        for (int64_t h = 0; h < num_heads; h++) {
            float *sc = scores + h * n;
            if (softcap > 0.f)
                for (int64_t j = 0; j < n; j++) sc[j] = softcap * tanhf(sc[j] / softcap);
            float mx = -INFINITY;
            for (int64_t j = 0; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                sc[j] = expf(sc[j] - mx);
                sum += sc[j];
            }
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
            for (int64_t j = 0; j < n; j++) sc[j] *= inv;
        }
        i = 0;
        for (int64_t pos = start; pos < len; pos++, i++) {
            const float *vr = v_pool + (int64_t)table[pos / block_size] * page + (pos % block_size) * row;
            for (int64_t h = 0; h < num_heads; h++) {
                const float p = scores[h * n + i];
                const float *vh = vr + (h / groups) * head_dim;
                float *a = acc + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * vh[d];
            }
        }
        float *o = out + s * num_heads * head_dim;
        for (int64_t x = 0; x < num_heads * head_dim; x++) o[x] = acc[x];
        free(acc);
        free(scores);
    }
}
