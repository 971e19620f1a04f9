/* optim: AdamW for chunks of plain arrays, on all CPU cores, with mixed
 * precision, loss scaling, global grad-norm clipping and LR schedules.
 *
 * A training step, as the trainer drives it:
 *   1. as each grad chunk arrives:  td_adam_cpu_grad_stats(cpu, grad, ..., &stats)
 *      (or td_grad_sumsq_cuda for chunks on the GPU); with several GPUs,
 *      all-reduce(sum) `stats.sumsq` (one double) across ranks;
 *   2. once:  td_optim_begin_step(&opt, &stats, &step)  decides skip / lr /
 *      clip coefficient and fills `step.coeffs`;
 *   3. unless step.skip, for each chunk:  td_adam_cpu_update(cpu, &step.coeffs,
 *      &chunk, 1)  (or td_adam_update_cuda, same coefficients, same result).
 *
 * The update follows torch.optim.AdamW (and torch.optim.Adam with L2 decay);
 * docs/optimizer.md gives the exact formulas.  In one pass over a chunk it
 * reads the grads (fp32, bf16 or fp16), unscales and clips them with one
 * multiplier, applies decay, updates m, v (fp32, bf16 or 8-bit block-wise
 * quantized: td_optim_state) and the fp32 master in place, and writes the
 * new params rounded to bf16/fp16 (RNE, see convert.h) into a caller-given
 * buffer (the pinned upload buffer).
 *
 * The CPU kernels exist for AVX-512, AVX2+FMA and plain C, generated from one
 * definition (optim/adam_kernel.h) and chosen at run time.  All three compute
 * the same operations in the same order with the same roundings (fused
 * multiply-adds included), so their results are bit-identical; so is the CUDA
 * kernel (optim_cuda.h).
 *
 * Ownership: chunks (master, m, v, grads, param buffers) belong to the caller;
 * td_adam_cpu only owns its small team bookkeeping.  td_optim, td_loss_scaler
 * and td_lr_schedule are plain caller-owned structs (no allocation) whose
 * fields are the training state to checkpoint.
 * Thread-safety: a td_adam_cpu runs one call at a time (it uses an OpenMP
 * team of its own); different td_adam_cpu objects may run concurrently.
 * The pure functions (schedules, coefficients, conversions) are thread-safe. */
#ifndef TIDAL_OPTIM_H
#define TIDAL_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/dtype.h"
#include "tidal/status.h"
#include "tidal/topo.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of grads, params and init values are td_dtype (dtype.h):
 * fp32, bf16 or fp16. */

/* ---- moment formats (--optim-state) ---------------------------------------
 * optim/ owns how AdamW's moments m and v are stored, end to end: the
 * formats, their sizes, their conversions to and from fp32 and their
 * packing; everyone else (the chunk manager, checkpoints, a disk tier)
 * treats a moment as an opaque byte array of td_adam_moment_bytes and moves
 * pieces of it through the calls below.  The fp32 master is fp32 always.
 *   fp32  exact (torch.optim.AdamW)
 *   bf16  m and v rounded to bf16 after each update: m to nearest even, v
 *         stochastically (from a hash of the step and the element index, so
 *         still deterministic), because v * beta2 moves v by less than half
 *         a bf16 step and nearest rounding would freeze it
 *   int8  m and v as 8-bit codes, block-wise quantized with one fp32 scale
 *         per TD_ADAM_INT8_BLOCK elements (Dettmers et al. 2021); m's codes
 *         rounded to nearest, v's stochastically (the same hash as bf16's)
 * A moment buffer of `numel` elements is laid out as
 *   fp32  numel floats
 *   bf16  numel bf16 codes (uint16)
 *   int8  numel 8-bit codes, zero bytes up to a multiple of 4, then one fp32
 *         scale (the block's absmax) per block; m's codes are sign + E4M3,
 *         v's are E5M3 (docs/optimizer.md)
 * A zero-initialised format is fp32. */
typedef enum td_optim_state {
    TD_OPTIM_STATE_FP32,
    TD_OPTIM_STATE_BF16,
    TD_OPTIM_STATE_INT8,
    TD_OPTIM_STATE_COUNT
} td_optim_state;

/* Elements per int8 scale block: divides 1024, so the CPU team's ranges
 * (multiples of 1024 elements) never split a block. */
#define TD_ADAM_INT8_BLOCK 256

const char *td_optim_state_name(td_optim_state s);            /* "fp32", "bf16", "int8" */
td_status td_optim_state_parse(const char *name, td_optim_state *out);
/* TD_ERR_INVALID naming the value unless s is one of the formats. */
td_status td_optim_state_check(td_optim_state s);
/* Bytes of one moment buffer (m or v) for `numel` elements, block scales
 * included (0 for a format that does not exist). */
size_t td_adam_moment_bytes(td_optim_state s, size_t numel);
/* Host bytes a parameter of the AdamW state: fp32 master + m + v (block
 * scales amortised), e.g. 12 for fp32, 8 for bf16, about 6 for int8. */
double td_adam_state_bytes_per_param(td_optim_state s);
/* The element type of a format that stores one value per element (fp32:
 * TD_DTYPE_F32, bf16: TD_DTYPE_BF16), or TD_DTYPE_COUNT for one with a
 * layout of its own (int8), which a chunk manager sizes with
 * td_adam_moment_bytes. */
td_dtype td_adam_moment_dtype(td_optim_state s);
/* The elements a piece of a moment buffer starts on when it is written or
 * copied on its own: 1 (fp32, bf16) or TD_ADAM_INT8_BLOCK (int8, whose
 * scales cover whole blocks).  A piece ends on a multiple of it, or at the
 * buffer's end.  A shard of a chunk's state (ZeRO-3) starts on one. */
size_t td_adam_moment_align(td_optim_state s);
/* A multiple of every format's td_adam_moment_align: pieces of a multiple
 * of it are aligned for whichever format a caller meets (a buffer that
 * moves moments in pieces sizes itself by it, knowing no format). */
#define TD_ADAM_MOMENT_ALIGN_MAX TD_ADAM_INT8_BLOCK

/* Which moment a buffer holds: int8 codes m (signed) and v (>= 0) differ. */
typedef enum td_adam_moment {
    TD_ADAM_MOMENT_M,
    TD_ADAM_MOMENT_V,
} td_adam_moment;

/* Elements [begin, end) of a moment buffer of `numel` elements as fp32
 * values, out[0 .. end - begin): any bounds (int8: the blocks they touch are
 * decoded).  Exact: every stored value is an fp32 value. */
td_status td_adam_moment_read(td_optim_state s, td_adam_moment which, const void *buf, size_t numel, size_t begin,
                              size_t end, float *out);
/* Elements [begin, end) of a moment buffer of `numel` elements from fp32
 * values in[0 .. end - begin), rounded exactly as the update rounds them
 * (int8: per block, the absmax is the scale; v's code keeps magnitudes
 * only), except that v is rounded to nearest here: writing what
 * td_adam_moment_read gave restores the same bits.  begin and end on the
 * format's alignment (end may be numel; the int8 padding is then zeroed).
 * For checkpoints, conversions between formats and tests. */
td_status td_adam_moment_write(td_optim_state s, td_adam_moment which, void *buf, size_t numel, size_t begin,
                               size_t end, const float *in);
/* Elements from `begin` as fp32 values in place, for a format that stores
 * them so (fp32): a zero-copy read or write; NULL for the others. */
float *td_adam_moment_f32(td_optim_state s, void *buf, size_t begin);

/* Where elements [begin, end) of a moment buffer of `numel` elements lie
 * in it, in its storage format: one byte range (fp32, bf16), or two (int8:
 * the codes, with the padding when end is numel, then the scales of their
 * blocks).  *count receives how many.  begin and end as for
 * td_adam_moment_write.  For reading and writing a piece of a moment where
 * it is stored (a file holding a chunk's state) without converting it. */
typedef struct td_adam_span {
    size_t offset, bytes;
} td_adam_span;
td_status td_adam_moment_spans(td_optim_state s, size_t numel, size_t begin, size_t end, td_adam_span spans[2],
                               int *count);
/* Copies `count` elements of moment `src` (src_numel elements) from
 * src_begin into moment `dst` (dst_numel elements) at dst_begin, in the
 * storage format, bit for bit: a piece of a chunk's state into a buffer of
 * its own and back.  Starts on the format's alignment; each piece ends on
 * it or at its buffer's end. */
td_status td_adam_moment_copy(td_optim_state s, void *dst, size_t dst_numel, size_t dst_begin, const void *src,
                              size_t src_numel, size_t src_begin, size_t count);

/* ---- AdamW hyper-parameters and per-step coefficients --------------------- */

typedef enum td_adam_decay {
    TD_ADAM_DECAY_DECOUPLED, /* AdamW: p *= 1 - lr*wd before the update */
    TD_ADAM_DECAY_L2,        /* Adam:  g += wd*p */
} td_adam_decay;

typedef struct td_adam_hparams {
    double beta1, beta2, eps, weight_decay;
    td_adam_decay decay;
} td_adam_hparams;

/* torch.optim.AdamW's defaults: betas (0.9, 0.999), eps 1e-8, wd 0.01, decoupled. */
td_adam_hparams td_adam_default_hparams(void);
td_status td_adam_hparams_check(const td_adam_hparams *hp);

/* Scalars of one step, shared by every chunk and by the CPU and GPU kernels.
 * Computed in double by td_adam_coeffs_make, then rounded once to fp32. */
typedef struct td_adam_coeffs {
    float grad_mul;        /* clip_coef / loss_scale */
    float l2;              /* L2: weight_decay; decoupled: 0 */
    float decay_mul;       /* decoupled: 1 - lr*weight_decay; L2: 1 */
    float beta1, one_minus_beta1;
    float beta2, one_minus_beta2;
    float step_size;       /* lr / (1 - beta1^t) */
    float rsqrt_bc2;       /* 1 / sqrt(1 - beta2^t) */
    float eps;
    uint32_t sr_seed;      /* bf16 state: the stream of this step's stochastic rounding of v (from t) */
} td_adam_coeffs;

/* `step` is the 1-based AdamW step t (already incremented, as torch does). */
td_status td_adam_coeffs_make(const td_adam_hparams *hp, double lr, long step, double grad_mul,
                              td_adam_coeffs *out);

/* One chunk: `numel` elements of each array.  master, m, v are updated in
 * place; param_out (may be NULL) receives the new master rounded to
 * param_dtype.  m and v are moment buffers of td_adam_moment_bytes(state,
 * numel) bytes each in the layout of `state` (above).  Arrays must not overlap, except that param_out may be `master`
 * itself when param_dtype is fp32 (a no-op copy), and, on the CPU, param_out
 * may be `grad` itself when param_dtype equals grad_dtype (each element's
 * grad is read before its param is written: a host copy that holds a
 * chunk's grads until its AdamW writes the new params over them).  Arrays need only their
 * elements' natural alignment (int8 moments: none); 64-byte alignment is
 * fastest. */
/* Elements [begin, end) of a chunk (indices into the chunk, 0-based). */
typedef struct td_adam_range {
    size_t begin, end;
} td_adam_range;

/* no_decay (optional) lists the elements that take no weight decay, e.g.
 * the norm gains and biases of a chunk that also holds matrices: sorted,
 * non-empty, non-overlapping ranges inside [0, numel).  Their elements are
 * updated with decay_mul 1 and l2 0 (what td_adam_coeffs_make gives for
 * weight_decay 0), the others with the step's coefficients, so one call
 * equals torch.optim.AdamW with two param groups bit for bit, whatever the
 * state type (int8: a scale block that straddles a boundary is dequantized,
 * updated element by element with each element's coefficients and
 * requantized whole).  NULL / 0: every element decays.  For the CUDA
 * update the list is in device memory, like the arrays. */
typedef struct td_adam_chunk {
    float *master;
    void *m, *v;
    const void *grad;
    td_dtype grad_dtype;
    void *param_out;
    td_dtype param_dtype;
    size_t numel;
    td_optim_state state;
    const td_adam_range *no_decay;
    int n_no_decay;
} td_adam_chunk;

/* Checks a no-decay list against numel (sorted, non-empty, disjoint, inside);
 * `what` names the caller in the message.  Host memory only. */
td_status td_adam_ranges_check(const td_adam_range *r, int n, size_t numel, const char *what);

/* ---- gradient statistics: global clipping and overflow ------------------- */

/* Partial sums for global clipping and overflow detection: the sum of
 * squares of the grads as stored (still multiplied by the loss scale),
 * accumulated in double.  A square of a finite fp32 cannot overflow a
 * double, so the sum is non-finite exactly when some grad is Inf or NaN:
 * one all-reduce(sum) of `sumsq` across ranks carries both the norm and the
 * overflow flag. */
typedef struct td_grad_stats {
    double sumsq;
} td_grad_stats;

static inline void td_grad_stats_merge(td_grad_stats *acc, const td_grad_stats *part) { acc->sumsq += part->sumsq; }
/* 1 when some grad was Inf or NaN. */
int td_grad_stats_overflow(const td_grad_stats *s);
/* The global L2 norm of the unscaled grads: sqrt(sumsq) / loss_scale. */
double td_grad_stats_norm(const td_grad_stats *s, double loss_scale);
/* torch.nn.utils.clip_grad_norm_'s coefficient: min(1, max_norm / (norm + 1e-6));
 * 1 when max_norm <= 0 (clipping off). */
double td_clip_coef(double norm, double max_norm);

/* ---- the CPU engine -------------------------------------------------------- */

typedef enum td_optim_isa {
    TD_OPTIM_ISA_AUTO,   /* the best this CPU supports */
    TD_OPTIM_ISA_SCALAR,
    TD_OPTIM_ISA_AVX2,   /* AVX2 + FMA + F16C */
    TD_OPTIM_ISA_AVX512, /* AVX-512 F/BW/VL/DQ */
    TD_OPTIM_ISA_COUNT
} td_optim_isa;

const char *td_optim_isa_name(td_optim_isa isa);             /* "auto", "scalar", "avx2", "avx512" */
td_status td_optim_isa_parse(const char *name, td_optim_isa *out);
int td_optim_isa_supported(td_optim_isa isa);                /* on this CPU; AUTO and SCALAR: 1 */
td_optim_isa td_optim_isa_best(void);

typedef struct td_adam_cpu td_adam_cpu;

typedef struct td_adam_cpu_params {
    int threads;        /* 0: the local cores of `topo`, else omp_get_max_threads() */
    td_optim_isa isa;   /* default AUTO */
    td_topo *topo;      /* optional: bind thread i of the team to local core i (hwloc);
                           must outlive the engine */
} td_adam_cpu_params;

td_adam_cpu_params td_adam_cpu_default_params(void);
td_status td_adam_cpu_create(const td_adam_cpu_params *params, td_adam_cpu **out);
void td_adam_cpu_destroy(td_adam_cpu *cpu);  /* NULL is a no-op */
td_optim_isa td_adam_cpu_isa(const td_adam_cpu *cpu);
int td_adam_cpu_threads(const td_adam_cpu *cpu);

/* Every call splits each chunk the same way: thread i of the team owns one
 * contiguous range, whose bounds are multiples of 1024 elements (4 KiB of
 * fp32), so the thread that first touches a page in td_adam_cpu_init is the
 * one that updates it every step (NUMA first touch, warm private caches).
 * The same range bounds are used by every call, whatever the chunk. */
void td_adam_cpu_partition(const td_adam_cpu *cpu, size_t numel, int thread, size_t *begin, size_t *end);

/* First touch: master := init (converted from init_dtype; NULL init: zeros),
 * m := v := 0 (compact state: zero codes and zero scales), and param_out
 * (if any) := master rounded, each page written
 * by the thread that will update it.  chunk->grad is not read. */
td_status td_adam_cpu_init(td_adam_cpu *cpu, const td_adam_chunk *chunk, const void *init, td_dtype init_dtype);

/* Adds the chunk's grad sum of squares to *acc (deterministic for a given
 * team size and ISA). */
td_status td_adam_cpu_grad_stats(td_adam_cpu *cpu, const void *grad, td_dtype dtype, size_t numel,
                                 td_grad_stats *acc);

/* The fused update of `n` chunks in one parallel region. */
td_status td_adam_cpu_update(td_adam_cpu *cpu, const td_adam_coeffs *c, const td_adam_chunk *chunks, int n);

/* The update of elements [begin, end) of one chunk on the calling thread with
 * the given ISA's kernel (tests and other schedulers; no checks of the ISA
 * or of chunk->no_decay, whose indices stay those of the whole chunk).
 * With int8 state a scale block is requantized as a whole: begin must be a
 * multiple of TD_ADAM_INT8_BLOCK and end one too, or numel. */
void td_adam_update_range(td_optim_isa isa, const td_adam_coeffs *c, const td_adam_chunk *chunk, size_t begin,
                          size_t end);
/* Sum of squares of grads [begin, end) on the calling thread. */
double td_grad_sumsq_range(td_optim_isa isa, const void *grad, td_dtype dtype, size_t begin, size_t end);

/* ---- LR schedules ---------------------------------------------------------- */

typedef enum td_lr_decay {
    TD_LR_DECAY_CONSTANT,
    TD_LR_DECAY_COSINE,
    TD_LR_DECAY_LINEAR,
    TD_LR_DECAY_NOAM,
    TD_LR_DECAY_EXPONENTIAL,
    TD_LR_DECAY_COUNT
} td_lr_decay;

/* Linear warmup over `warmup_steps` (step t <= W: lr * t / W, so the first
 * step's lr is lr / W, never 0), then the decay, never below min_lr, on the
 * clock k = t - W - 1 (0 on the first step after warmup, which runs at lr):
 *   constant     lr
 *   cosine       min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2
 *   linear       min_lr + (lr - min_lr) * (1 - p)
 *   noam         max(min_lr, lr * sqrt(W' / t)),    W' = max(W, 1)
 *   exponential  max(min_lr, lr * gamma^k)
 * with p = k / (total_steps - W - 1) clamped to [0, 1], so cosine and linear
 * reach min_lr at step total_steps (which must be >= W + 2).  Noam is the
 * usual lr * min(t / W', sqrt(W' / t)): warmup and decay meet at t = W'.
 * td_lr_at expects a schedule that passed td_lr_schedule_check. */
typedef struct td_lr_schedule {
    td_lr_decay decay;
    double lr;           /* peak */
    double min_lr;       /* floor of the decay */
    long warmup_steps;
    long total_steps;    /* cosine, linear: the step where lr reaches min_lr */
    double gamma;        /* exponential: factor per step, in (0, 1] */
} td_lr_schedule;

td_lr_schedule td_lr_schedule_default(void);  /* constant 1e-4, no warmup */
td_status td_lr_schedule_check(const td_lr_schedule *s);
/* The lr of 1-based step t (t < 1 is treated as 1). */
double td_lr_at(const td_lr_schedule *s, long step);
const char *td_lr_decay_name(td_lr_decay d);
td_status td_lr_decay_parse(const char *name, td_lr_decay *out);

/* ---- loss scaling ------------------------------------------------------------ */

typedef enum td_loss_scale_kind {
    TD_LOSS_SCALE_NONE,    /* scale 1 (bf16, fp32) */
    TD_LOSS_SCALE_STATIC,  /* init_scale, fixed */
    TD_LOSS_SCALE_DYNAMIC, /* grows after clean runs, backs off on overflow */
} td_loss_scale_kind;

typedef struct td_loss_scaler_params {
    td_loss_scale_kind kind;
    double init_scale;       /* 65536 */
    double growth_factor;    /* 2 */
    double backoff_factor;   /* 0.5 */
    long growth_interval;    /* 1000 clean steps in a row */
    int hysteresis;          /* 2: overflows it takes to back off (1: every one) */
    double min_scale;        /* 1 */
} td_loss_scaler_params;

/* Whatever the kind, a step whose grads hold an Inf or NaN is skipped (no
 * update, no schedule step) and counted.  Dynamic (DeepSpeed's rule): an
 * overflow resets the clean run and uses up one unit of hysteresis; when
 * none is left the scale is multiplied by backoff_factor (not below
 * min_scale), and every later overflow backs off at once until the next
 * growth; after growth_interval clean steps in a row the scale is multiplied
 * by growth_factor and the hysteresis refilled. */
typedef struct td_loss_scaler {
    td_loss_scaler_params params;
    double scale;           /* the scale for the next backward */
    long clean_steps;       /* clean steps since the last overflow or growth */
    int hysteresis_left;
    long overflows;         /* skipped steps so far */
} td_loss_scaler;

td_loss_scaler_params td_loss_scaler_default_params(void); /* kind NONE, dynamic values as above */
/* TD_ERR_INVALID naming the bad value. */
td_status td_loss_scaler_params_check(const td_loss_scaler_params *p);
td_status td_loss_scaler_init(td_loss_scaler *s, const td_loss_scaler_params *p);
/* Records one step's outcome; returns 1 when the step must be skipped. */
int td_loss_scaler_update(td_loss_scaler *s, int overflow);
td_status td_loss_scale_kind_parse(const char *name, td_loss_scale_kind *out);

/* ---- the step controller -------------------------------------------------- */

typedef struct td_optim_params {
    td_adam_hparams adam;
    td_lr_schedule lr;
    td_loss_scaler_params scaler;
    double max_grad_norm;   /* <= 0: no clipping (default 1.0) */
    td_optim_state state;   /* how m and v are stored (default fp32) */
} td_optim_params;

td_optim_params td_optim_default_params(void);
/* The one validity check of an optimizer's configuration, made where it is
 * configured (td_optim_init, td_train_config_check): the hyper-parameters,
 * the schedule, the loss scaler's parameters, max_grad_norm and the moment
 * format; TD_ERR_INVALID with a message naming the bad value and what to
 * use instead. */
td_status td_optim_params_check(const td_optim_params *p);

typedef struct td_optim {
    td_optim_params params;
    td_loss_scaler scaler;
    long step;              /* AdamW steps taken (t of the last update) */
    long skipped_steps;
} td_optim;

/* What td_optim_begin_step decided for this step. */
typedef struct td_optim_step {
    int skip;               /* overflow: do not update, the schedule does not advance */
    long step;              /* t of this update (unchanged when skipped) */
    double lr, loss_scale;  /* loss_scale: what the grads were multiplied by */
    double grad_norm;       /* global norm of the unscaled grads (Inf/NaN on overflow) */
    double clip_coef;
    td_adam_coeffs coeffs;  /* valid unless skip */
} td_optim_step;

td_status td_optim_init(td_optim *o, const td_optim_params *p);
/* The scale to multiply the loss by before the next backward. */
double td_optim_loss_scale(const td_optim *o);
/* Takes the global stats of this step's grads (all chunks, all ranks). */
td_status td_optim_begin_step(td_optim *o, const td_grad_stats *global, td_optim_step *out);

#ifdef __cplusplus
}
#endif
#endif
