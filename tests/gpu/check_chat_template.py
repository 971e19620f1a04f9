#!/usr/bin/env python3
"""Checks `tidal prepare` on conversations token for token against
transformers' apply_chat_template(..., tokenize=True).

    python3 tests/gpu/check_chat_template.py build/tidal [--keep DIR]

Needs transformers and tokenizers and no network.  The tokenizers are
trained here as tests/gpu/check_tokenizer_json.py trains them (the GPT-2,
Llama 3, Qwen2 and SmolLM2 pre-tokenizers, their special tokens) and saved
as a folder with tokenizer.json and a tokenizer_config.json holding one of
the real chat templates of tests/data/chat/ and the family's bos / eos
tokens, loaded with AutoTokenizer.from_pretrained(folder):

  llama3.1, llama3.2   Llama 3 pre-tokenizer; <|begin_of_text|>, <|start_header_id|>,
                       <|end_header_id|>, <|eot_id|>, <|eom_id|>, <|python_tag|>
  qwen2.5              Qwen2 pre-tokenizer (NFC); <|im_start|>, <|im_end|>
  smollm2              SmolLM2's (digits apart); <|im_start|>, <|im_end|>
  mistral-v0.1, v0.3   GPT-2's byte level with <s>, </s>, [INST], [/INST],
  gemma2, gemma3       [AVAILABLE_TOOLS] ... / <bos>, <eos>, <start_of_turn>, <end_of_turn>
                       (the real Mistral and Gemma tokenizers are SentencePiece,
                       which tidal does not read; their templates are checked
                       here with a byte-level tokenizer holding their specials)

The conversations are those of tests/data/chat/gen_chat_fixtures.py (system
prompt or not, one to four turns, empty and unicode content, tools and tool
calls, content parts): every one its template accepts, over 200 in all.
For each template all of them go into one JSONL file, `tidal prepare
--loss-on all --no-pack --no-shuffle` writes each as its own rows, and each
document read back (its flags mark where it starts; padding dropped) must
equal apply_chat_template(messages, tools=tools, tokenize=True).  Both render
the date of today (Llama 3.2's strftime_now) in the same time zone.  Then
with --loss-on assistant the tokens counted in each document, decoded, must
hold every assistant message's text in order (normalized as the
tokenizer normalizes it: Qwen2's NFC).

Ends with "check_chat_template: N passed, M failed" (exit 1 if any failed).
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
import time
import zlib

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "data", "chat"))
import gen_chat_fixtures as fixtures  # noqa: E402
from check_tokenizer_json import LLAMA3, QWEN2, mixed_text  # noqa: E402

results = []


def check(ok, what):
    results.append(bool(ok))
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    return ok


LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"]
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MISTRAL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
GEMMA = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"]

# template -> (pre-tokenizer kind, specials, tokenizer_config's special tokens)
TEMPLATES = {
    "llama3.1.jinja": ("llama3", LLAMA_SPECIALS, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "llama3.2.jinja": ("llama3", LLAMA_SPECIALS, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen2.5.jinja": ("qwen2", CHATML, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "smollm2.jinja": ("smollm2", CHATML, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                          "unk_token": "<|endoftext|>"}),
    "mistral-v0.1.jinja": ("gpt2", MISTRAL, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "mistral-v0.3.jinja": ("gpt2", MISTRAL, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "gemma2.jinja": ("gpt2", GEMMA, {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}),
    "gemma3.jinja": ("gpt2", GEMMA, {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}),
}


def train_tokenizer(kind, specials, text, out_dir, template, special_map):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    if kind in ("llama3", "qwen2"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3 if kind == "llama3" else QWEN2), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif kind == "smollm2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=6000, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i:i + 100000] for i in range(0, len(text), 100000)], trainer)
    os.makedirs(out_dir)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = dict(special_map)
    config.update({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
                   "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False})
    json.dump(config, open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8"), ensure_ascii=False)


def read_documents(path):
    """The documents of a tidal token file of rows with flags (docs/data.md):
    (ids, counted) each, padding dropped."""
    data = open(path, "rb").read()
    version, hbytes, width, kind, vocab, eot, count, crc = struct.unpack_from("<IIIIIIQI", data, 8)
    rows, has_flags, flags_crc = struct.unpack_from("<III", data, 44)
    assert data[:8] == b"TDTOKENS" and version == 2 and has_flags == 1, "not a token file of rows with flags"
    assert struct.unpack_from("<I", data, 60)[0] == zlib.crc32(data[:60]), "header checksum"
    ids = struct.unpack_from("<%d%s" % (count, "H" if width == 2 else "I"), data, 64)
    flags = data[64 + count * width:]
    assert len(flags) == count and zlib.crc32(flags) == flags_crc, "flags"
    docs, cur = [], None
    for i in range(count):
        if flags[i] & 2:  # a document starts
            cur = None if flags[i] & 4 else ([], [])
            if cur is not None:
                docs.append(cur)
        if cur is not None:
            cur[0].append(ids[i])
            cur[1].append(bool(flags[i] & 1))
    return docs


def prepare(tidal, tok_dir, jsonl, out, loss_on):
    cmd = [tidal, "prepare", "--input", jsonl, "--out", out, "--tokenizer", tok_dir, "--loss-on", loss_on,
           "--no-pack", "--no-shuffle", "--seq", "4096", "--too-long", "split"]
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(int(time.time())))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return r.returncode, r.stdout + r.stderr


def conversations(family):
    """The contexts of the fixtures its template accepts (messages, tools only)."""
    env = fixtures.environment()
    template = env.from_string(open(os.path.join(fixtures.HERE, family), encoding="utf-8").read())
    rng = random.Random(20250115)
    out = []
    for ctx in fixtures.cases_for(family, rng):
        if set(ctx) - {"messages", "tools"}:
            continue
        variables = dict(fixtures.FAMILIES[family], tools=None, documents=None, add_generation_prompt=False)
        variables.update(ctx)
        try:
            template.render(**variables)
        except Exception:
            continue
        out.append(ctx)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tidal")
    ap.add_argument("--keep", help="keep the work folder here")
    a = ap.parse_args()
    from transformers import AutoTokenizer
    work = a.keep or tempfile.mkdtemp(prefix="check_chat_")
    os.makedirs(work, exist_ok=True)
    rng = random.Random(7)
    total = 0
    for family, (kind, specials, special_map) in TEMPLATES.items():
        tag = f"[{family}]"
        template = open(os.path.join(ROOT, "tests", "data", "chat", family), encoding="utf-8").read()
        tok_dir = os.path.join(work, family.replace(".jinja", ""))
        shutil.rmtree(tok_dir, ignore_errors=True)
        text = mixed_text(rng, 1 << 20, specials) + " ".join(fixtures.TEXTS) * 20
        train_tokenizer(kind, specials, text, tok_dir, template, special_map)
        hf = AutoTokenizer.from_pretrained(tok_dir)
        convs = conversations(family)
        jsonl = os.path.join(tok_dir, "conversations.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            for ctx in convs:
                f.write(json.dumps(ctx, ensure_ascii=False) + "\n")
        out = os.path.join(tok_dir, "all.tok")
        rc, said = prepare(a.tidal, tok_dir, jsonl, out, "all")
        if not check(rc == 0, f"{tag} tidal prepare --loss-on all {said.strip()[-300:]}"):
            continue
        docs = read_documents(out)
        check(len(docs) == len(convs), f"{tag} {len(docs)} documents for {len(convs)} conversations")
        bad = []
        for i, (ctx, (ids, _)) in enumerate(zip(convs, docs)):
            want = hf.apply_chat_template(ctx["messages"], tools=ctx.get("tools"), tokenize=True,
                                          add_generation_prompt=False)
            if hasattr(want, "keys"):  # transformers versions that return a dict by default
                want = want["input_ids"]
            if list(want) != ids:
                bad.append(i)
        total += len(convs)
        check(not bad, f"{tag} token ids equal apply_chat_template on {len(convs) - len(bad)} of {len(convs)} "
                       f"conversations" + (f" (first differing: {bad[0]}: {convs[bad[0]]})" if bad else ""))
        # --loss-on assistant: the counted tokens hold the assistant messages
        out = os.path.join(tok_dir, "assistant.tok")
        rc, said = prepare(a.tidal, tok_dir, jsonl, out, "assistant")
        if not check(rc == 0, f"{tag} tidal prepare --loss-on assistant {said.strip()[-300:]}"):
            continue
        # what prepare keeps: the conversations with an assistant message (even
        # an empty one counts its end-of-turn token)
        with_answers = [c for c in convs if any(m["role"] == "assistant" for m in c["messages"])]
        docs = read_documents(out)
        check(len(docs) == len(with_answers), f"{tag} {len(docs)} documents with something to learn for "
                                              f"{len(with_answers)} conversations with an assistant message")
        # the tokens hold the text as the tokenizer normalizes it (Qwen2's
        # NFC composes "e\u0301" into "\u00e9"): compare it so normalized
        norm = hf.backend_tokenizer.normalizer
        normalized = (lambda s: norm.normalize_str(s)) if norm is not None else (lambda s: s)
        missing = 0
        for ctx, (ids, counted) in zip(with_answers, docs):
            spoken = hf.decode([t for t, c in zip(ids, counted) if c])
            at = 0
            for m in ctx["messages"]:
                if m["role"] != "assistant" or not isinstance(m.get("content"), str) or not m["content"].strip():
                    continue
                k = spoken.find(normalized(m["content"]).strip(), at)
                if k < 0:
                    missing += 1
                    break
                at = k
        check(missing == 0, f"{tag} --loss-on assistant counts the assistant messages "
                            f"({len(with_answers) - missing} of {len(with_answers)} conversations)")
    check(total >= 200, f"{total} conversations in all (at least 200)")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    failed = results.count(False)
    print(f"check_chat_template: {len(results) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
