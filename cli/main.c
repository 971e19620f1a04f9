/* The `tidal` command: dispatches to subcommands and benchmarks.
 * Only this file (and tests) may exit the process; the library returns status. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "tidal/backend.h"

typedef struct command {
    const char *name;
    int (*main)(int argc, char **argv);
    const char *help;
} command;

static const command commands[] = {
    {"train", td_cli_train_main, "train a transformer on a token file under a device budget"},
    {"eval", td_cli_eval_main, "mean cross-entropy of a checkpoint on a token file"},
    {"generate", td_cli_generate_main, "sample text from a checkpoint (on the CPU, with a key/value cache)"},
    {"merge", td_cli_merge_main, "merge a LoRA adapter folder into its base: a Hugging Face checkpoint"},
    {"plan", td_cli_plan_main, "print a run's footprint and whether it fits, before starting it"},
    {"tune", td_cli_tune_main, "find the fastest micro-batch, checkpointing and offload for a budget (or several)"},
    {"memsim", td_cli_memsim_main, "simulate a chunk access trace under a budget and policy"},
    {"prepare", td_cli_prepare_main, "tokenize text (byte, GPT-2 BPE or a tokenizer.json) into a token file"},
};

static const command benches[] = {
    {"copy", td_bench_copy_main, "host<->device copy bandwidth: copy engine vs raw pinned copies"},
    {"adam", td_bench_adam_main, "CPU AdamW throughput against the memory-bandwidth bound"},
    {"comm", td_bench_comm_main, "the communicator's collectives across ranks: checked, then timed (--nproc N)"},
    {"scaling", td_bench_scaling_main, "a training run on N ranks against one rank at the same global batch"},
    {"disk", td_bench_disk_main, "direct read/write rates of the drives under --offload-dir DIR ..."},
#ifdef TD_HAVE_CUDA
    {"ops", td_bench_ops_main, "time of each CUDA op of a transformer block at a training shape, beside its roofline"},
    {"attention", td_bench_attention_main, "causal flash attention forward and backward at T, beside its roofline"},
    {"head", td_bench_head_main, "the head and the loss in chunks of rows and in one chunk, beside the roofline"},
#endif
};

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

static void usage(FILE *f)
{
    fprintf(f, "usage: tidal <command> [options]   (tidal <command> --help for its options)\n\n"
               "tidal trains transformer models larger than GPU memory by moving chunks of\n"
               "parameters and optimizer state between pinned host memory and the GPU.\n\n"
               "exit status: 0 success, 1 a failure (named on stderr), 2 a usage error\n"
               "(a bad option or value; nothing was run), 3 `tidal plan`: the run does not fit\n\ncommands:\n");
    for (size_t i = 0; i < COUNT(commands); i++)
        fprintf(f, "  %-14s %s\n", commands[i].name, commands[i].help);
    fprintf(f, "  %-14s %s\n", "bench <name>", "benchmarks:");
    for (size_t i = 0; i < COUNT(benches); i++)
        fprintf(f, "    %-12s %s\n", benches[i].name, benches[i].help);
    fprintf(f, "  %-14s %s\n", "version", "print the version and the backends built in");
}

static int dispatch(const command *table, size_t n, const char *what, int argc, char **argv)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(argv[0], table[i].name)) return table[i].main(argc - 1, argv + 1);
    fprintf(stderr, "tidal: unknown %s '%s'\n\n", what, argv[0]);
    usage(stderr);
    return 2;
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "version") || !strcmp(argv[1], "--version")) {
        printf("tidal 0.1 (backends: cpu%s)\n", td_backend_cuda_compiled() ? ", cuda" : "");
        return 0;
    }
    if (!strcmp(argv[1], "bench")) {
        if (argc >= 3 && (!strcmp(argv[2], "--help") || !strcmp(argv[2], "-h"))) {
            usage(stdout);
            return 0;
        }
        if (argc < 3) {
            fprintf(stderr, "tidal bench: name a benchmark\n\n");
            usage(stderr);
            return 2;
        }
        return dispatch(benches, COUNT(benches), "benchmark", argc - 2, argv + 2);
    }
    return dispatch(commands, COUNT(commands), "command", argc - 1, argv + 1);
}
