"""Runs held back by one slow rank, in the reports: a per-rank table in results.md, a flag in
the scaling table, a mark on the run's timeline.

A run whose ``rank_spread`` ([METRIC]: the slowest rank's own time over the median rank's) is
above contract.SLOW_RANK_SPREAD ran at its straggler's pace: its throughput and parallel
efficiency say more about that rank (a throttling GPU, a busy node, a slow loader) than about
the strategy. The per-rank figures come from the run's ``[RANKS]`` lines (training/stragglers.py
writes them). No torch here: the reports run on a login node.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from training import contract
from reporting.scaling import gpus, num

#: The column results.csv gets for a flagged run, and the scaling table's status shows.
COLUMN = "straggler"


def read_ranks(path) -> dict:
    """{epoch (text): [one dict per rank]} of the complete [RANKS] lines of a log (the last one
    of an epoch, should a resumed run repeat it); {} when the log cannot be read."""
    found = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for text in f:
                if text.endswith("\n") and (parsed := contract.parse_ranks_line(text)):
                    found[parsed[0]] = parsed[1]
    except OSError:
        return {}
    return found


def is_held_back(row: dict) -> bool:
    spread = num(row, "rank_spread")
    return spread is not None and spread > contract.SLOW_RANK_SPREAD


def against_the_others(row: dict) -> tuple:
    """(the slowest rank's own time over the others', "the median rank's" or "the other
    rank's"), as the training's straggler line says it. Of two ranks the median is their mean,
    so the spread (slow / mean) is said as slow / the other: spread / (2 - spread)."""
    spread = num(row, "rank_spread")
    if gpus(row) == 2 and spread < 2:
        return spread / (2 - spread), "the other rank's"
    return spread, "the median rank's"


def summary(row: dict) -> str:
    """What the scaling table says of a run held back by one rank."""
    ratio, against = against_the_others(row)
    return (f"straggler: rank {row.get('slowest_rank', '?')} took {ratio:.2f}× {against} own "
            f"time, so this efficiency is the straggler's, not the strategy's")


def flag(rows: list) -> None:
    """Mark each run held back by a straggler: results.csv's ``straggler`` column, and its
    status detail, which the scaling table shows."""
    for row in rows:
        if is_held_back(row):
            row[COLUMN] = summary(row)
            row["detail"] = "; ".join(d for d in (row.get("detail", ""), row[COLUMN]) if d)


def rank_table(ranks: list) -> list:
    """A markdown table of one epoch's per-rank figures; the slowest rank in bold."""
    median = statistics.median(r["own_s"] for r in ranks)
    slowest = max(range(len(ranks)), key=lambda i: ranks[i]["own_s"])
    lines = ["| Rank | Node | Device | Own time (s) | Compute (s) | Data wait (s) | "
             "Rank wait (s) | vs median |", "|" + "---|" * 8]
    for i, r in enumerate(ranks):
        ratio = f"{r['own_s'] / median:.2f}×" if median > 0 else "—"
        cells = [str(i), r["node"], r["device"], f"{r['own_s']:.2f}", f"{r['compute_s']:.2f}",
                 f"{r['data_wait_s']:.2f}", f"{r['rank_wait_s']:.2f}", ratio]
        if i == slowest:
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def ranks_markdown(rows: list) -> list:
    """results.md's section on runs held back by one rank: per run, its epoch's per-rank
    table (the epoch of the row's figures, else the last one logged). A run the scaling table
    does not use (an older run of the same configuration) is left out: the section describes
    the runs the tables show."""
    lines = []
    for row in rows:
        if not is_held_back(row) or row.get("used_in_tables") == 0:
            continue
        logged = read_ranks(Path(row["path"]) / "train.log") if row.get("path") else {}
        ranks = logged.get(str(row.get("epoch"))) or (list(logged.values()) or [None])[-1]
        lines += [f"### {row['run']}", "", f"Epoch {row.get('epoch', '?')}, {summary(row)}. "
                  f"Own time = compute + data wait; a rank with much rank wait (waiting for "
                  f"the others) is not slow itself (docs/performance.md, \"Which rank holds "
                  f"the others back\").", ""]
        lines += rank_table(ranks) if ranks else ["(no [RANKS] line in its train.log)"]
        lines.append("")
    if lines:
        lines = ["## Runs held back by one rank", ""] + lines
    return lines


def slow_label(metric: dict) -> str | None:
    """A [METRIC] line's ({key: text}) straggler as the timeline marks it: "rank 1 +45%", the
    figure of the training's line ("45% slower than the other rank")."""
    if not is_held_back(metric):
        return None
    ratio, _ = against_the_others(metric)
    return f"rank {metric.get('slowest_rank', '?')} +{100 * (ratio - 1):.0f}%"
