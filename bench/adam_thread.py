#!/usr/bin/env python3
"""The CPU AdamW on its own thread against the same run with it on the
driving thread, at one workload's shape (default W6: GPT-2 1.5B, 8 GiB,
B16 x T1024, bf16, no clipping), in one process after the other on the same
GPU and token file, with the step's lower bound from `tidal plan`.

  python3 bench/adam_thread.py [--shape "..."] [--steps 8] [--warmup 3] [--modes on,off]

Prints, per mode: median step ms and tokens/s over the steps after the
warm-up, bound/step, device peak and pinned host bytes (transient grads pin
less), and the on/off speedup.  Losses of the two runs must be equal (the
thread changes no numerics): a difference is reported as FAIL."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import write_token_file  # noqa: E402

W6 = ("--layers 48 --width 1600 --heads 25 --vocab 50304 --seq 1024 --micro-batch 16 --grad-accum 1 "
      "--gpu-budget 8GiB --backend cuda --precision bf16 --clip-grad-norm 0 --lr 1e-4 --schedule constant "
      "--warmup 0 --seed 1337")

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--tidal", default="build/tidal")
ap.add_argument("--shape", default=W6, help="tidal train flags of the shape (default: W6's)")
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--warmup", type=int, default=3, help="untimed steps (default 3)")
ap.add_argument("--modes", default="on,off", help="--adam-thread values to run, in order (default on,off)")
ap.add_argument("--workdir", default="")
a = ap.parse_args()

work = a.workdir or tempfile.mkdtemp(prefix="tidal-adam-thread-")
os.makedirs(work, exist_ok=True)
tok = os.path.join(work, "random.tok")
if not os.path.exists(tok):
    write_token_file(tok, 4_000_000, 1)
shape = a.shape.split()


def plan(mode):
    cmd = [a.tidal, "plan", "--data", tok, *shape, "--adam-thread", mode, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    sys.exit(f"tidal plan failed: {out.stderr[-500:]}")


rows = {}
for mode in a.modes.split(","):
    p = plan(mode)
    log = os.path.join(work, f"{mode}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    cmd = [a.tidal, "train", "--data", tok, *shape, "--adam-thread", mode, "--steps", str(a.steps),
           "--log", log, "--log-every", "100"]
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    steps = [json.loads(l) for l in open(log)] if os.path.exists(log) else []
    timed = [s for s in steps if s["step"] > a.warmup]
    if rc or not timed:
        sys.exit(f"--adam-thread {mode}: exit {rc}, {len(steps)} steps logged")
    ms = statistics.median(s["step_ms"] for s in timed)
    bound = p["estimate"]["step_lower_bound_ms"]
    rows[mode] = dict(ms=ms, tps=statistics.median(s["tokens_per_s"] for s in timed), bound=bound,
                      est=p["estimate"], peak=max(s.get("device_peak_bytes", 0) for s in steps),
                      pinned=p["host"]["pinned_bytes"], grad_slots=p["host"].get("grad_slots", 0),
                      losses=[s["loss"] for s in steps])

print(f"\n{'adam-thread':>11} {'step ms':>8} {'tok/s':>8} {'bound ms (compute/pcie/adam/dram)':>35} {'bound/step':>10} "
      f"{'device peak':>12} {'pinned':>10} {'grad slots':>10}")
for mode, r in rows.items():
    e = r["est"]
    print(f"{mode:>11} {r['ms']:8.1f} {r['tps']:8.0f} "
          f"{r['bound']:8.1f} ({e['compute_ms']:.0f}/{e['pcie_ms']:.0f}/{e['adam_ms']:.0f}/{e.get('dram_ms', 0):.0f}){'':>6} "
          f"{r['bound'] / r['ms']:10.1%} {r['peak'] / 2**30:10.2f}Gi {r['pinned'] / 2**30:8.2f}Gi {r['grad_slots']:>10}")
if "on" in rows and "off" in rows:
    print(f"\non/off: {rows['off']['ms'] / rows['on']['ms']:.2f}x faster step")
    same = rows["on"]["losses"] == rows["off"]["losses"]
    print("losses equal step by step: " + ("PASS" if same else "FAIL"))
    if not same:
        sys.exit(1)
