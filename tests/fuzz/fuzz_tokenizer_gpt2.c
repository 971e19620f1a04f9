/* libFuzzer target: GPT-2 BPE loading from vocab.json and merges.txt, and
 * encoding with what was loaded (data/tokenizer.c).
 *
 * One input holds three parts cut at the two-byte separator "\1\1":
 * vocab.json, merges.txt, then a text.  The seeds carry a complete byte
 * alphabet (a vocabulary must have all 256 byte tokens), so mutations start
 * from files that load.  Whatever loads must keep the tokenizer's promises
 * on the text: decode(encode(x)) == x, every id a token, the same ids with
 * the text encoded in two pieces cut at td_tokenizer_split_point, and
 * pre-tokenizer pieces that concatenate to the text.  The byte tokenizer
 * gets the same round trip. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "tidal/tokenizer.h"

typedef struct pieces {
    const char *text;
    size_t at;
    int ok;
} pieces;

static void piece_fn(void *ctx, const char *piece, size_t len)
{
    pieces *p = ctx;
    if (len == 0 || piece != p->text + p->at) p->ok = 0;
    p->at += len;
}

static void round_trip(td_tokenizer *t, const char *text, size_t len)
{
    uint32_t *ids = NULL, *a = NULL, *b = NULL;
    size_t n = 0, na = 0, nb = 0, out_len = 0;
    char *out = NULL;
    FUZZ_CHECK(td_tokenizer_encode_alloc(t, text, len, &ids, &n) == TD_OK);
    for (size_t i = 0; i < n; i++) {
        size_t k;
        FUZZ_CHECK(ids[i] < td_tokenizer_vocab_size(t) && td_tokenizer_token_bytes(t, ids[i], &k));
    }
    FUZZ_CHECK(td_tokenizer_decode(t, ids, n, &out, &out_len) == TD_OK);
    FUZZ_CHECK(out_len == len && !memcmp(out, text, len));
    td_free(out);

    const size_t p = td_tokenizer_split_point(text, len);
    FUZZ_CHECK(p <= len);
    FUZZ_CHECK(td_tokenizer_encode_alloc(t, text, p, &a, &na) == TD_OK);
    FUZZ_CHECK(td_tokenizer_encode_alloc(t, text + p, len - p, &b, &nb) == TD_OK);
    FUZZ_CHECK(na + nb == n);
    FUZZ_CHECK(!na || !memcmp(a, ids, na * sizeof *ids));
    FUZZ_CHECK(!nb || !memcmp(b, ids + na, nb * sizeof *ids));
    td_free(a);
    td_free(b);
    td_free(ids);

    /* An id that is no token is refused by decode, not read. */
    uint32_t bad = td_tokenizer_vocab_size(t);
    FUZZ_CHECK(td_tokenizer_decode(t, &bad, 1, &out, &out_len) != TD_OK && out == NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const size_t live = td_host_live_allocs();
    const uint8_t *vocab, *merges, *text;
    size_t vocab_len, merges_len, text_len;
    fuzz_split(&data, &size, "\1\1", &vocab, &vocab_len);
    fuzz_split(&data, &size, "\1\1", &merges, &merges_len);
    text = data;
    text_len = size;

    pieces pc = {(const char *)text, 0, 1};
    td_gpt2_pretokenize((const char *)text, text_len, piece_fn, &pc);
    FUZZ_CHECK(pc.ok && pc.at == text_len);

    td_tokenizer *t = NULL;
    if (td_tokenizer_create_gpt2((const char *)vocab, vocab_len, "vocab.json", (const char *)merges, merges_len,
                                 "merges.txt", &t) == TD_OK) {
        FUZZ_CHECK(td_tokenizer_eot(t) < td_tokenizer_vocab_size(t));
        FUZZ_CHECK(td_tokenizer_vocab_size(t) <= TD_TOKENIZER_MAX_VOCAB);
        round_trip(t, (const char *)text, text_len);
        td_tokenizer_destroy(t);
    } else {
        FUZZ_CHECK(t == NULL && td_error_msg()[0]);
    }

    td_tokenizer *byte = NULL;
    FUZZ_CHECK(td_tokenizer_create_byte(&byte) == TD_OK);
    round_trip(byte, (const char *)text, text_len);
    td_tokenizer_destroy(byte);
    FUZZ_CHECK(td_host_live_allocs() == live);
    return 0;
}
