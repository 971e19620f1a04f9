#!/usr/bin/env python3
"""The disk tier on the GPU machine: W11a, W11b and the paper plans of docs/benchmarks.md, and a
scaled-down check of minutes.  Each part writes its figures into one JSON file, and each
part's results file bench/results/disk-tier-<part>.json (bench/results.py: the rates, the
tokens/s and the step's share of its bound, with the machine, the commit and the command;
not with --smoke or --tidal-backend cpu unless --results names a folder).

Parts (--parts, comma-separated, in this order):

  bench   `tidal bench disk DIR --bytes 16GiB --json`: the drive's direct write, read
          and mixed rates through the tier's own engine (io_uring and threads).
  check   the scaled-down check (a few minutes, a few GiB on disk): a GPT of
          --check-shape (default 24L/2048/16H, 1.3B) at --check-budget (8 GiB), every
          optimizer chunk on the CPU AdamW (--offload-optim-frac 1), --check-steps steps,
          first with all of its state in RAM, then with --host-ram set --check-disk-gib
          (4) below what the plan needs, so that much of the state lives in DIR.  It
          shows: the losses of the two runs equal bit for bit; the host's measured peak
          within --host-ram; the median step (after --warmup steps) against `tidal
          plan`'s disk-aware bound for the same flags (the lower of a plan before and one
          after the run): PASS at 85% or more.
  w11a    W11a: the 8.27B GPT (40L/4096/32H), fp32 state, 24 GiB, --host-ram 64GiB, the
          rest in DIR, at the grad accumulation `tidal plan` names (disk.hide_grad_accum;
          --w11a-accum N instead, or where that many micro-batches would take longer than
          --max-step-s, the most that do not, said in the notes): host peak <= 64 GiB and
          the step >= 85% of the bound, timed over --steps steps after --warmup.
          A step's time holds the previous step's CPU AdamW tail (its updates finish
          in the next forward), so the first step alone lacks one: with --steps 1
          --warmup 0 the timed step is step 1 plus its own updates' tail (the log's
          updates_tail_ms), more than a step of a longer run takes (conservative).
  w11b    W11b: the largest model the host trains at 24 GiB with its RAM (--host-ram,
          default: tidal's reading) plus DIR's free disk, int8 state: `tidal plan
          --largest --offload-dir DIR` at --w11b-width / --w11b-heads, then that shape
          trained for --w11b-steps optimizer steps (timed after the first, the warm-up).
  paper   `tidal plan --largest --disk-bytes 2TiB --host-ram 125GiB` (on paper: the
          sizes with fp32 and int8 state, at --paper-width/--paper-heads), with the same
          plan without a disk beside it.
  pg      equality with grads and params on disk too (minutes): a GPT of --pg-shape
          (default 12L/1024/16H) at --pg-budget (2 GiB), B2 x 2 micro-batches a step, every
          optimizer chunk on the CPU AdamW, at the least --host-ram whose plan fits with
          DIR (bisected over `tidal plan`: the whole state, then grads, then params on
          disk), on one GPU and, with --pg-nproc 2, on two (ZeRO-3): the losses equal those
          of the same run without the tier bit for bit, grads and params on disk, the
          host's peak within --host-ram.  No results file (no figure: PASS or FAIL).

Usage (GPU machine, repository root, after `make`; DIR on the local disk):
    python3 bench/disk_tier.py --dir /mnt/scratch/tidal --parts bench,check   # minutes
    python3 bench/disk_tier.py --dir /mnt/scratch/tidal --parts pg --pg-nproc 2   # minutes, 2 GPUs
    python3 bench/disk_tier.py --dir /mnt/scratch/tidal --parts w11a --w11a-accum 1
    python3 bench/disk_tier.py --dir /mnt/scratch/tidal --parts w11b,paper
    python3 bench/disk_tier.py --smoke --tidal-backend cpu --dir /tmp/x   # plumbing, no GPU
Results: --json (default out/bench-disk/disk_tier-<parts>.json), and bench/results/disk-tier-<part>.json.
"""
import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import workloads as wl  # noqa: E402

GIB = 1 << 30
PARTS = ["bench", "check", "w11a", "w11b", "paper", "pg"]
RESULT_PARTS = ["bench", "check", "w11a", "w11b", "paper"]  # pg: a check, no figure


PART_TITLES = {
    "bench": "the drive's direct write, read and mixed rates through the disk tier's engine",
    "check": "the disk tier's scaled-down check: state in RAM against state partly on disk",
    "w11a": "W11a: the 8.27B GPT, fp32 state, --host-ram 64GiB, the rest on local disk",
    "w11b": "W11b: the largest model on the host's RAM and free disk, int8 state",
    "paper": "the largest models `tidal plan` fits with 2 TiB of disk, on paper",
}


def part_figures(part, r):
    """The figures of one part's record for its results file (none where it failed)."""
    figs = []
    if not isinstance(r, dict) or r.get("error"):
        return figs
    if part == "bench":
        return wl.res.bench_figures(r.get("result") or {})
    if part == "paper":
        for tag, doc in r.items():
            for row in (doc or {}).get("largest") or []:
                if row.get("params"):
                    figs.append(wl.res.figure(f"{tag}, {row['optim_state']} state: the largest model "
                                              f"({row['layers']}L/{row['width']}/{row['heads']}H)", row["params"], "params"))
        return figs
    for key, name in (("timed_disk", "tokens/s, state partly on disk"), ("timed_ram", "tokens/s, state in RAM"),
                      ("timed", "tokens/s")):
        t = r.get(key)
        if isinstance(t, dict) and t.get("tokens_per_s_median"):
            figs.append(wl.res.figure(name, t["tokens_per_s_median"], "tok/s"))
    if r.get("bound_fraction"):
        figs.append(wl.res.figure("the lower bound / the step", 100 * r["bound_fraction"], "%"))
    t = r.get("timed")
    ram = r.get("host_ram_bytes")
    if isinstance(t, dict) and t.get("host_peak_bytes") and ram:
        figs.append(wl.res.figure("the host's peak / the host RAM given", 100 * t["host_peak_bytes"] / ram, "%"))
    if part == "w11b" and len(r.get("tokens_per_s") or []) > 1:
        figs.append(wl.res.figure("tokens/s (median after the first step)",
                                  statistics.median(r["tokens_per_s"][1:]), "tok/s"))
    return figs


def shape_flags(shape, vocab):
    L, C, H = shape
    return ["--layers", str(L), "--width", str(C), "--heads", str(H), "--vocab", str(vocab)]


def run_flags(a, shape, B, K, budget_gib, extra):
    f = ["--backend", a.tidal_backend, "--precision", "bf16" if a.tidal_backend == "cuda" else "fp32",
         "--data", a.data] + shape_flags(shape, a.vocab) + [
        "--seq", str(a.seq), "--micro-batch", str(B), "--grad-accum", str(K), "--lr", "1e-4",
        "--schedule", "constant", "--warmup", "0", "--clip-grad-norm", f"{a.clip:g}", "--seed", "1337",
        "--gpu-budget", f"{budget_gib:g}GiB"]
    return f + extra + shlex.split(a.tidal_args)


def plan(a, flags, tag, timeout=900):
    path = os.path.join(a.workdir, f"plan-{tag}.out")
    rc, _, _ = wl.run_logged([a.tidal, "plan"] + flags + ["--json"], path, timeout)
    doc = wl.last_json(path)
    if doc is None or rc not in (0, 3):
        raise RuntimeError(f"tidal plan ({tag}) failed, exit {rc}: {wl.tail(path, 3)}")
    doc["_exit"] = rc
    return doc


def train(a, flags, steps, tag, timeout):
    """A tidal train run with its JSON-lines log: its steps, exit status and output's tail."""
    log = os.path.join(a.workdir, f"train-{tag}.jsonl")
    out = os.path.join(a.workdir, f"train-{tag}.out")
    if os.path.exists(log):
        os.remove(log)
    cmd = [a.tidal, "train"] + flags + ["--steps", str(steps), "--log", log, "--log-every", "1"]
    rc, smi, secs = wl.run_logged(cmd, out, timeout)
    rows = wl.read_jsonl(log)
    return {"command": " ".join(shlex.quote(c) for c in cmd), "exit": rc, "seconds": secs, "smi_bytes": smi,
            "steps": rows, "output_tail": wl.tail(out, 6), "output": out}


def step_ms(run, r):
    """A step's time as a step of a longer run takes it.  A step's CPU AdamW
    updates finish in the next step's forward, so a step's time holds the
    tail of the one before; the run's first step has none.  When it is also
    the last (a one-step run), its own tail (updates_tail_ms, the run's last
    record) is added: more than a step of a longer run takes."""
    if len(run["steps"]) == 1 and r is run["steps"][0]:
        return r["step_ms"] + r.get("updates_tail_ms", 0)
    return r["step_ms"]


def timed(a, run):
    rows = [r for r in run["steps"] if r.get("step", 0) > a.warmup]
    if not rows:
        return None
    ms = [step_ms(run, r) for r in rows]
    tokens = [r["tokens_per_s"] * r["step_ms"] / 1e3 for r in rows]
    disk_r = [r.get("memmgr", {}).get("disk_read_bytes", 0) for r in rows]
    disk_w = [r.get("memmgr", {}).get("disk_write_bytes", 0) for r in rows]
    return {"step_ms_median": statistics.median(ms),
            "tokens_per_s_median": statistics.median(n / (m / 1e3) for n, m in zip(tokens, ms)),
            "timed_steps": len(rows),
            "updates_tail_added": len(run["steps"]) == 1 and "updates_tail_ms" in rows[0],
            # every timed step's time holds a CPU AdamW tail, the one before's or (one step) its own
            "holds_adam_tail": all(r is not run["steps"][0] or (len(run["steps"]) == 1 and "updates_tail_ms" in r)
                                   for r in rows),
            "updates_tail_ms": run["steps"][-1].get("updates_tail_ms"),
            "host_peak_bytes": max(r.get("host", {}).get("peak_bytes", 0) for r in run["steps"]),
            "device_peak_bytes": max(r.get("device_peak_bytes", 0) for r in run["steps"]),
            "disk_read_bytes_median": statistics.median(disk_r), "disk_write_bytes_median": statistics.median(disk_w),
            "disk_wait_ms_median": statistics.median(r.get("memmgr", {}).get("disk_wait_ms", 0) for r in rows),
            "adam_wait_ms_median": statistics.median(r.get("adam_wait_ms", 0) for r in rows)}


def bound_of(before, after):
    b = before["estimate"]["step_lower_bound_ms"]
    if after and after["estimate"]["step_lower_bound_ms"] < b:
        return after["estimate"]["step_lower_bound_ms"], "after"
    return b, "before"


def part_bench(a):
    path = os.path.join(a.workdir, "bench-disk.out")
    rc, _, _ = wl.run_logged([a.tidal, "bench", "disk", a.dir, "--bytes", a.bench_bytes, "--json"], path, 1200)
    doc = wl.last_json(path)
    wl.say(f"bench disk {a.dir}: " + (json.dumps(doc.get("results")) if doc else f"failed (exit {rc}): "
                                       f"{wl.tail(path, 3)}"))
    return {"exit": rc, "result": doc}


def host_cap_for(a, flags, disk_bytes):
    """--host-ram that leaves disk_bytes of the CPU AdamW's state out of RAM: the plan's host bytes less that."""
    p = plan(a, flags + ["--no-measure"], "check-all-in-ram")
    state = p["host"]["pageable_optimizer_bytes"]
    want = min(disk_bytes, int(state * 0.5))
    return p["host"]["total_bytes"] - want, p


def part_check(a):
    shape, B = a.check_shape, a.check_batch
    base = run_flags(a, shape, B, 1, a.check_budget, ["--offload-optim-frac", "1"])
    ram, p0 = host_cap_for(a, base, int(a.check_disk_gib * GIB))
    disk_flags = base + ["--offload-dir", a.dir, "--host-ram", str(ram)]
    res = {"shape": shape, "batch": B, "budget_gib": a.check_budget, "host_ram_bytes": ram,
           "all_in_ram_host_bytes": p0["host"]["total_bytes"]}
    before = plan(a, disk_flags, "check-before")
    res["plan_before"] = before
    wl.say(f"check: {shape}, B{B}, --host-ram {ram / GIB:.2f} GiB: {before['disk']['chunks']} of "
           f"{before['optimizer']['chunks']} optimizer chunks ({before['disk']['bytes'] / GIB:.2f} GiB) on disk; bound "
           f"{before['estimate']['step_lower_bound_ms']:.0f} ms (disk {before['disk']['disk_ms']:.0f} ms)")
    ref = train(a, base, a.check_steps, "check-ram", a.run_timeout)
    dsk = train(a, disk_flags, a.check_steps, "check-disk", a.run_timeout)
    after = None
    try:
        after = plan(a, disk_flags, "check-after")
    except RuntimeError as e:
        res["plan_after_error"] = str(e)
    res["plan_after"] = after
    res["ram_run"], res["disk_run"] = ref, dsk
    if ref["exit"] or dsk["exit"]:
        res["error"] = f"a run failed: in RAM exit {ref['exit']} ({ref['output_tail']}); with the disk exit " \
                       f"{dsk['exit']} ({dsk['output_tail']})"
        wl.say("check: " + res["error"])
        return res
    la = [r["loss"] for r in ref["steps"]]
    lb = [r["loss"] for r in dsk["steps"]]
    res["losses_ram"], res["losses_disk"] = la, lb
    res["losses_equal"] = len(la) == len(lb) == a.check_steps and all(x == y for x, y in zip(la, lb))
    t = timed(a, dsk)
    res["timed_disk"], res["timed_ram"] = t, timed(a, ref)
    bound, src = bound_of(before, after)
    res["bound_ms"], res["bound_from"] = bound, src
    res["bound_fraction"] = bound / t["step_ms_median"] if t and t["step_ms_median"] > 0 else None
    res["host_peak_within"] = t is not None and t["host_peak_bytes"] <= ram
    res["pass"] = bool(res["losses_equal"] and res["host_peak_within"] and (res["bound_fraction"] or 0) >= 0.85
                       and t and t["holds_adam_tail"])
    wl.say(f"check: losses equal {res['losses_equal']}; step {t['step_ms_median']:.0f} ms (in RAM "
           f"{res['timed_ram']['step_ms_median']:.0f} ms), bound {bound:.0f} ms ({src}): "
           f"{100 * res['bound_fraction']:.1f}% of the bound; host peak {t['host_peak_bytes'] / GIB:.2f} GiB of "
           f"{ram / GIB:.2f}; disk {t['disk_read_bytes_median'] / GIB:.2f} GiB read, "
           f"{t['disk_write_bytes_median'] / GIB:.2f} GiB written a step -> {'PASS' if res['pass'] else 'FAIL'}")
    return res


def least_ram(a, flags, tag):
    """The least --host-ram (to 1%) whose plan of flags with DIR fits the host, and that plan."""
    p = plan(a, flags + ["--no-measure"], f"{tag}-all-in-ram")
    hi, lo = p["host"]["total_bytes"] * a.pg_nproc, 0
    best = None
    while hi - lo > max(hi // 100, 1 << 20):
        mid = (lo + hi) // 2
        q = plan(a, flags + ["--no-measure", "--offload-dir", a.dir, "--host-ram", str(mid)], f"{tag}-ram")
        if q["host"].get("fits"):
            hi, best = mid, q
        else:
            lo = mid
    if best is None:
        best = plan(a, flags + ["--no-measure", "--offload-dir", a.dir, "--host-ram", str(hi)], f"{tag}-ram")
    return hi, best


def part_pg(a):
    res = {}
    for n in sorted({1, a.pg_nproc}):
        tag = f"pg-{n}"
        base = run_flags(a, a.pg_shape, a.pg_batch, 2, a.pg_budget, ["--offload-optim-frac", "1", "--nproc", str(n)])
        old, a.pg_nproc = a.pg_nproc, n
        try:
            ram, p = least_ram(a, base, tag)
        finally:
            a.pg_nproc = old
        d = p.get("disk", {})
        r = {"nproc": n, "host_ram_bytes": ram, "disk_chunks": d.get("chunks"), "grad_chunks": d.get("grad_chunks"),
             "param_chunks": d.get("param_chunks"), "plan": p}
        wl.say(f"pg, {n} rank(s): --host-ram {ram / GIB:.2f} GiB: {d.get('chunks')} optimizer, {d.get('grad_chunks')} "
               f"grad, {d.get('param_chunks')} param chunks on disk ({d.get('bytes', 0) / GIB:.2f} GiB)")
        ref = train(a, base, a.pg_steps, f"{tag}-ram", a.run_timeout)
        dsk = train(a, base + ["--offload-dir", a.dir, "--host-ram", str(ram)], a.pg_steps, f"{tag}-disk",
                    a.run_timeout)
        r["ram_run"], r["disk_run"] = ref, dsk
        if ref["exit"] or dsk["exit"]:
            r["error"] = f"a run failed: in RAM exit {ref['exit']} ({ref['output_tail']}); with the disk exit " \
                         f"{dsk['exit']} ({dsk['output_tail']})"
            r["pass"] = False
            wl.say(f"pg, {n} rank(s): " + r["error"])
            res[tag] = r
            continue
        la = [x["loss"] for x in ref["steps"]]
        lb = [x["loss"] for x in dsk["steps"]]
        r["losses_ram"], r["losses_disk"] = la, lb
        r["losses_equal"] = len(la) == len(lb) == a.pg_steps and all(x == y for x, y in zip(la, lb))
        peak = max((x.get("host", {}).get("peak_bytes", 0) for x in dsk["steps"]), default=0)
        written = max((x.get("memmgr", {}).get("disk_write_bytes", 0) for x in dsk["steps"]), default=0)
        r["host_peak_bytes"], r["disk_write_bytes_max"] = peak, written
        r["host_peak_within"] = peak <= ram / n  # the log is rank 0's; each rank plans against its share
        r["pass"] = bool(r["losses_equal"] and r["host_peak_within"] and (d.get("grad_chunks") or 0) > 0
                         and (d.get("param_chunks") or 0) > 0 and written > 0)
        wl.say(f"pg, {n} rank(s): losses equal {r['losses_equal']}; host peak {peak / GIB:.2f} GiB of "
               f"{ram / n / GIB:.2f} a rank; at most {written / GIB:.2f} GiB written a step -> "
               f"{'PASS' if r['pass'] else 'FAIL'}")
        res[tag] = r
    res["pass"] = all(v.get("pass") for v in res.values() if isinstance(v, dict))
    return res


def part_w11a(a):
    shape, B = (40, 4096, 32), a.batch
    base = lambda K: run_flags(a, shape, B, K, 24, ["--host-ram", "64GiB", "--offload-dir", a.dir])  # noqa: E731
    p1 = plan(a, base(1), "w11a-K1")
    K = a.w11a_accum or p1["disk"].get("hide_grad_accum") or 1
    res = {"shape": shape, "batch": B, "plan_K1": p1, "plan_named_accum": p1["disk"].get("hide_grad_accum")}
    # Micro-batches of this plan take about its compute per micro-batch; keep a step under --max-step-s.
    per_mb = p1["estimate"]["compute_ms"]
    if not a.w11a_accum and per_mb > 0 and (K * per_mb + p1["disk"]["disk_ms"]) / 1e3 > a.max_step_s:
        K2 = max(1, int((a.max_step_s * 1e3 - p1["disk"]["disk_ms"]) / per_mb))
        res["note"] = (f"the plan names --grad-accum {K}; a step there takes about {(K * per_mb + p1['disk']['disk_ms']) / 1e3:.0f} s, "
                       f"over --max-step-s {a.max_step_s:g}: run at {K2}")
        K = K2
    res["grad_accum"] = K
    before = plan(a, base(K), f"w11a-K{K}")
    wl.say(f"w11a: 8.27B, B{B} x K{K}: {before['disk']['chunks']} of {before['optimizer']['chunks']} chunks on disk "
           f"({before['disk']['bytes'] / GIB:.1f} GiB), bound {before['estimate']['step_lower_bound_ms'] / 1e3:.1f} s")
    run = train(a, base(K), a.steps, f"w11a-K{K}", a.run_timeout)
    after = None
    try:
        after = plan(a, base(K), f"w11a-K{K}-after")
    except RuntimeError as e:
        res["plan_after_error"] = str(e)
    res.update(plan_before=before, plan_after=after, run=run)
    if run["exit"]:
        res["error"] = f"exit {run['exit']}: {run['output_tail']}"
        wl.say("w11a: " + res["error"])
        return res
    t = timed(a, run)
    bound, src = bound_of(before, after)
    res.update(timed=t, bound_ms=bound, bound_from=src)
    res["bound_fraction"] = bound / t["step_ms_median"] if t else None
    res["host_ram_bytes"] = 64 * GIB
    res["host_peak_within"] = t is not None and t["host_peak_bytes"] <= 64 * GIB
    res["pass"] = bool(res["host_peak_within"] and (res["bound_fraction"] or 0) >= 0.85 and t and t["holds_adam_tail"])
    if t and not t["holds_adam_tail"]:
        res["note_timing"] = ("the run's first step is timed without the tail of its CPU AdamW updates (warm-up 0 "
                              "with more steps, or a tidal without updates_tail_ms): not a step's time; no PASS")
    wl.say(f"w11a: step {t['step_ms_median'] / 1e3:.1f} s, {t['tokens_per_s_median']:.0f} tok/s, bound "
           f"{bound / 1e3:.1f} s ({src}): {100 * res['bound_fraction']:.1f}%; host peak "
           f"{t['host_peak_bytes'] / GIB:.1f} GiB (<= 64) -> {'PASS' if res['pass'] else 'FAIL'}")
    return res


def largest(a, width, heads, extra, tag):
    flags = ["--backend", a.tidal_backend, "--precision", "bf16" if a.tidal_backend == "cuda" else "fp32",
             "--width", str(width), "--heads", str(heads), "--seq", str(a.seq), "--micro-batch", str(a.batch),
             "--vocab", str(a.vocab), "--gpu-budget", "24GiB" if not a.smoke else "64MiB", "--largest"] + extra
    path = os.path.join(a.workdir, f"largest-{tag}.out")
    rc, _, _ = wl.run_logged([a.tidal, "plan"] + flags + ["--json"], path, 1800)
    doc = wl.last_json(path)
    if doc is None:
        raise RuntimeError(f"tidal plan --largest ({tag}) failed, exit {rc}: {wl.tail(path, 3)}")
    return doc


def part_w11b(a):
    extra = ["--offload-dir", a.dir] + (["--host-ram", a.host_ram] if a.host_ram else [])
    doc = largest(a, a.w11b_width, a.w11b_heads, extra, "w11b")
    row = next((r for r in doc["largest"] if r["optim_state"] == "int8"), None)
    res = {"largest": doc}
    if not row or not row.get("layers"):
        res["error"] = "no int8 shape fits"
        return res
    shape = (row["layers"], a.w11b_width, a.w11b_heads)
    res.update(shape=shape, params=row["params"], disk_bytes=row.get("disk_bytes"))
    wl.say(f"w11b: the largest with int8 state: {row['layers']}L/{a.w11b_width}/{a.w11b_heads}H, "
           f"{row['params'] / 1e9:.2f}B params, host {row['host_bytes'] / GIB:.1f} GiB, disk {row.get('disk_bytes', 0) / GIB:.1f} GiB")
    flags = run_flags(a, shape, a.batch, 1, 24 if not a.smoke else 0.0625,
                      ["--optim-state", "int8"] + extra)
    run = train(a, flags, a.w11b_steps + 1, "w11b", a.run_timeout)
    res["run"] = run
    if run["exit"]:
        res["error"] = f"exit {run['exit']}: {run['output_tail']}"
        wl.say("w11b: " + res["error"])
        return res
    rows = [r for r in run["steps"] if r.get("step", 0) > 1]
    res["step_ms"] = [r["step_ms"] for r in rows]
    res["tokens_per_s"] = [r["tokens_per_s"] for r in rows]
    res["host_peak_bytes"] = max(r.get("host", {}).get("peak_bytes", 0) for r in run["steps"])
    wl.say(f"w11b: {len(rows)} optimizer steps after the warm-up: " +
           ", ".join(f"{ms / 1e3:.1f} s" for ms in res["step_ms"]) +
           f"; {statistics.median(res['tokens_per_s']) if rows else 0:.0f} tok/s")
    return res


def part_paper(a):
    res = {}
    for tag, extra in (("ram-only", ["--host-ram", "125GiB"]), ("disk-2TiB", ["--host-ram", "125GiB", "--disk-bytes", "2TiB"])):
        doc = largest(a, a.paper_width, a.paper_heads, extra, f"paper-{tag}")
        res[tag] = doc
        for r in doc["largest"]:
            wl.say(f"paper {tag}: --optim-state {r['optim_state']}: {r['layers']}L/{r['width']}/{r['heads']}H, "
                   f"{r['params'] / 1e9:.1f}B params, host {r['host_bytes'] / GIB:.1f} GiB, disk "
                   f"{r.get('disk_bytes', 0) / GIB:.1f} GiB")
    return res


def parse_shape(s):
    parts = s.lower().replace("/", "x").split("x")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"shape '{s}': use LAYERSxWIDTHxHEADS")
    return tuple(int(x) for x in parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a directory on the local disk for the tier's scratch file")
    ap.add_argument("--parts", default="bench,check", help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--tidal", default="build/tidal")
    ap.add_argument("--tidal-backend", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tidal-args", default="")
    ap.add_argument("--host-ram", default="", help="W11b's host RAM (default: tidal's reading)")
    ap.add_argument("--bench-bytes", default="16GiB")
    ap.add_argument("--check-shape", type=parse_shape, default=(24, 2048, 16))
    ap.add_argument("--check-batch", type=int, default=8)
    ap.add_argument("--check-budget", type=float, default=8.0, help="GiB")
    ap.add_argument("--check-disk-gib", type=float, default=4.0)
    ap.add_argument("--check-steps", type=int, default=8)
    ap.add_argument("--pg-shape", type=parse_shape, default=(12, 1024, 16))
    ap.add_argument("--pg-batch", type=int, default=2)
    ap.add_argument("--pg-budget", type=float, default=2.0, help="GiB")
    ap.add_argument("--pg-steps", type=int, default=4)
    ap.add_argument("--pg-nproc", type=int, default=1, help="also on this many GPUs (ZeRO-3)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4, help="W11a: steps, of which --warmup are not timed")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--w11a-accum", type=int, default=0, help="W11a's grad accumulation (default: the plan's)")
    ap.add_argument("--max-step-s", type=float, default=300.0)
    ap.add_argument("--w11b-width", type=int, default=6144)
    ap.add_argument("--w11b-heads", type=int, default=48)
    ap.add_argument("--w11b-steps", type=int, default=2)
    ap.add_argument("--paper-width", type=int, default=8192)
    ap.add_argument("--paper-heads", type=int, default=64)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the given backend: the plumbing")
    ap.add_argument("--workdir", default="out/bench-disk")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--results", metavar="DIR", help="results files here (default bench/results/, not with --smoke)")
    ap.add_argument("--no-results", action="store_true", help="write no results file")
    ap.add_argument("--run-timeout", type=int, default=1800)
    a = ap.parse_args(argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        ap.error(f"unknown part(s) {', '.join(bad) or '(none)'}: choose from {', '.join(PARTS)}")
    a.seq, a.vocab, token_range = 1024, wl.VOCAB, wl.TOKEN_RANGE
    if a.smoke:
        a.seq, a.batch, a.check_batch, a.check_budget, a.vocab, token_range = 64, 2, 2, 0.25, 512, 500
        a.check_shape, a.check_disk_gib, a.bench_bytes = (8, 128, 4), 0.012, "16MiB"
        a.pg_shape, a.pg_batch, a.pg_budget, a.pg_steps = (4, 192, 4), 2, 0.0625, 3
        a.w11b_width, a.w11b_heads, a.paper_width, a.paper_heads = 64, 2, 64, 2
        a.check_steps, a.steps, a.warmup, a.w11b_steps = 4, 3, 1, 2
        a.host_ram = a.host_ram or "200MiB"
    os.makedirs(a.workdir, exist_ok=True)
    os.makedirs(a.dir, exist_ok=True)
    a.data = os.path.join(a.workdir, "random.tok")
    wl.write_token_file(a.data, max(a.batch * a.seq * 64 + 1, 1 << 22), seed=1337, vocab=a.vocab, token_range=token_range,
                        eot=min(wl.EOT, a.vocab - 1))
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": wl.machine_info(),
           "dir": a.dir, "parts": parts, "args": vars(a)}
    fns = {"bench": part_bench, "check": part_check, "w11a": part_w11a, "w11b": part_w11b, "paper": part_paper, "pg": part_pg}
    for p in parts:
        wl.say(f"== {p}")
        try:
            out[p] = fns[p](a)
        except (RuntimeError, KeyError, TypeError) as e:
            out[p] = {"error": f"{type(e).__name__}: {e}"}
            wl.say(f"{p}: {out[p]['error']}")
    path = a.json or os.path.join(a.workdir, f"disk_tier-{'-'.join(parts)}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    wl.say(f"all of it: {path}")
    if a.no_results:
        a.results = None
    elif a.results is None and not a.smoke and a.tidal_backend == "cuda":
        a.results = wl.res.RESULTS_DIR
    if a.results:
        for p in [p for p in parts if p in RESULT_PARTS]:
            wl.res.write_result(f"disk-tier-{p}", PART_TITLES[p], part_figures(p, out[p]),
                                details=json.loads(json.dumps(out[p], default=str)), out_dir=a.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
