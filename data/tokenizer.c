/* Tokenizers: byte-level and GPT-2 byte-level BPE (see include/tidal/tokenizer.h).
 *
 * GPT-2 BPE in three steps, each matching Hugging Face tokenizers:
 *   1. split the text at "<|endoftext|>" literals (the special token);
 *   2. pre-tokenize each segment with the GPT-2 pattern, written out by hand
 *      as a scanner over code points (pretok_next), so no regex engine is
 *      needed and invalid UTF-8 is well defined (one "other" char per byte);
 *   3. per piece, start from one token per byte and merge adjacent pairs by
 *      rank with a min-heap of (rank, position), skipping stale entries the
 *      way tokenizers' Word::merge_all does.  A piece cache (cleared when
 *      full) makes repeated words cost one hash lookup.
 * The pieces of step 2 and the byte tables work on raw bytes: the
 * byte-to-unicode alphabet only matters when reading vocab.json/merges.txt. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "tidal/alloc.h"
#include "tidal/tokenizer.h"
#include "tokenizer_internal.h"
#include "tokenizer_unicode.h"

#define EOT_LEN TD_TOK_EOT_LEN
#define CP_INVALID TD_TOK_CP_INVALID
#define FILE_MAX_BYTES ((size_t)1 << 30)

/* Piece cache: open addressing over SLOTS, cleared when half full or when
 * an arena runs out.  Only pieces up to CACHE_MAX_KEY bytes are cached. */
#define CACHE_SLOTS (1u << 16)
#define CACHE_MAX_ENTRIES (CACHE_SLOTS / 2)
#define CACHE_MAX_KEY 255
#define CACHE_KEY_BYTES ((size_t)4 << 20)
#define CACHE_ID_COUNT ((size_t)1 << 20)

typedef td_tok_merge_slot merge_slot;
typedef td_tok_cache_slot cache_slot;
typedef td_tok_symbol symbol;
typedef td_tok_heap_item heap_item;
#define MERGE_EMPTY TD_TOK_MERGE_EMPTY

/* ---- small helpers ------------------------------------------------------- */

const char *td_tokenizer_kind_name(td_tokenizer_kind kind)
{
    switch (kind) {
    case TD_TOKENIZER_BYTE: return "byte";
    case TD_TOKENIZER_GPT2: return "gpt2";
    case TD_TOKENIZER_JSON: return "json";
    }
    return "?";
}

td_status td_tokenizer_kind_parse(const char *name, td_tokenizer_kind *out)
{
    if (name && !strcmp(name, "byte")) *out = TD_TOKENIZER_BYTE;
    else if (name && !strcmp(name, "gpt2")) *out = TD_TOKENIZER_GPT2;
    else return td_error_set(TD_ERR_INVALID, "unknown tokenizer '%s' (choose byte or gpt2, or give a tokenizer.json)",
                             name ? name : "");
    return TD_OK;
}

uint64_t td_tok_hash(const void *p, size_t n)
{
    const unsigned char *s = p;
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

/* Reads a whole file into a td_malloc'd buffer (NUL-terminated). */
td_status td_tok_read_file(const char *path, const char *what, char **buf_out, size_t *len_out)
{
    td_status st = TD_OK;
    char *buf = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) TD_FAIL(TD_ERR_IO, "cannot open %s '%s': %s", what, path, strerror(errno));
    if (fseek(f, 0, SEEK_END) != 0) TD_FAIL(TD_ERR_IO, "cannot read %s '%s': %s", what, path, strerror(errno));
    long size = ftell(f);
    if (size < 0) TD_FAIL(TD_ERR_IO, "cannot read %s '%s': %s", what, path, strerror(errno));
    if ((size_t)size > FILE_MAX_BYTES)
        TD_FAIL(TD_ERR_INVALID, "%s '%s' is %ld bytes, more than the 1 GiB a tokenizer file may have", what,
                path, size);
    rewind(f);
    buf = td_malloc((size_t)size + 1, TD_ROLE_META);
    if (!buf) TD_FAIL(TD_ERR_NOMEM, "out of memory reading %s '%s' (%ld bytes)", what, path, size);
    if (fread(buf, 1, (size_t)size, f) != (size_t)size)
        TD_FAIL(TD_ERR_IO, "cannot read %s '%s': %s", what, path, ferror(f) ? strerror(errno) : "file shrank");
    buf[size] = '\0';
    *buf_out = buf;
    *len_out = (size_t)size;
    buf = NULL;
cleanup:
    td_free(buf);
    if (f) fclose(f);
    return st;
}

/* ---- UTF-8 and character classes ----------------------------------------- */

/* The code point at s[i] (i < len) and its length; a byte that does not
 * start a valid sequence (overlong, surrogate, > U+10FFFF, truncated) is
 * CP_INVALID of length 1. */
uint32_t td_tok_utf8_at(const unsigned char *s, size_t len, size_t i, size_t *n_out)
{
    unsigned char b = s[i];
    *n_out = 1;
    if (b < 0x80) return b;
    size_t need;
    uint32_t cp;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) need = 1, cp = b & 0x1F;
    else if (b >= 0xE0 && b <= 0xEF) {
        need = 2, cp = b & 0x0F;
        if (b == 0xE0) lo = 0xA0;
        if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 3, cp = b & 0x07;
        if (b == 0xF0) lo = 0x90;
        if (b == 0xF4) hi = 0x8F;
    } else return CP_INVALID;
    if (len - i <= need) return CP_INVALID;
    for (size_t k = 1; k <= need; k++) {
        unsigned char c = s[i + k];
        if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF)) return CP_INVALID;
        cp = (cp << 6) | (c & 0x3F);
    }
    *n_out = need + 1;
    return cp;
}

static int in_ranges(const td_unicode_range *r, size_t n, uint32_t cp)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < r[mid].lo) hi = mid;
        else if (cp > r[mid].hi) lo = mid + 1;
        else return 1;
    }
    return 0;
}

int td_tok_class(uint32_t cp)
{
    if (cp < 0x80) {
        if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return TD_TOK_LETTER;
        if (cp >= '0' && cp <= '9') return TD_TOK_NUMBER;
        if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return TD_TOK_SPACE;
        return TD_TOK_OTHER;
    }
    if (cp == CP_INVALID) return TD_TOK_OTHER;
    if (in_ranges(td_unicode_space, td_unicode_space_count, cp)) return TD_TOK_SPACE;
    if (in_ranges(td_unicode_letters, td_unicode_letters_count, cp)) return TD_TOK_LETTER;
    if (in_ranges(td_unicode_numbers, td_unicode_numbers_count, cp)) return TD_TOK_NUMBER;
    return TD_TOK_OTHER;
}

int td_tok_is_word(uint32_t cp)
{
    if (cp < 0x80) return (cp | 0x20) - 'a' < 26 || cp - '0' < 10 || cp == '_';
    return cp != CP_INVALID && in_ranges(td_unicode_word, td_unicode_word_count, cp);
}

int td_tok_class_at(const unsigned char *s, size_t len, size_t i, size_t *n_out)
{
    return td_tok_class(td_tok_utf8_at(s, len, i, n_out));
}

/* ---- the GPT-2 pre-tokenizer ------------------------------------------- */

/* End of the piece that starts at i (< len).  The alternatives in the
 * pattern's order:
 *   's 't 're 've 'm 'll 'd          contractions (ASCII, case-sensitive)
 *   ' '? letters+ | ' '? numbers+ | ' '? others+   a run of one class, with at
 *                                                  most one leading U+0020
 *   \s+(?!\S)                        whitespace, leaving the last whitespace
 *                                    char to lead the next word
 *   \s+                              a single whitespace char before a word */
size_t td_tok_pretok_gpt2(const unsigned char *s, size_t len, size_t i)
{
    size_t n;
    uint32_t c = td_tok_utf8_at(s, len, i, &n);
    if (c == '\'' && i + 1 < len) {
        unsigned char a = s[i + 1];
        if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
        if (i + 2 < len) {
            unsigned char b = s[i + 2];
            if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
        }
    }
    int cls = td_tok_class(c);
    size_t j = i + n;
    if (c == ' ' && j < len) {
        size_t n2;
        int next = td_tok_class_at(s, len, j, &n2);
        if (next != TD_TOK_SPACE) {
            cls = next;
            j += n2;
        }
    }
    if (cls != TD_TOK_SPACE) {
        while (j < len) {
            size_t n3;
            if (td_tok_class_at(s, len, j, &n3) != cls) break;
            j += n3;
        }
        return j;
    }
    size_t last = i; /* start of the run's last whitespace char */
    while (j < len) {
        size_t n3;
        if (td_tok_class_at(s, len, j, &n3) != TD_TOK_SPACE) break;
        last = j;
        j += n3;
    }
    if (j == len || last == i) return j;
    return last;
}

void td_gpt2_pretokenize(const char *text, size_t len, td_piece_fn fn, void *ctx)
{
    const unsigned char *s = (const unsigned char *)text;
    for (size_t i = 0; i < len;) {
        size_t e = td_tok_pretok_gpt2(s, len, i);
        fn(ctx, text + i, e - i);
        i = e;
    }
}

static void pretok_stage(const td_tokenizer *t, const char *text, size_t len, int stage, td_piece_fn fn, void *ctx)
{
    if (stage == t->n_pretok) {
        if (len) fn(ctx, text, len);
        return;
    }
    for (size_t i = 0; i < len;) {
        size_t e = t->pretok[stage]((const unsigned char *)text, len, i);
        pretok_stage(t, text + i, e - i, stage + 1, fn, ctx);
        i = e;
    }
}

void td_tokenizer_pretokenize(const td_tokenizer *t, const char *text, size_t len, td_piece_fn fn, void *ctx)
{
    if (t->kind == TD_TOKENIZER_BYTE)
        for (size_t i = 0; i < len; i++) fn(ctx, text + i, 1);
    else
        pretok_stage(t, text, len, 0, fn, ctx);
}

/* The code point that ends at p (0 < p, s[p] ASCII): CP_INVALID when the
 * bytes before p are not the end of a valid sequence. */
static uint32_t cp_before(const unsigned char *s, size_t p)
{
    if (s[p - 1] < 0x80) return s[p - 1];
    for (size_t k = 1; k <= 4 && k <= p; k++) {
        size_t q = p - k;
        if ((s[q] & 0xC0) == 0x80) continue; /* continuation byte: look further back */
        size_t n;
        uint32_t cp = td_tok_utf8_at(s, p, q, &n);
        return (cp != CP_INVALID && n == k) ? cp : CP_INVALID;
    }
    return CP_INVALID;
}

/* The largest p <= len - 2 (so the char after it is seen) with a single
 * whitespace char between two non-whitespace ones that t (NULL: byte or
 * gpt2) accepts as a cut. */
static size_t cut_point(const td_tokenizer *t, const unsigned char *s, size_t len)
{
    for (size_t p = len >= 2 ? len - 2 : 0; p >= 1; p--) {
        unsigned char c = s[p];
        if (!(c == ' ' || (c >= 0x09 && c <= 0x0D))) continue;
        size_t n;
        if (td_tok_class_at(s, len, p + 1, &n) == TD_TOK_SPACE) continue;
        if (td_tok_class(cp_before(s, p)) == TD_TOK_SPACE) continue;
        if (t && t->kind == TD_TOKENIZER_JSON && !td_tok_json_cut_ok(t, s, len, p)) continue;
        return p;
    }
    return 0;
}

size_t td_tokenizer_split_point(const char *text, size_t len)
{
    return cut_point(NULL, (const unsigned char *)text, len);
}

size_t td_tokenizer_cut_point(const td_tokenizer *t, const char *text, size_t len)
{
    return cut_point(t, (const unsigned char *)text, len);
}

/* ---- merges -------------------------------------------------------------- */

static const merge_slot *merge_get(const td_tokenizer *t, uint32_t a, uint32_t b)
{
    uint64_t key = ((uint64_t)a << 32) | b;
    size_t mask = t->merge_cap - 1;
    for (size_t i = td_tok_hash(&key, sizeof key) & mask;; i = (i + 1) & mask) {
        if (t->merges[i].key == key) return &t->merges[i];
        if (t->merges[i].key == MERGE_EMPTY) return NULL;
    }
}

/* Later lines override earlier ones for the same pair (as a hash map built
 * in file order does in tokenizers and in OpenAI's encoder.py). */
static void merge_put(td_tokenizer *t, uint32_t a, uint32_t b, uint32_t rank, uint32_t id)
{
    uint64_t key = ((uint64_t)a << 32) | b;
    size_t mask = t->merge_cap - 1;
    size_t i = td_tok_hash(&key, sizeof key) & mask;
    while (t->merges[i].key != MERGE_EMPTY && t->merges[i].key != key) i = (i + 1) & mask;
    t->merges[i] = (merge_slot){key, rank, id};
}

/* ---- BPE ------------------------------------------------------------------ */

static int heap_less(const heap_item *x, const heap_item *y)
{
    return x->rank != y->rank ? x->rank < y->rank : x->pos < y->pos;
}

static void heap_push(heap_item *h, size_t *n, heap_item it)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!heap_less(&it, &h[parent])) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = it;
}

static heap_item heap_pop(heap_item *h, size_t *n)
{
    heap_item top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && heap_less(&h[c + 1], &h[c])) c++;
        if (!heap_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = last;
    return top;
}

static td_status ensure_scratch(td_tokenizer *t, size_t n)
{
    if (n <= t->scratch_cap) return TD_OK;
    size_t cap = t->scratch_cap ? t->scratch_cap : 64;
    while (cap < n) cap *= 2;
    symbol *syms = td_malloc(cap * sizeof *syms, TD_ROLE_META);
    /* Each merge pushes at most two entries: n - 1 + 2 (n - 1) bound the heap. */
    heap_item *heap = td_malloc(3 * cap * sizeof *heap, TD_ROLE_META);
    if (!syms || !heap) {
        td_free(syms);
        td_free(heap);
        return td_error_set(TD_ERR_NOMEM, "out of memory for BPE scratch (a piece of %zu bytes)", n);
    }
    td_free(t->syms);
    td_free(t->heap);
    t->syms = syms;
    t->heap = heap;
    t->scratch_cap = cap;
    return TD_OK;
}

static void push_pair(td_tokenizer *t, size_t *nh, int32_t left)
{
    int32_t right = t->syms[left].next;
    if (right < 0) return;
    const merge_slot *m = merge_get(t, t->syms[left].id, t->syms[right].id);
    if (m) heap_push(t->heap, nh, (heap_item){m->rank, (uint32_t)left, m->id});
}

/* Merges the piece's bytes in t->syms; returns the number of symbols left,
 * which are compacted to the front of t->syms. */
static size_t bpe_merge(td_tokenizer *t, const unsigned char *p, size_t n)
{
    symbol *sy = t->syms;
    for (size_t i = 0; i < n; i++)
        sy[i] = (symbol){t->byte_id[p[i]], (int32_t)i - 1, i + 1 < n ? (int32_t)i + 1 : -1, 1};
    size_t nh = 0;
    for (size_t i = 0; i + 1 < n; i++) push_pair(t, &nh, (int32_t)i);
    while (nh) {
        heap_item top = heap_pop(t->heap, &nh);
        symbol *l = &sy[top.pos];
        if (!l->alive || l->next < 0) continue;
        symbol *r = &sy[l->next];
        const merge_slot *m = merge_get(t, l->id, r->id);
        if (!m || m->id != top.new_id) continue; /* stale entry */
        l->id = top.new_id;
        r->alive = 0;
        l->next = r->next;
        if (r->next >= 0) sy[r->next].prev = (int32_t)top.pos;
        if (l->prev >= 0) push_pair(t, &nh, l->prev);
        push_pair(t, &nh, (int32_t)top.pos);
    }
    size_t k = 0;
    for (int32_t i = 0; i >= 0; i = sy[i].next) sy[k++].id = sy[i].id;
    return k;
}

static cache_slot *cache_find(td_tokenizer *t, uint64_t h, const unsigned char *p, size_t n)
{
    for (size_t i = h & (CACHE_SLOTS - 1);; i = (i + 1) & (CACHE_SLOTS - 1)) {
        cache_slot *c = &t->cache[i];
        if (c->key_len == 0) return c;
        if (c->hash == h && c->key_len == n && !memcmp(t->cache_keys + c->key_off, p, n)) return c;
    }
}

static void cache_put(td_tokenizer *t, cache_slot *slot, uint64_t h, const unsigned char *p, size_t n,
                      size_t n_ids)
{
    if (t->cache_entries >= CACHE_MAX_ENTRIES || t->cache_key_used + n > CACHE_KEY_BYTES ||
        t->cache_ids_used + n_ids > CACHE_ID_COUNT) {
        memset(t->cache, 0, CACHE_SLOTS * sizeof *t->cache);
        t->cache_entries = t->cache_key_used = t->cache_ids_used = 0;
        slot = cache_find(t, h, p, n);
    }
    memcpy(t->cache_keys + t->cache_key_used, p, n);
    for (size_t i = 0; i < n_ids; i++) t->cache_ids[t->cache_ids_used + i] = t->syms[i].id;
    *slot = (cache_slot){h, (uint32_t)t->cache_key_used, (uint32_t)t->cache_ids_used, (uint16_t)n, (uint16_t)n_ids};
    t->cache_key_used += n;
    t->cache_ids_used += n_ids;
    t->cache_entries++;
}

static td_status bpe_piece(td_tokenizer *t, const unsigned char *p, size_t n)
{
    if (n == 1) {
        td_tok_emit(t, t->byte_id[p[0]]);
        return TD_OK;
    }
    if (t->ignore_merges) { /* tokenizers' BPE.ignore_merges: a whole-piece token wins */
        uint32_t id = td_tok_vocab_find(t, (const char *)p, n);
        if (id != UINT32_MAX) {
            td_tok_emit(t, id);
            return TD_OK;
        }
    }
    cache_slot *slot = NULL;
    uint64_t h = 0;
    if (n <= CACHE_MAX_KEY) {
        h = td_tok_hash(p, n);
        slot = cache_find(t, h, p, n);
        if (slot->key_len) {
            for (size_t i = 0; i < slot->n_ids; i++) td_tok_emit(t, t->cache_ids[slot->ids_off + i]);
            return TD_OK;
        }
    }
    td_status st = ensure_scratch(t, n);
    if (st != TD_OK) return st;
    size_t k = bpe_merge(t, p, n);
    for (size_t i = 0; i < k; i++) td_tok_emit(t, t->syms[i].id);
    if (slot) cache_put(t, slot, h, p, n, k);
    return TD_OK;
}

/* ---- encoding ------------------------------------------------------------ */

/* Splits s[0, len) with pre-tokenizer stage `stage` and passes each piece
 * on to the next stage; past the last stage, a piece is BPE-encoded. */
static td_status encode_stage(td_tokenizer *t, const unsigned char *s, size_t len, int stage)
{
    if (stage == t->n_pretok) return len ? bpe_piece(t, s, len) : TD_OK;
    for (size_t i = 0; i < len && t->sink_status == TD_OK;) {
        size_t e = t->pretok[stage](s, len, i);
        td_status st = encode_stage(t, s + i, e - i, stage + 1);
        if (st != TD_OK) return st;
        i = e;
    }
    return TD_OK;
}

td_status td_tok_encode_plain(td_tokenizer *t, const unsigned char *s, size_t len)
{
    if (t->kind == TD_TOKENIZER_BYTE) {
        for (size_t i = 0; i < len && t->sink_status == TD_OK; i++) td_tok_emit(t, s[i]);
        return TD_OK;
    }
    return encode_stage(t, s, len, 0);
}

static td_status ensure_cache(td_tokenizer *t)
{
    if (t->kind == TD_TOKENIZER_BYTE || t->cache) return TD_OK;
    t->cache = td_calloc(CACHE_SLOTS, sizeof *t->cache, TD_ROLE_META);
    t->cache_keys = td_malloc(CACHE_KEY_BYTES, TD_ROLE_META);
    t->cache_ids = td_malloc(CACHE_ID_COUNT * sizeof *t->cache_ids, TD_ROLE_META);
    if (t->cache && t->cache_keys && t->cache_ids) return TD_OK;
    td_free(t->cache);
    td_free(t->cache_keys);
    td_free(t->cache_ids);
    t->cache = NULL;
    t->cache_keys = NULL;
    t->cache_ids = NULL;
    return td_error_set(TD_ERR_NOMEM, "out of memory for the BPE cache (%zu MiB)",
                        (CACHE_KEY_BYTES + CACHE_ID_COUNT * 4 + CACHE_SLOTS * sizeof(cache_slot)) >> 20);
}

td_status td_tokenizer_encode(td_tokenizer *t, const char *text, size_t len, td_token_sink sink, void *ctx)
{
    td_status st = ensure_cache(t);
    if (st != TD_OK) return st;
    const unsigned char *s = (const unsigned char *)text;
    t->sink = sink;
    t->sink_ctx = ctx;
    t->sink_status = TD_OK;
    t->n_out = 0;
    if (t->kind == TD_TOKENIZER_JSON) /* its own added tokens, not the <|endoftext|> literal */
        st = td_tok_json_encode(t, s, len);
    for (size_t pos = 0; t->kind != TD_TOKENIZER_JSON && pos < len && st == TD_OK && t->sink_status == TD_OK;) {
        const unsigned char *hit = memmem(s + pos, len - pos, TD_TOKEN_EOT_TEXT, EOT_LEN);
        size_t end = hit ? (size_t)(hit - s) : len;
        st = td_tok_encode_plain(t, s + pos, end - pos);
        if (hit) td_tok_emit(t, t->eot);
        pos = hit ? end + EOT_LEN : len;
    }
    td_tok_flush(t);
    return st != TD_OK ? st : t->sink_status;
}

typedef struct id_vec {
    uint32_t *ids;
    size_t n, cap;
} id_vec;

static td_status id_vec_sink(void *ctx, const uint32_t *ids, size_t n)
{
    id_vec *v = ctx;
    if (v->n + n > v->cap) {
        size_t cap = v->cap ? v->cap : 256;
        while (cap < v->n + n) cap *= 2;
        uint32_t *grown = td_malloc(cap * sizeof *grown, TD_ROLE_META);
        if (!grown) return td_error_set(TD_ERR_NOMEM, "out of memory for %zu token ids", cap);
        if (v->n) memcpy(grown, v->ids, v->n * sizeof *grown);
        td_free(v->ids);
        v->ids = grown;
        v->cap = cap;
    }
    memcpy(v->ids + v->n, ids, n * sizeof *ids);
    v->n += n;
    return TD_OK;
}

td_status td_tokenizer_encode_alloc(td_tokenizer *t, const char *text, size_t len, uint32_t **ids_out,
                                    size_t *n_out)
{
    id_vec v = {0};
    td_status st = td_tokenizer_encode(t, text, len, id_vec_sink, &v);
    if (st != TD_OK) {
        td_free(v.ids);
        v = (id_vec){0};
    }
    *ids_out = v.ids;
    *n_out = v.n;
    return st;
}

/* ---- decoding and accessors ---------------------------------------------- */

const char *td_tokenizer_token_bytes(const td_tokenizer *t, uint32_t id, size_t *len_out)
{
    if (id == t->eot && t->kind != TD_TOKENIZER_JSON) {
        *len_out = EOT_LEN;
        return TD_TOKEN_EOT_TEXT;
    }
    if (t->kind == TD_TOKENIZER_BYTE) {
        if (id >= 256) return NULL;
        *len_out = 1;
        return &t->bytes[id];
    }
    if (id >= t->vocab_size || t->tok_len[id] == 0) return NULL;
    *len_out = t->tok_len[id];
    return t->pool + t->tok_off[id];
}

td_status td_tokenizer_decode(const td_tokenizer *t, const uint32_t *ids, size_t n, char **text_out,
                              size_t *len_out)
{
    *text_out = NULL;
    *len_out = 0;
    size_t total = 0, len;
    for (size_t i = 0; i < n; i++) {
        if (!td_tokenizer_token_bytes(t, ids[i], &len))
            return td_error_set(TD_ERR_INVALID, "cannot decode token %zu: id %u is not in the %s vocabulary "
                                "(size %u)", i, ids[i], td_tokenizer_kind_name(t->kind), t->vocab_size);
        total += len;
    }
    char *buf = td_malloc(total + 1, TD_ROLE_META);
    if (!buf) return td_error_set(TD_ERR_NOMEM, "out of memory decoding %zu tokens (%zu bytes)", n, total);
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        const char *b = td_tokenizer_token_bytes(t, ids[i], &len);
        memcpy(buf + at, b, len);
        at += len;
    }
    buf[at] = '\0';
    *text_out = buf;
    *len_out = at;
    return TD_OK;
}

td_tokenizer_kind td_tokenizer_kind_of(const td_tokenizer *t) { return t->kind; }
uint32_t td_tokenizer_vocab_size(const td_tokenizer *t) { return t->vocab_size; }
uint32_t td_tokenizer_eot(const td_tokenizer *t) { return t->eot; }
uint32_t td_tokenizer_bos(const td_tokenizer *t) { return t->bos; }
size_t td_tokenizer_merge_count(const td_tokenizer *t) { return t->merge_lines; }

void td_tokenizer_destroy(td_tokenizer *t)
{
    if (!t) return;
    td_free(t->pool);
    td_free(t->tok_off);
    td_free(t->tok_len);
    td_free(t->vocab_slots);
    td_free(t->merges);
    td_tok_json_free(t->json);
    td_free(t->syms);
    td_free(t->heap);
    td_free(t->cache);
    td_free(t->cache_keys);
    td_free(t->cache_ids);
    td_free(t);
}

td_status td_tokenizer_create_byte(td_tokenizer **out)
{
    *out = NULL;
    td_tokenizer *t = td_calloc(1, sizeof *t, TD_ROLE_META);
    if (!t) return td_error_set(TD_ERR_NOMEM, "out of memory creating the byte tokenizer");
    t->kind = TD_TOKENIZER_BYTE;
    t->vocab_size = 257;
    t->eot = 256;
    t->bos = TD_TOKEN_NONE;
    for (int b = 0; b < 256; b++) {
        t->byte_id[b] = (uint32_t)b;
        t->bytes[b] = (char)b;
    }
    *out = t;
    return TD_OK;
}

/* ---- loading GPT-2 files ------------------------------------------------- */

/* GPT-2's byte-to-unicode alphabet: printable Latin-1 bytes stand for
 * themselves, the other 68 bytes for U+0100.. in byte order. */
void td_tok_byte_alphabet(uint32_t to_cp[256], int16_t from_cp[324])
{
    for (int i = 0; i < 324; i++) from_cp[i] = -1;
    uint32_t extra = 256;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        to_cp[b] = printable ? (uint32_t)b : extra++;
        from_cp[to_cp[b]] = (int16_t)b;
    }
}

long td_tok_alphabet_to_bytes(const int16_t from_cp[324], const char *str, size_t len, char *out, uint32_t *bad)
{
    const unsigned char *s = (const unsigned char *)str;
    long k = 0;
    for (size_t i = 0; i < len;) {
        size_t n;
        uint32_t cp = td_tok_utf8_at(s, len, i, &n);
        if (cp == CP_INVALID || cp >= 324 || from_cp[cp] < 0) {
            *bad = cp;
            return -1;
        }
        out[k++] = (char)from_cp[cp];
        i += n;
    }
    return k;
}

static uint32_t vocab_slot(const td_tokenizer *t, const char *b, size_t n, size_t *slot)
{
    size_t mask = t->vocab_cap - 1;
    size_t i = td_tok_hash(b, n) & mask;
    for (; t->vocab_slots[i]; i = (i + 1) & mask) {
        uint32_t id = t->vocab_slots[i] - 1;
        if (t->tok_len[id] == n && !memcmp(t->pool + t->tok_off[id], b, n)) break;
    }
    if (slot) *slot = i;
    return t->vocab_slots[i] ? t->vocab_slots[i] - 1 : UINT32_MAX;
}

uint32_t td_tok_vocab_find(const td_tokenizer *t, const char *b, size_t n)
{
    return vocab_slot(t, b, n, NULL);
}

const char *td_tok_describe_cp(uint32_t cp, char buf[32])
{
    if (cp == CP_INVALID) snprintf(buf, 32, "invalid UTF-8");
    else snprintf(buf, 32, "U+%04X", cp);
    return buf;
}

td_status td_tok_vocab_load(td_tokenizer *t, const cJSON *obj, size_t extra_ids, size_t extra_bytes,
                            const char *what)
{
    td_status st = TD_OK;
    char cpbuf[32];
    uint32_t to_cp[256];
    int16_t from_cp[324];
    td_tok_byte_alphabet(to_cp, from_cp);
    size_t count = 0, key_bytes = 0;
    double max_id = -1;
    for (const cJSON *e = obj->child; e; e = e->next) {
        double v = e->valuedouble;
        if (!cJSON_IsNumber(e) || !(v >= 0 && v < TD_TOKENIZER_MAX_VOCAB - 1) || v != (double)(uint32_t)v)
            TD_FAIL(TD_ERR_INVALID, "%s: the id of token \"%s\" is not an integer in [0, %u)", what, e->string,
                    TD_TOKENIZER_MAX_VOCAB - 1);
        if (!e->string[0]) TD_FAIL(TD_ERR_INVALID, "%s: a token is the empty string", what);
        if (v > max_id) max_id = v;
        count++;
        key_bytes += strlen(e->string);
    }
    if (!count) TD_FAIL(TD_ERR_INVALID, "%s has no tokens", what);
    t->vocab_size = (uint32_t)max_id + 1;
    size_t slots = (size_t)t->vocab_size + extra_ids;
    t->tok_off = td_calloc(slots, sizeof *t->tok_off, TD_ROLE_META);
    t->tok_len = td_calloc(slots, sizeof *t->tok_len, TD_ROLE_META);
    t->pool = td_malloc(key_bytes + extra_bytes + 1, TD_ROLE_META);
    t->vocab_cap = 16;
    while (t->vocab_cap < 2 * (count + extra_ids)) t->vocab_cap *= 2;
    t->vocab_slots = td_calloc(t->vocab_cap, sizeof *t->vocab_slots, TD_ROLE_META);
    if (!t->tok_off || !t->tok_len || !t->pool || !t->vocab_slots)
        TD_FAIL(TD_ERR_NOMEM, "out of memory loading %s (%zu tokens)", what, count);
    size_t used = 0;
    for (const cJSON *e = obj->child; e; e = e->next) {
        uint32_t id = (uint32_t)e->valuedouble, bad = 0;
        long n = td_tok_alphabet_to_bytes(from_cp, e->string, strlen(e->string), t->pool + used, &bad);
        if (n < 0)
            TD_FAIL(TD_ERR_INVALID, "%s: token \"%s\" has a character (%s) outside GPT-2's byte-to-unicode "
                    "alphabet", what, e->string, td_tok_describe_cp(bad, cpbuf));
        if (t->tok_len[id])
            TD_FAIL(TD_ERR_INVALID, "%s: id %u is given to two tokens (the second is \"%s\")", what, id, e->string);
        t->tok_off[id] = (uint32_t)used;
        t->tok_len[id] = (uint32_t)n;
        size_t slot;
        if (vocab_slot(t, t->pool + used, (size_t)n, &slot) != UINT32_MAX)
            TD_FAIL(TD_ERR_INVALID, "%s: token \"%s\" appears twice", what, e->string);
        t->vocab_slots[slot] = id + 1;
        used += (size_t)n;
    }
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        t->byte_id[b] = td_tok_vocab_find(t, &c, 1);
        if (t->byte_id[b] == UINT32_MAX)
            TD_FAIL(TD_ERR_INVALID, "%s lacks the token for byte 0x%02X (U+%04X); a byte-level BPE vocabulary "
                    "has all 256", what, b, to_cp[b]);
    }
cleanup:
    return st;
}

/* Parses vocab.json, loads it, and gives it an end-of-text token. */
static td_status load_vocab(td_tokenizer *t, const char *json, size_t len, const char *name)
{
    td_status st = TD_OK;
    char what[1200];
    snprintf(what, sizeof what, "vocab.json '%s'", name);
    if (len >= 3 && !memcmp(json, "\xEF\xBB\xBF", 3)) json += 3, len -= 3;
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root)
        TD_FAIL(TD_ERR_INVALID, "%s is not valid JSON (near byte %ld); expected the Hugging Face GPT-2 vocab.json, "
                "an object of token -> id", what, cJSON_GetErrorPtr() ? (long)(cJSON_GetErrorPtr() - json) : -1L);
    if (!cJSON_IsObject(root)) TD_FAIL(TD_ERR_INVALID, "%s is not a JSON object of token -> id", what);
    TD_TRY(td_tok_vocab_load(t, root, 1, EOT_LEN, what)); /* + 1: room for an added end-of-text */
    t->eot = td_tok_vocab_find(t, TD_TOKEN_EOT_TEXT, EOT_LEN);
    if (t->eot == UINT32_MAX) { /* no end-of-text token: add one past the largest id */
        size_t used = 0;
        for (uint32_t i = 0; i < t->vocab_size; i++) used += t->tok_len[i];
        t->eot = t->vocab_size++;
        memcpy(t->pool + used, TD_TOKEN_EOT_TEXT, EOT_LEN);
        t->tok_off[t->eot] = (uint32_t)used;
        t->tok_len[t->eot] = EOT_LEN;
    }
cleanup:
    cJSON_Delete(root);
    return st;
}

td_status td_tok_merges_alloc(td_tokenizer *t, size_t count, const char *what)
{
    t->merge_cap = 16;
    while (t->merge_cap < 2 * count) t->merge_cap *= 2;
    t->merges = td_malloc(t->merge_cap * sizeof *t->merges, TD_ROLE_META);
    if (!t->merges) return td_error_set(TD_ERR_NOMEM, "out of memory loading %s (%zu merges)", what, count);
    for (size_t i = 0; i < t->merge_cap; i++) t->merges[i].key = MERGE_EMPTY;
    return TD_OK;
}

td_tok_merge_result td_tok_merge_add(td_tokenizer *t, const int16_t from_cp[324], const char *a, size_t na,
                                     const char *b, size_t nb, char *scratch, uint32_t *bad)
{
    long ba = td_tok_alphabet_to_bytes(from_cp, a, na, scratch, bad);
    long bb = ba < 0 ? -1 : td_tok_alphabet_to_bytes(from_cp, b, nb, scratch + ba, bad);
    if (ba < 0 || bb < 0) return TD_TOK_MERGE_BAD_CHAR;
    uint32_t ia = td_tok_vocab_find(t, scratch, (size_t)ba);
    if (ia == UINT32_MAX) return TD_TOK_MERGE_NO_LEFT;
    uint32_t ib = td_tok_vocab_find(t, scratch + ba, (size_t)bb);
    if (ib == UINT32_MAX) return TD_TOK_MERGE_NO_RIGHT;
    uint32_t iab = td_tok_vocab_find(t, scratch, (size_t)(ba + bb));
    if (iab == UINT32_MAX) return TD_TOK_MERGE_NO_RESULT;
    merge_put(t, ia, ib, (uint32_t)t->merge_lines++, iab);
    return TD_TOK_MERGE_OK;
}

static td_status load_merges(td_tokenizer *t, const char *text, size_t len, const char *name)
{
    td_status st = TD_OK;
    char cpbuf[32];
    char *scratch = NULL;
    uint32_t to_cp[256];
    int16_t from_cp[324];
    td_tok_byte_alphabet(to_cp, from_cp);
    if (len >= 3 && !memcmp(text, "\xEF\xBB\xBF", 3)) text += 3, len -= 3;
    size_t lines = 1;
    for (size_t i = 0; i < len; i++) lines += text[i] == '\n';
    char what[1200];
    snprintf(what, sizeof what, "merges.txt '%s'", name);
    TD_TRY(td_tok_merges_alloc(t, lines, what));
    scratch = td_malloc(len + 1, TD_ROLE_META);
    if (!scratch) TD_FAIL(TD_ERR_NOMEM, "out of memory loading %s", what);
    size_t line_no = 0;
    for (size_t pos = 0; pos < len;) {
        const char *line = text + pos;
        const char *nl = memchr(line, '\n', len - pos);
        size_t n = nl ? (size_t)(nl - line) : len - pos;
        pos += n + (nl ? 1 : 0);
        line_no++;
        if (n && line[n - 1] == '\r') n--;
        if (n >= 8 && !memcmp(line, "#version", 8)) continue;
        const char *sp = memchr(line, ' ', n);
        if (!sp || sp == line || sp == line + n - 1 || memchr(sp + 1, ' ', (size_t)(line + n - sp - 1)))
            TD_FAIL(TD_ERR_INVALID, "%s:%zu: expected \"A B\" (two tokens separated by one space), got \"%.*s\"",
                    what, line_no, (int)(n > 80 ? 80 : n), line);
        size_t na = (size_t)(sp - line), nb = n - na - 1;
        uint32_t bad = 0;
        switch (td_tok_merge_add(t, from_cp, line, na, sp + 1, nb, scratch, &bad)) {
        case TD_TOK_MERGE_OK: break;
        case TD_TOK_MERGE_BAD_CHAR:
            TD_FAIL(TD_ERR_INVALID, "%s:%zu: \"%.*s\" has a character (%s) outside GPT-2's byte-to-unicode alphabet",
                    what, line_no, (int)n, line, td_tok_describe_cp(bad, cpbuf));
        case TD_TOK_MERGE_NO_LEFT:
            TD_FAIL(TD_ERR_INVALID, "%s:%zu: merge \"%.*s\": \"%.*s\" is not in vocab.json (do the two files belong "
                    "together?)", what, line_no, (int)n, line, (int)na, line);
        case TD_TOK_MERGE_NO_RIGHT:
            TD_FAIL(TD_ERR_INVALID, "%s:%zu: merge \"%.*s\": \"%.*s\" is not in vocab.json (do the two files belong "
                    "together?)", what, line_no, (int)n, line, (int)nb, sp + 1);
        case TD_TOK_MERGE_NO_RESULT:
            TD_FAIL(TD_ERR_INVALID, "%s:%zu: merge \"%.*s\": the merged token \"%.*s%.*s\" is not in vocab.json (do "
                    "the two files belong together?)", what, line_no, (int)n, line, (int)na, line, (int)nb, sp + 1);
        }
    }
cleanup:
    td_free(scratch);
    return st;
}

td_status td_tokenizer_create_gpt2(const char *vocab_json, size_t vocab_len, const char *vocab_name,
                                   const char *merges, size_t merges_len, const char *merges_name,
                                   td_tokenizer **out)
{
    td_status st = TD_OK;
    *out = NULL;
    td_tokenizer *t = td_calloc(1, sizeof *t, TD_ROLE_META);
    if (!t) TD_FAIL(TD_ERR_NOMEM, "out of memory creating the gpt2 tokenizer");
    t->kind = TD_TOKENIZER_GPT2;
    t->bos = TD_TOKEN_NONE;
    t->pretok[0] = td_tok_pretok_gpt2;
    t->n_pretok = 1;
    TD_TRY(load_vocab(t, vocab_json, vocab_len, vocab_name ? vocab_name : "vocab.json"));
    TD_TRY(load_merges(t, merges, merges_len, merges_name ? merges_name : "merges.txt"));
    *out = t;
    t = NULL;
cleanup:
    td_tokenizer_destroy(t);
    return st;
}

td_status td_tokenizer_load_gpt2(const char *vocab_path, const char *merges_path, td_tokenizer **out)
{
    td_status st = TD_OK;
    char *vocab = NULL, *merges = NULL;
    size_t vocab_len = 0, merges_len = 0;
    *out = NULL;
    if (!vocab_path || !merges_path)
        TD_FAIL(TD_ERR_INVALID, "the gpt2 tokenizer needs both --vocab vocab.json and --merges merges.txt");
    TD_TRY(td_tok_read_file(vocab_path, "vocab.json", &vocab, &vocab_len));
    TD_TRY(td_tok_read_file(merges_path, "merges.txt", &merges, &merges_len));
    TD_TRY(td_tokenizer_create_gpt2(vocab, vocab_len, vocab_path, merges, merges_len, merges_path, out));
cleanup:
    td_free(vocab);
    td_free(merges);
    return st;
}
