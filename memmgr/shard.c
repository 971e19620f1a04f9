/* Sharding arithmetic of ZeRO-3 (include/tidal/shard.h): equal, aligned
 * shards so the collectives move equal counts; a rank past the chunk's end
 * owns only padding. */
#include "tidal/shard.h"

#include <stdint.h>

td_status td_shard_layout_make(size_t numel, int ranks, size_t align, td_shard_layout *out)
{
    if (ranks < 1) return td_error_set(TD_ERR_INVALID, "shard: %d ranks; a job has at least one", ranks);
    if (align == 0) align = 1;
    size_t n = (size_t)ranks;
    size_t per = numel / n + (numel % n != 0);
    if (per > SIZE_MAX - (align - 1))
        return td_error_set(TD_ERR_INVALID, "shard: %zu elements over %d ranks overflow", numel, ranks);
    size_t s = (per + align - 1) / align * align;
    if (s != 0 && s > SIZE_MAX / n)
        return td_error_set(TD_ERR_INVALID, "shard: %zu elements over %d ranks overflow", numel, ranks);
    *out = (td_shard_layout){ .numel = numel, .ranks = ranks, .align = align, .shard_numel = s,
                              .padded_numel = s * n };
    return TD_OK;
}

static size_t clip(size_t x, size_t hi) { return x < hi ? x : hi; }

size_t td_shard_range(const td_shard_layout *l, int rank, size_t *begin, size_t *end)
{
    size_t b = clip((size_t)rank * l->shard_numel, l->numel);
    size_t e = clip(b + l->shard_numel, l->numel);
    *begin = b;
    *end = e;
    return e - b;
}

int td_shard_owner(const td_shard_layout *l, size_t i) { return l->shard_numel ? (int)(i / l->shard_numel) : 0; }

size_t td_shard_intersect(const td_shard_layout *l, int rank, size_t off, size_t n, size_t *begin, size_t *end)
{
    size_t b, e;
    td_shard_range(l, rank, &b, &e);
    size_t lo = off > b ? off : b, hi = off + n < e ? off + n : e;
    if (lo >= hi) lo = hi = b;
    *begin = lo;
    *end = hi;
    return hi - lo;
}

size_t td_shard_bytes(const td_shard_layout *l, size_t elem_bytes) { return l->shard_numel * elem_bytes; }
