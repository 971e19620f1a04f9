#!/usr/bin/env python3
"""Checks tidal's tokenizer.json reader token for token against the
`tokenizers` library.

    python3 tests/gpu/check_tokenizer_json.py build/tidal [--mb 4] [--keep DIR]

Needs `tokenizers` (the GPU machine has it) and no network: the tokenizers
are trained here, on generated text, the way the real ones are built:

  gpt2    ByteLevel pre-tokenizer (GPT-2's regex), <|endoftext|>
  llama3  Split(Llama 3 pattern) + ByteLevel, ignore_merges (and whole words
          added to the vocabulary that no merge makes, as in tiktoken-made
          files), <|begin_of_text|> put first by a TemplateProcessing,
          <|end_of_text|>, reserved specials
  qwen2   Split(Qwen2 pattern: single digits) + ByteLevel, an NFC normalizer,
          <|endoftext|>, <|im_start|>, <|im_end|>
  smollm2 Digits(individual_digits) + ByteLevel (GPT-2's regex), <|endoftext|>,
          <|im_start|>, <|im_end|>

each with further added tokens (a normalized one with a space inside, one
with lstrip, one with rstrip, a single_word one), saved to tokenizer.json
and also rewritten with the merges in the other format ("a b" strings vs
["a", "b"] pairs).  For every file, `tidal prepare --tokenizer FILE` runs on
  - one large mixed text (several MB: many scripts, code, numbers, emoji,
    whitespace runs, contractions, the added tokens' literals), once with
    the default block and once with 64 KiB blocks (streamed cuts), each a
    check that the token file equals [bos] + encode(text,
    add_special_tokens=False) and that its header names the eos id;
  - a folder of short samples (edge cases and random strings), one document
    each: a check per document (bos before each, eos between).
Prints tidal's and tokenizers' encoding speed, the mismatches (at most 20),
and ends with "N passed, M failed" (exit 1 if any failed).
"""
import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_bpe_vs_hf import builtin_samples, random_samples, read_tokfile  # noqa: E402

LLAMA3 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")

# Added tokens beyond each family's specials (content, options).
EXTRA_ADDED = [("<ws> <ws>", {"normalized": True}), ("<mask>", {"lstrip": True, "special": True}),
               ("[R]", {"rstrip": True, "special": True}), ("wordy", {"single_word": True})]

FAMILIES = {
    "gpt2": {"pattern": None, "specials": ["<|endoftext|>"], "bos": None, "eos": "<|endoftext|>",
             "vocab": 8000},
    "llama3": {"pattern": LLAMA3, "specials": ["<|begin_of_text|>", "<|end_of_text|>",
                                               "<|reserved_special_token_0|>", "<|eot_id|>"],
               "bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "vocab": 24000, "ignore_merges": True},
    "qwen2": {"pattern": QWEN2, "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "bos": None,
              "eos": "<|endoftext|>", "vocab": 16000, "nfc": True},
    "smollm2": {"pattern": None, "digits": True, "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                "bos": None, "eos": "<|endoftext|>", "vocab": 12000},
}

# ---- the text -------------------------------------------------------------------

WORDS = {
    "en": "the of and to in is was that for it with as his on be at by had are but from not this have which one "
          "you were her all she there would their we him been has when who will more no if out so said what up its "
          "about into than them can only other new some could time these two may then do first any my now such like "
          "our over man me even most made after also did many before must through back years where much your way "
          "well down should because each just those people Mr how too little state good very make world still own "
          "see men work long get here between both life being under never day same another know while last might "
          "us great old year off come since against go came right used take three".split(),
    "fr": "été façade naïve garçon cœur élève où déjà très après français château forêt hôpital".split(),
    "de": "Größe Straße über Mädchen schön Übung Fußball Äpfel Öl müssen".split(),
    "ru": "Привет мир это тест русский язык программирование Москва свобода".split(),
    "el": "Καλημέρα κόσμε Ελλάδα φιλοσοφία ΣΟΦΙΑ".split(),
    "ar": "مرحبا بالعالم اللغة العربية كتاب".split(),
    "hi": "नमस्ते दुनिया भाषा हिन्दी".split(),
}
CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; i++) {\n\tsum += a[i];\n}\n",
    "if (x == 3) { return y; }\n",
    "const obj = {\"key\": [1, 2, 3], 'v': null};\n",
    "    \n\t\t    \n",
    "SELECT * FROM users WHERE id = 42;\r\n",
    "#include <stdio.h>\n\nint main(void) {\n    printf(\"%d\\n\", 42);\n}\n",
]
EMOJI = ["😀", "🎉", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "✨", "🚀"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", "\u00a0", "\u3000", "\u2003", "   \n\n  "]
PUNCT = [".", ",", "!", "?", "...", "!!!\n", ".\n", ";", ":", "—", "–", "(", ")", "\"", "'", "«", "»", "“", "”"]
# Text that NFC changes: decomposed accents, marks out of order, jamo, singletons, exclusions.
NOT_NFC = ["e\u0301", "cafe\u0301", "a\u0323\u0302", "a\u0302\u0323", "\u1100\u1161\u11a8", "\u212b", "\u2126",
           "\u0958", "\u0915\u093c", "\u304b\u3099", "o\u0308\u0304", "\u0041\u030a", "\uf900"]
CONTRACTIONS = ["it's", "IT'S", "we'll", "WE'LL", "they're", "you've", "I'm", "he'd", "don't", "'s", "x'ſ",
                "O'Neil", "'''"]


def byte_level(text):
    """GPT-2's byte-to-unicode spelling of text (how vocab.json writes tokens)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, map(chr, cs)))
    return "".join(table[b] for b in text.encode("utf-8"))


def cjk(rng, n):
    return "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(n))


def kana(rng, n):
    return "".join(chr(rng.choice([rng.randint(0x3041, 0x3093), rng.randint(0x30A1, 0x30F3)])) for _ in range(n))


def hangul(rng, n):
    return "".join(chr(rng.randint(0xAC00, 0xD7A3)) for _ in range(n))


def number(rng):
    k = rng.randint(0, 5)
    if k == 0:
        return str(rng.randint(0, 10 ** rng.randint(1, 12)))
    if k == 1:
        return f"{rng.randint(0, 99999):,}"
    if k == 2:
        return f"{rng.random() * 1000:.{rng.randint(1, 6)}f}"
    if k == 3:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(10, 40)))
    if k == 4:
        return f"{rng.randint(1900, 2100)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    return rng.choice(["½", "²", "٣٤٥", "१२३", "Ⅻ"])


def piece(rng, literals):
    k = rng.random()
    if k < 0.40:
        w = rng.choice(WORDS["en"])
        return w.capitalize() if rng.random() < 0.1 else w.upper() if rng.random() < 0.02 else w
    if k < 0.50:
        return rng.choice(WORDS[rng.choice(["fr", "de", "ru", "el", "ar", "hi"])])
    if k < 0.56:
        return rng.choice([cjk, kana, hangul])(rng, rng.randint(1, 12))
    if k < 0.64:
        return number(rng)
    if k < 0.72:
        return rng.choice(PUNCT)
    if k < 0.76:
        return rng.choice(CONTRACTIONS)
    if k < 0.79:
        return rng.choice(EMOJI)
    if k < 0.82:
        return rng.choice(CODE)
    if k < 0.83:
        return rng.choice(literals)
    if k < 0.84:
        return rng.choice(NOT_NFC)
    return rng.choice(SPACES)


def mixed_text(rng, n_bytes, literals):
    out, size = [], 0
    while size < n_bytes:
        p = piece(rng, literals)
        sep = "" if rng.random() < 0.3 else " " if rng.random() < 0.8 else rng.choice(SPACES)
        out.append(p + sep)
        size += len(p.encode()) + len(sep.encode())
    return "".join(out)


# ---- tokenizers ------------------------------------------------------------------


def train(name, fam, text, out_dir):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, \
        trainers
    try:
        model = models.BPE(ignore_merges=bool(fam.get("ignore_merges")))
    except TypeError:
        model = models.BPE()
    tok = Tokenizer(model)
    if fam["pattern"]:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(fam["pattern"]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif fam.get("digits"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if fam.get("nfc"):
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=fam["vocab"], special_tokens=fam["specials"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i:i + 100000] for i in range(0, len(text), 100000)], trainer)
    tok.add_tokens([AddedToken(c, **opts) for c, opts in EXTRA_ADDED])
    if fam["bos"]:
        bos = tok.token_to_id(fam["bos"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fam['bos']} $A", pair=f"{fam['bos']} $A {fam['bos']} $B", special_tokens=[(fam["bos"], bos)])
    path = os.path.join(out_dir, name, "tokenizer.json")
    os.makedirs(os.path.dirname(path))
    tok.save(path)
    doc = json.load(open(path, encoding="utf-8"))
    if fam.get("ignore_merges"):
        doc["model"]["ignore_merges"] = True
        # Whole words no merge sequence makes: only ignore_merges finds them.
        vocab = doc["model"]["vocab"]
        nxt = max(list(vocab.values()) + [a["id"] for a in doc["added_tokens"]]) + 1
        for w in WORDS["en"][::3] + WORDS["fr"] + WORDS["ru"]:
            for form in (byte_level(w), byte_level(" " + w)):
                if form not in vocab:
                    vocab[form] = nxt
                    nxt += 1
        json.dump(doc, open(path, "w", encoding="utf-8"), ensure_ascii=False)
    # The same tokenizer with the merges in the other format.
    merges = doc["model"]["merges"]
    as_pairs = bool(merges) and isinstance(merges[0], list)
    doc["model"]["merges"] = [" ".join(m) for m in merges] if as_pairs else [m.split(" ") for m in merges]
    other = os.path.join(out_dir, name + "-other-merges", "tokenizer.json")
    os.makedirs(os.path.dirname(other))
    json.dump(doc, open(other, "w", encoding="utf-8"), ensure_ascii=False)
    return [(name + (" (pair merges)" if as_pairs else " (string merges)"), path),
            (name + (" (string merges)" if as_pairs else " (pair merges)"), other)]


def run_prepare(tidal, tokenizer, inp, out, block=None, quiet=True):
    cmd = [tidal, "prepare", "--input", inp, "--out", out, "--tokenizer", tokenizer]
    if block:
        cmd += ["--block", str(block)]
    if quiet:
        cmd.append("--quiet")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


class Tally:
    def __init__(self):
        self.passed = self.failed = 0

    def check(self, ok, what):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
            if self.failed <= 20:
                print("MISMATCH " + what)


def check_big(tidal, label, path, hf, fam, text, work, tally):
    from tokenizers import Tokenizer  # noqa: F401
    want = hf.encode(text, add_special_tokens=False).ids
    bos = hf.token_to_id(fam["bos"]) if fam["bos"] else None
    if bos is not None:
        want = [bos] + want
    eos = hf.token_to_id(fam["eos"])
    inp = os.path.join(work, "big.txt")
    with open(inp, "wb") as f:
        f.write(text.encode("utf-8"))
    for block in (None, 65536):
        out = os.path.join(work, "big.tok")
        summary = run_prepare(tidal, path, inp, out, block, quiet=False)
        got, got_eot, got_vocab = read_tokfile(out)
        ok = got == want and got_eot == eos and got_vocab >= hf.get_vocab_size(with_added_tokens=True)
        where = ""
        if not ok:
            i = first_diff(got, want)
            ctx = hf.decode(want[max(0, i - 5):i + 5], skip_special_tokens=False)
            where = (f": {len(got)} vs {len(want)} ids, first difference at {i}: tidal {got[i:i + 8]} "
                     f"tokenizers {want[i:i + 8]} near {ctx!r}; eot {got_eot} vs {eos}, vocab {got_vocab}")
        tally.check(ok, f"{label}: the {len(text) >> 20} MiB text, block {block or 'default'}{where}")
        m = re.search(r"\(([\d.]+) MiB/s\)", summary)
        if block is None and m:
            t0 = time.perf_counter()
            hf.encode(text, add_special_tokens=False)
            hf_s = time.perf_counter() - t0
            print(f"  {label}: tidal prepare {float(m.group(1)):.1f} MiB/s, tokenizers encode (one call) "
                  f"{len(text.encode()) / (1 << 20) / hf_s:.1f} MiB/s")


def check_samples(tidal, label, path, hf, fam, samples, work, tally):
    bos = hf.token_to_id(fam["bos"]) if fam["bos"] else None
    eos = hf.token_to_id(fam["eos"])

    def expect(docs):
        out = []
        for i, s in enumerate(docs):
            if i:
                out.append(eos)
            if bos is not None:
                out.append(bos)
            out.extend(hf.encode(s, add_special_tokens=False).ids)
        return out

    def tidal_ids(docs, tag):
        folder = os.path.join(work, "docs-" + tag)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        for i, s in enumerate(docs):
            with open(os.path.join(folder, "%07d.txt" % i), "wb") as f:
                f.write(s.encode("utf-8"))
        out = os.path.join(work, "docs-" + tag + ".tok")
        run_prepare(tidal, path, folder, out)
        return read_tokfile(out)[0]

    # In chunks, so a mismatch is found without one tidal run per sample.
    for c in range(0, len(samples), 200):
        chunk = samples[c:c + 200]
        if tidal_ids(chunk, "chunk") == expect(chunk):
            tally.passed += len(chunk)
            continue
        for s in chunk:
            got, want = tidal_ids([s], "one"), expect([s])
            tally.check(got == want, f"{label}: {s!r}\n  tidal:      {got}\n  tokenizers: {want}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tidal", help="the tidal binary (build/tidal)")
    ap.add_argument("--mb", type=float, default=4.0, help="size of the large mixed text in MiB (default 4)")
    ap.add_argument("--random", type=int, default=1500, help="random short samples (default 1500)")
    ap.add_argument("--keep", help="keep the tokenizers and texts in this folder")
    args = ap.parse_args()
    import tokenizers
    from tokenizers import Tokenizer
    print(f"tokenizers {tokenizers.__version__}")

    literals = sorted({s for f in FAMILIES.values() for s in f["specials"]} | {c for c, _ in EXTRA_ADDED} |
                      {"<|endoftext", "<|im_", "< ws>", "wordy!", "xwordy", " <mask> ", "[R]   x"})
    rng = random.Random(14)
    text = mixed_text(rng, int(args.mb * (1 << 20)), literals)
    train_text = mixed_text(random.Random(41), 2 << 20, literals)
    samples = builtin_samples() + random_samples(args.random, seed=7) + \
        [mixed_text(rng, rng.randint(1, 400), literals) for _ in range(args.random)]
    samples = [s for s in samples if s and "\0" not in s]

    work = args.keep or tempfile.mkdtemp(prefix="tidal_tokjson_")
    os.makedirs(work, exist_ok=True)
    tally = Tally()
    try:
        for name, fam in FAMILIES.items():
            for label, path in train(name, fam, train_text, work):
                hf = Tokenizer.from_file(path)
                print(f"{label}: {hf.get_vocab_size(with_added_tokens=True)} tokens, {path}")
                check_big(args.tidal, label, path, hf, fam, text, work, tally)
                check_samples(args.tidal, label, path, hf, fam, samples, work, tally)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{tally.passed} passed, {tally.failed} failed")
    return 1 if tally.failed else 0


if __name__ == "__main__":
    sys.exit(main())
