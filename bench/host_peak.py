#!/usr/bin/env python3
"""The host's peak memory a parameter, measured, for 1 and 2 ranks on one host.

Under ZeRO-3 each rank's host holds its shard of every chunk (16-bit params
and grads, fp32 master, AdamW m and v), so the host holds each byte of the
model state once: its bytes a parameter should not grow with the ranks.
This trains one model (default the 4.1B GPT of W4, 32L/3200/25H, bf16
compute, 24 GiB a GPU, fp32 AdamW state, no clipping: grads transient) for
a few steps with --nproc N for each N of --ranks, and reads the host's peak
from rank 0's log: `host_node_peak_bytes`, every rank's measured footprint
on this host added (pinned slabs, pageable state, the heap by jemalloc; the
peak of each sampled at every step's end).  Beside it, the plan's figures
(`tidal plan --nproc N`): host.node_bytes and the model state alone,
host.node_state_bytes.

Writes bench/results/host-peak-<state>.json through bench/results.py
(--results DIR for another folder): the figures are the spread of the
measured bytes a param over the N and the plan's (the target: within 3%,
at most 16.2 with fp32 state, 10.2 with bf16, 8.2 with int8) and the
largest N's measured bytes a param over one rank's; the details hold, per
N, params, the measured peak and its bytes a param, and the plan's.

Usage (GPU machine, repository root, after `make`):
    python3 bench/host_peak.py                         # N = 1 and 2, fp32 state
    python3 bench/host_peak.py --optim-state bf16 --ranks 1,2,4
    python3 bench/host_peak.py --smoke --backend cpu   # plumbing, no GPU
"""
import argparse
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results as res  # noqa: E402
import workloads as wl  # noqa: E402


def model_args(a):
    L, C, H = a.shape
    return ["--layers", str(L), "--width", str(C), "--heads", str(H), "--vocab", str(wl.VOCAB), "--seq", str(a.seq)]


def common(a, n):
    f = ["--backend", a.backend, "--precision", "bf16" if a.backend == "cuda" else "fp32"] + model_args(a) + \
        ["--micro-batch", str(a.batch), "--optim-state", a.optim_state, "--clip-grad-norm", "0",
         "--gpu-budget", a.budget]
    if n > 1:
        f += ["--nproc", str(n)]
    return f + shlex.split(a.tidal_args)


def plan(a, n):
    path = os.path.join(a.workdir, f"plan-n{n}.out")
    rc, _, _ = wl.run_logged([a.tidal, "plan", "--json", "--no-measure"] + common(a, n), path, 300)
    doc = wl.last_json(path)
    if doc is None or rc not in (0, 3):
        return None, f"tidal plan --nproc {n} failed (exit {rc}): {wl.tail(path, 2)}"
    return doc, None


def train(a, n):
    log = os.path.join(a.workdir, f"train-n{n}.jsonl")
    out = os.path.join(a.workdir, f"train-n{n}.out")
    if os.path.exists(log):
        os.remove(log)
    cmd = [a.tidal, "train", "--data", a.data, "--steps", str(a.steps), "--log", log] + common(a, n)
    rc, smi, secs = wl.run_logged(cmd, out, a.run_timeout)
    steps = wl.read_jsonl(log)
    res = {"command": " ".join(shlex.quote(c) for c in cmd), "exit": rc, "seconds": secs, "smi_bytes": smi,
           "output": out}
    if rc != 0 or not steps:
        res["error"] = f"exit {rc}, {len(steps)} steps logged: {wl.tail(out, 2) or 'no output'}"
        return res
    res["host_node_peak_bytes"] = max(s.get("host_node_peak_bytes", 0) for s in steps)
    res["host_node_rss_peak_bytes"] = max(s.get("host_node_rss_peak_bytes", 0) for s in steps)
    res["rank0_host"] = steps[-1].get("host")
    res["step_ms_last"] = steps[-1].get("step_ms")
    return res


def heap_split(row, h):
    """Rank 0's heap split into tidal's own (td_malloc, host.heap_roles of the
    log: live at the last step, and the most live at once) and the rest, the
    libraries' (the CUDA runtime, cuBLAS, NCCL, hwloc, OpenMP); with the
    allocation sites of tidal's largest peaks."""
    def mib(b):
        return f"{b / 2**20:.1f} MiB"
    roles = h.get("heap_roles")
    if not roles or "heap_allocated_bytes" not in h:
        return
    own = sum(r["bytes"] for r in roles.values())
    row["rank0_heap_tidal_bytes"] = own
    row["rank0_heap_tidal_peak_bytes"] = sum(r["peak_bytes"] for r in roles.values())
    row["rank0_heap_libraries_bytes"] = h["heap_allocated_bytes"] - own
    row["rank0_heap_sites"] = h.get("heap_sites", [])
    sites = ", ".join(f"{x['site']} {mib(x['peak_bytes'])}" for x in row["rank0_heap_sites"][:3])
    wl.say(f"    rank 0's heap {mib(h['heap_allocated_bytes'])}: tidal's own {mib(own)} (at most "
           f"{mib(row['rank0_heap_tidal_peak_bytes'])}; largest sites {sites or 'none'}), the libraries' "
           f"{mib(row['rank0_heap_libraries_bytes'])}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tidal", default="build/tidal")
    ap.add_argument("--ranks", default="1,2", help="comma-separated rank counts (default 1,2)")
    ap.add_argument("--shape", type=lambda s: tuple(int(x) for x in s.lower().replace("/", "x").split("x")),
                    default=(32, 3200, 25), help="LAYERSxWIDTHxHEADS (default 32x3200x25, 4.1B)")
    ap.add_argument("--optim-state", default="fp32", choices=["fp32", "bf16", "int8"])
    ap.add_argument("--budget", default="24GiB", help="GPU budget a rank (default 24GiB)")
    ap.add_argument("--batch", type=int, default=8, help="micro-batch a rank (default 8)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--backend", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tidal-args", default="")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, to check the plumbing")
    ap.add_argument("--workdir", default="out/bench-host-peak")
    ap.add_argument("--results", metavar="DIR", help="write the results file here (default bench/results/; not with "
                    "--smoke unless given)")
    ap.add_argument("--no-results", action="store_true", help="write no results file")
    ap.add_argument("--run-timeout", type=int, default=900)
    a = ap.parse_args(argv)
    a.seq = 1024
    if a.smoke:
        a.shape, a.seq, a.batch, a.budget = (2, 64, 2), 64, 2, "256MiB"
    ranks = [int(x) for x in a.ranks.split(",") if x.strip()]
    os.makedirs(a.workdir, exist_ok=True)
    a.data = os.path.join(a.workdir, "random.tok")
    wl.write_token_file(a.data, max(max(ranks) * a.batch * a.seq * a.steps + 1, 1 << 20), seed=1337)
    info = wl.machine_info()
    wl.say(f"bench/host_peak.py: {a.shape[0]}L/{a.shape[1]}/{a.shape[2]}H, {a.optim_state} AdamW state, ranks "
           f"{ranks}; machine {info.get('host')}, {info.get('cpus')} CPUs, GPU {', '.join(info.get('gpus', ['none']))}")
    rows = []
    for n in ranks:
        p, err = plan(a, n)
        row = {"ranks": n}
        if err:
            row["error"] = err
            rows.append(row)
            wl.say(f"  {n} rank(s): {err}")
            continue
        params = p["params"]
        row.update(params=params, plan_node_bytes=p["host"]["node_bytes"],
                   plan_node_state_bytes=p["host"]["node_state_bytes"],
                   plan_rank_bytes=p["host"]["total_bytes"],
                   plan_node_bytes_per_param=p["host"]["node_bytes"] / params,
                   plan_node_state_bytes_per_param=p["host"]["node_state_bytes"] / params)
        t = train(a, n)
        row["train"] = t
        if t.get("error"):
            row["error"] = t["error"]
            wl.say(f"  {n} rank(s): {t['error']}")
        else:
            row["measured_node_peak_bytes"] = t["host_node_peak_bytes"]
            row["measured_bytes_per_param"] = t["host_node_peak_bytes"] / params
            # what the footprint does not itemize: the resident peaks (VmHWM) beyond it, a process
            row["measured_node_rss_peak_bytes"] = t["host_node_rss_peak_bytes"]
            row["unitemized_bytes_per_process"] = (t["host_node_rss_peak_bytes"] - t["host_node_peak_bytes"]) / n
            wl.say(f"  {n} rank(s): the host's measured peak {wl.gib(t['host_node_peak_bytes'])}, "
                   f"{row['measured_bytes_per_param']:.2f} bytes a param (plan: {row['plan_node_bytes_per_param']:.2f}, "
                   f"of it model state {row['plan_node_state_bytes_per_param']:.2f}); resident peak "
                   f"{wl.gib(t['host_node_rss_peak_bytes'])}, {wl.gib(row['unitemized_bytes_per_process'])} a process "
                   f"beyond the itemized footprint")
            heap_split(row, t.get("rank0_host") or {})
        rows.append(row)
    ok = [r["measured_bytes_per_param"] for r in rows if "measured_bytes_per_param" in r]
    planned = [r["plan_node_bytes_per_param"] for r in rows if "plan_node_bytes_per_param" in r]
    doc = {"machine": info, "shape": a.shape, "optim_state": a.optim_state, "budget": a.budget, "batch": a.batch,
           "steps": a.steps, "rows": rows}
    figs = []
    if len(ok) > 1:
        doc["spread"] = max(ok) / min(ok) - 1
        wl.say(f"bytes a param from {min(ok):.2f} to {max(ok):.2f}: a spread of {100 * doc['spread']:.1f}% "
               f"(target: within 3%)")
        figs.append(res.figure(f"the host's measured peak a param, spread over {a.ranks} ranks", 100 * doc["spread"], "%"))
        m = [r for r in rows if "measured_bytes_per_param" in r]
        figs.append(res.figure(f"the host's measured peak a param, {m[-1]['ranks']} ranks / {m[0]['ranks']}",
                               m[-1]["measured_bytes_per_param"] / m[0]["measured_bytes_per_param"], "x"))
    extra = [r["unitemized_bytes_per_process"] for r in rows if "unitemized_bytes_per_process" in r]
    if extra:  # against the 512 MiB a process the plan keeps back on cuda (TD_HOST_RESERVE_PROCESS_CUDA)
        keep = (512 if a.backend == "cuda" else 64) * 2**20
        figs.append(res.figure("the resident peak beyond the itemized footprint, a process (the most), of what the "
                               "plan keeps for it", 100 * max(extra) / keep, "%"))
    if len(planned) > 1:
        doc["plan_spread"] = max(planned) / min(planned) - 1
        figs.append(res.figure(f"the plan's host bytes a param, spread over {a.ranks} ranks", 100 * doc["plan_spread"],
                               "%"))
    if not a.no_results and (a.results or not a.smoke):
        res.write_result(f"host-peak-{a.optim_state}", f"The host's peak a parameter under ZeRO-3 ({a.shape[0]}L/"
                         f"{a.shape[1]}/{a.shape[2]}H, {a.optim_state} AdamW state), {a.ranks} ranks on one host",
                         figs, details=doc, out_dir=a.results)
    return 0 if ok and len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
