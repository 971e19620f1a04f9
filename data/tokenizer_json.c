/* Hugging Face tokenizer.json: byte-level BPE (see include/tidal/tokenizer.h).
 *
 * The file is read into the same struct td_tokenizer as vocab.json +
 * merges.txt (data/tokenizer_internal.h), so BPE, the piece cache and
 * decoding are data/tokenizer.c's.  What only tokenizer.json has lives here:
 *   - the pre-tokenizer: each Split pattern tidal knows (GPT-2, Llama 3,
 *     Qwen2) is a hand-written scanner over Unicode classes, picked by
 *     comparing the pattern string; no regex engine, so a pattern not in the
 *     table is refused by name rather than run approximately;
 *   - added tokens, matched like tokenizers' AddedVocabulary: first the
 *     tokens with normalized false, then in the text between those the ones
 *     with normalized true (no normalizer is supported, so both see the raw
 *     text); leftmost match first, the longest at that place; single_word,
 *     lstrip and rstrip as there;
 *   - bos from a TemplateProcessing / Roberta / Bert post-processor, eos by
 *     name (the header lists the names).
 * Matching added tokens scans the text once per set with a first-byte table
 * and, per first byte, the candidates longest first: added tokens are few
 * (hundreds), and most bytes start none of them. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "tidal/alloc.h"
#include "tidal/tokenizer.h"
#include "tokenizer_internal.h"

#define WHAT_BYTES 1200

/* For functions without a cleanup label: return a failed call's status. */
#define TRY(expr)                                                             \
    do {                                                                      \
        td_status st_ = (expr);                                               \
        if (st_ != TD_OK) return st_;                                         \
    } while (0)

/* The Split patterns tidal implements, as they appear (JSON-decoded) in
 * tokenizer.json files. */
#define PATTERN_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define PATTERN_LLAMA3                                                                                    \
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|" \
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define PATTERN_QWEN2                                                                                \
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|" \
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

typedef struct added_tok {
    uint32_t id;
    uint8_t special, lstrip, rstrip, single_word, normalized;
    uint8_t ascii_space; /* holds an ASCII whitespace byte: may cover a streaming cut */
} added_tok;

/* One matching set: tokens bucketed by first byte, longest first in a bucket. */
typedef struct match_set {
    uint32_t *order; /* indices into td_tok_json.tok */
    uint32_t first[257]; /* bucket b is order[first[b], first[b + 1]) */
    size_t n;
} match_set;

struct td_tok_json {
    added_tok *tok;
    size_t n;
    match_set set[2]; /* [0] normalized false, [1] normalized true: matched in that order */
    int newline_guard; /* a Llama 3 / Qwen2 stage: a newline after punctuation joins it */
    int pattern_stage; /* a regex stage: whitespace between words always ends a piece */
    int nfc;           /* normalizer NFC: applied where tokenizers applies it (below) */
    td_tok_nfc_buf nfc_buf;
    size_t max_len;
};

/* ---- the Llama 3 / Qwen2 pre-tokenizers ------------------------------------ */

/* Simple case folding for the letters of the contractions: ASCII, and
 * U+017F (long s), which folds to 's' in Oniguruma's (?i). */
static uint32_t fold(uint32_t cp)
{
    if (cp >= 'A' && cp <= 'Z') return cp | 0x20;
    if (cp == 0x17F) return 's';
    return cp;
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d) at i (s[i] == '\''): the match's end, or 0. */
static size_t contraction(const unsigned char *s, size_t len, size_t i)
{
    size_t j = i + 1, n1, n2;
    if (j >= len) return 0;
    uint32_t a = fold(td_tok_utf8_at(s, len, j, &n1));
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return j + n1;
    if (j + n1 >= len) return 0;
    uint32_t b = fold(td_tok_utf8_at(s, len, j + n1, &n2));
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return j + n1 + n2;
    return 0;
}

/* End of the run of class `cls` starting at j, at most `max` chars. */
static size_t run_end(const unsigned char *s, size_t len, size_t j, int cls, size_t max)
{
    size_t n;
    for (size_t k = 0; k < max && j < len && td_tok_class_at(s, len, j, &n) == cls; k++) j += n;
    return j;
}

/* The Llama 3 pattern with at most `digits` numbers a piece (3; Qwen2: 1).
 * The alternatives in order, each tried where the one before fails:
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)     contractions, any case
 *   [^\r\n\p{L}\p{N}]?\p{L}+         letters, after at most one char that is
 *                                    no letter, number or newline (a space,
 *                                    a tab, a quote, ...)
 *   \p{N}{1,digits}                  numbers, in groups
 *   ' '?[^\s\p{L}\p{N}]+[\r\n]*      punctuation with the newlines after it
 *   \s*[\r\n]+                       whitespace up to its last newline
 *   \s+(?!\S) | \s+                  whitespace, leaving the last char to
 *                                    lead the next word (as GPT-2) */
static size_t pretok_llama(const unsigned char *s, size_t len, size_t i, size_t digits)
{
    size_t n0, n1;
    uint32_t c0 = td_tok_utf8_at(s, len, i, &n0);
    if (c0 == '\'') {
        size_t e = contraction(s, len, i);
        if (e) return e;
    }
    int cls0 = td_tok_class(c0);
    size_t j = i + n0;
    if (cls0 == TD_TOK_LETTER) return run_end(s, len, j, TD_TOK_LETTER, SIZE_MAX);
    int cls1 = j < len ? td_tok_class_at(s, len, j, &n1) : -1;
    if (cls0 != TD_TOK_NUMBER && c0 != '\r' && c0 != '\n' && cls1 == TD_TOK_LETTER)
        return run_end(s, len, j + n1, TD_TOK_LETTER, SIZE_MAX);
    if (cls0 == TD_TOK_NUMBER) return run_end(s, len, j, TD_TOK_NUMBER, digits - 1);
    if (cls0 == TD_TOK_OTHER || (c0 == ' ' && cls1 == TD_TOK_OTHER)) {
        size_t e = run_end(s, len, c0 == ' ' ? j : i, TD_TOK_OTHER, SIZE_MAX);
        while (e < len && (s[e] == '\r' || s[e] == '\n')) e++;
        return e;
    }
    /* c0 is whitespace */
    size_t last = i, after_newline = 0, n;
    for (j = i; j < len && td_tok_class_at(s, len, j, &n) == TD_TOK_SPACE; j += n) {
        last = j;
        if (s[j] == '\r' || s[j] == '\n') after_newline = j + 1;
    }
    if (after_newline) return after_newline;
    if (j == len || last == i) return j;
    return last;
}

static size_t pretok_llama3(const unsigned char *s, size_t len, size_t i) { return pretok_llama(s, len, i, 3); }
static size_t pretok_qwen2(const unsigned char *s, size_t len, size_t i) { return pretok_llama(s, len, i, 1); }

/* tokenizers' Digits pre-tokenizer: numbers (\p{N}) apart from the rest,
 * each on its own (individual_digits) or in runs. */
static size_t pretok_digits(const unsigned char *s, size_t len, size_t i, int each)
{
    size_t n;
    int digit = td_tok_class_at(s, len, i, &n) == TD_TOK_NUMBER;
    if (digit && each) return i + n;
    for (i += n; i < len && (td_tok_class_at(s, len, i, &n) == TD_TOK_NUMBER) == digit; i += n) {}
    return i;
}

static size_t pretok_digit_each(const unsigned char *s, size_t len, size_t i) { return pretok_digits(s, len, i, 1); }
static size_t pretok_digit_runs(const unsigned char *s, size_t len, size_t i) { return pretok_digits(s, len, i, 0); }

/* ---- added tokens ------------------------------------------------------- */

static const char *added_bytes(const td_tokenizer *t, const added_tok *a, size_t *len)
{
    *len = t->tok_len[a->id];
    return t->pool + t->tok_off[a->id];
}

/* The code point that ends at p (> 0) in s. */
static uint32_t cp_ending_at(const unsigned char *s, size_t p)
{
    for (size_t k = 1; k <= 4 && k <= p; k++) {
        if ((s[p - k] & 0xC0) == 0x80 && k < 4) continue;
        size_t n;
        uint32_t cp = td_tok_utf8_at(s, p, p - k, &n);
        return n == k ? cp : TD_TOK_CP_INVALID;
    }
    return TD_TOK_CP_INVALID;
}

/* The leftmost match of set m in s[from, len), the longest there: its start,
 * end and token index; 0 when none. */
static int find_added(const td_tokenizer *t, const match_set *m, const unsigned char *s, size_t len, size_t from,
                      size_t *start, size_t *end, uint32_t *which)
{
    const struct td_tok_json *j = t->json;
    for (size_t q = from; q < len; q++) {
        uint32_t lo = m->first[s[q]], hi = m->first[s[q] + 1];
        for (uint32_t k = lo; k < hi; k++) {
            size_t n;
            const char *b = added_bytes(t, &j->tok[m->order[k]], &n);
            if (n <= len - q && !memcmp(s + q, b, n)) {
                *start = q;
                *end = q + n;
                *which = m->order[k];
                return 1;
            }
        }
    }
    return 0;
}

/* Splits s[0, len) at the added tokens of set `level` (as tokenizers'
 * AddedVocabulary::find_matches), emitting them and passing the text
 * between them to the next level (the next set, then pre-tokenization).
 * The normalizer runs where tokenizers runs it: on the text between the
 * tokens of set 0, before set 1 (normalized tokens) is looked for. */
static td_status encode_level(td_tokenizer *t, const unsigned char *s, size_t len, int level)
{
    if (level == 2) return td_tok_encode_plain(t, s, len);
    struct td_tok_json *j = t->json;
    if (level == 1 && j->nfc && !td_tok_nfc_quick(s, len)) {
        const char *norm;
        td_status st = td_tok_nfc(s, len, &j->nfc_buf, &norm, &len);
        if (st != TD_OK) return st;
        s = (const unsigned char *)norm;
    }
    const match_set *m = &j->set[level];
    size_t done = 0, from = 0, ms, me, n;
    uint32_t k;
    td_status st = TD_OK;
    while (m->n && st == TD_OK && t->sink_status == TD_OK && find_added(t, m, s, len, from, &ms, &me, &k)) {
        const added_tok *a = &j->tok[k];
        from = me;
        if (a->single_word && ((ms > 0 && td_tok_is_word(cp_ending_at(s, ms))) ||
                               (me < len && td_tok_is_word(td_tok_utf8_at(s, len, me, &n)))))
            continue;
        size_t start = ms, stop = me;
        if (a->lstrip) {
            while (start > done && td_tok_class(cp_ending_at(s, start)) == TD_TOK_SPACE) {
                uint32_t cp = cp_ending_at(s, start);
                start -= cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
            }
        }
        if (a->rstrip)
            while (stop < len && td_tok_class_at(s, len, stop, &n) == TD_TOK_SPACE) stop += n;
        if (done < start) st = encode_level(t, s + done, start - done, level + 1);
        if (st == TD_OK) td_tok_emit(t, a->id);
        done = from = stop;
    }
    if (st == TD_OK && done < len) st = encode_level(t, s + done, len - done, level + 1);
    return st;
}

td_status td_tok_json_encode(td_tokenizer *t, const unsigned char *s, size_t len)
{
    return encode_level(t, s, len, 0);
}

/* A cut at p (s[p] ASCII whitespace, non-whitespace on both sides) is safe
 * for the patterns (GPT-2's rule, plus Llama 3 / Qwen2 joining newlines to
 * the punctuation before them) and when no added token can cover s[p] or
 * swallow it (rstrip) from the left. */
int td_tok_json_cut_ok(const td_tokenizer *t, const unsigned char *s, size_t len, size_t p)
{
    const struct td_tok_json *j = t->json;
    if (!j->pattern_stage) return 0; /* words and the space between them may be one piece */
    if (j->newline_guard && (s[p] == '\r' || s[p] == '\n') && td_tok_class(cp_ending_at(s, p)) == TD_TOK_OTHER)
        return 0;
    for (size_t i = 0; i < j->n; i++) {
        size_t n;
        if (!j->tok[i].rstrip && !j->tok[i].ascii_space) continue;
        const unsigned char *b = (const unsigned char *)added_bytes(t, &j->tok[i], &n);
        if (j->tok[i].rstrip && p >= n && !memcmp(s + p - n, b, n)) return 0;
        for (size_t k = 0; k < n && j->tok[i].ascii_space; k++) {
            if (b[k] != s[p] || k > p) continue;
            size_t at = p - k, have = len - at < n ? len - at : n; /* a match may end past len */
            if (!memcmp(s + at, b, have)) return 0;
        }
    }
    return 1;
}

void td_tok_json_free(struct td_tok_json *j)
{
    if (!j) return;
    td_free(j->tok);
    td_free(j->set[0].order);
    td_free(j->set[1].order);
    td_tok_nfc_buf_free(&j->nfc_buf);
    td_free(j);
}

/* ---- reading tokenizer.json ---------------------------------------------- */

typedef struct reader {
    td_tokenizer *t;
    const char *name;
    char what[WHAT_BYTES];
} reader;

static const char *type_of(const cJSON *o)
{
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
    return cJSON_IsString(ty) ? ty->valuestring : NULL;
}

static const char *json_type_name(const cJSON *v)
{
    if (!v) return "missing";
    if (cJSON_IsNull(v)) return "null";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsArray(v)) return "an array";
    return "an object";
}

/* A boolean field, `dflt` when missing or null. */
static td_status get_bool(const reader *r, const cJSON *o, const char *field, const char *path, int dflt, int *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, field);
    if (!v || cJSON_IsNull(v)) *out = dflt;
    else if (cJSON_IsBool(v)) *out = cJSON_IsTrue(v);
    else return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s.%s is %s, expected true or false", r->name,
                             path, field, json_type_name(v));
    return TD_OK;
}

static td_status add_stage(reader *r, td_tok_pretok_fn fn, const char *path)
{
    td_tokenizer *t = r->t;
    if (t->n_pretok == TD_TOK_MAX_STAGES)
        return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s: more than %d pre-tokenizer patterns", r->name,
                            path, TD_TOK_MAX_STAGES);
    t->pretok[t->n_pretok++] = fn;
    if (fn == pretok_llama3 || fn == pretok_qwen2) t->json->newline_guard = 1;
    if (fn != pretok_digit_each && fn != pretok_digit_runs) t->json->pattern_stage = 1;
    return TD_OK;
}

/* One pre-tokenizer (`last`: the final one of its sequence, where ByteLevel
 * must be); sets *byte_level when it is ByteLevel. */
static td_status read_pretok(reader *r, const cJSON *p, const char *path, int last, int *byte_level)
{
    const char *ty = type_of(p);
    if (!ty)
        return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s has no \"type\" (expected ByteLevel, Split or "
                            "Sequence)", r->name, path);
    if (!strcmp(ty, "ByteLevel")) {
        int prefix, use_regex;
        TRY(get_bool(r, p, "add_prefix_space", path, 0, &prefix));
        TRY(get_bool(r, p, "use_regex", path, 1, &use_regex));
        if (prefix)
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s.add_prefix_space is true; tidal supports "
                                "only false (a prefix space would change each streamed block)", r->name, path);
        if (!last)
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s: ByteLevel must be the last pre-tokenizer "
                                "of the sequence", r->name, path);
        *byte_level = 1;
        return use_regex ? add_stage(r, td_tok_pretok_gpt2, path) : TD_OK;
    }
    if (!strcmp(ty, "Split")) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(p, "pattern");
        const cJSON *re = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
        const cJSON *str = cJSON_GetObjectItemCaseSensitive(pat, "String");
        const cJSON *beh = cJSON_GetObjectItemCaseSensitive(p, "behavior");
        int invert;
        TRY(get_bool(r, p, "invert", path, 0, &invert));
        if (cJSON_IsString(str))
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s splits on the string \"%.60s\"; tidal "
                                "supports Split only with the GPT-2, Llama 3 or Qwen2 regex", r->name, path,
                                str->valuestring);
        if (!cJSON_IsString(re))
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s.pattern.Regex is %s, expected a string",
                                r->name, path, json_type_name(re));
        if (!cJSON_IsString(beh) || strcmp(beh->valuestring, "Isolated") || invert)
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s: behavior \"%s\"%s; tidal supports "
                                "behavior \"Isolated\" with invert false", r->name, path,
                                cJSON_IsString(beh) ? beh->valuestring : "(missing)", invert ? ", invert true" : "");
        td_tok_pretok_fn fn = !strcmp(re->valuestring, PATTERN_GPT2)     ? td_tok_pretok_gpt2
                              : !strcmp(re->valuestring, PATTERN_LLAMA3) ? pretok_llama3
                              : !strcmp(re->valuestring, PATTERN_QWEN2)  ? pretok_qwen2
                                                                         : NULL;
        if (!fn)
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s: unknown Split pattern \"%.300s\"; tidal "
                                "implements the GPT-2, Llama 3 and Qwen2 patterns (docs/data.md lists them)",
                                r->name, path, re->valuestring);
        return add_stage(r, fn, path);
    }
    if (!strcmp(ty, "Digits")) { /* SmolLM2: Digits(individual_digits) before ByteLevel */
        int each;
        TRY(get_bool(r, p, "individual_digits", path, 0, &each));
        return add_stage(r, each ? pretok_digit_each : pretok_digit_runs, path);
    }
    if (!strcmp(ty, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(p, "pretokenizers");
        if (!cJSON_IsArray(list))
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s.pretokenizers is %s, expected an array",
                                r->name, path, json_type_name(list));
        int i = 0, n = cJSON_GetArraySize(list);
        for (const cJSON *e = list->child; e; e = e->next, i++) {
            char sub[256];
            snprintf(sub, sizeof sub, "%.200s.pretokenizers[%d]", path, i);
            TRY(read_pretok(r, e, sub, last && i == n - 1, byte_level));
        }
        return TD_OK;
    }
    return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s: pre-tokenizer type \"%s\" is not supported "
                        "(tidal reads ByteLevel, Split with the GPT-2, Llama 3 or Qwen2 pattern, Digits and Sequence)",
                        r->name, path, ty);
}

static td_status read_pre_tokenizer(reader *r, const cJSON *root)
{
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer");
    int byte_level = 0;
    if (!p || cJSON_IsNull(p))
        return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': pre_tokenizer is %s; a byte-level BPE has a "
                            "ByteLevel pre-tokenizer", r->name, json_type_name(p));
    if (!cJSON_IsObject(p))
        return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': pre_tokenizer is %s, expected an object", r->name,
                            json_type_name(p));
    TRY(read_pretok(r, p, "pre_tokenizer", 1, &byte_level));
    if (!byte_level)
        return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': pre_tokenizer has no ByteLevel step; tidal reads "
                            "byte-level BPE only", r->name);
    return TD_OK;
}

/* normalizer null or NFC (alone or in a Sequence); decoder ByteLevel (or
 * null, or a Sequence of ByteLevel). */
static td_status read_normalizer_decoder(reader *r, const cJSON *root)
{
    const cJSON *nm = cJSON_GetObjectItemCaseSensitive(root, "normalizer");
    const char *nty = nm && !cJSON_IsNull(nm) ? type_of(nm) : NULL;
    if (nty && !strcmp(nty, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(nm, "normalizers");
        for (const cJSON *e = cJSON_IsArray(list) ? list->child : NULL; e; e = e->next)
            if (!(nty = type_of(e)) || strcmp(nty, "NFC")) goto bad_normalizer;
        r->t->json->nfc = cJSON_GetArraySize(list) > 0;
    } else if (nty && !strcmp(nty, "NFC")) {
        r->t->json->nfc = 1;
    } else if (nm && !cJSON_IsNull(nm)) {
    bad_normalizer:
        return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': normalizer \"%s\" is not supported (tidal reads "
                            "tokenizers without a normalizer or with NFC)", r->name, nty ? nty : json_type_name(nm));
    }
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(root, "decoder");
    if (!d || cJSON_IsNull(d)) return TD_OK;
    const char *ty = type_of(d);
    if (ty && !strcmp(ty, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(d, "decoders");
        for (const cJSON *e = cJSON_IsArray(list) ? list->child : NULL; e; e = e->next)
            if (!type_of(e) || strcmp(type_of(e), "ByteLevel")) {
                ty = type_of(e);
                goto bad;
            }
        return TD_OK;
    }
    if (ty && !strcmp(ty, "ByteLevel")) return TD_OK;
bad:
    return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': decoder \"%s\" is not supported (a byte-level BPE "
                        "decodes with ByteLevel)", r->name, ty ? ty : "(no type)");
}

/* An id field: an integer in [0, TD_TOKENIZER_MAX_VOCAB - 1). */
static int valid_id(const cJSON *v)
{
    return cJSON_IsNumber(v) && v->valuedouble >= 0 && v->valuedouble < TD_TOKENIZER_MAX_VOCAB - 1 &&
           v->valuedouble == (double)(uint32_t)v->valuedouble;
}

/* Validates added_tokens; its largest id and total content bytes. */
static td_status scan_added(const reader *r, const cJSON *added, double *max_id, size_t *bytes)
{
    int i = 0;
    for (const cJSON *e = added ? added->child : NULL; e; e = e->next, i++) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (!cJSON_IsObject(e))
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': added_tokens[%d] is %s, expected an object",
                                r->name, i, json_type_name(e));
        if (!valid_id(id))
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': added_tokens[%d].id is %s, expected an integer "
                                "in [0, %u)", r->name, i, cJSON_IsNumber(id) ? "out of range" : json_type_name(id),
                                TD_TOKENIZER_MAX_VOCAB - 1);
        if (!cJSON_IsString(c) || !c->valuestring[0])
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': added_tokens[%d].content is %s, expected a "
                                "non-empty string", r->name, i, cJSON_IsString(c) ? "empty" : json_type_name(c));
        if (id->valuedouble > *max_id) *max_id = id->valuedouble;
        *bytes += strlen(c->valuestring);
    }
    return TD_OK;
}

static td_status build_set(td_tokenizer *t, match_set *m, int normalized)
{
    struct td_tok_json *j = t->json;
    m->order = td_malloc((j->n ? j->n : 1) * sizeof *m->order, TD_ROLE_META);
    if (!m->order) return td_error_set(TD_ERR_NOMEM, "out of memory for %zu added tokens", j->n);
    /* bucket by first byte (counting sort), then longest first in each bucket */
    uint32_t count[257] = {0};
    for (size_t i = 0; i < j->n; i++)
        if (j->tok[i].normalized == normalized) count[(unsigned char)t->pool[t->tok_off[j->tok[i].id]] + 1]++;
    m->first[0] = 0;
    for (int b = 1; b <= 256; b++) m->first[b] = m->first[b - 1] + count[b];
    uint32_t fill[256];
    memcpy(fill, m->first, sizeof fill);
    for (size_t i = 0; i < j->n; i++)
        if (j->tok[i].normalized == normalized) m->order[fill[(unsigned char)t->pool[t->tok_off[j->tok[i].id]]]++] = (uint32_t)i;
    m->n = m->first[256];
    for (int b = 0; b < 256; b++) /* insertion sort: buckets are small */
        for (uint32_t i = m->first[b] + 1; i < m->first[b + 1]; i++) {
            uint32_t k = m->order[i], len = t->tok_len[j->tok[k].id], at = i;
            for (; at > m->first[b] && t->tok_len[j->tok[m->order[at - 1]].id] < len; at--)
                m->order[at] = m->order[at - 1];
            m->order[at] = k;
        }
    return TD_OK;
}

/* Added tokens into the pool (content bytes as they are) and the match sets. */
static td_status read_added(reader *r, const cJSON *added, size_t *pool_used)
{
    td_tokenizer *t = r->t;
    struct td_tok_json *j = t->json;
    size_t n = (size_t)(added ? cJSON_GetArraySize(added) : 0);
    j->tok = td_calloc(n ? n : 1, sizeof *j->tok, TD_ROLE_META);
    if (!j->tok) return td_error_set(TD_ERR_NOMEM, "out of memory for %zu added tokens", n);
    int i = 0;
    for (const cJSON *e = added ? added->child : NULL; e; e = e->next, i++) {
        const char *c = cJSON_GetObjectItemCaseSensitive(e, "content")->valuestring;
        uint32_t id = (uint32_t)cJSON_GetObjectItemCaseSensitive(e, "id")->valuedouble;
        size_t len = strlen(c);
        int special, lstrip, rstrip, single, normalized;
        char path[64];
        snprintf(path, sizeof path, "added_tokens[%d]", i);
        TRY(get_bool(r, e, "special", path, 0, &special));
        TRY(get_bool(r, e, "lstrip", path, 0, &lstrip));
        TRY(get_bool(r, e, "rstrip", path, 0, &rstrip));
        TRY(get_bool(r, e, "single_word", path, 0, &single));
        TRY(get_bool(r, e, "normalized", path, !special, &normalized));
        if (t->tok_len[id] && (t->tok_len[id] != len || memcmp(t->pool + t->tok_off[id], c, len))) {
            int in_vocab = id < t->vocab_size && td_tok_vocab_find(t, t->pool + t->tok_off[id], t->tok_len[id]) == id;
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s \"%s\" has id %u, which %s \"%.*s\"", r->name,
                                path, c, id, in_vocab ? "model.vocab gives to" : "an earlier added token has",
                                (int)t->tok_len[id], t->pool + t->tok_off[id]);
        }
        for (size_t k = 0; k < j->n; k++)
            if (t->tok_len[j->tok[k].id] == len && !memcmp(t->pool + t->tok_off[j->tok[k].id], c, len))
                return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s: \"%s\" is added twice", r->name, path, c);
        if (!t->tok_len[id]) {
            memcpy(t->pool + *pool_used, c, len);
            t->tok_off[id] = (uint32_t)*pool_used;
            t->tok_len[id] = (uint32_t)len;
            *pool_used += len;
        }
        if (j->nfc && normalized && !td_tok_nfc_quick((const unsigned char *)c, len))
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s \"%s\" is normalized but not in NFC; tidal "
                                "matches it in NFC text as it is", r->name, path, c);
        if (id >= t->vocab_size) t->vocab_size = id + 1;
        int space = 0;
        for (size_t k = 0; k < len; k++) space |= c[k] == ' ' || (c[k] >= 0x09 && c[k] <= 0x0D);
        j->tok[j->n++] = (added_tok){id, (uint8_t)special, (uint8_t)lstrip, (uint8_t)rstrip, (uint8_t)single,
                                     (uint8_t)normalized, (uint8_t)space};
        if (len > j->max_len) j->max_len = len;
    }
    TRY(build_set(t, &j->set[0], 0));
    return build_set(t, &j->set[1], 1);
}

static td_status read_merges(reader *r, const cJSON *merges)
{
    td_tokenizer *t = r->t;
    td_status st = TD_OK;
    char cpbuf[32];
    uint32_t to_cp[256];
    int16_t from_cp[324];
    td_tok_byte_alphabet(to_cp, from_cp);
    size_t count = (size_t)cJSON_GetArraySize(merges), longest = 0;
    for (const cJSON *e = merges->child; e; e = e->next) {
        size_t n = 0;
        if (cJSON_IsString(e)) n = strlen(e->valuestring);
        else
            for (const cJSON *p = cJSON_IsArray(e) ? e->child : NULL; p; p = p->next)
                n += cJSON_IsString(p) ? strlen(p->valuestring) : 0;
        if (n > longest) longest = n;
    }
    char *scratch = td_malloc(longest + 1, TD_ROLE_META);
    if (!scratch) TD_FAIL(TD_ERR_NOMEM, "out of memory loading tokenizer.json '%s' merges", r->name);
    TD_TRY(td_tok_merges_alloc(t, count, r->what));
    size_t i = 0;
    for (const cJSON *e = merges->child; e; e = e->next, i++) {
        const char *a, *b;
        size_t na, nb;
        if (cJSON_IsString(e)) {
            const char *s = e->valuestring, *sp = strchr(s, ' ');
            size_t n = strlen(s);
            if (!sp || sp == s || !sp[1] || strchr(sp + 1, ' '))
                TD_FAIL(TD_ERR_INVALID, "tokenizer.json '%s': model.merges[%zu] is \"%.80s\", expected \"A B\" (two "
                        "tokens separated by one space)", r->name, i, s);
            a = s, na = (size_t)(sp - s), b = sp + 1, nb = n - na - 1;
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(e->child) &&
                   cJSON_IsString(e->child->next) && e->child->valuestring[0] && e->child->next->valuestring[0]) {
            a = e->child->valuestring, na = strlen(a), b = e->child->next->valuestring, nb = strlen(b);
        } else {
            TD_FAIL(TD_ERR_INVALID, "tokenizer.json '%s': model.merges[%zu] is %s; expected \"A B\" or [\"A\", \"B\"] "
                    "(two non-empty tokens)", r->name, i, cJSON_IsArray(e) ? "not a pair of strings" : json_type_name(e));
        }
        uint32_t bad = 0;
        switch (td_tok_merge_add(t, from_cp, a, na, b, nb, scratch, &bad)) {
        case TD_TOK_MERGE_OK: break;
        case TD_TOK_MERGE_BAD_CHAR:
            TD_FAIL(TD_ERR_INVALID, "tokenizer.json '%s': model.merges[%zu] (\"%.*s\" \"%.*s\") has a character (%s) "
                    "outside GPT-2's byte-to-unicode alphabet", r->name, i, (int)na, a, (int)nb, b,
                    td_tok_describe_cp(bad, cpbuf));
        case TD_TOK_MERGE_NO_LEFT:
        case TD_TOK_MERGE_NO_RIGHT:
        case TD_TOK_MERGE_NO_RESULT: {
            td_tok_merge_result why = td_tok_merge_add(t, from_cp, a, na, b, nb, scratch, &bad);
            TD_FAIL(TD_ERR_INVALID, "tokenizer.json '%s': model.merges[%zu] (\"%.*s\" \"%.*s\"): %s%.*s%.*s\" is not "
                    "in model.vocab", r->name, i, (int)na, a, (int)nb, b,
                    why == TD_TOK_MERGE_NO_RESULT ? "the merged token \"" : "\"",
                    why == TD_TOK_MERGE_NO_RIGHT ? 0 : (int)na, a, why == TD_TOK_MERGE_NO_LEFT ? 0 : (int)nb, b);
        }
        }
    }
cleanup:
    td_free(scratch);
    return st;
}

static td_status read_model(reader *r, const cJSON *root, const cJSON *added)
{
    td_tokenizer *t = r->t;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model))
        return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': model is %s, expected an object with type \"BPE\", "
                            "vocab and merges", r->name, json_type_name(model));
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(model, "type");
    if (ty && (!cJSON_IsString(ty) || strcmp(ty->valuestring, "BPE")))
        return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': model.type is \"%s\"; tidal reads only \"BPE\" "
                            "(byte-level)", r->name, cJSON_IsString(ty) ? ty->valuestring : json_type_name(ty));
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (!cJSON_IsObject(vocab))
        return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': model.vocab is %s, expected an object of token -> "
                            "id", r->name, json_type_name(vocab));
    if (!cJSON_IsArray(merges))
        return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': model.merges is %s, expected an array", r->name,
                            json_type_name(merges));
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (dropout && !cJSON_IsNull(dropout) && !(cJSON_IsNumber(dropout) && dropout->valuedouble == 0))
        return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': model.dropout is set; tidal's BPE is deterministic "
                            "(use null)", r->name);
    static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int k = 0; k < 2; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(model, affixes[k]);
        if (v && !cJSON_IsNull(v) && !(cJSON_IsString(v) && !v->valuestring[0]))
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': model.%s is set; a byte-level BPE has none",
                                r->name, affixes[k]);
    }
    TRY(get_bool(r, model, "ignore_merges", "model", 0, &t->ignore_merges));
    /* Room: the vocabulary, then added tokens (ids and bytes) and a possible
     * end-of-text one past all. */
    double vmax = -1, amax = -1;
    size_t added_bytes_total = 0;
    for (const cJSON *e = vocab->child; e; e = e->next)
        if (valid_id(e) && e->valuedouble > vmax) vmax = e->valuedouble;
    TRY(scan_added(r, added, &amax, &added_bytes_total));
    size_t extra_ids = (amax > vmax ? (size_t)(amax - vmax) : 0) + 1;
    snprintf(r->what, sizeof r->what, "tokenizer.json '%s': model.vocab", r->name);
    TRY(td_tok_vocab_load(t, vocab, extra_ids, added_bytes_total + TD_TOK_EOT_LEN, r->what));
    snprintf(r->what, sizeof r->what, "tokenizer.json '%s': model.merges", r->name);
    return read_merges(r, merges);
}

static uint32_t added_by_content(const td_tokenizer *t, const char *c)
{
    size_t n = strlen(c);
    for (size_t i = 0; i < t->json->n; i++) {
        uint32_t id = t->json->tok[i].id;
        if (t->tok_len[id] == n && !memcmp(t->pool + t->tok_off[id], c, n)) return id;
    }
    return TD_TOKEN_NONE;
}

/* A token by content: an added token, else a model.vocab token. */
static uint32_t token_by_content(const td_tokenizer *t, const char *c)
{
    uint32_t id = added_by_content(t, c);
    if (id != TD_TOKEN_NONE) return id;
    /* model.vocab names tokens in GPT-2's byte alphabet ("\u0120a" is " a") */
    uint32_t to_cp[256], bad;
    int16_t from_cp[324];
    char bytes[256];
    size_t n = strlen(c);
    td_tok_byte_alphabet(to_cp, from_cp);
    long k = n < sizeof bytes ? td_tok_alphabet_to_bytes(from_cp, c, n, bytes, &bad) : -1;
    id = k > 0 ? td_tok_vocab_find(t, bytes, (size_t)k) : UINT32_MAX;
    return id == UINT32_MAX ? TD_TOKEN_NONE : id;
}

/* bos: the special token a TemplateProcessing puts before $A in "single"
 * (or the cls of a Roberta / Bert processor), looked through a Sequence. */
static td_status read_post_processor(reader *r, const cJSON *pp, const char *path)
{
    const char *ty = pp ? type_of(pp) : NULL;
    if (!ty) return TD_OK;
    if (!strcmp(ty, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(pp, "processors");
        int i = 0;
        for (const cJSON *e = cJSON_IsArray(list) ? list->child : NULL; e; e = e->next, i++) {
            char sub[128];
            snprintf(sub, sizeof sub, "post_processor.processors[%d]", i);
            TRY(read_post_processor(r, e, sub));
        }
        return TD_OK;
    }
    const char *name = NULL;
    if (!strcmp(ty, "RobertaProcessing") || !strcmp(ty, "BertProcessing")) {
        const cJSON *cls = cJSON_GetObjectItemCaseSensitive(pp, "cls");
        if (cJSON_IsArray(cls) && cJSON_IsString(cls->child)) name = cls->child->valuestring;
    } else if (!strcmp(ty, "TemplateProcessing")) {
        const cJSON *single = cJSON_GetObjectItemCaseSensitive(pp, "single");
        int before = 0;
        for (const cJSON *e = cJSON_IsArray(single) ? single->child : NULL; e; e = e->next) {
            if (cJSON_GetObjectItemCaseSensitive(e, "Sequence")) break;
            const cJSON *sp = cJSON_GetObjectItemCaseSensitive(e, "SpecialToken");
            const cJSON *id = cJSON_GetObjectItemCaseSensitive(sp, "id");
            if (!cJSON_IsString(id))
                return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s.single: an item before $A is not a "
                                    "SpecialToken with a string id", r->name, path);
            name = id->valuestring;
            before++;
        }
        if (before > 1)
            return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s.single puts %d tokens before $A; tidal "
                                "supports one begin-of-text token", r->name, path, before);
    }
    if (!name) return TD_OK;
    uint32_t id = token_by_content(r->t, name);
    if (id == TD_TOKEN_NONE)
        return td_error_set(TD_ERR_INVALID, "tokenizer.json '%s': %s begins a text with \"%s\", which is not a token "
                            "of the file", r->name, path, name);
    r->t->bos = id;
    return TD_OK;
}

/* eos: by name among the tokens, else tokenizer_config.json's eos_token,
 * else a new <|endoftext|> one past the largest id (never matched in text). */
static td_status pick_eos(reader *r, const char *config, size_t config_len, size_t pool_used)
{
    td_tokenizer *t = r->t;
    static const char *const names[] = {"<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>", "<eos>"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((t->eot = token_by_content(t, names[i])) != TD_TOKEN_NONE) return TD_OK;
    if (config) {
        cJSON *c = cJSON_ParseWithLength(config, config_len);
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(c, "eos_token");
        if (cJSON_IsObject(e)) e = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (cJSON_IsString(e)) t->eot = token_by_content(t, e->valuestring);
        cJSON_Delete(c);
        if (t->eot != TD_TOKEN_NONE) return TD_OK;
    }
    t->eot = t->vocab_size++;
    memcpy(t->pool + pool_used, TD_TOKEN_EOT_TEXT, TD_TOK_EOT_LEN);
    t->tok_off[t->eot] = (uint32_t)pool_used;
    t->tok_len[t->eot] = TD_TOK_EOT_LEN;
    return TD_OK;
}

td_status td_tokenizer_create_json(const char *json, size_t len, const char *name, const char *config_json,
                                   size_t config_len, td_tokenizer **out)
{
    td_status st = TD_OK;
    cJSON *root = NULL;
    *out = NULL;
    reader r = {.name = name ? name : "tokenizer.json"};
    td_tokenizer *t = td_calloc(1, sizeof *t, TD_ROLE_META);
    if (!t) TD_FAIL(TD_ERR_NOMEM, "out of memory creating the json tokenizer");
    r.t = t;
    t->kind = TD_TOKENIZER_JSON;
    t->bos = TD_TOKEN_NONE;
    t->json = td_calloc(1, sizeof *t->json, TD_ROLE_META);
    if (!t->json) TD_FAIL(TD_ERR_NOMEM, "out of memory creating the json tokenizer");
    if (len >= 3 && !memcmp(json, "\xEF\xBB\xBF", 3)) json += 3, len -= 3;
    root = cJSON_ParseWithLength(json, len);
    if (!root)
        TD_FAIL(TD_ERR_INVALID, "tokenizer.json '%s' is not valid JSON (near byte %ld of %zu)", r.name,
                cJSON_GetErrorPtr() ? (long)(cJSON_GetErrorPtr() - json) : -1L, len);
    if (!cJSON_IsObject(root)) TD_FAIL(TD_ERR_INVALID, "tokenizer.json '%s' is not a JSON object", r.name);
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (added && !cJSON_IsNull(added) && !cJSON_IsArray(added))
        TD_FAIL(TD_ERR_INVALID, "tokenizer.json '%s': added_tokens is %s, expected an array", r.name,
                json_type_name(added));
    if (!cJSON_IsArray(added)) added = NULL;
    TD_TRY(read_normalizer_decoder(&r, root));
    TD_TRY(read_pre_tokenizer(&r, root));
    TD_TRY(read_model(&r, root, added));
    size_t pool_used = 0;
    for (uint32_t i = 0; i < t->vocab_size; i++) pool_used += t->tok_len[i];
    TD_TRY(read_added(&r, added, &pool_used));
    TD_TRY(read_post_processor(&r, cJSON_GetObjectItemCaseSensitive(root, "post_processor"), "post_processor"));
    TD_TRY(pick_eos(&r, config_json, config_len, pool_used));
    *out = t;
    t = NULL;
cleanup:
    cJSON_Delete(root);
    td_tokenizer_destroy(t);
    return st;
}

int td_tokenizer_json_path(const char *path, char *buf, size_t buf_bytes)
{
    struct stat sb;
    size_t n = path ? strlen(path) : 0;
    int ok = 0;
    if (n && stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        char file[4096];
        snprintf(file, sizeof file, "%s%stokenizer.json", path, path[n - 1] == '/' ? "" : "/");
        ok = stat(file, &sb) == 0;
        if (ok && buf) snprintf(buf, buf_bytes, "%s", file);
        return ok;
    }
    ok = n >= 5 && !strcmp(path + n - 5, ".json");
    if (ok && buf) snprintf(buf, buf_bytes, "%s", path);
    return ok;
}

td_status td_tokenizer_load_json(const char *path, td_tokenizer **out)
{
    td_status st = TD_OK;
    char file[4096], config_path[4096];
    char *text = NULL, *config = NULL;
    size_t len = 0, config_len = 0;
    *out = NULL;
    if (!td_tokenizer_json_path(path, file, sizeof file))
        TD_FAIL(TD_ERR_INVALID, "'%s' is neither a .json file nor a folder holding tokenizer.json", path ? path : "");
    TD_TRY(td_tok_read_file(file, "tokenizer.json", &text, &len));
    /* tokenizer_config.json beside it may name the eos token */
    const char *slash = strrchr(file, '/');
    snprintf(config_path, sizeof config_path, "%.*s%stokenizer_config.json", slash ? (int)(slash - file) : 0, file,
             slash ? "/" : "");
    FILE *f = fopen(config_path, "rb");
    if (f) {
        fclose(f);
        TD_TRY(td_tok_read_file(config_path, "tokenizer_config.json", &config, &config_len));
    }
    TD_TRY(td_tokenizer_create_json(text, len, file, config, config_len, out));
cleanup:
    td_free(text);
    td_free(config);
    return st;
}
