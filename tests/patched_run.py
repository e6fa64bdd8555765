"""Run a training script with one test patch applied: for behaviour a test must provoke inside
a real run (a NaN on one rank only) or observe from inside it (the augmentation each rank
draws). Tests only; the scripts themselves carry no hooks.

    torchrun --nproc-per-node 2 tests/patched_run.py PATCH OUT_DIR ddp_train.py ARGS...

PATCH is one of the functions below; OUT_DIR is where a patch writes what it observed.
"""

from __future__ import annotations

import io
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from training import datasets, loading  # noqa: E402  (the modules the script will import too)
from training import lossguard, stopping  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def nan_on_rank1(out: Path) -> None:
    """Rank 1 alone records a non-finite loss at step index 2 (its gradients stay finite, so
    the other ranks see nothing wrong): only a vote can stop every rank together."""
    real = lossguard.LossWatch.track

    def track(self, loss, step):
        if RANK == 1 and step == 2:
            loss = torch.full_like(loss, float("nan"))
        real(self, loss, step)
    lossguard.LossWatch.track = track


def record_augment(out: Path) -> None:
    """The first training batch's device augmentation, applied to one fixed canary batch:
    saved per rank, so a test compares the crops and flips that the ranks drew."""
    real = datasets.DeviceAugment.__call__
    done = []

    def call(self, images, train):
        if train and not done:
            done.append(True)
            canary = torch.arange(8 * 64 * 64 * 3, dtype=torch.int64).remainder(251)
            canary = canary.to(torch.uint8).view(8, 64, 64, 3).to(images.device)
            torch.save(real(self, canary, True).cpu(), out / f"augment-rank{RANK}.pt")
        return real(self, images, train)
    datasets.DeviceAugment.__call__ = call


def record_worker_seed(out: Path) -> None:
    """The seed of each DataLoader worker that reads training images (folder path)."""
    real = datasets.ImageList.__getitem__

    def getitem(self, index):
        mark = out / f"worker-rank{RANK}-pid{os.getpid()}.txt"
        if self.augment_seed is not None and not mark.exists():  # training images
            mark.write_text(str(torch.initial_seed()))
        return real(self, index)
    datasets.ImageList.__getitem__ = getitem


def slow_loader(out: Path) -> None:
    """Every synthetic sample takes $SLOW_SAMPLE_S seconds (default 0.005) to make: a loader
    too slow for its model."""
    import time
    real = datasets.SyntheticImages.__getitem__
    delay = float(os.environ.get("SLOW_SAMPLE_S", "0.005"))

    def getitem(self, index):
        time.sleep(delay)
        return real(self, index)
    datasets.SyntheticImages.__getitem__ = getitem


def record_lr(out: Path) -> None:
    """The learning rate of every optimizer step, one line each, per rank."""
    real = torch.optim.SGD.step

    def step(self, *args, **kwargs):
        with open(out / f"lr-rank{RANK}.txt", "a") as f:
            f.write(f"{self.param_groups[0]['lr']!r}\n")
        return real(self, *args, **kwargs)
    torch.optim.SGD.step = step


def usr1_at_an_epochs_last_step(out: Path) -> None:
    """SIGUSR1 arrives as the last step of epoch $STOP_EPOCH (0-based, default 0) ends; one
    process, so the step sees it at once."""
    import signal
    real = stopping.StopRequest.at_step
    stop_epoch = int(os.environ.get("STOP_EPOCH", "0"))

    def at_step(self, epoch, done, steps):
        if epoch == stop_epoch and done == steps:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real(self, epoch, done, steps)
    stopping.StopRequest.at_step = at_step


def bug_at_step_3(out: Path) -> None:
    """A bug: the main process raises a plain ValueError at the fourth training step, while
    its DataLoader workers are alive."""
    real = lossguard.LossWatch.track

    def track(self, loss, step):
        if step == 3:
            raise ValueError("a bug planted by the test")
        real(self, loss, step)
    lossguard.LossWatch.track = track


def record_buffer_sync(out: Path) -> None:
    """Each rank writes whether its DDP broadcasts the BatchNorm buffers before every forward."""
    ddp = torch.nn.parallel.DistributedDataParallel
    real = ddp.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        (out / f"buffer-sync-rank{RANK}.txt").write_text(str(self.will_sync_module_buffers()))
    ddp.__init__ = init


def record_grad_storage(out: Path) -> None:
    """Where the first parameter's gradient lives: as backward accumulates into it (its
    post-accumulate hook) and as the optimizer reads it (DDP has made it a bucket view by
    then), one line per step."""
    ddp = torch.nn.parallel.DistributedDataParallel
    real = ddp.__init__

    def init(self, module, *args, **kwargs):
        real(self, module, *args, **kwargs)
        first = next(module.parameters())
        log = out / f"grad-storage-rank{RANK}.txt"

        def note(event):
            with log.open("a") as f:
                f.write(f"{event} {first.grad.data_ptr()}\n")
        first.register_post_accumulate_grad_hook(lambda p: note("accumulated"))
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        register_optimizer_step_pre_hook(lambda *a: note("stepped"))
    ddp.__init__ = init


def slow_cache_build(out: Path) -> None:
    """Each node's cache builder takes 5 s longer than it does (a first build of the whole
    TinyImageNet takes minutes): more than the test's --dist-timeout 3."""
    from training import tinyimagenet
    real = tinyimagenet.prepare

    def prepare(*args, **kwargs):
        time.sleep(5)
        return real(*args, **kwargs)
    tinyimagenet.prepare = prepare


def rank1_skips_an_all_reduce(out: Path) -> None:
    """Rank 1 skips the first epoch's reduction of its metrics (distributed.all_reduce), a
    collective that every rank must call."""
    from training import distributed
    real, skipped = distributed.all_reduce, []

    def all_reduce(tensor, *args, **kwargs):
        if RANK == 1 and not skipped:
            skipped.append(True)
            return tensor
        return real(tensor, *args, **kwargs)
    distributed.all_reduce = all_reduce


def rank0_saves_alone(out: Path) -> None:
    """Rank 0 runs a collective of its own while it writes a checkpoint (a rank-0-only code
    path that synchronises): the other ranks are not there."""
    import torch.distributed as dist
    from training import checkpoint
    real = checkpoint.atomic_save

    def atomic_save(obj, path):
        dist.all_reduce(torch.zeros(3))
        return real(obj, path)
    checkpoint.atomic_save = atomic_save


def rank1_one_batch_fewer(out: Path) -> None:
    """Rank 1's sampler yields $FEWER_SAMPLES (default 16, one batch) fewer training samples
    than the others': one step fewer in the epoch."""
    real = loading.SkipFirst.__iter__
    fewer = int(os.environ.get("FEWER_SAMPLES", "16"))

    def samples(self):
        indices = list(real(self))
        return iter(indices[:len(indices) - fewer] if RANK == 1 else indices)
    loading.SkipFirst.__iter__ = samples


def nan_in_rank1s_second_evaluation(out: Path) -> None:
    """Rank 1's validation sums of epoch 2 hold a NaN loss (its training stays finite): the
    reduced validation loss is NaN on every rank."""
    from training import common
    real, calls = common.evaluate, []

    def evaluate(*args, **kwargs):
        sums = real(*args, **kwargs)
        calls.append(True)
        if RANK == 1 and len(calls) == 2:
            sums[0] = float("nan")
        return sums
    common.evaluate = evaluate


def meta_pt_unreadable_on_rank1(out: Path) -> None:
    """Rank 1 alone cannot read an FSDP checkpoint's meta.pt (an I/O error on its node): the
    ranks must still meet in the same collectives."""
    import errno
    real = torch.load

    def load(f, *args, **kwargs):
        if RANK == 1 and str(f).endswith("meta.pt"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(f))
        return real(f, *args, **kwargs)
    torch.load = load


def ctrl_c_in_the_first_save(out: Path) -> None:
    """A Ctrl-C (SIGINT to this process) as the first checkpoint's torch.save begins."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        # a file: the checkpoint (the RNG states' gather also calls torch.save, into memory)
        if isinstance(f, io.BufferedWriter) and not (out / "ctrl_c_sent").exists():
            (out / "ctrl_c_sent").write_text("")
            # to this thread (the main one): handled at the next bytecode, here. A signal to
            # the process may reach another thread, and its handler run only after the save
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        return real(obj, f, *args, **kwargs)
    torch.save = save


def old_torch(out: Path) -> None:
    """torch says it is 2.5.1, older than the floor in requirements.txt."""
    torch.__version__ = "2.5.1"


if __name__ == "__main__":
    patch, out, script, *args = sys.argv[1:]
    globals()[patch](Path(out))
    sys.argv = [str(REPO / script), *args]
    runpy.run_path(str(REPO / script), run_name="__main__")
