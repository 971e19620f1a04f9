/* Frozen tensors (--freeze, td_train_config.freeze) on the cpu backend: a
 * run with some tensors frozen equals a reference that computes the whole
 * model's gradients and runs AdamW (with the global norm) over the others
 * alone; frozen tensors stay bit for bit as initialised, have no grad,
 * master, m or v, and offloading them changes nothing; a save and resume
 * continues bit-exactly and its train state holds no frozen tensor's
 * state; the plan counts them at their storage alone; bad patterns are
 * refused naming what is wrong. */
#include "td_train_test.h"
#include "tidal/checkpoint.h"
#include "tidal/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static td_train_config small(const char *family)
{
    td_train_config c = td_train_default_config();
    c.model = (td_model_desc){ .n_layer = 3, .n_head = 4, .n_embd = 32, .n_positions = 32, .vocab_size = 61,
                               .padded_vocab_size = 64 };
    td_model_desc_set_family(&c.model, family);
    if (strcmp(family, "gpt2")) {
        c.model.n_kv_head = 2;
        c.model.n_inner = 40;
        c.model.norm_eps = 1e-6f;
        c.model.rope_theta = 10000.0f;
    }
    c.micro_batch = 2;
    c.seq_len = 16;
    c.backend = TD_BACKEND_CPU;
    c.mm.min_chunk_numel = 1024;
    c.mm.max_chunk_numel = 8192;
    c.optim.lr.lr = 3e-3;
    c.optim.lr.warmup_steps = 0;
    c.optim.adam.weight_decay = 0.5;
    c.threads = 2;
    return c;
}

/* Every tensor's values in the trainer, into a flat buffer of the layout. */
static void trainer_params(td_trainer *t, const td_model_desc *mc, float *out)
{
    TD_ASSERT_OK(td_trainer_finish_update(t));
    td_memmgr *mm = td_trainer_memmgr(t);
    for (int i = 0; i < td_model_tensor_count(mc); i++) {
        td_model_tensor tt;
        int pid;
        void *h;
        td_model_tensor_get(mc, i, &tt);
        td_trainer_tensor_ids(t, i, &pid, NULL, NULL, NULL);
        TD_ASSERT_OK(td_memmgr_host_access(mm, &pid, 1, TD_ACCESS_READ, &h));
        memcpy(out + tt.offset, h, tt.numel * 4);
    }
}

static td_trainer *train(const td_train_config *c, int steps, double *losses, td_test_batches *b)
{
    td_trainer *t;
    TD_ASSERT_OK(td_trainer_create(c, &t));
    for (int s = 0; s < steps; s++) {
        td_step_result r;
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, b, &r));
        losses[s] = r.loss;
    }
    return t;
}

static const struct { const char *family; const char *pat[3]; } cases[] = {
    {"llama", {"model.layers.0.*", "model.embed_tokens.weight", "model.layers.2.mlp.*"}},
    {"qwen2", {"model.layers.1.self_attn.*", "model.norm.weight", NULL}},
    /* GPT-2: the tied wte frozen (the head's matrix too), wpe trained; a transformer. prefix */
    {"gpt2", {"transformer.wte.weight", "h.1.attn.c_attn.*", NULL}},
};

static void test_matches_reference_and_frozen_stay(void **state)
{
    enum { STEPS = 4 };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        td_train_config c = small(cases[k].family);
        int np = 0;
        while (np < 3 && cases[k].pat[np]) np++;
        c.freeze = cases[k].pat;
        c.n_freeze = np;
        const td_model_desc *mc = &c.model;
        int n = td_model_tensor_count(mc);
        uint8_t *frozen = malloc((size_t)n);
        TD_ASSERT_OK(td_train_frozen(&c, frozen));
        int nf = td_train_frozen_count(&c, frozen);
        assert_true(nf > 0 && nf < n);
        size_t numel = td_model_params_numel(mc);
        float *want = malloc(numel * 4), *got = malloc(numel * 4), *init = malloc(numel * 4);
        double lw[STEPS], lg[STEPS];
        uint8_t *trains = malloc((size_t)n);
        for (int i = 0; i < n; i++) trains[i] = !frozen[i];
        td_test_reference_train(&c, trains, STEPS, lw, want);
        free(trains);
        td_model_init(mc, init, c.seed);
        td_test_batches b = td_test_batches_of(&c, 99);
        td_trainer *t = train(&c, STEPS, lg, &b);
        for (int s = 0; s < STEPS; s++)
            if (!(fabs(lg[s] - lw[s]) <= 2e-6 * fabs(lw[s])))
                fail_msg("%s step %d: trainer %.9g, reference %.9g", cases[k].family, s, lg[s], lw[s]);
        assert_true(lg[STEPS - 1] < lg[0]);
        trainer_params(t, mc, got);
        td_memmgr *mm = td_trainer_memmgr(t);
        for (int i = 0; i < n; i++) {
            td_model_tensor tt;
            int pid, gid, mid, vid;
            td_model_tensor_get(mc, i, &tt);
            td_trainer_tensor_ids(t, i, &pid, &gid, &mid, &vid);
            if (frozen[i]) { /* its storage alone, never changed */
                assert_int_equal(gid, -1);
                assert_int_equal(mid, -1);
                assert_int_equal(vid, -1);
                assert_int_equal(td_memmgr_chunk_role(mm, td_memmgr_tensor_chunk(mm, pid)), TD_TENSOR_OTHER);
                assert_memory_equal(got + tt.offset, init + tt.offset, tt.numel * 4);
                continue;
            }
            assert_true(gid >= 0 && mid >= 0 && vid >= 0);
            int moved = 0;
            for (size_t e = 0; e < tt.numel; e++) {
                float d = got[tt.offset + e] - want[tt.offset + e];
                if (!(fabsf(d) <= 1e-5f)) fail_msg("%s %s[%zu]: trainer %.9g, reference %.9g", cases[k].family,
                                                   tt.name, e, got[tt.offset + e], want[tt.offset + e]);
                moved |= got[tt.offset + e] != init[tt.offset + e];
            }
            if (tt.numel > 1 && !moved) fail_msg("%s %s did not train", cases[k].family, tt.name);
        }
        /* No grad, master or moment of a frozen tensor is registered anywhere. */
        size_t grad_numel = 0;
        for (int c2 = 0; c2 < td_memmgr_chunk_count(mm); c2++)
            if (td_memmgr_chunk_role(mm, c2) == TD_TENSOR_GRAD) grad_numel += td_memmgr_chunk_numel_used(mm, c2);
        size_t trainable = 0;
        for (int i = 0; i < n; i++) {
            td_model_tensor tt;
            td_model_tensor_get(mc, i, &tt);
            if (!frozen[i]) trainable += tt.numel;
        }
        assert_true(grad_numel >= trainable && grad_numel < numel);
        td_trainer_destroy(t);
        free(frozen); free(want); free(got); free(init);
    }
}

/* Frozen chunks streamed through a budget just above one access's need
 * (and recomputed blocks) give the same bits as everything resident. */
static void test_offloaded_frozen_is_bit_identical(void **state)
{
    enum { STEPS = 3 };
    td_train_config c = small("llama");
    const char *pat[] = {"model.layers.[01].*"};
    c.freeze = pat;
    c.n_freeze = 1;
    c.mm.placement = TD_PLACEMENT_CUDA;
    c.gpu_budget = 64 * TD_MiB;
    double ref[STEPS], got[STEPS];
    td_test_train(&c, STEPS, 7, ref, NULL);
    td_train_config v = td_test_offloaded_config(&c, 7);
    td_memmgr_stats st;
    td_test_train(&v, STEPS, 7, got, &st);
    assert_memory_equal(got, ref, sizeof got);
    assert_true(st.evictions > 0);
    /* the AdamW thread with transient grads: the same again */
    v.optim.max_grad_norm = 0;
    v.adam_thread = -1;
    td_test_train(&v, STEPS, 7, ref, NULL);
    v.adam_thread = 1;
    td_test_train(&v, STEPS, 7, got, NULL);
    assert_memory_equal(got, ref, sizeof got);
}

static void test_save_resume(void **state)
{
    enum { STEPS = 5, CUT = 2 };
    td_train_config c = small("qwen2");
    const char *pat[] = {"model.layers.0.*", "model.embed_tokens.weight"};
    c.freeze = pat;
    c.n_freeze = 2;
    double straight[STEPS], part[STEPS];
    td_test_batches b = td_test_batches_of(&c, 99);
    td_trainer *t = train(&c, STEPS, straight, &b);
    td_trainer_destroy(t);

    char dir[] = "/tmp/td_freeze_XXXXXX", ckpt[300];
    assert_non_null(mkdtemp(dir));
    snprintf(ckpt, sizeof ckpt, "%s/ck", dir);
    b = td_test_batches_of(&c, 99);
    t = train(&c, CUT, part, &b);
    TD_ASSERT_OK(td_trainer_save(t, ckpt, 1, NULL));
    td_trainer_destroy(t);
    /* the train state holds the trainable tensors' state alone */
    td_ckpt_reader *r;
    TD_ASSERT_OK(td_ckpt_reader_open(ckpt, NULL, &r));
    float one;
    int emb = td_model_hf_find(&c.model, "model.embed_tokens.weight");
    int q1 = td_model_hf_find(&c.model, "model.layers.1.self_attn.q_proj.weight");
    assert_true(emb >= 0 && q1 >= 0);
    assert_int_not_equal(td_ckpt_reader_read_state(r, emb, TD_CKPT_STATE_ADAM_M, 0, 1, &one), TD_OK);
    assert_non_null(strstr(td_error_msg(), "frozen"));
    TD_ASSERT_OK(td_ckpt_reader_read_state(r, q1, TD_CKPT_STATE_ADAM_M, 0, 1, &one));
    td_ckpt_reader_close(r);

    TD_ASSERT_OK(td_trainer_create(&c, &t));
    TD_ASSERT_OK(td_trainer_load(t, ckpt, 1, NULL));
    for (int s = CUT; s < STEPS; s++) {
        td_step_result res;
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, &b, &res));
        assert_memory_equal(&res.loss, &straight[s], sizeof(double));
    }
    td_trainer_destroy(t);
    /* resuming with layer 0 trained: its state is not there, and the error says so */
    td_train_config d = c;
    d.n_freeze = 1;
    d.freeze = pat + 1;
    TD_ASSERT_OK(td_trainer_create(&d, &t));
    assert_int_not_equal(td_trainer_load(t, ckpt, 1, NULL), TD_OK);
    assert_non_null(strstr(td_error_msg(), "same --freeze"));
    /* its weights start a run (--init) */
    TD_ASSERT_OK(td_trainer_load(t, ckpt, 0, NULL));
    td_trainer_destroy(t);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

static void test_plan_counts_storage_only(void **state)
{
    td_train_config c = small("llama");
    td_train_plan all, fz;
    TD_ASSERT_OK(td_train_plan_make(&c, 0, &all));
    const char *pat[] = {"model.layers.*", "model.embed_tokens.weight"};
    c.freeze = pat;
    c.n_freeze = 2;
    TD_ASSERT_OK(td_train_plan_make(&c, 0, &fz));
    uint8_t frozen[64];
    TD_ASSERT_OK(td_train_frozen(&c, frozen));
    size_t fnumel = 0;
    for (int i = 0; i < td_model_tensor_count(&c.model); i++) {
        td_model_tensor tt;
        td_model_tensor_get(&c.model, i, &tt);
        if (frozen[i]) fnumel += tt.numel;
    }
    assert_int_equal(fz.frozen_params, fnumel);
    assert_int_equal(all.frozen_params, 0);
    /* frozen storage: fp32 params here, 4 bytes each (host copies end at each chunk's last tensor) */
    assert_true(fz.host_role_bytes[TD_TENSOR_OTHER] >= fnumel * 4);
    assert_true(fz.host_role_bytes[TD_TENSOR_OTHER] < fnumel * 4 + 4096 * 8);
    size_t opt_all = all.host_role_bytes[TD_TENSOR_ADAM_M] + all.host_role_bytes[TD_TENSOR_ADAM_V];
    size_t opt_fz = fz.host_role_bytes[TD_TENSOR_ADAM_M] + fz.host_role_bytes[TD_TENSOR_ADAM_V];
    assert_true(opt_fz <= (all.params - fnumel) * 8 + 4096 * 8);
    assert_true(opt_fz < opt_all / 4);
    assert_true(fz.host_role_bytes[TD_TENSOR_GRAD] < all.host_role_bytes[TD_TENSOR_GRAD] / 4);
    assert_true(fz.flops_per_step < all.flops_per_step);
}

static void expect_refused(const td_train_config *c, const char *needle)
{
    td_trainer *t = NULL;
    assert_int_not_equal(td_trainer_create(c, &t), TD_OK);
    assert_null(t);
    if (!strstr(td_error_msg(), needle)) fail_msg("expected '%s' in: %s", needle, td_error_msg());
}

static void test_bad_patterns(void **state)
{
    td_train_config c = small("llama");
    const char *none[] = {"model.layers.9.*"};
    c.freeze = none;
    c.n_freeze = 1;
    expect_refused(&c, "matches no tensor");
    const char *split[] = {"*.q_proj.weight"}; /* q alone of the fused q|k|v */
    c.freeze = split;
    expect_refused(&c, "freeze both or neither");
    const char *gate[] = {"model.layers.0.mlp.gate_proj.weight"};
    c.freeze = gate;
    expect_refused(&c, "up_proj");
    const char *all[] = {"*"};
    c.freeze = all;
    expect_refused(&c, "nothing is left to train");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_reference_and_frozen_stay),
        cmocka_unit_test(test_offloaded_frozen_is_bit_identical),
        cmocka_unit_test(test_save_resume),
        cmocka_unit_test(test_plan_counts_storage_only),
        cmocka_unit_test(test_bad_patterns),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
