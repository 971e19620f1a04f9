/* The chunk manager's disk tier (see "the disk tier" in include/tidal/memmgr.h):
 * where optimizer chunks homed on disk sit in the scratch file, the bounce
 * sets that hold them while they are used, and the read-ahead.
 *
 * A bounce set holds optimizer chunk k's disk chunks (master, m, v): the
 * AdamW of chunk k needs all three at once, and a checkpoint walks them
 * tensor by tensor, so one set serves both.  Its state per role is a mask:
 * valid (the bytes are here), reading, dirty (newer than the file),
 * writing.  A set is free for another chunk when nobody pins it and it is
 * neither dirty nor moving; which one goes is Belady's choice over the
 * known order (td_memmgr_disk_set_order): the one whose chunk comes back
 * last.  Reads ahead take only sets whose chunks come back after the one
 * read, so they never push out what is needed sooner.
 *
 * Locks: the tier's own mutex guards the sets; the AdamW thread and the
 * driving thread both call in.  The I/O engine's completion callback only
 * wakes waiters (it takes the tier's mutex to broadcast, so a wake-up
 * between a waiter's check and its wait is not lost). */
#include "memmgr_impl.h"
#include "tidal/hostpool.h"
#include "tidal/util.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

static const td_tensor_role disk_roles[3] = {TD_TENSOR_MASTER, TD_TENSOR_ADAM_M, TD_TENSOR_ADAM_V};

/* Chunk id of optimizer chunk k's role slot s when it is on disk (laid out
 * or planned), else -1. */
static int disk_chunk(const td_memmgr *m, int k, int s)
{
    td_tensor_role r = disk_roles[s];
    if (k < 0 || k >= m->role_count[r]) return -1;
    int c = m->role_first[r] + k;
    const mm_chunk *ch = &m->chunks[c];
    return (m->laid_out ? ch->on_disk : ch->home == TD_HOME_DISK) ? c : -1;
}

static unsigned disk_mask(const td_memmgr *m, int k)
{
    unsigned mask = 0;
    for (int s = 0; s < 3; s++)
        if (disk_chunk(m, k, s) >= 0) mask |= 1u << s;
    return mask;
}

static int optim_index_count(const td_memmgr *m)
{
    int n = 0;
    for (int s = 0; s < 3; s++)
        if (m->role_count[disk_roles[s]] > n) n = m->role_count[disk_roles[s]];
    return n;
}

int td_memmgr_chunk_on_disk(const td_memmgr *m, int c)
{
    if (c < 0 || c >= m->n_chunks) return 0;
    return m->laid_out ? m->chunks[c].on_disk : m->chunks[c].home == TD_HOME_DISK;
}

int td_memmgr_disk_plan(const td_memmgr *m, size_t role_bytes[3], size_t *file_bytes)
{
    size_t role[3] = {0}, file = 0;
    int any = 0;
    for (int c = 0; c < m->n_chunks; c++) {
        if (!td_memmgr_chunk_on_disk(m, c)) continue;
        size_t b = td_align_up(td_memmgr_chunk_bytes(m, c), TD_DIO_ALIGN);
        if (!b) b = TD_DIO_ALIGN;
        int s = m->chunks[c].role == TD_TENSOR_MASTER ? 0 : m->chunks[c].role == TD_TENSOR_ADAM_M ? 1 : 2;
        if (b > role[s]) role[s] = b;
        file += b;
        any = 1;
    }
    if (role_bytes) memcpy(role_bytes, role, sizeof role);
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

td_status mm_disk_setup(td_memmgr *m)
{
    td_status st = TD_OK;
    int sets = td_memmgr_disk_plan(m, NULL, NULL);
    if (!sets) return TD_OK;
    if (!m->params.n_disk_dirs)
        return td_error_set(TD_ERR_INVALID, "memmgr: chunks are homed on disk but no directory was given for them "
                            "(--offload-dir)");
    mm_disk *d = td_calloc(1, sizeof *d, TD_ROLE_META);
    if (!d) return TD_ERR_NOMEM;
    m->disk = d;
    pthread_mutex_init(&d->lock, NULL);
    pthread_cond_init(&d->cond, NULL);
    d->pos = -1;
    d->held[0] = d->held[1] = -1;
    for (int c = 0; c < m->n_chunks; c++) { /* in chunk order: a role's chunks lie together in the file */
        mm_chunk *ch = &m->chunks[c];
        if (ch->home != TD_HOME_DISK) continue;
        size_t b = td_align_up(ch->host_bytes ? ch->host_bytes : 1, TD_DIO_ALIGN);
        int s = ch->role == TD_TENSOR_MASTER ? 0 : ch->role == TD_TENSOR_ADAM_M ? 1 : 2;
        ch->on_disk = 1;
        ch->disk_off = d->file_bytes;
        d->file_bytes += b;
        if (b > d->role_bytes[s]) d->role_bytes[s] = b;
    }
    int n = optim_index_count(m);
    d->order = td_malloc(2 * ((size_t)n + 1) * sizeof *d->order, TD_ROLE_META);
    d->sets = td_calloc((size_t)sets, sizeof *d->sets, TD_ROLE_META);
    if (!d->order || !d->sets) TD_FAIL(TD_ERR_NOMEM, "memmgr: the disk tier's tables (%d chunks, %d sets)", n, sets);
    d->order_pos = d->order + n + 1;
    for (int k = 0; k < n; k++) d->order[k] = d->order_pos[k] = k;
    d->n_order = n;
    d->n_sets = sets;
    for (int i = 0; i < sets; i++) {
        d->sets[i].k = -1;
        for (int s = 0; s < 3; s++)
            if (d->role_bytes[s]) TD_TRY(td_hostpool_alloc(m->pool, d->role_bytes[s], TD_ROLE_STAGING, &d->sets[i].buf[s]));
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
    td_dio_destroy(d->io); /* first: it waits for what is in flight, which reads or writes the sets below */
    td_dio_file_close(d->file);
    for (int i = 0; d->sets && i < d->n_sets; i++)
        for (int s = 0; s < 3; s++)
            if (d->sets[i].buf[s]) td_hostpool_release(m->pool, d->sets[i].buf[s]);
    td_free(d->sets);
    td_free(d->order);
    pthread_cond_destroy(&d->cond);
    pthread_mutex_destroy(&d->lock);
    td_free(d);
    m->disk = NULL;
}

/* ---- the sets (d->lock held) ----------------------------------------------------- */

static int find_set(mm_disk *d, int k)
{
    for (int i = 0; i < d->n_sets; i++)
        if (d->sets[i].k == k) return i;
    return -1;
}

/* How far in the order chunk k's next use is from the last acquired one
 * (0: next); INT_MAX for an empty set, INT_MAX - 1 for a chunk not in the order. */
static int distance(const mm_disk *d, int k)
{
    if (k < 0) return INT_MAX;
    int p = d->order_pos[k];
    if (p < 0) return INT_MAX - 1;
    int pos = d->pos < 0 ? d->n_order - 1 : d->pos;
    return (p - pos - 1 + 2 * d->n_order) % d->n_order;
}

/* Polls set i's I/O: ended reads become valid, ended writes clean. */
static td_status refresh(td_memmgr *m, int i)
{
    mm_disk *d = m->disk;
    mm_dset *set = &d->sets[i];
    td_status st = TD_OK;
    for (int s = 0; s < 3 && (set->reading | set->writing); s++) {
        unsigned bit = 1u << s;
        int done;
        if ((set->reading & bit)) {
            if ((st = td_dio_done(d->io, &set->rd[s], &done))) return st;
            if (done) set->reading &= ~bit, set->valid |= bit;
        }
        if ((set->writing & bit)) {
            if ((st = td_dio_done(d->io, &set->wr[s], &done))) return st;
            if (done) set->writing &= ~bit;
        }
    }
    return st;
}

static td_status refresh_all(td_memmgr *m)
{
    for (int i = 0; i < m->disk->n_sets; i++) {
        td_status st = refresh(m, i);
        if (st) return st;
    }
    return TD_OK;
}

static td_status start_write(td_memmgr *m, int i)
{
    mm_disk *d = m->disk;
    mm_dset *set = &d->sets[i];
    for (int s = 0; s < 3; s++) {
        unsigned bit = 1u << s;
        if (!(set->dirty & bit)) continue;
        mm_chunk *ch = &m->chunks[disk_chunk(m, set->k, s)];
        size_t b = td_align_up(ch->host_bytes ? ch->host_bytes : 1, TD_DIO_ALIGN);
        td_status st = td_dio_write(d->file, ch->disk_off, set->buf[s], b, &set->wr[s]);
        if (st) return st;
        set->dirty &= ~bit;
        set->writing |= bit;
        ch->disk_written = 1;
        d->write_bytes += b;
    }
    return TD_OK;
}

/* The roles of `mask` set i lacks, read (or zeroed: a chunk never written). */
static td_status start_reads(td_memmgr *m, int i, unsigned mask)
{
    mm_disk *d = m->disk;
    mm_dset *set = &d->sets[i];
    for (int s = 0; s < 3; s++) {
        unsigned bit = 1u << s;
        if (!(mask & bit) || (set->valid & bit) || (set->reading & bit)) continue;
        mm_chunk *ch = &m->chunks[disk_chunk(m, set->k, s)];
        size_t b = td_align_up(ch->host_bytes ? ch->host_bytes : 1, TD_DIO_ALIGN);
        if (!ch->disk_written) {
            memset(set->buf[s], 0, b);
            set->valid |= bit;
            continue;
        }
        td_status st = td_dio_read(d->file, ch->disk_off, set->buf[s], b, &set->rd[s]);
        if (st) return st;
        set->reading |= bit;
        d->read_bytes += b;
    }
    return TD_OK;
}

/* A set that may take a new chunk whose next use is `dist` away: unpinned,
 * clean, idle, holding a chunk that comes back later (Belady); -1 if none.
 * *dirty_victim: the best such set that is only dirty (its write would free it). */
static int victim(mm_disk *d, int dist, int *dirty_victim)
{
    int best = -1, best_d = -1, dv = -1, dv_d = -1;
    for (int i = 0; i < d->n_sets; i++) {
        const mm_dset *s = &d->sets[i];
        if (s->pins || s->reading || s->writing) continue;
        int di = distance(d, s->k);
        if (di <= dist) continue;
        if (s->dirty) {
            if (di > dv_d) dv = i, dv_d = di;
        } else if (di > best_d) {
            best = i, best_d = di;
        }
    }
    if (dirty_victim) *dirty_victim = dv;
    return best;
}

static void assign(mm_disk *d, int i, int k)
{
    mm_dset *s = &d->sets[i];
    s->k = k;
    s->valid = s->reading = s->dirty = s->writing = 0;
}

/* Reads ahead: the next chunks of the order into sets that hold chunks
 * needed later (or none); a dirty set in the way starts its write. */
static td_status prefetch(td_memmgr *m)
{
    mm_disk *d = m->disk;
    td_status st = refresh_all(m);
    if (st || !d->n_order) return st;
    for (int ahead = 0; ahead < d->n_sets - 1 && ahead < d->n_order; ahead++) {
        int pos = d->pos < 0 ? d->n_order - 1 : d->pos;
        int k = d->order[(pos + 1 + ahead) % d->n_order];
        unsigned mask = disk_mask(m, k);
        if (!mask) continue;
        int i = find_set(d, k);
        if (i >= 0) {
            if ((st = start_reads(m, i, mask))) return st;
            continue;
        }
        int dirty;
        i = victim(d, ahead, &dirty);
        if (i < 0) {
            if (dirty >= 0) st = start_write(m, dirty);
            return st; /* no room yet: the rest waits for the next call */
        }
        assign(d, i, k);
        if ((st = start_reads(m, i, mask))) return st;
    }
    return TD_OK;
}

/* Optimizer chunk k's roles `mask` in a set, pinned (d->lock held): waits
 * for reads, for a write of its set in flight, or for a set to free. */
static td_status acquire_locked(td_memmgr *m, int k, unsigned mask, int *set_out)
{
    mm_disk *d = m->disk;
    td_status st = TD_OK;
    double t0 = 0;
    int i = -1;
    for (;;) {
        if ((st = refresh_all(m))) break;
        if (i < 0 && (i = find_set(d, k)) >= 0) d->sets[i].pins++;
        if (i < 0) {
            int dirty;
            int v = victim(d, -1, &dirty);
            if (v >= 0) {
                assign(d, v, k);
                d->sets[v].pins++;
                i = v;
            } else if (dirty >= 0) {
                if ((st = start_write(m, dirty))) break;
            } else {
                int busy = 0;
                for (int j = 0; j < d->n_sets; j++) busy |= d->sets[j].reading || d->sets[j].writing;
                if (!busy) {
                    st = td_error_set(TD_ERR_STATE, "memmgr: optimizer chunk %d needs a bounce set and all %d are in "
                                      "use (more users at once than sets: raise the disk tier's sets)", k, d->n_sets);
                    break;
                }
            }
        }
        if (i >= 0) {
            mm_dset *s = &d->sets[i];
            if (!s->writing && (st = start_reads(m, i, mask))) break;
            if (!s->writing && (s->valid & mask) == mask) break;
        }
        if ((st = prefetch(m))) break; /* keep the drive busy while this one waits */
        if (!t0) t0 = td_now_ms();
        pthread_cond_wait(&d->cond, &d->lock);
    }
    if (t0) d->wait_ms += td_now_ms() - t0;
    if (st && i >= 0) d->sets[i].pins--;
    if (!st) *set_out = i;
    return st;
}

static void unpin_locked(td_memmgr *m, int i)
{
    mm_disk *d = m->disk;
    mm_dset *s = &d->sets[i];
    if (s->pins > 0) s->pins--;
    if (!s->pins && s->dirty) (void)start_write(m, i); /* a failure is the engine's: the next call reports it */
    pthread_cond_broadcast(&d->cond);
}

/* ---- the public calls ------------------------------------------------------------- */

static td_status need_tier(const td_memmgr *m, const char *what)
{
    if (m->disk) return TD_OK;
    return td_error_set(TD_ERR_STATE, "memmgr: %s: no chunk is homed on disk", what);
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
    d->pos = -1;
    pthread_mutex_unlock(&d->lock);
    return st;
}

td_status td_memmgr_disk_acquire(td_memmgr *m, int k, void *host[3])
{
    td_status st = need_tier(m, "disk acquire");
    if (st) return st;
    mm_disk *d = m->disk;
    unsigned mask = disk_mask(m, k);
    for (int s = 0; s < 3; s++) host[s] = NULL;
    if (!mask) return TD_OK;
    pthread_mutex_lock(&d->lock);
    int i;
    st = acquire_locked(m, k, mask, &i);
    if (!st) {
        for (int s = 0; s < 3; s++)
            if (mask & (1u << s)) host[s] = d->sets[i].buf[s];
        if (d->order_pos[k] >= 0) d->pos = d->order_pos[k];
        st = prefetch(m);
        if (st) unpin_locked(m, i);
    }
    pthread_mutex_unlock(&d->lock);
    return st ? td_error_prefix(st, "optimizer chunk %d on disk: ", k) : TD_OK;
}

td_status td_memmgr_disk_release(td_memmgr *m, int k, int written)
{
    td_status st = need_tier(m, "disk release");
    if (st) return st;
    mm_disk *d = m->disk;
    unsigned mask = disk_mask(m, k);
    if (!mask) return TD_OK;
    pthread_mutex_lock(&d->lock);
    int i = find_set(d, k);
    if (i < 0 || !d->sets[i].pins) {
        st = td_error_set(TD_ERR_STATE, "memmgr: disk release of optimizer chunk %d, which is not acquired", k);
    } else {
        if (written) d->sets[i].dirty |= mask;
        unpin_locked(m, i);
        st = prefetch(m);
    }
    pthread_mutex_unlock(&d->lock);
    return st;
}

int td_memmgr_disk_ready(td_memmgr *m, int k)
{
    if (!m->disk) return 1;
    unsigned mask = disk_mask(m, k);
    if (!mask) return 1;
    mm_disk *d = m->disk;
    pthread_mutex_lock(&d->lock);
    int ready = 0;
    if (refresh_all(m) == TD_OK) {
        int i = find_set(d, k);
        ready = i >= 0 && !d->sets[i].writing && (d->sets[i].valid & mask) == mask;
    }
    pthread_mutex_unlock(&d->lock);
    td_error_clear();
    return ready;
}

/* The driving thread's held sets let go (their writes start). */
static void drop_held(td_memmgr *m)
{
    mm_disk *d = m->disk;
    for (int h = 0; h < d->n_held; h++) {
        int i = find_set(d, d->held[h]);
        if (i >= 0) unpin_locked(m, i);
    }
    d->n_held = 0;
}

void mm_disk_release_held(td_memmgr *m)
{
    pthread_mutex_lock(&m->disk->lock);
    drop_held(m);
    pthread_mutex_unlock(&m->disk->lock);
}

td_status td_memmgr_disk_flush(td_memmgr *m)
{
    if (!m->disk) return TD_OK;
    mm_disk *d = m->disk;
    td_status st = TD_OK;
    pthread_mutex_lock(&d->lock);
    drop_held(m);
    for (int i = 0; i < d->n_sets && !st; i++)
        if (!d->sets[i].pins && d->sets[i].dirty) st = start_write(m, i);
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
    int s = ch->role == TD_TENSOR_MASTER ? 0 : ch->role == TD_TENSOR_ADAM_M ? 1 : 2, k = ch->index, i;
    pthread_mutex_lock(&d->lock);
    td_status st = acquire_locked(m, k, 1u << s, &i);
    if (!st) {
        mm_dset *set = &d->sets[i];
        if (flags & TD_ACCESS_WRITE) set->dirty |= 1u << s;
        *host = set->buf[s];
        int kept = 0;
        for (int h = 0; h < d->n_held; h++) kept |= d->held[h] == k;
        if (kept) { /* pinned once by its hold already */
            set->pins--;
        } else {
            if (d->n_held == 2) { /* the oldest hold lets go */
                int j = find_set(d, d->held[0]);
                if (j >= 0) unpin_locked(m, j);
                d->held[0] = d->held[1];
                d->n_held = 1;
            }
            d->held[d->n_held++] = k;
        }
    }
    pthread_mutex_unlock(&d->lock);
    return st ? td_error_prefix(st, "%s chunk %d on disk: ", td_tensor_role_name(ch->role), k) : TD_OK;
}

void mm_disk_pump(td_memmgr *m)
{
    mm_disk *d = m->disk;
    if (!d || pthread_mutex_trylock(&d->lock) != 0) return; /* busy: whoever holds it reads ahead */
    if (prefetch(m)) td_error_clear(); /* an I/O failure: the next acquire reports it */
    pthread_mutex_unlock(&d->lock);
}
