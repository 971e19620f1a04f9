/* The heap each ZeRO-3 rank keeps (cpu backend): tidal's own heap
 * (td_malloc's bytes by role, the step log's host.heap_roles) holds no
 * per-parameter state, so a rank of 2 peaks at no more than one rank alone
 * does, plus its communicator's buffers (a fixed number of fixed-size
 * pieces, whatever the model) and 1 MiB for what a rank keeps per rank or
 * per chunk (its shard tables, the ranks' partial norms).  The model is one
 * whose largest tensor (the embedding, 50304 x 256 fp32: 49 MiB) is far
 * above that allowance, so a buffer the size of a tensor, or any array of
 * a byte a parameter (13M of them), drawn by every rank fails the test.
 * The losses of the two runs agree (the shards were drawn from the same
 * streams).  Every wait is bounded. */
#include "td_test.h"
#include "td_proc.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char tidal[512], tmp[64];

#define MODEL "--layers 1 --width 256 --heads 4 --vocab 50304 --seq 32 --backend cpu " \
              "--steps 2 --threads 1 --chunk-numel 4000000"

static int setup(void **state)
{
    (void)state;
    snprintf(tidal, sizeof tidal, "%s", td_test_tidal());
    if (td_proc_tmpdir(tmp, sizeof tmp, "tidal-zero3-heap")) return -1;
    return td_proc_prepare(tidal, tmp, "head -c 50000 /usr/share/games/fortunes/fortunes", "d");
}

static int teardown(void **state)
{
    (void)state;
    return td_proc_rmdir(tmp);
}

typedef struct heap_seen {
    double peak;  /* tidal's heap at its most: every role's peak added (an upper bound of the total's) */
    double comm;  /* the communication role's peak */
    int steps;
} heap_seen;

static void last_heap(cJSON *o, void *ctx)
{
    heap_seen *h = ctx;
    const cJSON *roles = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, "host"), "heap_roles");
    assert_non_null(roles);
    h->peak = 0;
    const cJSON *r;
    cJSON_ArrayForEach(r, roles) h->peak += td_test_json_num(r, "peak_bytes", NULL);
    h->comm = td_test_json_num(cJSON_GetObjectItemCaseSensitive(roles, "communication"), "peak_bytes", NULL);
    h->steps++;
}

static heap_seen train(int ranks, double *loss)
{
    char out[256], log[256], args[1024];
    snprintf(out, sizeof out, "%s/n%d.out", tmp, ranks);
    snprintf(log, sizeof log, "%s/n%d.jsonl", tmp, ranks);
    snprintf(args, sizeof args, "--data %s/d.tok " MODEL " --micro-batch %d --nproc %d --log %s", tmp, 2 / ranks, ranks,
             log); /* one global batch of 2 */
    pid_t p = td_proc_start(out, -1, 0, 0, "%s train %s", tidal, args);
    if (td_proc_finish(p, 120, args) != 0) fail_msg("%s: %s", args, td_proc_slurp(out));
    heap_seen h = {0};
    td_test_for_each_jsonl(log, last_heap, &h);
    assert_int_equal(h.steps, 2);
    assert_int_equal(td_proc_read_log(log, loss, NULL, 2), 2);
    return h;
}

static void test_rank_heap_holds_no_parameter_state(void **state)
{
    (void)state;
    double l1[2], l2[2];
    heap_seen one = train(1, l1), two = train(2, l2);
    td_proc_expect_close(l1, l2, 2, 1e-5, "2 ranks' losses against 1 rank's");
    assert_true(two.comm > 0); /* the communicator's pieces are counted, under their role */
    const double allowance = two.comm + (1 << 20), embed = 50304.0 * 256 * 4;
    if (two.peak > one.peak + allowance)
        fail_msg("a rank of 2 peaked at %.0f heap bytes, over 1 rank's %.0f + the communicator's %.0f + 1 MiB "
                 "(the embedding is %.0f bytes in fp32)", two.peak, one.peak, two.comm, embed);
    assert_true(one.peak < embed / 4); /* one rank draws into the master: nothing of a tensor's size either */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rank_heap_holds_no_parameter_state),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
