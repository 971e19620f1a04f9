/* The job from the launcher's environment variables (torchrun, mpirun,
 * Slurm, MPICH's mpiexec), and Slurm's compressed host lists.  Pure functions of the strings
 * they are given, so the tests feed them made-up environments. */
#include "tidal/parallel.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern char **environ;

static const char *env_get(char *const *envp, const char *name)
{
    size_t n = strlen(name);
    for (char *const *e = envp; e && *e; e++)
        if (!strncmp(*e, name, n) && (*e)[n] == '=') return *e + n + 1;
    return NULL;
}

/* An integer in [lo, hi] from variable `name`; *found = 0 when unset or empty. */
static td_status env_int(char *const *envp, const char *name, long lo, long hi, const char *launcher,
                         long *out, int *found)
{
    const char *v = env_get(envp, name);
    *found = v && *v;
    if (!*found) return TD_OK;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || *end || end == v || x < lo || x > hi)
        return td_error_set(TD_ERR_INVALID, "%s='%s' (set by %s) is not an integer in [%ld, %ld]", name, v,
                            launcher, lo, hi);
    *out = x;
    return TD_OK;
}

typedef struct launcher_vars {
    const char *name;
    const char *rank, *size, *local_rank, *local_size;
} launcher_vars;

static const launcher_vars launchers[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", NULL},
    /* MPICH and Intel MPI (Hydra's mpiexec); after Slurm, whose srun can set PMI_RANK too */
    {"mpiexec", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
};

/* Rank, size, local rank and local size of launcher L, checked against each other. */
static td_status read_ranks(char *const *envp, const launcher_vars *L, td_dist_env *out)
{
    long rank = 0, size = 1, lrank = 0, lsize = 0;
    int has_rank, has_size, has_lrank, has_lsize = 0;
    td_status st;
    if ((st = env_int(envp, L->rank, 0, INT_MAX, L->name, &rank, &has_rank))) return st;
    if ((st = env_int(envp, L->size, 1, INT_MAX, L->name, &size, &has_size))) return st;
    if ((st = env_int(envp, L->local_rank, 0, INT_MAX, L->name, &lrank, &has_lrank))) return st;
    if (L->local_size && (st = env_int(envp, L->local_size, 1, INT_MAX, L->name, &lsize, &has_lsize))) return st;
    if (!has_rank || !has_size)
        return td_error_set(TD_ERR_INVALID, "%s is set but %s is not: %s sets both; set them together", 
                            has_rank ? L->rank : L->size, has_rank ? L->size : L->rank, L->name);
    if (rank >= size)
        return td_error_set(TD_ERR_INVALID, "%s=%ld is not below %s=%ld (%s): ranks run from 0 to size - 1",
                            L->rank, rank, L->size, size, L->name);
    if (!has_lrank) lrank = has_lsize ? rank % lsize : rank; /* one host unless told otherwise */
    if (lrank >= size)
        return td_error_set(TD_ERR_INVALID, "%s=%ld is not below %s=%ld (%s): a host cannot run more ranks than the job",
                            L->local_rank, lrank, L->size, size, L->name);
    if (has_lsize && (lsize > size || lrank >= lsize))
        return td_error_set(TD_ERR_INVALID, "%s=%ld with %s=%ld and %s=%ld (%s): the local rank must be below the "
                            "local size, and the local size at most the world size",
                            L->local_rank, lrank, L->local_size, lsize, L->size, size, L->name);
    out->rank = (int)rank;
    out->size = (int)size;
    out->local_rank = (int)lrank;
    out->local_size = (int)lsize;
    snprintf(out->launcher, sizeof out->launcher, "%s", L->name);
    return TD_OK;
}

static td_status set_addr(td_dist_env *out, const char *addr, const char *from)
{
    if (!*addr) return td_error_set(TD_ERR_INVALID, "%s is empty", from);
    if (strlen(addr) >= sizeof out->master_addr)
        return td_error_set(TD_ERR_INVALID, "%s is longer than %zu characters", from, sizeof out->master_addr - 1);
    snprintf(out->master_addr, sizeof out->master_addr, "%s", addr);
    return TD_OK;
}

td_status td_dist_env_parse(char *const *envp, td_dist_env *out)
{
    td_status st;
    memset(out, 0, sizeof *out);
    out->size = 1;
    out->node_rank = -1;
    snprintf(out->launcher, sizeof out->launcher, "none");
    snprintf(out->master_addr, sizeof out->master_addr, "127.0.0.1");
    out->master_port = 29500;
    const launcher_vars *L = NULL;
    for (size_t i = 0; i < sizeof launchers / sizeof launchers[0] && !L; i++) {
        const char *r = env_get(envp, launchers[i].rank), *s = env_get(envp, launchers[i].size);
        if ((r && *r) || (s && *s)) L = &launchers[i];
    }
    if (L && (st = read_ranks(envp, L, out))) return st;
    /* the host's index, where the launcher says (a host's ranks share it) */
    const char *node_var = L && !strcmp(L->name, "torchrun") ? "GROUP_RANK" : L && !strcmp(L->name, "slurm") ? "SLURM_NODEID" : NULL;
    long node = -1;
    int has_node = 0;
    if (node_var && (st = env_int(envp, node_var, 0, INT_MAX, L->name, &node, &has_node))) return st;
    out->node_rank = has_node ? (int)node : -1;

    const char *addr = env_get(envp, "MASTER_ADDR");
    long port = 0;
    int has_port = 0, found;
    if ((st = env_int(envp, "MASTER_PORT", 1, 65535, L ? L->name : "the environment", &port, &has_port))) return st;
    if (addr && *addr) {
        if ((st = set_addr(out, addr, "MASTER_ADDR"))) return st;
    } else if (L && !strcmp(L->name, "slurm")) {
        const char *from = "SLURM_STEP_NODELIST", *list = env_get(envp, from);
        if (!list || !*list) list = env_get(envp, from = "SLURM_JOB_NODELIST");
        if (list && *list) {
            if ((st = td_dist_nodelist_host(list, 0, out->master_addr, sizeof out->master_addr)))
                return td_error_prefix(st, "%s='%s': ", from, list);
        } else if (out->size > 1) {
            return td_error_set(TD_ERR_INVALID, "slurm: neither MASTER_ADDR nor SLURM_STEP_NODELIST is set; "
                                "set MASTER_ADDR to rank 0's host");
        }
    } else if (L && out->size > 1 && !(out->local_size == out->size)) {
        /* torchrun always sets it; mpirun over several hosts needs it */
        return td_error_set(TD_ERR_INVALID, "%s: MASTER_ADDR is not set and the %d ranks may span hosts; set "
                            "MASTER_ADDR (and MASTER_PORT) to where rank 0 runs", L->name, out->size);
    }
    if (has_port) {
        out->master_port = (int)port;
    } else if (L && !strcmp(L->name, "slurm")) {
        long job = 0;
        if ((st = env_int(envp, "SLURM_JOB_ID", 0, LONG_MAX, "slurm", &job, &found))) return st;
        if (found) out->master_port = 20000 + (int)(job % 10000);
    } else if (L && !strcmp(L->name, "torchrun") && out->size > 1) {
        return td_error_set(TD_ERR_INVALID, "torchrun: MASTER_PORT is not set (torchrun sets it; set it with RANK "
                            "and WORLD_SIZE when launching by hand)");
    }
    const char *agent = env_get(envp, "TORCHELASTIC_USE_AGENT_STORE");
    if (L && !strcmp(L->name, "torchrun") && agent && !strcasecmp(agent, "true")) {
        if (out->master_port == 65535)
            return td_error_set(TD_ERR_INVALID, "MASTER_PORT=65535 is torchrun's store; tidal's rendezvous needs the "
                                "port above it: set TD_RDV_PORT");
        out->master_port++; /* torchrun's agent holds MASTER_PORT itself */
    }
    if ((st = env_int(envp, "TD_RDV_PORT", 1, 65535, "the user", &port, &found))) return st;
    if (found) out->master_port = (int)port;
    return TD_OK;
}

td_status td_dist_env_read(td_dist_env *out)
{
    return td_dist_env_parse(environ, out);
}

/* --- Slurm host lists ------------------------------------------------------------ */

/* Walks the list; calls back host i into buf when i == want.  *count = hosts. */
static td_status nodelist_walk(const char *list, int want, char *buf, size_t buf_bytes, int *count)
{
    int n = 0;
    const char *p = list;
    if (!list || !*list) return td_error_set(TD_ERR_INVALID, "the host list is empty");
    while (*p) {
        const char *prefix = p;
        while (*p && *p != ',' && *p != '[') p++;
        size_t plen = (size_t)(p - prefix);
        if (*p != '[') { /* a plain host */
            if (!plen) return td_error_set(TD_ERR_INVALID, "an empty host name in '%s'", list);
            if (n == want && snprintf(buf, buf_bytes, "%.*s", (int)plen, prefix) >= (int)buf_bytes)
                return td_error_set(TD_ERR_INVALID, "host name longer than %zu characters", buf_bytes - 1);
            n++;
        } else { /* prefix[a-b,c,...]suffix is not used by Slurm; the range list ends the name */
            if (!plen) return td_error_set(TD_ERR_INVALID, "a range without a host name before '[' in '%s'", list);
            p++;
            for (;;) {
                const char *a = p;
                while (isdigit((unsigned char)*p)) p++;
                size_t width = (size_t)(p - a);
                if (!width || width > 9) return td_error_set(TD_ERR_INVALID, "a bad number at '%.20s' in '%s'", a, list);
                long lo = strtol(a, NULL, 10), hi = lo;
                if (*p == '-') {
                    const char *b = ++p;
                    while (isdigit((unsigned char)*p)) p++;
                    if (p == b || p - b > 9) return td_error_set(TD_ERR_INVALID, "a bad range end at '%.20s' in '%s'", b, list);
                    hi = strtol(b, NULL, 10);
                    if (hi < lo) return td_error_set(TD_ERR_INVALID, "a range %ld-%ld that runs backwards in '%s'", lo, hi, list);
                    if (hi - lo > 1000000) return td_error_set(TD_ERR_INVALID, "a range of more than a million hosts in '%s'", list);
                }
                for (long x = lo; x <= hi; x++, n++) {
                    if (n == want && snprintf(buf, buf_bytes, "%.*s%0*ld", (int)plen, prefix, (int)width, x) >= (int)buf_bytes)
                        return td_error_set(TD_ERR_INVALID, "host name longer than %zu characters", buf_bytes - 1);
                }
                if (*p == ',') { p++; continue; }
                if (*p == ']') { p++; break; }
                return td_error_set(TD_ERR_INVALID, "'%s' has an unclosed '[' or a stray character", list);
            }
            if (*p && *p != ',')
                return td_error_set(TD_ERR_INVALID, "text after ']' in '%s' (expected ',' or the end)", list);
        }
        if (*p == ',') {
            p++;
            if (!*p) return td_error_set(TD_ERR_INVALID, "'%s' ends with ','", list);
        }
    }
    *count = n;
    return TD_OK;
}

td_status td_dist_nodelist_count(const char *nodelist, int *count)
{
    char dummy[2];
    return nodelist_walk(nodelist, -1, dummy, sizeof dummy, count);
}

td_status td_dist_nodelist_host(const char *nodelist, int i, char *buf, size_t buf_bytes)
{
    int n = 0;
    if (buf_bytes) buf[0] = '\0';
    td_status st = nodelist_walk(nodelist, i, buf, buf_bytes, &n);
    if (st) return st;
    if (i < 0 || i >= n) return td_error_set(TD_ERR_INVALID, "host %d of '%s', which lists %d", i, nodelist, n);
    return TD_OK;
}
