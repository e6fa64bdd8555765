"""Summarise the memory logs of a training job: one line per node and GPU, one per node's CPU.

launch/node.sh starts two loggers on every node (a requeued job's later attempts write
<node>.restart1.csv, <node>.restart2.csv, ... beside the first):

    q=timestamp,index,name,memory.used,memory.total,utilization.gpu,power.draw,clocks.sm
    nvidia-smi --query-gpu=$q --format=csv,nounits -l 5 > "$RUN_DIR/gpu_memory/<node>.csv" &
    psrecord "$TRAIN_PID" --include-children --interval 5 --log "$RUN_DIR/cpu_memory/<node>.txt" &

Copy-paste usage:

    python analyze_memory.py runs/myjob-123/                # a run directory, walked recursively
    python analyze_memory.py gpu_memory_log.csv             # one log file
    python analyze_memory.py --json runs/myjob-123/ > memory.json     # or --csv
    python analyze_memory.py --plot runs/myjob-123/         # also draws runs/myjob-123/timeline.png

Output: GPU lines, then CPU lines, labelled by node (the file name without extension and
.restart<N>); a node's attempts are folded together, and a note on stderr says how many. Logs
of several runs (a study directory): each run's lines under a line "== <run directory> ==".

    [gpu_memory_log - GPU 0] Peak = 26532 MiB, Avg = 22458.63 MiB, Mode = 26532 MiB
    [n1 - GPU 0] Peak = 26532 MiB, Avg = 20206.67 MiB, Mode = 26532 MiB, Util avg = 87.3%
    [n1 - CPU] Peak RSS = 2411.00 MB, Avg RSS = 1344.64 MB, Peak CPU = 398.2%, Avg CPU = 183.6%

Statistics of one GPU, over all its memory.used samples (MiB) in every attempt:
    Peak = the largest sample; Avg = the mean, 2 decimals;
    Mode = the most frequent sample; on a tie, the larger value;
    Util avg = the mean of the readable utilization.gpu samples, 1 decimal, only in logs that
    have the column (older logs have only the first five: their line ends at Mode).
Statistics of one node's psrecord samples (training process plus children): Peak / Avg RSS =
max / mean of "Real (MB)" (bytes / 1024**2, psrecord's unit), 2 decimals; Peak / Avg CPU =
max / mean of "CPU (%)", 1 decimal (100% = one core busy).

Input: log files and directories. In a directory, every file in a gpu_memory/ or cpu_memory/
folder is a log: an empty, zero-filled or unrecognised one is an error, never dropped. A file's
kind comes from its header line, not its extension. Lines that are not a complete sample
([N/A]-like values, a last line cut off without its newline, malformed lines) are skipped and
counted in a note on stderr. A crash often leaves a log ending in zeros (NUL bytes: its size
reached the disk, its last data did not); the lines before them are summarised with a note:
    note: runs/myjob-123/gpu_memory/n2.csv: ignored 4096 unreadable bytes (NUL) at the end of the
    file (the node probably crashed while logging)
NUL bytes inside a file and bytes that are not UTF-8 text are ignored and noted the same way.

Timeline (--plot): one PNG per run directory, RUN_DIR/timeline.png, with a panel per node
(restarts folded in): GPU memory used and GPU utilisation per GPU, the node's CPU memory (RSS),
epoch starts (dashed lines) and evaluations (grey spans) from the [METRIC] lines of the run's
train.log. The x-axis is seconds since the run's first sample. nvidia-smi writes the node's local
time, read here in this machine's time zone (set TZ=... if the cluster's differs). psrecord logs
only seconds since its start: it starts with the node's nvidia-smi (node.sh), so each attempt is
aligned to the first sample of the same attempt's GPU log; without one (a CPU run), its start is
the file's last change minus its last sample's elapsed time (a note says so). Requeued attempts
are separate line segments.

Exit status: 0 every input was summarised; 1 some were summarised but at least one path or file
was bad (each named on stderr in one line); 2 nothing could be summarised, a bad command line, or
a module of the repository missing beside this file. A reader that leaves early (| head) changes
nothing: the notes and errors still go to stderr, with the same exit status.

Python API (collect_results.py imports it; importing has no side effects):
    gpu_stats, cpu_stats, problems = summarize_paths(["runs/myjob-123"], notes=None)
    figure = plot_timeline("runs/myjob-123", "timeline.png")    # needs matplotlib
gpu_stats / cpu_stats: dicts with exactly GPU_KEYS / CPU_KEYS, one per node (and GPU).
problems: dicts {"kind", "path", "message"}; kind NO_LOGS = a directory without any log,
BAD_INPUT = a path or file that could not be summarised. notes (a list) gets the notes.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
from collections import Counter
from pathlib import Path

try:  # the repository's modules beside this file: a copy of this file alone says what to add
    import contract
    import plots
    import timeline
except ModuleNotFoundError as missing:
    if __name__ != "__main__":
        raise
    print(f"error: {Path(__file__).name} needs {missing.name}.py beside it: copy contract.py, "
          f"plots.py and timeline.py from the repository too, or run the repository's copy",
          file=sys.stderr)
    sys.exit(2)

# ---- Output contract: collect_results.py imports it, so writer and reader cannot drift

#: Keys of one GPU record (one per node and GPU), in output order. attempts: how many log files
#: (first attempt and restarts) the statistics cover; file: those files, joined by ";".
#: avg_util_pct: mean utilization.gpu (%), None for a log without that column (older node.sh).
GPU_KEYS = ("node", "gpu", "name", "samples", "attempts", "peak_mib", "avg_mib", "mode_mib",
            "total_mib", "avg_util_pct", "skipped_lines", "file")
#: Keys of one CPU record (one per node), in output order.
CPU_KEYS = ("node", "samples", "attempts", "duration_s", "peak_rss_mb", "avg_rss_mb",
            "peak_cpu_pct", "avg_cpu_pct", "skipped_lines", "file")
#: Columns of --csv output: "kind" ("gpu" or "cpu"), then the union of both key lists.
CSV_KEYS = ("kind",) + GPU_KEYS + tuple(k for k in CPU_KEYS if k not in GPU_KEYS)

GPU_LINE = ("[{node} - GPU {gpu}] Peak = {peak_mib} MiB, Avg = {avg_mib:.2f} MiB, "
            "Mode = {mode_mib} MiB")
GPU_UTIL_PART = ", Util avg = {avg_util_pct:.1f}%"    # appended when avg_util_pct is not None
CPU_LINE = ("[{node} - CPU] Peak RSS = {peak_rss_mb:.2f} MB, Avg RSS = {avg_rss_mb:.2f} MB, "
            "Peak CPU = {peak_cpu_pct:.1f}%, Avg CPU = {avg_cpu_pct:.1f}%")

KIND_GPU = "gpu"
KIND_CPU = "cpu"

# The kind of a problem (problems[i]["kind"]): callers branch on these, never on the message.
NO_LOGS = "no_logs"        # a directory without any memory log (e.g. the loggers never ran)
BAD_INPUT = "bad_input"    # a path or file that cannot be read or summarised

# Why a line was skipped (the keys of the per-file skip counter).
SKIP_UNAVAILABLE = "[N/A]-like value"
SKIP_INCOMPLETE = "incomplete last line"
SKIP_MALFORMED = "malformed"

# Unreadable bytes (the keys of the per-file damage count; the values count bytes).
BAD_NUL_END = "unreadable bytes (NUL) at the end of the file"
BAD_NUL_INSIDE = "unreadable bytes (NUL) inside the file"
BAD_UTF8 = "undecodable bytes (not UTF-8 text)"

# The header nvidia-smi writes for node.sh's --query-gpu with --format=csv,nounits: these five
# columns first; node.sh's newer logs add GPU_EXTRA_COLUMNS after them.
GPU_HEADER = "timestamp, index, name, memory.used [MiB], memory.total [MiB]"
GPU_COLUMNS = tuple(GPU_HEADER.split(", "))
#: Optional columns (header -> key of the per-GPU sample lists); others after the five are ignored.
GPU_EXTRA_COLUMNS = {"utilization.gpu [%]": "util", "power.draw [W]": "power_w",
                     "clocks.current.sm [MHz]": "sm_mhz"}
_LOG_DIRS = ("gpu_memory", "cpu_memory")
_RESTART_RE = re.compile(r"(?P<node>.+)\.restart(?P<attempt>\d+)")   # a file stem
_NUL_RUN_RE = re.compile(rb"\0+")
# What decode(errors="surrogateescape") makes of a byte that is not UTF-8: one such character each.
_UNDECODABLE_RE = re.compile("[\udc80-\udcff]")


class LogError(Exception):
    """A log file that cannot be summarised; the message says why in one sentence."""


# ---- Reading one log file

def _gpu_columns(line: str) -> tuple | None:
    """The column names of an nvidia-smi header line (GPU_COLUMNS, then any extra columns);
    None when the line is not one."""
    columns = tuple(f.strip() for f in line.split(","))
    return columns if columns[:len(GPU_COLUMNS)] == GPU_COLUMNS else None


def _header_kind(line: str) -> str | None:
    line = line.strip()
    if _gpu_columns(line):
        return KIND_GPU
    if line.startswith("#") and "Elapsed time" in line:     # psrecord's plain --log header
        return KIND_CPU
    return None


def read_log(path) -> tuple:
    """(kind, lines, skips, bad) of one log file, kind from its first header line. Raises
    LogError for a file without text or without a header, OSError if it cannot be read.

    Both loggers end every sample with a newline, so text without one was cut off (the logger
    was killed mid-write, or a crash left NUL bytes after it): it is dropped and counted in the
    Counter skips. bad counts unreadable bytes by kind: NUL bytes are dropped; bytes that are
    not UTF-8 become U+FFFD, so that a number they spoil makes its line malformed."""
    data = Path(path).read_bytes()
    if not data.replace(b"\0", b"").strip():
        if b"\0" in data:   # what a crash leaves when no line reached the disk
            raise LogError("no text, only zero bytes (NUL); the node probably crashed before "
                           "the logger's first lines reached the disk, check the job's stderr "
                           "and the node's state")
        raise LogError("the file is empty; the logger probably failed to start or was killed "
                       "at once, check the job's stderr")
    nul_end = len(data) - len(data.rstrip(b"\0"))
    bad = {BAD_NUL_END: nul_end, BAD_NUL_INSIDE: data.count(b"\0") - nul_end, BAD_UTF8: 0}
    skips, lines = Counter(), []
    # The text between runs of NUL bytes. What follows a run is kept: it comes from a logger
    # restarted after the crash, or from the rest of a line whose start was lost (then the line
    # is malformed, or at most its first field, a time, is cut short).
    for chunk in _NUL_RUN_RE.split(data):
        text, n_undecodable = _UNDECODABLE_RE.subn(
            "\ufffd", chunk.decode("utf-8", errors="surrogateescape"))
        bad[BAD_UTF8] += n_undecodable
        chunk_lines = text.split("\n")
        if chunk_lines.pop().strip():       # "" when the chunk ends with a newline
            skips[SKIP_INCOMPLETE] += 1
        lines.extend(chunk_lines)
    kind = next((k for k in map(_header_kind, lines) if k is not None), None)
    if kind is None:
        raise LogError("not an nvidia-smi --format=csv log or a psrecord log (no header line of "
                       "either); gpu_memory/ and cpu_memory/ should hold only the loggers' files")
    return kind, lines, skips, bad


def _skip_text(skips: Counter) -> str:
    return ", ".join(f"{why}: {n}" for why, n in sorted(skips.items()))


def parse_gpu_lines(lines, skips: Counter) -> dict:
    """{index: {"used": [MiB, ...], "name": str, "total": MiB or None, "stamp": [timestamp
    text, ...], "util": [% or None, ...], "power_w": [...], "sm_mhz": [...]}} from the lines of
    an nvidia-smi log; skipped lines are counted in skips. The lists have one entry per
    memory.used sample; an unreadable optional value (e.g. power.draw [Not Supported]) is None
    and does not skip the sample. Each header line sets the columns of the lines after it."""
    gpus, columns = {}, GPU_COLUMNS
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        header = _gpu_columns(line)
        if header:
            columns = header
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(columns):
            skips[SKIP_MALFORMED] += 1
            continue
        row = dict(zip(columns, fields))
        time, index, name, used, total = (row[c] for c in GPU_COLUMNS)
        if index.startswith("[") or used.startswith("["):   # [N/A], [Unknown Error], ...
            skips[SKIP_UNAVAILABLE] += 1
            continue
        if not (index.isdecimal() and used.isdecimal()):
            skips[SKIP_MALFORMED] += 1
            continue
        gpu = gpus.setdefault(int(index), {"used": [], "name": name, "total": None, "stamp": [],
                                           **{key: [] for key in GPU_EXTRA_COLUMNS.values()}})
        gpu["used"].append(int(used))
        gpu["stamp"].append(time)
        for column, key in GPU_EXTRA_COLUMNS.items():
            gpu[key].append(contract.number(row.get(column)))
        if total.isdecimal():     # an unavailable total does not spoil the memory.used sample
            gpu["total"] = max(gpu["total"] or 0, int(total))
    return gpus


def parse_cpu_lines(lines, skips: Counter) -> list:
    """[(elapsed s, CPU %, RSS MB), ...] from the lines of a psrecord --log file (its columns:
    elapsed time, CPU %, real MB, virtual MB); skipped lines are counted in skips."""
    samples = []
    for raw in lines:
        line = raw.strip()
        if not line or _header_kind(line) == KIND_CPU:
            continue
        fields = line.split()
        try:
            elapsed, cpu, rss, _virtual = map(float, fields)
        except ValueError:      # not four numbers
            skips[SKIP_MALFORMED] += 1
            continue
        samples.append((elapsed, cpu, rss))
    return samples


# ---- Statistics of one node: all its attempts' samples together

def _round(x: float, digits: int) -> float:
    """Round exactly as the text line prints, so the JSON/CSV numbers equal the printed ones."""
    return float(f"{x:.{digits}f}")


def _mode(counts: Counter) -> int:
    """Most frequent value; a tie goes to the larger value."""
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]


def gpu_records(node: str, logs: list) -> list:
    """One GPU_KEYS dict per GPU index of a node, from its logs (dicts with "path", "skipped"
    and "data" = parse_gpu_lines' result, one per attempt): statistics over all samples."""
    records = []
    for index in sorted({index for log in logs for index in log["data"]}):
        gpus = [log["data"][index] for log in logs if index in log["data"]]
        used = [mib for gpu in gpus for mib in gpu["used"]]
        util = [pct for gpu in gpus for pct in gpu["util"] if pct is not None]
        records.append({
            "node": node, "gpu": index, "name": gpus[0]["name"], "samples": len(used),
            "attempts": len(logs), "peak_mib": max(used),
            "avg_mib": _round(sum(used) / len(used), 2), "mode_mib": _mode(Counter(used)),
            "total_mib": max((gpu["total"] for gpu in gpus if gpu["total"]), default=None),
            "avg_util_pct": _round(math.fsum(util) / len(util), 1) if util else None,
            "skipped_lines": sum(log["skipped"] for log in logs),
            "file": ";".join(str(log["path"]) for log in logs),
        })
    return records


def cpu_record(node: str, logs: list) -> dict:
    """The CPU_KEYS dict of a node, from its logs (as for gpu_records, with parse_cpu_lines'
    results): statistics over all samples; the duration is the attempts' durations summed."""
    cpu = [sample[1] for log in logs for sample in log["data"]]
    rss = [sample[2] for log in logs for sample in log["data"]]
    return {
        "node": node, "samples": len(rss), "attempts": len(logs),
        "duration_s": _round(sum(max(s[0] for s in log["data"]) for log in logs), 1),
        "peak_rss_mb": _round(max(rss), 2), "avg_rss_mb": _round(math.fsum(rss) / len(rss), 2),
        "peak_cpu_pct": _round(max(cpu), 1), "avg_cpu_pct": _round(math.fsum(cpu) / len(cpu), 1),
        "skipped_lines": sum(log["skipped"] for log in logs),
        "file": ";".join(str(log["path"]) for log in logs),
    }


# ---- Files and directories

def _problem(kind: str, path, why: str) -> dict:
    return {"kind": kind, "path": str(path), "message": f"{path}: {why}"}


def _bad_bytes_note(path, bad: dict) -> str:
    """One sentence on a file's unreadable bytes, e.g. "n2.csv: ignored 4096 unreadable bytes
    (NUL) at the end of the file (the node probably crashed while logging)"."""
    what = " and ".join(f"{n} {kind}" for kind, n in bad.items() if n)
    why = ("the node probably crashed while logging" if bad[BAD_NUL_END] or bad[BAD_NUL_INSIDE]
           else "the file is damaged or not all text")
    return f"{path}: ignored {what} ({why})"


def _walk(top: Path, problems: list):
    """The files in gpu_memory/ and cpu_memory/ folders under top, recursively, in sorted
    order; hidden entries are skipped."""
    def onerror(e):
        problems.append(_problem(BAD_INPUT, e.filename, f"cannot list this directory "
                                                        f"({e.strerror}); check its permissions"))
    for dirpath, dirnames, filenames in os.walk(top, onerror=onerror):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        if Path(dirpath).name in _LOG_DIRS:
            for name in sorted(filenames):
                path = Path(dirpath) / name
                if not name.startswith(".") and path.is_file():
                    yield path


def _log_files(paths, problems: list):
    """The files to read, in order: each file named, and the logs in each directory named. A
    directory without logs (NO_LOGS) and a bad path (BAD_INPUT) are appended to problems."""
    for p in paths:
        path = Path(p)
        if path.is_file():
            yield path
        elif path.is_dir():
            n_problems = len(problems)
            files = list(_walk(path, problems))
            yield from files
            if not files and len(problems) == n_problems:
                problems.append(_problem(NO_LOGS, path, "no nvidia-smi or psrecord logs found "
                                         "in this directory (searched recursively for "
                                         "gpu_memory/ and cpu_memory/); pass the run directory "
                                         "that holds them, or the log files themselves"))
        else:
            problems.append(_problem(BAD_INPUT, path, "no such file or directory (or not a "
                                     "regular one); check the path (the logs are usually in "
                                     "runs/<job>/gpu_memory/ and runs/<job>/cpu_memory/)"))


def summarize_file(path, notes: list) -> tuple:
    """(kind, samples, skips) of one log file: samples as parse_gpu_lines or parse_cpu_lines
    return them; a note is appended for unreadable bytes and for skipped lines. Raises LogError
    (the file cannot be summarised) or OSError (it cannot be read)."""
    kind, lines, skips, bad = read_log(path)
    if any(bad.values()):   # also when the file fails below: say why it looks bad
        notes.append(_bad_bytes_note(path, bad))
    samples = (parse_gpu_lines if kind == KIND_GPU else parse_cpu_lines)(lines, skips)
    skipped = f"skipped {sum(skips.values())} line(s) ({_skip_text(skips)})"
    if not samples:
        raise LogError(f"no usable samples{' (' + skipped + ')' if skips else ''}; the logger "
                       f"probably stopped right after it started, check that it ran during "
                       f"training")
    if skips:
        notes.append(f"{path}: {skipped}; the statistics use the remaining samples")
    return kind, samples, skips


def summarize_paths(paths, notes: list | None = None) -> tuple:
    """(gpu_stats, cpu_stats, problems) for files and directories, in the given order.

    gpu_stats: dicts with GPU_KEYS, one per node and GPU index; cpu_stats: dicts with CPU_KEYS,
    one per node. A node's attempts (<node>.csv, <node>.restart1.csv, ... in one folder) are
    folded into one record. problems: dicts {"kind", "path", "message"}, one per directory
    without logs (kind NO_LOGS) and per bad path or file (BAD_INPUT: missing, unreadable, empty
    or zero-filled, unrecognised, no usable samples). Never raises for bad input. If notes is a
    list, the sentences of summarize_file's notes and one per node whose attempts were folded
    are appended to it."""
    notes = [] if notes is None else notes
    problems = []
    gpu_stats, cpu_stats = summarize_logs(collect_logs(paths, notes, problems), notes)
    return gpu_stats, cpu_stats, problems


def collect_logs(paths, notes: list, problems: list) -> dict:
    """Read every log file of paths (files and directories): {(kind, folder, node): [one dict
    {"path", "attempt", "skipped", "data"} per attempt, in attempt order]}, folder being the
    resolved directory of the files. Appends notes and problems as summarize_paths does, except
    the notes on folded attempts (summarize_logs adds those)."""
    seen, logs = set(), {}
    for file in _log_files(paths, problems):
        if file.resolve() in seen:
            continue
        seen.add(file.resolve())
        try:
            kind, samples, skips = summarize_file(file, notes)
        except OSError as e:
            problems.append(_problem(BAD_INPUT, file, f"cannot be read ({e.strerror or e}); "
                                     f"check that you have read permission"))
            continue
        except LogError as e:
            problems.append(_problem(BAD_INPUT, file, str(e)))
            continue
        restart = _RESTART_RE.fullmatch(file.stem)   # <node>.restart<N>: attempt N of <node>
        node = restart["node"] if restart else file.stem
        logs.setdefault((kind, file.resolve().parent, node), []).append({
            "path": file, "attempt": int(restart["attempt"]) if restart else 0,
            "skipped": sum(skips.values()), "data": samples})
    for node_logs in logs.values():
        node_logs.sort(key=lambda log: log["attempt"])
    return logs


def summarize_logs(logs: dict, notes: list) -> tuple:
    """(gpu_stats, cpu_stats) of collect_logs' result; a note per node whose attempts were
    folded together."""
    gpu_stats, cpu_stats = [], []
    for (kind, _folder, node), node_logs in logs.items():
        if len(node_logs) > 1:
            names = ", ".join(log["path"].name for log in node_logs)
            notes.append(f"{node_logs[0]['path'].parent / node}: folded {len(node_logs)} "
                         f"attempts of a requeued job ({names}) into one summary")
        if kind == KIND_GPU:
            gpu_stats.extend(gpu_records(node, node_logs))
        else:
            cpu_stats.append(cpu_record(node, node_logs))
    return gpu_stats, cpu_stats


# ---- Timeline (--plot): a run over time, one panel per node (timeline.py)

#: The file --plot writes in each run directory.
TIMELINE_NAME = "timeline.png"


def plot_timeline(run_dir, out_path=None, notes: list | None = None, logs: dict | None = None,
                  alignment_notes: bool = True):
    """The timeline of one run directory as a matplotlib Figure (timeline.draw: a panel per
    node, GPU memory and utilisation per GPU, the node's CPU RSS, the epochs marked), saved to
    out_path unless None. logs: the run's collect_logs result (read from run_dir when None).
    Notes (unreadable files, clocks; alignment_notes: how a CPU-only log was placed) are
    appended to notes. Raises LogError when run_dir has no usable log, OSError when out_path
    cannot be written."""
    notes = [] if notes is None else notes
    if logs is None:
        problems = []
        logs = collect_logs([run_dir], notes, problems)
        notes.extend(p["message"] for p in problems if logs)
        if not logs:
            raise LogError(problems[0]["message"] if problems else f"{run_dir}: no logs")
    gpu_logs = [(node, attempts) for (kind, _, node), attempts in logs.items() if kind == KIND_GPU]
    cpu_logs = [(node, attempts) for (kind, _, node), attempts in logs.items() if kind == KIND_CPU]
    return timeline.draw(run_dir, gpu_logs, cpu_logs, out_path, notes, alignment_notes)


def write_timelines(logs: dict, notes: list, problems: list) -> list:
    """Draw TIMELINE_NAME in every run directory that collect_logs' result logs comes from
    (the folder above gpu_memory/ and cpu_memory/); return the paths written. A log outside
    such a folder and a timeline that cannot be written are appended to problems."""
    runs = {}
    for key, attempts in logs.items():
        folder = key[1]
        if folder.name in _LOG_DIRS:
            run_dir = attempts[0]["path"].parent.parent     # as the user spelled it
            runs.setdefault(folder.parent, (run_dir, {}))[1][key] = attempts
        else:
            for log in attempts:
                problems.append(_problem(BAD_INPUT, log["path"], "not in a gpu_memory/ or "
                                         "cpu_memory/ folder, so no timeline; for --plot pass "
                                         "the run directory that holds those folders"))
    written = []
    for _resolved, (run_dir, run_logs) in sorted(runs.items()):
        out = run_dir / TIMELINE_NAME
        try:
            plot_timeline(run_dir, out, notes, logs=run_logs)
        except OSError as e:
            problems.append(_problem(BAD_INPUT, out, f"cannot write the timeline "
                                     f"({e.strerror or e}); make the run directory writable "
                                     f"or copy the run somewhere you can write"))
            continue
        written.append(out)
    return written


# ---- Command line

def _run_of(record: dict) -> Path:
    """The run directory of a record: the folder above gpu_memory/ or cpu_memory/, else the
    folder of its first file."""
    folder = Path(record["file"].split(";")[0]).parent
    return folder.parent if folder.name in _LOG_DIRS else folder


def format_gpu_line(record: dict) -> str:
    """GPU_LINE of a GPU record, with GPU_UTIL_PART when it has a utilisation average."""
    line = GPU_LINE.format(**record)
    if record.get("avg_util_pct") is not None:
        line += GPU_UTIL_PART.format(**record)
    return line


def format_cpu_line(record: dict) -> str:
    return CPU_LINE.format(**record)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="analyze_memory.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="nvidia-smi or psrecord log files, or run directories to search "
                             "recursively (e.g. runs/myjob-123/)")
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true",
                     help='print one JSON object {"gpu": [...], "cpu": [...], "problems": [...]} '
                          "with records keyed by GPU_KEYS / CPU_KEYS instead of text lines")
    fmt.add_argument("--csv", action="store_true",
                     help="print one CSV table with a header row: column kind (gpu or cpu), "
                          "then the GPU and CPU record keys; empty cells where not applicable")
    parser.add_argument("--plot", action="store_true",
                        help=f"also draw {TIMELINE_NAME} in each run directory (needs "
                             f"matplotlib): memory and utilisation over time, per node, with "
                             f"the epochs of train.log; prints the path of each file written")
    return parser


def print_results(args, gpu_stats: list, cpu_stats: list, problems: list,
                  timelines: list) -> None:
    """The summary on stdout: text lines, or --json, or --csv; then the timelines written."""
    if args.json:
        print(json.dumps({"gpu": gpu_stats, "cpu": cpu_stats, "problems": problems}, indent=2))
    elif args.csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=CSV_KEYS, lineterminator="\n")
        writer.writeheader()
        for kind, records in ((KIND_GPU, gpu_stats), (KIND_CPU, cpu_stats)):
            for r in records:
                writer.writerow({"kind": kind, **{k: "" if v is None else v
                                                  for k, v in r.items()}})
    else:
        lines = [(_run_of(r), format_gpu_line(r)) for r in gpu_stats]
        lines += [(_run_of(r), format_cpu_line(r)) for r in cpu_stats]
        runs = list(dict.fromkeys(run for run, _line in lines))
        for run in runs:
            if len(runs) > 1:   # a study: the same node may serve several runs
                print(f"== {run} ==")
            print("\n".join(line for line_run, line in lines if line_run == run))
    for path in timelines:      # on stderr after --json/--csv, which own stdout
        print(f"timeline: {path}", file=sys.stderr if args.json or args.csv else sys.stdout)
    sys.stdout.flush()      # results before the notes when both go to one terminal


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot and (why := plots.missing_matplotlib()):
        print(f"error: {why}", file=sys.stderr)
        return 2
    notes, problems = [], []
    logs = collect_logs(args.paths, notes, problems)
    gpu_stats, cpu_stats = summarize_logs(logs, notes)
    timelines = write_timelines(logs, notes, problems) if args.plot else []

    try:
        print_results(args, gpu_stats, cpu_stats, problems, timelines)
    except BrokenPipeError:     # the reader left early (| head): notes and errors still follow
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for problem in problems:
        print(f"error: {problem['message']}", file=sys.stderr)
    if not problems:
        return 0
    return 1 if gpu_stats or cpu_stats else 2


if __name__ == "__main__":
    sys.exit(main())
