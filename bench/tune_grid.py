#!/usr/bin/env python3
"""`tidal tune`'s pick against a measured brute-force grid over the same
knobs (the pick should be within 5% of the grid's best), at one workload's
shape (default W6: GPT-2 1.5B, 8 GiB, 16 sequences of 1024 a step, bf16).

  python3 bench/tune_grid.py [--shape "..."] [--steps 6] [--warmup 2]
      [--splits 16x1,8x2,4x4] [--ckpt 48,36,24] [--optim-frac 0,1]
      [--prefetch -1,8,16] [--chunk-numel 0] [--results FILE.json] [--max-minutes M]
      [--id tune-grid-W6]

1. `tidal tune` on the shape (--top, --steps): its winner's flags.
2. Every combination of the grid's knobs (micro-batch x grad-accum of the
   same tokens a step, checkpointed blocks, --offload-optim-frac under
   --policy auto: 0 lets the plan put what fits on the GPU, 1 keeps it all on
   the host, --prefetch, --chunk-numel: 0 is the default search) that
   `tidal plan` says fits is trained for --steps; the median tokens/s of the
   steps after --warmup counts.  A point whose plan places everything as a
   measured point's does (the same split, prefetch, checkpointed blocks,
   chunks and optimizer chunks on the GPU: --offload-optim-frac 0 and 1
   when the budget leaves the optimizer no room) takes that measurement.  The tune winner's flags are trained the
   same way, so that both sides are measured alike, in one call.
3. A table, best first, and the pick against the grid's best.

Each result goes to --results as it comes (default out/tune-grid/results.json):
a second call with the same file skips what was measured, so a grid larger
than one call's time (--max-minutes) is finished by calling again, on a
machine of the same kind (GPU model and CPU count; the file records them).
Two machines of one kind still differ (host DRAM, clocks: W4 ran 1102 and
1236 ms a step on two H200 machines), so every call first trains tune's pick
again, and each grid point counts against the pick of its own call: the
pick's share of the best is 1 / the largest (point / pick of the same
call).  Exit 1 if the pick is more than 5% below the best measured.

When every grid point has been measured, the figures (the pick's tokens/s,
the grid's best, the pick's share of it) go to bench/results/<--id>.json
(bench/results.py; --no-record writes none)."""
import argparse
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results as bench_results  # noqa: E402
from workloads import write_token_file  # noqa: E402

W6 = ("--layers 48 --width 1600 --heads 25 --vocab 50304 --seq 1024 --gpu-budget 8GiB --backend cuda "
      "--precision bf16 --clip-grad-norm 0 --lr 1e-4 --schedule constant --warmup 0 --seed 1337")


def parse_splits(text):
    out = []
    for s in text.split(","):
        b, _, k = s.partition("x")
        out.append((int(b), int(k or 1)))
    return out


def ints(text):
    return [int(x) for x in text.split(",") if x != ""]


def floats(text):
    return [float(x) for x in text.split(",") if x != ""]


def machine():
    gpu = ""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    return f"{os.cpu_count()} CPUs, {gpu or 'no GPU'}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tidal", default="build/tidal")
    ap.add_argument("--shape", default=W6, help="tidal flags of the shape, without batch flags (default: W6's)")
    ap.add_argument("--data", default="", help="token file (default: random tokens written to the work folder)")
    ap.add_argument("--steps", type=int, default=6, help="steps a run (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each run (default 2)")
    ap.add_argument("--splits", default="16x1,8x2,4x4", help="micro-batch x grad-accum (the same tokens a step)")
    ap.add_argument("--ckpt", default="", help="checkpointed blocks, a --ckpt N each (default: all, three quarters "
                    "and half of the shape's --layers)")
    ap.add_argument("--optim-frac", default="0,1", help="--offload-optim-frac under --policy auto")
    ap.add_argument("--prefetch", default="-1,8,16", help="--prefetch values (-1: auto; default -1,8,16)")
    ap.add_argument("--chunk-numel", default="0", help="--chunk-numel values (0: the default search)")
    ap.add_argument("--top", type=int, default=3, help="tidal tune --top (default 3)")
    ap.add_argument("--results", default="out/tune-grid/results.json")
    ap.add_argument("--max-minutes", type=float, default=0, help="stop starting runs after this long (0: no limit)")
    ap.add_argument("--id", default="tune-grid-W6", help="the results file's id (default tune-grid-W6; W6's shape)")
    ap.add_argument("--no-record", action="store_true", help="write no bench/results/ file")
    ap.add_argument("--run-timeout", type=int, default=300, help="seconds a run may take (default 300)")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        sys.exit("tune_grid: --steps must exceed --warmup")
    if not a.ckpt:
        words = shlex.split(a.shape)
        if "--layers" not in words:
            sys.exit("tune_grid: give --ckpt (the shape has no --layers to take it from)")
        L = int(words[words.index("--layers") + 1])
        a.ckpt = f"{L},{3 * L // 4},{L // 2}"
    try:
        grid = list(itertools.product(parse_splits(a.splits), ints(a.ckpt), floats(a.optim_frac), ints(a.prefetch),
                                      ints(a.chunk_numel)))
    except ValueError as e:
        sys.exit(f"tune_grid: a grid list is malformed: {e}")
    start = time.monotonic()
    os.makedirs(os.path.dirname(os.path.abspath(a.results)), exist_ok=True)
    work = os.path.dirname(os.path.abspath(a.results))
    tok = a.data
    if not tok:
        tok = os.path.join(work, "random.tok")
        if not os.path.exists(tok):
            write_token_file(tok, 4_000_000, 1)
    shape = shlex.split(a.shape) + ["--data", tok]
    res = {"machine": machine(), "shape": a.shape, "runs": {}, "calls": []}
    if os.path.exists(a.results):
        with open(a.results) as f:
            old = json.load(f)
        if old.get("shape") != a.shape or old.get("machine") != res["machine"]:
            sys.exit(f"tune_grid: {a.results} holds another shape or kind of machine ({old.get('machine')}); "
                     "give another --results")
        res = old
        res.setdefault("calls", [])
    call = len(res["calls"])
    res["calls"].append({"host": platform.node(), "pick_tokens_per_s": None})

    def save():
        tmp = a.results + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, a.results)

    def out_of_time():
        return a.max_minutes > 0 and time.monotonic() - start > a.max_minutes * 60

    def train(flags, again=False):
        """Median tokens/s and step ms of the timed steps, peak bytes; None if it did not run.
        again: train it in this call even if an earlier call did (the pick, each call's anchor)."""
        key = " ".join(flags)
        if key in res["runs"] and not again:
            return res["runs"][key]
        plan = subprocess.run([a.tidal, "plan", *shape, *flags, "--json"], capture_output=True, text=True,
                              timeout=a.run_timeout)
        if plan.returncode == 3:
            res["runs"][key] = {"fits": False}
            save()
            return res["runs"][key]
        if plan.returncode != 0:
            sys.exit(f"tune_grid: tidal plan {key}: exit {plan.returncode}: {plan.stderr[-400:]}")
        pj = json.loads(plan.stdout.strip().splitlines()[-1])
        bound = pj["estimate"]["step_lower_bound_ms"]
        # Two flag sets whose plans place everything alike (e.g. --offload-optim-frac 0
        # and 1 when the budget leaves no optimizer chunk room on the GPU) are one run.
        def flag(name, default):
            words = shape + flags  # the last one given counts, as in tidal's own parsing
            return words[len(words) - 1 - words[::-1].index(name) + 1] if name in words else default
        same = json.dumps([flag("--micro-batch", "4"), flag("--grad-accum", "1"), flag("--prefetch", "-1"),
                           pj.get("ckpt_blocks"), pj.get("chunks"), pj.get("chunk_numel"), pj.get("optimizer"),
                           pj.get("device", {}).get("min_bytes")], sort_keys=True)
        for other, r in res["runs"].items():
            if r.get("same") == same and "tokens_per_s" in r and not again:
                res["runs"][key] = dict(r, same_as=other)
                save()
                return res["runs"][key]
        log = os.path.join(work, "run.jsonl")
        if os.path.exists(log):
            os.remove(log)
        cmd = [a.tidal, "train", *shape, *flags, "--steps", str(a.steps), "--log", log, "--log-every", "1000"]
        t0 = time.monotonic()
        try:
            rc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.run_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        steps = [json.loads(l) for l in open(log)] if os.path.exists(log) else []
        timed = [s for s in steps if s["step"] > a.warmup]
        r = {"fits": True, "rc": rc, "bound_ms": bound, "seconds": round(time.monotonic() - t0, 1), "same": same,
             "call": call}
        if rc == 0 and timed:
            r.update(tokens_per_s=statistics.median(s["tokens_per_s"] for s in timed),
                     step_ms=statistics.median(s["step_ms"] for s in timed),
                     peak=max(s["device_peak_bytes"] for s in steps))
        res["runs"][key] = r
        save()
        return r

    # 1. tune's pick
    if "tune" not in res:
        cmd = [a.tidal, "tune", *shape, "--micro-batch", str(grid[0][0][0]), "--grad-accum", str(grid[0][0][1]),
               "--top", str(a.top), "--steps", str(a.steps), "--json"]
        print("$", " ".join(cmd), flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"tune_grid: tidal tune: exit {p.returncode}: {p.stderr[-600:]}")
        win = json.loads(p.stdout)["budgets"][0]["winner"]
        if not win:
            last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "(it said nothing)"
            sys.exit(f"tune_grid: tidal tune found no candidate that fits the shape's budget: {last}")
        flags = shlex.split(win["flags"])
        # its --gpu-budget is the shape's; the rest are the knobs
        knobs, i = [], 0
        while i < len(flags):
            if flags[i] == "--gpu-budget":
                i += 2
                continue
            knobs.append(flags[i])
            i += 1
        res["tune"] = {"flags": knobs, "tune_tokens_per_s": win.get("tokens_per_s")}
        save()
    pick_flags = res["tune"]["flags"]
    print(f"tune's pick: {' '.join(pick_flags)} ({res['tune']['tune_tokens_per_s'] or 0:.0f} tok/s in tune)",
          flush=True)
    pick = train(pick_flags, again=call > 0)
    if "tokens_per_s" not in pick:
        sys.exit(f"tune_grid: tune's pick did not train (exit {pick.get('rc')})")
    res["calls"][call]["pick_tokens_per_s"] = pick["tokens_per_s"]
    save()
    anchors = {i: c["pick_tokens_per_s"] for i, c in enumerate(res["calls"]) if c.get("pick_tokens_per_s")}

    def rel(r):
        """A run's tokens/s over the pick's in the same call."""
        return r["tokens_per_s"] / anchors[r.get("call", 0)] if r.get("call", 0) in anchors else None

    # 2. the grid
    def grid_flags(point):
        (b, k), ck, frac, pre, cn = point
        return ["--micro-batch", str(b), "--grad-accum", str(k), "--ckpt", str(ck), "--policy", "auto",
                "--offload-optim-frac", f"{frac:g}", "--prefetch", str(pre), "--chunk-numel", str(cn)]

    grid_keys = {" ".join(grid_flags(p)) for p in grid}
    done = 0
    for point in grid:
        if out_of_time():
            print(f"tune_grid: --max-minutes {a.max_minutes:g} reached; call again with the same --results",
                  flush=True)
            break
        flags = grid_flags(point)
        r = train(flags)
        done += 1
        state = ("does not fit" if not r["fits"] else f"{r['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in r
                 else f"exit {r['rc']}") + (f" (the same plan as {r['same_as']}: not run again)" if "same_as" in r
                                            else "")
        print(f"[{done}/{len(grid)}] {' '.join(flags)}: {state}", flush=True)

    # 3. the table
    ran = [(rel(r), key, r) for key, r in res["runs"].items() if "tokens_per_s" in r and rel(r) is not None]
    ran.sort(reverse=True)
    print(f"\nmachine kind: {res['machine']}; calls: " +
          ", ".join(f"{i + 1} on {c['host']} (pick {c['pick_tokens_per_s'] or 0:.0f} tok/s)"
                    for i, c in enumerate(res["calls"])))
    print(f"{'tok/s':>8} {'of pick':>8} {'call':>4} {'step ms':>8} {'bound/step':>10} {'peak GiB':>8}  flags")
    for x, key, r in ran:
        mark = ("  <- tune's pick" if key == " ".join(pick_flags) else "") + \
            ("  (its plan is that of another row: not run again)" if "same_as" in r else "")
        print(f"{r['tokens_per_s']:8.0f} {x:8.1%} {r.get('call', 0) + 1:4d} {r['step_ms']:8.1f} "
              f"{r['bound_ms'] / r['step_ms']:10.1%} {r['peak'] / 2**30:8.2f}  {key}{mark}")
    missing = sum(1 for key in grid_keys if key not in res["runs"])
    in_grid = [x for x in ran if x[1] in grid_keys]
    if not in_grid:
        sys.exit("tune_grid: nothing to compare yet")
    best = in_grid[0]
    ratio = 1.0 / best[0]
    print(f"\ntune's pick against the grid's best ({best[1]}, {best[2]['tokens_per_s']:.0f} tok/s in call "
          f"{best[2].get('call', 0) + 1}, {best[0]:.1%} of that call's pick): the pick is {ratio:.1%} of it "
          f"(target: within 5%)" + (f"; {missing} grid points not run yet" if missing else ""))
    if not missing and not a.no_record:
        bench_results.write_result(a.id, f"tidal tune's pick against a measured grid of {len(grid_keys)} points "
                                   f"({a.shape})", [
                                       bench_results.figure("tune's pick tokens/s", pick["tokens_per_s"], "tok/s"),
                                       bench_results.figure("the grid's best tokens/s", best[2]["tokens_per_s"], "tok/s"),
                                       bench_results.figure("tune's pick / the grid's best", 100 * ratio, "%")],
                                   details={"pick": pick_flags, "best": best[1], "calls": res["calls"],
                                            "runs": res["runs"]})
    if ratio < 0.95:
        sys.exit(1)


if __name__ == "__main__":
    main()
