"""DistributedDataParallel (DDP): one process per GPU, a full model replica in each, gradients
averaged with an all-reduce during backward. ResNet-50 on TinyImageNet by default.

Run it:
    python ddp_train.py                                  # 1 process; built-in synthetic data
    torchrun --nproc-per-node 2 ddp_train.py             # 2 processes (CPU: gloo, GPU: NCCL)
    torchrun --nproc-per-node 4 ddp_train.py --data-dir /data/tiny-imagenet-200
    sbatch launch/multi_node.slurm --epochs 3 --batch-size 512
    srun --kill-on-bad-exit=1 --ntasks-per-node 4 --gpus-per-node 4 python ddp_train.py

Every epoch rank 0 prints one line with metrics reduced over ALL ranks, then one
machine-readable ``[METRIC]`` line (keys: contract.METRIC_KEYS):

    Epoch [3/3] LR: 0.001000 | Loss (train, val): 5.149, 5.664 | Accuracy (train, val): ...

``--batch-size`` is per process (per GPU); the global batch is batch size x world size.
"""

from __future__ import annotations

import argparse
import inspect
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from training import (bandwidth, checkpoint, common, contract, cudagraph, datasets, devices,
                      distributed, flags, loading, lossguard, measure, memory, models, profiling,
                      schedule, simulate, stopping, stragglers)
from training.board import Board
from training.distributed import print0
from training.faults import end_process

STRATEGY = "ddp"
COLLECTIVES = ("all_reduce",)  # of the gradients, bucket by bucket during backward
# DDP's per-forward buffer sync is called forward_sync_buffers in recent torch (the old name,
# broadcast_buffers, warns); use whichever this torch has.
BUFFER_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in
               inspect.signature(DDP).parameters else "broadcast_buffers")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Data-parallel training with DistributedDataParallel (one process per GPU).",
        formatter_class=flags.HelpFormatter)
    flags.add_common_args(parser)
    g = parser.add_argument_group("DDP")
    g.add_argument("--bucket-cap-mb", type=flags.positive, default=25,
                   help="gradient bucket size: larger buckets mean fewer, bigger all-reduces")
    g.add_argument("--gradient-as-bucket-view", action=argparse.BooleanOptionalAction,
                   default=True, help="gradients are views into the all-reduce buckets, kept "
                                      "across steps (zeroed, not set to None): backward adds "
                                      "into the buckets in place, no copy into them per step, "
                                      "and no second set of gradients in memory")
    g.add_argument("--broadcast-buffers", action=argparse.BooleanOptionalAction, default=True,
                   help="copy rank 0's BatchNorm running statistics to all ranks before every "
                        "forward; off: one broadcast less per step, each rank keeps its own")
    g.add_argument("--static-graph", action="store_true",
                   help="the graph is the same every step: DDP skips per-step bookkeeping")
    g.add_argument("--zero1", action="store_true",
                   help="ZeRO stage 1 (ZeroRedundancyOptimizer): each rank keeps the optimizer "
                        "state of 1/N of the parameters, updates only those and broadcasts "
                        "them; parameters and gradients stay whole on every rank")
    return parser


def setup_distributed(args, env: distributed.DistEnv):
    """Pick the device and backend, then join the process group (every rank takes part)."""
    if devices.use_gpu(args):  # --device, and whether this torch can run on the GPU
        visible = torch.cuda.device_count()
        gpu = distributed.gpu_index(visible, env.local_rank, env.local_world_size, env.source,
                                    args.share_gpus)
        device = torch.device("cuda", gpu)
        torch.cuda.set_device(device)  # before any CUDA work, so NCCL binds the right GPU
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest kernels
        # NCCL: a GPU per rank; ranks that share one (--share-gpus) talk over gloo instead
        shared = distributed.sharing_gpus(visible, env, args.share_gpus)
        backend = "gloo" if shared else "nccl"
    else:
        device, backend, shared = torch.device("cpu"), "gloo", False
    distributed.init_process_group(backend, env, args.dist_timeout)
    if shared:
        print0(*distributed.shared_gpu_lines(visible, env))
        # every rank's group carries them all: the gradients' sums, the start's broadcast
        distributed.check_gloo_on_cuda(device, [(op, None) for op in COLLECTIVES + ("broadcast",)])
    return device, backend


def build_optimizer(model: nn.Module, lr: float, args, device: torch.device):
    """SGD with momentum; on CUDA its fused step (one kernel for all parameters, and no host
    sync with a GradScaler, but for --zero1's, which the scaler steps through its unfused
    path), its momentum made before the first step. --zero1 (ZeRO stage 1):
    ZeroRedundancyOptimizer gives each rank 1/N of the parameters; a rank keeps the momentum of
    its own only, steps them, and broadcasts the new values to the other ranks."""
    sgd = dict(lr=lr, momentum=args.momentum, weight_decay=args.weight_decay,
               fused=schedule.fused_sgd(device))
    if args.zero1:
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, **sgd)
        schedule.start_momentum(zero.optim)  # the momentum of this rank's partition
        return zero
    return schedule.start_momentum(torch.optim.SGD(model.parameters(), **sgd))


def save_checkpoint(path, state: dict, meta: dict) -> None:
    """DDP: every replica has the same weights, so rank 0 alone writes one file (with
    --no-broadcast-buffers, its BatchNorm statistics are rank 0's). --zero1: every rank first
    sends rank 0 its part of the optimizer state (a collective)."""
    if isinstance(state["optimizer"], ZeroRedundancyOptimizer):
        state["optimizer"].consolidate_state_dict(to=0)
    if distributed.rank_and_world()[0] == 0:
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
    device, backend = setup_distributed(args, env)
    flags.resolve_args(args, env, device)
    cudagraph.check(args, device, STRATEGY)  # --cuda-graph where it cannot capture
    rank, world = distributed.rank_and_world()  # the process group's, now that it is up
    is_main = rank == 0
    for line in common.provenance(args, env, device, backend):
        print0(line)
    if device.type == "cpu":
        why = "--device cpu" if args.device == "cpu" else "no GPU visible"
        print0(f"note: {why}: training on CPU with the gloo backend")

    data = datasets.build_data(args)
    checkpoint.check_writable(args.save_model)
    global_batch = args.batch_size * world
    datasets.describe(data, global_batch, f"{args.batch_size} per process x {world}")
    print0(f"global batch: {global_batch} = {args.batch_size} per process x {world} processes")

    # Same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(args.seed)
    model = models.build_model(args.model, data.num_classes, data.input_shape)
    if is_main:  # the predicted memory per GPU, which collect_results.py sets beside the peak
        saved = memory.saved_for_backward(model, data.input_shape, args.amp)
        print0(memory_per_gpu(model, args, world, saved, memory_variant(args)).line())
    model = model.to(device)
    checkpoint.check_checkpoint_dir(args.checkpoint_dir, model)
    grad_bytes = memory.param_bytes(model.parameters())  # fp32 gradients, as the parameters
    if args.check:
        bandwidth.collective_check(device, world, grad_bytes, COLLECTIVES)
        print0("preflight OK: data, batch size, devices and checkpoint dir")
        return 0
    if args.profile and world > 1:  # the bandwidth the step's collectives get
        bandwidth.bus_bandwidth(device, world, [grad_bytes], COLLECTIVES,
                                collectives_per_step(model, args))
    # From here on, randomness is per rank: crops, flips, dropout and the loader workers'
    # seeds differ between ranks (with one seed everywhere, rank r's i-th sample would get
    # the same crop as rank 0's i-th sample at every step).
    torch.manual_seed(distributed.seed_for_rank(args.seed, rank))
    layout = models.memory_format(model, device)  # channels_last on CUDA: faster convolutions
    model = model.to(memory_format=layout)
    prepare = loading.batch_finisher(data, layout)  # augments on the device, sets the layout
    # DDP: a full replica per process; backward all-reduces gradient buckets across ranks.
    # BatchNorm statistics are broadcast from rank 0 before every forward, unless there is no
    # other rank. --cuda-graph: DDP is built on the stream its step will be captured on.
    capture = cudagraph.StepCapture(args.cuda_graph, warmup=cudagraph.DDP_WARMUP_STEPS)
    with capture.stream():
        replica = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                      bucket_cap_mb=args.bucket_cap_mb,
                      gradient_as_bucket_view=args.gradient_as_bucket_view,
                      **{BUFFER_SYNC: args.broadcast_buffers and world > 1},
                      static_graph=args.static_graph)
    step_model = torch.compile(replica, mode=args.compile) if args.compile else replica

    batch = args.batch_size  # one DataLoader batch: this process's share of the global batch
    # Each rank reads a disjoint shard of the training set; the permutation depends on
    # (seed, epoch) only, so all ranks agree on it. drop_last keeps the shards equal.
    train_sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True,
                                       seed=args.seed, drop_last=True)
    train_batches = loading.SkipFirst(train_sampler)  # skips what a resumed epoch already saw
    val_sampler = DistributedSampler(data.val, num_replicas=world, rank=rank, shuffle=False)
    train_loader = loading.make_loader(data.train, train_batches, batch, args, device,
                                       drop_last=True)
    val_loader = loading.make_loader(data.val, val_sampler, batch, args, device,
                                     start_now=True, val=True)
    val_real = loading.real_samples(val_sampler)

    criterion = nn.CrossEntropyLoss()
    steps = min(len(train_loader), args.max_steps_per_epoch or len(train_loader))
    lr = schedule.peak_lr(args, global_batch)  # --lr, or --lr scaled with the global batch
    optimizer = build_optimizer(model, lr, args, device)  # SGD; --zero1: its state sharded
    # per step: warm-up (--warmup-epochs), then x --gamma every --step-size epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_factor(args, steps))
    dtype = flags.amp_dtype(args)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    def train_step(images, labels):
        """One optimizer step on this rank's batch: forward under autocast, loss, scaled
        backward, the optimizer step. Returns (outputs, loss), still on the device."""
        # --gradient-as-bucket-view: the gradients are zeroed, not dropped, so they stay views
        # into DDP's buckets and backward adds into them in place; dropped (None), every
        # backward would make new gradients and DDP copy each one into its bucket
        optimizer.zero_grad(set_to_none=not args.gradient_as_bucket_view)
        with torch.autocast(device.type, dtype=dtype or torch.float32,
                            enabled=dtype is not None):
            outputs = step_model(images)
            loss = criterion(outputs, labels)
        # backward: DDP all-reduces (averages) each gradient bucket across all ranks
        scaler.scale(loss).backward()
        # --clip-grad-norm: the averaged gradients are the same on every rank, and so is their
        # norm (no collective); fp16: unscaled first, so that the true gradients are clipped
        if args.clip_grad_norm:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        return outputs, loss
    train_step = capture.wrap(train_step, optimizer, replica)  # --cuda-graph: captured, replayed
    if args.simulate_world_size:  # rank 0 of N on the fake process group: its memory, no more
        return simulate.report(train_step, replica, model, optimizer, train_loader, prepare,
                               device, world)

    state = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    stop = stopping.StopRequest(args.dist_timeout)  # SIGUSR1/SIGTERM, agreed by all ranks
    ckpt = checkpoint.Checkpoints(args, state, save_checkpoint, load_checkpoint)
    start_epoch, resume_step = ckpt.resume(steps)
    losses = lossguard.LossWatch(device, scaler, data.num_classes)  # NaN/inf, jumps: no sync a step

    local_devices = [device]  # the GPU (or CPU) this process drives, for syncs and peak memory
    meter = measure.StepMeter(args, steps, global_batch)  # progress, data wait
    profiler = profiling.StepProfiler(args, steps, device)  # --profile: a window of steps
    # what every [METRIC] line of this run says about the run; each epoch adds its figures
    run_info = dict(strategy=STRATEGY, model=args.model, dataset=data.name, device=device.type,
                    world_size=world, nodes=env.nodes, gpus_per_node=env.local_world_size,
                    per_gpu_batch=args.batch_size, global_batch=global_batch, amp=args.amp,
                    image_size=data.input_shape[-1], epochs=args.epochs, lr_peak=lr,
                    lr_scaling=args.lr_scaling, warmup_epochs=args.warmup_epochs)
    # each rank's own time and its waits for the others: which rank holds the others back
    rank_clock = stragglers.watch(step_model, optimizer, device, args)
    # --tensorboard; the with block closes its files however the run ends
    with Board(args, run_info, steps, start_epoch * steps + resume_step) as tb:
        start = time.perf_counter()
        for epoch in range(start_epoch, args.epochs):
            train_sampler.set_epoch(epoch)  # reshuffle: same permutation on all ranks
            data.set_epoch(epoch)  # and new crops and flips (TinyImageNet's folder path)
            # the steps a resumed epoch already ran (0 in every other epoch), and their figures
            start_step = resume_step if epoch == start_epoch else 0
            earlier = ckpt.earlier if epoch == start_epoch else None
            train_batches.skip_samples = start_step * batch  # the same steps, in samples
            epoch_lr = optimizer.param_groups[0]["lr"]  # at this run's first step of the epoch
            step_model.train()
            # [loss x n, correct, n] of this rank, kept on the device: no host sync per step
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

            # Metric reduction, all ranks: sum of (loss x n, correct, n), then divide. The host
            # syncs here (each .tolist()) happen once per epoch, never per step.
            totals = distributed.all_reduce(torch.cat([sums, val_sums])).tolist()
            # the slowest rank sets the pace; data wait: the rank its loader kept waiting longest
            times = torch.tensor([train_time, meter.data_wait_s], device=device,
                                 dtype=torch.float64)
            epoch_time, data_wait = distributed.all_reduce(times, dist.ReduceOp.MAX).tolist()
            peaks = measure.peak_memory_per_gpu(local_devices)  # collective: every rank's GPU
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
# [MEMORY] line, which collect_results.py sets beside the measured peak) and the collectives
# of one step (the scaling model's latency term)
# --------------------------------------------------------------------------------------------


def collectives_per_step(model: nn.Module, args) -> dict:
    """What one training step sends, for the scaling model's latency term (collect_results.py):
    one all-reduce per gradient bucket of --bucket-cap-mb."""
    grad_bytes = memory.param_bytes(model.parameters())  # fp32 gradients, as the parameters
    return {"all_reduce": math.ceil(grad_bytes / (args.bucket_cap_mb * 2**20))}


# the rows --estimate-memory prints; memory_variant(args): the row of a run with these flags
MEMORY_VARIANTS = ("-", "zero1")


def memory_variant(args) -> str:
    return "zero1" if args.zero1 else "-"


def memory_per_gpu(model: nn.Module, args, world: int, saved: memory.Saved,
                   variant: str) -> memory.Estimate:
    """One GPU's memory under DDP: a whole replica (parameters, gradients, momentum) on every
    GPU, whatever the world size, plus the gradient buckets the all-reduce sends, which hold
    the gradients themselves with --gradient-as-bucket-view. zero1: the momentum of this
    rank's partition only (the largest partition: the GPU that fills first)."""
    params, grads, optimizer, buffers = memory.model_states(model, args.momentum)
    if variant == "zero1" and args.momentum:
        parts = memory.zero1_partition(list(model.parameters()), world)
        optimizer = max(memory.param_bytes(part) for part in parts)
    buckets = 0 if args.gradient_as_bucket_view else grads
    # each rank's loader holds its 1/world of the data and hands over its own batch
    data, inputs = memory.data_and_inputs(args, world, args.batch_size, args.batch_size)
    return memory.Estimate(STRATEGY, variant, world, args.batch_size, saved, params, grads,
                           optimizer, buffers, comm=buckets,
                           grads_at_peak=args.gradient_as_bucket_view, data=data,
                           inputs=inputs)


if __name__ == "__main__":
    end_process(main())  # leaves without the interpreter's teardown: see end_process
