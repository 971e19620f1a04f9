#!/usr/bin/env python3
"""The rotary families on two GPUs against one, and the fp16 loop end to end.

For LLaMA and Qwen2 (small shapes of their presets: their blocks, grouped-query
attention and Qwen2's qkv biases), `tidal train` on one GPU and on two
(--nproc 2, ZeRO-3, half the micro-batch each: the same global batch) from
the same seed: the worst relative difference of the per-step losses (fp32,
clipping on: within 1e-4, the sums' order is all that differs) and each
run's tokens/s.  Then the fp16 loop: the same LLaMA shape in fp16 (dynamic
loss scale) beside bf16, both from the same seed: every loss finite, the
steps the scaler skipped, and fp16's last loss against bf16's.

Writes bench/results/families-ranks.json through bench/results.py (--results
DIR for another folder, --no-results for none).  Exits 1 when a run fails or
a check misses.

Usage (GPU machine with 2 GPUs, repository root, after `make`):
    python3 bench/families_ranks.py
    python3 bench/families_ranks.py --backend cpu --no-fp16 --no-results   # the plumbing, no GPU
"""
import argparse
import math
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results as res  # noqa: E402
import workloads as wl  # noqa: E402

FAMILIES = [
    ("LLaMA", ["--model", "tiny-llama"]),
    ("Qwen2", ["--model", "qwen2.5-0.5b", "--layers", "4"]),
]


def train(a, tag, flags):
    log = os.path.join(a.workdir, f"{tag}.jsonl")
    out = os.path.join(a.workdir, f"{tag}.out")
    if os.path.exists(log):
        os.remove(log)
    cmd = [a.tidal, "train", "--data", a.data, "--backend", a.backend, "--seq", str(a.seq), "--steps", str(a.steps),
           "--seed", "1337", "--lr", "1e-3", "--log", log] + flags
    rc, _, secs = wl.run_logged(cmd, out, a.run_timeout)
    rows = wl.read_jsonl(log)
    r = {"command": " ".join(shlex.quote(c) for c in cmd), "exit": rc, "seconds": secs,
         "losses": [x.get("loss") for x in rows], "skipped": sum(1 for x in rows if x.get("skipped")),
         "tokens_per_s": sorted(x.get("tokens_per_s", 0) for x in rows[1:])[len(rows[1:]) // 2] if len(rows) > 1
         else None}
    if rc != 0 or len(rows) < a.steps:
        r["error"] = f"exit {rc}, {len(rows)} of {a.steps} steps logged: {wl.tail(out, 2) or 'no output'}"
    return r


def worst_rel(x, y):
    return max(abs(p - q) / max(abs(p), 1e-30) for p, q in zip(x, y))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tidal", default="build/tidal")
    ap.add_argument("--backend", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="global batch in sequences (default 8; even)")
    ap.add_argument("--tolerance", type=float, default=1e-4, help="relative, fp32 losses (default 1e-4)")
    ap.add_argument("--fp16-steps", type=int, default=60)
    ap.add_argument("--no-fp16", action="store_true", help="leave out the fp16 loop (the cpu backend has none)")
    ap.add_argument("--workdir", default="out/bench-families-ranks")
    ap.add_argument("--results", metavar="DIR", help="write the results file here (default bench/results/)")
    ap.add_argument("--no-results", action="store_true")
    ap.add_argument("--run-timeout", type=int, default=300)
    a = ap.parse_args(argv)
    if a.batch < 2 or a.batch % 2:
        ap.error(f"--batch {a.batch}: give an even count of sequences, split over 2 ranks")
    os.makedirs(a.workdir, exist_ok=True)
    a.data = os.path.join(a.workdir, "random.tok")
    wl.write_token_file(a.data, max(a.batch * a.seq * max(a.steps, a.fp16_steps) + 1, 1 << 20), seed=1337)
    prec = ["--precision", "fp32", "--clip-grad-norm", "1.0"]
    figs, rows, ok = [], [], True
    dev = "GPUs" if a.backend == "cuda" else "ranks"
    for name, model in FAMILIES:
        one = train(a, f"{name}-1", model + prec + ["--micro-batch", str(a.batch)])
        two = train(a, f"{name}-2", model + prec + ["--micro-batch", str(a.batch // 2), "--nproc", "2"])
        row = {"family": name, "one": one, "two": two}
        if one.get("error") or two.get("error"):
            ok = False
            row["error"] = one.get("error") or two.get("error")
            wl.say(f"{name}: {row['error']}")
        else:
            row["worst_relative_loss_difference"] = worst_rel(one["losses"], two["losses"])
            row["met"] = row["worst_relative_loss_difference"] <= a.tolerance
            ok &= row["met"]
            wl.say(f"{name}: 2 {dev} against 1, fp32, {a.steps} steps: worst relative loss difference "
                   f"{row['worst_relative_loss_difference']:.3g} (at most {a.tolerance:g}: "
                   f"{'yes' if row['met'] else 'NO'}); loss {one['losses'][0]:.4f} -> {one['losses'][-1]:.4f}; "
                   f"{one['tokens_per_s']:.0f} tok/s on 1, {two['tokens_per_s']:.0f} on 2")
            figs.append(res.figure(f"{name}, 2 GPUs against 1: worst relative loss difference over {a.steps} steps",
                                   100 * row["worst_relative_loss_difference"], "%"))
            figs.append(res.figure(f"{name} on 2 GPUs tokens/s", two["tokens_per_s"], "tok/s"))
            figs.append(res.figure(f"{name} on 1 GPU tokens/s", one["tokens_per_s"], "tok/s"))
        rows.append(row)
    doc = {"steps": a.steps, "seq": a.seq, "batch": a.batch, "tolerance": a.tolerance, "families": rows,
           "machine": wl.machine_info()}
    if not a.no_fp16:
        model = FAMILIES[0][1] + ["--micro-batch", str(a.batch), "--clip-grad-norm", "1.0"]
        saved, a.steps = a.steps, a.fp16_steps
        fp16 = train(a, "fp16", model + ["--precision", "fp16"])
        bf16 = train(a, "bf16", model + ["--precision", "bf16"])
        a.steps = saved
        f = {"fp16": fp16, "bf16": bf16}
        if fp16.get("error") or bf16.get("error"):
            ok = False
            f["error"] = fp16.get("error") or bf16.get("error")
            wl.say(f"fp16: {f['error']}")
        else:
            # random tokens: nothing to learn, so fp16 is held to bf16's path, not to a falling loss
            finite = all(x is not None and math.isfinite(x) for x in fp16["losses"])
            f["last_over_bf16"] = fp16["losses"][-1] / bf16["losses"][-1]
            f["met"] = finite and abs(f["last_over_bf16"] - 1) <= 0.02
            ok &= f["met"]
            wl.say(f"fp16, {a.fp16_steps} steps: every loss finite: {'yes' if finite else 'NO'}; loss "
                   f"{fp16['losses'][0]:.4f} -> {fp16['losses'][-1]:.4f} (bf16: -> {bf16['losses'][-1]:.4f}, "
                   f"{100 * (f['last_over_bf16'] - 1):+.2f}%, at most 2% apart: {'yes' if f['met'] else 'NO'}); "
                   f"{fp16['skipped']} steps skipped by the loss scale; {fp16['tokens_per_s']:.0f} tok/s "
                   f"(bf16 {bf16['tokens_per_s']:.0f})")
            figs.append(res.figure("fp16's last loss against bf16's", f["last_over_bf16"], "x"))
            figs.append(res.figure("fp16 tokens/s", fp16["tokens_per_s"], "tok/s"))
        doc["fp16"] = f
    if not a.no_results:
        res.write_result("families-ranks", "LLaMA and Qwen2 on 2 GPUs against 1 (fp32, the same global batch), and "
                         "the fp16 loop beside bf16", figs, details=doc, out_dir=a.results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
