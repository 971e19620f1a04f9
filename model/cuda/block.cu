/* One GPT-2 block composed from the CUDA ops: the GPU counterpart of
 * td_model_block_forward/backward (model_ref.c), same order and the same
 * activations kept, with the fusions the GPU ops offer:
 *   forward   the residual adds ride in the projections' GEMMs (beta = 1 on
 *             the residual input), GELU in the fc GEMM's epilogue (16-bit);
 *             With a LoRA target on fc, fc's product and GELU run apart (the
 *             adapters' update lands on the pre-activation between them).
 *   backward  input gradients are written (SET), not zeroed and added; the
 *             LayerNorms' input gradients land beside the residual gradient
 *             (no copy of it first), and GELU's derivative rides in the
 *             fc_proj input-gradient GEMM's epilogue (16-bit; else a kernel
 *             in place over that gradient).
 * Backward scratch: d4 (N,4C) for dfch, later dqkv (N,3C);
 * dres2 (N,C); dc (N,C) for dln2, datty, dln1; LoRA's dxa (N,R); then the op scratch
 * (matmul / LayerNorm partial sums, or attention's buffers). */
#include "kernels.cuh"

namespace {

using namespace tdc;

struct ActsSizes {
    size_t bytes[12];
};

/* Bytes of each acts field in td_ops_cuda_block_acts order. */
ActsSizes acts_sizes(const td_model_desc *cfg, int B, int T, td_dtype dt)
{
    const size_t N = (size_t)B * T, C = (size_t)cfg->n_embd, e = dtype_bytes(dt), f = sizeof(float);
    ActsSizes s = {{N * C * e, N * f, N * f, N * 3 * C * e, N * C * e, N * cfg->n_head * f, N * C * e,
                    N * C * e, N * f, N * f, N * 4 * C * e, N * 4 * C * e}};
    return s;
}

size_t op_scratch_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt, int att_seqs)
{
    const int N = B * T, C = cfg->n_embd;
    size_t need = td_ops_cuda_attention_scratch_bytes(att_seqs, T, C, cfg->n_head, dt);
    const size_t others[] = {td_ops_cuda_matmul_scratch_bytes(N, 4 * C), td_ops_cuda_matmul_scratch_bytes(N, 3 * C),
                             td_ops_cuda_layernorm_scratch_bytes(N, C)};
    for (size_t o : others)
        if (o > need) need = o;
    return need;
}

size_t fixed_scratch_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt)
{
    const size_t NC = (size_t)B * T * cfg->n_embd, e = dtype_bytes(dt);
    return align_up(4 * NC * e) + 2 * align_up(NC * e) + td_ops_cuda_lora_scratch_bytes(cfg, B, T, dt);
}

#define TRY(expr)                                         \
    do {                                                  \
        td_status st_ = (expr);                           \
        if (st_ != TD_OK) return td_error_prefix(st_, "%s: ", what); \
    } while (0)

} // namespace

extern "C" void td_ops_cuda_block_view(const td_model_desc *cfg, void *block_base, td_dtype dt,
                                       td_ops_cuda_block *out)
{
    /* Block 0's tensors of the layout, at their offsets inside the span in
     * elements of dt: any family (a LLaMA-family block has 6 or 7). */
    size_t span_off, span;
    td_model_block_span(cfg, 0, &span_off, &span);
    const int first = td_model_embed_tensor_count(cfg), nb = td_model_block_tensor_count(cfg);
    void *p[TD_MODEL_BLOCK_TENSORS] = {};
    for (int k = 0; k < nb; k++) {
        td_model_tensor t;
        td_model_tensor_get(cfg, first + k, &t);
        p[k] = (char *)block_base + (t.offset - span_off) * dtype_bytes(dt);
    }
    td_ops_cuda_block_from(cfg, p, out);
}

extern "C" void td_ops_cuda_block_from(const td_model_desc *cfg, void *const *p, td_ops_cuda_block *out)
{
    td_model_block b;
    td_model_block_from(cfg, p, &b);
    /* td_model_block and td_ops_cuda_block list the same roles in one order:
     * the twelve, then the LoRA adapters */
    static_assert(sizeof b == sizeof *out, "td_model_block and td_ops_cuda_block differ");
    void **dst = (void **)out;
    float **src = (float **)&b;
    for (size_t i = 0; i < sizeof *out / sizeof(void *); i++) dst[i] = src[i];
}

extern "C" size_t td_ops_cuda_block_acts_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt)
{
    const ActsSizes s = acts_sizes(cfg, B, T, dt);
    size_t total = 0;
    for (size_t b : s.bytes) total += align_up(b);
    return total + td_ops_cuda_lora_acts_bytes(cfg, B, T, dt);
}

extern "C" void td_ops_cuda_block_acts_view(const td_model_desc *cfg, int B, int T, td_dtype dt,
                                            void *base, td_ops_cuda_block_acts *out)
{
    const ActsSizes s = acts_sizes(cfg, B, T, dt);
    void **slot[12] = {&out->ln1, (void **)&out->ln1_mean, (void **)&out->ln1_rstd, &out->qkv, &out->atty,
                       (void **)&out->att_lse, &out->res2, &out->ln2, (void **)&out->ln2_mean,
                       (void **)&out->ln2_rstd, &out->fch, &out->fch_gelu};
    char *p = (char *)base;
    for (int i = 0; i < 12; i++) {
        *slot[i] = p;
        p += align_up(s.bytes[i]);
    }
    out->lora_xa = td_model_lora_count(cfg) ? p : nullptr; /* the adapters' xa after the twelve */
    out->lora_drop = nullptr; /* the exec sets the run's key */
}

extern "C" size_t td_ops_cuda_block_scratch_bytes(const td_model_desc *cfg, int B, int T, td_dtype dt,
                                                  int att_seqs)
{
    if (!cfg || B <= 0 || T <= 0) return 0;
    if (att_seqs < 1 || att_seqs > B) att_seqs = B;
    return fixed_scratch_bytes(cfg, B, T, dt) + op_scratch_bytes(cfg, B, T, dt, att_seqs);
}

extern "C" td_status td_ops_cuda_block_forward(td_ops_cuda *ctx, const td_model_desc *cfg,
                                               const td_ops_cuda_block *w,
                                               const td_ops_cuda_block_acts *a, const void *x, void *y,
                                               const int *pos, int B, int T, td_dtype dt, void *scratch,
                                               size_t scratch_bytes, void *stream)
{
    const char *what = "block forward";
    if (!cfg || !w || !a || !x) return td_error_set(TD_ERR_INVALID, "%s: NULL argument", what);
    if (x == y) return td_error_set(TD_ERR_INVALID, "%s: y must not alias x (backward needs x)", what);
    const int C = cfg->n_embd, NH = cfg->n_head, N = B * T;
    TRY(td_ops_cuda_layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x, w->ln1_w, w->ln1_b, N, C, dt,
                                      stream));
    TRY(td_ops_cuda_matmul_forward(ctx, a->qkv, nullptr, a->ln1, w->qkv_w, w->qkv_b, nullptr, N, C, 3 * C,
                                   dt, stream));
    /* the adapters' dropped input (a dropout) goes into the scratch: the ops between them are done with it */
    TRY(td_ops_cuda_lora_forward(ctx, cfg, w, a, TD_MODEL_QKV_W, a->ln1, a->qkv, 3 * C, N, dt, scratch, stream));
    TRY(td_ops_cuda_attention_gqa_forward(ctx, a->atty, a->att_lse, a->qkv, pos, B, T, NH, NH, C / NH, dt, scratch,
                                          scratch_bytes, stream));
    TRY(td_ops_cuda_matmul_forward(ctx, a->res2, nullptr, a->atty, w->attproj_w, w->attproj_b, x, N, C, C,
                                   dt, stream)); /* res2 = x + attention branch */
    TRY(td_ops_cuda_lora_forward(ctx, cfg, w, a, TD_MODEL_ATTPROJ_W, a->atty, a->res2, C, N, dt, scratch, stream));
    TRY(td_ops_cuda_layernorm_forward(a->ln2, a->ln2_mean, a->ln2_rstd, a->res2, w->ln2_w, w->ln2_b, N, C,
                                      dt, stream));
    if (td_ops_cuda_lora_on(cfg, TD_MODEL_FC_W)) { /* GELU after the adapters' update of its input */
        TRY(td_ops_cuda_matmul_forward(ctx, a->fch, nullptr, a->ln2, w->fc_w, w->fc_b, nullptr, N, C, 4 * C, dt,
                                       stream));
        TRY(td_ops_cuda_lora_forward(ctx, cfg, w, a, TD_MODEL_FC_W, a->ln2, a->fch, 4 * C, N, dt, scratch, stream));
        TRY(td_ops_cuda_gelu_forward(a->fch_gelu, a->fch, (size_t)N * 4 * C, dt, stream));
    } else
        TRY(td_ops_cuda_matmul_forward(ctx, a->fch_gelu, a->fch, a->ln2, w->fc_w, w->fc_b, nullptr, N, C,
                                       4 * C, dt, stream));
    if (!y) { /* a recompute: backward reads the acts (and c_proj's adapter input), not y */
        TRY(td_ops_cuda_lora_forward(ctx, cfg, w, a, TD_MODEL_FCPROJ_W, a->fch_gelu, nullptr, C, N, dt, scratch,
                                     stream));
        return TD_OK;
    }
    TRY(td_ops_cuda_matmul_forward(ctx, y, nullptr, a->fch_gelu, w->fcproj_w, w->fcproj_b, a->res2, N,
                                   4 * C, C, dt, stream)); /* y = res2 + mlp branch */
    TRY(td_ops_cuda_lora_forward(ctx, cfg, w, a, TD_MODEL_FCPROJ_W, a->fch_gelu, y, C, N, dt, scratch, stream));
    return TD_OK;
}

extern "C" td_status td_ops_cuda_block_backward(td_ops_cuda *ctx, const td_model_desc *cfg,
                                                const td_ops_cuda_block *w, const td_ops_cuda_block *g,
                                                const td_ops_cuda_block_acts *a, const void *x,
                                                const void *dy, void *dx, const int *pos, int B, int T,
                                                td_ops_cuda_write dx_mode, td_dtype dt, td_dtype gdt,
                                                void *scratch, size_t scratch_bytes, void *stream)
{
    const char *what = "block backward";
    if (!cfg || !w || !g || !a || !x || !dy || !dx)
        return td_error_set(TD_ERR_INVALID, "%s: NULL argument", what);
    td_status st = check_dtypes(what, dt, gdt);
    if (st != TD_OK) return st;
    const size_t fixed = fixed_scratch_bytes(cfg, B, T, dt);
    st = check_scratch(what, scratch, scratch_bytes,
                       fixed + op_scratch_bytes(cfg, B, T, dt, 1));
    if (st != TD_OK) return st;
    const int C = cfg->n_embd, NH = cfg->n_head, N = B * T;
    const size_t NC = (size_t)N * C, e = dtype_bytes(dt);
    Carve cv{(char *)scratch, scratch_bytes};
    void *d4 = cv.take(4 * NC * e);
    void *dres2 = cv.take(NC * e);
    void *dc = cv.take(NC * e);
    void *dxa = td_model_lora_count(cfg) ? cv.take(td_ops_cuda_lora_scratch_bytes(cfg, B, T, dt)) : nullptr;
    void *ops = cv.p;
    const size_t ops_bytes = cv.left;
    cudaStream_t s = (cudaStream_t)stream;

    /* y = res2 + fc_proj(gelu(fc(ln2(res2)))) */
    if (td_ops_cuda_lora_on(cfg, TD_MODEL_FCPROJ_W)) { /* GELU's derivative after the adapters' share */
        TRY(td_ops_cuda_matmul_backward(ctx, d4, g->fcproj_w, g->fcproj_b, dy, a->fch_gelu, w->fcproj_w, N, 4 * C,
                                        C, TD_OPS_CUDA_SET, dt, gdt, ops, ops_bytes, stream));
        TRY(td_ops_cuda_lora_backward(ctx, cfg, w, g, a, TD_MODEL_FCPROJ_W, a->fch_gelu, dy, C, d4, N, dt, gdt, dxa,
                                      stream));
        TRY(td_ops_cuda_gelu_backward(d4, a->fch, d4, 4 * NC, TD_OPS_CUDA_SET, dt, stream));
    } else
        TRY(td_ops_cuda_matmul_backward_gelu(ctx, d4, g->fcproj_w, g->fcproj_b, dy, a->fch_gelu, w->fcproj_w,
                                             a->fch, N, 4 * C, C, dt, gdt, ops, ops_bytes, stream));
    TRY(td_ops_cuda_matmul_backward(ctx, dc, g->fc_w, g->fc_b, d4, a->ln2, w->fc_w, N, C, 4 * C,
                                    TD_OPS_CUDA_SET, dt, gdt, ops, ops_bytes, stream));
    TRY(td_ops_cuda_lora_backward(ctx, cfg, w, g, a, TD_MODEL_FC_W, a->ln2, d4, 4 * C, dc, N, dt, gdt, dxa, stream));
    TRY(td_ops_cuda_layernorm_backward_res(dres2, dy, g->ln2_w, g->ln2_b, dc, a->res2, w->ln2_w, a->ln2_mean,
                                           a->ln2_rstd, N, C, dt, gdt, ops, ops_bytes, stream));
    /* res2 = x + attn_proj(attention(qkv(ln1(x)))) */
    if (dx_mode == TD_OPS_CUDA_ADD) TRY(add(dt, dx, dx, dres2, NC, s));
    TRY(td_ops_cuda_matmul_backward(ctx, dc, g->attproj_w, g->attproj_b, dres2, a->atty, w->attproj_w, N,
                                    C, C, TD_OPS_CUDA_SET, dt, gdt, ops, ops_bytes, stream));
    TRY(td_ops_cuda_lora_backward(ctx, cfg, w, g, a, TD_MODEL_ATTPROJ_W, a->atty, dres2, C, dc, N, dt, gdt, dxa,
                                  stream));
    void *dqkv = d4;
    TRY(td_ops_cuda_attention_gqa_backward(ctx, dqkv, dc, a->qkv, a->atty, a->att_lse, pos, B, T, NH, NH, C / NH,
                                           TD_OPS_CUDA_SET, dt, ops, ops_bytes, stream));
    TRY(td_ops_cuda_matmul_backward(ctx, dc, g->qkv_w, g->qkv_b, dqkv, a->ln1, w->qkv_w, N, C, 3 * C,
                                    TD_OPS_CUDA_SET, dt, gdt, ops, ops_bytes, stream));
    TRY(td_ops_cuda_lora_backward(ctx, cfg, w, g, a, TD_MODEL_QKV_W, a->ln1, dqkv, 3 * C, dc, N, dt, gdt, dxa, stream));
    /* dx = dres2 + LayerNorm 1's part (SET), or dx += it (ADD, dres2 added above) */
    TRY(td_ops_cuda_layernorm_backward_res(dx, dx_mode == TD_OPS_CUDA_SET ? dres2 : dx, g->ln1_w, g->ln1_b, dc,
                                           x, w->ln1_w, a->ln1_mean, a->ln1_rstd, N, C, dt, gdt, ops,
                                           ops_bytes, stream));
    return TD_OK;
}
