/* The step loop over the chunk manager (see include/tidal/trainer.h).
 *
 * Letters: B micro-batch, T sequence, C width, L layers, NH heads, Vp
 * padded vocabulary, N = B*T rows.  The model ops work on the device
 * pointers the chunk manager hands out: on the cpu backend the CPU
 * reference ops (ops.h / model_ref.h, fp32; "device" memory is a host
 * region), on the cuda backend the CUDA ops (ops_cuda.h, bf16/fp16/fp32
 * storage with fp32 accumulation) on the compute stream.  Everything else —
 * the access order, the states, the optimizer — is the same code. */
#include "train_impl.h"
#include "adam_worker.h"
#include "tidal/arena.h"
#include "tidal/copy.h"
#include "tidal/hostpool.h"
#include "tidal/ops.h"
#include "tidal/convert.h"
#ifdef TD_HAVE_CUDA
#include "tidal/ops_cuda.h"
#endif
#include "tidal/topo.h"
#include "tidal/util.h"

#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>


static td_status setup_optimizer(td_trainer *t);
static td_status set_disk_order(td_trainer *t);
static td_status adam_job(void *ctx, int k);
static int adam_ready(void *ctx, int k);
static void adam_drop(void *ctx, int k);

static int on_cuda(const td_trainer *t) { return t->ops_cuda != NULL; }
/* A wait shorter than this is not drawn on the timeline. */
#define SLICE_MIN_MS 0.05
/* The host waits for the compute queue: through the communicator when there
 * is one, so that a collective a dead peer never finishes ends in an error
 * within --comm-timeout instead of a hang (parallel.h). */
static td_status compute_sync(td_trainer *t)
{
    return t->comm ? td_comm_wait(t->comm, TD_QUEUE_COMPUTE) : td_queue_sync(t->backend, TD_QUEUE_COMPUTE);
}
#ifdef TD_HAVE_CUDA
static void *stream_of(td_trainer *t) { return td_backend_native_queue(t->backend, TD_QUEUE_COMPUTE); }
#endif
static size_t E_of(const td_trainer *t) { return td_dtype_bytes(t->dt); }

static size_t N_of(const td_trainer *t) { return (size_t)t->cfg.micro_batch * (size_t)t->cfg.seq_len; }

/* ---- ZeRO-3: the chunk manager's collectives (memmgr.h, shard_comm) -------- */

/* In place on a gathered chunk: this rank's shard is at shard_rank x S.
 * Over the shard group; a grad shard is then summed over its replicas on
 * the other hosts (--shard node), so each holds the sum over every rank. */
static td_status mm_all_gather(void *ctx, void *buf, size_t S, td_dtype dt, td_queue q)
{
    td_trainer *t = ctx;
    return td_comm_all_gather(t->scomm, (char *)buf + (size_t)t->shard_rank * S * td_dtype_bytes(dt), buf, S, dt, q);
}

static td_status mm_reduce_scatter(void *ctx, void *buf, size_t S, td_dtype dt, td_queue q)
{
    td_trainer *t = ctx;
    char *mine = (char *)buf + (size_t)t->shard_rank * S * td_dtype_bytes(dt);
    td_status st = td_comm_reduce_scatter(t->rcomm ? t->rcomm : t->scomm, buf, mine, S, dt, q);
    return st || !t->xcomm ? st : td_comm_all_reduce(t->xcomm, mine, mine, S, dt, TD_REDUCE_SUM, q);
}

static td_status mm_agree_max(void *ctx, double *v, int n)
{
    td_trainer *t = ctx;
    double *all = t->sumsq_all; /* ranks x (chunks + 1) */
    if (!all || n > td_memmgr_role_chunk_count(t->mm, TD_TENSOR_PARAM) + 1)
        return td_error_set(TD_ERR_STATE, "agreeing on %d values over %d ranks before the optimizer is set up", n,
                            t->ranks);
    td_status st = td_comm_host_allgather(t->comm, v, (size_t)n * sizeof *v, all);
    for (int r = 0; !st && r < t->ranks; r++)
        for (int i = 0; i < n; i++)
            if (all[r * n + i] > v[i]) v[i] = all[r * n + i];
    return st;
}

/* The host waits for queue q through every communicator that may have a
 * collective on it, the reduce-scatters' first on the D2H queue: a wait
 * ends when the queue drains, or aborts its communicator at the timeout,
 * so the one whose collective hangs should be the one waited through. */
static td_status queue_wait(td_trainer *t, td_queue q)
{
    td_status st = TD_OK;
    if (t->rcomm && q == TD_QUEUE_D2H) st = td_comm_wait(t->rcomm, q);
    if (!st) st = td_comm_wait(t->scomm, q);
    if (!st && t->xcomm) st = td_comm_wait(t->xcomm, q);
    if (!st && t->rcomm && q != TD_QUEUE_D2H) st = td_comm_wait(t->rcomm, q);
    return st;
}

static td_status mm_wait(void *ctx, td_queue q) { return queue_wait(ctx, q); }

/* --shard node over several hosts: a communicator over this host's ranks
 * (the shard group) and one over the ranks holding the same shard on the
 * other hosts.  The job's ranks must be numbered host by host. */
static td_status split_groups(td_trainer *t)
{
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    uint64_t mine = 1469598103934665603ull, *all = td_malloc((size_t)t->ranks * sizeof *all, TD_ROLE_META);
    if (!all) return TD_ERR_NOMEM;
    for (const char *p = host; *p; p++) mine = (mine ^ (unsigned char)*p) * 1099511628211ull;
    mine = (mine ^ (uint64_t)(t->node_rank + 1)) * 1099511628211ull;
    td_status st = td_comm_host_allgather(t->comm, &mine, sizeof mine, all);
    int L = t->shard_ranks, g = t->rank / L;
    for (int r = g * L; !st && r < (g + 1) * L; r++)
        if (all[r] != all[g * L])
            st = td_error_set(TD_ERR_INVALID, "--shard node: ranks %d and %d share a shard group of %d but not a host "
                              "(the job's ranks must be numbered host by host, %d a host; or use --shard world)",
                              g * L, r, L, L);
    td_free(all);
    if (!st) st = td_comm_split(t->comm, g, t->rank % L, &t->scomm);
    if (!st) st = td_comm_split(t->comm, t->rank % L, g, &t->xcomm);
    return st;
}

/* ---- creation ------------------------------------------------------------- */

static td_status register_tensors(td_trainer *t)
{
    int n = td_model_tensor_count(&t->cfg.model);
    t->n_tensors = n;
    t->pid = td_malloc(5 * (size_t)n * sizeof(int), TD_ROLE_META);
    if (!t->pid) return TD_ERR_NOMEM;
    t->gid = t->pid + n;
    t->sid = t->gid + n;
    t->mid = t->sid + n;
    t->vid = t->mid + n;
    td_status st = td_train_register_model(t->mm, &t->cfg, t->pid);
    if (st) return st;
    t->gid_live = td_malloc((size_t)n * sizeof(int), TD_ROLE_META);
    if (!t->gid_live) return TD_ERR_NOMEM;
    t->n_live = 0;
    for (int i = 0; i < n; i++)
        if (t->gid[i] >= 0) t->gid_live[t->n_live++] = t->gid[i];
    return TD_OK;
}

/* ids without the -1 of frozen tensors (their grads, m, v: none). */
static int live_ids(const int *ids, int n, int *out)
{
    int m = 0;
    for (int i = 0; i < n; i++)
        if (ids[i] >= 0) out[m++] = ids[i];
    return m;
}

/* Elements [begin, begin + count) of tensor i's seeded init into its host
 * copies, drawn alone (td_model_init_range): into the fp32 master when it
 * has one and the params rounded from it, into fp32 params directly (they
 * are the master), else (frozen 16-bit params) through a scratch of at most
 * INIT_PIECE floats.  No buffer the size of a tensor: under ZeRO-3 a rank
 * draws only its shard. */
#define INIT_PIECE ((size_t)1 << 20)
static td_status draw_init(td_trainer *t, int i, size_t begin, size_t count, float *master, char *param)
{
    const td_model_desc *d = &t->cfg.model;
    if (master || t->dt == TD_DTYPE_F32) {
        td_model_init_range(d, i, master ? master : (float *)param, begin, count, t->cfg.seed);
        if (master) td_train_from_f32(param, t->dt, master, count);
        return TD_OK;
    }
    size_t piece = count < INIT_PIECE ? count : INIT_PIECE;
    float *scratch = td_malloc((piece ? piece : 1) * sizeof(float), TD_ROLE_META);
    if (!scratch) return td_error_set(TD_ERR_NOMEM, "initialising frozen tensor %d (%zu elements at a time)", i, piece);
    for (size_t k = 0; k < count; k += piece) {
        size_t n = count - k < piece ? count - k : piece;
        td_model_init_range(d, i, scratch, begin + k, n, t->cfg.seed);
        td_train_from_f32(param + k * td_dtype_bytes(t->dt), t->dt, scratch, n);
    }
    td_free(scratch);
    return TD_OK;
}

/* ZeRO-3: the part of tensor i in this rank's shard of its chunk, drawn
 * into the host copies (every rank draws its own part of the same
 * streams). */
static td_status init_shard(td_trainer *t, int i, size_t numel)
{
    td_memmgr *mm = t->mm;
    int pc = td_memmgr_tensor_chunk(mm, t->pid[i]);
    size_t off = td_memmgr_tensor_offset(mm, t->pid[i]), b, e, from, to;
    td_memmgr_chunk_host_range(mm, pc, &b, &e);
    if (off >= e || off + numel <= b) return TD_OK; /* none of it is this rank's */
    float *master = NULL;
    char *param;
    from = off > b ? off : b;
    to = off + numel < e ? off + numel : e;
    td_status st = td_memmgr_chunk_host_access(mm, pc, TD_ACCESS_WRITE, (void **)&param);
    if (!st && t->sid[i] >= 0)
        st = td_memmgr_chunk_host_access(mm, td_memmgr_tensor_chunk(mm, t->sid[i]), TD_ACCESS_WRITE, (void **)&master);
    if (st) return st;
    return draw_init(t, i, from - off, to - from, master ? master + (from - b) : NULL,
                     param + (from - b) * td_dtype_bytes(t->dt));
}

/* Params from the seeded init, written into their host copies; m and v
 * start at zero (the layout zeroes host copies). */
static td_status init_state(td_trainer *t)
{
    td_status st = TD_OK;
    for (int i = 0; i < t->n_tensors; i++) { /* first, so that whole chunks may be written (a shard) */
        int hold[4] = {t->pid[i], t->mid[i], t->vid[i], t->sid[i]}, live[4];
        TD_TRY(td_memmgr_set_state(t->mm, live, live_ids(hold, 4, live), TD_TENSOR_HOLD));
    }
    for (int i = 0; i < t->n_tensors; i++) {
        void *host, *master = NULL;
        size_t numel = td_memmgr_tensor_numel(t->mm, t->pid[i]);
        if (t->ranks > 1) {
            TD_TRY(init_shard(t, i, numel));
            continue;
        }
        TD_TRY(td_memmgr_host_access(t->mm, &t->pid[i], 1, TD_ACCESS_WRITE, &host));
        if (t->sid[i] >= 0) TD_TRY(td_memmgr_host_access(t->mm, &t->sid[i], 1, TD_ACCESS_WRITE, &master));
        TD_TRY(draw_init(t, i, 0, numel, master, host));
    }
cleanup:
    return st;
}

static td_status take(td_trainer *t, size_t bytes, td_role role, void *pptr)
{
    void **p = pptr;
    td_status st = td_memmgr_alloc_nonmodel(t->mm, bytes, role, p);
    if (st == TD_OK) t->nonmodel_bytes += td_align_up(bytes, TD_ARENA_ALIGN);
    return st;
}

static td_status alloc_activations(td_trainer *t)
{
    td_status st = TD_OK;
    td_arena_stats as;
    td_arena_get_stats(t->arena, &as);
    td_act_plan p;
    td_state_bytes sb = td_train_state_of(t->mm);
    td_train_plan_activations(&t->cfg, as.budget_bytes, &sb, &p);
    t->ckpt_blocks = p.ckpt_blocks;
    t->acts_bytes = p.bytes[1] / (size_t)((p.ckpt_blocks > 0) + t->cfg.model.n_layer - p.ckpt_blocks);
    t->scratch_bytes = p.bytes[10];
    t->loss_rows = td_train_loss_rows(&t->cfg);
    t->want_row = -1;
    void *dst[ACT_BUFFERS] = {&t->resid, &t->acts, &t->lnf, &t->lnf_mean, &t->lnf_rstd, &t->logits, &t->losses,
                              &t->lse, &t->dres[0], &t->dres[1], &t->scratch, &t->tokens, &t->targets,
                              &t->positions, &t->workspace};
    for (int i = 0; i < p.n; i++)
        if (p.bytes[i]) TD_TRY(take(t, p.bytes[i], p.role[i], dst[i]));
    size_t N = N_of(t);
    TD_TRY(td_hostpool_alloc(t->pool, N * sizeof(int32_t), TD_ROLE_STAGING, (void **)&t->h_tokens));
    TD_TRY(td_hostpool_alloc(t->pool, N * sizeof(int32_t), TD_ROLE_STAGING, (void **)&t->h_targets));
    TD_TRY(td_hostpool_alloc(t->pool, N * sizeof(float), TD_ROLE_STAGING, (void **)&t->h_losses));
    TD_TRY(td_hostpool_alloc(t->pool, (size_t)t->cfg.model.padded_vocab_size * sizeof(float), TD_ROLE_STAGING,
                             &t->h_row));
    TD_TRY(td_hostpool_alloc(t->pool, N * sizeof(int32_t), TD_ROLE_STAGING, (void **)&t->h_positions));
    if (t->cfg.grad_accum > 1) {
        t->batches = td_malloc((size_t)t->cfg.grad_accum * 3 * N * sizeof(int32_t), TD_ROLE_META);
        if (!t->batches) TD_FAIL(TD_ERR_NOMEM, "out of memory for %d micro-batches of %zu tokens", t->cfg.grad_accum, N);
    }
cleanup:
    if (st == TD_ERR_BUDGET) {
        char need[32], budget[32];
        td_error_prefix(st, "activations for --micro-batch %d --seq %d need %s%s of the %s budget and do not fit: ",
                        t->cfg.micro_batch, t->cfg.seq_len, td_format_bytes(p.total, need, sizeof need),
                        t->ckpt_blocks ? " (checkpointed)" : "", td_format_bytes(as.budget_bytes, budget, sizeof budget));
    }
    return st;
}

/* The model family's compute on this backend and what its calls share:
 * the shape, the scratch, the stream, and its constants, uploaded once to
 * the workspace after cuBLASLt's (footprint.c sized it). */
static td_status setup_model_exec(td_trainer *t)
{
    td_status st = TD_OK;
    void *host = NULL;
    const td_model_desc *mc = &t->cfg.model;
    t->exec = td_model_exec_of(mc, on_cuda(t));
    if (!t->exec)
        return td_error_set(TD_ERR_UNSUPPORTED, "the %s model family has no CUDA compute in this build; use "
                            "--backend cpu", td_model_family_name(td_model_family_of(mc)));
    t->run = (td_model_run){.desc = &t->cfg.model, .B = t->cfg.micro_batch, .T = t->cfg.seq_len, .dt = t->dt,
                            .gdt = t->gdt, .ops = t->ops_cuda,
                            .stream = td_backend_native_queue(t->backend, TD_QUEUE_COMPUTE),
                            .scratch = t->scratch, .scratch_bytes = t->scratch_bytes};
    size_t bytes = t->exec->consts_bytes(mc);
    if (!bytes) return TD_OK;
    char *consts = (char *)t->workspace + td_train_cublas_workspace_bytes(&t->cfg);
    if (!(host = td_malloc(bytes, TD_ROLE_META))) return td_error_set(TD_ERR_NOMEM, "the model's constants");
    t->exec->consts_fill(mc, host);
    TD_TRY(td_backend_copy_async(t->backend, TD_QUEUE_COMPUTE, consts, host, bytes));
    TD_TRY(td_queue_sync(t->backend, TD_QUEUE_COMPUTE)); /* host is freed below */
    t->run.consts = consts;
cleanup:
    td_free(host);
    return st;
}

/* Ranks on one host near the same NUMA node(s) (every rank on the cpu
 * backend, GPUs behind one socket) split those nodes' cores: each AdamW
 * team gets its own share (topo.h), its memory stays on the nodes. */
static td_status share_cores(td_trainer *t)
{
    char host[256] = "", nodes[64] = "";
    gethostname(host, sizeof host - 1);
    td_topo_nodes_string(t->topo, nodes, sizeof nodes);
    uint64_t mine = 1469598103934665603ull; /* FNV-1a of host and nodes */
    for (const char *s = host; *s; s++) mine = (mine ^ (unsigned char)*s) * 1099511628211ull;
    mine = (mine ^ '/') * 1099511628211ull;
    for (const char *s = nodes; *s; s++) mine = (mine ^ (unsigned char)*s) * 1099511628211ull;
    mine = (mine ^ (uint64_t)(t->node_rank + 1)) * 1099511628211ull; /* hosts the launcher tells apart */
    t->host_id = mine;
    uint64_t *all = td_malloc((size_t)t->ranks * sizeof *all, TD_ROLE_META);
    if (!all) return TD_ERR_NOMEM;
    td_status st = td_comm_host_allgather(t->comm, &mine, sizeof mine, all);
    int index = 0, count = 0;
    for (int r = 0; !st && r < t->ranks; r++)
        if (all[r] == mine) index += r < t->rank, count++;
    td_free(all);
    return st ? st : td_topo_share(t->topo, index, count);
}

/* Every rank's value in v replaced by the largest (max) or smallest over the ranks. */
static td_status agree_size(td_trainer *t, size_t *v, int max)
{
    uint64_t mine = *v, *all = td_malloc((size_t)t->ranks * sizeof *all, TD_ROLE_META);
    if (!all) return TD_ERR_NOMEM;
    td_status st = td_comm_host_allgather(t->comm, &mine, sizeof mine, all);
    for (int r = 0; !st && r < t->ranks; r++)
        if (max ? all[r] > *v : all[r] < *v) *v = (size_t)all[r];
    td_free(all);
    return st;
}

/* The communicators' own device memory (NCCL's buffers, which NCCL
 * allocates itself, partly at the first collectives): the device's free
 * memory before the first joined (free0) less after a gather, a
 * reduce-scatter and an all-reduce of small and large counts on each, on
 * the two copy queues, where the chunk manager runs them.  The largest
 * over the ranks, so every rank's arena has the same budget (the ranks
 * must make the same eviction decisions). */
static td_status measure_comm_bytes(td_trainer *t, size_t free0, size_t *out)
{
    td_status st = TD_OK;
    td_arena *a = NULL;
    void *buf = NULL;
    size_t counts[2] = {256, (size_t)4 << 20}, E = 2, free1 = 0, total = 0;
    *out = 0;
    if (td_backend_get_kind(t->backend) != TD_BACKEND_CUDA) return TD_OK;
    size_t bytes = counts[1] * (size_t)t->ranks * E;
    TD_TRY(td_arena_create(t->backend, bytes + TD_ARENA_ALIGN, &a));
    TD_TRY(td_arena_alloc(a, bytes, TD_ROLE_COMM, &buf));
    TD_TRY(td_backend_memset_async(t->backend, TD_QUEUE_COMPUTE, buf, 0, bytes));
    TD_TRY(td_queue_sync(t->backend, TD_QUEUE_COMPUTE));
    /* every communicator that runs collectives on the device, each kind of
     * collective on each copy queue (NCCL connects them as first used) */
    td_comm *comms[3] = {t->scomm, t->xcomm, t->rcomm};
    for (int c = 0; c < 3; c++) {
        if (!comms[c]) continue;
        int size = td_comm_size(comms[c]), me = td_comm_rank(comms[c]);
        for (int q = TD_QUEUE_H2D; q <= TD_QUEUE_D2H; q++)
            for (int i = 0; i < 2; i++) {
                char *mine = (char *)buf + (size_t)me * counts[i] * E;
                TD_TRY(td_comm_all_gather(comms[c], mine, buf, counts[i], TD_DTYPE_BF16, (td_queue)q));
                TD_TRY(td_comm_reduce_scatter(comms[c], buf, mine, counts[i], TD_DTYPE_BF16, (td_queue)q));
                TD_TRY(td_comm_all_reduce(comms[c], buf, buf, counts[i] * (size_t)size, TD_DTYPE_BF16, TD_REDUCE_SUM,
                                          (td_queue)q));
                TD_TRY(td_comm_wait(comms[c], (td_queue)q));
            }
    }
    td_arena_release(a, buf);
    buf = NULL;
    td_arena_destroy(a);
    a = NULL;
    TD_TRY(td_backend_mem_info(t->backend, &free1, &total));
    *out = free0 > free1 ? free0 - free1 : 0;
    TD_TRY(agree_size(t, out, 1));
cleanup:
    if (buf) td_arena_release(a, buf);
    td_arena_destroy(a);
    return st;
}

/* Milliseconds since *mark, which moves to now. */
static double lap(double *mark)
{
    double now = td_now_ms(), ms = now - *mark;
    *mark = now;
    return ms;
}

td_status td_trainer_create(const td_train_config *cfg, td_trainer **out)
{
    td_status st = TD_OK;
    *out = NULL;
    if ((st = td_train_config_check(cfg))) return st;
    td_trainer *t = td_calloc(1, sizeof *t, TD_ROLE_META);
    if (!t) return TD_ERR_NOMEM;
    const double t0 = td_now_ms();
    double mark = t0;
    t->cfg = *cfg;
    *out = t; /* destroy frees whatever was taken if a later step fails */
    t->ranks = cfg->ranks > 1 ? cfg->ranks : 1;
    t->rank = t->ranks > 1 ? cfg->rank : 0;
    if (t->ranks > 1 && (!cfg->dist || cfg->dist->size != cfg->ranks || cfg->dist->rank != cfg->rank))
        TD_FAIL(TD_ERR_INVALID, "rank %d of %d ranks: td_train_config.dist must describe that job", cfg->rank,
                cfg->ranks);
    td_backend_params bp = td_train_backend_params(cfg);
    if (t->ranks > 1) bp.cuda_device = cfg->dist->local_rank; /* rank r: GPU LOCAL_RANK */
    TD_TRY(td_backend_create(&bp, &t->backend));
    if (td_backend_get_kind(t->backend) == TD_BACKEND_CUDA) { /* what the process takes beyond its context, from here */
        size_t total = 0;
        TD_TRY(td_backend_mem_info(t->backend, &t->dev_free0, &total));
    }
    size_t comm_heap = 0; /* the communicator's part of the libraries' heap (the plan's NCCL allowance) */
    if (t->ranks > 1) { /* join the job, and refuse disagreeing ranks before anything is allocated */
        comm_heap = td_train_library_heap();
        td_comm_params cp = td_comm_default_params();
        if (cfg->comm_timeout_ms > 0) cp.timeout_ms = cfg->comm_timeout_ms;
        TD_TRY(td_comm_create(cfg->dist, t->backend, &cp, &t->comm));
        if (cfg->n_agree) TD_TRY(td_comm_agree(t->comm, cfg->agree, cfg->n_agree));
        t->node_rank = cfg->dist->node_rank;
        if (t->cfg.shard == TD_SHARD_AUTO) { /* NODE only where every host holds the state (hosts differ) */
            TD_TRY(td_train_resolve_shard(&t->cfg));
            size_t node = t->cfg.shard == TD_SHARD_NODE;
            TD_TRY(agree_size(t, &node, 0));
            t->cfg.shard = node ? TD_SHARD_NODE : TD_SHARD_WORLD;
        }
        cfg = &t->cfg;
        t->shard_ranks = td_train_shard_ranks(cfg);
        t->shard_rank = td_train_shard_rank(cfg);
        t->replica_rank = t->rank / t->shard_ranks;
        t->scomm = t->comm;
        if (t->shard_ranks < t->ranks) TD_TRY(split_groups(t));
        if (t->shard_ranks > 1 && cfg->reduce_comm == TD_REDUCE_COMM_OWN) /* every rank of scomm, in its order */
            TD_TRY(td_comm_split(t->scomm, 0, t->shard_rank, &t->rcomm));
        /* NCCL's buffers come out of the budget, as measured (the plan's figure otherwise) */
        TD_TRY(measure_comm_bytes(t, t->dev_free0, &t->cfg.comm_device_bytes));
        size_t after = td_train_library_heap();
        comm_heap = after > comm_heap ? after - comm_heap : 0;
    }
    t->cfg.dist = NULL; /* the caller's, used only here */
    t->cfg.agree = NULL;
    t->cfg.n_agree = 0;
    t->cfg.backend = td_backend_get_kind(t->backend); /* AUTO resolved: the plan below sizes for it */
    cfg = &t->cfg;
    if (t->cfg.backend == TD_BACKEND_CPU && cfg->precision != TD_DTYPE_F32)
        TD_FAIL(TD_ERR_UNSUPPORTED, "--precision %s needs the cuda backend; the cpu backend trains in fp32",
                td_dtype_name(cfg->precision));
    t->dt = t->gdt = cfg->precision;
    TD_TRY(td_topo_create(t->backend, &t->topo));
    if (!t->cfg.library_heap_bytes) { /* as `tidal plan` measures it: backend and topology made, no communicator */
        size_t lib = td_train_library_heap();
        t->cfg.library_heap_bytes = lib > comm_heap ? lib - comm_heap : 0;
        if (t->ranks > 1) TD_TRY(agree_size(t, &t->cfg.library_heap_bytes, 1)); /* one plan for every rank */
    }
    if (t->ranks > 1) {
        TD_TRY(share_cores(t));
        /* Unless --threads says otherwise, a rank's ops run on its share of
         * the cores; its AdamW team takes them all but one when the AdamW
         * thread runs, and the one left drives the GPU (td_train_adam_threads). */
    }
    omp_set_num_threads(cfg->threads > 0 ? cfg->threads : t->ranks > 1 ? td_topo_local_cores(t->topo)
                                                                     : td_train_default_threads(t->topo, NULL, 0));
    TD_TRY(td_hostmem_create(t->topo, &t->hostmem)); /* on the AdamW team's node(s) */
    td_hostpool_params hp = td_hostpool_default_params();
    hp.pin_limit_bytes = cfg->host_pin_limit;
    TD_TRY(td_train_budget_resolve(cfg, t->backend, TD_BUDGET_USE_RUN, &t->budget));
    if (t->ranks > 1 && t->budget.origin != TD_BUDGET_GIVEN) /* one budget for every rank: they must make the same decisions */
        TD_TRY(agree_size(t, &t->budget.budget_bytes, 0));
    t->cfg.gpu_budget = t->budget.budget_bytes;
    TD_TRY(td_train_resolve_grad_slots(&t->cfg, cfg->gpu_budget)); /* the plan's choices, for the layout */
    TD_TRY(td_train_resolve_chunks(&t->cfg, cfg->gpu_budget));
    td_train_plan plan;
    TD_TRY(td_train_plan_make(cfg, cfg->gpu_budget, &plan));
    if (t->ranks > 1) { /* every rank places the optimizer alike (the chunks' accesses must be every rank's) */
        size_t gpu = (size_t)plan.optim_gpu_chunks;
        TD_TRY(agree_size(t, &gpu, 0));
        plan.optim_gpu_chunks = (int)gpu;
    }
    /* Refuse up front what cannot work, saying what would. */
    {
        size_t ram = 0, limit = 0;
        char need[32], lim[32], r[32], rb[32], src[256];
        TD_TRY(td_train_host_limits(cfg, &ram, &limit, src, sizeof src));
        hp.pin_limit_bytes = limit;
        if (plan.host_pinned_bytes > limit && plan.host_pinned_bytes <= ram) /* more than the RAM: the check below */
            TD_FAIL(TD_ERR_PIN, "the run pins %s of host memory (params, grads and staging in %d slab%s; `tidal plan` "
                    "shows host.pinned_bytes) and the pin limit is %s = %zu bytes (--host-pin-limit; default 80%% of the %s "
                    "RAM); raise --host-pin-limit to at least %zu bytes or use a smaller model or batch",
                    td_format_bytes(plan.host_pinned_bytes, need, sizeof need), plan.host_slabs,
                    plan.host_slabs == 1 ? "" : "s", td_format_bytes(limit, lim, sizeof lim), limit,
                    td_format_bytes(ram, r, sizeof r), plan.host_pinned_bytes);
        char more[96] = ""; /* grads and params that followed the state to disk */
        if (plan.disk_grad_chunks || plan.disk_param_chunks)
            snprintf(more, sizeof more, ", and %d grad and %d param chunks there", plan.disk_grad_chunks,
                     plan.disk_param_chunks);
        if (plan.host_bytes > ram)
            TD_FAIL(TD_ERR_NOMEM, "the run needs %s of host memory (%s pinned, %s pageable%s%s; `tidal plan` shows the "
                    "breakdown) and the host has %s (%s); %suse --optim-state bf16 or int8, a smaller model or batch, "
                    "or give --host-ram if the figure is wrong",
                    td_format_bytes(plan.host_bytes, need, sizeof need),
                    td_format_bytes(plan.host_pinned_bytes, lim, sizeof lim),
                    td_format_bytes(plan.host_pageable_bytes, r, sizeof r),
                    plan.disk_chunks ? ", with the CPU AdamW's whole optimizer state on disk" : "",
                    plan.disk_chunks ? more : "", td_format_bytes(ram, rb, sizeof rb), src,
                    cfg->mm.n_disk_dirs ? "" : "give --offload-dir DIR to keep optimizer state on a local disk, or ");
        if (plan.disk_chunks && !plan.disk_fits)
            TD_FAIL(TD_ERR_IO, "the disk tier needs %s of disk for %d optimizer chunks%s, and --offload-dir has %s free; "
                    "free space there, add another --offload-dir on a second drive, or keep more in RAM (--host-ram, "
                    "--optim-state bf16 or int8)", td_format_bytes(plan.disk_bytes, need, sizeof need), plan.disk_chunks,
                    more, td_format_bytes(plan.disk_free_bytes, lim, sizeof lim));
        size_t min = cfg->mm.placement == TD_PLACEMENT_CUDA ? plan.full_device_bytes : plan.min_device_bytes;
        if (cfg->gpu_budget < min)
            TD_FAIL(TD_ERR_BUDGET, "--gpu-budget %s%s is below the minimum of %s for this model, batch and --policy %s "
                    "(`tidal plan` shows the breakdown); %s or lower --micro-batch or --seq%s",
                    td_format_bytes(cfg->gpu_budget, need, sizeof need),
                    t->budget.origin == TD_BUDGET_GIVEN ? "" : " (all the free device memory less the margin)",
                    td_format_bytes(min, lim, sizeof lim), td_placement_name(cfg->mm.placement),
                    t->budget.origin == TD_BUDGET_GIVEN ? "raise the budget" : "free the device",
                    plan.ckpt ? "" : ", or use --ckpt on");
    }
    hp.slab_bytes = plan.host_slab_bytes; /* as planned: the plan's pinned bytes are exact */
    TD_TRY(td_hostpool_create(t->backend, t->topo, &hp, &t->pool));
    {
        size_t comm = td_train_comm_device_bytes(cfg);
        if (comm >= cfg->gpu_budget) {
            char a[32], b[32];
            TD_FAIL(TD_ERR_BUDGET, "--gpu-budget %s leaves nothing beside the communicator's %s of device memory "
                    "(NCCL's buffers, measured); raise the budget", td_format_bytes(cfg->gpu_budget, a, sizeof a),
                    td_format_bytes(comm, b, sizeof b));
        }
        TD_TRY(td_arena_create(t->backend, cfg->gpu_budget - comm, &t->arena)); /* the rest of the budget */
    }
    TD_TRY(td_copy_engine_create(t->backend, NULL, &t->engine));
    td_memmgr_params mp = td_train_chunk_params(cfg);
    mp.hostmem = t->hostmem;
    if (t->ranks > 1)
        mp.shard_comm = (td_memmgr_comm){ .ctx = t, .all_gather = mm_all_gather, .reduce_scatter = mm_reduce_scatter,
                                          .agree_max = mm_agree_max, .wait = mm_wait };
    TD_TRY(td_memmgr_create(t->arena, t->pool, t->engine, &mp, &t->mm));
    t->setup.backend_ms = lap(&mark);
    TD_TRY(register_tensors(t));
    /* host-homed state: pageable (memmgr.h); the disk tier's on disk */
    TD_TRY(td_train_place_optimizer(t, &plan));
    TD_TRY(td_memmgr_layout(t->mm));
    t->setup.pin_ms = lap(&mark);
    TD_TRY(td_train_first_touch(t->mm, cfg, t->topo));
    TD_TRY(td_train_decay_setup(t));
    t->setup.touch_ms = lap(&mark);
    TD_TRY(init_state(t));
    t->setup.init_ms = lap(&mark);
    TD_TRY(alloc_activations(t));
#ifdef TD_HAVE_CUDA
    if (t->cfg.backend == TD_BACKEND_CUDA) {
        td_ops_cuda_params op = td_ops_cuda_default_params();
        op.workspace = t->workspace;
        op.workspace_bytes = TD_OPS_CUDA_WORKSPACE_BYTES;
        td_ops_cuda *ctx = NULL;
        TD_TRY(td_ops_cuda_create(&op, &ctx));
        t->ops_cuda = ctx;
    }
#endif
    TD_TRY(setup_model_exec(t));
    td_adam_cpu_params ap = td_adam_cpu_default_params();
    ap.threads = td_train_adam_threads(cfg, t->topo);
    ap.topo = t->topo;
    TD_TRY(td_adam_cpu_create(&ap, &t->adam));
    t->adam_main = t->adam;
    t->main_core = -1;
    if (td_train_adam_overlap(cfg)) {
        TD_TRY(td_adam_cpu_create(&ap, &t->adam_main)); /* the driving thread's own team */
        int chunks = td_memmgr_role_chunk_count(t->mm, TD_TENSOR_PARAM);
        t->jobs = td_calloc((size_t)chunks, sizeof *t->jobs, TD_ROLE_META);
        t->ov_left = td_calloc((size_t)chunks, sizeof *t->ov_left, TD_ROLE_META);
        if (!t->jobs || !t->ov_left) TD_FAIL(TD_ERR_NOMEM, "out of memory for the AdamW thread's %d jobs", chunks);
        TD_TRY(td_adam_worker_create(chunks, adam_job, adam_drop, t, &t->worker));
        td_adam_worker_set_ready(t->worker, adam_ready);
        /* The core past the AdamW team's (it binds thread i to core i) drives the GPU. */
        if (ap.threads < td_topo_local_cores(t->topo)) t->main_core = ap.threads;
    }
    TD_TRY(setup_optimizer(t));
    TD_TRY(td_optim_init(&t->optim, &cfg->optim));
    TD_TRY(set_disk_order(t));
    td_host_usage hu;
    TD_TRY(td_trainer_host_usage(t, &hu)); /* the footprint's first sample */
    t->setup.rest_ms = lap(&mark);
    t->setup.total_ms = mark - t0;
    return TD_OK;
cleanup:
    td_trainer_destroy(t);
    *out = NULL;
    return st;
}

void td_trainer_destroy(td_trainer *t)
{
    if (!t) return;
    td_adam_worker_destroy(t->worker); /* its job running done first: it reads what is freed below */
    if (t->adam_main != t->adam) td_adam_cpu_destroy(t->adam_main);
    td_adam_cpu_destroy(t->adam);
#ifdef TD_HAVE_CUDA
    td_ops_cuda_free(t->ops_cuda);
#endif
    if (t->pool) {
        td_hostpool_release(t->pool, t->h_tokens);
        td_hostpool_release(t->pool, t->h_targets);
        td_hostpool_release(t->pool, t->h_losses);
        td_hostpool_release(t->pool, t->h_row);
        td_hostpool_release(t->pool, t->h_positions);
        td_hostpool_release(t->pool, t->h_sumsq);
    }
    td_memmgr_destroy(t->mm); /* gives back the activations with the arena below */
    td_copy_engine_destroy(t->engine);
    td_arena_destroy(t->arena);
    td_hostpool_destroy(t->pool);
    td_hostmem_destroy(t->hostmem);
    td_topo_destroy(t->topo);
    td_comm_destroy(t->rcomm);
    td_comm_destroy(t->xcomm);
    if (t->scomm != t->comm) td_comm_destroy(t->scomm);
    td_comm_destroy(t->comm);
    td_backend_free(t->backend);
    td_free(t->pid);
    td_free(t->gid_live);
    td_free(t->batches);
    td_free(t->group);
    td_free(t->group_start);
    td_free(t->gids_scratch);
    td_free(t->ptrs);
    td_free(t->optim_on_gpu);
    td_free(t->optim_on_disk);
    td_free(t->rs_left);
    td_free(t->sumsq_all);
    td_free(t->jobs);
    td_free(t->ov_left);
    td_train_decay_free(t);
    td_free(t);
}

/* ---- one micro-batch -------------------------------------------------------- */

/* Block l's tensors of one role, in model order (the model's family
 * decides how many: nb_of). */
static int nb_of(const td_trainer *t) { return td_model_block_tensor_count(&t->cfg.model); }
static void block_ids(const td_trainer *t, const int *role_ids, int l, int out[TD_MODEL_BLOCK_TENSORS])
{
    int nb = nb_of(t), ne = td_model_embed_tensor_count(&t->cfg.model);
    for (int k = 0; k < nb; k++) out[k] = role_ids[ne + l * nb + k];
}

/* Blocks [0, ckpt_blocks) share the first buffer; each later block has its own. */
static void *block_acts(td_trainer *t, int l)
{
    int nck = t->ckpt_blocks;
    size_t i = l < nck ? 0 : (size_t)(l - nck) + (nck > 0);
    return t->acts + i * t->acts_bytes;
}
static void *resid_at(td_trainer *t, int l) { return t->resid + (size_t)l * N_of(t) * (size_t)t->cfg.model.n_embd * E_of(t); }

/* ---- the deferred optimizer updates ------------------------------------------ */

static td_status update_host(td_trainer *t, int k, const td_adam_coeffs *c, int stats);
static int chunk_on_gpu(const td_trainer *t, int k);

/* The pending AdamW of param chunks up to role index `upto`; when the last
 * is done, the grads are consumed (FREE) and nothing is pending. */
static td_status take_back(td_trainer *t, int k);
static td_status take_back_all(td_trainer *t);
static td_status hand_over_begin(td_trainer *t);
static td_status hand_over_finished(td_trainer *t, const int *gids, int n);
static td_status catch_up(td_trainer *t, int upto)
{
    if (!t->pending_end) return TD_OK;
    for (; t->pending_next <= upto && t->pending_next < t->pending_end; t->pending_next++) {
        td_status st = TD_OK;
        if (chunk_on_gpu(t, t->pending_next)) continue; /* updated on the device */
        st = t->worker ? take_back(t, t->pending_next) : update_host(t, t->pending_next, &t->pending_coeffs, 0);
        if (st) return st;
    }
    /* The AdamW thread's updates already done, beyond: recorded now, so the
     * prefetcher loads their new params, not the old. */
    for (; t->worker && t->ranks == 1 && t->pending_next < t->pending_end; t->pending_next++) {
        int k = t->pending_next;
        if (chunk_on_gpu(t, k)) continue;
        if (!td_adam_worker_finished(t->worker, k)) break;
        td_status st = take_back(t, k);
        if (st) return st;
    }
    if (t->pending_next < t->pending_end) return TD_OK;
    t->pending_end = 0;
    return td_memmgr_set_state(t->mm, t->gid_live, t->n_live, TD_TENSOR_FREE);
}

/* The same for the chunks holding these param ids and the next CATCH_AHEAD
 * (param chunks are in model order, so everything before them is updated
 * too): the prefetcher, which loads chunks ahead of their use, then finds
 * their new params already written. */
enum { CATCH_AHEAD = 2 };
static td_status catch_up_ids(td_trainer *t, const int *ids, int n)
{
    if (!t->pending_end) return TD_OK;
    int first = td_memmgr_role_chunk(t->mm, TD_TENSOR_PARAM, 0), upto = -1;
    for (int i = 0; i < n; i++) {
        int c = td_memmgr_tensor_chunk(t->mm, ids[i]);
        if (td_memmgr_chunk_role(t->mm, c) != TD_TENSOR_PARAM) continue; /* frozen: nothing updates it */
        int k = c - first;
        if (k > upto) upto = k;
    }
    int from = t->pending_next;
    double t0 = td_now_ms();
    td_status st = catch_up(t, upto + (t->worker ? 0 : CATCH_AHEAD));
    double t1 = td_now_ms();
    /* on the timeline, where the host spent a while here (waits for the
     * AdamW, gathers, host copies marked new) */
    if (!st && t1 - t0 >= 0.05)
        st = td_memmgr_timeline_host(t->mm, "driving thread", t0, t1, "catch-up from chunk %d: %d chunks", from,
                                     t->pending_next - from); /* pending_next stays at the end when all are done */
    return st;
}

int td_trainer_updates_pending(td_trainer *t)
{
    int chunks = td_memmgr_role_chunk_count(t->mm, TD_TENSOR_PARAM), n = 0;
    for (int k = 0; k < chunks; k++) {
        int deferred = t->pending_end && k >= t->pending_next && k < t->pending_end && !chunk_on_gpu(t, k);
        n += deferred || (t->worker && td_adam_worker_pending(t->worker, k));
    }
    return n;
}

td_status td_trainer_finish_update(td_trainer *t)
{
    td_status st = catch_up(t, INT_MAX);
    /* and whatever the AdamW thread still holds (a step that failed after handing chunks over) */
    if (!st && t->worker) st = take_back_all(t);
    /* ZeRO-3: the collectives in flight done (bounded) before the host reads a save */
    return st || !t->comm ? st : compute_sync(t);
}

/* ---- the model ops, on whichever backend runs them ---------------------------- */

/* The model's block, head and embedding run through its family's exec
 * (family.h): the CPU reference on the cpu backend, the CUDA ops on cuda.
 * The loss is the trainer's, the same for every family. */

static td_status zero(td_trainer *t, void *dev, size_t bytes)
{
    return td_backend_memset_async(t->backend, TD_QUEUE_COMPUTE, dev, 0, bytes);
}

/* Rows [r0, r0 + n) of the losses from their logits (the chunk buffer);
 * with train, the logits become dlogits (scaled by dloss). */
static td_status op_loss(td_trainer *t, size_t r0, int n, double dloss, int train)
{
    const td_model_desc *mc = &t->cfg.model;
    int V = mc->vocab_size, Vp = mc->padded_vocab_size;
    float *losses = t->losses + r0, *lse = t->lse + r0;
    const int32_t *targets = t->targets + r0;
#ifdef TD_HAVE_CUDA
    if (on_cuda(t)) {
        if (train)
            return td_ops_cuda_crossentropy_fused(losses, lse, t->logits, targets, (float)dloss, n, V, Vp, t->dt,
                                                  stream_of(t));
        return td_ops_cuda_crossentropy_forward(losses, lse, t->logits, targets, n, V, Vp, t->dt, stream_of(t));
    }
#endif
    td_ops_crossentropy_forward(losses, lse, t->logits, targets, n, V, Vp);
    if (train) td_ops_crossentropy_backward(t->logits, t->logits, lse, targets, (float)dloss, n, V, Vp);
    return TD_OK;
}

/* The head and the loss over chunks of t->loss_rows rows: for each, the
 * final norm and the logits (the family's head on those rows), the losses,
 * and with train at once the backward from its dlogits: dx's rows (zeroed
 * first) and g +=.  Only one chunk's logits exist at a time; every row's
 * arithmetic is the whole batch's (rows are independent, and the gradients
 * of the head's weights add chunk after chunk in row order).  The logits of
 * row t->want_row (>= 0) go to h_row on the compute queue. */
static td_status op_head(td_trainer *t, void *const p[3], void *const g[3], const void *x, void *dx, double dloss,
                         int train)
{
    const size_t N = N_of(t), C = (size_t)t->cfg.model.n_embd, E = E_of(t);
    const size_t Vp = (size_t)t->cfg.model.padded_vocab_size, V = (size_t)t->cfg.model.vocab_size;
    if (train) {
        td_status st = zero(t, dx, N * C * E);
        if (st) return st;
    }
    for (size_t r0 = 0; r0 < N; r0 += (size_t)t->loss_rows) {
        int n = (int)(N - r0 < (size_t)t->loss_rows ? N - r0 : (size_t)t->loss_rows);
        td_model_run run = t->run; /* the head's arithmetic is per row: one sequence of n rows */
        run.B = 1;
        run.T = n;
        td_model_head_acts h = {t->lnf, t->lnf_mean, t->lnf_rstd};
        const char *xr = (const char *)x + r0 * C * E;
        td_status st = t->exec->head_forward(&run, p, xr, t->logits, &h);
        if (!st) st = op_loss(t, r0, n, dloss, train);
        if (!st && t->want_row >= 0 && (size_t)t->want_row >= r0 && (size_t)t->want_row < r0 + (size_t)n)
            st = td_backend_copy_async(t->backend, TD_QUEUE_COMPUTE, t->h_row,
                                       (char *)t->logits + ((size_t)t->want_row - r0) * Vp * E, V * E);
        if (!st && train) st = t->exec->head_backward(&run, p, g, xr, t->logits, &h, (char *)dx + r0 * C * E);
        if (st) return st;
    }
    return TD_OK;
}

/* Start the grads of the host's optimizer chunks for the host (the GPU
 * chunks' grads stay on the device).  ZeRO-3: each chunk once its grads are
 * whole (reduce_finished_grads). */
static td_status writeback_host_grads(td_trainer *t, const int *gids, int n)
{
    if (t->ranks > 1) return TD_OK;
    int keep[TD_MODEL_BLOCK_TENSORS], m = 0;
    int first = td_memmgr_role_chunk(t->mm, TD_TENSOR_GRAD, 0);
    for (int i = 0; i < n && m < TD_MODEL_BLOCK_TENSORS; i++)
        if (!chunk_on_gpu(t, td_memmgr_tensor_chunk(t->mm, gids[i]) - first)) keep[m++] = gids[i];
    return m ? td_memmgr_writeback_async(t->mm, keep, m) : TD_OK;
}

/* ---- ZeRO-3: the collectives of a chunk ------------------------------------------ */

static td_status access_chunk(td_trainer *t, const int *role_ids, int k, unsigned flags, void **base);
static td_status release_chunk(td_trainer *t, const int *role_ids, int k, td_tensor_state to);

static int param_chunk_of(const td_trainer *t, int id, td_tensor_role role)
{
    return td_memmgr_tensor_chunk(t->mm, id) - td_memmgr_role_chunk(t->mm, role, 0);
}

/* The last micro-batch's grads of param chunk k are complete: every
 * rank's are summed, each rank keeping its shard of the sum, the mean over
 * the global batch (each rank's loss was weighted 1/(ranks x rows x
 * accum)).  The chunk manager reduce-scatters the chunk in place on the
 * D2H queue after the kernels that wrote it, so the backward of the next
 * blocks goes on beside it: for a host chunk as the first step of its
 * shard's write-back, for a GPU AdamW's chunk alone (its grads stay). */
static td_status reduce_grad_chunk(td_trainer *t, int k)
{
    int n = t->group_start[k + 1] - t->group_start[k];
    for (int j = 0; j < n; j++) t->gids_scratch[j] = t->gid[t->group[t->group_start[k] + j]];
    if (chunk_on_gpu(t, k)) return td_memmgr_reduce_async(t->mm, t->gids_scratch, n);
    return td_memmgr_writeback_async(t->mm, t->gids_scratch, n);
}

/* Counts down the grads the last micro-batch finished (gids, just released
 * READY_FOR_REDUCE); a chunk whose grads are all done is reduced now, in the
 * order the backward finishes them, which is every rank's. */
static td_status reduce_finished_grads(td_trainer *t, const int *gids, int n)
{
    if (t->ranks == 1) return TD_OK;
    for (int i = 0; i < n; i++) {
        int k = param_chunk_of(t, gids[i], TD_TENSOR_GRAD);
        if (--t->rs_left[k] == 0) {
            td_status st = reduce_grad_chunk(t, k);
            if (st) return st;
        }
    }
    return TD_OK;
}

/* Before a step's last micro-batch: every grad tensor of each chunk still to finish. */
static void reduce_begin(td_trainer *t)
{
    if (t->ranks == 1) return;
    int chunks = td_memmgr_role_chunk_count(t->mm, TD_TENSOR_PARAM);
    for (int k = 0; k < chunks; k++) t->rs_left[k] = t->group_start[k + 1] - t->group_start[k];
}

/* Every rank's `n` doubles summed in rank order (the same bits on every
 * rank): over the job, or with `shard` over the shard group (each of its
 * ranks' shards summed once; the other hosts' replicas hold the same). */
static td_status sum_over_ranks(td_trainer *t, double *v, int n, int shard)
{
    if (t->ranks == 1) return TD_OK;
    td_comm *c = shard ? t->scomm : t->comm;
    int ranks = shard ? t->shard_ranks : t->ranks;
    td_status st = td_comm_host_allgather(c, v, (size_t)n * sizeof(double), t->sumsq_all);
    if (st) return st;
    for (int i = 0; i < n; i++) {
        double s = 0;
        for (int r = 0; r < ranks; r++) s += t->sumsq_all[(size_t)r * (size_t)n + (size_t)i];
        v[i] = s;
    }
    return TD_OK;
}

/* The grads of n tensors (gids, -1 where frozen) accessed for writing:
 * g[k] NULL for a frozen one (the family's compute then skips its
 * gradient); live: the others' ids, *m of them. */
static td_status access_grads(td_trainer *t, const int *gids, int n, int *live, int *m, void **g)
{
    void *q[TD_MODEL_BLOCK_TENSORS];
    *m = live_ids(gids, n, live);
    if (*m) {
        td_status st = td_memmgr_access(t->mm, live, *m, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, q);
        if (st) return st;
    }
    for (int k = 0, j = 0; k < n; k++) g[k] = gids[k] >= 0 ? q[j++] : NULL;
    return TD_OK;
}

/* The grads of a micro-batch's part are done (live, m of them): released,
 * and with the last micro-batch reduced, written back and handed over. */
static td_status grads_done(td_trainer *t, const int *live, int m, td_tensor_state to, int last)
{
    td_status st = TD_OK;
    if (!m) return TD_OK;
    TD_TRY(td_memmgr_release(t->mm, live, m, to));
    if (last) TD_TRY(reduce_finished_grads(t, live, m));
    if (last) TD_TRY(writeback_host_grads(t, live, m));
    if (last) TD_TRY(hand_over_finished(t, live, m));
cleanup:
    return st;
}

/* LoRA dropout's key for micro-batch k of the step (training, a dropout
 * above 0; else none): the step the gradients make, and the step-global
 * index of the micro-batch's first sample.  The loader hands rank r rows
 * [r B, (r + 1) B) of each ranks x B of the step's sequences, so a row's
 * index is its place in the global batch: N ranks draw one rank's masks. */
static void lora_drop_set(td_trainer *t, int k, int train)
{
    const int B = t->cfg.micro_batch;
    t->run.lora_drop = NULL;
    if (!train || t->cfg.model.lora.rank <= 0 || !(t->cfg.model.lora.dropout > 0)) return;
    t->lora_drop = (td_model_lora_drop){.seed = t->cfg.seed, .step = (int64_t)t->optim.step + 1,
                                        .sample0 = ((int64_t)k * t->ranks + t->rank) * B, .layer = 0,
                                        .T = t->cfg.seq_len};
    t->run.lora_drop = &t->lora_drop;
}

/* Forward through the blocks and the head with its backward; then the blocks'
 * backward.  `last`: the final micro-batch of the step (grads complete). */
static td_status micro_batch(td_trainer *t, double dloss, int last, int train, double *loss_sum)
{
    td_status st = TD_OK;
    const td_model_desc *mc = &t->cfg.model;
    int L = mc->n_layer, nb = nb_of(t), ne = td_model_embed_tensor_count(mc);
    size_t N = N_of(t);
    td_memmgr *mm = t->mm;
    void *p[TD_MODEL_BLOCK_TENSORS], *g[TD_MODEL_BLOCK_TENSORS];
    int ids[TD_MODEL_BLOCK_TENSORS], gids[TD_MODEL_BLOCK_TENSORS], live[TD_MODEL_BLOCK_TENSORS], m;
    td_tensor_state grad_done = last ? TD_TENSOR_READY_FOR_REDUCE : TD_TENSOR_HOLD_AFTER_BWD;
    if (last && train) reduce_begin(t);
    if (last && train) TD_TRY(hand_over_begin(t));

    TD_TRY(td_backend_copy_async(t->backend, TD_QUEUE_COMPUTE, t->tokens, t->h_tokens, N * sizeof(int32_t)));
    TD_TRY(td_backend_copy_async(t->backend, TD_QUEUE_COMPUTE, t->targets, t->h_targets, N * sizeof(int32_t)));
    if (t->packed)
        TD_TRY(td_backend_copy_async(t->backend, TD_QUEUE_COMPUTE, t->positions, t->h_positions, N * sizeof(int32_t)));
    t->run.pos = t->packed ? t->positions : NULL; /* packed documents: positions restart, attention stays in each */

    /* Embedding: x0 (N,C); wte and (GPT-2) wpe. */
    int emb[TD_MODEL_BLOCK_TENSORS];
    for (int k = 0; k < ne; k++) emb[k] = t->pid[k];
    TD_TRY(td_memmgr_timeline_range(mm, "embedding", 1));
    TD_TRY(catch_up_ids(t, emb, ne));
    TD_TRY(td_memmgr_access(mm, emb, ne, TD_TENSOR_COMPUTE, 0, p));
    TD_TRY(t->exec->embed_forward(&t->run, p, t->tokens, resid_at(t, 0)));
    TD_TRY(td_memmgr_release(mm, emb, ne, TD_TENSOR_HOLD_AFTER_FWD));
    TD_TRY(td_memmgr_timeline_range(mm, NULL, 0));

    for (int l = 0; l < L; l++) {
        char name[32];
        snprintf(name, sizeof name, "block %d forward", l);
        TD_TRY(td_memmgr_timeline_range(mm, name, 1));
        block_ids(t, t->pid, l, ids);
        TD_TRY(catch_up_ids(t, ids, nb));
        TD_TRY(td_memmgr_access(mm, ids, nb, TD_TENSOR_COMPUTE, 0, p));
        t->lora_drop.layer = l;
        TD_TRY(t->exec->block_forward(&t->run, p, block_acts(t, l), resid_at(t, l), resid_at(t, l + 1)));
        TD_TRY(td_memmgr_release(mm, ids, nb, TD_TENSOR_HOLD_AFTER_FWD));
        TD_TRY(td_memmgr_timeline_range(mm, NULL, 0));
    }

    /* Head: the final norm, logits against wte (or lm_head), loss and at
     * once its backward, chunk by chunk of rows (op_head).  The head's tensors are ordered so that a tied wte
     * comes last (td_model_head_tensors). */
    int hi[3], head[3], ghead[3];
    int nh = td_model_head_tensors(mc, hi), tied = hi[nh - 1] == 0;
    for (int k = 0; k < nh; k++) {
        head[k] = t->pid[hi[k]];
        ghead[k] = t->gid[hi[k]];
    }
    TD_TRY(td_memmgr_timeline_range(mm, "head", 1));
    TD_TRY(catch_up(t, INT_MAX)); /* ln_f is the last chunk: nothing stays pending into backward */
    TD_TRY(td_memmgr_access(mm, head, nh, TD_TENSOR_COMPUTE, 0, p));
    if (train) TD_TRY(access_grads(t, ghead, nh, live, &m, g));
    TD_TRY(op_head(t, p, train ? g : NULL, resid_at(t, L), t->dres[0], dloss, train));
    TD_TRY(td_backend_copy_async(t->backend, TD_QUEUE_COMPUTE, t->h_losses, t->losses, N * sizeof(float)));
    TD_TRY(compute_sync(t));
    double sum = 0;
    for (size_t i = 0; i < N; i++) sum += t->h_losses[i];
    *loss_sum += sum;
    if (!train) {
        TD_TRY(td_memmgr_release(mm, head, nh, TD_TENSOR_HOLD));
        TD_TRY(td_memmgr_timeline_range(mm, NULL, 0));
        /* Eval: embedding (what the head did not release) and blocks back to HOLD. */
        TD_TRY(td_memmgr_set_state(mm, emb + tied, ne - tied, TD_TENSOR_HOLD));
        for (int l = 0; l < L; l++) {
            block_ids(t, t->pid, l, ids);
            TD_TRY(td_memmgr_set_state(mm, ids, nb, TD_TENSOR_HOLD));
        }
        return TD_OK;
    }
    TD_TRY(td_memmgr_release(mm, head, nh, TD_TENSOR_HOLD_AFTER_BWD));
    /* A tied wte's grad still takes the embedding's part below. */
    m = live_ids(ghead, nh - tied, live);
    TD_TRY(grads_done(t, live, m, grad_done, last));
    if (tied && ghead[nh - 1] >= 0) TD_TRY(td_memmgr_release(mm, ghead + nh - 1, 1, TD_TENSOR_HOLD_AFTER_BWD));
    TD_TRY(td_memmgr_timeline_range(mm, NULL, 0));

    /* Blocks in reverse. */
    int cur = 0;
    for (int l = L - 1; l >= 0; l--) {
        char name[32];
        snprintf(name, sizeof name, "block %d backward", l);
        TD_TRY(td_memmgr_timeline_range(mm, name, 1));
        block_ids(t, t->pid, l, ids);
        block_ids(t, t->gid, l, gids);
        TD_TRY(td_memmgr_access(mm, ids, nb, TD_TENSOR_COMPUTE, 0, p));
        const void *x = resid_at(t, l);
        void *dy = t->dres[cur], *dxl = t->dres[cur ^ 1];
        t->lora_drop.layer = l; /* the recompute and the backward draw the forward's masks */
        /* Checkpointing: recompute this block's activations from its kept
         * input; its output is not needed (the last projection is skipped). */
        if (l < t->ckpt_blocks) TD_TRY(t->exec->block_forward(&t->run, p, block_acts(t, l), x, NULL));
        /* The grads after the recompute is queued: where their slot is the
         * one the next block's grads are leaving (a write-back in flight),
         * the compute queue waits for it behind the recompute, not before. */
        TD_TRY(access_grads(t, gids, nb, live, &m, g));
        TD_TRY(t->exec->block_backward(&t->run, p, g, block_acts(t, l), x, dy, dxl));
        TD_TRY(td_memmgr_release(mm, ids, nb, TD_TENSOR_HOLD_AFTER_BWD));
        TD_TRY(grads_done(t, live, m, grad_done, last));
        TD_TRY(td_memmgr_timeline_range(mm, NULL, 0));
        cur ^= 1;
    }

    /* Embedding backward: into the grads of wte and (GPT-2) wpe. */
    int gemb[TD_MODEL_BLOCK_TENSORS];
    for (int k = 0; k < ne; k++) gemb[k] = t->gid[k];
    TD_TRY(td_memmgr_timeline_range(mm, "embedding backward", 1));
    TD_TRY(access_grads(t, gemb, ne, live, &m, g));
    if (m) TD_TRY(t->exec->embed_backward(&t->run, g, t->tokens, t->dres[cur])); /* frozen: nothing to take */
    TD_TRY(grads_done(t, live, m, grad_done, last));
    TD_TRY(td_memmgr_timeline_range(mm, NULL, 0));
cleanup:
    return st;
}

/* ---- the optimizer ---------------------------------------------------------- */

/* The step's decision from the global grad stats.  TD_FAULT_NONFINITE_GRAD
 * makes the stats of an armed step non-finite, as a NaN or Inf in any grad
 * would: the tests' way to a bad step without a diverging model. */
static td_status begin_step(td_trainer *t, td_grad_stats *global, td_optim_step *os)
{
    if (td_fault_hit(TD_FAULT_NONFINITE_GRAD)) global->sumsq = NAN;
    return td_optim_begin_step(&t->optim, global, os);
}

#ifdef TD_HAVE_CUDA
#include "tidal/optim_cuda.h"
#endif

/* Whether param chunk k's optimizer lives on the GPU (optim_place.c). */
static int chunk_on_gpu(const td_trainer *t, int k) { return t->optim_on_gpu && t->optim_on_gpu[k]; }
/* Whether its state lives on disk (the disk tier: diskplan.c). */
static int chunk_on_disk(const td_trainer *t, int k)
{
    return t->optim_on_disk && (t->optim_on_disk[k] & TD_TRAIN_DISK_OPTIM);
}

/* The disk tier reads ahead in the order the CPU AdamW takes the chunks:
 * as their grads land in the backward (the last chunk first) when nothing
 * waits for the global norm, else in the next forward's order. */
static int updates_early(const td_trainer *t);
static td_status set_disk_order(td_trainer *t)
{
    if (!t->optim_on_disk) return TD_OK;
    int chunks = td_memmgr_role_chunk_count(t->mm, TD_TENSOR_PARAM), n = 0;
    int *order = td_malloc(((size_t)chunks + 1) * sizeof *order, TD_ROLE_META);
    if (!order) return TD_ERR_NOMEM;
    int early = updates_early(t) && (t->worker || t->ranks == 1);
    for (int i = 0; i < chunks; i++) {
        int k = early ? chunks - 1 - i : i;
        if (chunk_on_disk(t, k)) order[n++] = k;
    }
    td_status st = td_memmgr_disk_set_order(t->mm, order, n);
    td_free(order);
    return st;
}

/* Whether this step's host chunks went to the AdamW thread in the backward
 * with their grad sums (ZeRO-3: of this rank's reduced shard) taken on the
 * device as they went: the grads' host copies may be transient, gone once
 * the AdamW has read them. */
static int early_sums_on_device(const td_trainer *t) { return t->ov_early; }

/* Chunk k of role `role`: access all its tensors, give its base pointer. */
static td_status access_chunk(td_trainer *t, const int *role_ids, int k, unsigned flags, void **base)
{
    int n = t->group_start[k + 1] - t->group_start[k];
    for (int j = 0; j < n; j++) t->gids_scratch[j] = role_ids[t->group[t->group_start[k] + j]];
    td_status st = td_memmgr_access(t->mm, t->gids_scratch, n, TD_TENSOR_COMPUTE, flags, t->ptrs);
    if (st) return st;
    *base = NULL;
    for (int j = 0; j < n; j++)
        if (td_memmgr_tensor_offset(t->mm, t->gids_scratch[j]) == 0) *base = t->ptrs[j];
    return *base ? TD_OK : td_error_set(TD_ERR_STATE, "chunk %d has no tensor at offset 0", k);
}

static td_status release_chunk(td_trainer *t, const int *role_ids, int k, td_tensor_state to)
{
    int n = t->group_start[k + 1] - t->group_start[k];
    for (int j = 0; j < n; j++) t->gids_scratch[j] = role_ids[t->group[t->group_start[k] + j]];
    return td_memmgr_release(t->mm, t->gids_scratch, n, to);
}

/* The grad sumsq of GPU chunk k, on the device: into dev_acc[k] on the
 * cuda backend (read back by gather_device_sumsq), straight into
 * h_sumsq[chunks + k] on the cpu backend (its "device" is host memory; the
 * same kernel as the host path, so the same bits). */
static td_status device_chunk_sumsq(td_trainer *t, int k, int chunks)
{
    td_status st = TD_OK;
    td_memmgr *mm = t->mm;
    char *g;
    TD_TRY(access_chunk(t, t->gid, k, 0, (void **)&g));
    size_t numel = td_memmgr_chunk_bytes(mm, td_memmgr_role_chunk(mm, TD_TENSOR_GRAD, k)) / td_dtype_bytes(t->gdt);
    if (t->ranks > 1) { /* ZeRO-3: this rank's shard of the reduced grads */
        size_t b, e;
        numel = td_memmgr_chunk_host_range(mm, td_memmgr_role_chunk(mm, TD_TENSOR_ADAM_M, k), &b, &e);
        g += b * td_dtype_bytes(t->gdt);
    }
    if (!numel) { /* a rank past the end of a small chunk: its sum is the zero it starts at */
        t->h_sumsq[chunks + k] = 0;
    } else
#ifdef TD_HAVE_CUDA
    if (on_cuda(t)) {
        TD_TRY(td_grad_sumsq_cuda(g, t->gdt, numel, t->dev_acc + k, t->dev_sumsq_scratch, stream_of(t)));
    } else
#endif
    {
        td_grad_stats s = {0};
        TD_TRY(td_adam_cpu_grad_stats(t->adam_main, g, t->gdt, numel, &s));
        t->h_sumsq[chunks + k] = s.sumsq;
    }
    TD_TRY(release_chunk(t, t->gid, k, TD_TENSOR_READY_FOR_REDUCE));
cleanup:
    return st;
}

static td_status gather_device_sumsq(td_trainer *t, int chunks)
{
#ifdef TD_HAVE_CUDA
    if (on_cuda(t) && (t->gpu_opt || early_sums_on_device(t))) { /* dev_acc: GPU chunks', early host chunks' */
        td_status st = td_backend_copy_async(t->backend, TD_QUEUE_COMPUTE, t->h_sumsq + chunks, t->dev_acc,
                                             (size_t)chunks * sizeof(double));
        return st ? st : td_queue_sync(t->backend, TD_QUEUE_COMPUTE);
    }
#endif
    (void)t;
    (void)chunks;
    return TD_OK;
}

/* AdamW of GPU chunk k on the device: its grads never went down, its new
 * params stay there (no upload).  On the compute queue after the backward:
 * each chunk updated on a second stream as soon as the last micro-batch had
 * finished its grads (at the compute stream's priority, or below it) gave
 * the same bits and the same step time on an H200 (W1 and W2 within 0.7%):
 * the backward's GEMMs hold every SM, so the updates' blocks ran no sooner. */
static td_status update_chunk_device(td_trainer *t, int k, const td_adam_coeffs *c)
{
    td_status st = TD_OK;
    td_memmgr *mm = t->mm;
    char *g, *p;
    void *m, *v, *master;
    size_t numel = td_memmgr_chunk_bytes(mm, td_memmgr_role_chunk(mm, TD_TENSOR_PARAM, k)) / td_dtype_bytes(t->dt);
    TD_TRY(access_chunk(t, t->gid, k, 0, (void **)&g));
    TD_TRY(access_chunk(t, t->pid, k, TD_ACCESS_WRITE, (void **)&p));
    TD_TRY(access_chunk(t, t->mid, k, TD_ACCESS_WRITE, &m));
    TD_TRY(access_chunk(t, t->vid, k, TD_ACCESS_WRITE, &v));
    if (t->ranks > 1) { /* ZeRO-3: this rank's shard of the chunk (master, m, v hold it alone) */
        size_t b, e;
        numel = td_memmgr_chunk_host_range(mm, td_memmgr_role_chunk(mm, TD_TENSOR_ADAM_M, k), &b, &e);
        g += b * td_dtype_bytes(t->gdt);
        p += b * td_dtype_bytes(t->dt);
    }
    master = p;
    if (t->dt != TD_DTYPE_F32) TD_TRY(access_chunk(t, t->sid, k, TD_ACCESS_WRITE, &master));
    td_adam_chunk ch = { .master = master, .m = m, .v = v, .grad = g, .grad_dtype = t->gdt,
                         .param_out = p, .param_dtype = t->dt, .state = t->cfg.optim.state,
                         .numel = numel };
#ifdef TD_HAVE_CUDA
    if (on_cuda(t) && numel) TD_TRY(td_train_adam_chunk_cuda(t, k, c, &ch, stream_of(t)));
    else
#endif
    if (numel) TD_TRY(td_train_adam_chunk_cpu(t, t->adam_main, k, c, &ch));
    TD_TRY(release_chunk(t, t->gid, k, TD_TENSOR_HOLD)); /* consumed with the host's (FREE below or in catch_up) */
    TD_TRY(release_chunk(t, t->pid, k, TD_TENSOR_HOLD_AFTER_BWD)); /* to HOLD with the host's below */
    TD_TRY(release_chunk(t, t->mid, k, TD_TENSOR_HOLD));
    TD_TRY(release_chunk(t, t->vid, k, TD_TENSOR_HOLD));
    if (t->dt != TD_DTYPE_F32) TD_TRY(release_chunk(t, t->sid, k, TD_TENSOR_HOLD));
cleanup:
    return st;
}

/* Which param chunk holds each tensor, grouped (counting sort), and the
 * per-chunk grad sumsq buffers (host always: the global norm adds the
 * chunks in chunk order whichever optimizer owns them, so the sum has the
 * same bits for every placement; device ones for the GPU chunks). */
static td_status setup_optimizer(td_trainer *t)
{
    td_status st = TD_OK;
    td_memmgr *mm = t->mm;
    int n = t->n_tensors, chunks = td_memmgr_role_chunk_count(mm, TD_TENSOR_PARAM);
    int first = td_memmgr_role_chunk(mm, TD_TENSOR_PARAM, 0);
    TD_TRY(td_hostpool_alloc(t->pool, 2 * ((size_t)chunks + 1) * sizeof(double), TD_ROLE_STAGING, (void **)&t->h_sumsq));
    if (!t->gpu_opt && t->ranks == 1 && !t->worker) return TD_OK;
    if (t->ranks > 1) {
        t->rs_left = td_calloc((size_t)chunks + 1, sizeof(int), TD_ROLE_META);
        t->sumsq_all = td_calloc((size_t)t->ranks * ((size_t)chunks + 1), sizeof(double), TD_ROLE_META);
        if (!t->rs_left || !t->sumsq_all) return TD_ERR_NOMEM;
    }
    t->group = td_malloc((size_t)n * sizeof(int), TD_ROLE_META);
    t->group_start = td_calloc((size_t)chunks + 1, sizeof(int), TD_ROLE_META);
    t->gids_scratch = td_malloc((size_t)n * sizeof(int), TD_ROLE_META);
    t->ptrs = td_malloc((size_t)n * sizeof(void *), TD_ROLE_META);
    if (!t->group || !t->group_start || !t->gids_scratch || !t->ptrs) return TD_ERR_NOMEM;
    for (int i = 0; i < n; i++)
        if (t->gid[i] >= 0) t->group_start[td_memmgr_tensor_chunk(mm, t->pid[i]) - first + 1]++;
    for (int k = 0; k < chunks; k++) t->group_start[k + 1] += t->group_start[k];
    int *fill = t->gids_scratch;
    memcpy(fill, t->group_start, (size_t)chunks * sizeof(int));
    for (int i = 0; i < n; i++)
        if (t->gid[i] >= 0) t->group[fill[td_memmgr_tensor_chunk(mm, t->pid[i]) - first]++] = i;
#ifdef TD_HAVE_CUDA
    if (on_cuda(t)) {
        TD_TRY(take(t, (size_t)chunks * sizeof(double), TD_ROLE_WORKSPACE, &t->dev_acc));
        TD_TRY(take(t, TD_GRAD_SUMSQ_CUDA_SCRATCH * sizeof(double), TD_ROLE_WORKSPACE, &t->dev_sumsq_scratch));
    }
#endif
cleanup:
    return st;
}

/* ---- the AdamW thread (adam_worker.h) ---------------------------------------- */

/* Whether the updates start in the backward, each host chunk as its grads
 * land: nothing waits for the global norm (no clipping, no loss scale). */
static int updates_early(const td_trainer *t)
{
    const td_optim_params *op = &t->optim.params;
    return op->max_grad_norm <= 0 && op->scaler.kind == TD_LOSS_SCALE_NONE;
}

/* The coefficients of the step about to be taken (no clipping: scale 1). */
static td_status next_coeffs(td_trainer *t, td_adam_coeffs *c)
{
    const td_optim_params *op = &t->optim.params;
    long step = t->optim.step + 1;
    return td_adam_coeffs_make(&op->adam, td_lr_at(&op->lr, step), step, 1.0, c);
}

/* The thread driving the GPU on the core the AdamW team leaves free: the
 * team's threads would otherwise share a core with it (a team waits for
 * its slowest thread).  Each step, in case anything moved it.  Best effort. */
static void own_core(td_trainer *t)
{
    if (t->main_core >= 0) (void)td_topo_bind_thread_to_core(t->topo, t->main_core, t->main_core + 1);
}

/* Param chunk k's host update as a job (under ZeRO-3 this rank's shard of
 * it: every host copy holds the shard alone): the host copies peeked at,
 * and the tickets of the write-backs to wait for; *has 0 when this rank
 * holds none of it. */
static td_status job_make(td_trainer *t, int k, const td_adam_coeffs *c, int stats, td_adam_job *j, int *has)
{
    td_status st = TD_OK;
    td_memmgr *mm = t->mm;
    int pc = td_memmgr_role_chunk(mm, TD_TENSOR_PARAM, k), gc = td_memmgr_role_chunk(mm, TD_TENSOR_GRAD, k);
    int mc = td_memmgr_role_chunk(mm, TD_TENSOR_ADAM_M, k), vc = td_memmgr_role_chunk(mm, TD_TENSOR_ADAM_V, k);
    int sc = td_memmgr_role_chunk(mm, TD_TENSOR_MASTER, k); /* -1: the params are the fp32 master */
    size_t b, e, n = td_memmgr_chunk_host_range(mm, mc, &b, &e); /* the whole chunk, or this rank's shard */
    *has = n > 0;
    if (!*has) return TD_OK; /* a rank past the end of a small chunk */
    char *p, *g;
    void *m = NULL, *v = NULL, *master;
    /* What lives on disk is read when the job runs (job_run): master, m, v;
     * the grads (after their write-back lands in their slot); the params. */
    j->disk = chunk_on_disk(t, k);
    j->grads_disk = td_memmgr_chunk_on_disk(mm, gc) ? gc : -1;
    j->params_disk = td_memmgr_chunk_on_disk(mm, pc) ? pc : -1;
    TD_TRY(td_memmgr_chunk_host_peek(mm, gc, (void **)&g, &j->grads)); /* NULL on disk: its write-back's ticket */
    TD_TRY(td_memmgr_chunk_host_peek(mm, pc, (void **)&p, &j->params));
    if (!j->disk) TD_TRY(td_memmgr_chunk_host_peek(mm, mc, &m, NULL));
    if (!j->disk) TD_TRY(td_memmgr_chunk_host_peek(mm, vc, &v, NULL));
    j->master_is_params = sc < 0;
    master = sc < 0 ? (void *)p : NULL; /* fp32 params are the master */
    if (sc >= 0 && !j->disk) TD_TRY(td_memmgr_chunk_host_peek(mm, sc, &master, NULL));
    /* The new params go straight into the param chunk's pinned host copy,
     * which the next step uploads. */
    j->ch = (td_adam_chunk){ .master = master, .m = m, .v = v, .grad = g, .grad_dtype = t->gdt, .param_out = p,
                             .param_dtype = t->dt, .state = t->cfg.optim.state, .numel = n };
    j->c = c;
    j->stats = stats;
    j->consumes = td_memmgr_chunk_transient(mm, gc);
cleanup:
    return st;
}

/* Runs job k on the team `cpu`: once its grads (and a write-back into its
 * params' host copy) have landed, the grads' sumsq into h_sumsq[k] when
 * asked, then AdamW (its no-decay list the chunk's, or the shard's: decay.c). */
static td_status job_run(td_trainer *t, int k, td_adam_job *j, td_adam_cpu *cpu)
{
    td_status st = TD_OK;
    int acquired = 0, grads_held = 0, params_held = 0;
    TD_TRY(td_copy_wait(t->engine, &j->grads));
    TD_TRY(td_copy_wait(t->engine, &j->params));
    j->landed_ms = j->state_ms = td_now_ms();
    if (j->disk) { /* the state streams in (read ahead in the AdamW's order), and out after the update */
        void *h[3];
        TD_TRY(td_memmgr_disk_acquire(t->mm, k, h));
        acquired = 1;
        if (h[0]) j->ch.master = h[0];
        j->ch.m = h[1];
        j->ch.v = h[2];
    }
    if (j->grads_disk >= 0) { /* in the slot their write-back landed in, or read back */
        void *g;
        TD_TRY(td_memmgr_disk_chunk_acquire(t->mm, j->grads_disk, TD_DISK_READ, &g));
        grads_held = 1;
        j->ch.grad = g;
    }
    if (j->params_disk >= 0) { /* overwritten whole, unless they are the master too (read, then written) */
        void *p;
        TD_TRY(td_memmgr_disk_chunk_acquire(t->mm, j->params_disk,
                                            j->master_is_params || t->ranks > 1 ? TD_DISK_MODIFY : TD_DISK_OVERWRITE, &p));
        params_held = 1;
        j->ch.param_out = p;
        if (j->master_is_params) j->ch.master = p;
    }
    if (j->disk || j->grads_disk >= 0 || j->params_disk >= 0) j->state_ms = td_now_ms();
    if (j->stats) {
        td_grad_stats s = {0};
        TD_TRY(td_adam_cpu_grad_stats(cpu, j->ch.grad, j->ch.grad_dtype, j->ch.numel, &s));
        t->h_sumsq[k] = s.sumsq;
    }
    TD_TRY(td_train_adam_chunk_cpu(t, cpu, k, j->c, &j->ch));
    if (acquired) st = td_memmgr_disk_release(t->mm, k, 1); /* its write starts beside the next update */
    if (params_held && !st) st = td_memmgr_disk_chunk_release(t->mm, j->params_disk, 1);
    if (grads_held && !st) st = td_memmgr_disk_chunk_release(t->mm, j->grads_disk, 0);
    acquired = params_held = grads_held = 0;
cleanup:
    /* the update did not run: nothing to write */
    if (acquired) (void)td_memmgr_disk_release(t->mm, k, 0);
    if (params_held) (void)td_memmgr_disk_chunk_release(t->mm, j->params_disk, 0);
    if (grads_held) (void)td_memmgr_disk_chunk_release(t->mm, j->grads_disk, 0);
    return st;
}

/* Param chunk k's update done: its host copies of params, master and
 * moments recorded as written (the device copy of the params is stale
 * from here on). */
static td_status job_record(td_trainer *t, int k)
{
    td_status st = TD_OK;
    td_memmgr *mm = t->mm;
    static const td_tensor_role written[] = {TD_TENSOR_PARAM, TD_TENSOR_ADAM_M, TD_TENSOR_ADAM_V, TD_TENSOR_MASTER};
    for (int r = 0; r < 4; r++) {
        int ch = td_memmgr_role_chunk(mm, written[r], k);
        void *x;
        if (ch < 0) continue; /* no MASTER: fp32 params */
        if (td_memmgr_chunk_on_disk(mm, ch)) { /* written in its disk slot: the device copy of params goes stale */
            if (written[r] == TD_TENSOR_PARAM) TD_TRY(td_memmgr_chunk_host_written(mm, ch));
            continue;
        }
        TD_TRY(td_memmgr_chunk_host_access(mm, ch, TD_ACCESS_WRITE, &x));
    }
cleanup:
    return st;
}

/* AdamW of param chunk k (this rank's shard of it) on the host copies, on
 * the driving thread, with coefficients c; `stats`: the grads' sumsq into
 * h_sumsq[k] first. */
static td_status update_host(td_trainer *t, int k, const td_adam_coeffs *c, int stats)
{
    td_adam_job j;
    int has;
    td_status st = job_make(t, k, c, stats, &j, &has);
    if (!st && has) st = job_run(t, k, &j, t->adam_main);
    if (!st && has) { /* from its grads' landing, as the AdamW thread's */
        double t1 = td_now_ms();
        t->adam_cpu_ms += t1 - j.state_ms;
        if (j.state_ms > j.landed_ms + SLICE_MIN_MS)
            st = td_memmgr_timeline_host(t->mm, "CPU AdamW (driving thread)", j.landed_ms, j.state_ms,
                                         "chunk %d's state from disk", k);
        if (!st) st = td_memmgr_timeline_host(t->mm, "CPU AdamW (driving thread)", j.state_ms, t1, "AdamW chunk %d", k);
    }
    /* recorded on every rank, its shard empty or not: under ZeRO-3 the
     * chunk's next load (and gather) is every rank's */
    if (!st) st = job_record(t, k);
    return st;
}

/* On the AdamW thread: param chunk k's update, once its grads are on the host. */
static td_status adam_job(void *ctx, int k)
{
    td_trainer *t = ctx;
    /* The AdamW thread runs nothing but its team's regions: on the team's
     * first core (td_adam_cpu leaves a team's caller as it is), away from
     * the core the GPU's thread keeps (own_core).  Once, before its team
     * starts: the team's other threads pin themselves to the next cores. */
    if (!t->worker_pinned) {
        (void)td_topo_bind_thread_to_core(t->topo, 0, 1);
        t->worker_pinned = 1;
    }
    td_status st = job_run(t, k, &t->jobs[k], t->adam);
    adam_drop(t, k); /* read or failed: the grads' staging slot is free again */
    return st;
}

/* On the AdamW thread: whether job k's grads (and the write-back into its
 * params' host copy) have landed, so that its run will not wait; a job
 * with state on disk also only in its turn of the tier's read-ahead (the
 * worker would otherwise take the lowest index whose state is in, out of
 * the order the drive reads in) once its state is read. */
static int adam_ready(void *ctx, int k)
{
    td_trainer *t = ctx;
    int grads = 0, params = 0;
    return td_copy_done(t->engine, &t->jobs[k].grads, &grads) == TD_OK && grads &&
           td_copy_done(t->engine, &t->jobs[k].params, &params) == TD_OK && params &&
           (!t->jobs[k].disk || (td_memmgr_disk_next(t->mm) == k && td_memmgr_disk_ready(t->mm, k)));
}

/* On the AdamW thread: job k done with (run, failed or not run): a
 * transient grad chunk's slot goes back, for the write-back waiting on it. */
static void adam_drop(void *ctx, int k)
{
    td_trainer *t = ctx;
    td_adam_job *j = &t->jobs[k];
    if (j->consumes && td_memmgr_grad_consumed(t->mm, j->ch.grad) == TD_OK) j->consumes = 0;
}

/* Param chunk k's update (this rank's shard of it; none, nothing) handed to
 * the AdamW thread with the coefficients in t->ov_coeffs[t->ov_cur] (its
 * grads' sum is taken elsewhere: on the device, or before the hand-over).
 * Nothing may write the chunk's grads or params until it is taken back. */
static td_status hand_over(td_trainer *t, int k)
{
    int has;
    td_status st = job_make(t, k, &t->ov_coeffs[t->ov_cur], 0, &t->jobs[k], &has);
    return st || !has ? st : td_adam_worker_submit(t->worker, k);
}

/* ZeRO-3: the host chunks' params wait for their update before any load
 * (the order of loads, and so of gathers, must be every rank's: not when
 * an update happened to finish). */
static td_status expect_updates(td_trainer *t)
{
    int chunks = td_memmgr_role_chunk_count(t->mm, TD_TENSOR_PARAM);
    for (int k = 0; k < chunks; k++) {
        td_status st = chunk_on_gpu(t, k) ? TD_OK
                     : td_memmgr_expect_host_write(t->mm, td_memmgr_role_chunk(t->mm, TD_TENSOR_PARAM, k));
        if (st) return st;
    }
    return TD_OK;
}

/* Param chunk k's update back from the AdamW thread, recorded. */
static td_status take_back(td_trainer *t, int k)
{
    int handed = td_adam_worker_pending(t->worker, k);
    td_adam_job_times tm;
    td_status st = td_adam_worker_wait_timed(t->worker, k, &tm);
    if (st) return st;
    if (!handed) return job_record(t, k); /* none of it is this rank's: recorded all the same (update_host) */
    /* the run, from its grads' landing (before: the job waited for their write-back) */
    double landed = t->jobs[k].landed_ms > tm.started_ms ? t->jobs[k].landed_ms : tm.started_ms;
    double ran_from = t->jobs[k].state_ms > landed ? t->jobs[k].state_ms : landed; /* its state read from disk */
    t->adam_cpu_ms += tm.ended_ms - ran_from;
    t->adam_wait_ms += tm.waited_ms;
    if (landed > tm.started_ms)
        TD_TRY(td_memmgr_timeline_host(t->mm, "CPU AdamW", tm.started_ms, landed, "chunk %d's grads landing", k));
    if (ran_from > landed + SLICE_MIN_MS)
        TD_TRY(td_memmgr_timeline_host(t->mm, "CPU AdamW", landed, ran_from, "chunk %d's state from disk", k));
    TD_TRY(td_memmgr_timeline_host(t->mm, "CPU AdamW", ran_from, tm.ended_ms, "AdamW chunk %d", k));
    if (tm.waited_ms > 0)
        TD_TRY(td_memmgr_timeline_host(t->mm, "driving thread", tm.ended_ms - tm.waited_ms, tm.ended_ms,
                                       "wait for chunk %d's AdamW", k));
    st = job_record(t, k);
cleanup:
    return st;
}

/* Every update the AdamW thread holds, taken back. */
static td_status take_back_all(td_trainer *t)
{
    int chunks = td_memmgr_role_chunk_count(t->mm, TD_TENSOR_PARAM);
    for (int k = 0; t->worker && k < chunks; k++)
        if (td_adam_worker_pending(t->worker, k)) {
            td_status st = take_back(t, k);
            if (st) return st;
        }
    return TD_OK;
}

/* Before a step's last micro-batch, when the updates start in the
 * backward: every grad tensor of each host chunk still to finish. */
static td_status hand_over_begin(td_trainer *t)
{
    if (!t->worker || !updates_early(t)) return TD_OK;
    int chunks = td_memmgr_role_chunk_count(t->mm, TD_TENSOR_PARAM);
    for (int k = 0; k < chunks; k++)
        t->ov_left[k] = chunk_on_gpu(t, k) ? 0 : t->group_start[k + 1] - t->group_start[k];
    own_core(t);
    t->ov_early = 1;
#ifdef TD_HAVE_CUDA
    if (on_cuda(t) && early_sums_on_device(t)) { /* each chunk's grad sum lands in its own device double */
        td_status st = zero(t, t->dev_acc, (size_t)chunks * sizeof(double));
        if (st) return st;
    }
#endif
    t->ov_cur ^= 1; /* the last step's updates may still run with the other */
    return next_coeffs(t, &t->ov_coeffs[t->ov_cur]);
}

/* Counts down the grads the last micro-batch finished (gids, their
 * write-back started); a host chunk whose grads are all done goes to the
 * AdamW thread now, which waits for that write-back and updates it while
 * the GPU runs the backward of the blocks before it. */
static td_status hand_over_finished(td_trainer *t, const int *gids, int n)
{
    if (!t->worker || !updates_early(t)) return TD_OK;
    td_status st = TD_OK;
    int chunks = td_memmgr_role_chunk_count(t->mm, TD_TENSOR_PARAM);
    for (int i = 0; !st && i < n; i++) {
        int k = param_chunk_of(t, gids[i], TD_TENSOR_GRAD);
        if (chunk_on_gpu(t, k) || --t->ov_left[k]) continue;
        /* Its sum of squares on the device, where the grads still are, so
         * the step's norm does not wait for the AdamW thread; then the
         * update goes over.  (ZeRO-3: the chunk was reduce-scattered and
         * its shard's write-back queued just before, on the D2H queue; the
         * sum is of the shard, once reduced.) */
        if (early_sums_on_device(t)) st = device_chunk_sumsq(t, k, chunks);
        if (!st) st = hand_over(t, k);
        if (!st && t->ranks > 1) st = td_memmgr_expect_host_write(t->mm, td_memmgr_role_chunk(t->mm, TD_TENSOR_PARAM, k));
    }
    return st;
}

/* The global grad stats: each chunk's sumsq, added in chunk order. */
static td_grad_stats merge_sumsq(const td_trainer *t, int chunks)
{
    td_grad_stats global = {0};
    for (int i = 0; i < chunks; i++) {
        td_grad_stats part = { .sumsq = t->h_sumsq[chunk_on_gpu(t, i) || early_sums_on_device(t) ? chunks + i : i] };
        td_grad_stats_merge(&global, &part);
    }
    return global;
}


/* ZeRO-3's optimizer step: the global grad norm from every rank's shard
 * sums (all ranks get the same bits, so they clip alike and skip a
 * non-finite step together), then AdamW of this rank's shard of every
 * chunk: the GPU's now, the host's in the next forward (catch_up); the
 * devices gather each chunk's params from every rank's shard as they load
 * it (memmgr.h). */
static td_status optimizer_step_sharded(td_trainer *t, td_optim_step *os)
{
    td_status st = TD_OK;
    td_memmgr *mm = t->mm;
    int chunks = td_memmgr_role_chunk_count(mm, TD_TENSOR_PARAM);
    /* Every reduce-scatter done (bounded), before the host waits on the
     * write-backs queued behind them. */
    TD_TRY(compute_sync(t));
    TD_TRY(queue_wait(t, TD_QUEUE_D2H));
    /* The GPU AdamW's chunks' shard sums on the device first, then the
     * host's (taken on the device in the backward when the updates went
     * over there: early_sums_on_device). */
    int early = t->ov_early;
    if (t->gpu_opt && !on_cuda(t) && !early) memset(t->h_sumsq + chunks, 0, (size_t)chunks * sizeof(double));
    if (t->gpu_opt && on_cuda(t) && !early) TD_TRY(zero(t, t->dev_acc, (size_t)chunks * sizeof(double)));
    for (int i = 0; i < chunks; i++)
        if (chunk_on_gpu(t, i)) TD_TRY(device_chunk_sumsq(t, i, chunks));
    for (int i = 0; i < chunks; i++) {
        int gc = td_memmgr_role_chunk(mm, TD_TENSOR_GRAD, i), mc = td_memmgr_role_chunk(mm, TD_TENSOR_ADAM_M, i);
        size_t b, e, n = td_memmgr_chunk_host_range(mm, mc, &b, &e);
        char *g;
        td_grad_stats part = {0};
        if (!chunk_on_gpu(t, i) && !early) { /* accessed on every rank, its shard empty or not (a collective may follow) */
            TD_TRY(td_memmgr_chunk_host_access(mm, gc, TD_ACCESS_READ, (void **)&g));
            if (n) TD_TRY(td_adam_cpu_grad_stats(t->adam_main, g, t->gdt, n, &part)); /* the shard */
        }
        t->h_sumsq[i] = part.sumsq;
    }
    TD_TRY(gather_device_sumsq(t, chunks));
    for (int i = 0; i < chunks; i++)
        if (chunk_on_gpu(t, i) || early) t->h_sumsq[i] = t->h_sumsq[chunks + i];
    /* every rank's, chunk by chunk in rank order, then the chunks in order: the same bits everywhere */
    TD_TRY(sum_over_ranks(t, t->h_sumsq, chunks, 1));
    td_grad_stats global = {0};
    for (int i = 0; i < chunks; i++) {
        td_grad_stats part = { .sumsq = t->h_sumsq[i] };
        td_grad_stats_merge(&global, &part);
    }
    TD_TRY(begin_step(t, &global, os));
    /* Without clipping the host shards went to the AdamW thread in the
     * backward (hand_over_finished), each once reduced and written back. */
    if (early && os->skip)
        TD_FAIL(TD_ERR_STATE, "non-finite gradients at step %ld (no clipping and no loss scale: the update had "
                "already begun); lower --lr or use --clip-grad-norm", t->optim.step + 1);
    for (int i = 0; early && i < chunks; i++)
        if (t->ov_left[i]) TD_FAIL(TD_ERR_STATE, "param chunk %d's grads were never handed to the AdamW thread", i);
    /* The GPU's shards now (queued behind the backward); the host's in the
     * next forward, each just before the chunk's first use (catch_up): the
     * CPU updates chunk k + 1 while the GPU runs the blocks of chunk k, and
     * no load of a chunk comes before its update. */
    if (!os->skip) {
        for (int i = 0; i < chunks; i++)
            if (chunk_on_gpu(t, i)) TD_TRY(update_chunk_device(t, i, &os->coeffs));
        TD_TRY(expect_updates(t));
        t->pending_next = 0;
        t->pending_end = chunks;
        t->pending_coeffs = os->coeffs;
    }
    if (t->worker && !os->skip && !early) { /* every host shard to the AdamW thread, in forward order */
        t->ov_cur ^= 1;
        t->ov_coeffs[t->ov_cur] = os->coeffs;
        own_core(t);
        for (int i = 0; i < chunks; i++)
            if (!chunk_on_gpu(t, i)) TD_TRY(hand_over(t, i));
    }
    if (os->skip) TD_TRY(td_memmgr_set_state(mm, t->gid_live, t->n_live, TD_TENSOR_FREE));
    TD_TRY(td_memmgr_set_state(mm, t->pid, t->n_tensors, TD_TENSOR_HOLD));
cleanup:
    t->ov_early = 0; /* the next step says again where its updates start */
    return st;
}

static td_status optimizer_step(td_trainer *t, td_optim_step *os)
{
    if (t->ranks > 1) return optimizer_step_sharded(t, os);
    td_status st = TD_OK;
    td_memmgr *mm = t->mm;
    int chunks = td_memmgr_role_chunk_count(mm, TD_TENSOR_PARAM), host_chunks = chunks - t->gpu_opt;
    td_grad_stats global = {0};
    const td_optim_params *op = &t->optim.params;
    /* The GPU chunks' sumsq first: the device works on them while the CPU
     * reads the host chunks' grads.  (Updates handed over in the backward
     * had their sums taken there, into the same buffers: kept.) */
    if (t->gpu_opt && !on_cuda(t) && !early_sums_on_device(t)) memset(t->h_sumsq + chunks, 0, (size_t)chunks * sizeof(double));
    if (t->gpu_opt && on_cuda(t) && !early_sums_on_device(t)) TD_TRY(zero(t, t->dev_acc, (size_t)chunks * sizeof(double)));
    for (int i = 0; i < chunks; i++)
        if (chunk_on_gpu(t, i)) TD_TRY(device_chunk_sumsq(t, i, chunks));
    if (op->max_grad_norm <= 0 && op->scaler.kind == TD_LOSS_SCALE_NONE) {
        /* Nothing waits for the global norm (no clipping, no loss scale):
         * each host chunk is updated as soon as its grads reach the host,
         * last block first, while the GPU is still running the backward of
         * the blocks before it; the GPU chunks on the device.  Same
         * coefficients, same result as below. */
        long step = t->optim.step + 1;
        td_adam_coeffs c;
        TD_TRY(next_coeffs(t, &c));
        for (int i = chunks - 1; !t->worker && i >= 0; i--)
            if (!chunk_on_gpu(t, i)) TD_TRY(update_host(t, i, &c, 1));
        for (int i = 0; i < chunks; i++)
            if (chunk_on_gpu(t, i)) TD_TRY(update_chunk_device(t, i, &c));
        if (t->worker) { /* the host chunks went to the AdamW thread in the backward, their sums on the device */
            for (int i = 0; i < chunks; i++)
                if (t->ov_left[i])
                    TD_FAIL(TD_ERR_STATE, "param chunk %d's grads were never handed to the AdamW thread", i);
        }
        TD_TRY(gather_device_sumsq(t, chunks));
        global = merge_sumsq(t, chunks);
        TD_TRY(begin_step(t, &global, os));
        if (os->skip)
            TD_FAIL(TD_ERR_STATE, "non-finite gradients at step %ld (no clipping and no loss scale: the update had "
                    "already begun); lower --lr or use --clip-grad-norm", step);
        /* The AdamW thread's updates are taken back by the next forward,
         * each just before its chunk's first use (catch_up): the forward
         * starts as soon as the first chunks are updated, while the thread
         * finishes the last blocks'. */
        if (t->worker && host_chunks) {
            t->pending_next = 0;
            t->pending_end = chunks;
        }
    } else {
        /* Exact global norm and overflow flag over every grad chunk first. */
        for (int i = 0; i < chunks; i++) {
            if (chunk_on_gpu(t, i)) continue;
            int gc = td_memmgr_role_chunk(mm, TD_TENSOR_GRAD, i);
            void *g;
            td_grad_stats part = {0};
            TD_TRY(td_memmgr_chunk_host_access(mm, gc, TD_ACCESS_READ, &g));
            TD_TRY(td_adam_cpu_grad_stats(t->adam_main, g, t->gdt,
                                          td_memmgr_chunk_bytes(mm, gc) / td_dtype_bytes(t->gdt), &part));
            t->h_sumsq[i] = part.sumsq;
        }
        td_memmgr_disk_release_held(mm); /* grads on disk this loop kept: the AdamW takes them next */
        TD_TRY(gather_device_sumsq(t, chunks));
        global = merge_sumsq(t, chunks);
        TD_TRY(begin_step(t, &global, os));
        /* The GPU chunks now, on the device (queued behind the backward).
         * The host chunks' updates run chunk by chunk in forward order,
         * each just before the next step's forward first needs it
         * (catch_up): the CPU updates chunk k + 1 while the GPU runs the
         * blocks of chunk k.  Exact: the coefficients are this step's. */
        if (!os->skip) {
            for (int i = 0; i < chunks; i++)
                if (chunk_on_gpu(t, i)) TD_TRY(update_chunk_device(t, i, &os->coeffs));
            if (host_chunks) {
                t->pending_next = 0;
                t->pending_end = chunks;
                t->pending_coeffs = os->coeffs;
            }
            /* With the AdamW thread: every host chunk to it now, in the
             * order the next forward needs them; catch_up takes each back
             * just before its first use. */
            if (host_chunks && t->worker) {
                t->ov_cur ^= 1;
        t->ov_coeffs[t->ov_cur] = os->coeffs;
                own_core(t);
                for (int i = 0; i < chunks; i++)
                    if (!chunk_on_gpu(t, i)) TD_TRY(hand_over(t, i));
            }
        }
    }
    /* Every param back to HOLD for the next step; the grads are consumed
     * now, or when the last pending update has read them. */
    if (!t->pending_end) TD_TRY(td_memmgr_set_state(mm, t->gid_live, t->n_live, TD_TENSOR_FREE));
    TD_TRY(td_memmgr_set_state(mm, t->pid, t->n_tensors, TD_TENSOR_HOLD));
cleanup:
    t->ov_early = 0; /* the next step says again where its sums are */
    return st;
}

/* Draws the next micro-batch into the staging buffers (positions preset to
 * 0 .. T-1 on each row) and checks it: tokens and targets inside the
 * vocabulary, positions that start each row at 0 and go up by one or restart
 * at 0.  *kept: its targets that count (not negative); t->packed: whether a
 * row holds several documents. */
static td_status draw_batch(td_trainer *t, td_batch_fn next_batch, void *ctx, size_t *kept)
{
    const int B = t->cfg.micro_batch, T = t->cfg.seq_len, V = t->cfg.model.vocab_size;
    for (int b = 0; b < B; b++)
        for (int i = 0; i < T; i++) t->h_positions[(size_t)b * T + i] = i;
    td_status st = next_batch(ctx, t->h_tokens, t->h_targets, t->h_positions);
    if (st) return st;
    size_t n = 0;
    int packed = 0;
    for (size_t i = 0; i < N_of(t); i++) {
        const int32_t tok = t->h_tokens[i], tg = t->h_targets[i], p = t->h_positions[i];
        if (tok < 0 || tok >= V)
            return td_error_set(TD_ERR_INVALID, "token %d at position %zu is outside the vocabulary of %d", tok, i, V);
        if (tg >= V)
            return td_error_set(TD_ERR_INVALID, "target %d at position %zu is outside the vocabulary of %d", tg, i, V);
        const int32_t prev = i % (size_t)T ? t->h_positions[i - 1] : -1;
        if (p != 0 && p != prev + 1)
            return td_error_set(TD_ERR_INVALID, "position %d of row %zu, token %zu: a document's positions start at 0 "
                                "and go up by one (the one before is %d)", p, i / (size_t)T, i % (size_t)T, prev);
        packed |= p != (int32_t)(i % (size_t)T);
        n += tg >= 0;
    }
    t->packed = packed;
    *kept = n;
    return TD_OK;
}

/* Micro-batch k of the step, kept aside (grad_accum > 1) or brought back. */
static void keep_batch(td_trainer *t, int k, int back)
{
    const size_t N = N_of(t), bytes = N * sizeof(int32_t);
    int32_t *kept = t->batches + (size_t)k * 3 * N, *staging[3] = {t->h_tokens, t->h_targets, t->h_positions};
    for (int i = 0; i < 3; i++) {
        if (back) memcpy(staging[i], kept + (size_t)i * N, bytes);
        else memcpy(kept + (size_t)i * N, staging[i], bytes);
    }
    if (!back) return;
    int packed = 0;
    for (size_t i = 0; i < N && !packed; i++) packed = t->h_positions[i] != (int32_t)(i % (size_t)t->cfg.seq_len);
    t->packed = packed;
}

void td_trainer_set_microbatch_fn(td_trainer *t, td_microbatch_fn fn, void *ctx)
{
    t->microbatch_fn = fn;
    t->microbatch_ctx = ctx;
}

td_status td_trainer_step(td_trainer *t, td_batch_fn next_batch, void *ctx, td_step_result *out)
{
    td_status st = TD_OK;
    double t0 = td_now_ms();
    size_t N = N_of(t);
    double loss_sum = 0, targets = 0;
    memset(out, 0, sizeof *out);
    t->adam_cpu_ms = t->adam_wait_ms = 0;
    t->ov_early = 0; /* set by this step's hand-over, if it hands over in the backward */
    TD_TRY(td_memmgr_step_begin(t->mm));
    /* dloss: 1 / the step's targets that count, over every micro-batch and
     * rank, so that the step's gradient is that of the mean loss over them
     * (masked and padded targets take no part; micro-batches and ranks add
     * up).  The count needs every micro-batch first: they are drawn and
     * kept aside (ints: cheap), and the ranks' counts summed. */
    int accum = t->cfg.grad_accum;
    for (int k = 0; k < accum; k++) {
        size_t kept;
        TD_TRY(draw_batch(t, next_batch, ctx, &kept));
        targets += (double)kept;
        if (accum > 1) keep_batch(t, k, 0);
    }
    TD_TRY(sum_over_ranks(t, &targets, 1, 0));
    double dloss = (targets > 0 ? 1.0 / targets : 0.0) * td_optim_loss_scale(&t->optim);
    for (int k = 0; k < accum; k++) {
        if (accum > 1) keep_batch(t, k, 1);
        lora_drop_set(t, k, 1);
        st = micro_batch(t, dloss, k == accum - 1, 1, &loss_sum);
        t->run.lora_drop = NULL;
        TD_TRY(st);
        if (t->microbatch_fn && accum > 1) t->microbatch_fn(t->microbatch_ctx, k + 1, accum);
    }
    td_optim_step os;
    /* The grad norm's sums and the GPU chunks' AdamW, as the compute queue runs them */
    TD_TRY(td_memmgr_timeline_range(t->mm, "optimizer", 1));
    TD_TRY(optimizer_step(t, &os));
    TD_TRY(td_memmgr_timeline_range(t->mm, NULL, 0));
    TD_TRY(td_memmgr_disk_status(t->mm)); /* a write that failed behind the updates fails this step */
    TD_TRY(td_memmgr_step_end(t->mm));
    TD_TRY(sum_over_ranks(t, &loss_sum, 1, 0)); /* the step's loss over the global batch, in rank order */
    out->step = t->optim.step;
    out->loss = targets > 0 ? loss_sum / targets : 0;
    out->targets = (long)targets;
    out->lr = os.lr;
    out->grad_norm = os.grad_norm;
    out->skipped = os.skip;
    out->step_ms = td_now_ms() - t0;
    out->adam_cpu_ms = t->adam_cpu_ms;
    out->adam_wait_ms = t->adam_wait_ms;
    out->tokens_per_s = (double)N * accum * t->ranks / (out->step_ms * 1e-3); /* every rank's */
    td_memmgr_get_stats(t->mm, &out->mm);
    {   /* the host's footprint: this process's peak, and its host's (every local rank's peak, added) */
        td_host_usage hu;
        TD_TRY(td_trainer_host_usage(t, &hu));
        out->host_node_peak_bytes = hu.peak_bytes;
        out->host_node_rss_peak_bytes = hu.rss_peak_bytes;
        if (t->ranks > 1) {
            uint64_t mine[3] = {t->host_id, hu.peak_bytes, hu.rss_peak_bytes};
            uint64_t *all = td_calloc((size_t)t->ranks, sizeof mine, TD_ROLE_META);
            if (!all) TD_FAIL(TD_ERR_NOMEM, "the host figures of %d ranks", t->ranks);
            st = td_comm_host_allgather(t->comm, mine, sizeof mine, all);
            out->host_node_peak_bytes = out->host_node_rss_peak_bytes = 0;
            for (int r = 0; !st && r < t->ranks; r++)
                if (all[3 * r] == t->host_id) {
                    out->host_node_peak_bytes += all[3 * r + 1];
                    out->host_node_rss_peak_bytes += all[3 * r + 2];
                }
            td_free(all);
            TD_TRY(st);
        }
    }
    if (t->dev_free0) { /* cuda: the device memory the process holds beyond its context */
        size_t free_b = 0, total = 0;
        TD_TRY(td_backend_mem_info(t->backend, &free_b, &total));
        out->device_process_bytes = t->dev_free0 > free_b ? t->dev_free0 - free_b : 0;
        if (out->device_process_bytes > t->dev_used_peak) t->dev_used_peak = out->device_process_bytes;
        out->device_process_peak_bytes = t->dev_used_peak;
    }
cleanup:
    return st;
}

td_status td_trainer_eval(td_trainer *t, td_batch_fn next_batch, void *ctx, int batches, double *loss,
                          uint64_t *targets_out)
{
    td_status st = TD_OK;
    double sums[2] = {0, 0}; /* loss, targets */
    TD_TRY(td_trainer_finish_update(t));
    for (int k = 0; k < batches; k++) {
        size_t kept;
        TD_TRY(draw_batch(t, next_batch, ctx, &kept));
        sums[1] += (double)kept;
        TD_TRY(micro_batch(t, 0, 0, 0, &sums[0]));
    }
    TD_TRY(sum_over_ranks(t, sums, 2, 0));
    *loss = sums[1] > 0 ? sums[0] / sums[1] : 0;
    if (targets_out) *targets_out = (uint64_t)sums[1];
cleanup:
    return st;
}

const td_train_config *td_trainer_config(const td_trainer *t) { return &t->cfg; }
int td_trainer_adam_threads(const td_trainer *t, int *own_thread, int *grad_slots)
{
    if (own_thread) *own_thread = t->worker != NULL;
    if (grad_slots) *grad_slots = td_memmgr_grad_slots(t->mm, NULL);
    return td_adam_cpu_threads(t->adam);
}
const char *td_trainer_host_cores(const td_trainer *t, int *driver_core)
{
    if (driver_core) *driver_core = t->main_core;
    return td_topo_describe(t->topo);
}
td_comm *td_trainer_comm(td_trainer *t) { return t->comm; }
int td_trainer_shard_ranks(const td_trainer *t) { return t->ranks > 1 ? t->shard_ranks : 1; }
td_memmgr *td_trainer_memmgr(td_trainer *t) { return t->mm; }
td_backend *td_trainer_backend(td_trainer *t) { return t->backend; }
td_arena *td_trainer_arena(td_trainer *t) { return t->arena; }
td_hostpool *td_trainer_hostpool(td_trainer *t) { return t->pool; }
int td_trainer_checkpointing(const td_trainer *t) { return t->ckpt_blocks; }
int td_trainer_optim_gpu_chunks(const td_trainer *t, int *total)
{
    if (total) *total = td_memmgr_role_chunk_count(t->mm, TD_TENSOR_PARAM);
    return t->gpu_opt;
}
const td_train_budget *td_trainer_budget(const td_trainer *t) { return &t->budget; }
void td_trainer_setup_times(const td_trainer *t, td_setup_times *out) { *out = t->setup; }
td_optim *td_trainer_optim(td_trainer *t) { return &t->optim; }

void td_trainer_tensor_ids(const td_trainer *t, int index, int *param, int *grad, int *m, int *v)
{
    if (param) *param = t->pid[index];
    if (grad) *grad = t->gid[index];
    if (m) *m = t->mid[index];
    if (v) *v = t->vid[index];
}

/* ---- sampling ---------------------------------------------------------------------- */

td_status td_trainer_next_logits(td_trainer *t, const int32_t *tokens, int n, float *logits)
{
    td_status st = TD_OK;
    size_t N = N_of(t);
    int T = t->cfg.seq_len, V = t->cfg.model.vocab_size;
    if (n < 1 || n > T) return td_error_set(TD_ERR_INVALID, "context of %d tokens; 1 to %d fit", n, T);
    if ((st = td_trainer_finish_update(t))) return st;
    /* Row 0 holds the context, left-aligned; causal attention makes what
     * follows it irrelevant to position n-1. */
    for (size_t i = 0; i < N; i++) {
        t->h_tokens[i] = i < (size_t)n ? tokens[i] : 0;
        t->h_targets[i] = -1;
    }
    t->packed = 0;
    double ignored = 0;
    t->want_row = n - 1; /* the head copies its logits out of their chunk (op_head) */
    st = micro_batch(t, 0, 0, 0, &ignored);
    t->want_row = -1;
    if (st) goto cleanup;
    TD_TRY(compute_sync(t));
    td_train_to_f32(logits, t->h_row, t->dt, (size_t)V);
cleanup:
    return st;
}
