/* Forked ranks for tests (see td_ranks.h). */
#include "td_test.h"
#include "td_ranks.h"

#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

int td_test_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || getsockname(fd, (struct sockaddr *)&a, &len)) abort();
    close(fd);
    return ntohs(a.sin_port);
}

td_dist_env td_test_local_env(int rank, int size, int port)
{
    td_dist_env e = { .rank = rank, .size = size, .local_rank = rank, .local_size = size, .master_port = port };
    snprintf(e.master_addr, sizeof e.master_addr, "127.0.0.1");
    snprintf(e.launcher, sizeof e.launcher, "test");
    return e;
}

int td_test_rank_fail(int rank, const char *what)
{
    fprintf(stderr, "rank %d: %s: %s\n", rank, what, td_error_msg());
    return 1;
}

void td_test_run_ranks(int size, td_rank_body body, void *ctx, int *codes)
{
    int port = td_test_free_port();
    pid_t pids[16];
    assert_true(size >= 1 && size <= 16);
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < size; r++) {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            alarm(TD_RANKS_DEADLINE_S);
            _exit(body(r, size, port, ctx));
        }
        pids[r] = pid;
    }
    double deadline = td_now_ms() + (TD_RANKS_DEADLINE_S + 5) * 1000.0;
    for (int r = 0; r < size; r++) {
        int status = 0;
        while (waitpid(pids[r], &status, WNOHANG) == 0) {
            if (td_now_ms() > deadline) {
                for (int k = 0; k < size; k++) kill(pids[k], SIGKILL);
                waitpid(pids[r], &status, 0);
                break;
            }
            td_sleep_us(5000);
        }
        codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
}

void td_test_expect_codes(int size, const int *codes, const int *want)
{
    for (int r = 0; r < size; r++) {
        int w = want ? want[r] : 0;
        if (codes[r] != w) fail_msg("rank %d exited %d, expected %d (its message is above)", r, codes[r], w);
    }
}
