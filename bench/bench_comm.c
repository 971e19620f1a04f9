/* `tidal bench comm`: the communicator's collectives across the ranks of a
 * job, checked and timed.
 *
 * Launch it as a job (`torchrun --no-python --nproc-per-node 2 tidal bench
 * comm`, mpirun, srun) or let it start its own ranks (`--nproc N`).  Each
 * rank runs every collective (all_reduce sum and max, reduce_scatter,
 * all_gather, broadcast) on fp32 and bf16 buffers in device memory, for
 * counts that are 1, odd, and larger than the CPU communicator's pieces:
 *   - integer-valued inputs, whose sums are exact in any order: every
 *     communicator must give the serial reference bit for bit;
 *   - inputs of mixed magnitude, where order shows in the last bits: the
 *     CPU communicator must still give the rank-order reference bit for bit;
 *     NCCL (its own order) must be within rounding of it;
 *   - and every rank must hold the same bits (a hash of each result,
 *     all-gathered).
 * Then it times all_reduce, all_gather and reduce_scatter (bf16) for sizes
 * up to --max-bytes and prints algorithm and bus bandwidth as nccl-tests
 * does.  Rank 0 prints; the exit status is 1 on any mismatch, on any rank. */
#include "../cli/args.h"
#include "../cli/cli.h"
#include "tidal/alloc.h"
#include "tidal/arena.h"
#include "tidal/convert.h"
#include "tidal/parallel.h"
#include "tidal/util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct bench {
    td_backend *b;
    td_comm *comm;
    td_arena *arena;
    void *dsend, *drecv, *dhash;   /* device: max_bytes, max_bytes, 8 * size */
    unsigned char *hsend, *hrecv;  /* host staging: max check bytes */
    uint64_t *hashes;
    int rank, size, nccl;
    long checks, failures;
} bench;

enum { CHECK_MAX_NUMEL = 1 << 20 };

/* Input element i of rank r for case c: an integer in [-8, 8] (exact) or a
 * value of magnitude 2^-10 .. 2^10 with a random sign, rounded to dt. */
static float value(int r, int c, size_t i, int exact, td_dtype dt)
{
    uint64_t z = (uint64_t)r * 0x9e3779b97f4a7c15ull ^ (uint64_t)c * 0xbf58476d1ce4e5b9ull ^ (i + 1) * 0x94d049bb133111ebull;
    z = (z ^ (z >> 31)) * 0xd6e8feb96aa0a3f1ull;
    z ^= z >> 29;
    float x = exact ? (float)((int)(z % 17) - 8)
                    : (float)(((double)(z >> 11) / 9007199254740992.0 * 2 - 1) * ldexp(1.0, (int)((z >> 3) % 20) - 10));
    return dt == TD_DTYPE_BF16 ? td_f32_from_bf16(td_bf16_from_f32(x)) : x;
}

static void put(void *buf, size_t i, td_dtype dt, float x)
{
    if (dt == TD_DTYPE_F32) ((float *)buf)[i] = x;
    else ((uint16_t *)buf)[i] = td_bf16_from_f32(x);
}

static float get(const void *buf, size_t i, td_dtype dt)
{
    return dt == TD_DTYPE_F32 ? ((const float *)buf)[i] : td_f32_from_bf16(((const uint16_t *)buf)[i]);
}

static td_status copy_sync(bench *B, void *dst, const void *src, size_t bytes)
{
    td_status st = td_backend_copy_async(B->b, TD_QUEUE_COMPUTE, dst, src, bytes);
    return st ? st : td_comm_wait(B->comm, TD_QUEUE_COMPUTE); /* collectives before it: bounded by the timeout */
}

typedef enum what { ALL_REDUCE_SUM, ALL_REDUCE_MAX, REDUCE_SCATTER, ALL_GATHER, BROADCAST, WHAT_COUNT } what;
static const char *what_names[] = {"all_reduce sum", "all_reduce max", "reduce_scatter", "all_gather", "broadcast"};

/* Output element i of collective w for case c, from the serial reference. */
static float expected(bench *B, what w, int c, size_t n, size_t i, int exact, td_dtype dt)
{
    int N = B->size;
    switch (w) {
    case ALL_GATHER: return value((int)(i / n), c, i % n, exact, dt);
    case BROADCAST: return value(N - 1, c, i, exact, dt);
    default: break;
    }
    size_t j = w == REDUCE_SCATTER ? (size_t)B->rank * n + i : i;
    float acc = value(0, c, j, exact, dt);
    for (int r = 1; r < N; r++) {
        float x = value(r, c, j, exact, dt);
        acc = w == ALL_REDUCE_MAX ? (x > acc ? x : acc) : acc + x;
    }
    return dt == TD_DTYPE_BF16 ? td_f32_from_bf16(td_bf16_from_f32(acc)) : acc;
}

/* Runs collective w on case c (n elements per rank) and checks it. */
static td_status check_one(bench *B, what w, int c, size_t n, int exact, td_dtype dt)
{
    td_status st;
    size_t E = td_dtype_bytes(dt), N = (size_t)B->size;
    size_t in_n = w == REDUCE_SCATTER ? N * n : n, out_n = w == ALL_GATHER ? N * n : n;
    for (size_t i = 0; i < in_n; i++) put(B->hsend, i, dt, value(B->rank, c, i, exact, dt));
    if ((st = copy_sync(B, B->dsend, B->hsend, in_n * E))) return st;
    td_queue q = TD_QUEUE_COMPUTE;
    switch (w) {
    case ALL_REDUCE_SUM: st = td_comm_all_reduce(B->comm, B->dsend, B->drecv, n, dt, TD_REDUCE_SUM, q); break;
    case ALL_REDUCE_MAX: st = td_comm_all_reduce(B->comm, B->dsend, B->drecv, n, dt, TD_REDUCE_MAX, q); break;
    case REDUCE_SCATTER: st = td_comm_reduce_scatter(B->comm, B->dsend, B->drecv, n, dt, q); break;
    case ALL_GATHER: st = td_comm_all_gather(B->comm, B->dsend, B->drecv, n, dt, q); break;
    default:
        st = td_comm_broadcast(B->comm, B->dsend, n, dt, B->size - 1, q);
        if (!st) st = td_backend_copy_async(B->b, q, B->drecv, B->dsend, n * E);
        break;
    }
    if (st || (st = copy_sync(B, B->hrecv, B->drecv, out_n * E))) return st;
    /* exact, or the CPU communicator: the reference's bits; NCCL's own order: within rounding */
    int bitwise = exact || !B->nccl || w == ALL_GATHER || w == BROADCAST || w == ALL_REDUCE_MAX;
    double ulp = dt == TD_DTYPE_F32 ? ldexp(1.0, -23) : ldexp(1.0, -8);
    long bad = 0;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < out_n; i++) {
        float got = get(B->hrecv, i, dt), want = expected(B, w, c, n, i, exact, dt);
        uint32_t bits = td_f32_bits(got);
        h = (h ^ bits) * 1099511628211ull;
        if (bitwise ? td_f32_bits(want) != bits : fabs((double)got - want) > (B->size + 1) * ulp * 1024.0 + fabs(want) * 4 * ulp) {
            if (bad++ == 0 && B->rank == 0)
                fprintf(stderr, "tidal bench comm: %s %s n=%zu (%s inputs): element %zu is %.9g, the serial reference "
                        "%.9g\n", what_names[w], td_dtype_name(dt), n, exact ? "integer" : "mixed", i, got, want);
        }
    }
    /* every rank must hold the same bits: all-gather the hashes (as raw bytes) */
    memcpy(B->hsend, &h, sizeof h);
    if ((st = copy_sync(B, B->dhash, B->hsend, 8))) return st;
    if ((st = td_comm_all_gather(B->comm, B->dhash, (char *)B->dhash + 8, 2, TD_DTYPE_F32, q))) return st;
    if ((st = copy_sync(B, B->hashes, (char *)B->dhash + 8, 8 * N))) return st;
    if (w != REDUCE_SCATTER) /* each rank holds its own shard there */
        for (size_t r = 1; r < N; r++)
            if (B->hashes[r] != B->hashes[0]) {
                if (B->rank == 0)
                    fprintf(stderr, "tidal bench comm: %s %s n=%zu: rank %zu's result differs from rank 0's\n",
                            what_names[w], td_dtype_name(dt), n, r);
                bad++;
                break;
            }
    B->checks++;
    B->failures += bad != 0;
    return TD_OK;
}

static td_status run_checks(bench *B)
{
    static const size_t counts[] = {1, 7, 1000, (1 << 18) + 3};
    static const td_dtype dts[] = {TD_DTYPE_F32, TD_DTYPE_BF16};
    td_status st;
    int c = 0;
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++)
        for (int d = 0; d < 2; d++)
            for (int exact = 1; exact >= 0; exact--, c++)
                for (int w = 0; w < WHAT_COUNT; w++)
                    if ((st = check_one(B, (what)w, c, counts[k], exact, dts[d]))) return st;
    return TD_OK;
}

/* Times collective w on `bytes` (the all_reduce buffer, all_gather's output,
 * reduce_scatter's input) and prints algbw and busbw (nccl-tests' factors). */
static td_status time_one(bench *B, int w, size_t bytes, double *algbw, double *busbw)
{
    td_status st;
    size_t n = bytes / 2, N = (size_t)B->size, shard = n / N;
    int iters = bytes >= 64 * TD_MiB ? 10 : 20;
    double t0 = 0;
    for (int it = -2; it < iters; it++) { /* two warm-up rounds */
        if (it == 0) {
            if ((st = td_comm_barrier(B->comm, TD_QUEUE_COMPUTE))) return st;
            t0 = td_now_ms();
        }
        if (w == 0) st = td_comm_all_reduce(B->comm, B->dsend, B->drecv, n, TD_DTYPE_BF16, TD_REDUCE_SUM, TD_QUEUE_COMPUTE);
        else if (w == 1) st = td_comm_all_gather(B->comm, B->dsend, B->drecv, shard, TD_DTYPE_BF16, TD_QUEUE_COMPUTE);
        else st = td_comm_reduce_scatter(B->comm, B->dsend, B->drecv, shard, TD_DTYPE_BF16, TD_QUEUE_COMPUTE);
        if (st) return st;
    }
    if ((st = td_comm_wait(B->comm, TD_QUEUE_COMPUTE))) return st;
    double s = (td_now_ms() - t0) / 1e3 / iters;
    *algbw = (double)bytes / s / 1e9;
    *busbw = *algbw * (w == 0 ? 2.0 * (double)(N - 1) / (double)N : (double)(N - 1) / (double)N);
    return TD_OK;
}

static const char usage[] =
    "usage: tidal bench comm [--nproc N] [--backend B] [--comm C] [--max-bytes SIZE] [--comm-timeout S]\n\n"
    "Checks every collective of the communicator across the ranks of a job against a serial\n"
    "reference (bit for bit where the order is fixed; every rank must hold the same bits), then\n"
    "times all_reduce, all_gather and reduce_scatter in bf16.  Run it under a launcher\n"
    "(torchrun --no-python --nproc-per-node 2 tidal bench comm; mpirun; srun) or with --nproc.";

/* The job joined: the backend, the communicator (its settings agreed by
 * every rank: ranks timing different sizes would call different
 * collectives), the device and host buffers. */
static td_status comm_setup(bench *B, td_dist_env *env, const char *backend, const char *comm_kind,
                            td_comm_params *cp, size_t *max_bytes, int max_given)
{
    td_status st;
    td_backend_params bp = td_backend_default_params();
    if ((st = td_dist_env_read(env)) || (st = td_backend_kind_parse(backend, &bp.kind)) ||
        (st = td_comm_kind_parse(comm_kind, &cp->kind)))
        return st;
    bp.cuda_device = env->local_rank;
    if ((st = td_backend_create(&bp, &B->b)) || (st = td_comm_create(env, B->b, cp, &B->comm))) return st;
    B->rank = env->rank;
    B->size = env->size;
    B->nccl = !strcmp(td_comm_name(B->comm), "nccl");
    if (!max_given) *max_bytes = td_backend_get_kind(B->b) == TD_BACKEND_CUDA ? 256 * TD_MiB : 16 * TD_MiB;
    char mb[32];
    snprintf(mb, sizeof mb, "%zu", *max_bytes);
    td_dist_setting agree[] = {{"--backend", td_backend_name(B->b)}, {"--comm", td_comm_name(B->comm)},
                               {"--max-bytes", mb}};
    if ((st = td_comm_agree(B->comm, agree, sizeof agree / sizeof agree[0]))) return st;
    size_t check_bytes = (size_t)B->size * ((1 << 18) + 3) * 4; /* the largest check's buffer */
    size_t dev_bytes = (*max_bytes > check_bytes ? *max_bytes : check_bytes) + (size_t)B->size * 4;
    dev_bytes = td_align_up(dev_bytes, TD_ARENA_ALIGN);
    if ((st = td_arena_create(B->b, 2 * dev_bytes + 2 * TD_ARENA_ALIGN + td_align_up(16 * (size_t)B->size, TD_ARENA_ALIGN),
                              &B->arena)) ||
        (st = td_arena_alloc(B->arena, dev_bytes, TD_ROLE_COMM, &B->dsend)) ||
        (st = td_arena_alloc(B->arena, dev_bytes, TD_ROLE_COMM, &B->drecv)) ||
        (st = td_arena_alloc(B->arena, 16 * (size_t)B->size, TD_ROLE_COMM, &B->dhash)))
        return st;
    B->hsend = td_malloc(check_bytes, TD_ROLE_STAGING);
    B->hrecv = td_malloc(check_bytes, TD_ROLE_STAGING);
    B->hashes = td_malloc(8 * (size_t)B->size, TD_ROLE_STAGING);
    return B->hsend && B->hrecv && B->hashes ? TD_OK : TD_ERR_NOMEM;
}

/* Every collective checked against the serial reference; *failed when any
 * rank saw a mismatch (every rank learns it). */
static td_status comm_checks(bench *B, int *failed)
{
    td_status st;
    if ((st = run_checks(B))) return st;
    float mine = (float)B->failures, worst = 0;
    memcpy(B->hsend, &mine, 4);
    if ((st = copy_sync(B, B->dhash, B->hsend, 4)) ||
        (st = td_comm_all_reduce(B->comm, B->dhash, B->dhash, 1, TD_DTYPE_F32, TD_REDUCE_MAX, TD_QUEUE_COMPUTE)) ||
        (st = copy_sync(B, &worst, B->dhash, 4)))
        return st;
    if (B->rank == 0)
        printf("checks: %ld collectives x counts x dtypes against the serial reference: %s\n", B->checks,
               worst == 0 ? "all match, the same bits on every rank" : "MISMATCH (see above)");
    *failed = worst != 0;
    return TD_OK;
}

/* all_reduce, all_gather and reduce_scatter timed from 1 MiB up to max_bytes. */
static td_status comm_timings(bench *B, size_t max_bytes)
{
    if (max_bytes < 2 * (size_t)B->size) return TD_OK;
    if (B->rank == 0)
        printf("%12s  %22s  %22s  %22s\n%12s  %10s %11s  %10s %11s  %10s %11s\n", "bytes", "all_reduce (bf16)",
               "all_gather", "reduce_scatter", "", "algbw GB/s", "busbw GB/s", "algbw GB/s", "busbw GB/s",
               "algbw GB/s", "busbw GB/s");
    for (size_t bytes = TD_MiB < max_bytes ? TD_MiB : max_bytes; bytes <= max_bytes; bytes *= 2) {
        size_t aligned = bytes / (2 * (size_t)B->size) * (2 * (size_t)B->size);
        double alg[3], bus[3];
        for (int w = 0; w < 3; w++) {
            td_status st = time_one(B, w, aligned, &alg[w], &bus[w]);
            if (st) return st;
        }
        char s[32];
        if (B->rank == 0)
            printf("%12s  %10.2f %11.2f  %10.2f %11.2f  %10.2f %11.2f\n", td_format_bytes(aligned, s, sizeof s), alg[0],
                   bus[0], alg[1], bus[1], alg[2], bus[2]);
    }
    return TD_OK;
}

int td_bench_comm_main(int argc, char **argv)
{
    int nproc = 0, rc;
    const char *backend = "auto", *comm_kind = "auto";
    size_t max_bytes = 0;
    td_comm_params cp = td_comm_default_params();
    double timeout_s = cp.timeout_ms / 1000.0;
    td_opt table[] = {
        {"nproc", TD_OPT_INT, &nproc, "N", "start N local ranks (as torchrun --nproc-per-node) instead of joining the environment's job", 0},
        {"backend", TD_OPT_STRING, &backend, "B", "auto (default), cpu or cuda; rank r uses GPU LOCAL_RANK", 0},
        {"comm", TD_OPT_STRING, &comm_kind, "C", "communicator: auto (nccl on cuda when built with it), cpu or nccl", 0},
        {"max-bytes", TD_OPT_SIZE, &max_bytes, "SIZE", "largest timed buffer (default 256MiB on cuda, 16MiB on cpu; 0 skips timing)", 0},
        {"comm-timeout", TD_OPT_DOUBLE, &timeout_s, "S", "seconds a rank waits for the others to make progress before it "
         "exits naming the rank that stopped (default 60, or TD_COMM_TIMEOUT_MS)", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    rc = td_args_main(table, argc, argv, "bench comm", usage);
    if (rc >= 0) return rc;
    if (table[0].seen && getenv("WORLD_SIZE")) {
        fprintf(stderr, "tidal bench comm: --nproc starts its own ranks, but this process already is rank %s of a "
                "job of %s (torchrun, or --nproc in a --config); drop --nproc\n", getenv("RANK") ? getenv("RANK") : "?",
                getenv("WORLD_SIZE"));
        td_args_free();
        return 2;
    }
    if (table[0].seen) {
        const char *prefix[] = {"bench", "comm", NULL};
        rc = td_cli_launch_self("bench comm", nproc, prefix, argc, argv);
        td_args_free();
        return rc;
    }
    if (!(timeout_s > 0 && timeout_s <= 86400)) {
        fprintf(stderr, "tidal bench comm: --comm-timeout %g: give seconds in (0, 86400]\n", timeout_s);
        td_args_free();
        return 2;
    }
    cp.timeout_ms = (int)(timeout_s * 1000.0 + 0.5);
    if (cp.timeout_ms < 1) cp.timeout_ms = 1;
    bench B = {0};
    td_dist_env env = {0};
    int failed = 0;
    td_status st = comm_setup(&B, &env, backend, comm_kind, &cp, &max_bytes, td_args_find(table, "max-bytes")->seen);
    if (!st && B.rank == 0)
        printf("tidal bench comm: %d ranks (%s), %s communicator, %s\n", B.size, env.launcher, td_comm_name(B.comm),
               td_backend_describe(B.b));
    if (!st) st = comm_checks(&B, &failed);
    if (!st) st = comm_timings(&B, max_bytes);
    fflush(stdout);
    if (st) fprintf(stderr, "tidal bench comm (rank %d): %s\n", env.rank, td_error_msg());
    td_free(B.hsend);
    td_free(B.hrecv);
    td_free(B.hashes);
    td_comm_destroy(B.comm);
    td_arena_destroy(B.arena);
    td_backend_free(B.b);
    td_args_free();
    return st || failed ? 1 : 0;
}
