#!/usr/bin/env python3
"""Fine-tuning on packed conversations against pretraining, at one shape.

    python3 bench/finetune_packed.py build/tidal [--model qwen2.5-0.5b] [--seq 2048] [--micro-batch 8]
                                                  [--steps 30] [--conversations 6000] [--out bench/results]

A full fine-tune of the Qwen2.5-0.5B shape (tidal's preset: 24 layers, 896
wide, 14 heads on 2 key/value heads, vocabulary 151936) on a conversation
file must run within 5% of the tokens/s of pretraining at the same shape,
micro-batch and sequence, with at least 95% of a step's tokens real (not
padding).  Both runs start from the same random weights (no checkpoint is
needed) on the same device:

  pretraining  a stream of random bytes (`tidal prepare` of text: one
               document, every token a target, no positions passed);
  fine-tuning  --conversations generated conversations (system prompt or
               not, one to four turns of lengths drawn from a long-tailed
               distribution, as chat data has), rendered with Qwen2.5's
               chat template (tests/data/chat/qwen2.5.jinja), the loss on the
               assistant messages, packed into rows of --seq (positions
               restarting and attention stopping at each document).

Both use the byte tokenizer (ids below 257; the model's vocabulary, and so
the head's cost, is the preset's whatever ids the data holds).  Each run
takes --steps steps; tokens/s is the median of the step log's tokens_per_s
after the first 5 (the warm-up and the planner's first steps), counting
every token of a step, padding included; the fine-tune's share of real
tokens comes from the packed file (1 - padding / tokens), its counted
targets a step from the log.  The result goes to
bench/results/finetune-packed.json (bench/results.py; --out: another
folder) with the commands, the machine and both verdicts; the script exits
1 if a target is missed.
"""
import argparse
import json
import re
import os
import random
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import results as res  # noqa: E402

RESULT_ID = "finetune-packed"
TEMPLATE = os.path.join(ROOT, "tests", "data", "chat", "qwen2.5.jinja")

WORDS = ("the of and to in is was that for it with as on be at by had are but from not this have which one you were "
         "all there would their we been has when who will more no if out so said what up about into than them can "
         "only other new some could time these two may then do first any my now such like our over even most made "
         "after also did many before must through back years where much your way well down should because each just "
         "people how too little state good very make world still own see work long get here between both life being "
         "under never day same another know while last might great old year off come since against go came right").split()


def sentence(rng, words):
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def lognormal_words(rng, median, cap):
    return max(1, min(cap, int(rng.lognormvariate(0, 0.9) * median)))


def conversation(rng):
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": sentence(rng, rng.randint(5, 40))})
    for _ in range(rng.choice([1, 1, 2, 2, 3, 4])):
        msgs.append({"role": "user", "content": sentence(rng, lognormal_words(rng, 30, 300))})
        msgs.append({"role": "assistant", "content": " ".join(sentence(rng, 12) for _ in
                                                              range(lognormal_words(rng, 4, 40)))})
    return {"messages": msgs}


def run(cmd, log_path=None):
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return p.stdout


def steps_of(log):
    return [json.loads(line) for line in open(log) if line.strip()]


def train(a, data, log, seq):
    cmd = [a.tidal, "train", "--model", a.model, "--data", data, "--seq", str(seq), "--micro-batch",
           str(a.micro_batch), "--steps", str(a.steps), "--precision", "bf16", "--log", log]
    run(cmd + a.extra)
    steps = steps_of(log)
    timed = steps[5:] if len(steps) > 7 else steps[1:]
    return {"command": " ".join(cmd + a.extra),
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed),
            "step_ms": statistics.median(s["step_ms"] for s in timed),
            "targets_per_step": statistics.median(s.get("targets", 0) for s in timed),
            "steps": len(steps), "timed_steps": len(timed), "last_loss": steps[-1]["loss"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tidal")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--conversations", type=int, default=6000)
    ap.add_argument("--out", default=None, help="the results folder (default bench/results)")
    ap.add_argument("extra", nargs="*", help="more `tidal train` flags for both runs (after --)")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="finetune_packed_")
    rng = random.Random(1)
    # pretraining data: enough random text for every step
    need = a.seq * a.micro_batch * (a.steps + 2) + 1
    text = os.path.join(work, "text.txt")
    with open(text, "w") as f:
        while f.tell() < need:
            f.write(sentence(rng, 30) + " ")
    pre_tok = os.path.join(work, "pre.tok")
    run([a.tidal, "prepare", "--input", text, "--out", pre_tok, "--quiet"])
    # fine-tuning data: conversations packed into rows
    jsonl = os.path.join(work, "chat.jsonl")
    with open(jsonl, "w") as f:
        for _ in range(a.conversations):
            f.write(json.dumps(conversation(rng)) + "\n")
    ft_tok = os.path.join(work, "chat.tok")
    said = run([a.tidal, "prepare", "--input", jsonl, "--out", ft_tok, "--seq", str(a.seq), "--chat-template",
                TEMPLATE, "--loss-on", "assistant"])
    print(said.strip())

    m = re.search(r"\((\d+) tokens, (\d+) of them padding", said)
    tokens, padding = int(m.group(1)), int(m.group(2))
    real = 1 - padding / tokens
    pre = train(a, pre_tok, os.path.join(work, "pre.jsonl"), a.seq)
    ft = train(a, ft_tok, os.path.join(work, "ft.jsonl"), a.seq)
    ratio = ft["tokens_per_s"] / pre["tokens_per_s"]
    details = {
        "model": a.model, "seq": a.seq, "micro_batch": a.micro_batch, "steps": a.steps,
        "data": {"conversations": a.conversations, "rows": tokens // a.seq, "tokens": tokens, "padding": padding,
                 "real_share": real, "prepare": said.strip()},
        "pretraining": pre, "fine_tuning": ft, "tokens_per_s_ratio": ratio,
        "targets": {"ratio_at_least": 0.95, "real_share_at_least": 0.95},
        "pass": {"speed": ratio >= 0.95, "real_tokens": real >= 0.95},
    }
    figures = [
        res.figure(f"pretraining {a.model} T{a.seq} B{a.micro_batch}", pre["tokens_per_s"], "tok/s"),
        res.figure(f"fine-tuning on packed conversations {a.model} T{a.seq} B{a.micro_batch}", ft["tokens_per_s"],
                   "tok/s"),
        res.figure("fine-tuning over pretraining tokens/s", 100 * ratio, "%"),
        res.figure("real (non-padding) tokens of the packed file", 100 * real, "%"),
    ]
    path = res.write_result(RESULT_ID, "Fine-tuning on packed conversations beside pretraining at one shape", figures,
                            details, out_dir=a.out)
    print(f"pretraining {pre['tokens_per_s']:.0f} tokens/s, fine-tuning on packed conversations "
          f"{ft['tokens_per_s']:.0f} tokens/s ({100 * ratio:.1f}%; target >= 95%), {100 * real:.1f}% of the tokens "
          f"real (target >= 95%), {ft['targets_per_step']:.0f} targets counted a step; wrote {path}")
    sys.exit(0 if all(details["pass"].values()) else 1)


if __name__ == "__main__":
    main()
