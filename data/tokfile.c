/* Token files: CRC-32, the atomic writer and the validating, memory-mapping
 * reader (format in include/tidal/data.h and docs/data.md).
 *
 * The reader trusts nothing: every header field is checked before it is
 * used to size anything, the file size must match the token count exactly,
 * and one pass over the payload checks both its CRC and that every id is
 * inside the vocabulary (a bad id would index past the embedding table). */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tidal/alloc.h"
#include "tidal/data.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "token files are read in place and assume a little-endian host"
#endif

#define WRITE_BUF_BYTES ((size_t)1 << 20)
#define VERIFY_BLOCK_BYTES ((size_t)64 << 10)

/* ---- CRC-32 (reflected 0xEDB88320, slicing by 8) -------------------------- */

static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1)));
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

uint32_t td_crc32(uint32_t crc, const void *data, size_t bytes)
{
    pthread_once(&crc_once, crc_init);
    const unsigned char *p = data;
    uint32_t c = ~crc;
    while (bytes >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^ crc_table[5][(lo >> 16) & 0xFF] ^
            crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
            crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
        p += 8;
        bytes -= 8;
    }
    while (bytes--) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xFF];
    return ~c;
}

uint32_t td_tokfile_token_bytes_for(uint32_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

/* ---- the header ---------------------------------------------------------- */

static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static void header_encode(const td_tokfile_info *info, unsigned char h[TD_TOKFILE_HEADER_BYTES])
{
    memset(h, 0, TD_TOKFILE_HEADER_BYTES);
    memcpy(h, TD_TOKFILE_MAGIC, 8);
    put32(h + 8, info->version);
    put32(h + 12, TD_TOKFILE_HEADER_BYTES);
    put32(h + 16, info->token_bytes);
    put32(h + 20, (uint32_t)info->tokenizer);
    put32(h + 24, info->vocab_size);
    put32(h + 28, info->eot);
    put64(h + 32, info->token_count);
    put32(h + 40, info->payload_crc32);
    put32(h + 44, info->row_tokens);
    put32(h + 48, (uint32_t)info->has_flags);
    put32(h + 52, info->flags_crc32);
    put32(h + 60, td_crc32(0, h, 60));
}

/* Checks the header against the file's size; fills *info. */
static td_status header_decode(const unsigned char *h, size_t file_bytes, const char *name, td_tokfile_info *info)
{
    if (file_bytes < TD_TOKFILE_HEADER_BYTES)
        return td_error_set(TD_ERR_INVALID, "token file '%s' is %zu bytes, shorter than the %d-byte header: it is "
                            "truncated or not a token file (re-run tidal prepare)", name, file_bytes,
                            TD_TOKFILE_HEADER_BYTES);
    if (memcmp(h, TD_TOKFILE_MAGIC, 8))
        return td_error_set(TD_ERR_INVALID, "'%s' is not a tidal token file (its first bytes are not \"%s\"); "
                            "make one with tidal prepare", name, TD_TOKFILE_MAGIC);
    uint32_t version = get32(h + 8);
    if (version != 1 && version != 2)
        return td_error_set(TD_ERR_INVALID, "token file '%s' has format version %u; this tidal reads versions 1 "
                            "and 2 (re-run tidal prepare with this tidal)", name, version);
    uint32_t header_bytes = get32(h + 12);
    if (header_bytes != TD_TOKFILE_HEADER_BYTES)
        return td_error_set(TD_ERR_INVALID, "token file '%s': header size %u, expected %d: the header is corrupt",
                            name, header_bytes, TD_TOKFILE_HEADER_BYTES);
    uint32_t stored = get32(h + 60), computed = td_crc32(0, h, 60);
    if (stored != computed)
        return td_error_set(TD_ERR_INVALID, "token file '%s': header checksum mismatch (stored %08x, computed "
                            "%08x): the header is corrupt (re-run tidal prepare)", name, stored, computed);
    for (int i = version == 1 ? 44 : 56; i < 60; i++)
        if (h[i])
            return td_error_set(TD_ERR_INVALID, "token file '%s': reserved header byte %d is not zero", name, i);
    info->version = version;
    info->token_bytes = get32(h + 16);
    uint32_t kind = get32(h + 20);
    info->tokenizer = (td_tokenizer_kind)kind;
    info->vocab_size = get32(h + 24);
    info->eot = get32(h + 28);
    info->token_count = get64(h + 32);
    info->payload_crc32 = get32(h + 40);
    info->row_tokens = get32(h + 44);
    uint32_t has_flags = get32(h + 48);
    info->has_flags = has_flags == 1;
    info->flags_crc32 = get32(h + 52);
    if (has_flags > 1)
        return td_error_set(TD_ERR_INVALID, "token file '%s': the flags field is %u (0 or 1)", name, has_flags);
    if (!info->has_flags && info->flags_crc32)
        return td_error_set(TD_ERR_INVALID, "token file '%s': a flags checksum without flags", name);
    if (kind != TD_TOKENIZER_BYTE && kind != TD_TOKENIZER_GPT2 && kind != TD_TOKENIZER_JSON)
        return td_error_set(TD_ERR_INVALID, "token file '%s': unknown tokenizer kind %u", name, kind);
    if (info->vocab_size == 0 || info->vocab_size > TD_TOKENIZER_MAX_VOCAB)
        return td_error_set(TD_ERR_INVALID, "token file '%s': vocab size %u outside [1, %u]", name,
                            info->vocab_size, TD_TOKENIZER_MAX_VOCAB);
    if (info->eot >= info->vocab_size)
        return td_error_set(TD_ERR_INVALID, "token file '%s': end-of-text id %u is not below vocab size %u", name,
                            info->eot, info->vocab_size);
    if (info->token_bytes != td_tokfile_token_bytes_for(info->vocab_size))
        return td_error_set(TD_ERR_INVALID, "token file '%s': %u-byte tokens, but a vocabulary of %u needs %u", name,
                            info->token_bytes, info->vocab_size, td_tokfile_token_bytes_for(info->vocab_size));
    uint64_t payload = file_bytes - TD_TOKFILE_HEADER_BYTES;
    const uint64_t per_token = info->token_bytes + (uint64_t)info->has_flags;
    if (info->token_count > payload / per_token)
        return td_error_set(TD_ERR_INVALID, "token file '%s' is truncated: the header says %llu tokens (%llu "
                            "bytes%s) but the file holds %llu bytes after its header (re-run tidal prepare)", name,
                            (unsigned long long)info->token_count, (unsigned long long)(info->token_count * per_token),
                            info->has_flags ? " with their flags" : "", (unsigned long long)payload);
    if (info->token_count * per_token != payload)
        return td_error_set(TD_ERR_INVALID, "token file '%s' has %llu bytes after its %llu tokens%s: trailing "
                            "garbage or a corrupt header", name,
                            (unsigned long long)(payload - info->token_count * per_token),
                            (unsigned long long)info->token_count, info->has_flags ? " and their flags" : "");
    if (info->row_tokens && info->token_count % info->row_tokens)
        return td_error_set(TD_ERR_INVALID, "token file '%s': %llu tokens are not whole rows of %u", name,
                            (unsigned long long)info->token_count, info->row_tokens);
    return TD_OK;
}

/* ---- the writer ---------------------------------------------------------- */

struct td_tokfile_writer {
    char *path, *tmp_path;
    int fd;
    td_tokfile_info info;
    unsigned char *buf;
    size_t buf_used;
    /* the flag bytes go to a file of their own, appended to the tokens at commit */
    char *flags_path;
    int flags_fd;
    unsigned char *fbuf;
    size_t fbuf_used;
};

static td_status write_all(int fd, const void *data, size_t n, const char *path)
{
    const char *p = data;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0)
            return td_error_set(TD_ERR_IO, "writing '%s' failed: %s", path, strerror(errno));
        p += w;
        n -= (size_t)w;
    }
    return TD_OK;
}

static td_status writer_flush(td_tokfile_writer *w)
{
    td_status st = write_all(w->fd, w->buf, w->buf_used, w->tmp_path);
    w->buf_used = 0;
    return st;
}

static void writer_free(td_tokfile_writer *w)
{
    if (w->fd >= 0) close(w->fd);
    if (w->tmp_path) unlink(w->tmp_path);
    if (w->flags_fd >= 0) close(w->flags_fd);
    if (w->flags_path) unlink(w->flags_path);
    td_free(w->path);
    td_free(w->tmp_path);
    td_free(w->flags_path);
    td_free(w->buf);
    td_free(w->fbuf);
    td_free(w);
}

td_status td_tokfile_writer_open(const char *path, td_tokenizer_kind tokenizer, uint32_t vocab_size, uint32_t eot,
                                 td_tokfile_writer **out)
{
    static unsigned counter;
    td_status st = TD_OK;
    *out = NULL;
    if (vocab_size == 0 || vocab_size > TD_TOKENIZER_MAX_VOCAB || eot >= vocab_size)
        return td_error_set(TD_ERR_INVALID, "token file '%s': vocab size %u / end-of-text %u out of range", path,
                            vocab_size, eot);
    td_tokfile_writer *w = td_calloc(1, sizeof *w, TD_ROLE_META);
    if (!w) return td_error_set(TD_ERR_NOMEM, "out of memory opening token file '%s'", path);
    w->fd = w->flags_fd = -1;
    w->info = (td_tokfile_info){.version = 1, .token_bytes = td_tokfile_token_bytes_for(vocab_size),
                                .tokenizer = tokenizer, .vocab_size = vocab_size, .eot = eot};
    size_t tmp_bytes = strlen(path) + 48;
    w->path = td_strdup(path, TD_ROLE_META);
    w->tmp_path = td_malloc(tmp_bytes, TD_ROLE_META);
    w->buf = td_malloc(WRITE_BUF_BYTES, TD_ROLE_META);
    if (!w->path || !w->tmp_path || !w->buf) TD_FAIL(TD_ERR_NOMEM, "out of memory opening token file '%s'", path);
    for (int tries = 0; w->fd < 0; tries++) {
        snprintf(w->tmp_path, tmp_bytes, "%s.tmp.%d.%u", path, (int)getpid(),
                 __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED));
        w->fd = open(w->tmp_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (w->fd < 0 && (errno != EEXIST || tries > 100)) {
            int e = errno;
            td_free(w->tmp_path);
            w->tmp_path = NULL;
            TD_FAIL(TD_ERR_IO, "cannot create the token file '%s' (temporary file beside it): %s%s", path,
                    strerror(e), e == ENOENT ? " (does its folder exist?)" : "");
        }
    }
    unsigned char zero[TD_TOKFILE_HEADER_BYTES] = {0};
    TD_TRY(write_all(w->fd, zero, sizeof zero, w->tmp_path));
    *out = w;
    w = NULL;
cleanup:
    if (w) writer_free(w);
    return st;
}

td_status td_tokfile_writer_set_layout(td_tokfile_writer *w, uint32_t row_tokens, int with_flags)
{
    if (w->info.token_count)
        return td_error_set(TD_ERR_STATE, "token file '%s': the layout is set before the first token", w->path);
    w->info.row_tokens = row_tokens;
    w->info.has_flags = with_flags != 0;
    w->info.version = row_tokens || with_flags ? 2 : 1;
    if (!with_flags || w->flags_fd >= 0) return TD_OK;
    size_t len = strlen(w->tmp_path) + 8;
    w->flags_path = td_malloc(len, TD_ROLE_META);
    w->fbuf = td_malloc(WRITE_BUF_BYTES, TD_ROLE_META);
    if (!w->flags_path || !w->fbuf) return td_error_set(TD_ERR_NOMEM, "out of memory opening token file '%s'", w->path);
    snprintf(w->flags_path, len, "%s.flags", w->tmp_path);
    w->flags_fd = open(w->flags_path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (w->flags_fd < 0) {
        int e = errno;
        td_free(w->flags_path);
        w->flags_path = NULL;
        return td_error_set(TD_ERR_IO, "cannot create '%s.flags' beside the token file '%s': %s", w->tmp_path, w->path,
                            strerror(e));
    }
    return TD_OK;
}

td_status td_tokfile_writer_append(td_tokfile_writer *w, const uint32_t *ids, size_t n)
{
    if (w->info.has_flags)
        return td_error_set(TD_ERR_STATE, "token file '%s' has a flag byte per token: append with flags", w->path);
    return td_tokfile_writer_append_flagged(w, ids, NULL, n);
}

td_status td_tokfile_writer_append_flagged(td_tokfile_writer *w, const uint32_t *ids, const uint8_t *flags, size_t n)
{
    const uint32_t width = w->info.token_bytes;
    if (w->info.has_flags != (flags != NULL))
        return td_error_set(TD_ERR_STATE, "token file '%s': flags %s, but the layout has %s", w->path,
                            flags ? "given" : "missing", w->info.has_flags ? "a flag byte per token" : "none");
    for (size_t i = 0; flags && i < n; i++) {
        if (flags[i] & ~(TD_TOKFLAG_TARGET | TD_TOKFLAG_DOC_START | TD_TOKFLAG_PAD))
            return td_error_set(TD_ERR_INVALID, "token file '%s': flag byte %#x has unknown bits", w->path, flags[i]);
        if (w->fbuf_used == WRITE_BUF_BYTES) {
            w->info.flags_crc32 = td_crc32(w->info.flags_crc32, w->fbuf, w->fbuf_used);
            td_status st = write_all(w->flags_fd, w->fbuf, w->fbuf_used, w->flags_path);
            w->fbuf_used = 0;
            if (st != TD_OK) return st;
        }
        w->fbuf[w->fbuf_used++] = flags[i];
    }
    for (size_t i = 0; i < n; i++) {
        if (ids[i] >= w->info.vocab_size)
            return td_error_set(TD_ERR_INVALID, "token file '%s': id %u is not below vocab size %u", w->path, ids[i],
                                w->info.vocab_size);
        if (w->buf_used + width > WRITE_BUF_BYTES) {
            w->info.payload_crc32 = td_crc32(w->info.payload_crc32, w->buf, w->buf_used);
            td_status st = writer_flush(w);
            if (st != TD_OK) return st;
        }
        if (width == 2) {
            uint16_t v = (uint16_t)ids[i];
            memcpy(w->buf + w->buf_used, &v, 2);
        } else {
            memcpy(w->buf + w->buf_used, &ids[i], 4);
        }
        w->buf_used += width;
    }
    w->info.token_count += n;
    return TD_OK;
}

uint64_t td_tokfile_writer_count(const td_tokfile_writer *w) { return w->info.token_count; }

/* fsync the folder holding `path` so the rename itself is durable. */
static td_status sync_parent(const char *path)
{
    td_status st = TD_OK;
    char *copy = td_strdup(path, TD_ROLE_META);
    if (!copy) return td_error_set(TD_ERR_NOMEM, "out of memory");
    int fd = open(dirname(copy), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fsync(fd) != 0)
        st = td_error_set(TD_ERR_IO, "cannot sync the folder of '%s': %s", path, strerror(errno));
    if (fd >= 0) close(fd);
    td_free(copy);
    return st;
}

td_status td_tokfile_writer_commit(td_tokfile_writer *w)
{
    td_status st = TD_OK;
    unsigned char h[TD_TOKFILE_HEADER_BYTES];
    w->info.payload_crc32 = td_crc32(w->info.payload_crc32, w->buf, w->buf_used);
    TD_TRY(writer_flush(w));
    if (w->info.row_tokens && w->info.token_count % w->info.row_tokens)
        TD_FAIL(TD_ERR_STATE, "token file '%s': %llu tokens are not whole rows of %u", w->path,
                (unsigned long long)w->info.token_count, w->info.row_tokens);
    if (w->info.has_flags) { /* the flag bytes after the tokens */
        w->info.flags_crc32 = td_crc32(w->info.flags_crc32, w->fbuf, w->fbuf_used);
        TD_TRY(write_all(w->flags_fd, w->fbuf, w->fbuf_used, w->flags_path));
        if (lseek(w->flags_fd, 0, SEEK_SET) != 0)
            TD_FAIL(TD_ERR_IO, "reading back '%s' failed: %s", w->flags_path, strerror(errno));
        for (;;) {
            ssize_t r = read(w->flags_fd, w->buf, WRITE_BUF_BYTES);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) TD_FAIL(TD_ERR_IO, "reading back '%s' failed: %s", w->flags_path, strerror(errno));
            if (r == 0) break;
            TD_TRY(write_all(w->fd, w->buf, (size_t)r, w->tmp_path));
        }
    }
    header_encode(&w->info, h);
    if (pwrite(w->fd, h, sizeof h, 0) != (ssize_t)sizeof h)
        TD_FAIL(TD_ERR_IO, "writing the header of '%s' failed: %s", w->tmp_path, strerror(errno));
    if (fsync(w->fd) != 0) TD_FAIL(TD_ERR_IO, "fsync of '%s' failed: %s", w->tmp_path, strerror(errno));
    if (close(w->fd) != 0) {
        w->fd = -1;
        TD_FAIL(TD_ERR_IO, "closing '%s' failed: %s", w->tmp_path, strerror(errno));
    }
    w->fd = -1;
    if (rename(w->tmp_path, w->path) != 0)
        TD_FAIL(TD_ERR_IO, "cannot move the finished token file to '%s': %s", w->path, strerror(errno));
    td_free(w->tmp_path);
    w->tmp_path = NULL; /* renamed: nothing to remove */
    TD_TRY(sync_parent(w->path));
cleanup:
    writer_free(w);
    return st;
}

void td_tokfile_writer_abort(td_tokfile_writer *w)
{
    if (w) writer_free(w);
}

/* ---- the reader ---------------------------------------------------------- */

struct td_tokfile {
    char *name;
    const unsigned char *data; /* whole file */
    size_t bytes;
    int mapped;
    td_tokfile_info info;
};

/* One pass: CRC of the payload and the largest id in it. */
static td_status verify_flags(td_tokfile *f);

static td_status verify_payload(td_tokfile *f)
{
    const unsigned char *p = f->data + TD_TOKFILE_HEADER_BYTES;
    const uint64_t n = f->info.token_count;
    const uint32_t width = f->info.token_bytes, vocab = f->info.vocab_size;
    const uint64_t per_block = VERIFY_BLOCK_BYTES / width;
    uint32_t crc = 0;
    for (uint64_t start = 0; start < n; start += per_block) {
        uint64_t count = n - start < per_block ? n - start : per_block;
        const unsigned char *b = p + start * width;
        crc = td_crc32(crc, b, count * width);
        uint32_t max = 0;
        uint64_t bad = UINT64_MAX;
        if (width == 2) {
            for (uint64_t i = 0; i < count; i++) {
                uint16_t v;
                memcpy(&v, b + 2 * i, 2);
                if (v > max) max = v;
            }
        } else {
            for (uint64_t i = 0; i < count; i++) {
                uint32_t v;
                memcpy(&v, b + 4 * i, 4);
                if (v > max) max = v;
            }
        }
        if (max >= vocab) { /* rare: find where, for the message */
            for (uint64_t i = 0; i < count && bad == UINT64_MAX; i++)
                if (td_tokfile_at(f, start + i) >= vocab) bad = start + i;
            return td_error_set(TD_ERR_INVALID, "token file '%s': token %llu is %u, not below the vocab size %u: the "
                                "file is corrupt (re-run tidal prepare)", f->name, (unsigned long long)bad,
                                td_tokfile_at(f, bad), vocab);
        }
    }
    if (crc != f->info.payload_crc32)
        return td_error_set(TD_ERR_INVALID, "token file '%s': token data checksum mismatch (stored %08x, computed "
                            "%08x): the file is corrupt (re-run tidal prepare)", f->name, f->info.payload_crc32, crc);
    return verify_flags(f);
}

/* The flag bytes: their CRC, known bits, padding never a target, every row
 * starting a document; and the counts of documents, targets and padding. */
static td_status verify_flags(td_tokfile *f)
{
    td_tokfile_info *in = &f->info;
    const uint64_t n = in->token_count;
    if (!in->has_flags) { /* one document of targets */
        in->documents = n > 0;
        in->targets = n > 0 ? n - 1 : 0;
        in->padding = 0;
        return TD_OK;
    }
    const unsigned char *fl = f->data + TD_TOKFILE_HEADER_BYTES + n * in->token_bytes;
    uint32_t crc = td_crc32(0, fl, n);
    if (crc != in->flags_crc32)
        return td_error_set(TD_ERR_INVALID, "token file '%s': flags checksum mismatch (stored %08x, computed %08x): "
                            "the file is corrupt (re-run tidal prepare)", f->name, in->flags_crc32, crc);
    uint64_t docs = 0, targets = 0, pad = 0;
    for (uint64_t i = 0; i < n; i++) {
        const unsigned c = fl[i];
        if (c & ~(TD_TOKFLAG_TARGET | TD_TOKFLAG_DOC_START | TD_TOKFLAG_PAD))
            return td_error_set(TD_ERR_INVALID, "token file '%s': token %llu has the unknown flag bits %#x", f->name,
                                (unsigned long long)i, c);
        if ((c & TD_TOKFLAG_PAD) && (c & TD_TOKFLAG_TARGET))
            return td_error_set(TD_ERR_INVALID, "token file '%s': token %llu is padding and a target", f->name,
                                (unsigned long long)i);
        if (in->row_tokens && i % in->row_tokens == 0 && !(c & TD_TOKFLAG_DOC_START))
            return td_error_set(TD_ERR_INVALID, "token file '%s': row %llu does not start a document", f->name,
                                (unsigned long long)(i / in->row_tokens));
        const int start = (c & TD_TOKFLAG_DOC_START) != 0;
        docs += start && !(c & TD_TOKFLAG_PAD);
        targets += (c & TD_TOKFLAG_TARGET) && !start && i > 0;
        pad += (c & TD_TOKFLAG_PAD) != 0;
    }
    in->documents = docs;
    in->targets = targets;
    in->padding = pad;
    return TD_OK;
}

static td_status tokfile_init(td_tokfile *f)
{
    td_status st = header_decode(f->data, f->bytes, f->name, &f->info);
    if (st == TD_OK) st = verify_payload(f);
    return st;
}

td_status td_tokfile_open_buffer(const void *data, size_t bytes, const char *name, td_tokfile **out)
{
    *out = NULL;
    td_tokfile *f = td_calloc(1, sizeof *f, TD_ROLE_META);
    if (!f) return td_error_set(TD_ERR_NOMEM, "out of memory opening token file '%s'", name);
    f->name = td_strdup(name ? name : "(buffer)", TD_ROLE_META);
    f->data = data;
    f->bytes = bytes;
    td_status st = f->name ? tokfile_init(f) : td_error_set(TD_ERR_NOMEM, "out of memory");
    if (st != TD_OK) {
        td_tokfile_close(f);
        return st;
    }
    *out = f;
    return TD_OK;
}

td_status td_tokfile_open(const char *path, td_tokfile **out)
{
    td_status st = TD_OK;
    td_tokfile *f = NULL;
    struct stat sb;
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        TD_FAIL(TD_ERR_IO, "cannot open token file '%s': %s%s", path, strerror(errno),
                errno == ENOENT ? " (make one with tidal prepare --input TEXT --out FILE)" : "");
    if (fstat(fd, &sb) != 0) TD_FAIL(TD_ERR_IO, "cannot stat token file '%s': %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode)) TD_FAIL(TD_ERR_INVALID, "token file '%s' is not a regular file", path);
    f = td_calloc(1, sizeof *f, TD_ROLE_META);
    if (!f || !(f->name = td_strdup(path, TD_ROLE_META)))
        TD_FAIL(TD_ERR_NOMEM, "out of memory opening token file '%s'", path);
    f->bytes = (size_t)sb.st_size;
    if (f->bytes >= TD_TOKFILE_HEADER_BYTES) {
        void *m = mmap(NULL, f->bytes, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) TD_FAIL(TD_ERR_IO, "cannot map token file '%s': %s", path, strerror(errno));
        f->data = m;
        f->mapped = 1;
        madvise(m, f->bytes, MADV_SEQUENTIAL); /* for the verify pass */
    }
    TD_TRY(tokfile_init(f));
    madvise((void *)f->data, f->bytes, MADV_NORMAL);
    *out = f;
    f = NULL;
cleanup:
    if (fd >= 0) close(fd);
    td_tokfile_close(f);
    return st;
}

void td_tokfile_close(td_tokfile *f)
{
    if (!f) return;
    if (f->mapped) munmap((void *)f->data, f->bytes);
    td_free(f->name);
    td_free(f);
}

const td_tokfile_info *td_tokfile_get_info(const td_tokfile *f) { return &f->info; }
const char *td_tokfile_name(const td_tokfile *f) { return f->name; }
uint64_t td_tokfile_count(const td_tokfile *f) { return f->info.token_count; }

uint32_t td_tokfile_at(const td_tokfile *f, uint64_t i)
{
    const unsigned char *p = f->data + TD_TOKFILE_HEADER_BYTES;
    if (f->info.token_bytes == 2) {
        uint16_t v;
        memcpy(&v, p + 2 * i, 2);
        return v;
    }
    uint32_t v;
    memcpy(&v, p + 4 * i, 4);
    return v;
}

unsigned td_tokfile_flags_at(const td_tokfile *f, uint64_t i)
{
    if (!f->info.has_flags) return TD_TOKFLAG_TARGET;
    return f->data[TD_TOKFILE_HEADER_BYTES + f->info.token_count * f->info.token_bytes + i];
}

td_status td_tokfile_read(const td_tokfile *f, uint64_t start, size_t n, int32_t *out)
{
    if (start > f->info.token_count || n > f->info.token_count - start)
        return td_error_set(TD_ERR_INVALID, "token file '%s': tokens [%llu, %llu) are past its %llu tokens", f->name,
                            (unsigned long long)start, (unsigned long long)(start + n),
                            (unsigned long long)f->info.token_count);
    const unsigned char *p = f->data + TD_TOKFILE_HEADER_BYTES;
    if (f->info.token_bytes == 2) {
        for (size_t i = 0; i < n; i++) {
            uint16_t v;
            memcpy(&v, p + 2 * (start + i), 2);
            out[i] = v;
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            uint32_t v;
            memcpy(&v, p + 4 * (start + i), 4);
            out[i] = (int32_t)v;
        }
    }
    return TD_OK;
}

td_status td_tokfile_tokenizer_path(const char *tokfile, const char *name, char *buf, size_t buf_bytes)
{
    int n = snprintf(buf, buf_bytes, "%s.tokenizer%s%s", tokfile, name && *name ? "/" : "", name ? name : "");
    if (n < 0 || (size_t)n >= buf_bytes)
        return td_error_set(TD_ERR_INVALID, "the path of %s's tokenizer files is too long", tokfile);
    return TD_OK;
}
