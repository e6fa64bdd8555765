"""Summarise the memory logs of a training job: one line per node and GPU, one per node's CPU.

launch/node.sh starts two loggers on every node (a requeued job's later attempts write
<node>.restart1.csv, ... beside the first; their samples count as the node's):

    nvidia-smi --query-gpu=timestamp,index,name,memory.used,memory.total,utilization.gpu,... \\
        --format=csv,nounits -l 5 > RUN_DIR/gpu_memory/<node>.csv
    psrecord TRAIN_PID --include-children --interval 5 --log RUN_DIR/cpu_memory/<node>.txt

    python analyze_memory.py runs/myjob-123/            # a run (or study) directory, recursively
    python analyze_memory.py gpu_memory_log.csv         # one log file
    python analyze_memory.py --json runs/myjob-123/     # or --csv
    python analyze_memory.py --plot runs/myjob-123/     # also draws runs/myjob-123/timeline.png

    [n1 - GPU 0] Peak = 26532 MiB, Avg = 20206.67 MiB, Mode = 26532 MiB, Util avg = 87.3%
    [n1 - CPU] Peak RSS = 2411.00 MiB, Avg RSS = 1344.64 MiB, Peak CPU = 398.2%, Avg CPU = 183.6%

A log of another nvidia-smi query (--format=csv) is read by its header's column names, in any
order: it needs timestamp, index and memory.used; name and memory.total are read where present.

Per GPU, over its memory.used samples (MiB): Peak = the largest, Avg = the mean, Mode = the
most frequent, on a tie, the larger value; Util avg = the mean utilization.gpu when the log
has it. Per node, psrecord's RSS
("Real (MB)", which psrecord counts in MiB, so it is printed as MiB beside the GPU's) and CPU
(100% = one core) of the training process and its children. A study
gets each run's lines under "== <run directory> ==". docs/slurm.md, "Reading the memory
summary", says more, --plot's timeline included.

Lines that are not a complete sample ([N/A] values, a cut-off last line, malformed lines) or
hold an impossible one (in psrecord's a NaN, infinite or negative number; in nvidia-smi's a
negative one, more memory used than the GPU has; a NaN in its optional columns reads as
unavailable) are skipped and bytes that are not text (a crash's NUL bytes, not UTF-8)
ignored, each counted in a note on stderr. An empty, zero-filled or unrecognised log is an
error, never dropped.

Exit status: 0 every input was summarised; 1 some were, but a path or file was bad (each named
on stderr in one line); 2 nothing could be summarised, a bad command line (--plot or
--tensorboard of a log outside a run directory too, after its summary), or a module of the
repository missing beside this file.

collect_results.py imports summarize_paths (records keyed by GPU_KEYS / CPU_KEYS, and problems
of kind NO_LOGS or BAD_INPUT), plot_timeline and printable_stdout; importing has no side effects.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

try:  # the repository's modules beside this file: a copy of this file alone says what to add
    from reporting import plots, timeline
    from training import contract
except ImportError:
    needed = ("reporting/plots.py", "reporting/timeline.py", "training/contract.py")
    what = next((n for n in needed if not (Path(__file__).parent / n).is_file()), None)
    if __name__ != "__main__" or what is None:
        raise
    print(f"error: {Path(__file__).name} needs {what} beside it: copy the folders reporting/ "
          f"and training/ from the repository too, or run the repository's copy",
          file=sys.stderr)
    sys.exit(2)

# ---- What this module hands out: collect_results.py imports it, so they cannot drift

#: One GPU record (per node and GPU), in output order. attempts: how many log files (the first
#: and its restarts); file: those files, joined by ";"; avg_util_pct: None without the column.
#: busy_sm_mhz: the median SM clock of the samples in which the GPU was busy (utilisation above
#: 0, or unknown), max_temp_c: the highest temperature; each None without its column. A GPU
#: that holds the others back by throttling shows a lower clock and, often, a higher
#: temperature than its neighbours.
GPU_KEYS = ("node", "gpu", "name", "samples", "attempts", "peak_mib", "avg_mib", "mode_mib",
            "total_mib", "avg_util_pct", "busy_sm_mhz", "max_temp_c", "skipped_lines", "file")
#: One CPU record (per node), in output order.
CPU_KEYS = ("node", "samples", "attempts", "duration_s", "peak_rss_mib", "avg_rss_mib",
            "peak_cpu_pct", "avg_cpu_pct", "skipped_lines", "file")
#: Columns of --csv: "kind" ("gpu" or "cpu"), then the union of both key lists.
CSV_KEYS = ("kind",) + GPU_KEYS + tuple(k for k in CPU_KEYS if k not in GPU_KEYS)

GPU_LINE = ("[{node} - GPU {gpu}] Peak = {peak_mib} MiB, Avg = {avg_mib:.2f} MiB, "
            "Mode = {mode_mib} MiB")
# Each part is added to GPU_LINE when its value is not None.
GPU_LINE_PARTS = {"avg_util_pct": ", Util avg = {avg_util_pct:.1f}%",
                  "busy_sm_mhz": ", SM clock (busy) = {busy_sm_mhz:.0f} MHz",
                  "max_temp_c": ", Temp max = {max_temp_c:.0f} C"}
CPU_LINE = ("[{node} - CPU] Peak RSS = {peak_rss_mib:.2f} MiB, Avg RSS = {avg_rss_mib:.2f} MiB, "
            "Peak CPU = {peak_cpu_pct:.1f}%, Avg CPU = {avg_cpu_pct:.1f}%")

KIND_GPU, KIND_CPU = "gpu", "cpu"
# The kind of a problem (problems[i]["kind"]): callers branch on these, never on the message.
NO_LOGS = "no_logs"        # a directory without any memory log (e.g. the loggers never ran)
BAD_INPUT = "bad_input"    # a path or file that cannot be read or summarised
BAD_USAGE = "bad_usage"    # a flag its inputs cannot serve: --plot of a log outside a run

# Why a line was skipped (the keys of a file's skip Counter).
SKIP_UNAVAILABLE = "[N/A]-like value"
SKIP_INCOMPLETE = "incomplete last line"
SKIP_MALFORMED = "malformed"
# More memory used than the GPU has, utilization above 100%, a NaN, infinite or negative number
SKIP_IMPOSSIBLE = "impossible value"
# Bytes that are not text (the keys of a file's count of them, in the order a note names them).
BAD_NUL_END = "unreadable bytes (NUL) at the end of the file"
BAD_NUL_INSIDE = "unreadable bytes (NUL) inside the file"
BAD_UTF8 = "undecodable bytes (not UTF-8 text)"

# The five columns nvidia-smi writes first for node.sh's query (--format=csv,nounits); newer
# logs add the columns below after them (header -> key of the per-GPU lists); others are ignored.
# Without nounits the header is the same but each value ends with its column's unit ("100 MiB").
# A log of another query is read by its header's names, in any order: it needs GPU_NEEDED.
GPU_COLUMNS = ("timestamp", "index", "name", "memory.used [MiB]", "memory.total [MiB]")
GPU_NEEDED = ("timestamp", "index", "memory.used [MiB]")
GPU_QUERY = ("nvidia-smi --query-gpu=timestamp,index,name,memory.used,memory.total "
             "--format=csv,nounits -l 5")
# psrecord --log-format csv's header (--include-io adds four columns after it); its plain
# header starts "# Elapsed time" (four columns, --include-io: eight)
CPU_CSV_HEADER = "elapsed_time,nproc,cpu,mem_real,mem_virtual"
GPU_EXTRA_COLUMNS = {"utilization.gpu [%]": "util", "power.draw [W]": "power_w",
                     "clocks.current.sm [MHz]": "sm_mhz", "temperature.gpu": "temp_c"}
LOG_DIRS = ("gpu_memory", "cpu_memory")
TIMELINE_NAME = "timeline.png"      # what --plot writes in each run directory
_UNIT_RE = re.compile(r"\[(?P<unit>[^\]]+)\]$")      # a column's unit: "memory.used [MiB]"
_RESTART_RE = re.compile(r"(?P<node>.+)\.restart(?P<attempt>\d+)")   # a file's stem
# The name of a log node.sh writes in a log folder: <host>.csv, <host>.txt, and after a restart
# <host>.restart<N>.csv or .txt; a host name has no space. A copy ("n1 (copy).csv", "n1 copy.csv")
# or a backup ("n1.csv~", "n1.csv.bak") in the folder is not one: read, it would count as a node
# of its own, or as n1 twice.
_NODE_LOG_RE = re.compile(r"\S+\.(csv|txt)")
_NUL_RUN_RE = re.compile(rb"\0+")
_UNDECODABLE_RE = re.compile("[\udc80-\udcff]")     # decode(errors="surrogateescape")'s marks


class LogError(Exception):
    """A log file that cannot be summarised; the message says why in one sentence."""


# ---- Reading one log file

def _gpu_columns(line: str) -> tuple | None:
    """The column names of an nvidia-smi header line with the columns GPU_NEEDED, in any order;
    None when the line is not one."""
    columns = tuple(f.strip() for f in line.split(","))
    return columns if all(c in columns for c in GPU_NEEDED) else None


def _gpu_header_without(lines) -> str | None:
    """For a log of an nvidia-smi query without GPU_NEEDED's columns: the sentence naming what
    is missing (None when no line is such a header)."""
    for line in lines:
        columns = [f.strip() for f in line.split(",")]
        if "timestamp" in columns or any(c.startswith("memory.used") for c in columns):
            missing = [c.split(" [")[0] for c in GPU_NEEDED if c not in columns]
            other = next((c for c in columns if c.startswith("memory.used [")), None)
            if "memory.used" in missing and other:
                return (f"its {other} is not in MiB, the unit nvidia-smi writes and this "
                        f"tool reads: log as launch/node.sh does, {GPU_QUERY}")
            return (f"an nvidia-smi --format=csv log without the column(s) {', '.join(missing)} "
                    f"(its header: {line.strip()[:120]}): log as launch/node.sh does, "
                    f"{GPU_QUERY} (the columns in any order, and more may follow)")
    return None


def _unit_suffixes(columns: tuple) -> tuple:
    """What each column's values end with in a log written without nounits: " MiB" for
    "memory.used [MiB]", "" for a column without a unit."""
    return tuple(f" {unit['unit']}" if (unit := _UNIT_RE.search(c)) else "" for c in columns)


def _header_kind(line: str) -> str | None:
    line = line.strip()
    if _gpu_columns(line):
        return KIND_GPU
    if (line.startswith("#") and "Elapsed time" in line) or line.startswith(CPU_CSV_HEADER):
        return KIND_CPU     # psrecord's --log header, plain or --log-format csv
    return None


def _a_cut_header(text: str) -> bool:
    """Whether ``text``, a file's only line and one without its newline, is the start of
    either logger's header line."""
    return any(header.startswith(text) or text.startswith(header)
               for header in (", ".join(GPU_COLUMNS), "# Elapsed time", CPU_CSV_HEADER))


def read_log(path) -> tuple:
    """(kind, lines, skips, bad) of one log file. Raises LogError for a file without text or
    without a header, OSError if it cannot be read.

    Both loggers end a sample with a newline, so text without one was cut off (the logger was
    killed mid-write, or a crash left NUL bytes after it): it is counted in skips and dropped.
    bad: how many bytes of each BAD_* kind (NUL bytes are dropped; bytes that are not UTF-8
    become U+FFFD, so that a number they spoil makes its line malformed)."""
    # a UTF-8 byte order mark (a log saved again by an editor on Windows) is not text: before
    # the header, it hid the header and the whole file was refused
    data = Path(path).read_bytes().removeprefix(b"\xef\xbb\xbf")
    if not data.replace(b"\0", b"").strip():
        if b"\0" in data:   # what a crash leaves when no line reached the disk
            raise LogError("no text, only zero bytes (NUL); the node probably crashed before "
                           "the logger's first lines reached the disk, check the job's stderr "
                           "and the node's state")
        raise LogError("the file is empty; the logger probably failed to start or was killed "
                       "at once, check the job's stderr")
    nul_end = len(data) - len(data.rstrip(b"\0"))
    bad = Counter({BAD_NUL_END: nul_end, BAD_NUL_INSIDE: data.count(b"\0") - nul_end})
    skips, lines, cut = Counter(), [], []
    # The text between runs of NUL bytes is kept: it comes from a logger restarted after the
    # crash, or is the rest of a line whose start was lost (then malformed, or its time cut).
    for chunk in _NUL_RUN_RE.split(data):
        text, n = _UNDECODABLE_RE.subn("\ufffd", chunk.decode("utf-8", "surrogateescape"))
        bad[BAD_UTF8] += n
        chunk_lines = text.split("\n")
        if (last := chunk_lines.pop()).strip():       # "" when the chunk ends with a newline
            skips[SKIP_INCOMPLETE] += 1
            cut.append(last.strip())
        lines.extend(chunk_lines)
    kind = next((k for k in map(_header_kind, lines) if k is not None), None)
    if kind is None and cut and not any(line.strip() for line in lines) and _a_cut_header(cut[0]):
        raise LogError("cut off inside its header line, before any sample: the logger was "
                       "stopped as it started (the job ended or was cancelled at once), check "
                       "the job's stderr")
    if kind is None:
        first = next((line.strip() for line in lines if line.strip()), "")
        if len(first.split(",")) == len(GPU_COLUMNS) and first.split(",")[1].strip().isdecimal():
            raise LogError("nvidia-smi lines without their header line (written with "
                           "--format=csv,noheader?): log with the header, as launch/node.sh "
                           f"does: {GPU_QUERY}")
        raise LogError(_gpu_header_without(lines) or
                       "not an nvidia-smi --format=csv log or a psrecord log (no header line of "
                       "either); gpu_memory/ and cpu_memory/ should hold only the loggers' files")
    return kind, lines, skips, bad


# No node or GPU has a pebibyte of memory (in MiB; psrecord's MB are MiB too), nor a million
# cores' worth of CPU time, nor has a job run for a million hours: a larger figure is a damaged
# line, and a huge one would overflow the averages
MAX_MEMORY, MAX_CPU_PCT, MAX_ELAPSED_S = 2**30, 1e8, 3.6e9


def parse_gpu_lines(lines, skips: Counter, unread: dict | None = None) -> dict:
    """{index: {"used": [MiB], "name", "total": MiB or None, "stamp": [timestamp text],
    "util": [% or None], "power_w": [...], "sm_mhz": [...], "temp_c": [...]}} of an nvidia-smi
    log, one list entry per memory.used sample (an unreadable optional value is None and keeps
    the sample). unread, if a dict, gets {index: (name, Counter of memory.used texts, whether
    a memory.total was a number)} of each GPU with a line whose memory.used is no number
    ([N/A], [GPU requires reset]).
    Each header line sets the columns of the lines after it; a value may end with its column's
    unit (a log written with --format=csv alone, without nounits)."""
    gpus, columns = {}, GPU_COLUMNS
    units = _unit_suffixes(columns)
    for line in map(str.strip, lines):
        if not line:
            continue
        if header := _gpu_columns(line):
            columns, units = header, _unit_suffixes(header)
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(columns):
            skips[SKIP_MALFORMED] += 1
            continue
        row = {c: field.removesuffix(unit) for c, field, unit in zip(columns, fields, units)}
        time, index, name, used, total = (row.get(c, "") for c in GPU_COLUMNS)
        if index.startswith("[") or used.startswith("["):   # [N/A], [Unknown Error], ...
            skips[SKIP_UNAVAILABLE] += 1
            if unread is not None and index.isdecimal():
                name_, texts, has_total = unread.get(int(index), (name, Counter(), False))
                texts[used] += 1
                unread[int(index)] = (name_, texts, has_total or total.isdecimal())
            continue
        if not (index.isdecimal() and used.isdecimal()):
            skips[SKIP_MALFORMED] += 1
            continue
        extra = {key: contract.number(row.get(column))
                 for column, key in GPU_EXTRA_COLUMNS.items()}
        # contract.number reads "nan" and "inf" as unavailable (None); a negative clock, power or
        # temperature is no more possible than a negative utilization
        if ((total.isdecimal() and int(used) > int(total)) or (extra["util"] or 0) > 100
                or int(used) > MAX_MEMORY or (total.isdecimal() and int(total) > MAX_MEMORY)
                or any(value is not None and value < 0 for value in extra.values())):
            skips[SKIP_IMPOSSIBLE] += 1  # a damaged line that still parses is not a sample
            continue
        gpu = gpus.setdefault(int(index), {"used": [], "name": name, "total": None, "stamp": [],
                                           **{key: [] for key in GPU_EXTRA_COLUMNS.values()}})
        gpu["used"].append(int(used))
        gpu["stamp"].append(time)
        for key, value in extra.items():
            gpu[key].append(value)
        if total.isdecimal():     # an unavailable total does not spoil the memory.used sample
            gpu["total"] = max(gpu["total"] or 0, int(total))
    return gpus


def parse_cpu_lines(lines, skips: Counter) -> list:
    """[(elapsed s, CPU %, RSS MiB)] of a psrecord --log file (elapsed, CPU %, real, virtual; its
    header says MB, but psrecord divides bytes by 1024**2); with --include-io four I/O counts
    follow, which are not read. --log-format csv: elapsed, processes, CPU %, real, virtual."""
    samples, csv = [], False    # each header sets the layout of the lines after it
    for line in map(str.strip, lines):
        if not line:
            continue
        if _header_kind(line) == KIND_CPU:
            csv = line.startswith(CPU_CSV_HEADER)
            continue
        fields = line.split(",") if csv else line.split()
        try:
            if len(fields) not in ((5, 9) if csv else (4, 8)):
                raise ValueError
            if csv:
                del fields[1]   # the process count
            elapsed, cpu, rss, virtual = map(float, fields[:4])
        except ValueError:      # not four numbers (or eight, with the I/O counts; csv: one more)
            skips[SKIP_MALFORMED] += 1
            continue
        # float() also reads "nan", "inf" and 1e400 (as inf): such a value, a negative one or
        # an impossible memory, comes from a damaged line and would spoil every statistic and
        # the --json output
        if not (all(math.isfinite(v) and v >= 0 for v in (elapsed, cpu, rss, virtual))
                and max(rss, virtual) <= MAX_MEMORY and cpu <= MAX_CPU_PCT
                and elapsed <= MAX_ELAPSED_S):
            skips[SKIP_IMPOSSIBLE] += 1
            continue
        samples.append((elapsed, cpu, rss))
    return samples


def summarize_file(path, notes: list) -> tuple:
    """(kind, samples, skips) of one log file, samples as parse_gpu_lines or parse_cpu_lines
    return them; notes get its unreadable bytes and skipped lines. Raises LogError or OSError."""
    kind, lines, skips, bad = read_log(path)
    if any(bad.values()):   # say why the file looks bad, also when reading it fails below
        why = ("the node probably crashed while logging" if bad[BAD_NUL_END] or
               bad[BAD_NUL_INSIDE] else "the file is damaged or not all text")
        notes.append(f"{path}: ignored {' and '.join(f'{n} {k}' for k, n in bad.items() if n)} "
                     f"({why})")
    unread = {}
    samples = (parse_gpu_lines(lines, skips, unread) if kind == KIND_GPU
               else parse_cpu_lines(lines, skips))
    # a GPU whose every line lacks its memory would vanish from the summary without a word
    silent = [_never_reported(i, *unread[i]) for i in sorted(unread) if i not in samples]
    skipped = (f"skipped {sum(skips.values())} line(s) "
               f"({', '.join(f'{why}: {n}' for why, n in sorted(skips.items()))})")
    if not samples and skips and set(skips) <= {SKIP_MALFORMED, SKIP_IMPOSSIBLE}:
        raise LogError(f"no usable samples ({skipped}): the log holds lines, but not ones its "
                       f"logger writes; check that the file is that logger's own, whole")
    if not samples and silent:
        raise LogError(f"no usable samples: {'; '.join(silent)}")
    if not samples:
        raise LogError(f"no usable samples{' (' + skipped + ')' if skips else ''}; the logger "
                       f"probably stopped right after it started, check that it ran during "
                       f"training")
    notes.extend(f"{path}: {why}; it is left out of the summary" for why in silent)
    if skips:
        notes.append(f"{path}: {skipped}; the statistics use the remaining samples")
    return kind, samples, skips


def _never_reported(index: int, name: str, values: Counter, has_total: bool) -> str:
    """Why a GPU of an nvidia-smi log has no sample: what the log holds for its memory (a GPU
    whose memory is the CPU's reports no total either)."""
    value = values.most_common(1)[0][0]
    why = ("nvidia-smi gives [N/A] for memory.used on this GPU (its memory is the CPU's: a "
           "unified-memory GPU, such as GB10 or Jetson)" if value == "[N/A]" and not has_total
           else f"nvidia-smi wrote {value} in its place; check the GPU on its node "
           "(nvidia-smi -q)")
    return f"GPU {index} ({name}) never reported its memory: {why}"


# ---- Files and directories: every log, grouped by node

def _name(path) -> str:
    """The name of the file or folder path names, also when it is spelled "." or ".."
    (Path(".").name is "")."""
    return os.path.basename(os.path.abspath(path))


def _up(path, levels: int = 1) -> Path:
    """The folder levels above path, spelled from path as the user gave it: ".." for "n1.csv"
    (Path("n1.csv").parent is ".", which is the log folder itself, not its run directory)."""
    return Path(os.path.normpath(os.path.join(path, *[os.pardir] * levels)))


def _problem(kind: str, path, why: str) -> dict:
    return {"kind": kind, "path": str(path), "message": f"{path}: {why}"}


def _log_files(paths, problems: list, notes: list = None):
    """Each file named, and the node logs in gpu_memory/ and cpu_memory/ folders under each
    directory named (recursively, sorted, hidden entries skipped). A directory without logs
    (NO_LOGS) and a bad path (BAD_INPUT) are appended to problems; a file in a log folder not
    named as a node's log (_NODE_LOG_RE) is left out, with a note where notes is given."""
    def unlistable(e):
        problems.append(_problem(BAD_INPUT, e.filename, f"cannot list this directory "
                                                        f"({e.strerror}); check its permissions"))
    for p in map(Path, paths):
        if p.is_file():
            yield p
            continue
        if not p.is_dir():
            problems.append(_problem(BAD_INPUT, p, "no such file or directory (or not a "
                                     "regular one); check the path (the logs are usually in "
                                     "runs/<job>/gpu_memory/ and runs/<job>/cpu_memory/)"))
            continue
        n_problems, found = len(problems), []
        for folder, dirs, files in os.walk(p, onerror=unlistable):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            if _name(folder) in LOG_DIRS:
                for name in sorted(f for f in files if not f.startswith(".")):
                    if _NODE_LOG_RE.fullmatch(name):
                        found.append(Path(folder) / name)
                    elif notes is not None:
                        notes.append(f"{Path(folder) / name}: left out, as a node's log is "
                                     f"named <host>.csv or <host>.txt, and a copy (a name with "
                                     f"a space) or a backup (.csv~, .bak) is not one; move it "
                                     f"out of the folder, or rename it if it is a node's log")
        found = [path for path in found if path.is_file()]
        yield from found    # only after the whole walk, so its errors come before the files'
        if not found and len(problems) == n_problems:
            problems.append(_problem(NO_LOGS, p, "no nvidia-smi or psrecord logs found in this "
                                     "directory (searched recursively for gpu_memory/ and "
                                     "cpu_memory/); pass the run directory that holds them, "
                                     "or the log files themselves"))


def collect_logs(paths, notes: list, problems: list) -> dict:
    """Every log of paths (files and directories), read: {(kind, folder, node): [{"path",
    "attempt", "skipped", "data"} per attempt, in attempt order]}, folder being the file's
    resolved directory. Bad files go to problems, never raise."""
    seen, logs = set(), {}
    for file in _log_files(paths, problems, notes):
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


# ---- Statistics of one node: all its attempts' samples together

def _round(x: float, digits: int) -> float:
    """Round as the text line prints, so that the JSON/CSV numbers equal the printed ones."""
    return float(f"{x:.{digits}f}")


def _mode(counts: Counter) -> int:
    """Most frequent value; a tie goes to the larger value."""
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]


def gpu_records(node: str, logs: list) -> list:
    """One GPU_KEYS dict per GPU index of a node, over all its attempts (collect_logs' dicts)."""
    records = []
    for index in sorted({index for log in logs for index in log["data"]}):
        gpus = [log["data"][index] for log in logs if index in log["data"]]
        used = [mib for gpu in gpus for mib in gpu["used"]]
        util = [pct for gpu in gpus for pct in gpu["util"] if pct is not None]
        busy_clock = [mhz for gpu in gpus for mhz, pct in zip(gpu["sm_mhz"], gpu["util"])
                      if mhz is not None and pct != 0]
        temps = [c for gpu in gpus for c in gpu["temp_c"] if c is not None]
        records.append({
            "node": node, "gpu": index, "name": gpus[0]["name"], "samples": len(used),
            "attempts": len(logs), "peak_mib": max(used),
            "avg_mib": _round(sum(used) / len(used), 2), "mode_mib": _mode(Counter(used)),
            "total_mib": max((gpu["total"] for gpu in gpus if gpu["total"]), default=None),
            "avg_util_pct": _round(math.fsum(util) / len(util), 1) if util else None,
            "busy_sm_mhz": statistics.median(busy_clock) if busy_clock else None,
            "max_temp_c": max(temps, default=None),
            "skipped_lines": sum(log["skipped"] for log in logs),
            "file": ";".join(str(log["path"]) for log in logs),
        })
    return records


def cpu_record(node: str, logs: list) -> dict:
    """The CPU_KEYS dict of a node, over all its attempts; the duration sums theirs."""
    cpu = [sample[1] for log in logs for sample in log["data"]]
    rss = [sample[2] for log in logs for sample in log["data"]]
    return {
        "node": node, "samples": len(rss), "attempts": len(logs),
        "duration_s": _round(sum(max(s[0] for s in log["data"]) for log in logs), 1),
        "peak_rss_mib": _round(max(rss), 2), "avg_rss_mib": _round(math.fsum(rss) / len(rss), 2),
        "peak_cpu_pct": _round(max(cpu), 1), "avg_cpu_pct": _round(math.fsum(cpu) / len(cpu), 1),
        "skipped_lines": sum(log["skipped"] for log in logs),
        "file": ";".join(str(log["path"]) for log in logs),
    }


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


def summarize_paths(paths, notes: list | None = None) -> tuple:
    """(gpu_stats, cpu_stats, problems) of files and directories: GPU_KEYS dicts per node and
    GPU, CPU_KEYS dicts per node, and {"kind", "path", "message"} dicts (kind NO_LOGS or
    BAD_INPUT). Never raises for bad input; notes, if a list, gets the notes."""
    notes = [] if notes is None else notes
    problems = []
    gpu_stats, cpu_stats = summarize_logs(collect_logs(paths, notes, problems), notes)
    return gpu_stats, cpu_stats, problems


# ---- Timeline (--plot): timeline.py draws a run's logs over time

def plot_timeline(run_dir, out_path=None, notes: list | None = None, logs: dict | None = None,
                  alignment_notes: bool = True):
    """The timeline of one run directory as a matplotlib Figure, saved to out_path unless None.
    logs: the run's collect_logs result (read from run_dir when None). notes gets what the
    drawing notes (alignment_notes: also how a CPU-only log was placed). Raises LogError when
    run_dir has no usable log or no sample with a time, OSError when out_path cannot be
    written."""
    notes = [] if notes is None else notes
    if logs is None:
        problems = []
        logs = collect_logs([run_dir], notes, problems)
        if not logs:
            raise LogError(problems[0]["message"] if problems else f"{run_dir}: no logs")
        notes.extend(p["message"] for p in problems)
    by_kind = {kind: [(node, attempts) for (k, _, node), attempts in logs.items() if k == kind]
               for kind in (KIND_GPU, KIND_CPU)}
    try:
        return timeline.draw(run_dir, by_kind[KIND_GPU], by_kind[KIND_CPU], out_path, notes,
                             alignment_notes)
    except timeline.NothingToDraw as e:
        raise LogError(str(e)) from None


def _runs(logs: dict, problems: list, what: str, flag: str) -> list:
    """(run_dir as the user spelled it, its logs) of each run directory (the folder above
    gpu_memory/ and cpu_memory/) of collect_logs' result; a log outside such a folder goes to
    problems (what: the output it gets none of, by flag)."""
    runs = {}
    for key, attempts in logs.items():
        if key[1].name in LOG_DIRS:
            run_dir = _up(attempts[0]["path"], 2)     # as the user spelled it
            runs.setdefault(key[1].parent, (run_dir, {}))[1][key] = attempts
            continue
        for log in attempts:
            problems.append(_problem(BAD_USAGE, log["path"], f"not in a gpu_memory/ or "
                                     f"cpu_memory/ folder, so no {what}; for {flag} pass the "
                                     f"run directory that holds those folders"))
    return [runs[key] for key in sorted(runs)]


def write_timelines(logs: dict, notes: list, problems: list) -> list:
    """Draw TIMELINE_NAME in each run directory of collect_logs' result, of all the run's logs
    even where only some were named; return the paths written. A log outside a run directory
    and a timeline that cannot be drawn (no sample with a time) or written go to problems."""
    written = []
    # the files read, and those that could not be (named in problems): every file named
    named = {Path(p["path"]).resolve() for p in problems}
    for run_dir, run_logs in _runs(logs, problems, "timeline", "--plot"):
        named |= {log["path"].resolve() for attempts in run_logs.values() for log in attempts}
        if any(f.resolve() not in named for f in _log_files([run_dir], [])):
            # Some of the run's logs were named: its timeline.png is still the whole run's
            # (drawn from one GPU's log, it replaced the run's timeline of every node).
            notes.append(f"{run_dir / TIMELINE_NAME} shows all of the run's logs, not only "
                         f"those named")
            run_logs = None  # read again from run_dir, by plot_timeline
        drawn = []  # the drawing's notes (and those of logs read again, less any said)
        try:
            plot_timeline(run_dir, run_dir / TIMELINE_NAME, drawn, logs=run_logs)
            written.append(run_dir / TIMELINE_NAME)
        except LogError as e:
            problems.append(_problem(BAD_INPUT, run_dir, f"no timeline drawn: {e}"))
        except OSError as e:
            fix = (f"it is a folder: move it away (mv {run_dir / TIMELINE_NAME} ...)"
                   if (run_dir / TIMELINE_NAME).is_dir() else "make the run directory "
                   "writable or copy the run somewhere you can write")
            problems.append(_problem(BAD_INPUT, run_dir / TIMELINE_NAME, f"cannot write the "
                                     f"timeline ({e.strerror or e}); {fix}"))
        said = notes + [p["message"] for p in problems]
        notes.extend(note for note in drawn if note not in said)
    return written


def write_boards(logs: dict, notes: list, problems: list) -> list:
    """--tensorboard: each run directory's memory and utilisation samples as TensorBoard
    scalars in RUN_DIR/tensorboard (timeline.write_board); return the folders written."""
    written = []
    for run_dir, run_logs in _runs(logs, problems, "TensorBoard scalars", "--tensorboard"):
        by_kind = {kind: [(node, a) for (k, _, node), a in run_logs.items() if k == kind]
                   for kind in (KIND_GPU, KIND_CPU)}
        try:
            written.append(timeline.write_board(run_dir, by_kind[KIND_GPU], by_kind[KIND_CPU],
                                                notes))
        except OSError as e:
            problems.append(_problem(BAD_INPUT, run_dir / "tensorboard", f"cannot write "
                                     f"({e.strerror or e}); make the run directory writable"))
    return written


# ---- Command line

def format_gpu_line(record: dict) -> str:
    return GPU_LINE.format(**record) + "".join(
        part.format(**record) for key, part in GPU_LINE_PARTS.items()
        if record.get(key) is not None)


def format_cpu_line(record: dict) -> str:
    return CPU_LINE.format(**record)


def _run_of(record: dict) -> Path:
    """The run directory of a record: the folder above gpu_memory/ or cpu_memory/, else the
    folder of its first file."""
    folder = _up(record["file"].split(";")[0])
    return _up(folder) if _name(folder) in LOG_DIRS else folder


def missing_tensorboard() -> str | None:
    """What --tensorboard says before any work when the package is missing; None when it is
    there."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return ("--tensorboard needs the tensorboard package: pip install tensorboard "
                "(requirements.txt has it), or drop --tensorboard")
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="analyze_memory.py", description=__doc__,
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
                        help=f"also draw {TIMELINE_NAME} in each run directory, of all its "
                             f"logs even where only some are named (needs "
                             f"matplotlib): memory and utilisation over time, per node, with "
                             f"the epochs of train.log (nvidia-smi logs the node's local time: "
                             f"set TZ=... if this machine's differs); prints each file written")
    parser.add_argument("--tensorboard", action="store_true",
                        help="also write each run directory's GPU memory and utilisation and "
                             "CPU memory as TensorBoard scalars into RUN_DIR/tensorboard, "
                             "beside the training's curves (--tensorboard of the training "
                             "scripts), at the samples' clock times: choose TensorBoard's Wall "
                             "axis to line them up with the loss (needs tensorboard)")
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
            writer.writerows({"kind": kind, **{k: "" if v is None else v for k, v in r.items()}}
                             for r in records)
    else:
        lines = [(_run_of(r), format_gpu_line(r)) for r in gpu_stats]
        lines += [(_run_of(r), format_cpu_line(r)) for r in cpu_stats]
        runs = list(dict.fromkeys(run for run, _line in lines))
        for run in runs:
            if len(runs) > 1:   # in a study the same node may serve several runs
                print(f"== {run} ==")
            print("\n".join(line for line_run, line in lines if line_run == run))
    for path in timelines:      # on stderr after --json/--csv, which own stdout
        what = "tensorboard" if path.name == "tensorboard" else "timeline"
        print(f"{what}: {path}", file=sys.stderr if args.json or args.csv else sys.stdout)
    sys.stdout.flush()      # results before the notes when both go to one terminal


def printable_stdout() -> None:
    """Print a file or folder name that is not UTF-8 (Python holds its bytes as surrogate
    escapes) with backslash escapes where stdout would refuse it (PYTHONIOENCODING=utf-8:strict,
    a pipe under some locales): a UnicodeEncodeError ended the summary there."""
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    printable_stdout()
    if args.plot and (why := plots.missing_matplotlib()):
        print(f"error: {why}", file=sys.stderr)
        return 2
    if args.tensorboard and (why := missing_tensorboard()):
        print(f"error: {why}", file=sys.stderr)
        return 2
    notes, problems = [], []
    logs = collect_logs(args.paths, notes, problems)
    gpu_stats, cpu_stats = summarize_logs(logs, notes)
    timelines = write_timelines(logs, notes, problems) if args.plot else []
    timelines += write_boards(logs, notes, problems) if args.tensorboard else []
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
    if any(p["kind"] == BAD_USAGE for p in problems):  # a bad command line exits 2, as argparse
        return 2
    return 1 if gpu_stats or cpu_stats else 2


if __name__ == "__main__":
    sys.exit(main())
