/* The CPU threads a run takes when --threads is not given: the cores this
 * process may run on that no other process keeps busy (see
 * td_train_default_threads in trainer.h).
 *
 * Why not all of them: the model's ops and the CPU AdamW run as OpenMP
 * teams that meet at a barrier after every op.  On a host whose cores are
 * busy with other work, a team as large as the core count waits at each
 * barrier for its last thread to be scheduled again, while the others spin
 * (OpenMP's default wait policy) and take the very cores it waits for:
 * 600 steps of the demo's model on a busy 2-core machine ran 4.8 times
 * slower on 2 threads than on 1.  A team no larger than the idle cores
 * meets at its barriers at once. */
#include "train_impl.h"

#include <omp.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Busy and total jiffies of all CPUs from /proc/stat's first line. */
static int cpu_times(unsigned long long *busy, unsigned long long *total)
{
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return -1;
    unsigned long long v[8] = {0};
    int n = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
                   &v[7]);
    fclose(f);
    if (n < 4) return -1;
    *total = 0;
    for (int i = 0; i < 8; i++) *total += v[i];
    *busy = *total - v[3] - v[4]; /* less idle and iowait */
    return 0;
}

/* Cores other processes leave idle, measured over `ms` milliseconds (the
 * online CPUs' idle share; -1 when /proc/stat cannot be read). */
static double idle_cpus(int ms)
{
    unsigned long long b0, t0, b1, t1;
    if (cpu_times(&b0, &t0)) return -1;
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    if (cpu_times(&b1, &t1) || t1 <= t0) return -1;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    return (double)(online > 0 ? online : 1) * (1.0 - (double)(b1 - b0) / (double)(t1 - t0));
}

int td_train_default_threads(const td_topo *topo, char *why, size_t why_bytes)
{
    static int cached = 0;
    static char reason[160];
    if (!cached) {
        cpu_set_t set;
        int allowed = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : omp_get_num_procs();
        int cores = topo ? td_topo_local_cores(topo) : allowed;
        int n = cores < allowed ? cores : allowed;
        if (n < 1) n = 1;
        double idle = idle_cpus(100);
        int free_cores = idle < 0 ? n : (int)(idle + 0.5);
        cached = free_cores < 1 ? 1 : free_cores < n ? free_cores : n;
        if (cached < n)
            snprintf(reason, sizeof reason, "%d of %d core%s: the rest were busy with other processes (--threads sets the count)",
                     cached, n, n == 1 ? "" : "s");
        else
            snprintf(reason, sizeof reason, "%d core%s, all this process may use", n, n == 1 ? "" : "s");
    }
    if (why && why_bytes) snprintf(why, why_bytes, "%s", reason);
    return cached;
}
