/* The chunk manager's disk tier (see "the disk tier" in include/tidal/memmgr.h):
 * where chunks homed on disk sit in the scratch file, the slots that hold
 * them while they are used, and the read-ahead.
 *
 * Each role with chunks on disk has a pool of slots (pinned buffers the
 * size of its largest disk chunk).  A slot holds one chunk's bytes, with
 * their state: valid, being read, dirty (newer than the file), being
 * written; and a device copy in flight may read it (an upload) or write
 * it (a write-back: dirty once it lands).  A slot may take another chunk
 * when nobody pins it and it is clean and idle; which one goes is Belady's
 * choice: the one whose chunk comes back last (the AdamW's order for
 * optimizer state and grads, the manager's next-use table for params).
 * Reads ahead take only slots whose chunks come back after the one read,
 * so they never push out what is needed sooner.
 *
 * Locks: the tier's own mutex guards the slots; the AdamW thread and the
 * driving thread both call in.  The I/O engine's completion callback only
 * wakes waiters (it takes the mutex to broadcast, so a wake-up between a
 * waiter's check and its wait is not lost); a device copy's end is polled
 * (waiters for one sleep briefly instead). */
#include "memmgr_impl.h"
#include "tidal/hostpool.h"
#include "tidal/util.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static const td_tensor_role optim_roles[3] = {TD_TENSOR_MASTER, TD_TENSOR_ADAM_M, TD_TENSOR_ADAM_V};
/* Pools are made (and planned) in this order. */
static const td_tensor_role pool_roles[5] = {TD_TENSOR_PARAM, TD_TENSOR_GRAD, TD_TENSOR_MASTER, TD_TENSOR_ADAM_M,
                                             TD_TENSOR_ADAM_V};

static int on_disk(const td_memmgr *m, int c)
{
    const mm_chunk *ch = &m->chunks[c];
    return m->laid_out ? ch->on_disk : ch->home == TD_HOME_DISK;
}

/* Chunk id of index k of role r when it is on disk, else -1. */
static int disk_chunk(const td_memmgr *m, td_tensor_role r, int k)
{
    if (k < 0 || k >= m->role_count[r]) return -1;
    int c = m->role_first[r] + k;
    return on_disk(m, c) ? c : -1;
}

static size_t disk_bytes_of(const mm_chunk *ch, size_t host_bytes)
{
    (void)ch;
    return td_align_up(host_bytes ? host_bytes : 1, TD_DIO_ALIGN);
}

int td_memmgr_chunk_on_disk(const td_memmgr *m, int c)
{
    if (c < 0 || c >= m->n_chunks) return 0;
    return on_disk(m, c);
}

int td_memmgr_disk_plan(const td_memmgr *m, size_t slot_bytes[TD_TENSOR_ROLE_COUNT], size_t *file_bytes)
{
    size_t slot[TD_TENSOR_ROLE_COUNT] = {0}, file = 0;
    int any = 0;
    for (int c = 0; c < m->n_chunks; c++) {
        if (!on_disk(m, c)) continue;
        size_t b = disk_bytes_of(&m->chunks[c], td_memmgr_chunk_bytes(m, c));
        td_tensor_role r = m->chunks[c].role;
        if (b > slot[r]) slot[r] = b;
        file += b;
        any = 1;
    }
    if (slot_bytes) memcpy(slot_bytes, slot, sizeof slot);
    if (file_bytes) *file_bytes = file;
    if (!any) return 0;
    return m->params.disk_sets >= 3 ? m->params.disk_sets : 4;
}

/* ---- set-up ---------------------------------------------------------------------- */

static void wake(void *ctx)
{
    mm_disk *d = ctx;
    pthread_mutex_lock(&d->lock);
    pthread_cond_broadcast(&d->cond);
    pthread_mutex_unlock(&d->lock);
}

static int optim_index_count(const td_memmgr *m)
{
    int n = 0;
    for (int s = 0; s < 3; s++)
        if (m->role_count[optim_roles[s]] > n) n = m->role_count[optim_roles[s]];
    return n;
}

td_status mm_disk_setup(td_memmgr *m)
{
    td_status st = TD_OK;
    size_t slot_bytes[TD_TENSOR_ROLE_COUNT];
    int slots = td_memmgr_disk_plan(m, slot_bytes, NULL);
    if (!slots) return TD_OK;
    if (!m->params.n_disk_dirs)
        return td_error_set(TD_ERR_INVALID, "memmgr: chunks are homed on disk but no directory was given for them "
                            "(--offload-dir)");
    mm_disk *d = td_calloc(1, sizeof *d, TD_ROLE_META);
    if (!d) return TD_ERR_NOMEM;
    m->disk = d;
    pthread_mutex_init(&d->lock, NULL);
    pthread_cond_init(&d->cond, NULL);
    for (int c = 0; c < m->n_chunks; c++) { /* in chunk order: a role's chunks lie together in the file */
        mm_chunk *ch = &m->chunks[c];
        if (ch->home != TD_HOME_DISK) continue;
        ch->on_disk = 1;
        ch->disk_off = d->file_bytes;
        d->file_bytes += disk_bytes_of(ch, ch->host_bytes);
    }
    int n = optim_index_count(m);
    d->order = td_malloc(2 * ((size_t)n + 1) * sizeof *d->order, TD_ROLE_META);
    if (!d->order) TD_FAIL(TD_ERR_NOMEM, "memmgr: the disk tier's order of %d chunks", n);
    d->order_pos = d->order + n + 1;
    if (!(d->done = td_calloc((size_t)n + 1, 1, TD_ROLE_META)))
        TD_FAIL(TD_ERR_NOMEM, "memmgr: the disk tier's round of %d chunks", n);
    for (int k = 0; k < n; k++) d->order[k] = d->order_pos[k] = k;
    d->n_order = d->n_index = n;
    for (int p = 0; p < 5; p++) {
        td_tensor_role r = pool_roles[p];
        mm_dpool *pool = &d->pools[r];
        if (!slot_bytes[r]) continue;
        pool->slot_bytes = slot_bytes[r];
        if (!(pool->slots = td_calloc((size_t)slots, sizeof *pool->slots, TD_ROLE_META)))
            TD_FAIL(TD_ERR_NOMEM, "memmgr: the disk tier's %d slots", slots);
        for (int i = 0; i < slots; i++) pool->slots[i].chunk = -1;
        pool->n = slots;
        for (int i = 0; i < slots; i++)
            TD_TRY(td_hostpool_alloc(m->pool, pool->slot_bytes, TD_ROLE_STAGING, &pool->slots[i].buf));
    }
    td_dio_params ip = td_dio_default_params();
    ip.method = m->params.disk_method;
    TD_TRY(td_dio_create(&ip, &d->io));
    td_dio_set_notify(d->io, wake, d);
    td_dio_file_params fp = td_dio_file_default_params();
    fp.direct = m->params.disk_buffered ? 0 : 1;
    TD_TRY(td_dio_file_create(d->io, (const char *const *)m->disk_dirs, m->params.n_disk_dirs, d->file_bytes, &fp,
                              &d->file));
cleanup:
    return st; /* td_memmgr_destroy frees what was taken */
}

void mm_disk_free(td_memmgr *m)
{
    mm_disk *d = m->disk;
    if (!d) return;
    td_dio_destroy(d->io); /* first: it waits for what is in flight, which reads or writes the slots */
    td_dio_file_close(d->file);
    if (m->engine) td_copy_drain(m->engine); /* and the device copies of the slots */
    for (int r = 0; r < TD_TENSOR_ROLE_COUNT; r++) {
        mm_dpool *pool = &d->pools[r];
        for (int i = 0; pool->slots && i < pool->n; i++)
            if (pool->slots[i].buf) td_hostpool_release(m->pool, pool->slots[i].buf);
        td_free(pool->slots);
    }
    td_free(d->order);
    td_free(d->done);
    pthread_cond_destroy(&d->cond);
    pthread_mutex_destroy(&d->lock);
    td_free(d);
    m->disk = NULL;
}

/* ---- the slots (d->lock held) ------------------------------------------------------ */

static mm_dpool *pool_of(td_memmgr *m, int c) { return &m->disk->pools[m->chunks[c].role]; }

static int find_slot(const mm_dpool *pool, int c)
{
    for (int i = 0; i < pool->n; i++)
        if (pool->slots[i].chunk == c) return i;
    return -1;
}

/* How far place p of the AdamW's order is from its next use, in places:
 * the ones of this round not yet taken come first (from the cursor), then
 * the taken ones, in the next round.  The AdamW may take chunks out of the
 * order (its thread runs whichever job's inputs are in first): a chunk taken
 * early is spent for this round, and one passed over is still next. */
static int place_distance(const mm_disk *d, int p)
{
    return d->done[p] ? d->n_order - d->cursor + p : p - d->cursor;
}

/* How far chunk c's next use is (0: next): optimizer state and grads by
 * the AdamW's order (place_distance), params by the manager's next-use
 * table where there is one; INT_MAX for no chunk, INT_MAX - 1 for one with
 * no known use. */
static int distance(td_memmgr *m, int c)
{
    mm_disk *d = m->disk;
    if (c < 0) return INT_MAX;
    const mm_chunk *ch = &m->chunks[c];
    if (ch->role == TD_TENSOR_PARAM && d->nextuse) {
        uint64_t next = td_nextuse_of(d->nextuse, (uint32_t)c, d->mm_pos + 1);
        if (next == UINT64_MAX) return INT_MAX - 1;
        uint64_t far = next - d->mm_pos;
        return far > (uint64_t)INT_MAX - 2 ? INT_MAX - 2 : (int)far;
    }
    int p = ch->index < d->n_index && ch->index >= 0 ? d->order_pos[ch->index] : -1;
    if (p < 0 || !d->n_order) return INT_MAX - 1;
    return place_distance(d, p);
}

/* Index k taken by the AdamW: its place done for this round.  Taking one
 * that is done already starts the next round (a step whose updates all
 * ran, or one that stopped short: a skipped step, a failure). */
static void take_place(mm_disk *d, int k)
{
    if (k < 0 || k >= d->n_index || d->order_pos[k] < 0) return;
    int p = d->order_pos[k];
    if (d->done[p]) {
        memset(d->done, 0, (size_t)d->n_order);
        d->n_done = d->cursor = 0;
    }
    d->done[p] = 1;
    d->n_done++;
    while (d->cursor < d->n_order && d->done[d->cursor]) d->cursor++;
}

/* Polls slot s: ended reads become valid, ended writes clean, landed copies done. */
static td_status refresh(td_memmgr *m, mm_dslot *s)
{
    mm_disk *d = m->disk;
    td_status st;
    int done;
    if (s->reading) {
        if ((st = td_dio_done(d->io, &s->rd, &done))) return st;
        if (done) s->reading = 0, s->valid = 1;
    }
    if (s->writing) {
        if ((st = td_dio_done(d->io, &s->wr, &done))) return st;
        if (done) s->writing = 0;
    }
    if (s->copy_busy) {
        if ((st = td_copy_done(m->engine, &s->copy, &done))) return st;
        if (done) {
            s->copy_busy = 0;
            if (s->copy_dirty) s->copy_dirty = 0, s->dirty = 1, s->valid = 1;
        }
    }
    return TD_OK;
}

static td_status start_write(td_memmgr *m, mm_dslot *s)
{
    mm_disk *d = m->disk;
    if (!s->dirty || s->writing || s->copy_busy || s->chunk < 0) return TD_OK;
    mm_chunk *ch = &m->chunks[s->chunk];
    size_t b = disk_bytes_of(ch, ch->host_bytes);
    td_status st = td_dio_write(d->file, ch->disk_off, s->buf, b, &s->wr);
    if (st) return st;
    s->dirty = 0;
    s->writing = 1;
    ch->disk_written = 1;
    d->write_bytes += b;
    return TD_OK;
}

/* Whether a dirty slot of the role is written as soon as nobody uses it
 * (write-behind: optimizer state, params), or only when the slot is needed
 * for another chunk (grads: the AdamW mostly reads them from the slot their
 * write-back landed in, and they are spent after). */
static int eager_write(td_tensor_role r) { return r != TD_TENSOR_GRAD; }

/* Every slot polled; the dirty ones nobody pins start their writes (eager roles). */
static td_status refresh_all(td_memmgr *m)
{
    mm_disk *d = m->disk;
    for (int r = 0; r < TD_TENSOR_ROLE_COUNT; r++)
        for (int i = 0; i < d->pools[r].n; i++) {
            mm_dslot *s = &d->pools[r].slots[i];
            td_status st = refresh(m, s);
            if (!st && !s->pins && s->dirty && eager_write((td_tensor_role)r)) st = start_write(m, s);
            if (st) return st;
        }
    return TD_OK;
}

/* Slot s's chunk read (or zeroed: a chunk never written reads as zeros). */
static td_status start_read(td_memmgr *m, mm_dslot *s)
{
    mm_disk *d = m->disk;
    if (s->valid || s->reading || s->copy_dirty) return TD_OK;
    mm_chunk *ch = &m->chunks[s->chunk];
    size_t b = disk_bytes_of(ch, ch->host_bytes);
    if (!ch->disk_written) {
        memset(s->buf, 0, b);
        s->valid = 1;
        return TD_OK;
    }
    td_status st = td_dio_read(d->file, ch->disk_off, s->buf, b, &s->rd);
    if (st) return st;
    s->reading = 1;
    d->read_bytes += b;
    return TD_OK;
}

/* A slot of the pool that may take a chunk whose next use is `dist` away:
 * unpinned, clean, idle, its chunk back later (Belady), the least recently
 * used among equals; -1 if none.  *dirty_victim: the best that is only
 * dirty (its write would free it). */
static int victim(td_memmgr *m, mm_dpool *pool, int dist, int *dirty_victim)
{
    int best = -1, best_d = -1, dv = -1, dv_d = -1;
    for (int i = 0; i < pool->n; i++) {
        const mm_dslot *s = &pool->slots[i];
        if (s->pins || s->reading || s->writing || s->copy_busy || s->copy_dirty) continue;
        int di = distance(m, s->chunk);
        if (di <= dist) continue;
        if (s->dirty) {
            if (di > dv_d) dv = i, dv_d = di;
        } else if (di > best_d || (di == best_d && s->stamp < pool->slots[best].stamp)) {
            best = i, best_d = di;
        }
    }
    if (dirty_victim) *dirty_victim = dv;
    return best;
}

static void assign(mm_dslot *s, int c)
{
    s->chunk = c;
    s->valid = s->reading = s->dirty = s->writing = s->copy_busy = s->copy_dirty = 0;
}

/* The next chunk (of the pool's role) to read ahead into a slot: c, `dist` away
 * (distance's). */
static td_status read_ahead(td_memmgr *m, int c, int dist, int *stop)
{
    mm_dpool *pool = pool_of(m, c);
    int i = find_slot(pool, c);
    *stop = 0;
    if (i >= 0) return pool->slots[i].pins ? TD_OK : start_read(m, &pool->slots[i]);
    int dirty;
    i = victim(m, pool, dist, &dirty);
    if (i < 0) {
        *stop = 1; /* no room yet: the rest waits for the next call */
        return dirty >= 0 ? start_write(m, &pool->slots[dirty]) : TD_OK;
    }
    assign(&pool->slots[i], c);
    pool->slots[i].stamp = ++m->disk->clock;
    return start_read(m, &pool->slots[i]);
}

/* Reads ahead: the optimizer state of the next chunks of the AdamW's order,
 * and (from the driving thread, `params`) the params of the next accesses
 * that are not on the device. */
static td_status prefetch(td_memmgr *m, int params)
{
    mm_disk *d = m->disk;
    td_status st = refresh_all(m);
    if (st) return st;
    for (int s = 0; s < 3; s++) {
        td_tensor_role r = optim_roles[s];
        if (!d->pools[r].n) continue;
        /* the round's places not yet taken from the cursor on, then the
         * next round's: as many as the pool has slots but the one in use */
        int ahead = 0, stop = 0;
        for (int i = 0; i < 2 * d->n_order && ahead < d->pools[r].n - 1 && !stop; i++) {
            int p = i < d->n_order ? i : i - d->n_order;
            if (i < d->n_order ? p < d->cursor || d->done[p] : !d->done[p]) continue;
            int c = disk_chunk(m, r, d->order[p]);
            if (c < 0) continue;
            ahead++;
            if ((st = read_ahead(m, c, place_distance(d, p), &stop))) return st;
        }
    }
    mm_dpool *pp = &d->pools[TD_TENSOR_PARAM];
    if (!params || !pp->n || !d->nextuse) return TD_OK;
    int found = 0;
    for (uint64_t p = d->mm_pos + 1; found < pp->n - 1 && p < d->mm_pos + 1 + 4 * (uint64_t)m->n_chunks; p++) {
        int c = (int)td_nextuse_chunk_at(d->nextuse, p), stop;
        mm_chunk *ch = &m->chunks[c];
        if (!ch->on_disk || ch->role != TD_TENSOR_PARAM) continue;
        if ((ch->dev && ch->dev_ver >= ch->host_ver) || ch->n_free == ch->n_tensors) continue; /* no load coming */
        found++;
        if ((st = read_ahead(m, c, (int)(p - d->mm_pos - 1), &stop))) return st;
        if (stop) break;
    }
    return TD_OK;
}

typedef enum slot_use { USE_READ, USE_MODIFY, USE_OVERWRITE } slot_use;

/* Whether pinned slot s serves `how` now: its bytes there (READ, MODIFY),
 * and for a change no write or device copy still reading it. */
static int serves(const mm_dslot *s, slot_use how)
{
    if (how == USE_READ) return s->valid && !s->copy_dirty;
    return !s->writing && !s->copy_busy && (how == USE_OVERWRITE || s->valid);
}

/* Waits on the condition, or a moment when a device copy (which signals
 * nothing) is what it waits for. */
static void wait_some(mm_disk *d, int copy)
{
    if (!copy) {
        pthread_cond_wait(&d->cond, &d->lock);
        return;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 200 * 1000; /* 0.2 ms */
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(&d->cond, &d->lock, &ts);
}

/* Chunk c in a slot of its pool, pinned, serving `how` (d->lock held). */
static td_status acquire_locked(td_memmgr *m, int c, slot_use how, mm_dslot **out)
{
    mm_disk *d = m->disk;
    mm_dpool *pool = pool_of(m, c);
    td_status st = TD_OK;
    double t0 = 0;
    mm_dslot *s = NULL;
    for (;;) {
        if ((st = refresh_all(m))) break;
        if (!s) {
            int i = find_slot(pool, c), dirty = -1;
            if (i < 0 && (i = victim(m, pool, -1, &dirty)) >= 0) assign(&pool->slots[i], c);
            if (i >= 0) {
                s = &pool->slots[i];
                s->pins++;
            } else if (dirty >= 0) {
                if ((st = start_write(m, &pool->slots[dirty]))) break;
            } else {
                int busy = 0;
                for (int j = 0; j < pool->n; j++)
                    busy |= pool->slots[j].reading || pool->slots[j].writing || pool->slots[j].copy_busy;
                if (!busy) {
                    st = td_error_set(TD_ERR_STATE, "memmgr: %s chunk %d needs a disk slot and all %d are in use (more "
                                      "users at once than slots: raise the disk tier's sets)",
                                      td_tensor_role_name(m->chunks[c].role), m->chunks[c].index, pool->n);
                    break;
                }
            }
        }
        if (s) {
            if (how != USE_OVERWRITE && !s->valid && !s->reading && (st = start_read(m, s))) break;
            if (serves(s, how)) break;
        }
        if ((st = prefetch(m, 0))) break; /* keep the drive busy while this one waits */
        if (!t0) t0 = td_now_ms();
        /* a device copy's end is polled: with one in flight in this pool (a
         * slot to free, or this one's), wait a moment, not for a signal */
        int copies = 0;
        for (int j = 0; j < pool->n; j++) copies |= pool->slots[j].copy_busy;
        wait_some(d, copies || (s && s->copy_dirty));
    }
    if (t0) d->wait_ms += td_now_ms() - t0;
    if (st && s) s->pins--;
    if (st) return st;
    if (how == USE_OVERWRITE) s->valid = 1, s->reading = 0; /* the caller writes every byte */
    s->stamp = ++d->clock;
    *out = s;
    return TD_OK;
}

static void unpin_locked(td_memmgr *m, mm_dslot *s, int written)
{
    if (written) s->dirty = 1;
    if (s->pins > 0) s->pins--;
    if (!s->pins && s->dirty && s->chunk >= 0 && eager_write(m->chunks[s->chunk].role))
        (void)start_write(m, s); /* a failure is the engine's: the next call reports it */
    pthread_cond_broadcast(&m->disk->cond);
}

/* ---- the public calls ------------------------------------------------------------- */

static td_status need_tier(const td_memmgr *m, const char *what)
{
    if (m->disk) return TD_OK;
    return td_error_set(TD_ERR_STATE, "memmgr: %s: no chunk is homed on disk", what);
}

static td_status check_chunk(const td_memmgr *m, int c, const char *what)
{
    td_status st = need_tier(m, what);
    if (st) return st;
    if (c < 0 || c >= m->n_chunks || !m->chunks[c].on_disk)
        return td_error_set(TD_ERR_INVALID, "memmgr: %s of chunk %d, which is not homed on disk", what, c);
    return TD_OK;
}

td_status td_memmgr_disk_set_order(td_memmgr *m, const int *index, int n)
{
    td_status st = need_tier(m, "disk order");
    if (st) return st;
    mm_disk *d = m->disk;
    int total = optim_index_count(m);
    if (n < 0 || n > total) return td_error_set(TD_ERR_INVALID, "memmgr: disk order of %d chunks (%d)", n, total);
    pthread_mutex_lock(&d->lock);
    for (int k = 0; k < total; k++) d->order_pos[k] = -1;
    for (int j = 0; j < n && !st; j++) {
        if (index[j] < 0 || index[j] >= total || d->order_pos[index[j]] >= 0)
            st = td_error_set(TD_ERR_INVALID, "memmgr: disk order: chunk %d is out of range or named twice", index[j]);
        else d->order[j] = index[j], d->order_pos[index[j]] = j;
    }
    d->n_order = st ? 0 : n;
    memset(d->done, 0, (size_t)total + 1);
    d->n_done = d->cursor = 0;
    pthread_mutex_unlock(&d->lock);
    return st;
}

int td_memmgr_disk_next(td_memmgr *m)
{
    if (!m->disk) return -1;
    mm_disk *d = m->disk;
    pthread_mutex_lock(&d->lock);
    int k = !d->n_order ? -1 : d->order[d->cursor < d->n_order ? d->cursor : 0];
    pthread_mutex_unlock(&d->lock);
    return k;
}

td_status td_memmgr_disk_chunk_acquire(td_memmgr *m, int c, td_disk_access how, void **host)
{
    td_status st = check_chunk(m, c, "disk acquire");
    if (st) return st;
    mm_disk *d = m->disk;
    mm_dslot *s;
    pthread_mutex_lock(&d->lock);
    st = acquire_locked(m, c, how == TD_DISK_READ ? USE_READ : how == TD_DISK_MODIFY ? USE_MODIFY : USE_OVERWRITE, &s);
    if (!st) *host = s->buf;
    pthread_mutex_unlock(&d->lock);
    return st ? td_error_prefix(st, "%s chunk %d on disk: ", td_tensor_role_name(m->chunks[c].role),
                                m->chunks[c].index) : TD_OK;
}

td_status td_memmgr_disk_chunk_release(td_memmgr *m, int c, int written)
{
    td_status st = check_chunk(m, c, "disk release");
    if (st) return st;
    mm_disk *d = m->disk;
    pthread_mutex_lock(&d->lock);
    mm_dpool *pool = pool_of(m, c);
    int i = find_slot(pool, c);
    if (i < 0 || !pool->slots[i].pins) {
        st = td_error_set(TD_ERR_STATE, "memmgr: disk release of %s chunk %d, which is not acquired",
                          td_tensor_role_name(m->chunks[c].role), m->chunks[c].index);
    } else {
        unpin_locked(m, &pool->slots[i], written);
        st = prefetch(m, 0);
    }
    pthread_mutex_unlock(&d->lock);
    return st;
}

td_status td_memmgr_disk_acquire(td_memmgr *m, int k, void *host[3])
{
    td_status st = need_tier(m, "disk acquire");
    for (int s = 0; s < 3; s++) host[s] = NULL;
    if (st) return st;
    int got = 0;
    for (; got < 3 && !st; got++) {
        int c = disk_chunk(m, optim_roles[got], k);
        if (c >= 0) st = td_memmgr_disk_chunk_acquire(m, c, TD_DISK_MODIFY, &host[got]);
    }
    if (st) { /* the ones taken go back unchanged */
        for (int s = 0; s < got - 1; s++) {
            int c = disk_chunk(m, optim_roles[s], k);
            if (c >= 0) (void)td_memmgr_disk_chunk_release(m, c, 0);
            host[s] = NULL;
        }
        return st;
    }
    mm_disk *d = m->disk;
    pthread_mutex_lock(&d->lock);
    take_place(d, k);
    st = prefetch(m, 0);
    pthread_mutex_unlock(&d->lock);
    return st;
}

td_status td_memmgr_disk_release(td_memmgr *m, int k, int written)
{
    td_status st = need_tier(m, "disk release");
    for (int s = 0; s < 3 && !st; s++) {
        int c = disk_chunk(m, optim_roles[s], k);
        if (c >= 0) st = td_memmgr_disk_chunk_release(m, c, written);
    }
    return st;
}

int td_memmgr_disk_ready(td_memmgr *m, int k)
{
    if (!m->disk) return 1;
    mm_disk *d = m->disk;
    int ready = 1;
    pthread_mutex_lock(&d->lock);
    if (refresh_all(m) == TD_OK) {
        for (int s = 0; s < 3 && ready; s++) {
            int c = disk_chunk(m, optim_roles[s], k);
            if (c < 0) continue;
            int i = find_slot(pool_of(m, c), c);
            ready = i >= 0 && serves(&pool_of(m, c)->slots[i], USE_MODIFY);
        }
    }
    pthread_mutex_unlock(&d->lock);
    td_error_clear();
    return ready;
}

int mm_disk_chunk_ready(td_memmgr *m, const mm_chunk *ch)
{
    mm_disk *d = m->disk;
    int c = (int)(ch - m->chunks), ready = 0;
    pthread_mutex_lock(&d->lock);
    if (refresh_all(m) == TD_OK) {
        int i = find_slot(pool_of(m, c), c);
        ready = i >= 0 && serves(&pool_of(m, c)->slots[i], USE_READ);
    }
    pthread_mutex_unlock(&d->lock);
    td_error_clear();
    return ready;
}

/* The driving thread's holds let go (d->lock held). */
static void drop_held(td_memmgr *m)
{
    mm_disk *d = m->disk;
    for (int h = 0; h < d->n_held; h++) {
        mm_dpool *pool = pool_of(m, d->held[h]);
        int i = find_slot(pool, d->held[h]);
        if (i >= 0) unpin_locked(m, &pool->slots[i], 0);
    }
    d->n_held = 0;
}

void mm_disk_release_held(td_memmgr *m)
{
    pthread_mutex_lock(&m->disk->lock);
    drop_held(m);
    pthread_mutex_unlock(&m->disk->lock);
}

void td_memmgr_disk_release_held(td_memmgr *m)
{
    if (m->disk) mm_disk_release_held(m);
}

td_status td_memmgr_disk_flush(td_memmgr *m)
{
    if (!m->disk) return TD_OK;
    mm_disk *d = m->disk;
    td_status st = TD_OK;
    pthread_mutex_lock(&d->lock);
    drop_held(m);
    for (;;) { /* every dirty slot written, every copy into a slot landed */
        if ((st = refresh_all(m))) break;
        int busy = 0;
        for (int r = 0; r < TD_TENSOR_ROLE_COUNT && !st; r++)
            for (int i = 0; i < d->pools[r].n && !st; i++) {
                mm_dslot *s = &d->pools[r].slots[i];
                if (!s->pins && s->dirty) st = start_write(m, s); /* the lazy ones too */
                busy |= s->copy_busy || (s->dirty && !s->pins);
            }
        if (st || !busy) break;
        wait_some(d, 1);
    }
    pthread_mutex_unlock(&d->lock);
    if (!st) st = td_dio_drain(d->io);
    pthread_mutex_lock(&d->lock);
    if (!st) st = refresh_all(m);
    pthread_mutex_unlock(&d->lock);
    return st;
}

td_status td_memmgr_disk_status(td_memmgr *m)
{
    if (!m->disk) return TD_OK;
    pthread_mutex_lock(&m->disk->lock);
    td_status st = refresh_all(m);
    pthread_mutex_unlock(&m->disk->lock);
    return st ? st : td_dio_failed(m->disk->io);
}

const char *td_memmgr_disk_describe(const td_memmgr *m)
{
    static __thread char text[4096];
    if (!m->disk || !m->disk->file) return "";
    const char *notes = td_dio_file_notes(m->disk->file);
    snprintf(text, sizeof text, "%s\n%s%s%s", td_dio_describe(m->disk->io), td_dio_file_describe(m->disk->file),
             notes[0] ? "\n" : "", notes);
    return text;
}

td_status mm_disk_host_access(td_memmgr *m, mm_chunk *ch, unsigned flags, void **host)
{
    mm_disk *d = m->disk;
    int c = (int)(ch - m->chunks), kept = -1;
    mm_dslot *s;
    pthread_mutex_lock(&d->lock);
    for (int h = 0; h < d->n_held; h++)
        if (d->held[h] == c) kept = h;
    /* A new hold: the oldest lets go first when there are MM_DISK_HOLDS, or
     * when its pool has no slot left but one (its slot may be the one needed). */
    for (int pass = 0; kept < 0 && pass < 2; pass++) {
        int same = 0, oldest = -1;
        for (int h = 0; h < d->n_held; h++)
            if (m->chunks[d->held[h]].role == ch->role) {
                same++;
                if (oldest < 0) oldest = h;
            }
        int drop = d->n_held == MM_DISK_HOLDS ? 0 : same >= pool_of(m, c)->n - 1 ? oldest : -1;
        if (drop < 0) break;
        mm_dpool *pool = pool_of(m, d->held[drop]);
        int i = find_slot(pool, d->held[drop]);
        if (i >= 0) unpin_locked(m, &pool->slots[i], 0);
        memmove(d->held + drop, d->held + drop + 1, (size_t)(d->n_held - drop - 1) * sizeof d->held[0]);
        d->n_held--;
    }
    td_status st = acquire_locked(m, c, (flags & TD_ACCESS_WRITE) ? USE_MODIFY : USE_READ, &s);
    if (!st) {
        if (flags & TD_ACCESS_WRITE) s->dirty = 1;
        *host = s->buf;
        if (kept >= 0) s->pins--; /* pinned once by its hold already */
        else d->held[d->n_held++] = c;
    }
    pthread_mutex_unlock(&d->lock);
    return st ? td_error_prefix(st, "%s chunk %d on disk: ", td_tensor_role_name(ch->role), ch->index) : TD_OK;
}

td_status mm_disk_copy_begin(td_memmgr *m, mm_chunk *ch, int into, void **host)
{
    mm_dslot *s;
    pthread_mutex_lock(&m->disk->lock);
    td_status st = acquire_locked(m, (int)(ch - m->chunks), into ? USE_OVERWRITE : USE_READ, &s);
    if (!st) *host = s->buf;
    if (!st && into) s->valid = 0, s->copy_dirty = 1; /* its bytes are the write-back's once it lands: no read meanwhile */
    pthread_mutex_unlock(&m->disk->lock);
    return st ? td_error_prefix(st, "%s chunk %d on disk: ", td_tensor_role_name(ch->role), ch->index) : TD_OK;
}

void mm_disk_copy_end(td_memmgr *m, mm_chunk *ch, const td_copy_ticket *ticket)
{
    mm_disk *d = m->disk;
    pthread_mutex_lock(&d->lock);
    int c = (int)(ch - m->chunks), i = find_slot(pool_of(m, c), c);
    if (i >= 0) {
        mm_dslot *s = &pool_of(m, c)->slots[i];
        if (ticket) {
            s->copy = *ticket;
            s->copy_busy = 1; /* a write-back's slot (copy_dirty) is dirty once it lands */
        } else if (s->copy_dirty) {
            s->copy_dirty = 0;
            s->chunk = -1; /* a write-back that never started: nothing of the chunk is here */
        }
        unpin_locked(m, s, 0);
    }
    pthread_mutex_unlock(&d->lock);
}

void mm_disk_discard(td_memmgr *m, mm_chunk *ch)
{
    mm_disk *d = m->disk;
    pthread_mutex_lock(&d->lock);
    int c = (int)(ch - m->chunks), i = find_slot(pool_of(m, c), c);
    if (i >= 0) {
        mm_dslot *s = &pool_of(m, c)->slots[i];
        if (!s->pins && !s->copy_busy && !s->copy_dirty && !s->writing && !s->reading) {
            s->dirty = 0;
            s->valid = 0;
            s->chunk = -1;
            pthread_cond_broadcast(&d->cond);
        }
    }
    pthread_mutex_unlock(&d->lock);
}

void mm_disk_pump(td_memmgr *m)
{
    mm_disk *d = m->disk;
    if (!d || pthread_mutex_trylock(&d->lock) != 0) return; /* busy: whoever holds it reads ahead */
    d->nextuse = m->warmed_up && !m->off_trace ? m->nextuse : NULL;
    d->mm_pos = m->pos;
    if (prefetch(m, 1)) td_error_clear(); /* an I/O failure: the next acquire reports it */
    pthread_mutex_unlock(&d->lock);
}
