#!/bin/bash
# A real-text corpus from what a machine has, for runs that need more
# distinct text than the fortunes (issue 10's quality check at W1's shape:
# 2000 steps x 16k tokens = 33M tokens in one pass).  Gathers source and
# documentation files (.py .md .rst .txt .c .h) under the given folders, in
# sorted path order (the same corpus on the same machine), whole files, up
# to BYTES, into OUTDIR/corpus.txt, then tokenizes it with `tidal prepare`
# (byte tokens unless TOKENIZER is given) into OUTDIR/corpus.tok.
# TOKENIZER=bpe trains a GPT-2-style byte-level BPE of 50257 tokens on the
# first 64 MiB of the text (bench/train_bpe.py, Python's `tokenizers`) into
# OUTDIR/tokenizer.json and tokenizes with it: issue 10's check at W1's
# real vocabulary.  Any other TOKENIZER is passed to `tidal prepare`.
#   bench/text_corpus.sh OUTDIR BYTES [DIR...]
# Default folders: Python's standard library, every site-packages folder
# Python knows (on the GPU machines: torch, transformers, ...), /usr/share/doc.
set -euo pipefail
out=${1:?usage: bench/text_corpus.sh OUTDIR BYTES [DIR...]}
want=${2:?usage: bench/text_corpus.sh OUTDIR BYTES [DIR...]}
shift 2
tidal=${TIDAL:-build/tidal}
dirs=("$@")
# The Pythons there are: the PATH's, and the GPU machines' torch venv.
pythons() { for p in python3 /opt/torch/.venv/bin/python3; do command -v "$p" 2>/dev/null || true; done; }
if [ ${#dirs[@]} -eq 0 ]; then
  for py in $(pythons); do
    while IFS= read -r d; do dirs+=("$d"); done < <("$py" -c \
      'import site, sysconfig; print(sysconfig.get_paths()["stdlib"]); [print(p) for p in site.getsitepackages()]' 2>/dev/null)
  done
  dirs+=(/usr/share/doc)
fi
mkdir -p "$out"
: > "$out/corpus.txt"
have=0
while IFS= read -r -d '' f; do
  [ "$have" -ge "$want" ] && break
  cat "$f" >> "$out/corpus.txt"
  printf '\n<|endoftext|>\n' >> "$out/corpus.txt"
  have=$(stat -c %s "$out/corpus.txt")
done < <(for d in "${dirs[@]}"; do [ -d "$d" ] && find -L "$d" -type f \( -name '*.py' -o -name '*.md' -o \
           -name '*.rst' -o -name '*.txt' -o -name '*.c' -o -name '*.h' \) -size -4M -print0 2>/dev/null; done |
         sort -zu)
echo "bench/text_corpus.sh: $have bytes of text from ${dirs[*]}" >&2
[ "$have" -ge "$want" ] || echo "bench/text_corpus.sh: only $have of the $want bytes asked for were found" >&2
tokenizer=${TOKENIZER:-}
if [ "$tokenizer" = bpe ]; then
  py=
  for p in $(pythons); do
    "$p" -c 'import tokenizers' >/dev/null 2>&1 && { py=$p; break; }
  done
  [ -n "$py" ] || { echo "bench/text_corpus.sh: TOKENIZER=bpe needs Python's tokenizers package" >&2; exit 1; }
  "$py" "$(dirname "$0")/train_bpe.py" "$out/corpus.txt" "$out/tokenizer.json" --sample-mb 64
  tokenizer=$out/tokenizer.json
fi
"$tidal" prepare --input "$out/corpus.txt" --out "$out/corpus.tok" --quiet ${tokenizer:+--tokenizer "$tokenizer"}
ls -l "$out/corpus.tok" >&2
