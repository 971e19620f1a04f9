/* Shared by the libFuzzer targets in tests/fuzz/ (not a target itself: only
 * fuzz_*.c files are).
 *
 * Parsers that read files (safetensors, checkpoint directories) get the
 * fuzzer's bytes through a scratch folder made once per process, under
 * /dev/shm when it exists so an iteration costs no disk I/O.  The folder is
 * removed at exit.
 *
 * FUZZ_CHECK is the targets' assertion: a property the parser promises
 * (an accepted input re-reads the same, ids stay inside the vocabulary, no
 * accounted allocation outlives the call) that is false aborts, and libFuzzer
 * reports the input as a crash. */
#ifndef TIDAL_FUZZ_UTIL_H
#define TIDAL_FUZZ_UTIL_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tidal/alloc.h"

#define FUZZ_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: fuzz property failed: %s\n", __FILE__, __LINE__, #cond);       \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

static char fuzz_dir_path[256];

static inline void fuzz_dir_remove(void)
{
    DIR *d = opendir(fuzz_dir_path);
    if (!d) return;
    char p[512];
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", fuzz_dir_path, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(fuzz_dir_path);
}

/* The process's scratch folder (created on first use). */
static inline const char *fuzz_dir(void)
{
    if (!fuzz_dir_path[0]) {
        const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
        snprintf(fuzz_dir_path, sizeof fuzz_dir_path, "%s/tidal-fuzz.XXXXXX", base);
        if (!mkdtemp(fuzz_dir_path)) {
            perror("fuzz: mkdtemp");
            abort();
        }
        atexit(fuzz_dir_remove);
    }
    return fuzz_dir_path;
}

/* "<scratch>/name" into buf. */
static inline const char *fuzz_path(char *buf, size_t buf_bytes, const char *name)
{
    snprintf(buf, buf_bytes, "%s/%s", fuzz_dir(), name);
    return buf;
}

/* Writes bytes to <scratch>/name (replacing it); returns the path in buf. */
static inline const char *fuzz_write(char *buf, size_t buf_bytes, const char *name, const void *bytes, size_t n)
{
    fuzz_path(buf, buf_bytes, name);
    FILE *f = fopen(buf, "wb");
    if (!f || (n && fwrite(bytes, 1, n, f) != n) || fclose(f) != 0) {
        perror("fuzz: writing a scratch file");
        abort();
    }
    return buf;
}

/* Removes <scratch>/name if present. */
static inline void fuzz_unlink(const char *name)
{
    char p[512];
    unlink(fuzz_path(p, sizeof p, name));
}

/* The input cut at the first occurrence of `sep` (a fuzzer-friendly way to
 * feed one input to a parser that takes several files): [*part, *part_len)
 * before it, the rest after it.  Without `sep`, everything is the part. */
static inline void fuzz_split(const uint8_t **data, size_t *size, const char *sep, const uint8_t **part, size_t *part_len)
{
    const size_t k = strlen(sep);
    *part = *data;
    for (size_t i = 0; i + k <= *size; i++)
        if (!memcmp(*data + i, sep, k)) {
            *part_len = i;
            *data += i + k;
            *size -= i + k;
            return;
        }
    *part_len = *size;
    *data += *size;
    *size = 0;
}

#endif
