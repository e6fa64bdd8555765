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

from training import ctrl_c  # first: a Ctrl-C while torch loads ends the script quietly

ctrl_c.quiet_while_loading(__name__)

import torch
import torch.nn as nn
from torch.utils.data import DistributedSampler

from training import (checkpoint, common, cudagraph, datasets, devices, distributed, flags, loading,
                      loop, memory, models, schedule, stopping)
from training.distributed import print0
from training.faults import UsageError, end_process

STRATEGY = "dp"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Data-parallel training with nn.DataParallel (one process, all GPUs).",
        formatter_class=flags.HelpFormatter)
    flags.add_common_args(parser)
    flags.refuse_flags(parser, {
        "--share-gpus": "--share-gpus lets several processes share a GPU, and DataParallel is "
                        "one process: use ddp_train.py or fsdp_train.py --share-gpus",
        "--simulate-world-size": "--simulate-world-size simulates the ranks of a process "
                                 "group, and DataParallel has none: use ddp_train.py or "
                                 "fsdp_train.py"})
    g = parser.add_argument_group("DataParallel")
    g.add_argument("--gpus", type=flags.positive_int, default=None,
                   help="number of GPUs to use (default: all visible)")
    return parser


def setup_devices(args, env: distributed.DistEnv):
    """No process group: one process, the GPUs it drives, or the CPU."""
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


def save_model(model: nn.Module, path) -> None:
    """--save-model: the model's weights (the master copy, unwrapped), on the CPU."""
    checkpoint.save_model(model.state_dict(), path)
    print0(f"saved model state_dict to {path}")


def preflight(args, model: nn.Module, data, gpu_ids: list, world: int) -> bool:
    """Before training, with the model still on the CPU: the predicted memory of GPU 0 (the
    [MEMORY] line, which collect_results.py sets beside the peak) and room in the checkpoint
    folder; --check: the devices this process drives, then True (nothing to train)."""
    saved = memory.saved_for_backward(model, data.input_shape, args.amp)
    print0(memory_per_gpu(model, args, world, saved, memory_variant(args)).line())
    checkpoint.check_checkpoint_dir(args.checkpoint_dir, model)
    if args.check:
        print0(f"check: no process group (DataParallel is one process); {world} device(s): "
               f"{gpu_ids or ['cpu']}")
        print0("preflight OK: data, batch size, devices"
               + (" and checkpoint dir" if args.checkpoint_dir else ""))
        return True
    return False


def build_optimizer(model: nn.Module, lr: float, args, device: torch.device):
    """SGD with momentum over the master copy; on CUDA fused: one kernel for all parameters,
    no host sync with a GradScaler; its momentum made now, so that an overflowing first fp16
    step leaves none uninitialised."""
    return schedule.start_momentum(torch.optim.SGD(
        model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.weight_decay,
        fused=schedule.fused_sgd(device)))


def build_train_step(step_model, model, optimizer, scaler, args, device: torch.device):
    """The strategy's step, train_step(images, labels) on the whole batch: forward under
    autocast (scattered over the GPUs), loss, scaled backward (summed on GPU 0), the optimizer
    step. Returns (outputs, loss), still on the device."""
    criterion = nn.CrossEntropyLoss()
    dtype = flags.amp_dtype(args)

    def train_step(images, labels):
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
    return train_step


def train(args, env: distributed.DistEnv) -> int:
    if args.estimate_memory is not None:  # a prediction only: no GPU, no process group
        return memory.estimate_only(args, memory_per_gpu, MEMORY_VARIANTS)
    device, gpu_ids = setup_devices(args, env)
    flags.resolve_args(args, env, device)  # what needs the device: --amp, --num-workers
    cudagraph.check(args, device)  # --cuda-graph where it cannot capture
    world = max(1, len(gpu_ids))  # no process group: one process, `world` GPUs
    common.print_start(args, env, device, "none (single process)",
                       on_cpu="DataParallel runs on the CPU as a single device")
    if gpu_ids:
        print0(f"DataParallel over GPUs {gpu_ids} (scatter from and gather on GPU 0)")

    data = datasets.build_data(args)
    checkpoint.check_writable(args.save_model)
    global_batch = args.batch_size * world
    datasets.describe(data, global_batch, f"{args.batch_size} per GPU x {world}")
    print0(f"global batch: {global_batch} = {args.batch_size} per GPU x {world} GPU(s), one "
           f"DataLoader batch split by DataParallel")

    torch.manual_seed(args.seed)
    model = models.build_model(args.model, data.num_classes, data.input_shape, args.batch_size)
    if preflight(args, model, data, gpu_ids, world):  # --check: a preflight, no training
        return 0
    # From here on, randomness is this process's own (crops, flips, dropout, loader workers).
    torch.manual_seed(distributed.seed_for_rank(args.seed, 0))
    memory_format = models.memory_format(model, device)  # channels_last on CUDA: faster convs
    model = model.to(device, memory_format=memory_format)
    prepare = loading.batch_finisher(data, memory_format)  # augments, sets the format
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

    steps = min(len(train_loader), args.max_steps_per_epoch or len(train_loader))
    lr = schedule.peak_lr(args, global_batch)  # --lr, or --lr scaled with the global batch
    optimizer = build_optimizer(model, lr, args, device)  # SGD on the master copy
    # per step: warm-up (--warmup-epochs), then x --gamma every --step-size epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_factor(args, steps))
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    capture = cudagraph.StepCapture(args.cuda_graph)  # --cuda-graph: the step as one CUDA graph
    train_step = build_train_step(step_model, model, optimizer, scaler, args, device)
    train_step = capture.wrap(train_step, optimizer)  # --cuda-graph: captured, then replayed

    state = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    stop = stopping.StopRequest(args.dist_timeout)  # SIGUSR1/SIGTERM: save, then stop
    ckpt = checkpoint.Checkpoints(checkpoint.Settings.of(args), state, save_checkpoint,
                                  checkpoint.load_one_file)  # one file, as DDP's
    start = ckpt.resume(steps)  # (epoch, step): (0, 0) for a fresh start
    info = loop.run_info(STRATEGY, args, data, device, world, 1, world, lr)  # 1 node
    local_devices = [torch.device("cuda", i) for i in gpu_ids] or [device]  # GPU 0: the most
    with loop.Run(loop.Settings.of(args), info, steps, start, stop, ckpt, step_model, optimizer,
                  scaler, device, local_devices, data) as run:
        for epoch in run.epochs():
            train_sampler.set_epoch(epoch)  # reshuffle: a new permutation every epoch
            data.set_epoch(epoch)  # and new crops and flips (TinyImageNet's folder path)
            train_batches.skip_samples = run.start_step * batch  # a resumed epoch's, in samples
            step_model.train()
            for step, (images, labels) in run.batches(train_loader):
                images = prepare(images, train=True)
                outputs, loss = train_step(images, labels)  # forward, backward, optimizer step
                run.step_done(step, loss, outputs, labels)  # the epoch's sums, on the device
                scheduler.step()
                run.save_or_stop(step)  # a checkpoint when due; a stop signal: save, then exit
            run.end_training()  # each GPU's busy time, and the loss check
            val_sums = common.evaluate(step_model, val_loader, device, flags.amp_dtype(args),
                                       loading.real_samples(val_sampler), prepare)
            run.end_epoch(val_sums)  # the epoch and [METRIC] lines (nothing to reduce)
        run.finish()
        if args.save_model:
            save_model(model, args.save_model)
        run.final_report()
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
