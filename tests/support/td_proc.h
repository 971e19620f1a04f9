/* Child processes of the tidal command for the tests that run it as a user
 * would (several ranks, launchers, faults): start one with its output in a
 * file (optionally with torchrun's variables for one rank), wait for it with
 * a deadline, read its output and its --log. */
#ifndef TD_PROC_H
#define TD_PROC_H

#include <sys/types.h>

/* Seconds on the monotonic clock. */
double td_proc_now_s(void);
/* Starts `sh -c "exec CMD"` with stdout and stderr into `out`; with rank >= 0
 * also the variables torchrun gives rank `rank` of `size` at port `port`
 * (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
 * Every launcher variable of the test's own environment is cleared first. */
pid_t td_proc_start(const char *out, int rank, int size, int port, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Waits for pid at most `limit_s`; its exit status (128 + signal when
 * killed); on the deadline it is killed and the test fails naming `what`. */
int td_proc_finish(pid_t pid, double limit_s, const char *what);
/* Runs the command (td_proc_start, stdout and stderr into DIR/NAME.out) to
 * its end, at most 300 s; returns its exit status, with its output in *out
 * (td_proc_slurp's buffer). */
int td_proc_run(const char *dir, const char *name, const char **out, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* A file's first 64 KiB as a string, in a static buffer ("" if unreadable). */
char *td_proc_slurp(const char *path);
/* The per-step losses (and grad norms, when `norm`) of a --log file;
 * returns how many steps it holds (at most `max`). */
int td_proc_read_log(const char *path, double *loss, double *norm, int max);
/* Fails the test unless every got[i] is within `rel` of want[i], relatively;
 * returns the largest relative difference seen. */
double td_proc_expect_close(const double *want, const double *got, int n, double rel, const char *what);
/* A fresh directory /tmp/<prefix>-XXXXXX into dir (at least 64 bytes): 0, or -1. */
int td_proc_tmpdir(char *dir, size_t dir_bytes, const char *prefix);
/* DIR/NAME.tok: `tidal prepare` (the command tidal) of what the shell
 * command text_cmd prints, kept in DIR/NAME.txt; prepare's output appended
 * to DIR/prepare.out.  0, or -1. */
int td_proc_prepare(const char *tidal, const char *dir, const char *text_cmd, const char *name);
/* `rm -rf dir`: 0, or -1. */
int td_proc_rmdir(const char *dir);
/* GPUs that `nvidia-smi -L` lists, no more than CUDA_VISIBLE_DEVICES names
 * (at most 8; 0 without a driver). */
int td_proc_gpu_count(void);

#endif
