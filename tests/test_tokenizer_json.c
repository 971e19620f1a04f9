/* Tokenizers from Hugging Face tokenizer.json (data/tokenizer_json.c).
 *
 * - Pre-tokenizers: the Llama 3, Qwen2 and GPT-2 Split patterns against the
 *   `regex` module's matches (tests/data/tok/pretok_*.jsonl, written by
 *   gen_json_fixtures.py and gen_fixtures.py).
 * - BPE on hand-built files whose ids are worked out in the comments, with
 *   merges as "a b" strings and as ["a", "b"] pairs, and ignore_merges.
 * - Added tokens: leftmost-longest, the non-normalized set before the
 *   normalized one, lstrip / rstrip / single_word, ids past the vocabulary;
 *   bos from TemplateProcessing, eos by name, from tokenizer_config.json, or
 *   added.
 * - GPT-2: a tokenizer.json made from the repo's GPT-2 prefix encodes
 *   exactly as vocab.json + merges.txt do (and as GPT-2 itself).
 * - Round trips on mixed text, streaming cuts that never change the ids, a
 *   152k vocabulary.
 * - Malformed files: exact errors naming the field, no leaks; truncated and
 *   flipped files never crash; every allocation failure is clean. */
#include "td_test.h"
#include "tidal/data.h"
#include "tidal/tokenizer.h"
#include "../cli/cli.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define LLAMA3 "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define QWEN2 "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define G "\xC4\xA0" /* U+0120, GPT-2's alphabet for the space byte */

/* ---- fixtures -------------------------------------------------------------- */

static const char *fixture_path(const char *name)
{
    static char path[4][1024];
    static int k;
    char *p = path[k++ & 3];
    const char *f = __FILE__, *slash = strrchr(f, '/');
    int n = slash ? (int)(slash - f) : 0;
    snprintf(p, 1024, "%.*s%sdata/tok/%s", n, f, n ? "/" : "", name);
    return p;
}

/* Calls fn on every JSON line of a fixture; returns the count. */
static int for_each_jsonl(const char *name, void (*fn)(cJSON *obj, void *ctx), void *ctx)
{
    return td_test_for_each_jsonl(fixture_path(name), fn, ctx);
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

static void byte_str(int b, char out[4])
{
    uint32_t cp = byte_cp(b);
    if (cp < 0x80) out[0] = (char)cp, out[1] = 0;
    else out[0] = (char)(0xC0 | cp >> 6), out[1] = (char)(0x80 | (cp & 0x3F)), out[2] = 0;
}

/* What a test tokenizer.json holds. */
typedef struct spec {
    const char *pattern;     /* Split regex before ByteLevel(use_regex false); NULL: ByteLevel alone */
    const char *extra[16];   /* alphabet tokens with ids 256, 257, ... */
    const char *merges[16];  /* "a b" */
    int pairs;               /* merges written as ["a", "b"] */
    int ignore_merges;
    const char *added;       /* JSON array of added tokens */
    const char *post;        /* JSON post_processor */
} spec;

/* The 256 byte tokens have id = byte. */
static cJSON *make_doc(const spec *s)
{
    cJSON *doc = cJSON_CreateObject(), *model = cJSON_CreateObject(), *vocab = cJSON_CreateObject();
    cJSON *merges = cJSON_CreateArray();
    char b[4];
    for (int i = 0; i < 256; i++) {
        byte_str(i, b);
        cJSON_AddNumberToObject(vocab, b, i);
    }
    for (int i = 0; s->extra[i]; i++) cJSON_AddNumberToObject(vocab, s->extra[i], 256 + i);
    for (int i = 0; s->merges[i]; i++) {
        if (!s->pairs) {
            cJSON_AddItemToArray(merges, cJSON_CreateString(s->merges[i]));
            continue;
        }
        char tmp[128];
        snprintf(tmp, sizeof tmp, "%s", s->merges[i]);
        char *sp = strchr(tmp, ' ');
        *sp = '\0';
        const char *two[2] = {tmp, sp + 1};
        cJSON_AddItemToArray(merges, cJSON_CreateStringArray(two, 2));
    }
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddNullToObject(model, "dropout");
    cJSON_AddBoolToObject(model, "ignore_merges", s->ignore_merges);
    cJSON_AddItemToObject(model, "vocab", vocab);
    cJSON_AddItemToObject(model, "merges", merges);
    cJSON_AddItemToObject(doc, "added_tokens", s->added ? cJSON_Parse(s->added) : cJSON_CreateArray());
    cJSON_AddNullToObject(doc, "normalizer");
    cJSON *bl = cJSON_Parse("{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true}");
    cJSON_AddBoolToObject(bl, "use_regex", !s->pattern);
    if (s->pattern) {
        cJSON *seq = cJSON_CreateObject(), *list = cJSON_CreateArray(), *split = cJSON_CreateObject();
        cJSON *pat = cJSON_CreateObject();
        cJSON_AddStringToObject(pat, "Regex", s->pattern);
        cJSON_AddStringToObject(split, "type", "Split");
        cJSON_AddItemToObject(split, "pattern", pat);
        cJSON_AddStringToObject(split, "behavior", "Isolated");
        cJSON_AddBoolToObject(split, "invert", 0);
        cJSON_AddItemToArray(list, split);
        cJSON_AddItemToArray(list, bl);
        cJSON_AddStringToObject(seq, "type", "Sequence");
        cJSON_AddItemToObject(seq, "pretokenizers", list);
        cJSON_AddItemToObject(doc, "pre_tokenizer", seq);
    } else {
        cJSON_AddItemToObject(doc, "pre_tokenizer", bl);
    }
    cJSON_AddItemToObject(doc, "post_processor", s->post ? cJSON_Parse(s->post) : cJSON_CreateNull());
    cJSON_AddItemToObject(doc, "decoder", cJSON_Parse("{\"type\": \"ByteLevel\"}"));
    cJSON_AddItemToObject(doc, "model", model);
    return doc;
}

static td_tokenizer *from_doc(const cJSON *doc)
{
    char *text = cJSON_PrintUnformatted(doc);
    td_tokenizer *t = NULL;
    TD_ASSERT_OK(td_tokenizer_create_json(text, strlen(text), "test.json", NULL, 0, &t));
    assert_int_equal(td_tokenizer_kind_of(t), TD_TOKENIZER_JSON);
    free(text);
    return t;
}

static td_tokenizer *make_tok(const spec *s)
{
    cJSON *doc = make_doc(s);
    td_tokenizer *t = from_doc(doc);
    cJSON_Delete(doc);
    return t;
}

static void assert_ids(td_tokenizer *t, const char *text, const uint32_t *want, size_t n_want, int round_trip)
{
    uint32_t *ids;
    size_t n;
    TD_ASSERT_OK(td_tokenizer_encode_alloc(t, text, strlen(text), &ids, &n));
    if (n != n_want) {
        for (size_t i = 0; i < n; i++) fprintf(stderr, "%u ", ids[i]);
        fail_msg("'%s': %zu tokens, want %zu", text, n, n_want);
    }
    for (size_t i = 0; i < n; i++)
        if (ids[i] != want[i]) fail_msg("'%s': token %zu is %u, want %u", text, i, ids[i], want[i]);
    if (round_trip) {
        char *back;
        size_t len;
        TD_ASSERT_OK(td_tokenizer_decode(t, ids, n, &back, &len));
        assert_int_equal(len, strlen(text));
        assert_memory_equal(back, text, len);
        td_free(back);
    }
    td_free(ids);
}
#define ASSERT_IDS(t, text, ...)                                                              \
    do {                                                                                      \
        const uint32_t want_[] = {__VA_ARGS__};                                               \
        assert_ids((t), (text), want_, sizeof want_ / sizeof want_[0], 1);                    \
    } while (0)
/* For added tokens that strip whitespace: the text does not come back. */
#define ASSERT_IDS_LOSSY(t, text, ...)                                                        \
    do {                                                                                      \
        const uint32_t want_[] = {__VA_ARGS__};                                               \
        assert_ids((t), (text), want_, sizeof want_ / sizeof want_[0], 0);                    \
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

/* Mixed text: ASCII words, accents, CJK, emoji, digit runs, newlines after
 * punctuation, whitespace runs, contractions in both cases, the added-token
 * literals of the tests and pieces of them; invalid bytes when `raw`. */
static size_t random_text(td_rng *rng, char *buf, size_t cap, int raw)
{
    static const char *const atoms[] = {
        "the", "cat", "a", "aaa", "abc", "ab", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", ".\n", "!\n\n", "'s",
        "'S", "'ll", "'RE", "'", "1", "12", "123", "12345", "4,5", ".", "!?", "é", "façade", "ß", "Жук", "中文",
        "日本語", "😀", "👨‍👩‍👧", "٣", "½", "\xC2\xA0", "\xE3\x80\x80", "e\xCC\x81", "\xC5\xBF", "<|endoftext|>",
        "<|end_of_text|>", "<|begin_of_text|>", "<|", "|>", "<ws> <ws>", "<ws>", "Hello", " world", "don't", "x",
        "$", "\\", "\"", "\xE2\x80\xA8", "\xF0\x9F\x98", "{", "}", "();",
    };
    size_t n = 0, want = td_rng_below(rng, cap - 16);
    while (n < want) {
        if (raw && td_rng_below(rng, 6) == 0) {
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

/* A tokenizer.json made from tests/data/tok/gpt2_prefix (a real prefix of
 * GPT-2): merges as strings or pairs, pre-tokenizer `pattern` (NULL:
 * ByteLevel with its own regex), `added` (NULL: GPT-2's <|endoftext|>). */
static cJSON *gpt2_prefix_doc(const char *pattern, int pairs, const char *added)
{
    spec s = {.pattern = pattern, .pairs = pairs};
    cJSON *doc = make_doc(&s), *model = cJSON_GetObjectItem(doc, "model");
    char *v = td_test_slurp(fixture_path("gpt2_prefix/vocab.json"), NULL);
    char *m = td_test_slurp(fixture_path("gpt2_prefix/merges.txt"), NULL);
    cJSON_ReplaceItemInObject(model, "vocab", cJSON_Parse(v));
    cJSON *merges = cJSON_CreateArray();
    for (char *line = strtok(m, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strncmp(line, "#version", 8)) continue;
        if (!pairs) {
            cJSON_AddItemToArray(merges, cJSON_CreateString(line));
            continue;
        }
        char *sp = strchr(line, ' ');
        *sp = '\0';
        const char *two[2] = {line, sp + 1};
        cJSON_AddItemToArray(merges, cJSON_CreateStringArray(two, 2));
    }
    cJSON_ReplaceItemInObject(model, "merges", merges);
    cJSON_ReplaceItemInObject(doc, "added_tokens",
                              cJSON_Parse(added ? added : "[{\"id\": 50256, \"content\": \"<|endoftext|>\", "
                                                          "\"special\": true, \"normalized\": false}]"));
    free(v);
    free(m);
    return doc;
}

static td_tokenizer *gpt2_files_tok(void)
{
    td_tokenizer *t = NULL;
    TD_ASSERT_OK(td_tokenizer_load_gpt2(fixture_path("gpt2_prefix/vocab.json"),
                                        fixture_path("gpt2_prefix/merges.txt"), &t));
    return t;
}

/* ---- pre-tokenizers ------------------------------------------------------- */

static void check_pretok_case(cJSON *o, void *ctx)
{
    const char *text = cJSON_GetObjectItem(o, "text")->valuestring;
    td_test_pieces *got = ctx;
    td_tokenizer_pretokenize(got->user, text, strlen(text), td_test_collect_piece, got);
    td_test_expect_pieces(text, cJSON_GetObjectItem(o, "pieces"), got);
}

static void pretok_fixture(const char *pattern, const char *fixture)
{
    spec s = {.pattern = pattern};
    td_test_pieces *p = calloc(1, sizeof *p);
    p->user = make_tok(&s);
    int n = for_each_jsonl(fixture, check_pretok_case, p);
    assert_true(n > 300);
    td_tokenizer_destroy(p->user);
    free(p);
}

static void test_pretok_llama3(void **state) { pretok_fixture(LLAMA3, "pretok_llama3.jsonl"); }
static void test_pretok_qwen2(void **state) { pretok_fixture(QWEN2, "pretok_qwen2.jsonl"); }
static void test_pretok_gpt2_split(void **state)
{
    pretok_fixture(GPT2, "pretok_cases.jsonl");
    pretok_fixture(NULL, "pretok_cases.jsonl"); /* ByteLevel's own regex is the same pattern */
}

/* Pieces tile the input for every pattern, invalid UTF-8 included. */
static void test_pretok_tiles(void **state)
{
    const char *patterns[] = {LLAMA3, QWEN2, GPT2};
    char buf[600];
    td_test_pieces *p = calloc(1, sizeof *p);
    for (int k = 0; k < 3; k++) {
        spec s = {.pattern = patterns[k]};
        td_tokenizer *t = make_tok(&s);
        for (int seed = 0; seed < td_test_seeds(200); seed++) {
            td_rng rng;
            td_rng_seed(&rng, (uint64_t)seed + 77);
            size_t n = random_text(&rng, buf, sizeof buf, 1);
            td_tokenizer_pretokenize(t, buf, n, td_test_collect_piece, p);
            size_t at = 0;
            for (int i = 0; i < p->n; i++) {
                assert_true(p->len[i] > 0);
                assert_memory_equal(p->v[i], buf + at, p->len[i]);
                at += p->len[i];
            }
            assert_int_equal(at, n);
            td_test_free_pieces(p);
        }
        td_tokenizer_destroy(t);
    }
    free(p);
}

/* ---- BPE ----------------------------------------------------------------- */

/* ids: bytes are themselves; ab 256, abc 257, Ġab 258, 12 259, 123 260, xyz 261.
 * Merges by rank: a b -> ab, ab c -> abc, Ġ ab -> Ġab, 1 2 -> 12, 12 3 -> 123. */
static const spec HAND = {
    .extra = {"ab", "abc", G "ab", "12", "123", "xyz"},
    .merges = {"a b", "ab c", G " ab", "1 2", "12 3"},
};

static void test_bpe_patterns_and_merge_formats(void **state)
{
    for (int pairs = 0; pairs < 2; pairs++) {
        spec s = HAND;
        s.pairs = pairs;
        s.pattern = LLAMA3; /* " 12345" -> " ", "123", "45" */
        td_tokenizer *t = make_tok(&s);
        assert_int_equal(td_tokenizer_merge_count(t), 5);
        assert_int_equal(td_tokenizer_vocab_size(t), 263); /* 262 + an end-of-text past the largest */
        ASSERT_IDS(t, "abc ab 12345", 257, 258, ' ', 260, '4', '5');
        ASSERT_IDS(t, "xyz", 'x', 'y', 'z'); /* no merges make xyz */
        ASSERT_IDS(t, "ab.\nab", 256, '.', '\n', 256); /* ".\n" is one piece */
        ASSERT_IDS(t, "'ABc", '\'', 'A', 'B', 'c'); /* no contraction: 'A */
        td_tokenizer_destroy(t);

        s.pattern = QWEN2; /* digits one by one */
        t = make_tok(&s);
        ASSERT_IDS(t, "abc ab 12345", 257, 258, ' ', '1', '2', '3', '4', '5');
        td_tokenizer_destroy(t);

        s.pattern = NULL; /* ByteLevel's GPT-2 regex: " 12345" is one piece */
        t = make_tok(&s);
        ASSERT_IDS(t, "abc ab 12345", 257, 258, ' ', 260, '4', '5');
        ASSERT_IDS(t, " 12", ' ', 259);
        td_tokenizer_destroy(t);
    }
}

static void test_ignore_merges(void **state)
{
    spec s = HAND;
    s.pattern = LLAMA3;
    s.ignore_merges = 1;
    td_tokenizer *t = make_tok(&s);
    ASSERT_IDS(t, "xyz xyz", 261, ' ', 'x', 'y', 'z'); /* " xyz" is no token: merged as usual */
    ASSERT_IDS(t, "abc", 257);
    td_tokenizer_destroy(t);
}

/* SmolLM2's pre-tokenizer: Digits, then ByteLevel with the GPT-2 regex. */
static td_tokenizer *digits_tok(int each, int use_regex, int prefix)
{
    char pre[256];
    snprintf(pre, sizeof pre, "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Digits\", "
             "\"individual_digits\": %s}, {\"type\": \"ByteLevel\", \"use_regex\": %s}]}",
             each ? "true" : "false", use_regex ? "true" : "false");
    cJSON *doc = prefix ? gpt2_prefix_doc(NULL, 0, NULL) : NULL;
    if (!doc) {
        spec s = HAND;
        doc = make_doc(&s);
    }
    cJSON_ReplaceItemInObject(doc, "pre_tokenizer", cJSON_Parse(pre));
    td_tokenizer *t = from_doc(doc);
    cJSON_Delete(doc);
    return t;
}

static void test_digits_pretokenizer(void **state)
{
    td_tokenizer *t = digits_tok(1, 1, 0); /* "abc ", "1", "2", ...; then "abc", " " */
    ASSERT_IDS(t, "abc 12345", 257, ' ', '1', '2', '3', '4', '5');
    ASSERT_IDS(t, "x\xC2\xB2", 'x', 0xC2, 0xB2); /* ² is \p{N} */
    td_tokenizer_destroy(t);
    t = digits_tok(0, 1, 0); /* runs: "12345" alone, then 1 2 -> 12, 12 3 -> 123 */
    ASSERT_IDS(t, "abc 12345", 257, ' ', 260, '4', '5');
    assert_int_equal(td_tokenizer_cut_point(t, "a b", 3), 1);
    td_tokenizer_destroy(t);
    t = digits_tok(1, 0, 0); /* no regex: "ab ab" stays one piece, so no cut is safe */
    assert_int_equal(td_tokenizer_cut_point(t, "a b", 3), 0);
    ASSERT_IDS(t, "ab ab1", 256, 258, '1');
    td_tokenizer_destroy(t);
    /* streaming cuts stay exact with Digits before the regex */
    t = digits_tok(1, 1, 1);
    char buf[1024];
    int cuts = 0;
    for (int seed = 0; seed < td_test_seeds(200); seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed + 4242);
        size_t n = random_text(&rng, buf, sizeof buf, 0);
        size_t p = td_tokenizer_cut_point(t, buf, n);
        if (!p) continue;
        cuts++;
        uint32_t *whole, *a, *b;
        size_t nw, na, nb;
        TD_ASSERT_OK(td_tokenizer_encode_alloc(t, buf, n, &whole, &nw));
        TD_ASSERT_OK(td_tokenizer_encode_alloc(t, buf, p, &a, &na));
        TD_ASSERT_OK(td_tokenizer_encode_alloc(t, buf + p, n - p, &b, &nb));
        assert_int_equal(na + nb, nw);
        assert_memory_equal(a, whole, na * sizeof *a);
        assert_memory_equal(b, whole + na, nb * sizeof *b);
        td_free(whole);
        td_free(a);
        td_free(b);
        assert_round_trip(t, buf, n);
    }
    assert_true(cuts > 50);
    td_tokenizer_destroy(t);
}

/* ---- added tokens, bos, eos ---------------------------------------------------- */

#define ADDED_BASE                                                                                           \
    "{\"id\": 300, \"content\": \"<|begin_of_text|>\", \"special\": true, \"normalized\": false},"          \
    "{\"id\": 301, \"content\": \"<|end_of_text|>\", \"special\": true, \"normalized\": false},"            \
    "{\"id\": 302, \"content\": \"<|a|>\", \"special\": true, \"normalized\": false},"                      \
    "{\"id\": 303, \"content\": \"<|a|>b\", \"special\": true, \"normalized\": false},"                     \
    "{\"id\": 304, \"content\": \"ab\", \"special\": false, \"normalized\": true},"                         \
    "{\"id\": 305, \"content\": \"<mask>\", \"special\": true, \"lstrip\": true, \"normalized\": false},"   \
    "{\"id\": 306, \"content\": \"<r>\", \"special\": true, \"rstrip\": true, \"normalized\": false},"      \
    "{\"id\": 307, \"content\": \"word\", \"single_word\": true, \"normalized\": true},"                    \
    "{\"id\": 308, \"content\": \"x<\", \"normalized\": true},"                                             \
    "{\"id\": 309, \"content\": \"<ws> <ws>\", \"normalized\": false},"                                      \
    "{\"id\": 400, \"content\": \"\xE4\xB8\xAD\xE6\x96\x87\", \"normalized\": false}"

#define LLAMA_POST                                                                                      \
    "{\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<|begin_of_text|>\", " \
    "\"type_id\": 0}}, {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}], \"pair\": [], "                   \
    "\"special_tokens\": {\"<|begin_of_text|>\": {\"id\": \"<|begin_of_text|>\", \"ids\": [300], "        \
    "\"tokens\": [\"<|begin_of_text|>\"]}}}"

static td_tokenizer *added_tok(void)
{
    spec s = HAND;
    s.pattern = LLAMA3;
    s.added = "[" ADDED_BASE "]";
    s.post = LLAMA_POST;
    return make_tok(&s);
}

static void test_added_tokens(void **state)
{
    td_tokenizer *t = added_tok();
    assert_int_equal(td_tokenizer_vocab_size(t), 401);
    assert_int_equal(td_tokenizer_eot(t), 301);
    assert_int_equal(td_tokenizer_bos(t), 300);
    ASSERT_IDS(t, "<|begin_of_text|>abc<|end_of_text|>", 300, 304, 'c', 301); /* the added "ab" wins over BPE */
    ASSERT_IDS(t, "y<|a|>by", 'y', 303, 'y');                                   /* the longest at the place */
    ASSERT_IDS(t, "<|a|>c<|a|", 302, 'c', '<', '|', 'a', '|');
    ASSERT_IDS(t, "x<|a|>", 'x', 302); /* normalized false first: "x<" never sees its "<" */
    ASSERT_IDS(t, "x<y", 308, 'y');
    ASSERT_IDS(t, "words word", 'w', 'o', 'r', 'd', 's', ' ', 307); /* single_word skips "words" */
    ASSERT_IDS(t, "word_", 'w', 'o', 'r', 'd', '_');
    ASSERT_IDS(t, "\xE0\xA4\xBEword", 0xE0, 0xA4, 0xBE, 'w', 'o', 'r', 'd'); /* a mark (U+093E) is \w too */
    ASSERT_IDS(t, "\xC2\xB2word", 0xC2, 0xB2, 307);                         /* ² (No) is not */
    ASSERT_IDS(t, "<ws> <ws><ws>", 309, '<', 'w', 's', '>');
    ASSERT_IDS(t, "1中文2", '1', 400, '2');
    ASSERT_IDS(t, "<|endoftext|>", '<', '|', 'e', 'n', 'd', 'o', 'f', 't', 'e', 'x', 't', '|', '>');
    ASSERT_IDS_LOSSY(t, "c  <mask>c", 'c', 305, 'c'); /* lstrip takes the spaces before */
    ASSERT_IDS_LOSSY(t, "<r>  \n c", 306, 'c');      /* rstrip the whitespace after */
    ASSERT_IDS_LOSSY(t, "<r> <mask>", 306, 305);
    size_t len;
    const char *bytes = td_tokenizer_token_bytes(t, 300, &len);
    assert_int_equal(len, 17);
    assert_memory_equal(bytes, "<|begin_of_text|>", 17);
    assert_null(td_tokenizer_token_bytes(t, 350, &len)); /* between the added ids: no token */
    td_tokenizer_destroy(t);
}

static td_tokenizer *tok_with(const char *added, const char *post, const char *config)
{
    spec s = HAND;
    s.added = added;
    s.post = post;
    cJSON *doc = make_doc(&s);
    char *text = cJSON_PrintUnformatted(doc);
    td_tokenizer *t = NULL;
    TD_ASSERT_OK(td_tokenizer_create_json(text, strlen(text), "t.json", config, config ? strlen(config) : 0, &t));
    free(text);
    cJSON_Delete(doc);
    return t;
}

static void test_eos_and_bos_choice(void **state)
{
    /* by name, in the documented order */
    td_tokenizer *t = tok_with("[{\"id\": 270, \"content\": \"</s>\", \"special\": true}, {\"id\": 271, \"content\": "
                               "\"<|endoftext|>\", \"special\": true}]", NULL, NULL);
    assert_int_equal(td_tokenizer_eot(t), 271);
    assert_int_equal(td_tokenizer_bos(t), TD_TOKEN_NONE);
    assert_int_equal(td_tokenizer_vocab_size(t), 272);
    td_tokenizer_destroy(t);
    /* from tokenizer_config.json (string or object) when no name matches */
    const char *mine = "[{\"id\": 280, \"content\": \"<my_eos>\", \"special\": true}]";
    t = tok_with(mine, NULL, "{\"eos_token\": \"<my_eos>\"}");
    assert_int_equal(td_tokenizer_eot(t), 280);
    td_tokenizer_destroy(t);
    t = tok_with(mine, NULL, "{\"eos_token\": {\"content\": \"<my_eos>\", \"lstrip\": false}}");
    assert_int_equal(td_tokenizer_eot(t), 280);
    td_tokenizer_destroy(t);
    /* none: one past the largest id, decoding to the literal, never matched in text */
    t = tok_with(mine, NULL, NULL);
    assert_int_equal(td_tokenizer_eot(t), 281);
    assert_int_equal(td_tokenizer_vocab_size(t), 282);
    size_t len;
    const char *bytes = td_tokenizer_token_bytes(t, 281, &len);
    assert_int_equal(len, 13);
    assert_memory_equal(bytes, "<|endoftext|>", 13);
    ASSERT_IDS(t, "<my_eos>|>", 280, '|', '>');
    td_tokenizer_destroy(t);
    /* bos: Roberta's cls, a Sequence of processors */
    t = tok_with(mine, "{\"type\": \"Sequence\", \"processors\": [{\"type\": \"ByteLevel\"}, {\"type\": "
                       "\"RobertaProcessing\", \"sep\": [\"<my_eos>\", 280], \"cls\": [\"<my_eos>\", 280]}]}", NULL);
    assert_int_equal(td_tokenizer_bos(t), 280);
    td_tokenizer_destroy(t);
    /* a model.vocab token, named in the byte alphabet */
    t = tok_with(NULL, "{\"type\": \"BertProcessing\", \"sep\": [\"x\", 120], \"cls\": [\"" G "ab\", 258]}", NULL);
    assert_int_equal(td_tokenizer_bos(t), 258);
    td_tokenizer_destroy(t);
}

/* ---- NFC ------------------------------------------------------------------------ */

static td_tokenizer *nfc_tok(const char *normalizer, const char *added)
{
    spec s = HAND;
    s.pattern = QWEN2;
    s.added = added;
    cJSON *doc = make_doc(&s);
    cJSON_ReplaceItemInObject(doc, "normalizer", cJSON_Parse(normalizer));
    td_tokenizer *t = from_doc(doc);
    cJSON_Delete(doc);
    return t;
}

static void assert_decodes_to(td_tokenizer *t, const char *text, size_t len, const char *want, size_t want_len)
{
    uint32_t *ids;
    size_t n, got_len;
    char *got;
    TD_ASSERT_OK(td_tokenizer_encode_alloc(t, text, len, &ids, &n));
    TD_ASSERT_OK(td_tokenizer_decode(t, ids, n, &got, &got_len));
    if (got_len != want_len || memcmp(got, want, want_len))
        fail_msg("NFC of '%.*s' came out as '%s', want '%.*s'", (int)len, text, got, (int)want_len, want);
    td_free(got);
    td_free(ids);
}

static void check_nfc_case(cJSON *o, void *ctx)
{
    td_tokenizer *t = ctx;
    const char *text = cJSON_GetObjectItem(o, "text")->valuestring, *nfc = cJSON_GetObjectItem(o, "nfc")->valuestring;
    assert_decodes_to(t, text, strlen(text), nfc, strlen(nfc)); /* byte-level BPE decodes to what it encoded */
}

static void test_nfc_normalizer(void **state)
{
    td_tokenizer *t = nfc_tok("{\"type\": \"NFC\"}", NULL);
    assert_true(for_each_jsonl("nfc_cases.jsonl", check_nfc_case, t) > 600);
    /* invalid bytes pass through and block composition */
    assert_decodes_to(t, "e\xFF\xCC\x81", 4, "e\xFF\xCC\x81", 4);
    assert_decodes_to(t, "e\xCC\x81\xFF", 4, "\xC3\xA9\xFF", 3);
    td_tokenizer_destroy(t);
    /* a Sequence of NFC; special tokens are matched before, normalized ones after NFC */
    t = nfc_tok("{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFC\"}]}",
                "[{\"id\": 300, \"content\": \"<e\\u0301>\", \"special\": true, \"normalized\": false},"
                " {\"id\": 301, \"content\": \"\\u00e9!\", \"normalized\": true}]");
    ASSERT_IDS_LOSSY(t, "<e\xCC\x81>e\xCC\x81!", 300, 301);
    ASSERT_IDS_LOSSY(t, "<\xC3\xA9>", '<', 0xC3, 0xA9, '>');
    td_tokenizer_destroy(t);
    /* without the normalizer nothing changes */
    t = nfc_tok("null", NULL);
    assert_decodes_to(t, "e\xCC\x81", 3, "e\xCC\x81", 3);
    td_tokenizer_destroy(t);
}

/* ---- GPT-2: tokenizer.json and vocab.json + merges.txt agree ------------------ */

typedef struct gpt2_pair {
    td_tokenizer *files, *json;
    int n;
} gpt2_pair;

static void assert_same_ids(td_tokenizer *a, td_tokenizer *b, const char *text, size_t len)
{
    uint32_t *x, *y;
    size_t nx, ny;
    TD_ASSERT_OK(td_tokenizer_encode_alloc(a, text, len, &x, &nx));
    TD_ASSERT_OK(td_tokenizer_encode_alloc(b, text, len, &y, &ny));
    if (nx != ny) fail_msg("%zu tokens from one, %zu from the other for a %zu-byte text", nx, ny, len);
    for (size_t i = 0; i < nx; i++)
        if (x[i] != y[i]) fail_msg("token %zu: %u vs %u", i, x[i], y[i]);
    td_free(x);
    td_free(y);
}

static void check_known(cJSON *o, void *ctx)
{
    gpt2_pair *p = ctx;
    const char *text = cJSON_GetObjectItem(o, "text")->valuestring;
    cJSON *want = cJSON_GetObjectItem(o, "ids");
    uint32_t ids[256];
    int n = cJSON_GetArraySize(want);
    for (int i = 0; i < n; i++) ids[i] = (uint32_t)cJSON_GetArrayItem(want, i)->valueint;
    assert_ids(p->json, text, ids, (size_t)n, 1);
    p->n++;
}

static void test_gpt2_json_matches_files(void **state)
{
    const char *patterns[] = {NULL, GPT2};
    char buf[2048];
    for (int k = 0; k < 4; k++) {
        cJSON *doc = gpt2_prefix_doc(patterns[k & 1], k >> 1, NULL);
        gpt2_pair p = {gpt2_files_tok(), from_doc(doc), 0};
        cJSON_Delete(doc);
        assert_int_equal(td_tokenizer_vocab_size(p.json), td_tokenizer_vocab_size(p.files));
        assert_int_equal(td_tokenizer_eot(p.json), td_tokenizer_eot(p.files));
        assert_int_equal(td_tokenizer_merge_count(p.json), td_tokenizer_merge_count(p.files));
        int lines = for_each_jsonl("gpt2_known.jsonl", check_known, &p);
        assert_true(lines >= 10 && p.n == lines);
        for (int seed = 0; seed < td_test_seeds(100); seed++) {
            td_rng rng;
            td_rng_seed(&rng, (uint64_t)seed + 5);
            size_t n = random_text(&rng, buf, sizeof buf, seed & 1);
            assert_same_ids(p.files, p.json, buf, n);
        }
        td_tokenizer_destroy(p.files);
        td_tokenizer_destroy(p.json);
    }
}

/* ---- round trips and streaming ------------------------------------------------- */

static td_tokenizer *rich_tok(const char *pattern)
{
    cJSON *doc = gpt2_prefix_doc(pattern, 0,
                                 "[{\"id\": 50256, \"content\": \"<|endoftext|>\", \"special\": true, "
                                 "\"normalized\": false}, {\"id\": 50257, \"content\": \"<|begin_of_text|>\", "
                                 "\"special\": true, \"normalized\": false}, {\"id\": 50258, \"content\": \"<ws> "
                                 "<ws>\", \"normalized\": true}, {\"id\": 50259, \"content\": \"\\n\\n\", "
                                 "\"normalized\": true}]");
    td_tokenizer *t = from_doc(doc);
    cJSON_Delete(doc);
    return t;
}

static void test_round_trip_mixed(void **state)
{
    const char *patterns[] = {LLAMA3, QWEN2, GPT2};
    char buf[4096];
    for (int k = 0; k < 3; k++) {
        td_tokenizer *t = rich_tok(patterns[k]);
        const char *fixed = "ASCII words, accents: café naïve Ångström; CJK 中文 日本語 한국어; emoji 😀👍🏽; digits "
                            "1234567890 3.14159; newlines\n\n\r\n  spaces   and\ttabs\t\n<|endoftext|>it's 'S";
        assert_round_trip(t, fixed, strlen(fixed));
        for (int seed = 0; seed < td_test_seeds(150); seed++) {
            td_rng rng;
            td_rng_seed(&rng, (uint64_t)seed + 900);
            size_t n = random_text(&rng, buf, sizeof buf, seed % 3 == 0);
            assert_round_trip(t, buf, n);
        }
        td_tokenizer_destroy(t);
    }
}

/* Encoding up to a cut point and then the rest gives the ids of the whole. */
static void test_cut_point_is_safe(void **state)
{
    const char *patterns[] = {LLAMA3, QWEN2, GPT2};
    char buf[1024];
    for (int k = 0; k < 3; k++) {
        td_tokenizer *t = rich_tok(patterns[k]);
        int cuts = 0;
        for (int seed = 0; seed < td_test_seeds(300); seed++) {
            td_rng rng;
            td_rng_seed(&rng, (uint64_t)seed + 31);
            size_t n = random_text(&rng, buf, sizeof buf, seed & 1);
            size_t c = n ? td_rng_below(&rng, n + 1) : 0;
            size_t p = td_tokenizer_cut_point(t, buf, c);
            if (!p) continue;
            cuts++;
            uint32_t *whole, *a, *b;
            size_t nw, na, nb;
            TD_ASSERT_OK(td_tokenizer_encode_alloc(t, buf, n, &whole, &nw));
            TD_ASSERT_OK(td_tokenizer_encode_alloc(t, buf, p, &a, &na));
            TD_ASSERT_OK(td_tokenizer_encode_alloc(t, buf + p, n - p, &b, &nb));
            if (na + nb != nw) fail_msg("pattern %d seed %d: cut at %zu of %zu gives %zu + %zu ids, whole %zu", k,
                                        seed, p, n, na, nb, nw);
            for (size_t i = 0; i < na; i++) assert_int_equal(a[i], whole[i]);
            for (size_t i = 0; i < nb; i++) assert_int_equal(b[i], whole[na + i]);
            td_free(whole);
            td_free(a);
            td_free(b);
        }
        assert_true(cuts > 100);
        /* where the rule says no: Llama 3 and Qwen2 join a newline to punctuation */
        assert_int_equal(td_tokenizer_cut_point(t, "a.\nb", 4), k < 2 ? 0 : 2);
        assert_int_equal(td_tokenizer_cut_point(t, "a\nb", 3), 1);
        assert_int_equal(td_tokenizer_cut_point(t, "a<ws> <ws>b", 11), 0); /* inside an added token */
        assert_int_equal(td_tokenizer_cut_point(t, "a <ws>", 6), 1);
        assert_int_equal(td_tokenizer_cut_point(t, "a<ws> <w", 8), 0); /* may become one past the end */
        td_tokenizer_destroy(t);
    }
    /* no pattern: the whole text is one piece, so nothing is a safe cut */
    spec s = HAND;
    s.pattern = NULL;
    cJSON *doc = make_doc(&s);
    cJSON *bl = cJSON_GetObjectItem(doc, "pre_tokenizer");
    cJSON_ReplaceItemInObject(bl, "use_regex", cJSON_CreateFalse());
    td_tokenizer *t = from_doc(doc);
    cJSON_Delete(doc);
    assert_int_equal(td_tokenizer_cut_point(t, "a b c", 5), 0);
    ASSERT_IDS(t, "ab ab", 256, 258); /* one piece: a b, a b (leftmost first), then Ġ ab */
    td_tokenizer_destroy(t);
}

/* A Qwen2-sized vocabulary (152k tokens, ids past 65535): all byte pairs and
 * many triples, loaded, encoded and decoded. */
static void test_large_vocab(void **state)
{
    spec s = {.pattern = QWEN2};
    cJSON *doc = make_doc(&s), *model = cJSON_GetObjectItem(doc, "model");
    cJSON *vocab = cJSON_GetObjectItem(model, "vocab"), *merges = cJSON_GetObjectItem(model, "merges");
    char a[4], b[4], c[4], ab[8], abc[12], line[24];
    int id = 256;
    for (int i = 0; i < 256; i++)
        for (int j = 0; j < 256; j++) {
            byte_str(i, a), byte_str(j, b);
            snprintf(ab, sizeof ab, "%s%s", a, b);
            cJSON_AddNumberToObject(vocab, ab, id++);
            snprintf(line, sizeof line, "%s %s", a, b);
            cJSON_AddItemToArray(merges, cJSON_CreateString(line));
        }
    for (int i = 'a'; i <= 'z' && id < 151643; i++)
        for (int j = 0; j < 256 && id < 151643; j++)
            for (int k = 0; k < 256 && id < 151643; k++) {
                byte_str(i, a), byte_str(j, b), byte_str(k, c);
                snprintf(abc, sizeof abc, "%s%s%s", a, b, c);
                cJSON_AddNumberToObject(vocab, abc, id++);
                snprintf(line, sizeof line, "%s%s %s", a, b, c);
                cJSON_AddItemToArray(merges, cJSON_CreateString(line));
            }
    cJSON_ReplaceItemInObject(doc, "added_tokens",
                              cJSON_Parse("[{\"id\": 151643, \"content\": \"<|endoftext|>\", \"special\": true, "
                                          "\"normalized\": false}]"));
    td_tokenizer *t = from_doc(doc);
    cJSON_Delete(doc);
    assert_int_equal(td_tokenizer_vocab_size(t), 151644);
    assert_int_equal(td_tokenizer_eot(t), 151643);
    /* "abc": a b (rank 'a' * 256 + 'b') before b c, then the triple: 256 + 65536 + 'b' * 256 + 'c';
     * "abcd": c d (a pair) ranks before every triple, so ab, cd */
    ASSERT_IDS(t, "abc", 256 + 65536 + 'b' * 256 + 'c');
    ASSERT_IDS(t, "abcd", 256 + 'a' * 256 + 'b', 256 + 'c' * 256 + 'd');
    ASSERT_IDS(t, "zz", 256 + 'z' * 256 + 'z');
    char buf[4096];
    for (int seed = 0; seed < td_test_seeds(40); seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed);
        assert_round_trip(t, buf, random_text(&rng, buf, sizeof buf, 1));
    }
    td_tokenizer_destroy(t);
}

/* ---- files and paths -------------------------------------------------------------- */

static void test_load_from_path(void **state)
{
    char dir[] = "/tmp/td_tokjson_XXXXXX", file[256], other[256];
    assert_non_null(mkdtemp(dir));
    spec s = HAND;
    s.pattern = LLAMA3;
    s.added = "[{\"id\": 290, \"content\": \"<eot>\", \"special\": true}]";
    cJSON *doc = make_doc(&s);
    char *text = cJSON_PrintUnformatted(doc);
    cJSON_Delete(doc);
    snprintf(file, sizeof file, "%s/tokenizer.json", dir);
    FILE *f = fopen(file, "w");
    fputs(text, f);
    fclose(f);
    free(text);
    snprintf(other, sizeof other, "%s/tokenizer_config.json", dir);
    f = fopen(other, "w");
    fputs("{\"eos_token\": \"<eot>\"}", f);
    fclose(f);
    size_t base = td_host_live_allocs();
    char found[512];
    assert_true(td_tokenizer_json_path(dir, found, sizeof found));
    assert_string_equal(found, file);
    assert_true(td_tokenizer_json_path("x/y.json", NULL, 0));
    assert_false(td_tokenizer_json_path("/tmp", NULL, 0));
    assert_false(td_tokenizer_json_path("gpt2", NULL, 0));
    td_tokenizer *t = NULL;
    TD_ASSERT_OK(td_tokenizer_load_json(dir, &t));
    assert_int_equal(td_tokenizer_eot(t), 290); /* named by tokenizer_config.json */
    td_tokenizer_destroy(t);
    TD_ASSERT_OK(td_tokenizer_load_json(file, &t));
    td_tokenizer_destroy(t);
    snprintf(other, sizeof other, "%s/missing.json", dir);
    assert_int_equal(td_tokenizer_load_json(other, &t), TD_ERR_IO);
    assert_null(t);
    assert_non_null(strstr(td_error_msg(), "cannot open tokenizer.json"));
    assert_int_equal(td_tokenizer_load_json("/tmp", &t), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "neither a .json file nor a folder holding tokenizer.json"));
    assert_int_equal(td_host_live_allocs(), base);
    unlink(file);
    snprintf(other, sizeof other, "%s/tokenizer_config.json", dir);
    unlink(other);
    rmdir(dir);
}

/* ---- tidal prepare with a tokenizer.json ------------------------------------------ */

/* Runs `tidal prepare ARGS...` with its output silenced; returns the exit code. */
static int prepare(const char *first, ...)
{
    char *argv[32];
    int argc = 0;
    va_list ap;
    va_start(ap, first);
    for (const char *a = first; a; a = va_arg(ap, const char *)) argv[argc++] = (char *)a;
    va_end(ap);
    fflush(stdout);
    fflush(stderr);
    int out = dup(1), err = dup(2), null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    int rc = td_cli_prepare_main(argc, argv);
    fflush(stdout);
    fflush(stderr);
    dup2(out, 1);
    dup2(err, 2);
    close(out);
    close(err);
    close(null);
    return rc;
}

static void write_file(const char *path, const char *text, size_t len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, len, f), len);
    fclose(f);
}

static void append_ids(uint32_t **v, size_t *n, const uint32_t *ids, size_t k)
{
    *v = realloc(*v, (*n + k + 1) * sizeof **v);
    memcpy(*v + *n, ids, k * sizeof *ids);
    *n += k;
}

/* Documents start with bos and are separated by eos; streaming in 16-byte
 * blocks gives the same ids; the tokenizer.json is kept beside the file. */
static void test_prepare_documents(void **state)
{
    char dir[] = "/tmp/td_tokjson_prep_XXXXXX", path[512], in[512], out[512], kept[512];
    assert_non_null(mkdtemp(dir));
    td_tokenizer *t = added_tok(); /* Llama 3 pattern, bos 300, eos 301 */
    spec s = HAND;
    s.pattern = LLAMA3;
    s.added = "[" ADDED_BASE "]";
    s.post = LLAMA_POST;
    cJSON *doc = make_doc(&s);
    char *json = cJSON_PrintUnformatted(doc);
    cJSON_Delete(doc);
    snprintf(path, sizeof path, "%s/tok", dir);
    mkdir(path, 0777);
    snprintf(path, sizeof path, "%s/tok/tokenizer.json", dir);
    write_file(path, json, strlen(json));
    snprintf(in, sizeof in, "%s/in", dir);
    mkdir(in, 0777);
    char big[6000];
    td_rng rng;
    td_rng_seed(&rng, 99);
    size_t big_len = random_text(&rng, big, sizeof big, 0);
    const char *docs[3] = {"first doc. it's\n", "second <|a|>b 12345 ab.\nab", big};
    size_t lens[3] = {strlen(docs[0]), strlen(docs[1]), big_len};
    uint32_t *want = NULL;
    size_t n_want = 0;
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/in/%d.txt", dir, i);
        write_file(path, docs[i], lens[i]);
        uint32_t sep[2] = {301, 300}, *ids;
        size_t n;
        append_ids(&want, &n_want, sep + (i == 0), i == 0 ? 1 : 2);
        TD_ASSERT_OK(td_tokenizer_encode_alloc(t, docs[i], lens[i], &ids, &n));
        append_ids(&want, &n_want, ids, n);
        td_free(ids);
    }
    snprintf(out, sizeof out, "%s/out.tok", dir);
    snprintf(path, sizeof path, "%s/tok", dir);
    for (int pass = 0; pass < 2; pass++) {
        int rc = pass ? prepare("--input", in, "--out", out, "--tokenizer", path, "--block", "16", NULL)
                      : prepare("--input", in, "--out", out, "--tokenizer", path, NULL);
        assert_int_equal(rc, 0);
        td_tokfile *f = NULL;
        TD_ASSERT_OK(td_tokfile_open(out, &f));
        const td_tokfile_info *info = td_tokfile_get_info(f);
        assert_int_equal(info->tokenizer, TD_TOKENIZER_JSON);
        assert_int_equal(info->vocab_size, 401);
        assert_int_equal(info->eot, 301);
        assert_int_equal(td_tokfile_count(f), n_want);
        for (size_t i = 0; i < n_want; i++)
            if (td_tokfile_at(f, i) != want[i]) fail_msg("pass %d: token %zu is %u, want %u", pass, i,
                                                         td_tokfile_at(f, i), want[i]);
        td_tokfile_close(f);
    }
    /* the file is kept beside the tokens, as it was */
    TD_ASSERT_OK(td_tokfile_tokenizer_path(out, "tokenizer.json", kept, sizeof kept));
    size_t kept_len;
    char *copy = td_test_slurp(kept, &kept_len);
    assert_int_equal(kept_len, strlen(json));
    assert_memory_equal(copy, json, kept_len);
    free(copy);
    /* usage errors: 2; a bad file: 1 */
    snprintf(path, sizeof path, "%s/in", dir); /* a folder without tokenizer.json */
    assert_int_equal(prepare("--input", in, "--out", out, "--tokenizer", path, NULL), 2);
    snprintf(path, sizeof path, "%s/tok/tokenizer.json", dir);
    assert_int_equal(prepare("--input", in, "--out", out, "--tokenizer", path, "--vocab", path, NULL), 2);
    snprintf(path, sizeof path, "%s/bad.json", dir);
    write_file(path, "{\"model\": 1}", 12);
    assert_int_equal(prepare("--input", in, "--out", out, "--tokenizer", path, NULL), 1);
    free(want);
    free(json);
    td_tokenizer_destroy(t);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

/* ---- malformed files ------------------------------------------------------------ */

static void expect_error_text(const char *json, const char *needle)
{
    size_t base = td_host_live_allocs();
    td_tokenizer *t = (td_tokenizer *)1;
    td_status st = td_tokenizer_create_json(json, strlen(json), "bad.json", NULL, 0, &t);
    if (st != TD_ERR_INVALID) fail_msg("expected TD_ERR_INVALID (%s), got %s", needle, td_status_name(st));
    assert_null(t);
    if (!strstr(td_error_msg(), needle)) fail_msg("message '%s' lacks '%s'", td_error_msg(), needle);
    if (!strstr(td_error_msg(), "bad.json")) fail_msg("message '%s' does not name the file", td_error_msg());
    assert_int_equal(td_host_live_allocs(), base);
}

/* A valid Llama 3-style document changed by `edit` (a JSON path and a value,
 * "-" for delete) must fail with `needle`. */
static void expect_error_edit(const char *object, const char *field, const char *value, const char *needle)
{
    spec s = HAND;
    s.pattern = LLAMA3;
    s.added = "[" ADDED_BASE "]";
    s.post = LLAMA_POST;
    cJSON *doc = make_doc(&s), *obj = doc;
    if (object) {
        char path[128];
        snprintf(path, sizeof path, "%s", object);
        for (char *k = strtok(path, "."); k; k = strtok(NULL, "."))
            obj = (*k >= '0' && *k <= '9') ? cJSON_GetArrayItem(obj, atoi(k)) : cJSON_GetObjectItem(obj, k);
    }
    assert_non_null(obj);
    if (!strcmp(value, "-")) cJSON_DeleteItemFromObject(obj, field);
    else {
        cJSON *v = cJSON_Parse(value);
        assert_non_null(v);
        if (cJSON_GetObjectItem(obj, field)) cJSON_ReplaceItemInObject(obj, field, v);
        else cJSON_AddItemToObject(obj, field, v);
    }
    char *text = cJSON_PrintUnformatted(doc);
    cJSON_Delete(doc);
    expect_error_text(text, needle);
    free(text);
}

static void test_malformed_files(void **state)
{
    expect_error_text("{\"model\": {\"type\": \"BPE\", ", "is not valid JSON");
    expect_error_text("", "is not valid JSON");
    expect_error_text("[1, 2]", "is not a JSON object");
    expect_error_text("{\"pre_tokenizer\": {\"type\": \"ByteLevel\"}}", "model is missing");
    expect_error_edit(NULL, "model", "-", "model is missing, expected an object");
    expect_error_edit(NULL, "model", "[]", "model is an array");
    expect_error_edit("model", "type", "\"WordPiece\"", "model.type is \"WordPiece\"; tidal reads only \"BPE\"");
    expect_error_edit("model", "type", "7", "model.type is \"a number\"");
    expect_error_edit("model", "vocab", "-", "model.vocab is missing");
    expect_error_edit("model", "vocab", "[\"a\"]", "model.vocab is an array, expected an object");
    expect_error_edit("model", "vocab", "{\"a\": \"0\"}", "model.vocab: the id of token \"a\" is not an integer");
    expect_error_edit("model", "vocab", "{\"a\": 0}", "lacks the token for byte 0x00");
    expect_error_edit("model", "vocab", "{}", "model.vocab has no tokens");
    expect_error_edit("model", "merges", "-", "model.merges is missing");
    expect_error_edit("model", "merges", "\"a b\"", "model.merges is a string, expected an array");
    expect_error_edit("model", "merges", "[\"a b\", \"a  b\"]", "model.merges[1] is \"a  b\", expected \"A B\"");
    expect_error_edit("model", "merges", "[\"ab\"]", "model.merges[0] is \"ab\", expected");
    expect_error_edit("model", "merges", "[[\"a\"]]", "model.merges[0] is not a pair of strings");
    expect_error_edit("model", "merges", "[[\"a\", 1]]", "model.merges[0] is not a pair of strings");
    expect_error_edit("model", "merges", "[3]", "model.merges[0] is a number");
    expect_error_edit("model", "merges", "[\"a c\"]", "model.merges[0] (\"a\" \"c\"): the merged token \"ac\" is not in "
                                                      "model.vocab");
    expect_error_edit("model", "merges", "[\"a zq\"]", "model.merges[0] (\"a\" \"zq\"): \"zq\" is not in model.vocab");
    expect_error_edit("model", "merges", "[[\"qz\", \"b\"]]", "\"qz\" is not in model.vocab");
    expect_error_edit("model", "merges", "[\"a \xE2\x82\xAC\"]", "(U+20AC) outside GPT-2's byte-to-unicode alphabet");
    expect_error_edit("model", "dropout", "0.1", "model.dropout is set");
    expect_error_edit("model", "continuing_subword_prefix", "\"##\"", "model.continuing_subword_prefix is set");
    expect_error_edit("model", "ignore_merges", "\"yes\"", "model.ignore_merges is a string, expected true or false");
    expect_error_edit(NULL, "normalizer", "{\"type\": \"NFKC\"}", "normalizer \"NFKC\" is not supported");
    expect_error_edit(NULL, "normalizer", "{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFC\"}, {\"type\": "
                      "\"Lowercase\"}]}", "normalizer \"Lowercase\" is not supported");
    { /* NFC with a normalized added token that is not NFC */
        spec s = HAND;
        s.pattern = QWEN2;
        s.added = "[{\"id\": 300, \"content\": \"e\\u0301!\", \"normalized\": true}]";
        cJSON *doc = make_doc(&s);
        cJSON_ReplaceItemInObject(doc, "normalizer", cJSON_Parse("{\"type\": \"NFC\"}"));
        char *text = cJSON_PrintUnformatted(doc);
        cJSON_Delete(doc);
        expect_error_text(text, "added_tokens[0] \"e\xCC\x81!\" is normalized but not in NFC");
        free(text);
    }
    expect_error_edit(NULL, "decoder", "{\"type\": \"WordPiece\"}", "decoder \"WordPiece\" is not supported");
    expect_error_edit(NULL, "pre_tokenizer", "-", "pre_tokenizer is missing");
    { /* a Split without the ByteLevel after it */
        spec s = HAND;
        s.pattern = LLAMA3;
        cJSON *doc = make_doc(&s);
        cJSON_DeleteItemFromArray(cJSON_GetObjectItem(cJSON_GetObjectItem(doc, "pre_tokenizer"), "pretokenizers"), 1);
        char *text = cJSON_PrintUnformatted(doc);
        cJSON_Delete(doc);
        expect_error_text(text, "pre_tokenizer has no ByteLevel step");
        free(text);
    }
    expect_error_edit(NULL, "pre_tokenizer", "{\"type\": \"Whitespace\"}",
                      "pre_tokenizer: pre-tokenizer type \"Whitespace\" is not supported");
    expect_error_edit(NULL, "pre_tokenizer", "{\"type\": \"ByteLevel\", \"add_prefix_space\": true}",
                      "pre_tokenizer.add_prefix_space is true");
    expect_error_edit(NULL, "pre_tokenizer", "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"ByteLevel\", "
                      "\"use_regex\": false}, {\"type\": \"Split\", \"pattern\": {\"Regex\": \"\\\\s+\"}, \"behavior\": "
                      "\"Isolated\"}]}", "pre_tokenizer.pretokenizers[0]: ByteLevel must be the last pre-tokenizer");
    expect_error_edit("pre_tokenizer.pretokenizers.0.pattern", "Regex", "\"\\\\p{L}+|\\\\s+\"",
                      "pre_tokenizer.pretokenizers[0]: unknown Split pattern \"\\p{L}+|\\s+\"; tidal implements the "
                      "GPT-2, Llama 3 and Qwen2 patterns");
    expect_error_edit("pre_tokenizer.pretokenizers.0", "behavior", "\"Removed\"", "behavior \"Removed\"");
    expect_error_edit("pre_tokenizer.pretokenizers.0", "invert", "true", "invert true");
    expect_error_edit("pre_tokenizer.pretokenizers.0", "pattern", "{\"String\": \" \"}", "splits on the string \" \"");
    expect_error_edit("pre_tokenizer.pretokenizers.0", "pattern", "{}", "pattern.Regex is missing");
    expect_error_edit("pre_tokenizer.pretokenizers.1", "type", "\"Metaspace\"", "pre-tokenizer type \"Metaspace\"");
    expect_error_edit("pre_tokenizer", "pretokenizers", "{}", "pre_tokenizer.pretokenizers is an object");
    expect_error_edit(NULL, "added_tokens", "{}", "added_tokens is an object, expected an array");
    expect_error_edit("added_tokens.0", "id", "\"300\"", "added_tokens[0].id is a string, expected an integer");
    expect_error_edit("added_tokens.1", "id", "-1", "added_tokens[1].id is out of range");
    expect_error_edit("added_tokens.2", "content", "-", "added_tokens[2].content is missing");
    expect_error_edit("added_tokens.2", "content", "\"\"", "added_tokens[2].content is empty");
    expect_error_edit("added_tokens.2", "special", "1", "added_tokens[2].special is a number, expected true or false");
    expect_error_edit("added_tokens.2", "id", "97", "added_tokens[2] \"<|a|>\" has id 97, which model.vocab gives to "
                                                   "\"a\"");
    expect_error_edit("added_tokens.3", "id", "302", "which an earlier added token has \"<|a|>\"");
    expect_error_edit("added_tokens.3", "content", "\"<|a|>\"", "added_tokens[3]: \"<|a|>\" is added twice");
    expect_error_edit("post_processor.single.0.SpecialToken", "id", "\"<nope>\"",
                      "post_processor begins a text with \"<nope>\", which is not a token of the file");
    expect_error_edit("post_processor", "single", "[{\"SpecialToken\": {\"id\": \"<|a|>\"}}, {\"SpecialToken\": "
                      "{\"id\": \"<|a|>\"}}, {\"Sequence\": {\"id\": \"A\"}}]", "puts 2 tokens before $A");
}

/* Truncated and byte-flipped files load or fail cleanly, and what loads encodes. */
static void test_mutated_files(void **state)
{
    spec s = HAND;
    s.pattern = LLAMA3;
    s.added = "[" ADDED_BASE "]";
    s.post = LLAMA_POST;
    cJSON *doc = make_doc(&s);
    char *text = cJSON_Print(doc);
    cJSON_Delete(doc);
    size_t len = strlen(text), base = td_host_live_allocs();
    int ok = 0, failed = 0;
    char *copy = malloc(len + 1);
    for (int seed = 0; seed < td_test_seeds(300); seed++) {
        td_rng rng;
        td_rng_seed(&rng, (uint64_t)seed);
        memcpy(copy, text, len + 1);
        size_t use = len;
        if (seed % 2 == 0) use = td_rng_below(&rng, len);
        else
            for (int k = 0; k < 1 + (int)td_rng_below(&rng, 3); k++)
                copy[td_rng_below(&rng, len)] = "\"{}[],: 0a\\\xC4"[td_rng_below(&rng, 12)];
        td_tokenizer *t = NULL;
        td_status st = td_tokenizer_create_json(copy, use, "m.json", NULL, 0, &t);
        if (st == TD_OK) {
            ok++;
            const char *x = "it's a test <|a|>b 123\n";
            uint32_t *ids;
            size_t n;
            TD_ASSERT_OK(td_tokenizer_encode_alloc(t, x, strlen(x), &ids, &n));
            td_free(ids);
            td_tokenizer_destroy(t);
        } else {
            failed++;
            assert_null(t);
            assert_non_null(strstr(td_error_msg(), "m.json"));
        }
    }
    assert_true(ok > 0 && failed > 0);
    assert_int_equal(td_host_live_allocs(), base);
    free(copy);
    free(text);
}

/* The n-th allocation fails, for every n: an error, never a leak. */
static void test_alloc_faults(void **state)
{
    cJSON *doc = gpt2_prefix_doc(LLAMA3, 1, NULL);
    char *json = cJSON_PrintUnformatted(doc);
    cJSON_Delete(doc);
    const char *text = "Fault injection: it's the test's job, 12345 times.<|endoftext|>";
    size_t want = 0;
    {
        td_tokenizer *t = NULL;
        uint32_t *ids = NULL;
        TD_ASSERT_OK(td_tokenizer_create_json(json, strlen(json), "f", NULL, 0, &t));
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
        td_status st = td_tokenizer_create_json(json, strlen(json), "f", NULL, 0, &t);
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
    free(json);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pretok_llama3),
        cmocka_unit_test(test_pretok_qwen2),
        cmocka_unit_test(test_pretok_gpt2_split),
        cmocka_unit_test(test_pretok_tiles),
        cmocka_unit_test(test_bpe_patterns_and_merge_formats),
        cmocka_unit_test(test_ignore_merges),
        cmocka_unit_test(test_digits_pretokenizer),
        cmocka_unit_test(test_added_tokens),
        cmocka_unit_test(test_eos_and_bos_choice),
        cmocka_unit_test(test_nfc_normalizer),
        cmocka_unit_test(test_gpt2_json_matches_files),
        cmocka_unit_test(test_round_trip_mixed),
        cmocka_unit_test(test_cut_point_is_safe),
        cmocka_unit_test(test_large_vocab),
        cmocka_unit_test(test_load_from_path),
        cmocka_unit_test(test_prepare_documents),
        cmocka_unit_test(test_malformed_files),
        cmocka_unit_test(test_mutated_files),
        cmocka_unit_test(test_alloc_faults),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
