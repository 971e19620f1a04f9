/* The CPU communicator: collectives over the rendezvous's TCP star, rank 0
 * the hub.
 *
 * Why TCP through rank 0 and not shared memory: the connections already
 * exist (the rendezvous made them), a rank that dies closes its socket and
 * the others fail at once naming it (a shared-memory barrier would only
 * time out), nothing is left in /dev/shm after a crash, and it works across
 * hosts too.  Its cost, rank 0 moving (N - 1) x the bytes, is fine for what
 * it is for: CI on a 2-core machine and the cpu backend.
 *
 * Determinism: rank 0 reduces every element as ((x_0 + x_1) + ...) + x_{N-1}
 * in fp32, in rank order, rounds once to the element type and sends the
 * same bytes to every rank.  Reductions go piece by piece through staging
 * buffers taken at creation, so no collective allocates.
 *
 * Each collective begins with a header from every rank to rank 0 (what,
 * type, count, root, sequence number); rank 0 refuses a mismatch naming the
 * ranks, and any failure shuts every link down, so the other ranks fail
 * within one wait instead of at their timeout.
 *
 * Queues: the collective runs on the calling thread once the queue's
 * earlier work has finished (cpu backend copies run on worker threads), so
 * it is complete when the call returns. */
#include "parallel_impl.h"
#include "net.h"
#include "tidal/alloc.h"
#include "tidal/convert.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

enum { PIECE_NUMEL = 1 << 18 }; /* elements reduced per step: 1 MiB of fp32 */

#define HDR_MAGIC 0x54444343u /* "TDCC" */

typedef enum coll { COLL_ALL_GATHER, COLL_REDUCE_SCATTER, COLL_ALL_REDUCE, COLL_BROADCAST } coll;
static const char *coll_names[] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast"};

typedef struct header {
    uint32_t magic, what, dtype, op;
    uint64_t count, seq;
    int32_t root, pad;
} header;

typedef struct cpu_comm {
    td_comm base;
    int peer;            /* the rank of the last message, to name it when the job fails */
    float *acc, *x;      /* rank 0: PIECE_NUMEL each */
    unsigned char *raw;  /* rank 0: PIECE_NUMEL * 4 bytes, a piece as sent */
} cpu_comm;

static void cpu_destroy(td_comm *c)
{
    cpu_comm *cc = (cpu_comm *)c;
    td_rdv_close(c->rdv);
    td_free(cc->acc);
    td_free(cc->x);
    td_free(cc->raw);
    td_free(cc);
}

/* --- element conversion and reduction ------------------------------------------- */

static void to_f32(float *dst, const void *src, size_t n, td_dtype dt)
{
    const uint16_t *h = src;
    switch (dt) {
    case TD_DTYPE_F32: memcpy(dst, src, n * 4); break;
    case TD_DTYPE_BF16: for (size_t i = 0; i < n; i++) dst[i] = td_f32_from_bf16(h[i]); break;
    default: for (size_t i = 0; i < n; i++) dst[i] = td_f32_from_f16(h[i]); break;
    }
}

static void from_f32(void *dst, const float *src, size_t n, td_dtype dt)
{
    uint16_t *h = dst;
    switch (dt) {
    case TD_DTYPE_F32: memcpy(dst, src, n * 4); break;
    case TD_DTYPE_BF16: for (size_t i = 0; i < n; i++) h[i] = td_bf16_from_f32(src[i]); break;
    default: for (size_t i = 0; i < n; i++) h[i] = td_f16_from_f32(src[i]); break;
    }
}

static void accumulate(float *acc, const float *x, size_t n, td_reduce_op op)
{
    if (op == TD_REDUCE_SUM) {
        for (size_t i = 0; i < n; i++) acc[i] += x[i];
        return;
    }
    for (size_t i = 0; i < n; i++) /* a NaN wins: an overflow on one rank is seen by all */
        if (!isnan(acc[i]) && (isnan(x[i]) || x[i] > acc[i])) acc[i] = x[i];
}

/* --- plumbing ----------------------------------------------------------------------- */

/* After a failure: rank 0 tells the others which rank failed before the
 * links go down; another rank, whose link to rank 0 went down, waits a
 * moment for that notice so that its message names the rank that failed,
 * not rank 0. */
static td_status fail(td_comm *c, td_status st, const char *what)
{
    cpu_comm *cc = (cpu_comm *)c;
    int failed = -1;
    char why[480];
    c->failed_seq = c->seq;
    if (c->rank == 0 && cc->peer > 0) td_rdv_notify_fault(c->rdv, cc->peer, td_error_msg());
    else if (c->rank > 0 && cc->peer == 0 && td_rdv_fault_notice(c->rdv, c->timeout_ms < 2000 ? c->timeout_ms : 2000, &failed, why, sizeof why))
        st = td_error_set(st, "rank %d failed (rank 0 saw: %s)", failed, why);
    td_rdv_shutdown(c->rdv);
    return td_error_prefix(st, "%s #%lu on rank %d: ", what, c->seq, c->rank);
}

static td_status to_peer(td_comm *c, int r, const void *buf, size_t bytes)
{
    char who[32];
    ((cpu_comm *)c)->peer = r;
    int fd = c->rank == 0 ? c->rdv->peer_fd[r] : c->rdv->fd;
    return td_net_send(fd, buf, bytes, c->rdv->timeout_ms, td_rdv_who(r, who, sizeof who));
}

static td_status from_peer(td_comm *c, int r, void *buf, size_t bytes)
{
    char who[32];
    ((cpu_comm *)c)->peer = r;
    int fd = c->rank == 0 ? c->rdv->peer_fd[r] : c->rdv->fd;
    return td_net_recv(fd, buf, bytes, c->rdv->timeout_ms, td_rdv_who(r, who, sizeof who));
}

static void describe(char *buf, size_t bytes, const header *h)
{
    snprintf(buf, bytes, "%s of %llu %s%s", h->what < 4 ? coll_names[h->what] : "?", (unsigned long long)h->count,
             h->dtype < TD_DTYPE_COUNT ? td_dtype_name((td_dtype)h->dtype) : "?",
             h->what == COLL_ALL_REDUCE ? (h->op == TD_REDUCE_MAX ? " (max)" : " (sum)") : "");
    if (h->what == COLL_BROADCAST) snprintf(buf + strlen(buf), bytes - strlen(buf), " from rank %d", h->root);
}

/* Waits for the queue, then every rank tells rank 0 what it is calling. */
static td_status begin(td_comm *c, coll what, size_t count, td_dtype dt, td_reduce_op op, int root, td_queue q)
{
    ((cpu_comm *)c)->peer = -1; /* a failure before any message is this rank's own */
    td_status st = td_queue_sync(c->backend, q);
    if (st) return st;
    header mine = { HDR_MAGIC, what, (uint32_t)dt, (uint32_t)op, count, c->seq, root, 0 };
    if (c->size == 1) return TD_OK;
    if (c->rank > 0) return to_peer(c, 0, &mine, sizeof mine);
    for (int r = 1; r < c->size; r++) {
        header h;
        if ((st = from_peer(c, r, &h, sizeof h))) return st;
        if (h.magic != HDR_MAGIC || h.seq != mine.seq || h.what != mine.what || h.dtype != mine.dtype ||
            h.count != mine.count || h.root != mine.root || (what == COLL_ALL_REDUCE && h.op != mine.op)) {
            char a[96], b[96];
            describe(a, sizeof a, &mine);
            describe(b, sizeof b, &h);
            return td_error_set(TD_ERR_STATE, "the ranks call different collectives: rank 0 calls %s as its "
                                "collective #%llu, rank %d calls %s as its #%llu; every rank must call the same "
                                "collectives in the same order", a, (unsigned long long)mine.seq, r, b,
                                (unsigned long long)h.seq);
        }
    }
    return TD_OK;
}

/* Rank 0: reduces piece [o, o + n) of segment `seg` (elements from
 * send + seg_off) over all ranks in rank order into cc->raw as dt. */
static td_status reduce_piece(cpu_comm *cc, const void *send, size_t seg_off, size_t o, size_t n, td_dtype dt,
                              td_reduce_op op)
{
    td_comm *c = &cc->base;
    size_t E = td_dtype_bytes(dt);
    td_status st;
    to_f32(cc->acc, (const char *)send + (seg_off + o) * E, n, dt);
    for (int r = 1; r < c->size; r++) {
        if ((st = from_peer(c, r, cc->raw, n * E))) return st;
        to_f32(cc->x, cc->raw, n, dt);
        accumulate(cc->acc, cc->x, n, op);
    }
    from_f32(cc->raw, cc->acc, n, dt);
    return TD_OK;
}

/* --- collectives -------------------------------------------------------------------- */

static td_status cpu_all_reduce(td_comm *c, const void *send, void *recv, size_t count, td_dtype dt,
                                td_reduce_op op, td_queue q)
{
    cpu_comm *cc = (cpu_comm *)c;
    size_t E = td_dtype_bytes(dt);
    td_status st = begin(c, COLL_ALL_REDUCE, count, dt, op, 0, q);
    for (size_t o = 0; !st && o < count; o += PIECE_NUMEL) {
        size_t n = count - o < PIECE_NUMEL ? count - o : PIECE_NUMEL;
        char *out = (char *)recv + o * E;
        if (c->rank > 0) {
            st = to_peer(c, 0, (const char *)send + o * E, n * E);
            if (!st) st = from_peer(c, 0, out, n * E);
            continue;
        }
        st = reduce_piece(cc, send, 0, o, n, dt, op);
        for (int r = 1; !st && r < c->size; r++) st = to_peer(c, r, cc->raw, n * E);
        if (!st) memcpy(out, cc->raw, n * E);
    }
    return st ? fail(c, st, "all_reduce") : TD_OK;
}

static td_status cpu_reduce_scatter(td_comm *c, const void *send, void *recv, size_t count, td_dtype dt, td_queue q)
{
    cpu_comm *cc = (cpu_comm *)c;
    size_t E = td_dtype_bytes(dt);
    td_status st = begin(c, COLL_REDUCE_SCATTER, count, dt, TD_REDUCE_SUM, 0, q);
    for (int d = 0; !st && d < c->size; d++) {
        size_t seg = (size_t)d * count;
        for (size_t o = 0; !st && o < count; o += PIECE_NUMEL) {
            size_t n = count - o < PIECE_NUMEL ? count - o : PIECE_NUMEL;
            char *out = (char *)recv + o * E;
            if (c->rank > 0) {
                st = to_peer(c, 0, (const char *)send + (seg + o) * E, n * E);
                if (!st && d == c->rank) st = from_peer(c, 0, out, n * E);
                continue;
            }
            st = reduce_piece(cc, send, seg, o, n, dt, TD_REDUCE_SUM);
            if (st) break;
            if (d == 0) memcpy(out, cc->raw, n * E);
            else st = to_peer(c, d, cc->raw, n * E);
        }
    }
    return st ? fail(c, st, "reduce_scatter") : TD_OK;
}

static td_status cpu_all_gather(td_comm *c, const void *send, void *recv, size_t count, td_dtype dt, td_queue q)
{
    size_t bytes = count * td_dtype_bytes(dt), all = bytes * (size_t)c->size;
    char *dst = recv;
    td_status st = begin(c, COLL_ALL_GATHER, count, dt, TD_REDUCE_SUM, 0, q);
    if (!st && c->rank > 0) {
        st = to_peer(c, 0, send, bytes);
        if (!st) st = from_peer(c, 0, dst, all);
    } else if (!st) {
        memmove(dst, send, bytes);
        for (int r = 1; !st && r < c->size; r++) st = from_peer(c, r, dst + (size_t)r * bytes, bytes);
        for (int r = 1; !st && r < c->size; r++) st = to_peer(c, r, dst, all);
    }
    return st ? fail(c, st, "all_gather") : TD_OK;
}

static td_status cpu_broadcast(td_comm *c, void *buf, size_t count, td_dtype dt, int root, td_queue q)
{
    size_t bytes = count * td_dtype_bytes(dt);
    td_status st = begin(c, COLL_BROADCAST, count, dt, TD_REDUCE_SUM, root, q);
    if (!st && c->rank > 0) { /* a root other than 0 sends through rank 0 */
        if (c->rank == root) st = to_peer(c, 0, buf, bytes);
        else st = from_peer(c, 0, buf, bytes);
    } else if (!st) {
        if (root != 0) st = from_peer(c, root, buf, bytes);
        for (int r = 1; !st && r < c->size; r++)
            if (r != root) st = to_peer(c, r, buf, bytes);
    }
    return st ? fail(c, st, "broadcast") : TD_OK;
}

static const td_comm_ops cpu_ops = {
    .destroy = cpu_destroy,
    .all_gather = cpu_all_gather,
    .reduce_scatter = cpu_reduce_scatter,
    .all_reduce = cpu_all_reduce,
    .broadcast = cpu_broadcast,
};

td_status td_comm_cpu_create(td_comm *base, td_comm **out)
{
    cpu_comm *cc = td_calloc(1, sizeof *cc, TD_ROLE_COMM);
    if (!cc) return TD_ERR_NOMEM;
    cc->base = *base;
    cc->base.ops = &cpu_ops;
    cc->base.name = "cpu";
    if (base->rank == 0) { /* the hub reduces; the others only send and receive */
        cc->acc = td_malloc(PIECE_NUMEL * sizeof(float), TD_ROLE_COMM);
        cc->x = td_malloc(PIECE_NUMEL * sizeof(float), TD_ROLE_COMM);
        cc->raw = td_malloc(PIECE_NUMEL * sizeof(float), TD_ROLE_COMM);
        if (!cc->acc || !cc->x || !cc->raw) {
            td_free(cc->acc);
            td_free(cc->x);
            td_free(cc->raw);
            td_free(cc);
            return td_error_prefix(TD_ERR_NOMEM, "the cpu communicator's staging: ");
        }
    }
    *out = &cc->base;
    return TD_OK;
}
