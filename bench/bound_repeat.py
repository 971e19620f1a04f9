#!/usr/bin/env python3
"""How repeatable the step's lower bound is: `tidal plan --json` run N times
with one set of flags, each run's measured rates (the CPU AdamW's G params/s
and DRAM GB/s, the DRAM GB/s it reaches with copies running beside it, the
copy GB/s) and bound terms, and the spread of each (largest over smallest,
minus one).  Then `tidal bench adam` at --adam-params (default 256M) for the
same path (bf16 grads in, bf16 params out, fp32 state: what the plan times
for a bf16 run), against the plan's AdamW rate.

    python3 bench/bound_repeat.py                      # W4's shape, 3 plans
    python3 bench/bound_repeat.py --runs 5 --flags "--layers 48 --width 1600 --heads 25 --micro-batch 16 --gpu-budget 8GiB"

Issue 15 asks for the AdamW term within 10% between runs on one machine and
within 15% of `tidal bench adam` at 256M.  Exit status 0 unless a command
fails; the verdicts are printed, not enforced."""
import argparse
import json
import os
import shlex
import subprocess
import sys

W4 = ("--layers 32 --width 3200 --heads 25 --vocab 50304 --seq 1024 --micro-batch 16 --grad-accum 1 "
      "--gpu-budget 24GiB --clip-grad-norm 1")


def last_json(text):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tidal", default="build/tidal", help="the tidal binary (default build/tidal)")
    ap.add_argument("--runs", type=int, default=3, help="plans to run (default 3)")
    ap.add_argument("--backend", default="cuda", help="tidal's --backend (default cuda)")
    ap.add_argument("--flags", default=W4, help="the run's shape and budget flags (default: W4's)")
    ap.add_argument("--adam-params", default="256M", help="tidal bench adam's --max-params (default 256M; "
                    "'none' skips it)")
    ap.add_argument("--adam-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="tidal bench adam's --threads (default: cores - 1, the plan's team beside the AdamW "
                    "thread of a streaming run)")
    ap.add_argument("--json", help="write every figure to this file")
    a = ap.parse_args()
    if a.runs < 2:
        ap.error("--runs must be at least 2 (a spread needs two runs)")
    prec = "bf16" if a.backend == "cuda" else "fp32"
    cmd = [a.tidal, "plan", "--backend", a.backend, "--precision", prec] + shlex.split(a.flags) + ["--json"]
    print("command:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    rows = []
    for i in range(a.runs):
        p = subprocess.run(cmd, capture_output=True, text=True)
        j = last_json(p.stdout)
        if p.returncode not in (0, 3) or j is None:
            sys.exit(f"tidal plan failed (exit {p.returncode}): {p.stderr.strip()[-400:]}")
        m, e = j["measured"], j["estimate"]
        rows.append({"adam_gparams_per_s": m["adam_gparams_per_s"], "dram_gbytes_per_s": m["dram_gbytes_per_s"],
                     "dram_fastest_gbytes_per_s": m.get("dram_fastest_gbytes_per_s", 0),
                     "dram_loaded_gbytes_per_s": m.get("dram_loaded_gbytes_per_s", 0),
                     "dram_loaded_adam_gbytes_per_s": m.get("dram_loaded_adam_gbytes_per_s", 0),
                     "dram_loaded_copy_gbytes_per_s": m.get("dram_loaded_copy_gbytes_per_s", 0),
                     "copy_gbytes_per_s": m["copy_gbytes_per_s"], "compute_ms": e["compute_ms"],
                     "pcie_ms": e["pcie_ms"], "adam_ms": e["adam_ms"], "dram_ms": e.get("dram_ms", 0),
                     "bound_ms": e["step_lower_bound_ms"]})
        r = rows[-1]
        print(f"plan {i + 1}/{a.runs}: AdamW {r['adam_gparams_per_s']:.3f} G params/s ({r['dram_gbytes_per_s']:.1f} "
              f"GB/s, fastest pass {r['dram_fastest_gbytes_per_s']:.1f}; at {m.get('adam_probe_params', 0) / 2**20:.0f} Mi params), with copies {r['dram_loaded_gbytes_per_s']:.1f} GB/s (AdamW {r['dram_loaded_adam_gbytes_per_s']:.1f} + "
              f"copies {r['dram_loaded_copy_gbytes_per_s']:.1f}), copy {r['copy_gbytes_per_s']:.1f} GB/s; "
              f"bound {r['bound_ms']:.1f} ms (compute {r['compute_ms']:.1f} / PCIe {r['pcie_ms']:.1f} / AdamW "
              f"{r['adam_ms']:.1f} / host DRAM {r['dram_ms']:.1f})", flush=True)
    spread = {}
    for k in rows[0]:
        vals = [r[k] for r in rows]
        lo, hi = min(vals), max(vals)
        spread[k] = (hi / lo - 1) if lo > 0 else None
    print("\n| figure | min | max | spread |\n|---|---|---|---|")
    for k, s in spread.items():
        vals = [r[k] for r in rows]
        print(f"| {k} | {min(vals):.3f} | {max(vals):.3f} | {'-' if s is None else f'{100 * s:.1f}%'} |")
    out = {"command": cmd, "plans": rows, "spread": spread}
    if a.adam_params != "none":
        bcmd = [a.tidal, "bench", "adam", "--max-params", a.adam_params, "--optim-state", "fp32",
                "--threads", str(a.adam_threads), "--json"]
        print("\ncommand:", " ".join(bcmd), flush=True)
        p = subprocess.run(bcmd, capture_output=True, text=True)
        try:
            bj = json.loads(p.stdout)
        except ValueError:
            sys.exit(f"tidal bench adam failed (exit {p.returncode}): {p.stderr.strip()[-400:]}")
        path = "mixed" if prec == "bf16" else "fp32"
        res = [r for r in bj["results"] if r["path"] == path and r["state"] == "fp32"]
        if not res:
            sys.exit("tidal bench adam reported no row for the run's path")
        big = max(res, key=lambda r: r["params"])
        plan_rates = sorted(r["adam_gparams_per_s"] for r in rows)
        med = plan_rates[len(plan_rates) // 2]
        print(f"tidal bench adam, {path} path at {big['params']} params, {big['threads']} threads: "
              f"{big['gparams_per_s']:.3f} G params/s ({big['gbytes_per_s']:.1f} GB/s); the plans' median "
              f"{med:.3f}: {100 * (med / big['gparams_per_s'] - 1):+.1f}%")
        out["bench_adam"] = big
        out["plan_over_bench"] = med / big["gparams_per_s"]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
