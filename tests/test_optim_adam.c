/* The fused CPU AdamW against a double-precision reference of torch's AdamW
 * / Adam formulas: every ISA variant, many seeds, 12 steps each, with weight
 * decay (decoupled and L2), bias correction, global clipping over chunks and
 * a loss scale, grads in fp32/bf16/fp16, unaligned arrays and odd sizes.
 * Then: the variants and team sizes agree bit for bit, the partition tiles
 * every chunk, first touch initialises state, grad statistics are exact and
 * flag every Inf/NaN, and bad arguments fail with a message. */
#include "td_test.h"
#include "tidal/optim.h"
#include "tidal/convert.h"

#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STEPS 12

static double uniform(td_rng *r, double lo, double hi) { return lo + (hi - lo) * td_rng_uniform(r); }

/* One random problem: hyper-parameters, sizes, buffers (deliberately
 * misaligned), and the grads of every step as the backward stores them
 * (true grad * loss scale, rounded to grad_dtype). */
typedef struct problem {
    size_t n;
    int n_chunks;
    size_t chunk_n[3];
    td_optim_params op;
    td_dtype gdt, pdt;
    int has_out, out_is_master;
    float *p0;
    void *grads[STEPS];
    /* System under test. */
    void *mem, *out_mem;
    float *master, *m, *v;
    void *out;
} problem;

/* n 0: a random size up to 5000 elements */
static void problem_make_n(problem *pb, uint64_t seed, size_t n)
{
    td_rng r;
    td_rng_seed(&r, seed);
    memset(pb, 0, sizeof *pb);
    pb->n = 1 + td_rng_below(&r, 5000);
    if (n) pb->n = n;
    pb->n_chunks = 1 + (int)td_rng_below(&r, 3);
    size_t left = pb->n;
    for (int j = 0; j < pb->n_chunks; j++) {
        pb->chunk_n[j] = j == pb->n_chunks - 1 ? left : td_rng_below(&r, left + 1);
        left -= pb->chunk_n[j];
    }
    td_optim_params *op = &pb->op;
    *op = td_optim_default_params();
    static const double b1s[] = {0.9, 0.8, 0.95, 0.0}, b2s[] = {0.999, 0.95, 0.99}, eps[] = {1e-8, 1e-6, 1e-3},
                        wds[] = {0, 0.01, 0.1, 0.5};
    op->adam.beta1 = b1s[td_rng_below(&r, 4)];
    op->adam.beta2 = b2s[td_rng_below(&r, 3)];
    op->adam.eps = eps[td_rng_below(&r, 3)];
    op->adam.weight_decay = wds[td_rng_below(&r, 4)];
    op->adam.decay = td_rng_below(&r, 2) ? TD_ADAM_DECAY_L2 : TD_ADAM_DECAY_DECOUPLED;
    op->lr.lr = pow(10, uniform(&r, -4, -1.5));
    op->max_grad_norm = td_rng_below(&r, 3) ? uniform(&r, 0.1, 3) * sqrt((double)pb->n) * 0.3 : 0;
    static const double scales[] = {1, 1024, 65536};
    op->scaler.kind = TD_LOSS_SCALE_STATIC;
    op->scaler.init_scale = scales[td_rng_below(&r, 3)];
    pb->gdt = (td_dtype)td_rng_below(&r, 3);
    if (pb->gdt == TD_DTYPE_F16 && op->scaler.init_scale > 1024) op->scaler.init_scale = 1024;
    pb->has_out = td_rng_below(&r, 4) != 0;
    pb->pdt = (td_dtype)td_rng_below(&r, 3);
    pb->out_is_master = pb->has_out && pb->pdt == TD_DTYPE_F32 && td_rng_below(&r, 2);
    double gscale = pow(10, uniform(&r, -3, 0.5));
    pb->p0 = malloc(pb->n * 4);
    for (size_t i = 0; i < pb->n; i++) pb->p0[i] = (float)uniform(&r, -1, 1);
    for (int s = 0; s < STEPS; s++) {
        pb->grads[s] = malloc(pb->n * 4);
        for (size_t i = 0; i < pb->n; i++)
            td_test_store_as(pb->grads[s], pb->gdt, i, (float)(uniform(&r, -1, 1) * gscale * op->scaler.init_scale));
    }
    /* master, m, v, out at odd float offsets (not 64-byte aligned). */
    pb->mem = calloc(3 * (pb->n + 16), 4);
    float *base = pb->mem;
    pb->master = base + 1 + td_rng_below(&r, 15);
    pb->m = base + (pb->n + 16) + td_rng_below(&r, 16);
    pb->v = base + 2 * (pb->n + 16) + 3;
    /* The output 64-byte aligned half of the time (streaming stores), else not. */
    pb->out_mem = aligned_alloc(64, td_align_up((pb->n + 16) * 4, 64));
    float *out = (float *)pb->out_mem + (td_rng_below(&r, 2) ? 0 : 1 + td_rng_below(&r, 15));
    pb->out = pb->out_is_master ? (void *)pb->master : (void *)out;
}

static void problem_make(problem *pb, uint64_t seed) { problem_make_n(pb, seed, 0); }

static void problem_free(problem *pb)
{
    free(pb->p0);
    for (int s = 0; s < STEPS; s++) free(pb->grads[s]);
    free(pb->mem);
    free(pb->out_mem);
}

static int problem_chunks(problem *pb, int s, td_adam_chunk *ch)
{
    size_t off = 0;
    size_t osz = td_dtype_bytes(pb->pdt), gsz = td_dtype_bytes(pb->gdt);
    for (int j = 0; j < pb->n_chunks; j++) {
        ch[j] = (td_adam_chunk){.master = pb->master + off, .m = pb->m + off, .v = pb->v + off,
                                .grad = (char *)pb->grads[s] + off * gsz, .grad_dtype = pb->gdt,
                                .param_out = pb->has_out ? (char *)pb->out + off * osz : NULL,
                                .param_dtype = pb->pdt, .numel = pb->chunk_n[j]};
        off += pb->chunk_n[j];
    }
    return pb->n_chunks;
}

/* Runs the whole library path: engine init (first touch), per step the grad
 * stats of every chunk, the controller's decision, the fused update;
 * `nested`: each update called from inside a parallel region, where the
 * runtime gives the engine's team one thread. */
static void run_tidal_nested(problem *pb, td_optim_isa isa, int threads, int nested)
{
    td_adam_cpu_params cp = td_adam_cpu_default_params();
    cp.isa = isa;
    cp.threads = threads;
    td_adam_cpu *cpu;
    TD_ASSERT_OK(td_adam_cpu_create(&cp, &cpu));
    td_adam_chunk ch[3];
    int nc = problem_chunks(pb, 0, ch);
    for (int j = 0; j < nc; j++)
        TD_ASSERT_OK(td_adam_cpu_init(cpu, &ch[j], pb->p0 + (ch[j].master - pb->master), TD_DTYPE_F32));
    td_optim opt;
    TD_ASSERT_OK(td_optim_init(&opt, &pb->op));
    int levels = omp_get_max_active_levels();
    if (nested) omp_set_max_active_levels(1); /* the inner region gets one thread */
    for (int s = 0; s < STEPS; s++) {
        problem_chunks(pb, s, ch);
        td_grad_stats stats = {0};
        for (int j = 0; j < nc; j++) TD_ASSERT_OK(td_adam_cpu_grad_stats(cpu, ch[j].grad, pb->gdt, ch[j].numel, &stats));
        td_optim_step step;
        TD_ASSERT_OK(td_optim_begin_step(&opt, &stats, &step));
        assert_false(step.skip);
        assert_int_equal(step.step, s + 1);
        td_status st = TD_OK;
#pragma omp parallel num_threads(2) if (nested)
        {
            if (omp_get_thread_num() == 0) st = td_adam_cpu_update(cpu, &step.coeffs, ch, nc);
        }
        TD_ASSERT_OK(st);
    }
    omp_set_max_active_levels(levels);
    td_adam_cpu_destroy(cpu);
}

static void run_tidal(problem *pb, td_optim_isa isa, int threads) { run_tidal_nested(pb, isa, threads, 0); }

/* torch.optim.AdamW / Adam(weight_decay) in double, after unscale and
 * clip_grad_norm_ (coefficient min(1, max_norm / (norm + 1e-6))). */
static void run_reference(const problem *pb, double *p, double *m, double *v, double *max_g)
{
    const td_adam_hparams *hp = &pb->op.adam;
    double scale = pb->op.scaler.init_scale, lr = pb->op.lr.lr;
    size_t n = pb->n;
    for (size_t i = 0; i < n; i++) p[i] = pb->p0[i], m[i] = v[i] = 0;
    *max_g = 0;
    for (int s = 0; s < STEPS; s++) {
        long t = s + 1;
        double sumsq = 0;
        for (size_t i = 0; i < n; i++) {
            double g = td_test_load_as(pb->grads[s], pb->gdt, i) / scale;
            sumsq += g * g;
        }
        double norm = sqrt(sumsq), coef = 1;
        if (pb->op.max_grad_norm > 0 && pb->op.max_grad_norm / (norm + 1e-6) < 1) coef = pb->op.max_grad_norm / (norm + 1e-6);
        double bc1 = 1 - pow(hp->beta1, (double)t), bc2 = 1 - pow(hp->beta2, (double)t);
        for (size_t i = 0; i < n; i++) {
            double g = td_test_load_as(pb->grads[s], pb->gdt, i) / scale * coef;
            if (fabs(g) > *max_g) *max_g = fabs(g);
            if (hp->decay == TD_ADAM_DECAY_L2) g += hp->weight_decay * p[i];
            else p[i] *= 1 - lr * hp->weight_decay;
            m[i] = hp->beta1 * m[i] + (1 - hp->beta1) * g;
            v[i] = hp->beta2 * v[i] + (1 - hp->beta2) * g * g;
            double denom = sqrt(v[i]) / sqrt(bc2) + hp->eps;
            p[i] -= lr / bc1 * m[i] / denom;
        }
    }
}

static void test_each_isa_matches_double_reference(void **state)
{
    int seeds = td_test_seeds(60);
    double worst[3] = {0};
    for (int seed = 1; seed <= seeds; seed++) {
        problem pb;
        problem_make(&pb, (uint64_t)seed * 7919);
        double *p = malloc(pb.n * 8), *m = malloc(pb.n * 8), *v = malloc(pb.n * 8), max_g;
        run_reference(&pb, p, m, v, &max_g);
        for (int isa = TD_OPTIM_ISA_SCALAR; isa < TD_OPTIM_ISA_COUNT; isa++) {
            if (!td_optim_isa_supported((td_optim_isa)isa)) continue;
            run_tidal(&pb, (td_optim_isa)isa, 1 + seed % 3);
            /* fp32 tolerance: a few roundings per step on p (relative) and on
             * the update (bounded by ~3 lr in magnitude), accumulated. */
            double lr = pb.op.lr.lr, e = FLT_EPSILON * STEPS;
            for (size_t i = 0; i < pb.n; i++) {
                double dp = fabs(pb.master[i] - p[i]) / (e * (fabs(p[i]) + 4 * lr));
                double dm = fabs(pb.m[i] - m[i]) / (e * (fabs(m[i]) + max_g));
                double dv = fabs(pb.v[i] - v[i]) / (e * (fabs(v[i]) + max_g * max_g));
                if (dp > worst[0]) worst[0] = dp;
                if (dm > worst[1]) worst[1] = dm;
                if (dv > worst[2]) worst[2] = dv;
                if (dp > 4 || dm > 4 || dv > 4)
                    fail_msg("seed %d %s: element %zu of %zu: p %.9g vs %.9g, m %.9g vs %.9g, v %.9g vs %.9g "
                             "(grad %s, decay %s, wd %g, lr %g, scale %g, clip %g)",
                             seed, td_optim_isa_name(isa), i, pb.n, pb.master[i], p[i], pb.m[i], m[i], pb.v[i], v[i],
                             td_dtype_name(pb.gdt), pb.op.adam.decay == TD_ADAM_DECAY_L2 ? "l2" : "decoupled",
                             pb.op.adam.weight_decay, lr, pb.op.scaler.init_scale, pb.op.max_grad_norm);
            }
            if (pb.has_out && !pb.out_is_master) /* the output is the new master, rounded */
                for (size_t i = 0; i < pb.n; i++) {
                    uint16_t want16 = pb.pdt == TD_DTYPE_BF16 ? td_bf16_from_f32(pb.master[i]) : td_f16_from_f32(pb.master[i]);
                    if (pb.pdt == TD_DTYPE_F32) assert_true(((float *)pb.out)[i] == pb.master[i]);
                    else assert_int_equal(((uint16_t *)pb.out)[i], want16);
                }
        }
        free(p), free(m), free(v);
        problem_free(&pb);
    }
    print_message("worst error in units of fp32 tolerance: p %.3f, m %.3f, v %.3f (limit 4)\n", worst[0], worst[1], worst[2]);
}

/* Same inputs: every ISA and every team size give the same bits. */
static void test_variants_and_teams_bit_identical(void **state)
{
    int seeds = td_test_seeds(30);
    for (int seed = 1; seed <= seeds; seed++) {
        problem pb;
        problem_make(&pb, (uint64_t)seed * 104729);
        size_t bytes = pb.n * 4;
        float *want_p = malloc(bytes), *want_m = malloc(bytes), *want_v = malloc(bytes);
        void *want_o = malloc(bytes);
        run_tidal(&pb, TD_OPTIM_ISA_SCALAR, 1);
        memcpy(want_p, pb.master, bytes), memcpy(want_m, pb.m, bytes), memcpy(want_v, pb.v, bytes);
        size_t obytes = pb.n * td_dtype_bytes(pb.pdt);
        if (pb.has_out) memcpy(want_o, pb.out, obytes);
        for (int isa = TD_OPTIM_ISA_SCALAR; isa < TD_OPTIM_ISA_COUNT; isa++) {
            if (!td_optim_isa_supported((td_optim_isa)isa)) continue;
            for (int threads = 1; threads <= 4; threads++) {
                run_tidal(&pb, (td_optim_isa)isa, threads);
                if (memcmp(pb.master, want_p, bytes) || memcmp(pb.m, want_m, bytes) || memcmp(pb.v, want_v, bytes) ||
                    (pb.has_out && memcmp(pb.out, want_o, obytes)))
                    fail_msg("seed %d: %s with %d threads differs from scalar", seed, td_optim_isa_name(isa), threads);
            }
        }
        free(want_p), free(want_m), free(want_v), free(want_o);
        problem_free(&pb);
    }
}

/* Chunks of many pieces (a thread's range is claimed in pieces of 16 Ki
 * elements, and a thread done with its own claims the others' leftovers),
 * teams of several sizes, and a team the runtime cuts to one thread (a
 * call from inside a parallel region): the same bits as one scalar thread. */
static void test_pieces_and_teams_bit_identical(void **state)
{
    (void)state;
    for (int seed = 1; seed <= 3; seed++) {
        problem pb;
        /* 3 to 5 pieces a thread at 4 threads, and a ragged end */
        problem_make_n(&pb, (uint64_t)seed * 7919, (size_t)(3 + seed) * 4 * 16384 + 777 * (size_t)seed);
        size_t bytes = pb.n * 4, obytes = pb.n * td_dtype_bytes(pb.pdt);
        float *want_p = malloc(bytes), *want_m = malloc(bytes), *want_v = malloc(bytes);
        void *want_o = malloc(bytes);
        run_tidal(&pb, TD_OPTIM_ISA_SCALAR, 1);
        memcpy(want_p, pb.master, bytes), memcpy(want_m, pb.m, bytes), memcpy(want_v, pb.v, bytes);
        if (pb.has_out) memcpy(want_o, pb.out, obytes);
        for (int threads = 2; threads <= 7; threads += 5 - seed) {
            for (int nested = 0; nested < 2; nested++) {
                run_tidal_nested(&pb, TD_OPTIM_ISA_AUTO, threads, nested);
                if (memcmp(pb.master, want_p, bytes) || memcmp(pb.m, want_m, bytes) || memcmp(pb.v, want_v, bytes) ||
                    (pb.has_out && memcmp(pb.out, want_o, obytes)))
                    fail_msg("seed %d, %zu elements in %d chunks: %d threads%s differ from one scalar thread", seed,
                             pb.n, pb.n_chunks, threads, nested ? " (cut to one by the runtime)" : "");
            }
        }
        free(want_p), free(want_m), free(want_v), free(want_o);
        problem_free(&pb);
    }
}

/* Every element of every chunk is owned by exactly one thread, bounds fall
 * on multiples of 1024 elements (pages of fp32), and the split is even. */
static void test_partition_tiles_chunks(void **state)
{
    for (int threads = 1; threads <= 9; threads++) {
        td_adam_cpu_params cp = td_adam_cpu_default_params();
        cp.threads = threads;
        td_adam_cpu *cpu;
        TD_ASSERT_OK(td_adam_cpu_create(&cp, &cpu));
        assert_int_equal(td_adam_cpu_threads(cpu), threads);
        static const size_t sizes[] = {0, 1, 1023, 1024, 1025, 4096, 10000, 1 << 20, (1 << 20) + 17};
        for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
            size_t n = sizes[k], next = 0, blocks = (n + 1023) / 1024, most = 0, least = (size_t)-1;
            for (int t = 0; t < threads; t++) {
                size_t b, e;
                td_adam_cpu_partition(cpu, n, t, &b, &e);
                assert_int_equal(b, next);
                assert_true(e >= b);
                assert_true(b % 1024 == 0 || b == n);
                next = e;
                size_t nb = (e - b + 1023) / 1024;
                if (nb > most) most = nb;
                if (nb < least) least = nb;
            }
            assert_int_equal(next, n);
            assert_true(most - least <= 1 || blocks == 0);
        }
        td_adam_cpu_destroy(cpu);
    }
}

static void test_init_first_touch(void **state)
{
    enum { N = 5000 };
    td_adam_cpu *cpu;
    td_adam_cpu_params cp = td_adam_cpu_default_params();
    cp.threads = 3;
    TD_ASSERT_OK(td_adam_cpu_create(&cp, &cpu));
    float *master = malloc(N * 4), *m = malloc(N * 4), *v = malloc(N * 4);
    uint16_t init[N], out[N];
    for (int i = 0; i < N; i++) init[i] = td_bf16_from_f32((float)i * 0.37f - 900.0f);
    memset(m, 0x7f, N * 4), memset(v, 0x7f, N * 4), memset(out, 0xff, sizeof out);
    td_adam_chunk ch = {master, m, v, NULL, TD_DTYPE_F32, out, TD_DTYPE_F16, N, TD_OPTIM_STATE_FP32, NULL, 0};
    TD_ASSERT_OK(td_adam_cpu_init(cpu, &ch, init, TD_DTYPE_BF16));
    for (int i = 0; i < N; i++) {
        assert_true(master[i] == td_f32_from_bf16(init[i]));
        assert_true(m[i] == 0 && v[i] == 0);
        assert_int_equal(out[i], td_f16_from_f32(master[i]));
    }
    TD_ASSERT_OK(td_adam_cpu_init(cpu, &ch, NULL, TD_DTYPE_F32)); /* zeros */
    for (int i = 0; i < N; i++) assert_true(master[i] == 0 && out[i] == 0);
    free(master), free(m), free(v);
    td_adam_cpu_destroy(cpu);
}

/* Sums of squares against a double reference; every Inf/NaN anywhere is
 * reported; the value is the same on every call (deterministic). */
static void test_grad_stats(void **state)
{
    int seeds = td_test_seeds(20);
    td_adam_cpu_params cp = td_adam_cpu_default_params();
    for (int seed = 1; seed <= seeds; seed++) {
        td_rng r;
        td_rng_seed(&r, (uint64_t)seed);
        cp.threads = 1 + seed % 4;
        for (int isa = TD_OPTIM_ISA_SCALAR; isa < TD_OPTIM_ISA_COUNT; isa++) {
            if (!td_optim_isa_supported((td_optim_isa)isa)) continue;
            cp.isa = (td_optim_isa)isa;
            td_adam_cpu *cpu;
            TD_ASSERT_OK(td_adam_cpu_create(&cp, &cpu));
            for (int dt = 0; dt < TD_DTYPE_COUNT; dt++) {
                size_t n = 1 + td_rng_below(&r, 20000);
                void *g = malloc(n * 4 + 8);
                char *gu = (char *)g + td_dtype_bytes((td_dtype)dt) * td_rng_below(&r, 2); /* not 8-aligned */
                double want = 0, big = dt == TD_DTYPE_F16 ? 65504 : 3e38;
                for (size_t i = 0; i < n; i++) {
                    float x = (float)(td_rng_below(&r, 50) ? uniform(&r, -2, 2) : uniform(&r, -big, big));
                    td_test_store_as(gu, (td_dtype)dt, i, x);
                    double y = td_test_load_as(gu, (td_dtype)dt, i);
                    want += y * y;
                }
                td_grad_stats s = {0}, s2 = {0};
                TD_ASSERT_OK(td_adam_cpu_grad_stats(cpu, gu, (td_dtype)dt, n, &s));
                TD_ASSERT_OK(td_adam_cpu_grad_stats(cpu, gu, (td_dtype)dt, n, &s2));
                assert_true(s.sumsq == s2.sumsq);
                assert_false(td_grad_stats_overflow(&s));
                assert_true(fabs(s.sumsq - want) <= 1e-12 * want);
                /* One Inf or NaN at the start, the end or inside a vector. */
                size_t where[] = {0, n - 1, n / 2, td_rng_below(&r, n)};
                float bad[] = {INFINITY, -INFINITY, NAN};
                for (size_t w = 0; w < 4; w++)
                    for (size_t b = 0; b < 3; b++) {
                        unsigned char keep[4];
                        size_t sz = td_dtype_bytes((td_dtype)dt);
                        memcpy(keep, gu + where[w] * sz, sz);
                        td_test_store_as(gu, (td_dtype)dt, where[w], bad[b]);
                        td_grad_stats o = {0};
                        TD_ASSERT_OK(td_adam_cpu_grad_stats(cpu, gu, (td_dtype)dt, n, &o));
                        assert_true(td_grad_stats_overflow(&o));
                        memcpy(gu + where[w] * sz, keep, sz);
                    }
                free(g);
            }
            td_adam_cpu_destroy(cpu);
        }
    }
    /* The largest finite values cannot overflow the double sum. */
    float huge[64];
    for (int i = 0; i < 64; i++) huge[i] = FLT_MAX;
    td_grad_stats s = {td_grad_sumsq_range(TD_OPTIM_ISA_AUTO, huge, TD_DTYPE_F32, 0, 64)};
    assert_false(td_grad_stats_overflow(&s));
}

static void test_coeffs_and_clip(void **state)
{
    td_adam_hparams hp = td_adam_default_hparams();
    td_adam_coeffs c;
    TD_ASSERT_OK(td_adam_coeffs_make(&hp, 1e-3, 3, 0.25, &c));
    assert_true(c.step_size == (float)(1e-3 / (1 - pow(0.9, 3))));
    assert_true(c.rsqrt_bc2 == (float)(1 / sqrt(1 - pow(0.999, 3))));
    assert_true(c.decay_mul == (float)(1 - 1e-3 * 0.01));
    assert_true(c.l2 == 0 && c.grad_mul == 0.25f);
    hp.decay = TD_ADAM_DECAY_L2;
    TD_ASSERT_OK(td_adam_coeffs_make(&hp, 1e-3, 3, 1, &c));
    assert_true(c.l2 == 0.01f && c.decay_mul == 1.0f);
    assert_int_equal(td_adam_coeffs_make(&hp, 1e-3, 0, 1, &c), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "steps count from 1"));
    assert_int_equal(td_adam_coeffs_make(&hp, NAN, 1, 1, &c), TD_ERR_INVALID);
    hp.beta2 = 1.0;
    assert_int_equal(td_adam_coeffs_make(&hp, 1e-3, 1, 1, &c), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "beta2"));
    /* torch.nn.utils.clip_grad_norm_'s coefficient. */
    assert_true(td_clip_coef(4.0, 1.0) == 1.0 / (4.0 + 1e-6));
    assert_true(td_clip_coef(0.5, 1.0) == 1.0);
    assert_true(td_clip_coef(100, 0) == 1.0);
    td_grad_stats s = {16.0 * 1024 * 1024};
    assert_true(td_grad_stats_norm(&s, 1024) == 4.0);
}

static void test_errors(void **state)
{
    td_adam_cpu *cpu;
    td_adam_cpu_params cp = td_adam_cpu_default_params();
    cp.threads = -1;
    assert_int_equal(td_adam_cpu_create(&cp, &cpu), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "threads"));
    cp = td_adam_cpu_default_params();
    for (int isa = TD_OPTIM_ISA_AVX2; isa < TD_OPTIM_ISA_COUNT; isa++)
        if (!td_optim_isa_supported((td_optim_isa)isa)) {
            cp.isa = (td_optim_isa)isa;
            assert_int_equal(td_adam_cpu_create(&cp, &cpu), TD_ERR_UNSUPPORTED);
            assert_non_null(strstr(td_error_msg(), "lacks"));
        }
    td_optim_isa isa;
    assert_int_equal(td_optim_isa_parse("sse9", &isa), TD_ERR_INVALID);
    TD_ASSERT_OK(td_optim_isa_parse("avx2", &isa));
    assert_int_equal(isa, TD_OPTIM_ISA_AVX2);
    td_dtype dt;
    TD_ASSERT_OK(td_dtype_parse("bf16", &dt));
    assert_int_equal(dt, TD_DTYPE_BF16);

    cp = td_adam_cpu_default_params();
    TD_ASSERT_OK(td_adam_cpu_create(&cp, &cpu));
    assert_int_equal(td_adam_cpu_isa(cpu), td_optim_isa_best());
    float a[4] = {0}, b[4] = {0}, c4[4] = {0}, g[4] = {0};
    td_adam_coeffs co;
    td_adam_hparams hp = td_adam_default_hparams();
    TD_ASSERT_OK(td_adam_coeffs_make(&hp, 1e-3, 1, 1, &co));
    td_adam_chunk ch = {a, b, c4, g, TD_DTYPE_F32, NULL, TD_DTYPE_F32, 4, TD_OPTIM_STATE_FP32, NULL, 0};
    ch.grad_dtype = (td_dtype)7;
    assert_int_equal(td_adam_cpu_update(cpu, &co, &ch, 1), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "grad dtype"));
    ch.grad_dtype = TD_DTYPE_F32;
    ch.m = NULL;
    assert_int_equal(td_adam_cpu_update(cpu, &co, &ch, 1), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "NULL"));
    ch.m = b;
    ch.param_out = a;
    ch.param_dtype = TD_DTYPE_BF16;
    assert_int_equal(td_adam_cpu_update(cpu, &co, &ch, 1), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "aliases"));
    ch.param_dtype = TD_DTYPE_F32; /* fp32 output into master itself is allowed */
    TD_ASSERT_OK(td_adam_cpu_update(cpu, &co, &ch, 1));
    TD_ASSERT_OK(td_adam_cpu_update(cpu, &co, &ch, 0));
    assert_int_equal(td_adam_cpu_grad_stats(cpu, NULL, TD_DTYPE_F32, 4, &(td_grad_stats){0}), TD_ERR_INVALID);
    td_adam_cpu_destroy(cpu);
    td_adam_cpu_destroy(NULL);
}

/* The grads may arrive in the buffer that receives the new params (a host
 * copy that holds a chunk's grads until its AdamW writes its params over
 * them): with param_out == grad, every state type, grad dtype, ISA and team
 * size, with and without no-decay ranges, gives the bits of separate
 * buffers; a param_out that aliases grads of another dtype is refused. */
static void test_param_out_may_alias_grad(void **state)
{
    enum { N = 5000 + 37, ASTEPS = 3 }; /* odd: vector tails, a partial int8 block, uneven thread ranges */
    static const td_adam_range ranges[] = {{5, 300}, {1000, 1001}, {2047, 4100}};
    td_rng r;
    td_rng_seed(&r, 4242);
    float *p0 = malloc(N * 4), *gsrc = malloc((size_t)ASTEPS * N * 4);
    for (size_t i = 0; i < N; i++) p0[i] = (float)uniform(&r, -1, 1);
    for (size_t i = 0; i < (size_t)ASTEPS * N; i++) gsrc[i] = (float)uniform(&r, -0.1, 0.1);
    td_adam_hparams hp = td_optim_default_params().adam;
    hp.weight_decay = 0.1;
    for (int isa = TD_OPTIM_ISA_SCALAR; isa < TD_OPTIM_ISA_COUNT; isa++) {
        if (!td_optim_isa_supported((td_optim_isa)isa)) continue;
        for (int threads = 1; threads <= 3; threads += 2)
            for (int s = 0; s < TD_OPTIM_STATE_COUNT; s++)
                for (int dt = 0; dt < TD_DTYPE_COUNT; dt++)
                    for (int nd = 0; nd < 2; nd++) {
                        td_adam_cpu_params cp = td_adam_cpu_default_params();
                        cp.isa = (td_optim_isa)isa;
                        cp.threads = threads;
                        td_adam_cpu *cpu;
                        TD_ASSERT_OK(td_adam_cpu_create(&cp, &cpu));
                        size_t esz = td_dtype_bytes((td_dtype)dt), mb = td_adam_moment_bytes(s, N);
                        td_adam_chunk ch[2]; /* 0: separate grad and param_out; 1: param_out == grad */
                        void *bufs[2][5];
                        for (int a = 0; a < 2; a++) {
                            bufs[a][0] = malloc(N * 4);  /* master */
                            bufs[a][1] = calloc(1, mb);  /* m */
                            bufs[a][2] = calloc(1, mb);  /* v */
                            bufs[a][3] = malloc(N * esz); /* param_out */
                            bufs[a][4] = a ? bufs[a][3] : malloc(N * esz); /* grad */
                            ch[a] = (td_adam_chunk){.master = bufs[a][0], .m = bufs[a][1], .v = bufs[a][2],
                                                    .grad = bufs[a][4], .grad_dtype = (td_dtype)dt,
                                                    .param_out = bufs[a][3], .param_dtype = (td_dtype)dt,
                                                    .numel = N, .state = (td_optim_state)s,
                                                    .no_decay = nd ? ranges : NULL, .n_no_decay = nd ? 3 : 0};
                            TD_ASSERT_OK(td_adam_cpu_init(cpu, &ch[a], p0, TD_DTYPE_F32));
                        }
                        for (int step = 1; step <= ASTEPS; step++) {
                            td_adam_coeffs c;
                            TD_ASSERT_OK(td_adam_coeffs_make(&hp, 1e-2, step, 1.0, &c));
                            for (int a = 0; a < 2; a++) {
                                for (size_t i = 0; i < N; i++)
                                    td_test_store_as(bufs[a][4], (td_dtype)dt, i, gsrc[(size_t)(step - 1) * N + i]);
                                TD_ASSERT_OK(td_adam_cpu_update(cpu, &c, &ch[a], 1));
                            }
                            if (memcmp(bufs[0][0], bufs[1][0], N * 4) || memcmp(bufs[0][1], bufs[1][1], mb) ||
                                memcmp(bufs[0][2], bufs[1][2], mb) || memcmp(bufs[0][3], bufs[1][3], N * esz))
                                fail_msg("%s, %d threads, %s state, %s grads and params%s: step %d differs when "
                                         "param_out is the grad buffer", td_optim_isa_name(isa), threads,
                                         td_optim_state_name((td_optim_state)s), td_dtype_name((td_dtype)dt),
                                         nd ? ", no-decay ranges" : "", step);
                        }
                        for (int a = 0; a < 2; a++) {
                            for (int b = 0; b < 4; b++) free(bufs[a][b]);
                            if (!a) free(bufs[a][4]);
                        }
                        td_adam_cpu_destroy(cpu);
                    }
    }
    /* Aliased grads and params of different dtypes would overwrite grads not yet read. */
    td_adam_cpu *cpu;
    TD_ASSERT_OK(td_adam_cpu_create(NULL, &cpu));
    float master[8] = {0}, m[8] = {0}, v[8] = {0}, gp[8] = {0};
    td_adam_chunk bad = {.master = master, .m = m, .v = v, .grad = gp, .grad_dtype = TD_DTYPE_BF16,
                         .param_out = gp, .param_dtype = TD_DTYPE_F32, .numel = 8};
    td_adam_coeffs c;
    TD_ASSERT_OK(td_adam_coeffs_make(&hp, 1e-2, 1, 1.0, &c));
    assert_int_equal(td_adam_cpu_update(cpu, &c, &bad, 1), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "param_out aliases the grads"));
    td_adam_cpu_destroy(cpu);
    free(p0);
    free(gsrc);
}

/* The engine allocates through the accounting allocator and leaks nothing,
 * and a failed allocation surfaces as an error. */
static void test_no_leaks_and_alloc_failure(void **state)
{
    size_t live = td_host_live_allocs();
    for (long n = 1;; n++) {
        td_fault_arm(TD_FAULT_HOST_ALLOC, n);
        td_adam_cpu *cpu = NULL;
        td_status st = td_adam_cpu_create(NULL, &cpu);
        long reached = td_fault_count(TD_FAULT_HOST_ALLOC);
        td_fault_disarm_all();
        if (st == TD_OK) {
            td_adam_cpu_destroy(cpu);
            assert_true(reached < n);
            break;
        }
        assert_int_equal(st, TD_ERR_NOMEM);
        assert_null(cpu);
        assert_int_equal(td_host_live_allocs(), live);
    }
    assert_int_equal(td_host_live_allocs(), live);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_isa_matches_double_reference),
        cmocka_unit_test(test_variants_and_teams_bit_identical),
        cmocka_unit_test(test_pieces_and_teams_bit_identical),
        cmocka_unit_test(test_partition_tiles_chunks),
        cmocka_unit_test(test_init_first_touch),
        cmocka_unit_test(test_grad_stats),
        cmocka_unit_test(test_coeffs_and_clip),
        cmocka_unit_test(test_param_out_may_alias_grad),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_no_leaks_and_alloc_failure),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
