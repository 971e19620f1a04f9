/* The disk I/O engine (include/tidal/diskio.h): the request table, the
 * pread/pwrite threads, striped scratch files, their lock files and the
 * directories' facts.  The io_uring back end is diskio_uring.c.
 *
 * A request is cut into transfers lazily, as threads (or the ring) take
 * them, so the table is fixed and a request of any size costs one entry. */
#include "diskio_impl.h"
#include "tidal/alloc.h"
#include "tidal/util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

const char *td_dio_method_name(td_dio_method m)
{
    switch (m) {
    case TD_DIO_AUTO: return "auto";
    case TD_DIO_URING: return "io_uring";
    case TD_DIO_THREADS: return "threads";
    }
    return "unknown";
}

td_status td_dio_method_parse(const char *name, td_dio_method *out)
{
    for (int m = TD_DIO_AUTO; m <= TD_DIO_THREADS; m++)
        if (name && !strcmp(name, td_dio_method_name((td_dio_method)m))) { *out = (td_dio_method)m; return TD_OK; }
    return td_error_set(TD_ERR_INVALID, "unknown disk I/O method '%s'; use auto, io_uring or threads", name ? name : "");
}

int td_dio_uring_compiled(void)
{
#ifdef TD_HAVE_URING
    return 1;
#else
    return 0;
#endif
}

td_dio_params td_dio_default_params(void)
{
    return (td_dio_params){ .method = TD_DIO_AUTO, .queue_depth = 32, .threads = 8, .piece_bytes = (size_t)1 << 20 };
}

td_dio_file_params td_dio_file_default_params(void)
{
    return (td_dio_file_params){ .stripe_bytes = (size_t)4 << 20, .direct = 1 };
}

/* ---- requests and transfers ----------------------------------------------------- */

int dio_next_xfer(td_dio *io, dio_xfer *x)
{
    while (io->fifo_n) {
        dio_req *r = &io->reqs[io->fifo[io->fifo_head]];
        if (r->issued == r->bytes) { /* all cut (a zero-length request never queues) */
            io->fifo_head = (io->fifo_head + 1) % DIO_REQS;
            io->fifo_n--;
            r->queued = 0;
            continue;
        }
        td_dio_file *f = r->file;
        uint64_t pos = r->off + r->issued, s = pos / f->stripe, in = pos % f->stripe;
        size_t len = f->stripe - in;
        if (len > io->p.piece_bytes) len = io->p.piece_bytes;
        if (len > r->bytes - r->issued) len = (size_t)(r->bytes - r->issued);
        int d = (int)(s % (uint64_t)f->n);
        *x = (dio_xfer){ .fd = f->d[d].fd, .dir = d, .file = f, .off = s / (uint64_t)f->n * f->stripe + in,
                         .buf = r->buf + r->issued, .len = len, .write = r->write, .req = (int)(r - io->reqs) };
        r->issued += len;
        r->pending++;
        if (r->issued == r->bytes) {
            io->fifo_head = (io->fifo_head + 1) % DIO_REQS;
            io->fifo_n--;
            r->queued = 0;
        }
        return 1;
    }
    return 0;
}

int dio_fault(dio_xfer *x)
{
    if (td_fault_hit(TD_FAULT_DISK_NOSPC)) return ENOSPC;
    if (td_fault_hit(TD_FAULT_DISK_EIO)) return EIO;
    if (td_fault_hit(TD_FAULT_DISK_SHORT)) {
        x->starve = 1;
        return -1;
    }
    return 0;
}

static void xfer_message(td_dio *io, const dio_xfer *x, int err, char *msg, size_t n)
{
    (void)io;
    char len[32], moved[32];
    const struct dio_dir *d = &x->file->d[x->dir];
    const char *base = strrchr(d->data, '/') ? strrchr(d->data, '/') + 1 : d->data;
    const char *op = x->write ? "write" : "read";
    td_format_bytes(x->len, len, sizeof len);
    if (err < 0) {
        td_format_bytes(x->done, moved, sizeof moved);
        snprintf(msg, n, "disk %s failed in %s: %s of %s at byte %llu of %s moved, then none (a short %s: %s)", op,
                 d->dir, moved, len, (unsigned long long)x->off, base, op,
                 x->write ? "the disk is full or the device stopped taking data"
                          : "the file is shorter than tidal wrote it; did something truncate it?");
        return;
    }
    const char *hint = err == ENOSPC ? " (the disk is full: free space there, or give --offload-dir on a disk with room)"
                     : err == EIO    ? " (the drive reported an error: see the kernel log, dmesg)"
                     : err == EINVAL ? " (the filesystem refused the aligned transfer: it may not support O_DIRECT)"
                                     : "";
    snprintf(msg, n, "disk %s failed in %s: %s at byte %llu of %s: %s%s", op, d->dir, len,
             (unsigned long long)x->off, base, strerror(err), hint);
}

void dio_xfer_end(td_dio *io, dio_xfer *x, int err)
{
    char msg[512];
    if (err) xfer_message(io, x, err, msg, sizeof msg);
    pthread_mutex_lock(&io->lock);
    io->stats.transfers++;
    dio_req *r = &io->reqs[x->req];
    if (err) {
        if (r->st == TD_OK) {
            r->st = TD_ERR_IO;
            snprintf(r->msg, sizeof r->msg, "%s", msg);
        }
        if (io->failed == TD_OK) {
            io->failed = TD_ERR_IO;
            snprintf(io->failed_msg, sizeof io->failed_msg, "%s", msg);
        }
    } else if (x->write) {
        io->stats.bytes_written += x->len;
    } else {
        io->stats.bytes_read += x->len;
    }
    r->pending--;
    int ended = r->issued == r->bytes && r->pending == 0;
    if (ended) {
        r->ended = 1;
        io->active--;
        pthread_cond_broadcast(&io->ended);
    }
    void (*fn)(void *) = io->notify;
    void *ctx = io->notify_ctx;
    pthread_mutex_unlock(&io->lock);
    if (ended && fn) fn(ctx);
}

/* One transfer with pread/pwrite: continued while it moves something. */
static int run_xfer(td_dio *io, dio_xfer *x)
{
    int f = dio_fault(x);
    if (f > 0) return f;
    size_t stall = x->starve ? td_align_up(x->len / 2, TD_DIO_ALIGN) : SIZE_MAX; /* injected: half, then nothing */
    while (x->done < x->len) {
        if (x->done >= stall) return -1;
        size_t want = x->len - x->done;
        if (want > stall - x->done) want = stall - x->done;
        ssize_t n = x->write ? pwrite(x->fd, x->buf + x->done, want, (off_t)(x->off + x->done))
                             : pread(x->fd, x->buf + x->done, want, (off_t)(x->off + x->done));
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            return errno;
        }
        if (n == 0) return -1;
        if ((size_t)n < x->len - x->done && x->done + (size_t)n < stall) {
            pthread_mutex_lock(&io->lock);
            io->stats.partial++;
            pthread_mutex_unlock(&io->lock);
        }
        x->done += (size_t)n;
    }
    return 0;
}

static void *thread_main(void *arg)
{
    td_dio *io = arg;
    dio_xfer x;
    pthread_mutex_lock(&io->lock);
    for (;;) {
        int have = 0;
        while (!(have = dio_next_xfer(io, &x)) && !io->stop) pthread_cond_wait(&io->work, &io->lock);
        if (!have) break;
        pthread_mutex_unlock(&io->lock);
        int err = run_xfer(io, &x);
        dio_xfer_end(io, &x, err);
        pthread_mutex_lock(&io->lock);
    }
    pthread_mutex_unlock(&io->lock);
    return NULL;
}

static td_status start_threads(td_dio *io, const char *why_not_uring)
{
    int n = io->p.threads > 0 ? io->p.threads : 1;
    io->threads = td_calloc((size_t)n, sizeof *io->threads, TD_ROLE_META);
    if (!io->threads) return TD_ERR_NOMEM;
    for (int i = 0; i < n; i++) {
        int rc = pthread_create(&io->threads[i], NULL, thread_main, io);
        if (rc) return td_error_set(TD_ERR_NOMEM, "disk I/O: cannot start I/O thread %d of %d (%s)", i + 1, n, strerror(rc));
        io->n_threads++;
    }
    io->method = TD_DIO_THREADS;
    snprintf(io->describe, sizeof io->describe, "%d pread/pwrite thread%s%s%s%s", n, n == 1 ? "" : "s",
             why_not_uring ? " (io_uring: " : "", why_not_uring ? why_not_uring : "", why_not_uring ? ")" : "");
    return TD_OK;
}

td_status td_dio_create(const td_dio_params *params, td_dio **out)
{
    *out = NULL;
    td_dio_params p = params ? *params : td_dio_default_params();
    if (!p.piece_bytes) p.piece_bytes = td_dio_default_params().piece_bytes;
    if (p.piece_bytes % TD_DIO_ALIGN)
        return td_error_set(TD_ERR_INVALID, "disk I/O: piece of %zu bytes is not a multiple of %zu", p.piece_bytes,
                            TD_DIO_ALIGN);
    if (p.queue_depth < 1) p.queue_depth = td_dio_default_params().queue_depth;
    if (p.threads < 1) p.threads = td_dio_default_params().threads;
    td_dio *io = td_calloc(1, sizeof *io, TD_ROLE_META);
    if (!io) return TD_ERR_NOMEM;
    io->p = p;
    pthread_mutex_init(&io->lock, NULL);
    pthread_cond_init(&io->work, NULL);
    pthread_cond_init(&io->ended, NULL);
    td_status st = TD_OK;
    char why[200] = "";
    if (p.method != TD_DIO_THREADS) {
#ifdef TD_HAVE_URING
        st = dio_uring_start(io);
        if (st == TD_OK) {
            *out = io;
            return TD_OK;
        }
        snprintf(why, sizeof why, "%s", td_error_msg());
        td_error_clear();
#else
        st = TD_ERR_UNSUPPORTED;
        snprintf(why, sizeof why, "this build has no liburing (make URING=1 with liburing-dev installed)");
#endif
        if (p.method == TD_DIO_URING) {
            td_dio_destroy(io);
            return td_error_set(TD_ERR_UNSUPPORTED, "disk I/O: io_uring is not available: %s; use the threads method",
                                why);
        }
    }
    st = start_threads(io, why[0] ? why : NULL);
    if (st) {
        td_dio_destroy(io);
        return st;
    }
    *out = io;
    return TD_OK;
}

void td_dio_destroy(td_dio *io)
{
    if (!io) return;
    pthread_mutex_lock(&io->lock); /* every request ended (their failure, if any, is the caller's to have read) */
    while (io->active) pthread_cond_wait(&io->ended, &io->lock);
    io->stop = 1;
    pthread_cond_broadcast(&io->work);
    pthread_mutex_unlock(&io->lock);
    for (int i = 0; i < io->n_threads; i++) pthread_join(io->threads[i], NULL);
#ifdef TD_HAVE_URING
    if (io->uring) dio_uring_stop(io);
#endif
    td_free(io->threads);
    pthread_cond_destroy(&io->ended);
    pthread_cond_destroy(&io->work);
    pthread_mutex_destroy(&io->lock);
    td_free(io);
}

td_dio_method td_dio_get_method(const td_dio *io) { return io->method; }
const char *td_dio_describe(const td_dio *io) { return io->describe; }

void td_dio_set_notify(td_dio *io, void (*fn)(void *ctx), void *ctx)
{
    pthread_mutex_lock(&io->lock);
    io->notify = fn;
    io->notify_ctx = ctx;
    pthread_mutex_unlock(&io->lock);
}

void td_dio_get_stats(td_dio *io, td_dio_stats *out)
{
    pthread_mutex_lock(&io->lock);
    *out = io->stats;
    pthread_mutex_unlock(&io->lock);
}

static td_status submit(td_dio_file *f, size_t offset, void *buf, size_t bytes, int write, td_dio_ticket *t)
{
    t->seq = 0;
    if (!f) return td_error_set(TD_ERR_INVALID, "disk I/O: no file");
    td_dio *io = f->io;
    if (offset % TD_DIO_ALIGN || bytes % TD_DIO_ALIGN || (uintptr_t)buf % TD_DIO_ALIGN)
        return td_error_set(TD_ERR_INVALID, "disk I/O: %s of %zu bytes at %zu from %p: offset, length and buffer must "
                            "be multiples of %zu", write ? "write" : "read", bytes, offset, buf, TD_DIO_ALIGN);
    if (offset > f->bytes || bytes > f->bytes - offset)
        return td_error_set(TD_ERR_INVALID, "disk I/O: %s of bytes [%zu, %zu) past the end of a %zu-byte file",
                            write ? "write" : "read", offset, offset + bytes, f->bytes);
    if (!bytes) return TD_OK;
    pthread_mutex_lock(&io->lock);
    if (io->failed) {
        td_status st = td_error_set(io->failed, "%s", io->failed_msg);
        pthread_mutex_unlock(&io->lock);
        return st;
    }
    uint64_t seq = ++io->next_seq;
    int slot = (int)(seq % DIO_REQS);
    dio_req *r = &io->reqs[slot];
    while (r->seq && !r->ended) pthread_cond_wait(&io->ended, &io->lock); /* the slot's previous owner */
    *r = (dio_req){ .seq = seq, .file = f, .buf = buf, .off = offset, .bytes = bytes, .write = write, .queued = 1 };
    io->fifo[(io->fifo_head + io->fifo_n) % DIO_REQS] = slot;
    io->fifo_n++;
    io->active++;
    if (write) io->stats.writes++;
    else io->stats.reads++;
    pthread_cond_broadcast(&io->work);
    pthread_mutex_unlock(&io->lock);
    t->seq = seq;
    return TD_OK;
}

td_status td_dio_read(td_dio_file *f, size_t offset, void *buf, size_t bytes, td_dio_ticket *t)
{
    return submit(f, offset, buf, bytes, 0, t);
}

td_status td_dio_write(td_dio_file *f, size_t offset, const void *buf, size_t bytes, td_dio_ticket *t)
{
    return submit(f, offset, (void *)buf, bytes, 1, t);
}

/* io->lock held: whether ticket t ended, and its status (into msg). */
static int ticket_ended(td_dio *io, const td_dio_ticket *t, td_status *st, char *msg, size_t n)
{
    const dio_req *r = &io->reqs[t->seq % DIO_REQS];
    if (r->seq == t->seq && !r->ended) return 0;
    *st = io->failed;
    if (*st) snprintf(msg, n, "%s", io->failed_msg);
    else if (r->seq == t->seq && r->st) snprintf(msg, n, "%s", r->msg), *st = r->st;
    return 1;
}

td_status td_dio_wait(td_dio *io, const td_dio_ticket *t)
{
    if (!t || !t->seq) return TD_OK;
    td_status st = TD_OK;
    char msg[512];
    pthread_mutex_lock(&io->lock);
    while (!ticket_ended(io, t, &st, msg, sizeof msg)) pthread_cond_wait(&io->ended, &io->lock);
    pthread_mutex_unlock(&io->lock);
    return st ? td_error_set(st, "%s", msg) : TD_OK;
}

td_status td_dio_done(td_dio *io, const td_dio_ticket *t, int *done)
{
    *done = 1;
    if (!t || !t->seq) return TD_OK;
    td_status st = TD_OK;
    char msg[512];
    pthread_mutex_lock(&io->lock);
    *done = ticket_ended(io, t, &st, msg, sizeof msg);
    pthread_mutex_unlock(&io->lock);
    return st ? td_error_set(st, "%s", msg) : TD_OK;
}

td_status td_dio_drain(td_dio *io)
{
    pthread_mutex_lock(&io->lock);
    while (io->active) pthread_cond_wait(&io->ended, &io->lock);
    td_status st = io->failed;
    char msg[512];
    snprintf(msg, sizeof msg, "%s", io->failed_msg);
    pthread_mutex_unlock(&io->lock);
    return st ? td_error_set(st, "%s", msg) : TD_OK;
}

td_status td_dio_failed(td_dio *io)
{
    pthread_mutex_lock(&io->lock);
    td_status st = io->failed;
    char msg[512];
    snprintf(msg, sizeof msg, "%s", io->failed_msg);
    pthread_mutex_unlock(&io->lock);
    return st ? td_error_set(st, "%s", msg) : TD_OK;
}

/* ---- the lock files' registry, for a signal handler ------------------------------ */

#define DIO_REG 64
static char reg_path[DIO_REG][600];
static volatile sig_atomic_t reg_live[DIO_REG];
static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;

static int reg_add(const char *path)
{
    pthread_mutex_lock(&reg_lock);
    int slot = -1;
    for (int i = 0; i < DIO_REG && slot < 0; i++)
        if (!reg_live[i]) slot = i;
    if (slot >= 0) {
        snprintf(reg_path[slot], sizeof reg_path[slot], "%s", path);
        reg_live[slot] = 1;
    }
    pthread_mutex_unlock(&reg_lock);
    return slot;
}

static void reg_drop(int slot)
{
    if (slot < 0) return;
    pthread_mutex_lock(&reg_lock);
    reg_live[slot] = 0;
    pthread_mutex_unlock(&reg_lock);
}

void td_dio_signal_cleanup(void)
{
    for (int i = 0; i < DIO_REG; i++)
        if (reg_live[i]) unlink(reg_path[i]);
}

/* ---- directories ------------------------------------------------------------------ */

static void fs_name(long type, char *out, size_t n)
{
    static const struct { unsigned long magic; const char *name; } fs[] = {
        {0xEF53, "ext4"}, {0x58465342, "xfs"}, {0x9123683E, "btrfs"}, {0x01021994, "tmpfs"}, {0x858458F6, "ramfs"},
        {0x6969, "nfs"}, {0x794C7630, "overlayfs"}, {0xF2F52010, "f2fs"}, {0x2FC12FC1, "zfs"}, {0x65735546, "fuse"},
        {0x5346544E, "ntfs"}, {0x4D44, "vfat"}, {0xFF534D42, "cifs"}, {0x73717368, "squashfs"},
    };
    for (size_t i = 0; i < sizeof fs / sizeof fs[0]; i++)
        if ((unsigned long)type == fs[i].magic) { snprintf(out, n, "%s", fs[i].name); return; }
    snprintf(out, n, "0x%lx", (unsigned long)type);
}

static int fs_in_ram(const char *fs) { return !strcmp(fs, "tmpfs") || !strcmp(fs, "ramfs"); }

/* Opens `path` read-write with O_DIRECT (mode 2: or fails; 1: else
 * buffered; 0: buffered); *direct says which.  The fd `plain` is the
 * file's, already open without O_DIRECT. */
static td_status open_direct(const char *dir, const char *path, int plain, int mode, int *fd, int *direct)
{
    *direct = 0;
    *fd = -1;
    if (mode > 0) {
        int f = td_fault_hit(TD_FAULT_DISK_NODIRECT) ? (errno = EINVAL, -1) : open(path, O_RDWR | O_DIRECT);
        if (f >= 0) {
            *fd = f;
            *direct = 1;
            return TD_OK;
        }
        if (errno != EINVAL || mode == 2)
            return td_error_set(TD_ERR_IO, "%s: cannot open a scratch file with O_DIRECT: %s%s", dir, strerror(errno),
                                errno == EINVAL ? " (the filesystem does not support direct I/O; give a directory "
                                                  "on a local disk, or allow buffered I/O)" : "");
    }
    *fd = dup(plain);
    if (*fd < 0) return td_error_set(TD_ERR_IO, "%s: %s", dir, strerror(errno));
    return TD_OK;
}

td_status td_dio_dir_free(const char *dir, size_t *free_bytes)
{
    struct statvfs vs;
    struct stat sb;
    *free_bytes = 0;
    if (stat(dir, &sb) != 0)
        return td_error_set(TD_ERR_IO, "%s: %s (the offload directory must exist)", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode)) return td_error_set(TD_ERR_INVALID, "%s is not a directory", dir);
    if (statvfs(dir, &vs) != 0) return td_error_set(TD_ERR_IO, "%s: cannot read its free space: %s", dir, strerror(errno));
    *free_bytes = (size_t)vs.f_bavail * vs.f_frsize;
    return TD_OK;
}

td_status td_dio_dir_info_get(const char *dir, td_dio_dir_info *out)
{
    memset(out, 0, sizeof *out);
    struct statvfs vs;
    struct statfs fs;
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return td_error_set(TD_ERR_IO, "%s: %s (the offload directory must exist)", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode)) return td_error_set(TD_ERR_INVALID, "%s is not a directory", dir);
    if (statvfs(dir, &vs) != 0 || statfs(dir, &fs) != 0)
        return td_error_set(TD_ERR_IO, "%s: cannot read its filesystem's figures: %s", dir, strerror(errno));
    out->free_bytes = (size_t)vs.f_bavail * vs.f_frsize;
    out->total_bytes = (size_t)vs.f_blocks * vs.f_frsize;
    fs_name((long)fs.f_type, out->fs, sizeof out->fs);
    out->in_ram = fs_in_ram(out->fs);
    char path[600];
    snprintf(path, sizeof path, "%s/.tidal-probe-%d-XXXXXX", dir, (int)getpid());
    int plain = mkstemp(path);
    if (plain < 0)
        return td_error_set(TD_ERR_IO, "%s: cannot make a file there: %s (the offload directory must be writable)", dir,
                            strerror(errno));
    int fd, direct;
    td_status st = open_direct(dir, path, plain, 1, &fd, &direct);
    unlink(path);
    close(plain);
    if (fd >= 0) close(fd);
    out->direct = direct;
    return st;
}

/* ---- scratch files ----------------------------------------------------------------- */

static void host_name(char *out, size_t n)
{
    if (gethostname(out, n - 1) != 0) snprintf(out, n, "unknown");
    out[n - 1] = 0;
    for (char *c = out; *c; c++)
        if (*c == '/' || *c == ' ') *c = '_';
}

/* Lock files in `dir` whose flock is free were left by runs that ended
 * without removing them: removed (with the data file of the same stem, if
 * a crash left it named), each said in notes; one from another host is
 * refused. */
static td_status reclaim(const char *dir, const char *host, char *notes, size_t n)
{
    DIR *dh = opendir(dir);
    if (!dh) return td_error_set(TD_ERR_IO, "%s: cannot list it: %s", dir, strerror(errno));
    td_status st = TD_OK;
    struct dirent *e;
    while (!st && (e = readdir(dh))) {
        size_t len = strlen(e->d_name);
        if (strncmp(e->d_name, "tidal-", 6) || len < 11 || strcmp(e->d_name + len - 5, ".lock")) continue;
        char path[1200];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        int fd = open(path, O_RDWR);
        if (fd < 0) continue;
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) { /* a live run's */
            close(fd);
            continue;
        }
        char text[1024] = "", owner[256] = "?", started[64] = "?";
        int pid = 0;
        ssize_t got = pread(fd, text, sizeof text - 1, 0);
        if (got > 0) text[got] = 0;
        char *save = NULL;
        for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
            if (!strncmp(line, "host ", 5)) snprintf(owner, sizeof owner, "%s", line + 5);
            else if (!strncmp(line, "pid ", 4)) pid = atoi(line + 4);
            else if (!strncmp(line, "started ", 8)) snprintf(started, sizeof started, "%s", line + 8);
        }
        if (strcmp(owner, host) != 0) {
            st = td_error_set(TD_ERR_STATE, "%s holds %s, the scratch lock of a tidal run on host %s (pid %d, started "
                              "%s); from %s it cannot be told whether that run still goes on.  If it has ended, remove "
                              "the file; or give another --offload-dir", dir, e->d_name, owner, pid, started, host);
        } else {
            char data[1200];
            snprintf(data, sizeof data, "%.*s.data", (int)(strlen(path) - 5), path);
            unlink(data); /* named only if its run died between making and unlinking it */
            unlink(path);
            size_t used = strlen(notes);
            snprintf(notes + used, n > used ? n - used : 0, "%sremoved %s, the scratch lock of pid %d (started %s), "
                     "which ended without removing it; its scratch space was freed when it ended",
                     used ? "\n" : "", path, pid, started);
        }
        close(fd);
    }
    closedir(dh);
    return st;
}

/* The lock file: made under a temporary name, flocked and filled, then
 * renamed into place, so that no other run ever sees it unlocked. */
static td_status make_lock(struct dio_dir *d, const char *stem, const char *host, size_t bytes)
{
    char tmp[700];
    snprintf(tmp, sizeof tmp, "%s/.%s.lock-new", d->dir, stem);
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return td_error_set(TD_ERR_IO, "%s: cannot make a lock file there: %s", d->dir, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        close(fd);
        unlink(tmp);
        return td_error_set(TD_ERR_IO, "%s: cannot lock %s: %s", d->dir, tmp, strerror(errno));
    }
    char text[512], when[64];
    time_t now = time(NULL);
    struct tm tm;
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", localtime_r(&now, &tm));
    int len = snprintf(text, sizeof text, "tidal scratch lock: the run below holds a scratch file here (unnamed)\n"
                       "pid %d\nhost %s\nstarted %s\nbytes %zu\n", (int)getpid(), host, when, bytes);
    if (write(fd, text, (size_t)len) != len || rename(tmp, d->lock) != 0) {
        int err = errno;
        close(fd);
        unlink(tmp);
        return td_error_set(TD_ERR_IO, "%s: cannot write its lock file: %s", d->dir, strerror(err));
    }
    d->lock_fd = fd;
    d->reg = reg_add(d->lock);
    return TD_OK;
}

static td_status no_room(const struct dio_dir *d, size_t want, int err)
{
    char need[32], have[32];
    td_dio_dir_info info;
    size_t free_b = td_dio_dir_info_get(d->dir, &info) == TD_OK ? info.free_bytes : 0;
    td_error_clear();
    return td_error_set(TD_ERR_IO, "%s: cannot reserve %s for the scratch file: %s (%s free there); free space, give "
                        "another --offload-dir beside it, or keep more in RAM (--host-ram)", d->dir,
                        td_format_bytes(want, need, sizeof need), strerror(err),
                        td_format_bytes(free_b, have, sizeof have));
}

/* The data file of one directory: made named, opened direct, unlinked, preallocated. */
static td_status make_data(struct dio_dir *d, size_t bytes, int mode)
{
    int plain = open(d->data, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (plain < 0) return td_error_set(TD_ERR_IO, "%s: cannot make the scratch file: %s", d->dir, strerror(errno));
    td_status st = open_direct(d->dir, d->data, plain, mode, &d->fd, &d->direct);
    unlink(d->data); /* no name from here on: the space goes back when the process ends */
    if (st) {
        close(plain);
        return st;
    }
    int err = td_fault_hit(TD_FAULT_DISK_NOSPC) ? ENOSPC : 0;
    if (!err && fallocate(plain, 0, 0, (off_t)bytes) != 0) {
        err = errno;
        if (err == EOPNOTSUPP || err == ENOSYS) err = posix_fallocate(plain, 0, (off_t)bytes);
    }
    close(plain);
    return err ? no_room(d, bytes, err) : TD_OK;
}

td_status td_dio_file_create(td_dio *io, const char *const *dirs, int n_dirs, size_t bytes,
                             const td_dio_file_params *params, td_dio_file **out)
{
    *out = NULL;
    td_dio_file_params p = params ? *params : td_dio_file_default_params();
    if (!p.stripe_bytes) p.stripe_bytes = td_dio_file_default_params().stripe_bytes;
    if (n_dirs < 1 || n_dirs > DIO_MAX_DIRS)
        return td_error_set(TD_ERR_INVALID, "disk I/O: %d directories (1 to %d)", n_dirs, DIO_MAX_DIRS);
    if (p.stripe_bytes % TD_DIO_ALIGN)
        return td_error_set(TD_ERR_INVALID, "disk I/O: stripe of %zu bytes is not a multiple of %zu", p.stripe_bytes,
                            TD_DIO_ALIGN);
    struct stat seen[DIO_MAX_DIRS];
    for (int i = 0; i < n_dirs; i++) {
        if (!dirs[i] || !dirs[i][0]) return td_error_set(TD_ERR_INVALID, "disk I/O: an empty directory name");
        if (stat(dirs[i], &seen[i]) != 0)
            return td_error_set(TD_ERR_IO, "--offload-dir %s: %s (the directory must exist)", dirs[i], strerror(errno));
        if (!S_ISDIR(seen[i].st_mode)) return td_error_set(TD_ERR_INVALID, "--offload-dir %s is not a directory", dirs[i]);
        if (access(dirs[i], W_OK | X_OK) != 0)
            return td_error_set(TD_ERR_IO, "--offload-dir %s: %s (the directory must be writable)", dirs[i],
                                strerror(errno));
        for (int j = 0; j < i; j++)
            if (seen[j].st_dev == seen[i].st_dev && seen[j].st_ino == seen[i].st_ino)
                return td_error_set(TD_ERR_INVALID, "--offload-dir %s and %s are the same directory; give each once",
                                    dirs[j], dirs[i]);
    }
    td_dio_file *f = td_calloc(1, sizeof *f, TD_ROLE_META);
    if (!f) return TD_ERR_NOMEM;
    f->io = io;
    f->n = n_dirs;
    f->stripe = p.stripe_bytes;
    size_t stripes = (bytes + f->stripe - 1) / f->stripe;
    if (!stripes) stripes = 1;
    f->per_dir = (stripes + (size_t)n_dirs - 1) / (size_t)n_dirs * f->stripe;
    f->bytes = f->per_dir * (size_t)n_dirs;
    for (int i = 0; i < DIO_MAX_DIRS; i++) f->d[i].fd = f->d[i].lock_fd = f->d[i].reg = -1;
    static int counter;
    static pthread_mutex_t counter_lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&counter_lock);
    int serial = counter++;
    pthread_mutex_unlock(&counter_lock);
    char host[128], stem[300];
    host_name(host, sizeof host);
    snprintf(stem, sizeof stem, "tidal-%s-%d-%d", host, (int)getpid(), serial);
    td_status st = TD_OK;
    size_t at = 0;
    for (int i = 0; i < n_dirs; i++) {
        struct dio_dir *d = &f->d[i];
        char dir[sizeof d->dir];
        snprintf(dir, sizeof dir, "%s", dirs[i]);
        size_t dl = strlen(dir);
        while (dl > 1 && dir[dl - 1] == '/') dir[--dl] = 0;
        memcpy(d->dir, dir, dl + 1);
        /* a name cut short would be another file's: refuse it */
        int nl = snprintf(d->lock, sizeof d->lock, "%s/%s.lock", dir, stem);
        int nd = snprintf(d->data, sizeof d->data, "%s/%s.data", dir, stem);
        if (strlen(dirs[i]) >= sizeof dir || nl < 0 || (size_t)nl >= sizeof d->lock || nd < 0 ||
            (size_t)nd >= sizeof d->data) {
            d->lock[0] = d->data[0] = 0;
            size_t most = sizeof d->lock - strlen(stem) - sizeof "/.lock";
            if (most > sizeof dir - 1) most = sizeof dir - 1;
            st = td_error_set(TD_ERR_INVALID, "--offload-dir %s: the path is too long (at most %zu bytes here)",
                              dirs[i], most);
            goto cleanup;
        }
        struct statfs fs;
        if (statfs(d->dir, &fs) == 0) fs_name((long)fs.f_type, d->fs, sizeof d->fs);
        TD_TRY(reclaim(d->dir, host, f->notes, sizeof f->notes));
        TD_TRY(make_lock(d, stem, host, f->per_dir));
        TD_TRY(make_data(d, f->per_dir, p.direct));
        char sz[32];
        at += (size_t)snprintf(f->describe + at, sizeof f->describe - at, "%s%s: %s, %s, %s", i ? "\n" : "", d->dir,
                               td_format_bytes(f->per_dir, sz, sizeof sz), d->fs,
                               d->direct ? "O_DIRECT"
                                         : p.direct ? "through the page cache (the filesystem refuses O_DIRECT)"
                                                    : "through the page cache (buffered I/O asked)");
        if (fs_in_ram(d->fs) && at < sizeof f->describe)
            at += (size_t)snprintf(f->describe + at, sizeof f->describe - at, "; %s is memory: its files take host RAM",
                                   d->fs);
    }
    *out = f;
    return TD_OK;
cleanup:
    td_dio_file_close(f);
    return st;
}

void td_dio_file_close(td_dio_file *f)
{
    if (!f) return;
    for (int i = 0; i < f->n; i++) {
        struct dio_dir *d = &f->d[i];
        if (d->fd >= 0) close(d->fd);
        if (d->lock_fd >= 0) {
            reg_drop(d->reg);
            unlink(d->lock);
            close(d->lock_fd);
        }
    }
    td_free(f);
}

size_t td_dio_file_bytes(const td_dio_file *f) { return f->bytes; }
const char *td_dio_file_describe(const td_dio_file *f) { return f->describe; }
const char *td_dio_file_notes(const td_dio_file *f) { return f->notes; }

int td_dio_file_direct(const td_dio_file *f)
{
    for (int i = 0; i < f->n; i++)
        if (!f->d[i].direct) return 0;
    return 1;
}
