/* Trace format (parser, writer), next-use tables and evictors.
 *
 * The parser: exact round trips (random traces, the corpus), every kind of
 * bad input is an error naming file:line, garbage and mutated files never
 * crash (run under ASan by `make test SANITIZE=address,undefined`), and
 * allocation failures leak nothing.  The policy objects: checked against
 * naive reimplementations on random inputs. */
#include "td_test.h"
#include "tidal/memsim.h"
#include "tidal/policy.h"
#include "tidal/trace.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* tests/data/traces, found from this file's path so any working directory
 * that make uses works. */
static const char *trace_dir(void)
{
    static char dir[512];
    if (!dir[0]) {
        const char *f = __FILE__;
        const char *slash = strrchr(f, '/');
        int n = slash ? (int)(slash - f) : 0;
        snprintf(dir, sizeof dir, "%.*s%sdata/traces", n, f, n ? "/" : "");
    }
    return dir;
}

/* Calls fn(path) for every *.trace file of the corpus; returns how many. */
static int for_each_corpus_trace(void (*fn)(const char *path, void *ctx), void *ctx)
{
    DIR *d = opendir(trace_dir());
    if (!d) fail_msg("cannot open the trace corpus %s", trace_dir());
    char *names[256];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 256) {
        size_t len = strlen(e->d_name);
        if (len > 6 && !strcmp(e->d_name + len - 6, ".trace")) names[n++] = strdup(e->d_name);
    }
    closedir(d);
    for (int i = 0; i < n; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", trace_dir(), names[i]);
        fn(path, ctx);
        free(names[i]);
    }
    return n;
}

static td_trace *parse_ok(const char *text)
{
    td_trace *t = NULL;
    TD_ASSERT_OK(td_trace_parse(text, strlen(text), "t", &t));
    return t;
}

/* ---- the format ---------------------------------------------------------- */

static void test_parse_example(void **state)
{
    const char *text =
        "# before the header\n"
        "\n"
        "tidal-trace 1   # version\n"
        "chunk 0 4096\n"
        "chunk 1 8192\r\n"          /* CRLF is fine */
        "\taccess 0 r\n"            /* an access before any step: a prologue */
        "step\n"
        "nonmodel 100\n"
        "access 1 w   # dirty\n"
        "chunk 2 1\n"
        "access 2 r\n"
        "step\n"
        "access 0 r\n"
        "step\n";                   /* empty last step: the period is the one before */
    td_trace *t = parse_ok(text);
    assert_int_equal(td_trace_chunk_count(t), 3);
    assert_int_equal(td_trace_chunk_bytes(t, 0), 4096);
    assert_int_equal(td_trace_chunk_bytes(t, 1), 8192);
    assert_int_equal(td_trace_chunk_bytes(t, 2), 1);
    assert_int_equal(td_trace_chunk_bytes(t, 3), 0);
    assert_int_equal(td_trace_chunk_line(t, 2), 10);
    assert_int_equal(td_trace_access_count(t), 4);
    assert_int_equal(td_trace_step_count(t), 3);
    assert_int_equal(td_trace_period_start(t), 3);
    assert_false(td_trace_uniform_sizes(t));
    assert_int_equal(td_trace_event_count(t), 8);
    const td_trace_event *ev = td_trace_events(t);
    assert_int_equal(ev[0].kind, TD_TRACE_ACCESS);
    assert_int_equal(ev[0].chunk, 0);
    assert_int_equal(ev[0].write, 0);
    assert_int_equal(ev[0].line, 6);
    assert_int_equal(ev[1].kind, TD_TRACE_STEP);
    assert_int_equal(ev[2].kind, TD_TRACE_NONMODEL);
    assert_int_equal(ev[2].nonmodel_bytes, 100);
    assert_int_equal(ev[3].kind, TD_TRACE_ACCESS);
    assert_int_equal(ev[3].chunk, 1);
    assert_int_equal(ev[3].write, 1);
    assert_int_equal(ev[3].line, 9);
    assert_int_equal(ev[7].kind, TD_TRACE_STEP);
    uint32_t *seq;
    size_t n;
    TD_ASSERT_OK(td_trace_access_sequence(t, &seq, &n));
    assert_int_equal(n, 4);
    assert_int_equal(seq[0], 0);
    assert_int_equal(seq[1], 1);
    assert_int_equal(seq[2], 2);
    assert_int_equal(seq[3], 0);
    td_free(seq);
    td_trace_destroy(t);

    /* No step line: the whole trace is the period; a header alone is a valid empty trace. */
    t = parse_ok("tidal-trace 1\nchunk 0 5\naccess 0 r\naccess 0 w\n");
    assert_int_equal(td_trace_period_start(t), 0);
    assert_true(td_trace_uniform_sizes(t));
    td_trace_destroy(t);
    t = parse_ok("tidal-trace 1");
    assert_int_equal(td_trace_event_count(t), 0);
    assert_int_equal(td_trace_chunk_count(t), 0);
    td_trace_destroy(t);
}

typedef struct bad_case { const char *text; const char *message; } bad_case;

static void test_parse_errors(void **state)
{
    static const bad_case cases[] = {
        {"", "t: missing the header line 'tidal-trace 1'"},
        {"# only a comment\n\n", "t: missing the header line"},
        {"chunk 0 5\n", "t:1: expected the header 'tidal-trace 1' before 'chunk'"},
        {"tidal-trace 2\n", "t:1: unsupported trace header 'tidal-trace 2'"},
        {"tidal-trace\n", "t:1: unsupported trace header"},
        {"tidal-trace 1 extra\n", "t:1: unsupported trace header"},
        {"tidal-trace 1\ntidal-trace 1\n", "t:2: a second header"},
        {"tidal-trace 1\nacess 0 r\n", "t:2: unknown keyword 'acess'; expected chunk, step, access or nonmodel"},
        {"tidal-trace 1\nCHUNK 0 1\n", "t:2: unknown keyword 'CHUNK'"},
        {"tidal-trace 1\nchunk 0 5\n\naccess 1 r\n", "t:4: access to undeclared chunk 1 (1 declared so far)"},
        {"tidal-trace 1\naccess 0 r\n", "t:2: access to undeclared chunk 0"},
        {"tidal-trace 1\nchunk 0 5\nchunk 0 6\n", "t:3: chunk 0 is already declared at line 2"},
        {"tidal-trace 1\nchunk 1 5\n", "t:2: chunk id 1 is out of order: the next chunk must be 0"},
        {"tidal-trace 1\nchunk 0 5\nchunk 2 5\n", "t:3: chunk id 2 is out of order: the next chunk must be 1"},
        {"tidal-trace 1\nchunk 0 0\n", "t:2: chunk 0 has 0 bytes"},
        {"tidal-trace 1\nchunk x 5\n", "t:2: chunk id 'x' is not a plain decimal number"},
        {"tidal-trace 1\nchunk -1 5\n", "t:2: chunk id '-1' is not a plain decimal number"},
        {"tidal-trace 1\nchunk 0 5MiB\n", "t:2: chunk bytes '5MiB' is not a plain decimal number"},
        {"tidal-trace 1\nchunk 0 1e3\n", "t:2: chunk bytes '1e3' is not a plain decimal number"},
        {"tidal-trace 1\nchunk 0 +5\n", "t:2: chunk bytes '+5' is not a plain decimal number"},
        {"tidal-trace 1\nchunk 0 18446744073709551616\n", "t:2: chunk bytes 18446744073709551616 is too large (at most 18446744073709551615)"},
        {"tidal-trace 1\nchunk 4294967296 5\n", "t:2: chunk id 4294967296 is too large (at most 4294967295)"},
        {"tidal-trace 1\nchunk 0\n", "t:2: 'chunk' takes 2 arguments, got 1 (usage: chunk <id> <bytes>)"},
        {"tidal-trace 1\nchunk 0 1 2\n", "t:2: 'chunk' takes 2 arguments, got 3"},
        {"tidal-trace 1\nchunk 0 1\naccess 0\n", "t:3: 'access' takes 2 arguments, got 1 (usage: access <id> r|w)"},
        {"tidal-trace 1\nchunk 0 1\naccess 0 x\n", "t:3: access mode 'x' must be r or w"},
        {"tidal-trace 1\nchunk 0 1\naccess 0 rw\n", "t:3: access mode 'rw' must be r or w"},
        {"tidal-trace 1\nchunk 0 1\naccess 0 R\n", "t:3: access mode 'R' must be r or w"},
        {"tidal-trace 1\nchunk 0 1\naccess 0x0 r\n", "t:3: chunk id '0x0' is not a plain decimal number"},
        {"tidal-trace 1\nstep 1\n", "t:2: 'step' takes 0 arguments, got 1"},
        {"tidal-trace 1\nnonmodel\n", "t:2: 'nonmodel' takes 1 argument, got 0"},
        {"tidal-trace 1\nnonmodel -4\n", "t:2: non-model bytes '-4' is not a plain decimal number"},
        {"tidal-trace 1\nnonmodel 1.5\n", "t:2: non-model bytes '1.5' is not a plain decimal number"},
        {"tidal-trace 1\nchunk 16777216 1\n", "t:2: chunk id 16777216 is out of order"},
        {"tidal-trace 1\nstep\x01\n", "t:2: unknown keyword 'step?'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        td_trace *t = (td_trace *)1;
        td_status st = td_trace_parse(cases[i].text, strlen(cases[i].text), "t", &t);
        if (st != TD_ERR_INVALID || !strstr(td_error_msg(), cases[i].message))
            fail_msg("case %zu (%s): got %s '%s', want '%s'", i, cases[i].text, td_status_name(st),
                     td_error_msg(), cases[i].message);
        assert_null(t);
    }
    /* A NUL byte inside a line. */
    const char nul[] = "tidal-trace 1\nste\0p\n";
    td_trace *t;
    assert_int_equal(td_trace_parse(nul, sizeof nul - 1, "t", &t), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "t:2: line contains a NUL byte"));
    /* Files: a missing one is an I/O error naming it; errors from a file name it. */
    assert_int_equal(td_trace_load("/nonexistent/dir/x.trace", &t), TD_ERR_IO);
    assert_non_null(strstr(td_error_msg(), "/nonexistent/dir/x.trace"));
    char path[] = "/tmp/td_trace_bad_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs("tidal-trace 1\nchunk 0 1\n# fine so far\naccess 0 r\naccess 3 w\n", f);
    fclose(f);
    assert_int_equal(td_trace_load(path, &t), TD_ERR_INVALID);
    char want[600];
    snprintf(want, sizeof want, "%s:5: access to undeclared chunk 3", path);
    assert_non_null(strstr(td_error_msg(), want));
    remove(path);
}

/* A random valid trace: chunk declarations interleaved with the events,
 * sizes and non-model bytes over the whole 64-bit range now and then. */
static td_trace *random_trace(td_rng *rng)
{
    td_trace *t;
    TD_ASSERT_OK(td_trace_create("random", &t));
    uint32_t chunks = 0;
    int n = (int)td_rng_below(rng, 200);
    for (int i = 0; i < n; i++) {
        uint64_t r = td_rng_below(rng, 100);
        if (chunks == 0 || r < 10) {
            uint64_t bytes = td_rng_below(rng, 4) == 0 ? td_rng_next(rng) | 1 : td_rng_below(rng, 1 << 20) + 1;
            TD_ASSERT_OK(td_trace_add_chunk(t, chunks++, bytes, 0));
        } else if (r < 20) {
            TD_ASSERT_OK(td_trace_add_step(t, 0));
        } else if (r < 30) {
            uint64_t bytes = td_rng_below(rng, 4) == 0 ? td_rng_next(rng) : td_rng_below(rng, 1 << 20);
            TD_ASSERT_OK(td_trace_add_nonmodel(t, bytes, 0));
        } else {
            TD_ASSERT_OK(td_trace_add_access(t, (uint32_t)td_rng_below(rng, chunks), (int)td_rng_below(rng, 2), 0));
        }
    }
    return t;
}

static td_trace *roundtrip(const td_trace *t)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    TD_ASSERT_OK(td_trace_write(t, f));
    fclose(f);
    td_trace *back = NULL;
    TD_ASSERT_OK(td_trace_parse(buf, len, "roundtrip", &back));
    free(buf);
    return back;
}

static void test_roundtrip_random(void **state)
{
    int seeds = td_test_seeds(300);
    for (int seed = 1; seed <= seeds; seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed);
        td_trace *t = random_trace(&rng);
        td_trace *back = roundtrip(t);
        assert_true(td_trace_equal(t, back));
        assert_int_equal(td_trace_period_start(t), td_trace_period_start(back));
        assert_int_equal(td_trace_step_count(t), td_trace_step_count(back));
        /* td_trace_equal is not trivially true: one changed event breaks it. */
        if (td_trace_event_count(t) > 0) {
            td_trace *other;
            TD_ASSERT_OK(td_trace_create(NULL, &other));
            for (uint32_t c = 0; c < td_trace_chunk_count(t); c++)
                TD_ASSERT_OK(td_trace_add_chunk(other, c, td_trace_chunk_bytes(t, c), 0));
            const td_trace_event *ev = td_trace_events(t);
            size_t n = td_trace_event_count(t), flip = td_rng_below(&rng, n);
            for (size_t i = 0; i < n; i++) {
                td_trace_event e = ev[i];
                if (i == flip) {
                    if (e.kind == TD_TRACE_ACCESS) e.write ^= 1;
                    else if (e.kind == TD_TRACE_NONMODEL) e.nonmodel_bytes ^= 1;
                    else continue; /* drop the step */
                }
                if (e.kind == TD_TRACE_ACCESS) TD_ASSERT_OK(td_trace_add_access(other, e.chunk, e.write, 0));
                else if (e.kind == TD_TRACE_STEP) TD_ASSERT_OK(td_trace_add_step(other, 0));
                else TD_ASSERT_OK(td_trace_add_nonmodel(other, e.nonmodel_bytes, 0));
            }
            assert_false(td_trace_equal(t, other));
            td_trace_destroy(other);
        }
        td_trace_destroy(back);
        td_trace_destroy(t);
    }
}

static void roundtrip_file(const char *path, void *ctx)
{
    td_trace *t = NULL, *back = NULL;
    TD_ASSERT_OK(td_trace_load(path, &t));
    assert_string_equal(td_trace_name(t), path);
    assert_true(td_trace_access_count(t) > 0);
    char tmp[] = "/tmp/td_trace_rt_XXXXXX";
    int fd = mkstemp(tmp);
    assert_true(fd >= 0);
    close(fd);
    TD_ASSERT_OK(td_trace_save(t, tmp));
    TD_ASSERT_OK(td_trace_load(tmp, &back));
    assert_true(td_trace_equal(t, back));
    assert_int_equal(td_trace_period_start(t), td_trace_period_start(back));
    remove(tmp);
    td_trace_destroy(back);
    td_trace_destroy(t);
    (*(int *)ctx)++;
}

static void test_roundtrip_corpus(void **state)
{
    int n = 0;
    assert_true(for_each_corpus_trace(roundtrip_file, &n) >= 5);
    assert_true(n >= 5);
}

static void test_writer(void **state)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    td_trace_writer *w;
    TD_ASSERT_OK(td_trace_writer_open_stream(f, &w));
    TD_ASSERT_OK(td_trace_writer_comment(w, "model gpt2-tiny\nbudget 1 GiB"));
    TD_ASSERT_OK(td_trace_writer_chunk(w, 0, 64));
    /* The writer refuses what the parser would refuse, and carries on after. */
    assert_int_equal(td_trace_writer_chunk(w, 2, 64), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "the next chunk must be 1"));
    assert_int_equal(td_trace_writer_chunk(w, 1, 0), TD_ERR_INVALID);
    assert_int_equal(td_trace_writer_access(w, 1, 0), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "undeclared chunk 1"));
    TD_ASSERT_OK(td_trace_writer_step(w));
    TD_ASSERT_OK(td_trace_writer_nonmodel(w, UINT64_MAX));
    TD_ASSERT_OK(td_trace_writer_access(w, 0, 1));
    TD_ASSERT_OK(td_trace_writer_chunk(w, 1, 7));
    TD_ASSERT_OK(td_trace_writer_access(w, 1, 0));
    TD_ASSERT_OK(td_trace_writer_close(w));
    fclose(f);
    assert_string_equal(buf, "tidal-trace 1\n# model gpt2-tiny\n# budget 1 GiB\nchunk 0 64\nstep\n"
                             "nonmodel 18446744073709551615\naccess 0 w\nchunk 1 7\naccess 1 r\n");
    td_trace *t = NULL;
    TD_ASSERT_OK(td_trace_parse(buf, len, "w", &t));
    assert_int_equal(td_trace_events(t)[1].nonmodel_bytes, UINT64_MAX);
    td_trace_destroy(t);
    free(buf);

    /* Write errors surface (at the latest when closing). */
    FILE *full = fopen("/dev/full", "w");
    if (full) {
        TD_ASSERT_OK(td_trace_writer_open_stream(full, &w));
        td_status st = TD_OK;
        for (int i = 0; i < 100000 && st == TD_OK; i++) st = td_trace_writer_step(w);
        td_status cst = td_trace_writer_close(w);
        assert_true(st == TD_ERR_IO || cst == TD_ERR_IO);
        assert_non_null(strstr(td_error_msg(), "writing trace"));
        fclose(full);
    }
    assert_int_equal(td_trace_writer_open("/nonexistent/dir/x.trace", &w), TD_ERR_IO);
    assert_null(w);
    TD_ASSERT_OK(td_trace_writer_close(NULL));
}

/* ---- robustness ------------------------------------------------------------ */

/* A garbage line whose first byte cannot start a valid line: always an error
 * naming that line, whatever follows. */
static void test_fuzz_garbage_lines(void **state)
{
    static const char starters[] = "xyzXYZ0123456789!$%&*+-./:;<=>?@[]^_{|}~\x01\x7f\x80\xff";
    int seeds = td_test_seeds(2000);
    td_rng rng;
    td_rng_seed(&rng, 7);
    char text[600];
    for (int i = 0; i < seeds; i++) {
        int pos = sprintf(text, "tidal-trace 1\nchunk 0 10\naccess 0 r\n");
        text[pos++] = starters[td_rng_below(&rng, sizeof starters - 1)];
        int len = (int)td_rng_below(&rng, 300);
        for (int k = 0; k < len; k++) {
            char c = (char)td_rng_below(&rng, 256);
            text[pos++] = c == '\n' ? ' ' : c;
        }
        pos += sprintf(text + pos, "\naccess 0 w\n");
        td_trace *t = (td_trace *)1;
        td_status st = td_trace_parse(text, (size_t)pos, "g", &t);
        assert_int_equal(st, TD_ERR_INVALID);
        assert_null(t);
        assert_non_null(strstr(td_error_msg(), "g:4: "));
    }
}

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc(*len + 1);
    assert_int_equal(fread(buf, 1, *len, f), *len);
    fclose(f);
    return buf;
}

typedef struct mutate_ctx { td_rng rng; int parsed, rejected; } mutate_ctx;

/* Mutated corpus files: random byte changes, insertions, deletions and
 * truncations.  Each result either parses (and round-trips) or is an error
 * that names the file; nothing crashes or leaks. */
static void mutate_file(const char *path, void *vctx)
{
    mutate_ctx *ctx = vctx;
    static const char alphabet[] = "0123456789 \t\n#rwaccess chunk step nonmodel tidal-trace -x\r\0\xff";
    size_t len;
    char *orig = read_all(path, &len);
    int rounds = td_test_seeds(300);
    size_t live = td_host_live_allocs();
    for (int r = 0; r < rounds; r++) {
        size_t cap = len + 64;
        char *buf = malloc(cap);
        memcpy(buf, orig, len);
        size_t n = len;
        int edits = 1 + (int)td_rng_below(&ctx->rng, 4);
        for (int e = 0; e < edits && n > 0; e++) {
            size_t at = td_rng_below(&ctx->rng, n);
            char c = td_rng_below(&ctx->rng, 3) ? alphabet[td_rng_below(&ctx->rng, sizeof alphabet - 1)]
                                                : (char)td_rng_next(&ctx->rng);
            switch (td_rng_below(&ctx->rng, 4)) {
            case 0: buf[at] = c; break;
            case 1: if (n < cap) { memmove(buf + at + 1, buf + at, n - at); buf[at] = c; n++; } break;
            case 2: memmove(buf + at, buf + at + 1, n - at - 1); n--; break;
            default: n = at; break;
            }
        }
        td_trace *t = NULL;
        td_status st = td_trace_parse(buf, n, "m", &t);
        if (st == TD_OK) {
            td_trace *back = roundtrip(t);
            assert_true(td_trace_equal(t, back));
            td_trace_destroy(back);
            /* Whatever parses also simulates: it fits, or the error says why. */
            td_memsim_params p = td_memsim_default_params();
            uint64_t min = td_memsim_min_budget(t);
            p.budget_bytes = td_rng_below(&ctx->rng, 2) ? min : td_rng_below(&ctx->rng, min + 1);
            p.policy = (td_evict_policy)td_rng_below(&ctx->rng, TD_EVICT_POLICY_COUNT);
            p.prefetch = (uint32_t)td_rng_below(&ctx->rng, 5);
            td_memsim_result res;
            td_status sst = td_memsim_run(t, &p, &res);
            assert_int_equal(sst, p.budget_bytes >= min ? TD_OK : TD_ERR_BUDGET);
            if (sst == TD_OK) assert_true(res.peak_device_bytes <= p.budget_bytes);
            td_trace_destroy(t);
            ctx->parsed++;
        } else {
            assert_int_equal(st, TD_ERR_INVALID);
            assert_null(t);
            assert_true(!strncmp(td_error_msg(), "m:", 2));
            ctx->rejected++;
        }
        free(buf);
    }
    assert_int_equal(td_host_live_allocs(), live);
    free(orig);
}

static void test_fuzz_mutations(void **state)
{
    mutate_ctx ctx = {0};
    td_rng_seed(&ctx.rng, 11);
    for_each_corpus_trace(mutate_file, &ctx);
    /* Both outcomes happen, so the fuzzer reaches past the first error. */
    assert_true(ctx.parsed > 0);
    assert_true(ctx.rejected > 0);
}

/* The n-th allocation fails, for every n parsing reaches: an error, no leak. */
static void test_parse_alloc_failures(void **state)
{
    char text[8192];
    int pos = sprintf(text, "tidal-trace 1\n");
    for (int c = 0; c < 80; c++) pos += sprintf(text + pos, "chunk %d 100\n", c);
    for (int i = 0; i < 200; i++) pos += sprintf(text + pos, "access %d %c\n", i % 80, i % 3 ? 'r' : 'w');
    size_t live = td_host_live_allocs();
    int failures = 0;
    for (long n = 1;; n++) {
        td_fault_arm(TD_FAULT_HOST_ALLOC, n);
        td_trace *t = NULL;
        td_status st = td_trace_parse(text, (size_t)pos, "f", &t);
        long reached = td_fault_count(TD_FAULT_HOST_ALLOC);
        td_fault_disarm_all();
        if (st == TD_OK) {
            assert_true(reached < n);
            td_trace_destroy(t);
            break;
        }
        assert_int_equal(st, TD_ERR_NOMEM);
        assert_null(t);
        assert_int_equal(td_host_live_allocs(), live);
        failures++;
    }
    assert_true(failures >= 4);
    assert_int_equal(td_host_live_allocs(), live);
}

/* ---- next-use tables --------------------------------------------------------- */

static uint32_t naive_chunk_at(const uint32_t *seq, size_t n, size_t ps, uint64_t pos)
{
    return pos < n ? seq[pos] : seq[ps + (pos - n) % (n - ps)];
}

static uint64_t naive_first_from(const uint32_t *seq, size_t n, size_t ps, uint32_t c, uint64_t from)
{
    uint64_t horizon = ps < n ? from + 2 * n + 2 : n;
    for (uint64_t q = from; q < horizon; q++)
        if (naive_chunk_at(seq, n, ps, q) == c) return q;
    return TD_NEXTUSE_NEVER;
}

static void test_nextuse_against_naive(void **state)
{
    int seeds = td_test_seeds(300);
    for (int seed = 1; seed <= seeds; seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed * 31);
        uint32_t chunks = 1 + (uint32_t)td_rng_below(&rng, 8);
        size_t n = td_rng_below(&rng, 40);
        uint32_t seq[40];
        for (size_t i = 0; i < n; i++) seq[i] = (uint32_t)td_rng_below(&rng, chunks);
        size_t ps = td_rng_below(&rng, n + 1);
        td_nextuse *t;
        TD_ASSERT_OK(td_nextuse_create(seq, n, chunks, ps, &t));
        assert_int_equal(td_nextuse_length(t), n);
        assert_int_equal(td_nextuse_period_start(t), ps);
        uint64_t horizon = ps < n ? 4 * n + 3 : n;
        for (uint64_t pos = 0; pos < horizon; pos++) {
            assert_true(td_nextuse_valid(t, pos));
            uint32_t c = naive_chunk_at(seq, n, ps, pos);
            assert_int_equal(td_nextuse_chunk_at(t, pos), c);
            assert_int_equal(td_nextuse_after(t, pos), naive_first_from(seq, n, ps, c, pos + 1));
            for (uint32_t k = 0; k < chunks; k++)
                assert_int_equal(td_nextuse_of(t, k, pos), naive_first_from(seq, n, ps, k, pos));
        }
        if (ps == n) {
            assert_false(td_nextuse_valid(t, n));
            assert_int_equal(td_nextuse_after(t, n + 5), TD_NEXTUSE_NEVER);
            assert_int_equal(td_nextuse_of(t, 0, n), TD_NEXTUSE_NEVER);
        }
        assert_int_equal(td_nextuse_of(t, chunks, 0), TD_NEXTUSE_NEVER);
        td_nextuse_destroy(t);
    }
    td_nextuse *t;
    uint32_t bad[2] = {0, 5};
    assert_int_equal(td_nextuse_create(bad, 2, 3, 0, &t), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "chunk 5"));
    assert_int_equal(td_nextuse_create(bad, 2, 6, 3, &t), TD_ERR_INVALID);
}

/* ---- evictors ------------------------------------------------------------- */

typedef struct naive_cand { int member; uint64_t last, next; int dirty; } naive_cand;

static int64_t naive_pick(const naive_cand *c, uint32_t n, td_evict_policy p, uint64_t min_next)
{
    int64_t best = -1;
    for (uint32_t i = 0; i < n; i++) {
        if (!c[i].member || c[i].next < min_next) continue;
        if (best < 0) { best = i; continue; }
        const naive_cand *a = &c[i], *b = &c[best];
        int better = p == TD_EVICT_LRU
                   ? a->last < b->last
                   : (a->next != b->next ? a->next > b->next : a->dirty < b->dirty); /* ties: lower id wins */
        if (better) best = i;
    }
    return best;
}

static void test_evictor_against_naive(void **state)
{
    int seeds = td_test_seeds(200);
    for (int seed = 1; seed <= seeds; seed++) {
        for (int p = 0; p < TD_EVICT_POLICY_COUNT; p++) {
            td_rng rng;
            td_rng_seed(&rng, (uint64_t)seed);
            uint32_t n = 1 + (uint32_t)td_rng_below(&rng, 24);
            uint64_t bytes[24];
            for (uint32_t i = 0; i < n; i++) bytes[i] = 1 + td_rng_below(&rng, 100);
            td_evictor *e;
            TD_ASSERT_OK(td_evictor_create((td_evict_policy)p, n, bytes, &e));
            assert_int_equal(td_evictor_policy(e), p);
            naive_cand c[24] = {{0}};
            uint64_t clock = 1;
            for (int op = 0; op < 400; op++) {
                uint32_t k = (uint32_t)td_rng_below(&rng, n);
                uint64_t r = td_rng_below(&rng, 100);
                if (r < 55) {
                    uint64_t next = td_rng_below(&rng, 5) == 0 ? TD_NEXTUSE_NEVER : clock + td_rng_below(&rng, 30);
                    int dirty = (int)td_rng_below(&rng, 2);
                    /* Sometimes only the dirty bit changes (a writeback without eviction). */
                    uint64_t last = c[k].member && td_rng_below(&rng, 4) == 0 ? c[k].last : clock++;
                    TD_ASSERT_OK(td_evictor_update(e, k, last, next, dirty));
                    c[k] = (naive_cand){1, last, next, dirty};
                } else if (r < 75) {
                    td_evictor_remove(e, k);
                    c[k].member = 0;
                } else if (r < 95) {
                    uint64_t min_next = td_rng_below(&rng, 3) == 0 ? 0 : clock + td_rng_below(&rng, 30);
                    assert_int_equal(td_evictor_pick(e, min_next), naive_pick(c, n, (td_evict_policy)p, min_next));
                    uint64_t eligible = 0, enough = td_rng_below(&rng, 400);
                    for (uint32_t i = 0; i < n; i++)
                        if (c[i].member && c[i].next >= min_next) eligible += bytes[i];
                    uint64_t got = td_evictor_freeable(e, min_next, enough);
                    assert_true(got <= eligible);
                    assert_true(got >= (enough < eligible ? enough : eligible));
                } else {
                    /* make_room: the victims are the naive picks in order, or nothing. */
                    uint64_t need = td_rng_below(&rng, 300), free_bytes = td_rng_below(&rng, 100);
                    uint64_t min_next = td_rng_below(&rng, 2) ? 0 : clock + td_rng_below(&rng, 30);
                    uint32_t victims[24], nv;
                    naive_cand before[24];
                    memcpy(before, c, sizeof c);
                    uint32_t count_before = td_evictor_count(e);
                    td_status st = td_evictor_make_room(e, need, free_bytes, min_next, victims, &nv);
                    uint64_t f = free_bytes;
                    uint32_t want = 0;
                    uint32_t expect[24];
                    while (f < need) {
                        int64_t v = naive_pick(c, n, (td_evict_policy)p, min_next);
                        if (v < 0) break;
                        c[v].member = 0;
                        expect[want++] = (uint32_t)v;
                        f += bytes[v];
                    }
                    if (f >= need && p == TD_EVICT_BELADY && want > 1) {
                        /* Belady keeps victims that later, larger ones made unneeded. */
                        uint32_t m = want;
                        for (uint32_t i = want - 1; i-- > 0;)
                            if (f - bytes[expect[i]] >= need) {
                                f -= bytes[expect[i]];
                                c[expect[i]].member = 1;
                                expect[i] = UINT32_MAX;
                                m--;
                            }
                        for (uint32_t i = 0, o = 0; i < want; i++)
                            if (expect[i] != UINT32_MAX) expect[o++] = expect[i];
                        want = m;
                    }
                    if (f >= need) {
                        TD_ASSERT_OK(st);
                        assert_int_equal(nv, want);
                        for (uint32_t i = 0; i < nv; i++) assert_int_equal(victims[i], expect[i]);
                    } else {
                        assert_int_equal(st, TD_ERR_BUDGET);
                        assert_int_equal(nv, 0);
                        assert_int_equal(td_evictor_count(e), count_before);
                        memcpy(c, before, sizeof c);
                    }
                }
                uint32_t count = 0;
                uint64_t total = 0;
                for (uint32_t i = 0; i < n; i++) {
                    assert_int_equal(td_evictor_contains(e, i), c[i].member);
                    if (!c[i].member) continue;
                    count++;
                    total += bytes[i];
                    assert_int_equal(td_evictor_next_use(e, i), c[i].next);
                    assert_int_equal(td_evictor_dirty(e, i), c[i].dirty);
                }
                assert_int_equal(td_evictor_count(e), count);
                assert_int_equal(td_evictor_bytes(e), total);
            }
            assert_int_equal(td_evictor_update(e, n, 0, 0, 0), TD_ERR_INVALID);
            td_evictor_remove(e, n); /* out of range: a no-op */
            td_evictor_destroy(e);
        }
    }
    td_evict_policy p;
    TD_ASSERT_OK(td_evict_policy_parse("belady", &p));
    assert_int_equal(p, TD_EVICT_BELADY);
    TD_ASSERT_OK(td_evict_policy_parse("LRU", &p));
    assert_int_equal(p, TD_EVICT_LRU);
    assert_int_equal(td_evict_policy_parse("fifo", &p), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "use belady or lru"));
    assert_string_equal(td_evict_policy_name(TD_EVICT_BELADY), "belady");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_example),
        cmocka_unit_test(test_parse_errors),
        cmocka_unit_test(test_roundtrip_random),
        cmocka_unit_test(test_roundtrip_corpus),
        cmocka_unit_test(test_writer),
        cmocka_unit_test(test_fuzz_garbage_lines),
        cmocka_unit_test(test_fuzz_mutations),
        cmocka_unit_test(test_parse_alloc_failures),
        cmocka_unit_test(test_nextuse_against_naive),
        cmocka_unit_test(test_evictor_against_naive),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
