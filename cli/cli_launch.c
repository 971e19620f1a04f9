/* `--nproc N`: the running command again as N local ranks (parallel/'s launcher),
 * the way torchrun --nproc-per-node would start it. */
#include "cli.h"
#include "tidal/alloc.h"
#include "tidal/parallel.h"

#include <signal.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int td_cli_launch_wanted(int nproc)
{
    const char *nn = getenv("NNODES");
    return nproc != 1 || (nn && *nn && strcmp(nn, "1") != 0);
}

int td_cli_launch_self(const char *what, int nproc, const char *const *prefix, int argc, char **argv)
{
    if (nproc < 1) {
        fprintf(stderr, "tidal %s: --nproc %d: give at least 1 rank\n", what, nproc);
        return 2;
    }
    char exe[4096];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len <= 0) {
        fprintf(stderr, "tidal %s: cannot find this program (/proc/self/exe) to start its ranks\n", what);
        return 1;
    }
    exe[len] = '\0';
    int np = 0;
    while (prefix[np]) np++;
    char **args = td_calloc((size_t)(argc + np + 2), sizeof(char *), TD_ROLE_META);
    if (!args) {
        fprintf(stderr, "tidal %s: %s\n", what, td_error_msg());
        return 1;
    }
    int k = 0;
    args[k++] = exe;
    for (int i = 0; i < np; i++) args[k++] = (char *)prefix[i];
    for (int i = 0; i < argc; i++) { /* everything but --nproc N / --nproc=N */
        if (!strcmp(argv[i], "--nproc")) { i++; continue; }
        if (!strncmp(argv[i], "--nproc=", 8)) continue;
        args[k++] = argv[i];
    }
    args[k] = NULL;
    td_launch_params p = td_launch_default_params();
    p.nproc = nproc;
    /* Several hosts, as torchrun's --nnodes/--node-rank: NNODES and NODE_RANK,
     * with MASTER_ADDR and MASTER_PORT the same on every host. */
    const char *nn = getenv("NNODES"), *nr = getenv("NODE_RANK"), *ma = getenv("MASTER_ADDR"), *mp = getenv("MASTER_PORT");
    char *end = NULL;
    if (nn && *nn && ((p.nnodes = (int)strtol(nn, &end, 10)) < 1 || *end)) {
        fprintf(stderr, "tidal %s: NNODES='%s' is not a count of hosts\n", what, nn);
        return 2;
    }
    if (nr && *nr && ((p.node_rank = (int)strtol(nr, &end, 10)) < 0 || *end)) {
        fprintf(stderr, "tidal %s: NODE_RANK='%s' is not a host index\n", what, nr);
        return 2;
    }
    if (p.nnodes > 1) {
        p.master_addr = ma && *ma ? ma : NULL;
        if (mp && *mp && ((p.master_port = (int)strtol(mp, &end, 10)) < 1 || *end)) {
            fprintf(stderr, "tidal %s: MASTER_PORT='%s' is not a port\n", what, mp);
            return 2;
        }
    }
    td_launch_result res;
    int rc = 0;
    if (td_launch_run(&p, args, &res)) {
        fprintf(stderr, "tidal %s: %s\n", what, td_error_msg());
        rc = 1;
    } else if (res.failed_rank >= 0) {
        if (res.signal)
            fprintf(stderr, "tidal %s: stopped by signal %d (forwarded to the %d ranks)\n", what, res.signal, nproc);
        else
            fprintf(stderr, "tidal %s: rank %d failed (exit status %d); the other ranks were stopped\n", what,
                    res.failed_rank, res.exit_code);
        rc = res.exit_code;
    }
    td_free(args);
    return rc;
}
