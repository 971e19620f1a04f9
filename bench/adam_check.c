/* Replay of an optimizer trajectory for the torch oracle (adam_check.h).
 *
 * DIR/meta.json (written by the script):
 *   {"numel": N, "steps": S, "chunks": [n0, n1, ...] (sum N),
 *    "grad_dtype": "fp32"|"bf16"|"fp16", "param_dtype": "bf16"|"fp16"|"fp32",
 *    "beta1", "beta2", "eps", "weight_decay", "decay": "decoupled"|"l2",
 *    "max_grad_norm",
 *    "lr": {"decay", "lr", "min_lr", "warmup_steps", "total_steps", "gamma"},
 *    "loss_scale": {"kind", "init_scale", "growth_factor", "backoff_factor",
 *                   "growth_interval", "hysteresis", "min_scale"}}
 * DIR/param0.f32: N fp32 initial params.
 * DIR/grads.f32: S x N fp32 unscaled grads; each step they are multiplied by
 *   the current loss scale and rounded to grad_dtype, as a backward would
 *   produce them, then handed to the optimizer chunk by chunk.
 * Writes DIR/out_master.f32 (N fp32), DIR/out_param.bin (N of param_dtype)
 * and DIR/out.json ({"isa", "threads", "step", "skipped",
 * "steps": [{"skip", "lr", "grad_norm", "clip_coef", "loss_scale"}, ...]}). */
#include "adam_check.h"
#include "tidal/alloc.h"
#include "tidal/convert.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

static td_status read_file(const char *dir, const char *name, void *dst, size_t bytes, long offset)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) return td_error_set(TD_ERR_IO, "cannot open %s: run tests/gpu/adam_torch_check.py to create it", path);
    int ok = fseek(f, offset, SEEK_SET) == 0 && fread(dst, 1, bytes, f) == bytes;
    fclose(f);
    return ok ? TD_OK : td_error_set(TD_ERR_IO, "%s is shorter than meta.json says (%zu bytes at %ld)", path, bytes, offset);
}

static td_status write_file(const char *dir, const char *name, const void *src, size_t bytes)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return td_error_set(TD_ERR_IO, "cannot create %s", path);
    int ok = fwrite(src, 1, bytes, f) == bytes;
    ok = (fclose(f) == 0) && ok;
    return ok ? TD_OK : td_error_set(TD_ERR_IO, "cannot write %s", path);
}

static double num(const cJSON *o, const char *key, double fallback)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : fallback;
}

static const char *str(const cJSON *o, const char *key, const char *fallback)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : fallback;
}

static td_status parse_meta(const cJSON *meta, td_optim_params *p, td_dtype *gdt, td_dtype *pdt)
{
    td_status st = TD_OK;
    *p = td_optim_default_params();
    TD_TRY(td_dtype_parse(str(meta, "grad_dtype", "fp32"), gdt));
    TD_TRY(td_dtype_parse(str(meta, "param_dtype", "bf16"), pdt));
    p->adam.beta1 = num(meta, "beta1", p->adam.beta1);
    p->adam.beta2 = num(meta, "beta2", p->adam.beta2);
    p->adam.eps = num(meta, "eps", p->adam.eps);
    p->adam.weight_decay = num(meta, "weight_decay", p->adam.weight_decay);
    p->adam.decay = !strcmp(str(meta, "decay", "decoupled"), "l2") ? TD_ADAM_DECAY_L2 : TD_ADAM_DECAY_DECOUPLED;
    p->max_grad_norm = num(meta, "max_grad_norm", 0);
    const cJSON *lr = cJSON_GetObjectItemCaseSensitive(meta, "lr");
    TD_TRY(td_lr_decay_parse(str(lr, "decay", "constant"), &p->lr.decay));
    p->lr.lr = num(lr, "lr", p->lr.lr);
    p->lr.min_lr = num(lr, "min_lr", 0);
    p->lr.warmup_steps = (long)num(lr, "warmup_steps", 0);
    p->lr.total_steps = (long)num(lr, "total_steps", 0);
    p->lr.gamma = num(lr, "gamma", 1);
    const cJSON *ls = cJSON_GetObjectItemCaseSensitive(meta, "loss_scale");
    TD_TRY(td_loss_scale_kind_parse(str(ls, "kind", "none"), &p->scaler.kind));
    p->scaler.init_scale = num(ls, "init_scale", p->scaler.init_scale);
    p->scaler.growth_factor = num(ls, "growth_factor", p->scaler.growth_factor);
    p->scaler.backoff_factor = num(ls, "backoff_factor", p->scaler.backoff_factor);
    p->scaler.growth_interval = (long)num(ls, "growth_interval", (double)p->scaler.growth_interval);
    p->scaler.hysteresis = (int)num(ls, "hysteresis", p->scaler.hysteresis);
    p->scaler.min_scale = num(ls, "min_scale", p->scaler.min_scale);
cleanup:
    return st;
}

td_status td_adam_check_run(td_adam_cpu *cpu, const char *dir)
{
    td_status st = TD_OK;
    char *text = NULL;
    cJSON *meta = NULL, *out = NULL;
    float *master = NULL, *m = NULL, *v = NULL, *g32 = NULL;
    void *grad = NULL, *param = NULL;
    td_adam_chunk *chunks = NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/meta.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) TD_FAIL(TD_ERR_IO, "cannot open %s: run tests/gpu/adam_torch_check.py to create it", path);
    text = td_calloc(1, 1 << 20, TD_ROLE_META);
    size_t len = text ? fread(text, 1, (1 << 20) - 1, f) : 0;
    fclose(f);
    if (!text) TD_FAIL(TD_ERR_NOMEM, "out of memory");
    meta = cJSON_ParseWithLength(text, len);
    if (!meta) TD_FAIL(TD_ERR_INVALID, "%s is not valid JSON", path);

    size_t n = (size_t)num(meta, "numel", 0);
    long steps = (long)num(meta, "steps", 0);
    const cJSON *jchunks = cJSON_GetObjectItemCaseSensitive(meta, "chunks");
    int n_chunks = cJSON_IsArray(jchunks) ? cJSON_GetArraySize(jchunks) : 0;
    if (!n || steps < 1 || n_chunks < 1) TD_FAIL(TD_ERR_INVALID, "%s: needs numel, steps and chunks", path);
    td_optim_params op;
    td_dtype gdt, pdt;
    TD_TRY(parse_meta(meta, &op, &gdt, &pdt));
    td_optim opt;
    TD_TRY(td_optim_init(&opt, &op));

    master = td_malloc(n * 4, TD_ROLE_OPTIM);
    m = td_malloc(n * 4, TD_ROLE_OPTIM);
    v = td_malloc(n * 4, TD_ROLE_OPTIM);
    g32 = td_malloc(n * 4, TD_ROLE_WORKSPACE);
    grad = td_malloc(n * td_dtype_bytes(gdt), TD_ROLE_CHUNK);
    param = td_malloc(n * td_dtype_bytes(pdt), TD_ROLE_CHUNK);
    chunks = td_calloc((size_t)n_chunks, sizeof *chunks, TD_ROLE_META);
    if (!master || !m || !v || !g32 || !grad || !param || !chunks) TD_FAIL(TD_ERR_NOMEM, "out of memory for %zu params", n);
    size_t off = 0;
    for (int j = 0; j < n_chunks; j++) {
        size_t cn = (size_t)cJSON_GetArrayItem(jchunks, j)->valuedouble;
        if (off + cn > n) TD_FAIL(TD_ERR_INVALID, "%s: chunks add up to more than numel", path);
        chunks[j] = (td_adam_chunk){.master = master + off, .m = m + off, .v = v + off,
                                    .grad = (char *)grad + off * td_dtype_bytes(gdt), .grad_dtype = gdt,
                                    .param_out = (char *)param + off * td_dtype_bytes(pdt),
                                    .param_dtype = pdt, .numel = cn};
        off += cn;
    }
    if (off != n) TD_FAIL(TD_ERR_INVALID, "%s: chunks add up to %zu, not numel %zu", path, off, n);
    TD_TRY(read_file(dir, "param0.f32", g32, n * 4, 0));
    for (int j = 0; j < n_chunks; j++)
        TD_TRY(td_adam_cpu_init(cpu, &chunks[j], g32 + (chunks[j].master - master), TD_DTYPE_F32));

    out = cJSON_CreateObject();
    cJSON_AddStringToObject(out, "isa", td_optim_isa_name(td_adam_cpu_isa(cpu)));
    cJSON_AddNumberToObject(out, "threads", td_adam_cpu_threads(cpu));
    cJSON *jsteps = cJSON_AddArrayToObject(out, "steps");
    for (long s = 0; s < steps; s++) {
        TD_TRY(read_file(dir, "grads.f32", g32, n * 4, (long)(s * (long)n * 4)));
        float scale = (float)td_optim_loss_scale(&opt);
        for (size_t i = 0; i < n; i++) {
            float x = g32[i] * scale;
            if (gdt == TD_DTYPE_BF16) ((uint16_t *)grad)[i] = td_bf16_from_f32(x);
            else if (gdt == TD_DTYPE_F16) ((uint16_t *)grad)[i] = td_f16_from_f32(x);
            else ((float *)grad)[i] = x;
        }
        td_grad_stats stats = {0};
        for (int j = 0; j < n_chunks; j++) TD_TRY(td_adam_cpu_grad_stats(cpu, chunks[j].grad, gdt, chunks[j].numel, &stats));
        td_optim_step step;
        TD_TRY(td_optim_begin_step(&opt, &stats, &step));
        if (!step.skip) TD_TRY(td_adam_cpu_update(cpu, &step.coeffs, chunks, n_chunks));
        cJSON *js = cJSON_CreateObject();
        cJSON_AddBoolToObject(js, "skip", step.skip);
        cJSON_AddNumberToObject(js, "lr", step.lr);
        cJSON_AddNumberToObject(js, "grad_norm", step.skip ? -1 : step.grad_norm);
        cJSON_AddNumberToObject(js, "clip_coef", step.clip_coef);
        cJSON_AddNumberToObject(js, "loss_scale", step.loss_scale);
        cJSON_AddItemToArray(jsteps, js);
    }
    cJSON_AddNumberToObject(out, "step", (double)opt.step);
    cJSON_AddNumberToObject(out, "skipped", (double)opt.skipped_steps);
    cJSON_AddNumberToObject(out, "final_loss_scale", td_optim_loss_scale(&opt));
    TD_TRY(write_file(dir, "out_master.f32", master, n * 4));
    TD_TRY(write_file(dir, "out_param.bin", param, n * td_dtype_bytes(pdt)));
    char *json = cJSON_Print(out);
    if (!json) TD_FAIL(TD_ERR_NOMEM, "out of memory printing JSON");
    st = write_file(dir, "out.json", json, strlen(json));
    cJSON_free(json);
    if (st) goto cleanup;
    fprintf(stderr, "bench adam: replayed %ld steps of %zu params in %d chunks (%s, %d threads) into %s\n", steps, n,
            n_chunks, td_optim_isa_name(td_adam_cpu_isa(cpu)), td_adam_cpu_threads(cpu), dir);
cleanup:
    cJSON_Delete(meta);
    cJSON_Delete(out);
    td_free(text);
    td_free(master);
    td_free(m);
    td_free(v);
    td_free(g32);
    td_free(grad);
    td_free(param);
    td_free(chunks);
    return st;
}
