/* Element types of tensors that tidal stores and moves. */
#ifndef TIDAL_DTYPE_H
#define TIDAL_DTYPE_H

#include <stddef.h>

#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum td_dtype {
    TD_DTYPE_F32,
    TD_DTYPE_BF16,
    TD_DTYPE_F16,
    TD_DTYPE_COUNT
} td_dtype;

static inline size_t td_dtype_bytes(td_dtype dt) { return dt == TD_DTYPE_F32 ? 4 : 2; }
const char *td_dtype_name(td_dtype dt);                    /* "fp32", "bf16", "fp16" */
td_status td_dtype_parse(const char *name, td_dtype *out); /* also "float32", "bfloat16", "float16" */

#ifdef __cplusplus
}
#endif
#endif
