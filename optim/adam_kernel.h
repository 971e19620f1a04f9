/* The one definition of the CPU AdamW kernel and the grad sum-of-squares
 * kernel, instantiated once per instruction set by adam_scalar.c,
 * adam_avx2.c and adam_avx512.c.
 *
 * The including file defines, for a vector of VW floats:
 *   TD_KERNEL_TABLE                 name of the td_adam_kernels to define
 *   VW, vf                          lanes and vector type
 *   vf_set1 vf_loadu vf_storeu vf_mul vf_div vf_sqrt
 *   vf_fma(a, b, c) = a*b + c,  vf_fnma(a, b, c) = c - a*b   (one rounding)
 *   vf_load_bf16 vf_load_f16                         (exact)
 *   vh, vf_to_bf16 vf_to_f16 (RNE), vh_storeu vh_stream vf_stream stream_fence,
 *   TD_NT_BYTES: the alignment streaming stores need (0: none)
 *   vs_t vs_zero vs_add_sq vs_total                  (double sum of squares)
 * Every instance performs the same IEEE operations in the same order, so
 * they agree bit for bit (the CUDA kernel in adam.cu does the same too).
 *
 * Dtype combinations, the decay mode and streaming are specialised by
 * calling the always-inline loop with constants from a switch: one source,
 * 42 straight loops.  AdamW's loops do not touch the L2 term at all (0 * Inf would turn
 * an Inf param into NaN where torch keeps it Inf).
 * The tail (fewer than VW elements) goes through small zero-padded local
 * buffers, so every element takes the same vector path.
 *
 * The param output (the pinned upload buffer, read next by the copy engine's
 * DMA, not by this CPU) is written with streaming stores when its address
 * allows: no read-for-ownership of lines about to be overwritten (2 of the
 * mixed path's 28 bytes per param) and no eviction of the state streams
 * from the cache.  Partition bounds are multiples of 1024 elements, so every
 * thread's range keeps the alignment of the chunk's base. */
#include "adam_impl.h"

#include <string.h>

#define TD_KINLINE static inline __attribute__((always_inline))
#define TD_PDT_NONE TD_OPTIM_DTYPE_COUNT /* no param output */

typedef struct kcoeffs {
    vf grad_mul, l2, decay_mul, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, rsqrt_bc2, eps;
} kcoeffs;

TD_KINLINE vf load_grad(const void *g, int dt, size_t i)
{
    if (dt == TD_OPTIM_DTYPE_BF16) return vf_load_bf16((const uint16_t *)g + i);
    if (dt == TD_OPTIM_DTYPE_F16) return vf_load_f16((const uint16_t *)g + i);
    return vf_loadu((const float *)g + i);
}

TD_KINLINE void store_param(void *p, int dt, int nt, size_t i, vf x)
{
    if (dt == TD_OPTIM_DTYPE_BF16) {
        if (nt) vh_stream((uint16_t *)p + i, vf_to_bf16(x));
        else vh_storeu((uint16_t *)p + i, vf_to_bf16(x));
    } else if (dt == TD_OPTIM_DTYPE_F16) {
        if (nt) vh_stream((uint16_t *)p + i, vf_to_f16(x));
        else vh_storeu((uint16_t *)p + i, vf_to_f16(x));
    } else if (dt == TD_OPTIM_DTYPE_F32) {
        if (nt) vf_stream((float *)p + i, x);
        else vf_storeu((float *)p + i, x);
    }
}

/* VW elements at index i.  The formulas, in order (docs/optimizer.md):
 *   g  = grad * grad_mul                      unscale and clip
 *   g  = l2*p + g                             Adam's L2 (not in AdamW loops)
 *   p  = p * decay_mul                        AdamW's decay (1 for Adam)
 *   m  = beta1*m + (1-beta1)*g
 *   v  = beta2*v + ((1-beta2)*g)*g
 *   d  = sqrt(v)*rsqrt_bc2 + eps
 *   p  = p - step_size*(m/d)                                              */
TD_KINLINE void adam_block(const kcoeffs *k, int l2, float *master, float *m, float *v, const void *grad, int gdt,
                           void *out, int pdt, int nt, size_t i)
{
    vf g = vf_mul(load_grad(grad, gdt, i), k->grad_mul);
    vf p = vf_loadu(master + i);
    vf mm = vf_loadu(m + i);
    vf vv = vf_loadu(v + i);
    if (l2) g = vf_fma(k->l2, p, g);
    p = vf_mul(p, k->decay_mul);
    mm = vf_fma(k->beta1, mm, vf_mul(k->one_minus_beta1, g));
    vv = vf_fma(k->beta2, vv, vf_mul(vf_mul(k->one_minus_beta2, g), g));
    vf d = vf_fma(vf_sqrt(vv), k->rsqrt_bc2, k->eps);
    p = vf_fnma(k->step_size, vf_div(mm, d), p);
    vf_storeu(m + i, mm);
    vf_storeu(v + i, vv);
    vf_storeu(master + i, p);
    store_param(out, pdt, nt, i, p);
}

TD_KINLINE void adam_loop(const kcoeffs *k, int l2, const td_adam_chunk *ch, int gdt, int pdt, int nt,
                          size_t begin, size_t end)
{
    float *master = ch->master, *m = ch->m, *v = ch->v;
    const void *grad = ch->grad;
    void *out = ch->param_out;
    size_t i = begin;
    for (; i + VW <= end; i += VW) adam_block(k, l2, master, m, v, grad, gdt, out, pdt, nt, i);
    if (nt) stream_fence(); /* streamed lines are visible before the caller moves on */
    if (i == end) return;
    size_t n = end - i, gsz = gdt == TD_OPTIM_DTYPE_F32 ? 4 : 2, psz = pdt == TD_OPTIM_DTYPE_F32 ? 4 : 2;
    float lp[VW] = {0}, lm[VW] = {0}, lv[VW] = {0};
    unsigned char lg[VW * 4] = {0}, lo[VW * 4];
    memcpy(lp, master + i, n * 4);
    memcpy(lm, m + i, n * 4);
    memcpy(lv, v + i, n * 4);
    memcpy(lg, (const unsigned char *)grad + i * gsz, n * gsz);
    adam_block(k, l2, lp, lm, lv, lg, gdt, lo, pdt, 0, 0);
    memcpy(master + i, lp, n * 4);
    memcpy(m + i, lm, n * 4);
    memcpy(v + i, lv, n * 4);
    if (pdt != TD_PDT_NONE) memcpy((unsigned char *)out + i * psz, lo, n * psz);
}

static void kernel_update(const td_adam_coeffs *c, const td_adam_chunk *ch, size_t begin, size_t end)
{
    kcoeffs k = {
        vf_set1(c->grad_mul), vf_set1(c->l2),    vf_set1(c->decay_mul),       vf_set1(c->beta1),
        vf_set1(c->one_minus_beta1), vf_set1(c->beta2), vf_set1(c->one_minus_beta2), vf_set1(c->step_size),
        vf_set1(c->rsqrt_bc2), vf_set1(c->eps),
    };
    int pdt = ch->param_out ? (int)ch->param_dtype : TD_PDT_NONE;
    int l2 = c->l2 != 0.0f;
#if TD_NT_BYTES
    int nt = pdt != TD_PDT_NONE && ch->param_out != (void *)ch->master &&
             (uintptr_t)ch->param_out % (TD_NT_BYTES * (pdt == TD_OPTIM_DTYPE_F32 ? 2 : 1)) == 0;
#else
    int nt = 0;
#endif
    enum { F32 = TD_OPTIM_DTYPE_F32, BF16 = TD_OPTIM_DTYPE_BF16, F16 = TD_OPTIM_DTYPE_F16, NONE = TD_PDT_NONE };
#define TD_ADAM_CASE(n, l, g, p) \
    case (((n) * 2 + (l)) * 4 + (g)) * 4 + (p): adam_loop(&k, (l), ch, (g), (p), (n), begin, end); break;
#define TD_ADAM_CASES(n, l)                                                                                   \
    TD_ADAM_CASE(n, l, F32, F32) TD_ADAM_CASE(n, l, F32, BF16) TD_ADAM_CASE(n, l, F32, F16)                  \
    TD_ADAM_CASE(n, l, BF16, F32) TD_ADAM_CASE(n, l, BF16, BF16) TD_ADAM_CASE(n, l, BF16, F16)               \
    TD_ADAM_CASE(n, l, F16, F32) TD_ADAM_CASE(n, l, F16, BF16) TD_ADAM_CASE(n, l, F16, F16)
    switch (((nt * 2 + l2) * 4 + (int)ch->grad_dtype) * 4 + pdt) {
        TD_ADAM_CASES(0, 0)
        TD_ADAM_CASES(0, 1)
        TD_ADAM_CASES(1, 0)
        TD_ADAM_CASES(1, 1)
        TD_ADAM_CASE(0, 0, F32, NONE) TD_ADAM_CASE(0, 0, BF16, NONE) TD_ADAM_CASE(0, 0, F16, NONE)
        TD_ADAM_CASE(0, 1, F32, NONE) TD_ADAM_CASE(0, 1, BF16, NONE) TD_ADAM_CASE(0, 1, F16, NONE)
    default: break; /* dtypes are checked by the callers */
    }
#undef TD_ADAM_CASES
#undef TD_ADAM_CASE
}

TD_KINLINE double sumsq_loop(const void *grad, int gdt, size_t begin, size_t end)
{
    vs_t s = vs_zero();
    size_t i = begin;
    for (; i + VW <= end; i += VW) vs_add_sq(&s, load_grad(grad, gdt, i));
    if (i < end) {
        size_t gsz = gdt == TD_OPTIM_DTYPE_F32 ? 4 : 2;
        unsigned char lg[VW * 4] = {0};
        memcpy(lg, (const unsigned char *)grad + i * gsz, (end - i) * gsz);
        vs_add_sq(&s, load_grad(lg, gdt, 0));
    }
    return vs_total(&s);
}

static double kernel_sumsq(const void *grad, td_optim_dtype dt, size_t begin, size_t end)
{
    switch (dt) {
    case TD_OPTIM_DTYPE_BF16: return sumsq_loop(grad, TD_OPTIM_DTYPE_BF16, begin, end);
    case TD_OPTIM_DTYPE_F16: return sumsq_loop(grad, TD_OPTIM_DTYPE_F16, begin, end);
    default: return sumsq_loop(grad, TD_OPTIM_DTYPE_F32, begin, end);
    }
}

const td_adam_kernels TD_KERNEL_TABLE = {kernel_update, kernel_sumsq};
