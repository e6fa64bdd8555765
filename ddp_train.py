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

from training import ctrl_c  # first: a Ctrl-C while torch loads ends the script quietly

ctrl_c.quiet_while_loading(__name__)

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from training import (bandwidth, checkpoint, common, cudagraph, datasets, distributed, flags,
                      loading, loop, memory, models, schedule, simulate, stopping, torch_private)
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
    device, backend, shared = common.choose_device(args, env)  # this rank's GPU and NCCL
    distributed.init_process_group(backend, env, args.dist_timeout)
    if shared:  # ranks that share a GPU (--share-gpus) talk over gloo
        print0(*distributed.shared_gpu_lines(torch.cuda.device_count(), env))
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
        # imported here, where it is used, as in save_checkpoint: its package loads FSDP's and
        # DTensor's, about 1 s, which a refusal of a flag or a --help need not wait for
        from torch.distributed.optim import ZeroRedundancyOptimizer
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, **sgd)
        schedule.start_momentum(zero.optim)  # the momentum of this rank's partition
        return zero
    return schedule.start_momentum(torch.optim.SGD(model.parameters(), **sgd))


def save_checkpoint(path, state: dict, meta: dict) -> None:
    """DDP: every replica has the same weights, so rank 0 alone writes one file (with
    --no-broadcast-buffers, its BatchNorm statistics are rank 0's). --zero1: every rank first
    sends rank 0 its part of the optimizer state (a collective)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # see build_optimizer
    if isinstance(state["optimizer"], ZeroRedundancyOptimizer):
        state["optimizer"].consolidate_state_dict(to=0)
    if distributed.rank_and_world()[0] == 0:
        checkpoint.atomic_save({name: obj.state_dict() for name, obj in state.items()} | meta, path)


def save_model(model: nn.Module, path) -> None:
    """--save-model: rank 0 writes the unwrapped model's weights, on the CPU (every replica
    holds the same)."""
    if distributed.rank_and_world()[0] == 0:
        checkpoint.save_model(model.state_dict(), path)
        print0(f"saved model state_dict to {path}")


def wrap_ddp(model: nn.Module, args, world: int, device: torch.device, capture) -> DDP:
    """The model in DDP: a full replica per process; backward all-reduces each gradient bucket
    across ranks, averaging it once (average_per_bucket). BatchNorm statistics are broadcast
    from rank 0 before every forward, unless --no-broadcast-buffers or there is no other rank.
    --cuda-graph: DDP is built on the stream its step will be captured on (``capture``'s)."""
    with capture.stream():
        replica = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                      bucket_cap_mb=args.bucket_cap_mb, static_graph=args.static_graph,
                      gradient_as_bucket_view=args.gradient_as_bucket_view,
                      **{BUFFER_SYNC: args.broadcast_buffers and world > 1})
    average_per_bucket(replica, args, world)
    return replica


def average_per_bucket(replica: DDP, args, world: int) -> None:
    """DDP's average in one division per gradient bucket (its built-in all-reduce hook), not
    one per parameter, which is what DDP does when no comm hook is registered: 161 kernels a
    ResNet-50 step, even at world size 1, where the division is by 1 (0.2 ms of GPU work in an
    H200's 7.6 ms --cuda-graph step at 64 px, and 161 host launches in an eager one). Where
    the straggler clock registers its own hook, which divides per bucket too (several ranks,
    no --cuda-graph), or --simulate-world-size its own, this leaves DDP to them: a DDP model
    takes one comm hook."""
    if args.simulate_world_size or (world > 1 and not args.cuda_graph):
        return
    try:
        torch_private.ddp_average_per_bucket(replica)
    except torch_private.TorchInternalMoved as moved:
        print0(f"note: {moved}; DDP divides each gradient on its own (slower, the same result)")


def build_train_step(step_model, model, optimizer, scaler, args, device: torch.device):
    """The strategy's step, train_step(images, labels): forward under autocast, loss, scaled
    backward (DDP's all-reduce), the optimizer step. Returns (outputs, loss), still on the
    device."""
    criterion = nn.CrossEntropyLoss()
    dtype = flags.amp_dtype(args)

    def train_step(images, labels):
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
    return train_step


def preflight(args, model: nn.Module, data, device: torch.device, world: int) -> bool:
    """Before training, with the model still on the CPU: rank 0's predicted memory per GPU
    (the [MEMORY] line, which collect_results.py sets beside the peak) and room in the
    checkpoint folder; --check: the gradients' collective timed, then True (nothing to
    train); --profile: the bandwidth the step's collectives get."""
    if distributed.rank_and_world()[0] == 0:
        saved = memory.saved_for_backward(model, data.input_shape, args.amp)
        print0(memory_per_gpu(model, args, world, saved, memory_variant(args)).line())
    checkpoint.check_checkpoint_dir(args.checkpoint_dir, model)
    grad_bytes = memory.param_bytes(model.parameters())  # fp32 gradients, as the parameters
    if args.check:
        bandwidth.collective_check(device, world, grad_bytes, COLLECTIVES)
        print0("preflight OK: data, batch size, devices"
               + (" and checkpoint dir" if args.checkpoint_dir else ""))
        return True
    if args.profile and world > 1:
        bandwidth.bus_bandwidth(device, world, [grad_bytes], COLLECTIVES,
                                collectives_per_step(model, args))
    return False


def train(args, env: distributed.DistEnv) -> int:
    if args.estimate_memory is not None:  # a prediction only: no GPU, no process group
        return memory.estimate_only(args, memory_per_gpu, MEMORY_VARIANTS)
    device, backend = setup_distributed(args, env)
    flags.resolve_args(args, env, device)  # what needs the device: --amp, --num-workers
    cudagraph.check(args, device)  # --cuda-graph where it cannot capture
    rank, world = distributed.rank_and_world()  # the process group's, now that it is up
    common.print_start(args, env, device, backend)

    data = datasets.build_data(args)
    checkpoint.check_writable(args.save_model)
    global_batch = args.batch_size * world
    datasets.describe(data, global_batch, f"{args.batch_size} per process x {world}")
    print0(f"global batch: {global_batch} = {args.batch_size} per process x {world} processes")

    # Same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(args.seed)
    model = models.build_model(args.model, data.num_classes, data.input_shape, args.batch_size)
    if preflight(args, model, data, device, world):  # --check: a preflight, no training
        return 0
    # From here on, randomness is per rank: crops, flips, dropout and the loader workers'
    # seeds differ between ranks (with one seed everywhere, rank r's i-th sample would get
    # the same crop as rank 0's i-th sample at every step).
    torch.manual_seed(distributed.seed_for_rank(args.seed, rank))
    memory_format = models.memory_format(model, device)  # channels_last on CUDA: faster convs
    model = model.to(device, memory_format=memory_format)
    prepare = loading.batch_finisher(data, memory_format)  # augments, sets the format
    # DDP: a full replica per process; backward all-reduces (averages) the gradients
    capture = cudagraph.StepCapture(args.cuda_graph, warmup=cudagraph.DDP_WARMUP_STEPS)
    replica = wrap_ddp(model, args, world, device, capture)
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

    steps = min(len(train_loader), args.max_steps_per_epoch or len(train_loader))
    lr = schedule.peak_lr(args, global_batch)  # --lr, or --lr scaled with the global batch
    optimizer = build_optimizer(model, lr, args, device)  # SGD; --zero1: its state sharded
    # per step: warm-up (--warmup-epochs), then x --gamma every --step-size epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_factor(args, steps))
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    train_step = build_train_step(step_model, model, optimizer, scaler, args, device)
    train_step = capture.wrap(train_step, optimizer, replica)  # --cuda-graph: captured, replayed
    if args.simulate_world_size:  # rank 0 of N on the fake process group: its memory, no more
        return simulate.report(train_step, replica, model, optimizer, train_loader, prepare,
                               device, world)

    state = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    stop = stopping.StopRequest(args.dist_timeout)  # SIGUSR1/SIGTERM, agreed by all ranks
    ckpt = checkpoint.Checkpoints(checkpoint.Settings.of(args), state, save_checkpoint,
                                  checkpoint.load_one_file)  # DDP's: one file, from rank 0
    start = ckpt.resume(steps)  # (epoch, step): (0, 0) for a fresh start
    info = loop.run_info(STRATEGY, args, data, device, world, env.nodes, env.local_world_size, lr)
    with loop.Run(loop.Settings.of(args), info, steps, start, stop, ckpt, step_model, optimizer,
                  scaler, device, [device], data) as run:
        for epoch in run.epochs():
            train_sampler.set_epoch(epoch)  # reshuffle: same permutation on all ranks
            data.set_epoch(epoch)  # and new crops and flips (TinyImageNet's folder path)
            train_batches.skip_samples = run.start_step * batch  # a resumed epoch's, in samples
            step_model.train()
            for step, (images, labels) in run.batches(train_loader):
                images = prepare(images, train=True)
                outputs, loss = train_step(images, labels)  # forward, backward, optimizer step
                run.step_done(step, loss, outputs, labels)  # the epoch's sums, on the device
                scheduler.step()
                run.save_or_stop(step)  # a checkpoint when due; a stop: the same step everywhere
            run.end_training()  # every rank's times, and the loss check
            val_sums = common.evaluate(step_model, val_loader, device, flags.amp_dtype(args),
                                       loading.real_samples(val_sampler), prepare)
            run.end_epoch(val_sums)  # reduced over all ranks: the epoch and [METRIC] lines
        run.finish()
        if args.save_model:
            save_model(model, args.save_model)
        run.final_report()
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
