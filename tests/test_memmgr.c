/* The chunk manager: layout, tensor states through access/release, and
 * randomized traces under random budgets in the cpu backend's delaying,
 * poisoning debug mode (or on cuda with TD_BACKEND=cuda): the budget is
 * never exceeded, nothing is read before it arrives, contents survive any
 * number of evictions and reloads, dirty data is never lost. */
#include "td_test.h"
#include "tidal/memmgr.h"
#include "tidal/trace.h"

#include <cjson/cJSON.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

typedef struct rig {
    td_backend *b;
    td_hostpool *pool;
    td_arena *arena;
    td_copy_engine *eng;
    td_memmgr *m;
} rig;

static void rig_open(rig *r, int debug, size_t budget, const td_memmgr_params *mp)
{
    memset(r, 0, sizeof *r);
    r->b = td_test_backend(debug);
    td_hostpool_params hp = td_hostpool_default_params();
    hp.slab_bytes = 4 * TD_MiB;
    TD_ASSERT_OK(td_hostpool_create(r->b, NULL, &hp, &r->pool));
    TD_ASSERT_OK(td_arena_create(r->b, budget, &r->arena));
    td_copy_params cp = td_copy_default_params();
    cp.events_per_queue = 8; /* small ring: tickets get reused often */
    TD_ASSERT_OK(td_copy_engine_create(r->b, &cp, &r->eng));
    TD_ASSERT_OK(td_memmgr_create(r->arena, r->pool, r->eng, mp, &r->m));
}

static void rig_close(rig *r)
{
    td_memmgr_destroy(r->m);
    td_copy_engine_destroy(r->eng);
    td_arena_destroy(r->arena);
    td_hostpool_destroy(r->pool);
    td_backend_free(r->b);
}

/* Device memory through the compute queue: a plain memcpy on cpu, a copy
 * on the compute stream on cuda; either way ordered after the loads. */
static void dev_read(rig *r, void *dst, const void *dev, size_t n)
{
    TD_ASSERT_OK(td_backend_copy_async(r->b, TD_QUEUE_COMPUTE, dst, dev, n));
    TD_ASSERT_OK(td_queue_sync(r->b, TD_QUEUE_COMPUTE));
}

static void dev_write(rig *r, void *dev, const void *src, size_t n)
{
    TD_ASSERT_OK(td_backend_copy_async(r->b, TD_QUEUE_COMPUTE, dev, src, n));
    TD_ASSERT_OK(td_queue_sync(r->b, TD_QUEUE_COMPUTE));
}


/* ---- only what crosses PCIe is pinned -------------------------------------- */

static size_t int8ish_bytes(size_t numel, void *ctx)
{
    (void)ctx;
    return ((numel + 3) & ~(size_t)3) + (numel + 255) / 256 * 4; /* codes, then a scale per 256 */
}

/* A chunk's host copy is pageable iff it holds optimizer state (master, m,
 * v) homed on the host at layout: those never reach the device (access is
 * refused with a clear error) and take no pinned bytes; set_chunk_home
 * before the layout moves a chunk to the device side (pinned); an opaque
 * role format sizes its chunks by its function and keeps the mirrored
 * layout. */
static void test_pageable_optimizer_state(void **state)
{
    rig r;
    td_memmgr_params mp = td_memmgr_default_params();
    mp.chunk_numel = 4096;
    mp.placement = TD_PLACEMENT_CPU;
    rig_open(&r, 0, 16 * TD_MiB, &mp);
    static const size_t sizes[] = {3000, 700, 4000, 1000};
    enum { N = 4 };
    int ids[5][N];
    static const td_tensor_role roles[5] = {TD_TENSOR_PARAM, TD_TENSOR_GRAD, TD_TENSOR_MASTER, TD_TENSOR_ADAM_M,
                                            TD_TENSOR_ADAM_V};
    char name[32];
    TD_ASSERT_OK(td_memmgr_set_role_format(r.m, TD_TENSOR_ADAM_V, int8ish_bytes, NULL));
    for (int k = 0; k < 5; k++)
        for (int i = 0; i < N; i++) {
            snprintf(name, sizeof name, "%s%d", td_tensor_role_name(roles[k]), i);
            TD_ASSERT_OK(td_memmgr_register(r.m, name, sizes[i], k == 0 || k == 1 ? TD_DTYPE_BF16 : TD_DTYPE_F32,
                                            roles[k], &ids[k][i]));
        }
    TD_ASSERT_OK(td_memmgr_plan_layout(r.m));
    int chunks = td_memmgr_role_chunk_count(r.m, TD_TENSOR_PARAM);
    assert_true(chunks >= 2);
    for (int k = 0; k < 5; k++) {
        assert_int_equal(td_memmgr_role_chunk_count(r.m, roles[k]), chunks);
        for (int i = 0; i < N; i++)
            assert_int_equal(td_memmgr_tensor_chunk(r.m, ids[k][i]) - td_memmgr_role_chunk(r.m, roles[k], 0),
                             td_memmgr_tensor_chunk(r.m, ids[0][i]) - td_memmgr_role_chunk(r.m, TD_TENSOR_PARAM, 0));
    }
    /* Chunk 0's master on the device side: pinned; the rest stays pageable. */
    int master0 = td_memmgr_role_chunk(r.m, TD_TENSOR_MASTER, 0);
    TD_ASSERT_OK(td_memmgr_set_chunk_home(r.m, master0, TD_HOME_DEVICE));
    assert_int_equal(td_memmgr_set_chunk_home(r.m, 9999, TD_HOME_HOST), TD_ERR_INVALID);
    size_t pinned = 0, pinned_blocks = 0, pageable = 0;
    for (int c = 0; c < td_memmgr_chunk_count(r.m); c++) {
        td_tensor_role role = td_memmgr_chunk_role(r.m, c);
        int want = (role == TD_TENSOR_MASTER || role == TD_TENSOR_ADAM_M || role == TD_TENSOR_ADAM_V) && c != master0;
        assert_int_equal(td_memmgr_chunk_pageable(r.m, c), want);
        /* The device slot is the capacity; the host copy stops at the last tensor. */
        size_t bytes = td_memmgr_chunk_bytes(r.m, c), used = td_memmgr_chunk_numel_used(r.m, c), end = 0;
        for (int k = 0; k < 5; k++)
            for (int i = 0; i < N; i++)
                if (td_memmgr_tensor_chunk(r.m, ids[k][i]) == c)
                    end = td_memmgr_tensor_offset(r.m, ids[k][i]) + sizes[i] > end
                              ? td_memmgr_tensor_offset(r.m, ids[k][i]) + sizes[i] : end;
        assert_int_equal(used, end);
        assert_true(used < 4096 || c == td_memmgr_role_chunk(r.m, role, 1)); /* 3000+700 and 1000: tails */
        size_t el = role == TD_TENSOR_PARAM || role == TD_TENSOR_GRAD ? 2 : 4;
        if (role == TD_TENSOR_ADAM_V) {
            assert_int_equal(td_memmgr_chunk_slot_bytes(r.m, c), int8ish_bytes(4096, NULL));
            assert_int_equal(bytes, int8ish_bytes(used, NULL));
        } else {
            assert_int_equal(td_memmgr_chunk_slot_bytes(r.m, c), 4096 * el);
            assert_int_equal(bytes, used * el);
        }
        if (want) pageable += td_hostmem_round(bytes);
        else pinned += bytes, pinned_blocks += td_align_up(bytes, TD_HOSTPOOL_ALIGN);
    }
    TD_ASSERT_OK(td_memmgr_layout(r.m));
    assert_int_equal(td_memmgr_set_chunk_home(r.m, master0, TD_HOME_HOST), TD_ERR_STATE);
    td_memmgr_stats s;
    td_memmgr_get_stats(r.m, &s);
    assert_int_equal(s.host_chunk_bytes, pinned);
    assert_int_equal(s.host_pageable_bytes, pageable);
    td_hostpool_stats hs;
    td_hostpool_get_stats(r.pool, &hs);
    assert_int_equal(hs.used[TD_ROLE_OPTIM] + hs.used[TD_ROLE_CHUNK], pinned_blocks); /* in 4 KiB blocks */
    /* Host access works on every chunk, pageable ones read zero at first;
     * an opaque role's tensors all point at their chunk's start. */
    void *p[2];
    int two[2] = {ids[3][0], ids[4][1]};
    TD_ASSERT_OK(td_memmgr_set_state(r.m, two, 2, TD_TENSOR_HOLD));
    TD_ASSERT_OK(td_memmgr_host_access(r.m, two, 2, TD_ACCESS_WRITE, p));
    for (size_t i = 0; i < sizes[0]; i++) assert_true(((float *)p[0])[i] == 0.0f);
    void *vchunk;
    TD_ASSERT_OK(td_memmgr_chunk_host_access(r.m, td_memmgr_tensor_chunk(r.m, ids[4][1]), 0, &vchunk));
    assert_ptr_equal(p[1], vchunk);
    memset(p[0], 7, sizes[0] * 4);
    /* The device refuses the pageable ones and takes the rest. */
    TD_ASSERT_OK(td_memmgr_step_begin(r.m));
    void *d[2];
    assert_int_equal(td_memmgr_access(r.m, &ids[3][0], 1, TD_TENSOR_COMPUTE, 0, d), TD_ERR_STATE);
    assert_non_null(strstr(td_error_msg(), "pageable"));
    int dev_ok[2] = {ids[0][0], ids[2][0]}; /* a param, and the master homed on the device */
    assert_int_equal(td_memmgr_tensor_chunk(r.m, ids[2][0]), master0);
    TD_ASSERT_OK(td_memmgr_access(r.m, dev_ok, 2, TD_TENSOR_COMPUTE, 0, d));
    TD_ASSERT_OK(td_memmgr_release(r.m, dev_ok, 2, TD_TENSOR_HOLD));
    TD_ASSERT_OK(td_memmgr_step_end(r.m));
    TD_ASSERT_OK(td_memmgr_host_access(r.m, &ids[3][0], 1, 0, p));
    assert_int_equal(((unsigned char *)p[0])[123], 7);
    rig_close(&r);
}

/* ---- layout ---------------------------------------------------------------- */

static void test_layout_packs_and_mirrors(void **state)
{
    rig r;
    td_memmgr_params mp = td_memmgr_default_params();
    mp.min_chunk_numel = 1000;
    mp.max_chunk_numel = 20000;
    rig_open(&r, 0, 16 * TD_MiB, &mp);
    static const size_t sizes[] = {3000, 700, 700, 5000, 64, 30000, 1200, 4100, 999};
    int n = (int)(sizeof sizes / sizeof sizes[0]);
    int pid[9], gid[9], mid[9];
    char name[64];
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "p%d", i);
        TD_ASSERT_OK(td_memmgr_register(r.m, name, sizes[i], TD_DTYPE_BF16, TD_TENSOR_PARAM, &pid[i]));
    }
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "g%d", i);
        TD_ASSERT_OK(td_memmgr_register(r.m, name, sizes[i], TD_DTYPE_BF16, TD_TENSOR_GRAD, &gid[i]));
        snprintf(name, sizeof name, "m%d", i);
        TD_ASSERT_OK(td_memmgr_register(r.m, name, sizes[i], TD_DTYPE_F32, TD_TENSOR_MASTER, &mid[i]));
    }
    TD_ASSERT_OK(td_memmgr_layout(r.m));
    size_t cap = td_memmgr_chunk_numel(r.m);
    assert_true(cap >= 1000 && cap <= 20000 + 64);
    /* Tensors lie inside their chunks, aligned, without overlap. */
    for (int i = 0; i < n; i++) {
        int c = td_memmgr_tensor_chunk(r.m, pid[i]);
        size_t off = td_memmgr_tensor_offset(r.m, pid[i]);
        assert_int_equal(off % 64, 0);
        assert_true(off + sizes[i] <= td_memmgr_chunk_bytes(r.m, c) / 2);
        for (int j = 0; j < i; j++)
            if (td_memmgr_tensor_chunk(r.m, pid[j]) == c) {
                size_t o2 = td_memmgr_tensor_offset(r.m, pid[j]);
                assert_true(o2 + sizes[j] <= off || off + sizes[i] <= o2);
            }
        if (sizes[i] > cap) assert_int_equal(td_memmgr_chunk_bytes(r.m, c), sizes[i] * 2); /* own chunk */
        /* Grads and master mirror the params: same chunk index, same offset. */
        int idx = c - td_memmgr_role_chunk(r.m, TD_TENSOR_PARAM, 0);
        assert_int_equal(td_memmgr_tensor_chunk(r.m, gid[i]), td_memmgr_role_chunk(r.m, TD_TENSOR_GRAD, idx));
        assert_int_equal(td_memmgr_tensor_offset(r.m, gid[i]), off);
        assert_int_equal(td_memmgr_tensor_chunk(r.m, mid[i]), td_memmgr_role_chunk(r.m, TD_TENSOR_MASTER, idx));
        assert_int_equal(td_memmgr_tensor_offset(r.m, mid[i]), off);
    }
    /* The searched size wastes no more than any other aligned size in range
     * (brute force over every candidate, packing as documented). */
    size_t best_waste = SIZE_MAX;
    for (size_t c = 1024; c <= 20000; c += 64) {
        size_t waste = 0;
        for (int role = 0; role < 3; role++) {
            size_t el = role == 2 ? 4 : 2, used = 0;
            int open = 0;
            for (int i = 0; i < n; i++) {
                if (sizes[i] > c) continue;
                size_t start = (used + 63) / 64 * 64;
                if (!open || start + sizes[i] > c) {
                    if (open) waste += (c - used) * el;
                    open = 1;
                    start = 0;
                } else {
                    waste += (start - used) * el;
                }
                used = start + sizes[i];
            }
            if (open) waste += (c - used) * el;
        }
        if (waste < best_waste) best_waste = waste;
    }
    assert_true(td_memmgr_padding_bytes(r.m) <= best_waste);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    td_memmgr_print_layout(r.m, f);
    fclose(f);
    assert_non_null(strstr(text, "chunk layout: 27 tensors"));
    assert_non_null(strstr(text, "p5")); /* the big one, alone */
    free(text);
    int x;
    assert_int_equal(td_memmgr_register(r.m, "late", 10, TD_DTYPE_F32, TD_TENSOR_OTHER, &x), TD_ERR_STATE);
    rig_close(&r);
}

/* One role's padding bytes at capacity c, packed as documented: in order,
 * at aligned offsets, a new chunk when one does not fit or its element size
 * differs; a tensor over c alone in a chunk of its own. */
static size_t role_waste(const size_t *sizes, const size_t *els, int n, size_t c)
{
    size_t waste = 0, used = 0, open_el = 0;
    int open = 0;
    for (int i = 0; i < n; i++) {
        if (sizes[i] > c) continue;
        size_t start = (used + 63) / 64 * 64;
        if (!open || start + sizes[i] > c || els[i] != open_el) {
            if (open) waste += (c - used) * open_el;
            open = 1;
            open_el = els[i];
            start = 0;
        } else {
            waste += (start - used) * els[i];
        }
        used = start + sizes[i];
    }
    return open ? waste + (c - used) * open_el : waste;
}

/* The search prices every role as its own walk would: roles whose sizes
 * mirror the params' (in another element size too) and roles that only
 * look alike (the same sizes in another order, one size changed, mixed
 * element sizes).  Brute force over every candidate gives the least
 * padding, which the layout must reach exactly. */
static void test_layout_search_prices_every_role(void **state)
{
    rig r;
    td_memmgr_params mp = td_memmgr_default_params();
    mp.min_chunk_numel = 1024;
    mp.max_chunk_numel = 24576;
    rig_open(&r, 0, 16 * TD_MiB, &mp);
    enum { N = 11 };
    static const size_t sizes[N] = {3000, 700, 700, 5000, 64, 30000, 1200, 4100, 999, 7777, 2048};
    size_t roles[6][N], els[6][N];
    static const td_tensor_role role_of[6] = {TD_TENSOR_PARAM, TD_TENSOR_GRAD, TD_TENSOR_MASTER,
                                              TD_TENSOR_ADAM_M, TD_TENSOR_ADAM_V, TD_TENSOR_OTHER};
    for (int i = 0; i < N; i++) {
        roles[0][i] = roles[1][i] = roles[2][i] = sizes[i];   /* params, grads, master: mirrored */
        roles[3][i] = sizes[N - 1 - i];                       /* m: the same sizes, reversed */
        roles[4][i] = i == 6 ? 6000 : sizes[i];               /* v: one size changed */
        roles[5][i] = sizes[(i * 7) % N];                     /* other: shuffled, mixed element sizes */
        els[0][i] = els[1][i] = 2;
        els[2][i] = els[3][i] = els[4][i] = 4;
        els[5][i] = i % 3 ? 2 : 4;
    }
    char name[64];
    for (int k = 0; k < 6; k++)
        for (int i = 0; i < N; i++) {
            int id;
            snprintf(name, sizeof name, "r%d.%d", k, i);
            TD_ASSERT_OK(td_memmgr_register(r.m, name, roles[k][i], els[k][i] == 2 ? TD_DTYPE_BF16 : TD_DTYPE_F32,
                                            role_of[k], &id));
        }
    TD_ASSERT_OK(td_memmgr_layout(r.m));
    size_t best = SIZE_MAX, best_cap = 0;
    for (size_t c = 1024; c <= 24576; c += 64) {
        size_t waste = 0;
        for (int k = 0; k < 6; k++) waste += role_waste(roles[k], els[k], N, c);
        if (waste < best) best = waste, best_cap = c;
    }
    if (td_memmgr_padding_bytes(r.m) != best)
        fail_msg("the layout pads %zu bytes at %zu elements a chunk; brute force finds %zu at %zu",
                 td_memmgr_padding_bytes(r.m), td_memmgr_chunk_numel(r.m), best, best_cap);
    rig_close(&r);
}

static void test_bad_registrations(void **state)
{
    rig r;
    rig_open(&r, 0, TD_MiB, NULL);
    int id;
    assert_int_equal(td_memmgr_register(r.m, "empty", 0, TD_DTYPE_F32, TD_TENSOR_PARAM, &id), TD_ERR_INVALID);
    assert_int_equal(td_memmgr_register(r.m, "", 5, TD_DTYPE_F32, TD_TENSOR_PARAM, &id), TD_ERR_INVALID);
    assert_int_equal(td_memmgr_register(r.m, "x", 5, (td_dtype)9, TD_TENSOR_PARAM, &id), TD_ERR_INVALID);
    assert_int_equal(td_memmgr_layout(r.m), TD_ERR_INVALID); /* nothing registered */
    rig_close(&r);
}

/* ---- states through the manager ------------------------------------------- */

static void test_states_and_zero_fill(void **state)
{
    rig r;
    td_memmgr_params mp = td_memmgr_default_params();
    mp.chunk_numel = 4096;
    rig_open(&r, 1, TD_MiB, &mp);
    int a, b;
    TD_ASSERT_OK(td_memmgr_register(r.m, "a", 1000, TD_DTYPE_F32, TD_TENSOR_GRAD, &a));
    TD_ASSERT_OK(td_memmgr_register(r.m, "b", 1000, TD_DTYPE_F32, TD_TENSOR_GRAD, &b));
    TD_ASSERT_OK(td_memmgr_layout(r.m));
    int ids[2] = {a, b};
    void *p[2];
    float buf[1000];
    /* HOLD -> READY_FOR_REDUCE is illegal: an error naming the tensor, nothing changes. */
    assert_int_equal(td_memmgr_release(r.m, &a, 1, TD_TENSOR_READY_FOR_REDUCE), TD_ERR_STATE);
    assert_non_null(strstr(td_error_msg(), "'a': illegal transition FREE -> READY_FOR_REDUCE"));
    assert_int_equal(td_memmgr_tensor_state(r.m, a), TD_TENSOR_FREE);
    TD_ASSERT_OK(td_memmgr_access(r.m, ids, 2, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, p));
    dev_read(&r, buf, p[0], sizeof buf);
    for (int i = 0; i < 1000; i++) assert_true(buf[i] == 0.0f); /* FREE chunk comes zeroed */
    for (int i = 0; i < 1000; i++) buf[i] = (float)i;
    dev_write(&r, p[0], buf, sizeof buf);
    /* Nested COMPUTE is a bug: refused. */
    assert_int_equal(td_memmgr_access(r.m, &a, 1, TD_TENSOR_COMPUTE, 0, p), TD_ERR_STATE);
    assert_int_equal(td_memmgr_host_access(r.m, &a, 1, 0, p), TD_ERR_STATE); /* in COMPUTE on the device */
    int twice[2] = {a, a};
    assert_int_equal(td_memmgr_release(r.m, twice, 2, TD_TENSOR_HOLD_AFTER_BWD), TD_ERR_INVALID);
    TD_ASSERT_OK(td_memmgr_release(r.m, ids, 2, TD_TENSOR_HOLD_AFTER_BWD));
    TD_ASSERT_OK(td_memmgr_set_state(r.m, ids, 2, TD_TENSOR_READY_FOR_REDUCE));
    TD_ASSERT_OK(td_memmgr_writeback_async(r.m, ids, 2));
    void *h[2];
    TD_ASSERT_OK(td_memmgr_host_access(r.m, ids, 2, TD_ACCESS_READ, h));
    assert_memory_equal(h[0], buf, sizeof buf); /* the grad reached the host */
    /* Consumed: FREE again; the next access starts from zeros again. */
    TD_ASSERT_OK(td_memmgr_set_state(r.m, ids, 2, TD_TENSOR_FREE));
    TD_ASSERT_OK(td_memmgr_access(r.m, ids, 2, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, p));
    dev_read(&r, buf, p[0], sizeof buf);
    for (int i = 0; i < 1000; i++) assert_true(buf[i] == 0.0f);
    TD_ASSERT_OK(td_memmgr_release(r.m, ids, 2, TD_TENSOR_HOLD));
    rig_close(&r);
}

/* ---- transient grads (grad_slots) ------------------------------------------ */

typedef struct consumer { td_memmgr *m; void *host; int delay_us; td_status st; } consumer;

static void *consume_later(void *arg)
{
    consumer *c = arg;
    usleep((useconds_t)c->delay_us);
    c->st = td_memmgr_grad_consumed(c->m, c->host);
    return NULL;
}

/* One grad chunk's step: written on the device with `v`, released ready,
 * written back (taking a slot). */
static td_status write_grad(rig *r, int id, float v, size_t n)
{
    void *p;
    float buf[1024];
    td_status st = td_memmgr_access(r->m, &id, 1, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, &p);
    if (st) return st;
    for (size_t i = 0; i < n; i++) buf[i] = v + (float)i;
    dev_write(r, p, buf, n * sizeof(float));
    if ((st = td_memmgr_release(r->m, &id, 1, TD_TENSOR_READY_FOR_REDUCE))) return st;
    return td_memmgr_writeback_async(r->m, &id, 1);
}

/* Grad chunks whose optimizer chunk lives on the host have no host copy of
 * their own: a write-back takes a staging slot; a consumer's peek lends
 * it and td_memmgr_grad_consumed frees it; a write-back with every slot
 * lent waits for a consumer on another thread; with every slot merely held
 * (no consumer) it fails, saying why; a consumed chunk's host copy is gone;
 * FREE grads give their slot back; fewer such chunks than slots: off, and
 * so are 0 and the default -1 (the trainer's auto, which it resolves to a
 * count or 0 before a layout). */
static void test_transient_grads(void **state)
{
    enum { N = 4, NUMEL = 1024 };
    assert_int_equal(td_memmgr_default_params().grad_slots, -1);
    static const int cases[] = {-1, 0, 2, 4};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        int slots = cases[ci];
        rig r;
        td_memmgr_params mp = td_memmgr_default_params();
        mp.chunk_numel = NUMEL;
        mp.placement = TD_PLACEMENT_CPU;
        mp.grad_slots = slots;
        rig_open(&r, 1, TD_MiB, &mp);
        static const td_tensor_role roles[5] = {TD_TENSOR_PARAM, TD_TENSOR_GRAD, TD_TENSOR_MASTER, TD_TENSOR_ADAM_M,
                                                TD_TENSOR_ADAM_V};
        int ids[5][N];
        char name[32];
        for (int k = 0; k < 5; k++)
            for (int i = 0; i < N; i++) {
                snprintf(name, sizeof name, "%s%d", td_tensor_role_name(roles[k]), i);
                TD_ASSERT_OK(td_memmgr_register(r.m, name, NUMEL, TD_DTYPE_F32, roles[k], &ids[k][i]));
            }
        TD_ASSERT_OK(td_memmgr_plan_layout(r.m));
        size_t slot_bytes = 0;
        if (slots != 2) { /* off, or no more such chunks than slots: a copy each */
            assert_int_equal(td_memmgr_grad_slots(r.m, &slot_bytes), 0);
            for (int i = 0; i < N; i++)
                assert_false(td_memmgr_chunk_transient(r.m, td_memmgr_role_chunk(r.m, TD_TENSOR_GRAD, i)));
            TD_ASSERT_OK(td_memmgr_layout(r.m));
            assert_int_equal(td_memmgr_grad_slots(r.m, &slot_bytes), 0);
            assert_int_equal(slot_bytes, 0);
            rig_close(&r);
            continue;
        }
        assert_int_equal(td_memmgr_grad_slots(r.m, &slot_bytes), 2);
        assert_int_equal(slot_bytes, NUMEL * sizeof(float));
        for (int i = 0; i < N; i++) {
            assert_true(td_memmgr_chunk_transient(r.m, td_memmgr_role_chunk(r.m, TD_TENSOR_GRAD, i)));
            assert_false(td_memmgr_chunk_transient(r.m, td_memmgr_role_chunk(r.m, TD_TENSOR_PARAM, i)));
        }
        TD_ASSERT_OK(td_memmgr_layout(r.m));
        assert_int_equal(td_memmgr_grad_slots(r.m, &slot_bytes), 2);
        td_memmgr_stats ms;
        td_memmgr_get_stats(r.m, &ms);
        assert_int_equal(ms.host_chunk_bytes, (size_t)N * NUMEL * sizeof(float)); /* the params' copies only */
        int gc[N];
        for (int i = 0; i < N; i++) gc[i] = td_memmgr_role_chunk(r.m, TD_TENSOR_GRAD, i);

        /* Two chunks written back and lent: their grads arrive in the slots. */
        void *host[N];
        td_copy_ticket done[N];
        for (int i = 0; i < 2; i++) {
            TD_ASSERT_OK(write_grad(&r, ids[1][i], 100.0f * (float)i, NUMEL));
            TD_ASSERT_OK(td_memmgr_chunk_host_peek(r.m, gc[i], &host[i], &done[i]));
            TD_ASSERT_OK(td_copy_wait(r.eng, &done[i]));
            for (int j = 0; j < NUMEL; j++) assert_true(((float *)host[i])[j] == 100.0f * (float)i + (float)j);
        }
        assert_true(host[0] != host[1]);
        /* The third waits until a consumer frees a slot, then takes it. */
        consumer c = { .m = r.m, .host = host[0], .delay_us = 50000 };
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, consume_later, &c), 0);
        double t0 = td_now_ms();
        td_memmgr_stats before, after;
        td_memmgr_get_stats(r.m, &before);
        TD_ASSERT_OK(write_grad(&r, ids[1][2], 200.0f, NUMEL));
        double waited = td_now_ms() - t0;
        assert_true(waited >= 40.0);
        td_memmgr_get_stats(r.m, &after); /* the wait is counted, and no more than it lasted */
        assert_true(after.slot_wait_ms - before.slot_wait_ms >= 35.0 &&
                    after.slot_wait_ms - before.slot_wait_ms <= waited + 0.01);
        pthread_join(th, NULL);
        TD_ASSERT_OK(c.st);
        TD_ASSERT_OK(td_memmgr_chunk_host_peek(r.m, gc[2], &host[2], &done[2]));
        assert_ptr_equal(host[2], host[0]); /* the freed slot */
        TD_ASSERT_OK(td_copy_wait(r.eng, &done[2]));
        for (int j = 0; j < NUMEL; j++) assert_true(((float *)host[2])[j] == 200.0f + (float)j);
        /* Chunk 0 was consumed: its host copy is gone. */
        void *h;
        assert_int_equal(td_memmgr_chunk_host_access(r.m, gc[0], TD_ACCESS_READ, &h), TD_ERR_STATE);
        assert_non_null(strstr(td_error_msg(), "consumed"));
        /* Consuming twice, or what is no slot, is refused. */
        assert_int_equal(td_memmgr_grad_consumed(r.m, host[0] == host[2] ? (char *)host[2] + 1 : host[0]), TD_ERR_STATE);
        TD_ASSERT_OK(td_memmgr_grad_consumed(r.m, host[1]));
        TD_ASSERT_OK(td_memmgr_grad_consumed(r.m, host[2]));
        assert_int_equal(td_memmgr_grad_consumed(r.m, host[2]), TD_ERR_STATE);
        /* Spent grads FREE: every slot free again. */
        int all[N] = {ids[1][0], ids[1][1], ids[1][2]};
        TD_ASSERT_OK(td_memmgr_set_state(r.m, all, 3, TD_TENSOR_FREE));

        /* Held, not lent (no consumer peeked): the third write-back fails, naming why. */
        TD_ASSERT_OK(write_grad(&r, ids[1][0], 1.0f, NUMEL));
        TD_ASSERT_OK(write_grad(&r, ids[1][1], 2.0f, NUMEL));
        assert_int_equal(write_grad(&r, ids[1][2], 3.0f, NUMEL), TD_ERR_STATE);
        assert_non_null(strstr(td_error_msg(), "no consumer"));
        /* Their FREE gives the slots back: it goes through now. */
        TD_ASSERT_OK(td_memmgr_set_state(r.m, all, 2, TD_TENSOR_FREE));
        TD_ASSERT_OK(td_memmgr_writeback_async(r.m, &ids[1][2], 1));
        TD_ASSERT_OK(td_memmgr_chunk_host_access(r.m, gc[2], TD_ACCESS_READ, &h));
        for (int j = 0; j < NUMEL; j++) assert_true(((float *)h)[j] == 3.0f + (float)j);
        rig_close(&r);
    }
}

/* ---- randomized traces ------------------------------------------------------ */

typedef struct model {
    int n;
    int id[24];
    size_t numel[24];
    unsigned char *shadow[24]; /* expected contents (bytes) */
    int defined[24];
} model;

static void fill_random(td_rng *rng, unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(td_rng_next(rng) >> 24);
}

/* One randomized run; returns the loads of its steps after the warm-up. */
static uint64_t random_run(uint64_t seed, td_evict_policy policy, int prefetch, td_placement placement,
                           int check_budget_min)
{
    td_rng rng;
    td_rng_seed(&rng, seed);
    model md = {0};
    md.n = 6 + (int)td_rng_below(&rng, 18);
    size_t total = 0, largest = 0;
    for (int i = 0; i < md.n; i++) {
        md.numel[i] = 64 + td_rng_below(&rng, 6000);
        total += md.numel[i] * 4;
        if (md.numel[i] * 4 > largest) largest = md.numel[i] * 4;
    }
    td_memmgr_params mp = td_memmgr_default_params();
    mp.chunk_numel = 2048 + 64 * td_rng_below(&rng, 64);
    mp.eviction = policy;
    mp.prefetch = prefetch;
    mp.placement = placement;
    /* A budget between "one access fits" and "everything fits". */
    size_t chunk_bytes = (mp.chunk_numel > 6064 ? mp.chunk_numel : 6064) * 4 + 4096;
    size_t lo = 6 * chunk_bytes, hi = total * 2 + 6 * chunk_bytes + 1;
    size_t budget = lo + td_rng_below(&rng, hi - lo);
    if (placement == TD_PLACEMENT_STATIC) { /* half the chunks live on the device for good */
        mp.offload_param_frac = mp.offload_optim_frac = 0.5;
        budget = total + 8 * chunk_bytes + td_rng_below(&rng, total);
    }
    rig r;
    rig_open(&r, 1, budget, &mp);
    char name[32];
    for (int i = 0; i < md.n; i++) {
        snprintf(name, sizeof name, "t%d", i);
        td_tensor_role role = (td_tensor_role)td_rng_below(&rng, TD_TENSOR_ROLE_COUNT);
        TD_ASSERT_OK(td_memmgr_register(r.m, name, md.numel[i], TD_DTYPE_F32, role, &md.id[i]));
        md.shadow[i] = calloc(md.numel[i], 4);
    }
    TD_ASSERT_OK(td_memmgr_layout(r.m));
    /* The step's access pattern, repeated every step (so the plan applies). */
    int n_ops = 10 + (int)td_rng_below(&rng, 30);
    int op_tensor[40][3], op_count[40], op_write[40], op_host[40];
    size_t op_nonmodel[40];
    /* Optimizer state homed on the host is pageable and host-only: device
     * accesses draw from the other tensors. */
    int n_device = 0;
    for (int i = 0; i < md.n; i++) n_device += !td_memmgr_chunk_pageable(r.m, td_memmgr_tensor_chunk(r.m, md.id[i]));
    for (int k = 0; k < n_ops; k++) {
        op_host[k] = td_rng_below(&rng, 8) == 0 || n_device < 3;
        op_count[k] = 1 + (int)td_rng_below(&rng, 3);
        for (int j = 0; j < op_count[k]; j++) {
            int t;
            int dup;
            do {
                t = (int)td_rng_below(&rng, (uint64_t)md.n);
                dup = !op_host[k] && td_memmgr_chunk_pageable(r.m, td_memmgr_tensor_chunk(r.m, md.id[t]));
                for (int q = 0; q < j; q++) dup |= op_tensor[k][q] == t;
            } while (dup);
            op_tensor[k][j] = t;
        }
        op_write[k] = (int)td_rng_below(&rng, 2);
        op_nonmodel[k] = td_rng_below(&rng, 4) == 0 ? td_rng_below(&rng, chunk_bytes) + 1 : 0;
    }
    unsigned char *buf = malloc(6064 * 4);
    uint64_t loads_after_warmup = 0;
    td_memmgr_stats before = {0};
    for (int step = 0; step < 4; step++) {
        TD_ASSERT_OK(td_memmgr_step_begin(r.m));
        if (step == 1) td_memmgr_get_stats(r.m, &before);
        for (int k = 0; k < n_ops; k++) {
            int ids[3];
            void *ptr[3];
            for (int j = 0; j < op_count[k]; j++) ids[j] = md.id[op_tensor[k][j]];
            void *nm = NULL;
            if (op_nonmodel[k]) TD_ASSERT_OK(td_memmgr_alloc_nonmodel(r.m, op_nonmodel[k], TD_ROLE_ACTIVATION, &nm));
            if (op_host[k]) {
                if (op_write[k]) /* a host write needs a payload-holding state */
                    for (int j = 0; j < op_count[k]; j++)
                        if (td_memmgr_tensor_state(r.m, ids[j]) == TD_TENSOR_FREE) {
                            assert_int_equal(td_memmgr_host_access(r.m, &ids[j], 1, TD_ACCESS_WRITE, ptr), TD_ERR_STATE);
                            TD_ASSERT_OK(td_memmgr_set_state(r.m, &ids[j], 1, TD_TENSOR_HOLD));
                        }
                TD_ASSERT_OK(td_memmgr_host_access(r.m, ids, op_count[k], op_write[k] ? TD_ACCESS_WRITE : 0, ptr));
                for (int j = 0; j < op_count[k]; j++) {
                    int t = op_tensor[k][j];
                    size_t bytes = md.numel[t] * 4;
                    if (md.defined[t]) assert_memory_equal(ptr[j], md.shadow[t], bytes);
                    if (op_write[k]) {
                        fill_random(&rng, md.shadow[t], bytes);
                        memcpy(ptr[j], md.shadow[t], bytes);
                        md.defined[t] = 1;
                    }
                }
            } else {
                int first_use[3];
                for (int j = 0; j < op_count[k]; j++)
                    first_use[j] = td_memmgr_tensor_state(r.m, ids[j]) == TD_TENSOR_FREE;
                TD_ASSERT_OK(td_memmgr_access(r.m, ids, op_count[k], TD_TENSOR_COMPUTE,
                                              op_write[k] ? TD_ACCESS_WRITE : 0, ptr));
                for (int j = 0; j < op_count[k]; j++) {
                    int t = op_tensor[k][j];
                    size_t bytes = md.numel[t] * 4;
                    dev_read(&r, buf, ptr[j], bytes);
                    if (md.defined[t] && !first_use[j]) assert_memory_equal(buf, md.shadow[t], bytes);
                    if (op_write[k]) {
                        fill_random(&rng, md.shadow[t], bytes);
                        dev_write(&r, ptr[j], md.shadow[t], bytes);
                        md.defined[t] = 1;
                    } else if (first_use[j]) {
                        memcpy(md.shadow[t], buf, bytes); /* whatever a FREE tensor held, now it is this */
                        md.defined[t] = 1;
                    }
                }
                TD_ASSERT_OK(td_memmgr_release(r.m, ids, op_count[k], TD_TENSOR_HOLD));
            }
            if (nm) TD_ASSERT_OK(td_memmgr_free_nonmodel(r.m, nm));
            td_arena_stats as;
            td_arena_get_stats(r.arena, &as);
            assert_true(as.peak_bytes <= budget);
            assert_true(as.used_bytes <= budget);
        }
        TD_ASSERT_OK(td_memmgr_step_end(r.m));
    }
    td_memmgr_stats after;
    td_memmgr_get_stats(r.m, &after);
    loads_after_warmup = after.loads - before.loads;
    assert_true(after.device_peak_bytes <= budget);
    if (check_budget_min) assert_true(td_memmgr_min_budget(r.m) <= budget);
    /* Finally every tensor's newest data reaches the host intact. */
    for (int i = 0; i < md.n; i++) {
        void *h;
        TD_ASSERT_OK(td_memmgr_host_access(r.m, &md.id[i], 1, 0, &h));
        if (md.defined[i]) assert_memory_equal(h, md.shadow[i], md.numel[i] * 4);
        free(md.shadow[i]);
    }
    free(buf);
    rig_close(&r);
    return loads_after_warmup;
}

static void test_random_traces_keep_data(void **state)
{
    int seeds = td_test_seeds(12);
    for (int s = 1; s <= seeds; s++) {
        random_run((uint64_t)s, TD_EVICT_BELADY, -1, TD_PLACEMENT_CPU, 1);
        random_run((uint64_t)s + 1000, TD_EVICT_LRU, 0, TD_PLACEMENT_AUTO, 1);
        random_run((uint64_t)s + 2000, TD_EVICT_BELADY, 2, TD_PLACEMENT_STATIC, 0);
    }
}

/* On a cyclic pattern larger than the budget, Belady-with-wrap beats LRU
 * (which misses on every access of a loop one chunk too big). */
static void test_belady_beats_lru_on_a_loop(void **state)
{
    uint64_t loads[2];
    for (int pol = 0; pol < 2; pol++) {
        td_memmgr_params mp = td_memmgr_default_params();
        mp.chunk_numel = 4096; /* 16 KiB chunks */
        mp.eviction = pol ? TD_EVICT_BELADY : TD_EVICT_LRU;
        mp.placement = TD_PLACEMENT_CPU;
        mp.prefetch = 0;
        rig r;
        rig_open(&r, 0, 4 * 16384, &mp); /* room for 4 of 5 chunks */
        int id[5];
        for (int i = 0; i < 5; i++) TD_ASSERT_OK(td_memmgr_register(r.m, "x", 4096, TD_DTYPE_F32, TD_TENSOR_PARAM, &id[i]));
        TD_ASSERT_OK(td_memmgr_layout(r.m));
        td_memmgr_stats s0, s1;
        for (int step = 0; step < 6; step++) {
            if (step == 1) td_memmgr_get_stats(r.m, &s0);
            TD_ASSERT_OK(td_memmgr_step_begin(r.m));
            for (int i = 0; i < 5; i++) {
                void *p;
                TD_ASSERT_OK(td_memmgr_access(r.m, &id[i], 1, TD_TENSOR_COMPUTE, 0, &p));
                TD_ASSERT_OK(td_memmgr_release(r.m, &id[i], 1, TD_TENSOR_HOLD));
            }
            TD_ASSERT_OK(td_memmgr_step_end(r.m));
        }
        td_memmgr_get_stats(r.m, &s1);
        loads[pol] = s1.loads - s0.loads;
        rig_close(&r);
    }
    assert_int_equal(loads[0], 25); /* LRU: every access of the loop misses */
    /* Belady (MIN) on a cycle of 5 chunks through 4 slots misses once every
     * 4 accesses: at positions 5, 9, ..., 29 of the 25 accesses measured. */
    assert_int_equal(loads[1], 7);
}

/* The budget-too-small error says what would fit. */
static void test_budget_too_small(void **state)
{
    td_memmgr_params mp = td_memmgr_default_params();
    mp.chunk_numel = 4096;
    rig r;
    rig_open(&r, 0, 20000, &mp);
    int a, b;
    TD_ASSERT_OK(td_memmgr_register(r.m, "a", 4096, TD_DTYPE_F32, TD_TENSOR_PARAM, &a));
    TD_ASSERT_OK(td_memmgr_register(r.m, "b", 4096, TD_DTYPE_F32, TD_TENSOR_PARAM, &b));
    TD_ASSERT_OK(td_memmgr_layout(r.m));
    int ids[2] = {a, b};
    void *p[2];
    assert_int_equal(td_memmgr_access(r.m, ids, 2, TD_TENSOR_COMPUTE, 0, p), TD_ERR_BUDGET);
    assert_non_null(strstr(td_error_msg(), "needs a budget of at least 32.00 KiB"));
    assert_int_equal(td_memmgr_tensor_state(r.m, a), TD_TENSOR_FREE); /* nothing changed */
    TD_ASSERT_OK(td_memmgr_access(r.m, &a, 1, TD_TENSOR_COMPUTE, 0, p)); /* one at a time fits */
    TD_ASSERT_OK(td_memmgr_release(r.m, &a, 1, TD_TENSOR_HOLD));
    TD_ASSERT_OK(td_memmgr_access(r.m, &b, 1, TD_TENSOR_COMPUTE, 0, p));
    TD_ASSERT_OK(td_memmgr_release(r.m, &b, 1, TD_TENSOR_HOLD));
    rig_close(&r);
}

/* cuda placement keeps everything resident; auto with room does the same
 * after the warm-up; the warm-up trace is written and parses. */
static void test_placements_and_trace_out(void **state)
{
    char path[] = "/tmp/tidal-trace-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    for (int pl = 0; pl < 2; pl++) {
        td_memmgr_params mp = td_memmgr_default_params();
        mp.chunk_numel = 4096;
        mp.placement = pl ? TD_PLACEMENT_AUTO : TD_PLACEMENT_CUDA;
        mp.trace_out = pl ? path : NULL;
        rig r;
        rig_open(&r, 0, TD_MiB, &mp);
        int id[6];
        for (int i = 0; i < 6; i++) TD_ASSERT_OK(td_memmgr_register(r.m, "w", 3000, TD_DTYPE_F32, TD_TENSOR_PARAM, &id[i]));
        TD_ASSERT_OK(td_memmgr_layout(r.m));
        td_memmgr_stats s[3];
        for (int step = 0; step < 3; step++) {
            TD_ASSERT_OK(td_memmgr_step_begin(r.m));
            for (int i = 0; i < 6; i++) {
                void *p;
                TD_ASSERT_OK(td_memmgr_access(r.m, &id[i], 1, TD_TENSOR_COMPUTE, i % 2 ? TD_ACCESS_WRITE : 0, &p));
                TD_ASSERT_OK(td_memmgr_release(r.m, &id[i], 1, TD_TENSOR_HOLD));
                if (i == 2) { /* a spike between two accesses: the trace must show it */
                    void *spike;
                    TD_ASSERT_OK(td_memmgr_alloc_nonmodel(r.m, 5000, TD_ROLE_ACTIVATION, &spike));
                    TD_ASSERT_OK(td_memmgr_free_nonmodel(r.m, spike));
                }
            }
            TD_ASSERT_OK(td_memmgr_step_end(r.m));
            td_memmgr_get_stats(r.m, &s[step]);
        }
        assert_int_equal(s[2].loads, s[0].loads); /* nothing moves after the first step */
        assert_int_equal(s[2].evictions, 0);
        for (int c = 0; c < td_memmgr_chunk_count(r.m); c++)
            assert_int_equal(td_memmgr_chunk_home(r.m, c), TD_HOME_DEVICE);
        rig_close(&r);
    }
    td_trace *t;
    TD_ASSERT_OK(td_trace_load(path, &t));
    assert_int_equal(td_trace_access_count(t), 6);
    assert_int_equal(td_trace_step_count(t), 1);
    const td_trace_event *ev = td_trace_events(t);
    int spike_at = -1, back_at = -1, accesses = 0;
    for (size_t i = 0; i < td_trace_event_count(t); i++) {
        if (ev[i].kind == TD_TRACE_ACCESS) accesses++;
        if (ev[i].kind == TD_TRACE_NONMODEL && ev[i].nonmodel_bytes == 5120) spike_at = accesses;
        if (ev[i].kind == TD_TRACE_NONMODEL && ev[i].nonmodel_bytes == 0 && spike_at >= 0) back_at = accesses;
    }
    assert_int_equal(spike_at, 3); /* after the third access, before the fourth */
    assert_int_equal(back_at, 3);
    td_trace_destroy(t);
    unlink(path);
}

/* Optimizer homes set before the layout are final: chunk i of master, m
 * and v where asked, param and grad chunk i on the device with them, and
 * the auto policy's after-warm-up placement leaves optimizer chunks alone
 * even when they are used. */
static void test_optim_homes(void **state)
{
    td_memmgr_params mp = td_memmgr_default_params();
    mp.chunk_numel = 4096;
    mp.placement = TD_PLACEMENT_AUTO;
    rig r;
    rig_open(&r, 0, 4 * TD_MiB, &mp);
    static const td_tensor_role roles[4] = {TD_TENSOR_PARAM, TD_TENSOR_GRAD, TD_TENSOR_ADAM_M, TD_TENSOR_ADAM_V};
    int id[4][4];
    for (int ro = 0; ro < 4; ro++)
        for (int i = 0; i < 4; i++) TD_ASSERT_OK(td_memmgr_register(r.m, "t", 3000, TD_DTYPE_F32, roles[ro], &id[ro][i]));
    const uint8_t on[4] = {1, 0, 1, 0};
    TD_ASSERT_OK(td_memmgr_set_optim_homes(r.m, on, 4));
    TD_ASSERT_OK(td_memmgr_layout(r.m));
    assert_int_equal(td_memmgr_set_optim_homes(r.m, on, 4), TD_ERR_STATE); /* after the layout: too late */
    for (int ro = 0; ro < 4; ro++)
        for (int i = 0; i < 4; i++)
            assert_int_equal(td_memmgr_chunk_home(r.m, td_memmgr_role_chunk(r.m, roles[ro], i)),
                             on[i] ? TD_HOME_DEVICE : TD_HOME_HOST);
    /* A warm-up that uses every param and device-homed m chunk 0: auto homes
     * params on the device (the room is there), never an optimizer chunk;
     * host-homed m chunk 1 is pageable, the CPU AdamW's alone: the device
     * refuses it. */
    assert_true(td_memmgr_chunk_pageable(r.m, td_memmgr_role_chunk(r.m, TD_TENSOR_ADAM_M, 1)));
    assert_false(td_memmgr_chunk_pageable(r.m, td_memmgr_role_chunk(r.m, TD_TENSOR_ADAM_M, 0)));
    for (int step = 0; step < 2; step++) {
        TD_ASSERT_OK(td_memmgr_step_begin(r.m));
        for (int i = 0; i < 4; i++) {
            void *p;
            TD_ASSERT_OK(td_memmgr_access(r.m, &id[0][i], 1, TD_TENSOR_COMPUTE, 0, &p));
            TD_ASSERT_OK(td_memmgr_release(r.m, &id[0][i], 1, TD_TENSOR_HOLD));
        }
        void *p;
        TD_ASSERT_OK(td_memmgr_access(r.m, &id[2][0], 1, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, &p));
        TD_ASSERT_OK(td_memmgr_release(r.m, &id[2][0], 1, TD_TENSOR_HOLD));
        assert_int_equal(td_memmgr_access(r.m, &id[2][1], 1, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, &p), TD_ERR_STATE);
        TD_ASSERT_OK(td_memmgr_step_end(r.m));
    }
    assert_int_equal(td_memmgr_chunk_home(r.m, td_memmgr_role_chunk(r.m, TD_TENSOR_ADAM_M, 1)), TD_HOME_HOST);
    assert_int_equal(td_memmgr_chunk_home(r.m, td_memmgr_role_chunk(r.m, TD_TENSOR_PARAM, 1)), TD_HOME_DEVICE);
    rig_close(&r);
    /* A count that is not the layout's: refused, naming both. */
    rig_open(&r, 0, 4 * TD_MiB, &mp);
    for (int ro = 0; ro < 4; ro++)
        for (int i = 0; i < 4; i++) TD_ASSERT_OK(td_memmgr_register(r.m, "t", 3000, TD_DTYPE_F32, roles[ro], &id[ro][i]));
    TD_ASSERT_OK(td_memmgr_set_optim_homes(r.m, on, 3));
    assert_int_equal(td_memmgr_layout(r.m), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "optimizer homes for 3 chunks, but the layout made 4"));
    rig_close(&r);
}

/* The optimizer chunks the next forward needs first have the least slack. */
static void test_optim_order_by_slack(void **state)
{
    /* A step of 10 accesses: chunk 0 ready at 9, needed at 0 (slack 1);
     * chunk 1 ready at 8, needed at 1 (3); chunk 2 ready at 5, needed at 4
     * (9); chunk 3 ready at 6, needed at 3 (7, before chunk 2). */
    const uint64_t ready[4] = {9, 8, 5, 6}, need[4] = {0, 1, 4, 3};
    int order[4];
    td_optim_order_by_slack(4, ready, need, 10, order);
    assert_int_equal(order[0], 0);
    assert_int_equal(order[1], 1);
    assert_int_equal(order[2], 3);
    assert_int_equal(order[3], 2);
    /* Ties keep the lower index first. */
    const uint64_t r2[3] = {5, 5, 5}, n2[3] = {1, 1, 1};
    td_optim_order_by_slack(3, r2, n2, 10, order);
    assert_true(order[0] == 0 && order[1] == 1 && order[2] == 2);
}

/* Step statistics as JSON and the Perfetto timeline of a small run. */
static void test_step_json_and_timeline(void **state)
{
    char path[] = "/tmp/tidal-timeline-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    td_memmgr_params mp = td_memmgr_default_params();
    mp.chunk_numel = 4096;
    mp.placement = TD_PLACEMENT_CPU;
    rig r;
    rig_open(&r, 1, 3 * 16384, &mp); /* 3 of 4 chunks fit */
    int id[4];
    for (int i = 0; i < 4; i++) TD_ASSERT_OK(td_memmgr_register(r.m, "w", 4096, TD_DTYPE_F32, TD_TENSOR_PARAM, &id[i]));
    TD_ASSERT_OK(td_memmgr_layout(r.m));
    for (int i = 0; i < 4; i++) TD_ASSERT_OK(td_memmgr_set_state(r.m, &id[i], 1, TD_TENSOR_HOLD));
    TD_ASSERT_OK(td_memmgr_timeline_open(r.m, path));
    char json[1024];
    for (int step = 0; step < 3; step++) {
        TD_ASSERT_OK(td_memmgr_step_begin(r.m));
        for (int i = 0; i < 4; i++) {
            void *p;
            TD_ASSERT_OK(td_memmgr_timeline_range(r.m, "block", 1));
            TD_ASSERT_OK(td_memmgr_access(r.m, &id[i], 1, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, &p));
            TD_ASSERT_OK(td_memmgr_release(r.m, &id[i], 1, TD_TENSOR_HOLD));
            TD_ASSERT_OK(td_memmgr_timeline_range(r.m, NULL, 0));
        }
        double now = td_now_ms(); /* host work: 2 ms of "AdamW" ending now */
        TD_ASSERT_OK(td_memmgr_timeline_host(r.m, "CPU AdamW", now - 2.0, now, "AdamW chunk %d", 1));
        TD_ASSERT_OK(td_memmgr_step_end(r.m));
        td_memmgr_step_json(r.m, json, sizeof json);
        cJSON *o = cJSON_Parse(json);
        assert_non_null(o);
        assert_int_equal((int)cJSON_GetObjectItem(o, "step")->valuedouble, step);
        assert_int_equal((int)cJSON_GetObjectItem(o, "accesses")->valuedouble, 4);
        double loads = cJSON_GetObjectItem(o, "loads")->valuedouble;
        double wb = cJSON_GetObjectItem(o, "writebacks")->valuedouble;
        assert_true(loads >= 1 && loads <= 4); /* each step re-reads what did not stay */
        assert_true(wb >= 1);                  /* and writes back what it dirtied and evicted */
        assert_true(cJSON_GetObjectItem(o, "bytes_h2d")->valuedouble == loads * 16384);
        cJSON *peak = cJSON_GetObjectItem(o, "peak_bytes");
        assert_true(cJSON_GetObjectItem(peak, "chunks")->valuedouble <= 3 * 16384);
        cJSON_Delete(o);
    }
    /* "CPU AdamW" and, where the host waited in an access, the memmgr's
     * own "driving thread" are there: fill the rest, then one too many */
    for (int i = 2; i <= TD_TIMELINE_HOST_TRACKS + 1; i++) {
        char track[24]; /* "track " and any int */
        snprintf(track, sizeof track, "track %d", i);
        td_status st = td_memmgr_timeline_host(r.m, track, 0, 0, "x");
        if (st == TD_OK) continue;
        assert_int_equal(st, TD_ERR_INVALID);
        break;
    }
    assert_int_equal(td_memmgr_timeline_host(r.m, "one too many", 0, 0, "x"), TD_ERR_INVALID);
    td_error_clear();
    { /* with every track taken, an access's span is left out; the access works */
        void *p;
        TD_ASSERT_OK(td_memmgr_access(r.m, &id[0], 1, TD_TENSOR_COMPUTE, 0, &p));
        TD_ASSERT_OK(td_memmgr_release(r.m, &id[0], 1, TD_TENSOR_HOLD));
    }
    /* a name that JSON must escape comes back as it was given */
    TD_ASSERT_OK(td_memmgr_timeline_host(r.m, "CPU AdamW", 0, 0, "say \"%s\"\\\t", "hi"));
    int host_waits = td_backend_get_kind(r.b) == TD_BACKEND_CPU;
    rig_close(&r); /* closes the timeline */
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    static char text[1 << 20];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    cJSON *doc = cJSON_Parse(text);
    assert_non_null(doc);
    cJSON *events = cJSON_GetObjectItem(doc, "traceEvents");
    int loads = 0, ranges = 0, counters = 0, writebacks = 0, host = 0, host_named = 0, adam_tid = -1, drive_tid = -1;
    int access_spans = 0, tracks = 0, escaped = 0;
    double block_start[12], host_end[3];
    cJSON *ev;
    cJSON_ArrayForEach(ev, events) { /* the host tracks' ids, from their names (which comes first varies) */
        const char *name = cJSON_GetStringValue(cJSON_GetObjectItem(ev, "name"));
        if (!name || strcmp(name, "thread_name")) continue;
        int tid = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(ev, "tid"));
        const char *track = cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(ev, "args"), "name"));
        if (!strcmp(track, "CPU AdamW")) adam_tid = tid, host_named++;
        if (!strcmp(track, "driving thread")) drive_tid = tid;
        tracks += tid >= 3;
    }
    assert_int_equal(tracks, TD_TIMELINE_HOST_TRACKS);
    /* The cpu backend's compute queue waits on the host, so the accesses
     * that waited for a load took 2 ms there; on cuda the device waits. */
    assert_true(adam_tid >= 3);
    if (host_waits) assert_true(drive_tid >= 3);
    cJSON_ArrayForEach(ev, events) {
        const char *name = cJSON_GetStringValue(cJSON_GetObjectItem(ev, "name"));
        const char *ph = cJSON_GetStringValue(cJSON_GetObjectItem(ev, "ph"));
        if (!name || !ph) continue;
        escaped += !strcmp(name, "say \"hi\"\\\t");
        if (!strncmp(name, "load chunk", 10)) loads++;
        if (!strncmp(name, "writeback chunk", 15)) writebacks++;
        if (!strcmp(name, "block") && !strcmp(ph, "X")) ranges++;
        if (!strcmp(ph, "C")) counters++;
        if (!strcmp(ph, "X")) assert_true(cJSON_GetObjectItem(ev, "dur")->valuedouble >= 0);
        /* every span has its time, those that began before the timeline
         * opened too (the filler tracks' spans at 0 ms; on cuda, step 0's
         * 2 ms of "AdamW" can begin before it) */
        if (!strcmp(ph, "X")) assert_true(cJSON_IsNumber(cJSON_GetObjectItem(ev, "ts")));
        int tid = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(ev, "tid"));
        if (!strncmp(name, "access chunk", 12)) {
            assert_int_equal(tid, drive_tid);
            assert_true(strstr(name, "loads issued") != NULL);
            /* the debug backend's 2 ms load, waited for (others may be slow for other reasons) */
            access_spans += cJSON_GetNumberValue(cJSON_GetObjectItem(ev, "dur")) >= 1000.0;
        }
        double end = cJSON_GetNumberValue(cJSON_GetObjectItem(ev, "ts")) +
                     cJSON_GetNumberValue(cJSON_GetObjectItem(ev, "dur"));
        if (!strcmp(name, "block") && !strcmp(ph, "X") && ranges <= 12)
            block_start[ranges - 1] = cJSON_GetNumberValue(cJSON_GetObjectItem(ev, "ts"));
        if (!strcmp(name, "AdamW chunk 1")) { /* on the host's track, 2 ms */
            assert_int_equal(tid, adam_tid);
            assert_true(fabs(cJSON_GetNumberValue(cJSON_GetObjectItem(ev, "dur")) - 2000.0) < 1.0);
            if (host < 3) host_end[host] = end;
            host++;
        }
    }
    cJSON_Delete(doc);
    assert_int_equal(escaped, 1);
    assert_int_equal(host, 3);
    /* One clock: each step's host span ends before the next step's first
     * block starts (the device may still run a step's blocks after the host
     * issued them, so no bound the other way). */
    for (int i = 0; i < 2; i++) assert_true(host_end[i] <= block_start[4 * i + 4] + 0.5);
    assert_int_equal(host_named, 1);
    if (host_waits) assert_true(access_spans >= 3); /* the step's accesses waited for their loads */
    assert_int_equal(ranges, 12);
    assert_true(loads >= 3 && writebacks >= 2 && counters == 12);
    unlink(path);
}


/* A read of a chunk whose write-back is in flight runs beside it: the
 * compute queue does not wait for the D2H (the grads' sums of squares at a
 * block's end once held up the next block's backward that way).  The slot's
 * next owner still waits for both: with room for one chunk, a write to
 * another chunk reuses the slot only after the write-back has read it, so
 * the host gets the old values, never the new ones or poison.  A write
 * access, by contrast, waits for the write-back. */
static void test_read_beside_writeback(void **state)
{
    (void)state;
    enum { N = 4096 };
    td_memmgr_params mp = td_memmgr_default_params();
    mp.chunk_numel = N;
    rig r;
    rig_open(&r, 1, 20000, &mp); /* one 16 KiB slot */
    td_memmgr *m = r.m;
    int a, b;
    TD_ASSERT_OK(td_memmgr_register(m, "a", N, TD_DTYPE_F32, TD_TENSOR_PARAM, &a));
    TD_ASSERT_OK(td_memmgr_register(m, "b", N, TD_DTYPE_F32, TD_TENSOR_PARAM, &b));
    TD_ASSERT_OK(td_memmgr_layout(m));
    /* 16 x 16 MiB ahead of the write-back on D2H: milliseconds on cuda (page-locked, so
     * truly queued), and each delayed in the cpu backend's debug mode */
    size_t slow_bytes = 16 * TD_MiB;
    void *slow = NULL, *slow_host = td_malloc(slow_bytes, TD_ROLE_META);
    float *seen = NULL;
    assert_non_null(slow_host);
    TD_ASSERT_OK(td_backend_host_register(r.b, slow_host, slow_bytes));
    TD_ASSERT_OK(td_backend_dev_reserve(r.b, slow_bytes, &slow));
    TD_ASSERT_OK(td_backend_dev_reserve(r.b, N * sizeof(float), (void **)&seen));
    float *src = td_malloc(N * sizeof(float), TD_ROLE_META), *back = td_malloc(N * sizeof(float), TD_ROLE_META);
    assert_true(src && back && slow_host);
    for (int round = 0; round < 2; round++) {
        int write = round == 1;
        void *d;
        float *h;
        for (int i = 0; i < N; i++) src[i] = (float)(round * N + i);
        TD_ASSERT_OK(td_memmgr_access(m, &a, 1, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, &d));
        dev_write(&r, d, src, N * sizeof(float));
        TD_ASSERT_OK(td_memmgr_release(m, &a, 1, TD_TENSOR_HOLD));
        /* the write-back queued behind slow work on the D2H queue */
        for (int k = 0; k < 16; k++)
            TD_ASSERT_OK(td_backend_copy_async(r.b, TD_QUEUE_D2H, slow_host, slow, slow_bytes));
        TD_ASSERT_OK(td_memmgr_writeback_async(m, &a, 1));
        td_copy_ticket landed;
        TD_ASSERT_OK(td_memmgr_chunk_host_peek(m, td_memmgr_tensor_chunk(m, a), (void **)&h, &landed));
        TD_ASSERT_OK(td_memmgr_access(m, &a, 1, TD_TENSOR_COMPUTE, write ? TD_ACCESS_WRITE : 0, &d));
        TD_ASSERT_OK(td_backend_copy_async(r.b, TD_QUEUE_COMPUTE, seen, d, N * sizeof(float)));
        TD_ASSERT_OK(td_queue_sync(r.b, TD_QUEUE_COMPUTE));
        int done = 0;
        TD_ASSERT_OK(td_copy_done(r.eng, &landed, &done));
        if (!write && done) fail_msg("the read waited for the write-back (16 slow copies ahead of it on D2H)");
        if (write && !done) fail_msg("the write ran before the write-back had read the slot");
        TD_ASSERT_OK(td_memmgr_release(m, &a, 1, TD_TENSOR_HOLD));
        if (write) TD_ASSERT_OK(td_memmgr_host_access(m, &a, 1, TD_ACCESS_READ, (void **)&h)); /* a's newest up */
        /* b takes a's slot (room for one): written only after the write-back read it */
        for (int i = 0; i < N; i++) back[i] = -1.0f - (float)i;
        TD_ASSERT_OK(td_memmgr_access(m, &b, 1, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, &d));
        dev_write(&r, d, back, N * sizeof(float));
        TD_ASSERT_OK(td_memmgr_release(m, &b, 1, TD_TENSOR_HOLD));
        TD_ASSERT_OK(td_copy_wait(r.eng, &landed));
        TD_ASSERT_OK(td_backend_sync(r.b));
        for (int i = 0; i < N; i++)
            if (h[i] != (float)(round * N + i))
                fail_msg("round %d: a's host copy holds %g at %d, not %g", round, h[i], i, (float)(round * N + i));
        dev_read(&r, back, seen, N * sizeof(float));
        for (int i = 0; i < N; i++)
            if (back[i] != (float)(round * N + i)) fail_msg("round %d: the read saw %g at %d", round, back[i], i);
        TD_ASSERT_OK(td_memmgr_host_access(m, &b, 1, TD_ACCESS_READ, (void **)&h)); /* b back home */
    }
    td_free(src);
    td_free(back);
    td_backend_dev_release(r.b, seen);
    td_backend_dev_release(r.b, slow);
    td_backend_host_unregister(r.b, slow_host);
    td_free(slow_host);
    rig_close(&r);
}

/* A chunk whose host write was expected (ZeRO-3: the AdamW thread's update
 * still to come) is left alone by prefetches until the write; a write
 * recorded by td_memmgr_chunk_host_written (an update in a disk slot) ends
 * that as a host access for writing does, so the next step loads it ahead
 * again instead of at its access. */
static void test_expected_write_then_prefetch(void **state)
{
    (void)state;
    enum { N = 1024, T = 4 };
    for (int how = 0; how < 2; how++) { /* 0: a host access for writing, 1: td_memmgr_chunk_host_written */
        td_memmgr_params mp = td_memmgr_default_params();
        mp.chunk_numel = N;
        mp.prefetch = 4;
        rig r;
        rig_open(&r, 1, 64 * N * 4, &mp);
        int id[T];
        char name[8];
        for (int i = 0; i < T; i++) {
            snprintf(name, sizeof name, "p%d", i);
            TD_ASSERT_OK(td_memmgr_register(r.m, name, N, TD_DTYPE_F32, TD_TENSOR_PARAM, &id[i]));
        }
        TD_ASSERT_OK(td_memmgr_layout(r.m));
        td_memmgr_stats before, after;
        for (int step = 0; step < 3; step++) {
            TD_ASSERT_OK(td_memmgr_step_begin(r.m));
            td_memmgr_get_stats(r.m, &before);
            for (int i = 0; i < T; i++) {
                void *d;
                TD_ASSERT_OK(td_memmgr_access(r.m, &id[i], 1, TD_TENSOR_COMPUTE, 0, &d));
                TD_ASSERT_OK(td_memmgr_release(r.m, &id[i], 1, TD_TENSOR_HOLD));
            }
            td_memmgr_get_stats(r.m, &after);
            TD_ASSERT_OK(td_memmgr_step_end(r.m));
            if (step == 2) { /* p3 was written on the host: loaded again, ahead of its access */
                assert_int_equal(after.loads - before.loads, 1);
                if (after.prefetches - before.prefetches != 1)
                    fail_msg("%s: p3's new host copy was loaded at its access, not ahead (%llu prefetches)",
                             how ? "td_memmgr_chunk_host_written" : "a host access", 
                             (unsigned long long)(after.prefetches - before.prefetches));
            }
            /* between steps: p3's update expected, then written */
            int c = td_memmgr_tensor_chunk(r.m, id[T - 1]);
            TD_ASSERT_OK(td_memmgr_expect_host_write(r.m, c));
            if (how) {
                TD_ASSERT_OK(td_memmgr_chunk_host_written(r.m, c));
            } else {
                void *h;
                TD_ASSERT_OK(td_memmgr_chunk_host_access(r.m, c, TD_ACCESS_WRITE, &h));
            }
        }
        rig_close(&r);
    }
}

/* td_memmgr_order_after_use: work on another queue that overwrites a
 * chunk in place (ZeRO-3's all-gather, on the H2D queue) waits for what
 * still uses its device copy, and for nothing queued since.
 * - A write-back in flight (D2H) still reading it.  In the cpu backend's
 *   debug mode a copy poisons its destination when it starts, so an
 *   unordered overwrite hands the host poison or the new values.
 * - Kernels on the compute queue still reading it (on cuda, behind slow
 *   work on another buffer; the cpu backend's compute queue is synchronous).
 * Each is checked by what the reader saw: the old values.  The cpu
 * backend's synchronous compute queue settles both uses at the overwrite's
 * access already, so there the test checks values only; the ordering
 * itself is checked on cuda (make gpu-test runs this file there). */
static void test_order_after_use(void **state)
{
    (void)state;
    rig r;
    td_memmgr_params mp = td_memmgr_default_params();
    mp.chunk_numel = 4096;
    mp.placement = TD_PLACEMENT_CUDA;
    rig_open(&r, 1, 64 * TD_MiB, &mp);
    td_memmgr *m = r.m;
    int id;
    enum { N = 4096 };
    TD_ASSERT_OK(td_memmgr_register(m, "p", N, TD_DTYPE_F32, TD_TENSOR_PARAM, &id));
    TD_ASSERT_OK(td_memmgr_layout(m));
    assert_int_equal(td_memmgr_order_after_use(m, id, TD_QUEUE_H2D), TD_ERR_STATE); /* not resident */
    td_error_clear();
    size_t slow_bytes = 32 * TD_MiB;
    void *slow = NULL;
    TD_ASSERT_OK(td_backend_dev_reserve(r.b, slow_bytes, &slow));
    float *src = td_malloc(N * sizeof(float), TD_ROLE_META), *back = td_malloc(N * sizeof(float), TD_ROLE_META);
    float *seen = NULL;
    TD_ASSERT_OK(td_backend_dev_reserve(r.b, N * sizeof(float), (void **)&seen));
    assert_true(src && back);
    for (int round = 0; round < 3; round++) {
        void *d;
        float *h;
        /* the old values, written on the device: the chunk is dirty */
        for (int i = 0; i < N; i++) src[i] = (float)(round * N + i);
        TD_ASSERT_OK(td_memmgr_access(m, &id, 1, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, &d));
        dev_write(&r, d, src, N * sizeof(float));
        TD_ASSERT_OK(td_memmgr_release(m, &id, 1, TD_TENSOR_HOLD));
        TD_ASSERT_OK(td_memmgr_writeback_async(m, &id, 1)); /* reads d on the D2H queue */
        td_copy_ticket landed; /* where it lands (it is started: the peek starts nothing more) */
        TD_ASSERT_OK(td_memmgr_chunk_host_peek(m, td_memmgr_tensor_chunk(m, id), (void **)&h, &landed));
        /* a read on the compute queue behind slow work */
        TD_ASSERT_OK(td_memmgr_access(m, &id, 1, TD_TENSOR_COMPUTE, 0, &d));
        for (int k = 0; k < 20; k++) TD_ASSERT_OK(td_backend_memset_async(r.b, TD_QUEUE_COMPUTE, slow, k, slow_bytes));
        TD_ASSERT_OK(td_backend_copy_async(r.b, TD_QUEUE_COMPUTE, seen, d, N * sizeof(float)));
        TD_ASSERT_OK(td_memmgr_release(m, &id, 1, TD_TENSOR_HOLD));
        /* overwritten in place on the H2D queue, ordered after both uses */
        for (int i = 0; i < N; i++) src[i] = -1.0f - (float)i;
        TD_ASSERT_OK(td_memmgr_access(m, &id, 1, TD_TENSOR_COMPUTE, TD_ACCESS_WRITE, &d));
        TD_ASSERT_OK(td_memmgr_order_after_use(m, id, TD_QUEUE_H2D));
        TD_ASSERT_OK(td_backend_copy_async(r.b, TD_QUEUE_H2D, d, src, N * sizeof(float)));
        TD_ASSERT_OK(td_memmgr_release(m, &id, 1, TD_TENSOR_HOLD));
        TD_ASSERT_OK(td_memmgr_written_on(m, id, TD_QUEUE_H2D));
        TD_ASSERT_OK(td_copy_wait(r.eng, &landed));
        TD_ASSERT_OK(td_backend_sync(r.b));
        for (int i = 0; i < N; i++)
            if (h[i] != (float)(round * N + i))
                fail_msg("round %d: the write-back carried %g at %d, not the old value", round, h[i], i);
        dev_read(&r, back, seen, N * sizeof(float));
        for (int i = 0; i < N; i++)
            if (back[i] != (float)(round * N + i))
                fail_msg("round %d: the compute queue read %g at %d, not the old value", round, back[i], i);
        /* and the device copy the overwrite left */
        TD_ASSERT_OK(td_memmgr_access(m, &id, 1, TD_TENSOR_COMPUTE, 0, &d));
        dev_read(&r, back, d, N * sizeof(float));
        for (int i = 0; i < N; i++) assert_true(back[i] == src[i]);
        TD_ASSERT_OK(td_memmgr_release(m, &id, 1, TD_TENSOR_HOLD));
        TD_ASSERT_OK(td_memmgr_host_access(m, &id, 1, TD_ACCESS_READ, (void **)&h)); /* settles it */
    }
    td_free(src);
    td_free(back);
    td_backend_dev_release(r.b, seen);
    td_backend_dev_release(r.b, slow);
    rig_close(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_packs_and_mirrors),
        cmocka_unit_test(test_layout_search_prices_every_role),
        cmocka_unit_test(test_bad_registrations),
        cmocka_unit_test(test_pageable_optimizer_state),
        cmocka_unit_test(test_states_and_zero_fill),
        cmocka_unit_test(test_transient_grads),
        cmocka_unit_test(test_random_traces_keep_data),
        cmocka_unit_test(test_belady_beats_lru_on_a_loop),
        cmocka_unit_test(test_budget_too_small),
        cmocka_unit_test(test_placements_and_trace_out),
        cmocka_unit_test(test_step_json_and_timeline),
        cmocka_unit_test(test_optim_homes),
        cmocka_unit_test(test_optim_order_by_slack),
        cmocka_unit_test(test_order_after_use),
        cmocka_unit_test(test_read_beside_writeback),
        cmocka_unit_test(test_expected_write_then_prefetch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
