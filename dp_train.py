"""DataParallel (``nn.DataParallel``): ONE process drives all GPUs of one node. Every step it
scatters the batch from GPU 0 to the GPUs, copies the model from GPU 0 to every GPU, runs the
replicas in Python threads, gathers the outputs back on GPU 0, and sums the gradients on GPU 0.

Run it (the shared flags and output lines of ddp_train.py; its own flag: --gpus):
    python dp_train.py                                    # all visible GPUs (or the CPU)
    python dp_train.py --gpus 2 --data-dir /data/tiny-imagenet-200
    STRATEGY=dp sbatch launch/multi_gpu.slurm             # one process on one node

When is DataParallel still reasonable? A quick experiment on one machine with 2 GPUs and a
small model, where changing one line beats setting up a launcher. Why DDP is recommended
instead: DDP runs one process per GPU, so there is no Python GIL shared by all replicas, no
model copy from GPU 0 every step (each process keeps its replica and only gradients are
all-reduced), no output gather and loss on GPU 0, and it works across nodes. GPU 0 also holds
more memory than the others under DataParallel (the gathered outputs, the loss, the master
gradients); that imbalance is why this script reports every GPU's peak, not only GPU 0's.

``--batch-size`` is per GPU here too: the DataLoader batch is batch size x GPUs, which
DataParallel splits into one chunk per GPU.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DistributedSampler

from training import (checkpoint, common, contract, cudagraph, datasets, devices, distributed,
                      flags, loading, lossguard, measure, memory, models, profiling, schedule,
                      stopping, stragglers)
from training.board import Board
from training.distributed import print0
from training.faults import UsageError, end_process

STRATEGY = "dp"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Data-parallel training with nn.DataParallel (one process, all GPUs).",
        formatter_class=flags.HelpFormatter)
    flags.add_common_args(parser)
    g = parser.add_argument_group("DataParallel")
    g.add_argument("--gpus", type=flags.positive_int, default=None,
                   help="number of GPUs to use (default: all visible)")
    return parser


def setup_devices(args, env: distributed.DistEnv):
    """No process group: one process, the GPUs it drives, or the CPU."""
    if args.share_gpus:
        raise UsageError("--share-gpus lets several processes share a GPU, and DataParallel is "
                         "one process: use ddp_train.py or fsdp_train.py --share-gpus")
    if args.simulate_world_size:
        raise UsageError("--simulate-world-size simulates the ranks of a process group, and "
                         "DataParallel has none: use ddp_train.py or fsdp_train.py")
    if env.world_size > 1:  # torchrun --nproc-per-node 2, or srun with several tasks
        raise UsageError("dp_train.py is a single process that drives all GPUs itself: run it "
                         "with python, not torchrun --nproc-per-node > 1 or srun with several "
                         "tasks")
    if args.gpus and args.device == "cpu":
        raise UsageError(f"--gpus {args.gpus} asks for GPUs and --device cpu for none: drop "
                         f"one of them")
    # --device, and whether this torch can run on the GPUs it sees
    visible = torch.cuda.device_count() if devices.use_gpu(args) else 0
    if visible == 0:
        if args.gpus:
            raise UsageError(f"--gpus {args.gpus} was asked for but no GPU is visible: drop "
                             f"--gpus to train on the CPU, or run on a GPU node")
        return torch.device("cpu"), []
    n = visible if args.gpus is None else args.gpus
    if n > visible:
        raise UsageError(f"--gpus {n} but only {visible} GPU(s) are visible: use --gpus "
                         f"{visible} (or request more GPUs)")
    if args.compile and n > 1:
        raise UsageError(f"--compile cannot be combined with DataParallel over {n} GPUs: "
                         f"DataParallel copies the module to every GPU at each step, and a "
                         f"compiled module's copies would all run GPU 0's compiled code; use "
                         f"ddp_train.py --compile (one process per GPU), or --gpus 1")
    if args.cuda_graph and n > 1:
        raise UsageError(f"--cuda-graph cannot capture DataParallel over {n} GPUs: it runs the "
                         f"replicas in Python threads every step; use --gpus 1, or "
                         f"ddp_train.py --cuda-graph (one process per GPU)")
    torch.backends.cudnn.benchmark = True  # as in ddp/fsdp: fixed shapes, fastest kernels
    return torch.device("cuda", 0), list(range(n))


class AutocastForward(nn.Module):
    """Enter autocast inside forward: DataParallel runs each replica in its own thread, and
    autocast's dtype is per thread (outside, a bf16 choice would reach replicas as fp16)."""

    def __init__(self, module: nn.Module, device_type: str, dtype):
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def forward(self, x):
        with torch.autocast(self.device_type, dtype=self.dtype or torch.float32,
                            enabled=self.dtype is not None):
            return self.module(x)


def save_checkpoint(path, state: dict, meta: dict) -> None:
    """DataParallel: one process, one file; the master weights live on GPU 0."""
    checkpoint.atomic_save({name: obj.state_dict() for name, obj in state.items()} | meta, path)


def load_checkpoint(path, state: dict) -> dict:
    # weights_only: a checkpoint holds only tensors and plain values, so loading it cannot
    # run code.
    saved = torch.load(path, map_location="cpu", weights_only=True)
    for name, obj in state.items():
        # A run without fp16 saved its disabled GradScaler as an empty dict: keep the new one.
        if saved[name]:
            obj.load_state_dict(saved[name])
    return saved


def train(args, env: distributed.DistEnv) -> int:
    if args.estimate_memory is not None:  # a prediction only: no GPU, no process group
        return memory.estimate_only(args, memory_per_gpu, MEMORY_VARIANTS)
    device, gpu_ids = setup_devices(args, env)
    flags.resolve_args(args, env, device)
    cudagraph.check(args, device, STRATEGY)  # --cuda-graph where it cannot capture
    rank, world = 0, max(1, len(gpu_ids))  # no process group: one process, `world` GPUs
    is_main = True
    for line in common.provenance(args, env, device, "none (single process)"):
        print0(line)
    if device.type == "cpu":
        why = "--device cpu" if args.device == "cpu" else "no GPU visible"
        print0(f"note: {why}: DataParallel runs on the CPU as a single device")
    else:
        print0(f"DataParallel over GPUs {gpu_ids} (scatter from and gather on GPU 0)")

    data = datasets.build_data(args)
    checkpoint.check_writable(args.save_model)
    global_batch = args.batch_size * world
    datasets.describe(data, global_batch, f"{args.batch_size} per GPU x {world}")
    print0(f"global batch: {global_batch} = {args.batch_size} per GPU x {world} GPU(s), one "
           f"DataLoader batch split by DataParallel")

    torch.manual_seed(args.seed)
    model = models.build_model(args.model, data.num_classes, data.input_shape)
    if is_main:  # the predicted memory per GPU, which collect_results.py sets beside the peak
        saved = memory.saved_for_backward(model, data.input_shape, args.amp)
        print0(memory_per_gpu(model, args, world, saved, memory_variant(args)).line())
    model = model.to(device)
    checkpoint.check_checkpoint_dir(args.checkpoint_dir, model)
    if args.check:
        print0(f"check: no process group (DataParallel is one process); {world} device(s): "
               f"{gpu_ids or ['cpu']}")
        print0("preflight OK: data, batch size, devices and checkpoint dir")
        return 0
    # From here on, randomness is this process's own (crops, flips, dropout, loader workers).
    torch.manual_seed(distributed.seed_for_rank(args.seed, rank))
    layout = models.memory_format(model, device)  # channels_last on CUDA: faster convolutions
    model = model.to(memory_format=layout)
    prepare = loading.batch_finisher(data, layout)  # augments on the device, sets the layout
    # DataParallel: the master copy lives on GPU 0 and is replicated to every GPU each step;
    # each replica runs in its own thread, so autocast is entered inside it.
    inner = torch.compile(model, mode=args.compile) if args.compile else model
    step_model = nn.DataParallel(AutocastForward(inner, device.type, flags.amp_dtype(args)),
                                 device_ids=gpu_ids or None)

    batch = global_batch  # one DataLoader batch: the global batch, which DataParallel splits
    # The same sampler as the other scripts at world size 1: the same shuffling order.
    train_sampler = DistributedSampler(data.train, num_replicas=1, rank=0, shuffle=True,
                                       seed=args.seed, drop_last=True)
    train_batches = loading.SkipFirst(train_sampler)  # skips what a resumed epoch already saw
    val_sampler = DistributedSampler(data.val, num_replicas=1, rank=0, shuffle=False)
    train_loader = loading.make_loader(data.train, train_batches, batch, args, device,
                                       drop_last=True)
    val_loader = loading.make_loader(data.val, val_sampler, batch, args, device,
                                     start_now=True, val=True)
    val_real = loading.real_samples(val_sampler)

    criterion = nn.CrossEntropyLoss()
    steps = min(len(train_loader), args.max_steps_per_epoch or len(train_loader))
    lr = schedule.peak_lr(args, global_batch)  # --lr, or --lr scaled with the global batch
    # on CUDA fused: one kernel for all parameters, no host sync with a GradScaler; its
    # momentum made now, so that an overflowing first fp16 step leaves none uninitialised
    optimizer = schedule.start_momentum(torch.optim.SGD(
        model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.weight_decay,
        fused=schedule.fused_sgd(device)))
    # per step: warm-up (--warmup-epochs), then x --gamma every --step-size epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_factor(args, steps))
    dtype = flags.amp_dtype(args)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    capture = cudagraph.StepCapture(args.cuda_graph)  # --cuda-graph: the step as one CUDA graph

    def train_step(images, labels):
        """One optimizer step on the whole batch: forward under autocast, loss, scaled
        backward, the optimizer step. Returns (outputs, loss), still on the device."""
        optimizer.zero_grad(set_to_none=True)
        # forward: scatter the batch from GPU 0, replicate the model, gather on GPU 0
        with torch.autocast(device.type, dtype=dtype or torch.float32,
                            enabled=dtype is not None):
            outputs = step_model(images)
            loss = criterion(outputs, labels)
        # backward: the replicas' gradients are summed into the master copy on GPU 0
        scaler.scale(loss).backward()
        # --clip-grad-norm: the master copy's gradients (the whole batch's, on GPU 0); fp16:
        # unscaled first, so that the true gradients are clipped
        if args.clip_grad_norm:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        return outputs, loss
    train_step = capture.wrap(train_step, optimizer)  # --cuda-graph: captured, then replayed

    state = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    stop = stopping.StopRequest(args.dist_timeout)  # SIGUSR1/SIGTERM: save, then stop
    ckpt = checkpoint.Checkpoints(args, state, save_checkpoint, load_checkpoint)
    start_epoch, resume_step = ckpt.resume(steps)
    losses = lossguard.LossWatch(device, scaler, data.num_classes)  # NaN/inf, jumps: no sync a step

    local_devices = [torch.device("cuda", i) for i in gpu_ids] or [device]  # GPU 0 holds the most
    meter = measure.StepMeter(args, steps, global_batch)  # progress, data wait
    profiler = profiling.StepProfiler(args, steps, device)  # --profile: a window of steps
    # what every [METRIC] line of this run says about the run; each epoch adds its figures
    run_info = dict(strategy=STRATEGY, model=args.model, dataset=data.name, device=device.type,
                    world_size=world, nodes=1, gpus_per_node=world,
                    per_gpu_batch=args.batch_size, global_batch=global_batch, amp=args.amp,
                    image_size=data.input_shape[-1], epochs=args.epochs, lr_peak=lr,
                    lr_scaling=args.lr_scaling, warmup_epochs=args.warmup_epochs)
    # each rank's own time and its waits for the others: which rank holds the others back
    rank_clock = stragglers.watch(step_model, optimizer, device, args)
    # --tensorboard; the with block closes its files however the run ends
    with Board(args, run_info, steps, start_epoch * steps + resume_step) as tb:
        start = time.perf_counter()
        for epoch in range(start_epoch, args.epochs):
            train_sampler.set_epoch(epoch)  # reshuffle: a new permutation every epoch
            data.set_epoch(epoch)  # and new crops and flips (TinyImageNet's folder path)
            # the steps a resumed epoch already ran (0 in every other epoch), and their figures
            start_step = resume_step if epoch == start_epoch else 0
            earlier = ckpt.earlier if epoch == start_epoch else None
            train_batches.skip_samples = start_step * batch  # the same steps, in samples
            epoch_lr = optimizer.param_groups[0]["lr"]  # at this run's first step of the epoch
            step_model.train()
            # [loss x n, correct, n] of the epoch, kept on the device: no host sync per step
            sums = torch.zeros(3, device=device, dtype=torch.float64)
            measure.reset_peak_memory(*local_devices)  # this epoch's peak, not the whole run's
            measure.synchronize(*local_devices)
            t0 = time.perf_counter()
            rank_clock.start_epoch()
            # to_device: on CUDA the next batch's copy overlaps this step's compute; the meter
            # adds up the time spent waiting for the loader
            batches = meter.epoch(loading.to_device(train_loader, device), epoch, start_step)
            batches = profiler.epoch(batches, start_step)
            for step, (images, labels) in enumerate(batches, start=start_step):
                if step >= steps:
                    break
                images = prepare(images, train=True)
                outputs, loss = train_step(images, labels)  # forward, backward, optimizer step
                # TensorBoard: the loss and the learning rate, every --tensorboard-every s
                tb.step(epoch, step + 1, loss, optimizer, meter)
                scheduler.step()
                sums[0] += loss.detach().double() * labels.size(0)
                sums[1] += (outputs.argmax(1) == labels).sum()
                sums[2] += labels.size(0)
                losses.track(loss, step)  # counted on the device: no host sync here
                stop_now = stop.at_step(epoch, step + 1, steps)  # the same step on every rank
                # a checkpoint every --checkpoint-every steps, and one before a stop
                if ckpt.due(step + 1, steps, stopping=stop_now):
                    losses.check(epoch)  # a host sync and a vote: no NaN reaches a checkpoint
                    ckpt.save(epoch, step + 1, measure.epoch_so_far(
                        sums, t0, meter.data_wait_s, local_devices, earlier))
                if stop_now:  # checkpointed (with a --checkpoint-dir): exit, to be requeued
                    raise stop.requeue(saved=ckpt.enabled)
            measure.synchronize(*local_devices)
            train_time = time.perf_counter() - t0
            # every rank's times to rank 0 (a collective): slowest_rank and rank_spread
            slowest = rank_clock.end_epoch(epoch + 1, train_time, meter.data_wait_s)
            losses.check(epoch)  # a host sync and a vote of all ranks, once per epoch

            val_sums = common.evaluate(step_model, val_loader, device, dtype, val_real, prepare)

            # Metrics: sums of (loss x n, correct, n), then divide; one process, so all_reduce has
            # nothing to reduce. The host syncs here (each .tolist()) happen once per epoch.
            totals = distributed.all_reduce(torch.cat([sums, val_sums])).tolist()
            # one process: its own training time and the time its loader kept it waiting
            times = torch.tensor([train_time, meter.data_wait_s], device=device,
                                 dtype=torch.float64)
            epoch_time, data_wait = distributed.all_reduce(times, dist.ReduceOp.MAX).tolist()
            peaks = measure.peak_memory_per_gpu(local_devices)  # each GPU this process drives
            metrics = run_info | dict(epoch=epoch + 1, lr=epoch_lr) | measure.epoch_metrics(
                totals, epoch_time, data_wait, peaks, t0, train_time, earlier)
            metrics |= slowest
            print0(contract.format_epoch_line(metrics))
            print0(contract.format_metric_line(metrics))
            # rank 0 names a rank more than 10% slower than the median; [RANKS] has every rank's
            rank_clock.report()
            loading.report_unreadable_images(
                metrics, (steps - start_step) * global_batch + measure.earlier_images(earlier),
                len(data.val))
            tb.epoch(metrics)  # the same figures as TensorBoard curves
            ckpt.end_epoch(epoch, metrics)  # the epoch's checkpoint, with its metrics
            if stop.at_epoch_end(epoch, args.epochs):  # a stop signal by the epoch's end
                raise stop.requeue(saved=ckpt.enabled)
        stop.finish()
        total_time = time.perf_counter() - start
        if args.save_model and is_main:
            checkpoint.save_model(model.state_dict(), args.save_model)  # unwrapped, on the CPU
            print0(f"saved model state_dict to {args.save_model}")
        # TensorBoard: the hyperparameters beside the final metrics, and --profile's trace
        tb.finish(ckpt.metrics)
    measure.print_final(ckpt.metrics, total_time, trained=start_epoch < args.epochs)
    return 0


def main(argv=None) -> int:
    return common.run(train, build_parser(), argv)


# --------------------------------------------------------------------------------------------
# What the strategy predicts about itself: the memory of one GPU (--estimate-memory and the
# [MEMORY] line, which collect_results.py sets beside the measured peak). DataParallel has no
# collectives to count: its GPUs are driven by one process.
# --------------------------------------------------------------------------------------------


# the rows --estimate-memory prints; memory_variant(args): the row of a run with these flags
MEMORY_VARIANTS = ("-",)


def memory_variant(args) -> str:
    return "-"


def memory_per_gpu(model: nn.Module, args, world: int, saved: memory.Saved,
                   variant: str) -> memory.Estimate:
    """GPU 0's memory under DataParallel over ``world`` GPUs, the one that fills first: the
    model, its gradients and momentum (the other GPUs get copies of the parameters each step,
    nothing else), the activations of its share of the batch, and with several GPUs the
    extras only GPU 0 holds: the rest of the whole batch before the scatter, every GPU's
    outputs gathered back (and their gradients), and the replicas' gradients summed into
    its own."""
    params, grads, optimizer, buffers = memory.model_states(model, args.momentum)
    extras = 0
    if world > 1:
        image = math.prod(saved.input_shape) * 4  # fp32, as the loader hands it over
        outputs = 2 * 4 * saved.outputs_per_image  # the logits and their gradient, fp32
        extras = args.batch_size * (world - 1) * image + args.batch_size * world * outputs \
            + grads
    # one process, one loader: the whole data and the global batch land on GPU 0, of which
    # GPU 0's model copy trains on its share (the rest of the batch is in extras)
    data, inputs = memory.data_and_inputs(args, 1, args.batch_size * world, args.batch_size)
    return memory.Estimate(STRATEGY, variant, world, args.batch_size, saved, params, grads,
                           optimizer, buffers, extras, grads_at_peak=False, data=data,
                           inputs=inputs)


if __name__ == "__main__":
    end_process(main())  # leaves without the interpreter's teardown: see end_process
