"""The epoch loop's bookkeeping, written once for the three scripts: ``Run``. Each script keeps
its own loop, the strategy's step inside it, and calls the run in a few named places:

    with loop.Run(loop.Settings.of(args), info, steps, start, stop, ckpt, ...) as run:
        for epoch in run.epochs():
            train_sampler.set_epoch(epoch)
            for step, (images, labels) in run.batches(train_loader):
                outputs, loss = train_step(images, labels)
                run.step_done(step, loss, outputs, labels)  # sums, loss watch, TensorBoard
                scheduler.step()
                run.save_or_stop(step)  # a checkpoint when due; a stop signal ends the run
            run.end_training()  # the clock, every rank's times, the loss check
            val_sums = common.evaluate(...)
            run.end_epoch(val_sums)  # reduced metrics, the lines, the epoch's checkpoint
        run.finish()
        ...the script saves its model...
        run.final_report()

What the run does for them: rank 0's progress line and data wait (measure.StepMeter), the
--profile window (profiling.StepProfiler), the loss watch (lossguard), the straggler clock
(stragglers), the epoch's sums kept on the device and reduced over every rank at its end, the
epoch and [METRIC] lines, TensorBoard (board), the unreadable-image report, the checkpoint
cadence (checkpoint.Checkpoints decides it) and the stop for a requeue (stopping). Leaving
the ``with`` block closes the TensorBoard files however the run ends.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from training import (board, contract, cudagraph, distributed, loading, lossguard, measure,
                      profiling, stragglers)
from training.distributed import print0


def run_info(strategy: str, args, data, device: torch.device, world: int, nodes: int,
             gpus_per_node: int, lr: float) -> dict:
    """What every [METRIC] line of this run says about the run; each epoch adds its figures.
    ``world``: the GPUs (or processes) the global batch is split over; ``lr``: the peak."""
    return dict(strategy=strategy, model=args.model, dataset=data.name, device=device.type,
                world_size=world, nodes=nodes, gpus_per_node=gpus_per_node,
                per_gpu_batch=args.batch_size, global_batch=args.batch_size * world,
                amp=args.amp, image_size=data.input_shape[-1], epochs=args.epochs, lr_peak=lr,
                lr_scaling=args.lr_scaling, warmup_epochs=args.warmup_epochs)


@dataclass(frozen=True)
class Settings:
    """What the run's parts use of the resolved flags, each its own values: ``log_every``
    (--log-every s: the progress line), ``profile`` (--profile's DIR, or None: its window of
    steps), ``cuda_graph`` (--cuda-graph: the window starts after the capture; the straggler
    clock's hooks do not run in the replay), ``broadcast_buffers`` (DDP's --broadcast-buffers:
    the straggler clock times that broadcast), ``tensorboard``, TensorBoard's own section, and
    ``compiled_graphs`` (a --compile mode whose step replays CUDA graphs: the epochs' peaks keep
    the recorded step's)."""
    log_every: float
    profile: str | None
    cuda_graph: bool
    broadcast_buffers: bool
    tensorboard: board.Settings
    compiled_graphs: bool = False

    @classmethod
    def of(cls, args) -> "Settings":
        """The section of the resolved flags that the run's parts use."""
        # --broadcast-buffers is ddp_train.py's alone; the straggler clock reads it for a DDP
        # model only
        return cls(args.log_every, args.profile, args.cuda_graph,
                   getattr(args, "broadcast_buffers", False), board.Settings.of(args),
                   args.compile in cudagraph.COMPILE_GRAPH_MODES)


class Run:
    """One training run's epochs, from ``start`` (epoch, step: where the checkpoint left off)
    to --epochs, of ``steps`` steps each. ``settings``: its Settings; ``info``: run_info()
    (it reads the epochs and the global batch there); ``stop``: the stopping.StopRequest made
    before the resume; ``ckpt``: the run's checkpoint.Checkpoints; ``step_model``: the model
    the step runs (the straggler clock hooks into it); ``scaler``: the GradScaler (an fp16
    step it skipped is no NaN); ``device``: where this process keeps its sums; ``devices``:
    the GPUs it drives (DataParallel: all of them), for the syncs and the peak memory;
    ``data``: the datasets.DataBundle (its classes, its validation images)."""

    def __init__(self, settings: Settings, info: dict, steps: int, start: tuple, stop, ckpt,
                 step_model, optimizer, scaler, device: torch.device, devices: list, data):
        self.info, self.steps, self.stop, self.ckpt = info, steps, stop, ckpt
        self.compiled_graphs = settings.compiled_graphs
        self.epochs_begun = 0  # in this process: the first records the compiled graphs
        self.start_epoch, self.resume_step = start
        self.last_epoch = info["epochs"]
        self.optimizer, self.device, self.devices = optimizer, device, devices
        self.val_images = len(data.val)
        # NaN/inf and jumps of the loss: each step's loss noted on the device, no host sync
        self.losses = lossguard.LossWatch(device, scaler, data.num_classes, steps)
        # progress lines and data wait
        self.meter = measure.StepMeter(settings.log_every, self.last_epoch, steps,
                                       info["global_batch"])
        # --profile: a window of steps
        self.profiler = profiling.StepProfiler(settings.profile, settings.cuda_graph, steps,
                                               device)
        # each rank's own time and its waits for the others: which rank holds the others back
        self.rank_clock = stragglers.watch(step_model, optimizer, device, settings.cuda_graph,
                                           settings.broadcast_buffers)
        # --tensorboard, from the global step the run starts at
        self.tb = board.Board(settings.tensorboard, info, steps,
                              self.start_epoch * steps + self.resume_step)
        self.start = time.perf_counter()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.tb.close()  # however the run ends: finished, stopped for a requeue, failed

    def epochs(self):
        """Yield the index of each epoch left to run; before each, note the steps a resumed
        epoch already ran (``start_step``; 0 in every other epoch), their figures and the
        learning rate the epoch starts at."""
        for epoch in range(self.start_epoch, self.last_epoch):
            self.epoch = epoch
            self.start_step = self.resume_step if epoch == self.start_epoch else 0
            self.earlier = self.ckpt.earlier if epoch == self.start_epoch else None
            # at the epoch's first step: an epoch resumed mid-way has its optimizer at the
            # checkpoint's step, further up a warm-up; Checkpoints.resume says where it began
            mid_way = epoch == self.start_epoch and self.ckpt.epoch_lr is not None
            self.lr = self.ckpt.epoch_lr if mid_way else self.optimizer.param_groups[0]["lr"]
            yield epoch

    def batches(self, loader):
        """Yield (step, (images, labels)) of this epoch, on the device, from ``start_step``
        up to ``steps`` (--max-steps-per-epoch), after starting the epoch's clock."""
        # [loss x n, correct, n] of this process, kept on the device: no host sync per step
        self.sums = torch.zeros(3, device=self.device, dtype=torch.float64)
        # this epoch's peak, not the whole run's; after an epoch that recorded compiled CUDA
        # graphs, that epoch's peak is kept as the floor (not the peak before the first epoch:
        # the model's set-up)
        measure.reset_peak_memory(*self.devices,
                                  replays=self.compiled_graphs and self.epochs_begun > 0)
        self.epochs_begun += 1
        measure.synchronize(*self.devices)
        self.t0 = time.perf_counter()
        self.rank_clock.start_epoch()
        # islice: the loader is not asked for a batch past the last step (--max-steps-per-epoch
        # read one more, on the epoch's clock); to_device: on CUDA the next batch's copy
        # overlaps this step's compute; the meter adds up the time spent waiting for the loader
        batches = itertools.islice(loader, max(0, self.steps - self.start_step))
        batches = self.meter.epoch(loading.to_device(batches, self.device), self.epoch,
                                   self.start_step)
        batches = self.profiler.epoch(batches, self.start_step)
        yield from enumerate(batches, start=self.start_step)

    def step_done(self, step: int, loss, outputs, labels) -> None:
        """After the optimizer step, before the scheduler's: TensorBoard's loss and learning
        rate (every --tensorboard-every s), the epoch's sums and the loss watch, all on the
        device."""
        self.tb.step(self.epoch, step + 1, loss, self.optimizer, self.meter)
        # add_ on a view: one kernel each (``+=`` on an item would copy it back as well), and
        # alpha scales the loss in the sums' float64
        self.sums[0].add_(loss.detach(), alpha=labels.size(0))
        self.sums[1].add_((outputs.argmax(1) == labels).sum())
        self.sums[2].add_(labels.size(0))
        self.losses.track(loss, step)

    def save_or_stop(self, step: int) -> None:
        """After the scheduler's step: a checkpoint when one is due, and one before a stop for
        a requeue, which every rank takes after the same step (the stop's vote)."""
        stopping = self.stop.at_step(self.epoch, step + 1, self.steps)
        self.ckpt.save_if_due(self.epoch, step + 1, stopping, self._checked_so_far)
        if stopping:  # checkpointed (with a --checkpoint-dir): exit, to be requeued
            raise self.stop.requeue(saved=self.ckpt.enabled)

    def _checked_so_far(self) -> dict:
        """Right before a checkpoint inside the epoch: the losses checked (a host sync and a
        vote: no NaN reaches a checkpoint), then the epoch's figures so far (a collective)."""
        self.losses.check(self.epoch)
        return measure.epoch_so_far(self.sums, self.t0, self.meter.data_wait_s, self.devices,
                                    self.earlier)

    def end_training(self) -> None:
        """After the epoch's last step, before evaluation: the training time, every rank's
        times to rank 0 (a collective: slowest_rank and rank_spread) and the loss check (a
        host sync and a vote of all ranks, once per epoch)."""
        measure.synchronize(*self.devices)
        self.train_time = time.perf_counter() - self.t0
        self.slowest = self.rank_clock.end_epoch(self.epoch + 1, self.train_time,
                                                 self.meter.data_wait_s)
        self.losses.check(self.epoch)

    def end_epoch(self, val_sums: torch.Tensor) -> None:
        """After evaluation (``val_sums``: this process's [loss x n, correct, n]): the metrics
        reduced over every rank, the epoch and [METRIC] lines, the straggler and unreadable-
        image reports, TensorBoard's curves, the epoch's checkpoint, and a stop for a requeue
        when a signal came by now."""
        # Metric reduction, all ranks: sum of (loss x n, correct, n), then divide. The host
        # syncs here (each .tolist()) happen once per epoch, never per step. Without a process
        # group (DataParallel) all_reduce has nothing to reduce.
        totals = distributed.all_reduce(torch.cat([self.sums, val_sums])).tolist()
        # the slowest rank sets the pace; data wait: the rank its loader kept waiting longest
        times = torch.tensor([self.train_time, self.meter.data_wait_s], device=self.device,
                             dtype=torch.float64)
        epoch_time, data_wait = distributed.all_reduce(times, dist.ReduceOp.MAX).tolist()
        peaks = measure.peak_memory_per_gpu(self.devices)  # collective: every rank's GPU
        metrics = self.info | dict(epoch=self.epoch + 1, lr=self.lr) | measure.epoch_metrics(
            totals, epoch_time, data_wait, peaks, self.t0, self.train_time, self.earlier)
        metrics |= self.slowest
        print0(contract.format_epoch_line(metrics))
        print0(contract.format_metric_line(metrics))
        if (warning := lossguard.nonfinite_validation(metrics, self.info["amp"])) is not None:
            print0(warning)
        # rank 0 names a rank more than 10% slower than the median; [RANKS] has every rank's
        self.rank_clock.report()
        trained = (self.steps - self.start_step) * self.info["global_batch"]
        loading.report_unreadable_images(
            metrics, trained + measure.earlier_images(self.earlier), self.val_images)
        self.tb.epoch(metrics)  # the same figures as TensorBoard curves
        self.ckpt.end_epoch(self.epoch, metrics)  # the epoch's checkpoint, with its metrics
        if self.stop.at_epoch_end(self.epoch, self.last_epoch):  # a stop signal by its end
            raise self.stop.requeue(saved=self.ckpt.enabled)

    def finish(self) -> None:
        """After the last epoch: the stop vote's last round, and the run's clock stops."""
        self.stop.finish()
        self.total_time = time.perf_counter() - self.start

    def final_report(self) -> None:
        """TensorBoard's hyperparameters beside the final metrics (and --profile's trace), then
        the final [METRIC] line and the total time."""
        self.tb.finish(self.ckpt.metrics)
        measure.print_final(self.ckpt.metrics, self.total_time,
                            trained=self.start_epoch < self.last_epoch, run=self.info,
                            at=(self.start_epoch, self.resume_step))
