"""The NaN guard: a loss that became NaN or inf stops the run before it reaches a checkpoint,
without a host sync in the training step. And the jump guard: a loss that jumps by orders of
magnitude is named in one line, in the epoch it happens.

``LossWatch.track`` counts non-finite losses and notes the first jump on the device at every
step; ``LossWatch.check``, before each checkpoint and at each epoch's end, reads them (host
syncs) after a vote of all ranks: rank 0 names the earliest jump of any rank, and every rank
raises ``NonFiniteLoss`` together, which common.run() maps to contract.NONFINITE_EXIT.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from training.distributed import print0, rank_and_world


class NonFiniteLoss(Exception):
    """The loss became NaN/inf in a way GradScaler does not absorb."""


def check_finite(bad_steps: torch.Tensor, first_bad: torch.Tensor, epoch: int, scaler) -> None:
    """Host sync, called only before a checkpoint and at the end of an epoch, on every rank.

    The ranks vote first (one all-reduce, every rank of the group): a NaN seen on rank 1 alone
    stops every rank here, with the same message, instead of rank 1 raising while the others
    wait in their next collective until --dist-timeout. With fp16, a few non-finite losses are
    overflows that GradScaler skips; it is fatal once the scale has collapsed below 1 (the
    overflow never goes away). Otherwise any non-finite loss is fatal."""
    never = torch.full_like(first_bad, -2**62)
    verdict = torch.stack([bad_steps, torch.where(first_bad >= 0, -first_bad, never)])
    if rank_and_world()[1] > 1:
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)  # most bad steps; earliest bad step
    bad, neg_first = verdict.tolist()
    if bad == 0:
        return
    if scaler.is_enabled() and scaler.get_scale() >= 1.0:
        return
    raise NonFiniteLoss(f"the loss became NaN or inf at epoch {epoch + 1}, step "
                        f"{-neg_first + 1}; nothing was saved after the last good "
                        f"checkpoint: lower --lr or check the data, then resume from it")


# A jump: a step's loss more than JUMP times the loss of the step before (the last finite one),
# and at least half of chance's loss (ln of the number of classes): a model that was fitting
# its data is suddenly half as good as guessing, or worse. The floor keeps the noise of a loss
# near 0 (0.00001, then 0.04 on one harder batch) quiet.
JUMP = 10


def track_jump(loss, step: int, last, jump, floor: float) -> None:
    """Device-side: ``jump`` keeps the first jump since the last check, [step, loss before,
    loss] (step -1: none yet); ``last`` is the last finite loss (inf before the first). No
    host sync."""
    loss = loss.detach().to(last.dtype)
    jumped = (loss > JUMP * last) & (loss > floor) & (jump[0] < 0)
    torch.where(jumped, torch.stack([torch.full_like(loss, step), last, loss]), jump, out=jump)
    torch.where(torch.isfinite(loss), loss, last, out=last)  # a NaN or inf is not kept


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


def track_finite(loss, step: int, bad_steps, first_bad) -> None:
    """Device-side bookkeeping of non-finite losses: no host sync in the training step."""
    bad = ~torch.isfinite(loss.detach())
    bad_steps += bad.to(bad_steps.dtype)
    first_bad.copy_(torch.where(bad & (first_bad < 0), torch.full_like(first_bad, step),
                                first_bad))


class LossWatch:
    """NaN and inf losses and jumps of the loss, noted on the device at every step (``track``:
    no host sync in the step) and checked by a vote of all ranks before each checkpoint and at
    each epoch's end (``check``: names the first jump, raises NonFiniteLoss on every rank
    together)."""

    def __init__(self, device: torch.device, scaler, num_classes: int):
        self.scaler = scaler
        self.bad_steps = torch.zeros((), device=device, dtype=torch.int64)
        self.first_bad = torch.full((), -1, device=device, dtype=torch.int64)
        self.floor = math.log(num_classes) / 2  # half of chance's loss
        self.last = torch.full((), math.inf, device=device, dtype=torch.float64)
        self.jump = torch.tensor([-1.0, 0.0, 0.0], device=device, dtype=torch.float64)

    def track(self, loss, step: int) -> None:
        track_finite(loss, step, self.bad_steps, self.first_bad)
        track_jump(loss, step, self.last, self.jump, self.floor)

    def check(self, epoch: int) -> None:
        """Host syncs and votes (every rank): the jump is named before a NaN stops the run."""
        name_jump(self.jump, epoch)
        self.jump[0] = -1
        check_finite(self.bad_steps, self.first_bad, epoch, self.scaler)
        self.bad_steps.zero_()
        self.first_bad.fill_(-1)
