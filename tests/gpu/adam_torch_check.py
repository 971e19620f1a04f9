#!/usr/bin/env python3
"""tidal's CPU AdamW against torch.optim.AdamW / Adam on the CPU, 10 steps.

For each case the script writes inputs (initial params, the unscaled grads of
every step, the hyper-parameters, the schedule, the loss scaling) into a
directory, runs `tidal bench adam --check-dir DIR --isa ISA` for every
instruction set the CPU has, and replays the same steps in torch the way a
PyTorch training loop does them:

    grad = (true_grad * scale).to(grad_dtype).float()   # what backward stores
    GradScaler-style unscale (grad *= 1/scale), skip the step on Inf/NaN
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.param_groups[0]["lr"] = lr_at(step); optimizer.step()

It compares tidal's final fp32 master params with torch's params (and, for
scale, both with a float64 replay of the same steps):
    max relative difference = max_i |tidal_i - torch_i| / max_i |torch_i|
Pass: <= 1e-6 for every case, ISA and torch implementation (for-loop,
foreach, and fused=True where this torch has a fused CPU AdamW, >= 2.4).
The difference between torch's own implementations is printed as the noise
floor.  Also checked: the steps tidal skipped, its loss scale after the run
and its lr of every step equal the script's own replay.

Usage (from the repository root, after `make`):
    python3 tests/gpu/adam_torch_check.py [--tidal build/tidal] [--numel N]
                                          [--threads T] [--keep DIR]
Exit status 0 on PASS, 1 on FAIL.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

STEPS = 10
LIMIT = 1e-6

CASES = [
    dict(name="adamw-fp32-cosine-clip", grad_dtype="fp32", param_dtype="bf16", decay="decoupled",
         beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0,
         lr=dict(decay="cosine", lr=1e-3, min_lr=1e-4, warmup_steps=3, total_steps=STEPS, gamma=1.0),
         loss_scale=dict(kind="none"), inf_step=None),
    dict(name="adamw-bf16-dynamic-scale-overflow", grad_dtype="bf16", param_dtype="bf16", decay="decoupled",
         beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, max_grad_norm=0.5,
         lr=dict(decay="linear", lr=3e-3, min_lr=0.0, warmup_steps=2, total_steps=STEPS, gamma=1.0),
         loss_scale=dict(kind="dynamic", init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5,
                         growth_interval=3, hysteresis=1, min_scale=1.0),
         inf_step=4),
    dict(name="adam-l2-fp16-static-scale", grad_dtype="fp16", param_dtype="fp16", decay="l2",
         beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.05, max_grad_norm=0.0,
         lr=dict(decay="exponential", lr=2e-3, min_lr=1e-4, warmup_steps=0, total_steps=0, gamma=0.8),
         loss_scale=dict(kind="static", init_scale=1024.0), inf_step=6),
    dict(name="adamw-noam-betas", grad_dtype="fp32", param_dtype="fp32", decay="decoupled",
         beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, max_grad_norm=2.0,
         lr=dict(decay="noam", lr=1e-3, min_lr=0.0, warmup_steps=4, total_steps=0, gamma=1.0),
         loss_scale=dict(kind="none"), inf_step=None),
]

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def lr_at(s, t):
    """The closed forms of include/tidal/optim.h, in double."""
    t = max(t, 1)
    w, lr, lo = s["warmup_steps"], s["lr"], s["min_lr"]
    if s["decay"] == "noam":
        wp = max(w, 1)
        return lr * t / wp if t <= wp else max(lo, lr * math.sqrt(wp / t))
    if t <= w:
        return lr * t / w
    k = t - w - 1
    if s["decay"] in ("cosine", "linear"):
        p = min(max(k / (s["total_steps"] - w - 1), 0.0), 1.0)
        f = 0.5 * (1 + math.cos(math.pi * p)) if s["decay"] == "cosine" else 1 - p
        return lo + (lr - lo) * f
    if s["decay"] == "exponential":
        return max(lo, lr * s["gamma"] ** k)
    return lr


class Scaler:
    """DeepSpeed's dynamic rule with hysteresis, as documented in optim.h."""

    def __init__(self, p):
        self.kind = p["kind"]
        self.scale = 1.0 if self.kind == "none" else p["init_scale"]
        self.p = p
        self.clean = 0
        self.hyst = p.get("hysteresis", 2)
        self.overflows = 0

    def update(self, overflow):
        if overflow:
            self.overflows += 1
            self.clean = 0
            if self.kind == "dynamic":
                if self.hyst > 1:
                    self.hyst -= 1
                else:
                    self.hyst = 1
                    self.scale = max(self.scale * self.p["backoff_factor"], self.p["min_scale"])
            return True
        if self.kind == "dynamic":
            self.clean += 1
            if self.clean >= self.p["growth_interval"]:
                self.clean = 0
                self.hyst = self.p["hysteresis"]
                self.scale *= self.p["growth_factor"]
        return False


def torch_variants():
    """The torch AdamW implementations this torch has on the CPU."""
    out = [("for-loop", dict(foreach=False)), ("foreach", dict(foreach=True))]
    try:
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.zeros(4)
        torch.optim.AdamW([p], lr=1e-3, fused=True).step()
        out.append(("fused", dict(fused=True)))
    except (RuntimeError, TypeError, ValueError) as e:
        print(f"note: torch {torch.__version__} has no fused CPU AdamW ({str(e).splitlines()[0][:80]})")
    return out


def run_torch(case, p0, grads, kwargs):
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    betas = (case["beta1"], case["beta2"])
    if case["decay"] == "l2":
        opt = torch.optim.Adam([p], lr=case["lr"]["lr"], betas=betas, eps=case["eps"],
                               weight_decay=case["weight_decay"], **kwargs)
    else:
        opt = torch.optim.AdamW([p], lr=case["lr"]["lr"], betas=betas, eps=case["eps"],
                                weight_decay=case["weight_decay"], **kwargs)
    scaler = Scaler(case["loss_scale"])
    t = 0
    lrs, skips, scales = [], [], []
    for s in range(STEPS):
        scale = scaler.scale
        g = torch.from_numpy(grads[s])
        stored = (g * scale).to(TORCH_DTYPES[case["grad_dtype"]]).float()
        p.grad = stored * torch.tensor(1.0 / scale, dtype=torch.float32)  # GradScaler.unscale_
        overflow = not bool(torch.isfinite(p.grad).all())
        skip = scaler.update(overflow)
        skips.append(skip)
        scales.append(scale)
        if skip:
            lrs.append(lr_at(case["lr"], t + 1))
            continue
        t += 1
        lr = lr_at(case["lr"], t)
        lrs.append(lr)
        if case["max_grad_norm"] > 0:
            torch.nn.utils.clip_grad_norm_([p], case["max_grad_norm"])
        opt.param_groups[0]["lr"] = lr
        opt.step()
    return p.detach().numpy().copy(), dict(lrs=lrs, skips=skips, scales=scales, steps=t,
                                           final_scale=scaler.scale, overflows=scaler.overflows)


def run_float64(case, p0, grads):
    """The same steps in float64 (numpy): the exact answer both fp32 codes approximate."""
    p = p0.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    scaler = Scaler(case["loss_scale"])
    t = 0
    b1, b2, wd, eps = case["beta1"], case["beta2"], case["weight_decay"], case["eps"]
    for s in range(STEPS):
        scale = scaler.scale
        stored = torch.from_numpy(grads[s] * np.float32(scale)).to(TORCH_DTYPES[case["grad_dtype"]])
        g = stored.double().numpy() / scale
        if scaler.update(not np.all(np.isfinite(g))):
            continue
        t += 1
        lr = lr_at(case["lr"], t)
        if case["max_grad_norm"] > 0:
            g = g * min(1.0, case["max_grad_norm"] / (math.sqrt(float(np.dot(g, g))) + 1e-6))
        if case["decay"] == "l2":
            g = g + wd * p
        else:
            p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1 ** t) * m / (np.sqrt(v) / math.sqrt(1 - b2 ** t) + eps)
    return p


def max_rel(a, b):
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    den = np.max(np.abs(b))
    return float(np.max(np.abs(a - b)) / den) if den > 0 else float(np.max(np.abs(a - b)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tidal", default="build/tidal")
    ap.add_argument("--numel", type=int, default=1_000_003)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--keep", help="write the case directories here and keep them")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = torch_variants()
    root = args.keep or tempfile.mkdtemp(prefix="tidal-adam-check-")
    os.makedirs(root, exist_ok=True)
    n = args.numel
    chunks = [int(n * 0.3), int(n * 0.5)]
    chunks.append(n - sum(chunks))
    worst, failures, runs = 0.0, [], 0
    rng = np.random.default_rng(1234)
    try:
        for case in CASES:
            d = os.path.join(root, case["name"])
            os.makedirs(d, exist_ok=True)
            p0 = (rng.standard_normal(n) * 0.05).astype(np.float32)
            grads = np.empty((STEPS, n), dtype=np.float32)
            for s in range(STEPS):
                grads[s] = rng.standard_normal(n) * (0.002 if s % 3 else 0.02)
            if case["inf_step"] is not None:
                grads[case["inf_step"], n // 2] = np.inf
            meta = {k: case[k] for k in ("grad_dtype", "param_dtype", "decay", "beta1", "beta2", "eps",
                                         "weight_decay", "max_grad_norm", "lr", "loss_scale")}
            meta.update(numel=n, steps=STEPS, chunks=chunks)
            with open(os.path.join(d, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
            p0.tofile(os.path.join(d, "param0.f32"))
            grads.tofile(os.path.join(d, "grads.f32"))

            ref = {}
            for vname, kwargs in variants:
                ref[vname], replay = run_torch(case, p0, grads, kwargs)
            print(f"case {case['name']}: grad {case['grad_dtype']}, {n} params in {len(chunks)} chunks, "
                  f"{STEPS} steps, {sum(replay['skips'])} skipped, final loss scale {replay['final_scale']:g}")
            base = variants[0][0]
            for vname, _ in variants[1:]:
                print(f"  noise floor: torch {base} vs {vname}: {max_rel(ref[vname], ref[base]):.3g}")
            exact = run_float64(case, p0, grads)
            print("  fp32 rounding: " + ", ".join(f"torch {v} vs float64 {max_rel(ref[v], exact):.3g}" for v in ref))
            for isa in ("scalar", "avx2", "avx512"):
                r = subprocess.run([args.tidal, "bench", "adam", "--check-dir", d, "--isa", isa,
                                    "--threads", str(args.threads)], capture_output=True, text=True)
                if r.returncode != 0:
                    if "lacks" in r.stderr:
                        print(f"  {isa}: not supported by this CPU, skipped")
                        continue
                    failures.append(f"{case['name']} {isa}: tidal failed: {r.stderr.strip()}")
                    print(f"  {isa}: tidal FAILED: {r.stderr.strip()}")
                    continue
                runs += 1
                master = np.fromfile(os.path.join(d, "out_master.f32"), dtype=np.float32)
                with open(os.path.join(d, "out.json")) as f:
                    out = json.load(f)
                diffs = {v: max_rel(master, ref[v]) for v in ref}
                line = ", ".join(f"vs torch {v} {x:.3g}" for v, x in diffs.items())
                line += f" (vs float64 {max_rel(master, exact):.3g})"
                bad = [f"{v} {x:.3g} > {LIMIT:g}" for v, x in diffs.items() if not x <= LIMIT]
                # The decisions must be the same step by step.
                skips = [s["skip"] for s in out["steps"]]
                if skips != replay["skips"]:
                    bad.append(f"skipped steps {skips} != {replay['skips']}")
                if out["final_loss_scale"] != replay["final_scale"]:
                    bad.append(f"final loss scale {out['final_loss_scale']} != {replay['final_scale']}")
                if [s["loss_scale"] for s in out["steps"]] != replay["scales"]:
                    bad.append("loss scale sequence differs")
                for s, (a, b) in enumerate(zip([s["lr"] for s in out["steps"]], replay["lrs"])):
                    if abs(a - b) > 1e-15 * abs(b):
                        bad.append(f"lr of step {s + 1}: {a!r} != {b!r}")
                if out["step"] != replay["steps"]:
                    bad.append(f"AdamW steps {out['step']} != {replay['steps']}")
                # The 16-bit output is tidal's own master rounded (RNE).
                pd = case["param_dtype"]
                outp = np.fromfile(os.path.join(d, "out_param.bin"),
                                   dtype={"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}[pd])
                want = torch.from_numpy(master).to(TORCH_DTYPES[pd])
                want = want.view(torch.int16).numpy().view(np.uint16) if pd == "bf16" else want.numpy()
                if not np.array_equal(outp.view(np.uint16 if pd != "fp32" else np.uint32),
                                      want.view(np.uint16 if pd != "fp32" else np.uint32)):
                    bad.append(f"{pd} param output is not the master rounded to nearest even")
                worst = max([worst] + list(diffs.values()))
                print(f"  tidal {out['isa']} ({out['threads']} threads): {line}  {'ok' if not bad else 'FAIL'}")
                for b in bad:
                    failures.append(f"{case['name']} {isa}: {b}")
                    print(f"    {b}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if runs == 0:
        failures.append("no tidal run completed")
    if failures:
        print(f"FAIL: {len(failures)} problem(s); worst max relative difference {worst:.3g} (limit {LIMIT:g})")
        return 1
    print(f"PASS: tidal CPU AdamW vs torch.optim.AdamW on CPU, {STEPS} steps: max relative difference on params "
          f"{worst:.3g} <= {LIMIT:g} ({len(CASES)} cases, {runs} tidal runs, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
