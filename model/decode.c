/* Generation with a key/value cache (see include/tidal/decode.h): one
 * position's forward through every block, the reference ops at one row
 * (N = 1), attention over the cached keys and values of the positions
 * before it.  The block's make-up comes from the family's traits (its norm,
 * MLP, positions and embedding scale; family.h).
 *
 * Letters: C width, NH query heads, NKV key/value heads, hs head size,
 * A = NH hs the attention's width, QKV = (NH + 2 NKV) hs, F the MLP's
 * hidden width (4C for GPT-2's GELU; H for a gated MLP, whose fused gate|up
 * is 2H wide), P the cache's positions. */
#include "tidal/decode.h"
#include "tidal/family.h"

#include <math.h>
#include <string.h>

#include "tidal/alloc.h"
#include "tidal/ops.h"
#include "tidal/util.h"

struct td_decoder {
    td_model_desc cfg;
    const float *params;
    int max_pos, pos;
    const td_model_traits *tr;               /* the family's block make-up */
    int C, NH, NKV, hs, A, QKV, F, F_in;     /* F_in: the MLP's first projection's width (4C or 2H) */
    float *cache;                             /* (L, P, 2, NKV hs): keys then values of each position */
    float *x, *ln, *qkv, *att, *res, *fc, *act, *stats, *logits; /* one row each */
    float inv_freq[TD_MODEL_MAX_HEAD_SIZE / 2];
};

static size_t kv_floats(const td_model_desc *cfg) { return 2 * (size_t)td_model_kv_heads(cfg) * td_model_head_size(cfg); }

/* One row's scratch, in floats: x, ln, att (A), res, qkv, fc, act, stats, logits (Vp). */
static size_t scratch_floats(const td_model_desc *cfg, int P)
{
    size_t C = (size_t)cfg->n_embd, F = (size_t)td_model_mlp_width(cfg);
    size_t F_in = td_model_family_of(cfg)->traits.gated ? 2 * F : F;
    (void)P;
    return 3 * C + (size_t)td_model_attn_width(cfg) + (size_t)td_model_qkv_width(cfg) + F_in + F + 4 +
           (size_t)cfg->padded_vocab_size;
}

size_t td_decoder_bytes(const td_model_desc *cfg, int max_positions)
{
    return sizeof(float) * ((size_t)cfg->n_layer * (size_t)max_positions * kv_floats(cfg) +
                            scratch_floats(cfg, max_positions));
}

td_status td_decoder_create(const td_model_desc *cfg, const float *params, int max_positions, td_decoder **out)
{
    *out = NULL;
    td_status st = td_model_desc_check(cfg);
    if (st) return st;
    if (max_positions < 1 || max_positions > cfg->n_positions)
        return td_error_set(TD_ERR_INVALID, "decoder of %d positions: give 1 to the model's %d", max_positions,
                            cfg->n_positions);
    const td_model_traits *tr = &td_model_family_of(cfg)->traits;
    if (tr->rope && td_model_head_size(cfg) > TD_MODEL_MAX_HEAD_SIZE)
        return td_error_set(TD_ERR_INVALID, "head size %d: rotary positions take at most %d", td_model_head_size(cfg),
                            TD_MODEL_MAX_HEAD_SIZE);
    td_decoder *d = td_calloc(1, sizeof *d, TD_ROLE_META);
    if (!d) return TD_ERR_NOMEM;
    d->cfg = *cfg;
    d->params = params;
    d->tr = tr;
    d->max_pos = max_positions;
    d->C = cfg->n_embd;
    d->NH = cfg->n_head;
    d->NKV = td_model_kv_heads(cfg);
    d->hs = td_model_head_size(cfg);
    d->A = td_model_attn_width(cfg);
    d->QKV = td_model_qkv_width(cfg);
    d->F = td_model_mlp_width(cfg);
    d->F_in = tr->gated ? 2 * d->F : d->F;
    size_t cache = (size_t)cfg->n_layer * (size_t)max_positions * kv_floats(cfg);
    d->cache = td_malloc(sizeof(float) * (cache + scratch_floats(cfg, max_positions)), TD_ROLE_META);
    if (!d->cache) {
        char need[32];
        td_free(d);
        return td_error_set(TD_ERR_NOMEM, "the key/value cache of %d positions needs %s of host memory; give a "
                            "shorter context", max_positions,
                            td_format_bytes(td_decoder_bytes(cfg, max_positions), need, sizeof need));
    }
    float *s = d->cache + cache;
    d->x = s, s += d->C;
    d->ln = s, s += d->C;
    d->att = s, s += d->A;
    d->res = s, s += d->C;
    d->qkv = s, s += d->QKV;
    d->fc = s, s += d->F_in;
    d->act = s, s += d->F;
    d->stats = s, s += 4;
    d->logits = s;
    if (tr->rope) td_ops_rope_inv_freq(d->inv_freq, d->hs, td_model_rope_theta(cfg), &cfg->rope_scaling);
    *out = d;
    return TD_OK;
}

void td_decoder_destroy(td_decoder *d)
{
    if (!d) return;
    td_free(d->cache);
    td_free(d);
}

int td_decoder_position(const td_decoder *d) { return d->pos; }
void td_decoder_reset(td_decoder *d) { d->pos = 0; }

static const float *tensor(const td_decoder *d, int index)
{
    td_model_tensor t;
    td_model_tensor_get(&d->cfg, index, &t);
    return d->params + t.offset;
}

static void norm(const td_decoder *d, float *out, const float *in, const float *w, const float *b)
{
    if (d->tr->norm == TD_MODEL_NORM_RMS)
        td_ops_rmsnorm_forward(out, d->stats, in, w, d->tr->norm_offset, 1, d->C, td_model_norm_eps(&d->cfg));
    else td_ops_layernorm_forward(out, d->stats, d->stats + 1, in, w, b, 1, d->C);
}

/* Rotary positions on `heads` heads of one row at position `pos`: the
 * rotate-half layout of td_ops_rope_forward, whose angle (float)t x
 * inv_freq[i] this takes at t = pos. */
static void rope_row(const td_decoder *d, float *row, int heads, int pos)
{
    const int half = d->hs / 2;
    for (int i = 0; i < half; i++) {
        float angle = (float)pos * d->inv_freq[i], c = cosf(angle), s = sinf(angle);
        for (int h = 0; h < heads; h++) {
            float *p = row + (size_t)h * d->hs, x1 = p[i], x2 = p[i + half];
            p[i] = x1 * c - x2 * s;
            p[i + half] = x2 * c + x1 * s;
        }
    }
}

/* att (NH hs) = each query head's softmax(q . k / sqrt(hs)) over the cached
 * positions 0..pos, times their values; query head h reads key/value head
 * h / (NH / NKV). */
static void attend(const td_decoder *d, const float *kv_layer, int pos)
{
    const int group = d->NH / d->NKV, hs = d->hs;
    const size_t row = kv_floats(&d->cfg), KV = (size_t)d->NKV * hs;
    const float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for schedule(static) if (d->NH * (pos + 1) * hs >= 1 << 16)
    for (int h = 0; h < d->NH; h++) {
        const float *q = d->qkv + (size_t)h * hs;
        const float *k0 = kv_layer + (size_t)(h / group) * hs, *v0 = k0 + KV;
        float *o = d->att + (size_t)h * hs, mx = -INFINITY, sum = 0;
        /* the scores twice (for their max, then the weights): a row of them per head would be scratch of
         * NH x P floats, and a score costs hs multiply-adds */
        for (int t = 0; t <= pos; t++) {
            const float *k = k0 + (size_t)t * row;
            float s = 0;
            for (int i = 0; i < hs; i++) s += q[i] * k[i];
            s *= scale;
            if (s > mx) mx = s;
        }
        memset(o, 0, (size_t)hs * sizeof(float));
        for (int t = 0; t <= pos; t++) {
            const float *k = k0 + (size_t)t * row, *v = v0 + (size_t)t * row;
            float s = 0;
            for (int i = 0; i < hs; i++) s += q[i] * k[i];
            float p = expf(s * scale - mx);
            sum += p;
            for (int i = 0; i < hs; i++) o[i] += p * v[i];
        }
        for (int i = 0; i < hs; i++) o[i] /= sum;
    }
}

/* One block at position pos, x (C) in place. */
static void block(td_decoder *d, int layer, int pos)
{
    size_t off, numel;
    td_model_block w;
    td_model_block_span(&d->cfg, layer, &off, &numel);
    td_model_block_view(&d->cfg, (float *)(d->params + off), &w);
    const int C = d->C;
    const size_t row = kv_floats(&d->cfg), KV = (size_t)d->NKV * d->hs;
    float *kv_layer = d->cache + (size_t)layer * (size_t)d->max_pos * row;
    norm(d, d->ln, d->x, w.ln1_w, w.ln1_b);
    td_ops_matmul_forward(d->qkv, d->ln, w.qkv_w, w.qkv_b, 1, C, d->QKV);          // (QKV): q | k | v
    if (d->tr->rope) {
        rope_row(d, d->qkv, d->NH, pos);                                           // q
        rope_row(d, d->qkv + (size_t)d->NH * d->hs, d->NKV, pos);                  // k
    }
    memcpy(kv_layer + (size_t)pos * row, d->qkv + (size_t)d->NH * d->hs, 2 * KV * sizeof(float)); // keep k, v
    attend(d, kv_layer, pos);                                                      // (A)
    td_ops_matmul_forward(d->res, d->att, w.attproj_w, w.attproj_b, 1, d->A, C);   // attn branch
    td_ops_residual_forward(d->res, d->res, d->x, (size_t)C);                      // x + branch
    norm(d, d->ln, d->res, w.ln2_w, w.ln2_b);
    td_ops_matmul_forward(d->fc, d->ln, w.fc_w, w.fc_b, 1, C, d->F_in);            // (F_in)
    if (d->tr->gated) td_ops_glu_forward(d->act, d->fc, 1, d->F, d->tr->act);
    else td_ops_gelu_forward(d->act, d->fc, (size_t)d->F);
    td_ops_matmul_forward(d->x, d->act, w.fcproj_w, w.fcproj_b, 1, d->F, C);       // mlp branch
    td_ops_residual_forward(d->x, d->x, d->res, (size_t)C);                        // res + branch
}

td_status td_decoder_step(td_decoder *d, int token, float *logits)
{
    if (token < 0 || token >= d->cfg.vocab_size)
        return td_error_set(TD_ERR_INVALID, "token %d is outside the vocabulary of %d", token, d->cfg.vocab_size);
    if (d->pos >= d->max_pos)
        return td_error_set(TD_ERR_INVALID, "the key/value cache holds %d positions and is full; reset it or feed a "
                            "shorter context", d->max_pos);
    const int C = d->C, pos = d->pos;
    const float *wte = tensor(d, 0);
    memcpy(d->x, wte + (size_t)token * C, (size_t)C * sizeof(float));
    const float scale = td_model_embed_scale(&d->cfg, TD_DTYPE_F32);
    if (scale != 1.0f) td_ops_scale(d->x, d->x, scale, (size_t)C);
    if (!d->tr->rope) {
        const float *wpe = tensor(d, 1);
        for (int c = 0; c < C; c++) d->x[c] += wpe[(size_t)pos * C + c];
    }
    for (int l = 0; l < d->cfg.n_layer; l++) block(d, l, pos);
    int idx[3];
    int nh = td_model_head_tensors(&d->cfg, idx);
    const float *head[3] = {NULL, NULL, NULL};
    for (int k = 0; k < nh; k++) head[k] = tensor(d, idx[k]);
    td_model_head_forward(&d->cfg, d->logits, d->ln, d->stats, d->stats + 1, d->x, head, 1); // (Vp)
    memcpy(logits, d->logits, (size_t)d->cfg.vocab_size * sizeof(float));
    d->pos++;
    return TD_OK;
}
