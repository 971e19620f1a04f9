#!/usr/bin/env python3
"""Writes the pre-tokenizer fixtures of tests/test_tokenizer_json.c:

    python3 tests/data/tok/gen_json_fixtures.py

  pretok_llama3.jsonl, pretok_qwen2.jsonl
      {"text", "pieces"}: the Llama 3 and Qwen2 Split patterns' matches by
      the `regex` module (Oniguruma runs them in the `tokenizers` library;
      both are backtracking engines with the same leftmost-first
      alternation), on edge cases and random strings.
  nfc_cases.jsonl
      {"text", "nfc"}: Python's unicodedata NFC (Unicode 14, as tidal's
      tables) of strings of combining marks in every order, Hangul jamo and
      syllables, singletons, composition exclusions and precomposed letters.
"""
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(HERE, "..", "..", "gpu"))
from check_bpe_vs_hf import builtin_samples, random_samples  # noqa: E402

LLAMA3 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")

EXTRA = [
    "'S 'T 'Re 'rE 'VE 'M 'LL 'D", "\u017f 'ſ x'ſt", "x'stop 'hello '123", "\"quoted\" (paren) [x]y",
    "a.\nb", "a.\n\nb", "a,\r\n\r\nb", "end.\n", "!!!\n\n\n", "  \n\n  x", " \n", "\n\n  \n y",
    "\t\tx", "\tx", "\u00a0x", "\u3000x", "x \u00a0 y", "12345678", "1 22 333 4444 55555", "x12y",
    " 123", "a 1b", "٣٤٥٦", "²³¹", "...\n...", "- item\n- item\n", "def f():\n\treturn 1\n",
    "http://x.y/z?q=1\n", "\r\r\n\n\r", "a\r\nb", "\u2028x\u2029y\u0085z", "😀\n😀 😀", "中文，标点。\n下一行",
    "'", "''", "' s", "'\n", "x'", "'ll've're", "ΣΑΣ 'Σ", "\u00b5m \u00aa\u00ba",
]


def write(name, pattern):
    import regex
    pat = regex.compile(pattern)
    samples = builtin_samples() + EXTRA + random_samples(400, seed=2024)
    with open(os.path.join(HERE, name), "w", encoding="utf-8") as f:
        for text in samples:
            pieces = pat.findall(text)
            assert "".join(pieces) == text, text
            f.write(json.dumps({"text": text, "pieces": pieces}, ensure_ascii=False) + "\n")


NFC_POOL = ["a", "e", "o", "u", "A", "E", "\u03b1", "\u03b9", "\u03c9", "s", " ", "x", "\u0300", "\u0301", "\u0308",
            "\u0323", "\u0302", "\u0327", "\u0345", "\u0313", "\u0304", "\u031b", "\u05b0", "\u0e48",
            "\u1100", "\u1161", "\u11a8", "\u1112", "\u1175", "\u11c2", "\uac00", "\ud7a3", "\uac01",
            "\u212b", "\u2126", "\u0340", "\u0374", "\u0958", "\u2adc", "\u0915", "\u093c", "\u00e9",
            "\u01d6", "\u1e69", "\uf900", "\u0b47", "\u0b3e", "\u0dd9", "\u0dcf", "\u0ddf", "\u1025",
            "\u102e", "\U0001d15e", "\U0001d165", "\u3099", "\u304b", "\u00c5", "\u0041\u030a"]


def write_nfc(name):
    import unicodedata
    rng = random.Random(15)
    samples = ["", "plain ASCII", "e\u0301", "a\u0323\u0302", "a\u0302\u0323", "\u1100\u1161\u11a8",
               "\uac00\u11a8", "\u212b\u2126", "\u0958", "\u0915\u093c", "\u0301 leading mark",
               "\u0b47\u0b3e", "\u304b\u3099"]
    samples += ["".join(rng.choice(NFC_POOL) for _ in range(rng.randint(1, 12))) for _ in range(600)]
    with open(os.path.join(HERE, name), "w", encoding="utf-8") as f:
        for text in samples:
            f.write(json.dumps({"text": text, "nfc": unicodedata.normalize("NFC", text)}, ensure_ascii=False) + "\n")


def main():
    write("pretok_llama3.jsonl", LLAMA3)
    write("pretok_qwen2.jsonl", QWEN2)
    write_nfc("nfc_cases.jsonl")


if __name__ == "__main__":
    main()
