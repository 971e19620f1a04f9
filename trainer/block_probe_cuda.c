/* The block probe (tidal/block_probe.h): one block of the model's family on
 * the device, its buffers from one arena, timed by `tidal plan` (the step's
 * compute term) and, op by op, by `tidal bench ops`. */
#include "tidal/block_probe.h"

#include "tidal/alloc.h"
#include "tidal/convert.h"
#include "tidal/family.h"
#include "tidal/util.h"

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { PARAMS, GRADS, ACTS, X, Y, DY, DX, CONSTS, SCRATCH, WORKSPACE, BIG, MID, DRES, DC, NBUF };

/* The widest output of the block's matmuls (rows of its largest 2-D weight). */
static size_t widest_rows(const td_model_desc *mc)
{
    size_t rows = 0;
    for (int k = 0, first = td_model_embed_tensor_count(mc); k < td_model_block_tensor_count(mc); k++) {
        td_model_tensor t;
        td_model_tensor_get(mc, first + k, &t);
        if (t.ndim == 2 && (size_t)t.shape[0] > rows) rows = (size_t)t.shape[0];
    }
    return rows;
}

/* Each buffer's bytes; 0: not needed. */
static void sizes_of(const td_model_desc *model, int B, int T, td_dtype dt, int op_buffers, size_t s[NBUF])
{
    td_model_desc mc = *model;
    mc.n_layer = 1;
    const td_model_exec *ex = td_model_exec_of(&mc, 1);
    size_t off, span, E = td_dtype_bytes(dt), N = (size_t)B * (size_t)T, C = (size_t)mc.n_embd;
    size_t A = (size_t)td_model_attn_width(&mc), wide = C > A ? C : A;
    memset(s, 0, NBUF * sizeof *s);
    td_model_block_span(&mc, 0, &off, &span);
    s[PARAMS] = s[GRADS] = span * E;
    s[ACTS] = ex ? ex->block_acts_bytes(&mc, B, T, dt) : 0;
    s[X] = s[Y] = s[DY] = s[DX] = N * C * E;
    s[CONSTS] = ex ? ex->consts_bytes(&mc) : 0;
    s[SCRATCH] = ex ? ex->scratch_bytes(&mc, B, T, dt, B) : 0;
    s[WORKSPACE] = TD_OPS_CUDA_WORKSPACE_BYTES;
    if (!op_buffers) return;
    s[BIG] = N * widest_rows(&mc) * E;
    s[MID] = N * (size_t)td_model_mlp_width(&mc) * E;
    s[DRES] = s[DC] = N * wide * E;
}

/* n values center + uniform [-scale, scale) of type dt into device memory: the
 * tensor cores draw more power, and clock lower, on varied data than on a
 * constant (a constant fill ran a 1.5B block at B32 12% faster on an H100:
 * forward 3.51 against 3.80 ms, backward 8.48 against 9.81 ms). */
static td_status fill_random(void *dev, size_t n, td_dtype dt, uint64_t seed, float center, float scale)
{
    size_t E = td_dtype_bytes(dt);
    void *h = td_malloc(n * E, TD_ROLE_STAGING);
    if (!h) return td_error_set(TD_ERR_NOMEM, "block probe: %zu bytes of host staging", n * E);
    td_rng r;
    td_rng_seed(&r, seed);
    for (size_t i = 0; i < n; i++) {
        float v = center + (float)(td_rng_uniform(&r) * 2.0 - 1.0) * scale;
        if (dt == TD_DTYPE_F32) ((float *)h)[i] = v;
        else ((uint16_t *)h)[i] = dt == TD_DTYPE_BF16 ? td_bf16_from_f32(v) : td_f16_from_f32(v);
    }
    cudaError_t e = cudaMemcpy(dev, h, n * E, cudaMemcpyHostToDevice);
    td_free(h);
    return e == cudaSuccess ? TD_OK : td_error_set(TD_ERR_BACKEND, "block probe: cudaMemcpy: %s", cudaGetErrorString(e));
}

size_t td_block_probe_bytes(const td_model_desc *model, int B, int T, td_dtype dt, int op_buffers)
{
    size_t s[NBUF], total = 0;
    sizes_of(model, B, T, dt, op_buffers, s);
    for (int i = 0; i < NBUF; i++) total += td_align_up(s[i], TD_ARENA_ALIGN);
    return total;
}

td_status td_block_probe_create(td_backend *b, const td_model_desc *model, int B, int T, td_dtype dt, int op_buffers,
                                td_block_probe **out)
{
    td_status st = TD_OK;
    *out = NULL;
    void *host = NULL;
    td_block_probe *p = td_calloc(1, sizeof *p, TD_ROLE_META);
    if (!p) return TD_ERR_NOMEM;
    p->mc = *model;
    p->mc.n_layer = 1;
    p->B = B, p->T = T, p->N = B * T, p->dt = dt;
    if (!(p->exec = td_model_exec_of(&p->mc, 1)))
        TD_FAIL(TD_ERR_UNSUPPORTED, "block probe: the %s family has no CUDA compute",
                td_model_family_name(td_model_family_of(&p->mc)));
    size_t s[NBUF];
    void *buf[NBUF] = {0};
    sizes_of(model, B, T, dt, op_buffers, s);
    TD_TRY(td_arena_create(b, td_block_probe_bytes(model, B, T, dt, op_buffers), &p->arena));
    for (int i = 0; i < NBUF; i++)
        if (s[i]) TD_TRY(td_arena_alloc(p->arena, s[i], TD_ROLE_WORKSPACE, &buf[i]));
    p->stream = td_backend_native_queue(b, TD_QUEUE_COMPUTE);
    /* Params, the input and the output gradient as in training (random, of
     * GPT-2's init scale; what the family starts at a constant, the norms'
     * gains, at that constant); the rest is written before it is read. */
    size_t E = td_dtype_bytes(dt);
    for (int i = 0; i < NBUF; i++)
        if (buf[i] && i != WORKSPACE) TD_TRY(td_backend_memset_async(b, TD_QUEUE_COMPUTE, buf[i], 0, s[i]));
    TD_TRY(td_queue_sync(b, TD_QUEUE_COMPUTE));
    td_ops_cuda_block_view(&p->mc, buf[PARAMS], dt, &p->w);
    td_ops_cuda_block_view(&p->mc, buf[GRADS], dt, &p->g);
    size_t span_off, span;
    td_model_block_span(&p->mc, 0, &span_off, &span);
    for (int k = 0, first = td_model_embed_tensor_count(&p->mc); k < td_model_block_tensor_count(&p->mc); k++) {
        td_model_tensor t;
        td_model_tensor_get(&p->mc, first + k, &t);
        p->p[k] = (char *)buf[PARAMS] + (t.offset - span_off) * E;
        p->gp[k] = (char *)buf[GRADS] + (t.offset - span_off) * E;
    }
    TD_TRY(fill_random(buf[PARAMS], s[PARAMS] / E, dt, 1, 0.0f, 0.02f));
    const td_model_family *fam = td_model_family_of(&p->mc);
    for (int k = 0, first = td_model_embed_tensor_count(&p->mc); k < td_model_block_tensor_count(&p->mc); k++) {
        td_model_tensor t;
        td_model_tensor_get(&p->mc, first + k, &t);
        td_model_init_rule rule = fam->init(&p->mc, t.kind);
        if (rule.std <= 0 && rule.value != 0.0f) TD_TRY(fill_random(p->p[k], t.numel, dt, 4, rule.value, 0.0f));
    }
    TD_TRY(fill_random(buf[X], s[X] / E, dt, 2, 0.0f, 1.0f));
    TD_TRY(fill_random(buf[DY], s[DY] / E, dt, 3, 0.0f, 1e-3f));
    if (s[CONSTS]) {
        if (!(host = td_malloc(s[CONSTS], TD_ROLE_META))) TD_FAIL(TD_ERR_NOMEM, "block probe: the model's constants");
        p->exec->consts_fill(&p->mc, host);
        TD_TRY(td_backend_copy_async(b, TD_QUEUE_COMPUTE, buf[CONSTS], host, s[CONSTS]));
        TD_TRY(td_queue_sync(b, TD_QUEUE_COMPUTE));
    }
    td_ops_cuda_params op = td_ops_cuda_default_params();
    op.workspace = buf[WORKSPACE];
    op.workspace_bytes = s[WORKSPACE];
    TD_TRY(td_ops_cuda_create(&op, &p->ops));
    p->acts = buf[ACTS], p->consts = buf[CONSTS];
    p->x = buf[X], p->y = buf[Y], p->dy = buf[DY], p->dx = buf[DX];
    p->big = buf[BIG], p->mid = buf[MID], p->dres = buf[DRES], p->dc = buf[DC];
    p->scratch = buf[SCRATCH];
    p->scratch_bytes = s[SCRATCH];
    p->run = (td_model_run){.desc = &p->mc, .B = B, .T = T, .dt = dt, .gdt = dt, .ops = p->ops, .stream = p->stream,
                            .consts = p->consts, .scratch = p->scratch, .scratch_bytes = p->scratch_bytes};
    p->lora_drop = (td_model_lora_drop){.seed = 1, .step = 1, .T = T};
    if (p->mc.lora.rank > 0 && p->mc.lora.dropout > 0) p->run.lora_drop = &p->lora_drop;
    *out = p;
    td_free(host);
    return TD_OK;
cleanup:
    td_free(host);
    td_block_probe_destroy(p);
    return st;
}

void td_block_probe_freeze(td_block_probe *p, const uint8_t *frozen)
{
    for (int k = 0; k < td_model_block_tensor_count(&p->mc); k++)
        if (frozen[k]) p->gp[k] = NULL;
}

void td_block_probe_destroy(td_block_probe *p)
{
    if (!p) return;
    td_ops_cuda_free(p->ops);
    td_arena_destroy(p->arena); /* the reservation goes; the buffers with it */
    td_free(p);
}

td_status td_block_probe_forward(td_block_probe *p)
{
    return p->exec->block_forward(&p->run, p->p, p->acts, p->x, p->y);
}

td_status td_block_probe_recompute(td_block_probe *p)
{
    return p->exec->block_forward(&p->run, p->p, p->acts, p->x, NULL);
}

td_status td_block_probe_backward(td_block_probe *p)
{
    return p->exec->block_backward(&p->run, p->p, p->gp, p->acts, p->x, p->dy, p->dx);
}

td_status td_block_probe_time(td_block_probe *p, int repeat, double *fwd_ms, double *bwd_ms, double *rec_ms)
{
    td_status st = TD_OK;
    td_backend *b = td_arena_backend(p->arena);
    td_event *e[4] = {0};
    for (int i = 0; i < 4; i++) TD_TRY(td_event_create(b, &e[i]));
    double best_f = 1e30, best_b = 1e30, best_r = 1e30;
    /* Heat: the block at full load for TD_BLOCK_PROBE_HEAT_MS first, so the
     * GPU's clocks settle where its power limit holds them through a step.
     * On an H200 at W3's shape (1.5B, B32) a step's forward blocks slowed
     * from 3.9 to 4.4 ms over its first 17 blocks, nvidia-smi reading
     * 1320-1635 MHz at 679-695 W (1980 MHz idle); the cold probe's compute
     * term read 772-779 ms against an 895-908 ms step, after the heat 861. */
    /* The heat also runs until the GEMM shapes' tuning has settled (their
     * first calls take cuBLASLt's candidates in turn: ops_cuda.h), at most
     * ten heats. */
    double heat_from = td_now_ms();
    while (td_now_ms() - heat_from < TD_BLOCK_PROBE_HEAT_MS ||
           (td_ops_cuda_gemm_tuning(p->ops) && td_now_ms() - heat_from < 10 * TD_BLOCK_PROBE_HEAT_MS)) {
        TD_TRY(td_block_probe_forward(p));
        TD_TRY(td_block_probe_backward(p));
        TD_TRY(td_event_record(b, e[0], TD_QUEUE_COMPUTE));
        TD_TRY(td_event_sync(b, e[0]));
    }
    for (int it = 0; it <= repeat; it++) { /* run 0 is the warm-up */
        TD_TRY(td_event_record(b, e[0], TD_QUEUE_COMPUTE));
        TD_TRY(td_block_probe_forward(p));
        TD_TRY(td_event_record(b, e[1], TD_QUEUE_COMPUTE));
        TD_TRY(td_block_probe_backward(p));
        TD_TRY(td_event_record(b, e[2], TD_QUEUE_COMPUTE));
        TD_TRY(td_block_probe_recompute(p));
        TD_TRY(td_event_record(b, e[3], TD_QUEUE_COMPUTE));
        TD_TRY(td_event_sync(b, e[3]));
        float f = 0, bw = 0, rc = 0;
        TD_TRY(td_event_elapsed_ms(b, e[0], e[1], &f));
        TD_TRY(td_event_elapsed_ms(b, e[1], e[2], &bw));
        TD_TRY(td_event_elapsed_ms(b, e[2], e[3], &rc));
        if (it > 0 && f < best_f) best_f = f;
        if (it > 0 && bw < best_b) best_b = bw;
        if (it > 0 && rc < best_r) best_r = rc;
    }
    *fwd_ms = best_f;
    *bwd_ms = best_b;
    if (rec_ms) *rec_ms = best_r;
cleanup:
    for (int i = 0; i < 4; i++) td_event_free(b, e[i]);
    return st;
}
