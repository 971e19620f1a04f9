/* The rendezvous: a TCP star at MASTER_ADDR:MASTER_PORT that rank 0 serves.
 *
 * Each rank > 0 connects and sends a hello (magic, version, rank, world
 * size, pid, host name); rank 0 checks them (a world size or protocol that
 * differs, a rank out of range or taken twice) and answers every rank with
 * one reply, OK or the error that ended the job, so a misconfigured launch
 * fails on every rank with the same message.  The connections stay open:
 * they carry the small host collectives below and the CPU communicator, and
 * a rank that dies closes its end, which the others see at once. */
#include "parallel_impl.h"
#include "net.h"
#include "tidal/alloc.h"
#include "tidal/util.h"
#include <poll.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define RDV_MAGIC 0x54445256u /* "TDRV" */
#define RDV_VERSION 2u
#define FAULT_MAGIC 0x54444654u /* "TDFT" */

typedef struct hello {
    uint32_t magic, version;
    int32_t rank, size, pid;
    char host[64];
    int32_t channel; /* 0 data, 1 fault notices */
    int32_t pad;
} hello;

typedef struct notice {
    uint32_t magic;
    int32_t failed;
    char msg[480];
} notice;

typedef struct reply {
    int32_t status;   /* td_status */
    char msg[480];
} reply;

const char *td_rdv_who(int rank, char *buf, size_t buf_bytes)
{
    snprintf(buf, buf_bytes, "rank %d", rank);
    return buf;
}


void td_rdv_notify_fault(td_rdv *r, int failed, const char *msg)
{
    if (r->rank != 0 || !r->peer_ctl) return;
    notice n = { .magic = FAULT_MAGIC, .failed = failed };
    snprintf(n.msg, sizeof n.msg, "%s", msg ? msg : "");
    char who[32];
    for (int i = 1; i < r->size; i++)
        if (i != failed && r->peer_ctl[i] >= 0)
            td_net_send(r->peer_ctl[i], &n, sizeof n, 500, td_rdv_who(i, who, sizeof who));
}

int td_rdv_fault_notice(td_rdv *r, int wait_ms, int *failed, char *buf, size_t buf_bytes)
{
    if (r->rank == 0 || r->ctl_fd < 0) return 0;
    notice n;
    char keep[1024];
    snprintf(keep, sizeof keep, "%s", td_error_msg()); /* a missing notice must not replace the caller's error */
    int got = td_net_recv(r->ctl_fd, &n, sizeof n, wait_ms, "rank 0") == TD_OK && n.magic == FAULT_MAGIC;
    td_error_set(TD_ERR_IO, "%s", keep);
    if (!got) return 0;
    n.msg[sizeof n.msg - 1] = '\0';
    *failed = n.failed;
    snprintf(buf, buf_bytes, "%s", n.msg);
    return 1;
}

void td_rdv_shutdown(td_rdv *r)
{
    if (r->fd >= 0) shutdown(r->fd, SHUT_RDWR);
    if (r->peer_fd)
        for (int i = 1; i < r->size; i++)
            if (r->peer_fd[i] >= 0) shutdown(r->peer_fd[i], SHUT_RDWR);
}

int td_rdv_dead_peers(td_rdv *r, char *buf, size_t buf_bytes)
{
    size_t used = 0;
    int first = -1;
    if (buf_bytes) buf[0] = 0;
    for (int i = 0; i < r->size; i++) {
        int fd = r->rank == 0 ? (r->peer_fd && i > 0 ? r->peer_fd[i] : -1) : (i == 0 ? r->fd : -1);
        if (fd < 0) continue;
        char c;
        struct pollfd p = { .fd = fd, .events = POLLIN | POLLRDHUP };
        /* closed: hung up, or readable with nothing to read (a peek takes no byte) */
        int dead = poll(&p, 1, 0) == 1 && ((p.revents & (POLLHUP | POLLERR | POLLRDHUP)) ||
                                          recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0);
        if (dead && first < 0) first = i;
        if (dead && used + 16 < buf_bytes)
            used += (size_t)snprintf(buf + used, buf_bytes - used, "%srank %d", used ? ", " : "", i);
    }
    return first;
}

void td_rdv_close(td_rdv *r)
{
    if (!r) return;
    if (r->fd >= 0) close(r->fd);
    if (r->ctl_fd >= 0) close(r->ctl_fd);
    for (int i = 1; i < r->size; i++) {
        if (r->peer_fd && r->peer_fd[i] >= 0) close(r->peer_fd[i]);
        if (r->peer_ctl && r->peer_ctl[i] >= 0) close(r->peer_ctl[i]);
    }
    td_free(r->peer_fd);
    td_free(r->peer_ctl);
    td_free(r);
}

/* Rank 0: the reply to every connected rank (best effort: some may be gone). */
static void answer_all(td_rdv *r, td_status st, const char *msg)
{
    reply rp = { .status = (int32_t)st };
    snprintf(rp.msg, sizeof rp.msg, "%s", msg);
    char who[32];
    for (int i = 1; i < r->size; i++)
        if (r->peer_fd[i] >= 0) td_net_send(r->peer_fd[i], &rp, sizeof rp, 1000, td_rdv_who(i, who, sizeof who));
}

static td_status serve(td_rdv *r, const td_dist_env *env)
{
    td_status st = TD_OK;
    int lfd = -1, joined = 0;
    double deadline = td_now_ms() + r->timeout_ms;
    char msg[480] = "";
    if ((st = td_net_listen(env->master_port, &lfd))) return st;
    while (joined < 2 * (r->size - 1)) { /* a data link and a notice link from each */
        double left = deadline - td_now_ms();
        if (left <= 0) {
            char missing[256] = "";
            size_t used = 0;
            int in = 1;
            for (int i = 1; i < r->size && used < sizeof missing - 16; i++) {
                if (r->peer_fd[i] >= 0 && r->peer_ctl[i] >= 0) in++;
                else used += (size_t)snprintf(missing + used, sizeof missing - used, "%s%d", used ? ", " : "", i);
            }
            snprintf(msg, sizeof msg, "rendezvous: rank 0 waited %.1f s on port %d and %d of %d ranks joined; missing "
                     "ranks: %s (did they start, with the same MASTER_ADDR/MASTER_PORT?)", r->timeout_ms / 1000.0,
                     env->master_port, in, r->size, missing);
            st = TD_ERR_IO;
            break;
        }
        int fd;
        if ((st = td_net_accept(lfd, (int)left, &fd))) break;
        if (fd < 0) continue;
        hello h;
        if (td_net_recv(fd, &h, sizeof h, 2000, "a joining rank") != TD_OK || h.magic != RDV_MAGIC) {
            close(fd); /* not a tidal rank (a port probe); keep waiting for ours */
            continue;
        }
        h.host[sizeof h.host - 1] = '\0';
        if (h.version != RDV_VERSION)
            snprintf(msg, sizeof msg, "rendezvous: rank %d (pid %d on %s) speaks protocol %u, rank 0 speaks %u: "
                     "run the same tidal build on every rank", h.rank, h.pid, h.host, h.version, RDV_VERSION);
        else if (h.size != r->size)
            snprintf(msg, sizeof msg, "rendezvous: rank %d (pid %d on %s) has world size %d, rank 0 has %d: the "
                     "launcher's variables differ between ranks", h.rank, h.pid, h.host, h.size, r->size);
        else if (h.rank < 1 || h.rank >= r->size)
            snprintf(msg, sizeof msg, "rendezvous: a rank (pid %d on %s) says it is rank %d of %d", h.pid, h.host,
                     h.rank, r->size);
        else if ((h.channel ? r->peer_ctl : r->peer_fd)[h.rank] >= 0)
            snprintf(msg, sizeof msg, "rendezvous: two processes say they are rank %d (the second is pid %d on %s); "
                     "another job may be using MASTER_PORT %d", h.rank, h.pid, h.host, env->master_port);
        if (msg[0]) {
            reply rp = { .status = TD_ERR_INVALID };
            snprintf(rp.msg, sizeof rp.msg, "%s", msg);
            td_net_send(fd, &rp, sizeof rp, 1000, "the joining rank");
            close(fd);
            st = TD_ERR_INVALID;
            break;
        }
        (h.channel ? r->peer_ctl : r->peer_fd)[h.rank] = fd;
        joined++;
    }
    close(lfd); /* the port is free again once everyone is in (or the job failed) */
    if (st) {
        if (!msg[0]) snprintf(msg, sizeof msg, "%s", td_error_msg());
        answer_all(r, st, msg);
        return td_error_set(st, "%s", msg);
    }
    answer_all(r, TD_OK, "");
    return TD_OK;
}

static td_status join(td_rdv *r, const td_dist_env *env)
{
    td_status st;
    if ((st = td_net_connect(env->master_addr, env->master_port, r->timeout_ms, &r->fd))) return st;
    /* both links before either hello: once rank 0 has read a hello it may close its port */
    td_status ctl = td_net_connect(env->master_addr, env->master_port, r->timeout_ms, &r->ctl_fd);
    hello h = { .magic = RDV_MAGIC, .version = RDV_VERSION, .rank = r->rank, .size = r->size, .pid = (int32_t)getpid() };
    gethostname(h.host, sizeof h.host - 1);
    if ((st = td_net_send(r->fd, &h, sizeof h, r->timeout_ms, "rank 0"))) return st;
    h.channel = 1;
    if (!ctl) ctl = td_net_send(r->ctl_fd, &h, sizeof h, r->timeout_ms, "rank 0");
    reply rp;
    /* rank 0 answers once everyone is in: up to its own timeout, plus a margin */
    if ((st = td_net_recv(r->fd, &rp, sizeof rp, r->timeout_ms + 5000, "rank 0")))
        return td_error_prefix(st, "rendezvous at %s:%d, waiting for the other ranks: ", env->master_addr,
                               env->master_port);
    rp.msg[sizeof rp.msg - 1] = '\0';
    if (rp.status != TD_OK) return td_error_set((td_status)rp.status, "%s (reported by rank 0)", rp.msg);
    if (ctl) return td_error_prefix(ctl, "rendezvous at %s:%d, the notice link: ", env->master_addr, env->master_port);
    return TD_OK;
}

td_status td_rdv_join(const td_dist_env *env, int timeout_ms, td_rdv **out)
{
    td_status st = TD_OK;
    *out = NULL;
    if (env->size < 1 || env->rank < 0 || env->rank >= env->size)
        return td_error_set(TD_ERR_INVALID, "rendezvous: rank %d of %d", env->rank, env->size);
    if (timeout_ms <= 0) return td_error_set(TD_ERR_INVALID, "rendezvous: timeout %d ms must be positive", timeout_ms);
    td_rdv *r = td_calloc(1, sizeof *r, TD_ROLE_COMM);
    if (!r) return TD_ERR_NOMEM;
    r->rank = env->rank;
    r->size = env->size;
    r->timeout_ms = timeout_ms;
    r->fd = r->ctl_fd = -1;
    snprintf(r->addr0, sizeof r->addr0, "%s", env->master_addr);
    if (r->size > 1) {
        if (r->rank == 0) {
            r->peer_fd = td_malloc((size_t)r->size * sizeof(int), TD_ROLE_COMM);
            r->peer_ctl = td_malloc((size_t)r->size * sizeof(int), TD_ROLE_COMM);
            if (!r->peer_fd || !r->peer_ctl) TD_FAIL(TD_ERR_NOMEM, "rendezvous: peer table");
            for (int i = 0; i < r->size; i++) r->peer_fd[i] = r->peer_ctl[i] = -1;
            TD_TRY(serve(r, env));
        } else {
            TD_TRY(join(r, env));
        }
    }
    *out = r;
    return TD_OK;
cleanup:
    td_rdv_close(r);
    return st;
}

td_status td_rdv_bcast(td_rdv *r, void *buf, size_t bytes)
{
    char who[32];
    td_status st;
    if (r->rank > 0) return td_net_recv(r->fd, buf, bytes, r->timeout_ms, "rank 0");
    for (int i = 1; i < r->size; i++)
        if ((st = td_net_send(r->peer_fd[i], buf, bytes, r->timeout_ms, td_rdv_who(i, who, sizeof who)))) return st;
    return TD_OK;
}

td_status td_rdv_allgather(td_rdv *r, const void *mine, size_t bytes, void *all)
{
    char who[32];
    td_status st;
    char *dst = all;
    if (r->rank > 0) {
        if ((st = td_net_send(r->fd, mine, bytes, r->timeout_ms, "rank 0"))) return st;
        return td_net_recv(r->fd, all, bytes * (size_t)r->size, r->timeout_ms, "rank 0");
    }
    memmove(dst, mine, bytes);
    for (int i = 1; i < r->size; i++)
        if ((st = td_net_recv(r->peer_fd[i], dst + (size_t)i * bytes, bytes, r->timeout_ms, td_rdv_who(i, who, sizeof who))))
            return st;
    return td_rdv_bcast(r, all, bytes * (size_t)r->size);
}

td_status td_rdv_barrier(td_rdv *r)
{
    char token = 1, who[32];
    td_status st;
    if (r->rank > 0) {
        if ((st = td_net_send(r->fd, &token, 1, r->timeout_ms, "rank 0"))) return st;
        return td_net_recv(r->fd, &token, 1, r->timeout_ms, "rank 0");
    }
    for (int i = 1; i < r->size; i++)
        if ((st = td_net_recv(r->peer_fd[i], &token, 1, r->timeout_ms, td_rdv_who(i, who, sizeof who)))) return st;
    return td_rdv_bcast(r, &token, 1);
}

td_status td_rdv_addresses(td_rdv *r, char *table, size_t stride)
{
    memset(table, 0, (size_t)r->size * stride);
    if (r->rank == 0) {
        snprintf(table, stride, "%s", r->addr0);
        for (int i = 1; i < r->size; i++) {
            int loop = 0;
            char *a = table + (size_t)i * stride;
            td_status st = td_net_peer_addr(r->peer_fd[i], a, stride, &loop);
            if (st) return st;
            if (loop) snprintf(a, stride, "%s", r->addr0); /* on rank 0's host: reached as rank 0 is */
        }
    }
    return r->size > 1 ? td_rdv_bcast(r, table, (size_t)r->size * stride) : TD_OK;
}
