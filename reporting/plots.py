"""The pictures: a study's plots (collect_results.py --plot) and one run's timeline
(analyze_memory.py --plot).

Drawing only. Others decide what to show and hand over plain numbers: report.plot_data the
study's plot points and bars, timeline.node_timelines a run's time series. So this module imports
nothing of the project, and matplotlib only when it draws (headless: files only, no display on a
login or compute node). Both parsers ask ``missing_matplotlib()`` before they start.
"""

from __future__ import annotations

import math
import textwrap
from datetime import datetime
from pathlib import Path

#: collect_results.py --plot's files: file name -> what it shows.
PLOTS = {
    "time_per_epoch.png": "time per epoch vs GPUs (log scale)",
    "val_loss_acc.png": "validation loss and accuracy vs GPUs",
    "peak_memory.png": "peak memory per GPU vs GPUs",
    "throughput.png": "throughput vs GPUs against ideal linear scaling",
    "step_breakdown.png": "where the step time goes, per configuration",
    "memory_breakdown.png": "where the memory goes: predicted parts and measured peak",
}

#: The parts of a step_breakdown.png bar, in drawing order: key -> (legend, colour, hatch).
BAR_PARTS = {
    "compute": ("compute", "C0", None),
    "exposed_comm": ("exposed communication", "C3", None),
    "data_wait": ("data wait", "C1", None),
    "other": ("other (Python, launches, idle)", "0.6", None),
    "unprofiled": ("not profiled: rest of the step", "0.88", "//"),
}


def _pyplot():
    # matplotlib is needed only for --plot, so it is imported when a picture is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def missing_matplotlib() -> str | None:
    """What both parsers say before any work when --plot cannot draw here; None when it can."""
    try:
        _pyplot()
    except ImportError:
        return ("--plot needs matplotlib: pip install matplotlib (it is in requirements.txt), "
                "or drop --plot")
    return None


# --------------------------------------------------------------------------------------------
# A study: four plots against the number of GPUs, and where the step time goes
# --------------------------------------------------------------------------------------------

def steps_note(points: list) -> str | None:
    """val_loss_acc.png's footnote: the steps of an epoch at each GPU count. With a fixed batch
    per GPU, more GPUs train an epoch in fewer, larger steps, so a final epoch's loss is not
    the same amount of training at every count. None where no point knows its steps."""
    by_gpus = {}
    for p in points:
        if p.get("steps"):
            by_gpus.setdefault(p["gpus"], set()).add(p["steps"])
    if not by_gpus:
        return None
    # named as the x axis names them
    one, many = ("process", "processes") if {p["device"] for p in points} == {"cpu"} else (
        "GPU", "GPUs")
    counts = sorted(by_gpus)
    head = "steps per epoch (training images / global batch): "
    if len(counts) > 1 and len({frozenset(steps) for steps in by_gpus.values()}) == 1:
        return head + "/".join(f"{n:,}" for n in sorted(by_gpus[counts[0]])) + \
            f" at every {one} count"
    each = "; ".join(f"{n} {one if n == 1 else many}: "
                     + "/".join(f"{s:,}" for s in sorted(by_gpus[n])) for n in counts)
    fewer = len(counts) > 1 and max(by_gpus[counts[-1]]) < min(by_gpus[counts[0]])
    return head + each + (f"; fewer, larger steps with more {many}" if fewer else "")


def throughput_title(ideal: list, measured: bool = True) -> str:
    """throughput.png's title: the ideal line is there only where a strategy has a 1-GPU
    baseline (a throughput above 0) and a larger run. measured: whether any run has a
    throughput above 0 to draw."""
    if ideal:
        return "Throughput against ideal linear scaling"
    if not measured:
        return "Throughput\n(no run logged one above 0: no points, no ideal line)"
    # on two lines: on one, a figure 7 inches wide cut it at both edges
    return "Throughput\n(no ideal line: it needs a 1-GPU run with a throughput and a larger one)"


def log_limits(values: list) -> tuple:
    """The 1-2-5 ticks (0.5, 1, 2, 5, 10, 20, ...) just below and just above ``values`` (all
    above 0): the limits of a log axis whose extreme points then lie between labelled ticks
    (autoscaled, the lowest label could sit above the lowest point)."""
    def ticks_near(v):  # floats: an int tick of a huge value (a damaged line's 1e18 img/s)
        decade = 10.0 ** math.floor(math.log10(v))  # was past numpy's int64, a TypeError
        return [t for t in (decade * m for m in (0.5, 1, 2, 5, 10, 20)) if math.isfinite(t)]
    low, high = min(values), max(values)
    below = max(t for t in ticks_near(low) if t <= low * (1 + 1e-9))
    # one value on a tick: the next tick up, so that the axis has a range (none above the
    # largest float: the value itself)
    return below, min((t for t in ticks_near(high) if t >= high * (1 - 1e-9) and t > below),
                      default=high)


#: Each strategy's colour in the study's line plots.
STRATEGY_COLORS = {"dp": "C0", "ddp": "C1", "fsdp": "C2"}


def study_plots(series: list, ideal: list, bars: list, out_dir: Path, dpi: int) -> list:
    """Write PLOTS into out_dir; return the names written (step_breakdown.png needs bars).

    series: dicts {"group", "strategy", "label", "line", "points"}: one line each, "-" through
    a strategy's 1-node runs, "--" through a node sweep; points: dicts {"gpus", "partial",
    "device", and a number or None per plotted column}; a partial point (a run that did not
    finish) gets an open marker. groups sort in table order; a group's lines share a marker, a
    strategy's its colour (STRATEGY_COLORS). ideal: (group, label, GPU
    counts, throughputs) of the ideal linear scaling lines. bars: (label, {BAR_PARTS key: ms})
    of step_breakdown.png, top to bottom."""
    plt = _pyplot()
    from matplotlib.ticker import (FixedLocator, FuncFormatter, LogLocator, NullFormatter,
                                   NullLocator)

    groups = sorted({s["group"]: s["strategy"] for s in series}.items())
    # A strategy has its colour in every study, whichever strategies the study ran. Equal
    # values (dp, ddp and fsdp compute the same model) would hide each other: a marker each,
    # the first drawn largest, so every point stays visible.
    look = {k: dict(color=STRATEGY_COLORS.get(strategy, "C3"), marker="osD^v<>"[i % 7],
                    markersize=max(4, 11 - 2.5 * i))
            for i, (k, strategy) in enumerate(groups)}
    shown = [p for s in series for p in s["points"]]
    devices = {p["device"] for p in shown}
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")

    def draw(ax, column, ylabel, logy=False, with_ideal=False):
        """One panel of column against GPUs; a panel with no point says so, never an empty
        legend (a nan plotted as a line was invisible, but listed)."""
        for s in series:
            pts = [p for p in s["points"] if p[column] is not None]
            if pts:
                ax.plot([p["gpus"] for p in pts], [p[column] for p in pts], s["line"],
                        label=s["label"], **look[s["group"]])
            for p in pts:
                if p["partial"]:  # an open marker: the numbers are the last completed epoch's
                    ax.plot([p["gpus"]], [p[column]], linestyle="", markerfacecolor="white",
                            **look[s["group"]])
        for group, label, xs, ys in ideal if with_ideal else ():
            ax.plot(xs, ys, ":", color=look[group]["color"], label=label)
        if not ax.lines:
            logy = False  # a log scale without data has no range to label
            ax.text(0.5, 0.5, f"nothing to draw: no run logged a finite {column}"
                    + (" above 0" if column == "throughput_img_s" else ""),
                    transform=ax.transAxes, ha="center", va="center", gid="nothing to draw")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sorted({p["gpus"] for p in shown})))
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_locator(NullLocator())
        if logy:  # label in plain numbers, the minor ticks too when the range is narrow
            ax.set_yscale("log")
            drawn = [y for line in ax.lines for y in line.get_ydata()
                     if math.isfinite(y) and y > 0]
            if drawn:
                ax.set_ylim(*log_limits(drawn))
            low, high = ax.get_ylim()
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain if high / low < 20 else NullFormatter())
            ylabel = ylabel[:-1] + ", log scale)"
        ax.set_xlabel("processes (CPU run: each stands in for one GPU)" if devices == {"cpu"}
                      else "GPUs (nodes x GPUs per node)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)

    def legend(*axes):
        """One legend, on the first of axes that has a line, of every line in axes (a series
        keeps its colour in each panel, and may be drawn in one panel only: a run without a
        GPU log); an empty panel gets none."""
        ax = next((ax for ax in axes if ax.lines), None)
        if ax is None:
            return
        named = {}
        for each in axes:
            for handle, label in zip(*each.get_legend_handles_labels()):
                named.setdefault(label, handle)
        ax.legend(list(named.values()), list(named), fontsize=8)

    def save(fig, name, title, markers=True, note=None):
        """Title, then the figure's footnotes (note, and the open markers) under the panels,
        each wrapped to the figure's width (a line cut at the edge is lost: no bbox_inches)."""
        fig.suptitle(title)
        notes = [note] if note else []
        if markers and any(p["partial"] for p in shown):
            notes.append("open markers: partial or requeued runs (last completed epoch)")
        width = int(fig.get_figwidth() * 15)  # characters of 8 pt text a line holds, about
        lines = [line for text in notes for line in textwrap.wrap(text, width)]
        for i, text in enumerate(reversed(lines)):
            fig.text(0.01, 0.01 + 0.035 * i, text, fontsize=8, gid="footnote")
        fig.tight_layout(rect=(0, 0.035 * len(lines), 1, 1))
        fig.savefig(out_dir / name, dpi=dpi)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax, "epoch_time_s", "time per epoch (s; training part, final epoch)", logy=True)
    legend(ax)
    save(fig, "time_per_epoch.png", "Time per epoch")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
    draw(a1, "val_loss", "validation loss (cross-entropy)")
    draw(a2, "val_acc", "validation accuracy (%)")
    legend(a1, a2)
    save(fig, "val_loss_acc.png", "Validation loss and accuracy (final epoch)",
         note=steps_note(shown))

    gpu_log = any(p["gpu0_peak_mib"] is not None for p in shown)  # without one, one panel
    fig, axes = plt.subplots(1, 1 + gpu_log, figsize=(7 + 5.5 * gpu_log, 4.5), squeeze=False)
    first, last = axes[0][0], axes[0][-1]
    if gpu_log:
        draw(first, "gpu0_peak_mib", "GPU 0 peak memory (MiB, nvidia-smi)")
        first.set_title("nvidia-smi: GPU 0 of the first node", fontsize=10)
    draw(last, "peak_mem_mib",
         "peak RSS per process, max over ranks (MiB)\n(CPU run: no GPU memory)"
         if devices == {"cpu"} else
         "peak allocated per GPU, max over ranks (MiB)\n(torch.cuda.max_memory_allocated)"
         if devices == {"cuda"} else
         "peak memory per process, max over ranks (MiB)\n(GPU: allocated; CPU: RSS)")
    last.set_title("the training's [METRIC] peak_mem_mib", fontsize=10)
    legend(first, last)
    save(fig, "peak_memory.png", "Peak memory per process (CPU run)" if devices == {"cpu"}
         else "Peak memory per GPU")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax, "throughput_img_s", "throughput (training images/s)", logy=True, with_ideal=True)
    legend(ax)
    save(fig, "throughput.png", throughput_title(
        ideal, any(p["throughput_img_s"] is not None for p in shown)))

    drawn = [name for name in PLOTS if name != "memory_breakdown.png"]  # memory_plot draws it
    if not bars:  # no run with a step time (its [METRIC] line lacks the figures for one)
        return [name for name in drawn if name != "step_breakdown.png"]
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.4 * len(bars)))
    for y, (_label, widths) in enumerate(bars):
        left = 0.0
        for key, (name, color, hatch) in BAR_PARTS.items():
            width = widths.get(key, 0.0)
            ax.barh(y, width, left=left, color=color, hatch=hatch, edgecolor="white",
                    label=name if width > 0 else None)
            left += width
        ax.text(left, y, f" {left:.0f} ms", va="center", fontsize=8)
    handles = dict(zip(*reversed(ax.get_legend_handles_labels())))
    names = [name for name, *_ in BAR_PARTS.values() if name in handles]
    # above the bars, under the title: below them it covered the axis label
    ax.legend([handles[n] for n in names], names, fontsize=8, ncol=len(names), frameon=False,
              loc="lower center", bbox_to_anchor=(0.5, 1.0))
    ax.set_xlim(0, ax.get_xlim()[1] * 1.1)  # room for the labels
    ax.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.invert_yaxis()  # first configuration on top
    ax.set_xlabel("milliseconds per training step (profiled: 5 traced steps; else final epoch)")
    ax.grid(True, axis="x", alpha=0.3)
    save(fig, "step_breakdown.png", "Where the step time goes", markers=False)
    return drawn


MEMORY_COLORS = {"params": "C0", "grads": "C9", "optimizer": "C2", "buffers": "0.5",
                 "amp_copies": "C8", "activations": "C1", "comm": "C3", "workspace": "#393b79",
                 "transient": "C4", "data": "C5", "inputs": "C6"}


def memory_plot(bars: list, parts: dict, out_dir: Path, dpi: int, freed: list = ()) -> str:
    """memory_breakdown.png: one stacked bar per configuration, the predicted MiB per GPU of
    each part in ``parts`` ({key: name}); a black diamond at the measured peak where there is
    one (a GPU run). bars: (label, {key: MiB}, measured MiB or None), top to bottom; freed: the
    labels of the bars without gradients, which their runs free before each step (a note
    says so, and their labels get a *)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 1.7 + 0.4 * len(bars)))
    for y, (_label, widths, measured) in enumerate(bars):
        left = 0.0
        for key, name in parts.items():
            width = widths.get(key, 0.0)
            ax.barh(y, width, left=left, color=MEMORY_COLORS.get(key, "0.8"),
                    edgecolor="white", label=name if width > 0 else None)
            left += width
        text = f"{left:,.0f} predicted"
        if measured is not None:
            ax.plot([measured], [y], "kD", markersize=7, label="measured peak")
            text += f", {measured:,.0f} measured"
        ax.annotate(text, (max(left, measured or 0), y), xytext=(7, 0),
                    textcoords="offset points", va="center", fontsize=8)
    handles = dict(zip(*reversed(ax.get_legend_handles_labels())))
    names = [n for n in (*parts.values(), "measured peak") if n in handles]
    ax.legend([handles[n] for n in names], names, fontsize=8, ncol=min(5, len(names)),
              frameon=False, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    ax.set_xlim(0, ax.get_xlim()[1] * 1.35)  # room for the labels
    ax.set_yticks(range(len(bars)), [label + (" *" if label in freed else "")
                                     for label, *_ in bars], fontsize=8)
    ax.invert_yaxis()  # first configuration on top
    ax.set_xlabel("MiB per GPU: the parts predicted at the run's start (bars), the measured "
                  "peak (GPU runs)")
    ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle("Where the memory goes")
    if freed:
        fig.text(0.01, 0.01, "* no Grads: these runs free the gradients before each step and "
                 "make them during backward, so they are not in the peak", fontsize=8)
    fig.tight_layout(rect=(0, 0.04 if freed else 0, 1, 1))
    fig.savefig(out_dir / "memory_breakdown.png", dpi=dpi)
    plt.close(fig)
    return "memory_breakdown.png"


# --------------------------------------------------------------------------------------------
# A run over time: one panel per node
# --------------------------------------------------------------------------------------------

def timeline_figure(title: str, nodes: dict, phases: list):
    """One run's timeline as a matplotlib Figure: a panel (SubFigure) per node with rows of GPU
    memory used and GPU utilisation per GPU (one colour and one legend entry per GPU) and the
    node's CPU RSS; epoch starts dashed, evaluations grey. nodes: {node: {"gpu": [{index:
    {"time", "used", "util"}} per attempt], "cpu": [{"time", "rss"} per attempt]}}; phases:
    dicts {"epoch", "train_start", "eval_start", "eval_end", "slow"}; times in seconds since 1970;
    "slow": an epoch's straggler, marked in red under its name. The
    x-axis counts seconds from the run's first sample or epoch."""
    from matplotlib.figure import Figure

    t0 = _run_start(nodes, phases)
    ends = [t for entry in nodes.values() for series in entry["gpu"] for s in series.values()
            for t in s["time"][-1:]]
    ends += [a["time"][-1] for entry in nodes.values() for a in entry["cpu"] if a["time"]]
    ends += [p["eval_end"] or p["train_start"] for p in phases]
    xlim = (0.0, max(max(ends, default=t0) - t0, 1.0))

    rows = [len(node_rows(entry)) for entry in nodes.values()]
    fig = Figure(figsize=(13, 1.0 + sum(2.0 * r + 0.6 for r in rows)), layout="constrained")
    fig.suptitle(_drawable(title))
    subfigs = fig.subfigures(len(nodes), 1, squeeze=False, height_ratios=rows)[:, 0]
    for subfig, (node, entry) in zip(subfigs, nodes.items()):
        _draw_node(subfig, node, entry, phases, t0, xlim)
    return fig


def _drawable(text: str) -> str:
    """text with the bytes of a name that is not UTF-8 (held as surrogate escapes, which
    matplotlib refuses with a TypeError) written as \\xe9."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _run_start(nodes: dict, phases: list) -> float:
    """The earliest time of a run (a sample or an epoch start), in seconds since 1970."""
    times = [p["train_start"] for p in phases]
    for entry in nodes.values():
        times += [s["time"][0] for series in entry["gpu"] for s in series.values() if s["time"]]
        times += [attempt["time"][0] for attempt in entry["cpu"] if attempt["time"]]
    return min(times, default=0.0)


def node_rows(entry: dict) -> list:
    """The rows of a node's panel: "gpu_mem" and "gpu_util" (when its GPU logs have those
    samples), "cpu" (when it has a psrecord log)."""
    has_mem = any(s["time"] for series in entry["gpu"] for s in series.values())
    has_util = any(not math.isnan(u) for series in entry["gpu"] for s in series.values()
                   for u in s["util"])
    return ((["gpu_mem"] if has_mem else []) + (["gpu_util"] if has_util else [])
            + (["cpu"] if entry["cpu"] else []))


def _gpu_color(index: int, n_gpus: int):
    """One colour per GPU: tab10 for up to 10 GPUs, tab20 for more."""
    import matplotlib
    cmap = matplotlib.colormaps["tab10" if n_gpus <= 10 else "tab20"]
    return cmap(index % cmap.N)


def _mark_phases(ax, phases: list, t0: float, with_labels: bool) -> None:
    """Dashed lines at epoch starts and grey spans over evaluations; with_labels: name the
    epochs above the axes and put one of each mark in the legend."""
    for i, p in enumerate(phases):
        first = with_labels and i == 0
        ax.axvline(p["train_start"] - t0, color="0.35", linestyle="--", linewidth=0.8,
                   label="epoch start" if first else "_epoch start", gid="epoch start")
        if p["eval_start"] is not None and p["eval_end"] is not None:
            ax.axvspan(p["eval_start"] - t0, p["eval_end"] - t0, color="0.6", alpha=0.3,
                       linewidth=0, label="evaluation" if first else "_evaluation",
                       gid="evaluation")
        if with_labels and len(phases) <= 30:
            ax.text(p["train_start"] - t0, 1.01, f"epoch {p['epoch']}", fontsize="x-small",
                    transform=ax.get_xaxis_transform(), va="bottom")
        if with_labels and p.get("slow"):  # the straggler's rank, under the epoch's name
            ax.text(p["train_start"] - t0, 0.98, f" {p['slow']}", fontsize="x-small",
                    color="tab:red", transform=ax.get_xaxis_transform(), va="top",
                    gid="straggler")
    if with_labels and any(p.get("slow") for p in phases):  # what the red names mean
        ax.plot([], [], linestyle="none", marker="$\\mathrm{rank}$", markersize=18,
                color="tab:red", label="rank that held\nthe others back,\n% slower",
                gid="straggler key")


def _draw_node(subfig, node: str, entry: dict, phases: list, t0: float, xlim: tuple) -> None:
    """One node's panel: GPU memory, GPU utilisation (when logged) and CPU memory rows."""
    indices = sorted({i for series in entry["gpu"] for i in series})
    rows = node_rows(entry)
    missing = []
    if not indices:
        missing.append("no GPU logs (CPU run)")
    elif "gpu_mem" not in rows:
        missing.append("no GPU sample with a readable timestamp")
    elif "gpu_util" not in rows:
        missing.append("no utilisation in the GPU logs (written before node.sh logged it)")
    if not entry["cpu"]:
        missing.append("no CPU log (psrecord did not run)")
    subfig.suptitle(_drawable(f"node {node}") + "".join(f"; {m}" for m in missing),
                    fontsize="medium")
    axes = subfig.subplots(len(rows), 1, sharex=True, squeeze=False)[:, 0]
    for ax, row in zip(axes, rows):
        ax.set_xlim(*xlim)
        ax.grid(alpha=0.3)
        if row == "cpu":
            for n, attempt in enumerate(entry["cpu"]):
                ax.plot([t - t0 for t in attempt["time"]], attempt["rss"], color="black",
                        linewidth=1.2, label="RSS" if n == 0 else "_RSS",
                        gid=f"CPU, attempt {n}")
            ax.set_ylabel("CPU memory,\nRSS (MiB)")
            ax.set_ylim(bottom=0)
        else:
            key = "used" if row == "gpu_mem" else "util"
            for n, series in enumerate(entry["gpu"]):
                for index, s in series.items():
                    ax.plot([t - t0 for t in s["time"]], s[key], linewidth=1.2,
                            color=_gpu_color(index, len(indices)),
                            label=f"GPU {index}" if n == 0 else f"_GPU {index}",
                            gid=f"GPU {index}, attempt {n}")
            if row == "gpu_mem":
                ax.set_ylabel("GPU memory\nused (MiB)")
                ax.set_ylim(bottom=0)
            else:
                ax.set_ylabel("GPU\nutilisation (%)")
                ax.set_ylim(0, 105)
        _mark_phases(ax, phases, t0, with_labels=ax is axes[0])
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    axes[-1].set_xlabel(f"seconds since the run's first sample "
                        f"({datetime.fromtimestamp(t0):%Y-%m-%d %H:%M:%S} local time)"
                        if t0 else "seconds since psrecord started")
