/* A LoRA run's adapters as a PEFT adapter folder (trainer.h,
 * td_trainer_save_adapter): adapter_config.json and
 * adapter_model.safetensors as peft's save_pretrained writes them (tensor
 * names "base_model.model.<module path>.lora_A.weight", fp32), which
 * peft.PeftModel.from_pretrained loads over the base; with the train state,
 * adapter_train_state.safetensors beside them: the adapters' AdamW moments
 * (fp32 values), the optimizer's step and the caller's metadata, for
 * --resume.  The base's weights are not copied: the folder names them
 * (base_model_name_or_path). */
#include "train_impl.h"
#include "tidal/alloc.h"
#include "tidal/checkpoint.h"
#include "tidal/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define ADAPTER_CONFIG "adapter_config.json"
#define ADAPTER_MODEL "adapter_model.safetensors"
#define ADAPTER_STATE "adapter_train_state.safetensors"

/* PEFT's name of layout tensor i (an adapter). */
static void peft_name(const td_trainer *t, int i, char *buf, size_t n)
{
    td_model_tensor tt;
    td_model_tensor_get(&t->cfg.model, i, &tt);
    const char *pre = td_model_family_of(&t->cfg.model)->hf_optional_prefix;
    snprintf(buf, n, "base_model.model.%s%s", pre ? pre : "", tt.name);
}

static td_status mkdirs(const char *dir)
{
    char p[4096];
    snprintf(p, sizeof p, "%s", dir);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = '\0';
        if (mkdir(p, 0777) && errno != EEXIST) return td_error_set(TD_ERR_IO, "mkdir %s: %s", p, strerror(errno));
        *s = '/';
    }
    if (mkdir(p, 0777) && errno != EEXIST) return td_error_set(TD_ERR_IO, "mkdir %s: %s", p, strerror(errno));
    return TD_OK;
}

/* The shortest decimal that is f as a float (0.1f: 0.1, not 0.10000000149), as peft's config reads best. */
static double shortest(float f)
{
    char buf[32];
    for (int digits = 1; digits <= 9; digits++) {
        snprintf(buf, sizeof buf, "%.*g", digits, (double)f);
        if ((float)strtod(buf, NULL) == f) return strtod(buf, NULL);
    }
    return f;
}

static td_status write_config(const td_trainer *t, const char *dir, const char *base)
{
    const td_model_lora *l = &t->cfg.model.lora;
    char path[4200], tmp[4210], mods[256];
    td_model_lora_modules(&t->cfg.model, mods, sizeof mods);
    cJSON *j = cJSON_CreateObject(), *tm = cJSON_AddArrayToObject(j, "target_modules");
    for (char *s = mods, *e; s && *s; s = e ? e + 1 : NULL) {
        e = strchr(s, ',');
        if (e) *e = '\0';
        cJSON_AddItemToArray(tm, cJSON_CreateString(s));
    }
    if (base) cJSON_AddStringToObject(j, "base_model_name_or_path", base);
    else cJSON_AddNullToObject(j, "base_model_name_or_path");
    cJSON_AddStringToObject(j, "peft_type", "LORA");
    cJSON_AddStringToObject(j, "task_type", "CAUSAL_LM");
    cJSON_AddNumberToObject(j, "r", l->rank);
    cJSON_AddNumberToObject(j, "lora_alpha", l->alpha);
    cJSON_AddNumberToObject(j, "lora_dropout", shortest(l->dropout));
    cJSON_AddStringToObject(j, "bias", "none");
    /* GPT-2's Conv1D stores (in, out): PEFT's flag for it */
    cJSON_AddBoolToObject(j, "fan_in_fan_out", !strcmp(td_model_family_of(&t->cfg.model)->name, "gpt2"));
    cJSON_AddBoolToObject(j, "inference_mode", 1);
    cJSON_AddBoolToObject(j, "init_lora_weights", 1);
    cJSON_AddBoolToObject(j, "use_rslora", 0);
    cJSON_AddBoolToObject(j, "use_dora", 0);
    cJSON_AddNullToObject(j, "modules_to_save");
    cJSON_AddNullToObject(j, "layers_to_transform");
    cJSON_AddObjectToObject(j, "rank_pattern");
    cJSON_AddObjectToObject(j, "alpha_pattern");
    char *text = cJSON_Print(j);
    cJSON_Delete(j);
    if (!text) return td_error_set(TD_ERR_NOMEM, "writing %s/%s", dir, ADAPTER_CONFIG);
    snprintf(path, sizeof path, "%s/%s", dir, ADAPTER_CONFIG);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    int ok = f && fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    if (f && fclose(f)) ok = 0;
    free(text);
    if (!ok || rename(tmp, path))
        return td_error_set(TD_ERR_IO, "writing %s: %s", path, strerror(errno));
    return TD_OK;
}

/* Layout tensor i's host values as fp32 (its master when the params are not). */
static td_status values_of(td_trainer *t, int i, unsigned flags, float **out)
{
    int src = t->sid[i] >= 0 ? t->sid[i] : t->pid[i];
    return td_memmgr_host_access(t->mm, &src, 1, flags, (void **)out);
}

static int is_adapter(const td_trainer *t, int i)
{
    td_model_tensor tt;
    td_model_tensor_get(&t->cfg.model, i, &tt);
    return TD_MODEL_IS_LORA(tt.kind);
}

/* Layout tensor i when it is an adapter (1): its shape and PEFT name. */
static int adapter_at(const td_trainer *t, int i, td_model_tensor *tt, char *name, size_t n)
{
    if (!is_adapter(t, i)) return 0;
    td_model_tensor_get(&t->cfg.model, i, tt);
    peft_name(t, i, name, n);
    return 1;
}

/* Where layout tensor i lies in the host copy of its chunk of one role
 * (ids: t->sid, t->pid, t->mid or t->vid): the host copy (*buf) holds the
 * chunk's elements [*base, *base + *n); the tensor starts at chunk element
 * *p0, and [*e0, *e1) of it is in the copy: all of it on one rank, the
 * rank's shard's part under ZeRO-3 (maybe none). */
typedef struct host_part { void *buf; size_t base, n, p0, e0, e1; } host_part;

static td_status part_of(td_trainer *t, const int *ids, int i, unsigned flags, host_part *h)
{
    int c = td_memmgr_tensor_chunk(t->mm, ids[i]);
    size_t end, numel = td_memmgr_tensor_numel(t->mm, ids[i]);
    h->n = td_memmgr_chunk_host_range(t->mm, c, &h->base, &end);
    h->p0 = td_memmgr_tensor_offset(t->mm, ids[i]);
    h->e0 = h->p0 > h->base ? h->p0 : h->base;
    h->e1 = h->p0 + numel < h->base + h->n ? h->p0 + numel : h->base + h->n;
    if (h->e1 < h->e0) h->e1 = h->e0;
    return td_memmgr_chunk_host_access(t->mm, c, flags, &h->buf);
}

/* The whole of a tensor of numel elements into out, from each rank's part
 * of it (mine holds this rank's [e0, e1) in tensor coordinates, the rest
 * anything): on several ranks every rank's part is exchanged and each
 * element taken from a rank that holds it.  One rank: mine is the whole. */
static td_status assemble(td_trainer *t, float *mine, size_t numel, size_t e0, size_t e1, float *out, float *all)
{
    if (t->ranks <= 1) {
        if (out != mine) memcpy(out, mine, numel * sizeof(float));
        return TD_OK;
    }
    uint64_t range[2] = {e0, e1}, *ranges = (uint64_t *)all; /* all: at least 2 x ranks x numel floats */
    td_status st = td_comm_host_allgather(t->comm, range, sizeof range, ranges);
    uint64_t *saved = td_malloc((size_t)t->ranks * sizeof range, TD_ROLE_META);
    if (!saved) return TD_ERR_NOMEM;
    if (!st) memcpy(saved, ranges, (size_t)t->ranks * sizeof range);
    if (!st) st = td_comm_host_allgather(t->comm, mine, numel * sizeof(float), all);
    for (int r = 0; !st && r < t->ranks; r++)
        if (saved[2 * r + 1] > saved[2 * r])
            memcpy(out + saved[2 * r], all + (size_t)r * numel + saved[2 * r],
                   (saved[2 * r + 1] - saved[2 * r]) * sizeof(float));
    td_free(saved);
    return st;
}

/* Adapter tensor i's values (fp32: its master when the params are not) or
 * AdamW moment m (0: m, 1: v; which < 0: the values), whole, into out. */
static td_status gather(td_trainer *t, int i, int which, float *mine, float *out, float *all)
{
    host_part h;
    const int *ids = which < 0 ? (t->sid[i] >= 0 ? t->sid : t->pid) : which ? t->vid : t->mid;
    td_status st = part_of(t, ids, i, TD_ACCESS_READ, &h);
    if (st) return st;
    size_t numel = td_memmgr_tensor_numel(t->mm, t->pid[i]);
    if (which < 0) memcpy(mine + (h.e0 - h.p0), (float *)h.buf + (h.e0 - h.base), (h.e1 - h.e0) * sizeof(float));
    else if (h.e1 > h.e0 &&
             (st = td_adam_moment_read(t->cfg.optim.state, which ? TD_ADAM_MOMENT_V : TD_ADAM_MOMENT_M, h.buf, h.n,
                                       h.e0 - h.base, h.e1 - h.base, mine + (h.e0 - h.p0))))
        return st;
    return assemble(t, mine, numel, h.e0 - h.p0, h.e1 - h.p0, out, all);
}

td_status td_trainer_save_adapter(td_trainer *t, const char *dir, const char *base, int state,
                                  const char *const *meta)
{
    td_status st = TD_OK;
    td_st_writer *w = NULL, *sw = NULL;
    float *mine = NULL, *out = NULL, *all = NULL;
    char path[4200];
    const td_model_desc *d = &t->cfg.model;
    const int lead = t->rank == 0; /* on several ranks, every rank gathers and rank 0 writes */
    if (d->lora.rank <= 0) return td_error_set(TD_ERR_INVALID, "saving an adapter: the run trains no LoRA adapters");
    if (state && t->cfg.optim.state == TD_OPTIM_STATE_INT8)
        return td_error_set(TD_ERR_UNSUPPORTED, "an adapter's train state keeps fp32 or bf16 moments; train LoRA "
                            "with --optim-state fp32 or bf16 to --save it with its state");
    TD_TRY(td_trainer_finish_update(t));
    int n = t->n_tensors;
    size_t big = 0;
    for (int i = 0; i < n; i++)
        if (is_adapter(t, i) && td_memmgr_tensor_numel(t->mm, t->pid[i]) > big) big = td_memmgr_tensor_numel(t->mm, t->pid[i]);
    size_t all_n = t->ranks > 1 ? (size_t)t->ranks * (big > 4 ? big : 4) : 1;
    mine = td_calloc(big + 1, sizeof(float), TD_ROLE_META);
    out = td_calloc(big + 1, sizeof(float), TD_ROLE_META);
    all = td_calloc(all_n, sizeof(float), TD_ROLE_META);
    if (!mine || !out || !all) { st = TD_ERR_NOMEM; goto cleanup; }
    if (lead) {
        TD_TRY(mkdirs(dir));
        snprintf(path, sizeof path, "%s/%s", dir, ADAPTER_MODEL);
        TD_TRY(td_st_writer_create(path, &w));
        TD_TRY(td_st_writer_add_metadata(w, "format", "pt"));
        for (int i = 0; i < n; i++) {
            td_model_tensor tt;
            char name[160];
            if (!adapter_at(t, i, &tt, name, sizeof name)) continue;
            uint64_t shape[2] = {(uint64_t)tt.shape[0], (uint64_t)tt.shape[1]};
            TD_TRY(td_st_writer_declare(w, name, TD_ST_F32, 2, shape, NULL));
        }
    }
    for (int i = 0, k = 0; i < n; i++) {
        if (!is_adapter(t, i)) continue;
        TD_TRY(gather(t, i, -1, mine, out, all));
        if (lead) TD_TRY(td_st_writer_write(w, (size_t)k++, out, td_memmgr_tensor_numel(t->mm, t->pid[i]) * sizeof(float)));
    }
    if (lead) {
        TD_TRY(td_st_writer_commit(w));
        w = NULL;
        TD_TRY(write_config(t, dir, base));
    }
    if (!state) goto cleanup;
    if (lead) {
        snprintf(path, sizeof path, "%s/%s", dir, ADAPTER_STATE);
        TD_TRY(td_st_writer_create(path, &sw));
        TD_TRY(td_st_writer_add_metadata(sw, "format", "tidal-adapter-train-state"));
        char num[32];
        snprintf(num, sizeof num, "%ld", t->optim.step);
        TD_TRY(td_st_writer_add_metadata(sw, "optim_step", num));
        snprintf(num, sizeof num, "%ld", t->optim.skipped_steps);
        TD_TRY(td_st_writer_add_metadata(sw, "optim_skipped_steps", num));
        TD_TRY(td_st_writer_add_metadata(sw, "optim_state", td_optim_state_name(t->cfg.optim.state)));
        snprintf(num, sizeof num, "%.9g", (double)t->cfg.model.lora.dropout); /* a resume keeps the run's masks */
        TD_TRY(td_st_writer_add_metadata(sw, "lora_dropout", num));
        for (int k = 0; meta && meta[k] && meta[k + 1]; k += 2)
            TD_TRY(td_st_writer_add_metadata(sw, meta[k], meta[k + 1]));
        for (int i = 0; i < n; i++) {
            td_model_tensor tt;
            char name[160], full[176];
            if (!adapter_at(t, i, &tt, name, sizeof name)) continue;
            uint64_t shape[2] = {(uint64_t)tt.shape[0], (uint64_t)tt.shape[1]};
            for (int m = 0; m < 2; m++) {
                snprintf(full, sizeof full, "%s.%s", m ? "adam_v" : "adam_m", name);
                TD_TRY(td_st_writer_declare(sw, full, TD_ST_F32, 2, shape, NULL));
            }
        }
    }
    for (int i = 0, k = 0; i < n; i++) {
        if (!is_adapter(t, i)) continue;
        for (int m = 0; m < 2; m++) {
            TD_TRY(gather(t, i, m, mine, out, all));
            if (lead)
                TD_TRY(td_st_writer_write(sw, (size_t)k++, out, td_memmgr_tensor_numel(t->mm, t->pid[i]) * sizeof(float)));
        }
    }
    if (lead) {
        TD_TRY(td_st_writer_commit(sw));
        sw = NULL;
    }
cleanup:
    td_free(mine);
    td_free(out);
    td_free(all);
    td_st_writer_abort(w);
    td_st_writer_abort(sw);
    return st ? td_error_prefix(st, "saving adapter %s: ", dir) : TD_OK;
}

/* A tensor of f named `name`, F32 of the shape of layout tensor i. */
static td_status tensor_in(const td_st_reader *f, const char *name, const td_model_tensor *tt, const td_st_tensor **out)
{
    td_status st = td_st_get(f, name, out);
    if (st) return st;
    const td_st_tensor *x = *out;
    if (x->ndim != 2 || (int64_t)x->shape[0] != tt->shape[0] || (int64_t)x->shape[1] != tt->shape[1])
        return td_error_set(TD_ERR_INVALID, "%s: '%s' is %lld x %lld, this model's is %d x %d (another rank, "
                            "targets or base model?)", td_st_path(f), name, x->ndim > 0 ? (long long)x->shape[0] : 0,
                            x->ndim > 1 ? (long long)x->shape[1] : 0, tt->shape[0], tt->shape[1]);
    return TD_OK;
}

td_status td_trainer_load_adapter(td_trainer *t, const char *dir, int state)
{
    td_status st = TD_OK;
    td_st_reader *f = NULL, *sf = NULL;
    float *tmp = NULL;
    char path[4200];
    const td_model_desc *d = &t->cfg.model;
    if (d->lora.rank <= 0) return td_error_set(TD_ERR_INVALID, "loading adapter %s: the run has no LoRA adapters "
                                               "(give --lora-rank and --lora-targets as saved)", dir);
    TD_TRY(td_trainer_finish_update(t));
    snprintf(path, sizeof path, "%s/%s", dir, ADAPTER_MODEL);
    TD_TRY(td_st_open(path, &f));
    int n = t->n_tensors, found = 0;
    size_t big = 0;
    for (int i = 0; i < n; i++)
        if (is_adapter(t, i) && td_memmgr_tensor_numel(t->mm, t->pid[i]) > big) big = td_memmgr_tensor_numel(t->mm, t->pid[i]);
    if (!(tmp = td_malloc(big * sizeof(float) + 1, TD_ROLE_META))) { st = TD_ERR_NOMEM; goto cleanup; }
    for (int i = 0; i < n; i++) {
        td_model_tensor tt;
        const td_st_tensor *x;
        char name[160];
        if (!adapter_at(t, i, &tt, name, sizeof name)) continue;
        TD_TRY(tensor_in(f, name, &tt, &x));
        TD_TRY(td_st_read(f, x, 0, tt.numel, TD_ST_F32, tmp));
        /* each rank's host copy takes its part (all of it on one rank) */
        host_part h;
        TD_TRY(part_of(t, t->sid[i] >= 0 ? t->sid : t->pid, i, TD_ACCESS_WRITE, &h));
        memcpy((float *)h.buf + (h.e0 - h.base), tmp + (h.e0 - h.p0), (h.e1 - h.e0) * sizeof(float));
        if (t->sid[i] >= 0) { /* 16-bit params from the master */
            TD_TRY(part_of(t, t->pid, i, TD_ACCESS_WRITE, &h));
            td_train_from_f32((char *)h.buf + (h.e0 - h.base) * td_dtype_bytes(t->dt), t->dt, tmp + (h.e0 - h.p0),
                              h.e1 - h.e0);
        }
        found++;
    }
    if (!state) goto cleanup;
    snprintf(path, sizeof path, "%s/%s", dir, ADAPTER_STATE);
    TD_TRY(td_st_open(path, &sf));
    const char *saved = td_st_metadata(sf, "optim_state"), *step = td_st_metadata(sf, "optim_step");
    const char *skipped = td_st_metadata(sf, "optim_skipped_steps");
    if (!saved || !step || !skipped) TD_FAIL(TD_ERR_INVALID, "%s: no optimizer step in its metadata", path);
    if (strcmp(saved, td_optim_state_name(t->cfg.optim.state)))
        TD_FAIL(TD_ERR_INVALID, "%s was saved with --optim-state %s; resume with --optim-state %s", path, saved, saved);
    const char *p = td_st_metadata(sf, "lora_dropout"); /* absent: saved before dropout trained, so 0 */
    const float was = p ? (float)strtod(p, NULL) : 0.0f;
    if (was != d->lora.dropout)
        TD_FAIL(TD_ERR_INVALID, "%s was trained with --lora-dropout %g and this run has %g: resume with the folder's "
                "(its adapter_config.json's lora_dropout)", path, (double)was, (double)d->lora.dropout);
    for (int i = 0; i < n; i++) {
        td_model_tensor tt;
        char name[160], full[176];
        if (!adapter_at(t, i, &tt, name, sizeof name)) continue;
        for (int m = 0; m < 2; m++) {
            const td_st_tensor *x;
            host_part h;
            snprintf(full, sizeof full, "%s.%s", m ? "adam_v" : "adam_m", name);
            TD_TRY(tensor_in(sf, full, &tt, &x));
            TD_TRY(td_st_read(sf, x, 0, tt.numel, TD_ST_F32, tmp));
            TD_TRY(part_of(t, m ? t->vid : t->mid, i, TD_ACCESS_WRITE, &h));
            if (h.e1 > h.e0)
                TD_TRY(td_adam_moment_write(t->cfg.optim.state, m ? TD_ADAM_MOMENT_V : TD_ADAM_MOMENT_M, h.buf, h.n,
                                            h.e0 - h.base, h.e1 - h.base, tmp + (h.e0 - h.p0)));
        }
    }
    t->optim.step = strtol(step, NULL, 10);
    t->optim.skipped_steps = strtol(skipped, NULL, 10);
cleanup:
    (void)found;
    td_free(tmp);
    td_st_close(f);
    td_st_close(sf);
    return st ? td_error_prefix(st, "loading adapter %s: ", dir) : TD_OK;
}

const char *td_trainer_adapter_meta(const char *dir, const char *key, char *buf, size_t n)
{
    char path[4200];
    td_st_reader *sf = NULL;
    snprintf(path, sizeof path, "%s/%s", dir, ADAPTER_STATE);
    if (td_st_open(path, &sf)) return NULL;
    const char *v = td_st_metadata(sf, key);
    if (v) snprintf(buf, n, "%s", v);
    td_st_close(sf);
    return v ? buf : NULL;
}

/* Hugging Face part k of the merged model (its numel floats) into dst: the
 * base's values with s B A added on the rows a target covers. */
static td_status merged_part(td_trainer *t, int k, float *dst)
{
    td_status st = TD_OK;
    const td_model_desc *d = &t->cfg.model;
    const int nt = td_model_lora_count(d), R = d->lora.rank;
    const float s = d->lora.alpha / (float)R;
    const int ne = td_model_embed_tensor_count(d), nb = td_model_block_tensor_count(d);
    td_model_hf_tensor h;
    td_model_tensor tt;
    void *p;
    TD_TRY(td_model_hf_get(d, k, &h));
    td_model_tensor_get(d, h.tensor, &tt);
    size_t numel = h.numel;
    int src = t->sid[h.tensor] >= 0 ? t->sid[h.tensor] : t->pid[h.tensor];
    TD_TRY(td_memmgr_host_access(t->mm, &src, 1, TD_ACCESS_READ, &p));
    if (t->sid[h.tensor] >= 0 || t->dt == TD_DTYPE_F32) memcpy(dst, (float *)p + h.offset, numel * sizeof(float));
    else td_train_to_f32(dst, (char *)p + h.offset * td_dtype_bytes(t->dt), t->dt, numel);
    /* W[o, c] += s sum_r B[o - row0, r] A[r, c] on the rows of this part that a target covers */
    for (int j = 0; tt.layer >= 0 && tt.ndim == 2 && j < nt; j++) {
        td_model_lora_target tg;
        td_model_lora_target_get(d, j, &tg);
        if (tg.kind != tt.kind) continue;
        const int in = tt.shape[1], r0 = (int)(h.offset / (uint64_t)in), r1 = r0 + (int)(numel / (size_t)in);
        const int lo = r0 > tg.row0 ? r0 : tg.row0, hi = r1 < tg.row0 + tg.rows ? r1 : tg.row0 + tg.rows;
        if (lo >= hi) continue;
        int ia = -1, ib = -1;
        for (int q = ne + tt.layer * nb; q < ne + (tt.layer + 1) * nb; q++) {
            td_model_tensor tq;
            td_model_tensor_get(d, q, &tq);
            if (tq.kind == TD_MODEL_LORA_A(j)) ia = q;
            if (tq.kind == TD_MODEL_LORA_B(j)) ib = q;
        }
        float *A, *Bm;
        TD_TRY(values_of(t, ia, TD_ACCESS_READ, &A));
        TD_TRY(values_of(t, ib, TD_ACCESS_READ, &Bm));
        for (int o = lo; o < hi; o++)
            for (int c = 0; c < in; c++) {
                float acc = 0.0f;
                for (int r = 0; r < R; r++) acc += Bm[(size_t)(o - tg.row0) * R + r] * A[(size_t)r * in + c];
                dst[(size_t)(o - r0) * in + c] += s * acc;
            }
    }
cleanup:
    return st;
}

td_status td_trainer_merged_params(td_trainer *t, float *out)
{
    td_status st = TD_OK;
    const td_model_desc *d = &t->cfg.model;
    td_model_desc base = *d;
    base.lora = (td_model_lora){0};
    if (d->lora.rank <= 0) return td_error_set(TD_ERR_INVALID, "merging: the run has no LoRA adapters");
    TD_TRY(td_trainer_finish_update(t));
    for (int k = 0; k < td_model_hf_count(&base); k++) {
        td_model_hf_tensor h;
        td_model_tensor bt;
        TD_TRY(td_model_hf_get(&base, k, &h));
        td_model_tensor_get(&base, h.tensor, &bt);
        TD_TRY(merged_part(t, k, out + bt.offset + h.offset));
    }
cleanup:
    return st;
}

td_status td_trainer_save_merged(td_trainer *t, const char *dir)
{
    td_status st = TD_OK;
    const td_model_desc *d = &t->cfg.model;
    td_model_desc base = *d;
    base.lora = (td_model_lora){0};
    td_ckpt_writer *w = NULL;
    float *tmp = NULL;
    if (d->lora.rank <= 0) return td_error_set(TD_ERR_INVALID, "merging: the run has no LoRA adapters");
    TD_TRY(td_trainer_finish_update(t));
    td_ckpt_write_options wo = td_ckpt_write_default_options();
    wo.train_state = 0;
    wo.shard_bytes = t->cfg.save_shard_bytes;
    TD_TRY(td_ckpt_writer_begin(dir, &base, &wo, &w));
    for (int k = 0; k < td_model_hf_count(d); k++) {
        td_model_hf_tensor h;
        TD_TRY(td_model_hf_get(d, k, &h));
        td_free(tmp);
        if (!(tmp = td_malloc(h.numel * sizeof(float) + 1, TD_ROLE_META))) { st = TD_ERR_NOMEM; goto cleanup; }
        TD_TRY(merged_part(t, k, tmp));
        TD_TRY(td_ckpt_writer_put_weight(w, k, TD_DTYPE_F32, tmp));
    }
    st = td_ckpt_writer_commit(w);
    w = NULL;
cleanup:
    td_free(tmp);
    td_ckpt_writer_abort(w);
    return st ? td_error_prefix(st, "merging into %s: ", dir) : TD_OK;
}
