/* safetensors reader and writer.
 *
 * Round trips (every dtype, scalars, empty tensors, escaped names and
 * metadata, pieces of random sizes, tensors larger than the staging buffer),
 * conversions on read and write against convert.h (RNE ties), each
 * validation rule with the exact complaint, the writer's order and
 * completeness checks, atomic replacement (abort and a real I/O failure leave
 * the old file and no temporary), allocation failures that leak nothing, a
 * fuzz of corrupted files (never a crash: run under ASan by `make test
 * SANITIZE=address,undefined`), and concurrent reads. */
#include "td_test.h"
#include "tidal/convert.h"
#include "tidal/safetensors.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static char tmp_root[256];

static int setup_dir(void **state)
{
    snprintf(tmp_root, sizeof tmp_root, "/tmp/td_st_XXXXXX");
    if (!mkdtemp(tmp_root)) return -1;
    return 0;
}

static int teardown_dir(void **state)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_root);
    return system(cmd) == 0 ? 0 : -1;
}

static const char *tpath(const char *name)
{
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", tmp_root, name);
    return buf[k];
}

static int count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    if (d) closedir(d);
    return n;
}

static unsigned char *slurp(const char *path, size_t *n)
{
    return (unsigned char *)td_test_slurp(path, n);
}

static void spit(const char *path, const void *bytes, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(bytes, 1, n, f), n);
    fclose(f);
}

/* A file made of a header (with length `len`, or its real length if len < 0)
 * and `data_bytes` data bytes. */
static void write_raw(const char *path, const char *header, long long len, size_t data_bytes)
{
    size_t h = strlen(header);
    uint64_t n = len < 0 ? h : (uint64_t)len;
    unsigned char *b = calloc(1, 8 + h + data_bytes + 1);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(n >> (8 * i));
    memcpy(b + 8, header, h);
    for (size_t i = 0; i < data_bytes; i++) b[8 + h + i] = (unsigned char)(i * 7);
    spit(path, b, 8 + h + data_bytes);
    free(b);
}

/* Opening `path` fails with `code` and a message containing every given piece. */
static void expect_open_error(const char *path, td_status code, const char *piece1, const char *piece2)
{
    td_st_reader *r = NULL;
    td_status st = td_st_open(path, &r);
    if (st == TD_OK) {
        td_st_close(r);
        fail_msg("%s opened, expected an error containing '%s'", path, piece1);
    }
    assert_null(r);
    assert_int_equal(st, code);
    const char *msg = td_error_msg();
    if (!strstr(msg, path)) fail_msg("message does not name the file: %s", msg);
    if (piece1 && !strstr(msg, piece1)) fail_msg("message lacks '%s': %s", piece1, msg);
    if (piece2 && !strstr(msg, piece2)) fail_msg("message lacks '%s': %s", piece2, msg);
}

/* --- dtypes --------------------------------------------------------------- */

static void test_dtype_names(void **state)
{
    for (int i = 0; i < TD_ST_DTYPE_COUNT; i++) {
        td_st_dtype dt;
        TD_ASSERT_OK(td_st_dtype_parse(td_st_dtype_name((td_st_dtype)i), &dt));
        assert_int_equal(dt, i);
        assert_true(td_st_dtype_bytes(dt) >= 1 && td_st_dtype_bytes(dt) <= 8);
    }
    td_st_dtype dt;
    assert_int_equal(td_st_dtype_parse("float32", &dt), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "BF16"));
    assert_int_equal(td_st_dtype_bytes(TD_ST_BF16), 2);
    assert_int_equal(td_st_dtype_bytes(TD_ST_I64), 8);
    assert_true(td_st_dtype_convertible(TD_ST_F32, TD_ST_BF16));
    assert_true(td_st_dtype_convertible(TD_ST_I32, TD_ST_I32));
    assert_false(td_st_dtype_convertible(TD_ST_I32, TD_ST_F32));
    assert_false(td_st_dtype_convertible(TD_ST_F64, TD_ST_F32));
}

/* --- round trips ---------------------------------------------------------- */

typedef struct spec {
    const char *name;
    td_st_dtype dtype;
    int ndim;
    uint64_t shape[3];
} spec;

static const spec specs[] = {
    {"big", TD_ST_F32, 2, {1024, 800}},          /* 3.1 MiB: larger than the staging buffer */
    {"h.0.attn \"q\"\\k\n", TD_ST_BF16, 1, {37}}, /* a name that needs escaping */
    {"scalar", TD_ST_I64, 0, {0}},
    {"empty", TD_ST_F16, 2, {0, 5}},
    {"bytes", TD_ST_U8, 1, {3}},                 /* odd size: the next tensor is unaligned */
    {"rng", TD_ST_U64, 1, {4}},
    {"small", TD_ST_I32, 3, {2, 3, 4}},
    {"d", TD_ST_F64, 1, {5}},
    {"\xc3\xa9t\xc3\xa9", TD_ST_F16, 1, {9}},     /* UTF-8 */
};
#define N_SPECS (sizeof specs / sizeof specs[0])

static uint64_t spec_bytes(const spec *s)
{
    uint64_t n = td_st_dtype_bytes(s->dtype);
    for (int d = 0; d < s->ndim; d++) n *= s->shape[d];
    return n;
}

static unsigned char pattern(size_t t, uint64_t i) { return (unsigned char)(i * 131 + t * 17 + (i >> 8)); }

/* Writes specs[] with pieces of random sizes. */
static void write_specs(const char *path, td_rng *rng)
{
    td_st_writer *w;
    TD_ASSERT_OK(td_st_writer_create(path, &w));
    TD_ASSERT_OK(td_st_writer_add_metadata(w, "format", "pt"));
    TD_ASSERT_OK(td_st_writer_add_metadata(w, "note", "quote \" backslash \\ newline \n tab \t \x01 end"));
    for (size_t t = 0; t < N_SPECS; t++) {
        size_t idx;
        TD_ASSERT_OK(td_st_writer_declare(w, specs[t].name, specs[t].dtype, specs[t].ndim, specs[t].shape, &idx));
        assert_int_equal(idx, t);
    }
    for (size_t t = 0; t < N_SPECS; t++) {
        uint64_t n = spec_bytes(&specs[t]);
        unsigned char *b = malloc(n + 1);
        for (uint64_t i = 0; i < n; i++) b[i] = pattern(t, i);
        for (uint64_t at = 0; at < n;) {
            uint64_t k = 1 + td_rng_below(rng, td_rng_below(rng, 2) ? 64 : 1500000);
            if (k > n - at) k = n - at;
            TD_ASSERT_OK(td_st_writer_write(w, t, b + at, k));
            at += k;
        }
        free(b);
    }
    assert_int_equal(td_st_writer_next(w), N_SPECS);
    TD_ASSERT_OK(td_st_writer_commit(w));
}

static void test_round_trip(void **state)
{
    const size_t live = td_host_live_allocs();
    td_rng rng;
    td_rng_seed(&rng, 1);
    const char *path = tpath("rt.safetensors");
    write_specs(path, &rng);
    assert_int_equal(count_entries(tmp_root), 1); /* no temporary left */
    assert_int_equal(td_host_live_allocs(), live);

    /* Header layout: length, JSON, data 8-byte aligned. */
    size_t n;
    unsigned char *raw = slurp(path, &n);
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--) h = h << 8 | raw[i];
    assert_int_equal((8 + h) % 8, 0);
    assert_int_equal(raw[8], '{');
    assert_memory_equal(raw + 9, "\"__metadata__\"", 14);
    free(raw);

    td_st_reader *r;
    TD_ASSERT_OK(td_st_open(path, &r));
    assert_int_equal(td_st_tensor_count(r), N_SPECS);
    assert_int_equal(td_st_metadata_count(r), 2);
    assert_string_equal(td_st_metadata(r, "format"), "pt");
    assert_string_equal(td_st_metadata(r, "note"), "quote \" backslash \\ newline \n tab \t \x01 end");
    assert_null(td_st_metadata(r, "absent"));
    uint64_t off = 8 + h;
    for (size_t t = 0; t < N_SPECS; t++) {
        const td_st_tensor *x = td_st_tensor_at(r, t); /* file order = declaration order */
        assert_string_equal(x->name, specs[t].name);
        assert_ptr_equal(td_st_find(r, specs[t].name), x);
        assert_int_equal(x->dtype, specs[t].dtype);
        assert_int_equal(x->ndim, specs[t].ndim);
        for (int d = 0; d < x->ndim; d++) assert_int_equal(x->shape[d], specs[t].shape[d]);
        assert_int_equal(x->bytes, spec_bytes(&specs[t]));
        assert_int_equal(x->file_offset, off);
        off += x->bytes;
        unsigned char *b = malloc(x->bytes + 1);
        TD_ASSERT_OK(td_st_read_bytes(r, x, 0, x->bytes, b));
        for (uint64_t i = 0; i < x->bytes; i++)
            if (b[i] != pattern(t, i)) fail_msg("tensor %zu byte %llu differs", t, (unsigned long long)i);
        if (x->bytes > 10) { /* a byte range */
            TD_ASSERT_OK(td_st_read_bytes(r, x, 3, 7, b));
            for (uint64_t i = 0; i < 7; i++) assert_int_equal(b[i], pattern(t, i + 3));
        }
        free(b);
    }
    assert_int_equal(off, td_st_file_bytes(r));
    assert_null(td_st_find(r, "nope"));
    const td_st_tensor *x;
    assert_int_equal(td_st_get(r, "nope", &x), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "'nope'"));
    assert_non_null(strstr(td_error_msg(), path));
    /* Out-of-range reads are refused. */
    unsigned char b[16];
    x = td_st_find(r, "bytes");
    assert_int_equal(td_st_read_bytes(r, x, 2, 2, b), TD_ERR_INVALID);
    assert_int_equal(td_st_read(r, x, 0, 4, TD_ST_U8, b), TD_ERR_INVALID);
    assert_int_equal(td_st_read(r, x, 0, 3, TD_ST_F32, b), TD_ERR_INVALID); /* U8 -> F32: no */
    assert_non_null(strstr(td_error_msg(), "cannot be read as F32"));
    td_st_close(r);
    assert_int_equal(td_host_live_allocs(), live);
}

/* Values whose conversions exercise rounding: ties both ways, subnormals,
 * overflow, infinities, NaN. */
static float tricky(uint64_t i, td_rng *rng)
{
    static const uint32_t bits[] = {
        0x3f808000u, /* 1 + 2^-8: bf16 tie, rounds down to even */
        0x3f818000u, /* bf16 tie, rounds up to even */
        0x3f808001u, /* just above a tie */
        0x3f801000u, /* fp16 tie (1 + 2^-11) */
        0x3f803000u, /* fp16 tie, rounds up */
        0x00000001u, /* smallest subnormal */
        0x387fc000u, /* fp16 subnormal range */
        0x477ff000u, /* 65520: fp16 overflow */
        0x7f7fffffu, /* FLT_MAX: bf16 overflow */
        0x7f800000u, 0xff800000u, 0x7fc00001u, 0x80000000u,
    };
    if (i < sizeof bits / sizeof bits[0]) return td_f32_from_bits(bits[i]);
    return (float)((td_rng_uniform(rng) - 0.5) * 8.0);
}

static void test_conversions(void **state)
{
    const size_t live = td_host_live_allocs();
    td_rng rng;
    td_rng_seed(&rng, 7);
    const size_t n = 100000; /* the narrowing read loops over its 64 KiB buffer */
    float *src = malloc(n * 4), *back = malloc(n * 4);
    uint16_t *h = malloc(n * 2);
    for (size_t i = 0; i < n; i++) src[i] = tricky(i, &rng);
    const char *path = tpath("conv.safetensors");
    /* Written from F32 into each format, converted by the writer. */
    td_st_writer *w;
    uint64_t shape[1] = {n};
    TD_ASSERT_OK(td_st_writer_create(path, &w));
    TD_ASSERT_OK(td_st_writer_declare(w, "f32", TD_ST_F32, 1, shape, NULL));
    TD_ASSERT_OK(td_st_writer_declare(w, "bf16", TD_ST_BF16, 1, shape, NULL));
    TD_ASSERT_OK(td_st_writer_declare(w, "f16", TD_ST_F16, 1, shape, NULL));
    for (size_t t = 0; t < 3; t++)
        for (size_t at = 0; at < n; at += 30001)
            TD_ASSERT_OK(td_st_writer_write_convert(w, t, TD_ST_F32, src + at, n - at < 30001 ? n - at : 30001));
    TD_ASSERT_OK(td_st_writer_commit(w));

    td_st_reader *r;
    TD_ASSERT_OK(td_st_open(path, &r));
    const td_st_tensor *f32 = td_st_find(r, "f32"), *bf16 = td_st_find(r, "bf16"), *f16 = td_st_find(r, "f16");
    /* Stored bits are the RNE conversions. */
    TD_ASSERT_OK(td_st_read(r, bf16, 0, n, TD_ST_BF16, h));
    for (size_t i = 0; i < n; i++) assert_int_equal(h[i], td_bf16_from_f32(src[i]));
    assert_int_equal(h[0], 0x3f80);
    assert_int_equal(h[1], 0x3f82);
    assert_int_equal(h[2], 0x3f81);
    TD_ASSERT_OK(td_st_read(r, f16, 0, n, TD_ST_F16, h));
    for (size_t i = 0; i < n; i++) assert_int_equal(h[i], td_f16_from_f32(src[i]));
    /* Narrowing reads (F32 file -> 16-bit) round the same way. */
    TD_ASSERT_OK(td_st_read(r, f32, 0, n, TD_ST_BF16, h));
    for (size_t i = 0; i < n; i++) assert_int_equal(h[i], td_bf16_from_f32(src[i]));
    TD_ASSERT_OK(td_st_read(r, f32, 5, n - 5, TD_ST_F16, h));
    for (size_t i = 5; i < n; i++) assert_int_equal(h[i - 5], td_f16_from_f32(src[i]));
    /* Widening reads are exact, also from an offset. */
    TD_ASSERT_OK(td_st_read(r, bf16, 0, n, TD_ST_F32, back));
    for (size_t i = 0; i < n; i++)
        assert_int_equal(td_f32_bits(back[i]), td_f32_bits(td_f32_from_bf16(td_bf16_from_f32(src[i]))));
    TD_ASSERT_OK(td_st_read(r, f16, 11, 1000, TD_ST_F32, back));
    for (size_t i = 0; i < 1000; i++)
        assert_int_equal(td_f32_bits(back[i]), td_f32_bits(td_f32_from_f16(td_f16_from_f32(src[i + 11]))));
    /* Same width: bf16 -> f16 goes through the exact f32 value, one rounding. */
    TD_ASSERT_OK(td_st_read(r, bf16, 0, n, TD_ST_F16, h));
    for (size_t i = 0; i < n; i++)
        assert_int_equal(h[i], td_f16_from_f32(td_f32_from_bf16(td_bf16_from_f32(src[i]))));
    TD_ASSERT_OK(td_st_read(r, f32, 0, n, TD_ST_F32, back));
    assert_memory_equal(back, src, n * 4);
    td_st_close(r);
    free(src);
    free(back);
    free(h);
    assert_int_equal(td_host_live_allocs(), live);
}

/* --- writer misuse -------------------------------------------------------- */

static void test_writer_order_and_completeness(void **state)
{
    const size_t live = td_host_live_allocs();
    const char *path = tpath("w.safetensors");
    spit(path, "old contents", 12);
    td_st_writer *w;
    uint64_t s4[1] = {4}, s2[1] = {2};
    float v[4] = {1, 2, 3, 4};
    TD_ASSERT_OK(td_st_writer_create(path, &w));
    TD_ASSERT_OK(td_st_writer_declare(w, "a", TD_ST_F32, 1, s4, NULL));
    TD_ASSERT_OK(td_st_writer_declare(w, "b", TD_ST_F32, 1, s2, NULL));
    assert_int_equal(td_st_writer_declare(w, "__metadata__", TD_ST_F32, 1, s2, NULL), TD_ERR_INVALID);
    assert_int_equal(td_st_writer_declare(w, "", TD_ST_F32, 1, s2, NULL), TD_ERR_INVALID);
    assert_int_equal(td_st_writer_declare(w, "x", TD_ST_F32, 9, s2, NULL), TD_ERR_INVALID);
    assert_int_equal(td_st_writer_declare(w, "bad\xff", TD_ST_F32, 1, s2, NULL), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "not valid UTF-8"));
    assert_int_equal(td_st_writer_add_metadata(w, "k2", "\xc3"), TD_ERR_INVALID);
    TD_ASSERT_OK(td_st_writer_add_metadata(w, "k", "v"));
    assert_int_equal(td_st_writer_add_metadata(w, "k", "w"), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "\"k\" given twice"));
    /* Out of order: b before a is complete. */
    TD_ASSERT_OK(td_st_writer_write(w, 0, v, 8));
    assert_int_equal(td_st_writer_write(w, 1, v, 8), TD_ERR_STATE);
    assert_non_null(strstr(td_error_msg(), "tensor 'b' (index 1) arrived while tensor 'a' (index 0) "
                                           "still needs 8 of its 16 bytes"));
    /* A piece past the tensor's end. */
    assert_int_equal(td_st_writer_write(w, 0, v, 12), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "runs past the end of tensor 'a'"));
    assert_int_equal(td_st_writer_declare(w, "late", TD_ST_F32, 1, s2, NULL), TD_ERR_STATE);
    assert_int_equal(td_st_writer_add_metadata(w, "late", "x"), TD_ERR_STATE);
    /* Converted pieces need an element boundary. */
    TD_ASSERT_OK(td_st_writer_write(w, 0, v, 2));
    assert_int_equal(td_st_writer_write_convert(w, 0, TD_ST_BF16, v, 1), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "element boundary"));
    TD_ASSERT_OK(td_st_writer_write(w, 0, (char *)v + 2, 6));
    assert_int_equal(td_st_writer_next(w), 1);
    /* Incomplete at commit: an error naming the tensor; old file intact, no temporary. */
    assert_int_equal(td_st_writer_commit(w), TD_ERR_STATE);
    assert_non_null(strstr(td_error_msg(), "tensor 'b' (index 1 of 2) has 0 of its 8 bytes"));
    size_t n;
    unsigned char *raw = slurp(path, &n);
    assert_int_equal(n, 12);
    assert_memory_equal(raw, "old contents", 12);
    free(raw);
    assert_int_equal(count_entries(tmp_root), 1);

    /* Duplicate names are found when the header is built. */
    TD_ASSERT_OK(td_st_writer_create(path, &w));
    TD_ASSERT_OK(td_st_writer_declare(w, "a", TD_ST_F32, 1, s4, NULL));
    TD_ASSERT_OK(td_st_writer_declare(w, "b", TD_ST_F32, 1, s4, NULL));
    TD_ASSERT_OK(td_st_writer_declare(w, "a", TD_ST_F32, 1, s2, NULL));
    assert_int_equal(td_st_writer_write(w, 0, v, 4), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "tensor 'a' declared twice"));
    assert_int_equal(td_st_writer_write(w, 0, v, 4), TD_ERR_STATE); /* the writer stays failed */
    td_st_writer_abort(w);
    assert_int_equal(count_entries(tmp_root), 1);

    /* Abort after data was written: old file intact, no temporary. */
    TD_ASSERT_OK(td_st_writer_create(path, &w));
    TD_ASSERT_OK(td_st_writer_declare(w, "a", TD_ST_F32, 1, s4, NULL));
    TD_ASSERT_OK(td_st_writer_write(w, 0, v, 16));
    assert_int_equal(count_entries(tmp_root), 2);
    td_st_writer_abort(w);
    raw = slurp(path, &n);
    assert_memory_equal(raw, "old contents", 12);
    free(raw);
    assert_int_equal(count_entries(tmp_root), 1);

    /* A file with no tensors at all is valid. */
    TD_ASSERT_OK(td_st_writer_create(path, &w));
    TD_ASSERT_OK(td_st_writer_commit(w));
    td_st_reader *r;
    TD_ASSERT_OK(td_st_open(path, &r));
    assert_int_equal(td_st_tensor_count(r), 0);
    td_st_close(r);
    assert_int_equal(td_host_live_allocs(), live);
}

/* A real I/O failure in the middle of a file (RLIMIT_FSIZE -> EFBIG). */
static void test_writer_io_failure(void **state)
{
    const size_t live = td_host_live_allocs();
    const char *path = tpath("io.safetensors");
    spit(path, "previous", 8);
    struct rlimit old;
    getrlimit(RLIMIT_FSIZE, &old);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim = {1 << 20, old.rlim_max};
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    td_st_writer *w;
    uint64_t shape[1] = {1 << 20};
    float *v = calloc(1 << 20, 4);
    TD_ASSERT_OK(td_st_writer_create(path, &w));
    TD_ASSERT_OK(td_st_writer_declare(w, "big", TD_ST_F32, 1, shape, NULL));
    td_status st = td_st_writer_write(w, 0, v, (size_t)4 << 20);
    if (st == TD_OK) st = td_st_writer_commit(w);
    else td_st_writer_abort(w);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    assert_int_equal(st, TD_ERR_IO);
    assert_non_null(strstr(td_error_msg(), "cannot write"));
    size_t n;
    unsigned char *raw = slurp(path, &n);
    assert_int_equal(n, 8);
    assert_memory_equal(raw, "previous", 8);
    free(raw);
    free(v);
    assert_int_equal(count_entries(tmp_root), 1);
    /* The atomic small-file writer: a missing directory is a clean error. */
    assert_int_equal(td_write_file_atomic(tpath("no/such/dir/f"), "x", 1), TD_ERR_IO);
    assert_non_null(strstr(td_error_msg(), "cannot create"));
    assert_int_equal(td_host_live_allocs(), live);
}

/* --- validation ----------------------------------------------------------- */

static void test_validation_errors(void **state)
{
    const size_t live = td_host_live_allocs();
    const char *p = tpath("bad.safetensors");
    const char *ok1 = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";

    spit(p, "abc", 3);
    expect_open_error(p, TD_ERR_INVALID, "shorter than the 8-byte header length", NULL);
    write_raw(p, ok1, 1000, 8);
    expect_open_error(p, TD_ERR_INVALID, "header length 1000 runs past the end", NULL);
    write_raw(p, ok1, (long long)1 << 40, 8);
    expect_open_error(p, TD_ERR_INVALID, "exceeds the 100000000-byte limit", NULL);
    write_raw(p, "[1,2]", -1, 0);
    expect_open_error(p, TD_ERR_INVALID, "does not start with '{'", NULL);
    write_raw(p, "{\"a\":{\"dtype\":\"F32\",", -1, 0);
    expect_open_error(p, TD_ERR_INVALID, "not valid JSON", NULL);
    write_raw(p, "{} x", -1, 0);
    expect_open_error(p, TD_ERR_INVALID, "bytes after its JSON object", NULL);
    write_raw(p, "{\"\xff\":1}", -1, 0);
    expect_open_error(p, TD_ERR_INVALID, "not valid UTF-8", NULL);
    write_raw(p, "{\"a\":{\"dtype\":\"F31\",\"shape\":[2],\"data_offsets\":[0,8]}}", -1, 8);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'a'", "unknown dtype \"F31\"");
    write_raw(p, "{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", -1, 8);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'a'", "no \"dtype\"");
    write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", -1, 8);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'a'", "3 elements of F32 need 12 bytes but data_offsets [0, 8] hold 8");
    write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", -1, 4);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'a'", "run past the end of the data (4 bytes)");
    write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", -1, 8);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'a'", "end before they begin");
    write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", -1, 8);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'a'", "[begin, end]");
    write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", -1, 8);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'a'", "shape[0] is not a non-negative integer");
    write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}}", -1, 8);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'a'", "shape[0]");
    write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,2],\"data_offsets\":[0,8]}}", -1, 8);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'a'", "9 dimensions");
    write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[0,8]}}", -1, 8);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'a'", "overflows 64 bits");
    write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1e300],\"data_offsets\":[0,8]}}", -1, 8);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'a'", "shape[0]");
    write_raw(p, "{\"a\":5}", -1, 0);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'a'", "not a JSON object");
    write_raw(p, "{\"__metadata__\":{\"k\":1}}", -1, 0);
    expect_open_error(p, TD_ERR_INVALID, "__metadata__ value of \"k\" is not a string", NULL);
    write_raw(p, "{\"__metadata__\":[]}", -1, 0);
    expect_open_error(p, TD_ERR_INVALID, "\"__metadata__\" is not an object", NULL);
    /* Overlap, whatever the header order. */
    write_raw(p, "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]},"
                 "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", -1, 12);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'b' (bytes [4, 12)) overlaps tensor 'a'", NULL);
    write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}", -1, 12);
    expect_open_error(p, TD_ERR_INVALID, "data bytes [4, 8) before tensor 'b' belong to no tensor", NULL);
    write_raw(p, ok1, -1, 12);
    expect_open_error(p, TD_ERR_INVALID, "the last 4 data bytes belong to no tensor", NULL);
    write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                 "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", -1, 8);
    expect_open_error(p, TD_ERR_INVALID, "tensor 'a' appears twice", NULL);
    expect_open_error(tpath("missing.safetensors"), TD_ERR_IO, "cannot open", NULL);

    /* Valid although unsorted, padded with spaces, with zero-size tensors and a scalar. */
    write_raw(p, "{\"z\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[8,16]},"
                 "\"e\":{\"dtype\":\"BF16\",\"shape\":[0,3],\"data_offsets\":[8,8]},"
                 "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}   ", -1, 16);
    td_st_reader *r;
    TD_ASSERT_OK(td_st_open(p, &r));
    assert_int_equal(td_st_tensor_count(r), 3);
    assert_string_equal(td_st_tensor_at(r, 0)->name, "a");
    assert_int_equal(td_st_find(r, "z")->ndim, 0);
    assert_int_equal(td_st_find(r, "z")->numel, 1);
    assert_int_equal(td_st_find(r, "e")->numel, 0);
    td_st_close(r);
    assert_int_equal(td_host_live_allocs(), live);
}

/* --- fuzz ----------------------------------------------------------------- */

/* Opens a corrupted file: either a clean error, or a file whose every tensor
 * reads back (in full, with conversion where allowed). */
static void open_fuzzed(const char *path, size_t live)
{
    td_st_reader *r = NULL;
    td_status st = td_st_open(path, &r);
    if (st != TD_OK) {
        assert_true(st == TD_ERR_INVALID || st == TD_ERR_IO);
        assert_true(strlen(td_error_msg()) > 0);
        assert_null(r);
    } else {
        for (size_t i = 0; i < td_st_tensor_count(r); i++) {
            const td_st_tensor *t = td_st_tensor_at(r, i);
            assert_true(t->file_offset + t->bytes <= td_st_file_bytes(r));
            unsigned char *b = malloc(t->bytes * 2 + 8);
            TD_ASSERT_OK(td_st_read_bytes(r, t, 0, t->bytes, b));
            if (td_st_dtype_convertible(t->dtype, TD_ST_F32))
                TD_ASSERT_OK(td_st_read(r, t, 0, t->numel, TD_ST_F32, b));
            free(b);
        }
        td_st_close(r);
    }
    assert_int_equal(td_host_live_allocs(), live);
}

static void test_fuzz_corruptions(void **state)
{
    const size_t live = td_host_live_allocs();
    td_rng rng;
    td_rng_seed(&rng, 99);
    /* A small valid file. */
    const char *good = tpath("good.safetensors");
    td_st_writer *w;
    TD_ASSERT_OK(td_st_writer_create(good, &w));
    TD_ASSERT_OK(td_st_writer_add_metadata(w, "format", "pt"));
    const uint64_t shapes[4][2] = {{3, 4}, {5, 0}, {7, 1}, {2, 2}};
    const td_st_dtype dts[4] = {TD_ST_F32, TD_ST_BF16, TD_ST_F16, TD_ST_I64};
    const char *names[4] = {"wte.weight", "h.0.ln_1.bias", "x", "step"};
    for (int i = 0; i < 4; i++) TD_ASSERT_OK(td_st_writer_declare(w, names[i], dts[i], 2, shapes[i], NULL));
    unsigned char junk[256];
    for (int i = 0; i < 256; i++) junk[i] = (unsigned char)i;
    for (int i = 0; i < 4; i++)
        TD_ASSERT_OK(td_st_writer_write(w, (size_t)i, junk, shapes[i][0] * shapes[i][1] * td_st_dtype_bytes(dts[i])));
    TD_ASSERT_OK(td_st_writer_commit(w));
    size_t n;
    unsigned char *orig = slurp(good, &n);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | orig[i];
    unsigned char *buf = malloc(n + 64);
    const char *bad = tpath("fuzz.safetensors");
    const int iters = 400 * td_test_seeds(5);
    for (int it = 0; it < iters; it++) {
        size_t len = n;
        memcpy(buf, orig, n);
        switch (it % 6) {
        case 0: /* flip a few bytes, mostly in the header */
            for (int k = 0, m = 1 + (int)td_rng_below(&rng, 4); k < m; k++) {
                size_t at = td_rng_below(&rng, 3) ? 8 + td_rng_below(&rng, hlen) : td_rng_below(&rng, n);
                buf[at] ^= (unsigned char)(1 + td_rng_below(&rng, 255));
            }
            break;
        case 1: /* truncate */
            len = td_rng_below(&rng, n);
            break;
        case 2: /* bogus header length */ {
            uint64_t v = td_rng_below(&rng, 4) == 0 ? td_rng_next(&rng) : td_rng_below(&rng, n + 16);
            for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(v >> (8 * i));
            break;
        }
        case 3: /* a digit of the header replaced: shapes and offsets go wrong */ {
            for (int tries = 0; tries < 64; tries++) {
                size_t at = 8 + td_rng_below(&rng, hlen);
                if (buf[at] >= '0' && buf[at] <= '9') {
                    buf[at] = (unsigned char)('0' + td_rng_below(&rng, 10));
                    break;
                }
            }
            break;
        }
        case 4: /* huge numbers spliced into the header */ {
            static const char *huge[] = {"18446744073709551615", "9007199254740993", "1e999", "-1",
                                         "4294967296", "0.5", "99999999999"};
            const char *s = huge[td_rng_below(&rng, 7)];
            size_t at = 8 + td_rng_below(&rng, hlen), sl = strlen(s);
            if (at + sl < 8 + hlen) memcpy(buf + at, s, sl);
            break;
        }
        case 5: /* random bytes appended or the data region shifted */
            if (td_rng_below(&rng, 2)) {
                len = n + 1 + td_rng_below(&rng, 32);
                for (size_t i = n; i < len; i++) buf[i] = (unsigned char)td_rng_next(&rng);
            } else {
                size_t cut = 8 + hlen + td_rng_below(&rng, n - 8 - hlen); /* a data byte removed */
                memmove(buf + cut, buf + cut + 1, n - cut - 1);
                len = n - 1;
            }
            break;
        }
        spit(bad, buf, len);
        open_fuzzed(bad, live);
    }
    /* Hand-made overlapping and bogus-offset headers among valid data. */
    for (int it = 0; it < 200; it++) {
        char hdr[512];
        uint64_t a0 = td_rng_below(&rng, 24), a1 = a0 + 4 * td_rng_below(&rng, 4);
        uint64_t b0 = td_rng_below(&rng, 24), b1 = b0 + 4 * td_rng_below(&rng, 4);
        snprintf(hdr, sizeof hdr,
                 "{\"a\":{\"dtype\":\"F32\",\"shape\":[%llu],\"data_offsets\":[%llu,%llu]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[%llu],\"data_offsets\":[%llu,%llu]}}",
                 (unsigned long long)((a1 - a0) / 4), (unsigned long long)a0, (unsigned long long)a1,
                 (unsigned long long)((b1 - b0) / 4), (unsigned long long)b0, (unsigned long long)b1);
        write_raw(bad, hdr, -1, td_rng_below(&rng, 28));
        open_fuzzed(bad, live);
    }
    free(buf);
    free(orig);
}

/* --- allocation failures ---------------------------------------------------- */

static void test_alloc_failures(void **state)
{
    const size_t live = td_host_live_allocs();
    const char *path = tpath("fault.safetensors");
    td_rng rng;
    td_rng_seed(&rng, 3);
    write_specs(path, &rng);
    /* Reader: every allocation failing in turn gives an error and no leak. */
    int completed = 0;
    for (long k = 1; k < 100 && !completed; k++) {
        td_st_reader *r = NULL;
        td_fault_arm(TD_FAULT_HOST_ALLOC, k);
        td_status st = td_st_open(path, &r);
        td_fault_disarm_all();
        if (st == TD_OK) {
            completed = 1;
            td_st_close(r);
        } else {
            assert_int_equal(st, TD_ERR_NOMEM);
            assert_null(r);
        }
        assert_int_equal(td_host_live_allocs(), live);
    }
    assert_true(completed);
    /* Writer: failures anywhere leave the previous file and no temporary. */
    completed = 0;
    for (long k = 1; k < 100 && !completed; k++) {
        td_fault_arm(TD_FAULT_HOST_ALLOC, k);
        td_st_writer *w = NULL;
        uint64_t shape[1] = {1000};
        float v[1000] = {0};
        td_status st = td_st_writer_create(path, &w);
        if (st == TD_OK) st = td_st_writer_add_metadata(w, "a", "b");
        for (int t = 0; t < 20 && st == TD_OK; t++) {
            char name[16];
            snprintf(name, sizeof name, "t%d", t);
            st = td_st_writer_declare(w, name, TD_ST_BF16, 1, shape, NULL);
        }
        for (size_t t = 0; t < 20 && st == TD_OK; t++) st = td_st_writer_write_convert(w, t, TD_ST_F32, v, 1000);
        if (st == TD_OK) {
            st = td_st_writer_commit(w);
            completed = st == TD_OK;
        } else {
            td_st_writer_abort(w);
        }
        td_fault_disarm_all();
        if (!completed) {
            assert_int_equal(st, TD_ERR_NOMEM);
            td_st_reader *r;
            TD_ASSERT_OK(td_st_open(path, &r)); /* the previous file, intact */
            assert_int_equal(td_st_tensor_count(r), N_SPECS);
            td_st_close(r);
        }
        assert_int_equal(count_entries(tmp_root), 1);
        assert_int_equal(td_host_live_allocs(), live);
    }
    assert_true(completed);
}

/* --- concurrency ------------------------------------------------------------ */

static void test_concurrent_reads(void **state)
{
    const char *path = tpath("mt.safetensors");
    const size_t n = 1 << 18;
    float *v = malloc(n * 4);
    for (size_t i = 0; i < n; i++) v[i] = (float)i;
    td_st_writer *w;
    uint64_t shape[1] = {n};
    TD_ASSERT_OK(td_st_writer_create(path, &w));
    TD_ASSERT_OK(td_st_writer_declare(w, "v", TD_ST_F32, 1, shape, NULL));
    TD_ASSERT_OK(td_st_writer_write(w, 0, v, n * 4));
    TD_ASSERT_OK(td_st_writer_commit(w));
    td_st_reader *r;
    TD_ASSERT_OK(td_st_open(path, &r));
    const td_st_tensor *t = td_st_find(r, "v");
    int bad = 0;
#pragma omp parallel for num_threads(4) reduction(+ : bad)
    for (int piece = 0; piece < 64; piece++) {
        const size_t per = n / 64;
        float out[4096];
        for (size_t at = 0; at < per; at += 4096) {
            size_t base = (size_t)piece * per + at;
            if (td_st_read(r, t, base, 4096, TD_ST_F32, out) != TD_OK) bad++;
            for (size_t i = 0; i < 4096; i++) bad += out[i] != (float)(base + i);
        }
    }
    assert_int_equal(bad, 0);
    td_st_close(r);
    free(v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtype_names),
        cmocka_unit_test_setup_teardown(test_round_trip, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_conversions, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_writer_order_and_completeness, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_writer_io_failure, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_validation_errors, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_fuzz_corruptions, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_alloc_failures, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_concurrent_reads, setup_dir, teardown_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
