/* Command-line options from one table: flags, their help, and the same keys
 * in a JSON config file (--config FILE; the command line wins).  Used by the
 * `tidal` subcommands. */
#ifndef TIDAL_ARGS_H
#define TIDAL_ARGS_H

#include <stddef.h>
#include <stdio.h>

#include "tidal/status.h"

typedef enum td_opt_kind {
    TD_OPT_FLAG,    /* int, set to 1 */
    TD_OPT_INT,     /* int */
    TD_OPT_LONG,    /* long */
    TD_OPT_U64,     /* uint64_t */
    TD_OPT_DOUBLE,  /* double */
    TD_OPT_SIZE,    /* size_t, with units (512MiB) */
    TD_OPT_BUDGET,  /* size_t, with units, or "max": TD_GPU_BUDGET_MAX (trainer.h) */
    TD_OPT_STRING,  /* const char * (points into argv or the config) */
    TD_OPT_LIST,    /* td_opt_list: each occurrence adds one (a config gives a string or an array of them);
                       the command line's replace the config's */
} td_opt_kind;

#define TD_OPT_LIST_MAX 16
typedef struct td_opt_list {
    const char *v[TD_OPT_LIST_MAX];  /* point into argv or the config */
    int n;
} td_opt_list;

typedef struct td_opt {
    const char *name;  /* without "--" */
    td_opt_kind kind;
    void *dst;
    const char *arg;   /* "N", "SIZE", ... for help */
    const char *help;
    int seen;          /* set when given */
} td_opt;

/* Parses argv against opts (a table ending with a NULL name).  "--help"
 * prints the usage and returns 1 in *help; "--config FILE" reads JSON keys
 * first.  Errors name the option and what was expected. */
td_status td_args_parse(td_opt *opts, int argc, char **argv, int *help);
void td_args_usage(FILE *f, const char *usage, const td_opt *opts);
/* A subcommand's whole option step: parses argv against opts; after --help
 * prints `usage` and the table to stdout and returns 0; after a bad option
 * prints "tidal CMD: message" and where the options are listed to stderr and
 * returns 2; otherwise returns -1: go on.  `cmd` is what the user typed
 * after "tidal" ("eval", "bench copy").  Call td_args_free at the end. */
int td_args_main(td_opt *opts, int argc, char **argv, const char *cmd, const char *usage);
/* TD_OK when every named option (a NULL-terminated list) was given, else
 * TD_ERR_INVALID: "--trace FILE is required". */
td_status td_args_require(const td_opt *opts, ...);
/* The option of that name, NULL if none (to ask whether it was given). */
td_opt *td_args_find(td_opt *opts, const char *name);
/* Prints a JSON document on one line of stdout and frees it (NULL: out of
 * memory while it was built).  Every JSON tidal prints goes through cJSON. */
struct cJSON;
td_status td_cli_print_json(struct cJSON *doc);
/* Frees the config file text that string options may point into. */
void td_args_free(void);

/* Help text from the model families' registry (model.h), so that a new
 * family shows in every command's help without an edit here:
 * "Gemma, GPT-2, LLaMA or Qwen2", and the presets family by family
 * ("GPT-2: tiny (default), gpt2-124m, ...; LLaMA: ..."), wrapped for
 * td_args_usage, `default_preset` marked.  Built once; the CLI's thread. */
const char *td_cli_family_titles(void);
const char *td_cli_presets_help(const char *default_preset);

#endif
