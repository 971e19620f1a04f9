/* LoRA adapters on the CUDA blocks (ops_cuda.h): lora.c's compute on the
 * GPU, four small GEMMs a target with fp32 accumulation, never forming
 * W + s B A.  Row-major (N,K) is column-major (K,N) to cuBLASLt, so with A
 * (R,in), B (rows,R), x (N,in), xa (N,R) and y's rows [row0, row0 + rows)
 * (N,rows) of leading dimension ldy:
 *   xa^T (R,N)       = A^T (R,in) x^T (in,N)            ta=T tb=N m=R    n=N    k=in
 *   y_j^T (rows,N)  += s B (rows,R) xa^T (R,N)          ta=T tb=N m=rows n=N    k=R
 *   dB^T (R,rows)   += s xa^T (R,N) dy_j (N,rows)       ta=N tb=T m=R    n=rows k=N
 *   dxa^T (R,N)      = s B^T (R,rows) dy_j^T (rows,N)   ta=N tb=N m=R    n=N    k=rows
 *   dA^T (in,R)     += x^T (in,N) dxa (N,R)             ta=N tb=T m=in   n=R    k=N
 *   dx^T (in,N)     += A^T (in,R) dxa^T (R,N)           ta=N tb=N m=in   n=N    k=R
 * xa and dxa are stored in dt (fp32, or bf16 in a bf16 run), the adapters'
 * gradients in gdt.
 *
 * Dropout (a key in the acts): one elementwise kernel writes drop(x) =
 * x m/(1-P) into the scratch before the first GEMM, m from lora_mask.h's
 * hash (the CPU reference's bits); backward writes it again for dA, and
 * for dx forms dxa A in the scratch and adds m/(1-P) times it to dx. */
#include "kernels.cuh"
#include "../lora_mask.h"

using namespace tdc;

namespace {

float scale_of(const td_model_desc *cfg) { return cfg->lora.alpha / (float)cfg->lora.rank; }

void *at(const void *p, size_t elems, td_dtype dt) { return (char *)p + elems * dtype_bytes(dt); }

/* The widest input of a target (the dropped input's row width in the scratch). */
int widest_in(const td_model_desc *cfg)
{
    int in = 0;
    for (int j = 0; j < td_model_lora_count(cfg); j++) {
        td_model_lora_target tg;
        td_model_lora_target_get(cfg, j, &tg);
        if (tg.in > in) in = tg.in;
    }
    return in;
}

/* One call's mask: the hash's call key, the rows' samples and positions,
 * P 2^24 and 1/(1-P) (fp32, as lora.c computes them). */
struct Mask {
    uint64_t call;
    int64_t sample0;
    int T;
    float threshold, keep;
};

Mask mask_of(const td_model_desc *cfg, const td_model_lora_drop *k, const td_model_lora_target &tg)
{
    const float p = cfg->lora.dropout;
    return Mask{td_lora_mask_call(k->seed, k->step, k->layer, tg.module_index), k->sample0, k->T, p * 16777216.0f,
                1.0f / (1.0f - p)};
}

/* out (N,in) = m/(1-P) x, or (add) out += m/(1-P) x; fp32 arithmetic, one rounding to T. */
template <typename T>
__global__ void drop_kernel(T *out, const T *x, size_t N, int in, Mask m, int add)
{
    const size_t n = N * (size_t)in;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / (size_t)in;
        const int c = (int)(i - r * (size_t)in);
        const uint64_t row = td_lora_mask_row(m.call, m.sample0 + (int64_t)(r / (size_t)m.T), (int)(r % (size_t)m.T));
        const float v = td_lora_mask_dropped(row, c, m.threshold) ? 0.0f : to_f32(x[i]) * m.keep;
        out[i] = from_f32<T>(add ? to_f32(out[i]) + v : v);
    }
}

td_status drop(td_dtype dt, void *out, const void *x, int N, int in, const Mask &m, int add, cudaStream_t s)
{
    return dispatch(dt, [&](auto t) -> td_status {
        using T = decltype(t);
        const int threads = 256;
        drop_kernel<T><<<grid_for((size_t)N * in, threads), threads, 0, s>>>((T *)out, (const T *)x, (size_t)N, in,
                                                                              m, add);
        return check_launch("LoRA dropout");
    });
}

/* The acts' dropout key when this call drops. */
const td_model_lora_drop *drop_of(const td_model_desc *cfg, const td_ops_cuda_block_acts *a)
{
    return a->lora_drop && cfg->lora.dropout > 0 ? a->lora_drop : nullptr;
}

} // namespace

extern "C" size_t td_ops_cuda_lora_xa_stride(const td_model_desc *cfg, int B, int T, td_dtype dt)
{
    if (!cfg || td_model_lora_count(cfg) == 0 || B <= 0 || T <= 0) return 0;
    return align_up((size_t)B * T * (size_t)cfg->lora.rank * dtype_bytes(dt));
}

extern "C" size_t td_ops_cuda_lora_acts_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt)
{
    return cfg ? (size_t)td_model_lora_count(cfg) * td_ops_cuda_lora_xa_stride(cfg, B, T, dt) : 0;
}

extern "C" size_t td_ops_cuda_lora_scratch_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt)
{
    const size_t dxa = td_ops_cuda_lora_xa_stride(cfg, B, T, dt);
    if (!dxa || !(cfg->lora.dropout > 0)) return dxa;
    return dxa + align_up((size_t)B * T * (size_t)widest_in(cfg) * dtype_bytes(dt));
}

extern "C" int td_ops_cuda_lora_on(const td_model_desc *cfg, td_model_param kind)
{
    const int n = td_model_lora_count(cfg);
    for (int j = 0; j < n; j++) {
        td_model_lora_target tg;
        td_model_lora_target_get(cfg, j, &tg);
        if (tg.kind == kind) return 1;
    }
    return 0;
}

extern "C" td_status td_ops_cuda_lora_forward(td_ops_cuda *ctx, const td_model_desc *cfg, const td_ops_cuda_block *w,
                                              const td_ops_cuda_block_acts *a, td_model_param kind, const void *x,
                                              void *y, int ldy, int N, td_dtype dt, void *scratch, void *stream)
{
    const int n = td_model_lora_count(cfg), R = cfg->lora.rank;
    if (!n) return TD_OK;
    if (!ctx || !w || !a || !a->lora_xa || !x)
        return td_error_set(TD_ERR_INVALID, "LoRA forward: NULL context, adapters, acts or input");
    const td_model_lora_drop *dk = drop_of(cfg, a);
    if (dk && !scratch) return td_error_set(TD_ERR_INVALID, "LoRA forward: dropout without scratch");
    const size_t stride = td_ops_cuda_lora_xa_stride(cfg, 1, N, dt);
    void *xd = dk ? (char *)scratch + stride : nullptr; /* after the backward's dxa, as there */
    const cudaDataType_t type = cuda_type(dt);
    cudaStream_t s = (cudaStream_t)stream;
    for (int j = 0; j < n; j++) {
        td_model_lora_target tg;
        td_model_lora_target_get(cfg, j, &tg);
        if (tg.kind != kind || !w->lora_a[j]) continue;
        if (!w->lora_b[j]) return td_error_set(TD_ERR_INVALID, "LoRA forward: target %d has A but no B", j);
        void *xa = (char *)a->lora_xa + (size_t)j * stride;
        const void *in = x;
        td_status st;
        if (dk) { /* drop(x): the branch's input */
            if ((st = drop(dt, xd, x, N, tg.in, mask_of(cfg, dk, tg), 0, s)) != TD_OK) return st;
            in = xd;
        }
        Gemm g; /* xa = drop(x) A^T */
        g.ta = CUBLAS_OP_T, g.tb = CUBLAS_OP_N, g.m = R, g.n = N, g.k = tg.in;
        g.A = w->lora_a[j], g.lda = tg.in, g.B = in, g.ldb = tg.in;
        g.D = xa, g.ldd = R, g.ab_type = g.d_type = type;
        st = gemm(ctx, g, s, "LoRA forward (x A^T)");
        if (st != TD_OK) return st;
        if (!y) continue; /* a recompute: xa alone */
        Gemm u; /* y[:, rows] += s xa B^T */
        u.ta = CUBLAS_OP_T, u.tb = CUBLAS_OP_N, u.m = tg.rows, u.n = N, u.k = R;
        u.A = w->lora_b[j], u.lda = R, u.B = xa, u.ldb = R;
        u.D = at(y, (size_t)tg.row0, dt), u.C = u.D, u.ldd = ldy, u.ab_type = u.d_type = type;
        u.alpha = scale_of(cfg), u.beta = 1.0f;
        if ((st = gemm(ctx, u, s, "LoRA forward (+ s xa B^T)")) != TD_OK) return st;
    }
    return TD_OK;
}

extern "C" td_status td_ops_cuda_lora_backward(td_ops_cuda *ctx, const td_model_desc *cfg,
                                               const td_ops_cuda_block *w, const td_ops_cuda_block *g,
                                               const td_ops_cuda_block_acts *a, td_model_param kind, const void *x,
                                               const void *dy, int ldy, void *dx, int N, td_dtype dt, td_dtype gdt,
                                               void *scratch, void *stream)
{
    const int n = td_model_lora_count(cfg), R = cfg->lora.rank;
    if (!n) return TD_OK;
    td_status st = check_dtypes("LoRA backward", dt, gdt);
    if (st != TD_OK) return st;
    if (!ctx || !w || !g || !a || !a->lora_xa || !x || !dy || !scratch)
        return td_error_set(TD_ERR_INVALID, "LoRA backward: NULL context, adapters, acts, tensor or scratch");
    const size_t stride = td_ops_cuda_lora_xa_stride(cfg, 1, N, dt);
    const td_model_lora_drop *dk = drop_of(cfg, a);
    void *dxa = scratch, *xd = (char *)scratch + stride; /* xd: with a dropout only */
    const cudaDataType_t type = cuda_type(dt), gtype = cuda_type(gdt);
    const float sc = scale_of(cfg);
    cudaStream_t s = (cudaStream_t)stream;
    for (int j = 0; j < n; j++) {
        td_model_lora_target tg;
        td_model_lora_target_get(cfg, j, &tg);
        if (tg.kind != kind || !w->lora_a[j]) continue;
        const void *xa = (const char *)a->lora_xa + (size_t)j * stride;
        const void *dyj = at(dy, (size_t)tg.row0, dt);
        if (g->lora_b[j]) { /* dB += s dy^T xa */
            Gemm m;
            m.ta = CUBLAS_OP_N, m.tb = CUBLAS_OP_T, m.m = R, m.n = tg.rows, m.k = N;
            m.A = xa, m.lda = R, m.B = dyj, m.ldb = ldy;
            m.D = g->lora_b[j], m.ldd = R, m.ab_type = type, m.d_type = gtype;
            m.alpha = sc, m.beta = 1.0f;
            if ((st = gemm(ctx, m, s, "LoRA backward (dB)")) != TD_OK) return st;
        }
        if (!g->lora_a[j] && !dx) continue;
        Gemm m; /* dxa = s dy B */
        m.ta = CUBLAS_OP_N, m.tb = CUBLAS_OP_N, m.m = R, m.n = N, m.k = tg.rows;
        m.A = w->lora_b[j], m.lda = R, m.B = dyj, m.ldb = ldy;
        m.D = dxa, m.ldd = R, m.ab_type = m.d_type = type;
        m.alpha = sc;
        if ((st = gemm(ctx, m, s, "LoRA backward (dxa)")) != TD_OK) return st;
        const Mask mk = dk ? mask_of(cfg, dk, tg) : Mask{};
        if (g->lora_a[j]) { /* dA += dxa^T drop(x) */
            const void *in = x;
            if (dk) { /* the forward's drop(x), hashed again */
                if ((st = drop(dt, xd, x, N, tg.in, mk, 0, s)) != TD_OK) return st;
                in = xd;
            }
            Gemm u;
            u.ta = CUBLAS_OP_N, u.tb = CUBLAS_OP_T, u.m = tg.in, u.n = R, u.k = N;
            u.A = in, u.lda = tg.in, u.B = dxa, u.ldb = R;
            u.D = g->lora_a[j], u.ldd = tg.in, u.ab_type = type, u.d_type = gtype;
            u.beta = 1.0f;
            if ((st = gemm(ctx, u, s, "LoRA backward (dA)")) != TD_OK) return st;
        }
        if (dx) { /* dx += dxa A, or with a dropout dx += m/(1-P) (dxa A) */
            Gemm u;
            u.ta = CUBLAS_OP_N, u.tb = CUBLAS_OP_N, u.m = tg.in, u.n = N, u.k = R;
            u.A = w->lora_a[j], u.lda = tg.in, u.B = dxa, u.ldb = R;
            u.D = dk ? xd : dx, u.C = dk ? nullptr : dx, u.ldd = tg.in, u.ab_type = u.d_type = type;
            u.beta = dk ? 0.0f : 1.0f;
            if ((st = gemm(ctx, u, s, "LoRA backward (dx)")) != TD_OK) return st;
            if (dk && (st = drop(dt, dx, xd, N, tg.in, mk, 1, s)) != TD_OK) return st;
        }
    }
    return TD_OK;
}
