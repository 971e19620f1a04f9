/* Private to parallel/: the rendezvous's connections (the CPU communicator runs
 * over them) and the communicator's vtable (as offload/backend_impl.h). */
#ifndef TIDAL_DIST_IMPL_H
#define TIDAL_DIST_IMPL_H

#include "tidal/parallel.h"

/* A star: rank 0 holds a connection to every other rank, which holds one to
 * rank 0.  Messages between two ranks arrive in the order sent. */
struct td_rdv {
    int rank, size;
    int timeout_ms;
    int fd;        /* rank > 0: to rank 0; -1 on rank 0 */
    int *peer_fd;  /* rank 0: [size], peer_fd[0] = -1; NULL elsewhere */
    /* A second link per rank that carries only fault notices, so that when
     * rank 0 sees rank k fail, the others learn it was k (their data link
     * only shows rank 0 closing). */
    int ctl_fd;    /* rank > 0 */
    int *peer_ctl; /* rank 0: [size] */
    char addr0[256]; /* rank 0's address, as the job reached it (MASTER_ADDR) */
};

/* Every rank's address, as another host reaches it, into table (size
 * entries of stride bytes): rank 0's as the job reached it, the others' as
 * rank 0 sees their links (a rank on rank 0's host, seen on the loopback:
 * rank 0's).  Collective over the rendezvous. */
td_status td_rdv_addresses(td_rdv *r, char *table, size_t stride);

/* "rank 3" into buf, for messages. */
/* After a failure: shuts every link down, so the other ranks see the job
 * end at once instead of waiting for a timeout. */
void td_rdv_shutdown(td_rdv *r);
const char *td_rdv_who(int rank, char *buf, size_t buf_bytes);
/* The peers whose link is closed now ("rank 2, rank 3"; rank 0 sees every
 * rank, the others only rank 0), without waiting or reading; "" if none.
 * Returns the first of them, -1 if none.  For the message of a timeout
 * that NCCL cannot attribute. */
int td_rdv_dead_peers(td_rdv *r, char *buf, size_t buf_bytes);
/* Rank 0, before it shuts the links down after rank `failed` failed: tells
 * every other rank, with the message (best effort, bounded). */
void td_rdv_notify_fault(td_rdv *r, int failed, const char *msg);
/* Rank > 0, after its link to rank 0 failed: rank 0's notice if one comes
 * within wait_ms (the failed rank into *failed, its message into buf);
 * 0 when none came. */
int td_rdv_fault_notice(td_rdv *r, int wait_ms, int *failed, char *buf, size_t buf_bytes);

typedef struct td_comm_ops {
    void (*destroy)(td_comm *c);
    td_status (*all_gather)(td_comm *c, const void *send, void *recv, size_t count, td_dtype dt, td_queue q);
    td_status (*reduce_scatter)(td_comm *c, const void *send, void *recv, size_t count, td_dtype dt, td_queue q);
    td_status (*all_reduce)(td_comm *c, const void *send, void *recv, size_t count, td_dtype dt, td_reduce_op op,
                            td_queue q);
    td_status (*broadcast)(td_comm *c, void *buf, size_t count, td_dtype dt, int root, td_queue q);
    /* The host waits for queue q, collectives included, within the timeout
     * (NULL: td_queue_sync, for implementations whose collectives are done
     * when called). */
    td_status (*wait)(td_comm *c, td_queue q);
} td_comm_ops;

struct td_comm {
    const td_comm_ops *ops;
    const char *name;
    int rank, size, local_rank;
    td_backend *backend;
    td_rdv *rdv;         /* owned; the host barrier, and the cpu communicator's links */
    int timeout_ms;      /* how long any wait for a peer may see no progress */
    unsigned long seq;   /* collectives called so far, for messages */
    unsigned long failed_seq; /* the collective that failed; nothing runs after one (0: none) */
};

/* Each implementation fills *out (its own struct, td_comm first) and sets
 * ops; comm.c sets the common fields before and frees on failure. */
td_status td_comm_cpu_create(td_comm *base, td_comm **out);
#ifdef TD_HAVE_NCCL
td_status td_comm_nccl_create(td_comm *base, td_comm **out);
#endif

#endif
