/* libFuzzer target: a Hugging Face GPT-2 directory as tidal's checkpoint
 * reader opens it (checkpoint/checkpoint.c): config.json, the sharded
 * weights' model.safetensors.index.json and the weights themselves.
 *
 * One input holds three parts cut at "\1\1": config.json,
 * model.safetensors.index.json, and a safetensors file.  They are written to
 * a scratch directory; the safetensors file is model.safetensors when the
 * index part is empty, else shard.safetensors (the name the seeds' index
 * uses).  The directory is opened without and with an expected model shape
 * (the --resume/--init path that checks config.json against the flags).  An
 * accepted directory must hand out every parameter whole in tidal's layout. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz_util.h"
#include "tidal/checkpoint.h"

/* Larger parameters are not read back (the fuzzer's files are small; a large
 * numel comes from a padded vocabulary in config.json). */
#define READ_MAX_NUMEL ((uint64_t)1 << 18)

static void read_all(const td_ckpt_reader *r)
{
    const td_model_desc *cfg = td_ckpt_reader_config(r);
    FUZZ_CHECK(td_model_desc_check(cfg) == TD_OK);
    const int n = td_model_hf_count(cfg);
    for (int i = 0; i < n; i++) {
        td_model_hf_tensor p;
        FUZZ_CHECK(td_model_hf_get(cfg, i, &p) == TD_OK);
        if (p.numel > READ_MAX_NUMEL) continue;
        float *w = malloc((size_t)p.numel * sizeof *w + 1);
        FUZZ_CHECK(w);
        FUZZ_CHECK(td_ckpt_reader_get_weight(r, i, TD_DTYPE_F32, w) == TD_OK);
        free(w);
    }
    FUZZ_CHECK(td_ckpt_reader_get_weight(r, n, TD_DTYPE_F32, NULL) != TD_OK);
}

static void try_open(const char *dir, const td_model_desc *expect)
{
    td_ckpt_reader *r = NULL;
    if (td_ckpt_reader_open(dir, expect, &r) == TD_OK) {
        read_all(r);
        td_ckpt_reader_close(r);
    } else {
        FUZZ_CHECK(r == NULL && td_error_msg()[0]);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const size_t live = td_host_live_allocs();
    const uint8_t *config, *index, *weights;
    size_t config_len, index_len, weights_len;
    fuzz_split(&data, &size, "\1\1", &config, &config_len);
    fuzz_split(&data, &size, "\1\1", &index, &index_len);
    weights = data;
    weights_len = size;

    char path[512], dir[512];
    fuzz_path(dir, sizeof dir, "ckpt");
    mkdir(dir, 0777);
    static const char *const files[] = {"ckpt/config.json", "ckpt/model.safetensors.index.json",
                                        "ckpt/model.safetensors", "ckpt/shard.safetensors"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) fuzz_unlink(files[i]);
    if (config_len) fuzz_write(path, sizeof path, files[0], config, config_len);
    if (index_len) fuzz_write(path, sizeof path, files[1], index, index_len);
    if (weights_len) fuzz_write(path, sizeof path, index_len ? files[3] : files[2], weights, weights_len);

    try_open(dir, NULL);
    const td_model_desc expect = {.n_layer = 1, .n_head = 1, .n_embd = 4, .n_positions = 4, .vocab_size = 8,
                                   .padded_vocab_size = 16};
    try_open(dir, &expect);
    FUZZ_CHECK(td_host_live_allocs() == live);
    return 0;
}
