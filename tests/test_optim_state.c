/* Compact AdamW state (--optim-state bf16 | int8) against definitions written
 * here, independently of the kernels:
 *   - the int8 codes: a table of every code's value from the format's
 *     definition (sign + E4M3 for m, E5M3 for v, largest code 1.0) and a
 *     nearest-even search over it for m, a stochastic one for v; bf16 m by
 *     frexp/nearbyint in double, bf16 v's stochastic rounding from its hash,
 *     written here;
 *   - every step of a random problem (sizes not multiples of the block,
 *     1-3 chunks, misaligned buffers, grads fp32/bf16/fp16, Adam and AdamW,
 *     clipping, loss scale) against a double-precision step from the same
 *     quantized state: the params within a propagated fp32 error bound, and
 *     each new code inside the codes the reference value can round to given
 *     that bound (rounding is monotone), the block scales within it;
 *   - every ISA and team size bit-identical, tails and partial blocks;
 *   - round trips (all-zero blocks, huge, tiny and subnormal magnitudes) within
 *     half a code step, first touch zeroing compact state, errors;
 *   - quality: 3000 AdamW steps on a noisy least-squares problem end within
 *     1% of the fp32-state loss with bf16 and with int8 state. */
#include "td_test.h"
#include "tidal/optim.h"
#include "tidal/convert.h"
#include "tidal/trainer.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QB TD_ADAM_INT8_BLOCK
#define STEPS 12
#define EPS_F ((double)FLT_EPSILON)

static double uniform(td_rng *r, double lo, double hi) { return lo + (hi - lo) * td_rng_uniform(r); }

/* ---- the reference codes ----------------------------------------------------- */

enum { BIAS_M = 15, BIAS_V = 31 };

/* Value of magnitude code c: e = c >> 3, f = c & 7; e = 0: f * 2^(-2-bias)
 * (subnormal), else (8 + f) * 2^(e - bias - 3); the largest code is 8*bias (1.0). */
static double code_value(int bias, int c)
{
    int e = c >> 3, f = c & 7;
    return e == 0 ? ldexp(f, -2 - bias) : ldexp(8 + f, e - bias - 3);
}

static int code_max(int bias) { return bias * 8; }

/* Nearest magnitude code to y >= 0 (ties to the even code); y > 1 -> max. */
static int code_nearest(int bias, double y)
{
    int lo = 0, hi = code_max(bias);
    if (!(y < 1.0)) return hi;
    while (hi - lo > 1) { /* largest c with value(c) <= y */
        int mid = (lo + hi) / 2;
        if (code_value(bias, mid) <= y) lo = mid;
        else hi = mid;
    }
    double dl = y - code_value(bias, lo), dh = code_value(bias, lo + 1) - y;
    if (dl < dh) return lo;
    if (dh < dl) return lo + 1;
    return lo % 2 ? lo + 1 : lo;
}

static float f32_of_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float scale_of(const void *mom, size_t numel, size_t block)
{
    float s;
    memcpy(&s, (const unsigned char *)mom + ((numel + 3) & ~(size_t)3) + block * 4, 4);
    return s;
}

/* Element i of a moment buffer, decoded by this file's definition (double). */
static double ref_load(td_optim_state st, int is_v, const void *mom, size_t numel, size_t i)
{
    if (st == TD_OPTIM_STATE_FP32) return ((const float *)mom)[i];
    if (st == TD_OPTIM_STATE_BF16) {
        uint16_t h;
        memcpy(&h, (const uint16_t *)mom + i, 2);
        return f32_of_bits((uint32_t)h << 16);
    }
    int c = ((const uint8_t *)mom)[i];
    double s = scale_of(mom, numel, i / QB);
    if (is_v) return (double)(float)(code_value(BIAS_V, c) * s); /* one fp32 rounding of an exact product */
    double x = (double)(float)(code_value(BIAS_M, c & 0x7f) * s);
    return c & 0x80 ? -x : x;
}

/* Round-to-nearest-even of a double to bf16 precision (8 significant bits). */
static double bf16_round(double x)
{
    if (x == 0 || !isfinite(x)) return x;
    int e;
    double f = frexp(x, &e);
    return ldexp(nearbyint(ldexp(f, 8)), e - 8);
}

/* The stochastic rounding of bf16 v, from its definition: the step's seed
 * is lowbias32(t * 0x9e3779b9 + 0x6a09e667), element i's 16 random bits the
 * top of lowbias32(i ^ seed); x is rounded away from zero when its dropped
 * fraction (in units of 2^-16 bf16 ulp) plus those bits carries. */
static uint32_t lowbias32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

static uint32_t sr_seed(long t) { return lowbias32((uint32_t)t * 0x9e3779b9u + 0x6a09e667u); }

static double bf16_round_sr(double x, uint32_t r16)
{
    if (x == 0 || !isfinite(x)) return x;
    int e;
    double f = frexp(fabs(x), &e), lo = ldexp(floor(ldexp(f, 8)), e - 8), ulp = ldexp(1, e - 8);
    double frac = (fabs(x) - lo) / ulp, y = frac * 65536 >= 65536.0 - r16 ? lo + ulp : lo;
    return x < 0 ? -y : y;
}

/* v's int8 code in an update, from its definition: below the first normal
 * code's value, the nearest code; from there, y between the codes lo and
 * lo + 1 (a fraction f of the step between them) goes to lo + 1 when f *
 * 2^20 plus the top 20 random bits r20 reaches 2^20; y >= 1 -> max.
 * Monotone in y for fixed r20, so [code(y_lo), code(y_hi)] bounds the
 * kernel's code as it does for nearest rounding. */
static int code_sr(int bias, double y, uint32_t r20)
{
    if (!(y < 1.0)) return code_max(bias);
    if (y < code_value(bias, 8)) return code_nearest(bias, y);
    int lo = 8, hi = code_max(bias);
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (code_value(bias, mid) <= y) lo = mid;
        else hi = mid;
    }
    double f = (y - code_value(bias, lo)) / (code_value(bias, lo + 1) - code_value(bias, lo));
    return f * 1048576.0 + (double)r20 >= 1048576.0 ? lo + 1 : lo;
}

/* ---- random problems ---------------------------------------------------------- */

typedef struct problem {
    td_optim_state state;
    size_t n;
    int n_chunks;
    size_t chunk_n[3], chunk_off[3];
    td_optim_params op;
    td_dtype gdt, pdt;
    int has_out;
    float *p0;
    void *grads[STEPS];
    float *master;
    void *out, *out_mem;
    void *m_mem[3], *v_mem[3], *m[3], *v[3];
    td_adam_range nd[3][8]; /* per chunk: no-decay ranges (chunk indices) */
    int n_nd[3];
} problem;

/* Random no-decay ranges of a chunk of n elements: boundaries anywhere
 * (inside int8 scale blocks, at their edges, at 0 and n), 0 to 8 ranges. */
static int random_ranges(td_rng *r, size_t n, td_adam_range *out)
{
    if (n == 0 || td_rng_below(r, 4) == 0) return 0;
    size_t pts[16];
    int k = 2 * (1 + (int)td_rng_below(r, 8));
    for (int i = 0; i < k; i++) {
        int how = (int)td_rng_below(r, 4);
        size_t x = td_rng_below(r, n + 1);
        if (how == 0) x = x / QB * QB; /* a block edge */
        pts[i] = how == 1 ? (td_rng_below(r, 2) ? 0 : n) : x;
    }
    for (int i = 1; i < k; i++) /* insertion sort */
        for (int j = i; j > 0 && pts[j - 1] > pts[j]; j--) {
            size_t t = pts[j];
            pts[j] = pts[j - 1];
            pts[j - 1] = t;
        }
    int m = 0;
    for (int i = 0; i < k; i += 2)
        if (pts[i] < pts[i + 1] && (m == 0 || pts[i] >= out[m - 1].end)) out[m++] = (td_adam_range){pts[i], pts[i + 1]};
    return m;
}

static int in_ranges(const td_adam_range *r, int n, size_t i)
{
    for (int j = 0; j < n; j++)
        if (i >= r[j].begin && i < r[j].end) return 1;
    return 0;
}

static void problem_make(problem *pb, td_optim_state state, uint64_t seed)
{
    td_rng r;
    td_rng_seed(&r, seed);
    memset(pb, 0, sizeof *pb);
    pb->state = state;
    /* Sizes around block and partition multiples, and random ones. */
    static const size_t odd[] = {1, 3, 255, 256, 257, 1023, 1024, 1025, 2048 + 100, 4096 + 7};
    pb->n = td_rng_below(&r, 2) ? odd[td_rng_below(&r, 10)] : 1 + td_rng_below(&r, 6000);
    pb->n_chunks = 1 + (int)td_rng_below(&r, 3);
    size_t left = pb->n, off = 0;
    for (int j = 0; j < pb->n_chunks; j++) {
        pb->chunk_n[j] = j == pb->n_chunks - 1 ? left : td_rng_below(&r, left + 1);
        pb->chunk_off[j] = off;
        off += pb->chunk_n[j];
        left -= pb->chunk_n[j];
    }
    td_optim_params *op = &pb->op;
    *op = td_optim_default_params();
    op->state = state;
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
    /* Grad magnitudes vary by element over ~6 decades (blocks with small and
     * large members), plus a whole-problem scale. */
    double gscale = pow(10, uniform(&r, -3, 0.5));
    float *emag = malloc(pb->n * 4);
    for (size_t i = 0; i < pb->n; i++) emag[i] = (float)pow(10, td_rng_below(&r, 3) ? uniform(&r, -1, 0) : uniform(&r, -6, 0));
    pb->p0 = malloc(pb->n * 4);
    for (size_t i = 0; i < pb->n; i++) pb->p0[i] = (float)uniform(&r, -1, 1);
    for (int s = 0; s < STEPS; s++) {
        pb->grads[s] = malloc(pb->n * 4);
        for (size_t i = 0; i < pb->n; i++) {
            double g = uniform(&r, -1, 1) * emag[i] * gscale * op->scaler.init_scale;
            if (td_rng_below(&r, 50) == 0) g = 0; /* exact zeros */
            td_test_store_as(pb->grads[s], pb->gdt, i, (float)g);
        }
    }
    free(emag);
    pb->master = malloc(pb->n * 4 + 4);
    pb->out_mem = aligned_alloc(64, td_align_up((pb->n + 16) * 4, 64));
    pb->out = (float *)pb->out_mem + (td_rng_below(&r, 2) ? 0 : 1 + td_rng_below(&r, 15));
    /* Moment buffers per chunk (each carries its own scales), misaligned:
     * int8 at odd byte offsets, bf16 at odd 2-byte offsets. */
    for (int j = 0; j < pb->n_chunks; j++) {
        size_t bytes = td_adam_moment_bytes(state, pb->chunk_n[j]);
        size_t shift = state == TD_OPTIM_STATE_INT8 ? 1 + td_rng_below(&r, 3) : state == TD_OPTIM_STATE_BF16 ? 2 : 4;
        pb->m_mem[j] = malloc(bytes + 8);
        pb->v_mem[j] = malloc(bytes + 8);
        pb->m[j] = (char *)pb->m_mem[j] + shift;
        pb->v[j] = (char *)pb->v_mem[j] + shift;
    }
    for (int j = 0; j < pb->n_chunks; j++) pb->n_nd[j] = random_ranges(&r, pb->chunk_n[j], pb->nd[j]);
}

static void problem_free(problem *pb)
{
    free(pb->p0);
    for (int s = 0; s < STEPS; s++) free(pb->grads[s]);
    free(pb->master);
    free(pb->out_mem);
    for (int j = 0; j < pb->n_chunks; j++) free(pb->m_mem[j]), free(pb->v_mem[j]);
}

static void problem_chunks(problem *pb, int s, td_adam_chunk *ch)
{
    size_t osz = td_dtype_bytes(pb->pdt), gsz = td_dtype_bytes(pb->gdt);
    for (int j = 0; j < pb->n_chunks; j++) {
        size_t off = pb->chunk_off[j];
        ch[j] = (td_adam_chunk){.master = pb->master + off, .m = pb->m[j], .v = pb->v[j],
                                .grad = (char *)pb->grads[s] + off * gsz, .grad_dtype = pb->gdt,
                                .param_out = pb->has_out ? (char *)pb->out + off * osz : NULL,
                                .param_dtype = pb->pdt, .numel = pb->chunk_n[j], .state = pb->state,
                                .no_decay = pb->n_nd[j] ? pb->nd[j] : NULL, .n_no_decay = pb->n_nd[j]};
    }
}

/* The state before a step, for the reference. */
typedef struct snapshot {
    float *master;
    void *m[3], *v[3];
} snapshot;

static void snapshot_take(const problem *pb, snapshot *sn)
{
    sn->master = malloc(pb->n * 4 + 4);
    memcpy(sn->master, pb->master, pb->n * 4);
    for (int j = 0; j < pb->n_chunks; j++) {
        size_t bytes = td_adam_moment_bytes(pb->state, pb->chunk_n[j]);
        sn->m[j] = malloc(bytes + 1), sn->v[j] = malloc(bytes + 1);
        memcpy(sn->m[j], pb->m[j], bytes);
        memcpy(sn->v[j], pb->v[j], bytes);
    }
}

static void snapshot_free(const problem *pb, snapshot *sn)
{
    free(sn->master);
    for (int j = 0; j < pb->n_chunks; j++) free(sn->m[j]), free(sn->v[j]);
}

/* Checks a new moment value stored by the kernel against the reference x
 * (double, before requantization) whose fp32 computation may be off by err
 * (and the block's absmax A by err_a): rounding is monotone, so the stored
 * value lies between the roundings of x - err and x + err. */
static int moment_ok(td_optim_state st, int is_v, const void *mom, size_t numel, size_t i, double x, double err,
                     double a_ref, double err_a, uint32_t seed, char *why, size_t why_len)
{
    double got = ref_load(st, is_v, mom, numel, i);
    if (st == TD_OPTIM_STATE_BF16) {
        uint32_t r16 = lowbias32((uint32_t)i ^ seed) >> 16;
        double lo = is_v ? bf16_round_sr(x - err, r16) : bf16_round(x - err);
        double hi = is_v ? bf16_round_sr(x + err, r16) : bf16_round(x + err);
        if (got >= lo && got <= hi) return 1;
        snprintf(why, why_len, "bf16 %.9g outside [%.9g, %.9g] (ref %.12g +- %.3g)", got, lo, hi, x, err);
        return 0;
    }
    int bias = is_v ? BIAS_V : BIAS_M, c = ((const uint8_t *)mom)[i], mag = is_v ? c : c & 0x7f;
    if (a_ref == 0) {
        if (mag == 0) return 1;
        snprintf(why, why_len, "code %d in an all-zero block", c);
        return 0;
    }
    /* y = |m| * (1/A) in fp32: two more roundings. */
    double ax = fabs(x), ylo = (ax - err) / (a_ref + err_a) * (1 - 2 * EPS_F);
    double yhi = a_ref > err_a ? (ax + err) / (a_ref - err_a) * (1 + 2 * EPS_F) : 1.0;
    uint32_t r20 = lowbias32((uint32_t)i ^ seed) >> 12;
    int clo = is_v ? code_sr(bias, ylo > 0 ? ylo : 0, r20) : code_nearest(bias, ylo > 0 ? ylo : 0);
    int chi = is_v ? code_sr(bias, yhi > 0 ? yhi : 0, r20) : code_nearest(bias, yhi > 0 ? yhi : 0);
    if (mag < clo || mag > chi) {
        snprintf(why, why_len, "%s code %d (mag %d) outside [%d, %d]: ref %.12g +- %.3g, absmax %.9g +- %.3g",
                 is_v ? "v" : "m", c, mag, clo, chi, x, err, a_ref, err_a);
        return 0;
    }
    if (!is_v && mag && ((x - err > 0 && (c & 0x80)) || (x + err < 0 && !(c & 0x80)))) {
        snprintf(why, why_len, "m code %d has the wrong sign for ref %.12g", c, x);
        return 0;
    }
    return 1;
}

/* One step in double from the snapshot, with a bound on the fp32 error of
 * each quantity (a few units of fp32 rounding per operation, propagated),
 * against what the kernel left in pb. */
static void check_step(const problem *pb, const snapshot *sn, int s, int seed, const char *isa)
{
    const td_adam_hparams *hp = &pb->op.adam;
    double scale = pb->op.scaler.init_scale, lr = pb->op.lr.lr, e = 4 * EPS_F;
    long t = s + 1;
    double sumsq = 0;
    for (size_t i = 0; i < pb->n; i++) {
        double g = td_test_load_as(pb->grads[s], pb->gdt, i) / scale;
        sumsq += g * g;
    }
    double norm = sqrt(sumsq), coef = 1;
    if (pb->op.max_grad_norm > 0 && pb->op.max_grad_norm / (norm + 1e-6) < 1) coef = pb->op.max_grad_norm / (norm + 1e-6);
    double bc1 = 1 - pow(hp->beta1, (double)t), bc2 = 1 - pow(hp->beta2, (double)t), step = lr / bc1;
    int l2 = hp->decay == TD_ADAM_DECAY_L2;
    char why[256];
    for (int j = 0; j < pb->n_chunks; j++) {
        size_t nj = pb->chunk_n[j], off = pb->chunk_off[j];
        double *mr = malloc(nj * 8 + 8), *vr = malloc(nj * 8 + 8), *em = malloc(nj * 8 + 8), *ev = malloc(nj * 8 + 8);
        for (size_t i = 0; i < nj; i++) {
            double p = sn->master[off + i];
            double m = ref_load(pb->state, 0, sn->m[j], nj, i), v = ref_load(pb->state, 1, sn->v[j], nj, i);
            double g = td_test_load_as(pb->grads[s], pb->gdt, off + i) / scale * coef, eg = e * fabs(g);
            double wd = in_ranges(pb->nd[j], pb->n_nd[j], i) ? 0.0 : hp->weight_decay;
            if (l2) eg = e * (fabs(g) + 2 * wd * fabs(p)), g += wd * p;
            else p *= 1 - lr * wd;
            mr[i] = hp->beta1 * m + (1 - hp->beta1) * g;
            em[i] = e * (hp->beta1 * fabs(m) + (1 - hp->beta1) * fabs(g)) + (1 - hp->beta1) * eg + 1e-45;
            vr[i] = hp->beta2 * v + (1 - hp->beta2) * g * g;
            ev[i] = e * vr[i] + (1 - hp->beta2) * 2 * fabs(g) * eg + 1e-45;
            double d = sqrt(vr[i]) / sqrt(bc2) + hp->eps;
            double ed = e * d + (vr[i] > 0 ? ev[i] / (2 * sqrt(vr[i])) : sqrt(ev[i])) / sqrt(bc2);
            double u = mr[i] / d, eu = (em[i] + fabs(u) * ed) / d + e * fabs(u);
            double pr = p - step * u, ep = e * (fabs(p) + step * fabs(u)) + step * eu + 1e-45;
            double got = pb->master[off + i];
            if (!(fabs(got - pr) <= 2 * ep))
                fail_msg("%s seed %d step %d (%s, %s): chunk %d element %zu of %zu: master %.9g vs reference %.12g "
                         "(bound %.3g)",
                         isa, seed, s + 1, td_optim_state_name(pb->state), td_dtype_name(pb->gdt), j, i, nj,
                         got, pr, 2 * ep);
        }
        /* Block by block: the scale is the absmax of the new values. */
        for (size_t b = 0; b < nj; b += (pb->state == TD_OPTIM_STATE_INT8 ? QB : nj)) {
            size_t bn = pb->state == TD_OPTIM_STATE_INT8 ? (nj - b < QB ? nj - b : QB) : nj - b;
            double am = 0, av = 0, eam = 0, eav = 0;
            for (size_t i = b; i < b + bn; i++) {
                if (fabs(mr[i]) > am) am = fabs(mr[i]);
                if (vr[i] > av) av = vr[i];
                if (em[i] > eam) eam = em[i];
                if (ev[i] > eav) eav = ev[i];
            }
            if (pb->state == TD_OPTIM_STATE_INT8) {
                double sm = scale_of(pb->m[j], nj, b / QB), sv = scale_of(pb->v[j], nj, b / QB);
                if (!(fabs(sm - am) <= eam && fabs(sv - av) <= eav))
                    fail_msg("%s seed %d step %d: chunk %d block %zu: scales m %.9g v %.9g, reference %.12g %.12g",
                             isa, seed, s + 1, j, b / QB, sm, sv, am, av);
            }
            for (size_t i = b; i < b + bn; i++) {
                if (!moment_ok(pb->state, 0, pb->m[j], nj, i, mr[i], em[i], am, eam, sr_seed(t), why, sizeof why) ||
                    !moment_ok(pb->state, 1, pb->v[j], nj, i, vr[i], ev[i], av, eav, sr_seed(t), why, sizeof why))
                    fail_msg("%s seed %d step %d: chunk %d element %zu of %zu: %s", isa, seed, s + 1, j, i, nj, why);
            }
        }
        free(mr), free(vr), free(em), free(ev);
    }
    if (pb->has_out) /* the output is the new master, rounded */
        for (size_t i = 0; i < pb->n; i++) {
            if (pb->pdt == TD_DTYPE_F32) assert_true(((float *)pb->out)[i] == pb->master[i]);
            else if (pb->pdt == TD_DTYPE_BF16) assert_int_equal(((uint16_t *)pb->out)[i], td_bf16_from_f32(pb->master[i]));
            else assert_int_equal(((uint16_t *)pb->out)[i], td_f16_from_f32(pb->master[i]));
        }
}

/* The whole library path: first touch, per step the grad stats of every
 * chunk, the controller, the fused update; with `check`, each step against
 * the reference. */
static void run_tidal(problem *pb, td_optim_isa isa, int threads, int check, int seed)
{
    td_adam_cpu_params cp = td_adam_cpu_default_params();
    cp.isa = isa;
    cp.threads = threads;
    td_adam_cpu *cpu;
    TD_ASSERT_OK(td_adam_cpu_create(&cp, &cpu));
    td_adam_chunk ch[3];
    problem_chunks(pb, 0, ch);
    for (int j = 0; j < pb->n_chunks; j++)
        TD_ASSERT_OK(td_adam_cpu_init(cpu, &ch[j], pb->p0 + pb->chunk_off[j], TD_DTYPE_F32));
    td_optim opt;
    TD_ASSERT_OK(td_optim_init(&opt, &pb->op));
    for (int s = 0; s < STEPS; s++) {
        problem_chunks(pb, s, ch);
        snapshot sn = {0};
        if (check) snapshot_take(pb, &sn);
        td_grad_stats stats = {0};
        for (int j = 0; j < pb->n_chunks; j++)
            TD_ASSERT_OK(td_adam_cpu_grad_stats(cpu, ch[j].grad, pb->gdt, ch[j].numel, &stats));
        td_optim_step step;
        TD_ASSERT_OK(td_optim_begin_step(&opt, &stats, &step));
        assert_false(step.skip);
        TD_ASSERT_OK(td_adam_cpu_update(cpu, &step.coeffs, ch, pb->n_chunks));
        if (check) {
            check_step(pb, &sn, s, seed, td_optim_isa_name(isa));
            snapshot_free(pb, &sn);
        }
    }
    td_adam_cpu_destroy(cpu);
}

static void test_steps_match_double_reference(void **state)
{
    int seeds = td_test_seeds(24);
    for (int st = TD_OPTIM_STATE_BF16; st <= TD_OPTIM_STATE_INT8; st++)
        for (int seed = 1; seed <= seeds; seed++) {
            problem pb;
            problem_make(&pb, (td_optim_state)st, (uint64_t)seed * 6151 + (uint64_t)st);
            for (int isa = TD_OPTIM_ISA_SCALAR; isa < TD_OPTIM_ISA_COUNT; isa++)
                if (td_optim_isa_supported((td_optim_isa)isa))
                    run_tidal(&pb, (td_optim_isa)isa, 1 + seed % 3, 1, seed);
            problem_free(&pb);
        }
}

/* Same inputs: every ISA and every team size give the same bits, moments'
 * codes, padding and scales included. */
static void test_isas_and_teams_bit_identical(void **state)
{
    int seeds = td_test_seeds(12);
    for (int st = TD_OPTIM_STATE_FP32; st < TD_OPTIM_STATE_COUNT; st++)
        for (int seed = 1; seed <= seeds; seed++) {
            problem pb;
            problem_make(&pb, (td_optim_state)st, (uint64_t)seed * 104723 + (uint64_t)st);
            run_tidal(&pb, TD_OPTIM_ISA_SCALAR, 1, 0, seed);
            size_t bytes = pb.n * 4, obytes = pb.n * td_dtype_bytes(pb.pdt);
            float *want_p = malloc(bytes + 4);
            void *want_o = malloc(bytes + 4), *want_m[3], *want_v[3];
            memcpy(want_p, pb.master, bytes);
            if (pb.has_out) memcpy(want_o, pb.out, obytes);
            for (int j = 0; j < pb.n_chunks; j++) {
                size_t mb = td_adam_moment_bytes(pb.state, pb.chunk_n[j]);
                want_m[j] = malloc(mb + 1), want_v[j] = malloc(mb + 1);
                memcpy(want_m[j], pb.m[j], mb);
                memcpy(want_v[j], pb.v[j], mb);
            }
            for (int isa = TD_OPTIM_ISA_SCALAR; isa < TD_OPTIM_ISA_COUNT; isa++) {
                if (!td_optim_isa_supported((td_optim_isa)isa)) continue;
                for (int threads = 1; threads <= 4; threads++) {
                    run_tidal(&pb, (td_optim_isa)isa, threads, 0, seed);
                    int same = !memcmp(pb.master, want_p, bytes) && (!pb.has_out || !memcmp(pb.out, want_o, obytes));
                    for (int j = 0; j < pb.n_chunks; j++) {
                        size_t mb = td_adam_moment_bytes(pb.state, pb.chunk_n[j]);
                        same = same && !memcmp(pb.m[j], want_m[j], mb) && !memcmp(pb.v[j], want_v[j], mb);
                    }
                    if (!same)
                        fail_msg("seed %d, %s state: %s with %d threads differs from scalar with 1", seed,
                                 td_optim_state_name(pb.state), td_optim_isa_name(isa), threads);
                }
            }
            for (int j = 0; j < pb.n_chunks; j++) free(want_m[j]), free(want_v[j]);
            free(want_p), free(want_o);
            problem_free(&pb);
        }
}

/* fp32 state, where separate calls are expressible: one call with no-decay
 * ranges gives the bits of one call per range, the ranges with the
 * coefficients td_adam_coeffs_make gives for weight_decay 0 (torch's two
 * param groups), the rest with the step's. */
static void run_split(problem *pb)
{
    td_adam_cpu *cpu;
    td_adam_cpu_params cp = td_adam_cpu_default_params();
    cp.threads = 2;
    TD_ASSERT_OK(td_adam_cpu_create(&cp, &cpu));
    td_adam_chunk ch[3];
    problem_chunks(pb, 0, ch);
    for (int j = 0; j < pb->n_chunks; j++) {
        td_adam_chunk c = ch[j];
        c.no_decay = NULL, c.n_no_decay = 0;
        TD_ASSERT_OK(td_adam_cpu_init(cpu, &c, pb->p0 + pb->chunk_off[j], TD_DTYPE_F32));
    }
    td_optim opt;
    TD_ASSERT_OK(td_optim_init(&opt, &pb->op));
    td_adam_hparams nohp = pb->op.adam;
    nohp.weight_decay = 0;
    size_t gsz = td_dtype_bytes(pb->gdt), osz = td_dtype_bytes(pb->pdt);
    for (int s = 0; s < STEPS; s++) {
        problem_chunks(pb, s, ch);
        td_grad_stats stats = {0};
        for (int j = 0; j < pb->n_chunks; j++)
            TD_ASSERT_OK(td_adam_cpu_grad_stats(cpu, ch[j].grad, pb->gdt, ch[j].numel, &stats));
        td_optim_step step;
        TD_ASSERT_OK(td_optim_begin_step(&opt, &stats, &step));
        td_adam_coeffs nd;
        TD_ASSERT_OK(td_adam_coeffs_make(&nohp, step.lr, step.step, step.clip_coef / step.loss_scale, &nd));
        for (int j = 0; j < pb->n_chunks; j++)
            for (size_t i = 0; i < ch[j].numel;) {
                size_t e = ch[j].numel;
                int decays = 1;
                for (int r = 0; r < pb->n_nd[j]; r++) {
                    if (pb->nd[j][r].end <= i) continue;
                    if (pb->nd[j][r].begin <= i) decays = 0, e = pb->nd[j][r].end;
                    else e = pb->nd[j][r].begin;
                    break;
                }
                td_adam_chunk sub = ch[j];
                sub.no_decay = NULL, sub.n_no_decay = 0;
                sub.master += i, sub.m = (float *)sub.m + i, sub.v = (float *)sub.v + i;
                sub.grad = (const char *)sub.grad + i * gsz;
                if (sub.param_out) sub.param_out = (char *)sub.param_out + i * osz;
                sub.numel = e - i;
                TD_ASSERT_OK(td_adam_cpu_update(cpu, decays ? &step.coeffs : &nd, &sub, 1));
                i = e;
            }
    }
    td_adam_cpu_destroy(cpu);
}

static void test_ranges_equal_separate_calls(void **state)
{
    int seeds = td_test_seeds(16), cut = 0;
    for (int seed = 1; seed <= seeds; seed++) {
        problem pb;
        problem_make(&pb, TD_OPTIM_STATE_FP32, (uint64_t)seed * 7919 + 5);
        if (pb.op.adam.weight_decay == 0) pb.op.adam.weight_decay = 0.1;
        if (!pb.n_nd[0] && pb.chunk_n[0] > 2) pb.nd[0][0] = (td_adam_range){1, pb.chunk_n[0] / 2 + 1}, pb.n_nd[0] = 1;
        for (int j = 0; j < pb.n_chunks; j++) cut += pb.n_nd[j];
        size_t bytes = pb.n * 4, obytes = pb.n * td_dtype_bytes(pb.pdt);
        run_split(&pb);
        float *want_p = malloc(bytes + 4), *want_m = malloc(bytes + 4), *want_v = malloc(bytes + 4);
        void *want_o = malloc(obytes + 4);
        memcpy(want_p, pb.master, bytes);
        if (pb.has_out) memcpy(want_o, pb.out, obytes);
        for (int j = 0; j < pb.n_chunks; j++) {
            memcpy(want_m + pb.chunk_off[j], pb.m[j], pb.chunk_n[j] * 4);
            memcpy(want_v + pb.chunk_off[j], pb.v[j], pb.chunk_n[j] * 4);
        }
        for (int isa = TD_OPTIM_ISA_SCALAR; isa < TD_OPTIM_ISA_COUNT; isa++) {
            if (!td_optim_isa_supported((td_optim_isa)isa)) continue;
            run_tidal(&pb, (td_optim_isa)isa, 1 + seed % 4, 0, seed);
            int same = !memcmp(pb.master, want_p, bytes) && (!pb.has_out || !memcmp(pb.out, want_o, obytes));
            for (int j = 0; j < pb.n_chunks; j++)
                same = same && !memcmp(pb.m[j], want_m + pb.chunk_off[j], pb.chunk_n[j] * 4) &&
                       !memcmp(pb.v[j], want_v + pb.chunk_off[j], pb.chunk_n[j] * 4);
            if (!same)
                fail_msg("seed %d (%s decay, wd %g): %s with no-decay ranges differs from separate calls", seed,
                         pb.op.adam.decay == TD_ADAM_DECAY_L2 ? "L2" : "decoupled", pb.op.adam.weight_decay,
                         td_optim_isa_name((td_optim_isa)isa));
        }
        free(want_p), free(want_m), free(want_v), free(want_o);
        problem_free(&pb);
    }
    assert_true(cut > 0);
}

/* Round trips through td_adam_moment_write / _read: every code is the
 * nearest (ties even) to |x| / absmax, the decoded value is that code's
 * value times the scale, so within half a code step of x; all-zero blocks,
 * huge, tiny and subnormal magnitudes, partial blocks. */
static void test_round_trip(void **state)
{
    td_rng r;
    td_rng_seed(&r, 77);
    static const size_t sizes[] = {1, 5, 255, 256, 257, 1000, 3 * 256 + 1, 4096};
    double worst_rel[2] = {0};
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++)
        for (int trial = 0; trial < 40; trial++) {
            size_t n = sizes[k];
            float *x = malloc(n * 4), *y = malloc(n * 4);
            /* Per block: all zero, or one magnitude decade over 12 (huge,
             * tiny, subnormal) with elements spread down to 1e-12 of it. */
            for (size_t b = 0; b < n; b += QB) {
                int kind = (int)td_rng_below(&r, 6);
                double top = kind == 0 ? 0 : kind == 1 ? 1e37 : kind == 2 ? 1e-36 : kind == 3 ? 1e-40 : pow(10, uniform(&r, -8, 8));
                for (size_t i = b; i < n && i < b + QB; i++) {
                    double mag = top * pow(10, td_rng_below(&r, 4) ? uniform(&r, -2, 0) : uniform(&r, -12, 0));
                    x[i] = (float)(td_rng_below(&r, 2) ? mag : -mag);
                    if (td_rng_below(&r, 20) == 0) x[i] = 0;
                }
            }
            for (int st = TD_OPTIM_STATE_FP32; st < TD_OPTIM_STATE_COUNT; st++)
                for (int is_v = 0; is_v < 2; is_v++) {
                    size_t bytes = td_adam_moment_bytes((td_optim_state)st, n);
                    unsigned char *buf = malloc(bytes + 1);
                    memset(buf, 0xa5, bytes + 1);
                    float *in = x;
                    if (is_v) { /* v is never negative */
                        in = malloc(n * 4);
                        for (size_t i = 0; i < n; i++) in[i] = fabsf(x[i]);
                    }
                    td_adam_moment which = is_v ? TD_ADAM_MOMENT_V : TD_ADAM_MOMENT_M;
                    TD_ASSERT_OK(td_adam_moment_write((td_optim_state)st, which, buf, n, 0, n, in));
                    TD_ASSERT_OK(td_adam_moment_read((td_optim_state)st, which, buf, n, 0, n, y));
                    assert_int_equal(buf[bytes], 0xa5); /* nothing past the buffer */
                    for (size_t i = 0; i < n; i++) {
                        if (st == TD_OPTIM_STATE_FP32) {
                            assert_true(y[i] == in[i]);
                        } else if (st == TD_OPTIM_STATE_BF16) {
                            assert_true(y[i] == td_f32_from_bf16(td_bf16_from_f32(in[i])));
                        } else {
                            size_t b0 = i / QB * QB, b1 = b0 + QB < n ? b0 + QB : n;
                            double a = 0;
                            for (size_t q = b0; q < b1; q++) a = fmax(a, fabs(in[q]));
                            assert_true(scale_of(buf, n, i / QB) == (float)a);
                            int bias = is_v ? BIAS_V : BIAS_M, c = buf[i], mag = is_v ? c : c & 0x7f;
                            /* y = |x| * (1/a) in fp32 (or |x| / a) is within 2 roundings of
                             * |x| / a: the code is the nearest to that, or it is that close
                             * to a midpoint. */
                            double yd = a > 0 ? fabs(in[i]) / a : 0;
                            int lo = code_nearest(bias, yd * (1 - 2 * EPS_F)), hi = code_nearest(bias, yd * (1 + 2 * EPS_F));
                            if (mag < lo || mag > hi)
                                fail_msg("%s %s: x %.9g in block of absmax %.9g: code %d, expected %d..%d", "int8",
                                         is_v ? "v" : "m", in[i], a, c, lo, hi);
                            if (!is_v && mag) assert_int_equal(!!(c & 0x80), in[i] < 0);
                            assert_true(ref_load(TD_OPTIM_STATE_INT8, is_v, buf, n, i) == (double)fabsf(y[i]) ||
                                        ref_load(TD_OPTIM_STATE_INT8, is_v, buf, n, i) == (double)y[i]);
                            if (fabs(in[i]) == a) assert_true(fabsf(y[i]) == (float)a); /* the max is exact */
                            /* Error bound: half a step, relative 2^-4 in the normal range,
                             * absolute 2^(-3-bias) * a below it, plus the final rounding. */
                            double err = fabs((double)y[i] - in[i]);
                            double bound = ldexp(fabs(in[i]), -4) + ldexp(a, -3 - bias) + 2 * EPS_F * fabs(in[i]) + 1e-45;
                            if (!(err <= bound))
                                fail_msg("x %.9g -> %.9g: error %.3g > %.3g", in[i], y[i], err, bound);
                            if (fabs(in[i]) > ldexp(a, 1 - bias) && fabs(in[i]) > 1e-30 && /* not fp32 subnormal */
                                err / fabs(in[i]) > worst_rel[is_v])
                                worst_rel[is_v] = err / fabs(in[i]);
                        }
                    }
                    if (st == TD_OPTIM_STATE_INT8)
                        for (size_t i = n; i < ((n + 3) & ~(size_t)3); i++) assert_int_equal(buf[i], 0); /* padding */
                    if (is_v) free(in);
                    free(buf);
                }
            free(x), free(y);
        }
    print_message("int8 round trip: worst relative error in the normal range m %.4f, v %.4f (bound 0.0625)\n",
                  worst_rel[0], worst_rel[1]);
    assert_true(worst_rel[0] <= 0.0625 + 1e-6 && worst_rel[1] <= 0.0625 + 1e-6);
}

/* First touch writes zero codes, zero padding and zero scales over poison,
 * for sizes around the block and partition bounds and several team sizes. */
static void test_init_zeroes_compact_state(void **state)
{
    static const size_t sizes[] = {1, 255, 256, 257, 1023, 1025, 5000, 3 * 1024 + 2};
    for (int threads = 1; threads <= 3; threads++) {
        td_adam_cpu_params cp = td_adam_cpu_default_params();
        cp.threads = threads;
        td_adam_cpu *cpu;
        TD_ASSERT_OK(td_adam_cpu_create(&cp, &cpu));
        for (int st = TD_OPTIM_STATE_FP32; st < TD_OPTIM_STATE_COUNT; st++)
            for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
                size_t n = sizes[k], bytes = td_adam_moment_bytes((td_optim_state)st, n);
                float *master = malloc(n * 4);
                unsigned char *m = malloc(bytes + 1), *v = malloc(bytes + 1);
                memset(m, 0x7f, bytes + 1), memset(v, 0xff, bytes + 1);
                td_adam_chunk ch = {.master = master, .m = m, .v = v, .numel = n, .state = (td_optim_state)st};
                TD_ASSERT_OK(td_adam_cpu_init(cpu, &ch, NULL, TD_DTYPE_F32));
                for (size_t i = 0; i < bytes; i++)
                    if (m[i] || v[i])
                        fail_msg("%s state, %zu elements, %d threads: byte %zu of %zu not zeroed",
                                 td_optim_state_name((td_optim_state)st), n, threads, i, bytes);
                assert_int_equal(m[bytes], 0x7f);
                assert_int_equal(v[bytes], 0xff);
                free(master), free(m), free(v);
            }
        td_adam_cpu_destroy(cpu);
    }
}

static void test_bytes_and_names(void **state)
{
    assert_int_equal(td_adam_moment_bytes(TD_OPTIM_STATE_FP32, 1000), 4000);
    assert_int_equal(td_adam_moment_bytes(TD_OPTIM_STATE_BF16, 1000), 2000);
    assert_int_equal(td_adam_moment_bytes(TD_OPTIM_STATE_INT8, 1000), 1000 + 4 * 4);
    assert_int_equal(td_adam_moment_bytes(TD_OPTIM_STATE_INT8, 1), 4 + 4);
    assert_int_equal(td_adam_moment_bytes(TD_OPTIM_STATE_INT8, 0), 0);
    assert_int_equal(td_adam_moment_bytes(TD_OPTIM_STATE_INT8, 257), 260 + 8);
    assert_true(td_adam_state_bytes_per_param(TD_OPTIM_STATE_FP32) == 12);
    assert_true(td_adam_state_bytes_per_param(TD_OPTIM_STATE_BF16) == 8);
    assert_true(td_adam_state_bytes_per_param(TD_OPTIM_STATE_INT8) == 4 + 2 * (1 + 4.0 / QB));
    td_optim_state s;
    TD_ASSERT_OK(td_optim_state_parse("int8", &s));
    assert_int_equal(s, TD_OPTIM_STATE_INT8);
    assert_int_equal(td_optim_state_parse("fp8", &s), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "fp32"));
    assert_string_equal(td_optim_state_name(TD_OPTIM_STATE_BF16), "bf16");
}

/* Pieces of a moment, for every format: any range reads as the same values
 * as the whole; aligned pieces written one by one give the bytes of one
 * write of the whole; a piece's bytes found by td_adam_moment_spans, moved
 * into a buffer of its own (a file, say) and back, or copied with
 * td_adam_moment_copy, are the piece itself; a misaligned write is refused,
 * naming the alignment. */
static void test_pieces(void **state)
{
    td_rng r;
    td_rng_seed(&r, 5);
    static const size_t sizes[] = {1, 255, 256, 257, 1000, 4 * 256, 5 * 256 + 3};
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++)
        for (int st = 0; st < TD_OPTIM_STATE_COUNT; st++)
            for (int is_v = 0; is_v < 2; is_v++) {
                td_optim_state s = (td_optim_state)st;
                td_adam_moment which = is_v ? TD_ADAM_MOMENT_V : TD_ADAM_MOMENT_M;
                size_t n = sizes[k], bytes = td_adam_moment_bytes(s, n), a = td_adam_moment_align(s);
                float *x = malloc(n * 4), *all = malloc(n * 4), *y = malloc(n * 4);
                unsigned char *whole = malloc(bytes), *parts = malloc(bytes), *file = malloc(bytes),
                              *back = malloc(bytes);
                assert_true(x && all && y && whole && parts && file && back);
                for (size_t i = 0; i < n; i++) {
                    x[i] = (float)(uniform(&r, -1, 1) * pow(10, uniform(&r, -6, 2)));
                    if (is_v) x[i] = fabsf(x[i]);
                }
                TD_ASSERT_OK(td_adam_moment_write(s, which, whole, n, 0, n, x));
                TD_ASSERT_OK(td_adam_moment_read(s, which, whole, n, 0, n, all));
                for (int t = 0; t < 30; t++) { /* any range reads the same values */
                    size_t b = td_rng_below(&r, n + 1), e = b + td_rng_below(&r, n - b + 1);
                    memset(y, 0xff, n * 4);
                    TD_ASSERT_OK(td_adam_moment_read(s, which, whole, n, b, e, y));
                    assert_memory_equal(y, all + b, (e - b) * 4);
                }
                /* aligned pieces of random lengths, written in turn: the bytes of the whole */
                memset(parts, 0x5a, bytes);
                for (size_t b = 0; b < n;) {
                    size_t e = b + a * (1 + td_rng_below(&r, 3));
                    if (e > n) e = n;
                    TD_ASSERT_OK(td_adam_moment_write(s, which, parts, n, b, e, all + b));
                    b = e;
                }
                assert_memory_equal(parts, whole, bytes); /* what was read writes back to the same bits */
                /* a piece's bytes where they lie, moved out and back */
                size_t b = a * td_rng_below(&r, (n + a - 1) / a), e = b + a * (1 + td_rng_below(&r, 2));
                if (e > n) e = n;
                td_adam_span sp[2];
                int cnt;
                TD_ASSERT_OK(td_adam_moment_spans(s, n, b, e, sp, &cnt));
                assert_int_equal(cnt, s == TD_OPTIM_STATE_INT8 ? 2 : 1);
                memset(back, 0, bytes);
                for (int i = 0, at = 0; i < cnt; at += (int)sp[i].bytes, i++) {
                    assert_true(sp[i].offset + sp[i].bytes <= bytes);
                    memcpy(file + at, whole + sp[i].offset, sp[i].bytes);
                    memcpy(back + sp[i].offset, file + at, sp[i].bytes);
                }
                TD_ASSERT_OK(td_adam_moment_read(s, which, back, n, b, e, y));
                assert_memory_equal(y, all + b, (e - b) * 4);
                /* the piece as a moment of its own, and back into a fresh buffer at the same place */
                size_t pn = e - b, pbytes = td_adam_moment_bytes(s, pn);
                unsigned char *piece = malloc(pbytes + 1);
                piece[pbytes] = 0x77;
                TD_ASSERT_OK(td_adam_moment_copy(s, piece, pn, 0, whole, n, b, pn));
                assert_int_equal(piece[pbytes], 0x77);
                TD_ASSERT_OK(td_adam_moment_read(s, which, piece, pn, 0, pn, y));
                assert_memory_equal(y, all + b, pn * 4);
                memset(back, 0, bytes);
                TD_ASSERT_OK(td_adam_moment_copy(s, back, n, b, piece, pn, 0, pn));
                TD_ASSERT_OK(td_adam_moment_read(s, which, back, n, b, e, y));
                assert_memory_equal(y, all + b, pn * 4);
                free(piece);
                /* fp32 reads in place; the others do not */
                assert_true((td_adam_moment_f32(s, whole, 3) != NULL) == (s == TD_OPTIM_STATE_FP32));
                if (s == TD_OPTIM_STATE_FP32) assert_ptr_equal(td_adam_moment_f32(s, whole, 3), (float *)whole + 3);
                if (a > 1 && n > a + 1) { /* a piece off the block grid */
                    assert_int_equal(td_adam_moment_write(s, which, parts, n, 1, a, all + 1), TD_ERR_INVALID);
                    assert_non_null(strstr(td_error_msg(), "multiple of 256 elements"));
                    assert_int_equal(td_adam_moment_write(s, which, parts, n, 0, a + 1, all), TD_ERR_INVALID);
                    assert_int_equal(td_adam_moment_spans(s, n, 0, 1, sp, &cnt), TD_ERR_INVALID);
                    assert_int_equal(td_adam_moment_copy(s, back, n, 1, whole, n, 0, a), TD_ERR_INVALID);
                }
                assert_int_equal(td_adam_moment_copy(s, back, n, 0, whole, n, 0, n + 1), TD_ERR_INVALID);
                free(x); free(all); free(y); free(whole); free(parts); free(file); free(back);
            }
}

/* The one validity check of an optimizer's configuration names each bad
 * value; td_optim_init and the trainer's config check make it. */
static void test_params_check(void **state)
{
    td_optim_params ok = td_optim_default_params();
    TD_ASSERT_OK(td_optim_params_check(&ok));
    for (int s = 0; s < TD_OPTIM_STATE_COUNT; s++) {
        ok.state = (td_optim_state)s;
        TD_ASSERT_OK(td_optim_params_check(&ok));
        TD_ASSERT_OK(td_optim_state_check(ok.state));
    }
    assert_int_equal(td_adam_moment_dtype(TD_OPTIM_STATE_FP32), TD_DTYPE_F32);
    assert_int_equal(td_adam_moment_dtype(TD_OPTIM_STATE_BF16), TD_DTYPE_BF16);
    assert_int_equal(td_adam_moment_dtype(TD_OPTIM_STATE_INT8), TD_DTYPE_COUNT);
    assert_int_equal(td_adam_moment_align(TD_OPTIM_STATE_FP32), 1);
    assert_int_equal(td_adam_moment_align(TD_OPTIM_STATE_BF16), 1);
    assert_int_equal(td_adam_moment_align(TD_OPTIM_STATE_INT8), QB);
    for (int s = 0; s < TD_OPTIM_STATE_COUNT; s++) /* what callers size pieces by, knowing no format */
        assert_int_equal(TD_ADAM_MOMENT_ALIGN_MAX % td_adam_moment_align((td_optim_state)s), 0);
    struct { const char *field, *msg; } cases[] = {
        {"state", "optimizer state type 7: use fp32"},
        {"beta1", "beta1 1 out of range"},
        {"eps", "eps 0 out of range"},
        {"lr", "lr -1: use a finite lr > 0"},
        {"scaler", "loss-scale backoff factor 1.5"},
        {"clip", "max grad norm inf"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        td_optim_params p = td_optim_default_params();
        const char *f = cases[k].field;
        if (!strcmp(f, "state")) p.state = (td_optim_state)7;
        if (!strcmp(f, "beta1")) p.adam.beta1 = 1;
        if (!strcmp(f, "eps")) p.adam.eps = 0;
        if (!strcmp(f, "lr")) p.lr.lr = -1;
        if (!strcmp(f, "scaler")) {
            p.scaler.kind = TD_LOSS_SCALE_DYNAMIC;
            p.scaler.backoff_factor = 1.5;
        }
        if (!strcmp(f, "clip")) p.max_grad_norm = INFINITY;
        assert_int_equal(td_optim_params_check(&p), TD_ERR_INVALID);
        if (!strstr(td_error_msg(), cases[k].msg)) fail_msg("%s: '%s' lacks '%s'", f, td_error_msg(), cases[k].msg);
        td_optim o;
        assert_int_equal(td_optim_init(&o, &p), TD_ERR_INVALID);
        assert_non_null(strstr(td_error_msg(), cases[k].msg));
        td_train_config c = td_train_default_config();
        c.optim = p;
        assert_int_equal(td_train_config_check(&c), TD_ERR_INVALID);
        assert_non_null(strstr(td_error_msg(), cases[k].msg));
    }
    assert_int_equal(td_optim_params_check(NULL), TD_ERR_INVALID);
    assert_int_equal(td_optim_state_check((td_optim_state)-2), TD_ERR_INVALID);
}

static void test_errors(void **state)
{
    td_adam_cpu *cpu;
    TD_ASSERT_OK(td_adam_cpu_create(NULL, &cpu));
    float a[4] = {0}, g[4] = {0};
    unsigned char m[16] = {0}, v[16] = {0};
    td_adam_coeffs co;
    td_adam_hparams hp = td_adam_default_hparams();
    TD_ASSERT_OK(td_adam_coeffs_make(&hp, 1e-3, 1, 1, &co));
    td_adam_chunk ch = {.master = a, .m = m, .v = v, .grad = g, .numel = 4, .state = (td_optim_state)3};
    assert_int_equal(td_adam_cpu_update(cpu, &co, &ch, 1), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "optimizer state"));
    assert_int_equal(td_adam_cpu_init(cpu, &ch, NULL, TD_DTYPE_F32), TD_ERR_INVALID);
    ch.state = TD_OPTIM_STATE_INT8;
    TD_ASSERT_OK(td_adam_cpu_update(cpu, &co, &ch, 1));
    /* No-decay ranges: sorted, non-empty, disjoint, inside the chunk. */
    td_adam_range bad[][2] = {{{0, 0}, {1, 2}}, {{0, 5}, {0, 0}}, {{2, 3}, {1, 2}}, {{0, 2}, {1, 3}}};
    for (int b = 0; b < 4; b++) {
        ch.no_decay = bad[b];
        ch.n_no_decay = b == 1 ? 1 : 2;
        assert_int_equal(td_adam_cpu_update(cpu, &co, &ch, 1), TD_ERR_INVALID);
        assert_non_null(strstr(td_error_msg(), "no-decay range"));
    }
    ch.no_decay = NULL;
    ch.n_no_decay = 1;
    assert_int_equal(td_adam_cpu_update(cpu, &co, &ch, 1), TD_ERR_INVALID);
    ch.no_decay = bad[3];
    ch.n_no_decay = 1;
    TD_ASSERT_OK(td_adam_cpu_update(cpu, &co, &ch, 1));
    ch.no_decay = NULL;
    ch.n_no_decay = 0;
    assert_int_equal(td_adam_moment_write((td_optim_state)-1, TD_ADAM_MOMENT_M, m, 4, 0, 4, a), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "optimizer state type -1"));
    assert_int_equal(td_adam_moment_write(TD_OPTIM_STATE_INT8, (td_adam_moment)2, m, 4, 0, 4, a), TD_ERR_INVALID);
    assert_int_equal(td_adam_moment_read(TD_OPTIM_STATE_INT8, TD_ADAM_MOMENT_V, NULL, 4, 0, 4, a), TD_ERR_INVALID);
    assert_int_equal(td_adam_moment_read(TD_OPTIM_STATE_BF16, TD_ADAM_MOMENT_V, m, 4, 3, 5, a), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "not inside"));
    assert_int_equal(td_adam_moment_read(TD_OPTIM_STATE_BF16, TD_ADAM_MOMENT_V, m, 4, 3, 2, a), TD_ERR_INVALID);
    td_adam_cpu_destroy(cpu);
}

/* ---- quality ---------------------------------------------------------------- */

/* Noisy least squares, the shape of a training run: loss(w) = 1/(2N) sum_k
 * (a_k . w - b_k)^2 over N samples, b_k = a_k . w* + noise (so the loss has
 * a floor, as a language model's has), features of scales over two decades
 * (blocks mix large and small moments), minibatch grads, cosine lr with
 * warmup; the same samples and batches for every state.  Returns the final
 * full-data loss and, in *floor, the loss at w*. */
enum { LS_D = 1024 + 100, LS_N = 4096, LS_B = 128 };

static double ls_loss(const float *a, const float *b, const float *w)
{
    double sum = 0;
    for (size_t k = 0; k < LS_N; k++) {
        double r = -b[k];
        for (size_t i = 0; i < LS_D; i++) r += (double)a[k * LS_D + i] * w[i];
        sum += r * r;
    }
    return sum / (2.0 * LS_N);
}

static double least_squares_run(td_optim_state st, int steps, double *loss0, double *floor)
{
    td_rng r;
    td_rng_seed(&r, 31337);
    float *a = malloc(sizeof(float) * LS_N * LS_D), *b = malloc(sizeof(float) * LS_N);
    float *w = malloc(LS_D * 4), *g = malloc(LS_D * 4), *wstar = malloc(LS_D * 4), *init = malloc(LS_D * 4);
    double *scale = malloc(LS_D * 8);
    for (size_t i = 0; i < LS_D; i++) {
        scale[i] = pow(10, uniform(&r, -1, 1));
        wstar[i] = (float)uniform(&r, -1, 1);
        init[i] = 0;
    }
    for (size_t k = 0; k < LS_N; k++) {
        double y = 0;
        for (size_t i = 0; i < LS_D; i++) {
            a[k * LS_D + i] = (float)(uniform(&r, -1, 1) * scale[i]);
            y += (double)a[k * LS_D + i] * wstar[i];
        }
        b[k] = (float)(y + 2 * (td_rng_uniform(&r) + td_rng_uniform(&r) + td_rng_uniform(&r) - 1.5));
    }
    *floor = ls_loss(a, b, wstar);
    size_t mb = td_adam_moment_bytes(st, LS_D);
    void *m = malloc(mb), *v = malloc(mb);
    td_adam_cpu_params cp = td_adam_cpu_default_params();
    cp.threads = 2;
    td_adam_cpu *cpu;
    TD_ASSERT_OK(td_adam_cpu_create(&cp, &cpu));
    td_adam_chunk ch = {.master = w, .m = m, .v = v, .grad = g, .grad_dtype = TD_DTYPE_F32, .numel = LS_D, .state = st};
    TD_ASSERT_OK(td_adam_cpu_init(cpu, &ch, init, TD_DTYPE_F32));
    td_optim_params op = td_optim_default_params();
    op.state = st;
    op.adam.weight_decay = 0;
    op.max_grad_norm = 0;
    op.lr = (td_lr_schedule){TD_LR_DECAY_COSINE, 1e-2, 1e-4, 100, steps, 1};
    td_optim opt;
    TD_ASSERT_OK(td_optim_init(&opt, &op));
    *loss0 = ls_loss(a, b, w);
    td_rng batches;
    td_rng_seed(&batches, 4242);
    double *gd = malloc(LS_D * 8);
    for (int s = 0; s < steps; s++) {
        memset(gd, 0, LS_D * 8);
        for (int j = 0; j < LS_B; j++) {
            size_t k = td_rng_below(&batches, LS_N);
            double res = -b[k];
            for (size_t i = 0; i < LS_D; i++) res += (double)a[k * LS_D + i] * w[i];
            for (size_t i = 0; i < LS_D; i++) gd[i] += res * a[k * LS_D + i];
        }
        for (size_t i = 0; i < LS_D; i++) g[i] = (float)(gd[i] / LS_B);
        td_grad_stats stats = {0};
        TD_ASSERT_OK(td_adam_cpu_grad_stats(cpu, g, TD_DTYPE_F32, LS_D, &stats));
        td_optim_step step;
        TD_ASSERT_OK(td_optim_begin_step(&opt, &stats, &step));
        TD_ASSERT_OK(td_adam_cpu_update(cpu, &step.coeffs, &ch, 1));
    }
    double loss = ls_loss(a, b, w);
    td_adam_cpu_destroy(cpu);
    free(a), free(b), free(w), free(g), free(wstar), free(init), free(scale), free(m), free(v), free(gd);
    return loss;
}

static void test_quality_least_squares(void **state)
{
    const int steps = 3000;
    double l0, floor, loss[TD_OPTIM_STATE_COUNT];
    for (int st = 0; st < TD_OPTIM_STATE_COUNT; st++) loss[st] = least_squares_run((td_optim_state)st, steps, &l0, &floor);
    print_message("noisy least squares, %d params, %d steps: loss %.4g at start, %.4g at w*; at the end fp32 %.6g, "
                  "bf16 %.6g (%+.3f%%), int8 %.6g (%+.3f%%); excess over w*: fp32 %.4g, bf16 %.4g, int8 %.4g\n",
                  LS_D, steps, l0, floor, loss[0], loss[1], 100 * (loss[1] / loss[0] - 1), loss[2],
                  100 * (loss[2] / loss[0] - 1), loss[0] - floor, loss[1] - floor, loss[2] - floor);
    assert_true(loss[0] < 1e-2 * l0); /* it trained */
    for (int st = 1; st < TD_OPTIM_STATE_COUNT; st++) assert_true(fabs(loss[st] / loss[0] - 1) <= 0.01);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bytes_and_names),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_init_zeroes_compact_state),
        cmocka_unit_test(test_steps_match_double_reference),
        cmocka_unit_test(test_isas_and_teams_bit_identical),
        cmocka_unit_test(test_ranges_equal_separate_calls),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_pieces),
        cmocka_unit_test(test_params_check),
        cmocka_unit_test(test_quality_least_squares),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
