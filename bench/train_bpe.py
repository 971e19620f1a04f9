#!/usr/bin/env python3
"""Trains a GPT-2-style byte-level BPE tokenizer (GPT-2's pre-tokenizer
pattern, <|endoftext|>) on a text file with the `tokenizers` library and
writes it as a Hugging Face tokenizer.json, for token files at a real
vocabulary size where no published tokenizer can be downloaded (the GPU
machine has `tokenizers` and no network).  Issue 10's quality check at W1's
shape uses it: GPT-2's vocabulary size, text from bench/text_corpus.sh.

    python3 bench/train_bpe.py TEXT OUT/tokenizer.json [--vocab 50257] [--sample-mb 0]

Then: TOKENIZER=OUT/tokenizer.json bench/text_corpus.sh ... (or
`tidal prepare --tokenizer OUT/tokenizer.json`).  --sample-mb N trains on
the first N MiB of the text only (0: all of it); the token file still covers
all of it."""
import argparse
import os
import sys
import time


def chunks(path, limit):
    """The text in 1 MiB pieces, cut after a newline, up to limit bytes."""
    read = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        while not limit or read < limit:
            piece = f.read(1 << 20)
            if not piece:
                return
            piece += f.readline()
            read += len(piece.encode("utf-8"))
            yield piece


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("text", help="UTF-8 text to train on")
    ap.add_argument("out", help="where to write tokenizer.json (its folder is created)")
    ap.add_argument("--vocab", type=int, default=50257, help="vocabulary size, <|endoftext|> included (default 50257)")
    ap.add_argument("--sample-mb", type=float, default=0, help="train on the first N MiB only (default 0: all)")
    a = ap.parse_args()
    if a.vocab < 257:
        sys.exit(f"train_bpe: --vocab {a.vocab}: at least 257 (256 bytes and <|endoftext|>)")
    if not os.path.isfile(a.text):
        sys.exit(f"train_bpe: {a.text}: no such file")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        sys.exit("train_bpe: the Python package `tokenizers` is needed (pip install tokenizers)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.time()
    tok.train_from_iterator(chunks(a.text, int(a.sample_mb * (1 << 20))), trainer)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tok.save(a.out)
    print(f"train_bpe: {tok.get_vocab_size()} tokens in {time.time() - t0:.1f} s -> {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
