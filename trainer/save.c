/* Checkpoints of a trainer: its weights (the fp32 master), and with `state`
 * its AdamW state and step, written tensor by tensor from the host copies
 * through checkpoint/ (format in docs/checkpoints.md). */
#include "train_impl.h"
#include "tidal/checkpoint.h"

#include <string.h>

/* Moments travel as fp32 values whatever --optim-state keeps them in (the
 * state type is in the metadata), in pieces of MOMENT_PIECE elements
 * through a small buffer: a save or load takes no more heap than that. */
#define MOMENT_PIECE ((size_t)1 << 20)

static td_status moments_unsupported(const td_trainer *t)
{
    return td_error_set(TD_ERR_UNSUPPORTED, "checkpoints of --optim-state %s moments are not built yet",
                        td_optim_state_name(t->cfg.optim.state));
}

/* Appends m or v (memmgr id) of checkpoint param k, elements [off, off + numel) of the tensor. */
static td_status moment_save(td_trainer *t, td_ckpt_writer *w, int k, td_ckpt_state kind, int id, size_t off,
                             size_t numel, float *tmp)
{
    void *p;
    td_status st = td_memmgr_host_access(t->mm, &id, 1, TD_ACCESS_READ, &p);
    if (st) return st;
    if (t->cfg.optim.state == TD_OPTIM_STATE_FP32) return td_ckpt_writer_append_state(w, k, kind, (float *)p + off, numel);
    if (t->cfg.optim.state != TD_OPTIM_STATE_BF16) return moments_unsupported(t);
    for (size_t at = 0; at < numel; at += MOMENT_PIECE) {
        size_t n = numel - at < MOMENT_PIECE ? numel - at : MOMENT_PIECE;
        td_train_to_f32(tmp, (const uint16_t *)p + off + at, TD_DTYPE_BF16, n);
        if ((st = td_ckpt_writer_append_state(w, k, kind, tmp, n))) return st;
    }
    return TD_OK;
}

/* Reads m or v of checkpoint param k into elements [off, off + numel) of the moment buffer. */
static td_status moment_load(td_trainer *t, const td_ckpt_reader *r, int k, td_ckpt_state kind, int id, size_t off,
                             size_t numel, float *tmp)
{
    void *p;
    td_status st = td_memmgr_host_access(t->mm, &id, 1, TD_ACCESS_WRITE, &p);
    if (st) return st;
    if (t->cfg.optim.state == TD_OPTIM_STATE_FP32) return td_ckpt_reader_read_state(r, k, kind, 0, numel, (float *)p + off);
    if (t->cfg.optim.state != TD_OPTIM_STATE_BF16) return moments_unsupported(t);
    for (size_t at = 0; at < numel; at += MOMENT_PIECE) {
        size_t n = numel - at < MOMENT_PIECE ? numel - at : MOMENT_PIECE;
        if ((st = td_ckpt_reader_read_state(r, k, kind, at, n, tmp))) return st;
        td_train_from_f32((uint16_t *)p + off + at, TD_DTYPE_BF16, tmp, n);
    }
    return TD_OK;
}

/* Checkpoint parameter k: the tidal tensor it is (a part of), and the part's first element. */
static td_status ckpt_part(const td_ckpt_config *cc, int k, int *index, size_t *offset, size_t *numel)
{
    td_ckpt_param cp;
    td_status st = td_ckpt_param_get(cc, k, &cp);
    if (st) return st;
    *index = cp.tensor;
    *offset = (size_t)cp.offset;
    *numel = (size_t)cp.numel;
    return TD_OK;
}

td_status td_trainer_save(td_trainer *t, const char *dir, int state, const char *const *meta)
{
    return td_trainer_save_files(t, dir, state, meta, NULL);
}

td_status td_trainer_save_files(td_trainer *t, const char *dir, int state, const char *const *meta,
                                const char *const *files)
{
    td_status st = TD_OK;
    td_ckpt_config cc = t->cfg.model;
    td_ckpt_write_options wo = td_ckpt_write_default_options();
    wo.train_state = state;
    wo.shard_bytes = t->cfg.save_shard_bytes;
    td_ckpt_writer *w = NULL;
    float *tmp = NULL; /* moments not stored as fp32 go through it */
    TD_TRY(td_trainer_finish_update(t));
    TD_TRY(td_ckpt_writer_begin(dir, &cc, &wo, &w));
    if (state) {
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
    }
    /* Tensor by tensor from the host copies: never the whole model at once. */
    int n = td_ckpt_param_count(&cc);
    for (int k = 0; k < n; k++) {
        int i;
        size_t off, numel;
        TD_TRY(ckpt_part(&cc, k, &i, &off, &numel));
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
        void *p;
        int src = t->sid[i] >= 0 ? t->sid[i] : t->pid[i];
        if (t->cfg.optim.state != TD_OPTIM_STATE_FP32 && !tmp &&
            !(tmp = td_malloc(MOMENT_PIECE * sizeof(float), TD_ROLE_META))) { st = TD_ERR_NOMEM; goto cleanup; }
        TD_TRY(td_memmgr_host_access(t->mm, &src, 1, TD_ACCESS_READ, &p));
        TD_TRY(td_ckpt_writer_append_state(w, k, TD_CKPT_STATE_MASTER, (float *)p + off, numel));
        TD_TRY(moment_save(t, w, k, TD_CKPT_STATE_ADAM_M, t->mid[i], off, numel, tmp));
        TD_TRY(moment_save(t, w, k, TD_CKPT_STATE_ADAM_V, t->vid[i], off, numel, tmp));
    }
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
    td_ckpt_writer_abort(w);
    return td_error_prefix(st, "saving checkpoint %s: ", dir);
}

td_status td_trainer_checkpoint_model(const char *dir, td_gpt_ref_config *out)
{
    td_ckpt_reader *r = NULL;
    td_status st = td_ckpt_reader_open(dir, NULL, &r);
    if (st) return st;
    const td_ckpt_config *c = td_ckpt_reader_config(r);
    *out = *c;
    out->padded_vocab_size = c->padded_vocab_size > c->vocab_size ? c->padded_vocab_size : td_model_pad_vocab(c->vocab_size);
    td_ckpt_reader_close(r);
    return TD_OK;
}

td_status td_trainer_load(td_trainer *t, const char *dir, int state, td_ckpt_reader **reader_out)
{
    td_status st = TD_OK;
    td_ckpt_config cc = t->cfg.model;
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
    int n = td_ckpt_param_count(&cc);
    for (int k = 0; k < n; k++) {
        int i;
        size_t off, numel;
        TD_TRY(ckpt_part(&cc, k, &i, &off, &numel));
        void *p, *master;
        TD_TRY(td_memmgr_host_access(t->mm, &t->pid[i], 1, TD_ACCESS_WRITE, &p));
        master = p;
        if (t->sid[i] >= 0) TD_TRY(td_memmgr_host_access(t->mm, &t->sid[i], 1, TD_ACCESS_WRITE, &master));
        /* the part of the tensor (q, k, v of a fused qkv; gate, up of gate_up) */
        p = (char *)p + off * td_dtype_bytes(t->dt);
        master = (float *)master + off;
        if (state) { /* the fp32 master holds the exact weights */
            TD_TRY(td_ckpt_reader_read_state(r, k, TD_CKPT_STATE_MASTER, 0, numel, master));
            if (t->cfg.optim.state != TD_OPTIM_STATE_FP32 && !tmp &&
                !(tmp = td_malloc(MOMENT_PIECE * sizeof(float), TD_ROLE_META))) { st = TD_ERR_NOMEM; goto cleanup; }
            TD_TRY(moment_load(t, r, k, TD_CKPT_STATE_ADAM_M, t->mid[i], off, numel, tmp));
            TD_TRY(moment_load(t, r, k, TD_CKPT_STATE_ADAM_V, t->vid[i], off, numel, tmp));
        } else {
            TD_TRY(td_ckpt_reader_get_weight(r, k, TD_DTYPE_F32, master));
        }
        if (master != p) td_train_from_f32(p, t->dt, master, numel);
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
