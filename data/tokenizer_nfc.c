/* Unicode normalization form C for tokenizer.json's NFC normalizer
 * (Qwen2's files have one), from the tables of data/tokenizer_unicode.c.
 *
 * Most text is already NFC, so td_tok_nfc_quick first looks for any code
 * point that could change (a nonzero combining class, a character that
 * decomposes or composes, Hangul jamo): with none the text is used as it is.
 * Otherwise td_tok_nfc does the whole algorithm of UAX #15 on the text:
 * full canonical decomposition (Hangul syllables algorithmically), canonical
 * ordering of combining marks, then canonical composition of primary
 * composites.  Bytes that are not valid UTF-8 pass through unchanged and
 * block composition around them (they never reach the `tokenizers` library,
 * which takes str). */
#include <string.h>

#include "tidal/alloc.h"
#include "tokenizer_internal.h"
#include "tokenizer_unicode.h"

#define INVALID_BASE 0x110000u /* an invalid byte b travels as INVALID_BASE + b */
#define S_BASE 0xAC00u
#define L_BASE 0x1100u
#define V_BASE 0x1161u
#define T_BASE 0x11A7u
#define L_COUNT 19u
#define V_COUNT 21u
#define T_COUNT 28u
#define S_COUNT (L_COUNT * V_COUNT * T_COUNT)

static int in_check(uint32_t cp)
{
    size_t lo = 0, hi = td_unicode_nfc_check_count;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < td_unicode_nfc_check[mid].lo) hi = mid;
        else if (cp > td_unicode_nfc_check[mid].hi) lo = mid + 1;
        else return 1;
    }
    return 0;
}

int td_tok_nfc_quick(const unsigned char *s, size_t len)
{
    for (size_t i = 0; i < len;) {
        if (s[i] < 0xCC) { /* below U+0300 nothing changes under NFC */
            i++;
            continue;
        }
        size_t n;
        uint32_t cp = td_tok_utf8_at(s, len, i, &n);
        if (cp != TD_TOK_CP_INVALID && in_check(cp)) return 0;
        i += n;
    }
    return 1;
}

static uint8_t ccc_of(uint32_t cp)
{
    size_t lo = 0, hi = td_unicode_ccc_count;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < td_unicode_ccc_ranges[mid].lo) hi = mid;
        else if (cp > td_unicode_ccc_ranges[mid].hi) lo = mid + 1;
        else return td_unicode_ccc_ranges[mid].ccc;
    }
    return 0;
}

static const td_unicode_decomp *decomp_of(uint32_t cp)
{
    size_t lo = 0, hi = td_unicode_decomp_count;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < td_unicode_decomps[mid].cp) hi = mid;
        else if (cp > td_unicode_decomps[mid].cp) lo = mid + 1;
        else return &td_unicode_decomps[mid];
    }
    return NULL;
}

/* The primary composite of (a, b), or 0. */
static uint32_t compose(uint32_t a, uint32_t b)
{
    if (a - L_BASE < L_COUNT && b - V_BASE < V_COUNT)
        return S_BASE + ((a - L_BASE) * V_COUNT + (b - V_BASE)) * T_COUNT;
    if (a - S_BASE < S_COUNT && (a - S_BASE) % T_COUNT == 0 && b - T_BASE - 1 < T_COUNT - 1) return a + (b - T_BASE);
    size_t lo = 0, hi = td_unicode_comp_count;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        const td_unicode_comp *c = &td_unicode_comps[mid];
        if (a < c->first || (a == c->first && b < c->second)) hi = mid;
        else if (a > c->first || b > c->second) lo = mid + 1;
        else return c->composite;
    }
    return 0;
}

static td_status grow(void **buf, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return TD_OK;
    size_t c = *cap ? *cap : 256;
    while (c < need) c *= 2;
    void *p = td_malloc(c * elem, TD_ROLE_META);
    if (!p) return td_error_set(TD_ERR_NOMEM, "out of memory normalizing %zu bytes of text to NFC", need);
    td_free(*buf);
    *buf = p;
    *cap = c;
    return TD_OK;
}

static size_t put_utf8(char *p, uint32_t cp)
{
    if (cp >= INVALID_BASE) return (void)(p[0] = (char)(cp - INVALID_BASE)), 1;
    if (cp < 0x80) return (void)(p[0] = (char)cp), 1;
    if (cp < 0x800) {
        p[0] = (char)(0xC0 | cp >> 6), p[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        p[0] = (char)(0xE0 | cp >> 12), p[1] = (char)(0x80 | ((cp >> 6) & 0x3F)), p[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    p[0] = (char)(0xF0 | cp >> 18), p[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    p[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), p[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

td_status td_tok_nfc(const unsigned char *s, size_t len, td_tok_nfc_buf *b, const char **out, size_t *out_len)
{
    /* canonical decompositions expand a code point to at most 4 (checked below) */
    td_status st = grow((void **)&b->cps, &b->cps_cap, 4 * len + 4, sizeof *b->cps);
    if (st == TD_OK) st = grow((void **)&b->text, &b->text_cap, 4 * len + 4, 1);
    if (st != TD_OK) return st;
    uint32_t *cp = b->cps;
    size_t n = 0;
    for (size_t i = 0; i < len;) { /* decompose */
        size_t k;
        uint32_t c = td_tok_utf8_at(s, len, i, &k);
        if (c == TD_TOK_CP_INVALID) c = INVALID_BASE + s[i];
        i += k;
        const td_unicode_decomp *d;
        if (c - S_BASE < S_COUNT) {
            uint32_t si = c - S_BASE;
            cp[n++] = L_BASE + si / (V_COUNT * T_COUNT);
            cp[n++] = V_BASE + (si % (V_COUNT * T_COUNT)) / T_COUNT;
            if (si % T_COUNT) cp[n++] = T_BASE + si % T_COUNT;
        } else if (c < INVALID_BASE && (d = decomp_of(c)) && d->len <= 4) {
            memcpy(cp + n, td_unicode_decomp_pool + d->off, d->len * sizeof *cp);
            n += d->len;
        } else {
            cp[n++] = c;
        }
    }
    for (size_t i = 1; i < n; i++) { /* canonical order: a stable sort of each run of marks by class */
        uint8_t c = ccc_of(cp[i]);
        if (!c) continue;
        for (size_t j = i; j > 0; j--) {
            uint8_t p = cp[j - 1] < INVALID_BASE ? ccc_of(cp[j - 1]) : 0;
            if (p <= c) break;
            uint32_t tmp = cp[j];
            cp[j] = cp[j - 1];
            cp[j - 1] = tmp;
        }
    }
    /* compose: each char with the last starter, unless a char between of the
     * same or a higher class (or a starter) blocks it */
    size_t m = 0, starter = SIZE_MAX;
    int last_ccc = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t c = cp[i];
        int cc = c < INVALID_BASE ? ccc_of(c) : 0;
        uint32_t comp = starter != SIZE_MAX && c < INVALID_BASE && (last_ccc < cc || last_ccc == 0) &&
                                (last_ccc == 0 ? starter == m - 1 : 1)
                            ? compose(cp[starter], c)
                            : 0;
        if (comp) {
            cp[starter] = comp;
            continue;
        }
        if (cc == 0) starter = c < INVALID_BASE ? m : SIZE_MAX;
        last_ccc = cc;
        cp[m++] = c;
    }
    size_t at = 0;
    for (size_t i = 0; i < m; i++) at += put_utf8(b->text + at, cp[i]);
    *out = b->text;
    *out_len = at;
    return TD_OK;
}

void td_tok_nfc_buf_free(td_tok_nfc_buf *b)
{
    td_free(b->cps);
    td_free(b->text);
    b->cps = NULL;
    b->text = NULL;
    b->cps_cap = b->text_cap = 0;
}
