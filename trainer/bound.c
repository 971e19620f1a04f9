/* The step's lower bound (see td_train_bound in include/tidal/trainer.h):
 * this machine's rates, measured in a second or two, against the plan's
 * work and traffic.
 *
 * The CPU AdamW rate is measured where it runs in training: on buffers far
 * larger than the last-level cache, at the run's scale (its params, from
 * 64 Mi to 256 Mi: 1 to 4 GiB of optimizer state and grads), so every pass
 * streams from DRAM as a large run's does; a 16M-param probe mostly hits
 * the cache and reads two to three times too fast.  The buffers come from
 * the trainer's own pageable allocator (td_hostmem: bound to the AdamW
 * team's NUMA node, transparent huge pages advised), first touched by the
 * team, so the probe streams the pages a run's AdamW does: with 4 KiB pages
 * from the heap its TLB misses varied from run to run (the term read 323,
 * 400 and 398 ms for one plan on an H100 host).  One warm pass faults the
 * pages in; then passes for a second at least, and the rate is their
 * median, as `tidal bench adam` reports it.  A host shared with other
 * guests has a DRAM rate that moves over seconds: the fastest of nine
 * 64 Mi passes (0.15 s in all) read 4.29 to 5.68 G params/s in four plans
 * on one H200 host whose `tidal bench adam` at 200M read 4.27 to 4.51 in
 * seven runs of eight; the median of a longer window is what a run of
 * many seconds sustains.  The fastest pass is kept beside it
 * (dram_fastest_gbs), so a reader sees how far the host's bursts go. */
#include "train_impl.h"
#include "tidal/arena.h"
#include "tidal/copy.h"
#include "tidal/diskio.h"
#include "tidal/hostmem.h"
#include "tidal/hostpool.h"
#include "tidal/ops.h"
#include "tidal/optim.h"
#include "tidal/topo.h"
#include "tidal/util.h"

#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#ifdef TD_HAVE_CUDA
#include "tidal/block_probe.h"
#include "tidal/ops_cuda.h"
/* The model's MLP matmul in bf16 on the device (2048 rows), timed with events
 * once its tuning has settled. */
static td_status measure_cuda_gflops(td_backend *b, const td_model_desc *mc, double *gflops)
{
    td_status st = TD_OK;
    int N = 2048, C = mc->n_embd, OC = 4 * mc->n_embd;
    size_t xb = (size_t)N * C * 2, wb = (size_t)OC * C * 2, yb = (size_t)N * OC * 2;
    size_t sb = td_ops_cuda_matmul_scratch_bytes(N, OC), ws = TD_OPS_CUDA_WORKSPACE_BYTES;
    td_arena *a = NULL;
    td_ops_cuda *ctx = NULL;
    td_event *e0 = NULL, *e1 = NULL;
    void *x = NULL, *w = NULL, *y = NULL, *scr = NULL, *wsp = NULL;
    TD_TRY(td_arena_create(b, xb + wb + yb + sb + ws + 5 * TD_ARENA_ALIGN, &a));
    TD_TRY(td_arena_alloc(a, xb, TD_ROLE_WORKSPACE, &x));
    TD_TRY(td_arena_alloc(a, wb, TD_ROLE_WORKSPACE, &w));
    TD_TRY(td_arena_alloc(a, yb, TD_ROLE_WORKSPACE, &y));
    TD_TRY(td_arena_alloc(a, ws, TD_ROLE_WORKSPACE, &wsp));
    if (sb) TD_TRY(td_arena_alloc(a, sb, TD_ROLE_WORKSPACE, &scr));
    TD_TRY(td_backend_memset_async(b, TD_QUEUE_COMPUTE, x, 0x3c, xb)); /* small finite bf16 values */
    TD_TRY(td_backend_memset_async(b, TD_QUEUE_COMPUTE, w, 0x3c, wb));
    td_ops_cuda_params op = td_ops_cuda_default_params();
    op.workspace = wsp;
    op.workspace_bytes = ws;
    TD_TRY(td_ops_cuda_create(&op, &ctx));
    TD_TRY(td_event_create(b, &e0));
    TD_TRY(td_event_create(b, &e1));
    void *s = td_backend_native_queue(b, TD_QUEUE_COMPUTE);
    /* warm-up: until the shape's GEMM tuning has settled (its calls take
     * cuBLASLt's candidates in turn, each loaded on its first launch) */
    for (int i = 0; i < 64; i++) {
        TD_TRY(td_ops_cuda_matmul_forward(ctx, y, NULL, x, w, NULL, NULL, N, C, OC, TD_DTYPE_BF16, s));
        TD_TRY(td_event_record(b, e0, TD_QUEUE_COMPUTE));
        TD_TRY(td_event_sync(b, e0));
        if (i && !td_ops_cuda_gemm_tuning(ctx)) break;
    }
    TD_TRY(td_event_record(b, e0, TD_QUEUE_COMPUTE));
    for (int i = 0; i < 20; i++) TD_TRY(td_ops_cuda_matmul_forward(ctx, y, NULL, x, w, NULL, NULL, N, C, OC, TD_DTYPE_BF16, s));
    TD_TRY(td_event_record(b, e1, TD_QUEUE_COMPUTE));
    TD_TRY(td_event_sync(b, e1));
    float ms = 0;
    TD_TRY(td_event_elapsed_ms(b, e0, e1, &ms));
    *gflops = ms > 0 ? 20 * 2.0 * N * C * OC / (ms * 1e-3) / 1e9 : 0;
cleanup:
    td_event_free(b, e0);
    td_event_free(b, e1);
    td_ops_cuda_free(ctx);
    td_arena_destroy(a); /* the reservation goes; the buffers with it */
    return st;
}

/* One block's forward, backward and recompute at the run's shape (B, T, dtype) with
 * the trainer's ops, best of 3 after a warm-up.  A shape whose buffers do
 * not fit the device's free memory is left unmeasured (0). */
static td_status measure_cuda_block(td_backend *b, const td_train_config *cfg, td_train_rates *r)
{
    size_t free_b = 0, total_b = 0, need = td_block_probe_bytes(&cfg->model, cfg->micro_batch, cfg->seq_len,
                                                                 cfg->precision, 0);
    r->block_fwd_ms = r->block_bwd_ms = r->block_recompute_ms = 0; /* the probe runs the model's own
                                                                     * block, its family's */
    td_status st = td_backend_mem_info(b, &free_b, &total_b);
    if (st || need + need / 8 > free_b) return st;
    td_block_probe *p = NULL;
    if ((st = td_block_probe_create(b, &cfg->model, cfg->micro_batch, cfg->seq_len, cfg->precision, 0, &p))) return st;
    /* Frozen tensors (LoRA's base, --freeze) have no weight gradient: a block
     * tensor frozen in any block is frozen in the probe, so its backward is
     * at most any block's. */
    int n = td_model_tensor_count(&cfg->model), nb = td_model_block_tensor_count(&cfg->model);
    int ne = td_model_embed_tensor_count(&cfg->model);
    uint8_t *frozen = td_malloc((size_t)n + (size_t)nb, TD_ROLE_META), *any = frozen ? frozen + n : NULL;
    if (!frozen) st = td_error_set(TD_ERR_NOMEM, "block probe: the frozen tensors of %d", n);
    if (!st) st = td_train_frozen(cfg, frozen);
    if (!st) {
        memset(any, 0, (size_t)nb);
        for (int l = 0; l < cfg->model.n_layer; l++)
            for (int k = 0; k < nb; k++) any[k] |= frozen[ne + l * nb + k];
        td_block_probe_freeze(p, any);
        st = td_block_probe_time(p, 3, &r->block_fwd_ms, &r->block_bwd_ms, &r->block_recompute_ms);
    }
    td_free(frozen);
    td_block_probe_destroy(p);
    return st;
}
#endif

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Copies both ways through the copy engine, on a thread of their own, two
 * pairs in flight: the load a step's loads and write-backs put on host DRAM
 * (the DMA reads what goes up and writes what comes down) beside the CPU
 * AdamW.  `bytes` counts the copies finished. */
typedef struct copy_load {
    td_copy_engine *eng;
    void *up_dst, *down_dst;
    const void *up_src, *down_src;
    size_t piece;
    atomic_int stop;
    _Atomic uint64_t bytes;
    td_status st;
} copy_load;

static void *copy_load_main(void *arg)
{
    copy_load *L = arg;
    td_copy_ticket t[2][2];
    memset(t, 0, sizeof t);
    td_status st = TD_OK;
    for (uint64_t i = 0; !st; i++) {
        td_copy_ticket *slot = t[i & 1];
        if (i >= 2) { /* the pair submitted two rounds ago */
            if (!(st = td_copy_wait(L->eng, &slot[0])) && !(st = td_copy_wait(L->eng, &slot[1])))
                atomic_fetch_add(&L->bytes, 2 * (uint64_t)L->piece);
        }
        if (st || atomic_load(&L->stop)) break;
        if (!(st = td_copy_submit(L->eng, TD_COPY_H2D, L->up_dst, L->up_src, L->piece, NULL, &slot[0])))
            st = td_copy_submit(L->eng, TD_COPY_D2H, L->down_dst, L->down_src, L->piece, NULL, &slot[1]);
    }
    if (!st) st = td_copy_drain(L->eng);
    L->st = st;
    return NULL;
}

/* The CPU AdamW probe: G params/s and the DRAM GB/s it reached (the
 * median pass, and the fastest), its team bound to b's local cores as the
 * trainer's (b NULL: unbound); with `load`, also the host DRAM bytes a
 * second that it and the copies move together while both run:
 * *loaded_gbytes_per_s, the median of spans of two passes (the AdamW's
 * bytes and the copies' finished in the span, over its time). */
enum { PROBE_MIN_PASSES = 9, PROBE_MAX_PASSES = 256, LOAD_MIN_SPANS = 3, LOAD_MAX_SPANS = 64 };
#define PROBE_SECONDS 1.0
#define LOAD_SECONDS 0.5

size_t td_train_adam_probe_params(const td_train_config *cfg)
{
    size_t n = td_model_params_numel(&cfg->model);
    if (n < TD_TRAIN_ADAM_PROBE_PARAMS) n = TD_TRAIN_ADAM_PROBE_PARAMS;
    if (n > TD_TRAIN_ADAM_PROBE_MAX_PARAMS) n = TD_TRAIN_ADAM_PROBE_MAX_PARAMS;
    return n;
}

static int cmp_span(const void *a, const void *b)
{
    double x = ((const double *)a)[0], y = ((const double *)b)[0];
    return (x > y) - (x < y);
}

static td_status adam_probe(td_backend *b, const td_train_config *cfg, copy_load *load, td_train_rates *r)
{
    td_status st = TD_OK;
    td_topo *topo = NULL;
    td_hostmem *hm = NULL;
    size_t n = td_train_adam_probe_params(cfg);
    td_dtype dt = cfg->precision;
    size_t E = td_dtype_bytes(cfg->precision);
    td_adam_cpu_params ap = td_adam_cpu_default_params();
    td_adam_cpu *cpu = NULL;
    /* The team bound to the local cores, as the trainer's, of as many threads. */
    if (b && td_topo_create(b, &topo) == TD_OK) ap.topo = topo;
    ap.threads = td_train_adam_threads(cfg, topo);
    float *master = NULL, *m = NULL, *v = NULL;
    void *grad = NULL, *param = NULL;
    r->adam_gps = r->dram_gbs = r->dram_fastest_gbs = 0;
    r->adam_probe_params = 0;
    TD_TRY(td_hostmem_create(topo, &hm));
    /* At most a quarter of the host memory the run may use (--host-ram, the
     * cgroup's limit or MemTotal: td_train_host_limits), down to the 64 Mi
     * floor: a plan must not push a small host into swap. */
    size_t ram = 0, pin = 0;
    char ram_src[256];
    if (td_train_host_limits(cfg, &ram, &pin, ram_src, sizeof ram_src) != TD_OK) ram = 0;
    td_error_clear();
    while (ram && n > TD_TRAIN_ADAM_PROBE_PARAMS && n * (12 + 2 * E) > ram / 4) n /= 2;
    /* A host short of memory gets a smaller probe, which may run partly
     * from the cache and read high. */
    for (;; n /= 2) {
        int ok = td_hostmem_alloc(hm, n * 4, TD_ROLE_OPTIM, (void **)&master) == TD_OK &&
                 td_hostmem_alloc(hm, n * 4, TD_ROLE_OPTIM, (void **)&m) == TD_OK &&
                 td_hostmem_alloc(hm, n * 4, TD_ROLE_OPTIM, (void **)&v) == TD_OK &&
                 td_hostmem_alloc(hm, n * E, TD_ROLE_OPTIM, &grad) == TD_OK &&
                 (dt == TD_DTYPE_F32 || td_hostmem_alloc(hm, n * E, TD_ROLE_OPTIM, &param) == TD_OK);
        if (ok) break;
        td_hostmem_release(hm, master);
        td_hostmem_release(hm, m);
        td_hostmem_release(hm, v);
        td_hostmem_release(hm, grad);
        td_hostmem_release(hm, param);
        master = m = v = NULL;
        grad = param = NULL;
        if (n <= ((size_t)8 << 20))
            TD_FAIL(TD_ERR_NOMEM, "the CPU AdamW rate probe needs %zu MiB of host memory", n * (12 + 2 * E) >> 20);
    }
    td_error_clear();
    r->adam_probe_params = n;
    TD_TRY(td_adam_cpu_create(&ap, &cpu));
    td_adam_chunk ch = { .master = master, .m = m, .v = v, .grad = grad, .grad_dtype = dt,
                         .param_out = param ? param : master, .param_dtype = dt, .numel = n };
    TD_TRY(td_adam_cpu_init(cpu, &ch, NULL, TD_DTYPE_F32)); /* first touch by the team: NUMA-local pages */
    memset(grad, 0, n * E); /* touched: not the shared zero page */
    if (param) memset(param, 0, n * E);
    td_adam_coeffs c;
    TD_TRY(td_adam_coeffs_make(&cfg->optim.adam, 1e-4, 1, 1.0, &c));
    TD_TRY(td_adam_cpu_update(cpu, &c, &ch, 1)); /* warm: threads up, pages mapped */
    double ms[PROBE_MAX_PASSES], start = td_now_ms();
    int passes = 0;
    while (passes < PROBE_MAX_PASSES &&
           (passes < PROBE_MIN_PASSES || td_now_ms() - start < PROBE_SECONDS * 1e3)) {
        double t0 = td_now_ms();
        TD_TRY(td_adam_cpu_update(cpu, &c, &ch, 1));
        ms[passes++] = td_now_ms() - t0;
    }
    qsort(ms, (size_t)passes, sizeof ms[0], cmp_double);
    double median = ms[passes / 2] > 0 ? ms[passes / 2] : 1e-6, fastest = ms[0] > 0 ? ms[0] : 1e-6;
    /* The kernel's bytes a param: fp32 master, m, v read and written, the
     * grad read, a 16-bit param written. */
    double bpp = 24.0 + (double)E + (dt == TD_DTYPE_F32 ? 0.0 : (double)E);
    r->adam_gps = (double)n / (median * 1e-3) / 1e9;
    r->dram_gbs = r->adam_gps * bpp;
    r->dram_fastest_gbs = (double)n / (fastest * 1e-3) / 1e9 * bpp;
    if (load) {
        pthread_t th;
        if (pthread_create(&th, NULL, copy_load_main, load))
            TD_FAIL(TD_ERR_STATE, "the DRAM probe could not start its copy thread");
        td_status ast = td_adam_cpu_update(cpu, &c, &ch, 1); /* warm, under the load */
        double spans[LOAD_MAX_SPANS][3]; /* total GB/s, the AdamW's, the copies' */
        int ns = 0;
        double s0 = td_now_ms();
        while (!ast && ns < LOAD_MAX_SPANS && (ns < LOAD_MIN_SPANS || td_now_ms() - s0 < LOAD_SECONDS * 1e3)) {
            uint64_t b0 = atomic_load(&load->bytes);
            double t0 = td_now_ms();
            for (int i = 0; i < 2 && !ast; i++) ast = td_adam_cpu_update(cpu, &c, &ch, 1);
            double dt_ms = td_now_ms() - t0;
            if (dt_ms <= 0) continue;
            double moved = (double)(atomic_load(&load->bytes) - b0);
            spans[ns][1] = 2.0 * (double)n * bpp / (dt_ms * 1e-3) / 1e9;
            spans[ns][2] = moved / (dt_ms * 1e-3) / 1e9;
            spans[ns][0] = spans[ns][1] + spans[ns][2];
            ns++;
        }
        atomic_store(&load->stop, 1);
        pthread_join(th, NULL);
        TD_TRY(ast);
        TD_TRY(load->st);
        if (ns > 0) {
            qsort(spans, (size_t)ns, sizeof spans[0], cmp_span);
            r->dram_loaded_gbs = spans[ns / 2][0];
            r->dram_loaded_adam_gbs = spans[ns / 2][1];
            r->dram_loaded_copy_gbs = spans[ns / 2][2];
        }
    }
cleanup:
    td_adam_cpu_destroy(cpu);
    td_hostmem_destroy(hm); /* unmaps the probe's buffers */
    td_topo_destroy(topo);
    return st;
}

/* One block's forward, backward and recompute with the CPU reference ops (the cpu
 * backend's compute); left unmeasured (0) when the block's work would take
 * more than a few seconds to time. */
static td_status measure_cpu_block(const td_train_config *cfg, td_train_rates *r)
{
    td_status st = TD_OK;
    const td_model_desc *mc = &cfg->model;
    int B = cfg->micro_batch, T = cfg->seq_len;
    size_t N = (size_t)B * T, C = (size_t)mc->n_embd, off, span;
    r->block_fwd_ms = r->block_bwd_ms = r->block_recompute_ms = 0;
    td_model_block_span(mc, 0, &off, &span);
    if (2.0 * (double)N * (double)span * 3 * 3 > 20e9) return TD_OK; /* three passes of forward + backward (+ recompute) */
    size_t scratch = td_model_block_scratch_numel(mc, B, T) + td_model_lora_drop_numel(mc, B, T);
    float *w = td_calloc(span, sizeof(float), TD_ROLE_WORKSPACE), *g = td_calloc(span, sizeof(float), TD_ROLE_WORKSPACE);
    float *acts = td_calloc(td_model_block_acts_numel(mc, B, T), sizeof(float), TD_ROLE_WORKSPACE);
    float *scr = td_calloc(scratch, sizeof(float), TD_ROLE_WORKSPACE), *x = td_calloc(N * C, sizeof(float), TD_ROLE_WORKSPACE);
    float *y = td_calloc(N * C, sizeof(float), TD_ROLE_WORKSPACE), *dx = td_calloc(N * C, sizeof(float), TD_ROLE_WORKSPACE);
    if (!w || !g || !acts || !scr || !x || !y || !dx) TD_FAIL(TD_ERR_NOMEM, "the block probe");
    /* Block 0's tensors, after the embeddings (the family says how many). */
    for (int k = 0, first = td_model_embed_tensor_count(mc); k < td_model_block_tensor_count(mc); k++) {
        td_model_tensor tt;
        td_model_tensor_get(mc, first + k, &tt);
        td_model_init_tensor(mc, first + k, w + (tt.offset - off), cfg->seed);
    }
    for (size_t i = 0; i < N * C; i++) x[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
    td_model_block wb, gb;
    td_model_block_view(mc, w, &wb);
    td_model_block_view(mc, g, &gb);
    td_model_block_acts a;
    td_model_block_acts_view(mc, B, T, acts, &a);
    const td_model_lora_drop key = {.seed = cfg->seed, .step = 1, .T = T};
    if (td_model_lora_drop_numel(mc, B, T)) { /* a LoRA dropout: the training step's masks cost their time */
        a.lora_drop = &key;
        a.lora_xd = scr + td_model_block_scratch_numel(mc, B, T);
    }
    /* The best of up to seven after a warm-up, within about two seconds:
     * the fastest pass is the one other work on the host disturbed least. */
    double best_f = 1e30, best_b = 1e30, best_r = 1e30, start = td_now_ms();
    for (int i = 0; i < 8 && (i < 3 || td_now_ms() - start < 2000); i++) {
        double t0 = td_now_ms();
        td_model_block_forward(mc, &wb, &a, x, y, NULL, B, T);
        double t1 = td_now_ms();
        memset(dx, 0, N * C * sizeof(float));
        td_model_block_backward(mc, &wb, &gb, &a, x, y, dx, scr, NULL, B, T);
        double t2 = td_now_ms();
        td_model_block_forward(mc, &wb, &a, x, NULL, NULL, B, T); /* a recompute: no output */
        double t3 = td_now_ms();
        if (i && t1 - t0 < best_f) best_f = t1 - t0;
        if (i && t2 - t1 < best_b) best_b = t2 - t1;
        if (i && t3 - t2 < best_r) best_r = t3 - t2;
    }
    r->block_fwd_ms = best_f;
    r->block_bwd_ms = best_b;
    r->block_recompute_ms = best_r;
cleanup:
    td_free(w);
    td_free(g);
    td_free(acts);
    td_free(scr);
    td_free(x);
    td_free(y);
    td_free(dx);
    return st;
}

td_status td_train_measure_block(td_backend *b, const td_train_config *cfg, td_train_rates *r)
{
    omp_set_num_threads(cfg->threads > 0 ? cfg->threads : td_train_default_threads(NULL, NULL, 0));
#ifdef TD_HAVE_CUDA
    if (td_backend_get_kind(b) == TD_BACKEND_CUDA) return measure_cuda_block(b, cfg, r);
#endif
    return measure_cpu_block(cfg, r);
}

td_status td_train_measure_rates(td_backend *b, const td_train_config *cfg, td_train_rates *r)
{
    /* The run's threads, as td_trainer_create sets them: an oversubscribed
     * OpenMP team times far slower than the run it stands for. */
    omp_set_num_threads(cfg->threads > 0 ? cfg->threads : td_train_default_threads(NULL, NULL, 0));
    const td_model_desc *mc = &cfg->model;
    td_status st = TD_OK;
    td_hostpool *pool = NULL;
    td_arena *arena = NULL;
    td_copy_engine *eng = NULL;
    void *h = NULL, *d = NULL, *h_down = NULL, *d_down = NULL;
    float *x = NULL, *w = NULL, *y = NULL;
    size_t bytes = 64 * TD_MiB;
    memset(r, 0, sizeof *r);
    TD_TRY(td_hostpool_create(b, NULL, NULL, &pool));
    TD_TRY(td_hostpool_alloc(pool, bytes, TD_ROLE_STAGING, &h));
    TD_TRY(td_hostpool_alloc(pool, bytes, TD_ROLE_STAGING, &h_down));
    memset(h, 1, bytes);
    memset(h_down, 0, bytes);
    TD_TRY(td_arena_create(b, 2 * bytes + TD_ARENA_ALIGN, &arena));
    TD_TRY(td_arena_alloc(arena, bytes, TD_ROLE_STAGING, &d));
    TD_TRY(td_arena_alloc(arena, bytes, TD_ROLE_STAGING, &d_down));
    TD_TRY(td_copy_engine_create(b, NULL, &eng));
    double best = 1e30;
    for (int i = 0; i < 4; i++) {
        td_copy_ticket tk;
        double t0 = td_now_ms();
        TD_TRY(td_copy_submit(eng, TD_COPY_H2D, d, h, bytes, NULL, &tk));
        TD_TRY(td_copy_wait(eng, &tk));
        double ms = td_now_ms() - t0;
        if (ms < best) best = ms;
    }
    r->copy_gbs = (double)bytes / (best * 1e-3) / 1e9;
    TD_TRY(td_backend_memset_async(b, TD_QUEUE_COMPUTE, d_down, 0, bytes));
    TD_TRY(td_queue_sync(b, TD_QUEUE_COMPUTE));
    copy_load load = { .eng = eng, .up_dst = d, .up_src = h, .down_dst = h_down, .down_src = d_down, .piece = bytes };
    TD_TRY(adam_probe(b, cfg, &load, r));
    TD_TRY(td_train_measure_disk(cfg, r));
#ifdef TD_HAVE_CUDA
    if (td_backend_get_kind(b) == TD_BACKEND_CUDA) {
        TD_TRY(measure_cuda_gflops(b, mc, &r->gflops));
        TD_TRY(measure_cuda_block(b, cfg, r));
        if (cfg->ranks > 1) TD_TRY(td_link_probe_cuda(b, &r->link_gbs, &r->link_what));
        goto cleanup;
    }
#endif
    if (cfg->ranks > 1) { /* the cpu backend's collectives move host memory */
        best = 1e30;
        for (int i = 0; i < 3; i++) {
            double t0 = td_now_ms();
            memcpy(h_down, h, bytes);
            double ms = td_now_ms() - t0;
            if (ms < best) best = ms;
        }
        r->link_gbs = (double)bytes / (best * 1e-3) / 1e9;
        r->link_what = "host memory copies (the cpu backend's collectives)";
    }
    /* Compute: one MLP matmul of the model at 256 rows. */
    int N = 256, C = mc->n_embd, OC = 4 * mc->n_embd;
    x = td_malloc((size_t)N * C * sizeof(float), TD_ROLE_WORKSPACE);
    w = td_malloc((size_t)OC * C * sizeof(float), TD_ROLE_WORKSPACE);
    y = td_malloc((size_t)N * OC * sizeof(float), TD_ROLE_WORKSPACE);
    if (x && w && y) {
        for (size_t i = 0; i < (size_t)N * C; i++) x[i] = (float)(i % 7) * 0.1f;
        for (size_t i = 0; i < (size_t)OC * C; i++) w[i] = (float)(i % 5) * 0.1f;
        td_ops_matmul_forward(y, x, w, NULL, N, C, OC); /* warm-up: threads, caches, clocks */
        best = 1e30;
        for (int i = 0; i < 3; i++) {
            double t0 = td_now_ms();
            td_ops_matmul_forward(y, x, w, NULL, N, C, OC);
            double ms = td_now_ms() - t0;
            if (ms < best) best = ms;
        }
        r->gflops = 2.0 * N * C * OC / (best * 1e-3) / 1e9;
    }
    TD_TRY(measure_cpu_block(cfg, r));
cleanup:
    td_free(x);
    td_free(w);
    td_free(y);
    td_copy_engine_destroy(eng);
    if (d) td_arena_release(arena, d);
    if (d_down) td_arena_release(arena, d_down);
    td_arena_destroy(arena);
    if (h) td_hostpool_release(pool, h);
    if (h_down) td_hostpool_release(pool, h_down);
    td_hostpool_destroy(pool);
    return st;
}

/* The disk tier's directories through its own engine: a GiB each pass
 * where they have 8 GiB free (a quarter of one where not), requests of
 * 4 MiB, 16 in flight.  A drive behind a write cache (a virtual disk) runs
 * fast for its first few hundred MiB; a step moves tens of GiB, so the
 * probe must outlast that.  About two seconds on a drive of 1.5 GB/s.
 * TD_DISK_PROBE_BYTES sets another size (the tests' few MiB). */
#define DISK_PROBE_BYTES ((size_t)1 << 30)
#define DISK_PROBE_MIN_BYTES ((size_t)256 << 20)

td_status td_train_measure_disk(const td_train_config *cfg, td_train_rates *r)
{
    r->disk_write_gbs = r->disk_read_gbs = r->disk_mixed_gbs = 0;
    r->disk_direct = 0;
    if (cfg->mm.n_disk_dirs <= 0) return TD_OK;
    td_dio_params ip = td_dio_default_params();
    ip.method = cfg->mm.disk_method;
    td_dio *io = NULL;
    td_dio_rates dr;
    td_status st = td_dio_create(&ip, &io);
    size_t bytes = DISK_PROBE_BYTES;
    for (int i = 0; i < cfg->mm.n_disk_dirs && bytes > DISK_PROBE_MIN_BYTES; i++) {
        size_t f = 0;
        if (td_dio_dir_free(cfg->mm.disk_dirs[i], &f) || f < 8 * bytes / (size_t)cfg->mm.n_disk_dirs)
            bytes = DISK_PROBE_MIN_BYTES;
    }
    td_error_clear();
    const char *env = getenv("TD_DISK_PROBE_BYTES"); /* tests: a probe of a few MiB */
    size_t asked = 0;
    if (env && td_parse_bytes(env, &asked) == TD_OK && asked >= TD_DIO_ALIGN) bytes = asked;
    td_error_clear();
    if (!st) st = td_dio_measure(io, cfg->mm.disk_dirs, cfg->mm.n_disk_dirs, bytes, 4 * TD_MiB, 16, &dr);
    td_dio_destroy(io);
    if (st) return td_error_prefix(st, "measuring --offload-dir: ");
    r->disk_write_gbs = dr.write_gbs;
    r->disk_read_gbs = dr.read_gbs;
    r->disk_mixed_gbs = dr.mixed_gbs;
    r->disk_direct = dr.direct;
    return TD_OK;
}

void td_train_bound_of(const td_train_config *cfg, const td_train_plan *p, const td_train_rates *r, td_train_bound *out)
{
    memset(out, 0, sizeof *out);
    /* Compute: the measured block times (forward, recompute, backward of
     * every block) plus the head's matmuls at the matmul rate, per
     * micro-batch; without block times, every flop at the matmul rate.  A
     * recompute skips the block's last projection (its output is not
     * needed): its own time, the forward's where not measured. */
    out->compute_ms = r->gflops > 0 ? p->flops_per_step / (r->gflops * 1e9) * 1e3 : 0;
    if (r->block_fwd_ms > 0 && r->gflops > 0) {
        double L = cfg->model.n_layer, head = 6.0 * cfg->micro_batch * cfg->seq_len * cfg->model.n_embd *
                                              (double)cfg->model.padded_vocab_size;
        double rec = r->block_recompute_ms > 0 ? r->block_recompute_ms : r->block_fwd_ms;
        out->compute_ms = cfg->grad_accum * (L * (r->block_fwd_ms + r->block_bwd_ms) + p->ckpt_blocks * rec +
                                             head / (r->gflops * 1e9) * 1e3);
    }
    out->pcie_ms = r->copy_gbs > 0 ? (p->h2d_bytes_per_step + p->d2h_bytes_per_step) / (r->copy_gbs * 1e9) * 1e3 : 0;
    /* Several ranks: the other ranks' shards over the devices' links, the
     * gathers and the reduce-scatters sharing them (one direction each way
     * at best; counted in series: they share the links' bandwidth, and on
     * one communicator NCCL runs them in turn). */
    out->link_ms = r->link_gbs > 0 ? (p->gather_bytes_per_step + p->reduce_bytes_per_step) / (r->link_gbs * 1e9) * 1e3 : 0;
    /* The CPU AdamW streams its bytes a param at the measured DRAM rate (a
     * compact state moves fewer bytes at the same rate). */
    out->adam_gparams_per_s = r->dram_gbs > 0 && p->adam_bytes_per_param > 0 ? r->dram_gbs / p->adam_bytes_per_param
                                                                            : r->adam_gps;
    out->adam_ms = out->adam_gparams_per_s > 0 ? p->adam_cpu_params / (out->adam_gparams_per_s * 1e9) * 1e3 : 0;
    /* Host DRAM: every byte that crosses it in a step, the CPU AdamW's
     * streams and the copies' (the DMA reads each load from it and writes
     * each write-back to it), at the rate the two reached together.  Where
     * the AdamW alone leaves DRAM idle this is below the AdamW term; where
     * the copies take bandwidth from it (W4: 17 GB of copies beside 115 GB
     * of AdamW traffic a step) it is the larger. */
    double adam_bytes = out->adam_gparams_per_s > 0 ? p->adam_cpu_params * p->adam_bytes_per_param : 0;
    double disk_bytes = p->disk_read_bytes_per_step + p->disk_write_bytes_per_step; /* DMA into and out of DRAM too */
    out->dram_ms = r->dram_loaded_gbs > 0 ? (adam_bytes + p->h2d_bytes_per_step + p->d2h_bytes_per_step + disk_bytes) /
                                                (r->dram_loaded_gbs * 1e9) * 1e3
                                          : 0;
    /* The disk tier: its reads and writes at once, at the rate the drive
     * reached with both (the two rates in turn where that is unknown). */
    if (disk_bytes > 0 && r->disk_mixed_gbs > 0)
        out->disk_ms = disk_bytes / (r->disk_mixed_gbs * 1e9) * 1e3;
    else if (disk_bytes > 0 && r->disk_read_gbs > 0 && r->disk_write_gbs > 0)
        out->disk_ms = (p->disk_read_bytes_per_step / r->disk_read_gbs + p->disk_write_bytes_per_step / r->disk_write_gbs) /
                       1e9 * 1e3;
    /* Grad accumulation: a chunk's grads are whole only in the last
     * micro-batch's backward, and its update must be done before the next
     * step's first forward reads it.  So the CPU AdamW runs within one
     * micro-batch's compute (the last backward, the first forward); what
     * exceeds that the GPU waits for, on top of all the step's compute.
     * With one micro-batch this is max(compute, AdamW), as before. */
    int K = cfg->grad_accum > 1 ? cfg->grad_accum : 1;
    double window = out->compute_ms / K;
    /* Clipping (or a loss scale's overflow check) needs every grad before
     * the first update: the CPU AdamW starts when the backward is done and
     * hides only within the next step's first forward.  That forward: the
     * blocks' measured forwards plus the head's third of its flops, else a
     * third of a micro-batch's compute (more than its forward, which keeps
     * the bound below the step). */
    if (cfg->optim.max_grad_norm > 0 || cfg->optim.scaler.kind != TD_LOSS_SCALE_NONE) {
        double fwd = out->compute_ms / K / 3;
        if (r->block_fwd_ms > 0 && r->gflops > 0)
            fwd = cfg->model.n_layer * r->block_fwd_ms +
                  2.0 * cfg->micro_batch * cfg->seq_len * cfg->model.n_embd * (double)cfg->model.padded_vocab_size /
                      (r->gflops * 1e9) * 1e3;
        if (fwd < window) window = fwd;
    }
    /* The disk's reads and writes of the state (and of the last grads, and
     * the new params) run beside the CPU AdamW, which waits for each chunk's
     * read: the AdamW's stretch is the longer of the two.  The rest (the
     * params' reads for the uploads, the grads of the earlier micro-batches)
     * spreads over the step: in the disk term alone. */
    double beside = disk_bytes > 0 ? out->disk_ms * p->disk_stream_bytes_per_step / disk_bytes : 0;
    double stretch = beside > out->adam_ms ? beside : out->adam_ms;
    out->exposed_adam_ms = stretch > window ? stretch - window : 0;
    out->bound_ms = out->compute_ms + out->exposed_adam_ms;
    if (out->disk_ms > out->bound_ms) out->bound_ms = out->disk_ms;
    if (out->pcie_ms > out->bound_ms) out->bound_ms = out->pcie_ms;
    if (out->link_ms > out->bound_ms) out->bound_ms = out->link_ms;
    if (out->adam_ms > out->bound_ms) out->bound_ms = out->adam_ms;
    if (out->dram_ms > out->bound_ms) out->bound_ms = out->dram_ms;
    double tokens = (double)cfg->micro_batch * cfg->seq_len * cfg->grad_accum;
    out->tokens_per_s = out->bound_ms > 0 ? tokens / (out->bound_ms * 1e-3) : 0;
}
