/* Checkpoints of a trainer: its weights (the fp32 master), and with `state`
 * its AdamW state and step, written tensor by tensor from the host copies
 * through checkpoint/ (format in docs/checkpoints.md).
 *
 * The moments travel as fp32 values whatever --optim-state keeps them in
 * (the format's name is in the metadata); optim/ converts them
 * (td_adam_moment_read / _write), so nothing here knows a moment format.
 * One process streams every tensor in order; ranks (ZeRO-3) each write and
 * read the part of every tensor that lies in their shard, and any number of
 * ranks reads the files one process writes. */
#include "train_impl.h"
#include "tidal/checkpoint.h"

#include <string.h>

/* Moments move in pieces of PIECE elements through a small buffer (none for
 * fp32, read and written in place): a save or load takes no more heap than
 * that.  A multiple of every format's alignment (TD_ADAM_MOMENT_ALIGN_MAX),
 * so each piece of a load is written on its own. */
#define PIECE ((size_t)1 << 20)
_Static_assert(PIECE % TD_ADAM_MOMENT_ALIGN_MAX == 0, "a piece starts on every format's alignment");

/* Checkpoint parameter k: the tidal tensor it is (a part of), and the part's first element. */
static td_status ckpt_part(const td_model_desc *cc, int k, int *index, size_t *offset, size_t *numel)
{
    td_model_hf_tensor cp;
    td_status st = td_model_hf_get(cc, k, &cp);
    if (st) return st;
    *index = cp.tensor;
    *offset = (size_t)cp.offset;
    *numel = (size_t)cp.numel;
    return TD_OK;
}

/* Elements [off, off + n) of checkpoint param k's state: appended in order
 * (one process streaming), or written at their place (ranks, ranged). */
static td_status put_state(td_trainer *t, td_ckpt_writer *w, int k, td_ckpt_state kind, size_t off, const float *src,
                           size_t n)
{
    if (t->ranks > 1) return td_ckpt_writer_write_state(w, k, kind, off, src, n);
    return td_ckpt_writer_append_state(w, k, kind, src, n);
}

/* m or v of checkpoint param k (tensor i, its elements [off, off + numel))
 * as fp32 values: the part its moment chunk's host copy holds (all of it on
 * one rank, the shard's part on several).  The host copy holds n elements
 * from chunk element `base`; the tensor sits in the chunk where its param
 * does (every role packs the same elements). */
static td_status moment_save(td_trainer *t, td_ckpt_writer *w, int k, td_ckpt_state kind, int i, size_t off,
                             size_t numel, float *tmp)
{
    td_status st = TD_OK;
    td_optim_state s = t->cfg.optim.state;
    td_adam_moment which = kind == TD_CKPT_STATE_ADAM_M ? TD_ADAM_MOMENT_M : TD_ADAM_MOMENT_V;
    int c = td_memmgr_tensor_chunk(t->mm, (kind == TD_CKPT_STATE_ADAM_M ? t->mid : t->vid)[i]);
    size_t base, end, n = td_memmgr_chunk_host_range(t->mm, c, &base, &end);
    void *buf;
    TD_TRY(td_memmgr_chunk_host_access(t->mm, c, TD_ACCESS_READ, &buf));
    size_t p0 = td_memmgr_tensor_offset(t->mm, t->pid[i]) + off;
    size_t e0 = p0 > base ? p0 : base, e1 = p0 + numel < base + n ? p0 + numel : base + n;
    for (size_t from = e0; from < e1; from += PIECE) {
        size_t to = e1 - from < PIECE ? e1 : from + PIECE;
        const float *src = td_adam_moment_f32(s, buf, from - base);
        if (!src) {
            TD_TRY(td_adam_moment_read(s, which, buf, n, from - base, to - base, tmp));
            src = tmp;
        }
        TD_TRY(put_state(t, w, k, kind, from - p0, src, to - from));
    }
cleanup:
    return st;
}

/* Loads every m and v: chunk by chunk, a piece at a time, each piece
 * assembled from the checkpoint parts that fall in it (zeros between
 * tensors, as the update leaves them) and stored whole, so a format that
 * quantizes in blocks gets whole blocks where a block straddles two
 * tensors.  On several ranks each loads its shard of every chunk. */
static td_status moments_load(td_trainer *t, const td_ckpt_reader *r, float *tmp)
{
    td_status st = TD_OK;
    td_memmgr *mm = t->mm;
    td_model_desc cc = t->cfg.model;
    td_optim_state s = t->cfg.optim.state;
    int np = td_model_hf_count(&cc);
    size_t *p0 = td_malloc((size_t)np * sizeof *p0, TD_ROLE_META), *pn = td_malloc((size_t)np * sizeof *pn, TD_ROLE_META);
    int *pi = td_malloc((size_t)np * sizeof *pi, TD_ROLE_META), *pc = td_malloc((size_t)np * sizeof *pc, TD_ROLE_META);
    if (!p0 || !pn || !pi || !pc) { st = TD_ERR_NOMEM; goto cleanup; }
    for (int k = 0; k < np; k++) {
        size_t off;
        TD_TRY(ckpt_part(&cc, k, &pi[k], &off, &pn[k]));
        p0[k] = td_memmgr_tensor_offset(mm, t->pid[pi[k]]) + off; /* a frozen tensor's: unused */
    }
    for (int kind = 0; kind < 2; kind++) {
        td_ckpt_state ks = kind ? TD_CKPT_STATE_ADAM_V : TD_CKPT_STATE_ADAM_M;
        td_adam_moment which = kind ? TD_ADAM_MOMENT_V : TD_ADAM_MOMENT_M;
        const int *ids = kind ? t->vid : t->mid;
        td_tensor_role role = kind ? TD_TENSOR_ADAM_V : TD_TENSOR_ADAM_M;
        for (int k = 0; k < np; k++) pc[k] = ids[pi[k]] < 0 ? -1 : td_memmgr_tensor_chunk(mm, ids[pi[k]]); /* -1: frozen */
        for (int ci = 0; ci < td_memmgr_role_chunk_count(mm, role); ci++) {
            int c = td_memmgr_role_chunk(mm, role, ci), any = 0;
            for (int k = 0; k < np && !any; k++) any = pc[k] == c;
            size_t base, end, n = td_memmgr_chunk_host_range(mm, c, &base, &end);
            if (!any || !n) continue; /* no checkpoint tensor here, or none of it in this rank's shard */
            void *buf;
            TD_TRY(td_memmgr_chunk_host_access(mm, c, TD_ACCESS_WRITE, &buf));
            for (size_t w0 = 0; w0 < n; w0 += PIECE) {
                size_t w1 = n - w0 < PIECE ? n : w0 + PIECE;
                float *in_place = td_adam_moment_f32(s, buf, w0), *dst = in_place ? in_place : tmp;
                memset(dst, 0, (w1 - w0) * sizeof(float));
                for (int k = 0; k < np; k++) {
                    size_t a = p0[k] > base + w0 ? p0[k] : base + w0;
                    size_t b = p0[k] + pn[k] < base + w1 ? p0[k] + pn[k] : base + w1;
                    if (pc[k] == c && a < b)
                        TD_TRY(td_ckpt_reader_read_state(r, k, ks, a - p0[k], b - a, dst + (a - base - w0)));
                }
                if (!in_place) TD_TRY(td_adam_moment_write(s, which, buf, n, w0, w1, tmp));
            }
        }
    }
cleanup:
    td_free(p0);
    td_free(pn);
    td_free(pi);
    td_free(pc);
    return st;
}

static td_status set_state_meta(td_trainer *t, td_ckpt_writer *w, const char *const *meta)
{
    td_status st = TD_OK;
    const td_loss_scaler *sc = &t->optim.scaler;
    TD_TRY(td_ckpt_writer_set_meta_u64(w, "optim_step", (uint64_t)t->optim.step));
    TD_TRY(td_ckpt_writer_set_meta_u64(w, "optim_skipped_steps", (uint64_t)t->optim.skipped_steps));
    TD_TRY(td_ckpt_writer_set_meta_f64(w, "loss_scale", sc->scale));
    TD_TRY(td_ckpt_writer_set_meta_u64(w, "loss_scale_clean_steps", (uint64_t)sc->clean_steps));
    TD_TRY(td_ckpt_writer_set_meta_u64(w, "loss_scale_hysteresis_left", (uint64_t)sc->hysteresis_left));
    TD_TRY(td_ckpt_writer_set_meta_u64(w, "loss_scale_overflows", (uint64_t)sc->overflows));
    TD_TRY(td_ckpt_writer_set_meta_u64(w, "seed", t->cfg.seed));
    TD_TRY(td_ckpt_writer_set_meta(w, "optim_state", td_optim_state_name(t->cfg.optim.state)));
    for (int i = 0; meta && meta[i] && meta[i + 1]; i += 2) TD_TRY(td_ckpt_writer_set_meta(w, meta[i], meta[i + 1]));
cleanup:
    return st;
}

/* ---- ZeRO-3: each rank its shard ----------------------------------------------
 * Rank r saves (and loads) the elements of every tensor that fall in its
 * shard of the tensor's chunk, straight from its host copies (the shard of
 * params, master, m and v it keeps); the files are those one process
 * writes, so any number of ranks resumes them. */

static td_status group_allgather(void *arg, const void *mine, size_t bytes, void *all)
{
    return td_comm_host_allgather(arg, mine, bytes, all);
}

/* Checkpoint param k (tensor i, its elements [off, off + numel)): where it
 * starts in its chunk (*p0), and the part [*from, *to) of it in this rank's
 * shard, which starts at chunk element *base. */
static void shard_part(td_trainer *t, int i, size_t off, size_t numel, size_t *p0, size_t *from, size_t *to,
                       size_t *base)
{
    size_t end;
    td_memmgr_chunk_host_range(t->mm, td_memmgr_tensor_chunk(t->mm, t->mid[i]), base, &end);
    *p0 = td_memmgr_tensor_offset(t->mm, t->pid[i]) + off;
    *from = *p0 > *base ? *p0 : *base;
    *to = *p0 + numel < end ? *p0 + numel : end;
    if (*to < *from) *to = *from;
}

/* Chunk element `at` of tensor i's fp32 master on this rank (in its shard):
 * the master chunk's shard, or the fp32 params' (the same elements). */
static td_status master_at(td_trainer *t, int i, unsigned flags, size_t at, size_t base, float **out)
{
    void *h;
    int c = td_memmgr_tensor_chunk(t->mm, t->sid[i] >= 0 ? t->sid[i] : t->pid[i]);
    td_status st = td_memmgr_chunk_host_access(t->mm, c, flags, &h);
    *out = (float *)h + (at - base);
    return st;
}

/* A frozen tensor's weights (checkpoint param k: tensor i's elements from
 * `off`) from its host copy, in the compute precision: whole, or (ranged)
 * at their place. */
static td_status frozen_save(td_trainer *t, td_ckpt_writer *w, int k, int i, size_t off, size_t numel, int ranged)
{
    void *p;
    td_status st = td_memmgr_host_access(t->mm, &t->pid[i], 1, TD_ACCESS_READ, &p);
    if (st) return st;
    p = (char *)p + off * td_dtype_bytes(t->dt);
    return ranged ? td_ckpt_writer_write_weight(w, k, 0, t->dt, p, numel) : td_ckpt_writer_put_weight(w, k, t->dt, p);
}

/* A frozen tensor's weights into its host copy (every rank: whole). */
static td_status frozen_load(td_trainer *t, const td_ckpt_reader *r, int k, int i, size_t off)
{
    void *p;
    td_status st = td_memmgr_host_access(t->mm, &t->pid[i], 1, TD_ACCESS_WRITE, &p);
    if (st) return st;
    return td_ckpt_reader_get_weight(r, k, t->dt, (char *)p + off * td_dtype_bytes(t->dt));
}

static td_status save_shards(td_trainer *t, td_ckpt_writer *w, int state, float *tmp)
{
    td_status st = TD_OK;
    if (t->replica_rank > 0) return TD_OK; /* --shard node: the first host's ranks write every shard */
    td_model_desc cc = t->cfg.model;
    int n = td_model_hf_count(&cc);
    for (int k = 0; k < n; k++) {
        int i;
        size_t off, numel, p0, from, to, base;
        float *src;
        TD_TRY(ckpt_part(&cc, k, &i, &off, &numel));
        if (t->mid[i] < 0) { /* frozen: whole on every rank, written by rank 0, no state */
            if (t->rank == 0) TD_TRY(frozen_save(t, w, k, i, off, numel, 1));
            continue;
        }
        shard_part(t, i, off, numel, &p0, &from, &to, &base);
        if (from == to) continue;
        TD_TRY(master_at(t, i, TD_ACCESS_READ, from, base, &src));
        TD_TRY(td_ckpt_writer_write_weight(w, k, from - p0, TD_DTYPE_F32, src, to - from));
        if (!state) continue;
        TD_TRY(td_ckpt_writer_write_state(w, k, TD_CKPT_STATE_MASTER, from - p0, src, to - from));
        TD_TRY(moment_save(t, w, k, TD_CKPT_STATE_ADAM_M, i, off, numel, tmp));
        TD_TRY(moment_save(t, w, k, TD_CKPT_STATE_ADAM_V, i, off, numel, tmp));
    }
cleanup:
    return st;
}

/* Every rank: its shard of params and master (moments_load, its shard of
 * m and v; the devices gather the params from every rank's at their first
 * use). */
static td_status load_shards(td_trainer *t, const td_ckpt_reader *r, int state)
{
    td_status st = TD_OK;
    td_model_desc cc = t->cfg.model;
    int n = td_model_hf_count(&cc);
    for (int k = 0; k < n; k++) {
        int i;
        size_t off, numel, p0, from, to, base;
        char *p;
        float *master;
        TD_TRY(ckpt_part(&cc, k, &i, &off, &numel));
        if (t->mid[i] < 0) {
            TD_TRY(frozen_load(t, r, k, i, off));
            continue;
        }
        shard_part(t, i, off, numel, &p0, &from, &to, &base);
        if (from == to) continue; /* none of it in this rank's shard */
        TD_TRY(master_at(t, i, TD_ACCESS_WRITE, from, base, &master));
        if (state) TD_TRY(td_ckpt_reader_read_state(r, k, TD_CKPT_STATE_MASTER, from - p0, to - from, master));
        else TD_TRY(td_ckpt_reader_get_weight_range(r, k, from - p0, to - from, TD_DTYPE_F32, master));
        if (t->sid[i] >= 0) { /* 16-bit params: the shard's part rounded from the master */
            TD_TRY(td_memmgr_chunk_host_access(t->mm, td_memmgr_tensor_chunk(t->mm, t->pid[i]), TD_ACCESS_WRITE,
                                               (void **)&p));
            td_train_from_f32(p + (from - base) * td_dtype_bytes(t->dt), t->dt, master, to - from);
        }
    }
    /* Every param chunk's host copy written on every rank, its shard empty
     * or not: the next load of each, and so its gather, is every rank's. */
    for (int k = 0; k < td_memmgr_role_chunk_count(t->mm, TD_TENSOR_PARAM); k++) {
        void *h;
        TD_TRY(td_memmgr_chunk_host_access(t->mm, td_memmgr_role_chunk(t->mm, TD_TENSOR_PARAM, k), TD_ACCESS_WRITE, &h));
    }
cleanup:
    return st;
}

td_status td_trainer_save(td_trainer *t, const char *dir, int state, const char *const *meta)
{
    return td_trainer_save_files(t, dir, state, meta, NULL);
}

td_status td_trainer_save_files(td_trainer *t, const char *dir, int state, const char *const *meta,
                                const char *const *files)
{
    td_status st = TD_OK;
    td_model_desc cc = t->cfg.model;
    td_ckpt_write_options wo = td_ckpt_write_default_options();
    wo.train_state = state;
    wo.shard_bytes = t->cfg.save_shard_bytes;
    td_ckpt_writer *w = NULL;
    td_ckpt_group group;
    float *tmp = NULL; /* moments not stored as fp32 go through it */
    uint8_t *no_state = NULL;
    TD_TRY(td_trainer_finish_update(t));
    if (state && t->n_live < t->n_tensors) { /* frozen tensors keep no state */
        int nh = td_model_hf_count(&cc);
        if (!(no_state = td_calloc((size_t)nh, 1, TD_ROLE_META))) { st = TD_ERR_NOMEM; goto cleanup; }
        for (int k = 0; k < nh; k++) {
            int i;
            size_t off, numel;
            TD_TRY(ckpt_part(&cc, k, &i, &off, &numel));
            no_state[k] = t->mid[i] < 0;
        }
        wo.no_state = no_state;
    }
    if (state && !(tmp = td_malloc(PIECE * sizeof(float), TD_ROLE_META))) { st = TD_ERR_NOMEM; goto cleanup; }
    if (t->ranks > 1) {
        group = (td_ckpt_group){ .rank = t->rank, .size = t->ranks, .allgather = group_allgather, .arg = t->comm };
        wo.group = &group; /* used until commit */
        TD_TRY(td_ckpt_writer_begin(dir, &cc, &wo, &w));
        td_free(no_state);
        no_state = NULL;
        if (state) TD_TRY(set_state_meta(t, w, meta));
        TD_TRY(td_ckpt_writer_begin_ranges(w));
        TD_TRY(save_shards(t, w, state, tmp));
        goto files;
    }
    TD_TRY(td_ckpt_writer_begin(dir, &cc, &wo, &w));
    td_free(no_state);
    no_state = NULL;
    if (state) TD_TRY(set_state_meta(t, w, meta));
    /* Tensor by tensor from the host copies: never the whole model at once. */
    int n = td_model_hf_count(&cc);
    for (int k = 0; k < n; k++) {
        int i;
        size_t off, numel;
        TD_TRY(ckpt_part(&cc, k, &i, &off, &numel));
        if (t->mid[i] < 0) {
            TD_TRY(frozen_save(t, w, k, i, off, numel, 0));
            continue;
        }
        /* The fp32 master holds the exact weights (the params themselves in fp32). */
        int src = t->sid[i] >= 0 ? t->sid[i] : t->pid[i];
        void *p;
        TD_TRY(td_memmgr_host_access(t->mm, &src, 1, TD_ACCESS_READ, &p));
        TD_TRY(td_ckpt_writer_put_weight(w, k, TD_DTYPE_F32, (float *)p + off));
    }
    for (int k = 0; state && k < n; k++) {
        int i;
        size_t off, numel;
        TD_TRY(ckpt_part(&cc, k, &i, &off, &numel));
        if (t->mid[i] < 0) continue; /* frozen: no state */
        void *p;
        int src = t->sid[i] >= 0 ? t->sid[i] : t->pid[i];
        TD_TRY(td_memmgr_host_access(t->mm, &src, 1, TD_ACCESS_READ, &p));
        TD_TRY(td_ckpt_writer_append_state(w, k, TD_CKPT_STATE_MASTER, (float *)p + off, numel));
        TD_TRY(moment_save(t, w, k, TD_CKPT_STATE_ADAM_M, i, off, numel, tmp));
        TD_TRY(moment_save(t, w, k, TD_CKPT_STATE_ADAM_V, i, off, numel, tmp));
    }
files:
    td_free(tmp);
    tmp = NULL;
    for (int k = 0; files && files[k]; k++) {
        const char *slash = strrchr(files[k], '/');
        TD_TRY(td_ckpt_writer_add_file(w, slash ? slash + 1 : files[k], files[k]));
    }
    st = td_ckpt_writer_commit(w);
    w = NULL; /* commit frees it whatever the outcome */
    if (st) goto cleanup;
    return TD_OK;
cleanup:
    td_free(tmp);
    td_free(no_state);
    td_ckpt_writer_abort(w);
    return td_error_prefix(st, "saving checkpoint %s: ", dir);
}

td_status td_trainer_checkpoint_model(const char *dir, td_model_desc *out)
{
    td_ckpt_reader *r = NULL;
    td_status st = td_ckpt_reader_open(dir, NULL, &r);
    if (st) return st;
    const td_model_desc *c = td_ckpt_reader_config(r);
    *out = *c;
    out->padded_vocab_size = c->padded_vocab_size > c->vocab_size ? c->padded_vocab_size : td_model_pad_vocab(c->vocab_size);
    td_ckpt_reader_close(r);
    return TD_OK;
}

td_status td_trainer_load(td_trainer *t, const char *dir, int state, td_ckpt_reader **reader_out)
{
    td_status st = TD_OK;
    td_model_desc cc = t->cfg.model;
    td_ckpt_reader *r = NULL;
    float *tmp = NULL; /* moments not stored as fp32 go through it */
    if (reader_out) *reader_out = NULL;
    TD_TRY(td_trainer_finish_update(t)); /* nothing pending may overwrite what is loaded */
    TD_TRY(td_ckpt_reader_open(dir, &cc, &r));
    if (state && !td_ckpt_reader_has_state(r))
        TD_FAIL(TD_ERR_INVALID, "%s has no train_state.safetensors: it holds weights only; start from it with "
                "--init instead of --resume", dir);
    if (state) { /* the moments continue only in the type they were stored in (checkpoints before it: fp32) */
        const char *saved = td_ckpt_reader_meta(r, "optim_state");
        td_optim_state ss = TD_OPTIM_STATE_FP32;
        if (saved && td_optim_state_parse(saved, &ss) != TD_OK)
            TD_FAIL(TD_ERR_INVALID, "%s: train_state.safetensors names an unknown optimizer state type '%s'", dir, saved);
        if (ss != t->cfg.optim.state)
            TD_FAIL(TD_ERR_INVALID, "%s was saved with --optim-state %s and this run uses --optim-state %s; resume "
                    "with --optim-state %s (the AdamW moments continue in the type they were kept in)", dir,
                    td_optim_state_name(ss), td_optim_state_name(t->cfg.optim.state), td_optim_state_name(ss));
    }
    if (t->ranks > 1) {
        TD_TRY(load_shards(t, r, state));
    } else {
        int n = td_model_hf_count(&cc);
        for (int k = 0; k < n; k++) {
            int i;
            size_t off, numel;
            TD_TRY(ckpt_part(&cc, k, &i, &off, &numel));
            if (t->mid[i] < 0) { /* frozen: its weights alone, in the compute precision */
                TD_TRY(frozen_load(t, r, k, i, off));
                continue;
            }
            void *p, *master;
            TD_TRY(td_memmgr_host_access(t->mm, &t->pid[i], 1, TD_ACCESS_WRITE, &p));
            master = p;
            if (t->sid[i] >= 0) TD_TRY(td_memmgr_host_access(t->mm, &t->sid[i], 1, TD_ACCESS_WRITE, &master));
            /* the part of the tensor (q, k, v of a fused qkv; gate, up of gate_up) */
            p = (char *)p + off * td_dtype_bytes(t->dt);
            master = (float *)master + off;
            if (state) TD_TRY(td_ckpt_reader_read_state(r, k, TD_CKPT_STATE_MASTER, 0, numel, master)); /* exact */
            else TD_TRY(td_ckpt_reader_get_weight(r, k, TD_DTYPE_F32, master));
            if (master != p) td_train_from_f32(p, t->dt, master, numel);
        }
    }
    if (state) {
        if (!(tmp = td_malloc(PIECE * sizeof(float), TD_ROLE_META))) { st = TD_ERR_NOMEM; goto cleanup; }
        TD_TRY(moments_load(t, r, tmp));
    }
    if (state) {
        uint64_t step, skipped, clean, hyst, overflows;
        double scale;
        TD_TRY(td_ckpt_reader_meta_u64(r, "optim_step", &step));
        TD_TRY(td_ckpt_reader_meta_u64(r, "optim_skipped_steps", &skipped));
        TD_TRY(td_ckpt_reader_meta_f64(r, "loss_scale", &scale));
        TD_TRY(td_ckpt_reader_meta_u64(r, "loss_scale_clean_steps", &clean));
        TD_TRY(td_ckpt_reader_meta_u64(r, "loss_scale_hysteresis_left", &hyst));
        TD_TRY(td_ckpt_reader_meta_u64(r, "loss_scale_overflows", &overflows));
        t->optim.step = (long)step;
        t->optim.skipped_steps = (long)skipped;
        t->optim.scaler.scale = scale;
        t->optim.scaler.clean_steps = (long)clean;
        t->optim.scaler.hysteresis_left = (int)hyst;
        t->optim.scaler.overflows = (long)overflows;
    }
    td_free(tmp);
    if (reader_out) {
        *reader_out = r;
        return TD_OK;
    }
    td_ckpt_reader_close(r);
    return TD_OK;
cleanup:
    td_free(tmp);
    td_ckpt_reader_close(r);
    return td_error_prefix(st, "loading checkpoint %s: ", dir);
}
