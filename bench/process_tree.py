"""A row's command as a process tree (bench/gpu_check.py): run to its end or its timeout, and
then ended whole, none of its processes escaping; where its processes were when the timeout
came (their Python stacks), and where a rank crashed (faulthandler's dump)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from pathlib import Path

from training import hangs

REPO = Path(__file__).resolve().parents[1]

#: Set when the run stops (Ctrl-C, SIGTERM: bench/lanes.py's stop_rows, which then ends every
#: process of the run). A process tree started from then on (its start raced the stop, which
#: did not see it) is ended as soon as it has started.
STOP = threading.Event()


TIMED_OUT = "no result within"  # how a row's note starts when its timeout ended it


class RowTimeout(Exception):
    """A row's processes outlived its timeout: the last line it printed, and where each of
    its training processes was (``stack``: the lines of the row's note)."""

    def __init__(self, timeout: float, last_line: str, stack: list):
        said = f" (its last line: {last_line[:150]})" if last_line else ""
        super().__init__(f"{TIMED_OUT} {timeout:.0f} s{said}")
        self.stack = stack

    def result(self, cmd: list) -> dict:
        return {"error": str(self), "stack": self.stack, "cmd": cmd}


def run_command(cmd: list, timeout: float, env: dict | None = None
                ) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) in the repository, but at the
    timeout each training process of the row first prints its Python stacks
    (hangs.STACKS_SIGNAL), then every process of the row is ended (end_tree), torchrun's
    workers and the loggers included, and RowTimeout says where the row was: a row that gave
    no result says what it waited for. A tree started once the run stops (STOP) is ended at
    once."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=env)
    if STOP.is_set():
        end_tree(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hangs.ask_for_stacks([proc.pid] + descendants(proc.pid))
        end_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired as still:  # a process outside the tree holds a pipe:
            # what the row printed until now (bytes, whatever the text mode)
            out, err = (part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                        for part in (still.stdout, still.stderr))
        text = err + "\n" + out  # launch/local.sh's training prints everything to stdout
        printed = [line.strip() for line in out.splitlines()
                   if line.strip() and not is_dump_line(line)]
        raise RowTimeout(timeout, printed[-1] if printed else "",
                         stacks_at_timeout(text)) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def descendants(pid: int) -> list:
    """The processes below ``pid`` (Linux /proc): a row's script, torchrun and its workers (in
    sessions of their own), launch/local.sh's loggers."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def end_tree(root: int) -> list:
    """SIGKILL ``root`` and every process below it, none escaping: each is stopped first
    (SIGSTOP; a stopped process forks no more and its children stay its own) until no new one
    appears, then all are killed. Returns their pids."""
    stopped = []
    for _ in range(100):
        new = [pid for pid in [root] + descendants(root) if pid not in stopped]
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            stopped.append(pid)
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return stopped


def exited(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (dead, its parent not told yet). A process
    whose main thread has ended while others run reads as a zombie too: its threads say."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


#: A frame line of faulthandler's dump (a traceback's has ", in" and a source line after it)
DUMP_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (\S+)$')
DUMP_HEAD = "(most recent call first):"  # a thread's stack begins after such a line
STACK_FRAMES = 4  # innermost frames of each process's main thread kept, and as many of ours


def is_dump_line(line: str) -> bool:
    """Whether ``line`` belongs to a faulthandler dump (a header, a frame, its "..." cut)."""
    return (line.rstrip().endswith(DUMP_HEAD) or bool(DUMP_FRAME.match(line))
            or line.strip() == "...")


def stacks_at_timeout(text: str, processes: int = 3) -> list:
    """Where the main thread of each process that printed its stacks (faulthandler's dump
    in ``text``) was: its innermost frames, then its innermost frames in the toolkit (the line
    of ours that called them), for at most ``processes`` processes, the training processes
    before their DataLoader workers. A main thread is one whose outermost frame is a script's
    <module> (runpy's, run with -m), or whose stack faulthandler cut at 100 frames ("...")."""
    blocks, frames = [], None
    for line in text.splitlines() + [DUMP_HEAD]:
        if frames is not None and DUMP_FRAME.match(line):
            frames.append(line.strip())
            continue
        cut = frames is not None and line.strip() == "..."
        if frames and (cut or frames[-1].endswith((" in <module>", " in _run_module_as_main"))):
            blocks.append(frames + ["..."] * cut)
        frames = [] if line.rstrip().endswith(DUMP_HEAD) else None
    blocks.sort(key=lambda frames: any(f.endswith(" in _worker_loop") for f in frames))
    lines = []
    for number, frames in enumerate(blocks[:processes], 1):
        ours = [f for f in frames[STACK_FRAMES:]
                if f'File "{REPO}/' in f and "-packages/" not in f][:STACK_FRAMES]
        lines += ([f"process {number} of {len(blocks)}, innermost first:"]
                  + [f"  {f[:300]}" for f in frames[:STACK_FRAMES]]
                  + (["  ..."] if len(frames) > STACK_FRAMES + len(ours) else [])
                  + [f"  {f[:300]}" for f in ours])
    return lines


# A crash (SIGSEGV) prints every thread's Python stack: the rows that start ranks set this
FAULTHANDLER = {"PYTHONFAULTHANDLER": "1"}
FATAL_LINES = 15  # of the first such stack, kept in the row's note


def fatal_stack(text: str, limit: int = FATAL_LINES) -> list:
    """The first "Fatal Python error" of ``text`` and the stack of the thread that crashed
    (faulthandler's "Current thread", else the first one it printed), at most ``limit``
    lines; [] when nothing crashed."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Fatal Python error" in line), None)
    if start is None:
        return []
    after = lines[start + 1:]
    current = next((i for i, line in enumerate(after) if "Current thread" in line), None)
    if current is None:
        current = next((i for i, line in enumerate(after) if "(most recent call first)" in line),
                       len(after))
    stack = after[current:current + 1]
    for line in after[current + 1:]:
        if 'File "' not in line or len(stack) == limit - 1:  # the stack's frames, no more
            break
        stack.append(line)
    return [lines[start].strip()[:300]] + [line.rstrip()[:300] for line in stack]
