/* Forked ranks for the tests of several processes (parallel/, checkpoints
 * written by a group, ZeRO-3): each rank is a child running a body under
 * alarm(); the parent collects exit codes and kills all at a deadline. */
#ifndef TD_RANKS_H
#define TD_RANKS_H

#include "tidal/parallel.h"

enum { TD_RANKS_DEADLINE_S = 60 };

/* A free TCP port on the loopback interface (bound, read, released). */
int td_test_free_port(void);
/* Rank `rank` of `size`, all on this host, rendezvous at 127.0.0.1:port. */
td_dist_env td_test_local_env(int rank, int size, int port);

typedef int (*td_rank_body)(int rank, int size, int port, void *ctx);
/* A forked rank's failure: says why on stderr (with the library's message), returns 1. */
int td_test_rank_fail(int rank, const char *what);
/* Forks `size` ranks (<= 16) running body; codes[r] = rank r's exit status
 * (128 + signal when killed).  No rank outlives TD_RANKS_DEADLINE_S. */
void td_test_run_ranks(int size, td_rank_body body, void *ctx, int *codes);
/* Fails the test unless codes[r] == want[r] (want NULL: all 0). */
void td_test_expect_codes(int size, const int *codes, const int *want);

#endif
