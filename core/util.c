/* Byte sizes, clocks, the seeded RNG and whole-file copies (see include/tidal/util.h). */
#define _POSIX_C_SOURCE 200809L
#include "tidal/util.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

td_status td_parse_bytes(const char *text, size_t *bytes_out)
{
    static const struct { const char *suffix; double mult; } units[] = {
        {"", 1}, {"b", 1},
        {"k", 1024.0}, {"kib", 1024.0}, {"kb", 1e3},
        {"m", 1048576.0}, {"mib", 1048576.0}, {"mb", 1e6},
        {"g", 1073741824.0}, {"gib", 1073741824.0}, {"gb", 1e9},
        {"t", 1099511627776.0}, {"tib", 1099511627776.0}, {"tb", 1e12},
    };
    if (!text || !*text)
        return td_error_set(TD_ERR_INVALID, "empty size; expected e.g. 4096, 512MiB or 24GiB");
    const char *p = text;
    while (isspace((unsigned char)*p)) p++;
    if (*p == '-' || *p == '+')
        return td_error_set(TD_ERR_INVALID, "size '%s' must be a positive number of bytes", text);
    errno = 0;
    char *end;
    double v = strtod(p, &end);
    if (end == p || errno || !isfinite(v) || v < 0)
        return td_error_set(TD_ERR_INVALID, "size '%s' is not a number; expected e.g. 4096, 512MiB or 24GiB", text);
    while (isspace((unsigned char)*end)) end++;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcasecmp(end, units[i].suffix) == 0) {
            double bytes = v * units[i].mult;
            if (bytes >= 18446744073709549568.0)
                return td_error_set(TD_ERR_INVALID, "size '%s' is too large", text);
            if (bytes != floor(bytes))
                return td_error_set(TD_ERR_INVALID, "size '%s' is not a whole number of bytes", text);
            *bytes_out = (size_t)bytes;
            return TD_OK;
        }
    }
    return td_error_set(TD_ERR_INVALID, "size '%s' has an unknown unit '%s'; use B, KiB, MiB, GiB, TiB (or kB, MB, GB, TB)", text, end);
}

char *td_format_bytes(size_t bytes, char *buf, size_t buf_bytes)
{
    static const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 4) { v /= 1024.0; u++; }
    if (u == 0) snprintf(buf, buf_bytes, "%zu B", bytes);
    else snprintf(buf, buf_bytes, "%.2f %s", v, unit[u]);
    return buf;
}

double td_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double td_median(double *v, size_t n)
{
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void td_sleep_us(long us)
{
    struct timespec ts = { us / 1000000, (us % 1000000) * 1000 };
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
}

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void td_rng_seed(td_rng *rng, uint64_t seed)
{
    for (int i = 0; i < 4; i++) rng->s[i] = splitmix64(&seed);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t td_rng_next(td_rng *rng)
{
    uint64_t *s = rng->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

uint64_t td_rng_below(td_rng *rng, uint64_t bound)
{
    if (bound == 0) return 0;
    uint64_t limit = UINT64_MAX - UINT64_MAX % bound; /* reject the biased tail */
    uint64_t x;
    do x = td_rng_next(rng); while (x >= limit);
    return x % bound;
}

double td_rng_uniform(td_rng *rng) { return (double)(td_rng_next(rng) >> 11) * 0x1.0p-53; }

/* Jumping ahead.  xoshiro256's step is a linear map T of the state over
 * GF(2), and its characteristic polynomial P (degree 256; the low 256
 * coefficients below, x^256 implied) was found by Berlekamp-Massey on the
 * generator's own bit stream; test_util checks the jump against stepping.
 * T^k s = sum over i of c_i T^i s, where sum c_i x^i = x^k mod P: so k
 * steps cost about 64 products of 256-bit polynomials and 256 steps. */
static const uint64_t xoshiro_poly[4] = {0x9d116f2bb0f0f001ull, 0x0280002bcefd1a5eull, 0x04b4edcf26259f85ull,
                                         0x0003c03c3f3ecb19ull};

typedef struct { uint64_t w[4]; } gf2_poly; /* degree < 256 */

static void poly_times_x(gf2_poly *a)
{
    uint64_t top = a->w[3] >> 63;
    for (int i = 3; i > 0; i--) a->w[i] = (a->w[i] << 1) | (a->w[i - 1] >> 63);
    a->w[0] <<= 1;
    if (top)
        for (int i = 0; i < 4; i++) a->w[i] ^= xoshiro_poly[i];
}

static gf2_poly poly_mulmod(gf2_poly a, gf2_poly b)
{
    gf2_poly r = {{0}};
    for (int i = 0; i < 256; i++) {
        if (a.w[i / 64] >> (i % 64) & 1)
            for (int j = 0; j < 4; j++) r.w[j] ^= b.w[j];
        poly_times_x(&b);
    }
    return r;
}

void td_rng_jump(td_rng *rng, uint64_t k)
{
    if (k < 256) { /* stepping is cheaper */
        while (k--) (void)td_rng_next(rng);
        return;
    }
    gf2_poly c = {{1}}, base = {{2}}; /* 1 and x */
    for (; k; k >>= 1) {
        if (k & 1) c = poly_mulmod(c, base);
        base = poly_mulmod(base, base);
    }
    uint64_t acc[4] = {0};
    td_rng t = *rng;
    for (int i = 0; i < 256; i++) {
        if (c.w[i / 64] >> (i % 64) & 1)
            for (int j = 0; j < 4; j++) acc[j] ^= t.s[j];
        (void)td_rng_next(&t);
    }
    memcpy(rng->s, acc, sizeof acc);
}

td_status td_copy_file(const char *src, const char *dst)
{
    td_status st = TD_OK;
    char tmp[4096];
    char buf[1 << 16];
    int in = -1, out = -1;
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", dst, (long)getpid()) >= (int)sizeof tmp)
        return td_error_set(TD_ERR_INVALID, "copying to %s: the path is too long", dst);
    if ((in = open(src, O_RDONLY | O_CLOEXEC)) < 0)
        return td_error_set(TD_ERR_IO, "cannot read %s: %s", src, strerror(errno));
    if ((out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0) {
        st = td_error_set(TD_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
        goto cleanup;
    }
    for (;;) {
        ssize_t n = read(in, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { st = td_error_set(TD_ERR_IO, "reading %s: %s", src, strerror(errno)); goto cleanup; }
        if (n == 0) break;
        for (ssize_t done = 0; done < n;) {
            ssize_t w = write(out, buf + done, (size_t)(n - done));
            if (w < 0 && errno == EINTR) continue;
            if (w < 0) { st = td_error_set(TD_ERR_IO, "writing %s: %s", tmp, strerror(errno)); goto cleanup; }
            done += w;
        }
    }
    if (fsync(out) != 0) { st = td_error_set(TD_ERR_IO, "syncing %s: %s", tmp, strerror(errno)); goto cleanup; }
    if (close(out) != 0) { out = -1; st = td_error_set(TD_ERR_IO, "closing %s: %s", tmp, strerror(errno)); goto cleanup; }
    out = -1;
    if (rename(tmp, dst) != 0) st = td_error_set(TD_ERR_IO, "renaming %s to %s: %s", tmp, dst, strerror(errno));
cleanup:
    if (in >= 0) close(in);
    if (out >= 0) close(out);
    if (st) unlink(tmp);
    return st;
}
