/* The raw peer of `tidal bench copy`: plain copies that bypass tidal's
 * backend and copy engine (cudaMemcpyAsync on its own streams with a CUDA
 * build and device; memcpy on host threads otherwise), timed the same way. */
#ifndef TIDAL_BENCH_COPY_RAW_H
#define TIDAL_BENCH_COPY_RAW_H

#include <stddef.h>

typedef enum raw_mode { RAW_H2D, RAW_D2H, RAW_BOTH } raw_mode;

/* One timed transfer of `bytes` each way the mode names, host wall clock in
 * ms; returns 0 on success, else -1 with a message in err. `use_cuda`
 * selects the CUDA path (only in CUDA builds). */
int raw_copy_ms(int use_cuda, raw_mode mode, void *dev_dst, const void *host_src, void *host_dst,
                const void *dev_src, size_t bytes, double *ms, char *err, size_t err_bytes);
void raw_copy_shutdown(void);

#endif
