/* The CPU AdamW engine: picks the kernel for this CPU, and runs it on one
 * OpenMP team with a static partition whose tail is shared.
 *
 * Why a static partition: the state of a 4B-param model is 48 GiB that is
 * streamed once per step; the bound is DRAM bandwidth.  Each page must be
 * read by a thread on the NUMA node that holds it, and the cheapest way to
 * get that is to let the same thread first-touch it (td_adam_cpu_init) and
 * update it every step.  Dynamic scheduling would move pages between
 * threads and across nodes.  Why OpenMP: libgomp keeps its worker threads
 * between parallel regions (one persistent team per calling thread), so a
 * region per call costs a few microseconds, and thread i is the same OS
 * thread on every call, which keeps the hwloc binding and the partition
 * consistent.
 *
 * Why the tail is shared: a team waits for its slowest thread, and in a
 * training step one thread is often slowed by something else on its core
 * or memory channel (an interrupt, the hypervisor taking its vCPU, the copy
 * engine's DMA).  So an update walks its own range in pieces, claimed from
 * a counter per range; a thread done with its own claims the pieces left in
 * the others' ranges.  Almost every piece is still updated by the thread
 * that first touched it; the update is elementwise, so which thread runs a
 * piece changes no bit. */
#include "adam_impl.h"
#include "tidal/alloc.h"

#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "tidal/convert.h"

#define TD_PART_ELEMS 1024 /* 4 KiB of fp32: partition bounds fall on page bounds */
_Static_assert(TD_PART_ELEMS % TD_ADAM_INT8_BLOCK == 0, "a thread range must hold whole int8 scale blocks");
#define TD_PARTIAL_STRIDE 8 /* doubles: one cache line per thread's partial sum */
#define TD_PIECE_ELEMS (16 * TD_PART_ELEMS) /* the unit a thread claims: 64 KiB of each fp32 stream */

/* The next unclaimed piece of one thread's range of one chunk, alone on its
 * cache line. */
typedef struct claim {
    _Atomic size_t next;
    char pad[64 - sizeof(size_t)];
} claim;

struct td_adam_cpu {
    int threads;
    td_optim_isa isa;
    const td_adam_kernels *k;
    td_topo *topo;
    int bound;            /* the team of `bound_for` is bound to cores */
    pthread_t bound_for;
    double *partials;     /* threads * TD_PARTIAL_STRIDE */
    claim *claims;        /* claim_chunks * threads: td_adam_cpu_update's counters */
    int claim_chunks;
};

/* ---- instruction sets ------------------------------------------------------ */

static const char *const isa_names[TD_OPTIM_ISA_COUNT] = {"auto", "scalar", "avx2", "avx512"};

const char *td_optim_isa_name(td_optim_isa isa)
{
    return (unsigned)isa < TD_OPTIM_ISA_COUNT ? isa_names[isa] : "?";
}

td_status td_optim_isa_parse(const char *name, td_optim_isa *out)
{
    for (int i = 0; i < TD_OPTIM_ISA_COUNT; i++)
        if (name && !strcmp(name, isa_names[i])) {
            *out = (td_optim_isa)i;
            return TD_OK;
        }
    return td_error_set(TD_ERR_INVALID, "unknown instruction set '%s': use auto, scalar, avx2 or avx512",
                        name ? name : "(null)");
}

/* clang before 16 does not know the "f16c" feature name (a compile error);
 * there AVX2 stands for it: every AVX2 CPU has F16C (Ivy Bridge and
 * Piledriver brought F16C before AVX2). */
#if defined(__clang__) && __clang_major__ < 16
#define CPU_HAS_F16C() 1
#else
#define CPU_HAS_F16C() __builtin_cpu_supports("f16c")
#endif

int td_optim_isa_supported(td_optim_isa isa)
{
    __builtin_cpu_init();
    switch (isa) {
    case TD_OPTIM_ISA_AUTO:
    case TD_OPTIM_ISA_SCALAR: return 1;
    case TD_OPTIM_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && CPU_HAS_F16C();
    case TD_OPTIM_ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               td_optim_isa_supported(TD_OPTIM_ISA_AVX2);
    default: return 0;
    }
}

td_optim_isa td_optim_isa_best(void)
{
    if (td_optim_isa_supported(TD_OPTIM_ISA_AVX512)) return TD_OPTIM_ISA_AVX512;
    if (td_optim_isa_supported(TD_OPTIM_ISA_AVX2)) return TD_OPTIM_ISA_AVX2;
    return TD_OPTIM_ISA_SCALAR;
}

const td_adam_kernels *td_adam_kernels_for(td_optim_isa isa)
{
    if (isa == TD_OPTIM_ISA_AUTO) isa = td_optim_isa_best();
    if (isa == TD_OPTIM_ISA_AVX512) return &td_adam_kernels_avx512;
    if (isa == TD_OPTIM_ISA_AVX2) return &td_adam_kernels_avx2;
    return &td_adam_kernels_scalar;
}

void td_adam_update_range(td_optim_isa isa, const td_adam_coeffs *c, const td_adam_chunk *chunk, size_t begin,
                          size_t end)
{
    td_adam_kernels_for(isa)->update(c, chunk, begin, end);
}

double td_grad_sumsq_range(td_optim_isa isa, const void *grad, td_dtype dtype, size_t begin, size_t end)
{
    return td_adam_kernels_for(isa)->sumsq(grad, dtype, begin, end);
}

/* ---- moment formats: reading, writing and moving pieces ---------------------- */

static td_status check_moment(td_optim_state s, td_adam_moment which, const void *buf, size_t numel, size_t begin,
                              size_t end, const void *vals, const char *what)
{
    td_status st = td_optim_state_check(s);
    if (st) return td_error_prefix(st, "%s: ", what);
    if (which != TD_ADAM_MOMENT_M && which != TD_ADAM_MOMENT_V)
        return td_error_set(TD_ERR_INVALID, "%s: bad moment %d (use TD_ADAM_MOMENT_M or _V)", what, (int)which);
    if (begin > end || end > numel)
        return td_error_set(TD_ERR_INVALID, "%s: elements [%zu, %zu) are not inside the moment's %zu", what, begin,
                            end, numel);
    if (end > begin && (!buf || !vals))
        return td_error_set(TD_ERR_INVALID, "%s: NULL buffer for %zu elements", what, end - begin);
    return TD_OK;
}

/* A piece [begin, end) of a moment of numel elements that can be stored on
 * its own: both ends on the format's alignment, or the end at numel. */
static td_status check_piece(td_optim_state s, size_t numel, size_t begin, size_t end, const char *what)
{
    size_t a = td_adam_moment_align(s);
    if (begin % a || (end % a && end != numel))
        return td_error_set(TD_ERR_INVALID, "%s: elements [%zu, %zu) of a %s moment of %zu: a piece must start on a "
                            "multiple of %zu elements (its scale block) and end on one or at the end", what, begin,
                            end, td_optim_state_name(s), numel, a);
    return TD_OK;
}

td_status td_adam_moment_read(td_optim_state s, td_adam_moment which, const void *buf, size_t numel, size_t begin,
                              size_t end, float *out)
{
    td_status st = check_moment(s, which, buf, numel, begin, end, out, "td_adam_moment_read");
    if (st) return st;
    const td_adam_kernels *k = td_adam_kernels_for(TD_OPTIM_ISA_AUTO);
    int is_v = which == TD_ADAM_MOMENT_V;
    size_t a = td_adam_moment_align(s);
    float t[TD_ADAM_INT8_BLOCK];
    /* the block begin falls inside, decoded whole, its part kept */
    if (begin < end && begin % a) {
        size_t b0 = begin / a * a, b1 = b0 + a < numel ? b0 + a : numel, e = b1 < end ? b1 : end;
        k->moment_load(s, is_v, buf, numel, t, b0, b1);
        memcpy(out, t + (begin - b0), (e - begin) * sizeof(float));
        out += e - begin;
        begin = e;
    }
    /* whole blocks */
    size_t mid = end == numel ? end : end / a * a;
    if (mid > begin) {
        k->moment_load(s, is_v, buf, numel, out, begin, mid);
        out += mid - begin;
        begin = mid;
    }
    /* the block end falls inside */
    if (begin < end) {
        size_t b1 = begin + a < numel ? begin + a : numel;
        k->moment_load(s, is_v, buf, numel, t, begin, b1);
        memcpy(out, t, (end - begin) * sizeof(float));
    }
    return TD_OK;
}

td_status td_adam_moment_write(td_optim_state s, td_adam_moment which, void *buf, size_t numel, size_t begin,
                               size_t end, const float *in)
{
    td_status st = check_moment(s, which, buf, numel, begin, end, in, "td_adam_moment_write");
    if (!st) st = check_piece(s, numel, begin, end, "td_adam_moment_write");
    if (st) return st;
    if (s == TD_OPTIM_STATE_INT8 && end == numel && numel % 4) /* the zero padding before the scales */
        memset((unsigned char *)buf + numel, 0, 4 - numel % 4);
    td_adam_kernels_for(TD_OPTIM_ISA_AUTO)->moment_store(s, which == TD_ADAM_MOMENT_V, in, buf, numel, begin, end);
    return TD_OK;
}

float *td_adam_moment_f32(td_optim_state s, void *buf, size_t begin)
{
    return s == TD_OPTIM_STATE_FP32 && buf ? (float *)buf + begin : NULL;
}

td_status td_adam_moment_spans(td_optim_state s, size_t numel, size_t begin, size_t end, td_adam_span spans[2],
                               int *count)
{
    td_status st = td_optim_state_check(s);
    if (st) return td_error_prefix(st, "td_adam_moment_spans: ");
    if (!spans || !count) return td_error_set(TD_ERR_INVALID, "td_adam_moment_spans: NULL spans or count");
    *count = 0;
    if (begin > end || end > numel)
        return td_error_set(TD_ERR_INVALID, "td_adam_moment_spans: elements [%zu, %zu) are not inside the moment's %zu",
                            begin, end, numel);
    if ((st = check_piece(s, numel, begin, end, "td_adam_moment_spans"))) return st;
    if (s != TD_OPTIM_STATE_INT8) {
        size_t e = td_dtype_bytes(td_adam_moment_dtype(s));
        spans[0] = (td_adam_span){begin * e, (end - begin) * e};
        *count = 1;
        return TD_OK;
    }
    size_t codes = (numel + 3) & ~(size_t)3, qb = TD_ADAM_INT8_BLOCK;
    spans[0] = (td_adam_span){begin, (end == numel ? codes : end) - begin};
    spans[1] = (td_adam_span){codes + begin / qb * 4, ((end + qb - 1) / qb - begin / qb) * 4};
    *count = 2;
    return TD_OK;
}

td_status td_adam_moment_copy(td_optim_state s, void *dst, size_t dst_numel, size_t dst_begin, const void *src,
                              size_t src_numel, size_t src_begin, size_t count)
{
    td_adam_span ds[2], ss[2];
    int dn, sn;
    if (dst_begin > dst_numel || count > dst_numel - dst_begin || src_begin > src_numel ||
        count > src_numel - src_begin)
        return td_error_set(TD_ERR_INVALID, "td_adam_moment_copy: %zu elements from %zu of %zu into %zu of %zu do "
                            "not fit", count, src_begin, src_numel, dst_begin, dst_numel);
    td_status st = td_adam_moment_spans(s, dst_numel, dst_begin, dst_begin + count, ds, &dn);
    if (!st) st = td_adam_moment_spans(s, src_numel, src_begin, src_begin + count, ss, &sn);
    if (st) return td_error_prefix(st, "td_adam_moment_copy: ");
    if (count && (!dst || !src)) return td_error_set(TD_ERR_INVALID, "td_adam_moment_copy: NULL buffer");
    for (int i = 0; i < dn; i++) {
        /* The same elements take the same bytes, but for int8's padding,
         * which only the piece that ends its buffer has: zeros. */
        size_t n = ds[i].bytes < ss[i].bytes ? ds[i].bytes : ss[i].bytes;
        memmove((char *)dst + ds[i].offset, (const char *)src + ss[i].offset, n);
        memset((char *)dst + ds[i].offset + n, 0, ds[i].bytes - n);
    }
    return TD_OK;
}

/* ---- the engine -------------------------------------------------------------- */

td_adam_cpu_params td_adam_cpu_default_params(void)
{
    return (td_adam_cpu_params){.threads = 0, .isa = TD_OPTIM_ISA_AUTO, .topo = NULL};
}

td_status td_adam_cpu_create(const td_adam_cpu_params *params, td_adam_cpu **out)
{
    td_status st = TD_OK;
    td_adam_cpu *cpu = NULL;
    if (!out) return td_error_set(TD_ERR_INVALID, "td_adam_cpu_create: out is NULL");
    *out = NULL;
    td_adam_cpu_params p = params ? *params : td_adam_cpu_default_params();
    if ((unsigned)p.isa >= TD_OPTIM_ISA_COUNT) TD_FAIL(TD_ERR_INVALID, "td_adam_cpu_create: bad isa %d", (int)p.isa);
    if (!td_optim_isa_supported(p.isa))
        TD_FAIL(TD_ERR_UNSUPPORTED, "this CPU lacks %s (needs %s); use --optim-isa auto or a lower one",
                td_optim_isa_name(p.isa),
                p.isa == TD_OPTIM_ISA_AVX512 ? "AVX-512 F/BW/VL/DQ" : "AVX2, FMA and F16C");
    if (p.threads < 0 || p.threads > 4096)
        TD_FAIL(TD_ERR_INVALID, "optimizer threads %d out of range: use 0 (all local cores) to 4096", p.threads);
    if (p.threads == 0) p.threads = p.topo ? td_topo_local_cores(p.topo) : omp_get_max_threads();
    if (p.threads < 1) p.threads = 1;
    cpu = td_calloc(1, sizeof *cpu, TD_ROLE_META);
    if (!cpu) TD_FAIL(TD_ERR_NOMEM, "out of memory creating the CPU optimizer");
    cpu->partials = td_calloc((size_t)p.threads * TD_PARTIAL_STRIDE, sizeof(double), TD_ROLE_META);
    if (!cpu->partials) TD_FAIL(TD_ERR_NOMEM, "out of memory creating the CPU optimizer");
    cpu->threads = p.threads;
    cpu->isa = p.isa == TD_OPTIM_ISA_AUTO ? td_optim_isa_best() : p.isa;
    cpu->k = td_adam_kernels_for(cpu->isa);
    cpu->topo = p.topo;
    *out = cpu;
    return TD_OK;
cleanup:
    td_adam_cpu_destroy(cpu);
    return st;
}

void td_adam_cpu_destroy(td_adam_cpu *cpu)
{
    if (!cpu) return;
    td_free(cpu->partials);
    td_free(cpu->claims);
    td_free(cpu);
}

td_optim_isa td_adam_cpu_isa(const td_adam_cpu *cpu) { return cpu->isa; }
int td_adam_cpu_threads(const td_adam_cpu *cpu) { return cpu->threads; }

void td_adam_cpu_partition(const td_adam_cpu *cpu, size_t numel, int thread, size_t *begin, size_t *end)
{
    size_t blocks = (numel + TD_PART_ELEMS - 1) / TD_PART_ELEMS, n = (size_t)cpu->threads, t = (size_t)thread;
    size_t per = blocks / n, extra = blocks % n;
    size_t b0 = t * per + (t < extra ? t : extra), b1 = b0 + per + (t < extra);
    *begin = b0 * TD_PART_ELEMS < numel ? b0 * TD_PART_ELEMS : numel;
    *end = b1 * TD_PART_ELEMS < numel ? b1 * TD_PART_ELEMS : numel;
}

/* Binds the calling thread's team, once per calling thread: thread t to
 * core t, except the caller itself (thread 0), whose binding is its own
 * business (the trainer's AdamW thread pins itself to core 0).  Pinned here,
 * a caller that later runs regions of all the cores would have pinned every
 * thread it starts there too (a thread inherits its creator's binding): two
 * threads on core 0, one spinning in OpenMP's wait beside the serial code
 * between regions.  W8S's weights, drawn after the first touch, took 252 s
 * before this and the init's parallel draws, 22 s after (tidal train's
 * set-up line, docs/performance.md).
 * Best effort: a machine that refuses binding still runs, with the OS
 * placing threads. */
static void bind_team(td_adam_cpu *cpu)
{
    if (!cpu->topo || (cpu->bound && pthread_equal(cpu->bound_for, pthread_self()))) return;
    td_topo *topo = cpu->topo;
    int n = cpu->threads;
#pragma omp parallel num_threads(n)
    {
        for (int t = omp_get_thread_num(); t < n; t += omp_get_num_threads())
            if (t > 0) (void)td_topo_bind_thread_to_core(topo, t, n);
    }
    cpu->bound = 1;
    cpu->bound_for = pthread_self();
}

td_status td_adam_ranges_check(const td_adam_range *r, int n, size_t numel, const char *what)
{
    if (n < 0 || (n > 0 && !r))
        return td_error_set(TD_ERR_INVALID, "%s: %d no-decay ranges at %p (give a list, or NULL and 0)", what, n,
                            (const void *)r);
    for (int i = 0; i < n; i++) {
        if (r[i].begin >= r[i].end || r[i].end > numel)
            return td_error_set(TD_ERR_INVALID, "%s: no-decay range %d [%zu, %zu) is empty or outside the chunk's %zu "
                                "elements", what, i, r[i].begin, r[i].end, numel);
        if (i && r[i].begin < r[i - 1].end)
            return td_error_set(TD_ERR_INVALID, "%s: no-decay range %d [%zu, %zu) is not after range %d [%zu, %zu): "
                                "sort the ranges and merge overlaps", what, i, r[i].begin, r[i].end, i - 1,
                                r[i - 1].begin, r[i - 1].end);
    }
    return TD_OK;
}

static td_status check_chunk(const td_adam_chunk *ch, int need_grad, const char *what)
{
    td_status st = td_optim_state_check(ch->state);
    if (st) return td_error_prefix(st, "%s: ", what);
    if ((unsigned)ch->grad_dtype >= TD_DTYPE_COUNT)
        return td_error_set(TD_ERR_INVALID, "%s: bad grad dtype %d", what, (int)ch->grad_dtype);
    if (ch->param_out && (unsigned)ch->param_dtype >= TD_DTYPE_COUNT)
        return td_error_set(TD_ERR_INVALID, "%s: bad param dtype %d", what, (int)ch->param_dtype);
    if (ch->numel && (!ch->master || !ch->m || !ch->v || (need_grad && !ch->grad)))
        return td_error_set(TD_ERR_INVALID, "%s: a chunk of %zu elements has a NULL master, m, v or grad", what,
                            ch->numel);
    if (ch->param_out && ch->param_out == (void *)ch->master && ch->param_dtype != TD_DTYPE_F32)
        return td_error_set(TD_ERR_INVALID, "%s: param_out aliases master but is %s, not fp32", what,
                            td_dtype_name(ch->param_dtype));
    if (ch->param_out && ch->param_out == ch->grad && ch->param_dtype != ch->grad_dtype)
        return td_error_set(TD_ERR_INVALID, "%s: param_out aliases the grads but is %s and the grads are %s: each "
                            "element's param would overwrite grads not yet read; give them one dtype or separate "
                            "buffers", what, td_dtype_name(ch->param_dtype), td_dtype_name(ch->grad_dtype));
    return td_adam_ranges_check(ch->no_decay, ch->n_no_decay, ch->numel, what);
}

td_status td_adam_cpu_update(td_adam_cpu *cpu, const td_adam_coeffs *c, const td_adam_chunk *chunks, int n)
{
    if (!cpu || !c || (n > 0 && !chunks) || n < 0)
        return td_error_set(TD_ERR_INVALID, "td_adam_cpu_update: NULL engine, coefficients or chunks");
    for (int j = 0; j < n; j++) {
        td_status st = check_chunk(&chunks[j], 1, "td_adam_cpu_update");
        if (st) return td_error_prefix(st, "chunk %d: ", j);
    }
    if (n > cpu->claim_chunks) {
        claim *c2 = td_calloc((size_t)n * (size_t)cpu->threads, sizeof *c2, TD_ROLE_META);
        if (!c2) return td_error_set(TD_ERR_NOMEM, "td_adam_cpu_update: out of memory for %d chunks' counters", n);
        td_free(cpu->claims);
        cpu->claims = c2;
        cpu->claim_chunks = n;
    }
    bind_team(cpu);
    const td_adam_kernels *k = cpu->k;
    int threads = cpu->threads;
    claim *claims = cpu->claims;
    for (size_t i = 0; i < (size_t)n * (size_t)threads; i++) atomic_store_explicit(&claims[i].next, 0, memory_order_relaxed);
#pragma omp parallel num_threads(threads)
    {
        /* Its own range first, then what the others have left, in turn
         * (a team smaller than asked for covers every range too). */
        int me = omp_get_thread_num();
        for (int j = 0; j < n; j++)
            for (int s = 0; s < threads; s++) {
                int t = (me + s) % threads;
                size_t b, e, q;
                td_adam_cpu_partition(cpu, chunks[j].numel, t, &b, &e);
                size_t pieces = (e - b + TD_PIECE_ELEMS - 1) / TD_PIECE_ELEMS;
                claim *cl = &claims[(size_t)j * (size_t)threads + (size_t)t];
                while (b < e && (q = atomic_fetch_add_explicit(&cl->next, 1, memory_order_relaxed)) < pieces) {
                    size_t pb = b + q * TD_PIECE_ELEMS, pe = pb + TD_PIECE_ELEMS < e ? pb + TD_PIECE_ELEMS : e;
                    k->update(c, &chunks[j], pb, pe);
                }
            }
    }
    return TD_OK;
}

td_status td_adam_cpu_grad_stats(td_adam_cpu *cpu, const void *grad, td_dtype dtype, size_t numel,
                                 td_grad_stats *acc)
{
    if (!cpu || !acc || (numel && !grad))
        return td_error_set(TD_ERR_INVALID, "td_adam_cpu_grad_stats: NULL engine, grad or accumulator");
    if ((unsigned)dtype >= TD_DTYPE_COUNT)
        return td_error_set(TD_ERR_INVALID, "td_adam_cpu_grad_stats: bad grad dtype %d", (int)dtype);
    bind_team(cpu);
    const td_adam_kernels *k = cpu->k;
    int threads = cpu->threads;
    double *partials = cpu->partials;
#pragma omp parallel num_threads(threads)
    {
        for (int t = omp_get_thread_num(); t < threads; t += omp_get_num_threads()) {
            size_t b, e;
            td_adam_cpu_partition(cpu, numel, t, &b, &e);
            partials[(size_t)t * TD_PARTIAL_STRIDE] = b < e ? k->sumsq(grad, dtype, b, e) : 0.0;
        }
    }
    double sum = 0.0;
    for (int t = 0; t < threads; t++) sum += partials[(size_t)t * TD_PARTIAL_STRIDE];
    acc->sumsq += sum;
    return TD_OK;
}

static float load_elem(const void *p, td_dtype dt, size_t i)
{
    if (dt == TD_DTYPE_BF16) return td_f32_from_bf16(((const uint16_t *)p)[i]);
    if (dt == TD_DTYPE_F16) return td_f32_from_f16(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static void store_elem(void *p, td_dtype dt, size_t i, float x)
{
    if (dt == TD_DTYPE_BF16) ((uint16_t *)p)[i] = td_bf16_from_f32(x);
    else if (dt == TD_DTYPE_F16) ((uint16_t *)p)[i] = td_f16_from_f32(x);
    else ((float *)p)[i] = x;
}

/* Zeroes elements [b, e) of a moment buffer; int8: their codes and the
 * scales of the blocks they start (bounds are multiples of the block), and
 * the padding after the codes if e is the end. */
static void moment_zero(void *mom, td_optim_state st, size_t numel, size_t b, size_t e)
{
    unsigned char *p = mom;
    if (st == TD_OPTIM_STATE_FP32 || st == TD_OPTIM_STATE_BF16) {
        size_t esz = st == TD_OPTIM_STATE_FP32 ? 4 : 2;
        memset(p + b * esz, 0, (e - b) * esz);
        return;
    }
    size_t codes = (numel + 3) & ~(size_t)3, qb = TD_ADAM_INT8_BLOCK;
    memset(p + b, 0, (e == numel ? codes : e) - b);
    size_t b0 = b / qb, b1 = (e + qb - 1) / qb;
    memset(p + codes + b0 * 4, 0, (b1 - b0) * 4);
}

td_status td_adam_cpu_init(td_adam_cpu *cpu, const td_adam_chunk *chunk, const void *init, td_dtype init_dtype)
{
    if (!cpu || !chunk) return td_error_set(TD_ERR_INVALID, "td_adam_cpu_init: NULL engine or chunk");
    td_status st = check_chunk(chunk, 0, "td_adam_cpu_init");
    if (st) return st;
    if (init && (unsigned)init_dtype >= TD_DTYPE_COUNT)
        return td_error_set(TD_ERR_INVALID, "td_adam_cpu_init: bad init dtype %d", (int)init_dtype);
    bind_team(cpu);
    int threads = cpu->threads;
#pragma omp parallel num_threads(threads)
    {
        for (int t = omp_get_thread_num(); t < threads; t += omp_get_num_threads()) {
            size_t b, e;
            td_adam_cpu_partition(cpu, chunk->numel, t, &b, &e);
            if (b >= e) continue;
            if (init)
                for (size_t i = b; i < e; i++) chunk->master[i] = load_elem(init, init_dtype, i);
            else
                memset(chunk->master + b, 0, (e - b) * sizeof(float));
            moment_zero(chunk->m, chunk->state, chunk->numel, b, e);
            moment_zero(chunk->v, chunk->state, chunk->numel, b, e);
            if (chunk->param_out && chunk->param_out != (void *)chunk->master)
                for (size_t i = b; i < e; i++) store_elem(chunk->param_out, chunk->param_dtype, i, chunk->master[i]);
        }
    }
    return TD_OK;
}
