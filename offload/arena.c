/* The device arena (see include/tidal/arena.h). */
#include "tidal/arena.h"
#include "tidal/util.h"
#include "tidal/range.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

struct td_arena {
    td_backend *backend;
    char *base;
    size_t budget_bytes;
    td_range range;
    pthread_mutex_t lock;
    size_t used[TD_ROLE_COUNT], peak[TD_ROLE_COUNT];
    size_t used_total, peak_total;
};

struct td_slot_pool {
    td_arena *arena;
    size_t slot_bytes;
    td_role role;
    void **cached;       /* stack of released slots */
    int cached_count, cached_cap;
    int in_use;
};

td_status td_arena_create(td_backend *b, size_t budget_bytes, td_arena **out)
{
    td_status st = TD_OK;
    td_arena *a = NULL;
    int range_ok = 0;
    *out = NULL;
    if (budget_bytes == 0)
        TD_FAIL(TD_ERR_INVALID, "arena: a budget of 0 bytes: give the device bytes to reserve (at least %d; "
                "td_train_budget_resolve sizes a default)", TD_ARENA_ALIGN);
    if (budget_bytes < TD_ARENA_ALIGN)
        TD_FAIL(TD_ERR_INVALID, "arena: a budget of %zu bytes is too small (minimum %d)", budget_bytes, TD_ARENA_ALIGN);
    a = td_calloc(1, sizeof *a, TD_ROLE_META);
    if (!a) { st = TD_ERR_NOMEM; goto cleanup; } /* td_malloc set the message */
    a->backend = b;
    a->budget_bytes = budget_bytes;
    TD_TRY(td_range_init(&a->range, budget_bytes / TD_ARENA_ALIGN * TD_ARENA_ALIGN, TD_ARENA_ALIGN));
    range_ok = 1;
    void *base = NULL;
    st = td_backend_dev_reserve(b, budget_bytes, &base);
    if (st) {
        char s[32];
        td_error_prefix(st, "arena: reserving the budget of %s: ", td_format_bytes(budget_bytes, s, sizeof s));
        goto cleanup;
    }
    a->base = base;
    pthread_mutex_init(&a->lock, NULL);
    *out = a;
    return TD_OK;
cleanup:
    if (range_ok) td_range_destroy(&a->range);
    td_free(a);
    return st;
}

void td_arena_destroy(td_arena *a)
{
    if (!a) return;
    td_backend_dev_release(a->backend, a->base);
    td_range_destroy(&a->range);
    pthread_mutex_destroy(&a->lock);
    td_free(a);
}

static void count_add(td_arena *a, td_role role, size_t bytes)
{
    a->used[role] += bytes;
    a->used_total += bytes;
    if (a->used[role] > a->peak[role]) a->peak[role] = a->used[role];
    if (a->used_total > a->peak_total) a->peak_total = a->used_total;
}

static void count_sub(td_arena *a, td_role role, size_t bytes)
{
    a->used[role] -= bytes;
    a->used_total -= bytes;
}

/* Caller holds the lock. */
static void describe_locked(td_arena *a, char *buf, size_t buf_bytes)
{
    char s[32], t[32];
    size_t n = (size_t)snprintf(buf, buf_bytes, "budget %s, held %s",
                                td_format_bytes(a->budget_bytes, s, sizeof s),
                                td_format_bytes(a->used_total, t, sizeof t));
    const char *sep = " (";
    for (int r = 0; r < TD_ROLE_COUNT && n < buf_bytes; r++) {
        if (!a->used[r]) continue;
        n += (size_t)snprintf(buf + n, buf_bytes - n, "%s%s %s", sep, td_role_name((td_role)r),
                              td_format_bytes(a->used[r], s, sizeof s));
        sep = ", ";
    }
    if (n < buf_bytes && sep[0] == ',') n += (size_t)snprintf(buf + n, buf_bytes - n, ")");
    if (n < buf_bytes)
        snprintf(buf + n, buf_bytes - n, ", free %s in %d piece%s (largest %s)",
                 td_format_bytes(a->range.free_bytes, s, sizeof s), td_range_free_blocks(&a->range),
                 td_range_free_blocks(&a->range) == 1 ? "" : "s",
                 td_format_bytes(td_range_largest_free(&a->range), t, sizeof t));
}

static td_status alloc_locked(td_arena *a, size_t bytes, td_role role, int from_top, void **ptr)
{
    size_t off;
    td_status st = td_range_alloc(&a->range, bytes, from_top, (uint32_t)role, &off);
    if (st == TD_ERR_BUDGET) {
        char s[32], what[512];
        describe_locked(a, what, sizeof what);
        return td_error_set(TD_ERR_BUDGET, "arena: cannot place %s of %s: %s; raise --gpu-budget, or "
                            "lower --micro-batch or offload more", td_format_bytes(bytes, s, sizeof s),
                            td_role_name(role), what);
    }
    if (st) return st;
    count_add(a, role, td_range_block_bytes(&a->range, off));
    *ptr = a->base + off;
    return TD_OK;
}

static td_status release_locked(td_arena *a, void *ptr)
{
    char *p = ptr;
    if (p < a->base || p >= a->base + a->range.size)
        return td_error_set(TD_ERR_INVALID, "arena: %p is not inside the arena", ptr);
    size_t bytes;
    uint32_t role;
    td_status st = td_range_free(&a->range, (size_t)(p - a->base), &bytes, &role);
    if (st) return td_error_prefix(st, "arena: releasing %p: ", ptr);
    count_sub(a, (td_role)role, bytes);
    return TD_OK;
}

td_status td_arena_alloc(td_arena *a, size_t bytes, td_role role, void **ptr)
{
    *ptr = NULL;
    if ((unsigned)role >= TD_ROLE_COUNT) return td_error_set(TD_ERR_INVALID, "arena: no role %d", (int)role);
    pthread_mutex_lock(&a->lock);
    td_status st = alloc_locked(a, bytes, role, 0, ptr);
    pthread_mutex_unlock(&a->lock);
    return st;
}

td_status td_arena_release(td_arena *a, void *ptr)
{
    if (!ptr) return TD_OK;
    pthread_mutex_lock(&a->lock);
    td_status st = release_locked(a, ptr);
    pthread_mutex_unlock(&a->lock);
    return st;
}

void td_arena_get_stats(td_arena *a, td_arena_stats *out)
{
    pthread_mutex_lock(&a->lock);
    *out = (td_arena_stats){
        .budget_bytes = a->budget_bytes,
        .used_bytes = a->used_total,
        .peak_bytes = a->peak_total,
        .free_bytes = a->range.free_bytes,
        .largest_free_bytes = td_range_largest_free(&a->range),
        .free_blocks = td_range_free_blocks(&a->range),
        .live_blocks = a->range.live_blocks,
    };
    memcpy(out->used, a->used, sizeof a->used);
    memcpy(out->peak, a->peak, sizeof a->peak);
    pthread_mutex_unlock(&a->lock);
}

void td_arena_reset_peak(td_arena *a)
{
    pthread_mutex_lock(&a->lock);
    memcpy(a->peak, a->used, sizeof a->peak);
    a->peak_total = a->used_total;
    pthread_mutex_unlock(&a->lock);
}

void td_arena_describe(td_arena *a, char *buf, size_t buf_bytes)
{
    pthread_mutex_lock(&a->lock);
    describe_locked(a, buf, buf_bytes);
    pthread_mutex_unlock(&a->lock);
}

void *td_arena_base(td_arena *a) { return a->base; }
td_backend *td_arena_backend(td_arena *a) { return a->backend; }

/* --- slot pools ------------------------------------------------------------ */

td_status td_slot_pool_create(td_arena *a, size_t slot_bytes, td_role role, td_slot_pool **out)
{
    *out = NULL;
    if (slot_bytes == 0) return td_error_set(TD_ERR_INVALID, "slot pool: slot size 0");
    if ((unsigned)role >= TD_ROLE_COUNT) return td_error_set(TD_ERR_INVALID, "slot pool: no role %d", (int)role);
    td_slot_pool *p = td_calloc(1, sizeof *p, TD_ROLE_META);
    if (!p) return TD_ERR_NOMEM;
    p->arena = a;
    p->slot_bytes = td_align_up(slot_bytes, TD_ARENA_ALIGN);
    p->role = role;
    *out = p;
    return TD_OK;
}

size_t td_slot_pool_trim(td_slot_pool *p)
{
    size_t given = 0;
    pthread_mutex_lock(&p->arena->lock);
    while (p->cached_count > 0) {
        release_locked(p->arena, p->cached[--p->cached_count]);
        given += p->slot_bytes;
    }
    pthread_mutex_unlock(&p->arena->lock);
    return given;
}

void td_slot_pool_destroy(td_slot_pool *p)
{
    if (!p) return;
    td_slot_pool_trim(p);
    td_free(p->cached);
    td_free(p);
}

td_status td_slot_acquire(td_slot_pool *p, void **ptr)
{
    td_status st = TD_OK;
    *ptr = NULL;
    pthread_mutex_lock(&p->arena->lock);
    if (p->cached_count > 0) {
        *ptr = p->cached[--p->cached_count];
    } else {
        /* Make room to cache this slot later, so release never allocates. */
        int held = p->in_use + p->cached_count + 1;
        if (held > p->cached_cap) {
            int cap = p->cached_cap ? 2 * p->cached_cap : 16;
            void **grown = td_malloc((size_t)cap * sizeof *grown, TD_ROLE_META);
            if (!grown) { st = TD_ERR_NOMEM; goto out; }
            if (p->cached_count) memcpy(grown, p->cached, (size_t)p->cached_count * sizeof *grown);
            td_free(p->cached);
            p->cached = grown;
            p->cached_cap = cap;
        }
        st = alloc_locked(p->arena, p->slot_bytes, p->role, 1, ptr);
        if (st) goto out;
    }
    p->in_use++;
out:
    pthread_mutex_unlock(&p->arena->lock);
    return st;
}

void td_slot_release(td_slot_pool *p, void *ptr)
{
    if (!ptr) return;
    pthread_mutex_lock(&p->arena->lock);
    p->cached[p->cached_count++] = ptr;
    p->in_use--;
    pthread_mutex_unlock(&p->arena->lock);
}

size_t td_slot_pool_slot_bytes(const td_slot_pool *p) { return p->slot_bytes; }
int td_slot_pool_in_use(const td_slot_pool *p) { return p->in_use; }
int td_slot_pool_held(const td_slot_pool *p) { return p->in_use + p->cached_count; }
