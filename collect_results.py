"""Turn a scaling study into tables and plots: results.csv, results.md and, with --plot, PNGs.

    python collect_results.py runs/study-20250101-120000          # launch/run_benchmarks.py's
    python collect_results.py runs/study-20250101-120000 --plot   # + four PNG plots
    python collect_results.py runs/ddp-1n1g-4101 runs/ddp-1n2g-4102 --out results/  # run dirs
    python collect_results.py ddp-1n1g-4101.out ddp-1n2g-4102.out --out results/    # log files

Input, in any mix:
  - a study directory (launch/run_benchmarks.py --study-dir): its study.json says which runs were
    planned, so a run that never started is listed as missing instead of vanishing;
  - run directories (launch/job.sh: job.env, train.log, gpu_memory/, cpu_memory/), also found
    anywhere below a directory given;
  - log files: a train.log, or a Slurm .out file of job.sh (its "training exit code: N" and
    memory summary lines are read too).

What is read, and from where (the formats are imported, so writer and reader cannot drift):
  - the ``[METRIC]`` lines of rank 0 (``common.METRIC_KEYS``, ``common.parse_metric_line``);
    the final one (``final=1``) carries the last epoch's numbers. A log without any [METRIC]
    line falls back to the workshop's epoch lines (``common.EPOCH_LINE``). A line that mentions
    [METRIC] but does not parse (another rank's output glued into it, a line cut off when the job
    was killed) is counted and reported, never guessed at;
  - job.env: the configuration, START_TIME, END_TIME and EXIT_CODE;
  - memory: ``analyze_memory.summarize_paths([run_dir])`` over the nvidia-smi and psrecord logs
    (memory_summary.json when the logs are gone). GPU 0 = the GPU with index 0 on the first
    node of the job (NODELIST order); restarts of a requeued job (<node>.restart<N>.csv) are
    summarised together with the first attempt. CPU memory is psrecord's on the first node.

Status of a run:
  ok        the final [METRIC] line is there and the job exited 0
  partial   no final line and no EXIT_CODE in job.env: killed mid-run, or still running;
            the tables show the last completed epoch
  requeued  exit code 75: stopped by a signal after checkpointing, to be requeued (not a
            failure, not complete either); shown like partial
  failed    a non-zero exit code, or the job ended without the final [METRIC] line
  missing   planned in study.json, but no run directory (not submitted yet, or still queued)
  skipped   planned in study.json but not run (e.g. dp on more than one node)
A configuration run several times (launch/run_benchmarks.py --resume) keeps every attempt in
results.csv; the tables use the best one (ok, then requeued, then partial, then failed; the
newest on a tie).

Definitions (per strategy and scaling mode; all from the final epoch):
  GPUs                      nodes x GPUs per node (on CPU: processes)
  time per epoch            epoch_time_s: the training part of the epoch (validation excluded)
  Throughput Scaling vs 1G  throughput / throughput of the 1-GPU, 1-node run
  Memory Avg Scaling vs 1G  GPU 0 Avg / GPU 0 Avg of the 1-GPU, 1-node run
  parallel efficiency       Throughput Scaling / GPUs (1.0 = perfect linear scaling)

Output (in --out; default: the one directory given, else the current directory):
  results.csv   one row per run (every attempt, and every missing or skipped run)
  results.md    per strategy, the workshop's two tables "Multi-GPU Scaling (1 Node)" and
                "Multi-Node Scaling" filled in, plus parallel efficiency and status
  --plot:       time_per_epoch.png, val_loss_acc.png, peak_memory.png, throughput.png

Exit status: 0 results written (failed runs are results too); 2 a bad path or flag, nothing to
collect, or the output cannot be written (one sentence naming the fix).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import string
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import analyze_memory
import common
from common import FINAL_KEYS, METRIC_KEYS, METRIC_PREFIX, UsageError

MANIFEST = "study.json"  # written by launch/run_benchmarks.py

OK, REQUEUED, PARTIAL, FAILED, MISSING, SKIPPED = (
    "ok", "requeued", "partial", "failed", "missing", "skipped")
_PREFERENCE = {OK: 0, REQUEUED: 1, PARTIAL: 2, FAILED: 3, MISSING: 4, SKIPPED: 5}
HAS_METRICS = (OK, REQUEUED, PARTIAL)  # statuses whose numbers go into the tables

# Types of the [METRIC] values this script computes with; any other key stays a string.
INT_KEYS = ("world_size", "nodes", "gpus_per_node", "per_gpu_batch", "global_batch", "epoch",
            "epochs", "train_images", "val_images", "final")
FLOAT_KEYS = ("lr", "train_loss", "train_acc", "val_loss", "val_acc", "epoch_time_s",
              "throughput_img_s", "peak_mem_mib", "total_time_s")
LIST_KEYS = ("peak_mem_per_gpu_mib",)

STRATEGY_ORDER = ("dp", "ddp", "fsdp")
STRATEGY_TITLE = {"dp": "DataParallel (dp)", "ddp": "DistributedDataParallel (ddp)",
                  "fsdp": "FSDP (fsdp)"}
NO_GPU_LOG = "n/a (no GPU log)"
NO_BASELINE = "no 1-GPU baseline"

PLOTS = {  # file name -> what it shows
    "time_per_epoch.png": "time per epoch vs GPUs (log scale)",
    "val_loss_acc.png": "validation loss and accuracy vs GPUs",
    "peak_memory.png": "peak memory per GPU vs GPUs",
    "throughput.png": "throughput vs GPUs against ideal linear scaling",
}

CSV_COLUMNS = (
    ("run", "status", "detail", "used_in_tables", "scaling")
    + METRIC_KEYS + FINAL_KEYS[1:]  # every [METRIC] value as logged, then total_time_s
    + ("gpu0", "gpu0_peak_mib", "gpu0_avg_mib", "gpu0_mode_mib",
       "cpu_node", "cpu_peak_rss_mb", "cpu_avg_rss_mb", "cpu_peak_pct", "cpu_avg_pct",
       "throughput_scaling", "memory_avg_scaling", "parallel_efficiency", "baseline",
       "exit_code", "job_id", "job_name", "restarts", "start_time", "end_time",
       "metric_lines", "bad_metric_lines", "path")
)


def _template_regex(template: str) -> re.Pattern:
    """A regex for a str.format template, with one named group per field."""
    parts = []
    for literal, name, _spec, _conv in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if name is not None:
            parts.append(rf"(?P<{name}>[-+]?(?:\d+(?:\.\d*)?|nan|inf))")
    return re.compile("".join(parts))


EPOCH_RE = _template_regex(common.EPOCH_LINE)  # the workshop's epoch line, from its template
# job.sh's output in a Slurm .out file: its header, its exit code line.
EXIT_RE = re.compile(r"training exit code: (\d+)")
HEADER_RE = re.compile(
    r"^(?P<key>job id|strategy|nodes|GPUs per node|processes)\s*: (?P<value>.*)$")
RUN_SUFFIX_RE = re.compile(r"^(?:\d+|\d{8}-\d{6}-\d+)$")  # Slurm job id, or local.sh's stamp


# --------------------------------------------------------------------------------------------
# Reading logs
# --------------------------------------------------------------------------------------------

def typed_metrics(fields: dict) -> dict:
    """[METRIC] strings -> numbers for the keys computed with; the strings as logged stay under
    "_raw" (for results.csv). Raises ValueError naming the key."""
    out = dict(fields, _raw=fields)
    for key, value in fields.items():
        try:
            if key in INT_KEYS:
                out[key] = int(value)
            elif key in FLOAT_KEYS:
                out[key] = float(value)
            elif key in LIST_KEYS:
                out[key] = [float(v) for v in value.split("/")] if value not in ("", "-") else []
        except ValueError:
            raise ValueError(f"{key}={value!r} is not a number") from None
    return out


def _why_unparseable(line: str) -> str:
    at = line.find(METRIC_PREFIX)
    tokens = line[at + len(METRIC_PREFIX):].split()
    stray = [t for t in tokens if "=" not in t]
    if stray:
        return f"text without '=' in it ({stray[0][:40]!r}: another process's output?)"
    present = {t.partition("=")[0] for t in tokens}
    missing = [k for k in METRIC_KEYS if k not in present]
    return f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"


@dataclass
class LogScan:
    """What one log file says."""
    epochs: dict = field(default_factory=dict)       # epoch -> typed [METRIC] (the last seen)
    final: dict | None = None                         # the last final=1 line
    metric_lines: int = 0                             # parsed [METRIC] lines
    bad: list = field(default_factory=list)           # (file:line, reason, text)
    epoch_lines: dict = field(default_factory=dict)   # epoch -> values of an epoch line
    exit_code: int | None = None                      # "training exit code: N" (job.sh output)
    gpu_lines: list = field(default_factory=list)     # analyze_memory's GPU lines, parsed
    cpu_lines: list = field(default_factory=list)
    header: dict = field(default_factory=dict)       # job.sh's header lines

    @property
    def nodelist(self) -> list:
        hit = re.match(r"\d+ \((.*)\)", self.header.get("nodes", ""))
        return hit.group(1).split() if hit else []


def scan_log(path: Path) -> LogScan:
    scan = LogScan()
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.rstrip("\r\n")
            where = f"{path}:{lineno}"
            if METRIC_PREFIX in line:
                fields = common.parse_metric_line(line)
                reason = None if fields else _why_unparseable(line)
                if not raw.endswith("\n"):
                    reason = "last line without its newline (the job was killed mid-write)"
                elif fields and "final" in fields and "total_time_s" not in fields:
                    reason = "final line without total_time_s"
                if reason is None:
                    try:
                        m = typed_metrics(fields)
                    except ValueError as e:
                        reason = str(e)
                if reason is not None:
                    scan.bad.append((where, reason, line.strip()))
                    continue
                scan.metric_lines += 1
                if m.get("final") == 1:
                    scan.final = m
                else:
                    scan.epochs[m["epoch"]] = m
                continue
            hit = EPOCH_RE.search(line)
            if hit and raw.endswith("\n"):
                values = {k: float(v) for k, v in hit.groupdict().items()}
                values["epoch"], values["epochs"] = int(values["epoch"]), int(values["epochs"])
                scan.epoch_lines[values["epoch"]] = values
                continue
            if (hit := EXIT_RE.search(line)):
                scan.exit_code = int(hit.group(1))
            elif (hit := analyze_memory.GPU_LINE_RE.search(line)):
                scan.gpu_lines.append(hit.groupdict())
            elif (hit := analyze_memory.CPU_LINE_RE.search(line)):
                scan.cpu_lines.append(hit.groupdict())
            elif (hit := HEADER_RE.match(line)) and hit["key"] not in scan.header:
                scan.header[hit["key"]] = hit["value"].strip()
    return scan


def read_job_env(path: Path) -> dict:
    """job.env: KEY=value lines written with bash printf %q."""
    env = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier():
            continue
        if value.startswith("$'"):  # %q's ANSI-C quoting, used for control characters
            env[key] = value[2:-1].encode("utf-8").decode("unicode_escape", errors="replace")
            continue
        try:
            words = shlex.split(value)
        except ValueError:
            words = [value]
        env[key] = words[0] if len(words) == 1 else "" if not words else " ".join(words)
    return env


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------

def _of_node(records: list, node: str) -> list:
    """Records of one node, with those of its restarts (<node>.restart<N>)."""
    return [r for r in records if r["node"] == node or r["node"].startswith(node + ".restart")]


def _gpu0(records: list, first: str | None) -> tuple:
    """(GPU 0 record of the first node, why not)."""
    if not records:
        return None, NO_GPU_LOG
    if first is None:
        first = sorted(r["node"] for r in records)[0].split(".restart")[0]
    mine = [r for r in _of_node(records, first) if int(r["gpu"]) == 0]
    if not mine:
        return None, f"n/a (no GPU 0 log of node {first})"
    if len(mine) == 1:
        return mine[0], ""
    # A requeued job's attempts: summarise their logs as one (exact Peak/Avg/Mode; the parser
    # ignores the repeated headers).
    try:
        with tempfile.TemporaryDirectory() as tmp:
            joined = Path(tmp) / f"{first}.csv"
            with open(joined, "w", encoding="utf-8") as out:
                for r in sorted(mine, key=lambda r: r["node"]):
                    out.write(Path(r["file"]).read_text(encoding="utf-8", errors="replace"))
                    out.write("\n")
            _kind, records, _skips = analyze_memory.summarize_file(joined)
        record = next(r for r in records if int(r["gpu"]) == 0)
    except (OSError, analyze_memory.LogError, StopIteration):
        # The logs are gone (figures from memory_summary.json): combine the summaries; the
        # mode is then the one of the attempt with the most samples.
        n = sum(r["samples"] for r in mine)
        record = dict(max(mine, key=lambda r: r["samples"]), samples=n,
                      peak_mib=max(r["peak_mib"] for r in mine),
                      avg_mib=round(sum(r["avg_mib"] * r["samples"] for r in mine) / n, 2))
    return dict(record, node=first, file=";".join(r["file"] for r in mine)), ""


def _cpu_of(records: list, first: str | None) -> dict | None:
    """psrecord figures of the first node; a requeued job's attempts weighted by samples."""
    if not records:
        return None
    if first is None:
        first = sorted(r["node"] for r in records)[0].split(".restart")[0]
    mine = _of_node(records, first)
    if not mine:
        return None
    n = sum(r["samples"] for r in mine)
    return {"node": first,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in mine),
            "avg_rss_mb": round(sum(r["avg_rss_mb"] * r["samples"] for r in mine) / n, 2),
            "peak_cpu_pct": max(r["peak_cpu_pct"] for r in mine),
            "avg_cpu_pct": round(sum(r["avg_cpu_pct"] * r["samples"] for r in mine) / n, 1)}


def run_memory(run_dir: Path, nodelist: list) -> tuple:
    """(gpu0 record or None, why not, cpu dict or None, notes) of one run directory."""
    notes = []
    gpu, cpu, problems = analyze_memory.summarize_paths([run_dir], notes)
    summary = run_dir / "memory_summary.json"
    if not gpu and not cpu and summary.is_file():  # the logs were deleted, their summary kept
        try:
            data = json.loads(summary.read_text())
            gpu = [r if isinstance(r, dict) else dict(zip(analyze_memory.GPU_KEYS, r))
                   for r in data.get("gpu", [])]
            cpu = [r if isinstance(r, dict) else dict(zip(analyze_memory.CPU_KEYS, r))
                   for r in data.get("cpu", [])]
            problems = [p for p in problems if "no nvidia-smi or psrecord logs" not in p]
        except (OSError, ValueError, AttributeError) as e:
            notes.append(f"{summary}: unreadable ({e}); no memory figures")
    for p in problems:
        if "no nvidia-smi or psrecord logs" in p:
            notes.append("no memory logs in the run directory")
        else:
            notes.append(p)
    first = nodelist[0] if nodelist else None
    gpu0, why = _gpu0(gpu, first)
    return gpu0, why, _cpu_of(cpu, first), notes


def _memory_from_lines(scan: LogScan) -> tuple:
    """GPU 0 and CPU figures from analyze_memory's lines in a Slurm .out file."""
    first = scan.nodelist[0] if scan.nodelist else None
    gpus = [dict(node=g["node"], gpu=int(g["gpu"]), peak_mib=int(g["peak_mib"]),
                 avg_mib=float(g["avg_mib"]), mode_mib=int(g["mode_mib"]), samples=0, file="")
            for g in scan.gpu_lines]
    cpus = [dict(node=c["node"], samples=1, peak_rss_mb=float(c["peak_rss_mb"]),
                 avg_rss_mb=float(c["avg_rss_mb"]), peak_cpu_pct=float(c["peak_cpu_pct"]),
                 avg_cpu_pct=float(c["avg_cpu_pct"])) for c in scan.cpu_lines]
    if first is None and gpus:
        first = gpus[0]["node"]
    zeros = [g for g in gpus if g["node"] == first and g["gpu"] == 0]
    if zeros:
        gpu0, why = zeros[0], ""
    else:
        gpu0, why = None, NO_GPU_LOG if not gpus else f"n/a (no GPU 0 line of node {first})"
    return gpu0, why, _cpu_of(cpus, first or (cpus[0]["node"] if cpus else None))


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------

@dataclass
class Run:
    label: str                      # run directory or log file name; the config name if no run
    path: Path | None
    name: str = ""                  # job name = the study's name for this configuration
    job: dict = field(default_factory=dict)
    planned: dict | None = None     # the study.json entry
    scaling: str = ""
    scan: LogScan = field(default_factory=LogScan)
    exit_code: int | None = None
    status: str = ""
    detail: str = ""
    strategy: str = ""
    nodes: int | None = None
    gpus_per_node: int | None = None
    gpu0: dict | None = None
    gpu0_why: str = NO_GPU_LOG
    cpu: dict | None = None
    notes: list = field(default_factory=list)
    used: bool = False
    baseline: "Run | None" = None
    scaling_why: str = ""           # why there is no scaling factor
    throughput_scaling: float | None = None
    memory_scaling: float | None = None
    memory_why: str = ""
    efficiency: float | None = None

    @property
    def metrics(self) -> dict | None:
        """The final epoch's values: the final line, else the last epoch's (partial runs)."""
        if self.scan.final:
            return self.scan.final
        if self.scan.epochs:
            return self.scan.epochs[max(self.scan.epochs)]
        if self.scan.epoch_lines:
            return self.scan.epoch_lines[max(self.scan.epoch_lines)]
        return None

    @property
    def gpus(self) -> int | None:
        if self.nodes is None or self.gpus_per_node is None:
            return None
        return self.nodes * self.gpus_per_node

    @property
    def start(self) -> str:
        return self.job.get("START_TIME", "")


def _config_from(run: Run) -> None:
    """strategy / nodes / GPUs per node: what the training logged, else the plan, else job.env."""
    m = run.scan.final or (run.scan.epochs[max(run.scan.epochs)] if run.scan.epochs else None)
    plan = run.planned or {}
    job = run.job
    run.strategy = (m or {}).get("strategy") or plan.get("strategy") or job.get("STRATEGY", "")
    if m:
        run.nodes = m["nodes"]
        run.gpus_per_node = m["world_size"] // max(1, m["nodes"])
    elif plan:
        run.nodes, run.gpus_per_node = plan["nodes"], plan["gpus_per_node"]
    elif "NODES" in job:
        run.nodes = _int(job.get("NODES"))
        per_node = job.get("GPUS_PER_NODE") if run.strategy == "dp" else job.get("NPROC_PER_NODE")
        run.gpus_per_node = _int(per_node)
    else:  # a bare Slurm .out file: job.sh's header
        h = run.scan.header
        run.strategy = run.strategy or h.get("strategy", "").split(" ")[0]
        run.nodes = _int(h.get("nodes", "").split(" ")[0])
        per_node = re.search(r"\((\d+) per node\)", h.get("processes", ""))
        run.gpus_per_node = (_int(h.get("GPUs per node")) if run.strategy == "dp"
                             else _int(per_node.group(1)) if per_node else None)
    if m and plan and (plan["nodes"], plan["gpus_per_node"]) != (run.nodes, run.gpus_per_node):
        run.notes.append(f"the study planned {plan['nodes']} node(s) x {plan['gpus_per_node']} "
                         f"GPU(s), but the training ran with {run.nodes} x {run.gpus_per_node} "
                         f"(world size {m['world_size']}); listed as what it ran")


def _classify(run: Run) -> None:
    m = run.metrics
    total = m.get("epochs") if m else None
    done = f"{m['epoch']}/{total} epochs done" if m else "no epoch done"
    code = run.exit_code
    log = f"see {run.label}/train.log" if run.path and run.path.is_dir() else f"see {run.label}"
    complete_epochs = bool(m and m["epoch"] == total)
    if run.scan.final and code in (0, None):
        run.status = OK
        run.detail = "" if code == 0 else "no EXIT_CODE in job.env, but training finished"
    elif run.scan.final is None and run.scan.epochs and complete_epochs and code == 0:
        run.status = OK
        run.detail = "final [METRIC] line unreadable; its last epoch line is complete"
    elif (not run.scan.metric_lines and run.scan.epoch_lines and complete_epochs
          and code in (0, None)):
        run.status = OK
        run.detail = "from the epoch lines (the log has no [METRIC] lines)"
    elif code == common.REQUEUE_EXIT:
        run.status = REQUEUED
        run.detail = (f"exit code {code}: stopped by a signal after checkpointing, to be "
                      f"requeued; {done}")
    elif code is None:
        run.status = PARTIAL
        why = ("no EXIT_CODE in job.env: killed mid-run, or still running"
               if run.path and run.path.is_dir() else
               "the log ends before the final [METRIC] line and has no exit code")
        run.detail = f"{done}; {why}"
    else:
        run.status = FAILED
        why = (f"exit code {code}" if code != 0 else
               "exit code 0 but no final [METRIC] line (a --check run, or the log was cut)")
        run.detail = f"{why}; {done}; {log}"


def load_run_dir(path: Path, planned: dict | None = None) -> Run:
    run = Run(label=path.name, path=path)
    env_file, log = path / "job.env", path / "train.log"
    if env_file.is_file():
        try:
            run.job = read_job_env(env_file)
        except OSError as e:
            run.notes.append(f"job.env unreadable ({e.strerror or e})")
    run.name = run.job.get("JOB_NAME", "")
    run.exit_code = _int(run.job.get("EXIT_CODE"))
    if log.is_file():
        try:
            run.scan = scan_log(log)
        except OSError as e:
            run.notes.append(f"train.log unreadable ({e.strerror or e})")
    else:
        run.notes.append("no train.log in the run directory")
    run.planned = planned
    _config_from(run)
    _classify(run)
    nodelist = run.job.get("NODELIST", "").split()
    run.gpu0, run.gpu0_why, run.cpu, notes = run_memory(path, nodelist)
    run.notes += notes
    return run


def load_log_file(path: Path) -> Run:
    run = Run(label=path.name, path=path, name=path.stem)
    try:
        run.scan = scan_log(path)
    except OSError as e:
        raise UsageError(f"{path}: cannot be read ({e.strerror or e}); check the path and "
                         f"its permissions") from None
    s = run.scan
    job = re.match(r"(\S+) \((.+)\)$", s.header.get("job id", ""))
    if job:  # job.sh's header: "job id        : 5001 (ddp-1n1g)"
        run.job = {"JOB_ID": job.group(1), "JOB_NAME": job.group(2)}
        run.name = job.group(2)
    if not (s.metric_lines or s.bad or s.epoch_lines or s.exit_code is not None):
        raise UsageError(f"{path}: no [METRIC], epoch or 'training exit code' lines in it; pass "
                         f"a training log (train.log, or the job's Slurm .out file), a run "
                         f"directory or a study directory")
    run.exit_code = s.exit_code
    _config_from(run)
    _classify(run)
    run.gpu0, run.gpu0_why, run.cpu = _memory_from_lines(s)
    return run


def is_run_dir(path: Path) -> bool:
    return (path / "job.env").is_file() or (path / "train.log").is_file()


def find_run_dirs(top: Path) -> list:
    """Run directories at or below top (a run directory's own subfolders are not searched)."""
    if is_run_dir(top):
        return [top]
    found = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        if Path(dirpath) != top and ("job.env" in filenames or "train.log" in filenames):
            found.append(Path(dirpath))
            dirnames[:] = []
    return found


def load_manifest(study: Path) -> dict | None:
    path = study / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        runs = data["runs"]
        for entry in runs:
            entry["name"] = str(entry["name"])
            entry["strategy"] = str(entry["strategy"])
            entry["nodes"] = int(entry["nodes"])
            entry["gpus_per_node"] = int(entry["gpus_per_node"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path}: not a study manifest ({e.__class__.__name__}: {e}); restore "
                         f"it from launch/run_benchmarks.py, or move it away to collect the run "
                         f"directories without the study's plan") from None
    return data


def _name_of(run_dir: Path, names) -> str:
    """The configuration a run directory belongs to: job.env's JOB_NAME, else its name."""
    for name in names:
        rest = run_dir.name[len(name) + 1:]
        if run_dir.name.startswith(name + "-") and RUN_SUFFIX_RE.match(rest):
            return name
    return ""


def _study_scaling(manifest: dict) -> str:
    settings = manifest.get("settings")
    return settings.get("scaling", "") if isinstance(settings, dict) else ""


def _unstarted(study: Path, entry: dict, manifest: dict) -> Run:
    """A planned run without a run directory: skipped, missing, or died before job.sh ran."""
    run = Run(label=entry["name"], path=None, name=entry["name"], planned=entry,
              scaling=entry.get("scaling") or _study_scaling(manifest), gpu0_why="")
    run.strategy, run.nodes = entry["strategy"], entry["nodes"]
    run.gpus_per_node = entry["gpus_per_node"]
    if entry.get("skipped"):
        run.status, run.detail = SKIPPED, entry["skipped"]
        return run
    attempts = entry.get("attempts") or []
    for attempt in reversed(attempts):
        out = attempt.get("output") or (f"{entry['name']}-{attempt['job_id']}.out"
                                        if attempt.get("job_id") else "")
        out_path = study / Path(out).name if out else None
        if out_path and out_path.is_file():
            lines = [ln.strip() for ln in out_path.read_text(errors="replace").splitlines()
                     if ln.strip()]
            errors = [ln for ln in lines if "error" in ln.lower()]
            last = (errors or lines or ["(empty)"])[-1][:200]
            run.status = FAILED
            run.detail = f"ended before making its run directory: {last} (see {out_path.name})"
            return run
    run.status = MISSING
    if attempts:
        ids = ", ".join(str(a.get("job_id")) for a in attempts if a.get("job_id"))
        run.detail = (f"submitted (job {ids}) but no run directory yet: still queued (squeue), "
                      f"or cancelled before it started")
    else:
        run.detail = "not run yet: launch/run_benchmarks.py --resume runs it"
    return run


def load_study(top: Path) -> list:
    """Every run of a directory: its run directories, plus the planned runs without one."""
    manifest = load_manifest(top)
    single = is_run_dir(top)
    if single and manifest is None:  # one run directory of a study: the plan is one level up
        manifest = load_manifest(top.parent)
    dirs = find_run_dirs(top)
    if not dirs and manifest is None:
        raise UsageError(f"{top}: no run directories (folders with job.env or train.log) and no "
                         f"{MANIFEST} in it; pass a study directory of launch/run_benchmarks.py, "
                         f"run directories, or log files")
    entries = {e["name"]: e for e in (manifest or {}).get("runs", [])}
    runs = []
    for d in dirs:
        job_name = ""
        if (d / "job.env").is_file():
            try:
                job_name = read_job_env(d / "job.env").get("JOB_NAME", "")
            except OSError:
                pass
        name = job_name if job_name in entries else _name_of(d, entries)
        run = load_run_dir(d, entries.get(name))
        if name:
            run.name = name
            run.scaling = entries[name].get("scaling") or _study_scaling(manifest)
        runs.append(run)
    seen = {r.name for r in runs}
    for name, entry in entries.items():
        if name not in seen and not single:
            runs.append(_unstarted(top, entry, manifest))
    return runs


def load_inputs(paths: list) -> tuple:
    """(runs, study directories) for the command-line paths."""
    runs, studies, seen = [], [], set()
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise UsageError(f"{p}: no such file or directory; pass a study directory (made by "
                             f"launch/run_benchmarks.py), run directories, or log files")
        if path.is_dir():
            found = load_study(path)
            studies.append(path)
        elif path.name == "train.log" and (path.parent / "job.env").is_file():
            found = [load_run_dir(path.parent)]
        else:
            found = [load_log_file(path)]
        for run in found:
            key = (run.path.resolve() if run.path else None, run.label)
            if key not in seen:
                seen.add(key)
                runs.append(run)
    return runs, studies


# --------------------------------------------------------------------------------------------
# Scaling
# --------------------------------------------------------------------------------------------

def _group(run: Run) -> tuple:
    order = STRATEGY_ORDER.index(run.strategy) if run.strategy in STRATEGY_ORDER else 99
    return (order, run.strategy, run.scaling)


def select_and_scale(runs: list) -> dict:
    """Pick each configuration's run for the tables and compute every run's scaling factors.
    Returns {group: {(nodes, gpus_per_node): run}}."""
    groups = {}
    for run in runs:
        if run.nodes is None or run.gpus_per_node is None:
            run.notes.append("configuration unknown (no [METRIC] line, job.env or plan); not "
                             "in the tables")
            continue
        config = (run.nodes, run.gpus_per_node)
        groups.setdefault(_group(run), {}).setdefault(config, []).append(run)
    chosen = {}
    for key, configs in groups.items():
        chosen[key] = {}
        for config, candidates in configs.items():
            # Newest first, then the stable sort by status keeps the newest of the best status.
            candidates.sort(key=lambda r: r.start, reverse=True)
            candidates.sort(key=lambda r: _PREFERENCE[r.status])
            best = candidates[0]
            best.used = True
            chosen[key][config] = best
            for other in candidates[1:]:
                other.notes.append(f"superseded in the tables by {best.label} ({best.status})")
        base = chosen[key].get((1, 1))
        usable = base if base is not None and base.status in HAS_METRICS else None
        for config, candidates in configs.items():
            for run in candidates:
                _scale(run, usable)
    return chosen


def _scale(run: Run, base: Run | None) -> None:
    m = run.metrics
    if run.status not in HAS_METRICS or not m:
        run.scaling_why = run.status
        return
    if base is None:
        run.scaling_why = NO_BASELINE
        run.memory_why = NO_BASELINE
        return
    run.baseline = base
    b = base.metrics
    if b["throughput_img_s"] > 0:
        run.throughput_scaling = m["throughput_img_s"] / b["throughput_img_s"]
        if run.gpus:
            run.efficiency = run.throughput_scaling / run.gpus
    else:
        run.scaling_why = "baseline throughput is 0"
    if run.gpu0 is None:
        run.memory_why = run.gpu0_why
    elif base.gpu0 is None:
        run.memory_why = "n/a (the baseline has no GPU log)"
    elif base.gpu0["avg_mib"] > 0:
        run.memory_scaling = run.gpu0["avg_mib"] / base.gpu0["avg_mib"]
    else:
        run.memory_why = "n/a (baseline GPU 0 Avg is 0)"


# --------------------------------------------------------------------------------------------
# results.csv
# --------------------------------------------------------------------------------------------

def _num(x, digits: int) -> str:
    return "" if x is None else f"{round(x, digits):.{digits}f}".rstrip("0").rstrip(".")


def csv_row(run: Run) -> dict:
    m = run.metrics or {}
    logged = m.get("_raw") or {k: _num(v, 7) if isinstance(v, float) else v for k, v in m.items()}
    raw = {key: logged.get(key, "") for key in METRIC_KEYS + FINAL_KEYS[1:]}
    # The configuration for runs that logged nothing: from the plan or job.env.
    raw["strategy"] = raw["strategy"] or run.strategy
    if not raw["world_size"] and run.gpus:
        raw["world_size"], raw["nodes"], raw["gpus_per_node"] = (
            run.gpus, run.nodes, run.gpus_per_node)
    if not raw["per_gpu_batch"] and run.planned:
        raw["per_gpu_batch"] = run.planned.get("per_gpu_batch", "")
        raw["global_batch"] = run.planned.get("global_batch", "")
    g, c = run.gpu0, run.cpu
    return {
        "run": run.label, "status": run.status, "detail": run.detail,
        "used_in_tables": int(run.used), "scaling": run.scaling, **raw,
        "gpu0": f"{g['node']} GPU 0" if g else run.gpu0_why,
        "gpu0_peak_mib": g["peak_mib"] if g else "", "gpu0_avg_mib": g["avg_mib"] if g else "",
        "gpu0_mode_mib": g["mode_mib"] if g else "",
        "cpu_node": c["node"] if c else "", "cpu_peak_rss_mb": c["peak_rss_mb"] if c else "",
        "cpu_avg_rss_mb": c["avg_rss_mb"] if c else "",
        "cpu_peak_pct": c["peak_cpu_pct"] if c else "",
        "cpu_avg_pct": c["avg_cpu_pct"] if c else "",
        "throughput_scaling": _num(run.throughput_scaling, 4),
        "memory_avg_scaling": _num(run.memory_scaling, 4),
        "parallel_efficiency": _num(run.efficiency, 4),
        "baseline": run.baseline.label if run.baseline else "",
        "exit_code": "" if run.exit_code is None else run.exit_code,
        "job_id": run.job.get("JOB_ID", ""), "job_name": run.job.get("JOB_NAME", run.name),
        "restarts": run.job.get("RESTARTS", ""), "start_time": run.start,
        "end_time": run.job.get("END_TIME", ""), "metric_lines": run.scan.metric_lines,
        "bad_metric_lines": len(run.scan.bad), "path": str(run.path) if run.path else "",
    }


def write_csv(runs: list, path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        for run in runs:
            writer.writerow(csv_row(run))


# --------------------------------------------------------------------------------------------
# results.md
# --------------------------------------------------------------------------------------------

def _gpus_text(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _nodes_text(n: int) -> str:
    return f"{n} Node" if n == 1 else f"{n} Nodes"


def _row(label: str, run: Run | None, epoch: int | None) -> list:
    """One table row: the seed's columns, then parallel efficiency and status."""
    if run is None:
        return [label] + ["—"] * 9 + ["not in this study"]
    if run.status not in HAS_METRICS or not run.metrics:
        cell = run.status if run.status == FAILED else "—"
        return [label] + [cell] * 9 + [f"{run.status}: {run.detail}" if run.detail else run.status]
    m = run.metrics
    tag = f" (epoch {m['epoch']})" if epoch is not None and m["epoch"] != epoch else ""
    g = run.gpu0
    if g:
        gpu = [str(g["peak_mib"]), f"{g['avg_mib']:.2f}", str(g["mode_mib"])]
    else:
        gpu = [run.gpu0_why, "n/a", "n/a"]
    ts = (f"{run.throughput_scaling:.2f}×" if run.throughput_scaling is not None
          else run.scaling_why)
    ms = f"{run.memory_scaling:.2f}×" if run.memory_scaling is not None else run.memory_why
    eff = f"{run.efficiency:.0%}" if run.efficiency is not None else run.scaling_why
    status = run.status + (f": {run.detail}" if run.detail else "")
    return [label, f"{m['train_loss']:.3f}{tag}", f"{m['train_acc']:.2f}%{tag}",
            f"{m['throughput_img_s']:.1f}", *gpu, ts, ms, eff, status]


def _table(header: list, rows: list) -> list:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return lines


def _distinct(runs: list, key: str) -> list:
    """The distinct values of a [METRIC] key, numbers in numeric order."""
    def order(v: str):
        try:
            return (0, float(v), v)
        except ValueError:
            return (1, 0.0, v)
    return sorted({str(r.metrics[key]) for r in runs if r.metrics and key in r.metrics},
                  key=order)


def group_markdown(key: tuple, configs: dict, runs: list) -> list:
    _order, strategy, scaling = key
    members = [r for r in runs if _group(r) == key]
    with_metrics = [r for r in members if r.status in HAS_METRICS and r.metrics]
    title = STRATEGY_TITLE.get(strategy, strategy or "unknown strategy")
    per_gpu = _distinct(with_metrics, "per_gpu_batch") or sorted(
        {str(r.planned["per_gpu_batch"]) for r in members if r.planned})
    global_ = _distinct(with_metrics, "global_batch") or sorted(
        {str(r.planned["global_batch"]) for r in members if r.planned})
    if scaling == "weak":
        mode = f"weak scaling, {'/'.join(per_gpu) or '?'} images per GPU per step"
    elif scaling == "strong":
        mode = (f"strong scaling, global batch {'/'.join(global_) or '?'} "
                f"(per GPU: {'/'.join(per_gpu) or '?'})")
    else:
        mode = "scaling mode not recorded (no study.json)"
    lines = [f"## {title}: {mode}", ""]

    epochs = _distinct(with_metrics, "epochs")
    epoch = int(epochs[0]) if len(epochs) == 1 else None
    context = []
    for k, label in (("model", "model"), ("dataset", "dataset"), ("device", "device"),
                     ("amp", "amp")):
        values = _distinct(with_metrics, k)
        if values:
            context.append(f"{label} {'/'.join(values)}")
    if epochs:
        context.append(f"{'/'.join(epochs)} epochs")
    if context:
        lines.append(", ".join(context) + ".")
    if _distinct(with_metrics, "device") == ["cpu"]:
        lines.append("CPU run: each \"GPU\" below is one process; there is no GPU memory log, "
                     "so CPU memory (psrecord) is in results.csv.")
    fixed = {"weak": ("per_gpu_batch",), "strong": ("global_batch",)}.get(scaling, ())
    for k in ("model", "dataset", "epochs") + fixed:
        if len(_distinct(with_metrics, k)) > 1:
            values = ", ".join(_distinct(with_metrics, k))
            lines.append(f"**Warning:** the runs differ in {k} ({values}): their scaling "
                         f"factors compare different workloads.")
    lines.append("")

    ep = f"Epoch {epoch}" if epoch else "final epoch"
    cols = [f"Train Loss ({ep})", f"Train Acc ({ep})", "Throughput (img/s)", "GPU 0 Peak (MiB)",
            "GPU 0 Avg (MiB)", "GPU 0 Mode (MiB)"]
    skipped = sorted(c for c, r in configs.items() if r.status == SKIPPED)
    shown = {c: r for c, r in configs.items() if r.status != SKIPPED}

    def skipped_line(which) -> list:
        names = [c for c in skipped if which(c)]
        if not names:
            return []
        listed = ", ".join(f"{_nodes_text(n)} x {_gpus_text(g)}" for n, g in names)
        return ["", f"Skipped: {listed}: {configs[names[0]].detail}."]

    lines += ["### Multi-GPU Scaling (1 Node)", ""]
    single = sorted(g for (n, g) in shown if n == 1)
    if single:
        header = ["Config"] + cols + ["Throughput Scaling vs 1G", "Memory Avg Scaling vs 1G",
                                      "Parallel Efficiency", "Status"]
        rows = [_row(f"{_gpus_text(g)}, 1 Node" + (" (baseline)" if g == 1 else ""),
                     shown[(1, g)], epoch) for g in single]
        if 1 not in single:
            rows.insert(0, _row("1 GPU, 1 Node (baseline)", None, epoch))
        lines += _table(header, rows)
    else:
        lines.append("No single-node runs in this study.")
    lines += skipped_line(lambda c: c[0] == 1) + [""]

    lines += ["### Multi-Node Scaling (Fixed GPUs per Node)", ""]
    per_node = sorted({g for (n, g) in shown if n > 1})
    if per_node:
        header = ["Config"] + cols + ["Throughput Scaling vs 1N", "Memory Avg Scaling vs 1N",
                                      "Parallel Efficiency", "Status"]
        rows = [_row("1 Node, 1 GPU (baseline)", shown.get((1, 1)), epoch)]
        for g in per_node:
            for n in sorted({n for (n, gg) in shown if gg == g and (n, g) != (1, 1)}):
                rows.append(_row(f"{_nodes_text(n)} x {_gpus_text(g)}", shown[(n, g)], epoch))
        lines += _table(header, rows)
        lines += ["", "1N = the 1-GPU, 1-node baseline run (as in the workshop), so both "
                      "tables compare with the same run; the 1-node rows show where each node "
                      "sweep starts."]
    else:
        lines.append("No multi-node runs in this study.")
    lines += skipped_line(lambda c: c[0] > 1) + [""]
    return lines


def write_markdown(runs: list, chosen: dict, studies: list, path: Path, plots: list,
                   bad_total: int) -> None:
    counts = {}
    for r in runs:
        counts[r.status] = counts.get(r.status, 0) + 1
    summary = ", ".join(f"{counts[s]} {s}" for s in _PREFERENCE if s in counts)
    source = ", ".join(f"`{s}`" for s in studies) or "log files"
    lines = ["# Scaling study results", "",
             f"Collected from {source} on {datetime.now():%Y-%m-%d %H:%M} by "
             f"`python collect_results.py`: {len(runs)} runs ({summary}).", "",
             "Values are from each run's final epoch. Throughput Scaling = throughput / "
             "throughput of the same strategy's 1-GPU, 1-node run; Memory Avg Scaling = GPU 0 "
             "Avg / its GPU 0 Avg (GPU 0 = index 0 on the job's first node); Parallel "
             "Efficiency = Throughput Scaling / GPUs. All columns, CPU memory and every "
             "attempt are in results.csv.", ""]
    if bad_total:
        lines += [f"**{bad_total} [METRIC] line(s) could not be parsed** and were left out; "
                  f"they are listed under Notes.", ""]
    for key in sorted(chosen):
        lines += group_markdown(key, chosen[key], runs)
    if plots:
        lines += ["## Plots", ""]
        for name in plots:
            lines += [f"![{PLOTS[name]}]({name})", ""]
    notes = []
    for r in runs:
        for note in r.notes:
            notes.append(f"- {r.label}: {note}")
        for where, reason, text in r.scan.bad[:5]:
            notes.append(f"- {r.label}: unparseable [METRIC] line at {Path(where).name}: "
                         f"{reason}: `{text[:160]}`")
        if len(r.scan.bad) > 5:
            notes.append(f"- {r.label}: ... and {len(r.scan.bad) - 5} more unparseable lines")
    if notes:
        lines += ["## Notes", ""] + notes + [""]
    path.write_text("\n".join(lines), encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------

def _series(chosen: dict) -> list:
    """Lines to draw: per strategy, the 1-node runs and, per GPUs-per-node, the node sweep.
    Each: (group key, label, linestyle, [runs sorted by GPUs])."""
    out = []
    for key in sorted(chosen):
        configs = {c: r for c, r in chosen[key].items()
                   if r.status in HAS_METRICS and r.metrics and r.gpus}
        name = key[1] + (f" ({key[2]})" if len({k[2] for k in chosen}) > 1 and key[2] else "")
        single = [configs[c] for c in sorted(configs) if c[0] == 1]
        if single:
            out.append((key, f"{name}, 1 node", "-", sorted(single, key=lambda r: r.gpus)))
        for g in sorted({c[1] for c in configs if c[0] > 1}):
            sweep = [configs[c] for c in configs if c[1] == g]
            out.append((key, f"{name}, {g} GPU/node, 1-{max(r.nodes for r in sweep)} nodes",
                        "--", sorted(sweep, key=lambda r: r.gpus)))
    return out


def write_plots(chosen: dict, out_dir: Path, dpi: int) -> list:
    try:
        import matplotlib
        matplotlib.use("Agg")  # headless: no display on a login or compute node
        import matplotlib.pyplot as plt
        from matplotlib.ticker import (FixedLocator, FuncFormatter, NullFormatter, NullLocator,
                                       ScalarFormatter)
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib (it is in "
                         "requirements-test.txt), or drop --plot") from None
    series = _series(chosen)
    if not series:
        print("note: no run with metrics to plot; no PNG written", file=sys.stderr)
        return []
    strategies = sorted({k for k, *_ in series})
    colours = {k: f"C{i}" for i, k in enumerate(strategies)}
    # Equal values (dp, ddp and fsdp compute the same model) would hide each other: different
    # markers, the first drawn largest, so every point stays visible.
    markers = {k: "osD^v<>"[i % 7] for i, k in enumerate(strategies)}
    sizes = {k: max(4, 11 - 2.5 * i) for i, k in enumerate(strategies)}
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    xs = sorted({r.gpus for *_, rs in series for r in rs})
    devices = {r.metrics.get("device") for *_, rs in series for r in rs}
    cpu_only = devices == {"cpu"}
    xlabel = ("processes (CPU run: each stands in for one GPU)" if cpu_only
              else "GPUs (nodes x GPUs per node)")
    partial = any(r.status != OK for *_, rs in series for r in rs)

    def axis(ax, ylabel, logy=False):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(xs))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        if logy:  # plain numbers; the minor ticks labelled too when the range is narrow
            ax.set_yscale("log")
            low, high = ax.get_ylim()
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain if high / low < 20 else NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)

    def draw(ax, value, with_ideal=False):
        for key, label, style, rs in series:
            pts = [(r.gpus, value(r), r.status == OK) for r in rs if value(r) is not None]
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colours[key],
                    marker=markers[key], markersize=sizes[key], label=label)
            for x, y, ok in pts:
                if not ok:  # open marker: numbers of the last completed epoch
                    ax.plot([x], [y], markers[key], color=colours[key], markerfacecolor="white",
                            markersize=sizes[key])
        if with_ideal:
            for key in strategies:
                base = next((r.baseline for *_, rs in series for r in rs
                             if _group(r) == key and r.baseline), None)
                if base is None:
                    continue
                own = sorted({r.gpus for k, *_, rs in series if k == key for r in rs})
                if len(own) < 2:
                    continue  # nothing to compare with
                b = base.metrics["throughput_img_s"]
                ax.plot(own, [b * x for x in own], ":", color=colours[key],
                        label=f"{key[1]}, ideal (1-GPU x GPUs)")

    def save(fig, name, title):
        fig.suptitle(title)
        if partial:
            fig.text(0.01, 0.01, "open markers: partial or requeued runs (last completed epoch)",
                     fontsize=8)
        fig.tight_layout(rect=(0, 0.03 if partial else 0, 1, 1))
        fig.savefig(out_dir / name, dpi=dpi)
        plt.close(fig)

    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax, lambda r: r.metrics.get("epoch_time_s"))
    axis(ax, "time per epoch (s, training part, final epoch)", logy=True)
    ax.legend(fontsize=8)
    save(fig, "time_per_epoch.png", "Time per epoch")
    written.append("time_per_epoch.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
    draw(a1, lambda r: r.metrics.get("val_loss"))
    axis(a1, "validation loss (cross-entropy)")
    draw(a2, lambda r: r.metrics.get("val_acc"))
    axis(a2, "validation accuracy (%)")
    a1.legend(fontsize=8)
    save(fig, "val_loss_acc.png", "Validation loss and accuracy (final epoch)")
    written.append("val_loss_acc.png")

    has_gpu_log = any(r.gpu0 for *_, rs in series for r in rs)
    panels = 2 if has_gpu_log else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels + 1.5, 4.5), squeeze=False)
    axes = axes[0]
    if has_gpu_log:
        draw(axes[0], lambda r: r.gpu0["peak_mib"] if r.gpu0 else None)
        axis(axes[0], "GPU 0 peak memory (MiB, nvidia-smi)")
        axes[0].set_title("nvidia-smi: GPU 0 of the first node", fontsize=10)
    ax = axes[-1]
    draw(ax, lambda r: r.metrics.get("peak_mem_mib"))
    if cpu_only:
        ylabel = "peak RSS per process, max over ranks (MiB)\n(CPU run: no GPU memory)"
    elif devices == {"cuda"}:
        ylabel = "peak allocated per GPU, max over ranks (MiB)\n(torch.cuda.max_memory_allocated)"
    else:
        ylabel = "peak memory per process, max over ranks (MiB)\n(GPU: allocated; CPU: RSS)"
    axis(ax, ylabel)
    ax.set_title("the training's [METRIC] peak_mem_mib", fontsize=10)
    axes[0].legend(fontsize=8)
    save(fig, "peak_memory.png", "Peak memory per GPU" if not cpu_only
         else "Peak memory per process (CPU run)")
    written.append("peak_memory.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax, lambda r: r.metrics.get("throughput_img_s"), with_ideal=True)
    axis(ax, "throughput (training images/s)", logy=True)
    ax.legend(fontsize=8)
    save(fig, "throughput.png", "Throughput against ideal linear scaling")
    written.append("throughput.png")
    return written


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="collect_results.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="a study directory (launch/run_benchmarks.py --study-dir), run "
                             "directories, or log files (train.log, Slurm .out)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where results.csv, results.md and the plots go (default: the one "
                             "directory given, else the current directory); created if needed")
    parser.add_argument("--plot", action="store_true",
                        help="also write the PNG plots (matplotlib, headless)")
    parser.add_argument("--dpi", type=int, default=100, help="resolution of the PNG plots")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.dpi < 50:
            raise UsageError(f"--dpi {args.dpi} is too small to read; use 50 or more")
        runs, studies = load_inputs(args.paths)
        if args.out:
            out = Path(args.out)
        elif len(args.paths) == 1 and Path(args.paths[0]).is_dir():
            out = Path(args.paths[0])
        else:
            out = Path(".")
        try:
            out.mkdir(parents=True, exist_ok=True)
            probe = out / ".collect_results_write_test"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise UsageError(f"cannot write to {out} ({e.strerror or e}); pass a writable "
                             f"--out DIR") from None
        chosen = select_and_scale(runs)
        plots = write_plots(chosen, out, args.dpi) if args.plot else []
        write_csv(runs, out / "results.csv")
        bad = sum(len(r.scan.bad) for r in runs)
        write_markdown(runs, chosen, studies, out / "results.md", plots, bad)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    counts = {}
    for r in runs:
        counts[r.status] = counts.get(r.status, 0) + 1
    print(f"{len(runs)} runs: " + ", ".join(f"{counts[s]} {s}" for s in _PREFERENCE
                                            if s in counts))
    for r in runs:
        if r.status not in (OK, SKIPPED):
            print(f"  {r.label}: {r.status}" + (f" ({r.detail})" if r.detail else ""))
    if bad:
        print(f"warning: {bad} unparseable [METRIC] line(s), left out:", file=sys.stderr)
        for r in runs:
            for where, reason, _text in r.scan.bad:
                print(f"  {where}: {reason}", file=sys.stderr)
    print(f"wrote {out / 'results.csv'} and {out / 'results.md'}"
          + (f", plots: {', '.join(str(out / p) for p in plots)}" if plots else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
