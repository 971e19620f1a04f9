/* tidal status codes and error messages.
 *
 * Every library call that can fail returns td_status (or NULL) and leaves a
 * message in a thread-local buffer that names what failed and how to fix it.
 * The library never exits; only the CLI and tests do.  TD_TRY propagates a
 * status with file:line appended, TD_FAIL sets a message and jumps to the
 * caller's `cleanup:` label (NCCL style: goto cleanup frees what was taken).
 * Thread-safety: all functions here are thread-safe (the message is per thread). */
#ifndef TIDAL_STATUS_H
#define TIDAL_STATUS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum td_status {
    TD_OK = 0,
    TD_ERR_INVALID,     /* bad argument or bad input */
    TD_ERR_NOMEM,       /* host allocation failed */
    TD_ERR_PIN,         /* host memory could not be pinned */
    TD_ERR_DEVICE_MEM,  /* device reservation failed */
    TD_ERR_BUDGET,      /* request does not fit the arena / budget */
    TD_ERR_BACKEND,     /* CUDA / backend call failed */
    TD_ERR_IO,          /* file I/O failed */
    TD_ERR_STATE,       /* illegal state or transition */
    TD_ERR_UNSUPPORTED, /* not available in this build or on this machine */
    TD_ERR_FAULT,       /* injected fault (tests) */
} td_status;

/* Sets the thread's message (printf format) and returns `st`. */
td_status td_error_set(td_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Prepends context ("while loading chunk 3: ") to the current message. */
td_status td_error_prefix(td_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* The current thread's last message ("" if none). */
const char *td_error_msg(void);
void td_error_clear(void);
const char *td_status_name(td_status st);

/* Propagate: on failure record file:line once and jump to `cleanup`. */
#define TD_TRY(expr)                                                        \
    do {                                                                    \
        st = (expr);                                                        \
        if (st != TD_OK) {                                                  \
            td_error_trace(__FILE__, __LINE__);                             \
            goto cleanup;                                                   \
        }                                                                   \
    } while (0)

/* Fail with a message and jump to `cleanup`. */
#define TD_FAIL(code, ...)                                                  \
    do {                                                                    \
        st = td_error_set((code), __VA_ARGS__);                             \
        td_error_trace(__FILE__, __LINE__);                                 \
        goto cleanup;                                                       \
    } while (0)

/* Records the innermost file:line of a failure (kept for the CLI's --verbose). */
void td_error_trace(const char *file, int line);
const char *td_error_where(void);

#ifdef __cplusplus
}
#endif
#endif
