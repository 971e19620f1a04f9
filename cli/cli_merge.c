/* `tidal merge`: a LoRA adapter folder (PEFT's, as `tidal train
 * --lora-rank ... --save` writes it) merged into its base model: a Hugging
 * Face checkpoint whose targeted weights are W + (alpha / r) B A. */
#include "args.h"
#include "cli.h"
#include "train_opts.h"
#include "tidal/trainer.h"

#include <stdio.h>
#include <string.h>

static const char usage_text[] =
    "usage: tidal merge --adapter DIR --out DIR2 [--base DIR]\n\n"
    "Writes the model of a LoRA adapter folder (adapter_config.json, adapter_model.safetensors:\n"
    "`tidal train --lora-rank R --save DIR`, or peft's save_pretrained) merged into its base:\n"
    "a Hugging Face checkpoint in DIR2 whose targeted weights are W + (lora_alpha / r) B A,\n"
    "which transformers and `tidal eval` load.  The base is the folder's\n"
    "base_model_name_or_path unless --base names it.  Runs on the CPU.\n"
    "Exit status: 0 done, 2 a usage error, 1 a failure.";

static td_status merge(const char *adapter, const char *base_opt, const char *out, int threads)
{
    char base[4096], targets[512];
    td_train_config c = td_train_default_config();
    int found = 0;
    td_status st = td_cli_adapter_model(adapter, base_opt, &c.model, base, sizeof base, &found);
    if (st) return st;
    if (!found)
        return td_error_set(TD_ERR_INVALID, "--adapter %s holds no adapter_config.json: give a LoRA adapter folder",
                            adapter);
    td_model_lora_modules(&c.model, targets, sizeof targets);
    const int rank = c.model.lora.rank;
    const double alpha = c.model.lora.alpha;
    c.micro_batch = 1;
    c.seq_len = 1;
    c.backend = TD_BACKEND_CPU;
    c.ckpt = TD_CKPT_OFF;
    c.threads = threads;
    td_trainer *t = NULL;
    if ((st = td_trainer_create(&c, &t))) return st;
    if (!(st = td_trainer_load(t, base, 0, NULL)) && !(st = td_trainer_load_adapter(t, adapter, 0)))
        st = td_trainer_save_merged(t, out);
    td_trainer_destroy(t);
    if (!st) fprintf(stderr, "tidal merge: %s over %s (rank %d, alpha %g: %s) -> %s\n", adapter, base, rank, alpha,
                     targets, out);
    return st;
}

int td_cli_merge_main(int argc, char **argv)
{
    const char *adapter = NULL, *out = NULL, *base = NULL;
    int threads = 0;
    td_opt opts[] = {
        {"adapter", TD_OPT_STRING, &adapter, "DIR", "the LoRA adapter folder", 0},
        {"out", TD_OPT_STRING, &out, "DIR2", "where the merged checkpoint goes (replaced atomically)", 0},
        {"base", TD_OPT_STRING, &base, "DIR", "the base model's folder (default: the adapter's base_model_name_or_path)", 0},
        {"threads", TD_OPT_INT, &threads, "N", "CPU threads (default: the cores this process may run on)", 0},
        {NULL, 0, NULL, NULL, NULL, 0},
    };
    int rc = td_args_main(opts, argc, argv, "merge", usage_text);
    if (rc >= 0) return rc;
    td_status st = td_args_require(opts, "adapter", "out", NULL);
    if (!st && threads < 0) st = td_error_set(TD_ERR_INVALID, "--threads %d: give a count of threads", threads);
    if (st) {
        fprintf(stderr, "tidal merge: %s\n(tidal merge --help lists the options)\n", td_error_msg());
        td_args_free();
        return 2;
    }
    st = merge(adapter, base, out, threads);
    td_args_free();
    if (!st) return 0;
    fprintf(stderr, "tidal merge: %s\n", td_error_msg());
    return st == TD_ERR_INVALID ? 2 : 1;
}
