/* Checkpoints of a trainer: its weights (the fp32 master), and with `state`
 * its AdamW state and step, written tensor by tensor from the host copies
 * through checkpoint/ (format in docs/checkpoints.md). */
#include "train_impl.h"
#include "tidal/checkpoint.h"

#include <string.h>

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
        void *p, *m, *v;
        int src = t->sid[i] >= 0 ? t->sid[i] : t->pid[i];
        TD_TRY(td_memmgr_host_access(t->mm, &src, 1, TD_ACCESS_READ, &p));
        TD_TRY(td_memmgr_host_access(t->mm, &t->mid[i], 1, TD_ACCESS_READ, &m));
        TD_TRY(td_memmgr_host_access(t->mm, &t->vid[i], 1, TD_ACCESS_READ, &v));
        TD_TRY(td_ckpt_writer_append_state(w, k, TD_CKPT_STATE_MASTER, (float *)p + off, numel));
        TD_TRY(td_ckpt_writer_append_state(w, k, TD_CKPT_STATE_ADAM_M, (float *)m + off, numel));
        TD_TRY(td_ckpt_writer_append_state(w, k, TD_CKPT_STATE_ADAM_V, (float *)v + off, numel));
    }
    for (int k = 0; files && files[k]; k++) {
        const char *slash = strrchr(files[k], '/');
        TD_TRY(td_ckpt_writer_add_file(w, slash ? slash + 1 : files[k], files[k]));
    }
    st = td_ckpt_writer_commit(w);
    w = NULL; /* commit frees it whatever the outcome */
    if (st) goto cleanup;
    return TD_OK;
cleanup:
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
    if (reader_out) *reader_out = NULL;
    TD_TRY(td_trainer_finish_update(t)); /* nothing pending may overwrite what is loaded */
    TD_TRY(td_ckpt_reader_open(dir, &cc, &r));
    if (state && !td_ckpt_reader_has_state(r))
        TD_FAIL(TD_ERR_INVALID, "%s has no train_state.safetensors: it holds weights only; start from it with "
                "--init instead of --resume", dir);
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
            void *m, *v;
            TD_TRY(td_memmgr_host_access(t->mm, &t->mid[i], 1, TD_ACCESS_WRITE, &m));
            TD_TRY(td_memmgr_host_access(t->mm, &t->vid[i], 1, TD_ACCESS_WRITE, &v));
            TD_TRY(td_ckpt_reader_read_state(r, k, TD_CKPT_STATE_ADAM_M, 0, numel, (float *)m + off));
            TD_TRY(td_ckpt_reader_read_state(r, k, TD_CKPT_STATE_ADAM_V, 0, numel, (float *)v + off));
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
    if (reader_out) {
        *reader_out = r;
        return TD_OK;
    }
    td_ckpt_reader_close(r);
    return TD_OK;
cleanup:
    td_ckpt_reader_close(r);
    return td_error_prefix(st, "loading checkpoint %s: ", dir);
}
