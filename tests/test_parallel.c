/* parallel/: the launchers' environments (torchrun, mpirun, Slurm and its host
 * lists, bad values), the rendezvous between forked processes (its errors:
 * a busy port, a missing rank, a world size that differs), every collective
 * of the CPU communicator on 2, 3 and 4 processes against a serial
 * reference of the same order (bit for bit, on every rank, in place too,
 * counts that cross the staging pieces), its failures (a dead rank, a hung
 * rank, ranks calling different collectives) and the launcher (environment,
 * a failing rank ends the others, signals forwarded, SIGKILL after the
 * grace).  Every wait is bounded: forked ranks run under alarm(), the
 * parent kills them at a deadline. */
#include "td_test.h"
#include "td_ranks.h"

#include "tidal/convert.h"
#include "tidal/parallel.h"

#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- environments ------------------------------------------------------------- */

static td_status parse(td_dist_env *e, const char *const *vars)
{
    return td_dist_env_parse((char *const *)vars, e);
}

/* The job vars make: parsed, and each field as expected. */
static void expect_job(const char *const *vars, int rank, int size, int local_rank, int local_size,
                       const char *addr, const char *launcher)
{
    td_dist_env e;
    TD_ASSERT_OK(parse(&e, vars));
    assert_int_equal(e.rank, rank);
    assert_int_equal(e.size, size);
    assert_int_equal(e.local_rank, local_rank);
    assert_int_equal(e.local_size, local_size);
    assert_string_equal(e.master_addr, addr);
    assert_string_equal(e.launcher, launcher);
}

static void test_env_torchrun(void **state)
{
    td_dist_env e;
    const char *none[] = {"HOME=/root", NULL};
    TD_ASSERT_OK(parse(&e, none));
    assert_int_equal(e.size, 1);
    assert_int_equal(e.rank, 0);
    assert_string_equal(e.launcher, "none");

    const char *tr[] = {"RANK=3", "WORLD_SIZE=8", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=node7",
                        "MASTER_PORT=29400", NULL};
    expect_job(tr, 3, 8, 1, 2, "node7", "torchrun");
    TD_ASSERT_OK(parse(&e, tr));
    assert_int_equal(e.master_port, 29400);

    /* torchrun's agent serves its store on MASTER_PORT: the rendezvous takes the next port */
    const char *agent[] = {"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29500",
                           "TORCHELASTIC_USE_AGENT_STORE=True", NULL};
    TD_ASSERT_OK(parse(&e, agent));
    assert_int_equal(e.master_port, 29501);
    const char *override[] = {"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=h", "MASTER_PORT=29500",
                              "TORCHELASTIC_USE_AGENT_STORE=True", "TD_RDV_PORT=4242", NULL};
    TD_ASSERT_OK(parse(&e, override));
    assert_int_equal(e.master_port, 4242);
    /* torchrun wins over the Slurm job it may run in */
    const char *nested[] = {"SLURM_PROCID=0", "SLURM_NTASKS=1", "RANK=1", "WORLD_SIZE=4", "MASTER_ADDR=a",
                            "MASTER_PORT=1234", NULL};
    TD_ASSERT_OK(parse(&e, nested));
    assert_int_equal(e.rank, 1);
    assert_int_equal(e.size, 4);
    assert_int_equal(e.node_rank, -1);
    /* the host's index: torchrun's GROUP_RANK, Slurm's SLURM_NODEID */
    const char *group[] = {"RANK=5", "WORLD_SIZE=8", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=4", "GROUP_RANK=1",
                           "MASTER_ADDR=a", "MASTER_PORT=1234", NULL};
    TD_ASSERT_OK(parse(&e, group));
    assert_int_equal(e.node_rank, 1);
    const char *slurm[] = {"SLURM_PROCID=3", "SLURM_NTASKS=4", "SLURM_LOCALID=1", "SLURM_NODEID=1", "MASTER_ADDR=a", NULL};
    TD_ASSERT_OK(parse(&e, slurm));
    assert_int_equal(e.node_rank, 1);
    const char *bad_group[] = {"RANK=0", "WORLD_SIZE=2", "GROUP_RANK=x", "MASTER_ADDR=a", "MASTER_PORT=1", NULL};
    assert_int_equal(parse(&e, bad_group), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "GROUP_RANK"));
    td_error_clear();
}

static void test_env_mpirun_slurm(void **state)
{
    td_dist_env e;
    const char *mpi[] = {"OMPI_COMM_WORLD_RANK=2", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=2",
                         "OMPI_COMM_WORLD_LOCAL_SIZE=4", NULL};
    TD_ASSERT_OK(parse(&e, mpi));
    assert_int_equal(e.rank, 2);
    assert_int_equal(e.size, 4);
    assert_int_equal(e.local_rank, 2);
    assert_string_equal(e.master_addr, "127.0.0.1"); /* all local */
    assert_int_equal(e.master_port, 29500);
    assert_string_equal(e.launcher, "mpirun");

    const char *slurm[] = {"SLURM_PROCID=5", "SLURM_NTASKS=8", "SLURM_LOCALID=1", "SLURM_JOB_ID=123456",
                           "SLURM_STEP_NODELIST=gpu[01-04,07],cpu3", NULL};
    TD_ASSERT_OK(parse(&e, slurm));
    assert_int_equal(e.rank, 5);
    assert_int_equal(e.size, 8);
    assert_int_equal(e.local_rank, 1);
    assert_string_equal(e.master_addr, "gpu01");
    assert_int_equal(e.master_port, 20000 + 123456 % 10000);
    assert_string_equal(e.launcher, "slurm");
    const char *slurm_addr[] = {"SLURM_PROCID=0", "SLURM_NTASKS=2", "SLURM_STEP_NODELIST=n[3-4]",
                                "MASTER_ADDR=10.0.0.9", "MASTER_PORT=777", NULL};
    TD_ASSERT_OK(parse(&e, slurm_addr));
    assert_string_equal(e.master_addr, "10.0.0.9");
    assert_int_equal(e.master_port, 777);

    /* MPICH / Intel MPI (Hydra); under srun, which may set PMI_RANK too, Slurm's variables decide. */
    const char *hydra[] = {"PMI_RANK=3", "PMI_SIZE=4", "MPI_LOCALRANKID=1", "MPI_LOCALNRANKS=2",
                           "MASTER_ADDR=node7", NULL};
    expect_job(hydra, 3, 4, 1, 2, "node7", "mpiexec");
    const char *hydra_hosts[] = {"PMI_RANK=3", "PMI_SIZE=4", "MPI_LOCALRANKID=1", "MPI_LOCALNRANKS=2", NULL};
    assert_int_equal(parse(&e, hydra_hosts), TD_ERR_INVALID); /* two hosts, no MASTER_ADDR */
    const char *hydra_local[] = {"PMI_RANK=1", "PMI_SIZE=2", "MPI_LOCALRANKID=1", "MPI_LOCALNRANKS=2", NULL};
    expect_job(hydra_local, 1, 2, 1, 2, "127.0.0.1", "mpiexec"); /* all local */
    const char *srun_pmi[] = {"SLURM_PROCID=1", "SLURM_NTASKS=2", "PMI_RANK=0", "PMI_SIZE=2",
                              "SLURM_STEP_NODELIST=n1", NULL};
    TD_ASSERT_OK(parse(&e, srun_pmi));
    assert_string_equal(e.launcher, "slurm");
    assert_int_equal(e.rank, 1);
}

/* Each bad environment fails with a message holding `needle`. */
static void test_env_bad(void **state)
{
    struct { const char *vars[8]; const char *needle; } cases[] = {
        {{"RANK=2", "WORLD_SIZE=2", "MASTER_ADDR=a", "MASTER_PORT=1", NULL}, "RANK=2 is not below WORLD_SIZE=2"},
        {{"RANK=x", "WORLD_SIZE=2", NULL}, "RANK='x'"},
        {{"RANK=-1", "WORLD_SIZE=2", NULL}, "RANK='-1'"},
        {{"RANK=0", NULL}, "WORLD_SIZE is not"},
        {{"WORLD_SIZE=0", "RANK=0", NULL}, "WORLD_SIZE='0'"},
        {{"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=a", NULL}, "MASTER_PORT is not set"},
        {{"RANK=1", "WORLD_SIZE=4", "MASTER_ADDR=a", "MASTER_PORT=70000", NULL}, "MASTER_PORT='70000'"},
        {{"RANK=3", "WORLD_SIZE=4", "LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=a", "MASTER_PORT=5", NULL},
         "local rank must be below"},
        {{"OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_SIZE=2", NULL}, "MASTER_ADDR is not set"},
        {{"OMPI_COMM_WORLD_RANK=4", "OMPI_COMM_WORLD_SIZE=4", NULL}, "OMPI_COMM_WORLD_RANK=4 is not below"},
        {{"SLURM_PROCID=0", "SLURM_NTASKS=2", "SLURM_LOCALID=2", "MASTER_ADDR=a", NULL}, "SLURM_LOCALID=2 is not below"},
        {{"SLURM_PROCID=1", "SLURM_NTASKS=2", NULL}, "SLURM_STEP_NODELIST"},
        {{"SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_STEP_NODELIST=gpu[01-", NULL}, "SLURM_STEP_NODELIST='gpu[01-'"},
        {{"SLURM_PROCID=0", "SLURM_NTASKS=1", "SLURM_JOB_ID=abc", NULL}, "SLURM_JOB_ID='abc'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        td_dist_env e;
        td_status st = parse(&e, cases[i].vars);
        if (st == TD_OK) fail_msg("case %zu (%s...) was accepted", i, cases[i].vars[0]);
        assert_int_equal(st, TD_ERR_INVALID);
        if (!strstr(td_error_msg(), cases[i].needle))
            fail_msg("case %zu: message '%s' lacks '%s'", i, td_error_msg(), cases[i].needle);
    }
}

static void test_nodelist(void **state)
{
    const char *want[] = {"gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"};
    int n = 0;
    char host[64];
    TD_ASSERT_OK(td_dist_nodelist_count("gpu[01-04,07],cpu3", &n));
    assert_int_equal(n, 6);
    for (int i = 0; i < n; i++) {
        TD_ASSERT_OK(td_dist_nodelist_host("gpu[01-04,07],cpu3", i, host, sizeof host));
        assert_string_equal(host, want[i]);
    }
    TD_ASSERT_OK(td_dist_nodelist_count("node1", &n));
    assert_int_equal(n, 1);
    TD_ASSERT_OK(td_dist_nodelist_host("a-b[8-10],c.d,e[1]", 2, host, sizeof host));
    assert_string_equal(host, "a-b10");
    TD_ASSERT_OK(td_dist_nodelist_count("a-b[8-10],c.d,e[1]", &n));
    assert_int_equal(n, 5);
    TD_ASSERT_OK(td_dist_nodelist_host("a-b[8-10],c.d,e[1]", 3, host, sizeof host));
    assert_string_equal(host, "c.d");
    TD_ASSERT_OK(td_dist_nodelist_host("x[098-101]", 3, host, sizeof host));
    assert_string_equal(host, "x101");
    const char *bad[] = {"", "gpu[01-", "gpu[3-1]", "[1-2]", "a,,b", "a,", "gpu[01]x", "gpu[a]", "gpu[1,]"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        if (td_dist_nodelist_count(bad[i], &n) == TD_OK) fail_msg("'%s' was accepted", bad[i]);
    assert_int_equal(td_dist_nodelist_host("a,b", 2, host, sizeof host), TD_ERR_INVALID);
}

/* ---- forked ranks ------------------------------------------------------------------ */

enum { DEADLINE_S = TD_RANKS_DEADLINE_S };

static void expect_all_ok(int size, const int *codes) { td_test_expect_codes(size, codes, NULL); }

/* ---- rendezvous ----------------------------------------------------------------- */

static int rdv_body(int rank, int size, int port, void *ctx)
{
    td_dist_env e = td_test_local_env(rank, size, port);
    td_rdv *r = NULL;
    if (rank == size - 1) td_sleep_us(300000); /* a late rank: the others wait, rank 0 keeps listening */
    if (td_rdv_join(&e, 10000, &r)) return td_test_rank_fail(rank, "join");
    uint64_t id[4] = {0};
    if (rank == 0) for (int i = 0; i < 4; i++) id[i] = 0xabc0 + (uint64_t)i;
    if (td_rdv_bcast(r, id, sizeof id)) return td_test_rank_fail(rank, "bcast");
    for (int i = 0; i < 4; i++) if (id[i] != 0xabc0 + (uint64_t)i) return 2;
    int all[8] = {0}, mine = 100 + rank;
    if (td_rdv_allgather(r, &mine, sizeof mine, all)) return td_test_rank_fail(rank, "allgather");
    for (int i = 0; i < size; i++) if (all[i] != 100 + i) return 3;
    if (td_rdv_barrier(r)) return td_test_rank_fail(rank, "barrier");
    td_rdv_close(r);
    return 0;
}

static void test_rendezvous(void **state)
{
    int codes[8];
    for (int n = 1; n <= 4; n++) {
        td_test_run_ranks(n, rdv_body, NULL, codes);
        expect_all_ok(n, codes);
    }
}

/* Rank 1 claims a world size of 3 while rank 0 has 2. */
static int rdv_size_body(int rank, int size, int port, void *ctx)
{
    td_dist_env e = td_test_local_env(rank, rank == 1 ? 3 : 2, port);
    td_rdv *r = NULL;
    if (td_rdv_join(&e, 5000, &r) == TD_OK) return 10;
    return strstr(td_error_msg(), "world size 3, rank 0 has 2") ? 0 : td_test_rank_fail(rank, "unexpected message");
}

/* Rank 2 of 3 never comes: rank 0 names it, rank 1 hears it from rank 0. */
static int rdv_missing_body(int rank, int size, int port, void *ctx)
{
    if (rank == 2) return 0;
    td_dist_env e = td_test_local_env(rank, 3, port);
    td_rdv *r = NULL;
    double t0 = td_now_ms();
    if (td_rdv_join(&e, 700, &r) == TD_OK) return 10;
    if (td_now_ms() - t0 > 5000) return 11;
    return strstr(td_error_msg(), "missing ranks: 2") ? 0 : td_test_rank_fail(rank, "unexpected message");
}

static void test_rendezvous_errors(void **state)
{
    int codes[4];
    td_test_run_ranks(2, rdv_size_body, NULL, codes);
    expect_all_ok(2, codes);
    td_test_run_ranks(3, rdv_missing_body, NULL, codes);
    expect_all_ok(3, codes);

    /* a busy port: rank 0 says so; a rank with no rank 0 gives up at its timeout */
    int port = td_test_free_port();
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(fd, 4), 0);
    td_dist_env e = td_test_local_env(0, 2, port);
    td_rdv *r = NULL;
    assert_int_equal(td_rdv_join(&e, 1000, &r), TD_ERR_IO);
    assert_non_null(strstr(td_error_msg(), "already in use"));
    close(fd);
    e = td_test_local_env(1, 2, td_test_free_port());
    double t0 = td_now_ms();
    assert_int_equal(td_rdv_join(&e, 400, &r), TD_ERR_IO);
    assert_true(td_now_ms() - t0 < 3000);
    assert_non_null(strstr(td_error_msg(), "no rank 0 at 127.0.0.1"));
    assert_null(r);
    /* an address that never answers (or is unreachable): still bounded by the timeout */
    snprintf(e.master_addr, sizeof e.master_addr, "10.255.255.1");
    t0 = td_now_ms();
    assert_int_equal(td_rdv_join(&e, 500, &r), TD_ERR_IO);
    assert_true(td_now_ms() - t0 < 3000);
    assert_non_null(strstr(td_error_msg(), "no rank 0 at 10.255.255.1"));
}

/* ---- collectives against the serial reference ------------------------------------------ */

/* Rank r's input for case c: values of mixed magnitude, so the order of a sum shows in its bits. */
static void fill(void *buf, size_t n, td_dtype dt, int rank, int c)
{
    td_rng g;
    td_rng_seed(&g, 1000003u * (uint64_t)c + 7919u * (uint64_t)rank + 1);
    for (size_t i = 0; i < n; i++) {
        float x = (float)((td_rng_uniform(&g) * 2 - 1) * ldexp(1.0, (int)td_rng_below(&g, 20) - 10));
        if (dt == TD_DTYPE_F32) ((float *)buf)[i] = x;
        else if (dt == TD_DTYPE_BF16) ((uint16_t *)buf)[i] = td_bf16_from_f32(x);
        else ((uint16_t *)buf)[i] = td_f16_from_f32(x);
    }
}

static float get(const void *buf, size_t i, td_dtype dt)
{
    if (dt == TD_DTYPE_F32) return ((const float *)buf)[i];
    uint16_t h = ((const uint16_t *)buf)[i];
    return dt == TD_DTYPE_BF16 ? td_f32_from_bf16(h) : td_f32_from_f16(h);
}

static void put(void *buf, size_t i, td_dtype dt, float x)
{
    if (dt == TD_DTYPE_F32) ((float *)buf)[i] = x;
    else if (dt == TD_DTYPE_BF16) ((uint16_t *)buf)[i] = td_bf16_from_f32(x);
    else ((uint16_t *)buf)[i] = td_f16_from_f32(x);
}

/* Element i over ranks 0..size-1 in rank order, in fp32, rounded once. */
static void reference(void *out, size_t i_out, void *const *in, size_t i_in, int size, td_dtype dt, td_reduce_op op)
{
    float acc = get(in[0], i_in, dt);
    for (int r = 1; r < size; r++) {
        float x = get(in[r], i_in, dt);
        acc = op == TD_REDUCE_SUM ? acc + x : x > acc ? x : acc;
    }
    put(out, i_out, dt, acc);
}

typedef struct coll_case { size_t count; td_dtype dt; } coll_case;

/* Counts: 1, odd, and past the CPU communicator's 2^18-element pieces. */
static const coll_case cases[] = {
    {1, TD_DTYPE_F32}, {7, TD_DTYPE_BF16}, {1000, TD_DTYPE_F32}, {333, TD_DTYPE_F16},
    {(1 << 18) + 3, TD_DTYPE_F32}, {(1 << 18) + 5, TD_DTYPE_BF16},
};

static int check_bits(int rank, const char *what, int c, const void *got, const void *want, size_t bytes)
{
    if (!memcmp(got, want, bytes)) return 0;
    fprintf(stderr, "rank %d: %s case %d differs from the serial reference\n", rank, what, c);
    return 1;
}

static int coll_body(int rank, int size, int port, void *ctx)
{
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CPU;
    bp.cpu_device_bytes = 64 * TD_MiB;
    bp.cpu_debug = 1;          /* copies delayed and poisoned: a collective that does not wait reads NaN */
    bp.cpu_debug_delay_us = 20000;
    td_backend *b = NULL;
    td_comm *comm = NULL;
    if (td_backend_create(&bp, &b)) return td_test_rank_fail(rank, "backend");
    td_dist_env e = td_test_local_env(rank, size, port);
    td_comm_params cp = td_comm_default_params();
    cp.kind = TD_COMM_CPU;
    cp.timeout_ms = 20000;
    if (td_comm_create(&e, b, &cp, &comm)) return td_test_rank_fail(rank, "create");
    if (td_comm_size(comm) != size || td_comm_rank(comm) != rank || strcmp(td_comm_name(comm), "cpu")) return 2;
    int bad = 0;
    for (int c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++) {
        size_t n = cases[c].count, E = td_dtype_bytes(cases[c].dt), N = (size_t)size;
        td_dtype dt = cases[c].dt;
        void *in[16], *in_big[16];
        for (int r = 0; r < size; r++) {
            in[r] = malloc(n * E);
            in_big[r] = malloc(N * n * E);
            fill(in[r], n, dt, r, c);
            fill(in_big[r], N * n, dt, r, 100 + c);
        }
        void *out = malloc(N * n * E), *want = malloc(N * n * E), *tmp = malloc(N * n * E);
        /* all_reduce sum and max, from a buffer filled by a delayed H2D copy on the same queue */
        for (int op = 0; op < 2; op++) {
            if (td_backend_copy_async(b, TD_QUEUE_H2D, tmp, in[rank], n * E)) return td_test_rank_fail(rank, "copy");
            if (td_comm_all_reduce(comm, tmp, out, n, dt, (td_reduce_op)op, TD_QUEUE_H2D)) return td_test_rank_fail(rank, "all_reduce");
            for (size_t i = 0; i < n; i++) reference(want, i, in, i, size, dt, (td_reduce_op)op);
            bad |= check_bits(rank, op ? "all_reduce max" : "all_reduce sum", c, out, want, n * E);
        }
        memcpy(out, in[rank], n * E); /* in place */
        if (td_comm_all_reduce(comm, out, out, n, dt, TD_REDUCE_SUM, TD_QUEUE_COMPUTE)) return td_test_rank_fail(rank, "all_reduce");
        for (size_t i = 0; i < n; i++) reference(want, i, in, i, size, dt, TD_REDUCE_SUM);
        bad |= check_bits(rank, "all_reduce in place", c, out, want, n * E);

        /* reduce_scatter: my shard of the sum of everyone's N*n */
        if (td_comm_reduce_scatter(comm, in_big[rank], out, n, dt, TD_QUEUE_COMPUTE)) return td_test_rank_fail(rank, "reduce_scatter");
        for (size_t i = 0; i < n; i++) reference(want, i, in_big, (size_t)rank * n + i, size, dt, TD_REDUCE_SUM);
        bad |= check_bits(rank, "reduce_scatter", c, out, want, n * E);
        memcpy(tmp, in_big[rank], N * n * E); /* in place: recv = send + rank * n */
        if (td_comm_reduce_scatter(comm, tmp, (char *)tmp + (size_t)rank * n * E, n, dt, TD_QUEUE_COMPUTE))
            return td_test_rank_fail(rank, "reduce_scatter");
        bad |= check_bits(rank, "reduce_scatter in place", c, (char *)tmp + (size_t)rank * n * E, want, n * E);

        /* all_gather, out of place and in place */
        for (int r = 0; r < size; r++) memcpy((char *)want + (size_t)r * n * E, in[r], n * E);
        if (td_comm_all_gather(comm, in[rank], out, n, dt, TD_QUEUE_COMPUTE)) return td_test_rank_fail(rank, "all_gather");
        bad |= check_bits(rank, "all_gather", c, out, want, N * n * E);
        memset(tmp, 0, N * n * E);
        memcpy((char *)tmp + (size_t)rank * n * E, in[rank], n * E);
        if (td_comm_all_gather(comm, (char *)tmp + (size_t)rank * n * E, tmp, n, dt, TD_QUEUE_COMPUTE))
            return td_test_rank_fail(rank, "all_gather");
        bad |= check_bits(rank, "all_gather in place", c, tmp, want, N * n * E);

        /* broadcast from every root */
        for (int root = 0; root < size; root++) {
            memcpy(out, in[rank], n * E);
            if (td_comm_broadcast(comm, out, n, dt, root, TD_QUEUE_COMPUTE)) return td_test_rank_fail(rank, "broadcast");
            bad |= check_bits(rank, "broadcast", c, out, in[root], n * E);
        }
        for (int r = 0; r < size; r++) { free(in[r]); free(in_big[r]); }
        free(out); free(want); free(tmp);
    }
    if (td_comm_barrier(comm, TD_QUEUE_D2H)) return td_test_rank_fail(rank, "barrier");
    td_comm_destroy(comm);
    td_backend_free(b);
    return bad ? 3 : 0;
}

static void test_collectives(void **state)
{
    int codes[4];
    for (int n = 1; n <= 4; n++) {
        td_test_run_ranks(n, coll_body, NULL, codes);
        expect_all_ok(n, codes);
    }
}

/* The serial reference's order matters: a sum in another order differs in
 * the last bits for these inputs (else the tests above could not tell). */
static void test_reference_order_matters(void **state)
{
    enum { N = 4, n = 1000 };
    void *in[N];
    for (int r = 0; r < N; r++) { in[r] = malloc(n * 4); fill(in[r], n, TD_DTYPE_F32, r, 2); }
    int differ = 0;
    for (size_t i = 0; i < n; i++) {
        float fwd, bwd = get(in[N - 1], i, TD_DTYPE_F32);
        reference(&fwd, 0, in, i, N, TD_DTYPE_F32, TD_REDUCE_SUM);
        for (int r = N - 2; r >= 0; r--) bwd += get(in[r], i, TD_DTYPE_F32);
        differ += fwd != bwd;
    }
    for (int r = 0; r < N; r++) free(in[r]);
    assert_true(differ > 10);
}

/* ---- failures ------------------------------------------------------------------------ */

static int make_comm(int rank, int size, int port, int timeout_ms, td_backend **b, td_comm **comm)
{
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CPU;
    bp.cpu_device_bytes = 16 * TD_MiB;
    if (td_backend_create(&bp, b)) return td_test_rank_fail(rank, "backend");
    td_dist_env e = td_test_local_env(rank, size, port);
    td_comm_params cp = { .kind = TD_COMM_CPU, .timeout_ms = timeout_ms };
    if (td_comm_create(&e, *b, &cp, comm)) return td_test_rank_fail(rank, "create");
    return 0;
}

typedef struct fail_ctx { int mode; } fail_ctx;
enum { FAIL_DEAD, FAIL_HUNG, FAIL_MISMATCH };

/* Rank 2 dies, hangs or calls another collective; the others must fail
 * quickly (dead, mismatch: well under the 20 s timeout) naming it. */
static int fail_body(int rank, int size, int port, void *ctx)
{
    int mode = ((fail_ctx *)ctx)->mode;
    td_backend *b = NULL;
    td_comm *comm = NULL;
    int timeout_ms = mode == FAIL_HUNG ? 500 : 20000;
    if (make_comm(rank, size, port, timeout_ms, &b, &comm)) return 1;
    float x[64] = {0}, y[64 * 3];
    if (rank == 2) {
        if (mode == FAIL_DEAD) _exit(0);
        if (mode == FAIL_HUNG) { td_sleep_us(3000000); _exit(0); }
        td_comm_all_gather(comm, x, y, 64, TD_DTYPE_F32, TD_QUEUE_COMPUTE);
        _exit(0);
    }
    double t0 = td_now_ms();
    td_status st = td_comm_all_reduce(comm, x, x, 64, TD_DTYPE_F32, TD_REDUCE_SUM, TD_QUEUE_COMPUTE);
    double ms = td_now_ms() - t0;
    if (st == TD_OK) return 10;
    const char *m = td_error_msg();
    int ok = ms < 5000;
    if (rank == 0 && mode == FAIL_DEAD) ok &= strstr(m, "rank 2 closed the job's connection") != NULL;
    if (rank == 0 && mode == FAIL_HUNG) ok &= strstr(m, "no progress receiving from rank 2") != NULL;
    if (rank == 0 && mode == FAIL_MISMATCH)
        ok &= strstr(m, "rank 0 calls all_reduce of 64 fp32 (sum)") && strstr(m, "rank 2 calls all_gather of 64 fp32");
    /* rank 1 learns from rank 0 which rank failed */
    if (rank == 1 && mode == FAIL_DEAD) ok &= strstr(m, "rank 2 failed (rank 0 saw:") != NULL;
    if (rank == 1 && mode != FAIL_DEAD) ok &= strstr(m, "rank 0") != NULL;
    /* after a failure the communicator refuses work at once */
    if (td_comm_all_reduce(comm, x, x, 64, TD_DTYPE_F32, TD_REDUCE_SUM, TD_QUEUE_COMPUTE) != TD_ERR_STATE) ok = 0;
    if (!ok) fprintf(stderr, "rank %d after %.0f ms: %s\n", rank, ms, m);
    td_comm_destroy(comm);
    td_backend_free(b);
    return ok ? 0 : 4;
}

static void test_collective_failures(void **state)
{
    int codes[3];
    for (int mode = FAIL_DEAD; mode <= FAIL_MISMATCH; mode++) {
        fail_ctx ctx = { mode };
        td_test_run_ranks(3, fail_body, &ctx, codes);
        expect_all_ok(3, codes);
    }
}

static void test_comm_kinds(void **state)
{
    td_comm_kind k;
    TD_ASSERT_OK(td_comm_kind_parse("nccl", &k));
    assert_int_equal(k, TD_COMM_NCCL);
    assert_int_equal(td_comm_kind_parse("mpi", &k), TD_ERR_INVALID);
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CPU;
    td_backend *b = NULL;
    TD_ASSERT_OK(td_backend_create(&bp, &b));
    td_dist_env e = td_test_local_env(0, 1, 1);
    td_comm_params cp = { .kind = TD_COMM_NCCL, .timeout_ms = 1000 };
    td_comm *c = NULL;
    td_status st = td_comm_create(&e, b, &cp, &c);
    if (td_comm_nccl_compiled()) {
        assert_int_equal(st, TD_ERR_INVALID);
        assert_non_null(strstr(td_error_msg(), "needs the cuda backend"));
    } else {
        assert_int_equal(st, TD_ERR_UNSUPPORTED);
        assert_non_null(strstr(td_error_msg(), "built without NCCL"));
    }
    cp.kind = TD_COMM_AUTO;
    TD_ASSERT_OK(td_comm_create(&e, b, &cp, &c));
    assert_string_equal(td_comm_name(c), "cpu");
    float x = 1;
    assert_int_equal(td_comm_broadcast(c, &x, 1, TD_DTYPE_F32, 1, TD_QUEUE_COMPUTE), TD_ERR_INVALID);
    assert_int_equal(td_comm_all_reduce(c, NULL, &x, 1, TD_DTYPE_F32, TD_REDUCE_SUM, TD_QUEUE_COMPUTE), TD_ERR_INVALID);
    td_comm_destroy(c);
    td_backend_free(b);
}

/* ---- launcher ------------------------------------------------------------------------ */

static char dir[64];

static int setup(void **state)
{
    snprintf(dir, sizeof dir, "/tmp/tidal-dist-XXXXXX");
    return mkdtemp(dir) ? 0 : -1;
}

static int teardown(void **state)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : -1;
}

static int read_file(const char *path, char *buf, size_t bytes)
{
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, bytes - 1, f);
    buf[n] = '\0';
    fclose(f);
    return 0;
}

static void test_launch_env_and_failure(void **state)
{
    char script[512];
    /* every rank records its variables; rank 1 fails with 3 while the others would run for 30 s */
    snprintf(script, sizeof script,
             "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT\" > %s/env.$RANK; "
             "[ \"$RANK\" = 1 ] && { sleep 0.3; exit 3; }; sleep 30", dir);
    char *argv[] = {"sh", "-c", script, NULL};
    td_launch_params p = td_launch_default_params();
    p.nproc = 3;
    td_launch_result res;
    double t0 = td_now_ms();
    TD_ASSERT_OK(td_launch_run(&p, argv, &res));
    assert_true(td_now_ms() - t0 < 10000); /* the others were ended, not waited for */
    assert_int_equal(res.failed_rank, 1);
    assert_int_equal(res.exit_code, 3);
    for (int r = 0; r < 3; r++) {
        char path[128], got[256], want[256];
        snprintf(path, sizeof path, "%s/env.%d", dir, r);
        assert_int_equal(read_file(path, got, sizeof got), 0);
        snprintf(want, sizeof want, "%d 3 %d 3 127.0.0.1 %d\n", r, r, res.master_port);
        assert_string_equal(got, want);
    }
    /* all succeed: 0 */
    char *ok_argv[] = {"true", NULL};
    TD_ASSERT_OK(td_launch_run(&p, ok_argv, &res));
    assert_int_equal(res.exit_code, 0);
    assert_int_equal(res.failed_rank, -1);
    /* a command that does not exist: 127 */
    char *missing[] = {"/nonexistent/tidal-x", NULL};
    TD_ASSERT_OK(td_launch_run(&p, missing, &res));
    assert_int_equal(res.exit_code, 127);
    p.nproc = 0;
    assert_int_equal(td_launch_run(&p, ok_argv, &res), TD_ERR_INVALID);
}

/* Two "hosts" on this one, as torchrun --nnodes 2 --node-rank 0/1 starts
 * them: each launcher's ranks get the job's ranks, sizes and GROUP_RANK,
 * the rendezvous given (a launcher of several nodes needs MASTER_PORT), and
 * a failure names the job's rank.  Rank 3 fails only once rank 2 has written
 * its line: a failure stops the node's other ranks (SIGTERM). */
static void test_launch_nodes(void **state)
{
    char script[512];
    snprintf(script, sizeof script,
             "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT\" > "
             "%s/nodes.$RANK; [ \"$RANK\" = 3 ] && { while [ ! -s %s/nodes.2 ]; do sleep 0.01; done; exit 4; }; "
             "exit 0", dir, dir);
    char *argv[] = {"sh", "-c", script, NULL};
    td_launch_params p = td_launch_default_params();
    p.nproc = 2;
    p.nnodes = 2;
    td_launch_result res;
    assert_int_equal(td_launch_run(&p, argv, &res), TD_ERR_INVALID); /* no MASTER_PORT */
    assert_non_null(strstr(td_error_msg(), "MASTER_PORT"));
    td_error_clear();
    p.master_port = 4321;
    p.master_addr = "10.0.0.7";
    p.node_rank = 2;
    assert_int_equal(td_launch_run(&p, argv, &res), TD_ERR_INVALID); /* node rank past the nodes */
    td_error_clear();
    for (int node = 0; node < 2; node++) {
        p.node_rank = node;
        TD_ASSERT_OK(td_launch_run(&p, argv, &res));
        assert_int_equal(res.failed_rank, node ? 3 : -1);
        assert_int_equal(res.exit_code, node ? 4 : 0);
    }
    for (int r = 0; r < 4; r++) {
        char path[128], got[256], want[256];
        snprintf(path, sizeof path, "%s/nodes.%d", dir, r);
        assert_int_equal(read_file(path, got, sizeof got), 0);
        snprintf(want, sizeof want, "%d 4 %d 2 %d 10.0.0.7 4321\n", r, r % 2, r / 2);
        assert_string_equal(got, want);
    }
}

/* td_comm_split: 4 ranks split by rank / 2 (keyed by rank % 2) and by
 * rank % 2 (keyed backwards): each group's ranks, sizes and an all-reduce
 * over its members alone; a negative color gets no communicator. */
static int split_body(int rank, int size, int port, void *ctx)
{
    (void)ctx;
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CPU;
    bp.cpu_device_bytes = 4 * TD_MiB;
    td_backend *b = NULL;
    td_comm *c = NULL, *a = NULL, *x = NULL, *none = (td_comm *)&bp;
    td_dist_env e = td_test_local_env(rank, size, port);
    td_comm_params cp = td_comm_default_params();
    cp.kind = TD_COMM_CPU;
    cp.timeout_ms = 20000;
    if (td_backend_create(&bp, &b) || td_comm_create(&e, b, &cp, &c)) return td_test_rank_fail(rank, "create");
    if (td_comm_split(c, rank / 2, rank % 2, &a)) return td_test_rank_fail(rank, "split by host");
    if (td_comm_split(c, rank % 2, -rank, &x)) return td_test_rank_fail(rank, "split across hosts");
    if (td_comm_split(c, rank == 0 ? -1 : 0, rank, &none)) return td_test_rank_fail(rank, "split with a rank out");
    if (td_comm_size(a) != 2 || td_comm_rank(a) != rank % 2) return 2;
    if (td_comm_size(x) != 2 || td_comm_rank(x) != (rank < 2 ? 1 : 0)) return 3;
    if ((rank == 0) != (none == NULL) || (none && (td_comm_size(none) != 3 || td_comm_rank(none) != rank - 1))) return 4;
    float *v = NULL;
    if (td_backend_dev_reserve(b, 16, (void **)&v)) return td_test_rank_fail(rank, "alloc");
    v[0] = (float)(1 << rank);
    if (td_comm_all_reduce(a, v, v, 1, TD_DTYPE_F32, TD_REDUCE_SUM, TD_QUEUE_COMPUTE)) return td_test_rank_fail(rank, "a");
    if (v[0] != (float)(rank < 2 ? 3 : 12)) return 5; /* 1 + 2, 4 + 8 */
    v[0] = (float)(1 << rank);
    if (td_comm_all_reduce(x, v, v, 1, TD_DTYPE_F32, TD_REDUCE_SUM, TD_QUEUE_COMPUTE)) return td_test_rank_fail(rank, "x");
    if (v[0] != (float)(rank % 2 ? 10 : 5)) return 6; /* 2 + 8, 1 + 4 */
    td_backend_dev_release(b, v);
    td_comm_destroy(none);
    td_comm_destroy(x);
    td_comm_destroy(a);
    if (td_comm_barrier(c, TD_QUEUE_COMPUTE)) return td_test_rank_fail(rank, "barrier");
    td_comm_destroy(c);
    td_backend_free(b);
    return 0;
}

static void test_comm_split(void **state)
{
    int codes[4];
    td_test_run_ranks(4, split_body, NULL, codes);
    td_test_expect_codes(4, codes, NULL);
}

/* A rank that ignores SIGTERM is killed after the grace. */
static void test_launch_grace(void **state)
{
    char script[256];
    snprintf(script, sizeof script, "trap '' TERM; [ \"$RANK\" = 0 ] && exit 5; while :; do sleep 0.05; done");
    char *argv[] = {"sh", "-c", script, NULL};
    td_launch_params p = td_launch_default_params();
    p.nproc = 2;
    p.grace_ms = 300;
    td_launch_result res;
    double t0 = td_now_ms();
    TD_ASSERT_OK(td_launch_run(&p, argv, &res));
    assert_true(td_now_ms() - t0 < 5000);
    assert_int_equal(res.exit_code, 5);
    assert_int_equal(res.failed_rank, 0);
}

/* SIGTERM to the launcher reaches every rank (each traps it and records it). */
static void test_launch_forwards_signals(void **state)
{
    char script[512];
    snprintf(script, sizeof script, "trap 'echo got > %s/sig.$RANK; exit 9' TERM; touch %s/up.$RANK; "
             "while :; do sleep 0.05; done", dir, dir);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        alarm(DEADLINE_S);
        char *argv[] = {"sh", "-c", script, NULL};
        td_launch_params p = td_launch_default_params();
        p.nproc = 3;
        td_launch_result res;
        if (td_launch_run(&p, argv, &res)) _exit(1);
        _exit(res.signal == SIGTERM && res.exit_code == 9 ? 0 : 2);
    }
    for (int r = 0; r < 3; r++) { /* wait until every rank has its trap set */
        char path[128];
        snprintf(path, sizeof path, "%s/up.%d", dir, r);
        double deadline = td_now_ms() + 20000;
        while (access(path, F_OK) != 0 && td_now_ms() < deadline) td_sleep_us(10000);
        assert_int_equal(access(path, F_OK), 0);
    }
    td_sleep_us(100000);
    kill(pid, SIGTERM);
    int status = 0;
    double deadline = td_now_ms() + 20000;
    while (waitpid(pid, &status, WNOHANG) == 0) {
        if (td_now_ms() > deadline) { kill(pid, SIGKILL); waitpid(pid, &status, 0); fail_msg("the launcher hung"); }
        td_sleep_us(10000);
    }
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    for (int r = 0; r < 3; r++) {
        char path[128], got[32];
        snprintf(path, sizeof path, "%s/sig.%d", dir, r);
        assert_int_equal(read_file(path, got, sizeof got), 0);
        assert_string_equal(got, "got\n");
    }
}

/* ---- the command, end to end ------------------------------------------------------- */

static const char *tidal_path(void) { return td_test_tidal(); }

static int sh(char *out, size_t out_bytes, const char *cmd)
{
    char full[1200];
    snprintf(full, sizeof full, "timeout 120 sh -c '%s' 2>&1", cmd);
    FILE *p = popen(full, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, out_bytes - 1, p);
    out[n] = '\0';
    int rc = pclose(p);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

static void test_cli_bench_comm(void **state)
{
    char cmd[1024], out[8192];
    const char *t = tidal_path();
    /* --nproc: the launcher's ranks check every collective */
    snprintf(cmd, sizeof cmd, "%s bench comm --nproc 2 --backend cpu --max-bytes 0", t);
    int rc = sh(out, sizeof out, cmd);
    if (rc != 0 || !strstr(out, "2 ranks") || !strstr(out, "all match")) fail_msg("rc %d: %s", rc, out);
    /* launched as torchrun would: the variables set by hand, two processes */
    int port = td_test_free_port();
    snprintf(cmd, sizeof cmd, "export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=%d; "
             "RANK=1 LOCAL_RANK=1 %s bench comm --backend cpu --max-bytes 0 > %s/rank1.out 2>&1 & "
             "RANK=0 LOCAL_RANK=0 %s bench comm --backend cpu --max-bytes 0; r0=$?; wait $!; r1=$?; "
             "cat %s/rank1.out; echo codes $r0 $r1", port, t, dir, t, dir);
    rc = sh(out, sizeof out, cmd);
    if (rc != 0 || !strstr(out, "2 ranks (torchrun)") || !strstr(out, "all match") || !strstr(out, "codes 0 0"))
        fail_msg("rc %d: %s", rc, out);
    /* ranks that fail: the launcher returns the failure (2, a bad flag) */
    snprintf(cmd, sizeof cmd, "%s bench comm --nproc 2 --backend cpu --nproc 2 --max-bytes 0 --comm bogus", t);
    rc = sh(out, sizeof out, cmd);
    if (rc == 0 || !strstr(out, "unknown communicator")) fail_msg("rc %d: %s", rc, out);
    /* train's ranks that fail (no such data): the launcher returns the failure, naming the rank
     * (training on several ranks itself: tests/test_zero3_train.c) */
    snprintf(cmd, sizeof cmd, "%s train --nproc 2 --data none.tok", t);
    rc = sh(out, sizeof out, cmd);
    if (rc == 0 || !strstr(out, "none.tok") || !strstr(out, "failed")) fail_msg("rc %d: %s", rc, out);
    snprintf(cmd, sizeof cmd, "%s train --nproc 0 --data none.tok", t);
    rc = sh(out, sizeof out, cmd);
    if (rc != 2 || !strstr(out, "give at least 1 rank")) fail_msg("rc %d: %s", rc, out);
    snprintf(cmd, sizeof cmd, "RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 %s train --nproc 2 --data none.tok", t);
    rc = sh(out, sizeof out, cmd);
    if (rc != 2 || !strstr(out, "drop --nproc")) fail_msg("rc %d: %s", rc, out);
    snprintf(cmd, sizeof cmd, "RANK=2 WORLD_SIZE=2 %s train --data none.tok", t);
    rc = sh(out, sizeof out, cmd);
    if (rc != 2 || !strstr(out, "RANK=2 is not below WORLD_SIZE=2")) fail_msg("rc %d: %s", rc, out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_env_torchrun),
        cmocka_unit_test(test_env_mpirun_slurm),
        cmocka_unit_test(test_env_bad),
        cmocka_unit_test(test_nodelist),
        cmocka_unit_test(test_rendezvous),
        cmocka_unit_test(test_rendezvous_errors),
        cmocka_unit_test(test_reference_order_matters),
        cmocka_unit_test(test_collectives),
        cmocka_unit_test(test_collective_failures),
        cmocka_unit_test(test_comm_kinds),
        cmocka_unit_test(test_launch_env_and_failure),
        cmocka_unit_test(test_launch_grace),
        cmocka_unit_test(test_launch_nodes),
        cmocka_unit_test(test_comm_split),
        cmocka_unit_test(test_launch_forwards_signals),
        cmocka_unit_test(test_cli_bench_comm),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
