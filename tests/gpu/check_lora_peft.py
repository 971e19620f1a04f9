#!/usr/bin/env python3
"""Checks tidal's LoRA against peft + transformers + torch AdamW.

Run on a machine with PyTorch, transformers and peft (the GPU machine; no
internet needed), from the repository root:

    make build/tidal && python3 tests/gpu/check_lora_peft.py build/tidal [--cuda]

For small random LlamaForCausalLM and Qwen2ForCausalLM bases (untied head,
grouped-query attention, Qwen2's q/k/v biases; built by check_llama_hf.py's
build()), saved with save_pretrained:

1. `tidal train --init BASE --lora-rank 4 --lora-alpha 8` for 12 steps (fp32,
   cpu backend, constant lr, weight decay 0.1 on the adapters, with and
   without clipping) equals peft's LoraConfig(r=4, lora_alpha=8,
   target_modules=all seven, lora_dropout=0) on transformers +
   torch.optim.AdamW over the adapters, from the same A (tidal's initial
   adapter, saved after a step of lr 1e-30, loaded into peft; B zero), within
   1e-5 at every step;
2. peft.PeftModel.from_pretrained loads the adapter folder tidal saves
   (--save), and the adapters it holds equal the torch-trained ones within
   1e-4;
3. `tidal merge --adapter DIR --out M` writes a checkpoint whose `tidal eval`
   and transformers loss equal the peft model's (base + tidal's adapter)
   within 1e-5;
4. with --cuda, the same training on `--backend cuda` (fp32, the adapters
   in model/cuda/lora.cu) equals peft's within 1e-5 at every step, and the
   adapters it saves (loaded by peft) equal peft's trained ones within 1e-4;
5. LoRA dropout: `--lora-dropout 0.1` for 12 steps equals peft where each
   module's lora_dropout is a torch module applying tidal's mask
   (lora_mask.py: the hash of seed, step, layer, module, sample, position
   and column; kept elements times 1/(1-P)) within 1e-5 at every step, on
   the cpu backend and with --cuda on the cuda backend, and differs from
   peft's run without dropout by more than that.  The 4 sequences of this
   token file are the same tokens, so the loader's shuffled order cannot
   change which row (sample) a mask falls on.

The token file holds exactly one batch of sequences (docs/data.md), so
every step sees all of them.

Prints one line per check and ends with "check_lora_peft: N passed, M failed";
exits 0 only when all passed.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_llama_hf as hf  # noqa: E402  (build, write_tokens, run, hf_loss, tidal_eval)
import lora_mask  # noqa: E402  (tidal's dropout mask)

TOL = 1e-5
STEPS = 12
R, ALPHA = 4, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # module index = place
DROPOUT, SEED = 0.1, 1337

CASES = [
    ("llama untied, 4 q/kv", "llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    ("qwen2 untied, biases, 2 q/kv", "qwen2", dict(num_key_value_heads=4, tie_word_embeddings=False)),
]

results = []


def check(ok, what):
    results.append(bool(ok))
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    return ok


def tidal_lora(binary, base, data, B, T, lr, clip, steps, out, log, backend="cpu", dropout=0.0):
    return hf.run([binary, "train", "--init", base, "--data", data, "--steps", str(steps), "--micro-batch", str(B),
                   "--seq", str(T), "--lr", str(lr), "--schedule", "constant", "--warmup", "0",
                   "--weight-decay", "0.1", "--clip-grad-norm", str(clip), "--backend", backend, "--precision", "fp32",
                   "--lora-rank", str(R), "--lora-alpha", str(ALPHA), "--lora-targets", ",".join(TARGETS),
                   "--lora-dropout", str(dropout), "--seed", str(SEED), "--log", log, "--save", out])


_masks = {}  # (step, layer, module, B, T, in) -> tidal's mask as a float32 tensor (0 or 1/(1-P))


def tidal_dropout_module(p, layer, module, state):
    """A torch module for peft's lora_dropout that drops what tidal drops: row b, t of the input
    (B, T, in) is sample b (one micro-batch on one rank: the step's samples 0..B-1), position t."""
    import torch

    class TidalDropout(torch.nn.Module):
        def forward(self, x):
            if not self.training:
                return x
            B, T, n = x.shape
            key = (state["step"], layer, module, B, T, n)
            if key not in _masks:
                call = lora_mask.call_key(SEED, state["step"], layer, module)
                keep = lora_mask.keep_scale(p)
                rows = [[keep if k else 0.0 for k in lora_mask.kept_row(call, b, t, n, p)]
                        for b in range(B) for t in range(T)]
                _masks[key] = torch.tensor(rows, dtype=torch.float32).reshape(B, T, n)
            return x * _masks[key].to(device=x.device, dtype=x.dtype)

    return TidalDropout()


def use_tidal_dropout(pm, p, state):
    """Every LoRA module's lora_dropout["default"] replaced by tidal's mask; returns how many."""
    n = 0
    for name, mod in pm.named_modules():
        if not hasattr(mod, "lora_dropout") or "default" not in mod.lora_dropout:
            continue
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1])
        mod.lora_dropout["default"] = tidal_dropout_module(p, layer, TARGETS.index(parts[-1]), state)
        n += 1
    return n


def peft_model(family, over, k, adapter):
    """The base with tidal's initial adapter loaded (B zeroed, as peft starts)."""
    import torch
    from peft import PeftModel
    model = hf.build(family, over, seed=100 + k)
    pm = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.zero_()
    return pm


def peft_steps(pm, seqs, lr, clip, steps, state=None):
    import torch
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    pm.train()
    losses = []
    for s in range(steps):
        if state is not None:
            state["step"] = s + 1  # the optimizer step being made, as tidal keys its masks
        opt.zero_grad()
        loss = hf.hf_loss(pm, seqs)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        losses.append(float(loss))
    pm.eval()
    return losses


def one_case(binary, work, name, family, over, k, cuda):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tag = f"[{name}]"
    model = hf.build(family, over, seed=100 + k)
    base = os.path.join(work, f"base{k}")
    model.save_pretrained(base, safe_serialization=True)
    V, B, T = model.config.vocab_size, 4, 16
    g = torch.Generator().manual_seed(k)
    tokens = torch.randint(0, V, (B * T + 1,), generator=g).tolist()
    data = os.path.join(work, f"tok{k}.tok")
    hf.write_tokens(data, tokens, V)
    seqs = [tokens[s * T: s * T + T + 1] for s in range(B)]

    init = os.path.join(work, f"init{k}")
    rc, _, err = tidal_lora(binary, base, data, B, T, 1e-30, 0.0, 1, init, os.path.join(work, f"init{k}.jsonl"))
    if not check(rc == 0, f"{tag} tidal's initial adapter (one step at lr 1e-30) {err.strip()[-300:]}"):
        return
    for clip in (0.0, 1.0):
        lr = 2e-3
        out = os.path.join(work, f"ad{k}_{int(clip)}")
        log = os.path.join(work, f"log{k}_{int(clip)}.jsonl")
        rc, _, err = tidal_lora(binary, base, data, B, T, lr, clip, STEPS, out, log)
        if not check(rc == 0, f"{tag} tidal train --lora-rank ran (clip {clip}) {err.strip()[-300:]}"):
            continue
        tl = [json.loads(line)["loss"] for line in open(log) if line.strip()]
        pm = peft_model(family, over, k, init)
        pl = peft_steps(pm, seqs, lr, clip, STEPS)
        diff = max(abs(a - b) for a, b in zip(tl, pl)) if len(tl) == len(pl) else float("inf")
        check(diff <= TOL, f"{tag} {STEPS} LoRA steps (clip {clip}): max |tidal - peft| {diff:.2e} <= {TOL}")
        if clip:
            continue
        # 2. peft loads tidal's folder
        loaded = PeftModel.from_pretrained(hf.build(family, over, seed=100 + k), out).eval()
        got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
        want = {n: p for n, p in pm.named_parameters() if "lora_" in n}
        check(set(got) == set(want) and len(got) == 2 * len(TARGETS) * model.config.num_hidden_layers,
              f"{tag} peft loads tidal's adapter folder: {len(got)} adapter tensors")
        worst = max(float((got[n] - want[n]).abs().max()) for n in want if n in got) if got else float("inf")
        check(worst <= 1e-4, f"{tag} tidal's trained adapters vs peft's: max |diff| {worst:.2e} <= 1e-4")
        # 3. the merged checkpoint
        with torch.no_grad():
            want_loss = float(hf.hf_loss(loaded, seqs))
        merged = os.path.join(work, f"merged{k}")
        rc, _, err = hf.run([binary, "merge", "--adapter", out, "--out", merged])
        if check(rc == 0, f"{tag} tidal merge ran {err.strip()[-300:]}"):
            got_loss, err = hf.tidal_eval(binary, merged, data, B, T)
            check(got_loss is not None and abs(got_loss - want_loss) <= TOL,
                  f"{tag} tidal eval of the merge {got_loss} vs peft (base + adapter) {want_loss:.7f} {err}")
            m = AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32,
                                                     attn_implementation="eager").eval()
            with torch.no_grad():
                hl = float(hf.hf_loss(m, seqs))
            check(abs(hl - want_loss) <= TOL, f"{tag} transformers on the merge {hl:.7f} vs peft {want_loss:.7f}")
    # 5. dropout: the same tokens in every sequence (the loader's order cannot move a mask)
    dtokens = [tokens[i % T] for i in range(B * T + 1)]
    ddata = os.path.join(work, f"tokd{k}.tok")
    hf.write_tokens(ddata, dtokens, V)
    dseqs = [dtokens[s * T: s * T + T + 1] for s in range(B)]
    pm = peft_model(family, over, k, init)
    none = peft_steps(pm, dseqs, 2e-3, 0.0, STEPS)
    pm = peft_model(family, over, k, init)
    state = {"step": 0}
    n = use_tidal_dropout(pm, DROPOUT, state)
    check(n == len(TARGETS) * model.config.num_hidden_layers, f"{tag} dropout: tidal's mask in {n} peft modules")
    pl = peft_steps(pm, dseqs, 2e-3, 0.0, STEPS, state)
    apart = max(abs(a - b) for a, b in zip(none, pl))
    check(apart > 10 * TOL, f"{tag} dropout {DROPOUT}: peft's losses move by {apart:.2e} from no dropout")
    for backend in ["cpu"] + (["cuda"] if cuda else []):
        log = os.path.join(work, f"logd{k}{backend}.jsonl")
        rc, _, err = tidal_lora(binary, base, ddata, B, T, 2e-3, 0.0, STEPS, os.path.join(work, f"add{k}{backend}"),
                                log, backend=backend, dropout=DROPOUT)
        if not check(rc == 0, f"{tag} {backend}: tidal train --lora-dropout {DROPOUT} ran {err.strip()[-300:]}"):
            continue
        tl = [json.loads(line)["loss"] for line in open(log) if line.strip()]
        diff = max(abs(a - b) for a, b in zip(tl, pl)) if len(tl) == len(pl) else float("inf")
        check(diff <= TOL, f"{tag} {backend} {STEPS} LoRA steps with dropout {DROPOUT}: max |tidal - peft| "
              f"{diff:.2e} <= {TOL}")
        cfg = json.load(open(os.path.join(work, f"add{k}{backend}", "adapter_config.json")))
        check(abs(cfg["lora_dropout"] - DROPOUT) < 1e-7, f"{tag} {backend}: adapter_config.json's lora_dropout "
              f"{cfg['lora_dropout']}")
    if cuda:
        log = os.path.join(work, f"logcuda{k}.jsonl")
        rc, _, err = tidal_lora(binary, base, data, B, T, 2e-3, 0.0, STEPS, os.path.join(work, f"adc{k}"), log,
                                backend="cuda")
        if check(rc == 0, f"{tag} cuda: tidal train --lora-rank ran {err.strip()[-300:]}"):
            tl = [json.loads(line)["loss"] for line in open(log) if line.strip()]
            pm = peft_model(family, over, k, init)
            pl = peft_steps(pm, seqs, 2e-3, 0.0, STEPS)
            diff = max(abs(a - b) for a, b in zip(tl, pl)) if len(tl) == len(pl) else float("inf")
            check(diff <= TOL, f"{tag} cuda {STEPS} LoRA steps: max |tidal - peft| {diff:.2e} <= {TOL}")
            loaded = PeftModel.from_pretrained(hf.build(family, over, seed=100 + k), os.path.join(work, f"adc{k}"))
            got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
            want = {n: p for n, p in pm.named_parameters() if "lora_" in n}
            worst = max(float((got[n] - want[n]).abs().max()) for n in want if n in got) if got else float("inf")
            check(set(got) == set(want) and worst <= 1e-4,
                  f"{tag} cuda: tidal's trained adapters vs peft's: max |diff| {worst:.2e} <= 1e-4")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tidal", nargs="?", default="build/tidal")
    ap.add_argument("--cuda", action="store_true", help="also the cuda backend (fp32) against peft")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="tdlora")
    try:
        for k, (name, family, over) in enumerate(CASES):
            one_case(os.path.abspath(a.tidal), work, name, family, over, k, a.cuda)
    finally:
        if a.keep:
            print("work directory:", work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    n_ok = sum(results)
    print(f"check_lora_peft: {n_ok} passed, {len(results) - n_ok} failed")
    return 0 if results and n_ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
