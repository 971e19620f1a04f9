#!/usr/bin/env python3
"""LoRA on the GPU machine: W12 of docs/benchmarks.md beside peft, and the largest base LoRA fine-tunes.

Both parts train LoRA rank 16, alpha 32, on every linear module of a LLaMA
block (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), the
base frozen in bf16, on random tokens over Llama 3's whole vocabulary
(128256 ids, uint32; bench/workloads.py's token file), lr 1e-4 constant.

Parts (--parts, comma separated, in this order):

  w12      W12: the llama-3.1-8b shape at --gpu-budget 24GiB, 16k tokens a
           step, bf16: `tidal train --model llama-3.1-8b --lora-rank 16
           --lora-alpha 32 --lora-targets ...`, every micro-batch of 16x1,
           8x2, 4x4 that `tidal plan` fits (the fastest counts; --quick:
           the first), beside bench/peers/peft_lora.py: peft's LoraConfig on
           transformers' LlamaForCausalLM (built on the meta device, bf16
           weights materialised and initialised on the GPU, gradient
           checkpointing, autocast bf16, AdamW(fused=True) over the
           adapters), no budget, the same GPU and 16k tokens a step (16x1,
           or 8x2, 4x4 where 16x1 runs out of memory), one process after the
           other.  tokens/s: the median of steps 4-8 of 8 for both.  Target:
           tidal at least 1.5x peft.  About 3-4 minutes on an H200.
  largest  The largest base that LoRA fine-tunes at a 24 GiB GPU budget on a
           host of --host-ram (125GiB): `tidal plan --largest` with the LoRA
           flags at --width/--heads/--kv-heads/--mlp (Llama 3.1 70B's block:
           8192 wide, 64 heads, 8 key/value heads, MLP 28672), micro-batch
           of --largest-batch (4, then 2: at 16 the activations of 8192-wide
           blocks leave the chunks no room), the most layers of its rows (the
           adapters' AdamW state, fp32, bf16 or int8, is a few hundred MiB
           either way), and the EDGE counts above it checked with `tidal plan`
           (its search may stop below a fitting count: the device's need
           goes up and down by a layer's parity); then that shape trained
           for --largest-steps steps (3; the first untimed) at
           --largest-batch x --largest-accum (4 x 4: 16k tokens a step) with
           --host-ram, recording its parameters, tokens/s, the step against
           the lower bound of `tidal plan` for the same flags, the set-up's
           seconds (tidal initialises the base on the host: a 50B bf16 base
           is some 100 GiB of pinned pages, written by every core) and the
           host's measured peaks (--log: host.peak_bytes, itemized, and
           host.rss_peak_bytes, the process's resident peak) against
           --host-ram.  Target: at least 50B.  With --dir DIR the plan and
           the run may put state in DIR (--offload-dir).  About 3-5 minutes
           on a host of 2 H200s, 256 GiB and 32 cores, mostly the set-up and
           three steps that stream the base over PCIe twice a micro-batch.

Results: bench/results/W12.json and bench/results/lora-largest.json
(bench/results.py: the figures with the machine, the date, the commit and the
command; not with --smoke or --tidal-backend cpu unless --results names a
folder), and every figure and log in --json (default
out/bench-lora/lora-<parts>.json) and --workdir.

Usage (GPU machine, repository root, after `make`):
    python3 bench/lora.py --parts w12                        # one H200, ~4 minutes
    python3 bench/lora.py --parts largest --host-ram 125GiB  # a 256 GiB host of 2 H200s, ~5 minutes
    python3 bench/lora.py --smoke --tidal-backend cpu        # plumbing, no GPU: ~1 minute
Without PyTorch, transformers or peft the peer reports itself not available
(exit 2 of bench/peers/peft_lora.py) and tidal's figures stand alone.
"""
import argparse
import copy
import datetime
import json
import math
import os
import re
import shlex
import signal
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results as res  # noqa: E402
import workloads as wl  # noqa: E402

GIB = 1 << 30
PARTS = ["w12", "largest"]
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
LLAMA8B = wl.LlamaShape("llama-3.1-8b", 8, 14336, 128256, 128001)  # fp32 AdamW state for the adapters
EDGE = 4             # counts above plan --largest's answer checked with plan (trainer/largest.c's EDGE_LAYERS)
TARGET_PARAMS = 50e9  # the largest part's target: a base of at least 50B


class LoraWorkload(wl.Workload):
    """W12: a LLaMA workload whose peer is peft's LoRA (bench/peers/peft_lora.py)."""

    @property
    def peer_script(self):
        return os.path.join(wl.PEER_DIR, "peft_lora.py")


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def loss_problem(x):
    """Why a loss of these runs is wrong, or None.  On random ids over the whole vocabulary, from N(0, 0.02)
    weights, the loss starts at about ln(vocab) (11.76) and stays near it; a base whose weights are not what the
    init draws (e.g. written in the wrong precision) gives another loss, or none that is finite."""
    want = math.log(LLAMA8B.vocab)
    if not finite(x):
        return f"the loss is {x}"
    if abs(x - want) > 0.25 * want:
        return f"the loss is {x:.3f}, far from the {want:.2f} (ln {LLAMA8B.vocab}) that random ids give"
    return None


def lora_flags(a):
    return ["--lora-rank", str(a.lora_rank), "--lora-alpha", f"{a.lora_alpha:g}", "--lora-targets", TARGETS]


def tok_name(a):
    return os.path.join(a.workdir, f"random-v{LLAMA8B.vocab}.tok")


# ---- W12 -------------------------------------------------------------------------------------------

def w12_workload(a):
    cands = [(16, 1), (8, 2), (4, 4)]
    if a.smoke:
        return LoraWorkload("W12", "smoke 2L/128/2H llama-3.1-8b", (2, 128, 2), a.budget_gib, 2 * a.seq, cands,
                            "peft-lora", [(b, k, True) for b, k in cands], 1.5, llama=LLAMA8B.shrunk())
    return LoraWorkload("W12", "llama-3.1-8b (32L/4096/32H, 8 KV heads, MLP 14336, vocab 128256)", (32, 4096, 32),
                        a.budget_gib, 16 * 1024, cands, "peft-lora", [(b, k, True) for b, k in cands], 1.5,
                        llama=LLAMA8B)


def part_w12(a):
    w = w12_workload(a)
    w.data = tok_name(a)
    w.peer_args = lora_flags(a)  # bench/peers/peft_lora.py takes tidal's LoRA flags
    b = copy.copy(a)
    b.tidal_args = " ".join([shlex.quote(x) for x in lora_flags(a)] + ([a.tidal_args] if a.tidal_args else []))
    wl.say(f"W12: {w.name}, GPU budget {w.budget_gib:g} GiB for tidal (none for the peer), {w.tokens} tokens a step; "
           f"LoRA rank {a.lora_rank}, alpha {a.lora_alpha:g} on {TARGETS}")
    t = wl.guarded(wl.run_tidal, b, w, {"system": "tidal", "tried": []})
    if not t.get("error") and loss_problem(t.get("loss_last")):
        t["error"] = f"the last step: {loss_problem(t.get('loss_last'))}; no figure is recorded"
    wl.say_tidal(t, "")
    wp = copy.copy(w)
    wp.budget_gib = None  # the peer runs without one: its first micro-batch that runs is its figure
    if a.tidal_only:
        p = {"system": wl.PEER_NAMES[w.peer_mode], "error": "not run (--tidal-only)", "tried": [], "best": None}
    else:
        p = wl.guarded(wl.run_peer, b, wp, {"system": wl.PEER_NAMES[w.peer_mode], "tried": [], "best": None})
    row = {"w": w, "tidal": t, "peer": p}
    wl.print_table([row])
    doc = wl.to_json([row], b)["workloads"][0]
    doc["lora"] = {"rank": a.lora_rank, "alpha": a.lora_alpha, "targets": TARGETS.split(",")}
    doc["peer_budget"] = None
    return row, doc


def w12_figures(row):
    w, t, p = row["w"], row["tidal"], row["peer"]
    figs, best = [], p.get("best")
    ok_t = not t.get("error") and t.get("tokens_per_s")
    if ok_t:
        figs.append(res.figure("tidal tokens/s", t["tokens_per_s"], "tok/s"))
    if best:
        figs.append(res.figure(f"{p['system']} tokens/s", best["tokens_per_s"], "tok/s"))
    ratio, _ = wl.verdict(w, t, p)
    if ratio is not None:
        figs.append(res.figure(f"tidal / {p['system']}", ratio, "x"))
    if ok_t and t.get("plan") and t.get("step_ms_median"):
        figs.append(res.figure("tidal's lower bound / its step",
                               100 * t["plan"]["estimate"]["step_lower_bound_ms"] / t["step_ms_median"], "%"))
    if ok_t and t.get("budget_bytes") and t.get("peak_bytes"):
        figs.append(res.figure("tidal's device peak (arena) / its GPU budget", 100 * t["peak_bytes"] / t["budget_bytes"],
                               "%"))
    return figs


def w12_title(row, a):
    w, t, p = row["w"], row["tidal"], row["peer"]
    tid = "" if t.get("error") else f" (B{t['batch']}x{t['grad_accum']})"
    b = p.get("best")
    peer = (f"beside peft on transformers (bf16 base, no budget, B{b['batch']}x{b['grad_accum']}"
            f"{' with checkpointing' if b.get('ckpt') else ''})" if b else "alone (the peft peer did not run)")
    return (f"LoRA rank {a.lora_rank}, alpha {a.lora_alpha:g}, on every linear module of the {w.name} shape, "
            f"{wl.tok_step(w.tokens)} tokens a step: tidal at a {w.budget_gib:g} GiB GPU budget{tid} {peer}")


# ---- the largest base ------------------------------------------------------------------------------

def largest_flags(a, layers=None, state=None, accum=1):
    f = ["--backend", a.tidal_backend, "--precision", "bf16" if a.tidal_backend == "cuda" else "fp32",
         "--model", LLAMA8B.preset]
    if layers is not None:
        f += ["--layers", str(layers)]
    f += ["--width", str(a.width), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads), "--mlp-width", str(a.mlp),
          "--vocab", str(LLAMA8B.vocab), "--seq", str(a.seq), "--micro-batch", str(a.largest_batch),
          "--grad-accum", str(accum), "--gpu-budget", f"{a.budget_gib:g}GiB", "--host-ram", a.host_ram]
    if state:
        f += ["--optim-state", state]
    f += lora_flags(a)
    if a.dir:
        f += ["--offload-dir", a.dir]
    return f + shlex.split(a.tidal_args)


def plan_json(a, flags, tag, timeout=600):
    """`tidal plan FLAGS --json`'s object (exit 0: fits, 3: does not), or RuntimeError."""
    path = os.path.join(a.workdir, f"plan-{tag}.out")
    rc, _, _ = wl.run_logged([a.tidal, "plan"] + flags + ["--json"], path, timeout)
    doc = wl.last_json(path)
    if doc is None or rc not in (0, 3):
        raise RuntimeError(f"tidal plan ({tag}) failed, exit {rc}: {wl.tail(path, 3)}")
    return doc


def setup_seconds(out_path):
    """tidal train's "set up in S s (...)" line: (seconds, the breakdown), or (None, None)."""
    try:
        with open(out_path, errors="replace") as f:
            for ln in f:
                m = re.search(r"set up in ([0-9.]+) s(?: \((.*)\))?", ln)
                if m:
                    return float(m.group(1)), m.group(2)
    except OSError:
        pass
    return None, None


def part_largest(a):
    r = {"host_ram": a.host_ram, "budget_gib": a.budget_gib, "micro_batch": a.largest_batch,
         "grad_accum": a.largest_accum, "width": a.width, "heads": a.heads, "kv_heads": a.kv_heads, "mlp": a.mlp,
         "lora": {"rank": a.lora_rank, "alpha": a.lora_alpha, "targets": TARGETS.split(",")}, "dir": a.dir or None}
    t0 = time.perf_counter()
    r["plan_largest"], best = {}, None
    for B in a.largest_batches:  # the largest micro-batch first: on a tie it is taken
        a.largest_batch = B
        doc = plan_json(a, largest_flags(a) + ["--largest"], f"largest-B{B}")
        r["plan_largest"][f"B{B}"] = doc
        for x in doc.get("largest", []):
            wl.say(f"largest: plan --largest at micro-batch {B}, --optim-state {x['optim_state']}: {x['layers']} "
                   f"layers, {x['params'] / 1e9:.2f}B params, host {x['host_bytes'] / GIB:.1f} GiB "
                   f"({x['pinned_bytes'] / GIB:.1f} GiB pinned)")
            if x.get("layers") and (best is None or (x["layers"], x["optim_state"] == "fp32") >
                                    (best[1]["layers"], best[1]["optim_state"] == "fp32")):
                best = (B, x)
    if best is None:
        r["error"] = (f"`tidal plan --largest` fits no layer count at {a.width} wide and micro-batch "
                      f"{', '.join(map(str, a.largest_batches))}")
        wl.say("largest: " + r["error"])
        return r
    a.largest_batch, state, L = best[0], best[1]["optim_state"], best[1]["layers"]
    r["micro_batch"], r["plan_largest_layers"], r["optim_state"] = a.largest_batch, L, state
    # The counts just above: the search descends from the host's bound and may stop below a count that fits.
    for n in range(L + 1, L + EDGE + 1):
        p = plan_json(a, largest_flags(a, n, state, a.largest_accum) + ["--no-measure"], f"edge-{n}")
        fits = p["device"]["fits"] and p["host"]["fits"]
        wl.say(f"largest: {n} layers, --optim-state {state}: {'fits' if fits else 'does not fit'} "
               f"(device {p['device']['min_bytes'] / GIB:.1f} GiB needed, host {p['host']['total_bytes'] / GIB:.1f} "
               f"GiB, {p['host']['pinned_bytes'] / GIB:.1f} GiB pinned)")
        if fits:
            L = n
    r["layers"] = L
    flags = largest_flags(a, L, state, a.largest_accum)
    plan = plan_json(a, flags, "run")
    r["plan"] = plan
    base = plan.get("frozen_params") or 0
    r["params"], r["base_params"], r["adapter_params"] = plan["params"], base, plan["params"] - base
    r["search_seconds"] = time.perf_counter() - t0
    bound = (plan.get("estimate") or {}).get("step_lower_bound_ms")
    wl.say(f"largest: {L} layers x {a.width} wide: {plan['params'] / 1e9:.2f}B params, {base / 1e9:.2f}B of them the "
           f"frozen base; the plan: host {plan['host']['total_bytes'] / GIB:.1f} GiB of {a.host_ram} "
           f"({plan['host']['pinned_bytes'] / GIB:.1f} GiB pinned), device {plan['device']['min_bytes'] / GIB:.1f} GiB "
           f"at least; step bound {bound / 1e3 if bound else float('nan'):.1f} s")
    log = os.path.join(a.workdir, "largest-train.jsonl")
    out = os.path.join(a.workdir, "largest-train.out")
    if os.path.exists(log):
        os.remove(log)
    cmd = [a.tidal, "train", "--data", tok_name(a)] + flags + [
        "--steps", str(a.largest_steps), "--lr", "1e-4", "--schedule", "constant", "--warmup", "0",
        "--clip-grad-norm", f"{a.clip:g}", "--seed", "1337", "--log", log, "--log-every", "1"]
    r["command"] = " ".join(shlex.quote(c) for c in cmd)
    wl.say(f"largest: training {a.largest_steps} steps of B{a.largest_batch}x{a.largest_accum} "
           f"(timeout {a.run_timeout} s): {r['command']}")
    rc, smi, secs = wl.run_logged(cmd, out, a.run_timeout)
    steps = wl.read_jsonl(log)
    r.update(exit=rc, seconds=secs, smi_bytes=smi, steps=steps, output=out, output_tail=wl.tail(out, 6))
    r["setup_seconds"], r["setup_breakdown"] = setup_seconds(out)
    if rc != 0 or len(steps) < a.largest_steps:
        r["error"] = f"{wl.killed(rc) or f'exit {rc}'}, {len(steps)} of {a.largest_steps} steps logged: " \
                     f"{wl.tail(out, 3) or 'no output'}"
        wl.say("largest: " + r["error"])
        return r
    r["losses"] = [s.get("loss") for s in steps]
    bad = [f"step {i + 1}: {loss_problem(x)}" for i, x in enumerate(r["losses"]) if loss_problem(x)]
    if bad:
        r["error"] = "; ".join(bad) + "; no figure is recorded"
        wl.say("largest: " + r["error"])
        return r
    timed = [s for s in steps if s.get("step", 0) > 1] or steps
    ram = wl_size(a.host_ram)
    r["step_ms"] = [s["step_ms"] for s in steps]
    r["step_ms_median"] = statistics.median(s["step_ms"] for s in timed)
    r["tokens_per_s"] = statistics.median(s["tokens_per_s"] for s in timed)
    r["device_peak_bytes"] = max(s.get("device_peak_bytes", 0) for s in steps)
    r["host_peak_bytes"] = max(s.get("host", {}).get("peak_bytes", 0) for s in steps)
    r["host_rss_peak_bytes"] = max(s.get("host", {}).get("rss_peak_bytes", 0) for s in steps)
    r["host_ram_bytes"] = ram
    r["bound_ms"] = bound
    r["bound_fraction"] = bound / r["step_ms_median"] if bound and r["step_ms_median"] > 0 else None
    r["within_host_ram"] = ram is not None and max(r["host_peak_bytes"], r["host_rss_peak_bytes"]) <= ram
    r["within_budget"] = r["device_peak_bytes"] <= a.budget_gib * GIB
    r["met"] = base >= TARGET_PARAMS
    setup = f"{r['setup_seconds']:.0f} s ({r['setup_breakdown']})" if r["setup_seconds"] is not None else "?"
    wl.say(f"largest: set up in {setup}; steps " + ", ".join(f"{ms / 1e3:.1f} s" for ms in r["step_ms"]) +
           f"; {r['tokens_per_s']:.0f} tok/s (median after the first step)"
           + (f", {100 * r['bound_fraction']:.0f}% of the bound" if r["bound_fraction"] else "") +
           f"; device peak {r['device_peak_bytes'] / GIB:.2f} GiB of {a.budget_gib:g}; host peak "
           f"{r['host_peak_bytes'] / GIB:.1f} GiB itemized, {r['host_rss_peak_bytes'] / GIB:.1f} GiB resident, of "
           f"{a.host_ram} ({'within' if r['within_host_ram'] else 'OVER'}); base {base / 1e9:.2f}B "
           f"(target at least {TARGET_PARAMS / 1e9:.0f}B: {'met' if r['met'] else 'NOT met'})")
    return r


def wl_size(s):
    """Bytes of a size as tidal reads it (e.g. 125GiB, 512MiB, 1e9), or None."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", s or "")
    if not m:
        return None
    mult = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
            "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[m.group(2)]
    return int(float(m.group(1)) * mult)


def largest_figures(r):
    figs = []
    if not isinstance(r, dict) or not r.get("base_params") or r.get("error"):
        return figs
    figs.append(res.figure("the largest base / the 50B target", r["base_params"] / TARGET_PARAMS, "x"))
    figs.append(res.figure("tokens/s (median after the first step)", r["tokens_per_s"], "tok/s"))
    if r.get("bound_fraction"):
        figs.append(res.figure("the lower bound / the step", 100 * r["bound_fraction"], "%"))
    if r.get("host_ram_bytes"):
        figs.append(res.figure("the host's resident peak / the host RAM given", 100 * r["host_rss_peak_bytes"]
                               / r["host_ram_bytes"], "%"))
        figs.append(res.figure("the host's itemized peak / the host RAM given", 100 * r["host_peak_bytes"]
                               / r["host_ram_bytes"], "%"))
    figs.append(res.figure("the device's peak (arena) / the GPU budget", 100 * r["device_peak_bytes"]
                           / (r["budget_gib"] * GIB), "%"))
    return figs


def largest_title(r, a):
    block = " (Llama 3.1 70B's block)" if (a.width, a.heads, a.kv_heads, a.mlp) == (8192, 64, 8, 28672) else ""
    kv = f"{r['kv_heads']} key/value head" + ("s" if r["kv_heads"] != 1 else "")
    shape = (f"{r['layers']} layers of {r['width']} wide, {r['heads']} heads, {kv}, MLP {r['mlp']}{block}"
             if r.get("layers") else f"{a.width} wide")
    size = f": {r['base_params'] / 1e9:.2f}B base params" if r.get("base_params") else ""
    prec = "bf16" if a.tidal_backend == "cuda" else "fp32"
    return (f"The largest base that LoRA rank {a.lora_rank} on every linear module fine-tunes at a "
            f"{a.budget_gib:g} GiB GPU budget with --host-ram {a.host_ram}, {prec} base, the adapters' AdamW state "
            f"{r.get('optim_state')}, B{a.largest_batch}x{a.largest_accum} x {a.seq} tokens a step{size} ({shape})")


# ---- main ------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default both)")
    ap.add_argument("--tidal", default="build/tidal")
    ap.add_argument("--tidal-backend", choices=["cuda", "cpu"], default="cuda",
                    help="cpu only to check this script without a GPU (with --smoke)")
    ap.add_argument("--tidal-args", default="", help="more flags for tidal plan and train in both parts")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--budget-gib", type=float, default=24.0, help="tidal's GPU budget (default 24)")
    ap.add_argument("--steps", type=int, default=8, help="W12: steps a run (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="W12: of which untimed (default 3)")
    ap.add_argument("--quick", action="store_true", help="W12: tidal's first micro-batch its plan fits, not the best")
    ap.add_argument("--tidal-batch", default="", metavar="BxK[,BxK]", help="W12: only these of tidal's micro-batches")
    ap.add_argument("--peer-batch", default="", metavar="BxK[,BxK]", help="W12: only these of the peer's")
    ap.add_argument("--tidal-only", action="store_true", help="W12: leave out the peer")
    ap.add_argument("--python", default=sys.executable, help="the interpreter for the peer")
    ap.add_argument("--host-ram", default="125GiB", help="largest: the host RAM it plans and runs with (default "
                    "125GiB)")
    ap.add_argument("--width", type=int, default=8192, help="largest: the block's width (default 8192)")
    ap.add_argument("--heads", type=int, default=64, help="largest: heads (default 64)")
    ap.add_argument("--kv-heads", type=int, default=8, help="largest: key/value heads (default 8)")
    ap.add_argument("--mlp", type=int, default=28672, help="largest: the MLP's width (default 28672)")
    ap.add_argument("--largest-batch", default="4,2", metavar="B[,B]",
                    help="largest: the micro-batches searched, the one of the most layers trained (default 4,2)")
    ap.add_argument("--largest-accum", type=int, default=4, help="largest: micro-batches a step (default 4)")
    ap.add_argument("--largest-steps", type=int, default=3, help="largest: steps, the first untimed (default 3)")
    ap.add_argument("--dir", default="", help="largest: a local directory for the disk tier (--offload-dir)")
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks the plumbing, not the speed")
    ap.add_argument("--workdir", default="out/bench-lora")
    ap.add_argument("--json", metavar="OUT", help="every figure and record (default out/bench-lora/lora-PARTS.json)")
    ap.add_argument("--results", metavar="DIR", help="results files here (default bench/results/; not with --smoke "
                    "or --tidal-backend cpu unless given)")
    ap.add_argument("--no-results", action="store_true", help="write no results file")
    ap.add_argument("--run-timeout", type=int, default=420, help="seconds a process (default 420)")
    a = ap.parse_args(argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        ap.error(f"unknown part(s) {', '.join(bad) or '(none)'}: choose from {', '.join(PARTS)}")
    if a.steps <= a.warmup:
        ap.error(f"--steps {a.steps} must exceed --warmup {a.warmup}")
    if a.largest_steps < 2:
        ap.error(f"--largest-steps {a.largest_steps}: at least 2 (the first is not timed)")
    try:
        a.largest_batches = [int(x) for x in a.largest_batch.split(",") if x.strip()]
    except ValueError:
        a.largest_batches = []
    if not a.largest_batches or min(a.largest_batches) < 1:
        ap.error(f"--largest-batch {a.largest_batch!r}: give micro-batches, e.g. 4,2")
    a.largest_batch = a.largest_batches[0]
    if wl_size(a.host_ram) is None:
        ap.error(f"--host-ram {a.host_ram!r}: give a size such as 125GiB")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, wl.on_signal)
    a.seq = 1024
    if a.smoke:
        # the cpu backend's "device" is host memory: its budget counts in --host-ram (some 30 layers fit here)
        a.seq, a.budget_gib = 64, 0.5
        a.width, a.heads, a.kv_heads, a.mlp = 128, 2, 1, 256
        a.largest_batches, a.largest_batch, a.largest_accum = [2, 1], 2, 2
        a.host_ram = "720MiB" if a.host_ram == "125GiB" else a.host_ram
    if a.no_results:
        a.results = None
    elif a.results is None and not a.smoke and a.tidal_backend == "cuda":
        a.results = res.RESULTS_DIR
    os.makedirs(a.workdir, exist_ok=True)
    if a.dir:
        os.makedirs(a.dir, exist_ok=True)
    need = max(16 * a.seq * a.steps, max(a.largest_batches) * a.largest_accum * a.seq * a.largest_steps) + 1
    wl.write_token_file(tok_name(a), max(need, 1 << 20), seed=1337, vocab=LLAMA8B.vocab, token_range=LLAMA8B.vocab,
                        eot=LLAMA8B.eot, kind=3)
    info = wl.machine_info()
    wl.say(f"bench/lora.py: parts {', '.join(parts)}; tidal {a.tidal} ({a.tidal_backend}); machine {info.get('host')}, "
           f"{info.get('cpus')} CPUs, GPU {', '.join(info.get('gpus', ['none found']))}")
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": info, "parts": parts,
           "args": vars(a)}
    rc = 0
    for part in parts:
        t0 = time.perf_counter()
        wl.say(f"\n== {part}")
        if part == "w12":
            try:
                row, doc = part_w12(a)
            except (RuntimeError, KeyError, TypeError, ValueError) as e:
                row, doc = None, {"error": f"{type(e).__name__}: {e}"}
                wl.say(f"w12: {doc['error']}")
            doc["seconds"] = time.perf_counter() - t0
            out["w12"] = doc
            if row and not row["tidal"].get("error") and a.results:
                res.write_result("W12", w12_title(row, a), w12_figures(row), details=doc, out_dir=a.results)
            rc |= bool(not row or row["tidal"].get("error"))
        else:
            try:
                r = part_largest(a)
            except (RuntimeError, KeyError, TypeError, ValueError) as e:
                r = {"error": f"{type(e).__name__}: {e}"}
                wl.say(f"largest: {r['error']}")
            r["seconds"] = time.perf_counter() - t0
            out["largest"] = r
            if not r.get("error") and a.results:
                res.write_result("lora-largest", largest_title(r, a), largest_figures(r),
                                 details=json.loads(json.dumps(r, default=str)), out_dir=a.results)
            rc |= bool(r.get("error"))
        wl.say(f"{part}: {time.perf_counter() - t0:.0f} s")
    path = a.json or os.path.join(a.workdir, f"lora-{'-'.join(parts)}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    wl.say(f"all of it: {path}")
    return 1 if rc else 0


if __name__ == "__main__":
    sys.exit(main())
