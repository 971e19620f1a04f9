/* LoRA adapters on a block's linear modules (include/tidal/model.h): which
 * modules a family's block has (its 2-D Hugging Face weight parts), the
 * adapters' shapes, names and initialisation, and their compute on the CPU
 * reference: the family's block calls td_lora_forward after a module's
 * product and td_lora_backward beside its backward.
 *
 * Forward, for target j on rows [row0, row0 + rows) of the module's output
 * y (N, ldy):  xa = x A^T (N,R), kept;  y[:, rows] += s xa B^T.
 * Backward from dy:  dB += s dy^T xa;  dxa = s dy B;  dA += dxa^T x;
 * dx += dxa A.  W + s B A is never formed.
 *
 * Dropout (training: the acts carry a key): x above is drop(x) = x m/(1-P)
 * with the mask m of model.h's hash, written into the acts' lora_xd
 * scratch.  The backward hashes the same key again: dA += dxa^T drop(x),
 * and dx takes m/(1-P) times (dxa A), the branch's input gradient. */
#include "lora.h"
#include "lora_mask.h"
#include "ops_internal.h"
#include "tidal/family.h"
#include "tidal/util.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static const td_model_family *fam(const td_model_desc *d) { return td_model_family_of(d); }

/* The block's 2-D weight parts, in the family's order: the candidates. */
static int candidates(const td_model_desc *d, td_model_hf_part out[TD_MODEL_HF_PARTS_MAX])
{
    td_model_hf_part p[TD_MODEL_HF_PARTS_MAX];
    int n = fam(d)->hf_parts(d, TD_MODEL_SECTION_BLOCK, p), m = 0;
    for (int i = 0; i < n; i++) {
        int shape[2] = {0, 0};
        if (fam(d)->shape(d, p[i].kind, shape) != 2) continue;
        const char *dot = strrchr(p[i].name, '.');
        if (!dot || strcmp(dot, ".weight")) continue;
        out[m++] = p[i];
    }
    return m;
}

/* The module path of a part ("self_attn.q_proj") and its last component. */
static void module_of(const td_model_hf_part *p, char *path, size_t n, const char **last)
{
    snprintf(path, n, "%s", p->name);
    char *dot = strrchr(path, '.');
    if (dot) *dot = '\0';
    const char *l = strrchr(path, '.');
    *last = l ? l + 1 : path;
}

static void target_of(const td_model_desc *d, const td_model_hf_part *p, int index, td_model_lora_target *out)
{
    int shape[2] = {0, 0};
    const char *last;
    fam(d)->shape(d, p->kind, shape);
    memset(out, 0, sizeof *out);
    module_of(p, out->module, sizeof out->module, &last);
    out->kind = p->kind;
    out->module_index = index;
    out->in = shape[1];
    out->row0 = 0;
    out->rows = shape[0];
    const int hs = td_model_head_size(d), q = d->n_head * hs, kv = td_model_kv_heads(d) * hs;
    const int H = td_model_mlp_width(d);
    switch (p->split) {
    case TD_MODEL_HF_Q: out->rows = q; break;
    case TD_MODEL_HF_K: out->row0 = q, out->rows = kv; break;
    case TD_MODEL_HF_V: out->row0 = q + kv, out->rows = kv; break;
    case TD_MODEL_HF_GATE: out->rows = H; break;
    case TD_MODEL_HF_UP: out->row0 = H, out->rows = H; break;
    default: break;
    }
}

int td_model_lora_count(const td_model_desc *d)
{
    if (d->lora.rank <= 0) return 0;
    int n = 0;
    for (unsigned m = d->lora.targets; m; m &= m - 1) n++;
    return n > TD_MODEL_LORA_MAX ? TD_MODEL_LORA_MAX : n;
}

void td_model_lora_target_get(const td_model_desc *d, int j, td_model_lora_target *out)
{
    td_model_hf_part c[TD_MODEL_HF_PARTS_MAX];
    int n = candidates(d, c), seen = 0;
    memset(out, 0, sizeof *out);
    for (int i = 0; i < n; i++) {
        if (!(d->lora.targets >> i & 1u)) continue;
        if (seen++ == j) {
            target_of(d, &c[i], i, out);
            return;
        }
    }
}

td_status td_model_lora_set(td_model_desc *d, int rank, float alpha, float dropout, const char *targets)
{
    td_model_hf_part c[TD_MODEL_HF_PARTS_MAX];
    int n = candidates(d, c);
    char list[256] = "", path[64];
    const char *last;
    for (int i = 0, at = 0; i < n && at < (int)sizeof list; i++) {
        module_of(&c[i], path, sizeof path, &last);
        at += snprintf(list + at, sizeof list - (size_t)at, "%s%s", i ? ", " : "", last);
    }
    const char *title = td_model_family_title(fam(d));
    if (targets && !*targets)
        return td_error_set(TD_ERR_INVALID, "--lora-targets is empty: name modules of the %s block (%s)", title, list);
    unsigned mask = targets ? 0 : (1u << n) - 1; /* NULL: every linear module */
    for (const char *s = targets ? targets : ""; *s;) {
        const char *e = strchr(s, ',');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        while (len && *s == ' ') s++, len--;
        while (len && s[len - 1] == ' ') len--;
        int found = 0;
        for (int i = 0; i < n; i++) {
            module_of(&c[i], path, sizeof path, &last);
            if (len && strlen(last) == len && !strncmp(last, s, len)) mask |= 1u << i, found = 1;
        }
        if (!found)
            return td_error_set(TD_ERR_INVALID, "--lora-targets: '%.*s' is no linear module of the %s block; its "
                                "modules: %s", (int)len, s, title, list);
        if (!e) break;
        s = e + 1;
    }
    if (!(alpha > 0)) return td_error_set(TD_ERR_INVALID, "--lora-alpha %g: give a positive scale", alpha);
    if (!(dropout >= 0 && dropout < 1))
        return td_error_set(TD_ERR_INVALID, "--lora-dropout %g: give a probability in [0, 1)", dropout);
    td_model_desc t = *d;
    t.lora = (td_model_lora){ .rank = rank, .alpha = alpha, .dropout = dropout, .targets = mask };
    if (rank < 1) return td_error_set(TD_ERR_INVALID, "--lora-rank %d: give a rank of at least 1", rank);
    for (int j = 0; j < td_model_lora_count(&t); j++) {
        td_model_lora_target tg;
        td_model_lora_target_get(&t, j, &tg);
        int side = tg.in < tg.rows ? tg.in : tg.rows;
        if (rank > side)
            return td_error_set(TD_ERR_INVALID, "--lora-rank %d is above %s's width (%d x %d): at most %d", rank,
                                tg.module, tg.rows, tg.in, side);
    }
    d->lora = t.lora;
    return TD_OK;
}

int td_model_lora_modules(const td_model_desc *d, char *buf, size_t n)
{
    int at = 0;
    if (n) buf[0] = '\0';
    for (int j = 0; j < td_model_lora_count(d); j++) {
        td_model_lora_target tg;
        const char *last = NULL;
        td_model_lora_target_get(d, j, &tg);
        last = strrchr(tg.module, '.');
        last = last ? last + 1 : tg.module;
        /* GPT-2's c_proj names two modules: once */
        char probe[64];
        snprintf(probe, sizeof probe, "%s", last);
        int dup = 0;
        for (const char *s = buf; at && (s = strstr(s, probe)); s++) {
            size_t l = strlen(probe);
            if ((s == buf || s[-1] == ',') && (s[l] == ',' || s[l] == '\0')) dup = 1;
        }
        if (!dup && (size_t)at < n) at += snprintf(buf + at, n - (size_t)at, "%s%s", at ? "," : "", last);
    }
    return at;
}

/* --- the adapters as block tensors (model_tensors.c) -------------------------- */

int td_lora_kinds(const td_model_desc *d, td_model_param *out)
{
    int n = td_model_lora_count(d);
    for (int j = 0; j < n; j++) {
        out[2 * j] = TD_MODEL_LORA_A(j);
        out[2 * j + 1] = TD_MODEL_LORA_B(j);
    }
    return 2 * n;
}

int td_lora_shape(const td_model_desc *d, td_model_param kind, int shape[2])
{
    int j = ((int)kind - TD_MODEL_PARAM_COUNT) / 2, b = ((int)kind - TD_MODEL_PARAM_COUNT) % 2;
    td_model_lora_target tg;
    td_model_lora_target_get(d, j, &tg);
    shape[0] = b ? tg.rows : d->lora.rank;
    shape[1] = b ? d->lora.rank : tg.in;
    return 2;
}

void td_lora_name(const td_model_desc *d, td_model_param kind, char *buf, size_t n)
{
    int j = ((int)kind - TD_MODEL_PARAM_COUNT) / 2, b = ((int)kind - TD_MODEL_PARAM_COUNT) % 2;
    td_model_lora_target tg;
    td_model_lora_target_get(d, j, &tg);
    snprintf(buf, n, "%s.lora_%s.weight", tg.module, b ? "B" : "A");
}

/* A: kaiming uniform with a = sqrt(5) over fan_in = in (torch's Linear
 * default, PEFT's init_lora_weights=True): U(-b, b), b = sqrt(6 / ((1 +
 * a^2) in)) = 1 / sqrt(in).  B: zero. */
void td_lora_init(const td_model_desc *d, td_model_param kind, float *dst, size_t begin, size_t count, uint64_t stream)
{
    if (((int)kind - TD_MODEL_PARAM_COUNT) % 2) {
        memset(dst, 0, count * sizeof(float));
        return;
    }
    int shape[2];
    td_lora_shape(d, kind, shape);
    const double bound = 1.0 / sqrt((double)shape[1]);
    td_rng r;
    td_rng_seed(&r, stream);
    td_rng_jump(&r, begin); /* one draw an element */
    for (size_t i = 0; i < count; i++) dst[i] = (float)((2.0 * td_rng_uniform(&r) - 1.0) * bound);
}

/* --- dropout's mask --------------------------------------------------------------- */

uint64_t td_model_lora_drop_hash(uint64_t seed, int64_t step, int layer, int module_index, int64_t sample,
                                 int position, int column)
{
    const uint64_t row = td_lora_mask_row(td_lora_mask_call(seed, step, layer, module_index), sample, position);
    return td_lora_mask_eat(row, (uint64_t)column);
}

int td_model_lora_dropped(const td_model_lora_drop *k, int module_index, int64_t row, int column, float p)
{
    const uint64_t call = td_lora_mask_call(k->seed, k->step, k->layer, module_index);
    return td_lora_mask_dropped(td_lora_mask_row(call, k->sample0 + row / k->T, (int)(row % k->T)), column,
                                p * 16777216.0f);
}

/* out (N,in) = m/(1-P) x, or (add) out += m/(1-P) x: target tg's mask under key k. */
static void drop_apply(const td_model_desc *d, const td_model_lora_drop *k, const td_model_lora_target *tg,
                       float *out, const float *x, int N, int add)
{
    const float p = d->lora.dropout, threshold = p * 16777216.0f, keep = 1.0f / (1.0f - p);
    const uint64_t call = td_lora_mask_call(k->seed, k->step, k->layer, tg->module_index);
    const int in = tg->in;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < N; r++) {
        const uint64_t row = td_lora_mask_row(call, k->sample0 + r / k->T, r % k->T);
        float *o = out + (size_t)r * (size_t)in;
        const float *xr = x + (size_t)r * (size_t)in;
        for (int c = 0; c < in; c++) {
            const float v = td_lora_mask_dropped(row, c, threshold) ? 0.0f : xr[c] * keep;
            o[c] = add ? o[c] + v : v;
        }
    }
}

/* The acts' dropout key, when this call drops (a key, a dropout, its scratch). */
static const td_model_lora_drop *drop_of(const td_model_desc *d, const td_model_block_acts *a)
{
    return a->lora_drop && d->lora.dropout > 0 && a->lora_xd ? a->lora_drop : NULL;
}

/* --- compute ------------------------------------------------------------------------ */

size_t td_lora_acts_numel(const td_model_desc *d, int B, int T)
{
    int n = td_model_lora_count(d);
    return n ? (size_t)(n + 1) * (size_t)B * (size_t)T * (size_t)d->lora.rank : 0;
}

void td_lora_acts_view(const td_model_desc *d, int B, int T, float *base, td_model_block_acts *a)
{
    int n = td_model_lora_count(d);
    a->lora_xa = n ? base : NULL;
    a->lora_dxa = n ? base + (size_t)n * (size_t)B * (size_t)T * (size_t)d->lora.rank : NULL;
}

static float scale_of(const td_model_desc *d) { return d->lora.alpha / (float)d->lora.rank; }

void td_lora_forward(const td_model_desc *d, const td_model_block *w, const td_model_block_acts *a,
                     td_model_param kind, const float *x, float *y, int ldy, int N)
{
    const int n = td_model_lora_count(d), R = d->lora.rank;
    const float s = scale_of(d);
    const td_model_lora_drop *drop = drop_of(d, a);
    td_ops_gemm_fn *gemm = td_ops_gemm_get(td_ops_isa_best());
    for (int j = 0; j < n; j++) {
        td_model_lora_target tg;
        td_model_lora_target_get(d, j, &tg);
        if (tg.kind != kind || !w->lora_a[j]) continue;
        float *xa = a->lora_xa + (size_t)j * (size_t)N * (size_t)R;
        const float *xd = x;
        if (drop) { /* drop(x): the branch's input */
            drop_apply(d, drop, &tg, a->lora_xd, x, N, 0);
            xd = a->lora_xd;
        }
        memset(xa, 0, (size_t)N * (size_t)R * sizeof(float));
        gemm(N, R, tg.in, xa, (size_t)R, xd, (size_t)tg.in, 1, w->lora_a[j], 1, (size_t)tg.in); // (N,R)
        if (!y) continue; /* a recompute: xa alone */
        float *xs = a->lora_dxa;                                                                   // s xa
        for (size_t i = 0; i < (size_t)N * (size_t)R; i++) xs[i] = s * xa[i];
        gemm(N, tg.rows, R, y + tg.row0, (size_t)ldy, xs, (size_t)R, 1, w->lora_b[j], 1, (size_t)R);
    }
}

void td_lora_backward(const td_model_desc *d, const td_model_block *w, const td_model_block *g,
                      const td_model_block_acts *a, td_model_param kind, const float *x, const float *dy, int ldy,
                      float *dx, int N)
{
    const int n = td_model_lora_count(d), R = d->lora.rank;
    const float s = scale_of(d);
    const td_model_lora_drop *drop = drop_of(d, a);
    td_ops_gemm_fn *gemm = td_ops_gemm_get(td_ops_isa_best());
    for (int j = 0; j < n; j++) {
        td_model_lora_target tg;
        td_model_lora_target_get(d, j, &tg);
        if (tg.kind != kind || !w->lora_a[j]) continue;
        const float *xa = a->lora_xa + (size_t)j * (size_t)N * (size_t)R;
        const float *dyj = dy + tg.row0;
        float *dxa = a->lora_dxa;
        if (g->lora_b[j]) { // dB (rows,R) += s dy^T (rows,N) xa (N,R): s folded into a copy of xa
            for (size_t i = 0; i < (size_t)N * (size_t)R; i++) dxa[i] = s * xa[i];
            gemm(tg.rows, R, N, g->lora_b[j], (size_t)R, dyj, 1, (size_t)ldy, dxa, (size_t)R, 1);
        }
        memset(dxa, 0, (size_t)N * (size_t)R * sizeof(float)); // dxa (N,R) = s dy (N,rows) B (rows,R)
        gemm(N, R, tg.rows, dxa, (size_t)R, dyj, (size_t)ldy, 1, w->lora_b[j], (size_t)R, 1);
        for (size_t i = 0; i < (size_t)N * (size_t)R; i++) dxa[i] *= s;
        if (g->lora_a[j]) { // dA (R,in) += dxa^T (R,N) drop(x) (N,in)
            const float *xd = x;
            if (drop) {
                drop_apply(d, drop, &tg, a->lora_xd, x, N, 0);
                xd = a->lora_xd;
            }
            gemm(R, tg.in, N, g->lora_a[j], (size_t)tg.in, dxa, 1, (size_t)R, xd, (size_t)tg.in, 1);
        }
        if (dx && drop) { // dx (N,in) += m/(1-P) (dxa (N,R) A (R,in))
            memset(a->lora_xd, 0, (size_t)N * (size_t)tg.in * sizeof(float));
            gemm(N, tg.in, R, a->lora_xd, (size_t)tg.in, dxa, (size_t)R, 1, w->lora_a[j], (size_t)tg.in, 1);
            drop_apply(d, drop, &tg, dx, a->lora_xd, N, 1);
        } else if (dx) // dx (N,in) += dxa (N,R) A (R,in)
            gemm(N, tg.in, R, dx, (size_t)tg.in, dxa, (size_t)R, 1, w->lora_a[j], (size_t)tg.in, 1);
    }
}

/* --- merging ------------------------------------------------------------------------ */

void td_model_lora_merge(const td_model_desc *d, const float *params, float *base_params)
{
    td_model_desc b = *d;
    b.lora = (td_model_lora){0};
    const int n = td_model_tensor_count(d), nt = td_model_lora_count(d), R = d->lora.rank;
    const float s = d->lora.rank > 0 ? d->lora.alpha / (float)R : 0.0f;
    int bi = 0; /* the base layout is d's without the adapters, in the same order */
    for (int i = 0; i < n; i++) {
        td_model_tensor t, u;
        td_model_tensor_get(d, i, &t);
        if (TD_MODEL_IS_LORA(t.kind)) continue;
        td_model_tensor_get(&b, bi++, &u);
        float *dst = base_params + u.offset;
        memcpy(dst, params + t.offset, t.numel * sizeof(float));
        if (t.layer < 0) continue;
        /* W[row0 + o, c] += s sum_r B[o, r] A[r, c] for each target on this tensor */
        const int nb = td_model_block_tensor_count(d), first = i - (i - td_model_embed_tensor_count(d)) % nb;
        for (int j = 0; j < nt; j++) {
            td_model_lora_target tg;
            td_model_lora_target_get(d, j, &tg);
            if (tg.kind != t.kind) continue;
            td_model_tensor ta = t, tb = t; /* found below: each target has both */
            for (int k = first; k < first + nb; k++) {
                td_model_tensor tk;
                td_model_tensor_get(d, k, &tk);
                if (tk.kind == TD_MODEL_LORA_A(j)) ta = tk;
                if (tk.kind == TD_MODEL_LORA_B(j)) tb = tk;
            }
            const float *A = params + ta.offset, *Bm = params + tb.offset;
#pragma omp parallel for schedule(static)
            for (int o = 0; o < tg.rows; o++)
                for (int c = 0; c < tg.in; c++) {
                    float acc = 0.0f;
                    for (int r = 0; r < R; r++) acc += Bm[(size_t)o * R + r] * A[(size_t)r * tg.in + c];
                    dst[(size_t)(tg.row0 + o) * tg.in + c] += s * acc;
                }
        }
    }
}
