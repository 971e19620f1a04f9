/* `tidal bench ops`: the time of each CUDA op of one transformer block at a
 * training shape, and of the whole block forward and backward, so that a
 * step's compute can be split by op (what the trainer runs: the same ops,
 * the same shapes, buffers from the arena).
 *
 * Each figure is the median of --repeat timed runs after two warm-up runs,
 * timed with CUDA events on one stream.  Matmuls and attention also give
 * TFLOP/s (2 flops per multiply-add; causal attention counts half the T x T
 * products); memory-bound ops give GB/s of their compulsory reads + writes.
 * The buffers are tidal/block_probe.h's (the same `tidal plan` times the
 * whole block on), random as in training. */
#include "../cli/cli.h"
#include "../cli/args.h"
#include "tidal/block_probe.h"
#include "tidal/backend.h"
#include "tidal/ops_cuda.h"
#include "tidal/util.h"

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct opts {
    int width, heads, seq, batch, repeat, json;
    const char *precision;
} opts;

typedef struct row { const char *name; double ms, flops, bytes; } row;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One op on the probe's buffers. */
typedef td_status (*op_fn)(td_block_probe *b);

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
    return td_ops_cuda_matmul_backward(b->ops, b->big, b->g.fcproj_w, b->g.fcproj_b, b->dy, b->a.fch_gelu,
                                       b->w.fcproj_w, b->N, 4 * b->mc.n_embd, b->mc.n_embd, TD_OPS_CUDA_SET, b->dt, b->dt,
                                       b->scratch, b->scratch_bytes, b->stream);
}
static td_status gelu_bwd(td_block_probe *b)
{
    return td_ops_cuda_gelu_backward(b->big, b->a.fch, b->big, (size_t)b->N * 4 * b->mc.n_embd, TD_OPS_CUDA_SET, b->dt, b->stream);
}
static td_status fc_bwd(td_block_probe *b)
{
    return td_ops_cuda_matmul_backward(b->ops, b->dx, b->g.fc_w, b->g.fc_b, b->big, b->a.ln2, b->w.fc_w, b->N, b->mc.n_embd,
                                       4 * b->mc.n_embd, TD_OPS_CUDA_SET, b->dt, b->dt, b->scratch, b->scratch_bytes, b->stream);
}
static td_status ln2_bwd(td_block_probe *b)
{
    return td_ops_cuda_layernorm_backward(b->dx, b->g.ln2_w, b->g.ln2_b, b->dy, b->a.res2, b->w.ln2_w, b->a.ln2_mean,
                                          b->a.ln2_rstd, b->N, b->mc.n_embd, b->dt, b->dt, b->scratch, b->scratch_bytes,
                                          b->stream);
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
    return td_ops_cuda_layernorm_backward(b->dx, b->g.ln1_w, b->g.ln1_b, b->dy, b->x, b->w.ln1_w, b->a.ln1_mean,
                                          b->a.ln1_rstd, b->N, b->mc.n_embd, b->dt, b->dt, b->scratch, b->scratch_bytes, b->stream);
}
static td_status block_fwd(td_block_probe *b) { return td_block_probe_forward(b); }
static td_status block_bwd(td_block_probe *b) { return td_block_probe_backward(b); }

int td_bench_ops_main(int argc, char **argv)
{
    opts o = { .width = 1600, .heads = 25, .seq = 1024, .batch = 32, .repeat = 10, .precision = "bf16" };
    td_opt table[] = {
        {"width", TD_OPT_INT, &o.width, "C", "embedding width (default 1600, GPT-2 1.5B)", 0},
        {"heads", TD_OPT_INT, &o.heads, "H", "attention heads (default 25)", 0},
        {"seq", TD_OPT_INT, &o.seq, "T", "sequence length (default 1024)", 0},
        {"micro-batch", TD_OPT_INT, &o.batch, "B", "sequences (default 32)", 0},
        {"precision", TD_OPT_STRING, &o.precision, "P", "bf16 (default), fp16 or fp32", 0},
        {"repeat", TD_OPT_INT, &o.repeat, "N", "timed runs per op, median reported (default 10)", 0},
        {"json", TD_OPT_FLAG, &o.json, NULL, "one JSON object instead of the table", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = td_args_main(table, argc, argv, "bench ops",
                          "usage: tidal bench ops [options]\n\nTimes each CUDA op of one transformer block "
                          "(and the whole block, forward and backward)\nat a training shape: ms, TFLOP/s, GB/s.");
    if (rc >= 0) return rc;
    rc = 1;
    td_status st = TD_OK;
    td_backend *be = NULL;
    td_block_probe *pr = NULL;
    td_dtype dt;
    if ((st = td_dtype_parse(o.precision, &dt))) goto done;
    if (o.repeat < 1 || o.batch < 1 || o.seq < 1 || o.heads < 1 || o.width % o.heads) {
        st = td_error_set(TD_ERR_INVALID, "--repeat, --micro-batch, --seq must be positive and --heads divide --width");
        goto done;
    }
    td_gpt_ref_config mc = { .n_layer = 1, .n_head = o.heads, .n_embd = o.width, .n_positions = o.seq,
                             .vocab_size = 64, .padded_vocab_size = 64 };
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CUDA;
    if ((st = td_backend_create(&bp, &be))) goto done;
    if ((st = td_block_probe_create(be, &mc, o.batch, o.seq, dt, &pr))) goto done;
    td_block_probe *b = pr;
    if ((st = block_fwd(b))) goto done; /* acts for the backward ops */
    size_t N = (size_t)b->N, C = (size_t)o.width, E = td_dtype_bytes(dt);

    double mm = 2.0 * (double)N * C, att = 2.0 * (double)b->B * b->T * b->T * C; /* causal: half of 4 B T^2 C */
    double nc = (double)N * C * (double)E;
    row rows[] = {
        {"ln1 forward", 0, 0, 2 * nc},
        {"qkv matmul forward", 0, mm * 3 * C, 0},
        {"attention forward", 0, att, 0},
        {"attproj matmul + residual fwd", 0, mm * C, 0},
        {"ln2 forward", 0, 0, 2 * nc},
        {"fc matmul + gelu forward", 0, mm * 4 * C, 0},
        {"fcproj matmul + residual fwd", 0, mm * 4 * C, 0},
        {"fcproj matmul backward", 0, 2 * mm * 4 * C, 0},
        {"gelu backward", 0, 0, 3 * 4 * nc},
        {"fc matmul backward", 0, 2 * mm * 4 * C, 0},
        {"ln2 backward", 0, 0, 3 * nc},
        {"attproj matmul backward", 0, 2 * mm * C, 0},
        {"attention backward", 0, 2.5 * att, 0},
        {"qkv matmul backward", 0, 2 * mm * 3 * C, 0},
        {"ln1 backward", 0, 0, 3 * nc},
        {"block forward", 0, 0, 0},
        {"block backward", 0, 0, 0},
    };
    op_fn fns[] = {ln1_fwd, qkv_fwd, att_fwd, attproj_fwd, ln2_fwd, fc_fwd, fcproj_fwd, fcproj_bwd, gelu_bwd,
                   fc_bwd, ln2_bwd, attproj_bwd, att_bwd, qkv_bwd, ln1_bwd, block_fwd, block_bwd};
    int nrows = (int)(sizeof rows / sizeof rows[0]);
    for (int i = 0; i < nrows; i++) {
        if (i < 7 && (st = block_fwd(b))) goto done; /* forward ops read what the previous one wrote */
        if ((st = time_op(b, fns[i], o.repeat, &rows[i].ms))) goto done;
        if (i < nrows - 2) {
            double *f = i < 7 ? &rows[nrows - 2].flops : &rows[nrows - 1].flops;
            *f += rows[i].flops;
        }
        if (!o.json) fprintf(stderr, "\r%d/%d", i + 1, nrows);
    }
    if (o.json) {
        printf("{\"shape\":{\"B\":%d,\"T\":%d,\"C\":%d,\"NH\":%d,\"precision\":\"%s\"},\"ops\":[", b->B, b->T, o.width, o.heads,
               td_dtype_name(dt));
        for (int i = 0; i < nrows; i++)
            printf("%s{\"op\":\"%s\",\"ms\":%.4f,\"tflops\":%.1f,\"gbytes_per_s\":%.1f}", i ? "," : "", rows[i].name,
                   rows[i].ms, rows[i].flops > 0 ? rows[i].flops / rows[i].ms * 1e-9 : 0,
                   rows[i].bytes > 0 ? rows[i].bytes / rows[i].ms * 1e-6 : 0);
        printf("]}\n");
    } else {
        fprintf(stderr, "\r");
        printf("one block, B %d x T %d, C %d, %d heads, %s; median of %d runs\n\n", b->B, b->T, o.width, o.heads,
               td_dtype_name(dt), o.repeat);
        printf("%-32s %10s %10s %10s %8s\n", "op", "ms", "TFLOP/s", "GB/s", "share");
        double fsum = 0, bsum = 0;
        for (int i = 0; i < nrows - 2; i++) *(i < 7 ? &fsum : &bsum) += rows[i].ms;
        for (int i = 0; i < nrows; i++) {
            double whole = i < 7 ? fsum : i < nrows - 2 ? bsum : 0;
            if (i == nrows - 2) printf("\n");
            printf("%-32s %10.3f ", rows[i].name, rows[i].ms);
            if (rows[i].flops > 0) printf("%10.1f ", rows[i].flops / rows[i].ms * 1e-9);
            else printf("%10s ", "-");
            if (rows[i].bytes > 0) printf("%10.1f ", rows[i].bytes / rows[i].ms * 1e-6);
            else printf("%10s ", "-");
            if (whole > 0) printf("%7.1f%%\n", 100 * rows[i].ms / whole);
            else printf("%8s\n", "-");
        }
        printf("\nsum of the ops: forward %.3f ms, backward %.3f ms (the block runs add their own glue)\n", fsum,
               bsum);
    }
    rc = 0;
done:
    if (st) fprintf(stderr, "tidal bench ops: %s\n", td_error_msg());
    td_block_probe_destroy(pr);
    td_backend_free(be);
    td_args_free();
    return rc;
}
