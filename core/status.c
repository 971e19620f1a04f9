/* Thread-local error messages (see include/tidal/status.h). */
#include "tidal/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define TD_MSG_BYTES 1024

static _Thread_local char msg_buf[TD_MSG_BYTES];
static _Thread_local char where_buf[256];

td_status td_error_set(td_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg_buf, sizeof msg_buf, fmt, ap);
    va_end(ap);
    where_buf[0] = '\0';
    return st;
}

td_status td_error_prefix(td_status st, const char *fmt, ...)
{
    char head[TD_MSG_BYTES], old[TD_MSG_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(head, sizeof head, fmt, ap);
    va_end(ap);
    memcpy(old, msg_buf, sizeof old);
    size_t h = strlen(head), o = strlen(old);
    if (h > TD_MSG_BYTES - 1) h = TD_MSG_BYTES - 1;
    if (o > TD_MSG_BYTES - 1 - h) o = TD_MSG_BYTES - 1 - h;
    memcpy(msg_buf, head, h);
    memcpy(msg_buf + h, old, o);
    msg_buf[h + o] = '\0';
    return st;
}

const char *td_error_msg(void) { return msg_buf; }

void td_error_clear(void)
{
    msg_buf[0] = '\0';
    where_buf[0] = '\0';
}

void td_error_trace(const char *file, int line)
{
    if (where_buf[0] == '\0') /* keep the innermost site */
        snprintf(where_buf, sizeof where_buf, "%s:%d", file, line);
}

const char *td_error_where(void) { return where_buf; }

const char *td_status_name(td_status st)
{
    switch (st) {
    case TD_OK: return "ok";
    case TD_ERR_INVALID: return "invalid argument";
    case TD_ERR_NOMEM: return "out of host memory";
    case TD_ERR_PIN: return "cannot pin host memory";
    case TD_ERR_DEVICE_MEM: return "out of device memory";
    case TD_ERR_BUDGET: return "over budget";
    case TD_ERR_BACKEND: return "backend error";
    case TD_ERR_IO: return "I/O error";
    case TD_ERR_STATE: return "illegal state";
    case TD_ERR_UNSUPPORTED: return "unsupported";
    case TD_ERR_FAULT: return "injected fault";
    }
    return "unknown status";
}
