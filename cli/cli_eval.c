/* `tidal eval` and `tidal generate`: a checkpoint's loss on a token file,
 * and text sampled from it. */
#include "args.h"
#include "cli.h"
#include "tidal/checkpoint.h"
#include "tidal/data.h"
#include "tidal/tokenizer.h"
#include "tidal/trainer.h"
#include "tidal/util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The options of every command that runs a checkpoint, one block for both. */
typedef struct model_opts {
    const char *checkpoint, *backend;
    size_t gpu_budget;
    int threads;
} model_opts;

#define MODEL_OPTS(m)                                                                                              \
    {"checkpoint", TD_OPT_STRING, &(m)->checkpoint, "DIR", "checkpoint directory (tidal's, or a Hugging Face GPT-2, LLaMA or Qwen2 one)", 0}, \
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

/* A trainer shaped by the checkpoint, holding its weights. */
static td_status open_model(const model_opts *m, int batch, int seq, td_trainer **out)
{
    const char *dir = m->checkpoint;
    td_status st;
    td_train_config c = td_train_default_config();
    if ((st = td_trainer_checkpoint_model(dir, &c.model))) return st;
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
    if ((st = td_trainer_load(*out, dir, 0, NULL))) {
        td_trainer_destroy(*out);
        *out = NULL;
    }
    return st;
}

static td_status loader_batch(void *ctx, int32_t *tokens, int32_t *targets)
{
    return td_loader_next(ctx, tokens, targets);
}

int td_cli_eval_main(int argc, char **argv)
{
    model_opts m = {.backend = "auto"};
    const char *data = NULL, *split = "all";
    int batches = 20, batch = 4, seq = 0, json = 0;
    double heldout = 10;
    td_opt table[] = {
        MODEL_OPTS(&m),
        {"data", TD_OPT_STRING, &data, "FILE", "token file (`tidal prepare`)", 0},
        {"batches", TD_OPT_INT, &batches, "N", "batches to average over (default 20)", 0},
        {"micro-batch", TD_OPT_INT, &batch, "B", "sequences per batch (default 4)", 0},
        {"seq", TD_OPT_INT, &seq, "T", "sequence length (default: the model's positions, at most 1024)", 0},
        {"split", TD_OPT_STRING, &split, "S", "all (default) or heldout: the last --heldout % of the sequences", 0},
        {"heldout", TD_OPT_DOUBLE, &heldout, "PCT", "the held-out share, as given to `tidal train --heldout` (default 10)", 0},
        {"json", TD_OPT_FLAG, &json, NULL, "print {\"loss\": ..., \"perplexity\": ..., \"tokens\": ...}", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = parse_model_command(table, argc, argv, "eval",
                                 "usage: tidal eval --checkpoint DIR --data FILE [options]\n\n"
                                 "The mean cross-entropy (nats per token) of a checkpoint on a token file, over\n"
                                 "--batches batches read in file order.");
    if (rc >= 0) return rc;
    rc = 1;
    td_trainer *t = NULL;
    td_loader *l = NULL;
    td_status st = td_args_require(table, "data", NULL);
    if (!st && strcmp(split, "all") && strcmp(split, "heldout"))
        st = td_error_set(TD_ERR_INVALID, "--split '%s': use all or heldout", split);
    if (!st && (batches < 1 || batch < 1)) st = td_error_set(TD_ERR_INVALID, "--batches and --micro-batch must be positive");
    if (st) {
        fprintf(stderr, "tidal eval: %s\n", td_error_msg());
        td_args_free();
        return 2;
    }
    if ((st = open_model(&m, batch, seq, &t))) goto cleanup;
    const td_train_config *c = td_trainer_config(t);
    td_loader_params lp = td_loader_default_params();
    lp.batch = (uint32_t)batch;
    lp.seq = (uint32_t)c->seq_len;
    lp.shuffle = 0;
    if (!strcmp(split, "heldout")) {
        lp.heldout_percent = heldout;
        lp.split = TD_DATA_HELDOUT;
    }
    if ((st = td_loader_open(data, &lp, &l))) goto cleanup;
    int vocab = (int)td_tokfile_get_info(td_loader_file(l))->vocab_size;
    if (vocab > c->model.vocab_size) {
        st = td_error_set(TD_ERR_INVALID, "%s has a vocabulary of %d, the model only %d", data, vocab, c->model.vocab_size);
        goto cleanup;
    }
    double loss;
    if ((st = td_trainer_eval(t, loader_batch, l, batches, &loss))) goto cleanup;
    double tokens = (double)batches * batch * c->seq_len;
    if (json) printf("{\"loss\":%.6f,\"perplexity\":%.4f,\"tokens\":%.0f}\n", loss, exp(loss), tokens);
    else printf("loss %.4f nats/token (perplexity %.2f) over %.0f tokens of %s\n", loss, exp(loss), tokens, data);
    rc = 0;
cleanup:
    if (st) fprintf(stderr, "tidal eval: %s\n", td_error_msg());
    td_loader_destroy(l);
    td_trainer_destroy(t);
    td_args_free();
    return rc;
}

/* Samples from softmax(logits / temperature) with a seeded RNG; greedy at 0. */
static int sample(const float *logits, int V, double temperature, td_rng *rng)
{
    int best = 0;
    for (int i = 1; i < V; i++) if (logits[i] > logits[best]) best = i;
    if (temperature <= 0) return best;
    double sum = 0, max = logits[best];
    for (int i = 0; i < V; i++) sum += exp((logits[i] - max) / temperature);
    double u = td_rng_uniform(rng) * sum, acc = 0;
    for (int i = 0; i < V; i++) {
        acc += exp((logits[i] - max) / temperature);
        if (acc >= u) return i;
    }
    return V - 1;
}

int td_cli_generate_main(int argc, char **argv)
{
    model_opts m = {.backend = "auto"};
    const char *prompt = "", *tok_kind = NULL, *vocab_path = NULL, *merges = NULL;
    int tokens = 200;
    double temperature = 0.8;
    uint64_t seed = 1;
    td_opt table[] = {
        MODEL_OPTS(&m),
        {"prompt", TD_OPT_STRING, &prompt, "TEXT", "text to continue (default: empty)", 0},
        {"tokens", TD_OPT_INT, &tokens, "N", "tokens to generate (default 200)", 0},
        {"temperature", TD_OPT_DOUBLE, &temperature, "T", "sampling temperature; 0 is greedy (default 0.8)", 0},
        {"seed", TD_OPT_U64, &seed, "S", "sampling seed (default 1)", 0},
        {"tokenizer", TD_OPT_STRING, &tok_kind, "K", "byte, gpt2 or a tokenizer.json (a .json file or a folder\n"
                                                    "holding one; default: what the checkpoint was trained with,\n"
                                                    "or the tokenizer.json / vocab.json + merges.txt it holds)", 0},
        {"vocab", TD_OPT_STRING, &vocab_path, "FILE", "gpt2: vocab.json (default: the checkpoint's own)", 0},
        {"merges", TD_OPT_STRING, &merges, "FILE", "gpt2: merges.txt (default: the checkpoint's own)", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = parse_model_command(table, argc, argv, "generate",
                                 "usage: tidal generate --checkpoint DIR [--prompt TEXT] [options]\n\n"
                                 "Continues the prompt with text sampled from the model, one token at a time.\n"
                                 "The tokenizer is the one the checkpoint carries (tidal's checkpoints keep\n"
                                 "the tokenizer.json or vocab.json + merges.txt the data was prepared with;\n"
                                 "a Hugging Face folder holds its own), unless --tokenizer names another.");
    if (rc >= 0) return rc;
    rc = 1;
    td_trainer *t = NULL;
    td_tokenizer *tk = NULL;
    td_ckpt_reader *rd = NULL;
    uint32_t *ids = NULL;
    int32_t *ctx = NULL;
    float *logits = NULL;
    td_status st = TD_OK;
    if (tokens < 1 || !(temperature >= 0 && temperature <= 1e6)) {
        fprintf(stderr, "tidal generate: --tokens %d, --temperature %g: give a positive count of tokens and a "
                "temperature from 0 (greedy) to 1e6\n", tokens, temperature);
        td_args_free();
        return 2;
    }
    /* The tokenizer: the flag, else the checkpoint's record, else byte. */
    if (!tok_kind && td_ckpt_reader_open(m.checkpoint, NULL, &rd) == TD_OK) {
        const char *k = td_ckpt_reader_meta(rd, "tokenizer");
        tok_kind = k ? (!strcmp(k, "gpt2") ? "gpt2" : !strcmp(k, "json") ? "json" : "byte") : NULL;
    }
    /* GPT-2 BPE files: the flags, else the ones the checkpoint carries (as
     * tidal's checkpoints and Hugging Face directories do). */
    char ck_vocab[4096], ck_merges[4096];
    snprintf(ck_vocab, sizeof ck_vocab, "%s/vocab.json", m.checkpoint);
    snprintf(ck_merges, sizeof ck_merges, "%s/merges.txt", m.checkpoint);
    int carried = access(ck_vocab, R_OK) == 0 && access(ck_merges, R_OK) == 0;
    char ck_json[4096];
    snprintf(ck_json, sizeof ck_json, "%s/tokenizer.json", m.checkpoint);
    int carried_json = access(ck_json, R_OK) == 0;
    /* No flag and no record (a Hugging Face directory): the files it holds. */
    if (!tok_kind && carried_json) tok_kind = "json";
    if (!tok_kind && carried) tok_kind = "gpt2";
    if (!tok_kind) tok_kind = "byte";
    if (!strcmp(tok_kind, "json")) {
        if (!carried_json) {
            st = td_error_set(TD_ERR_INVALID, "%s was trained with a tokenizer.json it does not carry; give it with "
                              "--tokenizer PATH/tokenizer.json", m.checkpoint);
            goto cleanup;
        }
        if ((st = td_tokenizer_load_json(ck_json, &tk))) goto cleanup;
    } else if (strcmp(tok_kind, "gpt2") && strcmp(tok_kind, "byte") && td_tokenizer_json_path(tok_kind, NULL, 0)) {
        if ((st = td_tokenizer_load_json(tok_kind, &tk))) goto cleanup;
    } else if (!strcmp(tok_kind, "gpt2")) {
        if ((!vocab_path || !merges) && carried) {
            if (!vocab_path) vocab_path = ck_vocab;
            if (!merges) merges = ck_merges;
        }
        if (!vocab_path || !merges) {
            st = td_error_set(TD_ERR_INVALID, "a gpt2 model needs --vocab vocab.json --merges merges.txt to read and "
                              "write text (%s carries none: it was trained on a token file whose tokenizer files "
                              "were not kept beside it)", m.checkpoint);
            goto cleanup;
        }
        if ((st = td_tokenizer_load_gpt2(vocab_path, merges, &tk))) goto cleanup;
    } else if (!strcmp(tok_kind, "byte")) {
        if ((st = td_tokenizer_create_byte(&tk))) goto cleanup;
    } else {
        st = td_error_set(TD_ERR_INVALID, "--tokenizer '%s': use byte, gpt2, a tokenizer.json or a folder holding "
                          "one", tok_kind);
        goto cleanup;
    }
    if ((st = open_model(&m, 1, 0, &t))) goto cleanup;
    const td_train_config *c = td_trainer_config(t);
    if ((int)td_tokenizer_vocab_size(tk) > c->model.vocab_size) {
        st = td_error_set(TD_ERR_INVALID, "the %s tokenizer has %u tokens, the model %d", tok_kind,
                          td_tokenizer_vocab_size(tk), c->model.vocab_size);
        goto cleanup;
    }
    size_t n = 0;
    if ((st = td_tokenizer_encode_alloc(tk, prompt, strlen(prompt), &ids, &n))) goto cleanup;
    int T = c->seq_len, V = c->model.vocab_size;
    ctx = malloc(sizeof(int32_t) * (size_t)T);
    logits = malloc(sizeof(float) * (size_t)V);
    if (!ctx || !logits) { st = td_error_set(TD_ERR_NOMEM, "out of memory"); goto cleanup; }
    int len = 0;
    /* A document starts with the begin-of-text token where the tokenizer has
     * one (as tidal prepare wrote it), else an empty prompt follows an end of text. */
    uint32_t bos = td_tokenizer_bos(tk);
    if (bos != TD_TOKEN_NONE) ctx[len++] = (int32_t)bos;
    else if (n == 0) ctx[len++] = (int32_t)td_tokenizer_eot(tk);
    for (size_t i = n > (size_t)(T - len) ? n - (size_t)(T - len) : 0; i < n; i++) ctx[len++] = (int32_t)ids[i];
    td_rng rng;
    td_rng_seed(&rng, seed);
    fwrite(prompt, 1, strlen(prompt), stdout);
    for (int k = 0; k < tokens; k++) {
        if ((st = td_trainer_next_logits(t, ctx, len, logits))) goto cleanup;
        int next = sample(logits, (int)td_tokenizer_vocab_size(tk), temperature, &rng);
        size_t blen = 0;
        const char *bytes = td_tokenizer_token_bytes(tk, (uint32_t)next, &blen);
        if ((uint32_t)next == td_tokenizer_eot(tk)) {
            printf("\n");
            break;
        }
        if (bytes) fwrite(bytes, 1, blen, stdout);
        fflush(stdout);
        if (len == T) { /* slide the window */
            memmove(ctx, ctx + 1, sizeof(int32_t) * (size_t)(T - 1));
            len--;
        }
        ctx[len++] = next;
    }
    printf("\n");
    rc = 0;
cleanup:
    if (st) fprintf(stderr, "tidal generate: %s\n", td_error_msg());
    free(ctx);
    free(logits);
    td_free(ids);
    td_ckpt_reader_close(rd);
    td_tokenizer_destroy(tk);
    td_trainer_destroy(t);
    td_args_free();
    return rc;
}
