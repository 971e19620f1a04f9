/* The rotary decoder's block, head and embedding on the GPU (rotary.h), composed from
 * the CUDA ops: the counterpart of rotary.c's CPU reference, the same
 * order and the same activations kept (td_ops_cuda_block_acts's fields as
 * td_model_block_acts maps them: no means, qkv after RoPE, atty (N, NH hs),
 * fch the gate|up product, fch_gelu act(gate) * up), with the fusions the
 * GPU ops offer:
 *   forward   the residual adds ride in o_proj's and down_proj's GEMMs
 *             (beta = 1 on the residual input); RoPE rotates q and k of the
 *             fused qkv in one launch;
 *             LoRA targets add their updates right after their module's
 *             product (lora.cu), q, k and v before RoPE;
 *   backward  input gradients are written (SET), and the GLU backward
 *             runs in place over the gate|up gradient buffer.
 * Backward scratch: dA (N, max(2H, QKV)) for dgate_up, later dqkv; dB (N,H);
 * dres2 (N,C); dc (N, max(C, A)) for dln2, datty, dln1; LoRA's dxa (N,R); then the op scratch
 * (matmul / RMSNorm partial sums, or attention's buffers).
 * RoPE's frequency table (hs/2 fp32 on the device) is the family's
 * constants (consts_fill), uploaded once by the caller.
 *
 * Then the decoder's td_model_exec (family.h) over these. */
#include "../rotary.h"

#include <string.h>

#include "tidal/arena.h"
#include "tidal/ops_cuda.h"
#include "tidal/util.h"

#define ALIGN 256
static size_t up(size_t b) { return (b + ALIGN - 1) / ALIGN * ALIGN; }
static size_t max2(size_t a, size_t b) { return a > b ? a : b; }

typedef struct sizes { size_t N, C, NH, NKV, hs, A, QKV, H, e; } sizes;

static sizes sizes_of(const td_model_desc *cfg, int B, int T, td_dtype dt)
{
    sizes s = { (size_t)B * T, (size_t)cfg->n_embd, (size_t)cfg->n_head, (size_t)td_model_kv_heads(cfg),
                (size_t)td_model_head_size(cfg), (size_t)td_model_attn_width(cfg), (size_t)td_model_qkv_width(cfg),
                (size_t)td_model_mlp_width(cfg), td_dtype_bytes(dt) };
    return s;
}

/* Bytes of each acts field in td_ops_cuda_block_acts order (the means absent). */
static void acts_fields(const td_model_desc *cfg, int B, int T, td_dtype dt, size_t b[12])
{
    const sizes s = sizes_of(cfg, B, T, dt);
    const size_t f = sizeof(float);
    const size_t t[12] = { s.N * s.C * s.e, 0, s.N * f, s.N * s.QKV * s.e, s.N * s.A * s.e,
                           s.N * s.NH * f, s.N * s.C * s.e, s.N * s.C * s.e, 0, s.N * f,
                           s.N * 2 * s.H * s.e, s.N * s.H * s.e };
    memcpy(b, t, sizeof t);
}

size_t td_ops_cuda_rotary_block_acts_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt)
{
    size_t b[12], total = 0;
    acts_fields(cfg, B, T, dt, b);
    for (int i = 0; i < 12; i++) total += up(b[i]);
    return total + td_ops_cuda_lora_acts_bytes(cfg, B, T, dt);
}

void td_ops_cuda_rotary_block_acts_view(const td_model_desc *cfg, int B, int T, td_dtype dt, void *base,
                                         td_ops_cuda_block_acts *out)
{
    size_t b[12];
    acts_fields(cfg, B, T, dt, b);
    void **slot[12] = { &out->ln1, (void **)&out->ln1_mean, (void **)&out->ln1_rstd, &out->qkv, &out->atty,
                        (void **)&out->att_lse, &out->res2, &out->ln2, (void **)&out->ln2_mean,
                        (void **)&out->ln2_rstd, &out->fch, &out->fch_gelu };
    char *p = base;
    for (int i = 0; i < 12; i++) {
        *slot[i] = b[i] ? p : NULL;
        p += up(b[i]);
    }
    out->lora_xa = td_model_lora_count(cfg) ? p : NULL; /* the adapters' xa after the twelve */
    out->lora_drop = NULL; /* the exec sets the run's key */
}

static size_t op_scratch(const td_model_desc *cfg, int B, int T, td_dtype dt, int att_seqs)
{
    const sizes s = sizes_of(cfg, B, T, dt);
    size_t need = td_ops_cuda_attention_gqa_scratch_bytes(att_seqs, T, (int)s.NH, (int)s.NKV, (int)s.hs, dt);
    need = max2(need, td_ops_cuda_matmul_scratch_bytes((int)s.N, (int)(2 * s.H)));
    need = max2(need, td_ops_cuda_matmul_scratch_bytes((int)s.N, (int)s.QKV));
    need = max2(need, td_ops_cuda_matmul_scratch_bytes((int)s.N, (int)s.C));
    return max2(need, td_ops_cuda_rmsnorm_scratch_bytes((int)s.N, (int)s.C));
}

static size_t fixed_scratch(const td_model_desc *cfg, int B, int T, td_dtype dt)
{
    const sizes s = sizes_of(cfg, B, T, dt);
    return up(s.N * max2(2 * s.H, s.QKV) * s.e) + up(s.N * s.H * s.e) + up(s.N * s.C * s.e) +
           up(s.N * max2(s.C, s.A) * s.e) + td_ops_cuda_lora_scratch_bytes(cfg, B, T, dt);
}

size_t td_ops_cuda_rotary_block_scratch_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt, int att_seqs)
{
    if (!cfg || B <= 0 || T <= 0) return 0;
    if (att_seqs < 1 || att_seqs > B) att_seqs = B;
    return fixed_scratch(cfg, B, T, dt) + op_scratch(cfg, B, T, dt, att_seqs);
}

#define TRY(expr)                                                                \
    do {                                                                         \
        td_status st_ = (expr);                                                  \
        if (st_ != TD_OK) return td_error_prefix(st_, "%s: ", what);             \
    } while (0)

td_status td_ops_cuda_rotary_block_forward(td_ops_cuda *ctx, const td_model_desc *cfg, const td_ops_cuda_block *w,
                                            const td_ops_cuda_block_acts *a, const float *inv_freq, const void *x,
                                            void *y, const int *pos, int B, int T, td_dtype dt, void *scratch,
                                            size_t scratch_bytes, void *stream)
{
    const char *what = "decoder block forward";
    if (!cfg || !w || !a || !inv_freq || !x) return td_error_set(TD_ERR_INVALID, "%s: NULL argument", what);
    if (x == y) return td_error_set(TD_ERR_INVALID, "%s: y must not alias x (backward needs x)", what);
    const sizes s = sizes_of(cfg, B, T, dt);
    const int N = (int)s.N, C = (int)s.C, NH = (int)s.NH, NKV = (int)s.NKV, hs = (int)s.hs;
    const int A = (int)s.A, QKV = (int)s.QKV, H = (int)s.H;
    const float eps = td_model_norm_eps(cfg);
    const td_model_traits *sty = td_rotary_traits(cfg);
    const float off = sty->norm_offset;
    TRY(td_ops_cuda_rmsnorm_forward(a->ln1, a->ln1_rstd, x, w->ln1_w, off, N, C, eps, dt, stream));
    TRY(td_ops_cuda_matmul_forward(ctx, a->qkv, NULL, a->ln1, w->qkv_w, w->qkv_b, NULL, N, C, QKV, dt, stream));
    /* the adapters' dropped input (a dropout) goes into the scratch: the ops between them are done with it */
    TRY(td_ops_cuda_lora_forward(ctx, cfg, w, a, TD_MODEL_QKV_W, a->ln1, a->qkv, QKV, N, dt, scratch,
                                 stream)); /* before RoPE */
    TRY(td_ops_cuda_rope_forward(a->qkv, inv_freq, pos, B, T, NH + NKV, hs, (size_t)QKV, dt, stream)); /* q and k */
    TRY(td_ops_cuda_attention_gqa_forward(ctx, a->atty, a->att_lse, a->qkv, pos, B, T, NH, NKV, hs, dt, scratch,
                                          scratch_bytes, stream));
    TRY(td_ops_cuda_matmul_forward(ctx, a->res2, NULL, a->atty, w->attproj_w, NULL, x, N, A, C, dt,
                                   stream)); /* res2 = x + attention branch */
    TRY(td_ops_cuda_lora_forward(ctx, cfg, w, a, TD_MODEL_ATTPROJ_W, a->atty, a->res2, C, N, dt, scratch, stream));
    TRY(td_ops_cuda_rmsnorm_forward(a->ln2, a->ln2_rstd, a->res2, w->ln2_w, off, N, C, eps, dt, stream));
    TRY(td_ops_cuda_matmul_forward(ctx, a->fch, NULL, a->ln2, w->fc_w, NULL, NULL, N, C, 2 * H, dt, stream));
    TRY(td_ops_cuda_lora_forward(ctx, cfg, w, a, TD_MODEL_FC_W, a->ln2, a->fch, 2 * H, N, dt, scratch, stream));
    TRY(td_ops_cuda_glu_forward(a->fch_gelu, a->fch, N, H, sty->act, dt, stream));
    if (!y) { /* a recompute: backward reads the acts (and down_proj's adapter input), not y */
        TRY(td_ops_cuda_lora_forward(ctx, cfg, w, a, TD_MODEL_FCPROJ_W, a->fch_gelu, NULL, C, N, dt, scratch, stream));
        return TD_OK;
    }
    TRY(td_ops_cuda_matmul_forward(ctx, y, NULL, a->fch_gelu, w->fcproj_w, NULL, a->res2, N, H, C, dt,
                                   stream)); /* y = res2 + mlp branch */
    TRY(td_ops_cuda_lora_forward(ctx, cfg, w, a, TD_MODEL_FCPROJ_W, a->fch_gelu, y, C, N, dt, scratch, stream));
    return TD_OK;
}

td_status td_ops_cuda_rotary_block_backward(td_ops_cuda *ctx, const td_model_desc *cfg,
                                             const td_ops_cuda_block *w, const td_ops_cuda_block *g,
                                             const td_ops_cuda_block_acts *a, const float *inv_freq, const void *x,
                                             const void *dy, void *dx, const int *pos, int B, int T, td_dtype dt,
                                             td_dtype gdt, void *scratch, size_t scratch_bytes, void *stream)
{
    const char *what = "decoder block backward";
    if (!cfg || !w || !g || !a || !inv_freq || !x || !dy || !dx || !scratch)
        return td_error_set(TD_ERR_INVALID, "%s: NULL argument", what);
    const size_t fixed = fixed_scratch(cfg, B, T, dt), need = fixed + op_scratch(cfg, B, T, dt, 1);
    if (scratch_bytes < need)
        return td_error_set(TD_ERR_INVALID, "%s: scratch of %zu bytes, %zu needed", what, scratch_bytes, need);
    const sizes s = sizes_of(cfg, B, T, dt);
    const int N = (int)s.N, C = (int)s.C, NH = (int)s.NH, NKV = (int)s.NKV, hs = (int)s.hs;
    const int A = (int)s.A, QKV = (int)s.QKV, H = (int)s.H;
    char *p = scratch;
    void *dA = p;      p += up(s.N * max2(2 * s.H, s.QKV) * s.e); /* dgate_up, later dqkv */
    void *dB = p;      p += up(s.N * s.H * s.e);
    void *dres2 = p;   p += up(s.N * s.C * s.e);
    void *dc = p;      p += up(s.N * max2(s.C, s.A) * s.e);
    void *dxa = td_model_lora_count(cfg) ? p : NULL;
    p += td_ops_cuda_lora_scratch_bytes(cfg, B, T, dt);
    void *ops = p;
    const size_t ops_bytes = scratch_bytes - fixed;
    const td_model_traits *sty = td_rotary_traits(cfg);
    const float off = sty->norm_offset;

    /* y = res2 + down(act(gate) * up), (gate | up) = gate_up(rmsnorm_2(res2)) */
    TRY(td_ops_cuda_matmul_backward(ctx, dB, g->fcproj_w, NULL, dy, a->fch_gelu, w->fcproj_w, N, H, C,
                                    TD_OPS_CUDA_SET, dt, gdt, ops, ops_bytes, stream));
    TRY(td_ops_cuda_lora_backward(ctx, cfg, w, g, a, TD_MODEL_FCPROJ_W, a->fch_gelu, dy, C, dB, N, dt, gdt, dxa,
                                  stream));
    TRY(td_ops_cuda_glu_backward(dA, dB, a->fch, N, H, sty->act, TD_OPS_CUDA_SET, dt, stream));
    TRY(td_ops_cuda_matmul_backward(ctx, dc, g->fc_w, NULL, dA, a->ln2, w->fc_w, N, C, 2 * H, TD_OPS_CUDA_SET, dt,
                                    gdt, ops, ops_bytes, stream));
    TRY(td_ops_cuda_lora_backward(ctx, cfg, w, g, a, TD_MODEL_FC_W, a->ln2, dA, 2 * H, dc, N, dt, gdt, dxa, stream));
    TRY(td_ops_cuda_rmsnorm_backward_res(dres2, dy, g->ln2_w, dc, a->res2, w->ln2_w, off, a->ln2_rstd, N, C, dt, gdt,
                                         ops, ops_bytes, stream));
    /* res2 = x + o_proj(gqa(rope(qkv(rmsnorm_1(x))))) */
    TRY(td_ops_cuda_matmul_backward(ctx, dc, g->attproj_w, NULL, dres2, a->atty, w->attproj_w, N, A, C,
                                    TD_OPS_CUDA_SET, dt, gdt, ops, ops_bytes, stream));
    TRY(td_ops_cuda_lora_backward(ctx, cfg, w, g, a, TD_MODEL_ATTPROJ_W, a->atty, dres2, C, dc, N, dt, gdt, dxa,
                                  stream));
    void *dqkv = dA;
    TRY(td_ops_cuda_attention_gqa_backward(ctx, dqkv, dc, a->qkv, a->atty, a->att_lse, pos, B, T, NH, NKV, hs,
                                           TD_OPS_CUDA_SET, dt, ops, ops_bytes, stream));
    TRY(td_ops_cuda_rope_backward(dqkv, inv_freq, pos, B, T, NH + NKV, hs, (size_t)QKV, dt, stream));
    TRY(td_ops_cuda_matmul_backward(ctx, dc, g->qkv_w, g->qkv_b, dqkv, a->ln1, w->qkv_w, N, C, QKV,
                                    TD_OPS_CUDA_SET, dt, gdt, ops, ops_bytes, stream));
    TRY(td_ops_cuda_lora_backward(ctx, cfg, w, g, a, TD_MODEL_QKV_W, a->ln1, dqkv, QKV, dc, N, dt, gdt, dxa, stream));
    /* dx = dres2 + RMSNorm 1's part */
    TRY(td_ops_cuda_rmsnorm_backward_res(dx, dres2, g->ln1_w, dc, x, w->ln1_w, off, a->ln1_rstd, N, C, dt, gdt, ops,
                                         ops_bytes, stream));
    return TD_OK;
}

size_t td_ops_cuda_rotary_head_scratch_bytes(int N, int C, int Vp)
{
    size_t m = td_ops_cuda_matmul_scratch_bytes(N, Vp), r = td_ops_cuda_rmsnorm_scratch_bytes(N, C);
    return m > r ? m : r;
}

td_status td_ops_cuda_rotary_head_forward(td_ops_cuda *ctx, const td_model_desc *cfg, void *logits, void *lnf,
                                           float *lnf_rstd, const void *x, const void *norm_w, const void *out_w,
                                           int N, td_dtype dt, void *stream)
{
    const char *what = "decoder head forward";
    const int C = cfg->n_embd, Vp = cfg->padded_vocab_size;
    TRY(td_ops_cuda_rmsnorm_forward(lnf, lnf_rstd, x, norm_w, td_rotary_traits(cfg)->norm_offset, N, C,
                                    td_model_norm_eps(cfg), dt, stream));
    TRY(td_ops_cuda_matmul_forward(ctx, logits, NULL, lnf, out_w, NULL, NULL, N, C, Vp, dt, stream));
    return TD_OK;
}

td_status td_ops_cuda_rotary_head_backward(td_ops_cuda *ctx, const td_model_desc *cfg, void *dx, void *dnorm_w,
                                            void *dout_w, void *dlnf, const void *dlogits, const void *x,
                                            const void *lnf, const float *lnf_rstd, const void *norm_w,
                                            const void *out_w, int N, td_dtype dt, td_dtype gdt, void *scratch,
                                            size_t scratch_bytes, void *stream)
{
    const char *what = "decoder head backward";
    const int C = cfg->n_embd, Vp = cfg->padded_vocab_size;
    TRY(td_ops_cuda_matmul_backward(ctx, dlnf, dout_w, NULL, dlogits, lnf, out_w, N, C, Vp, TD_OPS_CUDA_SET, dt, gdt,
                                    scratch, scratch_bytes, stream));
    TRY(td_ops_cuda_rmsnorm_backward(dx, dnorm_w, dlnf, x, norm_w, td_rotary_traits(cfg)->norm_offset, lnf_rstd, N,
                                     C, dt, gdt, scratch, scratch_bytes, stream));
    return TD_OK;
}

/* --- the decoder's td_model_exec --------------------------------------------- */

static size_t exec_acts_bytes(const td_model_desc *d, int B, int T, td_dtype dt)
{
    return td_ops_cuda_rotary_block_acts_bytes(d, B, T, dt);
}

/* The embedding's backward: the scaled gradient (N,C) when the embedding is
 * scaled, the padding token's gradient row (C, in fp32: any grad dtype fits)
 * when there is one, then the encoder's sort. */
static size_t embed_scratch(const td_model_desc *d, int B, int T, td_dtype dt)
{
    const size_t NC = (size_t)B * T * (size_t)d->n_embd;
    const size_t scaled = td_rotary_traits(d)->embed_scaled ? up(NC * td_dtype_bytes(dt)) : 0;
    const size_t pad = d->has_pad_token ? up((size_t)d->n_embd * sizeof(float)) : 0;
    return scaled + pad + td_ops_cuda_encoder_scratch_bytes(B, T, d->padded_vocab_size);
}

/* The block's; the head's dlnf (N,C) and its op scratch; the embedding's. */
static size_t exec_scratch_bytes(const td_model_desc *d, int B, int T, td_dtype dt, int att_seqs)
{
    const size_t N = (size_t)B * T, C = (size_t)d->n_embd, Vp = (size_t)d->padded_vocab_size;
    size_t s = td_ops_cuda_rotary_block_scratch_bytes(d, B, T, dt, att_seqs);
    s = max2(s, up(N * C * td_dtype_bytes(dt)) + td_ops_cuda_rotary_head_scratch_bytes((int)N, (int)C, (int)Vp));
    return max2(s, embed_scratch(d, B, T, dt));
}

static size_t exec_consts_bytes(const td_model_desc *d) { return (size_t)td_model_head_size(d) / 2 * sizeof(float); }

static void exec_consts_fill(const td_model_desc *d, void *host)
{
    td_ops_rope_inv_freq(host, td_model_head_size(d), td_model_rope_theta(d), &d->rope_scaling);
}

/* The block's tensors (layout order) as td_ops_cuda_block's fields. */
static void view(const td_model_desc *d, void *const *p, td_ops_cuda_block *w) { td_ops_cuda_block_from(d, p, w); }

/* The embedding, scaled in place by sqrt(C) rounded to dt (Gemma). */
static td_status exec_embed_forward(const td_model_run *r, void *const *p, const int *tokens, void *out)
{
    const size_t NC = (size_t)r->B * r->T * (size_t)r->desc->n_embd;
    const float s = td_model_embed_scale(r->desc, r->dt);
    td_status st = td_ops_cuda_encoder_forward(out, tokens, NULL, p[0], NULL, r->B, r->T, r->desc->n_embd, r->dt, r->stream);
    return st || s == 1.0f ? st : td_ops_cuda_scale(out, out, s, NC, r->dt, r->stream);
}

/* A scaled embedding's gradient is the scaled dout: into the scratch first,
 * the encoder's sort after it.  The padding token's row (torch's
 * padding_idx) takes nothing from the lookup: kept aside before the sort's
 * sums and put back after them (x * 1 copies any dtype exactly), so what
 * reached it before (a tied head's logits, earlier micro-batches) stays. */
static td_status exec_embed_backward(const td_model_run *r, void *const *g, const int *tokens, const void *dout)
{
    const td_model_desc *d = r->desc;
    const size_t NC = (size_t)r->B * r->T * (size_t)d->n_embd;
    const float s = td_model_embed_scale(d, r->dt);
    char *scratch = r->scratch;
    size_t bytes = r->scratch_bytes;
    td_status st = TD_OK;
    if (s != 1.0f) {
        const size_t scaled = up(NC * td_dtype_bytes(r->dt));
        if ((st = td_ops_cuda_scale(scratch, dout, s, NC, r->dt, r->stream))) return st;
        dout = scratch;
        scratch += scaled, bytes -= scaled;
    }
    const int pad = g[0] && d->has_pad_token && d->pad_token >= 0 && d->pad_token < d->vocab_size;
    void *kept = scratch, *row = NULL;
    if (pad) {
        row = (char *)g[0] + (size_t)d->pad_token * d->n_embd * td_dtype_bytes(r->gdt);
        const size_t b = up((size_t)d->n_embd * sizeof(float));
        if ((st = td_ops_cuda_scale(kept, row, 1.0f, (size_t)d->n_embd, r->gdt, r->stream))) return st;
        scratch += b, bytes -= b;
    }
    st = td_ops_cuda_encoder_backward(g[0], NULL, dout, tokens, NULL, r->B, r->T, d->n_embd, d->padded_vocab_size,
                                      r->dt, r->gdt, scratch, bytes, r->stream);
    if (st || !pad) return st;
    return td_ops_cuda_scale(row, kept, 1.0f, (size_t)d->n_embd, r->gdt, r->stream);
}

static td_status exec_block_forward(const td_model_run *r, void *const *p, void *acts, const void *x, void *y)
{
    td_ops_cuda_block w;
    td_ops_cuda_block_acts a;
    view(r->desc, p, &w);
    td_ops_cuda_rotary_block_acts_view(r->desc, r->B, r->T, r->dt, acts, &a);
    a.lora_drop = r->lora_drop;
    return td_ops_cuda_rotary_block_forward(r->ops, r->desc, &w, &a, r->consts, x, y, r->pos, r->B, r->T, r->dt, r->scratch,
                                             r->scratch_bytes, r->stream);
}

static td_status exec_block_backward(const td_model_run *r, void *const *p, void *const *g, void *acts, const void *x,
                                     const void *dy, void *dx)
{
    td_ops_cuda_block w, gw;
    td_ops_cuda_block_acts a;
    view(r->desc, p, &w);
    view(r->desc, g, &gw);
    td_ops_cuda_rotary_block_acts_view(r->desc, r->B, r->T, r->dt, acts, &a);
    a.lora_drop = r->lora_drop;
    return td_ops_cuda_rotary_block_backward(r->ops, r->desc, &w, &gw, &a, r->consts, x, dy, dx, r->pos, r->B, r->T, r->dt,
                                              r->gdt, r->scratch, r->scratch_bytes, r->stream);
}

/* p: the final norm's weight and the output matrix (td_model_head_tensors). */
static td_status exec_head_forward(const td_model_run *r, void *const *p, const void *x, void *logits,
                                   const td_model_head_acts *h)
{
    return td_ops_cuda_rotary_head_forward(r->ops, r->desc, logits, h->lnf, h->rstd, x, p[0], p[1], r->B * r->T,
                                            r->dt, r->stream);
}

/* dlnf at the scratch's start, the op scratch after it. */
static td_status exec_head_backward(const td_model_run *r, void *const *p, void *const *g, const void *x,
                                    const void *dlogits, const td_model_head_acts *h, void *dx)
{
    const int N = r->B * r->T;
    const size_t dlnf = up((size_t)N * (size_t)r->desc->n_embd * td_dtype_bytes(r->dt));
    return td_ops_cuda_rotary_head_backward(r->ops, r->desc, dx, g[0], g[1], r->scratch, dlogits, x, h->lnf, h->rstd,
                                             p[0], p[1], N, r->dt, r->gdt, (char *)r->scratch + dlnf,
                                             r->scratch_bytes - dlnf, r->stream);
}

const td_model_exec td_rotary_cuda = {exec_acts_bytes, exec_scratch_bytes, exec_consts_bytes, exec_consts_fill,
                                       exec_embed_forward, exec_embed_backward, exec_block_forward,
                                       exec_block_backward, exec_head_forward, exec_head_backward};
