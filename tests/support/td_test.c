/* Shared helpers for tidal's cmocka tests (see td_test.h). */
#include "td_test.h"
#include "tidal/convert.h"

#include <cjson/cJSON.h>

#include <unistd.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

td_backend_kind td_test_backend_kind(void)
{
    const char *name = getenv("TD_BACKEND");
    td_backend_kind k = TD_BACKEND_CPU;
    if (name && *name && td_backend_kind_parse(name, &k) != TD_OK) k = TD_BACKEND_CPU;
    return k;
}

td_backend *td_test_backend(int debug)
{
    td_backend_params p = td_backend_default_params();
    p.kind = td_test_backend_kind();
    p.cpu_debug = debug;
    p.cpu_device_bytes = 512 * TD_MiB;
    td_backend *b = NULL;
    if (td_backend_create(&p, &b) != TD_OK) fail_msg("backend: %s", td_error_msg());
    return b;
}

int td_test_seeds(int fallback)
{
    const char *v = getenv("TD_TEST_SEEDS");
    int n = v ? atoi(v) : 0;
    return n > 0 ? n : fallback;
}

const char *td_test_tidal(void)
{
    const char *exe = getenv("TIDAL");
    if (exe && *exe) return exe;
    return access("./build/tidal", X_OK) == 0 ? "./build/tidal" : "./build-san/tidal";
}

double td_test_json_num(const struct cJSON *o, const char *a, const char *b)
{
    const cJSON *x = cJSON_GetObjectItem(o, a);
    if (x && b) x = cJSON_GetObjectItem(x, b);
    if (!x || !cJSON_IsNumber(x)) fail_msg("JSON: no number at %s%s%s", a, b ? "." : "", b ? b : "");
    return x->valuedouble;
}

char *td_test_slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *buf = malloc((size_t)n + 1);
    if (!buf) fail_msg("%s: %ld bytes", path, n);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    if (len) *len = (size_t)n;
    return buf;
}

int td_test_for_each_jsonl(const char *path, void (*fn)(struct cJSON *obj, void *ctx), void *ctx)
{
    char *text = td_test_slurp(path, NULL);
    int n = 0;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        cJSON *o = cJSON_Parse(line);
        if (!o) fail_msg("%s: bad JSON line %d", path, n + 1);
        fn(o, ctx);
        cJSON_Delete(o);
        n++;
    }
    free(text);
    return n;
}

void td_test_collect_piece(void *ctx, const char *piece, size_t len)
{
    td_test_pieces *p = ctx;
    assert_true(p->n < 4096);
    p->len[p->n] = len;
    p->v[p->n] = malloc(len + 1);
    assert_non_null(p->v[p->n]);
    memcpy(p->v[p->n], piece, len);
    p->v[p->n++][len] = '\0';
}

void td_test_free_pieces(td_test_pieces *p)
{
    for (int i = 0; i < p->n; i++) free(p->v[i]);
    p->n = 0;
}

void td_test_expect_pieces(const char *text, const cJSON *want, td_test_pieces *got)
{
    int n = cJSON_GetArraySize(want);
    for (int i = 0; i < n && i < got->n; i++)
        if (strcmp(got->v[i], cJSON_GetArrayItem(want, i)->valuestring))
            fail_msg("pre-tokenizing '%s': piece %d is '%s', the regex gives '%s'", text, i, got->v[i],
                     cJSON_GetArrayItem(want, i)->valuestring);
    if (got->n != n) fail_msg("pre-tokenizing '%s': %d pieces, the regex gives %d", text, got->n, n);
    td_test_free_pieces(got);
}

void td_test_store_as(void *dst, td_dtype dt, size_t i, float x)
{
    if (dt == TD_DTYPE_BF16) ((uint16_t *)dst)[i] = td_bf16_from_f32(x);
    else if (dt == TD_DTYPE_F16) ((uint16_t *)dst)[i] = td_f16_from_f32(x);
    else ((float *)dst)[i] = x;
}

double td_test_load_as(const void *src, td_dtype dt, size_t i)
{
    if (dt == TD_DTYPE_BF16) return td_f32_from_bf16(((const uint16_t *)src)[i]);
    if (dt == TD_DTYPE_F16) return td_f32_from_f16(((const uint16_t *)src)[i]);
    return ((const float *)src)[i];
}
