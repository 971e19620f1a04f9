/* `tidal train`: trains a GPT on a token file under a device budget. */
#include "args.h"
#include "cli.h"
#include <cjson/cJSON.h>
#include "tidal/checkpoint.h"
#include "tidal/data.h"
#include "tidal/diskio.h"
#include "tidal/parallel.h"
#include "tidal/trainer.h"
#include "tidal/util.h"

#include <errno.h>
#include <signal.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Every option of train/plan/eval that describes the model and the run. */
typedef struct train_opts {
    const char *model, *data, *policy, *precision, *ckpt, *schedule, *backend, *eviction;
    const char *log, *trace_out, *timeline, *save, *resume, *init, *optim_state, *adam_thread;
    long save_every, stop_after, max_bad_steps;
    double heldout;
    int layers, width, heads, kv_heads, mlp_width, seq, vocab, micro_batch, grad_accum, warmup, prefetch, grad_slots, threads, log_every, decay_all;
    long steps;
    uint64_t seed, chunk_numel;
    size_t gpu_budget, host_pin_limit, host_ram, shard_size;
    double param_frac, optim_frac, lr, min_lr, weight_decay, clip;
    td_opt_list offload_dirs;
} train_opts;

static const char usage[] =
    "usage: tidal train --data FILE [--model PRESET | --layers L --width C --heads H] [options]\n\n"
    "Trains a GPT-2, LLaMA or Qwen2 model on a token file (see `tidal prepare`) with its parameters, gradients and\n"
    "optimizer state in chunks that move between pinned host memory and the device under\n"
    "--gpu-budget.  The first step is a warm-up that records the access order; from the second on,\n"
    "chunks are evicted by Belady's rule and loaded ahead of use.  Prints a progress line per step.";

#define OPTS(o)                                                                                             \
    {"model", TD_OPT_STRING, &(o)->model, "PRESET", "GPT-2: tiny (default), gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b, gpt-2.7b, gpt-4b,\n"      \
     "gpt-6.7b, gpt-13b; LLaMA: tiny-llama, llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, smollm2-135m,\n"          \
     "smollm2-360m, smollm2-1.7b; Qwen2: qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b (docs/model.md);\n"             \
     "or a Hugging Face config.json (or a folder holding one): its architecture, fresh weights", 0},          \
    {"layers", TD_OPT_INT, &(o)->layers, "L", "layers (overrides the preset)", 0},                            \
    {"width", TD_OPT_INT, &(o)->width, "C", "embedding width", 0},                                           \
    {"heads", TD_OPT_INT, &(o)->heads, "H", "attention heads (must divide the width)", 0},                   \
    {"kv-heads", TD_OPT_INT, &(o)->kv_heads, "N", "LLaMA/Qwen2: key/value heads (must divide the heads)", 0},      \
    {"mlp-width", TD_OPT_INT, &(o)->mlp_width, "H", "LLaMA/Qwen2: the MLP's width (intermediate_size)", 0},      \
    {"seq", TD_OPT_INT, &(o)->seq, "T", "sequence length (default 64, at most the model's positions)", 0},   \
    {"vocab", TD_OPT_INT, &(o)->vocab, "V", "vocabulary (default: the token file's)", 0},                    \
    {"data", TD_OPT_STRING, &(o)->data, "FILE", "token file written by `tidal prepare`", 0},                 \
    {"steps", TD_OPT_LONG, &(o)->steps, "N", "optimizer steps (default 100)", 0},                            \
    {"seed", TD_OPT_U64, &(o)->seed, "S", "seed of init and data order (default 1337)", 0},                  \
    {"micro-batch", TD_OPT_INT, &(o)->micro_batch, "B", "sequences per micro-batch (default 4)", 0},         \
    {"grad-accum", TD_OPT_INT, &(o)->grad_accum, "K", "micro-batches per optimizer step (default 1)", 0},    \
    {"gpu-budget", TD_OPT_BUDGET, &(o)->gpu_budget, "SIZE", "device bytes tidal may use, e.g. 512MiB, 24GiB; default: what the run needs\nwith all of it resident plus an eighth, at most the free memory less a margin;\nmax: all of that free memory", 0}, \
    {"host-pin-limit", TD_OPT_SIZE, &(o)->host_pin_limit, "SIZE", "most host memory to pin (default 80% of the host RAM); `tidal plan`'s\nhost.pinned_bytes is what the run pins, to the byte", 0}, \
    {"host-ram", TD_OPT_SIZE, &(o)->host_ram, "SIZE", "host memory the run may use (default: MemTotal, or the cgroup's memory\nlimit when one is set: memory.max or memory.limit_in_bytes); with --offload-dir, the\noptimizer state beyond it goes to disk", 0}, \
    {"offload-dir", TD_OPT_LIST, &(o)->offload_dirs, "DIR", "a directory on a local disk (NVMe) for the optimizer state the host's RAM\ncannot hold: read and written with O_DIRECT beside the CPU AdamW; repeat it\nto stripe over several drives (docs/training.md, \"The disk tier\")", 0}, \
    {"optim-state", TD_OPT_STRING, &(o)->optim_state, "S", "how AdamW stores m and v: fp32 (default, exact), bf16 or int8 (block-wise\nquantized, 8-bit Optimizers); the fp32 master stays fp32", 0}, \
    {"policy", TD_OPT_STRING, &(o)->policy, "P", "placement: cuda, cpu, static or auto (default auto)", 0},   \
    {"offload-param-frac", TD_OPT_DOUBLE, &(o)->param_frac, "F", "static: share of param/grad chunks on the host", 0}, \
    {"offload-optim-frac", TD_OPT_DOUBLE, &(o)->optim_frac, "F", "static: share of optimizer-state chunks on the host (the rest are\nupdated on the GPU); auto: at least this share on the host", 0}, \
    {"chunk-numel", TD_OPT_U64, &(o)->chunk_numel, "N", "elements a chunk holds (default: searched around one block's params)", 0}, \
    {"eviction", TD_OPT_STRING, &(o)->eviction, "E", "belady (default) or lru", 0},                          \
    {"prefetch", TD_OPT_INT, &(o)->prefetch, "N", "look-ahead in accesses; -1 auto (default), 0 off", 0},     \
    {"grad-slots", TD_OPT_INT, &(o)->grad_slots, "N", "pinned staging slots for the grads the CPU AdamW consumes as they land (no\nclipping, no accumulation); -1 auto (default), 0: a host copy per grad chunk", 0}, \
    {"precision", TD_OPT_STRING, &(o)->precision, "P", "fp32 (cpu backend), bf16 or fp16 (cuda)", 0},         \
    {"ckpt", TD_OPT_STRING, &(o)->ckpt, "M", "activation checkpointing: on, off, auto (default) or N: recompute the first N blocks", 0},      \
    {"lr", TD_OPT_DOUBLE, &(o)->lr, "X", "peak learning rate (default 1e-3)", 0},                             \
    {"min-lr", TD_OPT_DOUBLE, &(o)->min_lr, "X", "floor of the decay (default lr/10)", 0},                  \
    {"schedule", TD_OPT_STRING, &(o)->schedule, "S", "constant, cosine (default), linear, noam or exponential", 0}, \
    {"warmup", TD_OPT_INT, &(o)->warmup, "N", "linear warmup steps (default 10% of --steps)", 0},             \
    {"weight-decay", TD_OPT_DOUBLE, &(o)->weight_decay, "X", "AdamW decoupled weight decay on the matrices (2-D weights and embeddings),\nnot on norm gains and biases (default 0.1)", 0}, \
    {"decay-all", TD_OPT_FLAG, &(o)->decay_all, NULL, "apply --weight-decay to every tensor, norm gains and biases too", 0}, \
    {"clip-grad-norm", TD_OPT_DOUBLE, &(o)->clip, "X", "global grad-norm clipping, 0 off (default 1.0)", 0}, \
    {"backend", TD_OPT_STRING, &(o)->backend, "B", "auto (default), cpu or cuda", 0},                        \
    {"threads", TD_OPT_INT, &(o)->threads, "N", "CPU threads (default: all local cores; a rank's share of them when ranks share a host)", 0},                 \
    {"adam-thread", TD_OPT_STRING, &(o)->adam_thread, "M", "the CPU AdamW on a thread of its own, beside the GPU's backward and the\nnext forward: on, off or auto (default: on with the cuda backend);\nthe same results either way", 0}, \
    {"log", TD_OPT_STRING, &(o)->log, "FILE", "JSON lines, one per step", 0},                                 \
    {"log-every", TD_OPT_INT, &(o)->log_every, "N", "progress line every N steps when not on a terminal (default 10)", 0}, \
    {"trace-out", TD_OPT_STRING, &(o)->trace_out, "FILE", "write the warm-up's chunk access trace (tidal-trace 1; ranks: as\n--trace-timeline)", 0}, \
    {"trace-timeline", TD_OPT_STRING, &(o)->timeline, "FILE", "Chrome/Perfetto timeline of copies, compute and the CPU AdamW\n(slower); several ranks write FILE's name with .rankR before its extension", 0}, \
    {"save", TD_OPT_STRING, &(o)->save, "DIR", "write a checkpoint there at the end (Hugging Face weights + train state)", 0}, \
    {"save-shard-size", TD_OPT_SIZE, &(o)->shard_size, "SIZE", "weights above SIZE are saved as Hugging Face shards with\nmodel.safetensors.index.json (default 5GB, as save_pretrained)", 0}, \
    {"save-every", TD_OPT_LONG, &(o)->save_every, "N", "also every N steps (atomic: the previous one stays until the new one is complete)", 0}, \
    {"resume", TD_OPT_STRING, &(o)->resume, "DIR", "continue a run from its checkpoint, bit-exactly (--steps counts from the start);\nthe shape flags of the first run may stay when they agree with it", 0}, \
    {"heldout", TD_OPT_DOUBLE, &(o)->heldout, "PCT", "keep the last PCT% of the sequences out of training (for `tidal eval --split heldout`)", 0}, \
    {"stop-after", TD_OPT_LONG, &(o)->stop_after, "N", "stop after N steps of this invocation (saving with --save); --resume continues", 0}, \
    {"init", TD_OPT_STRING, &(o)->init, "DIR", "start from the weights of a checkpoint or a Hugging Face GPT-2, LLaMA or Qwen2\ndirectory (its config.json decides the model)", 0}, \
    {"max-bad-steps", TD_OPT_LONG, &(o)->max_bad_steps, "N", "stop (exit 1, nothing saved) after N steps in a row whose loss or grads are\nnot finite; each is skipped (default 10)", 0}

static void opts_defaults(train_opts *o)
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

/* With --resume or --init, the shape flags of the original command may stay
 * on the command line: each must agree with the checkpoint (a preset's
 * layers, width and heads; --vocab the checkpoint's vocabulary). */
static td_status shape_agrees(const train_opts *o, td_opt *table, const td_model_desc *preset,
                              const td_model_desc *ck, const char *how, const char *from)
{
    struct { const char *flag; int seen, asked, have; } f[] = {
        {"model", td_args_find(table, "model")->seen, 0, 0},
        {"layers", td_args_find(table, "layers")->seen, o->layers, ck->n_layer},
        {"width", td_args_find(table, "width")->seen, o->width, ck->n_embd},
        {"heads", td_args_find(table, "heads")->seen, o->heads, ck->n_head},
        {"vocab", td_args_find(table, "vocab")->seen, o->vocab, ck->vocab_size},
        {"kv-heads", td_args_find(table, "kv-heads")->seen, o->kv_heads, td_model_kv_heads(ck)},
        {"mlp-width", td_args_find(table, "mlp-width")->seen, o->mlp_width, td_model_mlp_width(ck)},
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
    td_status st = td_ckpt_config_read(file, out);
    if (st) return td_error_prefix(st, "--model: ");
    out->padded_vocab_size = out->padded_vocab_size > out->vocab_size ? out->padded_vocab_size
                                                                     : td_model_pad_vocab(out->vocab_size);
    return TD_OK;
}

/* The run's configuration from the options (vocab: the data's unless given). */
static td_status build_config(const train_opts *o, td_opt *table, int data_vocab, td_train_config *c)
{
    td_status st;
    *c = td_train_default_config();
    if ((st = model_of(o->model, &c->model))) return st;
    const char *from = o->resume ? o->resume : o->init;
    if (from) { /* the checkpoint decides the model's shape; the flags of the first run may stay */
        td_model_desc asked = c->model;
        if ((st = td_trainer_checkpoint_model(from, &c->model))) return st;
        if ((st = shape_agrees(o, table, &asked, &c->model, o->resume ? "resume" : "init", from))) return st;
        if (data_vocab > c->model.vocab_size)
            return td_error_set(TD_ERR_INVALID, "the token file's vocabulary (%d) is larger than the checkpoint's (%d)",
                                data_vocab, c->model.vocab_size);
        data_vocab = c->model.vocab_size;
    }
    if (!from && td_args_find(table, "layers")->seen) c->model.n_layer = o->layers;
    if (!from && td_args_find(table, "width")->seen) c->model.n_embd = o->width;
    if (!from && td_args_find(table, "heads")->seen) c->model.n_head = o->heads;
    int llama_flag = td_args_find(table, "kv-heads")->seen || td_args_find(table, "mlp-width")->seen;
    if (!from && llama_flag && c->model.family == TD_MODEL_GPT2)
        return td_error_set(TD_ERR_INVALID, "--kv-heads and --mlp-width shape LLaMA-family models; pick one with "
                            "--model (e.g. tiny-llama)");
    if (!from && td_args_find(table, "kv-heads")->seen) c->model.n_kv_head = o->kv_heads;
    if (!from && td_args_find(table, "mlp-width")->seen) c->model.n_inner = o->mlp_width;
    int vocab = !from && td_args_find(table, "vocab")->seen ? o->vocab : data_vocab > 0 ? data_vocab : c->model.vocab_size;
    if (vocab < 1) return td_error_set(TD_ERR_INVALID, "--vocab must be positive");
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
    if (td_args_find(table, "host-ram")->seen && o->host_ram < TD_MiB)
        return td_error_set(TD_ERR_INVALID, "--host-ram %zu bytes is too small to run anything; give the host's "
                            "memory, e.g. --host-ram 125GiB", o->host_ram);
    c->host_ram = o->host_ram;
    c->mm.disk_dirs = o->offload_dirs.v;
    c->mm.n_disk_dirs = o->offload_dirs.n;
    if ((st = td_optim_state_parse(o->optim_state, &c->optim.state))) return td_error_prefix(st, "--optim-state: ");
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
    if ((st = td_evict_policy_parse(o->eviction, &c->mm.eviction))) return td_error_prefix(st, "--eviction: ");
    if (o->param_frac < 0 || o->param_frac > 1 || o->optim_frac < 0 || o->optim_frac > 1)
        return td_error_set(TD_ERR_INVALID, "--offload-param-frac and --offload-optim-frac lie in [0, 1]");
    if (td_args_find(table, "offload-param-frac")->seen && c->mm.placement != TD_PLACEMENT_STATIC)
        return td_error_set(TD_ERR_INVALID, "--offload-param-frac applies to --policy static only");
    if (td_args_find(table, "offload-optim-frac")->seen && c->mm.placement != TD_PLACEMENT_STATIC &&
        c->mm.placement != TD_PLACEMENT_AUTO)
        return td_error_set(TD_ERR_INVALID, "--offload-optim-frac applies to --policy static and auto only");
    c->mm.chunk_numel = (size_t)o->chunk_numel;
    c->mm.offload_param_frac = o->param_frac;
    c->mm.offload_optim_frac = o->optim_frac;
    c->mm.prefetch = o->prefetch;
    c->mm.grad_slots = o->grad_slots;
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
    if (o->grad_slots < -1) return td_error_set(TD_ERR_INVALID, "--grad-slots %d: use -1 (auto), 0 or a count", o->grad_slots);
    if (o->grad_slots > 0 && (o->clip > 0 || o->grad_accum > 1))
        return td_error_set(TD_ERR_INVALID, "--grad-slots %d: staging slots need grads that are read once as they "
                            "land: --clip-grad-norm 0 and --grad-accum 1 (the global norm and accumulation need a "
                            "host copy of every grad)", o->grad_slots);
    return td_train_config_check(c);
}

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
    /* The tokenizer the data was made with, when `tidal prepare` kept it. */
    char paths[3][4096];
    const char *files[4] = {NULL};
    static const char *const names[] = TD_CKPT_TOKENIZER_FILES;
    int n = 0;
    for (size_t i = 0; i < 3 && info->tokenizer != TD_TOKENIZER_BYTE; i++)
        if (!td_tokfile_tokenizer_path(data, names[i], paths[n], sizeof paths[n]) && access(paths[n], R_OK) == 0)
            files[n] = paths[n], n++;
    return td_trainer_save_files(t, dir, 1, meta, files);
}

static td_status loader_batch(void *ctx, int32_t *tokens, int32_t *targets)
{
    return td_loader_next(ctx, tokens, targets);
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
    fprintf(f, "%sstep %ld/%ld  loss %.4f  lr %.2e  %.0f tok/s  device %s/%s  pinned %s  h2d %s  d2h %s  stall %.0f ms%s",
            tty ? "\r\033[K" : "", step, steps, r->loss, r->lr, r->tokens_per_s,
            td_format_bytes(r->mm.device_peak_bytes, used, sizeof used),
            td_format_bytes(as.budget_bytes, budget, sizeof budget), td_format_bytes(hs.pinned_bytes, pinned, sizeof pinned),
            td_format_bytes(r->mm.bytes_h2d, h2d, sizeof h2d), td_format_bytes(r->mm.bytes_d2h, d2h, sizeof d2h),
            r->mm.stall_ms, r->skipped ? "  (overflow: step skipped)" : "");
    fprintf(f, tty ? "" : "\n");
    fflush(f);
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

/* One option's value as text (a --config file's form), for agreement across ranks. */
static void opt_value(const td_opt *t, char *v, size_t n)
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
                                        "offload-dir",
                                        "host-pin-limit", "config", "nproc", "comm-timeout", "data", NULL};
    a->n = 0;
    for (const td_opt *t = table; t->name; t++) {
        int skip = 0;
        for (int i = 0; local[i]; i++) skip |= !strcmp(t->name, local[i]);
        if (skip) continue;
        char key[40], v[200];
        snprintf(key, sizeof key, "--%s", t->name);
        opt_value(t, v, sizeof v);
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

int td_cli_train_main(int argc, char **argv)
{
    train_opts o;
    opts_defaults(&o);
    int nproc = 1;
    double comm_timeout_s = td_comm_default_params().timeout_ms / 1000.0;
    td_opt table[] = { OPTS(&o),
                       {"nproc", TD_OPT_INT, &nproc, "N", "start N local ranks (one per GPU, as torchrun --nproc-per-node) that train\n"
                        "data-parallel with ZeRO-3: each holds 1/N of the optimizer state (docs/distributed.md);\n"
                        "--micro-batch is per rank (global batch = N x micro-batch x grad-accum)", 0},
                       {"comm-timeout", TD_OPT_DOUBLE, &comm_timeout_s, "S", "several ranks: seconds a rank waits for the others "
                        "before it exits non-zero naming\nthe rank that stopped (default 60, or TD_COMM_TIMEOUT_MS)", 0},
                       {NULL, 0, NULL, NULL, NULL, 0} };
    int rc = td_args_main(table, argc, argv, "train", usage);
    if (rc >= 0) return rc;
    rc = 1;
    td_loader *loader = NULL;
    td_trainer *t = NULL;
    FILE *log = NULL;
    td_status st = TD_OK;
    td_dist_env env;
    int nproc_seen = td_args_find(table, "nproc")->seen;
    if (nproc_seen && getenv("WORLD_SIZE")) {
        fprintf(stderr, "tidal train: --nproc starts its own ranks, but this process already is rank %s of a job of %s "
                "(torchrun, or --nproc in a --config); drop --nproc\n", getenv("RANK") ? getenv("RANK") : "?",
                getenv("WORLD_SIZE"));
        td_args_free();
        return 2;
    }
    if (nproc_seen && nproc != 1) {
        const char *prefix[] = {"train", NULL};
        rc = td_cli_launch_self("train", nproc, prefix, argc, argv);
        td_args_free();
        return rc;
    }
    if (!(comm_timeout_s > 0 && comm_timeout_s <= 86400)) {
        fprintf(stderr, "tidal train: --comm-timeout %g: give seconds in (0, 86400]\n", comm_timeout_s);
        td_args_free();
        return 2;
    }
    if ((st = td_dist_env_read(&env))) {
        fprintf(stderr, "tidal train: %s\n", td_error_msg());
        td_args_free();
        return 2;
    }
    int lead = env.rank == 0; /* rank 0 alone prints progress and writes --log */
    static char trace_path[4096], timeline_path[4096]; /* several ranks: a file each */
    if (o.trace_out) o.trace_out = rank_path(o.trace_out, &env, trace_path, sizeof trace_path);
    if (o.timeline) o.timeline = rank_path(o.timeline, &env, timeline_path, sizeof timeline_path);
    if (!o.data) {
        fprintf(stderr, "tidal train: --data FILE is required (make one with `tidal prepare`)\n");
        td_args_free();
        return 2;
    }
    td_loader_params lp = td_loader_default_params();
    lp.batch = (uint32_t)(o.micro_batch > 0 ? o.micro_batch : 1);
    lp.seq = (uint32_t)(o.seq > 0 ? o.seq : 1);
    lp.seed = o.seed;
    lp.heldout_percent = o.heldout;
    lp.rank = (uint32_t)env.rank; /* this rank's slice of every global batch */
    lp.ranks = (uint32_t)env.size;
    if ((st = td_loader_open(o.data, &lp, &loader))) goto cleanup;
    int data_vocab = (int)td_tokfile_get_info(td_loader_file(loader))->vocab_size;
    td_train_config cfg;
    if ((st = build_config(&o, table, data_vocab, &cfg))) {
        fprintf(stderr, "tidal train: %s\n", td_error_msg());
        rc = 2;
        goto out;
    }
    if (o.log && lead && !(log = fopen(o.log, "w"))) {
        fprintf(stderr, "tidal train: cannot write --log %s\n", o.log);
        goto out;
    }
    /* Where --save writes, checked (and its folders made) before the run
     * spends its time: rank 0 alone writes the checkpoint directory. */
    if (o.save && lead && (st = td_ckpt_check_target(o.save))) {
        fprintf(stderr, "tidal train: --save %s: %s\n", o.save, td_error_msg());
        rc = 2;
        goto out;
    }
    static agree_list agree;
    if (env.size > 1) {
        cfg.ranks = env.size;
        cfg.rank = env.rank;
        cfg.local_ranks = env.local_size;
        cfg.dist = &env;
        cfg.comm_timeout_ms = (int)(comm_timeout_s * 1000.0 + 0.5);
        if (cfg.comm_timeout_ms < 1) cfg.comm_timeout_ms = 1;
        agree_build(&agree, table, &cfg, loader);
        cfg.agree = agree.s;
        cfg.n_agree = agree.n;
    }
    /* From here a first SIGINT / SIGTERM stops the run at a step's end, a
     * second at once (on_stop_signal). */
    stop_signal = 0;
    struct sigaction sa = {0};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    if ((st = td_trainer_create(&cfg, &t))) goto cleanup;
    if (o.resume) {
        td_ckpt_reader *rd = NULL;
        if ((st = td_trainer_load(t, o.resume, 1, &rd))) goto cleanup;
        td_loader_position pos = {0};
        st = td_ckpt_reader_meta_u64(rd, "data_epoch", &pos.epoch);
        if (!st) st = td_ckpt_reader_meta_u64(rd, "data_index", &pos.index);
        if (!st) st = td_ckpt_reader_meta_u64(rd, "data_fingerprint", &pos.fingerprint);
        td_ckpt_reader_close(rd);
        if (st || (st = td_loader_seek(loader, &pos))) {
            td_error_prefix(st, "--resume %s: the data position: ", o.resume);
            goto cleanup;
        }
        if (lead) fprintf(stderr, "tidal train: resumed %s at step %ld\n", o.resume, td_trainer_optim(t)->step);
    } else if (o.init) {
        if ((st = td_trainer_load(t, o.init, 0, NULL))) goto cleanup;
        if (lead) fprintf(stderr, "tidal train: weights from %s\n", o.init);
    }
    if (o.timeline && (st = td_memmgr_timeline_open(td_trainer_memmgr(t), o.timeline))) goto cleanup;
    size_t params = td_model_params_numel(&cfg.model);
    char budget[32];
    td_arena_stats as;
    td_arena_get_stats(td_trainer_arena(t), &as);
    char ckpt[48];
    int nck = td_trainer_checkpointing(t);
    if (nck == 0 || nck == cfg.model.n_layer) snprintf(ckpt, sizeof ckpt, "%s", nck ? "on" : "off");
    else snprintf(ckpt, sizeof ckpt, "%d of %d blocks", nck, cfg.model.n_layer);
    char origin[128] = "", cap[32];
    const td_train_budget *tb = td_trainer_budget(t);
    if (tb->origin != TD_BUDGET_GIVEN)
        snprintf(origin, sizeof origin, tb->origin == TD_BUDGET_CAP ? " (max: the %s free less a margin)"
                                                       : " (default: the run resident + 1/8; --gpu-budget max takes "
                                                         "the %s free less a margin)",
                 td_format_bytes(tb->cap_bytes, cap, sizeof cap));
    int optim_total = 0, optim_gpu = td_trainer_optim_gpu_chunks(t, &optim_total);
    if (lead && env.size > 1)
        fprintf(stderr, "tidal train: %d ranks (%s), ZeRO-3: each rank holds 1/%d of every chunk's optimizer state; "
                "global batch %d x %d x %d sequences; per rank:\n", env.size, env.launcher, env.size, env.size,
                cfg.micro_batch, cfg.grad_accum);
    int own_thread = 0, grad_slots = 0, adam_threads = td_trainer_adam_threads(t, &own_thread, &grad_slots);
    char rest[160] = "";
    if (optim_gpu < optim_total)
        snprintf(rest, sizeof rest, ", the rest by %d CPU thread%s%s%s", adam_threads, adam_threads == 1 ? "" : "s",
                 own_thread ? " driven from a thread of its own (--adam-thread)" : "",
                 grad_slots ? ", grads transient" : "");
    if (lead) fprintf(stderr, "tidal train: %zu params (%s %d layers, %d wide, %d heads, vocab %d), %s, budget %s%s, policy %s, "
                    "checkpointing %s, %d chunks, AdamW on the GPU for %d of %d param chunks%s\n",
            params, td_model_family_name(cfg.model.family), cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head,
            cfg.model.vocab_size,
            td_backend_describe(td_trainer_backend(t)), td_format_bytes(as.budget_bytes, budget, sizeof budget),
            origin, o.policy, ckpt, td_memmgr_chunk_count(td_trainer_memmgr(t)), optim_gpu, optim_total, rest);
    /* The host: what the plan said, and the figure of RAM it was held to. */
    td_train_plan hplan;
    size_t host_ram = 0, pin_limit = 0;
    char ram_src[160], hx[32], hy[32], hz[32], hv[32], hw[32];
    if ((st = td_train_plan_make(&cfg, as.budget_bytes, &hplan)) ||
        (st = td_train_host_limits(&cfg, &host_ram, &pin_limit, ram_src, sizeof ram_src)))
        goto cleanup;
    if (lead) fprintf(stderr, "tidal train: host plan %s pinned + %s pageable (--optim-state %s) of %s RAM (%s); heap "
                    "measured by %s\n",
            td_format_bytes(hplan.host_pinned_bytes, hx, sizeof hx), td_format_bytes(hplan.host_pageable_bytes, hy, sizeof hy),
            td_optim_state_name(cfg.optim.state), td_format_bytes(host_ram, hz, sizeof hz), ram_src,
            td_host_heap_source());
    if (hplan.disk_chunks) { /* every rank: each has its own directories' files */
        char db[32], sb[32], rw[32];
        fprintf(stderr, "tidal train: disk tier: %d of %d optimizer chunks (%s) on disk, %d bounce sets of %s pinned, %s read "
                "and written a step; %s\n", hplan.disk_chunks, hplan.optim_chunks,
                td_format_bytes(hplan.disk_bytes, db, sizeof db), hplan.disk_sets,
                td_format_bytes(hplan.disk_set_bytes, sb, sizeof sb),
                td_format_bytes((size_t)hplan.disk_read_bytes_per_step, rw, sizeof rw),
                td_memmgr_disk_describe(td_trainer_memmgr(t)));
    } else if (cfg.mm.n_disk_dirs && lead) {
        fprintf(stderr, "tidal train: --offload-dir: nothing goes to disk (the host's RAM holds the whole state)\n");
    }
    if (lead && optim_gpu < optim_total) { /* the CPU AdamW's cores: machines of one kind differ here */
        int driver = -1;
        const char *where = td_trainer_host_cores(t, &driver);
        char drv[128];
        if (!own_thread)
            snprintf(drv, sizeof drv, "thread i > 0 on core i; thread 0 is the one that drives the GPU, between its launches");
        else if (driver >= 0)
            snprintf(drv, sizeof drv, "thread i on core i (0: the AdamW thread); the GPU driven from core %d", driver);
        else
            snprintf(drv, sizeof drv, "thread i on core i (0: the AdamW thread); no core left to drive the GPU from");
        fprintf(stderr, "tidal train: CPU AdamW: %d thread%s on %s, %s\n", adam_threads, adam_threads == 1 ? "" : "s",
                where, drv);
    }
    td_setup_times su;
    td_trainer_setup_times(t, &su);
    if (lead) fprintf(stderr, "tidal train: set up in %.1f s (backend and plan %.1f s, pinning host slabs %.1f s, "
                    "first touch of pageable state %.1f s, initial weights %.1f s, the rest %.1f s)\n",
            su.total_ms / 1e3, su.backend_ms / 1e3, su.pin_ms / 1e3, su.touch_ms / 1e3, su.init_ms / 1e3,
            su.rest_ms / 1e3);
    int tty = isatty(fileno(stderr));
    long first = td_trainer_optim(t)->step + 1;
    if (first > o.steps && lead) fprintf(stderr, "tidal train: already at step %ld of --steps %ld\n", first - 1, o.steps);
    long last = o.stop_after > 0 && first - 1 + o.stop_after < o.steps ? first - 1 + o.stop_after : o.steps;
    if (o.max_bad_steps < 1) {
        st = td_error_set(TD_ERR_INVALID, "--max-bad-steps must be at least 1");
        goto cleanup;
    }
    long bad = 0;
    {   /* a signal while the run was set up: stop before the first step */
        int stopping = 0;
        if ((st = any_rank_stopping(t, stop_signal, &stopping))) goto cleanup;
        if (stopping) {
            if (lead) fprintf(stderr, "tidal train: %s: stopped before the first step\n",
                              stopping == SIGINT ? "SIGINT" : "SIGTERM");
            rc = 128 + stopping;
            goto out;
        }
    }
    int scaled = cfg.optim.scaler.kind != TD_LOSS_SCALE_NONE;
    for (long s = first; s <= last; s++) {
        td_step_result r;
        if (fault_step(s)) td_fault_arm(TD_FAULT_NONFINITE_GRAD, 1);
        st = td_trainer_step(t, loader_batch, loader, &r);
        td_fault_arm(TD_FAULT_NONFINITE_GRAD, 0);
        if (st) goto cleanup;
        /* A loss scaler skips overflowing steps as a matter of course; without
         * one, a skipped step had non-finite grads. */
        if (!isfinite(r.loss) || (r.skipped && !scaled)) {
            bad++;
            if (lead) fprintf(stderr, "%stidal train: step %ld: loss %g, grad norm %g: not finite; %s (%ld in a row, "
                            "--max-bad-steps %ld)\n", tty ? "\n" : "", s, r.loss, r.grad_norm,
                    r.skipped ? "skipped" : "the update ran", bad, o.max_bad_steps);
            if (bad >= o.max_bad_steps) {
                st = td_error_set(TD_ERR_STATE, "%ld steps in a row with a non-finite loss or grads (the last %ld); "
                                  "stopped without saving%s%s; lower --lr or --clip-grad-norm",
                                  bad, s, o.save ? ", the last good checkpoint stays in " : "", o.save ? o.save : "");
                goto cleanup;
            }
        } else {
            bad = 0;
        }
        if (lead && (tty || s == first || s == last || s % (o.log_every > 0 ? o.log_every : 10) == 0))
            progress(stderr, tty, s, o.steps, &r, t);
        td_host_usage hu;
        if ((st = td_trainer_host_usage(t, &hu))) goto cleanup;
        if (log) {
            char mm[1024], host[512];
            td_memmgr_step_json(td_trainer_memmgr(t), mm, sizeof mm);
            td_host_usage_json(&hu, host, sizeof host);
            fprintf(log, "{\"step\":%ld,\"loss\":%.6f,\"lr\":%.6g,\"grad_norm\":%.6g,\"skipped\":%d,"
                         "\"tokens_per_s\":%.1f,\"step_ms\":%.3f,\"device_peak_bytes\":%zu,\"h2d_bytes\":%llu,"
                         "\"d2h_bytes\":%llu,\"stall_ms\":%.3f,\"adam_cpu_ms\":%.3f,\"adam_wait_ms\":%.3f,"
                         "\"memmgr\":%s,\"host\":%s}\n",
                    s, r.loss, r.lr, r.grad_norm, r.skipped, r.tokens_per_s, r.step_ms, r.mm.device_peak_bytes,
                    (unsigned long long)r.mm.bytes_h2d, (unsigned long long)r.mm.bytes_d2h, r.mm.stall_ms,
                    r.adam_cpu_ms, r.adam_wait_ms, mm, host);
            fflush(log);
        }
        int stopping = 0;
        if ((st = any_rank_stopping(t, stop_signal, &stopping))) goto cleanup;
        if (stopping && !stop_signal) stop_signal = stopping; /* another rank's: stop alike */
        if (o.save && !bad && ((o.save_every > 0 && s % o.save_every == 0) || s == last || stopping)) {
            if ((st = save_checkpoint(t, loader, o.save, o.data))) goto cleanup;
            if (lead && (!tty || s == last || stopping))
                fprintf(stderr, "%ssaved %s at step %ld\n", tty ? "\n" : "", o.save, s);
        }
        if (stopping) {
            if (lead) fprintf(stderr, "%stidal train: %s: stopped after step %ld%s\n", tty ? "\n" : "",
                    stop_signal == SIGINT ? "SIGINT" : "SIGTERM", s, o.save ? " (--resume continues)" : "");
            rc = 128 + stop_signal;
            goto out;
        }
    }
    if (tty && lead) fprintf(stderr, "\n");
    /* The last step's updates, which the next forward would have waited
     * for, done: the run ends with all of its steps applied, and they are
     * in the --trace-timeline and the host footprint below.  (A save has
     * already done this.) */
    if ((st = td_trainer_finish_update(t))) goto cleanup;
    {
        td_host_usage hu;
        if ((st = td_trainer_host_usage(t, &hu))) goto cleanup;
        char hr[32], region[64] = "";
        if (hu.device_region_bytes)
            snprintf(region, sizeof region, ", device region %s",
                     td_format_bytes(hu.device_region_bytes, hr, sizeof hr));
        if (lead) fprintf(stderr, "host: planned %s, peak %s (%s pinned, %s pageable state, heap %s by %s%s)\n",
                td_format_bytes(hplan.host_bytes, hx, sizeof hx), td_format_bytes(hu.peak_bytes, hy, sizeof hy),
                td_format_bytes(hu.pinned_bytes, hz, sizeof hz), td_format_bytes(hu.pageable_bytes, hv, sizeof hv),
                td_format_bytes(hu.heap_allocated_bytes, hw, sizeof hw), hu.heap_source, region);
    }
    rc = 0;
cleanup:
    if (st && env.size > 1) fprintf(stderr, "\ntidal train: rank %d: %s\n", env.rank, td_error_msg());
    else if (st) fprintf(stderr, "\ntidal train: %s\n", td_error_msg());
out:
    if (log) fclose(log);
    td_trainer_destroy(t); /* its scratch files closed, their locks removed, before the handlers go */
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    td_loader_destroy(loader);
    td_args_free();
    return rc;
}

/* ---- tidal plan --------------------------------------------------------------- */

static const char plan_usage[] =
    "usage: tidal plan [--model PRESET | --layers L --width C --heads H] [--gpu-budget SIZE] [options]\n\n"
    "Prints a run's footprint before it starts: bytes per role on the device and the host, the\n"
    "chunk layout (--layout), whether it fits the budget and the host's RAM, and the step time\n"
    "estimated from bandwidths and compute rates measured here in a second or two.  Nothing of\n"
    "the model is allocated.  Takes the same options as `tidal train` (--data only for its vocabulary).";

/* --largest: for each state type, the most layers at the given width and
 * heads (td_train_largest_layers), and the largest preset that fits. */
static td_status print_largest(const td_train_config *base, const td_train_limits *lim, const char *ram_src, int json)
{
    char a[32], b2[32], c[32], d[32];
    size_t disk_room = 0;
    if (td_train_disk_tier(base)) { /* the disk the plans count: --disk-bytes, or the directories' free space */
        td_train_plan dp;
        td_train_config one = *base;
        one.model.n_layer = 1;
        td_status st = td_train_plan_make(&one, lim->budget_bytes, &dp);
        if (st) return st;
        disk_room = dp.disk_free_bytes;
    }
    if (json) printf("{\"budget_bytes\":%zu,\"ram_bytes\":%zu,\"ram_source\":\"%s\",\"pin_limit_bytes\":%zu,"
                     "\"disk_bytes\":%zu,\"largest\":[", lim->budget_bytes, lim->ram_bytes, ram_src, lim->pin_limit_bytes,
                     disk_room);
    else printf("largest models for --gpu-budget %s, host RAM %s (%s), pin limit %s%s%s%s; %d x %d tokens, %s\n\n",
                td_format_bytes(lim->budget_bytes, a, sizeof a), td_format_bytes(lim->ram_bytes, b2, sizeof b2), ram_src,
                td_format_bytes(lim->pin_limit_bytes, c, sizeof c), disk_room ? ", disk " : "",
                disk_room ? td_format_bytes(disk_room, d, sizeof d) : "",
                disk_room ? " for the optimizer state the RAM cannot hold" : "", base->micro_batch, base->seq_len,
                td_dtype_name(base->precision));
    for (int s = 0; s < TD_OPTIM_STATE_COUNT; s++) {
        td_train_config cfg = *base;
        cfg.optim.state = (td_optim_state)s;
        td_train_plan p;
        int layers = 0;
        td_status st = td_train_largest_layers(&cfg, lim, &layers, &p);
        if (st) return st;
        size_t layers_params = p.params, layers_host = p.host_bytes, layers_pinned = p.host_pinned_bytes;
        size_t layers_disk = p.disk_bytes;
        /* Presets, in the order listed (growing): the largest that fits. */
        const char *best = NULL;
        size_t best_params = 0, best_host = 0;
        char fit_list[512] = "", fit_json[640] = "";
        for (const char *const *n = td_model_preset_names(); *n; n++) {
            td_train_config pc = *base;
            pc.optim.state = (td_optim_state)s;
            if ((st = td_model_preset(*n, &pc.model))) return st;
            /* The presets of the run's family, with its vocabulary (the
             * token file's or --vocab; other families keep their own). */
            if (pc.model.family != base->model.family) continue;
            pc.model.vocab_size = base->model.vocab_size;
            pc.model.padded_vocab_size = base->model.padded_vocab_size;
            if (pc.model.n_positions < pc.seq_len) pc.model.n_positions = pc.seq_len;
            td_train_plan pp;
            int ok = 0;
            if (td_train_config_check(&pc) != TD_OK) { td_error_clear(); continue; }
            if ((st = td_train_plan_fits(&pc, lim, &pp, &ok, NULL))) return st;
            if (ok && pp.params > best_params) { best = *n; best_params = pp.params; best_host = pp.host_bytes; }
            if (ok) {
                size_t l = strlen(fit_list), lj = strlen(fit_json);
                snprintf(fit_list + l, sizeof fit_list - l, "%s%s", l ? ", " : "", *n);
                snprintf(fit_json + lj, sizeof fit_json - lj, "%s\"%s\"", lj ? "," : "", *n);
            }
        }
        const char *name = td_optim_state_name((td_optim_state)s);
        if (json) {
            printf("%s{\"optim_state\":\"%s\",\"width\":%d,\"heads\":%d,\"layers\":%d,\"params\":%zu,"
                   "\"host_bytes\":%zu,\"pinned_bytes\":%zu,\"disk_bytes\":%zu,\"preset\":%s%s%s,\"preset_params\":%zu,"
                   "\"preset_host_bytes\":%zu,\"presets_that_fit\":[%s]}", s ? "," : "", name, base->model.n_embd,
                   base->model.n_head, layers, layers_params, layers_host, layers_pinned, layers_disk, best ? "\"" : "",
                   best ? best : "null", best ? "\"" : "", best_params, best_host, fit_json);
        } else {
            if (layers > 0)
                printf("--optim-state %-5s  %4d layers x %d wide, %d heads: %.2fB params, host %s (%s pinned)%s%s\n", name,
                       layers, base->model.n_embd, base->model.n_head, (double)layers_params / 1e9,
                       td_format_bytes(layers_host, a, sizeof a), td_format_bytes(layers_pinned, b2, sizeof b2),
                       layers_disk ? ", disk " : "", layers_disk ? td_format_bytes(layers_disk, c, sizeof c) : "");
            else
                printf("--optim-state %-5s  no layer count fits at %d wide, %d heads\n", name, base->model.n_embd,
                       base->model.n_head);
            if (best)
                printf("                     largest preset %s: %.2fB params, host %s (fit: %s)\n", best,
                       (double)best_params / 1e9, td_format_bytes(best_host, d, sizeof d), fit_list);
            else
                printf("                     no preset fits\n");
        }
    }
    if (json) printf("]}\n");
    return TD_OK;
}

int td_cli_plan_main(int argc, char **argv)
{
    train_opts o;
    opts_defaults(&o);
    int json = 0, layout = 0, largest = 0, nproc = 1, no_measure = 0;
    size_t disk_bytes = 0;
    td_opt table[] = { OPTS(&o),
                       {"disk-bytes", TD_OPT_SIZE, &disk_bytes, "SIZE", "plan the disk tier for this much disk (a drive you "
                        "do not have here, or less\nthan --offload-dir's free space); without --offload-dir nothing "
                        "is measured", 0},
                       {"json", TD_OPT_FLAG, &json, NULL, "one JSON object instead of the table", 0},
                       {"nproc", TD_OPT_INT, &nproc, "N", "plan one rank of N (ZeRO-3, as `tidal train --nproc N`): its "
                        "share of the optimizer\nstate, the device chunks padded to N shards (under a launcher: the "
                        "job's size)", 0},
                       {"layout", TD_OPT_FLAG, &layout, NULL, "also print the chunk layout", 0},
                       {"no-measure", TD_OPT_FLAG, &no_measure, NULL, "the footprint only: time nothing on this machine "
                        "(no step estimate;\nsaves the second or two the rates take)", 0},
                       {"largest", TD_OPT_FLAG, &largest, NULL, "the largest model that fits the host and the budget, "
                        "for each --optim-state:\nlayers growing at the given width and heads, and each preset", 0},
                       {NULL, 0, NULL, NULL, NULL, 0} };
    int rc = td_args_main(table, argc, argv, "plan", plan_usage);
    if (rc >= 0) return rc;
    rc = 1;
    td_backend *b = NULL;
    td_loader *loader = NULL;
    td_status st = TD_OK;
    int data_vocab = 0;
    if (o.data) {
        td_loader_params lp = td_loader_default_params();
        lp.batch = 1;
        lp.seq = 1;
        if ((st = td_loader_open(o.data, &lp, &loader))) goto cleanup;
        data_vocab = (int)td_tokfile_get_info(td_loader_file(loader))->vocab_size;
    }
    td_train_config cfg;
    if ((st = build_config(&o, table, data_vocab, &cfg))) {
        fprintf(stderr, "tidal plan: %s\n", td_error_msg());
        rc = 2;
        goto out;
    }
    cfg.disk_bytes = disk_bytes;
    {   /* one rank's share: --nproc, or the job this process is a rank of */
        td_dist_env env;
        if (nproc < 1 || nproc > 65536) {
            fprintf(stderr, "tidal plan: --nproc %d: give 1 to 65536 ranks\n", nproc);
            rc = 2;
            goto out;
        }
        if (!td_args_find(table, "nproc")->seen && td_dist_env_read(&env) == TD_OK && env.size > 1) {
            cfg.ranks = env.size;
            cfg.rank = env.rank;
            cfg.local_ranks = env.local_size;
        } else if (nproc > 1) {
            cfg.ranks = nproc;
            cfg.rank = 0; /* the largest shards */
            cfg.local_ranks = nproc;
        }
        td_error_clear();
    }
    td_backend_params bp = td_backend_default_params();
    bp.kind = cfg.backend;
    /* --backend cuda on a machine without a GPU: the footprint still plans
     * (the sizes are the CUDA ops' own), with a budget given and nothing measured. */
    int no_device = 0;
#ifdef TD_HAVE_CUDA
    if (cfg.backend == TD_BACKEND_CUDA && td_backend_create(&bp, &b) != TD_OK) {
        td_error_clear();
        no_device = 1;
    }
#endif
    if (!no_device) {
        if (!b && (st = td_backend_create(&bp, &b))) goto cleanup;
        cfg.backend = td_backend_get_kind(b); /* size activations for the backend that will run */
    }
    td_train_budget tb;
    if ((st = td_train_budget_resolve(&cfg, b, largest ? TD_BUDGET_USE_SEARCH : TD_BUDGET_USE_RUN, &tb)))
        goto cleanup;
    size_t budget = tb.budget_bytes, free_b = tb.free_bytes;
    size_t ram = 0, pin_limit = 0;
    char ram_src[160];
    if ((st = td_train_host_limits(&cfg, &ram, &pin_limit, ram_src, sizeof ram_src))) goto cleanup;
    if (largest) {
        td_train_limits lim = { .budget_bytes = budget, .device_free_bytes = no_device ? SIZE_MAX : free_b,
                                .ram_bytes = ram, .pin_limit_bytes = pin_limit };
        if ((st = print_largest(&cfg, &lim, ram_src, json))) goto cleanup;
        rc = 0;
        goto cleanup;
    }
    td_train_plan p;
    if ((st = td_train_plan_make(&cfg, budget, &p))) goto cleanup;
    td_train_rates r;
    memset(&r, 0, sizeof r);
    if (!no_device && !no_measure && (st = td_train_measure_rates(b, &cfg, &r))) goto cleanup;
    td_train_bound bd;
    td_train_bound_of(&cfg, &p, &r, &bd);
    td_train_bound hide;
    int hide_accum = 0;
    if (p.disk_chunks && bd.disk_ms > 0 &&
        (st = td_train_disk_hiding_accum(&cfg, budget, &r, TD_CLI_DISK_HIDE_WITHIN, &hide_accum, &hide)))
        goto cleanup;
    if (no_device) free_b = SIZE_MAX; /* unknown: the budget is taken as given */
    int fits_device = budget >= p.min_device_bytes && budget <= free_b;
    int fits_host = p.host_pinned_bytes <= pin_limit && p.host_bytes <= ram && p.disk_fits;
    double host_pp = (double)(p.host_pinned_chunk_bytes + p.host_pageable_state_bytes) / (double)p.params;
    double pinned_pp = (double)p.host_pinned_chunk_bytes / (double)p.params;
    size_t pinned_optim = p.host_pinned_optimizer_bytes;
    size_t device_peak = cfg.mm.placement == TD_PLACEMENT_CUDA ? p.full_device_bytes
                         : cfg.mm.placement == TD_PLACEMENT_CPU ? p.min_device_bytes
                         : (p.full_device_bytes < budget ? p.full_device_bytes : budget);
    if (cfg.mm.placement == TD_PLACEMENT_CUDA) fits_device = budget >= p.full_device_bytes && budget <= free_b;
    if (no_device) free_b = 0;
    double compute_ms = bd.compute_ms, pcie_ms = bd.pcie_ms, adam_ms = bd.adam_ms, dram_ms = bd.dram_ms,
           bound_ms = bd.bound_ms;
    double tokens = (double)cfg.micro_batch * cfg.seq_len * cfg.grad_accum;
    char a[32], c2[32], d[32], e[32], f2[32], g[32], h2[32], i2[32], j[32], k[32];
    if (json) {
        printf("{\"ranks\":%d,\"rank\":%d,\"params\":%zu,\"chunks\":%d,\"chunk_numel\":%zu,\"padding_bytes\":%zu,"
               "\"device\":{\"budget_bytes\":%zu,\"free_bytes\":%zu,\"activation_bytes\":%zu,\"workspace_bytes\":%zu,"
               "\"staging_bytes\":%zu,\"working_set_bytes\":%zu,\"min_bytes\":%zu,\"all_resident_bytes\":%zu,"
               "\"peak_bytes\":%zu,\"fits\":%s},"
               "\"host\":{\"param_bytes\":%zu,\"grad_bytes\":%zu,\"grad_slots\":%d,\"optimizer_bytes\":%zu,\"pinned_bytes\":%zu,"
               "\"pinned_chunk_bytes\":%zu,\"pinned_optimizer_bytes\":%zu,\"staging_bytes\":%zu,\"slab_bytes\":%zu,"
               "\"slabs\":%d,\"pageable_bytes\":%zu,\"pageable_optimizer_bytes\":%zu,\"heap_bytes\":%zu,"
               "\"device_region_bytes\":%zu,\"total_bytes\":%zu,\"bytes_per_param\":%.3f,"
               "\"pinned_bytes_per_param\":%.3f,\"optim_state\":\"%s\",\"heap_measured_by\":\"%s\","
               "\"ram_bytes\":%zu,\"ram_source\":\"%s\",\"pin_limit_bytes\":%zu,\"fits\":%s},"
               "\"checkpointing\":%s,\"ckpt_blocks\":%d,\"gpu_optimizer\":%s,"
               "\"optimizer\":{\"chunks\":%d,\"gpu_chunks\":%d,\"gpu_state_bytes\":%zu,\"cpu_params\":%.0f,"
               "\"cpu_bytes_per_param\":%.1f},\"measured\":{\"copy_gbytes_per_s\":%.2f,\"dram_gbytes_per_s\":%.2f,\"adam_gparams_per_s\":%.3f,"
               "\"dram_fastest_gbytes_per_s\":%.2f,\"adam_probe_params\":%zu,\"dram_loaded_gbytes_per_s\":%.2f,\"dram_loaded_adam_gbytes_per_s\":%.2f,\"dram_loaded_copy_gbytes_per_s\":%.2f,"
               "\"compute_gflops\":%.2f,\"block_forward_ms\":%.3f,\"block_backward_ms\":%.3f,\"block_recompute_ms\":%.3f},"
               "\"estimate\":{\"h2d_bytes\":%.0f,\"d2h_bytes\":%.0f,\"compute_ms\":%.2f,\"pcie_ms\":%.2f,\"adam_ms\":%.2f,\"exposed_adam_ms\":%.2f,\"dram_ms\":%.2f,"
               "\"step_lower_bound_ms\":%.2f,\"tokens_per_s_upper_bound\":%.1f},",
               cfg.ranks > 1 ? cfg.ranks : 1, cfg.rank, p.params, p.chunks, p.chunk_numel, p.padding_bytes, budget, free_b, p.activation_bytes,
               p.workspace_bytes, p.staging_bytes, p.working_set_bytes, p.min_device_bytes, p.full_device_bytes,
               device_peak, fits_device ? "true" : "false", p.host_role_bytes[TD_TENSOR_PARAM],
               p.host_role_bytes[TD_TENSOR_GRAD], p.host_grad_slots, p.host_role_bytes[TD_TENSOR_ADAM_M] + p.host_role_bytes[TD_TENSOR_ADAM_V] + p.host_role_bytes[TD_TENSOR_MASTER],
               p.host_pinned_bytes, p.host_pinned_chunk_bytes, pinned_optim, p.host_staging_bytes, p.host_slab_bytes,
               p.host_slabs, p.host_pageable_bytes, p.host_pageable_state_bytes, p.host_heap_bytes,
               p.host_device_region_bytes, p.host_bytes, host_pp, pinned_pp, td_optim_state_name(cfg.optim.state),
               td_host_heap_source(), ram, ram_src, pin_limit, fits_host ? "true" : "false", p.ckpt ? "true" : "false",
               p.ckpt_blocks, p.gpu_optimizer ? "true" : "false", p.optim_chunks, p.optim_gpu_chunks,
               p.optim_gpu_state_bytes, p.adam_cpu_params, p.adam_bytes_per_param,
               r.copy_gbs, r.dram_gbs, bd.adam_gparams_per_s, r.dram_fastest_gbs, r.adam_probe_params,
               r.dram_loaded_gbs, r.dram_loaded_adam_gbs,
               r.dram_loaded_copy_gbs, r.gflops, r.block_fwd_ms, r.block_bwd_ms, r.block_recompute_ms,
               p.h2d_bytes_per_step, p.d2h_bytes_per_step, compute_ms, pcie_ms, adam_ms, bd.exposed_adam_ms, dram_ms, bound_ms,
               bound_ms > 0 ? tokens / (bound_ms * 1e-3) : 0);
        td_cli_plan_disk_json(stdout, &cfg, &p, &r, &bd, hide_accum, hide_accum ? &hide : NULL);
        printf("}\n");
    } else {
        char desc[256];
        td_model_desc_describe(&cfg.model, desc, sizeof desc);
        printf("model        %zu params: %s (padded vocab %d), seq %d\n", p.params, desc,
               cfg.model.padded_vocab_size, cfg.seq_len);
        printf("batch        %d x %d tokens, %d micro-batch%s per step; checkpointing %s", cfg.micro_batch,
               cfg.seq_len, cfg.grad_accum, cfg.grad_accum == 1 ? "" : "es", p.ckpt ? "on" : "off");
        if (p.ckpt) printf(" (%d of %d blocks recomputed)", p.ckpt_blocks, cfg.model.n_layer);
        printf("\n");
        printf("chunks       %d of %zu elements, %s padding\n", p.chunks, p.chunk_numel,
               td_format_bytes(p.padding_bytes, a, sizeof a));
        if (cfg.ranks > 1)
            printf("ranks        %d (ZeRO-3); below: rank %d's bytes: its 1/%d shard of the fp32 master and AdamW\n"
                   "             moments, the whole 16-bit params and grads, device chunks padded to %d equal shards;\n"
                   "             global batch %d x %d x %d sequences\n", cfg.ranks, cfg.rank, cfg.ranks, cfg.ranks,
                   cfg.ranks, cfg.micro_batch, cfg.grad_accum);
        printf("\ndevice (%s)\n", no_device ? "cuda, not present here: planned, nothing measured" : td_backend_describe(b));
        printf("  activations        %12s\n  workspace          %12s\n  staging            %12s\n",
               td_format_bytes(p.activation_bytes, a, sizeof a), td_format_bytes(p.workspace_bytes, c2, sizeof c2),
               td_format_bytes(p.staging_bytes, d, sizeof d));
        printf("  chunks in use      %12s  (the largest set one access pins)\n",
               td_format_bytes(p.working_set_bytes, e, sizeof e));
        printf("  minimum            %12s  (plus two of the largest chunk: prefetch, fragmentation%s)\n",
               td_format_bytes(p.min_device_bytes, f2, sizeof f2), p.optim_gpu_chunks ? "; the GPU's optimizer chunks" : "");
        printf("  all resident       %12s  (every param and grad chunk on the device, with the GPU's optimizer state)\n",
               td_format_bytes(p.full_device_bytes, g, sizeof g));
        printf("  budget             %12s  of %s free%s -> %s with --policy %s (peak about %s)\n",
               td_format_bytes(budget, h2, sizeof h2),
               no_device ? "unknown (no device here)" : td_format_bytes(free_b, i2, sizeof i2),
               !cfg.gpu_budget ? " (default: the run resident + 1/8)"
               : cfg.gpu_budget == TD_GPU_BUDGET_MAX ? " (max: free minus margin)" : "", fits_device ? "FITS" : "DOES NOT FIT", o.policy,
               td_format_bytes(device_peak, j, sizeof j));
        if (!fits_device)
            printf("  -> needs --gpu-budget of at least %s%s\n",
                   td_format_bytes(cfg.mm.placement == TD_PLACEMENT_CUDA ? p.full_device_bytes : p.min_device_bytes, k,
                                   sizeof k),
                   budget > free_b ? " and that much free device memory" : "");
        printf("\nhost (RAM %s: %s)\n", td_format_bytes(ram, a, sizeof a), ram_src);
        printf("  pinned (crosses PCIe)\n    params           %12s\n    grads            %12s",
               td_format_bytes(p.host_role_bytes[TD_TENSOR_PARAM], a, sizeof a),
               td_format_bytes(p.host_role_bytes[TD_TENSOR_GRAD], c2, sizeof c2));
        if (p.host_grad_slots)
            printf("  (the rest transient: %d staging slots of %s, in staging below, consumed\n%29sby the AdamW "
                   "thread as they land; a copy each only for chunks larger than a slot\n%29sand the GPU AdamW's)",
                   p.host_grad_slots, td_format_bytes(p.host_grad_slot_bytes, d, sizeof d), "", "");
        printf("\n");
        if (pinned_optim)
            printf("    optimizer        %12s  (homed on the device: the GPU AdamW's)\n",
                   td_format_bytes(pinned_optim, d, sizeof d));
        printf("    staging          %12s\n    total            %12s  in %d slab%s of %s; pin limit %s%s\n",
               td_format_bytes(p.host_staging_bytes, e, sizeof e), td_format_bytes(p.host_pinned_bytes, f2, sizeof f2),
               p.host_slabs, p.host_slabs == 1 ? "" : "s", td_format_bytes(p.host_slab_bytes, g, sizeof g),
               td_format_bytes(pin_limit, h2, sizeof h2),
               p.host_pinned_bytes > pin_limit ? " -> DOES NOT FIT (raise --host-pin-limit)" : "");
        printf("  pageable (NUMA-local to the CPU AdamW)\n    optimizer        %12s  (fp32 master, m and v as %s)\n"
               "    heap             %12s  (metadata, loader, libraries, the CUDA runtime; measured by %s)\n",
               td_format_bytes(p.host_pageable_state_bytes, a, sizeof a), td_optim_state_name(cfg.optim.state),
               td_format_bytes(p.host_heap_bytes, c2, sizeof c2), td_host_heap_source());
        if (p.host_device_region_bytes)
            printf("    device region    %12s  (the cpu backend's \"device\" is host memory)\n",
                   td_format_bytes(p.host_device_region_bytes, d, sizeof d));
        printf("  total              %12s  of %s RAM -> %s\n", td_format_bytes(p.host_bytes, e, sizeof e),
               td_format_bytes(ram, f2, sizeof f2), fits_host ? "FITS" : "DOES NOT FIT");
        printf("  bytes a param      %.2f on the host, %.2f of them pinned (model state)\n", host_pp, pinned_pp);
        if (td_train_disk_tier(&cfg)) td_cli_plan_disk_text(stdout, &cfg, &p, &r);
        printf("\noptimizer    %d of %d chunks on the GPU (%s of master, m, v there; their grads stay, their params\n"
               "             are not uploaded), the CPU AdamW updates %.0f params at %.0f bytes a param\n",
               p.optim_gpu_chunks, p.optim_chunks, td_format_bytes(p.optim_gpu_state_bytes, a, sizeof a),
               p.adam_cpu_params, p.adam_bytes_per_param);
        if (no_device)
            printf("\nmeasured here: nothing (no CUDA device on this machine; run the plan there for rates)\n");
        else if (no_measure)
            printf("\nmeasured here: nothing (--no-measure)\n");
        else
            printf("\nmeasured here: copy %.1f GB/s, DRAM %.1f GB/s (CPU AdamW at %zuM params, the median pass: %.2f G\n"
                   "               params/s; the fastest pass %.1f GB/s), matmul %.1f GFLOP/s (%s)\n"
                   "               DRAM %.1f GB/s with copies up and down beside the CPU AdamW (both together: the AdamW\n"
                   "               %.1f GB/s of it, the copies %.1f GB/s)\n",
                   r.copy_gbs, r.dram_gbs, r.adam_probe_params >> 20, bd.adam_gparams_per_s, r.dram_fastest_gbs, r.gflops,
                   td_backend_get_kind(b) == TD_BACKEND_CUDA ? "bf16 MLP matmul on the device" : "cpu reference matmul",
                   r.dram_loaded_gbs, r.dram_loaded_adam_gbs, r.dram_loaded_copy_gbs);
        if (r.block_fwd_ms > 0)
            printf("               one block at this batch: forward %.2f ms, backward %.2f ms, recompute %.2f ms\n",
                   r.block_fwd_ms, r.block_bwd_ms, r.block_recompute_ms);
        else if (!no_device && td_backend_get_kind(b) == TD_BACKEND_CUDA)
            printf("               one block at this batch: not measured (its buffers exceed the free device "
                   "memory); compute from the matmul rate\n");
        printf("step estimate: compute %.1f ms, PCIe %.1f ms (%s up, %s down), %s %.1f ms\n", compute_ms,
               pcie_ms, td_format_bytes((size_t)p.h2d_bytes_per_step, h2, sizeof h2),
               td_format_bytes((size_t)p.d2h_bytes_per_step, i2, sizeof i2),
               p.gpu_optimizer ? "CPU AdamW (none: all on the GPU)" : "CPU AdamW", adam_ms);
        printf("               host DRAM %.1f ms (the CPU AdamW's bytes and the copies')\n", dram_ms);
        td_cli_plan_disk_estimate(stdout, &cfg, &p, &bd, hide_accum, hide_accum ? &hide : NULL);
        if (bd.exposed_adam_ms > 0)
            printf("               CPU AdamW%s beyond one micro-batch's compute %.1f ms (it hides only there: the\n"
                   "               grads are whole in the last backward, the params needed in the first forward)\n",
                   bd.disk_ms > bd.adam_ms ? " (its disk reads and writes)" : "", bd.exposed_adam_ms);
        printf("               lower bound %.1f ms a step (all overlapped), at most %.0f tokens/s\n", bound_ms,
               bound_ms > 0 ? tokens / (bound_ms * 1e-3) : 0);
        if (layout) {
            printf("\n");
            if ((st = td_train_plan_print_layout(&cfg, &p, stdout))) goto cleanup;
        }
    }
    rc = fits_device && fits_host ? 0 : 3;
cleanup:
    if (st) fprintf(stderr, "tidal plan: %s\n", td_error_msg());
out:
    if (b) td_backend_free(b);
    td_loader_destroy(loader);
    td_args_free();
    return rc;
}

/* ---- `tidal train`'s options for `tidal tune` ------------------------------------ */

int td_cli_train_options(int argc, char **argv, const char *cmd, const char *usage_text, td_train_config *cfg,
                         const char **data, cJSON *given)
{
    static train_opts o; /* string options point into it until td_args_free */
    opts_defaults(&o);
    td_opt table[] = { OPTS(&o), {NULL, 0, NULL, NULL, NULL, 0} };
    int rc = td_args_main(table, argc, argv, cmd, usage_text);
    if (rc >= 0) return rc;
    int data_vocab = 0;
    *data = o.data;
    if (o.data) {
        td_loader_params lp = td_loader_default_params();
        lp.batch = 1;
        lp.seq = 1;
        td_loader *l = NULL;
        if (td_loader_open(o.data, &lp, &l)) {
            fprintf(stderr, "tidal %s: %s\n", cmd, td_error_msg());
            return 1;
        }
        data_vocab = (int)td_tokfile_get_info(td_loader_file(l))->vocab_size;
        td_loader_destroy(l);
    }
    if (build_config(&o, table, data_vocab, cfg)) {
        fprintf(stderr, "tidal %s: %s\n", cmd, td_error_msg());
        return 2;
    }
    /* The options given, as a --config file has them. */
    for (td_opt *t = table; given && t->name; t++) {
        if (!t->seen || !strcmp(t->name, "config")) continue;
        char v[200];
        if (t->kind == TD_OPT_FLAG) { cJSON_AddBoolToObject(given, t->name, *(int *)t->dst); continue; }
        if (t->kind == TD_OPT_STRING) { cJSON_AddStringToObject(given, t->name, *(const char **)t->dst); continue; }
        opt_value(t, v, sizeof v);
        cJSON_AddStringToObject(given, t->name, v);
    }
    return -1;
}
