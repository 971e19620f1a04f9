/* The Jinja lexer and parser (jinja_internal.h): template text to a syntax
 * tree, with Jinja2's whitespace rules as transformers sets them.
 *
 * Lexing follows jinja2's lexer (3.1): the text between tags is data; a tag
 * that opens with '-' ({%-, {{-, {#-) strips all whitespace before it, one
 * that ends with '-' (-%}, -}}, -#}) all whitespace after it; trim_blocks
 * drops the first newline after a block or comment tag (%}, #}), unless it
 * ends with '+%}'; lstrip_blocks drops the spaces and tabs between the start
 * of a line and a block or comment tag (not a {{ }}), unless it opens with
 * '+'.  A tag ends only where brackets inside it balance, and strings are
 * whole tokens, so '}}' inside a string or a dict does not end it.  As
 * jinja2 does with keep_trailing_newline off, the template's line endings
 * are read as \n and one final newline is dropped.
 *
 * Parsing follows jinja2's grammar and precedence (parser.py): conditional
 * expression, or, and, not, comparisons (chained), + -, ~, * / // %, **,
 * unary - +, then primaries with attribute, item, slice and call postfixes,
 * then | filters and `is` tests.  Filter and test names are checked here,
 * so a template using one tidal does not implement fails when it is loaded,
 * with the line and column of the name. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_internal.h"

int jinja_filter_known(const char *name); /* jinja_eval.c */
int jinja_test_known(const char *name);

typedef enum ttype {
    T_DATA, T_VAR_BEGIN, T_VAR_END, T_BLOCK_BEGIN, T_BLOCK_END, T_NAME, T_STRING, T_INT, T_FLOAT, T_OP, T_EOF
} ttype;

typedef struct token {
    ttype type;
    int line, col;
    const char *text; /* NAME and OP: into the source */
    size_t len;
    jv value;         /* DATA, STRING, INT, FLOAT */
} token;

typedef struct lexer {
    jarena *a;
    const char *s;
    size_t n;
    token *tok;
    size_t ntok, cap;
    char *err;
    size_t err_bytes;
    int failed;
} lexer;

static void pos_of(const char *s, size_t at, int *line, int *col)
{
    int l = 1, c = 1;
    for (size_t i = 0; i < at; i++) {
        if (s[i] == '\n') {
            l++;
            c = 1;
        } else {
            c++;
        }
    }
    *line = l;
    *col = c;
}

static int lex_fail(lexer *L, size_t at, const char *fmt, ...)
{
    if (L->failed) return -1;
    int line, col;
    pos_of(L->s, at, &line, &col);
    int k = snprintf(L->err, L->err_bytes, "line %d, column %d: ", line, col);
    va_list ap;
    va_start(ap, fmt);
    if (k >= 0 && (size_t)k < L->err_bytes) vsnprintf(L->err + k, L->err_bytes - (size_t)k, fmt, ap);
    va_end(ap);
    L->failed = 1;
    return -1;
}

static token *emit(lexer *L, ttype type, size_t at)
{
    if (L->ntok == L->cap) {
        size_t cap = L->cap ? 2 * L->cap : 256;
        token *t = jarena_alloc(L->a, cap * sizeof *t);
        if (!t) {
            lex_fail(L, at, "out of memory");
            return NULL;
        }
        if (L->ntok) memcpy(t, L->tok, L->ntok * sizeof *t);
        L->tok = t;
        L->cap = cap;
    }
    token *t = &L->tok[L->ntok++];
    memset(t, 0, sizeof *t);
    t->type = type;
    pos_of(L->s, at, &t->line, &t->col); /* quadratic in the worst case; templates are small */
    t->text = L->s + at;
    return t;
}

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
static int is_name0(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* Python's str.rstrip(): the whitespace at the end of s[0, len). */
static size_t rstrip_len(const char *s, size_t len)
{
    size_t n;
    while (len && ju_space_before(s, len, &n)) len -= n;
    return len;
}

/* Python's \s+ on the whole of s[0, len) (non-empty). */
static int all_space(const char *s, size_t len)
{
    size_t n;
    if (!len) return 0;
    for (size_t i = 0; i < len; i += n)
        if (!ju_space_at(s + i, len - i, &n)) return 0;
    return 1;
}

static int emit_data(lexer *L, size_t at, const char *s, size_t len)
{
    if (!len) return 0;
    token *t = emit(L, T_DATA, at);
    if (!t) return -1;
    const jstr *d = jstr_new(L->a, s, len);
    if (!d) return lex_fail(L, at, "out of memory");
    t->value = jv_strv(d);
    return 0;
}

/* The data before a tag, after the tag's whitespace control. */
static int emit_text(lexer *L, size_t pos, size_t tag, char sign, int is_var, int line_starting)
{
    const char *text = L->s + pos;
    size_t len = tag - pos;
    if (sign == '-') {
        len = rstrip_len(text, len);
    } else if (sign != '+' && !is_var) { /* lstrip_blocks */
        size_t l_pos = 0;
        for (size_t i = len; i > 0; i--)
            if (text[i - 1] == '\n') {
                l_pos = i;
                break;
            }
        if ((l_pos > 0 || line_starting) && all_space(text + l_pos, len - l_pos)) len = l_pos;
    }
    return emit_data(L, pos, text, len);
}

/* Python string-literal escapes, as jinja2 decodes them ("unicode-escape"). */
static int unescape(lexer *L, size_t at, const char *s, size_t len, const jstr **out)
{
    jbuf b = {.a = L->a};
    for (size_t i = 0; i < len; i++) {
        if (s[i] != '\\' || i + 1 == len) {
            jbuf_putc(&b, s[i]);
            continue;
        }
        char e = s[++i];
        unsigned long cp = 0;
        int hex = 0;
        switch (e) {
        case '\n': break; /* a backslash-newline continues the line */
        case '\\': jbuf_putc(&b, '\\'); break;
        case '\'': jbuf_putc(&b, '\''); break;
        case '"': jbuf_putc(&b, '"'); break;
        case 'a': jbuf_putc(&b, '\a'); break;
        case 'b': jbuf_putc(&b, '\b'); break;
        case 'f': jbuf_putc(&b, '\f'); break;
        case 'n': jbuf_putc(&b, '\n'); break;
        case 'r': jbuf_putc(&b, '\r'); break;
        case 't': jbuf_putc(&b, '\t'); break;
        case 'v': jbuf_putc(&b, '\v'); break;
        case 'x': hex = 2; break;
        case 'u': hex = 4; break;
        case 'U': hex = 8; break;
        case 'N': return lex_fail(L, at, "the \\N{...} escape in a string is not supported");
        default:
            if (e >= '0' && e <= '7') { /* up to three octal digits */
                int k = 0;
                while (k < 3 && i < len && s[i] >= '0' && s[i] <= '7') cp = cp * 8 + (unsigned long)(s[i++] - '0'), k++;
                i--;
                hex = -1;
            } else { /* unknown escapes stay as written */
                jbuf_putc(&b, '\\');
                jbuf_putc(&b, e);
            }
        }
        if (hex > 0) {
            if (i + (size_t)hex >= len) return lex_fail(L, at, "truncated \\%c escape in a string", e);
            for (int k = 0; k < hex; k++) {
                char c = s[i + 1 + (size_t)k];
                int v = is_digit(c) ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : -1;
                if (v < 0) return lex_fail(L, at, "bad \\%c escape in a string", e);
                cp = cp * 16 + (unsigned long)v;
            }
            i += (size_t)hex;
        }
        if (hex) {
            if (cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000))
                return lex_fail(L, at, "the escape \\%c%lx is not a character UTF-8 can hold", e, cp);
            char u[4];
            size_t n;
            if (cp < 0x80) u[0] = (char)cp, n = 1;
            else if (cp < 0x800) u[0] = (char)(0xC0 | cp >> 6), u[1] = (char)(0x80 | (cp & 0x3F)), n = 2;
            else if (cp < 0x10000)
                u[0] = (char)(0xE0 | cp >> 12), u[1] = (char)(0x80 | ((cp >> 6) & 0x3F)), u[2] = (char)(0x80 | (cp & 0x3F)), n = 3;
            else
                u[0] = (char)(0xF0 | cp >> 18), u[1] = (char)(0x80 | ((cp >> 12) & 0x3F)),
                u[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), u[3] = (char)(0x80 | (cp & 0x3F)), n = 4;
            jbuf_put(&b, u, n);
        }
    }
    if (b.failed) return lex_fail(L, at, "out of memory");
    *out = jstr_new(L->a, b.p ? b.p : "", b.n);
    return *out ? 0 : lex_fail(L, at, "out of memory");
}

static const char *const OPS[] = {"**", "//", "==", "!=", ">=", "<=", "+", "-", "*", "/", "%", "~", "(", ")",
                                  "[", "]", "{", "}", ",", ".", ":", "|", "=", "<", ">", ";"};

/* One token inside a tag at p; returns the position after it (0 on error). */
static size_t lex_token(lexer *L, size_t p, char *stack, int *depth)
{
    const char *s = L->s;
    const size_t n = L->n;
    char c = s[p];
    if (is_name0(c)) {
        size_t q = p + 1;
        while (q < n && (is_name0(s[q]) || is_digit(s[q]))) q++;
        token *t = emit(L, T_NAME, p);
        if (!t) return 0;
        t->len = q - p;
        return q;
    }
    if (is_digit(c)) { /* jinja2: integers and floats, with '_' between digits */
        size_t q = p;
        int is_float = 0;
        while (q < n && (is_digit(s[q]) || (s[q] == '_' && q + 1 < n && is_digit(s[q + 1])))) q++;
        if (q + 1 < n && s[q] == '.' && is_digit(s[q + 1])) {
            is_float = 1;
            q++;
            while (q < n && (is_digit(s[q]) || (s[q] == '_' && q + 1 < n && is_digit(s[q + 1])))) q++;
        }
        if (q < n && (s[q] == 'e' || s[q] == 'E')) {
            size_t e = q + 1;
            if (e < n && (s[e] == '+' || s[e] == '-')) e++;
            if (e < n && is_digit(s[e])) {
                is_float = 1;
                q = e;
                while (q < n && is_digit(s[q])) q++;
            }
        }
        char buf[64];
        size_t k = 0;
        for (size_t i = p; i < q && k + 1 < sizeof buf; i++)
            if (s[i] != '_') buf[k++] = s[i];
        buf[k] = '\0';
        token *t = emit(L, is_float ? T_FLOAT : T_INT, p);
        if (!t) return 0;
        t->len = q - p;
        errno = 0;
        if (is_float) {
            t->value = jv_float(strtod(buf, NULL));
        } else {
            long long v = strtoll(buf, NULL, 10);
            if (errno == ERANGE || q - p >= sizeof buf) return lex_fail(L, p, "integer literal outside the 64-bit range"), 0;
            t->value = jv_int(v);
        }
        return q;
    }
    if (c == '\'' || c == '"') {
        size_t q = p + 1;
        while (q < n && s[q] != c) q += s[q] == '\\' && q + 1 < n ? 2 : 1;
        if (q >= n) return lex_fail(L, p, "unterminated string"), 0;
        token *t = emit(L, T_STRING, p);
        if (!t) return 0;
        const jstr *v;
        if (unescape(L, p, s + p + 1, q - p - 1, &v)) return 0;
        t->value = jv_strv(v);
        t->len = q + 1 - p;
        return q + 1;
    }
    for (size_t k = 0; k < sizeof OPS / sizeof OPS[0]; k++) {
        size_t len = strlen(OPS[k]);
        if (p + len <= n && !memcmp(s + p, OPS[k], len)) {
            if (len == 1 && (c == '(' || c == '[' || c == '{')) {
                if (*depth >= 64) return lex_fail(L, p, "brackets nested more than 64 deep"), 0;
                stack[(*depth)++] = c == '(' ? ')' : c == '[' ? ']' : '}';
            } else if (len == 1 && (c == ')' || c == ']' || c == '}')) {
                if (!*depth) return lex_fail(L, p, "unexpected '%c'", c), 0;
                if (stack[*depth - 1] != c) return lex_fail(L, p, "unexpected '%c', expected '%c'", c, stack[*depth - 1]), 0;
                (*depth)--;
            }
            token *t = emit(L, T_OP, p);
            if (!t) return 0;
            t->len = len;
            return p + len;
        }
    }
    if ((unsigned char)c >= 0x80) return lex_fail(L, p, "unexpected non-ASCII character in a tag"), 0;
    return lex_fail(L, p, "unexpected character '%c'", c), 0;
}

/* The tokens of a {{ }} or {% %} opened at `open` (p after its sign); returns
 * the position after its end, *nl: whether that end consumed a newline last. */
static size_t lex_tag(lexer *L, size_t open, size_t p, int is_var, int *line_starting)
{
    const char *s = L->s;
    const size_t n = L->n;
    char stack[64];
    int depth = 0;
    for (;;) {
        while (p < n && is_ws(s[p])) p++;
        if (p >= n) return lex_fail(L, open, "'%s' is never closed", is_var ? "{{" : "{%"), 0;
        if (!depth) {
            size_t end = 0;
            int strip = 0, trim = 0;
            if (is_var) {
                if (p + 3 <= n && !memcmp(s + p, "-}}", 3)) end = p + 3, strip = 1;
                else if (p + 2 <= n && !memcmp(s + p, "}}", 2)) end = p + 2;
            } else {
                if (p + 3 <= n && !memcmp(s + p, "-%}", 3)) end = p + 3, strip = 1;
                else if (p + 3 <= n && !memcmp(s + p, "+%}", 3)) end = p + 3;
                else if (p + 2 <= n && !memcmp(s + p, "%}", 2)) end = p + 2, trim = 1;
            }
            if (end) {
                if (!emit(L, is_var ? T_VAR_END : T_BLOCK_END, p)) return 0;
                if (strip)
                    while (end < n && is_ws(s[end])) end++;
                else if (trim && end < n && s[end] == '\n')
                    end++;
                *line_starting = s[end - 1] == '\n';
                return end;
            }
        }
        p = lex_token(L, p, stack, &depth);
        if (!p) return 0;
    }
}

/* {% raw %} ... {% endraw %} starting at `tag` ({% then optional sign): 1 if
 * it is one (handled, *pos moved), 0 if not, -1 on error. */
static int lex_raw(lexer *L, size_t tag, size_t *pos, int *line_starting)
{
    const char *s = L->s;
    const size_t n = L->n;
    size_t p = tag + 2;
    if (p < n && (s[p] == '-' || s[p] == '+')) p++;
    while (p < n && is_ws(s[p])) p++;
    if (p + 3 > n || memcmp(s + p, "raw", 3) || (p + 3 < n && (is_name0(s[p + 3]) || is_digit(s[p + 3])))) return 0;
    p += 3;
    while (p < n && is_ws(s[p])) p++;
    if (p + 3 <= n && !memcmp(s + p, "-%}", 3)) {
        p += 3;
        while (p < n && is_ws(s[p])) p++;
    } else if (p + 2 <= n && !memcmp(s + p, "%}", 2)) {
        p += 2;
    } else {
        return lex_fail(L, tag, "'{%% raw' must be followed by '%%}'");
    }
    for (size_t q = p; q + 1 < n; q++) { /* the first {% endraw %} */
        if (s[q] != '{' || s[q + 1] != '%') continue;
        size_t r = q + 2;
        char sign = 0;
        if (r < n && (s[r] == '-' || s[r] == '+')) sign = s[r++];
        while (r < n && is_ws(s[r])) r++;
        if (r + 6 > n || memcmp(s + r, "endraw", 6)) continue;
        r += 6;
        while (r < n && is_ws(s[r])) r++;
        size_t end = 0;
        if (r + 3 <= n && !memcmp(s + r, "-%}", 3)) {
            end = r + 3;
            while (end < n && is_ws(s[end])) end++;
        } else if (r + 2 <= n && !memcmp(s + r, "%}", 2)) {
            end = r + 2;
            if (end < n && s[end] == '\n') end++;
        } else {
            continue;
        }
        size_t len = q - p;
        if (sign == '-') len = rstrip_len(s + p, len);
        if (emit_data(L, p, s + p, len)) return -1;
        *line_starting = s[end - 1] == '\n';
        *pos = end;
        return 1;
    }
    return lex_fail(L, tag, "'{%% raw %%}' is never closed by '{%% endraw %%}'");
}

static int lex(lexer *L)
{
    const char *s = L->s;
    const size_t n = L->n;
    size_t pos = 0;
    int line_starting = 1;
    while (pos < n && !L->failed) {
        size_t tag = pos;
        while (tag + 1 < n && !(s[tag] == '{' && (s[tag + 1] == '{' || s[tag + 1] == '%' || s[tag + 1] == '#'))) tag++;
        if (tag + 1 >= n) {
            if (emit_data(L, pos, s + pos, n - pos)) return -1;
            break;
        }
        const char kind = s[tag + 1];
        const char sign = tag + 2 < n && (s[tag + 2] == '-' || s[tag + 2] == '+') ? s[tag + 2] : 0;
        if (emit_text(L, pos, tag, sign, kind == '{', line_starting)) return -1;
        if (kind == '#') {
            size_t q = tag + 2;
            while (q + 1 < n && !(s[q] == '#' && s[q + 1] == '}')) q++;
            if (q + 1 >= n) return lex_fail(L, tag, "comment '{#' is never closed by '#}'");
            size_t end = q + 2;
            if (q > tag + 2 && s[q - 1] == '-')
                while (end < n && is_ws(s[end])) end++;
            else if (end < n && s[end] == '\n')
                end++;
            line_starting = s[end - 1] == '\n';
            pos = end;
            continue;
        }
        if (kind == '%') {
            int raw = lex_raw(L, tag, &pos, &line_starting);
            if (raw < 0) return -1;
            if (raw) continue;
        }
        if (!emit(L, kind == '{' ? T_VAR_BEGIN : T_BLOCK_BEGIN, tag)) return -1;
        pos = lex_tag(L, tag, tag + 2 + (sign != 0), kind == '{', &line_starting);
        if (!pos) return -1;
    }
    if (L->failed) return -1;
    return emit(L, T_EOF, n) ? 0 : -1;
}

/* ---- the parser ----------------------------------------------------------- */

typedef struct parser {
    jarena *a;
    token *t;
    size_t i;
    int loops;   /* for loops open (break / continue need one) */
    int depth;   /* expression nesting, bounded */
    char *err;
    size_t err_bytes;
    int failed;
} parser;

static token *cur(parser *P) { return &P->t[P->i]; }
/* The token k after the current one (the end, at most). */
static token *peek(parser *P, size_t k)
{
    size_t i = P->i;
    while (k-- && P->t[i].type != T_EOF) i++;
    return &P->t[i];
}

static void *fail_at(parser *P, const token *t, const char *fmt, ...)
{
    if (P->failed) return NULL;
    int k = snprintf(P->err, P->err_bytes, "line %d, column %d: ", t->line, t->col);
    va_list ap;
    va_start(ap, fmt);
    if (k >= 0 && (size_t)k < P->err_bytes) vsnprintf(P->err + k, P->err_bytes - (size_t)k, fmt, ap);
    va_end(ap);
    P->failed = 1;
    return NULL;
}

static int is_op(const token *t, const char *op) { return t->type == T_OP && t->len == strlen(op) && !memcmp(t->text, op, t->len); }
static int is_name(const token *t, const char *name)
{
    return t->type == T_NAME && t->len == strlen(name) && !memcmp(t->text, name, t->len);
}

/* What a token reads as in a message. */
static const char *describe(parser *P, const token *t)
{
    switch (t->type) {
    case T_EOF: return "the end of the template";
    case T_VAR_END: return "'}}'";
    case T_BLOCK_END: return "'%}'";
    case T_DATA: return "text";
    case T_STRING: return "a string";
    case T_INT: case T_FLOAT: return "a number";
    default: {
        char *b = jarena_alloc(P->a, t->len + 3);
        if (!b) return "a token";
        b[0] = '\'';
        memcpy(b + 1, t->text, t->len);
        b[t->len + 1] = '\'';
        return b;
    }
    }
}

static const char *name_of(parser *P, const token *t)
{
    const jstr *s = jstr_new(P->a, t->text, t->len);
    return s ? s->s : "";
}

static jnode *node(parser *P, jnode_kind kind, const token *at)
{
    jnode *n = jarena_alloc(P->a, sizeof *n);
    if (!n) return fail_at(P, at, "out of memory");
    n->kind = (uint8_t)kind;
    n->line = at->line;
    n->col = at->col;
    return n;
}

/* A growing list of nodes. */
typedef struct nlist { jnode **v; int n, cap; } nlist;
static int nl_push(parser *P, nlist *l, jnode *x)
{
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 8;
        jnode **v = jarena_alloc(P->a, (size_t)cap * sizeof *v);
        if (!v) return fail_at(P, cur(P), "out of memory") ? 0 : -1;
        if (l->n) memcpy(v, l->v, (size_t)l->n * sizeof *v);
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = x;
    return 0;
}

static int expect_op(parser *P, const char *op)
{
    if (is_op(cur(P), op)) {
        P->i++;
        return 0;
    }
    fail_at(P, cur(P), "expected '%s', found %s", op, describe(P, cur(P)));
    return -1;
}

static jnode *parse_expression(parser *P, int with_condexpr);
static jnode *parse_tuple(parser *P, int with_condexpr, int explicit_parens);
static jnode *parse_unary(parser *P, int with_filter);
static jnode *parse_primary(parser *P);
static jnode *parse_postfix(parser *P, jnode *n);

/* (args) of a call, a filter or a test: positional, then name=value. */
static int parse_call_args(parser *P, jnode *n)
{
    nlist args = {0};
    const char *kw[64];
    int nkw = 0;
    if (expect_op(P, "(")) return -1;
    while (!is_op(cur(P), ")")) {
        if (args.n) {
            if (expect_op(P, ",")) return -1;
            if (is_op(cur(P), ")")) break;
        }
        if (is_op(cur(P), "*") || is_op(cur(P), "**")) {
            fail_at(P, cur(P), "*args and **kwargs in a call are not supported");
            return -1;
        }
        if (cur(P)->type == T_NAME && is_op(peek(P, 1), "=")) {
            if (nkw == 64) return fail_at(P, cur(P), "more than 64 keyword arguments") ? 0 : -1;
            kw[nkw++] = name_of(P, cur(P));
            P->i += 2;
        } else if (nkw) {
            fail_at(P, cur(P), "a positional argument after keyword arguments");
            return -1;
        }
        jnode *x = parse_expression(P, 1);
        if (!x || nl_push(P, &args, x)) return -1;
    }
    P->i++; /* ')' */
    n->list = args.v;
    n->n = args.n;
    n->nkw = nkw;
    if (nkw) {
        n->kwnames = jarena_alloc(P->a, (size_t)nkw * sizeof *n->kwnames);
        if (!n->kwnames) return fail_at(P, cur(P), "out of memory") ? 0 : -1;
        memcpy(n->kwnames, kw, (size_t)nkw * sizeof *kw);
    }
    return 0;
}

/* A dotted name after '|' or 'is'. */
static const char *dotted_name(parser *P, const char *what)
{
    if (cur(P)->type != T_NAME) return fail_at(P, cur(P), "expected a %s name, found %s", what, describe(P, cur(P)));
    jbuf b = {.a = P->a};
    jbuf_put(&b, cur(P)->text, cur(P)->len);
    P->i++;
    while (is_op(cur(P), ".") && peek(P, 1)->type == T_NAME) {
        jbuf_putc(&b, '.');
        jbuf_put(&b, peek(P, 1)->text, peek(P, 1)->len);
        P->i += 2;
    }
    if (b.failed) return fail_at(P, cur(P), "out of memory");
    return b.p;
}

static jnode *parse_filter_expr(parser *P, jnode *n)
{
    for (;;) {
        token *at = cur(P);
        if (is_op(at, "|")) {
            P->i++;
            token *name_tok = cur(P);
            const char *name = dotted_name(P, "filter");
            if (!name) return NULL;
            if (!jinja_filter_known(name))
                return fail_at(P, name_tok, "the filter '%s' is not supported by tidal's Jinja interpreter", name);
            jnode *f = node(P, JN_FILTER, name_tok);
            if (!f) return NULL;
            f->name = name;
            f->a = n;
            if (is_op(cur(P), "(") && parse_call_args(P, f)) return NULL;
            n = f;
        } else if (is_name(at, "is")) {
            P->i++;
            int negate = 0;
            if (is_name(cur(P), "not")) {
                negate = 1;
                P->i++;
            }
            token *name_tok = cur(P);
            const char *name = dotted_name(P, "test");
            if (!name) return NULL;
            if (!jinja_test_known(name))
                return fail_at(P, name_tok, "the test '%s' is not supported by tidal's Jinja interpreter", name);
            jnode *t = node(P, JN_TEST, name_tok);
            if (!t) return NULL;
            t->name = name;
            t->a = n;
            t->negate = negate;
            token *c = cur(P);
            if (is_op(c, "(")) {
                if (parse_call_args(P, t)) return NULL;
            } else if ((c->type == T_NAME || c->type == T_STRING || c->type == T_INT || c->type == T_FLOAT ||
                        is_op(c, "[") || is_op(c, "{")) &&
                       !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
                if (is_name(c, "is")) return fail_at(P, c, "tests cannot be chained with 'is'");
                jnode *arg = parse_primary(P);
                if (!arg || !(arg = parse_postfix(P, arg))) return NULL;
                t->list = jarena_alloc(P->a, sizeof *t->list);
                if (!t->list) return fail_at(P, c, "out of memory");
                t->list[0] = arg;
                t->n = 1;
            }
            n = t;
        } else if (is_op(at, "(")) {
            jnode *c = node(P, JN_CALL, at);
            if (!c) return NULL;
            c->a = n;
            c->line = n->line; /* a call is reported where its callee starts */
            c->col = n->col;
            if (parse_call_args(P, c)) return NULL;
            n = c;
        } else {
            return n;
        }
    }
}

static jnode *parse_subscript(parser *P, jnode *obj, token *at)
{
    P->i++; /* '[' */
    jnode *parts[3] = {NULL, NULL, NULL};
    int slice = 0;
    for (int k = 0; k < 3; k++) {
        if (!is_op(cur(P), ":") && !is_op(cur(P), "]")) {
            parts[k] = parse_expression(P, 1);
            if (!parts[k]) return NULL;
        }
        if (is_op(cur(P), ":") && k < 2) {
            slice = 1;
            P->i++;
            continue;
        }
        break;
    }
    if (is_op(cur(P), ",")) return fail_at(P, cur(P), "subscripts with a comma (tuples) are not supported");
    if (expect_op(P, "]")) return NULL;
    if (!slice && !parts[0]) return fail_at(P, at, "an empty subscript []");
    jnode *n = node(P, slice ? JN_SLICE : JN_ITEM, at);
    if (!n) return NULL;
    n->a = obj;
    if (slice) {
        n->list = jarena_alloc(P->a, 3 * sizeof *n->list);
        if (!n->list) return fail_at(P, at, "out of memory");
        memcpy(n->list, parts, sizeof parts);
        n->n = 3;
    } else {
        n->b = parts[0];
    }
    return n;
}

static jnode *parse_postfix(parser *P, jnode *n)
{
    for (;;) {
        token *at = cur(P);
        if (is_op(at, ".")) {
            token *name = peek(P, 1);
            if (name->type == T_NAME) {
                jnode *x = node(P, JN_ATTR, name);
                if (!x) return NULL;
                x->a = n;
                x->name = name_of(P, name);
                P->i += 2;
                n = x;
            } else if (name->type == T_INT) { /* x.0 is x[0] */
                jnode *x = node(P, JN_ITEM, name), *k = node(P, JN_LIT, name);
                if (!x || !k) return NULL;
                k->lit = name->value;
                x->a = n;
                x->b = k;
                P->i += 2;
                n = x;
            } else {
                return fail_at(P, name, "expected an attribute name after '.', found %s", describe(P, name));
            }
        } else if (is_op(at, "[")) {
            if (!(n = parse_subscript(P, n, at))) return NULL;
        } else if (is_op(at, "(")) {
            jnode *c = node(P, JN_CALL, at);
            if (!c) return NULL;
            c->a = n;
            c->line = n->line; /* a call is reported where its callee starts */
            c->col = n->col;
            if (parse_call_args(P, c)) return NULL;
            n = c;
        } else {
            return n;
        }
    }
}

static jnode *parse_primary(parser *P)
{
    token *t = cur(P);
    if (++P->depth > 200) return fail_at(P, t, "expression nested more than 200 deep");
    jnode *n = NULL;
    if (t->type == T_NAME) {
        static const char *const lits[] = {"true", "True", "false", "False", "none", "None"};
        int which = -1;
        for (int k = 0; k < 6; k++)
            if (is_name(t, lits[k])) which = k;
        if (which >= 0) {
            n = node(P, JN_LIT, t);
            if (n) n->lit = which < 4 ? jv_bool(which < 2) : jv_none();
        } else if ((n = node(P, JN_NAME, t))) {
            n->name = name_of(P, t);
        }
        P->i++;
    } else if (t->type == T_STRING) {
        jv v = t->value;
        P->i++;
        while (cur(P)->type == T_STRING) { /* "a" "b" is "ab" */
            const jstr *s = jstr_cat(P->a, v.u.s, cur(P)->value.u.s);
            if (!s) return fail_at(P, t, "out of memory");
            v = jv_strv(s);
            P->i++;
        }
        if ((n = node(P, JN_LIT, t))) n->lit = v;
    } else if (t->type == T_INT || t->type == T_FLOAT) {
        if ((n = node(P, JN_LIT, t))) n->lit = t->value;
        P->i++;
    } else if (is_op(t, "(")) {
        P->i++;
        n = parse_tuple(P, 1, 1);
        if (n && expect_op(P, ")")) n = NULL;
    } else if (is_op(t, "[") || is_op(t, "{")) {
        const int dict = is_op(t, "{");
        const char *close = dict ? "}" : "]";
        nlist keys = {0}, vals = {0};
        P->i++;
        while (!is_op(cur(P), close)) {
            if (keys.n && expect_op(P, ",")) return NULL;
            if (is_op(cur(P), close)) break;
            jnode *k = parse_expression(P, 1);
            if (!k || nl_push(P, &keys, k)) return NULL;
            if (dict) {
                jnode *v;
                if (expect_op(P, ":") || !(v = parse_expression(P, 1)) || nl_push(P, &vals, v)) return NULL;
            }
        }
        P->i++;
        if ((n = node(P, dict ? JN_DICT : JN_LIST, t))) {
            n->n = keys.n;
            n->list = keys.v;
            if (dict) {
                n->list = jarena_alloc(P->a, (size_t)(2 * keys.n + 1) * sizeof *n->list);
                if (!n->list) return fail_at(P, t, "out of memory");
                if (keys.n) {
                    memcpy(n->list, keys.v, (size_t)keys.n * sizeof *n->list);
                    memcpy(n->list + keys.n, vals.v, (size_t)keys.n * sizeof *n->list);
                }
            }
        }
    } else {
        n = fail_at(P, t, "expected an expression, found %s", describe(P, t));
    }
    P->depth--;
    return n;
}

static jnode *parse_unary(parser *P, int with_filter)
{
    token *t = cur(P);
    jnode *n;
    if (++P->depth > 200) return fail_at(P, t, "expression nested more than 200 deep");
    if (is_op(t, "-") || is_op(t, "+")) {
        P->i++;
        jnode *x = parse_unary(P, 0);
        if (!x || !(n = node(P, is_op(t, "-") ? JN_NEG : JN_POS, t))) return NULL;
        n->a = x;
    } else if (!(n = parse_primary(P))) {
        return NULL;
    }
    if (!(n = parse_postfix(P, n))) return NULL;
    if (with_filter && !(n = parse_filter_expr(P, n))) return NULL;
    P->depth--;
    return n;
}

static jnode *binary(parser *P, const token *at, const char *op, jnode *a, jnode *b)
{
    jnode *n = node(P, JN_BIN, at);
    if (!n) return NULL;
    n->name = op;
    n->a = a;
    n->b = b;
    return n;
}

static jnode *parse_pow(parser *P)
{
    jnode *l = parse_unary(P, 1);
    while (l && is_op(cur(P), "**")) {
        token *at = cur(P);
        P->i++;
        jnode *r = parse_unary(P, 1);
        l = r ? binary(P, at, "**", l, r) : NULL;
    }
    return l;
}

static jnode *parse_math2(parser *P)
{
    jnode *l = parse_pow(P);
    static const char *const ops[] = {"*", "/", "//", "%"};
    for (;;) {
        int k = 0;
        while (k < 4 && !is_op(cur(P), ops[k])) k++;
        if (!l || k == 4) return l;
        token *at = cur(P);
        P->i++;
        jnode *r = parse_pow(P);
        l = r ? binary(P, at, ops[k], l, r) : NULL;
    }
}

static jnode *parse_concat(parser *P)
{
    token *at = cur(P);
    jnode *first = parse_math2(P);
    if (!first || !is_op(cur(P), "~")) return first;
    nlist args = {0};
    if (nl_push(P, &args, first)) return NULL;
    while (is_op(cur(P), "~")) {
        P->i++;
        jnode *x = parse_math2(P);
        if (!x || nl_push(P, &args, x)) return NULL;
    }
    jnode *n = node(P, JN_CONCAT, at);
    if (n) {
        n->list = args.v;
        n->n = args.n;
    }
    return n;
}

static jnode *parse_math1(parser *P)
{
    jnode *l = parse_concat(P);
    while (l && (is_op(cur(P), "+") || is_op(cur(P), "-"))) {
        token *at = cur(P);
        const char *op = is_op(at, "+") ? "+" : "-";
        P->i++;
        jnode *r = parse_concat(P);
        l = r ? binary(P, at, op, l, r) : NULL;
    }
    return l;
}

static jnode *parse_compare(parser *P)
{
    token *at = cur(P);
    jnode *first = parse_math1(P);
    if (!first) return NULL;
    nlist ops = {0};
    static const char *const cmp[] = {"==", "!=", "<", "<=", ">", ">="};
    for (;;) {
        const char *op = NULL;
        for (int k = 0; k < 6 && !op; k++)
            if (is_op(cur(P), cmp[k])) op = cmp[k];
        if (op) P->i++;
        else if (is_name(cur(P), "in")) op = "in", P->i++;
        else if (is_name(cur(P), "not") && is_name(peek(P, 1), "in")) op = "not in", P->i += 2;
        else break;
        jnode *x = parse_math1(P), *o = node(P, JN_LIT, at);
        if (!x || !o) return NULL;
        o->name = op;
        o->a = x;
        if (nl_push(P, &ops, o)) return NULL;
    }
    if (!ops.n) return first;
    jnode *n = node(P, JN_COMPARE, at);
    if (n) {
        n->a = first;
        n->list = ops.v;
        n->n = ops.n;
    }
    return n;
}

static jnode *parse_not(parser *P)
{
    token *at = cur(P);
    if (!is_name(at, "not")) return parse_compare(P);
    P->i++;
    if (++P->depth > 200) return fail_at(P, at, "expression nested more than 200 deep");
    jnode *x = parse_not(P), *n = x ? node(P, JN_NOT, at) : NULL;
    P->depth--;
    if (n) n->a = x;
    return n;
}

static jnode *parse_and(parser *P)
{
    jnode *l = parse_not(P);
    while (l && is_name(cur(P), "and")) {
        token *at = cur(P);
        P->i++;
        jnode *r = parse_not(P), *n = r ? node(P, JN_AND, at) : NULL;
        if (n) n->a = l, n->b = r;
        l = n;
    }
    return l;
}

static jnode *parse_or(parser *P)
{
    jnode *l = parse_and(P);
    while (l && is_name(cur(P), "or")) {
        token *at = cur(P);
        P->i++;
        jnode *r = parse_and(P), *n = r ? node(P, JN_OR, at) : NULL;
        if (n) n->a = l, n->b = r;
        l = n;
    }
    return l;
}

static jnode *parse_condexpr(parser *P)
{
    jnode *x = parse_or(P);
    while (x && is_name(cur(P), "if")) {
        token *at = cur(P);
        P->i++;
        jnode *test = parse_or(P), *other = NULL;
        if (!test) return NULL;
        if (is_name(cur(P), "else")) {
            P->i++;
            if (++P->depth > 200) return fail_at(P, at, "expression nested more than 200 deep");
            other = parse_condexpr(P);
            P->depth--;
            if (!other) return NULL;
        }
        jnode *n = node(P, JN_COND, at);
        if (!n) return NULL;
        n->a = test;
        n->b = x;
        n->c = other;
        x = n;
    }
    return x;
}

static jnode *parse_expression(parser *P, int with_condexpr)
{
    return with_condexpr ? parse_condexpr(P) : parse_or(P);
}

static int tuple_end(const token *t)
{
    return t->type == T_VAR_END || t->type == T_BLOCK_END || t->type == T_EOF || is_op(t, ")");
}

static jnode *parse_tuple(parser *P, int with_condexpr, int explicit_parens)
{
    token *at = cur(P);
    nlist items = {0};
    int is_tuple = 0;
    for (;;) {
        if (items.n && expect_op(P, ",")) return NULL;
        if (tuple_end(cur(P))) break;
        jnode *x = parse_expression(P, with_condexpr);
        if (!x || nl_push(P, &items, x)) return NULL;
        if (is_op(cur(P), ",")) is_tuple = 1;
        else break;
    }
    if (!is_tuple) {
        if (items.n) return items.v[0];
        if (!explicit_parens) return fail_at(P, cur(P), "expected an expression, found %s", describe(P, cur(P)));
    }
    jnode *n = node(P, JN_TUPLE, at);
    if (n) {
        n->list = items.v;
        n->n = items.n;
    }
    return n;
}

/* ---- statements ------------------------------------------------------------ */

static jnode *parse_body(parser *P, const char *const *ends, const token *opened, const char *opener);

static int expect_block_end(parser *P)
{
    if (cur(P)->type == T_BLOCK_END) {
        P->i++;
        return 0;
    }
    fail_at(P, cur(P), "expected '%%}', found %s", describe(P, cur(P)));
    return -1;
}

/* After parse_body stopped at {% name: consumes "{% name %}". */
static int end_tag(parser *P)
{
    P->i += 2; /* BLOCK_BEGIN, the name */
    return expect_block_end(P);
}

/* The names a for or set assigns: one name, or names separated by commas
 * (optionally in parentheses). */
static int parse_targets(parser *P, jnode *n, int allow_ns)
{
    nlist names = {0};
    int paren = is_op(cur(P), "(");
    if (paren) P->i++;
    for (;;) {
        token *t = cur(P);
        if (t->type != T_NAME) return fail_at(P, t, "expected a variable name, found %s", describe(P, t)) ? 0 : -1;
        jnode *x = node(P, JN_NAME, t);
        if (!x) return -1;
        x->name = name_of(P, t);
        P->i++;
        if (allow_ns && !names.n && is_op(cur(P), ".")) { /* namespace attribute: ns.attr */
            token *attr = peek(P, 1);
            if (attr->type != T_NAME) return fail_at(P, attr, "expected an attribute name after '.'") ? 0 : -1;
            x->b = node(P, JN_LIT, attr);
            if (!x->b) return -1;
            x->b->name = name_of(P, attr);
            P->i += 2;
            n->list = jarena_alloc(P->a, sizeof *n->list);
            if (!n->list) return -1;
            n->list[0] = x;
            n->n = 1;
            return 0;
        }
        if (nl_push(P, &names, x)) return -1;
        if (!is_op(cur(P), ",")) break;
        P->i++;
    }
    if (paren && expect_op(P, ")")) return -1;
    n->list = names.v;
    n->n = names.n;
    return 0;
}

static jnode *parse_if(parser *P, token *at)
{
    jnode *n = node(P, JN_IF, at);
    if (!n || !(n->a = parse_tuple(P, 0, 0)) || expect_block_end(P)) return NULL;
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    if (!(n->b = parse_body(P, ends, at, "if"))) return NULL;
    token *which = peek(P, 1);
    if (is_name(which, "elif")) {
        P->i += 2;
        n->c = parse_if(P, which);
        return n->c ? n : NULL;
    }
    if (is_name(which, "else")) {
        if (end_tag(P)) return NULL;
        static const char *const endif[] = {"endif", NULL};
        if (!(n->c = parse_body(P, endif, at, "if"))) return NULL;
    }
    return end_tag(P) ? NULL : n;
}

static jnode *parse_for(parser *P, token *at)
{
    jnode *n = node(P, JN_FOR, at);
    if (!n || parse_targets(P, n, 0)) return NULL;
    if (!is_name(cur(P), "in")) return fail_at(P, cur(P), "expected 'in' in the for tag, found %s", describe(P, cur(P)));
    P->i++;
    if (!(n->a = parse_tuple(P, 0, 0))) return NULL;
    if (is_name(cur(P), "if")) {
        P->i++;
        if (!(n->b = parse_expression(P, 1))) return NULL;
    }
    if (is_name(cur(P), "recursive")) return fail_at(P, cur(P), "recursive for loops are not supported");
    if (expect_block_end(P)) return NULL;
    static const char *const ends[] = {"endfor", "else", NULL};
    P->loops++;
    n->body = parse_body(P, ends, at, "for");
    P->loops--;
    if (!n->body) return NULL;
    if (is_name(peek(P, 1), "else")) {
        if (end_tag(P)) return NULL;
        static const char *const endfor[] = {"endfor", NULL};
        if (!(n->c = parse_body(P, endfor, at, "for"))) return NULL;
    }
    return end_tag(P) ? NULL : n;
}

static jnode *parse_set(parser *P, token *at)
{
    jnode *n = node(P, JN_SET, at);
    if (!n || parse_targets(P, n, 1)) return NULL;
    if (is_op(cur(P), "=")) {
        P->i++;
        if (!(n->a = parse_tuple(P, 1, 0)) || expect_block_end(P)) return NULL;
        return n;
    }
    if (is_op(cur(P), "|")) return fail_at(P, cur(P), "filters on a {%% set %%} block are not supported");
    if (n->n != 1 || n->list[0]->b) return fail_at(P, at, "a {%% set %%} block assigns one variable");
    if (expect_block_end(P)) return NULL;
    n->kind = JN_SET_BLOCK;
    static const char *const ends[] = {"endset", NULL};
    if (!(n->body = parse_body(P, ends, at, "set"))) return NULL;
    return end_tag(P) ? NULL : n;
}

static jnode *parse_statement(parser *P)
{
    token *open = cur(P), *t = peek(P, 1);
    if (t->type != T_NAME) return fail_at(P, t, "expected a tag name after '{%%', found %s", describe(P, t));
    P->i += 2;
    if (is_name(t, "if")) return parse_if(P, t);
    if (is_name(t, "for")) return parse_for(P, t);
    if (is_name(t, "set")) return parse_set(P, t);
    if (is_name(t, "break") || is_name(t, "continue")) {
        if (!P->loops) return fail_at(P, t, "'%s' outside of a for loop", is_name(t, "break") ? "break" : "continue");
        jnode *n = node(P, is_name(t, "break") ? JN_BREAK : JN_CONTINUE, t);
        return n && !expect_block_end(P) ? n : NULL;
    }
    if (is_name(t, "generation")) { /* transformers' {% generation %}: renders its body as it is */
        if (expect_block_end(P)) return NULL;
        static const char *const ends[] = {"endgeneration", NULL};
        jnode *body = parse_body(P, ends, t, "generation");
        return body && !end_tag(P) ? body : NULL;
    }
    static const char *const jinja_tags[] = {"macro", "call", "filter", "include", "import", "from", "extends",
                                             "block", "with", "autoescape", "do", "trans", "pluralize", NULL};
    for (int k = 0; jinja_tags[k]; k++)
        if (is_name(t, jinja_tags[k]))
            return fail_at(P, t, "the tag '{%% %s %%}' is not supported by tidal's Jinja interpreter", jinja_tags[k]);
    (void)open;
    return fail_at(P, t, "unknown tag '%s'", name_of(P, t));
}

/* Statements up to a {% name %} with a name in ends (not consumed), or the
 * end of the template (ends NULL). */
static jnode *parse_body(parser *P, const char *const *ends, const token *opened, const char *opener)
{
    jnode *body = node(P, JN_BODY, cur(P));
    nlist items = {0};
    if (!body) return NULL;
    for (;;) {
        token *t = cur(P);
        jnode *x = NULL;
        if (t->type == T_EOF) {
            if (ends) {
                const char *closer = ends[0];
                for (int k = 0; ends[k]; k++)
                    if (!strncmp(ends[k], "end", 3)) closer = ends[k];
                return fail_at(P, opened, "'{%% %s %%}' is never closed (expected '{%% %s %%}')", opener, closer);
            }
            break;
        }
        if (t->type == T_DATA) {
            if ((x = node(P, JN_DATA, t))) x->lit = t->value;
            P->i++;
        } else if (t->type == T_VAR_BEGIN) {
            P->i++;
            if ((x = node(P, JN_PRINT, t)) && (x->a = parse_tuple(P, 1, 0))) {
                if (cur(P)->type != T_VAR_END) x = fail_at(P, cur(P), "expected '}}', found %s", describe(P, cur(P)));
                else P->i++;
            } else {
                x = NULL;
            }
        } else if (t->type == T_BLOCK_BEGIN) {
            token *name = peek(P, 1);
            for (int k = 0; ends && ends[k]; k++)
                if (is_name(name, ends[k])) {
                    body->list = items.v;
                    body->n = items.n;
                    return body;
                }
            static const char *const closers[] = {"endif", "endfor", "endset", "elif", "else", "endgeneration", NULL};
            for (int k = 0; closers[k]; k++)
                if (is_name(name, closers[k])) return fail_at(P, name, "unexpected '{%% %s %%}'", closers[k]);
            x = parse_statement(P);
        } else {
            x = fail_at(P, t, "unexpected %s", describe(P, t));
        }
        if (!x || nl_push(P, &items, x)) return NULL;
    }
    body->list = items.v;
    body->n = items.n;
    return body;
}

int jinja_parse(jtemplate *t, const char *src, size_t len, char *err, size_t err_bytes)
{
    /* line endings as \n, one final newline dropped (keep_trailing_newline off) */
    char *norm = jarena_alloc(&t->arena, len + 1);
    if (!norm) {
        snprintf(err, err_bytes, "out of memory");
        return -1;
    }
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            norm[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            norm[n++] = src[i];
        }
    }
    if (n && norm[n - 1] == '\n') n--;
    norm[n] = '\0';
    lexer L = {.a = &t->arena, .s = norm, .n = n, .err = err, .err_bytes = err_bytes};
    if (lex(&L)) return -1;
    parser P = {.a = &t->arena, .t = L.tok, .err = err, .err_bytes = err_bytes};
    t->root = parse_body(&P, NULL, NULL, NULL);
    return t->root ? 0 : -1;
}
