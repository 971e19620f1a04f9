/* Entry points of the benchmark programs, run as `tidal bench <name>`.
 * Each takes the arguments after its name and returns a process exit code. */
#ifndef TIDAL_BENCH_H
#define TIDAL_BENCH_H

int td_bench_copy_main(int argc, char **argv);
int td_bench_adam_main(int argc, char **argv);
int td_bench_comm_main(int argc, char **argv);
#ifdef TD_HAVE_CUDA
int td_bench_ops_main(int argc, char **argv); /* bench_ops_cuda.c */
#endif

#endif
