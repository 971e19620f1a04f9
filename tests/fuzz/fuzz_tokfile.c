/* libFuzzer target: the token file reader (data/tokfile.c) and the loader on
 * top of it.
 *
 * The input is a whole token file in memory (td_tokfile_open_buffer reads
 * the same bytes td_tokfile_open maps).  Both checksums stop almost every
 * mutation at the first check, so each input is tried twice: as it is, and
 * with the header and payload CRC-32 fields recomputed, which lets the
 * fuzzer reach the size, vocabulary and id checks behind them (for a
 * version 2 file with flags, the flags' CRC too).  An accepted file must
 * hold exactly token_count ids below its vocabulary, and a loader over it
 * must produce batches whose targets are the inputs shifted by one where
 * they count (-1 elsewhere) and whose positions start at 0 and go up by
 * one or restart. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "tidal/data.h"

static void read_back(const td_tokfile *f)
{
    const td_tokfile_info *info = td_tokfile_get_info(f);
    FUZZ_CHECK(info->vocab_size >= 1 && info->vocab_size <= TD_TOKENIZER_MAX_VOCAB);
    FUZZ_CHECK(info->eot < info->vocab_size);
    int32_t buf[256];
    const uint64_t n = td_tokfile_count(f);
    for (uint64_t at = 0; at < n;) {
        size_t k = n - at < 256 ? (size_t)(n - at) : 256;
        FUZZ_CHECK(td_tokfile_read(f, at, k, buf) == TD_OK);
        for (size_t i = 0; i < k; i++) FUZZ_CHECK(buf[i] >= 0 && (uint32_t)buf[i] < info->vocab_size);
        at += k;
    }
    /* Past the end is refused, not read. */
    FUZZ_CHECK(td_tokfile_read(f, n, 1, buf) != TD_OK);
    FUZZ_CHECK(td_tokfile_read(f, UINT64_MAX, 2, buf) != TD_OK);

    /* A loader of short sequences (a file of rows: its rows, when short),
     * train and held-out splits. */
    const uint32_t T = info->row_tokens ? info->row_tokens : 3;
    if (T > 64) return;
    for (int split = 0; split < 2; split++) {
        td_loader_params p = td_loader_default_params();
        p.batch = 2;
        p.seq = T;
        p.heldout_percent = split ? 50 : 0;
        p.split = split ? TD_DATA_HELDOUT : TD_DATA_TRAIN;
        td_loader *l = NULL;
        if (td_loader_create(f, &p, &l) != TD_OK) continue;
        int32_t in[128], tg[128], pos[128];
        for (int b = 0; b < 3; b++) {
            FUZZ_CHECK(td_loader_next(l, in, tg, pos) == TD_OK);
            for (uint32_t i = 0; i < 2 * T; i++) FUZZ_CHECK(in[i] >= 0 && (uint32_t)in[i] < info->vocab_size);
            for (uint32_t r = 0; r < 2; r++)
                for (uint32_t t = 0; t < T; t++) {
                    const uint32_t k = r * T + t;
                    if (t + 1 < T) FUZZ_CHECK(tg[k] == -1 || tg[k] == in[k + 1]);
                    if (!info->has_flags && t + 1 < T) FUZZ_CHECK(tg[k] == in[k + 1]);
                    FUZZ_CHECK(t == 0 ? pos[k] == 0 : (pos[k] == 0 || pos[k] == pos[k - 1] + 1));
                    if (t + 1 < T && tg[k] >= 0) FUZZ_CHECK(pos[k + 1] != 0);
                }
        }
        td_loader_destroy(l);
    }
}

static void try_open(const uint8_t *data, size_t size)
{
    td_tokfile *f = NULL;
    if (td_tokfile_open_buffer(data, size, "fuzz.tok", &f) == TD_OK) {
        FUZZ_CHECK(f != NULL);
        read_back(f);
        td_tokfile_close(f);
    } else {
        FUZZ_CHECK(f == NULL && td_error_msg()[0]);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const size_t live = td_host_live_allocs();
    try_open(data, size);
    if (size >= TD_TOKFILE_HEADER_BYTES) {
        uint8_t *fixed = malloc(size);
        if (!fixed) return 0;
        memcpy(fixed, data, size);
        uint32_t width, has_flags;
        uint64_t count;
        memcpy(&width, fixed + 16, 4);
        memcpy(&has_flags, fixed + 48, 4);
        memcpy(&count, fixed + 32, 8);
        size_t tokens = size - TD_TOKFILE_HEADER_BYTES;
        if (has_flags == 1 && (width == 2 || width == 4) && count <= tokens / (width + 1) &&
            count * (width + 1) == tokens) { /* tokens, then a flag byte each: two CRCs */
            tokens = (size_t)count * width;
            uint32_t flags = td_crc32(0, fixed + TD_TOKFILE_HEADER_BYTES + tokens, (size_t)count);
            memcpy(fixed + 52, &flags, 4);
        }
        uint32_t payload = td_crc32(0, fixed + TD_TOKFILE_HEADER_BYTES, tokens);
        memcpy(fixed + 40, &payload, 4);
        uint32_t header = td_crc32(0, fixed, 60);
        memcpy(fixed + 60, &header, 4);
        try_open(fixed, size);
        free(fixed);
    }
    FUZZ_CHECK(td_host_live_allocs() == live);
    return 0;
}
