#!/usr/bin/env python3
"""W1's first 50 seeded steps: tidal on the GPU (bf16) against tidal's CPU backend (fp32).

Issue 6 asks that the first 50 seeded steps of W1 (GPT-2 124M: 12 layers,
768 wide, 12 heads, vocabulary 50304, B16 x T1024) on the GPU follow the CPU
backend's losses within bf16 tolerance.  Both runs read the same token file
(random GPT-2 ids, written by bench/workloads.py's writer with seed 1), start
from the same seeded init and take the same batches; they differ only in the
backend and the compute precision.

The CPU run is the slow half: about 76 s a step on 2 cores, about 10 s on 16.
Make it once with --run-cpu (anywhere: it needs no GPU) and pass its log with
--cpu-log; the GPU half takes seconds.

    python3 tests/gpu/check_w1_losses.py --run-cpu --cpu-log data/w1-cpu.jsonl   # no GPU needed
    python3 tests/gpu/check_w1_losses.py --cpu-log data/w1-cpu.jsonl            # on the GPU machine

Pass: every step's loss within --tol (default 0.5%) relative of the CPU's,
and the fall of the loss from step 1 to the last step within --fall-tol
(default 10%) of the CPU's fall (random tokens: the loss falls only about
0.1 nats in 50 steps, so the first check alone could not tell a model that
does not learn).  The largest difference is printed either way, with the
losses of every fifth step.
Exit status 0 on PASS, 1 on FAIL, 2 when something could not run.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
import workloads  # noqa: E402  (the token-file writer)

FLAGS = ["--layers", "12", "--width", "768", "--heads", "12", "--seq", "1024", "--vocab", "50304",
         "--micro-batch", "16", "--lr", "1e-4", "--schedule", "constant", "--warmup", "0",
         "--clip-grad-norm", "1", "--seed", "1337"]


def read_log(path):
    with open(path) as f:
        return {r["step"]: r["loss"] for r in (json.loads(ln) for ln in f if ln.strip())}


def train(a, backend, log):
    cmd = [a.tidal, "train", "--backend", backend, "--precision", "fp32" if backend == "cpu" else "bf16",
           "--data", a.data, "--steps", str(a.steps), "--log", log, "--log-every", "5"] + FLAGS
    env = dict(os.environ)
    if backend == "cpu":  # the cpu backend's "device" region must hold W1's activations
        env.setdefault("TD_CPU_DEVICE_BYTES", "12GiB")
        cmd += ["--gpu-budget", "10GiB"]
    print("$", " ".join(cmd), flush=True)
    if os.path.exists(log):
        os.remove(log)
    return subprocess.call(cmd, env=env)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tidal", default="build/tidal")
    ap.add_argument("--data", default="data/w1.tok", help="token file (written if missing)")
    ap.add_argument("--cpu-log", default="data/w1-cpu.jsonl", help="the CPU run's JSON-lines log")
    ap.add_argument("--gpu-log", default="out/w1-gpu.jsonl")
    ap.add_argument("--run-cpu", action="store_true", help="(re)make the CPU log, then stop")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--tol", type=float, default=0.005, help="largest relative loss difference (default 0.005)")
    ap.add_argument("--fall-tol", type=float, default=0.1,
                    help="largest relative difference of the loss's fall over the run (default 0.1)")
    a = ap.parse_args()
    if not os.path.exists(a.data):
        os.makedirs(os.path.dirname(os.path.abspath(a.data)), exist_ok=True)
        workloads.write_token_file(a.data, 4_000_000, 1)
    if a.run_cpu:
        return 0 if train(a, "cpu", a.cpu_log) == 0 else 2
    if not os.path.exists(a.cpu_log):
        print(f"no CPU log at {a.cpu_log}: make it with --run-cpu first", file=sys.stderr)
        return 2
    cpu = read_log(a.cpu_log)
    os.makedirs(os.path.dirname(os.path.abspath(a.gpu_log)), exist_ok=True)
    if train(a, "cuda", a.gpu_log) != 0:
        return 2
    gpu = read_log(a.gpu_log)
    steps = [s for s in range(1, a.steps + 1) if s in cpu and s in gpu]
    if len(steps) < a.steps:
        print(f"only {len(steps)} of {a.steps} steps in both logs", file=sys.stderr)
        return 2
    worst, at = 0.0, 0
    print("step  cpu fp32    gpu bf16    rel diff")
    for s in steps:
        d = abs(gpu[s] - cpu[s]) / abs(cpu[s])
        if d > worst:
            worst, at = d, s
        if s % 5 == 0 or s == 1:
            print(f"{s:4d}  {cpu[s]:.6f}  {gpu[s]:.6f}  {d:.2e}")
    first, last = steps[0], steps[-1]
    fall_cpu, fall_gpu = cpu[first] - cpu[last], gpu[first] - gpu[last]
    fall_d = abs(fall_gpu - fall_cpu) / abs(fall_cpu) if fall_cpu else float("inf")
    ok = worst <= a.tol and fall_d <= a.fall_tol
    print(f"largest relative difference {worst:.2e} at step {at} (tolerance {a.tol:g}); "
          f"loss fall step {first}->{last}: cpu {fall_cpu:.4f}, gpu {fall_gpu:.4f}, "
          f"relative difference {fall_d:.3f} (tolerance {a.fall_tol:g}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
