/* `tidal eval`: a checkpoint's mean loss on a token file. */
#include "args.h"
#include <cjson/cJSON.h>
#include "cli.h"
#include "train_opts.h"
#include "tidal/checkpoint.h"
#include "tidal/data.h"
#include "tidal/trainer.h"
#include "tidal/util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The options that run a checkpoint. */
typedef struct model_opts {
    const char *checkpoint, *base, *backend;
    size_t gpu_budget;
    int threads;
} model_opts;

#define MODEL_OPTS(m)                                                                                              \
    {"checkpoint", TD_OPT_STRING, &(m)->checkpoint, "DIR", "checkpoint directory (tidal's, or a Hugging Face one: tidal train --help lists\nthe families), or a LoRA adapter folder (PEFT's), run over its base", 0}, \
    {"base", TD_OPT_STRING, &(m)->base, "DIR", "an adapter folder's base model (default: its base_model_name_or_path)", 0}, \
    {"backend", TD_OPT_STRING, &(m)->backend, "B", "auto (default: cuda when a GPU answers), cpu or cuda", 0},                             \
    {"gpu-budget", TD_OPT_BUDGET, &(m)->gpu_budget, "SIZE", "device budget (default: what the model needs, at most the free memory;\nmax: all free memory)", 0}, \
    {"threads", TD_OPT_INT, &(m)->threads, "N", "CPU threads (default: the cores this process may run on, at most the\n" \
     "physical ones, less those other processes keep busy)", 0}

/* Parses a checkpoint command's options: -1 to go on, else its exit code. */
static int parse_model_command(td_opt *table, int argc, char **argv, const char *cmd, const char *usage)
{
    int rc = td_args_main(table, argc, argv, cmd, usage);
    if (rc >= 0) return rc;
    td_status st = td_args_require(table, "checkpoint", NULL);
    const td_opt *threads = td_args_find(table, "threads");
    if (!st && *(int *)threads->dst < 0)
        st = td_error_set(TD_ERR_INVALID, "--threads %d: give a count of threads, or leave it out", *(int *)threads->dst);
    if (!st) return -1;
    fprintf(stderr, "tidal %s: %s\n(tidal %s --help lists the options)\n", cmd, td_error_msg(), cmd);
    td_args_free();
    return 2;
}

/* A trainer shaped by the checkpoint, holding its weights (an adapter
 * folder's: its base's and the adapters). */
static td_status open_model(const model_opts *m, int batch, int seq, td_trainer **out)
{
    const char *dir = m->checkpoint;
    char base[4096];
    td_status st;
    td_train_config c = td_train_default_config();
    int adapter = 0;
    if ((st = td_cli_adapter_model(dir, m->base, &c.model, base, sizeof base, &adapter))) return st;
    if (!adapter && m->base)
        return td_error_set(TD_ERR_INVALID, "--base goes with an adapter folder; %s holds no adapter_config.json", dir);
    if (!adapter && (st = td_trainer_checkpoint_model(dir, &c.model))) return st;
    c.micro_batch = batch;
    /* Default: the model's positions, at most 1024 (LLaMA-family models
     * allow 131072, whose activations would not fit anywhere). */
    c.seq_len = seq > 0 ? seq : c.model.n_positions < 1024 ? c.model.n_positions : 1024;
    if (c.seq_len > c.model.n_positions)
        return td_error_set(TD_ERR_INVALID, "--seq %d is longer than the model's %d positions", seq, c.model.n_positions);
    c.gpu_budget = m->gpu_budget;
    c.threads = m->threads;
    c.ckpt = TD_CKPT_OFF;
    if ((st = td_backend_kind_parse(m->backend, &c.backend))) return td_error_prefix(st, "--backend: ");
    if ((st = td_trainer_create(&c, out))) return st;
    if ((st = td_trainer_load(*out, adapter ? base : dir, 0, NULL)) ||
        (adapter && (st = td_trainer_load_adapter(*out, dir, 0)))) {
        td_trainer_destroy(*out);
        *out = NULL;
    }
    return st;
}

/* Batches of the loader; with `once` (--batches all), the rows past the
 * split's end (the next epoch's first) count nothing, so the file is read
 * once. */
typedef struct eval_batches { td_loader *l; uint32_t B, T; int once; uint64_t left; } eval_batches;

static td_status loader_batch(void *ctx, int32_t *tokens, int32_t *targets, int32_t *positions)
{
    eval_batches *e = ctx;
    td_status st = td_loader_next(e->l, tokens, targets, positions);
    if (st || !e->once) return st;
    for (uint32_t b = (uint32_t)(e->left < e->B ? e->left : e->B); b < e->B; b++)
        for (uint32_t t = 0; t < e->T; t++) targets[(size_t)b * e->T + t] = -1;
    e->left -= e->left < e->B ? e->left : e->B;
    return TD_OK;
}

/* The command's options. */
typedef struct eval_opts {
    model_opts m;
    const char *data, *split, *batches_text;
    int batches, batch, seq, json, all;
    double heldout;
} eval_opts;

/* The options' checks (--batches read into batches and all); TD_OK or the
 * usage error. */
static td_status eval_check(const td_opt *table, eval_opts *o)
{
    td_status st = td_args_require(table, "data", NULL);
    if (!st && strcmp(o->split, "all") && strcmp(o->split, "heldout"))
        st = td_error_set(TD_ERR_INVALID, "--split '%s': use all or heldout", o->split);
    o->all = !strcmp(o->batches_text, "all");
    if (!st && !o->all) {
        char *end;
        long v = strtol(o->batches_text, &end, 10);
        if (*end || end == o->batches_text || v < 1 || v > 1000000000)
            st = td_error_set(TD_ERR_INVALID, "--batches '%s': a positive number, or all", o->batches_text);
        else o->batches = (int)v;
    }
    if (!st && o->batch < 1) st = td_error_set(TD_ERR_INVALID, "--micro-batch must be positive");
    return st;
}

/* The loader over --data's split in file order for the model c, and the
 * batches to read (--batches all: every sequence once). */
static td_status eval_loader(eval_opts *o, const td_train_config *c, td_loader **l, eval_batches *eb)
{
    td_status st;
    td_loader_params lp = td_loader_default_params();
    lp.batch = (uint32_t)o->batch;
    lp.seq = (uint32_t)c->seq_len;
    lp.shuffle = 0;
    if (!strcmp(o->split, "heldout")) {
        lp.heldout_percent = o->heldout;
        lp.split = TD_DATA_HELDOUT;
    }
    if ((st = td_loader_open(o->data, &lp, l))) return st;
    int vocab = (int)td_tokfile_get_info(td_loader_file(*l))->vocab_size;
    if (vocab > c->model.vocab_size)
        return td_error_set(TD_ERR_INVALID, "%s has a vocabulary of %d, the model only %d", o->data, vocab,
                            c->model.vocab_size);
    *eb = (eval_batches){*l, (uint32_t)o->batch, (uint32_t)c->seq_len, o->all, td_loader_sequences(*l)};
    if (o->all) {
        uint64_t n = (eb->left + (uint64_t)o->batch - 1) / (uint64_t)o->batch;
        if (n > 1000000000)
            return td_error_set(TD_ERR_INVALID, "%s holds %llu sequences: too many batches for --batches all", o->data,
                                (unsigned long long)eb->left);
        o->batches = (int)n;
    }
    return TD_OK;
}

static td_status eval_report(const eval_opts *o, double loss, uint64_t tokens)
{
    if (!o->json) {
        printf("loss %.4f nats/token (perplexity %.2f) over %llu tokens of %s (%d batches)\n", loss, exp(loss),
               (unsigned long long)tokens, o->data, o->batches);
        return TD_OK;
    }
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "loss", loss);
    cJSON_AddNumberToObject(j, "perplexity", exp(loss));
    cJSON_AddNumberToObject(j, "tokens", (double)tokens);
    cJSON_AddNumberToObject(j, "batches", o->batches);
    return td_cli_print_json(j);
}

int td_cli_eval_main(int argc, char **argv)
{
    eval_opts o = {.m = {.backend = "auto"}, .split = "all", .batches_text = "20", .batches = 20, .batch = 4,
                   .heldout = 10};
    td_opt table[] = {
        MODEL_OPTS(&o.m),
        {"data", TD_OPT_STRING, &o.data, "FILE", "token file (`tidal prepare`)", 0},
        {"batches", TD_OPT_STRING, &o.batches_text, "N", "batches to average over (default 20), or all: every sequence\n"
                                                          "of the split once", 0},
        {"micro-batch", TD_OPT_INT, &o.batch, "B", "sequences per batch (default 4)", 0},
        {"seq", TD_OPT_INT, &o.seq, "T", "sequence length (default: a file of packed rows' row length, else the\n"
                                         "model's positions, at most 1024)", 0},
        {"split", TD_OPT_STRING, &o.split, "S", "all (default) or heldout: the last --heldout % of the sequences", 0},
        {"heldout", TD_OPT_DOUBLE, &o.heldout, "PCT", "the held-out share, as given to `tidal train --heldout` (default 10)", 0},
        {"json", TD_OPT_FLAG, &o.json, NULL, "print {\"loss\": ..., \"perplexity\": ..., \"tokens\": ...}: tokens\n"
                                            "counts the targets the loss averages over", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = parse_model_command(table, argc, argv, "eval",
                                 "usage: tidal eval --checkpoint DIR --data FILE [options]\n\n"
                                 "The mean cross-entropy (nats per token) of a checkpoint on a token file, over\n"
                                 "--batches batches read in file order: over the targets that count (a\n"
                                 "file of JSONL records counts only the tokens its --loss-on named, never\n"
                                 "padding), with packed documents seen one by one.");
    if (rc >= 0) return rc;
    td_trainer *t = NULL;
    td_loader *l = NULL;
    td_status st = eval_check(table, &o);
    if (st) {
        fprintf(stderr, "tidal eval: %s\n", td_error_msg());
        td_args_free();
        return 2;
    }
    if (o.seq <= 0) { /* a file of packed rows is read with its own row length */
        td_tokfile *f = NULL;
        if ((st = td_tokfile_open(o.data, &f))) goto cleanup;
        o.seq = (int)td_tokfile_get_info(f)->row_tokens;
        td_tokfile_close(f);
    }
    eval_batches eb;
    double loss;
    uint64_t tokens = 0;
    if ((st = open_model(&o.m, o.batch, o.seq, &t)) || (st = eval_loader(&o, td_trainer_config(t), &l, &eb)) ||
        (st = td_trainer_eval(t, loader_batch, &eb, o.batches, &loss, &tokens)))
        goto cleanup;
    st = eval_report(&o, loss, tokens);
cleanup:
    if (st) fprintf(stderr, "tidal eval: %s\n", td_error_msg());
    td_loader_destroy(l);
    td_trainer_destroy(t);
    td_args_free();
    return st ? 1 : 0;
}
