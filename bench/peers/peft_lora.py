#!/usr/bin/env python3
"""The peer of W12 (docs/benchmarks.md): peft's LoRA on transformers' LlamaForCausalLM.

The model of a --model preset's shape (bench/peers/torch_hf.py's presets:
llama-3.1-8b for W12; --layers, --width, ... override it) is built from its
config on the meta device, cast to bf16 there, materialised on the GPU
(to_empty) and initialised there (matrices and embeddings N(0, 0.02), norm
gains 1; the rotary buffers from a freshly built 1-layer model): an 8B
model's init on the CPU would take minutes, on the GPU it takes seconds.
Then, with --ckpt, gradient checkpointing (non-reentrant), and peft's

    LoraConfig(r=--lora-rank, lora_alpha=--lora-alpha, target_modules=--lora-targets,
               lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")

through get_peft_model: the base frozen in bf16, the adapters in fp32
(peft's default autocast_adapter_dtype), B at zero.  The forward and the
loss run under torch.autocast(bfloat16), as transformers' Trainer with
bf16=True runs them; torch.optim.AdamW(fused=True) over the adapters alone,
lr 1e-4.  No GPU budget (W12's peer has none).

Defaults are W12's: rank 16, alpha 32, every linear module of the block
(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).

Flags, timing and the JSON result are bench/peers/torch_gpt.py's (the loop
is shared): tokens/s over the median of the steps after --warmup; the JSON
adds lora_rank, lora_alpha, lora_targets, trainable_params, frozen_params,
the base's and the adapters' dtypes and peft's version.  Exit status 2 when
torch, transformers or peft is missing or no GPU is seen (the message says
which), 3 out of GPU memory, 1 another failure.

Example (on the GPU machine):
    python3 bench/peers/peft_lora.py --mode peft-lora --model llama-3.1-8b --batch 16 --ckpt --json
"""
import copy
import sys
import time

import torch_gpt
import torch_hf

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class PeftLoRA(torch_hf.HFFamily):
    """torch_hf's LLaMA-family model with peft's LoRA adapters, a system of its own (torch_gpt's family hooks)."""
    modes = ["peft-lora"]
    system = "peft-lora"

    def add_args(self, ap):
        super().add_args(ap)
        ap.add_argument("--lora-rank", type=int, default=16, help="LoraConfig's r (default 16)")
        ap.add_argument("--lora-alpha", type=float, default=32.0, help="LoraConfig's lora_alpha (default 32)")
        ap.add_argument("--lora-targets", default=",".join(TARGETS),
                        help=f"target_modules, comma separated (default: every linear module, {','.join(TARGETS)})")

    def check_args(self, ap, a):
        sizes = super().check_args(ap, a)
        a.targets = [t.strip() for t in a.lora_targets.split(",") if t.strip()]
        bad = [t for t in a.targets if t not in TARGETS]
        if bad or not a.targets:
            ap.error(f"--lora-targets: {', '.join(bad) or '(none)'} is no linear module of the block; its modules: "
                     f"{', '.join(TARGETS)}")
        side = min(min(s) for s in self.module_sides(a))
        if a.lora_rank < 1 or a.lora_rank > side:
            ap.error(f"--lora-rank {a.lora_rank}: give 1 up to {side}, the smallest side of a targeted module")
        return sizes

    def describe(self, a):
        return (f"{super().describe(a)}; peft LoRA r {a.lora_rank}, alpha {a.lora_alpha:g} on "
                f"{','.join(a.targets)}")

    def fields(self, a):
        return {**super().fields(a), "lora_rank": a.lora_rank, "lora_alpha": a.lora_alpha, "lora_targets": a.targets}

    def setup(self, torch, a, cfg):
        try:
            import peft
        except ImportError as e:
            raise torch_gpt.Usage(f"peft is not importable ({e}); the peer is peft's LoRA on "
                                  f"transformers.{self.model_class}") from e
        if a.mode != "peft-lora":
            raise torch_gpt.Usage(f"--mode {a.mode}: this peer runs --mode peft-lora")
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = torch_gpt.build_model(cfg, self)
        model.to(dtype=torch.bfloat16)  # on meta: no bytes yet
        model.to_empty(device="cuda")
        torch_gpt.init_weights(torch, model)
        # The rotary buffers do not depend on the vocabulary: a 1-layer reference of a small one is quick to build.
        ref_cfg = copy.deepcopy(cfg)
        ref_cfg.vocab_size = 256
        torch_gpt.materialise_buffers(torch, model, ref_cfg, "cuda", self)
        torch.cuda.synchronize()
        torch_gpt.log(f"built and initialised the bf16 base on the GPU in {time.perf_counter() - t0:.1f} s")
        if a.ckpt:
            torch_gpt.enable_ckpt(model)
        lcfg = peft.LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha, target_modules=list(a.targets),
                               lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, lcfg)
        train = [p for p in model.parameters() if p.requires_grad]
        want = a.layers * sum(a.lora_rank * (i + o) for i, o in self.module_sides(a))
        have = sum(p.numel() for p in train)
        if have != want:
            raise RuntimeError(f"peft made {have} trainable parameters, {want} expected for r {a.lora_rank} on "
                               f"{','.join(a.targets)} of {a.layers} layers")
        for name, p in model.named_parameters():
            if p.requires_grad and "lora_" not in name:
                raise RuntimeError(f"{name} trains: only the adapters may")
        torch_gpt.log(f"peft {peft.__version__}: {have / 1e6:.1f}M adapter parameters "
                      f"({train[0].dtype}) on a {next(p for p in model.parameters() if not p.requires_grad).dtype} "
                      f"base")
        opt = torch.optim.AdamW(train, lr=a.lr, fused=True)
        return model, opt, True

    def module_sides(self, a):
        """(in, out) of each targeted module."""
        kv = a.kv_heads * (a.width // a.heads)
        sides = {"q_proj": (a.width, a.width), "k_proj": (a.width, kv), "v_proj": (a.width, kv),
                 "o_proj": (a.width, a.width), "gate_proj": (a.width, a.mlp), "up_proj": (a.width, a.mlp),
                 "down_proj": (a.mlp, a.width)}
        return [sides[t] for t in a.targets]

    def result_fields(self, model):
        import peft
        train = [p for p in model.parameters() if p.requires_grad]
        frozen = [p for p in model.parameters() if not p.requires_grad]
        return {"trainable_params": sum(p.numel() for p in train), "frozen_params": sum(p.numel() for p in frozen),
                "adapter_dtype": str(train[0].dtype).replace("torch.", ""),
                "base_dtype": str(frozen[0].dtype).replace("torch.", ""), "peft": peft.__version__}


if __name__ == "__main__":
    sys.exit(torch_gpt.main(family=PeftLoRA()))
