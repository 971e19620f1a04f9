/* Token files, the loader and `tidal prepare`.
 *
 * - CRC-32 against the standard check values; the header layout read back
 *   byte by byte; round trips for uint16 and uint32 files.
 * - Every truncation and every single-byte change of a file is an error
 *   (never a crash: run under ASan by make test SANITIZE=address,undefined),
 *   with messages that name the file and what is wrong.
 * - The writer is atomic: the final name holds the old file or the new one,
 *   and no temporary file survives a failure.
 * - The loader: every sequence exactly once per epoch, epochs and seeds give
 *   different orders, the same seed the same batches, a saved position
 *   resumes the identical stream (with any batch size), the held-out split
 *   is the disjoint tail.
 * - `tidal prepare`: files, folders (order, skips, separators), stdin, GPT-2
 *   BPE streamed in tiny blocks equal to encoding whole, and its errors. */
#define _XOPEN_SOURCE 700
#include "td_test.h"
#include "tidal/data.h"
#include "tidal/tokenizer.h"
#include "../cli/cli.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- helpers ----------------------------------------------------------------- */

static char tmp_root[256];

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    return remove(path);
}

static int setup_tmp(void **state)
{
    strcpy(tmp_root, "/tmp/td_test_data_XXXXXX");
    assert_non_null(mkdtemp(tmp_root));
    return 0;
}

static int teardown_tmp(void **state)
{
    nftw(tmp_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return 0;
}

/* Paths under the test's folder; a result stays valid for 64 more calls. */
static const char *tmp_path(const char *name)
{
    static char buf[64][512];
    static int k;
    char *p = buf[k++ & 63];
    snprintf(p, 512, "%s/%s", tmp_root, name);
    return p;
}

static void write_text(const char *path, const char *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    fclose(f);
}

static unsigned char *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    rewind(f);
    unsigned char *buf = malloc(*n + 1);
    assert_int_equal(fread(buf, 1, *n, f), *n);
    fclose(f);
    return buf;
}

/* Number of entries in a folder other than . and .. */
static int count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

static void write_tokens(const char *path, td_tokenizer_kind kind, uint32_t vocab, uint32_t eot, const uint32_t *ids,
                         size_t n)
{
    td_tokfile_writer *w = NULL;
    TD_ASSERT_OK(td_tokfile_writer_open(path, kind, vocab, eot, &w));
    TD_ASSERT_OK(td_tokfile_writer_append(w, ids, n));
    assert_int_equal(td_tokfile_writer_count(w), n);
    TD_ASSERT_OK(td_tokfile_writer_commit(w));
}

static uint32_t get32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void reseal_header(unsigned char *h) { put32(h + 60, td_crc32(0, h, 60)); }

static void expect_open_error(const unsigned char *data, size_t n, const char *needle)
{
    td_tokfile *f = (td_tokfile *)1;
    td_status st = td_tokfile_open_buffer(data, n, "corrupt.tok", &f);
    if (st == TD_OK) fail_msg("a corrupt file (%zu bytes) opened", n);
    assert_int_equal(st, TD_ERR_INVALID);
    assert_null(f);
    if (!strstr(td_error_msg(), "corrupt.tok")) fail_msg("message does not name the file: %s", td_error_msg());
    if (needle && !strstr(td_error_msg(), needle)) fail_msg("message '%s' lacks '%s'", td_error_msg(), needle);
}

/* ---- CRC and the format --------------------------------------------------------- */

static void test_crc32(void **state)
{
    assert_int_equal(td_crc32(0, "123456789", 9), 0xCBF43926u);
    assert_int_equal(td_crc32(0, "", 0), 0);
    assert_int_equal(td_crc32(0, "a", 1), 0xE8B7BE43u);
    char buf[1000];
    for (int i = 0; i < 1000; i++) buf[i] = (char)(i * 7 + 3);
    uint32_t whole = td_crc32(0, buf, sizeof buf);
    for (size_t cut = 0; cut <= sizeof buf; cut += 37)
        assert_int_equal(td_crc32(td_crc32(0, buf, cut), buf + cut, sizeof buf - cut), whole);
}

static void round_trip(uint32_t vocab, size_t n, uint64_t seed)
{
    uint32_t *ids = malloc(n * sizeof *ids);
    td_rng rng;
    td_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) ids[i] = (uint32_t)td_rng_below(&rng, vocab);
    if (n) ids[n - 1] = vocab - 1;
    const char *path = tmp_path("rt.tok");
    write_tokens(path, TD_TOKENIZER_GPT2, vocab, vocab - 1, ids, n);
    uint32_t width = vocab <= 65536 ? 2 : 4;

    /* the layout, byte by byte */
    size_t bytes;
    unsigned char *raw = read_all(path, &bytes);
    assert_int_equal(bytes, 64 + n * width);
    assert_memory_equal(raw, "TDTOKENS", 8);
    assert_int_equal(get32(raw + 8), 1);
    assert_int_equal(get32(raw + 12), 64);
    assert_int_equal(get32(raw + 16), width);
    assert_int_equal(get32(raw + 20), TD_TOKENIZER_GPT2);
    assert_int_equal(get32(raw + 24), vocab);
    assert_int_equal(get32(raw + 28), vocab - 1);
    assert_int_equal(get64(raw + 32), n);
    assert_int_equal(get32(raw + 40), td_crc32(0, raw + 64, n * width));
    for (int i = 44; i < 60; i++) assert_int_equal(raw[i], 0);
    assert_int_equal(get32(raw + 60), td_crc32(0, raw, 60));
    free(raw);

    td_tokfile *f = NULL;
    TD_ASSERT_OK(td_tokfile_open(path, &f));
    const td_tokfile_info *info = td_tokfile_get_info(f);
    assert_int_equal(info->token_bytes, width);
    assert_int_equal(info->vocab_size, vocab);
    assert_int_equal(info->tokenizer, TD_TOKENIZER_GPT2);
    assert_int_equal(td_tokfile_count(f), n);
    for (size_t i = 0; i < n; i++)
        if (td_tokfile_at(f, i) != ids[i]) fail_msg("token %zu: %u, wrote %u", i, td_tokfile_at(f, i), ids[i]);
    int32_t out[100];
    size_t start = n > 100 ? n - 100 : 0;
    TD_ASSERT_OK(td_tokfile_read(f, start, n - start, out));
    for (size_t i = start; i < n; i++) assert_int_equal(out[i - start], (int32_t)ids[i]);
    assert_int_equal(td_tokfile_read(f, n - 1, 2, out), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "past its"));
    assert_int_equal(td_tokfile_read(f, UINT64_MAX, 1, out), TD_ERR_INVALID);
    td_tokfile_close(f);
    free(ids);
}

static void test_round_trip_uint16(void **state)
{
    round_trip(257, 700001, 1);   /* crosses the writer's 1 MiB buffer */
    round_trip(65536, 1000, 2);   /* the largest uint16 vocabulary */
    round_trip(257, 1, 3);
    round_trip(257, 0, 4);
}

static void test_round_trip_uint32(void **state)
{
    round_trip(65537, 1000, 5);
    round_trip(50257 * 4, 300001, 6);
}

/* ---- the atomic writer --------------------------------------------------------- */

static void test_writer_atomic(void **state)
{
    mkdir(tmp_path("w"), 0777);
    const char *path = tmp_path("w/out.tok");
    write_text(path, "old", 3);
    uint32_t ids[] = {1, 2, 3};
    td_tokfile_writer *w = NULL;

    /* abort: the old file stays, nothing else is left */
    TD_ASSERT_OK(td_tokfile_writer_open(path, TD_TOKENIZER_BYTE, 257, 256, &w));
    TD_ASSERT_OK(td_tokfile_writer_append(w, ids, 3));
    assert_int_equal(count_entries(tmp_path("w")), 2); /* the old file and the temporary */
    td_tokfile_writer_abort(w);
    size_t n;
    unsigned char *raw = read_all(path, &n);
    assert_int_equal(n, 3);
    assert_memory_equal(raw, "old", 3);
    free(raw);
    assert_int_equal(count_entries(tmp_path("w")), 1);

    /* an id outside the vocabulary is refused */
    TD_ASSERT_OK(td_tokfile_writer_open(path, TD_TOKENIZER_BYTE, 257, 256, &w));
    uint32_t bad = 257;
    assert_int_equal(td_tokfile_writer_append(w, &bad, 1), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "id 257 is not below vocab size 257"));
    td_tokfile_writer_abort(w);

    /* commit replaces the old file */
    write_tokens(path, TD_TOKENIZER_BYTE, 257, 256, ids, 3);
    assert_int_equal(count_entries(tmp_path("w")), 1);
    td_tokfile *f = NULL;
    TD_ASSERT_OK(td_tokfile_open(path, &f));
    assert_int_equal(td_tokfile_count(f), 3);
    td_tokfile_close(f);

    /* a missing folder */
    assert_int_equal(td_tokfile_writer_open(tmp_path("nope/out.tok"), TD_TOKENIZER_BYTE, 257, 256, &w), TD_ERR_IO);
    assert_null(w);
    assert_non_null(strstr(td_error_msg(), "does its folder exist?"));

    /* the final name is a folder: commit fails and cleans up */
    mkdir(tmp_path("w/dir.tok"), 0777);
    TD_ASSERT_OK(td_tokfile_writer_open(tmp_path("w/dir.tok"), TD_TOKENIZER_BYTE, 257, 256, &w));
    TD_ASSERT_OK(td_tokfile_writer_append(w, ids, 3));
    assert_int_equal(td_tokfile_writer_commit(w), TD_ERR_IO);
    assert_non_null(strstr(td_error_msg(), "cannot move the finished token file"));
    assert_int_equal(count_entries(tmp_path("w")), 2); /* out.tok and dir.tok */

    /* bad parameters */
    assert_int_equal(td_tokfile_writer_open(path, TD_TOKENIZER_BYTE, 257, 257, &w), TD_ERR_INVALID);
    assert_int_equal(td_tokfile_writer_open(path, TD_TOKENIZER_BYTE, 0, 0, &w), TD_ERR_INVALID);
}

/* ---- corruption ------------------------------------------------------------------ */

static unsigned char *small_file(size_t *n, uint32_t vocab)
{
    uint32_t ids[100];
    for (int i = 0; i < 100; i++) ids[i] = (uint32_t)(i * 37) % vocab;
    write_tokens(tmp_path("small.tok"), TD_TOKENIZER_BYTE, vocab, vocab - 1, ids, 100);
    return read_all(tmp_path("small.tok"), n);
}

static void test_corrupt_truncated(void **state)
{
    size_t n;
    unsigned char *raw = small_file(&n, 257);
    size_t base = td_host_live_allocs();
    for (size_t len = 0; len < n; len++) expect_open_error(raw, len, len < 64 ? NULL : "truncated");
    expect_open_error(raw, 10, "shorter than the 64-byte header");
    unsigned char *longer = malloc(n + 3);
    memcpy(longer, raw, n);
    memset(longer + n, 0, 3);
    expect_open_error(longer, n + 3, "3 bytes after its 100 tokens");
    free(longer);
    assert_int_equal(td_host_live_allocs(), base);
    /* through the file (mmap) path, at random points */
    td_rng rng;
    td_rng_seed(&rng, 11);
    for (int k = 0; k < 20; k++) {
        size_t len = td_rng_below(&rng, n);
        const char *path = tmp_path("trunc.tok");
        write_text(path, (const char *)raw, len);
        td_tokfile *f = (td_tokfile *)1;
        assert_int_equal(td_tokfile_open(path, &f), TD_ERR_INVALID);
        assert_null(f);
        assert_non_null(strstr(td_error_msg(), path));
    }
    free(raw);
}

static void test_corrupt_every_byte(void **state)
{
    for (int v = 0; v < 2; v++) {
        size_t n;
        unsigned char *raw = small_file(&n, v ? 70000 : 257);
        td_tokfile *f = NULL;
        TD_ASSERT_OK(td_tokfile_open_buffer(raw, n, "ok.tok", &f));
        td_tokfile_close(f);
        td_rng rng;
        td_rng_seed(&rng, 12);
        for (size_t i = 0; i < n; i++) {
            for (int k = 0; k < 4; k++) {
                unsigned char flip = k < 3 ? (unsigned char)(1u << td_rng_below(&rng, 8))
                                           : (unsigned char)(1 + td_rng_below(&rng, 255));
                raw[i] ^= flip;
                expect_open_error(raw, n, NULL);
                raw[i] ^= flip;
            }
        }
        /* random multi-byte damage */
        for (int k = 0; k < 300; k++) {
            unsigned char *copy = malloc(n);
            memcpy(copy, raw, n);
            int changed = 0;
            for (int j = 0; j < 1 + (int)td_rng_below(&rng, 6); j++) {
                size_t at = td_rng_below(&rng, n);
                unsigned char x = (unsigned char)td_rng_below(&rng, 256);
                changed |= copy[at] != x;
                copy[at] = x;
            }
            if (changed && memcmp(copy, raw, n)) expect_open_error(copy, n, NULL);
            free(copy);
        }
        /* a flipped payload byte through the file path */
        raw[64] ^= 1;
        write_text(tmp_path("flip.tok"), (const char *)raw, n);
        td_tokfile *g = (td_tokfile *)1;
        assert_int_equal(td_tokfile_open(tmp_path("flip.tok"), &g), TD_ERR_INVALID);
        assert_non_null(strstr(td_error_msg(), "checksum mismatch"));
        free(raw);
    }
}

static void test_corrupt_messages(void **state)
{
    size_t n;
    unsigned char *raw = small_file(&n, 257);
    unsigned char *c = malloc(n);
#define RESET() memcpy(c, raw, n)
    RESET();
    memcpy(c, "TDTOKENZ", 8);
    expect_open_error(c, n, "is not a tidal token file");
    RESET();
    put32(c + 8, 3);
    reseal_header(c);
    expect_open_error(c, n, "has format version 3; this tidal reads versions 1 and 2");
    RESET(); /* version 2: the row and flags fields, then reserved bytes 56..59 */
    put32(c + 8, 2);
    put32(c + 48, 2);
    reseal_header(c);
    expect_open_error(c, n, "the flags field is 2 (0 or 1)");
    RESET();
    put32(c + 8, 2);
    put32(c + 48, 1);
    reseal_header(c);
    expect_open_error(c, n, "with their flags");
    RESET();
    put32(c + 8, 2);
    c[57] = 1;
    reseal_header(c);
    expect_open_error(c, n, "reserved header byte 57");
    RESET();
    put32(c + 8, 2);
    put32(c + 44, 7);
    reseal_header(c);
    expect_open_error(c, n, "are not whole rows of 7");
    RESET();
    c[24] ^= 1; /* vocab size, header not resealed */
    expect_open_error(c, n, "header checksum mismatch");
    RESET();
    put32(c + 12, 128);
    reseal_header(c);
    expect_open_error(c, n, "header size 128");
    RESET();
    put32(c + 20, 9);
    reseal_header(c);
    expect_open_error(c, n, "unknown tokenizer kind 9");
    RESET();
    put32(c + 16, 4);
    reseal_header(c);
    expect_open_error(c, n, "4-byte tokens, but a vocabulary of 257 needs 2");
    RESET();
    put32(c + 28, 257);
    reseal_header(c);
    expect_open_error(c, n, "end-of-text id 257 is not below vocab size 257");
    RESET();
    put32(c + 24, 0);
    reseal_header(c);
    expect_open_error(c, n, "vocab size 0");
    RESET();
    c[50] = 1;
    reseal_header(c);
    expect_open_error(c, n, "reserved header byte 50");
    RESET();
    c[64 + 2 * 5] ^= 4;
    expect_open_error(c, n, "token data checksum mismatch");
    RESET();
    c[64 + 2 * 7] = 0x01; /* token 7 := 257 + ... >= vocab, with the checksums redone */
    c[64 + 2 * 7 + 1] = 0x01;
    put32(c + 40, td_crc32(0, c + 64, n - 64));
    reseal_header(c);
    expect_open_error(c, n, "token 7 is 257, not below the vocab size 257");
    RESET();
    c[32] = 101; /* one token more than the file holds */
    reseal_header(c);
    expect_open_error(c, n, "truncated: the header says 101 tokens (202 bytes) but the file holds 200");
    RESET();
    memset(c + 32, 0xFF, 8); /* an absurd count must not overflow */
    reseal_header(c);
    expect_open_error(c, n, "truncated");
#undef RESET
    free(c);
    free(raw);

    td_tokfile *f = (td_tokfile *)1;
    assert_int_equal(td_tokfile_open(tmp_path("missing.tok"), &f), TD_ERR_IO);
    assert_null(f);
    assert_non_null(strstr(td_error_msg(), "cannot open token file"));
    assert_non_null(strstr(td_error_msg(), "missing.tok"));
    assert_non_null(strstr(td_error_msg(), "tidal prepare"));
    assert_int_equal(td_tokfile_open(tmp_root, &f), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "not a regular file"));
    write_text(tmp_path("empty.tok"), "", 0);
    assert_int_equal(td_tokfile_open(tmp_path("empty.tok"), &f), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "0 bytes, shorter than the 64-byte header"));
}

static void test_random_garbage(void **state)
{
    unsigned char buf[600];
    td_rng rng;
    td_rng_seed(&rng, 13);
    for (int k = 0; k < td_test_seeds(2000); k++) {
        size_t n = td_rng_below(&rng, sizeof buf);
        for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)td_rng_below(&rng, 256);
        if (k & 1 && n >= 8) memcpy(buf, "TDTOKENS", 8);
        if (k & 2 && n >= 12) put32(buf + 8, 1);
        if (k & 4 && n >= 64) reseal_header(buf);
        expect_open_error(buf, n, NULL);
    }
}

/* ---- the loader ----------------------------------------------------------------- */

/* A file whose token i is i (vocab 65536, so n_tokens <= 65535). */
static td_tokfile *positions_file(const char *name, size_t n_tokens)
{
    uint32_t *ids = malloc(n_tokens * sizeof *ids);
    for (size_t i = 0; i < n_tokens; i++) ids[i] = (uint32_t)i;
    write_tokens(tmp_path(name), TD_TOKENIZER_GPT2, 65536, 65535, ids, n_tokens);
    free(ids);
    td_tokfile *f = NULL;
    TD_ASSERT_OK(td_tokfile_open(tmp_path(name), &f));
    return f;
}

static td_loader *make_loader(const td_tokfile *f, uint32_t B, uint32_t T, uint64_t seed)
{
    td_loader_params p = td_loader_default_params();
    p.batch = B;
    p.seq = T;
    p.seed = seed;
    td_loader *l = NULL;
    TD_ASSERT_OK(td_loader_create(f, &p, &l));
    return l;
}

/* Pulls one batch and appends each row's sequence index (checking the row). */
static void next_rows(td_loader *l, uint32_t B, uint32_t T, uint64_t *seqs)
{
    int32_t *in = malloc((size_t)B * T * sizeof *in), *tg = malloc((size_t)B * T * sizeof *tg);
    TD_ASSERT_OK(td_loader_next(l, in, tg, NULL));
    for (uint32_t b = 0; b < B; b++) {
        int32_t first = in[(size_t)b * T];
        assert_int_equal(first % (int32_t)T, 0);
        for (uint32_t t = 0; t < T; t++) {
            assert_int_equal(in[(size_t)b * T + t], first + (int32_t)t);
            assert_int_equal(tg[(size_t)b * T + t], first + (int32_t)t + 1);
        }
        seqs[b] = (uint64_t)first / T;
    }
    free(in);
    free(tg);
}

static void test_loader_sequential_content(void **state)
{
    td_tokfile *f = positions_file("pos.tok", 1001);
    td_loader_params p = td_loader_default_params();
    p.batch = 3;
    p.seq = 10;
    p.shuffle = 0;
    td_loader *l = NULL;
    TD_ASSERT_OK(td_loader_create(f, &p, &l));
    assert_int_equal(td_loader_sequences(l), 100); /* (1001 - 1) / 10 */
    assert_int_equal(td_loader_first_sequence(l), 0);
    uint64_t seqs[3];
    for (int k = 0; k < 40; k++) { /* 120 sequences: wraps into epoch 1 */
        next_rows(l, 3, 10, seqs);
        for (int b = 0; b < 3; b++) assert_int_equal(seqs[b], (uint64_t)(3 * k + b) % 100);
    }
    td_loader_position pos;
    td_loader_tell(l, &pos);
    assert_int_equal(pos.epoch, 1);
    assert_int_equal(pos.index, 20);
    td_loader_destroy(l);
    /* the last sequence reads the file's last token as its last target */
    TD_ASSERT_OK(td_loader_create(f, &p, &l));
    td_loader_position last = {0, 99, pos.fingerprint};
    TD_ASSERT_OK(td_loader_seek(l, &last));
    int32_t in[30], tg[30];
    TD_ASSERT_OK(td_loader_next(l, in, tg, NULL));
    assert_int_equal(tg[9], 1000);
    assert_int_equal(in[10], 0); /* then epoch 1 starts over */
    td_loader_destroy(l);
    td_tokfile_close(f);
}

static void test_loader_permutations(void **state)
{
    const uint64_t sizes[] = {1, 2, 3, 5, 7, 64, 100, 1000, 4097};
    const uint32_t T = 4;
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        uint64_t n = sizes[s];
        td_tokfile *f = positions_file("perm.tok", n * T + 1);
        td_loader *l = make_loader(f, 7, T, 42), *other_seed = make_loader(f, 7, T, 43);
        assert_int_equal(td_loader_sequences(l), n);
        unsigned char *seen = malloc(n);
        uint64_t *order0 = malloc(n * sizeof *order0);
        for (uint64_t e = 0; e < 4; e++) {
            memset(seen, 0, n);
            uint64_t same_as_0 = 0, fixed = 0, same_seed = 0;
            for (uint64_t i = 0; i < n; i++) {
                uint64_t q = td_loader_sequence_at(l, e, i);
                assert_true(q < n);
                assert_int_equal(seen[q], 0); /* exactly once */
                seen[q] = 1;
                if (e == 0) order0[i] = q;
                same_as_0 += order0[i] == q;
                fixed += q == i;
                same_seed += td_loader_sequence_at(other_seed, e, i) == q;
            }
            if (n >= 100) {
                assert_true(fixed < n / 10 + 5); /* shuffled, not the identity */
                assert_true(same_seed < n / 10 + 5);
                if (e > 0) assert_true(same_as_0 < n / 10 + 5); /* each epoch its own order */
            }
        }
        /* the batches follow sequence_at, straddling epochs (7 does not divide n) */
        uint64_t total = 3 * n, got = 0;
        uint64_t *rows = malloc((total + 7) * sizeof *rows);
        while (got < total) {
            next_rows(l, 7, T, rows + got);
            got += 7;
        }
        for (uint64_t k = 0; k < total; k++) assert_int_equal(rows[k], td_loader_sequence_at(l, k / n, k % n));
        free(rows);
        free(seen);
        free(order0);
        td_loader_destroy(l);
        td_loader_destroy(other_seed);
        td_tokfile_close(f);
    }
}

static void test_loader_determinism_and_resume(void **state)
{
    td_tokfile *f = positions_file("resume.tok", 4001);
    const uint32_t T = 8; /* 500 sequences */
    td_loader *a = make_loader(f, 5, T, 1234);
    uint64_t first[57 * 5];
    for (int k = 0; k < 37; k++) next_rows(a, 5, T, first + 5 * k);
    td_loader_position pos;
    td_loader_tell(a, &pos);
    assert_int_equal(pos.index, 185);
    for (int k = 37; k < 57; k++) next_rows(a, 5, T, first + 5 * k);

    /* same seed, fresh: the same batches */
    td_loader *b = make_loader(f, 5, T, 1234);
    uint64_t again[5];
    for (int k = 0; k < 57; k++) {
        next_rows(b, 5, T, again);
        assert_memory_equal(again, first + 5 * k, sizeof again);
    }
    td_loader_destroy(b);

    /* resumed from the saved position: the identical continuation */
    td_loader *c = make_loader(f, 5, T, 1234);
    TD_ASSERT_OK(td_loader_seek(c, &pos));
    for (int k = 37; k < 57; k++) {
        next_rows(c, 5, T, again);
        assert_memory_equal(again, first + 5 * k, sizeof again);
    }
    td_loader_destroy(c);

    /* ... also with another batch size: the sequence stream is the same */
    td_loader *d = make_loader(f, 4, T, 1234);
    TD_ASSERT_OK(td_loader_seek(d, &pos));
    for (int k = 0; k < 25; k++) {
        uint64_t four[4];
        next_rows(d, 4, T, four);
        assert_memory_equal(four, first + 185 + 4 * k, sizeof four);
    }
    td_loader_destroy(d);

    /* across an epoch boundary */
    td_loader *e = make_loader(f, 5, T, 1234);
    td_loader_position near_end = {3, 498, pos.fingerprint};
    TD_ASSERT_OK(td_loader_seek(e, &near_end));
    uint64_t rows[5];
    next_rows(e, 5, T, rows);
    assert_int_equal(rows[0], td_loader_sequence_at(e, 3, 498));
    assert_int_equal(rows[1], td_loader_sequence_at(e, 3, 499));
    assert_int_equal(rows[2], td_loader_sequence_at(e, 4, 0));
    td_loader_tell(e, &near_end);
    assert_int_equal(near_end.epoch, 4);
    assert_int_equal(near_end.index, 3);
    td_loader_destroy(e);
    td_loader_destroy(a);
    td_tokfile_close(f);
}

static void test_loader_seek_errors(void **state)
{
    td_tokfile *f = positions_file("seek.tok", 801);
    td_loader *l = make_loader(f, 2, 8, 7), *other = make_loader(f, 2, 8, 8), *longer = make_loader(f, 2, 16, 7);
    td_loader_position pos;
    td_loader_tell(l, &pos);
    assert_int_equal(td_loader_seek(other, &pos), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "does not belong to"));
    assert_non_null(strstr(td_error_msg(), "seek.tok"));
    assert_int_equal(td_loader_seek(longer, &pos), TD_ERR_INVALID);
    pos.index = 100; /* 100 sequences: indices 0..99 */
    assert_int_equal(td_loader_seek(l, &pos), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "past the 100 sequences"));
    pos.index = 99;
    TD_ASSERT_OK(td_loader_seek(l, &pos));
    td_loader_destroy(l);
    td_loader_destroy(other);
    td_loader_destroy(longer);
    /* other data, same shape: the fingerprint differs */
    td_tokfile *g = positions_file("seek2.tok", 802);
    td_loader *m = make_loader(g, 2, 8, 7);
    pos.index = 0;
    assert_int_equal(td_loader_seek(m, &pos), TD_ERR_INVALID);
    td_loader_destroy(m);
    td_tokfile_close(g);
    td_tokfile_close(f);
}

static void test_loader_heldout(void **state)
{
    td_tokfile *f = positions_file("held.tok", 10001);
    td_loader_params p = td_loader_default_params();
    p.batch = 4;
    p.seq = 10; /* 1000 sequences */
    p.heldout_percent = 10;
    td_loader *train = NULL, *held = NULL;
    TD_ASSERT_OK(td_loader_create(f, &p, &train));
    p.split = TD_DATA_HELDOUT;
    p.shuffle = 0;
    TD_ASSERT_OK(td_loader_create(f, &p, &held));
    assert_int_equal(td_loader_sequences(train), 900);
    assert_int_equal(td_loader_sequences(held), 100);
    assert_int_equal(td_loader_first_sequence(held), 900);
    unsigned char seen[1000] = {0};
    for (uint64_t i = 0; i < 900; i++) {
        uint64_t q = td_loader_sequence_at(train, 0, i);
        assert_true(q < 900);
        seen[q]++;
    }
    for (uint64_t i = 0; i < 100; i++) {
        uint64_t q = td_loader_sequence_at(held, 0, i);
        assert_int_equal(q, 900 + i); /* in order */
        seen[q]++;
    }
    for (int i = 0; i < 1000; i++) assert_int_equal(seen[i], 1);
    uint64_t rows[4];
    next_rows(held, 4, 10, rows);
    assert_int_equal(rows[0], 900);
    assert_int_equal(rows[3], 903);
    td_loader_position a, b;
    td_loader_tell(train, &a);
    td_loader_tell(held, &b);
    assert_true(a.fingerprint != b.fingerprint);
    td_loader_destroy(train);
    td_loader_destroy(held);

    p.heldout_percent = 0.01; /* rounds to 0: at least one */
    TD_ASSERT_OK(td_loader_create(f, &p, &held));
    assert_int_equal(td_loader_sequences(held), 1);
    td_loader_destroy(held);
    td_loader *bad = (td_loader *)1;
    p.heldout_percent = 0;
    assert_int_equal(td_loader_create(f, &p, &bad), TD_ERR_INVALID);
    assert_null(bad);
    assert_non_null(strstr(td_error_msg(), "held-out split is empty"));
    p.heldout_percent = 100;
    assert_int_equal(td_loader_create(f, &p, &bad), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "outside [0, 100)"));
    p.heldout_percent = 99.99; /* holds out everything */
    assert_int_equal(td_loader_create(f, &p, &bad), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "leaves none to train on"));
    td_tokfile_close(f);
}

static void test_loader_errors(void **state)
{
    td_tokfile *f = positions_file("few.tok", 10);
    td_loader_params p = td_loader_default_params();
    p.seq = 9;
    td_loader *l = NULL;
    TD_ASSERT_OK(td_loader_create(f, &p, &l)); /* 10 tokens: one sequence of 9 + 1 */
    assert_int_equal(td_loader_sequences(l), 1);
    td_loader_destroy(l);
    p.seq = 10;
    assert_int_equal(td_loader_create(f, &p, &l), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "few.tok' has 10 tokens, too few for one sequence of 10 + 1"));
    p.seq = 4;
    p.batch = 0;
    assert_int_equal(td_loader_create(f, &p, &l), TD_ERR_INVALID);
    td_tokfile_close(f);
    p.batch = 1;
    assert_int_equal(td_loader_open(tmp_path("none.tok"), &p, &l), TD_ERR_IO);
    assert_null(l);
    assert_non_null(strstr(td_error_msg(), "none.tok"));
    const char *junk = "TDTOKENS but not really a token file at all, just text";
    write_text(tmp_path("junk.tok"), junk, strlen(junk));
    assert_int_equal(td_loader_open(tmp_path("junk.tok"), &p, &l), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "junk.tok"));
    /* td_loader_open owns its file */
    td_tokfile_close(positions_file("own.tok", 100));
    TD_ASSERT_OK(td_loader_open(tmp_path("own.tok"), &p, &l));
    assert_int_equal(td_tokfile_count(td_loader_file(l)), 100);
    td_loader_destroy(l);
}

/* ---- tidal prepare -------------------------------------------------------------- */

/* Runs `tidal prepare ARGS...` with its output silenced; returns the exit code. */
static int prepare(const char *first, ...)
{
    char *argv[32];
    int argc = 0;
    va_list ap;
    va_start(ap, first);
    for (const char *a = first; a; a = va_arg(ap, const char *)) argv[argc++] = (char *)a;
    va_end(ap);
    fflush(stdout);
    fflush(stderr);
    int out = dup(1), err = dup(2), null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    int rc = td_cli_prepare_main(argc, argv);
    fflush(stdout);
    fflush(stderr);
    dup2(out, 1);
    dup2(err, 2);
    close(out);
    close(err);
    close(null);
    return rc;
}

/* The token file decoded with the byte tokenizer (td_malloc'd). */
static char *decode_file(const char *path, size_t *len, td_tokenizer *t)
{
    td_tokfile *f = NULL;
    TD_ASSERT_OK(td_tokfile_open(path, &f));
    size_t n = td_tokfile_count(f);
    uint32_t *ids = malloc(n * sizeof *ids + 1);
    for (size_t i = 0; i < n; i++) ids[i] = td_tokfile_at(f, i);
    assert_int_equal(td_tokfile_get_info(f)->vocab_size, td_tokenizer_vocab_size(t));
    assert_int_equal(td_tokfile_get_info(f)->tokenizer, td_tokenizer_kind_of(t));
    char *text;
    TD_ASSERT_OK(td_tokenizer_decode(t, ids, n, &text, len));
    free(ids);
    td_tokfile_close(f);
    return text;
}

static void test_prepare_file_and_folder(void **state)
{
    td_tokenizer *t = NULL;
    TD_ASSERT_OK(td_tokenizer_create_byte(&t));
    mkdir(tmp_path("in"), 0777);
    mkdir(tmp_path("in/sub"), 0777);
    write_text(tmp_path("in/b.txt"), "beta text\n", 10);
    write_text(tmp_path("in/a.txt"), "alpha", 5);
    write_text(tmp_path("in/sub/c.txt"), "gamma", 5);
    write_text(tmp_path("in/.hidden"), "secret", 6);
    write_text(tmp_path("in/bin.dat"), "bi\0nary", 7);
    write_text(tmp_path("in/empty"), "", 0);
    assert_int_equal(symlink("a.txt", tmp_path("in/link.txt")), 0);
    assert_int_equal(symlink("..", tmp_path("in/sub/up")), 0); /* a loop */

    assert_int_equal(prepare("--input", tmp_path("in"), "--out", tmp_path("out/deep/x.tok"), NULL), 0);
    size_t len;
    char *text = decode_file(tmp_path("out/deep/x.tok"), &len, t);
    assert_string_equal(text, "alpha<|endoftext|>beta text\n<|endoftext|>gamma");
    td_free(text);
    assert_int_equal(count_entries(tmp_path("out/deep")), 1);

    assert_int_equal(prepare("--input", tmp_path("in/b.txt"), "--out", tmp_path("one.tok"), "--quiet", NULL), 0);
    text = decode_file(tmp_path("one.tok"), &len, t);
    assert_string_equal(text, "beta text\n");
    td_free(text);

    /* standard input */
    write_text(tmp_path("stdin.txt"), "from stdin <|endoftext|> too", 28);
    int saved = dup(0), fd = open(tmp_path("stdin.txt"), O_RDONLY);
    dup2(fd, 0);
    int rc = prepare("--input=-", "--out=" , NULL);
    assert_int_equal(rc, 2); /* empty --out value */
    rc = prepare("--input=-", "--out", tmp_path("stdin.tok"), "--block", "16", NULL);
    dup2(saved, 0);
    close(saved);
    close(fd);
    assert_int_equal(rc, 0);
    text = decode_file(tmp_path("stdin.tok"), &len, t);
    assert_string_equal(text, "from stdin <|endoftext|> too");
    td_free(text);
    td_tokenizer_destroy(t);
}

/* GPT-2 BPE through tiny blocks equals encoding each document whole. */
static void test_prepare_gpt2_streamed(void **state)
{
    char vocab[512], merges[512];
    const char *f = __FILE__, *slash = strrchr(f, '/');
    snprintf(vocab, sizeof vocab, "%.*s/data/tok/gpt2_prefix/vocab.json", (int)(slash - f), f);
    snprintf(merges, sizeof merges, "%.*s/data/tok/gpt2_prefix/merges.txt", (int)(slash - f), f);
    td_tokenizer *t = NULL;
    TD_ASSERT_OK(td_tokenizer_load_gpt2(vocab, merges, &t));
    static const char *const words[] = {"the", " the", " cat", "\n", "\n\n", "  ", "\t", "it's", " 1,000", "!",
                                        " ünï", " 中文", "😀", " don't", "\r\n", " <|endoftext|>", "aaaaaaaaaaaaaaaa"};
    size_t cap = 200000, n = 0;
    char *text = malloc(cap);
    td_rng rng;
    td_rng_seed(&rng, 99);
    while (n + 32 < cap) {
        const char *w = words[td_rng_below(&rng, sizeof words / sizeof words[0])];
        memcpy(text + n, w, strlen(w));
        n += strlen(w);
    }
    write_text(tmp_path("big.txt"), text, n);
    uint32_t *want;
    size_t n_want;
    TD_ASSERT_OK(td_tokenizer_encode_alloc(t, text, n, &want, &n_want));
    const char *blocks[] = {"16", "100", "4KiB", "16MiB"};
    for (int b = 0; b < 4; b++) {
        assert_int_equal(prepare("--input", tmp_path("big.txt"), "--out", tmp_path("big.tok"), "--tokenizer", "gpt2",
                                 "--vocab", vocab, "--merges", merges, "--block", blocks[b], NULL), 0);
        td_tokfile *tf = NULL;
        TD_ASSERT_OK(td_tokfile_open(tmp_path("big.tok"), &tf));
        assert_int_equal(td_tokfile_count(tf), n_want);
        assert_int_equal(td_tokfile_get_info(tf)->vocab_size, 50257);
        for (size_t i = 0; i < n_want; i++)
            if (td_tokfile_at(tf, i) != want[i]) fail_msg("--block %s: token %zu differs", blocks[b], i);
        td_tokfile_close(tf);
    }
    td_free(want);
    free(text);
    td_tokenizer_destroy(t);
}

static void test_prepare_errors(void **state)
{
    char out[512];
    snprintf(out, sizeof out, "%s", tmp_path("keep.tok"));
    write_text(out, "previous", 8);
    write_text(tmp_path("text.txt"), "some text", 9);
    write_text(tmp_path("empty.txt"), "", 0);
    write_text(tmp_path("bad_vocab.json"), "{\"a\": 0}", 8);
    assert_int_equal(prepare("--input", tmp_path("missing.txt"), "--out", out, NULL), 1);
    assert_int_equal(prepare("--input", tmp_path("text.txt"), "--out", out, "--tokenizer", "gpt2", "--vocab",
                             tmp_path("bad_vocab.json"), "--merges", tmp_path("text.txt"), NULL), 1);
    assert_int_equal(prepare("--input", tmp_path("empty.txt"), "--out", out, NULL), 1);
    assert_int_equal(prepare("--input", tmp_path("text.txt"), "--out", out, "--tokenizer", "bpe", NULL), 2);
    assert_int_equal(prepare("--input", tmp_path("text.txt"), "--out", out, "--tokenizer", "gpt2", NULL), 2);
    assert_int_equal(prepare("--input", tmp_path("text.txt"), "--out", out, "--vocab", "v.json", NULL), 2);
    assert_int_equal(prepare("--input", tmp_path("text.txt"), "--out", out, "--block", "8", NULL), 2);
    assert_int_equal(prepare("--input", tmp_path("text.txt"), "--out", out, "--frobnicate", NULL), 2);
    assert_int_equal(prepare("--input", tmp_path("text.txt"), NULL), 2);
    assert_int_equal(prepare("--out", out, NULL), 2);
    assert_int_equal(prepare("--input", NULL), 2);
    assert_int_equal(prepare("--help", NULL), 0);
    /* every failure left the previous file alone */
    size_t n;
    unsigned char *raw = read_all(out, &n);
    assert_int_equal(n, 8);
    assert_memory_equal(raw, "previous", 8);
    free(raw);
    /* an output that cannot be written: a folder in the way, a file as a folder */
    mkdir(tmp_path("e"), 0777);
    mkdir(tmp_path("e/taken.tok"), 0777);
    assert_int_equal(prepare("--input", tmp_path("text.txt"), "--out", tmp_path("e/taken.tok"), NULL), 1);
    assert_int_equal(count_entries(tmp_path("e")), 1); /* no temporary left */
    assert_int_equal(prepare("--input", tmp_path("text.txt"), "--out", tmp_path("text.txt/x.tok"), NULL), 1);
    /* a folder with no text */
    mkdir(tmp_path("e/only_binary"), 0777);
    write_text(tmp_path("e/only_binary/x.bin"), "\0\1\2", 3);
    assert_int_equal(prepare("--input", tmp_path("e/only_binary"), "--out", tmp_path("e/o.tok"), NULL), 1);
    assert_int_equal(count_entries(tmp_path("e")), 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crc32),
        cmocka_unit_test(test_round_trip_uint16),
        cmocka_unit_test(test_round_trip_uint32),
        cmocka_unit_test(test_writer_atomic),
        cmocka_unit_test(test_corrupt_truncated),
        cmocka_unit_test(test_corrupt_every_byte),
        cmocka_unit_test(test_corrupt_messages),
        cmocka_unit_test(test_random_garbage),
        cmocka_unit_test(test_loader_sequential_content),
        cmocka_unit_test(test_loader_permutations),
        cmocka_unit_test(test_loader_determinism_and_resume),
        cmocka_unit_test(test_loader_seek_errors),
        cmocka_unit_test(test_loader_heldout),
        cmocka_unit_test(test_loader_errors),
        cmocka_unit_test(test_prepare_file_and_folder),
        cmocka_unit_test(test_prepare_gpt2_streamed),
        cmocka_unit_test(test_prepare_errors),
    };
    return cmocka_run_group_tests(tests, setup_tmp, teardown_tmp);
}
