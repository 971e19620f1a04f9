/* Sharding of chunks over ranks (ZeRO-3): which elements of a chunk each
 * rank owns.
 *
 * A chunk of E elements is split over N ranks into N equal shards of S
 * elements, S = ceil(E / N) rounded up to `align` elements, so that the
 * all-gather of the 16-bit params and the reduce-scatter of the grads move
 * equal counts (N x S; the collectives need it) and every shard starts on an
 * aligned element.  Rank r's shard covers chunk elements [r S, (r + 1) S);
 * the part of it below E is real, the rest is padding that no tensor uses
 * (the gathered buffer holds N S >= E elements; its tail is never read).
 * Ranks past the end own an empty real range; with align 1 and E divisible
 * by N every shard is real.
 *
 * Each rank's host keeps only its shard of the fp32 master and the AdamW
 * moments, so the owner of element i updates it: td_shard_owner.  A tensor
 * at [off, off + n) of the chunk meets rank r's shard in one contiguous
 * range (td_shard_intersect), which is what a rank reads from a checkpoint
 * and writes back to one.
 *
 * Pure arithmetic: no memory, thread-safe. */
#ifndef TIDAL_SHARD_H
#define TIDAL_SHARD_H

#include <stddef.h>

#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_shard_layout {
    size_t numel;        /* E: the chunk's elements (tensors and the layout's padding) */
    int ranks;           /* N >= 1 */
    size_t align;        /* elements a shard's length is a multiple of (>= 1) */
    size_t shard_numel;  /* S: every rank's shard length, padding included */
    size_t padded_numel; /* N S >= E: the length of the gathered buffer */
} td_shard_layout;

/* The layout of a chunk of `numel` elements over `ranks`, shards rounded up
 * to `align` elements (0 means 1).  TD_ERR_INVALID for ranks < 1 or a size
 * that overflows. */
td_status td_shard_layout_make(size_t numel, int ranks, size_t align, td_shard_layout *out);

/* Rank r's real elements [*begin, *end) in chunk coordinates (clipped to E;
 * empty, begin == end == E, for a rank past the end).  Returns end - begin. */
size_t td_shard_range(const td_shard_layout *l, int rank, size_t *begin, size_t *end);

/* The rank that owns chunk element i (< E). */
int td_shard_owner(const td_shard_layout *l, size_t i);

/* Where [off, off + n) of the chunk (a tensor) meets rank r's shard:
 * [*begin, *end) in chunk coordinates; returns its length, 0 when they do
 * not meet (then *begin == *end). */
size_t td_shard_intersect(const td_shard_layout *l, int rank, size_t off, size_t n, size_t *begin, size_t *end);

/* Bytes a rank keeps of a chunk of elements of `elem_bytes`: the shard with
 * its padding (S elements), as the host buffer holding it is sized. */
size_t td_shard_bytes(const td_shard_layout *l, size_t elem_bytes);

#ifdef __cplusplus
}
#endif
#endif
