/* Memory-bound CUDA ops: embedding (encoder), GELU, residual add.
 *
 * Each thread handles 8 consecutive elements with 16-byte loads and stores
 * when every pointer is 16-byte aligned (and, for row-wise ops, the rows
 * are), element by element otherwise; arithmetic in fp32, one rounding at
 * the store.  The GELU is the CPU's formula, x * sigmoid(2u), with expf.
 *
 * The encoder backward must add rows that share a token into one row of dwte
 * without floating-point atomics (determinism): the token ids are sorted
 * (cub's stable radix sort, with the row numbers as values), and each run of
 * equal tokens is summed in ascending row order by one block, 8 channels per
 * thread.  dwpe sums over the batch, one thread per (t, 8 channels); with
 * packed documents (positions given) the positions are sorted the same way
 * and their runs summed into dwpe as the tokens' into dwte. */
#include "kernels.cuh"

#include <cub/device/device_radix_sort.cuh>

namespace tdc {
namespace {

constexpr int kThreads = 256;

/* --- encoder ----------------------------------------------------------------- */

template <typename T>
__global__ void encoder_forward_kernel(T *out, const int *tokens, const int *pos, const T *wte, const T *wpe,
                                       int N, int T_, int C, bool vec)
{
    const size_t groups = (size_t)(C + VN - 1) / VN, total = (size_t)N * groups;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const int n = (int)(idx / groups), c = (int)(idx % groups) * VN, t = pos ? pos[n] : n % T_;
        float e[VN], p[VN];
        load8(e, wte + (size_t)tokens[n] * C, c, C, vec);
        if (wpe) { /* NULL: rotary models have no position table */
            load8(p, wpe + (size_t)t * C, c, C, vec);
#pragma unroll
            for (int j = 0; j < VN; j++) e[j] += p[j];
        }
        store8(out + (size_t)n * C, c, C, vec, e);
    }
}

/* dwpe[t] += sum over b of dout[b,t], b ascending. */
template <typename T, typename G>
__global__ void encoder_dwpe_kernel(G *dwpe, const T *dout, int B, int T_, int C, bool vec)
{
    const size_t groups = (size_t)(C + VN - 1) / VN, total = (size_t)T_ * groups;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(idx / groups), c = (int)(idx % groups) * VN;
        float acc[VN] = {0}, d[VN];
        for (int b = 0; b < B; b++) {
            load8(d, dout + ((size_t)b * T_ + t) * C, c, C, vec);
#pragma unroll
            for (int j = 0; j < VN; j++) acc[j] += d[j];
        }
        G *row = dwpe + (size_t)t * C;
        load8(d, row, c, C, vec);
#pragma unroll
        for (int j = 0; j < VN; j++) d[j] += acc[j];
        store8(row, c, C, vec, d);
    }
}

__global__ void iota_kernel(unsigned *v, int n)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) v[i] = i;
}

/* Block i of the sorted tokens: if it starts a run of equal tokens, adds the
 * run's rows (ascending: the sort is stable) into that token's row of dwte. */
template <typename T, typename G>
__global__ void encoder_dwte_kernel(G *dwte, const T *dout, const unsigned *keys, const unsigned *rows,
                                    int N, int C, bool vec)
{
    const int i = blockIdx.x;
    const unsigned tok = keys[i];
    if (i > 0 && keys[i - 1] == tok) return;
    const int groups = (C + VN - 1) / VN;
    for (int g = blockIdx.y * blockDim.x + threadIdx.x; g < groups; g += gridDim.y * blockDim.x) {
        const int c = g * VN;
        float acc[VN] = {0}, d[VN];
        for (int j = i; j < N && keys[j] == tok; j++) {
            load8(d, dout + (size_t)rows[j] * C, c, C, vec);
#pragma unroll
            for (int q = 0; q < VN; q++) acc[q] += d[q];
        }
        G *row = dwte + (size_t)tok * C;
        load8(d, row, c, C, vec);
#pragma unroll
        for (int q = 0; q < VN; q++) d[q] += acc[q];
        store8(row, c, C, vec, d);
    }
}

/* Bits that hold every token id below Vp. */
int token_bits(int Vp)
{
    int bits = 1;
    while (bits < 31 && (1u << bits) < (unsigned)Vp) bits++;
    return bits;
}

size_t sort_temp_bytes(int N, int Vp)
{
    size_t temp = 0;
    cub::DeviceRadixSort::SortPairs(nullptr, temp, (const unsigned *)nullptr, (unsigned *)nullptr,
                                    (const unsigned *)nullptr, (unsigned *)nullptr, N, 0,
                                    token_bits(Vp));
    return temp;
}

/* --- GELU ------------------------------------------------------------------------ */

template <typename T>
__global__ void gelu_forward_kernel(T *out, const T *inp, size_t n, bool vec)
{
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VN; i < n;
         i += (size_t)gridDim.x * blockDim.x * VN) {
        float x[VN];
        load8(x, inp, i, n, vec);
#pragma unroll
        for (int j = 0; j < VN; j++) x[j] = gelu_tanh(x[j]);
        store8(out, i, n, vec, x);
    }
}

template <typename T, bool ADD>
__global__ void gelu_backward_kernel(T *dinp, const T *inp, const T *dout, size_t n, bool vec)
{
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VN; i < n;
         i += (size_t)gridDim.x * blockDim.x * VN) {
        float x[VN], d[VN], acc[VN];
        load8(x, inp, i, n, vec);
        load8(d, dout, i, n, vec);
        if (ADD) load8(acc, dinp, i, n, vec);
#pragma unroll
        for (int j = 0; j < VN; j++) {
            const float grad = gelu_tanh_grad(x[j]);
            d[j] = ADD ? acc[j] + grad * d[j] : grad * d[j];
        }
        store8(dinp, i, n, vec, d);
    }
}

/* --- scale ------------------------------------------------------------------------ */

template <typename T>
__global__ void scale_kernel(T *out, const T *inp, float sc, size_t n, bool vec)
{
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VN; i < n;
         i += (size_t)gridDim.x * blockDim.x * VN) {
        float x[VN];
        load8(x, inp, i, n, vec);
#pragma unroll
        for (int j = 0; j < VN; j++) x[j] *= sc;
        store8(out, i, n, vec, x);
    }
}

/* --- residual -------------------------------------------------------------------- */

template <typename T>
__global__ void add_kernel(T *out, const T *a, const T *b, size_t n, bool vec)
{
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VN; i < n;
         i += (size_t)gridDim.x * blockDim.x * VN) {
        float x[VN], y[VN];
        load8(x, a, i, n, vec);
        load8(y, b, i, n, vec);
#pragma unroll
        for (int j = 0; j < VN; j++) x[j] += y[j];
        store8(out, i, n, vec, x);
    }
}

unsigned pack_grid(size_t n) { return grid_for((n + VN - 1) / VN, kThreads); }

} // namespace

/* Shared with the block: out = a + b (any of them may alias). */
td_status add(td_dtype dt, void *out, const void *a, const void *b, size_t n, cudaStream_t s)
{
    if (n == 0) return TD_OK;
    const bool vec = aligned16(out) && aligned16(a) && aligned16(b);
    return dispatch(dt, [&](auto tag) {
        using T = decltype(tag);
        add_kernel<T><<<pack_grid(n), kThreads, 0, s>>>((T *)out, (const T *)a, (const T *)b, n, vec);
        return check_launch("residual add");
    });
}

} // namespace tdc

using namespace tdc;

extern "C" td_status td_ops_cuda_encoder_forward(void *out, const int *tokens, const int *pos, const void *wte,
                                                 const void *wpe, int B, int T, int C, td_dtype dt,
                                                 void *stream)
{
    td_status st = check_dtype("encoder forward", dt);
    if (st != TD_OK) return st;
    if (B <= 0 || T <= 0 || C <= 0) return TD_OK;
    if (!out || !tokens || !wte) /* wpe NULL: no position term (rotary models) */
        return td_error_set(TD_ERR_INVALID, "encoder forward: NULL tensor");
    const bool vec = C % VN == 0 && aligned16(out) && aligned16(wte) && (!wpe || aligned16(wpe));
    const int N = B * T;
    cudaStream_t s = (cudaStream_t)stream;
    return dispatch(dt, [&](auto tag) {
        using X = decltype(tag);
        encoder_forward_kernel<X><<<grid_for((size_t)N * ((C + VN - 1) / VN), kThreads), kThreads, 0, s>>>(
            (X *)out, tokens, pos, (const X *)wte, (const X *)wpe, N, T, C, vec);
        return check_launch("encoder forward");
    });
}

/* Scratch: sorted keys, row ids in and out, cub's temporary storage. */
extern "C" size_t td_ops_cuda_encoder_scratch_bytes(int B, int T, int Vp)
{
    const int N = B * T;
    if (N <= 0) return 0;
    return 3 * align_up((size_t)N * sizeof(unsigned)) + align_up(sort_temp_bytes(N, Vp > T ? Vp : T));
}

extern "C" td_status td_ops_cuda_encoder_backward(void *dwte, void *dwpe, const void *dout,
                                                  const int *tokens, const int *pos, int B, int T, int C, int Vp,
                                                  td_dtype dt, td_dtype gdt, void *scratch,
                                                  size_t scratch_bytes, void *stream)
{
    td_status st = check_dtypes("encoder backward", dt, gdt);
    if (st != TD_OK) return st;
    if (B <= 0 || T <= 0 || C <= 0) return TD_OK;
    if (!dout || !tokens) /* dwpe NULL: no position table (rotary models) or frozen; dwte NULL: frozen */
        return td_error_set(TD_ERR_INVALID, "encoder backward: NULL tensor");
    if (!dwte) {
        if (!dwpe) return TD_OK;
        const bool vec = C % VN == 0 && aligned16(dwpe) && aligned16(dout);
        return dispatch2(dt, gdt, [&](auto tt, auto gt) {
            using X = decltype(tt);
            using G = decltype(gt);
            const int groups = (C + VN - 1) / VN;
            encoder_dwpe_kernel<X, G><<<grid_for((size_t)T * groups, kThreads), kThreads, 0, (cudaStream_t)stream>>>(
                (G *)dwpe, (const X *)dout, B, T, C, vec);
            return check_launch("encoder backward (dwpe)");
        });
    }
    st = check_scratch("encoder backward", scratch, scratch_bytes,
                       td_ops_cuda_encoder_scratch_bytes(B, T, Vp));
    if (st != TD_OK) return st;
    const int N = B * T;
    cudaStream_t s = (cudaStream_t)stream;
    Carve cv{(char *)scratch, scratch_bytes};
    unsigned *keys = (unsigned *)cv.take((size_t)N * sizeof(unsigned));
    unsigned *rows_in = (unsigned *)cv.take((size_t)N * sizeof(unsigned));
    unsigned *rows = (unsigned *)cv.take((size_t)N * sizeof(unsigned));
    size_t temp_bytes = sort_temp_bytes(N, Vp > T ? Vp : T);
    void *temp = cv.take(temp_bytes);
    const bool vec = C % VN == 0 && aligned16(dwte) && (!dwpe || aligned16(dwpe)) && aligned16(dout);

    iota_kernel<<<grid_for(N, kThreads), kThreads, 0, s>>>(rows_in, N);
    st = check_launch("encoder backward (row ids)");
    if (st != TD_OK) return st;
    st = check_cuda(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, (const unsigned *)tokens, keys,
                                                    rows_in, rows, N, 0, token_bits(Vp), s),
                    "encoder backward: radix sort of the tokens");
    if (st != TD_OK) return st;
    return dispatch2(dt, gdt, [&](auto tt, auto gt) {
        using X = decltype(tt);
        using G = decltype(gt);
        const int groups = (C + VN - 1) / VN;
        if (dwpe && !pos) {
            encoder_dwpe_kernel<X, G><<<grid_for((size_t)T * groups, kThreads), kThreads, 0, s>>>(
                (G *)dwpe, (const X *)dout, B, T, C, vec);
            td_status st2 = check_launch("encoder backward (dwpe)");
            if (st2 != TD_OK) return st2;
        }
        const int threads = 128;
        dim3 grid(N, (groups + threads - 1) / threads);
        encoder_dwte_kernel<X, G><<<grid, threads, 0, s>>>((G *)dwte, (const X *)dout, keys, rows, N, C,
                                                           vec);
        td_status st2 = check_launch("encoder backward (dwte)");
        if (st2 != TD_OK || !dwpe || !pos) return st2;
        /* packed documents: the rows of each position, the same way (the
         * buffers are free again: the dwte kernel ran first on this stream) */
        st2 = check_cuda(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, (const unsigned *)pos, keys, rows_in, rows,
                                                         N, 0, token_bits(T), s),
                         "encoder backward: radix sort of the positions");
        if (st2 != TD_OK) return st2;
        encoder_dwte_kernel<X, G><<<grid, threads, 0, s>>>((G *)dwpe, (const X *)dout, keys, rows, N, C, vec);
        return check_launch("encoder backward (dwpe)");
    });
}

extern "C" td_status td_ops_cuda_scale(void *out, const void *inp, float sc, size_t n, td_dtype dt, void *stream)
{
    td_status st = check_dtype("scale", dt);
    if (st != TD_OK || n == 0) return st;
    if (!out || !inp) return td_error_set(TD_ERR_INVALID, "scale: NULL tensor");
    const bool vec = aligned16(out) && aligned16(inp);
    cudaStream_t s = (cudaStream_t)stream;
    return dispatch(dt, [&](auto tag) {
        using X = decltype(tag);
        scale_kernel<X><<<pack_grid(n), kThreads, 0, s>>>((X *)out, (const X *)inp, sc, n, vec);
        return check_launch("scale");
    });
}

extern "C" td_status td_ops_cuda_gelu_forward(void *out, const void *inp, size_t n, td_dtype dt,
                                              void *stream)
{
    td_status st = check_dtype("gelu forward", dt);
    if (st != TD_OK || n == 0) return st;
    if (!out || !inp) return td_error_set(TD_ERR_INVALID, "gelu forward: NULL tensor");
    const bool vec = aligned16(out) && aligned16(inp);
    cudaStream_t s = (cudaStream_t)stream;
    return dispatch(dt, [&](auto tag) {
        using X = decltype(tag);
        gelu_forward_kernel<X><<<pack_grid(n), kThreads, 0, s>>>((X *)out, (const X *)inp, n, vec);
        return check_launch("gelu forward");
    });
}

extern "C" td_status td_ops_cuda_gelu_backward(void *dinp, const void *inp, const void *dout, size_t n,
                                               td_ops_cuda_write mode, td_dtype dt, void *stream)
{
    td_status st = check_dtype("gelu backward", dt);
    if (st != TD_OK || n == 0) return st;
    if (!dinp || !inp || !dout) return td_error_set(TD_ERR_INVALID, "gelu backward: NULL tensor");
    if (mode == TD_OPS_CUDA_ADD && dinp == dout)
        return td_error_set(TD_ERR_INVALID, "gelu backward: dinp may be dout only with TD_OPS_CUDA_SET");
    const bool vec = aligned16(dinp) && aligned16(inp) && aligned16(dout);
    cudaStream_t s = (cudaStream_t)stream;
    return dispatch(dt, [&](auto tag) {
        using X = decltype(tag);
        if (mode == TD_OPS_CUDA_ADD)
            gelu_backward_kernel<X, true><<<pack_grid(n), kThreads, 0, s>>>((X *)dinp, (const X *)inp,
                                                                            (const X *)dout, n, vec);
        else
            gelu_backward_kernel<X, false><<<pack_grid(n), kThreads, 0, s>>>((X *)dinp, (const X *)inp,
                                                                             (const X *)dout, n, vec);
        return check_launch("gelu backward");
    });
}

extern "C" td_status td_ops_cuda_residual_forward(void *out, const void *a, const void *b, size_t n,
                                                  td_dtype dt, void *stream)
{
    td_status st = check_dtype("residual forward", dt);
    if (st != TD_OK || n == 0) return st;
    if (!out || !a || !b) return td_error_set(TD_ERR_INVALID, "residual forward: NULL tensor");
    return add(dt, out, a, b, n, (cudaStream_t)stream);
}

extern "C" td_status td_ops_cuda_residual_backward(void *da, void *db, const void *dout, size_t n,
                                                   td_dtype dt, void *stream)
{
    td_status st = check_dtype("residual backward", dt);
    if (st != TD_OK || n == 0) return st;
    if (!dout) return td_error_set(TD_ERR_INVALID, "residual backward: NULL dout");
    if (da) st = add(dt, da, da, dout, n, (cudaStream_t)stream);
    if (st == TD_OK && db) st = add(dt, db, db, dout, n, (cudaStream_t)stream);
    return st;
}
