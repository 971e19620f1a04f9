/* Best-fit range allocator with coalescing (see range.h). */
#include "tidal/range.h"
#include "tidal/alloc.h"

struct td_range_node {
    size_t offset, bytes;
    uint32_t tag;
    int free;
    td_range_node *prev, *next;
};

static td_range_node *node_new(td_range *r)
{
    td_range_node *n = r->spare;
    if (n) {
        r->spare = n->next;
        return n;
    }
    return td_malloc(sizeof *n, TD_ROLE_META);
}

static void node_recycle(td_range *r, td_range_node *n)
{
    n->next = r->spare;
    r->spare = n;
}

td_status td_range_init(td_range *r, size_t size, size_t align)
{
    *r = (td_range){ .size = size, .align = align ? align : 1, .free_bytes = size };
    if (size == 0) return TD_OK;
    td_range_node *n = node_new(r);
    if (!n) return TD_ERR_NOMEM;
    *n = (td_range_node){ .offset = 0, .bytes = size, .free = 1 };
    r->head = n;
    return TD_OK;
}

void td_range_destroy(td_range *r)
{
    for (td_range_node *n = r->head, *next; n; n = next) { next = n->next; td_free(n); }
    for (td_range_node *n = r->spare, *next; n; n = next) { next = n->next; td_free(n); }
    r->head = r->spare = NULL;
}

td_status td_range_alloc(td_range *r, size_t bytes, int from_top, uint32_t tag, size_t *offset_out)
{
    if (bytes == 0) bytes = 1;
    if (bytes > r->size) return TD_ERR_BUDGET;
    size_t need = (bytes + r->align - 1) & ~(r->align - 1);
    if (need > r->free_bytes) return TD_ERR_BUDGET; /* at once: a pool's full slabs are passed over in O(1) */
    td_range_node *best = NULL;
    for (td_range_node *n = r->head; n; n = n->next) {
        if (!n->free || n->bytes < need) continue;
        if (!best || n->bytes < best->bytes || (from_top && n->bytes == best->bytes)) best = n;
    }
    if (!best) return TD_ERR_BUDGET;
    if (best->bytes > need) {
        td_range_node *rest = node_new(r);
        if (!rest) return TD_ERR_NOMEM;
        if (from_top) { /* the new node is the free remainder below */
            *rest = (td_range_node){ .offset = best->offset, .bytes = best->bytes - need, .free = 1,
                                     .prev = best->prev, .next = best };
            if (best->prev) best->prev->next = rest; else r->head = rest;
            best->prev = rest;
            best->offset += rest->bytes;
        } else {
            *rest = (td_range_node){ .offset = best->offset + need, .bytes = best->bytes - need, .free = 1,
                                     .prev = best, .next = best->next };
            if (best->next) best->next->prev = rest;
            best->next = rest;
        }
        best->bytes = need;
    }
    best->free = 0;
    best->tag = tag;
    r->free_bytes -= best->bytes;
    r->live_blocks++;
    *offset_out = best->offset;
    return TD_OK;
}

static td_range_node *find_live(const td_range *r, size_t offset)
{
    for (td_range_node *n = r->head; n && n->offset <= offset; n = n->next)
        if (n->offset == offset && !n->free) return n;
    return NULL;
}

/* Merges n->next into n. */
static void absorb_next(td_range *r, td_range_node *n)
{
    td_range_node *m = n->next;
    n->bytes += m->bytes;
    n->next = m->next;
    if (m->next) m->next->prev = n;
    node_recycle(r, m);
}

td_status td_range_free(td_range *r, size_t offset, size_t *bytes_out, uint32_t *tag_out)
{
    td_range_node *n = find_live(r, offset);
    if (!n) return td_error_set(TD_ERR_INVALID, "no live block at offset %zu", offset);
    if (bytes_out) *bytes_out = n->bytes;
    if (tag_out) *tag_out = n->tag;
    r->free_bytes += n->bytes;
    r->live_blocks--;
    n->free = 1;
    if (n->next && n->next->free) absorb_next(r, n);
    if (n->prev && n->prev->free) absorb_next(r, n->prev);
    return TD_OK;
}

size_t td_range_block_bytes(const td_range *r, size_t offset)
{
    td_range_node *n = find_live(r, offset);
    return n ? n->bytes : 0;
}

size_t td_range_largest_free(const td_range *r)
{
    size_t best = 0;
    for (td_range_node *n = r->head; n; n = n->next)
        if (n->free && n->bytes > best) best = n->bytes;
    return best;
}

int td_range_free_blocks(const td_range *r)
{
    int count = 0;
    for (td_range_node *n = r->head; n; n = n->next) count += n->free;
    return count;
}

int td_range_check(const td_range *r)
{
    size_t expect = 0, free_bytes = 0;
    int live = 0;
    const td_range_node *prev = NULL;
    for (const td_range_node *n = r->head; n; prev = n, n = n->next) {
        if (n->offset != expect || n->prev != prev || n->bytes == 0) return 1;
        if (n->offset % r->align) return 2;
        if (prev && prev->free && n->free) return 3;
        expect += n->bytes;
        if (n->free) free_bytes += n->bytes; else live++;
    }
    if (expect != r->size) return 4;
    if (free_bytes != r->free_bytes || live != r->live_blocks) return 5;
    return 0;
}
