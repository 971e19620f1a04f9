/* Small shared utilities: byte sizes with units, clocks, a seeded RNG.
 * Thread-safety: all functions are reentrant; an td_rng is owned by its caller. */
#ifndef TIDAL_UTIL_H
#define TIDAL_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TD_KiB ((size_t)1 << 10)
#define TD_MiB ((size_t)1 << 20)
#define TD_GiB ((size_t)1 << 30)

/* "4096", "512MiB", "24GiB", "1.5G", "100MB", "64k": binary for KiB/MiB/GiB/TiB
 * and bare K/M/G/T, decimal for kB/MB/GB/TB.  Rejects garbage, negatives,
 * overflow. */
td_status td_parse_bytes(const char *text, size_t *bytes_out);
/* "1.50 GiB" into buf (at least 32 bytes); returns buf. */
char *td_format_bytes(size_t bytes, char *buf, size_t buf_bytes);

double td_now_ms(void); /* monotonic clock */
/* The median of v[0..n) (n > 0), which it sorts in place. */
double td_median(double *v, size_t n);
void td_sleep_us(long us);

/* xoshiro256** seeded by splitmix64: the same seed gives the same stream. */
typedef struct td_rng { uint64_t s[4]; } td_rng;
void     td_rng_seed(td_rng *rng, uint64_t seed);
uint64_t td_rng_next(td_rng *rng);
uint64_t td_rng_below(td_rng *rng, uint64_t bound); /* uniform in [0, bound) */
double   td_rng_uniform(td_rng *rng);                /* [0, 1) */
/* As k calls of td_rng_next, in O(log k): a thread can start its share of
 * one stream where the serial draws would have reached. */
void     td_rng_jump(td_rng *rng, uint64_t k);

/* Copies the file src to dst whole: written to dst.tmp.<pid>, fsync'd and
 * renamed over dst, so dst is the old file or the complete copy. */
td_status td_copy_file(const char *src, const char *dst);

static inline size_t td_align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

#ifdef __cplusplus
}
#endif
#endif
