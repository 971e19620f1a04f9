#!/usr/bin/env python3
"""A soak: one long `tidal train` run, then the per-step figures of its JSON
log checked for growth after the warm-up.  Device peak (the arena), pinned
host bytes (pinned and pageable) must stay exactly flat from step --warmup to
the end, the heap (jemalloc's allocated bytes) within 1 MiB of its value there
(its thread caches move a little), and every logged loss must be finite.

  python3 tests/gpu/soak.py [--steps 2000] [--tidal build/tidal] [-- extra train flags]

Default shape: W6 (GPT-2 1.5B, 8 GiB budget, B16 x T1024, bf16), on random
tokens.  Prints the figures and PASS/FAIL; exits 1 on growth.  A run that
finished is recorded in bench/results/soak-W6.json (bench/results.py: each
figure's growth after the warm-up as a share of its value there, the share of
finite losses, the median tokens/s; the machine, the commit and the command),
or in --results DIR; --no-results records nothing."""
import argparse, json, math, os, subprocess, sys, tempfile, time

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=2000)
ap.add_argument("--warmup", type=int, default=3)
ap.add_argument("--tidal", default="build/tidal")
ap.add_argument("--shape", default="--model gpt2-1.5b --vocab 50304 --seq 1024 --micro-batch 16 "
                "--gpu-budget 8GiB --backend cuda --precision bf16")
ap.add_argument("--results", default="", help="folder for soak-W6.json (default bench/results)")
ap.add_argument("--no-results", action="store_true", help="record nothing")
ap.add_argument("extra", nargs="*")
a = ap.parse_args()

work = tempfile.mkdtemp(prefix="tidal-soak-")
tok = os.path.join(work, "random.tok")
# Random tokens, as the benchmarks train on (bench/workloads.py's writer; the
# loader wraps around them).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from workloads import write_token_file
import results as res
write_token_file(tok, 4_000_000, 1)
log = os.path.join(work, "soak.jsonl")
cmd = [a.tidal, "train", "--data", tok, *a.shape.split(), "--steps", str(a.steps), "--lr", "1e-4",
       "--log", log, "--log-every", "100", *a.extra]
print("soak:", " ".join(cmd), flush=True)
t0 = time.time()
rc = subprocess.run(cmd).returncode
rows = [json.loads(l) for l in open(log)] if os.path.exists(log) else []
print(f"soak: exit {rc}, {len(rows)} steps in {time.time() - t0:.0f} s")
if rc != 0 or len(rows) < a.steps:
    print("FAIL the run did not finish")
    sys.exit(1)
# The log's figures: the arena's peak, and the host object's pinned and
# pageable bytes and the heap (jemalloc's allocated bytes where linked).
keys = ["device_peak_bytes", "host.pinned_bytes", "host.pageable_bytes", "host.heap_allocated_bytes"]


def field(r, k):
    for part in k.split("."):
        r = r[part]
    return r


ok = True
after = [r for r in rows if r["step"] >= a.warmup]
figs, flat = [], {}
for k in keys:
    vals = [field(r, k) for r in after]
    lo, hi = min(vals), max(vals)
    first = vals[0]
    slack = (1 << 20) if "heap" in k else 0
    grew = hi - first > slack
    ok &= not grew
    flat[k] = {"at_warmup": first, "min": lo, "max": hi, "end": vals[-1], "allowed_growth": slack, "grew": grew}
    figs.append(res.figure(f"{k} growth after step {a.warmup}", 100.0 * (hi - first) / first if first else 0.0, "%"))
    print(f"{'FAIL' if grew else 'ok  '} {k:18s} step {a.warmup}: {first}  min {lo}  max {hi}  end {vals[-1]}")
bad = [r["step"] for r in rows if not math.isfinite(r["loss"])]
if bad:
    ok = False
    print(f"FAIL loss not finite (NaN or infinite) at step(s) {bad[:10]}")
tps = sorted(r["tokens_per_s"] for r in after)
print(f"tokens/s median {tps[len(tps) // 2]:.0f}; loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
print("PASS: flat after warm-up" if ok else "FAIL: grew after warm-up")
if not a.no_results:
    figs.append(res.figure("steps with a finite loss", 100.0 * (len(rows) - len(bad)) / len(rows), "%"))
    figs.append(res.figure("tokens/s, median step after the warm-up", tps[len(tps) // 2], "tok/s"))
    details = {"pass": ok, "steps": len(rows), "warmup": a.warmup, "seconds": round(time.time() - t0, 1),
               "train_command": " ".join(cmd), "figures": flat,
               "nonfinite_steps": bad[:100], "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}
    path = res.write_result("soak-W6", f"{a.steps} steps at W6's shape: device peak, pinned, pageable and "
                            "heap bytes after the warm-up, and every loss finite", figs, details,
                            out_dir=a.results or None)
    print(f"soak: recorded {path}")
sys.exit(0 if ok else 1)
