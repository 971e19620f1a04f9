#!/usr/bin/env python3
"""tidal's kernels beside their rooflines and attention beside PyTorch's SDPA flash, in one run.

Runs on the GPU machine, from the repository root after `make`, one process
after the other on the same GPU:

  ops        `tidal bench ops --json` at GPT-2 1.5B's block (B 32, T 1024,
             C 1600, 25 heads) and at Llama 3.2 3B's width (B 8, T 1024,
             C 3072, 24 heads of 128, 8 key/value heads, MLP 8192): each op
             of a GPT-2 and a LLaMA-family block with its time, TFLOP/s,
             GB/s and the share of its roofline it reaches (bench_cuda.h: its
             FLOPs or compulsory bytes over the device's data-sheet peak);
  head       `tidal bench head --json` for the heads of W1 (gpt2-124m, B16
             T1024), W8 (llama-3.1-8b, B4 T4096) and W9 (qwen2.5-0.5b, B16
             T1024): the head and the loss in the trainer's chunks of rows
             against one chunk of all rows, with the logits each holds;
  attention  `tidal bench attention --json` and bench/peers/sdpa_attention.py
             (PyTorch SDPA with only the flash backend) at T = 1024, 4096 and
             8192, head sizes 64 and 128, causal, 16k tokens, 2048 wide, and
             grouped-query (4 query heads a key/value head) at 128; head
             sizes 80 and 96 at T = 4096, 32 heads; tidal / SDPA as ratios
             of forward + backward time.

Writes bench/results/kernels-ops.json, kernels-head.json and
kernels-attention.json (bench/results.py), and prints a summary.  A part
that fails is reported and the others still run; exit status 1 if any did.
About two minutes on an H100 (--repeat 10).

    python3 bench/kernels.py                       # everything
    python3 bench/kernels.py --parts attention     # one part
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results as res  # noqa: E402

OPS_SHAPES = [
    # W1's and W9's blocks (16k tokens), then wider ones
    ("gpt2-124m", ["--width", "768", "--heads", "12", "--micro-batch", "16", "--seq", "1024"]),
    ("qwen2.5-0.5b", ["--width", "896", "--heads", "14", "--kv-heads", "2", "--mlp", "4864",
                      "--micro-batch", "16", "--seq", "1024"]),
    ("gpt2-1.5b", ["--width", "1600", "--heads", "25", "--micro-batch", "32", "--seq", "1024"]),
    ("llama-3.2-3b", ["--width", "3072", "--heads", "24", "--kv-heads", "8", "--mlp", "8192",
                      "--micro-batch", "8", "--seq", "1024"]),
]
HEAD_SHAPES = [
    ("W1", ["--model", "gpt2-124m", "--micro-batch", "16", "--seq", "1024"]),
    ("W8", ["--model", "llama-3.1-8b", "--micro-batch", "4", "--seq", "4096"]),
    ("W9", ["--model", "qwen2.5-0.5b", "--micro-batch", "16", "--seq", "1024"]),
]
SEQS = [1024, 4096, 8192]
HEAD_DIMS = [64, 128]
ODD_DIMS, ODD_SEQ = [80, 96], 4096  # the flash kernels' other head sizes, 32 heads, at one length
WIDTH, TOKENS = 2048, 16384


def run_json(cmd, timeout):
    """The JSON a command prints (its whole stdout, else its last line), or raises with its stderr."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()[-400:]}")
    try:
        return json.loads(p.stdout)
    except json.JSONDecodeError:
        return json.loads(p.stdout.strip().splitlines()[-1])


def part_ops(a, log):
    figs, details = [], {}
    for name, args in OPS_SHAPES:
        doc = run_json([a.tidal, "bench", "ops", "--json", "--repeat", str(a.repeat)] + args, a.timeout)
        details[name] = doc
        tf = doc.get("tflops_per_block", {})
        for fam in ("gpt2", "llama"):
            for k in ("forward", "backward", "both"):
                v = tf.get(fam, {}).get(k)
                if v:
                    figs.append(res.figure(f"{name} {fam} block {k}", v * 1e12, "FLOP/s"))
        for fam, rows in (("gpt2", doc.get("ops", [])), ("llama", doc.get("llama", {}).get("ops", []))):
            for r in rows:
                figs.append(res.figure(f"{name} {fam} {r['op']} of roofline", 100 * r.get("of_roofline", 0), "%"))
                log(f"  {name:13s} {fam:6s} {r['op']:34s} {r['ms']:9.3f} ms  {100 * r.get('of_roofline', 0):5.1f}% of roofline")
    res.write_result("kernels-ops", "each op of a GPT-2 and a LLaMA block beside its roofline", figs, details)


def part_head(a, log):
    figs, details = [], {}
    for wid, args in HEAD_SHAPES:
        doc = run_json([a.tidal, "bench", "head", "--json", "--repeat", str(a.repeat)] + args, a.timeout)
        details[wid] = doc
        rows = doc.get("ops", [])
        for r in rows:
            log(f"  {wid:3s} {r['op']:40s} {r['ms']:9.3f} ms  {r['tflops']:6.1f} TFLOP/s  "
                f"{100 * r['of_roofline']:5.1f}% of roofline  logits {r['logits_bytes'] / 2**20:8.1f} MiB")
        if rows:
            figs.append(res.figure(f"{wid} head + loss in chunks", rows[0]["tflops"] * 1e12, "FLOP/s"))
        if len(rows) > 1:
            figs.append(res.figure(f"{wid} head + loss in chunks / one chunk (time)", rows[0]["ms"] / rows[1]["ms"], "x"))
    res.write_result("kernels-head", "the head and the loss in chunks of rows against one chunk", figs, details)


def part_attention(a, log):
    figs, details = [], {"tidal": [], "sdpa": None}
    # (T, hs, NH, NKV): 2048 wide at 64 and 128 (and GQA 4 at 128); 32 heads at 80 and 96, T 4096
    cases = ([(T, hs, WIDTH // hs, WIDTH // hs) for hs in HEAD_DIMS for T in SEQS] +
             [(T, 128, WIDTH // 128, 4) for T in SEQS] + [(ODD_SEQ, hs, 32, 32) for hs in ODD_DIMS])
    peer = {}
    sdpa = [sys.executable, os.path.join(HERE, "peers", "sdpa_attention.py"), "--repeat", str(a.repeat),
            "--tokens", str(TOKENS)]
    try:
        docs = [run_json(sdpa + ["--seqs", ",".join(map(str, SEQS)), "--head-dims", ",".join(map(str, HEAD_DIMS)),
                                 "--width", str(WIDTH)], a.timeout),
                run_json(sdpa + ["--seqs", ",".join(map(str, SEQS)), "--head-dims", "128", "--group", "4",
                                 "--width", str(WIDTH)], a.timeout)]
        docs += [run_json(sdpa + ["--seqs", str(ODD_SEQ), "--head-dims", str(hs), "--width", str(32 * hs)], a.timeout)
                 for hs in ODD_DIMS]
        details["sdpa"] = docs
        for doc in docs:
            for r in doc["results"]:
                peer[(r["T"], r["hs"], r["NKV"])] = r
    except Exception as e:  # the peer's failure is recorded; tidal's figures still are
        details["sdpa_error"] = str(e)
        log(f"  SDPA peer: not available: {e}")
    for T, hs, NH, nkv in cases:
        d = run_json([a.tidal, "bench", "attention", "--json", "--repeat", str(a.repeat), "--seq", str(T),
                      "--head-dim", str(hs), "--heads", str(NH), "--kv-heads", str(nkv), "--tokens", str(TOKENS)],
                     a.timeout)
        details["tidal"].append(d)
        ops = {r["op"]: r for r in d["ops"]}
        both = ops["attention forward + backward"]
        tag = f"T{T} hs{hs}" + ("" if nkv == NH else f" gqa{NH // nkv}")
        figs.append(res.figure(f"attention {tag} fwd+bwd", both["tflops"] * 1e12, "FLOP/s"))
        figs.append(res.figure(f"attention {tag} fwd+bwd of roofline", 100 * both["of_roofline"], "%"))
        p = peer.get((T, hs, nkv))
        line = (f"  {tag:18s} tidal fwd {ops['attention forward']['ms']:8.3f} bwd {ops['attention backward']['ms']:8.3f} "
                f"both {both['ms']:8.3f} ms ({both['tflops']:5.1f} TFLOP/s, {100 * both['of_roofline']:4.1f}% of roofline)")
        if p and "fwd_bwd_ms" in p:
            ratio = p["fwd_bwd_ms"] / both["ms"]
            figs.append(res.figure(f"attention {tag} fwd+bwd tidal / SDPA flash", ratio, "x"))
            figs.append(res.figure(f"attention {tag} fwd tidal / SDPA flash", p["forward_ms"] / ops["attention forward"]["ms"], "x"))
            figs.append(res.figure(f"attention {tag} bwd tidal / SDPA flash", p["backward_ms"] / ops["attention backward"]["ms"], "x"))
            line += f"; SDPA both {p['fwd_bwd_ms']:8.3f} ms: tidal {ratio:.2f}x"
        elif p:
            line += f"; SDPA: {p.get('error', 'no figure')}"
        log(line)
    res.write_result("kernels-attention", "causal flash attention beside PyTorch SDPA (flash)", figs, details)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="ops,head,attention", help="comma-separated: ops, head, attention")
    ap.add_argument("--tidal", default="build/tidal", help="the tidal command (default build/tidal)")
    ap.add_argument("--repeat", type=int, default=10, help="timed runs per figure, median (default 10)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds a command may take (default 300)")
    a = ap.parse_args()
    parts = {"ops": part_ops, "head": part_head, "attention": part_attention}
    bad = [p for p in a.parts.split(",") if p not in parts]
    if bad:
        ap.error(f"unknown part(s) {', '.join(bad)}: use ops, head, attention")
    failed = 0
    for name in a.parts.split(","):
        print(f"{name}:", flush=True)
        try:
            parts[name](a, lambda s: print(s, flush=True))
        except Exception as e:
            failed = 1
            print(f"  {name}: failed: {e}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
