/* Causal multi-head self-attention on the CPU (see include/tidal/ops.h).
 *
 * Memory trade-off: the textbook reference (llm.c's train_gpt2.c) keeps the
 * pre-softmax scores and the softmax weights, 2 x (B,NH,T,T) floats per layer
 * (GPT-2 124M at B=8, T=1024: 2 x 384 MiB per layer, 9 GiB for 12 layers),
 * and its backward needs two more such buffers.  Here forward keeps only the
 * log-sum-exp of each score row, lse (B,NH,T) (384 KiB per layer there), and
 * backward recomputes each weight as p = exp(s - lse), s = q.k / sqrt(hs), as
 * FlashAttention does: one more Q K^T product in backward, nothing in memory.
 * The softmax backward needs D[t] = sum_t2 p[t2] dp[t2], which equals
 * dout[t] . out[t] (FlashAttention-2), so no row of p has to be kept.  The
 * CUDA attention saves the same lse, so this is also the contract it is
 * tested against.
 *
 * Work is cut into tiles of QT queries x KT keys of one head and done with
 * the blocked GEMM (ops_gemm_impl.h) on small stack buffers, so attention runs
 * at matmul speed.  Key tiles strictly above the diagonal are skipped; inside
 * a diagonal tile the entries with t2 > t are masked (p = 0).
 *   forward, per query tile, key tiles in ascending order (online softmax):
 *     S = Q K^T * scale;  m' = max(m, rowmax S);  rescale out and l by exp(m - m');
 *     P = exp(S - m');  l += rowsum P;  out += P V;   finally out /= l, lse = m + log l
 *   backward, per head, query tiles then key tiles in ascending order:
 *     P = exp(Q K^T * scale - lse);  dP = dout V^T;  dS = P (dP - D) * scale;
 *     dQ += dS K;  dK += dS^T Q;  dV += P^T dout
 * Parallelism and order: forward tiles (b, h, query tile) are independent.
 * Backward adds into dK and dV from every query tile, so a thread owns a whole
 * key/value head (b, g) and walks its query heads and their tiles in a fixed
 * order; the GEMM's own sums have a fixed order too.  So the results are
 * bit-identical for any thread count.
 *
 * Packed sequences (pos not NULL): a row holds several documents and token t
 * of row b attends to keys t2 in [t - pos[b,t], t], its own document's up to
 * itself.  A query tile's key tiles start at the tile containing the lowest
 * document start of its rows; inside the visited tiles the keys before a
 * row's document start are masked like the future.  A tile where a row sees
 * no key at all leaves that row's running max and sum alone.
 *
 * Grouped-query attention (LLaMA, Qwen2): NKV key/value heads, each shared by
 * NH / NKV consecutive query heads; the rows of qkv hold the NH query heads,
 * then the NKV key heads, then the NKV value heads.  With NKV = NH it is the
 * GPT-2 layout (q, k, v of C channels each) and the same arithmetic. */
#include "tidal/ops.h"

#include <math.h>
#include <string.h>

#include "ops_internal.h"

enum { QT = 64, KT = 64 }; /* queries and keys per tile: 2 x 16 KiB of stack */

void td_ops_attention_forward(float *out, float *lse, const float *qkv, int B, int T, int C,
                              int NH)
{
    td_ops_attention_gqa_forward(out, lse, qkv, NULL, B, T, NH, NH, C / NH);
}

/* The first key a query of row b at t may read: its document's start. */
static inline int doc_start(const int *pos, int b, int T, int t) { return pos ? t - pos[(size_t)b * T + t] : 0; }

/* The lowest document start of queries [t0, t0 + nq) of row b. */
static int tile_start(const int *pos, int b, int T, int t0, int nq)
{
    int lo = t0;
    for (int r = 0; r < nq; r++) {
        const int s = doc_start(pos, b, T, t0 + r);
        if (s < lo) lo = s;
    }
    return pos ? lo : 0;
}

void td_ops_attention_gqa_forward(float *out, float *lse, const float *qkv, const int *pos, int B, int T, int NH,
                                  int NKV, int hs)
{
    const int q_tiles = (T + QT - 1) / QT, group = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hs);
    const size_t C = (size_t)NH * hs, KV = (size_t)NKV * hs, C3 = C + 2 * KV; /* row of q, k, v */
    td_ops_gemm_fn *gemm = td_ops_gemm_get(td_ops_isa_best());
#pragma omp parallel for collapse(3) schedule(dynamic, 1)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int qt = 0; qt < q_tiles; qt++) {
                const int t0 = qt * QT, nq = T - t0 < QT ? T - t0 : QT;
                const float *q = qkv + ((size_t)b * T + t0) * C3 + h * hs;  // (nq, hs), row stride C3
                const float *k = qkv + (size_t)b * T * C3 + C + (size_t)(h / group) * hs; // (T, hs): its kv head
                const float *v = k + KV;                                    // (T, hs), row stride C3
                float *o = out + ((size_t)b * T + t0) * C + h * hs;         // (nq, hs), row stride C
                float s[QT * KT];                                           // (nq, nk), row stride KT
                float m[QT], l[QT];
                for (int r = 0; r < nq; r++) {
                    m[r] = -INFINITY;
                    l[r] = 0.0f;
                    memset(o + (size_t)r * C, 0, (size_t)hs * sizeof(float));
                }
                const int first = tile_start(pos, b, T, t0, nq) / KT * KT;
                for (int j0 = first; j0 < t0 + nq; j0 += KT) { // keys up to the last query
                    const int nk = t0 + nq - j0 < KT ? t0 + nq - j0 : KT;
                    memset(s, 0, sizeof s);
                    gemm(nq, nk, hs, s, KT, q, C3, 1, k + j0 * C3, 1, C3); // S = Q K^T
                    for (int r = 0; r < nq; r++) {
                        float *sr = s + r * KT;
                        const int hi = t0 + r - j0 + 1 < nk ? t0 + r - j0 + 1 : nk; // t2 <= t
                        const int s0 = doc_start(pos, b, T, t0 + r) - j0, lo = s0 > 0 ? s0 : 0; // t2 >= start
                        if (hi <= lo) { // the whole tile is in this query's future or another document
                            memset(sr, 0, (size_t)nk * sizeof(float));
                            continue;
                        }
                        float mx = m[r];
                        for (int j = lo; j < hi; j++) {
                            sr[j] *= scale;
                            if (sr[j] > mx) mx = sr[j];
                        }
                        const float rescale = expf(m[r] - mx); // 0 on the row's first tile
                        float *orow = o + (size_t)r * C;
                        for (int i = 0; i < hs; i++) orow[i] *= rescale;
                        l[r] *= rescale;
                        for (int j = 0; j < lo; j++) sr[j] = 0.0f;
                        for (int j = lo; j < hi; j++) {
                            sr[j] = expf(sr[j] - mx);
                            l[r] += sr[j];
                        }
                        for (int j = hi; j < nk; j++) sr[j] = 0.0f;
                        m[r] = mx;
                    }
                    gemm(nq, hs, nk, o, C, s, KT, 1, v + j0 * C3, C3, 1); // out += P V
                }
                for (int r = 0; r < nq; r++) {
                    const float inv = 1.0f / l[r];
                    float *orow = o + (size_t)r * C;
                    for (int i = 0; i < hs; i++) orow[i] *= inv;
                    lse[((size_t)b * NH + h) * T + t0 + r] = m[r] + logf(l[r]);
                }
            }
}

void td_ops_attention_backward(float *dqkv, const float *dout, const float *qkv,
                               const float *out, const float *lse, int B, int T, int C, int NH)
{
    td_ops_attention_gqa_backward(dqkv, dout, qkv, out, lse, NULL, B, T, NH, NH, C / NH);
}

/* A thread owns one key/value head (b, g) and walks its group's query heads
 * in ascending order, so dK and dV sum in a fixed order. */
void td_ops_attention_gqa_backward(float *dqkv, const float *dout, const float *qkv, const float *out,
                                   const float *lse, const int *pos, int B, int T, int NH, int NKV, int hs)
{
    const int group = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hs);
    const size_t C = (size_t)NH * hs, KV = (size_t)NKV * hs, C3 = C + 2 * KV;
    td_ops_gemm_fn *gemm = td_ops_gemm_get(td_ops_isa_best());
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int b = 0; b < B; b++)
        for (int g = 0; g < NKV; g++) {
            const float *k = qkv + (size_t)b * T * C3 + C + (size_t)g * hs;  // (T, hs), row stride C3
            const float *v = k + KV;
            float *dk = dqkv + (size_t)b * T * C3 + C + (size_t)g * hs;      // (T, hs), row stride C3
            float *dv = dk + KV;
            float p[QT * KT], ds[QT * KT], D[QT];                            // (nq, nk), row stride KT
            for (int h = g * group; h < (g + 1) * group; h++) {
                const float *row_lse = lse + ((size_t)b * NH + h) * T;       // (T)
                for (int t0 = 0; t0 < T; t0 += QT) {
                    const int nq = T - t0 < QT ? T - t0 : QT;
                    const float *q = qkv + ((size_t)b * T + t0) * C3 + h * hs;
                    float *dq = dqkv + ((size_t)b * T + t0) * C3 + h * hs;
                    const float *o = out + ((size_t)b * T + t0) * C + h * hs;
                    const float *dO = dout + ((size_t)b * T + t0) * C + h * hs;
                    for (int r = 0; r < nq; r++)
                        D[r] = td_ops_dot(dO + (size_t)r * C, o + (size_t)r * C, hs);
                    const int first = tile_start(pos, b, T, t0, nq) / KT * KT;
                    for (int j0 = first; j0 < t0 + nq; j0 += KT) {
                        const int nk = t0 + nq - j0 < KT ? t0 + nq - j0 : KT;
                        memset(p, 0, sizeof p);
                        gemm(nq, nk, hs, p, KT, q, C3, 1, k + j0 * C3, 1, C3);    // S = Q K^T
                        memset(ds, 0, sizeof ds);
                        gemm(nq, nk, hs, ds, KT, dO, C, 1, v + j0 * C3, 1, C3);   // dP = dout V^T
                        for (int r = 0; r < nq; r++) {
                            const int start = doc_start(pos, b, T, t0 + r);
                            for (int j = 0; j < nk; j++) {
                                float *pr = p + r * KT + j, *dr = ds + r * KT + j;
                                if (j0 + j > t0 + r || j0 + j < start) { // masked: no weight, no gradient
                                    *pr = 0.0f;
                                    *dr = 0.0f;
                                    continue;
                                }
                                *pr = expf(*pr * scale - row_lse[t0 + r]);
                                *dr = *pr * (*dr - D[r]) * scale;
                            }
                        }
                        gemm(nq, hs, nk, dq, C3, ds, KT, 1, k + j0 * C3, C3, 1);          // dQ += dS K
                        gemm(nk, hs, nq, dk + j0 * C3, C3, ds, 1, KT, q, C3, 1);          // dK += dS^T Q
                        gemm(nk, hs, nq, dv + j0 * C3, C3, p, 1, KT, dO, C, 1);           // dV += P^T dout
                    }
                }
            }
        }
}
