/* Every registered model family (include/tidal/family.h), whatever it is:
 * the properties its table must have for the rest of tidal to work through
 * it, so a new family file is tested by being there.
 *   - the registry finds it by name and a description made for it is its;
 *   - every preset passes its checks, its description's layout is
 *     contiguous and its tensors are what the table's kinds and shapes say;
 *   - its Hugging Face tensors cover every element of every tidal tensor
 *     (the embedding's and head's padding rows apart) exactly once, and
 *     each is found again by its name;
 *   - config.json written for each preset reads back as the same
 *     description (memcmp), and td_model_desc_differs agrees;
 *   - the CPU reference of its smallest preset (one block, short
 *     sequences): the model's directional derivative equals its gradient,
 *     and the block API recomputes the whole model's activations bit for bit;
 *   - its exec tables size what their calls need. */
#include "td_test.h"
#include "tidal/family.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float *fvec(size_t n) { float *p = calloc(n ? n : 1, sizeof(float)); assert_non_null(p); return p; }

static void test_registry(void **state)
{
    assert_true(td_model_family_count() >= 4);
    for (int i = 0; i < td_model_family_count(); i++) {
        const td_model_family *f = td_model_family_at(i);
        assert_non_null(f->name);
        assert_true(td_model_family_find(f->name) == f);
        assert_non_null(f->architecture);
        assert_non_null(f->cpu);
        assert_true(f->n_presets >= 1);
        if (i) assert_true(strcmp(td_model_family_at(i - 1)->name, f->name) < 0); /* name order */
        td_model_desc d = {.n_layer = 1, .n_head = 4, .n_embd = 64, .n_positions = 16, .vocab_size = 10,
                           .padded_vocab_size = 64};
        TD_ASSERT_OK(td_model_desc_set_family(&d, f->name));
        assert_true(td_model_family_of(&d) == f);
#ifdef TD_HAVE_CUDA
        assert_non_null(f->cuda);
#else
        assert_null(f->cuda);
#endif
    }
    td_model_desc d = {0};
    assert_string_equal(td_model_family_name(td_model_family_of(&d)), "gpt2"); /* the zero description */
    assert_int_equal(td_model_desc_set_family(&d, "mamba"), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "gpt2"));
    assert_null(td_model_family_find("mamba"));
    const char *const *names = td_model_preset_names();
    int n = 0;
    for (; names[n]; n++) TD_ASSERT_OK(td_model_preset(names[n], &d));
    int want = 0;
    for (int i = 0; i < td_model_family_count(); i++) want += td_model_family_at(i)->n_presets;
    assert_int_equal(n, want);
}

/* Every element of tidal tensor i that the files hold is hit by exactly one
 * of its Hugging Face parts. */
static void check_coverage(const td_model_desc *d, const char *preset)
{
    const int nt = td_model_tensor_count(d), nh = td_model_hf_count(d);
    size_t *covered = calloc((size_t)nt, sizeof *covered);
    assert_non_null(covered);
    for (int j = 0; j < nh; j++) {
        td_model_hf_tensor h;
        TD_ASSERT_OK(td_model_hf_get(d, j, &h));
        assert_int_equal(td_model_hf_find(d, h.name), j);
        assert_true(h.tensor >= 0 && h.tensor < nt);
        td_model_tensor t;
        td_model_tensor_get(d, h.tensor, &t);
        /* parts come in row order, each starting where the last ended */
        if (h.offset != covered[h.tensor])
            fail_msg("%s: %s starts at %llu of %s, expected %zu", preset, h.name, (unsigned long long)h.offset, t.name,
                     covered[h.tensor]);
        covered[h.tensor] += h.numel;
        assert_true(h.hf_numel <= h.numel);
        assert_true(h.transposed == t.hf_transposed);
    }
    for (int i = 0; i < nt; i++) {
        td_model_tensor t;
        td_model_tensor_get(d, i, &t);
        if (covered[i] != t.numel) fail_msg("%s: %s has %zu elements, its parts %zu", preset, t.name, t.numel, covered[i]);
    }
    free(covered);
}

static void test_presets_layout_and_files(void **state)
{
    for (const char *const *name = td_model_preset_names(); *name; name++) {
        td_model_desc d;
        TD_ASSERT_OK(td_model_preset(*name, &d));
        TD_ASSERT_OK(td_model_desc_check(&d));
        const td_model_family *f = td_model_family_of(&d);
        /* the layout: contiguous, blocks of one span, shapes as the table says */
        size_t at = 0, off, span;
        td_model_block_span(&d, 1 % d.n_layer, &off, &span);
        for (int i = 0; i < td_model_tensor_count(&d); i++) {
            td_model_tensor t;
            td_model_tensor_get(&d, i, &t);
            assert_int_equal(t.offset, at);
            int shape[2] = {0, 0};
            assert_int_equal(f->shape(&d, t.kind, shape), t.ndim);
            assert_int_equal(t.numel, (size_t)shape[0] * (t.ndim == 2 ? (size_t)shape[1] : 1));
            at += t.numel;
        }
        assert_int_equal(at, td_model_params_numel(&d));
        assert_true(span * (size_t)d.n_layer < at);
        check_coverage(&d, *name);
        /* config.json out and in */
        td_hf_config *c;
        char *text;
        TD_ASSERT_OK(td_hf_config_create(*name, &c));
        TD_ASSERT_OK(td_model_config_put(&d, c));
        TD_ASSERT_OK(td_hf_config_print(c, &text));
        td_hf_config_free(c);
        td_hf_config *back;
        td_model_desc e;
        TD_ASSERT_OK(td_hf_config_parse(text, strlen(text), *name, &back));
        TD_ASSERT_OK(td_model_config_get(back, &e));
        td_hf_config_free(back);
        td_free(text);
        if (memcmp(&d, &e, sizeof d)) fail_msg("%s: config.json reads back as another description", *name);
        assert_null(td_model_desc_differs(&d, &e));
        e.n_layer++;
        assert_string_equal(td_model_desc_differs(&d, &e), "n_layer");
    }
}

/* The smallest preset of each family: one block, a vocabulary of 256, short sequences. */
static td_model_desc smallest(const td_model_family *f)
{
    td_model_desc best = {0};
    size_t least = (size_t)-1;
    for (int k = 0; k < f->n_presets; k++) {
        td_model_desc d;
        TD_ASSERT_OK(td_model_preset(f->presets[k].name, &d));
        if (td_model_params_numel(&d) < least) least = td_model_params_numel(&d), best = d;
    }
    best.n_layer = 1;
    best.vocab_size = 256;
    best.padded_vocab_size = td_model_pad_vocab(256);
    best.n_positions = best.n_positions < 64 ? best.n_positions : 64;
    return best;
}

static void test_cpu_reference(void **state)
{
    enum { B = 1, T = 6 };
    for (int i = 0; i < td_model_family_count(); i++) {
        const td_model_desc d = smallest(td_model_family_at(i));
        const size_t np = td_model_params_numel(&d);
        float *p = fvec(np), *g = fvec(np), *u = fvec(np), *q = fvec(np);
        float *acts = fvec(td_model_acts_numel(&d, B, T)), *scratch = fvec(td_model_scratch_numel(&d, B, T));
        int tok[T], tgt[T];
        td_rng rng;
        td_rng_seed(&rng, 21 + (uint64_t)i);
        td_model_init(&d, p, 3);
        for (size_t k = 0; k < np; k++) p[k] += (float)(td_rng_uniform(&rng) - 0.5) * 0.1f;
        for (int t = 0; t < T; t++) {
            tok[t] = (int)td_rng_below(&rng, (uint64_t)d.vocab_size);
            tgt[t] = (int)td_rng_below(&rng, (uint64_t)d.vocab_size);
        }
        float loss, lp, lm;
        TD_ASSERT_OK(td_model_forward(&d, p, tok, tgt, B, T, acts, &loss, NULL));
        /* the block API recomputes block 0's activations from its input */
        const size_t NC = (size_t)B * T * d.n_embd, na = td_model_block_acts_numel(&d, B, T);
        float *a2 = fvec(na), *y = fvec(NC);
        td_model_block w;
        td_model_block_acts a;
        size_t off, span;
        td_model_block_span(&d, 0, &off, &span);
        td_model_block_view(&d, p + off, &w);
        td_model_block_acts_view(&d, B, T, a2, &a);
        td_model_block_forward(&d, &w, &a, acts, y, NULL, B, T); /* x_0 is acts' start */
        assert_memory_equal(a2, acts + NC, na * sizeof(float));
        assert_memory_equal(y, acts + NC + na, NC * sizeof(float));
        TD_ASSERT_OK(td_model_backward(&d, p, g, tok, tgt, 1.0f / T, B, T, acts, scratch));
        double gu = 0;
        for (size_t k = 0; k < np; k++) gu += (double)g[k] * (u[k] = (float)(2.0 * td_rng_uniform(&rng) - 1.0));
        const double e = 0.3 / sqrt((double)np); /* a step of about 0.17 whatever the model's size */
        for (size_t k = 0; k < np; k++) q[k] = p[k] + (float)e * u[k];
        TD_ASSERT_OK(td_model_forward(&d, q, tok, tgt, B, T, acts, &lp, NULL));
        for (size_t k = 0; k < np; k++) q[k] = p[k] - (float)e * u[k];
        TD_ASSERT_OK(td_model_forward(&d, q, tok, tgt, B, T, acts, &lm, NULL));
        const double num = ((double)lp - lm) / (2 * e);
        printf("  %-6s loss %.5f, directional derivative %.6g, gradient %.6g\n", td_model_family_at(i)->name, loss,
               num, gu);
        assert_true(fabs(num - gu) < 5e-3 * fabs(gu) + 2e-3);
        free(p); free(g); free(u); free(q); free(acts); free(scratch); free(a2); free(y);
    }
}

/* The exec tables: the CPU reference's sizes are its own numel functions'; a
 * family with constants fills exactly their bytes. */
static void test_exec_sizes(void **state)
{
    for (int i = 0; i < td_model_family_count(); i++) {
        const td_model_family *f = td_model_family_at(i);
        const td_model_desc d = smallest(f);
        const td_model_exec *cpu = td_model_exec_of(&d, 0);
        assert_int_equal(cpu->block_acts_bytes(&d, 2, 8, TD_DTYPE_F32), td_model_block_acts_numel(&d, 2, 8) * 4);
        assert_true(cpu->scratch_bytes(&d, 2, 8, TD_DTYPE_F32, 2) >= (size_t)2 * 8 * d.n_embd * 4); /* the head's dlnf */
        assert_true(td_model_exec_of(&d, 1) == f->cuda);
        if (f->cuda) {
            const size_t n = f->cuda->consts_bytes(&d);
            unsigned char *host = malloc(n + 16);
            assert_non_null(host);
            memset(host, 0xA5, n + 16);
            f->cuda->consts_fill(&d, host);
            for (size_t k = n; k < n + 16; k++) assert_int_equal(host[k], 0xA5);
            free(host);
            assert_true(f->cuda->block_acts_bytes(&d, 2, 8, TD_DTYPE_BF16) > 0);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_registry),
        cmocka_unit_test(test_presets_layout_and_files),
        cmocka_unit_test(test_cpu_reference),
        cmocka_unit_test(test_exec_sizes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
