/* Tensor states and their legal transitions (the tensor-state tracker).
 *
 *   FREE              no payload needed now (a grad before backward)
 *   COMPUTE           an op is using it: its chunk must be resident and pinned
 *   HOLD              payload valid, not in use, chunk may move
 *   HOLD_AFTER_FWD    used in this forward, needed again in backward
 *   HOLD_AFTER_BWD    used in this backward; the grad it produced is pending
 *   READY_FOR_REDUCE  grad complete: may be reduced and offloaded
 *
 * A chunk's state follows from its tensors: any COMPUTE pins it.  The table
 * in memmgr/tensor_state.c is the whole contract; a transition not in it is
 * an error naming the tensor, the from-state and the to-state.
 * Thread-safety: pure functions. */
#ifndef TIDAL_TENSOR_STATE_H
#define TIDAL_TENSOR_STATE_H

#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum td_tensor_state {
    TD_TENSOR_FREE,
    TD_TENSOR_COMPUTE,
    TD_TENSOR_HOLD,
    TD_TENSOR_HOLD_AFTER_FWD,
    TD_TENSOR_HOLD_AFTER_BWD,
    TD_TENSOR_READY_FOR_REDUCE,
    TD_TENSOR_STATE_COUNT
} td_tensor_state;

const char *td_tensor_state_name(td_tensor_state s);
int td_tensor_state_legal(td_tensor_state from, td_tensor_state to);
/* TD_OK, or TD_ERR_STATE with "tensor 'h.3.attn.c_attn.weight': illegal
 * transition HOLD -> READY_FOR_REDUCE (legal from HOLD: FREE, COMPUTE)". */
td_status td_tensor_state_check(const char *tensor_name, td_tensor_state from, td_tensor_state to);

#ifdef __cplusplus
}
#endif
#endif
