/* The disk tier (memmgr.h, "the disk tier"; docs/training.md, "The disk
 * tier"), on the cpu backend in a temporary directory:
 *   - the chunk manager keeps every disk chunk's bytes through more chunks
 *     than bounce sets, reads ahead in the given order, serves host
 *     accesses, and counts its reads and writes;
 *   - a run with optimizer state on disk (a small --host-ram) gives the
 *     same losses, bit for bit, as the run with all of it in RAM: with and
 *     without the AdamW thread, clipping, grad accumulation, every state
 *     type; its checkpoints load into a run without a disk tier, and back;
 *   - an injected ENOSPC, EIO or short transfer fails the step cleanly
 *     (a message naming the directory), the trainer is freed without a
 *     leak, and the checkpoint saved before it loads and continues;
 *   - nothing is left in the directory afterwards. */
#include "td_train_test.h"
#include "tidal/checkpoint.h"
#include "tidal/hostpool.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char tmp_root[256];

static int count_files(const char *dir)
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

static const char *dirs[2];
static char dir_a[300], dir_b[300];

static int setup(void **state)
{
    snprintf(tmp_root, sizeof tmp_root, "/tmp/td_disk_tier_XXXXXX");
    if (!mkdtemp(tmp_root)) return -1;
    snprintf(dir_a, sizeof dir_a, "%s/a", tmp_root);
    snprintf(dir_b, sizeof dir_b, "%s/b", tmp_root);
    if (mkdir(dir_a, 0700) || mkdir(dir_b, 0700)) return -1;
    dirs[0] = dir_a;
    dirs[1] = dir_b;
    return 0;
}

static int teardown(void **state)
{
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp_root);
    return system(cmd) == 0 ? 0 : -1;
}

/* ---- the chunk manager's tier ------------------------------------------------------ */

static void fill_pattern(float *p, size_t n, int k, int round)
{
    for (size_t i = 0; i < n; i++) p[i] = (float)(k * 1000003 + round * 7919) + (float)i * 0.25f;
}

/* 8 optimizer chunks (master, m, v each) on disk, 3 bounce sets: every
 * chunk's bytes survive being pushed out and read back; reads ahead land
 * before the acquire; host accesses see the same bytes. */
static void test_memmgr_disk_chunks(void **state)
{
    td_backend *b = td_test_backend(0);
    td_hostpool *pool;
    td_arena *arena;
    td_copy_engine *eng;
    TD_ASSERT_OK(td_hostpool_create(b, NULL, NULL, &pool));
    TD_ASSERT_OK(td_arena_create(b, 8 * TD_MiB, &arena));
    TD_ASSERT_OK(td_copy_engine_create(b, NULL, &eng));
    td_memmgr_params p = td_memmgr_default_params();
    p.chunk_numel = 3000;
    p.placement = TD_PLACEMENT_CPU;
    p.disk_dirs = dirs;
    p.n_disk_dirs = 2;
    p.disk_sets = 3;
    td_memmgr *m;
    TD_ASSERT_OK(td_memmgr_create(arena, pool, eng, &p, &m));
    enum { K = 8 };
    int ids[4][K];
    static const td_tensor_role roles[4] = {TD_TENSOR_PARAM, TD_TENSOR_MASTER, TD_TENSOR_ADAM_M, TD_TENSOR_ADAM_V};
    for (int r = 0; r < 4; r++)
        for (int k = 0; k < K; k++) {
            char name[32];
            snprintf(name, sizeof name, "t%d.%d", k, r);
            TD_ASSERT_OK(td_memmgr_register(m, name, 2500 + 64 * (size_t)k, TD_DTYPE_F32, roles[r], &ids[r][k]));
        }
    uint8_t homes[K];
    for (int k = 0; k < K; k++) homes[k] = k == 3 ? TD_HOME_HOST : TD_HOME_DISK; /* one stays in RAM */
    TD_ASSERT_OK(td_memmgr_set_optim_homes(m, homes, K));
    TD_ASSERT_OK(td_memmgr_layout(m));
    assert_true(td_memmgr_chunk_on_disk(m, td_memmgr_role_chunk(m, TD_TENSOR_ADAM_M, 0)));
    assert_false(td_memmgr_chunk_on_disk(m, td_memmgr_role_chunk(m, TD_TENSOR_ADAM_M, 3)));
    assert_false(td_memmgr_chunk_on_disk(m, td_memmgr_role_chunk(m, TD_TENSOR_PARAM, 0)));
    size_t slot[TD_TENSOR_ROLE_COUNT], file;
    assert_int_equal(td_memmgr_disk_plan(m, slot, &file), 3);
    assert_int_equal(slot[TD_TENSOR_MASTER], td_align_up((2500 + 64 * 7) * 4, 4096));
    assert_int_equal(slot[TD_TENSOR_PARAM], 0); /* the params stay on the host */
    assert_true(file >= 3 * 7 * (size_t)2500 * 4);
    assert_int_equal(count_files(dir_a), 1); /* the lock file: the data file has no name */
    assert_non_null(strstr(td_memmgr_disk_describe(m), dir_a));
    for (int r = 0; r < 4; r++)
        for (int k = 0; k < K; k++) {
            int id = ids[r][k];
            TD_ASSERT_OK(td_memmgr_set_state(m, &id, 1, TD_TENSOR_HOLD));
        }
    /* A chunk never written reads as zeros. */
    void *h[3];
    TD_ASSERT_OK(td_memmgr_disk_acquire(m, 0, h));
    assert_non_null(h[0]);
    for (size_t i = 0; i < 2500; i++) assert_true(((float *)h[1])[i] == 0.0f);
    TD_ASSERT_OK(td_memmgr_disk_release(m, 0, 0));
    /* Rounds of updates in order, each writing a new pattern into master, m, v. */
    for (int round = 1; round <= 3; round++)
        for (int k = 0; k < K; k++) {
            if (k == 3) continue;
            size_t n = 2500 + 64 * (size_t)k;
            TD_ASSERT_OK(td_memmgr_disk_acquire(m, k, h));
            for (int s = 0; s < 3; s++) {
                float *f = h[s];
                float want[1];
                fill_pattern(want, 1, k * 3 + s, round - 1);
                if (round > 1) assert_true(f[0] == want[0] && f[n - 1] == want[0] + (float)(n - 1) * 0.25f);
                fill_pattern(f, n, k * 3 + s, round);
            }
            TD_ASSERT_OK(td_memmgr_disk_release(m, k, 1));
        }
    td_memmgr_stats st;
    td_memmgr_get_stats(m, &st);
    assert_true(st.disk_write_bytes >= 3 * 7 * 3 * 2500 * 4);
    assert_true(st.disk_read_bytes + 3 * 3 * 4 * 4096 * 4 >= (uint64_t)2 * 7 * 3 * 2500 * 4); /* most came back from disk */
    /* Read ahead: once chunk 0 is acquired, chunk 1 (next in the order) lands by itself. */
    TD_ASSERT_OK(td_memmgr_disk_acquire(m, 0, h));
    TD_ASSERT_OK(td_memmgr_disk_release(m, 0, 0));
    double t0 = td_now_ms();
    while (!td_memmgr_disk_ready(m, 1) && td_now_ms() - t0 < 5000) td_sleep_us(1000);
    assert_true(td_memmgr_disk_ready(m, 1));
    assert_true(td_memmgr_disk_ready(m, 3)); /* nothing of it on disk */
    /* Host accesses read the same bytes (a checkpoint's view), and write back. */
    float *mv;
    int id = ids[2][5];
    TD_ASSERT_OK(td_memmgr_host_access(m, &id, 1, TD_ACCESS_READ, (void **)&mv));
    float want[1];
    fill_pattern(want, 1, 5 * 3 + 1, 3);
    assert_true(mv[0] == want[0]);
    id = ids[3][6];
    TD_ASSERT_OK(td_memmgr_host_access(m, &id, 1, TD_ACCESS_WRITE, (void **)&mv));
    mv[7] = -1.5f;
    for (int k = 0; k < K; k++) { /* push it out of every set */
        if (k == 6 || k == 3) continue;
        TD_ASSERT_OK(td_memmgr_disk_acquire(m, k, h));
        TD_ASSERT_OK(td_memmgr_disk_release(m, k, 0));
    }
    TD_ASSERT_OK(td_memmgr_disk_flush(m));
    TD_ASSERT_OK(td_memmgr_disk_acquire(m, 6, h));
    assert_true(((float *)h[2])[7] == -1.5f);
    TD_ASSERT_OK(td_memmgr_disk_release(m, 6, 0));
    /* Misuse: a chunk not acquired, a device access, a peek. */
    assert_int_equal(td_memmgr_disk_release(m, 2, 0), TD_ERR_STATE);
    void *dev;
    id = ids[2][0];
    assert_int_equal(td_memmgr_access(m, &id, 1, TD_TENSOR_COMPUTE, 0, &dev), TD_ERR_STATE);
    assert_non_null(strstr(td_error_msg(), "homed on disk"));
    assert_int_equal(td_memmgr_chunk_host_peek(m, td_memmgr_role_chunk(m, TD_TENSOR_ADAM_V, 1), &dev, NULL), TD_ERR_STATE);
    int order[2] = {5, 5};
    assert_int_equal(td_memmgr_disk_set_order(m, order, 2), TD_ERR_INVALID);
    TD_ASSERT_OK(td_memmgr_disk_status(m));
    td_memmgr_destroy(m);
    assert_int_equal(count_files(dir_a), 0);
    assert_int_equal(count_files(dir_b), 0);
    td_copy_engine_destroy(eng);
    td_arena_destroy(arena);
    td_hostpool_destroy(pool);
    td_backend_free(b);
}

/* ---- training with the tier ---------------------------------------------------------- */

static td_train_config small_config(void)
{
    td_train_config c = td_train_default_config();
    c.model = (td_model_desc){ .n_layer = 4, .n_head = 2, .n_embd = 32, .n_positions = 32,
                                   .vocab_size = 61, .padded_vocab_size = 64 };
    c.micro_batch = 2;
    c.seq_len = 16;
    c.grad_accum = 1;
    c.backend = TD_BACKEND_CPU;
    c.mm.min_chunk_numel = 1024;
    c.mm.max_chunk_numel = 4096;
    c.mm.placement = TD_PLACEMENT_CPU; /* the CPU AdamW for every chunk */
    c.gpu_budget = 64 * TD_MiB;
    c.optim.lr.lr = 3e-3;
    c.threads = 2;
    return c;
}

/* cfg with a disk tier and a RAM figure that sends some (not all) of the
 * CPU AdamW's state to disk: *disk_chunks of *chunks. */
static td_train_config with_disk(td_train_config c, int *disk_chunks, int *chunks)
{
    td_train_plan all;
    TD_ASSERT_OK(td_train_plan_make(&c, c.gpu_budget, &all));
    c.mm.disk_dirs = dirs;
    c.mm.n_disk_dirs = 2;
    c.mm.disk_sets = 3;
    c.host_pin_limit = 2 * all.host_bytes;
    /* RAM short of the whole by a growing share of the pageable state,
     * until more chunks than bounce sets go to disk (so that chunks really
     * leave the sets and come back), but not all of them. */
    td_train_plan p;
    for (int eighths = 1; eighths <= 8; eighths++) {
        c.host_ram = all.host_bytes - all.host_pageable_state_bytes / 8 * (size_t)eighths;
        TD_ASSERT_OK(td_train_plan_make(&c, c.gpu_budget, &p));
        if (p.disk_chunks > 2 * p.disk_sets) break;
    }
    *disk_chunks = p.disk_chunks;
    *chunks = p.optim_chunks;
    if (!(p.disk_chunks > p.disk_sets && p.disk_chunks < p.optim_chunks))
        fail_msg("no RAM figure puts more than %d and fewer than %d chunks on disk (%d)", p.disk_sets, p.optim_chunks,
                 p.disk_chunks);
    assert_true(p.host_bytes <= c.host_ram);
    assert_true(p.disk_bytes > 0 && p.disk_read_bytes_per_step == (double)p.disk_bytes);
    return c;
}

static void expect_same(const double *a, const double *b, int n, const char *what)
{
    for (int s = 0; s < n; s++)
        if (memcmp(&a[s], &b[s], sizeof(double)) != 0)
            fail_msg("%s, step %d: loss %.17g with the disk tier, %.17g without", what, s + 1, a[s], b[s]);
}

static void test_disk_losses_bit_identical(void **state)
{
    enum { STEPS = 4 };
    struct { int adam_thread, accum; double clip; td_optim_state os; const char *what; } cases[] = {
        {-1, 1, 1.0, TD_OPTIM_STATE_FP32, "driving thread, clipping"},
        {-1, 1, 0.0, TD_OPTIM_STATE_FP32, "driving thread, no clipping (updates in the backward)"},
        {1, 1, 0.0, TD_OPTIM_STATE_FP32, "AdamW thread, no clipping (transient grads)"},
        {1, 2, 1.0, TD_OPTIM_STATE_FP32, "AdamW thread, clipping, two micro-batches"},
        {1, 1, 1.0, TD_OPTIM_STATE_BF16, "AdamW thread, bf16 state"},
        {-1, 1, 0.0, TD_OPTIM_STATE_INT8, "driving thread, int8 state"},
    };
    size_t live = td_host_live_allocs();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        td_train_config c = small_config();
        c.adam_thread = cases[i].adam_thread;
        c.grad_accum = cases[i].accum;
        c.optim.max_grad_norm = cases[i].clip;
        c.optim.state = cases[i].os;
        double ref[STEPS], got[STEPS];
        td_test_train(&c, STEPS, 7, ref, NULL);
        int dc, nc;
        td_train_config d = with_disk(c, &dc, &nc);
        td_memmgr_stats st;
        td_test_train(&d, STEPS, 7, got, &st);
        expect_same(got, ref, STEPS, cases[i].what);
        assert_true(st.disk_write_bytes > 0);
        assert_true(st.disk_read_bytes > 0);
        assert_int_equal(count_files(dir_a), 0);
        print_message("%s: %d of %d optimizer chunks on disk, %llu bytes read, %llu written\n", cases[i].what, dc, nc,
                      (unsigned long long)st.disk_read_bytes, (unsigned long long)st.disk_write_bytes);
    }
    assert_int_equal(td_host_live_allocs(), live);
}

static td_status steps(td_trainer *t, td_test_batches *b, int n, double *losses);

/* A wider model, and a RAM figure so small that after the whole optimizer
 * state, grads (`grads`) or params (`params`) go to disk too. */
static td_train_config with_disk_pg(td_train_config c, int want_grads, int want_params, td_train_plan *out)
{
    td_train_plan all, p;
    TD_ASSERT_OK(td_train_plan_make(&c, c.gpu_budget, &all));
    c.mm.disk_dirs = dirs;
    c.mm.n_disk_dirs = 2;
    c.mm.disk_sets = 3;
    c.host_pin_limit = 2 * all.host_bytes;
    size_t ram = all.host_bytes - all.host_pageable_state_bytes;
    for (int i = 0; i < 200; i++, ram -= 256 * 1024) {
        c.host_ram = ram;
        TD_ASSERT_OK(td_train_plan_make(&c, c.gpu_budget, &p));
        if (p.host_bytes > ram) continue;
        if ((!want_grads || p.disk_grad_chunks > 0) && (!want_params || p.disk_param_chunks > 0)) break;
    }
    if (p.host_bytes > c.host_ram || (want_grads && !p.disk_grad_chunks) || (want_params && !p.disk_param_chunks))
        fail_msg("no RAM figure puts %s on disk (optimizer %d, grads %d, params %d of %d chunks; host %zu of %zu)",
                 want_params ? "params" : "grads", p.disk_chunks, p.disk_grad_chunks, p.disk_param_chunks,
                 p.optim_chunks, p.host_bytes, c.host_ram);
    assert_int_equal(p.disk_chunks, p.optim_chunks); /* the state went first, all of it */
    *out = p;
    return c;
}

/* Grads (clipping, two micro-batches: every grad keeps a copy) and then
 * params on disk too: the same losses, bit for bit, with the AdamW on its
 * thread and without; uploads read params from the disk, write-backs land
 * in grad slots. */
static void test_disk_params_and_grads(void **state)
{
    enum { STEPS = 3 };
    td_train_config c = small_config();
    c.model.n_embd = 192;
    c.model.n_head = 4;
    c.mm.min_chunk_numel = 16384;
    c.mm.max_chunk_numel = 65536;
    c.optim.max_grad_norm = 1.0;
    c.grad_accum = 2;
    struct { int grads, params, adam_thread; const char *what; } cases[] = {
        {1, 0, -1, "grads on disk, driving thread"},
        {0, 1, 1, "params on disk, AdamW thread"},
        {0, 1, -1, "params on disk, driving thread"},
    };
    size_t live = td_host_live_allocs();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        td_train_config base = c;
        base.adam_thread = cases[i].adam_thread;
        double ref[STEPS], got[STEPS];
        td_test_train(&base, STEPS, 11, ref, NULL);
        td_train_plan p;
        td_train_config d = with_disk_pg(base, cases[i].grads, cases[i].params, &p);
        td_memmgr_stats st;
        td_test_train(&d, STEPS, 11, got, &st);
        expect_same(got, ref, STEPS, cases[i].what);
        assert_true(st.disk_read_bytes > 0 && st.disk_write_bytes > 0);
        print_message("%s: optimizer %d, grads %d, params %d of %d chunks on disk; %llu bytes read, %llu written\n",
                      cases[i].what, p.disk_chunks, p.disk_grad_chunks, p.disk_param_chunks, p.optim_chunks,
                      (unsigned long long)st.disk_read_bytes, (unsigned long long)st.disk_write_bytes);
        if (cases[i].params) { /* a checkpoint of it (params loaded into their disk slots, state streamed
                                  out) continues without the tier as the run without it */
            char ck[400];
            snprintf(ck, sizeof ck, "%s/ckpt_pg", tmp_root);
            td_trainer *t;
            td_test_batches b = td_test_batches_of(&d, 11);
            TD_ASSERT_OK(td_trainer_create(&d, &t));
            double two[2];
            TD_ASSERT_OK(steps(t, &b, 2, two));
            expect_same(two, ref, 2, "before the save");
            TD_ASSERT_OK(td_trainer_save(t, ck, 1, NULL));
            td_trainer_destroy(t);
            for (int into = 0; into < 2; into++) { /* into a run without the tier, and one with it */
                td_test_batches b2 = b;
                TD_ASSERT_OK(td_trainer_create(into ? &d : &base, &t));
                TD_ASSERT_OK(td_trainer_load(t, ck, 1, NULL));
                double last;
                TD_ASSERT_OK(steps(t, &b2, 1, &last));
                expect_same(&last, ref + 2, 1, into ? "resumed with the tier" : "resumed without it");
                td_trainer_destroy(t);
            }
        }
        assert_int_equal(count_files(dir_a), 0);
    }
    assert_int_equal(td_host_live_allocs(), live);
}

static td_status steps(td_trainer *t, td_test_batches *b, int n, double *losses)
{
    for (int s = 0; s < n; s++) {
        td_step_result r;
        td_status st = td_trainer_step(t, td_test_next_batch, b, &r);
        if (st) return st;
        if (losses) losses[s] = r.loss;
    }
    return TD_OK;
}

/* Runs `n` steps of cfg; the disk bytes read and written over them. */
static void disk_bytes_over(const td_train_config *cfg, int n, double *read, double *written)
{
    td_trainer *t;
    td_test_batches b = td_test_batches_of(cfg, 5);
    TD_ASSERT_OK(td_trainer_create(cfg, &t));
    *read = *written = 0;
    for (int s = 0; s < n; s++) {
        td_step_result r;
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &r));
        *read = (double)r.mm.disk_read_bytes; /* the run's so far */
        *written = (double)r.mm.disk_write_bytes;
    }
    td_trainer_destroy(t);
    assert_int_equal(count_files(dir_a), 0);
}

/* Each disk-resident byte read once a step and written once, as the plan
 * says (disk.read_bytes_per_step, disk.write_bytes_per_step): the AdamW
 * thread takes whichever chunk's grads and state are in first, out of the
 * order the tier reads ahead in, and a chunk passed over must stay in its
 * slot, not be read again.  Steps overlap (the last updates' writes, the
 * next step's reads ahead), so over n steps: the first reads nothing (the
 * file is new), and n - 1 rounds plus at most one round ahead come to no
 * more than n steps' plan; the writes to no more than n steps' either
 * (and more than n - 2: the grads' writes are lazy, some never happen). */
static void test_disk_bytes_per_step_as_planned(void **state)
{
    enum { STEPS = 4 };
    struct { int adam_thread, accum; double clip; int grads, params; const char *what; } cases[] = {
        {1, 1, 0.0, 0, 0, "AdamW thread, updates in the backward, one micro-batch"},
        {1, 4, 0.0, 0, 0, "AdamW thread, updates in the backward, four micro-batches"},
        {1, 3, 1.0, 0, 0, "AdamW thread, clipping, three micro-batches"},
        {-1, 2, 0.0, 0, 0, "driving thread, two micro-batches"},
        {1, 2, 1.0, 1, 0, "grads on disk too, AdamW thread"},
        {1, 2, 0.0, 0, 1, "params on disk too, AdamW thread"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        td_train_config c = small_config();
        c.adam_thread = cases[i].adam_thread;
        c.grad_accum = cases[i].accum;
        c.optim.max_grad_norm = cases[i].clip;
        td_train_config d;
        td_train_plan p;
        if (cases[i].grads || cases[i].params) {
            c.model.n_embd = 192; /* test_disk_params_and_grads's */
            c.model.n_head = 4;
            c.mm.min_chunk_numel = 16384;
            c.mm.max_chunk_numel = 65536;
            d = with_disk_pg(c, cases[i].grads, cases[i].params, &p);
        } else {
            int dc, nc;
            d = with_disk(c, &dc, &nc);
            TD_ASSERT_OK(td_train_plan_make(&d, d.gpu_budget, &p));
        }
        double rd, wr, plan_rd = p.disk_read_bytes_per_step, plan_wr = p.disk_write_bytes_per_step;
        disk_bytes_over(&d, STEPS, &rd, &wr);
        print_message("%s: %.0f bytes read and %.0f written in %d steps; the plan: %.0f and %.0f a step\n",
                      cases[i].what, rd, wr, STEPS, plan_rd, plan_wr);
        assert_true(plan_rd > 0 && plan_wr > 0);
        if (rd > STEPS * plan_rd)
            fail_msg("%s: %.0f bytes read in %d steps, %.2f times the plan's %.0f a step", cases[i].what, rd, STEPS,
                     rd / (STEPS - 1) / plan_rd, plan_rd);
        if (rd < (STEPS - 2) * plan_rd / 2)
            fail_msg("%s: %.0f bytes read in %d steps, the plan's %.0f a step", cases[i].what, rd, STEPS, plan_rd);
        if (wr > STEPS * plan_wr || wr < (STEPS - 2) * plan_wr)
            fail_msg("%s: %.0f bytes written in %d steps, the plan's %.0f a step", cases[i].what, wr, STEPS, plan_wr);
    }
}

/* A checkpoint of a disk-tier run streams the state out of its file; it
 * loads into a run without a disk tier (and one with it) and both continue
 * with the uninterrupted run's losses. */
static void test_disk_checkpoint_round_trip(void **state)
{
    td_train_config c = small_config();
    c.optim.state = TD_OPTIM_STATE_INT8;
    int dc, nc;
    td_train_config d = with_disk(c, &dc, &nc);
    char ck[400];
    snprintf(ck, sizeof ck, "%s/ckpt", tmp_root);
    double whole[6];
    td_test_train(&c, 6, 5, whole, NULL);
    td_trainer *t;
    td_test_batches b = td_test_batches_of(&d, 5);
    TD_ASSERT_OK(td_trainer_create(&d, &t));
    double first[3];
    TD_ASSERT_OK(steps(t, &b, 3, first));
    expect_same(first, whole, 3, "before the save");
    TD_ASSERT_OK(td_trainer_save(t, ck, 1, NULL));
    td_trainer_destroy(t);
    for (int into_disk = 0; into_disk < 2; into_disk++) {
        td_train_config e = into_disk ? d : c;
        td_test_batches b2 = td_test_batches_of(&e, 5);
        double skip[3];
        for (int s = 0; s < 3; s++) { /* the data position: the same batches as the whole run's */
            int32_t tok[64], tgt[64];
            TD_ASSERT_OK(td_test_next_batch(&b2, tok, tgt, NULL));
            (void)skip;
        }
        TD_ASSERT_OK(td_trainer_create(&e, &t));
        TD_ASSERT_OK(td_trainer_load(t, ck, 1, NULL));
        double rest[3];
        TD_ASSERT_OK(steps(t, &b2, 3, rest));
        expect_same(rest, whole + 3, 3, into_disk ? "resumed with the disk tier" : "resumed without it");
        td_trainer_destroy(t);
    }
    assert_int_equal(count_files(dir_a), 0);
}

/* Each I/O fault in a step: the step fails with the engine's message
 * (naming the directory); the trainer goes without a leak; the checkpoint
 * saved before still loads and continues as the run without faults. */
static void test_disk_faults_fail_cleanly(void **state)
{
    td_train_config c = small_config();
    int dc, nc;
    td_train_config d = with_disk(c, &dc, &nc);
    double whole[4];
    td_test_train(&c, 4, 3, whole, NULL);
    char ck[400];
    snprintf(ck, sizeof ck, "%s/ckpt_fault", tmp_root);
    struct { td_fault_kind kind; const char *says; } faults[] = {
        {TD_FAULT_DISK_NOSPC, "No space left on device"},
        {TD_FAULT_DISK_EIO, "Input/output error"},
        {TD_FAULT_DISK_SHORT, "short"},
    };
    for (size_t f = 0; f < sizeof faults / sizeof faults[0]; f++)
        for (int nth = 1; nth <= 7; nth += 6) { /* a read or write early in the step, and one later */
            size_t live = td_host_live_allocs();
            td_trainer *t;
            td_test_batches b = td_test_batches_of(&d, 3);
            TD_ASSERT_OK(td_trainer_create(&d, &t));
            TD_ASSERT_OK(steps(t, &b, 2, NULL));
            TD_ASSERT_OK(td_trainer_save(t, ck, 1, NULL));
            td_fault_arm(faults[f].kind, nth);
            td_status st = steps(t, &b, 2, NULL);
            long seen = td_fault_count(faults[f].kind);
            td_fault_disarm_all();
            assert_true(seen >= nth); /* the fault was reached */
            assert_int_equal(st, TD_ERR_IO);
            assert_non_null(strstr(td_error_msg(), faults[f].says));
            assert_true(strstr(td_error_msg(), dir_a) || strstr(td_error_msg(), dir_b));
            td_trainer_destroy(t);
            assert_int_equal(td_host_live_allocs(), live);
            assert_int_equal(count_files(dir_a), 0);
            assert_int_equal(count_files(dir_b), 0);
            /* Nothing lost: the checkpoint continues as the run without faults. */
            td_test_batches b2 = td_test_batches_of(&c, 3);
            for (int s = 0; s < 2; s++) {
                int32_t tok[64], tgt[64];
                TD_ASSERT_OK(td_test_next_batch(&b2, tok, tgt, NULL));
            }
            TD_ASSERT_OK(td_trainer_create(&c, &t));
            TD_ASSERT_OK(td_trainer_load(t, ck, 1, NULL));
            double rest[2];
            TD_ASSERT_OK(steps(t, &b2, 2, rest));
            expect_same(rest, whole + 2, 2, "from the checkpoint before the fault");
            td_trainer_destroy(t);
        }
}

/* A disk too small for the state: refused at creation, naming it; a
 * plan for a disk one does not have (--disk-bytes) counts it. */
static void test_disk_room(void **state)
{
    td_train_config c = small_config();
    int dc, nc;
    td_train_config d = with_disk(c, &dc, &nc);
    td_train_plan p;
    d.disk_bytes = 4096; /* far too little */
    TD_ASSERT_OK(td_train_plan_make(&d, d.gpu_budget, &p));
    assert_false(p.disk_fits);
    td_train_limits lim = { .budget_bytes = d.gpu_budget, .device_free_bytes = SIZE_MAX, .ram_bytes = d.host_ram,
                            .pin_limit_bytes = d.host_pin_limit };
    int fits = 1, host = 1;
    TD_ASSERT_OK(td_train_plan_fits(&d, &lim, &p, &fits, &host));
    assert_false(host);
    td_trainer *t;
    assert_int_equal(td_trainer_create(&d, &t), TD_ERR_IO);
    assert_non_null(strstr(td_error_msg(), "--offload-dir"));
    /* Without directories, --disk-bytes alone plans it. */
    d.mm.n_disk_dirs = 0;
    d.disk_bytes = TD_GiB;
    TD_ASSERT_OK(td_train_plan_make(&d, d.gpu_budget, &p));
    assert_true(p.disk_chunks > 0 && p.disk_fits);
    assert_int_equal(p.disk_free_bytes, TD_GiB);
    /* A RAM figure no disk helps: still refused, saying the whole state is on disk. */
    d.mm.disk_dirs = dirs;
    d.mm.n_disk_dirs = 2;
    d.disk_bytes = 0;
    d.host_ram = 8 * TD_MiB;
    TD_ASSERT_OK(td_train_plan_make(&d, d.gpu_budget, &p));
    assert_int_equal(p.disk_chunks, p.optim_chunks);
    assert_int_equal(td_trainer_create(&d, &t), TD_ERR_NOMEM);
    assert_non_null(strstr(td_error_msg(), "whole optimizer state on disk"));
    assert_int_equal(count_files(dir_a), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_memmgr_disk_chunks),
        cmocka_unit_test(test_disk_losses_bit_identical),
        cmocka_unit_test(test_disk_params_and_grads),
        cmocka_unit_test(test_disk_bytes_per_step_as_planned),
        cmocka_unit_test(test_disk_checkpoint_round_trip),
        cmocka_unit_test(test_disk_faults_fail_cleanly),
        cmocka_unit_test(test_disk_room),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
