/* Checkpoint directories: Hugging Face weights (of any model family,
 * family.h) plus tidal's training state, written chunk by chunk and
 * replaced atomically.  This module knows file formats and the directory
 * protocol; what a model's tensors and config.json hold is its family's
 * (model.h: td_model_hf_*, td_model_config_*).
 *
 * A checkpoint is a directory DIR holding
 *   config.json               the model's Hugging Face config (GPT2Config,
 *                             LlamaConfig, Qwen2Config, GemmaConfig, ...: the
 *                             family's model_type and keys) plus tidal_*
 *                             keys (format version, padded vocabulary)
 *   model.safetensors         the weights under the family's Hugging Face names
 *                             (GPT-2: "wte.weight", "h.0.attn.c_attn.weight",
 *                             ..., no "transformer." prefix, Conv1D weights
 *                             stored (in, out); LLaMA-style: "model.embed_tokens.weight",
 *                             "model.layers.0.self_attn.q_proj.weight", ...,
 *                             "lm_head.weight" unless tied: tidal's fused q|k|v
 *                             and gate|up weights split into their parts), the
 *                             embedding with the real vocabulary's rows only.
 *                             Above write_options.shard_bytes: shards
 *                             model-00001-of-0000N.safetensors and
 *                             model.safetensors.index.json, as save_pretrained
 *   train_state.safetensors   (optional) per parameter "master.<name>",
 *                             "adam_m.<name>", "adam_v.<name>" as F32 in tidal's
 *                             layout, caller-declared extra tensors (RNG words,
 *                             ...) and scalars as __metadata__ strings
 * so `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads it as is.
 *
 * Atomicity (docs/checkpoints.md): everything is written into DIR.tmp.<pid>
 * and fsync'd; then DIR.tmp.<pid> and DIR are swapped with one
 * renameat2(RENAME_EXCHANGE) and the old one is deleted.  Where the
 * filesystem cannot exchange, DIR is renamed to DIR.old first and
 * DIR.tmp.<pid> to DIR after; a reader finding no DIR but a DIR.old reads
 * DIR.old, and the next writer (or td_ckpt_recover) moves it back.  A kill at
 * any moment leaves DIR (or DIR.old) holding the old or the new checkpoint,
 * complete.  One writer per DIR at a time.
 *
 * Parameters: a `param` below is an index of td_model_hf_get (model.h), the
 * model's tensors of the files in the family's order, each with tidal's
 * shape (weights (out, in), the embedding (padded_vocab_size, C)), the shape
 * stored in model.safetensors and, for a part of a fused tensor, its offset.
 *
 * Ownership: a writer owns its temporary directory until commit or abort
 * (both free it); a reader owns its files until close.
 * Thread-safety: a writer is used by one thread at a time.  An open reader is
 * immutable: its read calls may run from several threads at once. */
#ifndef TIDAL_CHECKPOINT_H
#define TIDAL_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/dtype.h"
#include "tidal/model.h"
#include "tidal/safetensors.h"
#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TD_CKPT_FORMAT_VERSION 1
#define TD_CKPT_CONFIG_FILE "config.json"
#define TD_CKPT_MODEL_FILE "model.safetensors"
#define TD_CKPT_STATE_FILE "train_state.safetensors"
/* The tokenizer files a checkpoint may carry, as Hugging Face directories do
 * (GPT-2 BPE: vocab.json and merges.txt; or tokenizer.json), with the
 * tokenizer_config.json and chat_template.jinja that hold its special tokens
 * and chat template. */
#define TD_CKPT_TOKENIZER_FILES {"vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
#define TD_CKPT_TOKENIZER_FILE_COUNT 5

/* The model's description (model.h): vocab_size V rows of the embedding
 * stored in model.safetensors, padded_vocab_size Vp >= V rows in tidal's
 * layout.  Parameters are numbered as the model's Hugging Face tensors
 * (td_model_hf_get: names, tidal's and the files' shapes, the part of a
 * fused tensor each is); config.json is read with td_model_config_read. */

/* Training-state tensors kept per parameter. */
typedef enum td_ckpt_state {
    TD_CKPT_STATE_MASTER, /* fp32 master weights */
    TD_CKPT_STATE_ADAM_M, /* AdamW first moment */
    TD_CKPT_STATE_ADAM_V, /* AdamW second moment */
    TD_CKPT_STATE_COUNT
} td_ckpt_state;

/* "master", "adam_m", "adam_v": the name prefix in train_state.safetensors. */
const char *td_ckpt_state_name(td_ckpt_state kind);

/* --- writer --------------------------------------------------------------- */

/* How DIR is replaced when it exists. */
typedef enum td_ckpt_replace {
    TD_CKPT_REPLACE_AUTO,     /* exchange where the filesystem supports it, else aside */
    TD_CKPT_REPLACE_EXCHANGE, /* renameat2(RENAME_EXCHANGE) only; an error where unsupported */
    TD_CKPT_REPLACE_ASIDE,    /* DIR -> DIR.old, DIR.tmp.<pid> -> DIR, remove DIR.old */
} td_ckpt_replace;

/* Points of a save, in order, reported to on_stage (tests kill there). */
typedef enum td_ckpt_stage {
    TD_CKPT_STAGE_TEMP_CREATED,  /* DIR.tmp.<pid> exists with config.json, data not yet written */
    TD_CKPT_STAGE_FILES_SYNCED,  /* every file complete and fsync'd in DIR.tmp.<pid> */
    TD_CKPT_STAGE_OLD_ASIDE,     /* (aside only) DIR renamed to DIR.old; no DIR now */
    TD_CKPT_STAGE_PUBLISHED,     /* the new checkpoint is DIR; the old one not yet deleted */
    TD_CKPT_STAGE_DONE,          /* the old checkpoint deleted */
} td_ckpt_stage;

/* Several processes writing one checkpoint (data parallelism: each rank
 * holds a shard of every tensor, and nothing is gathered on one rank).
 * checkpoint/ does not know the communicator: the caller passes how its
 * ranks exchange a few bytes. */
typedef struct td_ckpt_group {
    int rank, size;
    /* Every rank's `bytes` from mine into all (size * bytes, in rank order);
     * every rank calls it at the same points.  May be NULL when size is 1. */
    td_status (*allgather)(void *arg, const void *mine, size_t bytes, void *all);
    void *arg;
} td_ckpt_group;

typedef struct td_ckpt_write_options {
    td_dtype weight_dtype;   /* dtype of model.safetensors (default fp32) */
    int train_state;         /* 1: also write train_state.safetensors (default 1) */
    td_ckpt_replace replace; /* default AUTO */
    void (*on_stage)(td_ckpt_stage stage, void *arg); /* may be NULL; rank 0 alone in a group */
    void *stage_arg;
    uint64_t shard_bytes;    /* weights above this many bytes go to shards of at most this size with
                                model.safetensors.index.json (0: 5 GB, save_pretrained's default) */
    /* NULL: one process streaming the files (the append/put calls).  Set:
     * ranged writing by every rank of the group (below); the pointer is
     * used until commit or abort. */
    const td_ckpt_group *group;
    /* no_state[k] = 1: Hugging Face tensor k (td_model_hf_get's order) is
     * frozen and has no train state (master, m, v) in the file; NULL: every
     * tensor has.  Used until td_ckpt_writer_begin returns. */
    const uint8_t *no_state;
} td_ckpt_write_options;

td_ckpt_write_options td_ckpt_write_default_options(void);

typedef struct td_ckpt_writer td_ckpt_writer;

/* Whether a save into DIR can go ahead, before a run spends hours on what
 * it would save: an existing DIR is a directory of checkpoint files only,
 * writable; otherwise the folders above it are made (as `mkdir -p`) and
 * the parent is writable.  Each failure names the path and what to do. */
td_status td_ckpt_check_target(const char *dir);

/* Starts a save into DIR: finishes an interrupted earlier save
 * (td_ckpt_recover), checks that an existing DIR holds only checkpoint files
 * (so nothing else is ever deleted), makes the folders above DIR that are
 * missing, creates DIR.tmp.<pid> with config.json,
 * and declares every weight (and, with train_state, every master/m/v tensor).
 * opts may be NULL for the defaults. */
td_status td_ckpt_writer_begin(const char *dir, const td_model_desc *cfg,
                               const td_ckpt_write_options *opts, td_ckpt_writer **out);

/* train_state.safetensors only, before its first data write: a __metadata__
 * string (scalars: step, data position, loss scale, ...), or an extra tensor
 * placed after every master/m/v tensor (*index_out numbers extras 0, 1, ...). */
td_status td_ckpt_writer_set_meta(td_ckpt_writer *w, const char *key, const char *value);
td_status td_ckpt_writer_set_meta_u64(td_ckpt_writer *w, const char *key, uint64_t value);
/* Printed with 17 significant digits, so td_ckpt_reader_meta_f64 returns the same double. */
td_status td_ckpt_writer_set_meta_f64(td_ckpt_writer *w, const char *key, double value);
td_status td_ckpt_writer_declare_extra(td_ckpt_writer *w, const char *name, td_st_dtype dtype,
                                       int ndim, const uint64_t *shape, int *index_out);

/* Weights, parameters in td_model_hf_get's order (each file is a stream: see
 * safetensors.h).  put_weight takes one whole tensor in tidal's layout (it
 * transposes Conv1D weights through a bounded buffer and keeps only wte's
 * first V rows); append_weight takes the next n_elems elements of the stored
 * (Hugging Face) layout, hf_numel in all. */
td_status td_ckpt_writer_put_weight(td_ckpt_writer *w, int param, td_dtype src_dtype,
                                    const void *src);
td_status td_ckpt_writer_append_weight(td_ckpt_writer *w, int param, td_dtype src_dtype,
                                       const void *src, size_t n_elems);
/* Training state in the order param 0 master, m, v, param 1 master, m, v, ...,
 * then the extras: the next n_elems of the tensor, tidal's layout (numel in all). */
td_status td_ckpt_writer_append_state(td_ckpt_writer *w, int param, td_ckpt_state kind,
                                      const float *src, size_t n_elems);
td_status td_ckpt_writer_append_extra(td_ckpt_writer *w, int extra, const void *bytes,
                                      size_t n_bytes);

/* --- ranged writing (write options with a group) ---------------------------
 * Every rank calls td_ckpt_writer_begin with the same directory, config and
 * options: rank 0 recovers and checks DIR, creates DIR.tmp.<rank 0's pid>
 * and config.json; then every rank declares the same tensors.  After the
 * same set_meta / declare_extra calls on every rank, td_ckpt_writer_begin_ranges
 * (collective) has rank 0 create both files at their full size with the
 * headers every rank computed alike (a rank whose header differs from rank
 * 0's is refused, naming it), and the others open them.  Each rank then
 * writes its element ranges, in any order, with the calls below (ranges of
 * different ranks must not overlap and together cover every tensor:
 * commit checks the total), and td_ckpt_writer_commit (collective) fsyncs
 * every rank's writes, checks that every rank succeeded, and has rank 0
 * publish DIR atomically as for one process.  A failure on any rank fails
 * commit on every rank with the same message naming the rank, and leaves
 * DIR as it was.  A rank that aborts instead makes the others' commit fail
 * (their allgather sees it gone, or times out).  With a group of size 1
 * this is ranged writing by one process. */
td_status td_ckpt_writer_begin_ranges(td_ckpt_writer *w);
/* Elements [elem_offset, elem_offset + n_elems) of a weight in tidal's
 * layout (Conv1D weights are transposed into the stored layout as they are
 * written; wte's padding rows V .. Vp-1 are dropped). */
td_status td_ckpt_writer_write_weight(td_ckpt_writer *w, int param, uint64_t elem_offset, td_dtype src_dtype,
                                      const void *src, size_t n_elems);
/* Elements of a master/m/v tensor (tidal's layout, F32). */
td_status td_ckpt_writer_write_state(td_ckpt_writer *w, int param, td_ckpt_state kind, uint64_t elem_offset,
                                     const float *src, size_t n_elems);
/* Bytes of an extra tensor (usually one rank writes each extra whole). */
td_status td_ckpt_writer_write_extra(td_ckpt_writer *w, int extra, uint64_t byte_offset, const void *bytes,
                                     size_t n_bytes);

/* Copies the file at src into the checkpoint as `name`, one of
 * TD_CKPT_TOKENIZER_FILES (published with the rest by commit). */
td_status td_ckpt_writer_add_file(td_ckpt_writer *w, const char *name, const char *src);

/* Checks that every tensor is complete, syncs, publishes DIR and deletes the
 * old checkpoint.  Frees w whatever the outcome; on failure DIR is as before. */
td_status td_ckpt_writer_commit(td_ckpt_writer *w);
/* Deletes DIR.tmp.<pid> and frees w (NULL is a no-op). */
void td_ckpt_writer_abort(td_ckpt_writer *w);

/* Finishes what an interrupted save left: DIR missing but DIR.old present ->
 * DIR.old becomes DIR; DIR present -> a stale DIR.old is deleted; temporary
 * DIR.tmp.<pid> directories of processes no longer running are deleted. */
td_status td_ckpt_recover(const char *dir);

/* --- reader --------------------------------------------------------------- */

typedef struct td_ckpt_reader td_ckpt_reader;

/* Opens DIR (or DIR.old after an interrupted save): config.json, then
 * model.safetensors (or the shards of model.safetensors.index.json), and
 * train_state.safetensors when present.  Each field of `expect` (may be NULL)
 * that is > 0 must agree with config.json; padded_vocab_size comes from
 * expect, else config.json's tidal_padded_vocab_size, else vocab_size.
 * config.json may be missing only when expect gives every field.  Every
 * weight must be present (with or without "transformer.") with its stored
 * shape and a float dtype; train-state tensors must be F32 with tidal's
 * shapes.  Errors name the file, the tensor, the expected and found shape
 * or dtype. */
td_status td_ckpt_reader_open(const char *dir, const td_model_desc *expect, td_ckpt_reader **out);
void td_ckpt_reader_close(td_ckpt_reader *r); /* NULL is a no-op */

const td_model_desc *td_ckpt_reader_config(const td_ckpt_reader *r);
/* The directory actually read (DIR, or DIR.old after an interrupted save). */
const char *td_ckpt_reader_dir(const td_ckpt_reader *r);

/* Parameter `param` whole, in tidal's layout (numel elements): Conv1D
 * weights transposed back, wte's rows V .. Vp-1 set to zero. */
td_status td_ckpt_reader_get_weight(const td_ckpt_reader *r, int param, td_dtype dst_dtype,
                                    void *dst);
/* Elements [elem_offset, elem_offset + n_elems) of parameter `param` in
 * tidal's layout (Conv1D weights transposed back, wte's padding rows zero):
 * a rank's shard, whatever number of ranks wrote the checkpoint. */
td_status td_ckpt_reader_get_weight_range(const td_ckpt_reader *r, int param, uint64_t elem_offset,
                                          size_t n_elems, td_dtype dst_dtype, void *dst);
/* Elements [elem_offset, elem_offset + n_elems) of the stored (HF) layout. */
td_status td_ckpt_reader_read_weight(const td_ckpt_reader *r, int param, uint64_t elem_offset,
                                     size_t n_elems, td_dtype dst_dtype, void *dst);
/* The dtype the weights are stored in. */
td_st_dtype td_ckpt_reader_weight_dtype(const td_ckpt_reader *r, int param);

/* 1 when train_state.safetensors is present. */
int td_ckpt_reader_has_state(const td_ckpt_reader *r);
/* Elements [elem_offset, +n_elems) of a master/m/v tensor (tidal's layout). */
td_status td_ckpt_reader_read_state(const td_ckpt_reader *r, int param, td_ckpt_state kind,
                                    uint64_t elem_offset, size_t n_elems, float *dst);
/* train_state's __metadata__: the string or NULL; typed forms fail with a
 * message naming the key when it is missing or not a number. */
const char *td_ckpt_reader_meta(const td_ckpt_reader *r, const char *key);
td_status td_ckpt_reader_meta_u64(const td_ckpt_reader *r, const char *key, uint64_t *out);
td_status td_ckpt_reader_meta_f64(const td_ckpt_reader *r, const char *key, double *out);
/* The train-state file itself, for extra tensors (td_st_find / td_st_read*);
 * NULL without one. */
const td_st_reader *td_ckpt_reader_state_file(const td_ckpt_reader *r);

#ifdef __cplusplus
}
#endif
#endif
