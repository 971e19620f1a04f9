/* `tidal train`: trains a model on a token file under a device budget. */
#include "cli.h"
#include "train_opts.h"
#include <cjson/cJSON.h>
#include "tidal/checkpoint.h"
#include "tidal/data.h"
#include "tidal/diskio.h"
#include "tidal/parallel.h"
#include "tidal/trainer.h"
#include "tidal/util.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char usage[] =
    "usage: tidal train --data FILE [--model PRESET | --layers L --width C --heads H] [options]\n\n"
    "Trains a transformer (a --model preset or a Hugging Face config) on a token file (see\n"
    "`tidal prepare`) with its parameters, gradients and optimizer state in chunks that move\n"
    "between pinned host memory and the device under --gpu-budget.  The first step is a warm-up\n"
    "that records the access order; from the second on, chunks are evicted by Belady's rule and\n"
    "loaded ahead of use.  Prints a progress line per step, and within a step of several\n"
    "micro-batches (--grad-accum) a line every 10 s on a terminal, every minute into a log.\n"
    "Exit status: 0 done, 2 a usage error (nothing was run), 1 a failure, 130 or 143 stopped by\n"
    "SIGINT or SIGTERM (saved with --save; --resume continues).";

/* One run of the command: its options, its job and what it opened. */
typedef struct train_run {
    td_cli_train_opts o;
    td_opt *table;
    td_dist_env env;
    int lead, tty;                 /* lead: rank 0, which alone prints progress and writes --log */
    td_loader *loader;
    td_trainer *t;
    FILE *log;
    td_train_config cfg;
    td_train_plan hplan;           /* the host's plan, for the end's footprint line */
    long step;                     /* the step running, for the lines within it */
    double step_t0, noted, note_ms; /* its start, the last line within it, the time between lines */
} train_run;

/* A LoRA run's base: --init's folder as an absolute path, or the base a
 * resumed adapter names ("" for fresh weights). */
static char lora_base[4096];

/* A checkpoint with the data position, so --resume continues mid-epoch. */
static td_status save_checkpoint(td_trainer *t, td_loader *loader, const char *dir, const char *data)
{
    td_loader_position pos;
    td_loader_tell(loader, &pos);
    char epoch[32], index[32], fp[32];
    snprintf(epoch, sizeof epoch, "%llu", (unsigned long long)pos.epoch);
    snprintf(index, sizeof index, "%llu", (unsigned long long)pos.index);
    snprintf(fp, sizeof fp, "%llu", (unsigned long long)pos.fingerprint);
    const td_tokfile_info *info = td_tokfile_get_info(td_loader_file(loader));
    const char *meta[] = {"data_epoch", epoch, "data_index", index, "data_fingerprint", fp, "data_file", data,
                          "tokenizer", td_tokenizer_kind_name(info->tokenizer), NULL};
    if (td_trainer_config(t)->model.lora.rank > 0) /* a LoRA run: a PEFT adapter folder naming its base */
        return td_trainer_save_adapter(t, dir, lora_base[0] ? lora_base : NULL, 1, meta);
    /* The tokenizer the data was made with, when `tidal prepare` kept it. */
    char paths[TD_CKPT_TOKENIZER_FILE_COUNT][4096];
    const char *files[TD_CKPT_TOKENIZER_FILE_COUNT + 1] = {NULL};
    static const char *const names[] = TD_CKPT_TOKENIZER_FILES;
    int n = 0;
    for (size_t i = 0; i < TD_CKPT_TOKENIZER_FILE_COUNT && info->tokenizer != TD_TOKENIZER_BYTE; i++)
        if (!td_tokfile_tokenizer_path(data, names[i], paths[n], sizeof paths[n]) && access(paths[n], R_OK) == 0)
            files[n] = paths[n], n++;
    return td_trainer_save_files(t, dir, 1, meta, files);
}

static td_status loader_batch(void *ctx, int32_t *tokens, int32_t *targets, int32_t *positions)
{
    return td_loader_next(ctx, tokens, targets, positions);
}

/* SIGINT / SIGTERM: the run stops at the next step boundary, saves when
 * --save is given and exits 130 / 143, as a shell reports those signals.
 * A second signal acts at once: the disk tier's lock files removed (its
 * scratch files have no names: their space goes back as the process
 * ends), then the default action. */
static volatile sig_atomic_t stop_signal;

static void on_stop_signal(int sig)
{
    if (stop_signal) {
        td_dio_signal_cleanup();
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    stop_signal = sig;
}

/* TD_FAULT_NONFINITE_STEP=N[,K]: steps N .. N+K-1 read non-finite grads
 * (tests and the GPU fault check; K defaults to 1). */
static int fault_step(long step)
{
    const char *e = getenv("TD_FAULT_NONFINITE_STEP");
    long n = 0, k = 1;
    if (!e || sscanf(e, "%ld,%ld", &n, &k) < 1) return 0;
    return step >= n && step < n + k;
}

static void progress(FILE *f, int tty, long step, long steps, const td_step_result *r, td_trainer *t)
{
    td_arena_stats as;
    td_arena_get_stats(td_trainer_arena(t), &as);
    td_hostpool_stats hs;
    td_hostpool_get_stats(td_trainer_hostpool(t), &hs);
    char used[32], budget[32], pinned[32], h2d[32], d2h[32];
    int cuda = td_backend_get_kind(td_trainer_backend(t)) == TD_BACKEND_CUDA;
    fprintf(f, "%sstep %ld/%ld  loss %.4f  lr %.2e  %.0f tok/s  device %s/%s  %s %s  h2d %s  d2h %s  stall %.0f ms%s",
            tty ? "\r\033[K" : "", step, steps, r->loss, r->lr, r->tokens_per_s,
            td_format_bytes(r->mm.device_peak_bytes, used, sizeof used),
            td_format_bytes(as.budget_bytes, budget, sizeof budget), cuda ? "pinned" : "host buffers",
            td_format_bytes(hs.pinned_bytes, pinned, sizeof pinned),
            td_format_bytes(r->mm.bytes_h2d, h2d, sizeof h2d), td_format_bytes(r->mm.bytes_d2h, d2h, sizeof d2h),
            r->mm.stall_ms, r->skipped ? "  (overflow: step skipped)" : "");
    fprintf(f, tty ? "" : "\n");
    fflush(f);
}

/* "2m05s" (under a minute: "41s"). */
static const char *format_span(double ms, char *buf, size_t n)
{
    long s = (long)(ms / 1e3);
    if (s < 60) snprintf(buf, n, "%lds", s);
    else if (s < 3600) snprintf(buf, n, "%ldm%02lds", s / 60, s % 60);
    else snprintf(buf, n, "%ldh%02ldm", s / 3600, s % 3600 / 60);
    return buf;
}

/* Within a step of several micro-batches (--grad-accum): a line once the
 * step has run note_ms since its start or its last line, so that a step of
 * minutes shows it moves (on a terminal rewritten in place, as the step
 * lines are). */
static void microbatch_progress(void *ctx, int k, int accum)
{
    train_run *r = ctx;
    double now = td_now_ms();
    if (!r->lead || k >= accum || now - r->noted < r->note_ms) return;
    r->noted = now;
    char el[32];
    fprintf(stderr, "%sstep %ld/%ld  micro-batch %d/%d  %s into the step%s", r->tty ? "\r\033[K" : "", r->step,
            r->o.steps, k, accum, format_span(now - r->step_t0, el, sizeof el), r->tty ? "" : "\n");
    fflush(stderr);
}

/* A file each rank writes for itself: with several ranks, "rankR" goes
 * before the name's extension (timeline.json -> timeline.rank1.json), so
 * that ranks never write one file. */
static const char *rank_path(const char *path, const td_dist_env *env, char *buf, size_t n)
{
    if (env->size <= 1) return path;
    const char *slash = strrchr(path, '/'), *dot = strrchr(path, '.');
    if (!dot || (slash && dot < slash) || dot == (slash ? slash + 1 : path)) dot = path + strlen(path);
    snprintf(buf, n, "%.*s.rank%d%s", (int)(dot - path), path, env->rank, dot);
    return buf;
}


/* What every rank of a job must share: each flag that shapes the run (not
 * the ones about this process: its log, traces, threads, host limits, the
 * launch), the model the run resolved to and the data file's identity (its
 * contents: the path may differ between hosts). */
#define AGREE_MAX 96
typedef struct agree_list {
    td_dist_setting s[AGREE_MAX];
    char keys[AGREE_MAX][40], values[AGREE_MAX][200];
    size_t n;
} agree_list;

static void agree_add(agree_list *a, const char *key, const char *value)
{
    if (a->n >= AGREE_MAX) return;
    snprintf(a->keys[a->n], sizeof a->keys[a->n], "%s", key);
    snprintf(a->values[a->n], sizeof a->values[a->n], "%s", value);
    a->s[a->n] = (td_dist_setting){a->keys[a->n], a->values[a->n]};
    a->n++;
}

static void agree_build(agree_list *a, const td_opt *table, const td_train_config *cfg, const td_loader *loader)
{
    static const char *const local[] = {"log", "log-every", "trace-out", "trace-timeline", "threads", "adam-thread", "host-ram",
                                        "host-pin-limit", "config", "nproc", "comm-timeout", "data", "overwrite", "offload-dir", NULL};
    a->n = 0;
    for (const td_opt *t = table; t->name; t++) {
        int skip = 0;
        for (int i = 0; local[i]; i++) skip |= !strcmp(t->name, local[i]);
        if (skip) continue;
        char key[40], v[200];
        snprintf(key, sizeof key, "--%s", t->name);
        td_cli_opt_value(t, v, sizeof v);
        agree_add(a, key, v);
    }
    char model[200];
    td_model_desc_describe(&cfg->model, model, sizeof model);
    agree_add(a, "the model", model);
    td_loader_position pos;
    td_loader_tell(loader, &pos);
    char data[200];
    const td_tokfile_info *info = td_tokfile_get_info(td_loader_file(loader));
    snprintf(data, sizeof data, "%llu tokens, CRC-32 %08x, loader fingerprint %016llx",
             (unsigned long long)info->token_count, (unsigned)info->payload_crc32, (unsigned long long)pos.fingerprint);
    agree_add(a, "the data file", data);
    /* a rank with its own reduce-scatter communicator and one without would
     * wait for each other's collectives */
    agree_add(a, "TD_REDUCE_COMM", cfg->reduce_comm == TD_REDUCE_COMM_SHARED ? "shared" : "own");
}

/* Whether any rank was asked to stop (each rank gets the signal at its own
 * moment; all stop after the same step, or their collectives would differ). */
static td_status any_rank_stopping(td_trainer *t, int mine, int *any)
{
    td_comm *c = td_trainer_comm(t);
    *any = mine;
    if (!c) return TD_OK;
    int n = td_comm_size(c), all[256], *v = n <= 256 ? all : td_malloc((size_t)n * sizeof(int), TD_ROLE_META);
    if (!v) return TD_ERR_NOMEM;
    td_status st = td_comm_host_allgather(c, &mine, sizeof mine, v);
    for (int r = 0; !st && r < n; r++)
        if (v[r]) *any = v[r];
    if (v != all) td_free(v);
    return st;
}
/* ---- --save onto an existing checkpoint ------------------------------------------ */

/* 1 when dir holds a checkpoint (or the DIR.old of an interrupted save),
 * described in `what`: its model and the step it was saved at. */
static int checkpoint_at(const char *dir, char *what, size_t n)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/config.json", dir);
    int here = access(path, F_OK) == 0;
    snprintf(path, sizeof path, "%s.old/config.json", dir);
    if (!here && access(path, F_OK) != 0) return 0;
    td_model_desc m;
    char desc[256] = "a model tidal cannot read", step[64] = "";
    if (td_trainer_checkpoint_model(dir, &m) == TD_OK) td_model_desc_describe(&m, desc, sizeof desc);
    td_ckpt_reader *rd = NULL;
    uint64_t s = 0;
    if (td_ckpt_reader_open(dir, NULL, &rd) == TD_OK && td_ckpt_reader_has_state(rd) &&
        td_ckpt_reader_meta_u64(rd, "optim_step", &s) == TD_OK)
        snprintf(step, sizeof step, ", saved at step %llu", (unsigned long long)s);
    td_ckpt_reader_close(rd);
    td_error_clear();
    snprintf(what, n, "%s%s", desc, step);
    return 1;
}

/* Whether two paths name one directory (the same file once resolved). */
static int same_dir(const char *a, const char *b)
{
    char ra[PATH_MAX], rb[PATH_MAX];
    if (realpath(a, ra) && realpath(b, rb)) return !strcmp(ra, rb);
    return !strcmp(a, b);
}

/* --save DIR, checked before the run spends its time: the folders are
 * made and DIR is writable (td_ckpt_check_target), and a checkpoint
 * already there is replaced only by its own run (--resume DIR) or with
 * --overwrite, never by forgetting --resume. */
static td_status check_save(const td_cli_train_opts *o)
{
    char what[400];
    if (!o->save) return TD_OK;
    if (o->lora_rank > 0 || (o->resume && lora_base[0])) { /* an adapter folder, made at the save */
        char path[4200];
        snprintf(path, sizeof path, "%s/adapter_config.json", o->save);
        if (!o->overwrite && access(path, F_OK) == 0 && !(o->resume && same_dir(o->resume, o->save)))
            return td_error_set(TD_ERR_INVALID, "--save %s holds an adapter that this run would replace; continue its "
                                "run with --resume %s, give --overwrite, or choose another --save DIR", o->save, o->save);
        return TD_OK;
    }
    if (!o->overwrite && checkpoint_at(o->save, what, sizeof what) && !(o->resume && same_dir(o->resume, o->save)))
        return td_error_set(TD_ERR_INVALID, "--save %s holds a checkpoint (%s) that this run would replace; continue "
                            "its run with --resume %s, give --overwrite to replace it, or choose another --save DIR",
                            o->save, what, o->save);
    td_status st = td_ckpt_check_target(o->save);
    return st ? td_error_prefix(st, "--save %s: ", o->save) : TD_OK;
}

/* ---- setting up ------------------------------------------------------------------ */

/* --nproc N starts N local ranks of this command; --comm-timeout and the
 * launcher's environment are read.  -1 to go on, else the exit code. */
static int train_job(train_run *r, int nproc, double timeout_s, int argc, char **argv)
{
    if (td_cli_seen(r->table, "nproc") && getenv("WORLD_SIZE")) {
        fprintf(stderr, "tidal train: --nproc starts its own ranks, but this process already is rank %s of a job of %s "
                "(torchrun, or --nproc in a --config); drop --nproc\n", getenv("RANK") ? getenv("RANK") : "?",
                getenv("WORLD_SIZE"));
        return 2;
    }
    if (td_cli_seen(r->table, "nproc") && td_cli_launch_wanted(nproc)) {
        const char *prefix[] = {"train", NULL};
        return td_cli_launch_self("train", nproc, prefix, argc, argv);
    }
    if (!(timeout_s > 0 && timeout_s <= 86400)) {
        fprintf(stderr, "tidal train: --comm-timeout %g: give seconds in (0, 86400]\n", timeout_s);
        return 2;
    }
    if (td_dist_env_read(&r->env)) {
        fprintf(stderr, "tidal train: %s\n", td_error_msg());
        return 2;
    }
    r->lead = r->env.rank == 0;
    r->tty = isatty(fileno(stderr));
    return -1;
}

/* The data, the configuration, the log and the --save target, before any
 * memory is taken.  -1 to go on, else the exit code. */
static int train_prepare(train_run *r)
{
    td_cli_train_opts *o = &r->o;
    static char trace_path[4096], timeline_path[4096]; /* several ranks: a file each */
    if (o->trace_out) o->trace_out = rank_path(o->trace_out, &r->env, trace_path, sizeof trace_path);
    if (o->timeline) o->timeline = rank_path(o->timeline, &r->env, timeline_path, sizeof timeline_path);
    if (!o->data) {
        fprintf(stderr, "tidal train: --data FILE is required (make one with `tidal prepare`)\n");
        return 2;
    }
    td_loader_params lp = td_loader_default_params();
    lp.batch = (uint32_t)(o->micro_batch > 0 ? o->micro_batch : 1);
    lp.seq = (uint32_t)(o->seq > 0 ? o->seq : 1);
    lp.seed = o->seed;
    lp.heldout_percent = o->heldout;
    lp.rank = (uint32_t)r->env.rank; /* this rank's slice of every global batch */
    lp.ranks = (uint32_t)r->env.size;
    td_status st = td_loader_open(o->data, &lp, &r->loader);
    if (st) {
        fprintf(stderr, "tidal train: %s\n", td_error_msg());
        return 1;
    }
    char note[512];
    int data_vocab = (int)td_tokfile_get_info(td_loader_file(r->loader))->vocab_size;
    lora_base[0] = '\0';
    if (o->resume) { /* an adapter folder names its base */
        char t[512];
        int rk;
        double a, p;
        (void)td_cli_adapter_read(o->resume, lora_base, sizeof lora_base, &rk, &a, &p, t, sizeof t);
    } else if (o->init && o->lora_rank > 0 && !realpath(o->init, lora_base)) {
        snprintf(lora_base, sizeof lora_base, "%s", o->init);
    }
    if ((st = td_cli_train_config(o, r->table, data_vocab, &r->cfg, note)) || (r->lead && (st = check_save(o)))) {
        fprintf(stderr, "tidal train: %s\n", td_error_msg());
        return td_cli_config_exit(st);
    }
    if (*note && r->lead) fprintf(stderr, "tidal train: %s\n", note);
    if (o->log && r->lead && !(r->log = fopen(o->log, "w"))) {
        fprintf(stderr, "tidal train: cannot write --log %s: %s\n", o->log, strerror(errno));
        return 1;
    }
    if (o->max_bad_steps < 1) {
        fprintf(stderr, "tidal train: --max-bad-steps must be at least 1\n");
        return 2;
    }
    return -1;
}

/* The trainer, joined to the job's other ranks, with the weights of
 * --resume or --init. */
static td_status train_create(train_run *r, double timeout_s)
{
    static agree_list agree;
    td_train_config *cfg = &r->cfg;
    const td_cli_train_opts *o = &r->o;
    td_status st;
    if (r->env.size > 1) {
        cfg->ranks = r->env.size;
        cfg->rank = r->env.rank;
        cfg->local_ranks = r->env.local_size;
        cfg->dist = &r->env;
        cfg->comm_timeout_ms = (int)(timeout_s * 1000.0 + 0.5);
        if (cfg->comm_timeout_ms < 1) cfg->comm_timeout_ms = 1;
        agree_build(&agree, r->table, cfg, r->loader);
        cfg->agree = agree.s;
        cfg->n_agree = agree.n;
    }
    /* From here a first SIGINT / SIGTERM stops the run at a step's end, a
     * second at once (on_stop_signal). */
    stop_signal = 0;
    struct sigaction sa = {0};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    if ((st = td_trainer_create(cfg, &r->t))) return st;
    /* Lines within a step: every 10 s on a terminal, every minute into a
     * log; TD_TRAIN_PROGRESS_S sets the seconds (0: after every micro-batch,
     * and the last step's updates' line however short they were). */
    const char *every = getenv("TD_TRAIN_PROGRESS_S");
    char *end = NULL;
    double secs = every && *every ? strtod(every, &end) : -1.0;
    if (every && *every && (*end || !(secs >= 0.0))) {
        if (r->lead) fprintf(stderr, "tidal train: TD_TRAIN_PROGRESS_S=%s: not seconds (0 or more); the default\n", every);
        secs = -1.0;
    }
    r->note_ms = (secs >= 0.0 ? secs : r->tty ? 10.0 : 60.0) * 1e3;
    td_trainer_set_microbatch_fn(r->t, microbatch_progress, r);
    if (o->resume && cfg->model.lora.rank > 0) { /* the base's weights, then the adapters and their state */
        td_loader_position pos = {0};
        char v[3][32];
        if ((st = td_trainer_load(r->t, lora_base, 0, NULL))) return st;
        if ((st = td_trainer_load_adapter(r->t, o->resume, 1))) return st;
        if (!td_trainer_adapter_meta(o->resume, "data_epoch", v[0], sizeof v[0]) ||
            !td_trainer_adapter_meta(o->resume, "data_index", v[1], sizeof v[1]) ||
            !td_trainer_adapter_meta(o->resume, "data_fingerprint", v[2], sizeof v[2]))
            return td_error_set(TD_ERR_INVALID, "--resume %s: the adapter's train state has no data position", o->resume);
        pos.epoch = strtoull(v[0], NULL, 10);
        pos.index = strtoull(v[1], NULL, 10);
        pos.fingerprint = strtoull(v[2], NULL, 10);
        if ((st = td_loader_seek(r->loader, &pos))) return td_error_prefix(st, "--resume %s: the data position: ", o->resume);
        if (r->lead) fprintf(stderr, "tidal train: resumed adapter %s over %s at step %ld\n", o->resume, lora_base,
                             td_trainer_optim(r->t)->step);
    } else if (o->resume) {
        td_ckpt_reader *rd = NULL;
        if ((st = td_trainer_load(r->t, o->resume, 1, &rd))) return st;
        td_loader_position pos = {0};
        st = td_ckpt_reader_meta_u64(rd, "data_epoch", &pos.epoch);
        if (!st) st = td_ckpt_reader_meta_u64(rd, "data_index", &pos.index);
        if (!st) st = td_ckpt_reader_meta_u64(rd, "data_fingerprint", &pos.fingerprint);
        td_ckpt_reader_close(rd);
        if (st || (st = td_loader_seek(r->loader, &pos)))
            return td_error_prefix(st, "--resume %s: the data position: ", o->resume);
        if (r->lead) fprintf(stderr, "tidal train: resumed %s at step %ld\n", o->resume, td_trainer_optim(r->t)->step);
    } else if (o->init) {
        if ((st = td_trainer_load(r->t, o->init, 0, NULL))) return st;
        if (r->lead) fprintf(stderr, "tidal train: weights from %s\n", o->init);
    }
    if (o->timeline && (st = td_memmgr_timeline_open(td_trainer_memmgr(r->t), o->timeline))) return st;
    *cfg = *td_trainer_config(r->t); /* as resolved: the backend, the budget */
    return TD_OK;
}

/* ---- what the run says ---------------------------------------------------------- */

/* The first line: the model, the backend, the budget, where AdamW runs. */
static void print_model_line(const train_run *r)
{
    const td_train_config *cfg = &r->cfg;
    td_trainer *t = r->t;
    int cuda = cfg->backend == TD_BACKEND_CUDA;
    char budget[32], origin[160] = "", cap[32], ckpt[48], rest[200] = "", comm[96] = "", cb[32], ab[32];
    td_arena_stats as;
    td_arena_get_stats(td_trainer_arena(t), &as);
    size_t comm_bytes = td_train_comm_device_bytes(cfg);
    if (comm_bytes) /* the budget as given: NCCL's share, measured, beside the arena's */
        snprintf(comm, sizeof comm, " (NCCL's buffers %s, measured; the arena %s)",
                 td_format_bytes(comm_bytes, cb, sizeof cb), td_format_bytes(as.budget_bytes, ab, sizeof ab));
    int nck = td_trainer_checkpointing(t);
    if (nck == 0 || nck == cfg->model.n_layer) snprintf(ckpt, sizeof ckpt, "%s", nck ? "on" : "off");
    else snprintf(ckpt, sizeof ckpt, "%d of %d blocks", nck, cfg->model.n_layer);
    const td_train_budget *tb = td_trainer_budget(t);
    if (tb->origin != TD_BUDGET_GIVEN)
        snprintf(origin, sizeof origin, tb->origin == TD_BUDGET_CAP ? " (max: the %s free less a margin)"
                 : " (default: the run resident + 1/8; --gpu-budget max takes the %s free less a margin)",
                 td_format_bytes(tb->cap_bytes, cap, sizeof cap));
    int optim_total = 0, optim_dev = td_trainer_optim_gpu_chunks(t, &optim_total);
    int own = 0, slots = 0, threads = td_trainer_adam_threads(t, &own, &slots);
    if (optim_dev < optim_total)
        snprintf(rest, sizeof rest, "%s%d CPU thread%s%s%s", optim_dev ? ", the rest by " : "by ", threads,
                 threads == 1 ? "" : "s", own ? " driven from a thread of its own (--adam-thread)" : "",
                 slots ? ", grads transient" : "");
    char where[sizeof rest + 128]; /* room for the longest line: never cut */
    if (optim_dev == 0) snprintf(where, sizeof where, "AdamW on the host for all %d param chunks, %s", optim_total, rest);
    else snprintf(where, sizeof where, "AdamW on the %s for %d of %d param chunks%s", cuda ? "GPU" : "cpu backend's device",
                  optim_dev, optim_total, rest);
    fprintf(stderr, "tidal train: %zu params (%s %d layers, %d wide, %d heads, vocab %d), %s, budget %s%s%s, policy %s, "
            "checkpointing %s, %d chunks, %s\n", td_model_params_numel(&cfg->model),
            td_model_family_name(td_model_family_of(&cfg->model)), cfg->model.n_layer, cfg->model.n_embd, cfg->model.n_head,
            cfg->model.vocab_size, td_backend_describe(td_trainer_backend(t)),
            td_format_bytes(as.budget_bytes + comm_bytes, budget, sizeof budget), comm, origin, r->o.policy, ckpt,
            td_memmgr_chunk_count(td_trainer_memmgr(t)), where);
}

/* Where the CPU AdamW runs: machines of one kind differ here. */
static void print_adam_cores(const train_run *r)
{
    int own = 0, threads = td_trainer_adam_threads(r->t, &own, NULL), driver = -1;
    const char *where = td_trainer_host_cores(r->t, &driver);
    const char *dev = r->cfg.backend == TD_BACKEND_CUDA ? "drives the GPU" : "runs the cpu backend's compute";
    char drv[160];
    if (!own) snprintf(drv, sizeof drv, "thread i > 0 on core i; thread 0 is the one that %s, between its steps", dev);
    else if (driver >= 0) snprintf(drv, sizeof drv, "thread i on core i (0: the AdamW thread); the thread that %s on core %d", dev, driver);
    else snprintf(drv, sizeof drv, "thread i on core i (0: the AdamW thread); no core left for the thread that %s", dev);
    fprintf(stderr, "tidal train: CPU AdamW: %d thread%s on %s, %s\n", threads, threads == 1 ? "" : "s", where, drv);
}

static td_status print_start(train_run *r)
{
    td_train_config *cfg = &r->cfg;
    td_arena_stats as;
    td_arena_get_stats(td_trainer_arena(r->t), &as);
    size_t ram = 0, pin_limit = 0;
    char src[256], a[32], b[32], c[32];
    td_status st;
    /* the trainer's own plan: the whole budget (the arena's and NCCL's measured share), as it resolved it */
    const td_train_config *tc = td_trainer_config(r->t);
    if ((st = td_train_plan_make(tc, as.budget_bytes + td_train_comm_device_bytes(tc), &r->hplan)) ||
        (st = td_train_host_limits(cfg, &ram, &pin_limit, src, sizeof src)))
        return st;
    if (r->lead && r->env.size > 1)
        fprintf(stderr, "tidal train: %d ranks (%s), ZeRO-3: every chunk split over %d ranks (--shard %s), each rank's "
                "host holding its shard of params, grads and optimizer state; grads reduce-scattered on %s; global "
                "batch %d x %d x %d sequences; per rank:\n", r->env.size, r->env.launcher, td_trainer_shard_ranks(r->t),
                td_shard_mode_name(td_trainer_config(r->t)->shard),
                tc->reduce_comm == TD_REDUCE_COMM_OWN ? "a communicator of their own" : "the gathers' communicator",
                r->env.size, cfg->micro_batch, cfg->grad_accum);
    if (r->lead) print_model_line(r);
    if (r->lead) fprintf(stderr, "tidal train: host plan %s %s + %s pageable (--optim-state %s) of %s RAM (%s); heap measured by %s\n",
            td_format_bytes(r->hplan.host_pinned_bytes, a, sizeof a),
            cfg->backend == TD_BACKEND_CUDA ? "pinned" : "in copy buffers",
            td_format_bytes(r->hplan.host_pageable_bytes, b, sizeof b), td_optim_state_name(cfg->optim.state),
            td_format_bytes(ram, c, sizeof c), src, td_host_heap_source());
    if (r->hplan.disk_chunks) { /* every rank: each has its own directories' files */
        char wb[32], more[96] = "";
        if (r->hplan.disk_grad_chunks || r->hplan.disk_param_chunks)
            snprintf(more, sizeof more, ", and %d grad and %d param chunks", r->hplan.disk_grad_chunks,
                     r->hplan.disk_param_chunks);
        fprintf(stderr, "tidal train: disk tier: %d of %d optimizer chunks%s on disk (%s), %d slots a role (%s pinned "
                "for one of each), %s read and %s written a step; %s\n", r->hplan.disk_chunks, r->hplan.optim_chunks,
                more, td_format_bytes(r->hplan.disk_bytes, a, sizeof a), r->hplan.disk_sets,
                td_format_bytes(r->hplan.disk_set_bytes, b, sizeof b),
                td_format_bytes((size_t)r->hplan.disk_read_bytes_per_step, c, sizeof c),
                td_format_bytes((size_t)r->hplan.disk_write_bytes_per_step, wb, sizeof wb),
                td_memmgr_disk_describe(td_trainer_memmgr(r->t)));
    } else if (cfg->mm.n_disk_dirs && r->lead) {
        fprintf(stderr, "tidal train: --offload-dir: nothing goes to disk (the host's RAM holds the whole state)\n");
    }
    if (!r->lead) return TD_OK;
    char why[160];
    if (r->o.threads <= 0 && r->env.size <= 1) {
        int n = td_train_default_threads(NULL, why, sizeof why);
        fprintf(stderr, "tidal train: %d CPU thread%s: %s\n", n, n == 1 ? "" : "s", why);
    }
    int total = 0;
    if (td_trainer_optim_gpu_chunks(r->t, &total) < total) print_adam_cores(r);
    td_setup_times su;
    td_trainer_setup_times(r->t, &su);
    fprintf(stderr, "tidal train: set up in %.1f s (backend and plan %.1f s, %s host slabs %.1f s, first touch of "
            "pageable state %.1f s, initial weights %.1f s, the rest %.1f s)\n", su.total_ms / 1e3, su.backend_ms / 1e3,
            cfg->backend == TD_BACKEND_CUDA ? "pinning" : "mapping", su.pin_ms / 1e3, su.touch_ms / 1e3,
            su.init_ms / 1e3, su.rest_ms / 1e3);
    return TD_OK;
}

/* One JSON line of --log for a step. */
static td_status log_step(train_run *r, long s, const td_step_result *res, double tail_ms)
{
    td_host_usage hu;
    td_status st = td_trainer_host_usage(r->t, &hu);
    if (st || !r->log) return st;
    char mm[2048], host[4096];
    td_memmgr_step_json(td_trainer_memmgr(r->t), mm, sizeof mm);
    td_host_usage_json(&hu, host, sizeof host);
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "step", (double)s);
    cJSON_AddNumberToObject(j, "loss", res->loss);
    cJSON_AddNumberToObject(j, "lr", res->lr);
    cJSON_AddNumberToObject(j, "grad_norm", res->grad_norm);
    cJSON_AddNumberToObject(j, "skipped", res->skipped);
    cJSON_AddNumberToObject(j, "tokens_per_s", res->tokens_per_s);
    cJSON_AddNumberToObject(j, "targets", (double)res->targets); /* the loss's targets, every rank's */
    cJSON_AddNumberToObject(j, "step_ms", res->step_ms);
    cJSON_AddNumberToObject(j, "device_peak_bytes", (double)res->mm.device_peak_bytes);
    cJSON_AddNumberToObject(j, "h2d_bytes", (double)res->mm.bytes_h2d);
    cJSON_AddNumberToObject(j, "d2h_bytes", (double)res->mm.bytes_d2h);
    cJSON_AddNumberToObject(j, "stall_ms", res->mm.stall_ms);
    cJSON_AddNumberToObject(j, "adam_cpu_ms", res->adam_cpu_ms);
    cJSON_AddNumberToObject(j, "adam_wait_ms", res->adam_wait_ms);
    cJSON_AddNumberToObject(j, "device_process_peak_bytes", (double)res->device_process_peak_bytes);
    cJSON_AddNumberToObject(j, "comm_device_bytes", (double)td_train_comm_device_bytes(td_trainer_config(r->t)));
    cJSON_AddNumberToObject(j, "host_node_peak_bytes", (double)res->host_node_peak_bytes);
    cJSON_AddNumberToObject(j, "host_node_rss_peak_bytes", (double)res->host_node_rss_peak_bytes);
    if (tail_ms >= 0) cJSON_AddNumberToObject(j, "updates_tail_ms", tail_ms); /* the run's last step: finish_last */
    cJSON_AddItemToObject(j, "memmgr", cJSON_Parse(mm));
    cJSON_AddItemToObject(j, "host", cJSON_Parse(host));
    char *text = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!text) return td_error_set(TD_ERR_NOMEM, "--log %s: out of memory", r->o.log);
    int bad = fprintf(r->log, "%s\n", text) < 0 || fflush(r->log) != 0;
    cJSON_free(text);
    return bad ? td_error_set(TD_ERR_IO, "--log %s: %s", r->o.log, strerror(errno)) : TD_OK;
}

/* A step whose loss or grads were not finite: counted, and after
 * --max-bad-steps in a row the run stops unsaved.  A loss scaler skips
 * overflowing steps as a matter of course; without one, a skipped step had
 * non-finite grads. */
static td_status count_bad(const train_run *r, long s, const td_step_result *res, long *bad)
{
    if (isfinite(res->loss) && !(res->skipped && r->cfg.optim.scaler.kind == TD_LOSS_SCALE_NONE)) {
        *bad = 0;
        return TD_OK;
    }
    ++*bad;
    if (r->lead) fprintf(stderr, "%stidal train: step %ld: loss %g, grad norm %g: not finite; %s (%ld in a row, "
                         "--max-bad-steps %ld)\n", r->tty ? "\n" : "", s, res->loss, res->grad_norm,
                         res->skipped ? "skipped" : "the update ran", *bad, r->o.max_bad_steps);
    if (*bad < r->o.max_bad_steps) return TD_OK;
    return td_error_set(TD_ERR_STATE, "%ld steps in a row with a non-finite loss or grads (the last %ld); stopped "
                        "without saving%s%s; lower --lr or --clip-grad-norm", *bad, s,
                        r->o.save ? ", the last good checkpoint stays in " : "", r->o.save ? r->o.save : "");
}

/* The run's last step: its CPU AdamW updates, which the next step's
 * forward would hide (each chunk's just before its first use), waited for
 * here, so that what a run of few steps reports holds them: the record gets
 * how long they ran past the step (updates_tail_ms; step_ms is the step's
 * own), and its host peak counts them.  A step time plus its tail bounds a
 * step of a longer run from above. */
static td_status finish_last(train_run *r, long s, td_step_result *res, double *tail_ms)
{
    int pending = td_trainer_updates_pending(r->t);
    double t0 = td_now_ms();
    td_status st = td_trainer_finish_update(r->t);
    *tail_ms = td_now_ms() - t0;
    td_host_usage hu;
    if (st || (st = td_trainer_host_usage(r->t, &hu))) return st;
    if (hu.peak_bytes > res->host_node_peak_bytes) res->host_node_peak_bytes = hu.peak_bytes;
    if (hu.rss_peak_bytes > res->host_node_rss_peak_bytes) res->host_node_rss_peak_bytes = hu.rss_peak_bytes;
    if (r->lead && pending && (*tail_ms >= 1e3 || r->note_ms == 0)) { /* a line where it matters (every line: 0) */
        char el[32];
        if (*tail_ms < 1e3) snprintf(el, sizeof el, "%.0f ms", *tail_ms);
        else if (*tail_ms < 60e3) snprintf(el, sizeof el, "%.1f s", *tail_ms / 1e3);
        fprintf(stderr, "%sstep %ld: its updates (%d param chunks) finished %s after it; a next step's forward would "
                "hide them\n", r->tty ? "\n" : "", s, pending,
                *tail_ms < 60e3 ? el : format_span(*tail_ms, el, sizeof el));
    }
    return TD_OK;
}

/* The steps, with progress, the log, checkpoints and signals.  Returns 0,
 * or 128 + the signal that stopped the run (*st: a failure). */
static int train_loop(train_run *r, td_status *st)
{
    const td_cli_train_opts *o = &r->o;
    long first = td_trainer_optim(r->t)->step + 1, bad = 0;
    if (first > o->steps && r->lead) fprintf(stderr, "tidal train: already at step %ld of --steps %ld\n", first - 1, o->steps);
    long last = o->stop_after > 0 && first - 1 + o->stop_after < o->steps ? first - 1 + o->stop_after : o->steps;
    int stopping = 0; /* a signal while the run was set up: stop before the first step */
    if ((*st = any_rank_stopping(r->t, stop_signal, &stopping))) return 0;
    if (stopping) {
        if (r->lead) fprintf(stderr, "tidal train: %s: stopped before the first step\n", stopping == SIGINT ? "SIGINT" : "SIGTERM");
        return 128 + stopping;
    }
    for (long s = first; s <= last; s++) {
        td_step_result res;
        if (fault_step(s)) td_fault_arm(TD_FAULT_NONFINITE_GRAD, 1);
        r->step = s;
        r->step_t0 = r->noted = td_now_ms();
        *st = td_trainer_step(r->t, loader_batch, r->loader, &res);
        td_fault_arm(TD_FAULT_NONFINITE_GRAD, 0);
        if (*st || (*st = count_bad(r, s, &res, &bad))) return 0;
        if (r->lead && (r->tty || s == first || s == last || s % (o->log_every > 0 ? o->log_every : 10) == 0))
            progress(stderr, r->tty, s, o->steps, &res, r->t);
        double tail_ms = -1;
        if (s == last && (*st = finish_last(r, s, &res, &tail_ms))) return 0;
        if ((*st = log_step(r, s, &res, tail_ms)) || (*st = any_rank_stopping(r->t, stop_signal, &stopping))) return 0;
        if (stopping && !stop_signal) stop_signal = stopping; /* another rank's: stop alike */
        if (o->save && !bad && ((o->save_every > 0 && s % o->save_every == 0) || s == last || stopping)) {
            if ((*st = save_checkpoint(r->t, r->loader, o->save, o->data))) return 0;
            if (r->lead && (!r->tty || s == last || stopping))
                fprintf(stderr, "%ssaved %s at step %ld\n", r->tty ? "\n" : "", o->save, s);
        }
        if (stopping) {
            if (r->lead) fprintf(stderr, "%stidal train: %s: stopped after step %ld%s\n", r->tty ? "\n" : "",
                                 stop_signal == SIGINT ? "SIGINT" : "SIGTERM", s, o->save ? " (--resume continues)" : "");
            return 128 + stop_signal;
        }
    }
    if (r->tty && r->lead) fprintf(stderr, "\n");
    return 0;
}

/* The last step's updates applied (the next forward would have waited for
 * them: the run ends with all of its steps in the --trace-timeline and the
 * host footprint), and the footprint against the plan. */
static td_status print_end(train_run *r)
{
    td_host_usage hu;
    td_status st;
    if ((st = td_trainer_finish_update(r->t)) || (st = td_trainer_host_usage(r->t, &hu))) return st;
    if (!r->lead) return TD_OK;
    char a[32], b[32], c[32], d[32], e[32], f[32], region[64] = "";
    if (hu.device_region_bytes)
        snprintf(region, sizeof region, ", device region %s", td_format_bytes(hu.device_region_bytes, a, sizeof a));
    fprintf(stderr, "host: planned %s, peak %s (%s %s, %s pageable state, heap %s by %s%s); the process's resident "
            "peak %s (VmHWM: with the %s and the libraries' own pages)\n",
            td_format_bytes(r->hplan.host_bytes, a, sizeof a), td_format_bytes(hu.peak_bytes, b, sizeof b),
            td_format_bytes(hu.pinned_bytes, c, sizeof c), r->cfg.backend == TD_BACKEND_CUDA ? "pinned" : "copy buffers",
            td_format_bytes(hu.pageable_bytes, d, sizeof d), td_format_bytes(hu.heap_allocated_bytes, e, sizeof e),
            hu.heap_source, region, td_format_bytes(hu.rss_peak_bytes, f, sizeof f),
            r->cfg.backend == TD_BACKEND_CUDA ? "CUDA driver's" : "program's");
    return TD_OK;
}

int td_cli_train_main(int argc, char **argv)
{
    train_run r;
    memset(&r, 0, sizeof r);
    td_cli_train_opts_defaults(&r.o);
    int nproc = 1;
    double timeout_s = td_comm_default_params().timeout_ms / 1000.0;
    td_opt table[] = { TD_CLI_MODEL_OPTS(&r.o), TD_CLI_RUN_OPTS(&r.o), TD_CLI_OPTIM_OPTS(&r.o), TD_CLI_TRAIN_OPTS(&r.o),
                       {"nproc", TD_OPT_INT, &nproc, "N", "start N local ranks (one per GPU, as torchrun --nproc-per-node) that train\n"
                        "data-parallel with ZeRO-3: each rank's host holds its shard of every chunk (params, grads,\n"
                        "optimizer state; docs/distributed.md); --micro-batch is per rank (global batch = ranks x\n"
                        "micro-batch x grad-accum); NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT start this host's\n"
                        "ranks of a job over several hosts", 0},
                       {"comm-timeout", TD_OPT_DOUBLE, &timeout_s, "S", "several ranks: seconds a rank waits for the others "
                        "before it exits non-zero naming\nthe rank that stopped (default 60, or TD_COMM_TIMEOUT_MS)", 0},
                       {NULL, 0, NULL, NULL, NULL, 0} };
    r.table = table;
    int rc = td_args_main(table, argc, argv, "train", usage);
    if (rc >= 0) return rc;
    td_status st = TD_OK;
    if ((rc = train_job(&r, nproc, timeout_s, argc, argv)) >= 0 || (rc = train_prepare(&r)) >= 0) goto out;
    rc = 1;
    if ((st = train_create(&r, timeout_s)) || (st = print_start(&r))) goto fail;
    rc = train_loop(&r, &st);
    if (st || (!rc && (st = print_end(&r)))) goto fail;
    goto out;
fail:
    rc = 1;
    if (r.env.size > 1) fprintf(stderr, "\ntidal train: rank %d: %s\n", r.env.rank, td_error_msg());
    else fprintf(stderr, "\ntidal train: %s\n", td_error_msg());
out:
    if (r.log) fclose(r.log);
    td_trainer_destroy(r.t); /* its scratch files closed, their locks removed, before the handlers go */
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    td_loader_destroy(r.loader);
    td_args_free();
    return rc;
}
