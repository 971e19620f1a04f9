/* The legal-transition table of the tensor-state tracker (see tensor_state.h).
 *
 * Why each row allows what it allows:
 *   FREE -> COMPUTE        a grad is written in backward; a buffer is filled
 *   FREE -> HOLD           a tensor is initialised (weights loaded)
 *   COMPUTE -> *           an op finishes and says what comes next; COMPUTE ->
 *                          COMPUTE is not allowed: nested use is a bug
 *   HOLD -> COMPUTE|FREE   used again, or dropped
 *   HOLD_AFTER_FWD -> COMPUTE   backward (or recomputation) uses it again
 *   HOLD_AFTER_FWD -> HOLD      the step ended without a backward (eval)
 *   HOLD_AFTER_BWD -> COMPUTE   used again in the same backward (tied weights)
 *   HOLD_AFTER_BWD -> READY_FOR_REDUCE|HOLD   its grad is complete / step ends
 *   READY_FOR_REDUCE -> HOLD|FREE   reduced and offloaded, or consumed
 *   READY_FOR_REDUCE -> COMPUTE     the optimizer reads the finished grad */
#include "tidal/tensor_state.h"

#include <stdio.h>
#include <string.h>

#define F (1u << TD_TENSOR_FREE)
#define C (1u << TD_TENSOR_COMPUTE)
#define H (1u << TD_TENSOR_HOLD)
#define HF (1u << TD_TENSOR_HOLD_AFTER_FWD)
#define HB (1u << TD_TENSOR_HOLD_AFTER_BWD)
#define R (1u << TD_TENSOR_READY_FOR_REDUCE)

static const unsigned legal_to[TD_TENSOR_STATE_COUNT] = {
    [TD_TENSOR_FREE] = C | H,
    [TD_TENSOR_COMPUTE] = F | H | HF | HB | R,
    [TD_TENSOR_HOLD] = F | C,
    [TD_TENSOR_HOLD_AFTER_FWD] = C | H | F,
    [TD_TENSOR_HOLD_AFTER_BWD] = C | H | R,
    [TD_TENSOR_READY_FOR_REDUCE] = C | H | F,
};

const char *td_tensor_state_name(td_tensor_state s)
{
    static const char *names[TD_TENSOR_STATE_COUNT] = {
        "FREE", "COMPUTE", "HOLD", "HOLD_AFTER_FWD", "HOLD_AFTER_BWD", "READY_FOR_REDUCE",
    };
    return (unsigned)s < TD_TENSOR_STATE_COUNT ? names[s] : "INVALID";
}

int td_tensor_state_legal(td_tensor_state from, td_tensor_state to)
{
    if ((unsigned)from >= TD_TENSOR_STATE_COUNT || (unsigned)to >= TD_TENSOR_STATE_COUNT) return 0;
    return (legal_to[from] >> to) & 1u;
}

td_status td_tensor_state_check(const char *tensor_name, td_tensor_state from, td_tensor_state to)
{
    if (td_tensor_state_legal(from, to)) return TD_OK;
    char allowed[128] = "";
    size_t n = 0;
    for (int s = 0; (unsigned)from < TD_TENSOR_STATE_COUNT && s < TD_TENSOR_STATE_COUNT; s++)
        if ((legal_to[from] >> s) & 1u)
            n += (size_t)snprintf(allowed + n, sizeof allowed - n, "%s%s", n ? ", " : "",
                                  td_tensor_state_name((td_tensor_state)s));
    return td_error_set(TD_ERR_STATE, "tensor '%s': illegal transition %s -> %s (legal from %s: %s)",
                        tensor_name ? tensor_name : "?", td_tensor_state_name(from), td_tensor_state_name(to),
                        td_tensor_state_name(from), n ? allowed : "none");
}
