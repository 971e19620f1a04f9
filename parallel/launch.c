/* The local launcher behind `--nproc N`: what torchrun --nproc-per-node does,
 * without Python.  Each rank gets the torchrun variables, its own process
 * group (so a terminal's Ctrl-C reaches the launcher once and is forwarded
 * once, and a kill reaches a rank's own children) and PR_SET_PDEATHSIG (so
 * no rank outlives a launcher killed with SIGKILL).  The environments are
 * built before fork: a forked child of a threaded process may only exec. */
#include "net.h"
#include "tidal/alloc.h"
#include "tidal/parallel.h"
#include "tidal/util.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

static volatile sig_atomic_t pending_signal;

static void on_signal(int sig) { pending_signal = sig; }

td_launch_params td_launch_default_params(void)
{
    td_launch_params p = { .nproc = 1, .grace_ms = 5000, .master_port = 0, .nnodes = 1, .node_rank = 0 };
    return p;
}

/* Variables the launcher sets, or drops because they would redirect the rendezvous. */
static int replaced(const char *kv)
{
    static const char *names[] = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                  "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TD_RDV_PORT"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        size_t n = strlen(names[i]);
        if (!strncmp(kv, names[i], n) && kv[n] == '=') return 1;
    }
    return 0;
}

enum { RANK_VARS = 7, VAR_BYTES = 300 };

/* One rank's environment: ours first, then the inherited rest.  One
 * allocation: the pointer table, then the seven "NAME=value" strings. */
static char **rank_env(const td_launch_params *p, int i, int port)
{
    size_t n = 0;
    for (char **e = environ; e && *e; e++) n++;
    char **env = td_malloc((n + RANK_VARS + 1) * sizeof(char *) + RANK_VARS * VAR_BYTES, TD_ROLE_META);
    if (!env) return NULL;
    char *s = (char *)(env + n + RANK_VARS + 1);
    size_t k = 0;
    const char *fmt[RANK_VARS] = {"RANK=%d", "LOCAL_RANK=%d", "WORLD_SIZE=%d", "LOCAL_WORLD_SIZE=%d",
                                  "GROUP_RANK=%d", "MASTER_PORT=%d", "MASTER_ADDR=%s"};
    int val[RANK_VARS] = {p->node_rank * p->nproc + i, i, p->nnodes * p->nproc, p->nproc, p->node_rank, port, 0};
    for (int v = 0; v < RANK_VARS; v++, s += VAR_BYTES) {
        if (v == RANK_VARS - 1) snprintf(s, VAR_BYTES, fmt[v], p->master_addr ? p->master_addr : "127.0.0.1");
        else snprintf(s, VAR_BYTES, fmt[v], val[v]);
        env[k++] = s;
    }
    for (char **e = environ; e && *e; e++)
        if (!replaced(*e)) env[k++] = *e;
    env[k] = NULL;
    return env;
}

static int status_code(int status)
{
    return WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1;
}

static void signal_all(const pid_t *pids, int n, int sig)
{
    for (int i = 0; i < n; i++)
        if (pids[i] > 0) kill(-pids[i], sig); /* the rank's process group: its children too */
}

td_status td_launch_run(const td_launch_params *params, char *const *argv, td_launch_result *res)
{
    td_launch_params p = params ? *params : td_launch_default_params();
    td_status st = TD_OK;
    memset(res, 0, sizeof *res);
    res->failed_rank = -1;
    if (p.nproc < 1 || p.nproc > 4096) return td_error_set(TD_ERR_INVALID, "--nproc %d: use 1 to 4096 ranks", p.nproc);
    if (!argv || !argv[0]) return td_error_set(TD_ERR_INVALID, "launch: no command to run");
    if (p.nnodes < 1) p.nnodes = 1;
    if (p.node_rank < 0 || p.node_rank >= p.nnodes)
        return td_error_set(TD_ERR_INVALID, "launch: node rank %d of %d nodes (NODE_RANK runs from 0 to NNODES - 1)",
                            p.node_rank, p.nnodes);
    if (p.nnodes > 1 && !p.master_port)
        return td_error_set(TD_ERR_INVALID, "launch: %d nodes need MASTER_PORT (and MASTER_ADDR, rank 0's host): every "
                            "node's launcher must give its ranks the same rendezvous", p.nnodes);
    if (p.master_addr && strlen(p.master_addr) >= VAR_BYTES - 16)
        return td_error_set(TD_ERR_INVALID, "launch: MASTER_ADDR is longer than %d characters", VAR_BYTES - 16);
    int port = p.master_port;
    /* a port nobody listens on now (the kernel's pick); the ranks bind it a moment later */
    if (port == 0 && (st = td_net_free_port(&port))) return td_error_prefix(st, "launch: MASTER_PORT: ");
    if (port < 1 || port > 65535) return td_error_set(TD_ERR_INVALID, "launch: MASTER_PORT %d is not a port", port);
    res->master_port = port;

    pid_t *pids = td_calloc((size_t)p.nproc, sizeof(pid_t), TD_ROLE_META);
    char ***envs = td_calloc((size_t)p.nproc, sizeof(char **), TD_ROLE_META);
    struct sigaction sa = { .sa_handler = on_signal }, old_int, old_term;
    int handlers = 0, alive = 0;
    if (!pids || !envs) TD_FAIL(TD_ERR_NOMEM, "launch: tables for %d ranks", p.nproc);
    for (int i = 0; i < p.nproc; i++)
        if (!(envs[i] = rank_env(&p, i, port))) TD_FAIL(TD_ERR_NOMEM, "launch: the environment of rank %d", i);
    sigemptyset(&sa.sa_mask);
    pending_signal = 0;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    handlers = 1;
    pid_t launcher = getpid();
    for (int i = 0; i < p.nproc; i++) {
        pid_t pid = fork();
        if (pid < 0) {
            int e = errno;
            signal_all(pids, i, SIGKILL);
            for (int j = 0; j < i; j++) waitpid(pids[j], NULL, 0);
            memset(pids, 0, (size_t)p.nproc * sizeof(pid_t));
            alive = 0;
            TD_FAIL(TD_ERR_IO, "launch: fork for rank %d: %s", i, strerror(e));
        }
        if (pid == 0) {
            setpgid(0, 0);
            prctl(PR_SET_PDEATHSIG, SIGTERM);
            if (getppid() != launcher) _exit(128 + SIGTERM); /* the launcher died before prctl */
            signal(SIGINT, SIG_DFL);
            signal(SIGTERM, SIG_DFL);
            execvpe(argv[0], argv, envs[i]);
            dprintf(2, "tidal launch: rank %d: cannot run %s: %s\n", i, argv[0], strerror(errno));
            _exit(127);
        }
        setpgid(pid, pid); /* also here: no window where a signal to the group misses it */
        pids[i] = pid;
        alive++;
    }
    double kill_at = 0;
    int killed = 0;
    while (alive > 0) {
        if (pending_signal) {
            res->signal = pending_signal;
            pending_signal = 0;
            signal_all(pids, p.nproc, res->signal);
        }
        for (int i = 0; i < p.nproc; i++) {
            int status;
            if (pids[i] <= 0 || waitpid(pids[i], &status, WNOHANG) != pids[i]) continue;
            pids[i] = 0;
            alive--;
            int code = status_code(status);
            if (code != 0 && res->failed_rank < 0) {
                res->failed_rank = p.node_rank * p.nproc + i; /* the job's rank */
                res->exit_code = code;
                signal_all(pids, p.nproc, SIGTERM);
                kill_at = td_now_ms() + p.grace_ms;
            }
        }
        if (kill_at > 0 && !killed && td_now_ms() >= kill_at) {
            signal_all(pids, p.nproc, SIGKILL);
            killed = 1;
        }
        if (alive > 0) td_sleep_us(10000); /* a signal ends the sleep early */
    }
cleanup:
    if (handlers) {
        sigaction(SIGINT, &old_int, NULL);
        sigaction(SIGTERM, &old_term, NULL);
    }
    for (int i = 0; envs && i < p.nproc; i++) td_free(envs[i]);
    td_free(envs);
    td_free(pids);
    return st;
}
