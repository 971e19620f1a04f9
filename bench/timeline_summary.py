#!/usr/bin/env python3
"""Where a step's time goes, from a `tidal train --trace-timeline FILE`.

  python3 bench/timeline_summary.py FILE [--steps N]

A step runs from one "embedding" forward range to the next.  Per step it
prints the span, the compute queue's ranges (forward, backward, head) and
the gaps between them (the queue idle: the driving thread had issued
nothing), the blocks whose range took longer than the median of its kind
(waiting inside: a load, a gather, a grad slot), the copy engines' busy
time, the CPU AdamW's busy time (its track, host clock) and the driving
thread's longest spans: its waits for the CPU AdamW, and the chunk manager's
accesses it spent 0.05 ms or more in (host waits, and how many loads each
issued).  With --blocks, each block's forward and backward range too.  The largest gaps and slow ranges are named, which
says what the step waits for at its boundary."""
import argparse
import json
import statistics
import sys


def busy(spans, lo, hi):
    """Time covered by the union of spans, clipped to [lo, hi)."""
    cut = sorted((max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi)
    total, end = 0.0, lo
    for a, b in cut:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def kind(name):
    if name.startswith("block "):
        return "block " + name.split()[-1]  # block forward / block backward
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--steps", type=int, default=0, help="summarise only the last N steps (default: all)")
    ap.add_argument("--top", type=int, default=4, help="largest gaps and slowest ranges named per step")
    ap.add_argument("--blocks", action="store_true",
                    help="also each block's forward and backward range per step, in ms, in block order")
    a = ap.parse_args()
    with open(a.file) as f:
        events = json.load(f)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    tracks = {}
    for e in events:
        if e.get("ph") == "X":
            tracks.setdefault(names.get(e["tid"], str(e["tid"])), []).append(
                (e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3, e["name"]))
    for v in tracks.values():
        v.sort()
    compute = tracks.get("compute", [])
    starts = [s for s, _, n in compute if n == "embedding"]
    if len(starts) < 2:
        sys.exit(f"{a.file}: fewer than two steps' forward ranges ('embedding') in the timeline")
    medians = {}
    for k in {kind(n) for _, _, n in compute}:
        medians[k] = statistics.median(b - s for s, b, n in compute if kind(n) == k)
    steps = list(zip(starts, starts[1:]))
    if a.steps:
        steps = steps[-a.steps:]
    for i, (lo, hi) in enumerate(steps):
        rng = [(s, b, n) for s, b, n in compute if lo <= s < hi]
        gaps = [(rng[j + 1][0] - rng[j][1], rng[j][2], rng[j + 1][2]) for j in range(len(rng) - 1)]
        gaps.append((hi - rng[-1][1], rng[-1][2], "next step's embedding"))
        by = {}
        for s, b, n in rng:
            by[kind(n)] = by.get(kind(n), 0.0) + (b - s)
        slow = sorted(((b - s) - medians[kind(n)], n) for s, b, n in rng)[::-1]
        print(f"step {i + 1} of {len(steps)}: {hi - lo:.1f} ms")
        print("  compute: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))
              + f"; idle {sum(g for g, _, _ in gaps if g > 0):.1f} ms")
        for tr in ("H2D", "D2H", "CPU AdamW", "CPU AdamW (driving thread)", "driving thread"):
            if tr in tracks:
                spans = [(s, b) for s, b, _ in tracks[tr]]
                print(f"  {tr}: busy {busy(spans, lo, hi):.1f} ms")
        print("  largest compute gaps: " + "; ".join(f"{g:.1f} ms after {p} (before {q})"
                                                       for g, p, q in sorted(gaps, reverse=True)[:a.top]))
        print("  slowest against their kind's median: " + "; ".join(f"{n} +{x:.1f} ms" for x, n in slow[:a.top]))
        if a.blocks:
            for k in ("forward", "backward"):
                per = sorted((int(n.split()[1]), b - s) for s, b, n in rng if kind(n) == "block " + k)
                if per:
                    ms = [d for _, d in per]
                    print(f"  block {k} ranges (block 0 first; median {statistics.median(ms):.2f} ms): "
                          + " ".join(f"{d:.2f}" for _, d in per))
        waits = sorted(((b - s), n) for s, b, n in tracks.get("driving thread", []) if lo <= s < hi)[::-1]
        if waits:
            print("  driving thread's longest spans (waits for the CPU AdamW, slow accesses): "
                  + "; ".join(f"{n} {x:.1f} ms" for x, n in waits[:a.top]))


if __name__ == "__main__":
    main()
