/* Which backend runs which model family.  The cpu backend runs every family
 * on the CPU reference ops (gpt_ref.h); the cuda backend composes GPT-2's
 * block from the CUDA ops (model/cuda/block.cu).  The LLaMA-family CUDA ops
 * (GQA flash attention, RMSNorm, SwiGLU, RoPE) are built on their own branch;
 * until a CUDA LLaMA block is composed from them, a LLaMA or Qwen2 model on
 * cuda is refused here, before anything is allocated, rather than run with
 * the wrong block, and --backend auto picks the cpu backend for them. */
#include "train_impl.h"

td_status td_train_model_supported(const td_train_config *cfg)
{
    const td_gpt_ref_config *mc = &cfg->model;
    td_status st = td_gpt_ref_config_check(mc);
    if (st) return st;
    if (cfg->backend == TD_BACKEND_CUDA && mc->family != TD_MODEL_GPT2)
        return td_error_set(TD_ERR_UNSUPPORTED,
                            "a %s model does not run on the cuda backend yet (its CUDA block is not built): "
                            "use --backend cpu (fp32, the reference ops), or a gpt2 model on cuda",
                            td_model_family_name(mc->family));
    return TD_OK;
}

td_backend_kind td_train_backend_for(const td_train_config *cfg)
{
    if (cfg->backend == TD_BACKEND_AUTO && cfg->model.family != TD_MODEL_GPT2) return TD_BACKEND_CPU;
    return cfg->backend;
}
