"""Loading batches, the same for every strategy: the sampler that skips what a resumed epoch
already trained on (``SkipFirst``), the DataLoader over the sampler the strategy chose
(``make_loader``; with --data-on-device ``DeviceResident``), the copy of each batch to the
device (``to_device``) and its finish there (``batch_finisher``); and the count of the images
that could not be read. The datasets themselves are datasets.py's.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.utils.data import BatchSampler, DataLoader, default_collate

from training import stopping
from training.datasets import CachedSplit, DataBundle, SyntheticImages
from training.distributed import print0, rank_and_world, seed_for_rank
from training.faults import DataError


class SkipFirst(torch.utils.data.Sampler):
    """Wrap a (Distributed)Sampler and skip the first ``skip_samples`` indices of the next
    epoch (the samples of the steps a resumed epoch already ran, counted in samples, not
    steps), so a run resumed mid-epoch does not see the batches it already trained on."""

    def __init__(self, sampler):
        self.sampler, self.skip_samples = sampler, 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.skip_samples, None)

    def __len__(self):
        return max(0, len(self.sampler) - self.skip_samples)


def collate_skip_unreadable(batch):
    """default_collate without the samples ImageList could not read."""
    kept = [item for item in batch if item is not None]
    if not kept:
        raise DataError(f"all {len(batch)} images of a batch are unreadable: the data dir is "
                        f"damaged; restore it from the dataset archive")
    return default_collate(kept)


def collate_val(batch):
    """collate_skip_unreadable plus a bool mask over the sampler's batch: which positions
    survived. evaluate() needs it to tell real samples from the DistributedSampler's padding
    once an unreadable image has been dropped and the positions after it have shifted."""
    survived = torch.tensor([item is not None for item in batch])
    return (*collate_skip_unreadable(batch), survived)


def real_samples(sampler) -> int:
    """How many of this rank's validation indices are real. A DistributedSampler without
    shuffle pads the stream by repeating the first samples so every rank gets the same count;
    rank r's real samples are r, r + world, r + 2*world, ... and come before its padding."""
    return len(range(sampler.rank, len(sampler.dataset), sampler.num_replicas))


def report_unreadable_images(metrics: dict, train_expected: int, val_total: int) -> None:
    """End-of-epoch count of images dropped because they could not be read (metrics: the
    epoch's, with the images counted over all ranks)."""
    skipped_train = train_expected - metrics["train_images"]
    skipped_val = val_total - metrics["val_images"]
    if skipped_train > 0 or skipped_val > 0:
        print0(f"warning: skipped {skipped_train} unreadable training and {skipped_val} "
               f"validation image(s) this epoch (see the warnings above; --strict stops at "
               f"the first)")


class DeviceResident:
    """--data-on-device: batches made on the device from what this rank holds there, in the
    sampler's order (so each rank gets the very samples the DataLoader would give it, resumed
    epochs included); iterates like the DataLoader it replaces, with no host work per step.

    What a rank holds (``held``, counted as data_mib by the memory model):
    - synthetic data: its class prototypes and noise field, and its samples of the epoch as
      a noise offset and a label each. Sample i is a function of (seed, i), so each batch is
      made where it is used (SyntheticImages.locate at the epoch's start, make per batch);
    - the TinyImageNet cache: the samples its sampler gives it this epoch, read from the
      memory-mapped cache at the epoch's start in the sampler's order, so each batch is a
      slice. The sampler reshuffles the whole split every epoch, so these are a new 1/world
      of it each epoch; they are let go when the epoch's batches end.
    Neither path makes a host copy of the whole split: at most the rank's shard, once.
    ``max_batches`` (held_batches: --max-steps-per-epoch): an epoch holds only the batches it
    will train on, a resumed one those left (read whole, a cap of 30 batches of a
    100,000-image split read all of it inside the timed epoch); the length stays the
    sampler's, as the scripts cap their steps themselves."""

    def __init__(self, dataset, sampler, batch_size: int, drop_last: bool, device,
                 max_batches: int = None):
        self.dataset, self.sampler, self.device = dataset, sampler, device
        self.batch_size, self.drop_last, self.max_batches = batch_size, drop_last, max_batches
        self.held = ()  # the tensors this rank holds on the device now
        if isinstance(dataset, SyntheticImages):
            self.prototypes, self.noise = dataset.prototypes.to(device), dataset.noise.to(device)
            self.held = (self.prototypes, self.noise)

    def __len__(self):
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self):
        # the epoch's indices for this rank, without those of a last batch that drop_last drops
        # and of the batches past --max-steps-per-epoch
        batches = len(self)
        if self.max_batches:  # less the steps a resumed epoch ran (SkipFirst skips them)
            ran = getattr(self.sampler, "skip_samples", 0) // self.batch_size
            batches = min(batches, max(0, self.max_batches - ran))
        order = torch.tensor(list(itertools.islice(self.sampler, batches * self.batch_size)),
                             dtype=torch.int64)
        before = self.held
        if isinstance(self.dataset, SyntheticImages):
            # one host-to-device copy of the order per epoch, located there at once
            offsets, labels = self.dataset.locate(order.to(self.device))
            self.held = (self.prototypes, self.noise, offsets, labels)
        else:  # CachedSplit: this epoch's shard, read in the sampler's order (a host copy of
            # the shard, not of the memory-mapped split), then moved to the device
            self.held = tuple(t.to(self.device) for t in self.dataset[order.numpy()])
        try:
            for k in range(batches):
                part = slice(k * self.batch_size, (k + 1) * self.batch_size)
                if isinstance(self.dataset, SyntheticImages):
                    yield (self.dataset.make(offsets[part], labels[part], self.prototypes,
                                             self.noise), labels[part])
                else:
                    yield tuple(t[part] for t in self.held)  # views of the shard: no copy
        finally:
            self.held = before  # the epoch's shard (or order) is let go


def held_batches(args) -> int | None:
    """The training batches an epoch holds with --data-on-device: --max-steps-per-epoch's,
    except on --simulate-world-size, which trains simulate.STEPS whatever the flag says; None:
    every batch of the rank's shard. The memory model counts the same."""
    return None if args.simulate_world_size else args.max_steps_per_epoch or None


def make_loader(dataset, sampler, batch_size: int, args, device, drop_last: bool = False,
                start_now: bool = False, val: bool = False):
    """The DataLoader, tuned the same way for every strategy: pinned memory on CUDA,
    persistent workers and a deeper prefetch. A cached split is read a batch at a time.
    ``val``: each batch also says which of its positions survived (collate_val), which
    evaluate() needs to count every validation image exactly once.

    ``start_now`` forks the workers at once (for the validation loader). Forked later, at the
    first evaluation, a worker would share the trained model's memory copy-on-write, and the
    next training step would pay to copy every page it writes (0.3-0.65 s per run for ResNet-18
    on a 2-core CPU). The batches it prefetches now are dropped when evaluation starts."""
    if args.data_on_device:
        return DeviceResident(dataset, sampler, batch_size, drop_last, device,
                              max_batches=None if val else held_batches(args))
    # The loader's own generator, for the seeds it draws for its workers at each epoch's
    # start: from the global random state, those draws would shift it, and a run resumed
    # mid-epoch (which starts its loader at once) would drop out and augment differently.
    generator = torch.Generator().manual_seed(seed_for_rank(args.seed, rank_and_world()[0]))
    kw = dict(num_workers=args.num_workers, pin_memory=device.type == "cuda",
              worker_init_fn=stopping.ignore_stop_signals, generator=generator,
              persistent_workers=args.num_workers > 0)
    if args.num_workers > 0:
        kw["prefetch_factor"] = 4
    if isinstance(dataset, CachedSplit):
        loader = DataLoader(dataset, sampler=BatchSampler(sampler, batch_size, drop_last),
                            batch_size=None, **kw)
    else:
        loader = DataLoader(dataset, sampler=sampler, batch_size=batch_size,
                            drop_last=drop_last,
                            collate_fn=collate_val if val else collate_skip_unreadable, **kw)
    if start_now and args.num_workers > 0:
        iter(loader)  # persistent: the iterator and its workers stay for later epochs
    return loader


def to_device(batches, device: torch.device):
    """Yield (images, labels) from ``batches`` on ``device``. On CUDA the next batch is copied
    on a side stream while the current step computes (pinned memory, one batch ahead), so
    the copy is off the critical path; elsewhere this is a plain ``.to``."""
    it = iter(batches)
    if device.type != "cuda":
        for images, labels in it:
            yield images.to(device), labels.to(device)
        return
    copy_stream = torch.cuda.Stream(device)
    compute = torch.cuda.current_stream(device)

    def fetch():
        batch = next(it, None)
        if batch is not None:
            with torch.cuda.stream(copy_stream):
                batch = [t.to(device, non_blocking=True) for t in batch]
        return batch

    ahead = fetch()
    while ahead is not None:
        compute.wait_stream(copy_stream)  # this batch's copy is done before the step uses it
        for t in ahead:
            t.record_stream(compute)  # its memory is not reused while the step runs
        current, ahead = ahead, fetch()  # start the next copy, then hand out this batch
        yield current


def batch_finisher(data: DataBundle, memory_format: torch.memory_format):
    """``prepare(images, train)``, which finishes a batch on the device: the cache path's
    augmentation, then the model's ``memory_format``. Every strategy calls it, so their inputs
    are identical."""
    augment = data.device_augment

    def prepare(images, train: bool):
        if augment is not None:
            images = augment(images, train)
        return images.contiguous(memory_format=memory_format)  # no-op when already in it
    return prepare
