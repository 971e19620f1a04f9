/* A drive's direct read and write rates (td_dio_measure in diskio.h): what
 * `tidal bench disk` prints and `tidal plan` puts in its step bound.
 *
 * Sequential requests of one block each, a window of `depth` in flight
 * (each buffer slot reused once its last request ended), through the same
 * engine and scratch files training uses, so the figure is what the disk
 * tier gets.  The bytes are random: a drive that compresses or dedups
 * zeros would otherwise read fast. */
#include "tidal/diskio.h"
#include "tidal/alloc.h"
#include "tidal/hostmem.h"
#include "tidal/util.h"

#include <stdio.h>
#include <string.h>

typedef enum pass_kind { PASS_WRITE, PASS_READ, PASS_MIXED } pass_kind;

/* One pass over the file; its GB/s. */
static td_status pass(td_dio *io, td_dio_file *f, char *buf, size_t blocks, size_t block, int depth, pass_kind kind,
                      double *gbs)
{
    td_status st = TD_OK;
    td_dio_ticket *t = td_calloc((size_t)depth, sizeof *t, TD_ROLE_META);
    if (!t) return TD_ERR_NOMEM;
    size_t half = blocks / 2;
    double t0 = td_now_ms();
    for (size_t i = 0; i < blocks; i++) {
        int slot = (int)(i % (size_t)depth);
        TD_TRY(td_dio_wait(io, &t[slot]));
        char *b = buf + (size_t)slot * block;
        if (kind == PASS_WRITE) TD_TRY(td_dio_write(f, i * block, b, block, &t[slot]));
        else if (kind == PASS_READ) TD_TRY(td_dio_read(f, i * block, b, block, &t[slot]));
        else if (i % 2 == 0) TD_TRY(td_dio_read(f, (i / 2) * block, b, block, &t[slot])); /* the first half, read */
        else TD_TRY(td_dio_write(f, (half + i / 2) * block, b, block, &t[slot]));         /* the second, written */
    }
    TD_TRY(td_dio_drain(io));
    double ms = td_now_ms() - t0;
    *gbs = ms > 0 ? (double)(blocks * block) / (ms * 1e-3) / 1e9 : 0;
cleanup:
    td_free(t);
    return st;
}

td_status td_dio_measure(td_dio *io, const char *const *dirs, int n_dirs, size_t bytes, size_t block, int depth,
                         td_dio_rates *out)
{
    memset(out, 0, sizeof *out);
    if (!block || block % TD_DIO_ALIGN)
        return td_error_set(TD_ERR_INVALID, "disk measure: a block of %zu bytes (a multiple of %zu)", block, TD_DIO_ALIGN);
    if (depth < 1) return td_error_set(TD_ERR_INVALID, "disk measure: %d requests in flight", depth);
    size_t blocks = bytes / block;
    if (blocks < 2) blocks = 2;
    td_status st = TD_OK;
    td_hostmem *hm = NULL;
    td_dio_file *f = NULL;
    char *buf = NULL;
    TD_TRY(td_hostmem_create(NULL, &hm));
    TD_TRY(td_hostmem_alloc(hm, (size_t)depth * block, TD_ROLE_STAGING, (void **)&buf));
    td_rng r;
    td_rng_seed(&r, 0x5eed);
    for (size_t i = 0; i + 8 <= (size_t)depth * block; i += 8) {
        uint64_t v = td_rng_next(&r);
        memcpy(buf + i, &v, 8);
    }
    TD_TRY(td_dio_file_create(io, dirs, n_dirs, blocks * block, NULL, &f));
    out->bytes = blocks * block;
    out->direct = td_dio_file_direct(f);
    snprintf(out->method, sizeof out->method, "%s", td_dio_method_name(td_dio_get_method(io)));
    TD_TRY(pass(io, f, buf, blocks, block, depth, PASS_WRITE, &out->write_gbs));
    TD_TRY(pass(io, f, buf, blocks, block, depth, PASS_READ, &out->read_gbs));
    TD_TRY(pass(io, f, buf, blocks & ~(size_t)1, block, depth, PASS_MIXED, &out->mixed_gbs));
cleanup:
    if (f) (void)td_dio_drain(io);
    td_dio_file_close(f);
    td_hostmem_destroy(hm);
    return st;
}
