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

/* `tidal <prefix...> <args without --nproc>` as nproc local ranks of one job
 * (cli_launch.c); returns the exit code for main: 0, the first failed rank's,
 * or 2 on a bad --nproc.  `what` names the command in messages. */
int td_cli_launch_self(const char *what, int nproc, const char *const *prefix, int argc, char **argv);

#endif
