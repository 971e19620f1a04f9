/* Chunk access traces: in-memory trace, text parser and writer (see
 * include/tidal/trace.h).  The parser is hand-written (no sscanf) so that a
 * trace of millions of accesses loads in a fraction of a second, and strict
 * so that any malformed line is an error naming file:line, never a guess. */
#include "tidal/trace.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "tidal/alloc.h"

struct td_trace {
    char *name;
    uint64_t *chunk_bytes;   /* [n_chunks] */
    uint32_t *chunk_line;    /* [n_chunks] */
    uint32_t n_chunks, chunk_cap;
    td_trace_event *events;
    size_t n_events, event_cap;
    size_t n_access, n_step;
    size_t period_start;     /* see td_trace_period_start */
    int step_pending;        /* a step line with no access after it yet */
};

static const char *trace_name(const td_trace *t) { return t && t->name ? t->name : "<trace>"; }

/* Every message names the source ("name:line: ") so a user can go to it. */
#define LOC_FMT "%s:%u: "
#define LOC(t, line) trace_name(t), (unsigned)(line)

td_status td_trace_create(const char *name, td_trace **out)
{
    *out = NULL;
    td_trace *t = td_calloc(1, sizeof *t, TD_ROLE_META);
    if (!t) return td_error_prefix(TD_ERR_NOMEM, "trace: ");
    if (name && !(t->name = td_strdup(name, TD_ROLE_META))) {
        td_free(t);
        return td_error_prefix(TD_ERR_NOMEM, "trace: ");
    }
    *out = t;
    return TD_OK;
}

void td_trace_destroy(td_trace *t)
{
    if (!t) return;
    td_free(t->name);
    td_free(t->chunk_bytes);
    td_free(t->chunk_line);
    td_free(t->events);
    td_free(t);
}

/* Grows *arr (elem bytes each) to hold at least `need` elements: doubling, so
 * appends are amortized O(1).  On failure *arr is untouched. */
static td_status grow(void **arr, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return TD_OK;
    size_t n = *cap ? *cap : 64;
    while (n < need) n *= 2;
    void *p = td_malloc(n * elem, TD_ROLE_META);
    if (!p) return td_error_prefix(TD_ERR_NOMEM, "trace: ");
    if (*cap) memcpy(p, *arr, *cap * elem);
    td_free(*arr);
    *arr = p;
    *cap = n;
    return TD_OK;
}

td_status td_trace_add_chunk(td_trace *t, uint32_t id, uint64_t bytes, uint32_t line)
{
    if (id < t->n_chunks) {
        if (t->chunk_line[id])
            return td_error_set(TD_ERR_INVALID, LOC_FMT "chunk %u is already declared at line %u",
                                LOC(t, line), id, t->chunk_line[id]);
        return td_error_set(TD_ERR_INVALID, LOC_FMT "chunk %u is already declared", LOC(t, line), id);
    }
    if (id != t->n_chunks)
        return td_error_set(TD_ERR_INVALID, LOC_FMT "chunk id %u is out of order: the next chunk must be %u "
                            "(ids are 0..N-1 in declaration order)", LOC(t, line), id, t->n_chunks);
    if (id >= TD_TRACE_MAX_CHUNKS)
        return td_error_set(TD_ERR_INVALID, LOC_FMT "too many chunks (at most %u)", LOC(t, line),
                            TD_TRACE_MAX_CHUNKS);
    if (bytes == 0)
        return td_error_set(TD_ERR_INVALID, LOC_FMT "chunk %u has 0 bytes; a chunk holds at least one byte",
                            LOC(t, line), id);
    size_t cap = t->chunk_cap;
    td_status st = grow((void **)&t->chunk_bytes, &cap, (size_t)id + 1, sizeof *t->chunk_bytes);
    if (st != TD_OK) return st;
    cap = t->chunk_cap;
    st = grow((void **)&t->chunk_line, &cap, (size_t)id + 1, sizeof *t->chunk_line);
    if (st != TD_OK) return st;  /* chunk_bytes grew; harmless, chunk_cap still bounds both */
    t->chunk_cap = (uint32_t)cap;
    t->chunk_bytes[id] = bytes;
    t->chunk_line[id] = line;
    t->n_chunks = id + 1;
    return TD_OK;
}

static td_status push_event(td_trace *t, td_trace_event ev)
{
    if (t->n_events >= TD_TRACE_MAX_EVENTS)
        return td_error_set(TD_ERR_INVALID, LOC_FMT "too many events (at most %zu)",
                            LOC(t, ev.line), (size_t)TD_TRACE_MAX_EVENTS);
    td_status st = grow((void **)&t->events, &t->event_cap, t->n_events + 1, sizeof *t->events);
    if (st != TD_OK) return st;
    t->events[t->n_events++] = ev;
    return TD_OK;
}

td_status td_trace_add_step(td_trace *t, uint32_t line)
{
    td_trace_event ev = { .line = line, .kind = TD_TRACE_STEP };
    td_status st = push_event(t, ev);
    if (st != TD_OK) return st;
    t->n_step++;
    t->step_pending = 1;
    return TD_OK;
}

td_status td_trace_add_access(td_trace *t, uint32_t chunk, int write, uint32_t line)
{
    if (chunk >= t->n_chunks)
        return td_error_set(TD_ERR_INVALID, LOC_FMT "access to undeclared chunk %u (%u declared so far); "
                            "declare 'chunk %u <bytes>' before its first access",
                            LOC(t, line), chunk, t->n_chunks, chunk);
    td_trace_event ev = { .chunk = chunk, .line = line, .kind = TD_TRACE_ACCESS, .write = write ? 1 : 0 };
    td_status st = push_event(t, ev);
    if (st != TD_OK) return st;
    if (t->step_pending) {
        t->period_start = t->n_access;
        t->step_pending = 0;
    }
    t->n_access++;
    return TD_OK;
}

td_status td_trace_add_nonmodel(td_trace *t, uint64_t bytes, uint32_t line)
{
    td_trace_event ev = { .nonmodel_bytes = bytes, .line = line, .kind = TD_TRACE_NONMODEL };
    return push_event(t, ev);
}

/* ---- parser ------------------------------------------------------------- */

typedef struct parser {
    td_trace *t;
    int have_header;
} parser;

/* A token for a message: at most 40 characters, non-printable bytes as '?',
 * so garbage input cannot garble the terminal. */
static const char *show(const char *tok, size_t len, char buf[48])
{
    size_t n = len < 40 ? len : 40;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)tok[i];
        buf[i] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    if (len > n) { buf[n++] = '.'; buf[n++] = '.'; buf[n++] = '.'; }
    buf[n] = '\0';
    return buf;
}

typedef struct token { const char *s; size_t len; } token;

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f'; }

/* Splits a line (comment removed) into at most `max` tokens; returns how many
 * there are (may exceed max, then only max are stored). */
static int tokenize(const char *s, size_t len, token *tok, int max)
{
    int n = 0;
    size_t i = 0;
    while (i < len) {
        while (i < len && is_space(s[i])) i++;
        if (i >= len) break;
        size_t b = i;
        while (i < len && !is_space(s[i])) i++;
        if (n < max) tok[n] = (token){ s + b, i - b };
        n++;
    }
    return n;
}

static int tok_is(token t, const char *word)
{
    size_t n = strlen(word);
    return t.len == n && memcmp(t.s, word, n) == 0;
}

/* Plain decimal, no sign, no unit, no overflow. */
static td_status parse_u64(const parser *p, uint32_t line, const char *what, token t, uint64_t max,
                           uint64_t *out)
{
    char buf[48];
    uint64_t v = 0;
    int overflow = 0;
    for (size_t i = 0; i < t.len; i++) {
        unsigned d = (unsigned)(unsigned char)t.s[i] - '0';
        if (d > 9)
            return td_error_set(TD_ERR_INVALID, LOC_FMT "%s '%s' is not a plain decimal number",
                                LOC(p->t, line), what, show(t.s, t.len, buf));
        if (v > (UINT64_MAX - d) / 10) overflow = 1;
        else v = v * 10 + d;
    }
    if (overflow || v > max)
        return td_error_set(TD_ERR_INVALID, LOC_FMT "%s %s is too large (at most %llu)", LOC(p->t, line),
                            what, show(t.s, t.len, buf), (unsigned long long)max);
    *out = v;
    return TD_OK;
}

static td_status arity(const parser *p, uint32_t line, int n, int want, const char *usage)
{
    if (n == want) return TD_OK;
    return td_error_set(TD_ERR_INVALID, LOC_FMT "'%.*s' takes %d argument%s, got %d (usage: %s)",
                        LOC(p->t, line), (int)strcspn(usage, " "), usage, want - 1, want == 2 ? "" : "s",
                        n - 1, usage);
}

static td_status parse_line(parser *p, const char *s, size_t len, uint32_t line)
{
    char buf[48];
    if (memchr(s, '\0', len))
        return td_error_set(TD_ERR_INVALID, LOC_FMT "line contains a NUL byte (is this a binary file?)",
                            LOC(p->t, line));
    const char *hash = memchr(s, '#', len);
    if (hash) len = (size_t)(hash - s);
    token tok[4];
    int n = tokenize(s, len, tok, 4);
    if (n == 0) return TD_OK;
    if (!p->have_header) {
        if (!tok_is(tok[0], "tidal-trace"))
            return td_error_set(TD_ERR_INVALID, LOC_FMT "expected the header 'tidal-trace 1' before '%s' "
                                "(is this a tidal trace?)", LOC(p->t, line), show(tok[0].s, tok[0].len, buf));
        if (n != 2 || !tok_is(tok[1], "1"))
            return td_error_set(TD_ERR_INVALID, LOC_FMT "unsupported trace header '%s' "
                                "(this tidal reads 'tidal-trace 1')", LOC(p->t, line), show(s, len, buf));
        p->have_header = 1;
        return TD_OK;
    }
    td_status st;
    uint64_t a, b;
    if (tok_is(tok[0], "access")) {
        if ((st = arity(p, line, n, 3, "access <id> r|w")) != TD_OK) return st;
        if ((st = parse_u64(p, line, "chunk id", tok[1], UINT32_MAX, &a)) != TD_OK) return st;
        int write = tok_is(tok[2], "w");
        if (!write && !tok_is(tok[2], "r"))
            return td_error_set(TD_ERR_INVALID, LOC_FMT "access mode '%s' must be r or w",
                                LOC(p->t, line), show(tok[2].s, tok[2].len, buf));
        return td_trace_add_access(p->t, (uint32_t)a, write, line);
    }
    if (tok_is(tok[0], "step")) {
        if ((st = arity(p, line, n, 1, "step")) != TD_OK) return st;
        return td_trace_add_step(p->t, line);
    }
    if (tok_is(tok[0], "nonmodel")) {
        if ((st = arity(p, line, n, 2, "nonmodel <bytes>")) != TD_OK) return st;
        if ((st = parse_u64(p, line, "non-model bytes", tok[1], UINT64_MAX, &a)) != TD_OK) return st;
        return td_trace_add_nonmodel(p->t, a, line);
    }
    if (tok_is(tok[0], "chunk")) {
        if ((st = arity(p, line, n, 3, "chunk <id> <bytes>")) != TD_OK) return st;
        if ((st = parse_u64(p, line, "chunk id", tok[1], UINT32_MAX, &a)) != TD_OK) return st;
        if ((st = parse_u64(p, line, "chunk bytes", tok[2], UINT64_MAX, &b)) != TD_OK) return st;
        return td_trace_add_chunk(p->t, (uint32_t)a, b, line);
    }
    if (tok_is(tok[0], "tidal-trace"))
        return td_error_set(TD_ERR_INVALID, LOC_FMT "a second header; a trace file holds one trace",
                            LOC(p->t, line));
    return td_error_set(TD_ERR_INVALID, LOC_FMT "unknown keyword '%s'; expected chunk, step, access or nonmodel",
                        LOC(p->t, line), show(tok[0].s, tok[0].len, buf));
}

static td_status parse_finish(parser *p, td_trace **out)
{
    if (!p->have_header)
        return td_error_set(TD_ERR_INVALID, "%s: missing the header line 'tidal-trace 1' (empty trace?)",
                            trace_name(p->t));
    *out = p->t;
    p->t = NULL;
    return TD_OK;
}

static td_status next_line_number(const parser *p, uint32_t *line)
{
    if (*line == UINT32_MAX)
        return td_error_set(TD_ERR_INVALID, "%s: more than %u lines", trace_name(p->t), UINT32_MAX - 1);
    (*line)++;
    return TD_OK;
}

td_status td_trace_parse(const char *text, size_t len, const char *name, td_trace **out)
{
    td_status st = TD_OK;
    parser p = {0};
    uint32_t line = 0;
    *out = NULL;
    TD_TRY(td_trace_create(name, &p.t));
    size_t i = 0;
    while (i < len) {
        const char *nl = memchr(text + i, '\n', len - i);
        size_t end = nl ? (size_t)(nl - text) : len;
        TD_TRY(next_line_number(&p, &line));
        TD_TRY(parse_line(&p, text + i, end - i, line));
        i = end + 1;
    }
    TD_TRY(parse_finish(&p, out));
cleanup:
    td_trace_destroy(p.t);
    return st;
}

td_status td_trace_read(FILE *f, const char *name, td_trace **out)
{
    td_status st = TD_OK;
    parser p = {0};
    uint32_t line = 0;
    char *buf = NULL;
    size_t cap = 0;
    *out = NULL;
    TD_TRY(td_trace_create(name, &p.t));
    for (;;) {
        errno = 0;
        ssize_t n = getline(&buf, &cap, f);
        if (n < 0) {
            if (ferror(f))
                TD_FAIL(TD_ERR_IO, "%s: read failed after line %u: %s", trace_name(p.t), line,
                        strerror(errno ? errno : EIO));
            break;
        }
        if (n > 0 && buf[n - 1] == '\n') n--;
        TD_TRY(next_line_number(&p, &line));
        TD_TRY(parse_line(&p, buf, (size_t)n, line));
    }
    TD_TRY(parse_finish(&p, out));
cleanup:
    free(buf); /* getline's buffer comes from malloc */
    td_trace_destroy(p.t);
    return st;
}

td_status td_trace_load(const char *path, td_trace **out)
{
    *out = NULL;
    if (!strcmp(path, "-")) return td_trace_read(stdin, "<stdin>", out);
    FILE *f = fopen(path, "r");
    if (!f)
        return td_error_set(TD_ERR_IO, "cannot open trace '%s': %s", path, strerror(errno));
    td_status st = td_trace_read(f, path, out);
    fclose(f);
    return st;
}

/* ---- accessors ---------------------------------------------------------- */

const char *td_trace_name(const td_trace *t) { return trace_name(t); }
uint32_t td_trace_chunk_count(const td_trace *t) { return t->n_chunks; }
uint64_t td_trace_chunk_bytes(const td_trace *t, uint32_t id) { return id < t->n_chunks ? t->chunk_bytes[id] : 0; }
uint32_t td_trace_chunk_line(const td_trace *t, uint32_t id) { return id < t->n_chunks ? t->chunk_line[id] : 0; }
const uint64_t *td_trace_chunk_sizes(const td_trace *t) { return t->chunk_bytes; }
size_t td_trace_event_count(const td_trace *t) { return t->n_events; }
const td_trace_event *td_trace_events(const td_trace *t) { return t->events; }
size_t td_trace_access_count(const td_trace *t) { return t->n_access; }
size_t td_trace_step_count(const td_trace *t) { return t->n_step; }
size_t td_trace_period_start(const td_trace *t) { return t->period_start; }

int td_trace_uniform_sizes(const td_trace *t)
{
    for (uint32_t i = 1; i < t->n_chunks; i++)
        if (t->chunk_bytes[i] != t->chunk_bytes[0]) return 0;
    return 1;
}

td_status td_trace_access_sequence(const td_trace *t, uint32_t **seq_out, size_t *n_out)
{
    *seq_out = NULL;
    *n_out = 0;
    uint32_t *seq = td_malloc((t->n_access ? t->n_access : 1) * sizeof *seq, TD_ROLE_META);
    if (!seq) return td_error_prefix(TD_ERR_NOMEM, "trace access sequence: ");
    size_t k = 0;
    for (size_t i = 0; i < t->n_events; i++)
        if (t->events[i].kind == TD_TRACE_ACCESS) seq[k++] = t->events[i].chunk;
    *seq_out = seq;
    *n_out = k;
    return TD_OK;
}

int td_trace_equal(const td_trace *a, const td_trace *b)
{
    if (a->n_chunks != b->n_chunks || a->n_events != b->n_events) return 0;
    if (a->n_chunks && memcmp(a->chunk_bytes, b->chunk_bytes, a->n_chunks * sizeof *a->chunk_bytes)) return 0;
    for (size_t i = 0; i < a->n_events; i++) {
        const td_trace_event *x = &a->events[i], *y = &b->events[i];
        if (x->kind != y->kind) return 0;
        if (x->kind == TD_TRACE_ACCESS && (x->chunk != y->chunk || x->write != y->write)) return 0;
        if (x->kind == TD_TRACE_NONMODEL && x->nonmodel_bytes != y->nonmodel_bytes) return 0;
    }
    return 1;
}

/* ---- writer ------------------------------------------------------------- */

struct td_trace_writer {
    FILE *f;
    int owns_file;
    char *path;
    uint32_t n_chunks;  /* declared so far: the same rules as the parser */
    int failed_errno;   /* first write error, reported by close */
};

static td_status writer_new(FILE *f, int owns, const char *path, td_trace_writer **out)
{
    td_trace_writer *w = td_calloc(1, sizeof *w, TD_ROLE_META);
    if (!w) return td_error_prefix(TD_ERR_NOMEM, "trace writer: ");
    if (!(w->path = td_strdup(path, TD_ROLE_META))) {
        td_free(w);
        return td_error_prefix(TD_ERR_NOMEM, "trace writer: ");
    }
    w->f = f;
    w->owns_file = owns;
    if (fprintf(f, "tidal-trace %d\n", TD_TRACE_VERSION) < 0) w->failed_errno = errno ? errno : EIO;
    *out = w;
    return TD_OK;
}

td_status td_trace_writer_open(const char *path, td_trace_writer **out)
{
    *out = NULL;
    FILE *f = fopen(path, "w");
    if (!f)
        return td_error_set(TD_ERR_IO, "cannot create trace file '%s': %s (check the directory exists "
                            "and is writable)", path, strerror(errno));
    td_status st = writer_new(f, 1, path, out);
    if (st != TD_OK) fclose(f);
    return st;
}

td_status td_trace_writer_open_stream(FILE *f, td_trace_writer **out)
{
    *out = NULL;
    return writer_new(f, 0, "<stream>", out);
}

static td_status writer_check(td_trace_writer *w, int rc)
{
    if (rc < 0 && !w->failed_errno) w->failed_errno = errno ? errno : EIO;
    if (w->failed_errno)
        return td_error_set(TD_ERR_IO, "writing trace '%s' failed: %s (disk full?)", w->path,
                            strerror(w->failed_errno));
    return TD_OK;
}

td_status td_trace_writer_comment(td_trace_writer *w, const char *text)
{
    const char *s = text;
    do {
        const char *nl = strchr(s, '\n');
        int n = nl ? (int)(nl - s) : (int)strlen(s);
        td_status st = writer_check(w, fprintf(w->f, "# %.*s\n", n, s));
        if (st != TD_OK) return st;
        s = nl ? nl + 1 : NULL;
    } while (s && *s);
    return TD_OK;
}

td_status td_trace_writer_chunk(td_trace_writer *w, uint32_t id, uint64_t bytes)
{
    if (id != w->n_chunks)
        return td_error_set(TD_ERR_INVALID, "trace writer '%s': chunk id %u out of order; the next chunk "
                            "must be %u (ids are 0..N-1 in declaration order)", w->path, id, w->n_chunks);
    if (id >= TD_TRACE_MAX_CHUNKS)
        return td_error_set(TD_ERR_INVALID, "trace writer '%s': too many chunks (at most %u)", w->path,
                            TD_TRACE_MAX_CHUNKS);
    if (bytes == 0)
        return td_error_set(TD_ERR_INVALID, "trace writer '%s': chunk %u has 0 bytes", w->path, id);
    td_status st = writer_check(w, fprintf(w->f, "chunk %u %llu\n", id, (unsigned long long)bytes));
    if (st == TD_OK) w->n_chunks++;
    return st;
}

td_status td_trace_writer_step(td_trace_writer *w)
{
    return writer_check(w, fputs("step\n", w->f));
}

td_status td_trace_writer_access(td_trace_writer *w, uint32_t chunk, int write)
{
    if (chunk >= w->n_chunks)
        return td_error_set(TD_ERR_INVALID, "trace writer '%s': access to undeclared chunk %u (%u declared); "
                            "declare chunks before their first access", w->path, chunk, w->n_chunks);
    return writer_check(w, fprintf(w->f, "access %u %c\n", chunk, write ? 'w' : 'r'));
}

td_status td_trace_writer_nonmodel(td_trace_writer *w, uint64_t bytes)
{
    return writer_check(w, fprintf(w->f, "nonmodel %llu\n", (unsigned long long)bytes));
}

td_status td_trace_writer_close(td_trace_writer *w)
{
    if (!w) return TD_OK;
    int rc = fflush(w->f);
    if (rc == 0 && ferror(w->f)) { rc = -1; errno = EIO; }
    if (w->owns_file && fclose(w->f) != 0) rc = -1;
    td_status st = writer_check(w, rc);
    td_free(w->path);
    td_free(w);
    return st;
}

td_status td_trace_write(const td_trace *t, FILE *f)
{
    td_status st = TD_OK;
    td_trace_writer *w = NULL;
    TD_TRY(td_trace_writer_open_stream(f, &w));
    for (uint32_t i = 0; i < t->n_chunks; i++) TD_TRY(td_trace_writer_chunk(w, i, t->chunk_bytes[i]));
    for (size_t i = 0; i < t->n_events; i++) {
        const td_trace_event *e = &t->events[i];
        if (e->kind == TD_TRACE_ACCESS) TD_TRY(td_trace_writer_access(w, e->chunk, e->write));
        else if (e->kind == TD_TRACE_STEP) TD_TRY(td_trace_writer_step(w));
        else TD_TRY(td_trace_writer_nonmodel(w, e->nonmodel_bytes));
    }
cleanup:
    if (w) {
        td_status cst = td_trace_writer_close(w);
        if (st == TD_OK) st = cst;
    }
    return st;
}

td_status td_trace_save(const td_trace *t, const char *path)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return td_error_set(TD_ERR_IO, "cannot create trace file '%s': %s", path, strerror(errno));
    td_status st = td_trace_write(t, f);
    if (fclose(f) != 0 && st == TD_OK)
        st = td_error_set(TD_ERR_IO, "writing trace '%s' failed: %s", path, strerror(errno));
    if (st != TD_OK) td_error_prefix(st, "saving trace '%s': ", path);
    return st;
}
