/* The CUDA ops (ops_cuda.h) against the CPU reference ops (ops.h, model_ref.h).
 *
 * Every op, forward and backward, on fresh random inputs of several shapes
 * (odd sizes, T not a multiple of anything, C not a multiple of 8, padded
 * vocabularies, unaligned views), in fp32, bf16 and fp16, with fp32 and
 * 16-bit parameter gradients.  The 16-bit inputs are rounded to the storage
 * type first and the CPU op runs on the rounded values, so the difference is
 * only what the GPU rounds on the way (its stores) plus the fp32 summation
 * order.  Error measure: max |gpu - cpu| / max |cpu| over a tensor; the
 * tolerance is
 *     k16 * u(dt)  (16-bit: u = 2^-8 bf16, 2^-11 fp16, the rounding unit)
 *     k32 * 2^-24  (fp32)
 *   + 8 * 2^-24 * sqrt(K)   (K the longest reduction: another summation order)
 * with k per op (TOL_* below): a bug shows as an error near 1, rounding as
 * a few units.  Gradients that are added into start from random values of
 * the gradient's own magnitude (a missing or doubled add fails); outputs
 * that are written start as NaN (an element left unwritten fails).
 * Each test prints, per storage type, its worst error as a fraction of its
 * tolerance.  The LLaMA-family ops (RMSNorm, SwiGLU, RoPE, grouped-query
 * attention with 1, 2 and 4 query heads a key/value head, q/k/v biases
 * through the qkv matmul) the same way.  The position-dependent ops
 * (encoder, RoPE, attention on both paths) also with packed documents:
 * positions restarting inside a row, attention not crossing them.  Also: a block composed of the CUDA ops against
 * td_model_block_forward/backward, bit-identical repeats, GEMM tuning
 * (the bits of an untuned context at every call), argument errors,
 * and the speed of one GPT-2 124M block (printed).
 *
 * Device memory comes from an arena on the cuda backend, as in the trainer. */
#include "td_test.h"
#include "tidal/arena.h"
#include "tidal/model_ref.h"
#include "tidal/ops.h"
#include "tidal/ops_cuda.h"
#include "tidal/convert.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CUDA_OK(expr)                                                                                      \
    do {                                                                                                   \
        cudaError_t e_ = (expr);                                                                           \
        if (e_ != cudaSuccess) fail_msg("%s: %s (%s:%d)", #expr, cudaGetErrorString(e_), __FILE__, __LINE__); \
    } while (0)

/* --- fixture ---------------------------------------------------------------- */

#define POOL_BYTES ((size_t)3 << 30)
#define MAX_HOST 256

static struct {
    td_backend *backend;
    td_arena *arena;
    void *ws, *pool;
    size_t used;
    td_ops_cuda *ctx, *ctx_nofuse, *ctx_fallback;
    void *s; /* the backend's compute stream */
    td_rng rng;
    void *host[MAX_HOST];
    int n_host;
} F;

static int setup(void **state)
{
    (void)state;
    td_backend_params bp = td_backend_default_params();
    bp.kind = TD_BACKEND_CUDA;
    if (td_backend_create(&bp, &F.backend) != TD_OK) {
        fprintf(stderr, "cuda backend: %s\n", td_error_msg());
        return -1;
    }
    if (td_arena_create(F.backend, POOL_BYTES + TD_OPS_CUDA_WORKSPACE_BYTES + TD_MiB, &F.arena) != TD_OK ||
        td_arena_alloc(F.arena, TD_OPS_CUDA_WORKSPACE_BYTES, TD_ROLE_WORKSPACE, &F.ws) != TD_OK ||
        td_arena_alloc(F.arena, POOL_BYTES, TD_ROLE_ACTIVATION, &F.pool) != TD_OK) {
        fprintf(stderr, "arena: %s\n", td_error_msg());
        return -1;
    }
    td_ops_cuda_params p = td_ops_cuda_default_params();
    p.workspace = F.ws;
    p.workspace_bytes = TD_OPS_CUDA_WORKSPACE_BYTES;
    if (td_ops_cuda_create(&p, &F.ctx) != TD_OK) return -1;
    p.fuse_gelu = 0;
    if (td_ops_cuda_create(&p, &F.ctx_nofuse) != TD_OK) return -1;
    p.fallback_gemm = 1;
    if (td_ops_cuda_create(&p, &F.ctx_fallback) != TD_OK) return -1;
    F.s = td_backend_native_queue(F.backend, TD_QUEUE_COMPUTE);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    td_ops_cuda_free(F.ctx);
    td_ops_cuda_free(F.ctx_nofuse);
    td_ops_cuda_free(F.ctx_fallback);
    td_arena_release(F.arena, F.pool);
    td_arena_release(F.arena, F.ws);
    td_arena_destroy(F.arena);
    td_backend_free(F.backend);
    return 0;
}

/* Frees the case's host buffers and empties the device pool. */
static void reset(void)
{
    CUDA_OK(cudaStreamSynchronize((cudaStream_t)F.s));
    for (int i = 0; i < F.n_host; i++) free(F.host[i]);
    F.n_host = 0;
    F.used = 0;
}

static void *hmalloc(size_t bytes)
{
    if (F.n_host == MAX_HOST) fail_msg("test: more than %d host buffers in one case", MAX_HOST);
    void *p = malloc(bytes ? bytes : 1);
    if (!p) fail_msg("test: host allocation of %zu bytes failed", bytes);
    F.host[F.n_host++] = p;
    return p;
}

static void *dmalloc(size_t bytes)
{
    size_t b = (bytes + 255) / 256 * 256;
    if (F.used + b > POOL_BYTES) fail_msg("test: device pool exhausted (%zu + %zu bytes)", F.used, b);
    void *p = (char *)F.pool + F.used;
    F.used += b;
    return p;
}

/* Copies and fills on the compute stream (non-blocking: the legacy stream
 * would not be ordered with it); host-side copies wait for completion. */
static void copy_sync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind)
{
    CUDA_OK(cudaMemcpyAsync(dst, src, bytes, kind, (cudaStream_t)F.s));
    CUDA_OK(cudaStreamSynchronize((cudaStream_t)F.s));
}

static void fill(void *d, int byte, size_t bytes)
{
    CUDA_OK(cudaMemsetAsync(d, byte, bytes, (cudaStream_t)F.s));
}

static size_t esize(td_dtype dt) { return td_dtype_bytes(dt); }

static float rnd(td_dtype dt, float x)
{
    if (dt == TD_DTYPE_BF16) return td_f32_from_bf16(td_bf16_from_f32(x));
    if (dt == TD_DTYPE_F16) return td_f32_from_f16(td_f16_from_f32(x));
    return x;
}

/* n uniform values in (-scale, scale), rounded to dt. */
static float *hrand(td_dtype dt, size_t n, float scale)
{
    float *h = hmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = rnd(dt, (float)((td_rng_uniform(&F.rng) * 2 - 1) * scale));
    return h;
}

static float *hcopy(const float *x, size_t n)
{
    float *h = hmalloc(n * sizeof(float));
    memcpy(h, x, n * sizeof(float));
    return h;
}

static float *hzero(size_t n)
{
    float *h = hmalloc(n * sizeof(float));
    memset(h, 0, n * sizeof(float));
    return h;
}

/* Device copy of h (n floats) in dt, `offset` elements past a 256-byte
 * boundary (a view that is not 16-byte aligned when offset is odd). */
static void *up_at(td_dtype dt, const float *h, size_t n, size_t offset)
{
    char *d = (char *)dmalloc((n + offset) * esize(dt)) + offset * esize(dt);
    void *tmp = hmalloc(n * esize(dt) + 1);
    for (size_t i = 0; i < n; i++) {
        if (dt == TD_DTYPE_BF16) ((uint16_t *)tmp)[i] = td_bf16_from_f32(h[i]);
        else if (dt == TD_DTYPE_F16) ((uint16_t *)tmp)[i] = td_f16_from_f32(h[i]);
        else ((float *)tmp)[i] = h[i];
    }
    CUDA_OK(cudaMemcpyAsync(d, tmp, n * esize(dt), cudaMemcpyHostToDevice, (cudaStream_t)F.s));
    CUDA_OK(cudaStreamSynchronize((cudaStream_t)F.s));
    return d;
}

static void *up(td_dtype dt, const float *h, size_t n) { return up_at(dt, h, n, 0); }

static int *up_int(const int *h, size_t n)
{
    int *d = dmalloc(n * sizeof(int));
    copy_sync(d, h, n * sizeof(int), cudaMemcpyHostToDevice);
    return d;
}

/* Device buffer of n elements, all bits set (NaN in every float format). */
static void *dnan_at(td_dtype dt, size_t n, size_t offset)
{
    char *d = (char *)dmalloc((n + offset) * esize(dt)) + offset * esize(dt);
    fill(d, 0xff, n * esize(dt));
    return d;
}

static void *dnan(td_dtype dt, size_t n) { return dnan_at(dt, n, 0); }

/* The device tensor as host floats (waits for the stream). */
static float *down(td_dtype dt, const void *d, size_t n)
{
    CUDA_OK(cudaStreamSynchronize((cudaStream_t)F.s));
    float *h = hmalloc(n * sizeof(float));
    void *tmp = hmalloc(n * esize(dt) + 1);
    copy_sync(tmp, d, n * esize(dt), cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < n; i++) {
        if (dt == TD_DTYPE_BF16) h[i] = td_f32_from_bf16(((uint16_t *)tmp)[i]);
        else if (dt == TD_DTYPE_F16) h[i] = td_f32_from_f16(((uint16_t *)tmp)[i]);
        else h[i] = ((float *)tmp)[i];
    }
    return h;
}

static float amax(const float *x, size_t n)
{
    float m = 0.0f;
    for (size_t i = 0; i < n; i++)
        if (fabsf(x[i]) > m) m = fabsf(x[i]);
    return m;
}

/* Start values for a gradient that is added into: random, of the size of
 * the gradient itself (g: the gradient from zero), rounded to gdt. */
static float *acc_like(td_dtype gdt, const float *g, size_t n)
{
    float a = amax(g, n);
    return hrand(gdt, n, a > 0 ? a : 1.0f);
}

/* --- tolerances and the worst-error summary ----------------------------------- */

typedef struct tol_k {
    double k16, k32;
} tol_k;

/*                               16-bit  fp32 (units of rounding) */
static const tol_k TOL_POINT  = {2, 32};   /* one rounding at the store */
static const tol_k TOL_LN     = {3, 64};
static const tol_k TOL_MATMUL = {3, 64};
static const tol_k TOL_GELU_MM = {6, 64};  /* + GELU of a rounded pre-activation or cuBLASLt's GELU */
static const tol_k TOL_ATT    = {6, 256};  /* P rounded, then O */
static const tol_k TOL_ATT_BW = {16, 512}; /* P, dS rounded; dS rows sum to 0 (cancellation) */
static const tol_k TOL_LOSS   = {2, 64};
static const tol_k TOL_HEAD   = {6, 128};
static const tol_k TOL_BLOCK  = {24, 2048};

static double tol_of(td_dtype dt, tol_k k, long K)
{
    const double u32 = 0x1p-24;
    const double u = dt == TD_DTYPE_BF16 ? 0x1p-8 : dt == TD_DTYPE_F16 ? 0x1p-11 : u32;
    return (dt == TD_DTYPE_F32 ? k.k32 : k.k16) * u + 8 * u32 * sqrt((double)(K > 1 ? K : 1));
}

static struct {
    double ratio[TD_DTYPE_COUNT];
    char where[TD_DTYPE_COUNT][168];
    int checks;
} W;

static void worst_begin(void) { memset(&W, 0, sizeof W); }

static void worst_print(const char *test)
{
    for (int d = 0; d < TD_DTYPE_COUNT; d++)
        if (W.where[d][0])
            print_message("  %-16s %-4s worst error %.3f of its tolerance (%s)\n", test,
                          td_dtype_name((td_dtype)d), W.ratio[d], W.where[d]);
    print_message("  %-16s %d tensors compared\n", test, W.checks);
}

/* Compares n values; `what` names the tensor and the case. */
static void check_at(const char *what, td_dtype dt, const float *got, const float *want, size_t n,
                     double tol)
{
    double max_err = 0, max_ref = 0;
    size_t worst = 0;
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(got[i]) && isfinite(want[i])) {
            bad = 1;
            worst = i;
            break;
        }
        double d = fabs((double)got[i] - (double)want[i]);
        if (d > max_err) {
            max_err = d;
            worst = i;
        }
        if (fabs((double)want[i]) > max_ref) max_ref = fabs((double)want[i]);
    }
    double err = bad ? INFINITY : max_ref > 0 ? max_err / max_ref : max_err;
    W.checks++;
    if (err / tol >= W.ratio[dt] || !W.where[dt][0]) {
        W.ratio[dt] = err / tol;
        snprintf(W.where[dt], sizeof W.where[dt], "%s", what);
    }
    if (!(err <= tol))
        fail_msg("%s (%s): error %.3e > tolerance %.2e; worst at %zu of %zu: gpu %.7g, cpu %.7g (max |cpu| %.4g)",
                 what, td_dtype_name(dt), err, tol, worst, n, n ? got[worst] : 0.0, n ? want[worst] : 0.0,
                 max_ref);
}

/* Compares a device tensor of type dt with the CPU's floats. */
static void check_dev(const char *what, td_dtype dt, const void *d, const float *want, size_t n, double tol)
{
    check_at(what, dt, down(dt, d, n), want, n, tol);
}

static char label[160];
#define LABEL(...) (snprintf(label, sizeof label, __VA_ARGS__), label)

static const td_dtype DTS[] = {TD_DTYPE_F32, TD_DTYPE_BF16, TD_DTYPE_F16};
#define N_DTS 3

/* Gradient types to test with storage type dt: dt, and fp32 for 16-bit. */
static int grad_types(td_dtype dt, td_dtype out[2])
{
    out[0] = dt;
    out[1] = TD_DTYPE_F32;
    return dt == TD_DTYPE_F32 ? 1 : 2;
}

static void *scratch_for(size_t bytes) { return bytes ? dmalloc(bytes) : NULL; }

/* --- encoder -------------------------------------------------------------------- */

static void test_encoder(void **state)
{
    (void)state;
    /* B, T, C, Vp, token range (small: many repeated tokens) */
    static const int cases[][5] = {
        {1, 1, 8, 1, 1}, {2, 5, 8, 7, 7}, {3, 33, 72, 50, 5}, {1, 17, 100, 13, 13}, {4, 64, 768, 1000, 1000},
    };
    td_rng_seed(&F.rng, 101);
    worst_begin();
    for (int di = 0; di < N_DTS; di++) {
        const td_dtype dt = DTS[di];
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const int B = cases[ci][0], T = cases[ci][1], C = cases[ci][2], Vp = cases[ci][3], range = cases[ci][4];
            const size_t N = (size_t)B * T;
            td_dtype gdts[2];
            const int ng = grad_types(dt, gdts);
            for (int gi = 0; gi < 2 * ng; gi++) { /* each gradient type, then again with packed documents */
                const td_dtype gdt = gdts[gi % ng];
                const int packed = gi >= ng;
                reset();
                int *tok = hmalloc(N * sizeof(int)), *pos = packed ? hmalloc(N * sizeof(int)) : NULL;
                for (size_t i = 0; i < N; i++) tok[i] = (int)td_rng_below(&F.rng, (uint64_t)range);
                for (size_t i = 0; packed && i < N; i++) /* documents of 1 to 4 tokens */
                    pos[i] = i % (size_t)T && td_rng_below(&F.rng, 4) ? pos[i - 1] + 1 : 0;
                int *d_pos = packed ? up_int(pos, N) : NULL;
                float *wte = hrand(dt, (size_t)Vp * C, 1), *wpe = hrand(dt, (size_t)T * C, 1);
                int *d_tok = up_int(tok, N);
                if (gi % ng == 0) {
                    float *want = hmalloc(N * C * sizeof(float));
                    td_ops_encoder_forward(want, tok, pos, wte, wpe, B, T, C);
                    void *d_out = dnan(dt, N * C);
                    TD_ASSERT_OK(td_ops_cuda_encoder_forward(d_out, d_tok, d_pos, up(dt, wte, (size_t)Vp * C),
                                                             up(dt, wpe, (size_t)T * C), B, T, C, dt, F.s));
                    check_dev(LABEL("encoder out B%d T%d C%d packed %d", B, T, C, packed), dt, d_out, want, N * C,
                              tol_of(dt, TOL_POINT, 2));
                }
                float *dout = hrand(dt, N * C, 1);
                float *g0 = hzero((size_t)Vp * C), *p0 = hzero((size_t)T * C);
                td_ops_encoder_backward(g0, p0, dout, tok, pos, B, T, C);
                float *dwte = acc_like(gdt, g0, (size_t)Vp * C), *dwpe = acc_like(gdt, p0, (size_t)T * C);
                void *d_dwte = up(gdt, dwte, (size_t)Vp * C), *d_dwpe = up(gdt, dwpe, (size_t)T * C);
                td_ops_encoder_backward(dwte, dwpe, dout, tok, pos, B, T, C);
                size_t sb = td_ops_cuda_encoder_scratch_bytes(B, T, Vp);
                TD_ASSERT_OK(td_ops_cuda_encoder_backward(d_dwte, d_dwpe, up(dt, dout, N * C), d_tok, d_pos, B, T, C, Vp,
                                                          dt, gdt, scratch_for(sb), sb, F.s));
                check_dev(LABEL("encoder dwte B%d T%d C%d grads %s", B, T, C, td_dtype_name(gdt)), gdt, d_dwte,
                          dwte, (size_t)Vp * C, tol_of(gdt, TOL_POINT, (long)N));
                check_dev(LABEL("encoder dwpe B%d T%d C%d grads %s packed %d", B, T, C, td_dtype_name(gdt), packed), gdt,
                          d_dwpe, dwpe, (size_t)T * C, tol_of(gdt, TOL_POINT, packed ? (long)N : B));
            }
        }
    }
    reset();
    worst_print("encoder");
}

/* --- LayerNorm ------------------------------------------------------------------- */

static void test_layernorm(void **state)
{
    (void)state;
    /* {300, 64} and {700, 1600}: several row partitions of the weight and
     * bias sums; {3, 16384}: rows of many steps a lane */
    static const int cases[][2] = {{1, 8},    {37, 72},   {64, 768},  {13, 100},  {5, 1600},
                                   {3, 2050}, {300, 64}, {700, 1600}, {3, 16384}};
    td_rng_seed(&F.rng, 102);
    worst_begin();
    for (int di = 0; di < N_DTS; di++) {
        const td_dtype dt = DTS[di];
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const int N = cases[ci][0], C = cases[ci][1];
            const size_t NC = (size_t)N * C;
            td_dtype gdts[2];
            const int ng = grad_types(dt, gdts);
            for (int gi = 0; gi < ng; gi++) {
                const td_dtype gdt = gdts[gi];
                reset();
                float *x = hrand(dt, NC, 2), *w = hrand(dt, C, 1), *b = hrand(dt, C, 1);
                for (size_t i = 0; i < NC; i++) x[i] = rnd(dt, x[i] + 0.5f); /* a nonzero mean */
                float *out = hmalloc(NC * 4), *mean = hmalloc(N * 4), *rstd = hmalloc(N * 4);
                td_ops_layernorm_forward(out, mean, rstd, x, w, b, N, C);
                void *d_x = up(dt, x, NC), *d_w = up(dt, w, C), *d_b = up(dt, b, C);
                float *d_mean = dnan(TD_DTYPE_F32, N), *d_rstd = dnan(TD_DTYPE_F32, N);
                if (gi == 0) {
                    void *d_out = dnan(dt, NC);
                    TD_ASSERT_OK(td_ops_cuda_layernorm_forward(d_out, d_mean, d_rstd, d_x, d_w, d_b, N, C, dt, F.s));
                    check_dev(LABEL("layernorm out N%d C%d", N, C), dt, d_out, out, NC, tol_of(dt, TOL_LN, C));
                    check_dev(LABEL("layernorm mean N%d C%d", N, C), TD_DTYPE_F32, d_mean, mean, N,
                              tol_of(TD_DTYPE_F32, TOL_LN, C));
                    check_dev(LABEL("layernorm rstd N%d C%d", N, C), TD_DTYPE_F32, d_rstd, rstd, N,
                              tol_of(TD_DTYPE_F32, TOL_LN, C));
                }
                /* backward from the CPU's statistics (both sides use the same) */
                float *dout = hrand(dt, NC, 1);
                float *dx0 = hzero(NC), *dw0 = hzero(C), *db0 = hzero(C);
                td_ops_layernorm_backward(dx0, dw0, db0, dout, x, w, mean, rstd, N, C);
                float *dx = acc_like(dt, dx0, NC), *dw = acc_like(gdt, dw0, C), *db = acc_like(gdt, db0, C);
                void *d_dx = up(dt, dx, NC), *d_dw = up(gdt, dw, C), *d_db = up(gdt, db, C);
                td_ops_layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, N, C);
                copy_sync(d_mean, mean, N * 4, cudaMemcpyHostToDevice);
                copy_sync(d_rstd, rstd, N * 4, cudaMemcpyHostToDevice);
                size_t sb = td_ops_cuda_layernorm_scratch_bytes(N, C);
                TD_ASSERT_OK(td_ops_cuda_layernorm_backward(d_dx, d_dw, d_db, up(dt, dout, NC), d_x, d_w, d_mean,
                                                            d_rstd, N, C, dt, gdt, scratch_for(sb), sb, F.s));
                check_dev(LABEL("layernorm dinp N%d C%d", N, C), dt, d_dx, dx, NC, tol_of(dt, TOL_LN, C));
                check_dev(LABEL("layernorm dweight N%d C%d grads %s", N, C, td_dtype_name(gdt)), gdt, d_dw, dw, C,
                          tol_of(gdt, TOL_LN, N));
                check_dev(LABEL("layernorm dbias N%d C%d grads %s", N, C, td_dtype_name(gdt)), gdt, d_db, db, C,
                          tol_of(gdt, TOL_LN, N));
                /* beside a residual gradient in another buffer (dinp = dres + ...),
                 * and with none (dinp set): dx0, dw0, db0 hold the bare gradients */
                float *dres = hrand(dt, NC, 1), *want = hmalloc(NC * 4);
                for (size_t i = 0; i < NC; i++) want[i] = dres[i] + dx0[i];
                void *d_dres = up(dt, dres, NC), *d_out = up(dt, dout, NC);
                for (int with_res = 0; with_res < 2; with_res++) {
                    void *d_dx2 = dnan(dt, NC), *d_dw2 = up(gdt, hzero(C), C), *d_db2 = up(gdt, hzero(C), C);
                    TD_ASSERT_OK(td_ops_cuda_layernorm_backward_res(d_dx2, with_res ? d_dres : NULL, d_dw2, d_db2, d_out,
                                                                    d_x, d_w, d_mean, d_rstd, N, C, dt, gdt,
                                                                    scratch_for(sb), sb, F.s));
                    check_dev(LABEL("layernorm dinp res %d N%d C%d", with_res, N, C), dt, d_dx2, with_res ? want : dx0,
                              NC, tol_of(dt, TOL_LN, C));
                    check_dev(LABEL("layernorm dweight res %d N%d C%d", with_res, N, C), gdt, d_dw2, dw0, C,
                              tol_of(gdt, TOL_LN, N));
                    check_dev(LABEL("layernorm dbias res %d N%d C%d", with_res, N, C), gdt, d_db2, db0, C,
                              tol_of(gdt, TOL_LN, N));
                }
                check_dev(LABEL("layernorm dres unchanged N%d C%d", N, C), dt, d_dres, dres, NC, 1e-30);
            }
        }
    }
    reset();
    worst_print("layernorm");
}

/* --- matmul ---------------------------------------------------------------------- */

/* One matmul shape through `ctx` (and `ctx_unfused` for the two-kernel GELU);
 * `path` names the GEMM path in the labels. */
static void matmul_case(td_ops_cuda *ctx, td_ops_cuda *ctx_unfused, const char *path, td_dtype dt, int N, int C,
                        int OC)
{
    const size_t NC = (size_t)N * C, NO = (size_t)N * OC, WC = (size_t)OC * C;
    reset();
    float *x = hrand(dt, NC, 1), *w = hrand(dt, WC, 1.0f / sqrtf((float)C)), *b = hrand(dt, OC, 0.5f);
    float *res = hrand(dt, NO, 1);
    void *d_x = up(dt, x, NC), *d_w = up(dt, w, WC), *d_b = up(dt, b, OC);

    /* out = x W^T + b, with and without the bias */
    float *want = hmalloc(NO * 4);
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        td_ops_matmul_forward(want, x, w, with_bias ? b : NULL, N, C, OC);
        void *d_out = dnan(dt, NO);
        TD_ASSERT_OK(td_ops_cuda_matmul_forward(ctx, d_out, NULL, d_x, d_w, with_bias ? d_b : NULL, NULL, N, C, OC, dt,
                                                F.s));
        check_dev(LABEL("matmul out N%d C%d OC%d bias %d %s", N, C, OC, with_bias, path), dt, d_out, want, NO,
                  tol_of(dt, TOL_MATMUL, C));
    }
    /* + residual, in place (out = residual) and separate */
    td_ops_matmul_forward(want, x, w, b, N, C, OC);
    td_ops_residual_forward(want, want, res, NO);
    for (int in_place = 0; in_place < 2; in_place++) {
        void *d_res = up(dt, res, NO);
        void *d_out = in_place ? d_res : dnan(dt, NO);
        TD_ASSERT_OK(td_ops_cuda_matmul_forward(ctx, d_out, NULL, d_x, d_w, d_b, d_res, N, C, OC, dt, F.s));
        check_dev(LABEL("matmul+residual N%d C%d OC%d in place %d %s", N, C, OC, in_place, path), dt, d_out, want, NO,
                  tol_of(dt, TOL_MATMUL, C));
    }
    /* GELU: fused epilogue (16-bit, when cuBLASLt has it) and the two-kernel path */
    float *pre = hmalloc(NO * 4), *act = hmalloc(NO * 4);
    td_ops_matmul_forward(pre, x, w, b, N, C, OC);
    td_ops_gelu_forward(act, pre, NO);
    for (int fused = 0; fused < 2; fused++) {
        void *d_pre = dnan(dt, NO), *d_act = dnan(dt, NO);
        TD_ASSERT_OK(td_ops_cuda_matmul_forward(fused ? ctx : ctx_unfused, d_act, d_pre, d_x, d_w, d_b, NULL, N, C, OC,
                                                dt, F.s));
        check_dev(LABEL("matmul pre-gelu N%d C%d OC%d fused %d %s", N, C, OC, fused, path), dt, d_pre, pre, NO,
                  tol_of(dt, TOL_MATMUL, C));
        check_dev(LABEL("matmul gelu N%d C%d OC%d fused %d %s", N, C, OC, fused, path), dt, d_act, act, NO,
                  tol_of(dt, TOL_GELU_MM, C));
    }

    /* backward: every gradient type, dinp added and set, with and without dbias */
    float *dout = hrand(dt, NO, 1);
    void *d_dout = up(dt, dout, NO);
    float *dx0 = hzero(NC), *dw0 = hzero(WC), *db0 = hzero(OC);
    td_ops_matmul_backward(dx0, dw0, db0, dout, x, w, N, C, OC);
    td_dtype gdts[2];
    const int ng = grad_types(dt, gdts);
    for (int gi = 0; gi < ng; gi++) {
        const td_dtype gdt = gdts[gi];
        for (int mode = 0; mode < 2; mode++) { /* 0: ADD with dbias, 1: SET without */
            float *dx = mode ? hzero(NC) : acc_like(dt, dx0, NC);
            float *dw = acc_like(gdt, dw0, WC), *db = acc_like(gdt, db0, OC);
            void *d_dx = mode ? dnan(dt, NC) : up(dt, dx, NC);
            void *d_dw = up(gdt, dw, WC), *d_db = up(gdt, db, OC);
            float *db_before = hcopy(db, OC);
            td_ops_matmul_backward(dx, dw, mode ? NULL : db, dout, x, w, N, C, OC);
            size_t sb = td_ops_cuda_matmul_scratch_bytes(N, OC);
            TD_ASSERT_OK(td_ops_cuda_matmul_backward(ctx, d_dx, d_dw, mode ? NULL : d_db, d_dout, d_x, d_w, N, C, OC,
                                                     mode ? TD_OPS_CUDA_SET : TD_OPS_CUDA_ADD, dt, gdt,
                                                     scratch_for(sb), sb, F.s));
            const char *m = mode ? "set" : "add";
            check_dev(LABEL("matmul dinp N%d C%d OC%d %s %s", N, C, OC, m, path), dt, d_dx, dx, NC,
                      tol_of(dt, TOL_MATMUL, OC));
            check_dev(LABEL("matmul dweight N%d C%d OC%d grads %s %s", N, C, OC, td_dtype_name(gdt), path), gdt, d_dw,
                      dw, WC, tol_of(gdt, TOL_MATMUL, N));
            check_dev(LABEL("matmul dbias N%d C%d OC%d grads %s %s %s", N, C, OC, td_dtype_name(gdt), m, path), gdt,
                      d_db, mode ? db_before : db, OC, tol_of(gdt, TOL_MATMUL, N));
        }
    }

    /* backward of a layer reading gelu(x) (fc_proj): dinp = (dout W) * gelu'(x),
     * the derivative in the GEMM's epilogue (16-bit, when cuBLASLt has it) and
     * as a kernel after it */
    float *gx = hmalloc(NC * 4);
    td_ops_gelu_forward(gx, x, NC);
    for (size_t i = 0; i < NC; i++) gx[i] = rnd(dt, gx[i]);
    void *d_gx = up(dt, gx, NC);
    float *dmm = hzero(NC), *dwg = hzero(WC), *dbg = hzero(OC), *dxg = hzero(NC);
    td_ops_matmul_backward(dmm, dwg, dbg, dout, gx, w, N, C, OC);
    td_ops_gelu_backward(dxg, x, dmm, NC);
    for (int gi = 0; gi < ng; gi++) {
        const td_dtype gdt = gdts[gi];
        for (int fused = 0; fused < 2; fused++) {
            void *d_dx = dnan(dt, NC), *d_dw = up(gdt, hzero(WC), WC), *d_db = up(gdt, hzero(OC), OC);
            size_t sb = td_ops_cuda_matmul_scratch_bytes(N, OC);
            TD_ASSERT_OK(td_ops_cuda_matmul_backward_gelu(fused ? ctx : ctx_unfused, d_dx, d_dw, d_db, d_dout, d_gx,
                                                          d_w, d_x, N, C, OC, dt, gdt, scratch_for(sb), sb, F.s));
            check_dev(LABEL("matmul dinp through gelu N%d C%d OC%d fused %d %s", N, C, OC, fused, path), dt, d_dx, dxg,
                      NC, tol_of(dt, TOL_GELU_MM, OC));
            check_dev(LABEL("matmul dweight through gelu N%d C%d OC%d grads %s %s", N, C, OC, td_dtype_name(gdt),
                            path),
                      gdt, d_dw, dwg, WC, tol_of(gdt, TOL_MATMUL, N));
            check_dev(LABEL("matmul dbias through gelu N%d C%d OC%d grads %s %s", N, C, OC, td_dtype_name(gdt), path),
                      gdt, d_db, dbg, OC, tol_of(gdt, TOL_MATMUL, N));
        }
    }
    assert_int_equal(td_ops_cuda_matmul_backward_gelu(ctx, d_x, d_w, NULL, d_dout, d_gx, d_w, d_x, N, C, OC, dt, dt,
                                                      NULL, 0, F.s),
                     TD_ERR_INVALID); /* dinp aliasing the pre-activation */
    td_error_clear();
}

/* cuBLASLt, and the fallback GEMM that serves the shapes cuBLASLt refuses. */
static void test_matmul(void **state)
{
    (void)state;
    static const int cases[][3] = {{1, 8, 8}, {37, 72, 216}, {64, 128, 512}, {33, 100, 36}, {5, 36, 60},
                                   {256, 768, 2304}, {128, 3072, 768}};
    td_rng_seed(&F.rng, 103);
    worst_begin();
    for (int di = 0; di < N_DTS; di++)
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            matmul_case(F.ctx, F.ctx_nofuse, "cublaslt", DTS[di], cases[ci][0], cases[ci][1], cases[ci][2]);
            matmul_case(F.ctx_fallback, F.ctx_fallback, "fallback", DTS[di], cases[ci][0], cases[ci][1],
                        cases[ci][2]);
        }
    reset();
    worst_print("matmul");
}


/* The bias gradient's two column-sum kernels (16-byte rows: 8 columns a
 * thread; else one) sum in the same order: the same bits from dout in an
 * aligned buffer and in one an element off, for every storage and gradient
 * type, rows over several partitions and a partial last block of columns. */
static void test_bias_grad_paths_bit_identical(void **state)
{
    (void)state;
    const int N = 1000, C = 16, OC = 776;
    td_rng_seed(&F.rng, 111);
    for (int di = 0; di < N_DTS; di++) {
        const td_dtype dt = DTS[di];
        for (int gi = 0; gi < 2; gi++) {
            const td_dtype gdt = gi ? TD_DTYPE_F32 : dt;
            float *dout = hrand(dt, (size_t)N * OC, 1.0f), *x = hrand(dt, (size_t)N * C, 1.0f);
            float *w = hrand(dt, (size_t)OC * C, 0.5f), *b0 = hrand(gdt, OC, 1.0f);
            void *d_x = up(dt, x, (size_t)N * C), *d_w = up(dt, w, (size_t)OC * C);
            void *d_dw = up(gdt, hzero((size_t)OC * C), (size_t)OC * C);
            const size_t sb = td_ops_cuda_matmul_scratch_bytes(N, OC);
            void *scratch = dmalloc(sb);
            float *got[2];
            for (int off = 0; off < 2; off++) {
                void *d_dout = up_at(dt, dout, (size_t)N * OC, (size_t)off), *d_db = up(gdt, b0, OC);
                TD_ASSERT_OK(td_ops_cuda_matmul_backward(F.ctx, NULL, d_dw, d_db, d_dout, d_x, d_w, N, C, OC,
                                                         TD_OPS_CUDA_SET, dt, gdt, scratch, sb, F.s));
                got[off] = down(gdt, d_db, OC);
            }
            if (memcmp(got[0], got[1], (size_t)OC * sizeof(float)) != 0)
                fail_msg("bias gradient, %s storage, %s grads: the 16-byte and the element column sums differ",
                         td_dtype_name(dt), td_dtype_name(gdt));
            reset();
        }
    }
}

/* --- GELU and residual -------------------------------------------------------------- */

static void test_pointwise(void **state)
{
    (void)state;
    static const size_t sizes[] = {1, 7, 1000, 4099, 65536 + 3};
    td_rng_seed(&F.rng, 104);
    worst_begin();
    for (int di = 0; di < N_DTS; di++) {
        const td_dtype dt = DTS[di];
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            for (size_t off = 0; off < 2; off++) { /* off 1: views that are not 16-byte aligned */
                const size_t n = sizes[si];
                reset();
                float *x = hrand(dt, n, 4), *y = hrand(dt, n, 2), *dout = hrand(dt, n, 1);
                void *d_x = up_at(dt, x, n, off), *d_y = up_at(dt, y, n, off), *d_dout = up_at(dt, dout, n, off);
                float *want = hmalloc(n * 4);
                /* GELU forward, separate output and in place */
                td_ops_gelu_forward(want, x, n);
                void *d_out = dnan_at(dt, n, off);
                TD_ASSERT_OK(td_ops_cuda_gelu_forward(d_out, d_x, n, dt, F.s));
                check_dev(LABEL("gelu n%zu off %zu", n, off), dt, d_out, want, n, tol_of(dt, TOL_POINT, 1));
                void *d_xx = up_at(dt, x, n, off);
                TD_ASSERT_OK(td_ops_cuda_gelu_forward(d_xx, d_xx, n, dt, F.s));
                check_dev(LABEL("gelu in place n%zu off %zu", n, off), dt, d_xx, want, n, tol_of(dt, TOL_POINT, 1));
                /* GELU backward: add, set, set in place over dout */
                float *g0 = hzero(n);
                td_ops_gelu_backward(g0, x, dout, n);
                float *acc = acc_like(dt, g0, n);
                void *d_acc = up_at(dt, acc, n, off);
                td_ops_gelu_backward(acc, x, dout, n);
                TD_ASSERT_OK(td_ops_cuda_gelu_backward(d_acc, d_x, d_dout, n, TD_OPS_CUDA_ADD, dt, F.s));
                check_dev(LABEL("gelu backward add n%zu off %zu", n, off), dt, d_acc, acc, n, tol_of(dt, TOL_POINT, 1));
                void *d_set = dnan_at(dt, n, off);
                TD_ASSERT_OK(td_ops_cuda_gelu_backward(d_set, d_x, d_dout, n, TD_OPS_CUDA_SET, dt, F.s));
                check_dev(LABEL("gelu backward set n%zu off %zu", n, off), dt, d_set, g0, n, tol_of(dt, TOL_POINT, 1));
                void *d_inpl = up_at(dt, dout, n, off);
                TD_ASSERT_OK(td_ops_cuda_gelu_backward(d_inpl, d_x, d_inpl, n, TD_OPS_CUDA_SET, dt, F.s));
                check_dev(LABEL("gelu backward in place n%zu off %zu", n, off), dt, d_inpl, g0, n,
                          tol_of(dt, TOL_POINT, 1));
                /* residual: out = a + b, out aliasing a; backward adds into both */
                td_ops_residual_forward(want, x, y, n);
                void *d_a = up_at(dt, x, n, off);
                TD_ASSERT_OK(td_ops_cuda_residual_forward(d_a, d_a, d_y, n, dt, F.s));
                check_dev(LABEL("residual n%zu off %zu", n, off), dt, d_a, want, n, tol_of(dt, TOL_POINT, 1));
                float *da = hcopy(x, n), *db = hcopy(y, n);
                void *d_da = up_at(dt, da, n, off), *d_db = up_at(dt, db, n, off);
                td_ops_residual_backward(da, db, dout, n);
                TD_ASSERT_OK(td_ops_cuda_residual_backward(d_da, d_db, d_dout, n, dt, F.s));
                check_dev(LABEL("residual backward da n%zu off %zu", n, off), dt, d_da, da, n, tol_of(dt, TOL_POINT, 1));
                check_dev(LABEL("residual backward db n%zu off %zu", n, off), dt, d_db, db, n, tol_of(dt, TOL_POINT, 1));
            }
        }
    }
    reset();
    worst_print("gelu, residual");
}

/* --- attention -------------------------------------------------------------------- */

/* Whether the flash kernels run for these (ops_cuda_flash.cu). */
static int flash_shape(td_dtype dt, int C, int NH)
{
    const int hs = C / NH;
    return dt != TD_DTYPE_F32 && (hs == 64 || hs == 80 || hs == 96 || hs == 128);
}

/* path 0: the default (flash where it applies, on wgmma where the device
 * runs the sm_90a code); 1: the batched-GEMM path; 2: flash on mma.sync. */
#define FLASH_PATHS 3
static void attention_path(int path)
{
    if (path) setenv("TD_OPS_CUDA_ATTENTION", path == 1 ? "gemm" : "mma", 1);
    else unsetenv("TD_OPS_CUDA_ATTENTION");
}

/* One attention shape on one path; grouped: scratch for one sequence only,
 * so the op runs the batch a sequence at a time.  gqa: through the
 * grouped-query entry points (NKV key/value heads of hs channels), else the
 * multi-head ones (NKV = NH, C = NH hs); the CPU reference is the same
 * function either way. */
static void attention_gqa_case(td_dtype dt, int B, int T, int NH, int NKV, int hs, int grouped, int path, int gqa,
                               const int *pos)
{
    const int C = NH * hs, group = NH / NKV;
    const size_t N = (size_t)B * T, n_qkv = N * (C + 2 * (size_t)NKV * hs), n_out = N * C, n_lse = (size_t)B * NH * T;
    const char *pn = path == 1 ? "gemm" : path == 2 ? "mma" : "default";
    char shape[64];
    if (gqa) snprintf(shape, sizeof shape, "B%d T%d NH%d NKV%d hs%d%s", B, T, NH, NKV, hs, pos ? " packed" : "");
    else snprintf(shape, sizeof shape, "B%d T%d C%d NH%d", B, T, C, NH);
    attention_path(path);
    reset();
    float *qkv = hrand(dt, n_qkv, 2.0f);
    float *out = hmalloc(n_out * 4), *lse = hmalloc(n_lse * 4);
    td_ops_attention_gqa_forward(out, lse, qkv, pos, B, T, NH, NKV, hs);
    void *d_qkv = up(dt, qkv, n_qkv);
    const int *d_pos = pos ? up_int(pos, N) : NULL;
    const int seqs = grouped ? 1 : B;
    const size_t sb = gqa ? td_ops_cuda_attention_gqa_scratch_bytes(seqs, T, NH, NKV, hs, dt)
                          : td_ops_cuda_attention_scratch_bytes(seqs, T, C, NH, dt);
    void *scratch = scratch_for(sb);
    void *d_out = dnan(dt, n_out);
    float *d_lse = dnan(TD_DTYPE_F32, n_lse);
    if (gqa)
        TD_ASSERT_OK(td_ops_cuda_attention_gqa_forward(F.ctx, d_out, d_lse, d_qkv, d_pos, B, T, NH, NKV, hs, dt, scratch,
                                                       sb, F.s));
    else
        TD_ASSERT_OK(td_ops_cuda_attention_forward(F.ctx, d_out, d_lse, d_qkv, B, T, C, NH, dt, scratch, sb, F.s));
    check_dev(LABEL("attention out %s grouped %d %s", shape, grouped, pn), dt, d_out, out, n_out,
              tol_of(dt, TOL_ATT, T));
    check_dev(LABEL("attention lse %s grouped %d %s", shape, grouped, pn), TD_DTYPE_F32, d_lse, lse, n_lse,
              tol_of(TD_DTYPE_F32, TOL_ATT, T));
    /* backward from the CPU forward's out (rounded) and lse, so both sides see the same */
    for (size_t i = 0; i < n_out; i++) out[i] = rnd(dt, out[i]);
    void *d_fout = up(dt, out, n_out);
    copy_sync(d_lse, lse, n_lse * 4, cudaMemcpyHostToDevice);
    float *dout = hrand(dt, n_out, 1);
    void *d_dout = up(dt, dout, n_out);
    float *g0 = hzero(n_qkv);
    td_ops_attention_gqa_backward(g0, dout, qkv, out, lse, pos, B, T, NH, NKV, hs);
    for (int mode = 0; mode < 2; mode++) { /* 0: added into random values, 1: set */
        float *dqkv = mode ? hcopy(g0, n_qkv) : acc_like(dt, g0, n_qkv);
        void *d_dqkv = mode ? dnan(dt, n_qkv) : up(dt, dqkv, n_qkv);
        if (!mode) td_ops_attention_gqa_backward(dqkv, dout, qkv, out, lse, pos, B, T, NH, NKV, hs);
        const td_ops_cuda_write wm = mode ? TD_OPS_CUDA_SET : TD_OPS_CUDA_ADD;
        if (gqa)
            TD_ASSERT_OK(td_ops_cuda_attention_gqa_backward(F.ctx, d_dqkv, d_dout, d_qkv, d_fout, d_lse, d_pos, B, T, NH,
                                                            NKV, hs, wm, dt, scratch, sb, F.s));
        else
            TD_ASSERT_OK(td_ops_cuda_attention_backward(F.ctx, d_dqkv, d_dout, d_qkv, d_fout, d_lse, B, T, C, NH, wm,
                                                        dt, scratch, sb, F.s));
        /* dK, dV sum over the group's query heads too */
        check_dev(LABEL("attention dqkv %s %s grouped %d %s", shape, mode ? "set" : "add", grouped, pn), dt, d_dqkv,
                  dqkv, n_qkv, tol_of(dt, TOL_ATT_BW, (long)group * T));
        if (gqa && mode) { /* no atomics: a second run gives the same bits */
            void *d_again = dnan(dt, n_qkv);
            TD_ASSERT_OK(td_ops_cuda_attention_gqa_backward(F.ctx, d_again, d_dout, d_qkv, d_fout, d_lse, d_pos, B, T, NH,
                                                            NKV, hs, wm, dt, scratch, sb, F.s));
            const size_t bytes = n_qkv * esize(dt);
            void *h1 = hmalloc(bytes), *h2 = hmalloc(bytes);
            copy_sync(h1, d_dqkv, bytes, cudaMemcpyDeviceToHost);
            copy_sync(h2, d_again, bytes, cudaMemcpyDeviceToHost);
            if (memcmp(h1, h2, bytes)) fail_msg("attention backward %s %s: two runs differ", shape, pn);
        }
    }
    attention_path(0);
}

static void attention_case(td_dtype dt, int B, int T, int C, int NH, int grouped, int path)
{
    attention_gqa_case(dt, B, T, NH, NH, C / NH, grouped, path, 0, NULL);
}

/* Packed rows: each row several documents, attention not crossing them
 * (pos restarts at 0), both paths, multi-head and grouped-query, against
 * the CPU reference with the same positions (tests/test_ops.c checks that
 * one against each document alone).  Documents end inside and at the edge
 * of the 64-row tiles, some are one token long, one row is whole. */
static int *packed_positions(int B, int T)
{
    int *pos = malloc((size_t)B * T * sizeof(int)); /* not hmalloc: the case's reset() would free it */
    assert_non_null(pos);
    static const int edges[] = {64, 1, 63, 1, 128, 3};
    for (int b = 0; b < B; b++) {
        int t = 0, d = 0;
        while (t < T) {
            int len = b == 1 ? T : b == 0 && d < 6 ? edges[d] : 1 + (int)td_rng_below(&F.rng, 90);
            d++;
            for (int i = 0; i < len && t < T; i++) pos[(size_t)b * T + t++] = i;
        }
    }
    return pos;
}

static void test_attention_packed(void **state)
{
    (void)state;
    /* B, T, NH, NKV, hs: flash (hs 64, 80, 96, 128) and GEMM (hs 24) shapes, T across several tiles */
    static const int cases[][5] = {{3, 200, 4, 4, 64}, {3, 257, 8, 2, 64}, {3, 130, 4, 1, 128}, {3, 96, 6, 3, 24},
                                   {4, 300, 2, 2, 128}, {3, 200, 4, 2, 80}, {2, 257, 4, 4, 96}};
    td_rng_seed(&F.rng, 39);
    worst_begin();
    for (int di = 0; di < N_DTS; di++)
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const int B = cases[ci][0], T = cases[ci][1], NH = cases[ci][2], NKV = cases[ci][3], hs = cases[ci][4];
            const int paths = flash_shape(DTS[di], NH * hs, NH) ? FLASH_PATHS : 1;
            for (int path = 0; path < paths; path++)
                for (int grouped = 0; grouped < 2; grouped++) {
                    int *pos = packed_positions(B, T);
                    attention_gqa_case(DTS[di], B, T, NH, NKV, hs, grouped, path, 1, pos);
                    free(pos);
                }
        }
    reset();
    worst_print("attention over packed documents");
}

static void test_attention(void **state)
{
    (void)state;
    /* B, T, C, NH: hs = 8, 8, 24, 64, 24, 64, 12, 64, 128, 128, 64, 80, 96 */
    static const int cases[][4] = {{1, 1, 8, 1},     {2, 5, 16, 2},   {2, 37, 72, 3},   {1, 64, 128, 2},
                                   {2, 130, 96, 4},  {1, 257, 64, 1}, {3, 20, 36, 3},   {2, 130, 128, 2},
                                   {1, 257, 256, 2}, {2, 1, 128, 1},  {1, 200, 384, 6}, {2, 130, 160, 2},
                                   {1, 257, 192, 2}};
    td_rng_seed(&F.rng, 105);
    worst_begin();
    for (int di = 0; di < N_DTS; di++)
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const int B = cases[ci][0], T = cases[ci][1], C = cases[ci][2], NH = cases[ci][3];
            const int paths = flash_shape(DTS[di], C, NH) ? FLASH_PATHS : 1;
            for (int path = 0; path < paths; path++)
                for (int grouped = 0; grouped < (B > 1 ? 2 : 1); grouped++)
                    attention_case(DTS[di], B, T, C, NH, grouped, path);
        }
    reset();
    worst_print("attention");
}

/* Grouped-query attention: 1, 2 and 4 query heads a key/value head, head
 * sizes 64, 80, 96 and 128 (flash for 16-bit) and others (batched GEMM), odd T, and
 * T a multiple of the flash tiles (every tile whole: the tiles below the
 * diagonal take the loops without mask tests, the last one too). */
static void test_attention_gqa(void **state)
{
    (void)state;
    /* B, T, NH, NKV, hs */
    static const int cases[][5] = {
        {2, 65, 4, 4, 64},  {2, 37, 4, 2, 64},   {1, 130, 8, 2, 64}, {2, 257, 4, 1, 64}, {1, 1, 2, 1, 64},
        {1, 100, 2, 2, 128}, {1, 200, 4, 2, 128}, {2, 130, 8, 2, 128}, {1, 63, 4, 1, 128},
        {2, 37, 6, 3, 24},  {1, 20, 4, 1, 8},    {3, 33, 6, 2, 40},  {2, 192, 4, 2, 64}, {1, 256, 4, 4, 128},
        {2, 130, 4, 2, 80}, {1, 63, 4, 4, 80},   {1, 128, 8, 2, 80}, {2, 200, 4, 1, 96}, {1, 192, 4, 2, 96},
    };
    td_rng_seed(&F.rng, 111);
    worst_begin();
    for (int di = 0; di < N_DTS; di++)
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const int B = cases[ci][0], T = cases[ci][1], NH = cases[ci][2], NKV = cases[ci][3], hs = cases[ci][4];
            const int paths = flash_shape(DTS[di], NH * hs, NH) ? FLASH_PATHS : 1;
            for (int path = 0; path < paths; path++)
                for (int grouped = 0; grouped < (B > 1 ? 2 : 1); grouped++)
                    attention_gqa_case(DTS[di], B, T, NH, NKV, hs, grouped, path, 1, NULL);
        }
    reset();
    worst_print("attention gqa");
}

/* The flash kernels' two engines (wgmma on a device that runs the sm_90a
 * code, mma.sync everywhere) give the same bits: out, lse and dqkv, whole
 * and partial tiles, grouped-query heads, packed documents.  Elsewhere both
 * runs take mma.sync and agree trivially. */
static void test_attention_engines(void **state)
{
    (void)state;
    /* B, T, NH, NKV, hs, packed */
    static const int cases[][6] = {{2, 257, 4, 4, 64, 0}, {2, 200, 8, 2, 128, 0}, {1, 256, 4, 1, 64, 0},
                                   {3, 200, 4, 2, 64, 1}, {2, 130, 4, 1, 128, 1}, {1, 64, 2, 2, 128, 0}};
    td_rng_seed(&F.rng, 41);
    for (int di = 0; di < N_DTS; di++) {
        const td_dtype dt = DTS[di];
        if (dt == TD_DTYPE_F32) continue;
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const int B = cases[ci][0], T = cases[ci][1], NH = cases[ci][2], NKV = cases[ci][3], hs = cases[ci][4];
            const size_t N = (size_t)B * T, n_qkv = N * ((size_t)NH + 2 * NKV) * hs, n_out = N * NH * hs,
                         n_lse = (size_t)B * NH * T, e = esize(dt);
            reset();
            int *pos = cases[ci][5] ? packed_positions(B, T) : NULL;
            const int *d_pos = pos ? up_int(pos, N) : NULL;
            void *d_qkv = up(dt, hrand(dt, n_qkv, 2.0f), n_qkv), *d_dout = up(dt, hrand(dt, n_out, 1), n_out);
            const size_t sb = td_ops_cuda_attention_gqa_scratch_bytes(B, T, NH, NKV, hs, dt);
            void *scratch = scratch_for(sb);
            void *h[2][3];
            for (int path = 0; path < 2; path++) {
                attention_path(path ? 2 : 0);
                void *d_out = dnan(dt, n_out), *d_dqkv = dnan(dt, n_qkv);
                float *d_lse = dnan(TD_DTYPE_F32, n_lse);
                TD_ASSERT_OK(td_ops_cuda_attention_gqa_forward(F.ctx, d_out, d_lse, d_qkv, d_pos, B, T, NH, NKV, hs, dt,
                                                               scratch, sb, F.s));
                TD_ASSERT_OK(td_ops_cuda_attention_gqa_backward(F.ctx, d_dqkv, d_dout, d_qkv, d_out, d_lse, d_pos, B, T,
                                                                NH, NKV, hs, TD_OPS_CUDA_SET, dt, scratch, sb, F.s));
                h[path][0] = hmalloc(n_out * e);
                h[path][1] = hmalloc(n_lse * 4);
                h[path][2] = hmalloc(n_qkv * e);
                copy_sync(h[path][0], d_out, n_out * e, cudaMemcpyDeviceToHost);
                copy_sync(h[path][1], d_lse, n_lse * 4, cudaMemcpyDeviceToHost);
                copy_sync(h[path][2], d_dqkv, n_qkv * e, cudaMemcpyDeviceToHost);
            }
            attention_path(0);
            static const char *const what[3] = {"out", "lse", "dqkv"};
            const size_t bytes[3] = {n_out * e, n_lse * 4, n_qkv * e};
            for (int k = 0; k < 3; k++)
                if (memcmp(h[0][k], h[1][k], bytes[k]))
                    fail_msg("attention engines: %s differs (B%d T%d NH%d NKV%d hs%d%s, %s)", what[k], B, T, NH, NKV,
                             hs, pos ? " packed" : "", dt == TD_DTYPE_BF16 ? "bf16" : "fp16");
            free(pos);
        }
    }
    reset();
}

/* --- LLaMA-family ops: RMSNorm, SwiGLU, RoPE ------------------------------------------ */

static void test_rmsnorm(void **state)
{
    (void)state;
    static const int cases[][2] = {{1, 8}, {37, 72}, {64, 768}, {13, 100}, {5, 1600}, {3, 2050}, {300, 64}, {9, 4096}};
    td_rng_seed(&F.rng, 112);
    worst_begin();
    for (int di = 0; di < N_DTS; di++) {
        const td_dtype dt = DTS[di];
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const int N = cases[ci][0], C = cases[ci][1];
            const float eps = ci % 2 ? 1e-6f : 1e-5f, wo = ci % 2 ? 1.0f : 0.0f; /* LLaMA's w, Gemma's 1 + w */
            const size_t NC = (size_t)N * C;
            td_dtype gdts[2];
            const int ng = grad_types(dt, gdts);
            for (int gi = 0; gi < ng; gi++) {
                const td_dtype gdt = gdts[gi];
                reset();
                float *x = hrand(dt, NC, 2), *w = hrand(dt, C, 1);
                float *out = hmalloc(NC * 4), *rstd = hmalloc(N * 4);
                td_ops_rmsnorm_forward(out, rstd, x, w, wo, N, C, eps);
                void *d_x = up(dt, x, NC), *d_w = up(dt, w, C);
                float *d_rstd = dnan(TD_DTYPE_F32, N);
                if (gi == 0) {
                    void *d_out = dnan(dt, NC);
                    TD_ASSERT_OK(td_ops_cuda_rmsnorm_forward(d_out, d_rstd, d_x, d_w, wo, N, C, eps, dt, F.s));
                    check_dev(LABEL("rmsnorm out N%d C%d", N, C), dt, d_out, out, NC, tol_of(dt, TOL_LN, C));
                    check_dev(LABEL("rmsnorm rstd N%d C%d", N, C), TD_DTYPE_F32, d_rstd, rstd, N,
                              tol_of(TD_DTYPE_F32, TOL_LN, C));
                }
                /* backward from the CPU's rstd (both sides use the same) */
                float *dout = hrand(dt, NC, 1);
                float *dx0 = hzero(NC), *dw0 = hzero(C);
                td_ops_rmsnorm_backward(dx0, dw0, dout, x, w, wo, rstd, N, C);
                float *dx = acc_like(dt, dx0, NC), *dw = acc_like(gdt, dw0, C);
                void *d_dx = up(dt, dx, NC), *d_dw = up(gdt, dw, C);
                td_ops_rmsnorm_backward(dx, dw, dout, x, w, wo, rstd, N, C);
                copy_sync(d_rstd, rstd, N * 4, cudaMemcpyHostToDevice);
                size_t sb = td_ops_cuda_rmsnorm_scratch_bytes(N, C);
                TD_ASSERT_OK(td_ops_cuda_rmsnorm_backward(d_dx, d_dw, up(dt, dout, NC), d_x, d_w, wo, d_rstd, N, C, dt, gdt,
                                                          scratch_for(sb), sb, F.s));
                check_dev(LABEL("rmsnorm dinp N%d C%d", N, C), dt, d_dx, dx, NC, tol_of(dt, TOL_LN, C));
                check_dev(LABEL("rmsnorm dweight N%d C%d grads %s", N, C, td_dtype_name(gdt)), gdt, d_dw, dw, C,
                          tol_of(gdt, TOL_LN, N));
                /* beside a residual gradient in another buffer, and with none (set) */
                float *dres = hrand(dt, NC, 1), *want = hmalloc(NC * 4);
                for (size_t i = 0; i < NC; i++) want[i] = dres[i] + dx0[i];
                void *d_dres = up(dt, dres, NC), *d_out = up(dt, dout, NC);
                for (int with_res = 0; with_res < 2; with_res++) {
                    void *d_dx2 = dnan(dt, NC), *d_dw2 = up(gdt, hzero(C), C);
                    TD_ASSERT_OK(td_ops_cuda_rmsnorm_backward_res(d_dx2, with_res ? d_dres : NULL, d_dw2, d_out, d_x,
                                                                  d_w, wo, d_rstd, N, C, dt, gdt, scratch_for(sb), sb,
                                                                  F.s));
                    check_dev(LABEL("rmsnorm dinp res %d N%d C%d", with_res, N, C), dt, d_dx2,
                              with_res ? want : dx0, NC, tol_of(dt, TOL_LN, C));
                    check_dev(LABEL("rmsnorm dweight res %d N%d C%d", with_res, N, C), gdt, d_dw2, dw0, C,
                              tol_of(gdt, TOL_LN, N));
                }
                check_dev(LABEL("rmsnorm dres unchanged N%d C%d", N, C), dt, d_dres, dres, NC, 1e-30);
            }
        }
    }
    reset();
    worst_print("rmsnorm");
}

/* SwiGLU and GeGLU (tanh GELU) against the CPU's. */
static void test_glu(void **state)
{
    (void)state;
    static const int cases[][2] = {{1, 1}, {3, 7}, {37, 72}, {64, 768}, {5, 1001}, {16, 2816}};
    td_rng_seed(&F.rng, 113);
    worst_begin();
    for (int di = 0; di < N_DTS; di++) {
        const td_dtype dt = DTS[di];
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
            for (size_t off = 0; off < 2; off++) /* off 1: views that are not 16-byte aligned */
                for (int k = 0; k < 2; k++) {
                    const td_ops_glu a = k ? TD_OPS_GLU_GELU_TANH : TD_OPS_GLU_SILU;
                    const char *name = k ? "geglu" : "swiglu";
                    const int N = cases[ci][0], H = cases[ci][1];
                    const size_t NH2 = (size_t)N * 2 * H, NH1 = (size_t)N * H;
                    reset();
                    float *gu = hrand(dt, NH2, 4), *dout = hrand(dt, NH1, 1);
                    float *out = hmalloc(NH1 * 4);
                    td_ops_glu_forward(out, gu, N, H, a);
                    void *d_gu = up_at(dt, gu, NH2, off), *d_dout = up_at(dt, dout, NH1, off);
                    void *d_out = dnan_at(dt, NH1, off);
                    TD_ASSERT_OK(td_ops_cuda_glu_forward(d_out, d_gu, N, H, a, dt, F.s));
                    check_dev(LABEL("%s N%d H%d off %zu", name, N, H, off), dt, d_out, out, NH1, tol_of(dt, TOL_POINT, 1));
                    /* backward: added, set, set in place over gate_up */
                    float *g0 = hzero(NH2);
                    td_ops_glu_backward(g0, dout, gu, N, H, a);
                    float *acc = acc_like(dt, g0, NH2);
                    void *d_acc = up_at(dt, acc, NH2, off);
                    td_ops_glu_backward(acc, dout, gu, N, H, a);
                    TD_ASSERT_OK(td_ops_cuda_glu_backward(d_acc, d_dout, d_gu, N, H, a, TD_OPS_CUDA_ADD, dt, F.s));
                    check_dev(LABEL("%s backward add N%d H%d off %zu", name, N, H, off), dt, d_acc, acc, NH2,
                              tol_of(dt, TOL_POINT, 1));
                    void *d_set = dnan_at(dt, NH2, off);
                    TD_ASSERT_OK(td_ops_cuda_glu_backward(d_set, d_dout, d_gu, N, H, a, TD_OPS_CUDA_SET, dt, F.s));
                    check_dev(LABEL("%s backward set N%d H%d off %zu", name, N, H, off), dt, d_set, g0, NH2,
                              tol_of(dt, TOL_POINT, 1));
                    void *d_inpl = up_at(dt, gu, NH2, off);
                    TD_ASSERT_OK(td_ops_cuda_glu_backward(d_inpl, d_dout, d_inpl, N, H, a, TD_OPS_CUDA_SET, dt, F.s));
                    check_dev(LABEL("%s backward in place N%d H%d off %zu", name, N, H, off), dt, d_inpl, g0, NH2,
                              tol_of(dt, TOL_POINT, 1));
                }
        /* the scale op (Gemma's embedding), in place and not */
        for (size_t off = 0; off < 2; off++) {
            const size_t n = 1001;
            reset();
            float *x = hrand(dt, n, 3), *want = hmalloc(n * 4);
            for (size_t i = 0; i < n; i++) want[i] = x[i] * 45.25f;
            void *d_x = up_at(dt, x, n, off), *d_y = dnan_at(dt, n, off);
            TD_ASSERT_OK(td_ops_cuda_scale(d_y, d_x, 45.25f, n, dt, F.s));
            check_dev(LABEL("scale off %zu", off), dt, d_y, want, n, tol_of(dt, TOL_POINT, 1));
            TD_ASSERT_OK(td_ops_cuda_scale(d_x, d_x, 45.25f, n, dt, F.s));
            check_dev(LABEL("scale in place off %zu", off), dt, d_x, want, n, tol_of(dt, TOL_POINT, 1));
        }
    }
    reset();
    worst_print("glu");
}

/* Llama 3.1's rope_scaling (theta 500000), or none (theta 10000). */
static void rope_table(float *inv_freq, int hs, int scaled)
{
    const td_rope_scaling llama3 = {8.0f, 1.0f, 4.0f, 8192};
    td_ops_rope_inv_freq(inv_freq, hs, scaled ? 500000.0f : 10000.0f, scaled ? &llama3 : NULL);
}

static void test_rope(void **state)
{
    (void)state;
    /* B, T, heads, hs, stride, llama3 scaling: q and k of a fused qkv row (heads NH + NKV,
     * stride (NH + 2 NKV) hs), odd strides and head sizes (element path), long T (large angles) */
    static const int cases[][6] = {
        {1, 1, 1, 2, 2, 0},        {2, 37, 3, 64, 192, 0},   {2, 130, 6, 128, 1024, 1}, {3, 17, 2, 10, 25, 0},
        {1, 1000, 12, 64, 1024, 1}, {2, 33, 5, 96, 483, 1}, {1, 70, 20, 64, 1536, 1},
    };
    td_rng_seed(&F.rng, 114);
    worst_begin();
    for (int di = 0; di < N_DTS; di++) {
        const td_dtype dt = DTS[di];
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const int B = cases[ci][0], T = cases[ci][1], heads = cases[ci][2], hs = cases[ci][3];
            const size_t stride = (size_t)cases[ci][4], n = (size_t)B * T * stride;
            for (int packed = 0; packed < 2; packed++) {
            reset();
            int *pos = packed ? hmalloc((size_t)B * T * sizeof(int)) : NULL;
            for (size_t i = 0; packed && i < (size_t)B * T; i++) /* documents of about 10 tokens */
                pos[i] = i % (size_t)T && td_rng_below(&F.rng, 10) ? pos[i - 1] + 1 : 0;
            int *d_pos = packed ? up_int(pos, (size_t)B * T) : NULL;
            float *inv = hmalloc((size_t)hs / 2 * 4);
            rope_table(inv, hs, cases[ci][5]);
            float *d_inv = up(TD_DTYPE_F32, inv, (size_t)hs / 2);
            float *x = hrand(dt, n, 2), *want = hcopy(x, n);
            /* forward; the columns past heads * hs of a row stay as they were */
            td_ops_rope_forward(want, inv, pos, B, T, heads, hs, stride);
            void *d_x = up(dt, x, n);
            TD_ASSERT_OK(td_ops_cuda_rope_forward(d_x, d_inv, d_pos, B, T, heads, hs, stride, dt, F.s));
            check_dev(LABEL("rope forward B%d T%d heads %d hs %d stride %zu", B, T, heads, hs, stride), dt, d_x, want,
                      n, tol_of(dt, TOL_POINT, 2));
            float *dx = hrand(dt, n, 1), *dwant = hcopy(dx, n);
            td_ops_rope_backward(dwant, inv, pos, B, T, heads, hs, stride);
            void *d_dx = up(dt, dx, n);
            TD_ASSERT_OK(td_ops_cuda_rope_backward(d_dx, d_inv, d_pos, B, T, heads, hs, stride, dt, F.s));
            check_dev(LABEL("rope backward B%d T%d heads %d hs %d stride %zu packed %d", B, T, heads, hs, stride, packed),
                      dt, d_dx, dwant, n, tol_of(dt, TOL_POINT, 2));
            }
        }
    }
    reset();
    worst_print("rope");
}

/* The attention half of a LLaMA / Qwen2 block, composed of the CUDA ops as
 * a trainer does: qkv = x W^T (+ bias: Qwen2's q/k/v biases, the matmul's
 * epilogue), RoPE on q and k in place, grouped-query attention; backward
 * through all three, dbias included.  The CPU side rounds qkv to the
 * storage type where the GPU stores it. */
static void llama_attention_case(td_dtype dt, int B, int T, int C, int NH, int NKV, int hs, int bias)
{
    const int N = B * T, OC = (NH + 2 * NKV) * hs, CA = NH * hs;
    const size_t NC = (size_t)N * C, NO = (size_t)N * OC, WC = (size_t)OC * C, NA = (size_t)N * CA;
    const size_t n_lse = (size_t)B * NH * T;
    char shape[80];
    snprintf(shape, sizeof shape, "B%d T%d C%d NH%d NKV%d hs%d bias %d", B, T, C, NH, NKV, hs, bias);
    reset();
    float *x = hrand(dt, NC, 1), *w = hrand(dt, WC, 2.0f / sqrtf((float)C)), *b = bias ? hrand(dt, OC, 0.5f) : NULL;
    float *inv = hmalloc((size_t)hs / 2 * 4);
    rope_table(inv, hs, 1);
    float *qkv = hmalloc(NO * 4), *out = hmalloc(NA * 4), *lse = hmalloc(n_lse * 4);
    td_ops_matmul_forward(qkv, x, w, b, N, C, OC);
    for (size_t i = 0; i < NO; i++) qkv[i] = rnd(dt, qkv[i]);
    td_ops_rope_forward(qkv, inv, NULL, B, T, NH + NKV, hs, OC);
    for (size_t i = 0; i < NO; i++) qkv[i] = rnd(dt, qkv[i]);
    td_ops_attention_gqa_forward(out, lse, qkv, NULL, B, T, NH, NKV, hs);

    void *d_x = up(dt, x, NC), *d_w = up(dt, w, WC), *d_b = bias ? up(dt, b, OC) : NULL;
    float *d_inv = up(TD_DTYPE_F32, inv, (size_t)hs / 2);
    void *d_qkv = dnan(dt, NO), *d_out = dnan(dt, NA);
    float *d_lse = dnan(TD_DTYPE_F32, n_lse);
    const size_t sb = td_ops_cuda_attention_gqa_scratch_bytes(B, T, NH, NKV, hs, dt) +
                      td_ops_cuda_matmul_scratch_bytes(N, OC);
    void *scratch = scratch_for(sb);
    TD_ASSERT_OK(td_ops_cuda_matmul_forward(F.ctx, d_qkv, NULL, d_x, d_w, d_b, NULL, N, C, OC, dt, F.s));
    TD_ASSERT_OK(td_ops_cuda_rope_forward(d_qkv, d_inv, NULL, B, T, NH + NKV, hs, OC, dt, F.s));
    TD_ASSERT_OK(td_ops_cuda_attention_gqa_forward(F.ctx, d_out, d_lse, d_qkv, NULL, B, T, NH, NKV, hs, dt, scratch, sb, F.s));
    check_dev(LABEL("llama attention qkv %s", shape), dt, d_qkv, qkv, NO, tol_of(dt, TOL_BLOCK, C));
    check_dev(LABEL("llama attention out %s", shape), dt, d_out, out, NA, tol_of(dt, TOL_BLOCK, T));

    /* backward from the CPU's out and lse */
    for (size_t i = 0; i < NA; i++) out[i] = rnd(dt, out[i]);
    copy_sync(d_lse, lse, n_lse * 4, cudaMemcpyHostToDevice);
    void *d_fout = up(dt, out, NA);
    float *dout = hrand(dt, NA, 1);
    float *dqkv = hzero(NO), *dx = hzero(NC), *dw = hzero(WC), *db = hzero(OC);
    td_ops_attention_gqa_backward(dqkv, dout, qkv, out, lse, NULL, B, T, NH, NKV, hs);
    td_ops_rope_backward(dqkv, inv, NULL, B, T, NH + NKV, hs, OC);
    td_ops_matmul_backward(dx, dw, bias ? db : NULL, dqkv, x, w, N, C, OC);
    void *d_dqkv = dnan(dt, NO), *d_dx = dnan(dt, NC), *d_dw = up(dt, hzero(WC), WC), *d_db = up(dt, hzero(OC), OC);
    TD_ASSERT_OK(td_ops_cuda_attention_gqa_backward(F.ctx, d_dqkv, up(dt, dout, NA), d_qkv, d_fout, d_lse, NULL, B, T, NH,
                                                    NKV, hs, TD_OPS_CUDA_SET, dt, scratch, sb, F.s));
    TD_ASSERT_OK(td_ops_cuda_rope_backward(d_dqkv, d_inv, NULL, B, T, NH + NKV, hs, OC, dt, F.s));
    TD_ASSERT_OK(td_ops_cuda_matmul_backward(F.ctx, d_dx, d_dw, bias ? d_db : NULL, d_dqkv, d_x, d_w, N, C, OC,
                                             TD_OPS_CUDA_SET, dt, dt, scratch, sb, F.s));
    check_dev(LABEL("llama attention dx %s", shape), dt, d_dx, dx, NC, tol_of(dt, TOL_BLOCK, OC));
    check_dev(LABEL("llama attention dweight %s", shape), dt, d_dw, dw, WC, tol_of(dt, TOL_BLOCK, N));
    if (bias) check_dev(LABEL("llama attention dbias %s", shape), dt, d_db, db, OC, tol_of(dt, TOL_BLOCK, N));
}

static void test_llama_attention(void **state)
{
    (void)state;
    td_rng_seed(&F.rng, 115);
    worst_begin();
    for (int di = 0; di < 2; di++) /* fp32, bf16 */
        for (int bias = 0; bias < 2; bias++) {
            llama_attention_case(DTS[di], 2, 70, 256, 4, 2, 64, bias);
            llama_attention_case(DTS[di], 1, 130, 384, 4, 1, 128, bias);
        }
    reset();
    worst_print("llama attention");
}

static void test_llama_argument_errors(void **state)
{
    (void)state;
    reset();
    void *d = dmalloc(1 << 16), *scratch = dmalloc(1 << 20);
    /* key/value heads that do not divide the query heads */
    assert_int_equal(td_ops_cuda_attention_gqa_forward(F.ctx, d, d, d, NULL, 1, 4, 6, 4, 64, TD_DTYPE_BF16, scratch, 1 << 20,
                                                       F.s),
                     TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "NKV"));
    assert_int_equal(td_ops_cuda_attention_gqa_scratch_bytes(1, 4, 6, 4, 64, TD_DTYPE_BF16), 0);
    /* odd head size, rows shorter than the heads */
    assert_int_equal(td_ops_cuda_rope_forward(d, d, NULL, 1, 4, 2, 63, 126, TD_DTYPE_F32, F.s), TD_ERR_INVALID);
    assert_int_equal(td_ops_cuda_rope_backward(d, d, NULL, 1, 4, 2, 64, 127, TD_DTYPE_F32, F.s), TD_ERR_INVALID);
    /* in place only when written */
    assert_int_equal(td_ops_cuda_glu_backward(d, d, d, 4, 8, TD_OPS_GLU_SILU, TD_OPS_CUDA_ADD, TD_DTYPE_F32, F.s), TD_ERR_INVALID);
    assert_int_equal(td_ops_cuda_glu_backward(d, d, (char *)d + 4096, 4, 8, TD_OPS_GLU_SILU, TD_OPS_CUDA_SET, TD_DTYPE_F32, F.s),
                     TD_ERR_INVALID); /* dgate_up over dout */
    assert_int_equal(td_ops_cuda_rmsnorm_backward(d, d, d, (char *)d + 4096, d, 0.0f, d, 4, 8, TD_DTYPE_F32, TD_DTYPE_F32,
                                                  scratch, 1 << 20, F.s),
                     TD_ERR_INVALID); /* dinp over dout */
    /* a negative epsilon, a gradient type that is neither dt nor fp32, small scratch */
    assert_int_equal(td_ops_cuda_rmsnorm_forward(d, d, d, d, 0.0f, 4, 8, -1.0f, TD_DTYPE_F32, F.s), TD_ERR_INVALID);
    assert_int_equal(td_ops_cuda_rmsnorm_backward(d, d, d, d, d, 0.0f, d, 4, 8, TD_DTYPE_F32, TD_DTYPE_BF16, scratch, 1 << 20,
                                                  F.s),
                     TD_ERR_INVALID);
    assert_int_equal(td_ops_cuda_rmsnorm_backward(d, d, d, d, d, 0.0f, d, 300, 8, TD_DTYPE_F32, TD_DTYPE_F32, scratch,
                                                  td_ops_cuda_rmsnorm_scratch_bytes(300, 8) - 1, F.s),
                     TD_ERR_INVALID);
    CUDA_OK(cudaStreamSynchronize((cudaStream_t)F.s));
    CUDA_OK(cudaGetLastError());
    reset();
}

/* --- softmax, cross-entropy ------------------------------------------------------- */

static void test_crossentropy(void **state)
{
    (void)state;
    static const int cases[][3] = {{1, 1, 1}, {5, 10, 16}, {37, 101, 128}, {16, 1000, 1000}, {6, 50257, 50304},
                                   {3, 7, 13}};
    td_rng_seed(&F.rng, 106);
    worst_begin();
    for (int di = 0; di < N_DTS; di++) {
        const td_dtype dt = DTS[di];
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const int N = cases[ci][0], V = cases[ci][1], Vp = cases[ci][2];
            const size_t NV = (size_t)N * Vp;
            reset();
            float *x = hrand(dt, NV, 6);
            for (size_t i = 0; i < NV; i++) /* padded columns hold garbage that must be ignored */
                if ((int)(i % Vp) >= V) x[i] = rnd(dt, 1e4f);
            int *y = hmalloc(N * sizeof(int));
            int kept = 0;
            for (int n = 0; n < N; n++) {
                y[n] = td_rng_below(&F.rng, 5) == 0 && N > 1 ? TD_OPS_IGNORE_INDEX : (int)td_rng_below(&F.rng, V);
                kept += y[n] >= 0;
            }
            const float dloss = kept ? 1.0f / (float)kept : 1.0f;
            void *d_x = up(dt, x, NV);
            int *d_y = up_int(y, N);
            float *losses = hmalloc(N * 4), *lse = hmalloc(N * 4), *probs = hmalloc(NV * 4), *dl = hmalloc(NV * 4);
            td_ops_crossentropy_forward(losses, lse, x, y, N, V, Vp);
            td_ops_softmax_forward(probs, x, N, V, Vp);
            td_ops_crossentropy_backward(dl, x, lse, y, dloss, N, V, Vp);

            void *d_probs = dnan(dt, NV);
            TD_ASSERT_OK(td_ops_cuda_softmax_forward(d_probs, d_x, N, V, Vp, dt, F.s));
            check_dev(LABEL("softmax N%d V%d Vp%d", N, V, Vp), dt, d_probs, probs, NV, tol_of(dt, TOL_LOSS, V));
            float *d_losses = dnan(TD_DTYPE_F32, N), *d_lse = dnan(TD_DTYPE_F32, N);
            TD_ASSERT_OK(td_ops_cuda_crossentropy_forward(d_losses, d_lse, d_x, d_y, N, V, Vp, dt, F.s));
            check_dev(LABEL("cross-entropy losses N%d V%d Vp%d", N, V, Vp), TD_DTYPE_F32, d_losses, losses, N,
                      tol_of(TD_DTYPE_F32, TOL_LOSS, V));
            check_dev(LABEL("cross-entropy lse N%d V%d Vp%d", N, V, Vp), TD_DTYPE_F32, d_lse, lse, N,
                      tol_of(TD_DTYPE_F32, TOL_LOSS, V));
            /* backward into another buffer, from the CPU's lse */
            copy_sync(d_lse, lse, N * 4, cudaMemcpyHostToDevice);
            void *d_dl = dnan(dt, NV);
            TD_ASSERT_OK(td_ops_cuda_crossentropy_backward(d_dl, d_x, d_lse, d_y, dloss, N, V, Vp, dt, F.s));
            check_dev(LABEL("cross-entropy dlogits N%d V%d Vp%d", N, V, Vp), dt, d_dl, dl, NV, tol_of(dt, TOL_LOSS, 1));
            /* backward in place, then fused in place */
            void *d_x2 = up(dt, x, NV);
            TD_ASSERT_OK(td_ops_cuda_crossentropy_backward(d_x2, d_x2, d_lse, d_y, dloss, N, V, Vp, dt, F.s));
            check_dev(LABEL("cross-entropy dlogits in place N%d V%d Vp%d", N, V, Vp), dt, d_x2, dl, NV,
                      tol_of(dt, TOL_LOSS, 1));
            void *d_x3 = up(dt, x, NV);
            fill(d_losses, 0xff, N * 4);
            fill(d_lse, 0xff, N * 4);
            TD_ASSERT_OK(td_ops_cuda_crossentropy_fused(d_losses, d_lse, d_x3, d_y, dloss, N, V, Vp, dt, F.s));
            check_dev(LABEL("cross-entropy fused dlogits N%d V%d Vp%d", N, V, Vp), dt, d_x3, dl, NV,
                      tol_of(dt, TOL_LOSS, 1));
            check_dev(LABEL("cross-entropy fused losses N%d V%d Vp%d", N, V, Vp), TD_DTYPE_F32, d_losses, losses, N,
                      tol_of(TD_DTYPE_F32, TOL_LOSS, V));
            check_dev(LABEL("cross-entropy fused lse N%d V%d Vp%d", N, V, Vp), TD_DTYPE_F32, d_lse, lse, N,
                      tol_of(TD_DTYPE_F32, TOL_LOSS, V));
            /* ignored rows and padded columns are exactly zero */
            float *g = down(dt, d_x3, NV);
            for (int n = 0; n < N; n++)
                for (int v = 0; v < Vp; v++)
                    if (y[n] < 0 || v >= V) assert_true(g[(size_t)n * Vp + v] == 0.0f);
        }
    }
    reset();
    worst_print("cross-entropy");
}

/* --- head ---------------------------------------------------------------------------- */

static void test_head(void **state)
{
    (void)state;
    static const int cases[][3] = {{7, 32, 50}, {33, 72, 128}, {64, 128, 1000}, {5, 100, 37}};
    td_rng_seed(&F.rng, 107);
    worst_begin();
    for (int di = 0; di < N_DTS; di++) {
        const td_dtype dt = DTS[di];
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const int N = cases[ci][0], C = cases[ci][1], Vp = cases[ci][2];
            const size_t NC = (size_t)N * C, NV = (size_t)N * Vp, VC = (size_t)Vp * C;
            td_dtype gdts[2];
            const int ng = grad_types(dt, gdts);
            for (int gi = 0; gi < ng; gi++) {
                const td_dtype gdt = gdts[gi];
                reset();
                float *x = hrand(dt, NC, 2), *lw = hrand(dt, C, 1), *lb = hrand(dt, C, 0.5f), *wte = hrand(dt, VC, 0.3f);
                float *logits = hmalloc(NV * 4), *lnf = hmalloc(NC * 4), *mean = hmalloc(N * 4), *rstd = hmalloc(N * 4);
                td_ops_head_forward(logits, lnf, mean, rstd, x, lw, lb, wte, N, C, Vp);
                void *d_x = up(dt, x, NC), *d_lw = up(dt, lw, C), *d_lb = up(dt, lb, C), *d_wte = up(dt, wte, VC);
                void *d_logits = dnan(dt, NV), *d_lnf = dnan(dt, NC);
                float *d_mean = dnan(TD_DTYPE_F32, N), *d_rstd = dnan(TD_DTYPE_F32, N);
                if (gi == 0) {
                    TD_ASSERT_OK(td_ops_cuda_head_forward(F.ctx, d_logits, d_lnf, d_mean, d_rstd, d_x, d_lw, d_lb, d_wte,
                                                          N, C, Vp, dt, F.s));
                    check_dev(LABEL("head logits N%d C%d Vp%d", N, C, Vp), dt, d_logits, logits, NV,
                              tol_of(dt, TOL_HEAD, C));
                    check_dev(LABEL("head lnf N%d C%d Vp%d", N, C, Vp), dt, d_lnf, lnf, NC, tol_of(dt, TOL_LN, C));
                    check_dev(LABEL("head mean N%d C%d", N, C), TD_DTYPE_F32, d_mean, mean, N,
                              tol_of(TD_DTYPE_F32, TOL_LN, C));
                    check_dev(LABEL("head rstd N%d C%d", N, C), TD_DTYPE_F32, d_rstd, rstd, N,
                              tol_of(TD_DTYPE_F32, TOL_LN, C));
                }
                /* backward from the CPU's lnf (rounded), mean and rstd */
                for (size_t i = 0; i < NC; i++) lnf[i] = rnd(dt, lnf[i]);
                d_lnf = up(dt, lnf, NC);
                copy_sync(d_mean, mean, N * 4, cudaMemcpyHostToDevice);
                copy_sync(d_rstd, rstd, N * 4, cudaMemcpyHostToDevice);
                float *dlogits = hrand(dt, NV, 0.1f);
                float *dx0 = hzero(NC), *dw0 = hzero(C), *db0 = hzero(C), *dwte0 = hzero(VC), *tmp = hmalloc(NC * 4);
                td_ops_head_backward(dx0, dw0, db0, dwte0, tmp, dlogits, x, lnf, mean, rstd, lw, wte, N, C, Vp);
                float *dx = acc_like(dt, dx0, NC), *dw = acc_like(gdt, dw0, C), *db = acc_like(gdt, db0, C),
                      *dwte = acc_like(gdt, dwte0, VC);
                void *d_dx = up(dt, dx, NC), *d_dw = up(gdt, dw, C), *d_db = up(gdt, db, C), *d_dwte = up(gdt, dwte, VC);
                td_ops_head_backward(dx, dw, db, dwte, tmp, dlogits, x, lnf, mean, rstd, lw, wte, N, C, Vp);
                size_t sb = td_ops_cuda_head_scratch_bytes(N, C);
                TD_ASSERT_OK(td_ops_cuda_head_backward(F.ctx, d_dx, d_dw, d_db, d_dwte, dnan(dt, NC), up(dt, dlogits, NV),
                                                       d_x, d_lnf, d_mean, d_rstd, d_lw, d_wte, N, C, Vp, dt, gdt,
                                                       scratch_for(sb), sb, F.s));
                const char *gn = td_dtype_name(gdt);
                check_dev(LABEL("head dx N%d C%d Vp%d", N, C, Vp), dt, d_dx, dx, NC, tol_of(dt, TOL_HEAD, Vp));
                /* dlnf (dt) lies between dlogits and these: dt's rounding, whatever gdt */
                check_dev(LABEL("head dlnf_w N%d C%d grads %s", N, C, gn), gdt, d_dw, dw, C, tol_of(dt, TOL_HEAD, N));
                check_dev(LABEL("head dlnf_b N%d C%d grads %s", N, C, gn), gdt, d_db, db, C, tol_of(dt, TOL_HEAD, N));
                check_dev(LABEL("head dwte N%d C%d Vp%d grads %s", N, C, Vp, gn), gdt, d_dwte, dwte, VC,
                          tol_of(gdt, TOL_HEAD, N));
            }
        }
    }
    reset();
    worst_print("head");
}

/* --- one block ----------------------------------------------------------------------- */

/* Random block parameters (a flat span of the reference model's layout) whose branches
 * matter next to the residual stream: weights ~ 1/sqrt(fan-in), LayerNorm
 * weights around 1, biases +-0.1. */
static float *block_params(const td_model_desc *cfg, td_dtype dt, size_t *numel)
{
    size_t off;
    td_model_block_span(cfg, 0, &off, numel);
    float *p = hmalloc(*numel * sizeof(float));
    td_model_block w;
    td_model_block_view(cfg, p, &w);
    const int C = cfg->n_embd;
    float *const tensors[12] = {w.ln1_w, w.ln1_b, w.qkv_w, w.qkv_b, w.attproj_w, w.attproj_b,
                                w.ln2_w, w.ln2_b, w.fc_w, w.fc_b, w.fcproj_w, w.fcproj_b};
    const size_t counts[12] = {C, C, 3 * (size_t)C * C, 3 * (size_t)C, (size_t)C * C, C,
                               C, C, 4 * (size_t)C * C, 4 * (size_t)C, 4 * (size_t)C * C, C};
    const float scales[12] = {0.2f, 0.1f, 1.0f / sqrtf((float)C), 0.1f, 1.0f / sqrtf((float)C), 0.1f,
                              0.2f, 0.1f, 1.0f / sqrtf((float)C), 0.1f, 0.5f / sqrtf((float)C), 0.1f};
    for (int t = 0; t < 12; t++)
        for (size_t i = 0; i < counts[t]; i++) {
            float u = (float)((td_rng_uniform(&F.rng) * 2 - 1) * scales[t]);
            tensors[t][i] = rnd(dt, (t == 0 || t == 6) ? 1.0f + u : u);
        }
    return p;
}

/* The acts of the CPU's block forward as views, and as one flat array. */
typedef struct cpu_acts {
    float *base;
    size_t numel;
    td_model_block_acts a;
} cpu_acts;

static void block_case(int B, int T, int C, int NH, td_dtype dt, td_dtype gdt, int do_forward)
{
    td_model_desc cfg = {.n_layer = 1, .n_head = NH, .n_embd = C, .n_positions = T, .vocab_size = 64, .padded_vocab_size = 64};
    const size_t N = (size_t)B * T, NC = N * C;
    reset();
    size_t pn;
    float *params = block_params(&cfg, dt, &pn);
    td_model_block w;
    td_model_block_view(&cfg, params, &w);
    float *x = hrand(dt, NC, 1), *dy = hrand(dt, NC, 1), *y = hmalloc(NC * 4);
    cpu_acts ca;
    ca.numel = td_model_block_acts_numel(&cfg, B, T);
    ca.base = hmalloc(ca.numel * 4);
    td_model_block_acts_view(&cfg, B, T, ca.base, &ca.a);
    td_model_block_forward(&cfg, &w, &ca.a, x, y, NULL, B, T);

    void *d_params = up(dt, params, pn), *d_x = up(dt, x, NC);
    td_ops_cuda_block dw;
    td_ops_cuda_block_view(&cfg, d_params, dt, &dw);
    size_t ab = td_ops_cuda_block_acts_bytes(&cfg, B, T, dt);
    void *d_acts = dmalloc(ab);
    fill(d_acts, 0xff, ab);
    td_ops_cuda_block_acts da;
    td_ops_cuda_block_acts_view(&cfg, B, T, dt, d_acts, &da);
    const size_t sb = td_ops_cuda_block_scratch_bytes(&cfg, B, T, dt, B);
    void *scratch = dmalloc(sb);

    /* The acts of one block, in the same order on both sides. */
    const struct {
        const char *name;
        size_t n;
        int fp32;
        float *cpu;
        void *gpu;
    } acts[] = {
        {"ln1", NC, 0, ca.a.ln1, da.ln1}, {"ln1_mean", N, 1, ca.a.ln1_mean, da.ln1_mean},
        {"ln1_rstd", N, 1, ca.a.ln1_rstd, da.ln1_rstd}, {"qkv", 3 * NC, 0, ca.a.qkv, da.qkv},
        {"atty", NC, 0, ca.a.atty, da.atty}, {"att_lse", (size_t)B * NH * T, 1, ca.a.att_lse, da.att_lse},
        {"res2", NC, 0, ca.a.res2, da.res2}, {"ln2", NC, 0, ca.a.ln2, da.ln2},
        {"ln2_mean", N, 1, ca.a.ln2_mean, da.ln2_mean}, {"ln2_rstd", N, 1, ca.a.ln2_rstd, da.ln2_rstd},
        {"fch", 4 * NC, 0, ca.a.fch, da.fch}, {"fch_gelu", 4 * NC, 0, ca.a.fch_gelu, da.fch_gelu},
    };
    const int n_acts = (int)(sizeof acts / sizeof acts[0]);
    if (do_forward) {
        void *d_y = dnan(dt, NC);
        TD_ASSERT_OK(td_ops_cuda_block_forward(F.ctx, &cfg, &dw, &da, d_x, d_y, NULL, B, T, dt, scratch, sb, F.s));
        check_dev(LABEL("block y B%d T%d C%d NH%d", B, T, C, NH), dt, d_y, y, NC, tol_of(dt, TOL_BLOCK, 4 * C));
        for (int i = 0; i < n_acts; i++) {
            td_dtype at = acts[i].fp32 ? TD_DTYPE_F32 : dt;
            check_dev(LABEL("block %s B%d T%d C%d NH%d", acts[i].name, B, T, C, NH), at, acts[i].gpu, acts[i].cpu,
                      acts[i].n, tol_of(dt, TOL_BLOCK, 4 * C));
        }
    }

    /* Backward from the CPU's acts rounded to dt (both sides see the same acts). */
    for (int i = 0; i < n_acts; i++) {
        if (!acts[i].fp32)
            for (size_t j = 0; j < acts[i].n; j++) acts[i].cpu[j] = rnd(dt, acts[i].cpu[j]);
        void *src = up(acts[i].fp32 ? TD_DTYPE_F32 : dt, acts[i].cpu, acts[i].n);
        copy_sync(acts[i].gpu, src, acts[i].n * esize(acts[i].fp32 ? TD_DTYPE_F32 : dt), cudaMemcpyDeviceToDevice);
    }
    float *g0 = hzero(pn), *dx0 = hzero(NC), *cpu_scratch = hmalloc(td_model_block_scratch_numel(&cfg, B, T) * 4);
    td_model_block gv;
    td_model_block_view(&cfg, g0, &gv);
    td_model_block_backward(&cfg, &w, &gv, &ca.a, x, dy, dx0, cpu_scratch, NULL, B, T);
    /* grads start at random values of each tensor's own gradient size */
    float *g = hmalloc(pn * 4);
    {
        size_t off = 0;
        const size_t counts[12] = {C, C, 3 * (size_t)C * C, 3 * (size_t)C, (size_t)C * C, C,
                                   C, C, 4 * (size_t)C * C, 4 * (size_t)C, 4 * (size_t)C * C, C};
        for (int t = 0; t < 12; t++) {
            float *a = acc_like(gdt, g0 + off, counts[t]);
            memcpy(g + off, a, counts[t] * 4);
            off += counts[t];
        }
    }
    void *d_g = up(gdt, g, pn);
    td_ops_cuda_block dg;
    td_ops_cuda_block_view(&cfg, d_g, gdt, &dg);
    td_model_block_view(&cfg, g, &gv);
    void *d_dy = up(dt, dy, NC);
    for (int mode = 0; mode < 2; mode++) {
        float *dx = mode ? hcopy(dx0, NC) : acc_like(dt, dx0, NC);
        void *d_dx = mode ? dnan(dt, NC) : up(dt, dx, NC);
        if (mode == 0) {
            td_model_block_backward(&cfg, &w, &gv, &ca.a, x, dy, dx, cpu_scratch, NULL, B, T);
        } else { /* the grads are added a second time on both sides */
            float *dx_unused = hzero(NC);
            td_model_block_backward(&cfg, &w, &gv, &ca.a, x, dy, dx_unused, cpu_scratch, NULL, B, T);
        }
        TD_ASSERT_OK(td_ops_cuda_block_backward(F.ctx, &cfg, &dw, &dg, &da, d_x, d_dy, d_dx, NULL, B, T,
                                                mode ? TD_OPS_CUDA_SET : TD_OPS_CUDA_ADD, dt, gdt, scratch, sb, F.s));
        const char *m = mode ? "set" : "add";
        check_dev(LABEL("block dx B%d T%d C%d NH%d %s", B, T, C, NH, m), dt, d_dx, dx, NC, tol_of(dt, TOL_BLOCK, 4 * C));
        static const char *const names[12] = {"ln1_w", "ln1_b", "qkv_w", "qkv_b", "attproj_w", "attproj_b",
                                              "ln2_w", "ln2_b", "fc_w", "fc_b", "fcproj_w", "fcproj_b"};
        const float *cpu_g[12] = {gv.ln1_w, gv.ln1_b, gv.qkv_w, gv.qkv_b, gv.attproj_w, gv.attproj_b,
                                  gv.ln2_w, gv.ln2_b, gv.fc_w, gv.fc_b, gv.fcproj_w, gv.fcproj_b};
        const void *gpu_g[12] = {dg.ln1_w, dg.ln1_b, dg.qkv_w, dg.qkv_b, dg.attproj_w, dg.attproj_b,
                                 dg.ln2_w, dg.ln2_b, dg.fc_w, dg.fc_b, dg.fcproj_w, dg.fcproj_b};
        const size_t counts[12] = {C, C, 3 * (size_t)C * C, 3 * (size_t)C, (size_t)C * C, C,
                                   C, C, 4 * (size_t)C * C, 4 * (size_t)C, 4 * (size_t)C * C, C};
        for (int t = 0; t < 12; t++)
            check_dev(LABEL("block d%s B%d T%d C%d NH%d grads %s pass %d", names[t], B, T, C, NH, td_dtype_name(gdt),
                            mode + 1),
                      gdt, gpu_g[t], cpu_g[t], counts[t], tol_of(dt, TOL_BLOCK, (long)N));
    }
}

static void test_block(void **state)
{
    (void)state;
    /* B, T, C, NH */
    static const int cases[][4] = {{2, 17, 64, 2}, {2, 37, 96, 3}, {1, 70, 128, 4}, {3, 9, 48, 4}, {2, 80, 128, 2}};
    td_rng_seed(&F.rng, 108);
    worst_begin();
    for (int di = 0; di < N_DTS; di++) {
        const td_dtype dt = DTS[di];
        td_dtype gdts[2];
        const int ng = grad_types(dt, gdts);
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
            for (int gi = 0; gi < ng; gi++)
                block_case(cases[ci][0], cases[ci][1], cases[ci][2], cases[ci][3], dt, gdts[gi], gi == 0);
    }
    reset();
    worst_print("block");
}

/* --- determinism ------------------------------------------------------------------------ */

/* The same block forward and backward twice: the same bits (no atomics). */
static void repeats_case(int C, int NH)
{
    const int B = 2, T = 96;
    const td_dtype dt = TD_DTYPE_BF16, gdt = TD_DTYPE_F32;
    td_model_desc cfg = {.n_layer = 1, .n_head = NH, .n_embd = C, .n_positions = T, .vocab_size = 64, .padded_vocab_size = 64};
    const size_t NC = (size_t)B * T * C;
    td_rng_seed(&F.rng, 109);
    reset();
    size_t pn;
    float *params = block_params(&cfg, dt, &pn);
    void *d_params = up(dt, params, pn), *d_x = up(dt, hrand(dt, NC, 1), NC), *d_dy = up(dt, hrand(dt, NC, 1), NC);
    td_ops_cuda_block w, g;
    td_ops_cuda_block_view(&cfg, d_params, dt, &w);
    void *d_g = dmalloc(pn * 4);
    td_ops_cuda_block_view(&cfg, d_g, gdt, &g);
    const size_t ab = td_ops_cuda_block_acts_bytes(&cfg, B, T, dt), sb = td_ops_cuda_block_scratch_bytes(&cfg, B, T, dt, B);
    void *d_acts = dmalloc(ab), *scratch = dmalloc(sb), *d_y = dmalloc(NC * 2), *d_dx = dmalloc(NC * 2);
    td_ops_cuda_block_acts a;
    td_ops_cuda_block_acts_view(&cfg, B, T, dt, d_acts, &a);
    unsigned char *first[3] = {0}, *now[3] = {0};
    const size_t bytes[3] = {NC * 2, pn * 4, NC * 2};
    void *const dev[3] = {d_y, d_g, d_dx};
    for (int rep = 0; rep < 3; rep++) {
        fill(d_g, 0, pn * 4);
        TD_ASSERT_OK(td_ops_cuda_block_forward(F.ctx, &cfg, &w, &a, d_x, d_y, NULL, B, T, dt, scratch, sb, F.s));
        TD_ASSERT_OK(td_ops_cuda_block_backward(F.ctx, &cfg, &w, &g, &a, d_x, d_dy, d_dx, NULL, B, T, TD_OPS_CUDA_SET, dt,
                                                gdt, scratch, sb, F.s));
        CUDA_OK(cudaStreamSynchronize((cudaStream_t)F.s));
        for (int i = 0; i < 3; i++) {
            unsigned char *h = hmalloc(bytes[i]);
            copy_sync(h, dev[i], bytes[i], cudaMemcpyDeviceToHost);
            if (rep == 0) first[i] = h;
            now[i] = h;
        }
        for (int i = 0; i < 3; i++) assert_memory_equal(first[i], now[i], bytes[i]);
    }
    reset();
}

/* hs 32 runs the batched-GEMM attention, hs 64 the flash kernels. */
static void test_block_repeats_bit_identical(void **state)
{
    (void)state;
    repeats_case(128, 4);
    repeats_case(128, 2);
}

/* --- GEMM tuning ------------------------------------------------------------------------------ */

/* A context that tunes its GEMMs (context.cu, "Tuning": the first calls of a
 * shape take cuBLASLt's candidates in turn) gives the bits of one that does
 * not, at every call: while each candidate is timed and after one is kept.
 * Shapes of the workloads' linears (GPT-2 124M and 1.5B, Qwen2.5 0.5B) at
 * 4096 rows: forward (with bias, and with the fused GELU), dinp (with the
 * fused GELU derivative), dweight added into (beta 1) in bf16 and fp32, and
 * an fp16 case. */
typedef struct tune_case {
    int C, OC, gelu;
    td_dtype dt, gdt;
} tune_case;

static int tune_case_run(td_ops_cuda *plain, td_ops_cuda *tuned, tune_case c)
{
    const int N = 4096, C = c.C, OC = c.OC, calls = 40;
    const td_dtype dt = c.dt, gdt = c.gdt;
    reset();
    const size_t nin = (size_t)N * C, nout = (size_t)N * OC, nw = (size_t)OC * C;
    void *inp = up(dt, hrand(dt, nin, 1), nin), *w = up(dt, hrand(dt, nw, 0.05f), nw),
         *bias = up(dt, hrand(dt, OC, 0.5f), OC), *dout = up(dt, hrand(dt, nout, 1), nout),
         *pre = c.gelu ? up(dt, hrand(dt, nin, 2), nin) : NULL, *dw0 = up(gdt, hrand(gdt, nw, 0.5f), nw);
    void *out = dmalloc(nout * esize(dt)), *aux = c.gelu ? dmalloc(nout * esize(dt)) : NULL,
         *dinp = dmalloc(nin * esize(dt)), *dw = dmalloc(nw * esize(gdt)), *db = dmalloc(OC * esize(gdt));
    const size_t sb = td_ops_cuda_matmul_scratch_bytes(N, OC);
    void *scratch = dmalloc(sb);
    void *const dev[4] = {out, dinp, dw, db};
    const size_t bytes[4] = {nout * esize(dt), nin * esize(dt), nw * esize(gdt), OC * esize(gdt)};
    unsigned char *ref[4], *now[4];
    for (int i = 0; i < 4; i++) {
        ref[i] = hmalloc(bytes[i]);
        now[i] = hmalloc(bytes[i]);
    }
    for (int call = -1; call < calls; call++) {
        td_ops_cuda *ctx = call < 0 ? plain : tuned;
        for (int i = 0; i < 2; i++) fill(dev[i], 0xff, bytes[i]);
        CUDA_OK(cudaMemcpyAsync(dw, dw0, bytes[2], cudaMemcpyDeviceToDevice, (cudaStream_t)F.s));
        fill(db, 0, bytes[3]);
        /* forward: with GELU, out = gelu(inp W^T + b) and the pre-activation in aux */
        TD_ASSERT_OK(td_ops_cuda_matmul_forward(ctx, out, aux, inp, w, bias, NULL, N, C, OC, dt, F.s));
        if (c.gelu) /* dinp through GELU: inp was gelu(pre) */
            TD_ASSERT_OK(td_ops_cuda_matmul_backward_gelu(ctx, dinp, dw, db, dout, inp, w, pre, N, C, OC, dt, gdt,
                                                          scratch, sb, F.s));
        else
            TD_ASSERT_OK(td_ops_cuda_matmul_backward(ctx, dinp, dw, db, dout, inp, w, N, C, OC, TD_OPS_CUDA_SET, dt,
                                                     gdt, scratch, sb, F.s));
        for (int i = 0; i < 4; i++) {
            copy_sync(call < 0 ? ref[i] : now[i], dev[i], bytes[i], cudaMemcpyDeviceToHost);
            if (call >= 0 && memcmp(ref[i], now[i], bytes[i]))
                fail_msg("GEMM tuning: C %d OC %d gelu %d %s/%s: %s of call %d differs from the untuned context's", C,
                         OC, c.gelu, td_dtype_name(dt), td_dtype_name(gdt),
                         (const char *[]){"out", "dinp", "dweight", "dbias"}[i], call);
        }
    }
    CUDA_OK(cudaStreamSynchronize((cudaStream_t)F.s));
    assert_int_equal(td_ops_cuda_gemm_tuning(tuned), 0); /* settled: every timed call has finished */
    int shapes = 0, timed = 0;
    td_ops_cuda_gemm_counts(tuned, &shapes, &timed, NULL);
    reset();
    return timed;
}

static void test_gemm_tuning_same_bits(void **state)
{
    (void)state;
    td_rng_seed(&F.rng, 211);
    const tune_case cases[] = {
        {768, 2304, 0, TD_DTYPE_BF16, TD_DTYPE_BF16},  {768, 768, 0, TD_DTYPE_BF16, TD_DTYPE_F32},
        {768, 3072, 1, TD_DTYPE_BF16, TD_DTYPE_BF16},  {3072, 768, 1, TD_DTYPE_BF16, TD_DTYPE_F32},
        {896, 1152, 0, TD_DTYPE_BF16, TD_DTYPE_BF16},  {4864, 896, 0, TD_DTYPE_BF16, TD_DTYPE_BF16},
        {1600, 4800, 0, TD_DTYPE_BF16, TD_DTYPE_F32}, {1024, 1024, 1, TD_DTYPE_F16, TD_DTYPE_F16},
    };
    td_ops_cuda_params p = td_ops_cuda_default_params();
    p.workspace = F.ws;
    p.workspace_bytes = TD_OPS_CUDA_WORKSPACE_BYTES;
    p.tune_gemm = 0;
    td_ops_cuda *plain = NULL, *tuned = NULL;
    TD_ASSERT_OK(td_ops_cuda_create(&p, &plain));
    p.tune_gemm = 1;
    TD_ASSERT_OK(td_ops_cuda_create(&p, &tuned));
    int timed = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) timed = tune_case_run(plain, tuned, cases[i]);
    int shapes = 0, retuned = 0, plain_timed = -1;
    td_ops_cuda_gemm_counts(tuned, &shapes, &timed, &retuned);
    td_ops_cuda_gemm_counts(plain, NULL, &plain_timed, NULL);
    assert_int_equal(plain_timed, 0); /* tune_gemm 0: one candidate a shape */
    int dev = 0, major = 0;
    CUDA_OK(cudaGetDevice(&dev));
    CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    if (major == 9) assert_true(timed > 0); /* sm_90 tunes these shapes (24 of 24 timed on an H200) */
    printf("  GEMM tuning: %d shapes, %d with candidates timed, %d kept one other than the heuristic's first; "
           "every call the untuned bits\n", shapes, timed, retuned);
    td_ops_cuda_free(plain);
    td_ops_cuda_free(tuned);
}

/* --- argument errors ----------------------------------------------------------------------- */

static void test_argument_errors(void **state)
{
    (void)state;
    reset();
    void *d = dmalloc(4096), *scratch = dmalloc(1 << 20);
    /* storage and gradient types */
    assert_int_equal(td_ops_cuda_gelu_forward(d, d, 16, (td_dtype)7, F.s), TD_ERR_INVALID);
    assert_int_equal(td_ops_cuda_layernorm_backward(d, d, d, d, d, d, d, d, 4, 8, TD_DTYPE_F32, TD_DTYPE_BF16, scratch,
                                                    1 << 20, F.s),
                     TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "gradient type"));
    /* scratch too small, or not 256-byte aligned */
    size_t need = td_ops_cuda_matmul_scratch_bytes(64, 64);
    assert_int_equal(td_ops_cuda_matmul_backward(F.ctx, d, d, d, d, d, d, 64, 8, 64, TD_OPS_CUDA_ADD, TD_DTYPE_F32,
                                                 TD_DTYPE_F32, scratch, need - 1, F.s),
                     TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "scratch"));
    assert_int_equal(td_ops_cuda_layernorm_backward(d, d, d, d, d, d, d, d, 4, 8, TD_DTYPE_F32, TD_DTYPE_F32,
                                                    (char *)scratch + 16, 1 << 19, F.s),
                     TD_ERR_INVALID);
    assert_int_equal(td_ops_cuda_attention_forward(F.ctx, d, d, d, 2, 64, 64, 2, TD_DTYPE_BF16, scratch,
                                                   td_ops_cuda_attention_scratch_bytes(1, 64, 64, 2, TD_DTYPE_BF16) - 1,
                                                   F.s),
                     TD_ERR_INVALID);
    /* shapes and aliasing */
    assert_int_equal(td_ops_cuda_attention_forward(F.ctx, d, d, d, 1, 4, 10, 3, TD_DTYPE_F32, scratch, 1 << 20, F.s),
                     TD_ERR_INVALID);
    assert_int_equal(td_ops_cuda_gelu_backward(d, d, d, 16, TD_OPS_CUDA_ADD, TD_DTYPE_F32, F.s), TD_ERR_INVALID);
    assert_int_equal(td_ops_cuda_matmul_forward(F.ctx, d, d, d, d, NULL, d, 4, 4, 4, TD_DTYPE_F32, F.s),
                     TD_ERR_INVALID);
    assert_int_equal(td_ops_cuda_crossentropy_forward(d, d, d, d, 4, 10, 8, TD_DTYPE_F32, F.s), TD_ERR_INVALID);
    /* a context needs an aligned workspace */
    td_ops_cuda_params p = td_ops_cuda_default_params();
    p.workspace = (char *)F.ws + 8;
    p.workspace_bytes = 1024;
    td_ops_cuda *ctx = NULL;
    assert_int_equal(td_ops_cuda_create(&p, &ctx), TD_ERR_INVALID);
    assert_null(ctx);
    /* nothing was launched by the failed calls */
    CUDA_OK(cudaStreamSynchronize((cudaStream_t)F.s));
    CUDA_OK(cudaGetLastError());
    reset();
}

/* --- speed of a GPT-2 124M block (printed, for the record) ------------------------------------ */

static void block_speed(int path)
{
    const int B = 8, T = 1024, C = 768, NH = 12;
    const td_dtype dt = TD_DTYPE_BF16, gdt = TD_DTYPE_BF16;
    td_model_desc cfg = {.n_layer = 1, .n_head = NH, .n_embd = C, .n_positions = T, .vocab_size = 64, .padded_vocab_size = 64};
    const size_t N = (size_t)B * T, NC = N * C;
    td_rng_seed(&F.rng, 110);
    reset();
    size_t pn;
    float *params = block_params(&cfg, dt, &pn);
    void *d_params = up(dt, params, pn), *d_x = up(dt, hrand(dt, NC, 1), NC), *d_dy = up(dt, hrand(dt, NC, 1), NC);
    td_ops_cuda_block w, g;
    td_ops_cuda_block_view(&cfg, d_params, dt, &w);
    void *d_g = dmalloc(pn * 2);
    fill(d_g, 0, pn * 2);
    td_ops_cuda_block_view(&cfg, d_g, gdt, &g);
    const size_t ab = td_ops_cuda_block_acts_bytes(&cfg, B, T, dt), sb = td_ops_cuda_block_scratch_bytes(&cfg, B, T, dt, B);
    void *d_acts = dmalloc(ab), *scratch = dmalloc(sb), *d_y = dmalloc(NC * 2), *d_dx = dmalloc(NC * 2);
    td_ops_cuda_block_acts a;
    td_ops_cuda_block_acts_view(&cfg, B, T, dt, d_acts, &a);
    cudaEvent_t e0, e1, e2;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    CUDA_OK(cudaEventCreate(&e2));
    cudaStream_t s = (cudaStream_t)F.s;
    float best_f = 1e30f, best_b = 1e30f;
    for (int rep = 0; rep < 6; rep++) { /* the first is the warm-up (plans, heuristics) */
        CUDA_OK(cudaEventRecord(e0, s));
        TD_ASSERT_OK(td_ops_cuda_block_forward(F.ctx, &cfg, &w, &a, d_x, d_y, NULL, B, T, dt, scratch, sb, F.s));
        CUDA_OK(cudaEventRecord(e1, s));
        TD_ASSERT_OK(td_ops_cuda_block_backward(F.ctx, &cfg, &w, &g, &a, d_x, d_dy, d_dx, NULL, B, T, TD_OPS_CUDA_SET, dt,
                                                gdt, scratch, sb, F.s));
        CUDA_OK(cudaEventRecord(e2, s));
        CUDA_OK(cudaEventSynchronize(e2));
        float f, b;
        CUDA_OK(cudaEventElapsedTime(&f, e0, e1));
        CUDA_OK(cudaEventElapsedTime(&b, e1, e2));
        if (rep > 0 && f < best_f) best_f = f;
        if (rep > 0 && b < best_b) best_b = b;
    }
    float *y = down(dt, d_y, NC), *dx = down(dt, d_dx, NC);
    for (size_t i = 0; i < NC; i++) {
        assert_true(isfinite(y[i]));
        assert_true(isfinite(dx[i]));
    }
    /* TFLOP/s counted llm.c's way: matmuls 2 N (3C^2 + C^2 + 4C^2 + 4C^2) forward, twice that
     * backward; attention as full T x T products, 2 forward and 4 backward of 2 B NH T^2 hs each
     * (the flash kernels skip the future but recompute: the figures compare the two paths) */
    const double mm = 2.0 * N * 12.0 * C * C, att = 2.0 * B * NH * (double)T * T * (C / NH);
    print_message("  GPT-2 124M block, B%d T%d bf16, %s attention: forward %.3f ms (%.0f TFLOP/s), backward %.3f ms "
                  "(%.0f TFLOP/s); 12 blocks fwd+bwd %.1f ms\n",
                  B, T, path ? "batched-GEMM" : "flash", best_f, (mm + 2 * att) / (best_f * 1e-3) / 1e12, best_b,
                  (2 * mm + 4 * att) / (best_b * 1e-3) / 1e12, 12 * (best_f + best_b));
    cudaEventDestroy(e0), cudaEventDestroy(e1), cudaEventDestroy(e2);
    reset();
}

/* Prints the time of one GPT-2 124M block on both attention paths
 * (asserts only finite outputs: speed is for the record). */
static void test_block_gpt2_speed(void **state)
{
    (void)state;
    for (int path = 0; path < 2; path++) {
        attention_path(path);
        block_speed(path);
    }
    attention_path(0);
}

int main(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        fprintf(stderr, "test_ops_cuda: no CUDA device\n");
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_encoder),
        cmocka_unit_test(test_layernorm),
        cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_bias_grad_paths_bit_identical),
        cmocka_unit_test(test_pointwise),
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_attention_gqa),
        cmocka_unit_test(test_attention_packed),
        cmocka_unit_test(test_attention_engines),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_glu),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_llama_attention),
        cmocka_unit_test(test_llama_argument_errors),
        cmocka_unit_test(test_crossentropy),
        cmocka_unit_test(test_head),
        cmocka_unit_test(test_block),
        cmocka_unit_test(test_block_repeats_bit_identical),
        cmocka_unit_test(test_gemm_tuning_same_bits),
        cmocka_unit_test(test_argument_errors),
        cmocka_unit_test(test_block_gpt2_speed),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
