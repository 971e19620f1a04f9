/* `tidal plan`'s disk tier: the disk object of --json and the lines of the
 * table (the plan's disk_* fields, the rates measured in --offload-dir, the
 * disk term of the step bound and the gradient accumulation that hides it). */
#include "cli.h"
#include <cjson/cJSON.h>
#include "tidal/util.h"

#include <stdio.h>

cJSON *td_cli_plan_disk_json(const td_train_config *cfg, const td_train_plan *p, const td_train_rates *r,
                             const td_train_bound *bd, int hide_accum, const td_train_bound *hide)
{
    cJSON *d = cJSON_CreateObject(), *dirs = cJSON_AddArrayToObject(d, "dirs");
    for (int i = 0; i < cfg->mm.n_disk_dirs; i++) cJSON_AddItemToArray(dirs, cJSON_CreateString(cfg->mm.disk_dirs[i]));
    cJSON_AddNumberToObject(d, "chunks", p->disk_chunks);
    cJSON_AddNumberToObject(d, "grad_chunks", p->disk_grad_chunks);
    cJSON_AddNumberToObject(d, "param_chunks", p->disk_param_chunks);
    cJSON_AddNumberToObject(d, "bytes", (double)p->disk_bytes);
    cJSON_AddNumberToObject(d, "free_bytes", (double)p->disk_free_bytes);
    cJSON_AddBoolToObject(d, "fits", p->disk_fits);
    cJSON_AddNumberToObject(d, "sets", p->disk_sets);
    cJSON_AddNumberToObject(d, "set_bytes", (double)p->disk_set_bytes);
    cJSON_AddNumberToObject(d, "read_bytes_per_step", p->disk_read_bytes_per_step);
    cJSON_AddNumberToObject(d, "write_bytes_per_step", p->disk_write_bytes_per_step);
    cJSON *m = cJSON_AddObjectToObject(d, "measured");
    cJSON_AddNumberToObject(m, "write_gbytes_per_s", r->disk_write_gbs);
    cJSON_AddNumberToObject(m, "read_gbytes_per_s", r->disk_read_gbs);
    cJSON_AddNumberToObject(m, "mixed_gbytes_per_s", r->disk_mixed_gbs);
    cJSON_AddBoolToObject(m, "direct", r->disk_direct);
    cJSON_AddNumberToObject(d, "disk_ms", bd->disk_ms);
    cJSON_AddNumberToObject(d, "hide_grad_accum", hide_accum);
    cJSON_AddNumberToObject(d, "hide_within", TD_CLI_DISK_HIDE_WITHIN);
    cJSON_AddNumberToObject(d, "hide_step_lower_bound_ms", hide ? hide->bound_ms : 0.0);
    return d;
}

void td_cli_plan_disk_text(FILE *f, const td_train_config *cfg, const td_train_plan *p, const td_train_rates *r)
{
    char a[32], b[32], c[32];
    fprintf(f, "\ndisk (");
    for (int i = 0; i < cfg->mm.n_disk_dirs; i++) fprintf(f, "%s%s", i ? ", " : "--offload-dir ", cfg->mm.disk_dirs[i]);
    if (cfg->disk_bytes) fprintf(f, "%s--disk-bytes %s", cfg->mm.n_disk_dirs ? "; " : "", td_format_bytes(cfg->disk_bytes, a, sizeof a));
    else fprintf(f, ": %s free", td_format_bytes(p->disk_free_bytes, a, sizeof a));
    fprintf(f, ")\n");
    if (!p->disk_chunks) {
        fprintf(f, "  nothing on disk: the host's RAM holds the whole optimizer state\n");
    } else {
        fprintf(f, "  optimizer chunks   %d of %d on disk (the CPU AdamW's state the host's RAM cannot hold)\n",
                p->disk_chunks, p->optim_chunks);
        if (p->disk_grad_chunks || p->disk_param_chunks)
            fprintf(f, "  grads, params      %d and %d chunks on disk too (the state alone was not enough: each upload of\n"
                       "                     a param there reads it first)\n", p->disk_grad_chunks, p->disk_param_chunks);
        fprintf(f, "  scratch file       %s\n", td_format_bytes(p->disk_bytes, a, sizeof a));
        fprintf(f, "  slots              %d a role, %s pinned for one of each (in staging above): a chunk while it is used\n",
                p->disk_sets, td_format_bytes(p->disk_set_bytes, b, sizeof b));
        fprintf(f, "  a step             reads %s and writes %s -> %s\n",
                td_format_bytes((size_t)p->disk_read_bytes_per_step, a, sizeof a),
                td_format_bytes((size_t)p->disk_write_bytes_per_step, b, sizeof b),
                p->disk_fits ? "FITS" : "DOES NOT FIT (free space there, or add --offload-dir on another drive)");
    }
    if (r->disk_mixed_gbs > 0)
        fprintf(f, "  measured           write %.2f GB/s, read %.2f GB/s, both at once %.2f GB/s%s\n", r->disk_write_gbs,
                r->disk_read_gbs, r->disk_mixed_gbs, r->disk_direct ? " (O_DIRECT)" : " (through the page cache)");
    (void)c;
}

void td_cli_plan_disk_estimate(FILE *f, const td_train_config *cfg, const td_train_plan *p, const td_train_bound *bd,
                               int hide_accum, const td_train_bound *hide)
{
    if (!p->disk_chunks) return;
    if (bd->disk_ms <= 0) {
        fprintf(f, "               disk: not timed (no --offload-dir measured here)\n");
        return;
    }
    fprintf(f, "               disk %.1f ms (reads and writes at once, beside the CPU AdamW: it waits for each read)\n",
            bd->disk_ms);
    if (hide_accum == cfg->grad_accum)
        fprintf(f, "               the disk costs at most %.0f%% of the step at this --grad-accum\n",
                TD_CLI_DISK_HIDE_WITHIN * 100);
    else if (hide_accum > 0)
        fprintf(f, "               from --grad-accum %d the disk costs at most %.0f%% of the step (bound %.1f ms, %.0f "
                   "tokens/s)\n", hide_accum, TD_CLI_DISK_HIDE_WITHIN * 100, hide->bound_ms, hide->tokens_per_s);
    else
        fprintf(f, "               no --grad-accum up to 65536 brings the disk under %.0f%% of the step\n",
                TD_CLI_DISK_HIDE_WITHIN * 100);
}
