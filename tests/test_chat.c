/* Chat templates and fine-tuning records (include/tidal/chat.h):
 *   - the real chat templates of Llama 3.1 and 3.2, Qwen2.5, Mistral v0.1
 *     and v0.3, SmolLM2, Gemma 2 and 3 (the .jinja files of tests/data/chat) render 662
 *     conversations (system or not, one to four turns, tools and tool
 *     calls, empty and unicode content, content parts) exactly as jinja2 in
 *     transformers' environment renders them, and refuse the ones their
 *     template refuses with the same message; 20 more templates check the
 *     constructs one by one (slicing, tests, arithmetic, float printing,
 *     tojson, filters, loops, scoping, whitespace control, CRLF, strftime):
 *     tests/data/chat/cases.jsonl, written by gen_chat_fixtures.py with jinja2;
 *   - unsupported constructs fail at load time naming the construct, its
 *     line and column; malformed templates never crash;
 *   - records: each shape, the spans that count under all / completion /
 *     assistant (also where the rendering up to an answer is not the start
 *     of the whole, as Mistral v0.3's), and each bad input's message;
 *   - tokens: the loss mask of a record follows its spans, framed records
 *     get begin and end of text; with a normalizing (NFC) tokenizer the
 *     counted tokens are still exactly the answers. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "td_test.h"
#include "tidal/chat.h"
#include "tidal/tokenizer.h"

#define CHAT_DIR "tests/data/chat/"
#define CLOCK 1736942400 /* gen_chat_fixtures.py's: 2025-01-15 12:00:00 UTC */

static int setup(void **state)
{
    (void)state;
    setenv("TZ", "UTC", 1); /* strftime_now reads local time; the fixtures were made in UTC */
    tzset();
    return 0;
}

/* ---- the fixtures ---------------------------------------------------------- */

typedef struct fixture_stats { int cases, errors, failed; } fixture_stats;

static void check_case(cJSON *c, void *ctx)
{
    fixture_stats *S = ctx;
    const cJSON *tmpl = cJSON_GetObjectItem(c, "template"), *source = cJSON_GetObjectItem(c, "source");
    const cJSON *cfg = cJSON_GetObjectItem(c, "config_json"), *vars = cJSON_GetObjectItem(c, "context_json");
    const cJSON *gen = cJSON_GetObjectItem(c, "add_generation_prompt"), *want = cJSON_GetObjectItem(c, "expected");
    const cJSON *err = cJSON_GetObjectItem(c, "error");
    char *src = NULL;
    size_t src_len;
    if (cJSON_IsString(tmpl)) {
        char path[512];
        snprintf(path, sizeof path, CHAT_DIR "%s", tmpl->valuestring);
        src = td_test_slurp(path, &src_len);
    } else {
        src = strdup(source->valuestring);
        src_len = strlen(src);
    }
    td_chat_template *t = NULL;
    const char *name = cJSON_IsString(tmpl) ? tmpl->valuestring : "expression";
    TD_ASSERT_OK(td_chat_template_create(src, src_len, cfg ? cfg->valuestring : NULL, cfg ? strlen(cfg->valuestring) : 0,
                                         name, &t));
    td_chat_template_set_clock(t, CLOCK);
    char *out = NULL;
    size_t len = 0;
    td_status st = td_chat_template_render(t, vars->valuestring, strlen(vars->valuestring), cJSON_IsTrue(gen), &out, &len);
    S->cases++;
    if (err) {
        S->errors++;
        if (st != TD_ERR_INVALID || !strstr(td_error_msg(), err->valuestring)) {
            S->failed++;
            print_error("%s on %s: expected the error '%s', got %s: %s\n", name, vars->valuestring, err->valuestring,
                        td_status_name(st), st ? td_error_msg() : out);
        }
    } else if (st != TD_OK || len != strlen(want->valuestring) || memcmp(out, want->valuestring, len)) {
        S->failed++;
        if (S->failed <= 5)
            print_error("%s (generation prompt %d) on %s:\nexpected: [%s]\n     got: [%s]\n", name, cJSON_IsTrue(gen),
                        vars->valuestring, want->valuestring, st ? td_error_msg() : out);
    }
    td_free(out);
    td_chat_template_free(t);
    free(src);
}

static void test_templates_match_jinja2(void **state)
{
    (void)state;
    fixture_stats S = {0};
    td_test_for_each_jsonl(CHAT_DIR "cases.jsonl", check_case, &S);
    printf("  %d cases (%d refused by their template), %d differ from jinja2\n", S.cases, S.errors, S.failed);
    assert_int_equal(S.failed, 0);
    assert_true(S.cases >= 600);
    assert_true(S.errors >= 10);
}

/* ---- errors ------------------------------------------------------------------ */

static void expect_load_error(const char *src, const char *needle)
{
    td_chat_template *t = NULL;
    td_status st = td_chat_template_create(src, strlen(src), NULL, 0, "t.jinja", &t);
    if (st == TD_OK) {
        td_chat_template_free(t);
        fail_msg("'%s' loaded; expected an error with '%s'", src, needle);
    }
    assert_int_equal(st, TD_ERR_INVALID);
    if (!strstr(td_error_msg(), needle)) fail_msg("'%s': expected '%s' in: %s", src, needle, td_error_msg());
}

static void expect_render_error(const char *src, const char *vars, const char *needle)
{
    td_chat_template *t = NULL;
    TD_ASSERT_OK(td_chat_template_create(src, strlen(src), NULL, 0, "t.jinja", &t));
    char *out = NULL;
    td_status st = td_chat_template_render(t, vars, strlen(vars), 0, &out, NULL);
    td_chat_template_free(t);
    if (st == TD_OK) {
        td_free(out);
        fail_msg("'%s' rendered; expected an error with '%s'", src, needle);
    }
    if (!strstr(td_error_msg(), needle)) fail_msg("'%s': expected '%s' in: %s", src, needle, td_error_msg());
}

static void test_unsupported_constructs_are_named(void **state)
{
    (void)state;
    expect_load_error("ab\n  {% macro m() %}x{% endmacro %}", "line 2, column 6: the tag '{% macro %}' is not supported");
    expect_load_error("{{ x | wordcount }}", "line 1, column 8: the filter 'wordcount' is not supported");
    expect_load_error("{{ x is lower_than(3) }}", "the test 'lower_than' is not supported");
    expect_load_error("{% include 'x' %}", "'{% include %}' is not supported");
    expect_load_error("{% for x in y recursive %}{% endfor %}", "recursive for loops are not supported");
    expect_load_error("{% set x | upper %}a{% endset %}", "filters on a {% set %} block are not supported");
    expect_load_error("{{ f(*args) }}", "*args and **kwargs in a call are not supported");
    expect_load_error("{{ x[1, 2] }}", "subscripts with a comma");
    expect_load_error("{% if x %}", "line 1, column 4: '{% if %}' is never closed (expected '{% endif %}')");
    expect_load_error("{% for x in y %}{% endif %}", "unexpected '{% endif %}'");
    expect_load_error("{{ x ", "'{{' is never closed");
    expect_load_error("{{ 'abc }}", "unterminated string");
    expect_load_error("{# x", "comment '{#' is never closed");
    expect_load_error("{{ (1 + 2 }}", "unexpected '}', expected ')'");
    expect_load_error("{{ 1 + }}", "expected an expression, found '}}'");
    expect_load_error("{% break %}", "'break' outside of a for loop");
    expect_load_error("{% frobnicate %}", "unknown tag 'frobnicate'");
    expect_load_error("{{ x $ y }}", "unexpected character '$'");
    expect_load_error("{{ 99999999999999999999 }}", "outside the 64-bit range");
    expect_render_error("{{ raise_exception('no ' ~ 'way') }}", "{}", "refused it, line 1, column 4: no way");
    expect_render_error("{{ messages[0].role }}", "{\"messages\": []}", "list index out of range");
    expect_render_error("{{ x.y.z }}", "{\"x\": {}}", "'dict object' has no attribute 'y'");
    expect_render_error("{{ 'a' + 1 }}", "{}", "can only concatenate str (not \"int\") to str");
    expect_render_error("{{ 1 // 0 }}", "{}", "integer division or modulo by zero");
    expect_render_error("{{ nope | tojson }}", "{}", "'nope' is undefined");
    expect_render_error("{{ 'x'.format(1) }}", "{}", "str.format is not supported");
    expect_render_error("{{ d.update({}) }}", "{\"d\": {}}", "would change a value");
    expect_render_error("{{ 5 | length }}", "{}", "object of type 'int' has no len()");
    expect_render_error("{% for x in 3 %}{% endfor %}", "{}", "'int' object is not iterable");
    expect_render_error("{{ range(1000000) | length }}", "{}", "range() of more than 100000 items");
    expect_render_error("{% set n = 1 %}{% set n.x = 2 %}", "{}", "cannot assign attribute on non-namespace object");
    expect_render_error("{% for a, b in [[1, 2, 3]] %}{% endfor %}", "{}", "too many values to unpack");
}

/* Truncations and byte changes of a real template load or fail cleanly, and
 * whatever loads renders or fails cleanly. */
static void test_damaged_templates_never_crash(void **state)
{
    (void)state;
    size_t len;
    char *src = td_test_slurp(CHAT_DIR "mistral-v0.3.jinja", &len);
    const char *vars = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": []}";
    td_rng rng;
    td_rng_seed(&rng, 7);
    int loaded = 0, tried = 0;
    for (size_t cut = 0; cut <= len; cut += 1 + cut / 8) {
        for (int k = 0; k < 4; k++) {
            char *s = malloc(len + 1);
            memcpy(s, src, len);
            size_t n = cut;
            if (k && n) s[td_rng_below(&rng, n)] = "{}%#-|.()'\"x \n"[td_rng_below(&rng, 14)];
            td_chat_template *t = NULL;
            tried++;
            if (td_chat_template_create(s, n, NULL, 0, "damaged", &t) == TD_OK) {
                loaded++;
                char *out = NULL;
                if (td_chat_template_render(t, vars, strlen(vars), 1, &out, NULL) == TD_OK) td_free(out);
                td_chat_template_free(t);
            }
            free(s);
        }
    }
    printf("  %d damaged templates: %d loaded\n", tried, loaded);
    assert_true(loaded > 0 && loaded < tried);
    free(src);
}

/* ---- loading from files --------------------------------------------------------- */

static void test_load_from_tokenizer_config(void **state)
{
    (void)state;
    char dir[] = "/tmp/td_chat_XXXXXX", path[256];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    FILE *f = fopen(path, "w");
    fprintf(f, "{\"bos_token\": {\"content\": \"<B>\", \"lstrip\": false}, \"eos_token\": \"<E>\", \"pad_token\": null,"
               " \"chat_template\": [{\"name\": \"tool_use\", \"template\": \"no\"},"
               " {\"name\": \"default\", \"template\": \"{{ bos_token }}{{ messages[0].content }}{{ eos_token }}\"}]}");
    fclose(f);
    td_chat_template *t;
    TD_ASSERT_OK(td_chat_template_load(dir, &t));
    assert_string_equal(td_chat_template_token(t, "bos_token"), "<B>");
    assert_null(td_chat_template_token(t, "pad_token"));
    char *out;
    const char *vars = "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}";
    TD_ASSERT_OK(td_chat_template_render(t, vars, strlen(vars), 0, &out, NULL));
    assert_string_equal(out, "<B>x<E>");
    td_free(out);
    td_chat_template_free(t);
    /* a chat_template.jinja beside it wins */
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    f = fopen(path, "w");
    fprintf(f, "[{{ bos_token }}]\n");
    fclose(f);
    TD_ASSERT_OK(td_chat_template_load(dir, &t));
    TD_ASSERT_OK(td_chat_template_render(t, vars, strlen(vars), 0, &out, NULL));
    assert_string_equal(out, "[<B>]");
    td_free(out);
    td_chat_template_free(t);
    /* a base model's config has no template */
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    f = fopen(path, "w");
    fprintf(f, "{\"eos_token\": \"<E>\"}");
    fclose(f);
    assert_int_equal(td_chat_template_load(path, &t), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "has no \"chat_template\""));
    assert_int_equal(td_chat_template_load("/nonexistent/x", &t), TD_ERR_IO);
    remove(path);
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    remove(path);
    rmdir(dir);
}

/* ---- records ---------------------------------------------------------------------- */

static td_chat_template *qwen(void)
{
    size_t len;
    char *src = td_test_slurp(CHAT_DIR "qwen2.5.jinja", &len);
    const char *cfg = "{\"eos_token\": \"<|im_end|>\"}";
    td_chat_template *t;
    TD_ASSERT_OK(td_chat_template_create(src, len, cfg, strlen(cfg), "qwen2.5.jinja", &t));
    free(src);
    return t;
}

static char *span_text(const td_chat_record *r, size_t k)
{
    size_t b = r->spans[2 * k], e = r->spans[2 * k + 1];
    char *s = malloc(e - b + 1);
    memcpy(s, r->text + b, e - b);
    s[e - b] = '\0';
    return s;
}

static void expect_spans(const td_chat_template *t, const char *line, td_loss_on on, int n, const char *const *want)
{
    td_chat_record r;
    td_record_error why;
    TD_ASSERT_OK(td_chat_record_parse(line, strlen(line), t, on, &r, &why));
    assert_int_equal(why, TD_RECORD_OK);
    if ((int)r.n_spans != n) fail_msg("%s: %zu spans, expected %d", line, r.n_spans, n);
    for (int k = 0; k < n; k++) {
        char *s = span_text(&r, (size_t)k);
        if (strcmp(s, want[k])) fail_msg("%s: span %d is [%s], expected [%s]", line, k, s, want[k]);
        free(s);
    }
    td_chat_record_free(&r);
}

static void test_record_spans(void **state)
{
    (void)state;
    td_chat_template *t = qwen();
    const char *chat = "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"Q1\"},"
                       " {\"role\": \"assistant\", \"content\": \"A1\"}, {\"role\": \"user\", \"content\": \"Q2\"},"
                       " {\"role\": \"assistant\", \"content\": \"\"}], \"id\": 7}";
    const char *both[] = {"A1<|im_end|>\n", "<|im_end|>\n"};
    expect_spans(t, chat, TD_LOSS_ASSISTANT, 2, both);
    expect_spans(t, chat, TD_LOSS_COMPLETION, 1, both + 1);
    const char *whole[] = {"<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1"
                           "<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"};
    expect_spans(t, chat, TD_LOSS_ALL, 1, whole);
    const char *pc = "{\"prompt\": \"2+2=\", \"completion\": \" 4\"}", *four[] = {" 4"}, *all_pc[] = {"2+2= 4"};
    expect_spans(t, pc, TD_LOSS_ASSISTANT, 1, four);
    expect_spans(t, pc, TD_LOSS_COMPLETION, 1, four);
    expect_spans(t, pc, TD_LOSS_ALL, 1, all_pc);
    const char *txt = "{\"text\": \"plain é\"}", *plain[] = {"plain é"};
    expect_spans(t, txt, TD_LOSS_ASSISTANT, 1, plain);
    /* no assistant message: nothing counts */
    expect_spans(t, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", TD_LOSS_ASSISTANT, 0, NULL);
    td_chat_template_free(t);
}

static td_chat_template *template_file(const char *file, const char *cfg)
{
    size_t len;
    char path[256];
    snprintf(path, sizeof path, CHAT_DIR "%s", file);
    char *src = td_test_slurp(path, &len);
    td_chat_template *t;
    TD_ASSERT_OK(td_chat_template_create(src, len, cfg, cfg ? strlen(cfg) : 0, file, &t));
    free(src);
    return t;
}

/* Mistral v0.3 puts the system message into the last user message and the
 * tools before it, so the rendering up to an answer is not the start of the
 * whole: each answer is found after the text of the message before it. */
static void test_record_spans_mistral_v03(void **state)
{
    (void)state;
    td_chat_template *t = template_file("mistral-v0.3.jinja", "{\"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}");
    const char *chat =
        "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"Q1\"},"
        " {\"role\": \"assistant\", \"content\": \" A1 \"}, {\"role\": \"user\", \"content\": \"Q2\"},"
        " {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"abc123xyz\", \"type\": \"function\","
        " \"function\": {\"name\": \"f\", \"arguments\": {\"x\": 1}}}]},"
        " {\"role\": \"tool\", \"tool_call_id\": \"abc123xyz\", \"content\": \"Q1\"}, {\"role\": \"assistant\", \"content\": \"A2\"},"
        " {\"role\": \"user\", \"content\": \"Q3\"}, {\"role\": \"assistant\", \"content\": \"\"}],"
        " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": \"d\"}}]}";
    const char *spans[] = {" A1</s>", "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"x\": 1}, \"id\": \"abc123xyz\"}]</s>",
                           " A2</s>", " </s>"};
    expect_spans(t, chat, TD_LOSS_ASSISTANT, 4, spans);
    expect_spans(t, chat, TD_LOSS_COMPLETION, 1, spans + 3);
    /* the system message shows when the last message is the user's */
    const char *sys = "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"Q1\"},"
                      " {\"role\": \"assistant\", \"content\": \"A1\"}, {\"role\": \"user\", \"content\": \"Q2\"}]}";
    td_chat_record r;
    td_record_error why;
    TD_ASSERT_OK(td_chat_record_parse(sys, strlen(sys), t, TD_LOSS_ASSISTANT, &r, &why));
    assert_string_equal(r.text, "<s>[INST] Q1[/INST] A1</s>[INST] S\n\nQ2[/INST]");
    td_chat_record_free(&r);
    const char *a1[] = {" A1</s>"};
    expect_spans(t, sys, TD_LOSS_ASSISTANT, 1, a1);
    td_chat_template_free(t);
    /* a template that renders an answer one way when it is the last message
     * and another way before others: no exact span, refused */
    const char *src = "{% for m in messages %}{% if loop.last %}[{{ m.content }}]{% else %}{{ m.content }}{% endif %}"
                      "{% endfor %}";
    TD_ASSERT_OK(td_chat_template_create(src, strlen(src), NULL, 0, "last.jinja", &t));
    const char *two = "{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", \"content\": \"A\"},"
                      " {\"role\": \"user\", \"content\": \"R\"}]}";
    TD_ASSERT_OK(td_chat_record_parse(two, strlen(two), t, TD_LOSS_ALL, &r, &why));
    td_chat_record_free(&r);
    assert_int_equal(td_chat_record_parse(two, strlen(two), t, TD_LOSS_ASSISTANT, &r, &why), TD_ERR_INVALID);
    assert_int_equal(why, TD_RECORD_TEMPLATE);
    assert_non_null(strstr(td_error_msg(), "message 2 neither as the start of the whole nor"));
    assert_non_null(strstr(td_error_msg(), "use --loss-on all"));
    assert_null(r.text);
    td_chat_template_free(t);
}

static void expect_bad(const td_chat_template *t, const char *line, td_record_error kind, const char *needle)
{
    td_chat_record r;
    td_record_error why;
    td_status st = td_chat_record_parse(line, strlen(line), t, TD_LOSS_ASSISTANT, &r, &why);
    if (st == TD_OK) fail_msg("%s: parsed; expected '%s'", line, needle);
    assert_int_equal(st, TD_ERR_INVALID);
    if (why != kind) fail_msg("%s: refused as kind %d, expected %d (%s)", line, why, kind, td_error_msg());
    if (!strstr(td_error_msg(), needle)) fail_msg("%s: expected '%s' in: %s", line, needle, td_error_msg());
    assert_null(r.text);
}

static void test_bad_records(void **state)
{
    (void)state;
    td_chat_template *t = qwen();
    expect_bad(t, "{\"text\": \"x\"", TD_RECORD_BAD_JSON, "not JSON: expected ',' or '}' at byte 12");
    expect_bad(t, "{\"text\": \"x\"} {}", TD_RECORD_BAD_JSON, "extra data");
    expect_bad(t, "", TD_RECORD_BAD_JSON, "expected a value");
    expect_bad(t, "[1]", TD_RECORD_BAD_FIELDS, "a record must be a JSON object, not list");
    expect_bad(t, "{\"txt\": \"x\"}", TD_RECORD_BAD_FIELDS, "needs \"text\", \"prompt\" and \"completion\", or \"messages\"");
    expect_bad(t, "{\"text\": \"x\", \"messages\": []}", TD_RECORD_BAD_FIELDS, "not several");
    expect_bad(t, "{\"text\": 5}", TD_RECORD_BAD_FIELDS, "\"text\" must be a string");
    expect_bad(t, "{\"prompt\": \"x\"}", TD_RECORD_BAD_FIELDS, "needs \"completion\"");
    expect_bad(t, "{\"completion\": \"x\"}", TD_RECORD_BAD_FIELDS, "needs \"prompt\"");
    expect_bad(t, "{\"messages\": {}}", TD_RECORD_BAD_FIELDS, "must be a list of messages");
    expect_bad(t, "{\"messages\": []}", TD_RECORD_BAD_FIELDS, "\"messages\" is empty");
    expect_bad(t, "{\"messages\": [{\"role\": \"bot\", \"content\": \"x\"}]}", TD_RECORD_BAD_FIELDS,
               "message 1 has the unknown role 'bot'");
    expect_bad(t, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"user\"}]}", TD_RECORD_BAD_FIELDS,
               "message 2 has no \"content\"");
    expect_bad(t, "{\"messages\": [{\"content\": \"x\"}]}", TD_RECORD_BAD_FIELDS, "message 1 has no \"role\"");
    expect_bad(t, "{\"messages\": [{\"role\": \"user\", \"content\": null}]}", TD_RECORD_BAD_FIELDS,
               "null only beside tool_calls");
    expect_bad(t, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": 3}", TD_RECORD_BAD_FIELDS,
               "\"tools\" must be a list");
    expect_bad(NULL, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", TD_RECORD_NO_TEMPLATE,
               "needs a chat template");
    expect_bad(t, "{\"text\": \"\\ud800\"}", TD_RECORD_BAD_JSON, "half a surrogate pair");
    td_chat_template_free(t);
    /* the template's own refusal */
    size_t len;
    char *src = td_test_slurp(CHAT_DIR "gemma2.jinja", &len);
    TD_ASSERT_OK(td_chat_template_create(src, len, NULL, 0, "gemma2.jinja", &t));
    expect_bad(t, "{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", \"content\": \"u\"}]}",
               TD_RECORD_TEMPLATE, "System role not supported");
    free(src);
    td_chat_template_free(t);
}

/* ---- tokens ---------------------------------------------------------------------- */

static void test_encode_masks(void **state)
{
    (void)state;
    td_tokenizer *tok;
    TD_ASSERT_OK(td_tokenizer_create_byte(&tok));
    td_chat_template *t = qwen();
    const char *chat = "{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", \"content\": \"A\"}]}";
    td_chat_record r;
    td_record_error why;
    TD_ASSERT_OK(td_chat_record_parse(chat, strlen(chat), t, TD_LOSS_ASSISTANT, &r, &why));
    uint32_t *ids;
    uint8_t *counted;
    size_t n;
    TD_ASSERT_OK(td_chat_record_encode(tok, &r, &ids, &counted, &n));
    assert_int_equal(n, r.len); /* bytes, no framing: the template's text alone */
    size_t b = r.spans[0], e = r.spans[1];
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(ids[i], (unsigned char)r.text[i]);
        assert_int_equal(counted[i], i >= b && i < e);
    }
    td_free(ids);
    td_free(counted);
    td_chat_record_free(&r);
    /* a prompt/completion record: end of text after, counted with the completion */
    const char *pc = "{\"prompt\": \"ab\", \"completion\": \"cd\"}";
    TD_ASSERT_OK(td_chat_record_parse(pc, strlen(pc), t, TD_LOSS_COMPLETION, &r, &why));
    TD_ASSERT_OK(td_chat_record_encode(tok, &r, &ids, &counted, &n));
    assert_int_equal(n, 5);
    const uint8_t want[5] = {0, 0, 1, 1, 1};
    for (size_t i = 0; i < n; i++) assert_int_equal(counted[i], want[i]);
    assert_int_equal(ids[4], td_tokenizer_eot(tok));
    td_free(ids);
    td_free(counted);
    td_chat_record_free(&r);
    td_chat_template_free(t);
    td_tokenizer_destroy(tok);
}

/* A byte-level tokenizer.json with Qwen2's NFC normalizer and ChatML's
 * added tokens: ids 0-255 are the bytes, 256 <|im_start|>, 257 <|im_end|>. */
static td_tokenizer *nfc_chatml_tokenizer(void)
{
    cJSON *doc = cJSON_CreateObject(), *model = cJSON_CreateObject(), *vocab = cJSON_CreateObject();
    for (int b = 0, extra = 0; b < 256; b++) { /* GPT-2's byte alphabet */
        int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        unsigned cp = printable ? (unsigned)b : 256u + (unsigned)extra++;
        char u[4] = {0};
        if (cp < 0x80) u[0] = (char)cp;
        else u[0] = (char)(0xC0 | cp >> 6), u[1] = (char)(0x80 | (cp & 0x3F));
        cJSON_AddNumberToObject(vocab, u, b);
    }
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddItemToObject(model, "vocab", vocab);
    cJSON_AddItemToObject(model, "merges", cJSON_CreateArray());
    cJSON_AddItemToObject(doc, "model", model);
    cJSON_AddItemToObject(doc, "added_tokens", cJSON_Parse(
        "[{\"id\": 256, \"content\": \"<|im_start|>\", \"special\": true, \"normalized\": false},"
        " {\"id\": 257, \"content\": \"<|im_end|>\", \"special\": true, \"normalized\": false}]"));
    cJSON_AddItemToObject(doc, "normalizer", cJSON_Parse("{\"type\": \"NFC\"}"));
    cJSON_AddItemToObject(doc, "pre_tokenizer", cJSON_Parse("{\"type\": \"ByteLevel\", \"add_prefix_space\": false, "
                                                            "\"trim_offsets\": true, \"use_regex\": true}"));
    cJSON_AddItemToObject(doc, "decoder", cJSON_Parse("{\"type\": \"ByteLevel\"}"));
    char *text = cJSON_PrintUnformatted(doc);
    td_tokenizer *tok;
    TD_ASSERT_OK(td_tokenizer_create_json(text, strlen(text), "nfc.json", NULL, 0, &tok));
    free(text);
    cJSON_Delete(doc);
    return tok;
}

/* Decodes the tokens whose counted flag is `which`. */
static char *decode_where(const td_tokenizer *tok, const uint32_t *ids, const uint8_t *counted, size_t n, int which)
{
    uint32_t *keep = malloc((n + 1) * sizeof *keep);
    size_t k = 0, len;
    for (size_t i = 0; i < n; i++)
        if (counted[i] == which) keep[k++] = ids[i];
    char *text;
    TD_ASSERT_OK(td_tokenizer_decode(tok, keep, k, &text, &len));
    free(keep);
    return text;
}

/* A tokenizer that normalizes (Qwen2's NFC): the tokens do not spell the
 * rendered text byte for byte, and the counted ones are still exactly the
 * assistant's answers, composed as the tokenizer composes them. */
static void test_encode_masks_nfc(void **state)
{
    (void)state;
    td_tokenizer *tok = nfc_chatml_tokenizer();
    td_chat_template *t = qwen();
    const char *chat = "{\"messages\": [{\"role\": \"user\", \"content\": \"caf\\u00e9 or cafe\\u0301?\"},"
                       " {\"role\": \"assistant\", \"content\": \"\\u00e9 composed vs e\\u0301 decomposed\"},"
                       " {\"role\": \"user\", \"content\": \"e\\u0301\"}, {\"role\": \"assistant\", \"content\": \"o\\u0308k\"}]}";
    td_chat_record r;
    td_record_error why;
    TD_ASSERT_OK(td_chat_record_parse(chat, strlen(chat), t, TD_LOSS_ASSISTANT, &r, &why));
    uint32_t *ids;
    uint8_t *counted;
    size_t n;
    TD_ASSERT_OK(td_chat_record_encode(tok, &r, &ids, &counted, &n));
    char *spoken = decode_where(tok, ids, counted, n, 1), *rest = decode_where(tok, ids, counted, n, 0);
    assert_string_equal(spoken, "\xC3\xA9 composed vs \xC3\xA9 decomposed<|im_end|>\n\xC3\xB6k<|im_end|>\n");
    assert_string_equal(rest, "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                              "<|im_end|>\n<|im_start|>user\ncaf\xC3\xA9 or caf\xC3\xA9?<|im_end|>\n<|im_start|>assistant\n"
                              "<|im_start|>user\n\xC3\xA9<|im_end|>\n<|im_start|>assistant\n");
    td_free(spoken);
    td_free(rest);
    td_free(ids);
    td_free(counted);
    td_chat_record_free(&r);
    td_chat_template_free(t);
    td_tokenizer_destroy(tok);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_templates_match_jinja2),
        cmocka_unit_test(test_unsupported_constructs_are_named),
        cmocka_unit_test(test_damaged_templates_never_crash),
        cmocka_unit_test(test_load_from_tokenizer_config),
        cmocka_unit_test(test_record_spans),
        cmocka_unit_test(test_record_spans_mistral_v03),
        cmocka_unit_test(test_bad_records),
        cmocka_unit_test(test_encode_masks),
        cmocka_unit_test(test_encode_masks_nfc),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
