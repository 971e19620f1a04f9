/* `tidal bench attention` and `tidal bench head`: two kernels timed alone
 * at the shapes their peers are measured at, each beside its roofline
 * (bench_cuda.h).
 *
 * attention: causal flash attention forward and backward (grouped-query
 * when --kv-heads < --heads) at B = --tokens / T sequences, the shapes of
 * bench/peers/sdpa_attention.py (PyTorch's SDPA flash).  FLOPs: the forward
 * does 2 products of B NH T^2 hs multiply-adds, halved by the causal mask
 * (2 B NH T^2 hs flops); the backward 2.5 times that (5 products), the
 * convention of FlashAttention's benchmarks.
 *
 * head: the model's final norm, the output matrix, the cross-entropy and
 * their backward over B T rows, as the trainer runs them: in chunks of rows
 * (td_train_loss_rows: --loss-chunk, or auto), and in one chunk of all rows,
 * with the logits each holds.  FLOPs: 6 N C Vp (the forward product and the
 * two of the backward).
 *
 * Buffers come from one arena of exactly their size, random as in training;
 * each figure is the median of --repeat runs after two warm-ups. */
#include "../cli/cli.h"
#include "../cli/args.h"
#include "bench_cuda.h"
#include "tidal/arena.h"
#include "tidal/backend.h"
#include "tidal/convert.h"
#include "tidal/family.h"
#include "tidal/model.h"
#include "tidal/ops_cuda.h"
#include "tidal/trainer.h"
#include "tidal/util.h"

#include <cjson/cJSON.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --- buffers ------------------------------------------------------------------- */

#define MAX_BUFS 24
typedef struct bufs {
    td_arena *arena;
    size_t bytes[MAX_BUFS];
    void **ptr[MAX_BUFS];
    int n;
} bufs;

static void want(bufs *b, void **p, size_t bytes)
{
    b->ptr[b->n] = p;
    b->bytes[b->n++] = bytes;
}

/* One arena holding every buffer asked for. */
static td_status take_all(bufs *b, td_backend *be)
{
    size_t total = 0;
    for (int i = 0; i < b->n; i++) total += td_align_up(b->bytes[i] ? b->bytes[i] : 1, TD_ARENA_ALIGN);
    td_status st = td_arena_create(be, total, &b->arena);
    for (int i = 0; i < b->n && !st; i++) st = td_arena_alloc(b->arena, b->bytes[i] ? b->bytes[i] : 1, TD_ROLE_WORKSPACE, b->ptr[i]);
    return st;
}

/* n values uniform in [lo, hi) of type dt into dev. */
static td_status fill(void *dev, size_t n, td_dtype dt, float lo, float hi, uint64_t seed)
{
    size_t E = td_dtype_bytes(dt);
    char *h = malloc(n * E);
    if (!h) return td_error_set(TD_ERR_NOMEM, "bench: out of host memory for %zu values", n);
    td_rng r;
    td_rng_seed(&r, seed);
    for (size_t i = 0; i < n; i++) {
        float v = lo + (float)td_rng_uniform(&r) * (hi - lo);
        if (dt == TD_DTYPE_F32) ((float *)h)[i] = v;
        else ((uint16_t *)h)[i] = dt == TD_DTYPE_BF16 ? td_bf16_from_f32(v) : td_f16_from_f32(v);
    }
    cudaError_t e = cudaMemcpy(dev, h, n * E, cudaMemcpyHostToDevice);
    free(h);
    return e == cudaSuccess ? TD_OK : td_error_set(TD_ERR_BACKEND, "bench: upload: %s", cudaGetErrorString(e));
}

/* An ops context on the current device with cuBLASLt's workspace. */
static td_status ops_create(void *workspace, td_ops_cuda **ops)
{
    td_ops_cuda_params p = td_ops_cuda_default_params();
    p.workspace = workspace;
    p.workspace_bytes = TD_OPS_CUDA_WORKSPACE_BYTES;
    return td_ops_cuda_create(&p, ops);
}

static void row_json(cJSON *a, const char *name, double ms, double flops, double bytes, const td_bench_peak *pk)
{
    cJSON *r = cJSON_CreateObject();
    double roof = td_bench_roofline_ms(pk, flops, bytes);
    cJSON_AddStringToObject(r, "op", name);
    cJSON_AddNumberToObject(r, "ms", ms);
    cJSON_AddNumberToObject(r, "tflops", flops > 0 ? flops / ms * 1e-9 : 0);
    cJSON_AddNumberToObject(r, "gbytes_per_s", bytes > 0 ? bytes / ms * 1e-6 : 0);
    cJSON_AddNumberToObject(r, "roofline_ms", roof);
    cJSON_AddNumberToObject(r, "of_roofline", roof > 0 ? roof / ms : 0);
    cJSON_AddItemToArray(a, r);
}

static void row_text(const char *name, double ms, double flops, double bytes, const td_bench_peak *pk)
{
    double roof = td_bench_roofline_ms(pk, flops, bytes);
    printf("%-36s %10.3f %10.1f %10.1f %12.3f %9.1f%%\n", name, ms, flops > 0 ? flops / ms * 1e-9 : 0,
           bytes > 0 ? bytes / ms * 1e-6 : 0, roof, roof > 0 ? 100 * roof / ms : 0);
}

static void header_text(const char *title, const td_bench_peak *pk)
{
    printf("%s\n%s: peaks %.1f TFLOP/s, %.0f GB/s (%s)\n\n%-36s %10s %10s %10s %12s %10s\n", title, pk->device, pk->tflops,
           pk->gbytes_s, pk->source, "op", "ms", "TFLOP/s", "GB/s", "roofline ms", "of roof");
}

/* --- attention ---------------------------------------------------------------- */

typedef struct att_run {
    td_ops_cuda *ops;
    void *qkv, *out, *dout, *dqkv, *scratch;
    float *lse;
    size_t scratch_bytes;
    int B, T, NH, NKV, hs;
    td_dtype dt;
    void *stream;
} att_run;

static td_status att_fwd(void *c)
{
    att_run *a = c;
    return td_ops_cuda_attention_gqa_forward(a->ops, a->out, a->lse, a->qkv, NULL, a->B, a->T, a->NH, a->NKV, a->hs, a->dt,
                                             a->scratch, a->scratch_bytes, a->stream);
}
static td_status att_bwd(void *c)
{
    att_run *a = c;
    return td_ops_cuda_attention_gqa_backward(a->ops, a->dqkv, a->dout, a->qkv, a->out, a->lse, NULL, a->B, a->T, a->NH,
                                              a->NKV, a->hs, TD_OPS_CUDA_SET, a->dt, a->scratch, a->scratch_bytes,
                                              a->stream);
}
static td_status att_both(void *c)
{
    td_status st = att_fwd(c);
    return st ? st : att_bwd(c);
}

/* The command's options. */
typedef struct att_opts {
    int T, hs, NH, NKV, tokens, repeat, json;
    double peak_tf, peak_gbs;
    const char *precision;
    td_dtype dt;
} att_opts;

/* The options' checks and defaults; TD_OK or the usage error. */
static td_status att_check(att_opts *o)
{
    td_status st = td_dtype_parse(o->precision, &o->dt);
    if (!st && o->dt == TD_DTYPE_F32) st = td_error_set(TD_ERR_INVALID, "--precision fp32: the flash kernels are 16-bit");
    if (!o->NH && o->hs > 0) o->NH = 2048 / o->hs > 0 ? 2048 / o->hs : 1;
    if (!o->NKV) o->NKV = o->NH;
    if (!st && (o->T < 1 || o->hs < 2 || o->hs % 2 || o->NH < 1 || o->NKV < 1 || o->NH % o->NKV || o->tokens < 1 ||
                o->repeat < 1))
        st = td_error_set(TD_ERR_INVALID, "--seq, --head-dim (even), --heads, --kv-heads (dividing --heads), --tokens "
                          "and --repeat must be positive");
    return st;
}

/* The buffers of one run in one arena (ws: cuBLASLt's workspace), random
 * inputs, the ops context. */
static td_status att_setup(att_run *a, td_backend *be, bufs *b, void **ws)
{
    const int QKV = (a->NH + 2 * a->NKV) * a->hs;
    const size_t E = td_dtype_bytes(a->dt), N = (size_t)a->B * a->T;
    a->stream = td_backend_native_queue(be, TD_QUEUE_COMPUTE);
    a->scratch_bytes = td_ops_cuda_attention_gqa_scratch_bytes(a->B, a->T, a->NH, a->NKV, a->hs, a->dt);
    want(b, ws, TD_OPS_CUDA_WORKSPACE_BYTES);
    want(b, &a->qkv, N * QKV * E);
    want(b, &a->dqkv, N * QKV * E);
    want(b, &a->out, N * a->NH * a->hs * E);
    want(b, &a->dout, N * a->NH * a->hs * E);
    want(b, (void **)&a->lse, (size_t)a->B * a->NH * a->T * sizeof(float));
    want(b, &a->scratch, a->scratch_bytes);
    td_status st = take_all(b, be);
    if (!st) st = ops_create(*ws, &a->ops);
    if (!st) st = fill(a->qkv, N * QKV, a->dt, -1.0f, 1.0f, 1);
    if (!st) st = fill(a->dout, N * a->NH * a->hs, a->dt, -1.0f, 1.0f, 2);
    return st;
}

/* The three timings (forward, backward, both) as the table or JSON. */
static td_status att_report(const att_opts *o, const att_run *a, const td_bench_peak *pk, const double ms[3])
{
    static const char *const names[3] = {"attention forward", "attention backward", "attention forward + backward"};
    const int B = a->B, T = a->T, NH = a->NH, hs = a->hs, QKV = (NH + 2 * a->NKV) * hs;
    const size_t E = td_dtype_bytes(a->dt), N = (size_t)B * T;
    const double f = 2.0 * B * NH * (double)T * T * hs; /* causal: half of 2 products of 2 B NH T^2 hs */
    /* compulsory bytes: forward reads q, k, v and writes out, lse; backward also reads out, dout, lse, writes dqkv */
    const double io_f = (double)N * (QKV + NH * hs) * E, io_b = (double)N * (2 * QKV + 2 * NH * hs) * E;
    const double flops[3] = {f, 2.5 * f, 3.5 * f}, io[3] = {io_f, io_b, io_f + io_b};
    if (!o->json) {
        char title[200];
        snprintf(title, sizeof title, "causal attention, B %d x T %d, %d query heads, %d key/value heads of %d, %s; "
                 "median of %d runs", B, T, NH, a->NKV, hs, td_dtype_name(a->dt), o->repeat);
        header_text(title, pk);
        for (int i = 0; i < 3; i++) row_text(names[i], ms[i], flops[i], io[i], pk);
        return TD_OK;
    }
    cJSON *doc = cJSON_CreateObject();
    cJSON_AddItemToObject(doc, "device", td_bench_peak_json(pk));
    cJSON *sh = cJSON_AddObjectToObject(doc, "shape");
    cJSON_AddNumberToObject(sh, "B", B);
    cJSON_AddNumberToObject(sh, "T", T);
    cJSON_AddNumberToObject(sh, "NH", NH);
    cJSON_AddNumberToObject(sh, "NKV", a->NKV);
    cJSON_AddNumberToObject(sh, "hs", hs);
    cJSON_AddStringToObject(sh, "precision", td_dtype_name(a->dt));
    cJSON_AddBoolToObject(sh, "causal", 1);
    cJSON *ops = cJSON_AddArrayToObject(doc, "ops");
    for (int i = 0; i < 3; i++) row_json(ops, names[i], ms[i], flops[i], io[i], pk);
    return td_cli_print_json(doc);
}

int td_bench_attention_main(int argc, char **argv)
{
    att_opts o = {.T = 4096, .hs = 128, .tokens = 16384, .repeat = 10, .precision = "bf16"};
    td_opt table[] = {
        {"seq", TD_OPT_INT, &o.T, "T", "sequence length (default 4096)", 0},
        {"head-dim", TD_OPT_INT, &o.hs, "D", "head size (default 128; the flash kernels take 64, 80, 96 and 128)", 0},
        {"heads", TD_OPT_INT, &o.NH, "H", "query heads (default 2048 / head-dim: a width of 2048)", 0},
        {"kv-heads", TD_OPT_INT, &o.NKV, "K", "key/value heads (default --heads: multi-head)", 0},
        {"tokens", TD_OPT_INT, &o.tokens, "N", "tokens in all: B = N / T sequences, at least 1 (default 16384)", 0},
        {"precision", TD_OPT_STRING, &o.precision, "P", "bf16 (default) or fp16", 0},
        {"repeat", TD_OPT_INT, &o.repeat, "N", "timed runs, median reported (default 10)", 0},
        {"peak-tflops", TD_OPT_DOUBLE, &o.peak_tf, "X", "the device's dense tensor TFLOP/s (default: its data sheet's)", 0},
        {"peak-gbs", TD_OPT_DOUBLE, &o.peak_gbs, "X", "its memory GB/s (default: its data sheet's)", 0},
        {"json", TD_OPT_FLAG, &o.json, NULL, "one JSON object instead of the table", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = td_args_main(table, argc, argv, "bench attention",
                          "usage: tidal bench attention [options]\n\nTimes causal flash attention forward and backward "
                          "(grouped-query with --kv-heads)\nat B = tokens / T sequences of T, beside its roofline; "
                          "bench/peers/sdpa_attention.py\ntimes PyTorch's SDPA flash at the same shapes "
                          "(bench/kernels.py runs both).");
    if (rc >= 0) return rc;
    td_status st = att_check(&o);
    if (st) {
        fprintf(stderr, "tidal bench attention: %s\n", td_error_msg());
        td_args_free();
        return 2;
    }
    td_backend *be = NULL;
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CUDA;
    bufs b = {0};
    att_run a = {.B = o.tokens / o.T > 0 ? o.tokens / o.T : 1, .T = o.T, .NH = o.NH, .NKV = o.NKV, .hs = o.hs,
                 .dt = o.dt};
    void *ws = NULL;
    td_bench_peak pk;
    double ms[3] = {0, 0, 0};
    if ((st = td_backend_create(&bp, &be)) || (st = td_bench_peak_get(o.dt, o.peak_tf, o.peak_gbs, &pk)) ||
        (st = att_setup(&a, be, &b, &ws)))
        goto done;
    if ((st = td_bench_time(att_fwd, &a, a.ops, a.stream, o.repeat, &ms[0])) ||
        (st = td_bench_time(att_bwd, &a, a.ops, a.stream, o.repeat, &ms[1])) ||
        (st = td_bench_time(att_both, &a, a.ops, a.stream, o.repeat, &ms[2])))
        goto done;
    st = att_report(&o, &a, &pk, ms);
done:
    if (st) fprintf(stderr, "tidal bench attention: %s\n", td_error_msg());
    td_ops_cuda_free(a.ops);
    td_arena_destroy(b.arena);
    td_backend_free(be);
    td_args_free();
    return st ? 1 : 0;
}

/* --- the head and the loss ------------------------------------------------------- */

typedef struct head_run {
    const td_model_exec *ex;
    td_model_run run;
    void *p[3], *g[3];
    void *x, *dx, *logits, *lnf;
    float *mean, *rstd, *losses, *lse;
    int *targets;
    int N, rows, C, V, Vp;
    float dloss;
} head_run;

/* The trainer's loop (trainer/train.c, op_head): per chunk the family's head
 * forward, the fused cross-entropy, the head backward into dx's rows. */
static td_status head_loss(void *c)
{
    head_run *h = c;
    const size_t E = td_dtype_bytes(h->run.dt), C = (size_t)h->C;
    for (int r0 = 0; r0 < h->N; r0 += h->rows) {
        int n = h->N - r0 < h->rows ? h->N - r0 : h->rows;
        td_model_run run = h->run;
        run.B = 1;
        run.T = n;
        td_model_head_acts a = {h->lnf, h->mean, h->rstd};
        const char *xr = (const char *)h->x + (size_t)r0 * C * E;
        td_status st = h->ex->head_forward(&run, h->p, xr, h->logits, &a);
        if (!st) st = td_ops_cuda_crossentropy_fused(h->losses + r0, h->lse + r0, h->logits, h->targets + r0, h->dloss,
                                                     n, h->V, h->Vp, run.dt, run.stream);
        if (!st) st = h->ex->head_backward(&run, h->p, h->g, xr, h->logits, &a, (char *)h->dx + (size_t)r0 * C * E);
        if (st) return st;
    }
    return TD_OK;
}

/* The command's options. */
typedef struct head_opts {
    int B, T, chunk, repeat, json;
    double peak_tf, peak_gbs;
    const char *model, *precision;
} head_opts;

/* The run's configuration from the options; TD_OK or the usage error. */
static td_status head_config(const head_opts *o, td_train_config *cfg)
{
    *cfg = td_train_default_config();
    td_status st = td_dtype_parse(o->precision, &cfg->precision);
    if (!st) st = td_model_preset(o->model, &cfg->model);
    if (!st && (o->B < 1 || o->T < 1 || o->chunk < 0 || o->repeat < 1))
        st = td_error_set(TD_ERR_INVALID, "--micro-batch, --seq and --repeat must be positive, --loss-chunk at least 0");
    cfg->micro_batch = o->B;
    cfg->seq_len = o->T;
    cfg->loss_chunk = o->chunk;
    return st;
}

/* Every buffer of one chunk of all N = B T rows (the chunked runs use a
 * part) in one arena (ws: cuBLASLt's workspace); the scratch as the trainer
 * sizes it, the family's (td_model_exec.scratch_bytes: its head's among its
 * calls'). */
static td_status head_buffers(head_run *h, td_backend *be, bufs *b, void **ws, const int *hi, int nh, int B, int T)
{
    const td_model_desc *mc = h->run.desc;
    const size_t E = td_dtype_bytes(h->run.dt), N = (size_t)h->N, C = (size_t)h->C;
    h->run.scratch_bytes = h->ex->scratch_bytes(mc, B, T, h->run.dt, 1);
    want(b, ws, TD_OPS_CUDA_WORKSPACE_BYTES);
    for (int k = 0; k < nh; k++) {
        td_model_tensor t;
        td_model_tensor_get(mc, hi[k], &t);
        want(b, &h->p[k], t.numel * E);
        want(b, &h->g[k], t.numel * E);
    }
    want(b, &h->x, N * C * E);
    want(b, &h->dx, N * C * E);
    want(b, &h->lnf, N * C * E);
    want(b, &h->logits, N * (size_t)h->Vp * E);
    want(b, (void **)&h->mean, N * sizeof(float));
    want(b, (void **)&h->rstd, N * sizeof(float));
    want(b, (void **)&h->losses, N * sizeof(float));
    want(b, (void **)&h->lse, N * sizeof(float));
    want(b, (void **)&h->targets, N * sizeof(int));
    want(b, &h->run.scratch, h->run.scratch_bytes);
    return take_all(b, be);
}

/* Inputs as in training: the norm's gain near 1 (first), a LayerNorm's
 * bias near 0, the output matrix at init scale, zero grads, x in [-2, 2),
 * random targets. */
static td_status head_fill(head_run *h, const int *hi, int nh)
{
    const td_model_desc *mc = h->run.desc;
    const td_dtype dt = h->run.dt;
    td_status st = TD_OK;
    for (int k = 0; k < nh && !st; k++) {
        td_model_tensor t;
        td_model_tensor_get(mc, hi[k], &t);
        if (t.numel != (size_t)h->C) st = fill(h->p[k], t.numel, dt, -0.04f, 0.04f, 10 + (uint64_t)k);
        else st = fill(h->p[k], t.numel, dt, k ? -0.1f : 0.9f, k ? 0.1f : 1.1f, 10 + (uint64_t)k);
        if (!st) st = fill(h->g[k], t.numel, dt, 0.0f, 0.0f, 1);
    }
    if (!st) st = fill(h->x, (size_t)h->N * h->C, dt, -2.0f, 2.0f, 3);
    if (st) return st;
    int *tg = malloc((size_t)h->N * sizeof(int));
    if (!tg) return td_error_set(TD_ERR_NOMEM, "bench: host memory");
    td_rng r;
    td_rng_seed(&r, 4);
    for (int i = 0; i < h->N; i++) tg[i] = (int)td_rng_below(&r, (uint64_t)mc->vocab_size);
    if (cudaMemcpy(h->targets, tg, (size_t)h->N * sizeof(int), cudaMemcpyHostToDevice) != cudaSuccess)
        st = td_error_set(TD_ERR_BACKEND, "bench: upload of the targets");
    free(tg);
    return st;
}

/* The timings (in chunks of R rows; in one chunk when R < N) as the table
 * or JSON. */
static td_status head_report(const head_opts *o, const head_run *h, int R, const td_bench_peak *pk,
                             const double ms[2])
{
    const int N = h->N, C = h->C, Vp = h->Vp, nrun = R < N ? 2 : 1;
    const size_t E = td_dtype_bytes(h->run.dt);
    const double f = 6.0 * N * (double)C * Vp;
    /* compulsory: x read, the output matrix read, its gradient read and written, dx written */
    const double io = (double)N * C * E * 2 + (double)Vp * C * E * 3;
    char title[240], name[2][64];
    snprintf(name[0], sizeof name[0], "head + loss, %d chunk%s of %d rows", (N + R - 1) / R, R < N ? "s" : "", R);
    snprintf(name[1], sizeof name[1], "head + loss, 1 chunk of %d rows", N);
    if (!o->json) {
        snprintf(title, sizeof title, "head and loss of %s, B %d x T %d, C %d, padded vocabulary %d, %s; median of %d runs",
                 o->model, o->B, o->T, C, Vp, td_dtype_name(h->run.dt), o->repeat);
        header_text(title, pk);
        for (int i = 0; i < nrun; i++) row_text(name[i], ms[i], f, io, pk);
        char a1[32], a2[32];
        printf("\nlogits held: %s in chunks, %s in one chunk\n", td_format_bytes((size_t)R * Vp * E, a1, sizeof a1),
               td_format_bytes((size_t)N * Vp * E, a2, sizeof a2));
        return TD_OK;
    }
    cJSON *doc = cJSON_CreateObject();
    cJSON_AddItemToObject(doc, "device", td_bench_peak_json(pk));
    cJSON *sh = cJSON_AddObjectToObject(doc, "shape");
    cJSON_AddStringToObject(sh, "model", o->model);
    cJSON_AddNumberToObject(sh, "B", o->B);
    cJSON_AddNumberToObject(sh, "T", o->T);
    cJSON_AddNumberToObject(sh, "C", C);
    cJSON_AddNumberToObject(sh, "Vp", Vp);
    cJSON_AddNumberToObject(sh, "loss_chunk_rows", R);
    cJSON_AddStringToObject(sh, "precision", td_dtype_name(h->run.dt));
    cJSON *rows = cJSON_AddArrayToObject(doc, "ops");
    for (int i = 0; i < nrun; i++) {
        row_json(rows, name[i], ms[i], f, io, pk);
        cJSON_AddNumberToObject(cJSON_GetArrayItem(rows, i), "logits_bytes", (double)(i ? N : R) * Vp * E);
    }
    return td_cli_print_json(doc);
}

int td_bench_head_main(int argc, char **argv)
{
    head_opts o = {.B = 16, .T = 1024, .repeat = 10, .model = "gpt2-124m", .precision = "bf16"};
    td_opt table[] = {
        {"model", TD_OPT_STRING, &o.model, "PRESET", "the model whose head (final norm, output matrix) is timed (default "
         "gpt2-124m;\nllama-3.1-8b, qwen2.5-0.5b, ...: docs/model.md)", 0},
        {"micro-batch", TD_OPT_INT, &o.B, "B", "sequences (default 16)", 0},
        {"seq", TD_OPT_INT, &o.T, "T", "sequence length (default 1024)", 0},
        {"loss-chunk", TD_OPT_INT, &o.chunk, "ROWS", "rows of a chunk (default 0: the trainer's auto choice)", 0},
        {"precision", TD_OPT_STRING, &o.precision, "P", "bf16 (default), fp16 or fp32", 0},
        {"repeat", TD_OPT_INT, &o.repeat, "N", "timed runs, median reported (default 10)", 0},
        {"peak-tflops", TD_OPT_DOUBLE, &o.peak_tf, "X", "the device's dense tensor TFLOP/s (default: its data sheet's)", 0},
        {"peak-gbs", TD_OPT_DOUBLE, &o.peak_gbs, "X", "its memory GB/s (default: its data sheet's)", 0},
        {"json", TD_OPT_FLAG, &o.json, NULL, "one JSON object instead of the table", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = td_args_main(table, argc, argv, "bench head",
                          "usage: tidal bench head [options]\n\nTimes the head and the loss (final norm, logits, "
                          "cross-entropy and their\nbackward) over B x T rows as the trainer runs them: in chunks of "
                          "rows\n(--loss-chunk) and in one chunk, beside the roofline, with the bytes of logits\n"
                          "each holds at a time.");
    if (rc >= 0) return rc;
    td_train_config cfg;
    td_status st = head_config(&o, &cfg);
    if (st) {
        fprintf(stderr, "tidal bench head: %s\n", td_error_msg());
        td_args_free();
        return 2;
    }
    const td_model_desc *mc = &cfg.model;
    const int N = o.B * o.T, R = td_train_loss_rows(&cfg);
    td_backend *be = NULL;
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CUDA;
    bufs b = {0};
    void *ws = NULL;
    td_bench_peak pk;
    head_run h = {.N = N, .C = mc->n_embd, .V = mc->vocab_size, .Vp = mc->padded_vocab_size, .dloss = 1.0f / (float)N};
    h.ex = td_model_exec_of(mc, 1);
    int hi[3], nh = td_model_head_tensors(mc, hi);
    double ms[2] = {0, 0};
    if (!h.ex) {
        st = td_error_set(TD_ERR_UNSUPPORTED, "the %s family has no CUDA compute in this build", o.model);
        goto done;
    }
    if ((st = td_backend_create(&bp, &be)) || (st = td_bench_peak_get(cfg.precision, o.peak_tf, o.peak_gbs, &pk)))
        goto done;
    h.run = (td_model_run){.desc = mc, .B = 1, .T = N, .dt = cfg.precision, .gdt = cfg.precision,
                           .stream = td_backend_native_queue(be, TD_QUEUE_COMPUTE)};
    if ((st = head_buffers(&h, be, &b, &ws, hi, nh, o.B, o.T)) || (st = ops_create(ws, &h.run.ops)) ||
        (st = head_fill(&h, hi, nh)))
        goto done;
    h.rows = R;
    if ((st = td_bench_time(head_loss, &h, h.run.ops, h.run.stream, o.repeat, &ms[0]))) goto done;
    if (R < N) {
        h.rows = N;
        if ((st = td_bench_time(head_loss, &h, h.run.ops, h.run.stream, o.repeat, &ms[1]))) goto done;
    }
    st = head_report(&o, &h, R, &pk, ms);
done:
    if (st) fprintf(stderr, "tidal bench head: %s\n", td_error_msg());
    td_ops_cuda_free(h.run.ops);
    td_arena_destroy(b.arena);
    td_backend_free(be);
    td_args_free();
    return st ? 1 : 0;
}
