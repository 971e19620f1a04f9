/* LoRA dropout's mask (include/tidal/model.h, td_model_lora_drop): the
 * counter-based hash, as inline functions that the CPU reference (lora.c)
 * and the CUDA kernels (cuda/lora.cu) share, so both draw the same bits.
 * Nothing is stored: a backward or a recompute hashes the same key again.
 * tests/gpu/lora_mask.py is the same hash in Python (peft's oracle). */
#ifndef TIDAL_MODEL_LORA_MASK_H
#define TIDAL_MODEL_LORA_MASK_H

#include <stdint.h>

#ifdef __CUDACC__
#define TD_LORA_MASK_FN __host__ __device__ static inline
#else
#define TD_LORA_MASK_FN static inline
#endif

/* splitmix64's finalizer: a bijection of 64-bit words that mixes every bit. */
TD_LORA_MASK_FN uint64_t td_lora_mask_mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* One field of the key into the hash: v + 1, so that zeros still stir it. */
TD_LORA_MASK_FN uint64_t td_lora_mask_eat(uint64_t h, uint64_t v)
{
    return td_lora_mask_mix(h + 0x9e3779b97f4a7c15ull * (v + 1));
}

/* The key of one module's call: seed, step, layer, module. */
TD_LORA_MASK_FN uint64_t td_lora_mask_call(uint64_t seed, int64_t step, int layer, int module)
{
    return td_lora_mask_eat(td_lora_mask_eat(td_lora_mask_eat(seed, (uint64_t)step), (uint64_t)layer),
                            (uint64_t)module);
}

/* A row's key from the call's: its sample and position. */
TD_LORA_MASK_FN uint64_t td_lora_mask_row(uint64_t call, int64_t sample, int position)
{
    return td_lora_mask_eat(td_lora_mask_eat(call, (uint64_t)sample), (uint64_t)position);
}

/* Whether column c of the row is dropped: threshold = P 2^24 (exact in fp32). */
TD_LORA_MASK_FN int td_lora_mask_dropped(uint64_t row, int column, float threshold)
{
    return (float)(td_lora_mask_eat(row, (uint64_t)column) >> 40) < threshold;
}

#endif
