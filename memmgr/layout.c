/* Registration and chunk layout: packing tensors into chunks of one size,
 * searched to waste the fewest padding bytes. */
#include "memmgr_impl.h"
#include "tidal/util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

const char *td_tensor_role_name(td_tensor_role r)
{
    static const char *names[TD_TENSOR_ROLE_COUNT] = {"param", "grad", "master", "adam_m", "adam_v", "other"};
    return (unsigned)r < TD_TENSOR_ROLE_COUNT ? names[r] : "unknown";
}

td_status td_memmgr_register(td_memmgr *m, const char *name, size_t numel, td_dtype dtype, td_tensor_role role,
                             int *id_out)
{
    if (m->laid_out) return td_error_set(TD_ERR_STATE, "memmgr: '%s' registered after the layout was made", name);
    if (!name || !*name) return td_error_set(TD_ERR_INVALID, "memmgr: a tensor needs a name");
    if (numel == 0) return td_error_set(TD_ERR_INVALID, "memmgr: tensor '%s' has no elements", name);
    if ((unsigned)dtype >= TD_DTYPE_COUNT || (unsigned)role >= TD_TENSOR_ROLE_COUNT)
        return td_error_set(TD_ERR_INVALID, "memmgr: tensor '%s' has a bad dtype or role", name);
    if (m->n_tensors == m->cap_tensors) {
        int cap = m->cap_tensors ? 2 * m->cap_tensors : 64;
        mm_tensor *grown = td_malloc((size_t)cap * sizeof *grown, TD_ROLE_META);
        if (!grown) return TD_ERR_NOMEM;
        if (m->n_tensors) memcpy(grown, m->tensors, (size_t)m->n_tensors * sizeof *grown);
        td_free(m->tensors);
        m->tensors = grown;
        m->cap_tensors = cap;
    }
    char *copy = td_strdup(name, TD_ROLE_META);
    if (!copy) return TD_ERR_NOMEM;
    m->tensors[m->n_tensors] = (mm_tensor){ .name = copy, .numel = numel, .dtype = dtype, .role = role,
                                            .chunk = -1, .state = TD_TENSOR_FREE };
    *id_out = m->n_tensors++;
    return TD_OK;
}

td_status td_memmgr_set_role_format(td_memmgr *m, td_tensor_role role, size_t (*bytes_of)(size_t numel, void *ctx),
                                    void *ctx)
{
    if (m->laid_out || m->n_chunks) return td_error_set(TD_ERR_STATE, "memmgr: a role's format is set before the layout");
    if ((unsigned)role >= TD_TENSOR_ROLE_COUNT) return td_error_set(TD_ERR_INVALID, "memmgr: no role %d", (int)role);
    m->role_bytes[role] = bytes_of;
    m->role_ctx[role] = ctx;
    return TD_OK;
}

size_t mm_tensor_byte_offset(const td_memmgr *m, const mm_tensor *t)
{
    return m->role_bytes[t->role] ? 0 : t->offset * td_dtype_bytes(t->dtype);
}

/* Each role's tensors in registration order (a counting sort by role), so
 * that packing walks a role's tensors alone: the chunk search packs every
 * candidate size, and a model has thousands of tensors in five roles.
 * Beside the ids, each one's elements, contiguous, for the search's walks;
 * and per role the element size its tensors share (0: mixed) and an earlier
 * role with the same sizes in the same order and a shared element size
 * (-1: none): the mirrored roles (grads, master, m, v of the params) pack
 * into the same chunks, so a search walks such a role once. */
typedef struct mm_by_role {
    int *ids;
    size_t *numel;
    int start[TD_TENSOR_ROLE_COUNT + 1];
    size_t el[TD_TENSOR_ROLE_COUNT];
    int same_as[TD_TENSOR_ROLE_COUNT];
} mm_by_role;

static td_status by_role_make(const td_memmgr *m, mm_by_role *br)
{
    int next[TD_TENSOR_ROLE_COUNT];
    memset(br->start, 0, sizeof br->start);
    br->ids = td_malloc((size_t)m->n_tensors * sizeof *br->ids, TD_ROLE_META);
    br->numel = td_malloc((size_t)m->n_tensors * sizeof *br->numel, TD_ROLE_META);
    if (!br->ids || !br->numel) {
        td_free(br->ids);
        td_free(br->numel);
        br->ids = NULL;
        br->numel = NULL;
        return TD_ERR_NOMEM;
    }
    for (int i = 0; i < m->n_tensors; i++) br->start[m->tensors[i].role + 1]++;
    for (int r = 0; r < TD_TENSOR_ROLE_COUNT; r++) {
        br->start[r + 1] += br->start[r];
        next[r] = br->start[r];
    }
    for (int i = 0; i < m->n_tensors; i++) {
        int j = next[m->tensors[i].role]++;
        br->ids[j] = i;
        br->numel[j] = m->tensors[i].numel;
    }
    for (int r = 0; r < TD_TENSOR_ROLE_COUNT; r++) {
        br->el[r] = 0;
        br->same_as[r] = -1;
        for (int j = br->start[r]; j < br->start[r + 1]; j++) {
            size_t el = td_dtype_bytes(m->tensors[br->ids[j]].dtype);
            if (j == br->start[r]) br->el[r] = el;
            else if (el != br->el[r]) {
                br->el[r] = 0;
                break;
            }
        }
        const int n = br->start[r + 1] - br->start[r];
        for (int q = 0; q < r && br->el[r] && n; q++)
            if (br->el[q] && br->same_as[q] < 0 && br->start[q + 1] - br->start[q] == n &&
                !memcmp(br->numel + br->start[q], br->numel + br->start[r], (size_t)n * sizeof *br->numel)) {
                br->same_as[r] = q;
                break;
            }
    }
    return TD_OK;
}

static void by_role_free(mm_by_role *br)
{
    td_free(br->ids);
    td_free(br->numel);
}

/* Packs every role with capacity `cap`, in registration order: a tensor
 * goes at the next aligned offset of the open chunk of its role and dtype if
 * it fits, else opens a new chunk; a tensor larger than `cap` gets a chunk of
 * its own and leaves the open one open.  Counts chunks and padding bytes;
 * with `record`, also fills m->chunks (sized by a counting pass) and places
 * the tensors.  One walk for both, so the search prices what the layout does.
 * Without `record`, a role with the sizes of an earlier one (same_as) has
 * its chunks and its padding in elements: they are counted again, not
 * walked. */
static void pack(td_memmgr *m, const mm_by_role *br, size_t cap, int record, size_t *chunks_out, size_t *waste_out)
{
    size_t chunks = 0, waste = 0;
    size_t role_chunks[TD_TENSOR_ROLE_COUNT] = {0}, role_pad[TD_TENSOR_ROLE_COUNT] = {0}; /* pad: in elements */
    for (int r = 0; r < TD_TENSOR_ROLE_COUNT; r++) {
        if (!record && br->same_as[r] >= 0) {
            const int q = br->same_as[r];
            chunks += role_chunks[q];
            waste += role_pad[q] * br->el[r];
            continue;
        }
        if (record) m->role_first[r] = (int)chunks;
        const size_t chunks_before = chunks, waste_before = waste;
        size_t used = 0, open_el = 0;
        long open = -1;
        for (int j = br->start[r]; j < br->start[r + 1]; j++) {
            const size_t numel = br->numel[j];
            size_t el = br->el[r] ? br->el[r] : td_dtype_bytes(m->tensors[br->ids[j]].dtype);
            long c;
            size_t start;
            if (numel > cap) {
                c = (long)chunks++;
                start = 0;
                if (record) {
                    mm_tensor *t = &m->tensors[br->ids[j]];
                    m->chunks[c] = (mm_chunk){ .role = t->role, .dtype = t->dtype, .numel = t->numel };
                }
            } else {
                start = td_align_up(used, MM_ALIGN_NUMEL);
                if (open < 0 || start + numel > cap || el != open_el) {
                    if (open >= 0) waste += (cap - used) * open_el;
                    open = (long)chunks++;
                    open_el = el;
                    start = 0;
                    if (record) {
                        mm_tensor *t = &m->tensors[br->ids[j]];
                        m->chunks[open] = (mm_chunk){ .role = t->role, .dtype = t->dtype, .numel = cap };
                    }
                } else {
                    waste += (start - used) * el;
                }
                used = start + numel;
                c = open;
            }
            if (record) {
                mm_tensor *t = &m->tensors[br->ids[j]];
                t->chunk = (int)c;
                t->offset = start;
            }
        }
        if (open >= 0) waste += (cap - used) * open_el;
        if (record) m->role_count[r] = (int)chunks - m->role_first[r];
        role_chunks[r] = chunks - chunks_before;
        role_pad[r] = br->el[r] ? (waste - waste_before) / br->el[r] : 0;
    }
    *chunks_out = chunks;
    *waste_out = waste;
}

static void pack_cost(const td_memmgr *m, const mm_by_role *br, size_t cap, size_t *chunks_out, size_t *waste_out)
{
    pack((td_memmgr *)m, br, cap, 0, chunks_out, waste_out);
}

static int cmp_size(const void *a, const void *b)
{
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    return (x > y) - (x < y);
}

/* The distinct aligned tensor sizes (a model repeats a dozen of them over
 * its layers; pricing each tensor's once made the search quadratic in the
 * layers: minutes at 4096 layers), sorted; NULL when out of memory. */
static size_t *tensor_sizes(const td_memmgr *m, size_t *n_out)
{
    size_t *v = td_malloc(((size_t)m->n_tensors + 1) * sizeof *v, TD_ROLE_META), n = 0;
    if (!v) return NULL;
    for (int i = 0; i < m->n_tensors; i++) v[i] = td_align_up(m->tensors[i].numel, MM_ALIGN_NUMEL);
    qsort(v, (size_t)m->n_tensors, sizeof *v, cmp_size);
    for (int i = 0; i < m->n_tensors; i++)
        if (!n || v[i] != v[n - 1]) v[n++] = v[i];
    *n_out = n;
    return v;
}

/* Candidates: every aligned size in the range when there are at most 8192
 * of them (exact), else a geometric ladder of 256 rungs plus every distinct
 * tensor size in range (a chunk exactly one tensor wide wastes nothing).
 * The fewest padding bytes win; at equal waste, fewer chunks, then the
 * larger. */
static size_t search_chunk_numel(const td_memmgr *m, const mm_by_role *br)
{
    size_t lo = td_align_up(m->params.min_chunk_numel, MM_ALIGN_NUMEL), hi = m->params.max_chunk_numel;
    size_t best = lo, best_waste = SIZE_MAX, best_chunks = SIZE_MAX;
    int exhaustive = hi >= lo && (hi - lo) / MM_ALIGN_NUMEL < 8192;
    size_t n_sizes = 0, *sizes = exhaustive ? NULL : tensor_sizes(m, &n_sizes);
    for (size_t k = 0;; k++) {
        size_t cap;
        if (exhaustive) {
            cap = lo + k * MM_ALIGN_NUMEL;
            if (cap > hi) break;
        } else if (k < 256) {
            cap = td_align_up((size_t)((double)lo * pow((double)hi / (double)lo, (double)k / 255.0)), MM_ALIGN_NUMEL);
        } else {
            if (k - 256 >= n_sizes) break;
            cap = sizes[k - 256];
        }
        if (cap < lo || cap > hi) continue;
        size_t chunks, waste;
        pack_cost(m, br, cap, &chunks, &waste);
        if (waste < best_waste || (waste == best_waste && (chunks < best_chunks || (chunks == best_chunks && cap > best)))) {
            best = cap;
            best_waste = waste;
            best_chunks = chunks;
        }
    }
    td_free(sizes);
    return best;
}

static td_status layout_by_role(td_memmgr *m, const mm_by_role *br)
{
    if (m->params.chunk_numel) {
        m->chunk_numel = td_align_up(m->params.chunk_numel, MM_ALIGN_NUMEL);
    } else {
        if (m->params.min_chunk_numel == 0 || m->params.max_chunk_numel < m->params.min_chunk_numel)
            return td_error_set(TD_ERR_INVALID, "memmgr: chunk search range %zu..%zu elements is empty",
                                m->params.min_chunk_numel, m->params.max_chunk_numel);
        m->chunk_numel = search_chunk_numel(m, br);
    }
    size_t n_chunks, waste;
    pack_cost(m, br, m->chunk_numel, &n_chunks, &waste);
    m->padding_bytes = waste;
    m->chunks = td_calloc(n_chunks, sizeof *m->chunks, TD_ROLE_META);
    int *members = td_malloc((size_t)m->n_tensors * sizeof *members, TD_ROLE_META);
    if (!m->chunks || !members) {
        td_free(members);
        td_free(m->chunks);
        m->chunks = NULL;
        return TD_ERR_NOMEM;
    }
    m->n_chunks = (int)n_chunks;
    pack(m, br, m->chunk_numel, 1, &n_chunks, &waste);
    /* Members grouped by chunk (a counting sort by chunk id, tensors in
     * registration order within each). */
    int *count = td_calloc(n_chunks + 1, sizeof *count, TD_ROLE_META);
    if (!count) {
        td_free(members);
        return TD_ERR_NOMEM;
    }
    for (int i = 0; i < m->n_tensors; i++) count[m->tensors[i].chunk + 1]++;
    for (size_t c = 0; c < n_chunks; c++) count[c + 1] += count[c];
    for (size_t c = 0; c < n_chunks; c++) {
        m->chunks[c].tensors = members + count[c];
        m->chunks[c].n_tensors = 0;
    }
    for (int i = 0; i < m->n_tensors; i++) {
        mm_chunk *ch = &m->chunks[m->tensors[i].chunk];
        ch->tensors[ch->n_tensors++] = i;
    }
    td_free(count);
    for (size_t c = 0; c < n_chunks; c++) {
        mm_chunk *ch = &m->chunks[c];
        ch->index = (int)c - m->role_first[ch->role];
        size_t (*fmt)(size_t, void *) = m->role_bytes[ch->role];
        void *ctx = m->role_ctx[ch->role];
        /* Sharded: the slot holds the gathered buffer of N equal shards
         * (N S <= the capacity rounded up to N x align: shard.h). */
        if (m->params.shard_ranks > 1) {
            size_t a = m->params.shard_align ? m->params.shard_align : 1, n = (size_t)m->params.shard_ranks;
            ch->numel = td_align_up(ch->numel, n * a);
            /* Optimizer state: the rank's shard alone, on the host and on the device. */
            if (mm_is_optim_role(ch->role)) ch->numel /= n;
        }
        ch->bytes = fmt ? fmt(ch->numel, ctx) : ch->numel * td_dtype_bytes(ch->dtype);
        /* The tail after the last tensor is padding on the device only: the
         * host copy, the copies and the optimizer stop at the last tensor. */
        ch->used_numel = 0;
        for (int j = 0; j < ch->n_tensors; j++) {
            const mm_tensor *t = &m->tensors[ch->tensors[j]];
            if (t->offset + t->numel > ch->used_numel) ch->used_numel = t->offset + t->numel;
        }
        ch->host_bytes = fmt ? fmt(ch->used_numel, ctx) : ch->used_numel * td_dtype_bytes(ch->dtype);
        ch->n_free = ch->n_tensors;
    }
    return TD_OK;
}

td_status mm_layout(td_memmgr *m)
{
    if (m->n_tensors == 0) return td_error_set(TD_ERR_INVALID, "memmgr: no tensors registered");
    mm_by_role br;
    td_status st = by_role_make(m, &br);
    if (st == TD_OK) st = layout_by_role(m, &br);
    by_role_free(&br);
    return st;
}

void td_memmgr_print_layout(td_memmgr *m, FILE *f)
{
    char a[32], b[32];
    fprintf(f, "chunk layout: %d tensors in %d chunks of %zu elements; %s padding\n", m->n_tensors, m->n_chunks,
            m->chunk_numel, td_format_bytes(m->padding_bytes, a, sizeof a));
    for (int k = 0; k < m->n_chunks; k++) {
        const mm_chunk *ch = &m->chunks[k];
        size_t used = 0, cap = ch->numel;
        for (int j = 0; j < ch->n_tensors; j++) used += m->tensors[ch->tensors[j]].numel;
        if (m->params.shard_ranks > 1 && mm_is_optim_role(ch->role)) cap *= (size_t)m->params.shard_ranks; /* a shard */
        fprintf(f, "  chunk %3d  %-6s #%-3d %-4s %10s  %5.1f%% full  %-8s  home %-6s  %d tensor%s: ", k,
                td_tensor_role_name(ch->role), ch->index, td_dtype_name(ch->dtype),
                td_format_bytes(ch->bytes, b, sizeof b), 100.0 * (double)used / (double)cap,
                td_memmgr_chunk_transient(m, k) ? "staged" : td_memmgr_chunk_on_disk(m, k) ? "disk" : td_memmgr_chunk_pageable(m, k) ? "pageable" : "pinned",
                ch->home == TD_HOME_DEVICE ? "device" : ch->home == TD_HOME_DISK ? "disk" : "host", ch->n_tensors, ch->n_tensors == 1 ? "" : "s");
        for (int j = 0; j < ch->n_tensors && j < 4; j++)
            fprintf(f, "%s%s", j ? ", " : "", m->tensors[ch->tensors[j]].name);
        if (ch->n_tensors > 4) fprintf(f, ", ... (%d more)", ch->n_tensors - 4);
        fprintf(f, "\n");
    }
}
