"""The data, the same for every strategy: TinyImageNet (its folder layout, or the decoded
uint8 cache of prepare_tinyimagenet.py), CIFAR-10, MNIST, Fashion-MNIST (from its four IDX
files, e.g. Debian's dataset-fashion-mnist package) and built-in synthetic data.

``build_data(args)`` returns the datasets (a DataBundle) and ``describe`` says what the run
trains on; the cache path and the synthetic data, stored as uint8, are finished on the device
by their ``DeviceAugment``. Feeding the batches to the training loop is loading.py's.
"""

from __future__ import annotations

import gzip
import math
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset

from training import tinyimagenet
from training.distributed import dist_env, on_rank0, print0, raise_if_any_rank, rank_and_world
from training.faults import DataError, UsageError
from training.flags import input_shape
from training.models import grey_channels


NORMALIZE = {  # channel mean and std of each dataset's training split
    "tinyimagenet": ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    # SyntheticImages stores 128 + 32 x (prototype + noise) as uint8: this undoes it
    "synthetic": ((128 / 255,), (32 / 255,)),
}


@dataclass
class DataBundle:
    train: Dataset
    val: Dataset
    num_classes: int
    input_shape: tuple  # (C, H, W)
    name: str
    description: str
    device_augment: "DeviceAugment | None" = None  # the cache's and synthetic uint8, finished

    def set_epoch(self, epoch: int) -> None:
        """Every epoch, beside the sampler's: the folder path's crops and flips are drawn
        from (seed, epoch, sample), so they change every epoch."""
        if isinstance(self.train, ImageList):
            self.train.set_epoch(epoch)


class ImageList(Dataset):
    """(path, label) pairs read with PIL. Used for TinyImageNet train and val alike.

    An unreadable image (corrupt, truncated, zero bytes) becomes None, which
    ``collate_skip_unreadable`` drops from its batch, with a warning naming the file; with
    ``strict`` it raises a UsageError naming the file instead. Either way the DataLoader
    worker does not crash. An image that is not 64x64 is resized, with a warning naming it
    (``strict``: an error), as the cache of prepare_tinyimagenet.py does.
    """

    def __init__(self, samples, strict: bool = False, augment_seed=None,
                 size: int | None = None):
        from torchvision import transforms as T  # imported here, where an image folder needs it
        self.samples, self.size = samples, size  # size: --image-size, resized after the crop
        self.targets = [label for _, label in samples]
        self.to_tensor, self.normalize = T.ToTensor(), T.Normalize(*NORMALIZE["tinyimagenet"])
        self.strict = strict
        self.warned = set()  # images of the wrong size already named (per loader worker)
        # Training: random crop (zero padding of 4) and flip, drawn from (seed, epoch, index),
        # not from the loader worker's random state, which a checkpoint cannot hold: a run
        # resumed mid-epoch then augments every sample as the uninterrupted run did. The
        # epoch lives in shared memory, so the loader's forked workers see set_epoch.
        self.augment_seed = augment_seed
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, label = self.samples[index]
        try:
            img, resized_from = tinyimagenet.load_rgb(path)
        except (OSError, ValueError, SyntaxError) as exc:  # PIL's errors for broken files
            reason = f"{exc.__class__.__name__}: {str(exc)[:100]}"
            if self.strict:
                raise DataError(f"unreadable image {path} ({reason}): replace or delete it, "
                                f"or drop --strict to skip such files") from None
            print(f"warning: skipping unreadable image {path} ({reason})", file=sys.stderr,
                  flush=True)
            return None
        if resized_from:  # as the cache does: resized with a warning, or --strict stops
            if self.strict:
                raise DataError(tinyimagenet.wrong_size(path, resized_from, strict=True))
            if path not in self.warned:  # once per file, not every epoch
                self.warned.add(path)
                print(tinyimagenet.wrong_size(path, resized_from, strict=False),
                      file=sys.stderr, flush=True)
        x = self.to_tensor(img)
        if self.augment_seed is not None:
            dy, dx, flip = crop_and_flip(self.augment_seed, int(self.epoch), index)
            pad = CROP_PADDING
            # zeros (black), padded before normalising, as the cache path pads its uint8 pixels
            x = F.pad(x, (pad, pad, pad, pad))
            x = x[:, dy:dy + x.shape[1] - 2 * pad, dx:dx + x.shape[2] - 2 * pad]
            if flip:
                x = x.flip(-1)
        if self.size:
            x = resize(x[None], self.size)[0]
        return self.normalize(x), label


CROP_PADDING = 4  # pixels of zeros around the image before a random 64x64 crop (both paths)


def resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """--image-size: a batch of float images (N, C, H, W) resized to size x size, bilinear, as
    torchvision's Resize does (antialiased when it shrinks them)."""
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False,
                         antialias=size < images.shape[-1])


def _mix32(x: int) -> int:
    """A 32-bit integer hash: nearby inputs give unrelated outputs. Works on a Python int and
    on an int64 tensor alike (each product stays below 2**63), with the same result on every
    device: integer arithmetic has no rounding."""
    x = x & 0xFFFFFFFF  # not in place: it also hashes int64 tensors, element by element
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    return x ^ (x >> 16)


def crop_and_flip(seed: int, epoch: int, index: int) -> tuple:
    """The folder path's augmentation of sample ``index`` in ``epoch``: (row offset, column
    offset, flip), offsets in 0..2 x CROP_PADDING. A function of its arguments only."""
    key = _mix32(_mix32(_mix32(seed) ^ epoch) ^ index)
    span = 2 * CROP_PADDING + 1
    return key % span, (key >> 8) % span, bool((key >> 16) & 1)


class SyntheticImages(Dataset):
    """Learnable, deterministic stand-in data: each class has its own smooth pattern, each
    sample adds its own noise. Loss falls and accuracy rises, so a run shows learning without
    any download. Sample ``i`` is a function of (seed, split, i) only: the same for every rank,
    every run and every device, whether one sample is made in a loader worker or a batch of
    them on the GPU (``make``).

    A sample is stored as the TinyImageNet cache stores an image, uint8 pixels in HWC order
    (one byte a value, not four), 128 + 32 x (prototype + noise), and DeviceAugment
    normalises it on the device (NORMALIZE["synthetic"]) back to prototype + noise: prototypes
    in [-1, 1], noise of standard deviation 1. Sample i's noise is a window of one fixed noise
    field, at an offset hashed from i: a batch is made with one gather (cheap on a GPU, where
    the batches of --data-on-device are made during training), not with a hash per value.
    """

    NOISE_SHIFTS = 65536  # the distinct windows of the noise field

    def __init__(self, size: int, shape: tuple, num_classes: int, seed: int, split: str):
        self.size, self.shape, self.num_classes = size, tuple(shape), num_classes
        g = torch.Generator().manual_seed(seed)
        coarse = torch.rand(num_classes, shape[0], 4, 4, generator=g) * 2 - 1
        smooth = F.interpolate(coarse, size=shape[1:], mode="bilinear", align_corners=False)
        self.prototypes = (128 + 32 * smooth).round().to(torch.uint8).permute(0, 2, 3, 1)
        self.prototypes = self.prototypes.contiguous()  # (classes, H, W, C), as the samples
        # one field for both splits, in noise levels (sd 32, int16: values below 0 and above
        # 255 before the clamp); the splits take their windows at different offsets
        field = torch.randn(math.prod(shape) + self.NOISE_SHIFTS, generator=g)
        self.noise = (32 * field).round().to(torch.int16)
        self.key = _mix32(seed) ^ (0 if split == "train" else 0x9E3779B9)
        self.targets = [i % num_classes for i in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        offsets, labels = self.locate(torch.tensor([index]))
        return self.make(offsets, labels, self.prototypes, self.noise)[0], index % self.num_classes

    def locate(self, indices: torch.Tensor) -> tuple:
        """(noise offsets, labels) of the samples ``indices`` (int64): all that make() needs
        to know of them. DeviceResident locates a whole epoch's samples at its start, so that
        making a batch during training costs a gather and a few elementwise kernels."""
        return _mix32(indices ^ self.key) % self.NOISE_SHIFTS, indices % self.num_classes

    def make(self, offsets: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor,
             noise: torch.Tensor) -> torch.Tensor:
        """uint8 images N x H x W x C of the samples that locate() gave ``offsets`` and
        ``labels``, made on the device that holds them, ``prototypes`` and ``noise`` (this
        split's, moved there): the class's prototype plus the sample's window of the noise
        field."""
        values = math.prod(self.shape)
        windows = noise.unfold(0, values, 1)  # a view: window k starts at value k
        # index_select, not windows[offsets]: advanced indexing checks the overlapping view
        # first, which costs milliseconds a call on the CPU
        pixels = (prototypes[labels].view(-1, values).to(torch.int16)
                  + torch.index_select(windows, 0, offsets))
        return pixels.clamp_(0, 255).to(torch.uint8).view(-1, *self.shape[1:], self.shape[0])


def rank0_first(fn):
    """Run ``fn`` (e.g. a download) on rank 0 while the other ranks wait, then on the others."""
    result = on_rank0(fn)
    if rank_and_world()[0] != 0:
        return fn()
    return result


def _torchvision_data(args) -> DataBundle:
    # torchvision is imported here, where its datasets are read: a synthetic run never needs it
    from torchvision import datasets, transforms as T
    root = Path(args.data_dir or "data")
    if root.is_file():
        raise UsageError(f"data dir {root} is a file, not a folder: pass the folder that holds "
                         f"(or should receive) the {args.dataset} files")
    mean, std = NORMALIZE[args.dataset]
    if args.dataset == "cifar10":
        cls, shape, archive = datasets.CIFAR10, (3, 32, 32), "cifar-10-python.tar.gz"
        kept = [root / archive, root / "cifar-10-batches-py"]  # the archive, and what it holds
        train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
                              T.ToTensor(), T.Normalize(mean, std)])
    else:
        cls, shape, archive = datasets.MNIST, (1, 28, 28), "MNIST/raw/*-ubyte.gz"
        kept = [root / "MNIST" / "raw"]
        train_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    val_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])

    def load(download: bool):
        try:
            return (cls(str(root), train=True, transform=train_tf, download=download),
                    cls(str(root), train=False, transform=val_tf, download=download))
        except (OSError, RuntimeError) as exc:  # URLError is an OSError
            # MNIST's error lists each mirror it tried over several lines: keep the first
            # (what failed) and the last (why), so the sentence stays one line
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
            why = lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')}: {lines[-1]}"
            why = f"{exc.__class__.__name__}: {why[:300]}"
            # an empty folder is no copy: torchvision makes MNIST/raw before it downloads
            there = [str(path) for path in kept
                     if path.is_file() or path.is_dir() and any(path.iterdir())]
            if there:  # torchvision checks the files' MD5 and downloads what fails it again
                raise UsageError(f"could not load {args.dataset} from {root}: {' and '.join(there)}"
                                 f" is there but incomplete or damaged (its checksum is not "
                                 f"the published one, and downloading it again failed: {why}); "
                                 f"replace it with a fresh copy of {archive} from the official "
                                 f"site, or delete it to download it again") from None
            raise UsageError(f"could not load {args.dataset} from {root} ({why}); without "
                             f"network, put {archive} (from the official site) in "
                             f"{root.resolve()} and pass --data-dir {root}") from None

    # rank 0 downloads (once per shared file system), the others read what it wrote
    train, val = rank0_first(lambda: load(download=rank_and_world()[0] == 0))
    return DataBundle(train, val, 10, shape, args.dataset,
                      f"{args.dataset} at {root}: {len(train)} train / {len(val)} val, 10 classes")


# Debian's and Ubuntu's dataset-fashion-mnist package puts the four files here
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                       "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def read_idx(path: Path, ndim: int) -> torch.Tensor:
    """One IDX file (the MNIST format, gzipped or not) as a uint8 tensor: images N x 28 x 28
    (ndim 3) or labels N (ndim 1). The header is two zero bytes, the type (8: unsigned byte),
    the number of dimensions, then each dimension as a big-endian 32-bit integer."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
        header = np.frombuffer(raw[:4], dtype=np.uint8)
        if len(raw) < 4 or header[0] or header[1] or header[2] != 8 or header[3] != ndim:
            raise ValueError("not an IDX file of unsigned bytes")
        shape = tuple(int(d) for d in np.frombuffer(raw[4:4 + 4 * ndim], dtype=">u4"))
        data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
        if len(shape) != ndim or data.size != math.prod(shape):
            raise ValueError(f"{data.size} bytes of data for the header's shape {shape}")
    except (OSError, EOFError, ValueError) as exc:  # gzip's BadGzipFile is an OSError
        raise UsageError(f"{path} is damaged ({exc.__class__.__name__}: {str(exc)[:100]}): "
                        f"reinstall it (sudo apt-get install --reinstall dataset-fashion-mnist) "
                        f"or replace it with the original file") from None
    return torch.from_numpy(data.reshape(shape).copy())


def idx_file(folder: Path, name: str) -> Path | None:
    """The IDX file ``name`` in ``folder``, unzipped or gzipped; None when neither is there."""
    return next((p for p in (folder / name, folder / f"{name}.gz") if p.is_file()), None)


def find_fashion_mnist(root: Path) -> Path:
    """The folder that holds Fashion-MNIST's four IDX files (each gzipped or not): ``root``
    itself, or torchvision's layout below it (``root/FashionMNIST/raw``)."""
    names = [n for pair in FASHION_MNIST_FILES.values() for n in pair]
    missing = {}  # folder: the files it lacks
    for folder in (root, root / "FashionMNIST" / "raw"):
        missing[folder] = [n for n in names if not idx_file(folder, n)]
        if not missing[folder]:
            return folder
    folder, lacks = min(missing.items(), key=lambda item: len(item[1]))
    if len(lacks) < len(names):  # some are there: name the ones that are not
        fix = ("reinstall the package: sudo apt-get install --reinstall dataset-fashion-mnist"
               if folder == FASHION_MNIST_DIR else
               f"put {'it' if len(lacks) == 1 else 'them'} there beside the others ('sudo "
               f"apt-get install dataset-fashion-mnist' puts all four in {FASHION_MNIST_DIR})")
        raise UsageError(f"Fashion-MNIST in {folder} lacks "
                         f"{' and '.join(n + '(.gz)' for n in lacks)}: {fix}")
    how = ("install them with 'sudo apt-get install dataset-fashion-mnist' (they land in "
           f"{FASHION_MNIST_DIR}, read without --data-dir)" if root == FASHION_MNIST_DIR else
           f"put them in {root} (or drop --data-dir to read {FASHION_MNIST_DIR}, where 'sudo "
           f"apt-get install dataset-fashion-mnist' puts them)")
    raise UsageError(f"Fashion-MNIST's four files ({', '.join(n + '.gz' for n in names)}) are "
                     f"not in {root} nor in {root / 'FashionMNIST' / 'raw'}: {how}")


class GreyImages(Dataset):
    """A split of grey images held in memory as uint8 (Fashion-MNIST: 60,000 x 28 x 28 is
    47 MB), normalised per sample. ``channels`` 3 repeats the grey channel for models made
    for colour images. No augmentation: the published Fashion-MNIST results we compare with
    mostly use none."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: float, std: float,
                 channels: int):
        self.images, self.labels = images, labels.long()
        self.targets = self.labels.tolist()
        self.mean, self.std, self.channels = mean, std, channels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        x = (self.images[index].float().div_(255) - self.mean) / self.std
        return x.unsqueeze(0).expand(self.channels, -1, -1), self.labels[index]


def _fashion_mnist(args) -> DataBundle:
    """Fashion-MNIST from its four IDX files, read where they are: nothing is downloaded or
    written, so the package's read-only folder works as it is."""
    folder = find_fashion_mnist(Path(args.data_dir) if args.data_dir else FASHION_MNIST_DIR)
    (mean,), (std,) = NORMALIZE["fashion-mnist"]
    channels = grey_channels(args.model)
    splits = {}
    for split, (images_name, labels_name) in FASHION_MNIST_FILES.items():
        paths = [idx_file(folder, n) for n in (images_name, labels_name)]
        images, labels = read_idx(paths[0], ndim=3), read_idx(paths[1], ndim=1)
        if len(images) != len(labels):
            raise UsageError(f"{paths[0]} holds {len(images)} images and {paths[1]} "
                            f"{len(labels)} labels: one of them is from another release; "
                            f"reinstall the four files")
        splits[split] = GreyImages(images, labels, mean, std, channels)
    train, val = splits["train"], splits["val"]
    grey = "" if channels == 1 else ", the grey channel repeated 3 times for the model"
    return DataBundle(train, val, 10, (channels, 28, 28), "fashion-mnist",
                      f"Fashion-MNIST at {folder}: {len(train)} train / {len(val)} test, 10 "
                      f"classes{grey}")


class CachedSplit(Dataset):
    """A split decoded once into a memory-mapped uint8 array (N x 64 x 64 x 3) plus labels.

    Indexed with a whole batch of indices (the DataLoader gets a BatchSampler), so one numpy
    fancy-index read replaces a JPEG decode and a PIL transform per image.
    """

    def __init__(self, images_file, labels_file):
        self.images = np.load(images_file, mmap_mode="r")
        self.labels = torch.from_numpy(np.load(labels_file))
        self.targets = self.labels.tolist()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, indices):
        idx = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(np.ascontiguousarray(self.images[idx])), self.labels[idx]


class DeviceAugment:
    """What the folder path does per image with PIL, done per batch on the device: uint8 NHWC
    -> (train, with ``crop_flip``; synthetic data has none) random crop with 4 pixels of zero
    padding and a random horizontal flip -> float in [0, 1] -> (--image-size) resized ->
    normalize. Without augmentation the NCHW result
    keeps the NHWC memory (channels_last)."""

    def __init__(self, mean, std, size: int | None = None, crop_flip: bool = True):
        self.mean_std, self.size, self.crop_flip = (mean, std), size, crop_flip
        self._cache = {}

    def _stats(self, device):
        if device not in self._cache:  # made once per device, so the step copies nothing
            mean, std = self.mean_std
            self._cache[device] = (torch.tensor(mean, device=device).view(1, -1, 1, 1),
                                   torch.tensor(std, device=device).view(1, -1, 1, 1))
        return self._cache[device]

    def __call__(self, images: torch.Tensor, train: bool) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2)  # uint8 NCHW view: crop and flip 1-byte pixels
        if train and self.crop_flip:
            b, c, h, w = x.shape
            pad = CROP_PADDING
            x = F.pad(x, (pad, pad, pad, pad))  # zeros, as the folder path pads its images
            dy = torch.randint(0, 2 * pad + 1, (b, 1, 1, 1), device=x.device)
            dx = torch.randint(0, 2 * pad + 1, (b, 1, 1, 1), device=x.device)
            flip = torch.rand(b, 1, 1, 1, device=x.device) < 0.5
            rows = torch.arange(h, device=x.device).view(1, 1, h, 1) + dy
            x = x.gather(2, rows.expand(b, c, h, w + 2 * pad))  # crop rows
            cols = torch.arange(w, device=x.device).view(1, 1, 1, w)
            cols = torch.where(flip, w - 1 - cols, cols) + dx  # a flip is reversed columns
            x = x.gather(3, cols.expand(b, c, h, w))  # crop (and flip) columns
        x = x.float().div_(255)
        if self.size:
            x = resize(x, self.size)
        mean, std = self._stats(x.device)
        return (x - mean) / std


CACHE_BUILD_WAIT = timedelta(hours=6)  # how long ranks wait for their node's cache builder


def _cached_tinyimagenet(args, classes, train, val) -> DataBundle:
    """The memory-mapped cache that prepare_tinyimagenet.py writes. Where it is missing or
    stale, local rank 0 of each node builds it; the others wait in the all_gather below, on a
    group of its own that waits as long as a build takes (up to CACHE_BUILD_WAIT), not
    --dist-timeout, which a first build of the whole TinyImageNet can outlast."""
    error = None
    wait = None
    # (--simulate-world-size's fake process group has no peer to wait for)
    if rank_and_world()[1] > 1 and dist.get_backend() != "fake":
        # made by every rank before any build starts (making a group is itself a rendezvous)
        wait = dist.new_group(backend="gloo", timeout=CACHE_BUILD_WAIT, group_desc="cache_wait")
    if dist_env().local_rank == 0:  # one builder per node
        try:
            tinyimagenet.prepare(args.data_dir, args.data_cache, args.strict,
                                         max(1, args.num_workers),
                                         lambda m: print(m, flush=True),
                                         scanned=(classes, train, val))
        except UsageError as exc:
            error = str(exc)
    # every rank waits for each node's builder, and learns whether it failed
    raise_if_any_rank(error, group=wait)
    directory = tinyimagenet.cache_dir(args.data_dir, args.data_cache)
    train_set = CachedSplit(directory / "train_u8.npy", directory / "train_labels.npy")
    val_set = CachedSplit(directory / "val_u8.npy", directory / "val_labels.npy")
    return DataBundle(train_set, val_set, len(classes), input_shape(args)[0], "tinyimagenet",
                      f"TinyImageNet at {args.data_dir} via the uint8 cache {directory}: "
                      f"{len(train_set)} train / {len(val_set)} val, {len(classes)} classes"
                      f"{resized(args)}",
                      DeviceAugment(*NORMALIZE["tinyimagenet"], size=args.image_size))


def resized(args) -> str:
    """What --image-size adds to the data line."""
    if not args.image_size or args.image_size == 64:
        return ""
    return f", resized from 64x64 to {args.image_size}x{args.image_size}"


def build_data(args) -> DataBundle:
    """Train and val datasets for ``args.dataset``. Downloads (CIFAR-10, MNIST) run on rank 0
    first; call after the process group exists."""
    if args.dataset == "synthetic":
        shape, classes = input_shape(args)  # shaped for the model (and --image-size)
        n_val = max(1, args.synthetic_size // 4)
        return DataBundle(
            SyntheticImages(args.synthetic_size, shape, classes, args.seed, "train"),
            SyntheticImages(n_val, shape, classes, args.seed, "val"), classes, shape,
            "synthetic", f"synthetic (built-in, learnable; no dataset read): "
                         f"{args.synthetic_size} train / {n_val} val, {classes} classes, "
                         f"{'x'.join(map(str, shape))}",
            DeviceAugment(*NORMALIZE["synthetic"], crop_flip=False))
    if args.dataset == "tinyimagenet":
        if not args.data_dir:
            raise UsageError("--dataset tinyimagenet needs --data-dir (or $DATA_DIR) pointing "
                             "at the tiny-imagenet-200 folder")
        classes, train, val = tinyimagenet.scan_tinyimagenet(args.data_dir)
        if args.data_cache:
            return _cached_tinyimagenet(args, classes, train, val)
        return DataBundle(ImageList(train, args.strict, args.seed, args.image_size),
                          ImageList(val, args.strict, size=args.image_size), len(classes),
                          input_shape(args)[0], "tinyimagenet",
                          f"TinyImageNet at {args.data_dir}: {len(train)} train / {len(val)} "
                          f"val, {len(classes)} classes{resized(args)}")
    if args.dataset == "fashion-mnist":
        return _fashion_mnist(args)
    return _torchvision_data(args)


def describe(data: DataBundle, global_batch: int, made_of: str) -> None:
    """Rank 0 says what the run trains on. A global batch larger than the training set
    (made_of: how it is made, e.g. "64 per process x 4") is refused: no step could run."""
    if global_batch > len(data.train):
        more = " or raise --synthetic-size" if data.name == "synthetic" else ""
        raise UsageError(f"global batch {global_batch} ({made_of}) is larger than the "
                         f"{len(data.train)} training samples: lower --batch-size{more}")
    if data.name == "synthetic":
        print0("note: this run uses built-in synthetic data (--data-dir DIR for TinyImageNet): "
               "its numbers show the pipeline, not TinyImageNet accuracy")
    print0(f"data: {data.description}")
