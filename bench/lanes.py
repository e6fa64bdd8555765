"""Which row of the GPU acceptance run runs when (bench/gpu_check.py): the rows in lanes, the
timed rows one after another in the first, the untimed ones beside them, each started only
while its time estimate fits; the same plan simulated for --dry-run; and a stop (Ctrl-C,
SIGTERM) that starts no more rows and ends the running ones."""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback

from bench.process_tree import STOP, descendants

# STOP is set by Ctrl-C or SIGTERM (stop_rows): no row starts after it, a row that ends after
# it was cut, and a row's process started after it is ended at once (process_tree).
CAUGHT: list = []  # the signals that came, the first of which set it
MAIN_PID = os.getpid()
INTERRUPTED = "interrupted"  # the word a cut row's note starts with (--continue runs it)


def stop_rows(signum, frame) -> None:
    """Ctrl-C or SIGTERM: start no more rows and end the running ones (a terminal's Ctrl-C
    reaches them too; a kill of this process alone would not), so the lanes end at once; a
    second signal kills what the first did not end."""
    if os.getpid() != MAIN_PID:  # a forked child (the tree's worker pool) inherited this
        os._exit(128 + signum)
    CAUGHT.append(signum)
    STOP.set()
    for pid in descendants(MAIN_PID):
        try:
            os.kill(pid, signal.SIGTERM if len(CAUGHT) == 1 else signal.SIGKILL)
        except ProcessLookupError:
            pass


def catch_stops() -> None:
    """stop_rows for SIGINT and SIGTERM, from the start of the run (a SIGINT that the shell
    ignores, as bash does for a script's background job, stays ignored)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, stop_rows)


def _pick(pending: list, lane: int, lanes: int, left: float, need, data: str,
          timed_busy: float = 0.0):
    """The row a free ``lane`` starts next: the first of ``pending`` it takes whose estimate
    (``need(row)``, seconds) fits the ``left`` seconds and whose data is there. "wait" when
    such a row waits for the data being built (``data``: "pending", "running", "done" or
    "failed"); None when nothing is left for this lane. One lane takes every row in order; of
    several, the first takes the timed rows, then helps with the others, and the rest take
    the untimed rows; once those are done, where the timed lane (``timed_busy``: the seconds
    its running row still needs) cannot reach its last rows in time, another lane takes the
    last of them that is no headline, beside it, rather than leave it not started."""
    def first(rows):
        waits = False
        for row in rows:
            if need(row) > left:
                continue
            if row.needs_data and data in ("pending", "running"):
                waits = waits or data == "running"
                continue
            return row
        return "wait" if waits else None

    if lanes == 1:
        return first(pending)
    timed = [r for r in pending if r.in_timed_lane]
    untimed = first([r for r in pending if not r.in_timed_lane])
    if lane == 0:
        return first(timed) or untimed
    if untimed is None and timed_busy + sum(map(need, timed)) > left:
        return first([r for r in reversed(timed) if not r.headline][:1])
    return untimed


def run_lanes(pending: list, lanes: int, deadline: float, need, run_row, record) -> list:
    """Run the ``pending`` rows in ``lanes`` threads, each row as ``run_row(row)`` -> its
    result, then ``record(row, result)``, one at a time, with the result's lane, seconds
    and "beside": the keys of the rows that ran at any time during it. A row starts only
    while its estimate fits before ``deadline`` (time.monotonic()). Returns the rows never
    started."""
    pending = list(pending)
    cond = threading.Condition()
    state = {"data": "pending" if any(r.kind == "data" for r in pending) else "done",
             "timed_end": 0.0}  # when the timed lane's running row ends, by its estimate
    running = {}  # key: the keys of the rows that ran beside it so far

    def lane_loop(lane: int) -> None:
        while not STOP.is_set():
            with cond:
                row = "wait"
                while row == "wait" and not STOP.is_set():  # a row waits for the data
                    now = time.monotonic()
                    row = _pick(pending, lane, lanes, deadline - now, need, state["data"],
                                max(0.0, state["timed_end"] - now))
                    if row == "wait":
                        cond.wait(timeout=1.0)
                if row in (None, "wait"):
                    return
                pending.remove(row)
                if row.kind == "data":
                    state["data"] = "running"
                if lane == 0:
                    state["timed_end"] = time.monotonic() + need(row)
                for beside in running.values():
                    beside.add(row.key)
                running[row.key] = set(running)
            t0 = time.monotonic()
            try:
                result = run_row(row)
            except Exception as exc:  # one row's bug: that row fails, the other lanes go on
                traceback.print_exc()
                result = {"error": f"{type(exc).__name__} in gpu_check: {exc}"}
            if STOP.is_set():  # cut: its figure (or failure) is the interruption's
                result = {"skipped": f"{INTERRUPTED} after {time.monotonic() - t0:.0f} s: "
                                     f"--continue runs it again"}
            with cond:
                result.update(lane=lane, seconds=round(time.monotonic() - t0, 1),
                              beside=sorted(running.pop(row.key)))
                if row.kind == "data":
                    state["data"] = "failed" if "error" in result else "done"
                record(row, result)
                cond.notify_all()

    threads = [threading.Thread(target=lane_loop, args=(lane,), name=f"lane {lane}")
               for lane in range(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return pending


def simulate_lanes(pending: list, lanes: int, budget: float, need) -> tuple:
    """What run_lanes does if every row takes its estimate: ([(lane, row, start, end)], the
    rows never started), seconds from the start."""
    pending, free, ended, runs = list(pending), [0.0] * lanes, set(), []
    data, data_end = ("pending" if any(r.kind == "data" for r in pending) else "done"), 0.0
    while len(ended) < lanes:
        lane = min(set(range(lanes)) - ended, key=lambda n: (free[n], n))
        now = free[lane]
        row = _pick(pending, lane, lanes, budget - now, need,
                    "done" if data == "running" and now >= data_end else data,
                    max(0.0, free[0] - now))
        if row == "wait":
            free[lane] = data_end
        elif row is None:
            ended.add(lane)
        else:
            pending.remove(row)
            free[lane] = now + need(row)
            if row.kind == "data":
                data, data_end = "running", free[lane]
            runs.append((lane, row, now, free[lane]))
    return runs, pending


def print_plan(pending: list, lanes: int, budget: float, need) -> None:
    """--dry-run: each lane's rows, when each starts and ends by its estimate, and the rows
    that would not start."""
    runs, left = simulate_lanes(pending, lanes, budget, need)
    for lane in range(lanes):
        mine = [(row, start, end) for n, row, start, end in runs if n == lane]
        print(f"lane {lane}{' (timed)' if lane == 0 and lanes > 1 else ''}: {len(mine)} "
              f"job(s), ends at about {max((end for *_, end in mine), default=0):.0f} s")
        for row, start, end in mine:
            print(f"  {start:5.0f} - {end:5.0f} s  {row.key}")
    for row in left:
        print(f"not started: {row.key} (about {need(row):.0f} s)")
