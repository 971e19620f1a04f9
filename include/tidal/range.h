/* A best-fit range allocator over [0, size) with coalescing.
 *
 * Serves both the device arena and each pinned host slab: it hands out
 * offsets, never touches the memory, and tags each block (the arena stores
 * the role there).  Blocks live in one address-ordered list; allocation scans
 * it for the smallest free block that fits (O(blocks), fine for the hundreds
 * to low thousands of live buffers a run holds), and a freed block merges
 * with free neighbours at once, so free space is never split needlessly.
 * `from_top` carves from the end of the chosen block and prefers the highest
 * such block: long-lived fixed-size chunk slots grow down from the top while
 * variable buffers grow up from the bottom, keeping the two from interleaving.
 * Not thread-safe: the owner locks. */
#ifndef TIDAL_RANGE_H
#define TIDAL_RANGE_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/status.h"

typedef struct td_range_node td_range_node;

typedef struct td_range {
    size_t size;
    size_t align;
    size_t free_bytes;
    int live_blocks;
    td_range_node *head;   /* address order */
    td_range_node *spare;  /* recycled nodes: steady state allocates nothing */
} td_range;

/* `align` must be a power of two.  Fails only if the first node cannot be
 * allocated. */
td_status td_range_init(td_range *r, size_t size, size_t align);
void td_range_destroy(td_range *r);

/* Rounds `bytes` up to the alignment.  TD_ERR_BUDGET (no message) when no
 * free block fits; TD_ERR_NOMEM if a split needed a node and none could be
 * allocated (the range is unchanged). */
td_status td_range_alloc(td_range *r, size_t bytes, int from_top, uint32_t tag, size_t *offset_out);
/* Frees the block at `offset`; gives back its (aligned) size and tag.
 * TD_ERR_INVALID if no live block starts there. */
td_status td_range_free(td_range *r, size_t offset, size_t *bytes_out, uint32_t *tag_out);
/* Size of the live block at `offset`, 0 if none. */
size_t td_range_block_bytes(const td_range *r, size_t offset);

size_t td_range_largest_free(const td_range *r);
int td_range_free_blocks(const td_range *r);
/* Checks list invariants (order, no overlap, no two adjacent free blocks,
 * free_bytes matches); returns 0 if consistent.  For tests. */
int td_range_check(const td_range *r);

#endif
