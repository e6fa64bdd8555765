"""What a run measures about itself: the figures of each epoch's [METRIC] line, the progress
line and the time spent waiting for data. Each answers a question a user asks of a running job:

- "how fast, how good, how much memory?": ``epoch_metrics``, from the sums reduced over ranks,
  and the peak memory of every GPU (``reset_peak_memory``, ``peak_memory_per_gpu``);
- "is my job alive, and when does it end?": ``StepMeter`` prints rank 0's progress line;
- "is the loader keeping up?": ``StepMeter.data_wait_s``, the epoch's ``data_wait_frac``.

Where a step's time goes (--profile) is profiling.py's; the bandwidth of the collectives
(--check, --profile) is bandwidth.py's.
"""

from __future__ import annotations

import math
import resource
import time

import torch
import torch.distributed as dist

from training import cudagraph
from training.contract import LATER_METRIC_KEYS, format_metric_line
from training.distributed import all_reduce, print0, rank_and_world

# --------------------------------------------------------------------------------------------
# The clock and the peak memory
# --------------------------------------------------------------------------------------------


def reset_peak_memory(*devices: torch.device, replays: bool = False) -> None:
    """Start a new peak on each device, so each epoch reports its own: the CUDA allocator's on a
    GPU, the peak RSS on a CPU (Linux: 5 into /proc/self/clear_refs; elsewhere the run's).
    ``replays``: the step is a torch.compile'd one that replays CUDA graphs, which allocate
    nothing, so the peak so far stays as the floor of the new one."""
    for device in devices:
        if device.type == "cuda":
            if replays:
                cudagraph.keep_peak(device)
            torch.cuda.reset_peak_memory_stats(device)
            continue
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory since ``reset_peak_memory``: CUDA ``max_memory_allocated`` on a GPU (at
    least the captured or recorded step's, with --cuda-graph or a --compile mode with CUDA
    graphs), else the peak RSS (VmHWM, or getrusage's whole-run figure where /proc is
    missing)."""
    if device.type == "cuda":
        return max(torch.cuda.max_memory_allocated(device) / 2**20,
                   cudagraph.captured_peak_mib.get(device.index, 0.0))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def peak_memory_per_gpu(devices: list) -> list:
    """The peak (MiB) of every GPU of the run, in rank order: this process's ``devices`` (DDP
    and FSDP: its one GPU; DataParallel: all of them), gathered from every rank."""
    local = torch.tensor([peak_memory_mib(d) for d in devices], dtype=torch.float64,
                         device=devices[0])
    world = rank_and_world()[1]
    if world == 1:
        return local.tolist()
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)  # collective: every rank's peaks
    return torch.cat(everyone).tolist()


def synchronize(*devices: torch.device) -> None:
    """Wait for the devices' queued work, so the clock measures work done, not work queued."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# The epoch's figures
# --------------------------------------------------------------------------------------------

def epoch_so_far(sums: torch.Tensor, t0: float, data_wait_s: float, devices: list,
                 earlier: dict | None) -> dict:
    """Collective (every rank), at a checkpoint inside an epoch: the epoch's training figures
    so far, which the checkpoint carries, so that the epoch resumed from it reports the whole
    epoch and not only the steps after the checkpoint (a fourth of the images, a fourth of the
    time: an outlier on every epoch chart). sums: this rank's [loss x n, correct, n]; t0: when
    this process began the epoch; data_wait_s: this rank's wait for its loader so far
    (StepMeter.data_wait_s); ``earlier``: what the checkpoint it resumed from carried."""
    synchronize(*devices)
    train = all_reduce(sums.clone()).tolist()
    times = torch.tensor([time.perf_counter() - t0, data_wait_s], device=sums.device,
                         dtype=torch.float64)
    train_time, data_wait = all_reduce(times, dist.ReduceOp.MAX).tolist()
    return with_earlier(dict(train_sums=train, train_time_s=train_time, data_wait_s=data_wait,
                             peaks=peak_memory_per_gpu(devices)), earlier)


def with_earlier(part: dict, earlier: dict | None) -> dict:
    """The figures of an epoch's ``part`` joined to those of its ``earlier`` steps (before the
    checkpoint it resumed from): sums and times add up, each GPU's peak is the larger (at
    another world size, this run's GPUs are other GPUs: only this run's peaks count)."""
    if not earlier:
        return part
    same_gpus = len(earlier["peaks"]) == len(part["peaks"])
    return dict(train_sums=[a + b for a, b in zip(earlier["train_sums"], part["train_sums"])],
                train_time_s=earlier["train_time_s"] + part["train_time_s"],
                data_wait_s=earlier["data_wait_s"] + part["data_wait_s"],
                peaks=[max(a, b) for a, b in zip(earlier["peaks"], part["peaks"])]
                if same_gpus else part["peaks"])


def earlier_images(earlier: dict | None) -> int:
    """The training images of an epoch's steps before the checkpoint it resumed from."""
    return int(earlier["train_sums"][2]) if earlier else 0


def epoch_metrics(totals: list, epoch_time: float, data_wait: float, peaks: list, t0: float,
                  train_time: float, earlier: dict | None = None) -> dict:
    """The measured keys of an epoch's [METRIC] line. totals: the six sums reduced over all
    ranks (train loss x n, correct, n, then the same for validation), so each average is a sum
    divided by a count, never a mean of the ranks' means; epoch_time: the slowest rank's
    training time, data_wait: the longest any rank's loader kept it waiting, both in s; peaks:
    MiB per GPU; t0, train_time: this rank's perf_counter() when training started, and how
    long it took. ``earlier``: the figures of the steps a resumed epoch ran before its
    checkpoint (epoch_so_far), joined in so that the line covers the whole epoch."""
    if earlier:
        whole = with_earlier(dict(train_sums=totals[:3], train_time_s=epoch_time,
                                  data_wait_s=data_wait, peaks=peaks), earlier)
        totals = whole["train_sums"] + totals[3:]
        epoch_time, data_wait, peaks = whole["train_time_s"], whole["data_wait_s"], \
            whole["peaks"]
    t_loss, t_correct, t_n, v_loss, v_correct, v_n = totals
    now, clock = time.perf_counter(), time.time()
    return dict(
        train_loss=t_loss / max(t_n, 1), train_acc=100.0 * t_correct / max(t_n, 1),
        val_loss=v_loss / max(v_n, 1), val_acc=100.0 * v_correct / max(v_n, 1),
        train_images=int(t_n), val_images=int(v_n), epoch_time_s=epoch_time,
        throughput_img_s=t_n / epoch_time if epoch_time > 0 else 0.0,
        peak_mem_mib=max(peaks), peak_mem_per_gpu_mib=peaks,
        data_wait_frac=min(1.0, data_wait / epoch_time) if epoch_time > 0 else 0.0,
        # when training and evaluation ran, in seconds since 1970 on this rank's clock: the
        # epochs on analyze_memory.py's timelines (evaluation ends now)
        train_start_unix=clock - (now - t0), eval_start_unix=clock - (now - t0 - train_time),
        eval_end_unix=clock)


def print_final(metrics: dict, total_time: float, trained: bool, run: dict,
                at: tuple = (0, 0)) -> None:
    """After the last epoch (rank 0 prints): the final [METRIC] line, the last epoch's metrics
    with final=1 and total_time_s (seconds since this process's first epoch began: training,
    evaluation, checkpoints), then the total time. A run resumed from a checkpoint already past
    --epochs trains nothing: it says so, and where the checkpoint is (``at``: the epoch it
    resumes, from 0, and the steps of it already run), and its final line repeats the
    checkpoint's last epoch with total_time_s=nan (nothing was timed), so that the study still
    sees the run end; where another strategy or world size (``run``: this run's run_info)
    trained it, it says which."""
    if not trained:
        epoch, step = at
        where = (f"(at epoch {epoch + 1}, step {step}, whose steps its weights hold but the "
                 f"final line below does not cover) is past" if step else
                 f"(after epoch {epoch}) has done")
        trainer = {k: metrics.get(k) for k in ("strategy", "world_size")}
        other = ("" if not metrics or trainer == {k: run[k] for k in trainer} else
                 f"; the final line below is its last epoch, which {trainer['strategy']} "
                 f"trained on {trainer['world_size']} process(es), not this {run['strategy']} "
                 f"run on {run['world_size']}")
        print0(f"nothing to train: the checkpoint {where} --epochs {run['epochs']} "
               f"already{other}")
    if metrics:
        total = total_time if trained else math.nan
        # a checkpoint written before a key was added to the line resumes without it: nan
        older = dict.fromkeys(LATER_METRIC_KEYS, math.nan)
        print0(format_metric_line(older | metrics | {"total_time_s": total}, final=True))
    if trained:
        print0(f"Total time: {total_time:.1f} s")


# --------------------------------------------------------------------------------------------
# Progress and data wait
# --------------------------------------------------------------------------------------------

def _clock(seconds: float) -> str:
    """A duration as a person reads it: 5:09, 1:05:09."""
    seconds = int(max(0.0, seconds))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class StepMeter:
    """The training batches of one epoch, metered: how long the host waited for each next
    batch (``data_wait_s``: the loader's share of the epoch), and rank 0's progress line after
    the first few steps and then every ``every`` seconds, which answers "is my job alive, and
    when does it end?". It reads only what the host knows (a step count, the clock): no host sync
    is added to the step. On a GPU the host runs a few steps ahead of the device, so the rate
    is that of queued steps; it converges to the real one from the second line on."""

    # An epoch's first line comes once its slow first steps are behind it, or after 10 s when
    # steps are slow (ResNet-50 on a CPU: 6 s a step): the user knows within seconds it runs.
    FIRST_AFTER, FIRST_WITHIN = 3, 10.0  # steps, seconds

    def __init__(self, every: float, epochs: int, steps: int, images_per_step: int):
        """``every``: --log-every, in seconds (0: no lines); ``epochs``: --epochs; ``steps``:
        an epoch's."""
        self.every, self.epochs, self.steps = every, epochs, steps
        self.images_per_step = images_per_step
        self.start = time.perf_counter()
        self.epoch_wall = 0.0  # one whole epoch (training, evaluation, saving), once known
        self.data_wait_s = 0.0

    def epoch(self, batches, epoch: int, start_step: int):
        """Yield ``batches``; ``start_step``: the steps a resumed epoch already ran."""
        now = time.perf_counter()
        if hasattr(self, "epoch_start"):
            self.epoch_wall = now - self.epoch_start
        self.epoch_start, self.data_wait_s = now, 0.0
        self.next_line = now + min(self.every, self.FIRST_WITHIN)
        it, done, first_line = iter(batches), start_step, True
        while True:
            t = time.perf_counter()
            batch = next(it, None)
            self.data_wait_s += time.perf_counter() - t  # host time blocked on the loader
            if batch is None:
                return
            if (first_line and done - start_step == self.FIRST_AFTER) or t >= self.next_line:
                self._line(epoch, done, start_step, t)
                first_line = False
            yield batch
            done += 1

    def _line(self, epoch: int, done: int, start_step: int, now: float) -> None:
        self.next_line = now + self.every
        if self.every <= 0 or done >= self.steps:
            return
        elapsed = now - self.epoch_start
        per_step = elapsed / max(1, done - start_step)
        eta_epoch = (self.steps - done) * per_step
        # the rest of the run: this epoch's steps and its evaluation (what a whole epoch took
        # beyond its steps, once one is known), then the remaining epochs
        evaluation = max(0.0, self.epoch_wall - self.steps * per_step)
        eta_run = eta_epoch + evaluation + (self.epochs - epoch - 1) * max(
            self.epoch_wall, self.steps * per_step)
        print0(f"progress: epoch {epoch + 1}/{self.epochs}, step {done}/{self.steps} | "
               f"{(done - start_step) * self.images_per_step / elapsed:.1f} img/s | elapsed "
               f"{_clock(now - self.start)} | ETA epoch {_clock(eta_epoch)}, run "
               f"{_clock(eta_run)}" + ("" if self.epoch_wall else " + evaluation"))
