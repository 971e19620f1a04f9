/* The Jinja interpreter's values (see jinja_internal.h): the arena, strings,
 * lists and dicts, Python's truth, equality and ordering, str() and repr(),
 * json.dumps as transformers' tojson filter calls it, and a JSON reader that
 * keeps what Python's json.loads keeps (integers apart from floats, key
 * order), so that a template prints a record's numbers as transformers
 * would. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_internal.h"
#include "tidal/alloc.h"

/* ---- the arena ----------------------------------------------------------- */

#define ARENA_BLOCK_BYTES ((size_t)64 << 10)

struct jarena_block {
    jarena_block *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
};

void *jarena_alloc(jarena *a, size_t bytes)
{
    bytes = (bytes + 15) & ~(size_t)15;
    if (bytes == 0) bytes = 16;
    jarena_block *b = a->head;
    if (!b || b->cap - b->used < bytes) {
        size_t cap = bytes > ARENA_BLOCK_BYTES / 4 ? bytes : ARENA_BLOCK_BYTES;
        if (a->limit_bytes && a->used_bytes + cap > a->limit_bytes) return NULL;
        b = td_malloc(sizeof *b + cap, TD_ROLE_META);
        if (!b) return NULL;
        b->used = 0;
        b->cap = cap;
        a->used_bytes += cap;
        if (cap == bytes && a->head) { /* a big one: behind the current block, which stays open */
            b->next = a->head->next;
            a->head->next = b;
        } else {
            b->next = a->head;
            a->head = b;
        }
    }
    void *p = b->data + b->used;
    b->used += bytes;
    memset(p, 0, bytes);
    return p;
}

void jarena_free(jarena *a)
{
    for (jarena_block *b = a->head, *next; b; b = next) {
        next = b->next;
        td_free(b);
    }
    a->head = NULL;
    a->used_bytes = 0;
}

/* ---- constructors -------------------------------------------------------- */

jv jv_undef(const jstr *name) { jv v = {.kind = JV_UNDEF}; v.u.s = name; return v; }
jv jv_none(void) { return (jv){.kind = JV_NONE}; }
jv jv_bool(int b) { jv v = {.kind = JV_BOOL}; v.u.b = b != 0; return v; }
jv jv_int(int64_t i) { jv v = {.kind = JV_INT}; v.u.i = i; return v; }
jv jv_float(double f) { jv v = {.kind = JV_FLOAT}; v.u.f = f; return v; }
jv jv_strv(const jstr *s) { jv v = {.kind = s ? JV_STR : JV_UNDEF}; v.u.s = s; return v; }

const jstr *jstr_new(jarena *a, const char *s, size_t len)
{
    jstr *r = jarena_alloc(a, sizeof *r + len + 1);
    if (!r) return NULL;
    r->len = len;
    if (len) memcpy(r->s, s, len);
    r->s[len] = '\0';
    return r;
}

const jstr *jstr_cat(jarena *a, const jstr *x, const jstr *y)
{
    jstr *r = jarena_alloc(a, sizeof *r + x->len + y->len + 1);
    if (!r) return NULL;
    r->len = x->len + y->len;
    memcpy(r->s, x->s, x->len);
    memcpy(r->s + x->len, y->s, y->len);
    r->s[r->len] = '\0';
    return r;
}

jlist *jlist_new(jarena *a, size_t cap)
{
    jlist *l = jarena_alloc(a, sizeof *l);
    if (!l) return NULL;
    if (cap) {
        l->v = jarena_alloc(a, cap * sizeof *l->v);
        if (!l->v) return NULL;
        l->cap = cap;
    }
    return l;
}

int jlist_push(jarena *a, jlist *l, jv v)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 8;
        jv *nv = jarena_alloc(a, cap * sizeof *nv);
        if (!nv) return -1;
        if (l->n) memcpy(nv, l->v, l->n * sizeof *nv);
        l->v = nv;
        l->cap = cap;
    }
    l->v[l->n++] = v;
    return 0;
}

jdict *jdict_new(jarena *a, size_t cap)
{
    jdict *d = jarena_alloc(a, sizeof *d);
    if (!d) return NULL;
    if (cap) {
        d->k = jarena_alloc(a, cap * sizeof *d->k);
        d->v = jarena_alloc(a, cap * sizeof *d->v);
        if (!d->k || !d->v) return NULL;
        d->cap = cap;
    }
    return d;
}

static jv *dict_find(const jdict *d, jv k)
{
    for (size_t i = 0; i < d->n; i++)
        if (jv_eq(d->k[i], k)) return &d->v[i];
    return NULL;
}

int jdict_set(jarena *a, jdict *d, jv k, jv v)
{
    jv *slot = dict_find(d, k);
    if (slot) {
        *slot = v;
        return 0;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 8;
        jv *nk = jarena_alloc(a, cap * sizeof *nk), *nv = jarena_alloc(a, cap * sizeof *nv);
        if (!nk || !nv) return -1;
        if (d->n) {
            memcpy(nk, d->k, d->n * sizeof *nk);
            memcpy(nv, d->v, d->n * sizeof *nv);
        }
        d->k = nk;
        d->v = nv;
        d->cap = cap;
    }
    d->k[d->n] = k;
    d->v[d->n++] = v;
    return 0;
}

const jv *jdict_get(const jdict *d, jv k) { return dict_find(d, k); }

const jv *jdict_get_str(const jdict *d, const char *key)
{
    size_t len = strlen(key);
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].kind == JV_STR && d->k[i].u.s->len == len && !memcmp(d->k[i].u.s->s, key, len)) return &d->v[i];
    return NULL;
}

/* ---- truth, equality, order ---------------------------------------------- */

int jv_truthy(jv v)
{
    switch (v.kind) {
    case JV_UNDEF: case JV_NONE: return 0;
    case JV_BOOL: return v.u.b;
    case JV_INT: return v.u.i != 0;
    case JV_FLOAT: return v.u.f != 0.0;
    case JV_STR: return v.u.s->len != 0;
    case JV_LIST: case JV_TUPLE: return v.u.l->n != 0;
    case JV_DICT: return v.u.d->n != 0;
    default: return 1;
    }
}

int jv_is_text(jv v) { return v.kind == JV_STR; }

static int is_num(jv v) { return v.kind == JV_BOOL || v.kind == JV_INT || v.kind == JV_FLOAT; }
static double num_f(jv v) { return v.kind == JV_FLOAT ? v.u.f : v.kind == JV_INT ? (double)v.u.i : (double)v.u.b; }
static int64_t num_i(jv v) { return v.kind == JV_INT ? v.u.i : (int64_t)v.u.b; }

int jv_eq(jv a, jv b)
{
    if (is_num(a) && is_num(b)) {
        if (a.kind == JV_FLOAT || b.kind == JV_FLOAT) return num_f(a) == num_f(b);
        return num_i(a) == num_i(b);
    }
    if ((a.kind == JV_LIST || a.kind == JV_TUPLE) && a.kind == b.kind) {
        if (a.u.l->n != b.u.l->n) return 0;
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!jv_eq(a.u.l->v[i], b.u.l->v[i])) return 0;
        return 1;
    }
    if (a.kind != b.kind) return 0;
    switch (a.kind) {
    case JV_UNDEF: case JV_NONE: return 1;
    case JV_STR: return a.u.s->len == b.u.s->len && !memcmp(a.u.s->s, b.u.s->s, a.u.s->len);
    case JV_DICT:
        if (a.u.d->n != b.u.d->n) return 0;
        for (size_t i = 0; i < a.u.d->n; i++) {
            const jv *o = jdict_get(b.u.d, a.u.d->k[i]);
            if (!o || !jv_eq(a.u.d->v[i], *o)) return 0;
        }
        return 1;
    case JV_NS: return a.u.d == b.u.d;
    case JV_LOOP: return a.u.loop == b.u.loop;
    case JV_FUNC: return a.u.fn == b.u.fn;
    case JV_METHOD: return a.u.m == b.u.m;
    default: return 0;
    }
}

int jv_cmp(jv a, jv b, int *ok)
{
    *ok = 1;
    if (is_num(a) && is_num(b)) {
        if (a.kind == JV_FLOAT || b.kind == JV_FLOAT) {
            double x = num_f(a), y = num_f(b);
            if (x != x || y != y) { /* NaN: every ordering is false; callers test <, <=, >, >= */
                *ok = 2;
                return 0;
            }
            return x < y ? -1 : x > y;
        }
        int64_t x = num_i(a), y = num_i(b);
        return x < y ? -1 : x > y;
    }
    if (a.kind == JV_STR && b.kind == JV_STR) { /* by code point = by UTF-8 byte */
        size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        int c = memcmp(a.u.s->s, b.u.s->s, n);
        if (c) return c < 0 ? -1 : 1;
        return a.u.s->len < b.u.s->len ? -1 : a.u.s->len > b.u.s->len;
    }
    if ((a.kind == JV_LIST || a.kind == JV_TUPLE) && a.kind == b.kind) {
        for (size_t i = 0; i < a.u.l->n && i < b.u.l->n; i++) {
            if (jv_eq(a.u.l->v[i], b.u.l->v[i])) continue;
            return jv_cmp(a.u.l->v[i], b.u.l->v[i], ok);
        }
        return a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n;
    }
    *ok = 0;
    return 0;
}

const char *jv_type_name(jv v)
{
    static const char *const names[] = {"Undefined", "NoneType", "bool", "int", "float", "str", "list", "tuple",
                                        "dict", "Namespace", "LoopContext", "function", "method"};
    return v.kind < sizeof names / sizeof names[0] ? names[v.kind] : "?";
}

/* ---- the buffer ---------------------------------------------------------- */

void jbuf_put(jbuf *b, const char *s, size_t len)
{
    if (b->failed || !len) return;
    if (b->n + len + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + len + 1) cap *= 2;
        char *p = jarena_alloc(b->a, cap);
        if (!p) {
            b->failed = 1;
            return;
        }
        if (b->n) memcpy(p, b->p, b->n);
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, len);
    b->n += len;
    b->p[b->n] = '\0';
}

void jbuf_puts(jbuf *b, const char *s) { jbuf_put(b, s, strlen(s)); }
void jbuf_putc(jbuf *b, char c) { jbuf_put(b, &c, 1); }

/* ---- UTF-8 ---------------------------------------------------------------- */

/* The code point at s (len bytes left); *n its length (1 for a byte that does
 * not start valid UTF-8, returned as 0xFFFD's stand-in -1). */
static long utf8_at(const unsigned char *s, size_t len, size_t *n)
{
    *n = 1;
    if (s[0] < 0x80) return s[0];
    int k = s[0] >= 0xF0 && s[0] < 0xF5 ? 4 : s[0] >= 0xE0 ? 3 : s[0] >= 0xC2 && s[0] < 0xE0 ? 2 : 0;
    if (!k || (size_t)k > len) return -1;
    long c = s[0] & (0x7F >> k);
    for (int i = 1; i < k; i++) {
        if ((s[i] & 0xC0) != 0x80) return -1;
        c = (c << 6) | (s[i] & 0x3F);
    }
    if ((k == 3 && c < 0x800) || (k == 4 && (c < 0x10000 || c > 0x10FFFF)) || (c >= 0xD800 && c < 0xE000)) return -1;
    *n = (size_t)k;
    return c;
}

static int py_space(long c)
{
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

int ju_space_at(const char *s, size_t len, size_t *n)
{
    long c = utf8_at((const unsigned char *)s, len, n);
    return py_space(c);
}

int ju_space_before(const char *s, size_t end, size_t *n)
{
    size_t start = end;
    for (int k = 0; k < 4 && start > 0; k++) {
        start--;
        if (((unsigned char)s[start] & 0xC0) != 0x80) break;
    }
    size_t m;
    long c = utf8_at((const unsigned char *)s + start, end - start, &m);
    if (start + m != end) { /* not one whole character: look at the last byte alone */
        *n = 1;
        return py_space((unsigned char)s[end - 1] < 0x80 ? s[end - 1] : -1);
    }
    *n = m;
    return py_space(c);
}

/* ---- str() and repr() ----------------------------------------------------- */

void jv_float_repr(double f, char out[32])
{
    if (f != f) { strcpy(out, "nan"); return; }
    if (isinf(f)) { strcpy(out, f < 0 ? "-inf" : "inf"); return; }
    char buf[40];
    int p;
    for (p = 1; p <= 17; p++) { /* the shortest correctly rounded digits that read back as f */
        snprintf(buf, sizeof buf, "%.*e", p - 1, f);
        if (strtod(buf, NULL) == f) break;
    }
    /* buf: [-]d[.ddd]e[+-]xx */
    char digits[24];
    int nd = 0, neg = buf[0] == '-';
    const char *q = buf + neg;
    for (; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9') digits[nd++] = *q;
    int e10 = atoi(q + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = '\0';
    int decpt = e10 + 1; /* value = 0.digits x 10^decpt */
    char *o = out;
    if (neg) *o++ = '-';
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            o += sprintf(o, "0.");
            for (int i = 0; i < -decpt; i++) *o++ = '0';
            o += sprintf(o, "%s", digits);
        } else if (decpt >= nd) {
            o += sprintf(o, "%s", digits);
            for (int i = nd; i < decpt; i++) *o++ = '0';
            o += sprintf(o, ".0");
        } else {
            memcpy(o, digits, (size_t)decpt);
            o += decpt;
            *o++ = '.';
            o += sprintf(o, "%s", digits + decpt);
        }
    } else {
        *o++ = digits[0];
        if (nd > 1) o += sprintf(o, ".%s", digits + 1);
        o += sprintf(o, "e%c%02d", e10 < 0 ? '-' : '+', e10 < 0 ? -e10 : e10);
    }
    *o = '\0';
}

/* Python's repr of a str: single quotes unless it holds ' and no ";
 * non-printable characters as \x, \u escapes (ASCII and Latin-1 controls,
 * the separators and format characters Python does not print). */
static void str_repr(jbuf *b, const jstr *s)
{
    const int dq = memchr(s->s, '\'', s->len) && !memchr(s->s, '"', s->len);
    const char quote = dq ? '"' : '\'';
    jbuf_putc(b, quote);
    for (size_t i = 0; i < s->len;) {
        size_t n;
        long c = utf8_at((const unsigned char *)s->s + i, s->len - i, &n);
        char esc[32];
        if (c == quote || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            jbuf_put(b, esc, 2);
        } else if (c == '\n') jbuf_puts(b, "\\n");
        else if (c == '\r') jbuf_puts(b, "\\r");
        else if (c == '\t') jbuf_puts(b, "\\t");
        else if (c < 0) { /* a byte outside UTF-8: Python would hold a surrogate escape */
            snprintf(esc, sizeof esc, "\\udc%02x", (unsigned char)s->s[i]);
            jbuf_puts(b, esc);
        } else if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) {
            snprintf(esc, sizeof esc, "\\x%02lx", c);
            jbuf_puts(b, esc);
        } else if (c == 0x1680 || (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) ||
                   (c >= 0x205F && c <= 0x2064) || c == 0x3000 || c == 0xFEFF) {
            snprintf(esc, sizeof esc, "\\u%04lx", c);
            jbuf_puts(b, esc);
        } else {
            jbuf_put(b, s->s + i, n);
        }
        i += n;
    }
    jbuf_putc(b, quote);
}

static void seq_to(jbuf *b, jv v, int repr_items)
{
    const int tuple = v.kind == JV_TUPLE;
    jbuf_putc(b, tuple ? '(' : '[');
    for (size_t i = 0; i < v.u.l->n; i++) {
        if (i) jbuf_puts(b, ", ");
        jv_repr_to(b, v.u.l->v[i]);
    }
    if (tuple && v.u.l->n == 1) jbuf_putc(b, ',');
    jbuf_putc(b, tuple ? ')' : ']');
    (void)repr_items;
}

static void dict_to(jbuf *b, const jdict *d)
{
    jbuf_putc(b, '{');
    for (size_t i = 0; i < d->n; i++) {
        if (i) jbuf_puts(b, ", ");
        jv_repr_to(b, d->k[i]);
        jbuf_puts(b, ": ");
        jv_repr_to(b, d->v[i]);
    }
    jbuf_putc(b, '}');
}

void jv_str_to(jbuf *b, jv v)
{
    char num[40];
    switch (v.kind) {
    case JV_UNDEF: return;
    case JV_NONE: jbuf_puts(b, "None"); return;
    case JV_BOOL: jbuf_puts(b, v.u.b ? "True" : "False"); return;
    case JV_INT: snprintf(num, sizeof num, "%lld", (long long)v.u.i); jbuf_puts(b, num); return;
    case JV_FLOAT: jv_float_repr(v.u.f, num); jbuf_puts(b, num); return;
    case JV_STR: jbuf_put(b, v.u.s->s, v.u.s->len); return;
    case JV_LIST: case JV_TUPLE: seq_to(b, v, 1); return;
    case JV_DICT: dict_to(b, v.u.d); return;
    case JV_NS: jbuf_puts(b, "<Namespace "); dict_to(b, v.u.d); jbuf_puts(b, ">"); return;
    case JV_LOOP: jbuf_puts(b, "<LoopContext>"); return;
    default: jbuf_puts(b, "<function>"); return;
    }
}

void jv_repr_to(jbuf *b, jv v)
{
    if (v.kind == JV_STR) str_repr(b, v.u.s);
    else if (v.kind == JV_UNDEF) jbuf_puts(b, "Undefined");
    else jv_str_to(b, v);
}

/* ---- json.dumps ------------------------------------------------------------- */

static void json_str(jbuf *b, const char *s, size_t len, int ensure_ascii)
{
    jbuf_putc(b, '"');
    for (size_t i = 0; i < len;) {
        unsigned char c = (unsigned char)s[i];
        char esc[32];
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            jbuf_put(b, esc, 2);
            i++;
        } else if (c < 0x20) {
            const char *named = c == '\n' ? "\\n" : c == '\r' ? "\\r" : c == '\t' ? "\\t" : c == '\b' ? "\\b"
                              : c == '\f' ? "\\f" : NULL;
            if (named) jbuf_puts(b, named);
            else {
                snprintf(esc, sizeof esc, "\\u%04x", c);
                jbuf_puts(b, esc);
            }
            i++;
        } else if (c < 0x80 || !ensure_ascii) {
            size_t j = i + 1; /* a run of plain bytes */
            while (j < len && (unsigned char)s[j] >= 0x20 && s[j] != '"' && s[j] != '\\' &&
                   (!ensure_ascii || (unsigned char)s[j] < 0x80))
                j++;
            jbuf_put(b, s + i, j - i);
            i = j;
        } else {
            size_t n;
            long cp = utf8_at((const unsigned char *)s + i, len - i, &n);
            if (cp < 0) cp = 0xDC00 + c; /* Python's surrogate escape of a stray byte */
            if (cp >= 0x10000) {
                cp -= 0x10000;
                snprintf(esc, sizeof esc, "\\u%04lx\\u%04lx", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
            } else {
                snprintf(esc, sizeof esc, "\\u%04lx", cp);
            }
            jbuf_puts(b, esc);
            i += n;
        }
    }
    jbuf_putc(b, '"');
}

typedef struct json_opts {
    int ensure_ascii, indent, sort_keys;
    const char *indent_str, *item_sep, *key_sep;
    char *err;
    size_t err_bytes;
} json_opts;

static void json_newline(jbuf *b, const json_opts *o, int depth)
{
    jbuf_putc(b, '\n');
    for (int d = 0; d < depth; d++) {
        if (o->indent_str) jbuf_puts(b, o->indent_str);
        else
            for (int i = 0; i < o->indent; i++) jbuf_putc(b, ' ');
    }
}

static int key_less(jv a, jv b)
{
    int ok;
    return jv_cmp(a, b, &ok) < 0;
}

static int json_value(jbuf *b, jv v, const json_opts *o, int depth);

/* A dict key as json.dumps writes it: str as is, numbers, bools, None as their JSON text. */
static int json_key(jbuf *b, jv k, const json_opts *o)
{
    char num[40];
    switch (k.kind) {
    case JV_STR: json_str(b, k.u.s->s, k.u.s->len, o->ensure_ascii); return 0;
    case JV_INT: snprintf(num, sizeof num, "\"%lld\"", (long long)k.u.i); jbuf_puts(b, num); return 0;
    case JV_FLOAT: {
        char f[32];
        jv_float_repr(k.u.f, f);
        snprintf(num, sizeof num, "\"%.30s\"", !strcmp(f, "nan") ? "NaN" : !strcmp(f, "inf") ? "Infinity"
                                              : !strcmp(f, "-inf") ? "-Infinity" : f);
        jbuf_puts(b, num);
        return 0;
    }
    case JV_BOOL: jbuf_puts(b, k.u.b ? "\"true\"" : "\"false\""); return 0;
    case JV_NONE: jbuf_puts(b, "\"null\""); return 0;
    default:
        snprintf(o->err, o->err_bytes, "tojson: keys must be str, int, float, bool or None, not %s", jv_type_name(k));
        return -1;
    }
}

static int json_value(jbuf *b, jv v, const json_opts *o, int depth)
{
    char num[40];
    if (depth > 200) {
        snprintf(o->err, o->err_bytes, "tojson: nested more than 200 levels deep");
        return -1;
    }
    const int pretty = o->indent >= 0 || o->indent_str;
    switch (v.kind) {
    case JV_NONE: jbuf_puts(b, "null"); return 0;
    case JV_BOOL: jbuf_puts(b, v.u.b ? "true" : "false"); return 0;
    case JV_INT: snprintf(num, sizeof num, "%lld", (long long)v.u.i); jbuf_puts(b, num); return 0;
    case JV_FLOAT:
        if (v.u.f != v.u.f) jbuf_puts(b, "NaN");
        else if (isinf(v.u.f)) jbuf_puts(b, v.u.f < 0 ? "-Infinity" : "Infinity");
        else {
            jv_float_repr(v.u.f, num);
            jbuf_puts(b, num);
        }
        return 0;
    case JV_STR: json_str(b, v.u.s->s, v.u.s->len, o->ensure_ascii); return 0;
    case JV_LIST: case JV_TUPLE: {
        const jlist *l = v.u.l;
        if (!l->n) { jbuf_puts(b, "[]"); return 0; }
        jbuf_putc(b, '[');
        for (size_t i = 0; i < l->n; i++) {
            if (i) jbuf_puts(b, o->item_sep);
            if (pretty) json_newline(b, o, depth + 1);
            if (json_value(b, l->v[i], o, depth + 1)) return -1;
        }
        if (pretty) json_newline(b, o, depth);
        jbuf_putc(b, ']');
        return 0;
    }
    case JV_DICT: {
        const jdict *d = v.u.d;
        if (!d->n) { jbuf_puts(b, "{}"); return 0; }
        size_t order_stack[64], *order = order_stack;
        if (d->n > 64 && !(order = jarena_alloc(b->a, d->n * sizeof *order))) {
            snprintf(o->err, o->err_bytes, "tojson: out of memory");
            return -1;
        }
        for (size_t i = 0; i < d->n; i++) order[i] = i;
        if (o->sort_keys) /* insertion sort: stable, small dicts */
            for (size_t i = 1; i < d->n; i++)
                for (size_t j = i; j > 0 && key_less(d->k[order[j]], d->k[order[j - 1]]); j--) {
                    size_t t = order[j];
                    order[j] = order[j - 1];
                    order[j - 1] = t;
                }
        jbuf_putc(b, '{');
        for (size_t i = 0; i < d->n; i++) {
            if (i) jbuf_puts(b, o->item_sep);
            if (pretty) json_newline(b, o, depth + 1);
            if (json_key(b, d->k[order[i]], o)) return -1;
            jbuf_puts(b, o->key_sep);
            if (json_value(b, d->v[order[i]], o, depth + 1)) return -1;
        }
        if (pretty) json_newline(b, o, depth);
        jbuf_putc(b, '}');
        return 0;
    }
    default:
        snprintf(o->err, o->err_bytes, "tojson: Object of type %s is not JSON serializable", jv_type_name(v));
        return -1;
    }
}

int jv_tojson(jbuf *b, jv v, int ensure_ascii, int indent, const char *indent_str, const char *item_sep,
              const char *key_sep, int sort_keys, char *err, size_t err_bytes)
{
    const int pretty = indent >= 0 || indent_str;
    json_opts o = {ensure_ascii, indent, sort_keys, indent_str, item_sep ? item_sep : pretty ? "," : ", ",
                   key_sep ? key_sep : ": ", err, err_bytes};
    int rc = json_value(b, v, &o, 0);
    if (!rc && b->failed) {
        snprintf(err, err_bytes, "tojson: out of memory");
        rc = -1;
    }
    return rc;
}

/* ---- JSON in -------------------------------------------------------------- */

typedef struct jreader {
    jarena *a;
    const char *s;
    size_t n, i;
    int depth;
    char *err;
    size_t err_bytes;
} jreader;

static int rd_fail(jreader *r, const char *what)
{
    snprintf(r->err, r->err_bytes, "%s at byte %zu", what, r->i);
    return -1;
}

static void rd_ws(jreader *r)
{
    while (r->i < r->n && (r->s[r->i] == ' ' || r->s[r->i] == '\t' || r->s[r->i] == '\n' || r->s[r->i] == '\r'))
        r->i++;
}

static int hex4(const char *s, unsigned *out)
{
    unsigned v = 0;
    for (int k = 0; k < 4; k++) {
        char c = s[k];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return -1;
    }
    *out = v;
    return 0;
}

static void put_utf8(jbuf *b, unsigned long c)
{
    char u[4];
    if (c < 0x80) { u[0] = (char)c; jbuf_put(b, u, 1); }
    else if (c < 0x800) { u[0] = (char)(0xC0 | c >> 6); u[1] = (char)(0x80 | (c & 0x3F)); jbuf_put(b, u, 2); }
    else if (c < 0x10000) {
        u[0] = (char)(0xE0 | c >> 12); u[1] = (char)(0x80 | ((c >> 6) & 0x3F)); u[2] = (char)(0x80 | (c & 0x3F));
        jbuf_put(b, u, 3);
    } else {
        u[0] = (char)(0xF0 | c >> 18); u[1] = (char)(0x80 | ((c >> 12) & 0x3F));
        u[2] = (char)(0x80 | ((c >> 6) & 0x3F)); u[3] = (char)(0x80 | (c & 0x3F));
        jbuf_put(b, u, 4);
    }
}

static int rd_string(jreader *r, const jstr **out)
{
    r->i++; /* the opening quote */
    size_t start = r->i;
    while (r->i < r->n && r->s[r->i] != '"' && r->s[r->i] != '\\' && (unsigned char)r->s[r->i] >= 0x20) r->i++;
    if (r->i < r->n && r->s[r->i] == '"') { /* no escapes: the common case */
        *out = jstr_new(r->a, r->s + start, r->i - start);
        r->i++;
        return *out ? 0 : rd_fail(r, "out of memory");
    }
    jbuf b = {.a = r->a};
    jbuf_put(&b, r->s + start, r->i - start);
    for (;;) {
        if (r->i >= r->n) return rd_fail(r, "unterminated string");
        unsigned char c = (unsigned char)r->s[r->i];
        if (c == '"') break;
        if (c < 0x20) return rd_fail(r, "control character in a string (escape it)");
        if (c != '\\') {
            jbuf_putc(&b, (char)c);
            r->i++;
            continue;
        }
        if (r->i + 1 >= r->n) return rd_fail(r, "unterminated string");
        char e = r->s[r->i + 1];
        r->i += 2;
        switch (e) {
        case '"': jbuf_putc(&b, '"'); break;
        case '\\': jbuf_putc(&b, '\\'); break;
        case '/': jbuf_putc(&b, '/'); break;
        case 'b': jbuf_putc(&b, '\b'); break;
        case 'f': jbuf_putc(&b, '\f'); break;
        case 'n': jbuf_putc(&b, '\n'); break;
        case 'r': jbuf_putc(&b, '\r'); break;
        case 't': jbuf_putc(&b, '\t'); break;
        case 'u': {
            unsigned u, lo;
            if (r->i + 4 > r->n || hex4(r->s + r->i, &u)) return rd_fail(r, "bad \\u escape");
            r->i += 4;
            unsigned long cp = u;
            if (u >= 0xD800 && u < 0xDC00) {
                if (r->i + 6 > r->n || r->s[r->i] != '\\' || r->s[r->i + 1] != 'u' || hex4(r->s + r->i + 2, &lo) ||
                    lo < 0xDC00 || lo >= 0xE000)
                    return rd_fail(r, "a \\u escape of half a surrogate pair, which UTF-8 cannot hold");
                r->i += 6;
                cp = 0x10000 + ((unsigned long)(u - 0xD800) << 10) + (lo - 0xDC00);
            } else if (u >= 0xDC00 && u < 0xE000) {
                return rd_fail(r, "a \\u escape of half a surrogate pair, which UTF-8 cannot hold");
            }
            put_utf8(&b, cp);
            break;
        }
        default: r->i -= 1; return rd_fail(r, "bad escape in a string");
        }
    }
    r->i++;
    if (b.failed) return rd_fail(r, "out of memory");
    *out = jstr_new(r->a, b.p ? b.p : "", b.n);
    return *out ? 0 : rd_fail(r, "out of memory");
}

static int rd_number(jreader *r, jv *out)
{
    size_t start = r->i;
    int is_float = 0;
    if (r->s[r->i] == '-') r->i++;
    if (r->i + 8 <= r->n && !memcmp(r->s + r->i, "Infinity", 8)) {
        r->i += 8;
        *out = jv_float(r->s[start] == '-' ? -INFINITY : INFINITY);
        return 0;
    }
    if (r->i >= r->n || r->s[r->i] < '0' || r->s[r->i] > '9') return rd_fail(r, "not a JSON value");
    if (r->s[r->i] == '0') r->i++;
    else
        while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9') r->i++;
    if (r->i < r->n && r->s[r->i] == '.') {
        is_float = 1;
        r->i++;
        if (r->i >= r->n || r->s[r->i] < '0' || r->s[r->i] > '9') return rd_fail(r, "a digit must follow '.'");
        while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9') r->i++;
    }
    if (r->i < r->n && (r->s[r->i] == 'e' || r->s[r->i] == 'E')) {
        is_float = 1;
        r->i++;
        if (r->i < r->n && (r->s[r->i] == '+' || r->s[r->i] == '-')) r->i++;
        if (r->i >= r->n || r->s[r->i] < '0' || r->s[r->i] > '9') return rd_fail(r, "a digit must follow the exponent");
        while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9') r->i++;
    }
    char buf[512];
    size_t len = r->i - start;
    if (len >= sizeof buf) return rd_fail(r, "number too long");
    memcpy(buf, r->s + start, len);
    buf[len] = '\0';
    errno = 0;
    if (is_float) {
        *out = jv_float(strtod(buf, NULL)); /* overflow gives inf, as Python's float() */
        return 0;
    }
    long long v = strtoll(buf, NULL, 10);
    if (errno == ERANGE) return rd_fail(r, "integer outside the 64-bit range");
    *out = jv_int(v);
    return 0;
}

static int rd_value(jreader *r, jv *out)
{
    rd_ws(r);
    if (r->i >= r->n) return rd_fail(r, "expected a value");
    if (++r->depth > 256) return rd_fail(r, "nested more than 256 levels deep");
    const char c = r->s[r->i];
    int rc = 0;
    if (c == '{') {
        jdict *d = jdict_new(r->a, 0);
        if (!d) return rd_fail(r, "out of memory");
        r->i++;
        rd_ws(r);
        if (r->i < r->n && r->s[r->i] == '}') r->i++;
        else
            for (;;) {
                rd_ws(r);
                if (r->i >= r->n || r->s[r->i] != '"') return rd_fail(r, "expected a \"key\"");
                const jstr *k;
                jv v;
                if (rd_string(r, &k)) return -1;
                rd_ws(r);
                if (r->i >= r->n || r->s[r->i] != ':') return rd_fail(r, "expected ':'");
                r->i++;
                if (rd_value(r, &v)) return -1;
                if (jdict_set(r->a, d, jv_strv(k), v)) return rd_fail(r, "out of memory");
                rd_ws(r);
                if (r->i < r->n && r->s[r->i] == ',') { r->i++; continue; }
                if (r->i < r->n && r->s[r->i] == '}') { r->i++; break; }
                return rd_fail(r, "expected ',' or '}'");
            }
        out->kind = JV_DICT;
        out->u.d = d;
    } else if (c == '[') {
        jlist *l = jlist_new(r->a, 0);
        if (!l) return rd_fail(r, "out of memory");
        r->i++;
        rd_ws(r);
        if (r->i < r->n && r->s[r->i] == ']') r->i++;
        else
            for (;;) {
                jv v;
                if (rd_value(r, &v)) return -1;
                if (jlist_push(r->a, l, v)) return rd_fail(r, "out of memory");
                rd_ws(r);
                if (r->i < r->n && r->s[r->i] == ',') { r->i++; continue; }
                if (r->i < r->n && r->s[r->i] == ']') { r->i++; break; }
                return rd_fail(r, "expected ',' or ']'");
            }
        out->kind = JV_LIST;
        out->u.l = l;
    } else if (c == '"') {
        const jstr *s;
        rc = rd_string(r, &s);
        if (!rc) *out = jv_strv(s);
    } else if (r->n - r->i >= 4 && !memcmp(r->s + r->i, "true", 4)) {
        r->i += 4;
        *out = jv_bool(1);
    } else if (r->n - r->i >= 5 && !memcmp(r->s + r->i, "false", 5)) {
        r->i += 5;
        *out = jv_bool(0);
    } else if (r->n - r->i >= 4 && !memcmp(r->s + r->i, "null", 4)) {
        r->i += 4;
        *out = jv_none();
    } else if (r->n - r->i >= 3 && !memcmp(r->s + r->i, "NaN", 3)) {
        r->i += 3;
        *out = jv_float(NAN);
    } else {
        rc = rd_number(r, out);
    }
    r->depth--;
    return rc;
}

int jv_from_json(jarena *a, const char *text, size_t len, jv *out, char *err, size_t err_bytes)
{
    jreader r = {a, text, len, 0, 0, err, err_bytes};
    if (rd_value(&r, out)) return -1;
    rd_ws(&r);
    if (r.i != r.n) return rd_fail(&r, "extra data after the JSON value");
    return 0;
}
