#!/usr/bin/env python3
"""Checks tidal's GPT-2 BPE against a reference tokenizer on a real vocabulary.

    python3 tests/gpu/check_bpe_vs_hf.py --vocab vocab.json --merges merges.txt \
        [--tidal build/tidal] [--reference hf|regex] [--corpus DIR] [--random N]

Every sample text is written to its own file in a temporary folder and
tokenized by `tidal prepare --tokenizer gpt2` (one run: files become
documents separated by <|endoftext|>); the token file is parsed here and
compared, document by document, with the reference:

  hf     transformers.GPT2TokenizerFast(vocab_file, merges_file) (the default;
         needs transformers, no network: the files are given)
  regex  OpenAI's encoder.py algorithm with the `regex` module (for machines
         without transformers)

Samples: built-in edge cases (contractions, Unicode letters and numbers,
whitespace runs, CRLF, emoji, CJK, the <|endoftext|> literal), random
strings over a mixed alphabet, and with --corpus every text file under DIR
cut into paragraphs.  Prints one line per mismatch and ends with
"N passed, M failed" (exit 1 if any failed).
"""
import argparse
import os
import random
import struct
import subprocess
import sys
import tempfile
import zlib

EOT = "<|endoftext|>"
PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def read_tokfile(path):
    """Parses and validates a tidal token file (format: docs/data.md)."""
    data = open(path, "rb").read()
    if len(data) < 64 or data[:8] != b"TDTOKENS":
        raise ValueError(f"{path}: not a tidal token file")
    version, hbytes, width, kind, vocab, eot, count, crc = struct.unpack_from("<IIIIIIQI", data, 8)
    if version != 1 or hbytes != 64:
        raise ValueError(f"{path}: version {version}, header {hbytes}")
    if struct.unpack_from("<I", data, 60)[0] != zlib.crc32(data[:60]):
        raise ValueError(f"{path}: header checksum mismatch")
    payload = data[64:]
    if len(payload) != count * width or zlib.crc32(payload) != crc:
        raise ValueError(f"{path}: payload size or checksum mismatch")
    fmt = "<%d%s" % (count, "H" if width == 2 else "I")
    return list(struct.unpack(fmt, payload)), eot, vocab


class RegexBPE:
    """OpenAI's encoder.py (the algorithm GPT2Tokenizer ports), plus the
    special-token split that GPT2TokenizerFast does for <|endoftext|>."""

    def __init__(self, vocab_path, merges_path):
        import json
        import regex
        self.pat = regex.compile(PATTERN)
        self.encoder = json.load(open(vocab_path, encoding="utf-8"))
        lines = open(merges_path, encoding="utf-8").read().split("\n")
        merges = [tuple(l.split(" ")) for l in lines if l and not l.startswith("#version")]
        self.ranks = {m: i for i, m in enumerate(merges)}
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
            list(range(ord("®"), ord("ÿ") + 1))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        self.byte_encoder = dict(zip(bs, map(chr, cs)))
        self.cache = {}

    def bpe(self, token):
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            first, second = best
            new, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    new.append(first + second)
                    i += 2
                else:
                    new.append(word[i])
                    i += 1
            word = tuple(new)
        self.cache[token] = word
        return word

    def encode(self, text):
        out = []
        for k, seg in enumerate(text.split(EOT)):
            if k:
                out.append(self.encoder[EOT])
            for piece in self.pat.findall(seg):
                mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
                out.extend(self.encoder[t] for t in self.bpe(mapped))
        return out


class HFBPE:
    def __init__(self, vocab_path, merges_path):
        # from_pretrained on a folder holding vocab.json + merges.txt: the
        # loading path every transformers version supports (newer ones build
        # an empty model from the vocab_file= keyword).
        import shutil, tempfile
        from transformers import GPT2TokenizerFast
        self.dir = tempfile.mkdtemp(prefix="td_bpe_")
        shutil.copy(vocab_path, f"{self.dir}/vocab.json")
        shutil.copy(merges_path, f"{self.dir}/merges.txt")
        self.tok = GPT2TokenizerFast.from_pretrained(self.dir)
        if not self.tok.encode("Hello world"):
            raise SystemExit("transformers built an empty GPT-2 tokenizer from " + self.dir)

    def encode(self, text):
        return self.tok.encode(text)


def builtin_samples():
    return [
        "Hello world", "Hello, world! How's it going?", " leading space", "trailing space ",
        "  two leading", "tabs\tand\ttabs", "line\nbreaks\n\nand\r\nCRLF\r\n", "   ", "\n\n\n",
        "it's they're we've I'm you'll he'd don't", "'S 'T 'RE upper contractions", "''s '''t x's",
        "numbers 1,000,000.50 and 2024-01-01 and ½ ⅓ ² ٣٤٥", "mixed123abc 123abc abc123",
        "Ünïcödé wörds ñ ç ß", "Привет мир", "你好，世界。这是测试", "こんにちは 世界", "안녕하세요",
        "emoji 😀🎉 and 👨‍👩‍👧 family", "a\u00a0non-breaking\u2003em space\u3000ideographic",
        "zero\u200bwidth", "combining e\u0301 a\u0308", "math ∑ ∫ √ ≤ ≥", "symbols $%^&*()_+-=[]{}|;:,.<>/?~`",
        "code: def f(x):\n    return x ** 2  # square\n", "URL https://example.com/a?b=c&d=e#f",
        "end" + EOT + "start", EOT, "a " + EOT + " b", "<|endoftext", "<|endoftext|", "x<|endoftext|>y<|endoftext|>z",
        "repeated aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa letters", "1234567890123456789012345678901234567890",
        "!!!!!!!!!!!!!!!!????????", " " * 40 + "spaces", "\t\t\tx", " \n x", "\n y", "x \n", "\u0085next line",
        "\u2028line sep\u2029para sep", "\x0b\x0cvt ff", "\x1c\x1d\x1e\x1f unit seps",
    ]


def random_samples(n, seed=1234):
    rng = random.Random(seed)
    pool = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") + \
        list(" \t\n\r'\".,;:!?-_()[]{}<>|/\\@#$%^&*+=~`") + \
        ["'s", "'t", "'re", "'ll", "  ", "\n\n", "é", "ß", "Ж", "中", "😀", "٣", "½", "\u00a0", "\u3000", "\u0301"]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 80))) for _ in range(n)]


def corpus_samples(root):
    out = []
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            try:
                raw = open(path, "rb").read()
                if b"\0" in raw:
                    continue
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            out.extend(p for p in text.split("\n%\n") if p)
    return out


def run_tidal(tidal, vocab, merges, samples, workdir):
    folder = os.path.join(workdir, "docs")
    os.makedirs(folder)
    for i, s in enumerate(samples):
        with open(os.path.join(folder, "%07d.txt" % i), "wb") as f:
            f.write(s.encode("utf-8"))
    out = os.path.join(workdir, "out.tok")
    subprocess.run([tidal, "prepare", "--input", folder, "--out", out, "--tokenizer", "gpt2",
                    "--vocab", vocab, "--merges", merges, "--quiet"], check=True)
    return read_tokfile(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--merges", required=True)
    ap.add_argument("--tidal", default="build/tidal")
    ap.add_argument("--reference", choices=["hf", "regex"], default="hf")
    ap.add_argument("--corpus", help="folder of text files to add as samples (e.g. /usr/share/games/fortunes)")
    ap.add_argument("--random", type=int, default=2000, help="random samples (default 2000)")
    args = ap.parse_args()

    ref = HFBPE(args.vocab, args.merges) if args.reference == "hf" else RegexBPE(args.vocab, args.merges)
    samples = builtin_samples() + random_samples(args.random)
    if args.corpus:
        samples += corpus_samples(args.corpus)
    # A folder skips empty files and files with NUL bytes: keep samples tidal will read.
    samples = [s for s in samples if s and "\0" not in s]

    with tempfile.TemporaryDirectory() as tmp:
        ids, eot, _ = run_tidal(args.tidal, args.vocab, args.merges, samples, tmp)
    expected = []
    for i, s in enumerate(samples):
        if i:
            expected.append(eot)
        expected.extend(ref.encode(s))

    passed = failed = 0
    if ids == expected:
        passed = len(samples)
    else:
        # Locate the differing samples: re-encode each one on its own.
        for s in samples:
            with tempfile.TemporaryDirectory() as tmp:
                got, _, _ = run_tidal(args.tidal, args.vocab, args.merges, [s], tmp)
            want = ref.encode(s)
            if got == want:
                passed += 1
            else:
                failed += 1
                if failed <= 20:
                    print(f"MISMATCH {s!r}\n  tidal:     {got}\n  reference: {want}")
    print(f"reference {args.reference}: {len(samples)} samples, {len(ids)} tokens")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
