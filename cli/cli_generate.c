/* `tidal generate`: text sampled from a checkpoint, one token at a time, by
 * the key/value-cache decoder (decode.h) on the CPU: each token costs one
 * position's work, not a forward over the whole window. */
#include "args.h"
#include "cli.h"
#include "train_opts.h"
#include "tidal/chat.h"
#include "tidal/checkpoint.h"
#include "tidal/decode.h"
#include "tidal/tokenizer.h"
#include "tidal/trainer.h"
#include "tidal/util.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char usage[] =
    "usage: tidal generate --checkpoint DIR [--prompt TEXT] [options]\n\n"
    "Continues the prompt with text sampled from the model, one token at a time, on the CPU\n"
    "with a key/value cache (each token costs one position's work; the weights take 4 bytes\n"
    "a parameter of host memory).  Past the model's positions (at most --context) it goes on\n"
    "from the last half of the text so far.  The tokenizer is the one the checkpoint carries\n"
    "(tidal's checkpoints keep the tokenizer.json or vocab.json + merges.txt the data was\n"
    "prepared with; a Hugging Face folder holds its own), unless --tokenizer names another.\n"
    "With --chat the prompt is a user message rendered with the model's chat template\n"
    "(generation prompt on) and the answer ends at the template's end-of-turn token.\n"
    "The text goes to stdout; the speed to stderr.";

typedef struct gen_opts {
    const char *checkpoint, *prompt, *tokenizer, *vocab, *merges, *chat_template, *system;
    const char *base;  /* --base: an adapter folder's base model */
    const char *files; /* where the tokenizer and chat template are: the checkpoint, or an adapter's base */
    int tokens, threads, context, chat;
    double temperature;
    uint64_t seed;
} gen_opts;

/* The tokenizer: --tokenizer, else the checkpoint's record of what its
 * data was made with, else the files it holds, else bytes. */
static td_status open_tokenizer(const gen_opts *o, td_tokenizer **tk)
{
    const char *kind = o->tokenizer, *vocab = o->vocab, *merges = o->merges;
    td_ckpt_reader *rd = NULL;
    if (!kind && td_ckpt_reader_open(o->files, NULL, &rd) == TD_OK) {
        const char *k = td_ckpt_reader_meta(rd, "tokenizer");
        kind = k ? (!strcmp(k, "gpt2") ? "gpt2" : !strcmp(k, "json") ? "json" : "byte") : NULL;
    }
    td_ckpt_reader_close(rd);
    td_error_clear();
    char ck_vocab[4096], ck_merges[4096], ck_json[4096];
    snprintf(ck_vocab, sizeof ck_vocab, "%s/vocab.json", o->files);
    snprintf(ck_merges, sizeof ck_merges, "%s/merges.txt", o->files);
    snprintf(ck_json, sizeof ck_json, "%s/tokenizer.json", o->files);
    int carried = access(ck_vocab, R_OK) == 0 && access(ck_merges, R_OK) == 0, carried_json = access(ck_json, R_OK) == 0;
    if (!kind) kind = carried_json ? "json" : carried ? "gpt2" : "byte";
    if (!strcmp(kind, "json")) {
        if (!carried_json)
            return td_error_set(TD_ERR_INVALID, "%s was trained with a tokenizer.json it does not carry; give it with "
                                "--tokenizer PATH/tokenizer.json", o->files);
        return td_tokenizer_load_json(ck_json, tk);
    }
    if (strcmp(kind, "gpt2") && strcmp(kind, "byte") && td_tokenizer_json_path(kind, NULL, 0))
        return td_tokenizer_load_json(kind, tk);
    if (!strcmp(kind, "byte")) return td_tokenizer_create_byte(tk);
    if (strcmp(kind, "gpt2"))
        return td_error_set(TD_ERR_INVALID, "--tokenizer '%s': use byte, gpt2, a tokenizer.json or a folder holding one",
                            kind);
    if (!vocab && carried) vocab = ck_vocab;
    if (!merges && carried) merges = ck_merges;
    if (!vocab || !merges)
        return td_error_set(TD_ERR_INVALID, "a gpt2 model needs --vocab vocab.json --merges merges.txt to read and "
                            "write text (%s carries none: it was trained on a token file whose tokenizer files were "
                            "not kept beside it)", o->files);
    return td_tokenizer_load_gpt2(vocab, merges, tk);
}

/* The checkpoint's weights as one flat fp32 buffer in the model's layout
 * (a fused tensor's parts, as Hugging Face stores them, in their places). */
static td_status load_weights(const char *dir, td_model_desc *cfg, float **params)
{
    td_ckpt_reader *r = NULL;
    td_status st = td_trainer_checkpoint_model(dir, cfg);
    if (st || (st = td_ckpt_reader_open(dir, cfg, &r))) return st;
    size_t n = td_model_params_numel(cfg);
    char need[32];
    *params = td_malloc(n * sizeof(float), TD_ROLE_META);
    if (!*params) {
        td_ckpt_reader_close(r);
        return td_error_set(TD_ERR_NOMEM, "the %zu weights of %s need %s of host memory in fp32", n, dir,
                            td_format_bytes(n * sizeof(float), need, sizeof need));
    }
    for (int k = 0; k < td_model_hf_count(cfg) && !st; k++) {
        td_model_hf_tensor p;
        td_model_tensor t;
        if ((st = td_model_hf_get(cfg, k, &p))) break;
        td_model_tensor_get(cfg, p.tensor, &t);
        st = td_ckpt_reader_get_weight(r, k, TD_DTYPE_F32, *params + t.offset + p.offset);
    }
    td_ckpt_reader_close(r);
    if (st) {
        td_free(*params);
        *params = NULL;
    }
    return st;
}

/* An adapter folder's model: its base's weights with the adapters merged
 * (W + s B A), through a trainer on the cpu backend that holds both, as one
 * flat fp32 buffer in the base model's layout; *cfg the base's description. */
static td_status load_adapter_weights(const char *dir, const char *base, td_model_desc *lora, td_model_desc *cfg,
                                      float **params)
{
    td_train_config c = td_train_default_config();
    c.model = *lora;
    c.micro_batch = 1;
    c.seq_len = 1;
    c.backend = TD_BACKEND_CPU;
    c.ckpt = TD_CKPT_OFF;
    *cfg = *lora;
    cfg->lora = (td_model_lora){0};
    size_t n = td_model_params_numel(cfg);
    char need[32];
    td_trainer *t = NULL;
    td_status st = td_trainer_create(&c, &t);
    if (!st && !(st = td_trainer_load(t, base, 0, NULL)) && !(st = td_trainer_load_adapter(t, dir, 0))) {
        if (!(*params = td_malloc(n * sizeof(float), TD_ROLE_META)))
            st = td_error_set(TD_ERR_NOMEM, "the %zu merged weights of %s need %s of host memory in fp32", n, dir,
                              td_format_bytes(n * sizeof(float), need, sizeof need));
        else st = td_trainer_merged_params(t, *params);
    }
    td_trainer_destroy(t);
    if (st) {
        td_free(*params);
        *params = NULL;
    }
    return st;
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

/* --chat: the prompt (after --system) as a conversation rendered with the
 * chat template, generation prompt on (td_malloc'd into *text), and the
 * token that ends an answer (the template's eos_token when it is one
 * token, else none). */
static td_status chat_prompt(const gen_opts *o, td_tokenizer *tk, char **text, size_t *len, uint32_t *stop)
{
    td_chat_template *t = NULL;
    char *json = NULL;
    td_status st = td_chat_template_load(o->chat_template ? o->chat_template : o->files, &t);
    if (st) return st;
    cJSON *conv = cJSON_CreateObject(), *msgs = cJSON_AddArrayToObject(conv, "messages");
    const char *roles[2] = {"system", "user"}, *contents[2] = {o->system, o->prompt};
    for (int k = 0; k < 2; k++) {
        if (!contents[k]) continue;
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", roles[k]);
        cJSON_AddStringToObject(m, "content", contents[k]);
        cJSON_AddItemToArray(msgs, m);
    }
    json = cJSON_PrintUnformatted(conv);
    cJSON_Delete(conv);
    if (!json) TD_FAIL(TD_ERR_NOMEM, "out of memory");
    TD_TRY(td_chat_template_render(t, json, strlen(json), 1, text, len));
    *stop = TD_TOKEN_NONE;
    const char *eos = td_chat_template_token(t, "eos_token");
    uint32_t *e = NULL;
    size_t ne = 0;
    if (eos && td_tokenizer_encode_alloc(tk, eos, strlen(eos), &e, &ne) == TD_OK && ne == 1) *stop = e[0];
    td_free(e);
cleanup:
    cJSON_free(json);
    td_chat_template_free(t);
    return st;
}

/* Feeds ctx[0, n) from an empty cache; the logits after the last. */
static td_status prefill(td_decoder *d, const int32_t *ctx, int n, float *logits)
{
    td_decoder_reset(d);
    td_status st = TD_OK;
    for (int i = 0; i < n && !st; i++) st = td_decoder_step(d, ctx[i], logits);
    return st;
}

/* The sampling loop: the prompt's tokens (after the begin-of-text token
 * where the tokenizer has one, as `tidal prepare` wrote it, else an end of
 * text before an empty prompt), then `tokens` new ones; a full window goes
 * on from its last half. */
static td_status generate(const gen_opts *o, td_tokenizer *tk, td_decoder *d, int T, int V, int *made)
{
    td_status st = TD_OK;
    uint32_t *ids = NULL, stop = TD_TOKEN_NONE;
    size_t n = 0, text_len = strlen(o->prompt);
    char *rendered = NULL;
    const char *text = o->prompt;
    int32_t *ctx = td_malloc(sizeof(int32_t) * (size_t)T, TD_ROLE_META);
    float *logits = td_malloc(sizeof(float) * (size_t)V, TD_ROLE_META);
    if (!ctx || !logits) TD_FAIL(TD_ERR_NOMEM, "out of memory for a context of %d tokens", T);
    if (o->chat) {
        TD_TRY(chat_prompt(o, tk, &rendered, &text_len, &stop));
        text = rendered;
    }
    TD_TRY(td_tokenizer_encode_alloc(tk, text, text_len, &ids, &n));
    int len = 0;
    uint32_t bos = o->chat ? TD_TOKEN_NONE : td_tokenizer_bos(tk); /* a chat template writes its own */
    if (bos != TD_TOKEN_NONE) ctx[len++] = (int32_t)bos;
    else if (n == 0) ctx[len++] = (int32_t)td_tokenizer_eot(tk);
    for (size_t i = n > (size_t)(T - len) ? n - (size_t)(T - len) : 0; i < n; i++) ctx[len++] = (int32_t)ids[i];
    TD_TRY(prefill(d, ctx, len, logits));
    td_rng rng;
    td_rng_seed(&rng, o->seed);
    if (!o->chat) fwrite(o->prompt, 1, strlen(o->prompt), stdout); /* with --chat: the answer alone */
    for (*made = 0; *made < o->tokens; ++*made) {
        int next = sample(logits, (int)td_tokenizer_vocab_size(tk), o->temperature, &rng);
        if ((uint32_t)next == td_tokenizer_eot(tk) || (uint32_t)next == stop) break;
        size_t blen = 0;
        const char *bytes = td_tokenizer_token_bytes(tk, (uint32_t)next, &blen);
        if (bytes) fwrite(bytes, 1, blen, stdout);
        fflush(stdout);
        if (len == T) { /* the window is full: go on from its last half */
            int keep = T / 2;
            memmove(ctx, ctx + len - keep, sizeof(int32_t) * (size_t)keep);
            len = keep;
            TD_TRY(prefill(d, ctx, len, logits));
        }
        ctx[len++] = next;
        TD_TRY(td_decoder_step(d, next, logits));
    }
    printf("\n");
    fflush(stdout); /* before the speed on stderr */
cleanup:
    td_free(ids);
    td_free(rendered);
    td_free(ctx);
    td_free(logits);
    return st;
}

/* The options' checks: -1 to go on, else the exit code. */
static int check_options(td_opt *table, const gen_opts *o)
{
    td_status st = td_args_require(table, "checkpoint", NULL);
    if (!st && o->tokens < 1) st = td_error_set(TD_ERR_INVALID, "--tokens %d: give a positive count", o->tokens);
    if (!st && !(o->temperature >= 0 && o->temperature <= 1e6))
        st = td_error_set(TD_ERR_INVALID, "--temperature %g: give a temperature from 0 (greedy) to 1e6", o->temperature);
    if (!st && o->threads < 0) st = td_error_set(TD_ERR_INVALID, "--threads %d: give a count, or leave it out", o->threads);
    if (!st && o->context < 0) st = td_error_set(TD_ERR_INVALID, "--context %d: give a count of tokens", o->context);
    if (!st && !o->chat && (o->chat_template || o->system))
        st = td_error_set(TD_ERR_INVALID, "--chat-template and --system go with --chat");
    if (!st) return -1;
    fprintf(stderr, "tidal generate: %s\n(tidal generate --help lists the options)\n", td_error_msg());
    return 2;
}

int td_cli_generate_main(int argc, char **argv)
{
    gen_opts o = {.prompt = "", .tokens = 200, .temperature = 0.8, .seed = 1};
    td_opt table[] = {
        {"checkpoint", TD_OPT_STRING, &o.checkpoint, "DIR", "checkpoint directory (tidal's, or a Hugging Face one: tidal train --help lists\nthe families), or a LoRA adapter folder (PEFT's), its adapters merged\ninto its base", 0},
        {"base", TD_OPT_STRING, &o.base, "DIR", "an adapter folder's base model (default: its base_model_name_or_path)", 0},
        {"prompt", TD_OPT_STRING, &o.prompt, "TEXT", "text to continue (default: empty)", 0},
        {"tokens", TD_OPT_INT, &o.tokens, "N", "tokens to generate (default 200)", 0},
        {"temperature", TD_OPT_DOUBLE, &o.temperature, "T", "sampling temperature; 0 is greedy (default 0.8)", 0},
        {"seed", TD_OPT_U64, &o.seed, "S", "sampling seed (default 1)", 0},
        {"context", TD_OPT_INT, &o.context, "T", "the longest context (default: the model's positions, at most 1024)", 0},
        {"threads", TD_OPT_INT, &o.threads, "N", "CPU threads (default: the cores this process may run on, at most the\n"
                                                "physical ones, less those other processes keep busy)", 0},
        {"tokenizer", TD_OPT_STRING, &o.tokenizer, "K", "byte, gpt2 or a tokenizer.json (a .json file or a folder\n"
                                                       "holding one; default: what the checkpoint was trained with,\n"
                                                       "or the tokenizer.json / vocab.json + merges.txt it holds)", 0},
        {"vocab", TD_OPT_STRING, &o.vocab, "FILE", "gpt2: vocab.json (default: the checkpoint's own)", 0},
        {"merges", TD_OPT_STRING, &o.merges, "FILE", "gpt2: merges.txt (default: the checkpoint's own)", 0},
        {"chat", TD_OPT_FLAG, &o.chat, NULL, "the prompt is a user message in the model's chat template; print\n"
                                             "the answer, which ends at the template's eos_token", 0},
        {"chat-template", TD_OPT_STRING, &o.chat_template, "PATH", "with --chat: a .jinja file, a tokenizer_config.json or a\n"
                                                                   "folder (default: the checkpoint's own)", 0},
        {"system", TD_OPT_STRING, &o.system, "TEXT", "with --chat: a system message before the prompt", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = td_args_main(table, argc, argv, "generate", usage);
    if (rc >= 0) return rc;
    if ((rc = check_options(table, &o)) >= 0) goto out;
    rc = 1;
    td_tokenizer *tk = NULL;
    td_decoder *d = NULL;
    float *params = NULL;
    td_model_desc cfg, lora;
    char base[4096];
    int adapter = 0;
    td_status st = td_cli_adapter_model(o.checkpoint, o.base, &lora, base, sizeof base, &adapter);
    if (st) {
        fprintf(stderr, "tidal generate: %s\n", td_error_msg());
        rc = st == TD_ERR_INVALID ? 2 : 1;
        goto out;
    }
    if (!adapter && o.base) {
        fprintf(stderr, "tidal generate: --base goes with an adapter folder; %s holds no adapter_config.json\n",
                o.checkpoint);
        rc = 2;
        goto out;
    }
    /* an adapter folder's tokenizer: its own files when it has them, else its base's */
    char own[4200], own_json[4200];
    snprintf(own, sizeof own, "%s/vocab.json", o.checkpoint);
    snprintf(own_json, sizeof own_json, "%s/tokenizer.json", o.checkpoint);
    o.files = adapter && access(own, R_OK) != 0 && access(own_json, R_OK) != 0 ? base : o.checkpoint;
    if ((st = open_tokenizer(&o, &tk))) goto done;
    if (adapter) st = load_adapter_weights(o.checkpoint, base, &lora, &cfg, &params);
    else st = load_weights(o.checkpoint, &cfg, &params);
    if (st) goto done;
    if ((int)td_tokenizer_vocab_size(tk) > cfg.vocab_size) {
        st = td_error_set(TD_ERR_INVALID, "the tokenizer has %u tokens, the model %d", td_tokenizer_vocab_size(tk),
                          cfg.vocab_size);
        goto done;
    }
    int T = o.context ? o.context : cfg.n_positions < 1024 ? cfg.n_positions : 1024;
    if (T > cfg.n_positions) T = cfg.n_positions;
    omp_set_num_threads(o.threads > 0 ? o.threads : td_train_default_threads(NULL, NULL, 0));
    if ((st = td_decoder_create(&cfg, params, T, &d))) goto done;
    int made = 0;
    double t0 = td_now_ms();
    if ((st = generate(&o, tk, d, T, cfg.padded_vocab_size, &made))) goto done;
    double s = (td_now_ms() - t0) / 1e3;
    fprintf(stderr, "tidal generate: %d tokens in %.2f s (%.1f tokens/s)\n", made, s, s > 0 ? made / s : 0);
    rc = 0;
done:
    if (st) fprintf(stderr, "tidal generate: %s\n", td_error_msg());
    td_decoder_destroy(d);
    td_free(params);
    td_tokenizer_destroy(tk);
out:
    td_args_free();
    return rc;
}
