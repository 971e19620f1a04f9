/* Checkpoint directories (include/tidal/checkpoint.h).
 *
 * The parameter table against the reference model's; round trips of weights (fp32 and
 * bf16, transposed Conv1D weights, padded wte), training state, metadata and
 * extras, bit for bit; Hugging Face layouts (with and without "transformer.",
 * extra buffers, sharded files) loading; each bad input with its message;
 * directories that hold other files never deleted; allocation failures; and
 * crash safety: a child process killed (SIGKILL) at every stage of a save and
 * at random moments of large saves, in both replacement modes, always leaves
 * a directory that loads as the old or the new checkpoint, bit for bit.
 *
 * With TD_CKPT_EXPORT_DIR set, only the export runs: it writes a checkpoint
 * and the reference loss for tests/gpu/check_hf_load.py.  With
 * TD_CKPT_IMPORT_DIR (+ TD_CKPT_IMPORT_TOKENS, TD_CKPT_IMPORT_OUT) set, only
 * the import runs: it loads a Hugging Face save_pretrained directory and
 * writes tidal's loss on the given tokens. */
#include "td_test.h"
#include "tidal/checkpoint.h"
#include "tidal/model_ref.h"
#include "tidal/convert.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char tmp_root[256];

static int setup_dir(void **state)
{
    snprintf(tmp_root, sizeof tmp_root, "/tmp/td_ckpt_XXXXXX");
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

/* Entries of tmp_root, as "a b c" sorted. */
static const char *root_entries(void)
{
    static char out[2048];
    char *names[64];
    int n = 0;
    DIR *d = opendir(tmp_root);
    struct dirent *e;
    while (d && (e = readdir(d)) && n < 64)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) names[n++] = strdup(e->d_name);
    if (d) closedir(d);
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char *t = names[j];
            names[j] = names[j - 1];
            names[j - 1] = t;
        }
    out[0] = '\0';
    for (int i = 0; i < n; i++) {
        strcat(out, i ? " " : "");
        strcat(out, names[i]);
        free(names[i]);
    }
    return out;
}

static void spit(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void expect_msg(const char *piece)
{
    if (!strstr(td_error_msg(), piece)) fail_msg("message lacks '%s': %s", piece, td_error_msg());
}

/* --- deterministic contents ------------------------------------------------ */

/* Element j (tidal layout) of parameter p in generation gen; kind 0 = weight,
 * 1..3 = master, adam_m, adam_v.  tests/gpu/check_hf_load.py recomputes the
 * weights with the same formula. */
static float val(uint64_t gen, int kind, int p, uint64_t j)
{
    uint64_t g = gen * 4 + (uint64_t)kind;
    uint64_t k = (g * 1000003u + (uint64_t)p * 7919u + j * 104729u) % 2001u;
    return (float)((double)((int64_t)k - 1000) * 5e-5);
}

static void fill(float *dst, uint64_t n, uint64_t gen, int kind, int p)
{
    for (uint64_t j = 0; j < n; j++) dst[j] = val(gen, kind, p, j);
}

static uint64_t max_numel(const td_model_desc *cfg)
{
    uint64_t m = 0;
    for (int i = 0; i < td_model_hf_count(cfg); i++) {
        td_model_hf_tensor p;
        td_model_hf_get(cfg, i, &p);
        if (p.numel > m) m = p.numel;
    }
    return m;
}

/* A whole checkpoint of generation `gen`: weights put whole, state appended in
 * three pieces per tensor, interleaved per parameter (as the step loop does,
 * chunk by chunk), metadata and an extra tensor. */
static td_status write_ckpt(const char *dir, const td_model_desc *cfg, uint64_t gen,
                            const td_ckpt_write_options *opts)
{
    td_status st = TD_OK;
    td_ckpt_writer *w = NULL;
    float *buf = malloc(max_numel(cfg) * sizeof(float));
    st = td_ckpt_writer_begin(dir, cfg, opts, &w);
    if (st != TD_OK) goto out;
    const int with_state = !opts || opts->train_state;
    int rng_idx = -1;
    if (with_state) {
        uint64_t shape[1] = {4};
        if ((st = td_ckpt_writer_set_meta_u64(w, "generation", gen)) != TD_OK ||
            (st = td_ckpt_writer_set_meta_f64(w, "loss_scale", (double)gen + 1.0 / 3.0)) != TD_OK ||
            (st = td_ckpt_writer_set_meta(w, "note", "data position \"x\"")) != TD_OK ||
            (st = td_ckpt_writer_declare_extra(w, "rng", TD_ST_U64, 1, shape, &rng_idx)) != TD_OK)
            goto out;
    }
    for (int i = 0; i < td_model_hf_count(cfg) && st == TD_OK; i++) {
        td_model_hf_tensor p;
        td_model_hf_get(cfg, i, &p);
        fill(buf, p.numel, gen, 0, i);
        if ((st = td_ckpt_writer_put_weight(w, i, TD_DTYPE_F32, buf)) != TD_OK) break;
        for (int k = 0; with_state && k < TD_CKPT_STATE_COUNT && st == TD_OK; k++) {
            fill(buf, p.numel, gen, k + 1, i);
            uint64_t a = p.numel / 3, b = 2 * p.numel / 3;
            st = td_ckpt_writer_append_state(w, i, (td_ckpt_state)k, buf, a);
            if (st == TD_OK) st = td_ckpt_writer_append_state(w, i, (td_ckpt_state)k, buf + a, b - a);
            if (st == TD_OK) st = td_ckpt_writer_append_state(w, i, (td_ckpt_state)k, buf + b, p.numel - b);
        }
    }
    if (st == TD_OK && with_state) {
        uint64_t rng[4] = {gen, gen * 3 + 1, ~gen, 0x0123456789abcdefull};
        st = td_ckpt_writer_append_extra(w, rng_idx, rng, 8);
        if (st == TD_OK) st = td_ckpt_writer_append_extra(w, rng_idx, (char *)rng + 8, 24);
    }
    if (st == TD_OK) {
        st = td_ckpt_writer_commit(w);
        w = NULL;
    }
out:
    td_ckpt_writer_abort(w);
    free(buf);
    return st;
}

/* Checks that `dir` holds generation `gen` bit for bit; returns a reason on
 * mismatch (NULL if it matches).  *gen_found receives the generation stored. */
static const char *verify_ckpt(const char *dir, const td_model_desc *cfg, td_dtype wdt, int with_state,
                               uint64_t *gen_found)
{
    static char why[1024];
    td_ckpt_reader *r = NULL;
    float *buf = malloc(max_numel(cfg) * sizeof(float)), *want = malloc(max_numel(cfg) * sizeof(float));
    uint64_t gen = 0;
    const char *bad = NULL;
#define BAD(...)                                                                                   \
    do {                                                                                           \
        snprintf(why, sizeof why, __VA_ARGS__);                                                    \
        bad = why;                                                                                 \
        goto out;                                                                                  \
    } while (0)
    if (td_ckpt_reader_open(dir, cfg, &r) != TD_OK) BAD("open: %s", td_error_msg());
    const td_model_desc *c = td_ckpt_reader_config(r);
    if (memcmp(c, cfg, sizeof *c)) BAD("config differs");
    if (td_ckpt_reader_has_state(r) != with_state) BAD("has_state %d", td_ckpt_reader_has_state(r));
    if (with_state) {
        if (td_ckpt_reader_meta_u64(r, "generation", &gen) != TD_OK) BAD("%s", td_error_msg());
        double ls;
        if (td_ckpt_reader_meta_f64(r, "loss_scale", &ls) != TD_OK || ls != (double)gen + 1.0 / 3.0)
            BAD("loss_scale");
        const char *note = td_ckpt_reader_meta(r, "note");
        if (!note || strcmp(note, "data position \"x\"")) BAD("note");
        uint64_t rng[4];
        const td_st_tensor *t = td_st_find(td_ckpt_reader_state_file(r), "rng");
        if (!t || td_st_read(td_ckpt_reader_state_file(r), t, 0, 4, TD_ST_U64, rng) != TD_OK ||
            rng[0] != gen || rng[1] != gen * 3 + 1 || rng[2] != ~gen || rng[3] != 0x0123456789abcdefull)
            BAD("rng");
    } else if (gen_found) {
        gen = *gen_found;
    }
    for (int i = 0; i < td_model_hf_count(cfg); i++) {
        td_model_hf_tensor p;
        td_model_hf_get(cfg, i, &p);
        fill(want, p.numel, gen, 0, i);
        for (uint64_t j = p.hf_numel; j < p.numel; j++) want[j] = 0; /* wte padding rows */
        if (wdt == TD_DTYPE_BF16)
            for (uint64_t j = 0; j < p.numel; j++) want[j] = td_f32_from_bf16(td_bf16_from_f32(want[j]));
        memset(buf, 0xff, p.numel * sizeof(float));
        if (td_ckpt_reader_get_weight(r, i, TD_DTYPE_F32, buf) != TD_OK) BAD("get %s: %s", p.name, td_error_msg());
        if (memcmp(buf, want, p.numel * sizeof(float))) BAD("weight %s differs (gen %llu)", p.name, (unsigned long long)gen);
        if (td_ckpt_reader_weight_dtype(r, i) != (wdt == TD_DTYPE_BF16 ? TD_ST_BF16 : TD_ST_F32)) BAD("dtype");
        for (int k = 0; with_state && k < TD_CKPT_STATE_COUNT; k++) {
            fill(want, p.numel, gen, k + 1, i);
            if (td_ckpt_reader_read_state(r, i, (td_ckpt_state)k, 0, p.numel, buf) != TD_OK)
                BAD("state %s: %s", p.name, td_error_msg());
            if (memcmp(buf, want, p.numel * sizeof(float))) BAD("state %d of %s differs", k, p.name);
        }
    }
    if (gen_found) *gen_found = gen;
out:
#undef BAD
    td_ckpt_reader_close(r);
    free(buf);
    free(want);
    return bad;
}

static const td_model_desc tiny = {
    .n_layer = 2, .n_head = 4, .n_embd = 16, .n_positions = 8, .vocab_size = 21, .padded_vocab_size = 32,
};

/* --- the parameter table ----------------------------------------------------- */

static void test_param_table(void **state)
{
    td_model_desc g = {.n_layer = 12, .n_head = 12, .n_embd = 768, .n_positions = 1024, .vocab_size = 50257, .padded_vocab_size = 50304};
    TD_ASSERT_OK(td_model_desc_check(&g));
    assert_int_equal(td_model_hf_count(&g), 148);
    /* Hugging Face's GPT-2 124M holds 124,439,808 parameters. */
    uint64_t hf = 0, tidal = 0;
    for (int i = 0; i < 148; i++) {
        td_model_hf_tensor p;
        TD_ASSERT_OK(td_model_hf_get(&g, i, &p));
        hf += p.hf_numel;
        tidal += p.numel;
        assert_int_equal(td_model_hf_find(&g, p.name), i);
        char prefixed[96];
        snprintf(prefixed, sizeof prefixed, "transformer.%s", p.name);
        assert_int_equal(td_model_hf_find(&g, prefixed), i);
    }
    assert_int_equal(hf, 124439808);
    assert_int_equal(tidal, 124475904);
    td_model_hf_tensor p;
    TD_ASSERT_OK(td_model_hf_get(&g, 2 + 12 * 5 + 2, &p));
    assert_string_equal(p.name, "h.5.attn.c_attn.weight");
    assert_int_equal(p.layer, 5);
    assert_true(p.transposed);
    assert_int_equal(p.shape[0], 2304);
    assert_int_equal(p.shape[1], 768);
    assert_int_equal(p.hf_shape[0], 768);
    assert_int_equal(p.hf_shape[1], 2304);
    TD_ASSERT_OK(td_model_hf_get(&g, 0, &p));
    assert_int_equal(p.hf_shape[0], 50257);
    assert_int_equal(p.shape[0], 50304);
    assert_int_equal(td_model_hf_get(&g, 148, &p), TD_ERR_INVALID);
    assert_int_equal(td_model_hf_find(&g, "h.12.ln_1.weight"), -1);
    assert_int_equal(td_model_hf_find(&g, "h.01.ln_1.weight"), -1);
    assert_int_equal(td_model_hf_find(&g, "h.1.ln_3.weight"), -1);
    assert_int_equal(td_model_hf_find(&g, "lm_head.weight"), -1);
    assert_int_equal(td_model_hf_find(&g, "h.-1.ln_1.weight"), -1);

    /* The same order, names, shapes and orientation as the reference model's table. */
    td_model_desc rc = {.n_layer = tiny.n_layer, .n_head = tiny.n_head, .n_embd = tiny.n_embd, .n_positions = tiny.n_positions, .vocab_size = tiny.vocab_size, .padded_vocab_size = tiny.padded_vocab_size};
    assert_int_equal(td_model_tensor_count(&rc), td_model_hf_count(&tiny));
    for (int i = 0; i < td_model_hf_count(&tiny); i++) {
        td_model_tensor t;
        td_model_tensor_get(&rc, i, &t);
        TD_ASSERT_OK(td_model_hf_get(&tiny, i, &p));
        assert_string_equal(p.name, t.name);
        assert_int_equal(p.ndim, t.ndim);
        assert_int_equal(p.shape[0], t.shape[0]);
        if (t.ndim == 2) assert_int_equal(p.shape[1], t.shape[1]);
        assert_int_equal(p.transposed, t.hf_transposed);
        assert_int_equal(p.numel, t.numel);
        assert_int_equal(p.layer, t.layer);
    }
    td_model_desc bad = tiny;
    bad.n_embd = 18;
    assert_int_equal(td_model_desc_check(&bad), TD_ERR_INVALID);
    bad = tiny;
    bad.padded_vocab_size = 20;
    assert_int_equal(td_model_desc_check(&bad), TD_ERR_INVALID);
}

/* --- round trips ------------------------------------------------------------- */

static void test_round_trip(void **state)
{
    const size_t live = td_host_live_allocs();
    const char *dir = tpath("ck");
    TD_ASSERT_OK(write_ckpt(dir, &tiny, 5, NULL));
    assert_string_equal(root_entries(), "ck");
    uint64_t gen = 0;
    const char *why = verify_ckpt(dir, &tiny, TD_DTYPE_F32, 1, &gen);
    if (why) fail_msg("%s", why);
    assert_int_equal(gen, 5);

    /* The stored layout: Conv1D weights transposed, wte with V rows. */
    td_ckpt_reader *r;
    TD_ASSERT_OK(td_ckpt_reader_open(dir, NULL, &r));
    assert_memory_equal(td_ckpt_reader_config(r), &tiny, sizeof tiny); /* padded from config.json */
    assert_string_equal(td_ckpt_reader_dir(r), dir);
    const int qkv = 2 + 12 + 2; /* h.1.attn.c_attn.weight: tidal (48, 16), stored (16, 48) */
    float row[48];
    TD_ASSERT_OK(td_ckpt_reader_read_weight(r, qkv, 48 * 3, 48, TD_DTYPE_F32, row)); /* stored row 3 */
    for (int o = 0; o < 48; o++) assert_true(row[o] == val(5, 0, qkv, (uint64_t)o * 16 + 3));
    assert_int_equal(td_ckpt_reader_read_weight(r, 0, 21 * 16 - 1, 2, TD_DTYPE_F32, row), TD_ERR_INVALID);
    assert_int_equal(td_ckpt_reader_read_state(r, 0, TD_CKPT_STATE_COUNT, 0, 1, row), TD_ERR_INVALID);
    uint64_t u;
    assert_int_equal(td_ckpt_reader_meta_u64(r, "missing", &u), TD_ERR_INVALID);
    expect_msg("has no metadata \"missing\"");
    assert_int_equal(td_ckpt_reader_meta_u64(r, "note", &u), TD_ERR_INVALID);
    expect_msg("not an unsigned integer");
    /* bf16 reads of fp32 weights round to nearest even. */
    uint16_t h[16];
    TD_ASSERT_OK(td_ckpt_reader_read_weight(r, 2, 0, 16, TD_DTYPE_BF16, h));
    for (int j = 0; j < 16; j++) assert_int_equal(h[j], td_bf16_from_f32(val(5, 0, 2, (uint64_t)j)));
    td_ckpt_reader_close(r);

    /* config.json speaks Hugging Face. */
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "rb");
    char text[4096];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    cJSON *j = cJSON_Parse(text);
    assert_non_null(j);
    assert_string_equal(cJSON_GetObjectItem(j, "model_type")->valuestring, "gpt2");
    assert_string_equal(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "architectures"), 0)->valuestring, "GPT2LMHeadModel");
    assert_string_equal(cJSON_GetObjectItem(j, "activation_function")->valuestring, "gelu_new");
    assert_true(cJSON_GetObjectItem(j, "layer_norm_epsilon")->valuedouble == 1e-5);
    assert_int_equal(cJSON_GetObjectItem(j, "n_layer")->valueint, 2);
    assert_int_equal(cJSON_GetObjectItem(j, "n_ctx")->valueint, 8);
    assert_int_equal(cJSON_GetObjectItem(j, "vocab_size")->valueint, 21);
    assert_int_equal(cJSON_GetObjectItem(j, "tidal_padded_vocab_size")->valueint, 32);
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(j, "tie_word_embeddings")));
    cJSON_Delete(j);

    /* model.safetensors: HF names, "format": "pt", no train-state tensor. */
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    td_st_reader *m;
    TD_ASSERT_OK(td_st_open(path, &m));
    assert_int_equal(td_st_tensor_count(m), td_model_hf_count(&tiny));
    assert_string_equal(td_st_metadata(m, "format"), "pt");
    assert_non_null(td_st_find(m, "h.1.mlp.c_proj.weight"));
    assert_int_equal(td_st_find(m, "h.1.mlp.c_proj.weight")->shape[0], 64);
    assert_int_equal(td_st_find(m, "wte.weight")->shape[0], 21);
    td_st_close(m);

    /* A second save replaces the first; nothing else is left behind. */
    TD_ASSERT_OK(write_ckpt(dir, &tiny, 6, NULL));
    assert_string_equal(root_entries(), "ck");
    why = verify_ckpt(dir, &tiny, TD_DTYPE_F32, 1, &gen);
    if (why) fail_msg("%s", why);
    assert_int_equal(gen, 6);

    /* bf16 weights without training state; trailing slash in the path. */
    td_ckpt_write_options o = td_ckpt_write_default_options();
    o.weight_dtype = TD_DTYPE_BF16;
    o.train_state = 0;
    o.replace = TD_CKPT_REPLACE_ASIDE;
    TD_ASSERT_OK(write_ckpt(tpath("ck/"), &tiny, 7, &o));
    gen = 7;
    why = verify_ckpt(dir, &tiny, TD_DTYPE_BF16, 0, &gen);
    if (why) fail_msg("%s", why);
    assert_string_equal(root_entries(), "ck");
    TD_ASSERT_OK(td_ckpt_reader_open(dir, &tiny, &r));
    assert_int_equal(td_ckpt_reader_read_state(r, 0, TD_CKPT_STATE_MASTER, 0, 1, row), TD_ERR_INVALID);
    expect_msg("holds weights only");
    assert_null(td_ckpt_reader_meta(r, "generation"));
    td_ckpt_reader_close(r);
    assert_int_equal(td_host_live_allocs(), live);
}

static void test_writer_misuse(void **state)
{
    const size_t live = td_host_live_allocs();
    const char *dir = tpath("ck");
    TD_ASSERT_OK(write_ckpt(dir, &tiny, 1, NULL));
    td_ckpt_writer *w;
    TD_ASSERT_OK(td_ckpt_writer_begin(dir, &tiny, NULL, &w));
    float buf[32 * 16] = {0};
    /* Out of order, reserved names, late metadata. */
    assert_int_equal(td_ckpt_writer_put_weight(w, 1, TD_DTYPE_F32, buf), TD_ERR_STATE);
    expect_msg("'wpe.weight' (index 1) arrived while tensor 'wte.weight'");
    uint64_t one[1] = {1};
    assert_int_equal(td_ckpt_writer_declare_extra(w, "master.x", TD_ST_F32, 1, one, NULL), TD_ERR_INVALID);
    assert_int_equal(td_ckpt_writer_set_meta(w, "format", "x"), TD_ERR_INVALID);
    TD_ASSERT_OK(td_ckpt_writer_put_weight(w, 0, TD_DTYPE_F32, buf));
    TD_ASSERT_OK(td_ckpt_writer_append_state(w, 0, TD_CKPT_STATE_MASTER, buf, 10));
    assert_int_equal(td_ckpt_writer_set_meta(w, "late", "x"), TD_ERR_STATE);
    assert_int_equal(td_ckpt_writer_append_extra(w, 0, buf, 4), TD_ERR_INVALID);
    assert_int_equal(td_ckpt_writer_append_state(w, 99, TD_CKPT_STATE_MASTER, buf, 1), TD_ERR_INVALID);
    /* Incomplete: commit fails naming the tensor; the old checkpoint stays, no temporary. */
    assert_int_equal(td_ckpt_writer_commit(w), TD_ERR_STATE);
    expect_msg("tensor 'wpe.weight' (index 1 of 28) has 0 of its 512 bytes");
    assert_string_equal(root_entries(), "ck");
    uint64_t gen;
    const char *why = verify_ckpt(dir, &tiny, TD_DTYPE_F32, 1, &gen);
    if (why) fail_msg("%s", why);
    assert_int_equal(gen, 1);
    /* Abort halfway. */
    TD_ASSERT_OK(td_ckpt_writer_begin(dir, &tiny, NULL, &w));
    TD_ASSERT_OK(td_ckpt_writer_put_weight(w, 0, TD_DTYPE_F32, buf));
    td_ckpt_writer_abort(w);
    assert_string_equal(root_entries(), "ck");
    /* Bad configurations and paths. */
    td_model_desc bad = tiny;
    bad.n_head = 5;
    assert_int_equal(td_ckpt_writer_begin(dir, &bad, NULL, &w), TD_ERR_INVALID);
    expect_msg("width 16 is not a multiple of the 5 heads");
    assert_int_equal(td_ckpt_writer_begin("/", &tiny, NULL, &w), TD_ERR_INVALID);
    /* Missing folders above are made (test_save_target); a file among them is refused. */
    assert_int_equal(td_ckpt_writer_begin(tpath("ck/config.json/ck2"), &tiny, NULL, &w), TD_ERR_INVALID);
    expect_msg("is not a folder");
    assert_string_equal(root_entries(), "ck");
    assert_int_equal(td_host_live_allocs(), live);
}

/* A directory tidal did not write is never replaced or deleted. */
static void test_foreign_directory_kept(void **state)
{
    const size_t live = td_host_live_allocs();
    const char *dir = tpath("mine");
    mkdir(dir, 0755);
    spit(tpath("mine/notes.txt"), "important");
    td_ckpt_writer *w;
    assert_int_equal(td_ckpt_writer_begin(dir, &tiny, NULL, &w), TD_ERR_INVALID);
    expect_msg("holds 'notes.txt', which tidal does not write");
    assert_string_equal(root_entries(), "mine");
    assert_int_equal(access(tpath("mine/notes.txt"), F_OK), 0);
    /* A stale DIR.old with a foreign file is not deleted either. */
    TD_ASSERT_OK(write_ckpt(tpath("ck"), &tiny, 1, NULL));
    mkdir(tpath("ck.old"), 0755);
    spit(tpath("ck.old/keep.me"), "x");
    assert_int_equal(td_ckpt_recover(tpath("ck")), TD_ERR_INVALID);
    assert_int_equal(access(tpath("ck.old/keep.me"), F_OK), 0);
    /* A file where the directory should be. */
    spit(tpath("file"), "x");
    assert_int_equal(td_ckpt_writer_begin(tpath("file"), &tiny, NULL, &w), TD_ERR_INVALID);
    expect_msg("is not a directory");
    assert_int_equal(td_host_live_allocs(), live);
}

/* Missing folders above a save are made (as `mkdir -p`), by the up-front
 * check and by the writer; a file in the path, an existing non-directory
 * or a foreign directory is refused before anything is made below it. */
static void test_save_target(void **state)
{
    const size_t live = td_host_live_allocs();
    TD_ASSERT_OK(td_ckpt_check_target(tpath("a/b/c/run")));
    struct stat sb;
    assert_int_equal(stat(tpath("a/b/c"), &sb), 0);
    assert_true(S_ISDIR(sb.st_mode));
    assert_int_not_equal(access(tpath("a/b/c/run"), F_OK), 0); /* the checkpoint itself is the save's */
    TD_ASSERT_OK(write_ckpt(tpath("x/y/run/"), &tiny, 1, NULL)); /* the writer alone, a trailing slash */
    assert_int_equal(access(tpath("x/y/run/config.json"), F_OK), 0);
    TD_ASSERT_OK(td_ckpt_check_target(tpath("x/y/run"))); /* a checkpoint to replace */
    spit(tpath("plain"), "x");
    assert_int_equal(td_ckpt_check_target(tpath("plain/sub/run")), TD_ERR_INVALID);
    expect_msg("plain is in the path of");
    assert_int_not_equal(access(tpath("plain/sub"), F_OK), 0);
    td_ckpt_writer *w;
    assert_int_equal(td_ckpt_writer_begin(tpath("plain/sub/run"), &tiny, NULL, &w), TD_ERR_INVALID);
    assert_int_equal(td_ckpt_check_target(tpath("plain")), TD_ERR_INVALID);
    expect_msg("is not a directory");
    mkdir(tpath("mine"), 0755);
    spit(tpath("mine/notes.txt"), "important");
    assert_int_equal(td_ckpt_check_target(tpath("mine")), TD_ERR_INVALID);
    expect_msg("holds 'notes.txt'");
    assert_int_equal(td_ckpt_check_target(""), TD_ERR_INVALID);
    assert_int_equal(td_ckpt_check_target("/"), TD_ERR_INVALID);
    assert_int_equal(td_host_live_allocs(), live);
}

/* --- Hugging Face layouts and bad inputs --------------------------------------- */

typedef struct hf_variant {
    const char *prefix;       /* "" or "transformer." */
    int skip;                 /* parameter left out (-1: none) */
    int linear;               /* parameter stored (out, in) instead of Conv1D (-1: none) */
    int as_i32;               /* parameter stored as I32 (-1: none) */
    int dup;                  /* parameter stored under both names (-1: none) */
    const char *extra;        /* an extra tensor (NULL: none) */
    int split;                /* 1: two shards and an index */
} hf_variant;

static const hf_variant plain = {"", -1, -1, -1, -1, NULL, 0};

static const char *hf_config_json =
    "{\n  \"_name_or_path\": \"x\", \"activation_function\": \"gelu_new\",\n"
    "  \"architectures\": [\"GPT2LMHeadModel\"], \"attn_pdrop\": 0.1, \"bos_token_id\": 50256,\n"
    "  \"embd_pdrop\": 0.1, \"eos_token_id\": 50256, \"initializer_range\": 0.02,\n"
    "  \"layer_norm_epsilon\": 1e-05, \"model_type\": \"gpt2\", \"n_ctx\": 8, \"n_embd\": 16,\n"
    "  \"n_head\": 4, \"n_inner\": null, \"n_layer\": 2, \"n_positions\": 8,\n"
    "  \"reorder_and_upcast_attn\": false, \"resid_pdrop\": 0.1, \"scale_attn_by_inverse_layer_idx\": false,\n"
    "  \"scale_attn_weights\": true, \"summary_activation\": null, \"torch_dtype\": \"float32\",\n"
    "  \"transformers_version\": \"4.57.0\", \"use_cache\": true, \"vocab_size\": 21\n}\n";

/* A Hugging Face style directory with generation-`gen` weights in the stored
 * layout, possibly broken as the variant says. */
static void write_hf_dir(const char *dir, const hf_variant *v, uint64_t gen, const char *config)
{
    mkdir(dir, 0755);
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (config) spit(path, config);
    const int n = td_model_hf_count(&tiny);
    td_st_writer *w[2] = {NULL, NULL};
    for (int s = 0; s <= v->split; s++) {
        snprintf(path, sizeof path, v->split ? "%s/model-%05d-of-00002.safetensors" : "%s/model.safetensors",
                 dir, s + 1);
        TD_ASSERT_OK(td_st_writer_create(path, &w[s]));
        TD_ASSERT_OK(td_st_writer_add_metadata(w[s], "format", "pt"));
    }
    cJSON *index = cJSON_CreateObject(), *map = cJSON_AddObjectToObject(index, "weight_map");
    for (int i = 0; i < n; i++) {
        if (i == v->skip) continue;
        td_model_hf_tensor p;
        td_model_hf_get(&tiny, i, &p);
        int s = v->split ? i % 2 : 0;
        uint64_t shape[2] = {(uint64_t)p.hf_shape[0], (uint64_t)p.hf_shape[1]};
        if (i == v->linear) {
            shape[0] = (uint64_t)p.hf_shape[1];
            shape[1] = (uint64_t)p.hf_shape[0];
        }
        char name[128];
        snprintf(name, sizeof name, "%s%s", v->prefix, p.name);
        TD_ASSERT_OK(td_st_writer_declare(w[s], name, i == v->as_i32 ? TD_ST_I32 : TD_ST_F32, p.ndim, shape, NULL));
        cJSON_AddStringToObject(map, name, s ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors");
        if (i == v->dup) {
            snprintf(name, sizeof name, "transformer.%s", p.name);
            TD_ASSERT_OK(td_st_writer_declare(w[s], name, TD_ST_F32, p.ndim, shape, NULL));
            }
        if (p.layer >= 0 && (i - 2) % 12 == 0) { /* the causal-mask buffer older versions saved */
            snprintf(name, sizeof name, "%sh.%d.attn.bias", v->prefix, p.layer);
            uint64_t mshape[4] = {1, 1, 8, 8};
            TD_ASSERT_OK(td_st_writer_declare(w[s], name, TD_ST_F32, 4, mshape, NULL));
            }
    }
    uint64_t one[1] = {3};
    if (v->extra) TD_ASSERT_OK(td_st_writer_declare(w[0], v->extra, TD_ST_F32, 1, one, NULL));
    /* Data, in declaration order per file. */
    for (int i = 0, idx[2] = {0, 0}; i < n; i++) {
        if (i == v->skip) continue;
        td_model_hf_tensor p;
        td_model_hf_get(&tiny, i, &p);
        int s = v->split ? i % 2 : 0;
        float tid[4096], hf[4096];
        fill(tid, p.numel, gen, 0, i);
        if (p.transposed)
            for (int64_t o = 0; o < p.shape[0]; o++)
                for (int64_t in = 0; in < p.shape[1]; in++) hf[in * p.shape[0] + o] = tid[o * p.shape[1] + in];
        else
            memcpy(hf, tid, p.hf_numel * sizeof(float));
        TD_ASSERT_OK(td_st_writer_write(w[s], (size_t)idx[s]++, hf, p.hf_numel * 4));
        if (i == v->dup) TD_ASSERT_OK(td_st_writer_write(w[s], (size_t)idx[s]++, hf, p.hf_numel * 4));
        if (p.layer >= 0 && (i - 2) % 12 == 0) {
            float mask[64] = {0};
            TD_ASSERT_OK(td_st_writer_write(w[s], (size_t)idx[s]++, mask, sizeof mask));
        }
    }
    if (v->extra) {
        float three[3] = {0};
        TD_ASSERT_OK(td_st_writer_write(w[0], td_st_writer_next(w[0]), three, sizeof three));
    }
    for (int s = 0; s <= v->split; s++) TD_ASSERT_OK(td_st_writer_commit(w[s]));
    if (v->split) {
        char *text = cJSON_Print(index);
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        spit(path, text);
        cJSON_free(text);
    }
    cJSON_Delete(index);
}

static void expect_open_fail(const char *dir, const td_model_desc *expect, const char *p1, const char *p2)
{
    td_ckpt_reader *r = NULL;
    td_status st = td_ckpt_reader_open(dir, expect, &r);
    if (st == TD_OK) {
        td_ckpt_reader_close(r);
        fail_msg("%s opened; expected '%s'", dir, p1);
    }
    assert_null(r);
    expect_msg(p1);
    if (p2) expect_msg(p2);
}

static void test_hf_layouts(void **state)
{
    const size_t live = td_host_live_allocs();
    td_model_desc hf_cfg = tiny;
    hf_cfg.padded_vocab_size = 21; /* no tidal key: padded = vocab */
    td_model_desc want_padded = {.padded_vocab_size = 32};
    uint64_t gen = 9;
    const char *why;

    hf_variant v = plain;
    v.prefix = "transformer.";
    write_hf_dir(tpath("pref"), &v, 9, hf_config_json);
    why = verify_ckpt(tpath("pref"), &hf_cfg, TD_DTYPE_F32, 0, &gen);
    if (why) fail_msg("prefixed: %s", why);
    /* A padded vocabulary asked by the caller: rows beyond V read as zeros. */
    why = verify_ckpt(tpath("pref"), &tiny, TD_DTYPE_F32, 0, &gen);
    if (why) fail_msg("prefixed, padded: %s", why);
    td_ckpt_reader *r;
    TD_ASSERT_OK(td_ckpt_reader_open(tpath("pref"), &want_padded, &r));
    assert_int_equal(td_ckpt_reader_config(r)->padded_vocab_size, 32);
    assert_int_equal(td_ckpt_reader_config(r)->n_layer, 2);
    td_ckpt_reader_close(r);

    write_hf_dir(tpath("bare"), &plain, 9, hf_config_json);
    why = verify_ckpt(tpath("bare"), &hf_cfg, TD_DTYPE_F32, 0, &gen);
    if (why) fail_msg("bare: %s", why);

    v = plain;
    v.split = 1;
    v.prefix = "transformer.";
    write_hf_dir(tpath("shards"), &v, 9, hf_config_json);
    why = verify_ckpt(tpath("shards"), &hf_cfg, TD_DTYPE_F32, 0, &gen);
    if (why) fail_msg("sharded: %s", why);

    v = plain;
    v.extra = "lm_head.weight";
    write_hf_dir(tpath("head"), &v, 9, hf_config_json);
    why = verify_ckpt(tpath("head"), &hf_cfg, TD_DTYPE_F32, 0, &gen);
    if (why) fail_msg("with lm_head: %s", why);

    /* No config.json: fine with a full expected configuration, an error without. */
    write_hf_dir(tpath("nocfg"), &plain, 9, NULL);
    why = verify_ckpt(tpath("nocfg"), &hf_cfg, TD_DTYPE_F32, 0, &gen);
    if (why) fail_msg("no config: %s", why);
    expect_open_fail(tpath("nocfg"), NULL, "has no config.json", NULL);

    /* Bad inputs, each with its message. */
    v = plain;
    v.skip = 2 + 12 + 11;
    write_hf_dir(tpath("e1"), &v, 9, hf_config_json);
    expect_open_fail(tpath("e1"), NULL, "has no tensor 'h.1.mlp.c_proj.bias'", "shape [16]");
    v = plain;
    v.linear = 2 + 2;
    write_hf_dir(tpath("e2"), &v, 9, hf_config_json);
    expect_open_fail(tpath("e2"), NULL, "tensor 'h.0.attn.c_attn.weight' has shape [48, 16], expected [16, 48]",
                     "transposed");
    v = plain;
    v.as_i32 = 27;
    write_hf_dir(tpath("e3"), &v, 9, hf_config_json);
    expect_open_fail(tpath("e3"), NULL, "tensor 'ln_f.bias' is I32; weights must be F32, BF16 or F16", NULL);
    td_model_desc other = tiny;
    other.n_layer = 3;
    expect_open_fail(tpath("bare"), &other, "n_layer is 2 but the model being trained has 3", NULL);
    other = tiny;
    other.n_embd = 32;
    other.n_head = 4;
    expect_open_fail(tpath("bare"), &other, "n_embd is 16 but the model being trained has 32", NULL);
    v = plain;
    v.extra = "h.5.ln_1.weight";
    write_hf_dir(tpath("e4"), &v, 9, hf_config_json);
    expect_open_fail(tpath("e4"), NULL, "tensor 'h.5.ln_1.weight' belongs to block 5, but the model has n_layer 2", NULL);
    v = plain;
    v.extra = "score.weight";
    write_hf_dir(tpath("e5"), &v, 9, hf_config_json);
    expect_open_fail(tpath("e5"), NULL, "tensor 'score.weight' is not a parameter of this GPT2LMHeadModel model", NULL);
    v = plain;
    v.dup = 5;
    write_hf_dir(tpath("e6"), &v, 9, hf_config_json);
    expect_open_fail(tpath("e6"), NULL, "holds both 'h.0.attn.c_attn.bias' and 'transformer.h.0.attn.c_attn.bias'", NULL);

    char cfg_text[2048];
    const char *act = strstr(hf_config_json, "gelu_new");
    snprintf(cfg_text, sizeof cfg_text, "%.*srelu%s", (int)(act - hf_config_json), hf_config_json, act + 8);
    write_hf_dir(tpath("e7"), &plain, 9, cfg_text);
    expect_open_fail(tpath("e7"), NULL, "activation_function \"relu\" is not supported", NULL);
    /* 4 * n_embd past INT_MAX in the message (UBSan found it in fuzz_hf_config) */
    write_hf_dir(tpath("e7b"), &plain, 9, "{\"model_type\": \"gpt2\", \"n_layer\": 1, \"n_head\": 1, "
                 "\"n_embd\": 898249966, \"n_positions\": 4, \"vocab_size\": 8, \"n_inner\": 5}");
    expect_open_fail(tpath("e7b"), NULL, "n_inner must be null or 4 * n_embd = 3592999864", NULL);
    write_hf_dir(tpath("e8"), &plain, 9, "{\"model_type\": \"mistral\", \"n_layer\": 2}");
    expect_open_fail(tpath("e8"), NULL, "model_type \"mistral\" is not supported; tidal loads gemma, gpt2, llama and qwen2", NULL);
    write_hf_dir(tpath("e9"), &plain, 9, "{\"n_layer\": 2, \"n_head\": 4, \"n_embd\": 16, \"vocab_size\": 21}");
    expect_open_fail(tpath("e9"), NULL, "no \"n_positions\"", NULL);
    write_hf_dir(tpath("e10"), &plain, 9, "not json");
    expect_open_fail(tpath("e10"), NULL, "is not a JSON object", NULL);
    expect_open_fail(tpath("absent"), NULL, "does not exist", NULL);
    mkdir(tpath("empty"), 0755);
    expect_open_fail(tpath("empty"), &tiny, "has no model.safetensors", NULL);

    /* A corrupt model file: the safetensors error, naming the file. */
    char path[600];
    write_hf_dir(tpath("e11"), &plain, 9, hf_config_json);
    snprintf(path, sizeof path, "%s/model.safetensors", tpath("e11"));
    assert_int_equal(truncate(path, 4000), 0);
    expect_open_fail(tpath("e11"), NULL, "model.safetensors", "truncated");

    /* A train state written for another padded vocabulary. */
    TD_ASSERT_OK(write_ckpt(tpath("ck"), &tiny, 3, NULL));
    td_model_desc repad = tiny;
    repad.padded_vocab_size = 64;
    expect_open_fail(tpath("ck"), &repad, "tensor 'master.wte.weight' is F32 [32, 16], expected F32 [64, 16]", NULL);
    assert_int_equal(td_host_live_allocs(), live);
}

/* --- allocation failures ------------------------------------------------------ */

static void test_alloc_failures(void **state)
{
    const size_t live = td_host_live_allocs();
    const char *dir = tpath("ck");
    TD_ASSERT_OK(write_ckpt(dir, &tiny, 1, NULL));
    int done = 0;
    for (long k = 1; k < 400 && !done; k++) {
        td_fault_arm(TD_FAULT_HOST_ALLOC, k);
        td_status st = write_ckpt(dir, &tiny, 2, NULL);
        td_fault_disarm_all();
        done = st == TD_OK;
        if (!done) assert_int_equal(st, TD_ERR_NOMEM);
        assert_string_equal(root_entries(), "ck");
        uint64_t gen;
        const char *why = verify_ckpt(dir, &tiny, TD_DTYPE_F32, 1, &gen);
        if (why) fail_msg("after failure %ld: %s", k, why);
        assert_int_equal(gen, done ? 2 : 1);
        assert_int_equal(td_host_live_allocs(), live);
    }
    assert_true(done);
    done = 0;
    for (long k = 1; k < 400 && !done; k++) {
        td_ckpt_reader *r = NULL;
        td_fault_arm(TD_FAULT_HOST_ALLOC, k);
        td_status st = td_ckpt_reader_open(dir, NULL, &r);
        td_fault_disarm_all();
        done = st == TD_OK;
        if (!done) assert_int_equal(st, TD_ERR_NOMEM);
        td_ckpt_reader_close(r);
        assert_int_equal(td_host_live_allocs(), live);
    }
    assert_true(done);
}

/* --- crash safety ---------------------------------------------------------------- */

typedef struct kill_at {
    td_ckpt_stage stage;
} kill_at;

static void kill_here(td_ckpt_stage stage, void *arg)
{
    if (stage == ((kill_at *)arg)->stage) raise(SIGKILL);
}

/* Runs a save of generation `gen` in a child killed at `stage`. */
static void save_killed_at(const char *dir, uint64_t gen, td_ckpt_replace mode, td_ckpt_stage stage)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        kill_at k = {stage};
        td_ckpt_write_options o = td_ckpt_write_default_options();
        o.replace = mode;
        o.on_stage = kill_here;
        o.stage_arg = &k;
        write_ckpt(dir, &tiny, gen, &o);
        _exit(3); /* the stage was never reached */
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
}

static void test_kill_at_each_stage(void **state)
{
    const size_t live = td_host_live_allocs();
    const char *dir = tpath("ck");
    const td_ckpt_replace modes[2] = {TD_CKPT_REPLACE_AUTO, TD_CKPT_REPLACE_ASIDE};
    uint64_t gen = 1;
    /* First save killed before publishing: no checkpoint at all, and the next save works. */
    save_killed_at(dir, gen, TD_CKPT_REPLACE_AUTO, TD_CKPT_STAGE_FILES_SYNCED);
    expect_open_fail(dir, &tiny, "does not exist", NULL);
    TD_ASSERT_OK(write_ckpt(dir, &tiny, gen, NULL));
    assert_string_equal(root_entries(), "ck");
    for (int m = 0; m < 2; m++)
        for (int s = TD_CKPT_STAGE_TEMP_CREATED; s <= TD_CKPT_STAGE_DONE; s++) {
            if (s == TD_CKPT_STAGE_OLD_ASIDE && modes[m] != TD_CKPT_REPLACE_ASIDE) continue;
            save_killed_at(dir, gen + 1, modes[m], (td_ckpt_stage)s);
            const uint64_t expect = s >= TD_CKPT_STAGE_PUBLISHED ? gen + 1 : gen;
            uint64_t found = 0;
            const char *why = verify_ckpt(dir, &tiny, TD_DTYPE_F32, 1, &found);
            if (why) fail_msg("mode %d, killed at stage %d: %s", m, s, why);
            if (found != expect) fail_msg("mode %d stage %d: generation %llu, expected %llu", m, s,
                                          (unsigned long long)found, (unsigned long long)expect);
            if (s == TD_CKPT_STAGE_OLD_ASIDE) {
                /* No DIR now: readers use DIR.old, recovery moves it back. */
                td_ckpt_reader *r;
                TD_ASSERT_OK(td_ckpt_reader_open(dir, &tiny, &r));
                assert_non_null(strstr(td_ckpt_reader_dir(r), "ck.old"));
                td_ckpt_reader_close(r);
                assert_non_null(strstr(root_entries(), "ck.tmp."));
                TD_ASSERT_OK(td_ckpt_recover(dir));
                assert_string_equal(root_entries(), "ck"); /* the dead save's temporary is gone too */
            }
            gen = expect;
            /* The next save cleans up whatever the dead one left. */
            TD_ASSERT_OK(write_ckpt(dir, &tiny, ++gen, NULL));
            assert_string_equal(root_entries(), "ck");
            assert_int_equal(td_host_live_allocs(), live);
        }
}

/* Kills at random moments of a save large enough to be caught in the middle
 * of its writes, many times; the directory always loads as the old or the
 * new checkpoint, bit for bit. */
static void test_kill9_random_moments(void **state)
{
    const td_model_desc big = {.n_layer = 4, .n_head = 4, .n_embd = 128, .n_positions = 128, .vocab_size = 2000, .padded_vocab_size = 2048}; /* ~1.1M params: 17 MB per save */
    const char *dir = tpath("ck");
    td_ckpt_write_options o = td_ckpt_write_default_options();
    uint64_t gen = 1;
    TD_ASSERT_OK(write_ckpt(dir, &big, gen, &o));
    /* The time a child takes for the whole save, kill points are spread over it. */
    fflush(NULL);
    double t0 = td_now_ms();
    pid_t cal = fork();
    assert_true(cal >= 0);
    if (cal == 0) _exit(write_ckpt(dir, &big, gen + 1, &o) == TD_OK ? 0 : 1);
    int cal_status;
    assert_int_equal(waitpid(cal, &cal_status, 0), cal);
    const double save_ms = td_now_ms() - t0;
    assert_true(WIFEXITED(cal_status) && WEXITSTATUS(cal_status) == 0);
    gen++;
    td_rng rng;
    td_rng_seed(&rng, 2024);
    const int rounds = 20 * td_test_seeds(3);
    int kept_old = 0, got_new = 0, finished = 0;
    for (int it = 0; it < rounds; it++) {
        o.replace = it % 2 ? TD_CKPT_REPLACE_ASIDE : TD_CKPT_REPLACE_AUTO;
        fflush(NULL);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) _exit(write_ckpt(dir, &big, gen + 1, &o) == TD_OK ? 0 : 1);
        long delay_us = (long)(td_rng_uniform(&rng) * save_ms * 1300.0);
        td_sleep_us(delay_us);
        kill(pid, SIGKILL);
        int status;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        if (WIFEXITED(status)) {
            assert_int_equal(WEXITSTATUS(status), 0);
            finished++;
        }
        uint64_t found = 0;
        const char *why = verify_ckpt(dir, &big, TD_DTYPE_F32, 1, &found);
        if (why) fail_msg("round %d (killed after %ld us): %s", it, delay_us, why);
        if (found != gen && found != gen + 1)
            fail_msg("round %d: generation %llu, expected %llu or %llu", it, (unsigned long long)found,
                     (unsigned long long)gen, (unsigned long long)gen + 1);
        if (found == gen) kept_old++;
        else got_new++;
        gen = found == gen ? gen : gen + 1;
        TD_ASSERT_OK(td_ckpt_recover(dir));
    }
    print_message("kill -9 at random moments: %d rounds, save %.0f ms; old kept %d, new %d "
                  "(%d saves finished before the kill)\n", rounds, save_ms, kept_old, got_new, finished);
    TD_ASSERT_OK(write_ckpt(dir, &big, gen + 1, &o));
    assert_string_equal(root_entries(), "ck");
}

/* --- export and import for tests/gpu/check_hf_load.py ------------------------------ */

static const td_model_desc export_cfg = {.n_layer = 2, .n_head = 4, .n_embd = 64, .n_positions = 32, .vocab_size = 100, .padded_vocab_size = 128};

/* tidal's reference loss of a flat parameter buffer on tokens (B, T+1). */
static float ref_loss(const td_model_desc *c, const float *params, const int *seq, int B, int T)
{
    td_model_desc rc = {.n_layer = c->n_layer, .n_head = c->n_head, .n_embd = c->n_embd, .n_positions = c->n_positions, .vocab_size = c->vocab_size, .padded_vocab_size = c->padded_vocab_size};
    int *tokens = malloc(sizeof(int) * (size_t)(B * T)), *targets = malloc(sizeof(int) * (size_t)(B * T));
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            tokens[b * T + t] = seq[b * (T + 1) + t];
            targets[b * T + t] = seq[b * (T + 1) + t + 1];
        }
    float *acts = calloc(td_model_acts_numel(&rc, B, T), sizeof(float));
    float loss = 0;
    TD_ASSERT_OK(td_model_forward(&rc, params, tokens, targets, B, T, acts, &loss, NULL));
    free(acts);
    free(tokens);
    free(targets);
    return loss;
}

/* The export's weights: element j (tidal layout) of parameter p is
 * base + ((p*7919 + j*104729) % 2001 - 1000) * 2.5e-4, base 1 for LayerNorm
 * weights and 0 otherwise, so that activations and logits are far from
 * trivial and a layout mistake moves the loss well past the tolerance. */
static float export_val(const td_model_hf_tensor *p, int index, uint64_t j)
{
    const size_t n = strlen(p->name);
    const int is_ln_w = strstr(p->name, "ln_") && !strcmp(p->name + n - 6, "weight");
    uint64_t k = ((uint64_t)index * 7919u + j * 104729u) % 2001u;
    return (float)((is_ln_w ? 1.0 : 0.0) + (double)((int64_t)k - 1000) * 2.5e-4);
}

static void test_export(void **state)
{
    const char *root = getenv("TD_CKPT_EXPORT_DIR");
    if (!root) td_test_skip("a helper of tests/gpu/check_hf_load.py: runs when TD_CKPT_EXPORT_DIR is set");
    char dir[1024], path[1100];
    mkdir(root, 0755);
    snprintf(dir, sizeof dir, "%s/ckpt", root);
    td_model_desc rc = {.n_layer = 2, .n_head = 4, .n_embd = 64, .n_positions = 32, .vocab_size = 100, .padded_vocab_size = 128};
    float *params = calloc(td_model_params_numel(&rc), sizeof(float));
    td_ckpt_writer *w;
    TD_ASSERT_OK(td_ckpt_writer_begin(dir, &export_cfg, NULL, &w));
    TD_ASSERT_OK(td_ckpt_writer_set_meta_u64(w, "step", 0));
    for (int i = 0; i < td_model_tensor_count(&rc); i++) {
        td_model_tensor t;
        td_model_hf_tensor p;
        td_model_tensor_get(&rc, i, &t);
        TD_ASSERT_OK(td_model_hf_get(&export_cfg, i, &p));
        for (size_t j = 0; j < t.numel; j++) params[t.offset + j] = export_val(&p, i, j);
        TD_ASSERT_OK(td_ckpt_writer_put_weight(w, i, TD_DTYPE_F32, params + t.offset));
        for (int k = 0; k < TD_CKPT_STATE_COUNT; k++)
            TD_ASSERT_OK(td_ckpt_writer_append_state(w, i, (td_ckpt_state)k, params + t.offset, t.numel));
    }
    TD_ASSERT_OK(td_ckpt_writer_commit(w));
    /* The reference model runs on what the reader gives back (wte's padding rows zero). */
    float *loaded = calloc(td_model_params_numel(&rc), sizeof(float));
    td_ckpt_reader *r;
    TD_ASSERT_OK(td_ckpt_reader_open(dir, &export_cfg, &r));
    for (int i = 0; i < td_model_tensor_count(&rc); i++) {
        td_model_tensor t;
        td_model_tensor_get(&rc, i, &t);
        TD_ASSERT_OK(td_ckpt_reader_get_weight(r, i, TD_DTYPE_F32, loaded + t.offset));
        for (size_t j = 0; j < t.numel; j++)
            if (loaded[t.offset + j] != (i == 0 && j >= 100 * 64 ? 0.0f : params[t.offset + j]))
                fail_msg("%s[%zu] read back wrong", t.name, j);
    }
    td_ckpt_reader_close(r);
    enum { B = 2, T = 16 };
    int seq[B * (T + 1)];
    for (int b = 0; b < B; b++)
        for (int t = 0; t <= T; t++) seq[b * (T + 1) + t] = (b * 131 + t * t * 7 + t * 3 + 5) % 100;
    float loss = ref_loss(&export_cfg, loaded, seq, B, T);
    /* The check is not vacuous: a transposed c_attn weight changes the loss a lot. */
    td_model_tensor qkv;
    td_model_tensor_get(&rc, 2 + 2, &qkv);
    float *wrong = malloc(qkv.numel * sizeof(float));
    for (int o = 0; o < 192; o++)
        for (int i = 0; i < 64; i++) wrong[i * 192 + o] = loaded[qkv.offset + (size_t)o * 64 + (size_t)i];
    memcpy(loaded + qkv.offset, wrong, qkv.numel * sizeof(float));
    float loss_wrong = ref_loss(&export_cfg, loaded, seq, B, T);
    print_message("tidal loss %.6f; with h.0.attn.c_attn.weight mis-transposed %.6f\n", loss, loss_wrong);
    assert_true(fabsf(loss - loss_wrong) > 1e-2f);
    free(wrong);
    cJSON *o = cJSON_CreateObject(), *toks = cJSON_AddArrayToObject(o, "tokens");
    for (int b = 0; b < B; b++) cJSON_AddItemToArray(toks, cJSON_CreateIntArray(seq + b * (T + 1), T + 1));
    cJSON_AddNumberToObject(o, "loss", loss);
    cJSON_AddStringToObject(o, "checkpoint", dir);
    cJSON_AddStringToObject(o, "values", "element j (tidal layout) of parameter p: base + ((p*7919 + "
                                         "j*104729) % 2001 - 1000) * 2.5e-4 as float32, base 1 for "
                                         "LayerNorm weights, 0 otherwise");
    char *text = cJSON_Print(o);
    snprintf(path, sizeof path, "%s/expected.json", root);
    spit(path, text);
    print_message("exported %s, tidal loss %.6f -> %s\n", dir, loss, path);
    cJSON_free(text);
    cJSON_Delete(o);
    free(params);
    free(loaded);
}

static void test_import(void **state)
{
    const char *dir = getenv("TD_CKPT_IMPORT_DIR"), *tok_path = getenv("TD_CKPT_IMPORT_TOKENS");
    const char *out = getenv("TD_CKPT_IMPORT_OUT");
    if (!dir || !tok_path || !out)
        td_test_skip("a helper of tests/gpu/check_hf_load.py: runs when TD_CKPT_IMPORT_DIR, _TOKENS and _OUT are set");
    td_ckpt_reader *r;
    TD_ASSERT_OK(td_ckpt_reader_open(dir, NULL, &r));
    td_model_desc c = *td_ckpt_reader_config(r);
    td_ckpt_reader_close(r);
    c.padded_vocab_size = (c.vocab_size + 63) / 64 * 64; /* load into a padded layout, as training does */
    TD_ASSERT_OK(td_ckpt_reader_open(dir, &c, &r));
    td_model_desc rc = {.n_layer = c.n_layer, .n_head = c.n_head, .n_embd = c.n_embd, .n_positions = c.n_positions, .vocab_size = c.vocab_size, .padded_vocab_size = c.padded_vocab_size};
    float *params = calloc(td_model_params_numel(&rc), sizeof(float));
    for (int i = 0; i < td_model_tensor_count(&rc); i++) {
        td_model_tensor t;
        td_model_tensor_get(&rc, i, &t);
        TD_ASSERT_OK(td_ckpt_reader_get_weight(r, i, TD_DTYPE_F32, params + t.offset));
    }
    td_ckpt_reader_close(r);
    FILE *f = fopen(tok_path, "rb");
    assert_non_null(f);
    static char text[1 << 20];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    cJSON *j = cJSON_Parse(text), *toks = cJSON_GetObjectItem(j, "tokens");
    assert_non_null(toks);
    const int B = cJSON_GetArraySize(toks), T = cJSON_GetArraySize(cJSON_GetArrayItem(toks, 0)) - 1;
    int *seq = malloc(sizeof(int) * (size_t)(B * (T + 1)));
    for (int b = 0; b < B; b++)
        for (int t = 0; t <= T; t++) seq[b * (T + 1) + t] = cJSON_GetArrayItem(cJSON_GetArrayItem(toks, b), t)->valueint;
    cJSON_Delete(j);
    float loss = ref_loss(&c, params, seq, B, T);
    f = fopen(out, "wb");
    assert_non_null(f);
    fprintf(f, "{\"loss\": %.9g, \"n_layer\": %d, \"n_embd\": %d, \"vocab_size\": %d, \"padded_vocab_size\": %d}\n",
            loss, c.n_layer, c.n_embd, c.vocab_size, c.padded_vocab_size);
    fclose(f);
    print_message("imported %s, tidal loss %.6f -> %s\n", dir, loss, out);
    free(seq);
    free(params);
}

int main(void)
{
    const struct CMUnitTest gpu_helpers[] = {
        cmocka_unit_test(test_export),
        cmocka_unit_test(test_import),
    };
    if (getenv("TD_CKPT_EXPORT_DIR") || getenv("TD_CKPT_IMPORT_DIR"))
        return cmocka_run_group_tests(gpu_helpers, NULL, NULL);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_param_table),
        cmocka_unit_test_setup_teardown(test_round_trip, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_writer_misuse, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_foreign_directory_kept, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_save_target, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_hf_layouts, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_alloc_failures, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_kill_at_each_stage, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_kill9_random_moments, setup_dir, teardown_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
