/* Every registered model family's CUDA compute (family.h, td_model_exec)
 * against its CPU reference, call by call, in fp32: the embedding forward
 * and backward, the block forward (output and activations' effect through
 * the backward), its recompute (y NULL) and backward (dx and every
 * parameter gradient), the head forward (logits) and backward; then all
 * again with each row holding packed documents (run.pos).  The family's
 * smallest preset with one block and a vocabulary of 256, its params
 * perturbed away from init so that gains and biases matter.  A new family
 * is tested by being in the registry.  The rotary families once more with a
 * padding token among the inputs (config.json's pad_token_id): its embedding
 * row keeps what it held (here random start gradients) and the other rows
 * sum the lookup as the CPU does.  Then each family with LoRA adapters of
 * rank 4 (alpha 8), the base frozen as the trainer freezes it (its
 * gradients NULL on both sides): on every linear module (q, k and v are
 * row ranges of the fused qkv, gate and up of gate|up), and on a few (v and
 * up, ranges that start past row 0, with o and down; k and gate; GPT-2's
 * c_attn and c_fc, c_proj's backward keeping its fused GELU derivative;
 * both c_proj, the fc GEMM keeping its fused GELU): the block's output, its dx and every
 * adapter's gradient against the CPU reference (model/lora.c), the adapters'
 * xa rebuilt by the recompute.  Last, adapters on every module with LoRA
 * dropout 0.25 under one key on both sides (model.h's hash: the same
 * masks): each target's kept xa = drop(x) A^T (within the block output's
 * 2e-4: a wrong mask moves it by tenths), and the output,
 * dx and the adapters' gradients as above; the dropout changed xa. */
#include "td_test.h"
#include "tidal/family.h"
#include "tidal/ops_cuda.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 2, T = 16, N = B * T };

static float *fvec(size_t n) { float *p = calloc(n ? n : 1, sizeof(float)); assert_non_null(p); return p; }

static void *dev(size_t bytes)
{
    void *p = NULL;
    assert_int_equal(cudaMalloc(&p, bytes ? bytes : 1), cudaSuccess);
    assert_int_equal(cudaMemset(p, 0, bytes ? bytes : 1), cudaSuccess);
    return p;
}

static void *dev_copy(const float *h, size_t n)
{
    void *p = dev(n * 4);
    assert_int_equal(cudaMemcpy(p, h, n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    return p;
}

/* The largest |gpu - cpu| against the largest |cpu|, which must be within rel. */
static int packed_run; /* the rows hold packed documents (run.pos set): labels say so */

static void compare(const char *fam, const char *what, const void *d_got, const float *want, size_t n, double rel)
{
    float *got = fvec(n);
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    assert_int_equal(cudaMemcpy(got, d_got, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    double err = 0, scale = 0;
    for (size_t i = 0; i < n; i++) {
        err = fmax(err, fabs((double)got[i] - want[i]));
        scale = fmax(scale, fabs((double)want[i]));
    }
    const char *how = packed_run ? " (packed)" : "";
    print_message("%-6s %-26s%s max |diff| %.3g of %.3g\n", fam, what, how, err, scale);
    if (!(err <= rel * scale + 1e-6)) fail_msg("%s %s%s: max |diff| %g of %g", fam, what, how, err, scale);
    free(got);
}

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
    best.padded_vocab_size = 256;
    if (best.n_positions < T) best.n_positions = T;
    return best;
}

/* Tensor pointers in layout order for a section starting at layout index first. */
static void ptrs(const td_model_desc *d, void *base, int first, int count, void **out)
{
    for (int k = 0; k < count; k++) {
        td_model_tensor t;
        td_model_tensor_get(d, first + k, &t);
        out[k] = (float *)base + t.offset;
    }
}

/* packed: each row holds documents (row 0: 5, 1, 10 tokens; row 1: 16),
 * their positions restarting, passed in run.pos to both sides. */
/* target j's xa (N,R) on the GPU: after the family's acts, j strides apart */
static const void *gpu_xa(const td_model_family *f, const td_model_desc *d, void *d_acts, int j)
{
    td_ops_cuda_block_acts a;
    if (f->traits.rope) td_ops_cuda_rotary_block_acts_view(d, B, T, TD_DTYPE_F32, d_acts, &a);
    else td_ops_cuda_block_acts_view(d, B, T, TD_DTYPE_F32, d_acts, &a);
    return (const char *)a.lora_xa + (size_t)j * td_ops_cuda_lora_xa_stride(d, B, T, TD_DTYPE_F32);
}

/* lora: 0 none, 1 on every linear module, 2 and 3 on a few (see the top), 4 on every one with dropout 0.25. */
static void run_family(const td_model_family *f, td_ops_cuda *ops, void *stream, int packed, int with_pad, int lora)
{
    packed_run = packed;
    static const int docs[B][4] = {{5, 1, 10, 0}, {16, 0, 0, 0}};
    int pos[N];
    for (int b = 0; b < B; b++)
        for (int k = 0, t = 0; k < 4 && docs[b][k]; k++)
            for (int i = 0; i < docs[b][k]; i++) pos[b * T + t++] = i;
    td_model_desc d = smallest(f);
    if (lora) {
        const char *few = f->traits.rope ? (lora == 2 ? "v_proj,o_proj,up_proj,down_proj" : "k_proj,gate_proj")
                                         : (lora == 2 ? "c_attn,c_fc" : "c_proj");
        TD_ASSERT_OK(td_model_lora_set(&d, 4, 8.0f, lora == 4 ? 0.25f : 0.0f, lora == 1 || lora == 4 ? NULL : few));
        char mods[256];
        td_model_lora_modules(&d, mods, sizeof mods);
        print_message("%-6s LoRA rank 4 on %s (%d targets)\n", f->name, mods, td_model_lora_count(&d));
        assert_true(td_model_lora_count(&d) >= 2);
    }
    const td_model_exec *cpu = td_model_exec_of(&d, 0), *gpu = td_model_exec_of(&d, 1);
    assert_non_null(gpu);
    const int C = d.n_embd, Vp = d.padded_vocab_size, ne = td_model_embed_tensor_count(&d);
    const int nb = td_model_block_tensor_count(&d);
    const size_t np = td_model_params_numel(&d), NC = (size_t)N * C;
    td_rng rng;
    td_rng_seed(&rng, 5);
    float *p = fvec(np), *x = fvec(NC), *dy = fvec(NC), *dlogits = fvec((size_t)N * Vp);
    td_model_init(&d, p, 1);
    for (size_t k = 0; k < np; k++) p[k] += (float)(td_rng_uniform(&rng) - 0.5) * 0.05f;
    for (size_t k = 0; k < NC; k++) x[k] = (float)(td_rng_uniform(&rng) - 0.5) * 2;
    for (size_t k = 0; k < NC; k++) dy[k] = (float)(td_rng_uniform(&rng) - 0.5) * 1e-2f;
    for (size_t k = 0; k < (size_t)N * Vp; k++) dlogits[k] = (float)(td_rng_uniform(&rng) - 0.5) * 1e-2f;
    int tok[N];
    for (int i = 0; i < N; i++) tok[i] = (int)td_rng_below(&rng, (uint64_t)d.vocab_size);
    if (with_pad) {
        d.has_pad_token = 1;
        d.pad_token = tok[N / 2];
        tok[3] = d.pad_token; /* twice at least */
        print_message("%-6s padding token %d\n", f->name, d.pad_token);
    }

    /* the CPU side: host buffers */
    float *g = fvec(np), *acts = fvec(cpu->block_acts_bytes(&d, B, T, TD_DTYPE_F32) / 4), *y = fvec(NC), *dx = fvec(NC);
    float *scr = fvec(cpu->scratch_bytes(&d, B, T, TD_DTYPE_F32, B) / 4), *emb = fvec(NC), *logits = fvec((size_t)N * Vp);
    float *lnf = fvec(NC), *mean = fvec(N), *rstd = fvec(N), *hdx = fvec(NC);
    td_model_run rc = {.desc = &d, .B = B, .T = T, .dt = TD_DTYPE_F32, .gdt = TD_DTYPE_F32, .scratch = scr,
                       .scratch_bytes = cpu->scratch_bytes(&d, B, T, TD_DTYPE_F32, B), .pos = packed ? pos : NULL};
    /* the GPU side */
    void *d_p = dev_copy(p, np), *d_g = dev(np * 4), *d_x = dev_copy(x, NC), *d_dy = dev_copy(dy, NC);
    void *d_acts = dev(gpu->block_acts_bytes(&d, B, T, TD_DTYPE_F32)), *d_y = dev(NC * 4), *d_dx = dev(NC * 4);
    size_t sb = gpu->scratch_bytes(&d, B, T, TD_DTYPE_F32, B), cb = gpu->consts_bytes(&d);
    void *d_scr = dev(sb), *d_emb = dev(NC * 4), *d_logits = dev((size_t)N * Vp * 4), *d_lnf = dev(NC * 4);
    void *d_mean = dev(N * 4), *d_rstd = dev(N * 4), *d_hdx = dev(NC * 4), *d_tok = dev(sizeof tok), *d_consts = NULL;
    assert_int_equal(cudaMemcpy(d_tok, tok, sizeof tok, cudaMemcpyHostToDevice), cudaSuccess);
    void *d_pos = dev(sizeof pos);
    assert_int_equal(cudaMemcpy(d_pos, pos, sizeof pos, cudaMemcpyHostToDevice), cudaSuccess);
    if (cb) {
        void *h = malloc(cb);
        assert_non_null(h);
        gpu->consts_fill(&d, h);
        d_consts = dev(cb);
        assert_int_equal(cudaMemcpy(d_consts, h, cb, cudaMemcpyHostToDevice), cudaSuccess);
        free(h);
    }
    td_model_run rg = {.desc = &d, .B = B, .T = T, .dt = TD_DTYPE_F32, .gdt = TD_DTYPE_F32, .ops = ops,
                       .stream = stream, .consts = d_consts, .scratch = d_scr, .scratch_bytes = sb,
                       .pos = packed ? d_pos : NULL};
    void *cp[TD_MODEL_BLOCK_TENSORS], *cg[TD_MODEL_BLOCK_TENSORS], *gp[TD_MODEL_BLOCK_TENSORS], *gg[TD_MODEL_BLOCK_TENSORS];
    const td_model_lora_drop key = {.seed = 9, .step = 2, .sample0 = 3, .layer = 0, .T = T};
    if (lora == 4) rc.lora_drop = rg.lora_drop = &key; /* training: the same masks on both sides */

    /* embedding */
    ptrs(&d, p, 0, ne, cp), ptrs(&d, d_p, 0, ne, gp);
    TD_ASSERT_OK(cpu->embed_forward(&rc, cp, tok, emb));
    TD_ASSERT_OK(gpu->embed_forward(&rg, gp, d_tok, d_emb));
    compare(f->name, "embedding forward", d_emb, emb, NC, 1e-6);
    ptrs(&d, g, 0, ne, cg), ptrs(&d, d_g, 0, ne, gg);
    const size_t wte_n = (size_t)Vp * C; /* tensor 0; start gradients, as a tied head's or a micro-batch's */
    float *g0 = fvec(wte_n);
    for (size_t k = 0; k < wte_n; k++) g0[k] = g[k] = (float)(td_rng_uniform(&rng) - 0.5) * 1e-2f;
    assert_int_equal(cudaMemcpy(d_g, g, wte_n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    TD_ASSERT_OK(cpu->embed_backward(&rc, cg, tok, dy));
    TD_ASSERT_OK(gpu->embed_backward(&rg, gg, d_tok, d_dy));
    if (with_pad) { /* the CPU's padding row kept its start; the GPU's is compared with it below */
        assert_memory_equal(g + (size_t)d.pad_token * C, g0 + (size_t)d.pad_token * C, (size_t)C * 4);
        int other = 0;
        while (tok[other] == d.pad_token) other++;
        assert_memory_not_equal(g + (size_t)tok[other] * C, g0 + (size_t)tok[other] * C, (size_t)C * 4);
    }
    free(g0);
    for (int k = 0; k < ne; k++) {
        td_model_tensor t;
        td_model_tensor_get(&d, k, &t);
        compare(f->name, t.name, gg[k], cg[k], t.numel, 1e-5);
    }

    /* the block: forward, recompute, backward */
    ptrs(&d, p, ne, nb, cp), ptrs(&d, d_p, ne, nb, gp), ptrs(&d, g, ne, nb, cg), ptrs(&d, d_g, ne, nb, gg);
    for (int k = 0; lora && k < nb; k++) { /* the base frozen: no gradients */
        td_model_tensor t;
        td_model_tensor_get(&d, ne + k, &t);
        if (!TD_MODEL_IS_LORA(t.kind)) cg[k] = gg[k] = NULL;
    }
    TD_ASSERT_OK(cpu->block_forward(&rc, cp, acts, x, y));
    TD_ASSERT_OK(gpu->block_forward(&rg, gp, d_acts, d_x, d_y));
    compare(f->name, "block forward", d_y, y, NC, 2e-4);
    if (lora) { /* each target's kept xa: drop(x) A^T under the key */
        const int R = d.lora.rank;
        td_model_block_acts ca;
        td_model_block_acts_view(&d, B, T, acts, &ca);
        for (int j = 0; j < td_model_lora_count(&d); j++)
            compare(f->name, lora == 4 ? "LoRA xa with dropout" : "LoRA xa", gpu_xa(f, &d, d_acts, j),
                    ca.lora_xa + (size_t)j * N * R, (size_t)N * R, 2e-4); /* the block output's: inputs past attention */
        if (lora == 4) { /* the masks mattered: without the key xa is another */
            td_model_run r0 = rc;
            r0.lora_drop = NULL;
            float *a0 = fvec(cpu->block_acts_bytes(&d, B, T, TD_DTYPE_F32) / 4), *y0 = fvec(NC);
            TD_ASSERT_OK(cpu->block_forward(&r0, cp, a0, x, y0));
            td_model_block_acts c0;
            td_model_block_acts_view(&d, B, T, a0, &c0);
            double most = 0;
            for (size_t k = 0; k < (size_t)td_model_lora_count(&d) * N * R; k++)
                most = fmax(most, fabs((double)c0.lora_xa[k] - ca.lora_xa[k]));
            assert_true(most > 1e-2);
            free(a0);
            free(y0);
        }
    }
    TD_ASSERT_OK(gpu->block_forward(&rg, gp, d_acts, d_x, NULL)); /* a recompute refills the same acts */
    TD_ASSERT_OK(cpu->block_backward(&rc, cp, cg, acts, x, dy, dx));
    TD_ASSERT_OK(gpu->block_backward(&rg, gp, gg, d_acts, d_x, d_dy, d_dx));
    compare(f->name, "block backward dx", d_dx, dx, NC, 2e-4);
    int adapters = 0;
    for (int k = 0; k < nb; k++) {
        td_model_tensor t;
        td_model_tensor_get(&d, ne + k, &t);
        if (!cg[k]) continue; /* frozen */
        /* an adapter's gradient: a handful of GEMMs past dx's, dx's tolerance */
        const int ad = TD_MODEL_IS_LORA(t.kind);
        adapters += ad;
        compare(f->name, t.name + strlen(f->hf_block_prefix) + 2, gg[k], cg[k], t.numel, ad ? 2e-4 : 1e-3);
    }
    assert_int_equal(adapters, 2 * td_model_lora_count(&d));
    if (lora) { /* the adapters moved the block: B is not zero here */
        float *base_y = fvec(NC);
        td_model_desc b = d;
        b.lora = (td_model_lora){0};
        const td_model_exec *bc = td_model_exec_of(&b, 0);
        float *bacts = fvec(bc->block_acts_bytes(&b, B, T, TD_DTYPE_F32) / 4);
        td_model_run rb = rc;
        rb.desc = &b;
        TD_ASSERT_OK(bc->block_forward(&rb, cp, bacts, x, base_y)); /* the block's tensors come first in the layout */
        double moved = 0;
        for (size_t k = 0; k < NC; k++) moved = fmax(moved, fabs((double)base_y[k] - y[k]));
        print_message("%-6s LoRA's change of the block output: max %.3g\n", f->name, moved);
        assert_true(moved > 1e-3);
        free(base_y);
        free(bacts);
    }

    /* the head */
    int hi[3], nh = td_model_head_tensors(&d, hi);
    for (int k = 0; k < nh; k++) {
        td_model_tensor t;
        td_model_tensor_get(&d, hi[k], &t);
        cp[k] = p + t.offset, gp[k] = (float *)d_p + t.offset;
        cg[k] = g + t.offset, gg[k] = (float *)d_g + t.offset;
    }
    td_model_head_acts hc = {lnf, mean, rstd}, hg = {d_lnf, d_mean, d_rstd};
    TD_ASSERT_OK(cpu->head_forward(&rc, cp, x, logits, &hc));
    TD_ASSERT_OK(gpu->head_forward(&rg, gp, d_x, d_logits, &hg));
    compare(f->name, "head logits", d_logits, logits, (size_t)N * Vp, 2e-4);
    assert_int_equal(cudaMemcpy(d_logits, dlogits, (size_t)N * Vp * 4, cudaMemcpyHostToDevice), cudaSuccess);
    TD_ASSERT_OK(cpu->head_backward(&rc, cp, cg, x, dlogits, &hc, hdx));
    TD_ASSERT_OK(gpu->head_backward(&rg, gp, gg, d_x, d_logits, &hg, d_hdx));
    compare(f->name, "head backward dx", d_hdx, hdx, NC, 2e-4);
    for (int k = 0; k < nh; k++) {
        td_model_tensor t;
        td_model_tensor_get(&d, hi[k], &t);
        compare(f->name, t.name, gg[k], cg[k], t.numel, 1e-3);
    }

    void *devs[] = {d_p, d_g, d_x, d_dy, d_acts, d_y, d_dx, d_scr, d_emb, d_logits, d_lnf, d_mean, d_rstd, d_hdx,
                    d_tok, d_consts, d_pos};
    for (size_t i = 0; i < sizeof devs / sizeof devs[0]; i++) cudaFree(devs[i]);
    free(p); free(x); free(dy); free(dlogits); free(g); free(acts); free(y); free(dx); free(scr); free(emb);
    free(logits); free(lnf); free(mean); free(rstd); free(hdx);
}

static void test_every_family_against_cpu(void **state)
{
    (void)state;
    void *ws = dev(TD_OPS_CUDA_WORKSPACE_BYTES);
    td_ops_cuda_params op = td_ops_cuda_default_params();
    op.workspace = ws;
    op.workspace_bytes = TD_OPS_CUDA_WORKSPACE_BYTES;
    td_ops_cuda *ops;
    TD_ASSERT_OK(td_ops_cuda_create(&op, &ops));
    for (int packed = 0; packed < 2; packed++)
        for (int i = 0; i < td_model_family_count(); i++) {
            const td_model_family *f = td_model_family_at(i);
            run_family(f, ops, NULL, packed, 0, 0);
            if (f->traits.rope && !packed) run_family(f, ops, NULL, 0, 1, 0);
            for (int lora = 1; lora <= 4 && !packed; lora++) run_family(f, ops, NULL, 0, 0, lora);
        }
    td_ops_cuda_free(ops);
    cudaFree(ws);
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        fprintf(stderr, "test_family_cuda: no CUDA device\n");
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_family_against_cpu),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
