"""DataParallel (``nn.DataParallel``): ONE process drives all GPUs of one node. Every step it
scatters the batch from GPU 0 to the GPUs, copies the model from GPU 0 to every GPU, runs the
replicas in Python threads, gathers the outputs back on GPU 0, and sums the gradients on GPU 0.

Run it (same flags and output lines as ddp_train.py, plus --gpus):
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
import os
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DistributedSampler

import common
from common import UsageError, print0

STRATEGY = "dp"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Data-parallel training with nn.DataParallel (one process, all GPUs).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--gpus", type=int, default=None,
                        help="number of GPUs to use (default: all visible)")
    return parser


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


def setup_devices(args):
    """No process group: one process, the GPUs it drives, or the CPU."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("dp_train.py is a single process that drives all GPUs itself: run it "
                         "with python, not torchrun --nproc-per-node > 1")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.gpus is not None and args.gpus < 1:
        raise UsageError(f"--gpus must be at least 1, got {args.gpus}")
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
    torch.backends.cudnn.benchmark = True  # as in ddp/fsdp: fixed shapes, fastest kernels
    return torch.device("cuda", 0), list(range(n))


def save_checkpoint(path, net, optimizer, scheduler, scaler, epoch, step, partial, metrics,
                    args) -> None:
    """DataParallel: one process, one file; the master weights live on GPU 0."""
    common.atomic_save({
        "model": net.state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
        "epoch": epoch, "step": step, "partial": partial, "metrics": metrics,
        "rng": [common.rng_state()], "args": vars(args), "world_size": 1,
    }, path)
    common.prune_checkpoints(args.checkpoint_dir, args.keep_checkpoints)


def load_checkpoint(path, net, optimizer, scheduler, scaler) -> dict:
    # weights_only: a checkpoint holds tensors and plain values, it cannot run code
    state = torch.load(path, map_location="cpu", weights_only=True)
    net.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    common.set_rng_state(state["rng"][0])
    return dict(state, path=str(path))


def train(args, env: common.DistEnv) -> int:
    device, gpu_ids = setup_devices(args)
    common.resolve_args(args, env, device)
    n_dev = max(1, len(gpu_ids))

    for line in common.provenance(args, env, device, "none (single process)"):
        print0(line)
    if device.type == "cpu":
        print0("note: no GPU visible: DataParallel runs on the CPU as a single device")
    else:
        print0(f"DataParallel over GPUs {gpu_ids} (scatter from and gather on GPU 0)")

    data = common.build_data(args, True)
    common.check_writable(args.save_model)
    global_batch = args.batch_size * n_dev
    if global_batch > len(data.train):
        raise UsageError(f"global batch {global_batch} ({args.batch_size} per GPU x {n_dev}) is "
                         f"larger than the {len(data.train)} training samples: lower "
                         f"--batch-size")
    if data.name == "synthetic":
        print0("note: no --data-dir given, so this run uses built-in synthetic data "
               "(numbers show the pipeline, not TinyImageNet accuracy)")
    print0(f"data: {data.description}")
    print0(f"global batch: {global_batch} = {args.batch_size} per GPU x {n_dev} GPU(s), one "
           f"DataLoader batch split by DataParallel")

    torch.manual_seed(args.seed)
    net = common.build_model(args.model, data.num_classes, data.input_shape).to(device)
    common.check_checkpoint_dir(args.checkpoint_dir, net)
    if args.check:
        print0(f"check: no process group (DataParallel is one process); {n_dev} device(s): "
               f"{gpu_ids or ['cpu']}")
        print0("preflight OK: data, batch size, devices and checkpoint dir")
        return 0
    # From here on, randomness is this process's own (crops, flips, dropout, loader workers).
    torch.manual_seed(common.seed_for_rank(args.seed, 0))
    dtype = common.amp_dtype(args)
    # DataParallel: the master copy lives on GPU 0 and is replicated to every GPU each step.
    net, prepare = common.input_pipeline(data, net, device)
    inner = torch.compile(net) if args.compile else net
    model = nn.DataParallel(AutocastForward(inner, device.type, dtype),
                            device_ids=gpu_ids or None)

    # The same sampler as the other scripts at world size 1: the same shuffling order.
    train_sampler = DistributedSampler(data.train, num_replicas=1, rank=0, shuffle=True,
                                       seed=args.seed, drop_last=True)
    train_batches = common.SkipFirst(train_sampler)  # skips what a resumed epoch already saw
    val_sampler = DistributedSampler(data.val, num_replicas=1, rank=0, shuffle=False)
    train_loader = common.make_loader(data.train, train_batches, global_batch, args, device,
                                      drop_last=True)
    val_loader = common.make_loader(data.val, val_sampler, global_batch, args, device,
                                    start_now=True, val=True)

    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay,
                                # CUDA: one kernel for all parameters, and GradScaler's inf
                                # check stays on the GPU (no host sync per step with fp16)
                                fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_size,
                                                gamma=args.gamma)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    start_epoch, start_step, partial, metrics = 0, 0, None, {}
    common.claim_checkpoint_dir(args.checkpoint_dir)  # lock it; tidy an interrupted save
    state = common.load_newest(
        common.resume_candidates(args),
        lambda p: load_checkpoint(p, net, optimizer, scheduler, scaler))
    if state:
        start_epoch, start_step = state["epoch"], state["step"]
        partial, metrics = state["partial"], state["metrics"]
        print0(f"Resumed from epoch {start_epoch + 1}, step {start_step} ({state['path']})")

    steps = len(train_loader)
    if args.max_steps_per_epoch:
        steps = min(steps, args.max_steps_per_epoch)
    stop = common.StopRequest(1)
    bad_steps = torch.zeros((), device=device, dtype=torch.int64)  # non-finite losses seen,
    first_bad = torch.full((), -1, device=device, dtype=torch.int64)  # on the device
    start = common.now()
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        skip = start_step if epoch == start_epoch else 0
        train_batches.skip = skip * global_batch
        lr = optimizer.param_groups[0]["lr"]
        model.train()
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)  # stays on the device:
        correct = torch.zeros((), device=device, dtype=torch.float64)   # no host sync per step
        seen, elapsed = 0, 0.0
        if skip and partial:  # the part of this epoch done before the interruption
            loss_sum += partial["loss_sum"]
            correct += partial["correct"]
            seen, elapsed = partial["seen"], partial["time"]
        bad_steps.zero_()
        first_bad.fill_(-1)
        for d in [torch.device("cuda", i) for i in gpu_ids] or [device]:
            common.reset_peak_memory(d)  # this epoch's peak, not the whole run's

        def checkpoint(step: int) -> None:
            common.check_finite(bad_steps, first_bad, epoch, scaler)  # host sync
            part = dict(loss_sum=loss_sum.item(), correct=correct.item(), seen=seen,
                        time=elapsed + common.now() - t0)
            save_checkpoint(Path(args.checkpoint_dir) / common.checkpoint_name(epoch, step),
                            net, optimizer, scheduler, scaler, epoch, step, part, metrics, args)

        for i in gpu_ids:
            common.synchronize(torch.device("cuda", i))
        t0 = common.now()
        # to_device: on CUDA the next batch's copy overlaps this step's compute
        batches = common.to_device(train_loader, device)
        for step, (images, labels) in enumerate(batches, start=skip):
            if step >= steps:
                break
            images = prepare(images, train=True)  # on GPU 0: DataParallel scatters from there
            optimizer.zero_grad(set_to_none=True)
            outputs = model(images)  # replicate, scatter, parallel forward, gather on GPU 0
            loss = criterion(outputs.float(), labels)  # on GPU 0
            scaler.scale(loss).backward()  # gradients of all replicas are summed on GPU 0
            scaler.step(optimizer)
            scaler.update()
            loss_sum += loss.detach().double() * labels.size(0)
            correct += (outputs.argmax(1) == labels).sum()
            seen += labels.size(0)
            common.track_finite(loss, step, bad_steps, first_bad)
            done = step + 1
            if args.checkpoint_dir and args.checkpoint_every and done % args.checkpoint_every \
                    == 0 and done < steps:
                checkpoint(done)
            if stop.should_stop():
                if args.checkpoint_dir:
                    checkpoint(done)
                print0(stop.report(epoch + 1, done, saved=bool(args.checkpoint_dir)))
                return common.REQUEUE_EXIT
        for i in gpu_ids:
            common.synchronize(torch.device("cuda", i))
        epoch_time = elapsed + common.now() - t0
        common.check_finite(bad_steps, first_bad, epoch, scaler)  # host sync, once per epoch
        scheduler.step()

        # One process sees every sample: these sums are already global.
        v_loss, v_correct, v_n = common.evaluate(model, val_loader, device, None,
                                                 common.real_samples(val_sampler),
                                                 prepare).tolist()
        t_loss, t_correct = loss_sum.item(), correct.item()  # one host sync per epoch
        if gpu_ids:
            peaks = [common.peak_memory_mib(torch.device("cuda", i)) for i in gpu_ids]
        else:
            peaks = [common.peak_memory_mib(device)]

        metrics = dict(
            strategy=STRATEGY, model=args.model, dataset=data.name, device=device.type,
            world_size=n_dev, nodes=1, gpus_per_node=n_dev,
            per_gpu_batch=args.batch_size, global_batch=global_batch, amp=args.amp,
            epoch=epoch + 1, epochs=args.epochs, lr=lr,
            train_loss=t_loss / max(seen, 1), train_acc=100.0 * t_correct / max(seen, 1),
            val_loss=v_loss / max(v_n, 1), val_acc=100.0 * v_correct / max(v_n, 1),
            train_images=seen, val_images=int(v_n), epoch_time_s=epoch_time,
            throughput_img_s=seen / epoch_time if epoch_time > 0 else 0.0,
            peak_mem_mib=max(peaks), peak_mem_per_gpu_mib=peaks,
        )
        print0(common.format_epoch_line(metrics))
        print0(common.format_metric_line(metrics))
        common.report_skipped(seen, steps * global_batch, v_n, len(data.val))
        if args.checkpoint_dir:
            save_checkpoint(Path(args.checkpoint_dir) / common.checkpoint_name(epoch + 1, 0),
                            net, optimizer, scheduler, scaler, epoch + 1, 0, None, metrics, args)

    total_time = common.now() - start
    if args.save_model:
        common.save_state_dict(net.state_dict(), args.save_model)  # the unwrapped model
        print0(f"saved model state_dict to {args.save_model}")
    if not metrics:
        print0("nothing to train: the checkpoint is already past --epochs")
        return 0
    metrics["total_time_s"] = total_time
    print0(common.format_metric_line(metrics, final=True))
    print0(f"Total time: {total_time:.1f} s")
    return 0


def main(argv=None) -> int:
    return common.run(train, build_parser(), argv)


if __name__ == "__main__":
    common.end_process(main())  # releases the checkpoint dir's lock, stops loader workers
