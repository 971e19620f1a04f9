#!/usr/bin/env python3
"""The attention peer of `tidal bench attention` (docs/benchmarks.md).

PyTorch's scaled_dot_product_attention with only the flash backend allowed
(torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)), causal, at the
shapes tidal's bench takes: B = tokens / T sequences of T, NH query heads
and NKV key/value heads of head size hs (enable_gqa when NKV < NH), bf16 or
fp16, q, k, v of shape (B, NH or NKV, T, hs) as views of (B, T, heads, hs)
tensors (the layout a fused projection writes).  Times, with CUDA events,
the median of --repeat runs after two warm-ups: the forward alone, the
backward alone (from a forward kept for it; retain_graph) and the two
together.  FLOPs as tidal counts them: forward 2 B NH T^2 hs (causal: half
of the two products), backward 2.5 times that.

Prints one JSON object:
    {"peer": "torch SDPA (flash)", "torch": VERSION, "device": NAME,
     "results": [{"T": T, "hs": hs, "B": B, "NH": NH, "NKV": NKV,
                  "forward_ms": F, "backward_ms": B, "fwd_bwd_ms": FB,
                  "forward_tflops": ..., "backward_tflops": ..., "fwd_bwd_tflops": ...}
                 or {..., "error": MESSAGE}, ...]}
"""
import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F


def timed(fn, repeat):
    """Median ms of repeat runs of fn after two warm-ups, CUDA events on the current stream."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def one(T, hs, NH, NKV, tokens, dtype, repeat):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B = max(1, tokens // T)
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    q = (torch.rand(B, T, NH, hs, device=dev, generator=g, dtype=torch.float32) * 2 - 1).to(dtype).transpose(1, 2)
    k = (torch.rand(B, T, NKV, hs, device=dev, generator=g, dtype=torch.float32) * 2 - 1).to(dtype).transpose(1, 2)
    v = (torch.rand(B, T, NKV, hs, device=dev, generator=g, dtype=torch.float32) * 2 - 1).to(dtype).transpose(1, 2)
    for t in (q, k, v):
        t.requires_grad_(True)
    dout = (torch.rand(B, NH, T, hs, device=dev, generator=g, dtype=torch.float32) * 2 - 1).to(dtype)
    kw = {"is_causal": True}
    if NKV != NH:
        kw["enable_gqa"] = True
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, **kw)

        out = F.scaled_dot_product_attention(q, k, v, **kw)

        def bwd():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        def both():
            o = F.scaled_dot_product_attention(q, k, v, **kw)
            torch.autograd.grad(o, (q, k, v), dout)

        f_ms, b_ms, fb_ms = timed(fwd, repeat), timed(bwd, repeat), timed(both, repeat)
    flops = 2.0 * B * NH * T * T * hs
    return {"T": T, "hs": hs, "B": B, "NH": NH, "NKV": NKV, "forward_ms": f_ms, "backward_ms": b_ms,
            "fwd_bwd_ms": fb_ms, "forward_tflops": flops / f_ms * 1e-9, "backward_tflops": 2.5 * flops / b_ms * 1e-9,
            "fwd_bwd_tflops": 3.5 * flops / fb_ms * 1e-9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="1024,4096,8192", help="sequence lengths, comma-separated (default 1024,4096,8192)")
    ap.add_argument("--head-dims", default="64,128", help="head sizes, comma-separated (default 64,128)")
    ap.add_argument("--width", type=int, default=2048, help="query heads x head size (default 2048)")
    ap.add_argument("--group", type=int, default=1, help="query heads a key/value head (default 1: multi-head)")
    ap.add_argument("--tokens", type=int, default=16384, help="B = tokens / T sequences (default 16384)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("sdpa_attention.py: no CUDA device", file=sys.stderr)
        return 1
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float16
    results = []
    for hs in [int(x) for x in a.head_dims.split(",")]:
        for T in [int(x) for x in a.seqs.split(",")]:
            NH = max(1, a.width // hs)
            NKV = max(1, NH // a.group)
            try:
                results.append(one(T, hs, NH, NKV, a.tokens, dtype, a.repeat))
            except Exception as e:  # a shape SDPA's flash backend refuses: recorded, the others still run
                results.append({"T": T, "hs": hs, "NH": NH, "NKV": NKV, "error": str(e)})
            torch.cuda.empty_cache()
    print(json.dumps({"peer": "torch SDPA (flash)", "torch": torch.__version__,
                      "device": torch.cuda.get_device_name(), "precision": a.precision, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
