/* LLaMA-family checkpoints in the Hugging Face layout (LlamaForCausalLM,
 * Qwen2ForCausalLM): the names, shapes and contents of what the trainer
 * saves (tidal's fused q|k|v and gate|up split into their tensors),
 * config.json out and back in, a save/load round trip that resumes bit for
 * bit, shards with model.safetensors.index.json in and out, and malformed
 * config.json files and weights refused with errors naming the field. */
#include "td_train_test.h"
#include "tidal/checkpoint.h"
#include "tidal/model.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char tmp_root[256];

static int setup_dir(void **state)
{
    snprintf(tmp_root, sizeof tmp_root, "/tmp/td_llckpt_XXXXXX");
    return mkdtemp(tmp_root) ? 0 : -1;
}

static int teardown_dir(void **state)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_root);
    return system(cmd) == 0 ? 0 : -1;
}

static const char *tpath(const char *name)
{
    static char buf[8][512];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", tmp_root, name);
    return buf[k];
}

static void expect_msg(const char *piece)
{
    if (!strstr(td_error_msg(), piece)) fail_msg("message lacks '%s': %s", piece, td_error_msg());
}

static td_train_config config_of(const char *family, int untied, int scaled)
{
    td_train_config c = td_train_default_config();
    c.model = (td_model_desc){ .n_layer = 2, .n_head = 4, .n_embd = 32, .n_positions = 64, .vocab_size = 50,
                                   .padded_vocab_size = 64 };
    td_model_desc_set_family(&c.model, family);
    c.model.n_kv_head = 2;
    c.model.n_inner = 40;
    c.model.norm_eps = !strcmp(family, "qwen2") ? 1e-6f : 1e-5f;
    c.model.rope_theta = !strcmp(family, "qwen2") ? 1000000.0f : 500000.0f;
    c.model.untied_head = untied;
    if (scaled) c.model.rope_scaling = (td_rope_scaling){ 32.0f, 1.0f, 4.0f, 8192 };
    c.micro_batch = 2;
    c.seq_len = 8;
    c.backend = TD_BACKEND_CPU;
    c.mm.min_chunk_numel = 1024;
    c.mm.max_chunk_numel = 8192;
    c.optim.lr.lr = 3e-3;
    c.threads = 2;
    return c;
}

static void steps(td_trainer *t, td_test_batches *b, int n, double *losses)
{
    for (int s = 0; s < n; s++) {
        td_step_result r;
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, b, &r));
        if (losses) losses[s] = r.loss;
    }
}

/* The host copy of tidal tensor i's params (fp32 on the cpu backend). */
static const float *host_param(td_trainer *t, int i)
{
    int pid;
    td_trainer_tensor_ids(t, i, &pid, NULL, NULL, NULL);
    void *p;
    TD_ASSERT_OK(td_memmgr_host_access(td_trainer_memmgr(t), &pid, 1, TD_ACCESS_READ, &p));
    return p;
}

static void check_layout(const char *family, int untied, int scaled, const char *dir)
{
    td_train_config c = config_of(family, untied, scaled);
    const td_model_desc *mc = &c.model;
    td_trainer *t;
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    td_test_batches b = { .vocab = mc->vocab_size, .n = 16 };
    td_rng_seed(&b.rng, 3);
    steps(t, &b, 1, NULL);
    TD_ASSERT_OK(td_trainer_save(t, dir, 0, NULL));

    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    td_st_reader *m;
    TD_ASSERT_OK(td_st_open(path, &m));
    const int L = 2, NH = 4, NKV = 2, hs = 8, C = 32, H = 40, V = 50;
    assert_int_equal(td_st_tensor_count(m), 2 + L * (9 + (!strcmp(family, "qwen2") ? 3 : 0)) + untied);
    static const char *const suffix[] = {"input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                         "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                         "mlp.down_proj.weight"};
    const int rows[] = {C, NH * hs, NKV * hs, NKV * hs, C, C, H, H, C}, cols[] = {0, C, C, C, C, 0, C, C, H};
    for (int l = 0; l < L; l++)
        for (int k = 0; k < 9; k++) {
            char name[96];
            snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix[k]);
            const td_st_tensor *tt = td_st_find(m, name);
            if (!tt) fail_msg("%s: no tensor %s", path, name);
            assert_int_equal(tt->ndim, cols[k] ? 2 : 1);
            assert_int_equal(tt->shape[0], rows[k]);
            if (cols[k]) assert_int_equal(tt->shape[1], cols[k]);
        }
    assert_true((td_st_find(m, "model.layers.1.self_attn.k_proj.bias") != NULL) == (!strcmp(family, "qwen2")));
    assert_null(td_st_find(m, "model.layers.1.self_attn.o_proj.bias"));
    assert_int_equal(td_st_find(m, "model.embed_tokens.weight")->shape[0], V);
    assert_non_null(td_st_find(m, "model.norm.weight"));
    assert_true((td_st_find(m, "lm_head.weight") != NULL) == untied);
    if (untied) assert_int_equal(td_st_find(m, "lm_head.weight")->shape[0], V);

    /* The parts are the fused tensors' rows: k_proj of block 1 is rows
     * [NH hs, (NH + NKV) hs) of qkv, up_proj rows [H, 2H) of gate_up. */
    const int ne = 1, nb = td_model_block_tensor_count(mc);
    const float *qkv = host_param(t, ne + nb + 1);
    const float *gate_up = host_param(t, ne + nb + (!strcmp(family, "qwen2") ? 5 : 4));
    float *buf = malloc((size_t)H * C * sizeof(float));
    TD_ASSERT_OK(td_st_read(m, td_st_find(m, "model.layers.1.self_attn.k_proj.weight"), 0, (size_t)NKV * hs * C,
                            TD_ST_F32, buf));
    assert_memory_equal(buf, qkv + (size_t)NH * hs * C, (size_t)NKV * hs * C * sizeof(float));
    TD_ASSERT_OK(td_st_read(m, td_st_find(m, "model.layers.1.mlp.up_proj.weight"), 0, (size_t)H * C, TD_ST_F32, buf));
    assert_memory_equal(buf, gate_up + (size_t)H * C, (size_t)H * C * sizeof(float));
    if (!strcmp(family, "qwen2")) {
        const float *qkv_b = host_param(t, ne + nb + 2);
        TD_ASSERT_OK(td_st_read(m, td_st_find(m, "model.layers.1.self_attn.v_proj.bias"), 0, (size_t)NKV * hs,
                                TD_ST_F32, buf));
        assert_memory_equal(buf, qkv_b + (size_t)(NH + NKV) * hs, (size_t)NKV * hs * sizeof(float));
    }
    free(buf);
    td_st_close(m);

    /* config.json: what transformers needs, and it reads back as the same model. */
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "r");
    char text[8192];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    cJSON *j = cJSON_Parse(text);
    assert_non_null(j);
    assert_string_equal(cJSON_GetObjectItem(j, "model_type")->valuestring, !strcmp(family, "qwen2") ? "qwen2" : "llama");
    assert_string_equal(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "architectures"), 0)->valuestring,
                        !strcmp(family, "qwen2") ? "Qwen2ForCausalLM" : "LlamaForCausalLM");
    assert_int_equal(cJSON_GetObjectItem(j, "num_key_value_heads")->valueint, NKV);
    assert_int_equal(cJSON_GetObjectItem(j, "intermediate_size")->valueint, H);
    assert_true(cJSON_IsBool(cJSON_GetObjectItem(j, "tie_word_embeddings")) &&
                cJSON_IsTrue(cJSON_GetObjectItem(j, "tie_word_embeddings")) == !untied);
    assert_true(cJSON_GetObjectItem(j, "rms_norm_eps")->valuedouble == (!strcmp(family, "qwen2") ? 1e-6 : 1e-5));
    const cJSON *rs = cJSON_GetObjectItem(j, "rope_scaling");
    if (scaled) {
        assert_string_equal(cJSON_GetObjectItem(rs, "rope_type")->valuestring, "llama3");
        assert_true(cJSON_GetObjectItem(rs, "factor")->valuedouble == 32.0);
        assert_int_equal(cJSON_GetObjectItem(rs, "original_max_position_embeddings")->valueint, 8192);
    } else {
        assert_true(cJSON_IsNull(rs));
    }
    cJSON_Delete(j);
    td_model_desc back;
    TD_ASSERT_OK(td_model_config_read(path, &back));
    assert_memory_equal(&back, mc, sizeof back);
    td_model_desc from_dir;
    TD_ASSERT_OK(td_trainer_checkpoint_model(dir, &from_dir));
    assert_memory_equal(&from_dir, mc, sizeof from_dir);
    td_trainer_destroy(t);
}

static void test_names_shapes_config(void **state)
{
    check_layout("llama", 0, 1, tpath("llama_tied"));
    check_layout("llama", 1, 0, tpath("llama_untied"));
    check_layout("qwen2", 1, 0, tpath("qwen_untied"));
    check_layout("qwen2", 0, 1, tpath("qwen_tied"));
}

/* Save with the training state, load into a fresh trainer built from the
 * directory's config.json: the next steps are bit-identical; weights alone
 * (--init) give the same eval loss. */
static void test_round_trip(void **state)
{
    for (int k = 0; k < 2; k++) {
        td_train_config c = config_of(k ? "qwen2" : "llama", k, !k);
        const char *dir = tpath(k ? "rt_qwen" : "rt_llama");
        td_trainer *a, *b;
        TD_ASSERT_OK(td_trainer_create(&c, &a));
        td_test_batches ba = { .vocab = c.model.vocab_size, .n = 16 };
        td_rng_seed(&ba.rng, 11);
        steps(a, &ba, 2, NULL);
        TD_ASSERT_OK(td_trainer_save(a, dir, 1, NULL));
        td_train_config cb = c;
        TD_ASSERT_OK(td_trainer_checkpoint_model(dir, &cb.model));
        TD_ASSERT_OK(td_trainer_create(&cb, &b));
        TD_ASSERT_OK(td_trainer_load(b, dir, 1, NULL));
        td_test_batches bb = ba;
        double la[3], lb[3];
        steps(a, &ba, 3, la);
        steps(b, &bb, 3, lb);
        assert_memory_equal(la, lb, sizeof la);
        td_trainer_destroy(b);

        /* weights only */
        TD_ASSERT_OK(td_trainer_save(a, dir, 0, NULL));
        TD_ASSERT_OK(td_trainer_create(&cb, &b));
        TD_ASSERT_OK(td_trainer_load(b, dir, 0, NULL));
        td_test_batches ea = { .vocab = c.model.vocab_size, .n = 16, .repeat = 1, .seed = 4 }, eb = ea;
        double ea_loss, eb_loss;
        TD_ASSERT_OK(td_trainer_eval(a, td_test_next_batch, &ea, 2, &ea_loss, NULL));
        TD_ASSERT_OK(td_trainer_eval(b, td_test_next_batch, &eb, 2, &eb_loss, NULL));
        assert_memory_equal(&ea_loss, &eb_loss, sizeof ea_loss);
        /* loading into another model names what differs */
        td_train_config other = cb;
        other.model.n_kv_head = 4;
        td_trainer *o;
        TD_ASSERT_OK(td_trainer_create(&other, &o));
        assert_int_equal(td_trainer_load(o, dir, 0, NULL), TD_ERR_INVALID);
        expect_msg("num_key_value_heads differs");
        td_trainer_destroy(o);
        td_trainer_destroy(a);
        td_trainer_destroy(b);
    }
}

/* Above shard_bytes the weights go to shards with an index; the reader
 * takes them (and save_pretrained's own shards) back. */
static void test_shards(void **state)
{
    td_model_desc c = config_of("qwen2", 1, 0).model;
    const char *dir = tpath("sharded");
    td_ckpt_write_options wo = td_ckpt_write_default_options();
    wo.train_state = 0;
    wo.shard_bytes = 20000; /* the model is ~60 KB at fp32: several shards, embed and lm_head each alone */
    td_ckpt_writer *w;
    TD_ASSERT_OK(td_ckpt_writer_begin(dir, &c, &wo, &w));
    const int n = td_model_hf_count(&c);
    float **vals = calloc((size_t)n, sizeof *vals);
    td_rng rng;
    td_rng_seed(&rng, 5);
    for (int i = 0; i < n; i++) {
        td_model_hf_tensor p;
        TD_ASSERT_OK(td_model_hf_get(&c, i, &p));
        vals[i] = calloc(p.numel, sizeof(float));
        for (uint64_t e = 0; e < p.hf_numel; e++) vals[i][e] = (float)td_rng_uniform(&rng);
        TD_ASSERT_OK(td_ckpt_writer_put_weight(w, i, TD_DTYPE_F32, vals[i]));
    }
    TD_ASSERT_OK(td_ckpt_writer_commit(w));
    char path[600];
    struct stat sb;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_not_equal(stat(path, &sb), 0);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    assert_int_equal(stat(path, &sb), 0);
    int shards = 0;
    for (int k = 1; k < 100; k++) {
        snprintf(path, sizeof path, "%s/model-%05d-of-%05d.safetensors", dir, k, k);
        if (stat(path, &sb) == 0) { shards = k; break; }
    }
    assert_true(shards >= 3);
    for (int k = 1; k <= shards; k++) { /* every shard within the limit, unless one tensor alone is larger */
        snprintf(path, sizeof path, "%s/model-%05d-of-%05d.safetensors", dir, k, shards);
        td_st_reader *r;
        TD_ASSERT_OK(td_st_open(path, &r));
        assert_true(td_st_file_bytes(r) <= 20000 + 4096 || td_st_tensor_count(r) == 1);
        td_st_close(r);
    }
    td_ckpt_reader *r;
    TD_ASSERT_OK(td_ckpt_reader_open(dir, NULL, &r));
    assert_memory_equal(td_ckpt_reader_config(r), &c, sizeof c);
    for (int i = 0; i < n; i++) {
        td_model_hf_tensor p;
        TD_ASSERT_OK(td_model_hf_get(&c, i, &p));
        float *got = calloc(p.numel, sizeof(float));
        TD_ASSERT_OK(td_ckpt_reader_get_weight(r, i, TD_DTYPE_F32, got));
        assert_memory_equal(got, vals[i], p.numel * sizeof(float)); /* padding rows come back zero */
        free(got);
        free(vals[i]);
    }
    free(vals);
    td_ckpt_reader_close(r);
    /* Saving again over it replaces the shards (they are checkpoint files). */
    wo.shard_bytes = 0;
    TD_ASSERT_OK(td_ckpt_writer_begin(dir, &c, &wo, &w));
    td_ckpt_writer_abort(w);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

#define LLAMA_BASE "\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 96, " \
                   "\"num_hidden_layers\": 2, \"num_attention_heads\": 8, \"max_position_embeddings\": 128, " \
                   "\"vocab_size\": 100"

static void expect_config_error(const char *json, const char *piece)
{
    const char *path = tpath("config.json");
    write_text(path, json);
    td_model_desc c;
    assert_int_equal(td_model_config_read(path, &c), TD_ERR_INVALID);
    expect_msg(piece);
}

static void test_config_json(void **state)
{
    const char *path = tpath("config.json");
    td_model_desc c;
    /* transformers' defaults for what a minimal LlamaConfig leaves out */
    write_text(path, "{" LLAMA_BASE "}");
    TD_ASSERT_OK(td_model_config_read(path, &c));
    assert_true(td_model_family_of(&c) == td_model_family_find("llama"));
    assert_int_equal(td_model_kv_heads(&c), 8);
    assert_true(c.norm_eps == 1e-6f && c.rope_theta == 10000.0f && c.untied_head == 1 && c.qkv_bias == 0);
    write_text(path, "{\"model_type\": \"qwen2\", \"hidden_size\": 896, \"intermediate_size\": 4864, "
                     "\"num_hidden_layers\": 24, \"num_attention_heads\": 14, \"num_key_value_heads\": 2, "
                     "\"max_position_embeddings\": 32768, \"vocab_size\": 151936, \"rms_norm_eps\": 1e-06, "
                     "\"rope_theta\": 1000000.0, \"tie_word_embeddings\": true, \"use_sliding_window\": false, "
                     "\"sliding_window\": 32768, \"hidden_act\": \"silu\", \"rope_scaling\": null}");
    TD_ASSERT_OK(td_model_config_read(path, &c));
    td_model_desc preset;
    TD_ASSERT_OK(td_model_preset("qwen2.5-0.5b", &preset));
    c.padded_vocab_size = preset.padded_vocab_size;
    assert_memory_equal(&c, &preset, sizeof c); /* Qwen2.5-0.5B's own config.json is the preset */
    write_text(path, "{\"model_type\": \"llama\", \"hidden_size\": 2048, \"intermediate_size\": 8192, "
                     "\"num_hidden_layers\": 16, \"num_attention_heads\": 32, \"num_key_value_heads\": 8, "
                     "\"head_dim\": 64, \"max_position_embeddings\": 131072, \"vocab_size\": 128256, "
                     "\"rms_norm_eps\": 1e-05, \"rope_theta\": 500000.0, \"tie_word_embeddings\": true, "
                     "\"attention_bias\": false, \"mlp_bias\": false, \"pretraining_tp\": 1, "
                     "\"rope_scaling\": {\"factor\": 32.0, \"high_freq_factor\": 4.0, \"low_freq_factor\": 1.0, "
                     "\"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"}}");
    TD_ASSERT_OK(td_model_config_read(path, &c));
    TD_ASSERT_OK(td_model_preset("llama-3.2-1b", &preset));
    assert_memory_equal(&c, &preset, sizeof c); /* Llama-3.2-1B's */
    /* transformers 5 writes the same as "rope_parameters", rope_theta inside */
    write_text(path, "{\"model_type\": \"llama\", \"hidden_size\": 2048, \"intermediate_size\": 8192, "
                     "\"num_hidden_layers\": 16, \"num_attention_heads\": 32, \"num_key_value_heads\": 8, "
                     "\"head_dim\": 64, \"max_position_embeddings\": 131072, \"vocab_size\": 128256, "
                     "\"rms_norm_eps\": 1e-05, \"tie_word_embeddings\": true, "
                     "\"rope_parameters\": {\"factor\": 32.0, \"high_freq_factor\": 4.0, \"low_freq_factor\": 1.0, "
                     "\"original_max_position_embeddings\": 8192, \"rope_theta\": 500000.0, \"rope_type\": \"llama3\"}}");
    TD_ASSERT_OK(td_model_config_read(path, &c));
    assert_memory_equal(&c, &preset, sizeof c);
    write_text(path, "{" LLAMA_BASE ", \"rope_parameters\": {\"rope_theta\": 1000000.0, \"rope_type\": \"default\"}}");
    TD_ASSERT_OK(td_model_config_read(path, &c));
    assert_true(c.rope_theta == 1000000.0f && c.rope_scaling.factor == 0);

    /* malformed: each error names the field */
    expect_config_error("{\"model_type\": \"llama\", \"intermediate_size\": 96, \"num_hidden_layers\": 2, "
                        "\"num_attention_heads\": 8, \"max_position_embeddings\": 128, \"vocab_size\": 100}",
                        "no \"hidden_size\"");
    expect_config_error("{" LLAMA_BASE ", \"num_key_value_heads\": \"2\"}", "\"num_key_value_heads\" must be a positive integer");
    expect_config_error("{" LLAMA_BASE ", \"rms_norm_eps\": \"small\"}", "\"rms_norm_eps\" must be a positive number");
    expect_config_error("{" LLAMA_BASE ", \"tie_word_embeddings\": 1}", "\"tie_word_embeddings\" must be true or false");
    expect_config_error("{" LLAMA_BASE ", \"num_key_value_heads\": 3}",
                        "\"num_key_value_heads\" 3 does not divide \"num_attention_heads\" 8");
    expect_config_error("{\"model_type\": \"llama\", \"hidden_size\": 60, \"intermediate_size\": 96, "
                        "\"num_hidden_layers\": 2, \"num_attention_heads\": 8, \"max_position_embeddings\": 128, "
                        "\"vocab_size\": 100}", "\"hidden_size\" 60 is not a multiple of \"num_attention_heads\" 8");
    expect_config_error("{\"model_type\": \"gpt2\", \"n_layer\": 2, \"n_head\": 5, \"n_embd\": 16, "
                        "\"n_positions\": 8, \"vocab_size\": 10}", "n_embd 16 is not a multiple of n_head 5");
    expect_config_error("{\"model_type\": \"mistral\"}", "model_type \"mistral\" is not supported");
    expect_config_error("{\"model_type\": 7}", "\"model_type\" must be a string");
    expect_config_error("{" LLAMA_BASE ", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}}",
                        "rope_scaling type \"yarn\" is not supported");
    expect_config_error("{" LLAMA_BASE ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, "
                        "\"low_freq_factor\": 1.0, \"original_max_position_embeddings\": 8192}}",
                        "(rope_scaling): no \"high_freq_factor\"");
    expect_config_error("{" LLAMA_BASE ", \"rope_scaling\": 3}", "\"rope_scaling\" must be null or an object");
    expect_config_error("{" LLAMA_BASE ", \"rope_parameters\": {\"rope_type\": \"dynamic\", \"rope_theta\": 1e4}}",
                        "rope_parameters type \"dynamic\" is not supported");
    expect_config_error("{" LLAMA_BASE ", \"hidden_act\": \"gelu\"}", "hidden_act \"gelu\" is not supported");
    expect_config_error("{" LLAMA_BASE ", \"attention_bias\": true}", "\"attention_bias\" must be false");
    expect_config_error("{" LLAMA_BASE ", \"head_dim\": 16}", "\"head_dim\" 16 is not hidden_size / num_attention_heads");
    expect_config_error("{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 96, "
                        "\"num_hidden_layers\": 2, \"num_attention_heads\": 8, \"max_position_embeddings\": 128, "
                        "\"vocab_size\": 100, \"use_sliding_window\": true}", "\"use_sliding_window\" must be false");
    expect_config_error("{" LLAMA_BASE ", \"rope_interleaved\": true}", "\"rope_interleaved\" must be false");
    expect_config_error("[1, 2]", "is not a JSON object");
}

/* Weights that do not fit the config.json: a missing lm_head of an untied
 * model, a tensor the model does not have; a tied model's lm_head saved
 * anyway is fine. */
static void test_malformed_weights(void **state)
{
    td_model_desc c = config_of("llama", 0, 0).model; /* tied */
    const char *dir = tpath("tied");
    td_ckpt_write_options wo = td_ckpt_write_default_options();
    wo.train_state = 0;
    td_ckpt_writer *w;
    TD_ASSERT_OK(td_ckpt_writer_begin(dir, &c, &wo, &w));
    float *zeros = calloc(64 * 64, sizeof(float));
    for (int i = 0; i < td_model_hf_count(&c); i++) TD_ASSERT_OK(td_ckpt_writer_put_weight(w, i, TD_DTYPE_F32, zeros));
    TD_ASSERT_OK(td_ckpt_writer_commit(w));
    /* claim untied: lm_head.weight is missing */
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    td_model_desc file;
    TD_ASSERT_OK(td_model_config_read(path, &file));
    td_model_desc untied = c;
    untied.untied_head = 1;
    TD_ASSERT_OK(td_ckpt_writer_begin(tpath("untied"), &untied, &wo, &w));
    for (int i = 0; i < td_model_hf_count(&untied); i++)
        TD_ASSERT_OK(td_ckpt_writer_put_weight(w, i, TD_DTYPE_F32, zeros));
    TD_ASSERT_OK(td_ckpt_writer_commit(w));
    /* the untied directory's weights with the tied config: lm_head is extra but harmless */
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "cp '%s/config.json' '%s/config.json'", dir, tpath("untied"));
    assert_int_equal(system(cmd), 0);
    td_ckpt_reader *r;
    TD_ASSERT_OK(td_ckpt_reader_open(tpath("untied"), NULL, &r));
    td_ckpt_reader_close(r);
    /* the tied directory's weights with an untied config: lm_head is missing */
    snprintf(cmd, sizeof cmd, "cp '%s/model.safetensors' '%s/model.safetensors' && sed -i "
             "'s/\\(\"tie_word_embeddings\":[[:space:]]*\\)true/\\1false/' '%s/config.json'",
             dir, tpath("untied"), tpath("untied"));
    assert_int_equal(system(cmd), 0);
    assert_int_equal(td_ckpt_reader_open(tpath("untied"), NULL, &r), TD_ERR_INVALID);
    expect_msg("has no tensor 'lm_head.weight'");
    /* a Qwen2 config over LLaMA weights: the q/k/v biases are missing */
    td_model_desc q = c;
    q.family = td_model_family_find("qwen2");
    q.qkv_bias = 1;
    assert_int_equal(td_ckpt_reader_open(dir, &q, &r), TD_ERR_INVALID);
    expect_msg("model_type is llama but the model being trained is qwen2");
    free(zeros);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names_shapes_config),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_shards),
        cmocka_unit_test(test_config_json),
        cmocka_unit_test(test_malformed_weights),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
