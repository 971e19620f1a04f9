/* libFuzzer target: the --config JSON file of `tidal train` (and of every
 * subcommand: cli/args.c reads it for all of them).
 *
 * The input is the config file.  It is parsed against a table with the
 * option names and kinds of `tidal train` (the table itself is static in
 * cli/cli_train.c; the parser only sees names and kinds), one option of each
 * kind the parser knows.  An accepted file must leave every string option
 * pointing at a readable C string until td_args_free, and a flag given on the
 * command line must win over the file.  Nothing may leak. */
#include <stdint.h>
#include <string.h>

#include "../../cli/args.h"
#include "fuzz_util.h"

typedef struct opts {
    const char *model, *data, *ckpt, *backend;
    int seq, layers, verbose;
    long steps, save_every;
    uint64_t seed;
    double lr, heldout;
    size_t gpu_budget, host_pin_limit;
} opts;

static void table_init(td_opt *t, opts *o)
{
    memset(o, 0, sizeof *o);
    const td_opt tab[] = {
        {"model", TD_OPT_STRING, &o->model, "PRESET", "", 0},
        {"data", TD_OPT_STRING, &o->data, "FILE", "", 0},
        {"ckpt", TD_OPT_STRING, &o->ckpt, "M", "", 0},
        {"backend", TD_OPT_STRING, &o->backend, "B", "", 0},
        {"seq", TD_OPT_INT, &o->seq, "T", "", 0},
        {"layers", TD_OPT_INT, &o->layers, "L", "", 0},
        {"verbose", TD_OPT_FLAG, &o->verbose, NULL, "", 0},
        {"steps", TD_OPT_LONG, &o->steps, "N", "", 0},
        {"save-every", TD_OPT_LONG, &o->save_every, "N", "", 0},
        {"seed", TD_OPT_U64, &o->seed, "S", "", 0},
        {"lr", TD_OPT_DOUBLE, &o->lr, "X", "", 0},
        {"heldout", TD_OPT_DOUBLE, &o->heldout, "PCT", "", 0},
        {"gpu-budget", TD_OPT_BUDGET, &o->gpu_budget, "SIZE", "", 0},
        {"host-pin-limit", TD_OPT_SIZE, &o->host_pin_limit, "SIZE", "", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    memcpy(t, tab, sizeof tab);
}
#define TABLE_LEN 15

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const size_t live = td_host_live_allocs();
    char path[512];
    fuzz_write(path, sizeof path, "train.json", data, size);
    td_opt table[TABLE_LEN];
    opts o;
    table_init(table, &o);
    int help = 0;
    char *argv[] = {"--config", path, NULL, NULL};
    td_status st = td_args_parse(table, 2, argv, &help);
    FUZZ_CHECK(!help);
    if (st == TD_OK) {
        const char *strs[] = {o.model, o.data, o.ckpt, o.backend};
        for (int i = 0; i < 4; i++)
            if (strs[i]) FUZZ_CHECK(strlen(strs[i]) < size + 64);
        /* The command line wins over the file. */
        table_init(table, &o);
        char seq[] = "--seq=7", ckpt[] = "--ckpt=off";
        char *argv2[] = {"--config", path, seq, ckpt};
        FUZZ_CHECK(td_args_parse(table, 4, argv2, &help) == TD_OK);
        FUZZ_CHECK(o.seq == 7 && o.ckpt && !strcmp(o.ckpt, "off"));
    } else {
        FUZZ_CHECK(td_error_msg()[0]);
    }
    td_args_free();
    FUZZ_CHECK(td_host_live_allocs() == live);
    return 0;
}
