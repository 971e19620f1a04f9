/* The `tidal` command's subcommands.  Each takes the arguments after its
 * name and returns a process exit code (0 ok, 1 runtime error, 2 usage). */
#ifndef TIDAL_CLI_H
#define TIDAL_CLI_H

#include "tidal/trainer.h"

#include <stdio.h>

struct cJSON;

int td_cli_memsim_main(int argc, char **argv);
int td_cli_train_main(int argc, char **argv);
int td_cli_plan_main(int argc, char **argv);
int td_cli_eval_main(int argc, char **argv);
int td_cli_merge_main(int argc, char **argv);
int td_cli_generate_main(int argc, char **argv);
int td_cli_prepare_main(int argc, char **argv);

int td_cli_tune_main(int argc, char **argv);

/* `tidal plan`'s disk tier (cli_disk.c): the "disk" member of --json, the
 * table's disk section and its lines of the step estimate.  hide_accum:
 * td_train_disk_hiding_accum's answer at TD_CLI_DISK_HIDE_WITHIN, with the
 * bound there (hide; may be NULL). */
#define TD_CLI_DISK_HIDE_WITHIN 0.10
struct cJSON *td_cli_plan_disk_json(const td_train_config *cfg, const td_train_plan *p, const td_train_rates *r,
                                    const td_train_bound *bd, int hide_accum, const td_train_bound *hide);
void td_cli_plan_disk_text(FILE *f, const td_train_config *cfg, const td_train_plan *p, const td_train_rates *r);
void td_cli_plan_disk_estimate(FILE *f, const td_train_config *cfg, const td_train_plan *p, const td_train_bound *bd,
                               int hide_accum, const td_train_bound *hide);

/* The benchmarks, run as `tidal bench <name>` (their code is in bench/). */
int td_bench_copy_main(int argc, char **argv);
int td_bench_adam_main(int argc, char **argv);
int td_bench_comm_main(int argc, char **argv);
int td_bench_scaling_main(int argc, char **argv);
int td_bench_disk_main(int argc, char **argv);
#ifdef TD_HAVE_CUDA
int td_bench_ops_main(int argc, char **argv); /* bench_ops_cuda.c */
int td_bench_attention_main(int argc, char **argv); /* bench_kernels_cuda.c */
int td_bench_head_main(int argc, char **argv);      /* bench_kernels_cuda.c */
#endif

/* Whether `--nproc N` launches ranks (cli_launch.c): N other than 1, or
 * NNODES in the environment other than 1 (several hosts, one rank each; a
 * bad NNODES the launch refuses by name). */
int td_cli_launch_wanted(int nproc);
/* `tidal <prefix...> <args without --nproc>` as nproc local ranks of one job
 * (cli_launch.c); returns the exit code for main: 0, the first failed rank's,
 * or 2 on a bad --nproc.  `what` names the command in messages. */
int td_cli_launch_self(const char *what, int nproc, const char *const *prefix, int argc, char **argv);

#endif
