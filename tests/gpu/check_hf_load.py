#!/usr/bin/env python3
"""Checks tidal's checkpoint format against Hugging Face transformers, both ways.

Run on a machine with PyTorch and transformers (the GPU machine), from the
repository root:

    make build/tests/test_checkpoint && python3 tests/gpu/check_hf_load.py

1. tidal -> transformers: build/tests/test_checkpoint with TD_CKPT_EXPORT_DIR
   writes a checkpoint with deterministic weights (2 layers, 64 wide, 4 heads,
   32 positions, vocabulary 100 padded to 128 in tidal) and tidal's reference
   loss on fixed tokens.  Here: model.safetensors is read with the safetensors
   library (names, shapes, metadata), the directory is loaded with
   GPT2LMHeadModel.from_pretrained, every tensor is compared bit for bit with
   the values recomputed from the formula, the head must be tied to wte, and
   the forward loss must match tidal's within 1e-4 (fp32, CPU, and CUDA when
   present with TF32 off).
2. transformers -> tidal: randomly initialised GPT2LMHeadModels are saved with
   save_pretrained (one file, and sharded with an index); test_checkpoint with
   TD_CKPT_IMPORT_DIR loads each into tidal's reference model and writes its
   loss on the tokens given here; it must match transformers' within 1e-4.

Prints one line per check and ends with "check_hf_load: N passed, M failed";
exits 0 only when all passed.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

TOL = 1e-4
BLOCK = [
    # suffix, tidal shape in units of C (rows, cols or 0), stored transposed (Conv1D)
    ("ln_1.weight", 1, 0, False), ("ln_1.bias", 1, 0, False),
    ("attn.c_attn.weight", 3, 1, True), ("attn.c_attn.bias", 3, 0, False),
    ("attn.c_proj.weight", 1, 1, True), ("attn.c_proj.bias", 1, 0, False),
    ("ln_2.weight", 1, 0, False), ("ln_2.bias", 1, 0, False),
    ("mlp.c_fc.weight", 4, 1, True), ("mlp.c_fc.bias", 4, 0, False),
    ("mlp.c_proj.weight", 1, 4, True), ("mlp.c_proj.bias", 1, 0, False),
]

results = []


def check(ok, what):
    results.append(bool(ok))
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    return ok


def params(cfg):
    """(name, tidal shape, transposed) in tidal's order (checkpoint.h)."""
    C, L = cfg["n_embd"], cfg["n_layer"]
    out = [("wte.weight", (cfg["padded_vocab_size"], C), False),
           ("wpe.weight", (cfg["n_positions"], C), False)]
    for layer in range(L):
        for suffix, r, c, t in BLOCK:
            out.append((f"h.{layer}.{suffix}", (r * C, c * C) if c else (r * C,), t))
    out += [("ln_f.weight", (C,), False), ("ln_f.bias", (C,), False)]
    return out


def values(p, name, shape):
    """The export's weight formula (export_val in tests/test_checkpoint.c), tidal's layout."""
    n = int(np.prod(shape))
    j = np.arange(n, dtype=np.int64)
    k = (p * 7919 + j * 104729) % 2001
    base = 1.0 if ("ln_" in name and name.endswith("weight")) else 0.0
    return (base + (k - 1000).astype(np.float64) * 2.5e-4).astype(np.float32).reshape(shape)


def hf_loss(model, tokens, device):
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    model = model.to(device)
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def run_test_binary(binary, env_extra):
    env = dict(os.environ, **env_extra)
    proc = subprocess.run([binary], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout + proc.stderr)
    return proc.returncode == 0


def export_check(binary, work, devices):
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel

    root = os.path.join(work, "export")
    if not check(run_test_binary(binary, {"TD_CKPT_EXPORT_DIR": root}), "tidal wrote the export checkpoint"):
        return
    expected = json.load(open(os.path.join(root, "expected.json")))
    ckpt = expected["checkpoint"]
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    cfg["padded_vocab_size"] = cfg["tidal_padded_vocab_size"]
    V = cfg["vocab_size"]
    table = params(cfg)

    # The file itself, through the safetensors library.
    with safe_open(os.path.join(ckpt, "model.safetensors"), framework="pt") as f:
        check(f.metadata().get("format") == "pt", "model.safetensors metadata format=pt")
        keys = set(f.keys())
        check(keys == {name for name, _, _ in table},
              f"model.safetensors holds exactly the {len(table)} GPT-2 names (no prefix, no lm_head)")
        bad = []
        for p, (name, shape, transposed) in enumerate(table):
            want = values(p, name, shape)
            if transposed:
                want = want.T
            if name == "wte.weight":
                want = want[:V]
            got = f.get_tensor(name).numpy()
            if got.shape != want.shape or not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
                bad.append(name)
        check(not bad, f"every stored tensor equals the formula bit for bit {bad[:3] if bad else ''}")

    model = GPT2LMHeadModel.from_pretrained(ckpt, attn_implementation="eager")
    model.eval()
    check(model.dtype == torch.float32, f"from_pretrained loads fp32 (got {model.dtype})")
    sd = model.state_dict()
    bad = []
    for p, (name, shape, transposed) in enumerate(table):
        want = values(p, name, shape)
        if transposed:
            want = want.T
        if name == "wte.weight":
            want = want[:V]
        got = sd["transformer." + name].cpu().numpy()
        if got.shape != want.shape or not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            bad.append(name)
    check(not bad, f"every model parameter after from_pretrained equals what tidal wrote {bad[:3] if bad else ''}")
    check(model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(), "lm_head is tied to wte")
    for dev in devices:
        loss = hf_loss(model, expected["tokens"], dev)
        check(abs(loss - expected["loss"]) <= TOL,
              f"forward on {dev}: transformers loss {loss:.6f} vs tidal {expected['loss']:.6f} "
              f"(|diff| {abs(loss - expected['loss']):.2e} <= {TOL})")


def import_check(binary, work, devices):
    from transformers import GPT2Config, GPT2LMHeadModel

    for tag, shard, cfg in [
        ("single file", None, dict(n_layer=2, n_head=4, n_embd=64, n_positions=32, vocab_size=100)),
        ("sharded", "100KB", dict(n_layer=3, n_head=2, n_embd=32, n_positions=16, vocab_size=257)),
    ]:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(**cfg)).eval()
        d = os.path.join(work, "hf_" + tag.replace(" ", "_"))
        if shard:
            model.save_pretrained(d, max_shard_size=shard)
            check(os.path.exists(os.path.join(d, "model.safetensors.index.json")),
                  f"{tag}: save_pretrained wrote an index")
        else:
            model.save_pretrained(d)
        g = torch.Generator().manual_seed(1)
        T = cfg["n_positions"] - 1
        tokens = torch.randint(0, cfg["vocab_size"], (2, T + 1), generator=g).tolist()
        tok_path, out_path = os.path.join(work, f"tokens_{tag[0]}.json"), os.path.join(work, f"tidal_{tag[0]}.json")
        json.dump({"tokens": tokens}, open(tok_path, "w"))
        ok = run_test_binary(binary, {"TD_CKPT_IMPORT_DIR": d, "TD_CKPT_IMPORT_TOKENS": tok_path,
                                      "TD_CKPT_IMPORT_OUT": out_path})
        if not check(ok, f"{tag}: tidal loaded the save_pretrained directory {d}"):
            continue
        tidal = json.load(open(out_path))["loss"]
        for dev in devices:
            loss = hf_loss(model, tokens, dev)
            check(abs(loss - tidal) <= TOL,
                  f"{tag} on {dev}: transformers loss {loss:.6f} vs tidal {tidal:.6f} "
                  f"(|diff| {abs(loss - tidal):.2e} <= {TOL})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default="build/tests/test_checkpoint")
    ap.add_argument("--work", default=None, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if not os.path.exists(args.binary):
        subprocess.run(["make", "-s", args.binary], check=True)
    work = args.work or tempfile.mkdtemp(prefix="td_hf_check_")
    os.makedirs(work, exist_ok=True)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, devices {devices}, work {work}")
    try:
        export_check(args.binary, work, devices)
        import_check(args.binary, work, devices)
    except Exception as e:  # a crash is a failed check, reported like the others
        import traceback
        traceback.print_exc()
        check(False, f"exception: {e!r}")
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    passed, failed = sum(results), len(results) - sum(results)
    print(f"check_hf_load: {passed} passed, {failed} failed")
    sys.exit(0 if failed == 0 and passed > 0 else 1)


if __name__ == "__main__":
    main()
