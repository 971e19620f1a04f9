/* The options shared by `tidal train`, `tidal plan` and `tidal tune`, and
 * the step from them to a td_train_config (see train_opts.h). */
#include "train_opts.h"
#include <cjson/cJSON.h>
#include "tidal/checkpoint.h"
#include "tidal/data.h"
#include "tidal/util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

void td_cli_train_opts_defaults(td_cli_train_opts *o)
{
    memset(o, 0, sizeof *o);
    o->model = "tiny";
    o->steps = 100;
    o->seed = 1337;
    o->micro_batch = 4;
    o->grad_accum = 1;
    o->seq = 64;
    o->prefetch = -1;
    o->grad_slots = -1;
    o->lr = 1e-3;
    o->min_lr = -1;
    o->warmup = -1;
    o->weight_decay = 0.1;
    o->clip = 1.0;
    o->policy = "auto";
    o->shard = "auto";
    o->eviction = "belady";
    o->precision = "fp32";
    o->optim_state = "fp32";
    o->adam_thread = "auto";
    o->ckpt = "auto";
    o->schedule = "cosine";
    o->backend = "auto";
    o->log_every = 10;
    o->max_bad_steps = 10;
}

int td_cli_seen(td_opt *table, const char *name)
{
    td_opt *o = td_args_find(table, name);
    return o && o->seen;
}

int td_cli_config_exit(td_status st) { return st == TD_ERR_NOMEM ? 1 : 2; }

int td_cli_adapter_read(const char *dir, char *base, size_t base_n, int *rank, double *alpha, double *dropout,
                        char *targets, size_t targets_n)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char text[65536];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    cJSON *j = cJSON_Parse(text);
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(j, "base_model_name_or_path");
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(j, "r"), *a = cJSON_GetObjectItemCaseSensitive(j, "lora_alpha");
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(j, "lora_dropout");
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(j, "target_modules"), *e;
    if (!j || !cJSON_IsNumber(r) || !cJSON_IsNumber(a) || !cJSON_IsArray(t)) {
        cJSON_Delete(j);
        td_error_set(TD_ERR_INVALID, "%s: not a LoRA adapter_config.json (r, lora_alpha and target_modules are needed)",
                     path);
        return -1;
    }
    snprintf(base, base_n, "%s", cJSON_IsString(b) ? b->valuestring : "");
    *rank = r->valueint;
    *alpha = a->valuedouble;
    *dropout = cJSON_IsNumber(p) ? p->valuedouble : 0;
    size_t at = 0;
    targets[0] = '\0';
    cJSON_ArrayForEach(e, t)
        if (cJSON_IsString(e) && at < targets_n)
            at += (size_t)snprintf(targets + at, targets_n - at, "%s%s", at ? "," : "", e->valuestring);
    cJSON_Delete(j);
    return 1;
}

td_status td_cli_adapter_model(const char *dir, const char *base_opt, td_model_desc *model, char *base, size_t base_n,
                               int *found)
{
    char targets[512];
    int rank = 0;
    double alpha = 0, dropout = 0;
    *found = td_cli_adapter_read(dir, base, base_n, &rank, &alpha, &dropout, targets, sizeof targets);
    if (*found < 0) return TD_ERR_INVALID;
    if (!*found) return TD_OK;
    if (base_opt) snprintf(base, base_n, "%s", base_opt);
    if (!base[0])
        return td_error_set(TD_ERR_INVALID, "%s is a LoRA adapter folder naming no base model "
                            "(base_model_name_or_path): give --base DIR", dir);
    td_status st = td_trainer_checkpoint_model(base, model);
    if (st) return td_error_prefix(st, "the base model %s of the adapter folder %s: ", base, dir);
    /* trained without dropout or with: the model the adapters make is the same */
    if ((st = td_model_lora_set(model, rank, (float)alpha, 0.0f, targets))) return td_error_prefix(st, "%s: ", dir);
    return TD_OK;
}

/* A preset names a model of a vocabulary; trained on a token file of
 * another, the model takes the file's, and its size changes: say so. */
static void vocab_note(const char *preset, const td_model_desc *m, int vocab, char *note)
{
    td_model_desc as_run = *m;
    as_run.vocab_size = vocab;
    as_run.padded_vocab_size = td_model_pad_vocab(vocab);
    double before = (double)td_model_params_numel(m), after = (double)td_model_params_numel(&as_run);
    int n = snprintf(note, 512, "--model %s has a vocabulary of %d tokens (%.1fM params); the token file's is %d, so "
                     "the model takes that: %.1fM params", preset, m->vocab_size, before / 1e6, vocab, after / 1e6);
    if (vocab < m->vocab_size && n > 0 && n < 512)
        snprintf(note + n, 512 - (size_t)n, ". Give --vocab %d to keep the preset's (its extra rows are never trained)",
                 m->vocab_size);
}

/* With --resume or --init, the shape flags of the original command may stay
 * on the command line: each must agree with the checkpoint (a preset's
 * layers, width and heads; --vocab the checkpoint's vocabulary). */
static td_status shape_agrees(const td_cli_train_opts *o, td_opt *table, const td_model_desc *preset,
                              const td_model_desc *ck, const char *how, const char *from)
{
    struct { const char *flag; int seen, asked, have; } f[] = {
        {"model", td_cli_seen(table, "model"), 0, 0},
        {"layers", td_cli_seen(table, "layers"), o->layers, ck->n_layer},
        {"width", td_cli_seen(table, "width"), o->width, ck->n_embd},
        {"heads", td_cli_seen(table, "heads"), o->heads, ck->n_head},
        {"vocab", td_cli_seen(table, "vocab"), o->vocab, ck->vocab_size},
        {"kv-heads", td_cli_seen(table, "kv-heads"), o->kv_heads, td_model_kv_heads(ck)},
        {"mlp-width", td_cli_seen(table, "mlp-width"), o->mlp_width, td_model_mlp_width(ck)},
    };
    if (f[0].seen && (preset->n_layer != ck->n_layer || preset->n_embd != ck->n_embd || preset->n_head != ck->n_head) &&
        !f[1].seen && !f[2].seen && !f[3].seen)
        return td_error_set(TD_ERR_INVALID, "--model %s (%d layers, %d wide, %d heads) differs from the checkpoint "
                            "%s given to --%s (%d layers, %d wide, %d heads); drop --model or use the run's own",
                            o->model, preset->n_layer, preset->n_embd, preset->n_head, from, how, ck->n_layer,
                            ck->n_embd, ck->n_head);
    for (size_t i = 1; i < sizeof f / sizeof f[0]; i++)
        if (f[i].seen && f[i].asked != f[i].have)
            return td_error_set(TD_ERR_INVALID, "--%s %d differs from the checkpoint %s given to --%s, which has %d; "
                                "drop --%s or make it %d", f[i].flag, f[i].asked, from, how, f[i].have, f[i].flag,
                                f[i].have);
    return TD_OK;
}

/* --model: a preset's name, or a Hugging Face config.json (a path, or a
 * folder holding one) whose architecture is trained from fresh weights. */
static td_status model_of(const char *name, td_model_desc *out)
{
    size_t n = strlen(name);
    struct stat sb;
    int path = strchr(name, '/') || (n >= 5 && !strcmp(name + n - 5, ".json"));
    if (!path && td_model_preset(name, out) == TD_OK) return TD_OK;
    if (stat(name, &sb) != 0) {
        if (!path) { /* neither a preset nor a file here: the presets' list, and the other way */
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", td_error_msg());
            return td_error_set(TD_ERR_INVALID, "%s; or a Hugging Face config.json, or a folder holding one", msg);
        }
        return td_error_set(TD_ERR_IO, "--model %s: %s (a preset's name, or a Hugging Face config.json or a folder "
                            "holding one)", name, strerror(errno));
    }
    char file[4096];
    snprintf(file, sizeof file, "%s%s", name, S_ISDIR(sb.st_mode) ? "/config.json" : "");
    td_status st = td_model_config_read(file, out);
    if (st) return td_error_prefix(st, "--model: ");
    out->padded_vocab_size = out->padded_vocab_size > out->vocab_size ? out->padded_vocab_size
                                                                     : td_model_pad_vocab(out->vocab_size);
    return TD_OK;
}

/* The run's configuration from the options (vocab: the data's unless given). */
td_status td_cli_train_config(const td_cli_train_opts *o, td_opt *table, int data_vocab, td_train_config *c,
                              char *note)
{
    td_status st;
    if (note) note[0] = '\0';
    *c = td_train_default_config();
    if (o->resume && o->init)
        return td_error_set(TD_ERR_INVALID, "--resume %s continues a run with its own weights and optimizer state; "
                            "--init %s would start from other weights: give one of them", o->resume, o->init);
    if ((st = model_of(o->model, &c->model))) return st;
    const char *from = o->resume ? o->resume : o->init;
    /* --resume of a LoRA run: its adapter folder names the base and the adapters' shape */
    static char adapter_base[4096];
    char targets[512];
    int a_rank = 0;
    double a_alpha = 0, a_dropout = 0;
    int adapter = o->resume ? td_cli_adapter_read(o->resume, adapter_base, sizeof adapter_base, &a_rank, &a_alpha,
                                                  &a_dropout, targets, sizeof targets) : 0;
    if (adapter < 0) return TD_ERR_INVALID;
    if (adapter && !adapter_base[0])
        return td_error_set(TD_ERR_INVALID, "--resume %s: the adapter names no base model (base_model_name_or_path); "
                            "it was trained on fresh weights and cannot be continued", o->resume);
    if (adapter) from = adapter_base;
    if (from) { /* the checkpoint decides the model's shape; the flags of the first run may stay */
        td_model_desc asked = c->model;
        if ((st = td_trainer_checkpoint_model(from, &c->model)))
            return td_error_prefix(st, "--%s: ", o->resume ? "resume" : "init");
        if ((st = shape_agrees(o, table, &asked, &c->model, o->resume ? "resume" : "init", from))) return st;
        if (data_vocab > c->model.vocab_size)
            return td_error_set(TD_ERR_INVALID, "the token file's vocabulary (%d) is larger than the checkpoint's (%d)",
                                data_vocab, c->model.vocab_size);
        data_vocab = c->model.vocab_size;
    }
    if (!from && td_cli_seen(table, "layers")) c->model.n_layer = o->layers;
    if (!from && td_cli_seen(table, "width")) c->model.n_embd = o->width;
    if (!from && td_cli_seen(table, "heads")) c->model.n_head = o->heads;
    if (!from && td_cli_seen(table, "kv-heads")) c->model.n_kv_head = o->kv_heads;
    if (!from && td_cli_seen(table, "mlp-width")) c->model.n_inner = o->mlp_width;
    if (!from && (td_cli_seen(table, "kv-heads") || td_cli_seen(table, "mlp-width")) &&
        (st = td_model_desc_check(&c->model))) /* the family says whether its blocks take them */
        return td_error_prefix(st, "--kv-heads / --mlp-width: ");
    int vocab = !from && td_cli_seen(table, "vocab") ? o->vocab : data_vocab > 0 ? data_vocab : c->model.vocab_size;
    if (vocab < 1) return td_error_set(TD_ERR_INVALID, "--vocab must be positive");
    if (note && !from && vocab != c->model.vocab_size && td_cli_seen(table, "model") && !td_cli_seen(table, "vocab"))
        vocab_note(o->model, &c->model, vocab, note);
    if (data_vocab > 0 && vocab < data_vocab)
        return td_error_set(TD_ERR_INVALID, "--vocab %d is smaller than the token file's vocabulary %d", vocab, data_vocab);
    c->model.vocab_size = vocab;
    c->model.padded_vocab_size = td_model_pad_vocab(vocab);
    if (o->seq > c->model.n_positions) c->model.n_positions = o->seq; /* tiny presets grow to the asked length */
    c->seq_len = o->seq;
    c->micro_batch = o->micro_batch;
    c->grad_accum = o->grad_accum;
    c->seed = o->seed;
    c->gpu_budget = o->gpu_budget;
    c->host_pin_limit = o->host_pin_limit;
    if (td_cli_seen(table, "host-ram") && o->host_ram < TD_MiB)
        return td_error_set(TD_ERR_INVALID, "--host-ram %zu bytes is too small to run anything; give the host's "
                            "memory, e.g. --host-ram 125GiB", o->host_ram);
    c->host_ram = o->host_ram;
    c->cpu_device_bytes = o->cpu_device_bytes;
    c->mm.disk_dirs = o->offload_dirs.v;
    c->mm.n_disk_dirs = o->offload_dirs.n;
    c->freeze = o->freeze.v;
    c->n_freeze = o->freeze.n;
    if (adapter) { /* the folder's adapters; flags given again must agree */
        if ((td_cli_seen(table, "lora-rank") && o->lora_rank != a_rank) ||
            (td_cli_seen(table, "lora-alpha") && (float)o->lora_alpha != (float)a_alpha) ||
            (td_cli_seen(table, "lora-targets") && strcmp(o->lora_targets, targets)))
            return td_error_set(TD_ERR_INVALID, "--resume %s holds adapters of rank %d, alpha %g on %s: the --lora "
                                "flags given differ", o->resume, a_rank, a_alpha, targets);
        if (td_cli_seen(table, "lora-dropout") && (float)o->lora_dropout != (float)a_dropout)
            return td_error_set(TD_ERR_INVALID, "--resume %s trained with --lora-dropout %g (its adapter_config.json's "
                                "lora_dropout): leave --lora-dropout out, or give %g", o->resume, a_dropout, a_dropout);
        if ((st = td_model_lora_set(&c->model, a_rank, (float)a_alpha, (float)a_dropout, targets)))
            return td_error_prefix(st, "--resume %s: ", o->resume);
    } else if (o->lora_rank || td_cli_seen(table, "lora-targets") || td_cli_seen(table, "lora-alpha") ||
        td_cli_seen(table, "lora-dropout")) {
        if (!td_cli_seen(table, "lora-rank"))
            return td_error_set(TD_ERR_INVALID, "--lora-alpha, --lora-dropout and --lora-targets need --lora-rank R");
        float alpha = td_cli_seen(table, "lora-alpha") ? (float)o->lora_alpha : (float)o->lora_rank;
        if ((st = td_model_lora_set(&c->model, o->lora_rank, alpha, (float)o->lora_dropout, o->lora_targets)))
            return st;
    }
    if ((st = td_optim_state_parse(o->optim_state, &c->optim.state))) return td_error_prefix(st, "--optim-state: ");
    if (o->threads < 0) return td_error_set(TD_ERR_INVALID, "--threads %d: give a count of threads, or leave it out", o->threads);
    c->threads = o->threads;
    if (!strcmp(o->adam_thread, "on")) c->adam_thread = 1;
    else if (!strcmp(o->adam_thread, "off")) c->adam_thread = -1;
    else if (!strcmp(o->adam_thread, "auto")) c->adam_thread = 0;
    else return td_error_set(TD_ERR_INVALID, "--adam-thread '%s': use on, off or auto", o->adam_thread);
    if ((st = td_backend_kind_parse(o->backend, &c->backend))) return td_error_prefix(st, "--backend: ");
    if ((st = td_dtype_parse(o->precision, &c->precision))) return td_error_prefix(st, "--precision: ");
    /* fp16 grads underflow without a loss scale: dynamic scaling, as PyTorch's GradScaler. */
    if (c->precision == TD_DTYPE_F16) c->optim.scaler.kind = TD_LOSS_SCALE_DYNAMIC;
    if (!strcmp(o->ckpt, "on")) c->ckpt = TD_CKPT_ON;
    else if (!strcmp(o->ckpt, "off")) c->ckpt = TD_CKPT_OFF;
    else if (!strcmp(o->ckpt, "auto")) c->ckpt = TD_CKPT_AUTO;
    else {
        char *end;
        errno = 0;
        long n = strtol(o->ckpt, &end, 10);
        if (errno || end == o->ckpt || *end || n < 0 || n > c->model.n_layer)
            return td_error_set(TD_ERR_INVALID, "--ckpt '%s': use on, off, auto or a block count in [0, %d]",
                                o->ckpt, c->model.n_layer);
        c->ckpt = n ? TD_CKPT_ON : TD_CKPT_OFF;
        c->ckpt_blocks = (int)n;
    }
    if ((st = td_placement_parse(o->policy, &c->mm.placement))) return td_error_prefix(st, "--policy: ");
    if ((st = td_shard_mode_parse(o->shard, &c->shard))) return st;
    if ((st = td_evict_policy_parse(o->eviction, &c->mm.eviction))) return td_error_prefix(st, "--eviction: ");
    if (o->param_frac < 0 || o->param_frac > 1 || o->optim_frac < 0 || o->optim_frac > 1)
        return td_error_set(TD_ERR_INVALID, "--offload-param-frac and --offload-optim-frac lie in [0, 1]");
    if (td_cli_seen(table, "offload-param-frac") && c->mm.placement != TD_PLACEMENT_STATIC)
        return td_error_set(TD_ERR_INVALID, "--offload-param-frac applies to --policy static only");
    if (td_cli_seen(table, "offload-optim-frac") && c->mm.placement != TD_PLACEMENT_STATIC &&
        c->mm.placement != TD_PLACEMENT_AUTO)
        return td_error_set(TD_ERR_INVALID, "--offload-optim-frac applies to --policy static and auto only");
    c->mm.chunk_numel = (size_t)o->chunk_numel;
    c->mm.offload_param_frac = o->param_frac;
    c->mm.offload_optim_frac = o->optim_frac;
    c->mm.prefetch = o->prefetch;
    c->mm.grad_slots = o->grad_slots;
    c->loss_chunk = o->loss_chunk;
    c->mm.trace_out = o->trace_out;
    c->optim.lr.lr = o->lr;
    c->optim.lr.min_lr = o->min_lr >= 0 ? o->min_lr : o->lr / 10;
    c->optim.lr.warmup_steps = o->warmup >= 0 ? o->warmup : o->steps / 10;
    /* The decay needs two steps past the warmup; a shorter run keeps the peak. */
    c->optim.lr.total_steps = o->steps >= c->optim.lr.warmup_steps + 2 ? o->steps : c->optim.lr.warmup_steps + 2;
    if ((st = td_lr_decay_parse(o->schedule, &c->optim.lr.decay))) return td_error_prefix(st, "--schedule: ");
    c->optim.adam.weight_decay = o->weight_decay;
    c->decay_all = o->decay_all;
    c->save_shard_bytes = o->shard_size;
    c->optim.max_grad_norm = o->clip;
    if (o->steps < 1) return td_error_set(TD_ERR_INVALID, "--steps must be at least 1");
    if (o->loss_chunk < 0) return td_error_set(TD_ERR_INVALID, "--loss-chunk %d: give the rows of a chunk, or 0 for auto", o->loss_chunk);
    if (o->grad_slots < -1) return td_error_set(TD_ERR_INVALID, "--grad-slots %d: use -1 (auto), 0 or a count", o->grad_slots);
    if (o->grad_slots > 0 && (o->clip > 0 || o->grad_accum > 1))
        return td_error_set(TD_ERR_INVALID, "--grad-slots %d: staging slots need grads that are read once as they "
                            "land: --clip-grad-norm 0 and --grad-accum 1 (the global norm and accumulation need a "
                            "host copy of every grad)", o->grad_slots);
    return td_train_config_check(c);
}

/* One option's value as text (a --config file's form), for agreement across ranks. */
void td_cli_opt_value(const td_opt *t, char *v, size_t n)
{
    switch (t->kind) {
    case TD_OPT_FLAG: snprintf(v, n, "%s", *(int *)t->dst ? "true" : "false"); return;
    case TD_OPT_INT: snprintf(v, n, "%d", *(int *)t->dst); return;
    case TD_OPT_LONG: snprintf(v, n, "%ld", *(long *)t->dst); return;
    case TD_OPT_U64: snprintf(v, n, "%llu", (unsigned long long)*(uint64_t *)t->dst); return;
    case TD_OPT_DOUBLE: /* the shortest form that reads back as the same double */
        for (int digits = 6; digits <= 17; digits++) {
            snprintf(v, n, "%.*g", digits, *(double *)t->dst);
            if (strtod(v, NULL) == *(double *)t->dst) break;
        }
        return;
    case TD_OPT_SIZE:
    case TD_OPT_BUDGET:
        if (*(size_t *)t->dst == SIZE_MAX) snprintf(v, n, "max");
        else snprintf(v, n, "%zu", *(size_t *)t->dst);
        return;
    case TD_OPT_STRING: snprintf(v, n, "%s", *(const char **)t->dst ? *(const char **)t->dst : "(unset)"); return;
    case TD_OPT_LIST: {
        const td_opt_list *l = t->dst;
        size_t at = 0;
        v[0] = 0;
        for (int i = 0; i < l->n && at < n; i++) at += (size_t)snprintf(v + at, n - at, "%s%s", i ? "," : "", l->v[i]);
        return;
    }
    }
    snprintf(v, n, "?");
}

td_status td_cli_data_vocab(const char *path, int *vocab)
{
    td_loader_params lp = td_loader_default_params();
    lp.batch = 1;
    lp.seq = 1;
    td_loader *l = NULL;
    td_status st = td_loader_open(path, &lp, &l);
    if (st) return st;
    *vocab = (int)td_tokfile_get_info(td_loader_file(l))->vocab_size;
    td_loader_destroy(l);
    return TD_OK;
}
