/* Tokenizers: byte and GPT-2 BPE.
 *
 * - Round trips: decode(encode(x)) == x for random byte strings (invalid
 *   UTF-8 included) and random UTF-8 text, both kinds.
 * - The pre-tokenizer against the `regex` module's split of the GPT-2
 *   pattern (tests/data/tok/pretok_cases.jsonl).
 * - BPE on a hand-made vocabulary whose merges are worked out in the
 *   comments (rank order, ties, repeated pairs, duplicate merge lines), and
 *   on a real prefix of GPT-2 (tests/data/tok/gpt2_prefix) against GPT-2's
 *   own encodings (gpt2_known.jsonl; see gen_fixtures.py).
 * - Streaming: cutting at td_tokenizer_split_point never changes the tokens.
 * - Bad vocab.json / merges.txt: exact errors; mutated files never crash;
 *   allocation failures leak nothing. */
#include "td_test.h"
#include "tidal/tokenizer.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- fixtures -------------------------------------------------------------- */

static const char *tok_dir(void)
{
    static char dir[512];
    if (!dir[0]) {
        const char *f = __FILE__;
        const char *slash = strrchr(f, '/');
        int n = slash ? (int)(slash - f) : 0;
        snprintf(dir, sizeof dir, "%.*s%sdata/tok", n, f, n ? "/" : "");
    }
    return dir;
}

static char *fixture_path(const char *name)
{
    static char path[4][1024];
    static int k;
    char *p = path[k++ & 3];
    snprintf(p, 1024, "%s/%s", tok_dir(), name);
    return p;
}

/* Calls fn on every JSON line of a fixture; returns the count. */
static int for_each_jsonl(const char *name, void (*fn)(cJSON *obj, void *ctx), void *ctx)
{
    return td_test_for_each_jsonl(fixture_path(name), fn, ctx);
}

static td_tokenizer *byte_tok(void)
{
    td_tokenizer *t = NULL;
    TD_ASSERT_OK(td_tokenizer_create_byte(&t));
    return t;
}

static td_tokenizer *prefix_tok(void)
{
    td_tokenizer *t = NULL;
    TD_ASSERT_OK(td_tokenizer_load_gpt2(fixture_path("gpt2_prefix/vocab.json"),
                                        fixture_path("gpt2_prefix/merges.txt"), &t));
    return t;
}

/* GPT-2's byte-to-unicode alphabet, written out independently of the library. */
static uint32_t byte_cp(int b)
{
    if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) return (uint32_t)b;
    uint32_t extra = 256;
    for (int c = 0; c < b; c++)
        if (!((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF))) extra++;
    return extra;
}

static size_t put_utf8(char *p, uint32_t cp)
{
    if (cp < 0x80) { p[0] = (char)cp; return 1; }
    if (cp < 0x800) { p[0] = (char)(0xC0 | cp >> 6); p[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    p[0] = (char)(0xE0 | cp >> 12);
    p[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    p[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
}

/* A vocab.json: the 256 byte tokens with GPT-2's ids (alphabet order as in
 * GPT-2: the printable bytes first), then `extra` (alphabet strings) from
 * id 256 on.  Caller frees. */
static char *vocab_json(const char *const *extra, int n_extra)
{
    size_t cap = 16384;
    for (int i = 0; i < n_extra; i++) cap += strlen(extra[i]) + 32;
    char *j = malloc(cap), *p = j;
    *p++ = '{';
    /* GPT-2 numbers the printable bytes first, in byte order, then the rest */
    int id = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int b = 0; b < 256; b++) {
            if ((byte_cp(b) == (uint32_t)b) != (pass == 0)) continue;
            *p++ = '"';
            if (b == '"' || b == '\\') *p++ = '\\';
            p += put_utf8(p, byte_cp(b));
            p += sprintf(p, "\": %d, ", id++);
        }
    for (int i = 0; i < n_extra; i++) p += sprintf(p, "\"%s\": %d, ", extra[i], 256 + i);
    p -= 2;
    strcpy(p, "}");
    return j;
}

static td_tokenizer *hand_tok(const char *const *extra, int n_extra, const char *merges)
{
    char *v = vocab_json(extra, n_extra);
    td_tokenizer *t = NULL;
    TD_ASSERT_OK(td_tokenizer_create_gpt2(v, strlen(v), "hand vocab", merges, strlen(merges), "hand merges", &t));
    free(v);
    return t;
}

static void assert_ids(td_tokenizer *t, const char *text, const uint32_t *want, size_t n_want)
{
    uint32_t *ids;
    size_t n;
    TD_ASSERT_OK(td_tokenizer_encode_alloc(t, text, strlen(text), &ids, &n));
    if (n != n_want) fail_msg("'%s': %zu tokens, want %zu", text, n, n_want);
    for (size_t i = 0; i < n; i++)
        if (ids[i] != want[i]) fail_msg("'%s': token %zu is %u, want %u", text, i, ids[i], want[i]);
    char *back;
    size_t len;
    TD_ASSERT_OK(td_tokenizer_decode(t, ids, n, &back, &len));
    assert_int_equal(len, strlen(text));
    assert_memory_equal(back, text, len);
    td_free(back);
    td_free(ids);
}
#define ASSERT_IDS(t, text, ...)                                                              \
    do {                                                                                      \
        const uint32_t want_[] = {__VA_ARGS__};                                               \
        assert_ids((t), (text), want_, sizeof want_ / sizeof want_[0]);                       \
    } while (0)

static void assert_round_trip(td_tokenizer *t, const char *text, size_t len)
{
    uint32_t *ids;
    size_t n;
    TD_ASSERT_OK(td_tokenizer_encode_alloc(t, text, len, &ids, &n));
    for (size_t i = 0; i < n; i++) assert_true(ids[i] < td_tokenizer_vocab_size(t));
    char *back;
    size_t back_len;
    TD_ASSERT_OK(td_tokenizer_decode(t, ids, n, &back, &back_len));
    if (back_len != len || memcmp(back, text, len)) fail_msg("round trip changed a %zu-byte text", len);
    td_free(back);
    td_free(ids);
}

/* Random text: UTF-8 words, punctuation, whitespace runs, contractions and
 * (when `raw`) arbitrary bytes. */
static size_t random_text(td_rng *rng, char *buf, size_t cap, int raw)
{
    static const char *const atoms[] = {
        "the", "cat", "a", "aaa", "that", " ", "  ", "\n", "\n\n", "\t", "\r\n", "'s", "'ll", "'re", "'", "''",
        "123", "4,5", ".", "!?", "é", "ß", "Жук", "中文", "😀", "٣", "½", "\xC2\xA0", "\xE3\x80\x80", "e\xCC\x81",
        "<|endoftext|>", "<|", "|>", "Hello", " world", "don't", "x", "Q", "$", "\\", "\"", "\xE2\x80\xA8",
    };
    size_t n = 0, want = td_rng_below(rng, cap - 16);
    while (n < want) {
        if (raw && td_rng_below(rng, 4) == 0) {
            buf[n++] = (char)td_rng_below(rng, 256);
            continue;
        }
        const char *a = atoms[td_rng_below(rng, sizeof atoms / sizeof atoms[0])];
        size_t l = strlen(a);
        if (n + l >= cap) break;
        memcpy(buf + n, a, l);
        n += l;
    }
    return n;
}

/* ---- byte tokenizer ---------------------------------------------------------- */

static void test_kind_parse(void **state)
{
    td_tokenizer_kind k;
    TD_ASSERT_OK(td_tokenizer_kind_parse("byte", &k));
    assert_int_equal(k, TD_TOKENIZER_BYTE);
    TD_ASSERT_OK(td_tokenizer_kind_parse("gpt2", &k));
    assert_int_equal(k, TD_TOKENIZER_GPT2);
    assert_int_equal(td_tokenizer_kind_parse("bpe", &k), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "choose byte or gpt2"));
    assert_string_equal(td_tokenizer_kind_name(TD_TOKENIZER_GPT2), "gpt2");
}

static void test_byte_ids(void **state)
{
    td_tokenizer *t = byte_tok();
    assert_int_equal(td_tokenizer_vocab_size(t), 257);
    assert_int_equal(td_tokenizer_eot(t), 256);
    assert_int_equal(td_tokenizer_merge_count(t), 0);
    ASSERT_IDS(t, "Ab\n", 'A', 'b', '\n');
    ASSERT_IDS(t, "a<|endoftext|>b", 'a', 256, 'b');
    ASSERT_IDS(t, "<|endoftext|><|endoftext|>", 256, 256);
    ASSERT_IDS(t, "<|endoftext|", '<', '|', 'e', 'n', 'd', 'o', 'f', 't', 'e', 'x', 't', '|');
    size_t len;
    assert_string_equal(td_tokenizer_token_bytes(t, 256, &len), "<|endoftext|>");
    assert_int_equal(len, 13);
    assert_int_equal((unsigned char)*td_tokenizer_token_bytes(t, 200, &len), 200);
    assert_null(td_tokenizer_token_bytes(t, 257, &len));
    td_tokenizer_destroy(t);
}

static void test_byte_round_trip_random(void **state)
{
    td_tokenizer *t = byte_tok();
    char buf[4096];
    for (int seed = 0; seed < td_test_seeds(200); seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed);
        size_t n = td_rng_below(&rng, sizeof buf);
        for (size_t i = 0; i < n; i++) buf[i] = (char)td_rng_below(&rng, 256);
        assert_round_trip(t, buf, n);
        n = random_text(&rng, buf, sizeof buf, seed & 1);
        assert_round_trip(t, buf, n);
    }
    td_tokenizer_destroy(t);
}

static void test_decode_errors(void **state)
{
    td_tokenizer *t = byte_tok();
    uint32_t ids[] = {104, 105, 300};
    char *text = (char *)1;
    size_t len = 1;
    assert_int_equal(td_tokenizer_decode(t, ids, 3, &text, &len), TD_ERR_INVALID);
    assert_null(text);
    assert_non_null(strstr(td_error_msg(), "token 2: id 300 is not in the byte vocabulary"));
    td_tokenizer_destroy(t);

    t = prefix_tok(); /* ids 2256..50255 are unused in the prefix */
    uint32_t gap[] = {262, 3000};
    assert_int_equal(td_tokenizer_decode(t, gap, 2, &text, &len), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "id 3000"));
    TD_ASSERT_OK(td_tokenizer_decode(t, gap, 1, &text, &len));
    assert_string_equal(text, " the");
    td_free(text);
    td_tokenizer_destroy(t);
}

/* ---- the pre-tokenizer ----------------------------------------------------- */

static void check_pretok_case(cJSON *o, void *ctx)
{
    const char *text = cJSON_GetObjectItem(o, "text")->valuestring;
    td_test_pieces *got = ctx;
    td_gpt2_pretokenize(text, strlen(text), td_test_collect_piece, got);
    td_test_expect_pieces(text, cJSON_GetObjectItem(o, "pieces"), got);
}

static void test_pretok_matches_regex(void **state)
{
    td_test_pieces *p = calloc(1, sizeof *p);
    int n = for_each_jsonl("pretok_cases.jsonl", check_pretok_case, p);
    assert_true(n > 300);
    free(p);
}

static void test_pretok_invalid_utf8(void **state)
{
    td_test_pieces *p = calloc(1, sizeof *p);
    /* each invalid byte is one "other" character */
    const char text[] = "ab\xFF" "cd \xFE\xFD" "e\xC3" " \xE2\x82" "x";
    td_gpt2_pretokenize(text, sizeof text - 1, td_test_collect_piece, p);
    const char *want[] = {"ab", "\xFF", "cd", " \xFE\xFD", "e", "\xC3", " \xE2\x82", "x"};
    assert_int_equal(p->n, 8);
    for (int i = 0; i < 8; i++) assert_string_equal(p->v[i], want[i]);
    td_test_free_pieces(p);
    /* pieces always tile the input */
    char buf[512];
    for (int seed = 0; seed < td_test_seeds(300); seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed + 1000);
        size_t n = random_text(&rng, buf, sizeof buf, 1);
        td_gpt2_pretokenize(buf, n, td_test_collect_piece, p);
        size_t at = 0;
        for (int i = 0; i < p->n; i++) {
            assert_true(p->len[i] > 0 && at + p->len[i] <= n);
            assert_memory_equal(p->v[i], buf + at, p->len[i]);
            at += p->len[i];
        }
        assert_int_equal(at, n);
        td_test_free_pieces(p);
    }
    free(p);
}

/* ---- BPE on a hand-made vocabulary ------------------------------------------ */

static void test_bpe_hand_fixture(void **state)
{
    /* ids 256..: th the Ġc at Ġcat aa, then end of text */
    const char *extra[] = {"th", "the", "\xC4\xA0" "c", "at", "\xC4\xA0" "cat", "aa", "<|endoftext|>"};
    td_tokenizer *t = hand_tok(extra, 7, "#version: 0.2\n"
                                         "t h\n"                      /* rank 0 -> 256 */
                                         "th e\n"                     /* rank 1 -> 257 */
                                         "\xC4\xA0 c\n"               /* rank 2 -> 258 */
                                         "a t\n"                      /* rank 3 -> 259 */
                                         "\xC4\xA0" "c at\r\n"        /* rank 4 -> 260 (CRLF is fine) */
                                         "a a\n");                    /* rank 5 -> 261 */
    assert_int_equal(td_tokenizer_vocab_size(t), 263);
    assert_int_equal(td_tokenizer_eot(t), 262);
    assert_int_equal(td_tokenizer_merge_count(t), 6);
    /* single bytes keep GPT-2's ids: 'a' 64, 'c' 66, ' ' (Ġ) 220 */
    ASSERT_IDS(t, "a", 64);
    ASSERT_IDS(t, " ", 220);
    /* "the": t h -> th (r0), th e -> the (r1) */
    ASSERT_IDS(t, "the", 257);
    /* " cat": Ġ c a t; (Ġ,c) r2 beats (a,t) r3 -> Ġc a t -> Ġc at -> Ġcat (r4) */
    ASSERT_IDS(t, "the cat", 257, 260);
    /* " the": no (Ġ,t) merge, so Ġ stays alone */
    ASSERT_IDS(t, " the", 220, 257);
    /* "that": (t,h) r0 first, then (a,t) r3; (th,at) is no merge */
    ASSERT_IDS(t, "that", 256, 259);
    /* repeated pair: leftmost first, non-overlapping */
    ASSERT_IDS(t, "aaa", 261, 64);
    ASSERT_IDS(t, "aaaa", 261, 261);
    ASSERT_IDS(t, "aaaaa", 261, 261, 64);
    /* the literal is end of text, splitting pieces around it */
    ASSERT_IDS(t, "cat<|endoftext|> cat", 66, 259, 262, 260);
    /* "cats": pre-tokenized as one piece, c a t s -> c at s */
    ASSERT_IDS(t, "cats", 66, 259, 82);
    td_tokenizer_destroy(t);
}

static void test_bpe_rank_order_and_ties(void **state)
{
    const char *extra[] = {"ab", "bc"};
    /* (b,c) ranks first: a bc */
    td_tokenizer *t = hand_tok(extra, 2, "b c\na b\n");
    ASSERT_IDS(t, "abc", 'a' - 33, 257);
    td_tokenizer_destroy(t);
    /* (a,b) ranks first: ab c */
    t = hand_tok(extra, 2, "a b\nb c\n");
    ASSERT_IDS(t, "abc", 256, 'c' - 33);
    /* equal pairs: the leftmost merges first: "abab" -> ab ab */
    ASSERT_IDS(t, "abab", 256, 256);
    td_tokenizer_destroy(t);
    /* a repeated merge line takes its later rank (tokenizers / encoder.py):
     * (a,b) becomes rank 2, so (b,c) at rank 1 wins */
    t = hand_tok(extra, 2, "a b\nb c\na b\n");
    assert_int_equal(td_tokenizer_merge_count(t), 3);
    ASSERT_IDS(t, "abc", 'a' - 33, 257);
    td_tokenizer_destroy(t);
    /* no end-of-text in vocab.json: it is added one past the largest id */
    t = hand_tok(extra, 2, "a b\n");
    assert_int_equal(td_tokenizer_eot(t), 258);
    assert_int_equal(td_tokenizer_vocab_size(t), 259);
    ASSERT_IDS(t, "ab<|endoftext|>", 256, 258);
    td_tokenizer_destroy(t);
}

/* A long piece exercises the heap: 4096 'a's with "a a" and "aa aa" merges
 * become 1024 "aaaa" tokens. */
static void test_bpe_long_piece(void **state)
{
    const char *extra[] = {"aa", "aaaa"};
    td_tokenizer *t = hand_tok(extra, 2, "a a\naa aa\n");
    char *text = malloc(4097);
    memset(text, 'a', 4096);
    text[4096] = '\0';
    uint32_t *ids;
    size_t n;
    TD_ASSERT_OK(td_tokenizer_encode_alloc(t, text, 4096, &ids, &n));
    assert_int_equal(n, 1024);
    for (size_t i = 0; i < n; i++) assert_int_equal(ids[i], 257);
    td_free(ids);
    TD_ASSERT_OK(td_tokenizer_encode_alloc(t, text, 4095, &ids, &n)); /* ... aaaa aa a */
    assert_int_equal(n, 1023 + 2);
    assert_int_equal(ids[1023], 256);
    assert_int_equal(ids[1024], 'a' - 33);
    td_free(ids);
    free(text);
    td_tokenizer_destroy(t);
}

/* ---- BPE on a real prefix of GPT-2 ------------------------------------------ */

static void check_known(cJSON *o, void *ctx)
{
    const char *text = cJSON_GetObjectItem(o, "text")->valuestring;
    cJSON *want = cJSON_GetObjectItem(o, "ids");
    uint32_t ids[256];
    size_t n = (size_t)cJSON_GetArraySize(want);
    assert_true(n <= 256);
    for (size_t i = 0; i < n; i++) ids[i] = (uint32_t)cJSON_GetArrayItem(want, (int)i)->valuedouble;
    assert_ids(ctx, text, ids, n);
}

static void test_gpt2_known_encodings(void **state)
{
    td_tokenizer *t = prefix_tok();
    assert_int_equal(td_tokenizer_vocab_size(t), 50257);
    assert_int_equal(td_tokenizer_eot(t), 50256);
    assert_int_equal(td_tokenizer_merge_count(t), 2000);
    /* a few spelled out (GPT-2's ids) */
    ASSERT_IDS(t, "It's a test, isn't it?", 1026, 338, 257, 1332, 11, 2125, 470, 340, 30);
    ASSERT_IDS(t, "The United States of America", 464, 1578, 1829, 286, 2253);
    ASSERT_IDS(t, "    return x;\n}", 220, 220, 220, 1441, 2124, 26, 198, 92);
    assert_true(for_each_jsonl("gpt2_known.jsonl", check_known, t) >= 10);
    td_tokenizer_destroy(t);
}

static void test_gpt2_round_trip_random(void **state)
{
    td_tokenizer *t = prefix_tok();
    char buf[4096];
    for (int seed = 0; seed < td_test_seeds(200); seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed + 77);
        size_t n = td_rng_below(&rng, sizeof buf);
        for (size_t i = 0; i < n; i++) buf[i] = (char)td_rng_below(&rng, 256);
        assert_round_trip(t, buf, n);
        n = random_text(&rng, buf, sizeof buf, 0);
        assert_round_trip(t, buf, n);
        n = random_text(&rng, buf, sizeof buf, 1);
        assert_round_trip(t, buf, n);
    }
    td_tokenizer_destroy(t);
}

/* Encoding twice (the second time from the piece cache) gives the same ids,
 * also after the cache has been cleared by filling it. */
static void test_gpt2_cache_consistent(void **state)
{
    td_tokenizer *t = prefix_tok();
    size_t cap = 1 << 20;
    char *text = malloc(cap);
    td_rng rng;
    td_rng_seed(&rng, 5);
    size_t n = 0;
    while (n + 16 < cap) { /* many distinct words: forces cache clears */
        n += (size_t)sprintf(text + n, " w%llx", (unsigned long long)td_rng_below(&rng, 1u << 20));
    }
    uint32_t *a, *b;
    size_t na, nb;
    TD_ASSERT_OK(td_tokenizer_encode_alloc(t, text, n, &a, &na));
    TD_ASSERT_OK(td_tokenizer_encode_alloc(t, text, n, &b, &nb));
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na * sizeof *a);
    td_tokenizer *fresh = prefix_tok(); /* piece by piece from an empty cache */
    size_t at = 0, k = 0;
    while (at < n && k < na) {
        size_t e = at + 1;
        while (e < n && text[e] != ' ') e++;
        uint32_t *c;
        size_t nc;
        TD_ASSERT_OK(td_tokenizer_encode_alloc(fresh, text + at, e - at, &c, &nc));
        assert_memory_equal(c, a + k, nc * sizeof *c);
        k += nc;
        td_free(c);
        at = e;
        if (at > 20000) break; /* a prefix is enough */
    }
    td_free(a);
    td_free(b);
    free(text);
    td_tokenizer_destroy(fresh);
    td_tokenizer_destroy(t);
}

/* ---- streaming -------------------------------------------------------------- */

typedef struct cat_sink {
    uint32_t ids[8192];
    size_t n;
} cat_sink;

static td_status append_ids(void *ctx, const uint32_t *ids, size_t n)
{
    cat_sink *c = ctx;
    assert_true(c->n + n <= 8192);
    memcpy(c->ids + c->n, ids, n * sizeof *ids);
    c->n += n;
    return TD_OK;
}

static void test_split_point_is_safe(void **state)
{
    td_tokenizer *toks[2] = {byte_tok(), prefix_tok()};
    char buf[2048];
    cat_sink *whole = calloc(1, sizeof *whole), *parts = calloc(1, sizeof *parts);
    int cuts = 0;
    for (int seed = 0; seed < td_test_seeds(400); seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed + 4242);
        size_t n = random_text(&rng, buf, sizeof buf, seed % 3 == 0);
        if (n < 2) continue;
        size_t c = 1 + td_rng_below(&rng, n - 1); /* the block seen so far */
        size_t p = td_tokenizer_split_point(buf, c);
        assert_true(p < c);
        if (p == 0) continue;
        cuts++;
        for (int k = 0; k < 2; k++) {
            whole->n = parts->n = 0;
            TD_ASSERT_OK(td_tokenizer_encode(toks[k], buf, n, append_ids, whole));
            TD_ASSERT_OK(td_tokenizer_encode(toks[k], buf, p, append_ids, parts));
            TD_ASSERT_OK(td_tokenizer_encode(toks[k], buf + p, n - p, append_ids, parts));
            if (whole->n != parts->n || memcmp(whole->ids, parts->ids, whole->n * sizeof(uint32_t)))
                fail_msg("seed %d: cutting %zu bytes at %zu changed the %s tokens", seed, n, p,
                         td_tokenizer_kind_name(td_tokenizer_kind_of(toks[k])));
        }
    }
    assert_true(cuts > td_test_seeds(400) / 2);
    /* no whitespace between non-whitespace: no cut */
    assert_int_equal(td_tokenizer_split_point("abc", 3), 0);
    assert_int_equal(td_tokenizer_split_point("a  b", 4), 0);
    assert_int_equal(td_tokenizer_split_point("a b", 3), 1);
    assert_int_equal(td_tokenizer_split_point("a b c", 4), 1); /* the char after the space must be seen */
    assert_int_equal(td_tokenizer_split_point("a\nb", 3), 1);
    assert_int_equal(td_tokenizer_split_point("\xC2\xA0 b", 4), 0); /* NBSP before: whitespace */
    assert_int_equal(td_tokenizer_split_point("\xC3\xA9 b", 4), 2);
    free(whole);
    free(parts);
    td_tokenizer_destroy(toks[0]);
    td_tokenizer_destroy(toks[1]);
}

static td_status failing_sink(void *ctx, const uint32_t *ids, size_t n)
{
    return td_error_set(TD_ERR_IO, "sink full");
}

static void test_sink_error_stops(void **state)
{
    td_tokenizer *t = prefix_tok();
    assert_int_equal(td_tokenizer_encode(t, "hello there", 11, failing_sink, NULL), TD_ERR_IO);
    assert_string_equal(td_error_msg(), "sink full");
    td_tokenizer_destroy(t);
}

/* ---- loading errors ----------------------------------------------------------- */

static void expect_load_error(const char *vocab, const char *merges, td_status code, const char *needle)
{
    td_tokenizer *t = (td_tokenizer *)1;
    td_status st = td_tokenizer_create_gpt2(vocab, strlen(vocab), "v.json", merges, strlen(merges), "m.txt", &t);
    if (st != code) fail_msg("expected %s for '%s' / '%s', got %s (%s)", td_status_name(code), vocab, merges,
                             td_status_name(st), td_error_msg());
    assert_null(t);
    if (!strstr(td_error_msg(), needle)) fail_msg("message '%s' lacks '%s'", td_error_msg(), needle);
}

static void test_gpt2_load_errors(void **state)
{
    size_t base = td_host_live_allocs();
    char *v = vocab_json(NULL, 0);
    expect_load_error("{\"a\": ", "", TD_ERR_INVALID, "v.json' is not valid JSON");
    expect_load_error("[1, 2]", "", TD_ERR_INVALID, "not a JSON object");
    expect_load_error("{}", "", TD_ERR_INVALID, "has no tokens");
    expect_load_error("{\"a\": 1.5}", "", TD_ERR_INVALID, "\"a\" is not an integer");
    expect_load_error("{\"a\": -1}", "", TD_ERR_INVALID, "\"a\" is not an integer");
    expect_load_error("{\"a\": \"1\"}", "", TD_ERR_INVALID, "\"a\" is not an integer");
    expect_load_error("{\"a\": 99999999}", "", TD_ERR_INVALID, "not an integer in [0,");
    expect_load_error("{\"\": 0}", "", TD_ERR_INVALID, "empty string");
    expect_load_error("{\"a\": 0, \"b\": 0}", "", TD_ERR_INVALID, "id 0 is given to two tokens");
    expect_load_error("{\"a\": 0, \"a\": 1}", "", TD_ERR_INVALID, "\"a\" appears twice");
    expect_load_error("{\"\xE2\x82\xAC\": 0}", "", TD_ERR_INVALID, "(U+20AC) outside GPT-2's byte-to-unicode");
    expect_load_error("{\"a\": 0}", "", TD_ERR_INVALID, "lacks the token for byte 0x00 (U+0100)");
    char *short_v = strdup(v);
    *strstr(short_v, ", \"\xC4\xA0\": 220") = '\0'; /* cut the vocabulary before the space token */
    strcat(short_v, "}");
    expect_load_error(short_v, "", TD_ERR_INVALID, "byte 0x20 (U+0120)");
    free(short_v);
    const char *extra[] = {"ab"};
    char *v2 = vocab_json(extra, 1);
    expect_load_error(v2, "a b c\n", TD_ERR_INVALID, "m.txt':1: expected \"A B\"");
    expect_load_error(v2, "#version: 0.2\na\n", TD_ERR_INVALID, "m.txt':2: expected \"A B\"");
    expect_load_error(v2, "a  b\n", TD_ERR_INVALID, "m.txt':1: expected");
    expect_load_error(v2, " b\n", TD_ERR_INVALID, "expected");
    expect_load_error(v2, "b \n", TD_ERR_INVALID, "expected");
    expect_load_error(v2, "a b\n\na b\n", TD_ERR_INVALID, "m.txt':2: expected");
    expect_load_error(v, "a b\n", TD_ERR_INVALID, "the merged token \"ab\" is not in vocab.json");
    expect_load_error(v2, "a \xE2\x82\xAC\n", TD_ERR_INVALID, "(U+20AC) outside");
    expect_load_error(v2, "ac b\n", TD_ERR_INVALID, "merge \"ac b\": \"ac\" is not in vocab.json");
    expect_load_error(v2, "a bc\n", TD_ERR_INVALID, "merge \"a bc\": \"bc\" is not in vocab.json");
    free(v2);
    free(v);
    td_tokenizer *t = (td_tokenizer *)1;
    assert_int_equal(td_tokenizer_load_gpt2("/nonexistent/vocab.json", fixture_path("gpt2_prefix/merges.txt"), &t),
                     TD_ERR_IO);
    assert_null(t);
    assert_non_null(strstr(td_error_msg(), "cannot open vocab.json '/nonexistent/vocab.json'"));
    assert_int_equal(td_tokenizer_load_gpt2(fixture_path("gpt2_prefix/vocab.json"), "/nonexistent/m.txt", &t),
                     TD_ERR_IO);
    assert_non_null(strstr(td_error_msg(), "cannot open merges.txt '/nonexistent/m.txt'"));
    /* the two files swapped */
    assert_int_equal(td_tokenizer_load_gpt2(fixture_path("gpt2_prefix/merges.txt"),
                                            fixture_path("gpt2_prefix/vocab.json"), &t), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "not valid JSON"));
    assert_int_equal(td_host_live_allocs(), base);
}

/* Truncated and byte-flipped vocab.json / merges.txt load or fail cleanly. */
static void test_gpt2_mutated_files(void **state)
{
    size_t vlen, mlen;
    char *v = td_test_slurp(fixture_path("gpt2_prefix/vocab.json"), &vlen);
    char *m = td_test_slurp(fixture_path("gpt2_prefix/merges.txt"), &mlen);
    size_t base = td_host_live_allocs();
    int ok = 0, failed = 0;
    for (int seed = 0; seed < td_test_seeds(60); seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed);
        int which = seed & 1;
        char *buf = which ? m : v;
        size_t len = which ? mlen : vlen;
        char *copy = malloc(len + 1);
        memcpy(copy, buf, len + 1);
        size_t use = len;
        if (seed % 3 == 0) use = td_rng_below(&rng, len);
        else
            for (int k = 0; k < 1 + (int)td_rng_below(&rng, 4); k++) copy[td_rng_below(&rng, len)] ^= (char)(1 + td_rng_below(&rng, 255));
        td_tokenizer *t = NULL;
        td_status st = which ? td_tokenizer_create_gpt2(v, vlen, "v", copy, use, "m", &t)
                             : td_tokenizer_create_gpt2(copy, use, "v", m, mlen, "m", &t);
        if (st == TD_OK) {
            ok++;
            assert_round_trip(t, "mutated files still encode: it's fine", 37);
            td_tokenizer_destroy(t);
        } else {
            failed++;
            assert_true(strlen(td_error_msg()) > 0);
        }
        free(copy);
    }
    assert_true(failed > 0);
    assert_int_equal(td_host_live_allocs(), base);
    free(v);
    free(m);
}

/* The n-th allocation fails, for every n: an error, never a leak. */
static void test_alloc_faults(void **state)
{
    size_t vlen, mlen;
    char *v = td_test_slurp(fixture_path("gpt2_prefix/vocab.json"), &vlen);
    char *m = td_test_slurp(fixture_path("gpt2_prefix/merges.txt"), &mlen);
    const char *text = "Fault injection: it's the test's job, 12345 times.";
    size_t want = 0;
    {
        td_tokenizer *t = NULL;
        uint32_t *ids = NULL;
        TD_ASSERT_OK(td_tokenizer_create_gpt2(v, vlen, "v", m, mlen, "m", &t));
        TD_ASSERT_OK(td_tokenizer_encode_alloc(t, text, strlen(text), &ids, &want));
        td_free(ids);
        td_tokenizer_destroy(t);
    }
    size_t base = td_host_live_allocs();
    for (long n = 1;; n++) {
        td_fault_arm(TD_FAULT_HOST_ALLOC, n);
        td_tokenizer *t = NULL;
        uint32_t *ids = NULL;
        size_t count = 0;
        td_status st = td_tokenizer_create_gpt2(v, vlen, "v", m, mlen, "m", &t);
        if (st == TD_OK) st = td_tokenizer_encode_alloc(t, text, strlen(text), &ids, &count);
        int reached = td_fault_count(TD_FAULT_HOST_ALLOC) >= n;
        td_fault_disarm_all();
        if (st == TD_OK) assert_int_equal(count, want);
        else assert_int_equal(st, TD_ERR_NOMEM);
        td_free(ids);
        td_tokenizer_destroy(t);
        assert_int_equal(td_host_live_allocs(), base);
        if (!reached) {
            assert_int_equal(st, TD_OK);
            break;
        }
    }
    free(v);
    free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kind_parse),
        cmocka_unit_test(test_byte_ids),
        cmocka_unit_test(test_byte_round_trip_random),
        cmocka_unit_test(test_decode_errors),
        cmocka_unit_test(test_pretok_matches_regex),
        cmocka_unit_test(test_pretok_invalid_utf8),
        cmocka_unit_test(test_bpe_hand_fixture),
        cmocka_unit_test(test_bpe_rank_order_and_ties),
        cmocka_unit_test(test_bpe_long_piece),
        cmocka_unit_test(test_gpt2_known_encodings),
        cmocka_unit_test(test_gpt2_round_trip_random),
        cmocka_unit_test(test_gpt2_cache_consistent),
        cmocka_unit_test(test_split_point_is_safe),
        cmocka_unit_test(test_sink_error_stops),
        cmocka_unit_test(test_gpt2_load_errors),
        cmocka_unit_test(test_gpt2_mutated_files),
        cmocka_unit_test(test_alloc_faults),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
