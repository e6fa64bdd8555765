"""What a run does when something goes wrong, so that a multi-node job never hangs and never
loses work. The training scripts meet it in two places: ``UsageError`` (a problem the user can
fix: one sentence, exit code 2) and ``end_process`` (the exit). common.run() uses the rest:

- a failed collective (a peer died, a timeout) becomes one sentence and exit code 1;
- any other error becomes one sentence (after its traceback, when it is a bug) and exit code 1;
- under torchrun, which reports any failed worker as 1, a worker's own code is an [EXIT] line;
- the lock of a checkpoint dir, so two runs never write and resume from the same checkpoints;
- the exit itself, which releases that lock and stops this rank's child processes.

The neighbours in the same trade: stopping.py turns SIGUSR1/SIGTERM into a checkpoint and a
requeue, watchdog.py ends a worker whose launcher is gone or that froze, and lossguard.py
catches a loss that became NaN or inf. Importing this module has no side effects; of this
project it imports contract.py only.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import platform
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from training import contract

# --------------------------------------------------------------------------------------------
# Errors a user can fix
# --------------------------------------------------------------------------------------------


class UsageError(Exception):
    """A problem the user can fix: printed as one sentence naming the fix, exit code 2."""


class DataError(UsageError):
    """A UsageError about the data one rank read (an unreadable image with --strict): only
    that rank sees it, so that rank prints it, whichever it is."""


class RankError(UsageError):
    """A UsageError that only the rank that raises it can see (no rank 0 answered it at
    MASTER_ADDR:MASTER_PORT): that rank prints it, whichever it is."""


def file_in_the_way(path) -> Path | None:
    """The file at ``path`` or above it that keeps a folder from being made there, or None."""
    return next((p for p in [Path(path), *Path(path).parents]
                 if p.exists() and not p.is_dir()), None)


def disk_full(exc: BaseException) -> bool:
    """Did a write fail for want of space (a full file system, a quota)? torch.save reports
    it as a RuntimeError ("file write failed"), DCP wraps it in its CheckpointException, and
    numpy's own check of the space raises an OSError without an errno ("Not enough free space
    to write N bytes")."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(words in str(exc) for words in ("No space left on device", "Disk quota exceeded",
                                               "file write failed", "Not enough free space")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def make_folder(path, flag: str) -> None:
    """mkdir -p of ``flag``'s folder, which must be writable, or one sentence: a file in its
    place (or above it) is named as such, where mkdir's "File exists" or "Not a directory"
    named no fix; an existing folder this process may not write (read-only, or another
    user's) is said so before anything is written there, not by a traceback of the writer."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocked = file_in_the_way(path)
        if blocked is not None:
            raise UsageError(f"{flag} {path}: {blocked} is a file, not a folder: give a folder's "
                             f"path") from None
        raise UsageError(f"{flag} {path}: cannot create that folder ({e.strerror or e}): give "
                         f"a writable directory") from None
    if not os.access(path, os.W_OK | os.X_OK):  # a read-only file system: for root too
        raise UsageError(f"{flag} {path}: that folder is not writable: give a writable "
                         f"directory")


def _rank(rank_env) -> str:
    """How an error line names this process: "rank R", or in a --simulate-world-size run, like
    its other lines, "simulation, rank 0 of N"."""
    if rank_env is not None and rank_env.source == "simulated":
        return f"simulation, rank 0 of {rank_env.world_size}"
    return f"rank {rank_env.rank if rank_env else 0}"


def fail_cleanly(err: UsageError, rank_env=None) -> int:
    """Print a UsageError as one line and return 2. A problem of the setup is the same on
    every rank that torchrun or srun started alike: local rank 0 of each node prints it. A
    DataError or RankError (or any error raised in a DataLoader worker) is this rank's own: it
    prints it, prefixed with its rank unless 0; so does a rank started by hand (RANK and
    WORLD_SIZE set in its own shell), whose setup may be its own (no MASTER_PORT there)."""
    text = str(err)
    from_worker = "Original Traceback" in text
    if from_worker:  # raised in a DataLoader worker: keep only its sentence
        text = re.sub(r"^.*?(Usage|Data)Error: ", "", text.strip().splitlines()[-1])
    by_hand = rank_env is not None and rank_env.source == "torchrun" and \
        "TORCHELASTIC_RUN_ID" not in os.environ  # set by torchrun for its workers
    own = isinstance(err, (DataError, RankError)) or from_worker or by_hand
    if rank_env is None or rank_env.local_rank == 0 or own:
        named = rank_env and (rank_env.source == "simulated" or own and rank_env.rank)
        rank = f"{_rank(rank_env)}: " if named else ""
        print(f"error: {rank}{text}", file=sys.stderr, flush=True)
    else:  # a silent rank that exits first makes torchrun stop the node's other ranks (SIGTERM):
        time.sleep(2)  # give local rank 0 the moment it needs to print the same error
    return 2


# --------------------------------------------------------------------------------------------
# A lost peer: fail, never hang
# --------------------------------------------------------------------------------------------


#: Words of the errors that gloo and NCCL raise as plain RuntimeError when a peer is lost.
COLLECTIVE_ERROR_WORDS = ("gloo", "nccl", "connection closed by peer", "connection reset by "
                          "peer", "broken pipe", "timed out")


def is_collective_failure(err: BaseException) -> bool:
    """Did a collective fail (a peer died, the network broke, a timeout)? torch raises
    dist.DistError for some of these; gloo raises a plain RuntimeError (also from inside
    DDP's backward), so its message and where it was raised count too."""
    if isinstance(err, dist.DistError):
        return True
    if not isinstance(err, RuntimeError) or isinstance(err, torch.OutOfMemoryError):
        return False  # an OOM inside FSDP's hooks is an OOM, not a lost peer
    text = str(err).lower()
    if any(word in text for word in COLLECTIVE_ERROR_WORDS):
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    # raised by a collective call itself (the innermost frame is torch's c10d module)?
    return tb is not None and tb.tb_frame.f_code.co_filename.endswith("distributed_c10d.py")


def exit_line(code: int, rank_env=None) -> int:
    """Under torchrun, which reports a failed worker as 1, say the real code for job.sh."""
    if code and "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for its workers
        rank = rank_env.rank if rank_env else os.environ.get("RANK", "?")
        print(contract.EXIT_LINE.format(code=code, rank=rank), flush=True)
    return code


def collective_failed(err: Exception, rank_env) -> int:
    """A collective failed or timed out (a peer died, the network broke): say so and exit 1
    instead of waiting forever."""
    first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    print(f"error: {_rank(rank_env)}: a collective with the other ranks failed or timed out "
          f"({err.__class__.__name__}: {first}); another rank probably died first: look for its "
          f"own error line, above or below this one, or raise --dist-timeout if the job is "
          f"merely slow", file=sys.stderr, flush=True)
    return 1


def crashed(err: Exception, rank_env) -> int:
    """Any other error: say so in one sentence and return 1, so that the caller's end_process
    stops this rank's DataLoader workers and exits. Raised on instead, the error would reach
    the interpreter's exit, where multiprocessing sends the workers a SIGTERM they ignore
    (they must outlive a stop signal) and then waits for them forever. A dead loader worker is
    named as such; for anything else the traceback comes first, because it is a bug."""
    rank = _rank(rank_env)
    text = str(err).strip()
    first = text.splitlines()[0][:300] if text else ""
    if "DataLoader worker" in text and ("killed by signal" in text or "exited unexpectedly"
                                        in text):
        print(f"error: {rank}: a DataLoader worker of this rank died ({first}); a "
              f"worker killed by signal 9 (Killed) is most often the kernel's out-of-memory "
              f"killer: lower --num-workers or --batch-size, or ask for more memory",
              file=sys.stderr, flush=True)
        return 1
    traceback.print_exception(err)
    print(f"error: {rank}: the run stopped on an unexpected {err.__class__.__name__} "
          f"({first}): the traceback above shows where", file=sys.stderr, flush=True)
    return 1


# --------------------------------------------------------------------------------------------
# The checkpoint dir belongs to one run
# --------------------------------------------------------------------------------------------


#: The lock file of a checkpoint dir: "<host> <pid>" of the run that writes there.
LOCK_FILE = ".lock"


LOCK_REFRESH_S = 10  # the holder touches the lock this often ...


LOCK_STALE_S = 60    # ... so one untouched this long belongs to a run that is gone


_held_lock: Path | None = None


#: What a lock holds: "<host> <pid>", printable ASCII.
_LOCK_RE = re.compile(r"([!-~]{1,255}) (\d{1,10})")


def _lock_holder(path: Path, wait_for_writer: bool = True) -> tuple:
    """(who, alive) for an existing lock: alive while it is refreshed and, on this host, its
    process exists (a killed holder's lock is taken over at once, another host's after
    LOCK_STALE_S). A lock that names no process (empty, or not "<host> <pid>": a crash or
    another program wrote it) is stale at once; who is then None, and its bytes are never
    printed. A fresh empty lock may be a holder between creating it and writing its line:
    it gets a second look a moment later."""
    try:
        text = path.read_bytes().decode("ascii", errors="replace").strip()
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "", False
    m = _LOCK_RE.fullmatch(text)
    if not m:
        if not text and age < 1 and wait_for_writer:
            time.sleep(1)
            return _lock_holder(path, wait_for_writer=False)
        return None, False
    host, pid = m.groups()
    alive = age < LOCK_STALE_S
    if alive and host == platform.node():
        alive = process_exists(int(pid))
    return f"host {host}, pid {pid}", alive


def process_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        pass
    return True


def _refresh_lock(path: Path, me: str) -> None:
    while _held_lock == path:
        try:
            if path.read_text().strip() != me:
                return  # taken over (this process was stopped for minutes): stop touching it
            os.utime(path)
        except FileNotFoundError:
            return
        except OSError:
            pass  # a passing file-system error (NFS): try again at the next refresh
        time.sleep(LOCK_REFRESH_S)


def lock_checkpoint_dir(directory) -> None:
    """Claim ``directory`` for this run (rank 0 calls it), so that two runs never write and
    resume from the same checkpoints: one whose predecessor still runs (an orphaned worker, a
    job started twice) stops here. A thread refreshes the lock; end_process removes it."""
    global _held_lock
    path = Path(directory) / LOCK_FILE
    me = f"{platform.node()} {os.getpid()}"
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            who, alive = _lock_holder(path)
            if alive:
                raise UsageError(f"--checkpoint-dir {directory} is in use by another run "
                                 f"({who}): wait for it to end or stop it, or choose another "
                                 f"--checkpoint-dir") from None
            if who is None:
                print(f"note: taking over the lock of {directory}: its {LOCK_FILE} names no "
                      f"process (empty or damaged)", flush=True)
            elif who:
                print(f"note: taking over the lock of {directory} from a run that is gone "
                      f"({who})", flush=True)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me + "\n")
        _held_lock = path
        threading.Thread(target=_refresh_lock, args=(path, me), daemon=True).start()
        return
    raise UsageError(f"could not lock --checkpoint-dir {directory}: another run keeps taking "
                     f"it; choose another --checkpoint-dir")


def release_checkpoint_lock() -> None:
    global _held_lock
    path, _held_lock = _held_lock, None
    try:
        if path is not None and path.read_text().strip().partition(" ")[2] == str(os.getpid()):
            path.unlink()
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# The exit
# --------------------------------------------------------------------------------------------


def end_process(code: int) -> None:
    """Exit with ``code`` without the interpreter's teardown: the checkpoint dir's lock is
    released, DataLoader workers and other child processes are stopped first, stdio is
    flushed. Some torch releases (2.15 on CPU/gloo) can abort in a C++ destructor during
    teardown ("terminate called without an active exception", SIGABRT) after the process
    group is destroyed, turning a finished run into a failed job."""
    release_checkpoint_lock()
    # A signal handler can be set only from the main thread; end_process also runs in the
    # thread that watches the stop signals (a SIGTERM during start-up), which skips this.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the DataLoader's would raise below
    for child in multiprocessing.active_children():
        child.kill()  # the run is over; a loader worker ignores SIGTERM (_child_signals)
        child.join(5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
