/* Checkpoints of a trainer: its weights (the fp32 master), and with `state`
 * its AdamW state and step, written tensor by tensor from the host copies
 * through checkpoint/ (format in docs/checkpoints.md). */
#include "train_impl.h"
#include "tidal/checkpoint.h"

#include <string.h>

/* Moments travel as fp32 values whatever --optim-state keeps them in (the
 * state type is in the metadata), in pieces of MOMENT_PIECE elements
 * through a small buffer: a save or load takes no more heap than that. */
#define MOMENT_PIECE ((size_t)1 << 20)

/* Appends m or v (memmgr id) of checkpoint param k, elements [off, off + numel) of the tensor; fp32 or
 * bf16 state. */
static td_status moment_save(td_trainer *t, td_ckpt_writer *w, int k, td_ckpt_state kind, int id, size_t off,
                             size_t numel, float *tmp)
{
    void *p;
    td_status st = td_memmgr_host_access(t->mm, &id, 1, TD_ACCESS_READ, &p);
    if (st) return st;
    if (t->cfg.optim.state == TD_OPTIM_STATE_FP32) return td_ckpt_writer_append_state(w, k, kind, (float *)p + off, numel);
    /* bf16 (int8 moments go through int8_moment_save / _load) */
    for (size_t at = 0; at < numel; at += MOMENT_PIECE) {
        size_t n = numel - at < MOMENT_PIECE ? numel - at : MOMENT_PIECE;
        td_train_to_f32(tmp, (const uint16_t *)p + off + at, TD_DTYPE_BF16, n);
        if ((st = td_ckpt_writer_append_state(w, k, kind, tmp, n))) return st;
    }
    return TD_OK;
}

/* Reads m or v of checkpoint param k into elements [off, off + numel) of the moment buffer; fp32 or bf16
 * state. */
static td_status moment_load(td_trainer *t, const td_ckpt_reader *r, int k, td_ckpt_state kind, int id, size_t off,
                             size_t numel, float *tmp)
{
    void *p;
    td_status st = td_memmgr_host_access(t->mm, &id, 1, TD_ACCESS_WRITE, &p);
    if (st) return st;
    if (t->cfg.optim.state == TD_OPTIM_STATE_FP32) return td_ckpt_reader_read_state(r, k, kind, 0, numel, (float *)p + off);
    /* bf16 (int8 moments go through int8_moment_save / _load) */
    for (size_t at = 0; at < numel; at += MOMENT_PIECE) {
        size_t n = numel - at < MOMENT_PIECE ? numel - at : MOMENT_PIECE;
        if ((st = td_ckpt_reader_read_state(r, k, kind, at, n, tmp))) return st;
        td_train_from_f32((uint16_t *)p + off + at, TD_DTYPE_BF16, tmp, n);
    }
    return TD_OK;
}

/* Checkpoint parameter k: the tidal tensor it is (a part of), and the part's first element. */
static td_status ckpt_part(const td_model_desc *cc, int k, int *index, size_t *offset, size_t *numel)
{
    td_model_hf_tensor cp;
    td_status st = td_model_hf_get(cc, k, &cp);
    if (st) return st;
    *index = cp.tensor;
    *offset = (size_t)cp.offset;
    *numel = (size_t)cp.numel;
    return TD_OK;
}

/* int8 moments: a scale block can straddle two tensors, so they move by
 * whole blocks of their chunk.  A window of blocks [b0, b1) of a moment
 * chunk of `n` elements is copied into (or out of) a small buffer laid out
 * as a moment of its own (codes, padding, scales: optim.h), which
 * td_adam_moment_load / _store convert. */
#define INT8_WINDOW_BLOCKS (MOMENT_PIECE / TD_ADAM_INT8_BLOCK)
#define INT8_WINDOW_BYTES (MOMENT_PIECE + INT8_WINDOW_BLOCKS * sizeof(float) + 4)

static size_t int8_window(size_t n, size_t b0, size_t *b1)
{
    size_t blocks = (n + TD_ADAM_INT8_BLOCK - 1) / TD_ADAM_INT8_BLOCK;
    *b1 = b0 + INT8_WINDOW_BLOCKS < blocks ? b0 + INT8_WINDOW_BLOCKS : blocks;
    size_t end = *b1 * TD_ADAM_INT8_BLOCK < n ? *b1 * TD_ADAM_INT8_BLOCK : n;
    return end - b0 * TD_ADAM_INT8_BLOCK;
}

static void int8_window_io(unsigned char *chunk, size_t n, size_t b0, size_t b1, unsigned char *win, int out)
{
    size_t e0 = b0 * TD_ADAM_INT8_BLOCK, wn = (b1 * TD_ADAM_INT8_BLOCK < n ? b1 * TD_ADAM_INT8_BLOCK : n) - e0;
    unsigned char *codes = chunk + e0, *scales = chunk + ((n + 3) & ~(size_t)3) + b0 * sizeof(float);
    unsigned char *wscales = win + ((wn + 3) & ~(size_t)3);
    if (out) {
        memcpy(win, codes, wn);
        memset(win + wn, 0, (size_t)(wscales - win) - wn);
        memcpy(wscales, scales, (b1 - b0) * sizeof(float));
    } else {
        memcpy(codes, win, wn);
        memcpy(scales, wscales, (b1 - b0) * sizeof(float));
    }
}

/* The moment chunk of tensor i (memmgr ids `ids`): its host copy holds n
 * elements from chunk element *base (the whole chunk, base 0, or this
 * rank's shard under ZeRO-3, whose start is a multiple of the block: its
 * blocks are the chunk's); *first, where the tensor starts in the chunk. */
static td_status int8_chunk_of(td_trainer *t, const int *ids, int i, unsigned flags, unsigned char **buf, size_t *n,
                               size_t *first, size_t *base)
{
    td_memmgr *mm = t->mm;
    size_t end;
    int c = td_memmgr_tensor_chunk(mm, ids[i]);
    *n = td_memmgr_chunk_host_range(mm, c, base, &end);
    *first = td_memmgr_tensor_offset(mm, t->pid[i]);
    return td_memmgr_chunk_host_access(mm, c, flags, (void **)buf);
}

/* Elements [off, off + n) of checkpoint param k's state: appended in order
 * (one process streaming), or written at their place (ranks, ranged). */
static td_status put_state(td_trainer *t, td_ckpt_writer *w, int k, td_ckpt_state kind, size_t off, const float *src,
                           size_t n)
{
    if (t->ranks > 1) return td_ckpt_writer_write_state(w, k, kind, off, src, n);
    return td_ckpt_writer_append_state(w, k, kind, src, n);
}

/* int8 m or v of checkpoint param k (tensor i, elements [off, off + numel))
 * as fp32 values: the part the host copy holds (all of it on one rank). */
static td_status int8_moment_save(td_trainer *t, td_ckpt_writer *w, int k, td_ckpt_state kind, int i, size_t off,
                                  size_t numel, float *tmp, unsigned char *win)
{
    const int *ids = kind == TD_CKPT_STATE_ADAM_M ? t->mid : t->vid;
    td_adam_moment which = kind == TD_CKPT_STATE_ADAM_M ? TD_ADAM_MOMENT_M : TD_ADAM_MOMENT_V;
    unsigned char *buf;
    size_t n, first, base;
    td_status st = int8_chunk_of(t, ids, i, TD_ACCESS_READ, &buf, &n, &first, &base);
    if (st) return st;
    size_t p0 = first + off, e0 = p0 > base ? p0 : base, e1 = p0 + numel < base + n ? p0 + numel : base + n;
    if (e0 >= e1) return TD_OK;
    e0 -= base; /* host copy coordinates */
    e1 -= base;
    for (size_t b0 = e0 / TD_ADAM_INT8_BLOCK, b1; b0 * TD_ADAM_INT8_BLOCK < e1; b0 = b1) {
        size_t wn = int8_window(n, b0, &b1), w0 = b0 * TD_ADAM_INT8_BLOCK;
        int8_window_io(buf, n, b0, b1, win, 1);
        if ((st = td_adam_moment_load(TD_OPTIM_STATE_INT8, which, win, wn, tmp))) return st;
        size_t from = e0 > w0 ? e0 : w0, to = e1 < w0 + wn ? e1 : w0 + wn;
        if ((st = put_state(t, w, k, kind, from + base - p0, tmp + (from - w0), to - from))) return st;
    }
    return TD_OK;
}

/* Loads every int8 moment: chunk by chunk, window by window, each window
 * assembled from the checkpoint parts that fall in it (zeros between
 * tensors) and quantized whole. */
static td_status int8_moments_load(td_trainer *t, const td_ckpt_reader *r, const td_model_desc *cc, float *tmp,
                                   unsigned char *win)
{
    td_status st = TD_OK;
    td_memmgr *mm = t->mm;
    int np = td_model_hf_count(cc), chunks = td_memmgr_role_chunk_count(mm, TD_TENSOR_PARAM);
    int first_chunk = td_memmgr_role_chunk(mm, TD_TENSOR_PARAM, 0);
    for (int kind = 0; kind < 2; kind++) {
        td_ckpt_state ks = kind ? TD_CKPT_STATE_ADAM_V : TD_CKPT_STATE_ADAM_M;
        const int *ids = kind ? t->vid : t->mid;
        for (int c = 0; c < chunks; c++) {
            unsigned char *buf = NULL;
            size_t n = 0, base = 0; /* the host copy: n elements from chunk element base (a rank's shard) */
            for (size_t b0 = 0, b1 = 0; ; b0 = b1) {
                if (buf && b0 * TD_ADAM_INT8_BLOCK >= n) break;
                size_t wn = 0, w0 = b0 * TD_ADAM_INT8_BLOCK;
                for (int k = 0; k < np; k++) {
                    int i;
                    size_t off, numel, first;
                    TD_TRY(ckpt_part(cc, k, &i, &off, &numel));
                    if (td_memmgr_tensor_chunk(mm, t->pid[i]) - first_chunk != c) continue;
                    if (!buf) {
                        TD_TRY(int8_chunk_of(t, ids, i, TD_ACCESS_WRITE, &buf, &n, &first, &base));
                        if (!n) break; /* a rank past the end of a small chunk */
                        wn = int8_window(n, b0, &b1);
                        memset(tmp, 0, wn * sizeof(float));
                    }
                    first = td_memmgr_tensor_offset(mm, t->pid[i]);
                    size_t e0 = first + off, e1 = e0 + numel;
                    if (!wn) { wn = int8_window(n, b0, &b1); memset(tmp, 0, wn * sizeof(float)); }
                    size_t from = e0 > base + w0 ? e0 : base + w0, to = e1 < base + w0 + wn ? e1 : base + w0 + wn;
                    if (from < to)
                        TD_TRY(td_ckpt_reader_read_state(r, k, ks, from - e0, to - from, tmp + (from - base - w0)));
                }
                if (!buf || !n) break; /* no tensor in this chunk, or none of it here */
                TD_TRY(td_adam_moment_store(TD_OPTIM_STATE_INT8, kind ? TD_ADAM_MOMENT_V : TD_ADAM_MOMENT_M, tmp, wn,
                                            win));
                int8_window_io(buf, n, b0, b1, win, 0);
            }
        }
    }
cleanup:
    return st;
}

static td_status set_state_meta(td_trainer *t, td_ckpt_writer *w, const char *const *meta)
{
    td_status st = TD_OK;
    const td_loss_scaler *sc = &t->optim.scaler;
    TD_TRY(td_ckpt_writer_set_meta_u64(w, "optim_step", (uint64_t)t->optim.step));
    TD_TRY(td_ckpt_writer_set_meta_u64(w, "optim_skipped_steps", (uint64_t)t->optim.skipped_steps));
    TD_TRY(td_ckpt_writer_set_meta_f64(w, "loss_scale", sc->scale));
    TD_TRY(td_ckpt_writer_set_meta_u64(w, "loss_scale_clean_steps", (uint64_t)sc->clean_steps));
    TD_TRY(td_ckpt_writer_set_meta_u64(w, "loss_scale_hysteresis_left", (uint64_t)sc->hysteresis_left));
    TD_TRY(td_ckpt_writer_set_meta_u64(w, "loss_scale_overflows", (uint64_t)sc->overflows));
    TD_TRY(td_ckpt_writer_set_meta_u64(w, "seed", t->cfg.seed));
    TD_TRY(td_ckpt_writer_set_meta(w, "optim_state", td_optim_state_name(t->cfg.optim.state)));
    for (int i = 0; meta && meta[i] && meta[i + 1]; i += 2) TD_TRY(td_ckpt_writer_set_meta(w, meta[i], meta[i + 1]));
cleanup:
    return st;
}

/* ---- ZeRO-3: each rank its shard ----------------------------------------------
 * Rank r saves (and loads) the elements of every tensor that fall in its
 * shard of the tensor's chunk, straight from its host copies (the shard of
 * master, m and v it keeps; the whole 16-bit params); the files are those one
 * process writes, so any number of ranks resumes them. */

static td_status group_allgather(void *arg, const void *mine, size_t bytes, void *all)
{
    return td_comm_host_allgather(arg, mine, bytes, all);
}

/* Checkpoint param k (tensor i, its elements [off, off + numel)): where it
 * starts in its chunk (*p0), and the part [*from, *to) of it in this rank's
 * shard, which starts at chunk element *base. */
static void shard_part(td_trainer *t, int i, size_t off, size_t numel, size_t *p0, size_t *from, size_t *to,
                       size_t *base)
{
    size_t end;
    td_memmgr_chunk_host_range(t->mm, td_memmgr_tensor_chunk(t->mm, t->mid[i]), base, &end);
    *p0 = td_memmgr_tensor_offset(t->mm, t->pid[i]) + off;
    *from = *p0 > *base ? *p0 : *base;
    *to = *p0 + numel < end ? *p0 + numel : end;
    if (*to < *from) *to = *from;
}

/* Chunk element `at` of tensor i's fp32 master on this rank (in its shard):
 * the master chunk's shard, or the fp32 params (whole). */
static td_status master_at(td_trainer *t, int i, unsigned flags, size_t at, size_t base, float **out)
{
    void *h;
    int c = td_memmgr_tensor_chunk(t->mm, t->sid[i] >= 0 ? t->sid[i] : t->pid[i]);
    td_status st = td_memmgr_chunk_host_access(t->mm, c, flags, &h);
    *out = (float *)h + (t->sid[i] >= 0 ? at - base : at);
    return st;
}

/* Element `at` of tensor i's moment chunk (ids: mid or vid) on this rank. */
static td_status moment_at(td_trainer *t, const int *ids, int i, unsigned flags, size_t at, size_t base, void **out)
{
    void *h;
    td_status st = td_memmgr_chunk_host_access(t->mm, td_memmgr_tensor_chunk(t->mm, ids[i]), flags, &h);
    *out = (char *)h + (at - base) * (t->cfg.optim.state == TD_OPTIM_STATE_BF16 ? 2 : 4);
    return st;
}

static td_status save_shards(td_trainer *t, td_ckpt_writer *w, int state)
{
    td_status st = TD_OK;
    td_model_desc cc = t->cfg.model;
    float *tmp = td_malloc(MOMENT_PIECE * sizeof(float), TD_ROLE_META);
    unsigned char *win = td_malloc(INT8_WINDOW_BYTES, TD_ROLE_META);
    if (!tmp || !win) { st = TD_ERR_NOMEM; goto cleanup; }
    int n = td_model_hf_count(&cc);
    for (int k = 0; k < n; k++) {
        int i;
        size_t off, numel, p0, from, to, base;
        float *src;
        TD_TRY(ckpt_part(&cc, k, &i, &off, &numel));
        shard_part(t, i, off, numel, &p0, &from, &to, &base);
        if (from == to) continue;
        TD_TRY(master_at(t, i, TD_ACCESS_READ, from, base, &src));
        TD_TRY(td_ckpt_writer_write_weight(w, k, from - p0, TD_DTYPE_F32, src, to - from));
        if (!state) continue;
        TD_TRY(td_ckpt_writer_write_state(w, k, TD_CKPT_STATE_MASTER, from - p0, src, to - from));
        if (t->cfg.optim.state == TD_OPTIM_STATE_INT8) {
            TD_TRY(int8_moment_save(t, w, k, TD_CKPT_STATE_ADAM_M, i, off, numel, tmp, win));
            TD_TRY(int8_moment_save(t, w, k, TD_CKPT_STATE_ADAM_V, i, off, numel, tmp, win));
            continue;
        }
        for (int kind = 0; kind < 2; kind++) {
            td_ckpt_state ks = kind ? TD_CKPT_STATE_ADAM_V : TD_CKPT_STATE_ADAM_M;
            void *mv;
            TD_TRY(moment_at(t, kind ? t->vid : t->mid, i, TD_ACCESS_READ, from, base, &mv));
            if (t->cfg.optim.state == TD_OPTIM_STATE_FP32) {
                TD_TRY(td_ckpt_writer_write_state(w, k, ks, from - p0, mv, to - from));
                continue;
            }
            for (size_t at = 0; at < to - from; at += MOMENT_PIECE) {
                size_t m = to - from - at < MOMENT_PIECE ? to - from - at : MOMENT_PIECE;
                td_train_to_f32(tmp, (const uint16_t *)mv + at, TD_DTYPE_BF16, m);
                TD_TRY(td_ckpt_writer_write_state(w, k, ks, from - p0 + at, tmp, m));
            }
        }
    }
cleanup:
    td_free(tmp);
    td_free(win);
    return st;
}

/* Every rank: the whole params (each rank computes with all of them), and
 * its shard of master, m and v. */
static td_status load_shards(td_trainer *t, const td_ckpt_reader *r, int state, float *tmp)
{
    td_status st = TD_OK;
    td_model_desc cc = t->cfg.model;
    float *whole = NULL;
    size_t whole_n = 0;
    int n = td_model_hf_count(&cc);
    for (int k = 0; k < n; k++) {
        int i;
        size_t off, numel, p0, from, to, base;
        char *p;
        TD_TRY(ckpt_part(&cc, k, &i, &off, &numel));
        shard_part(t, i, off, numel, &p0, &from, &to, &base);
        TD_TRY(td_memmgr_chunk_host_access(t->mm, td_memmgr_tensor_chunk(t->mm, t->pid[i]), TD_ACCESS_WRITE,
                                           (void **)&p));
        float *dst = (float *)(p + p0 * td_dtype_bytes(t->dt));
        if (t->sid[i] >= 0) { /* 16-bit params: through fp32, the shard's part kept as the master */
            if (numel > whole_n) {
                td_free(whole);
                if (!(whole = td_malloc(numel * sizeof(float), TD_ROLE_META))) { st = TD_ERR_NOMEM; goto cleanup; }
                whole_n = numel;
            }
            dst = whole;
        }
        if (state) TD_TRY(td_ckpt_reader_read_state(r, k, TD_CKPT_STATE_MASTER, 0, numel, dst));
        else TD_TRY(td_ckpt_reader_get_weight(r, k, TD_DTYPE_F32, dst));
        if (t->sid[i] >= 0) {
            float *master;
            td_train_from_f32(p + p0 * td_dtype_bytes(t->dt), t->dt, whole, numel);
            if (from < to) {
                TD_TRY(master_at(t, i, TD_ACCESS_WRITE, from, base, &master));
                memcpy(master, whole + (from - p0), (to - from) * sizeof(float));
            }
        }
        if (!state || from == to || t->cfg.optim.state == TD_OPTIM_STATE_INT8) continue; /* int8: by blocks, below */
        for (int kind = 0; kind < 2; kind++) {
            td_ckpt_state ks = kind ? TD_CKPT_STATE_ADAM_V : TD_CKPT_STATE_ADAM_M;
            void *mv;
            TD_TRY(moment_at(t, kind ? t->vid : t->mid, i, TD_ACCESS_WRITE, from, base, &mv));
            if (t->cfg.optim.state == TD_OPTIM_STATE_FP32) {
                TD_TRY(td_ckpt_reader_read_state(r, k, ks, from - p0, to - from, mv));
                continue;
            }
            for (size_t at = 0; at < to - from; at += MOMENT_PIECE) {
                size_t m = to - from - at < MOMENT_PIECE ? to - from - at : MOMENT_PIECE;
                TD_TRY(td_ckpt_reader_read_state(r, k, ks, from - p0 + at, m, tmp));
                td_train_from_f32((uint16_t *)mv + at, TD_DTYPE_BF16, tmp, m);
            }
        }
    }
    if (state && t->cfg.optim.state == TD_OPTIM_STATE_INT8) {
        unsigned char *win = td_malloc(INT8_WINDOW_BYTES, TD_ROLE_META);
        st = win ? int8_moments_load(t, r, &cc, tmp, win) : TD_ERR_NOMEM;
        td_free(win);
    }
cleanup:
    td_free(whole);
    return st;
}

td_status td_trainer_save(td_trainer *t, const char *dir, int state, const char *const *meta)
{
    return td_trainer_save_files(t, dir, state, meta, NULL);
}

td_status td_trainer_save_files(td_trainer *t, const char *dir, int state, const char *const *meta,
                                const char *const *files)
{
    td_status st = TD_OK;
    td_model_desc cc = t->cfg.model;
    td_ckpt_write_options wo = td_ckpt_write_default_options();
    wo.train_state = state;
    wo.shard_bytes = t->cfg.save_shard_bytes;
    td_ckpt_writer *w = NULL;
    td_ckpt_group group;
    float *tmp = NULL; /* moments not stored as fp32 go through it */
    unsigned char *win = NULL; /* int8 moments: a window of blocks */
    TD_TRY(td_trainer_finish_update(t));
    if (t->ranks > 1) {
        group = (td_ckpt_group){ .rank = t->rank, .size = t->ranks, .allgather = group_allgather, .arg = t->comm };
        wo.group = &group; /* used until commit */
        TD_TRY(td_ckpt_writer_begin(dir, &cc, &wo, &w));
        if (state) TD_TRY(set_state_meta(t, w, meta));
        TD_TRY(td_ckpt_writer_begin_ranges(w));
        TD_TRY(save_shards(t, w, state));
        goto files;
    }
    TD_TRY(td_ckpt_writer_begin(dir, &cc, &wo, &w));
    if (state) TD_TRY(set_state_meta(t, w, meta));
    /* Tensor by tensor from the host copies: never the whole model at once. */
    int n = td_model_hf_count(&cc);
    for (int k = 0; k < n; k++) {
        int i;
        size_t off, numel;
        TD_TRY(ckpt_part(&cc, k, &i, &off, &numel));
        /* The fp32 master holds the exact weights (the params themselves in fp32). */
        int src = t->sid[i] >= 0 ? t->sid[i] : t->pid[i];
        void *p;
        TD_TRY(td_memmgr_host_access(t->mm, &src, 1, TD_ACCESS_READ, &p));
        TD_TRY(td_ckpt_writer_put_weight(w, k, TD_DTYPE_F32, (float *)p + off));
    }
    for (int k = 0; state && k < n; k++) {
        int i;
        size_t off, numel;
        TD_TRY(ckpt_part(&cc, k, &i, &off, &numel));
        void *p;
        int src = t->sid[i] >= 0 ? t->sid[i] : t->pid[i];
        if (t->cfg.optim.state != TD_OPTIM_STATE_FP32 && !tmp &&
            !(tmp = td_malloc(MOMENT_PIECE * sizeof(float), TD_ROLE_META))) { st = TD_ERR_NOMEM; goto cleanup; }
        if (t->cfg.optim.state == TD_OPTIM_STATE_INT8 && !win &&
            !(win = td_malloc(INT8_WINDOW_BYTES, TD_ROLE_META))) { st = TD_ERR_NOMEM; goto cleanup; }
        TD_TRY(td_memmgr_host_access(t->mm, &src, 1, TD_ACCESS_READ, &p));
        TD_TRY(td_ckpt_writer_append_state(w, k, TD_CKPT_STATE_MASTER, (float *)p + off, numel));
        if (t->cfg.optim.state == TD_OPTIM_STATE_INT8) {
            TD_TRY(int8_moment_save(t, w, k, TD_CKPT_STATE_ADAM_M, i, off, numel, tmp, win));
            TD_TRY(int8_moment_save(t, w, k, TD_CKPT_STATE_ADAM_V, i, off, numel, tmp, win));
        } else {
            TD_TRY(moment_save(t, w, k, TD_CKPT_STATE_ADAM_M, t->mid[i], off, numel, tmp));
            TD_TRY(moment_save(t, w, k, TD_CKPT_STATE_ADAM_V, t->vid[i], off, numel, tmp));
        }
    }
    td_free(tmp);
    tmp = NULL;
    td_free(win);
    win = NULL;
files:
    for (int k = 0; files && files[k]; k++) {
        const char *slash = strrchr(files[k], '/');
        TD_TRY(td_ckpt_writer_add_file(w, slash ? slash + 1 : files[k], files[k]));
    }
    st = td_ckpt_writer_commit(w);
    w = NULL; /* commit frees it whatever the outcome */
    if (st) goto cleanup;
    return TD_OK;
cleanup:
    td_free(tmp);
    td_free(win);
    td_ckpt_writer_abort(w);
    return td_error_prefix(st, "saving checkpoint %s: ", dir);
}

td_status td_trainer_checkpoint_model(const char *dir, td_model_desc *out)
{
    td_ckpt_reader *r = NULL;
    td_status st = td_ckpt_reader_open(dir, NULL, &r);
    if (st) return st;
    const td_model_desc *c = td_ckpt_reader_config(r);
    *out = *c;
    out->padded_vocab_size = c->padded_vocab_size > c->vocab_size ? c->padded_vocab_size : td_model_pad_vocab(c->vocab_size);
    td_ckpt_reader_close(r);
    return TD_OK;
}

td_status td_trainer_load(td_trainer *t, const char *dir, int state, td_ckpt_reader **reader_out)
{
    td_status st = TD_OK;
    td_model_desc cc = t->cfg.model;
    td_ckpt_reader *r = NULL;
    float *tmp = NULL; /* moments not stored as fp32 go through it */
    if (reader_out) *reader_out = NULL;
    TD_TRY(td_trainer_finish_update(t)); /* nothing pending may overwrite what is loaded */
    TD_TRY(td_ckpt_reader_open(dir, &cc, &r));
    if (state && !td_ckpt_reader_has_state(r))
        TD_FAIL(TD_ERR_INVALID, "%s has no train_state.safetensors: it holds weights only; start from it with "
                "--init instead of --resume", dir);
    if (state) { /* the moments continue only in the type they were stored in (checkpoints before it: fp32) */
        const char *saved = td_ckpt_reader_meta(r, "optim_state");
        td_optim_state ss = TD_OPTIM_STATE_FP32;
        if (saved && td_optim_state_parse(saved, &ss) != TD_OK)
            TD_FAIL(TD_ERR_INVALID, "%s: train_state.safetensors names an unknown optimizer state type '%s'", dir, saved);
        if (ss != t->cfg.optim.state)
            TD_FAIL(TD_ERR_INVALID, "%s was saved with --optim-state %s and this run uses --optim-state %s; resume "
                    "with --optim-state %s (the AdamW moments continue in the type they were kept in)", dir,
                    td_optim_state_name(ss), td_optim_state_name(t->cfg.optim.state), td_optim_state_name(ss));
    }
    int n = td_model_hf_count(&cc);
    if (t->ranks > 1) {
        if (!(tmp = td_malloc(MOMENT_PIECE * sizeof(float), TD_ROLE_META))) { st = TD_ERR_NOMEM; goto cleanup; }
        TD_TRY(load_shards(t, r, state, tmp));
        n = 0; /* done */
    }
    for (int k = 0; k < n; k++) {
        int i;
        size_t off, numel;
        TD_TRY(ckpt_part(&cc, k, &i, &off, &numel));
        void *p, *master;
        TD_TRY(td_memmgr_host_access(t->mm, &t->pid[i], 1, TD_ACCESS_WRITE, &p));
        master = p;
        if (t->sid[i] >= 0) TD_TRY(td_memmgr_host_access(t->mm, &t->sid[i], 1, TD_ACCESS_WRITE, &master));
        /* the part of the tensor (q, k, v of a fused qkv; gate, up of gate_up) */
        p = (char *)p + off * td_dtype_bytes(t->dt);
        master = (float *)master + off;
        if (state) { /* the fp32 master holds the exact weights */
            TD_TRY(td_ckpt_reader_read_state(r, k, TD_CKPT_STATE_MASTER, 0, numel, master));
            if (t->cfg.optim.state != TD_OPTIM_STATE_FP32 && !tmp &&
                !(tmp = td_malloc(MOMENT_PIECE * sizeof(float), TD_ROLE_META))) { st = TD_ERR_NOMEM; goto cleanup; }
            if (t->cfg.optim.state != TD_OPTIM_STATE_INT8) { /* int8: whole blocks, after this loop */
                TD_TRY(moment_load(t, r, k, TD_CKPT_STATE_ADAM_M, t->mid[i], off, numel, tmp));
                TD_TRY(moment_load(t, r, k, TD_CKPT_STATE_ADAM_V, t->vid[i], off, numel, tmp));
            }
        } else {
            TD_TRY(td_ckpt_reader_get_weight(r, k, TD_DTYPE_F32, master));
        }
        if (master != p) td_train_from_f32(p, t->dt, master, numel);
    }
    if (state && t->cfg.optim.state == TD_OPTIM_STATE_INT8 && t->ranks == 1) {
        unsigned char *win = td_malloc(INT8_WINDOW_BYTES, TD_ROLE_META);
        if (!tmp) tmp = td_malloc(MOMENT_PIECE * sizeof(float), TD_ROLE_META);
        st = win && tmp ? int8_moments_load(t, r, &cc, tmp, win) : TD_ERR_NOMEM;
        td_free(win);
        if (st) goto cleanup;
    }
    if (state) {
        uint64_t step, skipped, clean, hyst, overflows;
        double scale;
        TD_TRY(td_ckpt_reader_meta_u64(r, "optim_step", &step));
        TD_TRY(td_ckpt_reader_meta_u64(r, "optim_skipped_steps", &skipped));
        TD_TRY(td_ckpt_reader_meta_f64(r, "loss_scale", &scale));
        TD_TRY(td_ckpt_reader_meta_u64(r, "loss_scale_clean_steps", &clean));
        TD_TRY(td_ckpt_reader_meta_u64(r, "loss_scale_hysteresis_left", &hyst));
        TD_TRY(td_ckpt_reader_meta_u64(r, "loss_scale_overflows", &overflows));
        t->optim.step = (long)step;
        t->optim.skipped_steps = (long)skipped;
        t->optim.scaler.scale = scale;
        t->optim.scaler.clean_steps = (long)clean;
        t->optim.scaler.hysteresis_left = (int)hyst;
        t->optim.scaler.overflows = (long)overflows;
    }
    td_free(tmp);
    if (reader_out) {
        *reader_out = r;
        return TD_OK;
    }
    td_ckpt_reader_close(r);
    return TD_OK;
cleanup:
    td_free(tmp);
    td_ckpt_reader_close(r);
    return td_error_prefix(st, "loading checkpoint %s: ", dir);
}
