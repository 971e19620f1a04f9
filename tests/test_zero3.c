/* ZeRO-3 data parallelism, the parts below the trainer: the sharding
 * arithmetic of chunks over ranks (against brute force, sizes not divisible
 * by the rank count), the loader's per-rank slices of every global batch
 * (N ranks see exactly the sequences of one rank with N times the batch,
 * and the position resumes on any rank count), the agreement of settings
 * at start (a differing flag is named with both values on every rank), and
 * checkpoints written by a group of forked ranks, each its shard ranges
 * (byte-identical to one process streaming the same values; read back on
 * any number of ranks; a rank with a different header, a missing range, or
 * a rank that dies leaves the old checkpoint in place). */
#include "td_test.h"
#include "td_ranks.h"
#include "../parallel/parallel_impl.h"

#include "tidal/checkpoint.h"
#include "tidal/data.h"
#include "tidal/parallel.h"
#include "tidal/shard.h"
#include "tidal/memmgr.h"
#include "tidal/arena.h"
#include "tidal/copy.h"
#include "tidal/hostpool.h"

#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[64];

static int setup(void **state)
{
    snprintf(dir, sizeof dir, "/tmp/td_zero3_XXXXXX");
    return mkdtemp(dir) ? 0 : -1;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    return remove(path);
}

static int teardown(void **state)
{
    return nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = (*s += 0x9E3779B97F4A7C15ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* ---- sharding arithmetic ---------------------------------------------------- */

static void check_layout(size_t numel, int ranks, size_t align, uint64_t *seed)
{
    td_shard_layout l;
    TD_ASSERT_OK(td_shard_layout_make(numel, ranks, align, &l));
    size_t a = align ? align : 1;
    assert_int_equal(l.shard_numel % a, 0);
    assert_int_equal(l.padded_numel, l.shard_numel * (size_t)ranks);
    assert_true(l.padded_numel >= numel);
    /* the smallest aligned equal shards that cover the chunk */
    if (l.shard_numel >= a) assert_true((l.shard_numel - a) * (size_t)ranks < numel);
    size_t next = 0;
    for (int r = 0; r < ranks; r++) {
        size_t b, e;
        size_t n = td_shard_range(&l, r, &b, &e);
        assert_int_equal(n, e - b);
        assert_true(n <= l.shard_numel);
        if (n) {
            assert_int_equal(b, next); /* consecutive, disjoint */
            assert_int_equal(b, (size_t)r * l.shard_numel);
            assert_int_equal(td_shard_owner(&l, b), r);
            assert_int_equal(td_shard_owner(&l, e - 1), r);
        } else {
            assert_int_equal(b, numel);
        }
        next = e > next ? e : next;
    }
    assert_int_equal(next, numel); /* covered */
    for (int k = 0; k < 20 && numel; k++) {
        size_t off = (size_t)(rng_next(seed) % numel), n = (size_t)(rng_next(seed) % (numel - off + 1));
        size_t total = 0;
        for (int r = 0; r < ranks; r++) {
            size_t b, e, want = 0, first = SIZE_MAX;
            size_t got = td_shard_intersect(&l, r, off, n, &b, &e);
            for (size_t i = off; i < off + n; i++)
                if (td_shard_owner(&l, i) == r) {
                    want++;
                    if (first == SIZE_MAX) first = i;
                }
            assert_int_equal(got, want);
            assert_int_equal(e - b, got);
            if (got) assert_int_equal(b, first);
            total += got;
        }
        assert_int_equal(total, n);
    }
}

static void test_shard_layout(void **state)
{
    uint64_t seed = 7;
    static const size_t sizes[] = {0, 1, 2, 3, 5, 7, 64, 100, 127, 128, 1000, 4097, 65536 + 3};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
        for (int ranks = 1; ranks <= 8; ranks++) {
            check_layout(sizes[s], ranks, 1, &seed);
            check_layout(sizes[s], ranks, 64, &seed);
            check_layout(sizes[s], ranks, 0, &seed);
        }
    for (int k = 0; k < td_test_seeds(200); k++)
        check_layout((size_t)(rng_next(&seed) % 100000), 1 + (int)(rng_next(&seed) % 16),
                     (size_t)(rng_next(&seed) % 3 == 0 ? 1 : 128), &seed);
    /* exact values: 10 elements over 4 ranks -> shards of 3, the last rank owns 1 */
    td_shard_layout l;
    size_t b, e;
    TD_ASSERT_OK(td_shard_layout_make(10, 4, 1, &l));
    assert_int_equal(l.shard_numel, 3);
    assert_int_equal(l.padded_numel, 12);
    assert_int_equal(td_shard_range(&l, 3, &b, &e), 1);
    assert_int_equal(b, 9);
    /* 3 elements over 4 ranks: rank 3 owns nothing */
    TD_ASSERT_OK(td_shard_layout_make(3, 4, 1, &l));
    assert_int_equal(td_shard_range(&l, 3, &b, &e), 0);
    assert_int_equal(td_shard_bytes(&l, 2), 2);
    assert_int_equal(td_shard_layout_make(10, 0, 1, &l), TD_ERR_INVALID);
    assert_int_equal(td_shard_layout_make(SIZE_MAX, 3, 1 << 20, &l), TD_ERR_INVALID);
}

/* ---- the loader's slices ---------------------------------------------------------- */

static void write_tokens(const char *path, uint64_t n, uint64_t seed)
{
    td_tokfile_writer *w = NULL;
    TD_ASSERT_OK(td_tokfile_writer_open(path, TD_TOKENIZER_BYTE, 257, 256, &w));
    for (uint64_t i = 0; i < n; i++) {
        uint32_t id = (uint32_t)(rng_next(&seed) % 257);
        TD_ASSERT_OK(td_tokfile_writer_append(w, &id, 1));
    }
    TD_ASSERT_OK(td_tokfile_writer_commit(w));
}

static void test_loader_slices(void **state)
{
    char path[128];
    snprintf(path, sizeof path, "%s/tokens.bin", dir);
    /* 8 + 1 tokens a sequence, 23 sequences: global batches straddle epochs */
    const uint32_t T = 8, B = 2, calls = 9;
    write_tokens(path, 23 * T + 1, 3);
    for (int shuffle = 0; shuffle <= 1; shuffle++)
        for (uint32_t N = 1; N <= 4; N++) {
            td_loader_params p = td_loader_default_params();
            p.seq = T;
            p.seed = 11;
            p.shuffle = shuffle;
            p.batch = N * B;
            td_loader *one = NULL, *rank[4] = {NULL};
            TD_ASSERT_OK(td_loader_open(path, &p, &one));
            p.batch = B;
            p.ranks = N;
            for (uint32_t r = 0; r < N; r++) {
                p.rank = r;
                TD_ASSERT_OK(td_loader_open(path, &p, &rank[r]));
            }
            int32_t in1[4 * 2 * 8], tg1[4 * 2 * 8], in[2 * 8], tg[2 * 8];
            for (uint32_t c = 0; c < calls; c++) {
                TD_ASSERT_OK(td_loader_next(one, in1, tg1, NULL));
                td_loader_position p1, pr;
                td_loader_tell(one, &p1);
                for (uint32_t r = 0; r < N; r++) {
                    TD_ASSERT_OK(td_loader_next(rank[r], in, tg, NULL));
                    /* rank r's slice is rows [r B, (r + 1) B) of the one-rank batch */
                    assert_memory_equal(in, in1 + (size_t)r * B * T, sizeof in);
                    assert_memory_equal(tg, tg1 + (size_t)r * B * T, sizeof tg);
                    td_loader_tell(rank[r], &pr);
                    assert_memory_equal(&pr, &p1, sizeof pr); /* the same global position */
                }
            }
            td_loader_destroy(one);
            for (uint32_t r = 0; r < N; r++) td_loader_destroy(rank[r]);
        }
    /* a position saved on 2 ranks resumes on 3 and on 1 with the global stream */
    td_loader_params p = td_loader_default_params();
    p.seq = T;
    p.seed = 5;
    p.batch = B;
    p.ranks = 2;
    td_loader *two = NULL, *three = NULL, *one = NULL;
    TD_ASSERT_OK(td_loader_open(path, &p, &two));
    int32_t in[6 * 8], tg[6 * 8], inr[2 * 8], tgr[2 * 8];
    for (int c = 0; c < 5; c++) TD_ASSERT_OK(td_loader_next(two, inr, tgr, NULL));
    td_loader_position pos;
    td_loader_tell(two, &pos);
    p.ranks = 3;
    p.rank = 2;
    TD_ASSERT_OK(td_loader_open(path, &p, &three));
    TD_ASSERT_OK(td_loader_seek(three, &pos));
    p.ranks = 1;
    p.rank = 0;
    p.batch = 3 * B;
    TD_ASSERT_OK(td_loader_open(path, &p, &one));
    TD_ASSERT_OK(td_loader_seek(one, &pos));
    TD_ASSERT_OK(td_loader_next(one, in, tg, NULL));
    TD_ASSERT_OK(td_loader_next(three, inr, tgr, NULL));
    assert_memory_equal(inr, in + 2 * B * T, sizeof inr);
    td_loader_destroy(two);
    td_loader_destroy(three);
    td_loader_destroy(one);
    /* a rank outside the job */
    p.batch = B;
    p.ranks = 2;
    p.rank = 2;
    assert_int_equal(td_loader_open(path, &p, &one), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "rank 2 is not below the 2 ranks"));
}

/* ---- agreement at start ----------------------------------------------------------- */

typedef struct agree_ctx {
    int mode; /* 0 all agree, 1 rank 2 differs on --lr, 2 rank 1 has one setting more */
} agree_ctx;

static int agree_body(int rank, int size, int port, void *ctx)
{
    const agree_ctx *a = ctx;
    td_dist_env e = td_test_local_env(rank, size, port);
    td_rdv *r = NULL;
    if (td_rdv_join(&e, 10000, &r)) return td_test_rank_fail(rank, "join");
    char long_value[400];
    memset(long_value, 'x', sizeof long_value - 1);
    long_value[sizeof long_value - 1] = 0;
    td_dist_setting s[] = {
        {"model", "gpt2-tiny"}, {"data", "1234 9abc"}, {"--lr", "0.0003"}, {"--seed", "1"}, {"long", long_value},
        {"--extra", "1"},
    };
    size_t n = 5;
    if (a->mode == 1 && rank == 2) s[2].value = "0.001";
    if (a->mode == 2 && rank == 1) n = 6;
    td_status st = td_rdv_agree(r, s, n);
    int code = 0;
    const char *msg = td_error_msg();
    if (a->mode == 0 && st != TD_OK) code = td_test_rank_fail(rank, "agree");
    if (a->mode == 1 && (st != TD_ERR_INVALID ||
                         !strstr(msg, "ranks disagree on --lr: rank 0 has '0.0003', rank 2 has '0.001'"))) code = 2;
    if (a->mode == 2 && (st != TD_ERR_INVALID || !strstr(msg, "rank 0 has 5, rank 1 has 6") ||
                         !strstr(msg, "--extra"))) code = 3;
    if (code > 1) fprintf(stderr, "rank %d: agreement said (%d) %s\n", rank, (int)st, msg);
    /* the link still works after a disagreement */
    if (!code && td_rdv_barrier(r)) code = td_test_rank_fail(rank, "barrier");
    td_rdv_close(r);
    return code;
}

static void test_agree(void **state)
{
    int codes[4];
    for (int mode = 0; mode <= 2; mode++) {
        agree_ctx a = {mode};
        td_test_run_ranks(mode == 0 ? 3 : mode == 1 ? 4 : 2, agree_body, &a, codes);
        td_test_expect_codes(mode == 0 ? 3 : mode == 1 ? 4 : 2, codes, NULL);
    }
    /* one rank: nothing to compare */
    td_dist_env e = td_test_local_env(0, 1, 0);
    td_rdv *r = NULL;
    TD_ASSERT_OK(td_rdv_join(&e, 1000, &r));
    td_dist_setting s = {"k", "v"};
    TD_ASSERT_OK(td_rdv_agree(r, &s, 1));
    td_rdv_close(r);
}

/* ---- naming a failed rank ---------------------------------------------------------- */

/* What a timeout's message is built from: the links found closed (rank 0
 * sees every rank, the others rank 0), and rank 0's notice of which rank
 * failed, which the others read from their notice link. */
static int dead_body(int rank, int size, int port, void *ctx)
{
    td_dist_env e = td_test_local_env(rank, size, port);
    td_rdv *r = NULL;
    if (td_rdv_join(&e, 10000, &r)) return td_test_rank_fail(rank, "join");
    if (td_rdv_barrier(r)) return td_test_rank_fail(rank, "barrier");
    if (rank == 2) _exit(0);
    char dead[128] = "";
    int code = 0;
    if (rank == 0) {
        double until = td_now_ms() + 20000; /* generous: CI machines are loaded */
        int first = -1;
        do first = td_rdv_dead_peers(r, dead, sizeof dead);
        while (strcmp(dead, "rank 2") && td_now_ms() < until && (td_sleep_us(10000), 1));
        if (strcmp(dead, "rank 2") || first != 2) code = 2;
        td_rdv_notify_fault(r, 2, "rank 2 closed the job's connection");
    } else {
        int failed = -1;
        char why[128];
        if (td_rdv_dead_peers(r, dead, sizeof dead) != -1 || dead[0]) code = 3; /* rank 0 is alive */
        else if (!td_rdv_fault_notice(r, 20000, &failed, why, sizeof why) || failed != 2 ||
                 strcmp(why, "rank 2 closed the job's connection"))
            code = 4;
    }
    if (code) fprintf(stderr, "rank %d: dead peers '%s' (code %d)\n", rank, dead, code);
    td_rdv_close(r);
    return code;
}

static void test_dead_peers(void **state)
{
    int codes[3];
    td_test_run_ranks(3, dead_body, NULL, codes);
    int want[3] = {0, 0, 0};
    td_test_expect_codes(3, codes, want);
}

/* ---- checkpoints written by a group ------------------------------------------------ */

static const td_model_desc cfg = {
    .n_layer = 2, .n_head = 2, .n_embd = 12, .n_positions = 8, .vocab_size = 21, .padded_vocab_size = 24,
};

/* The value of element j of parameter p's tensor `kind` (0 weight, 1.. state) in generation gen. */
static float val(int gen, int kind, int p, uint64_t j)
{
    uint64_t k = ((uint64_t)gen * 4 + (uint64_t)kind) * 1000003u + (uint64_t)p * 7919u + j * 104729u;
    return (float)((double)((int64_t)(k % 2001u) - 1000) * 1e-3);
}

static uint64_t total_numel(void)
{
    uint64_t t = 0;
    for (int i = 0; i < td_model_hf_count(&cfg); i++) {
        td_model_hf_tensor p;
        td_model_hf_get(&cfg, i, &p);
        t += p.numel;
    }
    return t;
}

static void save_meta(td_ckpt_writer *w, int gen, const char *note, int *rng)
{
    uint64_t shape[1] = {3};
    TD_ASSERT_OK(td_ckpt_writer_set_meta_u64(w, "step", (uint64_t)gen));
    TD_ASSERT_OK(td_ckpt_writer_set_meta(w, "note", note));
    TD_ASSERT_OK(td_ckpt_writer_declare_extra(w, "rng", TD_ST_U64, 1, shape, rng));
}

/* One process streaming generation gen: the reference bytes. */
static void save_stream_sharded(const char *path, int gen, td_dtype wdt, uint64_t shard_bytes)
{
    td_ckpt_write_options o = td_ckpt_write_default_options();
    o.weight_dtype = wdt;
    o.shard_bytes = shard_bytes;
    td_ckpt_writer *w = NULL;
    int rng;
    TD_ASSERT_OK(td_ckpt_writer_begin(path, &cfg, &o, &w));
    save_meta(w, gen, "same", &rng);
    float *buf = malloc(1 << 16);
    for (int i = 0; i < td_model_hf_count(&cfg); i++) {
        td_model_hf_tensor p;
        td_model_hf_get(&cfg, i, &p);
        for (uint64_t j = 0; j < p.numel; j++) buf[j] = val(gen, 0, i, j);
        TD_ASSERT_OK(td_ckpt_writer_put_weight(w, i, TD_DTYPE_F32, buf));
        for (int k = 0; k < TD_CKPT_STATE_COUNT; k++) {
            for (uint64_t j = 0; j < p.numel; j++) buf[j] = val(gen, 1 + k, i, j);
            TD_ASSERT_OK(td_ckpt_writer_append_state(w, i, (td_ckpt_state)k, buf, p.numel));
        }
    }
    uint64_t words[3] = {(uint64_t)gen, 2, 3};
    TD_ASSERT_OK(td_ckpt_writer_append_extra(w, rng, words, sizeof words));
    TD_ASSERT_OK(td_ckpt_writer_commit(w));
    free(buf);
}

static void save_stream(const char *path, int gen, td_dtype wdt) { save_stream_sharded(path, gen, wdt, 0); }

typedef struct group_ctx {
    const char *path;
    int gen;
    td_dtype wdt;
    int fault;      /* 0 none, 1 rank 1 declares other metadata, 2 rank 1 skips a range, 3 rank 1 dies before commit */
    int align;
    uint64_t shard_bytes; /* weights in files of at most this (0: one) */
} group_ctx;

static td_status rdv_allgather(void *arg, const void *mine, size_t bytes, void *all)
{
    return td_rdv_allgather(arg, mine, bytes, all);
}

/* Each rank writes its shard of the model's parameters laid end to end (one
 * chunk over every tensor, so shards cut tensors, rows included). */
static int group_body(int rank, int size, int port, void *vctx)
{
    const group_ctx *g = vctx;
    td_dist_env e = td_test_local_env(rank, size, port);
    td_rdv *r = NULL;
    if (td_rdv_join(&e, 10000, &r)) return td_test_rank_fail(rank, "join");
    td_ckpt_group grp = { .rank = rank, .size = size, .allgather = rdv_allgather, .arg = r };
    td_ckpt_write_options o = td_ckpt_write_default_options();
    o.weight_dtype = g->wdt;
    o.shard_bytes = g->shard_bytes;
    o.group = &grp;
    td_ckpt_writer *w = NULL;
    int rng, code = 0;
    td_status st = TD_OK;
    td_shard_layout l;
    float *buf = malloc(1 << 16);
    td_shard_layout_make(total_numel(), size, (size_t)g->align, &l);
    if ((st = td_ckpt_writer_begin(g->path, &cfg, &o, &w))) goto fail;
    save_meta(w, g->gen, g->fault == 1 && rank == 1 ? "other" : "same", &rng);
    if ((st = td_ckpt_writer_begin_ranges(w))) goto fail;
    uint64_t at = 0;
    int skip = g->fault == 2 && rank == 1; /* its first range */
    for (int i = 0; i < td_model_hf_count(&cfg); i++) {
        td_model_hf_tensor p;
        td_model_hf_get(&cfg, i, &p);
        size_t b, end;
        if (td_shard_intersect(&l, rank, at, p.numel, &b, &end) && !(skip && !(skip = 0))) {
            const uint64_t off = b - at, n = end - b;
            for (uint64_t j = 0; j < n; j++) buf[j] = val(g->gen, 0, i, off + j);
            if ((st = td_ckpt_writer_write_weight(w, i, off, TD_DTYPE_F32, buf, n))) goto fail;
            for (int k = 0; k < TD_CKPT_STATE_COUNT; k++) {
                for (uint64_t j = 0; j < n; j++) buf[j] = val(g->gen, 1 + k, i, off + j);
                if ((st = td_ckpt_writer_write_state(w, i, (td_ckpt_state)k, off, buf, n))) goto fail;
            }
        }
        at += p.numel;
    }
    if (rank == 0) {
        uint64_t words[3] = {(uint64_t)g->gen, 2, 3};
        if ((st = td_ckpt_writer_write_extra(w, rng, 0, words, sizeof words))) goto fail;
    }
    if (g->fault == 3 && rank == 1) _exit(9);
    st = td_ckpt_writer_commit(w);
    w = NULL;
fail:
    if (st) {
        /* the faults' expected messages, the same on every rank */
        const char *msg = td_error_msg();
        int expected = (g->fault == 1 && strstr(msg, "rank 1's train_state.safetensors header differs")) ||
                       (g->fault == 2 && strstr(msg, "must cover every tensor once")) ||
                       (g->fault == 3 && (strstr(msg, "rank 1") || strstr(msg, "rank 0")));
        code = expected ? 5 : td_test_rank_fail(rank, "group save");
        if (!expected) code = 1;
    }
    td_ckpt_writer_abort(w);
    td_rdv_close(r);
    free(buf);
    return code;
}

static int files_equal(const char *a, const char *b)
{
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int same = fa && fb;
    while (same) {
        int ca = fgetc(fa), cb = fgetc(fb);
        if (ca != cb) same = 0;
        if (ca == EOF || cb == EOF) break;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}

/* Every file of checkpoint a is in b with the same bytes, and b has no other. */
static void expect_same_ckpt(const char *a, const char *b)
{
    int na = 0, nb = 0;
    for (int pass = 0; pass < 2; pass++) {
        DIR *d = opendir(pass ? b : a);
        assert_non_null(d);
        struct dirent *e;
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.') continue;
            if (pass) {
                nb++;
                continue;
            }
            char pa[512], pb[512];
            snprintf(pa, sizeof pa, "%s/%s", a, e->d_name);
            snprintf(pb, sizeof pb, "%s/%s", b, e->d_name);
            if (!files_equal(pa, pb)) fail_msg("%s differs from %s", pb, pa);
            na++;
        }
        closedir(d);
    }
    assert_int_equal(na, nb);
    assert_true(na >= 3);
}

static void test_group_save(void **state)
{
    char ref[128], path[128];
    static const td_dtype wdts[] = {TD_DTYPE_F32, TD_DTYPE_BF16};
    for (int d = 0; d < 2; d++) {
        snprintf(ref, sizeof ref, "%s/ref%d", dir, d);
        save_stream(ref, 1, wdts[d]);
        for (int n = 1; n <= 4; n++)
            for (int align = 1; align <= 64; align *= 64) {
                snprintf(path, sizeof path, "%s/group%d_%d_%d", dir, d, n, align);
                int codes[4];
                group_ctx g = { .path = path, .gen = 1, .wdt = wdts[d], .align = align };
                td_test_run_ranks(n, group_body, &g, codes);
                td_test_expect_codes(n, codes, NULL);
                expect_same_ckpt(ref, path);
                /* a second save replaces the first (the exchange or aside path) */
                td_test_run_ranks(n, group_body, &g, codes);
                td_test_expect_codes(n, codes, NULL);
                expect_same_ckpt(ref, path);
            }
    }
}

/* Weights in several files with their index (Hugging Face shards), written by 3 ranks. */
static void test_group_save_shards(void **state)
{
    char ref[128], path[128];
    snprintf(ref, sizeof ref, "%s/shards_ref", dir);
    snprintf(path, sizeof path, "%s/shards", dir);
    save_stream_sharded(ref, 2, TD_DTYPE_F32, 3000);
    char index[160];
    snprintf(index, sizeof index, "%s/%s.index.json", ref, TD_CKPT_MODEL_FILE);
    assert_int_equal(access(index, F_OK), 0);
    int codes[3];
    group_ctx g = { .path = path, .gen = 2, .wdt = TD_DTYPE_F32, .align = 1, .shard_bytes = 3000 };
    td_test_run_ranks(3, group_body, &g, codes);
    td_test_expect_codes(3, codes, NULL);
    expect_same_ckpt(ref, path);
    td_ckpt_reader *r = NULL;
    TD_ASSERT_OK(td_ckpt_reader_open(path, &cfg, &r));
    float x[8];
    TD_ASSERT_OK(td_ckpt_reader_get_weight_range(r, td_model_hf_count(&cfg) - 1, 0, 8, TD_DTYPE_F32, x));
    for (int j = 0; j < 8; j++) assert_true(x[j] == val(2, 0, td_model_hf_count(&cfg) - 1, (uint64_t)j));
    td_ckpt_reader_close(r);
}

static void test_group_save_faults(void **state)
{
    char ref[128], path[128];
    snprintf(ref, sizeof ref, "%s/fault_ref", dir);
    snprintf(path, sizeof path, "%s/fault", dir);
    save_stream(ref, 1, TD_DTYPE_F32);
    int codes[3];
    group_ctx g = { .path = path, .gen = 1, .wdt = TD_DTYPE_F32, .align = 1 };
    td_test_run_ranks(3, group_body, &g, codes);
    td_test_expect_codes(3, codes, NULL);
    for (int fault = 1; fault <= 3; fault++) {
        group_ctx bad = { .path = path, .gen = 2, .wdt = TD_DTYPE_F32, .fault = fault, .align = 1 };
        td_test_run_ranks(3, group_body, &bad, codes);
        int want[3] = {5, fault == 3 ? 9 : 5, 5};
        td_test_expect_codes(3, codes, want);
        expect_same_ckpt(ref, path); /* the old checkpoint, untouched */
        char tmp[160];
        TD_ASSERT_OK(td_ckpt_recover(path));
        snprintf(tmp, sizeof tmp, "%s.old", path);
        assert_int_equal(access(tmp, F_OK), -1);
    }
    /* nothing left beside it: the temporary directories are gone */
    char cmd[256], out[64] = "";
    snprintf(cmd, sizeof cmd, "ls -d %s/fault.tmp.* 2>/dev/null | wc -l", dir);
    FILE *f = popen(cmd, "r");
    assert_non_null(fgets(out, sizeof out, f));
    pclose(f);
    assert_int_equal(atoi(out), 0);
}

/* Reading any rank's ranges of a checkpoint, whatever wrote it, against the whole tensors. */
static void test_read_ranges(void **state)
{
    char path[128];
    snprintf(path, sizeof path, "%s/read", dir);
    int codes[2];
    group_ctx g = { .path = path, .gen = 4, .wdt = TD_DTYPE_F32, .align = 1 };
    td_test_run_ranks(2, group_body, &g, codes); /* written by 2 ranks */
    td_test_expect_codes(2, codes, NULL);
    td_ckpt_reader *r = NULL;
    TD_ASSERT_OK(td_ckpt_reader_open(path, &cfg, &r));
    float *whole = malloc(1 << 16), *part = malloc(1 << 16);
    uint16_t *half = malloc(1 << 15);
    for (int n = 1; n <= 3; n++) { /* read on 1, 2 and 3 ranks */
        td_shard_layout l;
        TD_ASSERT_OK(td_shard_layout_make(total_numel(), n, 1, &l));
        for (int rank = 0; rank < n; rank++) {
            uint64_t at = 0;
            for (int i = 0; i < td_model_hf_count(&cfg); i++) {
                td_model_hf_tensor p;
                td_model_hf_get(&cfg, i, &p);
                TD_ASSERT_OK(td_ckpt_reader_get_weight(r, i, TD_DTYPE_F32, whole));
                size_t b, e;
                if (td_shard_intersect(&l, rank, at, p.numel, &b, &e)) {
                    TD_ASSERT_OK(td_ckpt_reader_get_weight_range(r, i, b - at, e - b, TD_DTYPE_F32, part));
                    assert_memory_equal(part, whole + (b - at), (e - b) * sizeof(float));
                    for (uint64_t j = b - at; j < e - at; j++) {
                        float want = j < p.hf_numel ? val(4, 0, i, j) : 0.0f; /* wte's padding rows read 0 */
                        if (part[j - (b - at)] != want) fail_msg("param %d element %llu", i, (unsigned long long)j);
                    }
                    TD_ASSERT_OK(td_ckpt_reader_read_state(r, i, TD_CKPT_STATE_ADAM_V, b - at, e - b, part));
                    for (uint64_t j = b - at; j < e - at; j++) assert_true(part[j - (b - at)] == val(4, 3, i, j));
                    TD_ASSERT_OK(td_ckpt_reader_get_weight_range(r, i, b - at, e - b, TD_DTYPE_BF16, half));
                }
                at += p.numel;
            }
        }
    }
    /* random ranges of every tensor */
    uint64_t seed = 9;
    for (int i = 0; i < td_model_hf_count(&cfg); i++) {
        td_model_hf_tensor p;
        td_model_hf_get(&cfg, i, &p);
        TD_ASSERT_OK(td_ckpt_reader_get_weight(r, i, TD_DTYPE_F32, whole));
        for (int k = 0; k < 20; k++) {
            uint64_t off = rng_next(&seed) % p.numel, n = rng_next(&seed) % (p.numel - off + 1);
            TD_ASSERT_OK(td_ckpt_reader_get_weight_range(r, i, off, n, TD_DTYPE_F32, part));
            assert_memory_equal(part, whole + off, n * sizeof(float));
        }
    }
    assert_int_equal(td_ckpt_reader_get_weight_range(r, 0, 1, (size_t)24 * 12, TD_DTYPE_F32, part), TD_ERR_INVALID);
    td_ckpt_reader_close(r);
    free(whole);
    free(part);
    free(half);
}

/* The same over a communicator (what the trainer holds): agreement, host
 * allgather, a group save through it. */
static td_status comm_allgather(void *arg, const void *mine, size_t bytes, void *all)
{
    return td_comm_host_allgather(arg, mine, bytes, all);
}

static int comm_body(int rank, int size, int port, void *ctx)
{
    const char *path = ctx;
    td_dist_env e = td_test_local_env(rank, size, port);
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CPU;
    bp.cpu_device_bytes = 16 * TD_MiB;
    td_backend *b = NULL;
    td_comm *c = NULL;
    td_comm_params cp = td_comm_default_params();
    cp.timeout_ms = 10000;
    if (td_backend_create(&bp, &b) || td_comm_create(&e, b, &cp, &c)) return td_test_rank_fail(rank, "comm");
    td_dist_setting same[] = {{"--lr", "1e-3"}, {"model", "tiny"}};
    if (td_comm_agree(c, same, 2)) return td_test_rank_fail(rank, "agree");
    td_dist_setting differ[] = {{"--lr", "1e-3"}, {"model", rank == size - 1 ? "small" : "tiny"}};
    char want[128];
    snprintf(want, sizeof want, "ranks disagree on model: rank 0 has 'tiny', rank %d has 'small'", size - 1);
    if (td_comm_agree(c, differ, 2) != TD_ERR_INVALID || !strstr(td_error_msg(), want)) return 2;
    double mine = 0.1 * (rank + 1), all[8];
    if (td_comm_host_allgather(c, &mine, sizeof mine, all)) return td_test_rank_fail(rank, "host allgather");
    for (int k = 0; k < size; k++)
        if (all[k] != 0.1 * (k + 1)) return 3;
    /* a group save over the communicator, rank r writing whole tensors r, r + size, ... */
    td_ckpt_group g = { .rank = rank, .size = size, .allgather = comm_allgather, .arg = c };
    td_ckpt_write_options o = td_ckpt_write_default_options();
    o.group = &g;
    td_ckpt_writer *w = NULL;
    int rng;
    float *buf = malloc(1 << 16);
    td_status st = td_ckpt_writer_begin(path, &cfg, &o, &w);
    if (!st) save_meta(w, 6, "same", &rng), st = td_ckpt_writer_begin_ranges(w);
    for (int i = rank; !st && i < td_model_hf_count(&cfg); i += size) {
        td_model_hf_tensor p;
        td_model_hf_get(&cfg, i, &p);
        for (uint64_t j = 0; j < p.numel; j++) buf[j] = val(6, 0, i, j);
        st = td_ckpt_writer_put_weight(w, i, TD_DTYPE_F32, buf);
        for (int k = 0; !st && k < TD_CKPT_STATE_COUNT; k++) {
            for (uint64_t j = 0; j < p.numel; j++) buf[j] = val(6, 1 + k, i, j);
            st = td_ckpt_writer_write_state(w, i, (td_ckpt_state)k, 0, buf, p.numel);
        }
    }
    uint64_t words[3] = {6, 2, 3};
    if (!st && rank == size - 1) st = td_ckpt_writer_write_extra(w, rng, 0, words, sizeof words);
    if (!st) st = td_ckpt_writer_commit(w), w = NULL;
    td_ckpt_writer_abort(w);
    free(buf);
    if (st) return td_test_rank_fail(rank, "group save over the communicator");
    if (td_comm_barrier(c, TD_QUEUE_COMPUTE)) return td_test_rank_fail(rank, "barrier");
    td_comm_destroy(c);
    td_backend_free(b);
    return 0;
}

static void test_comm_group(void **state)
{
    char ref[128], path[128];
    snprintf(ref, sizeof ref, "%s/comm_ref", dir);
    save_stream(ref, 6, TD_DTYPE_F32);
    for (int n = 2; n <= 3; n++) {
        int codes[3];
        snprintf(path, sizeof path, "%s/comm%d", dir, n);
        td_test_run_ranks(n, comm_body, path, codes);
        td_test_expect_codes(n, codes, NULL);
        expect_same_ckpt(ref, path);
    }
}

/* One process, ranged writing in random order and random pieces (a group of
 * one): the same bytes as streaming; and the calls' misuse. */
static void test_ranged_one_process(void **state)
{
    char ref[128], path[128];
    snprintf(ref, sizeof ref, "%s/one_ref", dir);
    snprintf(path, sizeof path, "%s/one", dir);
    save_stream(ref, 3, TD_DTYPE_BF16);
    td_ckpt_group g = { .rank = 0, .size = 1 };
    td_ckpt_write_options o = td_ckpt_write_default_options();
    o.weight_dtype = TD_DTYPE_BF16;
    o.group = &g;
    td_ckpt_writer *w = NULL;
    int rng;
    TD_ASSERT_OK(td_ckpt_writer_begin(path, &cfg, &o, &w));
    float x = 0;
    assert_int_equal(td_ckpt_writer_write_weight(w, 0, 0, TD_DTYPE_F32, &x, 1), TD_ERR_STATE); /* before begin_ranges */
    save_meta(w, 3, "same", &rng);
    TD_ASSERT_OK(td_ckpt_writer_begin_ranges(w));
    assert_int_equal(td_ckpt_writer_begin_ranges(w), TD_ERR_STATE);
    assert_int_equal(td_ckpt_writer_append_state(w, 0, TD_CKPT_STATE_MASTER, &x, 1), TD_ERR_STATE); /* streaming */
    assert_int_equal(td_ckpt_writer_append_weight(w, 0, TD_DTYPE_F32, &x, 1), TD_ERR_STATE);
    td_model_hf_tensor p0;
    td_model_hf_get(&cfg, 0, &p0);
    assert_int_equal(td_ckpt_writer_write_weight(w, 0, p0.numel, TD_DTYPE_F32, &x, 1), TD_ERR_INVALID);
    assert_int_equal(td_ckpt_writer_write_state(w, 0, TD_CKPT_STATE_ADAM_M, p0.numel, &x, 1), TD_ERR_INVALID);
    assert_int_equal(td_ckpt_writer_write_extra(w, rng, 20, &x, 8), TD_ERR_INVALID);
    /* every tensor in random pieces, tensors in reverse order */
    uint64_t seed = 17;
    float *buf = malloc(1 << 16);
    for (int i = td_model_hf_count(&cfg) - 1; i >= 0; i--) {
        td_model_hf_tensor p;
        td_model_hf_get(&cfg, i, &p);
        for (int kind = 0; kind <= TD_CKPT_STATE_COUNT; kind++) {
            for (uint64_t j = 0; j < p.numel; j++) buf[j] = val(3, kind, i, j);
            uint64_t cuts[6] = {0, 0, 0, 0, 0, p.numel};
            for (int c = 1; c < 5; c++) cuts[c] = rng_next(&seed) % (p.numel + 1);
            for (int a = 1; a < 5; a++) /* sort */
                for (int b = a; b > 0 && cuts[b] < cuts[b - 1]; b--) {
                    uint64_t t = cuts[b];
                    cuts[b] = cuts[b - 1];
                    cuts[b - 1] = t;
                }
            for (int c = 4; c >= 0; c--) { /* last piece first */
                uint64_t off = cuts[c], n = cuts[c + 1] - cuts[c];
                if (kind == 0) TD_ASSERT_OK(td_ckpt_writer_write_weight(w, i, off, TD_DTYPE_F32, buf + off, n));
                else TD_ASSERT_OK(td_ckpt_writer_write_state(w, i, (td_ckpt_state)(kind - 1), off, buf + off, n));
            }
        }
    }
    uint64_t words[3] = {3, 2, 3};
    TD_ASSERT_OK(td_ckpt_writer_write_extra(w, rng, 8, words + 1, 16));
    TD_ASSERT_OK(td_ckpt_writer_write_extra(w, rng, 0, words, 8));
    TD_ASSERT_OK(td_ckpt_writer_commit(w));
    expect_same_ckpt(ref, path);
    free(buf);
    /* a group that is not one */
    td_ckpt_group bad = { .rank = 2, .size = 2 };
    o.group = &bad;
    assert_int_equal(td_ckpt_writer_begin(path, &cfg, &o, &w), TD_ERR_INVALID);
    assert_null(w);
}

/* `tidal bench comm` launched as torchrun would, the ranks' flags differing:
 * both refuse at start naming the flag and both values. */
static void test_cli_mismatched_flags(void **state)
{
    const char *t = td_test_tidal();
    char cmd[1024], out[8192] = "";
    int port = td_test_free_port();
    snprintf(cmd, sizeof cmd, "export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=%d TD_COMM_TIMEOUT_MS=20000; "
             "RANK=1 LOCAL_RANK=1 %s bench comm --backend cpu --max-bytes 1MiB > %s/mm1.out 2>&1 & "
             "RANK=0 LOCAL_RANK=0 %s bench comm --backend cpu --max-bytes 0 2>&1; r0=$?; wait $!; r1=$?; "
             "cat %s/mm1.out; echo codes $r0 $r1", port, t, dir, t, dir);
    FILE *p = popen(cmd, "r");
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    pclose(p);
    const char *want = "ranks disagree on --max-bytes: rank 0 has '0', rank 1 has '1048576'";
    const char *first = strstr(out, want);
    if (!first || !strstr(first + 1, want) || !strstr(out, "codes 1 1")) fail_msg("%s", out);
}

/* The chunk manager sharded over N ranks (memmgr.h, shard_ranks), on
 * forked ranks joined by the CPU communicator: every chunk's host copy is
 * the rank's shard (td_shard_range of its used elements: pageable optimizer
 * state under --policy cpu, pinned when homed on the device; params and
 * grads pinned); an optimizer chunk is the shard alone on the device too,
 * a param or grad chunk is whole there (its slot N equal shards).  Params
 * reach the device whole from every rank's shard (the gather); a device
 * write changes the rank's shard alone (the others come back from their
 * owners); grads written on every rank reach each owner's host summed
 * (the reduce-scatter), and grads added after a write-back or a reload
 * are counted once.  Under a budget of three slots chunks are evicted and
 * reloaded throughout; per-tensor host access to a shard is refused. */
typedef struct mm_fixture {
    td_hostpool *pool;
    td_arena *arena;
    td_copy_engine *eng;
    td_memmgr *m;
} mm_fixture;

static void mm_fixture_create(td_backend *b, size_t arena_bytes, const td_memmgr_params *mp, mm_fixture *f)
{
    td_hostpool_params hp = td_hostpool_default_params();
    hp.slab_bytes = 4 * TD_MiB;
    TD_ASSERT_OK(td_hostpool_create(b, NULL, &hp, &f->pool));
    TD_ASSERT_OK(td_arena_create(b, arena_bytes, &f->arena));
    TD_ASSERT_OK(td_copy_engine_create(b, NULL, &f->eng));
    TD_ASSERT_OK(td_memmgr_create(f->arena, f->pool, f->eng, mp, &f->m));
}

static void mm_fixture_destroy(mm_fixture *f)
{
    td_memmgr_destroy(f->m);
    td_copy_engine_destroy(f->eng);
    td_arena_destroy(f->arena);
    td_hostpool_destroy(f->pool);
}

static td_status mm_gather(void *ctx, void *buf, size_t S, td_dtype dt, td_queue q)
{
    td_comm *c = ctx;
    return td_comm_all_gather(c, (char *)buf + (size_t)td_comm_rank(c) * S * td_dtype_bytes(dt), buf, S, dt, q);
}

static td_status mm_reduce(void *ctx, void *buf, size_t S, td_dtype dt, td_queue q)
{
    td_comm *c = ctx;
    return td_comm_reduce_scatter(c, buf, (char *)buf + (size_t)td_comm_rank(c) * S * td_dtype_bytes(dt), S, dt, q);
}

static td_status mm_wait(void *ctx, td_queue q) { return td_comm_wait(ctx, q); }

enum { SH_T = 6 };
static const size_t sh_sizes[SH_T] = {1000, 37, 2048, 777, 5, 4096 + 3};
/* Element e of tensor j's param: the same on every rank. */
static float sh_val(int j, size_t e) { return (float)(j * 10000 + (int)(e % 5000)); }

/* Every tensor of ids on the device (one at a time) equal to want(j, e) + add. */
static int sh_check_device(td_backend *b, td_memmgr *m, const int *ids, int rank, float add, float scale,
                           const char *what)
{
    static float back[8192];
    for (int j = 0; j < SH_T; j++) {
        void *d;
        if (td_memmgr_access(m, &ids[j], 1, TD_TENSOR_COMPUTE, 0, &d)) return td_test_rank_fail(rank, what);
        if (td_backend_copy_async(b, TD_QUEUE_COMPUTE, back, d, sh_sizes[j] * 4) || td_queue_sync(b, TD_QUEUE_COMPUTE))
            return td_test_rank_fail(rank, what);
        for (size_t e = 0; e < sh_sizes[j]; e++)
            if (back[e] != scale * sh_val(j, e) + add) {
                fprintf(stderr, "rank %d: %s: tensor %d element %zu is %g, want %g\n", rank, what, j, e, back[e],
                        scale * sh_val(j, e) + add);
                return 1;
            }
        if (td_memmgr_release(m, &ids[j], 1, TD_TENSOR_HOLD)) return td_test_rank_fail(rank, what);
    }
    return 0;
}

/* Each rank adds (rank + 1) x val to every grad on the device. */
static int sh_add_grads(td_backend *b, td_memmgr *m, const int *gid, int rank)
{
    static float buf[8192];
    for (int j = 0; j < SH_T; j++) {
        void *d;
        if (td_memmgr_access(m, &gid[j], 1, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, &d)) return td_test_rank_fail(rank, "grads");
        if (td_backend_copy_async(b, TD_QUEUE_COMPUTE, buf, d, sh_sizes[j] * 4) || td_queue_sync(b, TD_QUEUE_COMPUTE))
            return td_test_rank_fail(rank, "grads read");
        for (size_t e = 0; e < sh_sizes[j]; e++) buf[e] += (float)(rank + 1) * sh_val(j, e);
        if (td_backend_copy_async(b, TD_QUEUE_COMPUTE, d, buf, sh_sizes[j] * 4) || td_queue_sync(b, TD_QUEUE_COMPUTE) ||
            td_memmgr_release(m, &gid[j], 1, TD_TENSOR_HOLD_AFTER_BWD))
            return td_test_rank_fail(rank, "grads write");
    }
    return 0;
}

/* Each rank's host shard of every grad chunk: rounds x the sum over the ranks of (r + 1) x val. */
static int sh_check_grad_shards(td_memmgr *m, const int *gid, int rank, int size, int rounds)
{
    float want = (float)rounds * (float)(size * (size + 1) / 2);
    for (int c = 0; c < td_memmgr_chunk_count(m); c++) {
        if (td_memmgr_chunk_role(m, c) != TD_TENSOR_GRAD) continue;
        size_t hb, he;
        float *h;
        td_memmgr_chunk_host_range(m, c, &hb, &he);
        if (td_memmgr_chunk_host_access(m, c, TD_ACCESS_READ, (void **)&h)) return td_test_rank_fail(rank, "grad shard");
        for (int j = 0; j < SH_T; j++) {
            if (td_memmgr_tensor_chunk(m, gid[j]) != c) continue;
            size_t off = td_memmgr_tensor_offset(m, gid[j]);
            for (size_t e = 0; e < sh_sizes[j]; e++)
                if (off + e >= hb && off + e < he && h[off + e - hb] != want * sh_val(j, e)) {
                    fprintf(stderr, "rank %d: grad %d element %zu on the host is %g, want %g\n", rank, j, e,
                            h[off + e - hb], want * sh_val(j, e));
                    return 1;
                }
        }
    }
    return 0;
}

typedef struct sh_case { int place, tight; } sh_case;

static int shards_body(int rank, int size, int port, void *ctx)
{
    const sh_case *k = ctx;
    td_dist_env e = td_test_local_env(rank, size, port);
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CPU;
    bp.cpu_device_bytes = 16 * TD_MiB;
    td_backend *b = NULL;
    td_comm *c = NULL;
    td_comm_params cp = td_comm_default_params();
    cp.timeout_ms = 20000;
    if (td_backend_create(&bp, &b) || td_comm_create(&e, b, &cp, &c)) return td_test_rank_fail(rank, "comm");
    td_memmgr_params mp = td_memmgr_default_params();
    mp.chunk_numel = 3000;
    mp.placement = k->place ? TD_PLACEMENT_CUDA : TD_PLACEMENT_CPU;
    mp.prefetch = k->tight ? 2 : 0;
    mp.shard_ranks = size;
    mp.shard_rank = rank;
    mp.shard_align = 64;
    mp.shard_comm = (td_memmgr_comm){ .ctx = c, .all_gather = mm_gather, .reduce_scatter = mm_reduce, .wait = mm_wait };
    mm_fixture f;
    td_hostpool_params hp = td_hostpool_default_params();
    hp.slab_bytes = 4 * TD_MiB;
    /* tight: three slots of the largest chunk (4099 elements padded to 4 ranks x 64) */
    size_t arena = k->tight ? 3 * (4096 + 256) * 4 + 4 * TD_ARENA_ALIGN : 16 * TD_MiB;
    if (td_hostpool_create(b, NULL, &hp, &f.pool) || td_arena_create(b, arena, &f.arena) ||
        td_copy_engine_create(b, NULL, &f.eng) || td_memmgr_create(f.arena, f.pool, f.eng, &mp, &f.m))
        return td_test_rank_fail(rank, "memmgr");
    td_memmgr *m = f.m;
    int pid[SH_T], gid[SH_T], mid[SH_T];
    static const td_tensor_role roles[3] = {TD_TENSOR_PARAM, TD_TENSOR_GRAD, TD_TENSOR_ADAM_M};
    int *ids[3] = {pid, gid, mid};
    for (int r = 0; r < 3; r++)
        for (int j = 0; j < SH_T; j++) {
            char name[32];
            snprintf(name, sizeof name, "%s%d", td_tensor_role_name(roles[r]), j);
            if (td_memmgr_register(m, name, sh_sizes[j], TD_DTYPE_F32, roles[r], &ids[r][j]))
                return td_test_rank_fail(rank, "register");
        }
    if (td_memmgr_layout(m) || td_memmgr_set_state(m, pid, SH_T, TD_TENSOR_HOLD) ||
        td_memmgr_set_state(m, mid, SH_T, TD_TENSOR_HOLD))
        return td_test_rank_fail(rank, "layout");
    /* Layout and host copies: the rank's shard of every chunk. */
    for (int ch = 0; ch < td_memmgr_chunk_count(m); ch++) {
        size_t used = td_memmgr_chunk_numel_used(m, ch), slot = td_memmgr_chunk_slot_bytes(m, ch) / 4, hb, he, wb, we;
        td_shard_layout l;
        td_tensor_role role = td_memmgr_chunk_role(m, ch);
        int opt = role == TD_TENSOR_ADAM_M;
        if (td_memmgr_chunk_shard(m, ch, &l) || l.ranks != size) return td_test_rank_fail(rank, "shard layout");
        size_t n = td_memmgr_chunk_host_range(m, ch, &hb, &he);
        td_shard_range(&l, rank, &wb, &we);
        if (size == 1) wb = 0, we = used;
        int ok = hb == wb && he == we && td_memmgr_chunk_bytes(m, ch) == n * 4 &&
                 td_memmgr_chunk_pageable(m, ch) == (opt && !k->place) &&
                 (opt && size > 1 ? l.shard_numel <= slot && slot % 64 == 0
                                  : l.padded_numel <= slot && (size == 1 || slot % ((size_t)size * 64) == 0));
        if (!ok) {
            fprintf(stderr, "rank %d: chunk %d (%s): host [%zu, %zu) of %zu used, slot %zu; want [%zu, %zu)\n", rank,
                    ch, td_tensor_role_name(role), hb, he, used, slot, wb, we);
            return 1;
        }
        if (role == TD_TENSOR_PARAM && n) { /* the params' shard: the same values on every rank */
            float *h;
            if (td_memmgr_chunk_host_access(m, ch, TD_ACCESS_WRITE, (void **)&h)) return td_test_rank_fail(rank, "host");
            for (int j = 0; j < SH_T; j++) {
                if (td_memmgr_tensor_chunk(m, pid[j]) != ch) continue;
                size_t off = td_memmgr_tensor_offset(m, pid[j]);
                for (size_t x = 0; x < sh_sizes[j]; x++)
                    if (off + x >= hb && off + x < he) h[off + x - hb] = sh_val(j, x);
            }
        }
    }
    void *h;
    td_status st = td_memmgr_host_access(m, &pid[0], 1, TD_ACCESS_READ, &h);
    if ((size > 1) != (st == TD_ERR_STATE)) return td_test_rank_fail(rank, "per-tensor host access to a shard");
    td_error_clear();
    if (td_memmgr_step_begin(m)) return td_test_rank_fail(rank, "step");
    /* Params: every element on the device, gathered from every rank's shard. */
    if (sh_check_device(b, m, pid, rank, 0, 1, "params gathered")) return 1;
    /* A device write changes the rank's shard alone: every rank adds 1
     * everywhere, so the gathered params are val + 1 (not + N). */
    for (int j = 0; j < SH_T; j++) {
        static float buf[8192];
        void *d;
        if (td_memmgr_access(m, &pid[j], 1, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, &d)) return td_test_rank_fail(rank, "write");
        for (size_t x = 0; x < sh_sizes[j]; x++) buf[x] = sh_val(j, x) + 1;
        if (td_backend_copy_async(b, TD_QUEUE_COMPUTE, d, buf, sh_sizes[j] * 4) || td_queue_sync(b, TD_QUEUE_COMPUTE) ||
            td_memmgr_release(m, &pid[j], 1, TD_TENSOR_HOLD))
            return td_test_rank_fail(rank, "write");
    }
    if (sh_check_device(b, m, pid, rank, 1, 1, "params written on every rank, gathered")) return 1;
    /* Grads: added on every rank, written back (each owner's host shard
     * holds the sum), added again (after the write-back, or a reload under
     * the tight budget: counted once), summed again. */
    for (int round = 1; round <= 2; round++) {
        if (sh_add_grads(b, m, gid, rank)) return 1;
        if (round == 1 && sh_check_device(b, m, pid, rank, 1, 1, "params again, evicting grads")) return 1;
        if (td_memmgr_set_state(m, gid, SH_T, TD_TENSOR_READY_FOR_REDUCE) || td_memmgr_writeback_async(m, gid, SH_T))
            return td_test_rank_fail(rank, "grads write-back");
        if (sh_check_grad_shards(m, gid, rank, size, round)) return 1;
    }
    if (td_memmgr_step_end(m)) return td_test_rank_fail(rank, "step end");
    td_memmgr_stats ms;
    td_memmgr_get_stats(m, &ms);
    if (size > 1 && (!ms.gathers || !ms.reduce_scatters || !ms.bytes_gathered))
        return td_test_rank_fail(rank, "no collectives counted");
    if (k->tight && !ms.evictions) return td_test_rank_fail(rank, "the tight budget evicted nothing");
    mm_fixture_destroy(&f);
    if (td_comm_barrier(c, TD_QUEUE_COMPUTE)) return td_test_rank_fail(rank, "barrier");
    td_comm_destroy(c);
    td_backend_free(b);
    return 0;
}

static void test_memmgr_shards(void **state)
{
    (void)state;
    static const sh_case cases[] = {{0, 0}, {1, 0}, {0, 1}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (int ranks = 1; ranks <= 4; ranks++) {
            int codes[4];
            td_test_run_ranks(ranks, shards_body, (void *)&cases[k], codes);
            td_test_expect_codes(ranks, codes, NULL);
        }
    /* a shard rank outside the ranks is refused, and a live manager needs the collectives */
    td_memmgr_params mp = td_memmgr_default_params();
    mp.shard_ranks = 2;
    mp.shard_rank = 2;
    td_memmgr *m = NULL;
    assert_int_equal(td_memmgr_create(NULL, NULL, NULL, &mp, &m), TD_ERR_INVALID);
    td_error_clear();
    mp.shard_rank = 1;
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CPU;
    td_backend *b;
    td_arena *a;
    TD_ASSERT_OK(td_backend_create(&bp, &b));
    TD_ASSERT_OK(td_arena_create(b, TD_MiB, &a));
    assert_int_equal(td_memmgr_create(a, NULL, NULL, &mp, &m), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "shard_comm"));
    td_error_clear();
    td_arena_destroy(a);
    td_backend_free(b);
}

/* td_memmgr_written_on: a chunk written on the H2D queue after its release
 * (ZeRO-3's gather) is read by the next access only once that write has
 * landed, and its write-back carries it; in the cpu backend's debug mode a
 * copy's destination holds poison (NaN) until the copy lands, so a read
 * that is not ordered after it sees NaN.  Misuse is refused. */
static void test_memmgr_written_on(void **state)
{
    (void)state;
    td_backend *b = td_test_backend(1);
    td_memmgr_params mp = td_memmgr_default_params();
    mp.chunk_numel = 4096;
    mp.placement = TD_PLACEMENT_CUDA;
    mm_fixture f;
    mm_fixture_create(b, 4 * TD_MiB, &mp, &f);
    td_memmgr *m = f.m;
    td_copy_engine *eng = f.eng;
    int id, other;
    enum { N = 4096 };
    TD_ASSERT_OK(td_memmgr_register(m, "p", N, TD_DTYPE_F32, TD_TENSOR_PARAM, &id));
    TD_ASSERT_OK(td_memmgr_register(m, "q", N, TD_DTYPE_F32, TD_TENSOR_PARAM, &other));
    TD_ASSERT_OK(td_memmgr_layout(m));
    assert_int_equal(td_memmgr_written_on(m, id, TD_QUEUE_H2D), TD_ERR_STATE); /* not resident */
    td_error_clear();
    float *src = td_malloc(N * sizeof(float), TD_ROLE_META), *back = td_malloc(N * sizeof(float), TD_ROLE_META);
    assert_true(src && back);
    for (int i = 0; i < N; i++) src[i] = (float)i + 0.5f;
    for (int round = 0; round < 3; round++) {
        void *d;
        TD_ASSERT_OK(td_memmgr_access(m, &id, 1, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, &d));
        assert_int_equal(td_memmgr_written_on(m, id, TD_QUEUE_H2D), TD_ERR_STATE); /* still in COMPUTE */
        td_error_clear();
        td_copy_ticket used;
        TD_ASSERT_OK(td_copy_mark(eng, TD_QUEUE_COMPUTE, &used));
        TD_ASSERT_OK(td_copy_order(eng, TD_QUEUE_H2D, &used));
        TD_ASSERT_OK(td_backend_copy_async(b, TD_QUEUE_H2D, d, src, N * sizeof(float)));
        TD_ASSERT_OK(td_memmgr_release(m, &id, 1, TD_TENSOR_HOLD));
        TD_ASSERT_OK(td_memmgr_written_on(m, id, TD_QUEUE_H2D));
        /* the next access, read on the compute queue */
        TD_ASSERT_OK(td_memmgr_access(m, &id, 1, TD_TENSOR_COMPUTE, 0, &d));
        TD_ASSERT_OK(td_backend_copy_async(b, TD_QUEUE_COMPUTE, back, d, N * sizeof(float)));
        TD_ASSERT_OK(td_queue_sync(b, TD_QUEUE_COMPUTE));
        for (int i = 0; i < N; i++)
            if (back[i] != src[i]) fail_msg("round %d: element %d read %g before the H2D write landed", round, i, back[i]);
        TD_ASSERT_OK(td_memmgr_release(m, &id, 1, TD_TENSOR_HOLD));
        /* and the host copy, through the write-back */
        float *h;
        TD_ASSERT_OK(td_memmgr_host_access(m, &id, 1, TD_ACCESS_READ, (void **)&h));
        for (int i = 0; i < N; i++) assert_true(h[i] == src[i]);
        for (int i = 0; i < N; i++) src[i] += 1.0f;
    }
    td_free(src);
    td_free(back);
    mm_fixture_destroy(&f);
    td_backend_free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shard_layout),
        cmocka_unit_test(test_memmgr_shards),
        cmocka_unit_test(test_memmgr_written_on),
        cmocka_unit_test(test_loader_slices),
        cmocka_unit_test(test_agree),
        cmocka_unit_test(test_dead_peers),
        cmocka_unit_test(test_group_save),
        cmocka_unit_test(test_group_save_shards),
        cmocka_unit_test(test_group_save_faults),
        cmocka_unit_test(test_read_ranges),
        cmocka_unit_test(test_comm_group),
        cmocka_unit_test(test_ranged_one_process),
        cmocka_unit_test(test_cli_mismatched_flags),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
