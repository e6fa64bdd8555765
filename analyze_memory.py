"""Summarise the GPU and CPU memory logs that a training job wrote, one line per node and GPU.

The Slurm launchers start two background loggers on every node, one file per node:

    nvidia-smi --query-gpu=timestamp,index,name,memory.used,memory.total \\
        --format=csv,nounits -l 5 > "$RUN_DIR/gpu_memory/$(hostname -s).csv" &
    psrecord "$TRAIN_PID" --include-children --interval 5 \\
        --log "$RUN_DIR/cpu_memory/$(hostname -s).txt" &

Copy-paste usage:

    python analyze_memory.py runs/myjob-123/                # a run directory, walked recursively
    python analyze_memory.py gpu_memory_log.csv             # one log file
    python analyze_memory.py runs/myjob-123/gpu_memory/n1.csv runs/myjob-123/gpu_memory/n2.csv
    python analyze_memory.py --json runs/myjob-123/ > memory.json
    python analyze_memory.py --csv  runs/myjob-123/ > memory.csv

Output: GPU lines first, then CPU lines. The label is the file stem (gpu_memory/n1.csv -> n1):

    [gpu_memory_log - GPU 0] Peak = 26532 MiB, Avg = 22458.63 MiB, Mode = 26532 MiB
    [n1 - CPU] Peak RSS = 2411.00 MB, Avg RSS = 1344.64 MB, Peak CPU = 398.2%, Avg CPU = 183.6%

Statistics of one GPU: all its memory.used samples in that file (MiB, as nvidia-smi writes them).
    Peak = the largest sample.
    Avg  = the arithmetic mean of all samples, printed with 2 decimals.
    Mode = the most frequent sample; on a tie, the larger value.
Statistics of one psrecord log (training process plus its children, summed by psrecord):
    Peak / Avg RSS = max / mean of "Real (MB)" (csv: mem_real), 2 decimals. psrecord's MB is
                     bytes / 1024**2 (MiB-sized); the unit is kept as psrecord writes it.
    Peak / Avg CPU = max / mean of "CPU (%)" (csv: cpu), 1 decimal; 100% = one core busy.

Input: files and directories, in any mix. A file's kind is recognised by its header line (the
nvidia-smi --format=csv header with a memory.used column; psrecord's "# Elapsed time ..." plain
header or its --log-format csv header), not by its extension. Directories are walked recursively in
sorted order; files without a recognised header are ignored there (Slurm .out files, checkpoints),
except inside gpu_memory/ or cpu_memory/: those folders hold only logs, so an empty, zero-filled
or unrecognised file there is reported. Repeated header lines and blank lines are expected and
ignored. Lines that are not a complete sample are skipped and counted in a note on stderr: values
such as [N/A] or [Not Supported], a last line without its newline (the logger was killed
mid-write), text cut off by NUL bytes, and malformed lines. Values with units ("26532 MiB",
logged without nounits) are read as well.

Damaged files: a node that crashes while logging often leaves its log ending in zeros (NUL bytes:
the file's size reached the disk, its last data did not). The lines before them are summarised
and a note on stderr says how many bytes were unreadable, e.g.
    note: runs/myjob-123/gpu_memory/n2.csv: ignored 4096 unreadable bytes (NUL) at the end of the
    file (the node probably crashed while logging)
(one line). NUL bytes inside a file (a logger restarted after a crash) and bytes that are not
UTF-8 text are ignored and noted the same way; a file with no text at all is an error.

Exit status: 0 every input was summarised; 1 some were summarised but at least one path or file
was bad (each named on stderr in one line); 2 nothing could be summarised, or a bad command line.

Python API (collect_results.py imports it; importing has no side effects):
    gpu_stats, cpu_stats, problems = summarize_paths(["runs/myjob-123"])
gpu_stats and cpu_stats are lists of dicts with exactly GPU_KEYS / CPU_KEYS; problems is a list of
one-sentence messages, one per bad path or file. summarize_paths(paths, notes) also appends the
notes (skipped lines, unreadable bytes) to the list notes.
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

# --------------------------------------------------------------------------------------------
# Output contract: collect_results.py imports these, so writer and reader cannot drift.
# --------------------------------------------------------------------------------------------

#: Keys of one GPU record (one per node and GPU), in output order.
GPU_KEYS = ("node", "gpu", "name", "samples", "peak_mib", "avg_mib", "mode_mib", "total_mib",
            "skipped_lines", "file")
#: Keys of one CPU record (one per psrecord log), in output order.
CPU_KEYS = ("node", "samples", "duration_s", "peak_rss_mb", "avg_rss_mb", "peak_cpu_pct",
            "avg_cpu_pct", "max_nproc", "skipped_lines", "file")
#: Columns of --csv output: "kind" ("gpu" or "cpu"), then the union of both key lists.
CSV_KEYS = ("kind",) + GPU_KEYS + tuple(k for k in CPU_KEYS if k not in GPU_KEYS)

GPU_LINE = ("[{node} - GPU {gpu}] Peak = {peak_mib} MiB, Avg = {avg_mib:.2f} MiB, "
            "Mode = {mode_mib} MiB")
CPU_LINE = ("[{node} - CPU] Peak RSS = {peak_rss_mb:.2f} MB, Avg RSS = {avg_rss_mb:.2f} MB, "
            "Peak CPU = {peak_cpu_pct:.1f}%, Avg CPU = {avg_cpu_pct:.1f}%")
#: Regexes that read the two text lines back (e.g. from a job's .out file).
GPU_LINE_RE = re.compile(r"\[(?P<node>.+) - GPU (?P<gpu>\d+)\] Peak = (?P<peak_mib>\d+) MiB, "
                         r"Avg = (?P<avg_mib>\d+\.\d{2}) MiB, Mode = (?P<mode_mib>\d+) MiB")
CPU_LINE_RE = re.compile(r"\[(?P<node>.+) - CPU\] Peak RSS = (?P<peak_rss_mb>\d+\.\d{2}) MB, "
                         r"Avg RSS = (?P<avg_rss_mb>\d+\.\d{2}) MB, "
                         r"Peak CPU = (?P<peak_cpu_pct>\d+\.\d)%, "
                         r"Avg CPU = (?P<avg_cpu_pct>\d+\.\d)%")

KIND_GPU = "gpu"
KIND_CPU = "cpu"

# Why a line was skipped (the keys of the per-file skip counter).
SKIP_UNAVAILABLE = "[N/A]-like value"
SKIP_INCOMPLETE = "incomplete last line"
SKIP_MALFORMED = "malformed"

# Unreadable bytes (the keys of the per-file damage counter; the values count bytes).
BAD_NUL_END = "unreadable bytes (NUL) at the end of the file"
BAD_NUL_INSIDE = "unreadable bytes (NUL) inside the file"
BAD_UTF8 = "undecodable bytes (not UTF-8 text)"

_SNIFF_BYTES = 8192     # enough for the header plus a few samples
_SNIFF_LIMIT = 1 << 20  # how far sniff looks past zeros at the start of a file
_SNIFF_LINES = 10       # the header must be among the first non-blank lines
_LOG_DIRS = ("gpu_memory", "cpu_memory")
# nvidia-smi property names: "memory.used", "ecc.errors.corrected.volatile.l1_cache [...]"
_GPU_COLUMN_RE = re.compile(r"[A-Za-z][\w.]*(?: \[[^\]]*\])?")
_MIB_RE = re.compile(r"(\d+)(?:\s*MiB)?")
_NUL_RUN_RE = re.compile(rb"\0+")
# What decode(errors="surrogateescape") makes of a byte that is not UTF-8: one such character each.
_UNDECODABLE_RE = re.compile("[\udc80-\udcff]")
# What psrecord prints when its log goes to stdout and that stdout is redirected to the file.
_PSRECORD_CHATTER_RE = re.compile(r"(Attaching to process|Starting up command|Process finished)")
# Column labels of psrecord's plain header (1.4 writes the first four; later versions more).
_PSRECORD_PLAIN_LABELS = ("Elapsed time", "CPU (%)", "Real (MB)", "Virtual (MB)", "Swap (MB)",
                          "USS (MB)", "Read count", "Write count", "Read bytes", "Write bytes",
                          "Dir size (MB)")


class LogError(Exception):
    """A log file that cannot be summarised; the message is one sentence naming the file."""


# --------------------------------------------------------------------------------------------
# Recognising a file by its content
# --------------------------------------------------------------------------------------------

def _gpu_header_columns(line: str) -> list | None:
    """Column names of an nvidia-smi --format=csv header line, or None if it is not one.

    Every field must look like a property name, so that a sample line glued to a header (a
    killed logger restarted with >>) is not taken for a header."""
    fields = [f.strip() for f in line.split(",")]
    if not all(_GPU_COLUMN_RE.fullmatch(f) for f in fields):
        return None
    names = [f.split("[")[0].strip() for f in fields]
    return names if "memory.used" in names else None


def _psrecord_header(line: str) -> str | None:
    """"plain" or "csv" if the line is a psrecord --log header, else None."""
    s = line.strip()
    if s.startswith("#") and "Elapsed time" in s and "Real (MB)" in s:
        return "plain"
    fields = [f.strip() for f in s.split(",")]
    if fields[0] == "elapsed_time" and "cpu" in fields and "mem_real" in fields:
        return "csv"
    return None


def _line_kind(line: str) -> str | None:
    if _gpu_header_columns(line) is not None:
        return KIND_GPU
    if _psrecord_header(line) is not None:
        return KIND_CPU
    return None


def sniff(path) -> tuple:
    """(kind, empty): kind is KIND_GPU, KIND_CPU or None, from the first lines of the file;
    empty is True for a file holding no text: nothing, or only whitespace and NUL bytes (within
    its first _SNIFF_LIMIT bytes). Raises OSError if unreadable.

    NUL bytes are read as line breaks: a crash leaves runs of them where data was lost, and a
    logger restarted after it writes its header after them. A binary file (a checkpoint, an
    image) has no header line, so its kind is None."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
        while head and not head.strip(b"\0") and f.tell() < _SNIFF_LIMIT:
            head = f.read(_SNIFF_BYTES)     # only zeros so far: look at the next block
    text = _NUL_RUN_RE.sub(b"\n", head).decode("utf-8", errors="replace")
    if not text.strip():
        return None, True
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for line in lines[:_SNIFF_LINES]:
        kind = _line_kind(line)
        if kind is not None:
            return kind, False
    return None, False


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------

def _read_lines(path, skips: Counter, bad: Counter) -> list:
    """The file's complete lines. Both loggers end every sample with a newline, so text without
    one was cut off: a last line without its newline (the logger was killed mid-write) and the
    text just before a run of NUL bytes (a crash) are dropped and counted in skips.

    Unreadable bytes are counted in bad, by kind: NUL bytes (at the end of the file or inside
    it) are dropped; bytes that are not UTF-8 are read as U+FFFD, so that a number they spoil
    makes its line malformed. Reading never raises UnicodeDecodeError."""
    with open(path, "rb") as f:
        data = f.read()
    text_end = len(data.rstrip(b"\0"))
    n_inside = data.count(b"\0", 0, text_end)
    if len(data) > text_end:
        bad[BAD_NUL_END] += len(data) - text_end
    if n_inside:
        bad[BAD_NUL_INSIDE] += n_inside
    lines = []
    # The text between runs of NUL bytes. What follows a run is kept: it comes from a logger
    # restarted after the crash, or from the rest of a line whose start was lost (then the line
    # is malformed, or at most its first field, a time, is cut short).
    for chunk in _NUL_RUN_RE.split(data):
        text, n_undecodable = _UNDECODABLE_RE.subn(
            "\ufffd", chunk.decode("utf-8", errors="surrogateescape"))
        if n_undecodable:
            bad[BAD_UTF8] += n_undecodable
        chunk_lines = text.split("\n")
        last = chunk_lines.pop()            # "" when the chunk ends with a newline
        if last.strip():
            skips[SKIP_INCOMPLETE] += 1
        lines.extend(chunk_lines)
    return lines


def _unavailable(value: str) -> bool:
    """nvidia-smi writes [N/A], [Not Supported], [Unknown Error], [GPU is lost], ..."""
    return value.startswith("[") and value.endswith("]")


def _mib(value: str) -> int:
    m = _MIB_RE.fullmatch(value)
    if m is None:
        raise ValueError(value)
    return int(m.group(1))


def _finite(value: str) -> float:
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(value)
    return x


def _round(x: float, digits: int) -> float:
    """Round exactly as the text line prints, so the JSON/CSV numbers equal the printed ones."""
    return float(f"{x:.{digits}f}")


def _mode(counts: Counter) -> int:
    """Most frequent value; a tie goes to the larger value."""
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]


def _skip_text(skips: Counter) -> str:
    return ", ".join(f"{why}: {n}" for why, n in sorted(skips.items()))


def _bad_bytes_note(path, bad: Counter) -> str:
    """One sentence on a file's unreadable bytes, e.g. "n2.csv: ignored 4096 unreadable bytes
    (NUL) at the end of the file (the node probably crashed while logging)"."""
    what = " and ".join(f"{bad[kind]} {kind}" for kind in (BAD_NUL_END, BAD_NUL_INSIDE, BAD_UTF8)
                        if bad[kind])
    why = ("the node probably crashed while logging" if bad[BAD_NUL_END] or bad[BAD_NUL_INSIDE]
           else "the file is damaged or not all text")
    return f"{path}: ignored {what} ({why})"


def parse_gpu_log(path, bad: Counter | None = None) -> tuple:
    """(records, skips) for an nvidia-smi --format=csv log: one GPU_KEYS dict per GPU index,
    sorted by index, and a Counter of skipped lines by reason. Unreadable bytes are counted in
    bad if given (see _read_lines). Raises LogError."""
    skips = Counter()
    lines = _read_lines(path, skips, Counter() if bad is None else bad)
    cols = None                 # column name -> position, from the latest header line
    gpus = {}                   # index -> running statistics
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        names = _gpu_header_columns(line)
        if names is not None:
            if "index" not in names:
                raise LogError(f"{path}: the nvidia-smi header has no 'index' column, so GPUs "
                               f"cannot be told apart; log with --query-gpu=timestamp,index,"
                               f"name,memory.used,memory.total")
            cols = {name: i for i, name in enumerate(names)}
            continue
        fields = [f.strip() for f in line.split(",")]
        if cols is None or len(fields) != len(cols):
            skips[SKIP_MALFORMED] += 1
            continue
        index, used = fields[cols["index"]], fields[cols["memory.used"]]
        if _unavailable(index) or _unavailable(used):
            skips[SKIP_UNAVAILABLE] += 1
            continue
        try:
            gpu, used_mib = int(index), _mib(used)
        except ValueError:
            skips[SKIP_MALFORMED] += 1
            continue
        g = gpus.setdefault(gpu, {"counts": Counter(), "sum": 0, "name": None, "total": None})
        g["counts"][used_mib] += 1
        g["sum"] += used_mib
        if g["name"] is None and "name" in cols:
            g["name"] = fields[cols["name"]] or None
        if "memory.total" in cols:
            try:
                total = _mib(fields[cols["memory.total"]])
                g["total"] = total if g["total"] is None else max(g["total"], total)
            except ValueError:
                pass    # an unavailable total does not spoil the memory.used sample
    if not gpus:
        raise LogError(f"{path}: nvidia-smi log with no usable samples"
                       f"{' (skipped ' + _skip_text(skips) + ')' if skips else ''}; the logger "
                       f"probably stopped right after it started, check that it ran during "
                       f"training")
    records = []
    for gpu in sorted(gpus):
        g = gpus[gpu]
        n = sum(g["counts"].values())
        records.append({
            "node": Path(path).stem, "gpu": gpu, "name": g["name"], "samples": n,
            "peak_mib": max(g["counts"]), "avg_mib": _round(g["sum"] / n, 2),
            "mode_mib": _mode(g["counts"]), "total_mib": g["total"],
            "skipped_lines": sum(skips.values()), "file": str(path),
        })
    return records, skips


def parse_cpu_log(path, bad: Counter | None = None) -> tuple:
    """(record, skips) for a psrecord --log file (plain or --log-format csv): one CPU_KEYS dict
    and a Counter of skipped lines by reason. Unreadable bytes are counted in bad if given (see
    _read_lines). Raises LogError."""
    skips = Counter()
    lines = _read_lines(path, skips, Counter() if bad is None else bad)
    fmt, cols, min_fields = None, None, 0
    elapsed, cpu, rss, nproc = [], [], [], []
    for raw in lines:
        line = raw.strip()
        if not line or _PSRECORD_CHATTER_RE.match(line):
            continue
        header = _psrecord_header(line)
        if header == "plain":
            fmt = "plain"
            min_fields = max(4, sum(label in line for label in _PSRECORD_PLAIN_LABELS))
            continue
        if header == "csv":
            fmt = "csv"
            cols = {name.strip(): i for i, name in enumerate(line.split(","))}
            continue
        try:
            if fmt == "plain":
                fields = line.split()
                if len(fields) < min_fields:
                    raise ValueError(line)
                t, c, r, p = _finite(fields[0]), _finite(fields[1]), _finite(fields[2]), None
            elif fmt == "csv":
                fields = [f.strip() for f in line.split(",")]
                if len(fields) != len(cols):
                    raise ValueError(line)
                t = _finite(fields[cols["elapsed_time"]])
                c = _finite(fields[cols["cpu"]])
                r = _finite(fields[cols["mem_real"]])
                p = int(fields[cols["nproc"]]) if "nproc" in cols else None
            else:
                raise ValueError(line)      # data before any header
        except ValueError:
            skips[SKIP_MALFORMED] += 1
            continue
        elapsed.append(t)
        cpu.append(c)
        rss.append(r)
        if p is not None:
            nproc.append(p)
    if not rss:
        raise LogError(f"{path}: psrecord log with no usable samples"
                       f"{' (skipped ' + _skip_text(skips) + ')' if skips else ''}; the "
                       f"training process probably exited before the first sample, check that "
                       f"psrecord was given the right PID")
    n = len(rss)
    record = {
        "node": Path(path).stem, "samples": n, "duration_s": _round(max(elapsed), 1),
        "peak_rss_mb": _round(max(rss), 2), "avg_rss_mb": _round(math.fsum(rss) / n, 2),
        "peak_cpu_pct": _round(max(cpu), 1), "avg_cpu_pct": _round(math.fsum(cpu) / n, 1),
        "max_nproc": max(nproc) if nproc else None,
        "skipped_lines": sum(skips.values()), "file": str(path),
    }
    return record, skips


# --------------------------------------------------------------------------------------------
# Files and directories
# --------------------------------------------------------------------------------------------

def summarize_file(path, bad: Counter | None = None) -> tuple:
    """(kind, records, skips) for one log file, kind from its content; unreadable bytes are
    counted in bad if given. Raises LogError with a one-sentence message for an unreadable,
    empty, zero-filled, unrecognised or sample-less file."""
    try:
        kind, empty = sniff(path)
        if empty and _has_nul(path):    # what a crash leaves when no line reached the disk
            where = " in its first MiB" if os.path.getsize(path) > _SNIFF_LIMIT else ""
            raise LogError(f"{path}: no text, only zero bytes (NUL){where}; the node probably "
                           f"crashed before the logger's first lines reached the disk, check the "
                           f"job's stderr and the node's state")
        if empty:
            raise LogError(f"{path}: the file is empty; the logger probably failed to start or "
                           f"was killed at once, check the job's stderr")
        if kind is None:
            where = ("these folders should hold only the loggers' files"
                     if Path(path).parent.name in _LOG_DIRS else
                     "pass the files in the run's gpu_memory/ or cpu_memory/ folder")
            raise LogError(f"{path}: not an nvidia-smi --format=csv log or a psrecord log (no "
                           f"recognised header in its first lines); {where}")
        if kind == KIND_GPU:
            records, skips = parse_gpu_log(path, bad)
        else:
            record, skips = parse_cpu_log(path, bad)
            records = [record]
    except OSError as e:
        raise LogError(f"{path}: cannot be read ({e.strerror or e}); check that it exists and "
                       f"that you have read permission") from e
    return kind, records, skips


def _has_nul(path) -> bool:
    """True if the first _SNIFF_BYTES of the file hold a NUL byte."""
    with open(path, "rb") as f:
        return b"\0" in f.read(_SNIFF_BYTES)


def _walk(top: Path, problems: list):
    """Regular files under top, recursively, in sorted order; hidden entries are skipped."""
    def onerror(e):
        problems.append(f"{e.filename}: cannot list this directory ({e.strerror}); check its "
                        f"permissions")
    for dirpath, dirnames, filenames in os.walk(top, onerror=onerror):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if not name.startswith(".") and path.is_file():
                yield path


def summarize_paths(paths, notes: list | None = None) -> tuple:
    """(gpu_stats, cpu_stats, problems) for files and directories, in the given order.

    gpu_stats: dicts with GPU_KEYS, one per file and GPU index; cpu_stats: dicts with CPU_KEYS,
    one per psrecord log; problems: one sentence per bad path or file (missing, unreadable,
    empty or zero-filled, unrecognised when named explicitly or inside gpu_memory/ or cpu_memory/,
    no usable samples, a directory without logs). Never raises for bad input. If notes is a
    list, a sentence per file with unreadable bytes and per file with skipped lines is appended
    to it."""
    gpu_stats, cpu_stats, problems = [], [], []
    seen = set()

    def add(path: Path, explicit: bool) -> bool:
        """Summarise one file; True if it was a recognised log (good or bad)."""
        key = path.resolve()
        if key in seen:
            return True
        seen.add(key)
        bad = Counter()         # unreadable bytes of this file, by kind
        try:
            # Outside the log folders, a file without a recognised header is not a log (Slurm
            # output, a checkpoint, ...); inside them, every file is a log, so it is reported.
            if not explicit and path.parent.name not in _LOG_DIRS and sniff(path)[0] is None:
                return False
            kind, records, skips = summarize_file(path, bad)
        except OSError as e:
            problems.append(f"{path}: cannot be read ({e.strerror or e}); check that you have "
                            f"read permission")
            return True
        except LogError as e:
            problems.append(str(e))
            return True
        finally:
            if bad and notes is not None:   # also when the file failed: say why it looks bad
                notes.append(_bad_bytes_note(path, bad))
        (gpu_stats if kind == KIND_GPU else cpu_stats).extend(records)
        if skips and notes is not None:
            notes.append(f"{path}: skipped {sum(skips.values())} line(s) ({_skip_text(skips)}); "
                         f"the statistics use the remaining samples")
        return True

    for p in paths:
        path = Path(p)
        if path.is_dir():
            n_problems = len(problems)
            found = [add(f, explicit=False) for f in _walk(path, problems)]
            if not any(found) and len(problems) == n_problems:
                problems.append(f"{path}: no nvidia-smi or psrecord logs found in this directory "
                                f"(searched recursively); pass the run directory that holds "
                                f"gpu_memory/ or cpu_memory/, or the log files themselves")
        elif path.is_file():
            add(path, explicit=True)
        elif path.exists() or path.is_symlink():
            problems.append(f"{path}: not a regular file or directory (or a broken link); pass a "
                            f"log file or a run directory")
        else:
            problems.append(f"{path}: no such file or directory; check the path (the logs are "
                            f"usually in runs/<job>/gpu_memory/ and runs/<job>/cpu_memory/)")
    return gpu_stats, cpu_stats, problems


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def format_gpu_line(record: dict) -> str:
    return GPU_LINE.format(**record)


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
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    notes = []
    gpu_stats, cpu_stats, problems = summarize_paths(args.paths, notes)

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
        for r in gpu_stats:
            print(format_gpu_line(r))
        for r in cpu_stats:
            print(format_cpu_line(r))
    sys.stdout.flush()      # results before the notes when both go to one terminal

    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if not problems:
        return 0
    return 1 if gpu_stats or cpu_stats else 2


if __name__ == "__main__":
    sys.exit(main())
