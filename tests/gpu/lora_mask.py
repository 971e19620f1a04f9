#!/usr/bin/env python3
"""tidal's LoRA dropout mask in plain Python (no numpy or torch needed).

The same counter-based hash as model/lora_mask.h (include/tidal/model.h,
td_model_lora_drop): element (row, column) of the input of a LoRA module is
dropped when

    mix(z)    = splitmix64's finalizer (mod 2^64)
    eat(h, v) = mix(h + 0x9e3779b97f4a7c15 (v + 1))
    h = eat(eat(eat(eat(eat(eat(seed, step), layer), module), sample), position), column)
    (h >> 40) < P 2^24                              (P rounded to fp32)

and a kept one is scaled by 1 / (1 - P) in fp32.  `step` is the optimizer
step being made (1 for the first), `sample` the sequence's index in the
step's global batch, `position` the token's place in the sequence, `module`
the module's place among the block's linear modules (LLaMA, Qwen2: q k v o
gate up down = 0..6; GPT-2: attn.c_attn attn.c_proj mlp.c_fc mlp.c_proj =
0..3).

check_lora_peft.py imports it for peft's oracle; tests/test_lora_dropout.c
runs it as a program and compares what it prints with tidal's own hash:

    lora_mask.py hash SEED STEP LAYER MODULE SAMPLE POSITION COLUMN
        prints h (decimal)
    lora_mask.py mask SEED STEP LAYER MODULE SAMPLE0 T ROWS COLS P
        prints ROWS lines of COLS characters, 1 kept, 0 dropped
        (row r: sample SAMPLE0 + r // T, position r % T)
"""
import struct
import sys

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def mix(z):
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def eat(h, v):
    return mix(h + GOLDEN * ((v + 1) & M64))


def f32(x):
    """x rounded to the nearest fp32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def call_key(seed, step, layer, module):
    return eat(eat(eat(seed & M64, step), layer), module)


def row_key(call, sample, position):
    return eat(eat(call, sample), position)


def hash_of(seed, step, layer, module, sample, position, column):
    return eat(row_key(call_key(seed, step, layer, module), sample, position), column)


def threshold(p):
    return f32(p) * 16777216.0  # exact: a power-of-two multiple of an fp32


def keep_scale(p):
    """1 / (1 - P) as fp32 computes it (double then one rounding is the same for / and -)."""
    p = f32(p)
    return f32(1.0 / f32(1.0 - p))


def kept_row(call, sample, position, cols, p):
    """[True, False, ...]: which of the row's columns are kept."""
    row = row_key(call, sample, position)
    thr = threshold(p)
    return [(eat(row, c) >> 40) >= thr for c in range(cols)]


def main(argv):
    if len(argv) == 8 and argv[0] == "hash":
        print(hash_of(*[int(a) for a in argv[1:]]))
        return 0
    if len(argv) == 10 and argv[0] == "mask":
        seed, step, layer, module, sample0, T, rows, cols = [int(a) for a in argv[1:9]]
        p = float(argv[9])
        call = call_key(seed, step, layer, module)
        for r in range(rows):
            print("".join("1" if k else "0" for k in kept_row(call, sample0 + r // T, r % T, cols, p)))
        return 0
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
