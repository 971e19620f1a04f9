/* `tidal bench ops`: the time of each CUDA op of one transformer block at a
 * training shape, and of the whole block forward and backward, so that a
 * step's compute can be split by op (what the trainer runs: the same ops,
 * the same shapes, buffers from the arena).  Two blocks at the same width:
 * GPT-2's (LayerNorm, fused qkv, multi-head attention, GELU MLP) and a
 * LLaMA-family one (RMSNorm, fused qkv with grouped-query heads, RoPE on q
 * and k, flash GQA, SwiGLU MLP with gate and up from one matmul), so that
 * their TFLOP/s per block compare.
 *
 * Each figure is the median of --repeat timed runs after two warm-up runs
 * (and more until cuBLASLt's candidates for each GEMM shape have been timed),
 * timed with CUDA events on one stream.  Matmuls and attention also give
 * TFLOP/s (2 flops per multiply-add; causal attention counts half the T x T
 * products); memory-bound ops give GB/s of their compulsory reads + writes.
 * The buffers are tidal/block_probe.h's (the same `tidal plan` times the
 * whole block on), random as in training. */
#include "../cli/cli.h"
#include <cjson/cJSON.h>
#include "../cli/args.h"
#include "bench_cuda.h"
#include "tidal/arena.h"
#include "tidal/block_probe.h"
#include "tidal/backend.h"
#include "tidal/model.h"
#include "tidal/ops.h"
#include "tidal/ops_cuda.h"
#include "tidal/util.h"

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct opts {
    int width, heads, kv_heads, mlp, seq, batch, repeat, json;
    const char *precision;
    double peak_tflops, peak_gbs;
    td_bench_peak peak; /* the device's (bench_cuda.h): each row's roofline */
} opts;

typedef struct row { const char *name; double ms, flops, bytes; } row;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One op on the probe's buffers. */
typedef td_status (*op_fn)(td_block_probe *b);
/* Median time of `repeat` runs of fn(b) after two warm-ups, and more until
 * the GEMM shapes' tuning has settled (ops_cuda.h). */
static td_status time_op(td_block_probe *b, op_fn fn, int repeat, double *ms)
{
    cudaEvent_t e0, e1;
    double *t = malloc((size_t)repeat * sizeof *t);
    if (!t) return TD_ERR_NOMEM;
    td_status st = TD_OK;
    if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) {
        free(t);
        return td_error_set(TD_ERR_BACKEND, "cudaEventCreate failed");
    }
    for (int i = 0; i < 2 && !st; i++) st = fn(b);
    for (int i = 0; i < 256 && !st && td_ops_cuda_gemm_tuning(b->ops); i++) {
        st = fn(b);
        cudaStreamSynchronize(b->stream);
    }
    for (int i = 0; i < repeat && !st; i++) {
        cudaEventRecord(e0, b->stream);
        st = fn(b);
        cudaEventRecord(e1, b->stream);
        if (cudaEventSynchronize(e1) != cudaSuccess) st = td_error_set(TD_ERR_BACKEND, "an op failed");
        float f = 0;
        cudaEventElapsedTime(&f, e0, e1);
        t[i] = f;
    }
    if (!st) {
        qsort(t, (size_t)repeat, sizeof *t, cmp_double);
        *ms = t[repeat / 2];
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    free(t);
    return st;
}

/* The ops, in the order a block runs them. */
static td_status ln1_fwd(td_block_probe *b)
{
    return td_ops_cuda_layernorm_forward(b->a.ln1, b->a.ln1_mean, b->a.ln1_rstd, b->x, b->w.ln1_w, b->w.ln1_b, b->N,
                                         b->mc.n_embd, b->dt, b->stream);
}
static td_status qkv_fwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_forward(b->ops, b->a.qkv, NULL, b->a.ln1, b->w.qkv_w, b->w.qkv_b, NULL, b->N, b->mc.n_embd,
                                      3 * b->mc.n_embd, b->dt, b->stream);
}
static td_status att_fwd(td_block_probe *b)
{
    return td_ops_cuda_attention_forward(b->ops, b->a.atty, b->a.att_lse, b->a.qkv, b->B, b->T, b->mc.n_embd, b->mc.n_head, b->dt,
                                         b->scratch, b->scratch_bytes, b->stream);
}
static td_status attproj_fwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_forward(b->ops, b->a.res2, NULL, b->a.atty, b->w.attproj_w, b->w.attproj_b, b->x, b->N,
                                      b->mc.n_embd, b->mc.n_embd, b->dt, b->stream);
}
static td_status ln2_fwd(td_block_probe *b)
{
    return td_ops_cuda_layernorm_forward(b->a.ln2, b->a.ln2_mean, b->a.ln2_rstd, b->a.res2, b->w.ln2_w, b->w.ln2_b,
                                         b->N, b->mc.n_embd, b->dt, b->stream);
}
static td_status fc_fwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_forward(b->ops, b->a.fch_gelu, b->a.fch, b->a.ln2, b->w.fc_w, b->w.fc_b, NULL, b->N,
                                      b->mc.n_embd, 4 * b->mc.n_embd, b->dt, b->stream);
}
static td_status fcproj_fwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_forward(b->ops, b->y, NULL, b->a.fch_gelu, b->w.fcproj_w, b->w.fcproj_b, b->a.res2,
                                      b->N, 4 * b->mc.n_embd, b->mc.n_embd, b->dt, b->stream);
}
static td_status fcproj_bwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_backward_gelu(b->ops, b->big, b->g.fcproj_w, b->g.fcproj_b, b->dy, b->a.fch_gelu,
                                            b->w.fcproj_w, b->a.fch, b->N, 4 * b->mc.n_embd, b->mc.n_embd, b->dt, b->dt,
                                            b->scratch, b->scratch_bytes, b->stream);
}
static td_status fc_bwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_backward(b->ops, b->dx, b->g.fc_w, b->g.fc_b, b->big, b->a.ln2, b->w.fc_w, b->N, b->mc.n_embd,
                                       4 * b->mc.n_embd, TD_OPS_CUDA_SET, b->dt, b->dt, b->scratch, b->scratch_bytes, b->stream);
}
static td_status ln2_bwd(td_block_probe *b)
{
    return td_ops_cuda_layernorm_backward_res(b->dx, NULL, b->g.ln2_w, b->g.ln2_b, b->dy, b->a.res2, b->w.ln2_w,
                                              b->a.ln2_mean, b->a.ln2_rstd, b->N, b->mc.n_embd, b->dt, b->dt,
                                              b->scratch, b->scratch_bytes, b->stream);
}
static td_status attproj_bwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_backward(b->ops, b->dx, b->g.attproj_w, b->g.attproj_b, b->dy, b->a.atty,
                                       b->w.attproj_w, b->N, b->mc.n_embd, b->mc.n_embd, TD_OPS_CUDA_SET, b->dt, b->dt, b->scratch,
                                       b->scratch_bytes, b->stream);
}
static td_status att_bwd(td_block_probe *b)
{
    return td_ops_cuda_attention_backward(b->ops, b->big, b->dx, b->a.qkv, b->a.atty, b->a.att_lse, b->B, b->T, b->mc.n_embd,
                                          b->mc.n_head, TD_OPS_CUDA_SET, b->dt, b->scratch, b->scratch_bytes, b->stream);
}
static td_status qkv_bwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_backward(b->ops, b->dx, b->g.qkv_w, b->g.qkv_b, b->big, b->a.ln1, b->w.qkv_w, b->N,
                                       b->mc.n_embd, 3 * b->mc.n_embd, TD_OPS_CUDA_SET, b->dt, b->dt, b->scratch, b->scratch_bytes,
                                       b->stream);
}
static td_status ln1_bwd(td_block_probe *b)
{
    return td_ops_cuda_layernorm_backward_res(b->dx, NULL, b->g.ln1_w, b->g.ln1_b, b->dy, b->x, b->w.ln1_w,
                                              b->a.ln1_mean, b->a.ln1_rstd, b->N, b->mc.n_embd, b->dt, b->dt,
                                              b->scratch, b->scratch_bytes, b->stream);
}
static td_status block_fwd(td_block_probe *b) { return td_block_probe_forward(b); }
static td_status block_bwd(td_block_probe *b) { return td_block_probe_backward(b); }

/* --- the LLaMA-family block ------------------------------------------------------ */

/* The same probe with a LLaMA description: the block's tensors in w and g
 * (ln1_w = input_layernorm, qkv_w (QKV,C), attproj_w = o_proj, ln2_w,
 * fc_w = gate|up (2F,C), fcproj_w = down (C,F)), its acts in a (ln1, qkv
 * after RoPE, atty, res2, ln2, fch = gate|up, fch_gelu = silu(gate) * up),
 * and on the way back mid = dh (N,F), big = dgate_up then dqkv, dres =
 * dres2, dc for the norms' and projections' input gradients.  Shapes: N = B
 * T rows, C wide, NH query and NKV key/value heads of hs, QKV = (NH + 2 NKV)
 * hs, MLP width F. */
#define L_C(b) ((b)->mc.n_embd)
#define L_NKV(b) td_model_kv_heads(&(b)->mc)
#define L_HS(b) td_model_head_size(&(b)->mc)
#define L_QKV(b) td_model_qkv_width(&(b)->mc)
#define L_F(b) td_model_mlp_width(&(b)->mc)
#define L_EPS(b) td_model_norm_eps(&(b)->mc)

/* forward: rms1 -> qkv -> rope(q, k) -> GQA -> o + x -> rms2 -> gate|up -> SwiGLU -> down + res2 */
static td_status l_rms1_fwd(td_block_probe *b)
{
    return td_ops_cuda_rmsnorm_forward(b->a.ln1, b->a.ln1_rstd, b->x, b->w.ln1_w, 0.0f, b->N, L_C(b), L_EPS(b), b->dt,
                                       b->stream);
}
static td_status l_qkv_fwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_forward(b->ops, b->a.qkv, NULL, b->a.ln1, b->w.qkv_w, b->w.qkv_b, NULL, b->N, L_C(b),
                                      L_QKV(b), b->dt, b->stream);
}
static td_status l_rope_fwd(td_block_probe *b)
{
    return td_ops_cuda_rope_forward(b->a.qkv, (const float *)b->consts, NULL, b->B, b->T, b->mc.n_head + L_NKV(b), L_HS(b),
                                    (size_t)L_QKV(b), b->dt, b->stream);
}
static td_status l_att_fwd(td_block_probe *b)
{
    return td_ops_cuda_attention_gqa_forward(b->ops, b->a.atty, b->a.att_lse, b->a.qkv, NULL, b->B, b->T, b->mc.n_head,
                                             L_NKV(b), L_HS(b), b->dt, b->scratch, b->scratch_bytes, b->stream);
}
static td_status l_o_fwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_forward(b->ops, b->a.res2, NULL, b->a.atty, b->w.attproj_w, NULL, b->x, b->N, L_C(b),
                                      L_C(b), b->dt, b->stream);
}
static td_status l_rms2_fwd(td_block_probe *b)
{
    return td_ops_cuda_rmsnorm_forward(b->a.ln2, b->a.ln2_rstd, b->a.res2, b->w.ln2_w, 0.0f, b->N, L_C(b), L_EPS(b), b->dt,
                                       b->stream);
}
static td_status l_gu_fwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_forward(b->ops, b->a.fch, NULL, b->a.ln2, b->w.fc_w, NULL, NULL, b->N, L_C(b),
                                      2 * L_F(b), b->dt, b->stream);
}
static td_status l_swiglu_fwd(td_block_probe *b)
{
    return td_ops_cuda_glu_forward(b->a.fch_gelu, b->a.fch, b->N, L_F(b), TD_OPS_GLU_SILU, b->dt, b->stream);
}
static td_status l_down_fwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_forward(b->ops, b->y, NULL, b->a.fch_gelu, b->w.fcproj_w, NULL, b->a.res2, b->N, L_F(b),
                                      L_C(b), b->dt, b->stream);
}
/* backward, from dy: dres2 = dy + the MLP branch's, dx = dres2 + the attention branch's */
static td_status l_down_bwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_backward(b->ops, b->mid, b->g.fcproj_w, NULL, b->dy, b->a.fch_gelu, b->w.fcproj_w, b->N,
                                       L_F(b), L_C(b), TD_OPS_CUDA_SET, b->dt, b->dt, b->scratch, b->scratch_bytes,
                                       b->stream);
}
static td_status l_swiglu_bwd(td_block_probe *b)
{
    return td_ops_cuda_glu_backward(b->big, b->mid, b->a.fch, b->N, L_F(b), TD_OPS_GLU_SILU, TD_OPS_CUDA_SET, b->dt, b->stream);
}
static td_status l_gu_bwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_backward(b->ops, b->dc, b->g.fc_w, NULL, b->big, b->a.ln2, b->w.fc_w, b->N, L_C(b),
                                       2 * L_F(b), TD_OPS_CUDA_SET, b->dt, b->dt, b->scratch, b->scratch_bytes,
                                       b->stream);
}
static td_status l_rms2_bwd(td_block_probe *b)
{
    return td_ops_cuda_rmsnorm_backward_res(b->dres, b->dy, b->g.ln2_w, b->dc, b->a.res2, b->w.ln2_w, 0.0f, b->a.ln2_rstd,
                                            b->N, L_C(b), b->dt, b->dt, b->scratch, b->scratch_bytes, b->stream);
}
static td_status l_o_bwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_backward(b->ops, b->dc, b->g.attproj_w, NULL, b->dres, b->a.atty, b->w.attproj_w, b->N,
                                       L_C(b), L_C(b), TD_OPS_CUDA_SET, b->dt, b->dt, b->scratch, b->scratch_bytes,
                                       b->stream);
}
static td_status l_att_bwd(td_block_probe *b)
{
    return td_ops_cuda_attention_gqa_backward(b->ops, b->big, b->dc, b->a.qkv, b->a.atty, b->a.att_lse, NULL, b->B, b->T,
                                              b->mc.n_head, L_NKV(b), L_HS(b), TD_OPS_CUDA_SET, b->dt, b->scratch,
                                              b->scratch_bytes, b->stream);
}
static td_status l_rope_bwd(td_block_probe *b)
{
    return td_ops_cuda_rope_backward(b->big, (const float *)b->consts, NULL, b->B, b->T, b->mc.n_head + L_NKV(b), L_HS(b),
                                     (size_t)L_QKV(b), b->dt, b->stream);
}
static td_status l_qkv_bwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_backward(b->ops, b->dc, b->g.qkv_w, b->g.qkv_b, b->big, b->a.ln1, b->w.qkv_w, b->N,
                                       L_C(b), L_QKV(b), TD_OPS_CUDA_SET, b->dt, b->dt, b->scratch, b->scratch_bytes,
                                       b->stream);
}
static td_status l_rms1_bwd(td_block_probe *b)
{
    return td_ops_cuda_rmsnorm_backward_res(b->dx, b->dres, b->g.ln1_w, b->dc, b->x, b->w.ln1_w, 0.0f, b->a.ln1_rstd, b->N,
                                            L_C(b), b->dt, b->dt, b->scratch, b->scratch_bytes, b->stream);
}

static const op_fn l_fwd_ops[] = {l_rms1_fwd, l_qkv_fwd,    l_rope_fwd, l_att_fwd, l_o_fwd,
                                  l_rms2_fwd, l_gu_fwd,     l_swiglu_fwd, l_down_fwd};
static const op_fn l_bwd_ops[] = {l_down_bwd, l_swiglu_bwd, l_gu_bwd,   l_rms2_bwd, l_o_bwd,
                                  l_att_bwd,  l_rope_bwd,   l_qkv_bwd,  l_rms1_bwd};
enum { L_FWD = sizeof l_fwd_ops / sizeof l_fwd_ops[0], L_BWD = sizeof l_bwd_ops / sizeof l_bwd_ops[0] };

/* The largest divisor of NH that is at most NH / 4 (Llama 3's 4 query heads a
 * key/value head where NH allows), at least 1. */
static int default_kv_heads(int NH)
{
    for (int d = NH / 4; d > 1; d--)
        if (NH % d == 0) return d;
    return 1;
}

/* A table of rows whose last two are the block's forward and backward;
 * the first nfwd rows are forward ops.  Each row beside its roofline
 * (bench_cuda.h): its FLOPs or its compulsory bytes over the device's peak. */
static void print_rows(const char *title, const row *rows, int nrows, int nfwd, const td_bench_peak *pk)
{
    printf("%s\n%s: peaks %.1f TFLOP/s, %.0f GB/s (%s)\n\n%-32s %10s %10s %10s %8s %12s %9s\n", title, pk->device,
           pk->tflops, pk->gbytes_s, pk->source, "op", "ms", "TFLOP/s", "GB/s", "share", "roofline ms", "of roof");
    double fsum = 0, bsum = 0, froof = 0, broof = 0;
    for (int i = 0; i < nrows - 2; i++) {
        *(i < nfwd ? &fsum : &bsum) += rows[i].ms;
        *(i < nfwd ? &froof : &broof) += td_bench_roofline_ms(pk, rows[i].flops, rows[i].bytes);
    }
    for (int i = 0; i < nrows; i++) {
        double whole = i < nfwd ? fsum : i < nrows - 2 ? bsum : 0;
        double roof = i == nrows - 2 ? froof : i == nrows - 1 ? broof : td_bench_roofline_ms(pk, rows[i].flops, rows[i].bytes);
        if (i == nrows - 2) printf("\n");
        printf("%-32s %10.3f ", rows[i].name, rows[i].ms);
        if (rows[i].flops > 0) printf("%10.1f ", rows[i].flops / rows[i].ms * 1e-9);
        else printf("%10s ", "-");
        if (rows[i].bytes > 0) printf("%10.1f ", rows[i].bytes / rows[i].ms * 1e-6);
        else printf("%10s ", "-");
        if (whole > 0) printf("%7.1f%% ", 100 * rows[i].ms / whole);
        else printf("%8s ", "-");
        printf("%12.3f %8.1f%%\n", roof, 100 * roof / rows[i].ms);
    }
    printf("\nsum of the ops: forward %.3f ms, backward %.3f ms (the block runs add their own glue); "
           "the sum of their rooflines: %.3f, %.3f ms\n", fsum, bsum, froof, broof);
}

/* The rows as a JSON array of {op, ms, tflops, gbytes_per_s, roofline_ms,
 * of_roofline}; the block rows' roofline is the sum of their ops'. */
static cJSON *rows_json(const row *rows, int nrows, int nfwd, const td_bench_peak *pk)
{
    cJSON *a = cJSON_CreateArray();
    double froof = 0, broof = 0;
    for (int i = 0; i < nrows - 2; i++)
        *(i < nfwd ? &froof : &broof) += td_bench_roofline_ms(pk, rows[i].flops, rows[i].bytes);
    for (int i = 0; i < nrows; i++) {
        cJSON *r = cJSON_CreateObject();
        double roof = i == nrows - 2 ? froof : i == nrows - 1 ? broof : td_bench_roofline_ms(pk, rows[i].flops, rows[i].bytes);
        cJSON_AddStringToObject(r, "op", rows[i].name);
        cJSON_AddNumberToObject(r, "ms", rows[i].ms);
        cJSON_AddNumberToObject(r, "tflops", rows[i].flops > 0 ? rows[i].flops / rows[i].ms * 1e-9 : 0);
        cJSON_AddNumberToObject(r, "gbytes_per_s", rows[i].bytes > 0 ? rows[i].bytes / rows[i].ms * 1e-6 : 0);
        cJSON_AddNumberToObject(r, "roofline_ms", roof);
        cJSON_AddNumberToObject(r, "of_roofline", roof > 0 ? roof / rows[i].ms : 0);
        cJSON_AddItemToArray(a, r);
    }
    return a;
}

/* Times each row's op (fns[i]; the forward ops after a block forward, as
 * they read what the one before wrote), adding the ops' flops to the two
 * block rows at the end. */
static td_status time_rows(td_block_probe *b, row *rows, int nrows, int nfwd, op_fn const *fns, const opts *o)
{
    td_status st;
    if ((st = block_fwd(b))) return st; /* acts for the backward ops */
    for (int i = 0; i < nrows; i++) {
        if (i < nfwd && (st = block_fwd(b))) return st;
        if ((st = time_op(b, fns[i], o->repeat, &rows[i].ms))) return st;
        if (i < nrows - 2) rows[i < nfwd ? nrows - 2 : nrows - 1].flops += rows[i].flops;
        if (!o->json) fprintf(stderr, "\r%d/%d", i + 1, nrows);
    }
    if (!o->json) fprintf(stderr, "\r");
    return TD_OK;
}

/* TFLOP/s of the block rows: forward, backward, both. */
static void block_tflops(const row *rows, int nrows, double tf[3])
{
    const row *f = &rows[nrows - 2], *b = &rows[nrows - 1];
    tf[0] = f->flops / f->ms * 1e-9;
    tf[1] = b->flops / b->ms * 1e-9;
    tf[2] = (f->flops + b->flops) / (f->ms + b->ms) * 1e-9;
}

/* Compulsory bytes of a matmul (N,K) @ (M,K)^T: its forward reads the input
 * and the weight, writes the output (and reads a residual); its backward
 * reads dout twice (two GEMMs), the input and the weight, writes dinp and
 * reads and writes the weight's gradient. */
static double mm_fwd_bytes(double N, double K, double M, double E, int residual)
{
    return (N * K + K * M + N * M * (residual ? 2 : 1)) * E;
}
static double mm_bwd_bytes(double N, double K, double M, double E)
{
    return (2 * N * M + 2 * N * K + 3 * K * M) * E;
}

/* GPT-2's block: its ops timed, into the table or doc. */
static td_status time_gpt2(td_backend *be, const opts *o, td_dtype dt, const td_model_desc *mc, cJSON *doc, double tf[3])
{
    td_block_probe *b = NULL;
    td_status st = td_block_probe_create(be, mc, o->batch, o->seq, dt, 1, &b);
    if (st) return st;
    td_ops_cuda_block_acts_view(&b->mc, b->B, b->T, dt, b->acts, &b->a); /* GPT-2's block keeps these */
    size_t N = (size_t)b->N, C = (size_t)o->width, E = td_dtype_bytes(dt);
    double mm = 2.0 * (double)N * C, att = 2.0 * (double)b->B * b->T * b->T * C; /* causal: half of 4 B T^2 C */
    double nc = (double)N * C * (double)E, n = (double)N, c = (double)C, e = (double)E;
    row rows[] = {
        {"ln1 forward", 0, 0, 2 * nc},
        {"qkv matmul forward", 0, mm * 3 * C, mm_fwd_bytes(n, c, 3 * c, e, 0)},
        {"attention forward", 0, att, 4 * nc},
        {"attproj matmul + residual fwd", 0, mm * C, mm_fwd_bytes(n, c, c, e, 1)},
        {"ln2 forward", 0, 0, 2 * nc},
        {"fc matmul + gelu forward", 0, mm * 4 * C, mm_fwd_bytes(n, c, 4 * c, e, 0) + 4 * nc},
        {"fcproj matmul + residual fwd", 0, mm * 4 * C, mm_fwd_bytes(n, 4 * c, c, e, 1)},
        {"fcproj matmul + gelu backward", 0, 2 * mm * 4 * C, mm_bwd_bytes(n, 4 * c, c, e) + 4 * nc},
        {"fc matmul backward", 0, 2 * mm * 4 * C, mm_bwd_bytes(n, c, 4 * c, e)},
        {"ln2 backward (+ residual)", 0, 0, 4 * nc},
        {"attproj matmul backward", 0, 2 * mm * C, mm_bwd_bytes(n, c, c, e)},
        {"attention backward", 0, 2.5 * att, 10 * nc},
        {"qkv matmul backward", 0, 2 * mm * 3 * C, mm_bwd_bytes(n, c, 3 * c, e)},
        {"ln1 backward (+ residual)", 0, 0, 4 * nc},
        {"block forward", 0, 0, 0},
        {"block backward", 0, 0, 0},
    };
    static op_fn const fns[] = {ln1_fwd, qkv_fwd, att_fwd, attproj_fwd, ln2_fwd, fc_fwd, fcproj_fwd, fcproj_bwd, fc_bwd,
                                ln2_bwd, attproj_bwd, att_bwd, qkv_bwd, ln1_bwd, block_fwd, block_bwd};
    const int nrows = (int)(sizeof rows / sizeof rows[0]);
    if (!(st = time_rows(b, rows, nrows, 7, fns, o))) {
        block_tflops(rows, nrows, tf);
        if (doc) {
            cJSON *shape = cJSON_AddObjectToObject(doc, "shape");
            cJSON_AddNumberToObject(shape, "B", b->B);
            cJSON_AddNumberToObject(shape, "T", b->T);
            cJSON_AddNumberToObject(shape, "C", o->width);
            cJSON_AddNumberToObject(shape, "NH", o->heads);
            cJSON_AddStringToObject(shape, "precision", td_dtype_name(dt));
            cJSON_AddItemToObject(doc, "ops", rows_json(rows, nrows, 7, &o->peak));
        } else {
            char title[160];
            snprintf(title, sizeof title, "GPT-2 block, B %d x T %d, C %d, %d heads, MLP %d, %s; median of %d runs",
                     b->B, b->T, o->width, o->heads, 4 * o->width, td_dtype_name(dt), o->repeat);
            print_rows(title, rows, nrows, 7, &o->peak);
        }
    }
    td_block_probe_destroy(b);
    return st;
}

/* Llama 3.1's block at the same width (RMSNorm, theta 500000 with llama3
 * scaling), timed after GPT-2's buffers are gone; then both blocks'
 * TFLOP/s side by side. */
static td_status time_llama(td_backend *be, const opts *o, td_dtype dt, const td_model_desc *mc, cJSON *doc,
                            const double gpt_tf[3])
{
    const int NKV = o->kv_heads, F = o->mlp, hs = o->width / o->heads, QKV = (o->heads + 2 * NKV) * hs;
    td_model_desc lc; /* Llama 3.1 8B's settings, this width and these heads */
    td_status st = td_model_preset("llama-3.1-8b", &lc);
    if (st) return st;
    lc.n_layer = 1, lc.n_embd = mc->n_embd, lc.n_head = mc->n_head, lc.n_kv_head = NKV, lc.n_inner = F;
    lc.n_positions = mc->n_positions, lc.vocab_size = mc->vocab_size, lc.padded_vocab_size = mc->padded_vocab_size;
    td_block_probe *l = NULL;
    if ((st = td_block_probe_create(be, &lc, o->batch, o->seq, dt, 1, &l))) return st;
    td_ops_cuda_rotary_block_acts_view(&l->mc, l->B, l->T, dt, l->acts, &l->a); /* the rotary decoder's fields */
    const size_t N = (size_t)l->N, C = (size_t)o->width, E = td_dtype_bytes(dt);
    const double att = 2.0 * (double)l->B * l->T * l->T * C;
    const double lmm = 2.0 * (double)N, natt = (double)o->width * E * N, n = (double)N, c = (double)C, e = (double)E;
    row lrows[] = {
        {"rmsnorm 1 forward", 0, 0, 2 * natt},
        {"qkv matmul forward", 0, lmm * C * QKV, mm_fwd_bytes(n, c, QKV, e, 0)},
        {"rope q, k forward", 0, 0, 2.0 * N * (o->heads + NKV) * hs * E},
        {"attention gqa forward", 0, att, n * (QKV + C) * e},
        {"o matmul + residual fwd", 0, lmm * C * C, mm_fwd_bytes(n, c, c, e, 1)},
        {"rmsnorm 2 forward", 0, 0, 2 * natt},
        {"gate|up matmul forward", 0, lmm * C * 2 * F, mm_fwd_bytes(n, c, 2.0 * F, e, 0)},
        {"swiglu forward", 0, 0, 3.0 * N * F * E},
        {"down matmul + residual fwd", 0, lmm * F * C, mm_fwd_bytes(n, F, c, e, 1)},
        {"down matmul backward", 0, 2 * lmm * F * C, mm_bwd_bytes(n, F, c, e)},
        {"swiglu backward", 0, 0, 5.0 * N * F * E},
        {"gate|up matmul backward", 0, 2 * lmm * C * 2 * F, mm_bwd_bytes(n, c, 2.0 * F, e)},
        {"rmsnorm 2 backward (+ residual)", 0, 0, 4 * natt},
        {"o matmul backward", 0, 2 * lmm * C * C, mm_bwd_bytes(n, c, c, e)},
        {"attention gqa backward", 0, 2.5 * att, n * (2.0 * QKV + 2 * C) * e},
        {"rope q, k backward", 0, 0, 2.0 * N * (o->heads + NKV) * hs * E},
        {"qkv matmul backward", 0, 2 * lmm * C * QKV, mm_bwd_bytes(n, c, QKV, e)},
        {"rmsnorm 1 backward (+ residual)", 0, 0, 4 * natt},
        {"block forward", 0, 0, 0},
        {"block backward", 0, 0, 0},
    };
    const int nl = (int)(sizeof lrows / sizeof lrows[0]);
    op_fn fns[L_FWD + L_BWD + 2];
    for (int i = 0; i < L_FWD; i++) fns[i] = l_fwd_ops[i];
    for (int i = 0; i < L_BWD; i++) fns[L_FWD + i] = l_bwd_ops[i];
    fns[nl - 2] = block_fwd;
    fns[nl - 1] = block_bwd;
    double tf[3];
    if (!(st = time_rows(l, lrows, nl, L_FWD, fns, o))) {
        block_tflops(lrows, nl, tf);
        if (doc) {
            cJSON *ll = cJSON_AddObjectToObject(doc, "llama"), *shape = cJSON_AddObjectToObject(ll, "shape");
            cJSON_AddNumberToObject(shape, "B", l->B);
            cJSON_AddNumberToObject(shape, "T", l->T);
            cJSON_AddNumberToObject(shape, "C", o->width);
            cJSON_AddNumberToObject(shape, "NH", o->heads);
            cJSON_AddNumberToObject(shape, "NKV", NKV);
            cJSON_AddNumberToObject(shape, "F", F);
            cJSON_AddItemToObject(ll, "ops", rows_json(lrows, nl, L_FWD, &o->peak));
            cJSON *per = cJSON_AddObjectToObject(doc, "tflops_per_block"), *g = cJSON_AddObjectToObject(per, "gpt2"),
                  *lt = cJSON_AddObjectToObject(per, "llama");
            static const char *const names[3] = {"forward", "backward", "both"};
            for (int k = 0; k < 3; k++) {
                cJSON_AddNumberToObject(g, names[k], gpt_tf[k]);
                cJSON_AddNumberToObject(lt, names[k], tf[k]);
            }
        } else {
            char title[200];
            snprintf(title, sizeof title,
                     "\nLLaMA block, B %d x T %d, C %d, %d query heads, %d key/value heads, MLP %d (SwiGLU), %s",
                     l->B, l->T, o->width, o->heads, NKV, F, td_dtype_name(dt));
            print_rows(title, lrows, nl, L_FWD, &o->peak);
            printf("\nTFLOP/s per block: GPT-2 forward %.1f, backward %.1f, both %.1f; LLaMA forward %.1f, "
                   "backward %.1f, both %.1f\n(LLaMA / GPT-2: %.2fx forward, %.2fx backward, %.2fx both)\n",
                   gpt_tf[0], gpt_tf[1], gpt_tf[2], tf[0], tf[1], tf[2], tf[0] / gpt_tf[0], tf[1] / gpt_tf[1],
                   tf[2] / gpt_tf[2]);
        }
    }
    td_block_probe_destroy(l);
    return st;
}

/* The options' checks and the LLaMA block's defaults. */
static td_status check_opts(opts *o, td_dtype *dt)
{
    td_status st = td_dtype_parse(o->precision, dt);
    if (st) return st;
    if (o->repeat < 1 || o->batch < 1 || o->seq < 1 || o->heads < 1 || o->width % o->heads)
        return td_error_set(TD_ERR_INVALID, "--repeat, --micro-batch, --seq must be positive and --heads divide --width");
    if (!o->kv_heads) o->kv_heads = default_kv_heads(o->heads);
    if (!o->mlp) o->mlp = (8 * o->width / 3 + 255) / 256 * 256;
    if (o->kv_heads < 1 || o->heads % o->kv_heads || o->mlp < 1 || (o->width / o->heads) % 2)
        return td_error_set(TD_ERR_INVALID, "--kv-heads %d must divide --heads %d, --mlp %d be positive and the head "
                            "size %d even", o->kv_heads, o->heads, o->mlp, o->width / o->heads);
    return TD_OK;
}

int td_bench_ops_main(int argc, char **argv)
{
    opts o = { .width = 1600, .heads = 25, .seq = 1024, .batch = 32, .repeat = 10, .precision = "bf16" };
    td_opt table[] = {
        {"width", TD_OPT_INT, &o.width, "C", "embedding width (default 1600, GPT-2 1.5B)", 0},
        {"heads", TD_OPT_INT, &o.heads, "H", "attention heads (default 25)", 0},
        {"kv-heads", TD_OPT_INT, &o.kv_heads, "K",
         "key/value heads of the LLaMA block (default: the largest divisor of --heads that is at most a quarter of it)",
         0},
        {"mlp", TD_OPT_INT, &o.mlp, "F",
         "MLP width of the LLaMA block (default 8C/3 rounded up to a multiple of 256, LLaMA's rule)", 0},
        {"seq", TD_OPT_INT, &o.seq, "T", "sequence length (default 1024)", 0},
        {"micro-batch", TD_OPT_INT, &o.batch, "B", "sequences (default 32)", 0},
        {"precision", TD_OPT_STRING, &o.precision, "P", "bf16 (default), fp16 or fp32", 0},
        {"repeat", TD_OPT_INT, &o.repeat, "N", "timed runs per op, median reported (default 10)", 0},
        {"peak-tflops", TD_OPT_DOUBLE, &o.peak_tflops, "X", "the device's dense tensor TFLOP/s of --precision (default: its data\n"
         "sheet's, for H100, H200, GH200 and A100 parts)", 0},
        {"peak-gbs", TD_OPT_DOUBLE, &o.peak_gbs, "X", "its memory GB/s (default: its data sheet's)", 0},
        {"json", TD_OPT_FLAG, &o.json, NULL, "one JSON object instead of the table", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = td_args_main(table, argc, argv, "bench ops",
                          "usage: tidal bench ops [options]\n\nTimes each CUDA op of one transformer block "
                          "(and the whole block, forward and backward)\nat a training shape: ms, TFLOP/s, GB/s.  Two "
                          "blocks of the same width: GPT-2's\n(LayerNorm, multi-head attention, GELU MLP of 4C) and a "
                          "LLaMA-family one\n(RMSNorm, grouped-query attention with RoPE, SwiGLU MLP of --mlp); the "
                          "last\nline compares their TFLOP/s per block.  Each op beside its roofline: its FLOPs or\n"
                          "its compulsory bytes over the device's peak (the larger).");
    if (rc >= 0) return rc;
    td_dtype dt;
    td_status st = check_opts(&o, &dt);
    if (st) {
        fprintf(stderr, "tidal bench ops: %s\n", td_error_msg());
        td_args_free();
        return 2;
    }
    td_backend *be = NULL;
    td_model_desc mc = { .n_layer = 1, .n_head = o.heads, .n_embd = o.width, .n_positions = o.seq,
                         .vocab_size = 64, .padded_vocab_size = 64 };
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CUDA;
    cJSON *doc = o.json ? cJSON_CreateObject() : NULL;
    double gpt_tf[3];
    if (!(st = td_backend_create(&bp, &be)) && !(st = td_bench_peak_get(dt, o.peak_tflops, o.peak_gbs, &o.peak)) &&
        !(st = time_gpt2(be, &o, dt, &mc, doc, gpt_tf)) &&
        !(st = time_llama(be, &o, dt, &mc, doc, gpt_tf)) && doc) {
        cJSON_AddItemToObject(doc, "device", td_bench_peak_json(&o.peak));
        st = td_cli_print_json(doc);
        doc = NULL;
    }
    if (st) fprintf(stderr, "tidal bench ops: %s\n", td_error_msg());
    cJSON_Delete(doc);
    td_backend_free(be);
    td_args_free();
    return st ? 1 : 0;
}
