#!/usr/bin/env python3
"""W10 of BENCH.md: the largest model that trains on the 2 GPUs of one host at
24 GiB each with fp32 AdamW state, beside the largest one GPU of that host
trains, and beside FSDP2 CPU offload on the 2 GPUs.

Rows, each a bench/workloads.py run of its own (16k tokens a rank a step,
bf16 compute, fp32 AdamW state, lr 1e-4, random tokens):

  tidal-2gpu    tidal --nproc 2 at the largest shape `tidal plan --largest
                --nproc 2` finds for the host (each rank's host holding its
                shard of every chunk: the host holds the model state once)
  tidal-1gpu    tidal on one GPU of the same host at the largest shape
                `tidal plan --largest` finds (or --one-shape)
  at-peer-max   tidal --nproc 2 beside FSDP2 CPU offload on the 2 GPUs
                (torchrun) at FSDP2's largest 2-GPU shape (--peer-shape,
                default 32L/4096/32H = 6.65B: FSDP2 keeps fp32 params,
                grads, m and v on the host, 16 bytes a parameter for the
                host whatever the number of GPUs): the tokens/s ratio of one
                run

The W10 targets: tidal-2gpu's model at least tidal-1gpu's; at FSDP2's
largest, tidal at least 2x FSDP2.  Peers are not run at tidal's larger
shapes (their host state would not fit).  The results file
(bench/results/W10.json through bench/results.py; --results DIR for
another folder) has the two comparisons (each where both of its rows ran)
and each trained row's tokens/s and parameter count as figures; every
run's figures, the shapes and their parameter counts as details.

Usage (GPU machine of 2 GPUs, repository root, after `make`):
    python3 bench/w10.py                               # all rows
    python3 bench/w10.py --rows at-peer-max            # the ratio only
    python3 bench/w10.py --smoke --tidal-backend cpu   # plumbing, no GPU
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results as res  # noqa: E402
import workloads as wl  # noqa: E402
import w5  # noqa: E402

ROWS = ["tidal-2gpu", "tidal-1gpu", "at-peer-max"]


def largest(a, nproc):
    """The largest layer count at --width/--heads that `tidal plan --largest [--nproc N]` fits with fp32
    state, as a shape, or None."""
    extra = ["--clip-grad-norm", f"{a.clip:g}"] + (["--nproc", str(nproc)] if nproc > 1 else [])
    return w5.largest(a, "fp32", a.width, a.heads, extra)


def workload(wid, shape, a, ranks, peer):
    L, C, H = shape
    name = f"{w5.params_of(shape) / 1e9:.2f}B ({L}L/{C}/{H}H)" + (f" on {ranks} GPUs" if ranks > 1 else "")
    B = a.batch
    return wl.Workload(wid, name, shape, a.budget_gib, B * a.seq * ranks, [(B, 1)], "fsdp2-offload",
                       [(B, 1, True)] if peer else [], 2.0 if peer else 0.0, ranks=ranks)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--tidal", default="build/tidal")
    ap.add_argument("--two-shape", type=w5.parse_shape, help="LxCxH for tidal-2gpu (default: plan --largest --nproc 2)")
    ap.add_argument("--one-shape", type=w5.parse_shape, help="LxCxH for tidal-1gpu (default: plan --largest)")
    ap.add_argument("--peer-shape", type=w5.parse_shape, default=(32, 4096, 32),
                    help="FSDP2's largest on the 2 GPUs (32x4096x32)")
    ap.add_argument("--width", type=int, default=4096, help="width for --largest (default 4096)")
    ap.add_argument("--heads", type=int, default=32, help="heads for --largest (default 32)")
    ap.add_argument("--host-ram", default="", help="host RAM for tidal (e.g. 250GiB; default: tidal's reading)")
    ap.add_argument("--budget-gib", type=float, default=24.0, help="GPU budget of each GPU (default 24)")
    ap.add_argument("--batch", type=int, default=16, help="micro-batch a rank (16 x 1024 = 16k tokens)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--tidal-args", default="")
    ap.add_argument("--tidal-backend", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the plumbing")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--workdir", default="out/bench-w10")
    ap.add_argument("--results", metavar="DIR", help="write the results file W10.json here (default bench/results/; "
                    "not with --smoke unless given)")
    ap.add_argument("--no-results", action="store_true", help="write no results file")
    ap.add_argument("--run-timeout", type=int, default=900)
    a = ap.parse_args(argv)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        ap.error(f"unknown row(s) {', '.join(bad) or '(none)'}: choose from {', '.join(ROWS)}")
    a.seq, a.quick, a.tidal_batch, a.peer_batch = 1024, True, "", ""
    if a.smoke:
        a.seq, a.batch, a.budget_gib = 64, 2, 0.25
        a.width, a.heads = 64, 2
        a.peer_shape = (2, 64, 2)
    os.makedirs(a.workdir, exist_ok=True)
    a.data = os.path.join(a.workdir, "random.tok")
    wl.write_token_file(a.data, max(2 * a.batch * a.seq * a.steps + 1, 1 << 20), seed=1337)
    info = wl.machine_info()
    wl.say(f"bench/w10.py: rows {', '.join(rows)}; machine {info.get('host')}, {info.get('cpus')} CPUs, "
           f"GPU {', '.join(info.get('gpus', ['none found']))}")
    results, shapes = [], {}
    for r in rows:
        if r == "tidal-2gpu":
            shape, ranks, peer = a.two_shape or largest(a, 2), 2, False
        elif r == "tidal-1gpu":
            shape, ranks, peer = a.one_shape or largest(a, 1), 1, False
        else:
            shape, ranks, peer = a.peer_shape, 2, True
        if shape is None:
            continue
        shapes[r] = {"shape": shape, "params": w5.params_of(shape)}
        extra = "--optim-state fp32" + (f" --host-ram {a.host_ram}" if a.host_ram else "")
        w = workload(f"W10-{r}", shape, a, ranks, peer)
        wl.say(f"\n== W10-{r}: {w.name}, GPU budget {a.budget_gib:g} GiB each, {w.tokens} tokens/step, tidal {extra}")
        row = w5.run_row(a, w, extra, peer)
        t = row["tidal"]
        if t.get("error"):
            wl.say(f"  tidal: not available ({t['error']})")
        else:
            wl.say(f"  tidal: {t['tokens_per_s']:.0f} tok/s, step {t['step_ms_median']:.1f} ms, peak "
                   f"{wl.gib(t['peak_bytes'])}")
        results.append(row)
    wl.print_table(results)
    figs = []
    two, one = shapes.get("tidal-2gpu"), shapes.get("tidal-1gpu")
    if two and one:
        wl.say(f"\nlargest on 2 GPUs {two['params'] / 1e9:.2f}B, on 1 GPU {one['params'] / 1e9:.2f}B: "
               f"{two['params'] / one['params']:.2f}x (target: at least 1)")
        figs.append(res.figure("largest model on 2 GPUs / on 1 GPU (parameters)", two["params"] / one["params"], "x"))
    for row in results:
        t, best = row["tidal"], (row.get("peer") or {}).get("best")
        if not t.get("tokens_per_s"):
            continue
        figs.append(res.figure(f"{row['w'].id} tidal tokens/s", t["tokens_per_s"], "tok/s"))
        figs.append(res.figure(f"{row['w'].id} model, trained", shapes[row["w"].id[len("W10-"):]]["params"], "params"))
        if row["w"].id == "W10-at-peer-max" and best and best.get("tokens_per_s"):
            r = t["tokens_per_s"] / best["tokens_per_s"]
            wl.say(f"at FSDP2's largest: tidal {t['tokens_per_s']:.0f} tok/s, FSDP2 {best['tokens_per_s']:.0f} tok/s: "
                   f"{r:.2f}x (target: at least 2)")
            figs.append(res.figure("tidal / FSDP2 CPU offload at FSDP2's largest, 2 GPUs", r, "x"))
    if not a.no_results and (a.results or not a.smoke):
        doc = wl.to_json(results, a)
        doc["shapes"] = shapes
        res.write_result("W10", "The largest model on 2 GPUs at 24 GiB each (fp32 AdamW state) beside 1 GPU of "
                         "the host, and tidal beside FSDP2 CPU offload at FSDP2's largest", figs, details=doc,
                         out_dir=a.results)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
