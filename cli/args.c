/* Command-line and config-file options (see args.h). */
#include "args.h"
#include "tidal/alloc.h"
#include "tidal/family.h"
#include "tidal/util.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static cJSON *config_doc; /* keeps config strings alive */

td_opt *td_args_find(td_opt *opts, const char *name)
{
    for (td_opt *o = opts; o->name; o++)
        if (!strcmp(o->name, name)) return o;
    return NULL;
}

static td_status set_value(td_opt *o, const char *v, const char *origin)
{
    char *end = NULL;
    errno = 0;
    switch (o->kind) {
    case TD_OPT_FLAG:
        if (!strcmp(v, "1") || !strcmp(v, "true")) *(int *)o->dst = 1;
        else if (!strcmp(v, "0") || !strcmp(v, "false")) *(int *)o->dst = 0;
        else goto bad;
        break;
    case TD_OPT_INT: {
        long x = strtol(v, &end, 10);
        if (errno || *end || end == v || x < -2147483647L || x > 2147483647L) goto bad;
        *(int *)o->dst = (int)x;
        break;
    }
    case TD_OPT_LONG: {
        long x = strtol(v, &end, 10);
        if (errno || *end || end == v) goto bad;
        *(long *)o->dst = x;
        break;
    }
    case TD_OPT_U64: {
        if (*v == '-') goto bad;
        unsigned long long x = strtoull(v, &end, 10);
        if (errno || *end || end == v) goto bad;
        *(uint64_t *)o->dst = x;
        break;
    }
    case TD_OPT_DOUBLE: {
        double x = strtod(v, &end);
        if (errno || *end || end == v) goto bad;
        *(double *)o->dst = x;
        break;
    }
    case TD_OPT_BUDGET:
        if (!strcmp(v, "max")) {
            *(size_t *)o->dst = SIZE_MAX;
            break;
        }
        if (td_parse_bytes(v, (size_t *)o->dst) != TD_OK)
            return td_error_prefix(TD_ERR_INVALID, "%s --%s: ", origin, o->name);
        if (*(size_t *)o->dst == 0) /* 0 is not "the default": that is leaving the flag out */
            return td_error_set(TD_ERR_INVALID, "%s --%s: '%s' is no budget; give a size such as 512MiB or 24GiB, "
                                "max for all the free device memory, or leave --%s out for the default", origin,
                                o->name, v, o->name);
        break;
    case TD_OPT_SIZE:
        if (td_parse_bytes(v, (size_t *)o->dst) != TD_OK)
            return td_error_prefix(TD_ERR_INVALID, "%s --%s: ", origin, o->name);
        break;
    case TD_OPT_STRING:
        *(const char **)o->dst = v;
        break;
    case TD_OPT_LIST: {
        td_opt_list *l = o->dst;
        if (o->seen == 2 && strcmp(origin, "option") == 0) l->n = 0; /* the command line replaces the config's */
        if (l->n >= TD_OPT_LIST_MAX)
            return td_error_set(TD_ERR_INVALID, "%s --%s: at most %d given", origin, o->name, TD_OPT_LIST_MAX);
        l->v[l->n++] = v;
        o->seen = strcmp(origin, "option") == 0 ? 1 : 2;
        return TD_OK;
    }
    }
    o->seen = 1;
    return TD_OK;
bad:
    return td_error_set(TD_ERR_INVALID, "%s --%s: '%s' is not a valid %s", origin, o->name, v,
                        o->kind == TD_OPT_DOUBLE ? "number" : o->kind == TD_OPT_FLAG ? "true/false" : "integer");
}

static td_status read_config(td_opt *opts, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return td_error_set(TD_ERR_IO, "--config %s: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = len >= 0 ? malloc((size_t)len + 1) : NULL;
    size_t got = text ? fread(text, 1, (size_t)len, f) : 0;
    fclose(f);
    if (!text || got != (size_t)len) {
        free(text);
        return td_error_set(TD_ERR_IO, "--config %s: cannot read it", path);
    }
    text[len] = '\0';
    cJSON *doc = cJSON_Parse(text);
    free(text);
    if (!doc || !cJSON_IsObject(doc)) {
        cJSON_Delete(doc);
        return td_error_set(TD_ERR_INVALID, "--config %s: not a JSON object", path);
    }
    cJSON_Delete(config_doc);
    config_doc = doc;
    cJSON *item;
    cJSON_ArrayForEach(item, doc) {
        td_opt *o = td_args_find(opts, item->string);
        if (!o || !strcmp(item->string, "config"))
            return td_error_set(TD_ERR_INVALID, "--config %s: unknown key '%s'", path, item->string);
        char num[64];
        const char *v = NULL;
        if (o->kind == TD_OPT_LIST && cJSON_IsArray(item)) { /* each string of the array */
            char origin[300];
            snprintf(origin, sizeof origin, "config %s:", path);
            cJSON *e;
            cJSON_ArrayForEach(e, item) {
                if (!cJSON_IsString(e))
                    return td_error_set(TD_ERR_INVALID, "--config %s: key '%s' must hold strings", path, item->string);
                td_status st = set_value(o, e->valuestring, origin);
                if (st) return st;
            }
            continue;
        }
        if (cJSON_IsString(item)) v = item->valuestring;
        else if (cJSON_IsBool(item)) v = cJSON_IsTrue(item) ? "1" : "0";
        else if (cJSON_IsNumber(item)) {
            /* Whole numbers print as integers; the range test comes first, as
             * converting a double beyond long long is undefined. */
            double d = item->valuedouble;
            if (d > -9.2e18 && d < 9.2e18 && d == (double)(long long)d)
                snprintf(num, sizeof num, "%lld", (long long)item->valuedouble);
            else
                snprintf(num, sizeof num, "%.17g", item->valuedouble);
            v = num;
        } else {
            return td_error_set(TD_ERR_INVALID, "--config %s: key '%s' must be a string, number or bool", path,
                                item->string);
        }
        /* A string option given as a number or a bool ("ckpt": 32) takes its
         * text, kept in the document so that it outlives this loop. */
        if (o->kind == TD_OPT_STRING && !cJSON_IsString(item)) {
            const char *text = cJSON_IsBool(item) ? (cJSON_IsTrue(item) ? "true" : "false") : num;
            cJSON *s = cJSON_CreateString(text);
            if (!s || !cJSON_ReplaceItemViaPointer(doc, item, s)) {
                cJSON_Delete(s);
                return td_error_set(TD_ERR_NOMEM, "--config %s: out of memory", path);
            }
            item = s;
            v = s->valuestring;
        }
        char origin[300];
        snprintf(origin, sizeof origin, "config %s:", path);
        td_status st = set_value(o, v, origin);
        if (st) return st;
    }
    return TD_OK;
}

td_status td_args_parse(td_opt *opts, int argc, char **argv, int *help)
{
    *help = 0;
    for (int i = 0; i < argc; i++) /* the config first, so flags override it */
        if (!strcmp(argv[i], "--config")) {
            if (i + 1 >= argc) return td_error_set(TD_ERR_INVALID, "--config needs a file");
            td_status st = read_config(opts, argv[i + 1]);
            if (st) return st;
        }
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            *help = 1;
            return TD_OK;
        }
        if (strncmp(a, "--", 2) != 0)
            return td_error_set(TD_ERR_INVALID, "unexpected argument '%s' (options start with --)", a);
        if (!strcmp(a, "--config")) { i++; continue; }
        const char *name = a + 2, *eq = strchr(name, '=');
        char key[64];
        size_t klen = eq ? (size_t)(eq - name) : strlen(name);
        if (klen >= sizeof key) return td_error_set(TD_ERR_INVALID, "unknown option '%s'", a);
        memcpy(key, name, klen);
        key[klen] = '\0';
        td_opt *o = td_args_find(opts, key);
        if (!o) return td_error_set(TD_ERR_INVALID, "unknown option '--%s' (see --help)", key);
        const char *v = eq ? eq + 1 : NULL;
        if (!v && o->kind == TD_OPT_FLAG) v = "1";
        if (!v) {
            if (i + 1 >= argc) return td_error_set(TD_ERR_INVALID, "--%s needs a value (%s)", key, o->arg ? o->arg : "");
            v = argv[++i];
        }
        td_status st = set_value(o, v, "option");
        if (st) return st;
    }
    return TD_OK;
}

int td_args_main(td_opt *opts, int argc, char **argv, const char *cmd, const char *usage)
{
    int help = 0;
    td_status st = td_args_parse(opts, argc, argv, &help);
    if (help) {
        td_args_usage(stdout, usage, opts);
        td_args_free();
        return 0;
    }
    if (st) {
        fprintf(stderr, "tidal %s: %s\n(tidal %s --help lists the options)\n", cmd, td_error_msg(), cmd);
        td_args_free();
        return 2;
    }
    return -1;
}

td_status td_args_require(const td_opt *opts, ...)
{
    va_list ap;
    va_start(ap, opts);
    td_status st = TD_OK;
    for (const char *name = va_arg(ap, const char *); name && !st; name = va_arg(ap, const char *)) {
        const td_opt *o = opts;
        while (o->name && strcmp(o->name, name)) o++;
        if (o->name && !o->seen)
            st = td_error_set(TD_ERR_INVALID, "--%s%s%s is required", o->name, o->arg ? " " : "", o->arg ? o->arg : "");
    }
    va_end(ap);
    return st;
}

void td_args_usage(FILE *f, const char *usage, const td_opt *opts)
{
    fprintf(f, "%s\n\noptions (also as keys of a JSON file given with --config FILE):\n", usage);
    for (const td_opt *o = opts; o->name; o++) {
        char left[64];
        snprintf(left, sizeof left, "--%s%s%s", o->name, o->arg ? " " : "", o->arg ? o->arg : "");
        fprintf(f, "  %-28s ", left);
        for (const char *h = o->help; *h; h++) /* continuation lines under the first */
            if (*h == '\n') fprintf(f, "\n%31s", "");
            else fputc(*h, f);
        fputc('\n', f);
    }
}

void td_args_free(void)
{
    cJSON_Delete(config_doc);
    config_doc = NULL;
}

td_status td_cli_print_json(cJSON *doc)
{
    char *text = doc ? cJSON_PrintUnformatted(doc) : NULL;
    cJSON_Delete(doc);
    if (!text) return td_error_set(TD_ERR_NOMEM, "out of memory while writing JSON");
    printf("%s\n", text);
    cJSON_free(text);
    return TD_OK;
}

const char *td_cli_family_titles(void)
{
    static char text[512];
    if (text[0]) return text;
    size_t k = 0;
    int n = td_model_family_count();
    for (int i = 0; i < n && k < sizeof text; i++)
        k += (size_t)snprintf(text + k, sizeof text - k, "%s%s", i == 0 ? "" : i + 1 < n ? ", " : " or ",
                              td_model_family_title(td_model_family_at(i)));
    return text;
}

/* Appends `word` to text (length *k), breaking the line before it where
 * the line would pass `width` characters. */
static void append_wrapped(char *text, size_t cap, size_t *k, size_t *line, const char *word, size_t width)
{
    size_t n = strlen(word);
    if (*line > 0 && *line + n > width && *k + 1 < cap) {
        while (*k > 0 && text[*k - 1] == ' ') (*k)--; /* no trailing space before the break */
        text[(*k)++] = '\n';
        *line = 0;
    }
    if (*k < cap) *k += (size_t)snprintf(text + *k, cap - *k, "%s", word);
    if (*k >= cap) *k = cap - 1;
    *line += n;
}

const char *td_cli_presets_help(const char *default_preset)
{
    static char text[4096];
    if (text[0]) return text;
    size_t k = 0, line = 0;
    char word[160];
    for (int i = 0; i < td_model_family_count(); i++) {
        const td_model_family *f = td_model_family_at(i);
        snprintf(word, sizeof word, "%s: ", td_model_family_title(f));
        append_wrapped(text, sizeof text, &k, &line, word, 90);
        for (int p = 0; p < f->n_presets; p++) {
            const char *name = f->presets[p].name;
            snprintf(word, sizeof word, "%s%s%s ", name, default_preset && !strcmp(name, default_preset) ?
                     " (default)" : "", p + 1 < f->n_presets ? "," : ";");
            append_wrapped(text, sizeof text, &k, &line, word, 90);
        }
    }
    append_wrapped(text, sizeof text, &k, &line, "see docs/model.md; ", 90);
    append_wrapped(text, sizeof text, &k, &line, "or a Hugging Face config.json ", 90);
    append_wrapped(text, sizeof text, &k, &line, "(or a folder holding one): ", 90);
    append_wrapped(text, sizeof text, &k, &line, "its architecture, fresh weights", 90);
    return text;
}
