/* The NCCL communicator on GPUs, end to end through `tidal bench comm`
 * (which checks every collective against the serial reference and that
 * every rank holds the same bits): one rank, and as many ranks as there are
 * GPUs (up to 8) under --nproc and under torchrun-style variables set by
 * hand.  Run as separate processes: NCCL needs one process per GPU, and a
 * process that forks after initialising CUDA cannot use it in the child. */
#include "td_proc.h"
#include "td_test.h"

#include "tidal/parallel.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *tidal_path(void)
{
    const char *exe = getenv("TIDAL");
    return exe ? exe : "./build/tidal";
}

static int sh(char *out, size_t out_bytes, const char *cmd)
{
    char full[1200];
    snprintf(full, sizeof full, "timeout 300 sh -c '%s' 2>&1", cmd);
    FILE *p = popen(full, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, out_bytes - 1, p);
    out[n] = '\0';
    int rc = pclose(p);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

static void test_nccl_one_rank(void **state)
{
    if (!td_comm_nccl_compiled()) td_test_skip("needs NCCL (this build has none: NCCL=1)");
    int gpus = td_proc_gpu_count();
    if (gpus < 1) td_test_skip("needs a GPU (nvidia-smi -L lists none)");
    char cmd[1024], out[16384];
    snprintf(cmd, sizeof cmd, "%s bench comm --backend cuda --comm nccl --max-bytes 64MiB", tidal_path());
    int rc = sh(out, sizeof out, cmd);
    printf("%s", out);
    if (rc != 0 || !strstr(out, "nccl communicator") || !strstr(out, "all match")) fail_msg("1 rank: rc %d", rc);
}

/* Every GPU a rank under --nproc, then 2 ranks launched as torchrun would. */
static void test_nccl_ranks(void **state)
{
    int gpus = td_proc_gpu_count();
    if (gpus < 2) td_test_skip("needs 2 GPUs (found %d): NCCL takes one a rank", gpus);
    if (!td_comm_nccl_compiled()) td_test_skip("needs NCCL (this build has none: NCCL=1)");
    char cmd[1024], out[16384];
    snprintf(cmd, sizeof cmd, "%s bench comm --nproc %d --backend cuda --comm nccl --max-bytes 256MiB", tidal_path(), gpus);
    int rc = sh(out, sizeof out, cmd);
    printf("%s", out);
    if (rc != 0 || !strstr(out, "all match")) fail_msg("%d ranks under --nproc: rc %d", gpus, rc);
    /* as torchrun would launch it, the variables by hand (2 ranks) */
    snprintf(cmd, sizeof cmd, "export WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29613; "
             "RANK=1 LOCAL_RANK=1 %s bench comm --backend cuda --max-bytes 0 > /tmp/tidal-nccl-rank1.out 2>&1 & "
             "RANK=0 LOCAL_RANK=0 %s bench comm --backend cuda --max-bytes 0; r0=$?; wait $!; r1=$?; "
             "cat /tmp/tidal-nccl-rank1.out; rm -f /tmp/tidal-nccl-rank1.out; echo codes $r0 $r1",
             tidal_path(), tidal_path());
    rc = sh(out, sizeof out, cmd);
    printf("%s", out);
    if (rc != 0 || !strstr(out, "nccl communicator") || !strstr(out, "codes 0 0")) fail_msg("env launch: rc %d", rc);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nccl_one_rank),
        cmocka_unit_test(test_nccl_ranks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
