/* libFuzzer target: the safetensors reader (checkpoint/safetensors.c).
 *
 * The input is a whole file, written to a scratch file because td_st_open
 * reads with pread.  The 8-byte header length stops most mutations that
 * change the header's size, so each input is tried twice: as it is, and
 * with the length recomputed to end at the input's last '}' (then the
 * fuzzer reaches the JSON, dtype, shape and offset checks).  An accepted
 * file must keep its promises: tensors in offset order, contiguous, inside
 * the file, bytes = shape product * dtype size, found by name, and every
 * tensor readable whole (raw and, where allowed, converted to F32), while
 * reads outside a tensor are refused. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "tidal/safetensors.h"

/* Reads are capped: an accepted tensor's bytes are in the file, which is
 * never larger than libFuzzer's -max_len, but a zero-size dtype bug would
 * show as a huge numel. */
#define READ_CAP ((size_t)1 << 20)

static void check_reader(const td_st_reader *r)
{
    const uint64_t file_bytes = td_st_file_bytes(r);
    const size_t n = td_st_tensor_count(r);
    uint64_t at = 0;
    for (size_t i = 0; i < n; i++) {
        const td_st_tensor *t = td_st_tensor_at(r, i);
        FUZZ_CHECK(t && t->name && t->ndim >= 0 && t->ndim <= TD_ST_MAX_DIMS);
        FUZZ_CHECK(td_st_dtype_bytes(t->dtype) > 0);
        uint64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) numel *= t->shape[d];
        FUZZ_CHECK(numel == t->numel && t->bytes == numel * td_st_dtype_bytes(t->dtype));
        if (i == 0) at = t->file_offset;
        FUZZ_CHECK(t->file_offset == at); /* contiguous, no overlap */
        FUZZ_CHECK(t->file_offset <= file_bytes && t->bytes <= file_bytes - t->file_offset);
        at = t->file_offset + t->bytes;
        FUZZ_CHECK(td_st_find(r, t->name) == t);

        FUZZ_CHECK(t->bytes <= READ_CAP);
        unsigned char *buf = malloc(t->bytes ? t->bytes : 1);
        float *f32 = malloc((t->numel ? t->numel : 1) * sizeof *f32);
        FUZZ_CHECK(buf && f32);
        FUZZ_CHECK(td_st_read_bytes(r, t, 0, (size_t)t->bytes, buf) == TD_OK);
        FUZZ_CHECK(td_st_read_bytes(r, t, 1, (size_t)t->bytes, buf) != TD_OK);
        FUZZ_CHECK(td_st_read_bytes(r, t, UINT64_MAX, 2, buf) != TD_OK);
        if (td_st_dtype_convertible(t->dtype, TD_ST_F32)) {
            FUZZ_CHECK(td_st_read(r, t, 0, (size_t)t->numel, TD_ST_F32, f32) == TD_OK);
            if (t->numel) /* narrowing goes through the other path */
                FUZZ_CHECK(td_st_read(r, t, t->numel - 1, 1, TD_ST_BF16, buf) == TD_OK);
        } else {
            FUZZ_CHECK(td_st_read(r, t, 0, 1, TD_ST_F32, f32) != TD_OK);
        }
        FUZZ_CHECK(td_st_read(r, t, t->numel, 1, t->dtype, buf) != TD_OK);
        free(buf);
        free(f32);
    }
    FUZZ_CHECK(td_st_tensor_at(r, n) == NULL);
    for (size_t i = 0; i < td_st_metadata_count(r); i++) {
        const char *k, *v;
        td_st_metadata_at(r, i, &k, &v);
        FUZZ_CHECK(k && v && td_st_metadata(r, k) != NULL);
    }
}

static void try_open(const uint8_t *data, size_t size)
{
    char path[512];
    fuzz_write(path, sizeof path, "model.safetensors", data, size);
    td_st_reader *r = NULL;
    if (td_st_open(path, &r) == TD_OK) {
        check_reader(r);
        td_st_close(r);
    } else {
        FUZZ_CHECK(r == NULL && td_error_msg()[0]);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const size_t live = td_host_live_allocs();
    try_open(data, size);
    size_t last = size;
    while (last > 8 && data[last - 1] != '}') last--;
    if (last > 8) {
        uint8_t *fixed = malloc(size);
        if (!fixed) return 0;
        memcpy(fixed, data, size);
        uint64_t n = last - 8;
        for (int i = 0; i < 8; i++) fixed[i] = (uint8_t)(n >> (8 * i));
        if (memcmp(fixed, data, 8)) try_open(fixed, size);
        free(fixed);
    }
    FUZZ_CHECK(td_host_live_allocs() == live);
    return 0;
}
