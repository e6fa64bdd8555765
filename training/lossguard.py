"""The NaN guard: a loss that became NaN or inf stops the run before it reaches a checkpoint,
without a host sync in the training step.

``LossWatch.track`` counts non-finite losses on the device at every step; ``LossWatch.check``,
before each checkpoint and at each epoch's end, reads the count (one host sync) after a vote
of all ranks, and raises ``NonFiniteLoss`` on every rank together, which common.run() maps to
contract.NONFINITE_EXIT.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from training.distributed import rank_and_world


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


def track_finite(loss, step: int, bad_steps, first_bad) -> None:
    """Device-side bookkeeping of non-finite losses: no host sync in the training step."""
    bad = ~torch.isfinite(loss.detach())
    bad_steps += bad.to(bad_steps.dtype)
    first_bad.copy_(torch.where(bad & (first_bad < 0), torch.full_like(first_bad, step),
                                first_bad))


class LossWatch:
    """NaN and inf losses, counted on the device at every step (``track``: no host sync in the
    step) and checked by a vote of all ranks before each checkpoint and at each epoch's end
    (``check``: raises NonFiniteLoss on every rank together)."""

    def __init__(self, device: torch.device, scaler):
        self.scaler = scaler
        self.bad_steps = torch.zeros((), device=device, dtype=torch.int64)
        self.first_bad = torch.full((), -1, device=device, dtype=torch.int64)

    def track(self, loss, step: int) -> None:
        track_finite(loss, step, self.bad_steps, self.first_bad)

    def check(self, epoch: int) -> None:
        """A host sync and a vote (every rank)."""
        check_finite(self.bad_steps, self.first_bad, epoch, self.scaler)
        self.bad_steps.zero_()
        self.first_bad.fill_(-1)
