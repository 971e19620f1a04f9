/* The training configuration's defaults and checks (see
 * include/tidal/trainer.h). */
#include "tidal/trainer.h"

#include <stdlib.h>
#include <string.h>

td_train_config td_train_default_config(void)
{
    td_train_config c = {0};
    td_model_preset("tiny", &c.model);
    c.micro_batch = 4;
    c.seq_len = 64;
    c.grad_accum = 1;
    c.seed = 1337;
    c.precision = TD_DTYPE_F32;
    c.ckpt = TD_CKPT_AUTO;
    c.backend = TD_BACKEND_AUTO;
    c.mm = td_memmgr_default_params();
    c.optim = td_optim_default_params();
    const char *rc = getenv("TD_REDUCE_COMM");
    if (rc && *rc)
        c.reduce_comm = !strcmp(rc, "own") ? TD_REDUCE_COMM_OWN
                      : !strcmp(rc, "shared") ? TD_REDUCE_COMM_SHARED : TD_REDUCE_COMM_INVALID;
    return c;
}

td_backend_params td_train_backend_params(const td_train_config *cfg)
{
    td_backend_params bp = td_backend_default_params();
    bp.kind = cfg->backend;
    if (cfg->cpu_device_bytes) bp.cpu_device_bytes = cfg->cpu_device_bytes;
    else if (cfg->gpu_budget != TD_GPU_BUDGET_MAX && cfg->gpu_budget > bp.cpu_device_bytes)
        bp.cpu_device_bytes = cfg->gpu_budget;
    return bp;
}

td_status td_train_config_check(const td_train_config *c)
{
    td_status st = td_model_desc_check(&c->model);
    if (st) return st;
    if ((unsigned)c->reduce_comm >= TD_REDUCE_COMM_INVALID) {
        const char *v = getenv("TD_REDUCE_COMM");
        return td_error_set(TD_ERR_INVALID, "TD_REDUCE_COMM=%s: use shared (the grads' reduce-scatters on the gathers' "
                            "communicator, the default) or own (on a communicator of their own)", v ? v : "?");
    }
    if (c->micro_batch < 1) return td_error_set(TD_ERR_INVALID, "--micro-batch must be at least 1 (got %d)", c->micro_batch);
    if (c->seq_len < 1 || c->seq_len > c->model.n_positions)
        return td_error_set(TD_ERR_INVALID, "--seq %d must lie in [1, %d] (the model's positions)", c->seq_len,
                            c->model.n_positions);
    if (c->grad_accum < 1) return td_error_set(TD_ERR_INVALID, "--grad-accum must be at least 1 (got %d)", c->grad_accum);
    if ((size_t)c->micro_batch * (size_t)c->seq_len > (size_t)1 << 31)
        return td_error_set(TD_ERR_INVALID, "--micro-batch x --seq is too large");
    if ((unsigned)c->precision >= TD_DTYPE_COUNT) return td_error_set(TD_ERR_INVALID, "bad precision");
    if (c->loss_chunk < 0)
        return td_error_set(TD_ERR_INVALID, "--loss-chunk %d: give the rows of a chunk, or 0 for auto", c->loss_chunk);
    if (c->ckpt_blocks < 0 || c->ckpt_blocks > c->model.n_layer)
        return td_error_set(TD_ERR_INVALID, "--ckpt %d: the model has %d blocks; recompute between 0 and %d of them",
                            c->ckpt_blocks, c->model.n_layer, c->model.n_layer);
    if (c->ranks < 0 || (c->ranks > 1 && (c->rank < 0 || c->rank >= c->ranks)))
        return td_error_set(TD_ERR_INVALID, "rank %d of %d ranks", c->rank, c->ranks);
    if (c->model.lora.rank > 0 && !(c->model.lora.dropout >= 0 && c->model.lora.dropout < 1))
        return td_error_set(TD_ERR_INVALID, "--lora-dropout %g: give a probability in [0, 1)", c->model.lora.dropout);
    if ((unsigned)c->shard > TD_SHARD_NODE) return td_error_set(TD_ERR_INVALID, "bad --shard mode %d", (int)c->shard);
    if (c->ranks > 1 && c->shard == TD_SHARD_NODE && c->local_ranks > 0 && c->ranks % c->local_ranks)
        return td_error_set(TD_ERR_INVALID, "--shard node: %d ranks with %d on this host; every host must run the same "
                            "number of ranks", c->ranks, c->local_ranks);
    if (c->ranks > 1 && c->shard == TD_SHARD_NODE && c->local_ranks == 1)
        return td_error_set(TD_ERR_INVALID, "--shard node with one rank a host would keep the whole model state on "
                            "every host; use --shard world (or auto)");
    return td_optim_params_check(&c->optim);
}
