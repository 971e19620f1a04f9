/* Training data: the token file format, its writer and reader, and the
 * batch loader the trainer draws from.
 *
 * Token file (little-endian; docs/data.md has the full story):
 *
 *     offset  size  field
 *          0     8  magic "TDTOKENS"
 *          8     4  version: 1, or 2 when either field at 44 or 48 is set
 *         12     4  header bytes (64)
 *         16     4  token bytes: 2 (uint16) when vocab size <= 65536, else 4 (uint32)
 *         20     4  tokenizer kind (1 byte, 2 gpt2, 3 json; td_tokenizer_kind)
 *         24     4  vocab size (every token id is below it)
 *         28     4  end-of-text id
 *         32     8  token count N
 *         40     4  CRC-32 of the token payload (zlib's CRC-32, as Python's zlib.crc32)
 *         44     4  version 2: row length R (tokens); 0: the tokens are one stream
 *         48     4  version 2: 1 when a flag byte per token follows the tokens
 *         52     4  version 2: CRC-32 of the flag bytes
 *         56     4  reserved, zero (version 1: bytes 44..59 all zero)
 *         60     4  CRC-32 of header bytes [0, 60)
 *         64        N x token bytes of token ids
 *                   [N flag bytes: TD_TOKFLAG_* of each token]
 *
 * Streams (R = 0): a file of N tokens holds S = (N - 1) / T sequences of
 * T + 1 tokens; sequence s reads tokens [s T, s T + T] (consecutive
 * sequences share one token, so every token but the first is a target
 * exactly once).  Rows (R > 0, what `tidal prepare` writes for JSONL
 * records): the tokens are N / R rows of R, each holding whole documents
 * (packed) and padding; training reads them with T = R, one row a sequence
 * whose inputs are its tokens and whose last target is none.
 *
 * Flags: a token's TD_TOKFLAG_TARGET says the loss counts it as a target
 * (predicting it from the tokens before); TD_TOKFLAG_DOC_START that it
 * starts a document: nothing predicts it, positions restart at it and
 * attention does not reach back past it; TD_TOKFLAG_PAD marks padding
 * (never a target).  Without flags every target counts and a row is one
 * document.  Each batch gives the targets (-1 where none counts) and each
 * token's position in its document (include/tidal/ops.h).
 *
 * A held-out split takes the last sequences (heldout_percent of S, at
 * least one); the training split the rest.  With rows, a split is a set of
 * whole documents.
 *
 * Order: an epoch visits every sequence of its split exactly once, in an
 * order that is a pseudo-random permutation of the split keyed by (seed,
 * epoch) (a Feistel network with cycle walking: no table, any sequence
 * count, O(1) to find the i-th sequence), or in file order when shuffle is
 * off.  Sequences form one stream, epoch after epoch; a batch takes the next
 * B of them (a batch may straddle two epochs).  The position (epoch, index
 * of the next sequence) is all the state: seeking to a saved position
 * continues with exactly the same batches, whatever batch size is used.
 *
 * Several ranks (data parallelism, ranks = N): every call takes the next
 * global batch of N B sequences of that one stream, and rank r gets its
 * slice, sequences [r B, (r + 1) B) of it; the position advances by N B on
 * every rank alike.  So N ranks with batch B together see, call by call,
 * exactly the sequences one rank with batch N B sees, and the position (which
 * does not depend on N or r) resumes on any number of ranks.
 *
 * Ownership: a td_tokfile maps its file read-only (no copy) and unmaps it on
 * close; td_tokfile_open_buffer borrows the caller's bytes.  A loader made
 * by td_loader_open owns its file; one made by td_loader_create borrows it.
 * Thread-safety: a td_tokfile is immutable after open (any thread may read);
 * a loader or writer must be used by one thread at a time. */
#ifndef TIDAL_DATA_H
#define TIDAL_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/status.h"
#include "tidal/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TD_TOKFILE_MAGIC "TDTOKENS"
#define TD_TOKFILE_VERSION 2 /* the newest this tidal writes; 1 and 2 are read */
#define TD_TOKFILE_HEADER_BYTES 64

/* The flag byte of a token (version 2 files with flags). */
#define TD_TOKFLAG_TARGET 1u    /* the loss counts it as a target */
#define TD_TOKFLAG_DOC_START 2u /* the first token of a document */
#define TD_TOKFLAG_PAD 4u       /* padding: in no document's loss */

/* zlib-compatible CRC-32: pass 0 to start, the previous value to continue. */
uint32_t td_crc32(uint32_t crc, const void *data, size_t bytes);

typedef struct td_tokfile_info {
    uint32_t version;
    uint32_t token_bytes; /* 2 or 4 */
    td_tokenizer_kind tokenizer;
    uint32_t vocab_size;
    uint32_t eot;
    uint64_t token_count;
    uint32_t payload_crc32;
    uint32_t row_tokens;  /* R: 0 for a stream */
    int has_flags;
    uint32_t flags_crc32;
    /* counted when the file is opened (flags files; a stream of no flags:
       one document, every token but the first a target, no padding) */
    uint64_t documents, targets, padding;
} td_tokfile_info;

/* Where the tokenizer files a token file was made with are kept beside it:
 * "<tokfile>.tokenizer/<name>" (vocab.json and merges.txt for GPT-2 BPE,
 * tokenizer.json for json),
 * so that the checkpoints of a run on it can carry its tokenizer.  Writes
 * the path into buf; TD_ERR_INVALID when it does not fit. */
td_status td_tokfile_tokenizer_path(const char *tokfile, const char *name, char *buf, size_t buf_bytes);

/* The token width a vocabulary needs: 2 up to 65536 ids, else 4. */
uint32_t td_tokfile_token_bytes_for(uint32_t vocab_size);

/* ---- writing --------------------------------------------------------------
 * Writes go to a temporary file beside `path` ("<path>.tmp.<pid>.<n>");
 * commit writes the header, fsyncs, renames it over `path` and fsyncs the
 * folder, so `path` is either the old file or the complete new one.  Abort
 * (or a failed commit) removes the temporary file.  Both free the writer. */
typedef struct td_tokfile_writer td_tokfile_writer;
td_status td_tokfile_writer_open(const char *path, td_tokenizer_kind tokenizer, uint32_t vocab_size, uint32_t eot,
                                 td_tokfile_writer **out);
/* Rows of row_tokens tokens and/or a flag byte per token (version 2), set
 * before anything is appended; row_tokens 0 keeps a stream.  A file with
 * neither is written as version 1. */
td_status td_tokfile_writer_set_layout(td_tokfile_writer *w, uint32_t row_tokens, int with_flags);
/* Appends ids (each must be below vocab size: TD_ERR_INVALID otherwise);
 * flags (TD_TOKFLAG_*, one per id) when the layout has them, else NULL. */
td_status td_tokfile_writer_append(td_tokfile_writer *w, const uint32_t *ids, size_t n);
td_status td_tokfile_writer_append_flagged(td_tokfile_writer *w, const uint32_t *ids, const uint8_t *flags, size_t n);
uint64_t td_tokfile_writer_count(const td_tokfile_writer *w);
td_status td_tokfile_writer_commit(td_tokfile_writer *w);
void td_tokfile_writer_abort(td_tokfile_writer *w); /* NULL is a no-op */

/* ---- documents into rows -------------------------------------------------
 * What `tidal prepare` does with JSONL records: documents (token ids and,
 * per token, whether the loss counts it) are gathered, shuffled by document
 * with a seed, and placed into rows of R tokens, then written as a version 2
 * token file of rows with flags.  Packing places the documents longest
 * first, each into the first row with room (first fit decreasing), so short
 * documents fill the gaps long ones leave, and then shuffles the rows;
 * without packing each document has rows of its own.  The rest of a row is padding (the end-of-text id,
 * TD_TOKFLAG_PAD).  A document longer than R is split into pieces of R
 * (each its own document), cut to its first R tokens, or dropped.  A
 * document of no counted target is dropped (nothing to learn from it).
 * Memory: every document is held until td_pack_write (ids at 4 bytes and a
 * byte of flags a token). */
typedef enum td_pack_long { TD_PACK_SPLIT, TD_PACK_CUT, TD_PACK_DROP } td_pack_long;

typedef struct td_pack_stats {
    uint64_t documents, rows, tokens, padding, targets;  /* written */
    uint64_t split, cut, dropped_long, dropped_empty;    /* documents, by what happened to them */
} td_pack_stats;

typedef struct td_pack td_pack;
td_status td_pack_create(uint32_t row_tokens, int pack, td_pack **out);
void td_pack_free(td_pack *p); /* NULL is a no-op */
/* Adds one document: ids with counted[i] != 0 where token i is a target
 * the loss counts; `too_long` says what to do when n > R. */
td_status td_pack_add(td_pack *p, const uint32_t *ids, const uint8_t *counted, size_t n, td_pack_long too_long);
/* Shuffles the documents (seed; shuffle 0 keeps their order), places them
 * and writes the rows to w (whose layout it sets: rows of R with flags);
 * pad_id fills the rest of each row. */
td_status td_pack_write(td_pack *p, int shuffle, uint64_t seed, uint32_t pad_id, td_tokfile_writer *w,
                        td_pack_stats *stats);
const td_pack_stats *td_pack_get_stats(const td_pack *p);

/* ---- reading --------------------------------------------------------------
 * Open validates everything before returning: magic, version, header
 * checksum, field values, file size against the token count, the payload
 * checksum and that every id is below the vocab size.  Any failure is an
 * error (TD_ERR_IO when the file cannot be opened or mapped, TD_ERR_INVALID
 * otherwise) naming the file and what is wrong; nothing crashes on any
 * input. */
typedef struct td_tokfile td_tokfile;
td_status td_tokfile_open(const char *path, td_tokfile **out);
/* The same over bytes in memory, which must outlive the td_tokfile. */
td_status td_tokfile_open_buffer(const void *data, size_t bytes, const char *name, td_tokfile **out);
void td_tokfile_close(td_tokfile *f); /* NULL is a no-op */

const td_tokfile_info *td_tokfile_get_info(const td_tokfile *f);
const char *td_tokfile_name(const td_tokfile *f);
uint64_t td_tokfile_count(const td_tokfile *f);
/* Token i (i < count; unchecked). */
uint32_t td_tokfile_at(const td_tokfile *f, uint64_t i);
/* Tokens [start, start + n) as int32 into out (TD_ERR_INVALID when out of range). */
td_status td_tokfile_read(const td_tokfile *f, uint64_t start, size_t n, int32_t *out);
/* Token i's TD_TOKFLAG_* byte (i < count; unchecked); a file without flags
 * gives TD_TOKFLAG_TARGET for every token. */
unsigned td_tokfile_flags_at(const td_tokfile *f, uint64_t i);

/* ---- the loader ---------------------------------------------------------- */

typedef enum td_data_split {
    TD_DATA_TRAIN,   /* the first sequences */
    TD_DATA_HELDOUT, /* the last heldout_percent of them (for tidal eval) */
} td_data_split;

typedef struct td_loader_params {
    uint32_t batch;         /* B: sequences per batch (>= 1) */
    uint32_t seq;           /* T: inputs per sequence (>= 1); each reads T + 1 tokens of a stream, or
                               one row (a file of rows needs T = its row length) */
    uint64_t seed;          /* shuffle seed */
    double heldout_percent; /* [0, 100): share of sequences held out; 0: none */
    td_data_split split;
    int shuffle;            /* 1: a new permutation per epoch; 0: file order */
    uint32_t rank, ranks;   /* data parallelism: this rank's slice of every global batch (0 of 1; 0 ranks = 1) */
} td_loader_params;

/* batch 8, seq 64, seed 0, heldout 0, train split, shuffle on, rank 0 of 1. */
td_loader_params td_loader_default_params(void);

typedef struct td_loader_position {
    uint64_t epoch;
    uint64_t index;       /* the next sequence within the epoch's order */
    uint64_t fingerprint; /* data file, seq, seed, split and shuffle; seek checks it */
} td_loader_position;

typedef struct td_loader td_loader;
/* Opens (and validates) a token file and makes a loader over it.  Errors
 * name the file: too few tokens for one sequence, a row file read with
 * another sequence length, no held-out sequences when the held-out split is
 * asked for, bad parameters. */
td_status td_loader_open(const char *path, const td_loader_params *p, td_loader **out);
/* The same over an open file, which must outlive the loader. */
td_status td_loader_create(const td_tokfile *file, const td_loader_params *p, td_loader **out);
void td_loader_destroy(td_loader *l); /* NULL is a no-op */

const td_tokfile *td_loader_file(const td_loader *l);
uint64_t td_loader_sequences(const td_loader *l);      /* in this split */
uint64_t td_loader_first_sequence(const td_loader *l); /* index in the file of this split's first */
/* The next batch: inputs and targets are (B, T) row-major; targets[b][t] =
 * inputs[b][t + 1] within a sequence, and the last target is the sequence's
 * token T.  Advances the position by B sequences (N B with N ranks: this
 * rank's slice of the global batch). */
td_status td_loader_next(td_loader *l, int32_t *inputs, int32_t *targets, int32_t *positions);
/* The sequence (index in the file, from td_loader_first_sequence on) at
 * position `index` of epoch `epoch` (index < td_loader_sequences). */
uint64_t td_loader_sequence_at(const td_loader *l, uint64_t epoch, uint64_t index);

void td_loader_tell(const td_loader *l, td_loader_position *pos);
/* Continues from a saved position.  TD_ERR_INVALID when the position was
 * saved for other data or settings (fingerprint) or is out of range. */
td_status td_loader_seek(td_loader *l, const td_loader_position *pos);

#ifdef __cplusplus
}
#endif
#endif
