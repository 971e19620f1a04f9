/* Checkpoint directories (see include/tidal/checkpoint.h, docs/checkpoints.md).
 *
 * The file formats and the directory protocol: config.json with the
 * checkpoint's keys, the directory protocol (temporary directory, exchange
 * or aside, recovery, deleting only files tidal writes), and the writer and
 * reader on top of the safetensors streams.  What is stored under which
 * name and shape, and what config.json says of the model, is the model
 * family's (model.h: td_model_hf_*, td_model_config_*). */
#include "tidal/checkpoint.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tidal/alloc.h"
#include "tidal/family.h"
#include "tidal/util.h"

const char *td_ckpt_state_name(td_ckpt_state kind)
{
    static const char *names[TD_CKPT_STATE_COUNT] = {"master", "adam_m", "adam_v"};
    return (unsigned)kind < TD_CKPT_STATE_COUNT ? names[kind] : "unknown";
}

static td_st_dtype st_dtype_of(td_dtype dt)
{
    return dt == TD_DTYPE_BF16 ? TD_ST_BF16 : dt == TD_DTYPE_F16 ? TD_ST_F16 : TD_ST_F32;
}

static void shape_str(char *buf, size_t n, int ndim, const int64_t *shape)
{
    int k = snprintf(buf, n, "[");
    for (int d = 0; d < ndim && k > 0 && (size_t)k < n; d++)
        k += snprintf(buf + k, n - (size_t)k, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (k > 0 && (size_t)k < n) snprintf(buf + k, n - (size_t)k, "]");
}

/* --- config.json ---------------------------------------------------------- */

static const char *torch_dtype_name(td_dtype dt)
{
    return dt == TD_DTYPE_BF16 ? "bfloat16" : dt == TD_DTYPE_F16 ? "float16" : "float32";
}

/* The model's config.json (model.h) with the checkpoint's keys: the weights'
 * dtype and tidal's format version. */
static td_status write_config_json(const char *path, const td_model_desc *cfg, td_dtype weight_dtype)
{
    td_status st = TD_OK;
    char *text = NULL;
    td_hf_config *c = NULL;
    TD_TRY(td_hf_config_create(path, &c));
    TD_TRY(td_model_config_put(cfg, c));
    TD_TRY(td_hf_config_set_string(c, "torch_dtype", torch_dtype_name(weight_dtype)));
    TD_TRY(td_hf_config_set_int(c, "tidal_format_version", TD_CKPT_FORMAT_VERSION));
    TD_TRY(td_hf_config_print(c, &text));
    TD_TRY(td_write_file_atomic(path, text, strlen(text)));
cleanup:
    td_free(text);
    td_hf_config_free(c);
    return st;
}

static td_status read_small_file(const char *path, char **out, size_t *len_out)
{
    td_status st = TD_OK;
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return td_error_set(TD_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    struct stat sb;
    char *buf = NULL;
    if (fstat(fd, &sb) != 0) TD_FAIL(TD_ERR_IO, "cannot stat %s: %s", path, strerror(errno));
    if (sb.st_size > 64 * 1024 * 1024)
        TD_FAIL(TD_ERR_INVALID, "%s is %lld bytes, too large for a JSON configuration", path,
                (long long)sb.st_size);
    size_t n = (size_t)sb.st_size, got = 0;
    if (!(buf = td_malloc(n + 1, TD_ROLE_META))) TD_FAIL(TD_ERR_NOMEM, "out of memory reading %s", path);
    while (got < n) {
        ssize_t k = read(fd, buf + got, n - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) TD_FAIL(TD_ERR_IO, "cannot read %s: %s", path, k < 0 ? strerror(errno) : "short read");
        got += (size_t)k;
    }
    buf[n] = '\0';
    *out = buf;
    *len_out = n;
    buf = NULL;
cleanup:
    td_free(buf);
    close(fd);
    return st;
}

static td_status parse_config_json(const char *path, td_model_desc *cfg)
{
    td_status st = TD_OK;
    td_hf_config *c = NULL;
    TD_TRY(td_hf_config_load(path, &c));
    TD_TRY(td_model_config_get(c, cfg));
cleanup:
    td_hf_config_free(c);
    return st;
}

static td_status config_check(const td_model_desc *cfg)
{
    if (!cfg) return td_error_set(TD_ERR_INVALID, "checkpoint: no model configuration given");
    td_status st = td_model_desc_check(cfg);
    return st ? td_error_prefix(st, "checkpoint: ") : TD_OK;
}

/* --- paths and the directory protocol ------------------------------------- */

/* malloc'd "a" + "b" (+ "c"). */
static char *cat3(const char *a, const char *b, const char *c)
{
    size_t n = strlen(a) + strlen(b) + (c ? strlen(c) : 0) + 1;
    char *s = td_malloc(n, TD_ROLE_META);
    if (s) snprintf(s, n, "%s%s%s", a, b, c ? c : "");
    return s;
}

/* DIR without trailing slashes into *out; an error if empty or "/". */
static td_status normalize_dir(const char *dir, char **out)
{
    size_t n = dir ? strlen(dir) : 0;
    *out = NULL;
    while (n > 1 && dir[n - 1] == '/') n--;
    if (n == 0 || (n == 1 && dir[0] == '/'))
        return td_error_set(TD_ERR_INVALID, "checkpoint: \"%s\" is not a usable checkpoint directory",
                            dir ? dir : "");
    char *s = td_malloc(n + 1, TD_ROLE_META);
    if (!s) return td_error_prefix(TD_ERR_NOMEM, "checkpoint: ");
    memcpy(s, dir, n);
    s[n] = '\0';
    *out = s;
    return TD_OK;
}

/* Names of files tidal writes into a checkpoint directory, and their
 * temporary forms "<name>.tmp.<digits>". */
/* "model-00001-of-00003.safetensors": a shard's name, its length, or 0. */
static size_t shard_name_len(const char *name)
{
    int a = 0, b = 0, n = 0;
    if (sscanf(name, "model-%5d-of-%5d.safetensors%n", &a, &b, &n) != 2 || n != 32 || a < 1 || a > b) return 0;
    return (size_t)n;
}

static int is_ckpt_file(const char *name)
{
    static const char *known[] = {TD_CKPT_CONFIG_FILE, TD_CKPT_MODEL_FILE, TD_CKPT_STATE_FILE, "vocab.json",
                                  "merges.txt", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                  TD_CKPT_MODEL_FILE ".index.json", NULL};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
        size_t k = known[i] ? strlen(known[i]) : shard_name_len(name); /* NULL: a shard */
        if (!k || strncmp(name, known[i] ? known[i] : name, k)) continue;
        if (name[k] == '\0') return 1;
        if (strncmp(name + k, ".tmp.", 5) || !name[k + 5]) continue;
        const char *p = name + k + 5;
        while (*p >= '0' && *p <= '9') p++;
        if (*p == '\0') return 1;
    }
    return 0;
}

/* TD_OK when `path` is a directory holding only checkpoint files. */
static td_status check_ckpt_dir(const char *path)
{
    DIR *d = opendir(path);
    if (!d)
        return td_error_set(TD_ERR_IO, "checkpoint: %s exists but cannot be opened as a directory: %s",
                            path, strerror(errno));
    td_status st = TD_OK;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && !is_ckpt_file(e->d_name)) {
            st = td_error_set(TD_ERR_INVALID,
                              "checkpoint: %s holds '%s', which tidal does not write; refusing to "
                              "replace or delete it. Save to another directory, or move the file away",
                              path, e->d_name);
            break;
        }
    closedir(d);
    return st;
}

/* Deletes a checkpoint directory: its checkpoint files, then itself.  Fails
 * without deleting anything if it holds anything else. */
static td_status remove_ckpt_dir(const char *path)
{
    td_status st = check_ckpt_dir(path);
    if (st != TD_OK) return st;
    DIR *d = opendir(path);
    if (!d) return td_error_set(TD_ERR_IO, "checkpoint: cannot open %s: %s", path, strerror(errno));
    struct dirent *e;
    while ((e = readdir(d)))
        if (is_ckpt_file(e->d_name) && unlinkat(dirfd(d), e->d_name, 0) != 0 && errno != ENOENT) {
            st = td_error_set(TD_ERR_IO, "checkpoint: cannot delete %s/%s: %s", path, e->d_name,
                              strerror(errno));
            break;
        }
    closedir(d);
    if (st == TD_OK && rmdir(path) != 0 && errno != ENOENT)
        st = td_error_set(TD_ERR_IO, "checkpoint: cannot remove directory %s: %s", path, strerror(errno));
    return st;
}

static int is_dir(const char *path)
{
    struct stat sb;
    return lstat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static int exists(const char *path)
{
    struct stat sb;
    return lstat(path, &sb) == 0;
}

/* Removes DIR.tmp.<pid> directories whose process is gone (or is this one). */
static td_status remove_stale_temps(const char *dir)
{
    td_status st = TD_OK;
    const char *slash = strrchr(dir, '/');
    char parent[4096];
    const char *base = slash ? slash + 1 : dir;
    if (!slash) snprintf(parent, sizeof parent, ".");
    else if (slash == dir) snprintf(parent, sizeof parent, "/");
    else snprintf(parent, sizeof parent, "%.*s", (int)(slash - dir), dir);
    DIR *d = opendir(parent);
    if (!d) return TD_OK; /* nothing to clean; the caller reports a missing parent */
    const size_t blen = strlen(base);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, base, blen) || strncmp(e->d_name + blen, ".tmp.", 5)) continue;
        const char *p = e->d_name + blen + 5;
        char *endp;
        long pid = strtol(p, &endp, 10);
        if (!*p || *endp || pid <= 0) continue;
        if (pid != (long)getpid() && !(kill((pid_t)pid, 0) != 0 && errno == ESRCH)) continue;
        char *path = cat3(parent, "/", e->d_name);
        if (!path) {
            st = td_error_set(TD_ERR_NOMEM, "checkpoint: out of memory");
            break;
        }
        st = remove_ckpt_dir(path);
        td_free(path);
        if (st != TD_OK) break;
    }
    closedir(d);
    return st;
}

td_status td_ckpt_recover(const char *dir_in)
{
    td_status st = TD_OK;
    char *dir = NULL, *old = NULL;
    if ((st = normalize_dir(dir_in, &dir)) != TD_OK) return st;
    if (!(old = cat3(dir, ".old", NULL))) TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
    if (!exists(dir) && is_dir(old)) {
        /* Interrupted between moving the old checkpoint aside and publishing the new one. */
        if (rename(old, dir) != 0)
            TD_FAIL(TD_ERR_IO, "checkpoint: cannot restore %s from %s: %s", dir, old, strerror(errno));
        TD_TRY(td_fsync_parent_dir(dir));
    } else if (is_dir(old)) {
        TD_TRY(remove_ckpt_dir(old));
        TD_TRY(td_fsync_parent_dir(old));
    }
    TD_TRY(remove_stale_temps(dir));
cleanup:
    td_free(old);
    td_free(dir);
    return st;
}

/* --- writer --------------------------------------------------------------- */

#define SCRATCH_BYTES ((size_t)4 << 20)

struct td_ckpt_writer {
    td_model_desc cfg;
    td_ckpt_write_options opt;
    char *dir, *tmp_dir, *old_dir;
    int n_params;
    td_st_writer **model, *state;    /* model: n_model files (shards), params in order */
    int n_model;
    int *shard_of;                   /* [n_params]: the file of each param */
    size_t *local_of;                /* [n_params]: its index in that file */
    int n_extra;
    int *state_at;                   /* [n_params]: the index of its first train-state tensor, -1 frozen (none) */
    int n_state;                     /* train-state tensors declared (the extras follow) */
    unsigned char *scratch; /* transposes, SCRATCH_BYTES */
    td_ckpt_group group;    /* size 0: one process streaming */
    int ranges;             /* td_ckpt_writer_begin_ranges done */
};

td_ckpt_write_options td_ckpt_write_default_options(void)
{
    td_ckpt_write_options o;
    memset(&o, 0, sizeof o);
    o.weight_dtype = TD_DTYPE_F32;
    o.train_state = 1;
    o.replace = TD_CKPT_REPLACE_AUTO;
    return o;
}

static void stage(const td_ckpt_writer *w, td_ckpt_stage s)
{
    if (w->opt.on_stage) w->opt.on_stage(s, w->opt.stage_arg);
}

void td_ckpt_writer_abort(td_ckpt_writer *w)
{
    if (!w) return;
    for (int i = 0; w->model && i < w->n_model; i++) td_st_writer_abort(w->model[i]);
    td_free(w->model);
    td_free(w->shard_of);
    td_free(w->state_at);
    td_free(w->local_of);
    td_st_writer_abort(w->state);
    if (w->tmp_dir && w->group.rank == 0 && is_dir(w->tmp_dir)) { /* in a group, rank 0's */
        /* Cleanup must not hide the error that made the caller abort. */
        char msg[1024], where[256];
        snprintf(msg, sizeof msg, "%s", td_error_msg());
        snprintf(where, sizeof where, "%s", td_error_where());
        if (remove_ckpt_dir(w->tmp_dir) != TD_OK) {
            td_error_set(TD_ERR_IO, "%s", msg);
            char *colon = strrchr(where, ':');
            if (colon) {
                *colon = '\0';
                td_error_trace(where, atoi(colon + 1));
            }
        }
    }
    td_free(w->scratch);
    td_free(w->dir);
    td_free(w->tmp_dir);
    td_free(w->old_dir);
    td_free(w);
}

/* model.safetensors.index.json: the total size and the file of each tensor. */
static td_status write_index(const td_ckpt_writer *w, uint64_t total, char **names)
{
    td_status st = TD_OK;
    char *text = NULL, *path = cat3(w->tmp_dir, "/", TD_CKPT_MODEL_FILE ".index.json");
    cJSON *o = cJSON_CreateObject(), *meta = cJSON_AddObjectToObject(o, "metadata");
    cJSON *map = cJSON_AddObjectToObject(o, "weight_map");
    if (!path || !o || !meta || !map) TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
    cJSON_AddNumberToObject(meta, "total_size", (double)total);
    for (int i = 0; i < w->n_params; i++) {
        td_model_hf_tensor p;
        TD_TRY(td_model_hf_get(&w->cfg, i, &p));
        cJSON_AddStringToObject(map, p.name, names[w->shard_of[i]]);
    }
    if (!(text = cJSON_Print(o))) TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
    TD_TRY(td_write_file_atomic(path, text, strlen(text)));
cleanup:
    if (text) cJSON_free(text);
    cJSON_Delete(o);
    td_free(path);
    return st;
}

/* The weights' files: model.safetensors, or shards of at most shard_bytes
 * (a tensor larger than that gets a shard of its own) with their index. */
static td_status declare_files(td_ckpt_writer *w)
{
    td_status st = TD_OK;
    char *path = NULL, **names = NULL;
    const size_t es = td_dtype_bytes(w->opt.weight_dtype);
    const uint64_t limit = w->opt.shard_bytes ? w->opt.shard_bytes : (uint64_t)5000000000u;
    w->shard_of = td_calloc((size_t)w->n_params, sizeof(int), TD_ROLE_META);
    w->local_of = td_calloc((size_t)w->n_params, sizeof(size_t), TD_ROLE_META);
    if (!w->shard_of || !w->local_of) TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
    uint64_t total = 0, in_shard = 0;
    int shards = 1;
    size_t local = 0;
    for (int i = 0; i < w->n_params; i++) {
        td_model_hf_tensor p;
        TD_TRY(td_model_hf_get(&w->cfg, i, &p));
        uint64_t bytes = p.hf_numel * es;
        if (in_shard && in_shard + bytes > limit) {
            shards++;
            in_shard = 0;
            local = 0;
        }
        w->shard_of[i] = shards - 1;
        w->local_of[i] = local++;
        in_shard += bytes;
        total += bytes;
    }
    w->model = td_calloc((size_t)shards, sizeof *w->model, TD_ROLE_META);
    names = td_calloc((size_t)shards, sizeof *names, TD_ROLE_META);
    if (!w->model || !names) TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
    w->n_model = shards;
    for (int k = 0; k < shards; k++) {
        char name[64];
        if (shards == 1) snprintf(name, sizeof name, "%s", TD_CKPT_MODEL_FILE);
        else snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", k + 1, shards);
        names[k] = cat3(name, "", NULL);
        td_free(path);
        if (!names[k] || !(path = cat3(w->tmp_dir, "/", name))) TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
        TD_TRY(td_st_writer_create(path, &w->model[k]));
        TD_TRY(td_st_writer_add_metadata(w->model[k], "format", "pt")); /* transformers requires it */
    }
    for (int i = 0; i < w->n_params; i++) {
        td_model_hf_tensor p;
        TD_TRY(td_model_hf_get(&w->cfg, i, &p));
        uint64_t shape[2] = {(uint64_t)p.hf_shape[0], (uint64_t)p.hf_shape[1]};
        TD_TRY(td_st_writer_declare(w->model[w->shard_of[i]], p.name, st_dtype_of(w->opt.weight_dtype), p.ndim,
                                    shape, NULL));
    }
    if (shards > 1 && w->group.rank == 0) TD_TRY(write_index(w, total, names)); /* in a group, rank 0's */
    if (!w->opt.train_state) goto cleanup;
    td_free(path);
    if (!(path = cat3(w->tmp_dir, "/", TD_CKPT_STATE_FILE))) TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
    TD_TRY(td_st_writer_create(path, &w->state));
    TD_TRY(td_st_writer_add_metadata(w->state, "format", "tidal-train-state"));
    if (!(w->state_at = td_malloc((size_t)w->n_params * sizeof(int), TD_ROLE_META)))
        TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
    w->n_state = 0;
    for (int i = 0; i < w->n_params; i++) {
        td_model_hf_tensor p;
        w->state_at[i] = -1;
        if (w->opt.no_state && w->opt.no_state[i]) continue; /* frozen: no train state */
        w->state_at[i] = w->n_state;
        w->n_state += TD_CKPT_STATE_COUNT;
        TD_TRY(td_model_hf_get(&w->cfg, i, &p));
        uint64_t shape[2] = {(uint64_t)p.shape[0], (uint64_t)p.shape[1]};
        for (int k = 0; k < TD_CKPT_STATE_COUNT; k++) {
            char name[96];
            snprintf(name, sizeof name, "%s.%s", td_ckpt_state_name((td_ckpt_state)k), p.name);
            TD_TRY(td_st_writer_declare(w->state, name, TD_ST_F32, p.ndim, shape, NULL));
        }
    }
cleanup:
    for (int k = 0; names && k < w->n_model; k++) td_free(names[k]);
    td_free(names);
    td_free(path);
    return st;
}

/* --- the files a ranged save writes --------------------------------------------- */

/* The weights' file of a parameter and its index there. */
static td_st_writer *weight_file(const td_ckpt_writer *w, int param) { return w->model[w->shard_of[param]]; }
static size_t weight_index(const td_ckpt_writer *w, int param) { return w->local_of[param]; }
/* Every file of the save: the weights' file(s), then the train state. */
static int file_count(const td_ckpt_writer *w) { return w->n_model + (w->state != NULL); }
static td_st_writer **file_at(td_ckpt_writer *w, int k) { return k < w->n_model ? &w->model[k] : &w->state; }

/* --- a group's agreement ------------------------------------------------------- */

/* What each rank reports at a collective point of a grouped save. */
typedef struct vote {
    int32_t ok, pad;
    uint64_t a, b;
    char msg[232];
} vote;

/* all[size] = every rank's vote; one primitive for every collective point. */
static td_status group_vote(td_ckpt_writer *w, td_status mine, uint64_t a, uint64_t b, vote **all)
{
    vote v = { .ok = mine == TD_OK, .a = a, .b = b };
    if (mine != TD_OK) snprintf(v.msg, sizeof v.msg, "%s", td_error_msg());
    *all = td_malloc((size_t)w->group.size * sizeof v, TD_ROLE_META);
    if (!*all) return td_error_set(TD_ERR_NOMEM, "checkpoint %s: out of memory", w->dir);
    if (w->group.size == 1) {
        (*all)[0] = v;
        return TD_OK;
    }
    td_status st = w->group.allgather(w->group.arg, &v, sizeof v, *all);
    if (st != TD_OK) {
        td_free(*all);
        *all = NULL;
        return td_error_prefix(st, "checkpoint %s: rank %d lost the other ranks: ", w->dir, w->group.rank);
    }
    return TD_OK;
}

/* TD_OK when every vote is ok; else the first failed rank's message, the same on every rank. */
static td_status group_verdict(const td_ckpt_writer *w, const vote *all, const char *when)
{
    for (int k = 0; k < w->group.size; k++)
        if (!all[k].ok)
            return td_error_set(TD_ERR_IO, "checkpoint %s: %s failed on rank %d: %s", w->dir, when, k, all[k].msg);
    return TD_OK;
}

static td_status check_group(const td_ckpt_group *g)
{
    if (g->size < 1 || g->rank < 0 || g->rank >= g->size || (g->size > 1 && !g->allgather))
        return td_error_set(TD_ERR_INVALID, "checkpoint: group of rank %d of %d%s", g->rank, g->size,
                            g->size > 1 && !g->allgather ? " without an allgather" : " is not valid");
    return TD_OK;
}

/* The folders above DIR, made as `mkdir -p` would (save_pretrained makes
 * them too); then that its parent takes new entries. */
static td_status make_parents(const char *dir)
{
    char *p = cat3(dir, "", NULL);
    if (!p) return td_error_prefix(TD_ERR_NOMEM, "checkpoint: ");
    td_status st = TD_OK;
    struct stat sb;
    char *slash = strrchr(p, '/');
    if (slash == p) slash[1] = '\0'; /* "/x": the parent is the root */
    else if (slash) *slash = '\0';
    else {
        p[0] = '.';
        p[1] = '\0';
    }
    for (char *c = p + 1; ; c++) { /* each prefix ending before a '/', then the whole */
        int end = *c == '\0';
        if (!end && *c != '/') continue;
        *c = '\0';
        if (mkdir(p, 0755) != 0 && errno != EEXIST)
            st = td_error_set(TD_ERR_IO, "checkpoint: cannot create the folder %s for %s: %s", p, dir, strerror(errno));
        else if (stat(p, &sb) != 0 || !S_ISDIR(sb.st_mode)) /* stat: a link to a folder is one */
            st = td_error_set(TD_ERR_INVALID, "checkpoint: %s is in the path of %s and is not a folder", p, dir);
        if (end || st) break;
        *c = '/';
    }
    if (!st && access(p, W_OK | X_OK) != 0)
        st = td_error_set(TD_ERR_IO, "checkpoint: cannot write into %s (the folder %s goes in): %s; choose "
                          "another checkpoint path", p, dir, strerror(errno));
    td_free(p);
    return st;
}

/* DIR (normalized) as a save's target: an existing one a writable directory
 * of checkpoint files only, else its folders made.  Shared by the up-front
 * check and the writer. */
static td_status check_target_dir(const char *d)
{
    td_status st = TD_OK;
    if (exists(d)) {
        if (!is_dir(d))
            return td_error_set(TD_ERR_INVALID, "checkpoint: %s exists and is not a directory; choose another "
                                "checkpoint path", d);
        if ((st = check_ckpt_dir(d))) return st;
        if (access(d, W_OK | X_OK) != 0)
            return td_error_set(TD_ERR_IO, "checkpoint: cannot write into %s: %s", d, strerror(errno));
    }
    return make_parents(d);
}

td_status td_ckpt_check_target(const char *dir)
{
    char *d = NULL;
    td_status st = normalize_dir(dir, &d);
    if (st) return st;
    st = check_target_dir(d);
    td_free(d);
    return st;
}

/* Rank 0's (or a lone writer's) part of starting a save: recovery, checks,
 * the temporary directory with config.json. */
static td_status start_dir(td_ckpt_writer *w, long pid)
{
    td_status st = TD_OK;
    char suffix[32], *cfg_path = NULL;
    snprintf(suffix, sizeof suffix, ".tmp.%ld", pid);
    w->tmp_dir = cat3(w->dir, suffix, NULL);
    cfg_path = w->tmp_dir ? cat3(w->tmp_dir, "/", TD_CKPT_CONFIG_FILE) : NULL;
    if (!w->tmp_dir || !cfg_path) TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
    if (w->group.rank != 0) goto cleanup;
    TD_TRY(td_ckpt_recover(w->dir));
    TD_TRY(check_target_dir(w->dir));
    if (mkdir(w->tmp_dir, 0755) != 0) {
        char *gone = w->tmp_dir;
        w->tmp_dir = NULL; /* not ours: abort must not remove it */
        st = td_error_set(TD_ERR_IO, "checkpoint: cannot create %s: %s; check that the parent directory exists "
                          "and is writable", gone, strerror(errno));
        td_free(gone);
        goto cleanup;
    }
    TD_TRY(write_config_json(cfg_path, &w->cfg, w->opt.weight_dtype));
cleanup:
    td_free(cfg_path);
    return st;
}

td_status td_ckpt_writer_begin(const char *dir, const td_model_desc *cfg,
                               const td_ckpt_write_options *opts, td_ckpt_writer **out)
{
    td_status st = TD_OK;
    vote *all = NULL;
    *out = NULL;
    td_ckpt_writer *w = td_calloc(1, sizeof *w, TD_ROLE_META);
    if (!w) return td_error_prefix(TD_ERR_NOMEM, "checkpoint: ");
    TD_TRY(config_check(cfg));
    w->cfg = *cfg;
    w->opt = opts ? *opts : td_ckpt_write_default_options();
    if (w->opt.group) {
        TD_TRY(check_group(w->opt.group));
        w->group = *w->opt.group;
        if (w->group.rank != 0) w->opt.on_stage = NULL;
    }
    if ((unsigned)w->opt.weight_dtype >= TD_DTYPE_COUNT)
        TD_FAIL(TD_ERR_INVALID, "checkpoint: unknown weight dtype %d", w->opt.weight_dtype);
    w->n_params = td_model_hf_count(cfg);
    TD_TRY(normalize_dir(dir, &w->dir));
    w->old_dir = cat3(w->dir, ".old", NULL);
    if (!w->old_dir) TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
    if (!w->group.size) {
        TD_TRY(start_dir(w, (long)getpid()));
        TD_TRY(declare_files(w));
        for (int k = 0; k < w->n_model; k++) TD_TRY(td_st_writer_begin(w->model[k]));
    } else {
        /* rank 0 starts the directory; everyone learns its name (rank 0's pid) and whether it worked */
        td_status mine = w->group.rank == 0 ? start_dir(w, (long)getpid()) : TD_OK;
        TD_TRY(group_vote(w, mine, (uint64_t)getpid(), 0, &all));
        TD_TRY(group_verdict(w, all, "starting the save"));
        if (w->group.rank != 0) TD_TRY(start_dir(w, (long)all[0].a));
        TD_TRY(declare_files(w));
    }
    stage(w, TD_CKPT_STAGE_TEMP_CREATED);
    *out = w;
    w = NULL;
cleanup:
    td_free(all);
    td_ckpt_writer_abort(w);
    return st;
}

td_status td_ckpt_writer_begin_ranges(td_ckpt_writer *w)
{
    td_status st = TD_OK, mine = TD_OK;
    vote *all = NULL;
    uint64_t hm = 0, hs = 0; /* the weights' headers, the train state's */
    const int nf = file_count(w), nm = nf - (w->state != NULL);
    if (!w->group.size || w->ranges)
        return td_error_set(TD_ERR_STATE, "checkpoint %s: %s", w->dir, w->ranges ? "ranged writing has begun already"
                            : "ranged writing needs a group in the write options");
    /* rank 0 creates the files, then the others open them */
    for (int create = 1; create >= 0; create--) {
        for (int k = 0; k < nf && mine == TD_OK && (w->group.rank == 0) == create; k++) {
            uint64_t h = 0;
            mine = td_st_writer_begin_shared(*file_at(w, k), create, &h);
            if (k < nm) hm = (hm ^ h) * 0x100000001b3ull;
            else hs = h;
        }
        TD_TRY(group_vote(w, mine, hm, hs, &all));
        TD_TRY(group_verdict(w, all, create ? "creating the files" : "opening the files"));
        if (create) {
            td_free(all);
            all = NULL;
        }
    }
    for (int k = 1; k < w->group.size; k++)
        if (all[k].a != all[0].a || all[k].b != all[0].b)
            TD_FAIL(TD_ERR_INVALID, "checkpoint %s: rank %d's %s header differs from rank 0's: every rank must save "
                    "the same model and declare the same metadata and extra tensors", w->dir, k,
                    all[k].a != all[0].a ? "weights'" : TD_CKPT_STATE_FILE);
    w->ranges = 1;
cleanup:
    td_free(all);
    return st;
}

static td_status need_state(const td_ckpt_writer *w, const char *what)
{
    if (!w->state)
        return td_error_set(TD_ERR_STATE, "checkpoint %s: %s needs train_state in the write options",
                            w->dir, what);
    return TD_OK;
}

td_status td_ckpt_writer_set_meta(td_ckpt_writer *w, const char *key, const char *value)
{
    td_status st = need_state(w, "metadata");
    if (st == TD_OK && !strcmp(key, "format"))
        st = td_error_set(TD_ERR_INVALID, "checkpoint %s: metadata key \"format\" is reserved", w->dir);
    return st != TD_OK ? st : td_st_writer_add_metadata(w->state, key, value);
}

td_status td_ckpt_writer_set_meta_u64(td_ckpt_writer *w, const char *key, uint64_t value)
{
    char buf[32];
    snprintf(buf, sizeof buf, "%llu", (unsigned long long)value);
    return td_ckpt_writer_set_meta(w, key, buf);
}

td_status td_ckpt_writer_set_meta_f64(td_ckpt_writer *w, const char *key, double value)
{
    char buf[40];
    snprintf(buf, sizeof buf, "%.17g", value);
    return td_ckpt_writer_set_meta(w, key, buf);
}

td_status td_ckpt_writer_declare_extra(td_ckpt_writer *w, const char *name, td_st_dtype dtype,
                                       int ndim, const uint64_t *shape, int *index_out)
{
    td_status st = need_state(w, "an extra tensor");
    if (st != TD_OK) return st;
    for (int k = 0; k < TD_CKPT_STATE_COUNT; k++) {
        size_t n = strlen(td_ckpt_state_name((td_ckpt_state)k));
        if (!strncmp(name, td_ckpt_state_name((td_ckpt_state)k), n) && name[n] == '.')
            return td_error_set(TD_ERR_INVALID, "checkpoint %s: extra tensor '%s' uses the reserved "
                                "prefix \"%s.\"", w->dir, name, td_ckpt_state_name((td_ckpt_state)k));
    }
    if ((st = td_st_writer_declare(w->state, name, dtype, ndim, shape, NULL)) != TD_OK) return st;
    if (index_out) *index_out = w->n_extra;
    w->n_extra++;
    return TD_OK;
}

static td_status check_param(const td_ckpt_writer *w, int param, td_model_hf_tensor *p)
{
    if (param < 0 || param >= w->n_params)
        return td_error_set(TD_ERR_INVALID, "checkpoint %s: parameter index %d out of range (0..%d)",
                            w->dir, param, w->n_params - 1);
    return td_model_hf_get(&w->cfg, param, p);
}

/* A frozen tensor's state was not declared (write options' no_state). */
static td_status state_declared(const td_ckpt_writer *w, int param, const td_model_hf_tensor *p)
{
    if (w->state_at && w->state_at[param] >= 0) return TD_OK;
    return td_error_set(TD_ERR_INVALID, "checkpoint %s: tensor '%s' is frozen and has no train state", w->dir, p->name);
}

/* The streaming calls of a lone writer; a group writes ranges. */
static td_status need_stream(const td_ckpt_writer *w)
{
    if (w->group.size)
        return td_error_set(TD_ERR_STATE, "checkpoint %s: a group's writer takes ranges (td_ckpt_writer_write_*), "
                            "not streamed pieces", w->dir);
    return TD_OK;
}

td_status td_ckpt_writer_append_weight(td_ckpt_writer *w, int param, td_dtype src_dtype,
                                       const void *src, size_t n_elems)
{
    td_model_hf_tensor p;
    td_status st = need_stream(w);
    if (st == TD_OK) st = check_param(w, param, &p);
    if (st != TD_OK) return st;
    return td_st_writer_write_convert(w->model[w->shard_of[param]], w->local_of[param], st_dtype_of(src_dtype), src,
                                      n_elems);
}

/* HF rows [i0, i1) of a transposed weight, gathered from tidal's (out, in)
 * layout: dst[(i - i0) * out + o] = src[o * in + i]. */
static void gather_columns(unsigned char *dst, const unsigned char *src, size_t esize, int64_t out,
                           int64_t in, int64_t i0, int64_t i1)
{
    const int64_t rows = i1 - i0;
    for (int64_t o = 0; o < out; o++) {
        const unsigned char *s = src + ((size_t)o * (size_t)in + (size_t)i0) * esize;
        if (esize == 4)
            for (int64_t i = 0; i < rows; i++) memcpy(dst + ((size_t)i * out + o) * 4, s + i * 4, 4);
        else
            for (int64_t i = 0; i < rows; i++) memcpy(dst + ((size_t)i * out + o) * 2, s + i * 2, 2);
    }
}

td_status td_ckpt_writer_put_weight(td_ckpt_writer *w, int param, td_dtype src_dtype, const void *src)
{
    td_model_hf_tensor p;
    td_status st = check_param(w, param, &p);
    if (st != TD_OK) return st;
    if (w->group.size) return td_ckpt_writer_write_weight(w, param, 0, src_dtype, src, p.numel);
    if (!p.transposed) return td_ckpt_writer_append_weight(w, param, src_dtype, src, p.hf_numel);
    if (!w->scratch && !(w->scratch = td_malloc(SCRATCH_BYTES, TD_ROLE_STAGING)))
        return td_error_prefix(TD_ERR_NOMEM, "checkpoint %s: transposing '%s': ", w->dir, p.name);
    const size_t es = td_dtype_bytes(src_dtype);
    const int64_t out = p.shape[0], in = p.shape[1];
    int64_t rows = (int64_t)(SCRATCH_BYTES / ((size_t)out * es));
    if (rows < 1) rows = 1; /* out > 1M columns: still bounded by one row, see below */
    for (int64_t i0 = 0; i0 < in; i0 += rows) {
        const int64_t i1 = i0 + rows < in ? i0 + rows : in;
        if ((size_t)(i1 - i0) * (size_t)out * es > SCRATCH_BYTES)
            return td_error_set(TD_ERR_INVALID, "checkpoint %s: '%s' has %lld columns, more than the "
                                "transpose buffer holds; write it with append_weight in the stored "
                                "layout", w->dir, p.name, (long long)out);
        gather_columns(w->scratch, src, es, out, in, i0, i1);
        st = td_st_writer_write_convert(w->model[w->shard_of[param]], w->local_of[param], st_dtype_of(src_dtype), w->scratch,
                                        (size_t)((i1 - i0) * out));
        if (st != TD_OK) return st;
    }
    return TD_OK;
}

td_status td_ckpt_writer_append_state(td_ckpt_writer *w, int param, td_ckpt_state kind,
                                      const float *src, size_t n_elems)
{
    td_model_hf_tensor p;
    td_status st = need_state(w, "training state");
    if (st == TD_OK) st = need_stream(w);
    if (st == TD_OK) st = check_param(w, param, &p);
    if (st == TD_OK && (unsigned)kind >= TD_CKPT_STATE_COUNT)
        st = td_error_set(TD_ERR_INVALID, "checkpoint %s: unknown state kind %d", w->dir, kind);
    if (st == TD_OK) st = state_declared(w, param, &p);
    if (st != TD_OK) return st;
    return td_st_writer_write(w->state, (size_t)w->state_at[param] + kind, src, n_elems * sizeof(float));
}

td_status td_ckpt_writer_append_extra(td_ckpt_writer *w, int extra, const void *bytes, size_t n_bytes)
{
    td_status st = need_state(w, "an extra tensor");
    if (st == TD_OK) st = need_stream(w);
    if (st != TD_OK) return st;
    if (extra < 0 || extra >= w->n_extra)
        return td_error_set(TD_ERR_INVALID, "checkpoint %s: extra tensor %d was not declared (%d are)",
                            w->dir, extra, w->n_extra);
    return td_st_writer_write(w->state, (size_t)w->n_state + (size_t)extra, bytes, n_bytes);
}

/* --- ranged writes and reads of transposed weights ------------------------------
 * A range of tidal's (out, in) layout of a Conv1D weight is stored (in, out):
 * it is cut into rectangles of rows [o0, o1) x columns [i0, i1) of tidal's
 * layout (a partial first row, blocks of whole rows that fit the scratch
 * buffer, a partial last row); rectangle element (o, i) is stored at i * out
 * + o, so each i is one contiguous run of o1 - o0 elements, and a block of
 * all `out` rows is one run. */
typedef struct rect {
    int64_t o0, o1, i0, i1;
} rect;

typedef td_status (*rect_fn)(void *ctx, const rect *r, size_t tidal_index);

static td_status walk_transposed(int64_t out, int64_t in, uint64_t off, uint64_t n, size_t es, rect_fn fn, void *ctx)
{
    (void)out;
    uint64_t cur = off, end = off + n;
    td_status st = TD_OK;
    int64_t rows_fit = (int64_t)(SCRATCH_BYTES / ((size_t)in * es));
    if (rows_fit < 1) rows_fit = 1;
    while (cur < end && st == TD_OK) {
        int64_t o = (int64_t)(cur / (uint64_t)in), i = (int64_t)(cur % (uint64_t)in);
        rect r = { o, o + 1, i, in };
        if (i != 0 || end - cur < (uint64_t)in) {
            if (end - cur < (uint64_t)(in - i)) r.i1 = i + (int64_t)(end - cur);
        } else {
            int64_t whole = (int64_t)((end - cur) / (uint64_t)in);
            r.o1 = o + (whole < rows_fit ? whole : rows_fit);
        }
        st = fn(ctx, &r, (size_t)(cur - off));
        cur += (uint64_t)((r.o1 - r.o0) * (r.i1 - r.i0));
    }
    return st;
}

/* dst[(i - i0) * rows + (o - o0)] = src[(o - o0) * cols + (i - i0)] (and back with the roles swapped). */
static void transpose(unsigned char *dst, const unsigned char *src, int64_t rows, int64_t cols, size_t es)
{
    for (int64_t o = 0; o < rows; o++)
        for (int64_t i = 0; i < cols; i++)
            memcpy(dst + ((size_t)i * (size_t)rows + (size_t)o) * es, src + ((size_t)o * (size_t)cols + (size_t)i) * es, es);
}

typedef struct range_io {
    td_ckpt_writer *w;
    const td_ckpt_reader *r;
    int param;
    int64_t out;
    td_dtype dt;
    const unsigned char *src;
    unsigned char *dst, *scratch;
} range_io;

static td_status write_rect(void *ctx, const rect *r, size_t at)
{
    range_io *io = ctx;
    const size_t es = td_dtype_bytes(io->dt);
    const int64_t rows = r->o1 - r->o0, cols = r->i1 - r->i0;
    transpose(io->scratch, io->src + at * es, rows, cols, es);
    if (rows == io->out) /* whole stored rows: one run */
        return td_st_writer_pwrite_convert(weight_file(io->w, io->param), weight_index(io->w, io->param),
                                           (uint64_t)(r->i0 * io->out),
                                           st_dtype_of(io->dt), io->scratch, (size_t)(rows * cols));
    td_status st = TD_OK;
    for (int64_t i = 0; i < cols && st == TD_OK; i++)
        st = td_st_writer_pwrite_convert(weight_file(io->w, io->param), weight_index(io->w, io->param),
                                         (uint64_t)((r->i0 + i) * io->out + r->o0),
                                         st_dtype_of(io->dt), io->scratch + (size_t)(i * rows) * es, (size_t)rows);
    return st;
}

static td_status need_ranges(const td_ckpt_writer *w)
{
    if (!w->ranges)
        return td_error_set(TD_ERR_STATE, "checkpoint %s: ranged writes need td_ckpt_writer_begin_ranges first "
                            "(and a group in the write options)", w->dir);
    return TD_OK;
}

static td_status check_elems(const char *dir, const char *name, uint64_t off, size_t n, uint64_t numel)
{
    if (off > numel || n > numel - off)
        return td_error_set(TD_ERR_INVALID, "checkpoint %s: elements [%llu, +%zu) run past the end of '%s' (%llu "
                            "elements)", dir, (unsigned long long)off, n, name, (unsigned long long)numel);
    return TD_OK;
}

td_status td_ckpt_writer_write_weight(td_ckpt_writer *w, int param, uint64_t elem_offset, td_dtype src_dtype,
                                      const void *src, size_t n_elems)
{
    td_model_hf_tensor p;
    td_status st = need_ranges(w);
    if (st == TD_OK) st = check_param(w, param, &p);
    if (st == TD_OK) st = check_elems(w->dir, p.name, elem_offset, n_elems, p.numel);
    if (st == TD_OK && (unsigned)src_dtype >= TD_DTYPE_COUNT)
        st = td_error_set(TD_ERR_INVALID, "checkpoint %s: unknown dtype %d", w->dir, (int)src_dtype);
    if (st != TD_OK || n_elems == 0) return st;
    if (!p.transposed) { /* stored as laid out; wte's padding rows past hf_numel are not stored */
        size_t keep = elem_offset >= p.hf_numel ? 0 : (size_t)(p.hf_numel - elem_offset < n_elems
                                                               ? p.hf_numel - elem_offset : n_elems);
        return keep ? td_st_writer_pwrite_convert(weight_file(w, param), weight_index(w, param), elem_offset,
                                                  st_dtype_of(src_dtype), src, keep) : TD_OK;
    }
    if (!w->scratch && !(w->scratch = td_malloc(SCRATCH_BYTES, TD_ROLE_STAGING)))
        return td_error_prefix(TD_ERR_NOMEM, "checkpoint %s: transposing '%s': ", w->dir, p.name);
    if ((size_t)p.shape[1] * td_dtype_bytes(src_dtype) > SCRATCH_BYTES)
        return td_error_set(TD_ERR_INVALID, "checkpoint %s: '%s' has rows of %lld elements, more than the transpose "
                            "buffer holds", w->dir, p.name, (long long)p.shape[1]);
    range_io io = { .w = w, .param = param, .out = p.shape[0], .dt = src_dtype, .src = src, .scratch = w->scratch };
    return walk_transposed(p.shape[0], p.shape[1], elem_offset, n_elems, td_dtype_bytes(src_dtype), write_rect, &io);
}

td_status td_ckpt_writer_write_state(td_ckpt_writer *w, int param, td_ckpt_state kind, uint64_t elem_offset,
                                     const float *src, size_t n_elems)
{
    td_model_hf_tensor p;
    td_status st = need_state(w, "training state");
    if (st == TD_OK) st = need_ranges(w);
    if (st == TD_OK) st = check_param(w, param, &p);
    if (st == TD_OK && (unsigned)kind >= TD_CKPT_STATE_COUNT)
        st = td_error_set(TD_ERR_INVALID, "checkpoint %s: unknown state kind %d", w->dir, kind);
    if (st == TD_OK) st = state_declared(w, param, &p);
    if (st != TD_OK) return st;
    return td_st_writer_pwrite_convert(w->state, (size_t)w->state_at[param] + kind, elem_offset, TD_ST_F32, src,
                                       n_elems);
}

td_status td_ckpt_writer_write_extra(td_ckpt_writer *w, int extra, uint64_t byte_offset, const void *bytes,
                                     size_t n_bytes)
{
    td_status st = need_state(w, "an extra tensor");
    if (st == TD_OK) st = need_ranges(w);
    if (st != TD_OK) return st;
    if (extra < 0 || extra >= w->n_extra)
        return td_error_set(TD_ERR_INVALID, "checkpoint %s: extra tensor %d was not declared (%d are)",
                            w->dir, extra, w->n_extra);
    return td_st_writer_pwrite(w->state, (size_t)w->n_state + (size_t)extra, byte_offset, bytes, n_bytes);
}

/* renameat2 flags; the names come from <stdio.h> with _GNU_SOURCE. */
#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif
#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif

static int unsupported(int err) { return err == EINVAL || err == ENOSYS || err == EOPNOTSUPP; }

/* Makes tmp_dir the checkpoint DIR; returns in *old where the previous one
 * now is (NULL if there was none). */
static td_status publish_dir(td_ckpt_writer *w, const char **old)
{
    *old = NULL;
    if (!exists(w->dir)) {
        int rc = renameat2(AT_FDCWD, w->tmp_dir, AT_FDCWD, w->dir, RENAME_NOREPLACE);
        if (rc != 0 && unsupported(errno)) rc = rename(w->tmp_dir, w->dir);
        if (rc != 0)
            return td_error_set(TD_ERR_IO, "checkpoint: cannot rename %s to %s: %s", w->tmp_dir, w->dir,
                                strerror(errno));
        return td_fsync_parent_dir(w->dir);
    }
    if (w->opt.replace != TD_CKPT_REPLACE_ASIDE) {
        if (renameat2(AT_FDCWD, w->tmp_dir, AT_FDCWD, w->dir, RENAME_EXCHANGE) == 0) {
            *old = w->tmp_dir;
            return td_fsync_parent_dir(w->dir);
        }
        if (!unsupported(errno) || w->opt.replace == TD_CKPT_REPLACE_EXCHANGE)
            return td_error_set(TD_ERR_IO, "checkpoint: cannot exchange %s and %s: %s%s", w->tmp_dir,
                                w->dir, strerror(errno),
                                unsupported(errno) ? " (the filesystem cannot exchange directories; "
                                                     "use the aside mode)" : "");
    }
    if (rename(w->dir, w->old_dir) != 0)
        return td_error_set(TD_ERR_IO, "checkpoint: cannot move %s aside to %s: %s", w->dir, w->old_dir,
                            strerror(errno));
    td_status st = td_fsync_parent_dir(w->dir);
    if (st != TD_OK) return st;
    stage(w, TD_CKPT_STAGE_OLD_ASIDE);
    if (rename(w->tmp_dir, w->dir) != 0) {
        st = td_error_set(TD_ERR_IO, "checkpoint: cannot rename %s to %s: %s", w->tmp_dir, w->dir,
                          strerror(errno));
        rename(w->old_dir, w->dir); /* put the old one back; recovery does it otherwise */
        return st;
    }
    *old = w->old_dir;
    return td_fsync_parent_dir(w->dir);
}

td_status td_ckpt_writer_add_file(td_ckpt_writer *w, const char *name, const char *src)
{
    static const char *const allowed[] = TD_CKPT_TOKENIZER_FILES;
    int ok = 0;
    for (size_t i = 0; i < sizeof allowed / sizeof allowed[0]; i++) ok |= name && !strcmp(name, allowed[i]);
    if (!w || !ok || !src)
        return td_error_set(TD_ERR_INVALID, "checkpoint: '%s' is not a file a checkpoint carries (vocab.json, "
                            "merges.txt, tokenizer.json, tokenizer_config.json, chat_template.jinja)",
                            name ? name : "(null)");
    if (w->group.rank != 0) return TD_OK; /* in a group, rank 0 copies it */
    char *path = cat3(w->tmp_dir, "/", name);
    if (!path) return td_error_set(TD_ERR_NOMEM, "checkpoint: out of memory");
    td_status st = td_copy_file(src, path);
    td_free(path);
    return st ? td_error_prefix(st, "checkpoint: adding %s: ", name) : TD_OK;
}

/* Publishing: DIR.tmp becomes DIR, the old checkpoint is deleted. */
static td_status publish(td_ckpt_writer *w)
{
    td_status st = TD_OK;
    const char *old = NULL;
    TD_TRY(td_fsync_parent_dir(w->tmp_dir)); /* tmp_dir itself as an entry of DIR's parent */
    stage(w, TD_CKPT_STAGE_FILES_SYNCED);
    TD_TRY(publish_dir(w, &old));
    stage(w, TD_CKPT_STAGE_PUBLISHED);
    if (old && ((st = remove_ckpt_dir(old)) != TD_OK || (st = td_fsync_parent_dir(w->dir)) != TD_OK)) {
        td_error_prefix(st, "checkpoint: the new checkpoint is saved in %s, but the previous one "
                        "could not be deleted from %s: ", w->dir, old);
        goto cleanup;
    }
    stage(w, TD_CKPT_STAGE_DONE);
cleanup:
    return st;
}

/* A group's commit: every rank's writes synced, all succeeded and together
 * complete, then rank 0 publishes and tells the others how it went. */
static td_status commit_group(td_ckpt_writer *w)
{
    td_status st = TD_OK, mine = need_ranges(w);
    vote *all = NULL;
    uint64_t put_m = 0, put_s = 0, need_m = 0, need_s = 0;
    const int nf = file_count(w), nm = nf - (w->state != NULL);
    for (int k = 0; k < nf; k++) { /* every file synced and closed (freed) whatever happens */
        td_st_writer **f = file_at(w, k);
        if (mine == TD_OK) {
            *(k < nm ? &put_m : &put_s) += td_st_writer_written(*f);
            *(k < nm ? &need_m : &need_s) += td_st_writer_data_bytes(*f);
            mine = td_st_writer_finish_shared(*f);
        } else {
            td_st_writer_abort(*f);
        }
        *f = NULL;
    }
    TD_TRY(group_vote(w, mine, put_m, put_s, &all));
    TD_TRY(group_verdict(w, all, "writing"));
    uint64_t got_m = 0, got_s = 0;
    for (int k = 0; k < w->group.size; k++) {
        got_m += all[k].a;
        got_s += all[k].b;
    }
    if (got_m != need_m || got_s != need_s)
        TD_FAIL(TD_ERR_STATE, "checkpoint %s: the ranks wrote %llu of the %llu bytes of the %s%s: their ranges must "
                "cover every tensor once", w->dir, (unsigned long long)(got_m != need_m ? got_m : got_s),
                (unsigned long long)(got_m != need_m ? need_m : need_s),
                got_m != need_m ? "weights" : TD_CKPT_STATE_FILE,
                (got_m > need_m || got_s > need_s) ? " (more: ranges overlap)" : "");
    td_free(all);
    all = NULL;
    mine = w->group.rank == 0 ? publish(w) : TD_OK;
    TD_TRY(group_vote(w, mine, 0, 0, &all));
    if (!all[0].ok) TD_FAIL(TD_ERR_IO, "%s", all[0].msg);
cleanup:
    td_free(all);
    return st;
}

td_status td_ckpt_writer_commit(td_ckpt_writer *w)
{
    td_status st = TD_OK;
    if (w->group.size) {
        st = commit_group(w);
    } else {
        td_st_writer *state = w->state;
        w->state = NULL; /* commit frees them whatever happens */
        for (int k = 0; k < w->n_model; k++) {
            td_st_writer *m = w->model[k];
            w->model[k] = NULL;
            if (st == TD_OK) st = td_st_writer_commit(m);
            else td_st_writer_abort(m);
        }
        if (st == TD_OK && state) st = td_st_writer_commit(state);
        else td_st_writer_abort(state);
        if (st == TD_OK) st = publish(w);
    }
    td_ckpt_writer_abort(w); /* after a successful publish tmp_dir is gone or was the old one */
    return st;
}

/* --- reader --------------------------------------------------------------- */

typedef struct weight_ref {
    const td_st_reader *file;
    const td_st_tensor *t;
} weight_ref;

struct td_ckpt_reader {
    char *dir;
    td_model_desc cfg;
    td_st_reader **shards;
    int n_shards;
    weight_ref *weights;         /* [n_params] */
    td_st_reader *state;
    const td_st_tensor **state_t; /* [n_params * 3] */
};

const td_model_desc *td_ckpt_reader_config(const td_ckpt_reader *r) { return &r->cfg; }
const char *td_ckpt_reader_dir(const td_ckpt_reader *r) { return r->dir; }
int td_ckpt_reader_has_state(const td_ckpt_reader *r) { return r->state != NULL; }
const td_st_reader *td_ckpt_reader_state_file(const td_ckpt_reader *r) { return r->state; }

void td_ckpt_reader_close(td_ckpt_reader *r)
{
    if (!r) return;
    for (int i = 0; i < r->n_shards; i++) td_st_close(r->shards[i]);
    td_free(r->shards);
    td_st_close(r->state);
    td_free(r->weights);
    td_free(r->state_t);
    td_free(r->dir);
    td_free(r);
}

/* Opens the shard files of model.safetensors.index.json. */
static td_status open_index(td_ckpt_reader *r, const char *index_path)
{
    td_status st = TD_OK;
    char *text = NULL, *path = NULL;
    size_t len = 0;
    cJSON *o = NULL;
    TD_TRY(read_small_file(index_path, &text, &len));
    o = cJSON_ParseWithLength(text, len);
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(o, "weight_map");
    if (!cJSON_IsObject(map))
        TD_FAIL(TD_ERR_INVALID, "%s: no \"weight_map\" object", index_path);
    int n = cJSON_GetArraySize(map);
    if (!(r->shards = td_calloc((size_t)n + 1, sizeof *r->shards, TD_ROLE_META)))
        TD_FAIL(TD_ERR_NOMEM, "out of memory reading %s", index_path);
    for (const cJSON *e = map->child; e; e = e->next) {
        if (!cJSON_IsString(e) || !e->valuestring[0] || strchr(e->valuestring, '/'))
            TD_FAIL(TD_ERR_INVALID, "%s: weight_map entry '%s' must name a file in the same directory",
                    index_path, e->string);
        int seen = 0;
        for (int i = 0; i < r->n_shards && !seen; i++) {
            const char *p = td_st_path(r->shards[i]);
            seen = !strcmp(strrchr(p, '/') + 1, e->valuestring);
        }
        if (seen) continue;
        td_free(path);
        if (!(path = cat3(r->dir, "/", e->valuestring))) TD_FAIL(TD_ERR_NOMEM, "out of memory");
        TD_TRY(td_st_open(path, &r->shards[r->n_shards]));
        r->n_shards++;
    }
cleanup:
    td_free(path);
    cJSON_Delete(o);
    td_free(text);
    return st;
}

static td_status check_model_tensors(td_ckpt_reader *r)
{
    const td_model_desc *cfg = &r->cfg;
    const td_model_family *fam = td_model_family_of(cfg);
    const char *opt = fam->hf_optional_prefix; /* files may carry it before every name */
    const int n = td_model_hf_count(cfg);
    char want[64], got[64];
    for (int i = 0; i < n; i++) {
        td_model_hf_tensor p;
        td_status st = td_model_hf_get(cfg, i, &p);
        if (st != TD_OK) return st;
        char prefixed[128];
        snprintf(prefixed, sizeof prefixed, "%s%s", opt ? opt : "", p.name);
        for (int s = 0; s < r->n_shards; s++) {
            const td_st_tensor *a = td_st_find(r->shards[s], p.name);
            const td_st_tensor *b = opt ? td_st_find(r->shards[s], prefixed) : NULL;
            if (a && b)
                return td_error_set(TD_ERR_INVALID, "%s: holds both '%s' and '%s'; keep one",
                                    td_st_path(r->shards[s]), p.name, prefixed);
            if ((a || b) && r->weights[i].t)
                return td_error_set(TD_ERR_INVALID, "%s: tensor '%s' is in two files (%s and %s)",
                                    r->dir, p.name, td_st_path(r->weights[i].file), td_st_path(r->shards[s]));
            if (a || b) r->weights[i] = (weight_ref){r->shards[s], a ? a : b};
        }
        const td_st_tensor *t = r->weights[i].t;
        shape_str(want, sizeof want, p.ndim, p.hf_shape);
        if (!t)
            return td_error_set(TD_ERR_INVALID, "%s: has no tensor '%s'%s%s%s, shape %s "
                                "for n_layer %d, n_embd %d, n_positions %d, vocab_size %d",
                                r->n_shards == 1 ? td_st_path(r->shards[0]) : r->dir, p.name,
                                opt ? " (nor '" : "", opt ? prefixed : "", opt ? "')" : "", want, cfg->n_layer,
                                cfg->n_embd, cfg->n_positions, cfg->vocab_size);
        int64_t found[TD_ST_MAX_DIMS];
        for (int d = 0; d < t->ndim; d++) found[d] = (int64_t)t->shape[d];
        shape_str(got, sizeof got, t->ndim, found);
        int same = t->ndim == p.ndim;
        for (int d = 0; same && d < p.ndim; d++) same = found[d] == p.hf_shape[d];
        if (!same) {
            int swapped = p.ndim == 2 && t->ndim == 2 && found[0] == p.hf_shape[1] && found[1] == p.hf_shape[0];
            return td_error_set(TD_ERR_INVALID, "%s: tensor '%s' has shape %s, expected %s for n_layer "
                                "%d, n_embd %d, n_positions %d, vocab_size %d%s",
                                td_st_path(r->weights[i].file), t->name, got, want, cfg->n_layer,
                                cfg->n_embd, cfg->n_positions, cfg->vocab_size,
                                !swapped ? "; check the model configuration"
                                : p.transposed ? " (it is transposed: the files keep this weight as (in, out))"
                                               : " (it is transposed: the files keep this weight as (out, in))");
        }
        if (t->dtype != TD_ST_F32 && t->dtype != TD_ST_BF16 && t->dtype != TD_ST_F16)
            return td_error_set(TD_ERR_INVALID, "%s: tensor '%s' is %s; weights must be F32, BF16 or F16",
                                td_st_path(r->weights[i].file), t->name, td_st_dtype_name(t->dtype));
    }
    /* Anything else must be known to be harmless. */
    for (int s = 0; s < r->n_shards; s++)
        for (size_t k = 0; k < td_st_tensor_count(r->shards[s]); k++) {
            const char *name = td_st_tensor_at(r->shards[s], k)->name;
            if (td_model_hf_find(cfg, name) >= 0 || td_model_hf_ignorable(cfg, name)) continue;
            const char *rest;
            int layer = td_model_hf_layer(cfg, name, &rest);
            if (layer >= cfg->n_layer)
                return td_error_set(TD_ERR_INVALID, "%s: tensor '%s' belongs to block %d, but the model "
                                    "has n_layer %d", td_st_path(r->shards[s]), name, layer, cfg->n_layer);
            char what[256];
            td_model_desc_describe(cfg, what, sizeof what);
            return td_error_set(TD_ERR_INVALID, "%s: tensor '%s' is not a parameter of this %s model (%s)",
                                td_st_path(r->shards[s]), name, fam->architecture, what);
        }
    return TD_OK;
}

static td_status check_state_tensors(td_ckpt_reader *r)
{
    const int n = td_model_hf_count(&r->cfg);
    char want[64], got[64];
    for (int i = 0; i < n; i++) {
        td_model_hf_tensor p;
        td_status st = td_model_hf_get(&r->cfg, i, &p);
        if (st != TD_OK) return st;
        int have = 0; /* a tensor frozen when saved has none of its state: read_state says so if asked */
        for (int k = 0; k < TD_CKPT_STATE_COUNT; k++) {
            char name[96];
            snprintf(name, sizeof name, "%s.%s", td_ckpt_state_name((td_ckpt_state)k), p.name);
            have += td_st_find(r->state, name) != NULL;
        }
        for (int k = 0; have && k < TD_CKPT_STATE_COUNT; k++) {
            char name[96];
            snprintf(name, sizeof name, "%s.%s", td_ckpt_state_name((td_ckpt_state)k), p.name);
            const td_st_tensor *t;
            if ((st = td_st_get(r->state, name, &t)) != TD_OK) return st;
            int64_t found[TD_ST_MAX_DIMS];
            for (int d = 0; d < t->ndim; d++) found[d] = (int64_t)t->shape[d];
            int same = t->ndim == p.ndim && t->dtype == TD_ST_F32;
            for (int d = 0; same && d < p.ndim; d++) same = found[d] == p.shape[d];
            if (!same) {
                shape_str(want, sizeof want, p.ndim, p.shape);
                shape_str(got, sizeof got, t->ndim, found);
                return td_error_set(TD_ERR_INVALID, "%s: tensor '%s' is %s %s, expected F32 %s (padded "
                                    "vocabulary %d); was it written for another model?",
                                    td_st_path(r->state), name, td_st_dtype_name(t->dtype), got, want,
                                    r->cfg.padded_vocab_size);
            }
            r->state_t[(size_t)i * TD_CKPT_STATE_COUNT + k] = t;
        }
    }
    return TD_OK;
}

/* The size td_model_desc_differs names, when it is one of the five a
 * partial description may give. */
static int size_of(const td_model_desc *d, const char *field, int *v)
{
    const struct { const char *name; int value; } sizes[] = {
        {"n_layer", d->n_layer}, {"n_head", d->n_head}, {"n_embd", d->n_embd}, {"n_positions", d->n_positions},
        {"vocab_size", d->vocab_size}};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (!strcmp(field, sizes[i].name)) return *v = sizes[i].value, 1;
    return 0;
}

/* The merged configuration: config.json (if any) checked against `expect`. */
static td_status resolve_config(td_ckpt_reader *r, const td_model_desc *expect)
{
    td_status st = TD_OK;
    char *path = cat3(r->dir, "/", TD_CKPT_CONFIG_FILE);
    if (!path) return td_error_set(TD_ERR_NOMEM, "checkpoint: out of memory");
    td_model_desc file;
    if (exists(path)) {
        TD_TRY(parse_config_json(path, &file));
        if (expect) {
            const char *field = td_model_desc_differs(expect, &file);
            if (field && !strcmp(field, "model_type"))
                TD_FAIL(TD_ERR_INVALID, "%s: model_type is %s but the model being trained is %s; use a checkpoint "
                        "of this model, or change the model flags to match", path,
                        td_model_family_name(td_model_family_of(&file)),
                        td_model_family_name(td_model_family_of(expect)));
            int fv, ev;
            if (field && size_of(&file, field, &fv) && size_of(expect, field, &ev))
                TD_FAIL(TD_ERR_INVALID, "%s: %s is %d but the model being trained has %d; use a checkpoint of this "
                        "model, or change the model flags to match", path, field, fv, ev);
            if (field)
                TD_FAIL(TD_ERR_INVALID, "%s: %s differs from the model being trained; use a checkpoint of "
                        "this model, or change the model flags to match", path, field);
            if (expect->padded_vocab_size > 0) file.padded_vocab_size = expect->padded_vocab_size;
        }
        r->cfg = file;
    } else {
        if (!expect || expect->n_layer < 1 || expect->n_head < 1 || expect->n_embd < 1 ||
            expect->n_positions < 1 || expect->vocab_size < 1)
            TD_FAIL(TD_ERR_INVALID, "checkpoint %s has no %s; give the full model configuration to "
                    "load it", r->dir, TD_CKPT_CONFIG_FILE);
        r->cfg = *expect;
        if (r->cfg.padded_vocab_size < 1) r->cfg.padded_vocab_size = r->cfg.vocab_size;
    }
    st = config_check(&r->cfg);
    if (st != TD_OK) td_error_prefix(st, "%s: ", exists(path) ? path : r->dir);
cleanup:
    td_free(path);
    return st;
}

td_status td_ckpt_reader_open(const char *dir_in, const td_model_desc *expect, td_ckpt_reader **out)
{
    td_status st = TD_OK;
    char *path = NULL, *norm = NULL;
    *out = NULL;
    td_ckpt_reader *r = td_calloc(1, sizeof *r, TD_ROLE_META);
    if (!r) return td_error_prefix(TD_ERR_NOMEM, "checkpoint: ");
    TD_TRY(normalize_dir(dir_in, &norm));
    if (!exists(norm)) {
        char *old = cat3(norm, ".old", NULL);
        if (!old) TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
        if (is_dir(old)) { /* an interrupted save left the previous checkpoint aside */
            r->dir = old;
        } else {
            td_free(old);
            TD_FAIL(TD_ERR_IO, "checkpoint directory %s does not exist", norm);
        }
    } else if (!is_dir(norm)) {
        TD_FAIL(TD_ERR_INVALID, "checkpoint %s is not a directory", norm);
    } else {
        r->dir = norm;
        norm = NULL;
    }
    TD_TRY(resolve_config(r, expect));
    const int n = td_model_hf_count(&r->cfg);
    r->weights = td_calloc((size_t)n, sizeof *r->weights, TD_ROLE_META);
    r->state_t = td_calloc((size_t)n * TD_CKPT_STATE_COUNT, sizeof *r->state_t, TD_ROLE_META);
    if (!r->weights || !r->state_t) TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
    if (!(path = cat3(r->dir, "/", TD_CKPT_MODEL_FILE))) TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
    if (exists(path)) {
        if (!(r->shards = td_calloc(1, sizeof *r->shards, TD_ROLE_META)))
            TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
        TD_TRY(td_st_open(path, &r->shards[0]));
        r->n_shards = 1;
    } else {
        td_free(path);
        if (!(path = cat3(r->dir, "/", TD_CKPT_MODEL_FILE ".index.json")))
            TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
        if (!exists(path))
            TD_FAIL(TD_ERR_INVALID, "checkpoint %s has no %s (nor a sharded %s.index.json)", r->dir,
                    TD_CKPT_MODEL_FILE, TD_CKPT_MODEL_FILE);
        TD_TRY(open_index(r, path));
    }
    TD_TRY(check_model_tensors(r));
    td_free(path);
    if (!(path = cat3(r->dir, "/", TD_CKPT_STATE_FILE))) TD_FAIL(TD_ERR_NOMEM, "checkpoint: out of memory");
    if (exists(path)) {
        TD_TRY(td_st_open(path, &r->state));
        TD_TRY(check_state_tensors(r));
    }
    *out = r;
    r = NULL;
cleanup:
    td_free(path);
    td_free(norm);
    td_ckpt_reader_close(r);
    return st;
}

static td_status reader_param(const td_ckpt_reader *r, int param, td_model_hf_tensor *p)
{
    if (param < 0 || param >= td_model_hf_count(&r->cfg))
        return td_error_set(TD_ERR_INVALID, "checkpoint %s: parameter index %d out of range (0..%d)",
                            r->dir, param, td_model_hf_count(&r->cfg) - 1);
    return td_model_hf_get(&r->cfg, param, p);
}

td_st_dtype td_ckpt_reader_weight_dtype(const td_ckpt_reader *r, int param)
{
    return param >= 0 && param < td_model_hf_count(&r->cfg) ? r->weights[param].t->dtype : TD_ST_F32;
}

td_status td_ckpt_reader_read_weight(const td_ckpt_reader *r, int param, uint64_t elem_offset,
                                     size_t n_elems, td_dtype dst_dtype, void *dst)
{
    td_model_hf_tensor p;
    td_status st = reader_param(r, param, &p);
    if (st != TD_OK) return st;
    const weight_ref *ref = &r->weights[param];
    return td_st_read(ref->file, ref->t, elem_offset, n_elems, st_dtype_of(dst_dtype), dst);
}

td_status td_ckpt_reader_get_weight(const td_ckpt_reader *r, int param, td_dtype dst_dtype, void *dst)
{
    td_model_hf_tensor p;
    td_status st = reader_param(r, param, &p);
    if (st != TD_OK) return st;
    const size_t es = td_dtype_bytes(dst_dtype);
    if (!p.transposed) {
        st = td_ckpt_reader_read_weight(r, param, 0, p.hf_numel, dst_dtype, dst);
        if (st == TD_OK && p.numel > p.hf_numel) /* wte's padding rows */
            memset((unsigned char *)dst + p.hf_numel * es, 0, (p.numel - p.hf_numel) * es);
        return st;
    }
    /* Stored (in, out): read blocks of rows, scatter each row into a column of (out, in). */
    const int64_t out = p.shape[0], in = p.shape[1];
    int64_t rows = (int64_t)(SCRATCH_BYTES / ((size_t)out * es));
    if (rows < 1) rows = 1;
    unsigned char *buf = td_malloc((size_t)rows * (size_t)out * es, TD_ROLE_STAGING);
    if (!buf) return td_error_prefix(TD_ERR_NOMEM, "checkpoint %s: reading '%s': ", r->dir, p.name);
    unsigned char *d = dst;
    for (int64_t i0 = 0; i0 < in && st == TD_OK; i0 += rows) {
        const int64_t i1 = i0 + rows < in ? i0 + rows : in;
        st = td_ckpt_reader_read_weight(r, param, (uint64_t)(i0 * out), (size_t)((i1 - i0) * out),
                                        dst_dtype, buf);
        for (int64_t o = 0; st == TD_OK && o < out; o++)
            for (int64_t i = i0; i < i1; i++)
                memcpy(d + ((size_t)o * (size_t)in + (size_t)i) * es,
                       buf + ((size_t)(i - i0) * (size_t)out + (size_t)o) * es, es);
    }
    td_free(buf);
    return st;
}

static td_status read_rect(void *ctx, const rect *r, size_t at)
{
    range_io *io = ctx;
    const size_t es = td_dtype_bytes(io->dt);
    const int64_t rows = r->o1 - r->o0, cols = r->i1 - r->i0;
    td_status st = TD_OK;
    if (rows == io->out)
        st = td_ckpt_reader_read_weight(io->r, io->param, (uint64_t)(r->i0 * io->out), (size_t)(rows * cols), io->dt,
                                        io->scratch);
    for (int64_t i = 0; rows != io->out && i < cols && st == TD_OK; i++)
        st = td_ckpt_reader_read_weight(io->r, io->param, (uint64_t)((r->i0 + i) * io->out + r->o0), (size_t)rows,
                                        io->dt, io->scratch + (size_t)(i * rows) * es);
    if (st == TD_OK) transpose(io->dst + at * es, io->scratch, cols, rows, es);
    return st;
}

td_status td_ckpt_reader_get_weight_range(const td_ckpt_reader *r, int param, uint64_t elem_offset,
                                          size_t n_elems, td_dtype dst_dtype, void *dst)
{
    td_model_hf_tensor p;
    td_status st = reader_param(r, param, &p);
    if (st == TD_OK) st = check_elems(r->dir, p.name, elem_offset, n_elems, p.numel);
    if (st == TD_OK && (unsigned)dst_dtype >= TD_DTYPE_COUNT)
        st = td_error_set(TD_ERR_INVALID, "checkpoint %s: unknown dtype %d", r->dir, (int)dst_dtype);
    if (st != TD_OK || n_elems == 0) return st;
    const size_t es = td_dtype_bytes(dst_dtype);
    if (!p.transposed) {
        size_t keep = elem_offset >= p.hf_numel ? 0 : (size_t)(p.hf_numel - elem_offset < n_elems
                                                               ? p.hf_numel - elem_offset : n_elems);
        if (keep) st = td_ckpt_reader_read_weight(r, param, elem_offset, keep, dst_dtype, dst);
        if (st == TD_OK && keep < n_elems) /* wte's padding rows */
            memset((unsigned char *)dst + keep * es, 0, (n_elems - keep) * es);
        return st;
    }
    if ((size_t)p.shape[1] * es > SCRATCH_BYTES)
        return td_error_set(TD_ERR_INVALID, "checkpoint %s: '%s' has rows of %lld elements, more than the transpose "
                            "buffer holds", r->dir, p.name, (long long)p.shape[1]);
    unsigned char *scratch = td_malloc(SCRATCH_BYTES, TD_ROLE_STAGING);
    if (!scratch) return td_error_prefix(TD_ERR_NOMEM, "checkpoint %s: reading '%s': ", r->dir, p.name);
    range_io io = { .r = r, .param = param, .out = p.shape[0], .dt = dst_dtype, .dst = dst, .scratch = scratch };
    st = walk_transposed(p.shape[0], p.shape[1], elem_offset, n_elems, es, read_rect, &io);
    td_free(scratch);
    return st;
}

td_status td_ckpt_reader_read_state(const td_ckpt_reader *r, int param, td_ckpt_state kind,
                                    uint64_t elem_offset, size_t n_elems, float *dst)
{
    td_model_hf_tensor p;
    td_status st = reader_param(r, param, &p);
    if (st != TD_OK) return st;
    if (!r->state)
        return td_error_set(TD_ERR_INVALID, "checkpoint %s has no %s: it holds weights only; start "
                            "from it with --init instead of --resume", r->dir, TD_CKPT_STATE_FILE);
    if ((unsigned)kind >= TD_CKPT_STATE_COUNT)
        return td_error_set(TD_ERR_INVALID, "checkpoint %s: unknown state kind %d", r->dir, kind);
    if (!r->state_t[(size_t)param * TD_CKPT_STATE_COUNT + kind])
        return td_error_set(TD_ERR_INVALID, "checkpoint %s: tensor '%s' was frozen (--freeze) in the run that saved "
                            "it and has no optimizer state: resume with the same --freeze, or start from the "
                            "checkpoint with --init", r->dir, p.name);
    return td_st_read(r->state, r->state_t[(size_t)param * TD_CKPT_STATE_COUNT + kind], elem_offset,
                      n_elems, TD_ST_F32, dst);
}

const char *td_ckpt_reader_meta(const td_ckpt_reader *r, const char *key)
{
    return r->state ? td_st_metadata(r->state, key) : NULL;
}

static td_status meta_for(const td_ckpt_reader *r, const char *key, const char **out)
{
    *out = td_ckpt_reader_meta(r, key);
    if (!*out)
        return td_error_set(TD_ERR_INVALID, "checkpoint %s: %s has no metadata \"%s\"", r->dir,
                            TD_CKPT_STATE_FILE, key);
    return TD_OK;
}

td_status td_ckpt_reader_meta_u64(const td_ckpt_reader *r, const char *key, uint64_t *out)
{
    const char *s;
    td_status st = meta_for(r, key, &s);
    if (st != TD_OK) return st;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (!*s || *s < '0' || *s > '9' || *end || errno)
        return td_error_set(TD_ERR_INVALID, "checkpoint %s: metadata \"%s\" = \"%s\" is not an unsigned "
                            "integer", r->dir, key, s);
    *out = v;
    return TD_OK;
}

td_status td_ckpt_reader_meta_f64(const td_ckpt_reader *r, const char *key, double *out)
{
    const char *s;
    td_status st = meta_for(r, key, &s);
    if (st != TD_OK) return st;
    char *end;
    double v = strtod(s, &end);
    if (!*s || *end)
        return td_error_set(TD_ERR_INVALID, "checkpoint %s: metadata \"%s\" = \"%s\" is not a number",
                            r->dir, key, s);
    *out = v;
    return TD_OK;
}
