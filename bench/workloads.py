#!/usr/bin/env python3
"""tidal beside its peers on the GPU workloads of docs/benchmarks.md, in one run.

For each workload (W1, W2, W3, W4, W6, W7, and the LLaMA-family W8, W8S, W9
of docs/benchmarks.md) this runs, one process after the other on the same GPU:

  tidal   `tidal train --backend cuda --precision bf16` on a random-token file
          this script writes (tidal's token-file format, docs/data.md: uint16
          ids for GPT-2's vocabulary, uint32 for Llama 3's 128256 and
          Qwen2.5's 151936), with the workload's shape (W8, W9: `--model`
          llama-3.1-8b / qwen2.5-0.5b, tidal's presets of those shapes),
          tokens per step, --gpu-budget and --optim-state (W8: bf16, which
          `tidal plan` fits in 90 GiB of a 125 GiB host where fp32 state
          needs 120 GiB; W8S: the same shape with as many layers as the
          FSDP2 peer's host check passes in 0.9 of this machine's
          available memory, fp32 state on
          both sides, W8's fallback); tokens/s is
          the median of its log's tokens_per_s over the steps after the
          warm-up (4..8 of 8); its peak device bytes are the log's
          device_peak_bytes; its lower bound is `tidal plan --json`'s
          estimate.step_lower_bound_ms for the same flags, the lower of
          two plans, one before the run and one after (a shared host's
          DRAM rate moves from minute to minute; the notes give both).  At a budget tidal
          is given what the peer is: every candidate micro-batch the plan
          fits is run and the fastest is its figure (without a budget, or
          with --quick, the first the plan fits).  --ckpt stays auto: tidal
          recomputes the fewest blocks that leave its chunks their room.
  peers   bench/peers/torch_gpt.py: PyTorch eager (W1, W2) or FSDP2 with CPU
          offload on one GPU (W3, W4, W6), with the same shape and tokens per
          step; bench/peers/torch_hf.py for W8 (FSDP2 CPU offload of
          LlamaForCausalLM, fp32 AdamW state) and W9 (PyTorch eager
          Qwen2ForCausalLM).  A peer whose offloaded state cannot fit the
          host's memory says so before it allocates (exit 5) and its row
          reads "does not fit (host memory)"; one the kernel kills anyway
          (SIGKILL) is reported the same way.  A peer at a budget gets its best micro-batch within it: each
          candidate (B x K, checkpointing) of the workload is run, a run that
          runs out of memory or peaks over the budget is skipped (and listed),
          and the fastest of the rest is the peer's figure.  Without a budget
          the first candidate that runs is taken (the next ones are only
          fallbacks for a GPU too small for the workload's batch).

While each process runs, nvidia-smi samples the GPU's used memory every 100
ms: its peak minus the use before the start (CUDA context included) is printed
beside the allocator's own peak.

Then a table: tokens/s of each system, tidal/peer, the workload's target
ratio, tidal's peak device bytes against the budget, and tidal's lower bound
(max of compute, PCIe bytes / bandwidth, CPU AdamW, and host DRAM: the CPU
AdamW's bytes and the copies' at the rate the two reach together, as `tidal
plan` measures them) with how close the step comes to it.  A system that fails is reported
("not available: <its message>") and the run goes on.  Exit status 0 unless
the flags are bad or the data file cannot be written.

Usage (on the GPU machine, from the repository root, after `make`):
    python3 bench/workloads.py                       # W1,W2,W3,W4,W6
    python3 bench/workloads.py --workloads W9,W8 --quick --run-timeout 360
    python3 bench/workloads.py --workloads W1 --json out/bench-gpu/w1.json
    python3 bench/workloads.py --smoke               # tiny shapes: plumbing check in ~1 minute

Each workload's figures go to bench/results/<id>.json (bench/results.py), from
which bench/report.py makes docs/performance.md's tables; --smoke and
--tidal-backend cpu write none unless --results names a folder.
"""
import argparse
import array
import datetime
import glob
import json
import os
import platform
import random
import shlex
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results as res  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
VOCAB = 50304          # padded vocabulary (docs/benchmarks.md)
TOKEN_RANGE = 50257    # ids drawn from GPT-2's real vocabulary
EOT = 50256
HERE = os.path.dirname(os.path.abspath(__file__))
PEER_DIR = os.path.join(HERE, "peers")
PEER_SCRIPT = os.path.join(PEER_DIR, "torch_gpt.py")
EXIT_PEER_USAGE, EXIT_PEER_HOST_MEMORY = 2, 5  # torch_gpt.py's exit statuses


class LlamaShape:
    """A LLaMA-family workload's model: tidal's preset (and the peer's, bench/peers/torch_hf.py) of that name,
    its key/value heads, MLP width and vocabulary (ids drawn from all of it), the end-of-text id the token
    file names, and the AdamW state tidal keeps (None: fp32)."""

    def __init__(self, preset, kv_heads, mlp, vocab, eot, optim_state=None):
        self.preset, self.kv_heads, self.mlp, self.vocab, self.eot = preset, kv_heads, mlp, vocab, eot
        self.optim_state = optim_state

    def shrunk(self):
        """--smoke: 2 layers of 128 wide, 2 heads (hs 64), 1 key/value head, MLP 256; the vocabulary stays (the
        token file's uint32 ids are part of what the smoke run checks)."""
        return LlamaShape(self.preset, 1, 256, self.vocab, self.eot, self.optim_state)


class Workload:
    def __init__(self, wid, name, shape, budget_gib, tokens, tidal, peer_mode, peer_cands, target,
                 llama=None, ranks=1):
        self.id = wid
        self.name = name                  # "1.5B (48L/1600/25H)"
        self.shape = shape                # (layers, width, heads)
        self.budget_gib = budget_gib      # None: unlimited
        self.tokens = tokens              # tokens per optimizer step
        self.tidal = tidal                # [(B, K)]: largest micro-batch first; the first the plan fits runs
        self.peer_mode = peer_mode        # torch_gpt.py --mode
        self.peer_cands = peer_cands      # [(B, K, ckpt)]
        self.target = target              # the tidal/peer ratio the workload aims at
        self.llama = llama                # LlamaShape, or None: GPT-2
        self.ranks = ranks                # GPUs (tidal --nproc, torchrun for the peer); B is per rank
        self.data = None                  # its token file (main writes it; None: the caller's a.data)
        self.peer_args = []               # more flags for the peer script (bench/lora.py: the LoRA config)

    @property
    def vocab(self):
        return self.llama.vocab if self.llama else VOCAB

    @property
    def peer_script(self):
        return os.path.join(PEER_DIR, "torch_hf.py") if self.llama else PEER_SCRIPT


M124, M1_5, M4_1 = (12, 768, 12), (48, 1600, 25), (32, 3200, 25)
L8B, Q05B = (32, 4096, 32), (24, 896, 14)
WORKLOADS = [
    Workload("W1", "124M (12L/768/12H)", M124, None, 16 * 1024, [(16, 1)],
             "eager", [(16, 1, False), (8, 2, False), (4, 4, False)], 1.0),
    Workload("W2", "1.5B (48L/1600/25H)", M1_5, None, 8 * 1024, [(8, 1)],
             "eager", [(8, 1, False), (4, 2, False), (8, 1, True)], 1.0),
    Workload("W3", "1.5B (48L/1600/25H)", M1_5, 24, 32 * 1024, [(32, 1), (16, 2), (8, 4), (4, 8)],
             "fsdp2-offload", [(32, 1, True), (16, 2, True), (8, 4, True)], 1.3),
    Workload("W4", "4.1B (32L/3200/25H)", M4_1, 24, 16 * 1024, [(16, 1), (8, 2), (4, 4)],
             "fsdp2-offload", [(16, 1, True), (8, 2, True)], 1.3),
    Workload("W6", "1.5B (48L/1600/25H)", M1_5, 8, 16 * 1024, [(16, 1), (8, 2), (4, 4), (2, 8)],
             "fsdp2-offload", [(16, 1, True), (8, 2, True), (4, 4, True), (2, 8, True)], 1.0),
    # Targets: W8 >= 1.5x FSDP2, W9 >= 1.5x eager.  W8's tidal keeps bf16 AdamW state (fp32 needs
    # 120 of the host's 125 GiB by `tidal plan`); FSDP2's fp32 state needs ~16 bytes a param, 128 GB.
    # W7: tidal on 2 GPUs (ZeRO-3, --nproc 2) beside FSDP2 CPU offload on 2 (torchrun) and beside tidal on
    # one GPU at the same global batch (main runs that too); B is per rank, 64k tokens a step in all.
    Workload("W7", "1.5B (48L/1600/25H) on 2 GPUs", M1_5, 24, 64 * 1024, [(32, 1), (16, 2), (8, 4)],
             "fsdp2-offload", [(32, 1, True), (16, 2, True), (8, 4, True)], 1.5, ranks=2),
    Workload("W8", "llama-3.1-8b (32L/4096/32H, 8 KV heads, MLP 14336, vocab 128256)", L8B, 24, 16 * 1024,
             [(16, 1), (8, 2), (4, 4)], "fsdp2-offload", [(16, 1, True), (8, 2, True), (4, 4, True), (2, 8, True)],
             1.5, llama=LlamaShape("llama-3.1-8b", 8, 14336, 128256, 128001, "bf16")),
    # W8's fallback: FSDP2's fp32 state does not fit the host at 8.03B, so the same LLaMA shape with
    # the most layers the peer's host check passes on this machine (main sets them), both with fp32 AdamW state.
    Workload("W8S", "llama-3.1-8b shape, as many layers as FSDP2 offload fits the host", L8B, 24, 16 * 1024,
             [(16, 1), (8, 2), (4, 4)], "fsdp2-offload", [(16, 1, True), (8, 2, True), (4, 4, True), (2, 8, True)],
             1.5, llama=LlamaShape("llama-3.1-8b", 8, 14336, 128256, 128001)),
    Workload("W9", "qwen2.5-0.5b (24L/896/14H, 2 KV heads, MLP 4864, vocab 151936)", Q05B, None, 16 * 1024,
             [(16, 1), (8, 2)], "eager", [(16, 1, False), (8, 2, False), (4, 4, False)], 1.5,
             llama=LlamaShape("qwen2.5-0.5b", 2, 4864, 151936, 151643)),
]
for _w in WORKLOADS:  # every candidate keeps the workload's tokens per step
    assert all(b * k * 1024 * _w.ranks == _w.tokens for b, k in _w.tidal), _w.id
    assert all(b * k * 1024 * _w.ranks == _w.tokens for b, k, _ in _w.peer_cands), _w.id
# peft-lora: W12's peer (bench/lora.py, bench/peers/peft_lora.py)
PEER_NAMES = {"eager": "PyTorch eager", "fsdp2-offload": "FSDP2 CPU offload", "peft-lora": "peft LoRA"}


def llama_params(layers, width, heads, kv_heads, mlp, vocab):
    """Parameters of an untied LLaMA model without biases (Llama 3.1's layout): embeddings and head, and per
    block q, k, v, o, gate, up, down and two RMSNorm gains, then the final norm."""
    kv_width = kv_heads * (width // heads)
    block = 2 * width * width + 2 * width * kv_width + 3 * width * mlp + 2 * width
    return 2 * vocab * width + layers * block + width


# W8S's share of the available memory for the peer's estimate.  At 31 layers (7.81B) the peer's own check
# passed with 122.4 of 124.0 GiB (2026-11-27, H200 machine): it set up in 60 s, ran its warm-up step in
# 55.7 s, then had not finished the next one 350 s later (its AdamW state, taken in the first step, left the
# host no room).  A tenth is left for what 16 bytes a param does not count.
PEER_HOST_SHARE = 0.9


def fit_peer_host(w):
    """W8S: the most layers (<= the preset's) whose FSDP2 CPU-offload host state passes the peer's own host check
    (bench/peers/torch_gpt.py: bytes a param + margin) against PEER_HOST_SHARE of MemAvailable or the cgroup's
    room.  None where the host's memory cannot be read (the preset's layers stay)."""
    sys.path.insert(0, PEER_DIR)
    import torch_gpt  # the peer's check itself: no torch at import time
    avail = torch_gpt.mem_available_bytes()
    if avail is None:
        return None
    L, C, H = w.shape
    while L > 1 and (llama_params(L, C, H, w.llama.kv_heads, w.llama.mlp, w.vocab) * torch_gpt.HOST_BYTES_PER_PARAM
                     + torch_gpt.HOST_MARGIN_BYTES) > PEER_HOST_SHARE * avail:
        L -= 1
    n = llama_params(L, C, H, w.llama.kv_heads, w.llama.mlp, w.vocab)
    w.shape = (L, C, H)
    w.name = (f"llama-3.1-8b shape with {L} of 32 layers ({n / 1e9:.2f}B, {L}L/{C}/{H}H, 8 KV heads, MLP "
              f"{w.llama.mlp}): the most FSDP2 offload fits in {PEER_HOST_SHARE:g} of {avail / GIB:.1f} GiB "
              "available")
    return L


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scaling_target(n):
    """What n GPUs should give over one of the same host at the same global batch (docs/benchmarks.md):
    1.95x on 2, 3.7x on 4, 7.2x on 8; else 92.5% of n."""
    return {2: 1.95, 4: 3.7, 8: 7.2}.get(n, round(0.925 * n, 2))


def widened(w, n):
    """A several-GPU workload (W7) on n GPUs instead of its own count: the same model, budget a GPU and tokens a
    step, each candidate's micro-batch x accumulation scaled to n ranks (those that divide evenly); its id is
    the workload's own at its own width, else '<id>x<n>' (W7x4, as docs/benchmarks.md names it), so each width has its results file."""
    if n == w.ranks:
        return w
    per = w.tokens // (1024 * n)
    if per * 1024 * n != w.tokens or per < 1:
        raise ValueError(f"{w.id}: {w.tokens} tokens a step do not split over {n} ranks of 1024-token sequences")
    bs = [b for b in (64, 32, 16, 8, 4, 2, 1) if per % b == 0]
    tidal = [(b, per // b) for b in bs if b <= max(bb for bb, _ in w.tidal)][:3]
    peer = [(b, per // b, True) for b in bs if b <= max(bb for bb, _, _ in w.peer_cands)][:3]
    nw = Workload(f"{w.id}x{n}", w.name.replace(f" on {w.ranks} GPUs", f" on {n} GPUs"), w.shape, w.budget_gib,
                  w.tokens, tidal, w.peer_mode, peer, w.target, llama=w.llama, ranks=n)
    nw.peer_args = list(w.peer_args)
    return nw


def one_gpu(w):
    """A several-GPU workload's single-GPU run of the same global batch: tidal alone, one rank, K x ranks."""
    return Workload(w.id + "-1gpu", w.name.replace(f" on {w.ranks} GPUs", "") + " on 1 GPU", w.shape, w.budget_gib,
                    w.tokens, [(b, k * w.ranks) for b, k in w.tidal], w.peer_mode, [], w.target, llama=w.llama)


def say(msg=""):
    print(msg, flush=True)


def gib(b):
    return "-" if b is None else f"{b / GIB:.2f} GiB"


# ---- the token file -----------------------------------------------------------

def write_token_file(path, n_tokens, seed, vocab=VOCAB, token_range=TOKEN_RANGE, eot=EOT, kind=2):
    """Random ids below token_range in tidal's token-file format, version 1
    (docs/data.md): a 64-byte little-endian header (magic, version, header
    bytes, token bytes, tokenizer kind (2 gpt2, 3 tokenizer.json), vocab size,
    end-of-text id, token count, payload CRC-32, 16 reserved zero bytes, CRC-32
    of header bytes [0, 60)), then the ids as uint16 where the vocabulary is at
    most 65536, else uint32 (the width tidal requires of that vocabulary)."""
    width = 2 if vocab <= 65536 else 4
    code = next(c for c in ("H", "I", "L") if array.array(c).itemsize == width)
    rng = random.Random(seed)
    toks = array.array(code, (rng.randrange(token_range) for _ in range(n_tokens)))
    if sys.byteorder != "little":
        toks.byteswap()
    payload = toks.tobytes()
    head = struct.pack("<8sIIIIIIQI16s", b"TDTOKENS", 1, 64, width, kind, vocab, eot, n_tokens,
                       zlib.crc32(payload), bytes(16))
    assert len(head) == 60
    head += struct.pack("<I", zlib.crc32(head))
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(head)
        f.write(payload)
    os.replace(tmp, path)


# ---- running a process --------------------------------------------------------

class SmiMonitor:
    """Peak GPU memory use (nvidia-smi, every 100 ms) while a process runs, less the use before it."""

    def __init__(self):
        self.gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        if not self.gpu.isdigit():
            self.gpu = "0"
        self.proc, self.thread, self.peak_mib, self.base_mib = None, None, None, None

    def _query(self):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", self.gpu], capture_output=True, text=True, timeout=20)
            return int(out.stdout.split()[0]) if out.returncode == 0 else None
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def start(self):
        self.base_mib = self._query()
        if self.base_mib is None:
            return
        self.peak_mib = self.base_mib
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                          "-i", self.gpu, "-lms", "100"], stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.peak_mib = max(self.peak_mib, int(line.strip()))
            except ValueError:
                pass

    def stop(self):
        """Bytes above the baseline at the peak, or None without nvidia-smi."""
        if self.proc:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.thread.join(timeout=10)
        if self.base_mib is None or self.peak_mib is None:
            return None
        return (self.peak_mib - self.base_mib) * MIB


RUNNING = []  # the process run_logged waits for: a session of its own, which a signal to this script misses


def stop_group(p, grace_s):
    """SIGTERM to p's process group, SIGKILL after grace_s seconds."""
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=grace_s)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def on_signal(signum, frame):
    """SIGTERM, SIGINT, SIGHUP (a `timeout` around this script, Ctrl-C): the running system's processes end too,
    so none lives on holding the GPU and host memory the next run measures."""
    for p in list(RUNNING):
        stop_group(p, 10)
    sys.stderr.write(f"bench/workloads.py: stopped by signal {signum}\n")
    sys.exit(128 + signum)


def run_logged(cmd, log_path, timeout_s):
    """Runs cmd with stdout and stderr into log_path; returns (rc, smi_bytes, seconds).  rc 124: timed out."""
    smi = SmiMonitor()
    smi.start()
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        logf.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        logf.flush()
        try:
            p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            logf.write(f"cannot start: {e}\n")
            smi.stop()
            return 127, None, 0.0
        RUNNING.append(p)
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(p, 30)
            logf.write(f"\n(killed after {timeout_s} s)\n")
            rc = 124
        finally:
            RUNNING.remove(p)
    return rc, smi.stop(), time.perf_counter() - t0


def tail(path, n=4):
    try:
        with open(path, errors="replace") as f:
            lines = [ln.rstrip() for ln in f if ln.strip() and not ln.startswith("$ ")]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def read_jsonl(path):
    """The JSON objects of a --log file, a line each; [] when it is missing or unreadable."""
    try:
        with open(path) as f:
            return [json.loads(ln) for ln in f if ln.strip()]
    except (OSError, ValueError):
        return []


def last_json(path):
    """The last line of the file that parses as a JSON object, or None."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for ln in reversed(lines):
        ln = ln.strip()
        if ln.startswith("{"):
            try:
                return json.loads(ln)
            except ValueError:
                continue
    return None


# ---- tidal --------------------------------------------------------------------

def model_flags(w):
    """The model's shape for tidal: GPT-2 by its sizes; a LLaMA-family preset with its sizes spelt out (equal to
    the preset's, or --smoke's smaller ones) and the AdamW state."""
    L, C, H = w.shape
    f = ["--layers", str(L), "--width", str(C), "--heads", str(H)]
    if w.llama:
        f = ["--model", w.llama.preset] + f + ["--kv-heads", str(w.llama.kv_heads), "--mlp-width", str(w.llama.mlp)]
        if w.llama.optim_state:
            f += ["--optim-state", w.llama.optim_state]
    return f + ["--vocab", str(w.vocab)]


def tidal_flags(a, w, B, K):
    f = ["--backend", a.tidal_backend, "--precision", "bf16" if a.tidal_backend == "cuda" else "fp32",
         "--data", w.data or a.data] + model_flags(w) + ["--seq", str(a.seq), "--micro-batch", str(B), "--grad-accum", str(K), "--steps", str(a.steps),
         "--lr", "1e-4", "--schedule", "constant", "--warmup", "0", "--clip-grad-norm", f"{a.clip:g}",
         "--seed", "1337"]
    if w.budget_gib is not None:
        f += ["--gpu-budget", f"{w.budget_gib:g}GiB"]
    if w.ranks > 1:
        f += ["--nproc", str(w.ranks)]
    return f + shlex.split(a.tidal_args)


def tidal_plan(a, w, B, K, tag=""):
    log_path = os.path.join(a.workdir, f"{w.id}-tidal-plan-B{B}x{K}{tag}.out")
    cmd = [a.tidal, "plan"] + tidal_flags(a, w, B, K) + ["--json"]
    rc, _, _ = run_logged(cmd, log_path, 300)
    plan = last_json(log_path)
    if plan is None or rc not in (0, 3):
        return None, f"tidal plan failed (exit {rc}): {tail(log_path, 2)}"
    return plan, None


def run_tidal_once(a, w, B, K, plan):
    """One tidal training run of --steps steps at B x K; its figures from the JSON-lines log."""
    res = {"batch": B, "grad_accum": K, "plan": plan, "error": None,
           "lower_bound_ms": plan["estimate"]["step_lower_bound_ms"] if plan else None,
           "ckpt_blocks": plan.get("ckpt_blocks") if plan else None,
           "budget_bytes": None if w.budget_gib is None else int(w.budget_gib * GIB)}
    log_file = os.path.join(a.workdir, f"{w.id}-tidal-B{B}x{K}.jsonl")
    out_file = os.path.join(a.workdir, f"{w.id}-tidal-B{B}x{K}.out")
    if os.path.exists(log_file):
        os.remove(log_file)
    cmd = [a.tidal, "train"] + tidal_flags(a, w, B, K) + ["--log", log_file, "--log-every", "100"]
    res["command"] = " ".join(shlex.quote(c) for c in cmd)
    rc, smi, secs = run_logged(cmd, out_file, a.run_timeout)
    res.update(exit=rc, smi_bytes=smi, seconds=secs, output=out_file)
    steps = read_jsonl(log_file)
    timed = [s for s in steps if s.get("step", 0) > a.warmup]
    if rc != 0 or not timed:
        why = tail(out_file, 2) or "no output"
        res["error"] = f"{killed(rc) or f'exit {rc}'}, {len(steps)} steps logged: {why}"
        return res
    # The bound again, from a plan after the run: a shared host's DRAM rate
    # moves from minute to minute (the CPU AdamW probe read 3.21 and 4.30 G
    # params/s on one H200 VM minutes apart), and a lower bound takes the faster.
    after, err = tidal_plan(a, w, B, K, "-after")
    if err:
        res["plan_after_error"] = err
    elif plan and after:
        res["plan_before"], res["plan_after"] = plan, after
        if after["estimate"]["step_lower_bound_ms"] < plan["estimate"]["step_lower_bound_ms"]:
            res["plan"], res["lower_bound_ms"], res["bound_from"] = after, after["estimate"]["step_lower_bound_ms"], "after"
        else:
            res["bound_from"] = "before"
    res["tokens_per_s"] = statistics.median(s["tokens_per_s"] for s in timed)
    res["step_ms_median"] = statistics.median(s["step_ms"] for s in timed)
    res["timed_steps"] = len(timed)
    res["peak_bytes"] = max(s.get("device_peak_bytes", 0) for s in steps)
    res["within_budget"] = None if res["budget_bytes"] is None else res["peak_bytes"] <= res["budget_bytes"]
    res["loss_last"] = steps[-1].get("loss")
    return res


def describe_run(cfg, r):
    """One tried configuration of tidal or a peer, as the notes list it."""
    if r.get("error"):
        return f"{cfg}: failed ({r['error'][:300]})"
    s = f"{cfg}: {r['tokens_per_s']:.0f} tok/s, peak {gib(r['peak_bytes'])}"
    if r.get("within_budget") is False:
        s += f" > budget {gib(r['budget_bytes'])} (skipped)"
    return s


def describe_tidal_run(r):
    cfg = f"B{r['batch']}x{r['grad_accum']}"
    if r.get("ckpt_blocks") is not None:
        cfg += f" ({r['ckpt_blocks']} blocks recomputed)"
    return describe_run(cfg, r)


def run_tidal(a, w):
    """tidal's row, chosen as the peer's is: with no budget (or --quick) the first candidate micro-batch the
    plan fits, else the fastest of those the plan fits, each trained for --steps steps."""
    res = {"system": "tidal", "error": None, "tried": [], "runs": []}
    if not os.access(a.tidal, os.X_OK):
        res["error"] = f"{a.tidal} is not an executable (run `make` first)"
        return res
    take_first = w.budget_gib is None or a.quick
    cands = candidates(a, w, [(b, k, None) for b, k in w.tidal])
    if a.tidal_batch:
        only = {tuple(int(x) for x in c.split("x")) for c in a.tidal_batch.split(",")}
        cands = [c for c in cands if c in only]
        if not cands:
            res["error"] = f"--tidal-batch {a.tidal_batch} names none of {w.id}'s candidates"
            return res
    fitting = []
    for B, K in cands:
        plan, err = tidal_plan(a, w, B, K)
        if err:  # no plan, no bound: train the first candidate anyway (its own message says more)
            res["plan_error"] = err
            fitting = [(cands[0][0], cands[0][1], None)]
            break
        fits = plan["device"]["fits"] and plan["host"]["fits"]
        res["tried"].append({"batch": B, "grad_accum": K, "plan_fits": fits,
                             "plan_min_device_bytes": plan["device"]["min_bytes"],
                             "plan_host_pinned_bytes": plan["host"]["pinned_bytes"]})
        if fits:
            fitting.append((B, K, plan))
            if take_first:
                break
    if not fitting:
        t = res["tried"][-1]
        tried = ", ".join("B%dx%d" % (c["batch"], c["grad_accum"]) for c in res["tried"])
        res["error"] = (f"`tidal plan` fits none of {tried} (the last needs {gib(t['plan_min_device_bytes'])} on the device, "
                        f"{gib(t['plan_host_pinned_bytes'])} pinned)")
        return res
    best = None
    for B, K, plan in fitting:
        r = run_tidal_once(a, w, B, K, plan)
        res["runs"].append(r)
        if len(fitting) > 1:
            say(f"  tidal {describe_tidal_run(r)}")
        ok = r.get("error") is None and r.get("within_budget") is not False
        if ok and (best is None or r["tokens_per_s"] > best["tokens_per_s"]):
            best = r
    if best is None:
        res["error"] = "; ".join(describe_tidal_run(r) for r in res["runs"])
        if res.get("plan_error"):
            res["error"] += f"; {res['plan_error']}"
        return res
    res.update({k: v for k, v in best.items() if k != "error"})
    return res


def candidates(a, w, cands):
    """The workload's candidates, shrunk for --smoke (micro-batch at most 2, same K), without repeats."""
    out = []
    for B, K, ck in cands:
        if a.smoke:
            B = min(B, 2)
        c = (B, K) if ck is None else (B, K, ck)
        if c not in out:
            out.append(c)
    return out


def killed(rc):
    """A message for a process ended by a signal (run_logged's negative rc), else None."""
    if rc >= 0:
        return None
    why = " (the kernel's OOM killer, likely: out of host memory)" if rc == -signal.SIGKILL else ""
    return f"killed by signal {-rc}{why}"


def run_peer_once(a, w, B, K, ck):
    L, C, H = w.shape
    name = f"{w.id}-{w.peer_mode}-B{B}x{K}{'-ckpt' if ck else ''}"
    out_file = os.path.join(a.workdir, name + ".out")
    shape = ["--layers", str(L), "--width", str(C), "--heads", str(H)]
    if w.llama:
        shape = ["--model", w.llama.preset] + shape + ["--kv-heads", str(w.llama.kv_heads), "--mlp",
                                                       str(w.llama.mlp), "--vocab", str(w.vocab)]
    launch = [a.python]
    if w.ranks > 1:  # torchrun, as a user of FSDP2 starts it
        launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(w.ranks), "--master-port",
                   str(free_port())]
    cmd = launch + [w.peer_script, "--mode", w.peer_mode] + shape + [
           "--seq", str(a.seq), "--batch", str(B), "--grad-accum", str(K), "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--clip", f"{a.clip:g}", "--workload", w.id, "--json"]
    if ck:
        cmd.append("--ckpt")
    if w.budget_gib is not None:
        cmd += ["--budget-gib", f"{w.budget_gib:g}"]
    cmd += w.peer_args
    rc, smi, secs = run_logged(cmd, out_file, a.run_timeout)
    r = last_json(out_file) or {"error": f"exit {rc}, no JSON result: {tail(out_file, 3)}"}
    r.update(batch=B, grad_accum=K, ckpt=ck, exit=rc, smi_bytes=smi, seconds=secs, output=out_file,
             command=" ".join(shlex.quote(c) for c in cmd))
    r["host_memory"] = rc == EXIT_PEER_HOST_MEMORY or rc == -signal.SIGKILL
    if rc == 124:
        r["error"] = f"timed out after {a.run_timeout} s"
    elif killed(rc):
        r["error"] = f"{killed(rc)}: {tail(out_file, 2)}"
    elif r.get("error") is None and r.get("tokens_per_s") is None:
        r["error"] = f"exit {rc}: {tail(out_file, 3)}"
    return r


def describe_peer_run(r):
    cfg = f"B{r['batch']}x{r['grad_accum']}{' ckpt' if r['ckpt'] else ''}"
    if r.get("error") == "oom":
        return f"{cfg}: out of GPU memory"
    if r.get("host_memory"):
        why = (r.get("error") or "").removeprefix("host memory: ")
        return f"{cfg}: does not fit (host memory): {why}"
    return describe_run(cfg, r)


def run_peer(a, w):
    """The peer's figure: the first candidate that runs (no budget, or --quick), else the fastest within the budget."""
    res = {"system": PEER_NAMES[w.peer_mode], "mode": w.peer_mode, "error": None, "tried": [], "best": None}
    take_first = w.budget_gib is None or a.quick
    cands = candidates(a, w, w.peer_cands)
    if a.peer_batch:
        only = {tuple(int(x) for x in c.split("x")) for c in a.peer_batch.split(",")}
        cands = [c for c in cands if (c[0], c[1]) in only]
    for B, K, ck in cands:
        r = run_peer_once(a, w, B, K, ck)
        res["tried"].append(r)
        say(f"  {res['system']} {describe_peer_run(r)}")
        if r.get("exit") == EXIT_PEER_USAGE:  # no torch / transformers / GPU: no point in trying the others
            break
        if r.get("host_memory"):  # the host state is the same at every micro-batch
            res["host_memory"] = True
            break
        ok = r.get("error") is None and r.get("within_budget") is not False
        if ok and (res["best"] is None or r["tokens_per_s"] > res["best"]["tokens_per_s"]):
            res["best"] = r
        if ok and take_first:
            break
    if res["best"] is None:
        res["error"] = "; ".join(describe_peer_run(r) for r in res["tried"]) or "no candidate"
    return res


# ---- the table ----------------------------------------------------------------

def verdict(w, t, p):
    if t.get("error") or p.get("best") is None:
        return None, "-"
    ratio = t["tokens_per_s"] / p["best"]["tokens_per_s"]
    ok = ratio >= w.target and t.get("within_budget") is not False
    return ratio, "yes" if ok else "no"


def tok_step(n):
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def fmt_tok(x):
    return "-" if x is None else f"{x / 1e3:.1f}k"


def bound_over_step(t):
    """How close tidal's median step comes to its lower bound (`tidal plan`'s, whose CPU AdamW
    term is the measured DRAM bandwidth over the path's bytes a param, and whose host DRAM term adds the
    copies' bytes at the rate AdamW and copies reach together)."""
    if t.get("error") or not t.get("plan") or not t.get("step_ms_median"):
        return "n/a"
    b = t["plan"]["estimate"]["step_lower_bound_ms"]
    close = f"{100 * b / t['step_ms_median']:.0f}%"
    if b > t["step_ms_median"]:
        close += " (bound above the step: the plan's rates are not this device's)"
    return close


def print_table(results):
    say("\n## tidal vs peers (tokens/s; median of the timed steps)\n")
    say("| id | model | GPU budget | tokens/step | tidal | peer | peer tok/s (config) | tidal/peer | target | met | "
        "tidal bound/step |")
    say("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        w, t, p = r["w"], r["tidal"], r["peer"]
        ratio, met = verdict(w, t, p)
        ck = "" if t.get("ckpt_blocks") in (None, 0) else f", {t['ckpt_blocks']}/{w.shape[0]} recomputed"
        state = f", {w.llama.optim_state} AdamW state" if w.llama and w.llama.optim_state else ""
        tid = ("n/a" if t.get("error") else
               f"{fmt_tok(t['tokens_per_s'])} (B{t['batch']}x{t['grad_accum']}{ck}{state})")
        b = p.get("best")
        peer = "n/a" if b is None else (f"{fmt_tok(b['tokens_per_s'])} (B{b['batch']}x{b['grad_accum']}"
                                        f"{' ckpt' if b['ckpt'] else ''})")
        if b is None and p.get("host_memory"):
            peer = "does not fit (host memory)"
        budget = "unlimited" if w.budget_gib is None else f"{w.budget_gib:g} GiB"
        say(f"| {w.id} | {w.name} | {budget} | {tok_step(w.tokens)} | {tid} | {p['system']} | {peer} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | >= {w.target:g}x | {met} | {bound_over_step(t)} |")
    say("\n## tidal: memory and lower bound\n")
    say("| id | tidal peak (arena) / budget | nvidia-smi peak, context incl. | step ms | lower bound ms "
        "(compute / PCIe / AdamW / host DRAM) | optimizer chunks on the GPU | CPU AdamW rate (DRAM; with copies) | "
        "bound/step |")
    say("|---|---|---|---|---|---|---|---|")
    for r in results:
        w, t = r["w"], r["tidal"]
        if t.get("error"):
            say(f"| {w.id} | n/a | n/a | n/a | n/a | n/a | n/a | n/a |")
            continue
        budget = "unlimited" if t["budget_bytes"] is None else gib(t["budget_bytes"])
        flag = "" if t["within_budget"] is not False else " **over**"
        bound, optim, rate = "n/a (no plan)", "-", "-"
        if t["plan"]:
            e, pl = t["plan"]["estimate"], t["plan"]
            bound = (f"{e['step_lower_bound_ms']:.1f} ({e['compute_ms']:.1f} / {e['pcie_ms']:.1f} / "
                     f"{e['adam_ms']:.1f} / {e.get('dram_ms', 0):.1f})")
            o, m = pl.get("optimizer", {}), pl.get("measured", {})
            if o:
                optim = f"{o['gpu_chunks']}/{o['chunks']}"
            if m.get("dram_gbytes_per_s"):
                rate = f"{m['adam_gparams_per_s']:.2f} G params/s ({m['dram_gbytes_per_s']:.0f} GB/s"
                rate += f"; {m['dram_loaded_gbytes_per_s']:.0f} GB/s)" if m.get("dram_loaded_gbytes_per_s") else ")"
        say(f"| {w.id} | {gib(t['peak_bytes'])} / {budget}{flag} | {gib(t['smi_bytes'])} | "
            f"{t['step_ms_median']:.1f} | {bound} | {optim} | {rate} | {bound_over_step(t)} |")
    notes = []
    for r in results:
        w, t, p = r["w"], r["tidal"], r["peer"]
        if t.get("error"):
            notes.append(f"{w.id} tidal: not available ({t['error']})")
        elif t.get("plan_error"):
            notes.append(f"{w.id} tidal: no lower bound ({t['plan_error']})")
        elif t.get("plan_after_error"):
            notes.append(f"{w.id} tidal: bound from the plan before the run only; the plan after it failed "
                         f"({t['plan_after_error']})")
        elif t.get("plan_before") and t.get("plan_after"):
            nb, na = (t[k]["estimate"]["step_lower_bound_ms"] for k in ("plan_before", "plan_after"))
            rb, ra = (t[k]["measured"].get("adam_gparams_per_s", 0) for k in ("plan_before", "plan_after"))
            notes.append(f"{w.id} tidal: bound {min(nb, na):.1f} ms, the lower of the plans before ({nb:.1f} ms, CPU "
                         f"AdamW {rb:.2f} G params/s) and after the run ({na:.1f} ms, {ra:.2f} G params/s)")
        if p.get("best") is None:
            notes.append(f"{w.id} {p['system']}: not available ({p['error']})")
        others = [describe_tidal_run(x) for x in t.get("runs", []) if x.get("command") != t.get("command")]
        if others and not t.get("error"):
            notes.append(f"{w.id} tidal also tried: " + "; ".join(others))
        skipped = [describe_peer_run(x) for x in p["tried"] if x is not p.get("best")]
        if skipped and p.get("best") is not None:
            notes.append(f"{w.id} {p['system']} also tried: " + "; ".join(skipped))
        one = t.get("one_gpu")
        if one is not None:
            if one.get("error"):
                notes.append(f"{w.id} tidal on 1 GPU: not available ({one['error']})")
            elif not t.get("error"):
                notes.append(f"{w.id} tidal on {w.ranks} GPUs / tidal on 1 GPU, same {tok_step(w.tokens)} tokens a "
                             f"step: {t['tokens_per_s'] / one['tokens_per_s']:.2f}x (target: >= {scaling_target(w.ranks):g}x); "
                             f"1 GPU: {fmt_tok(one['tokens_per_s'])} tok/s at B{one['batch']}x{one['grad_accum']}")
    if notes:
        say("\nNotes:")
        for n in notes:
            say(f"- {n}")


def say_tidal(t, where):
    if t.get("error"):
        say(f"  tidal{where}: not available ({t['error']})")
        return
    bound = "none" if t["lower_bound_ms"] is None else f"{t['lower_bound_ms']:.1f} ms"
    say(f"  tidal{where} B{t['batch']}x{t['grad_accum']}: {t['tokens_per_s']:.0f} tok/s, step "
        f"{t['step_ms_median']:.1f} ms (lower bound {bound}), peak "
        f"{gib(t['peak_bytes'])}, nvidia-smi {gib(t['smi_bytes'])}")


def cpu_topology():
    """Physical cores, NUMA nodes and the CPU model from Linux's /sys and /proc (empty where absent): two
    machines of one kind may differ here (hyperthreads, nodes), and the CPU AdamW's rate with them."""
    topo = {}
    try:
        cores = set()
        for d in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology"):
            with open(os.path.join(d, "core_id")) as f, open(os.path.join(d, "physical_package_id")) as g:
                cores.add((g.read().strip(), f.read().strip()))
        if cores:
            topo["cores"] = len(cores)
        nodes = glob.glob("/sys/devices/system/node/node[0-9]*")
        if nodes:
            topo["numa_nodes"] = len(nodes)
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    topo["model"] = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return topo


def machine_info():
    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    info.update(cpu_topology())
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            info["gpus"] = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def to_json(results, a):
    def clean(d):
        return {k: v for k, v in d.items() if k != "w"}
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "steps": a.steps, "warmup": a.warmup, "seq": a.seq, "clip": a.clip, "smoke": a.smoke,
        "workloads": [dict(id=r["w"].id, model=r["w"].name, shape=r["w"].shape, budget_gib=r["w"].budget_gib,
                           tidal_model_flags=model_flags(r["w"]),
                           tokens_per_step=r["w"].tokens, target=r["w"].target, ranks=r["w"].ranks,
                           ratio=verdict(r["w"], r["tidal"], r["peer"])[0],
                           met=verdict(r["w"], r["tidal"], r["peer"])[1],
                           tidal=clean(r["tidal"]), peer=clean(r["peer"])) for r in results],
    }


# Dense bf16 peak of each card, FLOP/s, for MFU (H100 and H200 SXM: docs/benchmarks.md).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


def peak_flops():
    """The first GPU's dense bf16 peak, or None for a card not in PEAK_BF16_FLOPS (then no MFU is recorded)."""
    gpu = res.machine().get("gpu", "")
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in gpu), None)


def flops_per_token(params, w, seq):
    """The model's FLOPs a token, recomputation not counted: 6 x parameters + 12 x layers x sequence x width."""
    L, C, _ = w.shape
    return 6 * params + 12 * L * seq * C


def record(a, r, peak):
    """Writes the workload's results file (bench/results/<id>.json): tokens/s of each system, the ratio, how close
    tidal's step comes to its lower bound, MFU, and on several GPUs the ratio to tidal on one."""
    w, t, p = r["w"], r["tidal"], r["peer"]
    figs = []
    ok_t = not t.get("error") and t.get("tokens_per_s")
    best = p.get("best")
    params = (t.get("plan") or {}).get("params")
    if ok_t:
        figs.append(res.figure("tidal tokens/s", t["tokens_per_s"], "tok/s"))
    if best:
        figs.append(res.figure(f"{p['system']} tokens/s", best["tokens_per_s"], "tok/s"))
    ratio, _ = verdict(w, t, p)
    if ratio is not None:
        figs.append(res.figure(f"tidal / {p['system']}", ratio, "x"))
    if ok_t and t.get("plan") and t.get("step_ms_median"):
        figs.append(res.figure("tidal's lower bound / its step", 100 * t["plan"]["estimate"]["step_lower_bound_ms"]
                               / t["step_ms_median"], "%"))
    if peak and params:
        fpt = flops_per_token(params, w, a.seq)
        if ok_t:
            figs.append(res.figure("tidal MFU", 100 * fpt * t["tokens_per_s"] / (peak * w.ranks), "%"))
        if best:
            figs.append(res.figure(f"{p['system']} MFU", 100 * fpt * best["tokens_per_s"] / (peak * w.ranks), "%"))
    one = t.get("one_gpu")
    if ok_t and one and not one.get("error") and one.get("tokens_per_s"):
        figs.append(res.figure("tidal on 1 GPU tokens/s", one["tokens_per_s"], "tok/s"))
        figs.append(res.figure(f"tidal on {w.ranks} GPUs / tidal on 1 GPU", t["tokens_per_s"] / one["tokens_per_s"], "x"))
    budget = "unlimited" if w.budget_gib is None else f"{w.budget_gib:g} GiB"
    title = (f"{w.name}, GPU budget {budget}{' a GPU' if w.ranks > 1 else ''}, {tok_step(w.tokens)} tokens a step: "
             + (f"tidal beside {p['system']}" if p.get("tried") else "tidal alone"))
    res.write_result(w.id, title, figs, details=to_json([r], a)["workloads"][0], out_dir=a.results)


def guarded(fn, a, w, empty):
    """fn(a, w), or `empty` with the error when the driver itself trips (a changed log or plan format): one
    workload's row says so and the others still run."""
    try:
        return fn(a, w)
    except Exception as e:  # noqa: BLE001 - reported in the table
        import traceback
        traceback.print_exc()
        return dict(empty, error=f"bench/workloads.py failed on it: {type(e).__name__}: {e}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=os.environ.get("TD_WORKLOADS") or "W1,W2,W3,W4,W6",
                    help="comma-separated ids of W1, W2, W3, W4, W6, W7, W8, W8S, W9 (default: $TD_WORKLOADS or "
                         "W1,W2,W3,W4,W6)")
    ap.add_argument("--tidal", default="build/tidal", help="the tidal command (default build/tidal)")
    ap.add_argument("--peers-only", action="store_true")
    ap.add_argument("--tidal-only", action="store_true")
    ap.add_argument("--json", metavar="OUT", help="write every figure as JSON here (rewritten after each workload)")
    ap.add_argument("--results", metavar="DIR",
                    help="write each workload's results file (<id>.json) here (default bench/results/; not with "
                         "--smoke or --tidal-backend cpu unless given)")
    ap.add_argument("--no-results", action="store_true", help="write no results file")
    ap.add_argument("--workdir", default="out/bench-gpu", help="data file, logs (default out/bench-gpu)")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (default 3)")
    ap.add_argument("--clip", type=float, default=0.0,
                    help="global grad-norm clipping for tidal and the peers alike (default 0: off, as the peers)")
    ap.add_argument("--quick", action="store_true", help="budget peers: stop at the first candidate within budget")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes (2L/128/2H, T64, micro-batch <= 2): checks the plumbing, not the speed")
    ap.add_argument("--tidal-backend", choices=["cuda", "cpu"], default="cuda",
                    help="cpu only to test this script on a machine without a GPU (with --smoke)")
    ap.add_argument("--tidal-batch", default="", metavar="BxK[,BxK]",
                    help="try only these of tidal's candidates, e.g. 16x2 (each must keep the workload's tokens/step)")
    ap.add_argument("--peer-batch", default="", metavar="BxK[,BxK]",
                    help="run only these of the peer's candidates (its best one, found before), e.g. 32x1")
    ap.add_argument("--tidal-args", default="", help="extra flags for tidal plan and train, e.g. '--prefetch 8'")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the peers")
    ap.add_argument("--run-timeout", type=int, default=900, help="seconds per process (default 900)")
    ap.add_argument("--ranks", type=int, default=0, metavar="N",
                    help="run the several-GPU workloads (W7) on N GPUs instead of their own count; the results "
                         "id becomes <id>xN (W7x4, W7x8) unless N is the workload's own")
    a = ap.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if a.peers_only and a.tidal_only:
        ap.error("--peers-only and --tidal-only exclude each other")
    if a.steps <= a.warmup:
        ap.error("--steps must exceed --warmup")
    if a.no_results:
        a.results = None
    elif a.results is None and not a.smoke and a.tidal_backend == "cuda":
        a.results = res.RESULTS_DIR
    by_id = {w.id: w for w in WORKLOADS}
    ids = [s.strip().upper() for s in a.workloads.split(",") if s.strip()]
    bad = [i for i in ids if i not in by_id]
    if bad or not ids:
        ap.error(f"unknown workload(s) {', '.join(bad) or '(none)'}: choose from {', '.join(by_id)}")
    chosen = [by_id[i] for i in ids]
    if a.ranks:
        if a.ranks < 1:
            ap.error("--ranks must be at least 1")
        try:
            chosen = [widened(w, a.ranks) if w.ranks > 1 else w for w in chosen]
        except ValueError as e:
            ap.error(str(e))
    a.seq = 1024
    if a.smoke:
        a.seq = 64
        chosen = [Workload(w.id, "smoke 2L/128/2H" + (f" {w.llama.preset}" if w.llama else ""), (2, 128, 2),
                           None if w.budget_gib is None else 1, min(w.tidal[0][0], 2) * w.tidal[0][1] * a.seq * w.ranks,
                           w.tidal, w.peer_mode, w.peer_cands, w.target,
                           llama=w.llama.shrunk() if w.llama else None, ranks=w.ranks) for w in chosen]
    for w in chosen:
        if w.id == "W8S" and not a.smoke:
            fit_peer_host(w)
    os.makedirs(a.workdir, exist_ok=True)
    # One random-token file per vocabulary: GPT-2's ids (uint16), or all of a LLaMA-family vocabulary (uint32).
    need = max(max(b * k * w.ranks for b, k in w.tidal) for w in chosen) * a.seq * a.steps + 1
    for w in chosen:
        if w.llama:
            w.data = os.path.join(a.workdir, f"random-v{w.vocab}.tok")
            tok = dict(vocab=w.vocab, token_range=w.vocab, eot=w.llama.eot, kind=3)
        else:
            w.data = os.path.join(a.workdir, "random.tok")
            tok = {}
        if not any(x.data == w.data for x in chosen[:chosen.index(w)]):
            write_token_file(w.data, max(need, 1 << 20), seed=1337, **tok)
    peers = sorted({os.path.relpath(w.peer_script) for w in chosen})
    say(f"bench/workloads.py: {', '.join(w.id for w in chosen)}; tidal {a.tidal} ({a.tidal_backend}); peers "
        f"{'off' if a.tidal_only else a.python + ' ' + ', '.join(peers)}; data "
        f"{', '.join(sorted({w.data for w in chosen}))}; logs in {a.workdir}")
    info = machine_info()
    cores = f" ({info['cores']} cores, {info.get('numa_nodes', '?')} NUMA nodes)" if "cores" in info else ""
    cpu = f", {info['model']}" if "model" in info else ""
    say(f"machine: {info.get('host')}, {info.get('cpus')} CPUs{cores}{cpu}, "
        f"GPU {', '.join(info.get('gpus', ['none found']))}")

    results = []
    peak = peak_flops()
    for w in chosen:
        budget = "unlimited" if w.budget_gib is None else f"{w.budget_gib:g} GiB"
        say(f"\n== {w.id}: {w.name}, GPU budget {budget}, {w.tokens} tokens/step")
        if a.peers_only:
            t = {"system": "tidal", "error": "not run (--peers-only)", "tried": []}
        else:
            t = guarded(run_tidal, a, w, {"system": "tidal", "tried": []})
            say_tidal(t, "" if w.ranks == 1 else f" on {w.ranks} GPUs")
            if w.ranks > 1:  # the same global batch on one GPU: what the second GPU is worth
                w1 = one_gpu(w)
                w1.data = w.data
                t["one_gpu"] = guarded(run_tidal, a, w1, {"system": "tidal", "tried": []})
                say_tidal(t["one_gpu"], " on 1 GPU")
        if a.tidal_only:
            p = {"system": PEER_NAMES[w.peer_mode], "error": "not run (--tidal-only)", "tried": [], "best": None}
        else:
            p = guarded(run_peer, a, w, {"system": PEER_NAMES[w.peer_mode], "tried": [], "best": None})
        results.append({"w": w, "tidal": t, "peer": p})
        if a.results:
            record(a, results[-1], peak)
        if a.json:
            os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
            with open(a.json, "w") as f:
                json.dump(to_json(results, a), f, indent=1)
    print_table(results)
    if a.json:
        say(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
