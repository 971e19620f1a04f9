/* safetensors reader and streaming writer (see include/tidal/safetensors.h).
 *
 * The reader trusts nothing in the file: every number in the header is
 * checked against the file size before it is used, sizes are multiplied with
 * overflow checks, and the tensors are sorted by offset so that overlaps and
 * holes are found whatever order the header lists them in.  cJSON parses the
 * header; its tree is turned into our own tables at once and freed.
 *
 * The writer builds the header itself (so 64-bit offsets are printed exactly)
 * and streams the data through one staging buffer. */
#include "tidal/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tidal/alloc.h"
#include "tidal/convert.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c assumes a little-endian host (the format is little-endian)"
#endif

/* --- dtypes --------------------------------------------------------------- */

static const struct {
    const char *name;
    size_t bytes;
} dtype_table[TD_ST_DTYPE_COUNT] = {
    [TD_ST_BOOL] = {"BOOL", 1},       [TD_ST_U8] = {"U8", 1},     [TD_ST_I8] = {"I8", 1},
    [TD_ST_F8_E5M2] = {"F8_E5M2", 1}, [TD_ST_F8_E4M3] = {"F8_E4M3", 1},
    [TD_ST_I16] = {"I16", 2},         [TD_ST_U16] = {"U16", 2},   [TD_ST_F16] = {"F16", 2},
    [TD_ST_BF16] = {"BF16", 2},       [TD_ST_I32] = {"I32", 4},   [TD_ST_U32] = {"U32", 4},
    [TD_ST_F32] = {"F32", 4},         [TD_ST_F64] = {"F64", 8},   [TD_ST_I64] = {"I64", 8},
    [TD_ST_U64] = {"U64", 8},
};

const char *td_st_dtype_name(td_st_dtype dt)
{
    return (unsigned)dt < TD_ST_DTYPE_COUNT ? dtype_table[dt].name : "unknown";
}

size_t td_st_dtype_bytes(td_st_dtype dt)
{
    return (unsigned)dt < TD_ST_DTYPE_COUNT ? dtype_table[dt].bytes : 0;
}

td_status td_st_dtype_parse(const char *name, td_st_dtype *out)
{
    for (int i = 0; name && i < TD_ST_DTYPE_COUNT; i++)
        if (!strcmp(name, dtype_table[i].name)) {
            *out = (td_st_dtype)i;
            return TD_OK;
        }
    return td_error_set(TD_ERR_INVALID,
                        "unknown dtype \"%s\"; known: BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, "
                        "BF16, I32, U32, F32, F64, I64, U64",
                        name ? name : "");
}

static int is_float16_32(td_st_dtype dt)
{
    return dt == TD_ST_F32 || dt == TD_ST_BF16 || dt == TD_ST_F16;
}

int td_st_dtype_convertible(td_st_dtype a, td_st_dtype b)
{
    return ((unsigned)a < TD_ST_DTYPE_COUNT && a == b) || (is_float16_32(a) && is_float16_32(b));
}

static float load_as_f32(td_st_dtype dt, const unsigned char *p)
{
    if (dt == TD_ST_F32) {
        float x;
        memcpy(&x, p, 4);
        return x;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    return dt == TD_ST_BF16 ? td_f32_from_bf16(h) : td_f32_from_f16(h);
}

static void store_from_f32(td_st_dtype dt, unsigned char *p, float x)
{
    if (dt == TD_ST_F32) {
        memcpy(p, &x, 4);
        return;
    }
    uint16_t h = dt == TD_ST_BF16 ? td_bf16_from_f32(x) : td_f16_from_f32(x);
    memcpy(p, &h, 2);
}

/* n elements from src (src_dt) to dst (dst_dt), both among F32/BF16/F16.
 * Runs front to back one element at a time, so it may work in place when dst
 * starts at or before src and dst's elements are at least as wide (see
 * td_st_read: element i is read before element i is written, and never
 * overwrites an element not yet read). */
static void convert(td_st_dtype src_dt, const void *src, td_st_dtype dst_dt, void *dst, size_t n)
{
    const unsigned char *s = src;
    unsigned char *d = dst;
    const size_t ss = td_st_dtype_bytes(src_dt), ds = td_st_dtype_bytes(dst_dt);
    for (size_t i = 0; i < n; i++) store_from_f32(dst_dt, d + i * ds, load_as_f32(src_dt, s + i * ss));
}

/* --- small I/O helpers ---------------------------------------------------- */

static td_status pread_full(int fd, void *dst, size_t n, uint64_t off, const char *path)
{
    unsigned char *p = dst;
    while (n) {
        ssize_t got = pread(fd, p, n, (off_t)off);
        if (got < 0) {
            if (errno == EINTR) continue;
            return td_error_set(TD_ERR_IO, "cannot read %s at byte %llu: %s", path,
                                (unsigned long long)off, strerror(errno));
        }
        if (got == 0)
            return td_error_set(TD_ERR_IO,
                                "%s ends at byte %llu, before the %zu bytes asked for: the file was "
                                "truncated while open",
                                path, (unsigned long long)off, n);
        p += got;
        n -= (size_t)got;
        off += (uint64_t)got;
    }
    return TD_OK;
}

static td_status write_full(int fd, const void *src, size_t n, const char *path)
{
    const unsigned char *p = src;
    while (n) {
        ssize_t put = write(fd, p, n);
        if (put < 0) {
            if (errno == EINTR) continue;
            return td_error_set(TD_ERR_IO, "cannot write %s: %s; check free space and permissions",
                                path, strerror(errno));
        }
        p += put;
        n -= (size_t)put;
    }
    return TD_OK;
}

td_status td_fsync_parent_dir(const char *path)
{
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == path) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return td_error_set(TD_ERR_IO, "cannot open directory %s to sync it: %s", dir, strerror(errno));
    int rc = fsync(fd), err = errno;
    close(fd);
    /* Some filesystems cannot sync a directory (EINVAL); nothing more can be done there. */
    if (rc != 0 && err != EINVAL)
        return td_error_set(TD_ERR_IO, "cannot sync directory %s: %s", dir, strerror(err));
    return TD_OK;
}

static char *tmp_path_for(const char *path)
{
    size_t n = strlen(path) + 32;
    char *tmp = td_malloc(n, TD_ROLE_META);
    if (tmp) snprintf(tmp, n, "%s.tmp.%ld", path, (long)getpid());
    return tmp;
}

/* fsync fd, close it, rename tmp over path, sync the directory.  Closes fd and
 * removes tmp on failure. */
static td_status publish(int fd, const char *tmp, const char *path)
{
    td_status st = TD_OK;
    if (fsync(fd) != 0) {
        st = td_error_set(TD_ERR_IO, "cannot sync %s: %s", tmp, strerror(errno));
        close(fd);
        unlink(tmp);
        return st;
    }
    if (close(fd) != 0) {
        st = td_error_set(TD_ERR_IO, "cannot close %s: %s", tmp, strerror(errno));
        unlink(tmp);
        return st;
    }
    if (rename(tmp, path) != 0) {
        st = td_error_set(TD_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
        unlink(tmp);
        return st;
    }
    return td_fsync_parent_dir(path);
}

td_status td_write_file_atomic(const char *path, const void *bytes, size_t n_bytes)
{
    td_status st = TD_OK;
    char *tmp = tmp_path_for(path);
    if (!tmp) return td_error_prefix(TD_ERR_NOMEM, "writing %s: ", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        st = td_error_set(TD_ERR_IO, "cannot create %s: %s; check the directory exists and is writable",
                          tmp, strerror(errno));
        goto cleanup;
    }
    st = write_full(fd, bytes, n_bytes, tmp);
    if (st != TD_OK) {
        close(fd);
        unlink(tmp);
        goto cleanup;
    }
    st = publish(fd, tmp, path);
cleanup:
    td_free(tmp);
    return st;
}

/* --- reader --------------------------------------------------------------- */

struct td_st_reader {
    char *path;
    int fd;
    uint64_t file_bytes;
    size_t n_tensors;
    td_st_tensor *tensors;   /* by offset */
    size_t *by_name;         /* indices into tensors, sorted by name */
    size_t n_meta;
    const char **meta;       /* key, value, key, value, ... */
    char *pool;              /* every string */
};

#define FILE_FMT "safetensors file %s: "

const char *td_st_path(const td_st_reader *r) { return r->path; }
uint64_t td_st_file_bytes(const td_st_reader *r) { return r->file_bytes; }
size_t td_st_tensor_count(const td_st_reader *r) { return r->n_tensors; }
size_t td_st_metadata_count(const td_st_reader *r) { return r->n_meta; }

const td_st_tensor *td_st_tensor_at(const td_st_reader *r, size_t index)
{
    return index < r->n_tensors ? &r->tensors[index] : NULL;
}

void td_st_metadata_at(const td_st_reader *r, size_t index, const char **key, const char **value)
{
    *key = index < r->n_meta ? r->meta[2 * index] : NULL;
    *value = index < r->n_meta ? r->meta[2 * index + 1] : NULL;
}

const char *td_st_metadata(const td_st_reader *r, const char *key)
{
    for (size_t i = 0; i < r->n_meta; i++)
        if (!strcmp(r->meta[2 * i], key)) return r->meta[2 * i + 1];
    return NULL;
}

void td_st_close(td_st_reader *r)
{
    if (!r) return;
    if (r->fd >= 0) close(r->fd);
    td_free(r->path);
    td_free(r->tensors);
    td_free(r->by_name);
    td_free(r->meta);
    td_free(r->pool);
    td_free(r);
}

/* Valid UTF-8 without NUL bytes (the format requires UTF-8; a NUL would cut a C string). */
static int utf8_valid(const unsigned char *s, size_t n, size_t *bad)
{
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (c == 0 || len == 0 || i + len > n) break;
        size_t k = 1;
        while (k < len && (s[i + k] & 0xc0) == 0x80) k++;
        if (k < len) break;
        /* overlong forms, surrogates and code points above U+10FFFF */
        uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
        for (k = 1; k < len; k++) cp = cp << 6 | (s[i + k] & 0x3f);
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
            (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff)
            break;
        i += len;
    }
    *bad = i;
    return i == n;
}

/* A JSON number that is an integer in [0, 2^53] (exact in a double). */
static int json_u64(const cJSON *v, uint64_t *out)
{
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!(d >= 0 && d <= 9007199254740992.0) || d != floor(d)) return 0;
    *out = (uint64_t)d;
    return 1;
}

static int cmp_offset(const void *a, const void *b)
{
    const td_st_tensor *x = a, *y = b;
    if (x->file_offset != y->file_offset) return x->file_offset < y->file_offset ? -1 : 1;
    if (x->bytes != y->bytes) return x->bytes < y->bytes ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Merge sort of tensor indices by name (qsort has no context argument). */
static void sort_by_name(const td_st_tensor *t, size_t *idx, size_t *tmp, size_t n)
{
    if (n < 2) return;
    size_t h = n / 2;
    sort_by_name(t, idx, tmp, h);
    sort_by_name(t, idx + h, tmp, n - h);
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) tmp[k++] = strcmp(t[idx[i]].name, t[idx[j]].name) <= 0 ? idx[i++] : idx[j++];
    while (i < h) tmp[k++] = idx[i++];
    while (j < n) tmp[k++] = idx[j++];
    memcpy(idx, tmp, n * sizeof *idx);
}

/* One tensor entry of the header into *t (name already set). */
static td_status parse_tensor(const char *path, const cJSON *e, uint64_t data_bytes, td_st_tensor *t)
{
    td_status st = TD_OK;
    const char *nm = t->name;
    if (!cJSON_IsObject(e))
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "tensor '%s': entry is not a JSON object", path, nm);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt))
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "tensor '%s': no \"dtype\" string", path, nm);
    if (td_st_dtype_parse(dt->valuestring, &t->dtype) != TD_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", td_error_msg()); /* the message buffer is rewritten below */
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "tensor '%s': %s", path, nm, why);
    }
    if (!cJSON_IsArray(shape))
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "tensor '%s': no \"shape\" array", path, nm);
    int ndim = cJSON_GetArraySize(shape);
    if (ndim > TD_ST_MAX_DIMS)
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "tensor '%s': %d dimensions, tidal reads at most %d", path, nm,
                ndim, TD_ST_MAX_DIMS);
    t->ndim = ndim;
    uint64_t numel = 1;
    int overflow = 0;
    for (int d = 0; d < ndim; d++) {
        if (!json_u64(cJSON_GetArrayItem(shape, d), &t->shape[d]))
            TD_FAIL(TD_ERR_INVALID, FILE_FMT "tensor '%s': shape[%d] is not a non-negative integer",
                    path, nm, d);
        overflow |= __builtin_mul_overflow(numel, t->shape[d], &numel);
    }
    for (int d = ndim; d < TD_ST_MAX_DIMS; d++) t->shape[d] = 0;
    uint64_t bytes = 0;
    overflow |= __builtin_mul_overflow(numel, (uint64_t)td_st_dtype_bytes(t->dtype), &bytes);
    if (overflow)
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "tensor '%s': shape of %d dimensions overflows 64 bits "
                "(corrupt header)", path, nm, ndim);
    t->numel = numel;
    t->bytes = bytes;
    uint64_t begin, end;
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 ||
        !json_u64(cJSON_GetArrayItem(offs, 0), &begin) || !json_u64(cJSON_GetArrayItem(offs, 1), &end))
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "tensor '%s': \"data_offsets\" must be [begin, end], two "
                "non-negative integers", path, nm);
    if (end < begin)
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "tensor '%s': data_offsets [%llu, %llu] end before they begin",
                path, nm, (unsigned long long)begin, (unsigned long long)end);
    if (end > data_bytes)
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "tensor '%s': data_offsets [%llu, %llu] run past the end of "
                "the data (%llu bytes): the file is truncated or the header corrupt",
                path, nm, (unsigned long long)begin, (unsigned long long)end,
                (unsigned long long)data_bytes);
    if (end - begin != bytes)
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "tensor '%s': %llu elements of %s need %llu bytes but "
                "data_offsets [%llu, %llu] hold %llu",
                path, nm, (unsigned long long)numel, td_st_dtype_name(t->dtype),
                (unsigned long long)bytes, (unsigned long long)begin, (unsigned long long)end,
                (unsigned long long)(end - begin));
    t->file_offset = begin; /* relative for now; made absolute by the caller */
cleanup:
    return st;
}

/* Offsets sorted: each tensor starts where the previous one ended. */
static td_status check_coverage(const char *path, const td_st_tensor *t, size_t n, uint64_t data_bytes)
{
    uint64_t at = 0;
    for (size_t i = 0; i < n; i++) {
        if (t[i].file_offset < at)
            return td_error_set(TD_ERR_INVALID, FILE_FMT "tensor '%s' (bytes [%llu, %llu)) overlaps "
                                "tensor '%s' (which ends at %llu)",
                                path, t[i].name, (unsigned long long)t[i].file_offset,
                                (unsigned long long)(t[i].file_offset + t[i].bytes), t[i - 1].name,
                                (unsigned long long)at);
        if (t[i].file_offset > at)
            return td_error_set(TD_ERR_INVALID, FILE_FMT "data bytes [%llu, %llu) before tensor '%s' "
                                "belong to no tensor (the format allows no holes)",
                                path, (unsigned long long)at, (unsigned long long)t[i].file_offset,
                                t[i].name);
        at = t[i].file_offset + t[i].bytes;
    }
    if (at != data_bytes)
        return td_error_set(TD_ERR_INVALID, FILE_FMT "the last %llu data bytes belong to no tensor "
                            "(tensors end at %llu, the data is %llu bytes)",
                            path, (unsigned long long)(data_bytes - at), (unsigned long long)at,
                            (unsigned long long)data_bytes);
    return TD_OK;
}

static td_status parse_header(td_st_reader *r, const char *hdr, size_t hdr_bytes, uint64_t data_bytes)
{
    td_status st = TD_OK;
    const char *path = r->path;
    cJSON *root = NULL;
    size_t *tmp = NULL;
    size_t bad;
    if (!utf8_valid((const unsigned char *)hdr, hdr_bytes, &bad))
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "header byte %zu is not valid UTF-8 (or is a NUL byte): "
                "corrupt file", path, bad);
    if (hdr_bytes == 0 || hdr[0] != '{')
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "header does not start with '{': not a safetensors file", path);
    const char *end = NULL;
    root = cJSON_ParseWithLengthOpts(hdr, hdr_bytes, &end, 0);
    if (!root) {
        /* On failure cJSON points `end` at the error (its global error pointer is not thread-safe). */
        size_t pos = end && end >= hdr && end <= hdr + hdr_bytes ? (size_t)(end - hdr) : 0;
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "header is not valid JSON (error near byte %zu of %zu)", path,
                pos, hdr_bytes);
    }
    for (const char *p = end; p && p < hdr + hdr_bytes; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r')
            TD_FAIL(TD_ERR_INVALID, FILE_FMT "header has bytes after its JSON object (at byte %zu)",
                    path, (size_t)(p - hdr));
    if (!cJSON_IsObject(root))
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "header is not a JSON object", path);

    /* Count entries and string bytes, so one pool holds every string. */
    size_t n_tensors = 0, n_meta = 0, pool_bytes = 0;
    const cJSON *meta = NULL;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (!strcmp(e->string, "__metadata__")) {
            if (meta) TD_FAIL(TD_ERR_INVALID, FILE_FMT "header has two \"__metadata__\" entries", path);
            if (!cJSON_IsObject(e))
                TD_FAIL(TD_ERR_INVALID, FILE_FMT "\"__metadata__\" is not an object of strings", path);
            meta = e;
            for (const cJSON *m = e->child; m; m = m->next) {
                if (!cJSON_IsString(m))
                    TD_FAIL(TD_ERR_INVALID, FILE_FMT "__metadata__ value of \"%s\" is not a string",
                            path, m->string);
                n_meta++;
                pool_bytes += strlen(m->string) + strlen(m->valuestring) + 2;
            }
        } else {
            n_tensors++;
            pool_bytes += strlen(e->string) + 1;
        }
    }
    r->pool = td_malloc(pool_bytes + 1, TD_ROLE_META);
    r->tensors = td_calloc(n_tensors + 1, sizeof *r->tensors, TD_ROLE_META);
    r->by_name = td_malloc((n_tensors + 1) * sizeof *r->by_name, TD_ROLE_META);
    tmp = td_malloc((n_tensors + 1) * sizeof *tmp, TD_ROLE_META);
    r->meta = td_malloc((2 * n_meta + 1) * sizeof *r->meta, TD_ROLE_META);
    if (!r->pool || !r->tensors || !r->by_name || !tmp || !r->meta)
        TD_FAIL(TD_ERR_NOMEM, FILE_FMT "out of memory for a header of %zu tensors", path, n_tensors);
    char *pool = r->pool;
#define POOL_PUT(dst, s)                                                                           \
    do {                                                                                           \
        size_t len_ = strlen(s) + 1;                                                               \
        memcpy(pool, (s), len_);                                                                   \
        (dst) = pool;                                                                              \
        pool += len_;                                                                              \
    } while (0)
    if (meta)
        for (const cJSON *m = meta->child; m; m = m->next) {
            POOL_PUT(r->meta[2 * r->n_meta], m->string);
            POOL_PUT(r->meta[2 * r->n_meta + 1], m->valuestring);
            r->n_meta++;
        }
    for (const cJSON *e = root->child; e; e = e->next) {
        if (!strcmp(e->string, "__metadata__")) continue;
        td_st_tensor *t = &r->tensors[r->n_tensors];
        POOL_PUT(t->name, e->string);
        TD_TRY(parse_tensor(path, e, data_bytes, t));
        r->n_tensors++;
    }
#undef POOL_PUT
    qsort(r->tensors, r->n_tensors, sizeof *r->tensors, cmp_offset);
    TD_TRY(check_coverage(path, r->tensors, r->n_tensors, data_bytes));
    for (size_t i = 0; i < r->n_tensors; i++) r->by_name[i] = i;
    sort_by_name(r->tensors, r->by_name, tmp, r->n_tensors);
    for (size_t i = 1; i < r->n_tensors; i++)
        if (!strcmp(r->tensors[r->by_name[i]].name, r->tensors[r->by_name[i - 1]].name))
            TD_FAIL(TD_ERR_INVALID, FILE_FMT "tensor '%s' appears twice in the header", path,
                    r->tensors[r->by_name[i]].name);
cleanup:
    td_free(tmp);
    cJSON_Delete(root);
    return st;
}

td_status td_st_open(const char *path, td_st_reader **out)
{
    td_status st = TD_OK;
    char *hdr = NULL;
    *out = NULL;
    td_st_reader *r = td_calloc(1, sizeof *r, TD_ROLE_META);
    if (!r) return td_error_prefix(TD_ERR_NOMEM, "opening %s: ", path);
    r->fd = -1;
    if (!(r->path = td_strdup(path, TD_ROLE_META))) TD_FAIL(TD_ERR_NOMEM, "opening %s: out of memory", path);
    r->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (r->fd < 0)
        TD_FAIL(TD_ERR_IO, "cannot open safetensors file %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(r->fd, &sb) != 0) TD_FAIL(TD_ERR_IO, "cannot stat %s: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode)) TD_FAIL(TD_ERR_INVALID, FILE_FMT "not a regular file", path);
    r->file_bytes = (uint64_t)sb.st_size;
    if (r->file_bytes < 8)
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "only %llu bytes, shorter than the 8-byte header length "
                "(truncated, or not a safetensors file)", path, (unsigned long long)r->file_bytes);
    unsigned char len8[8];
    TD_TRY(pread_full(r->fd, len8, 8, 0, path));
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | len8[i];
    if (n > TD_ST_MAX_HEADER_BYTES)
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "header length %llu exceeds the %llu-byte limit (corrupt, or "
                "not a safetensors file)", path, (unsigned long long)n,
                (unsigned long long)TD_ST_MAX_HEADER_BYTES);
    if (n > r->file_bytes - 8)
        TD_FAIL(TD_ERR_INVALID, FILE_FMT "header length %llu runs past the end of the %llu-byte file "
                "(truncated or corrupt)", path, (unsigned long long)n, (unsigned long long)r->file_bytes);
    if (!(hdr = td_malloc((size_t)n + 1, TD_ROLE_META)))
        TD_FAIL(TD_ERR_NOMEM, FILE_FMT "out of memory for its %llu-byte header", path,
                (unsigned long long)n);
    TD_TRY(pread_full(r->fd, hdr, (size_t)n, 8, path));
    hdr[n] = '\0';
    TD_TRY(parse_header(r, hdr, (size_t)n, r->file_bytes - 8 - n));
    for (size_t i = 0; i < r->n_tensors; i++) r->tensors[i].file_offset += 8 + n;
    *out = r;
    r = NULL;
cleanup:
    td_free(hdr);
    td_st_close(r);
    return st;
}

const td_st_tensor *td_st_find(const td_st_reader *r, const char *name)
{
    size_t lo = 0, hi = r->n_tensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(r->tensors[r->by_name[mid]].name, name);
        if (c == 0) return &r->tensors[r->by_name[mid]];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

td_status td_st_get(const td_st_reader *r, const char *name, const td_st_tensor **out)
{
    *out = td_st_find(r, name);
    if (!*out)
        return td_error_set(TD_ERR_INVALID, FILE_FMT "has no tensor '%s' (%zu tensors in the file)",
                            r->path, name, r->n_tensors);
    return TD_OK;
}

static td_status check_tensor_of(const td_st_reader *r, const td_st_tensor *t)
{
    if (!t || t < r->tensors || t >= r->tensors + r->n_tensors)
        return td_error_set(TD_ERR_INVALID, FILE_FMT "tensor handle does not belong to this file",
                            r->path);
    return TD_OK;
}

td_status td_st_read_bytes(const td_st_reader *r, const td_st_tensor *t, uint64_t byte_offset,
                           size_t n_bytes, void *dst)
{
    td_status st = check_tensor_of(r, t);
    if (st != TD_OK) return st;
    if (byte_offset > t->bytes || n_bytes > t->bytes - byte_offset)
        return td_error_set(TD_ERR_INVALID, FILE_FMT "tensor '%s': bytes [%llu, +%zu) are outside its "
                            "%llu bytes", r->path, t->name, (unsigned long long)byte_offset, n_bytes,
                            (unsigned long long)t->bytes);
    return pread_full(r->fd, dst, n_bytes, t->file_offset + byte_offset, r->path);
}

td_status td_st_read(const td_st_reader *r, const td_st_tensor *t, uint64_t elem_offset,
                     size_t n_elems, td_st_dtype dst_dtype, void *dst)
{
    td_status st = check_tensor_of(r, t);
    if (st != TD_OK) return st;
    if (!td_st_dtype_convertible(t->dtype, dst_dtype))
        return td_error_set(TD_ERR_INVALID, FILE_FMT "tensor '%s' is %s and cannot be read as %s "
                            "(conversions are among F32, BF16 and F16)",
                            r->path, t->name, td_st_dtype_name(t->dtype), td_st_dtype_name(dst_dtype));
    if (elem_offset > t->numel || n_elems > t->numel - elem_offset)
        return td_error_set(TD_ERR_INVALID, FILE_FMT "tensor '%s': elements [%llu, +%zu) are outside "
                            "its %llu elements", r->path, t->name, (unsigned long long)elem_offset,
                            n_elems, (unsigned long long)t->numel);
    const size_t ss = td_st_dtype_bytes(t->dtype), ds = td_st_dtype_bytes(dst_dtype);
    const uint64_t at = t->file_offset + elem_offset * ss;
    if (t->dtype == dst_dtype) return pread_full(r->fd, dst, n_elems * ss, at, r->path);
    if (ds >= ss) {
        /* Widening or same width: read into dst's tail, convert in place front to back. */
        unsigned char *src = (unsigned char *)dst + n_elems * (ds - ss);
        st = pread_full(r->fd, src, n_elems * ss, at, r->path);
        if (st == TD_OK) convert(t->dtype, src, dst_dtype, dst, n_elems);
        return st;
    }
    /* Narrowing: through a bounded stack buffer. */
    unsigned char buf[64 * 1024];
    const size_t per = sizeof buf / ss;
    for (size_t done = 0; done < n_elems;) {
        size_t k = n_elems - done < per ? n_elems - done : per;
        st = pread_full(r->fd, buf, k * ss, at + done * ss, r->path);
        if (st != TD_OK) return st;
        convert(t->dtype, buf, dst_dtype, (unsigned char *)dst + done * ds, k);
        done += k;
    }
    return TD_OK;
}

/* --- writer --------------------------------------------------------------- */

#define STAGING_BYTES ((size_t)1 << 20)

typedef struct st_wtensor {
    char *name;
    td_st_dtype dtype;
    int ndim;
    uint64_t shape[TD_ST_MAX_DIMS];
    uint64_t bytes;
    uint64_t offset;          /* from the start of the data, once the header is made */
} st_wtensor;

struct td_st_writer {
    char *path, *tmp_path;
    int fd;
    int begun, failed;
    st_wtensor *t;
    size_t n, cap;
    char **meta;              /* key, value pairs */
    size_t n_meta, meta_cap;
    size_t cur;               /* tensor being filled */
    uint64_t cur_filled;      /* its bytes so far */
    unsigned char *buf;       /* staging */
    size_t buf_used;
    int shared;               /* positional mode: several writers, the file written in place */
    uint64_t data_start;      /* positional: 8 + header bytes */
    uint64_t written;         /* positional: bytes this writer put */
};

#define WFMT "safetensors writer for %s: "

size_t td_st_writer_next(const td_st_writer *w) { return w->cur; }

static void writer_free(td_st_writer *w)
{
    if (!w) return;
    for (size_t i = 0; i < w->n; i++) td_free(w->t[i].name);
    for (size_t i = 0; i < 2 * w->n_meta; i++) td_free(w->meta[i]);
    td_free(w->t);
    td_free(w->meta);
    td_free(w->buf);
    td_free(w->path);
    td_free(w->tmp_path);
    td_free(w);
}

void td_st_writer_abort(td_st_writer *w)
{
    if (!w) return;
    if (w->fd >= 0) {
        close(w->fd);
        if (!w->shared) unlink(w->tmp_path); /* a shared file belongs to the caller's directory */
    }
    writer_free(w);
}

td_status td_st_writer_create(const char *path, td_st_writer **out)
{
    *out = NULL;
    td_st_writer *w = td_calloc(1, sizeof *w, TD_ROLE_META);
    if (!w) return td_error_prefix(TD_ERR_NOMEM, "safetensors writer for %s: ", path);
    w->fd = -1;
    w->path = td_strdup(path, TD_ROLE_META);
    w->tmp_path = tmp_path_for(path);
    if (!w->path || !w->tmp_path) {
        writer_free(w);
        return td_error_set(TD_ERR_NOMEM, WFMT "out of memory", path);
    }
    *out = w;
    return TD_OK;
}

static td_status check_open_for_declarations(const td_st_writer *w, const char *what)
{
    if (w->failed)
        return td_error_set(TD_ERR_STATE, WFMT "an earlier call failed; abort the writer", w->path);
    if (w->begun)
        return td_error_set(TD_ERR_STATE, WFMT "cannot add %s after the header was written; declare "
                            "everything before the first write", w->path, what);
    return TD_OK;
}

static td_status grow(void **arr, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return TD_OK;
    size_t n = *cap ? *cap * 2 : 16;
    while (n < need) n *= 2;
    void *p = td_malloc(n * elem, TD_ROLE_META);
    if (!p) return TD_ERR_NOMEM;
    if (*cap) memcpy(p, *arr, *cap * elem);
    td_free(*arr);
    *arr = p;
    *cap = n;
    return TD_OK;
}

td_status td_st_writer_add_metadata(td_st_writer *w, const char *key, const char *value)
{
    td_status st = check_open_for_declarations(w, "metadata");
    if (st != TD_OK) return st;
    size_t bad;
    if (!key || !key[0] || !value)
        return td_error_set(TD_ERR_INVALID, WFMT "metadata needs a non-empty key and a value", w->path);
    if (!utf8_valid((const unsigned char *)key, strlen(key), &bad) ||
        !utf8_valid((const unsigned char *)value, strlen(value), &bad))
        return td_error_set(TD_ERR_INVALID, WFMT "metadata \"%s\" is not valid UTF-8", w->path, key);
    for (size_t i = 0; i < w->n_meta; i++)
        if (!strcmp(w->meta[2 * i], key))
            return td_error_set(TD_ERR_INVALID, WFMT "metadata key \"%s\" given twice", w->path, key);
    if (grow((void **)&w->meta, &w->meta_cap, 2 * (w->n_meta + 1), sizeof *w->meta) != TD_OK)
        return td_error_set(TD_ERR_NOMEM, WFMT "out of memory for metadata", w->path);
    char *k = td_strdup(key, TD_ROLE_META), *v = td_strdup(value, TD_ROLE_META);
    if (!k || !v) {
        td_free(k);
        td_free(v);
        return td_error_set(TD_ERR_NOMEM, WFMT "out of memory for metadata", w->path);
    }
    w->meta[2 * w->n_meta] = k;
    w->meta[2 * w->n_meta + 1] = v;
    w->n_meta++;
    return TD_OK;
}

td_status td_st_writer_declare(td_st_writer *w, const char *name, td_st_dtype dtype, int ndim,
                               const uint64_t *shape, size_t *index_out)
{
    td_status st = check_open_for_declarations(w, "tensors");
    if (st != TD_OK) return st;
    size_t bad;
    if (!name || !name[0] || !strcmp(name, "__metadata__"))
        return td_error_set(TD_ERR_INVALID, WFMT "tensor name \"%s\" is not allowed", w->path,
                            name ? name : "");
    if (!utf8_valid((const unsigned char *)name, strlen(name), &bad))
        return td_error_set(TD_ERR_INVALID, WFMT "tensor name \"%s\" is not valid UTF-8 (byte %zu)",
                            w->path, name, bad);
    if ((unsigned)dtype >= TD_ST_DTYPE_COUNT)
        return td_error_set(TD_ERR_INVALID, WFMT "tensor '%s': unknown dtype %d", w->path, name, dtype);
    if (ndim < 0 || ndim > TD_ST_MAX_DIMS)
        return td_error_set(TD_ERR_INVALID, WFMT "tensor '%s': %d dimensions (0..%d allowed)", w->path,
                            name, ndim, TD_ST_MAX_DIMS);
    uint64_t bytes = td_st_dtype_bytes(dtype);
    for (int d = 0; d < ndim; d++)
        if (shape[d] > 9007199254740992ull || __builtin_mul_overflow(bytes, shape[d], &bytes))
            return td_error_set(TD_ERR_INVALID, WFMT "tensor '%s': shape overflows", w->path, name);
    if (grow((void **)&w->t, &w->cap, w->n + 1, sizeof *w->t) != TD_OK)
        return td_error_set(TD_ERR_NOMEM, WFMT "out of memory for tensor '%s'", w->path, name);
    st_wtensor *t = &w->t[w->n];
    memset(t, 0, sizeof *t);
    if (!(t->name = td_strdup(name, TD_ROLE_META)))
        return td_error_set(TD_ERR_NOMEM, WFMT "out of memory for tensor '%s'", w->path, name);
    t->dtype = dtype;
    t->ndim = ndim;
    for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
    t->bytes = bytes;
    if (index_out) *index_out = w->n;
    w->n++;
    return TD_OK;
}

/* A growing string for the header. */
typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (b->len + n + 1 > cap) cap *= 2;
        char *p = td_malloc(cap, TD_ROLE_META);
        if (!p) {
            b->oom = 1;
            return;
        }
        if (b->len) memcpy(p, b->p, b->len);
        td_free(b->p);
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_u64(sbuf *b, uint64_t v)
{
    char tmp[24];
    sb_put(b, tmp, (size_t)snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v));
}

/* A JSON string literal: quotes, backslashes and control characters escaped. */
static void sb_json_string(sbuf *b, const char *s)
{
    sb_put(b, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char esc[8];
        if (*p == '"' || *p == '\\') {
            esc[0] = '\\';
            esc[1] = (char)*p;
            sb_put(b, esc, 2);
        } else if (*p < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", *p);
            sb_put(b, esc, 6);
        } else {
            sb_put(b, (const char *)p, 1);
        }
    }
    sb_put(b, "\"", 1);
}

static int cmp_str_ptr(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static td_status flush_buf(td_st_writer *w)
{
    td_status st = write_full(w->fd, w->buf, w->buf_used, w->tmp_path);
    w->buf_used = 0;
    return st;
}

static td_status put_bytes(td_st_writer *w, const void *src, size_t n)
{
    td_status st = TD_OK;
    if (w->buf_used + n <= STAGING_BYTES) {
        memcpy(w->buf + w->buf_used, src, n);
        w->buf_used += n;
        return TD_OK;
    }
    if ((st = flush_buf(w)) != TD_OK) return st;
    if (n >= STAGING_BYTES) return write_full(w->fd, src, n, w->tmp_path);
    memcpy(w->buf, src, n);
    w->buf_used = n;
    return TD_OK;
}

static void skip_empty(td_st_writer *w)
{
    while (w->cur < w->n && w->cur_filled == w->t[w->cur].bytes) {
        w->cur++;
        w->cur_filled = 0;
    }
}

/* The header of what is declared, padded so the data starts 8-byte
 * aligned; fills every tensor's offset.  Pure: every process that declared
 * the same gets the same bytes. */
static td_status make_header(td_st_writer *w, sbuf *b)
{
    td_status st = TD_OK;
    char **names = NULL;
    /* Unique names. */
    if (w->n > 1) {
        if (!(names = td_malloc(w->n * sizeof *names, TD_ROLE_META)))
            TD_FAIL(TD_ERR_NOMEM, WFMT "out of memory", w->path);
        for (size_t i = 0; i < w->n; i++) names[i] = w->t[i].name;
        qsort(names, w->n, sizeof *names, cmp_str_ptr);
        for (size_t i = 1; i < w->n; i++)
            if (!strcmp(names[i], names[i - 1]))
                TD_FAIL(TD_ERR_INVALID, WFMT "tensor '%s' declared twice", w->path, names[i]);
    }
    /* Written here rather than with cJSON: offsets are 64-bit integers, which
     * cJSON's doubles would round past 2^53 bytes. */
    sb_str(b, "{");
    if (w->n_meta) {
        sb_str(b, "\"__metadata__\":{");
        for (size_t i = 0; i < w->n_meta; i++) {
            if (i) sb_str(b, ",");
            sb_json_string(b, w->meta[2 * i]);
            sb_str(b, ":");
            sb_json_string(b, w->meta[2 * i + 1]);
        }
        sb_str(b, "}");
    }
    uint64_t off = 0;
    for (size_t i = 0; i < w->n; i++) {
        st_wtensor *t = &w->t[i];
        if (i || w->n_meta) sb_str(b, ",");
        sb_json_string(b, t->name);
        sb_str(b, ":{\"dtype\":\"");
        sb_str(b, td_st_dtype_name(t->dtype));
        sb_str(b, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++) {
            if (d) sb_str(b, ",");
            sb_u64(b, t->shape[d]);
        }
        sb_str(b, "],\"data_offsets\":[");
        sb_u64(b, off);
        sb_str(b, ",");
        t->offset = off;
        if (__builtin_add_overflow(off, t->bytes, &off))
            TD_FAIL(TD_ERR_INVALID, WFMT "total size overflows 64 bits", w->path);
        sb_u64(b, off);
        sb_str(b, "]}");
    }
    sb_str(b, "}");
    while (!b->oom && (8 + b->len) % 8) sb_str(b, " ");
    if (b->oom) TD_FAIL(TD_ERR_NOMEM, WFMT "out of memory for the header", w->path);
    if (b->len > TD_ST_MAX_HEADER_BYTES)
        TD_FAIL(TD_ERR_INVALID, WFMT "header of %zu bytes exceeds the format's %llu-byte limit "
                "(too many tensors)", w->path, b->len, (unsigned long long)TD_ST_MAX_HEADER_BYTES);
    if (!(w->buf = td_malloc(STAGING_BYTES, TD_ROLE_STAGING)))
        TD_FAIL(TD_ERR_NOMEM, WFMT "out of memory for the staging buffer", w->path);
cleanup:
    td_free(names);
    return st;
}

static void put_len8(unsigned char len8[8], uint64_t len)
{
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)(len >> (8 * i));
}

td_status td_st_writer_begin(td_st_writer *w)
{
    td_status st = TD_OK;
    sbuf b = {0};
    if (w->begun) return TD_OK;
    if ((st = check_open_for_declarations(w, "a header")) != TD_OK) return st;
    TD_TRY(make_header(w, &b));
    w->fd = open(w->tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w->fd < 0)
        TD_FAIL(TD_ERR_IO, "cannot create %s: %s; check the directory exists and is writable",
                w->tmp_path, strerror(errno));
    w->begun = 1;
    unsigned char len8[8];
    put_len8(len8, b.len);
    TD_TRY(put_bytes(w, len8, 8));
    TD_TRY(put_bytes(w, b.p, b.len));
    skip_empty(w);
cleanup:
    if (st != TD_OK) w->failed = 1;
    td_free(b.p);
    return st;
}

/* --- positional writing ---------------------------------------------------- */

static uint64_t hash_bytes(uint64_t h, const void *p, size_t n)
{
    for (const unsigned char *c = p; n--; c++) h = (h ^ *c) * 0x100000001b3ull;
    return h;
}

td_status td_st_writer_begin_shared(td_st_writer *w, int create, uint64_t *header_hash)
{
    td_status st = TD_OK;
    sbuf b = {0};
    if ((st = check_open_for_declarations(w, "a header")) != TD_OK) return st;
    TD_TRY(make_header(w, &b));
    w->shared = 1;
    w->begun = 1;
    w->cur = w->n; /* the streaming calls are closed */
    w->data_start = 8 + (uint64_t)b.len;
    uint64_t data = w->n ? w->t[w->n - 1].offset + w->t[w->n - 1].bytes : 0;
    unsigned char len8[8];
    put_len8(len8, b.len);
    if (header_hash) *header_hash = hash_bytes(hash_bytes(0xcbf29ce484222325ull, len8, 8), b.p, b.len);
    w->fd = open(w->path, create ? O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC : O_WRONLY | O_CLOEXEC, 0644);
    if (w->fd < 0)
        TD_FAIL(TD_ERR_IO, "cannot %s %s: %s; check the directory exists and is writable",
                create ? "create" : "open", w->path, strerror(errno));
    if (create) {
        TD_TRY(write_full(w->fd, len8, 8, w->path));
        TD_TRY(write_full(w->fd, b.p, b.len, w->path));
        if (ftruncate(w->fd, (off_t)(w->data_start + data)) != 0)
            TD_FAIL(TD_ERR_IO, "cannot size %s to %llu bytes: %s; check free space", w->path,
                    (unsigned long long)(w->data_start + data), strerror(errno));
    }
cleanup:
    if (st != TD_OK) w->failed = 1;
    td_free(b.p);
    return st;
}

static td_status check_range(td_st_writer *w, size_t index, uint64_t byte_offset, uint64_t n_bytes)
{
    if (!w->shared || w->failed)
        return td_error_set(TD_ERR_STATE, WFMT "%s", w->path, w->failed ? "an earlier call failed; abort the writer"
                            : "positional writes need td_st_writer_begin_shared first");
    if (index >= w->n)
        return td_error_set(TD_ERR_INVALID, WFMT "tensor index %zu out of range (%zu declared)", w->path, index, w->n);
    const st_wtensor *t = &w->t[index];
    if (byte_offset > t->bytes || n_bytes > t->bytes - byte_offset)
        return td_error_set(TD_ERR_INVALID, WFMT "bytes [%llu, +%llu) run past the end of tensor '%s' (%llu bytes)",
                            w->path, (unsigned long long)byte_offset, (unsigned long long)n_bytes, t->name,
                            (unsigned long long)t->bytes);
    return TD_OK;
}

static td_status pwrite_full(td_st_writer *w, const void *src, size_t n, uint64_t off)
{
    const unsigned char *p = src;
    while (n) {
        ssize_t put = pwrite(w->fd, p, n, (off_t)off);
        if (put < 0) {
            if (errno == EINTR) continue;
            w->failed = 1;
            return td_error_set(TD_ERR_IO, "cannot write %s at byte %llu: %s; check free space", w->path,
                                (unsigned long long)off, strerror(errno));
        }
        p += put;
        off += (uint64_t)put;
        n -= (size_t)put;
        w->written += (uint64_t)put;
    }
    return TD_OK;
}

td_status td_st_writer_pwrite(td_st_writer *w, size_t index, uint64_t byte_offset, const void *bytes, size_t n_bytes)
{
    td_status st = check_range(w, index, byte_offset, n_bytes);
    return st ? st : pwrite_full(w, bytes, n_bytes, w->data_start + w->t[index].offset + byte_offset);
}

td_status td_st_writer_pwrite_convert(td_st_writer *w, size_t index, uint64_t elem_offset, td_st_dtype src_dtype,
                                      const void *src, size_t n_elems)
{
    if (index >= w->n) return check_range(w, index, 0, 0);
    const st_wtensor *t = &w->t[index];
    const size_t ds = td_st_dtype_bytes(t->dtype), ss = td_st_dtype_bytes(src_dtype);
    uint64_t off, n_bytes;
    if (__builtin_mul_overflow(elem_offset, (uint64_t)ds, &off)) off = UINT64_MAX;
    if (__builtin_mul_overflow((uint64_t)n_elems, (uint64_t)ds, &n_bytes)) n_bytes = UINT64_MAX;
    td_status st = check_range(w, index, off, n_bytes);
    if (st) return st;
    if (src_dtype == t->dtype) return pwrite_full(w, src, n_bytes, w->data_start + t->offset + off);
    if (!td_st_dtype_convertible(src_dtype, t->dtype))
        return td_error_set(TD_ERR_INVALID, WFMT "tensor '%s' is %s; %s data cannot be converted to it",
                            w->path, t->name, td_st_dtype_name(t->dtype), td_st_dtype_name(src_dtype));
    const unsigned char *s = src;
    for (size_t done = 0; done < n_elems;) {
        size_t k = n_elems - done < STAGING_BYTES / ds ? n_elems - done : STAGING_BYTES / ds;
        convert(src_dtype, s + done * ss, t->dtype, w->buf, k);
        if ((st = pwrite_full(w, w->buf, k * ds, w->data_start + t->offset + off + done * ds))) return st;
        done += k;
    }
    return TD_OK;
}

uint64_t td_st_writer_written(const td_st_writer *w) { return w->written; }

uint64_t td_st_writer_data_bytes(const td_st_writer *w)
{
    return w->n && w->begun ? w->t[w->n - 1].offset + w->t[w->n - 1].bytes : 0;
}

td_status td_st_writer_finish_shared(td_st_writer *w)
{
    td_status st = TD_OK;
    if (!w->shared || w->failed)
        st = td_error_set(TD_ERR_STATE, WFMT "%s", w->path, w->failed ? "an earlier call failed; nothing is complete"
                          : "not in positional mode (td_st_writer_begin_shared)");
    else if (fsync(w->fd) != 0)
        st = td_error_set(TD_ERR_IO, "cannot sync %s: %s", w->path, strerror(errno));
    if (w->fd >= 0 && close(w->fd) != 0 && st == TD_OK)
        st = td_error_set(TD_ERR_IO, "cannot close %s: %s", w->path, strerror(errno));
    w->fd = -1;
    writer_free(w);
    return st;
}

/* Shared checks of a piece for tensor `index`: order and size. */
static td_status check_piece(td_st_writer *w, size_t index, uint64_t n_bytes)
{
    td_status st = TD_OK;
    if (!w->begun && !w->failed && (st = td_st_writer_begin(w)) != TD_OK) return st;
    if (n_bytes == 0 && index < w->n && !w->failed) return TD_OK; /* e.g. a zero-size tensor */
    if (w->failed)
        return td_error_set(TD_ERR_STATE, WFMT "an earlier call failed; abort the writer", w->path);
    if (index >= w->n)
        return td_error_set(TD_ERR_INVALID, WFMT "tensor index %zu out of range (%zu declared)",
                            w->path, index, w->n);
    if (w->cur >= w->n)
        return td_error_set(TD_ERR_STATE, WFMT "every tensor is already complete; bytes for '%s' are "
                            "one piece too many", w->path, w->t[index].name);
    const st_wtensor *c = &w->t[w->cur];
    if (index != w->cur)
        return td_error_set(TD_ERR_STATE, WFMT "bytes for tensor '%s' (index %zu) arrived while tensor "
                            "'%s' (index %zu) still needs %llu of its %llu bytes; write tensors in "
                            "declaration order", w->path, w->t[index].name, index, c->name, w->cur,
                            (unsigned long long)(c->bytes - w->cur_filled),
                            (unsigned long long)c->bytes);
    if (n_bytes > c->bytes - w->cur_filled)
        return td_error_set(TD_ERR_INVALID, WFMT "a piece of %llu bytes runs past the end of tensor "
                            "'%s' (%llu of %llu bytes left)", w->path, (unsigned long long)n_bytes,
                            c->name, (unsigned long long)(c->bytes - w->cur_filled),
                            (unsigned long long)c->bytes);
    return TD_OK;
}

td_status td_st_writer_write(td_st_writer *w, size_t index, const void *bytes, size_t n_bytes)
{
    td_status st = check_piece(w, index, n_bytes);
    if (st != TD_OK) return st;
    if ((st = put_bytes(w, bytes, n_bytes)) != TD_OK) {
        w->failed = 1;
        return st;
    }
    w->cur_filled += n_bytes;
    skip_empty(w);
    return TD_OK;
}

td_status td_st_writer_write_convert(td_st_writer *w, size_t index, td_st_dtype src_dtype,
                                     const void *src, size_t n_elems)
{
    if (index < w->n && src_dtype == w->t[index].dtype)
        return td_st_writer_write(w, index, src, n_elems * td_st_dtype_bytes(src_dtype));
    const size_t ds = index < w->n ? td_st_dtype_bytes(w->t[index].dtype) : 0;
    uint64_t n_bytes;
    if (__builtin_mul_overflow((uint64_t)n_elems, (uint64_t)ds, &n_bytes)) n_bytes = UINT64_MAX;
    td_status st = check_piece(w, index, n_bytes);
    if (st != TD_OK) return st;
    const st_wtensor *t = &w->t[index];
    if (!td_st_dtype_convertible(src_dtype, t->dtype))
        return td_error_set(TD_ERR_INVALID, WFMT "tensor '%s' is %s; %s data cannot be converted to it",
                            w->path, t->name, td_st_dtype_name(t->dtype), td_st_dtype_name(src_dtype));
    if (w->cur_filled % ds)
        return td_error_set(TD_ERR_INVALID, WFMT "tensor '%s': a converted piece must start at an "
                            "element boundary (byte %llu is inside an element)", w->path, t->name,
                            (unsigned long long)w->cur_filled);
    const size_t ss = td_st_dtype_bytes(src_dtype);
    const unsigned char *s = src;
    for (size_t done = 0; done < n_elems;) {
        if (w->buf_used + ds > STAGING_BYTES && (st = flush_buf(w)) != TD_OK) {
            w->failed = 1;
            return st;
        }
        size_t room = (STAGING_BYTES - w->buf_used) / ds;
        size_t k = n_elems - done < room ? n_elems - done : room;
        convert(src_dtype, s + done * ss, t->dtype, w->buf + w->buf_used, k);
        w->buf_used += k * ds;
        done += k;
    }
    w->cur_filled += n_bytes;
    skip_empty(w);
    return TD_OK;
}

td_status td_st_writer_commit(td_st_writer *w)
{
    td_status st = TD_OK;
    if (!w->begun && !w->failed) TD_TRY(td_st_writer_begin(w));
    if (w->failed)
        TD_FAIL(TD_ERR_STATE, WFMT "an earlier call failed; nothing was written", w->path);
    if (w->cur < w->n)
        TD_FAIL(TD_ERR_STATE, WFMT "tensor '%s' (index %zu of %zu) has %llu of its %llu bytes; every "
                "tensor must be complete before commit", w->path, w->t[w->cur].name, w->cur, w->n,
                (unsigned long long)w->cur_filled, (unsigned long long)w->t[w->cur].bytes);
    TD_TRY(flush_buf(w));
    int fd = w->fd;
    w->fd = -1; /* publish closes it and removes the temporary file on failure */
    TD_TRY(publish(fd, w->tmp_path, w->path));
cleanup:
    td_st_writer_abort(w);
    return st;
}
