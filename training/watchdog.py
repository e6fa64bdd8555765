"""The watchdog: a small process beside each worker of a multi-process run, so that a worker
never outlives its launcher and a frozen rank never holds the job.

``start(env, timeout_s)`` runs in the worker (common.run calls it); it starts
``python -m training.watchdog WORKER_PID LAUNCHER_PID TIMEOUT_S RANK`` and writes the sign of
life to it. ``main()`` is that program: it imports nothing but the standard library (and
hangs.py, which does the same), so it starts in a moment and does not hold a copy of torch in
memory. Before it ends a silent worker, and after a worker that NCCL aborted on a timeout,
it prints the [HANG] lines (hangs.report) from every rank's record; a silent worker that is
not stopped first prints its own Python stacks (hangs.STACKS_SIGNAL).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from training import hangs

#: The folder that holds the ``training`` package: the watchdog runs there, because
#: ``python -m`` finds the module from the current directory, whatever the worker's own.
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def start(env, timeout_s: int) -> None:
    """A small process beside each worker of a multi-process run that ends the worker when
    (a) its launcher is gone: torchrun starts workers in their own session, so a SIGKILLed
    torchrun would leave them training on as orphans, writing checkpoints; or (b) it has
    shown no sign of life for ``timeout_s`` (--dist-timeout): a stopped or hung rank, which
    its peers give up on after the same time, would otherwise keep its node's torchrun
    waiting forever. The worker's sign of life is a byte a thread writes to a pipe every
    second; the watchdog leaves by itself when the worker ends."""
    by_torchrun = "TORCHELASTIC_RUN_ID" in os.environ  # set by torchrun for its workers
    if not by_torchrun and not (env.source == "slurm" and env.world_size > 1):
        return
    launcher = os.getppid() if by_torchrun else 0
    read_end, write_end = os.pipe()
    silence = max(timeout_s, 10)  # well above the 1 s beat, even for a tiny --dist-timeout
    # python -m finds training/ from the project root; PYTHONPATH says where it is also when
    # PYTHONSAFEPATH keeps the current directory off sys.path
    path = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    subprocess.Popen([sys.executable, "-m", "training.watchdog", str(os.getpid()),
                      str(launcher), str(silence), str(env.rank)], stdin=read_end,
                     close_fds=True, cwd=PROJECT_ROOT, env=dict(os.environ, PYTHONPATH=path))
    os.close(read_end)
    os.set_blocking(write_end, False)

    def beat():
        while True:
            try:
                os.write(write_end, b".")
            except BlockingIOError:
                pass
            except OSError:
                return
            time.sleep(1)
    threading.Thread(target=beat, daemon=True).start()


def parent_and_state(pid: int) -> tuple:
    """The parent pid and the state letter (R, S, T, Z, ...) of process ``pid``, from
    /proc/<pid>/stat; (None, "X") when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[0]
    except (OSError, ValueError, IndexError):
        return None, "X"


def end(worker: int, rank: int, reason: str) -> None:
    """Say why, kill the worker, and leave."""
    print(f"error: rank {rank}: {reason}: ending it (pid {worker}) so that the job ends on "
          f"every node", file=sys.stderr, flush=True)
    try:
        os.kill(worker, signal.SIGKILL)
    except ProcessLookupError:
        pass
    sys.exit(0)


def main() -> None:
    """Watch one worker: its sign of life arrives on stdin, a byte a second."""
    worker, launcher, timeout, rank = map(int, sys.argv[1:])
    last = time.monotonic()
    # Slurm sends these to the whole job, and torchrun hands Ctrl-C to each worker's process
    # group: the worker acts on them, the watchdog stays (until the worker has exited).
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        if select.select([0], [], [], 1.0)[0]:
            if not os.read(0, 4096):
                hangs.report_dumps(rank, worker)  # aborted by NCCL on a timeout?
                sys.exit(0)  # the worker closed its end: it has exited
            last = time.monotonic()
        parent, state = parent_and_state(worker)
        if state in "XZ":
            hangs.report_dumps(rank, worker)
            sys.exit(0)
        if launcher and parent != launcher:
            end(worker, rank, f"its launcher (torchrun, pid {launcher}) is gone")
        if time.monotonic() - last > timeout:
            # where its Python code sits, printed by the worker itself: one that runs or
            # sleeps can (not one stopped, traced, or in the kernel's uninterruptible wait)
            asked = state in ("R", "S") and hangs.ask_for_stacks([worker], wait_s=1.0)
            try:
                hangs.report(owner=(rank, worker))  # where every rank waits, before the end
            finally:  # whatever the report meets, the frozen rank is ended
                how = "stopped" if state == "T" else "hung"
                if asked:
                    how += "; its Python stacks are in its output above"
                end(worker, rank, f"no sign of life for {timeout} s ({how})")


if __name__ == "__main__":
    main()
