/* The disk I/O engine (diskio.h): data written striped over directories
 * reads back exactly, with either back end (io_uring when built with it,
 * pread/pwrite threads); many requests in flight; alignment and range
 * errors; every injected fault (ENOSPC, EIO, short transfers, a
 * filesystem without O_DIRECT) a clear error naming the directory, sticky,
 * with nothing leaked; lock files made and removed, those of ended runs
 * reclaimed, another host's refused; a full disk refused when the file is
 * made. */
#include "td_test.h"
#include "tidal/diskio.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct fixture {
    char root[256];
    char dir[3][300];
    const char *dirs[3];
} fixture;

static void fixture_make(fixture *f)
{
    snprintf(f->root, sizeof f->root, "/tmp/td_diskio_XXXXXX");
    assert_non_null(mkdtemp(f->root));
    char root[sizeof f->root]; /* a copy: GCC -O1 -Wrestrict sees f->root and f->dir in one object */
    memcpy(root, f->root, sizeof root);
    for (int i = 0; i < 3; i++) {
        snprintf(f->dir[i], sizeof f->dir[i], "%s/d%d", root, i);
        assert_int_equal(mkdir(f->dir[i], 0700), 0);
        f->dirs[i] = f->dir[i];
    }
}

/* Entries in a directory whose names start with `prefix`. */
static int count_files(const char *dir, const char *prefix)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, prefix, strlen(prefix))) n++;
    closedir(d);
    return n;
}

static void fixture_free(fixture *f)
{
    for (int i = 0; i < 3; i++) {
        assert_int_equal(count_files(f->dir[i], "tidal-"), 0); /* nothing left behind */
        assert_int_equal(count_files(f->dir[i], ".tidal"), 0);
        assert_int_equal(rmdir(f->dir[i]), 0);
    }
    assert_int_equal(rmdir(f->root), 0);
}

static void *aligned(size_t bytes)
{
    void *p = NULL;
    assert_int_equal(posix_memalign(&p, TD_DIO_ALIGN, bytes), 0);
    return p;
}

static void fill(unsigned char *p, size_t n, uint64_t seed)
{
    td_rng r;
    td_rng_seed(&r, seed);
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v = td_rng_next(&r);
        memcpy(p + i, &v, n - i < 8 ? n - i : 8);
    }
}

static int methods(td_dio_method out[2])
{
    int n = 0;
    out[n++] = TD_DIO_THREADS;
    if (td_dio_uring_compiled()) {
        td_dio *io;
        td_dio_params p = td_dio_default_params();
        p.method = TD_DIO_URING;
        if (td_dio_create(&p, &io) == TD_OK) {
            td_dio_destroy(io);
            out[n++] = TD_DIO_URING;
        } else {
            print_message("io_uring unavailable here (%s): threads only\n", td_error_msg());
        }
    }
    return n;
}

static td_dio *make_io(td_dio_method m, size_t piece)
{
    td_dio_params p = td_dio_default_params();
    p.method = m;
    p.piece_bytes = piece;
    p.threads = 3;
    p.queue_depth = 8;
    td_dio *io;
    TD_ASSERT_OK(td_dio_create(&p, &io));
    assert_int_equal(td_dio_get_method(io), m);
    return io;
}

static int notified;
static void count_notify(void *ctx) { __atomic_add_fetch((int *)ctx, 1, __ATOMIC_RELAXED); }

/* Random aligned ranges written (many in flight), read back in other
 * pieces, over 1, 2 and 3 directories with stripes smaller than the
 * requests; unwritten bytes read as zeros. */
static void test_diskio_round_trip(void **state)
{
    fixture f;
    fixture_make(&f);
    td_dio_method ms[2];
    int nm = methods(ms);
    size_t live = td_host_live_allocs();
    for (int mi = 0; mi < nm; mi++)
        for (int nd = 1; nd <= 3; nd++) {
            td_dio *io = make_io(ms[mi], 16 * 1024);
            notified = 0;
            td_dio_set_notify(io, count_notify, &notified);
            td_dio_file_params fp = td_dio_file_default_params();
            fp.stripe_bytes = 64 * 1024;
            size_t bytes = 3 * TD_MiB + 12345;
            td_dio_file *file;
            TD_ASSERT_OK(td_dio_file_create(io, f.dirs, nd, bytes, &fp, &file));
            assert_true(td_dio_file_bytes(file) >= bytes);
            assert_int_equal(td_dio_file_bytes(file) % (fp.stripe_bytes * (size_t)nd), 0);
            for (int i = 0; i < nd; i++) assert_int_equal(count_files(f.dir[i], "tidal-"), 1); /* the lock alone */
            size_t n = td_dio_file_bytes(file);
            unsigned char *want = aligned(n), *got = aligned(n);
            memset(want, 0, n);
            /* Fresh: zeros. */
            memset(got, 0xAB, n);
            td_dio_ticket t;
            TD_ASSERT_OK(td_dio_read(file, 0, got, n, &t));
            TD_ASSERT_OK(td_dio_wait(io, &t));
            assert_memory_equal(got, want, n);
            /* Writes of random aligned ranges, 40 in flight, the last write of a byte wins
             * (they are waited for in order before the next overlapping round). */
            td_rng r;
            td_rng_seed(&r, 77 + (uint64_t)nd);
            for (int round = 0; round < 3; round++) {
                td_dio_ticket tk[40];
                size_t pos = 0;
                int k = 0;
                while (k < 40 && pos < n) { /* disjoint ranges in one round */
                    size_t len = (1 + td_rng_below(&r, 40)) * TD_DIO_ALIGN;
                    if (len > n - pos) len = n - pos;
                    fill(want + pos, len, (uint64_t)round * 1000 + (uint64_t)k);
                    TD_ASSERT_OK(td_dio_write(file, pos, want + pos, len, &tk[k]));
                    pos += len + td_rng_below(&r, 8) * TD_DIO_ALIGN;
                    k++;
                }
                for (int i = 0; i < k; i++) TD_ASSERT_OK(td_dio_wait(io, &tk[i]));
            }
            /* Read back in pieces of another size, in reverse. */
            memset(got, 0, n);
            size_t piece = 5 * TD_DIO_ALIGN;
            td_dio_ticket rt[1024];
            int nr = 0;
            for (size_t pos = 0; pos < n; pos += piece) {
                size_t len = n - pos < piece ? n - pos : piece;
                TD_ASSERT_OK(td_dio_read(file, n - pos - len, got + n - pos - len, len, &rt[nr++]));
            }
            TD_ASSERT_OK(td_dio_drain(io));
            assert_memory_equal(got, want, n);
            td_dio_stats s;
            td_dio_get_stats(io, &s);
            assert_int_equal(s.bytes_read, 2 * n);
            assert_true(s.writes >= 40);
            assert_true(s.transfers >= s.reads + s.writes);
            /* each request's notice comes just after its end is visible: wait for the last */
            double t0 = td_now_ms();
            while ((uint64_t)__atomic_load_n(&notified, __ATOMIC_RELAXED) < s.reads + s.writes && td_now_ms() - t0 < 2000)
                td_sleep_us(100);
            assert_int_equal((uint64_t)notified, s.reads + s.writes);
            td_dio_file_close(file);
            td_dio_destroy(io);
            free(want);
            free(got);
        }
    assert_int_equal(td_host_live_allocs(), live);
    fixture_free(&f);
}

/* More requests than the engine's table (256) in flight: each waits for
 * its slot; every one completes with its own bytes. */
static void test_diskio_many_requests(void **state)
{
    fixture f;
    fixture_make(&f);
    td_dio_method ms[2];
    int nm = methods(ms);
    for (int mi = 0; mi < nm; mi++) {
        td_dio *io = make_io(ms[mi], TD_DIO_ALIGN);
        td_dio_file *file;
        size_t n = 700 * TD_DIO_ALIGN;
        TD_ASSERT_OK(td_dio_file_create(io, f.dirs, 2, n, NULL, &file));
        unsigned char *want = aligned(n), *got = aligned(n);
        fill(want, n, 5);
        td_dio_ticket t[700];
        for (int i = 0; i < 700; i++)
            TD_ASSERT_OK(td_dio_write(file, (size_t)i * TD_DIO_ALIGN, want + (size_t)i * TD_DIO_ALIGN, TD_DIO_ALIGN, &t[i]));
        for (int i = 0; i < 700; i++) TD_ASSERT_OK(td_dio_wait(io, &t[i])); /* old tickets read as done */
        TD_ASSERT_OK(td_dio_read(file, 0, got, n, &t[0]));
        int done = 0;
        while (!done) TD_ASSERT_OK(td_dio_done(io, &t[0], &done));
        assert_memory_equal(got, want, n);
        td_dio_file_close(file);
        td_dio_destroy(io);
        free(want);
        free(got);
    }
    fixture_free(&f);
}

static void test_diskio_bad_requests(void **state)
{
    fixture f;
    fixture_make(&f);
    td_dio *io = make_io(TD_DIO_THREADS, TD_MiB);
    td_dio_file *file;
    TD_ASSERT_OK(td_dio_file_create(io, f.dirs, 1, TD_MiB, NULL, &file));
    unsigned char *buf = aligned(2 * TD_MiB);
    td_dio_ticket t;
    assert_int_equal(td_dio_read(file, 100, buf, TD_DIO_ALIGN, &t), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "multiples of 4096"));
    assert_int_equal(td_dio_read(file, 0, buf + 1, TD_DIO_ALIGN, &t), TD_ERR_INVALID);
    assert_int_equal(td_dio_write(file, 0, buf, 100, &t), TD_ERR_INVALID);
    assert_int_equal(td_dio_read(file, td_dio_file_bytes(file), buf, TD_DIO_ALIGN, &t), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "past the end"));
    TD_ASSERT_OK(td_dio_read(file, 0, buf, 0, &t)); /* nothing to do: a complete ticket */
    TD_ASSERT_OK(td_dio_wait(io, &t));
    /* The same directory twice, a missing one, a file given as a directory. */
    td_dio_file *g;
    const char *twice[2] = {f.dir[0], f.dir[0]};
    assert_int_equal(td_dio_file_create(io, twice, 2, TD_MiB, NULL, &g), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "same directory"));
    const char *missing[1] = {"/nonexistent/td_diskio"};
    assert_int_equal(td_dio_file_create(io, missing, 1, TD_MiB, NULL, &g), TD_ERR_IO);
    assert_non_null(strstr(td_error_msg(), "/nonexistent/td_diskio"));
    /* A directory whose path leaves no room for the file names: refused by
     * name, nothing created in it (a name cut short would be another file). */
    char deep[700];
    int dl = snprintf(deep, sizeof deep, "%s", f.dir[0]), levels = 0;
    while (dl < 560) {
        dl += snprintf(deep + dl, sizeof deep - (size_t)dl, "/%s", "a123456789012345678901234567890123456789");
        assert_int_equal(mkdir(deep, 0700), 0);
        levels++;
    }
    const char *too_long[1] = {deep};
    assert_int_equal(td_dio_file_create(io, too_long, 1, TD_MiB, NULL, &g), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "too long"));
    assert_int_equal(count_files(deep, "tidal-"), 0);
    assert_int_equal(count_files(deep, ".tidal"), 0);
    for (; levels > 0; levels--) {
        assert_int_equal(rmdir(deep), 0);
        *strrchr(deep, '/') = 0;
    }
    td_dio_params p = td_dio_default_params();
    p.piece_bytes = 1000;
    td_dio *bad;
    assert_int_equal(td_dio_create(&p, &bad), TD_ERR_INVALID);
    td_dio_method m;
    assert_int_equal(td_dio_method_parse("aio", &m), TD_ERR_INVALID);
    TD_ASSERT_OK(td_dio_method_parse("io_uring", &m));
    assert_int_equal(m, TD_DIO_URING);
    td_dio_file_close(file);
    td_dio_destroy(io);
    free(buf);
    fixture_free(&f);
}

/* Each injected transfer fault fails its request with a message naming the
 * directory and the cause; the engine stays failed (the next request and
 * wait say so); destroying it frees everything. */
static void test_diskio_faults(void **state)
{
    fixture f;
    fixture_make(&f);
    td_dio_method ms[2];
    int nm = methods(ms);
    struct { td_fault_kind kind; const char *says; } faults[] = {
        {TD_FAULT_DISK_NOSPC, "No space left on device"},
        {TD_FAULT_DISK_EIO, "Input/output error"},
        {TD_FAULT_DISK_SHORT, "short"},
    };
    size_t live = td_host_live_allocs();
    unsigned char *buf = aligned(TD_MiB);
    fill(buf, TD_MiB, 3);
    for (int mi = 0; mi < nm; mi++)
        for (size_t fi = 0; fi < sizeof faults / sizeof faults[0]; fi++)
            for (int write = 0; write < 2; write++)
                for (int nth = 1; nth <= 3; nth++) {
                    td_dio *io = make_io(ms[mi], 64 * 1024);
                    td_dio_file *file;
                    TD_ASSERT_OK(td_dio_file_create(io, f.dirs, 2, TD_MiB, NULL, &file));
                    td_fault_arm(faults[fi].kind, nth);
                    td_dio_ticket t;
                    TD_ASSERT_OK(write ? td_dio_write(file, 0, buf, TD_MiB, &t) : td_dio_read(file, 0, buf, TD_MiB, &t));
                    assert_int_equal(td_dio_wait(io, &t), TD_ERR_IO);
                    td_fault_disarm_all();
                    const char *msg = td_error_msg();
                    assert_non_null(strstr(msg, faults[fi].says));
                    assert_non_null(strstr(msg, write ? "disk write failed" : "disk read failed"));
                    assert_true(strstr(msg, f.dir[0]) || strstr(msg, f.dir[1])); /* the directory */
                    if (faults[fi].kind == TD_FAULT_DISK_NOSPC) assert_non_null(strstr(msg, "disk is full"));
                    /* sticky */
                    assert_int_equal(td_dio_read(file, 0, buf, TD_DIO_ALIGN, &t), TD_ERR_IO);
                    assert_non_null(strstr(td_error_msg(), faults[fi].says));
                    assert_int_equal(td_dio_drain(io), TD_ERR_IO);
                    td_dio_file_close(file);
                    td_dio_destroy(io);
                    if (!write) fill(buf, TD_MiB, 3); /* a failed read may have written part of it */
                }
    assert_int_equal(td_host_live_allocs(), live);
    free(buf);
    fixture_free(&f);
}

/* A disk without room for the file: refused when it is made, naming the
 * directory and the free space, nothing left behind; a filesystem without
 * O_DIRECT: buffered by default (said), an error when direct is required. */
static void test_diskio_create_faults(void **state)
{
    fixture f;
    fixture_make(&f);
    td_dio *io = make_io(TD_DIO_THREADS, TD_MiB);
    td_dio_file *file;
    td_fault_arm(TD_FAULT_DISK_NOSPC, 2); /* the second directory's preallocation */
    assert_int_equal(td_dio_file_create(io, f.dirs, 3, 8 * TD_MiB, NULL, &file), TD_ERR_IO);
    td_fault_disarm_all();
    assert_non_null(strstr(td_error_msg(), f.dir[1]));
    assert_non_null(strstr(td_error_msg(), "free there"));
    assert_non_null(strstr(td_error_msg(), "No space left"));
    for (int i = 0; i < 3; i++) assert_int_equal(count_files(f.dir[i], "tidal-"), 0);

    td_fault_arm(TD_FAULT_DISK_NODIRECT, 1);
    TD_ASSERT_OK(td_dio_file_create(io, f.dirs, 2, TD_MiB, NULL, &file));
    td_fault_disarm_all();
    assert_false(td_dio_file_direct(file));
    assert_non_null(strstr(td_dio_file_describe(file), "page cache"));
    unsigned char *buf = aligned(TD_MiB), *back = aligned(TD_MiB);
    fill(buf, TD_MiB, 9);
    td_dio_ticket t;
    TD_ASSERT_OK(td_dio_write(file, 0, buf, TD_MiB, &t));
    TD_ASSERT_OK(td_dio_wait(io, &t));
    TD_ASSERT_OK(td_dio_read(file, 0, back, TD_MiB, &t));
    TD_ASSERT_OK(td_dio_wait(io, &t));
    assert_memory_equal(buf, back, TD_MiB);
    td_dio_file_close(file);

    td_dio_file_params fp = td_dio_file_default_params();
    fp.direct = 2;
    td_fault_arm(TD_FAULT_DISK_NODIRECT, 1);
    assert_int_equal(td_dio_file_create(io, f.dirs, 1, TD_MiB, &fp, &file), TD_ERR_IO);
    td_fault_disarm_all();
    assert_non_null(strstr(td_error_msg(), "O_DIRECT"));
    assert_non_null(strstr(td_error_msg(), f.dir[0]));
    td_dio_dir_info info;
    TD_ASSERT_OK(td_dio_dir_info_get(f.dir[0], &info));
    assert_true(info.free_bytes > 0 && info.total_bytes >= info.free_bytes);
    assert_true(info.fs[0] != 0);
    assert_int_equal(td_dio_dir_info_get("/nonexistent/x", &info), TD_ERR_IO);
    td_dio_destroy(io);
    free(buf);
    free(back);
    fixture_free(&f);
}

static void write_lock(const char *dir, const char *name, const char *host, int pid)
{
    char path[700];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    fprintf(fp, "tidal scratch lock\npid %d\nhost %s\nstarted 2026-01-01T00:00:00\nbytes 4096\n", pid, host);
    fclose(fp);
}

/* Lock files: one per directory while a file is open, gone after close or
 * after the signal cleanup; an ended run's lock is reclaimed with a note;
 * another host's is refused; a live one (this process's) is left alone. */
static void test_diskio_locks(void **state)
{
    fixture f;
    fixture_make(&f);
    td_dio *io = make_io(TD_DIO_THREADS, TD_MiB);
    char host[128];
    gethostname(host, sizeof host);
    write_lock(f.dir[0], "tidal-old-4242-0.lock", host, 4242);
    write_lock(f.dir[0], "tidal-old-4242-0.data", host, 4242); /* a named leftover data file */
    td_dio_file *a, *b;
    TD_ASSERT_OK(td_dio_file_create(io, f.dirs, 2, TD_MiB, NULL, &a));
    assert_non_null(strstr(td_dio_file_notes(a), "tidal-old-4242-0.lock"));
    assert_non_null(strstr(td_dio_file_notes(a), "pid 4242"));
    assert_int_equal(count_files(f.dir[0], "tidal-old"), 0);
    assert_int_equal(count_files(f.dir[0], "tidal-"), 1);
    /* A second file in the same directories beside the first: both live. */
    TD_ASSERT_OK(td_dio_file_create(io, f.dirs, 2, TD_MiB, NULL, &b));
    assert_string_equal(td_dio_file_notes(b), "");
    assert_int_equal(count_files(f.dir[0], "tidal-"), 2);
    assert_int_equal(count_files(f.dir[1], "tidal-"), 2);
    td_dio_file_close(b);
    assert_int_equal(count_files(f.dir[1], "tidal-"), 1);
    /* The signal handler's cleanup: the lock files go, the file still works. */
    td_dio_signal_cleanup();
    assert_int_equal(count_files(f.dir[0], "tidal-"), 0);
    unsigned char *buf = aligned(TD_DIO_ALIGN);
    td_dio_ticket t;
    TD_ASSERT_OK(td_dio_read(a, 0, buf, TD_DIO_ALIGN, &t));
    TD_ASSERT_OK(td_dio_wait(io, &t));
    td_dio_file_close(a);
    /* Another host's lock: refused, naming it. */
    write_lock(f.dir[2], "tidal-far-7-0.lock", "another-host.example", 7);
    assert_int_equal(td_dio_file_create(io, f.dirs + 1, 2, TD_MiB, NULL, &a), TD_ERR_STATE);
    assert_non_null(strstr(td_error_msg(), "another-host.example"));
    assert_non_null(strstr(td_error_msg(), "tidal-far-7-0.lock"));
    assert_int_equal(count_files(f.dir[1], "tidal-"), 0); /* the first directory's lock, made before, went */
    char path[700];
    snprintf(path, sizeof path, "%s/tidal-far-7-0.lock", f.dir[2]);
    assert_int_equal(unlink(path), 0);
    td_dio_destroy(io);
    free(buf);
    fixture_free(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_diskio_round_trip),
        cmocka_unit_test(test_diskio_many_requests),
        cmocka_unit_test(test_diskio_bad_requests),
        cmocka_unit_test(test_diskio_faults),
        cmocka_unit_test(test_diskio_create_faults),
        cmocka_unit_test(test_diskio_locks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
