/* Chunk access traces: the text format (version 1), an in-memory trace, the
 * parser and the writer.
 *
 * A trace is what the warm-up tracer records from a real step and what
 * `tidal memsim` replays offline: which chunks exist and how big they are,
 * where training steps start, every chunk access in order (read or write),
 * and the non-model device bytes (activations, workspaces) live at each
 * moment.  The format, one item per line, `#` starts a comment:
 *
 *     tidal-trace 1
 *     chunk <id> <bytes>      ids 0, 1, 2, ... in declaration order, bytes > 0
 *     step                    start of a training step
 *     access <id> r|w         w: the access leaves the device copy dirty
 *     nonmodel <bytes>        non-model bytes live from here on (default 0)
 *
 * Numbers are plain decimal.  Blank lines and comments may appear anywhere,
 * also before the header; a chunk must be declared before its first access.
 * The parser and the writer enforce the same rules, so whatever the writer
 * produces parses, and parse(write(t)) == t (line numbers aside).
 *
 * Ownership: a td_trace owns its arrays (accounted as TD_ROLE_META); events
 * returned by td_trace_events stay valid until the next td_trace_add_* call
 * or td_trace_destroy.  A td_trace_writer owns its FILE unless it was opened
 * on a caller's stream.
 * Thread-safety: distinct objects may be used from different threads; one
 * object must not be used from two threads at once. */
#ifndef TIDAL_TRACE_H
#define TIDAL_TRACE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TD_TRACE_VERSION 1
/* Limits that keep garbage input from asking for absurd allocations. */
#define TD_TRACE_MAX_CHUNKS (1u << 24)
#define TD_TRACE_MAX_EVENTS ((size_t)UINT32_MAX - 1)

typedef enum td_trace_kind {
    TD_TRACE_ACCESS,   /* chunk, write */
    TD_TRACE_STEP,
    TD_TRACE_NONMODEL, /* nonmodel_bytes */
} td_trace_kind;

/* One event, 16 bytes (traces of many millions of accesses stay small). */
typedef struct td_trace_event {
    union {
        uint32_t chunk;          /* TD_TRACE_ACCESS */
        uint64_t nonmodel_bytes; /* TD_TRACE_NONMODEL */
    };
    uint32_t line;  /* 1-based line in the source; 0 when built in memory */
    uint8_t kind;   /* td_trace_kind */
    uint8_t write;  /* TD_TRACE_ACCESS: 1 for w */
} td_trace_event;

typedef struct td_trace td_trace;

/* An empty trace; `name` (copied, may be NULL) prefixes error messages as
 * "name:line:".  Build it with the td_trace_add_* calls below. */
td_status td_trace_create(const char *name, td_trace **out);
void td_trace_destroy(td_trace *t); /* NULL is a no-op */

/* Builders.  `line` is the source line for messages (0: none).  They apply
 * the format's rules: td_trace_add_chunk takes the next id only (the id is
 * checked against the number already declared) and bytes > 0; an access names
 * a declared chunk.  On error the trace is unchanged. */
td_status td_trace_add_chunk(td_trace *t, uint32_t id, uint64_t bytes, uint32_t line);
td_status td_trace_add_step(td_trace *t, uint32_t line);
td_status td_trace_add_access(td_trace *t, uint32_t chunk, int write, uint32_t line);
td_status td_trace_add_nonmodel(td_trace *t, uint64_t bytes, uint32_t line);

/* Parsers.  Errors are TD_ERR_INVALID with "name:line: what is wrong"
 * (TD_ERR_IO when the file cannot be read, TD_ERR_NOMEM when memory runs
 * out); *out is NULL on error.  `path` "-" reads standard input. */
td_status td_trace_load(const char *path, td_trace **out);
td_status td_trace_read(FILE *f, const char *name, td_trace **out);
td_status td_trace_parse(const char *text, size_t len, const char *name, td_trace **out);

/* Writes `t` in the text format (no comments). */
td_status td_trace_save(const td_trace *t, const char *path);
td_status td_trace_write(const td_trace *t, FILE *f);

/* Accessors. */
const char *td_trace_name(const td_trace *t);
uint32_t td_trace_chunk_count(const td_trace *t);
uint64_t td_trace_chunk_bytes(const td_trace *t, uint32_t id); /* 0 for a bad id */
uint32_t td_trace_chunk_line(const td_trace *t, uint32_t id);  /* its declaration line */
const uint64_t *td_trace_chunk_sizes(const td_trace *t);       /* [chunk_count] */
size_t td_trace_event_count(const td_trace *t);
const td_trace_event *td_trace_events(const td_trace *t);
size_t td_trace_access_count(const td_trace *t);
size_t td_trace_step_count(const td_trace *t);
/* Number of accesses before the start of the period: the last step that
 * contains an access (0 when the trace has no such step).  After its last
 * access the trace is taken to repeat accesses [period_start, access_count)
 * forever; see policy.h and docs/memory-manager.md. */
size_t td_trace_period_start(const td_trace *t);
/* 1 if all chunks have the same size (Belady is then load-optimal). */
int td_trace_uniform_sizes(const td_trace *t);
/* The chunk id of every access in order, into a td_malloc'd array (caller
 * frees with td_free); *n_out = td_trace_access_count. */
td_status td_trace_access_sequence(const td_trace *t, uint32_t **seq_out, size_t *n_out);
/* 1 if both traces have the same chunks and the same events (lines ignored). */
int td_trace_equal(const td_trace *a, const td_trace *b);

/* The writer the live tracer uses (--trace-out).  It checks the same rules
 * as the parser as it goes, so a call that would produce an invalid trace
 * fails instead.  td_trace_writer_close flushes, reports any write error that
 * happened on the way, and frees the writer (also on error). */
typedef struct td_trace_writer td_trace_writer;
td_status td_trace_writer_open(const char *path, td_trace_writer **out);
/* Writes to a caller's stream, which close flushes but does not close. */
td_status td_trace_writer_open_stream(FILE *f, td_trace_writer **out);
/* One `# text` line per line of text (for provenance: model, budget, date). */
td_status td_trace_writer_comment(td_trace_writer *w, const char *text);
td_status td_trace_writer_chunk(td_trace_writer *w, uint32_t id, uint64_t bytes);
td_status td_trace_writer_step(td_trace_writer *w);
td_status td_trace_writer_access(td_trace_writer *w, uint32_t chunk, int write);
td_status td_trace_writer_nonmodel(td_trace_writer *w, uint64_t bytes);
td_status td_trace_writer_close(td_trace_writer *w); /* NULL is a no-op */

#ifdef __cplusplus
}
#endif
#endif
