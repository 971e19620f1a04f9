/* `tidal prepare`: text to a token file (format in include/tidal/data.h).
 *
 * Inputs are streamed in blocks and cut only at td_tokenizer_cut_point, so
 * the tokens equal those of encoding each document whole while memory stays
 * at one block (it grows only for a block with no whitespace at all).  A
 * folder is walked recursively in byte order of the paths; each regular file
 * is one document and documents are separated by the end-of-text token (and
 * each starts with the begin-of-text token when the tokenizer has one).  The
 * output is written through td_tokfile_writer: a temporary file renamed over
 * --out when complete, removed on any error or interrupt. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "args.h"
#include "cli.h"
#include "cli_prepare_records.h"
#include "tidal/alloc.h"
#include "tidal/chat.h"
#include "tidal/data.h"
#include "tidal/tokenizer.h"
#include "tidal/util.h"

#define BLOCK_BYTES ((size_t)16 << 20)
#define MIN_BLOCK_BYTES 16
#define SNIFF_BYTES 8192
#define PROGRESS_MS 250.0

static volatile sig_atomic_t interrupted;
static void on_signal(int sig) { interrupted = sig; }

/* ---- the input list ------------------------------------------------------ */

typedef struct input {
    char *path;
    dev_t dev;
    ino_t ino;
    uint64_t bytes;
} input;

typedef struct input_list {
    input *v;
    size_t n, cap;
    size_t skipped_hidden, skipped_binary, skipped_links, skipped_empty, skipped_other;
    char example_binary[64]; /* the first binary file skipped, for the summary */
} input_list;

static int push_input(input_list *L, const char *path, const struct stat *sb)
{
    if (L->n == L->cap) {
        size_t cap = L->cap ? 2 * L->cap : 64;
        input *v = td_malloc(cap * sizeof *v, TD_ROLE_META);
        if (!v) return -1;
        if (L->n) memcpy(v, L->v, L->n * sizeof *v);
        td_free(L->v);
        L->v = v;
        L->cap = cap;
    }
    char *copy = td_strdup(path, TD_ROLE_META);
    if (!copy) return -1;
    L->v[L->n++] = (input){copy, sb->st_dev, sb->st_ino, (uint64_t)sb->st_size};
    return 0;
}

static void free_inputs(input_list *L)
{
    for (size_t i = 0; i < L->n; i++) td_free(L->v[i].path);
    td_free(L->v);
}

typedef struct dir_id { dev_t dev; ino_t ino; } dir_id;

/* Collects regular files under `dir` (recursively; `seen` guards against
 * symlink loops).  Returns 0, or -1 with a message on stderr. */
static int walk(input_list *L, const char *dir, dir_id *seen, int depth)
{
    if (depth > 64) {
        fprintf(stderr, "tidal prepare: folders nested deeper than 64 levels under '%s'\n", dir);
        return -1;
    }
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "tidal prepare: cannot read folder '%s': %s\n", dir, strerror(errno));
        return -1;
    }
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (errno = 0, e = readdir(d))) {
        if (e->d_name[0] == '.') {
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) L->skipped_hidden++;
            continue;
        }
        size_t len = strlen(dir) + strlen(e->d_name) + 2;
        char *path = td_malloc(len, TD_ROLE_META);
        if (!path) {
            fprintf(stderr, "tidal prepare: out of memory listing '%s'\n", dir);
            rc = -1;
            break;
        }
        snprintf(path, len, "%s%s%s", dir, dir[strlen(dir) - 1] == '/' ? "" : "/", e->d_name);
        struct stat sb;
        if (stat(path, &sb) != 0) {
            fprintf(stderr, "tidal prepare: cannot stat '%s': %s\n", path, strerror(errno));
            rc = -1;
        } else if (S_ISDIR(sb.st_mode)) {
            int loop = 0;
            for (int k = 0; k <= depth; k++) loop |= seen[k].dev == sb.st_dev && seen[k].ino == sb.st_ino;
            if (!loop) {
                seen[depth + 1] = (dir_id){sb.st_dev, sb.st_ino};
                rc = walk(L, path, seen, depth + 1);
            }
        } else if (S_ISREG(sb.st_mode)) {
            if (push_input(L, path, &sb) != 0) {
                fprintf(stderr, "tidal prepare: out of memory listing '%s'\n", dir);
                rc = -1;
            }
        } else {
            L->skipped_other++;
        }
        td_free(path);
    }
    if (rc == 0 && errno) {
        fprintf(stderr, "tidal prepare: cannot read folder '%s': %s\n", dir, strerror(errno));
        rc = -1;
    }
    closedir(d);
    return rc;
}

static int by_path(const void *a, const void *b) { return strcmp(((const input *)a)->path, ((const input *)b)->path); }

/* 1 if the file's first bytes hold a NUL (how git and grep spot binaries). */
static int looks_binary(const char *path)
{
    char buf[SNIFF_BYTES];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0; /* reported when it is read */
    ssize_t n = read(fd, buf, sizeof buf);
    close(fd);
    return n > 0 && memchr(buf, 0, (size_t)n) != NULL;
}

/* Sorts, drops second links to a file, empty files and binaries. */
static void filter_inputs(input_list *L)
{
    qsort(L->v, L->n, sizeof *L->v, by_path);
    size_t k = 0;
    for (size_t i = 0; i < L->n; i++) {
        int dup = 0;
        for (size_t j = 0; j < k && !dup; j++) dup = L->v[j].dev == L->v[i].dev && L->v[j].ino == L->v[i].ino;
        if (dup) {
            L->skipped_links++;
        } else if (L->v[i].bytes == 0) {
            L->skipped_empty++;
        } else if (looks_binary(L->v[i].path)) {
            if (!L->skipped_binary++)
                snprintf(L->example_binary, sizeof L->example_binary, "%s", strrchr(L->v[i].path, '/') + 1);
        } else {
            L->v[k++] = L->v[i];
            continue;
        }
        td_free(L->v[i].path);
    }
    L->n = k;
}

/* ---- encoding ------------------------------------------------------------ */

typedef struct prep {
    td_tokenizer *tok;
    td_tokfile_writer *w;
    char *buf;
    size_t cap;
    uint64_t bytes_done, bytes_total; /* total 0: unknown (stdin) */
    int progress;
    double t0, last_ms;
} prep;

static td_status sink_writer(void *ctx, const uint32_t *ids, size_t n)
{
    return td_tokfile_writer_append(((prep *)ctx)->w, ids, n);
}

static void show_progress(prep *P, int final)
{
    if (!P->progress) return;
    double now = td_now_ms();
    if (!final && now - P->last_ms < PROGRESS_MS) return;
    P->last_ms = now;
    char a[32], b[32];
    double s = (now - P->t0) / 1e3;
    fprintf(stderr, "\r  prepare: %s", td_format_bytes(P->bytes_done, a, sizeof a));
    if (P->bytes_total)
        fprintf(stderr, " / %s (%3.0f%%)", td_format_bytes(P->bytes_total, b, sizeof b),
                100.0 * (double)P->bytes_done / (double)P->bytes_total);
    fprintf(stderr, ", %llu tokens, %.1f MiB/s   %s", (unsigned long long)td_tokfile_writer_count(P->w),
            s > 0 ? (double)P->bytes_done / (1 << 20) / s : 0.0, final ? "\n" : "");
    fflush(stderr);
}

/* Reads fd to the end, encoding block by block.  Returns 0, or -1 with a
 * message on stderr. */
static int encode_stream(prep *P, int fd, const char *name)
{
    size_t fill = 0;
    for (;;) {
        if (fill == P->cap) {
            size_t p = td_tokenizer_cut_point(P->tok, P->buf, fill);
            if (p == 0) { /* no place to cut: grow the block */
                char *grown = td_malloc(2 * P->cap, TD_ROLE_META);
                if (!grown) {
                    char a[32];
                    fprintf(stderr, "tidal prepare: out of memory: '%s' has more than %s without whitespace\n",
                            name, td_format_bytes(P->cap, a, sizeof a));
                    return -1;
                }
                memcpy(grown, P->buf, fill);
                td_free(P->buf);
                P->buf = grown;
                P->cap *= 2;
                continue;
            }
            if (td_tokenizer_encode(P->tok, P->buf, p, sink_writer, P) != TD_OK) goto encode_failed;
            memmove(P->buf, P->buf + p, fill - p);
            fill -= p;
        }
        ssize_t r = read(fd, P->buf + fill, P->cap - fill);
        if (interrupted) return -1;
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            fprintf(stderr, "tidal prepare: cannot read '%s': %s\n", name, strerror(errno));
            return -1;
        }
        if (r == 0) break;
        fill += (size_t)r;
        P->bytes_done += (uint64_t)r;
        show_progress(P, 0);
    }
    if (td_tokenizer_encode(P->tok, P->buf, fill, sink_writer, P) == TD_OK) return 0;
encode_failed:
    fprintf(stderr, "tidal prepare: encoding '%s': %s\n", name, td_error_msg());
    return -1;
}

/* ---- output folder --------------------------------------------------------- */

/* The command's options. */
typedef struct prep_opts {
    const char *in_path, *out_path, *kind_text, *vocab, *merges;
    size_t block_bytes;
    int quiet;
    const char *chat_given;   /* --chat-template, or NULL */
    td_prepare_records rec;   /* JSONL records' options (rec.input NULL: the input is text) */
} prep_opts;

/* Creates the folders leading to `path` (mkdir -p of its dirname). */
static int make_parents(const char *path)
{
    char *copy = td_strdup(path, TD_ROLE_META);
    if (!copy) return -1;
    int rc = 0;
    for (char *p = copy + 1; *p && rc == 0; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(copy, 0777) != 0 && errno != EEXIST) {
            fprintf(stderr, "tidal prepare: cannot create folder '%s' for --out: %s\n", copy, strerror(errno));
            rc = -1;
        }
        *p = '/';
    }
    td_free(copy);
    return rc;
}

/* ---- main ------------------------------------------------------------------ */

static void print_summary(const prep *P, uint64_t n_tokens, const char *out, const input_list *L, int from_dir,
                          double ms)
{
    char a[32], b[32];
    uint32_t vocab = td_tokenizer_vocab_size(P->tok), width = td_tokfile_token_bytes_for(vocab);
    printf("wrote %s: %llu tokens (%s tokenizer, vocab %u, uint%u, %s) from %s of text", out,
           (unsigned long long)n_tokens, td_tokenizer_kind_name(td_tokenizer_kind_of(P->tok)), vocab, 8 * width,
           td_format_bytes(TD_TOKFILE_HEADER_BYTES + n_tokens * width, a, sizeof a),
           td_format_bytes(P->bytes_done, b, sizeof b));
    if (from_dir) printf(" in %zu files", L->n);
    printf(", %.2f s (%.1f MiB/s)\n", ms / 1e3, ms > 0 ? (double)P->bytes_done / (1 << 20) / (ms / 1e3) : 0.0);
    if (L->skipped_links || L->skipped_binary || L->skipped_empty || L->skipped_hidden || L->skipped_other)
        printf("skipped %zu second links to files already read, %zu binary files%s%s%s, %zu empty, %zu hidden, "
               "%zu neither file nor folder\n", L->skipped_links, L->skipped_binary,
               L->skipped_binary ? " (e.g. " : "", L->example_binary, L->skipped_binary ? ")" : "",
               L->skipped_empty, L->skipped_hidden, L->skipped_other);
}

/* Copies the tokenizer files (vocab.json and merges.txt, or tokenizer.json:
 * merges NULL) to "<out>.tokenizer/", with the tokenizer_config.json and
 * chat_template.jinja beside a tokenizer.json, or the --chat-template given
 * (chat: its path, or NULL); 0 or 1 (said). */
static int save_tokenizer(const char *out, const char *vocab, const char *merges, const char *chat)
{
    char dir[4096], path[4096], extra[2][4096];
    const char *src[4] = {vocab, merges, NULL, NULL}, *name[4] = {"vocab.json", "merges.txt", "tokenizer_config.json",
                                                                  "chat_template.jinja"};
    int n = merges ? 2 : 1;
    if (!merges) { /* tokenizer.json: its folder's config and template */
        const char *slash = strrchr(vocab, '/');
        name[0] = "tokenizer.json";
        for (int k = 0; k < 2; k++) {
            snprintf(extra[k], sizeof extra[k], "%.*s%s%s", slash ? (int)(slash - vocab) : 0, vocab, slash ? "/" : "",
                     name[2 + k]);
            if (access(extra[k], R_OK) == 0) src[2 + k] = extra[k];
        }
        name[1] = name[2], src[1] = src[2];
        name[2] = name[3], src[2] = src[3];
        n = 3;
    }
    if (chat) { /* the template given wins over the one beside the tokenizer */
        size_t len = strlen(chat);
        int is_config = len >= 5 && !strcmp(chat + len - 5, ".json");
        name[n] = is_config ? "tokenizer_config.json" : "chat_template.jinja";
        src[n++] = chat;
    }
    if (td_tokfile_tokenizer_path(out, NULL, dir, sizeof dir)) goto fail;
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        td_error_set(TD_ERR_IO, "cannot create %s: %s", dir, strerror(errno));
        goto fail;
    }
    for (int i = 0; i < n; i++)
        if (src[i] && (td_tokfile_tokenizer_path(out, name[i], path, sizeof path) || td_copy_file(src[i], path)))
            goto fail;
    return 0;
fail:
    fprintf(stderr, "tidal prepare: keeping the tokenizer beside the token file: %s\n", td_error_msg());
    return 1;
}

/* The document separators: end of text after each but the last, begin of
 * text (when the tokenizer has one) before each.  0, or -1 (said). */
static int append_special(prep *P, int before_first)
{
    uint32_t ids[2], n = 0, bos = td_tokenizer_bos(P->tok);
    if (!before_first) ids[n++] = td_tokenizer_eot(P->tok);
    if (bos != TD_TOKEN_NONE) ids[n++] = bos;
    if (n && td_tokfile_writer_append(P->w, ids, n) != TD_OK) {
        fprintf(stderr, "tidal prepare: %s\n", td_error_msg());
        return -1;
    }
    return 0;
}

/* Whether the tokenizer_config.json at path names a "chat_template". */
static int config_has_template(const char *path)
{
    char *text = NULL;
    size_t len = 0;
    int has = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n > 0 && fseek(f, 0, SEEK_SET) == 0 && (text = td_malloc((size_t)n + 1, TD_ROLE_META)))
            len = fread(text, 1, (size_t)n, f);
    }
    fclose(f);
    if (text) {
        text[len] = '\0';
        has = strstr(text, "\"chat_template\"") != NULL;
        td_free(text);
    }
    return has;
}

/* The chat template for JSONL records: --chat-template, else the one beside
 * a tokenizer.json (chat_template.jinja, or tokenizer_config.json's), else
 * none.  *file: the file it came from (kept beside the token file).  0, or
 * 1 (said). */
static int find_chat_template(const char *given, const char *json_path, td_chat_template **out, char *file,
                              size_t file_bytes)
{
    char cand[2][4096];
    struct stat sb;
    *out = NULL;
    file[0] = '\0';
    if (given) {
        if (stat(given, &sb) == 0 && S_ISDIR(sb.st_mode)) {
            snprintf(cand[0], sizeof cand[0], "%s/chat_template.jinja", given);
            snprintf(cand[1], sizeof cand[1], "%s/tokenizer_config.json", given);
            snprintf(file, file_bytes, "%s", access(cand[0], R_OK) == 0 ? cand[0] : cand[1]);
        } else {
            snprintf(file, file_bytes, "%s", given);
        }
        if (td_chat_template_load(given, out) == TD_OK) return 0;
        fprintf(stderr, "tidal prepare: --chat-template: %s\n", td_error_msg());
        return 1;
    }
    if (!json_path) return 0;
    const char *slash = strrchr(json_path, '/');
    for (int k = 0; k < 2; k++)
        snprintf(cand[k], sizeof cand[k], "%.*s%s%s", slash ? (int)(slash - json_path) : 0, json_path,
                 slash ? "/" : "", k ? "tokenizer_config.json" : "chat_template.jinja");
    const char *use = NULL;
    if (access(cand[0], R_OK) == 0) use = cand[0];
    else if (access(cand[1], R_OK) == 0 && config_has_template(cand[1])) use = cand[1]; /* a base model's has none */
    if (!use) return 0;
    snprintf(file, file_bytes, "%s", use);
    if (td_chat_template_load(use, out) == TD_OK) return 0;
    fprintf(stderr, "tidal prepare: %s\n", td_error_msg());
    return 1;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

/* --tokenizer and its files: the kind and, for a tokenizer.json, its path.
 * 0, or 2 (a usage error, said). */
static int resolve_tokenizer(const char *kind_text, const char *vocab, const char *merges, td_tokenizer_kind *kind,
                             char *json_path, size_t json_bytes)
{
    if (td_tokenizer_kind_parse(kind_text, kind) != TD_OK) {
        if (!td_tokenizer_json_path(kind_text, json_path, json_bytes)) {
            fprintf(stderr, "tidal prepare: --tokenizer '%s' is not byte or gpt2, nor a .json file or a folder "
                            "holding tokenizer.json\n", kind_text);
            return 2;
        }
        *kind = TD_TOKENIZER_JSON;
    }
    if (*kind != TD_TOKENIZER_GPT2 && (vocab || merges)) {
        fprintf(stderr, "tidal prepare: --vocab and --merges are for --tokenizer gpt2\n");
        return 2;
    }
    if (*kind == TD_TOKENIZER_GPT2 && (!vocab || !merges)) {
        fprintf(stderr, "tidal prepare: --tokenizer gpt2 needs --vocab vocab.json and --merges merges.txt "
                        "(Hugging Face GPT-2 files)\n");
        return 2;
    }
    return 0;
}

/* The documents of --input (a file or a folder's files; none for stdin)
 * into L, their bytes into P->bytes_total.  0, or 1 (said). */
static int gather_inputs(const char *in_path, int jsonl, input_list *L, dir_id **seen, prep *P, int *from_dir)
{
    struct stat sb;
    if (stat(in_path, &sb) != 0) {
        fprintf(stderr, "tidal prepare: cannot open --input '%s': %s\n", in_path, strerror(errno));
        return 1;
    }
    if (S_ISDIR(sb.st_mode) && jsonl) {
        fprintf(stderr, "tidal prepare: --input '%s' is a folder; JSONL records come from one file\n", in_path);
        return 2;
    }
    if (S_ISDIR(sb.st_mode)) {
        *from_dir = 1;
        if (!(*seen = td_calloc(66, sizeof **seen, TD_ROLE_META))) return 1;
        (*seen)[0] = (dir_id){sb.st_dev, sb.st_ino};
        if (walk(L, in_path, *seen, 0) != 0) return 1;
        filter_inputs(L);
        if (L->n == 0) {
            fprintf(stderr, "tidal prepare: no text files under '%s'\n", in_path);
            return 1;
        }
    } else if (S_ISREG(sb.st_mode) && !jsonl && looks_binary(in_path)) { /* JSONL may be gzip */
        fprintf(stderr, "tidal prepare: --input '%s' is not text (a NUL byte in its first %d bytes, as in a "
                "program or an image); give a text file, or a folder (whose binary files are skipped)\n",
                in_path, SNIFF_BYTES);
        return 1;
    } else if (push_input(L, in_path, &sb) != 0) {
        fprintf(stderr, "tidal prepare: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < L->n; i++) P->bytes_total += L->v[i].bytes;
    return 0;
}

/* The tokenizer, the token file's writer (its folders made) and the read
 * block.  0, or 1 (said). */
static int open_output(prep *P, td_tokenizer_kind kind, const char *json_path, const prep_opts *o)
{
    td_status st = kind == TD_TOKENIZER_BYTE   ? td_tokenizer_create_byte(&P->tok)
                   : kind == TD_TOKENIZER_GPT2 ? td_tokenizer_load_gpt2(o->vocab, o->merges, &P->tok)
                                               : td_tokenizer_load_json(json_path, &P->tok);
    if (!st && make_parents(o->out_path) != 0) return 1;
    if (!st)
        st = td_tokfile_writer_open(o->out_path, kind, td_tokenizer_vocab_size(P->tok), td_tokenizer_eot(P->tok),
                                    &P->w);
    if (st) {
        fprintf(stderr, "tidal prepare: %s\n", td_error_msg());
        return 1;
    }
    P->cap = o->block_bytes;
    if (!(P->buf = td_malloc(P->cap, TD_ROLE_META))) {
        fprintf(stderr, "tidal prepare: out of memory for a %zu-byte read block\n", o->block_bytes);
        return 1;
    }
    P->progress = !o->quiet && isatty(STDERR_FILENO);
    return 0;
}

/* Every document through the tokenizer into the writer.  0, or 1 (said). */
static int encode_inputs(prep *P, const input_list *L, int from_stdin, const char *in_path)
{
    if (from_stdin && (append_special(P, 1) != 0 || encode_stream(P, STDIN_FILENO, "standard input") != 0)) return 1;
    for (size_t i = 0; i < L->n; i++) {
        if (append_special(P, i == 0) != 0) return 1;
        int fd = open(L->v[i].path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            fprintf(stderr, "tidal prepare: cannot open '%s': %s\n", L->v[i].path, strerror(errno));
            return 1;
        }
        int r = encode_stream(P, fd, L->v[i].path);
        close(fd);
        if (r != 0) return 1;
    }
    if (td_tokfile_writer_count(P->w) == 0) {
        fprintf(stderr, "tidal prepare: --input '%s' has no text; nothing written\n", in_path);
        return 1;
    }
    show_progress(P, 1);
    return interrupted ? 1 : 0;
}

/* JSONL records: rendered with the chat template, masked, packed into rows
 * and appended to the writer.  0, or 1 (said). */
static int encode_records(prep *P, prep_opts *o, const td_chat_template *chat, td_prepare_records_result *res)
{
    td_prepare_records *rec = &o->rec;
    rec->tok = P->tok;
    rec->chat = chat;
    rec->output = o->out_path;
    rec->input_bytes = ends_with(o->in_path, ".gz") ? 0 : P->bytes_total; /* gzip: the bytes read are more */
    rec->progress = P->progress;
    return td_prepare_records_run(rec, P->w, &interrupted, res) ? 1 : 0;
}

/* The tokenizer's files beside the token file, then the token file itself
 * (renamed into place).  0, or 1 (said). */
static int commit_output(prep *P, td_tokenizer_kind kind, const char *json_path, const prep_opts *o,
                         const char *chat_file)
{
    /* The tokenizer files go beside the token file before it appears, so a
     * run's checkpoints can carry them (`tidal generate` then needs no flags). */
    const char *keep_chat = chat_file[0] ? chat_file : NULL;
    if (kind == TD_TOKENIZER_GPT2 && save_tokenizer(o->out_path, o->vocab, o->merges, keep_chat) != 0) return 1;
    if (kind == TD_TOKENIZER_JSON && save_tokenizer(o->out_path, json_path, NULL, keep_chat) != 0) return 1;
    td_tokfile_writer *w = P->w;
    P->w = NULL;
    if (td_tokfile_writer_commit(w) != TD_OK) {
        fprintf(stderr, "tidal prepare: %s\n", td_error_msg());
        return 1;
    }
    return 0;
}

/* SIGINT and SIGTERM set `interrupted` (no SA_RESTART: a blocked read
 * returns); old[] keeps the handlers to put back. */
static void catch_signals(struct sigaction old[2])
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    interrupted = 0;
    sigaction(SIGINT, &sa, &old[0]);
    sigaction(SIGTERM, &sa, &old[1]);
}

/* Tokenizes --input into --out: 0 done, 1 failed (said on stderr), 2 bad
 * usage, 130 interrupted. */
static int prepare(prep_opts *o)
{
    td_tokenizer_kind kind;
    char json_path[4096], chat_file[4096] = "";
    if (resolve_tokenizer(o->kind_text, o->vocab, o->merges, &kind, json_path, sizeof json_path)) return 2;
    const int jsonl = o->rec.input != NULL;
    int rc = 1, from_dir = 0, from_stdin = !strcmp(o->in_path, "-");
    input_list L = {0};
    prep P = {.t0 = td_now_ms()};
    dir_id *seen = NULL;
    struct sigaction old[2];
    int handlers = 0;
    td_chat_template *chat = NULL;
    td_prepare_records_result res;
    if (!from_stdin && (rc = gather_inputs(o->in_path, jsonl, &L, &seen, &P, &from_dir)) != 0) goto done;
    rc = 1;
    if (jsonl && find_chat_template(o->chat_given, kind == TD_TOKENIZER_JSON ? json_path : NULL, &chat, chat_file,
                                    sizeof chat_file))
        goto done;
    catch_signals(old);
    handlers = 1;
    if (open_output(&P, kind, json_path, o) != 0) goto done;
    if (jsonl ? encode_records(&P, o, chat, &res) != 0 : encode_inputs(&P, &L, from_stdin, o->in_path) != 0) goto done;
    if (interrupted) goto done;
    uint64_t n_tokens = td_tokfile_writer_count(P.w);
    if (commit_output(&P, kind, json_path, o, chat_file) != 0) goto done;
    if (!o->quiet && jsonl) td_prepare_records_summary(&o->rec, &res);
    else if (!o->quiet) print_summary(&P, n_tokens, o->out_path, &L, from_dir, td_now_ms() - P.t0);
    rc = 0;
done:
    if (rc != 0 && interrupted) {
        fprintf(stderr, "\ntidal prepare: interrupted; '%s' was not written\n", o->out_path);
        rc = 130;
    }
    td_tokfile_writer_abort(P.w);
    if (handlers) {
        sigaction(SIGINT, &old[0], NULL);
        sigaction(SIGTERM, &old[1], NULL);
    }
    td_tokenizer_destroy(P.tok);
    td_chat_template_free(chat);
    td_free(P.buf);
    td_free(seen);
    free_inputs(&L);
    return rc;
}

/* The JSONL options, checked; 0 or 2 (said). */
static int records_options(td_opt *table, const char *in_path, const char *format, const char *loss_on,
                           const char *too_long, long seq, int no_pack, int no_shuffle, int skip_bad, uint64_t seed,
                           td_prepare_records *rec)
{
    static const char *const jsonl_only[] = {"seq", "loss-on", "chat-template", "no-pack", "seed", "no-shuffle",
                                             "too-long", "skip-bad", NULL};
    td_status st = TD_OK;
    int jsonl = !strcmp(format, "jsonl") ||
                (!strcmp(format, "auto") && (ends_with(in_path, ".jsonl") || ends_with(in_path, ".jsonl.gz")));
    memset(rec, 0, sizeof *rec);
    if (strcmp(format, "auto") && strcmp(format, "text") && strcmp(format, "jsonl"))
        st = td_error_set(TD_ERR_INVALID, "--format '%s': use auto, text or jsonl", format);
    for (int k = 0; !st && !jsonl && jsonl_only[k]; k++)
        if (td_args_find(table, jsonl_only[k])->seen)
            st = td_error_set(TD_ERR_INVALID, "--%s is for JSONL records (an --input ending in .jsonl or .jsonl.gz, "
                              "or --format jsonl)", jsonl_only[k]);
    if (!st && jsonl && (seq < 2 || seq > (1 << 24)))
        st = td_error_set(TD_ERR_INVALID, "--seq %ld: a row needs 2 to 16777216 tokens", seq);
    if (!st && jsonl) st = td_loss_on_parse(loss_on, &rec->loss_on);
    rec->too_long = -1;
    if (!st && jsonl && strcmp(too_long, "auto")) {
        if (!strcmp(too_long, "split")) rec->too_long = TD_PACK_SPLIT;
        else if (!strcmp(too_long, "cut")) rec->too_long = TD_PACK_CUT;
        else if (!strcmp(too_long, "drop")) rec->too_long = TD_PACK_DROP;
        else st = td_error_set(TD_ERR_INVALID, "--too-long '%s': use auto, split, cut or drop", too_long);
    }
    if (st) {
        fprintf(stderr, "tidal prepare: %s\n(tidal prepare --help lists the options)\n", td_error_msg());
        return 2;
    }
    if (!jsonl) return 0;
    rec->input = in_path;
    rec->seq = (uint32_t)seq;
    rec->pack = !no_pack;
    rec->shuffle = !no_shuffle;
    rec->skip_bad = skip_bad;
    rec->seed = seed;
    return 0;
}

int td_cli_prepare_main(int argc, char **argv)
{
    prep_opts o = {.kind_text = "byte", .block_bytes = BLOCK_BYTES};
    const char *format = "auto", *loss_on = "assistant", *too_long = "auto";
    long seq = 1024;
    uint64_t seed = 0;
    int no_pack = 0, no_shuffle = 0, skip_bad = 0;
    td_opt table[] = {
        {"input", TD_OPT_STRING, &o.in_path, "TEXT", "a text file, a folder (every regular file under it, in path\n"
                                                   "order, each a document; hidden names, binary files and second\n"
                                                   "links to a file already read are skipped) or '-' for stdin;\n"
                                                   "or JSONL records (a .jsonl or .jsonl.gz file, see below)", 0},
        {"out", TD_OPT_STRING, &o.out_path, "FILE", "the token file; written to a temporary file and renamed when\n"
                                                  "complete (missing folders are created)", 0},
        {"tokenizer", TD_OPT_STRING, &o.kind_text, "K", "byte (default: 256 byte tokens + end-of-text, vocab 257),\n"
                                                      "gpt2 (GPT-2 BPE; needs --vocab and --merges), or a Hugging\n"
                                                      "Face tokenizer.json (a path ending in .json, or a folder\n"
                                                      "holding tokenizer.json): byte-level BPE with the GPT-2,\n"
                                                      "Llama 3 or Qwen2 pre-tokenizer and its added tokens", 0},
        {"vocab", TD_OPT_STRING, &o.vocab, "FILE", "Hugging Face GPT-2 vocab.json", 0},
        {"merges", TD_OPT_STRING, &o.merges, "FILE", "Hugging Face GPT-2 merges.txt", 0},
        {"block", TD_OPT_SIZE, &o.block_bytes, "BYTES", "read the input in blocks of this size (default 16MiB); a block\n"
                                                      "is cut at whitespace and grows when it has none", 0},
        {"format", TD_OPT_STRING, &format, "F", "auto (default: jsonl for a name ending in .jsonl or .jsonl.gz,\n"
                                                "else text), text or jsonl", 0},
        {"seq", TD_OPT_LONG, &seq, "T", "JSONL: tokens a row (default 1024); train and eval with the same --seq", 0},
        {"loss-on", TD_OPT_STRING, &loss_on, "WHAT", "JSONL: which tokens the loss counts: assistant (default: every\n"
                                                     "assistant message, a completion), completion (a completion,\n"
                                                     "a conversation's last assistant message) or all; text\n"
                                                     "records count whole", 0},
        {"chat-template", TD_OPT_STRING, &o.chat_given, "PATH", "JSONL: the chat template for conversations: a .jinja\n"
                                                                "file, a tokenizer_config.json or a folder (default:\n"
                                                                "the one beside the tokenizer.json)", 0},
        {"no-pack", TD_OPT_FLAG, &no_pack, NULL, "JSONL: each document in rows of its own (default: packed, several\n"
                                                 "a row, attention not crossing them)", 0},
        {"seed", TD_OPT_U64, &seed, "S", "JSONL: the seed documents are shuffled with (default 0)", 0},
        {"no-shuffle", TD_OPT_FLAG, &no_shuffle, NULL, "JSONL: keep the records' order", 0},
        {"too-long", TD_OPT_STRING, &too_long, "RULE", "JSONL: a document longer than --seq: split (into pieces of\n"
                                                       "--seq), cut (to its first --seq tokens) or drop; auto\n"
                                                       "(default) splits text records and drops the others", 0},
        {"skip-bad", TD_OPT_FLAG, &skip_bad, NULL, "JSONL: skip and count bad lines (default: stop at the first,\n"
                                                   "naming its line)", 0},
        {"quiet", TD_OPT_FLAG, &o.quiet, NULL, "no progress line and no summary", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = td_args_main(table, argc, argv, "prepare",
                          "usage: tidal prepare --input TEXT --out FILE [--tokenizer byte|gpt2|tokenizer.json]\n"
                          "                     [--vocab vocab.json --merges merges.txt] [--block BYTES] [--quiet]\n"
                          "       tidal prepare --input RECORDS.jsonl[.gz] --out FILE --tokenizer MODEL_DIR\n"
                          "                     [--seq T] [--loss-on assistant|completion|all] [--chat-template PATH]\n"
                          "                     [--no-pack] [--seed S] [--too-long RULE] [--skip-bad]\n\n"
                          "Tokenizes text into a token file for tidal train / eval (format: docs/data.md).\n"
                          "Documents are separated by the end-of-text token; the literal text\n"
                          "<|endoftext|> in the input is that token too.  With a tokenizer.json, the\n"
                          "literal text of each of its added tokens is that token, end of text is\n"
                          "its <|endoftext|> / <|end_of_text|> / </s> token, and a begin-of-text\n"
                          "token its post_processor adds (Llama 3's <|begin_of_text|>) starts each\n"
                          "document.\n\n"
                          "JSONL records, one a line: {\"text\": ...}, {\"prompt\": ..., \"completion\": ...} or\n"
                          "{\"messages\": [{\"role\": ..., \"content\": ...}, ...], \"tools\": [...]}, the last\n"
                          "rendered with the model's chat template.  The file written holds rows of --seq\n"
                          "tokens packed with whole documents (positions restart and attention stops at\n"
                          "each), a flag per token saying whether the loss counts it, and padding.");
    if (rc >= 0) return rc;
    td_status st = td_args_require(table, "input", "out", NULL);
    if (!st && (!*o.in_path || !*o.out_path))
        st = td_error_set(TD_ERR_INVALID, "--%s needs a value", !*o.in_path ? "input" : "out");
    if (!st && o.block_bytes < MIN_BLOCK_BYTES)
        st = td_error_set(TD_ERR_INVALID, "--block must be a size of at least %d bytes (e.g. 16MiB)", MIN_BLOCK_BYTES);
    if (st) {
        fprintf(stderr, "tidal prepare: %s\n(tidal prepare --help lists the options)\n", td_error_msg());
        td_args_free();
        return 2;
    }
    rc = records_options(table, o.in_path, format, loss_on, too_long, seq, no_pack, no_shuffle, skip_bad, seed, &o.rec);
    if (!rc) rc = prepare(&o);
    td_args_free(); /* config strings live until here */
    return rc;
}
