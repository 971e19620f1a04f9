/* Raw copies for `tidal bench copy` (see copy_raw.h): the host path. */
#include "copy_raw.h"
#include "tidal/util.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#ifdef TD_HAVE_CUDA
int raw_copy_cuda_ms(raw_mode mode, void *dev_dst, const void *host_src, void *host_dst, const void *dev_src,
                     size_t bytes, double *ms, char *err, size_t err_bytes);
void raw_copy_cuda_shutdown(void);
#endif

typedef struct job { void *dst; const void *src; size_t bytes; } job;

static void *run_job(void *arg)
{
    job *j = arg;
    memcpy(j->dst, j->src, j->bytes);
    return NULL;
}

int raw_copy_ms(int use_cuda, raw_mode mode, void *dev_dst, const void *host_src, void *host_dst,
                const void *dev_src, size_t bytes, double *ms, char *err, size_t err_bytes)
{
#ifdef TD_HAVE_CUDA
    if (use_cuda) return raw_copy_cuda_ms(mode, dev_dst, host_src, host_dst, dev_src, bytes, ms, err, err_bytes);
#endif
    if (use_cuda) {
        snprintf(err, err_bytes, "built without CUDA");
        return -1;
    }
    job up = { dev_dst, host_src, bytes }, down = { host_dst, dev_src, bytes };
    double t0 = td_now_ms();
    if (mode == RAW_BOTH) { /* one host thread per direction, like the cpu backend */
        pthread_t th;
        if (pthread_create(&th, NULL, run_job, &down) != 0) {
            snprintf(err, err_bytes, "pthread_create failed");
            return -1;
        }
        run_job(&up);
        pthread_join(th, NULL);
    } else {
        run_job(mode == RAW_H2D ? &up : &down);
    }
    *ms = td_now_ms() - t0;
    return 0;
}

void raw_copy_shutdown(void)
{
#ifdef TD_HAVE_CUDA
    raw_copy_cuda_shutdown();
#endif
}
