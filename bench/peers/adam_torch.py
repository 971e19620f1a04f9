#!/usr/bin/env python3
"""The CPU AdamW peer of `tidal bench adam` (docs/benchmarks.md).

torch.optim.AdamW([one flat fp32 param], fused=True) on the CPU, with
torch.set_num_threads(threads), on the sizes tidal's bench uses (1M, 4M,
16M, 64M, 200M, 1G params, up to --max-params), fp32 grads: the same 28
bytes per param as tidal's fp32 path (reads param, grad, exp_avg,
exp_avg_sq; writes param, exp_avg, exp_avg_sq).  Each figure is the median
step time over at least 5 steps and --min-seconds, after 2 warm-up steps.

Run beside tidal with the same threads, e.g. on a 16-core machine:
    build/tidal bench adam --json --threads 16 --max-params 1G > tidal_adam.json
    python3 bench/peers/adam_torch.py --threads 16 --max-params 1G > torch_adam.json
and compare gparams_per_s at the same "params".  --impl foreach gives the
other torch implementation (docs/benchmarks.md, the CPU AdamW peer).

Prints one JSON object:
    {"peer": "torch.optim.AdamW(fused=True)", "torch": VERSION, "threads": T,
     "results": [{"path": "fp32", "params": N, "threads": T,
                  "gparams_per_s": G, "gbytes_per_s": B}, ...]}
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

SIZES = [1_000_000, 4_000_000, 16_000_000, 64_000_000, 200_000_000, 1_000_000_000]
BYTES_PER_PARAM = 28


def parse_count(s):
    mult = {"k": 1e3, "K": 1e3, "M": 1e6, "m": 1e6, "G": 1e9, "g": 1e9}
    return int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(float(s))


def mem_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def bench_size(n, impl, min_s):
    p = torch.nn.Parameter(torch.empty(n, dtype=torch.float32).uniform_(-1, 1))
    p.grad = torch.empty(n, dtype=torch.float32).uniform_(-1, 1)
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    opt = torch.optim.AdamW([p], lr=1e-4, **kwargs)
    times = []
    start = time.perf_counter()
    for step in range(1_000_000):
        t0 = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t0
        if step < 2:  # warm-up: state allocation and first touch happen in step 1
            continue
        times.append(dt)
        if len(times) >= 5 and time.perf_counter() - start >= min_s:
            break
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-params", default="1G")
    ap.add_argument("--impl", choices=["fused", "foreach", "for-loop"], default="fused")
    ap.add_argument("--min-seconds", type=float, default=1.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    max_params = parse_count(args.max_params)
    sizes = [s for s in SIZES if s <= max_params]
    if not sizes or sizes[-1] < max_params:
        sizes.append(max_params)
    avail = mem_available()
    results, skipped = [], []
    for n in sizes:
        # param, grad, exp_avg, exp_avg_sq: 16 bytes/param.
        if avail and 16 * n > 0.9 * avail:
            skipped.append(n)
            print(f"adam_torch: skipped {n} params: needs {16 * n / 2**30:.1f} GiB, "
                  f"{avail / 2**30:.1f} GiB available", file=sys.stderr)
            continue
        sec = bench_size(n, args.impl, args.min_seconds)
        r = {"path": "fp32", "params": n, "threads": args.threads, "gparams_per_s": n / sec / 1e9,
             "gbytes_per_s": BYTES_PER_PARAM * n / sec / 1e9}
        results.append(r)
        print(f"adam_torch: {n:>11} params {r['gparams_per_s']:.3f} Gparams/s {r['gbytes_per_s']:.2f} GB/s",
              file=sys.stderr)
    name = {"fused": "torch.optim.AdamW(fused=True)", "foreach": "torch.optim.AdamW(foreach=True)",
            "for-loop": "torch.optim.AdamW(foreach=False)"}[args.impl]
    print(json.dumps({"peer": name, "torch": torch.__version__, "threads": args.threads,
                      "bytes_per_param": BYTES_PER_PARAM, "results": results, "skipped_params": skipped},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
