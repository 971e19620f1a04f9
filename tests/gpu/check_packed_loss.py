#!/usr/bin/env python3
"""Checks the loss of packed, masked documents against transformers, document
by document.

    make build/tidal && python3 tests/gpu/check_packed_loss.py build/tidal

Needs PyTorch and transformers, no network.  For small random GPT-2
(learned positions), LLaMA (RoPE, grouped-query attention) and Qwen2 (q/k/v
biases) models written with save_pretrained, and 60 documents of 2 to 90
random tokens, each with a random loss mask:

1. the documents are packed (first fit, as `tidal prepare` packs) into rows
   of 128 tokens with flags and padding, written here in tidal's token file
   format (version 2, docs/data.md);
2. `tidal eval --batches all --json` (fp32, on the cpu backend and on the
   cuda backend) must equal transformers' loss computed document by
   document: each document alone (position_ids from 0, no other document
   in its attention), cross-entropy summed over the targets its mask
   counts, divided by their count, within 1e-5; and report that count;
3. 6 steps of `tidal train --init` on the packed file (fp32, cpu, constant
   lr, AdamW with decay on matrices; the file holds exactly one batch, so
   every step sees every row) must follow 6 steps of torch.optim.AdamW on the
   mean of the same per-document losses within 1e-5 at every step.

Ends with "check_packed_loss: N passed, M failed" (exit 1 if any failed).
"""
import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib

TOL = 1e-5
ROW = 128
STEPS = 6
results = []


def check(ok, what):
    results.append(bool(ok))
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    return ok


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def make_documents(seed, vocab, n=60):
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        length = rng.randint(2, 90)
        ids = [rng.randrange(vocab - 1) for _ in range(length)]
        counted = [i > 0 and rng.random() < 0.7 for i in range(length)]
        counted[-1] = True
        docs.append((ids, counted))
    return docs


def pack(docs):
    """First fit into rows of ROW tokens: rows of document indices."""
    rows, room = [], []
    for d, (ids, _) in enumerate(docs):
        for r in range(len(rows)):
            if room[r] >= len(ids):
                rows[r].append(d)
                room[r] -= len(ids)
                break
        else:
            rows.append([d])
            room.append(ROW - len(ids))
    return rows


def write_rows(path, docs, rows, vocab):
    """A version 2 token file: rows of ROW tokens, a flag byte a token
    (1 counted target, 2 document start, 4 padding)."""
    ids, flags = [], []
    for row in rows:
        n = 0
        for d in row:
            t, c = docs[d]
            ids += t
            flags += [2] + [1 if x else 0 for x in c[1:]]
            n += len(t)
        if n < ROW:
            ids += [vocab - 1] * (ROW - n)
            flags += [6] + [4] * (ROW - n - 1)
    width = 2 if vocab <= 65536 else 4
    payload = struct.pack("<%d%s" % (len(ids), "H" if width == 2 else "I"), *ids)
    fl = bytes(flags)
    head = b"TDTOKENS" + struct.pack("<IIIIII", 2, 64, width, 2, vocab, vocab - 1)
    head += struct.pack("<QI", len(ids), zlib.crc32(payload) & 0xFFFFFFFF)
    head += struct.pack("<III", ROW, 1, zlib.crc32(fl) & 0xFFFFFFFF) + b"\0" * 4
    head += struct.pack("<I", zlib.crc32(head) & 0xFFFFFFFF)
    assert len(head) == 64
    with open(path, "wb") as f:
        f.write(head + payload + fl)


def build(family, seed, vocab):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM
    torch.manual_seed(seed)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=ROW, vocab_size=vocab,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    else:
        cfg = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=2, max_position_embeddings=ROW, vocab_size=vocab, rms_norm_eps=1e-5,
                   rope_theta=10000.0, attention_dropout=0.0, tie_word_embeddings=False, torch_dtype="float32")
        if family == "llama":
            model = LlamaForCausalLM(LlamaConfig(**cfg))
        else:
            cfg.update(use_sliding_window=False, rope_theta=1000000.0, rms_norm_eps=1e-6)
            model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02))
    return model.float().eval()


def doc_losses(model, docs, device="cpu"):
    """Summed cross-entropy and target count of each document alone."""
    import torch
    import torch.nn.functional as F
    total, count = None, 0
    model = model.to(device)
    for ids, counted in docs:
        x = torch.tensor([ids[:-1]], device=device)
        pos = torch.arange(len(ids) - 1, device=device).unsqueeze(0)
        y = torch.tensor([t if c else -100 for t, c in zip(ids[1:], counted[1:])], device=device)
        logits = model(input_ids=x, position_ids=pos).logits[0]
        s = F.cross_entropy(logits.double(), y, ignore_index=-100, reduction="sum")
        total = s if total is None else total + s
        count += int((y != -100).sum())
    return total, count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tidal")
    ap.add_argument("--keep", help="keep the work folder here")
    a = ap.parse_args()
    import torch
    work = a.keep or tempfile.mkdtemp(prefix="check_packed_")
    os.makedirs(work, exist_ok=True)
    backends = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for k, family in enumerate(["gpt2", "llama", "qwen2"]):
        tag = f"[{family}]"
        vocab = 97
        model = build(family, 100 + k, vocab)
        d = os.path.join(work, family)
        model.save_pretrained(d, safe_serialization=True)
        docs = make_documents(k, vocab)
        rows = pack(docs)
        data = os.path.join(work, family + ".tok")
        write_rows(data, docs, rows, vocab)
        padding = sum(ROW - sum(len(docs[i][0]) for i in r) for r in rows)
        with torch.no_grad():
            s, n = doc_losses(model, docs)
        want = float(s) / n
        print(f"{tag} {len(docs)} documents in {len(rows)} rows of {ROW} ({padding} padding), {n} targets counted")
        for backend in backends:
            rc, out, err = run([a.tidal, "eval", "--checkpoint", d, "--data", data, "--batches", "all",
                                "--micro-batch", "3", "--backend", backend, "--json"])
            if not check(rc == 0, f"{tag} tidal eval --backend {backend} {err.strip()[-300:]}"):
                continue
            got = json.loads(out.strip().splitlines()[-1])
            check(int(got["tokens"]) == n, f"{tag} eval ({backend}) counts {got['tokens']} targets, "
                                           f"transformers {n}")
            check(abs(got["loss"] - want) <= TOL, f"{tag} eval ({backend}): tidal {got['loss']:.7f} vs transformers "
                                                  f"document by document {want:.7f} (|diff| "
                                                  f"{abs(got['loss'] - want):.2e} <= {TOL})")
        # training: one batch holds every row
        lr, wd = 2e-3, 0.1
        log = os.path.join(work, family + ".log")
        rc, _, err = run([a.tidal, "train", "--init", d, "--data", data, "--steps", str(STEPS), "--micro-batch",
                          str(len(rows)), "--seq", str(ROW), "--lr", str(lr), "--schedule", "constant", "--warmup", "0",
                          "--weight-decay", str(wd), "--clip-grad-norm", "0", "--backend", "cpu", "--log", log])
        if not check(rc == 0, f"{tag} tidal train --init on the packed file {err.strip()[-300:]}"):
            continue
        tl = [json.loads(line)["loss"] for line in open(log) if line.strip()]
        ref = build(family, 100 + k, vocab)
        decay = [p for p in ref.parameters() if p.dim() >= 2]
        no_decay = [p for p in ref.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([dict(params=decay, weight_decay=wd), dict(params=no_decay, weight_decay=0.0)],
                                lr=lr, betas=(0.9, 0.999), eps=1e-8)
        ref.train()
        hl = []
        for _ in range(STEPS):
            opt.zero_grad()
            s, n = doc_losses(ref, docs)
            loss = s / n
            loss.backward()
            opt.step()
            hl.append(float(loss))
        diff = max(abs(x - y) for x, y in zip(tl, hl)) if len(tl) == len(hl) else float("inf")
        check(diff <= TOL, f"{tag} {STEPS} training steps on packed rows: max |tidal - torch per document| "
                           f"{diff:.2e} <= {TOL}")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    failed = results.count(False)
    print(f"check_packed_loss: {len(results) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
