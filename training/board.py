"""--tensorboard: rank 0 writes the run's curves where TensorBoard reads them. The other ranks
write nothing.

- every --tensorboard-every seconds (at most; never a host sync per step just for the log):
  the step's training loss, the learning rate, images/s since the last point and the share of
  the epoch so far spent waiting for data (``step/...``);
- every epoch: the figures of the [METRIC] line, the same values (``epoch/...``);
- at the start the run's configuration as text, at the end its hyperparameters with the final
  metrics (TensorBoard's HPARAMS tab compares runs);
- with --profile, the trace, where TensorBoard's profiler plugin looks for it.

The x axis is the optimizer step over the whole run (epoch x steps per epoch + step), so a run
resumed from a checkpoint continues its curves in the same directory: TensorBoard drops the
points a killed run wrote after the checkpoint it resumes from (``purge_step``). A fresh start
(--resume never, or no checkpoint yet) in a directory that holds an earlier run's curves first
moves them into ``superseded-<time>-*/`` inside it, so the two never mix into one curve with
steps twice and backwards, and the old run stays readable as a run of its own.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from training.distributed import rank_and_world
from training.faults import UsageError, make_folder

#: The value of --tensorboard when a launcher set $RUN_DIR and the user said nothing: on, in
#: $RUN_DIR/tensorboard, unless the tensorboard package is missing (then a note, and off).
UNDER_LAUNCHER = "launcher-default"
OFF = "off"
EPOCH_KEYS = ("train_loss", "val_loss", "train_acc", "val_acc", "throughput_img_s",
              "epoch_time_s", "data_wait_frac", "peak_mem_mib", "rank_spread")
HPARAM_KEYS = ("strategy", "model", "dataset", "world_size", "nodes", "gpus_per_node",
               "per_gpu_batch", "global_batch", "amp", "image_size", "lr_peak", "lr_scaling",
               "epochs")


def default_flag() -> str | None:
    """--tensorboard's default: on under the launchers (they export $RUN_DIR), else off."""
    return UNDER_LAUNCHER if os.environ.get("RUN_DIR") else None


def available() -> bool:
    """Whether the tensorboard package (which torch.utils.tensorboard needs) is installed."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def check_flags(args) -> None:
    """Before anything runs (flags.check_flags): --tensorboard asked for while the package is
    missing is a one-line error, exit 2. (The launchers' default turns itself off with a note
    instead: Board.)"""
    if args.tensorboard not in (None, OFF, UNDER_LAUNCHER) and not available():
        raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard "
                         "(requirements.txt has it), or drop --tensorboard")
    if not args.tensorboard_every >= 0:
        raise UsageError(f"--tensorboard-every is in seconds, 0 (a point every step) or more, "
                         f"got {args.tensorboard_every:g}")


@dataclass(frozen=True)
class Settings:
    """What Board uses of the flags: ``tensorboard`` (--tensorboard: a DIR, "auto", the
    launchers' default, "off" or None), ``every`` (--tensorboard-every, in seconds),
    ``profile`` (--profile's DIR, whose trace goes beside the curves), ``checkpoint_dir``
    (--checkpoint-dir, whose name names the default folder) and ``flags``."""
    tensorboard: str | None
    every: float
    profile: str | None
    checkpoint_dir: str | None
    # All the flags, as plain values: the run's configuration table shows every one of them.
    flags: dict

    @classmethod
    def of(cls, args) -> "Settings":
        """The section of the resolved flags that TensorBoard uses."""
        return cls(args.tensorboard, args.tensorboard_every, args.profile, args.checkpoint_dir,
                   dict(vars(args)))


def log_dir(settings: Settings, strategy: str, nodes: int, gpus_per_node: int) -> Path:
    """Where this run writes: the flag's DIR; under the launchers $RUN_DIR/tensorboard; else
    runs/tensorboard/<strategy>-<nodes>n<gpus>g-<the --checkpoint-dir's name, so that a resumed
    run finds its curves again, or the time>."""
    if settings.tensorboard not in ("auto", UNDER_LAUNCHER):
        return Path(settings.tensorboard)
    if os.environ.get("RUN_DIR"):
        return Path(os.environ["RUN_DIR"]) / "tensorboard"
    name = (Path(settings.checkpoint_dir).resolve().name if settings.checkpoint_dir
            else f"{datetime.now():%Y%m%d-%H%M%S}")
    return Path("runs/tensorboard") / f"{strategy}-{nodes}n{gpus_per_node}g-{name}"


def view_dir(path: Path, under_launcher: bool) -> Path:
    """The folder to give `tensorboard --logdir` so that this run gets a name: TensorBoard names
    each run by its folder below the logdir, and the logdir's own files become the run ".".
    Under the launchers the runs directory, where the run is <job>/tensorboard beside the
    other jobs; else the folder above the run's."""
    if under_launcher:
        return path.parent.parent
    return path.parent if path.name else path.resolve().parent


def set_aside_curves(path: Path) -> Path | None:
    """Move the training's event files (and --profile's trace) in ``path`` into
    ``path/superseded-<time>-*/``; return that folder, or None when there were none. The memory
    scalars of analyze_memory.py --tensorboard (``*.system``) stay: they are rewritten for every
    attempt of the run directory at once."""
    old = [p for p in path.glob("events.out.tfevents.*") if not p.name.endswith(".system")]
    old += list(path.glob("*.pt.trace.json"))
    if not old:
        return None
    aside = Path(tempfile.mkdtemp(prefix=f"superseded-{datetime.now():%Y%m%d-%H%M%S}-",
                                  dir=path))
    for p in old:
        os.replace(p, aside / p.name)
    return aside


class Board:
    """Rank 0's TensorBoard writer for one run (a no-op on the other ranks and without
    --tensorboard). ``settings``: its Settings; ``start_global_step``: the global step the run
    starts at (a resumed run's, counted over all epochs). A context manager: ``with
    Board(...) as tb:`` closes the files however the run ends (finished, stopped for a
    requeue, failed)."""

    def __init__(self, settings: Settings, run_info: dict, steps: int, start_global_step: int):
        self.writer, self.steps = None, steps
        if rank_and_world()[0] != 0 or settings.tensorboard in (None, OFF):
            return
        if not available():  # only the launchers' default gets here without it
            print("note: the tensorboard package is not installed, so this run writes no "
                  "TensorBoard curves (pip install tensorboard; --tensorboard off hides this "
                  "note)", flush=True)
            return
        # imported here: the tensorboard package it needs is optional (available() checked)
        from torch.utils.tensorboard import SummaryWriter
        self.path = log_dir(settings, run_info["strategy"], run_info["nodes"],
                            run_info["gpus_per_node"])
        make_folder(self.path, "--tensorboard")
        aside = None if start_global_step else set_aside_curves(self.path)
        if aside:
            print(f"note: a fresh start: moved the earlier run's TensorBoard curves in "
                  f"{self.path} to {aside} (TensorBoard shows it as a run of its own)",
                  flush=True)
        # purge_step: TensorBoard hides what a killed run wrote after its checkpoint, from the
        # first step this run takes on (the checkpoint's own step, an epoch's end, stays)
        self.writer = SummaryWriter(str(self.path), purge_step=start_global_step + 1
                                    if start_global_step else None)
        self.every, self.profile = settings.every, settings.profile
        self.images_per_step = run_info["global_batch"]
        self.last = None  # (time, global step) of the last point
        rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(settings.flags.items()))
        self.writer.add_text("config", "| flag | value |\n|---|---|\n" + rows, start_global_step)
        print(f"tensorboard: writing to {self.path} (view: tensorboard --logdir "
              f"{view_dir(self.path, settings.tensorboard == UNDER_LAUNCHER)})", flush=True)

    def step(self, epoch: int, done: int, loss, optimizer, meter) -> None:
        """After a training step (``done`` steps of ``epoch`` taken): a point, if
        --tensorboard-every seconds have passed since the last one. Reads the loss (one host
        sync) only then."""
        if self.writer is None:
            return
        now, step = time.perf_counter(), epoch * self.steps + done
        if self.last is not None and now - self.last[0] < self.every:
            return
        w = self.writer
        w.add_scalar("step/train_loss", loss.item(), step)
        w.add_scalar("step/lr", optimizer.param_groups[0]["lr"], step)
        if self.last is not None and self.last[1] < step and now > self.last[0]:
            rate = (step - self.last[1]) * self.images_per_step / (now - self.last[0])
            w.add_scalar("step/throughput_img_s", rate, step)
        elapsed = now - meter.epoch_start
        if elapsed > 0:
            w.add_scalar("step/data_wait_frac", min(1.0, meter.data_wait_s / elapsed), step)
        self.last = (now, step)

    def epoch(self, metrics: dict) -> None:
        """The epoch's [METRIC] figures, at the global step the epoch ends on."""
        if self.writer is None:
            return
        step = metrics["epoch"] * self.steps
        for key in EPOCH_KEYS:
            self.writer.add_scalar(f"epoch/{key}", metrics[key], step)
        for gpu, peak in enumerate(metrics["peak_mem_per_gpu_mib"]):
            self.writer.add_scalar(f"epoch/peak_mem_mib_gpu{gpu}", peak, step)
        self.writer.flush()
        self.last = None  # the next epoch's first point starts the images/s clock again

    def finish(self, metrics: dict) -> None:
        """The hyperparameters with the final metrics (the HPARAMS tab), --profile's trace
        beside the curves, and the files closed."""
        if self.writer is None:
            return
        if metrics:
            from torch.utils.tensorboard.summary import hparams  # optional, as in __init__
            config = {k: metrics[k] for k in HPARAM_KEYS if k in metrics}
            final = {f"epoch/{k}": metrics[k] for k in ("val_acc", "val_loss",
                                                        "throughput_img_s", "peak_mem_mib")}
            for summary in hparams(config, final):  # in this run's own directory
                self.writer.file_writer.add_summary(summary)
        trace = Path(self.profile or ".") / "profile_trace_rank0.json"
        if self.profile is not None and trace.is_file():
            # TensorBoard's PyTorch profiler plugin reads <run>/<worker>.pt.trace.json
            shutil.copyfile(trace, self.path / f"{socket.gethostname()}.pt.trace.json")
        self.close()

    def __enter__(self) -> "Board":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Everything written reaches the disk (a run stopped for requeue, too)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
