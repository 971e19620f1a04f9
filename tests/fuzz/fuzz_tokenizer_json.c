/* libFuzzer target: tokenizer.json from arbitrary bytes.
 *
 * The input is the file.  When it loads, the tokenizer encodes a fixed
 * mixed text and the input itself (as text, up to 4 KiB), every id must be
 * below the vocabulary size and decode, and a cut point must lie inside the
 * text.  Failures to load must leave a message and no allocation behind
 * (td_host_live_allocs); crashes, leaks and sanitizer reports are the bugs
 * this looks for. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tidal/alloc.h"
#include "tidal/tokenizer.h"

#define TEXT_MAX 4096

static void check_text(td_tokenizer *t, const char *text, size_t len)
{
    uint32_t *ids = NULL;
    size_t n = 0;
    if (td_tokenizer_encode_alloc(t, text, len, &ids, &n) != TD_OK) abort();
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= td_tokenizer_vocab_size(t)) abort();
    char *back = NULL;
    size_t back_len = 0;
    if (td_tokenizer_decode(t, ids, n, &back, &back_len) != TD_OK) abort();
    size_t p = td_tokenizer_cut_point(t, text, len);
    if (p && p >= len) abort();
    td_free(back);
    td_free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char mixed[] = "Hello, world! It's 2024: caf\xC3\xA9 \xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x98\x80 "
                                "12345\n\n  <|endoftext|><|begin_of_text|>'S x.\ny\t\xFF e\xCC\x81 "
                                "\xE1\x84\x80\xE1\x85\xA1"; /* decomposed é, Hangul jamo: NFC work */
    size_t base = td_host_live_allocs();
    td_tokenizer *t = NULL;
    if (td_tokenizer_create_json((const char *)data, size, "fuzz", NULL, 0, &t) == TD_OK) {
        check_text(t, mixed, sizeof mixed - 1);
        check_text(t, (const char *)data, size < TEXT_MAX ? size : TEXT_MAX);
        td_tokenizer_destroy(t);
    } else if (t || !td_error_msg()[0]) {
        abort();
    }
    if (td_host_live_allocs() != base) abort();
    return 0;
}
