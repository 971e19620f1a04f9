#!/usr/bin/env python3
"""Checks tidal's Gemma family (model/family_gemma.c) against transformers' GemmaForCausalLM.

Run on a machine with PyTorch and transformers (the GPU machine; no internet
needed), from the repository root:

    make build/tidal && python3 tests/gpu/check_gemma_hf.py build/tidal

For random small GemmaForCausalLM models that exercise what sets Gemma
apart (RMSNorm's gain 1 + w, the embedding times sqrt(width) rounded to the
compute dtype, GeGLU with the tanh GELU, heads whose total width is not the
model's: wider and narrower; multi-query and grouped-query attention; tied
and untied heads; every parameter perturbed so that no gain is 0):

1. what tests/gpu/check_llama_hf.py checks for every family, with its code:
   `tidal eval` (fp32, cpu backend) equals transformers' loss within 1e-5;
   12 AdamW steps of `tidal train --init` follow transformers + torch.optim
   within 1e-5 (with and without clipping); transformers loads what tidal
   saves, bit for bit, as a GemmaForCausalLM; on a CUDA machine the cuda
   backend's fp32 loss within 1e-5 and 12 bf16 steps within 2%;
2. greedy decoding: `tidal generate --temperature 0` (the key/value-cache
   decoder) continues a prompt with the tokens of transformers' argmax over
   the whole sequence, step by step;
3. parameter counts: `tidal plan --model config.json` of Gemma 2B's and
   Gemma 7B's configurations (GemmaConfig's defaults are 7B's) counts the
   parameters of GemmaForCausalLM built on the meta device (no memory).

Prints one line per check and ends with "check_gemma_hf: N passed, M failed";
exits 0 only when all passed.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_llama_hf as common  # noqa: E402  (the cases' code shared by every family)

check = common.check

# name, family, config overrides (over check_llama_hf's base: width 64, 2 layers, 8 heads), shard size
CASES = [
    ("gemma tied, MQA, 4 heads of 16 over 48 (wider)", "gemma",
     dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True), None),
    ("gemma untied, 2 q/kv, heads of 24 over 48, sharded", "gemma",
     dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False),
     "60KB"),
    ("gemma tied, MHA, 4 heads of 8 over 64 (narrower)", "gemma",
     dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=8, tie_word_embeddings=True), None),
]

# Gemma 2B (google/gemma-2b's config.json) and 7B (GemmaConfig's defaults).
SIZES = {
    "gemma-2b": dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
                     num_key_value_heads=1, head_dim=256, vocab_size=256000, max_position_embeddings=8192),
    "gemma-7b": dict(hidden_size=3072, intermediate_size=24576, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=16, head_dim=256, vocab_size=256000, max_position_embeddings=8192),
}


def greedy_case(binary, work):
    """tidal generate --temperature 0 against an argmax loop over transformers' full forward."""
    import torch
    from transformers import GemmaConfig, GemmaForCausalLM
    tag = "[gemma greedy decoding]"
    torch.manual_seed(7)
    # The byte tokenizer's 257 ids (256 bytes and the end of text) are the vocabulary.
    cfg = GemmaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=16, vocab_size=257, max_position_embeddings=64,
                      rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="gelu_pytorch_tanh",
                      hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, torch_dtype="float32")
    model = GemmaForCausalLM(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.05))
    model = model.float().eval()
    d = os.path.join(work, "greedy")
    model.save_pretrained(d, safe_serialization=True)
    prompt = b"tidal: "
    n_new = 12
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n_new):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            nxt = int(torch.argmax(logits))
            if nxt == 256:  # the end of text: tidal stops there too
                break
            ids.append(nxt)
    want = bytes(ids)
    proc = subprocess.run([binary, "generate", "--checkpoint", d, "--tokenizer", "byte", "--prompt",
                           prompt.decode(), "--tokens", str(n_new), "--temperature", "0", "--threads", "1"],
                          capture_output=True)
    if not check(proc.returncode == 0, f"{tag} tidal generate ran {proc.stderr.decode(errors='replace')[-300:]}"):
        return
    got = proc.stdout[:-1] if proc.stdout.endswith(b"\n") else proc.stdout
    check(got == want, f"{tag} tidal {got!r} vs transformers {want!r}")


def count_case(binary, work, name, sizes):
    """tidal plan's parameter count of a configuration against transformers' on the meta device."""
    import torch
    from transformers import GemmaConfig, GemmaForCausalLM
    tag = f"[{name} parameters]"
    cfg = GemmaConfig(**sizes, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="gelu_pytorch_tanh",
                      hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
    with torch.device("meta"):
        model = GemmaForCausalLM(cfg)
    want = sum(p.numel() for p in model.parameters())  # tied: the embedding once
    d = os.path.join(work, name)
    os.makedirs(d, exist_ok=True)
    cfg.save_pretrained(d)
    proc = subprocess.run([binary, "plan", "--model", d, "--backend", "cpu", "--no-measure", "--json"], capture_output=True,
                          text=True)
    if not check(proc.returncode in (0, 3), f"{tag} tidal plan ran (rc {proc.returncode}) {proc.stderr[-300:]}"):
        return
    got = json.loads(proc.stdout.strip().splitlines()[-1])["params"]
    check(got == want, f"{tag} tidal {got:,} vs transformers {want:,}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary", nargs="?", default="build/tidal")
    ap.add_argument("--work", default=None, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args()
    import torch
    import transformers
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    work = args.work or tempfile.mkdtemp(prefix="td_gemma_check_")
    os.makedirs(work, exist_ok=True)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, devices {devices}, work {work}")
    jobs = [(name, lambda k=k, c=c: common.one_case(args.binary, work, c[0], c[1], c[2], c[3], devices, 50 + k))
            for k, c in enumerate(CASES) for name in [c[0]]]
    jobs.append(("gemma greedy decoding", lambda: greedy_case(args.binary, work)))
    jobs += [(f"{n} parameters", lambda n=n, s=s: count_case(args.binary, work, n, s)) for n, s in SIZES.items()]
    try:
        for name, job in jobs:
            try:
                job()
            except Exception as e:  # a crash is a failed check, reported like the others
                import traceback
                traceback.print_exc()
                check(False, f"[{name}] exception: {e!r}")
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    passed, failed = sum(common.results), len(common.results) - sum(common.results)
    print(f"check_gemma_hf: {passed} passed, {failed} failed")
    sys.exit(0 if failed == 0 and passed > 0 else 1)


if __name__ == "__main__":
    main()
