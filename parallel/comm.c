/* Communicator dispatch: the choice of implementation, argument checks and
 * the host barrier in one place, so NCCL and the CPU communicator behave the
 * same at the interface. */
#include "parallel_impl.h"
#include "net.h"
#include "tidal/alloc.h"

#include <stdlib.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

td_comm_params td_comm_default_params(void)
{
    td_comm_params p = { .kind = TD_COMM_AUTO, .timeout_ms = 60000 };
    const char *v = getenv("TD_COMM_TIMEOUT_MS");
    char *end;
    long ms = v ? strtol(v, &end, 10) : 0;
    if (v && *v && !*end && ms > 0 && ms < 86400000L) p.timeout_ms = (int)ms;
    return p;
}

td_status td_comm_kind_parse(const char *name, td_comm_kind *out)
{
    if (!name) return td_error_set(TD_ERR_INVALID, "communicator name is missing");
    if (!strcmp(name, "auto")) *out = TD_COMM_AUTO;
    else if (!strcmp(name, "cpu")) *out = TD_COMM_CPU;
    else if (!strcmp(name, "nccl")) *out = TD_COMM_NCCL;
    else return td_error_set(TD_ERR_INVALID, "unknown communicator '%s'; use auto, cpu or nccl", name);
    return TD_OK;
}

int td_comm_nccl_compiled(void)
{
#ifdef TD_HAVE_NCCL
    return 1;
#else
    return 0;
#endif
}

td_status td_comm_create(const td_dist_env *env, td_backend *b, const td_comm_params *params, td_comm **out)
{
    td_comm_params p = params ? *params : td_comm_default_params();
    *out = NULL;
    td_comm_kind kind = p.kind;
    int cuda = td_backend_get_kind(b) == TD_BACKEND_CUDA;
    if (kind == TD_COMM_AUTO) kind = cuda && td_comm_nccl_compiled() ? TD_COMM_NCCL : TD_COMM_CPU;
    if (kind == TD_COMM_NCCL && !td_comm_nccl_compiled())
        return td_error_set(TD_ERR_UNSUPPORTED, "this tidal was built without NCCL (CUDA=0, NCCL=0, or no nccl.h "
                            "found at build time); rebuild where NCCL is installed, or use the cpu communicator");
    if (kind == TD_COMM_NCCL && !cuda)
        return td_error_set(TD_ERR_INVALID, "the NCCL communicator needs the cuda backend (this one is %s)",
                            td_backend_name(b));
    if (p.timeout_ms <= 0)
        return td_error_set(TD_ERR_INVALID, "communicator timeout %d ms must be positive (--comm-timeout)", p.timeout_ms);
    td_comm base = { .rank = env->rank, .size = env->size, .local_rank = env->local_rank, .backend = b,
                     .timeout_ms = p.timeout_ms };
    td_status st = td_rdv_join(env, p.timeout_ms, &base.rdv);
    if (st) return st;
#ifdef TD_HAVE_NCCL
    if (kind == TD_COMM_NCCL) st = td_comm_nccl_create(&base, out);
    else
#endif
        st = td_comm_cpu_create(&base, out);
    if (st) td_rdv_close(base.rdv);
    return st;
}

/* Who joins which group: color, key and, from the group's first rank, the port it serves. */
typedef struct split_entry { int32_t color, key, port, pad; } split_entry;

td_status td_comm_split(td_comm *c, int color, int key, td_comm **out)
{
    td_status st = TD_OK;
    enum { ADDR = 256 };
    *out = NULL;
    split_entry mine = { color, key, 0, 0 }, *all = td_calloc((size_t)c->size, sizeof *all, TD_ROLE_COMM);
    char *addrs = td_malloc((size_t)c->size * ADDR, TD_ROLE_COMM);
    if (!all || !addrs) TD_FAIL(TD_ERR_NOMEM, "splitting a communicator of %d ranks", c->size);
    TD_TRY(td_rdv_allgather(c->rdv, &mine, sizeof mine, all));
    /* my group, in (key, rank) order: my index, its size, its first rank */
    int index = 0, size = 0, first = -1;
    for (int r = 0; color >= 0 && r < c->size; r++) {
        if (all[r].color != color) continue;
        size++;
        if (all[r].key < key || (all[r].key == key && r < c->rank)) index++;
        if (first < 0 || all[r].key < all[first].key) first = r;
    }
    if (color >= 0 && index == 0) TD_TRY(td_net_free_port(&mine.port)); /* the group's first rank serves */
    TD_TRY(td_rdv_allgather(c->rdv, &mine, sizeof mine, all));
    TD_TRY(td_rdv_addresses(c->rdv, addrs, ADDR));
    if (color < 0) goto cleanup;
    td_dist_env env = { .rank = index, .size = size, .local_rank = c->local_rank, .node_rank = -1,
                        .master_port = all[first].port };
    snprintf(env.master_addr, sizeof env.master_addr, "%s", addrs + (size_t)first * ADDR);
    snprintf(env.launcher, sizeof env.launcher, "split");
    td_comm_params p = { .kind = !strcmp(c->name, "nccl") ? TD_COMM_NCCL : TD_COMM_CPU, .timeout_ms = c->timeout_ms };
    st = td_comm_create(&env, c->backend, &p, out);
    if (st) st = td_error_prefix(st, "the group of color %d (%d ranks, served by rank %d at %s:%d): ", color, size,
                                 first, env.master_addr, env.master_port);
cleanup:
    td_free(all);
    td_free(addrs);
    return st;
}

void td_comm_destroy(td_comm *c)
{
    if (c) c->ops->destroy(c); /* closes the rendezvous too */
}

int td_comm_rank(const td_comm *c) { return c->rank; }
int td_comm_size(const td_comm *c) { return c->size; }
const char *td_comm_name(const td_comm *c) { return c->name; }

static td_status check(td_comm *c, const char *what, const void *a, const void *b, size_t count, td_dtype dt,
                       td_queue q)
{
    c->seq++;
    if (c->failed_seq)
        return td_error_set(TD_ERR_STATE, "%s #%lu: the communicator failed in collective #%lu and cannot be used "
                            "after a failure", what, c->seq, c->failed_seq);
    if ((unsigned)dt >= TD_DTYPE_COUNT) return td_error_set(TD_ERR_INVALID, "%s: no dtype %d", what, (int)dt);
    if ((unsigned)q >= TD_QUEUE_COUNT) return td_error_set(TD_ERR_INVALID, "%s: no queue %d", what, (int)q);
    if (count && (!a || !b)) return td_error_set(TD_ERR_INVALID, "%s of %zu elements with a NULL buffer", what, count);
    if (count > ((size_t)1 << 40) / (size_t)c->size)
        return td_error_set(TD_ERR_INVALID, "%s of %zu elements per rank is beyond any buffer", what, count);
    return TD_OK;
}

td_status td_comm_all_gather(td_comm *c, const void *send, void *recv, size_t count, td_dtype dt, td_queue q)
{
    td_status st = check(c, "all_gather", send, recv, count, dt, q);
    return st ? st : c->ops->all_gather(c, send, recv, count, dt, q);
}

td_status td_comm_reduce_scatter(td_comm *c, const void *send, void *recv, size_t count, td_dtype dt, td_queue q)
{
    td_status st = check(c, "reduce_scatter", send, recv, count, dt, q);
    return st ? st : c->ops->reduce_scatter(c, send, recv, count, dt, q);
}

td_status td_comm_all_reduce(td_comm *c, const void *send, void *recv, size_t count, td_dtype dt, td_reduce_op op,
                             td_queue q)
{
    td_status st = check(c, "all_reduce", send, recv, count, dt, q);
    if (!st && op != TD_REDUCE_SUM && op != TD_REDUCE_MAX)
        st = td_error_set(TD_ERR_INVALID, "all_reduce: no reduction %d (sum or max)", (int)op);
    return st ? st : c->ops->all_reduce(c, send, recv, count, dt, op, q);
}

td_status td_comm_broadcast(td_comm *c, void *buf, size_t count, td_dtype dt, int root, td_queue q)
{
    td_status st = check(c, "broadcast", buf, buf, count, dt, q);
    if (!st && (root < 0 || root >= c->size))
        st = td_error_set(TD_ERR_INVALID, "broadcast from rank %d of a job of %d ranks", root, c->size);
    return st ? st : c->ops->broadcast(c, buf, count, dt, root, q);
}

static td_status wait_queue(td_comm *c, td_queue q)
{
    td_status st = c->ops->wait ? c->ops->wait(c, q) : td_queue_sync(c->backend, q);
    if (st && c->ops->wait) c->failed_seq = c->seq;
    return st;
}

td_status td_comm_wait(td_comm *c, td_queue q)
{
    if (c->failed_seq)
        return td_error_set(TD_ERR_STATE, "wait: the communicator failed in collective #%lu and cannot be used "
                            "after a failure", c->failed_seq);
    if ((unsigned)q >= TD_QUEUE_COUNT) return td_error_set(TD_ERR_INVALID, "wait: no queue %d", (int)q);
    return wait_queue(c, q);
}


td_status td_comm_barrier(td_comm *c, td_queue q)
{
    td_status st = check(c, "barrier", c, c, 0, TD_DTYPE_F32, q);
    if (!st) st = wait_queue(c, q);
    if (!st && (st = td_rdv_barrier(c->rdv))) {
        c->failed_seq = c->seq;
        td_rdv_shutdown(c->rdv);
    }
    return st ? td_error_prefix(st, "barrier #%lu: ", c->seq) : TD_OK;
}
