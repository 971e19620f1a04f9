/* The step loop on the cuda backend against the cpu backend (the oracle):
 * fp32 losses agree within 1e-5 relative over the training steps, bf16
 * losses follow within what bf16's rounding explains (BF16_LOSS_TOL),
 * offloading changes nothing (same losses under every policy and budget),
 * and the device never holds more than the budget. */
#include "td_train_test.h"
#include "tidal/block_probe.h"
#include "tidal/convert.h"
#include "tidal/model.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static td_train_config config(td_backend_kind kind, td_dtype dt)
{
    td_train_config c = td_train_default_config();
    c.model = (td_model_desc){ .n_layer = 3, .n_head = 4, .n_embd = 128, .n_positions = 128,
                                   .vocab_size = 250, .padded_vocab_size = 256 };
    c.micro_batch = 4;
    c.seq_len = 128;
    c.grad_accum = 2;
    c.backend = kind;
    c.precision = dt;
    c.gpu_budget = 512 * TD_MiB;
    c.optim.lr.lr = 2e-3;
    return c;
}

static void run(const td_train_config *c, int steps, double *losses, td_memmgr_stats *stats)
{
    td_test_train(c, steps, 42, losses, stats);
}

/* fp32 on both sides: the two backends differ only in the order of their
 * sums (cuBLASLt with CUBLAS_COMPUTE_32F, no TF32), a few 2^-24 relative
 * each; transformers agrees with the cpu backend to 6e-7. */
#define FP32_LOSS_TOL 1e-5

/* bf16 against fp32: the relative difference of a step's loss that bf16's
 * rounding explains.  u = 2^-8 is bf16's rounding unit (8 significant bits:
 * a rounding moves a value by at most u/2 of it).  On the way from the
 * tokens to the logits the CUDA step rounds, at each of n_layer + 2 stages
 * (the embedding, every block, the head), the stage's weights and its
 * output to bf16; inside an op sums run in fp32 (test_ops_cuda checks each
 * op's own roundings).  Two roundings of at most u/2 a stage compound to a
 * relative change of at most eps = (n_layer + 2) * u of the logits, to
 * first order.  A relative change eps of the logits z changes the
 * cross-entropy by eps * (CE - H(p)) (as logsumexp(z) = E_p[z] + H(p), with
 * p = softmax(z) and H its entropy), and 0 <= H(p) <= 2 CE in these runs (at
 * the start H = CE = log V; a calibrated model keeps H near CE), so by at
 * most eps * CE: the bound is eps relative, 5/256 = 2.0% for 3 layers.
 * Training keeps the runs in that band: AdamW moves each weight by about lr
 * a step whatever its gradient's rounding.  A wrong kernel (a missing term,
 * a scale, a transposed operand) moves the loss by far more. */
static double bf16_loss_tol(const td_train_config *c)
{
    const double u = 1.0 / 256; /* 2^-8 */
    return (c->model.n_layer + 2) * u;
}

static void test_fp32_matches_cpu(void **state)
{
    enum { S = 5 };
    double cpu[S], gpu[S];
    td_train_config c = config(TD_BACKEND_CPU, TD_DTYPE_F32);
    run(&c, S, cpu, NULL);
    c = config(TD_BACKEND_CUDA, TD_DTYPE_F32);
    run(&c, S, gpu, NULL);
    for (int s = 0; s < S; s++) {
        print_message("step %d: cpu %.7f  cuda fp32 %.7f  relative difference %.2g\n", s + 1, cpu[s], gpu[s],
                      fabs(gpu[s] - cpu[s]) / fabs(cpu[s]));
        if (!(fabs(gpu[s] - cpu[s]) <= FP32_LOSS_TOL * fabs(cpu[s])))
            fail_msg("step %d: cuda fp32 loss %.9g, cpu %.9g: more than %g apart", s + 1, gpu[s], cpu[s], FP32_LOSS_TOL);
    }
}

static void test_bf16_follows_cpu(void **state)
{
    enum { S = 30 };
    double cpu[S], gpu[S], worst = 0;
    td_train_config c = config(TD_BACKEND_CPU, TD_DTYPE_F32);
    run(&c, S, cpu, NULL);
    c = config(TD_BACKEND_CUDA, TD_DTYPE_BF16);
    run(&c, S, gpu, NULL);
    for (int s = 0; s < S; s++) {
        double d = fabs(gpu[s] - cpu[s]) / cpu[s];
        if (d > worst) worst = d;
    }
    print_message("bf16 vs cpu fp32 over %d steps: worst relative loss difference %.4f, bound %.4f (loss %.3f -> %.3f)\n",
                  S, worst, bf16_loss_tol(&c), cpu[0], cpu[S - 1]);
    assert_true(worst <= bf16_loss_tol(&c));
    assert_true(gpu[S - 1] < 0.8 * gpu[0]); /* it learns */
}

/* Offloading and checkpointing change no bit of the losses. */
static void test_offloading_changes_nothing(void **state)
{
    enum { S = 4 };
    double ref[S], got[S];
    td_memmgr_stats st;
    td_train_config c = config(TD_BACKEND_CUDA, TD_DTYPE_BF16);
    c.mm.placement = TD_PLACEMENT_CUDA;
    td_train_plan p;
    td_train_config v = c;
    v.model.n_layer = c.model.n_layer = 8; /* more chunks than the smallest budget holds */
    run(&c, S, ref, NULL);
    v.mm.placement = TD_PLACEMENT_CPU;
    v.ckpt = TD_CKPT_ON;
    TD_ASSERT_OK(td_train_plan_make(&v, 0, &p));
    v.gpu_budget = p.min_device_bytes;
    run(&v, S, got, &st);
    for (int s = 0; s < S; s++)
        if (memcmp(&got[s], &ref[s], sizeof(double)) != 0)
            fail_msg("step %d: offloaded %.17g != resident %.17g", s + 1, got[s], ref[s]);
    print_message("budget %zu bytes: peak %zu, %llu loads, %llu evictions\n", v.gpu_budget, st.device_peak_bytes,
                  (unsigned long long)st.loads, (unsigned long long)st.evictions);
    assert_true(st.device_peak_bytes <= v.gpu_budget);
    assert_true(st.evictions > 0);
    /* Recomputing some blocks and keeping the others' activations: the same. */
    v = c;
    v.ckpt = TD_CKPT_ON;
    v.ckpt_blocks = 3;
    run(&v, S, got, NULL);
    for (int s = 0; s < S; s++)
        if (memcmp(&got[s], &ref[s], sizeof(double)) != 0)
            fail_msg("step %d: 3 of 8 blocks recomputed %.17g != %.17g", s + 1, got[s], ref[s]);
}

/* The rotary decoder's families: LLaMA and Qwen2 (GQA, RoPE with llama3
 * scaling, tied and untied heads, q/k/v biases) and Gemma (heads of 128 over
 * a width of 256, RMSNorm's 1 + w, GeGLU, the embedding scaled by sqrt(C)):
 * their CUDA compute (model/cuda/rotary_cuda.c) against the cpu backend in fp32,
 * bf16 following it, and offloading changing no bit. */
static td_train_config llama(td_backend_kind kind, td_dtype dt, const char *family, int untied)
{
    td_train_config c = config(kind, dt);
    c.model = (td_model_desc){ .n_layer = 3, .n_head = 4, .n_embd = 256, .n_positions = 128,
                                   .vocab_size = 250, .padded_vocab_size = 256 };
    td_model_desc_set_family(&c.model, family);
    c.model.n_kv_head = 2;   /* hs 64: the flash path in bf16 */
    c.model.n_inner = 384;
    c.model.norm_eps = 1e-5f;
    c.model.rope_theta = 500000.0f;
    c.model.untied_head = untied;
    if (!strcmp(family, "llama")) c.model.rope_scaling = (td_rope_scaling){ 8.0f, 1.0f, 4.0f, 64 };
    if (!strcmp(family, "gemma")) c.model.head_dim = 128; /* the flash path, o_proj (256, 512) */
    return c;
}

static void test_llama_family(void **state)
{
    static const char *const families[] = {"llama", "qwen2", "gemma"};
    for (int k = 0; k < 3; k++) {
        const char *f = families[k];
        enum { S = 5, SB = 20 };
        double cpu[SB], gpu[SB], worst = 0;
        td_train_config c = llama(TD_BACKEND_CPU, TD_DTYPE_F32, f, k == 1);
        run(&c, SB, cpu, NULL);
        c = llama(TD_BACKEND_CUDA, TD_DTYPE_F32, f, k == 1);
        run(&c, S, gpu, NULL);
        for (int s = 0; s < S; s++) {
            print_message("%s step %d: cpu %.7f  cuda fp32 %.7f  relative difference %.2g\n", f,
                          s + 1, cpu[s], gpu[s], fabs(gpu[s] - cpu[s]) / fabs(cpu[s]));
            if (!(fabs(gpu[s] - cpu[s]) <= FP32_LOSS_TOL * fabs(cpu[s])))
                fail_msg("%s step %d: cuda fp32 loss %.9g, cpu %.9g: more than %g apart", f, s + 1,
                         gpu[s], cpu[s], FP32_LOSS_TOL);
        }
        c = llama(TD_BACKEND_CUDA, TD_DTYPE_BF16, f, k == 1);
        run(&c, SB, gpu, NULL);
        for (int s = 0; s < SB; s++) worst = fmax(worst, fabs(gpu[s] - cpu[s]) / cpu[s]);
        print_message("%s bf16 vs cpu fp32: worst relative loss difference %.4f, bound %.4f\n", f,
                      worst, bf16_loss_tol(&c));
        assert_true(worst <= bf16_loss_tol(&c));
        /* offloaded at the plan's minimum budget: the same bits as resident */
        double ref[4], got[4];
        c.mm.placement = TD_PLACEMENT_CUDA;
        run(&c, 4, ref, NULL);
        td_train_config v = c;
        v.mm.placement = TD_PLACEMENT_CPU;
        v.ckpt = TD_CKPT_ON;
        td_train_plan p;
        TD_ASSERT_OK(td_train_plan_make(&v, 0, &p));
        v.gpu_budget = p.min_device_bytes + p.min_device_bytes / 8;
        run(&v, 4, got, NULL);
        assert_memory_equal(got, ref, sizeof got);
    }
}


/* The head and the loss over chunks of rows on the GPU (100 rows: five
 * chunks and a ragged sixth of the 512), GPT-2 and the rotary families:
 * fp32 losses within FP32_LOSS_TOL of the cpu backend's single chunk, bf16
 * within bf16's band, sampling's logits those of one chunk, and the plan
 * (so the arena) holding one chunk's logits instead of all rows'. */
static void test_loss_chunks(void **state)
{
    enum { S = 5 };
    static const char *const families[] = {"gpt2", "llama", "gemma"};
    for (int k = 0; k < 3; k++) {
        td_train_config c = k ? llama(TD_BACKEND_CPU, TD_DTYPE_F32, families[k], k == 1)
                              : config(TD_BACKEND_CPU, TD_DTYPE_F32);
        const int N = c.micro_batch * c.seq_len;
        double cpu[S], gpu[S];
        run(&c, S, cpu, NULL);
        c.backend = TD_BACKEND_CUDA;
        c.loss_chunk = 100;
        run(&c, S, gpu, NULL);
        for (int s = 0; s < S; s++) {
            print_message("%s, loss chunks of 100 rows, step %d: cpu %.7f  cuda fp32 %.7f  relative difference %.2g\n",
                          families[k], s + 1, cpu[s], gpu[s], fabs(gpu[s] - cpu[s]) / fabs(cpu[s]));
            if (!(fabs(gpu[s] - cpu[s]) <= FP32_LOSS_TOL * fabs(cpu[s])))
                fail_msg("%s step %d: cuda fp32 loss in chunks %.9g, cpu %.9g: more than %g apart", families[k], s + 1,
                         gpu[s], cpu[s], FP32_LOSS_TOL);
        }
        c.precision = TD_DTYPE_BF16;
        run(&c, S, gpu, NULL);
        for (int s = 0; s < S; s++)
            if (!(fabs(gpu[s] - cpu[s]) <= bf16_loss_tol(&c) * cpu[s]))
                fail_msg("%s step %d: cuda bf16 loss in chunks %.9g, cpu %.9g", families[k], s + 1, gpu[s], cpu[s]);
        /* sampling: the context fills the sequence, so its last row (127 of
         * T = 128) lies in the second chunk of 100 rows */
        const int L = c.seq_len;
        assert_true(L > c.loss_chunk && L <= 1024);
        int32_t ctx[1024];
        for (int i = 0; i < L; i++) ctx[i] = (i * 37 + 11) % c.model.vocab_size;
        float *whole = malloc(sizeof(float) * (size_t)c.model.vocab_size);
        float *chunked = malloc(sizeof(float) * (size_t)c.model.vocab_size);
        assert_non_null(whole);
        assert_non_null(chunked);
        c.precision = TD_DTYPE_F32;
        td_trainer *t;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        TD_ASSERT_OK(td_trainer_next_logits(t, ctx, L, chunked));
        td_trainer_destroy(t);
        c.loss_chunk = 0;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        TD_ASSERT_OK(td_trainer_next_logits(t, ctx, L, whole));
        td_trainer_destroy(t);
        double err = 0, scale = 0;
        for (int v = 0; v < c.model.vocab_size; v++) {
            err = fmax(err, fabs((double)chunked[v] - whole[v]));
            scale = fmax(scale, fabs((double)whole[v]));
        }
        free(whole);
        free(chunked);
        assert_true(scale > 0 && err <= 1e-5 * scale);
        /* the plan: one chunk's logits (bf16) */
        c.precision = TD_DTYPE_BF16;
        td_train_plan one, five;
        c.loss_chunk = N;
        TD_ASSERT_OK(td_train_plan_make(&c, 0, &one));
        c.loss_chunk = 100;
        TD_ASSERT_OK(td_train_plan_make(&c, 0, &five));
        assert_true(one.activation_bytes - five.activation_bytes >= (size_t)(N - 100) * c.model.padded_vocab_size * 2);
    }
}

/* LoRA (rank 4, alpha 8, on every linear module; the base frozen) on the
 * cuda backend, GPT-2 and the rotary families: fp32 losses within
 * FP32_LOSS_TOL of the cpu backend's (model/lora.c), bf16 within bf16's band,
 * the loss falling, and checkpointed blocks (their adapters' xa rebuilt by
 * the recompute) offloaded at the plan's minimum budget the same bits as
 * resident. */
static void test_lora_matches_cpu(void **state)
{
    enum { S = 6 };
    static const char *const families[] = {"gpt2", "llama", "qwen2", "gemma"};
    for (int k = 0; k < 4; k++) {
        const char *f = families[k];
        td_train_config c = k ? llama(TD_BACKEND_CPU, TD_DTYPE_F32, f, k == 2) : config(TD_BACKEND_CPU, TD_DTYPE_F32);
        TD_ASSERT_OK(td_model_lora_set(&c.model, 4, 8.0f, 0.0f, NULL));
        c.optim.lr.lr = 1e-2;
        double cpu[S], gpu[S], worst = 0;
        run(&c, S, cpu, NULL);
        c.backend = TD_BACKEND_CUDA;
        run(&c, S, gpu, NULL);
        for (int s = 0; s < S; s++) {
            print_message("%s LoRA step %d: cpu %.7f  cuda fp32 %.7f  relative difference %.2g\n", f, s + 1, cpu[s],
                          gpu[s], fabs(gpu[s] - cpu[s]) / fabs(cpu[s]));
            if (!(fabs(gpu[s] - cpu[s]) <= FP32_LOSS_TOL * fabs(cpu[s])))
                fail_msg("%s LoRA step %d: cuda fp32 loss %.9g, cpu %.9g: more than %g apart", f, s + 1, gpu[s],
                         cpu[s], FP32_LOSS_TOL);
        }
        assert_true(cpu[S - 1] < cpu[0] - 1e-3); /* the adapters learn */
        c.precision = TD_DTYPE_BF16;
        run(&c, S, gpu, NULL);
        for (int s = 0; s < S; s++) worst = fmax(worst, fabs(gpu[s] - cpu[s]) / cpu[s]);
        print_message("%s LoRA bf16 vs cpu fp32: worst relative loss difference %.4f, bound %.4f\n", f, worst,
                      bf16_loss_tol(&c));
        assert_true(worst <= bf16_loss_tol(&c));
        double ref[4], got[4];
        c.mm.placement = TD_PLACEMENT_CUDA;
        run(&c, 4, ref, NULL);
        td_train_config v = c;
        v.mm.placement = TD_PLACEMENT_CPU;
        v.ckpt = TD_CKPT_ON;
        td_train_plan p;
        TD_ASSERT_OK(td_train_plan_make(&v, 0, &p));
        v.gpu_budget = p.min_device_bytes + p.min_device_bytes / 8;
        td_memmgr_stats st;
        run(&v, 4, got, &st);
        assert_memory_equal(got, ref, sizeof got);
        assert_true(st.device_peak_bytes <= v.gpu_budget);
    }
}

/* A bf16 run's frozen base from the seeded init: each weight the cpu
 * backend's fp32 draw rounded to bf16 (to nearest, ties to even), none
 * lost or out of place.  The base has no fp32 master to draw into, so the
 * draw goes through a scratch buffer; written straight into the 16-bit copy,
 * the fp32 values took twice its bytes. */
static void test_lora_bf16_base_from_init(void **state)
{
    (void)state;
    for (int k = 0; k < 2; k++) {
        td_train_config c = k ? llama(TD_BACKEND_CPU, TD_DTYPE_F32, "llama", 1) : config(TD_BACKEND_CPU, TD_DTYPE_F32);
        TD_ASSERT_OK(td_model_lora_set(&c.model, 4, 8.0f, 0.0f, NULL));
        td_model_desc base = c.model;
        base.lora = (td_model_lora){0};
        size_t n = td_model_params_numel(&base), bad = 0;
        float *want = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));
        assert_non_null(want);
        assert_non_null(got);
        td_trainer *t = NULL;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        TD_ASSERT_OK(td_trainer_merged_params(t, want)); /* B starts at zero: the base itself */
        td_trainer_destroy(t);
        c.backend = TD_BACKEND_CUDA;
        c.precision = TD_DTYPE_BF16;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        TD_ASSERT_OK(td_trainer_merged_params(t, got));
        td_trainer_destroy(t);
        for (size_t i = 0; i < n; i++) {
            float rounded = td_f32_from_bf16(td_bf16_from_f32(want[i])); /* RNE, as the init writes it */
            if (memcmp(&got[i], &rounded, sizeof rounded)) {
                if (!bad++)
                    print_message("%s: weight %zu is %.9g, the fp32 draw %.9g rounds to %.9g\n", k ? "llama" : "gpt2", i,
                                  got[i], want[i], rounded);
            }
        }
        print_message("%s: %zu base weights in bf16, %zu not the fp32 draw rounded\n", k ? "llama" : "gpt2", n, bad);
        assert_int_equal(bad, 0);
        free(want);
        free(got);
    }
}

/* LoRA dropout 0.2 (model.h's hashed masks, the same on both backends):
 * the cuda backend's fp32 losses within FP32_LOSS_TOL of the cpu backend's
 * with the same dropout, apart from its own run without dropout (the masks
 * act on cuda), the same bits run after run and offloaded with every block
 * recomputed at the plan's minimum budget (the recompute and the backward
 * hash the forward's masks), bf16 within bf16's band of the cpu's fp32. */
static void test_lora_dropout_matches_cpu(void **state)
{
    enum { S = 6 };
    static const char *const families[] = {"gpt2", "llama", "qwen2", "gemma"};
    for (int k = 0; k < 4; k++) {
        const char *f = families[k];
        td_train_config c = k ? llama(TD_BACKEND_CPU, TD_DTYPE_F32, f, k == 2) : config(TD_BACKEND_CPU, TD_DTYPE_F32);
        TD_ASSERT_OK(td_model_lora_set(&c.model, 4, 8.0f, 0.2f, NULL));
        c.optim.lr.lr = 1e-2;
        double cpu[S], gpu[S], again[S], none[S], worst = 0;
        run(&c, S, cpu, NULL);
        c.backend = TD_BACKEND_CUDA;
        run(&c, S, gpu, NULL);
        run(&c, S, again, NULL);
        assert_memory_equal(gpu, again, sizeof gpu);
        for (int s = 0; s < S; s++) {
            print_message("%s LoRA dropout step %d: cpu %.7f  cuda fp32 %.7f  relative difference %.2g\n", f, s + 1,
                          cpu[s], gpu[s], fabs(gpu[s] - cpu[s]) / fabs(cpu[s]));
            if (!(fabs(gpu[s] - cpu[s]) <= FP32_LOSS_TOL * fabs(cpu[s])))
                fail_msg("%s LoRA dropout step %d: cuda fp32 loss %.9g, cpu %.9g: more than %g apart", f, s + 1,
                         gpu[s], cpu[s], FP32_LOSS_TOL);
        }
        td_train_config z = c;
        z.model.lora.dropout = 0.0f;
        run(&z, S, none, NULL);
        double apart = 0;
        for (int s = 1; s < S; s++) apart = fmax(apart, fabs(none[s] - gpu[s]) / fabs(gpu[s]));
        print_message("%s LoRA dropout 0.2 against none on cuda: relative loss difference up to %.2g\n", f, apart);
        assert_true(apart > 3 * FP32_LOSS_TOL); /* past the backends' difference: the masks act */
        double ref[4], got[4];
        c.mm.placement = TD_PLACEMENT_CUDA;
        run(&c, 4, ref, NULL);
        td_train_config v = c;
        v.mm.placement = TD_PLACEMENT_CPU;
        v.ckpt = TD_CKPT_ON;
        td_train_plan p;
        TD_ASSERT_OK(td_train_plan_make(&v, 0, &p));
        v.gpu_budget = p.min_device_bytes + p.min_device_bytes / 8;
        td_memmgr_stats st;
        run(&v, 4, got, &st);
        assert_memory_equal(got, ref, sizeof got);
        assert_true(st.device_peak_bytes <= v.gpu_budget);
        c.precision = TD_DTYPE_BF16;
        c.mm.placement = TD_PLACEMENT_AUTO;
        run(&c, S, gpu, NULL);
        for (int s = 0; s < S; s++) worst = fmax(worst, fabs(gpu[s] - cpu[s]) / cpu[s]);
        print_message("%s LoRA dropout bf16 vs cpu fp32: worst relative loss difference %.4f, bound %.4f\n", f, worst,
                      bf16_loss_tol(&c));
        assert_true(worst <= bf16_loss_tol(&c));
    }
}

/* `tidal plan`'s block probe composes the model's own block: for LLaMA and
 * Qwen2 (GQA with hs 64 and 128, RoPE with llama3 scaling, q/k/v biases) its
 * fp32 forward equals the CPU reference block on the probe's own params and
 * input (the branch y - x compared: x dominates y at init scale), and the
 * bf16 probe (the flash path) times forward and backward. */
static void test_block_probe_llama_family(void **state)
{
    static const struct { const char *f; int C, NH, NKV, H, hd; } shapes[] = {
        {"llama", 256, 4, 2, 512, 0}, {"llama", 256, 2, 1, 384, 0}, {"qwen2", 256, 4, 1, 448, 0},
        {"gemma", 256, 2, 1, 512, 96}, /* heads of 96 over 256: not C / NH */
    };
    enum { B = 2, T = 64, N = B * T };
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CUDA;
    td_backend *be;
    TD_ASSERT_OK(td_backend_create(&bp, &be));
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        td_model_desc mc = { .n_layer = 2, .n_head = shapes[k].NH, .n_embd = shapes[k].C, .n_positions = T,
                                 .vocab_size = 64, .padded_vocab_size = 64 };
        td_model_desc_set_family(&mc, shapes[k].f);
        mc.n_kv_head = shapes[k].NKV;
        mc.n_inner = shapes[k].H;
        mc.head_dim = shapes[k].hd;
        mc.rope_theta = 500000.0f;
        if (!strcmp(shapes[k].f, "llama")) mc.rope_scaling = (td_rope_scaling){ 8.0f, 1.0f, 4.0f, 32 };
        const size_t C = (size_t)mc.n_embd;
        td_block_probe *p;
        TD_ASSERT_OK(td_block_probe_create(be, &mc, B, T, TD_DTYPE_F32, 0, &p));
        td_ops_cuda_rotary_block_acts_view(&p->mc, B, T, TD_DTYPE_F32, p->acts, &p->a); /* the decoder's fields */
        TD_ASSERT_OK(td_block_probe_forward(p));
        assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
        size_t off, span;
        td_model_block_span(&p->mc, 0, &off, &span);
        float *w = malloc(span * sizeof(float)), *x = malloc(N * C * sizeof(float));
        float *y_gpu = malloc(N * C * sizeof(float)), *y = malloc(N * C * sizeof(float));
        float *acts = calloc(td_model_block_acts_numel(&p->mc, B, T), sizeof(float));
        assert_non_null(w && x && y_gpu && y && acts);
        /* the span starts with ln1_w in every family */
        assert_int_equal(cudaMemcpy(w, p->w.ln1_w, span * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
        assert_int_equal(cudaMemcpy(x, p->x, N * C * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
        assert_int_equal(cudaMemcpy(y_gpu, p->y, N * C * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
        td_model_block wb;
        td_model_block_acts a;
        td_model_block_view(&p->mc, w, &wb);
        td_model_block_acts_view(&p->mc, B, T, acts, &a);
        td_model_block_forward(&p->mc, &wb, &a, x, y, NULL, B, T);
        /* a recompute (y NULL) refills the acts bit for bit and writes no output */
        const size_t NH_ = (size_t)N * shapes[k].H * sizeof(float);
        float *g0 = malloc(NH_), *g1 = malloc(NH_), *y_after = malloc(N * C * sizeof(float));
        assert_non_null(g0 && g1 && y_after);
        assert_int_equal(cudaMemcpy(g0, p->a.fch_gelu, NH_, cudaMemcpyDeviceToHost), cudaSuccess);
        assert_int_equal(cudaMemset(p->a.fch_gelu, 0, NH_), cudaSuccess);
        assert_int_equal(cudaMemset(p->y, 0x7f, N * C * sizeof(float)), cudaSuccess);
        TD_ASSERT_OK(td_block_probe_recompute(p));
        assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
        assert_int_equal(cudaMemcpy(g1, p->a.fch_gelu, NH_, cudaMemcpyDeviceToHost), cudaSuccess);
        assert_int_equal(cudaMemcpy(y_after, p->y, N * C * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
        assert_memory_equal(g0, g1, NH_);
        for (size_t i = 0; i < N * C * sizeof(float); i++) assert_int_equal(((unsigned char *)y_after)[i], 0x7f);
        free(g0);
        free(g1);
        free(y_after);
        double branch = 0, err = 0;
        for (size_t i = 0; i < N * C; i++) {
            branch = fmax(branch, fabs(y[i] - x[i]));
            err = fmax(err, fabs(y_gpu[i] - y[i]));
        }
        print_message("probe %s C %zu NH %d NKV %d: largest branch %.3g, largest difference %.3g\n",
                      td_model_family_name(td_model_family_of(&mc)), C, mc.n_head, mc.n_kv_head, branch, err);
        assert_true(branch > 1e-3);
        assert_true(err <= 1e-2 * branch);
        free(w);
        free(x);
        free(y_gpu);
        free(y);
        free(acts);
        td_block_probe_destroy(p);
        double fwd = 0, bwd = 0, rec = 0;
        TD_ASSERT_OK(td_block_probe_create(be, &mc, B, T, TD_DTYPE_BF16, 0, &p));
        TD_ASSERT_OK(td_block_probe_time(p, 2, &fwd, &bwd, &rec));
        td_block_probe_destroy(p);
        /* positive, and sane for a block of 256 wide at B2 x T64: well under a second */
        assert_true(fwd > 0 && bwd > 0 && rec > 0);
        assert_true(fwd < 1e3 && bwd < 1e3 && rec < 1e3);
    }
    td_backend_free(be);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fp32_matches_cpu),
        cmocka_unit_test(test_bf16_follows_cpu),
        cmocka_unit_test(test_offloading_changes_nothing),
        cmocka_unit_test(test_llama_family),
        cmocka_unit_test(test_loss_chunks),
        cmocka_unit_test(test_lora_matches_cpu),
        cmocka_unit_test(test_lora_bf16_base_from_init),
        cmocka_unit_test(test_lora_dropout_matches_cpu),
        cmocka_unit_test(test_block_probe_llama_family),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
