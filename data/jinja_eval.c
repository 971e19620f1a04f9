/* The Jinja evaluator (jinja_internal.h): a syntax tree and a context to
 * text, with the semantics of jinja2 3.1 in transformers' environment
 * (ImmutableSandboxedEnvironment, autoescape off, the loopcontrols
 * extension, raise_exception, strftime_now and transformers' tojson).
 *
 * Scopes as jinja2 compiles them: {% set %} at the top level or inside an
 * {% if %} assigns in the enclosing scope; each iteration of a for loop runs
 * in a fresh scope of its own (what it sets is gone after the iteration,
 * and the next one starts from the enclosing values again), which is why
 * templates carry state across iterations in a namespace().  Undefined
 * behaves as jinja2's default Undefined: it prints as nothing, is false,
 * iterates as empty and has length 0, and any attribute, item, call or
 * arithmetic on it is an error naming what was undefined.  Attribute access
 * reads Python attributes first (so d.items is the method, d['items'] the
 * key), then items; item access the other way round; methods that would
 * change a value are refused, as the immutable sandbox refuses them.
 *
 * Strings are UTF-8; length, indexing and slicing count code points, strip,
 * split and trim use Python's whitespace (str.isspace).  upper, lower,
 * capitalize and title change ASCII letters only (Python changes every
 * cased letter).  Limits keep a hostile template finite: 100000 items from
 * range(), 256 MiB of output and memory, 100 nested loops or calls. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "jinja_internal.h"

#define MAX_RANGE 100000
#define MAX_DEPTH 100
#define MAX_OUTPUT ((size_t)256 << 20)

enum { FN_RAISE, FN_STRFTIME, FN_NAMESPACE, FN_RANGE, FN_DICT };
static const char *const FN_NAMES[] = {"raise_exception", "strftime_now", "namespace", "range", "dict"};

typedef struct frame {
    struct frame *parent;
    const char **names;
    jv *vals;
    int n, cap;
} frame;

typedef struct ev {
    jarena *a;
    const jdict *globals;
    int64_t now;
    char *err;
    size_t err_bytes;
    int failed, raised;
    int ctl;   /* 1 break, 2 continue */
    int depth;
} ev;

/* ---- errors --------------------------------------------------------------- */

static int fail(ev *E, const jnode *n, const char *fmt, ...)
{
    if (E->failed) return -1;
    int k = n ? snprintf(E->err, E->err_bytes, "line %d, column %d: ", n->line, n->col) : 0;
    va_list ap;
    va_start(ap, fmt);
    if (k >= 0 && (size_t)k < E->err_bytes) vsnprintf(E->err + k, E->err_bytes - (size_t)k, fmt, ap);
    va_end(ap);
    E->failed = 1;
    return -1;
}

static int oom(ev *E, const jnode *n) { return fail(E, n, "out of memory (or over the interpreter's limit)"); }

/* An undefined value that says why it is undefined. */
static jv undef_msg(ev *E, const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return jv_undef(jstr_new(E->a, buf, strlen(buf)));
}

static int use_undef(ev *E, const jnode *n, jv v)
{
    return fail(E, n, "%s", v.u.s ? v.u.s->s : "a value is undefined");
}

/* ---- frames --------------------------------------------------------------- */

static int frame_set(ev *E, frame *F, const char *name, jv v)
{
    for (int i = 0; i < F->n; i++)
        if (!strcmp(F->names[i], name)) {
            F->vals[i] = v;
            return 0;
        }
    if (F->n == F->cap) {
        int cap = F->cap ? 2 * F->cap : 8;
        const char **nn = jarena_alloc(E->a, (size_t)cap * sizeof *nn);
        jv *nv = jarena_alloc(E->a, (size_t)cap * sizeof *nv);
        if (!nn || !nv) return -1;
        if (F->n) {
            memcpy(nn, F->names, (size_t)F->n * sizeof *nn);
            memcpy(nv, F->vals, (size_t)F->n * sizeof *nv);
        }
        F->names = nn;
        F->vals = nv;
        F->cap = cap;
    }
    F->names[F->n] = name;
    F->vals[F->n++] = v;
    return 0;
}

static jv lookup(ev *E, const frame *F, const char *name)
{
    for (; F; F = F->parent)
        for (int i = F->n - 1; i >= 0; i--)
            if (!strcmp(F->names[i], name)) return F->vals[i];
    const jv *g = jdict_get_str(E->globals, name);
    if (g) return *g;
    for (int k = 0; k < (int)(sizeof FN_NAMES / sizeof FN_NAMES[0]); k++)
        if (!strcmp(FN_NAMES[k], name)) {
            jv f = {.kind = JV_FUNC};
            f.u.fn = k;
            return f;
        }
    return undef_msg(E, "'%s' is undefined", name);
}

/* ---- strings --------------------------------------------------------------- */

static jv str_of(ev *E, const char *s, size_t len) { return jv_strv(jstr_new(E->a, s, len)); }

/* str(v) as a jstr. */
static const jstr *to_str(ev *E, jv v)
{
    if (v.kind == JV_STR) return v.u.s;
    jbuf b = {.a = E->a};
    jv_str_to(&b, v);
    if (b.failed) return NULL;
    return jstr_new(E->a, b.p ? b.p : "", b.n);
}

static size_t u8_len(unsigned char c) { return c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1; }

/* Code point offsets: the byte offset of each of the n code points of s, and s->len at [n]. */
static size_t *cp_offsets(ev *E, const jstr *s, size_t *n_out)
{
    size_t n = 0;
    for (size_t i = 0; i < s->len; i += u8_len((unsigned char)s->s[i])) n++;
    size_t *off = jarena_alloc(E->a, (n + 1) * sizeof *off);
    if (!off) return NULL;
    size_t k = 0, i = 0;
    for (; i < s->len && k < n; i += u8_len((unsigned char)s->s[i])) off[k++] = i;
    off[n] = s->len;
    for (size_t j = 0; j < n; j++) /* a truncated sequence at the end */
        if (off[j] > s->len) off[j] = s->len;
    *n_out = n;
    return off;
}

static size_t cp_count(const jstr *s)
{
    size_t n = 0;
    for (size_t i = 0; i < s->len; i += u8_len((unsigned char)s->s[i])) n++;
    return n;
}

static char ascii_up(char c) { return c >= 'a' && c <= 'z' ? (char)(c - 32) : c; }
static char ascii_low(char c) { return c >= 'A' && c <= 'Z' ? (char)(c + 32) : c; }
static int ascii_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

/* 0 upper, 1 lower, 2 capitalize, 3 title. */
static jv case_map(ev *E, const jstr *s, int how)
{
    char *p = jarena_alloc(E->a, s->len + 1);
    if (!p) return jv_undef(NULL);
    int prev_letter = 0;
    for (size_t i = 0; i < s->len; i++) {
        char c = s->s[i];
        if (how == 0) c = ascii_up(c);
        else if (how == 1) c = ascii_low(c);
        else if (how == 2) c = i == 0 ? ascii_up(c) : ascii_low(c);
        else c = prev_letter ? ascii_low(c) : ascii_up(c);
        prev_letter = ascii_alpha(s->s[i]) || (unsigned char)s->s[i] >= 0x80;
        p[i] = c;
    }
    return str_of(E, p, s->len);
}

/* Python's str.strip / lstrip / rstrip (which: 1 left, 2 right, 3 both);
 * chars NULL: whitespace. */
static jv strip(ev *E, const jstr *s, const jstr *chars, int which)
{
    size_t b = 0, e = s->len, n;
    if (!chars) {
        if (which & 1)
            while (b < e && ju_space_at(s->s + b, e - b, &n)) b += n;
        if (which & 2)
            while (e > b && ju_space_before(s->s, e, &n) && e - n >= b) e -= n;
    } else { /* characters of chars: compare whole UTF-8 sequences */
        for (int side = 1; side <= 2; side++) {
            if (!(which & side)) continue;
            for (int moved = 1; moved && b < e;) {
                moved = 0;
                for (size_t k = 0; k < chars->len; k += u8_len((unsigned char)chars->s[k])) {
                    size_t cl = u8_len((unsigned char)chars->s[k]);
                    if (cl > chars->len - k) cl = chars->len - k;
                    if (e - b < cl) continue;
                    if (side == 1 && !memcmp(s->s + b, chars->s + k, cl)) { b += cl; moved = 1; break; }
                    if (side == 2 && !memcmp(s->s + e - cl, chars->s + k, cl)) { e -= cl; moved = 1; break; }
                }
            }
        }
    }
    return str_of(E, s->s + b, e - b);
}

static const char *find_sub(const char *h, size_t hn, const char *nd, size_t nn)
{
    if (!nn) return h;
    for (size_t i = 0; i + nn <= hn; i++)
        if (h[i] == nd[0] && !memcmp(h + i, nd, nn)) return h + i;
    return NULL;
}

static jv replace(ev *E, const jstr *s, const jstr *old, const jstr *new_, int64_t count)
{
    jbuf b = {.a = E->a};
    size_t i = 0;
    int64_t done = 0;
    if (!old->len) { /* Python inserts new around every character */
        size_t n = 0;
        for (; i <= s->len && (count < 0 || done < count); done++) {
            jbuf_put(&b, new_->s, new_->len);
            if (i == s->len) { i++; break; }
            n = u8_len((unsigned char)s->s[i]);
            jbuf_put(&b, s->s + i, n);
            i += n;
        }
        if (i <= s->len) jbuf_put(&b, s->s + i, s->len - i);
    } else {
        while (i < s->len && (count < 0 || done < count)) {
            const char *f = find_sub(s->s + i, s->len - i, old->s, old->len);
            if (!f) break;
            jbuf_put(&b, s->s + i, (size_t)(f - (s->s + i)));
            jbuf_put(&b, new_->s, new_->len);
            i = (size_t)(f - s->s) + old->len;
            done++;
        }
        jbuf_put(&b, s->s + i, s->len - i);
    }
    if (b.failed) return jv_undef(NULL);
    return str_of(E, b.p ? b.p : "", b.n);
}

/* ---- values ------------------------------------------------------------------ */

static int is_seq(jv v) { return v.kind == JV_LIST || v.kind == JV_TUPLE; }
static int is_intlike(jv v) { return v.kind == JV_INT || v.kind == JV_BOOL; }
static int64_t as_int(jv v) { return v.kind == JV_INT ? v.u.i : v.u.b; }
static int is_number(jv v) { return v.kind == JV_INT || v.kind == JV_FLOAT || v.kind == JV_BOOL; }
static double as_f(jv v) { return v.kind == JV_FLOAT ? v.u.f : (double)as_int(v); }

static jv list_v(jlist *l, int tuple)
{
    jv v = {.kind = tuple ? JV_TUPLE : JV_LIST};
    v.u.l = l;
    return v;
}

static jv dict_v(jdict *d, int ns)
{
    jv v = {.kind = ns ? JV_NS : JV_DICT};
    v.u.d = d;
    return v;
}

/* The items a for loop or a filter walks: a list's, a dict's keys, a
 * string's characters; undefined is empty. */
static int iterate(ev *E, const jnode *n, jv v, jlist **out)
{
    if (is_seq(v)) {
        *out = v.u.l;
        return 0;
    }
    jlist *l = jlist_new(E->a, 0);
    if (!l) return oom(E, n);
    *out = l;
    if (v.kind == JV_UNDEF) return 0;
    if (v.kind == JV_DICT) {
        for (size_t i = 0; i < v.u.d->n; i++)
            if (jlist_push(E->a, l, v.u.d->k[i])) return oom(E, n);
        return 0;
    }
    if (v.kind == JV_STR) {
        const jstr *s = v.u.s;
        for (size_t i = 0; i < s->len;) {
            size_t k = u8_len((unsigned char)s->s[i]);
            if (k > s->len - i) k = s->len - i;
            if (jlist_push(E->a, l, str_of(E, s->s + i, k))) return oom(E, n);
            i += k;
        }
        return 0;
    }
    return fail(E, n, "'%s' object is not iterable", jv_type_name(v));
}

static int length_of(ev *E, const jnode *n, jv v, int64_t *len)
{
    switch (v.kind) {
    case JV_UNDEF: *len = 0; return 0;
    case JV_STR: *len = (int64_t)cp_count(v.u.s); return 0;
    case JV_LIST: case JV_TUPLE: *len = (int64_t)v.u.l->n; return 0;
    case JV_DICT: *len = (int64_t)v.u.d->n; return 0;
    default: return fail(E, n, "object of type '%s' has no len()", jv_type_name(v));
    }
}

static const char *const DICT_METHODS[] = {"items", "keys", "values", "get", "copy", "pop", "popitem", "update",
                                           "setdefault", "clear", "fromkeys", NULL};
static const char *const STR_METHODS[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "startswith",
                                          "endswith", "upper", "lower", "title", "capitalize", "replace", "find",
                                          "rfind", "count", "join", "splitlines", "isdigit", "isalpha",
                                          "isalnum", "isspace", "isupper", "islower", "format", NULL};
static const char *const LIST_METHODS[] = {"index", "count", "append", "extend", "insert", "pop", "remove",
                                           "reverse", "sort", "clear", "copy", NULL};

static int in_names(const char *const *names, const char *name)
{
    for (int k = 0; names[k]; k++)
        if (!strcmp(names[k], name)) return 1;
    return 0;
}

static jv method(ev *E, jv self, const char *name)
{
    jmethod *m = jarena_alloc(E->a, sizeof *m);
    if (!m) return jv_undef(NULL);
    m->self = self;
    m->name = name;
    jv v = {.kind = JV_METHOD};
    v.u.m = m;
    return v;
}

/* obj.name as jinja2's sandboxed getattr reads it: the Python attribute
 * (a method), else the item, else undefined. */
static int get_attr(ev *E, const jnode *n, jv obj, const char *name, jv *out)
{
    switch (obj.kind) {
    case JV_UNDEF: return use_undef(E, n, obj);
    case JV_DICT:
        if (in_names(DICT_METHODS, name)) { *out = method(E, obj, name); return 0; }
        {
            const jv *v = jdict_get_str(obj.u.d, name);
            *out = v ? *v : undef_msg(E, "'dict object' has no attribute '%s'", name);
        }
        return 0;
    case JV_NS: {
        const jv *v = jdict_get_str(obj.u.d, name);
        *out = v ? *v : undef_msg(E, "'Namespace object' has no attribute '%s'", name);
        return 0;
    }
    case JV_LOOP: {
        const jloop *L = obj.u.loop;
        if (!strcmp(name, "index")) *out = jv_int(L->index0 + 1);
        else if (!strcmp(name, "index0")) *out = jv_int(L->index0);
        else if (!strcmp(name, "revindex")) *out = jv_int(L->length - L->index0);
        else if (!strcmp(name, "revindex0")) *out = jv_int(L->length - L->index0 - 1);
        else if (!strcmp(name, "first")) *out = jv_bool(L->index0 == 0);
        else if (!strcmp(name, "last")) *out = jv_bool(L->index0 == L->length - 1);
        else if (!strcmp(name, "length")) *out = jv_int(L->length);
        else if (!strcmp(name, "depth")) *out = jv_int(1);
        else if (!strcmp(name, "depth0")) *out = jv_int(0);
        else if (!strcmp(name, "previtem"))
            *out = L->index0 > 0 ? L->items->v[L->index0 - 1] : undef_msg(E, "there is no previous item");
        else if (!strcmp(name, "nextitem"))
            *out = L->index0 + 1 < L->length ? L->items->v[L->index0 + 1] : undef_msg(E, "there is no next item");
        else if (!strcmp(name, "cycle")) *out = method(E, obj, "cycle");
        else *out = undef_msg(E, "'LoopContext object' has no attribute '%s'", name);
        return 0;
    }
    case JV_STR:
        *out = in_names(STR_METHODS, name) ? method(E, obj, name) : undef_msg(E, "'str object' has no attribute '%s'", name);
        return 0;
    case JV_LIST: case JV_TUPLE:
        *out = in_names(LIST_METHODS, name) ? method(E, obj, name)
                                            : undef_msg(E, "'%s object' has no attribute '%s'", jv_type_name(obj), name);
        return 0;
    default:
        *out = undef_msg(E, "'%s object' has no attribute '%s'", jv_type_name(obj), name);
        return 0;
    }
}

/* Python's index normalisation: *i in [0, len) or 0 (out of range). */
static int norm_index(int64_t i, int64_t len, int64_t *out)
{
    if (i < 0) i += len;
    if (i < 0 || i >= len) return 0;
    *out = i;
    return 1;
}

/* obj[key]: the item, else (a string key) the attribute, else undefined. */
static int get_item(ev *E, const jnode *n, jv obj, jv key, jv *out)
{
    int64_t i;
    switch (obj.kind) {
    case JV_UNDEF: return use_undef(E, n, obj);
    case JV_DICT: {
        const jv *v = jdict_get(obj.u.d, key);
        if (v) { *out = *v; return 0; }
        break;
    }
    case JV_LIST: case JV_TUPLE:
        if (is_intlike(key)) {
            *out = norm_index(as_int(key), (int64_t)obj.u.l->n, &i) ? obj.u.l->v[i]
                                                                     : undef_msg(E, "%s index out of range", jv_type_name(obj));
            return 0;
        }
        break;
    case JV_STR:
        if (is_intlike(key)) {
            size_t cps;
            size_t *off = cp_offsets(E, obj.u.s, &cps);
            if (!off) return oom(E, n);
            *out = norm_index(as_int(key), (int64_t)cps, &i) ? str_of(E, obj.u.s->s + off[i], off[i + 1] - off[i])
                                                              : undef_msg(E, "string index out of range");
            return 0;
        }
        break;
    default: break;
    }
    if (key.kind == JV_STR && obj.kind != JV_DICT) return get_attr(E, n, obj, key.u.s->s, out);
    if (key.kind == JV_STR && in_names(DICT_METHODS, key.u.s->s)) return get_attr(E, n, obj, key.u.s->s, out);
    jbuf b = {.a = E->a};
    jv_repr_to(&b, key);
    *out = undef_msg(E, "'%s object' has no item %s", jv_type_name(obj), b.p ? b.p : "");
    return 0;
}

/* Python's slice.indices() and the items it picks. */
static int slice_of(ev *E, const jnode *n, jv obj, const jv parts[3], jv *out)
{
    int64_t len, start, stop, step = 1;
    size_t *off = NULL, cps = 0;
    if (is_seq(obj)) len = (int64_t)obj.u.l->n;
    else if (obj.kind == JV_STR) {
        if (!(off = cp_offsets(E, obj.u.s, &cps))) return oom(E, n);
        len = (int64_t)cps;
    } else if (obj.kind == JV_UNDEF) return use_undef(E, n, obj);
    else {
        *out = undef_msg(E, "'%s object' cannot be sliced", jv_type_name(obj));
        return 0;
    }
    for (int k = 0; k < 3; k++)
        if (parts[k].kind != JV_NONE && !is_intlike(parts[k]))
            return fail(E, n, "slice indices must be integers or None, not %s", jv_type_name(parts[k]));
    if (parts[2].kind != JV_NONE) step = as_int(parts[2]);
    if (step == 0) return fail(E, n, "slice step cannot be zero");
    const int64_t lo = step < 0 ? -1 : 0, hi = step < 0 ? len - 1 : len;
    if (parts[0].kind == JV_NONE) start = step < 0 ? hi : lo;
    else {
        start = as_int(parts[0]);
        if (start < 0) { start += len; if (start < lo) start = lo; }
        else if (start > hi) start = hi;
    }
    if (parts[1].kind == JV_NONE) stop = step < 0 ? lo : hi;
    else {
        stop = as_int(parts[1]);
        if (stop < 0) { stop += len; if (stop < lo) stop = lo; }
        else if (stop > hi) stop = hi;
    }
    if (is_seq(obj)) {
        jlist *l = jlist_new(E->a, 0);
        if (!l) return oom(E, n);
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
            if (jlist_push(E->a, l, obj.u.l->v[i])) return oom(E, n);
        *out = list_v(l, obj.kind == JV_TUPLE);
        return 0;
    }
    jbuf b = {.a = E->a};
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) jbuf_put(&b, obj.u.s->s + off[i], off[i + 1] - off[i]);
    if (b.failed) return oom(E, n);
    *out = str_of(E, b.p ? b.p : "", b.n);
    return 0;
}

static int contains(ev *E, const jnode *n, jv hay, jv needle, int *out)
{
    switch (hay.kind) {
    case JV_STR:
        if (needle.kind != JV_STR)
            return fail(E, n, "'in <string>' requires string as left operand, not %s", jv_type_name(needle));
        *out = find_sub(hay.u.s->s, hay.u.s->len, needle.u.s->s, needle.u.s->len) != NULL;
        return 0;
    case JV_LIST: case JV_TUPLE:
        *out = 0;
        for (size_t i = 0; i < hay.u.l->n && !*out; i++) *out = jv_eq(hay.u.l->v[i], needle);
        return 0;
    case JV_DICT: *out = jdict_get(hay.u.d, needle) != NULL; return 0;
    case JV_UNDEF: *out = 0; return 0;
    default: return fail(E, n, "argument of type '%s' is not iterable", jv_type_name(hay));
    }
}

/* ---- arithmetic ------------------------------------------------------------- */

static double py_fmod(double a, double b)
{
    double m = fmod(a, b);
    if (m != 0.0 && ((b < 0) != (m < 0))) m += b;
    else if (m == 0.0) m = copysign(0.0, b);
    return m;
}

static double py_floordiv(double a, double b)
{
    double m = fmod(a, b), div = (a - m) / b;
    if (m != 0.0 && ((b < 0) != (m < 0))) div -= 1.0;
    if (div != 0.0) {
        double f = floor(div);
        if (div - f > 0.5) f += 1.0;
        return f;
    }
    return copysign(0.0, a / b);
}

static int arith(ev *E, const jnode *n, const char *op, jv a, jv b, jv *out)
{
    if (a.kind == JV_UNDEF) return use_undef(E, n, a);
    if (b.kind == JV_UNDEF) return use_undef(E, n, b);
    const char c = op[0], c2 = op[1];
    if (is_number(a) && is_number(b)) {
        if (is_intlike(a) && is_intlike(b) && !(c == '/' && !c2)) {
            int64_t x = as_int(a), y = as_int(b), r;
            int over = 0;
            if (c == '+') over = __builtin_add_overflow(x, y, &r);
            else if (c == '-') over = __builtin_sub_overflow(x, y, &r);
            else if (c == '*' && !c2) over = __builtin_mul_overflow(x, y, &r);
            else if (c == '*') { /* ** */
                if (y < 0) { *out = jv_float(pow((double)x, (double)y)); return 0; }
                r = 1;
                for (int64_t k = 0; k < y && !over; k++) over = __builtin_mul_overflow(r, x, &r);
            } else {
                if (y == 0) return fail(E, n, "integer division or modulo by zero");
                if (x == INT64_MIN && y == -1) over = 1;
                else if (c == '/') { r = x / y; if ((x % y != 0) && ((x < 0) != (y < 0))) r--; }
                else { r = x % y; if (r != 0 && ((r < 0) != (y < 0))) r += y; }
            }
            if (over) return fail(E, n, "integer overflow in '%s' (tidal's integers are 64-bit)", op);
            *out = jv_int(r);
            return 0;
        }
        double x = as_f(a), y = as_f(b), r;
        if (c == '+') r = x + y;
        else if (c == '-') r = x - y;
        else if (c == '*' && !c2) r = x * y;
        else if (c == '*') r = pow(x, y);
        else {
            if (y == 0.0) return fail(E, n, "float division by zero");
            r = c2 == '/' ? py_floordiv(x, y) : c == '/' ? x / y : py_fmod(x, y);
        }
        *out = jv_float(r);
        return 0;
    }
    if (c == '+' && a.kind == JV_STR && b.kind == JV_STR) {
        const jstr *s = jstr_cat(E->a, a.u.s, b.u.s);
        if (!s) return oom(E, n);
        *out = jv_strv(s);
        return 0;
    }
    if (c == '+' && is_seq(a) && a.kind == b.kind) {
        jlist *l = jlist_new(E->a, a.u.l->n + b.u.l->n);
        if (!l) return oom(E, n);
        for (size_t i = 0; i < a.u.l->n; i++) jlist_push(E->a, l, a.u.l->v[i]);
        for (size_t i = 0; i < b.u.l->n; i++) jlist_push(E->a, l, b.u.l->v[i]);
        *out = list_v(l, a.kind == JV_TUPLE);
        return 0;
    }
    if (c == '*' && !c2 && ((is_intlike(a) && (b.kind == JV_STR || is_seq(b))) || (is_intlike(b) && (a.kind == JV_STR || is_seq(a))))) {
        jv seq = is_intlike(a) ? b : a;
        int64_t k = is_intlike(a) ? as_int(a) : as_int(b);
        if (k < 0) k = 0;
        if (seq.kind == JV_STR) {
            if (seq.u.s->len && (uint64_t)k > MAX_OUTPUT / seq.u.s->len) return fail(E, n, "string repetition too large");
            jbuf bb = {.a = E->a};
            for (int64_t i = 0; i < k; i++) jbuf_put(&bb, seq.u.s->s, seq.u.s->len);
            if (bb.failed) return oom(E, n);
            *out = str_of(E, bb.p ? bb.p : "", bb.n);
        } else {
            if ((uint64_t)k * seq.u.l->n > MAX_RANGE) return fail(E, n, "list repetition too large");
            jlist *l = jlist_new(E->a, 0);
            if (!l) return oom(E, n);
            for (int64_t i = 0; i < k; i++)
                for (size_t j = 0; j < seq.u.l->n; j++)
                    if (jlist_push(E->a, l, seq.u.l->v[j])) return oom(E, n);
            *out = list_v(l, seq.kind == JV_TUPLE);
        }
        return 0;
    }
    if (c == '%' && a.kind == JV_STR) return fail(E, n, "string formatting with '%%' is not supported");
    if (c == '+' && (a.kind == JV_STR || b.kind == JV_STR))
        return fail(E, n, "can only concatenate str (not \"%s\") to str", jv_type_name(a.kind == JV_STR ? b : a));
    return fail(E, n, "unsupported operand type(s) for %s: '%s' and '%s'", op, jv_type_name(a), jv_type_name(b));
}

static int compare(ev *E, const jnode *n, const char *op, jv a, jv b, int *out)
{
    if (!strcmp(op, "==")) { *out = jv_eq(a, b); return 0; }
    if (!strcmp(op, "!=")) { *out = !jv_eq(a, b); return 0; }
    if (!strcmp(op, "in")) return contains(E, n, b, a, out);
    if (!strcmp(op, "not in")) {
        int r = contains(E, n, b, a, out);
        *out = !*out;
        return r;
    }
    int ok, c = jv_cmp(a, b, &ok);
    if (!ok) {
        if (a.kind == JV_UNDEF) return use_undef(E, n, a);
        if (b.kind == JV_UNDEF) return use_undef(E, n, b);
        return fail(E, n, "'%s' not supported between instances of '%s' and '%s'", op, jv_type_name(a), jv_type_name(b));
    }
    if (ok == 2) { *out = 0; return 0; } /* NaN */
    *out = op[0] == '<' ? (op[1] ? c <= 0 : c < 0) : (op[1] ? c >= 0 : c > 0);
    return 0;
}

/* ---- arguments --------------------------------------------------------------- */

typedef struct args {
    jv *pos;
    int npos;
    const char **kwn;
    jv *kwv;
    int nkw;
} args;

/* Argument `index` (positional) or `name` (keyword); 1 if given. */
static int arg(const args *A, int index, const char *name, jv *out)
{
    if (index >= 0 && index < A->npos) {
        *out = A->pos[index];
        return 1;
    }
    for (int k = 0; name && k < A->nkw; k++)
        if (!strcmp(A->kwn[k], name)) {
            *out = A->kwv[k];
            return 1;
        }
    return 0;
}

static int eval(ev *E, frame *F, const jnode *n, jv *out);

/* Evaluates a node's arguments (skipping the first `skip` positional nodes). */
static int eval_args(ev *E, frame *F, const jnode *n, args *A)
{
    const int npos = n->n - n->nkw;
    A->pos = jarena_alloc(E->a, (size_t)(n->n + 1) * sizeof *A->pos);
    A->kwv = A->pos + npos;
    if (!A->pos) return oom(E, n);
    for (int k = 0; k < n->n; k++)
        if (eval(E, F, n->list[k], &A->pos[k])) return -1;
    A->npos = npos;
    A->kwn = n->kwnames;
    A->nkw = n->nkw;
    return 0;
}

/* ---- tests --------------------------------------------------------------------- */

static const char *const TESTS[] = {"defined", "undefined", "none", "boolean", "true", "false", "integer", "float",
                                    "number", "string", "mapping", "iterable", "sequence", "callable", "odd",
                                    "even", "divisibleby", "eq", "equalto", "==", "ne", "!=", "lt", "<",
                                    "lessthan", "le", "<=", "gt", ">", "greaterthan", "ge", ">=", "in", "sameas",
                                    "lower", "upper", "escaped", NULL};

int jinja_test_known(const char *name) { return in_names(TESTS, name); }

static int run_test(ev *E, const jnode *n, const char *name, jv v, const jv *a, int na, int *out)
{
    const jv arg0 = na > 0 ? a[0] : jv_undef(NULL);
    if (!strcmp(name, "defined")) *out = v.kind != JV_UNDEF;
    else if (!strcmp(name, "undefined")) *out = v.kind == JV_UNDEF;
    else if (!strcmp(name, "none")) *out = v.kind == JV_NONE;
    else if (!strcmp(name, "boolean")) *out = v.kind == JV_BOOL;
    else if (!strcmp(name, "true")) *out = v.kind == JV_BOOL && v.u.b;
    else if (!strcmp(name, "false")) *out = v.kind == JV_BOOL && !v.u.b;
    else if (!strcmp(name, "integer")) *out = v.kind == JV_INT;
    else if (!strcmp(name, "float")) *out = v.kind == JV_FLOAT;
    else if (!strcmp(name, "number")) *out = is_number(v);
    else if (!strcmp(name, "string")) *out = v.kind == JV_STR;
    else if (!strcmp(name, "mapping")) *out = v.kind == JV_DICT;
    else if (!strcmp(name, "iterable") || !strcmp(name, "sequence"))
        *out = v.kind == JV_STR || is_seq(v) || v.kind == JV_DICT || v.kind == JV_UNDEF;
    else if (!strcmp(name, "callable")) *out = v.kind == JV_FUNC || v.kind == JV_METHOD;
    else if (!strcmp(name, "odd") || !strcmp(name, "even") || !strcmp(name, "divisibleby")) {
        jv d = !strcmp(name, "divisibleby") ? arg0 : jv_int(2);
        jv r;
        if (!strcmp(name, "divisibleby") && na < 1) return fail(E, n, "the test 'divisibleby' needs a number");
        if (arith(E, n, "%", v, d, &r)) return -1;
        *out = !strcmp(name, "odd") ? jv_truthy(r) : !jv_truthy(r);
    } else if (!strcmp(name, "sameas")) *out = v.kind == arg0.kind && jv_eq(v, arg0) && (v.kind <= JV_BOOL);
    else if (!strcmp(name, "lower") || !strcmp(name, "upper")) {
        const jstr *s = to_str(E, v);
        if (!s) return oom(E, n);
        int any = 0, ok = 1;
        for (size_t i = 0; i < s->len; i++) {
            char c = s->s[i];
            if (!ascii_alpha(c)) continue;
            any = 1;
            if (!strcmp(name, "lower") ? (c >= 'A' && c <= 'Z') : (c >= 'a' && c <= 'z')) ok = 0;
        }
        *out = any && ok;
    } else if (!strcmp(name, "escaped")) *out = 0;
    else if (!strcmp(name, "in")) {
        if (na < 1) return fail(E, n, "the test 'in' needs a container");
        return contains(E, n, arg0, v, out);
    } else { /* comparisons */
        static const char *const cmp[][2] = {{"eq", "=="}, {"equalto", "=="}, {"==", "=="}, {"ne", "!="},
                                             {"!=", "!="}, {"lt", "<"}, {"<", "<"}, {"lessthan", "<"},
                                             {"le", "<="}, {"<=", "<="}, {"gt", ">"}, {">", ">"},
                                             {"greaterthan", ">"}, {"ge", ">="}, {">=", ">="}};
        for (size_t k = 0; k < sizeof cmp / sizeof cmp[0]; k++)
            if (!strcmp(name, cmp[k][0])) {
                if (na < 1) return fail(E, n, "the test '%s' needs a value to compare with", name);
                return compare(E, n, cmp[k][1], v, arg0, out);
            }
        return fail(E, n, "no test named '%s'", name);
    }
    return 0;
}

/* ---- filters ------------------------------------------------------------------- */

static const char *const FILTERS[] = {"abs", "attr", "capitalize", "count", "d", "default", "dictsort", "e",
                                      "escape", "first", "float", "indent", "int", "items", "join", "last",
                                      "length", "list", "lower", "map", "max", "min", "reject", "rejectattr",
                                      "replace", "reverse", "round", "safe", "select", "selectattr", "sort",
                                      "string", "sum", "title", "tojson", "trim", "unique", "upper", NULL};

int jinja_filter_known(const char *name) { return in_names(FILTERS, name); }

static int run_filter(ev *E, const jnode *n, const char *name, jv v, const args *A, jv *out);

/* Stable merge sort of l's items by key (the item, or its attribute), with
 * Python's ordering; case-insensitive compares lower-cased ASCII. */
typedef struct sort_ctx { ev *E; const jnode *n; int failed, fold; } sort_ctx;

static jv fold_key(ev *E, jv v)
{
    if (v.kind != JV_STR) return v;
    jv r = case_map(E, v.u.s, 1);
    return r.kind == JV_STR ? r : v;
}

static int sort_less(sort_ctx *S, jv a, jv b)
{
    int ok;
    if (S->fold) a = fold_key(S->E, a), b = fold_key(S->E, b);
    int c = jv_cmp(a, b, &ok);
    if (!ok && !S->failed) {
        S->failed = 1;
        fail(S->E, S->n, "'<' not supported between instances of '%s' and '%s'", jv_type_name(a), jv_type_name(b));
    }
    return ok == 1 && c < 0;
}

static void merge_sort(sort_ctx *S, jv *items, jv *keys, jv *tmp_i, jv *tmp_k, size_t n)
{
    if (n < 2) return;
    size_t h = n / 2;
    merge_sort(S, items, keys, tmp_i, tmp_k, h);
    merge_sort(S, items + h, keys + h, tmp_i, tmp_k, n - h);
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) {
        if (sort_less(S, keys[j], keys[i])) tmp_i[k] = items[j], tmp_k[k++] = keys[j++];
        else tmp_i[k] = items[i], tmp_k[k++] = keys[i++];
    }
    while (i < h) tmp_i[k] = items[i], tmp_k[k++] = keys[i++];
    while (j < n) tmp_i[k] = items[j], tmp_k[k++] = keys[j++];
    memcpy(items, tmp_i, n * sizeof *items);
    memcpy(keys, tmp_k, n * sizeof *keys);
}

/* The value of attribute path `attr` ("a.b", or an integer index) of v. */
static int attr_path(ev *E, const jnode *n, jv v, jv attr, jv *out)
{
    if (attr.kind != JV_STR) return get_item(E, n, v, attr, out);
    const char *p = attr.u.s->s;
    for (;;) {
        const char *dot = strchr(p, '.');
        size_t len = dot ? (size_t)(dot - p) : strlen(p);
        const jstr *part = jstr_new(E->a, p, len);
        if (!part) return oom(E, n);
        char *end;
        long long idx = strtoll(part->s, &end, 10);
        jv key = (len && *end == '\0') ? jv_int(idx) : jv_strv(part);
        if (v.kind == JV_UNDEF) return use_undef(E, n, v);
        if (get_item(E, n, v, key, &v)) return -1;
        if (!dot) break;
        p = dot + 1;
    }
    *out = v;
    return 0;
}

static int sorted(ev *E, const jnode *n, jlist *items, int reverse, int fold, jv attribute, jlist **out)
{
    size_t m = items->n;
    jlist *l = jlist_new(E->a, m);
    jv *keys = jarena_alloc(E->a, (m + 1) * sizeof *keys), *ti = jarena_alloc(E->a, (m + 1) * sizeof *ti),
       *tk = jarena_alloc(E->a, (m + 1) * sizeof *tk);
    if (!l || !keys || !ti || !tk) return oom(E, n);
    for (size_t i = 0; i < m; i++) {
        l->v[i] = items->v[reverse ? m - 1 - i : i];
        if (attribute.kind == JV_UNDEF || attribute.kind == JV_NONE) keys[i] = l->v[i];
        else if (attr_path(E, n, l->v[i], attribute, &keys[i])) return -1;
    }
    l->n = m;
    sort_ctx S = {E, n, 0, fold};
    merge_sort(&S, l->v, keys, ti, tk, m);
    if (S.failed) return -1;
    if (reverse) /* sorted(reverse=True) is stable: sort the reversed list, then reverse it */
        for (size_t i = 0; i < m / 2; i++) {
            jv t = l->v[i];
            l->v[i] = l->v[m - 1 - i];
            l->v[m - 1 - i] = t;
        }
    *out = l;
    return 0;
}

/* select / reject / selectattr / rejectattr. */
static int select_items(ev *E, const jnode *n, jv v, const args *A, int by_attr, int keep, jv *out)
{
    jlist *items, *res = jlist_new(E->a, 0);
    if (!res || iterate(E, n, v, &items)) return res ? -1 : oom(E, n);
    int first = by_attr ? 1 : 0;
    jv attr = jv_undef(NULL), test = jv_undef(NULL);
    if (by_attr && !arg(A, 0, NULL, &attr)) return fail(E, n, "selectattr / rejectattr need an attribute name");
    int has_test = arg(A, first, NULL, &test);
    if (has_test && test.kind != JV_STR) return fail(E, n, "the test name must be a string");
    if (has_test && !jinja_test_known(test.u.s->s)) return fail(E, n, "the test '%s' is not supported", test.u.s->s);
    const jv *targs = A->pos + first + 1;
    int ntargs = A->npos - first - 1 > 0 ? A->npos - first - 1 : 0;
    for (size_t i = 0; i < items->n; i++) {
        jv x = items->v[i];
        int t;
        if (by_attr && attr_path(E, n, x, attr, &x)) return -1;
        if (has_test) {
            if (run_test(E, n, test.u.s->s, x, targs, ntargs, &t)) return -1;
        } else {
            t = jv_truthy(x);
        }
        if ((t != 0) == keep && jlist_push(E->a, res, items->v[i])) return oom(E, n);
    }
    *out = list_v(res, 0);
    return 0;
}

static int do_map(ev *E, const jnode *n, jv v, const args *A, jv *out)
{
    jlist *items, *res = jlist_new(E->a, 0);
    if (!res || iterate(E, n, v, &items)) return res ? -1 : oom(E, n);
    jv attr = jv_undef(NULL), fname = jv_undef(NULL), dflt = jv_undef(NULL);
    int by_attr = arg(A, -1, "attribute", &attr), has_default = arg(A, -1, "default", &dflt);
    if (!by_attr && (!arg(A, 0, NULL, &fname) || fname.kind != JV_STR))
        return fail(E, n, "map needs attribute='...' or a filter name");
    if (!by_attr && !jinja_filter_known(fname.u.s->s)) return fail(E, n, "the filter '%s' is not supported", fname.u.s->s);
    args rest = {A->pos + 1, A->npos > 1 ? A->npos - 1 : 0, A->kwn, A->kwv, A->nkw};
    for (size_t i = 0; i < items->n; i++) {
        jv x;
        if (by_attr) {
            if (attr_path(E, n, items->v[i], attr, &x)) return -1;
            if (x.kind == JV_UNDEF && has_default) x = dflt;
        } else if (run_filter(E, n, fname.u.s->s, items->v[i], &rest, &x)) {
            return -1;
        }
        if (jlist_push(E->a, res, x)) return oom(E, n);
    }
    *out = list_v(res, 0);
    return 0;
}

static int want_str(ev *E, const jnode *n, jv v, const char *what, const jstr **out)
{
    if (v.kind != JV_STR) return fail(E, n, "%s must be a string, not %s", what, jv_type_name(v));
    *out = v.u.s;
    return 0;
}

static int run_filter(ev *E, const jnode *n, const char *name, jv v, const args *A, jv *out)
{
    jv a0 = jv_undef(NULL), a1 = jv_undef(NULL), a2 = jv_undef(NULL);
    const jstr *s;
    if (!strcmp(name, "length") || !strcmp(name, "count")) {
        int64_t len = 0;
        if (length_of(E, n, v, &len)) return -1;
        *out = jv_int(len);
    } else if (!strcmp(name, "default") || !strcmp(name, "d")) {
        jv boolean = jv_bool(0);
        if (!arg(A, 0, "default_value", &a0)) a0 = str_of(E, "", 0);
        arg(A, 1, "boolean", &boolean);
        *out = (v.kind == JV_UNDEF || (jv_truthy(boolean) && !jv_truthy(v))) ? a0 : v;
    } else if (!strcmp(name, "trim")) {
        jv chars = jv_none();
        arg(A, 0, "chars", &chars);
        if (!(s = to_str(E, v))) return oom(E, n);
        *out = strip(E, s, chars.kind == JV_STR ? chars.u.s : NULL, 3);
    } else if (!strcmp(name, "upper") || !strcmp(name, "lower") || !strcmp(name, "capitalize") || !strcmp(name, "title")) {
        if (!(s = to_str(E, v))) return oom(E, n);
        *out = case_map(E, s, !strcmp(name, "upper") ? 0 : !strcmp(name, "lower") ? 1 : !strcmp(name, "capitalize") ? 2 : 3);
    } else if (!strcmp(name, "string")) {
        if (!(s = to_str(E, v))) return oom(E, n);
        *out = jv_strv(s);
    } else if (!strcmp(name, "safe")) {
        *out = v;
    } else if (!strcmp(name, "e") || !strcmp(name, "escape")) {
        if (!(s = to_str(E, v))) return oom(E, n);
        jbuf b = {.a = E->a};
        for (size_t i = 0; i < s->len; i++) {
            char c = s->s[i];
            jbuf_puts(&b, c == '&' ? "&amp;" : c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '"' ? "&#34;" : c == '\'' ? "&#39;" : "");
            if (c != '&' && c != '<' && c != '>' && c != '"' && c != '\'') jbuf_putc(&b, c);
        }
        if (b.failed) return oom(E, n);
        *out = str_of(E, b.p ? b.p : "", b.n);
    } else if (!strcmp(name, "tojson")) {
        jv indent = jv_none(), ea = jv_bool(0), seps = jv_none(), sk = jv_bool(0);
        arg(A, 0, "ensure_ascii", &ea);
        arg(A, 1, "indent", &indent);
        arg(A, 2, "separators", &seps);
        arg(A, 3, "sort_keys", &sk);
        /* transformers: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) */
        int ind = -1;
        const char *ind_s = NULL, *item_sep = NULL, *key_sep = NULL;
        if (indent.kind == JV_STR) ind_s = indent.u.s->s;
        else if (is_intlike(indent)) ind = as_int(indent) < 0 ? 0 : (int)(as_int(indent) > 64 ? 64 : as_int(indent));
        else if (indent.kind != JV_NONE) return fail(E, n, "tojson: indent must be an integer or a string");
        if (seps.kind != JV_NONE) {
            if (!is_seq(seps) || seps.u.l->n != 2 || seps.u.l->v[0].kind != JV_STR || seps.u.l->v[1].kind != JV_STR)
                return fail(E, n, "tojson: separators must be a pair of strings");
            item_sep = seps.u.l->v[0].u.s->s;
            key_sep = seps.u.l->v[1].u.s->s;
        }
        jbuf b = {.a = E->a};
        char err[200];
        if (jv_tojson(&b, v, jv_truthy(ea), ind, ind_s, item_sep, key_sep, jv_truthy(sk), err, sizeof err))
            return v.kind == JV_UNDEF ? use_undef(E, n, v) : fail(E, n, "%s", err);
        *out = str_of(E, b.p ? b.p : "", b.n);
    } else if (!strcmp(name, "items")) {
        if (v.kind == JV_UNDEF) { *out = list_v(jlist_new(E->a, 0), 0); return 0; }
        if (v.kind != JV_DICT) return fail(E, n, "can only get item pairs from a mapping, not %s", jv_type_name(v));
        jlist *l = jlist_new(E->a, v.u.d->n);
        if (!l) return oom(E, n);
        for (size_t i = 0; i < v.u.d->n; i++) {
            jlist *pair = jlist_new(E->a, 2);
            if (!pair) return oom(E, n);
            pair->v[0] = v.u.d->k[i];
            pair->v[1] = v.u.d->v[i];
            pair->n = 2;
            l->v[l->n++] = list_v(pair, 1);
        }
        *out = list_v(l, 0);
    } else if (!strcmp(name, "dictsort")) {
        if (v.kind != JV_DICT) return fail(E, n, "dictsort needs a mapping, not %s", jv_type_name(v));
        jv cs = jv_bool(0), by = jv_undef(NULL), rev = jv_bool(0), items;
        arg(A, 0, "case_sensitive", &cs);
        arg(A, 1, "by", &by);
        arg(A, 2, "reverse", &rev);
        args none = {0};
        if (run_filter(E, n, "items", v, &none, &items)) return -1;
        int by_value = by.kind == JV_STR && !strcmp(by.u.s->s, "value");
        jlist *l;
        if (sorted(E, n, items.u.l, jv_truthy(rev), !jv_truthy(cs), jv_int(by_value), &l)) return -1;
        *out = list_v(l, 0);
    } else if (!strcmp(name, "first") || !strcmp(name, "last")) {
        jlist *items;
        if (iterate(E, n, v, &items)) return -1;
        *out = items->n ? items->v[!strcmp(name, "first") ? 0 : items->n - 1]
                        : undef_msg(E, "No %s item, sequence was empty.", name);
    } else if (!strcmp(name, "join")) {
        jv attribute = jv_none();
        if (!arg(A, 0, "d", &a0)) a0 = str_of(E, "", 0);
        arg(A, 1, "attribute", &attribute);
        if (want_str(E, n, a0, "join's separator", &s)) return -1;
        jlist *items;
        if (iterate(E, n, v, &items)) return -1;
        jbuf b = {.a = E->a};
        for (size_t i = 0; i < items->n; i++) {
            jv x = items->v[i];
            if (attribute.kind != JV_NONE && attr_path(E, n, x, attribute, &x)) return -1;
            if (i) jbuf_put(&b, s->s, s->len);
            jv_str_to(&b, x);
        }
        if (b.failed) return oom(E, n);
        *out = str_of(E, b.p ? b.p : "", b.n);
    } else if (!strcmp(name, "list")) {
        jlist *items;
        if (iterate(E, n, v, &items)) return -1;
        jlist *l = jlist_new(E->a, items->n);
        if (!l) return oom(E, n);
        if (items->n) memcpy(l->v, items->v, items->n * sizeof *l->v);
        l->n = items->n;
        *out = list_v(l, 0);
    } else if (!strcmp(name, "reverse")) {
        if (v.kind == JV_STR) {
            jv parts[3] = {jv_none(), jv_none(), jv_int(-1)};
            return slice_of(E, n, v, parts, out);
        }
        jlist *items;
        if (iterate(E, n, v, &items)) return -1;
        jlist *l = jlist_new(E->a, items->n);
        if (!l) return oom(E, n);
        for (size_t i = 0; i < items->n; i++) l->v[i] = items->v[items->n - 1 - i];
        l->n = items->n;
        *out = list_v(l, 0);
    } else if (!strcmp(name, "replace")) {
        const jstr *old, *new_;
        jv cnt = jv_none();
        if (!arg(A, 0, "old", &a0) || !arg(A, 1, "new", &a1)) return fail(E, n, "replace needs old and new");
        arg(A, 2, "count", &cnt);
        if (!(s = to_str(E, v)) || want_str(E, n, a0, "replace's old", &old) || want_str(E, n, a1, "replace's new", &new_))
            return E->failed ? -1 : oom(E, n);
        *out = replace(E, s, old, new_, is_intlike(cnt) ? as_int(cnt) : -1);
    } else if (!strcmp(name, "int") || !strcmp(name, "float")) {
        const int is_int = !strcmp(name, "int");
        jv dflt = is_int ? jv_int(0) : jv_float(0.0);
        arg(A, 0, "default", &dflt);
        if (v.kind == JV_STR) {
            char *end;
            const char *p = v.u.s->s;
            while (*p == ' ' || *p == '\t' || *p == '\n') p++;
            if (is_int) {
                long long r = strtoll(p, &end, 10);
                if (end != p && (*end == '\0' || *end == ' ' || *end == '\n')) *out = jv_int(r);
                else {
                    double f = strtod(p, &end); /* jinja2: int(float(s)) when int(s) fails */
                    *out = end != p && *end == '\0' && isfinite(f) ? jv_int((int64_t)f) : dflt;
                }
            } else {
                double r = strtod(p, &end);
                *out = end != p ? jv_float(r) : dflt;
            }
        } else if (is_number(v)) {
            *out = is_int ? (v.kind == JV_FLOAT ? (isfinite(v.u.f) ? jv_int((int64_t)v.u.f) : dflt) : jv_int(as_int(v)))
                          : jv_float(as_f(v));
        } else {
            *out = dflt;
        }
    } else if (!strcmp(name, "abs")) {
        if (!is_number(v)) return fail(E, n, "bad operand type for abs(): '%s'", jv_type_name(v));
        *out = v.kind == JV_FLOAT ? jv_float(fabs(v.u.f)) : jv_int(as_int(v) < 0 ? -as_int(v) : as_int(v));
    } else if (!strcmp(name, "round")) {
        jv prec = jv_int(0), meth = jv_undef(NULL);
        arg(A, 0, "precision", &prec);
        arg(A, 1, "method", &meth);
        if (!is_number(v) || !is_intlike(prec)) return fail(E, n, "round needs a number and an integer precision");
        double f = as_f(v), m = pow(10.0, (double)as_int(prec)), r;
        const char *how = meth.kind == JV_STR ? meth.u.s->s : "common";
        if (!strcmp(how, "common")) r = round(f * m) / m;
        else if (!strcmp(how, "ceil")) r = ceil(f * m) / m;
        else if (!strcmp(how, "floor")) r = floor(f * m) / m;
        else return fail(E, n, "round: method must be common, ceil or floor");
        *out = jv_float(r);
    } else if (!strcmp(name, "sum")) {
        jv attribute = jv_none(), start = jv_int(0);
        arg(A, 0, "attribute", &attribute);
        arg(A, 1, "start", &start);
        jlist *items;
        if (iterate(E, n, v, &items)) return -1;
        jv acc = start;
        for (size_t i = 0; i < items->n; i++) {
            jv x = items->v[i];
            if (attribute.kind != JV_NONE && attr_path(E, n, x, attribute, &x)) return -1;
            if (arith(E, n, "+", acc, x, &acc)) return -1;
        }
        *out = acc;
    } else if (!strcmp(name, "min") || !strcmp(name, "max") || !strcmp(name, "sort") || !strcmp(name, "unique")) {
        jv cs = jv_bool(0), attribute = jv_none(), rev = jv_bool(0);
        const int is_sort = !strcmp(name, "sort");
        if (is_sort) {
            arg(A, 0, "reverse", &rev);
            arg(A, 1, "case_sensitive", &cs);
            arg(A, 2, "attribute", &attribute);
        } else {
            arg(A, 0, "case_sensitive", &cs);
            arg(A, 1, "attribute", &attribute);
        }
        jlist *items, *l;
        if (iterate(E, n, v, &items)) return -1;
        if (!strcmp(name, "unique")) {
            jlist *res = jlist_new(E->a, 0);
            jlist *seen = jlist_new(E->a, 0);
            if (!res || !seen) return oom(E, n);
            for (size_t i = 0; i < items->n; i++) {
                jv key = items->v[i];
                int dup = 0;
                if (attribute.kind != JV_NONE && attr_path(E, n, key, attribute, &key)) return -1;
                if (!jv_truthy(cs)) key = fold_key(E, key);
                for (size_t j = 0; j < seen->n && !dup; j++) dup = jv_eq(seen->v[j], key);
                if (dup) continue;
                if (jlist_push(E->a, seen, key) || jlist_push(E->a, res, items->v[i])) return oom(E, n);
            }
            *out = list_v(res, 0);
            return 0;
        }
        if (sorted(E, n, items, jv_truthy(rev), !jv_truthy(cs), attribute, &l)) return -1;
        if (is_sort) *out = list_v(l, 0);
        else if (!l->n) *out = undef_msg(E, "No aggregated item, sequence was empty.");
        else *out = l->v[!strcmp(name, "min") ? 0 : l->n - 1];
    } else if (!strcmp(name, "select") || !strcmp(name, "reject")) {
        return select_items(E, n, v, A, 0, !strcmp(name, "select"), out);
    } else if (!strcmp(name, "selectattr") || !strcmp(name, "rejectattr")) {
        return select_items(E, n, v, A, 1, !strcmp(name, "selectattr"), out);
    } else if (!strcmp(name, "map")) {
        return do_map(E, n, v, A, out);
    } else if (!strcmp(name, "attr")) {
        if (!arg(A, 0, "name", &a0) || want_str(E, n, a0, "attr's name", &s)) return E->failed ? -1 : fail(E, n, "attr needs a name");
        return get_attr(E, n, v, s->s, out);
    } else if (!strcmp(name, "indent")) {
        jv width = jv_int(4), first = jv_bool(0), blank = jv_bool(0);
        arg(A, 0, "width", &width);
        arg(A, 1, "first", &first);
        arg(A, 2, "blank", &blank);
        const jstr *pad;
        if (width.kind == JV_STR) pad = width.u.s;
        else {
            int64_t w = is_intlike(width) ? as_int(width) : 4;
            if (w < 0) w = 0;
            if (w > 1024) w = 1024;
            char sp[1025];
            memset(sp, ' ', (size_t)w);
            pad = jstr_new(E->a, sp, (size_t)w);
        }
        if (!(s = to_str(E, v)) || !pad) return oom(E, n);
        jbuf b = {.a = E->a};
        size_t i = 0;
        int line = 0;
        while (i <= s->len) {
            const char *nl = memchr(s->s + i, '\n', s->len - i);
            size_t end = nl ? (size_t)(nl - s->s) : s->len;
            int empty = end == i;
            if ((line > 0 || jv_truthy(first)) && (!empty || jv_truthy(blank))) jbuf_put(&b, pad->s, pad->len);
            jbuf_put(&b, s->s + i, end - i);
            if (!nl) break;
            jbuf_putc(&b, '\n');
            i = end + 1;
            line++;
        }
        if (b.failed) return oom(E, n);
        *out = str_of(E, b.p ? b.p : "", b.n);
    } else {
        (void)a2;
        return fail(E, n, "the filter '%s' is not supported by tidal's Jinja interpreter", name);
    }
    if (out->kind == JV_UNDEF && !out->u.s && strcmp(name, "default") && strcmp(name, "d")) {
        /* a constructor ran out of memory (an undefined without a message) */
        if (v.kind != JV_UNDEF) return oom(E, n);
    }
    return 0;
}

/* ---- calls ------------------------------------------------------------------ */

static int split_ws(ev *E, const jnode *n, const jstr *s, int64_t maxsplit, jlist *l)
{
    size_t i = 0, k;
    int64_t done = 0;
    for (;;) {
        while (i < s->len && ju_space_at(s->s + i, s->len - i, &k)) i += k;
        if (i >= s->len) return 0;
        if (maxsplit >= 0 && done == maxsplit) { /* the rest, its trailing whitespace stripped */
            size_t e = s->len;
            while (e > i && ju_space_before(s->s, e, &k)) e -= k;
            return jlist_push(E->a, l, str_of(E, s->s + i, e - i)) ? oom(E, n) : 0;
        }
        size_t j = i;
        while (j < s->len && !ju_space_at(s->s + j, s->len - j, &k)) j += k;
        if (jlist_push(E->a, l, str_of(E, s->s + i, j - i))) return oom(E, n);
        done++;
        i = j;
    }
}

static int call_method(ev *E, const jnode *n, const jmethod *m, const args *A, jv *out)
{
    jv self = m->self, a0 = jv_undef(NULL), a1 = jv_undef(NULL);
    const char *name = m->name;
    if (self.kind == JV_LOOP) { /* loop.cycle(...) */
        if (A->npos < 1) return fail(E, n, "loop.cycle needs at least one value");
        *out = A->pos[self.u.loop->index0 % A->npos];
        return 0;
    }
    if (self.kind == JV_DICT) {
        const jdict *d = self.u.d;
        if (!strcmp(name, "items") || !strcmp(name, "keys") || !strcmp(name, "values")) {
            jlist *l = jlist_new(E->a, d->n);
            if (!l) return oom(E, n);
            for (size_t i = 0; i < d->n; i++) {
                if (!strcmp(name, "keys")) l->v[i] = d->k[i];
                else if (!strcmp(name, "values")) l->v[i] = d->v[i];
                else {
                    jlist *pair = jlist_new(E->a, 2);
                    if (!pair) return oom(E, n);
                    pair->v[0] = d->k[i];
                    pair->v[1] = d->v[i];
                    pair->n = 2;
                    l->v[i] = list_v(pair, 1);
                }
            }
            l->n = d->n;
            *out = list_v(l, 0);
            return 0;
        }
        if (!strcmp(name, "get")) {
            if (!arg(A, 0, NULL, &a0)) return fail(E, n, "get needs a key");
            if (!arg(A, 1, NULL, &a1)) a1 = jv_none();
            const jv *v = jdict_get(d, a0);
            *out = v ? *v : a1;
            return 0;
        }
        if (!strcmp(name, "copy")) {
            *out = self;
            return 0;
        }
    } else if (is_seq(self)) {
        if (!strcmp(name, "index") || !strcmp(name, "count")) {
            if (!arg(A, 0, NULL, &a0)) return fail(E, n, "%s needs a value", name);
            int64_t c = 0;
            for (size_t i = 0; i < self.u.l->n; i++)
                if (jv_eq(self.u.l->v[i], a0)) {
                    if (!strcmp(name, "index")) { *out = jv_int((int64_t)i); return 0; }
                    c++;
                }
            if (!strcmp(name, "index")) return fail(E, n, "list.index(x): x not in list");
            *out = jv_int(c);
            return 0;
        }
        if (!strcmp(name, "copy")) {
            *out = self;
            return 0;
        }
    } else if (self.kind == JV_STR) {
        const jstr *s = self.u.s, *x;
        if (!strcmp(name, "strip") || !strcmp(name, "lstrip") || !strcmp(name, "rstrip")) {
            arg(A, 0, "chars", &a0);
            *out = strip(E, s, a0.kind == JV_STR ? a0.u.s : NULL, name[0] == 'l' ? 1 : name[0] == 'r' ? 2 : 3);
            return 0;
        }
        if (!strcmp(name, "upper") || !strcmp(name, "lower") || !strcmp(name, "title") || !strcmp(name, "capitalize")) {
            *out = case_map(E, s, name[0] == 'u' ? 0 : name[0] == 'l' ? 1 : name[0] == 'c' ? 2 : 3);
            return 0;
        }
        if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
            if (!arg(A, 0, NULL, &a0)) return fail(E, n, "%s needs an argument", name);
            jlist one = {1, 1, &a0};
            const jlist *cands = is_seq(a0) ? a0.u.l : &one;
            *out = jv_bool(0);
            for (size_t i = 0; i < cands->n; i++) {
                if (want_str(E, n, cands->v[i], name, &x)) return -1;
                if (x->len <= s->len && !memcmp(name[0] == 's' ? s->s : s->s + s->len - x->len, x->s, x->len))
                    *out = jv_bool(1);
            }
            return 0;
        }
        if (!strcmp(name, "split") || !strcmp(name, "rsplit")) {
            jv sep = jv_none(), maxs = jv_int(-1);
            arg(A, 0, "sep", &sep);
            arg(A, 1, "maxsplit", &maxs);
            jlist *l = jlist_new(E->a, 0);
            if (!l) return oom(E, n);
            int64_t maxsplit = is_intlike(maxs) ? as_int(maxs) : -1;
            if (sep.kind == JV_NONE) {
                if (name[0] == 'r' && maxsplit >= 0) return fail(E, n, "rsplit with maxsplit and no separator is not supported");
                if (split_ws(E, n, s, maxsplit, l)) return -1;
            } else {
                if (want_str(E, n, sep, "split's separator", &x)) return -1;
                if (!x->len) return fail(E, n, "empty separator");
                if (name[0] == 'r' && maxsplit >= 0) return fail(E, n, "rsplit with maxsplit is not supported");
                size_t i = 0;
                int64_t done = 0;
                for (;;) {
                    const char *f = (maxsplit < 0 || done < maxsplit) ? find_sub(s->s + i, s->len - i, x->s, x->len) : NULL;
                    size_t end = f ? (size_t)(f - s->s) : s->len;
                    if (jlist_push(E->a, l, str_of(E, s->s + i, end - i))) return oom(E, n);
                    if (!f) break;
                    i = end + x->len;
                    done++;
                }
            }
            *out = list_v(l, 0);
            return 0;
        }
        if (!strcmp(name, "splitlines")) {
            jlist *l = jlist_new(E->a, 0);
            if (!l) return oom(E, n);
            size_t i = 0;
            while (i < s->len) {
                size_t j = i;
                while (j < s->len && s->s[j] != '\n' && s->s[j] != '\r') j++;
                if (jlist_push(E->a, l, str_of(E, s->s + i, j - i))) return oom(E, n);
                if (j < s->len && s->s[j] == '\r' && j + 1 < s->len && s->s[j + 1] == '\n') j++;
                i = j + 1;
            }
            *out = list_v(l, 0);
            return 0;
        }
        if (!strcmp(name, "replace")) {
            const jstr *old, *new_;
            jv cnt = jv_int(-1);
            arg(A, 2, "count", &cnt);
            if (!arg(A, 0, NULL, &a0) || !arg(A, 1, NULL, &a1) || want_str(E, n, a0, "replace's old", &old) ||
                want_str(E, n, a1, "replace's new", &new_))
                return E->failed ? -1 : fail(E, n, "replace needs old and new");
            *out = replace(E, s, old, new_, is_intlike(cnt) ? as_int(cnt) : -1);
            return 0;
        }
        if (!strcmp(name, "find") || !strcmp(name, "rfind") || !strcmp(name, "count")) {
            if (!arg(A, 0, NULL, &a0) || want_str(E, n, a0, name, &x)) return E->failed ? -1 : fail(E, n, "%s needs a string", name);
            int64_t found = -1, count = 0;
            for (size_t i = 0; i + x->len <= s->len;) {
                if (!memcmp(s->s + i, x->s, x->len)) {
                    if (found < 0 || name[0] == 'r') found = (int64_t)i;
                    count++;
                    if (name[0] == 'f') break;
                    i += x->len ? x->len : 1;
                } else {
                    i++;
                }
            }
            if (!strcmp(name, "count")) *out = jv_int(count);
            else { /* a byte offset is a code point offset only in ASCII; count code points before it */
                int64_t cps = 0;
                for (int64_t i = 0; found >= 0 && i < found; i += (int64_t)u8_len((unsigned char)s->s[i])) cps++;
                *out = jv_int(found < 0 ? -1 : cps);
            }
            return 0;
        }
        if (!strcmp(name, "join")) {
            jlist *items;
            if (!arg(A, 0, NULL, &a0)) return fail(E, n, "join needs an iterable");
            if (iterate(E, n, a0, &items)) return -1;
            jbuf b = {.a = E->a};
            for (size_t i = 0; i < items->n; i++) {
                if (items->v[i].kind != JV_STR)
                    return fail(E, n, "sequence item %zu: expected str instance, %s found", i, jv_type_name(items->v[i]));
                if (i) jbuf_put(&b, s->s, s->len);
                jbuf_put(&b, items->v[i].u.s->s, items->v[i].u.s->len);
            }
            if (b.failed) return oom(E, n);
            *out = str_of(E, b.p ? b.p : "", b.n);
            return 0;
        }
        if (!strncmp(name, "is", 2)) {
            int any = s->len > 0, ok = 1, cased = 0;
            for (size_t i = 0; i < s->len; i++) {
                char c = s->s[i];
                if (!strcmp(name, "isdigit")) ok &= c >= '0' && c <= '9';
                else if (!strcmp(name, "isalpha")) ok &= ascii_alpha(c);
                else if (!strcmp(name, "isalnum")) ok &= ascii_alpha(c) || (c >= '0' && c <= '9');
                else if (!strcmp(name, "isspace")) ok &= c == ' ' || (c >= 9 && c <= 13);
                else if (!strcmp(name, "isupper")) { ok &= !(c >= 'a' && c <= 'z'); cased |= c >= 'A' && c <= 'Z'; }
                else if (!strcmp(name, "islower")) { ok &= !(c >= 'A' && c <= 'Z'); cased |= c >= 'a' && c <= 'z'; }
            }
            if (!strcmp(name, "isupper") || !strcmp(name, "islower")) any = cased;
            *out = jv_bool(any && ok);
            return 0;
        }
        if (!strcmp(name, "format")) return fail(E, n, "str.format is not supported by tidal's Jinja interpreter");
    }
    if ((self.kind == JV_DICT && in_names(DICT_METHODS, name)) || (is_seq(self) && in_names(LIST_METHODS, name)))
        return fail(E, n, "'%s.%s' would change a value, which the sandbox chat templates run in does not allow",
                    jv_type_name(self), name);
    return fail(E, n, "the method '%s.%s' is not supported", jv_type_name(self), name);
}

static int call_function(ev *E, const jnode *n, int fn, const args *A, jv *out)
{
    jv a0;
    switch (fn) {
    case FN_RAISE: {
        const jstr *msg = arg(A, 0, NULL, &a0) ? to_str(E, a0) : NULL;
        E->raised = 1;
        return fail(E, n, "%s", msg ? msg->s : "raise_exception called");
    }
    case FN_STRFTIME: {
        const jstr *f = NULL;
        if (!arg(A, 0, "format", &a0) || want_str(E, n, a0, "strftime_now's format", &f))
            return E->failed ? -1 : fail(E, n, "strftime_now needs a format");
        time_t t = (time_t)E->now;
        struct tm tm;
        localtime_r(&t, &tm);
        char buf[512];
        size_t len = f->len ? strftime(buf, sizeof buf, f->s, &tm) : 0;
        if (f->len && !len) buf[0] = '\0';
        *out = str_of(E, buf, len);
        return 0;
    }
    case FN_NAMESPACE: case FN_DICT: {
        jdict *d = jdict_new(E->a, 0);
        if (!d) return oom(E, n);
        if (A->npos > 1) return fail(E, n, "%s takes at most one positional argument", FN_NAMES[fn]);
        if (A->npos == 1) {
            if (A->pos[0].kind != JV_DICT) return fail(E, n, "%s(x): x must be a mapping", FN_NAMES[fn]);
            for (size_t i = 0; i < A->pos[0].u.d->n; i++)
                if (jdict_set(E->a, d, A->pos[0].u.d->k[i], A->pos[0].u.d->v[i])) return oom(E, n);
        }
        for (int k = 0; k < A->nkw; k++)
            if (jdict_set(E->a, d, str_of(E, A->kwn[k], strlen(A->kwn[k])), A->kwv[k])) return oom(E, n);
        *out = dict_v(d, fn == FN_NAMESPACE);
        return 0;
    }
    case FN_RANGE: {
        int64_t start = 0, stop, step = 1;
        for (int k = 0; k < A->npos; k++)
            if (!is_intlike(A->pos[k])) return fail(E, n, "range() needs integers, not %s", jv_type_name(A->pos[k]));
        if (A->npos == 1) stop = as_int(A->pos[0]);
        else if (A->npos == 2 || A->npos == 3) {
            start = as_int(A->pos[0]);
            stop = as_int(A->pos[1]);
            if (A->npos == 3) step = as_int(A->pos[2]);
        } else {
            return fail(E, n, "range() takes 1 to 3 arguments");
        }
        if (step == 0) return fail(E, n, "range() arg 3 must not be zero");
        jlist *l = jlist_new(E->a, 0);
        if (!l) return oom(E, n);
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            if (l->n == MAX_RANGE) return fail(E, n, "range() of more than %d items", MAX_RANGE);
            if (jlist_push(E->a, l, jv_int(i))) return oom(E, n);
        }
        *out = list_v(l, 0);
        return 0;
    }
    default: return fail(E, n, "unknown function");
    }
}

/* ---- expressions ---------------------------------------------------------------- */

static int eval(ev *E, frame *F, const jnode *n, jv *out)
{
    if (E->failed) return -1;
    if (++E->depth > 4 * MAX_DEPTH) return fail(E, n, "expression nested too deep");
    int rc = 0;
    jv a, b;
    switch (n->kind) {
    case JN_LIT: *out = n->lit; break;
    case JN_NAME: *out = lookup(E, F, n->name); break;
    case JN_ATTR: rc = eval(E, F, n->a, &a) || get_attr(E, n, a, n->name, out); break;
    case JN_ITEM: rc = eval(E, F, n->a, &a) || eval(E, F, n->b, &b) || get_item(E, n, a, b, out); break;
    case JN_SLICE: {
        jv parts[3] = {jv_none(), jv_none(), jv_none()};
        rc = eval(E, F, n->a, &a);
        for (int k = 0; k < 3 && !rc; k++)
            if (n->list[k]) rc = eval(E, F, n->list[k], &parts[k]);
        if (!rc) rc = slice_of(E, n, a, parts, out);
        break;
    }
    case JN_NEG: case JN_POS:
        if ((rc = eval(E, F, n->a, &a))) break;
        if (!is_number(a)) {
            rc = a.kind == JV_UNDEF ? use_undef(E, n, a) : fail(E, n, "bad operand type for unary %c: '%s'",
                                                                 n->kind == JN_NEG ? '-' : '+', jv_type_name(a));
        } else if (n->kind == JN_POS) {
            *out = a.kind == JV_BOOL ? jv_int(a.u.b) : a;
        } else {
            *out = a.kind == JV_FLOAT ? jv_float(-a.u.f) : jv_int(-as_int(a));
        }
        break;
    case JN_NOT:
        if (!(rc = eval(E, F, n->a, &a))) *out = jv_bool(!jv_truthy(a)); /* a is unset when eval failed */
        break;
    case JN_AND: case JN_OR:
        if ((rc = eval(E, F, n->a, &a))) break;
        if (jv_truthy(a) == (n->kind == JN_OR)) *out = a;
        else rc = eval(E, F, n->b, out);
        break;
    case JN_COND:
        if ((rc = eval(E, F, n->a, &a))) break;
        if (jv_truthy(a)) rc = eval(E, F, n->b, out);
        else if (n->c) rc = eval(E, F, n->c, out);
        else *out = undef_msg(E, "the inline if-expression on line %d evaluated to false and no else section was defined",
                              n->line);
        break;
    case JN_BIN: rc = eval(E, F, n->a, &a) || eval(E, F, n->b, &b) || arith(E, n, n->name, a, b, out); break;
    case JN_CONCAT: {
        jbuf buf = {.a = E->a};
        for (int k = 0; k < n->n && !rc; k++)
            if (!(rc = eval(E, F, n->list[k], &a))) jv_str_to(&buf, a);
        if (!rc) *out = buf.failed ? (rc = oom(E, n), jv_none()) : str_of(E, buf.p ? buf.p : "", buf.n);
        break;
    }
    case JN_COMPARE: {
        if ((rc = eval(E, F, n->a, &a))) break;
        int r = 1;
        for (int k = 0; k < n->n && r && !rc; k++) {
            if ((rc = eval(E, F, n->list[k]->a, &b))) break;
            rc = compare(E, n->list[k], n->list[k]->name, a, b, &r);
            a = b;
        }
        *out = jv_bool(r);
        break;
    }
    case JN_LIST: case JN_TUPLE: {
        jlist *l = jlist_new(E->a, (size_t)n->n);
        if (!l) { rc = oom(E, n); break; }
        for (int k = 0; k < n->n && !rc; k++) rc = eval(E, F, n->list[k], &l->v[k]);
        l->n = (size_t)n->n;
        *out = list_v(l, n->kind == JN_TUPLE);
        break;
    }
    case JN_DICT: {
        jdict *d = jdict_new(E->a, (size_t)n->n);
        if (!d) { rc = oom(E, n); break; }
        for (int k = 0; k < n->n && !rc; k++) {
            rc = eval(E, F, n->list[k], &a) || eval(E, F, n->list[n->n + k], &b);
            if (!rc && jdict_set(E->a, d, a, b)) rc = oom(E, n);
        }
        *out = dict_v(d, 0);
        break;
    }
    case JN_FILTER: {
        args A;
        rc = eval(E, F, n->a, &a) || eval_args(E, F, n, &A) || run_filter(E, n, n->name, a, &A, out);
        break;
    }
    case JN_TEST: {
        args A;
        int r = 0;
        rc = eval(E, F, n->a, &a) || eval_args(E, F, n, &A) || run_test(E, n, n->name, a, A.pos, A.npos, &r);
        *out = jv_bool(n->negate ? !r : r);
        break;
    }
    case JN_CALL: {
        args A;
        if ((rc = eval(E, F, n->a, &a) || eval_args(E, F, n, &A))) break;
        if (a.kind == JV_FUNC) rc = call_function(E, n, a.u.fn, &A, out);
        else if (a.kind == JV_METHOD) rc = call_method(E, n, a.u.m, &A, out);
        else if (a.kind == JV_UNDEF) rc = use_undef(E, n, a);
        else rc = fail(E, n, "'%s' object is not callable", jv_type_name(a));
        break;
    }
    default: rc = fail(E, n, "not an expression");
    }
    E->depth--;
    return rc || E->failed ? -1 : 0;
}

/* ---- statements ---------------------------------------------------------------- */

static int exec(ev *E, frame *F, const jnode *n, jbuf *out);

/* Binds for/set targets (names in t->list) to v, unpacking when several. */
static int bind(ev *E, frame *F, const jnode *t, jv v)
{
    if (t->n == 1) return frame_set(E, F, t->list[0]->name, v) ? oom(E, t) : 0;
    if (!is_seq(v)) {
        jlist *items;
        if (iterate(E, t, v, &items)) return -1;
        v = list_v(items, 0);
    }
    if ((int)v.u.l->n != t->n)
        return fail(E, t, "%s values to unpack (expected %d, got %zu)", (int)v.u.l->n > t->n ? "too many" : "not enough",
                    t->n, v.u.l->n);
    for (int k = 0; k < t->n; k++)
        if (frame_set(E, F, t->list[k]->name, v.u.l->v[k])) return oom(E, t);
    return 0;
}

static int exec_for(ev *E, frame *F, const jnode *n, jbuf *out)
{
    jv seq;
    jlist *items;
    if (eval(E, F, n->a, &seq) || iterate(E, n->a, seq, &items)) return -1;
    if (n->b) { /* the loop's filter, with the targets bound and no `loop` */
        jlist *kept = jlist_new(E->a, 0);
        if (!kept) return oom(E, n);
        for (size_t i = 0; i < items->n; i++) {
            frame tmp = {.parent = F};
            jv t;
            if (bind(E, &tmp, n, items->v[i]) || eval(E, &tmp, n->b, &t)) return -1;
            if (jv_truthy(t) && jlist_push(E->a, kept, items->v[i])) return oom(E, n);
        }
        items = kept;
    }
    if (++E->depth > MAX_DEPTH) return fail(E, n, "loops nested more than %d deep", MAX_DEPTH);
    jloop *L = jarena_alloc(E->a, sizeof *L);
    if (!L) return oom(E, n);
    L->length = (int64_t)items->n;
    L->items = items;
    for (size_t i = 0; i < items->n; i++) {
        frame it = {.parent = F}; /* every iteration starts from the enclosing scope */
        L->index0 = (int64_t)i;
        jv lv = {.kind = JV_LOOP};
        lv.u.loop = L;
        if (bind(E, &it, n, items->v[i]) || frame_set(E, &it, "loop", lv)) return E->failed ? -1 : oom(E, n);
        if (exec(E, &it, n->body, out)) return -1;
        if (E->ctl == 1) { E->ctl = 0; break; }
        E->ctl = 0;
    }
    E->depth--;
    if (!items->n && n->c) return exec(E, F, n->c, out);
    return 0;
}

static int exec(ev *E, frame *F, const jnode *n, jbuf *out)
{
    if (E->failed) return -1;
    switch (n->kind) {
    case JN_BODY:
        for (int k = 0; k < n->n && !E->ctl; k++)
            if (exec(E, F, n->list[k], out)) return -1;
        break;
    case JN_DATA: jbuf_put(out, n->lit.u.s->s, n->lit.u.s->len); break;
    case JN_PRINT: {
        jv v;
        if (eval(E, F, n->a, &v)) return -1;
        jv_str_to(out, v);
        break;
    }
    case JN_IF: {
        jv t;
        if (eval(E, F, n->a, &t)) return -1;
        if (jv_truthy(t)) return exec(E, F, n->b, out);
        if (n->c) return exec(E, F, n->c, out);
        break;
    }
    case JN_FOR: return exec_for(E, F, n, out);
    case JN_SET: {
        jv v;
        if (eval(E, F, n->a, &v)) return -1;
        const jnode *t = n->list[0];
        if (t->b) { /* ns.attr = v */
            jv ns = lookup(E, F, t->name);
            if (ns.kind != JV_NS) return fail(E, t, "cannot assign attribute on non-namespace object ('%s' is %s)", t->name,
                                              ns.kind == JV_UNDEF ? "undefined" : jv_type_name(ns));
            return jdict_set(E->a, ns.u.d, str_of(E, t->b->name, strlen(t->b->name)), v) ? oom(E, t) : 0;
        }
        return bind(E, F, n, v);
    }
    case JN_SET_BLOCK: {
        jbuf b = {.a = E->a};
        if (exec(E, F, n->body, &b)) return -1;
        if (b.failed) return oom(E, n);
        return frame_set(E, F, n->list[0]->name, str_of(E, b.p ? b.p : "", b.n)) ? oom(E, n) : 0;
    }
    case JN_BREAK: E->ctl = 1; break;
    case JN_CONTINUE: E->ctl = 2; break;
    default: return fail(E, n, "not a statement");
    }
    if (out->failed) return fail(E, n, "the output is larger than the interpreter's memory limit");
    if (out->n > MAX_OUTPUT) return fail(E, n, "the output is larger than %zu MiB", MAX_OUTPUT >> 20);
    return 0;
}

int jinja_render(const jtemplate *t, jarena *a, const jdict *ctx, int64_t now, jbuf *out, char *err,
                 size_t err_bytes, int *raised)
{
    ev E = {.a = a, .globals = ctx, .now = now, .err = err, .err_bytes = err_bytes};
    frame root = {0};
    out->a = a;
    int rc = exec(&E, &root, t->root, out);
    if (raised) *raised = E.raised;
    if (!rc && out->failed) rc = fail(&E, NULL, "out of memory");
    return rc;
}
