"""Turn a scaling study into tables and plots: results.csv, results.md and, with --plot, PNGs.

    python collect_results.py runs/study-20250101-120000          # launch/run_benchmarks.py's
    python collect_results.py runs/study-20250101-120000 --plot   # + six PNG plots, and
                                                                  # timeline-<run>.png per run
    python collect_results.py runs/ddp-1n1g-4101 runs/ddp-1n2g-4102 --out results/  # run dirs

Input: study directories (launch/run_benchmarks.py: study.json, the plan, and a run directory
per job) and run directories (launch/job.sh: job.env, train.log, gpu_memory/, cpu_memory/,
memory_summary.json). No torch needed; --plot needs matplotlib.

The pipeline: each run directory -> one row, a plain dict (every key=value of the training's last
[METRIC] line, job.env, GPU 0 and CPU memory from analyze_memory.py) -> its status -> scaling
factors, step times and predictions (scaling.py) -> results.csv. results.md and the plots are
made from those rows alone (report.py; plots.py draws).

Status of a run (a configuration run several times keeps every attempt in results.csv; the
tables use the first status in this order, the newest run on a tie):
  ok        the final [METRIC] line (final=1) is there and the job exited 0
  requeued  exit code 75: stopped by a signal after checkpointing, to be requeued (not a
            failure, not complete either); shown like partial
  partial   no final line and no EXIT_CODE in job.env: killed mid-run, or still running;
            the tables show the last completed epoch
  failed    a non-zero exit code, or the job ended without the final [METRIC] line
  unreadable  its run directory or a file in it cannot be read (another user's, say)
  missing   planned in study.json, but no run directory (not submitted yet, or still queued)
  skipped   planned in study.json but not run (e.g. dp on more than one node)

Scaling, per strategy and scaling mode, from the final epoch, against the 1-GPU, 1-node run:
Throughput Scaling = throughput / its throughput; Memory Avg Scaling = GPU 0 Avg / its GPU 0
Avg (GPU 0 = index 0 on the job's first node); Parallel Efficiency = Throughput Scaling / GPUs.
A throughput that is not a finite number above 0 (nan, inf, 0, negative) is no figure: the
tables show "—" and a note, it is no baseline, and results.csv keeps it as logged.

Why not N x: each run's step time (epoch time x global batch / images), its data wait and,
from the [PROFILE] and [BANDWIDTH] lines of a run with --profile, the step's parts and the bus
bandwidth of its collectives; from those a weak-scaling model predicts 2 to 64 nodes
(scaling.predict_step_ms; the formula is in docs/slurm.md, "A scaling model"). Where no multi-node
run measured the bandwidth between nodes, the model assumes --inter-node-busbw.

Exit status: 0 results written (failed runs are results too); 1 results written, but
--tensorboard could not write some runs' scalars (each named); 2 a bad path or flag, a folder
of studies such as runs/ or two studies (one study at a time), nothing to collect (no run
that can be read, or none run yet), the output cannot be written, or a module of the
repository missing beside this file (one sentence naming the fix). results.csv, results.md and the plots are replaced together: a write
that fails leaves those of the last collection as they were.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

try:  # the repository's modules beside this file: a copy of this file alone says what to add
    import analyze_memory
    from reporting import plots, report, scaling
    from training import contract
except ImportError:
    needed = ("analyze_memory.py", "reporting/plots.py", "reporting/report.py",
             "reporting/scaling.py", "reporting/timeline.py", "training/contract.py")
    what = next((n for n in needed if not (Path(__file__).parent / n).is_file()), None)
    if __name__ != "__main__" or what is None:
        raise
    print(f"error: {Path(__file__).name} needs {what} beside it: copy analyze_memory.py and "
          f"the folders reporting/ and training/ from the repository too, or run the "
          f"repository's copy", file=sys.stderr)
    sys.exit(2)
from reporting import stragglers  # noqa: E402
from reporting.scaling import (FAILED, MISSING, OK, PARTIAL,  # noqa: E402
                               REQUEUED, SKIPPED, STATUSES, UNREADABLE)
from training.contract import (BANDWIDTH_PREFIX, MEMORY_PREFIX,  # noqa: E402
                               PROFILE_PREFIX, REQUEUE_EXIT)

MANIFEST = "study.json"     # the study's plan, written by launch/run_benchmarks.py
NO_GPU_LOG = "n/a (no GPU log)"

# results.csv: HEAD, then every [METRIC] key in the order the training logged it, then TAIL.
HEAD = ("run", "status", "detail", "used_in_tables", "scaling")
TAIL = ("gpu0", "gpu0_peak_mib", "gpu0_avg_mib", "gpu0_mode_mib",
        "cpu_node", "cpu_peak_rss_mib", "cpu_avg_rss_mib", "cpu_peak_pct", "cpu_avg_pct",
        "throughput_scaling", "memory_avg_scaling", "parallel_efficiency", "baseline",
        "step_ms", "data_wait_ms", "profile_steps", "profile_step_ms", "profile_compute_ms",
        "profile_exposed_comm_ms", "profile_data_wait_ms", "profile_other_ms", "profile_comm_ms",
        "profile_launches_per_step",
        "grad_bytes", "busbw_all_reduce_gbs", "busbw_all_gather_gbs",
        "busbw_reduce_scatter_gbs", "transport", "messages_all_reduce", "messages_all_gather",
        "messages_reduce_scatter", "predicted_step_ms", "prediction_error",
        *(f"predicted_{k}" for k in contract.READ_MEMORY_SIZE_KEYS), "predicted_variant",
        "memory_error",
        "exit_code", "job_id", "job_name", "restarts", "start_time", "end_time",
        "metric_lines", "bad_metric_lines", "path")
NOT_COLUMNS = ("final", "notes", "bad")  # in a row, but not in results.csv
# The figures read_memory takes from analyze_memory.py's summary of a GPU and of a node's CPU.
SUMMARY_GPU_FIGURES = ("peak_mib", "avg_mib", "mode_mib")
SUMMARY_CPU_FIGURES = ("peak_rss_mib", "avg_rss_mib", "peak_cpu_pct", "avg_cpu_pct")
# memory_summary.json's CPU keys before 2026-12-07 (their numbers were MiB all along)
OLD_SUMMARY_KEYS = {"peak_rss_mb": "peak_rss_mib", "avg_rss_mb": "avg_rss_mib"}


class UsageError(Exception):
    """A problem the user can fix: printed as one sentence naming the fix, exit code 2."""


# --------------------------------------------------------------------------------------------
# Reading: a run directory -> one row
# --------------------------------------------------------------------------------------------

def read_log(path: Path) -> tuple:
    """The [METRIC] lines of a train.log as {key: text as logged}, in order, and the lines that
    mention [METRIC] but do not parse, as (line number, why, text): another rank's output glued
    into the line, or a line cut off when the job was killed (contract.read_metric_line's rules).
    Those are counted, never guessed."""
    lines, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, text, values, problem in contract.metric_lines(f):
            if problem is None:
                lines.append(values)
            else:
                bad.append((number, problem, text.strip()))
    return lines, bad


def read_explanations(path: Path) -> dict:
    """What explains a run's numbers in its train.log, as row columns: the predicted memory
    per GPU of its [MEMORY] line (predicted_<key>, predicted_variant); with --profile, the last
    [PROFILE] line's parts (profile_<key>) and, per collective, the bus bandwidth at the
    largest message size measured ([BANDWIDTH] lines: busbw_<op>_gbs, and that size as
    grad_bytes), with the collectives of that kind per training step where the run counted
    them (messages_<op>) and the network that carried them (transport: IB, RoCE, socket, P2P,
    gloo-tcp ..., as training/network.py writes it)."""
    readers = {MEMORY_PREFIX: _explain_memory, PROFILE_PREFIX: _explain_profile,
               BANDWIDTH_PREFIX: _explain_bandwidth}
    found = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for text in f:
            if not text.endswith("\n"):  # a line cut off when the job was killed
                continue
            for tag, explain in readers.items():
                parsed = contract.fields(text, tag + " ")
                if parsed is not None:
                    explain(parsed[0], found)
    return found


def _explain_memory(pairs: dict, found: dict) -> None:
    """A [MEMORY] line whose sizes are all numbers: the predicted memory per GPU. An older
    line without the later keys (data_mib, inputs_mib, workspace_mib) did not count them, and
    a newer one has no transient_mib: "" there."""
    sizes = contract.READ_MEMORY_SIZE_KEYS
    optional = contract.LATER_MEMORY_KEYS + contract.EARLIER_MEMORY_KEYS
    if all(contract.is_number(pairs.get(k, "")) for k in sizes
           if k not in optional or k in pairs):
        found.update((f"predicted_{k}", pairs.get(k, "")) for k in sizes)
        found["predicted_variant"] = pairs.get("variant", "")


def _explain_profile(pairs: dict, found: dict) -> None:
    """A [PROFILE] line: the step's parts (its trace's file name is no figure)."""
    found.update((f"profile_{k}", v) for k, v in pairs.items() if k != "trace")


def _explain_bandwidth(pairs: dict, found: dict) -> None:
    """A [BANDWIDTH] line: kept when its message size is at least the largest one so far."""
    if "op" in pairs and pairs.get("bytes", "").isdigit() and int(
            pairs["bytes"]) >= int(found.get("grad_bytes", 0)):
        found["grad_bytes"] = pairs["bytes"]
        found[f"busbw_{pairs['op']}_gbs"] = pairs.get("busbw_gbs", "")
        found["transport"] = pairs.get("transport", "")  # "" in a log from before the key
        found[f"messages_{pairs['op']}"] = pairs.get("messages", "")


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
        notes += [p["message"] for p in problems]  # each problem is {"kind", "path", "message"}
    elif (run_dir / "memory_summary.json").is_file():
        try:
            summary = json.loads((run_dir / "memory_summary.json").read_text(encoding="utf-8"))
            gpu, cpu = summary_rows(summary)
        except (OSError, ValueError) as e:
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
            "cpu_node": c.get("node", ""), "cpu_peak_rss_mib": c.get("peak_rss_mib", ""),
            "cpu_avg_rss_mib": c.get("avg_rss_mib", ""), "cpu_peak_pct": c.get("peak_cpu_pct", ""),
            "cpu_avg_pct": c.get("avg_cpu_pct", "")}, notes


def summary_rows(summary) -> tuple:
    """(GPU rows, CPU rows) of a memory_summary.json, checked to be what analyze_memory.py
    --json writes as far as read_memory reads it: lists of objects, each naming its node, each
    GPU one its index, every figure a number. ValueError saying what is not."""
    if not (isinstance(summary, dict) and isinstance(summary.get("gpu"), list)
            and isinstance(summary.get("cpu"), list)):
        raise ValueError('not {"gpu": [...], "cpu": [...]}')
    for kind, figures in (("gpu", SUMMARY_GPU_FIGURES), ("cpu", SUMMARY_CPU_FIGURES)):
        for i, r in enumerate(summary[kind], 1):
            if not (isinstance(r, dict) and isinstance(r.get("node"), str)
                    and (kind == "cpu" or type(r.get("gpu")) is int)  # not true/false
                    and all(_is_figure(r[k]) for k in figures + tuple(OLD_SUMMARY_KEYS)
                            if k in r)):
                raise ValueError(f"{kind} entry {i} is not an object with a node name"
                                 + (", a GPU index" if kind == "gpu" else "")
                                 + f" and numbers for {', '.join(figures)}")
    cpu = [{OLD_SUMMARY_KEYS.get(k, k): v for k, v in r.items()} for r in summary["cpu"]]
    return summary["gpu"], cpu


def _is_figure(value) -> bool:
    """Whether a JSON value is a finite number (true and false are not)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


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
    folder = run_name(run_dir)
    if name not in plan:  # without job.env: the directory is <job name>-<job id>
        name = next((n for n in plan if folder.startswith(n + "-")), name)
    row = new_row(folder, plan.get(name), str(run_dir))
    lines = []
    if (run_dir / "train.log").is_file():
        lines, row["bad"] = read_log(run_dir / "train.log")
        row.update(read_explanations(run_dir / "train.log"))
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
    predicted, measured = contract.number(row.get("predicted_peak_mib")), contract.number(
        row.get("peak_mem_mib"))
    if predicted and measured and row.get("device") == "cuda":  # a CPU run's peak is its RSS
        row["memory_error"] = f"{predicted / measured - 1:.4f}"
    row["notes"] += notes
    return row


def run_status(row: dict) -> tuple:
    """(status, detail) of a run directory's row; the statuses are in the module docstring."""
    code = int(row["exit_code"]) if row["exit_code"].isdigit() else None
    epoch, epochs = row.get("epoch"), row.get("epochs")
    done = f"{epoch}/{epochs} epochs done" if epoch else "no epoch done"
    has_log = (Path(row["path"]) / "train.log").is_file()
    no_log = "" if has_log else "; no train.log in the run directory"
    if row.get("final") == "1" and code in (0, None):
        return OK, "" if code == 0 else "no EXIT_CODE in job.env, but training finished"
    if code == 0 and epoch and epoch == epochs:
        return OK, "final [METRIC] line unreadable; its last epoch line is complete"
    if code == REQUEUE_EXIT:
        return REQUEUED, (f"exit code {code}: stopped by a signal after checkpointing, to be "
                          f"requeued; {done}{no_log}")
    if code is None:
        return PARTIAL, (f"{done}; no EXIT_CODE in job.env: killed mid-run, or still "
                         f"running{no_log}")
    if not has_log:
        return FAILED, f"exit code {code}{no_log}"
    if code:
        why = f"exit code {code}"
    elif row["bad_metric_lines"]:
        why = "exit code 0 but no readable final [METRIC] line (see the notes)"
    else:
        why = "exit code 0 but no final [METRIC] line (a --check run, or the log was cut)"
    return FAILED, f"{why}; {done}; see {row['run']}/train.log"


def planned_row(study: Path, entry: dict) -> dict:
    """A planned run without a run directory: skipped, missing, or failed before job.sh ran."""
    row = new_row(entry["name"], entry)
    row.update(planned_config(entry), job_name=entry["name"])
    if entry.get("skipped"):
        row["status"], row["detail"] = SKIPPED, entry["skipped"]
        return row
    attempts = entry.get("attempts") or []
    # a local run's attempt names the run directory it made (a Slurm one, where it will be)
    newest = attempts[-1] if attempts else {}
    gone = newest.get("run_dir") if "exit_code" in newest else None
    if gone:  # the newest attempt made one, which is not in the study now
        row["status"] = MISSING
        row["detail"] = (f"its run directory {Path(gone).name} is not in the study any more "
                         f"(moved or deleted); put it back, or launch/run_benchmarks.py --resume "
                         f"runs it again")
        return row
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
        # utf-8-sig: a byte order mark (the file saved again by an editor on Windows) is not
        # JSON, and json.loads refused the whole manifest for it
        manifest = json.loads(path.read_text(encoding="utf-8-sig"))
        if not isinstance(manifest["settings"], dict) or manifest["mode"] not in ("slurm",
                                                                                 "local"):
            raise ValueError("settings or mode malformed")
        if not (isinstance(manifest["runs"], list)
                and isinstance(manifest.get("invocations", []), list)):
            raise ValueError("runs or invocations is not a list")
        for e in manifest["runs"]:
            e["name"], e["strategy"] = str(e["name"]), str(e["strategy"])
            e["nodes"], e["gpus_per_node"] = int(e["nodes"]), int(e["gpus_per_node"])
            check_entry(e)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path}: not a study manifest ({e.__class__.__name__}: {e}); restore "
                         f"it, or move it away (the run directories are then read without the "
                         f"study's plan)") from None
    return manifest


def check_entry(entry: dict) -> None:
    """ValueError unless what the rows take from a study.json entry beyond its configuration
    has launch/run_benchmarks.py's shape: text for its scaling mode and why it was skipped,
    a list of objects for its attempts, each with the text of its Slurm output's path."""
    attempts = entry.get("attempts", [])
    if not (isinstance(entry.get("scaling", ""), str)
            and isinstance(entry.get("skipped") or "", str) and isinstance(attempts, list)
            and all(isinstance(a, dict) and isinstance(a.get("output") or "", str)
                    for a in attempts)):
        raise ValueError(f"run {entry['name']}: scaling, skipped or attempts malformed")


def run_name(run_dir: Path) -> str:
    """A run directory's name, which its row and timeline-<run>.png take: that of the real
    folder, also when it is spelled "." (Path(".").name is "") or reached by a link."""
    return run_dir.resolve().name


def is_run_dir(path: Path) -> bool:
    """A folder with job.env or train.log; one that cannot be looked into counts too, so that
    it is listed as unreadable rather than left out without a word."""
    try:
        return (path / "job.env").is_file() or (path / "train.log").is_file()
    except PermissionError:
        return True


def unreadable_row(run_dir: Path, err: OSError, plan: dict) -> dict:
    """The row of a run directory that cannot be read: listed, with why, and no numbers."""
    folder = run_name(run_dir)
    name = next((n for n in plan if folder.startswith(n + "-")), "")
    row = new_row(folder, plan.get(name), str(run_dir))
    if name:
        row.update(planned_config(plan[name]))
    row["job_name"] = name
    where = err.filename or run_dir
    row["status"] = UNREADABLE
    row["detail"] = (f"cannot read {where} ({err.strerror or err}): run as a user who may "
                     f"read it, or make it readable (chmod -R a+rX {run_dir})")
    return row


def check_not_a_folder_of_studies(top: Path, dirs: list) -> None:
    """UsageError if top, which has no study.json, holds studies (folders with one), as runs/
    does: collecting only the run directories beside them would give a part the user did not
    mean and say nothing of the rest, and a study's tables are for that study alone."""
    studies = sorted(d for d in top.iterdir()
                     if d.is_dir() and not is_run_dir(d) and (d / MANIFEST).is_file())
    if not studies:
        return
    names = ", ".join(d.name for d in studies[:4]) + (f" and {len(studies) - 4} more"
                                                      if len(studies) > 4 else "")
    loose = ""
    if dirs:
        some = " ".join(shlex.quote(str(d)) for d in dirs[:2]) + (" ..." if len(dirs) > 2
                                                                    else "")
        loose = (f"; for the {len(dirs)} run director{'y' if len(dirs) == 1 else 'ies'} "
                 f"beside them, name {'it' if len(dirs) == 1 else 'them'}: python "
                 f"collect_results.py {some}")
    raise UsageError(f"{top} is no study but holds {len(studies)} "
                     f"stud{'y' if len(studies) == 1 else 'ies'} ({names}): collect one study "
                     f"at a time (a study's tables compare its own strategies and GPU counts): "
                     f"python collect_results.py {shlex.quote(str(studies[0]))}{loose}")


def read_study(top: Path) -> list:
    """The rows of a study directory (its run directories, and its planned runs without one),
    or of one run directory (its study.json, one level up, gives its scaling mode)."""
    try:
        os.listdir(top)
    except PermissionError as err:  # nothing in it can be read: no results, not one "run"
        raise UsageError(f"cannot read {top} ({err.strerror}): run as a user who may read it, "
                         f"or make it readable (chmod -R a+rX {top})") from None
    single = is_run_dir(top)
    # resolved: the parent of "." (a run directory collected from inside it) is "." too
    manifest = read_manifest(top.resolve().parent if single else top)
    dirs = [top] if single else sorted(d for d in top.iterdir() if is_run_dir(d))
    # a link to a run beside it (latest -> ddp-1n2g-5002) is that run, listed once, by the
    # real folder's path
    real = {}
    for d in sorted(dirs, key=Path.is_symlink):
        real.setdefault(d.resolve(), d)
    dirs = sorted(real.values())
    if not single and manifest is None:
        check_not_a_folder_of_studies(top, dirs)
    if not dirs and manifest is None:
        raise UsageError(f"{top}: no run directories (folders with job.env or train.log) and no "
                         f"{MANIFEST} in it; pass a study directory of launch/run_benchmarks.py "
                         f"or run directories")
    plan = {e["name"]: e for e in (manifest or {}).get("runs", [])}
    rows = []
    for d in dirs:
        try:
            row = read_run_dir(d, plan)
            row["status"], row["detail"] = run_status(row)
        except PermissionError as err:
            row = unreadable_row(d, err, plan)
        rows.append(row)
    started = {row["job_name"] for row in rows}
    return rows + [planned_row(top, entry) for name, entry in plan.items()
                   if name not in started and not single]


def read_inputs(paths: list) -> list:
    """The rows of the command line's study and run directories, each run once; two studies
    are refused, as a folder of studies is (runs scaled against another study's baseline)."""
    studies = list(dict.fromkeys(  # one study named twice (s1 s1/, a link to it) is one
        Path(p).resolve() for p in paths  # (os.path.isfile: False for a folder it may not enter)
        if os.path.isfile(os.path.join(p, MANIFEST)) and not is_run_dir(Path(p))))
    if len(studies) > 1:
        raise UsageError(f"{studies[0]} and {studies[1]} are two studies: collect one study at "
                         f"a time (a study's tables compare its own strategies and GPU counts): "
                         f"python collect_results.py {shlex.quote(str(studies[0]))}, then each "
                         f"other one, with its own --out if you give one")
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
# results.csv: everything the tables and plots show
# --------------------------------------------------------------------------------------------

def write_csv(rows: list, path: Path) -> None:
    # The [METRIC] keys in the order the training logged them; rows with a [METRIC] line
    # come first, so their order wins.
    middle = {}
    for row in sorted(rows, key=lambda r: not r["metric_lines"]):
        middle.update(dict.fromkeys(k for k in row if k not in HEAD + TAIL + NOT_COLUMNS))
    # surrogateescape: a run folder's name that is not UTF-8 is written as its own bytes
    with open(path, "w", newline="", encoding="utf-8", errors="surrogateescape") as f:
        writer = csv.DictWriter(f, fieldnames=HEAD + tuple(middle) + TAIL,
                                extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def runs_with_logs(rows: list):
    """(row, run directory) of every row whose run directory holds memory logs. A run
    directory this user may not read is none of them: its row says so already (os.path.isdir
    is False there, where Path.is_dir raises PermissionError)."""
    for row in rows:
        run_dir = Path(row["path"]) if row["path"] else None
        if run_dir is not None and any(os.path.isdir(run_dir / d) for d in ("gpu_memory",
                                                                            "cpu_memory")):
            yield row, run_dir


def write_boards(rows: list) -> tuple:
    """--tensorboard: each run directory's memory logs as TensorBoard scalars in its
    tensorboard/ folder (analyze_memory.py --tensorboard RUN_DIR). Returns the folders written
    and a sentence for each run it cannot write (a note of that run's row too)."""
    written, failed = [], []
    for row, run_dir in runs_with_logs(rows):
        notes, problems = [], []
        logs = analyze_memory.collect_logs([run_dir], notes, problems)
        written += analyze_memory.write_boards(logs, notes, problems)
        unwritten = [p["message"] for p in problems if "cannot write" in p["message"]]
        row["notes"] += unwritten
        failed += unwritten
    return written, failed


# --------------------------------------------------------------------------------------------
# --plot: each run over time (analyze_memory.py draws it)
# --------------------------------------------------------------------------------------------

def write_timelines(rows: list, out_dir: Path, shown_dir: Path) -> list:
    """--plot: each run directory's timeline, as ``timeline-<run>.png`` in out_dir (what
    ``analyze_memory.py --plot RUN_DIR`` draws). What the drawing notes (clocks that disagree,
    an unreadable training log) joins the run's notes, except what reading the memory logs
    already noted; not how a CPU-only run's log was placed, which every CPU run would repeat;
    a run it cannot draw gets a note (its reason unless a note above already gives it), which
    names ``shown_dir``, where the files end up, not the staging folder out_dir."""
    written, drawn = [], list(runs_with_logs(rows))
    # Two runs of the same name (from two studies) get a file each, the later one said so; a
    # suffix never takes another run's own name (a run named ddp-2 beside two named ddp).
    taken = {f"timeline-{row['run']}.png" for row, _ in drawn}
    seen = set()
    for row, run_dir in drawn:
        name = f"timeline-{row['run']}.png"
        if name in seen:
            n = 2
            while (name := f"timeline-{row['run']}-{n}.png") in taken:
                n += 1
            taken.add(name)
            row["notes"].append(f"{name} is the timeline of {run_dir}: an earlier run is named "
                                f"{row['run']} too")
        seen.add(f"timeline-{row['run']}.png")
        try:
            path = out_dir / name
            notes = []
            analyze_memory.plot_timeline(run_dir, path, notes, alignment_notes=False)
            written.append(path)
            row["notes"] += [f"timeline: {n}" for n in notes if n not in row["notes"]]
        except (analyze_memory.LogError, OSError) as e:  # the reason is often a note already
            why = str(e).replace(str(out_dir), str(shown_dir))
            row["notes"].append("no timeline drawn" + ("" if why in row["notes"] else f": {why}"))
    return written


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="collect_results.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="DIR",
                        help="a study directory (launch/run_benchmarks.py --study-dir; one "
                             "study, not a folder of them such as runs/) or run directories "
                             "(launch/job.sh)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where results.csv, results.md and the plots go (default: the one "
                             "directory given, else the current directory); created if needed")
    parser.add_argument("--plot", action="store_true",
                        help="also write the PNG plots (matplotlib, headless)")
    parser.add_argument("--tensorboard", action="store_true",
                        help="also add each run's GPU memory and utilisation and CPU memory to "
                             "its RUN_DIR/tensorboard, beside the training's curves "
                             "(analyze_memory.py --tensorboard), so that tensorboard --logdir "
                             "STUDY shows them per run")
    parser.add_argument("--dpi", type=int, default=100,
                        help="resolution of the PNG plots, 50 to 600 (default: %(default)s)")
    parser.add_argument("--inter-node-busbw", type=float, default=scaling.INTER_NODE_BUSBW_GBS,
                        metavar="GBS",
                        help="the scaling model's bus bandwidth between nodes, GB/s, where no "
                             "multi-node run measured it (--profile); default: one 100 Gb/s "
                             "link per node")
    parser.add_argument("--ring-latency-us", type=float,
                        default=scaling.RING_STEP_LATENCY_US, metavar="US",
                        help="the scaling model's latency of one ring step, microseconds "
                             "(default: %(default)g)")
    return parser


def publish(staging: Path, out: Path, stale: str | None = None) -> None:
    """Move the files written in staging (a folder inside out) into out, replacing an earlier
    collection's, and remove the earlier files matching ``stale`` that this one did not write
    again (the timeline of a run no longer in the study). A folder in the way of one of them
    stops it before any file moves, so that out never holds a results.csv of this collection
    beside a results.md of the last."""
    names = sorted(p.name for p in staging.iterdir())
    taken = next((out / n for n in names if (out / n).is_dir()), None)
    if taken is not None:
        raise UsageError(f"cannot write {taken}: a folder of that name is in the way; move it "
                         f"away, or pass another --out DIR")
    for name in names:  # renames within one file system: each replaces its file at once
        os.replace(staging / name, out / name)
    for old in sorted(out.glob(stale)) if stale else []:
        if old.name not in names and old.is_file():
            old.unlink()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    analyze_memory.printable_stdout()
    out = Path(args.out or (args.paths[0] if len(args.paths) == 1 else "."))
    try:
        if not 50 <= args.dpi <= 600:  # 600 dpi makes a 4200 x 2700 plot, more than print needs
            raise UsageError(f"--dpi {args.dpi} is out of range: use 50 to 600 (default 100)")
        if args.out == "":
            raise UsageError("--out '' names no folder: give one, or leave --out out")
        # a network's figures: from 1 MB/s to well above NVLink's bus bandwidth, and a latency
        # of at most a second (inf or nan would make every prediction meaningless)
        if not (0.001 <= args.inter_node_busbw <= 10_000 and 0 <= args.ring_latency_us <= 1e6):
            raise UsageError(f"--inter-node-busbw {args.inter_node_busbw:g} and "
                             f"--ring-latency-us {args.ring_latency_us:g}: the bandwidth must "
                             f"be 0.001 to 10000 GB/s and the latency 0 to 1000000 us")
        if args.plot and (why := plots.missing_matplotlib()):
            raise UsageError(why)
        if args.tensorboard and (why := analyze_memory.missing_tensorboard()):
            raise UsageError(why)
        rows = read_inputs(args.paths)
        stragglers.flag(rows)  # runs held back by one slow rank
        # every run unreadable: results.md would hold no number, so there is nothing to write
        if rows and all(r["status"] == UNREADABLE for r in rows):
            raise UsageError(rows[0]["detail"] if len(rows) == 1 else
                             f"none of the {len(rows)} runs can be read; the first: "
                             f"{rows[0]['detail']}")
        if rows and all(r["status"] in (MISSING, SKIPPED) for r in rows):  # a plan, no run
            first = next((r for r in rows if r["status"] == MISSING), rows[0])
            raise UsageError(f"nothing to collect yet: none of the study's {len(rows)} runs "
                             f"has a run directory; {first['run']}: {first['detail']}")
        chosen = scaling.scale(rows)
        scaling.step_times(rows)
        models = scaling.predict(rows, chosen, args.inter_node_busbw, args.ring_latency_us)
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a file: name a folder for results.csv, results.md "
                             f"and the plots")
        try:
            out.mkdir(parents=True, exist_ok=True)
            boards, unwritten = write_boards(rows) if args.tensorboard else ([], [])
            # Everything is written into a folder inside out first, and moved into place only
            # when all of it is written: a failed write leaves the last collection's files.
            staging = Path(tempfile.mkdtemp(prefix=".collect_results-", dir=out))
            try:
                pngs = report.write_plots(chosen, staging, args.dpi) if args.plot else []
                timelines = write_timelines(rows, staging, out) if args.plot else []
                write_csv(rows, staging / "results.csv")
                report.write_markdown(rows, chosen, models, args.paths, staging / "results.md",
                                      pngs)
                publish(staging, out, "timeline-*.png" if args.plot else None)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
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
    earlier = [out / name for name in plots.PLOTS if not args.plot and (out / name).is_file()]
    if earlier:  # results.md no longer links them, and they show the earlier collection
        print(f"note: {earlier[0]} and the other plots of an earlier --plot are not in "
              f"results.md now, and show that collection's runs: add --plot to draw them again")
    if timelines:
        print(f"timelines (memory and utilisation over time, one per run): "
              f"{out / 'timeline-<run>.png'}, {len(timelines)} of them")
    if boards:
        top = Path(args.paths[0]) if len(args.paths) == 1 else Path(".")
        print(f"TensorBoard: memory and utilisation scalars added to {len(boards)} run(s)' "
              f"tensorboard/ folders; view them with the training's curves: tensorboard "
              f"--logdir {top}")
    if unwritten:
        print(f"warning: --tensorboard could not write {len(unwritten)} run(s)' scalars:",
              file=sys.stderr)
        for why in unwritten:
            print(f"  {why}", file=sys.stderr)
    return 1 if unwritten else 0


if __name__ == "__main__":
    sys.exit(main())
