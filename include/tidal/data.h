/* Training data: the token file format, its writer and reader, and the
 * batch loader the trainer draws from.
 *
 * Token file, version 1 (little-endian; docs/data.md has the full story):
 *
 *     offset  size  field
 *          0     8  magic "TDTOKENS"
 *          8     4  version (1)
 *         12     4  header bytes (64)
 *         16     4  token bytes: 2 (uint16) when vocab size <= 65536, else 4 (uint32)
 *         20     4  tokenizer kind (1 byte, 2 gpt2, 3 json; td_tokenizer_kind)
 *         24     4  vocab size (every token id is below it)
 *         28     4  end-of-text id
 *         32     8  token count
 *         40     4  CRC-32 of the token payload (zlib's CRC-32, as Python's zlib.crc32)
 *         44    16  reserved, zero
 *         60     4  CRC-32 of header bytes [0, 60)
 *         64        token count x token bytes of token ids
 *
 * Sequences: a file of N tokens holds S = (N - 1) / T sequences of T + 1
 * tokens; sequence s reads tokens [s T, s T + T] (consecutive sequences share
 * one token, so every token but the first is a target exactly once).  A
 * held-out split takes the last sequences (heldout_percent of S, at least
 * one); the training split the rest.
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
#define TD_TOKFILE_VERSION 1
#define TD_TOKFILE_HEADER_BYTES 64

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
/* Appends ids (each must be below vocab size: TD_ERR_INVALID otherwise). */
td_status td_tokfile_writer_append(td_tokfile_writer *w, const uint32_t *ids, size_t n);
uint64_t td_tokfile_writer_count(const td_tokfile_writer *w);
td_status td_tokfile_writer_commit(td_tokfile_writer *w);
void td_tokfile_writer_abort(td_tokfile_writer *w); /* NULL is a no-op */

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

/* ---- the loader ---------------------------------------------------------- */

typedef enum td_data_split {
    TD_DATA_TRAIN,   /* the first sequences */
    TD_DATA_HELDOUT, /* the last heldout_percent of them (for tidal eval) */
} td_data_split;

typedef struct td_loader_params {
    uint32_t batch;         /* B: sequences per batch (>= 1) */
    uint32_t seq;           /* T: inputs per sequence (>= 1); each reads T + 1 tokens */
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
 * name the file: too few tokens for one sequence, no held-out sequences
 * when the held-out split is asked for, bad parameters. */
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
td_status td_loader_next(td_loader *l, int32_t *inputs, int32_t *targets);
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
