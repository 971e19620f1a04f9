#!/usr/bin/env python3
"""Results on record: the JSON files of bench/results/, one per benchmark id.

Every benchmark script writes its figures through write_result(): one file
bench/results/<id>.json per id (W1, W3, W5-int8, copy, adam, ...), rewritten
by each run of it (git keeps the earlier ones), holding

  id, title      what was measured
  date           when (ISO 8601, the measuring machine's clock)
  commit         `git describe --always --dirty` of the tree that was measured
  command        the command line that produced the file: run it again to reproduce
  machine        GPU model, count and memory, CPU model, cores, RAM, host name
  figures        [{"name", "value", "unit"}]: the figures docs may quote, with
                 unit one of FIGURE_UNITS
  details        the script's own record of the run (configurations tried,
                 peaks, bounds, errors)

bench/report.py turns these files into docs/performance.md's tables and
checks that every figure README.md and docs/performance.md quote is one of
them (tests/test_figures.c runs that check in `make test`).

As a command, `python3 bench/results.py wrap ID TITLE -- CMD...` runs a
`tidal bench ... --json` command and records its JSON (bench/bench-gpu.sh
does this for `tidal bench copy`, `adam` and `comm`)."""
import datetime
import glob
import json
import os
import platform
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(HERE, "results")
SCHEMA = 1
# The units a figure may have: a ratio (tidal over its peer, "2.01x"), a
# percentage (of a bound, MFU), rates, and a model's size in parameters.
FIGURE_UNITS = ("x", "%", "tok/s", "params/s", "B/s", "FLOP/s", "params")


def commit():
    """TD_BENCH_COMMIT when set (a copy of the tree whose .git is not the tree's own, as on
    a machine that receives the working tree without its history), else `git describe
    --always --dirty` of the repository, or "unknown" outside a checkout."""
    if os.environ.get("TD_BENCH_COMMIT"):
        return os.environ["TD_BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def machine():
    """The measuring machine: GPUs (model, count, memory) from nvidia-smi, CPU model, cores and logical CPUs,
    NUMA nodes, RAM (MemTotal) and the host name."""
    m = {"host": platform.node(), "cpus": os.cpu_count()}
    for ln in _read("/proc/cpuinfo").splitlines():
        if ln.startswith("model name"):
            m["cpu"] = ln.split(":", 1)[1].strip()
            break
    cores = set()
    for d in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology"):
        core, pkg = _read(os.path.join(d, "core_id")).strip(), _read(os.path.join(d, "physical_package_id")).strip()
        if core:
            cores.add((pkg, core))
    if cores:
        m["cores"] = len(cores)
    nodes = glob.glob("/sys/devices/system/node/node[0-9]*")
    if nodes:
        m["numa_nodes"] = len(nodes)
    for ln in _read("/proc/meminfo").splitlines():
        if ln.startswith("MemTotal:"):
            m["ram_gib"] = round(int(ln.split()[1]) * 1024 / (1 << 30), 1)
            break
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
        rows = [[c.strip() for c in ln.split(",")] for ln in out.stdout.splitlines() if ln.strip()]
        if out.returncode == 0 and rows:
            m["gpu"] = rows[0][0]
            m["gpu_count"] = len(rows)
            m["gpu_memory_gib"] = round(float(rows[0][1]) / 1024, 1)
            m["driver"] = rows[0][2]
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        pass
    m.setdefault("gpu_count", 0)
    return m


def describe_machine(m):
    """One line: "NVIDIA H200 (1 GPU, 139.8 GiB), 16 cores (Intel ...), 125.6 GiB RAM"."""
    n = m.get("gpu_count", 1)
    gpu = (f"{m['gpu']} ({n} GPU{'s' if n != 1 else ''}, {m.get('gpu_memory_gib', '?')} GiB{' each' if n > 1 else ''})"
           if m.get("gpu") else "no GPU")
    cores = f"{m['cores']} cores" if "cores" in m else f"{m.get('cpus', '?')} CPUs"
    cpu = f" ({m['cpu']})" if m.get("cpu") else ""
    ram = f", {m['ram_gib']} GiB RAM" if "ram_gib" in m else ""
    return f"{gpu}, {cores}{cpu}{ram}"


def figure(name, value, unit):
    """One figure for a results file; None values are left out by write_result."""
    if unit not in FIGURE_UNITS:
        raise ValueError(f"figure {name!r}: unit {unit!r} is not one of {', '.join(FIGURE_UNITS)}")
    return {"name": name, "value": None if value is None else float(value), "unit": unit}


def command_line(argv=None):
    """The command that produced the results, as one shell line run from the repository root."""
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(".py"):
        argv[0] = os.path.relpath(os.path.abspath(argv[0]), ROOT)
        argv.insert(0, "python3")
    return " ".join(shlex.quote(x) for x in argv)


def write_result(rid, title, figures, details=None, command=None, out_dir=None):
    """Writes bench/results/<rid>.json (or out_dir/<rid>.json) and returns its path.  figures: figure()s;
    those without a value (a system that did not run) are left out."""
    if not rid or "/" in rid or rid.startswith("."):
        raise ValueError(f"bad results id {rid!r}")
    rec = {
        "schema": SCHEMA,
        "id": rid,
        "title": title,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": commit(),
        "command": command or command_line(),
        "machine": machine(),
        "figures": [f for f in figures if f["value"] is not None],
        "details": details or {},
    }
    d = out_dir or RESULTS_DIR
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{rid}.json")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(rec, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)
    print(f"results: wrote {os.path.relpath(path)}", flush=True)
    return path


def load_results(d=None):
    """Every results file of d (default bench/results/), checked: a list of records.  Raises ValueError naming
    the file and the field when one is malformed."""
    recs = []
    for path in sorted(glob.glob(os.path.join(d or RESULTS_DIR, "*.json"))):
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not JSON ({e})")
        for k in ("id", "title", "date", "commit", "command", "machine", "figures"):
            if k not in r:
                raise ValueError(f"{path}: no {k!r}")
        if r["id"] != os.path.basename(path)[:-5]:
            raise ValueError(f"{path}: id {r['id']!r} differs from the file's name")
        for fg in r["figures"]:
            if not isinstance(fg.get("value"), (int, float)) or fg.get("unit") not in FIGURE_UNITS or not fg.get("name"):
                raise ValueError(f"{path}: figure {fg!r} needs a name, a numeric value and a unit of "
                                 f"{', '.join(FIGURE_UNITS)}")
        r["path"] = path
        recs.append(r)
    return recs


# ---- `tidal bench ... --json`, recorded -------------------------------------------------------------

LABEL_KEYS = ("direction", "path", "state", "method", "name", "op", "collective")


def _walk(o, prefix=""):
    """(key path, value) of every leaf; a list's dict elements are named by their label fields (LABEL_KEYS)."""
    if isinstance(o, dict):
        for k, v in o.items():
            yield from _walk(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(o, list):
        for i, v in enumerate(o):
            label = " ".join(str(v[k]) for k in LABEL_KEYS if isinstance(v, dict) and isinstance(v.get(k), str))
            if isinstance(v, dict) and isinstance(v.get("params"), (int, float)):
                label += f" {v['params']:.0f} params"
            yield from _walk(v, f"{prefix}[{label or i}]")
    else:
        yield prefix, o


def bench_figures(doc):
    """The figures of a `tidal bench` JSON document: every number whose key names a rate (..._gbytes_per_s,
    ..._gbps in GB/s; ..._gparams_per_s; ..._tokens_per_s), a ratio (..._over_..., ..._ratio, speedup) or a
    share of a bound (fraction_of_bound, efficiency: as a percentage), named by its key path."""
    figs = []
    for key, v in _walk(doc):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        leaf = key.rsplit(".", 1)[-1]
        if leaf.endswith(("gbps", "gbytes_per_s", "gb_per_s")):
            figs.append(figure(key, v * 1e9, "B/s"))
        elif leaf.endswith("gparams_per_s"):
            figs.append(figure(key, v * 1e9, "params/s"))
        elif leaf.endswith(("tokens_per_s", "tok_per_s")):
            figs.append(figure(key, v, "tok/s"))
        elif "_over_" in leaf or leaf.endswith(("ratio", "speedup")):
            figs.append(figure(key, v, "x"))
        elif leaf in ("fraction_of_bound", "efficiency"):
            figs.append(figure(key, v * 100, "%"))
    return figs


def wrap(argv):
    """results.py wrap ID TITLE -- CMD...: runs CMD (which prints JSON, its last line or its whole output),
    records its figures; exit status CMD's, or 2 on bad usage."""
    if len(argv) < 4 or argv[2] != "--":
        print("usage: bench/results.py wrap ID TITLE -- CMD [ARGS...]", file=sys.stderr)
        return 2
    rid, title, cmd = argv[0], argv[1], argv[3:]
    p = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    if p.returncode != 0:
        print(f"results: {' '.join(cmd)} exited {p.returncode}: nothing recorded", file=sys.stderr)
        return p.returncode
    doc = None
    for text in [p.stdout] + p.stdout.strip().splitlines()[::-1]:
        try:
            doc = json.loads(text)
            break
        except ValueError:
            continue
    if doc is None:
        print(f"results: {' '.join(cmd)} printed no JSON: nothing recorded", file=sys.stderr)
        return 1
    figs = bench_figures(doc)
    if not figs:
        print(f"results: no rate or ratio in {' '.join(cmd)}'s JSON: nothing recorded", file=sys.stderr)
        return 1
    write_result(rid, title, figs, details=doc, command=" ".join(shlex.quote(c) for c in cmd))
    for f in figs:
        print(f"  {f['name']}: {f['value']:.4g} {f['unit']}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "wrap":
        sys.exit(wrap(sys.argv[2:]))
    print(__doc__)
    sys.exit(2)
