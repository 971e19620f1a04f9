/* The `tidal` command's subcommands.  Each takes the arguments after its
 * name and returns a process exit code (0 ok, 1 runtime error, 2 usage). */
#ifndef TIDAL_CLI_H
#define TIDAL_CLI_H

int td_cli_memsim_main(int argc, char **argv);
int td_cli_train_main(int argc, char **argv);
int td_cli_plan_main(int argc, char **argv);
int td_cli_eval_main(int argc, char **argv);
int td_cli_generate_main(int argc, char **argv);
int td_cli_prepare_main(int argc, char **argv);

/* The benchmarks, run as `tidal bench <name>` (their code is in bench/). */
int td_bench_copy_main(int argc, char **argv);
int td_bench_adam_main(int argc, char **argv);
int td_bench_comm_main(int argc, char **argv);
#ifdef TD_HAVE_CUDA
int td_bench_ops_main(int argc, char **argv); /* bench_ops_cuda.c */
#endif

/* `tidal <prefix...> <args without --nproc>` as nproc local ranks of one job
 * (cli_launch.c); returns the exit code for main: 0, the first failed rank's,
 * or 2 on a bad --nproc.  `what` names the command in messages. */
int td_cli_launch_self(const char *what, int nproc, const char *const *prefix, int argc, char **argv);

#endif
