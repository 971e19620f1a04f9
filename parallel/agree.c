/* Agreement at start: ranks that run with different flags, models or data
 * would train nonsense together (or hang in a collective of another size),
 * so each rank's settings are hashed and the hashes all-gathered; only when
 * they differ do the ranks exchange per-setting hashes, find the first
 * setting that differs, and then its values, so the message names it.  In
 * the common case this costs one all-gather of 8 bytes a rank. */
#include "parallel_impl.h"
#include "tidal/alloc.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

enum { SHOWN_BYTES = 160 }; /* of a value, in the message */

static uint64_t fnv(uint64_t h, const char *s)
{
    for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) h = (h ^ *p) * 0x100000001b3ull;
    return (h ^ 0xff) * 0x100000001b3ull; /* a terminator, so "ab","c" differs from "a","bc" */
}

static uint64_t setting_hash(const td_dist_setting *s) { return fnv(fnv(0xcbf29ce484222325ull, s->key), s->value); }

typedef struct shown {
    char key[64];
    char value[SHOWN_BYTES];
} shown;

static void show(shown *out, const td_dist_setting *s)
{
    memset(out, 0, sizeof *out);
    snprintf(out->key, sizeof out->key, "%s", s ? s->key : "(none)");
    const char *v = s ? (s->value ? s->value : "(unset)") : "(none)";
    size_t n = strlen(v);
    if (n < sizeof out->value) memcpy(out->value, v, n);
    else snprintf(out->value, sizeof out->value, "%.*s...", (int)sizeof out->value - 4, v);
}

td_status td_rdv_agree(td_rdv *r, const td_dist_setting *s, size_t n)
{
    const int size = r->size;
    td_status st = TD_OK;
    uint64_t *heads = NULL, *all = NULL, *mine = NULL;
    shown *vals = NULL;
    if (size == 1) return TD_OK;
    /* 1: the count and a hash of everything */
    uint64_t h[2] = { n, 0xcbf29ce484222325ull };
    for (size_t i = 0; i < n; i++) h[1] = (h[1] ^ setting_hash(&s[i])) * 0x100000001b3ull;
    if (!(heads = td_malloc((size_t)size * sizeof h, TD_ROLE_COMM))) return TD_ERR_NOMEM;
    TD_TRY(td_rdv_allgather(r, h, sizeof h, heads));
    int differ = 0;
    size_t common = n;
    for (int k = 0; k < size; k++) {
        differ |= heads[2 * k] != heads[0] || heads[2 * k + 1] != heads[1];
        if (heads[2 * k] < common) common = (size_t)heads[2 * k];
    }
    if (!differ) goto cleanup;
    /* 2: the first common setting that differs, and the first rank it differs on */
    mine = td_malloc((common ? common : 1) * sizeof *mine, TD_ROLE_COMM);
    all = td_malloc((size_t)size * (common ? common : 1) * sizeof *all, TD_ROLE_COMM);
    if (!mine || !all) TD_FAIL(TD_ERR_NOMEM, "agreement: out of memory");
    for (size_t i = 0; i < common; i++) mine[i] = setting_hash(&s[i]);
    if (common) TD_TRY(td_rdv_allgather(r, mine, common * sizeof *mine, all));
    size_t at = common; /* none of the common ones: the first setting past them */
    int rank = -1;
    for (size_t i = 0; i < common && rank < 0; i++)
        for (int k = 1; k < size; k++)
            if (all[(size_t)k * common + i] != all[i]) {
                at = i;
                rank = k;
                break;
            }
    if (rank < 0) /* the lists differ in length: the first rank whose count is not rank 0's */
        for (int k = 1; k < size && rank < 0; k++)
            if (heads[2 * k] != heads[0]) rank = k;
    /* 3: every rank's setting there, so every rank words the same message */
    shown one;
    show(&one, at < n ? &s[at] : NULL);
    if (!(vals = td_malloc((size_t)size * sizeof *vals, TD_ROLE_COMM))) TD_FAIL(TD_ERR_NOMEM, "agreement: out of memory");
    TD_TRY(td_rdv_allgather(r, &one, sizeof one, vals));
    if (at < common)
        st = td_error_set(TD_ERR_INVALID, "ranks disagree on %s: rank 0 has '%s', rank %d has '%s'; every rank must "
                          "run with the same flags, model and data", vals[0].key, vals[0].value, rank,
                          vals[rank].value);
    else
        st = td_error_set(TD_ERR_INVALID, "ranks disagree on their settings: rank 0 has %llu, rank %d has %llu (the "
                          "first one only some have: %s); run the same tidal build with the same flags on every rank",
                          (unsigned long long)heads[0], rank, (unsigned long long)heads[2 * rank],
                          heads[2 * rank] > heads[0] ? vals[rank].key : vals[0].key);
cleanup:
    td_free(heads);
    td_free(all);
    td_free(mine);
    td_free(vals);
    return st;
}

td_status td_comm_agree(td_comm *c, const td_dist_setting *s, size_t n)
{
    if (c->failed_seq)
        return td_error_set(TD_ERR_STATE, "agreement: the communicator failed in collective #%lu", c->failed_seq);
    td_status st = td_rdv_agree(c->rdv, s, n);
    if (st != TD_OK && st != TD_ERR_INVALID) {
        c->failed_seq = ++c->seq;
        td_rdv_shutdown(c->rdv);
    }
    return st;
}

td_status td_comm_host_allgather(td_comm *c, const void *mine, size_t bytes, void *all)
{
    if (c->failed_seq)
        return td_error_set(TD_ERR_STATE, "host allgather: the communicator failed in collective #%lu", c->failed_seq);
    if (bytes && (!mine || !all)) return td_error_set(TD_ERR_INVALID, "host allgather of %zu bytes with a NULL buffer", bytes);
    td_status st = td_rdv_allgather(c->rdv, mine, bytes, all);
    if (st != TD_OK) {
        c->failed_seq = ++c->seq;
        td_rdv_shutdown(c->rdv);
    }
    return st;
}
