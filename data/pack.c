/* Documents into rows (include/tidal/data.h, "documents into rows"): the
 * documents of a JSONL file held in memory, shuffled by document, placed
 * into rows of R tokens and written with their flags.
 *
 * Placement is first fit decreasing: the documents, longest first (ties in
 * the shuffled order), each go to the lowest row with room, which a max
 * segment tree over the rows' free room finds in O(log rows), so a million
 * documents place in well under a second and the long ones leave gaps the
 * short ones fill.  The rows are then shuffled themselves (with the same
 * seed), so that the held-out split (the last rows) is a random sample of
 * documents, not the shortest. */
#include <stdlib.h>
#include <string.h>

#include "tidal/alloc.h"
#include "tidal/data.h"
#include "tidal/util.h"

typedef struct doc { uint64_t at, order; uint32_t n; } doc; /* tokens [at, at + n) of the store; order: after the shuffle */

struct td_pack {
    uint32_t R;
    int pack;
    uint32_t *ids;     /* every document's tokens, back to back */
    uint8_t *flags;    /* and their flags (TARGET; DOC_START on each document's first) */
    uint64_t n, cap;
    doc *docs;
    uint64_t ndocs, cap_docs;
    td_pack_stats stats;
};

td_status td_pack_create(uint32_t row_tokens, int pack, td_pack **out)
{
    *out = NULL;
    if (row_tokens < 2)
        return td_error_set(TD_ERR_INVALID, "rows of %u tokens: a row needs at least 2 (--seq)", row_tokens);
    td_pack *p = td_calloc(1, sizeof *p, TD_ROLE_META);
    if (!p) return td_error_set(TD_ERR_NOMEM, "out of memory");
    p->R = row_tokens;
    p->pack = pack;
    *out = p;
    return TD_OK;
}

void td_pack_free(td_pack *p)
{
    if (!p) return;
    td_free(p->ids);
    td_free(p->flags);
    td_free(p->docs);
    td_free(p);
}

const td_pack_stats *td_pack_get_stats(const td_pack *p) { return &p->stats; }

static td_status reserve(td_pack *p, uint64_t more)
{
    if (p->n + more > p->cap) {
        uint64_t cap = p->cap ? p->cap : (uint64_t)1 << 20;
        while (cap < p->n + more) cap *= 2;
        uint32_t *ids = td_malloc(cap * sizeof *ids, TD_ROLE_META);
        uint8_t *flags = td_malloc(cap, TD_ROLE_META);
        if (!ids || !flags) {
            td_free(ids);
            td_free(flags);
            char a[32];
            return td_error_set(TD_ERR_NOMEM, "out of memory holding %s of documents to pack",
                                td_format_bytes((size_t)cap * 5, a, sizeof a));
        }
        if (p->n) {
            memcpy(ids, p->ids, p->n * sizeof *ids);
            memcpy(flags, p->flags, p->n);
        }
        td_free(p->ids);
        td_free(p->flags);
        p->ids = ids;
        p->flags = flags;
        p->cap = cap;
    }
    if (p->ndocs == p->cap_docs) {
        uint64_t cap = p->cap_docs ? 2 * p->cap_docs : 4096;
        doc *d = td_malloc(cap * sizeof *d, TD_ROLE_META);
        if (!d) return td_error_set(TD_ERR_NOMEM, "out of memory");
        if (p->ndocs) memcpy(d, p->docs, p->ndocs * sizeof *d);
        td_free(p->docs);
        p->docs = d;
        p->cap_docs = cap;
    }
    return TD_OK;
}

/* One document of ids[0, n); 0 when it has no counted target (dropped). */
static td_status add_one(td_pack *p, const uint32_t *ids, const uint8_t *counted, uint32_t n)
{
    uint64_t targets = 0;
    for (uint32_t i = 1; i < n; i++) targets += counted[i] != 0;
    if (!targets) {
        p->stats.dropped_empty++;
        return TD_OK;
    }
    td_status st = reserve(p, n);
    if (st) return st;
    memcpy(p->ids + p->n, ids, (size_t)n * sizeof *ids);
    for (uint32_t i = 0; i < n; i++) p->flags[p->n + i] = i == 0 ? TD_TOKFLAG_DOC_START : counted[i] ? TD_TOKFLAG_TARGET : 0;
    p->docs[p->ndocs++] = (doc){p->n, 0, n};
    p->n += n;
    return TD_OK;
}

td_status td_pack_add(td_pack *p, const uint32_t *ids, const uint8_t *counted, size_t n, td_pack_long too_long)
{
    if (!n) return TD_OK;
    if (n <= p->R) return add_one(p, ids, counted, (uint32_t)n);
    if (too_long == TD_PACK_DROP) {
        p->stats.dropped_long++;
        return TD_OK;
    }
    if (too_long == TD_PACK_CUT) {
        p->stats.cut++;
        return add_one(p, ids, counted, p->R);
    }
    p->stats.split++;
    for (size_t at = 0; at < n; at += p->R) {
        td_status st = add_one(p, ids + at, counted + at, (uint32_t)(n - at < p->R ? n - at : p->R));
        if (st) return st;
    }
    return TD_OK;
}

/* splitmix64, for the shuffle */
static uint64_t mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static int longer_first(const void *a, const void *b)
{
    const doc *x = a, *y = b;
    if (x->n != y->n) return x->n > y->n ? -1 : 1;
    return x->order < y->order ? -1 : x->order > y->order; /* ties in the shuffled order */
}

/* The lowest row whose free room is at least `need`, in a max segment tree
 * over rows [0, size) (leaf i at size + i); -1 when none. */
static int64_t first_fit(const uint32_t *tree, uint64_t size, uint32_t need)
{
    if (tree[1] < need) return -1;
    uint64_t i = 1;
    while (i < size) i = tree[2 * i] >= need ? 2 * i : 2 * i + 1;
    return (int64_t)(i - size);
}

static void tree_set(uint32_t *tree, uint64_t size, uint64_t row, uint32_t room)
{
    uint64_t i = size + row;
    tree[i] = room;
    for (i /= 2; i >= 1; i /= 2) tree[i] = tree[2 * i] > tree[2 * i + 1] ? tree[2 * i] : tree[2 * i + 1];
}

td_status td_pack_write(td_pack *p, int shuffle, uint64_t seed, uint32_t pad_id, td_tokfile_writer *w,
                        td_pack_stats *stats)
{
    td_status st = TD_OK;
    const uint32_t R = p->R;
    uint64_t *last = NULL, *row_first = NULL, *next_in_row = NULL;
    uint32_t *tree = NULL, *row_ids = NULL, *used = NULL;
    uint8_t *row_flags = NULL;
    if (shuffle) { /* Fisher-Yates over the documents */
        uint64_t s = seed ^ 0x7469646C61ull;
        for (uint64_t i = p->ndocs; i > 1; i--) {
            uint64_t j = mix(&s) % i;
            doc t = p->docs[i - 1];
            p->docs[i - 1] = p->docs[j];
            p->docs[j] = t;
        }
    }
    if (p->pack) { /* longest first */
        for (uint64_t i = 0; i < p->ndocs; i++) p->docs[i].order = i;
        qsort(p->docs, p->ndocs, sizeof *p->docs, longer_first);
    }
    /* place: rows chained by next_in_row from row_first */
    uint64_t size = 1;
    while (size < p->ndocs) size *= 2;
    used = td_malloc((p->ndocs + 1) * sizeof *used, TD_ROLE_META);
    row_first = td_malloc((p->ndocs + 1) * sizeof *row_first, TD_ROLE_META);
    next_in_row = td_malloc((p->ndocs + 1) * sizeof *next_in_row, TD_ROLE_META);
    last = td_malloc((p->ndocs + 1) * sizeof *last, TD_ROLE_META); /* each row's last document */
    tree = td_calloc(2 * size, sizeof *tree, TD_ROLE_META);
    row_ids = td_malloc((size_t)R * sizeof *row_ids, TD_ROLE_META);
    row_flags = td_malloc(R, TD_ROLE_META);
    if (!used || !row_first || !next_in_row || !last || !tree || !row_ids || !row_flags)
        TD_FAIL(TD_ERR_NOMEM, "out of memory placing %llu documents", (unsigned long long)p->ndocs);
    uint64_t rows = 0;
    for (uint64_t d = 0; d < p->ndocs; d++) {
        const uint32_t n = p->docs[d].n;
        int64_t r = p->pack ? first_fit(tree, size, n) : -1;
        if (r < 0) { /* a new row */
            r = (int64_t)rows++;
            row_first[r] = d;
            used[r] = 0;
        } else {
            next_in_row[last[r]] = d;
        }
        last[r] = d;
        next_in_row[d] = UINT64_MAX;
        used[r] += n;
        if (p->pack) tree_set(tree, size, (uint64_t)r, R - used[r]);
    }
    TD_TRY(td_tokfile_writer_set_layout(w, R, 1));
    for (uint64_t r = 0; r < rows; r++) last[r] = r; /* the rows' order, shuffled as the documents were */
    if (shuffle) {
        uint64_t s = seed ^ 0x726F7773ull;
        for (uint64_t i = rows; i > 1; i--) {
            uint64_t j = mix(&s) % i, t = last[i - 1];
            last[i - 1] = last[j];
            last[j] = t;
        }
    }
    for (uint64_t ri = 0; ri < rows; ri++) {
        const uint64_t r = last[ri];
        uint32_t k = 0;
        for (uint64_t d = row_first[r]; d != UINT64_MAX; d = next_in_row[d]) {
            memcpy(row_ids + k, p->ids + p->docs[d].at, (size_t)p->docs[d].n * sizeof *row_ids);
            memcpy(row_flags + k, p->flags + p->docs[d].at, p->docs[d].n);
            for (uint32_t i = 1; i < p->docs[d].n; i++) p->stats.targets += (row_flags[k + i] & TD_TOKFLAG_TARGET) != 0;
            k += p->docs[d].n;
            p->stats.documents++;
        }
        p->stats.padding += R - k;
        for (uint32_t i = k; i < R; i++) {
            row_ids[i] = pad_id;
            row_flags[i] = TD_TOKFLAG_PAD | (i == k ? TD_TOKFLAG_DOC_START : 0);
        }
        TD_TRY(td_tokfile_writer_append_flagged(w, row_ids, row_flags, R));
    }
    p->stats.rows = rows;
    p->stats.tokens = rows * R;
    if (stats) *stats = p->stats;
cleanup:
    td_free(used);
    td_free(row_first);
    td_free(next_in_row);
    td_free(last);
    td_free(tree);
    td_free(row_ids);
    td_free(row_flags);
    return st;
}
