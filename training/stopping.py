"""Stopping cleanly for a requeue: SIGUSR1 (Slurm's warning before the time limit) and
SIGTERM (preemption) become a checkpoint at the same step on every rank, then exit code
contract.REQUEUE_EXIT, which launch/job.sh requeues.

- ``catch_stop_signals``: common.run() catches both signals from the first line, so that none
  is lost; ``StopSignals`` holds the last one received;
- ``ignore_stop_signals``: DataLoader workers and helpers live on while their rank saves;
- ``StopRequest``: the training loop asks it after every step and at each epoch's end; the
  ranks vote, so they all stop after the same step;
- ``Requeue``: the exception the loop raises to stop (``raise stop.requeue(saved)``);
  common.run() prints its report and returns REQUEUE_EXIT.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from training.contract import REQUEUE_EXIT, STOP_LINE
from training.distributed import rank_and_world
from training.faults import end_process


# --------------------------------------------------------------------------------------------
# The signals, caught from the start
# --------------------------------------------------------------------------------------------


STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopSignals:
    """SIGUSR1 (Slurm's warning before the time limit) and SIGTERM (preemption), caught from
    the first line of main(). Once training runs, StopRequest turns them into a checkpoint and
    REQUEUE_EXIT; before that a SIGTERM ends the process at once, saying so."""
    signum = 0          # the last stop signal received
    training = False    # set by StopRequest: from now on a signal is handled at a step
    installed = False


def ignore_stop_signals(worker_id=None) -> None:
    """Slurm and torchrun send SIGTERM (and job.sh SIGUSR1) to every process of the job, the
    DataLoader workers too: those must live on while their rank saves its stop checkpoint.
    Also a DataLoader worker_init_fn, because torch installs its own SIGTERM handler there.
    As a worker ignores SIGTERM, it asks the kernel for a SIGKILL when its parent dies, so it
    never outlives a rank that was killed or crashed."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if worker_id is not None:
        die_with_parent()


def die_with_parent() -> None:
    """Linux's PR_SET_PDEATHSIG: this process gets SIGKILL when the thread that forked it
    ends (the rank's main thread, which starts the DataLoader workers). Elsewhere a no-op:
    the loader's own check of its parent ends the worker within seconds."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request: nobody would send it
        os.kill(os.getpid(), signal.SIGKILL)


_MASKS_BEFORE_FORK: dict = {}  # thread id: that thread's signal mask before its fork


def _block_stop_signals() -> None:
    """Before a fork, in the thread that forks: a child starts with the stop signals blocked,
    so that one sent to it before it lets go of the rank's wakeup pipe (_child_signals) is
    not written into that pipe and taken for the rank's own. The rank's other threads still
    take a stop signal sent to the rank meanwhile."""
    _MASKS_BEFORE_FORK[threading.get_ident()] = signal.pthread_sigmask(signal.SIG_BLOCK,
                                                                       STOP_SIGNALS)


def _restore_signal_mask() -> None:
    """After the fork, in the parent and in the child: the mask the thread had before."""
    mask = _MASKS_BEFORE_FORK.pop(threading.get_ident(), None)
    if mask is None:  # not blocked by _block_stop_signals
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    else:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _child_signals() -> None:
    """In every forked child (DataLoader and cache workers; also a subprocess started with a
    preexec_fn, which then runs its program with these signals ignored): no wakeup pipe (its
    signals are not the run's), and the stop signals ignored, so that one sent since the fork
    is dropped once they are unblocked; a DataLoader worker ends with its rank instead.
    Ctrl-C gets Python's own handler back: holding it and ending the process after a grace
    are the rank's."""
    signal.set_wakeup_fd(-1)
    ignore_stop_signals()
    if signal.getsignal(signal.SIGINT) is _on_ctrl_c:  # the rank's; a loader worker's own
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _restore_signal_mask()


def _watch_signals(read_end: int) -> None:
    while True:
        for signum in os.read(read_end, 64):
            if signum not in STOP_SIGNALS:
                continue
            StopSignals.signum = signum
            if signum == signal.SIGTERM and not StopSignals.training:
                if rank_and_world()[0] == 0:
                    print("SIGTERM during start-up, before the first training step: stopping "
                          "now (nothing to checkpoint yet)", file=sys.stderr, flush=True)
                end_process(128 + signum)


class CtrlC:
    """Ctrl-C (SIGINT) raises KeyboardInterrupt between two bytecodes of the main thread,
    wherever it is: inside torch.save it left a RuntimeError traceback from the zip writer
    ("unexpected pos") instead of the one sentence. ``holding_ctrl_c`` sections hold it back
    until they end; a second Ctrl-C does not wait (a save stuck in a collective)."""
    held = 0          # depth of the holding_ctrl_c sections the main thread is in
    pending = False   # a Ctrl-C came inside one
    raised = False    # its KeyboardInterrupt is on its way up


#: Seconds a process may take to end once Ctrl-C's KeyboardInterrupt is raised; then it is ended.
CTRL_C_GRACE_S = 10


def _on_ctrl_c(signum, frame) -> None:
    if CtrlC.held and not CtrlC.pending:
        CtrlC.pending = True
        if rank_and_world()[0] == 0:  # os.write: a print here could re-enter one in progress
            os.write(2, b"Ctrl-C: stopping once the checkpoint being written is complete "
                        b"(Ctrl-C again to stop at once)\n")
        return
    _interrupt()


def _interrupt() -> None:
    """Raise Ctrl-C's KeyboardInterrupt, and see that the process ends. On its way up it runs
    every ``finally`` and ``with`` exit it passes, and one that waits on something the
    interrupt left half done kept a worker silent after a Ctrl-C at an epoch's end until
    torchrun's SIGKILL 30 s later, without its sentence (once, in a launcher test)."""
    if not CtrlC.raised:
        CtrlC.raised = True
        threading.Thread(target=_end_after_grace, daemon=True).start()
    raise KeyboardInterrupt


def _end_after_grace() -> None:
    time.sleep(CTRL_C_GRACE_S)
    main = sys._current_frames().get(threading.main_thread().ident)
    where = "".join(traceback.format_stack(main)) if main is not None else ""
    os.write(2, f"error: interrupted (Ctrl-C), and rank {rank_and_world()[0]} was still "
                f"running {CTRL_C_GRACE_S} s later: ending it now; its main thread was "
                f"here:\n{where}".encode())
    end_process(130)


@contextlib.contextmanager
def holding_ctrl_c():
    """Within this section (a checkpoint being written), a Ctrl-C waits for its end."""
    CtrlC.held += 1
    try:
        yield
    finally:
        CtrlC.held -= 1
    if not CtrlC.held and CtrlC.pending:  # the section ended normally: now the Ctrl-C
        CtrlC.pending = False
        _interrupt()


def catch_stop_signals() -> None:
    """Python runs a signal handler in the main thread only, between two bytecodes: a main
    thread blocked in the process-group start or a collective would hold a SIGTERM back for
    up to --dist-timeout. So the handler does nothing, and the signal's number reaches a
    thread at once through the wakeup pipe (signal.set_wakeup_fd), which acts on it."""
    if StopSignals.installed:
        return
    StopSignals.installed = True
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: None)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored
        signal.signal(signal.SIGINT, _on_ctrl_c)
    os.register_at_fork(before=_block_stop_signals, after_in_parent=_restore_signal_mask,
                        after_in_child=_child_signals)
    threading.Thread(target=_watch_signals, args=(read_end,), daemon=True).start()


# --------------------------------------------------------------------------------------------
# Stop at the same step on every rank
# --------------------------------------------------------------------------------------------


class StopRequest:
    """SIGUSR1 (Slurm's warning before the time limit) or SIGTERM (preemption) asks the run to
    checkpoint at the next step boundary and exit with REQUEUE_EXIT. The signals are caught
    from the start (catch_stop_signals); a USR1 that came during start-up counts here.

    Ranks receive the signal at slightly different times, or only some of them do, so they
    vote: every step each rank contributes the number of the signal it got (0: none) to an
    all-reduce (MAX) on a CPU (gloo) group, started without waiting; the result is read one
    step later, when it has long arrived. All ranks therefore stop after the same step, name
    the same signal, and no GPU sync is added to the step.
    """

    def __init__(self, timeout_s: int | None = None):
        self.signum = 0  # agreed by the vote
        self.where = (1, 0)  # (epoch, step) of the last at_step or at_epoch_end, 1-based epoch
        self._buf = torch.zeros(1, dtype=torch.int32)
        self._work = None
        self._group = None
        if rank_and_world()[1] > 1:  # a gloo group for the vote,
            # whatever the training backend; it waits as long as the run's collectives
            # (--dist-timeout), not gloo's default of 30 minutes
            self._group = dist.new_group(backend="gloo", timeout=None if timeout_s is None
                                         else timedelta(seconds=timeout_s),
                                         group_desc="stop_vote")
        StopSignals.training = True

    @property
    def signame(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "stop request"

    def at_step(self, epoch: int, done: int, steps: int) -> bool:
        """Every rank, after step ``done`` (1-based) of ``steps`` of ``epoch``: True on every
        rank at the same step when a stop signal came. A signal at the epoch's last step waits
        for at_epoch_end, after the epoch's metrics: a checkpoint taken here would resume into
        an epoch with no step left to run."""
        self.where = (epoch + 1, done)
        return done < steps and self.should_stop()

    def at_epoch_end(self, epoch: int, epochs: int) -> bool:
        """Every rank, after ``epoch``'s metrics: True when a stop signal came by its end and
        more epochs were to come (after the last epoch the run just ends, its work done)."""
        self.where = (epoch + 2, 0)
        return epoch + 1 < epochs and self.should_stop()

    def report(self, saved: bool) -> str:
        """What rank 0 prints as the run stops: a sentence, then the [STOP] line for job.sh."""
        epoch, step = self.where
        code = self.exit_code(saved)
        if saved:
            text = (f"{self.signame}: checkpoint saved at epoch {epoch}, step {step}; exiting "
                    f"with code {code} to be requeued")
        else:
            text = (f"{self.signame}: stopping without a checkpoint (no --checkpoint-dir), so "
                    f"a requeue would start over; exiting with code {code}")
        return text + "\n" + STOP_LINE.format(signal=self.signame, epoch=epoch, step=step,
                                              saved=int(saved), code=code)

    def exit_code(self, saved: bool) -> int:
        """contract.REQUEUE_EXIT after a checkpoint (requeue it and it resumes); without one,
        the signal's own code, 128 + its number (as SIGTERM's 143 during start-up)."""
        return REQUEUE_EXIT if saved else 128 + (self.signum or signal.SIGTERM)

    def requeue(self, saved: bool) -> "Requeue":
        """The exception that ends the run here, to be requeued: ``raise stop.requeue(...)``.
        ``saved``: a checkpoint was just written (there is a --checkpoint-dir)."""
        return Requeue(self.report(saved), self.exit_code(saved))

    def should_stop(self) -> bool:
        """Call once per step on every rank; True on all ranks at the same step."""
        if self._group is None:
            self.signum = StopSignals.signum
            return bool(self.signum)
        if self._work is not None:
            self._work.wait()
            self.signum = int(self._buf.item())
        agreed = bool(self.signum)
        self._buf.fill_(StopSignals.signum)
        self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self._group,
                                     async_op=True)
        return agreed

    def finish(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


class Requeue(Exception):
    """The run stops here, to be requeued: common.run() prints the message (a sentence, then
    the [STOP] line for job.sh) on rank 0 and returns ``code`` (contract.REQUEUE_EXIT after a
    checkpoint). Every rank raises it at the same step (the vote of StopRequest)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code
