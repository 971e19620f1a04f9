/* Shared helpers for tidal's cmocka tests (see td_test.h). */
#include "td_test.h"

#include <cjson/cJSON.h>

#include <unistd.h>

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
