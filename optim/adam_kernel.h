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
 *   vi: VW int32 lanes; vi_set1 vi_add vi_sub vi_and vi_or (wrapping),
 *   vi_srli vi_slli (logical shifts), vi_min vi_max (signed), vi_hmax,
 *   vi_as_vf vf_as_vi (bit casts), vf_from_vi (int -> float, RNE), vf_add,
 *   vi_select_flt(a, b, x, y) = a < b ? x : y (float compare, false for NaN),
 *   vi_select_ilt(a, b, x, y) = a < b ? x : y (signed compare),
 *   vi_load_u8 / vi_store_u8 (VW bytes <-> lanes holding 0..255),
 *   vi_mul (low 32 bits), vi_xor, vi_iota(i) = {i, i+1, ...}, vi_to_vh (lanes 0..65535)
 *   vs_t vs_zero vs_add_sq vs_total                  (double sum of squares)
 * Every instance performs the same IEEE operations in the same order, so
 * they agree bit for bit (the CUDA kernel in adam.cu does the same too).
 *
 * Dtype combinations, the decay mode, streaming and the state type (fp32,
 * bf16, int8 moments) are specialised by calling the always-inline loop with
 * constants from a switch: one source, 42 x 3 straight loops.  AdamW's loops do not touch the L2 term at all (0 * Inf would turn
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
#define TD_PDT_NONE TD_DTYPE_COUNT /* no param output */
#define QB TD_ADAM_INT8_BLOCK

typedef struct kcoeffs {
    vf grad_mul, l2, decay_mul, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, rsqrt_bc2, eps;
    vi sr_seed;
} kcoeffs;

TD_KINLINE vf load_grad(const void *g, int dt, size_t i)
{
    if (dt == TD_DTYPE_BF16) return vf_load_bf16((const uint16_t *)g + i);
    if (dt == TD_DTYPE_F16) return vf_load_f16((const uint16_t *)g + i);
    return vf_loadu((const float *)g + i);
}

TD_KINLINE void store_param(void *p, int dt, int nt, size_t i, vf x)
{
    if (dt == TD_DTYPE_BF16) {
        if (nt) vh_stream((uint16_t *)p + i, vf_to_bf16(x));
        else vh_storeu((uint16_t *)p + i, vf_to_bf16(x));
    } else if (dt == TD_DTYPE_F16) {
        if (nt) vh_stream((uint16_t *)p + i, vf_to_f16(x));
        else vh_storeu((uint16_t *)p + i, vf_to_f16(x));
    } else if (dt == TD_DTYPE_F32) {
        if (nt) vf_stream((float *)p + i, x);
        else vf_storeu((float *)p + i, x);
    }
}

/* ---- the int8 moment codes ---------------------------------------------------
 * A block's values x are scaled by the block's absmax A (so |y| <= 1, see
 * q8_normalizer) and y is rounded to nearest-even in a small float format with 3 mantissa bits
 * and no Inf/NaN, whose largest exponent is 2^0: m as sign + E4M3 (bias 15,
 * normals down to 2^-14, subnormal step 2^-17), v (never negative) as E5M3
 * (bias 31, normals down to 2^-30, subnormal step 2^-33).  Every value keeps
 * 3 significant bits down to 2^-14 (m) or 2^-30 (v) of its block's largest,
 * the dynamic-exponent idea of Dettmers et al.; v gets the wider range
 * because it holds squares (sqrt(v) then spans what m spans).  Encoding is
 * the fp32 -> fp16 trick: for normals, rebias the exponent and round the
 * mantissa with integer adds on the bit pattern; for subnormals, one float
 * add of a power of two whose ulp is the subnormal step lets the FPU round.
 * Codes above the one of 1.0 (8 * bias) are never produced.  Decoding is the
 * reverse, exact, then one multiply by A.  All integer or correctly rounded
 * IEEE operations: every instance gives the same bits (and so does the
 * CUDA kernel, which mirrors these lines). */
#define Q8_BIAS_M 15
#define Q8_BIAS_V 31

static inline float q8_pow2(int e)
{
    union { uint32_t u; float f; } c = {(uint32_t)(127 + e) << 23};
    return c.f;
}

/* y in [0, 1] (or NaN: the largest code) -> magnitude code, a normal y's
 * mantissa cut to 3 bits after `carry` (< 2^20) is added to the 20 dropped
 * bits; a subnormal y rounds to nearest even through the FPU. */
TD_KINLINE vi q8_encode_carry(vf y, int bias, vi carry)
{
    vi b = vf_as_vi(y);
    vi normal = vi_srli(vi_add(vi_sub(b, vi_set1((127 - bias) << 23)), carry), 20);
    normal = vi_min(normal, vi_set1(bias << 3));
    vf magic = vf_set1(q8_pow2(21 - bias)); /* its ulp is the subnormal step 2^(-2-bias) */
    vi sub = vi_sub(vf_as_vi(vf_add(y, magic)), vf_as_vi(magic));
    return vi_select_flt(y, vf_set1(q8_pow2(1 - bias)), sub, normal);
}

/* Rounded to nearest even: the carry is half a step, less one when the
 * kept mantissa is even. */
TD_KINLINE vi q8_encode(vf y, int bias)
{
    vi half = vi_add(vi_set1((1 << 19) - 1), vi_and(vi_srli(vf_as_vi(y), 20), vi_set1(1)));
    return q8_encode_carry(y, bias, half);
}

/* Rounded stochastically: a normal y goes up with probability equal to the
 * dropped fraction of its code step (the top 20 of rnd's 32 random bits are
 * the carry).  v moves by (1 - beta2) = 0.1% a step, far less than half a
 * code step (up to 6.25%): rounded to nearest it moved only with its
 * block's absmax, and a v that shrank under a steady absmax stayed high;
 * rounded so, it is right on average, as bf16 v is.  Subnormal codes
 * (below 2^(1-bias) of the absmax) still round to nearest.  Integer ops:
 * every instance and the GPU give the same bits. */
TD_KINLINE vi q8_encode_sr(vf y, int bias, vi rnd) { return q8_encode_carry(y, bias, vi_srli(rnd, 12)); }

/* Magnitude code -> value in [0, 1], exact. */
TD_KINLINE vf q8_decode(vi c, int bias)
{
    vi normal = vi_add(vi_slli(c, 20), vi_set1((127 - bias) << 23));
    vi sub = vf_as_vi(vf_mul(vf_from_vi(c), vf_set1(q8_pow2(-2 - bias))));
    return vi_as_vf(vi_select_ilt(c, vi_set1(8), sub, normal));
}

TD_KINLINE vf q8_load_m(const uint8_t *codes, vf scale)
{
    vi c = vi_load_u8(codes);
    vf x = vf_mul(q8_decode(vi_and(c, vi_set1(0x7f)), Q8_BIAS_M), scale);
    return vi_as_vf(vi_or(vf_as_vi(x), vi_slli(vi_and(c, vi_set1(0x80)), 24)));
}

TD_KINLINE vf q8_load_v(const uint8_t *codes, vf scale) { return vf_mul(q8_decode(vi_load_u8(codes), Q8_BIAS_V), scale); }

TD_KINLINE vi abs_bits(vf x) { return vi_and(vf_as_vi(x), vi_set1(0x7fffffff)); }

/* How a block's values are scaled into [0, 1]: y = |x| * (1 / A) when the
 * reciprocal of the absmax A is a normal float (2^-126 <= A <= 2^126), one
 * multiply instead of a divide per element; y = |x| / A otherwise (huge,
 * subnormal or non-finite A); y = |x| * 1 = 0 for an all-zero block.  The
 * choice depends on A alone, so every instance (and the GPU) makes it the
 * same way.  Returns 1 to multiply by *factor, 0 to divide by it. */
static inline int q8_normalizer(int32_t absmax_bits, float *scale, float *factor)
{
    union { int32_t i; float f; } a = {absmax_bits};
    *scale = a.f;
    if (absmax_bits == 0) return *factor = 1.0f, 1;
    if (absmax_bits >= 0x00800000 && absmax_bits <= 0x7e800000) return *factor = 1.0f / a.f, 1;
    return *factor = a.f, 0;
}

TD_KINLINE vf q8_normalize(vf x, vf factor, int mul)
{
    vf ax = vi_as_vf(abs_bits(x));
    return mul ? vf_mul(ax, factor) : vf_div(ax, factor);
}

TD_KINLINE void q8_store_m(uint8_t *codes, vf x, vf factor, int mul)
{
    vi sign = vi_srli(vi_and(vf_as_vi(x), vi_set1((int32_t)0x80000000u)), 24);
    vi_store_u8(codes, vi_or(q8_encode(q8_normalize(x, factor, mul), Q8_BIAS_M), sign));
}

TD_KINLINE void q8_store_v(uint8_t *codes, vf x, vf factor, int mul)
{
    vi_store_u8(codes, q8_encode(q8_normalize(x, factor, mul), Q8_BIAS_V));
}

/* v's codes in an update: stochastically rounded (q8_encode_sr). */
TD_KINLINE void q8_store_v_sr(uint8_t *codes, vf x, vf factor, int mul, vi rnd)
{
    vi_store_u8(codes, q8_encode_sr(q8_normalize(x, factor, mul), Q8_BIAS_V, rnd));
}

/* The int8 layout of one moment buffer of `numel` elements: codes, then
 * (after padding to 4 bytes) the block scales. */
static inline unsigned char *q8_scales(void *moment, size_t numel)
{
    return (unsigned char *)moment + ((numel + 3) & ~(size_t)3);
}

static inline float load_f32(const unsigned char *p)
{
    float x;
    memcpy(&x, p, 4);
    return x;
}

/* ---- the update ------------------------------------------------------------- */

/* VW elements.  The formulas, in order (docs/optimizer.md):
 *   g  = grad * grad_mul                      unscale and clip
 *   g  = l2*p + g                             Adam's L2 (not in AdamW loops)
 *   p  = p * decay_mul                        AdamW's decay (1 for Adam)
 *   m  = beta1*m + (1-beta1)*g
 *   v  = beta2*v + ((1-beta2)*g)*g
 *   d  = sqrt(v)*rsqrt_bc2 + eps
 *   p  = p - step_size*(m/d)                                              */
TD_KINLINE void adam_math(const kcoeffs *k, int l2, vf graw, vf *p, vf *m, vf *v)
{
    vf g = vf_mul(graw, k->grad_mul);
    if (l2) g = vf_fma(k->l2, *p, g);
    *p = vf_mul(*p, k->decay_mul);
    *m = vf_fma(k->beta1, *m, vf_mul(k->one_minus_beta1, g));
    *v = vf_fma(k->beta2, *v, vf_mul(vf_mul(k->one_minus_beta2, g), g));
    vf d = vf_fma(vf_sqrt(*v), k->rsqrt_bc2, k->eps);
    *p = vf_fnma(k->step_size, vf_div(*m, d), *p);
}

/* ---- bf16 v: stochastic rounding --------------------------------------------
 * v = beta2*v + ... moves v by (1 - beta2) = 0.1% a step, less than half a
 * bf16 step (2^-9 relative): rounded to nearest, a decaying v would never
 * move.  Rounded up with probability equal to the dropped fraction, it is
 * right on average.  The random 16 bits come from a hash (lowbias32) of the
 * element's index in its chunk and the step's seed, so the result is a
 * function of the inputs, the same on every ISA, team size and the GPU. */
TD_KINLINE vi sr_bits(vi seed, size_t idx)
{
    vi x = vi_xor(vi_iota((uint32_t)idx), seed);
    x = vi_xor(x, vi_srli(x, 16));
    x = vi_mul(x, vi_set1(0x7feb352d));
    x = vi_xor(x, vi_srli(x, 15));
    x = vi_mul(x, vi_set1((int32_t)0x846ca68bu));
    return vi_xor(x, vi_srli(x, 16));
}

TD_KINLINE vh bf16_round_stochastic(vf x, vi rnd)
{
    vi u = vf_as_vi(x);
    vi r = vi_srli(vi_add(u, vi_srli(rnd, 16)), 16); /* the magnitude truncated after a random carry */
    vi nan = vi_or(vi_srli(u, 16), vi_set1(0x40));   /* NaN stays NaN, quiet, as vf_to_bf16 keeps it */
    return vi_to_vh(vi_select_ilt(vi_set1(0x7f800000), vi_and(u, vi_set1(0x7fffffff)), nan, r));
}

/* fp32 or bf16 moments (ST), VW elements at index i. */
TD_KINLINE vf load_moment(const void *s, int st, size_t i)
{
    if (st == TD_OPTIM_STATE_BF16) return vf_load_bf16((const uint16_t *)s + i);
    return vf_loadu((const float *)s + i);
}

TD_KINLINE void store_moment(void *s, int st, size_t i, vf x)
{
    if (st == TD_OPTIM_STATE_BF16) vh_storeu((uint16_t *)s + i, vf_to_bf16(x));
    else vf_storeu((float *)s + i, x);
}

/* idx: the chunk index of element i (they differ in the tail's local copy). */
TD_KINLINE void adam_block(const kcoeffs *k, int l2, float *master, void *m, void *v, const void *grad, int gdt,
                           void *out, int pdt, int nt, int st, size_t i, size_t idx)
{
    vf g = load_grad(grad, gdt, i);
    vf p = vf_loadu(master + i);
    vf mm = load_moment(m, st, i);
    vf vv = load_moment(v, st, i);
    adam_math(k, l2, g, &p, &mm, &vv);
    store_moment(m, st, i, mm);
    if (st == TD_OPTIM_STATE_BF16) vh_storeu((uint16_t *)v + i, bf16_round_stochastic(vv, sr_bits(k->sr_seed, idx)));
    else store_moment(v, st, i, vv);
    vf_storeu(master + i, p);
    store_param(out, pdt, nt, i, p);
}

TD_KINLINE void adam_loop(const kcoeffs *k, int l2, const td_adam_chunk *ch, int gdt, int pdt, int nt, int st,
                          size_t begin, size_t end)
{
    float *master = ch->master;
    void *m = ch->m, *v = ch->v;
    const void *grad = ch->grad;
    void *out = ch->param_out;
    size_t i = begin;
    for (; i + VW <= end; i += VW) adam_block(k, l2, master, m, v, grad, gdt, out, pdt, nt, st, i, i);
    if (nt) stream_fence(); /* streamed lines are visible before the caller moves on */
    if (i == end) return;
    size_t n = end - i, gsz = gdt == TD_DTYPE_F32 ? 4 : 2, psz = pdt == TD_DTYPE_F32 ? 4 : 2;
    size_t msz = st == TD_OPTIM_STATE_BF16 ? 2 : 4;
    float lp[VW] = {0}, lm[VW] = {0}, lv[VW] = {0}; /* moments as bytes of their type, zero-padded */
    unsigned char lg[VW * 4] = {0}, lo[VW * 4];
    memcpy(lp, master + i, n * 4);
    memcpy(lm, (unsigned char *)m + i * msz, n * msz);
    memcpy(lv, (unsigned char *)v + i * msz, n * msz);
    memcpy(lg, (const unsigned char *)grad + i * gsz, n * gsz);
    adam_block(k, l2, lp, lm, lv, lg, gdt, lo, pdt, 0, st, 0, i);
    memcpy(master + i, lp, n * 4);
    memcpy((unsigned char *)m + i * msz, lm, n * msz);
    memcpy((unsigned char *)v + i * msz, lv, n * msz);
    if (pdt != TD_PDT_NONE) memcpy((unsigned char *)out + i * psz, lo, n * psz);
}

/* ---- no-decay ranges (td_adam_chunk.no_decay) --------------------------------
 * A thread's range is processed in segments between range boundaries, each
 * a straight vector loop with its own coefficients (the step's, or the
 * step's with decay_mul 1 and no L2 term): no per-element branch, and with
 * no ranges one segment, the loop of before. */

/* The first range that ends after element i (n when none). */
static inline int range_after(const td_adam_range *r, int n, size_t i)
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (r[mid].end <= i) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* The segment [i, *seg_end) of [i, end): 1 when it decays, 0 when it lies
 * in a no-decay range.  *at: a cursor from range_after, moved forward. */
static inline int range_segment(const td_adam_range *r, int n, int *at, size_t i, size_t end, size_t *seg_end)
{
    while (*at < n && r[*at].end <= i) (*at)++;
    if (*at == n || r[*at].begin >= end) return *seg_end = end, 1;
    if (r[*at].begin > i) return *seg_end = r[*at].begin, 1;
    *seg_end = r[*at].end < end ? r[*at].end : end;
    return 0;
}

/* ---- int8 state ------------------------------------------------------------- */

/* New m and v of one block (tm, tv: QB values, zeros past a partial block's
 * end) into codes and scales: the absmax is a max of the bit patterns,
 * order-free, NaN wins.  m rounds to nearest, v stochastically with the
 * bits of each element's chunk index (idx: the block's first) and the
 * step's seed, as bf16 v does. */
TD_KINLINE void q8_requant(const float *tm, const float *tv, uint8_t *mc, uint8_t *vc, unsigned char *sm,
                           unsigned char *sv, vi am, vi av, vi seed, size_t idx)
{
    float new_m, new_v, fm, fv;
    int mul_m = q8_normalizer(vi_hmax(am), &new_m, &fm), mul_v = q8_normalizer(vi_hmax(av), &new_v, &fv);
    vf factor_m = vf_set1(fm), factor_v = vf_set1(fv);
    for (size_t j = 0; j < QB; j += VW) {
        q8_store_m(mc + j, vf_loadu(tm + j), factor_m, mul_m);
        q8_store_v_sr(vc + j, vf_loadu(tv + j), factor_v, mul_v, sr_bits(seed, idx + j));
    }
    memcpy(sm, &new_m, 4);
    memcpy(sv, &new_v, 4);
}

/* One int8 scale block of QB elements, all with the same coefficients:
 * dequantize, update, keep the new m and v in L1 while their absmax is
 * found, requantize.  Pointers are at the block's first element; sm, sv at
 * its scales; idx: that element's chunk index. */
TD_KINLINE void q8_block(const kcoeffs *k, int l2, float *master, uint8_t *mc, uint8_t *vc, unsigned char *sm,
                         unsigned char *sv, const void *grad, int gdt, void *out, int pdt, int nt, size_t idx)
{
    float tm[QB] __attribute__((aligned(64))), tv[QB] __attribute__((aligned(64)));
    vf scale_m = vf_set1(load_f32(sm)), scale_v = vf_set1(load_f32(sv));
    vi am = vi_set1(0), av = vi_set1(0);
    for (size_t j = 0; j < QB; j += VW) {
        vf p = vf_loadu(master + j);
        vf mm = q8_load_m(mc + j, scale_m), vv = q8_load_v(vc + j, scale_v);
        adam_math(k, l2, load_grad(grad, gdt, j), &p, &mm, &vv);
        vf_storeu(master + j, p);
        store_param(out, pdt, nt, j, p);
        vf_storeu(tm + j, mm);
        vf_storeu(tv + j, vv);
        am = vi_max(am, abs_bits(mm));
        av = vi_max(av, abs_bits(vv));
    }
    q8_requant(tm, tv, mc, vc, sm, sv, am, av, k->sr_seed, idx);
}

/* A block that straddles a no-decay boundary (base: the chunk index of its
 * first element; at: the range cursor there): dequantized whole into fp32,
 * updated by segments with each segment's coefficients (the fp32 loop: the
 * same operations as q8_block's, element for element), requantized whole.
 * One out-of-line copy with run-time dtypes: such blocks are few (two per
 * range at most), and 42 inlined copies would only grow the code. */
static __attribute__((noinline)) void q8_block_ranges(const kcoeffs *k, const kcoeffs *knd, int l2, float *master, uint8_t *mc,
                                uint8_t *vc, unsigned char *sm, unsigned char *sv, const void *grad, int gdt,
                                void *out, int pdt, const td_adam_range *rg, int nr, int at, size_t base)
{
    float tm[QB] __attribute__((aligned(64))), tv[QB] __attribute__((aligned(64)));
    vf scale_m = vf_set1(load_f32(sm)), scale_v = vf_set1(load_f32(sv));
    for (size_t j = 0; j < QB; j += VW) {
        vf_storeu(tm + j, q8_load_m(mc + j, scale_m));
        vf_storeu(tv + j, q8_load_v(vc + j, scale_v));
    }
    td_adam_chunk f = {0};
    f.master = master;
    f.m = tm;
    f.v = tv;
    f.grad = grad;
    f.param_out = out;
    for (size_t i = 0; i < QB;) {
        size_t se;
        int dec = range_segment(rg, nr, &at, base + i, base + QB, &se);
        se -= base;
        if (dec) adam_loop(k, l2, &f, gdt, pdt, 0, TD_OPTIM_STATE_FP32, i, se);
        else adam_loop(knd, 0, &f, gdt, pdt, 0, TD_OPTIM_STATE_FP32, i, se);
        i = se;
    }
    vi am = vi_set1(0), av = vi_set1(0);
    for (size_t j = 0; j < QB; j += VW) {
        am = vi_max(am, abs_bits(vf_loadu(tm + j)));
        av = vi_max(av, abs_bits(vf_loadu(tv + j)));
    }
    q8_requant(tm, tv, mc, vc, sm, sv, am, av, k->sr_seed, base);
}

/* Block [i, i + QB) (pointers at i): with one set of coefficients when no
 * boundary crosses it, else by segments.  *at: the range cursor. */
TD_KINLINE void q8_any_block(const kcoeffs *k, const kcoeffs *knd, int l2, const td_adam_range *rg, int nr, int *at,
                             size_t i, float *master, uint8_t *mc, uint8_t *vc, unsigned char *sm, unsigned char *sv,
                             const void *grad, int gdt, void *out, int pdt, int nt)
{
    size_t se = i + QB;
    int dec = nr ? range_segment(rg, nr, at, i, i + QB, &se) : 1;
    if (se < i + QB) q8_block_ranges(k, knd, l2, master, mc, vc, sm, sv, grad, gdt, out, pdt, rg, nr, *at, i);
    else if (dec) q8_block(k, l2, master, mc, vc, sm, sv, grad, gdt, out, pdt, nt, i);
    else q8_block(knd, 0, master, mc, vc, sm, sv, grad, gdt, out, pdt, nt, i);
}

TD_KINLINE void q8_loop(const kcoeffs *k, const kcoeffs *knd, int l2, const td_adam_chunk *ch, int gdt, int pdt,
                        int nt, size_t begin, size_t end)
{
    size_t gsz = gdt == TD_DTYPE_F32 ? 4 : 2, psz = pdt == TD_DTYPE_F32 ? 4 : 2;
    uint8_t *mc = ch->m, *vc = ch->v;
    unsigned char *sm = q8_scales(ch->m, ch->numel), *sv = q8_scales(ch->v, ch->numel);
    const unsigned char *grad = ch->grad;
    unsigned char *out = ch->param_out;
    const td_adam_range *rg = ch->no_decay;
    int nr = ch->n_no_decay, at = nr ? range_after(rg, nr, begin) : 0;
    size_t i = begin;
    for (; i + QB <= end; i += QB)
        q8_any_block(k, knd, l2, rg, nr, &at, i, ch->master + i, mc + i, vc + i, sm + i / QB * 4, sv + i / QB * 4,
                     grad + i * gsz, gdt, out + i * psz, pdt, nt);
    if (nt) stream_fence();
    if (i == end) return;
    /* The chunk's last, partial block, through zero-padded copies: zeros
     * stay zero and do not change the absmax (padding is never in a
     * no-decay range, which ends by numel). */
    size_t n = end - i;
    float lp[QB] = {0};
    uint8_t lm[QB] = {0}, lv[QB] = {0};
    unsigned char lg[QB * 4] = {0}, lo[QB * 4], lsm[4], lsv[4];
    memcpy(lp, ch->master + i, n * 4);
    memcpy(lm, mc + i, n);
    memcpy(lv, vc + i, n);
    memcpy(lsm, sm + i / QB * 4, 4);
    memcpy(lsv, sv + i / QB * 4, 4);
    memcpy(lg, grad + i * gsz, n * gsz);
    q8_any_block(k, knd, l2, rg, nr, &at, i, lp, lm, lv, lsm, lsv, lg, gdt, lo, pdt, 0);
    memcpy(ch->master + i, lp, n * 4);
    memcpy(mc + i, lm, n);
    memcpy(vc + i, lv, n);
    memcpy(sm + i / QB * 4, lsm, 4);
    memcpy(sv + i / QB * 4, lsv, 4);
    if (pdt != TD_PDT_NONE) memcpy(out + i * psz, lo, n * psz);
}

TD_KINLINE void adam_run(const kcoeffs *k, const kcoeffs *knd, int l2, const td_adam_chunk *ch, int gdt, int pdt,
                         int nt, size_t begin, size_t end)
{
    switch (ch->state) {
    case TD_OPTIM_STATE_BF16: adam_loop(k, l2, ch, gdt, pdt, nt, TD_OPTIM_STATE_BF16, begin, end); break;
    case TD_OPTIM_STATE_INT8: q8_loop(k, knd, l2, ch, gdt, pdt, nt, begin, end); break;
    default: adam_loop(k, l2, ch, gdt, pdt, nt, TD_OPTIM_STATE_FP32, begin, end); break;
    }
}

/* One specialisation of the loops per combination of streaming stores (n),
 * decay (l), grad dtype (g) and param output dtype (p), each a function of
 * its own: in one function the 42 x 3 inlined loops cost GCC's inliner
 * minutes a file.  The coefficients are copied to locals first: the loops'
 * stores (vector types may alias anything) cannot reach them, so they stay
 * in registers. */
enum { AK_F32 = TD_DTYPE_F32, AK_BF16 = TD_DTYPE_BF16, AK_F16 = TD_DTYPE_F16, AK_NONE = TD_PDT_NONE };
#define TD_ADAM_CASE_FN(n, l, g, p)                                                                            \
    static __attribute__((noinline)) void adam_case_##n##_##l##_##g##_##p(const kcoeffs *kp, const kcoeffs *kndp, \
                                                                         const td_adam_chunk *ch, size_t begin, \
                                                                         size_t end)                            \
    {                                                                                                           \
        const kcoeffs kl = *kp, kndl = *kndp;                                                                   \
        adam_run(&kl, &kndl, (l), ch, AK_##g, AK_##p, (n), begin, end);                                         \
    }
#define TD_ADAM_CASE_FNS(n, l)                                                                                 \
    TD_ADAM_CASE_FN(n, l, F32, F32) TD_ADAM_CASE_FN(n, l, F32, BF16) TD_ADAM_CASE_FN(n, l, F32, F16)           \
    TD_ADAM_CASE_FN(n, l, BF16, F32) TD_ADAM_CASE_FN(n, l, BF16, BF16) TD_ADAM_CASE_FN(n, l, BF16, F16)        \
    TD_ADAM_CASE_FN(n, l, F16, F32) TD_ADAM_CASE_FN(n, l, F16, BF16) TD_ADAM_CASE_FN(n, l, F16, F16)
TD_ADAM_CASE_FNS(0, 0)
TD_ADAM_CASE_FNS(0, 1)
#if TD_NT_BYTES
TD_ADAM_CASE_FNS(1, 0)
TD_ADAM_CASE_FNS(1, 1)
#endif
TD_ADAM_CASE_FN(0, 0, F32, NONE) TD_ADAM_CASE_FN(0, 0, BF16, NONE) TD_ADAM_CASE_FN(0, 0, F16, NONE)
TD_ADAM_CASE_FN(0, 1, F32, NONE) TD_ADAM_CASE_FN(0, 1, BF16, NONE) TD_ADAM_CASE_FN(0, 1, F16, NONE)
#undef TD_ADAM_CASE_FNS
#undef TD_ADAM_CASE_FN

/* Elements [begin, end) with coefficients k (knd: without decay, for the
 * int8 blocks that straddle a no-decay boundary). */
static void update_segment(const kcoeffs *k, const kcoeffs *knd, int l2, const td_adam_chunk *ch, size_t begin,
                           size_t end)
{
    int pdt = ch->param_out ? (int)ch->param_dtype : TD_PDT_NONE;
#if TD_NT_BYTES
    /* Streaming stores where the segment's first output is aligned: every
     * thread range of a chunk without no-decay ranges, since their bounds
     * are multiples of 1024 elements. */
    size_t psz = pdt == TD_DTYPE_F32 ? 4 : 2;
    int nt = pdt != TD_PDT_NONE && ch->param_out != (void *)ch->master &&
             ((uintptr_t)ch->param_out + begin * psz) % (TD_NT_BYTES * (pdt == TD_DTYPE_F32 ? 2 : 1)) == 0;
#else
    int nt = 0;
#endif
#define TD_ADAM_CASE(n, l, g, p) \
    case (((n) * 2 + (l)) * 4 + AK_##g) * 4 + AK_##p: adam_case_##n##_##l##_##g##_##p(k, knd, ch, begin, end); break;
#define TD_ADAM_CASES(n, l)                                                                                   \
    TD_ADAM_CASE(n, l, F32, F32) TD_ADAM_CASE(n, l, F32, BF16) TD_ADAM_CASE(n, l, F32, F16)                  \
    TD_ADAM_CASE(n, l, BF16, F32) TD_ADAM_CASE(n, l, BF16, BF16) TD_ADAM_CASE(n, l, BF16, F16)               \
    TD_ADAM_CASE(n, l, F16, F32) TD_ADAM_CASE(n, l, F16, BF16) TD_ADAM_CASE(n, l, F16, F16)
    switch (((nt * 2 + l2) * 4 + (int)ch->grad_dtype) * 4 + pdt) {
        TD_ADAM_CASES(0, 0)
        TD_ADAM_CASES(0, 1)
#if TD_NT_BYTES
        TD_ADAM_CASES(1, 0)
        TD_ADAM_CASES(1, 1)
#endif
        TD_ADAM_CASE(0, 0, F32, NONE) TD_ADAM_CASE(0, 0, BF16, NONE) TD_ADAM_CASE(0, 0, F16, NONE)
        TD_ADAM_CASE(0, 1, F32, NONE) TD_ADAM_CASE(0, 1, BF16, NONE) TD_ADAM_CASE(0, 1, F16, NONE)
    default: break; /* dtypes are checked by the callers */
    }
#undef TD_ADAM_CASES
#undef TD_ADAM_CASE
}

static void kernel_update(const td_adam_coeffs *c, const td_adam_chunk *ch, size_t begin, size_t end)
{
    kcoeffs k = {
        vf_set1(c->grad_mul), vf_set1(c->l2),    vf_set1(c->decay_mul),       vf_set1(c->beta1),
        vf_set1(c->one_minus_beta1), vf_set1(c->beta2), vf_set1(c->one_minus_beta2), vf_set1(c->step_size),
        vf_set1(c->rsqrt_bc2), vf_set1(c->eps), vi_set1((int32_t)c->sr_seed),
    };
    kcoeffs knd = k; /* no decay: what td_adam_coeffs_make gives for weight_decay 0 */
    knd.l2 = vf_set1(0.0f);
    knd.decay_mul = vf_set1(1.0f);
    int l2 = c->l2 != 0.0f;
    /* int8 cuts by scale blocks itself (q8_loop). */
    if (!ch->n_no_decay || ch->state == TD_OPTIM_STATE_INT8) {
        update_segment(&k, &knd, l2, ch, begin, end);
        return;
    }
    int at = range_after(ch->no_decay, ch->n_no_decay, begin);
    for (size_t i = begin; i < end;) {
        size_t se;
        if (range_segment(ch->no_decay, ch->n_no_decay, &at, i, end, &se)) update_segment(&k, &knd, l2, ch, i, se);
        else update_segment(&knd, &knd, 0, ch, i, se);
        i = se;
    }
}

/* ---- moments to and from fp32 (td_adam_moment_write / _read) ---------------
 * The update's codes and scales, rounded to nearest: the same bits as an
 * update leaves for the same values, except v's, which an update rounds
 * stochastically (bf16 and int8).  Elements [begin, end) of the moment as
 * in the update (int8: whole blocks, end may be numel); x holds their
 * values from x[0] (element begin). */
static void kernel_moment_store(td_optim_state st, int is_v, const float *x, void *buf, size_t numel, size_t begin,
                                size_t end)
{
    if (st == TD_OPTIM_STATE_INT8) {
        unsigned char *scales = q8_scales(buf, numel);
        for (size_t b = begin; b < end; b += QB) {
            size_t n = end - b < QB ? end - b : QB;
            float t[QB] = {0};
            uint8_t codes[QB];
            memcpy(t, x + (b - begin), n * 4);
            vi a = vi_set1(0);
            for (size_t j = 0; j < QB; j += VW) a = vi_max(a, abs_bits(vf_loadu(t + j)));
            float scale, f;
            int mul = q8_normalizer(vi_hmax(a), &scale, &f);
            vf factor = vf_set1(f);
            for (size_t j = 0; j < QB; j += VW) {
                if (is_v) q8_store_v(codes + j, vf_loadu(t + j), factor, mul);
                else q8_store_m(codes + j, vf_loadu(t + j), factor, mul);
            }
            memcpy((uint8_t *)buf + b, codes, n);
            memcpy(scales + b / QB * 4, &scale, 4);
        }
        return;
    }
    size_t i = begin;
    for (; i + VW <= end; i += VW) store_moment(buf, st, i, vf_loadu(x + (i - begin)));
    for (; i < end; i++) {
        float t[VW] = {x[i - begin]}, o[VW];
        store_moment(o, st, 0, vf_loadu(t));
        if (st == TD_OPTIM_STATE_BF16) memcpy((uint16_t *)buf + i, o, 2);
        else ((float *)buf)[i] = o[0];
    }
}

static void kernel_moment_load(td_optim_state st, int is_v, const void *buf, size_t numel, float *x, size_t begin,
                               size_t end)
{
    if (st == TD_OPTIM_STATE_INT8) {
        const unsigned char *scales = q8_scales((void *)buf, numel);
        for (size_t b = begin; b < end; b += QB) {
            size_t n = end - b < QB ? end - b : QB;
            uint8_t codes[QB] = {0};
            float t[QB];
            memcpy(codes, (const uint8_t *)buf + b, n);
            vf scale = vf_set1(load_f32(scales + b / QB * 4));
            for (size_t j = 0; j < QB; j += VW)
                vf_storeu(t + j, is_v ? q8_load_v(codes + j, scale) : q8_load_m(codes + j, scale));
            memcpy(x + (b - begin), t, n * 4);
        }
        return;
    }
    size_t i = begin;
    for (; i + VW <= end; i += VW) vf_storeu(x + (i - begin), load_moment(buf, st, i));
    for (; i < end; i++) {
        unsigned char t[VW * 4] = {0};
        float o[VW];
        memcpy(t, (const unsigned char *)buf + i * (st == TD_OPTIM_STATE_BF16 ? 2 : 4), st == TD_OPTIM_STATE_BF16 ? 2 : 4);
        vf_storeu(o, load_moment(t, st, 0));
        x[i - begin] = o[0];
    }
}

TD_KINLINE double sumsq_loop(const void *grad, int gdt, size_t begin, size_t end)
{
    vs_t s = vs_zero();
    size_t i = begin;
    for (; i + VW <= end; i += VW) vs_add_sq(&s, load_grad(grad, gdt, i));
    if (i < end) {
        size_t gsz = gdt == TD_DTYPE_F32 ? 4 : 2;
        unsigned char lg[VW * 4] = {0};
        memcpy(lg, (const unsigned char *)grad + i * gsz, (end - i) * gsz);
        vs_add_sq(&s, load_grad(lg, gdt, 0));
    }
    return vs_total(&s);
}

static double kernel_sumsq(const void *grad, td_dtype dt, size_t begin, size_t end)
{
    switch (dt) {
    case TD_DTYPE_BF16: return sumsq_loop(grad, TD_DTYPE_BF16, begin, end);
    case TD_DTYPE_F16: return sumsq_loop(grad, TD_DTYPE_F16, begin, end);
    default: return sumsq_loop(grad, TD_DTYPE_F32, begin, end);
    }
}

const td_adam_kernels TD_KERNEL_TABLE = {kernel_update, kernel_sumsq, kernel_moment_store, kernel_moment_load};
