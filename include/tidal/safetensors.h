/* safetensors files: a validating reader and a streaming, atomic writer.
 *
 * The format (https://huggingface.co/docs/safetensors): an 8-byte
 * little-endian header length N, N bytes of JSON
 *     {"__metadata__": {"key": "value", ...},
 *      "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
 * then the data; offsets are relative to the first byte after the header.
 *
 * Reader: td_st_open validates the whole header before returning (header
 * length against the file size, JSON well-formed, known dtypes, shape product
 * times dtype size equal to end - begin, offsets inside the data, no overlaps,
 * no holes, no duplicate names, metadata values strings), and every violation
 * is an error naming the file and the tensor.  Tensor bytes are read with
 * pread into the caller's buffer, converting between F32, BF16 and F16 when
 * asked (to the 16-bit formats: round to nearest, ties to even); the file is
 * never copied whole into memory.
 *
 * Writer: streaming.  Declare every tensor (name, dtype, shape) and metadata
 * first; the first write emits the header; then supply each tensor's bytes in
 * pieces, tensors in declaration order, pieces appended.  Memory use is one
 * 1 MiB staging buffer whatever the file size.  The file is written to
 * `<path>.tmp.<pid>`, fsync'd, renamed over `<path>`, and the directory is
 * fsync'd; on any error (or td_st_writer_abort) the temporary file is removed
 * and a previous `<path>` stays as it was.  Written headers put
 * `__metadata__` first and tensors in declaration order, and are padded with
 * spaces so the data starts 8-byte aligned (as Hugging Face's writer does).
 *
 * Ownership: a reader owns its descriptor and its tables; td_st_tensor
 * pointers and strings it returns live until td_st_close.  A writer owns its
 * temporary file until commit or abort, which both free the writer.
 * Thread-safety: an open reader is immutable, so any number of threads may
 * look up and read through one reader at once.  A writer must be used by one
 * thread at a time. */
#ifndef TIDAL_SAFETENSORS_H
#define TIDAL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of the format (whole-byte types only). */
typedef enum td_st_dtype {
    TD_ST_BOOL,
    TD_ST_U8,
    TD_ST_I8,
    TD_ST_F8_E5M2,
    TD_ST_F8_E4M3,
    TD_ST_I16,
    TD_ST_U16,
    TD_ST_F16,
    TD_ST_BF16,
    TD_ST_I32,
    TD_ST_U32,
    TD_ST_F32,
    TD_ST_F64,
    TD_ST_I64,
    TD_ST_U64,
    TD_ST_DTYPE_COUNT
} td_st_dtype;

const char *td_st_dtype_name(td_st_dtype dt);                    /* "F32", "BF16", ... */
size_t td_st_dtype_bytes(td_st_dtype dt);                        /* 0 for an unknown value */
/* The format's spelling ("F32", "BF16", ...); TD_ERR_INVALID listing the known ones. */
td_status td_st_dtype_parse(const char *name, td_st_dtype *out);
/* 1 when td_st_read / td_st_writer_write_convert can convert from `a` to `b`:
 * a == b, or both among F32, BF16, F16. */
int td_st_dtype_convertible(td_st_dtype a, td_st_dtype b);

#define TD_ST_MAX_DIMS 8
/* Largest header accepted (Hugging Face's reader uses the same bound). */
#define TD_ST_MAX_HEADER_BYTES ((uint64_t)100000000)

typedef struct td_st_tensor {
    const char *name;
    td_st_dtype dtype;
    int ndim;                        /* 0 (a scalar) .. TD_ST_MAX_DIMS */
    uint64_t shape[TD_ST_MAX_DIMS];
    uint64_t numel;                  /* product of the shape (1 for a scalar) */
    uint64_t bytes;                  /* numel * dtype size */
    uint64_t file_offset;            /* absolute offset of the first byte in the file */
} td_st_tensor;

/* --- reader --------------------------------------------------------------- */

typedef struct td_st_reader td_st_reader;

/* Opens and validates `path`.  TD_ERR_IO if it cannot be opened or read,
 * TD_ERR_INVALID (naming the file and the tensor) if it is not a valid
 * safetensors file. */
td_status td_st_open(const char *path, td_st_reader **out);
void td_st_close(td_st_reader *r); /* NULL is a no-op */

const char *td_st_path(const td_st_reader *r);
uint64_t td_st_file_bytes(const td_st_reader *r);
/* Tensors in file order (ascending offsets), index 0 .. count-1. */
size_t td_st_tensor_count(const td_st_reader *r);
const td_st_tensor *td_st_tensor_at(const td_st_reader *r, size_t index);
/* By name (binary search); NULL if absent. */
const td_st_tensor *td_st_find(const td_st_reader *r, const char *name);
/* Like td_st_find, but a missing tensor is TD_ERR_INVALID naming the file. */
td_status td_st_get(const td_st_reader *r, const char *name, const td_st_tensor **out);

/* __metadata__ entries in file order; td_st_metadata returns NULL if absent. */
size_t td_st_metadata_count(const td_st_reader *r);
void td_st_metadata_at(const td_st_reader *r, size_t index, const char **key, const char **value);
const char *td_st_metadata(const td_st_reader *r, const char *key);

/* Raw bytes [byte_offset, byte_offset + n_bytes) of tensor t into dst. */
td_status td_st_read_bytes(const td_st_reader *r, const td_st_tensor *t, uint64_t byte_offset,
                           size_t n_bytes, void *dst);
/* Elements [elem_offset, elem_offset + n_elems) of t into dst as dst_dtype
 * (see td_st_dtype_convertible).  Tensor `t` must come from this reader. */
td_status td_st_read(const td_st_reader *r, const td_st_tensor *t, uint64_t elem_offset,
                     size_t n_elems, td_st_dtype dst_dtype, void *dst);

/* --- writer --------------------------------------------------------------- */

typedef struct td_st_writer td_st_writer;

/* A writer for `path`; nothing touches the disk before the first write (or
 * td_st_writer_begin). */
td_status td_st_writer_create(const char *path, td_st_writer **out);
/* Before the header is emitted.  Keys unique, not empty. */
td_status td_st_writer_add_metadata(td_st_writer *w, const char *key, const char *value);
/* Before the header is emitted.  Names unique, not empty, not "__metadata__".
 * *index_out (may be NULL) receives the tensor's index, 0, 1, 2, ... */
td_status td_st_writer_declare(td_st_writer *w, const char *name, td_st_dtype dtype, int ndim,
                               const uint64_t *shape, size_t *index_out);
/* Creates the temporary file and writes the header (the first write does it
 * when not called).  Declarations are closed from here on. */
td_status td_st_writer_begin(td_st_writer *w);
/* Appends n_bytes to tensor `index`, which must be the tensor being filled
 * (td_st_writer_next): tensors fill in declaration order, and a piece may not
 * run past its tensor's end. */
td_status td_st_writer_write(td_st_writer *w, size_t index, const void *bytes, size_t n_bytes);
/* The same with n_elems elements of src_dtype converted to the tensor's dtype
 * (td_st_dtype_convertible); the tensor's filled bytes must be at an element
 * boundary. */
td_status td_st_writer_write_convert(td_st_writer *w, size_t index, td_st_dtype src_dtype,
                                     const void *src, size_t n_elems);
/* Index of the tensor the next bytes go to; the tensor count when all are full. */
size_t td_st_writer_next(const td_st_writer *w);
/* Checks every tensor is complete, then flushes, fsyncs, renames over the
 * final path and fsyncs its directory.  Frees w whatever the outcome; on
 * failure the temporary file is gone and the final path untouched. */
td_status td_st_writer_commit(td_st_writer *w);
/* Removes the temporary file and frees w (NULL is a no-op). */
void td_st_writer_abort(td_st_writer *w);

/* --- positional writing: several processes filling one file ---------------
 * Each process creates a writer for the same final path and declares the
 * same metadata and tensors; td_st_writer_begin_shared computes the header
 * (the same bytes in every process: compare *header_hash) and, with
 * create = 1 (one process, first), creates the file there directly, writes
 * the header and sizes the file; the others open it (create = 0) once it
 * exists.  Each then pwrite()s its byte ranges in any order, and
 * td_st_writer_finish_shared fsyncs and closes.  No temporary file: the
 * caller writes into a temporary directory and publishes it (checkpoint.h).
 * The streaming calls are closed in this mode; ranges of different
 * processes must not overlap, and together cover every tensor. */
td_status td_st_writer_begin_shared(td_st_writer *w, int create, uint64_t *header_hash);
/* n_bytes at byte_offset of tensor `index`. */
td_status td_st_writer_pwrite(td_st_writer *w, size_t index, uint64_t byte_offset, const void *bytes, size_t n_bytes);
/* n_elems of src_dtype converted to the tensor's dtype, at element elem_offset. */
td_status td_st_writer_pwrite_convert(td_st_writer *w, size_t index, uint64_t elem_offset, td_st_dtype src_dtype,
                                      const void *src, size_t n_elems);
/* Bytes this writer has put (its share), and the data bytes of the whole file. */
uint64_t td_st_writer_written(const td_st_writer *w);
uint64_t td_st_writer_data_bytes(const td_st_writer *w);
/* fsync and close; frees w whatever the outcome.  Abort also works. */
td_status td_st_writer_finish_shared(td_st_writer *w);

/* --- file helpers shared with the checkpoint module ----------------------- */

/* fsync of the directory holding `path` (its parent), so that a rename or a
 * new entry there is durable. */
td_status td_fsync_parent_dir(const char *path);
/* Writes `bytes` to `path` atomically: `<path>.tmp.<pid>`, fsync, rename,
 * fsync of the directory; on failure the temporary file is removed. */
td_status td_write_file_atomic(const char *path, const void *bytes, size_t n_bytes);

#ifdef __cplusplus
}
#endif
#endif
