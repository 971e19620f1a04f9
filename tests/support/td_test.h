/* Shared helpers for tidal's cmocka tests. */
#ifndef TD_TEST_H
#define TD_TEST_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

/* 1 in builds under AddressSanitizer (`make test SANITIZE=...`), whose
 * instrumented code runs several times slower: long loops there check the
 * memory of fewer iterations, the plain build the whole property. */
#if defined(__SANITIZE_ADDRESS__)
#define TD_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TD_TEST_SANITIZED 1
#endif
#endif
#ifndef TD_TEST_SANITIZED
#define TD_TEST_SANITIZED 0
#endif

#include "tidal/alloc.h"
#include "tidal/backend.h"
#include "tidal/dtype.h"
#include "tidal/status.h"
#include "tidal/util.h"

/* Fails the test with the library's message when `expr` is not TD_OK. */
#define TD_ASSERT_OK(expr)                                                        \
    do {                                                                          \
        td_status st_ = (expr);                                                   \
        if (st_ != TD_OK) fail_msg("%s -> %s: %s (at %s)", #expr,                \
                                   td_status_name(st_), td_error_msg(), td_error_where()); \
    } while (0)

/* Skips the running test case, printing "skipped: REASON" first: tests/run.sh
 * lists the reason, fails a skip that gives none, and fails one whose reason
 * names hardware the machine has ("needs 2 GPUs", "needs a GPU", "needs NCCL",
 * "needs CPU flag avx2"), so a machine that can run a case never skips it. */
#define td_test_skip(...)                  \
    do {                                   \
        print_message("skipped: " __VA_ARGS__); \
        print_message("\n");               \
        skip();                            \
    } while (0)

/* The backend tests run on: env TD_BACKEND (cpu|cuda|auto), default cpu. */
td_backend_kind td_test_backend_kind(void);
/* Creates that backend; `debug` turns on the cpu backend's delay+poison mode. */
td_backend *td_test_backend(int debug);
/* Number of seeds for randomized tests: env TD_TEST_SEEDS, default `fallback`. */
int td_test_seeds(int fallback);
/* The tidal command of this build, for tests that run it: env TIDAL, else
 * ./build/tidal when it is there, else ./build-san/tidal. */
const char *td_test_tidal(void);
/* The number at o[a] (o[a][b] when b is given), failing the test with the
 * key's name when it is missing or not a number. */
struct cJSON;
double td_test_json_num(const struct cJSON *o, const char *a, const char *b);
/* A file's bytes with a NUL after them (free() them); *len (may be NULL)
 * gets their count.  Fails the test when the file cannot be read. */
char *td_test_slurp(const char *path, size_t *len);
/* Calls fn on every line of a JSON-lines file, failing the test on a line
 * that is not JSON; returns the count. */
int td_test_for_each_jsonl(const char *path, void (*fn)(struct cJSON *obj, void *ctx), void *ctx);

/* Element i of a buffer of dtype dt (fp32, bf16 or fp16), written from x
 * rounded to nearest even, or read as a double. */
void td_test_store_as(void *dst, td_dtype dt, size_t i, float x);
double td_test_load_as(const void *src, td_dtype dt, size_t i);

/* The pieces a pre-tokenizer hands its callback, copied (at most 4096);
 * `user` is the caller's (a tokenizer, say). */
typedef struct td_test_pieces {
    char *v[4096];
    size_t len[4096];
    int n;
    void *user;
} td_test_pieces;
/* A pre-tokenizer's callback: ctx a td_test_pieces. */
void td_test_collect_piece(void *ctx, const char *piece, size_t len);
void td_test_free_pieces(td_test_pieces *p);
/* got's pieces of `text` against the JSON array of strings `want` (the
 * reference regex's), each piece and their count; then frees got's. */
void td_test_expect_pieces(const char *text, const struct cJSON *want, td_test_pieces *got);

#endif
