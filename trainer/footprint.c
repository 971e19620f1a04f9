/* What a run needs where: the model's tensors in each role, the chunk size,
 * the non-model buffers and --ckpt auto's choice, and whether AdamW runs on
 * the GPU.  One set of rules for the trainer (train.c) and `tidal plan`
 * (plan.c). */
#include "train_impl.h"
#include "tidal/arena.h"
#include "tidal/convert.h"
#ifdef TD_HAVE_CUDA
#include "tidal/ops_cuda.h"
#endif
#include "tidal/util.h"

#include <string.h>

/* A moment chunk in a format with a layout of its own (int8: codes, then a
 * scale per block): optim/ sizes it. */
static size_t moment_bytes(size_t numel, void *ctx)
{
    return td_adam_moment_bytes((td_optim_state)(uintptr_t)ctx, numel);
}

/* Every tensor of the model in each role, in the same order for each, so
 * chunk i of each role holds the same tensors: params and grads in the
 * compute precision, an fp32 master when that is not fp32, AdamW m and v as
 * --optim-state stores them: in the format's element type (fp32, bf16), or,
 * for a format with a layout of its own (int8), an opaque format to the
 * chunk manager, sized by td_adam_moment_bytes of the chunk's elements (the
 * elements pack as in every other role).
 * A frozen tensor (--freeze) is registered once, its storage in the
 * compute precision in the OTHER role (chunks of its own, loaded and never
 * written back), with no grad, master, m or v (their ids -1): the mirrored
 * roles hold the trainable tensors alone, alike.
 * ids: 5 * count ints (param, grad, master or -1, m, v). */
td_status td_train_register_model(td_memmgr *mm, const td_train_config *cfg, int *ids)
{
    td_status st = TD_OK;
    const td_model_desc *mc = &cfg->model;
    int n = td_model_tensor_count(mc);
    td_dtype dt = cfg->precision;
    static const td_tensor_role roles[5] = {TD_TENSOR_PARAM, TD_TENSOR_GRAD, TD_TENSOR_MASTER, TD_TENSOR_ADAM_M,
                                            TD_TENSOR_ADAM_V};
    td_optim_state os = cfg->optim.state;
    uint8_t *frozen = NULL;
    TD_TRY(td_optim_state_check(os));
    td_dtype mdt = td_adam_moment_dtype(os);
    if (mdt == TD_DTYPE_COUNT) { /* registered by element count; the format sizes the chunk */
        mdt = TD_DTYPE_F32;
        TD_TRY(td_memmgr_set_role_format(mm, TD_TENSOR_ADAM_M, moment_bytes, (void *)(uintptr_t)os));
        TD_TRY(td_memmgr_set_role_format(mm, TD_TENSOR_ADAM_V, moment_bytes, (void *)(uintptr_t)os));
    }
    td_dtype dts[5] = {dt, dt, TD_DTYPE_F32, mdt, mdt};
    frozen = td_malloc((size_t)n, TD_ROLE_META);
    if (!frozen) return td_error_set(TD_ERR_NOMEM, "registering %d tensors", n);
    TD_TRY(td_train_frozen(cfg, frozen));
    if (td_train_frozen_count(cfg, frozen) == n) {
        st = td_error_set(TD_ERR_INVALID, "--freeze freezes every tensor of the model: nothing is left to train");
        goto cleanup;
    }
    for (int r = 0; r < 5; r++)
        for (int i = 0; i < n; i++) {
            ids[r * n + i] = -1;
            if (roles[r] == TD_TENSOR_MASTER && dt == TD_DTYPE_F32) continue;
            if (frozen[i] && r > 0) continue; /* its storage alone */
            td_tensor_role role = frozen[i] ? TD_TENSOR_OTHER : roles[r];
            if (r > 0) { /* the name and size its param took */
                TD_TRY(td_memmgr_register(mm, td_memmgr_tensor_name(mm, ids[i]), td_memmgr_tensor_numel(mm, ids[i]),
                                          dts[r], role, &ids[r * n + i]));
                continue;
            }
            td_model_tensor tt;
            td_model_tensor_get(mc, i, &tt);
            TD_TRY(td_memmgr_register(mm, tt.name, tt.numel, dts[r], role, &ids[r * n + i]));
        }
cleanup:
    td_free(frozen);
    return st;
}

/* Chunk sizes around one block's parameters unless the caller chose. */
td_memmgr_params td_train_chunk_params(const td_train_config *cfg)
{
    td_memmgr_params mp = cfg->mm;
    td_memmgr_params dflt = td_memmgr_default_params();
    if (!mp.chunk_numel && mp.min_chunk_numel == dflt.min_chunk_numel && mp.max_chunk_numel == dflt.max_chunk_numel) {
        /* At least the largest block tensor (GPT-2: 4C x C; LLaMA: gate|up,
         * 2H x C), so only the embedding (and an untied head) may get a
         * chunk of its own: few distinct chunk sizes, little fragmentation;
         * at most one block's worth. */
        size_t off, span, big = td_model_block_largest_numel(&cfg->model);
        td_model_block_span(&cfg->model, 0, &off, &span);
        mp.min_chunk_numel = big > 4096 ? big : 4096;
        mp.max_chunk_numel = span > mp.min_chunk_numel ? span : mp.min_chunk_numel;
    }
    mp.shard_ranks = td_train_shard_ranks(cfg);
    mp.shard_rank = td_train_shard_rank(cfg);
    mp.shard_align = td_train_shard_align(cfg);
    /* auto (-1) is resolved before a layout (td_train_resolve_grad_slots);
     * unresolved here, the host's least */
    mp.grad_slots = !td_train_grads_transient(cfg) ? 0 : cfg->mm.grad_slots < 0 ? TD_TRAIN_GRAD_SLOTS : cfg->mm.grad_slots;
    return mp;
}

td_state_bytes td_train_state_of(td_memmgr *mm)
{
    td_state_bytes s = {0};
    for (int c = 0; c < td_memmgr_chunk_count(mm); c++) {
        size_t b = td_memmgr_chunk_slot_bytes(mm, c); /* the device's view */
        td_tensor_role r = td_memmgr_chunk_role(mm, c);
        s.all += b;
        if (r == TD_TENSOR_PARAM || r == TD_TENSOR_GRAD) s.param_grad += b;
        if (b > s.largest) s.largest = b;
    }
    return s;
}

size_t td_train_cublas_workspace_bytes(const td_train_config *cfg)
{
#ifdef TD_HAVE_CUDA
    if (cfg->backend == TD_BACKEND_CUDA) return TD_OPS_CUDA_WORKSPACE_BYTES;
#endif
    (void)cfg;
    return 0;
}

int td_train_loss_rows(const td_train_config *cfg)
{
    size_t N = (size_t)cfg->micro_batch * (size_t)cfg->seq_len;
    if (N == 0) return 0;
    if (cfg->loss_chunk > 0) return (size_t)cfg->loss_chunk < N ? cfg->loss_chunk : (int)N;
    size_t row = (size_t)cfg->model.padded_vocab_size * td_dtype_bytes(cfg->precision);
    size_t most = row ? TD_TRAIN_LOSS_CHUNK_BYTES / row : N;
    if (most < TD_TRAIN_LOSS_CHUNK_MIN_ROWS) most = TD_TRAIN_LOSS_CHUNK_MIN_ROWS;
    if (most >= N) return (int)N;
    /* as many chunks as that takes, the rows split evenly (the last chunk is
     * no runt), rounded up to 64 rows */
    size_t chunks = (N + most - 1) / most, rows = td_align_up((N + chunks - 1) / chunks, 64);
    return (int)(rows < N ? rows : N);
}

/* The buffers when blocks [0, nck) are recomputed.  The head's final norm
 * and logits hold one chunk of rows (td_train_loss_rows): never the whole
 * (B*T, Vp) logits. */
static void act_buffers(const td_train_config *cfg, int nck, td_act_plan *p)
{
    const td_model_desc *mc = &cfg->model;
    int B = cfg->micro_batch, T = cfg->seq_len, L = mc->n_layer;
    size_t N = (size_t)B * (size_t)T, C = (size_t)mc->n_embd, Vp = (size_t)mc->padded_vocab_size, F = sizeof(float);
    size_t E = td_dtype_bytes(cfg->precision);
    /* The family's compute on this backend (family.h): its block's acts,
     * the scratch of its calls, its constants after cuBLASLt's workspace. */
    const td_model_exec *ex = td_model_exec_of(mc, cfg->backend == TD_BACKEND_CUDA);
    if (!ex) ex = td_model_exec_of(mc, 0); /* no CUDA in this build: the reference's sizes (the run says so) */
    size_t acts = ex->block_acts_bytes(mc, B, T, cfg->precision);
    size_t scratch = ex->scratch_bytes(mc, B, T, cfg->precision, B), consts = ex->consts_bytes(mc);
    size_t workspace = td_train_cublas_workspace_bytes(cfg) + (consts ? td_align_up(consts, TD_ARENA_ALIGN) : 0);
    size_t blocks = (size_t)(nck > 0) + (size_t)(L - nck), R = (size_t)td_train_loss_rows(cfg);
    size_t sizes[ACT_BUFFERS] = {(size_t)(L + 1) * N * C * E, blocks * acts, R * C * E, R * F,
                                 R * F, R * Vp * E, N * F, N * F, N * C * E, N * C * E, scratch, N * 4, N * 4,
                                 N * 4, workspace};
    td_role roles[ACT_BUFFERS] = {TD_ROLE_ACTIVATION, TD_ROLE_ACTIVATION, TD_ROLE_ACTIVATION, TD_ROLE_ACTIVATION,
                                  TD_ROLE_ACTIVATION, TD_ROLE_ACTIVATION, TD_ROLE_ACTIVATION, TD_ROLE_ACTIVATION,
                                  TD_ROLE_WORKSPACE, TD_ROLE_WORKSPACE, TD_ROLE_WORKSPACE, TD_ROLE_STAGING,
                                  TD_ROLE_STAGING, TD_ROLE_STAGING, TD_ROLE_WORKSPACE};
    p->n = ACT_BUFFERS;
    p->ckpt_blocks = nck;
    p->total = 0;
    for (int i = 0; i < ACT_BUFFERS; i++) {
        p->bytes[i] = sizes[i];
        p->role[i] = roles[i];
        if (sizes[i]) p->total += td_align_up(sizes[i], TD_ARENA_ALIGN);
    }
}

/* Whether the whole model state (all roles) and the non-model buffers fit
 * the budget with a sixteenth to spare: then AdamW runs on the GPU. */
static int gpu_state_fits(const td_train_config *cfg, size_t nonmodel, size_t state_all, size_t budget)
{
    size_t all = nonmodel + state_all;
    return cfg->backend == TD_BACKEND_CUDA && cfg->mm.placement == TD_PLACEMENT_AUTO && budget &&
           all + all / 16 <= budget;
}

/* The non-model buffers of a run, in allocation order (one list for the
 * trainer and for `tidal plan`).  The sizes depend on the backend: the CUDA
 * ops keep activations in the compute precision and have their own scratch
 * needs and a cuBLASLt workspace.  --ckpt auto: see td_train_plan_make in
 * trainer.h. */
void td_train_plan_activations(const td_train_config *cfg, size_t budget, const td_state_bytes *sb, td_act_plan *p)
{
    int L = cfg->model.n_layer;
    if (cfg->ckpt == TD_CKPT_OFF) { act_buffers(cfg, 0, p); return; }
    if (cfg->ckpt == TD_CKPT_ON) { act_buffers(cfg, cfg->ckpt_blocks ? cfg->ckpt_blocks : L, p); return; }
    td_act_plan all;
    act_buffers(cfg, L, &all);
    /* The room the state needs beside the activations: all of it (then the
     * GPU AdamW runs), or the param and grad chunks with two of the largest
     * chunk for fragmentation, as the plan's minimum has it. */
    int gpu = gpu_state_fits(cfg, all.total, sb->all, budget);
    size_t keep = sb->param_grad + 2 * sb->largest;
    if (gpu || all.total + keep <= budget) {
        for (int nck = 0; nck < L; nck += nck ? 1 : 2) { /* one recomputed block saves nothing */
            act_buffers(cfg, nck, p);
            if (gpu ? gpu_state_fits(cfg, p->total, sb->all, budget) : p->total + keep <= budget) return;
        }
    } else if ((size_t)L * all.bytes[1] <= budget / 4) { /* chunks stream: keep small activations */
        act_buffers(cfg, 0, p);
        return;
    }
    *p = all;
}


double td_train_adam_bytes_per_param(const td_train_config *cfg)
{
    double e = (double)td_dtype_bytes(cfg->precision);
    return 2.0 * td_adam_state_bytes_per_param(cfg->optim.state) + e + (cfg->precision == TD_DTYPE_F32 ? 0.0 : e);
}

/* fp32 values into a buffer of dtype dt (round to nearest even). */
void td_train_from_f32(void *dst, td_dtype dt, const float *src, size_t n)
{
    if (dt == TD_DTYPE_F32) { memcpy(dst, src, n * sizeof(float)); return; }
    uint16_t *d = dst;
    /* On all threads: the init rounds every param through here (7.8B at
     * W8S's shape), and each element's rounding is its own. */
#pragma omp parallel for schedule(static) if (n >= (1u << 18))
    for (size_t i = 0; i < n; i++) d[i] = dt == TD_DTYPE_BF16 ? td_bf16_from_f32(src[i]) : td_f16_from_f32(src[i]);
}

void td_train_to_f32(float *dst, const void *src, td_dtype dt, size_t n)
{
    if (dt == TD_DTYPE_F32) { memcpy(dst, src, n * sizeof(float)); return; }
    const uint16_t *s = src;
#pragma omp parallel for schedule(static) if (n >= (1u << 18))
    for (size_t i = 0; i < n; i++) dst[i] = dt == TD_DTYPE_BF16 ? td_f32_from_bf16(s[i]) : td_f32_from_f16(s[i]);
}

const char *td_shard_mode_name(td_shard_mode m)
{
    return m == TD_SHARD_WORLD ? "world" : m == TD_SHARD_NODE ? "node" : "auto";
}

td_status td_shard_mode_parse(const char *name, td_shard_mode *out)
{
    for (int m = TD_SHARD_AUTO; m <= TD_SHARD_NODE; m++)
        if (name && !strcmp(name, td_shard_mode_name((td_shard_mode)m))) { *out = (td_shard_mode)m; return TD_OK; }
    return td_error_set(TD_ERR_INVALID, "--shard '%s': use node (each host holds the model state once), world (the "
                        "job holds it once) or auto", name ? name : "");
}

int td_train_shard_ranks(const td_train_config *cfg)
{
    if (cfg->ranks <= 1) return 1;
    return cfg->shard == TD_SHARD_NODE && cfg->local_ranks > 0 ? cfg->local_ranks : cfg->ranks;
}

/* Ranks are numbered host by host, so a host's ranks are one shard group
 * under --shard node. */
int td_train_shard_rank(const td_train_config *cfg) { return cfg->ranks > 1 ? cfg->rank % td_train_shard_ranks(cfg) : 0; }

size_t td_train_comm_device_bytes(const td_train_config *cfg)
{
    if (cfg->ranks <= 1 || cfg->backend != TD_BACKEND_CUDA) return 0;
    if (cfg->comm_device_bytes) return cfg->comm_device_bytes;
    int groups = td_train_shard_ranks(cfg) < cfg->ranks ? 2 : 1; /* --shard node over hosts: a second communicator */
    if (td_train_shard_ranks(cfg) > 1 && cfg->reduce_comm == TD_REDUCE_COMM_OWN) groups++; /* the reduce-scatters' */
    return (size_t)groups * TD_TRAIN_NCCL_PLAN_BYTES;
}

size_t td_train_shard_align(const td_train_config *cfg)
{
    /* A shard starts on the moment format's alignment (int8: a scale block,
     * so its blocks are the whole chunk's and the update is the one a single
     * rank makes), and on 64 elements at least. */
    size_t a = td_adam_moment_align(cfg->optim.state);
    return a > 64 ? a : 64;
}
