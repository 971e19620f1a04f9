#!/usr/bin/env python3
"""W5 of docs/benchmarks.md: the largest model that trains on the host, at a 24 GiB GPU budget.

Rows, each a bench/workloads.py run of its own (tidal and peer one process
after the other on the same GPU, the same random-token file, 16k tokens a
step, bf16 compute, lr 1e-4):

  tidal-fp32    tidal at the largest shape `tidal plan --largest` finds for the
                host with exact fp32 AdamW state (or --fp32-shape)
  tidal-int8    the same with --optim-state int8 (or --int8-shape)
  at-peer-max   tidal beside FSDP2 CPU offload at FSDP2's largest shape
                (--peer-shape, default 32L/4096/32H = 6.65B, the largest that
                trains on a 125 GiB host; FSDP2 keeps fp32 params, grads, m
                and v on the host, 16 bytes a parameter, so the next size up
                does not fit): the tokens/s ratio of one run

`tidal plan --largest` is asked with the host RAM given by --host-ram (default:
what tidal reads itself).  Peers are not run at tidal's larger shapes: their
host state would not fit (16 bytes a parameter), and a host out-of-memory kill
is not a measurement.  Parts can run in separate calls (--rows), each printing
its table; the ratio row is self-contained.

Usage (GPU machine, repository root, after `make`):
    python3 bench/w5.py                         # all rows
    python3 bench/w5.py --rows at-peer-max      # the ratio only
    python3 bench/w5.py --smoke --tidal-backend cpu   # plumbing, no GPU

Each row's figures go to bench/results/W5-<row>.json (bench/results.py);
--smoke and --tidal-backend cpu write none unless --results names a folder.
"""
import argparse
import copy
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import workloads as wl  # noqa: E402

ROWS = ["tidal-fp32", "tidal-int8", "at-peer-max"]


def parse_shape(s):
    m = re.fullmatch(r"(\d+)[xX/](\d+)[xX/](\d+)", s.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"shape '{s}': use LAYERSxWIDTHxHEADS, e.g. 40x4096x32")
    return tuple(int(g) for g in m.groups())


def params_of(shape, vocab=wl.VOCAB, seq=1024):
    L, C, _ = shape
    return vocab * C + seq * C + L * (12 * C * C + 13 * C) + 2 * C


def largest(a, state, width, heads, extra=()):
    """The largest layer count of width/heads that `tidal plan --largest [extra flags]` says fits, or None."""
    cmd = [a.tidal, "plan", "--largest", "--json", "--backend", a.tidal_backend,
           "--precision", "bf16" if a.tidal_backend == "cuda" else "fp32", "--width", str(width),
           "--heads", str(heads), "--seq", str(a.seq), "--micro-batch", str(a.batch), "--vocab", str(wl.VOCAB),
           "--gpu-budget", f"{a.budget_gib:g}GiB", "--optim-state", state] + list(extra)
    if a.host_ram:
        cmd += ["--host-ram", a.host_ram]
    out = subprocess.run(cmd, capture_output=True, text=True)
    doc = None
    for ln in reversed(out.stdout.splitlines()):
        if ln.strip().startswith("{"):
            try:
                doc = json.loads(ln)
                break
            except ValueError:
                pass
    if doc is None:
        wl.say(f"  tidal plan --largest {' '.join(extra)} failed (exit {out.returncode}): {out.stderr.strip()[-300:]}")
        return None
    for row in doc.get("largest", []):
        if row.get("optim_state") == state and row.get("width") == width and row.get("layers"):
            return (row["layers"], width, heads)
    wl.say(f"  tidal plan --largest gave no {state} row for width {width}: {json.dumps(doc)[:300]}")
    return None


def workload(wid, shape, a, peer):
    L, C, H = shape
    name = f"{params_of(shape) / 1e9:.2f}B ({L}L/{C}/{H}H)"
    B = a.batch
    w = wl.Workload(wid, name, shape, a.budget_gib, B * a.seq, [(B, 1)], "fsdp2-offload",
                    [(B, 1, True)] if peer else [], 1.5 if peer else 0.0)
    return w


def run_row(a, w, extra, peer):
    b = copy.copy(a)
    b.tidal_args = (a.tidal_args + " " + extra).strip()
    t = wl.guarded(wl.run_tidal, b, w, {"system": "tidal", "tried": []})
    if peer:
        p = wl.guarded(wl.run_peer, b, w, {"system": wl.PEER_NAMES[w.peer_mode], "tried": [], "best": None})
    else:
        p = {"system": wl.PEER_NAMES[w.peer_mode], "error": "not run at this size (its host state would not fit)",
             "tried": [], "best": None}
    return {"w": w, "tidal": t, "peer": p, "extra": extra}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--tidal", default="build/tidal")
    ap.add_argument("--fp32-shape", type=parse_shape, help="LxCxH for tidal-fp32 (default: tidal plan --largest)")
    ap.add_argument("--int8-shape", type=parse_shape, help="LxCxH for tidal-int8 (default: tidal plan --largest)")
    ap.add_argument("--peer-shape", type=parse_shape, default=(32, 4096, 32), help="FSDP2's largest (32x4096x32)")
    ap.add_argument("--width", type=int, default=4096, help="width for --largest (default 4096)")
    ap.add_argument("--heads", type=int, default=32, help="heads for --largest (default 32)")
    ap.add_argument("--int8-width", type=int, default=5120, help="width for the int8 --largest (default 5120)")
    ap.add_argument("--int8-heads", type=int, default=40, help="heads for the int8 --largest (default 40)")
    ap.add_argument("--host-ram", default="", help="host RAM for tidal (e.g. 125GiB; default: tidal's reading)")
    ap.add_argument("--budget-gib", type=float, default=24.0)
    ap.add_argument("--batch", type=int, default=16, help="micro-batch (16 x 1024 = 16k tokens a step)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--tidal-args", default="")
    ap.add_argument("--tidal-backend", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the plumbing")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--workdir", default="out/bench-w5")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--results", metavar="DIR", help="results files here (default bench/results/, not with --smoke)")
    ap.add_argument("--no-results", action="store_true", help="write no results file")
    ap.add_argument("--run-timeout", type=int, default=900)
    a = ap.parse_args(argv)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        ap.error(f"unknown row(s) {', '.join(bad) or '(none)'}: choose from {', '.join(ROWS)}")
    a.seq, a.quick, a.tidal_batch, a.peer_batch = 1024, True, "", ""
    if a.no_results:
        a.results = None
    elif a.results is None and not a.smoke and a.tidal_backend == "cuda":
        a.results = wl.res.RESULTS_DIR
    peak = wl.peak_flops()
    if a.smoke:
        a.seq, a.batch, a.budget_gib = 64, 2, 0.0625
        a.width, a.heads, a.int8_width, a.int8_heads = 64, 2, 64, 2
        a.peer_shape = (2, 64, 2)
    os.makedirs(a.workdir, exist_ok=True)
    a.data = os.path.join(a.workdir, "random.tok")
    wl.write_token_file(a.data, max(a.batch * a.seq * a.steps + 1, 1 << 20), seed=1337)
    info = wl.machine_info()
    wl.say(f"bench/w5.py: rows {', '.join(rows)}; machine {info.get('host')}, {info.get('cpus')} CPUs, "
           f"GPU {', '.join(info.get('gpus', ['none found']))}")
    results = []
    for r in rows:
        if r == "tidal-fp32":
            shape = a.fp32_shape or largest(a, "fp32", a.width, a.heads)
            extra, peer = "--optim-state fp32", False
        elif r == "tidal-int8":
            shape = a.int8_shape or largest(a, "int8", a.int8_width, a.int8_heads)
            extra, peer = "--optim-state int8", False
        else:
            shape, extra, peer = a.peer_shape, "--optim-state fp32", True
        if shape is None:
            continue
        if a.host_ram:
            extra += f" --host-ram {a.host_ram}"
        w = workload(f"W5-{r}", shape, a, peer)
        wl.say(f"\n== W5-{r}: {w.name}, GPU budget {a.budget_gib:g} GiB, {w.tokens} tokens/step, tidal {extra}")
        res = run_row(a, w, extra, peer)
        t = res["tidal"]
        if t.get("error"):
            wl.say(f"  tidal: not available ({t['error']})")
        else:
            wl.say(f"  tidal: {t['tokens_per_s']:.0f} tok/s, step {t['step_ms_median']:.1f} ms, peak "
                   f"{wl.gib(t['peak_bytes'])}")
        results.append(res)
        if a.results:
            wl.record(a, res, peak)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(wl.to_json(results, a), f, indent=1)
    wl.print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
