"""Turn a scaling study into tables and plots: results.csv, results.md and, with --plot, PNGs.

    python collect_results.py runs/study-20250101-120000          # launch/run_benchmarks.py's
    python collect_results.py runs/study-20250101-120000 --plot   # + five PNG plots, and
                                                                  # timeline-<run>.png per run
    python collect_results.py runs/ddp-1n1g-4101 runs/ddp-1n2g-4102 --out results/  # run dirs

Input: study directories (launch/run_benchmarks.py: study.json, the plan, and a run directory
per job) and run directories (launch/job.sh: job.env, train.log, gpu_memory/, cpu_memory/,
memory_summary.json). No torch needed; --plot needs matplotlib.

The pipeline: each run directory -> one row, a plain dict (every key=value of the training's last
[METRIC] line, job.env, GPU 0 and CPU memory from analyze_memory.py) -> its status -> scaling
factors -> results.csv. The tables and plots are made from those rows alone (plots.py draws).

Status of a run (a configuration run several times keeps every attempt in results.csv; the
tables use the first status in this order, the newest run on a tie):
  ok        the final [METRIC] line (final=1) is there and the job exited 0
  requeued  exit code 75: stopped by a signal after checkpointing, to be requeued (not a
            failure, not complete either); shown like partial
  partial   no final line and no EXIT_CODE in job.env: killed mid-run, or still running;
            the tables show the last completed epoch
  failed    a non-zero exit code, or the job ended without the final [METRIC] line
  missing   planned in study.json, but no run directory (not submitted yet, or still queued)
  skipped   planned in study.json but not run (e.g. dp on more than one node)

Scaling, per strategy and scaling mode, from the final epoch, against the 1-GPU, 1-node run:
Throughput Scaling = throughput / its throughput; Memory Avg Scaling = GPU 0 Avg / its GPU 0
Avg (GPU 0 = index 0 on the job's first node); Parallel Efficiency = Throughput Scaling / GPUs.

Why not N x: each run's step time (epoch time x global batch / images), its data wait and,
from the [PROFILE] and [BANDWIDTH] lines of a run with --profile, the step's parts and the bus
bandwidth of its collectives; from those a weak-scaling model predicts 2 to 64 nodes
(predict_step_ms; the formula is in the README, "A scaling model").

Exit status: 0 results written (failed runs are results too); 2 a bad path or flag, nothing to
collect, or the output cannot be written (one sentence naming the fix).
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
from datetime import datetime
from pathlib import Path

import analyze_memory
import contract
import plots
from contract import BANDWIDTH_PREFIX, METRIC_PREFIX, PROFILE_PREFIX, REQUEUE_EXIT
from plots import PLOTS

MANIFEST = "study.json"     # the study's plan, written by launch/run_benchmarks.py
STRATEGIES = ("dp", "ddp", "fsdp")  # in table order; launch/run_benchmarks.py's --strategies
STRATEGY_TITLE = {"dp": "DataParallel (dp)", "ddp": "DistributedDataParallel (ddp)",
                  "fsdp": "FSDP (fsdp)"}

OK, REQUEUED, PARTIAL, FAILED, MISSING, SKIPPED = (
    "ok", "requeued", "partial", "failed", "missing", "skipped")
STATUSES = (OK, REQUEUED, PARTIAL, FAILED, MISSING, SKIPPED)  # best first
HAS_METRICS = (OK, REQUEUED, PARTIAL)  # statuses whose numbers go into the tables
NO_GPU_LOG = "n/a (no GPU log)"
NO_BASELINE = "no 1-GPU baseline"

# results.csv: HEAD, then every [METRIC] key in the order the training logged it, then TAIL.
HEAD = ("run", "status", "detail", "used_in_tables", "scaling")
TAIL = ("gpu0", "gpu0_peak_mib", "gpu0_avg_mib", "gpu0_mode_mib",
        "cpu_node", "cpu_peak_rss_mb", "cpu_avg_rss_mb", "cpu_peak_pct", "cpu_avg_pct",
        "throughput_scaling", "memory_avg_scaling", "parallel_efficiency", "baseline",
        "step_ms", "data_wait_ms", "profile_steps", "profile_step_ms", "profile_compute_ms",
        "profile_exposed_comm_ms", "profile_data_wait_ms", "profile_other_ms", "profile_comm_ms",
        "grad_bytes", "busbw_all_reduce_gbs", "busbw_all_gather_gbs",
        "busbw_reduce_scatter_gbs", "predicted_step_ms", "prediction_error",
        "exit_code", "job_id", "job_name", "restarts", "start_time", "end_time",
        "metric_lines", "bad_metric_lines", "path")
NOT_COLUMNS = ("final", "notes", "bad")  # in a row, but not in results.csv

class UsageError(Exception):
    """A problem the user can fix: printed as one sentence naming the fix, exit code 2."""


# --------------------------------------------------------------------------------------------
# Reading: a run directory -> one row
# --------------------------------------------------------------------------------------------

def read_log(path: Path) -> tuple:
    """The [METRIC] lines of a train.log as {key: text as logged}, in order, and the lines that
    mention [METRIC] but do not parse, as (line number, why, text): another rank's output glued
    into the line, or a line cut off when the job was killed. Those are counted, never guessed."""
    lines, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, 1):
            parsed = contract.fields(text, METRIC_PREFIX)
            if parsed is None:
                continue
            pairs, stray = parsed
            if not text.endswith("\n"):
                why = "last line without its newline (the job was killed mid-write)"
            elif stray:
                why = f"text without '=' in it ({stray[0][:40]!r}: another process's output?)"
            elif not pairs:
                why = "no key=value after the tag"
            else:
                lines.append(pairs)
                continue
            bad.append((number, why, text.strip()))
    return lines, bad


def read_explanations(path: Path) -> dict:
    """What --profile adds to a train.log, as row columns: the last [PROFILE] line's parts
    (profile_<key>) and, per collective, the bus bandwidth at the largest message size
    measured ([BANDWIDTH] lines: busbw_<op>_gbs, and that size as grad_bytes)."""
    found = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for text in f:
            for tag in (PROFILE_PREFIX, BANDWIDTH_PREFIX):
                parsed = contract.fields(text, tag + " ")
                if parsed is None or not text.endswith("\n"):
                    continue
                pairs = parsed[0]
                if tag == PROFILE_PREFIX:
                    found.update((f"profile_{k}", v) for k, v in pairs.items() if k != "trace")
                elif "op" in pairs and pairs.get("bytes", "").isdigit() and int(
                        pairs["bytes"]) >= int(found.get("grad_bytes", 0)):
                    found["grad_bytes"] = pairs["bytes"]
                    found[f"busbw_{pairs['op']}_gbs"] = pairs.get("busbw_gbs", "")
    return found


def read_job_env(path: Path) -> dict:
    """job.env: KEY=value lines, each value quoted by bash's printf %q (launch/job.sh)."""
    env = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep and key.isidentifier():
            try:
                env[key] = " ".join(shlex.split(value))
            except ValueError:  # an unbalanced quote: keep the text as written
                env[key] = value
    return env


def read_memory(run_dir: Path, node: str) -> tuple:
    """(the GPU 0 and CPU columns of results.csv, notes) of a run directory, for the job's first
    node ("": the first by name). analyze_memory reads gpu_memory/ and cpu_memory/ (a requeued
    job's <node>.restart<N> logs count as <node>); memory_summary.json, which job.sh writes from
    the same analysis, stands in when the logs were deleted."""
    gpu, cpu, notes = [], [], []
    if (run_dir / "gpu_memory").is_dir() or (run_dir / "cpu_memory").is_dir():
        gpu, cpu, problems = analyze_memory.summarize_paths([run_dir], notes)
        notes += [p["message"] for p in problems]  # dicts: {"kind", "path", "message"}
    elif (run_dir / "memory_summary.json").is_file():
        try:
            summary = json.loads((run_dir / "memory_summary.json").read_text(encoding="utf-8"))
            gpu, cpu = summary["gpu"], summary["cpu"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            notes.append(f"memory_summary.json unreadable ({e}); no memory figures")
    else:
        notes.append("no memory logs in the run directory")
    node = node or min((r["node"] for r in gpu + cpu), default="")
    g = next((r for r in gpu if r["node"] == node and int(r["gpu"]) == 0), {})
    c = next((r for r in cpu if r["node"] == node), {})
    no_gpu0 = f"n/a (no GPU 0 log of node {node})" if gpu else NO_GPU_LOG
    return {"gpu0": f"{node} GPU 0" if g else no_gpu0,
            "gpu0_peak_mib": g.get("peak_mib", ""), "gpu0_avg_mib": g.get("avg_mib", ""),
            "gpu0_mode_mib": g.get("mode_mib", ""),
            "cpu_node": c.get("node", ""), "cpu_peak_rss_mb": c.get("peak_rss_mb", ""),
            "cpu_avg_rss_mb": c.get("avg_rss_mb", ""), "cpu_peak_pct": c.get("peak_cpu_pct", ""),
            "cpu_avg_pct": c.get("avg_cpu_pct", "")}, notes


def new_row(run: str, entry: dict | None, path: str = "") -> dict:
    """An empty row; entry (from study.json) gives its scaling mode."""
    row = dict.fromkeys(HEAD + TAIL, "")
    row.update(run=run, used_in_tables=0, scaling=(entry or {}).get("scaling", ""),
               metric_lines=0, bad_metric_lines=0, path=path, notes=[], bad=[])
    return row


def planned_config(entry: dict) -> dict:
    """The configuration a study.json entry plans, under the [METRIC] keys."""
    return {"strategy": entry["strategy"], "world_size": entry["nodes"] * entry["gpus_per_node"],
            "nodes": entry["nodes"], "gpus_per_node": entry["gpus_per_node"],
            "per_gpu_batch": entry.get("per_gpu_batch"), "global_batch": entry.get("global_batch")}


def read_run_dir(run_dir: Path, plan: dict) -> dict:
    """One run directory -> one row. plan: the study's entries by name ({} without study.json).
    The configuration comes from the [METRIC] line, else from the plan, else from job.env."""
    job = read_job_env(run_dir / "job.env") if (run_dir / "job.env").is_file() else {}
    name = job.get("JOB_NAME", "")
    if name not in plan:  # without job.env: the directory is <job name>-<job id>
        name = next((n for n in plan if run_dir.name.startswith(n + "-")), name)
    row = new_row(run_dir.name, plan.get(name), str(run_dir))
    lines = []
    if (run_dir / "train.log").is_file():
        lines, row["bad"] = read_log(run_dir / "train.log")
        row.update(read_explanations(run_dir / "train.log"))
    else:
        row["notes"].append("no train.log in the run directory")
    finals = [m for m in lines if m.get("final") == "1"]
    row.update((finals or lines or [{}])[-1])  # the final line, else the last epoch's
    per_node = job.get("GPUS_PER_NODE" if job.get("STRATEGY") == "dp" else "NPROC_PER_NODE")
    config = planned_config(plan[name]) if name in plan else {
        "strategy": job.get("STRATEGY"), "world_size": job.get("WORLD_SIZE"),
        "nodes": job.get("NODES"), "gpus_per_node": per_node}
    for key, value in config.items():
        row.setdefault(key, value)
    row.update(exit_code=job.get("EXIT_CODE", ""), job_id=job.get("JOB_ID", ""),
               job_name=name, restarts=job.get("RESTARTS", ""),
               start_time=job.get("START_TIME", ""), end_time=job.get("END_TIME", ""),
               metric_lines=len(lines), bad_metric_lines=len(row["bad"]))
    memory, notes = read_memory(run_dir, (job.get("NODELIST", "").split() or [""])[0])
    row.update(memory)
    row["notes"] += notes
    return row


def run_status(row: dict) -> tuple:
    """(status, detail) of a run directory's row; the statuses are in the module docstring."""
    code = int(row["exit_code"]) if row["exit_code"].isdigit() else None
    epoch, epochs = row.get("epoch"), row.get("epochs")
    done = f"{epoch}/{epochs} epochs done" if epoch else "no epoch done"
    if row.get("final") == "1" and code in (0, None):
        return OK, "" if code == 0 else "no EXIT_CODE in job.env, but training finished"
    if code == 0 and epoch and epoch == epochs:
        return OK, "final [METRIC] line unreadable; its last epoch line is complete"
    if code == REQUEUE_EXIT:
        return REQUEUED, (f"exit code {code}: stopped by a signal after checkpointing, to be "
                          f"requeued; {done}")
    if code is None:
        return PARTIAL, f"{done}; no EXIT_CODE in job.env: killed mid-run, or still running"
    why = (f"exit code {code}" if code else
           "exit code 0 but no final [METRIC] line (a --check run, or the log was cut)")
    return FAILED, f"{why}; {done}; see {row['run']}/train.log"


def planned_row(study: Path, entry: dict) -> dict:
    """A planned run without a run directory: skipped, missing, or failed before job.sh ran."""
    row = new_row(entry["name"], entry)
    row.update(planned_config(entry), job_name=entry["name"])
    if entry.get("skipped"):
        row["status"], row["detail"] = SKIPPED, entry["skipped"]
        return row
    attempts = entry.get("attempts") or []
    for attempt in reversed(attempts):  # the newest Slurm output that is there
        out = study / Path(attempt.get("output")
                           or f"{entry['name']}-{attempt.get('job_id')}.out").name
        if out.is_file():
            lines = [ln.strip() for ln in out.read_text(errors="replace").splitlines()
                     if ln.strip()]
            last = ([ln for ln in lines if "error" in ln.lower()] or lines or ["(empty)"])[-1]
            row["status"] = FAILED
            row["detail"] = f"ended before making its run directory: {last[:200]} (see {out.name})"
            return row
    ids = ", ".join(str(a["job_id"]) for a in attempts if a.get("job_id"))
    row["status"] = MISSING
    row["detail"] = (f"submitted (job {ids}) but no run directory yet: still queued (squeue), "
                     f"or cancelled before it started" if ids else
                     "not run yet: launch/run_benchmarks.py --resume runs it")
    return row


def read_manifest(study: Path) -> dict | None:
    """The study directory's study.json (None if it has none), checked enough to be used."""
    path = study / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(manifest["settings"], dict) or manifest["mode"] not in ("slurm",
                                                                                 "local"):
            raise ValueError("settings or mode malformed")
        for e in manifest["runs"]:
            e["name"], e["strategy"] = str(e["name"]), str(e["strategy"])
            e["nodes"], e["gpus_per_node"] = int(e["nodes"]), int(e["gpus_per_node"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path}: not a study manifest ({e.__class__.__name__}: {e}); restore "
                         f"it, or move it away (the run directories are then read without the "
                         f"study's plan)") from None
    return manifest


def is_run_dir(path: Path) -> bool:
    return (path / "job.env").is_file() or (path / "train.log").is_file()


def read_study(top: Path) -> list:
    """The rows of a study directory (its run directories, and its planned runs without one),
    or of one run directory (its study.json, one level up, gives its scaling mode)."""
    single = is_run_dir(top)
    manifest = read_manifest(top.parent if single else top)
    dirs = [top] if single else sorted(d for d in top.iterdir() if is_run_dir(d))
    if not dirs and manifest is None:
        raise UsageError(f"{top}: no run directories (folders with job.env or train.log) and no "
                         f"{MANIFEST} in it; pass a study directory of launch/run_benchmarks.py "
                         f"or run directories")
    plan = {e["name"]: e for e in (manifest or {}).get("runs", [])}
    rows = []
    for d in dirs:
        row = read_run_dir(d, plan)
        row["status"], row["detail"] = run_status(row)
        rows.append(row)
    started = {row["job_name"] for row in rows}
    return rows + [planned_row(top, entry) for name, entry in plan.items()
                   if name not in started and not single]


def read_inputs(paths: list) -> list:
    """The rows of the command line's study and run directories, each run once."""
    rows, seen = [], set()
    for p in paths:
        path = Path(p)
        if not path.is_dir():
            what = "not a directory" if path.exists() else "no such file or directory"
            raise UsageError(f"{p}: {what}; pass a study directory (launch/run_benchmarks.py) "
                             f"or run directories (launch/job.sh)")
        for row in read_study(path):
            key = (Path(row["path"] or path).resolve(), row["run"])
            if key not in seen:
                seen.add(key)
                rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# Scaling
# --------------------------------------------------------------------------------------------

def num(row: dict, key: str) -> float | None:
    """A row's value as a number; None when it is empty or not a number."""
    try:
        return float(row.get(key))
    except (TypeError, ValueError):
        return None


def gpus(row: dict) -> int | None:
    nodes, per_node = num(row, "nodes"), num(row, "gpus_per_node")
    return None if nodes is None or per_node is None else int(nodes * per_node)


def group_of(row: dict) -> tuple:
    """The tables are per strategy (in STRATEGIES order) and scaling mode."""
    s = row.get("strategy") or ""
    return (STRATEGIES.index(s) if s in STRATEGIES else len(STRATEGIES), s, row["scaling"])


def best(rows: list) -> dict:
    """The row the tables use among the runs of one configuration: the best status, then the
    newest run."""
    newest_first = sorted(rows, key=lambda r: r["start_time"], reverse=True)
    return min(newest_first, key=lambda r: STATUSES.index(r["status"]))


def _4(x: float) -> str:
    return f"{x:.4f}".rstrip("0").rstrip(".")


def scale(rows: list) -> dict:
    """Mark each configuration's best row used_in_tables and give every row with numbers its
    scaling factors against the 1-GPU, 1-node row of its group. Returns {group: {(nodes,
    GPUs per node): the row in the tables}}."""
    groups = {}
    for row in rows:
        if gpus(row) is None:
            row["notes"].append("configuration unknown (no [METRIC] line, job.env or plan); "
                                "not in the tables")
            continue
        config = (int(num(row, "nodes")), int(num(row, "gpus_per_node")))
        groups.setdefault(group_of(row), {}).setdefault(config, []).append(row)
    chosen = {}
    for key, configs in groups.items():
        chosen[key] = {config: best(runs) for config, runs in configs.items()}
        base = chosen[key].get((1, 1))
        if base and (base["status"] not in HAS_METRICS or not num(base, "throughput_img_s")):
            base = None
        for config, runs in configs.items():
            used = chosen[key][config]
            for row in runs:
                row["used_in_tables"] = int(row is used)
                if row is not used:
                    row["notes"].append(f"superseded in the tables by {used['run']} "
                                        f"({used['status']})")
                if base and row["status"] in HAS_METRICS and gpus(row) and num(
                        row, "throughput_img_s") is not None:
                    speedup = num(row, "throughput_img_s") / num(base, "throughput_img_s")
                    row.update(baseline=base["run"], throughput_scaling=_4(speedup),
                               parallel_efficiency=_4(speedup / gpus(row)))
                    if num(row, "gpu0_avg_mib") is not None and num(base, "gpu0_avg_mib"):
                        row["memory_avg_scaling"] = _4(num(row, "gpu0_avg_mib")
                                                       / num(base, "gpu0_avg_mib"))
    return chosen


# --------------------------------------------------------------------------------------------
# Why not N x: the parts of a step, and a scaling model beyond the study
# --------------------------------------------------------------------------------------------

#: The share of the 1-GPU step that a strategy's communication can hide behind: DDP
#: all-reduces gradient buckets during backward (about 2/3 of forward + backward); FSDP
#: prefetches the next all-gather during forward and backward alike.
OVERLAP = {"ddp": 2 / 3, "fsdp": 1.0}
COLLECTIVES = {"ddp": ("all_reduce",), "fsdp": ("all_gather", "reduce_scatter")}
MODEL_NODES = (2, 4, 8, 16, 32, 64)


def step_times(rows: list) -> None:
    """step_ms (training time of one step in the row's epoch) and data_wait_ms, its share
    spent waiting for the loader, for every row with numbers."""
    for row in rows:
        t, n, b = num(row, "epoch_time_s"), num(row, "train_images"), num(row, "global_batch")
        if row["status"] in HAS_METRICS and t and n and b:
            step = t * 1e3 * b / n
            row["step_ms"] = _4(step)
            if num(row, "data_wait_frac") is not None:
                row["data_wait_ms"] = _4(num(row, "data_wait_frac") * step)


def comm_ms(strategy: str, n: int, grad_bytes: float, busbw: dict) -> float:
    """Milliseconds of communication per step at ``n`` ranks with ring collectives, from the
    bus bandwidth per collective (GB/s, as nccl-tests define it: time = bytes x factor / busbw,
    factor 2(n-1)/n for an all-reduce, (n-1)/n for an all-gather or a reduce-scatter)."""
    if n <= 1:
        return 0.0
    ring = (n - 1) / n
    if strategy == "ddp":  # one all-reduce of the gradients
        return 2 * ring * grad_bytes / busbw["all_reduce"] / 1e6
    # fsdp: the parameters all-gathered for forward and again for backward, the gradients
    # reduce-scattered
    return (2 * ring * grad_bytes / busbw["all_gather"]
            + ring * grad_bytes / busbw["reduce_scatter"]) / 1e6


def predict_step_ms(strategy: str, t1_ms: float, n: int, grad_bytes: float,
                    busbw: dict) -> float:
    """Weak scaling: every GPU does the 1-GPU run's work (t1_ms a step) and waits for the
    communication that compute does not hide: step(n) = t1 + max(0, comm(n) - h x t1), h =
    OVERLAP[strategy]. Parallel efficiency = t1 / step(n)."""
    return t1_ms + max(0.0, comm_ms(strategy, n, grad_bytes, busbw) - OVERLAP[strategy] * t1_ms)


def model_inputs(key: tuple, configs: dict) -> tuple:
    """(inputs of the scaling model for a table group, or None, and why not). t1: the 1-GPU
    run's step; gradient bytes and bus bandwidth: the run with the most nodes that measured
    them (--profile or --check)."""
    _order, strategy, scaling = key
    if strategy not in OVERLAP:
        return None, f"no scaling model for {strategy or 'this strategy'} (one process)"
    if scaling == "strong":
        return None, "the scaling model covers weak scaling (fixed work per GPU)"
    base = configs.get((1, 1))
    if not base or num(base, "step_ms") is None:
        return None, "no scaling model: it needs the 1-GPU run's step time"
    ops = COLLECTIVES[strategy]
    measured = [r for r in configs.values() if num(r, "grad_bytes")
                and all(num(r, f"busbw_{op}_gbs") for op in ops)]
    if not measured:
        return None, ("no scaling model: no run measured its bus bandwidth; run the study with "
                      "`-- --profile` (each multi-GPU run then measures it)")
    source = max(measured, key=lambda r: (num(r, "nodes"), gpus(r)))
    nodes = int(num(source, "nodes"))
    per_node = int(num(source, "gpus_per_node")) if nodes > 1 else max(
        g for n, g in configs if n == 1)
    return dict(strategy=strategy, t1=num(base, "step_ms"), grad_bytes=num(source, "grad_bytes"),
                busbw={op: num(source, f"busbw_{op}_gbs") for op in ops}, source=source,
                per_node=per_node), ""


def predict(rows: list, chosen: dict) -> None:
    """Each measured multi-GPU row of a group with a scaling model: its predicted step and
    the relative error of the prediction."""
    for key, configs in chosen.items():
        inputs, _why = model_inputs(key, configs)
        for row in configs.values() if inputs else ():
            if gpus(row) > 1 and num(row, "step_ms"):
                predicted = predict_step_ms(inputs["strategy"], inputs["t1"], gpus(row),
                                            inputs["grad_bytes"], inputs["busbw"])
                row["predicted_step_ms"] = _4(predicted)
                row["prediction_error"] = _4(predicted / num(row, "step_ms") - 1)


# --------------------------------------------------------------------------------------------
# results.csv: everything the tables and plots show
# --------------------------------------------------------------------------------------------

def write_csv(rows: list, path: Path) -> None:
    middle = {}  # the [METRIC] keys as logged: rows with a [METRIC] line first
    for row in sorted(rows, key=lambda r: not r["metric_lines"]):
        middle.update(dict.fromkeys(k for k in row if k not in HEAD + TAIL + NOT_COLUMNS))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=HEAD + tuple(middle) + TAIL,
                                extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


# --------------------------------------------------------------------------------------------
# results.md: the workshop's two tables per strategy
# --------------------------------------------------------------------------------------------

def _fmt(row: dict, key: str, spec: str, unit: str = "") -> str:
    value = num(row, key)
    return "—" if value is None else f"{value:{spec}}{unit}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("s" if n != 1 else "")


def table_row(label: str, row: dict | None, epochs: str) -> list:
    """One table row: the workshop's columns, then parallel efficiency and status."""
    if row is None:
        return [label] + ["—"] * 9 + ["not in this study"]
    status = row["status"] + (f": {row['detail']}" if row["detail"] else "")
    if row["status"] not in HAS_METRICS or num(row, "throughput_img_s") is None:
        return [label] + [FAILED if row["status"] == FAILED else "—"] * 9 + [status]
    tag = f" (epoch {row['epoch']})" if epochs and row.get("epoch") != epochs else ""
    gpu = [row["gpu0"], "n/a", "n/a"]
    if row["gpu0_peak_mib"] != "":
        gpu = [str(row["gpu0_peak_mib"]), _fmt(row, "gpu0_avg_mib", ".2f"),
               str(row["gpu0_mode_mib"])]
    factors = [NO_BASELINE] * 3
    if row["baseline"]:
        memory = _fmt(row, "memory_avg_scaling", ".2f", "×")
        if memory == "—":  # say why
            memory = row["gpu0"] if row["gpu0_avg_mib"] == "" else "n/a (baseline: no GPU log)"
        factors = [_fmt(row, "throughput_scaling", ".2f", "×"), memory,
                   _fmt(row, "parallel_efficiency", ".0%")]
    return [label, _fmt(row, "train_loss", ".3f") + tag, _fmt(row, "train_acc", ".2f", "%") + tag,
            _fmt(row, "throughput_img_s", ".1f"), *gpu, *factors, status]


def _table(vs: str, epochs: str, labelled_rows: list) -> list:
    ep = f"Epoch {epochs}" if epochs else "final epoch"
    header = ["Config", f"Train Loss ({ep})", f"Train Acc ({ep})", "Throughput (img/s)",
              "GPU 0 Peak (MiB)", "GPU 0 Avg (MiB)", "GPU 0 Mode (MiB)",
              f"Throughput Scaling vs {vs}", f"Memory Avg Scaling vs {vs}",
              "Parallel Efficiency", "Status"]
    rows = [table_row(label, row, epochs) for label, row in labelled_rows]
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows])


def _distinct(rows: list, key: str) -> list:
    """The distinct values of a key, numbers in numeric order."""
    def order(value: str) -> tuple:
        n = num({key: value}, key)
        return (n is None, n or 0.0, value)
    return sorted({str(r[key]) for r in rows if r.get(key) not in (None, "")}, key=order)


def strategy_markdown(key: tuple, configs: dict, rows: list) -> list:
    """A strategy's heading, its workload, and the workshop's two tables."""
    _order, strategy, scaling = key
    members = [r for r in rows if group_of(r) == key]
    logged = [r for r in members if r["status"] in HAS_METRICS and r["metric_lines"]]

    def values(k, rows=logged):
        return "/".join(_distinct(rows, k))

    per_gpu = values("per_gpu_batch") or values("per_gpu_batch", members) or "?"
    global_ = values("global_batch") or values("global_batch", members) or "?"
    mode = {"weak": f"weak scaling, {per_gpu} images per GPU per step",
            "strong": f"strong scaling, global batch {global_} (per GPU: {per_gpu})"}.get(
        scaling, "scaling mode not recorded (no study.json)")
    lines = [f"## {STRATEGY_TITLE.get(strategy, strategy or 'unknown strategy')}: {mode}", ""]
    context = [f"{k} {values(k)}" for k in ("model", "dataset", "device", "amp") if values(k)]
    context += [f"{values('epochs')} epochs"] if values("epochs") else []
    if values("lr_peak"):  # the learning rate each run trained with, and why
        context.append(f"learning rate {values('lr_peak')} (lr scaling "
                       f"{values('lr_scaling') or 'none'}, warm-up "
                       f"{values('warmup_epochs') or '0'} epochs)")
    if context:
        lines.append(", ".join(context) + ".")
    if values("device") == "cpu":
        lines.append("CPU run: each \"GPU\" below is one process; there is no GPU memory log, "
                     "so CPU memory (psrecord) is in results.csv.")
    fixed = {"weak": ("per_gpu_batch",), "strong": ("global_batch",)}.get(scaling, ())
    for k in ("model", "dataset", "epochs") + fixed:
        if len(_distinct(logged, k)) > 1:
            lines.append(f"**Warning:** the runs differ in {k} ({', '.join(_distinct(logged, k))}"
                         f"): their scaling factors compare different workloads.")
    epochs = values("epochs") if len(_distinct(logged, "epochs")) == 1 else ""
    shown = {c: r for c, r in configs.items() if r["status"] != SKIPPED}

    def skipped(multi_node: bool) -> list:
        names = [c for c in sorted(configs) if configs[c]["status"] == SKIPPED
                 and (c[0] > 1) == multi_node]
        listed = ", ".join(f"{_count(n, 'Node')} x {_count(g, 'GPU')}" for n, g in names)
        return ["", f"Skipped: {listed}: {configs[names[0]]['detail']}."] if names else []

    lines += ["", "### Multi-GPU Scaling (1 Node)", ""]
    single = sorted(g for (n, g) in shown if n == 1)
    if single:
        labelled = [(f"{_count(g, 'GPU')}, 1 Node" + (" (baseline)" if g == 1 else ""),
                     shown[(1, g)]) for g in single]
        if 1 not in single:
            labelled.insert(0, ("1 GPU, 1 Node (baseline)", None))
        lines += _table("1G", epochs, labelled)
    else:
        lines.append("No single-node runs in this study.")
    lines += skipped(False) + ["", "### Multi-Node Scaling (Fixed GPUs per Node)", ""]
    sweeps = sorted({g for (n, g) in shown if n > 1})
    if sweeps:
        labelled = [("1 Node, 1 GPU (baseline)", shown.get((1, 1)))]
        labelled += [(f"{_count(n, 'Node')} x {_count(g, 'GPU')}", shown[(n, g)])
                     for g in sweeps for n in sorted(n for (n, gg) in shown if gg == g)
                     if (n, g) != (1, 1)]
        lines += _table("1N", epochs, labelled)
        lines += ["", "1N = the 1-GPU, 1-node baseline run (as in the workshop), so both "
                      "tables compare with the same run; the 1-node rows show where each node "
                      "sweep starts."]
    else:
        lines.append("No multi-node runs in this study.")
    return lines + skipped(True) + [""]


def _ms(row: dict | None, key: str) -> str:
    return "—" if row is None or num(row, key) is None else f"{num(row, key):.1f}"


def explain_markdown(key: tuple, configs: dict) -> list:
    """Why a group does not scale perfectly: each run's step split into its parts, then the
    scaling model's prediction beyond the study."""
    shown = [(c, r) for c, r in sorted(configs.items()) if num(r, "step_ms") is not None]
    if not shown:
        return []
    lines = ["### Where the step time goes", "",
             "ms per training step (final epoch). Data wait: the loader kept the step waiting. "
             "Compute, exposed communication (not hidden behind compute) and other: from "
             "`--profile`'s 5 traced steps, where profiled.", "",
             "| Config | Step | Data wait | Compute | Exposed comm. | Other | Comm. total | "
             "Bus bandwidth (GB/s) |", "|---|---|---|---|---|---|---|---|"]
    for (nodes, g), r in shown:
        profiled = num(r, "profile_step_ms") is not None
        parts = ([_ms(r, f"profile_{k}_ms") for k in ("compute", "exposed_comm", "other",
                                                      "comm")]
                 if profiled else ["not profiled"] * 3 + ["—"])
        bw = ", ".join(f"{op} {r[f'busbw_{op}_gbs']}" for op in
                       ("all_reduce", "all_gather", "reduce_scatter") if r[f"busbw_{op}_gbs"])
        lines.append(f"| {_count(nodes, 'node')} x {_count(g, 'GPU')} | {_ms(r, 'step_ms')} | "
                     f"{_ms(r, 'data_wait_ms')} | " + " | ".join(parts) + f" | {bw or '—'} |")
    inputs, why = model_inputs(key, configs)
    if key[1] not in OVERLAP:  # DataParallel: one process, nothing to model
        return lines + [""]
    lines += ["", "### Scaling model: beyond this study", ""]
    if not inputs:
        return lines + [why + ".", ""]
    strategy, t1, per_node = inputs["strategy"], inputs["t1"], inputs["per_node"]
    source = inputs["source"]
    bw = ", ".join(f"{op} {v:g} GB/s" for op, v in inputs["busbw"].items())
    comm = ("2(N-1)/N x G / busbw(all_reduce)" if strategy == "ddp" else
            "2(N-1)/N x G / busbw(all_gather) + (N-1)/N x G / busbw(reduce_scatter)")
    lines += [f"step(N) = t1 + max(0, comm(N) - h x t1), comm(N) = {comm}; efficiency = t1 / "
              f"step(N). Here t1 = {t1:.1f} ms (the 1-GPU run), G = "
              f"{inputs['grad_bytes'] / 1e6:.1f} MB (fp32 gradients), bus bandwidth {bw} "
              f"(measured by {source['run']} on {_count(int(num(source, 'nodes')), 'node')}"
              f"{'' if num(source, 'nodes') > 1 else ': within a node, so optimistic beyond'}), "
              f"h = {OVERLAP[strategy]:.2f} (the share of a step communication can hide "
              f"behind). See the README, \"A scaling model\".", "",
              "| Config | GPUs | Predicted step (ms) | Predicted efficiency | Measured step (ms) "
              "| Error |", "|---|---|---|---|---|---|"]
    measured = {c: r for c, r in configs.items() if r["predicted_step_ms"]}
    planned = {(n, per_node): None for n in MODEL_NODES}
    for (nodes, g), r in sorted({**planned, **measured}.items()):
        step = (num(r, "predicted_step_ms") if r else
                predict_step_ms(strategy, t1, nodes * g, inputs["grad_bytes"], inputs["busbw"]))
        error = f"{num(r, 'prediction_error'):+.0%}" if r else "—"
        lines.append(f"| {_count(nodes, 'node')} x {_count(g, 'GPU')} | {nodes * g} | "
                     f"{step:.1f} | {t1 / step:.0%} | {_ms(r, 'step_ms')} | {error} |")
    return lines + [""]


def write_markdown(rows: list, chosen: dict, studies: list, path: Path, pngs: list) -> None:
    counts = ", ".join(f"{n} {s}" for s in STATUSES if (n := [r["status"] for r in rows].count(s)))
    bad = sum(len(r["bad"]) for r in rows)
    lines = ["# Scaling study results", "",
             f"Collected from {', '.join(f'`{s}`' for s in studies)} on "
             f"{datetime.now():%Y-%m-%d %H:%M} by `python collect_results.py`: {len(rows)} runs "
             f"({counts}).", "",
             "Values are from each run's final epoch. Throughput Scaling = throughput / "
             "throughput of the same strategy's 1-GPU, 1-node run; Memory Avg Scaling = GPU 0 "
             "Avg / its GPU 0 Avg (GPU 0 = index 0 on the job's first node); Parallel "
             "Efficiency = Throughput Scaling / GPUs. All columns, CPU memory and every "
             "attempt are in results.csv.", ""]
    if bad:
        lines += [f"**{bad} [METRIC] line(s) could not be parsed** and were left out; they are "
                  f"listed under Notes.", ""]
    for key in sorted(chosen):
        lines += strategy_markdown(key, chosen[key], rows)
        lines += explain_markdown(key, chosen[key])
    if pngs:
        lines += ["## Plots", ""]
        for name in pngs:
            lines += [f"![{PLOTS[name]}]({name})", ""]
    notes = []
    for r in rows:
        notes += [f"- {r['run']}: {note}" for note in r["notes"]]
        notes += [f"- {r['run']}: unparseable [METRIC] line at train.log:{number}: {why}: "
                  f"`{text[:160]}`" for number, why, text in r["bad"][:5]]
        if len(r["bad"]) > 5:
            notes.append(f"- {r['run']}: ... and {len(r['bad']) - 5} more unparseable lines")
    if notes:
        lines += ["## Notes", ""] + notes + [""]
    path.write_text("\n".join(lines), encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Plots: what to draw, as plain numbers (plots.py draws it)
# --------------------------------------------------------------------------------------------

PLOTTED = ("epoch_time_s", "val_loss", "val_acc", "gpu0_peak_mib", "peak_mem_mib",
           "throughput_img_s")


def plot_data(chosen: dict) -> tuple:
    """(series, ideal, bars) for plots.study_plots: per strategy, a line through its 1-node runs
    and a dashed one per GPUs-per-node through its node sweep; the ideal throughput (1-GPU x
    GPUs) where there is a 1-GPU baseline; a bar of the step's parts per configuration."""
    def points(rows: list) -> list:
        return [dict(gpus=gpus(r), partial=r["status"] != OK, device=r.get("device"),
                     **{column: num(r, column) for column in PLOTTED}) for r in rows]

    series, ideal, bars = [], [], []
    for key in sorted(chosen):
        configs = {c: r for c, r in chosen[key].items()
                   if r["status"] in HAS_METRICS and num(r, "throughput_img_s") is not None}
        if not configs:
            continue
        name = key[1] + (f" ({key[2]})" if len({k[2] for k in chosen}) > 1 and key[2] else "")
        if any(n == 1 for n, g in configs):
            series.append(dict(group=key, label=f"{name}, 1 node", line="-",
                               points=points([configs[c] for c in sorted(configs) if c[0] == 1])))
        for g in sorted({g for n, g in configs if n > 1}):
            sweep = sorted(c for c in configs if c[1] == g)
            series.append(dict(group=key, label=f"{name}, {g} GPU/node, 1-{sweep[-1][0]} nodes",
                               line="--", points=points([configs[c] for c in sweep])))
        base, own = chosen[key].get((1, 1)), sorted({gpus(r) for r in configs.values()})
        if base and base["baseline"] and len(own) > 1:
            ideal.append((key, f"{key[1]}, ideal (1-GPU x GPUs)", own,
                          [num(base, "throughput_img_s") * x for x in own]))
        for (n, g), r in sorted(chosen[key].items()):
            if num(r, "step_ms") is None:
                continue
            if num(r, "profile_step_ms") is not None:  # --profile: the traced steps' parts
                parts = dict(compute=num(r, "profile_compute_ms") or 0.0,
                             exposed_comm=num(r, "profile_exposed_comm_ms") or 0.0,
                             data_wait=num(r, "profile_data_wait_ms") or 0.0,
                             other=num(r, "profile_other_ms") or 0.0)
            else:  # the epoch's data wait, and the rest unexplained
                wait = num(r, "data_wait_ms") or 0.0
                parts = dict(data_wait=wait, unprofiled=max(0.0, num(r, "step_ms") - wait))
            bars.append((f"{key[1]}, {_count(n, 'node')} x {_count(g, 'GPU')}", parts))
    return series, ideal, bars


def write_plots(chosen: dict, out_dir: Path, dpi: int) -> list:
    """The PNGs of PLOTS in out_dir; returns their names (none when no run has metrics)."""
    series, ideal, bars = plot_data(chosen)
    if not series:
        print("note: no run with metrics to plot; no PNG written", file=sys.stderr)
        return []
    return plots.study_plots(series, ideal, bars, out_dir, dpi)


def write_timelines(rows: list, out_dir: Path) -> list:
    """--plot: each run directory's timeline, as ``timeline-<run>.png`` in out_dir (what
    ``analyze_memory.py --plot RUN_DIR`` draws); a run it cannot draw gets a note."""
    written = []
    for row in rows:
        run_dir = Path(row["path"]) if row["path"] else None
        if run_dir is None or not any((run_dir / d).is_dir() for d in ("gpu_memory",
                                                                        "cpu_memory")):
            continue
        try:
            path = out_dir / f"timeline-{row['run']}.png"
            analyze_memory.plot_timeline(run_dir, path, [])
            written.append(path)
        except (analyze_memory.LogError, OSError) as e:
            row["notes"].append(f"no timeline drawn: {e}")
    return written


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="collect_results.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="DIR",
                        help="a study directory (launch/run_benchmarks.py --study-dir) or run "
                             "directories (launch/job.sh)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where results.csv, results.md and the plots go (default: the one "
                             "directory given, else the current directory); created if needed")
    parser.add_argument("--plot", action="store_true",
                        help="also write the PNG plots (matplotlib, headless)")
    parser.add_argument("--dpi", type=int, default=100, help="resolution of the PNG plots")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out or (args.paths[0] if len(args.paths) == 1 else "."))
    try:
        if args.dpi < 50:
            raise UsageError(f"--dpi {args.dpi} is too small to read; use 50 or more")
        if args.plot and (why := plots.missing_matplotlib()):
            raise UsageError(why)
        rows = read_inputs(args.paths)
        chosen = scale(rows)
        step_times(rows)
        predict(rows, chosen)
        try:
            out.mkdir(parents=True, exist_ok=True)
            pngs = write_plots(chosen, out, args.dpi) if args.plot else []
            timelines = write_timelines(rows, out) if args.plot else []
            write_csv(rows, out / "results.csv")
            write_markdown(rows, chosen, args.paths, out / "results.md", pngs)
        except OSError as e:
            raise UsageError(f"cannot write to {out} ({e.strerror or e}); pass a writable "
                             f"--out DIR") from None
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    statuses = [r["status"] for r in rows]
    print(f"{len(rows)} runs: " + ", ".join(f"{statuses.count(s)} {s}" for s in STATUSES
                                            if s in statuses))
    for r in rows:
        if r["status"] not in (OK, SKIPPED):
            print(f"  {r['run']}: {r['status']}" + (f" ({r['detail']})" if r["detail"] else ""))
    bad = [(r["path"], line) for r in rows for line in r["bad"]]
    if bad:
        print(f"warning: {len(bad)} unparseable [METRIC] line(s), left out:", file=sys.stderr)
        for path, (number, why, _text) in bad:
            print(f"  {path}/train.log:{number}: {why}", file=sys.stderr)
    print(f"wrote {out / 'results.csv'} and {out / 'results.md'}"
          + (f", plots: {', '.join(str(out / p) for p in pngs)}" if pngs else ""))
    if timelines:
        print(f"timelines (memory and utilisation over time, one per run): "
              f"{out / 'timeline-<run>.png'}, {len(timelines)} of them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
