/* The options that describe a model and a run, shared by `tidal train`,
 * `tidal plan` and `tidal tune` (train_opts.c): one struct, the option
 * tables in three groups, and the step from options to a td_train_config.
 *
 *   TD_CLI_MODEL_OPTS  the model and its data (every command)
 *   TD_CLI_RUN_OPTS    how a step runs: batch, budget, placement, precision
 *                      (every command: they decide the footprint)
 *   TD_CLI_OPTIM_OPTS  the optimizer and its schedule (train and tune)
 *   TD_CLI_TRAIN_OPTS  what only a training run does: its log, traces and
 *                      checkpoints (train)
 * A command's table is some of these groups and its own options; the
 * functions below ask only for options its table has. */
#ifndef TIDAL_CLI_TRAIN_OPTS_H
#define TIDAL_CLI_TRAIN_OPTS_H

#include "args.h"
#include "tidal/trainer.h"

struct cJSON;

typedef struct td_cli_train_opts {
    const char *model, *data, *policy, *precision, *ckpt, *schedule, *backend, *eviction;
    const char *log, *trace_out, *timeline, *save, *resume, *init, *optim_state, *adam_thread, *shard;
    long save_every, stop_after, max_bad_steps;
    double heldout;
    int layers, width, heads, kv_heads, mlp_width, seq, vocab, micro_batch, grad_accum, warmup, prefetch, grad_slots;
    int threads, log_every, decay_all, overwrite, loss_chunk;
    long steps;
    uint64_t seed, chunk_numel;
    size_t gpu_budget, host_pin_limit, host_ram, shard_size, cpu_device_bytes;
    double param_frac, optim_frac, lr, min_lr, weight_decay, clip;
    td_opt_list offload_dirs, freeze;
    int lora_rank;
    double lora_alpha, lora_dropout;
    const char *lora_targets;
} td_cli_train_opts;

#define TD_CLI_MODEL_OPTS(o)                                                                                         \
    {"model", TD_OPT_STRING, &(o)->model, "PRESET", td_cli_presets_help("tiny"), 0},                                \
    {"layers", TD_OPT_INT, &(o)->layers, "L", "layers (overrides the preset)", 0},                                 \
    {"width", TD_OPT_INT, &(o)->width, "C", "embedding width", 0},                                                \
    {"heads", TD_OPT_INT, &(o)->heads, "H", "attention heads (must divide the width)", 0},                        \
    {"kv-heads", TD_OPT_INT, &(o)->kv_heads, "N", "key/value heads (grouped-query attention; must divide the heads)", 0},      \
    {"mlp-width", TD_OPT_INT, &(o)->mlp_width, "H", "the MLP's width (intermediate_size; GPT-2's is 4 x the width)", 0},         \
    {"seq", TD_OPT_INT, &(o)->seq, "T", "sequence length (default 64, at most the model's positions)", 0},        \
    {"vocab", TD_OPT_INT, &(o)->vocab, "V", "vocabulary (default: the token file's; a preset's own is kept only\n" \
     "when given here)", 0},                                                                                       \
    {"data", TD_OPT_STRING, &(o)->data, "FILE", "token file written by `tidal prepare`", 0},                      \
    {"init", TD_OPT_STRING, &(o)->init, "DIR", "start from the weights of a checkpoint or a Hugging Face directory of a family\n" \
     "above (its config.json decides the model)", 0}

#define TD_CLI_RUN_OPTS(o)                                                                                           \
    {"micro-batch", TD_OPT_INT, &(o)->micro_batch, "B", "sequences per micro-batch (default 4)", 0},              \
    {"grad-accum", TD_OPT_INT, &(o)->grad_accum, "K", "micro-batches per optimizer step (default 1)", 0},         \
    {"gpu-budget", TD_OPT_BUDGET, &(o)->gpu_budget, "SIZE", "device bytes tidal may use, e.g. 512MiB, 24GiB; default: what the run needs\n" \
     "with all of it resident plus an eighth, at most the free memory less a margin;\nmax: all of that free memory", 0}, \
    {"cpu-device-bytes", TD_OPT_SIZE, &(o)->cpu_device_bytes, "SIZE", "the cpu backend: the size of its \"device\" (a host region standing\n" \
     "for a GPU's memory; default 4GiB, or TD_CPU_DEVICE_BYTES, or --gpu-budget when larger)", 0},              \
    {"host-pin-limit", TD_OPT_SIZE, &(o)->host_pin_limit, "SIZE", "most host memory to pin (default 80% of the host RAM); `tidal plan`'s\n" \
     "host.pinned_bytes is what the run pins, to the byte", 0},                                                    \
    {"host-ram", TD_OPT_SIZE, &(o)->host_ram, "SIZE", "host memory the run may use (default: MemTotal, or the cgroup's memory\n" \
     "limit when one is set: memory.max or memory.limit_in_bytes, less 5% and at least 2 GiB\n"                  \
     "for the system and 512 MiB a process on cuda); with --offload-dir, the\n"                                   \
     "optimizer state beyond it goes to disk (then grads, then params)", 0},                                       \
    {"offload-dir", TD_OPT_LIST, &(o)->offload_dirs, "DIR", "a directory on a local disk (NVMe) for the optimizer state the host's RAM\n" \
     "cannot hold (then grads, then 16-bit params): read and written with O_DIRECT\n"                            \
     "beside the CPU AdamW; repeat it to stripe over several drives\n"                                            \
     "(docs/training.md, \"The disk tier\")", 0},                                                                  \
    {"freeze", TD_OPT_LIST, &(o)->freeze, "PATTERN", "train without these tensors: a glob over the Hugging Face names, e.g.\n" \
     "'model.embed_tokens.weight' or 'model.layers.[0-9].*' (repeat it for more); they take no\n"           \
     "gradient and no optimizer state, and are never written back (docs/training.md)", 0},                       \
    {"lora-rank", TD_OPT_INT, &(o)->lora_rank, "R", "LoRA: train rank-R adapters on --lora-targets, the base frozen (docs/training.md,\n" \
     "\"LoRA\"); a save then writes a PEFT adapter folder", 0},                                                  \
    {"lora-alpha", TD_OPT_DOUBLE, &(o)->lora_alpha, "A", "LoRA: the update is scaled by A / R (default A = R)", 0}, \
    {"lora-dropout", TD_OPT_DOUBLE, &(o)->lora_dropout, "P", "LoRA: dropout on the adapters' input while training (peft's lora_dropout;\ndefault 0): each input element of an adapter is zeroed with probability P,\nthe others scaled by 1/(1-P); the mask is a hash of the seed, step, sample,\nposition, layer, module and column, never stored; eval and generate never drop", 0}, \
    {"lora-targets", TD_OPT_STRING, &(o)->lora_targets, "LIST", "LoRA: the modules, comma separated, e.g. q_proj,v_proj (default: every\n" \
     "linear module of the block: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj;\n"                  \
     "GPT-2's c_attn,c_proj,c_fc)", 0},                                              \
    {"optim-state", TD_OPT_STRING, &(o)->optim_state, "S", "how AdamW stores m and v: fp32 (default, exact), bf16 or int8 (block-wise\n" \
     "quantized, 8-bit Optimizers); the fp32 master stays fp32", 0},                                               \
    {"policy", TD_OPT_STRING, &(o)->policy, "P", "placement: cuda, cpu, static or auto (default auto)", 0},        \
    {"shard", TD_OPT_STRING, &(o)->shard, "M", "several ranks: split every chunk over each host's ranks (node: each host\n" \
     "holds the model state once, the hosts' grads summed over the network) or over every\n"                   \
     "rank (world: the job holds it once); auto (default): node where each host holds it", 0},               \
    {"offload-param-frac", TD_OPT_DOUBLE, &(o)->param_frac, "F", "static: share of param/grad chunks on the host", 0}, \
    {"offload-optim-frac", TD_OPT_DOUBLE, &(o)->optim_frac, "F", "static: share of optimizer-state chunks on the host (the rest are\n" \
     "updated on the device); auto: at least this share on the host", 0},                                         \
    {"chunk-numel", TD_OPT_U64, &(o)->chunk_numel, "N", "elements a chunk holds (default: searched around one block's params, smaller where the budget needs it)", 0}, \
    {"eviction", TD_OPT_STRING, &(o)->eviction, "E", "belady (default) or lru", 0},                               \
    {"prefetch", TD_OPT_INT, &(o)->prefetch, "N", "look-ahead in accesses; -1 auto (default), 0 off", 0},          \
    {"grad-slots", TD_OPT_INT, &(o)->grad_slots, "N", "pinned staging slots for the grads the CPU AdamW consumes as they land (no\n" \
     "clipping, no accumulation); -1 auto (default), 0: a host copy per grad chunk", 0},                         \
    {"precision", TD_OPT_STRING, &(o)->precision, "P", "fp32 (cpu backend), bf16 or fp16 (cuda)", 0},              \
    {"ckpt", TD_OPT_STRING, &(o)->ckpt, "M", "activation checkpointing: on, off, auto (default) or N: recompute the first N blocks", 0}, \
    {"loss-chunk", TD_OPT_INT, &(o)->loss_chunk, "ROWS", "the head and the loss run over chunks of ROWS of the B x T rows, so only\n" \
     "one chunk's logits exist (default 0: auto, at most 256 MiB of logits but\nat least 2048 rows; B x T or more: one chunk); the same losses", 0}, \
    {"clip-grad-norm", TD_OPT_DOUBLE, &(o)->clip, "X", "global grad-norm clipping, 0 off (default 1.0)", 0},       \
    {"backend", TD_OPT_STRING, &(o)->backend, "B", "auto (default: cuda when a GPU answers), cpu or cuda", 0},    \
    {"threads", TD_OPT_INT, &(o)->threads, "N", "CPU threads (default: the cores this process may run on, at most the\n" \
     "physical ones; a rank's share of them when ranks share a host)", 0},                                        \
    {"adam-thread", TD_OPT_STRING, &(o)->adam_thread, "M", "the CPU AdamW on a thread of its own, beside the GPU's backward and the\n" \
     "next forward: on, off or auto (default: on with the cuda backend);\nthe same results either way", 0}

#define TD_CLI_OPTIM_OPTS(o)                                                                                         \
    {"steps", TD_OPT_LONG, &(o)->steps, "N", "optimizer steps (default 100)", 0},                                 \
    {"seed", TD_OPT_U64, &(o)->seed, "S", "seed of init and data order (default 1337)", 0},                       \
    {"lr", TD_OPT_DOUBLE, &(o)->lr, "X", "peak learning rate (default 1e-3)", 0},                                  \
    {"min-lr", TD_OPT_DOUBLE, &(o)->min_lr, "X", "floor of the decay (default lr/10)", 0},                        \
    {"schedule", TD_OPT_STRING, &(o)->schedule, "S", "constant, cosine (default), linear, noam or exponential", 0}, \
    {"warmup", TD_OPT_INT, &(o)->warmup, "N", "linear warmup steps (default 10% of --steps)", 0},                  \
    {"weight-decay", TD_OPT_DOUBLE, &(o)->weight_decay, "X", "AdamW decoupled weight decay on the matrices (2-D weights and embeddings),\n" \
     "not on norm gains and biases (default 0.1)", 0},                                                            \
    {"decay-all", TD_OPT_FLAG, &(o)->decay_all, NULL, "apply --weight-decay to every tensor, norm gains and biases too", 0}

#define TD_CLI_TRAIN_OPTS(o)                                                                                         \
    {"log", TD_OPT_STRING, &(o)->log, "FILE", "JSON lines, one per step", 0},                                      \
    {"log-every", TD_OPT_INT, &(o)->log_every, "N", "progress line every N steps when not on a terminal (default 10)", 0}, \
    {"trace-out", TD_OPT_STRING, &(o)->trace_out, "FILE", "write the warm-up's chunk access trace (tidal-trace 1; ranks: as\n" \
     "--trace-timeline)", 0},                                                                                      \
    {"trace-timeline", TD_OPT_STRING, &(o)->timeline, "FILE", "Chrome/Perfetto timeline of copies, compute and the CPU AdamW\n" \
     "(slower); several ranks write FILE's name with .rankR before its extension", 0},                            \
    {"save", TD_OPT_STRING, &(o)->save, "DIR", "write a checkpoint there at the end (Hugging Face weights + train state);\n" \
     "a checkpoint already there is replaced only by its own run (--resume DIR)\nor with --overwrite", 0},      \
    {"overwrite", TD_OPT_FLAG, &(o)->overwrite, NULL, "let --save replace a checkpoint of another run", 0},       \
    {"save-shard-size", TD_OPT_SIZE, &(o)->shard_size, "SIZE", "weights above SIZE are saved as Hugging Face shards with\n" \
     "model.safetensors.index.json (default 5GB, as save_pretrained)", 0},                                        \
    {"save-every", TD_OPT_LONG, &(o)->save_every, "N", "also every N steps (atomic: the previous one stays until the new one is complete)", 0}, \
    {"resume", TD_OPT_STRING, &(o)->resume, "DIR", "continue a run from its checkpoint, bit-exactly (--steps counts from the start);\n" \
     "the shape flags of the first run may stay when they agree with it", 0},                                    \
    {"heldout", TD_OPT_DOUBLE, &(o)->heldout, "PCT", "keep the last PCT% of the sequences out of training (for `tidal eval --split heldout`)", 0}, \
    {"stop-after", TD_OPT_LONG, &(o)->stop_after, "N", "stop after N steps of this invocation (saving with --save); --resume continues", 0}, \
    {"max-bad-steps", TD_OPT_LONG, &(o)->max_bad_steps, "N", "stop (exit 1, nothing saved) after N steps in a row whose loss or grads are\n" \
     "not finite; each is skipped (default 10)", 0}

/* The defaults of every option above. */
void td_cli_train_opts_defaults(td_cli_train_opts *o);

/* The run's configuration from the options of `table` (the token file's
 * vocabulary `data_vocab`, 0 when no --data); on failure the message
 * names the option.  `note` (may be NULL; 512 bytes) receives what the command should
 * tell the user about a choice made for them, such as a preset's
 * vocabulary replaced by the token file's ("" when nothing). */
td_status td_cli_train_config(const td_cli_train_opts *o, td_opt *table, int data_vocab, td_train_config *c,
                              char *note);

/* The exit status for a failed td_cli_train_config: 2, a usage error (a
 * value, or a file an option names, that cannot be used), or 1 when the host
 * ran out of memory. */
int td_cli_config_exit(td_status st);
/* A PEFT adapter folder (adapter_config.json in dir): 1 and its base model
 * path (base_model_name_or_path, in base), rank, alpha, dropout and
 * target modules (comma separated); 0 when dir holds none; -1 with a
 * message when it is unreadable. */
int td_cli_adapter_read(const char *dir, char *base, size_t base_n, int *rank, double *alpha, double *dropout,
                        char *targets, size_t targets_n);
/* When dir is a LoRA adapter folder (*found 1): its base model's description
 * with the folder's adapters (rank, alpha, targets) in *model and the
 * base's folder in base (base_opt, else base_model_name_or_path); *found 0
 * when dir holds no adapter_config.json.  An error when the folder or its
 * base cannot be read (TD_ERR_INVALID for a bad folder or no base named). */
td_status td_cli_adapter_model(const char *dir, const char *base_opt, td_model_desc *model, char *base, size_t base_n,
                               int *found);

/* One option's value as a --config file has it ("max" for a budget of
 * TD_GPU_BUDGET_MAX, "(unset)" for a string never given). */
void td_cli_opt_value(const td_opt *t, char *v, size_t n);

/* 1 when the table has this option and it was given. */
int td_cli_seen(td_opt *table, const char *name);

/* The token file's vocabulary (1 when it cannot be read: the message says
 * why), for commands that read --data for that alone. */
td_status td_cli_data_vocab(const char *path, int *vocab);

#endif
