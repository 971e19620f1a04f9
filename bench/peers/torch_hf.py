#!/usr/bin/env python3
"""The PyTorch peers of tidal's LLaMA-family benchmarks (W8, W9 of docs/benchmarks.md).

transformers' LlamaForCausalLM or Qwen2ForCausalLM built from a config of
the --model preset's published shape (random init: matrices N(0, 0.02),
norm gains 1, biases 0; nothing is downloaded), sdpa attention, random
tokens over the whole vocabulary, AdamW lr 1e-4, in one of two systems:

  --mode eager          the model, fp32 master weights and AdamW(fused=True)
                        state on the GPU; forward/backward under
                        torch.autocast(bfloat16) (W9).
  --mode fsdp2-offload  FSDP2 on one GPU with CPUOffloadPolicy (one process,
                        a process group of world size 1): built on the meta
                        device, each decoder layer and then the root
                        fully_shard()ed (bf16 params, fp32 reduce),
                        materialised on the CPU, AdamW(fused=True) on the CPU
                        copies (W8).  Before anything is allocated the
                        host's available memory is checked against what the
                        offloaded state needs (16 bytes a param: fp32 params,
                        grads, m and v): an 8B model does not fit a 125 GiB
                        host, and the run then ends at once with exit status
                        5 and "error": "host memory: ..." instead of being
                        killed by the kernel mid-way.

Presets (tidal's of the same name, model/model.c):
  llama-3.1-8b   32 layers, 4096 wide, 32 heads, 8 key/value heads, MLP 14336,
                 vocab 128256, rope theta 500000 with llama3 scaling (factor 8),
                 RMSNorm eps 1e-5, untied head
  qwen2.5-0.5b   24 layers, 896 wide, 14 heads, 2 key/value heads, MLP 4864,
                 vocab 151936, rope theta 1e6, eps 1e-6, q/k/v biases, tied head
--layers, --width, --heads, --kv-heads, --mlp and --vocab override the
preset's (bench/workloads.py --smoke shrinks the model with them).

Flags, timing and the JSON result are bench/peers/torch_gpt.py's (the loop is
shared): tokens/s over the median of the steps after --warmup; peak memory
torch.cuda.max_memory_allocated(); --budget-gib flags a run over it.

Examples (on the GPU machine):
    python3 bench/peers/torch_hf.py --mode eager --model qwen2.5-0.5b --batch 16 --json
    python3 bench/peers/torch_hf.py --mode fsdp2-offload --model llama-3.1-8b --batch 4 \\
        --grad-accum 4 --ckpt --budget-gib 24 --json
"""
import sys

import torch_gpt

PRESETS = {
    "llama-3.1-8b": dict(family="llama", layers=32, width=4096, heads=32, kv_heads=8, mlp=14336, vocab=128256,
                         theta=500000.0, eps=1e-5, tied=False, llama3_factor=8.0, positions=131072),
    "qwen2.5-0.5b": dict(family="qwen2", layers=24, width=896, heads=14, kv_heads=2, mlp=4864, vocab=151936,
                         theta=1000000.0, eps=1e-6, tied=True, llama3_factor=0.0, positions=32768),
}
SIZES = ("layers", "width", "heads", "kv_heads", "mlp", "vocab")


class HFFamily:
    """LlamaForCausalLM / Qwen2ForCausalLM at a preset's shape (the family is the preset's)."""
    model_class = None  # set by check_args, from the preset
    layers_field = "num_hidden_layers"
    vocab = None
    token_range = None

    def add_args(self, ap):
        ap.add_argument("--model", choices=sorted(PRESETS), required=True, help="the shape (tidal's preset)")
        for name in SIZES:
            ap.add_argument("--" + name.replace("_", "-"), type=int, help=f"override the preset's {name}")

    def check_args(self, ap, a):
        p = PRESETS[a.model]
        for name in SIZES:
            if getattr(a, name) is None:
                setattr(a, name, p[name])
        a.preset = p
        if a.width % a.heads:
            ap.error(f"--heads {a.heads} must divide --width {a.width}")
        if a.heads % a.kv_heads:
            ap.error(f"--kv-heads {a.kv_heads} must divide --heads {a.heads}")
        if (a.width // a.heads) % 2:
            ap.error(f"the head size {a.width // a.heads} must be even (RoPE rotates pairs)")
        self.model_class = "LlamaForCausalLM" if p["family"] == "llama" else "Qwen2ForCausalLM"
        self.vocab = self.token_range = a.vocab
        return SIZES

    def config(self, a):
        import transformers
        p = a.preset
        common = dict(hidden_size=a.width, intermediate_size=a.mlp, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                      max_position_embeddings=max(p["positions"], a.seq), rms_norm_eps=p["eps"],
                      rope_theta=p["theta"], tie_word_embeddings=p["tied"], attention_dropout=0.0, use_cache=False)
        if p["family"] == "llama":
            scaling = None
            if p["llama3_factor"]:
                scaling = {"rope_type": "llama3", "factor": p["llama3_factor"], "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
            return transformers.LlamaConfig(rope_scaling=scaling, **common)
        return transformers.Qwen2Config(use_sliding_window=False, **common)

    def blocks(self, model):
        return model.model.layers

    def describe(self, a):
        return (f"{a.model} shape: {a.layers}L/{a.width}/{a.heads}H, {a.kv_heads} key/value heads, MLP {a.mlp}, "
                f"vocab {a.vocab}")

    def fields(self, a):
        return {"model": a.model, **{name: getattr(a, name) for name in SIZES}}


if __name__ == "__main__":
    sys.exit(torch_gpt.main(family=HFFamily()))
