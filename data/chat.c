/* Chat templates and fine-tuning records (include/tidal/chat.h): loading a
 * template from a Hugging Face folder, rendering it as transformers does,
 * turning a JSONL record into text plus the byte ranges that count, and
 * those into tokens with their loss mask. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "jinja_internal.h"
#include "tidal/alloc.h"
#include "tidal/chat.h"
#include "tokenizer_internal.h"

#define RENDER_LIMIT_BYTES ((size_t)256 << 20)

struct td_chat_template {
    jtemplate jt;        /* its arena also holds the special tokens */
    jdict *special;      /* "bos_token" -> "<s>", ... */
    int64_t now;
};

/* ---- loading --------------------------------------------------------------- */

static int64_t default_clock(void)
{
    const char *e = getenv("SOURCE_DATE_EPOCH");
    if (e && *e) {
        char *end;
        long long v = strtoll(e, &end, 10);
        if (*end == '\0') return v;
    }
    return (int64_t)time(NULL);
}

static const char *const SPECIAL[] = {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                                      "mask_token", NULL};

/* The special tokens and the template text of a tokenizer_config.json
 * (*source NULL when it has no chat_template). */
static td_status read_config(td_chat_template *t, const char *config, size_t len, const char *name,
                             const char **source, size_t *source_len)
{
    jarena *a = &t->jt.arena;
    jv root;
    char err[256];
    if (jv_from_json(a, config, len, &root, err, sizeof err))
        return td_error_set(TD_ERR_INVALID, "%s: not JSON: %s", name, err);
    if (root.kind != JV_DICT) return td_error_set(TD_ERR_INVALID, "%s: not a JSON object", name);
    for (int k = 0; SPECIAL[k]; k++) {
        const jv *v = jdict_get_str(root.u.d, SPECIAL[k]);
        if (v && v->kind == JV_DICT) v = jdict_get_str(v->u.d, "content"); /* an AddedToken written out */
        if (!v || v->kind == JV_NONE) continue;
        if (v->kind != JV_STR)
            return td_error_set(TD_ERR_INVALID, "%s: \"%s\" must be a string or an object with \"content\"", name,
                                SPECIAL[k]);
        if (jdict_set(a, t->special, jv_strv(jstr_new(a, SPECIAL[k], strlen(SPECIAL[k]))), *v))
            return td_error_set(TD_ERR_NOMEM, "out of memory reading %s", name);
    }
    const jv *extra = jdict_get_str(root.u.d, "additional_special_tokens");
    if (extra && extra->kind == JV_LIST) {
        jlist *l = jlist_new(a, extra->u.l->n);
        if (!l) return td_error_set(TD_ERR_NOMEM, "out of memory reading %s", name);
        for (size_t i = 0; i < extra->u.l->n; i++) {
            jv x = extra->u.l->v[i];
            if (x.kind == JV_DICT) {
                const jv *c = jdict_get_str(x.u.d, "content");
                x = c ? *c : jv_none();
            }
            if (x.kind == JV_STR) l->v[l->n++] = x;
        }
        jv lv = {.kind = JV_LIST};
        lv.u.l = l;
        jdict_set(a, t->special, jv_strv(jstr_new(a, "additional_special_tokens", 25)), lv);
    }
    *source = NULL;
    const jv *ct = jdict_get_str(root.u.d, "chat_template");
    if (!ct || ct->kind == JV_NONE) return TD_OK;
    if (ct->kind == JV_LIST) { /* named templates: the "default" one */
        const jv *found = NULL;
        for (size_t i = 0; i < ct->u.l->n && !found; i++) {
            jv e = ct->u.l->v[i];
            const jv *nm = e.kind == JV_DICT ? jdict_get_str(e.u.d, "name") : NULL;
            if (nm && nm->kind == JV_STR && !strcmp(nm->u.s->s, "default")) found = jdict_get_str(e.u.d, "template");
        }
        if (!found) return td_error_set(TD_ERR_INVALID, "%s: \"chat_template\" is a list without a \"default\" one", name);
        ct = found;
    }
    if (ct->kind != JV_STR) return td_error_set(TD_ERR_INVALID, "%s: \"chat_template\" must be a string", name);
    *source = ct->u.s->s;
    *source_len = ct->u.s->len;
    return TD_OK;
}

td_status td_chat_template_create(const char *source, size_t len, const char *config_json, size_t config_len,
                                  const char *name, td_chat_template **out)
{
    td_status st = TD_OK;
    char err[512];
    *out = NULL;
    if (!name) name = "chat template";
    td_chat_template *t = td_calloc(1, sizeof *t, TD_ROLE_META);
    if (!t) return td_error_set(TD_ERR_NOMEM, "out of memory loading %s", name);
    t->jt.arena.limit_bytes = RENDER_LIMIT_BYTES;
    t->now = default_clock();
    t->special = jdict_new(&t->jt.arena, 0);
    t->jt.name = td_strdup(name, TD_ROLE_META);
    if (!t->special || !t->jt.name) TD_FAIL(TD_ERR_NOMEM, "out of memory loading %s", name);
    if (config_json) {
        const char *from_config = NULL;
        size_t from_len = 0;
        TD_TRY(read_config(t, config_json, config_len, name, &from_config, &from_len));
        if (!source) {
            if (!from_config)
                TD_FAIL(TD_ERR_INVALID, "%s has no \"chat_template\" (a base model's tokenizer has none: use an "
                        "instruct model's, or give the template with --chat-template FILE.jinja)", name);
            source = from_config;
            len = from_len;
        }
    }
    if (!source) TD_FAIL(TD_ERR_INVALID, "%s: no template text", name);
    if (jinja_parse(&t->jt, source, len, err, sizeof err)) TD_FAIL(TD_ERR_INVALID, "chat template of %s: %s", name, err);
    *out = t;
    t = NULL;
cleanup:
    td_chat_template_free(t);
    return st;
}

static int file_exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

td_status td_chat_template_load(const char *path, td_chat_template **out)
{
    td_status st = TD_OK;
    char jinja[4096] = "", config[4096] = "";
    char *src = NULL, *cfg = NULL;
    size_t src_len = 0, cfg_len = 0;
    struct stat sb;
    *out = NULL;
    if (!path || stat(path, &sb) != 0) return td_error_set(TD_ERR_IO, "cannot open chat template '%s'", path ? path : "");
    size_t plen = strlen(path);
    if (S_ISDIR(sb.st_mode)) {
        snprintf(jinja, sizeof jinja, "%s/chat_template.jinja", path);
        snprintf(config, sizeof config, "%s/tokenizer_config.json", path);
        if (!file_exists(jinja)) jinja[0] = '\0';
        if (!file_exists(config)) config[0] = '\0';
        if (!jinja[0] && !config[0])
            return td_error_set(TD_ERR_INVALID, "'%s' holds neither chat_template.jinja nor tokenizer_config.json", path);
    } else if (plen >= 5 && !strcmp(path + plen - 5, ".json")) {
        snprintf(config, sizeof config, "%s", path);
    } else { /* a template file; special tokens from a tokenizer_config.json beside it */
        snprintf(jinja, sizeof jinja, "%s", path);
        const char *slash = strrchr(path, '/');
        snprintf(config, sizeof config, "%.*s%stokenizer_config.json", slash ? (int)(slash - path) : 0, path,
                 slash ? "/" : "");
        if (!file_exists(config)) config[0] = '\0';
    }
    if (jinja[0]) TD_TRY(td_tok_read_file(jinja, "chat template", &src, &src_len));
    if (config[0]) TD_TRY(td_tok_read_file(config, "tokenizer_config.json", &cfg, &cfg_len));
    TD_TRY(td_chat_template_create(src, src_len, cfg, cfg_len, jinja[0] ? jinja : config, out));
cleanup:
    td_free(src);
    td_free(cfg);
    return st;
}

void td_chat_template_free(td_chat_template *t)
{
    if (!t) return;
    jarena_free(&t->jt.arena);
    td_free(t->jt.name);
    td_free(t);
}

void td_chat_template_set_clock(td_chat_template *t, int64_t epoch_seconds) { t->now = epoch_seconds; }

const char *td_chat_template_token(const td_chat_template *t, const char *name)
{
    const jv *v = jdict_get_str(t->special, name);
    return v && v->kind == JV_STR ? v->u.s->s : NULL;
}

/* ---- rendering ---------------------------------------------------------------- */

static jv key(jarena *a, const char *k) { return jv_strv(jstr_new(a, k, strlen(k))); }

/* The variables of one render: the special tokens, then vars' items, then
 * add_generation_prompt; tools and documents None unless given. */
static jdict *context(const td_chat_template *t, jarena *a, const jdict *vars, jv messages, int add_gen)
{
    jdict *c = jdict_new(a, t->special->n + 8);
    if (!c) return NULL;
    int fail = 0;
    for (size_t i = 0; i < t->special->n; i++) fail |= jdict_set(a, c, t->special->k[i], t->special->v[i]);
    fail |= jdict_set(a, c, key(a, "tools"), jv_none());
    fail |= jdict_set(a, c, key(a, "documents"), jv_none());
    for (size_t i = 0; vars && i < vars->n; i++) fail |= jdict_set(a, c, vars->k[i], vars->v[i]);
    if (messages.kind != JV_UNDEF) fail |= jdict_set(a, c, key(a, "messages"), messages);
    fail |= jdict_set(a, c, key(a, "add_generation_prompt"), jv_bool(add_gen));
    return fail ? NULL : c;
}

/* Renders into out (arena a); TD_ERR_INVALID with the template's message. */
static td_status render(const td_chat_template *t, jarena *a, const jdict *ctx, jbuf *out)
{
    char err[512];
    int raised = 0;
    *out = (jbuf){.a = a};
    if (jinja_render(&t->jt, a, ctx, t->now, out, err, sizeof err, &raised)) {
        if (raised) return td_error_set(TD_ERR_INVALID, "the chat template of %s refused it, %s", t->jt.name, err);
        return td_error_set(TD_ERR_INVALID, "chat template of %s, %s", t->jt.name, err);
    }
    return TD_OK;
}

td_status td_chat_template_render(const td_chat_template *t, const char *conversation_json, size_t len,
                                  int add_generation_prompt, char **text_out, size_t *len_out)
{
    td_status st = TD_OK;
    jarena a = {.limit_bytes = RENDER_LIMIT_BYTES};
    jv vars;
    char err[256];
    jbuf out;
    *text_out = NULL;
    if (jv_from_json(&a, conversation_json, len, &vars, err, sizeof err))
        TD_FAIL(TD_ERR_INVALID, "the conversation is not JSON: %s", err);
    if (vars.kind != JV_DICT) TD_FAIL(TD_ERR_INVALID, "the conversation must be a JSON object with \"messages\"");
    jdict *ctx = context(t, &a, vars.u.d, jv_undef(NULL), add_generation_prompt);
    if (!ctx) TD_FAIL(TD_ERR_NOMEM, "out of memory rendering a chat template");
    TD_TRY(render(t, &a, ctx, &out));
    *text_out = td_malloc(out.n + 1, TD_ROLE_META);
    if (!*text_out) TD_FAIL(TD_ERR_NOMEM, "out of memory");
    if (out.n) memcpy(*text_out, out.p, out.n);
    (*text_out)[out.n] = '\0';
    if (len_out) *len_out = out.n;
cleanup:
    jarena_free(&a);
    return st;
}

/* ---- records --------------------------------------------------------------------- */

td_status td_loss_on_parse(const char *name, td_loss_on *out)
{
    if (name && !strcmp(name, "all")) *out = TD_LOSS_ALL;
    else if (name && !strcmp(name, "completion")) *out = TD_LOSS_COMPLETION;
    else if (name && !strcmp(name, "assistant")) *out = TD_LOSS_ASSISTANT;
    else return td_error_set(TD_ERR_INVALID, "--loss-on '%s': use all, completion or assistant", name ? name : "");
    return TD_OK;
}

static const char *const ROLES[] = {"system", "user", "assistant", "tool", "ipython", NULL};

static td_status bad(td_record_error *why, td_record_error kind, const char *fmt, const char *a, const char *b)
{
    *why = kind;
    return td_error_set(TD_ERR_INVALID, fmt, a, b);
}

/* The messages of a conversation record, checked. */
static td_status check_messages(jv msgs, td_record_error *why)
{
    char idx[32];
    if (msgs.kind != JV_LIST) return bad(why, TD_RECORD_BAD_FIELDS, "\"messages\" must be a list of messages%s%s", "", "");
    if (!msgs.u.l->n) return bad(why, TD_RECORD_BAD_FIELDS, "\"messages\" is empty%s%s", "", "");
    for (size_t i = 0; i < msgs.u.l->n; i++) {
        jv m = msgs.u.l->v[i];
        snprintf(idx, sizeof idx, "%zu", i + 1);
        if (m.kind != JV_DICT) return bad(why, TD_RECORD_BAD_FIELDS, "message %s is not a JSON object%s", idx, "");
        const jv *role = jdict_get_str(m.u.d, "role"), *content = jdict_get_str(m.u.d, "content");
        const jv *calls = jdict_get_str(m.u.d, "tool_calls");
        if (!role) return bad(why, TD_RECORD_BAD_FIELDS, "message %s has no \"role\"%s", idx, "");
        if (role->kind != JV_STR) return bad(why, TD_RECORD_BAD_FIELDS, "message %s: \"role\" must be a string%s", idx, "");
        int known = 0;
        for (int k = 0; ROLES[k]; k++) known |= !strcmp(role->u.s->s, ROLES[k]);
        if (!known)
            return bad(why, TD_RECORD_BAD_FIELDS, "message %s has the unknown role '%s' (roles are system, user, "
                       "assistant, tool and ipython)", idx, role->u.s->s);
        int has_calls = calls && calls->kind != JV_NONE;
        if (!content && !has_calls) return bad(why, TD_RECORD_BAD_FIELDS, "message %s has no \"content\"%s", idx, "");
        if (content && content->kind != JV_STR && content->kind != JV_LIST && !(content->kind == JV_NONE && has_calls))
            return bad(why, TD_RECORD_BAD_FIELDS, "message %s: \"content\" must be a string or a list of parts%s", idx,
                       content->kind == JV_NONE ? " (null only beside tool_calls)" : "");
    }
    return TD_OK;
}

static jv sublist(jarena *a, jv l, size_t n)
{
    jlist *s = jlist_new(a, n);
    if (s) {
        if (n) memcpy(s->v, l.u.l->v, n * sizeof *s->v);
        s->n = n;
    }
    jv v = {.kind = s ? JV_LIST : JV_UNDEF};
    v.u.l = s;
    return v;
}

static int is_assistant(jv m)
{
    const jv *role = jdict_get_str(m.u.d, "role");
    return role && role->kind == JV_STR && !strcmp(role->u.s->s, "assistant");
}

static td_status push_span(td_chat_record *r, size_t *cap, size_t b, size_t e)
{
    if (e <= b) return TD_OK;
    if (r->n_spans && r->spans[2 * r->n_spans - 1] == b) { /* adjacent: one span */
        r->spans[2 * r->n_spans - 1] = e;
        return TD_OK;
    }
    if (r->n_spans == *cap) {
        size_t nc = *cap ? 2 * *cap : 8;
        size_t *s = td_malloc(2 * nc * sizeof *s, TD_ROLE_META);
        if (!s) return td_error_set(TD_ERR_NOMEM, "out of memory");
        if (r->n_spans) memcpy(s, r->spans, 2 * r->n_spans * sizeof *s);
        td_free(r->spans);
        r->spans = s;
        *cap = nc;
    }
    r->spans[2 * r->n_spans] = b;
    r->spans[2 * r->n_spans + 1] = e;
    r->n_spans++;
    return TD_OK;
}

static td_status set_text(td_chat_record *r, const char *a, size_t alen, const char *b, size_t blen)
{
    r->text = td_malloc(alen + blen + 1, TD_ROLE_META);
    if (!r->text) return td_error_set(TD_ERR_NOMEM, "out of memory");
    if (alen) memcpy(r->text, a, alen);
    if (blen) memcpy(r->text + alen, b, blen);
    r->text[alen + blen] = '\0';
    r->len = alen + blen;
    return TD_OK;
}

/* msgs[0, n) with message j's "content" replaced by s. */
static jv with_content(jarena *a, jv msgs, size_t n, size_t j, const char *s)
{
    jv l = sublist(a, msgs, n), v = {.kind = JV_DICT};
    const jdict *src = msgs.u.l->v[j].u.d;
    jdict *d = l.kind == JV_LIST ? jdict_new(a, src->n + 1) : NULL;
    if (!d) return jv_undef(NULL);
    for (size_t k = 0; k < src->n; k++)
        if (jdict_set(a, d, src->k[k], src->v[k])) return jv_undef(NULL);
    if (jdict_set(a, d, key(a, "content"), jv_strv(jstr_new(a, s, strlen(s))))) return jv_undef(NULL);
    v.u.d = d;
    l.u.l->v[j] = v;
    return l;
}

static size_t common_suffix(const jbuf *x, const jbuf *y)
{
    size_t k = 0;
    while (k < x->n && k < y->n && x->p[x->n - 1 - k] == y->p[y->n - 1 - k]) k++;
    return k;
}

/* Where what message j's text decides ends in r, the rendering of msgs[0, n):
 * r less the end it shares with renderings that hold one of two sentinels
 * (their last bytes differ) in place of that text. */
static td_status content_end(const td_chat_template *t, jarena *a, jdict *vars, jv msgs, size_t n, size_t j, int gen,
                             const jbuf *r, size_t *end)
{
    static const char *const SENTINEL[2] = {"\x7ftidal-sentinel\x01", "\x7ftidal-sentinel\x02"};
    size_t shared = r->n;
    for (int k = 0; k < 2; k++) {
        jv l = with_content(a, msgs, n, j, SENTINEL[k]);
        jdict *c = l.kind == JV_LIST ? context(t, a, vars, l, gen) : NULL;
        if (!c) return td_error_set(TD_ERR_NOMEM, "out of memory");
        jbuf other;
        td_status st = render(t, a, c, &other);
        if (st) return st;
        size_t s = common_suffix(r, &other);
        if (s < shared) shared = s;
    }
    *end = r->n - shared;
    return TD_OK;
}

/* Assistant message i where the rendering up to it is not the start of the
 * whole (Mistral v0.3 puts the system message in the last user message and
 * the tools before it): anchored at the end of the text of message i - 1,
 * found by sentinels in before (msgs[0, i) with the generation prompt), with
 * (msgs[0, i + 1)) and full.  What before holds after that text (the end of
 * message i - 1, the generation prompt) must follow it in with and in full;
 * what with holds after that, message i as the last one, must follow in full,
 * and is its span.  1 where the template does not render them so. */
static int span_by_anchor(const td_chat_template *t, jarena *a, jdict *vars, jv msgs, size_t i, const jbuf *before,
                          const jbuf *with, const jbuf *full, size_t *b, size_t *e)
{
    if (i == 0) return 1;
    const jv *prev = jdict_get_str(msgs.u.l->v[i - 1].u.d, "content");
    if (!prev || prev->kind != JV_STR) return 1;
    size_t eb, ew, ef;
    if (content_end(t, a, vars, msgs, i, i - 1, 1, before, &eb) || content_end(t, a, vars, msgs, i + 1, i - 1, 0, with, &ew) ||
        content_end(t, a, vars, msgs, msgs.u.l->n, i - 1, 0, full, &ef))
        return 1;
    size_t lt = before->n - eb;
    if (ew + lt > with->n || ef + lt > full->n || (lt && (memcmp(with->p + ew, before->p + eb, lt) ||
                                                          memcmp(full->p + ef, before->p + eb, lt))))
        return 1;
    size_t le = with->n - ew - lt;
    if (ef + lt + le > full->n || (le && memcmp(full->p + ef + lt, with->p + ew + lt, le))) return 1;
    *b = ef + lt;
    *e = ef + lt + le;
    return 0;
}

/* A conversation: the full text, and the span of each assistant message
 * that counts: what the rendering up to it with the generation prompt
 * leaves of the rendering up to and with it, when those are the start of
 * the whole, else found by span_by_anchor. */
static td_status parse_chat(const td_chat_template *t, jarena *a, jv rec, jv msgs, td_loss_on loss_on,
                            td_chat_record *r, td_record_error *why)
{
    td_status st = TD_OK;
    size_t cap = 0;
    jdict *vars = jdict_new(a, 2);
    const jv *tools = jdict_get_str(rec.u.d, "tools");
    if (!vars) return td_error_set(TD_ERR_NOMEM, "out of memory");
    if (tools && jdict_set(a, vars, key(a, "tools"), *tools)) return td_error_set(TD_ERR_NOMEM, "out of memory");
    jbuf full;
    jdict *ctx = context(t, a, vars, msgs, 0);
    if (!ctx) return td_error_set(TD_ERR_NOMEM, "out of memory");
    if ((st = render(t, a, ctx, &full))) {
        *why = TD_RECORD_TEMPLATE;
        return st;
    }
    r->kind = TD_RECORD_CHAT;
    TD_TRY(set_text(r, full.p ? full.p : "", full.n, NULL, 0));
    if (loss_on == TD_LOSS_ALL) return push_span(r, &cap, 0, r->len);
    size_t n = msgs.u.l->n, last = n;
    for (size_t i = 0; i < n; i++)
        if (is_assistant(msgs.u.l->v[i])) last = i;
    for (size_t i = 0; i < n; i++) {
        if (!is_assistant(msgs.u.l->v[i]) || (loss_on == TD_LOSS_COMPLETION && i != last)) continue;
        jbuf before, with;
        jdict *c1 = context(t, a, vars, sublist(a, msgs, i), 1), *c2 = context(t, a, vars, sublist(a, msgs, i + 1), 0);
        if (!c1 || !c2) TD_FAIL(TD_ERR_NOMEM, "out of memory");
        if ((st = render(t, a, c1, &before)) || (st = render(t, a, c2, &with))) {
            *why = TD_RECORD_TEMPLATE;
            goto cleanup;
        }
        size_t b = before.n, e = with.n, done = r->n_spans ? r->spans[2 * r->n_spans - 1] : 0;
        if (((before.n > with.n || with.n > full.n || (before.n && memcmp(before.p, with.p, before.n)) ||
              (with.n && memcmp(with.p, full.p, with.n))) &&
             span_by_anchor(t, a, vars, msgs, i, &before, &with, &full, &b, &e)) ||
            b < done) { /* or it reaches back into the answer before */
            *why = TD_RECORD_TEMPLATE;
            TD_FAIL(TD_ERR_INVALID, "the chat template renders the conversation up to message %zu neither as the "
                    "start of the whole nor with that message as it is in the whole after message %zu's text, so the "
                    "tokens of its answer cannot be told apart; use --loss-on all", i + 1, i);
        }
        TD_TRY(push_span(r, &cap, b, e));
    }
cleanup:
    return st;
}

td_status td_chat_record_parse(const char *line, size_t len, const td_chat_template *t, td_loss_on loss_on,
                               td_chat_record *out, td_record_error *why)
{
    td_status st = TD_OK;
    jarena a = {.limit_bytes = RENDER_LIMIT_BYTES};
    char err[256];
    size_t cap = 0;
    jv rec;
    memset(out, 0, sizeof *out);
    *why = TD_RECORD_OK;
    if (jv_from_json(&a, line, len, &rec, err, sizeof err)) {
        *why = TD_RECORD_BAD_JSON;
        TD_FAIL(TD_ERR_INVALID, "not JSON: %s", err);
    }
    if (rec.kind != JV_DICT) {
        *why = TD_RECORD_BAD_FIELDS;
        TD_FAIL(TD_ERR_INVALID, "a record must be a JSON object, not %s", jv_type_name(rec));
    }
    const jv *text = jdict_get_str(rec.u.d, "text"), *prompt = jdict_get_str(rec.u.d, "prompt"),
             *completion = jdict_get_str(rec.u.d, "completion"), *msgs = jdict_get_str(rec.u.d, "messages");
    int kinds = !!text + !!(prompt || completion) + !!msgs;
    if (kinds != 1) {
        *why = TD_RECORD_BAD_FIELDS;
        TD_FAIL(TD_ERR_INVALID, kinds ? "a record holds one of \"text\", \"prompt\" + \"completion\" or "
                "\"messages\", not several" : "a record needs \"text\", \"prompt\" and \"completion\", or \"messages\"");
    }
    if (msgs) {
        if ((st = check_messages(*msgs, why))) goto cleanup;
        const jv *tools = jdict_get_str(rec.u.d, "tools");
        if (tools && tools->kind != JV_LIST && tools->kind != JV_NONE) {
            *why = TD_RECORD_BAD_FIELDS;
            TD_FAIL(TD_ERR_INVALID, "\"tools\" must be a list");
        }
        if (!t) {
            *why = TD_RECORD_NO_TEMPLATE;
            TD_FAIL(TD_ERR_INVALID, "a conversation needs a chat template (give --chat-template, or a --tokenizer "
                    "folder whose tokenizer_config.json has one)");
        }
        st = parse_chat(t, &a, rec, *msgs, loss_on, out, why);
        goto cleanup;
    }
    out->framed = 1;
    if (text) {
        if (text->kind != JV_STR) {
            *why = TD_RECORD_BAD_FIELDS;
            TD_FAIL(TD_ERR_INVALID, "\"text\" must be a string");
        }
        out->kind = TD_RECORD_TEXT;
        TD_TRY(set_text(out, text->u.s->s, text->u.s->len, NULL, 0));
        TD_TRY(push_span(out, &cap, 0, out->len));
        goto cleanup;
    }
    if (!prompt || !completion || prompt->kind != JV_STR || completion->kind != JV_STR) {
        *why = TD_RECORD_BAD_FIELDS;
        TD_FAIL(TD_ERR_INVALID, !prompt ? "a record with \"completion\" needs \"prompt\""
                : !completion ? "a record with \"prompt\" needs \"completion\""
                              : "\"prompt\" and \"completion\" must be strings");
    }
    out->kind = TD_RECORD_PROMPT;
    TD_TRY(set_text(out, prompt->u.s->s, prompt->u.s->len, completion->u.s->s, completion->u.s->len));
    TD_TRY(push_span(out, &cap, loss_on == TD_LOSS_ALL ? 0 : prompt->u.s->len, out->len));
cleanup:
    jarena_free(&a);
    if (st) td_chat_record_free(out);
    return st;
}

void td_chat_record_free(td_chat_record *r)
{
    if (!r) return;
    td_free(r->text);
    td_free(r->spans);
    memset(r, 0, sizeof *r);
}

/* ---- tokens ---------------------------------------------------------------------- */

static int in_spans(const td_chat_record *r, size_t at)
{
    for (size_t k = 0; k < r->n_spans; k++)
        if (at >= r->spans[2 * k] && at < r->spans[2 * k + 1]) return 1;
    return 0;
}

/* Marks ids[0, n) by the byte each starts at, when the tokens' bytes spell
 * the text exactly; 0, or 1 when they do not (normalisation, stripped
 * whitespace). */
static int mark_by_bytes(const td_tokenizer *tok, const td_chat_record *r, const uint32_t *ids, size_t n, uint8_t *counted)
{
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        size_t len;
        const char *b = td_tokenizer_token_bytes(tok, ids[i], &len);
        if (!b || at + len > r->len || memcmp(r->text + at, b, len)) return 1;
        counted[i] = (uint8_t)in_spans(r, at);
        at += len;
    }
    return at == r->len ? 0 : 1;
}

td_status td_chat_record_encode(td_tokenizer *tok, const td_chat_record *r, uint32_t **ids_out, uint8_t **counted_out,
                                size_t *n_out)
{
    td_status st = TD_OK;
    uint32_t *ids = NULL, *whole = NULL, *part = NULL;
    uint8_t *counted = NULL;
    size_t n = 0, nw = 0;
    *ids_out = NULL;
    *counted_out = NULL;
    *n_out = 0;
    TD_TRY(td_tokenizer_encode_alloc(tok, r->text, r->len, &whole, &nw));
    const uint32_t bos = r->framed ? td_tokenizer_bos(tok) : TD_TOKEN_NONE;
    const size_t extra = (bos != TD_TOKEN_NONE) + (r->framed != 0);
    ids = td_malloc((nw + extra + 1) * sizeof *ids, TD_ROLE_META);
    counted = td_calloc(nw + extra + 1, 1, TD_ROLE_META);
    if (!ids || !counted) TD_FAIL(TD_ERR_NOMEM, "out of memory encoding a record of %zu bytes", r->len);
    if (bos != TD_TOKEN_NONE) ids[n++] = bos; /* nothing predicts the first token: never counted */
    if (nw) memcpy(ids + n, whole, nw * sizeof *ids);
    if (mark_by_bytes(tok, r, whole, nw, counted + n)) {
        /* The tokens do not spell the text (NFC, an added token that strips
         * whitespace): encode the pieces between span edges on their own;
         * where they give the same tokens as the whole, the pieces tell
         * which tokens count. */
        size_t at = 0, k = 0, cut[130];
        int ncut = 0;
        for (size_t s = 0; s < r->n_spans && ncut < 128; s++) cut[ncut++] = r->spans[2 * s], cut[ncut++] = r->spans[2 * s + 1];
        cut[ncut++] = r->len;
        for (int c = 0; c < ncut; c++) {
            if (cut[c] <= at) continue;
            size_t np;
            TD_TRY(td_tokenizer_encode_alloc(tok, r->text + at, cut[c] - at, &part, &np));
            if (k + np > nw || (np && memcmp(part, whole + k, np * sizeof *part)))
                TD_FAIL(TD_ERR_INVALID, "the tokens of this record cross the edge of an answer (at byte %zu), so which "
                        "of them count is not clear; use --loss-on all", at);
            for (size_t i = 0; i < np; i++) counted[n + k + i] = (uint8_t)in_spans(r, at);
            k += np;
            at = cut[c];
            td_free(part);
            part = NULL;
        }
        if (k != nw) TD_FAIL(TD_ERR_INVALID, "the record's tokens do not add up to its text");
    }
    n += nw;
    if (r->framed) { /* end of text, counted when the last span reaches the end */
        ids[n] = td_tokenizer_eot(tok);
        counted[n++] = (uint8_t)(r->n_spans && r->spans[2 * r->n_spans - 1] == r->len);
    }
    *ids_out = ids;
    *counted_out = counted;
    *n_out = n;
    ids = NULL;
    counted = NULL;
cleanup:
    td_free(ids);
    td_free(counted);
    td_free(whole);
    td_free(part);
    return st;
}
