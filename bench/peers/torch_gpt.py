#!/usr/bin/env python3
"""The PyTorch peers of tidal's GPT training benchmarks (docs/benchmarks.md).

Two systems, one GPT-2 model (transformers.GPT2LMHeadModel, sdpa attention,
vocabulary 50304, no dropout, random tokens, AdamW lr 1e-4):

  --mode eager          the model, fp32 master weights and AdamW(fused=True)
                        state all on the GPU; forward/backward under
                        torch.autocast(bfloat16).
  --mode fsdp2-offload  FSDP2 on one GPU with CPUOffloadPolicy: the model is
                        built on the meta device, each block and then the root
                        are fully_shard()ed (MixedPrecisionPolicy bf16 params,
                        fp32 reduce), materialised on the CPU, and
                        AdamW(fused=True) runs on the CPU copies.  Gradient
                        checkpointing with --ckpt (docs/benchmarks.md's configuration).

A step is --grad-accum micro-batches of --batch sequences of --seq tokens and
one optimizer step; each is timed with torch.cuda.synchronize() on both sides
and the wall clock.  Of --steps steps (default 8) the first --warmup (3) are
warm-up; tokens/s is the tokens of a step over the median of the others.
Peak memory is torch.cuda.max_memory_allocated() over the whole run (model,
optimizer state, activations, everything the caching allocator handed out).
With --budget-gib G the run is checked against G GiB: over it, the result is
flagged ("within_budget": false) and the exit status is 4.

Examples (on the GPU machine):
    python3 bench/peers/torch_gpt.py --mode eager --model 124m --batch 16
    python3 bench/peers/torch_gpt.py --mode fsdp2-offload --model 1.5b --batch 32 \\
        --ckpt --budget-gib 24 --json

With --json the last line of stdout is one JSON object:
    {"system": "pytorch-eager" | "fsdp2-cpu-offload", "workload": ..., "tokens_per_s": ...,
     "step_ms_median": ..., "peak_bytes": ..., "reserved_peak_bytes": ..., "budget_bytes": ... | null,
     "within_budget": true | false | null, "batch": B, "grad_accum": K, "ckpt": bool, ...,
     "error": null | "oom" | "...message..."}
Several GPUs (W7): launched by torchrun (`python3 -m torch.distributed.run
--nproc-per-node 2 bench/peers/torch_gpt.py --mode fsdp2-offload ...`), each
rank uses GPU LOCAL_RANK, FSDP2 shards every block over the ranks (with CPU
offload, each rank's host holds its shard), --batch is per rank, each rank
draws its own batches, tokens/s counts every rank's tokens, and rank 0 alone
prints the JSON (its own peak memory).  The host check divides the state
over the ranks and the host's memory over the ranks on it.

Exit status: 0 done, 1 failed (message on stderr and in "error"), 2 bad flags
or no usable GPU / PyTorch / transformers, 3 out of GPU memory, 4 over the
budget, 5 (fsdp2-offload) the host's memory cannot hold the offloaded state
("error": "host memory: ..."; checked before anything is allocated, see
host_check()).

The machinery here (flags, FSDP2 setup, the timed loop, the JSON result) is
shared with the LLaMA-family peer, bench/peers/torch_hf.py, through a Family
object: what differs between GPT2LMHeadModel and LlamaForCausalLM /
Qwen2ForCausalLM (the config, the blocks FSDP2 wraps, the vocabulary).  A
family may bring a system of its own (bench/peers/peft_lora.py): its `modes`
(the --mode choices), `system` (the JSON's name), `setup(torch, a, cfg)`
returning (model, optimizer, autocast) in place of the eager and FSDP2
set-ups, and `result_fields(model)` added to the JSON.
"""
import argparse
import os
import copy
import importlib
import json
import math
import re
import socket
import statistics
import sys
import time

MODELS = {  # name: (layers, width, heads)
    "124m": (12, 768, 12),
    "1.5b": (48, 1600, 25),
    "4.1b": (32, 3200, 25),
}
VOCAB = 50304      # GPT-2's 50257 padded to a multiple of 64 (docs/benchmarks.md)
TOKEN_RANGE = 50257  # random ids are real GPT-2 ids, as in tidal's data file
GIB = 1 << 30

EXIT_FAILED, EXIT_USAGE, EXIT_OOM, EXIT_OVER_BUDGET, EXIT_HOST_MEMORY = 1, 2, 3, 4, 5
# FSDP2 CPU offload keeps, per parameter, the fp32 param and grad (pinned) and
# AdamW's fp32 m and v on the host; beyond them the process itself (torch,
# CUDA, transformers, the pinned allocator's rounding) takes a few GiB.
HOST_BYTES_PER_PARAM = 16
HOST_MARGIN_BYTES = 6 * GIB


def world():
    """(rank, size, local size) of a torchrun launch; (0, 1, 1) for a plain process."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_WORLD_SIZE", str(size))))


def log(msg):
    print(f"torch_peer: {msg}", file=sys.stderr, flush=True)


class Usage(Exception):
    """Bad flags or an environment that cannot run the peer (exit 2)."""


class HostMemory(Exception):
    """The offloaded state would not fit the host's memory (exit 5)."""


class GPT2Family:
    """transformers.GPT2LMHeadModel at a (layers, width, heads) shape, vocabulary 50304."""
    model_class = "GPT2LMHeadModel"
    layers_field = "n_layer"  # the config's count of blocks
    vocab = VOCAB
    token_range = TOKEN_RANGE

    def add_args(self, ap):
        ap.add_argument("--model", choices=sorted(MODELS), help="preset shape (or --layers/--width/--heads)")
        ap.add_argument("--layers", type=int)
        ap.add_argument("--width", type=int)
        ap.add_argument("--heads", type=int)

    def check_args(self, ap, a):
        if a.model:
            preset = MODELS[a.model]
            a.layers = a.layers or preset[0]
            a.width = a.width or preset[1]
            a.heads = a.heads or preset[2]
        if not (a.layers and a.width and a.heads):
            ap.error("give --model or all of --layers, --width and --heads")
        if a.width % a.heads:
            ap.error(f"--heads {a.heads} must divide --width {a.width}")
        return ("layers", "width", "heads")

    def config(self, a):
        from transformers import GPT2Config
        return GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=a.heads, n_positions=max(1024, a.seq),
                          vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          summary_first_dropout=0.0, use_cache=False)

    def blocks(self, model):
        return model.transformer.h

    def describe(self, a):
        return f"gpt2 {a.layers}L/{a.width}/{a.heads}H, vocab {VOCAB}"

    def fields(self, a):
        return {"layers": a.layers, "width": a.width, "heads": a.heads}


GPT2 = GPT2Family()


def parse_args(argv, family=GPT2):
    ap = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__ or __doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=getattr(family, "modes", ["eager", "fsdp2-offload"]), required=True)
    family.add_args(ap)
    ap.add_argument("--batch", type=int, required=True, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps in all (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="of which untimed (default 3)")
    ap.add_argument("--budget-gib", type=float, help="GPU budget: peak allocated memory must stay under it")
    ap.add_argument("--ckpt", action="store_true", help="gradient checkpointing")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=0.0, help="clip the global grad norm to this (0: off)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--port", type=int, default=0, help="fsdp2: tcp port of the process group (0: a free one)")
    ap.add_argument("--workload", default="", help="a label copied into the JSON (e.g. W3)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    ap.add_argument("--no-host-check", action="store_true",
                    help="fsdp2-offload: start even when the host's available memory looks too small")
    a = ap.parse_args(argv)
    sizes = family.check_args(ap, a)
    for name in ("batch", "seq", "grad_accum") + sizes:
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.steps <= a.warmup:
        ap.error(f"--steps {a.steps} must exceed --warmup {a.warmup} (at least one timed step)")
    if a.budget_gib is not None and a.budget_gib <= 0:
        ap.error("--budget-gib must be positive")
    return a


def import_stack(mode, family=GPT2):
    """torch, transformers and (fsdp2) the FSDP2 API, or a Usage error saying what is missing."""
    try:
        import torch
    except ImportError as e:
        raise Usage(f"PyTorch is not importable ({e}); run this on the GPU machine") from e
    if not torch.cuda.is_available():
        raise Usage(f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)")
    try:
        getattr(importlib.import_module("transformers"), family.model_class)
    except (ImportError, AttributeError) as e:
        raise Usage(f"transformers is not importable ({e}); the peer is transformers.{family.model_class}") from e
    fsdp = None
    if mode == "fsdp2-offload":
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        except ImportError:
            try:  # torch 2.4 / 2.5 kept FSDP2 under _composable
                from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
            except ImportError as e:
                raise Usage(f"torch {torch.__version__} has no FSDP2 (fully_shard, CPUOffloadPolicy): "
                            f"it needs torch >= 2.4 ({e})") from e
        fsdp = (fully_shard, CPUOffloadPolicy, MixedPrecisionPolicy)
    return torch, fsdp


def build_model(cfg, family=GPT2):
    """The family's model class with sdpa attention in the current default device context."""
    cls = getattr(importlib.import_module("transformers"), family.model_class)
    try:
        model = cls._from_config(cfg, attn_implementation="sdpa")
    except TypeError:  # a transformers without attn_implementation in _from_config
        cfg._attn_implementation = "sdpa"
        model = cls(cfg)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        raise RuntimeError(f"transformers built {family.model_class} with attention {impl!r}, not 'sdpa': "
                           "the peer must use torch's scaled_dot_product_attention")
    return model


def init_weights(torch, model, std=0.02):
    """GPT-2's init, which the LLaMA family shares: matrices (embeddings
    included) N(0, std), norm gains (the 1-D weights: LayerNorm, RMSNorm) 1,
    biases 0.

    Works on plain tensors and on FSDP2's DTensor shards: each rank fills its
    local shard (one rank: the whole tensor; under torchrun the ranks share a
    seed, so their shards repeat one another's draws: a benchmark's weights,
    not a faithful init)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            if p.dim() >= 2:
                t.normal_(0.0, std)
            elif name.endswith(".weight"):
                t.fill_(1.0)
            else:
                t.zero_()


def materialise_buffers(torch, model, cfg, device, family=GPT2):
    """After to_empty() the buffers (attention masks, RoPE's inverse
    frequencies) hold garbage: copy each from a 1-layer model built on the
    CPU, matching names with the block index mapped to 0, and place them on
    `device` (FSDP2 manages parameters only, and the forward runs on the GPU)."""
    with torch.device("cpu"):
        small_cfg = copy.deepcopy(cfg)
        setattr(small_cfg, family.layers_field, 1)
        ref = dict(build_model(small_cfg, family).named_buffers())
    for mod_name, mod in model.named_modules():
        for b_name, buf in list(mod._buffers.items()):
            if buf is None:
                continue
            full = f"{mod_name}.{b_name}" if mod_name else b_name
            key = re.sub(r"(^|\.)(h|layers)\.\d+\.", r"\1\2.0.", full)
            if key not in ref:
                raise RuntimeError(f"buffer {full} has no counterpart in a freshly built 1-layer model; "
                                   "this transformers version needs another way to initialise it")
            mod._buffers[b_name] = ref[key].to(device)


def enable_ckpt(model):
    try:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    except TypeError:  # transformers before gradient_checkpointing_kwargs
        model.gradient_checkpointing_enable()


def setup_eager(torch, a, cfg, family):
    with torch.device("cuda"):
        model = build_model(cfg, family)
    init_weights(torch, model)
    if a.ckpt:
        enable_ckpt(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=True)
    return model, opt, True


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mem_available_bytes():
    """MemAvailable of /proc/meminfo, lowered to the cgroup's limit less its use where one is set; None elsewhere."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for ln in f:
                if ln.startswith("MemAvailable:"):
                    avail = int(ln.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    for limit_path, used_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                   "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(used_path) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < (1 << 60) and avail is not None:
            avail = min(avail, int(limit) - used)
        break
    return avail


def host_check(n_params, a):
    """Refuses (HostMemory) an FSDP2 CPU-offload run whose host state cannot fit, before any of it is
    allocated: a run past the host's memory is killed by the kernel, or swaps for hours."""
    _, size, local = world()
    # Each rank holds its 1/size of the state, and the ranks on this host share its memory.
    need = n_params * HOST_BYTES_PER_PARAM // size + HOST_MARGIN_BYTES
    avail = mem_available_bytes()
    if avail is not None:
        avail //= local
    if avail is None or a.no_host_check:
        return
    log(f"host memory: about {need / GIB:.1f} GiB needed ({HOST_BYTES_PER_PARAM} bytes a param for "
        f"{n_params / 1e9:.2f}B params + {HOST_MARGIN_BYTES / GIB:.0f} GiB), {avail / GIB:.1f} GiB available")
    if need > avail:
        raise HostMemory(f"host memory: FSDP2 CPU offload of {n_params / 1e9:.2f}B params needs about "
                         f"{need / GIB:.1f} GiB ({HOST_BYTES_PER_PARAM} bytes a param: fp32 params, grads, AdamW m "
                         f"and v, + {HOST_MARGIN_BYTES / GIB:.0f} GiB for the process), {avail / GIB:.1f} GiB is "
                         "available (--no-host-check tries anyway)")


def setup_fsdp2(torch, fsdp, a, cfg, family):
    import torch.distributed as dist
    fully_shard, CPUOffloadPolicy, MixedPrecisionPolicy = fsdp
    with torch.device("meta"):
        model = build_model(cfg, family)
    host_check(sum(p.numel() for p in model.parameters()), a)
    rank, size, _ = world()
    if size > 1:  # torchrun: its environment names the rendezvous
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        torch.cuda.set_device(0)
        port = a.port or free_port()
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if a.ckpt:
        enable_ckpt(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy()
    for block in family.blocks(model):
        fully_shard(block, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    model.to_empty(device="cpu")
    t0 = time.perf_counter()
    init_weights(torch, model)
    materialise_buffers(torch, model, cfg, "cuda", family)
    log(f"initialised the weights on the CPU in {time.perf_counter() - t0:.1f} s")
    for p in model.parameters():
        if p.device.type != "cpu":
            raise RuntimeError(f"FSDP2 CPU offload left a parameter on {p.device}, expected cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=True)
    return model, opt, False


def run(a, family=GPT2):
    torch, fsdp = import_stack(a.mode, family)
    import transformers
    torch.manual_seed(a.seed)
    torch.set_float32_matmul_precision("high")
    cfg = family.config(a)
    t0 = time.perf_counter()
    rank, size, _ = world()
    if hasattr(family, "setup"):  # a family of its own system (bench/peers/peft_lora.py)
        model, opt, autocast = family.setup(torch, a, cfg)
    elif a.mode == "eager":
        if size > 1:
            raise Usage("--mode eager runs on one GPU; several ranks need --mode fsdp2-offload")
        model, opt, autocast = setup_eager(torch, a, cfg, family)
    else:
        model, opt, autocast = setup_fsdp2(torch, fsdp, a, cfg, family)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{a.mode}: {n_params / 1e6:.1f}M params ({family.describe(a)}), "
        f"B{a.batch} x{a.grad_accum} T{a.seq}, ckpt {'on' if a.ckpt else 'off'}, "
        f"set up in {time.perf_counter() - t0:.1f} s on {torch.cuda.get_device_name(0)}")

    g = torch.Generator(device="cuda")
    g.manual_seed(a.seed + rank)  # each rank its own sequences, as data-parallel ranks read
    # Every batch up front (a few MB): the timed steps do no data work.
    data = torch.randint(0, family.token_range, (a.steps, a.grad_accum, a.batch, a.seq + 1), device="cuda", generator=g)
    tokens_per_step = a.batch * a.grad_accum * a.seq * size
    step_ms, losses = [], []
    for step in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device="cuda")
        for k in range(a.grad_accum):
            x = data[step, k, :, :-1]
            y = data[step, k, :, 1:]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=x, use_cache=False).logits
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
            del logits
            (loss / a.grad_accum).backward()
            loss_sum += loss.detach()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        loss_val = loss_sum.item() / a.grad_accum
        if not math.isfinite(loss_val):
            raise RuntimeError(f"step {step + 1}: the loss is {loss_val}")
        step_ms.append(ms)
        losses.append(loss_val)
        log(f"step {step + 1}/{a.steps}{' (warm-up)' if step < a.warmup else ''}: loss {loss_val:.4f}, "
            f"{ms:.1f} ms, {tokens_per_step / ms * 1e3:.0f} tok/s")

    timed = step_ms[a.warmup:]
    median_ms = statistics.median(timed)
    peak = torch.cuda.max_memory_allocated()
    budget = int(a.budget_gib * GIB) if a.budget_gib is not None else None
    result = {
        "error": None,
        "tokens_per_s": tokens_per_step / median_ms * 1e3,
        "step_ms_median": median_ms,
        "step_ms": step_ms,
        "timed_steps": len(timed),
        "peak_bytes": peak,
        "reserved_peak_bytes": torch.cuda.max_memory_reserved(),
        "budget_bytes": budget,
        "within_budget": None if budget is None else peak <= budget,
        "params": n_params,
        "tokens_per_step": tokens_per_step,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0),
        "ranks": size,
    }
    if hasattr(family, "result_fields"):
        result.update(family.result_fields(model))
    if a.mode == "fsdp2-offload":
        import torch.distributed as dist
        dist.destroy_process_group()
    return result


def main(argv=None, family=GPT2):
    a = parse_args(sys.argv[1:] if argv is None else argv, family)
    out = {
        "system": getattr(family, "system", None) or ("pytorch-eager" if a.mode == "eager" else "fsdp2-cpu-offload"),
        "workload": a.workload or f"{family.describe(a)} T{a.seq}",
        **family.fields(a), "seq": a.seq,
        "batch": a.batch, "grad_accum": a.grad_accum, "ckpt": a.ckpt, "steps": a.steps, "warmup": a.warmup,
        "tokens_per_s": None, "step_ms_median": None, "peak_bytes": None,
        "budget_bytes": int(a.budget_gib * GIB) if a.budget_gib is not None else None,
    }
    rc = 0
    try:
        out.update(run(a, family))
        if out["within_budget"] is False:
            rc = EXIT_OVER_BUDGET
            log(f"over the budget: peak allocated {out['peak_bytes'] / GIB:.2f} GiB > {a.budget_gib:g} GiB")
        log(f"{out['system']}: {out['tokens_per_s']:.0f} tok/s (median of {out['timed_steps']} steps, "
            f"{out['step_ms_median']:.1f} ms), peak allocated {out['peak_bytes'] / GIB:.2f} GiB"
            + (f" of {a.budget_gib:g} GiB" if a.budget_gib is not None else ""))
    except Usage as e:
        out["error"] = str(e)
        rc = EXIT_USAGE
    except HostMemory as e:
        out["error"] = str(e)
        rc = EXIT_HOST_MEMORY
    except Exception as e:  # noqa: BLE001 - reported, never swallowed silently
        oom = type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()
        out["error"] = "oom" if oom else f"{type(e).__name__}: {e}"
        rc = EXIT_OOM if oom else EXIT_FAILED
        if oom:
            try:
                import torch
                out["peak_bytes"] = torch.cuda.max_memory_allocated()
            except Exception:  # noqa: BLE001
                pass
            log(f"out of GPU memory: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        else:
            import traceback
            traceback.print_exc()
    if out["error"] and not out["error"] == "oom":
        log(f"failed: {out['error']}")
    if world()[0] != 0:  # rank 0 alone reports
        return rc
    if a.json:
        print(json.dumps(out), flush=True)
    elif out["tokens_per_s"] is not None:
        print(f"{out['system']} {out['workload']}: {out['tokens_per_s']:.0f} tok/s, "
              f"step {out['step_ms_median']:.1f} ms, peak {out['peak_bytes'] / GIB:.2f} GiB")
    return rc


if __name__ == "__main__":
    sys.exit(main())
