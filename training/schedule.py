"""The learning-rate schedule and the optimizer's settings, the same for every strategy.

- ``peak_lr``: --lr, scaled to the global batch by --lr-scaling;
- ``lr_factor``: the factor of the peak at each optimizer step (a linear warm-up, then a step
  decay), for torch's LambdaLR, which the scripts step once per optimizer step;
- ``place_schedule``: a resumed run's schedule set to where it left off;
- ``fused_sgd`` and ``start_momentum``: SGD's fused step on CUDA, safe with a GradScaler.
"""

from __future__ import annotations

import math

import torch

from training.faults import UsageError


def peak_lr(args, global_batch: int) -> float:
    """--lr scaled to the global batch by --lr-scaling, relative to --base-batch."""
    ratio = global_batch / args.base_batch
    lr = args.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[args.lr_scaling]
    if lr != args.lr:
        check_float32(args, lr, f"--lr {args.lr:g} scaled by --lr-scaling {args.lr_scaling} to "
                                f"the global batch of {global_batch} ({lr:g})")
    return lr


def check_float32(args, lr: float, what: str) -> None:
    """Refuse a learning rate that the optimizer, which holds it as float32, cannot hold at
    some point of the run: at the peak, or after the --gamma decays (a --gamma above 1).
    ``what`` names the rate in the message. --lr 1e39 was a RuntimeError traceback in the
    first step, --gamma 1e308 one at the first decay, after an epoch of training."""
    f32_max = torch.finfo(torch.float32).max
    if not lr < f32_max:
        raise UsageError(f"{what} must be below the largest float32, {f32_max:.3g} (0.01 to 1 "
                         f"is common)")
    decays = args.epochs // args.step_size
    if math.log(lr) + decays * math.log(args.gamma) >= math.log(f32_max):
        raise UsageError(f"{what} times --gamma {args.gamma:g} at each of the {decays} decays "
                         f"(every --step-size {args.step_size} of --epochs {args.epochs}) goes "
                         f"past the largest float32 ({f32_max:.3g}): use a --gamma below 1 "
                         f"(0.1 is common)")


def lr_factor(args, steps: int):
    """The learning rate at optimizer step ``s`` (0-based, counted over the whole run) is
    peak_lr x lr_factor(s): a linear warm-up, (s + 1) / W for the first W = --warmup-epochs x
    steps, then a step decay, x --gamma every --step-size epochs (torch's StepLR)."""
    warmup = max(1, round(args.warmup_epochs * steps)) if args.warmup_epochs else 0

    def factor(s: int) -> float:
        ramp = min(1.0, (s + 1) / warmup) if warmup else 1.0
        return ramp * args.gamma ** (s // steps // args.step_size)
    return factor


def place_schedule(optimizer, scheduler, peak: list, position: int) -> None:
    """Set the per-step LambdaLR schedule to optimizer step ``position`` (0-based, counted
    in this run's steps per epoch), with this run's peak learning rate: the learning rate an
    uninterrupted run with this layout would use there."""
    scheduler.base_lrs = list(peak)
    scheduler.last_epoch = position
    for group, base, factor in zip(optimizer.param_groups, peak, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(position)


def fused_sgd(device: torch.device) -> bool:
    """Whether SGD takes its fused step: on CUDA, one kernel for all parameters. With fp16 too:
    the GradScaler then hands the kernel its scale and inf flag as tensors, and the kernel
    skips an overflowing step on the device, where the default (foreach) step costs a host
    sync per step while the scaler reads the flag. Safe because start_momentum makes the
    momentum buffers before the first step."""
    return device.type == "cuda"


def start_momentum(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make every momentum buffer now, as zeros. Fused SGD would otherwise make them at its
    first step with torch.empty_like and, when that step overflows (common at the GradScaler's
    first scale, 65536), return early on the inf flag: from the next step on the momentum would
    be uninitialised memory. With dampening 0 a zero buffer's first update is the gradient
    itself, which is what SGD's own first step sets, so the training is unchanged."""
    for group in optimizer.param_groups:
        if group["momentum"]:
            for p in group["params"]:
                optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
    return optimizer
