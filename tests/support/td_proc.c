/* Child processes of the tidal command for the tests (td_proc.h). */
#include "td_proc.h"
#include "td_test.h"

#include <math.h>
#include <stdarg.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

double td_proc_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

pid_t td_proc_start(const char *out, int rank, int size, int port, const char *fmt, ...)
{
    char cmd[3072];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char full[3400];
    snprintf(full, sizeof full, "exec %s > %s 2>&1", cmd, out);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        static const char *const launcher[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                               "TORCHELASTIC_USE_AGENT_STORE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"};
        for (size_t i = 0; i < sizeof launcher / sizeof launcher[0]; i++) unsetenv(launcher[i]);
        if (rank >= 0) {
            char v[32];
            snprintf(v, sizeof v, "%d", rank);
            setenv("RANK", v, 1);
            setenv("LOCAL_RANK", v, 1);
            snprintf(v, sizeof v, "%d", size);
            setenv("WORLD_SIZE", v, 1);
            setenv("LOCAL_WORLD_SIZE", v, 1);
            setenv("MASTER_ADDR", "127.0.0.1", 1);
            snprintf(v, sizeof v, "%d", port);
            setenv("MASTER_PORT", v, 1);
        }
        execl("/bin/sh", "sh", "-c", full, (char *)NULL);
        _exit(127);
    }
    return pid;
}

int td_proc_finish(pid_t pid, double limit_s, const char *what)
{
    double t0 = td_proc_now_s();
    int status;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) break;
        if (td_proc_now_s() - t0 > limit_s) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            fail_msg("%s still running after %.0f s", what, limit_s);
        }
        usleep(20000);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int td_proc_run(const char *dir, const char *name, const char **out, const char *fmt, ...)
{
    char cmd[2048], path[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    snprintf(path, sizeof path, "%s/%s.out", dir, name);
    pid_t p = td_proc_start(path, -1, 0, 0, "%s", cmd);
    int rc = td_proc_finish(p, 300, name);
    *out = td_proc_slurp(path);
    return rc;
}

char *td_proc_slurp(const char *path)
{
    static char buf[1 << 16];
    FILE *f = fopen(path, "r");
    buf[0] = '\0';
    if (!f) return buf;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

int td_proc_read_log(const char *path, double *loss, double *norm, int max)
{
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[8192];
    int n = 0;
    while (n < max && fgets(line, sizeof line, f)) {
        char *l = strstr(line, "\"loss\":"), *g = strstr(line, "\"grad_norm\":");
        if (!l || !g) continue;
        loss[n] = strtod(l + 7, NULL);
        if (norm) norm[n] = strtod(g + 12, NULL);
        n++;
    }
    fclose(f);
    return n;
}

double td_proc_expect_close(const double *want, const double *got, int n, double rel, const char *what)
{
    double worst = 0;
    for (int i = 0; i < n; i++) {
        double d = fabs(got[i] - want[i]) / fabs(want[i]);
        if (!(d <= rel))
            fail_msg("%s: step %d: %.9g against %.9g (relative %.3g > %.0e)", what, i + 1, got[i], want[i], d, rel);
        if (d > worst) worst = d;
    }
    return worst;
}

int td_proc_tmpdir(char *dir, size_t dir_bytes, const char *prefix)
{
    snprintf(dir, dir_bytes, "/tmp/%s-XXXXXX", prefix);
    return mkdtemp(dir) ? 0 : -1;
}

int td_proc_prepare(const char *tidal, const char *dir, const char *text_cmd, const char *name)
{
    char cmd[2048];
    int n = snprintf(cmd, sizeof cmd, "(%s) > '%s/%s.txt' && '%s' prepare --quiet --input '%s/%s.txt' --out '%s/%s.tok' "
                     ">> '%s/prepare.out' 2>&1", text_cmd, dir, name, tidal, dir, name, dir, name, dir);
    return n > 0 && (size_t)n < sizeof cmd && system(cmd) == 0 ? 0 : -1;
}

int td_proc_rmdir(const char *dir)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? 0 : -1;
}

int td_proc_gpu_count(void)
{
    FILE *p = popen("nvidia-smi -L 2>/dev/null", "r");
    if (!p) return 0;
    char line[512];
    int n = 0;
    while (fgets(line, sizeof line, p))
        if (!strncmp(line, "GPU ", 4)) n++;
    if (pclose(p) != 0) return 0;
    /* CUDA_VISIBLE_DEVICES narrows what a process sees: its entries up to
     * the first that names none (CUDA stops there), at most the listed. */
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    if (vis) {
        int seen = 0;
        for (const char *q = vis; *q;) {
            size_t len = strcspn(q, ",");
            if (!len || *q == '-') break;
            seen++;
            q += len;
            if (*q == ',') q++;
        }
        if (seen < n) n = seen;
    }
    return n > 8 ? 8 : n;
}
