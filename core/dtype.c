/* Element types: their names (see include/tidal/dtype.h). */
#include "tidal/dtype.h"

#include <string.h>

const char *td_dtype_name(td_dtype dt)
{
    static const char *names[TD_DTYPE_COUNT] = {"fp32", "bf16", "fp16"};
    return (unsigned)dt < TD_DTYPE_COUNT ? names[dt] : "unknown";
}

td_status td_dtype_parse(const char *name, td_dtype *out)
{
    static const struct { const char *name; td_dtype dt; } names[] = {
        {"fp32", TD_DTYPE_F32}, {"float32", TD_DTYPE_F32}, {"f32", TD_DTYPE_F32},
        {"bf16", TD_DTYPE_BF16}, {"bfloat16", TD_DTYPE_BF16},
        {"fp16", TD_DTYPE_F16}, {"float16", TD_DTYPE_F16}, {"f16", TD_DTYPE_F16},
    };
    for (size_t i = 0; name && i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i].name)) { *out = names[i].dt; return TD_OK; }
    return td_error_set(TD_ERR_INVALID, "unknown dtype '%s'; use fp32, bf16 or fp16", name ? name : "");
}
