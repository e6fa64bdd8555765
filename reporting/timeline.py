"""A run over time: the memory logs' samples and the epochs of train.log on one clock, per node.

analyze_memory.py --plot (RUN_DIR/timeline.png) and collect_results.py --plot (timeline-<run>.png)
draw it; analyze_memory.py's --help says what the picture shows and how the clocks are aligned.
analyze_memory.collect_logs reads the logs, node_timelines turns their samples into clock times,
read_phases finds the epochs and evaluations, and plots.timeline_figure draws them.
"""

from __future__ import annotations

import errno
import math
import os
from datetime import datetime
from pathlib import Path

from training import contract
from reporting import plots, stragglers
from training.contract import METRIC_PREFIX

_STAMP_FORMATS = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S")
STAMP_EXAMPLE = "2026/11/24 06:30:01.123"   # how nvidia-smi writes a timestamp


class NothingToDraw(Exception):
    """A run without a sample that has a time; the message says why in one sentence."""


def stamp_to_unix(stamp: str) -> float | None:
    """Seconds since 1970 of an nvidia-smi timestamp such as "2026/11/24 06:30:01.123" (the
    node's local time, read in this machine's time zone: set TZ if they differ); None when the
    text is not such a timestamp."""
    for fmt in _STAMP_FORMATS:
        try:
            return datetime.strptime(stamp, fmt).timestamp()
        except ValueError:
            pass
    return None


def find_training_logs(run_dir, notes: list) -> list:
    """The files of run_dir with the training's output: train.log (launch/job.sh tees the
    training's stdout and stderr into it), else every other file directly in run_dir (e.g. a
    copied Slurm .out file) that has a [METRIC] line."""
    run_dir = Path(run_dir)
    if (run_dir / "train.log").is_file():
        return [run_dir / "train.log"]
    found = []
    try:
        for path in sorted(run_dir.iterdir()):
            if (path.is_file() and not path.name.startswith(".")
                    and METRIC_PREFIX.encode() in path.read_bytes()):
                found.append(path)
    except OSError as e:
        notes.append(f"{run_dir}: cannot look for the training log ({e.strerror or e}); the "
                     f"timeline has no epoch marks")
    return found


def read_phases(paths, notes: list) -> list:
    """The epochs of the [METRIC] lines in the files paths: dicts {"epoch", "train_start",
    "eval_start", "eval_end"} (clock times in seconds since 1970, None where missing) and "slow"
    (the rank that held the others back, reporting/stragglers.slow_label, or None), sorted by
    train_start, each epoch once (the final line repeats the last one). Only lines readable by
    contract.read_metric_line's rules count; lines without train_start_unix (older training
    scripts) give no phase."""
    phases = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                readable = [values for _, _, values, problem in contract.metric_lines(f)
                            if problem is None]
        except OSError as e:
            notes.append(f"{path}: cannot be read ({e.strerror or e}); no epoch marks from it")
            continue
        for values in readable:
            if contract.number(values.get("train_start_unix")) is None:
                continue
            phase = {"epoch": values.get("epoch", "?"),
                     "train_start": contract.number(values["train_start_unix"]),
                     "eval_start": contract.number(values.get("eval_start_unix")),
                     "eval_end": contract.number(values.get("eval_end_unix")),
                     "slow": stragglers.slow_label(values)}  # a rank held the others back
            phases[tuple(phase.values())] = phase
    return sorted(phases.values(), key=lambda p: p["train_start"])


def gpu_series(log: dict, notes: list) -> dict:
    """{index: {"time": [s since 1970], "used": [MiB], "util": [% or nan]}} of one attempt's
    nvidia-smi log (a collect_logs dict). Samples without a readable timestamp are left out,
    and a note names the file: a silent gap would look like the logger stopped."""
    series, untimed, total = {}, [], 0
    for index, gpu in sorted(log["data"].items()):
        points = [(stamp_to_unix(stamp), used, math.nan if util is None else util)
                  for stamp, used, util in zip(gpu["stamp"], gpu["used"], gpu["util"])]
        untimed += [stamp for stamp, p in zip(gpu["stamp"], points) if p[0] is None]
        total += len(points)
        points = [p for p in points if p[0] is not None]
        series[index] = {"time": [p[0] for p in points], "used": [p[1] for p in points],
                         "util": [p[2] for p in points]}
    if untimed:
        which = f"all {total}" if len(untimed) == total else f"{len(untimed)} of {total}"
        notes.append(f"{log['path']}: {which} samples left out of the timeline: their timestamps "
                     f"do not read like nvidia-smi's {STAMP_EXAMPLE} (the first: {untimed[0]!r})")
    return series


def _cpu_start(log: dict, gpu_starts: dict, phases: list, notes: list, warnings: list
               ) -> float:
    """Clock time of psrecord's 0 s for one attempt of a node. node.sh starts psrecord with the
    node's nvidia-smi, so: the first sample of the same attempt's GPU log. Without one (a CPU
    run), the log file's last change, when psrecord wrote its last sample, minus that
    sample's elapsed time (notes says so). A copy that did not keep the file's time (scp -r,
    cp -r) put the log months away from the training log's epochs (``phases``), a lone line
    on an empty axis: then its last sample is placed at the last epoch's end, and warnings
    says so."""
    if log["attempt"] in gpu_starts:
        return gpu_starts[log["attempt"]]
    notes.append(f"{log['path']}: no GPU log to align it to; its start is the file's last "
                 f"change minus its last sample's elapsed time")
    last = max(sample[0] for sample in log["data"])
    changed = Path(log["path"]).stat().st_mtime
    start = changed - last
    if phases and not any(start - 600 <= p["train_start"] <= changed + 600 for p in phases):
        end = max(p["eval_end"] or p["train_start"] for p in phases)
        warnings.append(f"{log['path']}: the file's last change "
                        f"({datetime.fromtimestamp(changed):%Y-%m-%d %H:%M}) is far from the "
                        f"training log's epochs (copied without its file times?); its last "
                        f"sample is placed at the end of the last epoch instead (copy with cp "
                        f"-a or rsync -a to keep the times)")
        start = end - last
    return start


def node_timelines(gpu_logs: list, cpu_logs: list, notes: list,
                   alignment_notes: bool = True, phases: list = ()) -> dict:
    """{node: {"gpu": [gpu_series of each attempt], "cpu": [{"time", "rss"} of each attempt]}}
    of one run, every time in seconds since 1970 (psrecord's elapsed seconds aligned by
    _cpu_start), nodes in sorted order; a node without any sample that has a time is left out.
    gpu_logs, cpu_logs: (node, attempts) pairs, the attempts being analyze_memory.collect_logs'
    dicts of one node's nvidia-smi or psrecord logs. notes gets the samples left out and, with
    alignment_notes, how a CPU log without a GPU log was placed (``phases``, the training log's
    epochs, place it where its file's time does not fit them)."""
    nodes = {node: {"gpu": [], "cpu": [], "gpu_starts": {}, "cpu_logs": []}
             for node in sorted({node for node, _attempts in gpu_logs + cpu_logs})}
    for node, attempts in gpu_logs:
        entry = nodes[node]
        for log in attempts:
            series = gpu_series(log, notes)
            entry["gpu"].append(series)
            times = [t for s in series.values() for t in s["time"]]
            if times:
                entry["gpu_starts"][log["attempt"]] = min(times)
    for node, attempts in cpu_logs:
        nodes[node]["cpu_logs"] = attempts
    for entry in nodes.values():
        for log in entry.pop("cpu_logs"):
            if not log["data"]:
                continue
            start = _cpu_start(log, entry["gpu_starts"], phases,
                               notes if alignment_notes else [], notes)
            entry["cpu"].append({"time": [start + sample[0] for sample in log["data"]],
                                 "rss": [sample[2] for sample in log["data"]]})
        del entry["gpu_starts"]
    return {node: entry for node, entry in nodes.items()
            if entry["cpu"] or any(s["time"] for series in entry["gpu"] for s in series.values())}


def _check_clocks(nodes: dict, phases: list, run_dir, notes: list) -> None:
    """A note when no epoch lies within the GPU logs' time span: the usual cause is a time
    zone that differs between the cluster and this machine."""
    times = [t for entry in nodes.values() for series in entry["gpu"]
             for s in series.values() for t in s["time"]]
    if times and phases and not any(min(times) - 600 <= p["train_start"] <= max(times) + 600
                                    for p in phases):
        notes.append(f"{run_dir}: the epochs of the training log lie outside the GPU logs' "
                     f"time span; if this machine's time zone differs from the cluster's, rerun "
                     f"with TZ set to the cluster's (e.g. TZ=Europe/Berlin)")


def draw(run_dir, gpu_logs: list, cpu_logs: list, out_path=None, notes: list | None = None,
         alignment_notes: bool = True):
    """The timeline of one run directory as a matplotlib Figure (plots.timeline_figure), saved to
    out_path unless None; gpu_logs and cpu_logs as node_timelines takes them. Notes (unreadable
    training logs, clocks, samples without a readable timestamp, and with alignment_notes how a
    CPU log without a GPU log was placed) are appended to notes. Raises NothingToDraw when no
    sample has a time, OSError when out_path cannot be written."""
    notes = [] if notes is None else notes
    phases = read_phases(find_training_logs(run_dir, notes), notes)
    nodes = node_timelines(gpu_logs, cpu_logs, notes, alignment_notes, phases)
    if not nodes:   # only GPU logs, none with a readable timestamp
        raise NothingToDraw(f"no timestamp of its nvidia-smi logs reads like nvidia-smi's own "
                            f"({STAMP_EXAMPLE}) and it has no psrecord log; write the "
                            f"timestamps in that form to plot it")
    _check_clocks(nodes, phases, run_dir, notes)
    shown = "memory and utilisation" if any("gpu_util" in plots.node_rows(entry)
                                            for entry in nodes.values()) else "memory"
    fig = plots.timeline_figure(f"{run_dir}: {shown} over time", nodes, phases)
    if out_path is not None:
        fig.savefig(out_path, dpi=100)
    return fig


SYSTEM_SUFFIX = ".system"  # the event files of write_board, told apart from the training's


def write_board(run_dir, gpu_logs: list, cpu_logs: list, notes: list) -> Path:
    """analyze_memory.py --tensorboard: the run's GPU memory and utilisation and CPU memory,
    every node's, as TensorBoard scalars in RUN_DIR/tensorboard beside the training's curves,
    each point at its sample's clock time (TensorBoard's Wall axis puts them beside the loss;
    their step is the seconds since the run's first sample). Written again from scratch on
    every call: the files of an earlier call are replaced."""
    # TensorBoard's own writer, so no torch is needed on a login node; imported here because
    # the tensorboard package is needed only for --tensorboard
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    # the epochs place a CPU log whose file lost its time in a copy (their notes: --plot's)
    phases = read_phases(find_training_logs(run_dir, []), [])
    nodes = node_timelines(gpu_logs, cpu_logs, notes, phases=phases)
    starts = [t for entry in nodes.values() for series in entry["gpu"] for s in series.values()
              for t in s["time"][:1]] + [c["time"][0] for e in nodes.values() for c in e["cpu"]
                                        if c["time"]]
    out = Path(run_dir) / "tensorboard"
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK | os.X_OK):  # else the writer's thread fails, in a traceback
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(out))
    for old in out.glob(f"events.out.tfevents.*{SYSTEM_SUFFIX}"):
        old.unlink()
    t0 = min(starts, default=0.0)
    writer = EventFileWriter(str(out), filename_suffix=SYSTEM_SUFFIX)

    def scalar(tag: str, value: float, t: float) -> None:
        writer.add_event(Event(wall_time=t, step=round(t - t0), summary=Summary(
            value=[Summary.Value(tag=tag, simple_value=value)])))

    for node, entry in nodes.items():
        for series in entry["gpu"]:  # one per attempt of a requeued job
            for index, s in series.items():
                for t, used, util in zip(s["time"], s["used"], s["util"]):
                    scalar(f"gpu_memory_mib/{node}/gpu{index}", used, t)
                    if not math.isnan(util):
                        scalar(f"gpu_util_pct/{node}/gpu{index}", util, t)
        for attempt in entry["cpu"]:
            for t, rss in zip(attempt["time"], attempt["rss"]):
                scalar(f"cpu_rss_mib/{node}", rss, t)
    writer.close()
    return out
