"""The NaN guard: a loss that became NaN or inf stops the run before it reaches a checkpoint,
without a host sync in the training step. And the jump guard: a loss that jumps by orders of
magnitude is named in one line, in the epoch it happens.

``LossWatch.track`` notes each step's loss on the device; ``LossWatch.check``, before each
checkpoint and at each epoch's end, reads the losses noted since the last check (a host sync)
and votes with all ranks: rank 0 names the earliest jump of any rank, and every rank
raises ``NonFiniteLoss`` together, which common.run() maps to contract.NONFINITE_EXIT.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from training.distributed import print0, rank_and_world


class NonFiniteLoss(Exception):
    """The loss became NaN/inf in a way GradScaler does not absorb."""


# fp16: this many non-finite losses one after another, up to a check, stop the run (one alone
# is an overflow GradScaler skipped; a diverged model overflows every step)
STUCK_STEPS = 2


def check_finite(bad_steps: torch.Tensor, first_bad: torch.Tensor, stuck: torch.Tensor,
                 epoch: int, scaler) -> None:
    """Host sync, called only before a checkpoint and at the end of an epoch, on every rank.

    The ranks vote first (one all-reduce, every rank of the group): a NaN seen on rank 1 alone
    stops every rank here, with the same message, instead of rank 1 raising while the others
    wait in their next collective until --dist-timeout. With fp16, a non-finite loss now and
    then is an overflow whose step GradScaler skipped, the weights left as they were; it is
    fatal where the last steps' losses are not finite one after another (``stuck``, 1 on a
    rank where its last STUCK_STEPS or more were not), since the weights about to be saved
    give them (a too-high --lr: finite weights that overflow every forward, which no scale
    brings back), or once the scale has collapsed below 1. Otherwise any non-finite loss is
    fatal."""
    never = torch.full_like(first_bad, -2**62)
    verdict = torch.stack([bad_steps, torch.where(first_bad >= 0, -first_bad, never),
                           stuck.to(bad_steps.dtype)])
    if rank_and_world()[1] > 1:
        # most bad steps; earliest bad step; a rank whose last steps were bad
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    bad, neg_first, stuck_anywhere = verdict.tolist()
    if bad == 0:
        return
    if scaler.is_enabled() and scaler.get_scale() >= 1.0 and not stuck_anywhere:
        return
    raise NonFiniteLoss(f"the loss became NaN or inf at epoch {epoch + 1}, step "
                        f"{-neg_first + 1}; nothing was saved after the last good "
                        f"checkpoint: lower --lr or check the data, then resume from it")


# A jump: a step's loss more than JUMP times the loss of the step before (the last finite one),
# and at least half of chance's loss (ln of the number of classes): a model that was fitting
# its data is suddenly half as good as guessing, or worse. The floor keeps the noise of a loss
# near 0 (0.00001, then 0.04 on one harder batch) quiet.
JUMP = 10


def name_jump(jump, epoch: int) -> None:
    """Host sync, at the same calls as check_finite, on every rank: each rank puts its first
    jump in its own row, one all-reduce (every rank of the group) gives every rank all rows,
    and rank 0 names the earliest (on the lowest rank of those at that step)."""
    rank, world = rank_and_world()
    rows = torch.zeros(world, 3, device=jump.device, dtype=jump.dtype)
    rows[rank] = jump
    if world > 1:
        dist.all_reduce(rows)
    seen = [(int(step), r, before, after) for r, (step, before, after) in
            enumerate(rows.tolist()) if step >= 0]
    if not seen:
        return
    step, r, before, after = min(seen)
    where = f" on rank {r}" if world > 1 else ""
    print0(f"warning: the loss jumped from {before:.4g} to {after:.4g} at epoch {epoch + 1}, "
           f"step {step + 1}{where}, more than {JUMP}x the step before's: a step "
           f"too large for the model; clip the gradients (--clip-grad-norm 1) or lower --lr")


def nonfinite_validation(metrics: dict, amp: str) -> str | None:
    """The warning for an epoch whose validation loss is NaN or inf, or None. The NaN guard
    watches the training loss (the weights are finite while it is), so such an epoch goes on,
    and its line alone would show the nan. The evaluation runs the model with BatchNorm's
    running statistics in place of each batch's, which can overflow fp16 where training did
    not."""
    if math.isfinite(metrics["val_loss"]):
        return None
    said = f"warning: the validation loss is {metrics['val_loss']} at epoch {metrics['epoch']}"
    if not math.isfinite(metrics["train_loss"]):
        return said
    why = ("the evaluation overflowed fp16's range (65,504) with BatchNorm's running statistics: "
           "--amp bf16 on a GPU of compute capability 8.0+, or --amp off, evaluates in a wider "
           "range" if amp == "fp16" else
           "the model's outputs on some validation images are not finite: check those images "
           "and the model's BatchNorm running statistics")
    return f"{said}, its training loss {metrics['train_loss']:.4g}: {why}"


class LossWatch:
    """NaN and inf losses and jumps of the loss. ``track`` notes each step's loss on the device,
    one copy into a buffer of the epoch's steps (no host sync, one kernel on a GPU: few
    launches a step count under --cuda-graph, where a step is one graph and the kernels around
    it). ``check``, before each checkpoint and at each epoch's end, reads the losses noted
    since the last check (a host sync), then votes with all ranks: rank 0 names the first jump,
    and every rank raises NonFiniteLoss together."""

    def __init__(self, device: torch.device, scaler, num_classes: int, steps: int):
        self.scaler, self.device = scaler, device
        self.floor = math.log(num_classes) / 2  # half of chance's loss
        self.losses = torch.zeros(max(steps, 1), device=device, dtype=torch.float64)
        self.first, self.upto = None, 0  # the steps noted since the last check
        self.last = math.inf  # the last finite loss checked (inf: none yet)
        self.trailing = 0  # non-finite losses one after another up to the last one checked

    def track(self, loss, step: int) -> None:
        """After ``step`` (0-based, in the epoch, below the ``steps`` it was made for)."""
        self.losses[step].copy_(loss.detach())
        if self.first is None:
            self.first = step
        self.upto = step + 1

    def check(self, epoch: int) -> None:
        """Host syncs and votes (every rank): the jump is named before a NaN stops the run."""
        first = self.upto if self.first is None else self.first
        losses = self.losses[first:self.upto].tolist()
        self.first = None
        jump, bad = [-1.0, 0.0, 0.0], []  # [step, loss before, loss] of the first jump
        for step, loss in enumerate(losses, start=first):
            # a jump from the last finite loss (an inf after a finite loss is one, a NaN not)
            if jump[0] < 0 and loss > JUMP * self.last and loss > self.floor:
                jump = [float(step), self.last, loss]
            if math.isfinite(loss):
                self.last, self.trailing = loss, 0
            else:
                bad.append(step)
                self.trailing += 1
        name_jump(torch.tensor(jump, device=self.device, dtype=torch.float64), epoch)
        check_finite(torch.tensor(len(bad), device=self.device),
                     torch.tensor(bad[0] if bad else -1, device=self.device),
                     torch.tensor(int(self.trailing >= STUCK_STEPS), device=self.device), epoch,
                     self.scaler)
