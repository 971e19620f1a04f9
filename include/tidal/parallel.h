/* Several processes: the job's environment, the rendezvous, the
 * communicator and the local launcher.
 *
 *   env          rank, world size and local rank from torchrun, mpirun
 *                (Open MPI) or Slurm srun variables, checked for consistency.
 *   rendezvous   a TCP star at MASTER_ADDR:MASTER_PORT: rank 0 listens, the
 *                others connect and say who they are; afterwards it carries
 *                small host messages (the NCCL unique id, flags to compare).
 *                No MPI is needed.
 *   communicator all-gather, reduce-scatter, all-reduce, broadcast and
 *                barrier on a backend queue.  Two implementations behind one
 *                vtable: NCCL (cuda backend; async on the queue's stream) and
 *                a CPU one over the rendezvous connections (cpu backend; runs
 *                on the calling thread after the queue's earlier work, so it
 *                is synchronous).
 *   launch       `tidal ... --nproc N`: N local copies of one command with the
 *                torchrun variables set, signals forwarded, all ended when one
 *                fails.
 *
 * Reductions of the CPU communicator are deterministic: element i of the
 * result is (((x_0 + x_1) + x_2) + ... + x_{N-1}) in fp32, in rank order,
 * rounded once to the element type, and every rank receives the same bits.
 * NCCL's order is its own (ring or tree); its results are the same on every
 * rank but may differ from that serial order in the last bits.
 *
 * Thread-safety: a communicator or rendezvous is used by one thread at a
 * time, and every rank must call the same collectives in the same order with
 * the same counts and types (the CPU communicator checks this and names the
 * rank that differs). */
#ifndef TIDAL_PARALLEL_H
#define TIDAL_PARALLEL_H

#include <stddef.h>

#include "tidal/backend.h"
#include "tidal/dtype.h"
#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --- environment -------------------------------------------------------------- */

typedef struct td_dist_env {
    int rank, size;             /* global rank in [0, size) */
    int local_rank, local_size; /* on this host; local_size 0 when the launcher does not say */
    int node_rank;              /* this host's index when the launcher says (torchrun's GROUP_RANK,
                                   Slurm's SLURM_NODEID); -1 otherwise */
    char master_addr[256];      /* where rank 0 serves the rendezvous */
    int master_port;            /* the rendezvous port (see td_dist_env_parse) */
    char launcher[16];          /* "none", "torchrun", "mpirun" or "slurm" */
} td_dist_env;

/* Reads the job from an environment (NULL-terminated "NAME=value" strings,
 * as `environ`).  The first launcher whose variables are present decides:
 *   torchrun (and `tidal --nproc`): RANK, WORLD_SIZE, LOCAL_RANK,
 *       LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.  torchrun's agent already
 *       serves its own store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True),
 *       so tidal's rendezvous then takes MASTER_PORT + 1.
 *   mpirun:  OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE; MASTER_ADDR
 *       (127.0.0.1 when every rank is local) and MASTER_PORT (default 29500).
 *   Slurm:   SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR, else the
 *       first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST); MASTER_PORT,
 *       else 20000 + SLURM_JOB_ID % 10000.
 *   none:    a single process (rank 0 of 1).
 * TD_RDV_PORT, when set, overrides the rendezvous port for every launcher.
 * Missing, malformed or inconsistent values (RANK >= WORLD_SIZE, a local
 * rank outside the local size, ...) fail with TD_ERR_INVALID naming the
 * variables and the launcher that set them. */
td_status td_dist_env_parse(char *const *envp, td_dist_env *out);
/* td_dist_env_parse of this process's environment. */
td_status td_dist_env_read(td_dist_env *out);

/* Slurm's compressed host lists: "gpu[01-04,07],cpu3" is gpu01 gpu02 gpu03
 * gpu04 gpu07 cpu3 (zero padding kept).  *count = number of hosts; host
 * i (0-based) into buf.  TD_ERR_INVALID on a malformed list or i >= count. */
td_status td_dist_nodelist_count(const char *nodelist, int *count);
td_status td_dist_nodelist_host(const char *nodelist, int i, char *buf, size_t buf_bytes);

/* --- rendezvous ----------------------------------------------------------------- */

typedef struct td_rdv td_rdv;

/* Joins the job: rank 0 listens on master_port (all interfaces) and waits
 * for the others; rank r > 0 connects to master_addr:master_port, retrying
 * while rank 0 is not up yet.  Every rank returns once all have joined, or
 * fails after timeout_ms naming the missing ranks (rank 0), the address it
 * could not reach (others), a port already in use, or a rank whose world
 * size or rank disagrees.  A job of size 1 joins at once without sockets. */
td_status td_rdv_join(const td_dist_env *env, int timeout_ms, td_rdv **out);
void td_rdv_close(td_rdv *r);
/* Rank 0's `bytes` at buf reach buf on every rank. */
td_status td_rdv_bcast(td_rdv *r, void *buf, size_t bytes);
/* Every rank's `bytes` from mine, in rank order, into all (size * bytes). */
td_status td_rdv_allgather(td_rdv *r, const void *mine, size_t bytes, void *all);
td_status td_rdv_barrier(td_rdv *r);

/* --- agreement -------------------------------------------------------------------- */

/* One setting every rank must share: a flag, the model, the data file
 * (e.g. "--lr" = "0.0003", "data" = "<token count> <CRC-32>"). */
typedef struct td_dist_setting {
    const char *key;
    const char *value; /* NULL reads as unset */
} td_dist_setting;

/* Every rank passes its settings, the same keys in the same order.  TD_OK
 * when all ranks' lists are equal; otherwise TD_ERR_INVALID on every rank
 * with the same message naming the first setting that differs, the first
 * rank that differs from rank 0 and both values ("ranks disagree on --lr:
 * rank 0 has '0.0003', rank 2 has '0.001'"), or the counts when the lists
 * differ only in length.  Values are compared whole (by a 64-bit hash) and
 * shown up to 160 bytes.  Costs one all-gather of 16 bytes a rank when all
 * agree. */
td_status td_rdv_agree(td_rdv *r, const td_dist_setting *s, size_t n);

/* --- communicator --------------------------------------------------------------- */

typedef struct td_comm td_comm;

typedef enum td_comm_kind {
    TD_COMM_AUTO,   /* nccl on the cuda backend when built with NCCL, else cpu */
    TD_COMM_CPU,    /* over the rendezvous connections; host-readable buffers only */
    TD_COMM_NCCL,
} td_comm_kind;

typedef enum td_reduce_op {
    TD_REDUCE_SUM,
    TD_REDUCE_MAX,  /* a NaN anywhere gives NaN (the CPU communicator) */
} td_reduce_op;

typedef struct td_comm_params {
    td_comm_kind kind;
    int timeout_ms;   /* the rendezvous, and each wait for a peer: progress within this or the job
                         fails naming the rank (--comm-timeout; NCCL: the communicator is aborted) */
} td_comm_params;

/* AUTO, 60 s (env TD_COMM_TIMEOUT_MS). */
td_comm_params td_comm_default_params(void);
td_status td_comm_kind_parse(const char *name, td_comm_kind *out); /* auto, cpu, nccl */
/* Whether this build contains the NCCL communicator. */
int td_comm_nccl_compiled(void);

/* Joins the job described by env (a rendezvous, then the implementation's
 * setup) for buffers of backend b; b must outlive the communicator.  On the
 * cuda backend the device the backend uses must be current. */
td_status td_comm_create(const td_dist_env *env, td_backend *b, const td_comm_params *params, td_comm **out);
void td_comm_destroy(td_comm *c);
/* A communicator over some of c's ranks (collective: every rank of c calls
 * it): those that pass the same color (>= 0) form one, ranked by key then
 * by their rank in c; a rank passing a negative color gets *out NULL.  The
 * same kind as c (NCCL or CPU), the same timeout, with a rendezvous of its
 * own that the group's first rank serves on a free port of its host (the
 * address the job reaches it at).  Destroy it before c. */
td_status td_comm_split(td_comm *c, int color, int key, td_comm **out);
int td_comm_rank(const td_comm *c);
int td_comm_size(const td_comm *c);
const char *td_comm_name(const td_comm *c); /* "cpu" or "nccl" */

/* Collectives on queue q, after the queue's earlier work.  Counts are in
 * elements of dt.  In place works as in NCCL: all_reduce with send == recv,
 * all_gather with send == recv + rank * count, reduce_scatter with
 * recv == send + rank * count.  A shard of a length not divisible by the
 * world size is the caller's to pad. */
/* recv (size * count) = the ranks' send (count each), in rank order. */
td_status td_comm_all_gather(td_comm *c, const void *send, void *recv, size_t count, td_dtype dt, td_queue q);
/* recv (count) = sum over ranks of send[rank * count ... +count) (send holds size * count). */
td_status td_comm_reduce_scatter(td_comm *c, const void *send, void *recv, size_t count, td_dtype dt, td_queue q);
td_status td_comm_all_reduce(td_comm *c, const void *send, void *recv, size_t count, td_dtype dt,
                             td_reduce_op op, td_queue q);
/* Root's count elements at buf reach buf on every rank. */
td_status td_comm_broadcast(td_comm *c, void *buf, size_t count, td_dtype dt, int root, td_queue q);
/* Returns once every rank's queue q has finished what came before (the host
 * waits for its queue, then for the other ranks). */
td_status td_comm_barrier(td_comm *c, td_queue q);
/* The host waits for queue q, its collectives included.  With NCCL a wait
 * that sees no progress for the timeout aborts the communicator and fails
 * (TD_ERR_IO) naming the ranks whose link has closed; use it instead of
 * td_queue_sync wherever collectives may be in flight. */
td_status td_comm_wait(td_comm *c, td_queue q);
/* td_rdv_agree over the communicator's rendezvous (host only).  A failure
 * other than a disagreement ends the communicator. */
td_status td_comm_agree(td_comm *c, const td_dist_setting *s, size_t n);
/* Small host messages over the rendezvous, not the collective path: every
 * rank's `bytes` at mine into all (size * bytes, rank order).  For control
 * data (a checkpoint group's votes, per-rank sums to add in rank order so
 * every rank gets the same bits).  A failure ends the communicator. */
td_status td_comm_host_allgather(td_comm *c, const void *mine, size_t bytes, void *all);

/* --- launch ----------------------------------------------------------------------- */

typedef struct td_launch_params {
    int nproc;             /* local ranks, >= 1 */
    int grace_ms;          /* after the first failure: SIGTERM, then SIGKILL after this (default 5000) */
    int master_port;       /* 0: a free port found now (one host only) */
    /* Several hosts, as torchrun's --nnodes / --node-rank: this launcher
     * starts ranks node_rank x nproc .. + nproc - 1 of nnodes x nproc, and
     * each host's launcher must be given the same master_addr (rank 0's
     * host; NULL: 127.0.0.1) and master_port. */
    int nnodes, node_rank;
    const char *master_addr;
} td_launch_params;

typedef struct td_launch_result {
    int exit_code;     /* 0, or the first failed rank's status (128 + signal when killed) */
    int failed_rank;   /* the first rank that failed; -1 if none */
    int signal;        /* the last SIGINT/SIGTERM forwarded to the ranks; 0 if none */
    int master_port;   /* the port the ranks were given */
} td_launch_result;

td_launch_params td_launch_default_params(void);
/* Runs argv (argv[0] looked up on PATH) nproc times, each with RANK,
 * LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (the node rank),
 * MASTER_ADDR (127.0.0.1 unless given) and MASTER_PORT set, each in its own process group (and ended if the
 * launcher dies); forwards SIGINT and SIGTERM to all of them.  When a rank
 * exits non-zero or is killed, the others get SIGTERM, then SIGKILL after
 * grace_ms.  Returns once every rank has exited; fails only when it could
 * not start them.  Installs handlers for SIGINT and SIGTERM for its
 * duration, so only a launcher process should call it. */
td_status td_launch_run(const td_launch_params *p, char *const *argv, td_launch_result *res);

#ifdef __cplusplus
}
#endif
#endif
