/* Internal to the Jinja interpreter (jinja_value.c, jinja_parse.c,
 * jinja_eval.c; the public face is include/tidal/chat.h): values, the
 * arena they live in, the syntax tree and the evaluator's entry points.
 *
 * Values follow Python's, as Jinja2 runs on Python: None, bool, int (int64
 * here), float (double), str (UTF-8 bytes), list, tuple, dict (insertion
 * ordered), plus Jinja's Undefined, a namespace() object, the loop object,
 * built-in functions and bound methods.  A value is a small struct passed by
 * value; what it points to lives in an arena that is freed at once (one per
 * parsed template, one per render). */
#ifndef TIDAL_DATA_JINJA_INTERNAL_H
#define TIDAL_DATA_JINJA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

/* ---- the arena ----------------------------------------------------------- */

typedef struct jarena_block jarena_block;
typedef struct jarena {
    jarena_block *head;
    size_t used_bytes;  /* every block's bytes */
    size_t limit_bytes; /* 0: none; beyond it allocations fail */
} jarena;

void *jarena_alloc(jarena *a, size_t bytes); /* 16-byte aligned, zeroed; NULL when out of memory or over the limit */
void jarena_free(jarena *a);

/* ---- values -------------------------------------------------------------- */

typedef enum jkind {
    JV_UNDEF, JV_NONE, JV_BOOL, JV_INT, JV_FLOAT, JV_STR, JV_LIST, JV_TUPLE, JV_DICT,
    JV_NS,     /* namespace(): a dict whose items are attributes, the one thing a template may change */
    JV_LOOP,   /* a for loop's `loop` */
    JV_FUNC,   /* a global function (raise_exception, strftime_now, namespace, range) */
    JV_METHOD, /* a method bound to its object ('x'.upper, d.items, loop.cycle) */
} jkind;

typedef struct jstr { size_t len; char s[]; } jstr;   /* NUL-terminated after len */
typedef struct jv jv;
typedef struct jlist { size_t n, cap; jv *v; } jlist;
typedef struct jdict { size_t n, cap; jv *k, *v; } jdict;
typedef struct jloop jloop;
typedef struct jmethod jmethod;

struct jv {
    uint8_t kind;
    union {
        int b;
        int64_t i;
        double f;
        const jstr *s;   /* JV_STR; JV_UNDEF: the name that was undefined, or NULL */
        jlist *l;        /* JV_LIST, JV_TUPLE */
        jdict *d;        /* JV_DICT, JV_NS */
        jloop *loop;
        int fn;          /* JV_FUNC: which (jinja_eval.c) */
        jmethod *m;
    } u;
};

struct jloop { int64_t index0, length; const jlist *items; };
struct jmethod { jv self; const char *name; };

jv jv_undef(const jstr *name);
jv jv_none(void);
jv jv_bool(int b);
jv jv_int(int64_t i);
jv jv_float(double f);
jv jv_strv(const jstr *s);
/* A new string of these bytes (copied); kind JV_UNDEF (name NULL) when out of memory. */
const jstr *jstr_new(jarena *a, const char *s, size_t len);
const jstr *jstr_cat(jarena *a, const jstr *x, const jstr *y);
jlist *jlist_new(jarena *a, size_t cap);
int jlist_push(jarena *a, jlist *l, jv v);            /* 0, or -1 out of memory */
jdict *jdict_new(jarena *a, size_t cap);
int jdict_set(jarena *a, jdict *d, jv k, jv v);       /* replaces the value of an equal key, keeping its place */
const jv *jdict_get(const jdict *d, jv k);            /* NULL: no such key */
const jv *jdict_get_str(const jdict *d, const char *key);

int jv_truthy(jv v);
/* Python's ==, and <, <=, ... (*ok 0 when the two cannot be ordered). */
int jv_eq(jv a, jv b);
int jv_cmp(jv a, jv b, int *ok);
const char *jv_type_name(jv v); /* as Python names it: 'str', 'int', 'dict', 'NoneType', 'Undefined' ... */
int jv_is_text(jv v);           /* str */

/* A growing byte buffer in an arena. */
typedef struct jbuf { jarena *a; char *p; size_t n, cap; int failed; } jbuf;
void jbuf_put(jbuf *b, const char *s, size_t len);
void jbuf_puts(jbuf *b, const char *s);
void jbuf_putc(jbuf *b, char c);

/* Python str() and repr() of a value appended to b. */
void jv_str_to(jbuf *b, jv v);
void jv_repr_to(jbuf *b, jv v);
/* Python's repr of a float (the shortest text that reads back as it). */
void jv_float_repr(double f, char out[32]);
/* json.dumps(v, ensure_ascii, indent, separators, sort_keys) as transformers'
 * tojson filter calls it: indent < 0 none, else that many spaces (indent_str
 * wins when not NULL); item_sep / key_sep NULL: Python's defaults.  Returns
 * 0, or -1 with a message in err (a value JSON cannot hold). */
int jv_tojson(jbuf *b, jv v, int ensure_ascii, int indent, const char *indent_str, const char *item_sep,
              const char *key_sep, int sort_keys, char *err, size_t err_bytes);

/* Parses one JSON document (text[0, len)) into values, as Python's json.loads
 * reads it: integers stay integers (int64; larger ones are an error),
 * NaN / Infinity / -Infinity accepted, a repeated key keeps its first place
 * and its last value.  0, or -1 with a message naming the byte offset in err. */
int jv_from_json(jarena *a, const char *text, size_t len, jv *out, char *err, size_t err_bytes);

/* UTF-8 helpers: Python's str.isspace() on the code point at s (its length
 * in *n), and the same looking backwards from the end. */
int ju_space_at(const char *s, size_t len, size_t *n);
int ju_space_before(const char *s, size_t end, size_t *n);

/* ---- the syntax tree ----------------------------------------------------- */

typedef enum jnode_kind {
    /* expressions */
    JN_LIT, JN_NAME, JN_ATTR, JN_ITEM, JN_SLICE, JN_CALL, JN_FILTER, JN_TEST, JN_NEG, JN_POS, JN_NOT,
    JN_BIN, JN_AND, JN_OR, JN_COMPARE, JN_COND, JN_LIST, JN_TUPLE, JN_DICT, JN_CONCAT,
    /* statements */
    JN_DATA, JN_PRINT, JN_IF, JN_FOR, JN_SET, JN_SET_BLOCK, JN_BREAK, JN_CONTINUE, JN_BODY,
} jnode_kind;

typedef struct jnode jnode;
struct jnode {
    uint8_t kind;
    int line, col;
    const char *name;     /* NAME, ATTR, FILTER, TEST, SET target, FOR targets' first; op text for BIN / COMPARE */
    jv lit;               /* LIT */
    jnode *a, *b, *c;     /* operands; IF: test, then, else; FOR: iter, filter, else; SLICE: obj in a, parts in list */
    jnode **list;         /* CALL/FILTER/TEST args; LIST/TUPLE items; DICT keys then values; BODY statements;
                             COMPARE operands; FOR / SET target names (as JN_NAME nodes) */
    const char **kwnames; /* CALL/FILTER/TEST: keyword names of the last nkw args */
    int n, nkw;
    int negate;           /* TEST: `is not` */
    jnode *body;          /* FOR, SET_BLOCK, IF's then (also b) */
};

typedef struct jtemplate {
    jarena arena;
    jnode *root;          /* JN_BODY */
    char *name;           /* for messages */
} jtemplate;

/* Parses src (any bytes; \r\n and \r read as \n, one final newline
 * dropped, trim_blocks and lstrip_blocks on, as transformers renders chat
 * templates).  0, or -1 with "line L, column C: what" in err. */
int jinja_parse(jtemplate *t, const char *src, size_t len, char *err, size_t err_bytes);

/* Renders t with the globals in ctx (a dict) into out (arena a).  now: the
 * clock strftime_now reads (seconds since the epoch, local time).  0, or -1
 * with the message in err (raise_exception's own message when *raised). */
int jinja_render(const jtemplate *t, jarena *a, const jdict *ctx, int64_t now, jbuf *out, char *err,
                 size_t err_bytes, int *raised);

#endif
