/* config.json documents (see include/tidal/hf_config.h), over cJSON.
 *
 * A document is a cJSON object and the name errors give it.  Sub-documents
 * (an object under a key) are handles allocated on first use and kept on
 * their root's list, so a family's reader never frees anything. */
#include "tidal/hf_config.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tidal/alloc.h"

struct td_hf_config {
    cJSON *o;
    char *where;          /* "path" or "path (key)" */
    int owns;             /* a root: frees o */
    td_hf_config *root;   /* a sub-document's root (NULL: a root) */
    td_hf_config *kids;   /* a root's sub-documents */
    td_hf_config *next;
};

static td_hf_config *wrap(cJSON *o, const char *where, const char *key)
{
    td_hf_config *c = td_calloc(1, sizeof *c, TD_ROLE_META);
    size_t n = strlen(where) + (key ? strlen(key) + 4 : 0) + 1;
    char *w = td_malloc(n, TD_ROLE_META);
    if (!c || !w) {
        td_free(c);
        td_free(w);
        return NULL;
    }
    if (key) snprintf(w, n, "%s (%s)", where, key);
    else snprintf(w, n, "%s", where);
    c->o = o;
    c->where = w;
    return c;
}

td_status td_hf_config_create(const char *where, td_hf_config **out)
{
    cJSON *o = cJSON_CreateObject();
    *out = o ? wrap(o, where ? where : "config.json", NULL) : NULL;
    if (!*out) {
        cJSON_Delete(o);
        return td_error_set(TD_ERR_NOMEM, "out of memory for %s", where ? where : "config.json");
    }
    (*out)->owns = 1;
    return TD_OK;
}

td_status td_hf_config_parse(const char *text, size_t len, const char *where, td_hf_config **out)
{
    *out = NULL;
    if (!where) where = "config.json";
    cJSON *o = cJSON_ParseWithLength(text, len);
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return td_error_set(TD_ERR_INVALID, "%s is not a JSON object", where);
    }
    if (!(*out = wrap(o, where, NULL))) {
        cJSON_Delete(o);
        return td_error_set(TD_ERR_NOMEM, "out of memory reading %s", where);
    }
    (*out)->owns = 1;
    return TD_OK;
}

td_status td_hf_config_load(const char *path, td_hf_config **out)
{
    td_status st = TD_OK;
    char *buf = NULL;
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return td_error_set(TD_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) TD_FAIL(TD_ERR_IO, "cannot stat %s: %s", path, strerror(errno));
    if (sb.st_size > 64 * 1024 * 1024)
        TD_FAIL(TD_ERR_INVALID, "%s is %lld bytes, too large for a JSON configuration", path, (long long)sb.st_size);
    size_t n = (size_t)sb.st_size, got = 0;
    if (!(buf = td_malloc(n + 1, TD_ROLE_META))) TD_FAIL(TD_ERR_NOMEM, "out of memory reading %s", path);
    while (got < n) {
        ssize_t k = read(fd, buf + got, n - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) TD_FAIL(TD_ERR_IO, "cannot read %s: %s", path, k < 0 ? strerror(errno) : "short read");
        got += (size_t)k;
    }
    buf[n] = '\0';
    TD_TRY(td_hf_config_parse(buf, n, path, out));
cleanup:
    td_free(buf);
    close(fd);
    return st;
}

void td_hf_config_free(td_hf_config *c)
{
    if (!c) return;
    for (td_hf_config *k = c->kids, *next; k; k = next) {
        next = k->next;
        td_free(k->where);
        td_free(k);
    }
    if (c->owns) cJSON_Delete(c->o);
    td_free(c->where);
    td_free(c);
}

td_status td_hf_config_print(const td_hf_config *c, char **text)
{
    char *s = cJSON_Print(c->o);
    *text = NULL;
    if (!s) return td_error_set(TD_ERR_NOMEM, "out of memory printing %s", c->where);
    size_t n = strlen(s) + 1;
    *text = td_malloc(n, TD_ROLE_META);
    if (*text) memcpy(*text, s, n);
    cJSON_free(s);
    return *text ? TD_OK : td_error_set(TD_ERR_NOMEM, "out of memory printing %s", c->where);
}

const char *td_hf_config_where(const td_hf_config *c) { return c->where; }

/* --- reading ----------------------------------------------------------------- */

static const cJSON *get(const td_hf_config *c, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(c->o, key);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

int td_hf_config_has(const td_hf_config *c, const char *key) { return get(c, key) != NULL; }

int td_hf_config_present(const td_hf_config *c, const char *key)
{
    return cJSON_GetObjectItemCaseSensitive(c->o, key) != NULL;
}

static td_status absent(const td_hf_config *c, const char *key, int required)
{
    return required ? td_error_set(TD_ERR_INVALID, "%s: no \"%s\"; this config.json needs it", c->where, key) : TD_OK;
}

td_status td_hf_config_int(const td_hf_config *c, const char *key, int required, int *out)
{
    const cJSON *v = get(c, key);
    if (!v) return absent(c, key, required);
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 1 ||
        v->valuedouble > INT32_MAX)
        return td_error_set(TD_ERR_INVALID, "%s: \"%s\" must be a positive integer", c->where, key);
    *out = (int)v->valuedouble;
    return TD_OK;
}

td_status td_hf_config_float(const td_hf_config *c, const char *key, int required, float *out)
{
    const cJSON *v = get(c, key);
    if (!v) return absent(c, key, required);
    if (!cJSON_IsNumber(v) || !(v->valuedouble > 0) || !isfinite((float)v->valuedouble))
        return td_error_set(TD_ERR_INVALID, "%s: \"%s\" must be a positive number", c->where, key);
    *out = (float)v->valuedouble;
    return TD_OK;
}

td_status td_hf_config_number(const td_hf_config *c, const char *key, double *out)
{
    const cJSON *v = get(c, key);
    if (!v) return TD_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return td_error_set(TD_ERR_INVALID, "%s: \"%s\" must be a number", c->where, key);
    *out = v->valuedouble;
    return TD_OK;
}

td_status td_hf_config_bool(const td_hf_config *c, const char *key, int *out)
{
    const cJSON *v = get(c, key);
    if (!v) return TD_OK;
    if (!cJSON_IsBool(v)) return td_error_set(TD_ERR_INVALID, "%s: \"%s\" must be true or false", c->where, key);
    *out = cJSON_IsTrue(v);
    return TD_OK;
}

td_status td_hf_config_string(const td_hf_config *c, const char *key, int required, const char **out)
{
    const cJSON *v = get(c, key);
    if (!v) return absent(c, key, required);
    if (!cJSON_IsString(v)) return td_error_set(TD_ERR_INVALID, "%s: \"%s\" must be a string", c->where, key);
    *out = v->valuestring;
    return TD_OK;
}

/* A handle for the object v under key, kept on the root's list. */
static td_status adopt(td_hf_config *parent, cJSON *v, const char *key, td_hf_config **out)
{
    td_hf_config *k = wrap(v, parent->where, key);
    if (!k) return td_error_set(TD_ERR_NOMEM, "out of memory reading %s", parent->where);
    td_hf_config *root = parent->root ? parent->root : parent;
    k->root = root;
    k->next = root->kids;
    root->kids = k;
    *out = k;
    return TD_OK;
}

td_status td_hf_config_get_object(const td_hf_config *c, const char *key, const td_hf_config **out)
{
    *out = NULL;
    const cJSON *v = get(c, key);
    if (!v) return TD_OK;
    if (!cJSON_IsObject(v)) return td_error_set(TD_ERR_INVALID, "%s: \"%s\" must be null or an object", c->where, key);
    td_hf_config *k = NULL;
    td_status st = adopt((td_hf_config *)c, (cJSON *)v, key, &k);
    if (st == TD_OK) *out = k;
    return st;
}

td_status td_hf_config_must_be(const td_hf_config *c, const char *key, int want, const char *why)
{
    const cJSON *v = get(c, key);
    if (!v || (want ? cJSON_IsTrue(v) : cJSON_IsFalse(v))) return TD_OK;
    return td_error_set(TD_ERR_INVALID, "%s: \"%s\" must be %s; %s", c->where, key, want ? "true" : "false", why);
}

td_status td_hf_config_one_of(const td_hf_config *c, const char *key, const char *const *allowed, const char *why)
{
    const cJSON *v = get(c, key);
    if (!v) return TD_OK;
    for (int i = 0; cJSON_IsString(v) && allowed[i]; i++)
        if (!strcmp(v->valuestring, allowed[i])) return TD_OK;
    return td_error_set(TD_ERR_INVALID, "%s: %s %s%s%s is not supported; %s", c->where, key,
                        cJSON_IsString(v) ? "\"" : "", cJSON_IsString(v) ? v->valuestring : "(not a string)",
                        cJSON_IsString(v) ? "\"" : "", why);
}

/* --- writing ----------------------------------------------------------------- */

static td_status put(td_hf_config *c, const char *key, cJSON *item)
{
    if (!item) return td_error_set(TD_ERR_NOMEM, "out of memory writing %s", c->where);
    cJSON_bool ok = cJSON_HasObjectItem(c->o, key) ? cJSON_ReplaceItemInObjectCaseSensitive(c->o, key, item)
                                                  : cJSON_AddItemToObject(c->o, key, item);
    if (ok) return TD_OK;
    cJSON_Delete(item);
    return td_error_set(TD_ERR_NOMEM, "out of memory writing %s", c->where);
}

td_status td_hf_config_set_int(td_hf_config *c, const char *key, long long v)
{
    return put(c, key, cJSON_CreateNumber((double)v));
}

/* The shortest decimal that reads back as the same float. */
static double short_float(float f)
{
    char buf[32];
    snprintf(buf, sizeof buf, "%.9g", f);
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, f);
        if ((float)strtod(buf, NULL) == f) break;
    }
    return strtod(buf, NULL);
}

td_status td_hf_config_set_float(td_hf_config *c, const char *key, float v)
{
    return put(c, key, cJSON_CreateNumber(short_float(v)));
}

td_status td_hf_config_set_number(td_hf_config *c, const char *key, double v)
{
    return put(c, key, cJSON_CreateNumber(v));
}

td_status td_hf_config_set_bool(td_hf_config *c, const char *key, int v) { return put(c, key, cJSON_CreateBool(v)); }
td_status td_hf_config_set_string(td_hf_config *c, const char *key, const char *v)
{
    return put(c, key, cJSON_CreateString(v));
}
td_status td_hf_config_set_null(td_hf_config *c, const char *key) { return put(c, key, cJSON_CreateNull()); }

td_status td_hf_config_set_strings1(td_hf_config *c, const char *key, const char *v)
{
    const char *one[1] = {v};
    return put(c, key, cJSON_CreateStringArray(one, 1));
}

td_status td_hf_config_object(td_hf_config *c, const char *key, td_hf_config **out)
{
    *out = NULL;
    cJSON *o = cJSON_CreateObject();
    td_status st = put(c, key, o);
    return st ? st : adopt(c, o, key, out);
}
